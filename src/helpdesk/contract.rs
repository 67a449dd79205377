//! The agent API's input rules, in one place for both sides of the contract: the handlers check
//! requests with these constants and functions, and the OpenAPI document's schemas are built
//! from the same ones ([`schema`]), so the document says exactly what the handlers accept.

use crate::helpdesk::idempotency;
use engine::state::desk::DeskPhase;
use utoipa::openapi::schema::{
    AdditionalProperties, ArrayBuilder, ObjectBuilder, OneOfBuilder, Schema, SchemaType, Type,
};
use utoipa::openapi::RefOr;

/// Longest agent id, in characters.
pub const MAX_AGENT_ID: usize = 200;
// A reply's bounds are the service's (MESSAGE.DATA, MEDIA, CARD and BUTTON in its webhook
// format): one past them would be accepted here and then refused by the send call, a dead letter
// instead of a 400. Lengths are in characters, as the service counts them.
/// Longest reply text.
pub const MAX_TEXT: usize = 1000;
/// A media's `contentType`.
pub const MEDIA_TYPES: [&str; 4] = ["image", "video", "audio", "link"];
/// Most cards in a reply.
pub const MAX_CARDS: usize = 10;
/// Longest card title.
pub const MAX_CARD_TITLE: usize = 50;
/// Longest card description.
pub const MAX_CARD_DESCRIPTION: usize = 500;
/// Most buttons on a card.
pub const MAX_BUTTONS: usize = 9;
/// Longest button label.
pub const MAX_LABEL: usize = 255;
/// Largest flow and node id magnitude: 2^53 - 1, the integers every JSON reader (a JavaScript
/// one, or one that reads numbers as doubles) holds exactly.
pub const MAX_ID: i64 = (1 << 53) - 1;
/// The queue's `phase` query parameter: every [`DeskPhase`]'s name, then [`ALL_PHASES`]; the
/// first is the default. Built from the enum, so a phase added there is allowed here.
pub const PHASES: [&str; DeskPhase::ALL.len() + 1] = {
    let mut out = [ALL_PHASES; DeskPhase::ALL.len() + 1];
    let mut i = 0;
    while i < DeskPhase::ALL.len() {
        out[i] = DeskPhase::ALL[i].as_str();
        i += 1;
    }
    out
};
/// The `phase` that lists every phase.
pub const ALL_PHASES: &str = "all";

/// The queue's `phase` query parameter, read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PhaseQuery {
    One(DeskPhase),
    All,
}

impl PhaseQuery {
    /// The parameter's value, if it is one of [`PHASES`].
    pub fn parse(name: &str) -> Option<PhaseQuery> {
        match name {
            ALL_PHASES => Some(PhaseQuery::All),
            _ => DeskPhase::parse(name).map(PhaseQuery::One),
        }
    }

    /// The one phase asked for, `None` for all.
    pub fn phase(self) -> Option<DeskPhase> {
        match self {
            PhaseQuery::One(p) => Some(p),
            PhaseQuery::All => None,
        }
    }
}

/// The queue's `after` query parameter: a page's `next`, base64url (no padding), at most this
/// many characters.
pub const MAX_CURSOR: usize = storage::desk::MAX_CURSOR_LEN;
/// The pattern of a cursor: canonical base64url without padding (whole groups of 4, then 2 or 3
/// characters whose unused low bits are 0), which is what `DeskCursor::decode` accepts.
pub const CURSOR_PATTERN: &str =
    "^(?:[A-Za-z0-9_-]{4})*(?:[A-Za-z0-9_-][AQgw]|[A-Za-z0-9_-]{2}[AEIMQUYcgkosw048])?$";
/// The queue's `limit` query parameter: its range and default.
pub const LIMIT_MIN: usize = 1;
pub const LIMIT_MAX: usize = 1000;
pub const LIMIT_DEFAULT: usize = 100;

