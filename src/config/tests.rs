use super::*;

pub(super) fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

pub(super) fn write(text: &str) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("bridge.toml");
    std::fs::write(&path, text).expect("write");
    (dir, path)
}

fn problems(err: ConfigError) -> Vec<Problem> {
    match err {
        ConfigError::Invalid(p) => p,
        other => panic!("expected Invalid, got {other}"),
    }
}

#[test]
fn embedded_defaults_are_safe() {
    let c = Config::load_from(None, env(&[]), &Overrides::default()).expect("defaults load");
    assert_eq!(c.listen_addr().ip().to_string(), "127.0.0.1");
    assert_eq!(c.store.data_dir, std::path::PathBuf::from("./data"));
    assert!(c.webhook.tokens.is_empty());
    assert_eq!(c.webhook.max_body_bytes, 8 * 1024 * 1024);
    assert_eq!(c.webhook.dedupe_retention, Duration::from_secs(48 * 3600));
}

#[test]
fn the_documented_example_is_valid_and_names_every_key() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/bridge.toml");
    Config::load_from(Some(&path), env(&[]), &Overrides::default()).expect("example is valid");
    let example: toml::Table =
        toml::from_str(&std::fs::read_to_string(&path).expect("read")).expect("toml");
    let defaults: toml::Table = toml::from_str(DEFAULTS).expect("toml");
    fn keys(t: &toml::Table, prefix: &str, out: &mut Vec<String>) {
        for (k, v) in t {
            let path = format!("{prefix}{k}");
            match v {
                toml::Value::Table(sub) => keys(sub, &format!("{path}."), out),
                _ => out.push(path),
            }
        }
    }
    let (mut a, mut b) = (Vec::new(), Vec::new());
    keys(&example, "", &mut a);
    keys(&defaults, "", &mut b);
    a.sort();
    b.sort();
    assert_eq!(
        a, b,
        "deploy/bridge.toml and the embedded defaults must list the same keys"
    );
    assert_eq!(example, defaults, "the example shows the defaults");
}

#[test]
fn file_then_env_then_flags_override_in_order() {
    let (_d, path) = write("[server]\nlisten = \"127.0.0.1:9000\"\n[dispatch]\nconcurrency = 4\n");
    let c = Config::load_from(
        Some(&path),
        env(&[
            ("HANDOFF_BRIDGE_LISTEN", "127.0.0.1:9001"),
            ("HANDOFF_BRIDGE__DISPATCH__BATCH_SIZE", "7"),
            (
                "HANDOFF_BRIDGE_WEBHOOK_TOKENS",
                "aaaaaaaaaaaaaaaa1, bbbbbbbbbbbbbbbb2",
            ),
            ("UNRELATED", "x"),
        ]),
        &Overrides {
            upstream: None,
            listen: Some("127.0.0.1:9002".into()),
            admin_listen: None,
            data_dir: Some("/tmp/x".into()),
            check_files: false,
        },
    )
    .expect("load");
    assert_eq!(c.server.listen, "127.0.0.1:9002");
    assert_eq!(c.dispatch.concurrency, 4);
    assert_eq!(c.dispatch.batch_size, 7);
    assert_eq!(c.webhook.tokens.len(), 2);
    assert_eq!(c.webhook.tokens[1].expose(), "bbbbbbbbbbbbbbbb2");
    assert_eq!(c.store.data_dir, std::path::PathBuf::from("/tmp/x"));
}

