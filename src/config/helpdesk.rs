//! `[helpdesk]`: the agent API's settings and where help-desk events go.

use super::Secret;
use ipnet::IpNet;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::Duration;

/// The help desk: its agent API (inbound) and its event endpoints (outbound).
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct HelpdeskConfig {
    /// Bearer tokens of the agent API; several at once for rotation. Empty: the API answers 503
    /// `helpdesk_api_disabled` (nothing is generated: a help desk is set up on purpose).
    pub tokens: Vec<Secret>,
    /// Source addresses allowed to call the agent API (403 `forbidden` to others, before the
    /// token is looked at); empty allows any, like `webhook.allow_cidrs`.
    pub allow_cidrs: Vec<IpNet>,
    /// How long the first answer to an `Idempotency-Key` is kept.
    #[serde(with = "humantime_serde")]
    pub idempotency_retention: Duration,
    /// How long a mutating call waits for its command's verdict (then 504 `command_pending`).
    #[serde(with = "humantime_serde")]
    pub command_timeout: Duration,
    /// Mutating calls waiting for their verdict at once; more are answered 503
    /// `too_many_pending` (each holds a connection and a waiter while the fold is behind).
    pub max_pending_commands: usize,
    /// Messages of the transcript `GET /conversations/{id}` shows and a `handoff.requested`
    /// event carries (the newest, read from the Open API; 0: none).
    pub transcript_messages: u32,
    /// Where a release without a flow sends the conversation: a flow id (digits) or title; empty
    /// leaves it where it is.
    pub release_flow: String,
    pub partner: PartnerConfig,
    /// Where help-desk events go. None: events are recorded as done without a call, so rules can
    /// send them before a help desk is connected.
    pub endpoints: Vec<HelpdeskEndpoint>,
    /// Send the bot's messages as `conversation.message` too (the user's always go).
    pub bot_messages: bool,
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
    /// One delivery attempt, answer included.
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
    /// The Chatwoot connector (off without its `url`).
    pub chatwoot: super::chatwoot::ChatwootConfig,
}

/// Partner-messenger counseling channels, so agents address users by conversation, not by
/// channel keys.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PartnerConfig {
    /// The channel of bots not in `bots`; empty: none.
    pub default_sender_key: String,
    /// Bot id -> its channel's `senderKey`.
    pub bots: BTreeMap<String, String>,
}

impl PartnerConfig {
    /// The `senderKey` of a bot's channel.
    pub fn sender_key(&self, bot: Option<&str>) -> Option<&str> {
        bot.and_then(|b| self.bots.get(b))
            .map(String::as_str)
            .or(Some(self.default_sender_key.as_str()))
            .filter(|k| !k.is_empty())
    }
}

/// One help desk (or one of its webhooks).
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct HelpdeskEndpoint {
    /// Names the endpoint in logs and metrics (the URL may carry credentials).
    pub name: String,
    /// A `Secret`: it may carry credentials (`http://user:password@...`), so it is masked in
    /// `Debug`, `check` output and errors like the signing secrets.
    pub url: Secret,
    /// Standard Webhooks secrets (`whsec_` + base64); each signs, so several allow rotation.
    pub secrets: Vec<Secret>,
    /// Event kinds sent here: names, families (`handoff.*`) or `*`.
    #[serde(default = "all_events")]
    pub events: Vec<String>,
    /// A private CA (PEM, one or more certificates) trusted for this endpoint's `https://` URL,
    /// besides the platform's roots. Empty: the platform's roots only.
    #[serde(default)]
    pub ca_file: String,
}

fn all_events() -> Vec<String> {
    vec!["*".to_owned()]
}

impl HelpdeskConfig {
    /// A desk events go to: an endpoint, or Chatwoot.
    pub fn has_desk(&self) -> bool {
        !self.endpoints.is_empty() || self.chatwoot.enabled()
    }

    /// Semantic problems: (key, value shown, why).
    pub fn problems(&self) -> Vec<(String, String, String)> {
        let mut p = Vec::new();
        for (i, t) in self.tokens.iter().enumerate() {
            if t.expose().len() < 16 || !t.expose().chars().all(|c| c.is_ascii_graphic()) {
                p.push((
                    format!("helpdesk.tokens[{i}]"),
                    "****".into(),
                    "must be at least 16 visible ASCII characters".into(),
                ));
            }
        }
        if self.idempotency_retention < Duration::from_secs(60) {
            p.push((
                "helpdesk.idempotency_retention".into(),
                humantime::format_duration(self.idempotency_retention).to_string(),
                "must be at least 1m".into(),
            ));
        }
        if self.command_timeout.is_zero() || self.command_timeout > Duration::from_secs(300) {
            p.push((
                "helpdesk.command_timeout".into(),
                humantime::format_duration(self.command_timeout).to_string(),
                "must be more than 0 and at most 5m".into(),
            ));
        }
        if self.max_pending_commands == 0 || self.max_pending_commands > 100_000 {
            p.push((
                "helpdesk.max_pending_commands".into(),
                self.max_pending_commands.to_string(),
                "must be 1..=100000".into(),
            ));
        }
        if self.transcript_messages > 100 {
            p.push((
                "helpdesk.transcript_messages".into(),
                self.transcript_messages.to_string(),
                "must be 0..=100 (one page of the Open API)".into(),
            ));
        }
        p.extend(self.chatwoot.problems());
        for (bot, key) in &self.partner.bots {
            if key.is_empty() {
                p.push((
                    format!("helpdesk.partner.bots.{bot}"),
                    String::new(),
                    "a senderKey must not be empty".into(),
                ));
            }
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bot_uses_its_own_channel_else_the_default_else_none() {
        let mut partner = PartnerConfig {
            default_sender_key: String::new(),
            bots: BTreeMap::from([("B1".to_owned(), "sk-1".to_owned())]),
        };
        assert_eq!(partner.sender_key(Some("B1")), Some("sk-1"));
        assert_eq!(partner.sender_key(Some("B2")), None);
        partner.default_sender_key = "sk-default".into();
        assert_eq!(partner.sender_key(Some("B2")), Some("sk-default"));
        assert_eq!(partner.sender_key(None), Some("sk-default"));
    }
}
