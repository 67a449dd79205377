//! Each `Action` carried out against the emulator (default seed, loopback): the call it makes
//! (endpoint, method, path), the body the emulator received, and the idempotency key, which is the
//! action's id. Internal actions make no call.

use ::emulator::{start_standalone, EmulatorConfig, Seed};
use model::action::{action_id, Action};
use model::contract::{ChannelSetting, NotifyRequest, PbStatus, UpdatePbConversation};
use model::ids::{ConversationId, EndUserId, EventId};
use model::secret::Secret;
use model::webhook::model::MessageData;
use serde_json::{json, Value};
use std::time::Duration;
use upstream::execute::{execute, ExecuteError};
use upstream::limits::{Limits, LimitsConfig, Rate};
use upstream::transport::AwcTransport;
use upstream::{Client, ClientSettings, OpenApi};

const KEY: &str = "hb-actions-SUPERSECRET-key-51c0";
const CONV: &str = "5c0e9b1f-2222-4d3e-9f10-000000000001";
const EU: &str = "4e6f0d0a-1111-4a5b-8c9d-000000000001";
const SK: &str = "sk-support-0001";
const UK: &str = "kb-user-77a9f2";

fn api(base: &str) -> OpenApi<Client<AwcTransport>> {
    let r = Rate {
        per_second: 10_000.0,
        burst: 1_000,
    };
    let limits = Limits::new(&LimitsConfig {
        global: r,
        write: r,
        partner_send: r,
        notify: r,
    })
    .expect("limits");
    let settings = ClientSettings {
        auth_header: "Authorization".into(),
        auth_scheme: "Bearer".into(),
        api_key: Secret::new(KEY),
        idempotency_header: "Idempotency-Key".into(),
    };
    OpenApi::new(Client::new(
        AwcTransport::new(
            base,
            Duration::from_secs(2),
            Duration::from_secs(5),
            upstream::tls::ClientTls::new(&upstream::tls::Trust::empty(), "", "upstream", None)
                .expect("client TLS"),
        ),
        settings,
        limits,
    ))
}

fn text(t: &str) -> MessageData {
    serde_json::from_value(json!({"type": "text", "text": t})).expect("message data")
}

fn conv() -> ConversationId {
    ConversationId::new(CONV)
}

/// (action, endpoint name, method, a subset the request body must contain).
fn cases() -> Vec<(Action, &'static str, &'static str, Value)> {
    vec![
        (
            Action::SetManual {
                conversation_id: conv(),
                enabled: true,
            },
            "set-manual",
            "PUT",
            json!({"enabled": true}),
        ),
        (
            Action::Navigate {
                conversation_id: conv(),
                flow_id: Some(5),
                node_id: Some(40),
                flow: None,
                bot_id: None,
            },
            "set-navigation",
            "PUT",
            json!({"flowId": 5, "nodeId": 40}),
        ),
        (
            Action::UpdateParams {
                conversation_id: conv(),
                params: serde_json::from_value(json!({"tier": "gold"})).expect("map"),
            },
            "update-conversation",
            "PUT",
            json!({"params": {"tier": "gold"}}),
        ),
        (
            Action::SendMessage {
                conversation_id: conv(),
                message: text("an agent will be with you shortly"),
                custom: None,
            },
            "send-conversation-message",
            "POST",
            json!({"message": {"type": "text", "text": "an agent will be with you shortly"}}),
        ),
        (
            Action::SendToEndUser {
                end_user_id: EndUserId::new(EU),
                message: text("hello again"),
                custom: Some("ticket-7".into()),
            },
            "send-end-user-message",
            "POST",
            json!({"endUserId": EU, "custom": "ticket-7", "message": {"type": "text", "text": "hello again"}}),
        ),
        (
            Action::PartnerUpdateConversation {
                sender_key: SK.into(),
                user_key: UK.into(),
                update: UpdatePbConversation {
                    status: Some(PbStatus::Counseling),
                    assignee: Some("agent-3".into()),
                    memo: None,
                },
            },
            "pb-update-conversation",
            "PUT",
            json!({"status": "counseling", "assignee": "agent-3"}),
        ),
        (
            Action::PartnerSendMessage {
                sender_key: SK.into(),
                user_key: UK.into(),
                message: text("relayed from the help desk"),
            },
            "pb-send-message",
            "POST",
            json!({"userKey": UK, "message": {"type": "text", "text": "relayed from the help desk"}}),
        ),
        (
            Action::PartnerRemoveSession {
                sender_key: SK.into(),
                user_key: UK.into(),
            },
            "pb-remove-session",
            "DELETE",
            Value::Null,
        ),
        (
            Action::PartnerBlock {
                sender_key: SK.into(),
                user_key: UK.into(),
                reason: Some("abuse".into()),
            },
            "pb-block",
            "POST",
            json!({"reason": "abuse"}),
        ),
        (
            Action::PartnerUnblock {
                sender_key: SK.into(),
                user_key: UK.into(),
            },
            "pb-unblock",
            "POST",
            Value::Null,
        ),
        (
            Action::PartnerChannelSetting {
                sender_key: SK.into(),
                setting: ChannelSetting {
                    auto_reply: Some(false),
                    welcome_message: Some("hi".into()),
                    business_hours: None,
                },
            },
            "pb-update-setting",
            "PUT",
            json!({"autoReply": false, "welcomeMessage": "hi"}),
        ),
        (
            Action::SendNotification {
                request: NotifyRequest {
                    sender_key: SK.into(),
                    template_code: "CALLBACK".into(),
                    recipient: "01012345678".into(),
                    variables: [("name", "Kim"), ("time", "15:00")]
                        .into_iter()
                        .map(|(k, v)| (k.to_owned(), v.to_owned()))
                        .collect(),
                },
            },
            "notify-send",
            "POST",
            json!({"templateCode": "CALLBACK", "variables": {"name": "Kim", "time": "15:00"}}),
        ),
    ]
}

