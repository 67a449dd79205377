//! Every sled key and tree name the bridge uses. No other module builds keys.

/// Tree names. Changing one is a data migration.
pub mod tree {
    /// Layouts 1 and 2 (kept read-only after the upgrade until past the dedupe window; layout 3
    /// indexes the event log's ids in memory): event id -> its sequence number (8 bytes) and where
    /// its frame is in the event log ([`LogPosition`](super::super::eventlog::LogPosition), 16 bytes).
    /// Layout 1 had the sequence number only.
    pub const SEEN: &str = "seen/v1";
    /// Layouts 1 and 2 (like `SEEN`): delivery id -> receive time.
    pub const DELIVERIES: &str = "deliveries/v1";
    /// Layout 1 only: sequence number -> event record. Layout 2 keeps the bodies in the event
    /// log (`eventlog`); opening a layout-1 store moves them there and drops this tree.
    pub const LEGACY_EVENTS: &str = "events/v1";
    /// Layouts 1 to 3: sequence number -> where the event's frame is (16 bytes) and its
    /// partition key, for events not yet folded into state (layout 1 had the partition key
    /// only). Layout 4 reads it once to migrate, then drops it: the event log and `FOLDED` say
    /// the same without two sled writes per event.
    pub const INBOX: &str = "inbox/v1";
    /// Since layout 4: partition key (text form) -> the sequence number of the partition's last
    /// folded event (u64 BE). A partition's events are folded in order, so an event is still to
    /// fold exactly when its number is above its partition's mark. Only folds write it.
    pub const FOLDED: &str = "folded/v1";
    pub const CONVERSATIONS: &str = "conversations/v1";
    pub const END_USERS: &str = "end_users/v1";
    /// (platform, userKey) -> end user id.
    pub const USER_INDEX: &str = "user_index/v1";
    pub const BOTS: &str = "bots/v1";
    /// quarantine id -> quarantined delivery or event.
    pub const QUARANTINE: &str = "quarantine/v1";
    /// quarantine id + chunk index (u32 BE) -> a part of a large record's body (its base64
    /// text), written before the record (see `SledStore::quarantine`).
    pub const QUARANTINE_BODIES: &str = "quarantine_bodies/v1";
    /// sequence number -> decided action not yet carried out.
    pub const OUTBOX: &str = "outbox/v1";
    /// sequence number (as in the outbox) -> action that failed for good.
    pub const DEAD_LETTERS: &str = "dead_letters/v1";
    /// sequence number (as in the outbox) -> why a pending entry waits ([`RetryState`]): written
    /// after each failed attempt, removed with the entry's outcome.
    ///
    /// [`RetryState`]: model::action::RetryState
    pub const OUTBOX_RETRY: &str = "outbox_retry/v1";
    /// action id -> its status (pending, done, dead, dropped): every decided action.
    pub const ACTIONS: &str = "actions/v1";
    /// sequence number (as in the outbox) -> finished entry (done or dropped), for the audit
    /// window.
    pub const DONE: &str = "done/v1";
    /// (due time, conversation id, timer name) -> what firing it needs (JSON): every running rule
    /// timer, earliest due first. Equal to the conversation states' `timers`: only the fold
    /// writes it, in the transaction that writes those states.
    pub const TIMERS: &str = "timers/v1";
    /// The waiting queue: `w` (bot, requested at, conversation id) -> nothing, every conversation
    /// waiting for an agent, per bot in request order; `h` bot -> its recent accepts (JSON
    /// [`AcceptHistory`](engine::state::queue::AcceptHistory)). Equal to the conversation states
    /// (`state::queue::waiting_since`): only the fold writes it, in the journal that writes
    /// those states. Also the reconciliation sweeper's index (`a` active, `r` released: see
    /// `store::watch`), and the agent API's phase index (`p` by phase, `b` by bot and phase: see
    /// `store::desk`), kept the same way. And the handoff figures: `s` + hour -> that hour's
    /// [`HandoffStats`](engine::state::stats::HandoffStats) (JSON), added to by the folds in
    /// their journal (see `store::queue`), pruned after `engine::state::stats::KEPT_MS`.
    pub const QUEUE: &str = "queue/v1";
    /// The retention index: `c` (newest activity time, conversation id) and `u` (newest activity
    /// time, end user id) -> nothing, oldest first (see `store::retention`), so a pruning pass
    /// reads the states past `store.state_retention` as a range. Equal to the states: only the
    /// fold writes it (and the pass that prunes a state removes its key), in the journal that
    /// writes those states.
    pub const ACTIVITY: &str = "activity/v1";
    /// The event log by partition: segment, partition key, sequence number ([`partition_event`])
    /// -> the offset of the event's frame in its segment (u64 BE). Written by the folds in their
    /// journal for each event they fold or pass over; a segment's keys are one range, read only
    /// while the segment exists and removed after it (see `store::history`).
    pub const PARTITION_EVENTS: &str = "partition_events/v1";
    /// Bookkeeping: layout version, prune cursor.
    pub const META: &str = "meta";
    /// The desks' mappings (`storage::desk_links`).
    pub const DESK_LINKS: &str = "desk_links/v1";
}

