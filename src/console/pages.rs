//! The console's pages (GET): overview, queue, conversation, outbox and dead letters,
//! quarantine, rules, the audit list, and the sign-in form. Reads go to the blocking pool (the
//! store may wait on its I/O) and read the same indexes as the agent API and the admin lists.

use super::view::{self, Frame};
use super::{html, Console, ConsoleError, Signed, PREFIX};
use actix_web::http::StatusCode;
use actix_web::{web, HttpRequest, HttpResponse};
use askama::Template;
use engine::state::desk::DeskPhase;
use serde::Deserialize;
use serde_json::Value;

/// Rows a list page shows at most.
const PAGE: usize = 100;
/// Messages the conversation page shows (read from the Open API).
const MESSAGES: u32 = 10;
/// The most of a quarantined body a page shows.
const BODY_SHOWN: usize = 64 * 1024;

pub(super) fn routes(cfg: &mut web::ServiceConfig) {
    cfg.route("/", web::get().to(overview))
        .route("/queue", web::get().to(queue))
        .route("/conversations/{id}", web::get().to(conversation))
        .route("/outbox", web::get().to(outbox))
        .route("/quarantine", web::get().to(quarantine))
        .route("/quarantine/{id}", web::get().to(quarantine_one))
        .route("/rules", web::get().to(rules))
        .route("/audit", web::get().to(audit))
        .route("/sign-in", web::get().to(sign_in_form))
        .route("/static/console.css", web::get().to(stylesheet));
}

/// `/console` without its slash.
pub(super) async fn to_overview() -> HttpResponse {
    super::see_other(&format!("{PREFIX}/"))
}

/// `?done=` after an action's redirect.
#[derive(Deserialize)]
pub(super) struct Done {
    done: Option<String>,
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, storage::StoreError> + Send + 'static,
) -> Result<T, ConsoleError> {
    web::block(f)
        .await
        .map_err(|_| ConsoleError::Unavailable("the console is busy; retry".into()))?
        .map_err(ConsoleError::from)
}

// ---- Overview ----

#[derive(Template)]
#[template(path = "console/overview.html")]
struct OverviewPage {
    frame: Frame,
    checks: Vec<(String, String, bool)>,
    circuits: Vec<(String, String, bool)>,
    waiting: u64,
    oldest_wait: String,
    /// Per bot: its id, how many wait, the oldest wait.
    bots: Vec<(String, u64, String)>,
    day: DayFigures,
    rules_version: String,
    cluster: NodesView,
}

/// This node among the nodes on the store, as `GET /admin/v1/cluster` has it.
struct NodesView {
    node_id: String,
    role: &'static str,
    holder: String,
    epoch: u64,
    expires: String,
    /// Each node seen in the last minute, and when.
    nodes: Vec<(String, String)>,
}

impl NodesView {
    fn of(view: crate::cluster::View) -> NodesView {
        NodesView {
            role: match view.role {
                crate::cluster::Role::Active => "active",
                crate::cluster::Role::Standby => "standby",
            },
            node_id: view.node_id,
            holder: view.holder.unwrap_or_else(|| "none".into()),
            epoch: view.epoch,
            expires: match view.expires_at {
                Some(at) if view.shared => view::time(at),
                Some(_) => "never (one node on its own store)".into(),
                None => "-".into(),
            },
            nodes: view
                .nodes
                .into_iter()
                .map(|n| (n.node, view::time(n.seen_at)))
                .collect(),
        }
    }
}

/// The last 24 hours' handoff figures, as the folds kept them (no scan).
struct DayFigures {
    joined: u64,
    accepted: u64,
    abandoned: u64,
    abandonment_rate: String,
    p50: String,
    p90: String,
}

/// How far back the overview's figures go.
const DAY_MS: i64 = 24 * 3600 * 1000;

fn day_figures(stats: &engine::state::stats::HandoffStats) -> DayFigures {
    use engine::state::stats::QueueExit;
    let or_dash = |v: Option<i64>| v.map_or_else(|| "-".into(), view::wait);
    DayFigures {
        joined: stats.joined,
        accepted: stats.exits.get(QueueExit::Accepted),
        abandoned: stats.abandoned(),
        abandonment_rate: stats
            .abandonment_rate()
            .map_or_else(|| "-".into(), |r| format!("{:.0}%", r * 100.0)),
        p50: or_dash(stats.percentile(0.5)),
        p90: or_dash(stats.percentile(0.9)),
    }
}

