//! `handoff-bridge emulator`, the service's fake, as its own process on a free loopback port: its
//! journal and idempotency records outlive daemons a test kills, and a daemon reaches it as a
//! remote upstream. Killed by PID (through `Child`) when dropped.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, ChildStdout, Command, Stdio};

pub struct ExternalEmulator {
    child: Child,
    /// `http://127.0.0.1:PORT`.
    pub base: String,
    /// Kept open: the emulator's later lines must not meet a closed pipe.
    _stdout: BufReader<ChildStdout>,
}

impl ExternalEmulator {
    /// Start one that accepts `api_key`, and wait for its `listening:` line.
    pub fn start(api_key: &str) -> Self {
        Self::start_with(api_key, &[])
    }

    /// [`start`](Self::start) with its webhook sender delivering to `url` (changed later by
    /// `POST /_emulator/webhook/enable {"url": ...}`, as the bot's webhook settings do).
    pub fn start_with_webhook(api_key: &str, url: &str) -> Self {
        Self::start_with(api_key, &["--webhook-url", url])
    }

    /// [`start`](Self::start) with the seed file `seed` instead of the embedded default.
    pub fn start_seeded(api_key: &str, seed: &std::path::Path) -> Self {
        let seed = seed.to_str().expect("a UTF-8 seed path");
        Self::start_with(api_key, &["--seed", seed])
    }

    fn start_with(api_key: &str, extra: &[&str]) -> Self {
        let mut child = Command::new(super::bin())
            .args(["emulator", "--listen", "127.0.0.1:0", "--api-key", api_key])
            .args(extra)
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the emulator");
        let mut reader = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        let base = loop {
            line.clear();
            let n = reader.read_line(&mut line).expect("emulator stdout");
            if n == 0 {
                let _ = child.kill();
                let _ = child.wait();
                panic!("the emulator exited before listening");
            }
            if let Some(rest) = line.trim().strip_prefix("listening: ") {
                break rest.to_owned();
            }
        };
        assert!(base.starts_with("http://127.0.0.1:"), "{base}");
        ExternalEmulator {
            child,
            base,
            _stdout: reader,
        }
    }

    /// Its socket address.
    pub fn addr(&self) -> SocketAddr {
        self.base
            .strip_prefix("http://")
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("emulator address: {}", self.base))
    }
}

impl Drop for ExternalEmulator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
