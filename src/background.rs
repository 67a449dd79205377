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
//!   acknowledgment of about 1.7 ms. Measured on 2 cores: see docs/benchmarks-history.md, session 11.
//! - [`Priority::Nice`]: a nice value, which still gets a share of a contended CPU (nice 19 about
//!   a seventieth against nice 0). For a host that other programs keep busy: the fold then keeps
//!   some pace instead of waiting for idle time that never comes.
//!
//! Threads inherit their creator's scheduling. Sled starts its I/O threads and its log flusher
//! from the thread that opens the store (or first writes its log), so the daemon opens it on a
//! thread at the fold's priority ([`on_thread_at`]). Under a burst sled may start more I/O
//! threads from whichever thread writes; those keep that thread's priority. Nothing idle holds
//! sled's global lock exclusively: a fold writes with plain inserts through its journal
//! (`store::journal`), not a transaction. Idle threads do hold it shared (a fold's reads and
//! writes, sled's log flusher), and a transaction waiting for it, with the readers queued behind
//! that transaction, waits while such a thread waits for a CPU; so does a log write whose buffer
//! holds an idle fold's unfinished insert, and a `Db::flush` waiting for it: moments, while the
//! daemon is the only load, and at most `dispatch.lift_after` on a busy host (the fold is then
//! lifted). The writer, syncer
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

/// Threads under `SCHED_IDLE` that another thread can lift to the daemon's own scheduling while
/// they starve, and put back afterwards: the fold threads (`dispatch` lifts them when a fold
/// waits longer than `dispatch.lift_after` for a CPU, and lowers them once the inbox is empty).
///
/// Under `SCHED_IDLE` a thread gets a CPU only when nothing else wants it, which is what keeps
/// the fold off intake's CPU during a burst. On a host whose other programs keep every CPU busy
/// it gets almost none, and it holds the fold lock while it waits, so every handoff waits with
/// it. Lifting it is the way out; sled's I/O threads are left as they are (they are sled's,
/// and measured, the fold is what starves handoffs).
///
/// Leaving `SCHED_IDLE` needs `CAP_SYS_NICE` or an `RLIMIT_NICE` that allows nice 0 (systemd:
/// `LimitNICE=+0`); [`can_lift_from_idle`] finds out once, at start.
#[derive(Debug, Default)]
pub struct Lift {
    threads: std::sync::Mutex<Vec<thread_priority::unix::ThreadId>>,
    lifted: std::sync::atomic::AtomicBool,
}

impl Lift {
    /// Register the calling thread (a fold thread, from its start handler).
    pub fn register_this_thread(&self) {
        let id = thread_priority::unix::thread_native_id();
        match self.threads.lock() {
            Ok(mut threads) => threads.push(id),
            Err(poisoned) => poisoned.into_inner().push(id),
        }
    }

