//! The console as a browser without JavaScript sees it: a cookie jar, forms posted, no redirect
//! followed (each is checked). Shared by the console's tests and the connectors' (a dead letter
//! retried from the console).

use std::collections::HashMap;
use std::time::Duration;

/// A browser without JavaScript: a cookie jar, no redirects followed (each is checked).
pub struct Browser {
    pub base: String,
    pub agent: ureq::Agent,
    pub cookies: HashMap<String, String>,
}

pub struct Page {
    pub status: u16,
    pub headers: HashMap<String, Vec<String>>,
    pub body: String,
}

impl Page {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .get(name)
            .and_then(|v| v.first())
            .map(String::as_str)
    }

    /// The value of the first hidden field `name` (`key` fields by their prefix).
    pub fn field(&self, name: &str, prefix: &str) -> String {
        let marker = format!("name=\"{name}\" value=\"{prefix}");
        let at = self.body.find(&marker).unwrap_or_else(|| {
            panic!("no field {name} ({prefix}) in:\n{}", self.body);
        });
        let rest = &self.body[at + marker.len() - prefix.len()..];
        rest[..rest.find('"').expect("end of value")].to_owned()
    }
}

impl Browser {
    pub fn new(app: &super::TestApp) -> Browser {
        Browser {
            base: app.admin_base.clone(),
            agent: ureq::Agent::config_builder()
                .http_status_as_error(false)
                .max_redirects(0)
                .timeout_global(Some(Duration::from_secs(30)))
                .build()
                .into(),
            cookies: HashMap::new(),
        }
    }

    pub fn cookie_header(&self) -> String {
        self.cookies
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join("; ")
    }

    pub fn keep(&mut self, resp: ureq::http::Response<ureq::Body>) -> Page {
        let mut headers: HashMap<String, Vec<String>> = HashMap::new();
        for (name, value) in resp.headers() {
            let value = value.to_str().unwrap_or_default().to_owned();
            headers
                .entry(name.as_str().to_owned())
                .or_default()
                .push(value);
        }
        for set in headers.get("set-cookie").into_iter().flatten() {
            let pair = set.split(';').next().unwrap_or_default();
            if let Some((k, v)) = pair.split_once('=') {
                if v.is_empty() || set.contains("Max-Age=0") {
                    self.cookies.remove(k);
                } else {
                    self.cookies.insert(k.to_owned(), v.to_owned());
                }
            }
        }
        let status = resp.status().as_u16();
        let body = resp.into_body().read_to_string().unwrap_or_default();
        Page {
            status,
            headers,
            body,
        }
    }

    pub fn get(&mut self, path: &str) -> Page {
        let resp = self
            .agent
            .get(format!("{}{path}", self.base))
            .header("cookie", self.cookie_header())
            .call()
            .expect("GET");
        self.keep(resp)
    }

    pub fn post(&mut self, path: &str, fields: &[(&str, &str)]) -> Page {
        let enc = |s: &str| {
            percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string()
        };
        let body = fields
            .iter()
            .map(|(k, v)| format!("{}={}", enc(k), enc(v)))
            .collect::<Vec<_>>()
            .join("&");
        let resp = self
            .agent
            .post(format!("{}{path}", self.base))
            .header("cookie", self.cookie_header())
            .header("content-type", "application/x-www-form-urlencoded")
            .send(body)
            .expect("POST");
        self.keep(resp)
    }

    /// Sign in with `token` as `name`; the answer to the form.
    pub fn sign_in(&mut self, token: &str, name: &str) -> Page {
        let form = self.get("/console/sign-in");
        assert_eq!(form.status, 200);
        let form_token = form.field("form", "");
        self.post(
            "/console/sign-in",
            &[("token", token), ("name", name), ("form", &form_token)],
        )
    }
}