/// `want` is contained in `got` (objects by key, recursively; anything else equal).
fn contains(got: &Value, want: &Value) -> bool {
    match (got, want) {
        (_, Value::Null) => true,
        (Value::Object(g), Value::Object(w)) => w
            .iter()
            .all(|(k, v)| g.get(k).is_some_and(|gv| contains(gv, v))),
        _ => got == want,
    }
}

#[actix_web::test]
async fn every_external_action_is_its_call_with_its_body_and_id_as_idempotency_key() {
    let running = start_standalone(
        "127.0.0.1:0",
        Seed::default_seed().expect("seed"),
        EmulatorConfig::new(Secret::new(KEY)),
    )
    .expect("emulator");
    let addr = running.addrs[0];
    assert!(addr.ip().is_loopback());
    let handle = running.server.handle();
    let server = actix_web::rt::spawn(running.server);
    let emu = running.emulator;
    let api = api(&format!("http://{addr}"));

    let event = EventId::new("ev-actions-1");
    let cases = cases();
    let names: std::collections::BTreeSet<&str> = cases.iter().map(|(a, ..)| a.name()).collect();
    assert_eq!(names.len(), cases.len(), "one case per action");
    for (index, (action, endpoint, method, body)) in cases.into_iter().enumerate() {
        let key = action_id(&event, "test-rule", index);
        emu.clear_journal();
        let answer = execute(&api, &action, &key).await;
        assert!(answer.is_ok(), "{}: {answer:?}", action.name());
        let journal = emu.journal();
        assert_eq!(
            journal.len(),
            1,
            "{}: exactly one call: {journal:?}",
            action.name()
        );
        let call = &journal[0];
        assert_eq!(
            call.endpoint.as_deref(),
            Some(endpoint),
            "{}",
            action.name()
        );
        assert_eq!(call.method, method, "{}", action.name());
        assert_eq!(
            call.idempotency_key.as_deref(),
            Some(key.as_str()),
            "{}",
            action.name()
        );
        assert!(
            (200..300).contains(&call.status),
            "{}: {call:?}",
            action.name()
        );
        assert!(
            contains(&call.body, &body),
            "{}: body {} lacks {body}",
            action.name(),
            call.body
        );

        // The same action again (a crash after the call): the same key, one effect.
        let before = emu.state_snapshot();
        let again = execute(&api, &action, &key).await;
        assert!(again.is_ok(), "{}: {again:?}", action.name());
        let replay = emu.journal();
        assert!(
            replay[1].replayed,
            "{}: the repeat is answered from the stored result",
            action.name()
        );
        assert_eq!(
            emu.state_snapshot(),
            before,
            "{}: the repeat changed state",
            action.name()
        );
    }

    for internal in [
        Action::UpdateState {
            conversation_id: conv(),
            add_labels: vec!["vip".into()],
            remove_labels: vec![],
            variables: Default::default(),
        },
        Action::NotifyHelpdesk {
            conversation_id: conv(),
            kind: "handoff.requested".into(),
            reason: None,
            payload: Value::Null,
        },
    ] {
        emu.clear_journal();
        let err = execute(&api, &internal, "k")
            .await
            .expect_err("not an upstream call");
        assert!(matches!(err, ExecuteError::NotUpstream(_)), "{err:?}");
        assert!(emu.journal().is_empty(), "{} made a call", internal.name());
    }

    drop(api);
    handle.stop(false).await;
    let _ = server.await;
}
