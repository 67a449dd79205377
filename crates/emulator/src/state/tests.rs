use super::*;
use crate::seed::Seed;
use serde_json::json;

const BOT: &str = "B7f3a2c";
const BOT2: &str = "B2c9d10";
const EU1: &str = "4e6f0d0a-1111-4a5b-8c9d-000000000001";
const EU2: &str = "4e6f0d0a-1111-4a5b-8c9d-000000000002";
const CONV1: &str = "5c0e9b1f-2222-4d3e-9f10-000000000001";
const CONV2: &str = "5c0e9b1f-2222-4d3e-9f10-000000000002";
const SK: &str = "sk-support-0001";
const KB: &str = "kb-user-77a9f2";
const KB_BLOCKED: &str = "kb-user-blocked-03";
const NOW: Millis = 1_763_700_000_000;

fn state() -> EmulatorState {
    EmulatorState::from_seed(&Seed::default_seed().expect("default seed"))
}

fn call(
    s: &mut EmulatorState,
    e: Endpoint,
    path: &[(&str, &str)],
    query: Value,
    body: Option<Value>,
) -> Reply {
    s.handle(e, path, &query, body.as_ref(), NOW)
}

fn get(s: &mut EmulatorState, e: Endpoint, path: &[(&str, &str)]) -> Reply {
    call(s, e, path, Value::Null, None)
}

fn code(reply: &Reply) -> &str {
    reply.1["error"]["code"].as_str().unwrap_or("")
}

fn assert_error(reply: &Reply, status: u16, code_: &str) {
    assert_eq!(reply.0, status, "{}", reply.1);
    assert_eq!(code(reply), code_, "{}", reply.1);
    assert!(
        reply.1["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{}",
        reply.1
    );
}

fn ok(reply: Reply) -> Value {
    assert_eq!(reply.0, 200, "{}", reply.1);
    reply.1
}

fn ids(page: &Value) -> Vec<String> {
    page["data"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|x| x["id"].as_str().unwrap_or("").to_owned())
                .collect()
        })
        .unwrap_or_default()
}

const C1: &[(&str, &str)] = &[("conversationId", CONV1)];
const NO_CONV: &[(&str, &str)] = &[("conversationId", "nope")];
const PB: &[(&str, &str)] = &[("senderKey", SK), ("userKey", KB)];
const PB_BLOCKED: &[(&str, &str)] = &[("senderKey", SK), ("userKey", KB_BLOCKED)];

#[test]
fn list_bots_pages_and_checks_limits() {
    let mut s = state();
    let page = ok(get(&mut s, Endpoint::ListBots, &[]));
    assert_eq!(ids(&page), vec![BOT, BOT2]);
    assert_eq!(
        page["paging"],
        json!({"offset": 0, "limit": 20, "total": 2})
    );
    let page = ok(call(
        &mut s,
        Endpoint::ListBots,
        &[],
        json!({"offset": "1", "limit": "1"}),
        None,
    ));
    assert_eq!(ids(&page), vec![BOT2]);
    assert_eq!(page["paging"], json!({"offset": 1, "limit": 1, "total": 2}));
    let page = ok(call(
        &mut s,
        Endpoint::ListBots,
        &[],
        json!({"offset": 5}),
        None,
    ));
    assert!(ids(&page).is_empty());
    for bad in [
        json!({"limit": "0"}),
        json!({"limit": "101"}),
        json!({"limit": "ten"}),
        json!({"offset": "-1"}),
        json!({"limt": "5"}),
    ] {
        let r = call(&mut s, Endpoint::ListBots, &[], bad.clone(), None);
        assert_error(&r, 400, "invalid_query");
    }
    let r = call(&mut s, Endpoint::ListBots, &[], json!({"limt": "5"}), None);
    assert!(r.1["error"]["message"]
        .as_str()
        .unwrap_or("")
        .contains("limt"));
}

#[test]
fn get_bot_and_unknown_bot() {
    let mut s = state();
    let bot = ok(get(&mut s, Endpoint::GetBot, &[("botId", BOT)]));
    assert_eq!(bot["title"], "Support bot");
    assert_error(
        &get(&mut s, Endpoint::GetBot, &[("botId", "Bnope")]),
        404,
        "not_found",
    );
    let r = call(
        &mut s,
        Endpoint::GetBot,
        &[("botId", BOT)],
        json!({"x": "1"}),
        None,
    );
    assert_error(&r, 400, "invalid_query");
}

