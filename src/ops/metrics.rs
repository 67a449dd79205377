//! Prometheus metrics. Labels are bounded: outcomes and reasons are fixed codes, event types are
//! the known ones plus `other`.

use prometheus::core::Collector;
use prometheus::{
    Encoder, Gauge, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec,
    Opts, Registry, TextEncoder,
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
    /// A connector's calls to its desk, by connector (`chatwoot`), operation
    /// (`chatwoot::Operation`) and outcome (`ok`, `http_<status>`, `connect`, `timeout`...).
    pub desk_calls: IntCounterVec,
    /// A connector's webhook deliveries, by connector, kind (what the delivery was) and verdict
    /// (`relayed`, `ignored`, `duplicate`, `refused`, `quarantined`).
    pub desk_webhooks: IntCounterVec,
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
    /// Conversations that left the waiting queue, by outcome (`stats::QueueExit::ALL`), counted
    /// after each committed fold.
    pub queue_exits: IntCounterVec,
    /// How long each accepted conversation had waited (seconds), in the buckets of
    /// `stats::TIME_TO_ACCEPT_BOUNDS` (the same as the store's hour records).
    pub time_to_accept_seconds: Histogram,
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
    /// 1 while this node is the active one (holds the lease), 0 while it stands by.
    pub cluster_role: IntGauge,
    /// The lease's epoch as this node last found it (sled: the starts counted).
    pub lease_epoch: IntGauge,
    /// Outbox entries carried out again by a new active after the one that began them died.
    pub outbox_replayed: IntCounter,
}

fn latency_buckets() -> Vec<f64> {
    vec![
        0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    ]
}

impl Metrics {
    /// Every metric, registered under the `handoff_` prefix.
    pub fn new() -> Result<Self, prometheus::Error> {
        let registry = Registry::new_custom(Some("handoff".into()), None)?;
        let r = Reg(&registry);
        let intake = Intake::register(&r)?;
        let fold = Fold::register(&r)?;
        let store = Store::register(&r)?;
        let outbox = Outbox::register(&r)?;
        let upstream = Upstream::register(&r)?;
        let helpdesk = Helpdesk::register(&r)?;
        let tls = Tls::register(&r)?;
        let rules = Rules::register(&r)?;
        let queue = Queue::register(&r)?;
        let body = BodyBudget::register(&r)?;
        let sweeps = Sweeps::register(&r)?;
        let cluster = Cluster::register(&r)?;
        Ok(Metrics {
            deliveries: intake.deliveries,
            events: intake.events,
            duplicate_events: intake.duplicate_events,
            unknown_platforms: intake.unknown_platforms,
            quarantined: intake.quarantined,
            quarantine_entries: intake.quarantine_entries,
            inbox_depth: fold.inbox_depth,
            dispatch_paused: fold.dispatch_paused,
            events_applied: fold.events_applied,
            dispatch_errors: fold.dispatch_errors,
            fold_lifts: fold.fold_lifts,
            fold_lifted: fold.fold_lifted,
            processing_seconds: fold.processing_seconds,
            flush_seconds: store.flush_seconds,
            flush_writers: store.flush_writers,
            state_entries: store.state_entries,
            store_bytes: store.store_bytes,
            pruned: store.pruned,
            outbox_depth: outbox.outbox_depth,
            outbox_paused: outbox.outbox_paused,
            outbox_oldest_seconds: outbox.outbox_oldest_seconds,
            action_attempts: outbox.action_attempts,
            upstream_attempts: upstream.upstream_attempts,
            upstream_info: upstream.upstream_info,
            helpdesk_deliveries: helpdesk.helpdesk_deliveries,
            desk_calls: helpdesk.desk_calls,
            desk_webhooks: helpdesk.desk_webhooks,
            circuit_open: outbox.circuit_open,
            dead_letters: outbox.dead_letters,
            dead_letter_entries: outbox.dead_letter_entries,
            action_latency_seconds: outbox.action_latency_seconds,
            tls_failures: tls.tls_failures,
            tls_reloads: tls.tls_reloads,
            rules_reloads: rules.rules_reloads,
            queue_waiting: queue.queue_waiting,
            queue_oldest_wait_seconds: queue.queue_oldest_wait_seconds,
            queue_exits: queue.queue_exits,
            time_to_accept_seconds: queue.time_to_accept_seconds,
            timers_pending: rules.timers_pending,
            helpdesk_calls_in_progress: helpdesk.helpdesk_calls_in_progress,
            timers_fired: rules.timers_fired,
            backfill_events: sweeps.backfill_events,
            webhook_silent: sweeps.webhook_silent,
            rule_caps_hit: rules.rule_caps_hit,
            rule_template_errors: rules.rule_template_errors,
            body_budget: body.body_budget,
            inflight_body_bytes: body.inflight_body_bytes,
            body_budget_waiting: body.body_budget_waiting,
            reconcile_drift: sweeps.reconcile_drift,
            reconcile_passes: sweeps.reconcile_passes,
            reconcile_skipped: sweeps.reconcile_skipped,
            reconcile_pass_seconds: sweeps.reconcile_pass_seconds,
            cluster_role: cluster.cluster_role,
            lease_epoch: cluster.lease_epoch,
            outbox_replayed: cluster.outbox_replayed,
            registry,
        })
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

/// The registry metrics are registered with: each method creates one metric and registers it.
struct Reg<'a>(&'a Registry);

impl Reg<'_> {
    /// Register `metric` and hand it back.
    fn add<M: Collector + Clone + 'static>(&self, metric: M) -> Result<M, prometheus::Error> {
        self.0.register(Box::new(metric.clone()))?;
        Ok(metric)
    }

    /// An integer counter.
    fn counter(&self, name: &str, help: &str) -> Result<IntCounter, prometheus::Error> {
        self.add(IntCounter::new(name, help)?)
    }

    /// Integer counters by `labels`.
    fn counter_vec(
        &self,
        name: &str,
        help: &str,
        labels: &[&str],
    ) -> Result<IntCounterVec, prometheus::Error> {
        self.add(IntCounterVec::new(Opts::new(name, help), labels)?)
    }

    /// An integer gauge.
    fn gauge(&self, name: &str, help: &str) -> Result<IntGauge, prometheus::Error> {
        self.add(IntGauge::new(name, help)?)
    }

    /// A histogram with the given bucket bounds.
    fn histogram(
        &self,
        name: &str,
        help: &str,
        buckets: Vec<f64>,
    ) -> Result<Histogram, prometheus::Error> {
        self.add(Histogram::with_opts(
            HistogramOpts::new(name, help).buckets(buckets),
        )?)
    }
}