/// A desk mapping's key (`storage::desk_links`): its kind, connector and id, NUL-separated.
pub fn desk_link(kind: u8, connector: &str, id: &str) -> Vec<u8> {
    [&[kind, 0][..], connector.as_bytes(), &[0], id.as_bytes()].concat()
}

/// A quarantine body's chunk: the record's id (as [`seq`]) and the chunk's index (u32 BE).
pub fn quarantine_chunk(id: u64, index: u32) -> Vec<u8> {
    let mut key = seq(id).to_vec();
    key.extend_from_slice(&index.to_be_bytes());
    key
}

pub mod meta {
    pub const LAYOUT_VERSION: &[u8] = b"layout_version";
    /// Layout 1: the sequence number of the last event whose dedupe record was pruned.
    pub const LEGACY_DEDUPE_PRUNED_THROUGH: &[u8] = b"dedupe_pruned_through";
    /// Since layout 3: the first event log segment whose ids are in the dedupe window (a
    /// location at the start of that segment; layout 2 kept a frame's location).
    pub const DEDUPE_PRUNED_TO: &[u8] = b"dedupe_pruned_to";
    /// When a store of layout 1 or 2 was opened as layout 3 (u64 BE millis): its sled dedupe
    /// trees are kept until that is past the dedupe window.
    pub const LEGACY_DEDUPE_SINCE: &[u8] = b"legacy_dedupe_since";
    /// Layout 1 -> 3 migration in progress: where the event log ended before the old intake
    /// log's deliveries were appended (a rerun after a crash keeps the first run's value).
    pub const LEGACY_WAL_FROM: &[u8] = b"legacy_wal_from";
    /// Every event log frame before this location was acknowledged and handed on (layouts 1 to
    /// 3: indexed into the inbox). Damage before it is not a torn write (`eventlog::check_tail`).
    pub const INDEXED_TO: &[u8] = b"event_log_indexed_to";
    /// Since layout 4: a location at or before every event still to fold; a start scans the log
    /// from here against `FOLDED`. Written by the folds (conservatively: it may lag, never lead).
    pub const FOLD_FROM: &[u8] = b"fold_from";
    /// The highest event sequence number handed on so far (u64 BE), written just before
    /// `INDEXED_TO`: a start numbers new events above it (see `SledStore::next_seq`).
    pub const SEQ_FLOOR: &[u8] = b"event_seq_floor";
    /// A fold's writes while it applies them (see `store::journal`): present after a crash
    /// only if the fold was not all applied, and then applied on open.
    pub const FOLD_JOURNAL: &[u8] = b"fold_journal";
    /// Record counts of the state trees (u64 BE), kept by the folds.
    pub const COUNT_CONVERSATIONS: &[u8] = b"count/conversations";
    pub const COUNT_END_USERS: &[u8] = b"count/end_users";
    pub const COUNT_BOTS: &[u8] = b"count/bots";
    /// Set once the waiting queue (`queue/v1`) was built from the states (a store from before
    /// the queue existed gets its waiting conversations indexed on its first open).
    pub const QUEUE_INDEXED: &[u8] = b"queue_indexed";
    /// Set once the reconciliation index (in `queue/v1`) was built from the states.
    pub const WATCH_INDEXED: &[u8] = b"watch_indexed";
    /// Set once the retention index (`activity/v1`) was built from the states.
    pub const ACTIVITY_INDEXED: &[u8] = b"activity_indexed";
    /// Set once the agent API's phase index (in `queue/v1`) was built from the states.
    pub const DESK_INDEXED: &[u8] = b"desk_indexed";
    /// Set once the event log was indexed by partition (`partition_events/v1`): a store from
    /// before that index gets its logged events indexed on its first open.
    pub const PARTITION_EVENTS_INDEXED: &[u8] = b"partition_events_indexed";
    /// When the daemon last opened the store (u64 BE millis; see `SledStore::start_background`).
    pub const OPENED_AT: &[u8] = b"opened_at";
    /// Backfill's cursor (u64 BE millis, the daemon's clock): the service's events up to it are
    /// known to the bridge (delivered by the webhook or backfilled). Written by backfill only.
    pub const BACKFILL_CURSOR: &[u8] = b"backfill_cursor";
    /// The lease's epoch (u64 BE): how many times the daemon claimed it, once per open (see
    /// `lease`: one process holds a sled store, so its lease is always its own).
    pub const LEASE_EPOCH: &[u8] = b"lease_epoch";
}

