//! TLS end to end, against real TLS servers this test starts on 127.0.0.1 with certificates it
//! makes (rcgen):
//! - the Open API client: an `https://` upstream (a TLS-terminating relay in front of the
//!   emulator, run as its own process) refused while its certificate is from an unknown CA, for
//!   another name or expired (the action stays pending, retried; logged; counted), then accepted
//!   once it is signed by the private CA of `upstream.ca_file`, and carried out once;
//! - the help-desk sender: four `https://` endpoints, one per case, each with its own client; the
//!   good one gets the event once, the others are retried and end as a `tls_<reason>` dead letter;
//! - the public listener over TLS (`server.tls`): a delivery accepted over https, the certificate
//!   swapped on SIGHUP for new connections while a keep-alive connection opened before keeps
//!   working, and a broken file on SIGHUP keeping the running certificate.

use crate::common::emulator::ExternalEmulator;
use crate::common::helpdesk::{HelpDesk, OLD_SECRET};
use crate::common::relay::{
    daemon_env, make_delivery, rules_dir, user_message, Ids, EMULATOR_KEY, SEND_MESSAGE,
};
use crate::common::*;
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::sign::CertifiedKey;
use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

/// A web conversation of the emulator's default seed.
const CONV: &str = "5c0e9b1f-2222-4d3e-9f10-000000000001";

// ---- Certificates ----

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A certificate authority made by the test.
struct Ca {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

impl Ca {
    fn new(name: &str) -> Ca {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        Ca {
            issuer: CertifiedIssuer::self_signed(params, KeyPair::generate().expect("key"))
                .expect("CA"),
        }
    }

    fn pem(&self) -> String {
        self.issuer.pem()
    }

    /// A server certificate for `names` (an IP address becomes an IP SAN); `expired`: valid in
    /// 2020 only.
    fn leaf(&self, names: &[&str], expired: bool) -> Leaf {
        let key = KeyPair::generate().expect("key");
        let mut params =
            CertificateParams::new(names.iter().map(|n| (*n).to_owned()).collect::<Vec<_>>())
                .expect("leaf params");
        params.distinguished_name.push(DnType::CommonName, names[0]);
        if expired {
            params.not_before = rcgen::date_time_ymd(2020, 1, 1);
            params.not_after = rcgen::date_time_ymd(2021, 1, 1);
        }
        let cert = params.signed_by(&key, &self.issuer).expect("leaf");
        Leaf {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            der: cert.der().clone(),
        }
    }
}

struct Leaf {
    cert_pem: String,
    key_pem: String,
    der: CertificateDer<'static>,
}

impl Leaf {
    fn certified_key(&self) -> Arc<CertifiedKey> {
        let key = PrivateKeyDer::from_pem_slice(self.key_pem.as_bytes()).expect("key PEM");
        Arc::new(CertifiedKey::from_der(vec![self.der.clone()], key, &provider()).expect("pair"))
    }
}

fn write_file(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write");
    path
}

fn utf8(path: &Path) -> &str {
    path.to_str().expect("utf-8 path")
}

// ---- A TLS-terminating relay whose certificate the test switches ----

/// Serves the certificate in `current` to every new connection.
#[derive(Debug)]
struct Switchable {
    current: RwLock<Arc<CertifiedKey>>,
}

impl rustls::server::ResolvesServerCert for Switchable {
    fn resolve(&self, _: rustls::server::ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current.read().expect("cert").clone())
    }
}

/// TLS on 127.0.0.1 in front of a plain-HTTP server at `target`: each connection's handshake,
/// then its bytes both ways. Serves until the test process ends; a failed handshake just closes
/// the connection (the client reports why).
struct Relay {
    addr: SocketAddr,
    cert: Arc<Switchable>,
}

