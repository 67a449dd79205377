//! Contract tests of the typed Open API client (`OpenApi<Client<AwcTransport>>`) against the
//! standalone emulator on a loopback socket, with the default seed: per endpoint, the typed
//! answer, what the emulator journaled (method, path, query, body, idempotency key), the state a
//! later read observes, and at least one permanent error (not retried, no effect). Plus
//! idempotency (one effect per key), authentication, that the API key never leaks, and the hang
//! and drop faults over a real socket.

use ::emulator::{start_standalone, Emulator, EmulatorConfig, FaultConfig, JournalEntry, Seed};
use model::contract::{
    BotConversationsQuery, BusinessHours, ChannelSetting, ConversationsQuery, EndUsersQuery,
    Endpoint, MessageRangeQuery, MessagesQuery, NotifyRequest, PageQuery, PbStatus,
    UpdatePbConversation,
};
use model::secret::Secret;
use model::webhook::model::MessageData;
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;
use upstream::limits::{Limits, LimitsConfig, Rate};
use upstream::transport::AwcTransport;
use upstream::{Client, ClientSettings, OpenApi, UpstreamError};

const KEY: &str = "hb-contract-SUPERSECRET-key-9f31c";
const WRONG_KEY: &str = "hb-wrong-SUPERSECRET-key-0b7d2";

// The default seed (deploy/emulator-seed.json).
const BOT: &str = "B7f3a2c";
const BOT2: &str = "B2c9d10";
const CONV1: &str = "5c0e9b1f-2222-4d3e-9f10-000000000001";
const CONV2: &str = "5c0e9b1f-2222-4d3e-9f10-000000000002";
const CONV4: &str = "5c0e9b1f-2222-4d3e-9f10-000000000004";
const EU1: &str = "4e6f0d0a-1111-4a5b-8c9d-000000000001";
const EU2: &str = "4e6f0d0a-1111-4a5b-8c9d-000000000002";
const SK: &str = "sk-support-0001";
/// Waiting, not blocked, session active since `UK_SESSION`.
const UK: &str = "kb-user-77a9f2";
const UK_SESSION: i64 = 1_763_690_400_000;
/// Closed, blocked, no session.
const UK_BLOCKED: &str = "kb-user-blocked-03";
const MISSING: &str = "does-not-exist";

type Api = OpenApi<Client<AwcTransport>>;

fn limits() -> Limits {
    let r = Rate {
        per_second: 10_000.0,
        burst: 1_000,
    };
    Limits::new(&LimitsConfig {
        global: r,
        write: r,
        partner_send: r,
        notify: r,
    })
    .expect("limits")
}

fn settings(key: &str, scheme: &str) -> ClientSettings {
    ClientSettings {
        auth_header: "Authorization".into(),
        auth_scheme: scheme.into(),
        api_key: Secret::new(key),
        idempotency_header: "Idempotency-Key".into(),
    }
}

/// A running emulator and a client pointed at it.
struct Env {
    api: Api,
    emu: Emulator,
    base: String,
    handle: actix_web::dev::ServerHandle,
    server: actix_web::rt::task::JoinHandle<std::io::Result<()>>,
}

impl Env {
    async fn start() -> Env {
        let seed = Seed::default_seed().expect("seed");
        let running = start_standalone("127.0.0.1:0", seed, EmulatorConfig::new(Secret::new(KEY)))
            .expect("start the emulator");
        let addr = running.addrs[0];
        assert!(addr.ip().is_loopback());
        let handle = running.server.handle();
        let server = actix_web::rt::spawn(running.server);
        let base = format!("http://{addr}");
        let api = client(&base, KEY, "Bearer", Duration::from_secs(5));
        Env {
            api,
            emu: running.emulator,
            base,
            handle,
            server,
        }
    }

    async fn stop(self) {
        drop(self.api);
        self.handle.stop(false).await;
        let _ = self.server.await;
    }

    /// Runs a call that must fail permanently: exactly one attempt reaches the emulator, the
    /// error carries `status` and `code`, and the state is unchanged. Returns the error and
    /// the journal entry.
    async fn permanent<T: std::fmt::Debug>(
        &self,
        call: impl Future<Output = Result<T, UpstreamError>>,
        status: u16,
        code: &str,
    ) -> (UpstreamError, JournalEntry) {
        let before = self.emu.state_snapshot();
        self.emu.clear_journal();
        let err = call.await.expect_err("the call must fail");
        assert_status(&err, status, code);
        let entry = single(&self.emu);
        assert_eq!(entry.status, status, "{entry:?}");
        assert_eq!(entry.answer["error"]["code"], code, "{entry:?}");
        assert!(!entry.replayed && entry.fault.is_none(), "{entry:?}");
        assert_eq!(
            self.emu.state_snapshot(),
            before,
            "a failed call changed the state"
        );
        (err, entry)
    }
}

fn client(base: &str, key: &str, scheme: &str, request_timeout: Duration) -> Api {
    OpenApi::new(Client::new(
        AwcTransport::new(
            base,
            Duration::from_secs(2),
            request_timeout,
            upstream::tls::ClientTls::new(&upstream::tls::Trust::empty(), "", "upstream", None)
                .expect("client TLS"),
        ),
        settings(key, scheme),
        limits(),
    ))
}

#[track_caller]
fn assert_status(err: &UpstreamError, want_status: u16, want_code: &str) {
    match err {
        UpstreamError::Status {
            status,
            code,
            body,
            retry_after,
            ..
        } => {
            assert_eq!(*status, want_status, "{err:?}");
            assert_eq!(code, want_code, "{err:?}");
            assert!(body.contains(want_code), "{err:?}");
            assert_eq!(*retry_after, None);
        }
        other => panic!("expected {want_status} {want_code}, got {other:?}"),
    }
    assert!(!err.is_retryable());
    assert_eq!(err.status(), Some(want_status));
    let shown = err.to_string();
    assert!(shown.contains(&want_status.to_string()) && shown.contains(want_code));
    assert!(!shown.contains(KEY) && !format!("{err:?}").contains(KEY));
}

/// The journal holds exactly one entry; it is returned.
#[track_caller]
fn single(emu: &Emulator) -> JournalEntry {
    let mut j = emu.journal();
    assert_eq!(j.len(), 1, "expected exactly one call: {j:#?}");
    j.remove(0)
}

/// Checks a successful, first-time call as the emulator saw it.
#[track_caller]
fn assert_entry(e: &JournalEntry, endpoint: Endpoint, path: &str, body: Value, key: Option<&str>) {
    assert_eq!(e.method, endpoint.method(), "{e:?}");
    assert_eq!(e.path, path, "{e:?}");
    assert_eq!(e.endpoint.as_deref(), Some(endpoint.name()), "{e:?}");
    assert_eq!(e.body, body, "{e:?}");
    assert_eq!(e.idempotency_key.as_deref(), key, "{e:?}");
    assert_eq!(e.status, 200, "{e:?}");
    assert!(!e.replayed, "{e:?}");
    assert_eq!(e.fault, None, "{e:?}");
}

/// The journaled query string, decoded.
fn query(e: &JournalEntry) -> BTreeMap<String, String> {
    let decode = |s: &str| {
        percent_encoding::percent_decode_str(s)
            .decode_utf8()
            .expect("utf-8")
            .into_owned()
    };
    e.query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (decode(k), decode(v))
        })
        .collect()
}

