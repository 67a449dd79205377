//! The size and shape rules of the contract (`docs/open-api-contract.md`, "sizes"), shared by the
//! seed check and the request checks so a seed can never hold what the API would refuse.

use model::contract::{BusinessHours, ChannelSetting};
use model::webhook::model::{Button, FlowButton, MessageData, MessageType};

pub const MAX_TEXT: usize = 1000;
pub const MAX_BUTTONS: usize = 9;
pub const MAX_CARDS: usize = 10;
pub const MAX_CARD_TITLE: usize = 50;
pub const MAX_CARD_DESCRIPTION: usize = 500;
pub const MAX_LABEL: usize = 255;
pub const MAX_USER_KEY: usize = 90;
/// `meta.custom` and a postback payload share the text bound (webhook format).
pub const MAX_CUSTOM: usize = 1000;

pub const MEDIA_TYPES: [&str; 4] = ["image", "video", "audio", "link"];
const BUTTON_TYPES: [&str; 3] = ["postback", "link", "goto"];
const DAYS: [&str; 7] = ["mon", "tue", "wed", "thu", "fri", "sat", "sun"];

/// Characters, not bytes: the service counts Korean text by characters.
fn chars(text: &str) -> usize {
    text.chars().count()
}

fn max_len(field: &str, text: &str, max: usize) -> Result<(), String> {
    let n = chars(text);
    if n > max {
        return Err(format!(
            "`{field}` has {n} characters; at most {max} are allowed"
        ));
    }
    Ok(())
}

fn non_empty(field: &str, text: &str) -> Result<(), String> {
    if text.trim().is_empty() {
        return Err(format!("`{field}` must not be empty"));
    }
    Ok(())
}

/// MESSAGE.DATA: the part its `type` needs must be present, and every bound holds. Unknown types
/// are refused here (the webhook side keeps them; a sender must use a known one).
pub fn message_data(data: &MessageData, at: &str) -> Result<(), String> {
    if let Some(text) = &data.text {
        max_len(&format!("{at}.text"), text, MAX_TEXT)?;
    }
    match &data.kind {
        MessageType::Text => {
            let text = data
                .text
                .as_deref()
                .ok_or_else(|| format!("`{at}.text` is required for a text message"))?;
            non_empty(&format!("{at}.text"), text)?;
        }
        MessageType::Media => {
            let media = data
                .media
                .as_ref()
                .ok_or_else(|| format!("`{at}.media` is required for a media message"))?;
            if !MEDIA_TYPES.contains(&media.content_type.as_str()) {
                return Err(format!(
                    "`{at}.media.contentType` is {:?}; expected one of {}",
                    media.content_type,
                    MEDIA_TYPES.join(", ")
                ));
            }
            non_empty(&format!("{at}.media.uri"), &media.uri)?;
        }
        MessageType::Cards => {
            let cards = data
                .cards
                .as_ref()
                .ok_or_else(|| format!("`{at}.cards` is required for a cards message"))?;
            if cards.is_empty() || cards.len() > MAX_CARDS {
                return Err(format!(
                    "`{at}.cards` has {} cards; 1 to {MAX_CARDS} are allowed",
                    cards.len()
                ));
            }
            for (i, card) in cards.iter().enumerate() {
                let at = format!("{at}.cards[{i}]");
                non_empty(&format!("{at}.title"), &card.title)?;
                max_len(&format!("{at}.title"), &card.title, MAX_CARD_TITLE)?;
                if let Some(d) = &card.description {
                    max_len(&format!("{at}.description"), d, MAX_CARD_DESCRIPTION)?;
                }
                if let Some(buttons) = &card.buttons {
                    buttons_list(buttons, &format!("{at}.buttons"))?;
                }
            }
        }
        MessageType::Location => {
            let loc = data
                .location
                .as_ref()
                .ok_or_else(|| format!("`{at}.location` is required for a location message"))?;
            if !(loc.latitude.is_finite() && (-90.0..=90.0).contains(&loc.latitude)) {
                return Err(format!("`{at}.location.latitude` must be within -90..=90"));
            }
            if !(loc.longitude.is_finite() && (-180.0..=180.0).contains(&loc.longitude)) {
                return Err(format!(
                    "`{at}.location.longitude` must be within -180..=180"
                ));
            }
        }
        MessageType::Other(kind) => {
            return Err(format!(
                "`{at}.type` is {kind:?}; expected one of text, media, cards, location"
            ));
        }
    }
    if let Some(button) = &data.button {
        label(&button.label, &format!("{at}.button.label"))?;
    }
    if let Some(buttons) = &data.buttons {
        flow_buttons(buttons, &format!("{at}.buttons"))?;
    }
    Ok(())
}