impl Relay {
    fn start(target: SocketAddr, leaf: &Leaf) -> Relay {
        let cert = Arc::new(Switchable {
            current: RwLock::new(leaf.certified_key()),
        });
        let config = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_no_client_auth()
            .with_cert_resolver(cert.clone());
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        listener.set_nonblocking(true).expect("nonblocking");
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
                while let Ok((tcp, _)) = listener.accept().await {
                    let acceptor = acceptor.clone();
                    tokio::spawn(async move {
                        let handshake =
                            tokio::time::timeout(Duration::from_secs(10), acceptor.accept(tcp));
                        let Ok(Ok(mut tls)) = handshake.await else {
                            return;
                        };
                        let Ok(mut plain) = tokio::net::TcpStream::connect(target).await else {
                            return;
                        };
                        let copy = tokio::io::copy_bidirectional(&mut tls, &mut plain);
                        let _ = tokio::time::timeout(Duration::from_secs(60), copy).await;
                    });
                }
            });
        });
        Relay { addr, cert }
    }

    /// New connections get `leaf` from now on.
    fn serve(&self, leaf: &Leaf) {
        *self.cert.current.write().expect("cert") = leaf.certified_key();
    }
}

// ---- Driving the daemon ----

/// Post one user message ("hello") in a new delivery (ids from `seed`); the id of the action rule
/// `rule` decides for it.
fn post_hello(app: &TestApp, seed: u64, rule: &str) -> String {
    let mut ids = Ids::new(seed);
    let event = user_message(&mut ids, 0, "hello", 1_763_690_500_000);
    let sent = make_delivery(&mut ids, vec![event]);
    let (status, receipt) = app.post(&sent.body);
    assert_eq!(status, 200, "{receipt}");
    format!("{}/{rule}/0", sent.events[0])
}

// ---- Reading the daemon ----

fn pending_ids(app: &TestApp) -> Vec<String> {
    let (status, body) = app.admin_get("/admin/v1/outbox");
    assert_eq!(status, 200, "{body}");
    body["entries"]
        .as_array()
        .expect("entries")
        .iter()
        .filter_map(|e| e["id"].as_str().map(str::to_owned))
        .collect()
}

fn done_ids(app: &TestApp) -> Vec<String> {
    let (status, body) = app.admin_get("/admin/v1/outbox/done");
    assert_eq!(status, 200, "{body}");
    body["finished"]
        .as_array()
        .expect("finished")
        .iter()
        .filter(|r| r["outcome"] == "done")
        .filter_map(|r| r["entry"]["id"].as_str().map(str::to_owned))
        .collect()
}

fn dead_letters(app: &TestApp) -> Vec<Value> {
    let (status, body) = app.admin_get("/admin/v1/dead-letters");
    assert_eq!(status, 200, "{body}");
    body["dead_letters"]
        .as_array()
        .cloned()
        .expect("dead_letters")
}

/// The daemon's log without terminal colours (fields read `key=value`).
fn plain_logs(app: &TestApp) -> String {
    let mut out = String::new();
    let mut escape = false;
    for c in app.logs().chars() {
        match (escape, c) {
            (false, '\u{1b}') => escape = true,
            (true, 'm') => escape = false,
            (true, _) => {}
            (false, c) => out.push(c),
        }
    }
    out
}

fn tls_failures(app: &TestApp, destination: &str, reason: &str) -> f64 {
    app.metric(&format!(
        r#"handoff_tls_failures_total{{destination="{destination}",reason="{reason}"}}"#
    ))
}

/// The action stays in the outbox, not finished, not a dead letter, and the daemon runs.
fn assert_pending(app: &mut TestApp, id: &str) {
    assert!(
        pending_ids(app).iter().any(|p| p == id),
        "{id} is not pending: {:?}",
        pending_ids(app)
    );
    assert!(
        !done_ids(app).iter().any(|d| d == id),
        "{id} recorded as done"
    );
    assert!(
        dead_letters(app).is_empty(),
        "no dead letter yet: {:?}",
        dead_letters(app)
    );
    assert!(
        matches!(app.child().try_wait(), Ok(None)),
        "the daemon is still running"
    );
}

// ---- 1. The Open API over https ----

