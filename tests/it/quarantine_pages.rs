//! The quarantine list is paged and holds no bodies (issue 19's review): `?limit=` and
//! `?after=` online, `--limit` and `--after` offline, `next_after` while more remain; a record's
//! whole body at `/quarantine/{id}/body`.

use crate::common::{cli_ok, TestApp};
use serde_json::Value;

fn ids(page: &Value) -> Vec<u64> {
    page["records"]
        .as_array()
        .expect("records")
        .iter()
        .map(|r| r["id"].as_u64().expect("id"))
        .collect()
}

#[test]
fn the_list_pages_metadata_and_the_body_is_read_whole_on_its_own() {
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data");
    let app = TestApp::spawn_in(&data, crate::common::Spawn::default());
    let mut posted = Vec::new();
    for i in 0..5 {
        let body = format!("{{not json {i}");
        let (status, receipt) = app.post(body.as_bytes());
        assert_eq!(status, 200, "{receipt}");
        posted.push((receipt["quarantine_id"].as_u64().expect("id"), body));
    }
    let all: Vec<u64> = posted.iter().map(|(id, _)| *id).collect();

    // Pages of two: next_after until the last.
    let (status, first) = app.admin_get("/admin/v1/quarantine?limit=2");
    assert_eq!(status, 200, "{first}");
    assert_eq!(ids(&first), all[..2]);
    assert_eq!(first["next_after"].as_u64(), Some(all[1]));
    let record = &first["records"][0];
    for body_field in ["body_base64", "body_text"] {
        assert!(
            record.get(body_field).is_none(),
            "no body in the list: {record}"
        );
    }
    assert_eq!(
        record["body_bytes"].as_u64(),
        Some(posted[0].1.len() as u64)
    );
    assert_eq!(record["reason"], "invalid_json");
    let (_, second) = app.admin_get(&format!("/admin/v1/quarantine?limit=2&after={}", all[1]));
    assert_eq!(ids(&second), all[2..4]);
    let (_, last) = app.admin_get(&format!("/admin/v1/quarantine?limit=2&after={}", all[3]));
    assert_eq!(ids(&last), all[4..]);
    assert!(last.get("next_after").is_none(), "{last}");
    // The default page holds them all; a limit over the maximum is refused, as on every list.
    let (_, default) = app.admin_get("/admin/v1/quarantine");
    assert_eq!(ids(&default), all);
    assert!(default["next"].is_null(), "{default}");
    let (status, huge) = app.admin_get("/admin/v1/quarantine?limit=999999");
    assert_eq!(status, 400, "{huge}");
    assert_eq!(huge["error"]["code"], "invalid_limit", "{huge}");

    // The body, whole and as received.
    let (id, body) = &posted[3];
    let mut resp = app
        .agent
        .get(app.admin_url(&format!("/admin/v1/quarantine/{id}/body")))
        .header(
            "authorization",
            format!("Bearer {}", crate::common::ADMIN_TOKEN),
        )
        .call()
        .expect("GET body");
    assert_eq!(resp.status().as_u16(), 200);
    assert_eq!(
        resp.headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok()),
        Some("application/octet-stream")
    );
    assert_eq!(resp.body_mut().read_to_string().expect("body"), *body);
    let (status, shown) = app.admin_get(&format!("/admin/v1/quarantine/{id}"));
    assert_eq!(status, 200);
    assert_eq!(shown["body_text"].as_str(), Some(body.as_str()));
    assert_eq!(shown["body_truncated"], false);
    let (status, _) = app.admin_get("/admin/v1/quarantine/999999999/body");
    assert_eq!(status, 404);

    // The CLI online: a page as the admin API answers it.
    let online: Value =
        serde_json::from_str(&app.cli_ok(&["quarantine", "list", "--limit", "2"])).expect("JSON");
    assert_eq!(online, first);
    assert!(app.terminate().success());

    // Offline: the same pages from the store, and without flags every record as one array.
    let page: Value = serde_json::from_str(&cli_ok(
        &data,
        &[
            "quarantine",
            "list",
            "--limit",
            "2",
            "--after",
            &all[1].to_string(),
        ],
    ))
    .expect("JSON");
    assert_eq!(page, second);
    let every: Value =
        serde_json::from_str(&cli_ok(&data, &["quarantine", "list"])).expect("JSON array");
    let listed: Vec<u64> = every
        .as_array()
        .expect("an array")
        .iter()
        .map(|r| r["id"].as_u64().expect("id"))
        .collect();
    assert_eq!(listed, all);
    // Re-processing all takes every id from the pages: all still invalid, all still there.
    let out: Value =
        serde_json::from_str(&cli_ok(&data, &["quarantine", "reprocess", "--all"])).expect("JSON");
    let statuses: Vec<&str> = out
        .as_array()
        .expect("results")
        .iter()
        .map(|r| r["status"].as_str().expect("status"))
        .collect();
    assert_eq!(statuses, ["still_invalid"; 5]);
}