#[test]
fn bot_conversations_filter_by_user_and_platform() {
    let mut s = state();
    let all = ok(get(
        &mut s,
        Endpoint::ListBotConversations,
        &[("botId", BOT)],
    ));
    assert_eq!(all["paging"]["total"], 3);
    let kb = ok(call(
        &mut s,
        Endpoint::ListBotConversations,
        &[("botId", BOT)],
        json!({"platform": "kakaobiz", "userKey": KB}),
        None,
    ));
    assert_eq!(ids(&kb), vec![CONV2]);
    let by_user = ok(call(
        &mut s,
        Endpoint::ListBotConversations,
        &[("botId", BOT)],
        json!({"endUserId": EU1}),
        None,
    ));
    assert_eq!(ids(&by_user), vec![CONV1]);
    let other = ok(get(
        &mut s,
        Endpoint::ListBotConversations,
        &[("botId", BOT2)],
    ));
    assert_eq!(other["paging"]["total"], 1);
    let r = get(
        &mut s,
        Endpoint::ListBotConversations,
        &[("botId", "Bnope")],
    );
    assert_error(&r, 404, "not_found");
    let r = call(
        &mut s,
        Endpoint::ListBotConversations,
        &[("botId", BOT)],
        json!({"platform": ""}),
        None,
    );
    assert_error(&r, 400, "invalid_query");
}

#[test]
fn flows_are_listed_with_their_nodes() {
    let mut s = state();
    let flows = ok(get(&mut s, Endpoint::ListFlows, &[("botId", BOT)]));
    let flow5 = flows["data"]
        .as_array()
        .and_then(|a| a.iter().find(|f| f["id"] == 5))
        .cloned()
        .expect("flow 5");
    assert_eq!(
        flow5["nodes"][0],
        json!({"id": 40, "type": "agent_call", "title": "Connect an agent"})
    );
    assert_error(
        &get(&mut s, Endpoint::ListFlows, &[("botId", "Bnope")]),
        404,
        "not_found",
    );
}

#[test]
fn get_conversation_and_unknown_conversation() {
    let mut s = state();
    let c = ok(get(&mut s, Endpoint::GetConversation, C1));
    assert_eq!(c["endUserId"], EU1);
    assert_eq!(c["navigation"]["current"]["nodeId"], 40);
    assert_error(
        &get(&mut s, Endpoint::GetConversation, NO_CONV),
        404,
        "not_found",
    );
}

#[test]
fn update_conversation_merges_params_and_null_removes() {
    let mut s = state();
    let body = json!({"params": {"orderNo": null, "agent": "lee", "n": 2}});
    let c = ok(call(
        &mut s,
        Endpoint::UpdateConversation,
        C1,
        Value::Null,
        Some(body),
    ));
    assert_eq!(
        c["params"],
        json!({"name": "김민지", "agent": "lee", "n": 2})
    );
    assert_eq!(c["context"]["params"], c["params"]);
    assert_eq!(c["updatedAt"], format_iso_millis(NOW));
    let again = ok(get(&mut s, Endpoint::GetConversation, C1));
    assert_eq!(again["params"], c["params"]);

    for bad in [
        json!({"params": null}),
        json!({"param": {}}),
        json!([1]),
        json!({"params": 3}),
    ] {
        let r = call(
            &mut s,
            Endpoint::UpdateConversation,
            C1,
            Value::Null,
            Some(bad),
        );
        assert_error(&r, 400, "invalid_body");
    }
    let r = call(&mut s, Endpoint::UpdateConversation, C1, Value::Null, None);
    assert_error(&r, 400, "invalid_body");
    let r = call(
        &mut s,
        Endpoint::UpdateConversation,
        C1,
        json!({"force": "1"}),
        Some(json!({"params": {}})),
    );
    assert_error(&r, 400, "invalid_query");
    let r = call(
        &mut s,
        Endpoint::UpdateConversation,
        NO_CONV,
        Value::Null,
        Some(json!({"params": {}})),
    );
    assert_error(&r, 404, "not_found");
}