#[test]
fn every_problem_is_reported_at_once_with_key_value_and_reason() {
    let (_d, path) = write(
        "[server]\nlisten = \"nowhere\"\nworkers = \"two\"\nbogus = 1\n[dispatch]\nconcurrency = 0\n[nosuch]\nx = 1\n",
    );
    let p = problems(
        Config::load_from(Some(&path), env(&[]), &Overrides::default()).expect_err("invalid"),
    );
    let keys: Vec<&str> = p.iter().map(|p| p.key.as_str()).collect();
    // Unknown keys, wrong types and bad values are all listed together.
    assert!(keys.contains(&"server.listen"), "{p:?}");
    assert!(keys.contains(&"dispatch.concurrency"), "{p:?}");
    assert!(keys.contains(&"server.workers"), "{p:?}");
    assert!(keys.contains(&"server.bogus"), "{p:?}");
    assert!(keys.contains(&"nosuch"), "{p:?}");
    let workers = p
        .iter()
        .find(|p| p.key == "server.workers")
        .expect("workers");
    assert_eq!(workers.value, "\"two\"");
    assert!(workers.why.contains("expected integer"), "{}", workers.why);

    let (_d2, path) = write("[server]\nlisten = \"nowhere\"\n[dispatch]\nconcurrency = 0\n[webhook]\ndedupe_retention = \"1s\"\n[outbox]\naudit_retention = \"1h\"\n[rules]\ndir = \"/nonexistent/rules\"\n");
    let p = problems(
        Config::load_from(Some(&path), env(&[]), &Overrides::default()).expect_err("invalid"),
    );
    let keys: Vec<&str> = p.iter().map(|p| p.key.as_str()).collect();
    assert_eq!(
        keys,
        vec![
            "server.listen",
            "webhook.dedupe_retention",
            "outbox.audit_retention",
            "dispatch.concurrency",
            "rules.dir"
        ]
    );
    assert_eq!(p[0].value, "nowhere");
}

#[test]
fn bad_env_values_are_reported_with_their_source() {
    let p = problems(
        Config::load_from(
            None,
            env(&[
                ("HANDOFF_BRIDGE__DISPATCH__CONCURRENCY", "lots"),
                ("HANDOFF_BRIDGE__NOPE__X", "1"),
            ]),
            &Overrides::default(),
        )
        .expect_err("invalid"),
    );
    assert_eq!(p.len(), 2, "{p:?}");
    assert!(p[0].value.contains("HANDOFF_BRIDGE__DISPATCH__CONCURRENCY"));
    assert_eq!(p[1].why, "unknown key");
}

#[test]
fn secrets_never_show_in_problems_or_the_effective_config() {
    let secret = "super-secret-token-value-1";
    let (_d, path) = write(&format!(
        "[webhook]\ntokens = \"{secret}\"\n[admin]\ntoken = \"short\"\n"
    ));
    let err = Config::load_from(Some(&path), env(&[]), &Overrides::default()).expect_err("invalid");
    assert!(!err.to_string().contains(secret), "{err}");

    let p = problems(
        Config::load_from(
            None,
            env(&[("HANDOFF_BRIDGE_ADMIN_TOKEN", "short")]),
            &Overrides::default(),
        )
        .expect_err("short token"),
    );
    assert!(p.iter().all(|p| !p.value.contains("short")), "{p:?}");

    let c = Config::load_from(
        None,
        env(&[
            ("HANDOFF_BRIDGE_WEBHOOK_TOKENS", secret),
            ("HANDOFF_BRIDGE_ADMIN_TOKEN", secret),
        ]),
        &Overrides::default(),
    )
    .expect("load");
    let shown = c.to_masked_toml();
    assert!(!shown.contains(secret), "{shown}");
    assert!(shown.contains("****"));
    assert!(!format!("{c:?}").contains(secret));
}

#[test]
fn a_missing_or_broken_file_is_a_clear_error() {
    let err = Config::load_from(
        Some(std::path::Path::new("/nonexistent/bridge.toml")),
        env(&[]),
        &Overrides::default(),
    )
    .expect_err("missing");
    assert!(matches!(err, ConfigError::Read { .. }), "{err}");
    let (_d, path) = write("[server\nlisten=");
    let err = Config::load_from(Some(&path), env(&[]), &Overrides::default()).expect_err("broken");
    assert!(matches!(err, ConfigError::Syntax { .. }), "{err}");
}

