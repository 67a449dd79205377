//! Keys of older releases still accepted: each is read as its new key, with a note (logged at
//! start, shown by `check`) naming the new one; never an error.

/// Old key -> the key it now sets (`None`: no longer used, ignored). The help desk's own retry
/// keys come first: they meant what `[outbox.retry]` means now (a queue's backoff between
/// attempts), so where both old sections set a key, theirs wins.
pub const RENAMED: &[(&str, Option<&str>)] = &[
    ("helpdesk.retry.initial", Some("outbox.retry.base")),
    ("helpdesk.retry.max", Some("outbox.retry.cap")),
    (
        "helpdesk.retry.max_retry_after",
        Some("outbox.retry.max_retry_after"),
    ),
    ("helpdesk.retry.give_up_after", Some("outbox.give_up_after")),
    ("upstream.retry.base", Some("outbox.retry.base")),
    ("upstream.retry.cap", Some("outbox.retry.cap")),
    (
        "upstream.retry.max_retry_after",
        Some("outbox.retry.max_retry_after"),
    ),
    ("upstream.retry.max_attempts", None),
];

/// The new key of an old one (`Some(None)`: ignored), or `None` when `key` is not an old key.
pub fn renamed(key: &str) -> Option<Option<&'static str>> {
    RENAMED
        .iter()
        .find(|(old, _)| *old == key)
        .map(|(_, new)| *new)
}

/// The note for an old key.
pub fn note(old: &str, new: Option<&str>) -> String {
    match new {
        Some(new) => format!("{old} is deprecated: it now sets {new}; rename it"),
        None => format!(
            "{old} is no longer used (the client makes one attempt; the outbox retries until \
             outbox.give_up_after): remove it"
        ),
    }
}

/// Move the old keys of a file's table to their new places. A new key the file sets itself
/// wins over an old one.
pub fn rewrite(table: &mut toml::Table, notes: &mut Vec<String>) {
    for (old, new) in RENAMED {
        let (section, rest) = old.split_once('.').unwrap_or((old, ""));
        let (sub, leaf) = rest.split_once('.').unwrap_or((rest, ""));
        let Some(toml::Value::Table(s)) = table.get_mut(section) else {
            continue;
        };
        let Some(toml::Value::Table(r)) = s.get_mut(sub) else {
            continue;
        };
        let Some(value) = r.remove(leaf) else {
            continue;
        };
        if r.is_empty() {
            s.remove(sub);
        }
        notes.push(note(old, *new));
        if let Some(new) = new {
            insert_if_absent(table, new, value);
        }
    }
}

fn insert_if_absent(table: &mut toml::Table, key: &str, value: toml::Value) {
    let mut parts: Vec<&str> = key.split('.').collect();
    let Some(leaf) = parts.pop() else {
        return;
    };
    let mut t = table;
    for part in parts {
        let entry = t
            .entry(part.to_owned())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        let toml::Value::Table(next) = entry else {
            return;
        };
        t = next;
    }
    t.entry(leaf.to_owned()).or_insert(value);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn old_retry_keys_move_to_the_outbox_and_new_keys_win() {
        let mut t: toml::Table = toml::from_str(
            r#"
[upstream.retry]
max_attempts = 3
base = "200ms"
cap = "10s"
[helpdesk.retry]
max = "2m"
give_up_after = "12h"
[outbox.retry]
base = "2s"
"#,
        )
        .expect("toml");
        let mut notes = Vec::new();
        rewrite(&mut t, &mut notes);
        assert_eq!(notes.len(), 5, "{notes:?}");
        assert!(notes
            .iter()
            .any(|n| n.contains("upstream.retry.max_attempts is no longer used")));
        let ob = t["outbox"].as_table().expect("outbox");
        assert_eq!(ob["give_up_after"].as_str(), Some("12h"));
        let r = ob["retry"].as_table().expect("retry");
        assert_eq!(r["base"].as_str(), Some("2s"), "the new key wins");
        assert_eq!(
            r["cap"].as_str(),
            Some("2m"),
            "the help desk's wins over the client's"
        );
        assert!(!t["upstream"].as_table().expect("up").contains_key("retry"));
        assert!(!t["helpdesk"].as_table().expect("hd").contains_key("retry"));
    }
}