#[test]
fn manual_status_follows_put() {
    let mut s = state();
    let m = ok(get(&mut s, Endpoint::GetManual, C1));
    assert_eq!(m["enabled"], false);
    assert_eq!(m["status"], Value::Null);
    let before = m["updatedAt"].clone();

    let m = ok(call(
        &mut s,
        Endpoint::SetManual,
        C1,
        Value::Null,
        Some(json!({"enabled": true})),
    ));
    assert_eq!(
        m,
        json!({"conversationId": CONV1, "enabled": true, "status": "HANDOVER", "updatedAt": NOW})
    );
    assert_eq!(ok(get(&mut s, Endpoint::GetManual, C1)), m);
    let c = ok(get(&mut s, Endpoint::GetConversation, C1));
    assert_eq!(c["context"]["manual"]["status"], "HANDOVER");

    // Same value again: nothing changes.
    let later = s.handle(
        Endpoint::SetManual,
        C1,
        &Value::Null,
        Some(&json!({"enabled": true})),
        NOW + 5,
    );
    assert_eq!(later.1["updatedAt"], NOW);

    let m = ok(call(
        &mut s,
        Endpoint::SetManual,
        C1,
        Value::Null,
        Some(json!({"enabled": false})),
    ));
    assert_eq!(m["status"], Value::Null);
    assert_ne!(m["updatedAt"], before);
    let c = ok(get(&mut s, Endpoint::GetConversation, C1));
    assert_eq!(c["context"]["manual"]["status"], Value::Null);

    let r = call(
        &mut s,
        Endpoint::SetManual,
        C1,
        Value::Null,
        Some(json!({"enabled": "yes"})),
    );
    assert_error(&r, 400, "invalid_body");
    let r = call(
        &mut s,
        Endpoint::SetManual,
        NO_CONV,
        Value::Null,
        Some(json!({"enabled": true})),
    );
    assert_error(&r, 404, "not_found");
    assert_error(&get(&mut s, Endpoint::GetManual, NO_CONV), 404, "not_found");
}

#[test]
fn conversation_messages_are_oldest_first_and_filtered_by_time() {
    let mut s = state();
    let page = ok(get(&mut s, Endpoint::ListConversationMessages, C1));
    let times: Vec<i64> = page["data"]
        .as_array()
        .map(|a| a.iter().filter_map(|m| m["timestamp"].as_i64()).collect())
        .unwrap_or_default();
    assert_eq!(times.len(), 3);
    assert!(times.windows(2).all(|w| w[0] <= w[1]));
    let ranged = ok(call(
        &mut s,
        Endpoint::ListConversationMessages,
        C1,
        json!({"from": times[1].to_string(), "to": times[1].to_string()}),
        None,
    ));
    assert_eq!(ranged["paging"]["total"], 1);
    let r = call(
        &mut s,
        Endpoint::ListConversationMessages,
        C1,
        json!({"from": "yesterday"}),
        None,
    );
    assert_error(&r, 400, "invalid_query");
    assert_error(
        &get(&mut s, Endpoint::ListConversationMessages, NO_CONV),
        404,
        "not_found",
    );
}

#[test]
fn sent_messages_appear_in_both_lists() {
    let mut s = state();
    let body = json!({"message": {"type": "text", "text": "잠시만요"}, "custom": "{\"k\":1}"});
    let m = ok(call(
        &mut s,
        Endpoint::SendConversationMessage,
        C1,
        Value::Null,
        Some(body),
    ));
    assert_eq!(m["isUser"], false);
    assert_eq!(m["timestamp"], NOW);
    assert_eq!(m["conversationId"], CONV1);
    assert_eq!(m["endUserId"], EU1);
    assert_eq!(m["meta"]["custom"], "{\"k\":1}");
    let id = m["id"].as_str().unwrap_or("").to_owned();
    assert_eq!(id.len(), 36);

    let page = ok(get(&mut s, Endpoint::ListConversationMessages, C1));
    assert_eq!(ids(&page).last(), Some(&id));
    let page = ok(call(
        &mut s,
        Endpoint::ListMessages,
        &[],
        json!({"conversationId": CONV1, "isUser": "false", "from": NOW.to_string()}),
        None,
    ));
    assert_eq!(ids(&page), vec![id.clone()]);
    let eu = ok(get(&mut s, Endpoint::GetEndUser, &[("id", EU1)]));
    assert_eq!(eu["lastMessageId"], id.as_str());

    // A second one gets another id.
    let body = json!({"message": {"type": "text", "text": "또"}});
    let m2 = ok(call(
        &mut s,
        Endpoint::SendConversationMessage,
        C1,
        Value::Null,
        Some(body),
    ));
    assert_ne!(m2["id"], m["id"]);
    assert_eq!(m2["meta"], Value::Null);
}

