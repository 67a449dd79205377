//! The emulator's starting data: a JSON file of bots, flows, end users, conversations, messages,
//! partner-messenger channels and notification templates. Checked on load, with every problem
//! reported together, so a bad seed fails at start rather than as a puzzling 404 in a test.
//!
//! The default seed (`deploy/emulator-seed.json`, embedded) knows every bot, end user and
//! conversation the shared webhook fixtures refer to.

use super::validate;
use model::clock::parse_iso_millis;
use model::contract::{ChannelSetting, Flow, PbStatus};
use model::ids::{BotId, ConversationId, EndUserId};
use model::webhook::model::{Bot, Conversation, EndUser, Message, Millis, Navigation, Platform};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::Path;

/// The embedded default seed.
pub const DEFAULT_SEED: &str = include_str!("../../../deploy/emulator-seed.json");

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Seed {
    pub bots: Vec<Bot>,
    /// Flows by bot id. Every flow needs at least one node (navigation without `nodeId` goes to
    /// the first).
    #[serde(default)]
    pub flows: BTreeMap<BotId, Vec<Flow>>,
    #[serde(default)]
    pub end_users: Vec<EndUser>,
    /// Each needs `botId`, `endUserId`, `createdAt` and `updatedAt`; `platform` and `userKey`
    /// default to the end user's. `context.manual.status = "HANDOVER"` starts it in manual mode.
    #[serde(default)]
    pub conversations: Vec<Conversation>,
    /// Each needs a `timestamp`.
    #[serde(default)]
    pub messages: Vec<Message>,
    #[serde(default)]
    pub channels: Vec<SeedChannel>,
    #[serde(default)]
    pub templates: Vec<SeedTemplate>,
}

/// A partner-messenger counseling channel.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SeedChannel {
    pub sender_key: String,
    pub bot_id: BotId,
    /// Its users: each is the `userKey` of a `kakaobiz` end user of `botId`.
    pub user_keys: Vec<String>,
    #[serde(default)]
    pub setting: ChannelSetting,
    /// Starting counseling state of some users. The others start `waiting`, unblocked, without a
    /// session.
    #[serde(default)]
    pub conversations: Vec<SeedPbConversation>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SeedPbConversation {
    pub user_key: String,
    #[serde(default)]
    pub status: Option<PbStatus>,
    #[serde(default)]
    pub assignee: Option<String>,
    #[serde(default)]
    pub memo: Option<String>,
    #[serde(default)]
    pub blocked: bool,
    #[serde(default)]
    pub blocked_at: Option<Millis>,
    /// Set: the user has an active session that started then.
    #[serde(default)]
    pub session_started_at: Option<Millis>,
    #[serde(default)]
    pub updated_at: Option<Millis>,
}