async fn overview(
    console: web::Data<Console>,
    signed: Signed,
    q: web::Query<Done>,
) -> Result<HttpResponse, ConsoleError> {
    let ops = &console.ops;
    let now = ops.store.clock().now_millis();
    let summary = ops.store.queue_summary()?;
    let store = ops.store.clone();
    let (stats, by_bot) = blocking(move || {
        let stats = store.handoff_stats(now - DAY_MS, now + 1)?;
        Ok((stats, store.waiting_by_bot()?))
    })
    .await?;
    let bots = by_bot
        .into_iter()
        .map(|b| {
            let oldest = b
                .oldest_since
                .map_or_else(|| "-".into(), |s| view::wait(now - s));
            (b.bot, b.waiting, oldest)
        })
        .collect();
    let health = crate::ops::health(ops);
    let checks = vec![
        check("store", health.store_ok, "ok", "failing"),
        check("outbox", !health.outbox_backed_up, "ok", "backed up"),
        ("upstream".to_owned(), health.upstream_mode.to_owned(), true),
        check(
            "webhook",
            !health.webhook_silent,
            "delivering",
            "silent (backfill reads the Open API)",
        ),
        check("folding", !health.dispatch_paused, "running", "paused"),
        check(
            "outbox execution",
            !health.outbox_paused,
            "running",
            "paused",
        ),
    ];
    let mut checks = checks;
    for (name, status) in crate::ops::desks(ops) {
        let status = status.as_str().unwrap_or_default().to_owned();
        let ok = status == "ok" || status == "not called yet";
        checks.push((format!("desk {name}"), status, ok));
    }
    let circuits = ops
        .executor
        .circuits()
        .into_iter()
        .map(|(name, c)| {
            let state = match c.since {
                Some(at) if c.open => format!("open since {}", view::time(at)),
                _ => format!("closed ({} failures in a row)", c.consecutive_failures),
            };
            (name, state, !c.open)
        })
        .collect();
    let page = OverviewPage {
        frame: Frame::new(&signed.0, "overview", q.done.as_deref()),
        checks,
        circuits,
        waiting: summary.waiting,
        oldest_wait: summary
            .oldest_since
            .map_or_else(|| "-".into(), |since| view::wait(now - since)),
        bots,
        day: day_figures(&stats),
        rules_version: ops.rules.live.current().version().to_owned(),
        cluster: NodesView::of(ops.cluster.view().await?),
    };
    Ok(html(StatusCode::OK, page))
}

fn check(name: &str, ok: bool, good: &str, bad: &str) -> (String, String, bool) {
    let text = if ok { good } else { bad };
    (name.to_owned(), text.to_owned(), ok)
}

// ---- Queue ----

#[derive(Template)]
#[template(path = "console/queue.html")]
struct QueuePage {
    frame: Frame,
    rows: Vec<QueueRow>,
    bot: String,
    next: Option<String>,
}

struct QueueRow {
    id: String,
    bot: String,
    position: String,
    wait: String,
    platform: String,
    user: String,
}

#[derive(Deserialize)]
struct QueueQuery {
    bot: Option<String>,
    after: Option<String>,
}

async fn queue(
    console: web::Data<Console>,
    signed: Signed,
    q: web::Query<QueueQuery>,
) -> Result<HttpResponse, ConsoleError> {
    let q = q.into_inner();
    let after = match q.after.as_deref().filter(|a| !a.is_empty()) {
        Some(text) => Some(
            storage::desk::DeskCursor::decode(text)
                .map_err(|e| ConsoleError::BadRequest(e.to_string()))?,
        ),
        None => None,
    };
    let bot = q.bot.filter(|b| !b.trim().is_empty());
    let store = console.ops.store.clone();
    let wanted = bot.clone();
    let (page, positions) = blocking(move || {
        let page = store.desk_page(
            Some(DeskPhase::Requested),
            wanted.as_deref(),
            after.as_ref(),
            PAGE,
        )?;
        let positions = store.waiting_positions(&page.conversations)?;
        Ok((page, positions))
    })
    .await?;
    let now = console.ops.store.clock().now_millis();
    let rows = page
        .conversations
        .iter()
        .map(|s| QueueRow {
            id: s.id.as_str().to_owned(),
            bot: s.bot_id.as_ref().map_or("-", |b| b.as_str()).to_owned(),
            position: positions
                .get(s.id.as_str())
                .map_or_else(|| "-".into(), |p| p.to_string()),
            wait: s
                .handoff
                .requested_at
                .map_or_else(|| "-".into(), |at| view::wait(now - at)),
            platform: s.platform.as_ref().map_or("-", |p| p.as_str()).to_owned(),
            user: s.user_key.as_ref().map_or("-", |k| k.as_str()).to_owned(),
        })
        .collect();
    let page = QueuePage {
        frame: Frame::new(&signed.0, "queue", None),
        rows,
        bot: bot.unwrap_or_default(),
        next: page.next.map(|c| c.encode()),
    };
    Ok(html(StatusCode::OK, page))
}

