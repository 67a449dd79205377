//! Chatwoot's account API as the connector calls it: one typed call per operation, each one
//! attempt, its answer judged ([`judge`]) and counted (`handoff_desk_calls_total`), its outcome
//! told to the connector's [`Health`]. Paths and bodies are those of Chatwoot's OpenAPI document
//! (`../shared/chatwoot/swagger.json`); where the running code answers more than the document
//! shows, the readers take either (docs/chatwoot.md).

use super::health::Health;
use crate::helpdesk::port::{judge, DeskError};
use crate::ops::metrics::Metrics;
use model::secret::Secret;
use serde_json::{json, Value};
use std::sync::Arc;
use upstream::handle::TransportHandle;
use upstream::transport::{RawRequest, Transport};

/// The connector's name (metrics, errors, the mappings' connector).
pub const NAME: &str = "chatwoot";

/// The calls the connector makes: the `operation` label of `handoff_desk_calls_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, strum::IntoStaticStr, strum::VariantArray)]
#[strum(serialize_all = "snake_case")]
pub enum Operation {
    SearchContact,
    CreateContact,
    AddContactInbox,
    CreateConversation,
    ContactConversations,
    SetLabels,
    PostMessage,
    ListMessages,
    ToggleStatus,
    SetCustomAttributes,
}

/// A message to post into a conversation.
pub struct Post<'a> {
    pub content: &'a str,
    /// `incoming` (from the contact: only in API inboxes) or `outgoing`.
    pub incoming: bool,
    /// A private note (agents only).
    pub private: bool,
    /// The bridge's own id, stored on the message and echoed in its webhooks.
    pub source_id: &'a str,
}

/// The account API of one Chatwoot account.
pub struct Api {
    /// `{url}/api/v1/accounts/{account_id}`.
    base: String,
    token: Secret,
    http: TransportHandle,
    metrics: Metrics,
    health: Arc<Health>,
}

impl Api {
    pub fn new(
        url: &str,
        account_id: u64,
        token: Secret,
        http: TransportHandle,
        (metrics, health): (Metrics, Arc<Health>),
    ) -> Self {
        Api {
            base: format!("{url}/api/v1/accounts/{account_id}"),
            token,
            http,
            metrics,
            health,
        }
    }

    /// Contacts whose name, identifier, email or phone contains `q` (Chatwoot's search matches
    /// substrings: the caller picks the exact one).
    pub async fn search_contacts(&self, q: &str) -> Result<Value, DeskError> {
        let q = percent_encoding::utf8_percent_encode(q, percent_encoding::NON_ALPHANUMERIC);
        let path = format!("/contacts/search?q={q}");
        self.call(Operation::SearchContact, "GET", &path, None)
            .await
    }

    pub async fn create_contact(&self, body: Value) -> Result<Value, DeskError> {
        self.call(Operation::CreateContact, "POST", "/contacts", Some(body))
            .await
    }

    pub async fn add_contact_inbox(
        &self,
        contact: &str,
        inbox_id: u64,
        source_id: &str,
    ) -> Result<Value, DeskError> {
        let body = json!({ "inbox_id": inbox_id, "source_id": source_id });
        let path = format!("/contacts/{contact}/contact_inboxes");
        self.call(Operation::AddContactInbox, "POST", &path, Some(body))
            .await
    }

    pub async fn create_conversation(&self, body: Value) -> Result<Value, DeskError> {
        self.call(
            Operation::CreateConversation,
            "POST",
            "/conversations",
            Some(body),
        )
        .await
    }

    pub async fn contact_conversations(&self, contact: &str) -> Result<Value, DeskError> {
        let path = format!("/contacts/{contact}/conversations");
        self.call(Operation::ContactConversations, "GET", &path, None)
            .await
    }

    /// Set a conversation's labels: the list replaces the one it had.
    pub async fn set_labels(&self, conversation: &str, labels: &[String]) -> Result<(), DeskError> {
        let path = format!("/conversations/{conversation}/labels");
        let body = json!({ "labels": labels });
        self.call(Operation::SetLabels, "POST", &path, Some(body))
            .await
            .map(|_| ())
    }

    pub async fn post_message(&self, conversation: &str, post: &Post<'_>) -> Result<(), DeskError> {
        let path = format!("/conversations/{conversation}/messages");
        let body = json!({
            "content": post.content,
            "message_type": if post.incoming { "incoming" } else { "outgoing" },
            "private": post.private,
            "source_id": post.source_id,
        });
        self.call(Operation::PostMessage, "POST", &path, Some(body))
            .await
            .map(|_| ())
    }

    /// The conversation's newest messages.
    pub async fn list_messages(&self, conversation: &str) -> Result<Value, DeskError> {
        let path = format!("/conversations/{conversation}/messages");
        self.call(Operation::ListMessages, "GET", &path, None).await
    }

    /// Resolve a conversation (the hand-back to the bot).
    pub async fn resolve(&self, conversation: &str) -> Result<(), DeskError> {
        self.toggle_status(conversation, "resolved").await
    }

    /// Open a conversation again (one Chatwoot answered a create with).
    pub async fn reopen(&self, conversation: &str) -> Result<(), DeskError> {
        self.toggle_status(conversation, "open").await
    }

    async fn toggle_status(&self, conversation: &str, status: &str) -> Result<(), DeskError> {
        let path = format!("/conversations/{conversation}/toggle_status");
        let body = json!({ "status": status });
        self.call(Operation::ToggleStatus, "POST", &path, Some(body))
            .await
            .map(|_| ())
    }

    /// Set a conversation's custom attributes (the object replaces the one it had).
    pub async fn set_custom_attributes(
        &self,
        conversation: &str,
        attributes: Value,
    ) -> Result<(), DeskError> {
        let path = format!("/conversations/{conversation}/custom_attributes");
        let body = json!({ "custom_attributes": attributes });
        self.call(Operation::SetCustomAttributes, "POST", &path, Some(body))
            .await
            .map(|_| ())
    }

    /// One call: sent, judged, counted; its answer's JSON (`null` for an empty body).
    async fn call(
        &self,
        op: Operation,
        method: &'static str,
        path: &str,
        body: Option<Value>,
    ) -> Result<Value, DeskError> {
        let request = RawRequest {
            method,
            path: format!("{}{path}", self.base),
            headers: vec![
                (
                    "api_access_token".to_owned(),
                    self.token.expose().to_owned(),
                ),
                ("accept".to_owned(), "application/json".to_owned()),
            ],
            body: body.map(|b| b.to_string().into_bytes()),
        };
        let answer = judge(NAME, self.http.send(request).await).and_then(|resp| {
            if resp.body.iter().all(u8::is_ascii_whitespace) {
                return Ok(Value::Null);
            }
            serde_json::from_slice(&resp.body).map_err(|e| DeskError::BadAnswer {
                endpoint: NAME.to_owned(),
                detail: format!("{}: {e}", <&str>::from(op)),
            })
        });
        let outcome = match &answer {
            Ok(_) => "ok".to_owned(),
            Err(e) => e.outcome(),
        };
        self.metrics
            .desk_calls
            .with_label_values(&[NAME, op.into(), &outcome])
            .inc();
        self.health.saw(answer.as_ref().map(|_| ()));
        answer
    }
}

/// An id in an answer: a number (or text) at `pointer`, as text.
pub fn id_at(answer: &Value, pointer: &str) -> Option<String> {
    match answer.pointer(pointer)? {
        Value::Number(n) => Some(n.to_string()),
        Value::String(s) if !s.is_empty() => Some(s.clone()),
        _ => None,
    }
}
