//! Carrying out one action: the one place that maps an [`Action`] to its Open API call.

use crate::api::OpenApi;
use crate::client::Execute;
use crate::error::UpstreamError;
use model::action::Action;
use serde_json::Value;

/// Why an action could not be carried out here.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExecuteError {
    #[error(transparent)]
    Upstream(#[from] UpstreamError),
    /// Internal actions are not upstream calls.
    #[error("{0} is not carried out through the Open API")]
    NotUpstream(&'static str),
    /// A navigation by flow title that names no flow of the bot (or names no bot).
    #[error("no flow titled {title:?} in bot {bot}'s flow list")]
    UnknownFlow { bot: String, title: String },
}

/// A navigation by flow title with the title's flow id filled in, from `flows` (the bot's flow
/// list); other actions as they are. Titles compare exactly; the first flow of that title wins.
pub fn resolve_flow(
    action: &Action,
    flows: &[model::contract::Flow],
) -> Result<Action, ExecuteError> {
    match action {
        Action::Navigate {
            flow_id: None,
            flow: Some(title),
            bot_id,
            ..
        } => {
            let Some(found) = flows.iter().find(|f| f.title == *title) else {
                return Err(ExecuteError::UnknownFlow {
                    bot: bot_id
                        .as_ref()
                        .map(|b| b.as_str().to_owned())
                        .unwrap_or_default(),
                    title: title.clone(),
                });
            };
            let mut resolved = action.clone();
            if let Action::Navigate { flow_id, .. } = &mut resolved {
                *flow_id = Some(found.id);
            }
            Ok(resolved)
        }
        _ => Ok(action.clone()),
    }
}

/// The bot whose flow list a navigation by title needs, if the action is one.
pub fn flow_title_bot(action: &Action) -> Option<Option<&model::ids::BotId>> {
    match action {
        Action::Navigate {
            flow_id: None,
            flow: Some(_),
            bot_id,
            ..
        } => Some(bot_id.as_ref()),
        _ => None,
    }
}

/// Make the action's call, with `key` as its idempotency key; returns the answer as JSON.
pub async fn execute<E: Execute>(
    api: &OpenApi<E>,
    action: &Action,
    key: &str,
) -> Result<Value, ExecuteError> {
    match action {
        Action::SetManual { .. } | Action::Navigate { .. } | Action::UpdateParams { .. } => {
            conversation_call(api, action, key).await
        }
        Action::SendMessage { .. } | Action::SendToEndUser { .. } => {
            message_call(api, action, key).await
        }
        Action::PartnerUpdateConversation { .. }
        | Action::PartnerBlock { .. }
        | Action::PartnerUnblock { .. }
        | Action::PartnerRemoveSession { .. }
        | Action::PartnerSendMessage { .. }
        | Action::PartnerChannelSetting { .. } => partner_call(api, action, key).await,
        Action::SendNotification { request } => Ok(json(api.notify_send(request, key).await?)),
        // Internal actions are applied in the fold; help-desk events go to the help desks
        // (`outbox` hands them to `helpdesk`), not the Open API.
        Action::UpdateState { .. }
        | Action::StartTimer { .. }
        | Action::CancelTimer { .. }
        | Action::NotifyHelpdesk { .. } => Err(ExecuteError::NotUpstream(action.name())),
    }
}

/// An Open API answer as JSON (`null` if it cannot be serialized).
fn json<T: serde::Serialize>(v: T) -> Value {
    serde_json::to_value(v).unwrap_or(Value::Null)
}

/// The conversation's manual mode, navigation and parameters (`set_manual`, `navigate`,
/// `update_params`).
async fn conversation_call<E: Execute>(
    api: &OpenApi<E>,
    action: &Action,
    key: &str,
) -> Result<Value, ExecuteError> {
    let answer = match action {
        Action::SetManual {
            conversation_id,
            enabled,
        } => json(
            api.set_manual(conversation_id.as_str(), *enabled, key)
                .await?,
        ),
        Action::Navigate {
            conversation_id,
            flow_id,
            node_id,
            flow,
            bot_id,
        } => {
            // By title: the executor resolves it first ([`resolve_flow`]); unresolved, no call.
            let Some(flow_id) = flow_id else {
                return Err(ExecuteError::UnknownFlow {
                    bot: bot_id
                        .as_ref()
                        .map(|b| b.as_str().to_owned())
                        .unwrap_or_default(),
                    title: flow.clone().unwrap_or_default(),
                });
            };
            json(
                api.set_navigation(conversation_id.as_str(), *flow_id, *node_id, key)
                    .await?,
            )
        }
        Action::UpdateParams {
            conversation_id,
            params,
        } => json(
            api.update_conversation(conversation_id.as_str(), params.clone(), key)
                .await?,
        ),
        other => return Err(ExecuteError::NotUpstream(other.name())),
    };
    Ok(answer)
}

/// Messages to a conversation or to an end user (`send_message`, `send_to_end_user`).
async fn message_call<E: Execute>(
    api: &OpenApi<E>,
    action: &Action,
    key: &str,
) -> Result<Value, ExecuteError> {
    let answer = match action {
        Action::SendMessage {
            conversation_id,
            message,
            custom,
        } => json(
            api.send_conversation_message(
                conversation_id.as_str(),
                message.clone(),
                custom.clone(),
                key,
            )
            .await?,
        ),
        Action::SendToEndUser {
            end_user_id,
            message,
            custom,
        } => json(
            api.send_end_user_message(end_user_id.as_str(), message.clone(), custom.clone(), key)
                .await?,
        ),
        other => return Err(ExecuteError::NotUpstream(other.name())),
    };
    Ok(answer)
}

/// The partner channel's calls (every `partner_*` action).
async fn partner_call<E: Execute>(
    api: &OpenApi<E>,
    action: &Action,
    key: &str,
) -> Result<Value, ExecuteError> {
    let answer = match action {
        Action::PartnerUpdateConversation {
            sender_key,
            user_key,
            update,
        } => json(
            api.pb_update_conversation(sender_key, user_key, update, key)
                .await?,
        ),
        Action::PartnerBlock {
            sender_key,
            user_key,
            reason,
        } => json(
            api.pb_block(sender_key, user_key, reason.clone(), key)
                .await?,
        ),
        Action::PartnerUnblock {
            sender_key,
            user_key,
        } => json(api.pb_unblock(sender_key, user_key, key).await?),
        Action::PartnerRemoveSession {
            sender_key,
            user_key,
        } => json(api.pb_remove_session(sender_key, user_key, key).await?),
        Action::PartnerSendMessage {
            sender_key,
            user_key,
            message,
        } => json(
            api.pb_send_message(sender_key, user_key, message.clone(), key)
                .await?,
        ),
        Action::PartnerChannelSetting {
            sender_key,
            setting,
        } => json(api.pb_update_setting(sender_key, setting, key).await?),
        other => return Err(ExecuteError::NotUpstream(other.name())),
    };
    Ok(answer)
}

#[cfg(test)]
mod tests {
    use super::*;
    use model::contract::Flow;

    #[test]
    fn a_title_resolves_to_its_flow_id_or_to_an_unknown_flow() {
        let flows = vec![
            Flow {
                id: 1,
                title: "Welcome".into(),
                nodes: vec![],
            },
            Flow {
                id: 2,
                title: "Fallback".into(),
                nodes: vec![],
            },
        ];
        let by_title = |title: &str| Action::Navigate {
            conversation_id: "c1".into(),
            flow_id: None,
            node_id: None,
            flow: Some(title.into()),
            bot_id: Some("B1".into()),
        };
        match resolve_flow(&by_title("Fallback"), &flows) {
            Ok(Action::Navigate {
                flow_id: Some(2), ..
            }) => {}
            other => panic!("flow 2, got {other:?}"),
        }
        assert_eq!(
            resolve_flow(&by_title("fallback"), &flows).err(),
            Some(ExecuteError::UnknownFlow {
                bot: "B1".into(),
                title: "fallback".into()
            }),
            "titles compare exactly"
        );
    }
}