#[test]
fn message_bodies_are_checked_against_the_size_bounds() {
    let mut s = state();
    let card = json!({"title": "t"});
    let cases = [
        json!({"message": {"type": "text", "text": "x".repeat(1001)}}),
        json!({"message": {"type": "text"}}),
        json!({"message": {"type": "cards", "cards": vec![card.clone(); 11]}}),
        json!({"message": {"type": "cards", "cards": [{"title": "x".repeat(51)}]}}),
        json!({"message": {"type": "cards", "cards": [{"title": "t", "description": "d".repeat(501)}]}}),
        json!({"message": {"type": "text", "text": "hi", "button": {"label": "l".repeat(256)}}}),
        json!({"message": {"type": "text", "text": "hi", "buttons": vec![json!({"type": "postback", "label": "b"}); 10]}}),
        json!({"message": {"type": "text", "text": "hi"}, "custom": "c".repeat(1001)}),
        json!({"msg": {"type": "text", "text": "hi"}}),
    ];
    for body in cases {
        let r = call(
            &mut s,
            Endpoint::SendConversationMessage,
            C1,
            Value::Null,
            Some(body.clone()),
        );
        assert_error(&r, 400, "invalid_body");
    }
    let ok_cards = json!({"message": {"type": "cards", "cards": vec![card; 10]}});
    ok(call(
        &mut s,
        Endpoint::SendConversationMessage,
        C1,
        Value::Null,
        Some(ok_cards),
    ));
    let r = call(
        &mut s,
        Endpoint::SendConversationMessage,
        NO_CONV,
        Value::Null,
        Some(json!({"message": {"type": "text", "text": "hi"}})),
    );
    assert_error(&r, 404, "not_found");
}

#[test]
fn navigation_moves_the_conversation_and_keeps_prev() {
    let mut s = state();
    let nav = ok(call(
        &mut s,
        Endpoint::SetNavigation,
        C1,
        Value::Null,
        Some(json!({"flowId": 9})),
    ));
    assert_eq!(
        nav["current"],
        json!({"flowId": 9, "nodeId": 90, "visitCount": 1})
    );
    assert_eq!(
        nav["prev"],
        json!({"flowId": 5, "nodeId": 40, "visitCount": 1})
    );
    let c = ok(get(&mut s, Endpoint::GetConversation, C1));
    assert_eq!(c["navigation"], nav);
    assert_eq!(c["context"]["navigation"], nav);

    let nav = ok(call(
        &mut s,
        Endpoint::SetNavigation,
        C1,
        Value::Null,
        Some(json!({"flowId": 5, "nodeId": 40})),
    ));
    assert_eq!(
        nav["current"],
        json!({"flowId": 5, "nodeId": 40, "visitCount": 2})
    );
    assert_eq!(nav["prev"]["flowId"], 9);

    for body in [
        json!({"flowId": 4}),
        json!({"flowId": 5, "nodeId": 99}),
        json!({"nodeId": 1}),
    ] {
        let r = call(&mut s, Endpoint::SetNavigation, C1, Value::Null, Some(body));
        assert_error(&r, 400, "invalid_body");
    }
    // Flow 9 exists in the other bot's conversation? No: flows are per bot.
    let c4 = &[("conversationId", "5c0e9b1f-2222-4d3e-9f10-000000000004")];
    let r = call(
        &mut s,
        Endpoint::SetNavigation,
        c4,
        Value::Null,
        Some(json!({"flowId": 9})),
    );
    assert_error(&r, 400, "invalid_body");
    let r = call(
        &mut s,
        Endpoint::SetNavigation,
        NO_CONV,
        Value::Null,
        Some(json!({"flowId": 1})),
    );
    assert_error(&r, 404, "not_found");
}