/// A dedupe record's value: the sequence number, then the event's frame location.
pub fn seen_value(seq: u64, at: super::eventlog::LogPosition) -> [u8; 24] {
    let mut out = [0; 24];
    out[..8].copy_from_slice(&seq.to_be_bytes());
    out[8..].copy_from_slice(&at.encode());
    out
}

/// The sequence number and (layout 2) location of a dedupe record.
pub fn parse_seen(bytes: &[u8]) -> Option<(u64, Option<super::eventlog::LogPosition>)> {
    let seq = parse_seq(bytes.get(..8)?)?;
    Some((
        seq,
        bytes
            .get(8..)
            .and_then(super::eventlog::LogPosition::decode),
    ))
}

/// An inbox entry's value: the event's frame location, then its partition key.
pub fn inbox_value(at: super::eventlog::LogPosition, partition: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(16 + partition.len());
    out.extend_from_slice(&at.encode());
    out.extend_from_slice(partition.as_bytes());
    out
}

/// The location and partition key of an inbox entry.
pub fn parse_inbox(bytes: &[u8]) -> Option<(super::eventlog::LogPosition, &str)> {
    let at = super::eventlog::LogPosition::decode(bytes)?;
    let partition = std::str::from_utf8(bytes.get(16..)?).ok()?;
    Some((at, partition))
}

/// Sequence numbers are big-endian so sled's byte order is numeric order.
pub fn seq(n: u64) -> [u8; 8] {
    n.to_be_bytes()
}

pub fn parse_seq(bytes: &[u8]) -> Option<u64> {
    Some(u64::from_be_bytes(bytes.try_into().ok()?))
}

/// A [`tree::PARTITION_EVENTS`] key: [`partition_events`]'s prefix, then the sequence number
/// (big-endian, so a partition's events in a segment sort in log order).
pub fn partition_event(segment: u64, partition: &str, seq: u64) -> Vec<u8> {
    let mut key = partition_events(segment, partition);
    key.extend_from_slice(&seq.to_be_bytes());
    key
}

/// The prefix of a partition's [`tree::PARTITION_EVENTS`] keys in one event log segment: the
/// segment's number (8 bytes, big-endian, so a segment's keys are one range), the partition key's
/// length (4 bytes), then the key, so no partition's prefix is another's.
pub fn partition_events(segment: u64, partition: &str) -> Vec<u8> {
    let mut key = Vec::with_capacity(20 + partition.len());
    let len = u32::try_from(partition.len()).unwrap_or(u32::MAX);
    key.extend_from_slice(&segment.to_be_bytes());
    key.extend_from_slice(&len.to_be_bytes());
    key.extend_from_slice(partition.as_bytes());
    key
}

/// The sequence number of a [`partition_event`] key.
pub fn parse_partition_event(key: &[u8]) -> Option<u64> {
    parse_seq(key.get(key.len().checked_sub(8)?..)?)
}

/// `(platform, userKey)`: the platform is length-prefixed so no user key can forge another
/// platform's entry.
pub fn user_index(platform: &str, user_key: &str) -> Vec<u8> {
    let mut key = Vec::with_capacity(2 + platform.len() + user_key.len());
    let len = u16::try_from(platform.len()).unwrap_or(u16::MAX);
    key.extend_from_slice(&len.to_be_bytes());
    key.extend_from_slice(&platform.as_bytes()[..usize::from(len)]);
    key.extend_from_slice(user_key.as_bytes());
    key
}

