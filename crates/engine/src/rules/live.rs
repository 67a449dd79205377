//! The rule set in force. A reload swaps it whole; each fold takes one `Arc` for its whole batch,
//! so an event is always decided by one complete rule set, old or new, never a mix.

use crate::decide::Decide;
use std::sync::{Arc, RwLock};

#[derive(Clone)]
pub struct LiveRules(Arc<RwLock<Arc<dyn Decide>>>);

impl LiveRules {
    pub fn new(rules: Arc<dyn Decide>) -> Self {
        LiveRules(Arc::new(RwLock::new(rules)))
    }

    /// The set in force now; keep it for as long as one decision (or batch) lasts.
    pub fn current(&self) -> Arc<dyn Decide> {
        match self.0.read() {
            Ok(rules) => rules.clone(),
            // A panic while swapping cannot leave a half-written Arc: the value is still whole.
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// Put `rules` in force; returns the set it replaced.
    pub fn replace(&self, rules: Arc<dyn Decide>) -> Arc<dyn Decide> {
        let mut slot = match self.0.write() {
            Ok(slot) => slot,
            Err(poisoned) => poisoned.into_inner(),
        };
        std::mem::replace(&mut *slot, rules)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decide::NoRules;

    fn set(name: &str) -> Arc<dyn Decide> {
        let text = format!(
            "[[rule]]\nname = \"{name}\"\non = [\"bot.message.received\"]\n\
             actions = [{{ type = \"set_manual\", enabled = true }}]\n"
        );
        Arc::new(crate::rules::RuleSet::from_sources(&[("r.toml".into(), text)]).expect("rules"))
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
}
