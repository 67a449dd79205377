//! The console's audit list: who did what from the console, when, as which role, and how it
//! ended. Kept in the store (`storage::operators`) for `admin.console_audit_retention` and made
//! durable before the action's page answers; each entry is also logged (`console action` at
//! info).

use crate::ops::Ops;
use storage::operators::OperatorAction;

/// Entries a page of the list shows.
pub const PAGE: usize = 100;

/// Record an action taken from the console (and log it). An action is done when this runs: a
/// store that cannot keep its entry is logged with the entry, and the action's answer stands.
pub async fn record(ops: &Ops, action: OperatorAction) {
    tracing::info!(who = %action.who, role = %action.role, what = %action.what, result = %action.result, "console action");
    let store = ops.store.clone();
    let kept =
        actix_web::web::block(move || store.record_operator_action(&action).map(|_| action)).await;
    let failed = match kept {
        Ok(Ok(_)) => ops.writer.flush_own().await.err().map(|e| e.to_string()),
        Ok(Err(e)) => Some(e.to_string()),
        Err(e) => Some(e.to_string()),
    };
    if let Some(error) = failed {
        tracing::error!(%error, "the console's audit list could not keep an action; this log line is its record");
    }
}

/// A page of the list, newest first: up to [`PAGE`] entries recorded before number `before`
/// (the newest when `None`), and the number to ask for the next (older) page, if any.
pub fn page(
    store: &dyn storage::Storage,
    before: Option<u64>,
) -> Result<(Vec<OperatorAction>, Option<u64>), storage::StoreError> {
    let mut entries = store.operator_actions_page(before, PAGE + 1)?;
    let more = entries.len() > PAGE;
    entries.truncate(PAGE);
    let next = more.then(|| entries.last().map(|(id, _)| *id)).flatten();
    Ok((entries.into_iter().map(|(_, a)| a).collect(), next))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_go_back_from_the_newest_a_hundred_at_a_time() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store: storage::Store =
            std::sync::Arc::new(storage::SledStore::open(dir.path(), 1 << 20).expect("open"));
        for at in 0..(PAGE as i64 + 1) {
            let action = OperatorAction {
                at,
                who: "Kim".into(),
                role: "operator".into(),
                what: format!("accept c-{at}"),
                result: "applied".into(),
            };
            store.record_operator_action(&action).expect("record");
        }
        let (first, older) = page(&*store, None).expect("page");
        assert_eq!(first.len(), PAGE);
        assert_eq!(first[0].at, PAGE as i64, "newest first");
        let (second, end) = page(&*store, older).expect("older page");
        assert_eq!(second.iter().map(|a| a.at).collect::<Vec<_>>(), [0]);
        assert_eq!(end, None, "nothing older");
    }
}