/// Unicode's `White_Space` characters, which `char::is_whitespace` (and so `str::trim`) tests:
/// written out so the document's "not blank" pattern names the same set.
const WHITE_SPACE: [char; 25] = [
    '\u{9}', '\u{a}', '\u{b}', '\u{c}', '\u{d}', ' ', '\u{85}', '\u{a0}', '\u{1680}', '\u{2000}',
    '\u{2001}', '\u{2002}', '\u{2003}', '\u{2004}', '\u{2005}', '\u{2006}', '\u{2007}', '\u{2008}',
    '\u{2009}', '\u{200a}', '\u{2028}', '\u{2029}', '\u{202f}', '\u{205f}', '\u{3000}',
];

/// Whether `s` has no character but white space (or none at all).
pub fn blank(s: &str) -> bool {
    s.chars().all(|c| WHITE_SPACE.contains(&c))
}

/// A JSON Schema pattern (ECMA-262; unanchored, so it matches a string that holds a match
/// anywhere) for "not [`blank`]": some character outside [`WHITE_SPACE`].
pub fn non_blank_pattern() -> String {
    let class: String = WHITE_SPACE
        .iter()
        .map(|c| format!("\\u{:04x}", u32::from(*c)))
        .collect();
    format!("[^{class}]")
}

/// An agent id's rule: 1 to [`MAX_AGENT_ID`] characters, not blank.
pub fn valid_agent_id(id: &str) -> bool {
    !blank(id) && id.chars().count() <= MAX_AGENT_ID
}

/// At most `max` characters.
pub fn within(text: &str, max: usize) -> bool {
    text.chars().count() <= max
}

/// Not blank, and at most `max` characters.
pub fn non_blank_within(text: &str, max: usize) -> bool {
    !blank(text) && within(text, max)
}

/// An optional JSON integer as JSON Schema counts them: any number with no fractional part
/// (`2.0` is the integer 2), within [`MAX_ID`] either side of 0, where a double is exact (serde
/// alone refuses `2.0` for an `i64`, and reads integers past `i64` as inexact doubles).
pub fn integral<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<i64>, D::Error> {
    use serde::de::{Deserialize as _, Error as _};
    let Some(n) = Option::<serde_json::Number>::deserialize(d)? else {
        return Ok(None);
    };
    let max = MAX_ID as f64;
    let value = match n.as_i64() {
        Some(i) => Some(i).filter(|i| i.abs() <= MAX_ID),
        None => n
            .as_f64()
            .filter(|f| f.fract() == 0.0 && f.abs() <= max)
            .map(|f| f as i64),
    };
    value.map(Some).ok_or_else(|| {
        D::Error::custom(format!(
            "invalid value: {n}, expected an integer from -{MAX_ID} to {MAX_ID}"
        ))
    })
}

/// The `Idempotency-Key` pattern, from [`idempotency::KEY_PUNCTUATION`].
pub fn key_pattern() -> String {
    let punct: String = idempotency::KEY_PUNCTUATION
        .iter()
        .map(|b| match b {
            b'-' => "\\-".to_owned(),
            b => char::from(*b).to_string(),
        })
        .collect();
    format!("^[A-Za-z0-9{punct}]+$")
}

/// Schemas of the document, each built from the rules above.
pub mod schema {
    use super::*;

    fn string() -> ObjectBuilder {
        ObjectBuilder::new().schema_type(Type::String)
    }

    fn nullable(t: Type) -> SchemaType {
        SchemaType::from_iter([t, Type::Null])
    }

    fn null() -> ObjectBuilder {
        ObjectBuilder::new().schema_type(Type::Null)
    }

    fn reference(name: &str) -> RefOr<Schema> {
        RefOr::Ref(utoipa::openapi::Ref::from_schema_name(name))
    }

    fn null_or(name: &str) -> RefOr<Schema> {
        OneOfBuilder::new()
            .item(null())
            .item(reference(name))
            .into()
    }

    /// A string that is not blank.
    pub fn non_blank() -> RefOr<Schema> {
        string()
            .min_length(Some(1))
            .pattern(Some(non_blank_pattern()))
            .build()
            .into()
    }

