//! Client behaviour under paused time with a scripted transport: one attempt per call (the
//! outbox schedules retries), `Retry-After` parsed, permanent errors, idempotency keys.

use super::client::{ApiCall, AttemptObserver, Client, ClientSettings, Execute};
use super::error::UpstreamError;
use super::limits::{Limits, LimitsConfig, Rate};
use super::transport::{RawRequest, RawResponse, Transport, TransportError};
use model::contract::Endpoint;
use model::secret::Secret;
use std::cell::RefCell;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// Answers from a script and records each request with the (virtual) time it arrived.
struct Scripted {
    answers: RefCell<VecDeque<Result<RawResponse, TransportError>>>,
    seen: RefCell<Vec<(Duration, RawRequest)>>,
    start: Instant,
}

impl Scripted {
    fn new(answers: Vec<Result<RawResponse, TransportError>>) -> Self {
        Scripted {
            answers: RefCell::new(answers.into()),
            seen: RefCell::new(Vec::new()),
            start: Instant::now(),
        }
    }
}

impl Transport for &Scripted {
    async fn send(&self, request: RawRequest) -> Result<RawResponse, TransportError> {
        self.seen.borrow_mut().push((self.start.elapsed(), request));
        self.answers
            .borrow_mut()
            .pop_front()
            .unwrap_or(Err(TransportError::Other("script exhausted".into())))
    }
}

