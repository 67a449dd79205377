//! The Open API contract as handoff-bridge assumes it (`docs/open-api-contract.md`): one type per
//! request and answer body, shared by the client and the emulator so both sides agree by
//! construction. Objects reuse the webhook's models.

use crate::webhook::model::{MessageData, Millis};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::collections::BTreeMap;

/// Every endpoint of the Open API. The names are stable: they label metrics, rate-limit classes
/// and the `api` CLI command. The names ([`Endpoint::name`], kebab-case) and the list of all
/// endpoints ([`Endpoint::ALL`]) come from the enum itself.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    strum::IntoStaticStr,
    strum::VariantArray,
    strum::EnumCount,
)]
#[strum(serialize_all = "kebab-case")]
pub enum Endpoint {
    ListBots,
    GetBot,
    ListBotConversations,
    ListFlows,
    GetConversation,
    UpdateConversation,
    SetManual,
    GetManual,
    ListConversationMessages,
    SendConversationMessage,
    SetNavigation,
    ListConversations,
    GetEndUser,
    ListEndUsers,
    SendEndUserMessage,
    ListMessages,
    PbGetConversation,
    PbUpdateConversation,
    PbBlock,
    PbUnblock,
    PbRemoveSession,
    PbSendMessage,
    PbUpdateSetting,
    NotifySend,
}

/// Rate-limit classes: each has its own quota beside the global one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EndpointClass {
    Read,
    Write,
    PartnerSend,
    Notify,
}

impl Endpoint {
    /// Every endpoint, in declaration order.
    pub const ALL: [Endpoint; <Endpoint as strum::EnumCount>::COUNT] =
        *<Endpoint as strum::VariantArray>::VARIANTS
            .first_chunk()
            .unwrap();

    /// Kebab-case name (CLI and metric label).
    pub fn name(self) -> &'static str {
        self.into()
    }

    pub fn from_name(name: &str) -> Option<Endpoint> {
        Endpoint::ALL.into_iter().find(|e| e.name() == name)
    }

    pub fn method(self) -> &'static str {
        use Endpoint::*;
        match self {
            UpdateConversation | SetManual | SetNavigation | PbUpdateConversation
            | PbUpdateSetting => "PUT",
            SendConversationMessage
            | SendEndUserMessage
            | PbBlock
            | PbUnblock
            | PbSendMessage
            | NotifySend => "POST",
            PbRemoveSession => "DELETE",
            _ => "GET",
        }
    }

    /// Path template with `{name}` placeholders, as in the service's documentation.
    pub fn path_template(self) -> &'static str {
        use Endpoint::*;
        match self {
            ListBots => "/openapi/bot",
            GetBot => "/openapi/bot/{botId}",
            ListBotConversations => "/openapi/bot/{botId}/conversation",
            ListFlows => "/openapi/bot/{botId}/flow",
            GetConversation | UpdateConversation => "/openapi/conversation/{conversationId}",
            SetManual | GetManual => "/openapi/conversation/{conversationId}/manual",
            ListConversationMessages | SendConversationMessage => {
                "/openapi/conversation/{conversationId}/message"
            }
            SetNavigation => "/openapi/conversation/{conversationId}/navigation",
            ListConversations => "/openapi/conversations",
            GetEndUser => "/openapi/enduser/{id}",
            ListEndUsers => "/openapi/endusers",
            SendEndUserMessage => "/openapi/message",
            ListMessages => "/openapi/messages",
            PbGetConversation | PbUpdateConversation => {
                "/openapi/partnerbiz/{senderKey}/conversation/{userKey}"
            }
            PbBlock => "/openapi/partnerbiz/{senderKey}/conversation/{userKey}/block",
            PbUnblock => "/openapi/partnerbiz/{senderKey}/conversation/{userKey}/unblock",
            PbRemoveSession => "/openapi/partnerbiz/{senderKey}/conversation/{userKey}/session",
            PbSendMessage => "/openapi/partnerbiz/{senderKey}/message",
            PbUpdateSetting => "/openapi/partnerbiz/{senderKey}/setting",
            NotifySend => "/openapi/notifytalk/sendMessage",
        }
    }

    /// Placeholders of the path template, in order.
    pub fn path_params(self) -> Vec<&'static str> {
        let t = self.path_template();
        t.split('/')
            .filter_map(|seg| seg.strip_prefix('{').and_then(|s| s.strip_suffix('}')))
            .collect()
    }

    pub fn is_mutating(self) -> bool {
        self.method() != "GET"
    }

    pub fn class(self) -> EndpointClass {
        match self {
            Endpoint::PbSendMessage => EndpointClass::PartnerSend,
            Endpoint::NotifySend => EndpointClass::Notify,
            e if e.is_mutating() => EndpointClass::Write,
            _ => EndpointClass::Read,
        }
    }
}

/// Paging of list endpoints.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PageQuery {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offset: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Page<T> {
    pub data: Vec<T>,
    pub paging: Paging,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Paging {
    pub offset: u32,
    pub limit: u32,
    pub total: u64,
}

/// Query of `GET /openapi/bot/{botId}/conversation`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BotConversationsQuery {
    #[serde(flatten)]
    pub page: PageQuery,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end_user_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub platform: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_key: Option<String>,
}

