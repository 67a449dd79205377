//! The console's commands: what an operator asks of a conversation (as the name they signed in
//! with, or another they typed), checked as the agent API checks its bodies and carried out on
//! its path ([`Commands::answer`]), keyed by the form they came from.

use super::{Built, Commands};
use crate::helpdesk::agent_api::convert::{agent_of, message_of, target_of};
use crate::helpdesk::agent_api::dto::{AgentBody, FlowTarget, ReplyMessage, ReplyType};
use actix_web::http::StatusCode;
use api_error::ApiError;
use model::webhook::agent::Command;
use serde_json::Value;
use std::sync::Arc;

/// What an operator asks of a conversation from the console.
pub enum ConsoleCommand {
    Accept { agent: String },
    Reply { agent: String, text: String },
    Release,
    Transfer { flow_id: i64 },
}

impl ConsoleCommand {
    /// Its route, as the agent API names it (the idempotency records are kept per route).
    pub fn route(&self) -> &'static str {
        match self {
            ConsoleCommand::Accept { .. } => "accept",
            ConsoleCommand::Reply { .. } => "message",
            ConsoleCommand::Release => "release",
            ConsoleCommand::Transfer { .. } => "transfer",
        }
    }

    /// The command, checked as the agent API checks its bodies.
    fn build(self, commands: &Commands, id: &str) -> Result<Built, ApiError> {
        let agent_named = |name: String| {
            let body = AgentBody {
                id: name.clone(),
                name: Some(name),
            };
            agent_of(body, "agent")
        };
        let command = match self {
            ConsoleCommand::Accept { agent } => Command::Accept {
                agent: agent_named(agent)?,
            },
            ConsoleCommand::Reply { agent, text } => {
                let message = message_of(ReplyMessage {
                    kind: ReplyType::Text,
                    text: Some(text),
                    media: None,
                    cards: None,
                })?;
                return commands.message_command(id, Some(agent_named(agent)?), message);
            }
            ConsoleCommand::Release => Command::Release {
                target: commands.release_target(),
            },
            ConsoleCommand::Transfer { flow_id } => Command::Transfer {
                target: target_of(FlowTarget {
                    flow_id: Some(flow_id),
                    flow: None,
                    node_id: None,
                })?,
            },
        };
        Ok((commands.conversation(id)?, command))
    }
}

impl Commands {
    /// A command from the console: the agent API's path after its HTTP (the same claim of
    /// `key`, idempotent answer, event, fold, verdict and answer), keyed by the form it came
    /// from, so a form sent twice is one command. Returns the status and body the agent API would
    /// answer, and whether this was a repeated form's (answered from the first).
    pub async fn console(
        self: &Arc<Self>,
        conversation_id: String,
        command: ConsoleCommand,
        key: String,
    ) -> (StatusCode, Value, bool) {
        let route = command.route();
        let Some(_claim) = self.claim(route, &key) else {
            let e = ApiError::new(
                StatusCode::CONFLICT,
                "idempotency_key_in_progress",
                "this form is being answered already",
            );
            return (e.status, e.body(), false);
        };
        let request = format!("{route} {conversation_id} console");
        let build = move |c: &Commands| command.build(c, &conversation_id);
        let (answer, replayed) = self.answer(route, request, Some(key), None, build).await;
        (answer.status, answer.body, replayed)
    }
}