#[test]
fn upstream_settings_load_validate_and_mask_the_key() {
    let (_d, path) = write("[upstream]\nurl = \"http://127.0.0.1:9090\"\n[upstream.limits.global]\nper_second = 7\nburst = 3\n");
    let c = Config::load_from(
        Some(&path),
        env(&[("HANDOFF_BRIDGE_UPSTREAM_API_KEY", "upstream-key-123456")]),
        &Overrides::default(),
    )
    .expect("load");
    assert_eq!(c.upstream.url, "http://127.0.0.1:9090");
    assert_eq!(
        c.upstream.limits.global.per_second, 7.0,
        "an integer rate is taken as a float"
    );
    assert_eq!(
        c.upstream.resolve_api_key().expect("key").expose(),
        "upstream-key-123456"
    );
    assert!(!c.to_masked_toml().contains("upstream-key-123456"));

    let c = Config::load_from(
        None,
        env(&[]),
        &Overrides {
            upstream: Some("embedded".into()),
            ..Overrides::default()
        },
    )
    .expect("load");
    assert!(c.upstream.is_embedded());

    let p = problems(
        Config::load_from(
            None,
            env(&[
                ("HANDOFF_BRIDGE_UPSTREAM_URL", "ftp://x"),
                ("HANDOFF_BRIDGE__UPSTREAM__RETRY__MAX_ATTEMPTS", "0"),
            ]),
            &Overrides::default(),
        )
        .expect_err("invalid"),
    );
    let keys: Vec<&str> = p.iter().map(|p| p.key.as_str()).collect();
    // The client's old retry count is no longer used: accepted (with a note), never an error.
    assert_eq!(keys, vec!["upstream.url"], "{p:?}");
}

#[test]
fn the_api_key_can_come_from_a_file() {
    let (_d, path) = write("file-key-abcdef\nignored\n");
    let c = Config::load_from(
        None,
        env(&[
            (
                "HANDOFF_BRIDGE__UPSTREAM__API_KEY_FILE",
                path.to_str().expect("utf8"),
            ),
            // A key without a URL is refused (see secret_tests).
            ("HANDOFF_BRIDGE_UPSTREAM_URL", "embedded"),
        ]),
        &Overrides::default(),
    )
    .expect("load");
    assert_eq!(
        c.upstream.resolve_api_key().expect("key").expose(),
        "file-key-abcdef"
    );
}

#[test]
fn helpdesk_endpoints_are_validated_every_problem_at_once_and_secrets_never_shown() {
    let (_dir, path) = write(
        r#"
[[helpdesk.endpoints]]
name = "desk"
url = "https://desk.example/events"
secrets = ["whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"]
events = ["handoff.*"]

[[helpdesk.endpoints]]
name = "desk"
url = "ftp://user:pw@desk.example/events"
ca_file = "/nonexistent/handoff-bridge-test/ca.pem"
secrets = ["whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSx-not-base64", "plain-secret-value-1234567890"]
events = ["handof.*"]

[[helpdesk.endpoints]]
name = "bad name"
url = "not a url"
secrets = []
"#,
    );
    let files = Overrides {
        check_files: true,
        ..Overrides::default()
    };
    let p = problems(Config::load_from(Some(&path), env(&[]), &files).unwrap_err());
    let keys: Vec<&str> = p.iter().map(|p| p.key.as_str()).collect();
    for key in [
        "helpdesk.endpoints[1].name",
        "helpdesk.endpoints[1].url",
        "helpdesk.endpoints[1].ca_file",
        "helpdesk.endpoints[1].secrets[0]",
        "helpdesk.endpoints[1].secrets[1]",
        "helpdesk.endpoints[1].events",
        "helpdesk.endpoints[2].name",
        "helpdesk.endpoints[2].url",
        "helpdesk.endpoints[2].secrets",
    ] {
        assert!(keys.contains(&key), "{key} not reported: {p:#?}");
    }
    assert!(
        !keys.iter().any(|k| k.starts_with("helpdesk.endpoints[0]")),
        "{p:#?}"
    );
    let text = ConfigError::Invalid(p).to_string();
    for secret in [
        "plain-secret-value",
        "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSx",
        "user:pw",
    ] {
        assert!(!text.contains(secret), "{secret} shown in: {text}");
    }
}

