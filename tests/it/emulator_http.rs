//! The Open API emulator over HTTP, in-process (`actix_web::test`, no sockets): authentication,
//! idempotency, every fault type, the journal, and that the API key never leaks.

use ::emulator::{Emulator, EmulatorConfig, FaultConfig, JournalEntry};
use actix_web::body::MessageBody;
use actix_web::dev::{Service, ServiceResponse};
use actix_web::http::header::HeaderMap;
use actix_web::test::{self, TestRequest};
use actix_web::{web, App};
use model::secret::Secret;
use serde_json::{json, Value};
use std::time::Duration;

const KEY: &str = "emu-key-SUPERSECRET-41f9";
const CONV1: &str = "5c0e9b1f-2222-4d3e-9f10-000000000001";
const MESSAGES: &str = "/openapi/conversation/5c0e9b1f-2222-4d3e-9f10-000000000001/message";

fn emulator() -> Emulator {
    Emulator::with_default_seed(EmulatorConfig::new(Secret::new(KEY))).expect("emulator")
}

macro_rules! app {
    ($emu:expr) => {{
        let emu = $emu.clone();
        test::init_service(App::new().configure(move |cfg| emu.configure(cfg))).await
    }};
}

struct Answer {
    status: u16,
    headers: HeaderMap,
    body: Value,
}

async fn call<S, R, B>(app: &S, req: R) -> Answer
where
    S: Service<R, Response = ServiceResponse<B>, Error = actix_web::Error>,
    B: MessageBody,
{
    let resp = test::call_service(app, req).await;
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let bytes = test::read_body(resp).await;
    let body = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes).expect("JSON answer")
    };
    Answer {
        status,
        headers,
        body,
    }
}

fn authed(req: TestRequest) -> TestRequest {
    req.insert_header(("Authorization", format!("Bearer {KEY}")))
}

fn get(path: &str) -> TestRequest {
    authed(TestRequest::get().uri(path))
}

fn send_text(text: &str) -> TestRequest {
    authed(TestRequest::post().uri(MESSAGES))
        .set_json(json!({"message": {"type": "text", "text": text}}))
}

fn message_count(emu: &Emulator) -> usize {
    emu.state_snapshot()["messages"]
        .as_array()
        .map(Vec::len)
        .unwrap_or(0)
}

fn set_faults(emu: &Emulator, faults: FaultConfig) {
    emu.set_faults(faults).expect("faults");
}

#[test]
fn the_handle_is_clone_send_and_sync() {
    fn assert_handle<T: Clone + Send + Sync + 'static>() {}
    assert_handle::<Emulator>();
}

#[actix_web::test]
async fn the_api_key_is_required_and_checked() {
    let emu = emulator();
    let app = app!(emu);
    let none = call(&app, TestRequest::get().uri("/openapi/bot").to_request()).await;
    assert_eq!(none.status, 401);
    assert_eq!(none.body["error"]["code"], "unauthorized");
    for value in [
        format!("Bearer {KEY}x"),
        format!("Basic {KEY}"),
        KEY.to_owned(),
        "Bearer".to_owned(),
    ] {
        let req = TestRequest::get()
            .uri("/openapi/bot")
            .insert_header(("Authorization", value))
            .to_request();
        assert_eq!(call(&app, req).await.status, 401);
    }
    assert_eq!(
        call(&app, get("/openapi/bot").to_request()).await.status,
        200
    );
    let lower = TestRequest::get()
        .uri("/openapi/bot")
        .insert_header(("authorization", format!("bearer {KEY}")))
        .to_request();
    assert_eq!(call(&app, lower).await.status, 200);
}

#[actix_web::test]
async fn the_auth_header_and_scheme_are_configurable() {
    let mut config = EmulatorConfig::new(Secret::new(KEY));
    config.auth_header = "X-Api-Key".into();
    config.auth_scheme = None;
    let emu = Emulator::with_default_seed(config).expect("emulator");
    let app = app!(emu);
    let ok = TestRequest::get()
        .uri("/openapi/bot")
        .insert_header(("X-Api-Key", KEY))
        .to_request();
    assert_eq!(call(&app, ok).await.status, 200);
    assert_eq!(
        call(&app, get("/openapi/bot").to_request()).await.status,
        401
    );

    let mut bad = EmulatorConfig::new(Secret::new(KEY));
    bad.auth_header = "Bad Header".into();
    assert!(Emulator::with_default_seed(bad).is_err());
    assert!(Emulator::with_default_seed(EmulatorConfig::new(Secret::new(""))).is_err());
}