/// A timer's key: its due time (8 bytes, big-endian, so the earliest sorts first), the
/// conversation id, a 0 byte, the name. Names never hold a 0 byte, so the last one ends the
/// conversation id whatever it holds. A due time before 1970 counts as 0.
pub fn timer(due_at: i64, conversation: &str, name: &str) -> Vec<u8> {
    let mut key = Vec::with_capacity(9 + conversation.len() + name.len());
    key.extend_from_slice(&u64::try_from(due_at).unwrap_or(0).to_be_bytes());
    key.extend_from_slice(conversation.as_bytes());
    key.push(0);
    key.extend_from_slice(name.as_bytes());
    key
}

/// The due time, conversation id and name of a timer key.
pub fn parse_timer(key: &[u8]) -> Option<(i64, &str, &str)> {
    let due = i64::try_from(parse_seq(key.get(..8)?)?).ok()?;
    let rest = key.get(8..)?;
    let split = rest.iter().rposition(|b| *b == 0)?;
    let conversation = std::str::from_utf8(rest.get(..split)?).ok()?;
    let name = std::str::from_utf8(rest.get(split + 1..)?).ok()?;
    Some((due, conversation, name))
}

/// The prefix of a bot's waiting entries: `w`, the bot id's length (2 bytes), the bot id; so no
/// bot id is a prefix of another's entries.
pub fn queue_bot(bot: &str) -> Vec<u8> {
    let len = u16::try_from(bot.len()).unwrap_or(u16::MAX);
    let mut key = Vec::with_capacity(3 + bot.len());
    key.push(QUEUE_WAITING);
    key.extend_from_slice(&len.to_be_bytes());
    key.extend_from_slice(&bot.as_bytes()[..usize::from(len)]);
    key
}

/// A waiting conversation's key: its bot's prefix, the request time (8 bytes, big-endian, before
/// 1970 as 0), the conversation id; so a bot's entries sort by request time, then id.
pub fn queue_entry(bot: &str, requested_at: i64, conversation: &str) -> Vec<u8> {
    let mut key = Vec::new();
    queue_entry_into(&mut key, &queue_bot(bot), requested_at, conversation);
    key
}

/// [`queue_entry`] into `key` (cleared first), given its bot's prefix ([`queue_bot`]): one buffer
/// for many keys.
pub fn queue_entry_into(key: &mut Vec<u8>, prefix: &[u8], requested_at: i64, conversation: &str) {
    key.clear();
    key.extend_from_slice(prefix);
    key.extend_from_slice(&u64::try_from(requested_at).unwrap_or(0).to_be_bytes());
    key.extend_from_slice(conversation.as_bytes());
}

/// The conversation id of a waiting entry of the bot whose prefix is `prefix`.
pub fn parse_queue_entry<'a>(prefix: &[u8], key: &'a [u8]) -> Option<&'a str> {
    std::str::from_utf8(key.get(prefix.len() + 8..)?).ok()
}

/// The bot's prefix ([`queue_bot`]) of any bot's waiting entry, read from the key itself.
pub fn queue_bot_of(key: &[u8]) -> Option<&[u8]> {
    let len = usize::from(u16::from_be_bytes([*key.get(1)?, *key.get(2)?]));
    key.get(..3 + len)
}

/// The request time of any bot's waiting entry (the bot's prefix read from the key itself).
pub fn parse_queue_requested_at(key: &[u8]) -> Option<i64> {
    let prefix = queue_bot_of(key)?.len();
    let at = key.get(prefix..prefix + 8)?;
    let at = u64::from_be_bytes(at.try_into().ok()?);
    i64::try_from(at).ok()
}

/// The first byte of every waiting entry's key (accept histories start with `h`).
pub const QUEUE_WAITING: u8 = b'w';

/// A bot's accept history key.
pub fn queue_history(bot: &str) -> Vec<u8> {
    let mut key = Vec::with_capacity(1 + bot.len());
    key.push(b'h');
    key.extend_from_slice(bot.as_bytes());
    key
}

/// The first byte of the handoff figures' hour records (in `queue/v1`; see `store::queue`).
pub const QUEUE_STATS: u8 = b's';