/// A notification template. `variables` must name exactly the `#{name}` placeholders of `text`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SeedTemplate {
    pub sender_key: String,
    pub code: String,
    pub text: String,
    pub variables: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum SeedError {
    #[error("cannot read seed file {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("seed is not valid JSON for the seed format: {0}")]
    Parse(#[from] serde_json::Error),
    #[error("seed is invalid:\n  - {}", .0.join("\n  - "))]
    Invalid(Vec<String>),
}

impl Seed {
    /// The embedded default seed (checked like any other).
    pub fn default_seed() -> Result<Seed, SeedError> {
        Seed::from_json(DEFAULT_SEED)
    }

    pub fn from_json(text: &str) -> Result<Seed, SeedError> {
        let seed: Seed = serde_json::from_str(text)?;
        seed.validate()?;
        Ok(seed)
    }

    pub fn load(path: &Path) -> Result<Seed, SeedError> {
        let text = std::fs::read_to_string(path).map_err(|source| SeedError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Seed::from_json(&text)
    }

    /// Every cross-reference and bound; all problems at once.
    pub fn validate(&self) -> Result<(), SeedError> {
        let mut problems = Vec::new();
        let bots = self.check_bots(&mut problems);
        self.check_flows(&bots, &mut problems);
        let end_users = self.check_end_users(&bots, &mut problems);
        let conversations = self.check_conversations(&bots, &end_users, &mut problems);
        self.check_messages(&conversations, &mut problems);
        let senders = self.check_channels(&bots, &mut problems);
        self.check_templates(&senders, &mut problems);
        if problems.is_empty() {
            Ok(())
        } else {
            Err(SeedError::Invalid(problems))
        }
    }

    /// Bot ids are unique; answers the set of them.
    fn check_bots(&self, p: &mut Vec<String>) -> HashSet<&BotId> {
        let mut bots = HashSet::new();
        for bot in &self.bots {
            if !bots.insert(&bot.id) {
                p.push(format!("bots: id {} appears twice", bot.id));
            }
        }
        bots
    }

    /// Flows belong to known bots, flow ids are unique per bot, and each flow has nodes with
    /// unique ids.
    fn check_flows(&self, bots: &HashSet<&BotId>, p: &mut Vec<String>) {
        for (bot_id, flows) in &self.flows {
            if !bots.contains(bot_id) {
                p.push(format!("flows: bot {bot_id} is not in `bots`"));
            }
            let mut ids = HashSet::new();
            for flow in flows {
                if !ids.insert(flow.id) {
                    p.push(format!("flows of {bot_id}: flow {} appears twice", flow.id));
                }
                if flow.nodes.is_empty() {
                    p.push(format!("flows of {bot_id}: flow {} has no nodes", flow.id));
                }
                let mut nodes = HashSet::new();
                for node in &flow.nodes {
                    if !nodes.insert(node.id) {
                        p.push(format!(
                            "flows of {bot_id}: flow {} has node {} twice",
                            flow.id, node.id
                        ));
                    }
                }
            }
        }
    }

    /// End users are unique, belong to known bots, are unique per (bot, platform, userKey) and
    /// have valid user keys; answers them by id.
    fn check_end_users(
        &self,
        bots: &HashSet<&BotId>,
        p: &mut Vec<String>,
    ) -> HashMap<&EndUserId, &EndUser> {
        let mut end_users: HashMap<&EndUserId, &EndUser> = HashMap::new();
        let mut natural = HashSet::new();
        for eu in &self.end_users {
            let at = format!("endUsers: {}", eu.id);
            if end_users.insert(&eu.id, eu).is_some() {
                p.push(format!("{at} appears twice"));
            }
            match &eu.bot_id {
                None => p.push(format!("{at} has no botId")),
                Some(b) if !bots.contains(b) => p.push(format!("{at}: bot {b} is not in `bots`")),
                Some(b) => {
                    if !natural.insert((b, eu.platform.as_str(), eu.user_key.as_str())) {
                        p.push(format!(
                            "{at}: ({}, {}) is already used by another end user of {b}",
                            eu.platform, eu.user_key
                        ));
                    }
                }
            }
            if let Err(e) = validate::user_key(eu.user_key.as_str(), "userKey") {
                p.push(format!("{at}: {e}"));
            }
        }
        end_users
    }

    /// Conversations are unique and each passes [`Seed::check_conversation`]; answers them by id.
    fn check_conversations(
        &self,
        bots: &HashSet<&BotId>,
        end_users: &HashMap<&EndUserId, &EndUser>,
        p: &mut Vec<String>,
    ) -> HashMap<&ConversationId, &Conversation> {
        let mut conversations: HashMap<&ConversationId, &Conversation> = HashMap::new();
        for c in &self.conversations {
            let at = format!("conversations: {}", c.id);
            if conversations.insert(&c.id, c).is_some() {
                p.push(format!("{at} appears twice"));
            }
            self.check_conversation(c, &at, bots, end_users, p);
        }
        conversations
    }

    /// One conversation: a known bot, an end user of that bot it agrees with, both times, and
    /// navigation to nodes that exist in the bot's flows.
    fn check_conversation(
        &self,
        c: &Conversation,
        at: &str,
        bots: &HashSet<&BotId>,
        end_users: &HashMap<&EndUserId, &EndUser>,
        p: &mut Vec<String>,
    ) {
        let Some(bot_id) = &c.bot_id else {
            p.push(format!("{at} has no botId"));
            return;
        };
        if !bots.contains(bot_id) {
            p.push(format!("{at}: bot {bot_id} is not in `bots`"));
        }
        match c.end_user_id.as_ref().map(|id| (id, end_users.get(id))) {
            None => p.push(format!("{at} has no endUserId")),
            Some((id, None)) => p.push(format!("{at}: end user {id} is not in `endUsers`")),
            Some((id, Some(eu))) => {
                if eu.bot_id.as_ref() != Some(bot_id) {
                    p.push(format!("{at}: end user {id} belongs to another bot"));
                }
                if c.platform.as_ref().is_some_and(|pl| *pl != eu.platform) {
                    p.push(format!("{at}: platform differs from end user {id}'s"));
                }
                if c.user_key.as_ref().is_some_and(|k| *k != eu.user_key) {
                    p.push(format!("{at}: userKey differs from end user {id}'s"));
                }
            }
        }
        for (name, value) in [("createdAt", &c.created_at), ("updatedAt", &c.updated_at)] {
            match value.as_deref().map(parse_iso_millis) {
                None => p.push(format!("{at} has no {name}")),
                Some(Err(e)) => p.push(format!("{at}: {name} {e}")),
                Some(Ok(_)) => {}
            }
        }
        let flows = self.flows.get(bot_id).map(Vec::as_slice).unwrap_or(&[]);
        let navs = [
            Some(("navigation", c.navigation.as_ref())),
            c.context
                .as_ref()
                .map(|ctx| ("context.navigation", ctx.navigation.as_ref())),
        ];
        for (name, nav) in navs.into_iter().flatten() {
            if let Some(nav) = nav {
                if let Err(e) = navigation_exists(nav, flows) {
                    p.push(format!("{at}: {name}: {e}"));
                }
            }
        }
    }

    /// Messages are unique, in known conversations (with the same end user), timestamped and
    /// with valid data.
    fn check_messages(
        &self,
        conversations: &HashMap<&ConversationId, &Conversation>,
        p: &mut Vec<String>,
    ) {
        let mut message_ids = HashSet::new();
        for m in &self.messages {
            let at = format!("messages: {}", m.id);
            if !message_ids.insert(m.id.as_str()) {
                p.push(format!("{at} appears twice"));
            }
            match conversations.get(&m.conversation_id) {
                None => p.push(format!(
                    "{at}: conversation {} is not in `conversations`",
                    m.conversation_id
                )),
                Some(c) => {
                    if m.end_user_id.is_some() && m.end_user_id != c.end_user_id {
                        p.push(format!("{at}: endUserId differs from its conversation's"));
                    }
                }
            }
            if m.timestamp.is_none() {
                p.push(format!("{at} has no timestamp"));
            }
            if let Err(e) = validate::message_data(&m.data, "data") {
                p.push(format!("{at}: {e}"));
            }
        }
    }

    /// Channels have unique, non-empty sender keys, known bots, valid users and counseling
    /// states, and a valid setting; answers their sender keys.
    fn check_channels(&self, bots: &HashSet<&BotId>, p: &mut Vec<String>) -> HashSet<&str> {
        let mut senders = HashSet::new();
        for ch in &self.channels {
            let at = format!("channels: {}", ch.sender_key);
            if ch.sender_key.is_empty() {
                p.push("channels: a senderKey is empty".to_owned());
            }
            if !senders.insert(ch.sender_key.as_str()) {
                p.push(format!("{at} appears twice"));
            }
            if !bots.contains(&ch.bot_id) {
                p.push(format!("{at}: bot {} is not in `bots`", ch.bot_id));
            }
            let keys = self.check_channel_users(ch, &at, p);
            check_channel_conversations(ch, &at, &keys, p);
            if let Err(e) = validate::channel_setting(&ch.setting) {
                p.push(format!("{at}: setting: {e}"));
            }
        }
        senders
    }

    /// A channel's user keys are unique and each is a `kakaobiz` end user of the channel's bot;
    /// answers the keys.
    fn check_channel_users<'a>(
        &self,
        ch: &'a SeedChannel,
        at: &str,
        p: &mut Vec<String>,
    ) -> BTreeSet<&'a str> {
        let mut keys = BTreeSet::new();
        for key in &ch.user_keys {
            if !keys.insert(key.as_str()) {
                p.push(format!("{at}: userKey {key} appears twice"));
            }
            let known = self.end_users.iter().any(|eu| {
                eu.bot_id.as_ref() == Some(&ch.bot_id)
                    && eu.platform == Platform::Kakaobiz
                    && eu.user_key.as_str() == key
            });
            if !known {
                p.push(format!(
                    "{at}: userKey {key} is not a kakaobiz end user of {}",
                    ch.bot_id
                ));
            }
        }
        keys
    }

    /// Templates name a known channel, have a non-empty code unique per sender, and declare
    /// exactly the placeholders of their text, each once.
    fn check_templates(&self, senders: &HashSet<&str>, p: &mut Vec<String>) {
        let mut codes = HashSet::new();
        for t in &self.templates {
            let at = format!("templates: {}/{}", t.sender_key, t.code);
            if !senders.contains(t.sender_key.as_str()) {
                p.push(format!("{at}: senderKey is not in `channels`"));
            }
            if t.code.is_empty() {
                p.push(format!("{at}: code is empty"));
            }
            if !codes.insert((t.sender_key.as_str(), t.code.as_str())) {
                p.push(format!("{at} appears twice"));
            }
            let declared: BTreeSet<&str> = t.variables.iter().map(String::as_str).collect();
            if declared.len() != t.variables.len() {
                p.push(format!("{at}: a variable is listed twice"));
            }
            let used = validate::placeholders(&t.text);
            let used: BTreeSet<&str> = used.iter().map(String::as_str).collect();
            if declared != used {
                p.push(format!(
                    "{at}: variables {declared:?} do not match the text's placeholders {used:?}"
                ));
            }
        }
    }
}