fn label(text: &str, at: &str) -> Result<(), String> {
    non_empty(at, text)?;
    max_len(at, text, MAX_LABEL)
}

fn buttons_list(buttons: &[Button], at: &str) -> Result<(), String> {
    if buttons.len() > MAX_BUTTONS {
        return Err(format!(
            "`{at}` has {} buttons; at most {MAX_BUTTONS} are allowed",
            buttons.len()
        ));
    }
    for (i, b) in buttons.iter().enumerate() {
        label(&b.label, &format!("{at}[{i}].label"))?;
    }
    Ok(())
}

fn flow_buttons(buttons: &[FlowButton], at: &str) -> Result<(), String> {
    if buttons.len() > MAX_BUTTONS {
        return Err(format!(
            "`{at}` has {} buttons; at most {MAX_BUTTONS} are allowed",
            buttons.len()
        ));
    }
    for (i, b) in buttons.iter().enumerate() {
        let at = format!("{at}[{i}]");
        if !BUTTON_TYPES.contains(&b.kind.as_str()) {
            return Err(format!(
                "`{at}.type` is {:?}; expected one of {}",
                b.kind,
                BUTTON_TYPES.join(", ")
            ));
        }
        label(&b.label, &format!("{at}.label"))?;
        if let Some(serde_json::Value::String(p)) = &b.payload {
            max_len(&format!("{at}.payload"), p, MAX_CUSTOM)?;
        }
    }
    Ok(())
}

pub fn user_key(key: &str, at: &str) -> Result<(), String> {
    non_empty(at, key)?;
    max_len(at, key, MAX_USER_KEY)
}

pub fn custom(text: &str, at: &str) -> Result<(), String> {
    max_len(at, text, MAX_CUSTOM)
}

/// A channel setting (request or seed): known days, `HH:MM` times, open before close.
pub fn channel_setting(setting: &ChannelSetting) -> Result<(), String> {
    if let Some(text) = &setting.welcome_message {
        max_len("welcomeMessage", text, MAX_TEXT)?;
    }
    if let Some(hours) = &setting.business_hours {
        for (i, h) in hours.iter().enumerate() {
            business_hours(h, &format!("businessHours[{i}]"))?;
        }
    }
    Ok(())
}

fn business_hours(h: &BusinessHours, at: &str) -> Result<(), String> {
    if !DAYS.contains(&h.day.as_str()) {
        return Err(format!(
            "`{at}.day` is {:?}; expected one of {}",
            h.day,
            DAYS.join(", ")
        ));
    }
    let open = clock_minutes(&h.open).ok_or_else(|| {
        format!(
            "`{at}.open` is {:?}; expected HH:MM (00:00 to 23:59)",
            h.open
        )
    })?;
    let close = clock_minutes(&h.close).ok_or_else(|| {
        format!(
            "`{at}.close` is {:?}; expected HH:MM (00:00 to 23:59)",
            h.close
        )
    })?;
    if open >= close {
        return Err(format!(
            "`{at}`: open ({}) must be before close ({})",
            h.open, h.close
        ));
    }
    Ok(())
}