#[test]
fn a_helpdesk_endpoint_takes_every_kind_by_default_and_masks_its_secrets() {
    let (_dir, path) = write(
        r#"
[[helpdesk.endpoints]]
name = "desk"
url = "http://127.0.0.1:9000/events"
secrets = ["whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"]
"#,
    );
    let c = Config::load_from(Some(&path), env(&[]), &Overrides::default()).expect("valid");
    assert_eq!(c.helpdesk.endpoints[0].events, ["*"]);
    assert_eq!(c.helpdesk.transcript_messages, 20);
    assert_eq!(c.outbox.give_up_after, Duration::from_secs(24 * 3600));
    let shown = format!("{}\n{:?}", c.to_masked_toml(), c);
    assert!(
        !shown.contains("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"),
        "{shown}"
    );
}

#[test]
fn helpdesk_tokens_and_partner_channels_load_and_tokens_stay_masked() {
    let (_d, path) = write(
        "[helpdesk.partner]\ndefault_sender_key = \"sk-default\"\n\n[helpdesk.partner.bots]\nB7f3a2c = \"sk-support-0001\"\n",
    );
    let c = Config::load_from(
        Some(&path),
        env(&[(
            "HANDOFF_BRIDGE_HELPDESK_TOKENS",
            "helpdesk-token-one-0001,helpdesk-token-two-0002",
        )]),
        &Overrides::default(),
    )
    .expect("valid");
    assert_eq!(c.helpdesk.tokens.len(), 2);
    assert_eq!(
        c.helpdesk.partner.sender_key(Some("B7f3a2c")),
        Some("sk-support-0001")
    );
    assert_eq!(
        c.helpdesk.partner.sender_key(Some("B0")),
        Some("sk-default")
    );
    for shown in [format!("{c:?}"), c.to_masked_toml()] {
        assert!(!shown.contains("helpdesk-token-one"), "{shown}");
    }
    let bad = Config::load_from(
        None,
        env(&[("HANDOFF_BRIDGE_HELPDESK_TOKENS", "short")]),
        &Overrides::default(),
    )
    .expect_err("short token");
    let p = problems(bad);
    assert!(
        p.iter()
            .any(|p| p.key == "helpdesk.tokens[0]" && p.value == "****"),
        "{p:?}"
    );
}

#[test]
fn a_mistyped_secret_is_not_shown_in_the_error() {
    let (_dir, path) = write(
        r#"
[[helpdesk.endpoints]]
name = "desk"
url = "http://127.0.0.1:9000/events"
secrets = "whsec_TOPSECRETVALUE0123456789abcdef"
"#,
    );
    let err = Config::load_from(Some(&path), env(&[]), &Overrides::default()).unwrap_err();
    let text = err.to_string();
    assert!(!text.contains("TOPSECRETVALUE"), "{text}");
    assert!(
        text.contains("secrets") || text.contains("sequence"),
        "{text}"
    );
}

#[test]
fn a_helpdesk_url_with_credentials_is_masked_like_a_secret() {
    let (_dir, path) = write(
        r#"
[[helpdesk.endpoints]]
name = "desk"
url = "http://agent:hunter2pass@127.0.0.1:9000/events"
secrets = ["whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"]
"#,
    );
    let c = Config::load_from(Some(&path), env(&[]), &Overrides::default()).expect("valid");
    assert_eq!(
        c.helpdesk.endpoints[0].url.expose(),
        "http://agent:hunter2pass@127.0.0.1:9000/events"
    );
    let shown = format!("{}\n{:?}", c.to_masked_toml(), c);
    assert!(!shown.contains("hunter2pass"), "{shown}");
}