fn pairs(items: &[(&str, &str)]) -> BTreeMap<String, String> {
    items
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

fn text(t: &str) -> MessageData {
    serde_json::from_value(json!({"type": "text", "text": t})).expect("message data")
}

fn page(offset: u32, limit: u32) -> PageQuery {
    PageQuery {
        offset: Some(offset),
        limit: Some(limit),
    }
}

fn limit(limit: u32) -> PageQuery {
    PageQuery {
        offset: None,
        limit: Some(limit),
    }
}

fn conv_path(id: &str, rest: &str) -> String {
    format!("/openapi/conversation/{id}{rest}")
}

fn pb_path(user: &str, rest: &str) -> String {
    format!("/openapi/partnerbiz/{SK}/conversation/{user}{rest}")
}

// ---------------------------------------------------------------------------------------------
// Bot Builder (16)

#[actix_web::test]
async fn e01_list_bots() {
    let env = Env::start().await;
    env.emu.clear_journal();
    let all = env
        .api
        .list_bots(&PageQuery::default())
        .await
        .expect("list bots");
    let ids: Vec<&str> = all.data.iter().map(|b| b.id.as_str()).collect();
    assert_eq!(ids, vec![BOT, BOT2]);
    assert_eq!(
        (all.paging.offset, all.paging.limit, all.paging.total),
        (0, 20, 2)
    );
    assert_eq!(all.data[0].title.as_deref(), Some("Support bot"));
    let e = single(&env.emu);
    assert_entry(&e, Endpoint::ListBots, "/openapi/bot", Value::Null, None);
    assert_eq!(e.query, "");

    env.emu.clear_journal();
    let second = env.api.list_bots(&page(1, 1)).await.expect("page 2");
    assert_eq!(second.data.len(), 1);
    assert_eq!(second.data[0].id.as_str(), BOT2);
    assert_eq!(
        (
            second.paging.offset,
            second.paging.limit,
            second.paging.total
        ),
        (1, 1, 2)
    );
    let e = single(&env.emu);
    assert_entry(&e, Endpoint::ListBots, "/openapi/bot", Value::Null, None);
    assert_eq!(query(&e), pairs(&[("offset", "1"), ("limit", "1")]));

    for bad in [0, 101] {
        env.permanent(env.api.list_bots(&limit(bad)), 400, "invalid_query")
            .await;
    }
    env.stop().await;
}

#[actix_web::test]
async fn e02_get_bot() {
    let env = Env::start().await;
    env.emu.clear_journal();
    let bot = env.api.get_bot(BOT).await.expect("get bot");
    assert_eq!(bot.id.as_str(), BOT);
    assert_eq!(bot.title.as_deref(), Some("Support bot"));
    assert_eq!(
        bot.description.as_deref(),
        Some("Order and delivery questions")
    );
    assert_eq!(
        bot.preference,
        Some(json!({"entryFlowId": 1, "fallbackFlowId": 2}))
    );
    let e = single(&env.emu);
    assert_entry(
        &e,
        Endpoint::GetBot,
        &format!("/openapi/bot/{BOT}"),
        Value::Null,
        None,
    );

    let (_, e) = env
        .permanent(env.api.get_bot(MISSING), 404, "not_found")
        .await;
    assert_eq!(e.path, format!("/openapi/bot/{MISSING}"));
    env.stop().await;
}

#[actix_web::test]
async fn e03_list_bot_conversations() {
    let env = Env::start().await;
    let path = format!("/openapi/bot/{BOT}/conversation");
    env.emu.clear_journal();
    let all = env
        .api
        .list_bot_conversations(BOT, &BotConversationsQuery::default())
        .await
        .expect("list");
    let ids: Vec<&str> = all.data.iter().map(|c| c.id.as_str()).collect();
    assert_eq!(
        ids,
        vec![CONV1, CONV2, "5c0e9b1f-2222-4d3e-9f10-000000000003"]
    );
    assert_eq!(all.paging.total, 3);
    assert_entry(
        &single(&env.emu),
        Endpoint::ListBotConversations,
        &path,
        Value::Null,
        None,
    );

    env.emu.clear_journal();
    let q = BotConversationsQuery {
        platform: Some("kakaobiz".into()),
        user_key: Some(UK.into()),
        ..BotConversationsQuery::default()
    };
    let one = env
        .api
        .list_bot_conversations(BOT, &q)
        .await
        .expect("filtered");
    assert_eq!(one.data.len(), 1);
    assert_eq!(one.data[0].id.as_str(), CONV2);
    assert_eq!(one.paging.total, 1);
    let e = single(&env.emu);
    assert_entry(&e, Endpoint::ListBotConversations, &path, Value::Null, None);
    assert_eq!(
        query(&e),
        pairs(&[("platform", "kakaobiz"), ("userKey", UK)])
    );

    // The other bot's conversation is not listed under this bot.
    let q = BotConversationsQuery {
        end_user_id: Some("4e6f0d0a-1111-4a5b-8c9d-000000000004".into()),
        ..BotConversationsQuery::default()
    };
    let none = env.api.list_bot_conversations(BOT, &q).await.expect("none");
    assert!(none.data.is_empty());
    assert_eq!(none.paging.total, 0);

    env.permanent(
        env.api
            .list_bot_conversations(MISSING, &BotConversationsQuery::default()),
        404,
        "not_found",
    )
    .await;
    let empty_filter = BotConversationsQuery {
        platform: Some(String::new()),
        ..BotConversationsQuery::default()
    };
    env.permanent(
        env.api.list_bot_conversations(BOT, &empty_filter),
        400,
        "invalid_query",
    )
    .await;
    env.stop().await;
}

#[actix_web::test]
async fn e04_list_flows() {
    let env = Env::start().await;
    env.emu.clear_journal();
    let flows = env.api.list_flows(BOT).await.expect("flows");
    let ids: Vec<i64> = flows.data.iter().map(|f| f.id).collect();
    assert_eq!(ids, vec![1, 2, 3, 5, 9]);
    let agent = &flows.data[3];
    assert_eq!(agent.title, "Agent call");
    let nodes: Vec<(i64, &str)> = agent
        .nodes
        .iter()
        .map(|n| (n.id, n.kind.as_str()))
        .collect();
    assert_eq!(nodes, vec![(40, "agent_call"), (41, "message")]);
    assert_entry(
        &single(&env.emu),
        Endpoint::ListFlows,
        &format!("/openapi/bot/{BOT}/flow"),
        Value::Null,
        None,
    );
    let other = env.api.list_flows(BOT2).await.expect("flows of bot 2");
    assert_eq!(other.data.len(), 1);

    env.permanent(env.api.list_flows(MISSING), 404, "not_found")
        .await;
    env.stop().await;
}

#[actix_web::test]
async fn e05_get_conversation() {
    let env = Env::start().await;
    env.emu.clear_journal();
    let c = env.api.get_conversation(CONV1).await.expect("get");
    assert_eq!(c.id.as_str(), CONV1);
    assert_eq!(c.bot_id.as_ref().map(|b| b.as_str()), Some(BOT));
    assert_eq!(c.end_user_id.as_ref().map(|e| e.as_str()), Some(EU1));
    assert_eq!(
        c.user_key.as_ref().map(|k| k.as_str()),
        Some("web-visitor-8841")
    );
    let nav = c.navigation.as_ref().expect("navigation");
    let cur = nav.current.as_ref().expect("current");
    assert_eq!((cur.flow_id, cur.node_id), (5, 40));
    let prev = nav.prev.as_ref().expect("prev");
    assert_eq!((prev.flow_id, prev.node_id), (3, 12));
    assert_eq!(
        c.params.as_ref().expect("params")["orderNo"],
        "A-20251121-0042"
    );
    assert_entry(
        &single(&env.emu),
        Endpoint::GetConversation,
        &conv_path(CONV1, ""),
        Value::Null,
        None,
    );

    env.permanent(env.api.get_conversation(MISSING), 404, "not_found")
        .await;
    env.stop().await;
}

#[actix_web::test]
async fn e06_update_conversation() {
    let env = Env::start().await;
    let mut params = Map::new();
    params.insert("ticket".into(), json!("T-1001"));
    params.insert("priority".into(), json!(2));
    params.insert("name".into(), Value::Null);
    env.emu.clear_journal();
    let c = env
        .api
        .update_conversation(CONV1, params, "k-update-1")
        .await
        .expect("update");
    let expect = json!({"orderNo": "A-20251121-0042", "ticket": "T-1001", "priority": 2});
    assert_eq!(Value::Object(c.params.clone().expect("params")), expect);
    let e = single(&env.emu);
    assert_entry(
        &e,
        Endpoint::UpdateConversation,
        &conv_path(CONV1, ""),
        json!({"params": {"ticket": "T-1001", "priority": 2, "name": null}}),
        Some("k-update-1"),
    );

    // A later read sees the merge, in the conversation and its context.
    let again = env.api.get_conversation(CONV1).await.expect("get");
    assert_eq!(Value::Object(again.params.expect("params")), expect);
    let ctx_params = again
        .context
        .and_then(|c| c.params)
        .expect("context params");
    assert_eq!(Value::Object(ctx_params), expect);
    assert_eq!(
        again.updated_at.as_deref(),
        c.updated_at.as_deref(),
        "updatedAt bumped once"
    );
    assert_ne!(
        c.updated_at.as_deref(),
        Some("2025-11-21T02:00:02.200Z"),
        "updatedAt bumped"
    );

    env.permanent(
        env.api
            .update_conversation(MISSING, Map::new(), "k-update-404"),
        404,
        "not_found",
    )
    .await;
    env.stop().await;
}

#[actix_web::test]
async fn e07_set_manual() {
    let env = Env::start().await;
    env.emu.clear_journal();
    let m = env
        .api
        .set_manual(CONV2, true, "k-manual-on")
        .await
        .expect("set manual");
    assert_eq!(m.conversation_id, CONV2);
    assert!(m.enabled);
    assert_eq!(m.status.as_deref(), Some("HANDOVER"));
    let e = single(&env.emu);
    assert_entry(
        &e,
        Endpoint::SetManual,
        &conv_path(CONV2, "/manual"),
        json!({"enabled": true}),
        Some("k-manual-on"),
    );
    assert_eq!(m.updated_at, e.at, "stamped with the emulator's time");

    // Observable: the manual status, and its mirror in the conversation's context.
    let got = env.api.get_manual(CONV2).await.expect("get manual");
    assert_eq!(got, m);
    let conv = env.api.get_conversation(CONV2).await.expect("get");
    assert_eq!(conv.manual_status(), Some("HANDOVER"));

    let off = env
        .api
        .set_manual(CONV2, false, "k-manual-off")
        .await
        .expect("off");
    assert!(!off.enabled);
    assert_eq!(off.status, None);
    assert!(!env.api.get_manual(CONV2).await.expect("get").enabled);
    let conv = env.api.get_conversation(CONV2).await.expect("get");
    assert_eq!(conv.manual_status(), None);

    env.permanent(
        env.api.set_manual(MISSING, true, "k-manual-404"),
        404,
        "not_found",
    )
    .await;
    env.stop().await;
}

#[actix_web::test]
async fn e08_get_manual() {
    let env = Env::start().await;
    env.emu.clear_journal();
    let m = env.api.get_manual(CONV1).await.expect("get manual");
    assert_eq!(m.conversation_id, CONV1);
    assert!(!m.enabled);
    assert_eq!(m.status, None);
    assert_entry(
        &single(&env.emu),
        Endpoint::GetManual,
        &conv_path(CONV1, "/manual"),
        Value::Null,
        None,
    );

    env.permanent(env.api.get_manual(MISSING), 404, "not_found")
        .await;
    env.stop().await;
}

#[actix_web::test]
async fn e09_list_conversation_messages() {
    let env = Env::start().await;
    let path = conv_path(CONV1, "/message");
    env.emu.clear_journal();
    let all = env
        .api
        .list_conversation_messages(CONV1, &MessageRangeQuery::default())
        .await
        .expect("list");
    let ids: Vec<&str> = all.data.iter().map(|m| m.id.as_str()).collect();
    assert_eq!(
        ids,
        vec![
            "6a1d0000-0000-4000-8000-000000000016",
            "6a1d0000-0000-4000-8000-000000000020",
            "6a1d0000-0000-4000-8000-000000000027"
        ],
        "oldest first"
    );
    assert!(all.data[0].is_user && !all.data[1].is_user);
    assert_entry(
        &single(&env.emu),
        Endpoint::ListConversationMessages,
        &path,
        Value::Null,
        None,
    );

    env.emu.clear_journal();
    let q = MessageRangeQuery {
        page: PageQuery::default(),
        from: Some(1_763_690_402_100),
        to: Some(1_763_690_402_100),
    };
    let one = env
        .api
        .list_conversation_messages(CONV1, &q)
        .await
        .expect("range");
    assert_eq!(one.data.len(), 1, "from and to are inclusive");
    assert_eq!(one.data[0].id, "6a1d0000-0000-4000-8000-000000000020");
    let e = single(&env.emu);
    assert_eq!(
        query(&e),
        pairs(&[("from", "1763690402100"), ("to", "1763690402100")])
    );

    env.permanent(
        env.api
            .list_conversation_messages(MISSING, &MessageRangeQuery::default()),
        404,
        "not_found",
    )
    .await;
    let bad = MessageRangeQuery {
        page: limit(0),
        ..MessageRangeQuery::default()
    };
    env.permanent(
        env.api.list_conversation_messages(CONV1, &bad),
        400,
        "invalid_query",
    )
    .await;
    env.stop().await;
}

#[actix_web::test]
async fn e10_send_conversation_message() {
    let env = Env::start().await;
    env.emu.clear_journal();
    let m = env
        .api
        .send_conversation_message(
            CONV1,
            text("주문을 확인했습니다."),
            Some(r#"{"ticket":"T-1"}"#.into()),
            "k-send-1",
        )
        .await
        .expect("send");
    assert!(!m.is_user, "sent by the bot");
    assert_eq!(m.conversation_id.as_str(), CONV1);
    assert_eq!(m.end_user_id.as_ref().map(|e| e.as_str()), Some(EU1));
    assert_eq!(m.data, text("주문을 확인했습니다."));
    assert_eq!(
        m.meta.as_ref().and_then(|x| x.custom.as_deref()),
        Some(r#"{"ticket":"T-1"}"#)
    );
    let e = single(&env.emu);
    assert_entry(
        &e,
        Endpoint::SendConversationMessage,
        &conv_path(CONV1, "/message"),
        json!({"message": {"type": "text", "text": "주문을 확인했습니다."}, "custom": "{\"ticket\":\"T-1\"}"}),
        Some("k-send-1"),
    );
    assert_eq!(m.timestamp, Some(e.at));

    // Observable: listed last in the conversation, and the end user's last message.
    let listed = env
        .api
        .list_conversation_messages(CONV1, &MessageRangeQuery::default())
        .await
        .expect("list");
    assert_eq!(listed.paging.total, 4);
    assert_eq!(listed.data.last(), Some(&m));
    let eu = env.api.get_end_user(EU1).await.expect("end user");
    assert_eq!(eu.last_message_id.as_deref(), Some(m.id.as_str()));

    env.permanent(
        env.api
            .send_conversation_message(CONV1, text("   "), None, "k-send-blank"),
        400,
        "invalid_body",
    )
    .await;
    env.permanent(
        env.api
            .send_conversation_message(CONV1, text(&"가".repeat(1001)), None, "k-send-long"),
        400,
        "invalid_body",
    )
    .await;
    env.permanent(
        env.api
            .send_conversation_message(MISSING, text("hi"), None, "k-send-404"),
        404,
        "not_found",
    )
    .await;
    env.stop().await;
}

#[actix_web::test]
async fn e11_set_navigation() {
    let env = Env::start().await;
    env.emu.clear_journal();
    let nav = env
        .api
        .set_navigation(CONV1, 3, Some(10), "k-nav-1")
        .await
        .expect("navigate");
    let cur = nav.current.as_ref().expect("current");
    assert_eq!(
        (cur.flow_id, cur.node_id, cur.visit_count),
        (3, 10, Some(1))
    );
    let prev = nav.prev.as_ref().expect("prev");
    assert_eq!((prev.flow_id, prev.node_id), (5, 40), "prev = where it was");
    assert_entry(
        &single(&env.emu),
        Endpoint::SetNavigation,
        &conv_path(CONV1, "/navigation"),
        json!({"flowId": 3, "nodeId": 10}),
        Some("k-nav-1"),
    );
    let conv = env.api.get_conversation(CONV1).await.expect("get");
    assert_eq!(conv.navigation.as_ref(), Some(&nav));
    assert_eq!(
        conv.context.as_ref().and_then(|c| c.navigation.as_ref()),
        Some(&nav)
    );

    // Without nodeId: the flow's first node.
    env.emu.clear_journal();
    let nav = env
        .api
        .set_navigation(CONV1, 9, None, "k-nav-2")
        .await
        .expect("navigate");
    let cur = nav.current.as_ref().expect("current");
    assert_eq!((cur.flow_id, cur.node_id), (9, 90));
    let prev = nav.prev.as_ref().expect("prev");
    assert_eq!((prev.flow_id, prev.node_id), (3, 10));
    assert_eq!(single(&env.emu).body, json!({"flowId": 9}));
    let conv = env.api.get_conversation(CONV1).await.expect("get");
    assert_eq!(conv.navigation.as_ref(), Some(&nav));

    env.permanent(
        env.api.set_navigation(CONV1, 99, None, "k-nav-flow"),
        400,
        "invalid_body",
    )
    .await;
    env.permanent(
        env.api.set_navigation(CONV1, 3, Some(40), "k-nav-node"),
        400,
        "invalid_body",
    )
    .await;
    env.permanent(
        env.api.set_navigation(MISSING, 3, None, "k-nav-404"),
        404,
        "not_found",
    )
    .await;
    env.stop().await;
}

#[actix_web::test]
async fn e12_list_conversations() {
    let env = Env::start().await;
    env.emu.clear_journal();
    let all = env
        .api
        .list_conversations(&ConversationsQuery::default())
        .await
        .expect("list");
    assert_eq!(all.paging.total, 4);
    assert_entry(
        &single(&env.emu),
        Endpoint::ListConversations,
        "/openapi/conversations",
        Value::Null,
        None,
    );

    env.emu.clear_journal();
    let q = ConversationsQuery {
        bot_id: Some(BOT2.into()),
        ..ConversationsQuery::default()
    };
    let bot2 = env.api.list_conversations(&q).await.expect("by bot");
    let ids: Vec<&str> = bot2.data.iter().map(|c| c.id.as_str()).collect();
    assert_eq!(ids, vec![CONV4]);
    assert_eq!(query(&single(&env.emu)), pairs(&[("botId", BOT2)]));

    // `from`/`to` filter on updatedAt: a change moves a conversation into a recent window.
    let now = env.emu.now_ms();
    let recent = ConversationsQuery {
        from: Some(now - 60_000),
        ..ConversationsQuery::default()
    };
    let before = env.api.list_conversations(&recent).await.expect("recent");
    assert!(before.data.is_empty(), "{:?}", before.data);
    env.api
        .set_manual(CONV4, true, "k-conv-touch")
        .await
        .expect("touch");
    let after = env.api.list_conversations(&recent).await.expect("recent");
    let ids: Vec<&str> = after.data.iter().map(|c| c.id.as_str()).collect();
    assert_eq!(ids, vec![CONV4]);

    let bad = ConversationsQuery {
        page: limit(0),
        ..ConversationsQuery::default()
    };
    env.permanent(env.api.list_conversations(&bad), 400, "invalid_query")
        .await;
    let empty = ConversationsQuery {
        user_key: Some(String::new()),
        ..ConversationsQuery::default()
    };
    env.permanent(env.api.list_conversations(&empty), 400, "invalid_query")
        .await;
    env.stop().await;
}

#[actix_web::test]
async fn e13_get_end_user() {
    let env = Env::start().await;
    env.emu.clear_journal();
    let eu = env.api.get_end_user(EU1).await.expect("get");
    assert_eq!(eu.id.as_str(), EU1);
    assert_eq!(eu.platform.as_str(), "web");
    assert_eq!(eu.user_key.as_str(), "web-visitor-8841");
    assert_eq!(eu.bot_id.as_ref().map(|b| b.as_str()), Some(BOT));
    assert_eq!(
        eu.last_conversation_id.as_ref().map(|c| c.as_str()),
        Some(CONV1)
    );
    assert_entry(
        &single(&env.emu),
        Endpoint::GetEndUser,
        &format!("/openapi/enduser/{EU1}"),
        Value::Null,
        None,
    );

    env.permanent(env.api.get_end_user(MISSING), 404, "not_found")
        .await;
    env.stop().await;
}

#[actix_web::test]
async fn e14_list_end_users() {
    let env = Env::start().await;
    env.emu.clear_journal();
    let q = EndUsersQuery {
        platform: Some("kakaobiz".into()),
        bot_id: Some(BOT.into()),
        ..EndUsersQuery::default()
    };
    let users = env.api.list_end_users(&q).await.expect("list");
    let keys: Vec<&str> = users.data.iter().map(|u| u.user_key.as_str()).collect();
    assert_eq!(keys, vec![UK, UK_BLOCKED]);
    assert_eq!(users.paging.total, 2);
    let e = single(&env.emu);
    assert_entry(
        &e,
        Endpoint::ListEndUsers,
        "/openapi/endusers",
        Value::Null,
        None,
    );
    assert_eq!(
        query(&e),
        pairs(&[("platform", "kakaobiz"), ("botId", BOT)])
    );

    let paged = env
        .api
        .list_end_users(&EndUsersQuery {
            page: page(3, 2),
            ..EndUsersQuery::default()
        })
        .await
        .expect("paged");
    assert_eq!(paged.data.len(), 1);
    assert_eq!(paged.paging.total, 4);

    let bad = EndUsersQuery {
        page: limit(101),
        ..EndUsersQuery::default()
    };
    env.permanent(env.api.list_end_users(&bad), 400, "invalid_query")
        .await;
    env.stop().await;
}

#[actix_web::test]
async fn e15_send_end_user_message() {
    let env = Env::start().await;
    env.emu.clear_journal();
    let m = env
        .api
        .send_end_user_message(EU2, text("배송이 시작되었습니다."), None, "k-eu-1")
        .await
        .expect("send");
    assert!(!m.is_user);
    assert_eq!(
        m.conversation_id.as_str(),
        CONV2,
        "the user's newest conversation"
    );
    assert_eq!(m.meta, None);
    let e = single(&env.emu);
    assert_entry(
        &e,
        Endpoint::SendEndUserMessage,
        "/openapi/message",
        json!({"endUserId": EU2, "message": {"type": "text", "text": "배송이 시작되었습니다."}}),
        Some("k-eu-1"),
    );
    assert_eq!(m.timestamp, Some(e.at));

    let listed = env
        .api
        .list_messages(&MessagesQuery {
            conversation_id: Some(CONV2.into()),
            ..MessagesQuery::default()
        })
        .await
        .expect("list");
    assert_eq!(listed.data.last(), Some(&m));
    let eu = env.api.get_end_user(EU2).await.expect("end user");
    assert_eq!(eu.last_message_id.as_deref(), Some(m.id.as_str()));

    env.permanent(
        env.api
            .send_end_user_message(MISSING, text("hi"), None, "k-eu-404"),
        404,
        "not_found",
    )
    .await;
    let pdf: MessageData = serde_json::from_value(
        json!({"type": "media", "media": {"contentType": "pdf", "uri": "https://x/a.pdf"}}),
    )
    .expect("data");
    env.permanent(
        env.api.send_end_user_message(EU2, pdf, None, "k-eu-400"),
        400,
        "invalid_body",
    )
    .await;
    env.stop().await;
}

#[actix_web::test]
async fn e16_list_messages() {
    let env = Env::start().await;
    env.emu.clear_journal();
    let q = MessagesQuery {
        end_user_id: Some(EU1.into()),
        is_user: Some(false),
        ..MessagesQuery::default()
    };
    let bot_msgs = env.api.list_messages(&q).await.expect("list");
    let ids: Vec<&str> = bot_msgs.data.iter().map(|m| m.id.as_str()).collect();
    assert_eq!(
        ids,
        vec![
            "6a1d0000-0000-4000-8000-000000000020",
            "6a1d0000-0000-4000-8000-000000000027"
        ]
    );
    assert!(bot_msgs.data.iter().all(|m| !m.is_user));
    let e = single(&env.emu);
    assert_entry(
        &e,
        Endpoint::ListMessages,
        "/openapi/messages",
        Value::Null,
        None,
    );
    assert_eq!(query(&e), pairs(&[("endUserId", EU1), ("isUser", "false")]));

    let all = env
        .api
        .list_messages(&MessagesQuery::default())
        .await
        .expect("all");
    assert_eq!(all.paging.total, 6);
    let stamps: Vec<i64> = all.data.iter().filter_map(|m| m.timestamp).collect();
    assert!(stamps.windows(2).all(|w| w[0] <= w[1]), "oldest first");

    let bad = MessagesQuery {
        page: limit(0),
        ..MessagesQuery::default()
    };
    env.permanent(env.api.list_messages(&bad), 400, "invalid_query")
        .await;
    env.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Partner messenger counseling chat (7)

#[actix_web::test]
async fn e17_pb_get_conversation() {
    let env = Env::start().await;
    env.emu.clear_journal();
    let c = env.api.pb_get_conversation(SK, UK).await.expect("get");
    assert_eq!((c.sender_key.as_str(), c.user_key.as_str()), (SK, UK));
    assert_eq!(c.status, PbStatus::Waiting);
    assert!(!c.blocked && c.blocked_at.is_none());
    assert!(c.session.active);
    assert_eq!(c.session.started_at, Some(UK_SESSION));
    assert_entry(
        &single(&env.emu),
        Endpoint::PbGetConversation,
        &pb_path(UK, ""),
        Value::Null,
        None,
    );
    let b = env
        .api
        .pb_get_conversation(SK, UK_BLOCKED)
        .await
        .expect("blocked user");
    assert!(b.blocked);
    assert_eq!(b.status, PbStatus::Closed);
    assert!(!b.session.active);

    env.permanent(env.api.pb_get_conversation(SK, MISSING), 404, "not_found")
        .await;
    env.permanent(env.api.pb_get_conversation(MISSING, UK), 404, "not_found")
        .await;
    env.stop().await;
}

#[actix_web::test]
async fn e18_pb_update_conversation() {
    let env = Env::start().await;
    let update = UpdatePbConversation {
        status: Some(PbStatus::Counseling),
        assignee: Some("agent-7".into()),
        memo: Some("VIP".into()),
    };
    env.emu.clear_journal();
    let c = env
        .api
        .pb_update_conversation(SK, UK, &update, "k-pbu-1")
        .await
        .expect("update");
    assert_eq!(c.status, PbStatus::Counseling);
    assert_eq!(c.assignee.as_deref(), Some("agent-7"));
    assert_eq!(c.memo.as_deref(), Some("VIP"));
    assert!(c.session.active, "the session is left alone");
    let e = single(&env.emu);
    assert_entry(
        &e,
        Endpoint::PbUpdateConversation,
        &pb_path(UK, ""),
        json!({"status": "counseling", "assignee": "agent-7", "memo": "VIP"}),
        Some("k-pbu-1"),
    );
    assert_eq!(c.updated_at, e.at);
    assert_eq!(env.api.pb_get_conversation(SK, UK).await.expect("get"), c);

    // Only the given fields change.
    env.emu.clear_journal();
    let closed = env
        .api
        .pb_update_conversation(
            SK,
            UK,
            &UpdatePbConversation {
                status: Some(PbStatus::Closed),
                ..UpdatePbConversation::default()
            },
            "k-pbu-2",
        )
        .await
        .expect("close");
    assert_eq!(single(&env.emu).body, json!({"status": "closed"}));
    assert_eq!(closed.status, PbStatus::Closed);
    assert_eq!(closed.assignee.as_deref(), Some("agent-7"));
    assert_eq!(closed.memo.as_deref(), Some("VIP"));
    let got = env.api.pb_get_conversation(SK, UK).await.expect("get");
    assert_eq!(got.status, PbStatus::Closed);

    env.permanent(
        env.api
            .pb_update_conversation(SK, MISSING, &update, "k-pbu-404"),
        404,
        "not_found",
    )
    .await;
    env.stop().await;
}

#[actix_web::test]
async fn e19_pb_block() {
    let env = Env::start().await;
    env.emu.clear_journal();
    let c = env
        .api
        .pb_block(SK, UK, Some("abusive language".into()), "k-block-1")
        .await
        .expect("block");
    assert!(c.blocked);
    let e = single(&env.emu);
    assert_entry(
        &e,
        Endpoint::PbBlock,
        &pb_path(UK, "/block"),
        json!({"reason": "abusive language"}),
        Some("k-block-1"),
    );
    assert_eq!(c.blocked_at, Some(e.at));
    assert_eq!(
        c.status,
        PbStatus::Waiting,
        "blocking does not change status"
    );
    assert!(c.session.active, "blocking does not end the session");
    assert_eq!(env.api.pb_get_conversation(SK, UK).await.expect("get"), c);

    // Without a reason the body is an empty object.
    let (_, e) = env
        .permanent(
            env.api.pb_block(SK, UK_BLOCKED, None, "k-block-409"),
            409,
            "conflict",
        )
        .await;
    assert_eq!(e.body, json!({}));
    // Blocking again with a new key is a conflict too.
    env.permanent(
        env.api.pb_block(SK, UK, None, "k-block-again"),
        409,
        "conflict",
    )
    .await;
    env.permanent(
        env.api.pb_block(SK, MISSING, None, "k-block-404"),
        404,
        "not_found",
    )
    .await;
    env.stop().await;
}

#[actix_web::test]
async fn e20_pb_unblock() {
    let env = Env::start().await;
    env.emu.clear_journal();
    let c = env
        .api
        .pb_unblock(SK, UK_BLOCKED, "k-unblock-1")
        .await
        .expect("unblock");
    assert!(!c.blocked);
    assert_eq!(c.blocked_at, None);
    assert_eq!(
        c.status,
        PbStatus::Closed,
        "unblocking does not change status"
    );
    let e = single(&env.emu);
    assert_entry(
        &e,
        Endpoint::PbUnblock,
        &pb_path(UK_BLOCKED, "/unblock"),
        Value::Null,
        Some("k-unblock-1"),
    );
    assert_eq!(c.updated_at, e.at);
    assert_eq!(
        env.api
            .pb_get_conversation(SK, UK_BLOCKED)
            .await
            .expect("get"),
        c
    );

    env.permanent(env.api.pb_unblock(SK, UK, "k-unblock-409"), 409, "conflict")
        .await;
    env.permanent(
        env.api.pb_unblock(SK, UK_BLOCKED, "k-unblock-409b"),
        409,
        "conflict",
    )
    .await;
    env.permanent(
        env.api.pb_unblock(MISSING, UK, "k-unblock-404"),
        404,
        "not_found",
    )
    .await;
    env.stop().await;
}

#[actix_web::test]
async fn e21_pb_remove_session() {
    let env = Env::start().await;
    env.emu.clear_journal();
    let c = env
        .api
        .pb_remove_session(SK, UK, "k-session-1")
        .await
        .expect("remove session");
    assert!(!c.session.active);
    assert_eq!(c.session.started_at, None);
    assert_eq!(c.status, PbStatus::Waiting);
    let e = single(&env.emu);
    assert_entry(
        &e,
        Endpoint::PbRemoveSession,
        &pb_path(UK, "/session"),
        Value::Null,
        Some("k-session-1"),
    );
    assert_eq!(c.updated_at, e.at);
    let got = env.api.pb_get_conversation(SK, UK).await.expect("get");
    assert!(!got.session.active);

    env.permanent(
        env.api.pb_remove_session(SK, UK, "k-session-409"),
        409,
        "conflict",
    )
    .await;
    env.permanent(
        env.api.pb_remove_session(SK, UK_BLOCKED, "k-session-409b"),
        409,
        "conflict",
    )
    .await;
    env.permanent(
        env.api.pb_remove_session(SK, MISSING, "k-session-404"),
        404,
        "not_found",
    )
    .await;
    env.stop().await;
}

#[actix_web::test]
async fn e22_pb_send_message() {
    let env = Env::start().await;
    env.emu.clear_journal();
    let sent = env
        .api
        .pb_send_message(SK, UK, text("상담을 시작합니다."), "k-pbsend-1")
        .await
        .expect("send");
    assert_eq!(sent.user_key, UK);
    assert!(!sent.message_id.is_empty());
    let e = single(&env.emu);
    assert_entry(
        &e,
        Endpoint::PbSendMessage,
        &format!("/openapi/partnerbiz/{SK}/message"),
        json!({"userKey": UK, "message": {"type": "text", "text": "상담을 시작합니다."}}),
        Some("k-pbsend-1"),
    );
    assert_eq!(sent.sent_at, e.at);
    // There is no read endpoint for partner messages: the emulator's state shows it.
    let stored = env.emu.with_state(|s| s.partner_messages().to_vec());
    assert_eq!(stored.len(), 1);
    assert_eq!(stored[0].message_id, sent.message_id);
    assert_eq!(
        (stored[0].sender_key.as_str(), stored[0].user_key.as_str()),
        (SK, UK)
    );
    assert_eq!(stored[0].message, text("상담을 시작합니다."));

    env.permanent(
        env.api
            .pb_send_message(SK, UK_BLOCKED, text("hi"), "k-pbsend-409"),
        409,
        "conflict",
    )
    .await;
    env.permanent(
        env.api
            .pb_send_message(SK, MISSING, text("hi"), "k-pbsend-404"),
        404,
        "not_found",
    )
    .await;
    env.permanent(
        env.api
            .pb_send_message(MISSING, UK, text("hi"), "k-pbsend-404b"),
        404,
        "not_found",
    )
    .await;
    env.permanent(
        env.api.pb_send_message(SK, UK, text(""), "k-pbsend-400"),
        400,
        "invalid_body",
    )
    .await;
    env.stop().await;
}

#[actix_web::test]
async fn e23_pb_update_setting() {
    let env = Env::start().await;
    let change = ChannelSetting {
        auto_reply: Some(false),
        business_hours: Some(vec![BusinessHours {
            day: "sat".into(),
            open: "10:00".into(),
            close: "14:00".into(),
        }]),
        ..ChannelSetting::default()
    };
    env.emu.clear_journal();
    let s = env
        .api
        .pb_update_setting(SK, &change, "k-setting-1")
        .await
        .expect("update setting");
    assert_eq!(s.auto_reply, Some(false));
    assert_eq!(
        s.welcome_message.as_deref(),
        Some("안녕하세요, 고객센터입니다."),
        "the full setting comes back; absent fields are kept"
    );
    assert_eq!(s.business_hours, change.business_hours);
    assert_entry(
        &single(&env.emu),
        Endpoint::PbUpdateSetting,
        &format!("/openapi/partnerbiz/{SK}/setting"),
        json!({"autoReply": false, "businessHours": [{"day": "sat", "open": "10:00", "close": "14:00"}]}),
        Some("k-setting-1"),
    );
    // No read endpoint for the setting: the emulator's state shows it.
    let stored = env.emu.state_snapshot()["channels"][SK]["setting"].clone();
    assert_eq!(stored, serde_json::to_value(&s).expect("json"));

    let bad_day = ChannelSetting {
        business_hours: Some(vec![BusinessHours {
            day: "monday".into(),
            open: "09:00".into(),
            close: "18:00".into(),
        }]),
        ..ChannelSetting::default()
    };
    env.permanent(
        env.api.pb_update_setting(SK, &bad_day, "k-setting-400"),
        400,
        "invalid_body",
    )
    .await;
    let reversed = ChannelSetting {
        business_hours: Some(vec![BusinessHours {
            day: "mon".into(),
            open: "18:00".into(),
            close: "09:00".into(),
        }]),
        ..ChannelSetting::default()
    };
    env.permanent(
        env.api.pb_update_setting(SK, &reversed, "k-setting-400b"),
        400,
        "invalid_body",
    )
    .await;
    env.permanent(
        env.api.pb_update_setting(MISSING, &change, "k-setting-404"),
        404,
        "not_found",
    )
    .await;
    env.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Notification message (1)

fn notify(template: &str, vars: &[(&str, &str)]) -> NotifyRequest {
    NotifyRequest {
        sender_key: SK.into(),
        template_code: template.into(),
        recipient: "01012345678".into(),
        variables: vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
    }
}

#[actix_web::test]
async fn e24_notify_send() {
    let env = Env::start().await;
    let req = notify("CALLBACK", &[("name", "김민지"), ("time", "15:00")]);
    env.emu.clear_journal();
    let r = env
        .api
        .notify_send(&req, "k-notify-1")
        .await
        .expect("notify");
    assert_eq!(r.status, "accepted");
    assert!(!r.message_id.is_empty());
    let e = single(&env.emu);
    assert_entry(
        &e,
        Endpoint::NotifySend,
        "/openapi/notifytalk/sendMessage",
        json!({"senderKey": SK, "templateCode": "CALLBACK", "recipient": "01012345678",
               "variables": {"name": "김민지", "time": "15:00"}}),
        Some("k-notify-1"),
    );
    let sent = env.emu.with_state(|s| s.notifications().to_vec());
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0].message_id, r.message_id);
    assert_eq!(
        sent[0].text,
        "김민지님, 상담원이 15:00에 다시 연락드리겠습니다."
    );
    assert_eq!(sent[0].sent_at, e.at);

    env.permanent(
        env.api
            .notify_send(&notify("CALLBACK", &[("name", "x")]), "k-notify-422"),
        422,
        "template_mismatch",
    )
    .await;
    env.permanent(
        env.api.notify_send(
            &notify("CALLBACK", &[("name", "x"), ("time", "1"), ("extra", "y")]),
            "k-notify-422b",
        ),
        422,
        "template_mismatch",
    )
    .await;
    env.permanent(
        env.api
            .notify_send(&notify("NO_SUCH_TEMPLATE", &[]), "k-notify-404"),
        404,
        "not_found",
    )
    .await;
    let mut unknown_sender = req.clone();
    unknown_sender.sender_key = MISSING.into();
    env.permanent(
        env.api.notify_send(&unknown_sender, "k-notify-404b"),
        404,
        "not_found",
    )
    .await;
    let mut blank = req.clone();
    blank.recipient = " ".into();
    env.permanent(
        env.api.notify_send(&blank, "k-notify-400"),
        400,
        "invalid_body",
    )
    .await;
    env.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Idempotency, authentication, secrecy

#[actix_web::test]
async fn a_repeated_key_has_one_effect_and_is_replayed() {
    let env = Env::start().await;
    let count = |emu: &Emulator| {
        emu.state_snapshot()["messages"]
            .as_array()
            .map(Vec::len)
            .unwrap_or(0)
    };
    let before = count(&env.emu);
    env.emu.clear_journal();
    let first = env
        .api
        .send_conversation_message(CONV1, text("once"), None, "k-idem-send")
        .await
        .expect("first");
    let second = env
        .api
        .send_conversation_message(CONV1, text("once"), None, "k-idem-send")
        .await
        .expect("second");
    assert_eq!(first, second, "the first answer comes back");
    assert_eq!(count(&env.emu), before + 1, "one message, not two");
    let j = env.emu.journal();
    assert_eq!(j.len(), 2);
    assert!(!j[0].replayed && j[1].replayed, "{j:#?}");
    assert_eq!(j[0].idempotency_key.as_deref(), Some("k-idem-send"));
    assert_eq!(j[1].idempotency_key.as_deref(), Some("k-idem-send"));
    assert_eq!(j[0].answer, j[1].answer);
    let listed = env
        .api
        .list_conversation_messages(CONV1, &MessageRangeQuery::default())
        .await
        .expect("list");
    assert_eq!(
        listed
            .data
            .iter()
            .filter(|m| m.data == text("once"))
            .count(),
        1
    );

    // A state-dependent call: the same key twice succeeds twice (replayed), a new key conflicts.
    env.emu.clear_journal();
    let a = env
        .api
        .pb_block(SK, UK, None, "k-idem-block")
        .await
        .expect("block");
    let b = env
        .api
        .pb_block(SK, UK, None, "k-idem-block")
        .await
        .expect("replayed block");
    assert_eq!(a, b);
    let j = env.emu.journal();
    assert_eq!(j.len(), 2);
    assert!(!j[0].replayed && j[1].replayed);
    env.permanent(
        env.api.pb_block(SK, UK, None, "k-idem-block-2"),
        409,
        "conflict",
    )
    .await;

    // A repeat after the state moved on returns the first answer and has no second effect.
    let on = env
        .api
        .set_manual(CONV2, true, "k-idem-on")
        .await
        .expect("on");
    env.api
        .set_manual(CONV2, false, "k-idem-off")
        .await
        .expect("off");
    env.emu.clear_journal();
    let replay = env
        .api
        .set_manual(CONV2, true, "k-idem-on")
        .await
        .expect("replay");
    assert_eq!(replay, on, "the stored first answer");
    assert!(single(&env.emu).replayed);
    assert!(
        !env.api.get_manual(CONV2).await.expect("get").enabled,
        "the replay did not switch manual mode back on"
    );

    // Error answers are stored as well: the retry of a refused call gets the refusal again,
    // even after the state would now allow the change.
    env.api
        .pb_unblock(SK, UK_BLOCKED, "k-idem-unblock")
        .await
        .expect("unblock");
    env.permanent(
        env.api.pb_unblock(SK, UK_BLOCKED, "k-idem-err"),
        409,
        "conflict",
    )
    .await;
    env.api
        .pb_block(SK, UK_BLOCKED, None, "k-idem-reblock")
        .await
        .expect("block again");
    env.emu.clear_journal();
    let err = env
        .api
        .pb_unblock(SK, UK_BLOCKED, "k-idem-err")
        .await
        .expect_err("the stored refusal");
    assert_status(&err, 409, "conflict");
    let e = single(&env.emu);
    assert!(e.replayed && e.status == 409, "{e:?}");
    assert!(
        env.api
            .pb_get_conversation(SK, UK_BLOCKED)
            .await
            .expect("get")
            .blocked,
        "the replayed refusal did not unblock"
    );
    env.stop().await;
}

#[actix_web::test]
async fn a_wrong_or_missing_key_is_refused_once_without_effect() {
    let env = Env::start().await;
    let wrong = client(&env.base, WRONG_KEY, "Bearer", Duration::from_secs(5));
    let no_key = client(&env.base, "", "Bearer", Duration::from_secs(5));
    let bare = client(&env.base, KEY, "", Duration::from_secs(5));
    let other_scheme = client(&env.base, KEY, "Token", Duration::from_secs(5));

    for api in [&wrong, &no_key, &bare, &other_scheme] {
        let (err, e) = env
            .permanent(api.list_bots(&PageQuery::default()), 401, "unauthorized")
            .await;
        assert_eq!(e.path, "/openapi/bot");
        assert!(!err.to_string().contains(WRONG_KEY));
        let (err, e) = env
            .permanent(api.set_manual(CONV1, true, "k-unauth"), 401, "unauthorized")
            .await;
        assert_eq!(e.idempotency_key.as_deref(), Some("k-unauth"));
        assert_eq!(e.body, json!({"enabled": true}));
        assert!(!format!("{err} {err:?}").contains(WRONG_KEY));
    }
    // An unauthorized answer is not stored: the same key with the right API key takes effect.
    env.emu.clear_journal();
    let m = env
        .api
        .set_manual(CONV1, true, "k-unauth")
        .await
        .expect("authorized");
    assert!(m.enabled);
    assert!(!single(&env.emu).replayed);
    env.stop().await;
}

#[actix_web::test]
async fn the_api_key_never_reaches_the_journal_or_error_texts() {
    let env = Env::start().await;
    let wrong = client(&env.base, WRONG_KEY, "Bearer", Duration::from_secs(5));
    let mut errors: Vec<UpstreamError> = Vec::new();
    env.api
        .list_bots(&PageQuery::default())
        .await
        .expect("list");
    env.api
        .set_manual(CONV1, true, "k-secret-1")
        .await
        .expect("manual");
    env.api
        .pb_send_message(SK, UK, text("hello"), "k-secret-2")
        .await
        .expect("send");
    errors.push(env.api.get_bot(MISSING).await.expect_err("404"));
    errors.push(env.api.list_bots(&limit(0)).await.expect_err("400"));
    errors.push(
        env.api
            .pb_unblock(SK, UK, "k-secret-3")
            .await
            .expect_err("409"),
    );
    errors.push(
        env.api
            .notify_send(&notify("CALLBACK", &[]), "k-secret-4")
            .await
            .expect_err("422"),
    );
    errors.push(wrong.get_bot(BOT).await.expect_err("401"));
    errors.push(
        wrong
            .set_manual(CONV1, false, "k-secret-5")
            .await
            .expect_err("401"),
    );
    assert_eq!(errors.len(), 6);
    for err in &errors {
        for shown in [err.to_string(), format!("{err:?}")] {
            assert!(!shown.contains(KEY), "{shown}");
            assert!(!shown.contains(WRONG_KEY), "{shown}");
            assert!(!shown.contains("SUPERSECRET"), "{shown}");
        }
    }
    let journal = env.emu.journal();
    assert_eq!(journal.len(), 9);
    let dumped = serde_json::to_string(&journal).expect("json");
    assert!(!dumped.contains("SUPERSECRET"), "{dumped}");
    // The same over the admin path.
    let mut resp = awc::Client::new()
        .get(format!("{}/_emulator/journal", env.base))
        .send()
        .await
        .expect("journal");
    let body = resp.body().await.expect("body");
    let text = String::from_utf8_lossy(&body);
    assert!(text.contains("k-secret-1"), "the journal is complete");
    assert!(!text.contains("SUPERSECRET"), "{text}");
    // Nor does the client's own debug form show it.
    assert!(!format!("{:?}", settings(KEY, "Bearer")).contains("SUPERSECRET"));
    env.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Transport faults over a real socket

#[actix_web::test]
async fn a_hung_call_times_out_as_a_transient_failure_and_the_retry_with_the_same_key_works() {
    let env = Env::start().await;
    let api = client(&env.base, KEY, "Bearer", Duration::from_millis(300));
    env.emu
        .set_faults(FaultConfig {
            hang_next: 1,
            ..FaultConfig::default()
        })
        .expect("faults");
    env.emu.clear_journal();
    let started = std::time::Instant::now();
    let err = api
        .set_manual(CONV2, true, "k-hang-1")
        .await
        .expect_err("times out");
    assert_eq!(err, UpstreamError::Timeout);
    assert!(err.is_retryable(), "the outbox tries it again later");
    // The client waited out its 300 ms timeout (measured where it runs).
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "{:?}",
        started.elapsed()
    );
    // The outbox's next attempt: the same key.
    let m = api
        .set_manual(CONV2, true, "k-hang-1")
        .await
        .expect("succeeds on the retry");
    assert!(m.enabled);
    let j = env.emu.journal();
    assert_eq!(j.len(), 2, "{j:#?}");
    assert_eq!((j[0].status, j[0].fault.as_deref()), (0, Some("hang")));
    assert_eq!((j[1].status, j[1].fault.as_deref()), (200, None));
    assert!(j
        .iter()
        .all(|e| e.idempotency_key.as_deref() == Some("k-hang-1")));
    let gap = j[1].at - j[0].at;
    // The 300 ms run from when awc started sending, which may be well before the emulator
    // journaled the call on a loaded machine (the journal keeps whole ms): the retry came after
    // the timeout, not at once.
    assert!(gap >= 150, "waited for the timeout: {gap} ms");
    env.stop().await;
}

/// The emulator's drop fault answers 200 with `Content-Length: 4096` and cuts the connection
/// after a few bytes. awc 3 hands the short body back without an error, so the client has to
/// treat an undecodable 2xx as a transport failure (transient: the outbox tries it again, same
/// key) (module docs of `emulator`).
#[actix_web::test]
async fn a_dropped_answer_is_a_transient_failure() {
    let env = Env::start().await;
    let drop_next = |n| {
        env.emu
            .set_faults(FaultConfig {
                drop_next: n,
                ..FaultConfig::default()
            })
            .expect("faults")
    };
    drop_next(1);
    env.emu.clear_journal();
    let first = env.api.get_bot(BOT).await;
    assert!(
        matches!(&first, Err(e @ UpstreamError::Transport(_)) if e.is_retryable()),
        "{first:?}"
    );
    let bot = env.api.get_bot(BOT).await;
    let j = env.emu.journal();
    assert!(bot.is_ok(), "{bot:?}; journal {j:#?}");
    assert_eq!(j.len(), 2, "{j:#?}");
    assert_eq!((j[0].status, j[0].fault.as_deref()), (0, Some("drop")));
    assert_eq!((j[1].status, j[1].fault.as_deref()), (200, None));

    drop_next(1);
    env.emu.clear_journal();
    let first = env.api.set_manual(CONV2, true, "k-drop-1").await;
    assert!(first.is_err_and(|e| e.is_retryable()));
    let m = env.api.set_manual(CONV2, true, "k-drop-1").await;
    let j = env.emu.journal();
    assert!(m.is_ok(), "{m:?}; journal {j:#?}");
    assert_eq!(j.len(), 2, "{j:#?}");
    assert!(j
        .iter()
        .all(|e| e.idempotency_key.as_deref() == Some("k-drop-1")));
    env.stop().await;
}
