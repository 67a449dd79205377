//! The events a help desk receives, by kind: their names are the interface with help desks.

/// What happened. The names are the interface with help desks: never rename one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EventKind {
    HandoffRequested,
    HandoffCancelled,
    HandoffTimedOut,
    HandoffConnected,
    HandoffEnded,
    /// An agent has the conversation but has not answered the user for a while (issue 5's
    /// shipped handoff reminds the help desk).
    HandoffReminder,
    ConversationMessage,
    UserBlocked,
    UserUnblocked,
}

impl EventKind {
    pub const ALL: [EventKind; 9] = [
        EventKind::HandoffRequested,
        EventKind::HandoffCancelled,
        EventKind::HandoffTimedOut,
        EventKind::HandoffConnected,
        EventKind::HandoffEnded,
        EventKind::HandoffReminder,
        EventKind::ConversationMessage,
        EventKind::UserBlocked,
        EventKind::UserUnblocked,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::HandoffRequested => "handoff.requested",
            EventKind::HandoffCancelled => "handoff.cancelled",
            EventKind::HandoffTimedOut => "handoff.timed_out",
            EventKind::HandoffConnected => "handoff.connected",
            EventKind::HandoffEnded => "handoff.ended",
            EventKind::HandoffReminder => "handoff.reminder",
            EventKind::ConversationMessage => "conversation.message",
            EventKind::UserBlocked => "user.blocked",
            EventKind::UserUnblocked => "user.unblocked",
        }
    }

    pub fn parse(name: &str) -> Option<EventKind> {
        EventKind::ALL.into_iter().find(|k| k.as_str() == name)
    }

    /// Every name, for error messages.
    pub fn names() -> String {
        EventKind::ALL.map(EventKind::as_str).join(", ")
    }
}

/// Does an endpoint's `events` entry select `kind`? `*` is every kind, `handoff.*` every kind
/// of that family, anything else one kind by name.
pub fn pattern_matches(pattern: &str, kind: &str) -> bool {
    if pattern == "*" {
        return true;
    }
    match pattern.strip_suffix(".*") {
        Some(family) => kind
            .strip_prefix(family)
            .is_some_and(|rest| rest.starts_with('.')),
        None => pattern == kind,
    }
}

/// A pattern that selects no kind is a typo in the configuration, not an intent.
pub fn is_valid_pattern(pattern: &str) -> bool {
    EventKind::ALL
        .iter()
        .any(|k| pattern_matches(pattern, k.as_str()))
}
