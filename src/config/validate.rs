//! [`Config::validate`]'s semantic checks. Each function checks a run of related keys and adds
//! what it finds to the one list, so every problem is reported together; they run in a fixed
//! order, which is the order the problems are reported in.

use super::{mask_url, Config, HelpdeskEndpoint, Problems};
use std::collections::HashSet;
use std::net::SocketAddr;
use std::time::Duration;

/// Every semantic check, in the order their problems are reported.
pub(super) fn check_all(c: &Config, p: &mut Problems) {
    listeners(c, p);
    webhook(c, p);
    retention(c, p);
    store(c, p);
    backfill(c, p);
    dispatch(c, p);
    outbox(c, p);
    rules(c, p);
    admin(c, p);
    server_tls(c, p);
    upstream_api(c, p);
    reconcile(c, p);
    helpdesk(c, p);
    cluster(c, p);
    log_level(c, p);
}

/// `store.url` / `store.url_file`: one of them, a PostgreSQL URL (never shown).
fn store(c: &Config, p: &mut Problems) {
    let s = &c.store;
    if !s.url.is_empty() && !s.url_file.is_empty() {
        p.add(
            "store.url_file",
            &s.url_file,
            "give url or url_file, not both",
        );
    }
    let url = s.url.expose();
    let postgres = url.starts_with("postgres://") || url.starts_with("postgresql://");
    if !(url.is_empty() || postgres) {
        p.add(
            "store.url",
            &"****",
            "not a postgres:// URL (empty: sled in store.data_dir)",
        );
    }
}

/// `cluster.*`: the node's name (empty: generated) and the lease's length.
fn cluster(c: &Config, p: &mut Problems) {
    let id = &c.cluster.node_id;
    let allowed = |ch: char| ch.is_ascii_alphanumeric() || matches!(ch, '-' | '_' | '.');
    if id.len() > 64 || !id.chars().all(allowed) {
        p.add(
            "cluster.node_id",
            id,
            "must be at most 64 characters of A-Z a-z 0-9 - _ . (or empty: the host name and a \
             random suffix)",
        );
    }
    let lease = c.cluster.lease;
    if lease < Duration::from_secs(3) || lease > Duration::from_secs(600) {
        p.add(
            "cluster.lease",
            &humantime::format_duration(lease),
            "must be from 3s to 10m (renewed every third of it; a standby takes over within the \
             lease and one renewal)",
        );
    }
}

/// `server.listen`, `admin.listen`, and the public server's connection and shutdown limits.
fn listeners(c: &Config, p: &mut Problems) {
    if c.server.listen.parse::<SocketAddr>().is_err() {
        p.add(
            "server.listen",
            &c.server.listen,
            "not an IP:port socket address",
        );
    }
    if !c.admin.listen.is_empty() {
        match c.admin.listen.parse::<SocketAddr>() {
            Err(_) => p.add(
                "admin.listen",
                &c.admin.listen,
                "not an IP:port socket address (or \"\" to serve the admin API on server.listen)",
            ),
            Ok(admin) if admin.port() != 0 && Some(admin) == c.server.listen.parse().ok() => p.add(
                "admin.listen",
                &c.admin.listen,
                "must differ from server.listen (or be \"\" to share it)",
            ),
            Ok(_) => {}
        }
    }
    if c.server.max_connections == 0 {
        p.add("server.max_connections", &0, "must be at least 1");
    }
    if c.server.shutdown_timeout.is_zero() {
        p.add("server.shutdown_timeout", &"0s", "must be longer than zero");
    }
}

/// `webhook.*`: path, tokens, body and event limits (and the in-flight body budget they need),
/// dedupe retention.
fn webhook(c: &Config, p: &mut Problems) {
    if !c.webhook.path.starts_with('/') || c.webhook.path.ends_with('/') {
        p.add(
            "webhook.path",
            &c.webhook.path,
            "must start with '/' and not end with '/'",
        );
    }
    for (i, t) in c.webhook.tokens.iter().enumerate() {
        if t.expose().len() < 16
            || !t
                .expose()
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            p.add(
                &format!("webhook.tokens[{i}]"),
                &"****",
                "must be at least 16 characters of A-Z a-z 0-9 - _",
            );
        }
    }
    if c.webhook.max_body_bytes < 1024 {
        p.add(
            "webhook.max_body_bytes",
            &c.webhook.max_body_bytes,
            "must be at least 1024",
        );
    }
    if c.webhook.max_events == 0 {
        p.add("webhook.max_events", &0, "must be at least 1");
    }
    if c.server.max_inflight_body_bytes < c.webhook.max_body_bytes {
        p.add(
            "server.max_inflight_body_bytes",
            &c.server.max_inflight_body_bytes,
            "must be at least webhook.max_body_bytes (or no delivery at the limit is read)",
        );
    }
    if c.webhook.dedupe_retention < Duration::from_secs(60) {
        p.add(
            "webhook.dedupe_retention",
            &humantime::format_duration(c.webhook.dedupe_retention),
            "must be at least 1m",
        );
    }
}

