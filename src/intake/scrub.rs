//! Webhook tokens scrubbed from a delivery's body before anything of it is stored.
//!
//! The service puts the webhook's URL, token included, in every delivery (`webhookUrl`), and a
//! message can quote it too. Intake replaces every spelling of every webhook token the daemon
//! knows (the configured ones, several during a rotation, and the generated one in the data
//! directory) by [`MARKER`] in the raw body, once, before it is parsed: the event log, the
//! quarantine (bodies and error details), sled and backups then never see a token.
//!
//! Spellings: each character literally, as a JSON `\uXXXX` escape (hex digits in either case; a
//! character outside the BMP as its surrogate pair), with its JSON short escape (`\/`, `\"`,
//! `\\`), or percent-encoded (`%XX` per UTF-8 byte, the `%` itself possibly spelled `\u0025`),
//! mixed freely. It works on bytes, so a body that is not JSON (or not UTF-8) is scrubbed too.
//!
//! The marker contains nothing JSON escapes, so a JSON body stays JSON: a token inside a string
//! becomes the marker inside the same string. A match that would start inside an escape (the `n`
//! of `\n`, the digits of `\u0041`) takes the escape's backslash with it, so no dangling escape is
//! left. Ids are scrubbed like the rest of the body, deterministically, so dedupe is unchanged
//! (an id only differs if it contained a token).

use bytes::{BufMut, BytesMut};
use regex::bytes::Regex;
use std::borrow::Cow;
use std::sync::Arc;

/// What a token is replaced by.
pub const MARKER: &str = "[webhook-token]";

/// Replaces the webhook tokens in a body. Cheap to clone: clones share one compiled pattern and
/// its search caches (a cloned `Regex` would start with empty caches and rebuild its lazy DFA at
/// every delivery: a quarter of intake's throughput, measured).
#[derive(Clone, Debug, Default)]
pub struct Scrubber {
    pattern: Option<Arc<Regex>>,
}

impl Scrubber {
    /// A scrubber for these tokens (empty ones are ignored; none: bodies pass unchanged).
    pub fn new<'a>(tokens: impl IntoIterator<Item = &'a str>) -> Result<Scrubber, regex::Error> {
        let mut tokens: Vec<&str> = tokens.into_iter().filter(|t| !t.is_empty()).collect();
        // Longest first: a token that is a prefix of another must not leave the other's tail.
        tokens.sort_by_key(|t| std::cmp::Reverse(t.len()));
        tokens.dedup();
        if tokens.is_empty() {
            return Ok(Scrubber::default());
        }
        let alternatives: Vec<String> = tokens.iter().map(|t| spellings(t)).collect();
        let pattern = regex::bytes::RegexBuilder::new(&alternatives.join("|"))
            .size_limit(64 * 1024 * 1024)
            .build()?;
        Ok(Scrubber {
            pattern: Some(Arc::new(pattern)),
        })
    }

    /// The body with every token spelling replaced by [`MARKER`] (borrowed when it held none).
    pub fn scrub<'a>(&self, body: &'a [u8]) -> Cow<'a, [u8]> {
        match self.replaced(body, Vec::with_capacity) {
            None => Cow::Borrowed(body),
            Some(clean) => Cow::Owned(clean),
        }
    }

    /// [`Scrubber::scrub`] for a body intake owns: the same buffer back when it held no token,
    /// else the scrubbed copy (built once, not copied again).
    pub fn scrub_owned(&self, body: BytesMut) -> BytesMut {
        self.replaced(&body, BytesMut::with_capacity)
            .unwrap_or(body)
    }

    /// `body` with every match replaced, written into a buffer made by `new` (given the body's
    /// length); `None` when nothing matched.
    fn replaced<B: BufMut>(&self, body: &[u8], mut new: impl FnMut(usize) -> B) -> Option<B> {
        let pattern = self.pattern.as_ref()?;
        let mut out: Option<B> = None;
        let mut copied = 0;
        let mut at = 0;
        while let Some(found) = pattern.find_at(body, at) {
            let start = escape_start(body, found.start()).max(copied);
            let buf = out.get_or_insert_with(|| new(body.len()));
            buf.put_slice(&body[copied..start]);
            buf.put_slice(MARKER.as_bytes());
            copied = found.end();
            // A token is never empty, so the search moves on.
            at = found.end().max(found.start() + 1);
        }
        let mut buf = out?;
        buf.put_slice(&body[copied..]);
        Some(buf)
    }

    /// A scrubber for every webhook token of this configuration: `webhook.tokens`, and the
    /// generated one in the data directory if there is one (kept after tokens were configured,
    /// deliveries may still carry it).
    pub fn configured(config: &crate::config::Config) -> Result<Scrubber, regex::Error> {
        let data = crate::datadir::DataDir::new(&config.store.data_dir);
        let generated = data.read_secret(crate::datadir::WEBHOOK_TOKEN_FILE);
        Scrubber::new(
            config
                .webhook
                .tokens
                .iter()
                .chain(generated.iter())
                .map(model::secret::Secret::expose),
        )
    }

    /// Whether any token is known.
    pub fn is_active(&self) -> bool {
        self.pattern.is_some()
    }
}