#[test]
fn the_agent_api_address_list_and_pending_limit_load_and_are_validated() {
    let c = Config::load_from(None, env(&[]), &Overrides::default()).expect("defaults");
    assert!(c.helpdesk.allow_cidrs.is_empty(), "any address by default");
    assert_eq!(c.helpdesk.max_pending_commands, 1024);
    let c = Config::load_from(
        None,
        env(&[(
            "HANDOFF_BRIDGE__HELPDESK__ALLOW_CIDRS",
            "10.20.0.0/16,::1/128",
        )]),
        &Overrides::default(),
    )
    .expect("from the environment");
    let nets: Vec<String> = c
        .helpdesk
        .allow_cidrs
        .iter()
        .map(|n| n.to_string())
        .collect();
    assert_eq!(nets, ["10.20.0.0/16", "::1/128"]);
    let (_d, path) =
        write("[helpdesk]\nallow_cidrs = [\"10.0.0.300/8\"]\nmax_pending_commands = 0\n");
    let p = problems(
        Config::load_from(Some(&path), env(&[]), &Overrides::default()).expect_err("invalid"),
    );
    assert!(
        p.iter().any(|p| p.why.contains("allow_cidrs")),
        "a bad CIDR is named: {p:?}"
    );
    let (_d, path) = write("[helpdesk]\nmax_pending_commands = 0\n");
    let p = problems(
        Config::load_from(Some(&path), env(&[]), &Overrides::default()).expect_err("invalid"),
    );
    assert!(
        p.iter().any(|p| p.key == "helpdesk.max_pending_commands"),
        "{p:?}"
    );
}

#[test]
fn the_admin_listener_has_its_own_address_flag_env_and_an_empty_escape_hatch() {
    let load = |env: &[(&str, &str)], flag: Option<&str>| {
        Config::load_from(
            None,
            env.iter().map(|(k, v)| (k.to_string(), v.to_string())),
            &Overrides {
                admin_listen: flag.map(str::to_owned),
                ..Overrides::default()
            },
        )
    };
    let c = load(&[], None).expect("defaults");
    assert_eq!(
        c.admin_listen_addr(),
        Some("127.0.0.1:8081".parse().expect("addr"))
    );
    let c = load(&[("HANDOFF_BRIDGE_ADMIN_LISTEN", "127.0.0.1:9001")], None).expect("env");
    assert_eq!(c.admin.listen, "127.0.0.1:9001");
    let c = load(
        &[("HANDOFF_BRIDGE__ADMIN__LISTEN", "127.0.0.1:9001")],
        Some(""),
    )
    .expect("flag over env");
    assert_eq!(c.admin_listen_addr(), None, "empty: shares server.listen");
    for (bad, why) in [
        ("nowhere", "not an IP:port"),
        ("127.0.0.1:8080", "must differ"),
    ] {
        let Err(ConfigError::Invalid(p)) = load(&[], Some(bad)) else {
            panic!("{bad} accepted");
        };
        assert!(
            p.iter()
                .any(|p| p.key == "admin.listen" && p.why.contains(why)),
            "{p:?}"
        );
    }
    // Port 0 on both picks two free ports: allowed.
    let c = load(
        &[("HANDOFF_BRIDGE_LISTEN", "127.0.0.1:0")],
        Some("127.0.0.1:0"),
    );
    assert!(c.is_ok(), "{c:?}");
}

#[test]
fn trusted_proxies_and_their_header_are_read_and_checked() {
    let c = Config::load_from(
        None,
        [
            (
                "HANDOFF_BRIDGE__SERVER__TRUSTED_PROXIES".to_owned(),
                "10.0.0.0/8, ::1/128".to_owned(),
            ),
            (
                "HANDOFF_BRIDGE__SERVER__PROXY_HEADER".to_owned(),
                "forwarded".to_owned(),
            ),
        ],
        &Overrides::default(),
    )
    .expect("load");
    assert_eq!(c.server.trusted_proxies.len(), 2);
    assert_eq!(c.server.proxy_header, crate::config::ProxyHeader::Forwarded);
    let defaults = Config::load_from(None, Vec::new(), &Overrides::default()).expect("load");
    assert!(defaults.server.trusted_proxies.is_empty());
    assert_eq!(
        defaults.server.proxy_header,
        crate::config::ProxyHeader::XForwardedFor
    );
    let bad = Config::load_from(
        None,
        [(
            "HANDOFF_BRIDGE__SERVER__PROXY_HEADER".to_owned(),
            "x-real-ip".to_owned(),
        )],
        &Overrides::default(),
    );
    assert!(matches!(bad, Err(ConfigError::Invalid(_))), "{bad:?}");
}

