//! Console sign-ins: a session per browser, kept in memory (a restart signs everyone out), named
//! by a random id in an `HttpOnly`, `SameSite=Strict` cookie (`Secure` over TLS), expiring after
//! `admin.console_session`. Each session carries its role, the name its person gave and a CSRF
//! token that every state-changing form sends back. The sign-in form itself is guarded by a
//! short-lived cookie of its own holding the token its form carries (double submit).

use actix_web::cookie::{time, Cookie, SameSite};
use actix_web::HttpRequest;
use rand::distr::{Alphanumeric, SampleString};
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use subtle::ConstantTimeEq;

/// The session cookie.
pub const COOKIE: &str = "hb_console";
/// The sign-in form's own cookie (its CSRF token before there is a session).
pub const SIGN_IN_COOKIE: &str = "hb_console_sign_in";
/// Where the cookies are sent.
const PATH: &str = "/console";
/// Sessions held at most: a sign-in beyond it drops the expired ones first, then is refused.
const MAX_SESSIONS: usize = 10_000;
/// How long a sign-in form stays valid.
const SIGN_IN_FORM_TTL: Duration = Duration::from_secs(30 * 60);
/// The longest name a person may give.
pub const MAX_NAME: usize = 64;

/// What a signed-in person may do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum Role {
    /// Signed in with the admin token: sees everything and acts.
    Operator,
    /// Signed in with one of `admin.viewer_tokens`: sees everything, changes nothing.
    Viewer,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

/// One signed-in browser.
#[derive(Clone, Debug)]
pub struct Session {
    pub role: Role,
    /// The name the person gave at sign-in (goes with each of their actions).
    pub name: String,
    /// Sent back by every state-changing form of this session.
    pub csrf: String,
    expires: Instant,
}

impl Session {
    /// Whether `token` is this session's CSRF token (compared in constant time).
    pub fn csrf_ok(&self, token: &str) -> bool {
        self.csrf.as_bytes().ct_eq(token.as_bytes()).into()
    }
}

/// Why a sign-in was refused.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum SignInError {
    #[error("the token is not valid for the console")]
    BadToken,
    #[error("give your name (1 to {MAX_NAME} characters): it goes with every action you take")]
    BadName,
    #[error("the sign-in form expired or came from elsewhere; sign in again")]
    Form,
    #[error("too many people are signed in; try again later")]
    Full,
}

/// The sessions of this daemon.
pub struct Sessions {
    ttl: Duration,
    live: Mutex<HashMap<String, Session>>,
}

impl Sessions {
    pub fn new(ttl: Duration) -> Self {
        Sessions {
            ttl,
            live: Mutex::new(HashMap::new()),
        }
    }

    /// A new session for `name` as `role`; returns its id.
    pub fn open(&self, role: Role, name: &str) -> Result<String, SignInError> {
        let name = name.trim();
        if name.is_empty() || name.chars().count() > MAX_NAME || name.chars().any(char::is_control)
        {
            return Err(SignInError::BadName);
        }
        let mut live = self.lock();
        if live.len() >= MAX_SESSIONS {
            let now = Instant::now();
            live.retain(|_, s| s.expires > now);
        }
        if live.len() >= MAX_SESSIONS {
            return Err(SignInError::Full);
        }
        let id = random_token();
        let session = Session {
            role,
            name: name.to_owned(),
            csrf: random_token(),
            expires: Instant::now() + self.ttl,
        };
        live.insert(id.clone(), session);
        Ok(id)
    }

    /// The session the request's cookie names, unless it expired (then it is forgotten).
    pub fn of_request(&self, req: &HttpRequest) -> Option<Session> {
        let id = req.cookie(COOKIE)?;
        let mut live = self.lock();
        let session = live.get(id.value())?;
        if session.expires <= Instant::now() {
            live.remove(id.value());
            return None;
        }
        Some(session.clone())
    }

    /// Sign the request's session out.
    pub fn close(&self, req: &HttpRequest) {
        if let Some(id) = req.cookie(COOKIE) {
            self.lock().remove(id.value());
        }
    }

    /// The session cookie for `id`.
    pub fn cookie(&self, id: String, secure: bool) -> Cookie<'static> {
        let max_age = time::Duration::seconds(i64::try_from(self.ttl.as_secs()).unwrap_or(0));
        base_cookie(COOKIE, id, secure).max_age(max_age).finish()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Session>> {
        match self.live.lock() {
            Ok(live) => live,
            Err(poisoned) => poisoned.into_inner(),
        }
    }
}

