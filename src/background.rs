//! CPU priority for the fold, which runs after an acknowledgment.
//!
//! On 2 cores the fold competes with the HTTP workers and the syncer for the CPU, and every
//! millisecond it takes from those lengthens an acknowledgment. The fold is not on that path (the
//! event log makes a delivery durable; the inbox absorbs a burst), so it runs at a higher nice
//! value: under contention the scheduler gives intake the CPU, and the backlog is folded as soon as
//! it lets go. A nice value still gets a share of a contended CPU (nice 10 about a tenth against
//! nice 0, nice 19 about a seventieth) and all of an idle one. The indexer stays at the daemon's
//! priority: until it has indexed a group, the group's typed events wait in memory. The default
//! (`dispatch.fold_niceness = 19`) measured best once nothing on the acknowledgment path waited
//! for sled's lock any more (docs/benchmarks.md, session 8).

use thread_priority::{ThreadPriority, ThreadPriorityValue};

/// The highest nice value Linux has.
pub const MAX_NICENESS: u8 = 19;

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
    let after_name = &stat[stat.rfind(')')? + 1..];
    // Fields 3.. follow the name; nice is field 19, the 17th of those.
    after_name.split_whitespace().nth(16)?.parse().ok()
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
    fn the_nice_field_is_read_past_a_name_with_spaces_and_parentheses() {
        let line = "42 (a (b) c) S 1 42 42 0 -1 4194560 100 0 0 0 5 3 0 0 20 9 4 0 100 0 0";
        assert_eq!(niceness_in_stat(line), Some(9));
    }
}