/// Webhook intake: deliveries, new and duplicate events, quarantine.
struct Intake {
    deliveries: IntCounterVec,
    events: IntCounterVec,
    duplicate_events: IntCounter,
    unknown_platforms: IntCounter,
    quarantined: IntCounterVec,
    quarantine_entries: IntGauge,
}

impl Intake {
    /// Register the intake's metrics, every delivery outcome visible from the first scrape.
    fn register(r: &Reg) -> Result<Self, prometheus::Error> {
        let deliveries = r.counter_vec(
            "webhook_deliveries_total",
            "Webhook deliveries by outcome",
            &["outcome"],
        )?;
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
            deliveries.with_label_values(&[outcome]);
        }
        Ok(Intake {
            deliveries,
            events: r.counter_vec(
                "webhook_events_total",
                "Newly accepted events by type",
                &["type"],
            )?,
            duplicate_events: r.counter(
                "webhook_duplicate_events_total",
                "Events dropped as already accepted",
            )?,
            unknown_platforms: r.counter(
                "webhook_unknown_platform_events_total",
                "Accepted events naming a platform the bridge does not know",
            )?,
            quarantined: r.counter_vec(
                "quarantined_total",
                "Quarantined deliveries or events by reason",
                &["reason"],
            )?,
            quarantine_entries: r.gauge("quarantine_entries", "Records currently in quarantine")?,
        })
    }
}

/// The fold: the inbox, pausing, applied events and errors, the fold threads' lifts, latency.
struct Fold {
    inbox_depth: IntGauge,
    dispatch_paused: IntGauge,
    events_applied: IntCounter,
    dispatch_errors: IntCounter,
    fold_lifts: IntCounter,
    fold_lifted: IntGauge,
    processing_seconds: Histogram,
}

impl Fold {
    /// Register the fold's metrics.
    fn register(r: &Reg) -> Result<Self, prometheus::Error> {
        Ok(Fold {
            inbox_depth: r.gauge("inbox_depth", "Accepted events not yet folded into state")?,
            dispatch_paused: r.gauge(
                "dispatch_paused",
                "1 while folding is paused by an operator (POST /admin/v1/dispatch/pause)",
            )?,
            events_applied: r.counter("events_applied_total", "Events folded into state")?,
            dispatch_errors: r.counter(
                "dispatch_errors_total",
                "Failed attempts to fold a batch (retried)",
            )?,
            fold_lifts: r.counter(
                "fold_lifts_total",
                "Times the fold threads left SCHED_IDLE because a fold waited past dispatch.lift_after",
            )?,
            fold_lifted: r.gauge(
                "fold_lifted",
                "1 while the fold threads run at the daemon's own scheduling (lifted out of SCHED_IDLE)",
            )?,
            processing_seconds: r.histogram(
                "processing_seconds",
                "Time from receipt to state update",
                latency_buckets(),
            )?,
        })
    }
}