    /// Whether the threads run lifted now.
    pub fn is_lifted(&self) -> bool {
        self.lifted.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Run every registered thread under the normal policy (`SCHED_OTHER`, their nice value 0).
    /// Returns how many were lifted; a failure is logged, never fatal.
    pub fn lift(&self) -> usize {
        let done = self.set_all(NormalThreadSchedulePolicy::Other);
        self.lifted
            .store(true, std::sync::atomic::Ordering::Relaxed);
        done
    }

    /// Put every registered thread back under `SCHED_IDLE`.
    pub fn lower(&self) -> usize {
        let done = self.set_all(NormalThreadSchedulePolicy::Idle);
        self.lifted
            .store(false, std::sync::atomic::Ordering::Relaxed);
        done
    }

    fn set_all(&self, policy: NormalThreadSchedulePolicy) -> usize {
        let threads = match self.threads.lock() {
            Ok(threads) => threads.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        };
        threads
            .into_iter()
            .filter(|id| match set_policy_of(*id, policy) {
                Ok(()) => true,
                Err(e) => {
                    tracing::warn!(error = ?e, ?policy, "cannot change a fold thread's scheduling");
                    false
                }
            })
            .count()
    }
}

use thread_priority::unix::NormalThreadSchedulePolicy;

/// Set another thread's (or this one's) normal policy. The crate sets the policy on `thread`,
/// then the nice value of the *calling* thread: it is given the caller's own, so nothing else
/// changes (a caller whose nice value has no cross-platform value is refused before anything).
fn set_policy_of(
    thread: thread_priority::unix::ThreadId,
    policy: NormalThreadSchedulePolicy,
) -> Result<(), thread_priority::Error> {
    let own = this_thread_niceness().unwrap_or(0);
    let keep = priority_for_nice(own).ok_or(thread_priority::Error::Priority(
        "the calling thread's nice value has no cross-platform value",
    ))?;
    thread_priority::unix::set_thread_priority_and_policy(
        thread,
        keep,
        thread_priority::unix::ThreadSchedulePolicy::Normal(policy),
    )
}

/// Whether this process may take a thread out of `SCHED_IDLE` again (found on a scratch
/// thread, which goes idle and tries to come back).
pub fn can_lift_from_idle() -> bool {
    std::thread::Builder::new()
        .name("lift-probe".into())
        .spawn(|| {
            idle_this_thread();
            set_policy_of(
                thread_priority::unix::thread_native_id(),
                NormalThreadSchedulePolicy::Other,
            )
            .is_ok()
                && thread_priority::unix::thread_schedule_policy().ok()
                    == Some(thread_priority::unix::ThreadSchedulePolicy::Normal(
                        NormalThreadSchedulePolicy::Other,
                    ))
        })
        .ok()
        .and_then(|probe| probe.join().ok())
        .unwrap_or(false)
}

/// The crate takes a 0..=99 cross-platform value (99 highest) and maps it onto nice -20..=19;
/// find the value that lands exactly on `niceness`.
fn priority_for(niceness: u8) -> Option<ThreadPriority> {
    priority_for_nice(i32::from(niceness))
}

/// [`priority_for`] over the whole nice range (-20..=19).
fn priority_for_nice(niceness: i32) -> Option<ThreadPriority> {
    (0u8..=99)
        .filter_map(|v| ThreadPriorityValue::try_from(v).ok())
        .find(|v| niceness_of(u8::from(*v)) == niceness)
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
        for n in 0..=MAX_NICENESS {
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

    /// A thread's scheduling policy, from /proc (the calling process's task `tid`).
    fn policy_of(tid: i32) -> Option<i32> {
        policy_in_stat(&std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).ok()?)
    }

    #[test]
    fn a_registered_idle_thread_is_lifted_by_another_and_put_back() {
        let caller = this_thread_policy().expect("own policy");
        let lift = std::sync::Arc::new(Lift::default());
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let registry = lift.clone();
        let worker = std::thread::spawn(move || {
            idle_this_thread();
            registry.register_this_thread();
            let tid = std::fs::read_link("/proc/thread-self")
                .ok()
                .and_then(|p| p.file_name()?.to_str()?.parse::<i32>().ok())
                .expect("own tid");
            ready_tx.send(tid).expect("ready");
            let _ = done_rx.recv();
        });
        let tid = ready_rx.recv().expect("tid");
        assert_eq!(policy_of(tid), Some(SCHED_IDLE_POLICY));
        if can_lift_from_idle() {
            assert_eq!(lift.lift(), 1);
            assert!(lift.is_lifted());
            assert_eq!(policy_of(tid), Some(0), "SCHED_OTHER after the lift");
        } else {
            // Without CAP_SYS_NICE or RLIMIT_NICE the kernel refuses: nothing changes.
            assert_eq!(lift.lift(), 0);
            assert_eq!(policy_of(tid), Some(SCHED_IDLE_POLICY));
        }
        assert_eq!(
            lift.lower(),
            1,
            "going back under SCHED_IDLE is always allowed"
        );
        assert!(!lift.is_lifted());
        assert_eq!(policy_of(tid), Some(SCHED_IDLE_POLICY));
        // The caller's own scheduling is untouched by either.
        assert_eq!(this_thread_policy(), Some(caller));
        done_tx.send(()).expect("done");
        worker.join().expect("worker");
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