/// Retention of the event log, the outbox's audit and the states, against each other and
/// dedupe; the prune interval.
fn retention(c: &Config, p: &mut Problems) {
    if c.store.event_retention < c.webhook.dedupe_retention {
        p.add(
            "store.event_retention",
            &humantime::format_duration(c.store.event_retention),
            "must be at least webhook.dedupe_retention (the log drives dedupe pruning)",
        );
    }
    if c.outbox.audit_retention < c.store.event_retention {
        p.add(
            "outbox.audit_retention",
            &humantime::format_duration(c.outbox.audit_retention),
            "must be at least store.event_retention (a replay must know what already ran)",
        );
    }
    let states = c.store.state_retention;
    if !states.is_zero() && states < c.store.event_retention {
        p.add(
            "store.state_retention",
            &humantime::format_duration(states),
            "must be at least store.event_retention, or \"off\" (a late event of a pruned \
             conversation must find none of its older events still in the log)",
        );
    }
    if !states.is_zero() && states < c.webhook.dedupe_retention {
        p.add(
            "store.state_retention",
            &humantime::format_duration(states),
            "must be at least webhook.dedupe_retention, or \"off\" (a re-sent event of a \
             pruned conversation must still be a duplicate)",
        );
    }
    if c.store.prune_interval < Duration::from_secs(1) {
        p.add(
            "store.prune_interval",
            &humantime::format_duration(c.store.prune_interval),
            "must be at least 1s",
        );
    }
}

/// `backfill.*`: interval, silence alert, read rate, overlap.
fn backfill(c: &Config, p: &mut Problems) {
    let bf = &c.backfill;
    if !bf.interval.is_zero() && bf.interval < Duration::from_secs(1) {
        p.add(
            "backfill.interval",
            &humantime::format_duration(bf.interval),
            "must be at least 1s (or 0 / \"off\")",
        );
    }
    if bf.silence_alert_after < Duration::from_secs(1) {
        p.add(
            "backfill.silence_alert_after",
            &humantime::format_duration(bf.silence_alert_after),
            "must be at least 1s",
        );
    }
    if !(bf.per_second.is_finite() && bf.per_second > 0.0) {
        p.add(
            "backfill.per_second",
            &bf.per_second,
            "must be a positive number",
        );
    }
    if bf.overlap > Duration::from_secs(24 * 3600) {
        p.add(
            "backfill.overlap",
            &humantime::format_duration(bf.overlap),
            "must be at most 24h",
        );
    }
}

/// The fold's resources: `dispatch.fold_niceness`, the store's cache it reads through,
/// `dispatch.concurrency` and `dispatch.batch_size`.
fn dispatch(c: &Config, p: &mut Problems) {
    if c.dispatch.fold_niceness > crate::background::MAX_NICENESS {
        p.add(
            "dispatch.fold_niceness",
            &c.dispatch.fold_niceness,
            "must be 0 (off) to 19",
        );
    }
    if c.store.cache_capacity_bytes < 1024 * 1024 {
        p.add(
            "store.cache_capacity_bytes",
            &c.store.cache_capacity_bytes,
            "must be at least 1 MiB",
        );
    }
    if c.dispatch.concurrency == 0 || c.dispatch.concurrency > 1024 {
        p.add(
            "dispatch.concurrency",
            &c.dispatch.concurrency,
            "must be 1..=1024",
        );
    }
    if c.dispatch.batch_size == 0 || c.dispatch.batch_size > 10_000 {
        p.add(
            "dispatch.batch_size",
            &c.dispatch.batch_size,
            "must be 1..=10000",
        );
    }
}

