//! The standalone emulator on a real loopback socket, driven by `awc` (the client the bridge
//! uses) and a raw socket: a served call, and that the hang and drop faults look to a client like
//! a timeout and a cut connection.

use ::emulator::{start_standalone, EmulatorConfig, FaultConfig, Seed};
use model::secret::Secret;
use std::time::Duration;

const KEY: &str = "standalone-key-0123";

/// One GET on a fresh connection, read until the server closes it.
fn raw_get(addr: std::net::SocketAddr) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let request = format!(
        "GET /openapi/bot HTTP/1.1\r\nHost: emulator\r\nAuthorization: Bearer {KEY}\r\n\r\n"
    );
    stream.write_all(request.as_bytes()).expect("write");
    let mut buf = Vec::new();
    // A reset instead of a clean close is also a cut connection.
    let _ = stream.read_to_end(&mut buf);
    String::from_utf8_lossy(&buf).into_owned()
}

#[actix_web::test]
async fn standalone_serves_hangs_and_drops_over_a_real_socket() {
    let seed = Seed::default_seed().expect("seed");
    let running = start_standalone("127.0.0.1:0", seed, EmulatorConfig::new(Secret::new(KEY)))
        .expect("start");
    let handle = running.server.handle();
    let server = actix_web::rt::spawn(running.server);
    let emu = running.emulator;
    let base = format!("http://{}", running.addrs[0]);
    let client = awc::Client::builder()
        .timeout(Duration::from_millis(500))
        .finish();
    let get = |path: &str| {
        client
            .get(format!("{base}{path}"))
            .insert_header(("Authorization", format!("Bearer {KEY}")))
    };

    let mut resp = get("/openapi/bot/B7f3a2c").send().await.expect("answer");
    assert_eq!(resp.status().as_u16(), 200);
    let bot: serde_json::Value = resp.json().await.expect("json");
    assert_eq!(bot["id"], "B7f3a2c");

    emu.set_faults(FaultConfig {
        hang_next: 1,
        ..FaultConfig::default()
    })
    .expect("faults");
    let hung = get("/openapi/bot").send().await;
    assert!(
        matches!(hung, Err(awc::error::SendRequestError::Timeout)),
        "{hung:?}"
    );

    // A drop announces a body and cuts the connection part-way. awc 3 hands the short body back
    // as if it were complete, so what a client can rely on is that it is not valid JSON.
    emu.set_faults(FaultConfig {
        drop_next: 1,
        ..FaultConfig::default()
    })
    .expect("faults");
    match get("/openapi/bot").send().await {
        Err(_) => {}
        Ok(mut resp) => {
            if let Ok(body) = resp.body().await {
                assert!(serde_json::from_slice::<serde_json::Value>(&body).is_err());
            }
        }
    }
    emu.set_faults(FaultConfig {
        drop_next: 1,
        ..FaultConfig::default()
    })
    .expect("faults");
    let addr = running.addrs[0];
    let raw = actix_web::rt::task::spawn_blocking(move || raw_get(addr))
        .await
        .expect("raw call");
    let (head, body) = raw
        .split_once("\r\n\r\n")
        .expect("a response head was sent");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(head.contains("content-length: 4096"), "{head}");
    assert!(!body.is_empty() && body.len() < 4096, "{body:?}");

    let statuses: Vec<(u16, Option<String>)> = emu
        .journal()
        .into_iter()
        .map(|e| (e.status, e.fault))
        .collect();
    assert_eq!(
        statuses,
        vec![
            (200, None),
            (0, Some("hang".to_owned())),
            (0, Some("drop".to_owned())),
            (0, Some("drop".to_owned()))
        ]
    );

    let mut resp = get("/openapi/bot").send().await.expect("served again");
    assert_eq!(resp.status().as_u16(), 200);
    let _ = resp.body().await;
    handle.stop(false).await;
    let _ = server.await;
}
