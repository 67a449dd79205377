//! Issue 19: the upstream is never silently the emulator, and configuration errors and output
//! never show a secret (a mistyped key's value, credentials in `upstream.url`).

use super::tests::{env, write};
use super::*;

fn load(file: Option<&Path>, pairs: &[(&str, &str)]) -> Result<Config, ConfigError> {
    Config::load_from(file, env(pairs), &Overrides::default())
}

#[test]
fn no_configuration_runs_the_embedded_emulator() {
    let c = load(None, &[]).expect("defaults");
    assert!(c.upstream.is_embedded());
    assert_eq!(c.upstream.mode(), "embedded");
    assert_eq!(c.upstream.url, "embedded", "said explicitly once loaded");
}

#[test]
fn an_api_key_without_a_url_is_refused_naming_upstream_url() {
    let dir = tempfile::tempdir().expect("tempdir");
    let key_file = dir.path().join("api_key");
    std::fs::write(&key_file, "from-a-file-0123456789\n").expect("write");
    let key_file = key_file.display().to_string();
    let (_d, file) = write("[upstream]\napi_key = \"in-the-file-0123456789\"\n");
    type Case<'a> = (Option<&'a Path>, Vec<(&'a str, &'a str)>);
    let cases: [Case; 3] = [
        (Some(&file), vec![]),
        (
            None,
            vec![("HANDOFF_BRIDGE_UPSTREAM_API_KEY", "in-the-env-0123456789")],
        ),
        (
            None,
            vec![("HANDOFF_BRIDGE__UPSTREAM__API_KEY_FILE", key_file.as_str())],
        ),
    ];
    for (file, pairs) in cases {
        let err = load(file, &pairs).expect_err("refused");
        let text = err.to_string();
        assert!(
            matches!(&err, ConfigError::Invalid(p) if p.iter().any(|p| p.key == "upstream.url")),
            "{text}"
        );
        for secret in ["in-the-file", "in-the-env", "from-a-file"] {
            assert!(!text.contains(secret), "{text}");
        }
    }
}

#[test]
fn embedded_asked_for_or_a_url_is_accepted_with_a_key() {
    let key = ("HANDOFF_BRIDGE_UPSTREAM_API_KEY", "in-the-env-0123456789");
    let c = load(None, &[key, ("HANDOFF_BRIDGE_UPSTREAM_URL", "embedded")]).expect("embedded");
    assert_eq!(c.upstream.mode(), "embedded");
    let c = Config::load_from(
        None,
        env(&[key]),
        &Overrides {
            upstream: Some("embedded".into()),
            ..Overrides::default()
        },
    )
    .expect("--upstream embedded");
    assert_eq!(c.upstream.mode(), "embedded");
    let c = load(
        None,
        &[key, ("HANDOFF_BRIDGE_UPSTREAM_URL", "http://10.0.0.1:9000")],
    )
    .expect("remote");
    assert_eq!(c.upstream.mode(), "remote");
}

#[test]
fn credentials_in_urls_are_masked() {
    let cases = [
        (
            "http://user:s3cr3t@api.example.com/v1?x=1",
            "http://user:****@api.example.com/v1?x=1",
        ),
        (
            "http://t0k3n@api.example.com",
            "http://****@api.example.com",
        ),
        (
            "http://api.example.com/v1?token=s3cr3t&page=2&api_key=s3cr3t&Secret=s3cr3t#f",
            "http://api.example.com/v1?token=****&page=2&api_key=****&Secret=****#f",
        ),
        (
            "http://api.example.com:8080/v1",
            "http://api.example.com:8080/v1",
        ),
        ("embedded", "embedded"),
    ];
    for (url, masked) in cases {
        assert_eq!(mask_url(url), masked, "{url}");
    }
    let c = load(
        None,
        &[(
            "HANDOFF_BRIDGE_UPSTREAM_URL",
            "http://user:s3cr3t@127.0.0.1:9/v1?token=s3cr3t",
        )],
    )
    .expect("valid");
    let shown = c.to_masked_toml();
    assert!(!shown.contains("s3cr3t"), "{shown}");
    assert!(
        shown.contains("http://user:****@127.0.0.1:9/v1?token=****"),
        "{shown}"
    );
    // An invalid one is reported masked too.
    let err = load(
        None,
        &[(
            "HANDOFF_BRIDGE_UPSTREAM_URL",
            "ftp://user:s3cr3t@host/?key=s3cr3t",
        )],
    )
    .expect_err("not http");
    let text = err.to_string();
    assert!(
        text.contains("upstream.url") && !text.contains("s3cr3t"),
        "{text}"
    );
}

#[test]
fn a_mistyped_key_never_echoes_its_value() {
    let (_d, file) = write(
        "[upstream]\napikey = \"s3cr3t-value\"\n[admin]\ntokn = \"s3cr3t-admin\"\n[upstraem]\napi_key = \"s3cr3t-section\"\n",
    );
    let err = load(
        Some(&file),
        &[("HANDOFF_BRIDGE__UPSTREAM__APIKEY", "s3cr3t-env")],
    )
    .expect_err("unknown keys");
    let text = err.to_string();
    for key in ["upstream.apikey", "admin.tokn", "upstraem"] {
        assert!(text.contains(key), "{key} named: {text}");
    }
    assert!(text.contains("HANDOFF_BRIDGE__UPSTREAM__APIKEY"), "{text}");
    assert!(!text.contains("s3cr3t"), "{text}");
}

#[test]
fn a_section_given_as_a_value_is_not_echoed() {
    let (_d, file) = write("upstream = \"s3cr3t-as-section\"\n");
    let text = load(Some(&file), &[]).expect_err("wrong type").to_string();
    assert!(
        text.contains("upstream") && !text.contains("s3cr3t"),
        "{text}"
    );
}

#[test]
fn a_toml_syntax_error_does_not_quote_the_line() {
    let (_d, file) = write("[upstream]\napi_key = s3cr3t-unquoted\n");
    let err = load(Some(&file), &[]).expect_err("syntax");
    let text = err.to_string();
    assert!(!text.contains("s3cr3t"), "{text}");
    assert!(text.contains("line 2"), "says where: {text}");
}