#[test]
fn an_https_upstream_is_refused_until_its_certificate_verifies_then_called_once() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let private = Ca::new("handoff-bridge test private CA");
    let unknown = Ca::new("handoff-bridge test unknown CA");
    let ca_file = write_file(tmp.path(), "private-ca.pem", &private.pem());
    let emulator = ExternalEmulator::start(EMULATOR_KEY);
    // First a certificate from a CA the daemon does not trust.
    let relay = Relay::start(emulator.addr(), &unknown.leaf(&["127.0.0.1"], false));
    let rules = rules_dir(
        tmp.path(),
        r#"
        [[rule]]
        name = "ack"
        on = ["bot.message.received"]
        when = { field = "sender", equals = "user" }
        actions = [{ type = "send_message", text = "got it" }]
        "#,
    );
    let url = format!("https://127.0.0.1:{}", relay.addr.port());
    let mut app = TestApp::spawn_in(
        &tmp.path().join("data"),
        Spawn {
            env: daemon_env(
                &rules,
                &[
                    ("HANDOFF_BRIDGE_UPSTREAM_URL", &url),
                    ("HANDOFF_BRIDGE_UPSTREAM_API_KEY", EMULATOR_KEY),
                    ("HANDOFF_BRIDGE__UPSTREAM__CA_FILE", utf8(&ca_file)),
                    // Tried again (transient) until outbox.give_up_after; the circuit that
                    // opens probes often enough for every refusal below.
                    ("HANDOFF_BRIDGE__OUTBOX__RETRY__BASE", "200ms"),
                    ("HANDOFF_BRIDGE__OUTBOX__RETRY__CAP", "1s"),
                    ("HANDOFF_BRIDGE__OUTBOX__BREAKER__PROBE_INTERVAL", "500ms"),
                ],
            ),
            ..Spawn::default()
        },
    );
    let action = post_hello(&app, 19, "ack");

    let refusals = [
        ("unknown_issuer", "UnknownIssuer", None),
        (
            "name_mismatch",
            "not valid for name",
            Some(private.leaf(&["other.example"], false)),
        ),
        (
            "expired",
            "not valid after",
            Some(private.leaf(&["127.0.0.1"], true)),
        ),
    ];
    for (reason, rustls_word, leaf) in &refusals {
        if let Some(leaf) = leaf {
            relay.serve(leaf);
        }
        poll_until(
            &format!("a TLS failure counted as {reason}"),
            Duration::from_secs(30),
            || (tls_failures(&app, "upstream", reason) >= 1.0).then_some(()),
        );
        assert_pending(&mut app, &action);
        let logs = plain_logs(&app);
        assert!(
            logs.lines().any(|l| l.contains("TLS handshake failed")
                && l.contains("destination=upstream")
                && l.contains(&format!("reason=\"{reason}\""))
                && l.contains(rustls_word)),
            "no log line names the upstream and {reason}:\n{logs}"
        );
    }
    assert!(
        app.metric(&format!(
            r#"handoff_upstream_attempts_total{{endpoint="{SEND_MESSAGE}",status="tls"}}"#
        )) >= 3.0,
        "every refused attempt is counted as tls"
    );
    let journal = crate::common::relay::journal(&emulator.base);
    assert!(
        journal
            .iter()
            .all(|e| e.idempotency_key.as_deref() != Some(&action)),
        "no call reached the upstream through a refused handshake: {journal:?}"
    );

    // Signed by the private CA, for the right address: the call goes through, once.
    relay.serve(&private.leaf(&["127.0.0.1"], false));
    poll_until(
        "the action recorded as done",
        Duration::from_secs(30),
        || done_ids(&app).iter().any(|d| d == &action).then_some(()),
    );
    let journal = crate::common::relay::journal(&emulator.base);
    let calls: Vec<_> = journal
        .iter()
        .filter(|e| e.idempotency_key.as_deref() == Some(&action))
        .collect();
    assert_eq!(calls.len(), 1, "one call under the action's key: {calls:?}");
    assert_eq!(calls[0].status / 100, 2, "{calls:?}");
    assert!(dead_letters(&app).is_empty());
    assert!(
        plain_logs(&app)
            .lines()
            .any(|l| l.contains("TLS handshakes succeed again")
                && l.contains("destination=upstream")),
        "the recovery is logged"
    );
    let (status, _) = app.get("/healthz");
    assert_eq!(status, 200, "the daemon keeps running");
}