    fn bounded_non_blank(max: usize) -> ObjectBuilder {
        string()
            .min_length(Some(1))
            .max_length(Some(max))
            .pattern(Some(non_blank_pattern()))
    }

    fn nullable_string(max: usize) -> Schema {
        ObjectBuilder::new()
            .schema_type(nullable(Type::String))
            .max_length(Some(max))
            .into()
    }

    pub fn media_type() -> RefOr<Schema> {
        string().enum_values(Some(MEDIA_TYPES)).build().into()
    }

    pub fn card_title() -> RefOr<Schema> {
        bounded_non_blank(MAX_CARD_TITLE).build().into()
    }

    pub fn card_description() -> RefOr<Schema> {
        nullable_string(MAX_CARD_DESCRIPTION).into()
    }

    pub fn card_buttons() -> RefOr<Schema> {
        ArrayBuilder::new()
            .schema_type(nullable(Type::Array))
            .items(reference("ReplyButton"))
            .max_items(Some(MAX_BUTTONS))
            .build()
            .into()
    }

    pub fn button_label() -> RefOr<Schema> {
        bounded_non_blank(MAX_LABEL).build().into()
    }

    pub fn agent_id() -> RefOr<Schema> {
        bounded_non_blank(MAX_AGENT_ID)
            .description(Some(format!(
                "The help desk's id of the agent: 1 to {MAX_AGENT_ID} characters, not blank."
            )))
            .build()
            .into()
    }

    pub fn phase() -> RefOr<Schema> {
        string()
            .description(Some(
                "`requested` (the default: waiting for an agent), `accepted` (taken through this \
                 API), `connected`, `released`, `cancelled`, `ended`, `bot`, or `all`.",
            ))
            .enum_values(Some(PHASES))
            .default(Some(PHASES[0].into()))
            .build()
            .into()
    }

    pub fn after() -> RefOr<Schema> {
        string()
            .description(Some(
                "Where to go on: the `next` of the previous page (opaque). Absent: the first page.",
            ))
            .min_length(Some(1))
            .max_length(Some(MAX_CURSOR))
            .pattern(Some(CURSOR_PATTERN))
            .build()
            .into()
    }

    pub fn limit() -> RefOr<Schema> {
        ObjectBuilder::new()
            .schema_type(Type::Integer)
            .description(Some("At most this many conversations."))
            .minimum(Some(LIMIT_MIN))
            .maximum(Some(LIMIT_MAX))
            .default(Some(LIMIT_DEFAULT.into()))
            .build()
            .into()
    }

    pub fn idempotency_key() -> RefOr<Schema> {
        string()
            .description(Some(
                "The same key returns the first answer to the same request; another request \
                 with it is 422 idempotency_key_reused.",
            ))
            .min_length(Some(1))
            .max_length(Some(idempotency::MAX_KEY_LEN))
            .pattern(Some(key_pattern()))
            .build()
            .into()
    }

    /// `ReplyMessage`: one shape per `type`, each requiring its own content; the other
    /// contents are optional (and passed on as they are), within the same bounds.
    pub fn reply_message() -> RefOr<Schema> {
        let cards = |min: usize, t: SchemaType| {
            ArrayBuilder::new()
                .schema_type(t)
                .items(reference("ReplyCard"))
                .min_items(Some(min).filter(|m| *m > 0))
                .max_items(Some(MAX_CARDS))
                .build()
        };
        let shape = |kind: &str| {
            let own = |name: &str| kind == name;
            let text: RefOr<Schema> = if own("text") {
                bounded_non_blank(MAX_TEXT).build().into()
            } else {
                nullable_string(MAX_TEXT).into()
            };
            let media = if own("media") {
                reference("ReplyMedia")
            } else {
                null_or("ReplyMedia")
            };
            let cards = if own("cards") {
                cards(1, SchemaType::Type(Type::Array))
            } else {
                cards(0, nullable(Type::Array))
            };
            ObjectBuilder::new()
                .schema_type(Type::Object)
                .property("type", string().enum_values(Some([kind])))
                .property("text", text)
                .property("media", media)
                .property("cards", cards)
                .required("type")
                .required(kind)
                .additional_properties(Some(AdditionalProperties::FreeForm(false)))
                .build()
        };
        OneOfBuilder::new()
            .description(Some(format!(
                "A reply, by `type`: `text` needs its text (not blank), `media` its media, \
                 `cards` 1 to {MAX_CARDS} cards. Text is at most {MAX_TEXT} characters."
            )))
            .item(shape("text"))
            .item(shape("media"))
            .item(shape("cards"))
            .into()
    }

