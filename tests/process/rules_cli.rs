//! `rules check` and `rules test`: their documented output for good and broken rule files.

use std::path::Path;
use std::process::Command;

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_handoff-bridge")
}

fn run(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(bin())
        .args(args)
        // No stray configuration from the environment.
        .env_remove("HANDOFF_BRIDGE__RULES__DIR")
        .output()
        .expect("run the binary");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn write(dir: &Path, name: &str, text: &str) {
    std::fs::write(dir.join(name), text).expect("write rule file");
}

const GOOD: &str = r#"
[[rule]]
name = "ask-agent"
priority = 10
on = ["bot.message.received"]
stop = true
when = { all = [
  { field = "sender", equals = "user" },
  { field = "message.data.text", matches = "agent" },
] }
actions = [
  { type = "set_manual", enabled = true },
  { type = "send_message", text = "Queued, {{ conversation_id }}." },
]

[[rule]]
name = "greet"
on = ["bot.message.received"]
when = { field = "state.user_messages", equals = 1 }
actions = [{ type = "send_message", text = "Hello!" }]

[[rule]]
name = "echo"
on = ["bot.message.sent"]
echoes = true
max_firings = { count = 3, per = "1m" }
actions = [{ type = "send_message", text = "again" }]
"#;

const EVENT: &str = r#"{"id":"e-1","event":"bot.message.received","sourceType":"bot","sourceId":"B1","timestamp":1763800000000,
 "data":{"message":{"id":"m-1","conversationId":"c-1","isUser":true,"meta":null,"data":{"type":"text","text":"an agent please"}}}}"#;

#[test]
fn check_lists_the_rules_in_evaluation_order_and_warns() {
    let dir = tempfile::tempdir().expect("tempdir");
    write(dir.path(), "a.toml", GOOD);
    let path = dir.path().display().to_string();
    let (code, out, err) = run(&["rules", "check", &path]);
    assert_eq!(code, 0, "{err}");
    let version = out
        .lines()
        .next()
        .and_then(|l| l.rsplit(' ').next())
        .expect("version")
        .to_owned();
    assert_eq!(version.len(), 8, "{out}");
    let expected = format!(
        "{path}: 3 rule(s), version {version}\n\
         \x20    10  ask-agent  (a.toml)  on bot.message.received  -> set_manual, send_message\n\
         \x20     0  greet  (a.toml)  on bot.message.received  -> send_message\n\
         \x20     0  echo  (a.toml)  on bot.message.sent  -> send_message\n\
         1 warning(s):\n\
         \x20 a.toml rule echo: may loop: it listens to bot.message.sent with echoes = true and \
         takes send_message (a message it sends comes back as bot.message.sent); make sure its \
         conditions exclude what the bridge itself caused\n"
    );
    assert_eq!(out, expected);

    // Without `echoes = true` the rule never sees its own messages: it cannot loop on them.
    write(dir.path(), "a.toml", &GOOD.replace("echoes = true\n", ""));
    let (code, out, err) = run(&["rules", "check", &path]);
    assert_eq!(code, 0, "{err}");
    assert!(out.ends_with("-> send_message\nno warnings\n"), "{out}");
}

#[test]
fn check_reports_every_error_with_file_and_place_and_exits_2() {
    let dir = tempfile::tempdir().expect("tempdir");
    write(dir.path(), "a.toml", GOOD);
    write(
        dir.path(),
        "b.toml",
        r#"
[[rule]]
name = "bad"
on = ["bot.message.recieved"]
when = { field = "state.phase", matches = "(" }
actions = [{ type = "send_message", txt = "x" }]
"#,
    );
    let (code, out, err) = run(&["rules", "check", &dir.path().display().to_string()]);
    assert_eq!(code, 2, "{out}");
    for place in [
        "b.toml:2: rule[0] (bad).on[0]",
        "b.toml:2: rule[0] (bad).when.matches",
        "b.toml:2: rule[0] (bad).actions[0]",
    ] {
        assert!(err.contains(place), "missing {place} in:\n{err}");
    }
    assert!(out.is_empty(), "nothing listed for a broken set: {out}");
}

