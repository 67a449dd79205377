//! Read-only views shared by the admin API and the offline CLI, so both print the same JSON.

use crate::store::{Store, StoreError};
use serde_json::{json, Value};

/// An end user by messenger identity, with their newest conversation's state.
pub fn find_end_user(
    store: &Store,
    platform: &str,
    user_key: &str,
) -> Result<Option<Value>, StoreError> {
    let Some(user) = store.find_end_user(platform, user_key)? else {
        return Ok(None);
    };
    let last = match &user.last_conversation_id.value {
        Some(id) => store.conversation(id)?,
        None => None,
    };
    Ok(Some(json!({ "endUser": user, "lastConversation": last })))
}

/// A quarantine record with its body also shown as text when it is UTF-8.
pub fn quarantine_view(record: &crate::store::QuarantineRecord) -> Value {
    let text = record.body().ok().and_then(|b| String::from_utf8(b).ok());
    let mut v = serde_json::to_value(record).unwrap_or(Value::Null);
    if let (Some(obj), Some(text)) = (v.as_object_mut(), text) {
        obj.insert("body_text".into(), Value::String(text));
    }
    v
}

/// Every quarantine record, each as [`quarantine_view`] shows it.
pub fn quarantine_list(store: &Store) -> Result<Value, StoreError> {
    Ok(Value::Array(
        store.quarantined()?.iter().map(quarantine_view).collect(),
    ))
}