#[actix_web::test]
async fn unknown_paths_methods_and_bad_input_get_json_errors() {
    let emu = emulator();
    let app = app!(emu);
    let r = call(&app, get("/openapi/nothing").to_request()).await;
    assert_eq!(
        (r.status, r.body["error"]["code"].as_str()),
        (404, Some("not_found"))
    );
    let r = call(
        &app,
        authed(TestRequest::delete().uri("/openapi/bot")).to_request(),
    )
    .await;
    assert_eq!(r.status, 405);
    let r = call(&app, get("/openapi/bot/Bnope").to_request()).await;
    assert_eq!(
        (r.status, r.body["error"]["code"].as_str()),
        (404, Some("not_found"))
    );
    let bad_json = authed(TestRequest::put().uri(&format!("/openapi/conversation/{CONV1}/manual")))
        .insert_header(("content-type", "application/json"))
        .set_payload("{\"enabled\": tru")
        .to_request();
    let r = call(&app, bad_json).await;
    assert_eq!(
        (r.status, r.body["error"]["code"].as_str()),
        (400, Some("invalid_body"))
    );
    let r = call(&app, get("/openapi/bot?limit=500").to_request()).await;
    assert_eq!(
        (r.status, r.body["error"]["code"].as_str()),
        (400, Some("invalid_query"))
    );
    let r = call(&app, get("/openapi/bot?limit=1&limit=2").to_request()).await;
    assert_eq!(r.status, 400);
    let r = call(
        &app,
        get("/openapi/endusers?platform=kakaobiz&limit=1").to_request(),
    )
    .await;
    assert_eq!(r.status, 200);
    assert_eq!(
        r.body["paging"],
        json!({"offset": 0, "limit": 1, "total": 2})
    );
}

#[actix_web::test]
async fn state_changes_are_seen_by_later_calls() {
    let emu = emulator();
    let app = app!(emu);
    let manual = format!("/openapi/conversation/{CONV1}/manual");
    let put = authed(TestRequest::put().uri(&manual)).set_json(json!({"enabled": true}));
    assert_eq!(
        call(&app, put.to_request()).await.body["status"],
        "HANDOVER"
    );
    let r = call(&app, get(&manual).to_request()).await;
    assert_eq!(r.body["status"], "HANDOVER");
    let r = call(&app, send_text("hi").to_request()).await;
    assert_eq!(r.status, 200);
    let listed = call(
        &app,
        get(&format!("{MESSAGES}?from={}", r.body["timestamp"])).to_request(),
    )
    .await;
    assert_eq!(listed.body["data"][0]["id"], r.body["id"]);
    let pb = "/openapi/partnerbiz/sk-support-0001/conversation/kb-user-77a9f2";
    let block = authed(TestRequest::post().uri(&format!("{pb}/block")));
    assert_eq!(call(&app, block.to_request()).await.status, 200);
    assert_eq!(call(&app, get(pb).to_request()).await.body["blocked"], true);
    let again = authed(TestRequest::post().uri(&format!("{pb}/block")));
    assert_eq!(call(&app, again.to_request()).await.status, 409);
}

