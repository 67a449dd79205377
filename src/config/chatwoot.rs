//! `[helpdesk.chatwoot]`: the Chatwoot connector. Setting `url` turns it on; then the account,
//! the API inbox, an administrator's or agent bot's token and the inbox's webhook secret are all
//! it takes (docs/chatwoot.md).

use super::Secret;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The Chatwoot connector's settings.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ChatwootConfig {
    /// The installation's base address (`https://chat.example.com`); empty: no Chatwoot.
    pub url: String,
    pub account_id: u64,
    /// The API-channel inbox conversations are opened in (a bot may name another: `bots`).
    pub inbox_id: u64,
    /// An administrator's or an agent bot's access token (an agent's assigns to itself every
    /// conversation it opens). Also `HANDOFF_BRIDGE_CHATWOOT_API_TOKEN`, or `api_token_file`.
    pub api_token: Secret,
    pub api_token_file: String,
    /// The inbox's webhook secret (`X-Chatwoot-Signature`). Also
    /// `HANDOFF_BRIDGE_CHATWOOT_WEBHOOK_SECRET`, or `webhook_secret_file`.
    pub webhook_secret: Secret,
    pub webhook_secret_file: String,
    /// Pass Chatwoot's satisfaction survey (its link) to the user after a resolve.
    pub relay_csat: bool,
    /// Chatwoot before 4.13 signs nothing: a secret last path segment
    /// (`/helpdesk/chatwoot/webhook/<token>`) authenticates its deliveries instead. Empty (the
    /// default): unsigned deliveries are refused.
    pub unsigned_path_token: Secret,
    /// A private CA (PEM) trusted for an `https://` URL besides the platform's roots.
    pub ca_file: String,
    /// Per bot id: another inbox, a team, labels.
    pub bots: BTreeMap<String, ChatwootBot>,
}

/// One bot's own Chatwoot settings.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ChatwootBot {
    /// Its conversations open in this inbox instead of `inbox_id`.
    #[serde(default)]
    pub inbox_id: Option<u64>,
    /// Its conversations are assigned to this team.
    #[serde(default)]
    pub team_id: Option<u64>,
    /// Labels added to its conversations (besides the bot's and the platform's).
    #[serde(default)]
    pub labels: Vec<String>,
}

impl ChatwootConfig {
    /// Configured: the connector runs.
    pub fn enabled(&self) -> bool {
        !self.url.is_empty()
    }

    /// The inbox, team and labels of `bot`'s conversations.
    pub fn bot(&self, bot: Option<&str>) -> (u64, Option<u64>, &[String]) {
        match bot.and_then(|b| self.bots.get(b)) {
            Some(b) => (
                b.inbox_id.unwrap_or(self.inbox_id),
                b.team_id,
                b.labels.as_slice(),
            ),
            None => (self.inbox_id, None, &[]),
        }
    }

    /// The API token: `api_token` (or its variable), else the first line of `api_token_file`.
    pub fn resolve_api_token(&self) -> Result<Secret, String> {
        resolve(
            &self.api_token,
            &self.api_token_file,
            "helpdesk.chatwoot.api_token_file",
        )
    }

    /// The webhook secret: `webhook_secret` (or its variable), else `webhook_secret_file`'s.
    pub fn resolve_webhook_secret(&self) -> Result<Secret, String> {
        resolve(
            &self.webhook_secret,
            &self.webhook_secret_file,
            "helpdesk.chatwoot.webhook_secret_file",
        )
    }

    /// Semantic problems: (key, value shown, why). Secrets are never shown.
    pub fn problems(&self) -> Vec<(String, String, String)> {
        let mut p = Problems::default();
        if !self.enabled() {
            if !self.api_token.is_empty() || !self.webhook_secret.is_empty() || self.account_id != 0
            {
                p.add(
                    "url",
                    "(not set)",
                    "Chatwoot settings are given but no url: set it to the installation's base \
                     address (https://chat.example.com)",
                );
            }
            return p.0;
        }
        self.where_problems(&mut p);
        self.secret_problems(&mut p);
        self.bot_problems(&mut p);
        p.0
    }