/// `outbox.*`: concurrency, retries, give-up, window, circuit breaker, depth, blocking actions.
fn outbox(c: &Config, p: &mut Problems) {
    let ob = &c.outbox;
    if ob.concurrency == 0 || ob.concurrency > 1024 {
        p.add("outbox.concurrency", &ob.concurrency, "must be 1..=1024");
    }
    if ob.retry.base.is_zero() || ob.retry.cap < ob.retry.base {
        p.add(
            "outbox.retry.cap",
            &humantime::format_duration(ob.retry.cap),
            "base must be positive and cap at least base",
        );
    }
    if ob.give_up_after < ob.retry.base {
        p.add(
            "outbox.give_up_after",
            &humantime::format_duration(ob.give_up_after),
            "must be at least outbox.retry.base",
        );
    }
    if ob.window < 2 {
        p.add("outbox.window", &ob.window, "must be at least 2");
    }
    if ob.breaker.failures == 0 {
        p.add(
            "outbox.breaker.failures",
            &ob.breaker.failures,
            "must be at least 1",
        );
    }
    if ob.breaker.probe_interval.is_zero() {
        p.add(
            "outbox.breaker.probe_interval",
            &humantime::format_duration(ob.breaker.probe_interval),
            "must be positive",
        );
    }
    if ob.max_depth == 0 {
        p.add("outbox.max_depth", &ob.max_depth, "must be at least 1");
    }
    for name in &ob.blocking {
        if !model::action::Action::NAMES.contains(&name.as_str()) {
            p.add(
                "outbox.blocking",
                name,
                &format!(
                    "unknown action; one of {}",
                    model::action::Action::NAMES.join(", ")
                ),
            );
        }
    }
}

/// `rules.dir`: a directory when set.
fn rules(c: &Config, p: &mut Problems) {
    if !c.rules.dir.is_empty() && !std::path::Path::new(&c.rules.dir).is_dir() {
        p.add("rules.dir", &c.rules.dir, "not a directory");
    }
}

/// `admin.token`'s length, and an own `admin.listen` when the public listener serves TLS.
fn admin(c: &Config, p: &mut Problems) {
    if !c.admin.token.is_empty() && c.admin.token.expose().len() < 16 {
        p.add("admin.token", &"****", "must be at least 16 characters");
    }
    for (i, t) in c.admin.viewer_tokens.iter().enumerate() {
        if t.expose().len() < 16 {
            p.add(
                &format!("admin.viewer_tokens[{i}]"),
                &"****",
                "must be at least 16 characters",
            );
        } else if !c.admin.token.is_empty() && t.expose() == c.admin.token.expose() {
            p.add(
                &format!("admin.viewer_tokens[{i}]"),
                &"****",
                "is the admin token, which signs in as an operator",
            );
        }
    }
    if c.admin.console_session < std::time::Duration::from_secs(60)
        || c.admin.console_session > std::time::Duration::from_secs(7 * 24 * 3600)
    {
        p.add(
            "admin.console_session",
            &humantime::format_duration(c.admin.console_session),
            "must be 1m to 7d",
        );
    }
    if c.admin.console_audit_retention < std::time::Duration::from_secs(3600) {
        p.add(
            "admin.console_audit_retention",
            &humantime::format_duration(c.admin.console_audit_retention),
            "must be 1h or more",
        );
    }
    let tls = &c.server.tls;
    if c.admin.listen.is_empty() && !(tls.cert_file.is_empty() && tls.key_file.is_empty()) {
        p.add(
            "admin.listen",
            &"\"\"",
            "with server.tls the admin API would be served over TLS on server.listen, which \
             the CLI (plain http) cannot reach: give admin.listen its own address (e.g. \
             127.0.0.1:8081)",
        );
    }
}

/// `server.tls`: both its certificate and its key, or neither.
fn server_tls(c: &Config, p: &mut Problems) {
    let tls = &c.server.tls;
    match (tls.cert_file.is_empty(), tls.key_file.is_empty()) {
        (true, true) | (false, false) => {}
        (false, true) => p.add(
            "server.tls.key_file",
            &"\"\"",
            "give both cert_file and key_file",
        ),
        (true, false) => p.add(
            "server.tls.cert_file",
            &"\"\"",
            "give both cert_file and key_file",
        ),
    }
}

