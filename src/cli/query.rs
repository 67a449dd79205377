//! Online commands on the store: `state`, `outbox`, `reconcile`, `audit`, `quarantine`, `dlq`,
//! `replay`. Through the running daemon's admin API, or on the store when it is stopped.

use super::admin::{enc, online, print_found, read};
use super::pages::{items, list_command, next_cursor, Pager, Unpaged};
use super::{CliError, DlqCommand, OutboxCommand, QuarantineCommand, StateCommand};
use handoff_bridge::config::Config;
use handoff_bridge::queries::{List, PAGE_MAX};
use serde_json::Value;
use storage::Storage;

/// `handoff-bridge audit`: a conversation's timeline with the rules re-evaluated.
pub(super) fn audit(config: &Config, conversation_id: &str) -> Result<(), CliError> {
    let path = format!("/admin/v1/conversations/{}/audit", enc(conversation_id));
    let (rules, set) = handoff_bridge::app::load_rules(config)?.current_explained();
    let value = read(config, "GET", &path, |store| {
        let id = conversation_id.into();
        handoff_bridge::queries::audit(store, rules.as_ref(), set.as_deref(), &id)
    })?;
    print_found(value, || format!("no conversation {conversation_id}"))
}

/// `handoff-bridge state ...`: one conversation, an end user, or a list of either.
pub(super) fn state(config: &Config, action: StateCommand) -> Result<(), CliError> {
    match action {
        StateCommand::Show { conversation_id } => {
            let path = format!("/admin/v1/conversations/{}", enc(&conversation_id));
            let value = read(config, "GET", &path, |store| {
                let state = store.conversation(&conversation_id.as_str().into())?;
                Ok(state.map(|s| serde_json::to_value(s).unwrap_or(Value::Null)))
            })?;
            print_found(value, || format!("no conversation {conversation_id}"))
        }
        StateCommand::Find { platform, user_key } => {
            let path = format!(
                "/admin/v1/endusers?platform={}&userKey={}",
                enc(&platform),
                enc(&user_key)
            );
            let value = read(config, "GET", &path, |store| {
                handoff_bridge::queries::find_end_user(store, &platform, &user_key)
            })?;
            print_found(value, || format!("no end user {user_key} on {platform}"))
        }
        StateCommand::Conversations { page } => {
            list_command(config, List::Conversations, page, Unpaged::FirstPage)
        }
        StateCommand::Endusers { page } => {
            list_command(config, List::EndUsers, page, Unpaged::FirstPage)
        }
    }
}

/// `handoff-bridge outbox ...`: pending and finished entries, pause and resume.
pub(super) fn outbox(config: &Config, action: OutboxCommand) -> Result<(), CliError> {
    match action {
        OutboxCommand::List { page } => list_command(config, List::Outbox, page, Unpaged::Object),
        OutboxCommand::Show { id } => {
            let path = format!("/admin/v1/outbox/{id}");
            let value = read(config, "GET", &path, |store| {
                let entry = store.outbox_entry(id)?;
                Ok(entry.map(|e| serde_json::to_value(e).unwrap_or(Value::Null)))
            })?;
            print_found(value, || format!("no pending outbox entry {id}"))
        }
        OutboxCommand::Pause => outbox_switch(config, "pause"),
        OutboxCommand::Resume => outbox_switch(config, "resume"),
        OutboxCommand::Done { page } => list_command(config, List::Done, page, Unpaged::FirstPage),
    }
}

/// `outbox pause|resume` (`verb`): only the running daemon has an executor to switch.
fn outbox_switch(config: &Config, verb: &str) -> Result<(), CliError> {
    let path = format!("/admin/v1/outbox/{verb}");
    match online(config, "POST", &path)? {
        Some(value) => print_found(value, String::new),
        // Offline there is no executor to pause: say so instead of pretending.
        None => Err(CliError::Usage(format!(
            "`outbox {verb}` acts on the running daemon, and none is running here"
        ))),
    }
}

