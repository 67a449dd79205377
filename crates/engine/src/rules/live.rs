//! The rule set in force. A reload swaps it whole; each fold takes one `Arc` for its whole batch,
//! so an event is always decided by one complete rule set, old or new, never a mix.

use crate::decide::Decide;
use crate::rules::RuleSet;
use std::sync::{Arc, RwLock};

/// The rules in force: what decides, and the rule set behind it when there is one (the audit
/// explains each rule's verdict with it). Swapped whole.
#[derive(Clone)]
struct InForce {
    decide: Arc<dyn Decide>,
    set: Option<Arc<RuleSet>>,
}

#[derive(Clone)]
pub struct LiveRules(Arc<RwLock<InForce>>);

impl LiveRules {
    /// Any decider, with no rule set to explain its decisions (no rules configured; tests).
    pub fn new(rules: Arc<dyn Decide>) -> Self {
        Self::with(InForce {
            decide: rules,
            set: None,
        })
    }

    /// A rule set in force.
    pub fn of_set(set: RuleSet) -> Self {
        Self::with(in_force(set))
    }

    fn with(rules: InForce) -> Self {
        LiveRules(Arc::new(RwLock::new(rules)))
    }

    /// The set in force now; keep it for as long as one decision (or batch) lasts.
    pub fn current(&self) -> Arc<dyn Decide> {
        self.read().decide
    }

    /// The set in force now and, when it is a rule set, that set (both from one swap).
    pub fn current_explained(&self) -> (Arc<dyn Decide>, Option<Arc<RuleSet>>) {
        let InForce { decide, set } = self.read();
        (decide, set)
    }

    fn read(&self) -> InForce {
        match self.0.read() {
            Ok(rules) => rules.clone(),
            // A panic while swapping cannot leave a half-written value: it is still whole.
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// Put `set` in force; returns what it replaced.
    pub fn replace(&self, set: RuleSet) -> Arc<dyn Decide> {
        let mut slot = match self.0.write() {
            Ok(slot) => slot,
            Err(poisoned) => poisoned.into_inner(),
        };
        std::mem::replace(&mut *slot, in_force(set)).decide
    }
}

fn in_force(set: RuleSet) -> InForce {
    let set = Arc::new(set);
    InForce {
        decide: set.clone(),
        set: Some(set),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decide::NoRules;

    fn set(name: &str) -> RuleSet {
        let text = format!(
            "[[rule]]\nname = \"{name}\"\non = [\"bot.message.received\"]\n\
             actions = [{{ type = \"set_manual\", enabled = true }}]\n"
        );
        RuleSet::from_sources(&[("r.toml".into(), text)]).expect("rules")
    }

    #[test]
    fn a_holder_keeps_its_set_across_a_swap() {
        let live = LiveRules::new(Arc::new(NoRules));
        let first = live.current();
        let a = set("a");
        let a_version = a.version().to_owned();
        let old = live.replace(a);
        assert_eq!(old.version(), first.version());
        assert_eq!(live.current().version(), a_version);
        let held = live.current();
        live.replace(set("b"));
        assert_eq!(
            held.version(),
            a_version,
            "a batch keeps the set it started with"
        );
        assert_ne!(live.current().version(), a_version);
    }

    #[test]
    fn a_rule_set_in_force_comes_with_itself_to_explain_and_other_deciders_without() {
        let live = LiveRules::new(Arc::new(NoRules));
        assert!(live.current_explained().1.is_none());
        live.replace(set("a"));
        let (decide, explained) = live.current_explained();
        let explained = explained.expect("a rule set");
        assert_eq!(decide.version(), explained.version());
        assert_eq!(explained.rules()[0].name, "a");
    }
}