#[test]
fn conversations_filter_by_bot_user_and_updated_time() {
    let mut s = state();
    let all = ok(get(&mut s, Endpoint::ListConversations, &[]));
    assert_eq!(all["paging"]["total"], 4);
    let bot2 = ok(call(
        &mut s,
        Endpoint::ListConversations,
        &[],
        json!({"botId": BOT2}),
        None,
    ));
    assert_eq!(bot2["paging"]["total"], 1);
    let by_key = ok(call(
        &mut s,
        Endpoint::ListConversations,
        &[],
        json!({"userKey": "web-visitor-8841", "platform": "web", "endUserId": EU1}),
        None,
    ));
    assert_eq!(ids(&by_key), vec![CONV1]);
    // Touch one conversation, then only it is updated at or after NOW.
    ok(call(
        &mut s,
        Endpoint::SetManual,
        C1,
        Value::Null,
        Some(json!({"enabled": true})),
    ));
    let recent = ok(call(
        &mut s,
        Endpoint::ListConversations,
        &[],
        json!({"from": NOW.to_string(), "to": NOW}),
        None,
    ));
    assert_eq!(ids(&recent), vec![CONV1]);
    let r = call(
        &mut s,
        Endpoint::ListConversations,
        &[],
        json!({"to": "soon"}),
        None,
    );
    assert_error(&r, 400, "invalid_query");
}

#[test]
fn end_users_get_and_list() {
    let mut s = state();
    let eu = ok(get(&mut s, Endpoint::GetEndUser, &[("id", EU2)]));
    assert_eq!(eu["userKey"], KB);
    assert_error(
        &get(&mut s, Endpoint::GetEndUser, &[("id", "nope")]),
        404,
        "not_found",
    );
    let kb = ok(call(
        &mut s,
        Endpoint::ListEndUsers,
        &[],
        json!({"botId": BOT, "platform": "kakaobiz"}),
        None,
    ));
    assert_eq!(kb["paging"]["total"], 2);
    let one = ok(call(
        &mut s,
        Endpoint::ListEndUsers,
        &[],
        json!({"userKey": KB}),
        None,
    ));
    assert_eq!(ids(&one), vec![EU2]);
    let r = call(
        &mut s,
        Endpoint::ListEndUsers,
        &[],
        json!({"isUser": "true"}),
        None,
    );
    assert_error(&r, 400, "invalid_query");
}

#[test]
fn message_to_an_end_user_lands_in_their_newest_conversation() {
    let mut s = state();
    let body = json!({"endUserId": EU2, "message": {"type": "text", "text": "확인했습니다"}});
    let m = ok(call(
        &mut s,
        Endpoint::SendEndUserMessage,
        &[],
        Value::Null,
        Some(body),
    ));
    assert_eq!(m["conversationId"], CONV2);
    assert_eq!(m["isUser"], false);
    let body = json!({"endUserId": "nope", "message": {"type": "text", "text": "x"}});
    let r = call(
        &mut s,
        Endpoint::SendEndUserMessage,
        &[],
        Value::Null,
        Some(body),
    );
    assert_error(&r, 404, "not_found");
    let body = json!({"endUserId": EU2, "message": {"type": "location"}});
    let r = call(
        &mut s,
        Endpoint::SendEndUserMessage,
        &[],
        Value::Null,
        Some(body),
    );
    assert_error(&r, 400, "invalid_body");
}

#[test]
fn end_user_without_conversation_is_a_conflict() {
    let mut seed = Seed::default_seed().expect("seed");
    let mut lonely = seed.end_users[0].clone();
    lonely.id = EndUserId::new("4e6f0d0a-1111-4a5b-8c9d-0000000000ff");
    lonely.user_key = UserKey::new("lonely");
    seed.end_users.push(lonely);
    seed.validate().expect("valid");
    let mut s = EmulatorState::from_seed(&seed);
    let body = json!({"endUserId": "4e6f0d0a-1111-4a5b-8c9d-0000000000ff", "message": {"type": "text", "text": "x"}});
    let r = call(
        &mut s,
        Endpoint::SendEndUserMessage,
        &[],
        Value::Null,
        Some(body),
    );
    assert_error(&r, 409, "conflict");
}