#[test]
fn test_shows_matches_failures_with_actual_values_and_rendered_actions() {
    let dir = tempfile::tempdir().expect("tempdir");
    write(dir.path(), "a.toml", GOOD);
    let event = dir.path().join("event.json");
    std::fs::write(&event, EVENT).expect("event");
    let rules = dir.path().display().to_string();
    let (code, out, err) = run(&[
        "rules",
        "test",
        "--dir",
        &rules,
        "--event",
        &event.display().to_string(),
        "--at",
        "2026-11-22T09:00:00Z",
    ]);
    assert_eq!(code, 0, "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert!(
        lines[0]
            .starts_with("event e-1 (bot.message.received), conversation c-1, at 1795338000000"),
        "{out}"
    );
    assert_eq!(
        &lines[1..],
        &[
            "MATCHED      ask-agent (priority 10, a.toml), stops",
            r#"    actions[0] {"type":"set_manual","conversation_id":"c-1","enabled":true}"#,
            r#"    actions[1] {"type":"send_message","conversation_id":"c-1","message":{"type":"text","text":"Queued, c-1."}}"#,
            "not run      greet (priority 0, a.toml): `ask-agent` stopped the event",
            "not for it   echo (priority 0, a.toml)",
        ],
        "{out}"
    );

    // A state where the user has written before: ask-agent fails on the text, greet on the count.
    let other = EVENT.replace("an agent please", "hello");
    std::fs::write(&event, other).expect("event");
    let state = dir.path().join("state.json");
    let (code, shown, err) = run(&[
        "rules",
        "test",
        "--dir",
        &rules,
        "--event",
        &event.display().to_string(),
        "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    let report: serde_json::Value = serde_json::from_str(&shown).expect("json");
    let greet = &report[0]["rules"][1];
    assert_eq!(greet["rule"], "greet");
    assert_eq!(greet["verdict"], "matched", "first message: {shown}");
    let ask = &report[0]["rules"][0];
    assert_eq!(ask["verdict"], "no_match");
    assert_eq!(ask["failure"]["at"], "when.all[1]");
    assert_eq!(ask["failure"]["actual"], "hello");

    let mut before = engine::state::ConversationState::new("c-1".into());
    before.messages.user_messages = 4;
    std::fs::write(&state, serde_json::to_vec(&before).expect("state")).expect("write");
    let (code, out, err) = run(&[
        "rules",
        "test",
        "--dir",
        &rules,
        "--event",
        &event.display().to_string(),
        "--state",
        &state.display().to_string(),
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("no match     greet (priority 0, a.toml): when failed: state.user_messages equals 1; actual: 5"),
        "the event is folded into the given state first:\n{out}"
    );
}

#[test]
fn test_shows_a_rule_held_back_by_its_cap_in_the_given_state() {
    let dir = tempfile::tempdir().expect("tempdir");
    write(dir.path(), "a.toml", GOOD);
    // The flow's own message (no marker): `echo` listens, and fired 3 times in the last minute.
    let sent = EVENT
        .replace("bot.message.received", "bot.message.sent")
        .replace("\"isUser\":true", "\"isUser\":false");
    let event = dir.path().join("event.json");
    std::fs::write(&event, sent).expect("event");
    let at: i64 = 1_795_338_000_000;
    let mut before = engine::state::ConversationState::new("c-1".into());
    let cap = engine::state::FiringCap {
        count: 3,
        per: std::time::Duration::from_secs(60),
    };
    for ago in [50_000, 30_000, 10_000] {
        before.record_firing("echo", cap, at - ago);
    }
    let state = dir.path().join("state.json");
    std::fs::write(&state, serde_json::to_vec(&before).expect("state")).expect("write");
    let (code, out, err) = run(&[
        "rules",
        "test",
        "--dir",
        &dir.path().display().to_string(),
        "--event",
        &event.display().to_string(),
        "--state",
        &state.display().to_string(),
        "--at",
        &at.to_string(),
    ]);
    assert_eq!(code, 0, "{err}");
    let lines: Vec<&str> = out.lines().skip(1).collect();
    assert_eq!(
        lines,
        [
            "not for it   ask-agent (priority 10, a.toml)",
            "not for it   greet (priority 0, a.toml)",
            "capped       echo (priority 0, a.toml): fired 3 times in the last 1m",
        ],
        "{out}"
    );
}

#[test]
fn test_refuses_what_is_not_an_event() {
    let dir = tempfile::tempdir().expect("tempdir");
    write(dir.path(), "a.toml", GOOD);
    let event = dir.path().join("event.json");
    std::fs::write(&event, r#"{"id":"x"}"#).expect("event");
    let (code, _, err) = run(&[
        "rules",
        "test",
        "--dir",
        &dir.path().display().to_string(),
        "--event",
        &event.display().to_string(),
    ]);
    assert_eq!(code, 2);
    assert!(err.contains("event.json"), "{err}");
}

#[test]
fn test_compares_with_the_given_state_and_reads_the_given_end_user() {
    let dir = tempfile::tempdir().expect("tempdir");
    write(
        dir.path(),
        "a.toml",
        r#"
[[rule]]
name = "first"
on = ["bot.message.received"]
when = { field = "state.user_messages", changed = { from = 0 } }
actions = [{ type = "send_message", text = "Hello, {{ end_user.params.name }}." }]
"#,
    );
    let event = dir.path().join("event.json");
    std::fs::write(&event, EVENT).expect("event");
    let user = dir.path().join("user.json");
    let updated = model::webhook::parse_event(
        r#"{"id":"e-0","event":"bot.end_user.updated","sourceType":"bot","sourceId":"B1","timestamp":1,
        "data":{"endUser":{"id":"u-1","platform":"web","userKey":"k-1","params":{"name":"Mina"}}}}"#,
    )
    .expect("end-user event");
    let mut end_user = engine::state::EndUserState::new("u-1".into());
    if let model::webhook::model::Payload::EndUser(u) = &updated.payload {
        end_user.apply(&updated, u);
    }
    std::fs::write(&user, serde_json::to_vec(&end_user).expect("user")).expect("write");
    let args = |state: Option<&str>| {
        let mut args = vec![
            "rules".to_owned(),
            "test".into(),
            "--dir".into(),
            dir.path().display().to_string(),
            "--event".into(),
            event.display().to_string(),
            "--end-user".into(),
            user.display().to_string(),
        ];
        if let Some(state) = state {
            args.extend(["--state".into(), state.to_owned()]);
        }
        args
    };
    // A new conversation: 0 -> 1.
    let new = args(None);
    let (code, out, err) = run(&new.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("MATCHED      first"), "{out}");
    assert!(out.contains("\"text\":\"Hello, Mina.\""), "{out}");

    // One message seen before (another one: the same message again would be a duplicate, which
    // the fold counts once): 1 -> 2 fails, and the verdict shows both values.
    let earlier = EVENT
        .replace("\"e-1\"", "\"e-0\"")
        .replace("\"m-1\"", "\"m-0\"");
    let mut before = engine::state::ConversationState::new("c-1".into());
    before.apply(&model::webhook::parse_event(&earlier).expect("event"));
    let state = dir.path().join("state.json");
    std::fs::write(&state, serde_json::to_vec(&before).expect("state")).expect("write");
    let later = args(Some(&state.display().to_string()));
    let (code, out, err) = run(&later.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains(
            "no match     first (priority 0, a.toml): when failed: state.user_messages changed \
             from 0; before: 1, after: 2"
        ),
        "{out}"
    );
}

/// Output cut short by its reader (`rules check | head -1`) ends the command quietly, as a Unix
/// tool would, instead of a panic on the closed pipe.
#[test]
fn a_reader_that_stops_early_ends_the_command_quietly() {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;
    let tmp = tempfile::tempdir().expect("tempdir");
    // Far more output than a pipe holds (64 KiB), so the command is still writing when the
    // reader goes away.
    let rules: String = (0..1500)
        .map(|i| {
            format!(
                "[[rule]]\nname = \"r{i}-a-long-enough-name-to-fill-the-pipe-sooner\"\n\
                 on = [\"bot.message.received\"]\nactions = [{{ type = \"set_manual\", enabled = true }}]\n"
            )
        })
        .collect();
    write(tmp.path(), "many.toml", &rules);
    let mut child = Command::new(bin())
        .args(["rules", "check", tmp.path().to_str().expect("utf-8")])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let stdout = child.stdout.take().expect("stdout");
    let mut first = String::new();
    BufReader::new(stdout)
        .read_line(&mut first)
        .expect("first line");
    assert!(first.contains(": 1500 rule(s)"), "{first}");
    // The reader is dropped here: the pipe closes.
    let out = child.wait_with_output().expect("wait");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}: {stderr}", out.status);
    assert!(!stderr.contains("panicked"), "{stderr}");
}