/// A cookie that ends a session (or a sign-in form) in the browser.
pub fn removal(name: &'static str, secure: bool) -> Cookie<'static> {
    let mut cookie = base_cookie(name, String::new(), secure).finish();
    cookie.make_removal();
    cookie
}

/// A sign-in form's token and its cookie.
pub fn sign_in_form(secure: bool) -> (String, Cookie<'static>) {
    let token = random_token();
    let max_age = time::Duration::seconds(SIGN_IN_FORM_TTL.as_secs() as i64);
    let cookie = base_cookie(SIGN_IN_COOKIE, token.clone(), secure)
        .max_age(max_age)
        .finish();
    (token, cookie)
}

/// Whether a sign-in form's token is the one its cookie holds.
pub fn sign_in_form_ok(req: &HttpRequest, token: &str) -> bool {
    req.cookie(SIGN_IN_COOKIE).is_some_and(|c| {
        !token.is_empty() && bool::from(c.value().as_bytes().ct_eq(token.as_bytes()))
    })
}

fn base_cookie(
    name: &'static str,
    value: String,
    secure: bool,
) -> actix_web::cookie::CookieBuilder<'static> {
    Cookie::build(name, value)
        .path(PATH)
        .http_only(true)
        .same_site(SameSite::Strict)
        .secure(secure)
}

/// 32 random letters and digits (about 190 bits).
pub fn random_token() -> String {
    Alphanumeric.sample_string(&mut rand::rng(), 32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use actix_web::test::TestRequest;

    #[test]
    fn a_session_is_found_by_its_cookie_until_it_expires_or_is_closed() {
        let sessions = Sessions::new(Duration::from_secs(60));
        let id = sessions.open(Role::Viewer, "  Kim ").expect("open");
        let req = TestRequest::default()
            .cookie(Cookie::new(COOKIE, id.clone()))
            .to_http_request();
        let session = sessions.of_request(&req).expect("signed in");
        assert_eq!((session.role, session.name.as_str()), (Role::Viewer, "Kim"));
        assert!(session.csrf_ok(&session.csrf.clone()));
        assert!(!session.csrf_ok("forged"));
        assert!(!session.csrf_ok(""));
        sessions.close(&req);
        assert!(sessions.of_request(&req).is_none());

        let gone = Sessions::new(Duration::ZERO);
        let id = gone.open(Role::Operator, "Lee").expect("open");
        let req = TestRequest::default()
            .cookie(Cookie::new(COOKIE, id))
            .to_http_request();
        assert!(gone.of_request(&req).is_none(), "expired at once");
    }

    #[test]
    fn a_name_is_required_short_and_printable() {
        let sessions = Sessions::new(Duration::from_secs(60));
        for bad in ["", "   ", "a\u{7}b", &"x".repeat(MAX_NAME + 1)] {
            assert_eq!(
                sessions.open(Role::Operator, bad),
                Err(SignInError::BadName),
                "{bad:?}"
            );
        }
        assert!(sessions.open(Role::Operator, &"x".repeat(MAX_NAME)).is_ok());
    }

    #[test]
    fn cookies_are_http_only_strict_and_scoped_to_the_console() {
        let sessions = Sessions::new(Duration::from_secs(3600));
        let plain = sessions.cookie("id".into(), false);
        assert_eq!(plain.http_only(), Some(true));
        assert_eq!(plain.same_site(), Some(SameSite::Strict));
        assert_eq!(plain.path(), Some(PATH));
        assert_eq!(plain.secure(), Some(false));
        assert_eq!(plain.max_age(), Some(time::Duration::seconds(3600)));
        assert_eq!(sessions.cookie("id".into(), true).secure(), Some(true));
        let removed = removal(COOKIE, false);
        assert_eq!(removed.value(), "");
        assert_eq!(removed.max_age(), Some(time::Duration::ZERO));
    }

    #[test]
    fn a_sign_in_form_is_accepted_only_with_its_own_cookie() {
        let (token, cookie) = sign_in_form(false);
        let with = TestRequest::default().cookie(cookie).to_http_request();
        assert!(sign_in_form_ok(&with, &token));
        assert!(!sign_in_form_ok(&with, "other"));
        assert!(!sign_in_form_ok(&with, ""));
        let without = TestRequest::default().to_http_request();
        assert!(!sign_in_form_ok(&without, &token));
    }
}
