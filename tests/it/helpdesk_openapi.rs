//! Issue 6, done-when 5: the agent API's OpenAPI document, as the real daemon serves it, is a
//! valid OpenAPI 3.1 document. Parsing it (tests/it/helpdesk_api.rs) proves little: a parser
//! accepts documents the specification does not. Here it is validated against the official OAS
//! 3.1 JSON Schema (vendored in tests/data, see its README there), and every `$ref` in it must
//! point at something inside it.

use crate::common::TestApp;
use serde_json::{json, Value};

/// The document the daemon serves (it needs no token, even with the agent API off).
fn served_document() -> Value {
    let app = TestApp::spawn();
    let (status, text) = app.get("/helpdesk/v1/openapi.json");
    assert_eq!(status, 200, "{text}");
    serde_json::from_str(&text).expect("the document is JSON")
}

/// The official OAS 3.1 schema (`https://spec.openapis.org/oas/3.1/schema/2022-10-07`).
fn oas_validator() -> jsonschema::Validator {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/oas-3.1-schema.json"
    );
    let text = std::fs::read_to_string(path).expect("the vendored OAS 3.1 schema");
    let schema: Value = serde_json::from_str(&text).expect("schema JSON");
    assert_eq!(
        schema["$id"], "https://spec.openapis.org/oas/3.1/schema/2022-10-07",
        "the vendored file is the OAS 3.1 schema"
    );
    jsonschema::draft202012::new(&schema).expect("the OAS schema compiles")
}

/// Every violation, as `<instance path>: <message>`.
fn violations(validator: &jsonschema::Validator, doc: &Value) -> Vec<String> {
    validator
        .iter_errors(doc)
        .map(|e| format!("{}: {e}", e.instance_path))
        .collect()
}

/// Every `$ref` of `doc` (with where it is) that does not resolve inside `doc`: a local
/// reference (`#/...`) whose JSON pointer finds nothing, or any non-local reference (the
/// document is meant to stand alone).
fn unresolved_refs(doc: &Value) -> (usize, Vec<String>) {
    fn walk(node: &Value, at: &str, root: &Value, seen: &mut usize, bad: &mut Vec<String>) {
        match node {
            Value::Object(map) => {
                for (key, value) in map {
                    if key == "$ref" {
                        *seen += 1;
                        let target = value.as_str().and_then(|r| r.strip_prefix('#'));
                        // The fragment is a JSON pointer (RFC 6901; `~1` and `~0` are
                        // unescaped by `Value::pointer`).
                        let resolves = target.is_some_and(|p| root.pointer(p).is_some());
                        if !resolves {
                            bad.push(format!("{at}/$ref = {value}"));
                        }
                    } else {
                        let escaped = key.replace('~', "~0").replace('/', "~1");
                        walk(value, &format!("{at}/{escaped}"), root, seen, bad);
                    }
                }
            }
            Value::Array(items) => {
                for (i, item) in items.iter().enumerate() {
                    walk(item, &format!("{at}/{i}"), root, seen, bad);
                }
            }
            _ => {}
        }
    }
    let mut seen = 0;
    let mut bad = Vec::new();
    walk(doc, "", doc, &mut seen, &mut bad);
    (seen, bad)
}

#[test]
fn the_served_document_validates_against_the_official_openapi_3_1_schema() {
    let doc = served_document();
    assert!(
        doc["openapi"]
            .as_str()
            .is_some_and(|v| v.starts_with("3.1.")),
        "{}",
        doc["openapi"]
    );
    let validator = oas_validator();
    let problems = violations(&validator, &doc);
    assert!(problems.is_empty(), "{problems:#?}");

    // The validator is not one that accepts anything: the same document with a required field
    // gone, a wrong type, or a path not starting with `/` fails, each where it is wrong.
    let mut no_info = doc.clone();
    no_info.as_object_mut().expect("object").remove("info");
    assert!(!violations(&validator, &no_info).is_empty(), "no info");
    let mut bad_version = doc.clone();
    bad_version["openapi"] = json!("3.0.3");
    let problems = violations(&validator, &bad_version);
    assert!(
        problems.iter().any(|p| p.starts_with("/openapi")),
        "3.0 is not 3.1: {problems:#?}"
    );
    let mut bad_path = doc.clone();
    let paths = bad_path["paths"].as_object_mut().expect("paths");
    let (first, item) = paths
        .iter()
        .next()
        .map(|(k, v)| (k.clone(), v.clone()))
        .expect("a path");
    paths.remove(&first);
    paths.insert(first.trim_start_matches('/').to_owned(), item);
    assert!(
        !violations(&validator, &bad_path).is_empty(),
        "a path must start with /"
    );
    let mut bad_response = doc.clone();
    let op = bad_response["paths"]
        .as_object_mut()
        .and_then(|p| p.values_mut().next())
        .and_then(|item| item.as_object_mut())
        .and_then(|item| item.values_mut().find(|v| v.get("responses").is_some()))
        .expect("an operation with responses");
    op["responses"] = json!({ "200": "fine" });
    let problems = violations(&validator, &bad_response);
    assert!(
        problems.iter().any(|p| p.contains("/responses/200")),
        "a response is an object: {problems:#?}"
    );
}

#[test]
fn every_ref_in_the_served_document_resolves_inside_it() {
    let doc = served_document();
    let (seen, bad) = unresolved_refs(&doc);
    assert!(bad.is_empty(), "unresolved: {bad:#?}");
    // The document does use references (its schemas are components), so the walk checked some.
    assert!(seen > 0, "no $ref found: the walk saw nothing to check");
    assert!(
        doc["components"]["schemas"]
            .as_object()
            .is_some_and(|s| !s.is_empty()),
        "{:#}",
        doc["components"]
    );

    // The check finds a dangling reference, a non-local one, and a bad pointer escape.
    let mut broken = doc.clone();
    let schemas = broken["components"]["schemas"]
        .as_object_mut()
        .expect("schemas");
    let name = schemas.keys().next().cloned().expect("a schema");
    schemas.remove(&name);
    let (_, bad) = unresolved_refs(&broken);
    assert!(
        bad.iter().any(|b| b.contains(&name)),
        "removing {name} leaves its references dangling: {bad:#?}"
    );
    let mut foreign = doc.clone();
    foreign["components"]["schemas"]["Foreign"] = json!({ "$ref": "other.json#/Foo" });
    foreign["components"]["schemas"]["Escaped"] = json!({ "$ref": "#/paths/~2nope" });
    let (_, mut bad) = unresolved_refs(&foreign);
    bad.sort();
    assert_eq!(
        bad,
        vec![
            r##"/components/schemas/Escaped/$ref = "#/paths/~2nope""##.to_owned(),
            r##"/components/schemas/Foreign/$ref = "other.json#/Foo""##.to_owned(),
        ],
    );
}
