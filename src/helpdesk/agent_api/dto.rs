//! The agent API's request and answer bodies, and the schemas its OpenAPI document states
//! (from the same constants the handlers check: [`contract`]).

use crate::helpdesk::contract;
use model::webhook::agent::DeskAgent;
use model::webhook::model::Millis;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::{IntoParams, ToSchema};

// Named `ErrorBody` in the document, as it always was; `AgentError` here, so it is not mistaken
// for the Open API's `model::contract::ErrorBody`. (A doc comment would change the schema's text.)
/// The one error body: `{"error": {"code", "message", "field"?}}`.
#[derive(Serialize, ToSchema)]
#[schema(as = ErrorBody)]
pub struct AgentError {
    pub error: ErrorInner,
}

#[derive(Serialize, ToSchema)]
pub struct ErrorInner {
    /// Stable, for programs.
    pub code: String,
    /// For people.
    pub message: String,
    /// The request field at fault (400 `invalid_body`).
    pub field: Option<String>,
}

#[derive(Debug, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AgentBody {
    /// The help desk's id of the agent.
    #[schema(schema_with = contract::schema::agent_id)]
    pub id: String,
    pub name: Option<String>,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AcceptBody {
    pub agent: AgentBody,
}

/// An agent's reply: text, media or cards.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MessageBody {
    pub agent: Option<AgentBody>,
    pub message: ReplyMessage,
}

#[derive(Deserialize, Serialize, ToSchema, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ReplyType {
    Text,
    Media,
    Cards,
}

/// Its schema is one shape per `type` ([`contract::schema::reply_message`]), which says what
/// [`message_of`](super::convert::message_of) requires of each.
#[derive(Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ReplyMessage {
    #[serde(rename = "type")]
    pub kind: ReplyType,
    pub text: Option<String>,
    pub media: Option<ReplyMedia>,
    pub cards: Option<Vec<ReplyCard>>,
}

impl utoipa::PartialSchema for ReplyMessage {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        contract::schema::reply_message()
    }
}

impl ToSchema for ReplyMessage {
    fn schemas(
        schemas: &mut Vec<(
            String,
            utoipa::openapi::RefOr<utoipa::openapi::schema::Schema>,
        )>,
    ) {
        use utoipa::PartialSchema as _;
        schemas.push((ReplyMedia::name().into(), ReplyMedia::schema()));
        schemas.push((ReplyCard::name().into(), ReplyCard::schema()));
        schemas.push((ReplyButton::name().into(), ReplyButton::schema()));
        <ReplyCard as ToSchema>::schemas(schemas);
    }
}

#[derive(Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ReplyMedia {
    #[schema(schema_with = contract::schema::media_type)]
    pub content_type: String,
    /// Not blank.
    #[schema(schema_with = contract::schema::non_blank)]
    pub uri: String,
}

#[derive(Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReplyCard {
    /// Not blank.
    #[schema(schema_with = contract::schema::card_title)]
    pub title: String,
    #[schema(schema_with = contract::schema::card_description)]
    pub description: Option<String>,
    pub media: Option<ReplyMedia>,
    pub uri: Option<String>,
    #[schema(schema_with = contract::schema::card_buttons)]
    pub buttons: Option<Vec<ReplyButton>>,
}

#[derive(Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReplyButton {
    /// Not blank.
    #[schema(schema_with = contract::schema::button_label)]
    pub label: String,
    pub uri: Option<String>,
}

/// Where to send the conversation: a flow by id or by title (`flow`), optionally a node. Its
/// schema ([`contract::schema::flow_target`]) states what [`target_of`](super::convert::target_of) requires.
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct FlowTarget {
    #[serde(default, deserialize_with = "contract::integral")]
    pub flow_id: Option<i64>,
    pub flow: Option<String>,
    #[serde(default, deserialize_with = "contract::integral")]
    pub node_id: Option<i64>,
}

impl utoipa::PartialSchema for FlowTarget {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        contract::schema::flow_target()
    }
}

impl ToSchema for FlowTarget {}

/// The release call's body: a [`FlowTarget`] or no flow (then `helpdesk.release_flow`). Only a
/// schema: the call parses a [`FlowTarget`].
pub struct ReleaseTarget;

impl utoipa::PartialSchema for ReleaseTarget {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        contract::schema::release_target()
    }
}

