mod common;
use common::*;
use serde_json::json;

#[test]
fn probe_idle_race() {
    let tmp = tempfile::tempdir().unwrap();
    let rules = tmp.path().join("rules");
    std::fs::create_dir_all(&rules).unwrap();
    std::fs::write(
        rules.join("r.toml"),
        r#"
[[rule]]
name = "echo"
on = ["bot.message.received"]
actions = [{ type = "send_message", text = "{{ message.data.text }}" }]
"#,
    )
    .unwrap();
    let app = TestApp::spawn_in(
        &tmp.path().join("data"),
        Spawn {
            env: vec![(
                "HANDOFF_BRIDGE__RULES__DIR".into(),
                rules.to_str().unwrap().into(),
            )],
            ..Spawn::default()
        },
    );
    let mut premature = 0;
    for i in 0..30 {
        let ev = json!({"id": format!("probe-ev-{i}"), "event": "bot.message.received", "sourceType": "bot", "sourceId": "B7f3a2c", "timestamp": 1763690400000i64 + i,
          "data": {"message": {"id": format!("probe-m-{i}"), "endUserId": "4e6f0d0a-1111-4a5b-8c9d-000000000001", "conversationId": "5c0e9b1f-2222-4d3e-9f10-000000000001", "data": {"type":"text","text": format!("t{i}")}, "isUser": true, "timestamp": 1763690400000i64 + i}}});
        let (s, _) = app.post(&delivery(&format!("probe-d-{i}"), &[ev]));
        assert_eq!(s, 200);
        wait_drained(&app);
        let (s, idle) = app.admin_get("/admin/v1/outbox/idle?timeout_ms=5000");
        let (_, outbox) = app.admin_get("/admin/v1/outbox");
        let emu = app.emulator_url.clone().unwrap();
        let mut resp = app
            .agent
            .get(format!("{emu}/_emulator/journal"))
            .call()
            .unwrap();
        let j: serde_json::Value =
            serde_json::from_str(&resp.body_mut().read_to_string().unwrap()).unwrap();
        let done = j
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["idempotency_key"] == format!("probe-ev-{i}/echo/0"))
            .count();
        if outbox["depth"] != 0 || done == 0 {
            premature += 1;
            eprintln!(
                "{i}: idle {s} {idle} but outbox depth {} journal {}",
                outbox["depth"], done
            );
        }
    }
    eprintln!("premature idle: {premature}/30");
}