/// Query of `GET /openapi/conversations`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ConversationsQuery {
    #[serde(flatten)]
    pub page: PageQuery,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bot_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end_user_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub platform: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_key: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<Millis>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to: Option<Millis>,
}

/// Query of `GET /openapi/endusers`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EndUsersQuery {
    #[serde(flatten)]
    pub page: PageQuery,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bot_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub platform: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_key: Option<String>,
}

/// Query of `GET /openapi/conversation/{id}/message`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MessageRangeQuery {
    #[serde(flatten)]
    pub page: PageQuery,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<Millis>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to: Option<Millis>,
}

/// Query of `GET /openapi/messages`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MessagesQuery {
    #[serde(flatten)]
    pub page: PageQuery,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conversation_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end_user_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub is_user: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<Millis>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to: Option<Millis>,
}

/// A flow of a bot, with its nodes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Flow {
    pub id: i64,
    pub title: String,
    #[serde(default)]
    pub nodes: Vec<FlowNode>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlowNode {
    pub id: i64,
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub title: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlowList {
    pub data: Vec<Flow>,
}

/// `PUT /openapi/conversation/{id}`: params merged in; a `null` value removes a key.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct UpdateConversation {
    pub params: Map<String, Value>,
}

/// `PUT .../manual`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SetManual {
    pub enabled: bool,
}

/// The agent-connection ("manual") status of a conversation: the answer of `GET` and `PUT
/// .../manual` (not the webhook's `context.manual`, [`crate::webhook::model::Manual`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ManualStatus {
    pub conversation_id: String,
    pub enabled: bool,
    pub status: Option<String>,
    pub updated_at: Millis,
}

/// `POST .../message` into a conversation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SendMessage {
    pub message: MessageData,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub custom: Option<String>,
}

/// `PUT .../navigation`: without `nodeId`, the flow's first node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SetNavigation {
    pub flow_id: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_id: Option<i64>,
}

/// `POST /openapi/message`: to an end user, in their newest conversation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SendToEndUser {
    pub end_user_id: String,
    pub message: MessageData,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub custom: Option<String>,
}

/// Partner-messenger conversation status.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PbStatus {
    Waiting,
    Counseling,
    Closed,
}

/// A partner-messenger counseling conversation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PbConversation {
    pub sender_key: String,
    pub user_key: String,
    pub status: PbStatus,
    pub assignee: Option<String>,
    pub memo: Option<String>,
    pub blocked: bool,
    pub blocked_at: Option<Millis>,
    pub session: PbSession,
    pub updated_at: Millis,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PbSession {
    pub active: bool,
    pub started_at: Option<Millis>,
}

/// `PUT .../conversation/{userKey}`: only the given fields change.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct UpdatePbConversation {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<PbStatus>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub assignee: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memo: Option<String>,
}

/// `POST .../block`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// `POST /openapi/partnerbiz/{senderKey}/message`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PbSendMessage {
    pub user_key: String,
    pub message: MessageData,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PbSent {
    pub message_id: String,
    pub user_key: String,
    pub sent_at: Millis,
}

/// Counseling-chat channel setting; in a request only the given fields change.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ChannelSetting {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auto_reply: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub welcome_message: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub business_hours: Option<Vec<BusinessHours>>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BusinessHours {
    /// `mon` .. `sun`.
    pub day: String,
    /// `HH:MM`.
    pub open: String,
    pub close: String,
}

/// `POST /openapi/notifytalk/sendMessage`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NotifyRequest {
    pub sender_key: String,
    pub template_code: String,
    pub recipient: String,
    #[serde(default)]
    pub variables: BTreeMap<String, String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NotifyResult {
    pub message_id: String,
    pub status: String,
}

/// The error body of every endpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorDetail {
    pub code: String,
    pub message: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn there_are_24_distinct_endpoints_with_round_tripping_names() {
        let mut seen = std::collections::HashSet::new();
        for e in Endpoint::ALL {
            assert!(
                seen.insert((e.method(), e.path_template())),
                "{e:?} repeats a method+path"
            );
            assert_eq!(Endpoint::from_name(e.name()), Some(e));
        }
        assert_eq!(seen.len(), 24);
        assert_eq!(
            Endpoint::ALL
                .iter()
                .filter(|e| e.path_template().starts_with("/openapi/partnerbiz"))
                .count(),
            7
        );
        assert_eq!(
            Endpoint::PbBlock.path_params(),
            vec!["senderKey", "userKey"]
        );
        assert_eq!(Endpoint::PbSendMessage.class(), EndpointClass::PartnerSend);
        assert_eq!(Endpoint::GetManual.class(), EndpointClass::Read);
        assert_eq!(Endpoint::SetManual.class(), EndpointClass::Write);
        // The names are kebab-case of the variants (metric labels, the `api` CLI command).
        assert_eq!(Endpoint::ListBots.name(), "list-bots");
        assert_eq!(Endpoint::ListEndUsers.name(), "list-end-users");
        assert_eq!(Endpoint::PbGetConversation.name(), "pb-get-conversation");
        assert_eq!(Endpoint::NotifySend.name(), "notify-send");
        assert_eq!(Endpoint::ALL[0], Endpoint::ListBots);
        assert_eq!(Endpoint::ALL[23], Endpoint::NotifySend);
        assert_eq!(Endpoint::from_name("ListBots"), None);
    }
}