#[actix_web::test]
async fn a_repeated_idempotency_key_replays_the_first_answer_with_one_effect() {
    let emu = emulator();
    let app = app!(emu);
    let before = message_count(&emu);
    let first = call(
        &app,
        send_text("once")
            .insert_header(("Idempotency-Key", "k-1"))
            .to_request(),
    )
    .await;
    assert_eq!(first.status, 200);
    assert!(first.headers.get("Idempotent-Replayed").is_none());
    let second = call(
        &app,
        send_text("once")
            .insert_header(("Idempotency-Key", "k-1"))
            .to_request(),
    )
    .await;
    assert_eq!(second.status, 200);
    assert_eq!(second.body, first.body);
    assert_eq!(
        second
            .headers
            .get("Idempotent-Replayed")
            .and_then(|v| v.to_str().ok()),
        Some("true")
    );
    assert_eq!(message_count(&emu), before + 1);

    // Errors are stored too, and the key is global: another call with it gets the same answer.
    let unblock = "/openapi/partnerbiz/sk-support-0001/conversation/kb-user-77a9f2/unblock";
    let req = || authed(TestRequest::post().uri(unblock)).insert_header(("Idempotency-Key", "k-2"));
    let conflict = call(&app, req().to_request()).await;
    assert_eq!(conflict.status, 409);
    let replay = call(&app, req().to_request()).await;
    assert_eq!((replay.status, &replay.body), (409, &conflict.body));
    let other = call(
        &app,
        send_text("other")
            .insert_header(("Idempotency-Key", "k-2"))
            .to_request(),
    )
    .await;
    assert_eq!((other.status, &other.body), (409, &conflict.body));
    assert_eq!(message_count(&emu), before + 1);

    // GETs are not stored.
    let g = || get("/openapi/bot").insert_header(("Idempotency-Key", "k-3"));
    call(&app, g().to_request()).await;
    let again = call(&app, g().to_request()).await;
    assert!(again.headers.get("Idempotent-Replayed").is_none());

    let journal = emu.journal();
    let replays: Vec<&JournalEntry> = journal.iter().filter(|e| e.replayed).collect();
    assert_eq!(replays.len(), 3);
    assert!(replays.iter().all(|e| e.idempotency_key.is_some()));

    let mut config = EmulatorConfig::new(Secret::new(KEY));
    config.idempotency_header = "X-Request-Id".into();
    let emu2 = Emulator::with_default_seed(config).expect("emulator");
    let app2 = app!(emu2);
    let n = message_count(&emu2);
    for _ in 0..2 {
        call(
            &app2,
            send_text("x")
                .insert_header(("X-Request-Id", "r1"))
                .to_request(),
        )
        .await;
    }
    assert_eq!(message_count(&emu2), n + 1);
}

#[actix_web::test]
async fn fail_next_answers_the_status_without_effect_and_the_retry_counts() {
    let emu = emulator();
    let app = app!(emu);
    let before = emu.state_snapshot();
    set_faults(
        &emu,
        FaultConfig {
            fail_next: 2,
            status: 502,
            ..FaultConfig::default()
        },
    );
    for _ in 0..2 {
        let r = call(
            &app,
            send_text("retry me")
                .insert_header(("Idempotency-Key", "f-1"))
                .to_request(),
        )
        .await;
        assert_eq!(r.status, 502);
        assert_eq!(r.body["error"]["code"], "unavailable");
    }
    assert_eq!(emu.state_snapshot(), before);
    assert_eq!(emu.faults().fail_next, 0);
    let r = call(
        &app,
        send_text("retry me")
            .insert_header(("Idempotency-Key", "f-1"))
            .to_request(),
    )
    .await;
    assert_eq!(r.status, 200);
    assert!(r.headers.get("Idempotent-Replayed").is_none());
    assert_eq!(message_count(&emu), message_count_of(&before) + 1);

    // The default status is 503, and faults come before authentication.
    set_faults(
        &emu,
        FaultConfig {
            fail_next: 1,
            ..FaultConfig::default()
        },
    );
    let r = call(&app, TestRequest::get().uri("/openapi/bot").to_request()).await;
    assert_eq!(r.status, 503);
    let faulted: Vec<_> = emu
        .journal()
        .into_iter()
        .filter(|e| e.fault.is_some())
        .collect();
    assert_eq!(faulted.len(), 3);
    assert!(faulted.iter().all(|e| e.fault.as_deref() == Some("fail")));
    assert_eq!(faulted[0].status, 502);
}

fn message_count_of(snapshot: &Value) -> usize {
    snapshot["messages"].as_array().map(Vec::len).unwrap_or(0)
}

#[actix_web::test]
async fn error_rate_is_deterministic_per_seed() {
    async fn run(rate: f64, seed: u64) -> Vec<u16> {
        let emu = emulator();
        let app = app!(emu);
        set_faults(
            &emu,
            FaultConfig {
                error_rate: rate,
                seed,
                status: 500,
                ..FaultConfig::default()
            },
        );
        let mut out = Vec::new();
        for _ in 0..40 {
            out.push(call(&app, get("/openapi/bot").to_request()).await.status);
        }
        out
    }
    let a = run(0.5, 42).await;
    assert_eq!(a, run(0.5, 42).await);
    assert!(a.contains(&500) && a.contains(&200), "{a:?}");
    assert!(run(1.0, 1).await.iter().all(|s| *s == 500));
    assert!(run(0.0, 1).await.iter().all(|s| *s == 200));
}

#[actix_web::test]
async fn latency_delays_the_answer() {
    let emu = emulator();
    let app = app!(emu);
    set_faults(
        &emu,
        FaultConfig {
            latency_ms: 150,
            ..FaultConfig::default()
        },
    );
    let start = std::time::Instant::now();
    let r = call(&app, get("/openapi/bot").to_request()).await;
    assert_eq!(r.status, 200);
    assert!(
        start.elapsed() >= Duration::from_millis(150),
        "{:?}",
        start.elapsed()
    );
}