/// `handoff-bridge reconcile`: a reconciliation pass of the running daemon.
pub(super) fn reconcile(config: &Config, dry_run: bool) -> Result<(), CliError> {
    let path = format!("/admin/v1/reconcile?dry_run={dry_run}");
    match online(config, "POST", &path)? {
        Some(value) => print_found(value, String::new),
        // The pass needs the daemon's Open API client and writer.
        None => Err(CliError::Usage(
            "`reconcile` runs a pass of the running daemon, and none is running here".into(),
        )),
    }
}

/// `handoff-bridge quarantine ...`: list, show, re-process.
pub(super) fn quarantine(config: &Config, action: QuarantineCommand) -> Result<(), CliError> {
    match action {
        QuarantineCommand::List { page } => {
            list_command(config, List::Quarantine, page, Unpaged::Array)
        }
        QuarantineCommand::Show { id } => {
            let value = read(
                config,
                "GET",
                &format!("/admin/v1/quarantine/{id}"),
                |store| {
                    Ok(store
                        .quarantined_one(id)?
                        .map(|r| handoff_bridge::queries::quarantine_view(&r)))
                },
            )?;
            print_found(value, || format!("no quarantine record {id}"))
        }
        QuarantineCommand::Reprocess { id, all } => {
            let ids: Vec<u64> = match (id, all) {
                (Some(id), _) => vec![id],
                (None, true) => quarantine_ids(config)?,
                (None, false) => {
                    return Err(CliError::Usage("give a quarantine id or --all".into()))
                }
            };
            reprocess(config, ids)
        }
    }
}

/// Every quarantine record's id, page by page (the pages hold no bodies); the pager, and the
/// store it may have opened, is gone before re-processing.
fn quarantine_ids(config: &Config) -> Result<Vec<u64>, CliError> {
    let mut pages = Pager::new(config, List::Quarantine);
    let mut ids = Vec::new();
    let mut after = None;
    loop {
        let page = pages.page(Some(PAGE_MAX), after.as_deref())?;
        ids.extend(
            items(&page, List::Quarantine).filter_map(|r| r.get("id").and_then(Value::as_u64)),
        );
        match next_cursor(&page) {
            Some(next) => after = Some(next),
            None => return Ok(ids),
        }
    }
}

/// Re-process the quarantine records `ids` in turn and print the results as one JSON array.
fn reprocess(config: &Config, ids: Vec<u64>) -> Result<(), CliError> {
    let scrubber = handoff_bridge::intake::scrub::Scrubber::configured(config)
        .map_err(|e| CliError::Usage(format!("webhook tokens: {e}")))?;
    let mut results = Vec::new();
    for id in ids {
        let value = read(
            config,
            "POST",
            &format!("/admin/v1/quarantine/{id}/reprocess"),
            |store| {
                let now = model::clock::system_millis();
                let checks = model::webhook::Checks::intake(
                    config.webhook.max_events,
                    config.webhook.max_clock_skew,
                    now,
                );
                let out =
                    handoff_bridge::intake::reprocess_offline(store, id, &checks, now, &scrubber)?;
                store.flush()?;
                Ok(out.map(|o| serde_json::to_value(o).unwrap_or(Value::Null)))
            },
        )?;
        match value {
            Some(v) => results.push(v),
            None => return Err(CliError::NotFound(format!("no quarantine record {id}"))),
        }
    }
    out!(
        "{}",
        serde_json::to_string_pretty(&results).unwrap_or_default()
    );
    Ok(())
}

/// `handoff-bridge replay`: through the running daemon (its rules, its executor), or on the
/// store when it is stopped (with the configured rules; the next start runs what was queued).
pub(super) fn replay(
    config: &Config,
    from: &str,
    to: &str,
    dry_run: bool,
    force: bool,
) -> Result<(), CliError> {
    let parse = |what: &str, text: &str| {
        model::clock::parse_time(text).map_err(|e| CliError::Usage(format!("--{what}: {e}")))
    };
    let request = storage::replay::ReplayRequest {
        from: parse("from", from)?,
        to: parse("to", to)?,
        dry_run,
        force,
    };
    if request.from >= request.to {
        return Err(CliError::Usage("--from must be before --to".into()));
    }
    let rules = handoff_bridge::app::load_rules(config)?.current();
    let path = format!(
        "/admin/v1/replay?from={}&to={}&dry_run={dry_run}&force={force}",
        request.from, request.to
    );
    let value = read(config, "POST", &path, |store| {
        let report = store.replay(&request, rules.as_ref())?;
        if !report.entries.is_empty() {
            store.flush()?;
        }
        Ok(Some(serde_json::to_value(&report).unwrap_or(Value::Null)))
    })?;
    // A running daemon replays with the rules it loaded at start, not the files on disk.
    let used = value.as_ref().and_then(|v| v["rules_version"].as_str());
    if let Some(used) = used.filter(|v| *v != rules.version()) {
        eprintln!(
            "note: replayed with rules version {used} (the running daemon's); the rule files \
             here are version {}. Restart the daemon to replay with them.",
            rules.version()
        );
    }
    print_found(value, String::new)
}