fn clock_minutes(text: &str) -> Option<u32> {
    let (h, m) = text.split_once(':')?;
    if h.len() != 2 || m.len() != 2 {
        return None;
    }
    let h: u32 = h.parse().ok()?;
    let m: u32 = m.parse().ok()?;
    (h < 24 && m < 60).then_some(h * 60 + m)
}

/// The `#{name}` placeholders of a template text, in order of first use.
pub fn placeholders(text: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find("#{") {
        let after = &rest[start + 2..];
        let Some(end) = after.find('}') else { break };
        let name = &after[..end];
        if !name.is_empty() && !out.iter().any(|n| n == name) {
            out.push(name.to_owned());
        }
        rest = &after[end + 1..];
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn data(v: serde_json::Value) -> MessageData {
        serde_json::from_value(v).expect("message data")
    }

    #[test]
    fn text_bounds_count_characters_not_bytes() {
        let ok = data(json!({"type": "text", "text": "가".repeat(1000)}));
        assert!(message_data(&ok, "message").is_ok());
        let long = data(json!({"type": "text", "text": "가".repeat(1001)}));
        let err = message_data(&long, "message").expect_err("too long");
        assert!(err.contains("1001 characters"), "{err}");
        let missing = data(json!({"type": "text"}));
        assert!(message_data(&missing, "message").is_err());
    }

    #[test]
    fn cards_buttons_and_labels_are_bounded() {
        let card = json!({"title": "t", "buttons": [{"label": "b"}]});
        let eleven: Vec<_> = (0..11).map(|_| card.clone()).collect();
        assert!(message_data(&data(json!({"type": "cards", "cards": eleven})), "m").is_err());
        let long_title = json!([{"title": "x".repeat(51)}]);
        assert!(message_data(&data(json!({"type": "cards", "cards": long_title})), "m").is_err());
        let long_desc = json!([{"title": "x", "description": "d".repeat(501)}]);
        assert!(message_data(&data(json!({"type": "cards", "cards": long_desc})), "m").is_err());
        let ten_buttons: Vec<_> = (0..10)
            .map(|i| json!({"type": "postback", "label": format!("b{i}")}))
            .collect();
        let m = data(json!({"type": "text", "text": "hi", "buttons": ten_buttons}));
        assert!(message_data(&m, "m").is_err());
        let m = data(json!({"type": "text", "text": "hi", "button": {"label": "l".repeat(256)}}));
        assert!(message_data(&m, "m").is_err());
        let m = data(json!({"type": "media", "media": {"contentType": "pdf", "uri": "x"}}));
        assert!(message_data(&m, "m").is_err());
        let m = data(json!({"type": "location", "location": {"latitude": 91.0, "longitude": 0.0}}));
        assert!(message_data(&m, "m").is_err());
        let m = data(json!({"type": "sticker"}));
        assert!(message_data(&m, "m").is_err());
    }

    #[test]
    fn placeholders_are_found_once_in_order() {
        assert_eq!(
            placeholders("#{name}님, #{time}에 #{name} #{"),
            vec!["name".to_owned(), "time".to_owned()]
        );
        assert!(placeholders("no vars").is_empty());
    }

    #[test]
    fn business_hours_need_known_days_and_ordered_times() {
        let s = |day: &str, open: &str, close: &str| ChannelSetting {
            business_hours: Some(vec![BusinessHours {
                day: day.into(),
                open: open.into(),
                close: close.into(),
            }]),
            ..ChannelSetting::default()
        };
        assert!(channel_setting(&s("mon", "09:00", "18:00")).is_ok());
        assert!(channel_setting(&s("monday", "09:00", "18:00")).is_err());
        assert!(channel_setting(&s("mon", "9:00", "18:00")).is_err());
        assert!(channel_setting(&s("mon", "18:00", "09:00")).is_err());
        assert!(channel_setting(&s("mon", "09:00", "24:00")).is_err());
    }
}