// ---- 2. Help desks over https ----

#[test]
fn each_https_help_desk_is_verified_with_its_own_trust_and_a_bad_one_ends_as_a_tls_dead_letter() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let private = Ca::new("handoff-bridge test private CA");
    let unknown = Ca::new("handoff-bridge test unknown CA");
    let ca_file = write_file(tmp.path(), "private-ca.pem", &private.pem());
    // (name, the certificate its TLS front serves, the reason it is refused for)
    let cases = [
        ("good", private.leaf(&["127.0.0.1"], false), None),
        (
            "unknown_ca",
            unknown.leaf(&["127.0.0.1"], false),
            Some(("unknown_issuer", "UnknownIssuer")),
        ),
        (
            "wrong_name",
            private.leaf(&["other.example"], false),
            Some(("name_mismatch", "not valid for name")),
        ),
        (
            "expired",
            private.leaf(&["127.0.0.1"], true),
            Some(("expired", "not valid after")),
        ),
    ];
    let mut desks = Vec::new();
    let mut config = String::from(
        "[outbox]\ngive_up_after = \"15s\"\n[outbox.retry]\nbase = \"100ms\"\ncap = \"400ms\"\n[outbox.breaker]\nprobe_interval = \"500ms\"\n\n",
    );
    for (name, leaf, _) in &cases {
        let desk = HelpDesk::start(&[], 200);
        let plain: SocketAddr = desk
            .url
            .strip_prefix("http://")
            .and_then(|rest| rest.split('/').next())
            .and_then(|a| a.parse().ok())
            .expect("desk address");
        let relay = Relay::start(plain, leaf);
        config.push_str(&format!(
            "[[helpdesk.endpoints]]\nname = \"{name}\"\nurl = \"https://127.0.0.1:{}/events\"\nsecrets = [\"{OLD_SECRET}\"]\nca_file = \"{}\"\n\n",
            relay.addr.port(),
            utf8(&ca_file)
        ));
        desks.push((desk, relay));
    }
    let config_path = write_file(tmp.path(), "bridge.toml", &config);
    let rules = rules_dir(
        tmp.path(),
        r#"
        [[rule]]
        name = "tell"
        on = ["bot.message.received"]
        when = { field = "sender", equals = "user" }
        actions = [{ type = "notify_helpdesk", kind = "conversation.message" }]
        "#,
    );
    let mut app = TestApp::spawn_in(
        &tmp.path().join("data"),
        Spawn {
            env: daemon_env(&rules, &[]),
            args: vec!["--config".into(), utf8(&config_path).into()],
            ..Spawn::default()
        },
    );
    let action = post_hello(&app, 20, "tell");

    poll_until(
        "the good desk's delivery and a refusal by every other",
        Duration::from_secs(30),
        || {
            let refused = cases.iter().all(|(name, _, why)| match why {
                Some((reason, _)) => tls_failures(&app, name, reason) >= 1.0,
                None => true,
            });
            (refused && desks[0].0.accepted().len() == 1).then_some(())
        },
    );
    // Not done while any desk still has to get it: pending, retried.
    assert_pending(&mut app, &action);
    assert_eq!(desks[0].0.accepted()[0].header("webhook-id"), action);
    let logs = plain_logs(&app);
    for (name, _, why) in &cases {
        let Some((reason, rustls_word)) = why else {
            for reason in upstream::tls::TlsReason::ALL {
                assert_eq!(tls_failures(&app, name, reason.label()), 0.0, "{name}");
            }
            continue;
        };
        assert!(
            logs.lines().any(|l| l.contains("TLS handshake failed")
                && l.contains(&format!("destination={name}"))
                && l.contains(&format!("reason=\"{reason}\""))
                && l.contains(rustls_word)),
            "no log line names {name} and {reason}:\n{logs}"
        );
        assert!(
            app.metric(&format!(
                r#"handoff_helpdesk_deliveries_total{{endpoint="{name}",outcome="tls"}}"#
            )) >= 1.0
        );
        // The TLS front never passed a request on.
        let (desk, _) = &desks[cases.iter().position(|c| c.0 == *name).expect("case")];
        assert!(desk.received().is_empty(), "{name} received a request");
    }

    // Past give_up_after: a dead letter whose reason says why (the first endpoint refused).
    let letters = poll_until("the dead letter", Duration::from_secs(60), || {
        let letters = dead_letters(&app);
        (!letters.is_empty()).then_some(letters)
    });
    assert_eq!(letters.len(), 1, "{letters:#?}");
    assert_eq!(letters[0]["entry"]["id"], action.as_str());
    assert_eq!(
        letters[0]["reason"], "tls_unknown_issuer",
        "{:#}",
        letters[0]
    );
    let error = letters[0]["error"].as_str().unwrap_or_default();
    assert!(
        error.contains("unknown_ca") && error.contains("certificate not trusted"),
        "{error}"
    );
    assert!(!done_ids(&app).iter().any(|d| d == &action));
    assert_eq!(
        app.metric(r#"handoff_dead_letters_total{reason="tls_unknown_issuer"}"#),
        1.0
    );
    // The good desk got it once, however often the others were tried.
    assert_eq!(desks[0].0.received().len(), 1);
    let (status, _) = app.get("/healthz");
    assert_eq!(status, 200, "the daemon keeps running");
    assert!(matches!(app.child().try_wait(), Ok(None)));
}