/// An hour record's key: `s`, then the hour's start (ms, 8 bytes, big-endian, before 1970 as 0),
/// so the hours sort in time order and a window is a range.
pub fn queue_stats(hour: i64) -> [u8; 9] {
    let mut key = [QUEUE_STATS; 9];
    key[1..].copy_from_slice(&u64::try_from(hour).unwrap_or(0).to_be_bytes());
    key
}

/// The hour of an hour record's key.
pub fn parse_queue_stats(key: &[u8]) -> Option<i64> {
    let rest = key.strip_prefix(&[QUEUE_STATS])?;
    i64::try_from(u64::from_be_bytes(rest.try_into().ok()?)).ok()
}

/// The first byte of the reconciliation index's active entries (in `queue/v1`; see
/// `store::watch`): `a` + conversation id.
pub const WATCH_ACTIVE: u8 = b'a';
/// The first byte of its released entries: `r` + the release time (8 bytes, big-endian, before
/// 1970 as 0) + conversation id, so the recently released are a range.
pub const WATCH_RELEASED: u8 = b'r';

/// An active conversation's index key.
pub fn watch_active(conversation: &str) -> Vec<u8> {
    let mut key = Vec::with_capacity(1 + conversation.len());
    key.push(WATCH_ACTIVE);
    key.extend_from_slice(conversation.as_bytes());
    key
}

/// A released conversation's index key.
pub fn watch_released(at: i64, conversation: &str) -> Vec<u8> {
    let mut key = Vec::with_capacity(9 + conversation.len());
    key.push(WATCH_RELEASED);
    key.extend_from_slice(&u64::try_from(at).unwrap_or(0).to_be_bytes());
    key.extend_from_slice(conversation.as_bytes());
    key
}

/// The conversation id of an active entry.
pub fn parse_watch_active(key: &[u8]) -> Option<&str> {
    key.strip_prefix(&[WATCH_ACTIVE])
        .and_then(|id| std::str::from_utf8(id).ok())
}

/// The release time and conversation id of a released entry.
pub fn parse_watch_released(key: &[u8]) -> Option<(i64, &str)> {
    let rest = key.strip_prefix(&[WATCH_RELEASED])?;
    let at = u64::from_be_bytes(rest.get(..8)?.try_into().ok()?);
    let id = std::str::from_utf8(rest.get(8..)?).ok()?;
    Some((i64::try_from(at).ok()?, id))
}

/// The first byte of a conversation's key in the retention index (`activity/v1`).
pub const ACTIVITY_CONVERSATION: u8 = b'c';
/// The first byte of an end user's key there.
pub const ACTIVITY_END_USER: u8 = b'u';

/// A key of the retention index: `kind` (a conversation's or an end user's), the newest activity
/// time (8 bytes, big-endian, before 1970 as 0), the id; so each kind's keys sort oldest first.
pub fn activity(kind: u8, at: i64, id: &str) -> Vec<u8> {
    let mut key = Vec::with_capacity(9 + id.len());
    key.push(kind);
    key.extend_from_slice(&u64::try_from(at).unwrap_or(0).to_be_bytes());
    key.extend_from_slice(id.as_bytes());
    key
}

/// The kind, activity time and id of a retention index key.
pub fn parse_activity(key: &[u8]) -> Option<(u8, i64, &str)> {
    let kind = *key.first()?;
    let at = u64::from_be_bytes(key.get(1..9)?.try_into().ok()?);
    let id = std::str::from_utf8(key.get(9..)?).ok()?;
    Some((kind, i64::try_from(at).ok()?, id))
}

/// The first byte of the agent API's phase index (in `queue/v1`; see `store::desk`): `p`, the
/// phase's byte ([`DeskPhase::byte`](engine::state::desk::DeskPhase::byte)), then the
/// conversation's [`desk_position`]; so a phase's conversations are a prefix, in the order the
/// API lists them.
pub const DESK_PHASE: u8 = b'p';
/// The first byte of its per-bot keys: `b`, the bot id's length (2 bytes), the bot id, the
/// phase's byte, then the [`desk_position`].
pub const DESK_BOT: u8 = b'b';
/// Length of a [`desk_position`]'s time part.
pub const DESK_TIME_LEN: usize = 9;