/// The store: group-commit flushes, stored records, size, retention.
struct Store {
    flush_seconds: Histogram,
    flush_writers: Histogram,
    state_entries: IntGaugeVec,
    store_bytes: IntGauge,
    pruned: IntCounterVec,
}

impl Store {
    /// Register the store's metrics.
    fn register(r: &Reg) -> Result<Self, prometheus::Error> {
        Ok(Store {
            flush_seconds: r.histogram(
                "store_flush_seconds",
                "Duration of one group commit of the event log (append and fdatasync)",
                latency_buckets(),
            )?,
            flush_writers: r.histogram(
                "store_flush_writers",
                "Deliveries answered by one group commit",
                vec![1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0],
            )?,
            state_entries: r.add(IntGaugeVec::new(
                Opts::new("state_entries", "Stored state records by kind"),
                &["kind"],
            )?)?,
            store_bytes: r.gauge("store_size_bytes", "Size of the store on disk")?,
            pruned: r.counter_vec("pruned_total", "Records removed by retention", &["kind"])?,
        })
    }
}

/// The outbox: depth, pausing, age, attempts, circuit breakers, dead letters, action latency.
struct Outbox {
    outbox_depth: IntGauge,
    outbox_paused: IntGauge,
    outbox_oldest_seconds: Gauge,
    action_attempts: IntCounterVec,
    circuit_open: IntGaugeVec,
    dead_letters: IntCounterVec,
    dead_letter_entries: IntGauge,
    action_latency_seconds: Histogram,
}

impl Outbox {
    /// Register the outbox's metrics.
    fn register(r: &Reg) -> Result<Self, prometheus::Error> {
        Ok(Outbox {
            outbox_depth: r.gauge("outbox_depth", "Decided actions not yet carried out")?,
            outbox_paused: r.gauge(
                "outbox_paused",
                "1 while the outbox's execution is paused by an operator (outbox pause)",
            )?,
            outbox_oldest_seconds: r.add(Gauge::new(
                "outbox_oldest_seconds",
                "Age of the oldest pending outbox entry",
            )?)?,
            action_attempts: r.counter_vec(
                "action_attempts_total",
                "Attempts to carry out an action, by action and outcome",
                &["action", "status"],
            )?,
            circuit_open: r.add(IntGaugeVec::new(
                Opts::new(
                    "circuit_open",
                    "1 while a destination's circuit breaker is open (no calls but a probe every outbox.breaker.probe_interval)",
                ),
                &["destination"],
            )?)?,
            dead_letters: r.counter_vec(
                "dead_letters_total",
                "Outbox entries moved to the dead letters, by reason",
                &["reason"],
            )?,
            dead_letter_entries: r.gauge(
                "dead_letter_entries",
                "Entries currently in the dead letters",
            )?,
            action_latency_seconds: r.histogram(
                "action_latency_seconds",
                "Time from receipt of the source event to the upstream's answer",
                latency_buckets(),
            )?,
        })
    }
}

/// The Open API upstream: attempts, and which upstream is in use.
struct Upstream {
    upstream_attempts: IntCounterVec,
    upstream_info: IntGaugeVec,
}

impl Upstream {
    /// Register the upstream's metrics.
    fn register(r: &Reg) -> Result<Self, prometheus::Error> {
        Ok(Upstream {
            upstream_attempts: r.counter_vec(
                "upstream_attempts_total",
                "HTTP attempts at Open API calls, retries included, by endpoint and status",
                &["endpoint", "status"],
            )?,
            upstream_info: r.add(IntGaugeVec::new(
                Opts::new(
                    "upstream_info",
                    "1 for the Open API upstream in use: embedded (the built-in emulator) or remote",
                ),
                &["mode"],
            )?)?,
        })
    }
}

/// The help desk: deliveries to its endpoints, agent API calls in progress.
struct Helpdesk {
    helpdesk_deliveries: IntCounterVec,
    helpdesk_calls_in_progress: IntGauge,
    desk_calls: IntCounterVec,
    desk_webhooks: IntCounterVec,
}

