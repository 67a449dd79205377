//! The timer firer: turns due rule timers into `timer.<name>` events.
//!
//! A due timer becomes a synthetic event that goes through the writer like a webhook delivery
//! (event log sync, sled index, dispatcher), so it is folded in order with its conversation's
//! other events. Its event and delivery id are deterministic, so firing it again (after a crash,
//! before its fold) is a duplicate the writer drops. The firer never writes the timers tree: the
//! fold of the firing removes the key (see `store::timers`); until then the firer remembers the
//! key in memory and does not fire it again. After a restart that memory is empty and every due
//! key fires once more, harmlessly.
//!
//! It sleeps until the earliest due time, and is woken early when a fold starts a timer due
//! before that (`store::timers::TimerWakeup`).

use crate::ops::metrics::Metrics;
use model::ids::DeliveryId;
use model::webhook::model::Millis;
use std::collections::HashSet;
use std::time::Duration;
use storage::writer::WriterError;
use storage::{AcceptJob, DueTimer, Store, TimerKey, Writer};
use tokio::sync::watch;

/// Firings handed to the writer at once (they share its syncs).
const BATCH: usize = 256;
/// Longest sleep: the due times are wall-clock times, so a clock step is noticed this late at most.
const MAX_SLEEP: Duration = Duration::from_secs(60);
/// Pause after the store or the writer failed.
const RETRY_PAUSE: Duration = Duration::from_millis(500);
/// The firing's `sourceId` when the conversation's bot is not known (it always is once a rule
/// ran for one of its events).
const NO_BOT: &str = "bridge";

/// Start the firer on the current runtime: in each of `terms` (this node as the active one),
/// until the term ends (or the writer stops).
pub fn start(
    store: Store,
    writer: Writer,
    metrics: Metrics,
    terms: crate::cluster::Terms,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(crate::cluster::each_term(terms, move |stop| {
        run(store.clone(), writer.clone(), metrics.clone(), stop)
    }))
}

async fn run(store: Store, writer: Writer, metrics: Metrics, mut stop: watch::Receiver<bool>) {
    let wakeup = store.timer_wakeup();
    // Keys fired by this process whose firing is not folded yet.
    let mut fired: HashSet<TimerKey> = HashSet::new();
    loop {
        if *stop.borrow() {
            break;
        }
        wakeup.looking();
        fired.retain(|key| store.has_timer(key).unwrap_or(true));
        let now = store.clock().now_millis();
        let wait = match store.due_timers(now, BATCH, &|key| fired.contains(key)) {
            Ok((due, next)) if due.is_empty() => until(next, now),
            Ok((due, _)) => match fire(&writer, &metrics, due, now).await {
                Fired::Done(keys) => {
                    fired.extend(keys);
                    Duration::ZERO
                }
                Fired::Failed(keys, error) => {
                    fired.extend(keys);
                    tracing::error!(%error, "cannot fire timers; will retry");
                    RETRY_PAUSE
                }
                Fired::WriterStopped => break,
            },
            Err(e) => {
                tracing::error!(error = %e, "cannot read timers; will retry");
                RETRY_PAUSE
            }
        };
        if wait.is_zero() {
            continue;
        }
        let ms = Millis::try_from(wait.as_millis()).unwrap_or(Millis::MAX);
        wakeup.sleeping_until(now.saturating_add(ms));
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = wakeup.notified() => {}
            changed = stop.changed() => if changed.is_err() { break },
        }
    }
    tracing::info!(in_flight = fired.len(), "timer firer stopped");
}

/// How long to sleep until `next` (or [`MAX_SLEEP`] without one).
fn until(next: Option<Millis>, now: Millis) -> Duration {
    next.map_or(MAX_SLEEP, |at| {
        let ms = u64::try_from(at.saturating_sub(now)).unwrap_or(0);
        Duration::from_millis(ms).min(MAX_SLEEP)
    })
}

enum Fired {
    /// The keys handed over (new or duplicate: either way stored).
    Done(Vec<TimerKey>),
    /// Some were handed over, the others failed and will be fired again.
    Failed(Vec<TimerKey>, WriterError),
    WriterStopped,
}

