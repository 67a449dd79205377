//! Only `serve` and `check` read the files the config names (issue 19's review): an operator's
//! offline commands work with a TLS key only the service's user can read, or one not there yet.

use crate::common::{cli, cli_ok};

#[test]
fn offline_commands_work_with_an_unreadable_tls_key_and_check_reports_it() {
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data");
    std::fs::create_dir_all(&data).expect("data dir");
    let config = tmp.path().join("bridge.toml");
    std::fs::write(
        &config,
        format!(
            "[server.tls]\ncert_file = \"{0}/missing/tls.crt\"\nkey_file = \"{0}/missing/tls.key\"\n",
            tmp.path().display()
        ),
    )
    .expect("config");
    let config = config.to_str().expect("utf-8");

    let listed = cli_ok(&data, &["quarantine", "list", "--config", config]);
    assert_eq!(listed.trim(), "[]");
    let state = cli(
        &data,
        &["state", "show", "no-such-conversation", "--config", config],
    );
    assert_eq!(
        state.status.code(),
        Some(1),
        "not found, not a config error: {}",
        String::from_utf8_lossy(&state.stderr)
    );

    let checked = cli(&data, &["check", "--config", config]);
    assert_eq!(checked.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&checked.stderr);
    assert!(stderr.contains("server.tls"), "{stderr}");
}
