//! The shipped agent handoff: the rule files of the repository's `rules/`, built into the binary,
//! so the daemon runs a complete handoff with no rule directory configured (`rules.dir` empty).

/// (file name, text), in file-name order as `load_dir` would read them.
pub const SOURCES: [(&str, &str); 4] = [
    (
        "handoff.toml",
        include_str!("../../../../rules/handoff.toml"),
    ),
    ("hours.toml", include_str!("../../../../rules/hours.toml")),
    (
        "partner.toml",
        include_str!("../../../../rules/partner.toml"),
    ),
    (
        "settings.toml",
        include_str!("../../../../rules/settings.toml"),
    ),
];

/// The shipped files as owned sources.
pub fn sources() -> Vec<(String, String)> {
    SOURCES
        .iter()
        .map(|(name, text)| ((*name).to_owned(), (*text).to_owned()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::RuleSet;

    /// With `notify_helpdesk` on, each step of the agent call tells the help desk, once.
    #[test]
    fn the_shipped_handoff_tells_the_help_desk_each_step_when_switched_on() {
        use crate::decide::Decide;
        let mut overrides = serde_json::Map::new();
        overrides.insert("notify_helpdesk".into(), serde_json::Value::Bool(true));
        let on = RuleSet::from_sources_with(&sources(), &overrides).expect("load");
        let off = RuleSet::from_sources(&sources()).expect("load");
        let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../../shared/fixtures/webhooks");
        for (fixture, kind) in [
            ("agent-call-requested.json", "handoff.requested"),
            ("agent-call-cancelled.json", "handoff.cancelled"),
            ("agent-call-connected.json", "handoff.connected"),
            ("agent-call-disconnected.json", "handoff.ended"),
        ] {
            let text = std::fs::read_to_string(fixtures.join(fixture)).expect("fixture");
            let delivery: serde_json::Value = serde_json::from_str(&text).expect("json");
            let event =
                model::webhook::parse_event(&delivery["messages"][0].to_string()).expect("event");
            let id = event
                .payload
                .conversation_id()
                .cloned()
                .expect("conversation");
            let mut state = crate::state::ConversationState::new(id);
            state.apply(&event);
            let kinds = |set: &RuleSet| -> Vec<String> {
                set.decide(&event, &state, 1_763_690_500_000)
                    .into_iter()
                    .filter_map(|d| match d.action {
                        model::action::Action::NotifyHelpdesk { kind, .. } => Some(kind),
                        _ => None,
                    })
                    .collect()
            };
            assert_eq!(kinds(&on), [kind], "{fixture}");
            assert!(kinds(&off).is_empty(), "{fixture}: off by default");
        }
    }

    #[test]
    fn the_shipped_set_compiles_and_matches_the_repository_files() {
        let set = RuleSet::from_sources(&sources()).expect("the shipped rules load");
        assert!(set.rules().len() >= 20, "{}", set.rules().len());
        // Built in what the directory holds (no file left out of the list).
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../rules");
        let on_disk = crate::rules::read_dir(&dir).expect("rules/");
        assert_eq!(on_disk, sources());
        assert_eq!(set.settings()["fallback_flow_id"], 0);
    }

    /// The schema editors use (`rules/schema.json`) knows every action type and every key the
    /// shipped and example files use; a structural check, the loader checks the rest.
    #[test]
    fn the_json_schema_matches_the_engine_and_the_shipped_files() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../rules");
        let schema: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(root.join("schema.json")).expect("schema.json"),
        )
        .expect("schema JSON");
        let defs = &schema["$defs"];
        let mut types: Vec<&str> = defs["action"]["properties"]["type"]["enum"]
            .as_array()
            .expect("action types")
            .iter()
            .filter_map(|v| v.as_str())
            .collect();
        let mut names = model::action::Action::NAMES.to_vec();
        types.sort_unstable();
        names.sort_unstable();
        assert_eq!(types, names, "action types in rules/schema.json");
        let kinds: Vec<&str> = defs["action"]["properties"]["kind"]["enum"]
            .as_array()
            .expect("help-desk event kinds")
            .iter()
            .filter_map(|v| v.as_str())
            .collect();
        assert_eq!(
            kinds,
            model::helpdesk::DeskEventKind::ALL
                .iter()
                .map(|k| k.as_str())
                .collect::<Vec<_>>(),
            "notify_helpdesk kinds in rules/schema.json"
        );
        let keys = |def: &str| -> Vec<String> {
            defs[def]["properties"]
                .as_object()
                .map(|m| m.keys().cloned().collect())
                .unwrap_or_default()
        };
        let (rule_keys, action_keys, calendar_keys) =
            (keys("rule"), keys("action"), keys("calendar"));
        let mut files = sources();
        files.extend(crate::rules::read_dir(&root.join("examples")).expect("examples"));
        for (file, text) in files {
            let doc: serde_json::Value = toml::from_str(&text).expect("TOML");
            for rule in doc["rule"].as_array().into_iter().flatten() {
                for key in rule.as_object().into_iter().flat_map(|m| m.keys()) {
                    assert!(
                        rule_keys.contains(key),
                        "{file}: rule key `{key}` not in the schema"
                    );
                }
                for action in rule["actions"].as_array().into_iter().flatten() {
                    for key in action.as_object().into_iter().flat_map(|m| m.keys()) {
                        assert!(
                            action_keys.contains(key),
                            "{file}: action key `{key}` not in the schema"
                        );
                    }
                }
            }
            for calendar in doc["calendar"]
                .as_object()
                .into_iter()
                .flat_map(|m| m.values())
            {
                for key in calendar.as_object().into_iter().flat_map(|m| m.keys()) {
                    assert!(
                        calendar_keys.contains(key),
                        "{file}: calendar key `{key}` not in the schema"
                    );
                }
            }
        }
    }

    #[test]
    fn settings_are_overridden_by_name_and_unknown_names_refused() {
        let mut overrides = serde_json::Map::new();
        overrides.insert("fallback_flow_id".into(), 12.into());
        let set = RuleSet::from_sources_with(&sources(), &overrides).expect("override");
        assert_eq!(set.settings()["fallback_flow_id"], 12);
        let plain = RuleSet::from_sources(&sources()).expect("plain");
        assert_ne!(
            set.version(),
            plain.version(),
            "overrides are part of the version"
        );
        overrides.insert("fallback_flow".into(), 1.into());
        match RuleSet::from_sources_with(&sources(), &overrides) {
            Err(crate::rules::LoadError::Invalid(problems)) => {
                assert_eq!(problems.len(), 1, "{problems:?}");
                assert_eq!(problems[0].at, "rules.settings.fallback_flow");
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
    }
}