#[actix_web::test]
async fn rate_limit_sends_retry_after_verbatim() {
    let emu = emulator();
    let app = app!(emu);
    let before = emu.state_snapshot();
    for value in ["Wed, 21 Oct 2015 07:28:00 GMT", "soon-ish", "2"] {
        set_faults(
            &emu,
            FaultConfig {
                rate_limit_next: 1,
                retry_after: value.into(),
                ..FaultConfig::default()
            },
        );
        let r = call(&app, send_text("x").to_request()).await;
        assert_eq!(r.status, 429);
        assert_eq!(r.body["error"]["code"], "rate_limited");
        assert_eq!(
            r.headers.get("Retry-After").and_then(|v| v.to_str().ok()),
            Some(value)
        );
    }
    assert_eq!(
        call(&app, get("/openapi/bot").to_request()).await.status,
        200
    );
    assert_eq!(emu.state_snapshot(), before);
    let limited = emu
        .journal()
        .into_iter()
        .filter(|e| e.status == 429)
        .count();
    assert_eq!(limited, 3);
}

#[actix_web::test]
async fn a_hung_call_never_answers_and_changes_nothing() {
    let emu = emulator();
    let app = app!(emu);
    let before = emu.state_snapshot();
    set_faults(
        &emu,
        FaultConfig {
            hang_next: 1,
            ..FaultConfig::default()
        },
    );
    let req = send_text("lost")
        .insert_header(("Idempotency-Key", "h-1"))
        .to_request();
    let waited =
        tokio::time::timeout(Duration::from_millis(200), test::call_service(&app, req)).await;
    assert!(waited.is_err(), "the call answered");
    assert_eq!(emu.state_snapshot(), before);
    let entry = emu.journal().pop().expect("journaled");
    assert_eq!((entry.status, entry.fault.as_deref()), (0, Some("hang")));
    assert_eq!(entry.idempotency_key.as_deref(), Some("h-1"));
    // The next call (a retry) is served normally and is the first real attempt.
    let r = call(
        &app,
        send_text("lost")
            .insert_header(("Idempotency-Key", "h-1"))
            .to_request(),
    )
    .await;
    assert_eq!(r.status, 200);
    assert!(r.headers.get("Idempotent-Replayed").is_none());
}

#[actix_web::test]
async fn a_dropped_call_breaks_its_body_and_changes_nothing() {
    let emu = emulator();
    let app = app!(emu);
    let before = emu.state_snapshot();
    set_faults(
        &emu,
        FaultConfig {
            drop_next: 1,
            ..FaultConfig::default()
        },
    );
    let resp = test::call_service(&app, send_text("cut").to_request()).await;
    let body = actix_web::body::to_bytes(resp.into_body()).await;
    assert!(body.is_err(), "the body completed");
    assert_eq!(emu.state_snapshot(), before);
    let entry = emu.journal().pop().expect("journaled");
    assert_eq!((entry.status, entry.fault.as_deref()), (0, Some("drop")));
    assert_eq!(call(&app, send_text("cut").to_request()).await.status, 200);
}

#[actix_web::test]
async fn faults_respect_the_path_prefix_and_are_managed_over_http() {
    let emu = emulator();
    let app = app!(emu);
    let faults = json!({"fail_next": 1, "status": 500, "path_prefix": "/openapi/partnerbiz"});
    let r = call(
        &app,
        TestRequest::post()
            .uri("/_emulator/faults")
            .set_json(faults)
            .to_request(),
    )
    .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.body["fail_next"], 1);
    assert_eq!(
        call(&app, get("/openapi/bot").to_request()).await.status,
        200
    );
    let pb = "/openapi/partnerbiz/sk-support-0001/conversation/kb-user-77a9f2";
    assert_eq!(call(&app, get(pb).to_request()).await.status, 500);
    assert_eq!(call(&app, get(pb).to_request()).await.status, 200);
    let r = call(
        &app,
        TestRequest::get().uri("/_emulator/faults").to_request(),
    )
    .await;
    assert_eq!(
        (r.body["fail_next"].as_u64(), r.body["status"].as_u64()),
        (Some(0), Some(500))
    );

    for bad in [
        json!({"error_rate": 2.0}),
        json!({"status": 200}),
        json!({"fail_nxt": 1}),
    ] {
        let r = call(
            &app,
            TestRequest::post()
                .uri("/_emulator/faults")
                .set_json(bad)
                .to_request(),
        )
        .await;
        assert_eq!(r.status, 400);
        assert_eq!(r.body["error"]["code"], "invalid_body");
    }
    set_faults(
        &emu,
        FaultConfig {
            fail_next: 5,
            ..FaultConfig::default()
        },
    );
    let r = call(
        &app,
        TestRequest::delete().uri("/_emulator/faults").to_request(),
    )
    .await;
    assert_eq!(r.status, 204);
    assert_eq!(emu.faults(), FaultConfig::default());
    assert_eq!(
        call(&app, get("/openapi/bot").to_request()).await.status,
        200
    );
}