impl Helpdesk {
    /// Register the help desk's metrics.
    fn register(r: &Reg) -> Result<Self, prometheus::Error> {
        Ok(Helpdesk {
            helpdesk_deliveries: r.counter_vec(
                "helpdesk_deliveries_total",
                "Attempts to deliver help-desk events, by endpoint and outcome",
                &["endpoint", "outcome"],
            )?,
            helpdesk_calls_in_progress: r.gauge(
                "helpdesk_calls_in_progress",
                "Agent API calls holding an Idempotency-Key",
            )?,
            desk_calls: r.counter_vec(
                "desk_calls_total",
                "A connector's calls to its help desk, by connector, operation and outcome",
                &["connector", "operation", "outcome"],
            )?,
            desk_webhooks: r.counter_vec(
                "desk_webhooks_total",
                "A connector's webhook deliveries, by connector, kind and verdict",
                &["connector", "kind", "verdict"],
            )?,
        })
    }
}

/// TLS: failed client handshakes, reloads of the listener's certificate.
struct Tls {
    tls_failures: IntCounterVec,
    tls_reloads: IntCounterVec,
}

impl Tls {
    /// Register the TLS metrics.
    fn register(r: &Reg) -> Result<Self, prometheus::Error> {
        Ok(Tls {
            tls_failures: r.counter_vec(
                "tls_failures_total",
                "Failed TLS handshakes of the daemon's clients, by destination and reason",
                &["destination", "reason"],
            )?,
            tls_reloads: r.counter_vec(
                "tls_reloads_total",
                "Reloads of the public listener's TLS certificate (SIGHUP), by result",
                &["result"],
            )?,
        })
    }
}

/// Rules: reloads, timers, firing caps, template errors.
struct Rules {
    rules_reloads: IntCounterVec,
    timers_pending: IntGauge,
    timers_fired: IntCounter,
    rule_caps_hit: IntCounterVec,
    rule_template_errors: IntCounterVec,
}

impl Rules {
    /// Register the rules' metrics.
    fn register(r: &Reg) -> Result<Self, prometheus::Error> {
        Ok(Rules {
            rules_reloads: r.counter_vec(
                "rules_reloads_total",
                "Rule reloads by trigger and outcome",
                &["trigger", "outcome"],
            )?,
            timers_pending: r.gauge("timers_pending", "Rule timers running")?,
            timers_fired: r.counter(
                "timers_fired_total",
                "Rule timers fired as events into their conversation",
            )?,
            rule_caps_hit: r.counter_vec(
                "rule_caps_hit_total",
                "Events a rule matched but was held back for by its firing cap, by rule",
                &["rule"],
            )?,
            rule_template_errors: r.counter_vec(
                "rule_template_errors_total",
                "Actions of a fired rule skipped because a template failed at run time, by rule",
                &["rule"],
            )?,
        })
    }
}

/// The agents' queue: conversations waiting, the longest wait, those that left it and how long
/// the accepted ones waited.
struct Queue {
    queue_waiting: IntGauge,
    queue_oldest_wait_seconds: Gauge,
    queue_exits: IntCounterVec,
    time_to_accept_seconds: Histogram,
}

/// The time-to-accept buckets (seconds): the bounds the store's hour records use.
fn time_to_accept_buckets() -> Vec<f64> {
    engine::state::stats::TIME_TO_ACCEPT_BOUNDS
        .iter()
        .map(|s| *s as f64)
        .collect()
}

impl Queue {
    /// Register the queue's metrics, every exit outcome visible from the first scrape.
    fn register(r: &Reg) -> Result<Self, prometheus::Error> {
        let queue_exits = r.counter_vec(
            "queue_exits_total",
            "Conversations that left the waiting queue, by outcome",
            &["outcome"],
        )?;
        for exit in engine::state::stats::QueueExit::ALL {
            queue_exits.with_label_values(&[exit.as_str()]);
        }
        Ok(Queue {
            queue_waiting: r.gauge(
                "queue_waiting",
                "Conversations waiting for an agent, all bots",
            )?,
            queue_oldest_wait_seconds: r.add(Gauge::new(
                "queue_oldest_wait_seconds",
                "How long the longest-waiting conversation has waited for an agent",
            )?)?,
            queue_exits,
            time_to_accept_seconds: r.histogram(
                "time_to_accept_seconds",
                "How long a conversation waited in the queue before an agent took it",
                time_to_accept_buckets(),
            )?,
        })
    }
}