    /// `FlowTarget` (transfer): a flow by id or by title, not both, optionally a node.
    pub fn flow_target() -> RefOr<Schema> {
        OneOfBuilder::new()
            .description(Some(
                "Where to send the conversation: a flow by id (`flow_id`) or by title (`flow`, \
                 not blank), not both; optionally a node of it (`node_id`).",
            ))
            .item(flow_shape(Some("flow_id")))
            .item(flow_shape(Some("flow")))
            .into()
    }

    /// `ReleaseTarget`: a [`flow_target`], or nothing (then `helpdesk.release_flow`).
    pub fn release_target() -> RefOr<Schema> {
        OneOfBuilder::new()
            .description(Some(
                "Where the bot picks up: a FlowTarget, or no flow at all (then the configured \
                 helpdesk.release_flow).",
            ))
            .item(reference("FlowTarget"))
            .item(flow_shape(None))
            .into()
    }

    /// The object with `given` (`flow_id` or `flow`) set and the other null or absent; with
    /// none given, all three are null or absent.
    fn flow_shape(given: Option<&str>) -> Schema {
        let int = |nullable_: bool| {
            let t = if nullable_ {
                nullable(Type::Integer)
            } else {
                SchemaType::Type(Type::Integer)
            };
            ObjectBuilder::new()
                .schema_type(t)
                .format(Some(utoipa::openapi::SchemaFormat::KnownFormat(
                    utoipa::openapi::KnownFormat::Int64,
                )))
                .minimum(Some(-MAX_ID))
                .maximum(Some(MAX_ID))
                .build()
        };
        let mut o = ObjectBuilder::new()
            .schema_type(Type::Object)
            .additional_properties(Some(AdditionalProperties::FreeForm(false)));
        o = match given {
            Some("flow_id") => o
                .property("flow_id", int(false))
                .required("flow_id")
                .property("flow", null()),
            Some(_) => o
                .property("flow", non_blank())
                .required("flow")
                .property("flow_id", null()),
            None => o.property("flow_id", null()).property("flow", null()),
        };
        o = if given.is_some() {
            o.property("node_id", int(true))
        } else {
            o.property("node_id", null())
        };
        Schema::Object(o.build())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_phases_are_the_desk_phases_then_all() {
        assert_eq!(PHASES[0], "requested", "the default");
        assert_eq!(PHASES.last(), Some(&"all"));
        for name in PHASES {
            let parsed = PhaseQuery::parse(name).expect("parses");
            assert_eq!(parsed.phase().map_or("all", |p| p.as_str()), name);
        }
        assert_eq!(PhaseQuery::parse("waiting"), None);
        assert_eq!(PHASES.len(), DeskPhase::ALL.len() + 1);
    }

    #[test]
    fn white_space_is_what_char_is_whitespace_says() {
        for c in (0..=0x10ffffu32).filter_map(char::from_u32) {
            assert_eq!(c.is_whitespace(), WHITE_SPACE.contains(&c), "{c:?}");
        }
        assert!(blank("") && blank(" \t\u{3000}"));
        assert!(!blank(" a "));
    }

    #[test]
    fn reply_bounds_are_the_ones_the_emulator_holds_the_service_to() {
        use emulator::validate as service;
        assert_eq!(MAX_TEXT, service::MAX_TEXT);
        assert_eq!(MEDIA_TYPES, service::MEDIA_TYPES);
        assert_eq!(MAX_CARDS, service::MAX_CARDS);
        assert_eq!(MAX_CARD_TITLE, service::MAX_CARD_TITLE);
        assert_eq!(MAX_CARD_DESCRIPTION, service::MAX_CARD_DESCRIPTION);
        assert_eq!(MAX_BUTTONS, service::MAX_BUTTONS);
        assert_eq!(MAX_LABEL, service::MAX_LABEL);
    }

    #[test]
    fn integers_are_what_json_schema_counts_and_a_double_holds_exactly() {
        #[derive(serde::Deserialize)]
        struct Ids {
            #[serde(default, deserialize_with = "integral")]
            id: Option<i64>,
        }
        let id = |text: &str| serde_json::from_str::<Ids>(text).map(|i| i.id);
        assert_eq!(id(r#"{"id": 2}"#).ok(), Some(Some(2)));
        assert_eq!(id(r#"{"id": 2.0}"#).ok(), Some(Some(2)));
        assert_eq!(id(r#"{"id": -2e3}"#).ok(), Some(Some(-2000)));
        assert_eq!(id(r#"{"id": null}"#).ok(), Some(None));
        assert_eq!(id(r#"{}"#).ok(), Some(None));
        assert_eq!(
            id(&format!(r#"{{"id": {MAX_ID}}}"#)).ok(),
            Some(Some(MAX_ID))
        );
        assert_eq!(
            id(&format!(r#"{{"id": -{MAX_ID}}}"#)).ok(),
            Some(Some(-MAX_ID))
        );
        for bad in [
            "2.5".to_owned(),
            (MAX_ID + 1).to_string(),
            "-9223372036854775809".to_owned(),
            "1e300".to_owned(),
            "\"2\"".to_owned(),
        ] {
            assert!(id(&format!(r#"{{"id": {bad}}}"#)).is_err(), "{bad}");
        }
    }

    /// A JSON Schema validator of strings with `pattern` (the ECMA-262 dialect the document
    /// declares, as a JSON Schema library reads it).
    fn matches(pattern: &str) -> impl Fn(&str) -> bool {
        let schema = serde_json::json!({"type": "string", "pattern": pattern});
        let validator = jsonschema::draft202012::new(&schema).expect("pattern compiles");
        move |s| validator.is_valid(&serde_json::json!(s))
    }

    #[test]
    fn the_patterns_say_what_the_checks_do() {
        let non_blank = matches(&non_blank_pattern());
        for s in ["a", " a", "\u{3000}x", "\u{1c}", "x\u{2028}"] {
            assert!(non_blank(s) && !blank(s), "{s:?}");
        }
        for s in ["", " ", "\t\n", "\u{2028}\u{a0}", "\u{85}\u{3000}"] {
            assert!(!non_blank(s) && blank(s), "{s:?}");
        }
        let cursor = matches(CURSOR_PATTERN);
        let accepted = |c: &str| storage::desk::DeskCursor::decode(c).is_ok();
        let mut texts: Vec<String> = [
            "", "A", "AB", "AQ", "ABC", "ABE", "AAAA", "a-_9", "AAAAAw", "AAAAAx", "AAA=", "a+b/",
            "ab cd", "é",
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        // Every 2- and 3-character tail after a whole group, from a spread of the alphabet.
        let alphabet = "AEQgwz059_-+/=";
        for a in alphabet.chars() {
            for b in alphabet.chars() {
                texts.push(format!("AAAA{a}{b}"));
                texts.push(format!("AAAAA{a}{b}"));
            }
        }
        for c in &texts {
            let document = cursor(c) && (1..=MAX_CURSOR).contains(&c.chars().count());
            assert_eq!(document, accepted(c), "{c:?}");
        }
        let key = matches(&key_pattern());
        for k in ["a", "order:42.retry_1", "A-Z_0.9:x"] {
            assert!(key(k) && idempotency::valid_key(k), "{k:?}");
        }
        for k in ["", "a/b", "has space", "k\n", "é", "a\u{0}"] {
            assert!(!key(k) && !idempotency::valid_key(k), "{k:?}");
        }
    }
}
