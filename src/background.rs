//! CPU priority for the fold, which runs after an acknowledgment.
//!
//! On 2 cores the fold competes with the HTTP workers and the syncer for the CPU, and every
//! millisecond it takes from those lengthens an acknowledgment. The fold is not on that path (the
//! event log makes a delivery durable and is the fold's inbox, so a burst waits there), so its
//! threads, and sled's I/O threads that write what the folds change, run at a lower priority:
//!
//! - [`Priority::Idle`] (the default): Linux's `SCHED_IDLE`. Such a thread gets a CPU only when no
//!   other thread wants it, and a waking HTTP worker takes the CPU from it at once. A nice value
//!   is not enough: the scheduler may let a niced thread that got an idle CPU run out its time
//!   slice (up to about 1.5 ms on 2 cores) before a waking worker gets it, against an
//!   acknowledgment of about 1.7 ms. Measured on 2 cores: see docs/benchmarks.md, session 11.
//! - [`Priority::Nice`]: a nice value, which still gets a share of a contended CPU (nice 19 about
//!   a seventieth against nice 0). For a host that other programs keep busy: the fold then keeps
//!   some pace instead of waiting for idle time that never comes.
//!
//! Threads inherit their creator's scheduling. Sled starts its I/O threads and its log flusher
//! from the thread that opens the store (or first writes its log), so the daemon opens it on a
//! thread at the fold's priority ([`on_thread_at`]). Under a burst sled may start more I/O
//! threads from whichever thread writes; those keep that thread's priority. Nothing idle holds
//! sled's global lock exclusively: the folds' commits run at the daemon's priority
//! (`store::committer`). Idle threads do hold it shared (a fold's reads, sled's log flusher), and
//! a transaction waiting for it, with the readers queued behind that transaction, waits while
//! such a thread waits for a CPU: moments, while the daemon is the only load. The writer, syncer
//! and indexer keep the daemon's priority: until the indexer has indexed a group, the group's
//! typed events wait in memory.

use thread_priority::{ThreadPriority, ThreadPriorityValue};

/// The highest nice value Linux has.
pub const MAX_NICENESS: u8 = 19;

/// How the fold's threads (and sled's I/O threads) are scheduled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Priority {
    /// `SCHED_IDLE` (Linux): only CPU time no other thread wants.
    Idle,
    /// A nice value, 0 (the daemon's own) to 19.
    Nice(u8),
}

impl Priority {
    /// Apply to the calling thread (and so to the threads it starts afterwards). A failure is
    /// logged, never fatal: the daemon is only slower.
    pub fn apply_to_this_thread(self) {
        match self {
            Priority::Idle => idle_this_thread(),
            Priority::Nice(n) => lower_this_thread(n),
        }
    }
}

/// Run `f` on a new thread named `name` at `priority` and wait for its result: threads that `f`
/// starts inherit that priority, the caller keeps its own.
pub fn on_thread_at<T: Send>(
    priority: Priority,
    name: &str,
    f: impl FnOnce() -> T + Send,
) -> std::io::Result<T> {
    std::thread::scope(|scope| {
        let handle = std::thread::Builder::new()
            .name(name.to_owned())
            .spawn_scoped(scope, move || {
                priority.apply_to_this_thread();
                f()
            })?;
        match handle.join() {
            Ok(out) => Ok(out),
            Err(panic) => std::panic::resume_unwind(panic),
        }
    })
}

/// Put the calling thread under `SCHED_IDLE`.
fn idle_this_thread() {
    use thread_priority::unix::{
        set_thread_priority_and_policy, thread_native_id, thread_schedule_policy,
        NormalThreadSchedulePolicy, ThreadSchedulePolicy,
    };
    let idle = ThreadSchedulePolicy::Normal(NormalThreadSchedulePolicy::Idle);
    // The crate also resets the nice value to 0 (meaningless under SCHED_IDLE), which a thread
    // already niced may not do: what counts is whether the policy took.
    let set = set_thread_priority_and_policy(thread_native_id(), ThreadPriority::Min, idle);
    if thread_schedule_policy().ok() != Some(idle) {
        tracing::warn!(error = ?set.err(), "cannot put a background thread under SCHED_IDLE");
    }
}

/// Raise the calling thread's nice value to `niceness` (0 leaves it alone). Threads it spawns
/// afterwards inherit the value. A failure is logged, never fatal: the daemon is only slower.
pub fn lower_this_thread(niceness: u8) {
    if niceness == 0 {
        return;
    }
    let Some(priority) = priority_for(niceness.min(MAX_NICENESS)) else {
        tracing::warn!(niceness, "no thread priority maps to this nice value");
        return;
    };
    if let Err(e) = thread_priority::set_current_thread_priority(priority) {
        tracing::warn!(niceness, error = ?e, "cannot lower a background thread's priority");
    }
}