/// Where a conversation sorts in the agent API's listing: the request time (a byte 0 when there
/// is none, so those sort first; else 1 and the time as 8 bytes, sign bit flipped, big-endian,
/// so every `i64` sorts in order), then the conversation id. It is also what a page's cursor
/// holds.
pub fn desk_position(requested_at: Option<i64>, conversation: &str) -> Vec<u8> {
    let mut key = Vec::with_capacity(DESK_TIME_LEN + conversation.len());
    push_desk_position(&mut key, requested_at, conversation);
    key
}

fn push_desk_position(key: &mut Vec<u8>, requested_at: Option<i64>, conversation: &str) {
    match requested_at {
        None => key.extend_from_slice(&[0; DESK_TIME_LEN]),
        Some(at) => {
            key.push(1);
            key.extend_from_slice(&((at as u64) ^ (1 << 63)).to_be_bytes());
        }
    }
    key.extend_from_slice(conversation.as_bytes());
}

/// The request time and conversation id of a [`desk_position`] (`None` when it is not one).
pub fn parse_desk_position(bytes: &[u8]) -> Option<(Option<i64>, &str)> {
    let time = bytes.get(..DESK_TIME_LEN)?;
    let at = match time[0] {
        0 if time[1..].iter().all(|b| *b == 0) => None,
        1 => Some((u64::from_be_bytes(time[1..].try_into().ok()?) ^ (1 << 63)) as i64),
        _ => return None,
    };
    let id = std::str::from_utf8(bytes.get(DESK_TIME_LEN..)?).ok()?;
    Some((at, id))
}

/// The prefix of a phase's entries in the phase index.
pub fn desk_phase_prefix(phase: u8) -> Vec<u8> {
    vec![DESK_PHASE, phase]
}

/// The prefix of a bot's entries of a phase.
pub fn desk_bot_prefix(bot: &str, phase: u8) -> Vec<u8> {
    let len = u16::try_from(bot.len()).unwrap_or(u16::MAX);
    let mut key = Vec::with_capacity(4 + bot.len());
    key.push(DESK_BOT);
    key.extend_from_slice(&len.to_be_bytes());
    key.extend_from_slice(&bot.as_bytes()[..usize::from(len)]);
    key.push(phase);
    key
}

/// A conversation's key in the phase index.
pub fn desk_phase(phase: u8, requested_at: Option<i64>, conversation: &str) -> Vec<u8> {
    let mut key = desk_phase_prefix(phase);
    push_desk_position(&mut key, requested_at, conversation);
    key
}

/// A conversation's key among its bot's entries of its phase.
pub fn desk_bot(bot: &str, phase: u8, requested_at: Option<i64>, conversation: &str) -> Vec<u8> {
    let mut key = desk_bot_prefix(bot, phase);
    push_desk_position(&mut key, requested_at, conversation);
    key
}

/// The first key after every key that starts with `prefix` (a prefix that ends below 255).
pub fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < u8::MAX {
            end.push(last + 1);
            return end;
        }
    }
    end
}