/// A channel's stated counseling states are of its users, one per user, and not `blockedAt`
/// without being blocked.
fn check_channel_conversations(
    ch: &SeedChannel,
    at: &str,
    keys: &BTreeSet<&str>,
    p: &mut Vec<String>,
) {
    let mut stated = HashSet::new();
    for c in &ch.conversations {
        if !keys.contains(c.user_key.as_str()) {
            p.push(format!(
                "{at}: conversations: userKey {} is not in userKeys",
                c.user_key
            ));
        }
        if !stated.insert(c.user_key.as_str()) {
            p.push(format!(
                "{at}: conversations: userKey {} appears twice",
                c.user_key
            ));
        }
        if c.blocked_at.is_some() && !c.blocked {
            p.push(format!(
                "{at}: conversations: {} has blockedAt but is not blocked",
                c.user_key
            ));
        }
    }
}

/// A navigation's nodes must exist in the bot's flows.
fn navigation_exists(nav: &Navigation, flows: &[Flow]) -> Result<(), String> {
    for (name, node) in [("current", nav.current), ("prev", nav.prev)] {
        if let Some(node) = node {
            let found = flows
                .iter()
                .find(|f| f.id == node.flow_id)
                .is_some_and(|f| f.nodes.iter().any(|n| n.id == node.node_id));
            if !found {
                return Err(format!(
                    "{name} node {}/{} is not in the bot's flows",
                    node.flow_id, node.node_id
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use model::clock::format_iso_millis;

    const CONV1: &str = "5c0e9b1f-2222-4d3e-9f10-000000000001";
    const CONV2: &str = "5c0e9b1f-2222-4d3e-9f10-000000000002";

    #[test]
    fn the_default_seed_is_valid_and_knows_the_fixtures_ids() {
        let seed = Seed::default_seed().expect("default seed");
        assert!(seed.bots.iter().any(|b| b.id.as_str() == "B7f3a2c"));
        for (id, platform, key) in [
            (
                "4e6f0d0a-1111-4a5b-8c9d-000000000001",
                "web",
                "web-visitor-8841",
            ),
            (
                "4e6f0d0a-1111-4a5b-8c9d-000000000002",
                "kakaobiz",
                "kb-user-77a9f2",
            ),
        ] {
            let eu = seed
                .end_users
                .iter()
                .find(|e| e.id.as_str() == id)
                .expect("end user");
            assert_eq!(eu.platform.as_str(), platform);
            assert_eq!(eu.user_key.as_str(), key);
        }
        for id in [CONV1, CONV2] {
            assert!(seed.conversations.iter().any(|c| c.id.as_str() == id));
        }
        let flows = &seed.flows[&BotId::new("B7f3a2c")];
        for (flow, node) in [(1, 1), (2, 7), (3, 12), (5, 40), (5, 41)] {
            let f = flows.iter().find(|f| f.id == flow).expect("flow");
            assert!(f.nodes.iter().any(|n| n.id == node), "{flow}/{node}");
        }
        let ch = &seed.channels[0];
        assert_eq!(ch.sender_key, "sk-support-0001");
        assert!(ch.user_keys.iter().any(|k| k == "kb-user-77a9f2"));
        assert!(seed.templates.iter().any(|t| t.code == "CALLBACK"));
    }

    #[test]
    fn every_problem_is_reported_together() {
        let mut seed = Seed::default_seed().expect("default seed");
        seed.bots.push(seed.bots[0].clone());
        seed.conversations[0].end_user_id = Some(EndUserId::new("nobody"));
        seed.messages[0].timestamp = None;
        seed.channels[0].user_keys.push("web-visitor-8841".into());
        seed.templates[0].variables.push("extra".into());
        let Err(SeedError::Invalid(problems)) = seed.validate() else {
            panic!("expected problems");
        };
        let text = problems.join("\n");
        for needle in [
            "bots: id B7f3a2c appears twice",
            "end user nobody is not in `endUsers`",
            "has no timestamp",
            "userKey web-visitor-8841 is not a kakaobiz end user",
            "do not match the text's placeholders",
        ] {
            assert!(text.contains(needle), "missing {needle:?} in\n{text}");
        }
    }

    #[test]
    fn navigation_to_an_unknown_node_and_bad_times_are_refused() {
        let mut seed = Seed::default_seed().expect("default seed");
        if let Some(nav) = seed.conversations[0].navigation.as_mut() {
            nav.current = Some(model::webhook::model::Node {
                flow_id: 5,
                node_id: 999,
                visit_count: None,
            });
        }
        seed.conversations[1].updated_at = Some("yesterday".into());
        let err = seed.validate().expect_err("invalid").to_string();
        assert!(err.contains("current node 5/999"), "{err}");
        assert!(err.contains("not an RFC 3339 time"), "{err}");
    }

    #[test]
    fn unknown_fields_and_bad_json_are_parse_errors() {
        assert!(matches!(
            Seed::from_json(r#"{"bots": [], "robots": []}"#),
            Err(SeedError::Parse(_))
        ));
        assert!(matches!(Seed::from_json("{"), Err(SeedError::Parse(_))));
        assert!(Seed::from_json(r#"{"bots": []}"#).is_ok());
    }

    #[test]
    fn iso_times_round_trip_through_millis() {
        let ms = parse_iso_millis("2025-11-21T02:00:02.200Z").expect("time");
        assert_eq!(ms, 1_763_690_402_200);
        assert_eq!(format_iso_millis(ms), "2025-11-21T02:00:02.200Z");
    }
}
