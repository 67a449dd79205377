//! Issue 32: the operator console, over HTTP as a browser without JavaScript uses it (forms,
//! cookies, redirects): where it is served, signing in and the cookie's flags, the security
//! headers, an operator's actions through the agent API's path (and into the audit list), a
//! viewer's and a forged form's refusal, markup shown as text, the rules' dry run. The same
//! pages in a real browser: tests/browser/.

use crate::common::browser::{Browser, Page};
use crate::common::{poll_until, Spawn, TestApp, ADMIN_TOKEN};
use serde_json::{json, Value};
use std::time::Duration;

const VIEWER_TOKEN: &str = "test-viewer-token-0123456789";
const CONVERSATION: &str = "5c0e9b1f-2222-4d3e-9f10-000000000001";

fn app() -> TestApp {
    TestApp::spawn_with(Spawn::with_env(&[(
        "HANDOFF_BRIDGE__ADMIN__VIEWER_TOKENS",
        VIEWER_TOKEN,
    )]))
}

impl Browser {
    /// A form of the conversation page: its CSRF token and its key.
    fn command(&mut self, command: &str, extra: &[(&str, &str)]) -> Page {
        let page = self.get(&format!("/console/conversations/{CONVERSATION}"));
        assert_eq!(page.status, 200, "{}", page.body);
        let csrf = page.field("csrf", "");
        let key = page.field("key", &format!("{command}-"));
        let mut fields = vec![("csrf", csrf.as_str()), ("key", key.as_str())];
        fields.extend_from_slice(extra);
        self.post(
            &format!("/console/conversations/{CONVERSATION}/{command}"),
            &fields,
        )
    }
}

fn waiting(app: &TestApp) {
    let (status, _) = app.post(&crate::common::fixture_bytes("agent-call-requested.json"));
    assert_eq!(status, 200);
    crate::common::wait_drained(app);
}

#[test]
fn the_console_is_on_the_admin_listener_only_and_asks_to_sign_in_first() {
    let app = app();
    let mut b = Browser::new(&app);
    for path in [
        "/console/",
        "/console/queue",
        "/console/outbox",
        "/console/audit",
    ] {
        let page = b.get(path);
        assert_eq!(page.status, 303, "{path}");
        assert_eq!(page.header("location"), Some("/console/sign-in"), "{path}");
    }
    assert_eq!(b.get("/console").header("location"), Some("/console/"));
    let (status, _) = app.get("/console/sign-in");
    assert_eq!(status, 404, "never on the public listener");
}

#[test]
fn signing_in_needs_its_form_a_console_token_and_a_name_and_gives_a_strict_cookie() {
    let app = app();
    let mut b = Browser::new(&app);
    let refused = b.sign_in("not-a-token-0123456789", "Kim");
    assert_eq!(refused.status, 401);
    assert!(refused.body.contains("not valid"), "{}", refused.body);
    assert!(!b.cookies.contains_key("hb_console"));
    assert!(
        !refused.body.contains("not-a-token"),
        "the token is not echoed"
    );
    let nameless = b.sign_in(ADMIN_TOKEN, "  ");
    assert_eq!(nameless.status, 400);
    // A sign-in without its form's cookie (a form posted from elsewhere) is refused.
    let mut other = Browser::new(&app);
    let forged = other.post(
        "/console/sign-in",
        &[("token", ADMIN_TOKEN), ("name", "Kim"), ("form", "guess")],
    );
    assert_eq!(forged.status, 400);
    assert!(!other.cookies.contains_key("hb_console"));

    let ok = b.sign_in(ADMIN_TOKEN, "Kim");
    assert_eq!(ok.status, 303);
    assert_eq!(ok.header("location"), Some("/console/"));
    let session = ok.headers["set-cookie"]
        .iter()
        .find(|c| c.starts_with("hb_console="))
        .expect("session cookie");
    for flag in [
        "HttpOnly",
        "SameSite=Strict",
        "Path=/console",
        "Max-Age=28800",
    ] {
        assert!(session.contains(flag), "{flag} in {session}");
    }
    assert!(!session.contains("Secure"), "plain HTTP: not Secure");
    let overview = b.get("/console/");
    assert_eq!(overview.status, 200);
    assert!(
        overview.body.contains("Kim (operator)"),
        "{}",
        overview.body
    );
    assert!(
        !overview.body.contains(ADMIN_TOKEN),
        "no page shows a token"
    );

    let csrf = overview.field("csrf", "");
    assert_eq!(b.post("/console/sign-out", &[("csrf", &csrf)]).status, 303);
    assert_eq!(b.get("/console/").status, 303, "signed out");
}