/// Timer keys due at or before `at` sort before this one.
pub fn timers_after(at: i64) -> [u8; 8] {
    u64::try_from(at.saturating_add(1))
        .unwrap_or(0)
        .to_be_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timer_keys_sort_by_due_time_and_parse_back_whatever_the_conversation_id() {
        assert!(timer(999, "zzz", "a") < timer(1_000, "aaa", "a"));
        assert!(timer(1_000, "c", "z") < timers_after(1_000).to_vec());
        assert!(timers_after(999).to_vec() <= timer(1_000, "c", "a"));
        for conversation in ["c1", "", "a\0b", "c:\0/x\0"] {
            let key = timer(1_763_690_400_000, conversation, "agent-wait");
            assert_eq!(
                parse_timer(&key),
                Some((1_763_690_400_000, conversation, "agent-wait"))
            );
        }
        assert_eq!(parse_timer(b"short"), None);
    }

    #[test]
    fn queue_keys_sort_per_bot_by_request_time_and_parse_back() {
        assert!(queue_entry("b", 999, "zz") < queue_entry("b", 1_000, "aa"));
        assert!(queue_entry("b", 1_000, "a") < queue_entry("b", 1_000, "b"));
        let prefix = queue_bot("b");
        assert!(!queue_entry("bb", 0, "c").starts_with(&prefix));
        assert!(queue_entry("b", -5, "c").starts_with(&prefix));
        assert_eq!(
            parse_queue_entry(&prefix, &queue_entry("b", 7, "c:1")),
            Some("c:1")
        );
        assert_ne!(queue_history("b"), prefix);
        assert_eq!(
            parse_queue_requested_at(&queue_entry("bot-7", 1_763_690_400_000, "c")),
            Some(1_763_690_400_000)
        );
        assert_eq!(parse_queue_requested_at(&queue_bot("bot-7")), None);
    }

    #[test]
    fn hour_record_keys_sort_by_hour_apart_from_every_other_queue_key_and_parse_back() {
        let hour = 3_600_000;
        assert!(queue_stats(5 * hour) < queue_stats(6 * hour));
        assert!(queue_stats(i64::MAX).to_vec() < prefix_end(&[QUEUE_STATS]));
        assert_eq!(queue_stats(-hour), queue_stats(0));
        assert_eq!(parse_queue_stats(&queue_stats(7 * hour)), Some(7 * hour));
        assert_eq!(parse_queue_stats(b"s123"), None);
        assert_eq!(parse_queue_stats(&queue_bot("b")), None);
        for other in [
            QUEUE_WAITING,
            b'h',
            WATCH_ACTIVE,
            WATCH_RELEASED,
            DESK_PHASE,
            DESK_BOT,
        ] {
            assert_ne!(other, QUEUE_STATS);
        }
    }

    #[test]
    fn activity_keys_sort_per_kind_oldest_first_and_parse_back() {
        let c = ACTIVITY_CONVERSATION;
        assert!(activity(c, 999, "zz") < activity(c, 1_000, "aa"));
        assert!(activity(c, i64::MAX, "z") < activity(ACTIVITY_END_USER, 0, ""));
        assert!(activity(c, 1_000, "x") < activity(c, 1_001, ""));
        assert_eq!(activity(c, -5, "a"), activity(c, 0, "a"));
        assert_eq!(
            parse_activity(&activity(ACTIVITY_END_USER, 1_763_690_400_000, "u:1")),
            Some((ACTIVITY_END_USER, 1_763_690_400_000, "u:1"))
        );
        assert_eq!(parse_activity(b"c1234"), None);
    }

    #[test]
    fn desk_keys_sort_by_request_time_missing_first_then_id_and_parse_back() {
        let order = [
            desk_position(None, "b"),
            desk_position(None, "c"),
            desk_position(Some(i64::MIN), "a"),
            desk_position(Some(-5), "a"),
            desk_position(Some(0), "a"),
            desk_position(Some(1_000), "a"),
            desk_position(Some(1_000), "a0"),
            desk_position(Some(i64::MAX), "a"),
        ];
        assert!(order.windows(2).all(|w| w[0] < w[1]));
        for (at, id) in [(None, "c:1"), (Some(-5), ""), (Some(i64::MAX), "x\0y")] {
            assert_eq!(parse_desk_position(&desk_position(at, id)), Some((at, id)));
        }
        assert_eq!(parse_desk_position(b"short"), None);
        assert_eq!(parse_desk_position(&[2; 12]), None);
        assert_eq!(
            parse_desk_position(&[0, 0, 0, 0, 0, 0, 0, 0, 1, b'c']),
            None
        );
        let prefix = desk_bot_prefix("b", b'1');
        assert!(desk_bot("b", b'1', None, "c").starts_with(&prefix));
        assert!(!desk_bot("bb", b'1', None, "c").starts_with(&prefix));
        assert!(desk_bot("b", b'1', Some(i64::MAX), "zz") < prefix_end(&prefix));
        assert!(desk_phase(b'1', None, "c").starts_with(&desk_phase_prefix(b'1')));
        assert_eq!(prefix_end(&[1, 255]), vec![2]);
    }

    #[test]
    fn sequence_keys_sort_numerically() {
        assert!(seq(9) < seq(10));
        assert!(seq(255) < seq(256));
        assert_eq!(parse_seq(&seq(123_456)), Some(123_456));
        assert_eq!(parse_seq(b"short"), None);
    }

    #[test]
    fn user_index_keys_do_not_collide_across_platforms() {
        assert_ne!(user_index("web", "kakaoX"), user_index("webkakao", "X"));
        assert_eq!(user_index("web", "k"), user_index("web", "k"));
    }
}
