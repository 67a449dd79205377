//! One typed method per endpoint. Each builds an [`ApiCall`] and decodes the answer into the
//! contract's type; the transport and limits are the client's business, retries the outbox's.

use super::client::{ApiCall, Execute};
use super::error::UpstreamError;
use model::contract::*;
use model::webhook::model::{Bot, Conversation, EndUser, Message, MessageData, Navigation};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::{Map, Value};

#[derive(Clone)]
pub struct OpenApi<E> {
    exec: E,
}

/// Query pairs from a query struct (its serde form, `None`s skipped).
fn query_of<Q: Serialize>(q: &Q) -> Result<Vec<(String, String)>, UpstreamError> {
    let Value::Object(map) =
        serde_json::to_value(q).map_err(|e| UpstreamError::InvalidCall(e.to_string()))?
    else {
        return Ok(Vec::new());
    };
    Ok(map
        .into_iter()
        .filter_map(|(k, v)| match v {
            Value::Null => None,
            Value::String(s) => Some((k, s)),
            other => Some((k, other.to_string())),
        })
        .collect())
}

fn body_of<B: Serialize>(b: &B) -> Result<Value, UpstreamError> {
    serde_json::to_value(b).map_err(|e| UpstreamError::InvalidCall(e.to_string()))
}

impl<E: Execute> OpenApi<E> {
    pub fn new(exec: E) -> Self {
        OpenApi { exec }
    }

    pub fn executor(&self) -> &E {
        &self.exec
    }

    async fn run<T: DeserializeOwned>(&self, call: ApiCall) -> Result<T, UpstreamError> {
        let value = self.exec.execute(call).await?;
        serde_json::from_value(value).map_err(|e| UpstreamError::Decode(e.to_string()))
    }

    fn call(endpoint: Endpoint, path: &[&str]) -> ApiCall {
        ApiCall::new(endpoint, path)
    }

    fn with_query<Q: Serialize>(mut call: ApiCall, q: &Q) -> Result<ApiCall, UpstreamError> {
        call.query = query_of(q)?;
        Ok(call)
    }

    fn with_body<B: Serialize>(
        mut call: ApiCall,
        b: &B,
        key: &str,
    ) -> Result<ApiCall, UpstreamError> {
        call.body = Some(body_of(b)?);
        call.idempotency_key = Some(key.to_owned());
        Ok(call)
    }

    // Bot Builder

    pub async fn list_bots(&self, page: &PageQuery) -> Result<Page<Bot>, UpstreamError> {
        self.run(Self::with_query(Self::call(Endpoint::ListBots, &[]), page)?)
            .await
    }

    pub async fn get_bot(&self, bot_id: &str) -> Result<Bot, UpstreamError> {
        self.run(Self::call(Endpoint::GetBot, &[bot_id])).await
    }

    pub async fn list_bot_conversations(
        &self,
        bot_id: &str,
        q: &BotConversationsQuery,
    ) -> Result<Page<Conversation>, UpstreamError> {
        self.run(Self::with_query(
            Self::call(Endpoint::ListBotConversations, &[bot_id]),
            q,
        )?)
        .await
    }

    pub async fn list_flows(&self, bot_id: &str) -> Result<FlowList, UpstreamError> {
        self.run(Self::call(Endpoint::ListFlows, &[bot_id])).await
    }

    pub async fn get_conversation(
        &self,
        conversation_id: &str,
    ) -> Result<Conversation, UpstreamError> {
        self.run(Self::call(Endpoint::GetConversation, &[conversation_id]))
            .await
    }

    pub async fn update_conversation(
        &self,
        conversation_id: &str,
        params: Map<String, Value>,
        key: &str,
    ) -> Result<Conversation, UpstreamError> {
        let call = Self::with_body(
            Self::call(Endpoint::UpdateConversation, &[conversation_id]),
            &UpdateConversation { params },
            key,
        )?;
        self.run(call).await
    }

    pub async fn set_manual(
        &self,
        conversation_id: &str,
        enabled: bool,
        key: &str,
    ) -> Result<ManualStatus, UpstreamError> {
        let call = Self::with_body(
            Self::call(Endpoint::SetManual, &[conversation_id]),
            &SetManual { enabled },
            key,
        )?;
        self.run(call).await
    }

    pub async fn get_manual(&self, conversation_id: &str) -> Result<ManualStatus, UpstreamError> {
        self.run(Self::call(Endpoint::GetManual, &[conversation_id]))
            .await
    }

    pub async fn list_conversation_messages(
        &self,
        conversation_id: &str,
        q: &MessageRangeQuery,
    ) -> Result<Page<Message>, UpstreamError> {
        self.run(Self::with_query(
            Self::call(Endpoint::ListConversationMessages, &[conversation_id]),
            q,
        )?)
        .await
    }