#[test]
fn messages_filter_by_user_side_and_end_user() {
    let mut s = state();
    let users = ok(call(
        &mut s,
        Endpoint::ListMessages,
        &[],
        json!({"isUser": "true"}),
        None,
    ));
    assert_eq!(users["paging"]["total"], 3);
    let eu2 = ok(call(
        &mut s,
        Endpoint::ListMessages,
        &[],
        json!({"endUserId": EU2}),
        None,
    ));
    assert_eq!(eu2["paging"]["total"], 3);
    let r = call(
        &mut s,
        Endpoint::ListMessages,
        &[],
        json!({"isUser": "yes"}),
        None,
    );
    assert_error(&r, 400, "invalid_query");
}

#[test]
fn partner_conversation_get_and_update() {
    let mut s = state();
    let c = ok(get(&mut s, Endpoint::PbGetConversation, PB));
    assert_eq!(c["status"], "waiting");
    assert_eq!(c["blocked"], false);
    assert_eq!(c["session"]["active"], true);

    let body = json!({"status": "counseling", "assignee": "agent-7", "memo": "VIP"});
    let c = ok(call(
        &mut s,
        Endpoint::PbUpdateConversation,
        PB,
        Value::Null,
        Some(body),
    ));
    assert_eq!(c["status"], "counseling");
    assert_eq!(c["assignee"], "agent-7");
    assert_eq!(c["updatedAt"], NOW);
    // Absent fields stay; null clears.
    let c = ok(call(
        &mut s,
        Endpoint::PbUpdateConversation,
        PB,
        Value::Null,
        Some(json!({"memo": null})),
    ));
    assert_eq!(c["assignee"], "agent-7");
    assert_eq!(c["memo"], Value::Null);
    assert_eq!(ok(get(&mut s, Endpoint::PbGetConversation, PB)), c);

    let r = call(
        &mut s,
        Endpoint::PbUpdateConversation,
        PB,
        Value::Null,
        Some(json!({"status": "done"})),
    );
    assert_error(&r, 400, "invalid_body");
    let r = call(
        &mut s,
        Endpoint::PbUpdateConversation,
        PB,
        Value::Null,
        Some(json!({"status": null})),
    );
    assert_error(&r, 400, "invalid_body");
    let unknown_user = &[("senderKey", SK), ("userKey", "web-visitor-8841")];
    assert_error(
        &get(&mut s, Endpoint::PbGetConversation, unknown_user),
        404,
        "not_found",
    );
    let unknown_sender = &[("senderKey", "sk-nope"), ("userKey", KB)];
    assert_error(
        &get(&mut s, Endpoint::PbGetConversation, unknown_sender),
        404,
        "not_found",
    );
    let r = call(
        &mut s,
        Endpoint::PbUpdateConversation,
        unknown_sender,
        Value::Null,
        Some(json!({})),
    );
    assert_error(&r, 404, "not_found");
}

#[test]
fn block_and_unblock_are_observed_and_conflict_when_repeated() {
    let mut s = state();
    let c = ok(call(
        &mut s,
        Endpoint::PbBlock,
        PB,
        Value::Null,
        Some(json!({"reason": "spam"})),
    ));
    assert_eq!(c["blocked"], true);
    assert_eq!(c["blockedAt"], NOW);
    assert_eq!(
        ok(get(&mut s, Endpoint::PbGetConversation, PB))["blocked"],
        true
    );
    assert_error(
        &call(&mut s, Endpoint::PbBlock, PB, Value::Null, None),
        409,
        "conflict",
    );

    // Sending to a blocked user is refused.
    let send = json!({"userKey": KB, "message": {"type": "text", "text": "hi"}});
    let sk = &[("senderKey", SK)];
    let r = call(
        &mut s,
        Endpoint::PbSendMessage,
        sk,
        Value::Null,
        Some(send.clone()),
    );
    assert_error(&r, 409, "conflict");

    let c = ok(call(&mut s, Endpoint::PbUnblock, PB, Value::Null, None));
    assert_eq!(c["blocked"], false);
    assert_eq!(c["blockedAt"], Value::Null);
    assert_error(
        &call(&mut s, Endpoint::PbUnblock, PB, Value::Null, None),
        409,
        "conflict",
    );
    ok(call(
        &mut s,
        Endpoint::PbSendMessage,
        sk,
        Value::Null,
        Some(send),
    ));

    let r = call(&mut s, Endpoint::PbBlock, PB_BLOCKED, Value::Null, None);
    assert_error(&r, 409, "conflict");
    let r = call(
        &mut s,
        Endpoint::PbBlock,
        PB_BLOCKED,
        Value::Null,
        Some(json!({"reason": 5})),
    );
    assert_error(&r, 400, "invalid_body");
    let nobody = &[("senderKey", SK), ("userKey", "nobody")];
    assert_error(
        &call(&mut s, Endpoint::PbBlock, nobody, Value::Null, None),
        404,
        "not_found",
    );
    assert_error(
        &call(&mut s, Endpoint::PbUnblock, nobody, Value::Null, None),
        404,
        "not_found",
    );
}