#[test]
fn every_console_answer_carries_a_strict_policy_and_no_framing() {
    let app = app();
    let mut b = Browser::new(&app);
    b.sign_in(ADMIN_TOKEN, "Kim");
    for path in [
        "/console/",
        "/console/sign-in",
        "/console/nowhere",
        "/console/rules",
    ] {
        let page = b.get(path);
        let csp = page.header("content-security-policy").unwrap_or_default();
        assert!(csp.contains("default-src 'none'"), "{path}: {csp}");
        assert!(!csp.contains("script-src"), "no script at all: {csp}");
        assert!(csp.contains("frame-ancestors 'none'"), "{csp}");
        assert_eq!(page.header("x-frame-options"), Some("DENY"), "{path}");
        assert_eq!(page.header("cache-control"), Some("no-store"), "{path}");
        assert!(!page.body.contains("<script"), "{path}");
    }
    assert_eq!(b.get("/console/nowhere").status, 404);
    let css = b.get("/console/static/console.css");
    assert_eq!(css.status, 200);
    assert!(css
        .header("content-type")
        .unwrap_or_default()
        .starts_with("text/css"));
}

#[test]
fn an_operator_runs_a_handoff_through_the_agent_apis_path_and_the_audit_lists_it() {
    let app = app();
    waiting(&app);
    let mut b = Browser::new(&app);
    b.sign_in(ADMIN_TOKEN, "Kim");
    let overview = b.get("/console/").body;
    assert!(
        overview.contains(r#"data-figure="waiting">1<"#),
        "{overview}"
    );
    assert!(
        overview.contains(r#"<a href="/console/queue?bot=B7f3a2c">B7f3a2c</a></td><td>1</td>"#),
        "{overview}"
    );
    assert!(
        overview.contains(r#"data-figure="accepted-24h">0<"#),
        "{overview}"
    );
    let queue = b.get("/console/queue");
    assert!(
        queue.body.contains(&format!(
            "<td>1</td>\n    <td><a href=\"/console/conversations/{CONVERSATION}\">"
        )),
        "{}",
        queue.body
    );

    let accepted = b.command("accept", &[("agent", "Kim")]);
    assert_eq!(accepted.status, 303, "{}", accepted.body);
    assert_eq!(
        accepted.header("location").map(str::to_owned),
        Some(format!(
            "/console/conversations/{CONVERSATION}?done=accepted"
        ))
    );
    let (_, state) = app.admin_get(&format!("/admin/v1/conversations/{CONVERSATION}"));
    assert_eq!(state["desk"]["agent"]["id"], "Kim", "{state}");
    let page = b.get(&format!(
        "/console/conversations/{CONVERSATION}?done=accepted"
    ));
    assert!(page.body.contains("Accepted: the conversation is yours."));
    assert!(
        !b.get("/console/queue").body.contains(CONVERSATION),
        "left the queue"
    );
    let overview = b.get("/console/").body;
    assert!(
        overview.contains(r#"data-figure="waiting">0<"#),
        "{overview}"
    );
    assert!(
        overview.contains(r#"data-figure="accepted-24h">1<"#),
        "the figures move: {overview}"
    );

    // The reply form sent twice (a double click, a reload) is one reply.
    let page = b.get(&format!("/console/conversations/{CONVERSATION}"));
    let (csrf, key) = (page.field("csrf", ""), page.field("key", "reply-"));
    let fields = [
        ("csrf", csrf.as_str()),
        ("key", key.as_str()),
        ("text", "Hello from Kim"),
    ];
    let path = format!("/console/conversations/{CONVERSATION}/reply");
    assert_eq!(b.post(&path, &fields).status, 303);
    assert_eq!(b.post(&path, &fields).status, 303);
    app.settle();
    let replies = |journal: &[Value]| {
        journal
            .iter()
            .filter(|e| e.to_string().contains("Hello from Kim"))
            .count()
    };
    poll_until(
        "the reply reaches the emulator",
        Duration::from_secs(10),
        || (replies(&app.journal()) > 0).then_some(()),
    );
    app.settle();
    assert_eq!(
        replies(&app.journal()),
        1,
        "one reply for the form sent twice"
    );

    assert_eq!(b.command("release", &[]).status, 303);
    let (_, state) = app.admin_get(&format!("/admin/v1/conversations/{CONVERSATION}"));
    assert!(state["desk"]["agent"].is_null(), "released: {state}");

    let audit = b.get("/console/audit").body;
    assert!(
        audit.contains("the same form again: its first answer, nothing done twice"),
        "the repeated reply form is listed as such: {audit}"
    );
    for what in ["accept", "reply", "release"] {
        assert!(
            audit.contains(&format!(
                "<td>Kim</td><td>operator</td><td>{what} {CONVERSATION}</td><td>applied"
            )),
            "{what} in {audit}"
        );
    }
}

#[test]
fn a_viewer_sees_no_actions_and_forged_or_tokenless_forms_are_refused() {
    let app = app();
    waiting(&app);
    let mut viewer = Browser::new(&app);
    assert_eq!(viewer.sign_in(VIEWER_TOKEN, "Vee").status, 303);
    let page = viewer.get(&format!("/console/conversations/{CONVERSATION}"));
    assert_eq!(page.status, 200);
    assert!(page.body.contains("Vee (viewer)"));
    assert!(
        !page.body.contains("/accept\""),
        "no action forms for a viewer"
    );
    assert!(!page.body.contains("Release to the bot"));
    // A forged release with the viewer's own session and CSRF token.
    let csrf = page.field("csrf", "");
    let forged = viewer.post(
        &format!("/console/conversations/{CONVERSATION}/release"),
        &[("csrf", &csrf), ("key", "forged-1")],
    );
    assert_eq!(forged.status, 403, "{}", forged.body);

    let mut operator = Browser::new(&app);
    operator.sign_in(ADMIN_TOKEN, "Kim");
    let no_csrf = operator.post(
        &format!("/console/conversations/{CONVERSATION}/accept"),
        &[("key", "k-1"), ("agent", "Kim")],
    );
    assert_eq!(no_csrf.status, 403, "{}", no_csrf.body);
    let wrong_csrf = operator.post(
        &format!("/console/conversations/{CONVERSATION}/accept"),
        &[("csrf", &csrf), ("key", "k-2"), ("agent", "Kim")],
    );
    assert_eq!(wrong_csrf.status, 403, "another session's token");
    let (_, state) = app.admin_get(&format!("/admin/v1/conversations/{CONVERSATION}"));
    assert!(state["desk"]["agent"].is_null(), "nothing changed: {state}");
    assert_eq!(state["handoff"]["phase"]["value"], "requested");
}

#[test]
fn markup_in_a_users_message_is_shown_as_text() {
    let app = app();
    waiting(&app);
    // The user says it at the service (the emulator keeps the conversation's messages, which
    // the page reads through the Open API, and sends the webhook).
    app.emulator_act(
        CONVERSATION,
        "say",
        json!({"text": "<script>alert(1)</script>"}),
    );
    app.emulator_delivered();
    let mut b = Browser::new(&app);
    b.sign_in(ADMIN_TOKEN, "Kim");
    let page = b.get(&format!("/console/conversations/{CONVERSATION}"));
    assert_eq!(page.status, 200);
    assert!(!page.body.contains("<script>alert(1)"), "{}", page.body);
    assert!(
        page.body
            .contains("&#60;script&#62;alert(1)&#60;/script&#62;"),
        "{}",
        page.body
    );
}

#[test]
fn the_rules_dry_run_explains_a_pasted_event_and_stores_nothing() {
    let app = TestApp::spawn_with(Spawn::with_env(&[(
        "HANDOFF_BRIDGE__RULES__ENABLED",
        "true",
    )]));
    let mut b = Browser::new(&app);
    b.sign_in(ADMIN_TOKEN, "Kim");
    let page = b.get("/console/rules");
    assert!(page.body.contains("rule(s) in evaluation order"));
    let csrf = page.field("csrf", "");
    let event = String::from_utf8(crate::common::fixture_bytes("agent-call-requested.json"))
        .expect("utf-8");
    let report = b.post("/console/rules/test", &[("csrf", &csrf), ("event", &event)]);
    assert_eq!(report.status, 200, "{}", report.body);
    assert!(report.body.contains("rules version"), "{}", report.body);
    assert!(report.body.contains(CONVERSATION));
    let (status, _) = app.admin_get(&format!("/admin/v1/conversations/{CONVERSATION}"));
    assert_eq!(status, 404, "a dry run stores nothing");
    let bad = b.post(
        "/console/rules/test",
        &[("csrf", &csrf), ("event", "{nope")],
    );
    assert_eq!(bad.status, 200);
    assert!(
        bad.body.contains("not an event or delivery"),
        "{}",
        bad.body
    );
}

/// Rules that answer every user message: each answer is an outbox entry to make a dead letter of.
fn dead_letters(app: &TestApp) -> Vec<u64> {
    let (status, page) = app.admin_get("/admin/v1/dead-letters");
    assert_eq!(status, 200, "{page}");
    page["dead_letters"]
        .as_array()
        .expect("letters")
        .iter()
        .map(|l| l["entry"]["seq"].as_u64().expect("seq"))
        .collect()
}

fn idle(app: &TestApp) {
    let (status, body) = app.admin_get("/admin/v1/outbox/idle?timeout_ms=20000");
    assert_eq!(status, 200, "{body}");
}

#[test]
fn dead_letters_are_retried_one_by_one_or_by_filter_and_discarded_each_after_a_confirmation() {
    use crate::common::relay::{clear_faults, rules_dir, seeded_message, set_faults, ECHO_RULE};
    let tmp = tempfile::tempdir().expect("tmp");
    let rules = rules_dir(tmp.path(), ECHO_RULE);
    let app = TestApp::spawn_in(
        &tmp.path().join("data"),
        Spawn::with_env(&[("HANDOFF_BRIDGE__RULES__DIR", rules.to_str().expect("utf-8"))]),
    );
    let emu = app.emulator().to_owned();
    set_faults(
        &emu,
        json!({"fail_next": 3, "status": 400, "path_prefix": "/openapi/"}),
    );
    let events: Vec<Value> = (0..3).map(|n| seeded_message("cs", n)).collect();
    let (status, _) = app.post(&crate::common::delivery("cs-d-1", &events));
    assert_eq!(status, 200);
    crate::common::wait_drained(&app);
    idle(&app);
    clear_faults(&emu);
    let letters = dead_letters(&app);
    assert_eq!(letters.len(), 3, "{letters:?}");

    let mut b = Browser::new(&app);
    b.sign_in(ADMIN_TOKEN, "Kim");
    let outbox = b.get("/console/outbox");
    for seq in &letters {
        assert!(
            outbox.body.contains(&format!(">Retry {seq}</a>")),
            "{}",
            outbox.body
        );
    }
    // Retry the first: asked, then done; it leaves the dead letters and is carried out.
    let first = letters[0];
    let confirm = b.get(&format!("/console/dead-letters/{first}/retry"));
    assert_eq!(confirm.status, 200);
    assert!(confirm
        .body
        .contains(&format!("Retry dead letter {first}?")));
    let csrf = confirm.field("csrf", "");
    let done = b.post(
        &format!("/console/dead-letters/{first}/retry"),
        &[("csrf", &csrf)],
    );
    assert_eq!(done.status, 303, "{}", done.body);
    assert_eq!(
        done.header("location"),
        Some("/console/outbox?done=retried")
    );
    idle(&app);
    assert!(!dead_letters(&app).contains(&first));
    let (_, finished) = app.admin_get("/admin/v1/outbox/done");
    assert!(finished.to_string().contains("echo m0"), "{finished}");

    // Discard the second.
    let second = letters[1];
    let done = b.post(
        &format!("/console/dead-letters/{second}/discard"),
        &[("csrf", &csrf)],
    );
    assert_eq!(done.status, 303, "{}", done.body);
    assert_eq!(dead_letters(&app), vec![letters[2]]);

    // Retry all matching a filter that takes none, then one that takes the last.
    let none = b.get("/console/dead-letters-retry?reason=no-such-reason&queue=");
    assert!(none.body.contains("(0 now)"), "{}", none.body);
    let some = b.get("/console/dead-letters-retry?reason=&queue=c%3A");
    assert!(some.body.contains("(1 now)"), "{}", some.body);
    let done = b.post(
        "/console/dead-letters-retry",
        &[("csrf", &csrf), ("reason", ""), ("queue", "c:")],
    );
    assert_eq!(done.status, 303, "{}", done.body);
    idle(&app);
    assert!(dead_letters(&app).is_empty());

    let audit = b.get("/console/audit").body;
    for what in [
        format!("retry dead letter {first}"),
        format!("discard dead letter {second}"),
        "retry dead letters whose queue contains &#34;c:&#34;".to_owned(),
    ] {
        assert!(audit.contains(&what), "{what} in {audit}");
    }
    // A letter that is gone is said so, not retried or discarded twice, and listed as refused.
    for what in ["retry", "discard"] {
        let gone = b.post(
            &format!("/console/dead-letters/{second}/{what}"),
            &[("csrf", &csrf)],
        );
        assert_eq!(gone.status, 404, "{what}");
    }
    let audit = b.get("/console/audit").body;
    assert_eq!(
        audit.matches("refused: no such dead letter").count(),
        2,
        "{audit}"
    );
}

#[test]
fn a_quarantined_body_is_shown_escaped_and_re_processed_from_the_console() {
    let app = app();
    let body =
        br#"{"id":"q-1","webhookId":"w","webhookUrl":"u","messages":[{"id":"<b>bold</b>"}]}"#;
    let (status, answer) = app.post(body);
    assert_eq!(status, 200, "quarantined and answered 200: {answer}");
    let mut b = Browser::new(&app);
    b.sign_in(ADMIN_TOKEN, "Kim");
    let list = b.get("/console/quarantine");
    let id = list
        .body
        .split("/console/quarantine/")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .expect("a record link")
        .to_owned();
    let one = b.get(&format!("/console/quarantine/{id}"));
    assert_eq!(one.status, 200);
    assert!(
        one.body.contains("&#60;b&#62;bold&#60;/b&#62;"),
        "{}",
        one.body
    );
    assert!(!one.body.contains("<b>bold"), "escaped");
    let csrf = one.field("csrf", "");
    let done = b.post(
        &format!("/console/quarantine/{id}/reprocess"),
        &[("csrf", &csrf)],
    );
    assert_eq!(done.status, 303, "{}", done.body);
    let audit = b.get("/console/audit").body;
    assert!(
        audit.contains(&format!(
            "re-process quarantine record {id}</td><td>still_invalid"
        )),
        "{audit}"
    );
    let mut viewer = Browser::new(&app);
    viewer.sign_in(VIEWER_TOKEN, "Vee");
    let page = viewer.get(&format!("/console/quarantine/{id}"));
    assert!(!page.body.contains("Re-process"), "no action for a viewer");
    let csrf = page.field("csrf", "");
    let refused = viewer.post(
        &format!("/console/quarantine/{id}/reprocess"),
        &[("csrf", &csrf)],
    );
    assert_eq!(refused.status, 403);
}

#[test]
fn the_console_answers_only_the_admin_apis_addresses() {
    let app = TestApp::spawn_with(Spawn::with_env(&[(
        "HANDOFF_BRIDGE__ADMIN__ALLOW_CIDRS",
        "10.0.0.0/8",
    )]));
    let mut b = Browser::new(&app);
    for path in [
        "/console/sign-in",
        "/console/",
        "/console/static/console.css",
    ] {
        let page = b.get(path);
        assert_eq!(page.status, 403, "{path}: {}", page.body);
        assert!(page.body.contains("not open to this address"), "{path}");
    }
    let refused = b.post(
        "/console/sign-in",
        &[("token", ADMIN_TOKEN), ("name", "Kim"), ("form", "x")],
    );
    assert_eq!(refused.status, 403);
    assert!(!b.cookies.contains_key("hb_console"));
}

#[test]
fn the_audit_list_outlives_a_restart_and_goes_with_its_retention() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data = tmp.path().join("data");
    let opts = Spawn::with_env(&[
        ("HANDOFF_BRIDGE__ADMIN__TEST_CLOCK", "true"),
        ("HANDOFF_BRIDGE__ADMIN__CONSOLE_AUDIT_RETENTION", "2h"),
    ]);
    let accepted = format!("accept {CONVERSATION}");
    {
        let app = TestApp::spawn_in(&data, opts.clone());
        waiting(&app);
        let mut b = Browser::new(&app);
        b.sign_in(ADMIN_TOKEN, "Kim");
        assert_eq!(b.command("accept", &[("agent", "Kim")]).status, 303);
    }
    let app = TestApp::spawn_in(&data, opts);
    let mut b = Browser::new(&app);
    b.sign_in(ADMIN_TOKEN, "Lee");
    let audit = b.get("/console/audit").body;
    assert!(
        audit.contains(&accepted) && audit.contains("<td>Kim</td>"),
        "kept over the restart: {audit}"
    );
    let bad = b.get("/console/audit?before=abc");
    assert_eq!(bad.status, 400, "{}", bad.body);
    assert!(bad.body.contains("is an entry"), "{}", bad.body);
    app.advance_clock_unsettled("3h");
    let (status, report) = app.admin_post("/admin/v1/prune");
    assert_eq!(status, 200, "{report}");
    assert_eq!(report["console_actions"], 1, "{report}");
    let audit = b.get("/console/audit").body;
    assert!(
        !audit.contains(&accepted) && audit.contains("No actions yet."),
        "past its retention: {audit}"
    );
}