/// The in-flight request-body budget (`server.max_inflight_body_bytes`).
struct BodyBudget {
    body_budget: IntCounterVec,
    inflight_body_bytes: IntGauge,
    body_budget_waiting: IntGauge,
}

impl BodyBudget {
    /// Register the body budget's metrics, every outcome visible from the first scrape.
    fn register(r: &Reg) -> Result<Self, prometheus::Error> {
        let body_budget = r.counter_vec(
            "body_budget_total",
            "Request bodies by how they got room in server.max_inflight_body_bytes",
            &["outcome"],
        )?;
        for outcome in ["immediate", "waited", "refused"] {
            body_budget.with_label_values(&[outcome]);
        }
        Ok(BodyBudget {
            body_budget,
            inflight_body_bytes: r.gauge(
                "inflight_body_bytes",
                "Request-body bytes held against server.max_inflight_body_bytes",
            )?,
            body_budget_waiting: r.gauge(
                "body_budget_waiting",
                "Requests waiting for room in server.max_inflight_body_bytes",
            )?,
        })
    }
}

/// The sweeps against the service: backfill (and the webhook's silence it finds) and
/// reconciliation.
struct Sweeps {
    backfill_events: IntCounter,
    webhook_silent: IntGauge,
    reconcile_drift: IntCounterVec,
    reconcile_passes: IntCounterVec,
    reconcile_skipped: IntCounterVec,
    reconcile_pass_seconds: Histogram,
}

impl Sweeps {
    /// Register backfill's and reconciliation's metrics, every drift kind visible from the
    /// first scrape.
    fn register(r: &Reg) -> Result<Self, prometheus::Error> {
        let reconcile_drift = r.counter_vec(
            "reconcile_drift_total",
            "Drift between the bridge and the service found by the reconciliation sweeper, by kind",
            &["kind"],
        )?;
        for kind in model::webhook::drift::DriftKind::ALL {
            reconcile_drift.with_label_values(&[kind.as_str()]);
        }
        Ok(Sweeps {
            backfill_events: r.counter(
                "backfill_events_total",
                "Events the webhook had not delivered, read back through the Open API and stored",
            )?,
            webhook_silent: r.gauge(
                "webhook_silent",
                "1 while backfill finds events the webhook did not deliver for longer than backfill.silence_alert_after",
            )?,
            reconcile_drift,
            reconcile_passes: r.counter_vec(
                "reconcile_passes_total",
                "Reconciliation passes (dry runs not counted), by outcome",
                &["outcome"],
            )?,
            reconcile_skipped: r.counter_vec(
                "reconcile_skipped_total",
                "Conversations a reconciliation pass left for the next one, by reason",
                &["reason"],
            )?,
            reconcile_pass_seconds: r.histogram(
                "reconcile_pass_seconds",
                "Duration of one reconciliation pass",
                vec![0.01, 0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0, 900.0],
            )?,
        })
    }
}

/// Several nodes on one store: this node's role, the lease's epoch, the outbox's replays.
struct Cluster {
    cluster_role: IntGauge,
    lease_epoch: IntGauge,
    outbox_replayed: IntCounter,
}

impl Cluster {
    fn register(r: &Reg) -> Result<Self, prometheus::Error> {
        Ok(Cluster {
            cluster_role: r.gauge(
                "cluster_role",
                "1 while this node is the active one (holds the lease), 0 while it stands by",
            )?,
            lease_epoch: r.gauge(
                "lease_epoch",
                "The lease's epoch as this node last found it (it grows at each takeover)",
            )?,
            outbox_replayed: r.counter(
                "outbox_replayed_total",
                "Outbox entries carried out again by a new active node after the one that began them died",
            )?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_queue_exits_and_the_time_to_accept_are_there_from_the_first_scrape() {
        let metrics = Metrics::new().expect("metrics");
        let text = metrics.render();
        for exit in engine::state::stats::QueueExit::ALL {
            let line = format!("handoff_queue_exits_total{{outcome=\"{exit}\"}} 0");
            assert!(text.contains(&line), "{line} in\n{text}");
        }
        for bound in engine::state::stats::TIME_TO_ACCEPT_BOUNDS {
            let line = format!("handoff_time_to_accept_seconds_bucket{{le=\"{bound}\"}} 0");
            assert!(text.contains(&line), "{line} in\n{text}");
        }
        assert!(text.contains("handoff_time_to_accept_seconds_bucket{le=\"+Inf\"} 0"));
        assert!(text.contains("handoff_time_to_accept_seconds_count 0"));
    }
}