fn status(code: u16, retry_after: Option<&str>) -> Result<RawResponse, TransportError> {
    Ok(RawResponse {
        status: code,
        retry_after: retry_after.map(str::to_owned),
        body: bytes::Bytes::from(format!(r#"{{"error":{{"code":"c{code}","message":"m"}}}}"#)),
    })
}

fn ok(body: &str) -> Result<RawResponse, TransportError> {
    Ok(RawResponse {
        status: 200,
        retry_after: None,
        body: bytes::Bytes::from(body.to_owned()),
    })
}

fn unlimited() -> LimitsConfig {
    let r = Rate {
        per_second: 1_000_000.0,
        burst: 1_000,
    };
    LimitsConfig {
        global: r,
        write: r,
        partner_send: r,
        notify: r,
    }
}

fn client(t: &Scripted) -> Client<&Scripted> {
    let settings = ClientSettings {
        auth_header: "Authorization".into(),
        auth_scheme: "Bearer".into(),
        api_key: Secret::new("k-secret-123"),
        idempotency_header: "Idempotency-Key".into(),
    };
    Client::new(t, settings, Limits::new(&unlimited()).expect("limits"))
}

fn manual_call() -> ApiCall {
    let mut call = ApiCall::new(Endpoint::SetManual, &["conv 1"]);
    call.body = Some(serde_json::json!({"enabled": true}));
    call.idempotency_key = Some("key-1".into());
    call
}

#[tokio::test(start_paused = true)]
async fn a_transient_failure_is_one_attempt_returned_at_once_under_the_same_key() {
    let t = Scripted::new(vec![
        status(503, None),
        Err(TransportError::Timeout),
        Err(TransportError::Connect("refused".into())),
        status(429, Some("garbage")),
        ok(r#"{"conversationId":"c","enabled":true,"status":"HANDOVER","updatedAt":1}"#),
    ]);
    let c = client(&t);
    let start = Instant::now();
    for expected in 1..=4 {
        let err = c.execute(manual_call()).await.expect_err("transient");
        assert!(err.is_retryable(), "{err:?}");
        assert_eq!(t.seen.borrow().len(), expected, "one attempt per call");
    }
    assert_eq!(
        start.elapsed(),
        Duration::ZERO,
        "no sleeping inside the client"
    );
    let value = c.execute(manual_call()).await.expect("succeeds");
    assert_eq!(value["status"], "HANDOVER");
    let seen = t.seen.borrow();
    assert_eq!(seen.len(), 5);
    for (_, req) in seen.iter() {
        assert_eq!(req.path, "/openapi/conversation/conv%201/manual");
        assert!(
            req.headers
                .contains(&("Idempotency-Key".into(), "key-1".into())),
            "same key on every attempt"
        );
        assert!(req
            .headers
            .contains(&("Authorization".into(), "Bearer k-secret-123".into())));
    }
}

#[tokio::test(start_paused = true)]
async fn permanent_errors_are_not_retried_and_keep_status_and_body() {
    for code in [400, 401, 404, 409, 422] {
        let t = Scripted::new(vec![status(code, None), ok("{}")]);
        let err = client(&t)
            .execute(manual_call())
            .await
            .expect_err("permanent");
        assert_eq!(t.seen.borrow().len(), 1, "{code} was retried");
        match err {
            UpstreamError::Status {
                status,
                code: c,
                body,
                ..
            } => {
                assert_eq!(status, code);
                assert_eq!(c, format!("c{code}"));
                assert!(body.contains("error"));
            }
            other => panic!("{other:?}"),
        }
    }
}

#[tokio::test(start_paused = true)]
async fn retry_after_is_parsed_in_seconds_and_dates() {
    let date = httpdate::fmt_http_date(std::time::SystemTime::now() + Duration::from_secs(5));
    let t = Scripted::new(vec![
        status(429, Some("3")),
        status(503, Some(&date)),
        status(429, Some("86400")),
    ]);
    let c = client(&t);
    let mut waits = Vec::new();
    for _ in 0..3 {
        match c.execute(manual_call()).await {
            Err(UpstreamError::Status { retry_after, .. }) => waits.push(retry_after),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(waits[0], Some(Duration::from_secs(3)));
    // An HTTP date is relative to the wall clock at parse time: about 5 s (4..=5 after rounding).
    let w = waits[1].expect("date");
    assert!(
        w >= Duration::from_secs(4) && w <= Duration::from_secs(5),
        "{w:?}"
    );
    // Not clamped here: the outbox's policy clamps (`outbox.retry.max_retry_after`).
    assert_eq!(waits[2], Some(Duration::from_secs(86_400)));
}

#[tokio::test(start_paused = true)]
async fn reads_carry_no_key_and_unkeyed_writes_get_a_stable_generated_one() {
    let t = Scripted::new(vec![ok("{}"), status(500, None), ok("{}")]);
    let c = client(&t);
    c.execute(ApiCall::new(Endpoint::GetBot, &["B1"]))
        .await
        .expect("read");
    let mut write = manual_call();
    write.idempotency_key = None;
    c.execute(write.clone())
        .await
        .expect_err("500, one attempt");
    c.execute(write).await.expect("write");
    let seen = t.seen.borrow();
    assert!(!seen[0]
        .1
        .headers
        .iter()
        .any(|(k, _)| k == "Idempotency-Key"));
    let key = |i: usize| {
        seen[i]
            .1
            .headers
            .iter()
            .find(|(k, _)| k == "Idempotency-Key")
            .map(|(_, v)| v.clone())
    };
    assert!(
        key(1).is_some() && key(2).is_some(),
        "every write carries a key"
    );
}

#[tokio::test(start_paused = true)]
async fn bad_calls_fail_before_anything_is_sent() {
    let t = Scripted::new(vec![]);
    let c = client(&t);
    let err = c
        .execute(ApiCall::new(Endpoint::PbBlock, &["only-one"]))
        .await
        .expect_err("arity");
    assert!(matches!(err, UpstreamError::InvalidCall(_)), "{err:?}");
    let err = c
        .execute(ApiCall::new(Endpoint::GetBot, &[""]))
        .await
        .expect_err("empty");
    assert!(matches!(err, UpstreamError::InvalidCall(_)), "{err:?}");
    assert!(t.seen.borrow().is_empty());
    assert!(!format!("{err}").contains("k-secret-123"));
}

#[test]
fn path_and_query_are_encoded() {
    let mut call = ApiCall::new(Endpoint::PbGetConversation, &["sk/1", "user key"]);
    call.query = vec![
        ("from".into(), "1".into()),
        ("userKey".into(), "a&b".into()),
    ];
    assert_eq!(
        call.path_and_query().expect("path"),
        "/openapi/partnerbiz/sk%2F1/conversation/user%20key?from=1&userKey=a%26b"
    );
}

#[tokio::test(start_paused = true)]
async fn every_attempt_is_reported_to_the_observer_with_its_outcome() {
    let t = Scripted::new(vec![
        status(503, None),
        Err(TransportError::Timeout),
        Err(TransportError::Connect("refused".into())),
        ok(r#"{"conversationId":"c","enabled":true,"status":"HANDOVER","updatedAt":1}"#),
    ]);
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let sink = seen.clone();
    let observer = AttemptObserver::new(move |endpoint, status| {
        if let Ok(mut s) = sink.lock() {
            s.push(format!("{endpoint} {status}"));
        }
    });
    let c = client(&t).with_observer(Some(observer));
    for _ in 0..3 {
        c.execute(manual_call()).await.expect_err("transient");
    }
    c.execute(manual_call())
        .await
        .expect("succeeds on the 4th call");
    let seen = seen.lock().expect("lock").clone();
    let name = Endpoint::SetManual.name();
    assert_eq!(
        seen,
        [
            format!("{name} 503"),
            format!("{name} timeout"),
            format!("{name} connect"),
            format!("{name} 2xx"),
        ]
    );
}

/// The executor's home: a task spawned beside the client runs on the client's own thread, its
/// calls go through the client there (here refused: nothing listens on the port), and its end
/// is heard by whoever started it.
#[actix_rt::test]
async fn a_task_beside_the_client_runs_on_its_thread_and_its_end_is_heard() {
    use super::handle::{Remote as Upstream, UpstreamHandle};
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let tls =
        crate::tls::ClientTls::new(&crate::tls::Trust::empty(), "", "upstream", None).expect("tls");
    let endpoint = Upstream {
        base_url: format!("http://127.0.0.1:{closed}"),
        connect_timeout: Duration::from_secs(2),
        request_timeout: Duration::from_secs(2),
        tls,
    };
    let settings = ClientSettings {
        auth_header: "Authorization".into(),
        auth_scheme: "Bearer".into(),
        api_key: Secret::new("k-secret-123"),
        idempotency_header: "Idempotency-Key".into(),
    };
    let handle = UpstreamHandle::start(endpoint, settings, &unlimited(), None).expect("start");
    let (tx, rx) = tokio::sync::oneshot::channel();
    let beside = handle.clone();
    let finished = handle
        .spawn_beside(async move {
            let thread = std::thread::current().name().map(str::to_owned);
            let answer = beside.execute(manual_call()).await;
            let _ = tx.send((thread, answer));
        })
        .expect("spawned");
    let (thread, answer) = tokio::time::timeout(Duration::from_secs(10), rx)
        .await
        .expect("in time")
        .expect("the task ran");
    // actix names an arbiter's thread `actix-rt|system:N|arbiter:M`; the test runs on the system's.
    assert!(
        thread
            .as_deref()
            .is_some_and(|name| name.contains("arbiter")),
        "on the client's arbiter: {thread:?}"
    );
    assert!(
        matches!(answer, Err(UpstreamError::Connect(_))),
        "the call reached the client and came back: {answer:?}"
    );
    tokio::time::timeout(Duration::from_secs(10), finished)
        .await
        .expect("in time")
        .expect("its end is heard");
}