#[actix_web::test]
async fn faults_can_be_set_at_start() {
    let mut config = EmulatorConfig::new(Secret::new(KEY));
    config.faults = FaultConfig {
        fail_next: 1,
        status: 504,
        ..FaultConfig::default()
    };
    let emu = Emulator::with_default_seed(config).expect("emulator");
    let app = app!(emu);
    assert_eq!(
        call(&app, get("/openapi/bot").to_request()).await.status,
        504
    );
    assert_eq!(
        call(&app, get("/openapi/bot").to_request()).await.status,
        200
    );
}

#[actix_web::test]
async fn the_journal_records_every_call_and_can_be_cleared() {
    let emu = emulator();
    let app = app!(emu);
    let start = emu.now_ms();
    call(&app, get("/openapi/bot?limit=1").to_request()).await;
    let sent = call(
        &app,
        send_text("journaled")
            .insert_header(("Idempotency-Key", "j-1"))
            .to_request(),
    )
    .await;
    call(&app, TestRequest::get().uri("/openapi/bot").to_request()).await;
    let end = emu.now_ms();

    let r = call(
        &app,
        TestRequest::get().uri("/_emulator/journal").to_request(),
    )
    .await;
    assert_eq!(r.status, 200);
    let journal: Vec<JournalEntry> = serde_json::from_value(r.body).expect("journal");
    assert_eq!(journal.len(), 3);
    let first = &journal[0];
    assert_eq!(
        (
            first.method.as_str(),
            first.path.as_str(),
            first.query.as_str()
        ),
        ("GET", "/openapi/bot", "limit=1")
    );
    assert_eq!(first.endpoint.as_deref(), Some("list-bots"));
    assert_eq!(first.body, Value::Null);
    assert_eq!(first.status, 200);
    assert_eq!(first.answer["paging"]["limit"], 1);
    let second = &journal[1];
    assert_eq!(
        (second.method.as_str(), second.path.as_str()),
        ("POST", MESSAGES)
    );
    assert_eq!(
        second.body,
        json!({"message": {"type": "text", "text": "journaled"}})
    );
    assert_eq!(second.idempotency_key.as_deref(), Some("j-1"));
    assert_eq!(second.answer, sent.body);
    assert_eq!(journal[2].status, 401);
    assert!(journal.windows(2).all(|w| w[0].seq < w[1].seq));
    assert!(journal.iter().all(|e| (start..=end).contains(&e.at)));

    let r = call(
        &app,
        TestRequest::delete().uri("/_emulator/journal").to_request(),
    )
    .await;
    assert_eq!(r.status, 204);
    assert!(emu.journal().is_empty());
    // Admin calls are not journaled.
    call(
        &app,
        TestRequest::get().uri("/_emulator/state").to_request(),
    )
    .await;
    assert!(emu.journal().is_empty());

    let mut config = EmulatorConfig::new(Secret::new(KEY));
    config.journal_capacity = 2;
    let small = Emulator::with_default_seed(config).expect("emulator");
    let app = app!(small);
    for _ in 0..3 {
        call(&app, get("/openapi/bot").to_request()).await;
    }
    let seqs: Vec<u64> = small.journal().iter().map(|e| e.seq).collect();
    assert_eq!(seqs, vec![2, 3]);
}