    pub async fn send_conversation_message(
        &self,
        conversation_id: &str,
        message: MessageData,
        custom: Option<String>,
        key: &str,
    ) -> Result<Message, UpstreamError> {
        let call = Self::with_body(
            Self::call(Endpoint::SendConversationMessage, &[conversation_id]),
            &SendMessage { message, custom },
            key,
        )?;
        self.run(call).await
    }

    pub async fn set_navigation(
        &self,
        conversation_id: &str,
        flow_id: i64,
        node_id: Option<i64>,
        key: &str,
    ) -> Result<Navigation, UpstreamError> {
        let call = Self::with_body(
            Self::call(Endpoint::SetNavigation, &[conversation_id]),
            &SetNavigation { flow_id, node_id },
            key,
        )?;
        self.run(call).await
    }

    pub async fn list_conversations(
        &self,
        q: &ConversationsQuery,
    ) -> Result<Page<Conversation>, UpstreamError> {
        self.run(Self::with_query(
            Self::call(Endpoint::ListConversations, &[]),
            q,
        )?)
        .await
    }

    pub async fn get_end_user(&self, id: &str) -> Result<EndUser, UpstreamError> {
        self.run(Self::call(Endpoint::GetEndUser, &[id])).await
    }

    pub async fn list_end_users(&self, q: &EndUsersQuery) -> Result<Page<EndUser>, UpstreamError> {
        self.run(Self::with_query(
            Self::call(Endpoint::ListEndUsers, &[]),
            q,
        )?)
        .await
    }

    pub async fn send_end_user_message(
        &self,
        end_user_id: &str,
        message: MessageData,
        custom: Option<String>,
        key: &str,
    ) -> Result<Message, UpstreamError> {
        let body = SendToEndUser {
            end_user_id: end_user_id.to_owned(),
            message,
            custom,
        };
        self.run(Self::with_body(
            Self::call(Endpoint::SendEndUserMessage, &[]),
            &body,
            key,
        )?)
        .await
    }

    pub async fn list_messages(&self, q: &MessagesQuery) -> Result<Page<Message>, UpstreamError> {
        self.run(Self::with_query(
            Self::call(Endpoint::ListMessages, &[]),
            q,
        )?)
        .await
    }

    // Partner messenger counseling chat

    pub async fn pb_get_conversation(
        &self,
        sender_key: &str,
        user_key: &str,
    ) -> Result<PbConversation, UpstreamError> {
        self.run(Self::call(
            Endpoint::PbGetConversation,
            &[sender_key, user_key],
        ))
        .await
    }

    pub async fn pb_update_conversation(
        &self,
        sender_key: &str,
        user_key: &str,
        update: &UpdatePbConversation,
        key: &str,
    ) -> Result<PbConversation, UpstreamError> {
        self.run(Self::with_body(
            Self::call(Endpoint::PbUpdateConversation, &[sender_key, user_key]),
            update,
            key,
        )?)
        .await
    }

    pub async fn pb_block(
        &self,
        sender_key: &str,
        user_key: &str,
        reason: Option<String>,
        key: &str,
    ) -> Result<PbConversation, UpstreamError> {
        self.run(Self::with_body(
            Self::call(Endpoint::PbBlock, &[sender_key, user_key]),
            &BlockRequest { reason },
            key,
        )?)
        .await
    }

    pub async fn pb_unblock(
        &self,
        sender_key: &str,
        user_key: &str,
        key: &str,
    ) -> Result<PbConversation, UpstreamError> {
        let mut call = Self::call(Endpoint::PbUnblock, &[sender_key, user_key]);
        call.idempotency_key = Some(key.to_owned());
        self.run(call).await
    }

    pub async fn pb_remove_session(
        &self,
        sender_key: &str,
        user_key: &str,
        key: &str,
    ) -> Result<PbConversation, UpstreamError> {
        let mut call = Self::call(Endpoint::PbRemoveSession, &[sender_key, user_key]);
        call.idempotency_key = Some(key.to_owned());
        self.run(call).await
    }

    pub async fn pb_send_message(
        &self,
        sender_key: &str,
        user_key: &str,
        message: MessageData,
        key: &str,
    ) -> Result<PbSent, UpstreamError> {
        let body = PbSendMessage {
            user_key: user_key.to_owned(),
            message,
        };
        self.run(Self::with_body(
            Self::call(Endpoint::PbSendMessage, &[sender_key]),
            &body,
            key,
        )?)
        .await
    }

    pub async fn pb_update_setting(
        &self,
        sender_key: &str,
        setting: &ChannelSetting,
        key: &str,
    ) -> Result<ChannelSetting, UpstreamError> {
        self.run(Self::with_body(
            Self::call(Endpoint::PbUpdateSetting, &[sender_key]),
            setting,
            key,
        )?)
        .await
    }

    // Notification message

    pub async fn notify_send(
        &self,
        request: &NotifyRequest,
        key: &str,
    ) -> Result<NotifyResult, UpstreamError> {
        self.run(Self::with_body(
            Self::call(Endpoint::NotifySend, &[]),
            request,
            key,
        )?)
        .await
    }
}