#[test]
fn tls_on_the_public_listener_needs_the_admin_api_on_its_own() {
    let tls = [
        (
            "HANDOFF_BRIDGE__SERVER__TLS__CERT_FILE",
            "/nonexistent/tls.crt",
        ),
        (
            "HANDOFF_BRIDGE__SERVER__TLS__KEY_FILE",
            "/nonexistent/tls.key",
        ),
    ];
    let mut shared = tls.to_vec();
    shared.push(("HANDOFF_BRIDGE__ADMIN__LISTEN", ""));
    let p = problems(Config::load_from(None, env(&shared), &Overrides::default()).unwrap_err());
    let admin = p
        .iter()
        .find(|p| p.key == "admin.listen")
        .unwrap_or_else(|| panic!("admin.listen not reported: {p:#?}"));
    assert!(admin.why.contains("CLI"), "{admin:?}");
    // Its own listener (the default): fine. Without TLS an empty admin.listen is fine too.
    Config::load_from(None, env(&tls), &Overrides::default()).expect("admin on its own listener");
    Config::load_from(
        None,
        env(&[("HANDOFF_BRIDGE__ADMIN__LISTEN", "")]),
        &Overrides::default(),
    )
    .expect("no TLS");
}

#[test]
fn the_files_the_config_names_are_read_only_when_asked() {
    let dir = tempfile::tempdir().expect("tmp");
    let missing = |name: &str| dir.path().join(name).display().to_string();
    let (cert, key, ca) = (missing("tls.crt"), missing("tls.key"), missing("ca.pem"));
    let vars = env(&[
        ("HANDOFF_BRIDGE__SERVER__TLS__CERT_FILE", &cert),
        ("HANDOFF_BRIDGE__SERVER__TLS__KEY_FILE", &key),
        ("HANDOFF_BRIDGE__UPSTREAM__CA_FILE", &ca),
    ]);
    Config::load_from(None, vars.clone(), &Overrides::default())
        .expect("other commands do not read them");
    let files = Overrides {
        check_files: true,
        ..Overrides::default()
    };
    let p = problems(Config::load_from(None, vars, &files).unwrap_err());
    let keys: Vec<&str> = p.iter().map(|p| p.key.as_str()).collect();
    assert_eq!(keys, ["server.tls", "upstream.ca_file"], "{p:#?}");
}

#[test]
fn backfill_keys_load_off_turns_passes_off_and_bad_values_are_reported() {
    let c = Config::load_from(None, env(&[]), &Overrides::default()).expect("defaults");
    assert_eq!(c.backfill.interval, Duration::from_secs(60));
    assert_eq!(c.backfill.silence_alert_after, Duration::from_secs(600));
    for off in ["off", "0"] {
        let c = Config::load_from(
            None,
            env(&[("HANDOFF_BRIDGE__BACKFILL__INTERVAL", off)]),
            &Overrides::default(),
        )
        .expect("off is valid");
        assert!(c.backfill.interval.is_zero(), "{off}");
    }
    let (_d, path) = write(
        "[backfill]\ninterval = \"500ms\"\nsilence_alert_after = \"0s\"\noverlap = \"48h\"\n",
    );
    let p = problems(
        Config::load_from(Some(&path), env(&[]), &Overrides::default()).expect_err("invalid"),
    );
    let keys: Vec<&str> = p.iter().map(|p| p.key.as_str()).collect();
    assert_eq!(
        keys,
        vec![
            "backfill.interval",
            "backfill.silence_alert_after",
            "backfill.overlap"
        ]
    );
    let (_d, path) = write("[backfill]\ninterval = \"sometimes\"\n");
    let p = problems(
        Config::load_from(Some(&path), env(&[]), &Overrides::default()).expect_err("invalid"),
    );
    assert!(
        p.iter()
            .any(|p| p.key == "backfill.interval" || p.why.contains("backfill.interval")),
        "{p:?}"
    );
}