// ---- Conversation ----

#[derive(Template)]
#[template(path = "console/conversation.html")]
struct ConversationPage {
    frame: Frame,
    id: String,
    summary: Vec<(&'static str, String)>,
    messages: Vec<(String, String, String)>,
    messages_note: Option<String>,
    /// Its conversation at each desk: (connector, what, link).
    desks: Vec<(String, String, Option<String>)>,
    timeline: Vec<TimelineItem>,
    /// A key per form: the console's commands are idempotent per form shown.
    form_key: String,
}

struct TimelineItem {
    at: String,
    kind: String,
    event_id: String,
    detail: String,
    rules: Vec<(String, bool, String)>,
    actions: Vec<(String, String, String)>,
}

async fn conversation(
    console: web::Data<Console>,
    signed: Signed,
    id: web::Path<String>,
    q: web::Query<Done>,
) -> Result<HttpResponse, ConsoleError> {
    let id = model::ids::ConversationId::new(id.into_inner());
    let store = console.ops.store.clone();
    let (rules, set) = console.ops.rules.live.current_explained();
    let key = id.clone();
    let found = blocking(move || {
        let Some(state) = store.conversation(&key)? else {
            return Ok(None);
        };
        let audit = crate::queries::audit_of(&*store, rules.as_ref(), set.as_deref(), &state)?;
        let link = store.desk_link(crate::helpdesk::chatwoot::client::NAME, &key)?;
        Ok(Some((state, audit, link)))
    })
    .await?;
    let Some((state, audit, link)) = found else {
        return Err(ConsoleError::NotFound(format!("no conversation {id}")));
    };
    let (messages, messages_note) = messages(&console, id.as_str()).await;
    let page = ConversationPage {
        frame: Frame::new(&signed.0, "queue", q.done.as_deref()),
        id: id.as_str().to_owned(),
        summary: summary(&state),
        messages,
        messages_note,
        desks: desk_rows(&console, link),
        timeline: timeline(&audit),
        form_key: super::session::random_token(),
    };
    Ok(html(StatusCode::OK, page))
}

/// The conversation at its desks: the Chatwoot conversation (a link to it), open or handed back.
fn desk_rows(
    console: &Console,
    link: Option<storage::desk_links::DeskLink>,
) -> Vec<(String, String, Option<String>)> {
    let (Some(view), Some(link)) = (&console.ops.chatwoot, link) else {
        return Vec::new();
    };
    let Some(remote) = link.remote else {
        return vec![(link.connector, "being opened".into(), None)];
    };
    let state = match link.closed_at {
        Some(at) => format!("conversation {remote}, handed back {}", view::time(at)),
        None => format!("conversation {remote}, open"),
    };
    vec![(link.connector, state, Some(view.conversation_url(&remote)))]
}

/// The state's summary: phase, agent, manual status, navigation, who and where.
fn summary(s: &engine::state::ConversationState) -> Vec<(&'static str, String)> {
    let or_dash = |v: Option<&str>| v.unwrap_or("-").to_owned();
    vec![
        ("Phase", DeskPhase::of(s).as_str().to_owned()),
        (
            "Agent",
            s.desk.agent.as_ref().map_or_else(
                || "-".into(),
                |a| a.name.clone().unwrap_or_else(|| a.id.clone()),
            ),
        ),
        ("Accepted at", view::time_or_dash(s.desk.accepted_at)),
        ("Requested at", view::time_or_dash(s.handoff.requested_at)),
        (
            "Manual mode",
            match s.manual_set.value {
                Some(true) => "on".to_owned(),
                Some(false) => "off".to_owned(),
                None => "-".to_owned(),
            },
        ),
        ("Manual status", or_dash(s.manual_status.value.as_deref())),
        (
            "Navigation",
            view::text(&serde_json::to_value(&s.navigation.value).unwrap_or_default()),
        ),
        ("Bot", or_dash(s.bot_id.as_ref().map(|b| b.as_str()))),
        ("Platform", or_dash(s.platform.as_ref().map(|p| p.as_str()))),
        ("User key", or_dash(s.user_key.as_ref().map(|k| k.as_str()))),
        ("Last event", view::time(s.last_event_at)),
    ]
}

/// The newest messages, from the Open API (a failure is said, not fatal).
async fn messages(console: &Console, id: &str) -> (Vec<(String, String, String)>, Option<String>) {
    match crate::helpdesk::agent_api::transcript(&console.upstream, id, MESSAGES).await {
        Ok(Value::Array(list)) => {
            let rows = list
                .iter()
                .map(|m| {
                    let parsed =
                        serde_json::from_value::<model::webhook::model::Message>(m.clone());
                    // The bridge's own sends carry its marker; the agent API's (the console's
                    // replies too) are the desk's agents'.
                    let ours = m["meta"]["custom"]
                        .as_str()
                        .filter(|c| c.starts_with(model::action::echo::MARKER_PREFIX));
                    let who = match (ours, parsed.map(|m| m.sender())) {
                        (Some(c), _) if c.contains(engine::state::desk::BUILTIN_RULE) => "agent",
                        (Some(_), _) => "bot (a rule)",
                        (None, Ok(model::webhook::model::Sender::User)) => "user",
                        (None, Ok(model::webhook::model::Sender::Agent)) => "agent",
                        (None, Ok(model::webhook::model::Sender::Bot)) => "bot",
                        (None, Err(_)) => "?",
                    };
                    let text = match m["data"]["text"].as_str() {
                        Some(t) => t.to_owned(),
                        None => format!("({})", view::text(&m["data"]["type"])),
                    };
                    let at = m["timestamp"].as_i64().map_or_else(String::new, view::time);
                    (at, who.to_owned(), text)
                })
                .collect();
            (rows, None)
        }
        Ok(_) => (Vec::new(), None),
        Err(e) => (
            Vec::new(),
            Some(format!("the Open API could not be read: {e}")),
        ),
    }
}

/// The audit's timeline, made into rows.
fn timeline(audit: &Value) -> Vec<TimelineItem> {
    let Some(items) = audit["timeline"].as_array() else {
        return Vec::new();
    };
    items
        .iter()
        .rev()
        .map(|item| TimelineItem {
            at: item["received_at"]
                .as_i64()
                .map_or_else(String::new, view::time),
            kind: view::text(&item["type"]),
            event_id: view::text(&item["event_id"]),
            detail: [
                ("sender", &item["sender"]),
                ("message", &item["message_type"]),
                ("pending", &item["pending"]),
            ]
            .into_iter()
            .filter(|(_, v)| **v != Value::Bool(false))
            .filter_map(field)
            .collect::<Vec<_>>()
            .join(", "),
            rules: item["rules"]
                .as_array()
                .map_or_else(Vec::new, |rules| rules.iter().map(rule_row).collect()),
            actions: item["actions"]
                .as_array()
                .map_or_else(Vec::new, |actions| actions.iter().map(action_row).collect()),
        })
        .collect()
}

/// A rule's verdict: its name, whether it matched, and why (its conditions, or what failed).
fn rule_row(r: &Value) -> (String, bool, String) {
    let matched = r["matched"].as_bool() == Some(true);
    let keys = [
        "failed",
        "stopped_by",
        "echo_of",
        "conditions",
        "actions",
        "cap",
    ];
    let why = keys
        .map(|k| (k, &r[k]))
        .into_iter()
        .filter_map(field)
        .collect::<Vec<_>>()
        .join("; ");
    (view::text(&r["rule"]), matched, why)
}

/// `key: value` for a value that is there (not null).
fn field((key, value): (&str, &Value)) -> Option<String> {
    (!value.is_null()).then(|| format!("{key}: {}", view::text(value)))
}

/// An action: its type, status and detail (attempts, reason, when).
fn action_row(a: &Value) -> (String, String, String) {
    let detail = ["attempts", "reason", "error", "note"]
        .map(|k| (k, &a[k]))
        .into_iter()
        .filter_map(field)
        .chain(a["at"].as_i64().map(|at| format!("at {}", view::time(at))))
        .collect::<Vec<_>>()
        .join(", ");
    (view::text(&a["type"]), view::text(&a["status"]), detail)
}

// ---- Outbox and dead letters ----

#[derive(Template)]
#[template(path = "console/outbox.html")]
struct OutboxPage {
    frame: Frame,
    depth: usize,
    paused: bool,
    pending: Vec<(u64, String, String, String)>,
    dead: Vec<DeadRow>,
}

struct DeadRow {
    seq: u64,
    action: String,
    conversation: String,
    reason: String,
    attempts: u32,
    last: String,
}

async fn outbox(
    console: web::Data<Console>,
    signed: Signed,
    q: web::Query<Done>,
) -> Result<HttpResponse, ConsoleError> {
    let store = console.ops.store.clone();
    let (pending, dead) = blocking(move || {
        Ok((
            store.outbox_page(None, PAGE)?,
            store.dead_letters_page(None, PAGE)?,
        ))
    })
    .await?;
    let pending = pending
        .into_iter()
        .map(|e| {
            let conversation = conversation_of(&e.queue);
            (e.seq, e.action.name().to_owned(), conversation, e.queue)
        })
        .collect();
    let dead = dead
        .into_iter()
        .map(|l| DeadRow {
            seq: l.entry.seq,
            action: l.entry.action.name().to_owned(),
            conversation: conversation_of(&l.entry.queue),
            reason: l.reason,
            attempts: l.attempts,
            last: view::time(l.last_attempt_at),
        })
        .collect();
    let page = OutboxPage {
        frame: Frame::new(&signed.0, "outbox", q.done.as_deref()),
        depth: console.ops.executor.depth(),
        paused: console.ops.executor.is_paused(),
        pending,
        dead,
    };
    Ok(html(StatusCode::OK, page))
}

/// The conversation an outbox queue belongs to (`c:<id>`), or empty.
fn conversation_of(queue: &str) -> String {
    match model::ids::PartitionKey::decode(queue) {
        Some(model::ids::PartitionKey::Conversation(id)) => id.as_str().to_owned(),
        _ => String::new(),
    }
}

// ---- Quarantine ----

#[derive(Template)]
#[template(path = "console/quarantine.html")]
struct QuarantinePage {
    frame: Frame,
    records: Vec<storage::QuarantineMeta>,
}

async fn quarantine(
    console: web::Data<Console>,
    signed: Signed,
    q: web::Query<Done>,
) -> Result<HttpResponse, ConsoleError> {
    let store = console.ops.store.clone();
    let (records, _) = blocking(move || store.quarantine_page(None, PAGE)).await?;
    let page = QuarantinePage {
        frame: Frame::new(&signed.0, "quarantine", q.done.as_deref()),
        records,
    };
    Ok(html(StatusCode::OK, page))
}

#[derive(Template)]
#[template(path = "console/quarantine_one.html")]
struct QuarantineOnePage {
    frame: Frame,
    record: storage::QuarantineMeta,
    received: String,
    body: String,
    truncated: bool,
}

async fn quarantine_one(
    console: web::Data<Console>,
    signed: Signed,
    id: web::Path<String>,
) -> Result<HttpResponse, ConsoleError> {
    let id: u64 = id
        .parse()
        .map_err(|_| ConsoleError::BadRequest("a quarantine id is a number".into()))?;
    let store = console.ops.store.clone();
    let scrubber = console.ops.intake.scrubber.clone();
    let found = blocking(move || {
        let Some(record) = store.quarantined_one(id)? else {
            return Ok(None);
        };
        let body = record.body_prefix(BODY_SHOWN + 1)?;
        Ok(Some((record.meta(), body)))
    })
    .await?;
    let Some((record, mut body)) = found else {
        return Err(ConsoleError::NotFound(format!("no quarantine record {id}")));
    };
    let truncated = body.len() > BODY_SHOWN;
    body.truncate(BODY_SHOWN);
    // Shown with every known webhook token masked (a body stored before a token was added).
    let body = String::from_utf8_lossy(&scrubber.scrub(&body)).into_owned();
    let page = QuarantineOnePage {
        frame: Frame::new(&signed.0, "quarantine", None),
        received: view::time(record.received_at),
        record,
        body,
        truncated,
    };
    Ok(html(StatusCode::OK, page))
}

// ---- Rules ----

#[derive(Template)]
#[template(path = "console/rules.html")]
pub(super) struct RulesPage {
    pub frame: Frame,
    pub version: String,
    pub rules: Vec<RuleRow>,
    pub warnings: Vec<engine::rules::explain::Warning>,
    /// The pasted event of a dry run, and its report.
    pub event: String,
    pub report: Vec<(String, String)>,
    pub error: Option<String>,
}

pub(super) struct RuleRow {
    name: String,
    file: String,
    enabled: bool,
    on: String,
    actions: String,
}

/// The rules page for `set` (none when rules are off), with a dry run's input and report.
pub(super) fn rules_page(
    console: &Console,
    frame: Frame,
    event: String,
    report: Vec<(String, String)>,
    error: Option<String>,
) -> RulesPage {
    let (decide, set) = console.ops.rules.live.current_explained();
    let (rules, warnings) = match &set {
        Some(set) => (
            set.rules()
                .iter()
                .map(|r| RuleRow {
                    name: r.name.clone(),
                    file: r.file.clone(),
                    enabled: r.enabled,
                    on: r.on.join(", "),
                    actions: r.action_types().join(", "),
                })
                .collect(),
            engine::rules::explain::lint(set),
        ),
        None => (Vec::new(), Vec::new()),
    };
    RulesPage {
        frame,
        version: decide.version().to_owned(),
        rules,
        warnings,
        event,
        report,
        error,
    }
}

async fn rules(console: web::Data<Console>, signed: Signed) -> HttpResponse {
    let frame = Frame::new(&signed.0, "rules", None);
    html(
        StatusCode::OK,
        rules_page(&console, frame, String::new(), Vec::new(), None),
    )
}

// ---- Audit list ----

#[derive(Template)]
#[template(path = "console/audit.html")]
struct AuditPage {
    frame: Frame,
    entries: Vec<(String, storage::operators::OperatorAction)>,
    /// The number to ask for the next (older) page.
    older: Option<u64>,
}

#[derive(Deserialize)]
struct AuditQuery {
    /// Read as text, so a bad one is the console's own 400 page.
    before: Option<String>,
}

async fn audit(
    console: web::Data<Console>,
    signed: Signed,
    q: web::Query<AuditQuery>,
) -> Result<HttpResponse, ConsoleError> {
    let before = match q.before.as_deref() {
        None | Some("") => None,
        Some(text) => Some(text.parse::<u64>().map_err(|_| {
            ConsoleError::BadRequest(
                "`before` is an entry's number (from \"Older actions\")".into(),
            )
        })?),
    };
    let store = console.ops.store.clone();
    let (entries, older) = blocking(move || super::audit::page(&*store, before)).await?;
    let page = AuditPage {
        frame: Frame::new(&signed.0, "audit", None),
        entries: entries.into_iter().map(|e| (view::time(e.at), e)).collect(),
        older,
    };
    Ok(html(StatusCode::OK, page))
}

// ---- Sign-in ----

#[derive(Template)]
#[template(path = "console/sign_in.html")]
pub(super) struct SignInPage {
    pub form_token: String,
    pub error: Option<String>,
}

async fn sign_in_form(console: web::Data<Console>, req: HttpRequest) -> HttpResponse {
    let secure = console.ops.proxies.over_tls(&req);
    let (form_token, cookie) = super::session::sign_in_form(secure);
    let mut response = html(
        StatusCode::OK,
        SignInPage {
            form_token,
            error: None,
        },
    );
    if let Err(e) = response.add_cookie(&cookie) {
        tracing::error!(error = %e, "cannot set the sign-in cookie");
    }
    response
}

/// The stylesheet, embedded in the binary.
async fn stylesheet() -> HttpResponse {
    HttpResponse::Ok()
        .content_type("text/css; charset=utf-8")
        .insert_header((actix_web::http::header::CACHE_CONTROL, "max-age=3600"))
        .body(include_str!("../../templates/console/console.css"))
}