impl ToSchema for ReleaseTarget {
    fn schemas(
        schemas: &mut Vec<(
            String,
            utoipa::openapi::RefOr<utoipa::openapi::schema::Schema>,
        )>,
    ) {
        use utoipa::PartialSchema as _;
        schemas.push((FlowTarget::name().into(), FlowTarget::schema()));
    }
}

/// The `Idempotency-Key` header of the mutating calls.
#[derive(IntoParams)]
#[into_params(parameter_in = Header)]
#[allow(dead_code)]
pub struct KeyHeader {
    /// The same key returns the first answer (for the same request; another request with it is
    /// 422 `idempotency_key_reused`).
    #[param(
        rename = "Idempotency-Key",
        schema_with = contract::schema::idempotency_key,
        required = false
    )]
    key: Option<String>,
}

#[derive(Deserialize, Default, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BlockBody {
    pub reason: Option<String>,
}

/// The answer to a mutating call: the command's verdict, once folded.
#[derive(Serialize, ToSchema)]
pub struct CommandAnswer {
    pub conversation_id: String,
    /// `accept`, `message`, `release`, `transfer`, `block`, `unblock`, `remove_session`.
    pub command: String,
    /// The stored `agent.<command>` event (in the conversation's audit timeline).
    pub event_id: String,
    /// `applied`.
    pub status: String,
    /// False for a repeat that had nothing left to do (the same agent accepting again).
    pub changed: bool,
    /// The agent who has the conversation now, if any.
    pub agent: Option<AgentBody>,
}

#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct QueueQuery {
    /// `requested` (default: waiting for an agent), `accepted` (taken through this API),
    /// `connected`, `released`, `cancelled`, `ended`, `bot`, or `all`.
    #[param(schema_with = contract::schema::phase, required = false)]
    pub phase: Option<String>,
    /// Only this bot's conversations.
    pub bot: Option<String>,
    /// At most this many (default 100, 1 to 1000).
    #[param(schema_with = contract::schema::limit, required = false)]
    pub limit: Option<usize>,
    /// The previous page's `next`: the page after it.
    #[param(schema_with = contract::schema::after, required = false)]
    pub after: Option<String>,
}

#[derive(Serialize, ToSchema)]
pub struct QueueItem {
    pub id: String,
    pub bot_id: Option<String>,
    pub platform: Option<String>,
    pub user_key: Option<String>,
    pub end_user_id: Option<String>,
    pub phase: String,
    /// When the user asked for an agent (Unix ms).
    pub requested_at: Option<Millis>,
    /// Seconds since then, while waiting.
    pub wait_seconds: Option<i64>,
    /// 1-based place among the conversations waiting for the same bot, by request time.
    pub position: Option<usize>,
    pub agent: Option<AgentBody>,
    pub accepted_at: Option<Millis>,
}

#[derive(Serialize, ToSchema)]
pub struct QueueAnswer {
    /// In request order (those with no request first), then by id.
    pub conversations: Vec<QueueItem>,
    /// The `after` of the next page; null on the last page. A page may hold fewer than `limit`
    /// conversations and still not be the last.
    pub next: Option<String>,
}

#[derive(Serialize, ToSchema)]
pub struct ConversationAnswer {
    #[serde(flatten)]
    pub summary: QueueItem,
    /// The service's view: manual status, navigation, params, message counters.
    #[schema(value_type = Object)]
    pub state: Value,
    /// The newest messages, read through the Open API (null when it could not be read).
    #[schema(value_type = Option<Vec<Object>>)]
    pub transcript: Option<Value>,
    pub transcript_error: Option<String>,
}

impl Default for AcceptBody {
    fn default() -> Self {
        AcceptBody {
            agent: AgentBody {
                id: String::new(),
                name: None,
            },
        }
    }
}

impl Default for MessageBody {
    fn default() -> Self {
        MessageBody {
            agent: None,
            message: ReplyMessage {
                kind: ReplyType::Text,
                text: None,
                media: None,
                cards: None,
            },
        }
    }
}

impl AgentBody {
    /// An agent as the answers name them.
    pub fn of(a: &DeskAgent) -> AgentBody {
        AgentBody {
            id: a.id.clone(),
            name: a.name.clone(),
        }
    }
}