/// The platform's roots are read as OpenSSL-based tools read them: `SSL_CERT_FILE` names the
/// bundle, so a CA given there (and no `ca_file`) is trusted.
#[test]
fn ssl_cert_file_is_honoured_as_the_platform_roots() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let ca = Ca::new("handoff-bridge test CA via SSL_CERT_FILE");
    let bundle = write_file(tmp.path(), "bundle.pem", &ca.pem());
    let desk = HelpDesk::start(&[], 200);
    let plain: SocketAddr = desk
        .url
        .strip_prefix("http://")
        .and_then(|rest| rest.split('/').next())
        .and_then(|a| a.parse().ok())
        .expect("desk address");
    let relay = Relay::start(plain, &ca.leaf(&["127.0.0.1"], false));
    let config_path = write_file(
        tmp.path(),
        "bridge.toml",
        &format!(
            "[[helpdesk.endpoints]]\nname = \"desk\"\nurl = \"https://127.0.0.1:{}/events\"\nsecrets = [\"{OLD_SECRET}\"]\n",
            relay.addr.port()
        ),
    );
    let rules = rules_dir(
        tmp.path(),
        r#"
        [[rule]]
        name = "tell"
        on = ["bot.message.received"]
        when = { field = "sender", equals = "user" }
        actions = [{ type = "notify_helpdesk", kind = "conversation.message" }]
        "#,
    );
    let app = TestApp::spawn_in(
        &tmp.path().join("data"),
        Spawn {
            env: daemon_env(&rules, &[("SSL_CERT_FILE", utf8(&bundle))]),
            args: vec!["--config".into(), utf8(&config_path).into()],
            ..Spawn::default()
        },
    );
    let action = post_hello(&app, 22, "tell");
    poll_until(
        "the event recorded as done",
        Duration::from_secs(30),
        || done_ids(&app).iter().any(|d| d == &action).then_some(()),
    );
    let accepted = desk.accepted();
    assert_eq!(accepted.len(), 1, "delivered once over https");
    assert_eq!(accepted[0].header("webhook-id"), action);
    assert_eq!(tls_failures(&app, "desk", "unknown_issuer"), 0.0);
}

