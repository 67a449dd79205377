//! The deployment kit names only metrics the daemon exports: every `handoff_*` name in the alert
//! rules and the Grafana dashboard is registered in `src/ops/metrics.rs`, and a running daemon's
//! `/metrics` shows those that have no labels (labelled families appear with their first sample,
//! so for them the registration is what can be checked). The same parse of the source must
//! account for every family the running daemon shows, so it cannot silently miss metrics.

use crate::common::*;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Families registered in `src/ops/metrics.rs`: full name -> (histogram, labelled).
fn registered() -> BTreeMap<String, (bool, bool)> {
    let source =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("src/ops/metrics.rs"))
            .expect("metrics.rs");
    let re = regex::Regex::new(
        r#"\b(counter_vec|counter|gauge|histogram|Opts::new|Gauge::new)\(\s*"([a-z_]+)""#,
    )
    .expect("regex");
    re.captures_iter(&source)
        .map(|c| {
            let kind = &c[1];
            let labelled = matches!(kind, "counter_vec" | "Opts::new");
            (
                format!("handoff_{}", &c[2]),
                (kind == "histogram", labelled),
            )
        })
        .collect()
}

/// The family a sample or query name belongs to (histogram series carry a suffix).
fn family<'a>(name: &'a str, families: &BTreeMap<String, (bool, bool)>) -> &'a str {
    for suffix in ["_bucket", "_sum", "_count"] {
        if let Some(base) = name.strip_suffix(suffix) {
            if families.get(base).is_some_and(|(histogram, _)| *histogram) {
                return base;
            }
        }
    }
    name
}

fn named_in(file: &str) -> BTreeSet<String> {
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(file))
        .unwrap_or_else(|e| panic!("{file}: {e}"));
    regex::Regex::new(r"\bhandoff_[a-z_]+")
        .expect("regex")
        .find_iter(&text)
        .map(|m| m.as_str().to_owned())
        .collect()
}

#[test]
fn alerts_and_dashboard_name_only_exported_metrics() {
    let families = registered();
    assert!(families.len() >= 20, "parsed only {families:?}");

    let app = TestApp::spawn();
    let (status, receipt) = app.post(&fixture_bytes("message-received-text.json"));
    assert_eq!(status, 200, "{receipt}");
    wait_drained(&app);
    let (status, text) = app.admin_get_text("/metrics");
    assert_eq!(status, 200);
    let shown: BTreeSet<String> = text
        .lines()
        .filter(|l| l.starts_with("handoff_"))
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(|name| family(name, &families).to_owned())
        .collect();
    let unparsed: Vec<&String> = shown
        .iter()
        .filter(|n| !families.contains_key(*n))
        .collect();
    assert!(
        unparsed.is_empty(),
        "the daemon exports families the source parse missed: {unparsed:?}"
    );

    for file in [
        "deploy/prometheus-alerts.yml",
        "deploy/grafana-dashboard.json",
    ] {
        let named = named_in(file);
        assert!(!named.is_empty(), "{file} names no metric");
        for name in &named {
            let base = family(name, &families);
            let Some((_, labelled)) = families.get(base) else {
                panic!("{file} names {name}, which the daemon does not export");
            };
            if !labelled {
                assert!(
                    shown.contains(base),
                    "{file} names {name}, missing from a running daemon's /metrics"
                );
            }
        }
    }
}

/// The deploy kit points at a real `https://` Open API (a placeholder to replace) and shows the
/// private-CA option; the image carries a CA bundle for it (deploy/check checks the same).
#[test]
fn the_deploy_kit_sets_an_https_upstream_and_shows_the_ca_option() {
    let read = |file: &str| {
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(file))
            .unwrap_or_else(|e| panic!("{file}: {e}"))
    };
    let found = |file: &str, pattern: &str| {
        regex::Regex::new(pattern)
            .expect("regex")
            .is_match(&read(file))
    };
    for (file, url, ca) in [
        (
            "deploy/Dockerfile",
            r"HANDOFF_BRIDGE_UPSTREAM_URL=https://\S+",
            r"HANDOFF_BRIDGE__UPSTREAM__CA_FILE=/\S+",
        ),
        (
            "deploy/handoff-bridge.service",
            r"(?m)^Environment=HANDOFF_BRIDGE_UPSTREAM_URL=https://\S+",
            r"HANDOFF_BRIDGE__UPSTREAM__CA_FILE=/\S+",
        ),
        (
            "deploy/kubernetes.yaml",
            r#"(?m)^\s+url = "https://[^"]+""#,
            r#"(?m)^\s+# ca_file = "/[^"]+""#,
        ),
    ] {
        assert!(found(file, url), "{file}: no https:// upstream URL");
        assert!(found(file, ca), "{file}: the CA option is not shown");
        assert!(
            !found(file, r"(?i)upstream\S*\s*=\s*.?http://"),
            "{file}: a plain-http upstream"
        );
    }
    assert!(found(
        "deploy/Dockerfile",
        r"(?m)^COPY --from=build /etc/ssl/certs/ca-certificates.crt"
    ));
    assert!(found(
        "deploy/kubernetes.yaml",
        r#"(?m)^\s+# cert_file = "/[^"]+""#
    ));
}

/// The Kubernetes example's probes use the admin port (plain HTTP), so turning on the commented
/// `[server.tls]` for 8080 does not fail them.
#[test]
fn the_kubernetes_probes_use_the_plain_http_admin_port() {
    let text = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/kubernetes.yaml"),
    )
    .expect("deploy/kubernetes.yaml");
    let probes =
        regex::Regex::new(r"httpGet: \{path: /(healthz|readyz), port: (\w+)\}").expect("regex");
    let ports: Vec<&str> = probes
        .captures_iter(&text)
        .filter_map(|c| c.get(2).map(|m| m.as_str()))
        .collect();
    assert_eq!(ports, ["admin"; 3], "startup, liveness, readiness");
    assert!(text.contains("- {name: admin, containerPort: 8081}"));
}