/// `handoff-bridge dlq ...`: through the running daemon, or on the store when it is stopped (the
/// next start then runs what was retried).
pub(super) fn dlq(config: &Config, action: DlqCommand) -> Result<(), CliError> {
    let now = model::clock::system_millis();
    match action {
        DlqCommand::List { page } => list_command(config, List::DeadLetters, page, Unpaged::Object),
        DlqCommand::Show { id } => {
            let value = read(
                config,
                "GET",
                &format!("/admin/v1/dead-letters/{id}"),
                |store| {
                    Ok(store
                        .dead_letter(id)?
                        .and_then(|l| serde_json::to_value(l).ok()))
                },
            )?;
            print_found(value, || format!("no dead letter {id}"))
        }
        DlqCommand::Retry { id, all } => dlq_retry(config, id, all, now),
        DlqCommand::Drop { id, reason } => dlq_drop(config, id, &reason, now),
    }
}

/// `dlq retry`: the dead letter `id`, or with `all` every one, back in the outbox.
fn dlq_retry(
    config: &Config,
    id: Option<u64>,
    all: bool,
    now: model::webhook::model::Millis,
) -> Result<(), CliError> {
    let (path, wanted) = match (id, all) {
        (Some(id), _) => (format!("/admin/v1/dead-letters/{id}/retry"), Some(id)),
        (None, true) => ("/admin/v1/dead-letters/retry".to_owned(), None),
        (None, false) => return Err(CliError::Usage("give a dead-letter id or --all".into())),
    };
    let value = read(config, "POST", &path, |store| {
        let mut retried = Vec::new();
        let mut page = match wanted {
            Some(id) => vec![id],
            None => first_letters(store, None)?,
        };
        // All of them a page at a time (each page leaves the dead letters as it goes).
        while let Some(&last) = page.last() {
            for &id in &page {
                if store.retry_dead_letter(id, now)?.is_some() {
                    retried.push(id);
                }
            }
            page = match wanted {
                Some(_) => Vec::new(),
                None => first_letters(store, Some(last))?,
            };
        }
        store.flush()?;
        Ok((wanted.is_none() || !retried.is_empty())
            .then(|| serde_json::json!({ "retried": retried })))
    })?;
    print_found(value, || {
        format!("no dead letter {}", id.unwrap_or_default())
    })
}

/// `dlq drop`: remove the dead letter `id` for good, keeping `reason` in the action ledger.
fn dlq_drop(
    config: &Config,
    id: u64,
    reason: &str,
    now: model::webhook::model::Millis,
) -> Result<(), CliError> {
    if reason.trim().is_empty() {
        return Err(CliError::Usage("--reason must not be empty".into()));
    }
    let path = format!("/admin/v1/dead-letters/{id}?reason={}", enc(reason));
    let value = read(config, "DELETE", &path, |store| {
        let dropped = store.drop_dead_letter(id, reason, now)?;
        store.flush()?;
        Ok(dropped.map(|_| serde_json::json!({ "dropped": id, "reason": reason })))
    })?;
    print_found(value, || format!("no dead letter {id}"))
}

/// The seqs of a page of dead letters after `after`.
fn first_letters(store: &dyn Storage, after: Option<u64>) -> Result<Vec<u64>, storage::StoreError> {
    Ok(store
        .dead_letters_page(after, handoff_bridge::queries::PAGE)?
        .iter()
        .map(|l| l.entry.seq)
        .collect())
}