#[test]
fn removing_a_session_twice_conflicts() {
    let mut s = state();
    let c = ok(call(
        &mut s,
        Endpoint::PbRemoveSession,
        PB,
        Value::Null,
        None,
    ));
    assert_eq!(c["session"], json!({"active": false, "startedAt": null}));
    assert_eq!(
        ok(get(&mut s, Endpoint::PbGetConversation, PB))["session"]["active"],
        false
    );
    assert_error(
        &call(&mut s, Endpoint::PbRemoveSession, PB, Value::Null, None),
        409,
        "conflict",
    );
    let nobody = &[("senderKey", SK), ("userKey", "nobody")];
    assert_error(
        &call(&mut s, Endpoint::PbRemoveSession, nobody, Value::Null, None),
        404,
        "not_found",
    );
}

#[test]
fn partner_send_checks_sender_user_and_body() {
    let mut s = state();
    let sk = &[("senderKey", SK)];
    let body = json!({"userKey": KB, "message": {"type": "text", "text": "안녕하세요"}});
    let sent = ok(call(
        &mut s,
        Endpoint::PbSendMessage,
        sk,
        Value::Null,
        Some(body.clone()),
    ));
    assert_eq!(sent["userKey"], KB);
    assert_eq!(sent["sentAt"], NOW);
    assert_eq!(s.partner_messages().len(), 1);
    assert_eq!(
        s.partner_messages()[0].message_id,
        sent["messageId"].as_str().unwrap_or("")
    );

    let nope = &[("senderKey", "sk-nope")];
    assert_error(
        &call(
            &mut s,
            Endpoint::PbSendMessage,
            nope,
            Value::Null,
            Some(body),
        ),
        404,
        "not_found",
    );
    let unknown_user = json!({"userKey": "nobody", "message": {"type": "text", "text": "x"}});
    let r = call(
        &mut s,
        Endpoint::PbSendMessage,
        sk,
        Value::Null,
        Some(unknown_user),
    );
    assert_error(&r, 404, "not_found");
    let long_key = json!({"userKey": "k".repeat(91), "message": {"type": "text", "text": "x"}});
    let r = call(
        &mut s,
        Endpoint::PbSendMessage,
        sk,
        Value::Null,
        Some(long_key),
    );
    assert_error(&r, 400, "invalid_body");
    let blocked = json!({"userKey": KB_BLOCKED, "message": {"type": "text", "text": "x"}});
    let r = call(
        &mut s,
        Endpoint::PbSendMessage,
        sk,
        Value::Null,
        Some(blocked),
    );
    assert_error(&r, 409, "conflict");
    assert_eq!(s.partner_messages().len(), 1);
}