// ---- 3. The public listener over TLS ----

/// One TLS connection to the daemon, kept open (keep-alive) across requests.
struct Conn {
    reader: BufReader<rustls::StreamOwned<rustls::ClientConnection, TcpStream>>,
}

impl Conn {
    fn open(addr: SocketAddr, client: &Arc<rustls::ClientConfig>) -> Conn {
        let tcp = TcpStream::connect(addr).expect("connect");
        tcp.set_read_timeout(Some(Duration::from_secs(30)))
            .expect("timeout");
        let name = ServerName::IpAddress(addr.ip().into());
        let conn = rustls::ClientConnection::new(client.clone(), name).expect("client");
        let mut stream = rustls::StreamOwned::new(conn, tcp);
        // Complete the handshake now, so the peer's certificate is known.
        while stream.conn.is_handshaking() {
            stream
                .conn
                .complete_io(&mut stream.sock)
                .expect("handshake");
        }
        Conn {
            reader: BufReader::new(stream),
        }
    }

    fn peer_certificate(&self) -> CertificateDer<'static> {
        self.reader
            .get_ref()
            .conn
            .peer_certificates()
            .and_then(|c| c.first())
            .expect("a peer certificate")
            .clone()
            .into_owned()
    }

    /// One request on this connection; (status, body).
    fn request(&mut self, method: &str, path: &str, body: &[u8]) -> (u16, String) {
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        let stream = self.reader.get_mut();
        stream.write_all(head.as_bytes()).expect("write");
        stream.write_all(body).expect("write");
        stream.flush().expect("flush");
        let mut line = String::new();
        self.reader.read_line(&mut line).expect("status line");
        let status: u16 = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("status line: {line:?}"));
        let mut length = 0usize;
        loop {
            line.clear();
            self.reader.read_line(&mut line).expect("header");
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            if let Some((k, v)) = l.split_once(':') {
                if k.eq_ignore_ascii_case("content-length") {
                    length = v.trim().parse().expect("length");
                }
            }
        }
        let mut body = vec![0; length];
        self.reader.read_exact(&mut body).expect("body");
        (status, String::from_utf8_lossy(&body).into_owned())
    }
}

fn client_trusting(ca: &Ca) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.issuer.der().clone()).expect("root");
    Arc::new(
        rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_root_certificates(roots)
            .with_no_client_auth(),
    )
}

/// `host:port` and path of an `https://` URL.
fn split_url(url: &str) -> (SocketAddr, String) {
    let rest = url.strip_prefix("https://").expect("https URL");
    let (host, path) = rest.split_once('/').unwrap_or((rest, ""));
    (host.parse().expect("address"), format!("/{path}"))
}