/// The crate takes a 0..=99 cross-platform value (99 highest) and maps it onto nice -20..=19;
/// find the value that lands exactly on `niceness`.
fn priority_for(niceness: u8) -> Option<ThreadPriority> {
    (0u8..=99)
        .filter_map(|v| ThreadPriorityValue::try_from(v).ok())
        .find(|v| niceness_of(u8::from(*v)) == i32::from(niceness))
        .map(ThreadPriority::Crossplatform)
}

/// The crate's mapping from a cross-platform value to a nice value (its `to_posix` for normal
/// policies), kept here so the search above agrees with what the call will set.
fn niceness_of(value: u8) -> i32 {
    let ratio = 1f32 - (f32::from(value) / 99f32);
    i32::from((39f32 * ratio) as i8) - 20
}

/// The calling thread's nice value, from /proc (Linux only).
pub fn this_thread_niceness() -> Option<i32> {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").ok()?;
    niceness_in_stat(&stat)
}

/// Field 19 of a /proc/<pid>/task/<tid>/stat line (after the parenthesised command name, which
/// may itself contain spaces and parentheses).
pub fn niceness_in_stat(stat: &str) -> Option<i32> {
    stat_field(stat, 19)
}

/// Field `n` (1-based, as in proc(5)) of a stat line, read past the parenthesised command name.
fn stat_field(stat: &str, n: usize) -> Option<i32> {
    let after_name = &stat[stat.rfind(')')? + 1..];
    // Fields 3.. follow the name.
    after_name
        .split_whitespace()
        .nth(n.checked_sub(3)?)?
        .parse()
        .ok()
}

/// `SCHED_IDLE`'s number in field 41 of a /proc stat line.
pub const SCHED_IDLE_POLICY: i32 = 5;

/// Field 41 (the scheduling policy: 0 normal, 5 idle) of a /proc/<pid>/task/<tid>/stat line.
pub fn policy_in_stat(stat: &str) -> Option<i32> {
    stat_field(stat, 41)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_nice_value_from_0_to_19_has_a_priority() {
        for n in 1..=MAX_NICENESS {
            assert!(priority_for(n).is_some(), "nice {n}");
        }
    }

    #[test]
    fn a_thread_gets_the_nice_value_asked_for_and_its_children_inherit_it() {
        // Only raising a nice value is always allowed: ask for values above the test's own.
        let base = this_thread_niceness().expect("nice value of the test thread");
        for n in [1u8, 7, 10, 19]
            .into_iter()
            .filter(|&n| i32::from(n) > base)
        {
            let (own, child) = std::thread::spawn(move || {
                lower_this_thread(n);
                let child = std::thread::spawn(this_thread_niceness)
                    .join()
                    .expect("child");
                (this_thread_niceness(), child)
            })
            .join()
            .expect("thread");
            assert_eq!(own, Some(i32::from(n)), "nice {n}");
            assert_eq!(child, Some(i32::from(n)), "nice {n}, inherited");
        }
        // The test's own thread is untouched.
        assert_eq!(this_thread_niceness(), Some(base));
    }

    /// This thread's scheduling policy, from /proc.
    fn this_thread_policy() -> Option<i32> {
        policy_in_stat(&std::fs::read_to_string("/proc/thread-self/stat").ok()?)
    }

    #[test]
    fn a_thread_started_at_idle_runs_idle_and_so_do_its_children_but_not_the_caller() {
        let caller = this_thread_policy().expect("own policy");
        assert_ne!(
            caller, SCHED_IDLE_POLICY,
            "the test must not run under SCHED_IDLE"
        );
        let (own, child) = on_thread_at(Priority::Idle, "idle-test", || {
            let child = std::thread::spawn(this_thread_policy)
                .join()
                .expect("child");
            (this_thread_policy(), child)
        })
        .expect("thread");
        assert_eq!(own, Some(SCHED_IDLE_POLICY));
        assert_eq!(child, Some(SCHED_IDLE_POLICY), "inherited");
        assert_eq!(this_thread_policy(), Some(caller));
    }

    #[test]
    fn zero_leaves_the_thread_alone() {
        let base = this_thread_niceness();
        let n = std::thread::spawn(|| {
            lower_this_thread(0);
            this_thread_niceness()
        })
        .join()
        .expect("thread");
        assert_eq!(n, base);
    }

    #[test]
    fn the_nice_and_policy_fields_are_read_past_a_name_with_spaces_and_parentheses() {
        // Fields 1-41 as proc(5) numbers them: nice (19) is 9, policy (41) is 5.
        let mut fields: Vec<String> = (3..=52).map(|n| (n * 100).to_string()).collect();
        fields[19 - 3] = "9".into();
        fields[41 - 3] = "5".into();
        let line = format!("42 (a (b) c) {}", fields.join(" "));
        assert_eq!(niceness_in_stat(&line), Some(9));
        assert_eq!(policy_in_stat(&line), Some(5));
        assert_eq!(stat_field(&line, 3), Some(300));
        assert_eq!(stat_field(&line, 2), None);
    }
}