/// Hand due timers to the writer as events, all at once so they share its syncs.
async fn fire(writer: &Writer, metrics: &Metrics, due: Vec<DueTimer>, now: Millis) -> Fired {
    let mut done = Vec::with_capacity(due.len());
    let mut jobs = Vec::with_capacity(due.len());
    for timer in due {
        let bot = match timer.bot_id.as_str() {
            "" => NO_BOT,
            bot => bot,
        };
        match model::webhook::timer_event(&timer.firing, bot) {
            Ok(event) => {
                let job = AcceptJob {
                    delivery: DeliveryId::new(event.event.id.as_str()),
                    events: vec![event],
                    invalid: Vec::new(),
                    received_at: now,
                };
                jobs.push((timer, job));
            }
            Err(e) => {
                // Cannot happen for a timer a rule started (its name was checked at load); kept
                // out of later passes so it is logged once.
                tracing::error!(error = %e, conversation_id = %timer.firing.conversation_id, "timer cannot fire");
                done.push(timer.key);
            }
        }
    }
    let handed = futures_util::future::join_all(jobs.into_iter().map(|(timer, job)| async move {
        let result = writer.accept(job).await;
        (timer, result)
    }))
    .await;
    let mut failed = None;
    for (timer, result) in handed {
        match result {
            Ok(accepted) => {
                // A duplicate was fired before a restart and is stored already.
                if !accepted.new.is_empty() {
                    metrics.timers_fired.inc();
                    tracing::debug!(
                        conversation_id = %timer.firing.conversation_id,
                        timer = %timer.firing.name,
                        due_at = timer.firing.due_at,
                        late_ms = now.saturating_sub(timer.firing.due_at),
                        "timer fired"
                    );
                }
                done.push(timer.key);
            }
            Err(WriterError::Stopped) => return Fired::WriterStopped,
            Err(e) => failed = Some(e),
        }
    }
    match failed {
        None => Fired::Done(done),
        Some(e) => Fired::Failed(done, e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use storage::writer::WriterHooks;
    use storage::NewEvent;
    use tokio::sync::mpsc;

    struct Setup {
        _dir: tempfile::TempDir,
        store: Store,
        /// The backend under `store`, for what tests read beside the port.
        backend: storage::SledStore,
        writer: Writer,
        durable: mpsc::UnboundedReceiver<NewEvent>,
        rules: engine::rules::RuleSet,
    }

    /// A store with a writer whose newly durable events come out of `durable`, and rules that
    /// start timer `t<text>` after `<text>` for a user message `<text>` ("50ms", "1h"...).
    fn setup() -> Setup {
        let dir = tempfile::tempdir().expect("tempdir");
        let store =
            storage::SledStore::open(&dir.path().join("store"), 8 * 1024 * 1024).expect("open");
        let (tx, durable) = mpsc::unbounded_channel();
        let hooks = WriterHooks {
            observe: Box::new(|_, _| {}),
            durable: Box::new(move |events, _| {
                for e in events {
                    let _ = tx.send(e);
                }
            }),
        };
        let stuck = storage::Stuck::new().0;
        let writer =
            storage::writer::SledWriter::start(store.clone(), hooks, stuck).expect("writer");
        let (backend, store): (_, Store) = (store.clone(), std::sync::Arc::new(store));
        let rule = |after: &str| {
            format!(
                "[[rule]]\nname = \"t{after}\"\non = [\"bot.message.received\"]\n\
                 when = {{ field = \"message.data.text\", equals = \"{after}\" }}\n\
                 actions = [{{ type = \"start_timer\", name = \"t{after}\", after = \"{after}\" }}]\n"
            )
        };
        let text = [rule("1ms"), rule("50ms"), rule("1h")].concat();
        let rules =
            engine::rules::RuleSet::from_sources(&[("t.toml".into(), text)]).expect("rules");
        Setup {
            _dir: dir,
            store,
            backend,
            writer,
            durable,
            rules,
        }
    }

    /// A user message through the writer, folded with the rules once it is durable.
    async fn say(s: &mut Setup, n: u32, text: &str) {
        let body = format!(
            r#"{{"id":"d{n}","webhookId":"w","webhookUrl":"u","messages":[{{"id":"e{n}","event":"bot.message.received","sourceType":"bot","sourceId":"B1","timestamp":1,
            "data":{{"message":{{"id":"m{n}","conversationId":"c1","isUser":true,"meta":null,"data":{{"type":"text","text":"{text}"}}}}}}}}]}}"#
        );
        let parsed = model::webhook::parse_delivery(body.as_bytes()).expect("delivery");
        let job = AcceptJob {
            delivery: parsed.id,
            events: parsed.events,
            invalid: Vec::new(),
            received_at: 1,
        };
        s.writer.accept(job).await.expect("accepted");
        let new = next_durable(s).await;
        fold(s, new);
    }

    fn fold(s: &Setup, new: NewEvent) {
        let received = [new.received_at];
        s.backend
            .apply_with(&[(new.seq, new.event)], &s.rules, &received)
            .expect("fold");
    }

    /// The next newly durable event; a deadline well under the firer's longest sleep, so a
    /// firer that missed its wake-up fails the test.
    async fn next_durable(s: &mut Setup) -> NewEvent {
        tokio::time::timeout(Duration::from_secs(20), s.durable.recv())
            .await
            .expect("an event within the deadline")
            .expect("writer running")
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn due_timers_fire_through_the_writer_and_a_new_timer_wakes_the_firer() {
        let mut s = setup();
        let metrics = Metrics::new().expect("metrics");
        let (stop_tx, stop) = watch::channel(false);
        let terms = crate::cluster::Terms::single(&stop);
        let firer = start(s.store.clone(), s.writer.clone(), metrics.clone(), terms);
        say(&mut s, 1, "1ms").await;
        let first = next_durable(&mut s).await;
        assert_eq!(first.event.kind.as_str(), "timer.t1ms");
        let due = match &first.event.payload {
            model::webhook::model::Payload::Timer(t) => t.due_at,
            other => panic!("not a timer: {other:?}"),
        };
        assert_eq!(first.event.id.as_str(), format!("timer:c1:t1ms:{due}"));
        assert_eq!(
            first.partition,
            model::ids::PartitionKey::Conversation("c1".into())
        );
        // Stored like a delivery: in the inbox, readable back from the log.
        let stored = s
            .backend
            .event(first.seq)
            .expect("read")
            .expect("in the inbox");
        let back = model::webhook::parse_event(stored.event.get()).expect("parses");
        assert_eq!(back.id, first.event.id);
        fold(&s, first);
        assert_eq!(
            s.store.timers_pending().expect("timers"),
            0,
            "the fold removed its key"
        );

        // The firer now sleeps with nothing due; a timer started meanwhile wakes it.
        say(&mut s, 2, "50ms").await;
        let second = next_durable(&mut s).await;
        assert_eq!(second.event.kind.as_str(), "timer.t50ms");
        // Counted when the firer has the writer's answer, which may come after the event is
        // indexed (the hook above): wait for it, bounded.
        let counted = async {
            while metrics.timers_fired.get() < 2 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(20), counted)
            .await
            .expect("the second firing is counted");
        assert_eq!(metrics.timers_fired.get(), 2);

        // A timer not due yet stays, and so does a fired one until its firing is folded;
        // stopping the firer leaves them for the next start.
        say(&mut s, 3, "1h").await;
        stop_tx.send(true).expect("stop");
        tokio::time::timeout(Duration::from_secs(20), firer)
            .await
            .expect("stops")
            .expect("joins");
        let (due, next) = s
            .store
            .due_timers(model::webhook::model::Millis::MAX, 10, &|_| false)
            .expect("timers");
        let names: Vec<&str> = due.iter().map(|t| t.firing.name.as_str()).collect();
        assert_eq!((names, next), (vec!["t50ms", "t1h"], None));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn firing_again_before_the_fold_is_a_duplicate_and_not_counted() {
        let mut s = setup();
        let metrics = Metrics::new().expect("metrics");
        say(&mut s, 1, "1h").await;
        let now = model::webhook::model::Millis::MAX;
        let (due, _) = s.store.due_timers(now, 10, &|_| false).expect("timers");
        assert_eq!(due.len(), 1);
        let key = due[0].key.clone();
        for round in 0..2 {
            match fire(&s.writer, &metrics, due.clone(), now).await {
                Fired::Done(keys) => assert_eq!(keys, std::slice::from_ref(&key), "round {round}"),
                _ => panic!("round {round}: not handed over"),
            }
        }
        assert_eq!(metrics.timers_fired.get(), 1);
        // Everything accepted before the flush was handed on: one event, not two.
        s.writer.flush().await.expect("flush");
        let firing = s.durable.try_recv().expect("the first firing");
        assert_eq!(firing.event.kind.timer_name(), Some("t1h"));
        assert!(s.durable.try_recv().is_err(), "the second was a duplicate");
        assert!(s.store.has_timer(&key).expect("read"), "until its fold");
    }

    #[test]
    fn the_firer_sleeps_until_the_next_due_time_at_most_a_minute() {
        assert_eq!(until(Some(1_500), 1_000), Duration::from_millis(500));
        assert_eq!(until(Some(900), 1_000), Duration::ZERO);
        assert_eq!(until(None, 1_000), MAX_SLEEP);
        assert_eq!(until(Some(i64::MAX), i64::MIN), MAX_SLEEP);
    }
}
