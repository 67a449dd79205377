//! `server.trusted_proxies`: behind a trusted proxy every allow-list (`webhook.allow_cidrs`,
//! `admin.allow_cidrs`, `helpdesk.allow_cidrs`) judges the client the proxy names (the rightmost
//! untrusted address of `X-Forwarded-For`, or of `Forwarded` when configured); without trusted
//! proxies the headers are ignored. The test connects from 127.0.0.1 (the "proxy"); the other
//! addresses appear only inside headers.

use crate::common::{Spawn, TestApp, ADMIN_TOKEN, WEBHOOK_TOKEN};

const HELPDESK_TOKEN: &str = "helpdesk-token-proxy-0123456789";

/// A daemon whose three allow-lists admit only 10.0.0.0/8, with `extra` settings.
fn spawn(extra: &[(&str, &str)]) -> (tempfile::TempDir, TestApp) {
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut env = vec![
        ("HANDOFF_BRIDGE__WEBHOOK__ALLOW_CIDRS", "10.0.0.0/8"),
        ("HANDOFF_BRIDGE__ADMIN__ALLOW_CIDRS", "10.0.0.0/8"),
        ("HANDOFF_BRIDGE__HELPDESK__ALLOW_CIDRS", "10.0.0.0/8"),
        ("HANDOFF_BRIDGE_HELPDESK_TOKENS", HELPDESK_TOKEN),
    ];
    env.extend_from_slice(extra);
    let app = TestApp::spawn_in(&tmp.path().join("data"), Spawn::with_env(&env));
    (tmp, app)
}

/// Status of a call to each allow-listed API with `header` set (none when `None`). The calls are
/// made so that an admitted caller gets a known status: the webhook 200 (a body it quarantines),
/// the admin API 200 (with its token), the agent API 401 (without a token; the address is
/// checked first, so a refused address gets 403 whatever it sends).
fn statuses(app: &TestApp, header: Option<(&str, &str)>) -> [u16; 3] {
    fn add<B>(
        req: ureq::RequestBuilder<B>,
        header: Option<(&str, &str)>,
    ) -> ureq::RequestBuilder<B> {
        match header {
            Some((name, value)) => req.header(name, value),
            None => req,
        }
    }
    let with = |req| add(req, header);
    let with_body = |req| add(req, header);
    let webhook = with_body(
        app.agent
            .post(format!("{}/webhook/{WEBHOOK_TOKEN}", app.base)),
    )
    .header("content-type", "application/json")
    .send("{}")
    .expect("POST webhook")
    .status()
    .as_u16();
    let admin = with(app.agent.get(app.admin_url("/admin/v1/quarantine")))
        .header("authorization", format!("Bearer {ADMIN_TOKEN}"))
        .call()
        .expect("GET admin")
        .status()
        .as_u16();
    let helpdesk = with(
        app.agent
            .get(format!("{}/helpdesk/v1/conversations", app.base)),
    )
    .call()
    .expect("GET agent API")
    .status()
    .as_u16();
    [webhook, admin, helpdesk]
}

const ADMITTED: [u16; 3] = [200, 200, 401];
const REFUSED: [u16; 3] = [403, 403, 403];

#[test]
fn behind_a_trusted_proxy_every_allow_list_judges_the_forwarded_client() {
    let (_tmp, app) = spawn(&[("HANDOFF_BRIDGE__SERVER__TRUSTED_PROXIES", "127.0.0.0/8")]);
    let xff = |v| Some(("x-forwarded-for", v));
    // The proxy itself (no header) is outside the lists.
    assert_eq!(statuses(&app, None), REFUSED, "the proxy's own address");
    assert_eq!(statuses(&app, xff("10.0.0.5")), ADMITTED, "a listed client");
    assert_eq!(
        statuses(&app, xff("203.0.113.9")),
        REFUSED,
        "an unlisted client"
    );
    // A client that writes a listed address itself: the proxy appends what it saw, the
    // rightmost entry, which decides.
    assert_eq!(
        statuses(&app, xff("10.0.0.5, 203.0.113.9")),
        REFUSED,
        "a spoofed left entry"
    );
    // Trusted hops on the right are skipped.
    assert_eq!(
        statuses(&app, xff("203.0.113.9, 10.0.0.5, 127.0.0.1")),
        ADMITTED,
        "the rightmost untrusted hop"
    );
    // A header that does not parse: the client is unknown, and the lists refuse it.
    assert_eq!(
        statuses(&app, xff("10.0.0.5, not-an-address")),
        REFUSED,
        "malformed"
    );
    // `Forwarded` is not the configured header: it is not read.
    assert_eq!(
        statuses(&app, Some(("forwarded", "for=10.0.0.5"))),
        REFUSED,
        "the other header"
    );
    assert!(app.terminate().success());
}

#[test]
fn without_trusted_proxies_forwarding_headers_are_ignored() {
    let (_tmp, app) = spawn(&[]);
    assert_eq!(
        statuses(&app, Some(("x-forwarded-for", "10.0.0.5"))),
        REFUSED
    );
    assert_eq!(statuses(&app, Some(("forwarded", "for=10.0.0.5"))), REFUSED);
    assert!(app.terminate().success());
}

#[test]
fn the_forwarded_header_when_configured() {
    let (_tmp, app) = spawn(&[
        ("HANDOFF_BRIDGE__SERVER__TRUSTED_PROXIES", "127.0.0.1/32"),
        ("HANDOFF_BRIDGE__SERVER__PROXY_HEADER", "forwarded"),
    ]);
    let fwd = |v| Some(("forwarded", v));
    assert_eq!(
        statuses(&app, fwd("for=10.0.0.5;proto=https")),
        ADMITTED,
        "a listed client"
    );
    assert_eq!(
        statuses(&app, fwd("for=\"[2001:db8::1]:4711\"")),
        REFUSED,
        "an unlisted v6 client"
    );
    assert_eq!(
        statuses(&app, fwd("for=10.0.0.5, for=203.0.113.9")),
        REFUSED,
        "a spoofed left element"
    );
    assert_eq!(statuses(&app, fwd("for=unknown")), REFUSED, "unknown");
    assert_eq!(
        statuses(&app, Some(("x-forwarded-for", "10.0.0.5"))),
        REFUSED,
        "X-Forwarded-For is not read"
    );
    assert!(app.terminate().success());
}
