//! `[reconcile]`: the reconciliation sweeper (`crate::reconcile`).

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::time::Duration;

/// The sweeper's settings.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ReconcileConfig {
    /// How often a pass runs on its own; `"0"` or `"off"` runs none (`POST /admin/v1/reconcile`
    /// and `handoff-bridge reconcile` still do).
    #[serde(with = "off_or_duration")]
    pub interval: Duration,
    /// Conversations released (call ended or cancelled, desk release, manual mode off) this
    /// recently are checked too.
    #[serde(with = "humantime_serde")]
    pub recent: Duration,
    /// Conversations in plain bot mode checked per pass besides those (a rotating sample).
    pub sample: usize,
    /// Most conversations one pass checks (active first, then recently released, then the sample).
    pub max_per_pass: usize,
    /// Open API reads per second the sweeper makes at most (its own limiter, well below the
    /// outbox's share of `upstream.limits.global`).
    pub per_second: f64,
}

impl ReconcileConfig {
    /// Whether passes run on their own.
    pub fn periodic(&self) -> bool {
        !self.interval.is_zero()
    }

    /// Every problem: (key, value, why).
    pub fn problems(&self, upstream_global: f64) -> Vec<(String, String, String)> {
        let mut p = Vec::new();
        if !(self.per_second.is_finite() && self.per_second > 0.0) {
            p.push((
                "reconcile.per_second".into(),
                self.per_second.to_string(),
                "must be a positive number".into(),
            ));
        } else if self.per_second > upstream_global / 2.0 {
            p.push((
                "reconcile.per_second".into(),
                self.per_second.to_string(),
                format!(
                    "must be at most half of upstream.limits.global.per_second ({upstream_global}): \
                     the outbox's calls come first"
                ),
            ));
        }
        if self.periodic() && self.interval < Duration::from_secs(10) {
            p.push((
                "reconcile.interval".into(),
                humantime::format_duration(self.interval).to_string(),
                "must be at least 10s, or \"off\"".into(),
            ));
        }
        if self.sample > 10_000 {
            p.push((
                "reconcile.sample".into(),
                self.sample.to_string(),
                "must be 0..=10000".into(),
            ));
        }
        if self.max_per_pass == 0 || self.max_per_pass > 1_000_000 {
            p.push((
                "reconcile.max_per_pass".into(),
                self.max_per_pass.to_string(),
                "must be 1..=1000000".into(),
            ));
        }
        p
    }
}

/// A duration in humantime form, or `"off"` (zero).
mod off_or_duration {
    use super::*;

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        if d.is_zero() {
            s.serialize_str("off")
        } else {
            s.serialize_str(&humantime::format_duration(*d).to_string())
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let text = String::deserialize(d)?;
        match text.trim() {
            "off" => Ok(Duration::ZERO),
            other => humantime::parse_duration(other).map_err(|e| {
                serde::de::Error::custom(format!(
                    "`{other}` is neither a duration (\"5m\") nor \"off\": {e}"
                ))
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(interval: &str) -> Result<ReconcileConfig, toml::de::Error> {
        toml::from_str(&format!(
            "interval = \"{interval}\"\nrecent = \"1h\"\nsample = 20\nmax_per_pass = 100\nper_second = 2.0\n"
        ))
    }

    #[test]
    fn the_interval_is_a_duration_or_off() {
        assert_eq!(parse("5m").expect("5m").interval, Duration::from_secs(300));
        assert!(!parse("off").expect("off").periodic());
        assert!(!parse("0").expect("0").periodic());
        assert!(parse("often").is_err());
        let config = parse("off").expect("off");
        let shown = toml::to_string(&config).expect("render");
        assert!(shown.contains("interval = \"off\""), "{shown}");
    }

    #[test]
    fn problems_name_their_keys() {
        let mut config = parse("1s").expect("1s");
        config.per_second = 40.0;
        config.max_per_pass = 0;
        let keys: Vec<String> = config.problems(50.0).into_iter().map(|p| p.0).collect();
        assert_eq!(
            keys,
            [
                "reconcile.per_second",
                "reconcile.interval",
                "reconcile.max_per_pass"
            ]
        );
        assert!(parse("5m").expect("ok").problems(50.0).is_empty());
    }
}