#[test]
fn backfill_reads_below_half_the_global_rate() {
    let d = Config::load_from(None, env(&[]), &Overrides::default()).expect("defaults");
    assert_eq!(d.backfill.per_second, 5.0);
    for bad in ["0", "-1", "NaN"] {
        let p = problems(
            Config::load_from(
                None,
                env(&[("HANDOFF_BRIDGE__BACKFILL__PER_SECOND", bad)]),
                &Overrides::default(),
            )
            .expect_err("invalid"),
        );
        let keys: Vec<&str> = p.iter().map(|p| p.key.as_str()).collect();
        assert_eq!(keys, ["backfill.per_second"], "{bad}: {p:?}");
    }
}

#[test]
fn each_breaker_problem_names_its_own_key() {
    for (key, value, named) in [
        (
            "HANDOFF_BRIDGE__OUTBOX__BREAKER__FAILURES",
            "0",
            "outbox.breaker.failures",
        ),
        (
            "HANDOFF_BRIDGE__OUTBOX__BREAKER__PROBE_INTERVAL",
            "0s",
            "outbox.breaker.probe_interval",
        ),
    ] {
        let p = problems(
            Config::load_from(None, env(&[(key, value)]), &Overrides::default())
                .expect_err("invalid"),
        );
        let keys: Vec<&str> = p.iter().map(|p| p.key.as_str()).collect();
        assert_eq!(keys, [named], "{p:?}");
    }
}

#[test]
fn old_retry_keys_are_accepted_from_env_and_files_with_a_note() {
    let (_d, path) = write(
        r#"
[helpdesk.retry]
give_up_after = "12h"
max = "2m"
"#,
    );
    let c = Config::load_from(
        Some(&path),
        env(&[("HANDOFF_BRIDGE__UPSTREAM__RETRY__MAX_ATTEMPTS", "3")]),
        &Overrides::default(),
    )
    .expect("old keys are never an error");
    assert_eq!(c.outbox.give_up_after, Duration::from_secs(12 * 3600));
    assert_eq!(c.outbox.retry.cap, Duration::from_secs(120));
    assert_eq!(c.deprecated.len(), 3, "{:?}", c.deprecated);
    assert!(c
        .deprecated
        .iter()
        .any(|n| n.contains("helpdesk.retry.give_up_after") && n.contains("outbox.give_up_after")));
    let d = Config::load_from(None, env(&[]), &Overrides::default()).expect("defaults");
    assert_eq!(d.outbox.give_up_after, Duration::from_secs(24 * 3600));
    assert_eq!(d.outbox.window, 10_000);
    assert_eq!(d.outbox.breaker.failures, 5);
    assert_eq!(d.outbox.breaker.probe_interval, Duration::from_secs(15));
    assert!(d.deprecated.is_empty());
}

#[test]
fn state_and_quarantine_retention_load_off_keeps_forever_and_short_values_are_refused() {
    let c = Config::load_from(None, env(&[]), &Overrides::default()).expect("defaults");
    assert_eq!(c.store.state_retention, Duration::from_secs(90 * 86_400));
    assert_eq!(
        c.store.quarantine_retention,
        Duration::from_secs(30 * 86_400)
    );
    let c = Config::load_from(
        None,
        env(&[
            ("HANDOFF_BRIDGE__STORE__STATE_RETENTION", "off"),
            ("HANDOFF_BRIDGE__STORE__QUARANTINE_RETENTION", "off"),
        ]),
        &Overrides::default(),
    )
    .expect("off is valid");
    assert!(c.store.state_retention.is_zero());
    assert!(c.store.quarantine_retention.is_zero());
    // Shorter than the event retention (168h) and the dedupe window (set to 200h here): both
    // problems, each saying which bound.
    let (_d, path) =
        write("[webhook]\ndedupe_retention = \"200h\"\n[store]\nevent_retention = \"200h\"\nstate_retention = \"100h\"\n");
    let p = problems(
        Config::load_from(Some(&path), env(&[]), &Overrides::default()).expect_err("invalid"),
    );
    let found: Vec<&str> = p
        .iter()
        .filter(|p| p.key == "store.state_retention")
        .map(|p| p.why.as_str())
        .collect();
    assert_eq!(found.len(), 2, "{p:?}");
    assert!(found[0].contains("store.event_retention"), "{p:?}");
    assert!(found[1].contains("webhook.dedupe_retention"), "{p:?}");
    let (_d, path) = write("[store]\nstate_retention = \"168h\"\n");
    Config::load_from(Some(&path), env(&[]), &Overrides::default()).expect("equal is enough");
}