    /// The address, the account and the inbox.
    fn where_problems(&self, p: &mut Problems) {
        match self.url.parse::<actix_web::http::Uri>() {
            // Credentials in the address would be shown in the console's links to Chatwoot.
            Ok(uri) if uri.authority().is_some_and(|a| a.as_str().contains('@')) => p.add(
                "url",
                &super::mask_url(&self.url),
                "must not carry credentials (user:password@): Chatwoot takes the token \
                 (api_token), and the address is shown in the console's links",
            ),
            Ok(uri)
                if matches!(uri.scheme_str(), Some("http" | "https"))
                    && uri.host().is_some()
                    && !self.url.ends_with('/')
                    && uri.query().is_none() => {}
            _ => p.add(
                "url",
                &super::mask_url(&self.url),
                "must be an http:// or https:// base address, without a trailing slash or query",
            ),
        }
        if self.account_id == 0 {
            p.add(
                "account_id",
                "0",
                "the account's id is required (1 or more)",
            );
        }
        if self.inbox_id == 0 {
            p.add(
                "inbox_id",
                "0",
                "the API inbox's id is required (1 or more)",
            );
        }
    }

    /// The token and the webhook secret (each once, inline or in a file), the path token.
    fn secret_problems(&self, p: &mut Problems) {
        for (key, secret, file, env) in [
            (
                "api_token",
                &self.api_token,
                &self.api_token_file,
                "HANDOFF_BRIDGE_CHATWOOT_API_TOKEN",
            ),
            (
                "webhook_secret",
                &self.webhook_secret,
                &self.webhook_secret_file,
                "HANDOFF_BRIDGE_CHATWOOT_WEBHOOK_SECRET",
            ),
        ] {
            if !secret.is_empty() && !file.is_empty() {
                p.add(
                    &format!("{key}_file"),
                    file,
                    &format!("give {key} or {key}_file, not both"),
                );
            }
            let unsigned = key == "webhook_secret" && !self.unsigned_path_token.is_empty();
            if secret.is_empty() && file.is_empty() && !unsigned {
                p.add(
                    key,
                    "(not set)",
                    &format!("required: set {key}, {env} or {key}_file"),
                );
            }
        }
        let token = self.unsigned_path_token.expose();
        if !token.is_empty()
            && (token.len() < 16
                || !token
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_'))
        {
            p.add(
                "unsigned_path_token",
                "****",
                "must be at least 16 characters of A-Z a-z 0-9 - _",
            );
        }
    }

    /// Each bot's inbox, team and labels.
    fn bot_problems(&self, p: &mut Problems) {
        for (bot, b) in &self.bots {
            if b.inbox_id == Some(0) {
                p.add(&format!("bots.{bot}.inbox_id"), "0", "must be 1 or more");
            }
            if b.team_id == Some(0) {
                p.add(&format!("bots.{bot}.team_id"), "0", "must be 1 or more");
            }
            for label in b.labels.iter().filter(|l| !valid_label(l)) {
                p.add(
                    &format!("bots.{bot}.labels"),
                    label,
                    "a label is 1 to 255 characters of letters, digits, - and _",
                );
            }
        }
    }
}

/// Problems of the section: (key under `helpdesk.chatwoot`, value shown, why).
#[derive(Default)]
struct Problems(Vec<(String, String, String)>);

impl Problems {
    fn add(&mut self, key: &str, value: &str, why: &str) {
        self.0.push((
            format!("helpdesk.chatwoot.{key}"),
            value.to_owned(),
            why.to_owned(),
        ));
    }
}

/// A Chatwoot label as its API takes it.
pub fn valid_label(label: &str) -> bool {
    !label.is_empty()
        && label.len() <= 255
        && label
            .chars()
            .all(|c| c.is_alphanumeric() || c == '-' || c == '_')
}

/// A secret given inline (or by its variable), else as a file's first line.
fn resolve(inline: &Secret, file: &str, key: &str) -> Result<Secret, String> {
    if !inline.is_empty() || file.is_empty() {
        return Ok(inline.clone());
    }
    let text = std::fs::read_to_string(file).map_err(|e| format!("{key} {file}: {e}"))?;
    let first = text.lines().next().unwrap_or_default().trim();
    if first.is_empty() {
        return Err(format!("{key} {file}: the file is empty"));
    }
    Ok(Secret::new(first))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn configured() -> ChatwootConfig {
        ChatwootConfig {
            url: "https://chat.example.com".into(),
            account_id: 1,
            inbox_id: 7,
            api_token: Secret::new("tok-0123456789"),
            api_token_file: String::new(),
            webhook_secret: Secret::new("whs-0123456789"),
            webhook_secret_file: String::new(),
            relay_csat: false,
            unsigned_path_token: Secret::default(),
            ca_file: String::new(),
            bots: BTreeMap::new(),
        }
    }

    #[test]
    fn a_complete_section_has_no_problem_and_a_bot_may_name_its_own_inbox() {
        let mut c = configured();
        assert!(c.problems().is_empty(), "{:?}", c.problems());
        c.bots.insert(
            "B1".into(),
            ChatwootBot {
                inbox_id: Some(9),
                team_id: Some(2),
                labels: vec!["vip".into()],
            },
        );
        assert_eq!(c.bot(Some("B1")), (9, Some(2), &["vip".to_owned()][..]));
        assert_eq!(c.bot(Some("B2")), (7, None, &[][..]));
    }

    #[test]
    fn every_problem_is_listed_and_no_secret_is_shown() {
        let mut c = configured();
        c.url = "ftp://chat.example.com/".into();
        c.account_id = 0;
        c.api_token = Secret::default();
        c.webhook_secret_file = "/run/secret".into();
        c.unsigned_path_token = Secret::new("short");
        c.bots.insert(
            "B1".into(),
            ChatwootBot {
                inbox_id: Some(0),
                team_id: None,
                labels: vec!["no spaces".into()],
            },
        );
        let keys: Vec<String> = c.problems().into_iter().map(|(k, _, _)| k).collect();
        assert_eq!(
            keys,
            [
                "helpdesk.chatwoot.url",
                "helpdesk.chatwoot.account_id",
                "helpdesk.chatwoot.api_token",
                "helpdesk.chatwoot.webhook_secret_file",
                "helpdesk.chatwoot.unsigned_path_token",
                "helpdesk.chatwoot.bots.B1.inbox_id",
                "helpdesk.chatwoot.bots.B1.labels",
            ]
        );
        let shown = format!("{:?}", c.problems());
        assert!(!shown.contains("whs-0123456789") && !shown.contains("short"));
    }

    #[test]
    fn a_url_carrying_credentials_is_refused_and_not_shown() {
        for url in [
            "https://admin:hunter2-secret@chat.example.com",
            "https://token-secret@chat.example.com",
        ] {
            let mut c = configured();
            c.url = url.into();
            let problems = c.problems();
            assert_eq!(problems.len(), 1, "{problems:?}");
            let (key, shown, why) = &problems[0];
            assert_eq!(key, "helpdesk.chatwoot.url");
            assert!(why.contains("credentials"), "{why}");
            assert!(!shown.contains("secret"), "{shown}");
        }
    }

    #[test]
    fn settings_without_a_url_are_refused_and_none_is_off() {
        let mut c = configured();
        c.url.clear();
        assert_eq!(c.problems()[0].0, "helpdesk.chatwoot.url");
        c.api_token = Secret::default();
        c.webhook_secret = Secret::default();
        c.account_id = 0;
        assert!(c.problems().is_empty());
        assert!(!c.enabled());
    }

    #[test]
    fn an_unsigned_path_token_stands_in_for_the_secret() {
        let mut c = configured();
        c.webhook_secret = Secret::default();
        assert_eq!(c.problems()[0].0, "helpdesk.chatwoot.webhook_secret");
        c.unsigned_path_token = Secret::new("path-token-0123456789");
        assert!(c.problems().is_empty());
    }

    #[test]
    fn a_secret_file_gives_its_first_line() {
        let dir = tempfile::tempdir().expect("tmp");
        let file = dir.path().join("token");
        std::fs::write(&file, "from-file-token\nignored\n").expect("write");
        let mut c = configured();
        c.api_token = Secret::default();
        c.api_token_file = file.display().to_string();
        assert_eq!(
            c.resolve_api_token().expect("token").expose(),
            "from-file-token"
        );
        std::fs::write(&file, "\n").expect("write");
        assert!(c.resolve_api_token().is_err());
    }
}
