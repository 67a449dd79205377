//! The CLI's configuration commands, first-start token generation, and secrets kept out of
//! logs and output.

use crate::common::*;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

fn run(args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    Command::new(bin())
        .args(args)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .envs(env.iter().copied())
        .output()
        .expect("run cli")
}

#[test]
fn check_prints_the_effective_config_with_secrets_masked() {
    let secret = "very-secret-webhook-token-42";
    let admin = "very-secret-admin-token-42";
    let out = run(
        &["check", "--listen", "127.0.0.1:9999"],
        &[
            ("HANDOFF_BRIDGE_WEBHOOK_TOKENS", secret),
            ("HANDOFF_BRIDGE_ADMIN_TOKEN", admin),
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("listen = \"127.0.0.1:9999\""), "{text}");
    assert!(text.contains("****"), "{text}");
    for s in [secret, admin] {
        assert!(!text.contains(s) && !String::from_utf8_lossy(&out.stderr).contains(s));
    }
}

#[test]
fn an_invalid_config_lists_every_problem_and_exits_2() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("bad.toml");
    std::fs::write(
        &path,
        "[server]\nlisten = \"not-an-address\"\nmystery = true\n[dispatch]\nconcurrency = 0\n",
    )
    .expect("write");
    for cmd in ["check", "serve"] {
        let out = run(&[cmd, "--config", path.to_str().expect("utf8")], &[]);
        assert_eq!(out.status.code(), Some(2), "{cmd}");
        let err = String::from_utf8_lossy(&out.stderr);
        for key in ["server.listen", "server.mystery", "dispatch.concurrency"] {
            assert!(err.contains(key), "{cmd}: {key} missing from:\n{err}");
        }
        assert!(err.contains("not-an-address"), "{err}");
    }
}

#[test]
fn first_start_generates_a_token_and_prints_where_it_is_not_the_token() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let start = || {
        let mut child = Command::new(bin())
            .args([
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--admin-listen",
                "127.0.0.1:0",
            ])
            .arg("--data-dir")
            .arg(&data)
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn");
        let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
        let mut url = None;
        for line in lines.by_ref() {
            let line = line.expect("line");
            if let Some(u) = line.strip_prefix("webhook url: ") {
                url = Some(u.to_owned());
                break;
            }
        }
        let _ = child.kill();
        let _ = child.wait();
        url.expect("webhook url line")
    };
    let first = start();
    let token = std::fs::read_to_string(data.join("webhook_token")).expect("token file");
    assert_eq!(token.len(), 40);
    // Stdout is not a terminal here (as under systemd or Kubernetes, where it is a log): the
    // line says where the token is, never the token.
    assert!(
        !first.contains(&token),
        "the token stays out of stdout: {first}"
    );
    assert!(
        first.contains("/webhook/<generated token, saved in ") && first.contains("webhook_token"),
        "{first}"
    );
    let second = start();
    assert!(
        !second.contains(&token),
        "the token is printed only when generated: {second}"
    );
    assert_eq!(
        std::fs::read_to_string(data.join("webhook_token")).expect("token"),
        token,
        "kept across restarts"
    );
}

#[test]
fn tokens_and_message_texts_stay_out_of_logs_and_metrics() {
    let app = TestApp::spawn();
    let text_fixture = fixtures()
        .into_iter()
        .find(|(n, _)| n == "message-received-text.json")
        .expect("fixture");
    let (status, _) = app.post(&text_fixture.1);
    assert_eq!(status, 200);
    let (status, _) = app.post(b"{ not json");
    assert_eq!(status, 200);
    let wrong = format!("{}/webhook/wrong-token-abcdefghijkl", app.base);
    assert_eq!(app.post_to(&wrong, b"{}", Some("application/json")).0, 401);
    wait_drained(&app);
    let (_, metrics) = app.admin_get_text("/metrics");
    let logs = app.terminate_and_logs();
    let message_text = "주문한 상품이 아직 안 왔어요";
    for (name, text) in [("logs", &logs), ("metrics", &metrics)] {
        assert!(
            !text.contains(WEBHOOK_TOKEN),
            "{name} contain the webhook token"
        );
        assert!(
            !text.contains(ADMIN_TOKEN),
            "{name} contain the admin token"
        );
        assert!(
            !text.contains("wrong-token-abcdefghijkl"),
            "{name} contain a presented token"
        );
        assert!(
            !text.contains(message_text),
            "{name} contain a message text"
        );
    }
    assert!(
        logs.contains("delivery quarantined"),
        "the quarantine is logged: {logs}"
    );
}

#[test]
fn the_upstream_key_stays_out_of_logs_journal_and_check_output() {
    let key = "upstream-secret-key-abcdef-99";
    let tmp = tempfile::tempdir().expect("tempdir");
    let app = TestApp::spawn_in(
        &tmp.path().join("data"),
        Spawn {
            env: vec![
                ("HANDOFF_BRIDGE_UPSTREAM_API_KEY".into(), key.into()),
                // A key without a URL is refused: the emulator is asked for.
                ("HANDOFF_BRIDGE_UPSTREAM_URL".into(), "embedded".into()),
                ("RUST_LOG".into(), "debug".into()),
            ],
            ..Spawn::default()
        },
    );
    let emu = app.emulator_url.clone().expect("embedded");
    let conv = "5c0e9b1f-2222-4d3e-9f10-000000000001";
    let (status, _) = app.post_to(
        &format!("{emu}/_emulator/conversations/{conv}/request-agent"),
        b"{}",
        Some("application/json"),
    );
    assert_eq!(status, 200);
    // The embedded emulator authenticates with the configured key: a call with it succeeds.
    let mut resp = app
        .agent
        .get(format!("{emu}/openapi/bot/B7f3a2c"))
        .header("authorization", format!("Bearer {key}"))
        .call()
        .expect("GET");
    assert_eq!(
        resp.status().as_u16(),
        200,
        "{}",
        resp.body_mut().read_to_string().unwrap_or_default()
    );
    let (_, journal) = app.admin_get("/admin/v1/emulator/journal");
    let journal = journal.to_string();
    assert!(journal.contains("/openapi/bot/B7f3a2c"));
    let check = run(
        &["check"],
        &[
            ("HANDOFF_BRIDGE_UPSTREAM_API_KEY", key),
            ("HANDOFF_BRIDGE_UPSTREAM_URL", "embedded"),
        ],
    );
    assert!(check.status.success(), "{check:?}");
    let logs = app.terminate_and_logs();
    for (name, text) in [
        ("logs", logs),
        ("journal", journal),
        ("check", String::from_utf8_lossy(&check.stdout).into_owned()),
    ] {
        assert!(!text.contains(key), "{name} contain the upstream key");
    }
}