#[test]
fn channel_setting_merges() {
    let mut s = state();
    let sk = &[("senderKey", SK)];
    let out = ok(call(
        &mut s,
        Endpoint::PbUpdateSetting,
        sk,
        Value::Null,
        Some(json!({"autoReply": false})),
    ));
    assert_eq!(out["autoReply"], false);
    assert_eq!(out["welcomeMessage"], "안녕하세요, 고객센터입니다.");
    assert_eq!(out["businessHours"].as_array().map(Vec::len), Some(5));
    let hours = json!({"businessHours": [{"day": "sat", "open": "10:00", "close": "14:00"}]});
    let out = ok(call(
        &mut s,
        Endpoint::PbUpdateSetting,
        sk,
        Value::Null,
        Some(hours),
    ));
    assert_eq!(
        out["businessHours"],
        json!([{"day": "sat", "open": "10:00", "close": "14:00"}])
    );
    assert_eq!(out["autoReply"], false);

    let bad = json!({"businessHours": [{"day": "sat", "open": "25:00", "close": "26:00"}]});
    assert_error(
        &call(
            &mut s,
            Endpoint::PbUpdateSetting,
            sk,
            Value::Null,
            Some(bad),
        ),
        400,
        "invalid_body",
    );
    let bad = json!({"autoReply": "yes"});
    assert_error(
        &call(
            &mut s,
            Endpoint::PbUpdateSetting,
            sk,
            Value::Null,
            Some(bad),
        ),
        400,
        "invalid_body",
    );
    let nope = &[("senderKey", "sk-nope")];
    let r = call(
        &mut s,
        Endpoint::PbUpdateSetting,
        nope,
        Value::Null,
        Some(json!({})),
    );
    assert_error(&r, 404, "not_found");
}

#[test]
fn notifications_are_checked_against_the_template() {
    let mut s = state();
    let body = json!({
        "senderKey": SK, "templateCode": "CALLBACK", "recipient": "01012345678",
        "variables": {"name": "김민지", "time": "15:00"}
    });
    let out = ok(call(
        &mut s,
        Endpoint::NotifySend,
        &[],
        Value::Null,
        Some(body.clone()),
    ));
    assert_eq!(out["status"], "accepted");
    assert!(out["messageId"].as_str().is_some_and(|id| id.len() == 36));
    assert_eq!(
        s.notifications()[0].text,
        "김민지님, 상담원이 15:00에 다시 연락드리겠습니다."
    );

    let mut missing = body.clone();
    missing["variables"] = json!({"name": "김민지"});
    let r = call(
        &mut s,
        Endpoint::NotifySend,
        &[],
        Value::Null,
        Some(missing),
    );
    assert_error(&r, 422, "template_mismatch");
    assert!(r.1["error"]["message"]
        .as_str()
        .unwrap_or("")
        .contains("time"));
    let mut extra = body.clone();
    extra["variables"]["orderNo"] = json!("A-1");
    assert_error(
        &call(&mut s, Endpoint::NotifySend, &[], Value::Null, Some(extra)),
        422,
        "template_mismatch",
    );

    let mut unknown = body.clone();
    unknown["templateCode"] = json!("NOPE");
    assert_error(
        &call(
            &mut s,
            Endpoint::NotifySend,
            &[],
            Value::Null,
            Some(unknown),
        ),
        404,
        "not_found",
    );
    let mut sender = body.clone();
    sender["senderKey"] = json!("sk-nope");
    assert_error(
        &call(&mut s, Endpoint::NotifySend, &[], Value::Null, Some(sender)),
        404,
        "not_found",
    );
    let mut no_recipient = body.clone();
    no_recipient["recipient"] = json!(" ");
    assert_error(
        &call(
            &mut s,
            Endpoint::NotifySend,
            &[],
            Value::Null,
            Some(no_recipient),
        ),
        400,
        "invalid_body",
    );
    let mut typed = body;
    typed["variables"]["time"] = json!(15);
    assert_error(
        &call(&mut s, Endpoint::NotifySend, &[], Value::Null, Some(typed)),
        400,
        "invalid_body",
    );
    assert_eq!(s.notifications().len(), 1);
}

#[test]
fn snapshot_holds_everything_and_errors_leave_state_unchanged() {
    let mut s = state();
    let before = s.snapshot();
    let _ = call(
        &mut s,
        Endpoint::SetNavigation,
        C1,
        Value::Null,
        Some(json!({"flowId": 77})),
    );
    let _ = call(&mut s, Endpoint::PbUnblock, PB, Value::Null, None);
    let _ = call(
        &mut s,
        Endpoint::UpdateConversation,
        C1,
        Value::Null,
        Some(json!({"params": 1})),
    );
    assert_eq!(s.snapshot(), before);
    for key in [
        "bots",
        "flows",
        "endUsers",
        "conversations",
        "messages",
        "channels",
        "templates",
    ] {
        assert!(before.get(key).is_some(), "{key}");
    }
}