/// A regex matching `token` in any of the spellings the module doc lists.
fn spellings(token: &str) -> String {
    let mut out = String::from("(?:");
    for c in token.chars() {
        let mut forms = vec![regex::escape(c.encode_utf8(&mut [0; 4]))];
        let mut units = [0u16; 2];
        let escaped: String = c
            .encode_utf16(&mut units)
            .iter()
            .map(|unit| format!(r"\\u{}", hex_either_case(&format!("{unit:04x}"))))
            .collect();
        forms.push(escaped);
        match c {
            '/' => forms.push(r"\\/".into()),
            '"' => forms.push(r#"\\""#.into()),
            '\\' => forms.push(r"\\\\".into()),
            _ => {}
        }
        let percent: String = c
            .encode_utf8(&mut [0; 4])
            .bytes()
            .map(|b| format!(r"(?:%|\\u0025){}", hex_either_case(&format!("{b:02x}"))))
            .collect();
        forms.push(percent);
        out.push_str("(?:");
        out.push_str(&forms.join("|"));
        out.push(')');
    }
    out.push(')');
    out
}

/// `4a` -> `4[aA]`.
fn hex_either_case(hex: &str) -> String {
    hex.chars()
        .map(|d| {
            if d.is_ascii_alphabetic() {
                format!("[{}{}]", d.to_ascii_lowercase(), d.to_ascii_uppercase())
            } else {
                d.to_string()
            }
        })
        .collect()
}

/// Whether the byte at `at` follows an odd run of backslashes (it is escaped).
fn escaped(body: &[u8], at: usize) -> bool {
    body[..at].iter().rev().take_while(|&&b| b == b'\\').count() % 2 == 1
}

/// Where a replacement starting at `at` must start so that it leaves no broken escape: at the
/// backslash of an escape `at` is inside of (`\n`, `\u00e9`), else at `at`.
fn escape_start(body: &[u8], at: usize) -> usize {
    if at > 0 && escaped(body, at) {
        return at - 1;
    }
    // Inside the four hex digits of a `\u` escape: the backslash is 2 to 5 bytes back.
    (at.saturating_sub(5)..at.saturating_sub(1))
        .find(|&q| body[q] == b'\\' && body[q + 1] == b'u' && !escaped(body, q))
        .unwrap_or(at)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: &str = "tok-EN_0123456789abcdef";

    fn scrub(tokens: &[&str], body: &str) -> String {
        let s = Scrubber::new(tokens.iter().copied()).expect("scrubber");
        String::from_utf8(s.scrub(body.as_bytes()).into_owned()).expect("utf8")
    }

    /// `\uXXXX` for every character of `s`, hex in the given case.
    fn json_escaped(s: &str, upper: bool) -> String {
        s.chars()
            .map(|c| {
                let hex = format!("{:04x}", c as u32);
                format!("\\u{}", if upper { hex.to_uppercase() } else { hex })
            })
            .collect()
    }

    #[test]
    fn an_owned_body_is_kept_when_clean_and_replaced_when_not() {
        let scrubber = Scrubber::new([TOKEN]).expect("scrubber");
        let clean = bytes::BytesMut::from(&b"{\"nothing\": \"here\"}"[..]);
        let at = clean.as_ptr();
        let kept = scrubber.clone().scrub_owned(clean);
        assert_eq!(kept.as_ptr(), at, "a clean body is the same buffer");
        let body = format!(r#"{{"u":"https://h/webhook/{TOKEN}","t":"a%2F{TOKEN}"}}"#);
        let owned = scrubber.scrub_owned(bytes::BytesMut::from(body.as_bytes()));
        assert_eq!(&owned[..], &scrubber.scrub(body.as_bytes())[..]);
        assert!(!String::from_utf8_lossy(&owned).contains(TOKEN));
    }

    #[test]
    fn a_token_in_the_webhook_url_becomes_the_marker_and_the_json_stays_valid() {
        for url in [
            format!("https://bridge.example.com/webhook/{TOKEN}"),
            format!("https://bridge.example.com/webhook/closer?token={TOKEN}&x=1"),
        ] {
            let body = serde_json::json!({"id": "d1", "webhookUrl": url, "messages": []});
            let out = scrub(&[TOKEN], &body.to_string());
            assert!(!out.contains(TOKEN), "{out}");
            let parsed: serde_json::Value = serde_json::from_str(&out).expect("still JSON");
            assert_eq!(parsed["id"], "d1");
            assert!(parsed["webhookUrl"]
                .as_str()
                .is_some_and(|u| u.contains(MARKER)));
        }
    }

    #[test]
    fn every_spelling_is_replaced() {
        let half = TOKEN.len() / 2;
        let percent: String = TOKEN.bytes().map(|b| format!("%{b:02X}")).collect();
        let json_percent: String = TOKEN.bytes().map(|b| format!("\\u0025{b:02x}")).collect();
        let spellings = [
            TOKEN.to_owned(),
            json_escaped(TOKEN, false),
            json_escaped(TOKEN, true),
            // Mixed: half escaped, half literal.
            format!("{}{}", json_escaped(&TOKEN[..half], false), &TOKEN[half..]),
            percent,
            json_percent,
        ];
        for spelled in spellings {
            let body = format!(r#"{{"webhookUrl":"https:\/\/h\/webhook\/{spelled}","n":1}}"#);
            let out = scrub(&[TOKEN], &body);
            let parsed: serde_json::Value =
                serde_json::from_str(&out).unwrap_or_else(|e| panic!("{spelled}: {e}: {out}"));
            assert_eq!(
                parsed["webhookUrl"],
                format!("https://h/webhook/{MARKER}"),
                "{spelled}"
            );
            assert_eq!(parsed["n"], 1);
        }
    }

    #[test]
    fn every_token_of_a_rotation_is_replaced_wherever_it_occurs() {
        let other = "another-token-0123456789";
        let body = format!("not json at all {TOKEN} then {other}{TOKEN}\n\u{0}\u{ff}");
        let out = scrub(&[TOKEN, other], &body);
        assert_eq!(
            out,
            format!("not json at all {MARKER} then {MARKER}{MARKER}\n\u{0}\u{ff}")
        );
        // Raw bytes that are not UTF-8 around it.
        let mut raw = vec![0xff, 0xfe];
        raw.extend_from_slice(TOKEN.as_bytes());
        raw.push(0x80);
        let s = Scrubber::new([TOKEN]).expect("scrubber");
        let mut expected = vec![0xff, 0xfe];
        expected.extend_from_slice(MARKER.as_bytes());
        expected.push(0x80);
        assert_eq!(s.scrub(&raw).as_ref(), expected.as_slice());
    }

    #[test]
    fn a_token_that_prefixes_another_leaves_no_tail() {
        let long = format!("{TOKEN}-longer");
        assert_eq!(
            scrub(&[TOKEN, &long], &format!("a {long} b")),
            format!("a {MARKER} b")
        );
    }

    #[test]
    fn a_match_starting_inside_an_escape_takes_the_escape_along() {
        // The token's first letter is the `n` of `\n`; its first digits are inside `\u00`.
        let token = "n0123456789abcdefgh";
        let body = format!(r#"{{"a":"x\{token}y"}}"#);
        let out = scrub(&[token], &body);
        let parsed: serde_json::Value = serde_json::from_str(&out).expect("JSON");
        assert_eq!(parsed["a"], format!("x{MARKER}y"));

        let token = "00e9abcdefghijklmnop";
        let body = format!(r#"{{"a":"x\u{token}y"}}"#);
        let out = scrub(&[token], &body);
        let parsed: serde_json::Value = serde_json::from_str(&out).expect("JSON");
        assert_eq!(parsed["a"], format!("x{MARKER}y"));

        // An escaped backslash before the token: the token is literal there, the pair stays.
        let body = format!(r#"{{"a":"x\\{TOKEN}"}}"#);
        let out = scrub(&[TOKEN], &body);
        let parsed: serde_json::Value = serde_json::from_str(&out).expect("JSON");
        assert_eq!(parsed["a"], format!("x\\{MARKER}"));
    }

    #[test]
    fn a_body_without_a_token_is_borrowed_unchanged() {
        let s = Scrubber::new([TOKEN]).expect("scrubber");
        let body = br#"{"id":"d1","webhookUrl":"https://h/webhook/other"}"#;
        assert!(matches!(s.scrub(body), Cow::Borrowed(b) if b == body));
        let none = Scrubber::new(["", ""]).expect("scrubber");
        assert!(!none.is_active());
        assert!(matches!(
            none.scrub(b"anything"),
            Cow::Borrowed(b"anything")
        ));
    }

    #[test]
    fn a_body_quarantined_by_an_older_build_is_scrubbed_when_reprocessed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store: storage::Store = std::sync::Arc::new(
            storage::SledStore::open(&dir.path().join("store"), 8 * 1024 * 1024).expect("open"),
        );
        let body = format!(
            r#"{{"id":"d-old","webhookId":"w","webhookUrl":"https://h/webhook/{TOKEN}","messages":[{{"id":"e-old","event":"bot.message.received","sourceType":"bot","sourceId":"B1","timestamp":1,"data":{{"message":{{"id":"m-1","conversationId":"c-1","isUser":true,"meta":null,"data":{{"type":"text","text":"my hook: {TOKEN}"}}}}}}}}]}}"#
        );
        let record = storage::QuarantineRecord::new(
            "delivery",
            "invalid_format",
            "stored before scrubbing",
            body.as_bytes(),
            1,
        );
        let id = store.quarantine(record).expect("quarantine");
        let scrubber = Scrubber::new([TOKEN]).expect("scrubber");
        let out = crate::intake::reprocess_offline(
            &*store,
            id,
            &model::webhook::Checks::NONE,
            2,
            &scrubber,
        )
        .expect("reprocess")
        .expect("record");
        assert_eq!((out.status.as_str(), out.accepted), ("accepted", 1));
        let (event, _) = store
            .event_status(&model::ids::EventId::new("e-old"))
            .expect("read")
            .expect("stored");
        let text = event.event.get();
        assert!(!text.contains(TOKEN), "{text}");
        assert!(text.contains(&format!("my hook: {MARKER}")), "{text}");
    }

    #[test]
    fn scrubbing_is_idempotent_and_keeps_ids() {
        let body = format!(
            r#"{{"id":"d-1","webhookUrl":"/webhook/{TOKEN}","messages":[{{"id":"e-1"}}]}}"#
        );
        let once = scrub(&[TOKEN], &body);
        assert_eq!(scrub(&[TOKEN], &once), once);
        let parsed: serde_json::Value = serde_json::from_str(&once).expect("JSON");
        assert_eq!(parsed["id"], "d-1");
        assert_eq!(parsed["messages"][0]["id"], "e-1");
    }
}
