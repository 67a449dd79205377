//! Prometheus metrics. Labels are bounded: outcomes and reasons are fixed codes, event types are
//! the known ones plus `other`.

use prometheus::{
    Encoder, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

#[derive(Clone)]
pub struct Metrics {
    registry: Registry,
    /// Deliveries by outcome: accepted, duplicate, quarantined, unauthorized, forbidden,
    /// too_large, timeout, unavailable.
    pub deliveries: IntCounterVec,
    /// Newly accepted events by type.
    pub events: IntCounterVec,
    pub duplicate_events: IntCounter,
    pub unknown_platforms: IntCounter,
    /// Quarantined bodies by reason code.
    pub quarantined: IntCounterVec,
    pub quarantine_entries: IntGauge,
    /// Events accepted but not yet folded into state.
    pub inbox_depth: IntGauge,
    /// 1 while an operator holds folding back; set at each scrape. A forgotten pause looks like a
    /// slow fold otherwise (the inbox grows, nothing errs).
    pub dispatch_paused: IntGauge,
    /// Events folded into state.
    pub events_applied: IntCounter,
    pub dispatch_errors: IntCounter,
    /// Times the fold threads were lifted out of `SCHED_IDLE` because a fold waited for a CPU.
    pub fold_lifts: IntCounter,
    /// 1 while the fold threads run lifted (at the daemon's own scheduling).
    pub fold_lifted: IntGauge,
    /// Receive -> folded into state.
    pub processing_seconds: Histogram,
    /// One group-commit flush.
    pub flush_seconds: Histogram,
    /// Writers covered by one flush.
    pub flush_writers: Histogram,
    /// Stored records by kind: conversations, end_users, bots.
    pub state_entries: IntGaugeVec,
    pub store_bytes: IntGauge,
    pub pruned: IntCounterVec,
    /// Decided actions not yet carried out.
    pub outbox_depth: IntGauge,
    /// 1 while an operator holds the outbox's execution back; set at each scrape.
    pub outbox_paused: IntGauge,
    /// Age of the oldest pending outbox entry (0 when empty).
    pub outbox_oldest_seconds: prometheus::Gauge,
    /// Attempts to carry out an action, by action and outcome (`ok`, `http_<status>`, error kind).
    pub action_attempts: IntCounterVec,
    pub upstream_attempts: IntCounterVec,
    /// 1 for the upstream in use: `mode="embedded"` (the built-in emulator) or `"remote"`.
    pub upstream_info: IntGaugeVec,
    /// Help-desk delivery attempts by endpoint (its configured name, never its URL) and outcome
    /// (`delivered`, `http_<status>`, `connect`, `timeout`, `transport`).
    pub helpdesk_deliveries: IntCounterVec,
    /// 1 while a destination's circuit is open (`openapi`, `helpdesk:<endpoint>`).
    pub circuit_open: IntGaugeVec,
    /// Entries moved to the dead letters, by reason.
    pub dead_letters: IntCounterVec,
    pub dead_letter_entries: IntGauge,
    /// Event received -> upstream answered, for carried-out actions.
    pub action_latency_seconds: Histogram,
    /// TLS handshakes that failed, by destination (`upstream` or a help-desk endpoint's name) and
    /// reason (`tls::TlsReason::label`).
    pub tls_failures: IntCounterVec,
    /// Reloads of the public listener's certificate (SIGHUP), by result (`loaded`, `failed`).
    pub tls_reloads: IntCounterVec,
    /// Rule reloads by trigger (`file`, `signal`, `admin`) and outcome (`loaded`, `unchanged`,
    /// `invalid`).
    pub rules_reloads: IntCounterVec,
    /// Conversations waiting for an agent (handoff requested, nobody took it yet), all bots.
    pub queue_waiting: IntGauge,
    /// How long the longest-waiting of them has waited (0 when none does): the stuck-handoff
    /// alert's input.
    pub queue_oldest_wait_seconds: prometheus::Gauge,
    /// Rule timers running (started, not yet fired into a fold, cancelled or replaced).
    pub timers_pending: IntGauge,
    /// Agent API calls holding an `Idempotency-Key` (being read, stored or waiting for a verdict).
    pub helpdesk_calls_in_progress: IntGauge,
    /// Timer events stored (a re-fire after a restart that was stored before is not counted).
    pub timers_fired: IntCounter,
    /// Events backfill read through the Open API that the webhook had not delivered, stored.
    pub backfill_events: IntCounter,
    /// 1 while backfill finds events the webhook did not deliver for longer than
    /// `backfill.silence_alert_after` (the service may have disabled the webhook).
    pub webhook_silent: IntGauge,
    /// Events a rule matched but its firing cap held it back for, by rule (names come from the
    /// loaded rule files, so the label is bounded).
    pub rule_caps_hit: IntCounterVec,
    /// Actions skipped because their template failed at run time, by rule (bounded like above).
    pub rule_template_errors: IntCounterVec,
    /// Request bodies by how they got their share of `server.max_inflight_body_bytes`:
    /// `immediate`, `waited`, `refused` (503).
    pub body_budget: IntCounterVec,
    /// Request-body bytes held against that budget now.
    pub inflight_body_bytes: IntGauge,
    /// Requests waiting for room in that budget now.
    pub body_budget_waiting: IntGauge,
    /// Drift the reconciliation sweeper found and handed on as `reconcile.drift` events, by kind
    /// (`webhook::drift::DriftKind::ALL`).
    pub reconcile_drift: IntCounterVec,
    /// Sweeper passes, by outcome (`done`, `failed`); dry runs are not counted.
    pub reconcile_passes: IntCounterVec,
    /// Conversations a pass left for the next one, by reason (`pending`: outbox actions of
    /// theirs were pending; `read_failed`: the Open API read failed; `changed`: an event was
    /// folded for them during the pass).
    pub reconcile_skipped: IntCounterVec,
    /// How long one pass took.
    pub reconcile_pass_seconds: Histogram,
}

fn latency_buckets() -> Vec<f64> {
    vec![
        0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    ]
}

impl Metrics {
    pub fn new() -> Result<Self, prometheus::Error> {
        let registry = Registry::new_custom(Some("handoff".into()), None)?;
        let counter_vec =
            |name: &str, help: &str, label: &str| -> Result<IntCounterVec, prometheus::Error> {
                let c = IntCounterVec::new(Opts::new(name, help), &[label])?;
                registry.register(Box::new(c.clone()))?;
                Ok(c)
            };
        let counter = |name: &str, help: &str| -> Result<IntCounter, prometheus::Error> {
            let c = IntCounter::new(name, help)?;
            registry.register(Box::new(c.clone()))?;
            Ok(c)
        };
        let gauge = |name: &str, help: &str| -> Result<IntGauge, prometheus::Error> {
            let g = IntGauge::new(name, help)?;
            registry.register(Box::new(g.clone()))?;
            Ok(g)
        };
        let histogram =
            |name: &str, help: &str, buckets: Vec<f64>| -> Result<Histogram, prometheus::Error> {
                let h = Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets))?;
                registry.register(Box::new(h.clone()))?;
                Ok(h)
            };
        let state_entries = IntGaugeVec::new(
            Opts::new("state_entries", "Stored state records by kind"),
            &["kind"],
        )?;
        registry.register(Box::new(state_entries.clone()))?;
        let action_attempts = IntCounterVec::new(
            Opts::new(
                "action_attempts_total",
                "Attempts to carry out an action, by action and outcome",
            ),
            &["action", "status"],
        )?;
        registry.register(Box::new(action_attempts.clone()))?;
        let upstream_attempts = IntCounterVec::new(
            Opts::new(
                "upstream_attempts_total",
                "HTTP attempts at Open API calls, retries included, by endpoint and status",
            ),
            &["endpoint", "status"],
        )?;
        registry.register(Box::new(upstream_attempts.clone()))?;
        let upstream_info = IntGaugeVec::new(
            Opts::new(
                "upstream_info",
                "1 for the Open API upstream in use: embedded (the built-in emulator) or remote",
            ),
            &["mode"],
        )?;
        registry.register(Box::new(upstream_info.clone()))?;
        let helpdesk_deliveries = IntCounterVec::new(
            Opts::new(
                "helpdesk_deliveries_total",
                "Attempts to deliver help-desk events, by endpoint and outcome",
            ),
            &["endpoint", "outcome"],
        )?;
        registry.register(Box::new(helpdesk_deliveries.clone()))?;
        let circuit_open = IntGaugeVec::new(
            Opts::new(
                "circuit_open",
                "1 while a destination's circuit breaker is open (no calls but a probe every outbox.breaker.probe_interval)",
            ),
            &["destination"],
        )?;
        registry.register(Box::new(circuit_open.clone()))?;
        let tls_failures = IntCounterVec::new(
            Opts::new(
                "tls_failures_total",
                "Failed TLS handshakes of the daemon's clients, by destination and reason",
            ),
            &["destination", "reason"],
        )?;
        registry.register(Box::new(tls_failures.clone()))?;
        let outbox_oldest_seconds = prometheus::Gauge::new(
            "outbox_oldest_seconds",
            "Age of the oldest pending outbox entry",
        )?;
        registry.register(Box::new(outbox_oldest_seconds.clone()))?;
        let queue_oldest_wait_seconds = prometheus::Gauge::new(
            "queue_oldest_wait_seconds",
            "How long the longest-waiting conversation has waited for an agent",
        )?;
        registry.register(Box::new(queue_oldest_wait_seconds.clone()))?;
        let m = Metrics {
            deliveries: counter_vec(
                "webhook_deliveries_total",
                "Webhook deliveries by outcome",
                "outcome",
            )?,
            events: counter_vec(
                "webhook_events_total",
                "Newly accepted events by type",
                "type",
            )?,
            duplicate_events: counter(
                "webhook_duplicate_events_total",
                "Events dropped as already accepted",
            )?,
            unknown_platforms: counter(
                "webhook_unknown_platform_events_total",
                "Accepted events naming a platform the bridge does not know",
            )?,
            quarantined: counter_vec(
                "quarantined_total",
                "Quarantined deliveries or events by reason",
                "reason",
            )?,
            quarantine_entries: gauge("quarantine_entries", "Records currently in quarantine")?,
            inbox_depth: gauge("inbox_depth", "Accepted events not yet folded into state")?,
            dispatch_paused: gauge(
                "dispatch_paused",
                "1 while folding is paused by an operator (POST /admin/v1/dispatch/pause)",
            )?,
            events_applied: counter("events_applied_total", "Events folded into state")?,
            dispatch_errors: counter(
                "dispatch_errors_total",
                "Failed attempts to fold a batch (retried)",
            )?,
            fold_lifts: counter(
                "fold_lifts_total",
                "Times the fold threads left SCHED_IDLE because a fold waited past dispatch.lift_after",
            )?,
            fold_lifted: gauge(
                "fold_lifted",
                "1 while the fold threads run at the daemon's own scheduling (lifted out of SCHED_IDLE)",
            )?,
            processing_seconds: histogram(
                "processing_seconds",
                "Time from receipt to state update",
                latency_buckets(),
            )?,
            flush_seconds: histogram(
                "store_flush_seconds",
                "Duration of one group-commit flush",
                latency_buckets(),
            )?,
            flush_writers: histogram(
                "store_flush_writers",
                "Writers covered by one flush",
                vec![1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0],
            )?,
            state_entries,
            store_bytes: gauge("store_size_bytes", "Size of the store on disk")?,
            pruned: counter_vec("pruned_total", "Records removed by retention", "kind")?,
            outbox_depth: gauge("outbox_depth", "Decided actions not yet carried out")?,
            outbox_paused: gauge(
                "outbox_paused",
                "1 while the outbox's execution is paused by an operator (outbox pause)",
            )?,
            outbox_oldest_seconds,
            action_attempts,
            upstream_attempts,
            upstream_info,
            helpdesk_deliveries,
            circuit_open,
            dead_letters: counter_vec(
                "dead_letters_total",
                "Outbox entries moved to the dead letters, by reason",
                "reason",
            )?,
            dead_letter_entries: gauge(
                "dead_letter_entries",
                "Entries currently in the dead letters",
            )?,
            action_latency_seconds: histogram(
                "action_latency_seconds",
                "Time from receipt of the source event to the upstream's answer",
                latency_buckets(),
            )?,
            tls_failures,
            tls_reloads: counter_vec(
                "tls_reloads_total",
                "Reloads of the public listener's TLS certificate (SIGHUP), by result",
                "result",
            )?,
            rules_reloads: {
                let c = prometheus::IntCounterVec::new(
                    Opts::new("rules_reloads_total", "Rule reloads by trigger and outcome"),
                    &["trigger", "outcome"],
                )?;
                registry.register(Box::new(c.clone()))?;
                c
            },
            queue_waiting: gauge(
                "queue_waiting",
                "Conversations waiting for an agent, all bots",
            )?,
            queue_oldest_wait_seconds,
            timers_pending: gauge("timers_pending", "Rule timers running")?,
            helpdesk_calls_in_progress: gauge(
                "helpdesk_calls_in_progress",
                "Agent API calls holding an Idempotency-Key",
            )?,
            timers_fired: counter(
                "timers_fired_total",
                "Rule timers fired as events into their conversation",
            )?,
            backfill_events: counter(
                "backfill_events_total",
                "Events the webhook had not delivered, read back through the Open API and stored",
            )?,
            webhook_silent: gauge(
                "webhook_silent",
                "1 while backfill finds events the webhook did not deliver for longer than backfill.silence_alert_after",
            )?,
            rule_caps_hit: counter_vec(
                "rule_caps_hit_total",
                "Events a rule matched but was held back for by its firing cap, by rule",
                "rule",
            )?,
            rule_template_errors: counter_vec(
                "rule_template_errors_total",
                "Actions of a fired rule skipped because a template failed at run time, by rule",
                "rule",
            )?,
            body_budget: counter_vec(
                "body_budget_total",
                "Request bodies by how they got room in server.max_inflight_body_bytes",
                "outcome",
            )?,
            inflight_body_bytes: gauge(
                "inflight_body_bytes",
                "Request-body bytes held against server.max_inflight_body_bytes",
            )?,
            body_budget_waiting: gauge(
                "body_budget_waiting",
                "Requests waiting for room in server.max_inflight_body_bytes",
            )?,
            reconcile_drift: counter_vec(
                "reconcile_drift_total",
                "Drift between the bridge and the service found by the reconciliation sweeper, by kind",
                "kind",
            )?,
            reconcile_passes: counter_vec(
                "reconcile_passes_total",
                "Reconciliation passes (dry runs not counted), by outcome",
                "outcome",
            )?,
            reconcile_skipped: counter_vec(
                "reconcile_skipped_total",
                "Conversations a reconciliation pass left for the next one, by reason",
                "reason",
            )?,
            reconcile_pass_seconds: histogram(
                "reconcile_pass_seconds",
                "Duration of one reconciliation pass",
                vec![0.01, 0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0, 900.0],
            )?,
            registry,
        };
        // Make every outcome visible from the first scrape.
        for outcome in [
            "accepted",
            "duplicate",
            "quarantined",
            "unauthorized",
            "forbidden",
            "too_large",
            "timeout",
            "unavailable",
            "busy",
        ] {
            m.deliveries.with_label_values(&[outcome]);
        }
        for outcome in ["immediate", "waited", "refused"] {
            m.body_budget.with_label_values(&[outcome]);
        }
        for kind in model::webhook::drift::DriftKind::ALL {
            m.reconcile_drift.with_label_values(&[kind.as_str()]);
        }
        Ok(m)
    }

    /// One body or event went into quarantine.
    pub fn record_quarantined(&self, reason: &str) {
        self.quarantined.with_label_values(&[reason]).inc();
        self.quarantine_entries.inc();
    }

    /// Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        let encoder = TextEncoder::new();
        if let Err(e) = encoder.encode(&self.registry.gather(), &mut buf) {
            return format!("# encoding metrics failed: {e}\n");
        }
        String::from_utf8(buf).unwrap_or_default()
    }
}