/// `upstream.*`: URL, API key sources, header names, timeouts, rate limits.
fn upstream_api(c: &Config, p: &mut Problems) {
    let up = &c.upstream;
    if up.url.is_empty() && (!up.api_key.is_empty() || !up.api_key_file.is_empty()) {
        p.add(
            "upstream.url",
            &"(not set)",
            "an API key is configured (upstream.api_key, HANDOFF_BRIDGE_UPSTREAM_API_KEY or \
             upstream.api_key_file) but no upstream.url: set it to the service's Open API base \
             address, or to \"embedded\" to run the built-in emulator on purpose",
        );
    }
    if !up.is_embedded() {
        match up.url.parse::<actix_web::http::Uri>() {
            Ok(uri)
                if matches!(uri.scheme_str(), Some("http" | "https")) && uri.host().is_some() => {}
            _ => p.add(
                "upstream.url",
                &mask_url(&up.url),
                "must be \"embedded\" or an http:// or https:// base address",
            ),
        }
    }
    if !up.api_key.is_empty() && !up.api_key_file.is_empty() {
        p.add(
            "upstream.api_key_file",
            &up.api_key_file,
            "give api_key or api_key_file, not both",
        );
    }
    if up.auth_header.trim().is_empty() || up.idempotency_header.trim().is_empty() {
        p.add(
            "upstream.auth_header",
            &up.auth_header,
            "header names must not be empty",
        );
    }
    if up.request_timeout.is_zero() || up.connect_timeout.is_zero() {
        p.add(
            "upstream.request_timeout",
            &humantime::format_duration(up.request_timeout),
            "timeouts must be positive",
        );
    }
    if let Err(e) = upstream::limits::Limits::new(&up.limits) {
        p.add("upstream.limits", &e, "invalid rate limit");
    }
}

/// The reconciliation sweeper's settings (`reconcile.*`), its read rate against the upstream's.
fn reconcile(c: &Config, p: &mut Problems) {
    for (key, value, why) in c.reconcile.problems(c.upstream.limits.global.per_second) {
        p.add(&key, &value, &why);
    }
}

/// `helpdesk.*`: each endpoint, the timeouts, then the checks of the help desk's own settings.
fn helpdesk(c: &Config, p: &mut Problems) {
    let hd = &c.helpdesk;
    let mut names = HashSet::new();
    for (i, ep) in hd.endpoints.iter().enumerate() {
        helpdesk_endpoint(&format!("helpdesk.endpoints[{i}]"), ep, &mut names, p);
    }
    if hd.timeout.is_zero() || hd.connect_timeout.is_zero() {
        p.add(
            "helpdesk.timeout",
            &humantime::format_duration(hd.timeout),
            "timeouts must be positive",
        );
    }
    for (key, value, why) in hd.problems() {
        p.add(&key, &value, &why);
    }
}

/// One help-desk endpoint at key `at`: a unique name (`names` holds those seen before), its URL,
/// signing secrets and event patterns.
fn helpdesk_endpoint<'a>(
    at: &str,
    ep: &'a HelpdeskEndpoint,
    names: &mut HashSet<&'a str>,
    p: &mut Problems,
) {
    if ep.name.is_empty()
        || !ep
            .name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
        p.add(
            &format!("{at}.name"),
            &ep.name,
            "must be non-empty A-Z a-z 0-9 - _ (it labels metrics)",
        );
    } else if !names.insert(ep.name.as_str()) {
        p.add(&format!("{at}.name"), &ep.name, "used by another endpoint");
    }
    // The URL is not echoed: it may carry credentials.
    match ep.url.expose().parse::<actix_web::http::Uri>() {
        Ok(uri) if matches!(uri.scheme_str(), Some("http" | "https")) && uri.host().is_some() => {}
        _ => p.add(
            &format!("{at}.url"),
            &"(not shown)",
            "not an http:// or https:// URL with a host",
        ),
    }
    if ep.secrets.is_empty() {
        p.add(
            &format!("{at}.secrets"),
            &"[]",
            "at least one signing secret (whsec_ + base64)",
        );
    }
    for (j, secret) in ep.secrets.iter().enumerate() {
        if let Err(e) = crate::helpdesk::signing::SigningKey::from_secret(secret) {
            p.add(&format!("{at}.secrets[{j}]"), &"****", &e.to_string());
        }
    }
    if ep.events.is_empty() {
        p.add(
            &format!("{at}.events"),
            &"[]",
            "selects nothing; leave it out to send every kind",
        );
    }
    for pattern in &ep.events {
        if !crate::helpdesk::events::is_valid_pattern(pattern) {
            p.add(
                &format!("{at}.events"),
                pattern,
                &format!(
                    "selects no event kind; kinds: {}, a family (`handoff.*`) or `*`",
                    model::helpdesk::DeskEventKind::names()
                ),
            );
        }
    }
}

/// `log.level`: a tracing filter.
fn log_level(c: &Config, p: &mut Problems) {
    if tracing_subscriber::EnvFilter::try_new(&c.log.level).is_err() {
        p.add(
            "log.level",
            &c.log.level,
            "not a tracing filter (e.g. info, handoff_bridge=debug)",
        );
    }
}