#[actix_web::test]
async fn the_api_key_never_appears_in_answers_journal_or_state() {
    let emu = emulator();
    let app = app!(emu);
    let mut bodies = Vec::new();
    let wrong = format!("Bearer {KEY}-but-wrong");
    let reqs = vec![
        TestRequest::get()
            .uri("/openapi/bot")
            .insert_header(("Authorization", wrong.clone())),
        TestRequest::get()
            .uri("/openapi/bot")
            .insert_header(("Authorization", KEY)),
        get("/openapi/bot"),
        get("/openapi/nothing"),
        send_text(""),
        authed(TestRequest::post().uri(MESSAGES)).set_payload(format!("not json {KEY}")),
    ];
    for req in reqs {
        let r = call(&app, req.to_request()).await;
        bodies.push(r.body.to_string());
        for (name, value) in r.headers.iter() {
            assert!(!value.to_str().unwrap_or("").contains(KEY), "header {name}");
        }
    }
    for path in [
        "/_emulator/journal",
        "/_emulator/state",
        "/_emulator/faults",
    ] {
        let r = call(&app, TestRequest::get().uri(path).to_request()).await;
        assert_eq!(r.status, 200, "{path} needs no key");
        bodies.push(r.body.to_string());
    }
    for body in &bodies {
        assert!(!body.contains(KEY), "leaked in {body}");
    }
    let config = EmulatorConfig::new(Secret::new(KEY));
    assert!(!format!("{config:?} {emu:?}").contains(KEY));
}

#[actix_web::test]
async fn it_can_be_mounted_under_a_prefix_and_reset() {
    let emu = emulator();
    let mounted = emu.clone();
    let app = test::init_service(
        App::new().service(web::scope("/emu").configure(move |cfg| mounted.configure(cfg))),
    )
    .await;
    let r = call(&app, get("/emu/openapi/bot").to_request()).await;
    assert_eq!(r.status, 200);
    assert_eq!(emu.journal()[0].path, "/openapi/bot");
    let before = emu.state_snapshot();
    let put = authed(TestRequest::put().uri(&format!("/emu/openapi/conversation/{CONV1}/manual")))
        .set_json(json!({"enabled": true}))
        .insert_header(("Idempotency-Key", "m-1"));
    assert_eq!(call(&app, put.to_request()).await.status, 200);
    assert_ne!(emu.state_snapshot(), before);
    let r = call(
        &app,
        TestRequest::post().uri("/emu/_emulator/reset").to_request(),
    )
    .await;
    assert_eq!(r.status, 204);
    assert_eq!(emu.state_snapshot(), before);
}

#[actix_web::test]
async fn a_trickled_call_takes_effect_and_its_answer_arrives_a_byte_at_a_time() {
    let emu = emulator();
    let app = app!(emu);
    let before = message_count(&emu);
    set_faults(
        &emu,
        FaultConfig {
            trickle_next: 1,
            trickle_byte_ms: 5,
            ..FaultConfig::default()
        },
    );
    let started = std::time::Instant::now();
    let resp = test::call_service(
        &app,
        send_text("slow")
            .insert_header(("Idempotency-Key", "trickle-1"))
            .to_request(),
    )
    .await;
    // The head is there before the body: status and the full length up front.
    assert_eq!(resp.status().as_u16(), 200);
    let promised: usize = resp
        .headers()
        .get("content-length")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .expect("content-length");
    let mut body = std::pin::pin!(resp.into_body());
    let mut chunks = Vec::new();
    while let Some(chunk) = futures_util::future::poll_fn(|cx| body.as_mut().poll_next(cx)).await {
        chunks.push(chunk.expect("chunk"));
    }
    let bytes: Vec<u8> = chunks.iter().flat_map(|c| c.iter().copied()).collect();
    assert!(chunks.iter().all(|c| c.len() == 1), "one byte per chunk");
    assert_eq!(bytes.len(), promised);
    // One pause per byte.
    assert!(
        started.elapsed() >= Duration::from_millis(5 * promised as u64),
        "{:?} for {promised} bytes",
        started.elapsed()
    );
    let answer: Value = serde_json::from_slice(&bytes).expect("the whole answer");
    // It took effect once; the journal names the fault with the real status and answer.
    assert_eq!(message_count(&emu), before + 1);
    let entry = emu.journal().pop().expect("journaled");
    assert_eq!(
        (entry.status, entry.fault.as_deref()),
        (200, Some("trickle"))
    );
    assert_eq!(entry.answer, answer);
    // A retry under the same key (a client that gave up) replays, quickly, with no new effect.
    let again = call(
        &app,
        send_text("slow")
            .insert_header(("Idempotency-Key", "trickle-1"))
            .to_request(),
    )
    .await;
    assert_eq!(again.status, 200);
    assert_eq!(again.body, answer);
    assert_eq!(message_count(&emu), before + 1);
}