/// A metric sample, read where `TestApp::admin_url` says /metrics is: over TLS while it is on the
/// public listener, through `TestApp::metric` once it is on a plain-HTTP admin listener.
fn metric_over(app: &TestApp, client: &Arc<rustls::ClientConfig>, sample: &str) -> f64 {
    let url = app.admin_url("/metrics");
    if !url.starts_with("https://") {
        return app.metric(sample);
    }
    let (addr, path) = split_url(&url);
    let (status, text) = Conn::open(addr, client).request("GET", &path, b"");
    assert_eq!(status, 200, "{text}");
    text.lines()
        .find_map(|l| l.strip_prefix(sample).and_then(|r| r.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

#[test]
fn the_public_listener_serves_https_and_a_sighup_swaps_its_certificate_for_new_connections() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let ca = Ca::new("handoff-bridge test server CA");
    let first = ca.leaf(&["127.0.0.1", "localhost"], false);
    let cert_file = write_file(tmp.path(), "tls.crt", &first.cert_pem);
    let key_file = write_file(tmp.path(), "tls.key", &first.key_pem);
    let app = TestApp::spawn_in(
        &tmp.path().join("data"),
        Spawn::with_env(&[
            ("HANDOFF_BRIDGE__SERVER__TLS__CERT_FILE", utf8(&cert_file)),
            ("HANDOFF_BRIDGE__SERVER__TLS__KEY_FILE", utf8(&key_file)),
        ]),
    );
    assert!(app.base.starts_with("https://127.0.0.1:"), "{}", app.base);
    let (addr, _) = split_url(&app.base);
    let (_, webhook_path) = split_url(&app.webhook_url);
    let client = client_trusting(&ca);

    // A delivery over https, on a connection kept open.
    let mut kept = Conn::open(addr, &client);
    assert_eq!(kept.peer_certificate(), first.der);
    let mut ids = Ids::new(21);
    let event = user_message(&mut ids, 0, "over tls", 1_763_690_500_000);
    let sent = make_delivery(&mut ids, vec![event]);
    let (status, body) = kept.request("POST", &webhook_path, &sent.body);
    assert_eq!(status, 200, "{body}");
    let receipt: Value = serde_json::from_str(&body).expect("JSON receipt");
    assert_eq!(receipt["accepted"], 1, "{receipt}");
    // The embedded emulator's webhooks reach the TLS listener too (pinned to its certificate).
    let accepted = |app: &TestApp| {
        metric_over(
            app,
            &client,
            r#"handoff_webhook_deliveries_total{outcome="accepted"}"#,
        )
    };
    app.emulator_act(
        CONV,
        "say",
        serde_json::json!({"text": "from the emulator"}),
    );
    poll_until(
        "the emulator's webhook over https",
        Duration::from_secs(30),
        || (accepted(&app) >= 2.0).then_some(()),
    );

    // Rotation: new files, then SIGHUP. New connections get the new certificate.
    let second = ca.leaf(&["127.0.0.1", "localhost"], false);
    std::fs::write(&cert_file, &second.cert_pem).expect("write");
    std::fs::write(&key_file, &second.key_pem).expect("write");
    let pid = nix::unistd::Pid::from_raw(app.pid() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGHUP).expect("SIGHUP");
    poll_until(
        "a new connection to see the new certificate",
        Duration::from_secs(30),
        || (Conn::open(addr, &client).peer_certificate() == second.der).then_some(()),
    );
    assert_eq!(
        metric_over(
            &app,
            &client,
            r#"handoff_tls_reloads_total{result="loaded"}"#
        ),
        1.0
    );
    // The emulator's sender trusts the new certificate as it is served.
    app.emulator_act(
        CONV,
        "say",
        serde_json::json!({"text": "after the rotation"}),
    );
    poll_until(
        "the emulator's webhook after the rotation",
        Duration::from_secs(30),
        || (accepted(&app) >= 3.0).then_some(()),
    );
    // The connection opened before keeps working, on the certificate it was made with.
    let (status, body) = kept.request("GET", "/healthz", b"");
    assert_eq!(status, 200, "{body}");
    assert_eq!(kept.peer_certificate(), first.der);

    // A broken file on SIGHUP: the running certificate stays, the failure is logged and counted.
    std::fs::write(&cert_file, "-----BEGIN CERTIFICATE-----\nbroken\n").expect("write");
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGHUP).expect("SIGHUP");
    poll_until("the failed reload counted", Duration::from_secs(30), || {
        (metric_over(
            &app,
            &client,
            r#"handoff_tls_reloads_total{result="failed"}"#,
        ) >= 1.0)
            .then_some(())
    });
    assert_eq!(Conn::open(addr, &client).peer_certificate(), second.der);
    assert!(
        plain_logs(&app).contains("TLS certificate reload failed"),
        "{}",
        plain_logs(&app)
    );
    let (status, body) = kept.request("GET", "/healthz", b"");
    assert_eq!(status, 200, "{body}");
    let logs = app.terminate_and_logs();
    assert!(
        !logs.contains("PRIVATE KEY"),
        "the key never reaches the log"
    );
}
