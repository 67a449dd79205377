//! A probe, not a target: what 1,000,000 small sled entries cost in disk and resident memory, to
//! decide what may stay in sled (issue 2's memory target). Not run in CI.
//!
//! ```text
//! cargo bench -p storage --bench sled_probe -- seen         # 1M dedupe records (36-byte id -> 24 bytes)
//! cargo bench -p storage --bench sled_probe -- hashed       # 1M 16-byte hashed keys -> 8 bytes
//! cargo bench -p storage --bench sled_probe -- state        # 1M 1 KB writes over 100,000 keys
//! ```
//!
//! Each mode writes into a fresh sled database (32 MiB cache, the daemon's default when the probe
//! was written), flushes, prints the process RSS and the directory size, then closes and reopens
//! it and prints the RSS again (what a restarted daemon would carry).

use std::path::Path;
use std::time::Instant;

fn rss_mib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse::<u64>().ok())
        .map_or(0, |kb| kb / 1024)
}

fn dir_mib(path: &Path) -> u64 {
    fn walk(path: &Path) -> u64 {
        std::fs::read_dir(path)
            .map(|entries| {
                entries
                    .flatten()
                    .map(|e| match e.metadata() {
                        Ok(m) if m.is_dir() => walk(&e.path()),
                        Ok(m) => m.len(),
                        Err(_) => 0,
                    })
                    .sum()
            })
            .unwrap_or(0)
    }
    walk(path) >> 20
}

fn open(dir: &Path) -> sled::Db {
    sled::Config::new()
        .path(dir)
        .cache_capacity(32 << 20)
        .mode(sled::Mode::HighThroughput)
        .open()
        .expect("open sled")
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let (Some("--reopen"), Some(dir), Some(mode)) =
        (args.get(1).map(String::as_str), args.get(2), args.get(3))
    {
        return reopen(Path::new(dir), mode);
    }
    let mode = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .unwrap_or_else(|| "seen".into());
    let dir =
        std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("sled-probe-{mode}"));
    let _ = std::fs::remove_dir_all(&dir);
    {
        let db = open(&dir);
        let tree = db.open_tree("probe").expect("tree");
        let body = vec![b'x'; 1000];
        let started = Instant::now();
        for i in 0..1_000_000u64 {
            let written = match mode.as_str() {
                "seen" => tree.insert(format!("3e5f0000-0000-4000-8000-{i:012}"), &[0u8; 24][..]),
                "hashed" => {
                    let h = u128::from(i).wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835);
                    tree.insert(&h.to_be_bytes()[..], &[0u8; 8][..])
                }
                "state" => tree.insert(
                    format!("5c0e9b1f-2222-4d3e-9f10-{:012}", i % 100_000),
                    &body[..],
                ),
                other => {
                    eprintln!("unknown mode {other}: seen, hashed or state");
                    std::process::exit(2);
                }
            };
            written.expect("insert");
        }
        db.flush().expect("flush");
        println!(
            "{mode}: 1,000,000 writes in {:.1} s; RSS {} MiB; on disk {} MiB",
            started.elapsed().as_secs_f64(),
            rss_mib(),
            dir_mib(&dir)
        );
    }
    // Reopen in a fresh process, so the figure is what a restarted daemon carries (this one's
    // allocator keeps what the writes used).
    let me = std::env::current_exe().expect("current exe");
    let status = std::process::Command::new(me)
        .arg("--reopen")
        .arg(&dir)
        .arg(&mode)
        .status()
        .expect("reopen process");
    assert!(status.success(), "reopen failed: {status}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--reopen DIR MODE`: open the database and report the RSS.
fn reopen(dir: &Path, mode: &str) {
    let started = Instant::now();
    let db = open(dir);
    let _tree = db.open_tree("probe").expect("tree");
    println!(
        "{mode}: reopened (fresh process) in {:.2} s; RSS {} MiB",
        started.elapsed().as_secs_f64(),
        rss_mib()
    );
}
