//! The events a help desk receives, by kind: their names are the interface with help desks.

/// What happened. The names are the interface with help desks: never rename one. The name list
/// (`ALL`, `names`) comes from the enum itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, strum::IntoStaticStr, strum::VariantArray)]
pub enum DeskEventKind {
    #[strum(serialize = "handoff.requested")]
    HandoffRequested,
    #[strum(serialize = "handoff.cancelled")]
    HandoffCancelled,
    #[strum(serialize = "handoff.timed_out")]
    HandoffTimedOut,
    #[strum(serialize = "handoff.connected")]
    HandoffConnected,
    #[strum(serialize = "handoff.ended")]
    HandoffEnded,
    /// An agent has the conversation but has not answered the user for a while (issue 5's
    /// shipped handoff reminds the help desk).
    #[strum(serialize = "handoff.reminder")]
    HandoffReminder,
    #[strum(serialize = "conversation.message")]
    ConversationMessage,
    #[strum(serialize = "user.blocked")]
    UserBlocked,
    #[strum(serialize = "user.unblocked")]
    UserUnblocked,
    /// A waiting user's place in line, told again while they wait (the shipped handoff's queue
    /// updates).
    #[strum(serialize = "queue.updated")]
    QueueUpdated,
}

impl DeskEventKind {
    /// Every kind.
    pub const ALL: &'static [DeskEventKind] = <DeskEventKind as strum::VariantArray>::VARIANTS;

    pub fn as_str(self) -> &'static str {
        self.into()
    }

    pub fn parse(name: &str) -> Option<DeskEventKind> {
        DeskEventKind::ALL
            .iter()
            .copied()
            .find(|k| k.as_str() == name)
    }

    /// Every name, for error messages.
    pub fn names() -> String {
        let names: Vec<&str> = DeskEventKind::ALL.iter().map(|k| k.as_str()).collect();
        names.join(", ")
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
    DeskEventKind::ALL
        .iter()
        .any(|k| pattern_matches(pattern, k.as_str()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_round_trip_and_are_the_documented_names() {
        for kind in DeskEventKind::ALL {
            assert_eq!(DeskEventKind::parse(kind.as_str()), Some(*kind));
        }
        assert_eq!(DeskEventKind::parse("handoff.remind"), None);
        assert!(DeskEventKind::names().contains("handoff.timed_out"));
    }
}
