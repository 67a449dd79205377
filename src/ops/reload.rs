//! Reloading the rule files without a restart: on a change of the files (checked every
//! `rules.watch_interval`), on SIGHUP, or on `POST /admin/v1/rules/reload`. The new files are
//! compiled as a whole and swapped in at once ([`LiveRules`]); a set with any problem is refused
//! with every problem, and the running set stays.

use super::metrics::Metrics;
use engine::rules::live::LiveRules;
use engine::rules::{LoadError, RuleSet};
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::sync::watch;

/// What started a reload (a metric label).
#[derive(Clone, Copy, Debug)]
pub enum Trigger {
    File,
    Signal,
    Admin,
}

impl Trigger {
    fn label(self) -> &'static str {
        match self {
            Trigger::File => "file",
            Trigger::Signal => "signal",
            Trigger::Admin => "admin",
        }
    }
}

#[derive(Debug, Serialize)]
pub struct Reloaded {
    /// The version in force now.
    pub version: String,
    pub previous: String,
    /// False when the files compiled to the version already in force.
    pub changed: bool,
    pub rules: usize,
}

/// The rules and where they come from, for the reload paths.
#[derive(Clone)]
pub struct Reloader {
    pub live: LiveRules,
    /// `rules.dir`; `None` when no directory is configured (nothing to reload).
    pub dir: Option<PathBuf>,
    /// `rules.settings`, applied to every reload.
    pub overrides: serde_json::Map<String, serde_json::Value>,
    pub metrics: Metrics,
}

impl Reloader {
    /// Compile the directory and swap it in. Blocking (reads files): call off the async workers.
    pub fn reload(&self, trigger: Trigger) -> Result<Reloaded, LoadError> {
        let count = |outcome: &str| {
            self.metrics
                .rules_reloads
                .with_label_values(&[trigger.label(), outcome])
                .inc();
        };
        let Some(dir) = &self.dir else {
            count("invalid");
            return Err(LoadError::Dir {
                dir: String::new(),
                source: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "no rule directory is configured (rules.dir)",
                ),
            });
        };
        let set = match RuleSet::load_dir_with(dir, &self.overrides) {
            Ok(set) => set,
            Err(e) => {
                count("invalid");
                tracing::error!(trigger = trigger.label(), dir = %dir.display(), error = %e, "rule reload refused; the running rules stay");
                return Err(e);
            }
        };
        let previous = self.live.current().version().to_owned();
        let version = set.version().to_owned();
        let rules = set.rules().len();
        let changed = version != previous;
        if changed {
            self.live.replace(set);
            count("loaded");
            tracing::info!(trigger = trigger.label(), %previous, %version, rules, "rules reloaded");
        } else {
            count("unchanged");
        }
        Ok(Reloaded {
            version,
            previous,
            changed,
            rules,
        })
    }

    /// Watch for SIGHUP and (every `interval`, unless zero) for changed files, until `stop`.
    /// SIGHUP is caught from this call on, whatever the rules: a reload request (`systemctl
    /// reload`) never ends the daemon, also when there is nothing to reload.
    pub fn spawn_watchers(
        self,
        interval: Duration,
        mut stop: watch::Receiver<bool>,
    ) -> tokio::task::JoinHandle<()> {
        let hangup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup());
        tokio::spawn(async move {
            let mut hangup = match hangup {
                Ok(s) => Some(s),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot watch SIGHUP; reload by file change or admin API");
                    None
                }
            };
            let Some(dir) = self.dir.clone() else {
                // The shipped rules are built in (or rules are off): nothing to reload.
                let Some(mut hangup) = hangup else { return };
                loop {
                    tokio::select! {
                        _ = stop.changed() => return,
                        got = hangup.recv() => match got {
                            Some(()) => tracing::info!("SIGHUP: no rules.dir, nothing to reload"),
                            None => return,
                        },
                    }
                }
            };
            let watching = !interval.is_zero();
            let mut tick = tokio::time::interval(interval.max(Duration::from_millis(100)));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            // The files as last seen, so an invalid edit is reported once, not every tick.
            let mut seen = files_version(&dir).await;
            loop {
                let trigger = tokio::select! {
                    _ = stop.changed() => return,
                    Some(()) = async { match hangup.as_mut() { Some(h) => h.recv().await, None => None } } => Trigger::Signal,
                    _ = tick.tick(), if watching => {
                        let now = files_version(&dir).await;
                        if now == seen {
                            continue;
                        }
                        seen = now;
                        Trigger::File
                    }
                };
                let reloader = self.clone();
                // Errors are logged and counted inside; the running set stays.
                let _ = tokio::task::spawn_blocking(move || reloader.reload(trigger)).await;
            }
        })
    }
}

/// The version the directory's files would compile to (`None` while unreadable).
async fn files_version(dir: &Path) -> Option<String> {
    let dir = dir.to_owned();
    tokio::task::spawn_blocking(move || {
        engine::rules::read_dir(&dir)
            .ok()
            .map(|sources| engine::rules::version_of_sources(&sources))
    })
    .await
    .ok()
    .flatten()
}
