//! A request body into the domain: parsed with the field at fault named, checked against the
//! service's rules ([`contract`]), turned into the service's message format and targets.

use super::dto::{AgentBody, FlowTarget, ReplyMedia, ReplyMessage, ReplyType};
use crate::helpdesk::contract::{self, MAX_TEXT};
use actix_web::http::StatusCode;
use api_error::ApiError;
use model::webhook::agent::{DeskAgent, Target};
use model::webhook::model::MessageData;

pub fn invalid_body(field: &str, reason: impl Into<String>) -> ApiError {
    ApiError::new(StatusCode::BAD_REQUEST, "invalid_body", reason).with_field(field)
}

/// Parse a JSON body; `optional` bodies may be empty or `null`. A serde error names its field when it
/// can (missing and unknown fields); other errors blame the body as a whole.
pub fn parse_body<T: serde::de::DeserializeOwned + Default>(
    body: &[u8],
    optional: bool,
) -> Result<T, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return if optional {
            Ok(T::default())
        } else {
            Err(invalid_body("body", "a JSON body is required"))
        };
    }
    let parsed = if optional {
        // An optional body may also be JSON `null` (the document's `oneOf: [null, ...]`).
        serde_json::from_slice::<Option<T>>(body).map(Option::unwrap_or_default)
    } else {
        serde_json::from_slice(body)
    };
    parsed.map_err(|e| {
        let text = e.to_string();
        let field = text
            .split('`')
            .nth(1)
            .filter(|_| text.starts_with("missing field") || text.starts_with("unknown field"))
            .unwrap_or("body")
            .to_owned();
        invalid_body(&field, text)
    })
}

pub fn agent_of(a: AgentBody, at: &str) -> Result<DeskAgent, ApiError> {
    if !contract::valid_agent_id(&a.id) {
        return Err(invalid_body(
            &format!("{at}.id"),
            format!(
                "must be 1 to {} characters, not blank",
                contract::MAX_AGENT_ID
            ),
        ));
    }
    Ok(DeskAgent {
        id: a.id,
        name: a.name.filter(|n| !n.is_empty()),
    })
}

/// Check a reply against the service's rules (those [`contract::schema::reply_message`] states)
/// and turn it into the service's message format.
pub fn message_of(m: ReplyMessage) -> Result<MessageData, ApiError> {
    use contract::{non_blank_within, within};
    let media = |at: &str, m: &ReplyMedia| {
        if !contract::MEDIA_TYPES.contains(&m.content_type.as_str()) {
            return Err(invalid_body(
                &format!("{at}.contentType"),
                format!("must be one of {}", contract::MEDIA_TYPES.join(", ")),
            ));
        }
        if contract::blank(&m.uri) {
            return Err(invalid_body(&format!("{at}.uri"), "must not be blank"));
        }
        Ok(())
    };
    // Every content present is checked, whatever the type.
    if m.text.as_deref().is_some_and(|t| !within(t, MAX_TEXT)) {
        return Err(invalid_body(
            "message.text",
            format!("at most {MAX_TEXT} characters"),
        ));
    }
    if let Some(m) = &m.media {
        media("message.media", m)?;
    }
    let cards = m.cards.as_deref().unwrap_or_default();
    if cards.len() > contract::MAX_CARDS {
        return Err(invalid_body(
            "message.cards",
            format!("at most {} cards", contract::MAX_CARDS),
        ));
    }
    for (i, card) in cards.iter().enumerate() {
        let at = format!("message.cards[{i}]");
        if !non_blank_within(&card.title, contract::MAX_CARD_TITLE) {
            return Err(invalid_body(
                &format!("{at}.title"),
                format!(
                    "a card needs a title of 1 to {} characters, not blank",
                    contract::MAX_CARD_TITLE
                ),
            ));
        }
        if let Some(d) = card
            .description
            .as_deref()
            .filter(|d| !within(d, contract::MAX_CARD_DESCRIPTION))
        {
            return Err(invalid_body(
                &format!("{at}.description"),
                format!(
                    "at most {} characters, not {}",
                    contract::MAX_CARD_DESCRIPTION,
                    d.chars().count()
                ),
            ));
        }
        if let Some(m) = &card.media {
            media(&format!("{at}.media"), m)?;
        }
        let buttons = card.buttons.as_deref().unwrap_or_default();
        if buttons.len() > contract::MAX_BUTTONS {
            return Err(invalid_body(
                &format!("{at}.buttons"),
                format!("at most {} buttons", contract::MAX_BUTTONS),
            ));
        }
        if let Some(j) = buttons
            .iter()
            .position(|b| !non_blank_within(&b.label, contract::MAX_LABEL))
        {
            return Err(invalid_body(
                &format!("{at}.buttons[{j}].label"),
                format!(
                    "a button needs a label of 1 to {} characters, not blank",
                    contract::MAX_LABEL
                ),
            ));
        }
    }
    match m.kind {
        ReplyType::Text => {
            if m.text.as_deref().is_none_or(contract::blank) {
                return Err(invalid_body(
                    "message.text",
                    format!("a text message needs 1 to {MAX_TEXT} characters of text"),
                ));
            }
        }
        ReplyType::Media => {
            if m.media.is_none() {
                return Err(invalid_body(
                    "message.media",
                    "a media message needs media with contentType and uri",
                ));
            }
        }
        ReplyType::Cards => {
            if cards.is_empty() {
                return Err(invalid_body(
                    "message.cards",
                    "a cards message needs at least one card",
                ));
            }
        }
    }
    let value = serde_json::to_value(&m).map_err(|e| invalid_body("message", e.to_string()))?;
    serde_json::from_value(value).map_err(|e| invalid_body("message", e.to_string()))
}