#[test]
fn the_chatwoot_section_takes_its_secrets_from_the_environment_and_never_shows_them() {
    let (_dir, path) = write(
        r#"
[helpdesk.chatwoot]
url = "https://chat.example.com"
account_id = 1
inbox_id = 7

[helpdesk.chatwoot.bots.B1]
inbox_id = 9
labels = ["vip"]
"#,
    );
    let c = Config::load_from(
        Some(&path),
        env(&[
            ("HANDOFF_BRIDGE_CHATWOOT_API_TOKEN", "cw-token-0123456789"),
            (
                "HANDOFF_BRIDGE_CHATWOOT_WEBHOOK_SECRET",
                "cw-secret-0123456789",
            ),
        ]),
        &Overrides::default(),
    )
    .expect("valid");
    let cw = &c.helpdesk.chatwoot;
    assert!(cw.enabled());
    assert_eq!(cw.api_token.expose(), "cw-token-0123456789");
    assert_eq!(cw.bot(Some("B1")).0, 9);
    let shown = format!("{}{:?}", c.to_masked_toml(), c);
    assert!(
        !shown.contains("cw-token") && !shown.contains("cw-secret"),
        "{shown}"
    );
}

#[test]
fn a_bad_chatwoot_section_is_refused_with_every_problem() {
    let (_dir, path) = write(
        r#"
[helpdesk.chatwoot]
url = "chat.example.com"
"#,
    );
    let err = Config::load_from(Some(&path), env(&[]), &Overrides::default()).expect_err("bad");
    let keys: Vec<String> = problems(err).into_iter().map(|p| p.key).collect();
    for key in [
        "helpdesk.chatwoot.url",
        "helpdesk.chatwoot.account_id",
        "helpdesk.chatwoot.inbox_id",
        "helpdesk.chatwoot.api_token",
        "helpdesk.chatwoot.webhook_secret",
    ] {
        assert!(keys.iter().any(|k| k == key), "{key} in {keys:?}");
    }
}

#[test]
fn cluster_keys_load_from_the_environment_and_every_problem_is_reported() {
    let c = Config::load_from(None, env(&[]), &Overrides::default()).expect("defaults");
    assert_eq!(c.cluster.node_id, "", "generated at the start");
    assert_eq!(c.cluster.lease, Duration::from_secs(10));
    let c = Config::load_from(
        None,
        env(&[("HANDOFF_BRIDGE__CLUSTER__NODE_ID", "bridge-a.eu_1")]),
        &Overrides::default(),
    )
    .expect("a node id from the environment");
    assert_eq!(c.cluster.node_id, "bridge-a.eu_1");
    let (_d, path) = write("[cluster]\nnode_id = \"a b/c\"\nlease = \"1s\"\n");
    let p = problems(
        Config::load_from(Some(&path), env(&[]), &Overrides::default()).expect_err("invalid"),
    );
    let keys: Vec<&str> = p.iter().map(|p| p.key.as_str()).collect();
    assert_eq!(keys, ["cluster.node_id", "cluster.lease"]);
    let (_d, path) = write("[cluster]\nlease = \"11m\"\n");
    let p = problems(
        Config::load_from(Some(&path), env(&[]), &Overrides::default()).expect_err("invalid"),
    );
    assert_eq!(p.len(), 1, "{p:?}");
    assert!(p[0].why.contains("3s to 10m"), "{p:?}");
}