pub fn target_of(b: FlowTarget) -> Result<Target, ApiError> {
    if b.flow_id.is_some() && b.flow.is_some() {
        return Err(invalid_body("flow", "give flow_id or flow, not both"));
    }
    if b.flow.as_deref().is_some_and(contract::blank) {
        return Err(invalid_body("flow", "a flow title must not be empty"));
    }
    if b.node_id.is_some() && b.flow_id.is_none() && b.flow.is_none() {
        return Err(invalid_body("node_id", "a node needs its flow_id or flow"));
    }
    Ok(Target {
        flow_id: b.flow_id,
        flow: b.flow,
        node_id: b.node_id,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::helpdesk::agent_api::dto::AcceptBody;

    #[test]
    fn body_errors_name_the_field() {
        let e = parse_body::<AcceptBody>(br#"{}"#, false).expect_err("missing");
        assert_eq!(e.field.as_deref(), Some("agent"));
        let e =
            parse_body::<AcceptBody>(br#"{"agent":{"id":"a"},"x":1}"#, false).expect_err("unknown");
        assert_eq!(e.field.as_deref(), Some("x"));
        let e = parse_body::<AcceptBody>(b"", false).expect_err("empty");
        assert_eq!((e.code, e.field.as_deref()), ("invalid_body", Some("body")));
        assert!(parse_body::<FlowTarget>(b"", true).is_ok());
        let e = message_of(ReplyMessage {
            kind: ReplyType::Text,
            text: Some("  ".into()),
            media: None,
            cards: None,
        })
        .expect_err("blank text");
        assert_eq!(e.field.as_deref(), Some("message.text"));
        let e = target_of(FlowTarget {
            flow_id: None,
            flow: None,
            node_id: Some(3),
        })
        .expect_err("node without flow");
        assert_eq!(e.field.as_deref(), Some("node_id"));
    }

    #[test]
    fn replies_become_the_service_message_format() {
        let m = message_of(ReplyMessage {
            kind: ReplyType::Media,
            text: None,
            media: Some(ReplyMedia {
                content_type: "image".into(),
                uri: "https://example.com/a.png".into(),
            }),
            cards: None,
        })
        .expect("media");
        assert_eq!(m.kind.as_str(), "media");
        assert_eq!(m.media.expect("media").content_type, "image");
    }
}
