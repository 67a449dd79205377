//! Fault injection: the failures a client has to survive (errors, rate limits, latency, calls that
//! never answer, connections cut mid-answer, answers trickled a byte at a time), on demand and
//! reproducibly. A faulted call never reaches the state, so it has no effect there and a retry is
//! the first real attempt; except a trickled one, which is a slow answer, not a failure: the call
//! takes effect and only its answer crawls (a client that gives up retries under the same key and
//! gets the stored answer).

use serde::{Deserialize, Serialize};
use std::time::Duration;

/// What to inject. Counters (`*_next`) count down as matching calls arrive; at most one fault
/// applies to a call, in this order: hang, drop, trickle, rate limit, fail, error rate. `latency_ms` is
/// added to every matching call, faulted or not.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FaultConfig {
    /// The next N calls are answered with `status`.
    pub fail_next: u32,
    /// Status of `fail_next` and `error_rate` faults (400..=599; default 503).
    pub status: u16,
    /// Share of calls (0..=1) answered with `status`, drawn from a PRNG seeded with `seed`.
    pub error_rate: f64,
    pub seed: u64,
    /// Added before every matching call is answered.
    pub latency_ms: u64,
    /// The next N calls are answered 429 with `Retry-After: <retry_after>`.
    pub rate_limit_next: u32,
    /// Sent verbatim, so seconds, an HTTP-date or garbage can all be tested.
    pub retry_after: String,
    /// The next N calls are never answered (the client must time out).
    pub hang_next: u32,
    /// The next N calls get response headers and part of a body, then the connection is cut.
    pub drop_next: u32,
    /// The next N calls are carried out, then answered with their headers at once and their body
    /// one byte every `trickle_byte_ms` (a slow upstream or network the client's timeout must cut).
    pub trickle_next: u32,
    pub trickle_byte_ms: u64,
    /// Only calls whose path starts with this are affected (all `/openapi` calls when unset).
    pub path_prefix: Option<String>,
}

impl Default for FaultConfig {
    fn default() -> Self {
        FaultConfig {
            fail_next: 0,
            status: 503,
            error_rate: 0.0,
            seed: 0x5eed,
            latency_ms: 0,
            rate_limit_next: 0,
            retry_after: "1".to_owned(),
            hang_next: 0,
            drop_next: 0,
            trickle_next: 0,
            trickle_byte_ms: 100,
            path_prefix: None,
        }
    }
}

/// The longest latency accepted, so a typo cannot park calls for days.
pub const MAX_LATENCY_MS: u64 = 600_000;

impl FaultConfig {
    pub fn validate(&self) -> Result<(), String> {
        let mut problems = Vec::new();
        if !(400..=599).contains(&self.status) {
            problems.push(format!(
                "status is {}; it must be from 400 to 599",
                self.status
            ));
        }
        if !(self.error_rate.is_finite() && (0.0..=1.0).contains(&self.error_rate)) {
            problems.push(format!(
                "error_rate is {}; it must be from 0 to 1",
                self.error_rate
            ));
        }
        if self.latency_ms > MAX_LATENCY_MS {
            problems.push(format!(
                "latency_ms is {}; at most {MAX_LATENCY_MS} is allowed",
                self.latency_ms
            ));
        }
        if self.trickle_byte_ms > MAX_LATENCY_MS {
            problems.push(format!(
                "trickle_byte_ms is {}; at most {MAX_LATENCY_MS} is allowed",
                self.trickle_byte_ms
            ));
        }
        if actix_web::http::header::HeaderValue::from_str(&self.retry_after).is_err() {
            problems.push("retry_after cannot be sent as a header value".to_owned());
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(problems.join("; "))
        }
    }
}

/// The fault chosen for one call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fault {
    Hang,
    Drop,
    /// Carried out; the answer's body goes out one byte per `byte_delay`.
    Trickle {
        byte_delay: Duration,
    },
    RateLimit {
        retry_after: String,
    },
    Fail {
        status: u16,
    },
    Random {
        status: u16,
    },
}

impl Fault {
    /// Journal label.
    pub fn name(&self) -> &'static str {
        match self {
            Fault::Hang => "hang",
            Fault::Drop => "drop",
            Fault::Trickle { .. } => "trickle",
            Fault::RateLimit { .. } => "rate_limit",
            Fault::Fail { .. } => "fail",
            Fault::Random { .. } => "error_rate",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct FaultDecision {
    pub latency: Option<Duration>,
    pub fault: Option<Fault>,
}

/// The configuration with its counters as they run down, and the PRNG.
#[derive(Debug)]
pub struct FaultState {
    config: FaultConfig,
    rng: u64,
}

impl FaultState {
    pub fn new(config: FaultConfig) -> Self {
        let rng = config.seed;
        FaultState { config, rng }
    }

    pub fn config(&self) -> &FaultConfig {
        &self.config
    }

    /// Picks the fault for a call to `path`, consuming a counter.
    pub fn decide(&mut self, path: &str) -> FaultDecision {
        let c = &mut self.config;
        if c.path_prefix
            .as_deref()
            .is_some_and(|p| !path.starts_with(p))
        {
            return FaultDecision::default();
        }
        let latency = (c.latency_ms > 0).then(|| Duration::from_millis(c.latency_ms));
        let fault = if take(&mut c.hang_next) {
            Some(Fault::Hang)
        } else if take(&mut c.drop_next) {
            Some(Fault::Drop)
        } else if take(&mut c.trickle_next) {
            Some(Fault::Trickle {
                byte_delay: Duration::from_millis(c.trickle_byte_ms),
            })
        } else if take(&mut c.rate_limit_next) {
            Some(Fault::RateLimit {
                retry_after: c.retry_after.clone(),
            })
        } else if take(&mut c.fail_next) {
            Some(Fault::Fail { status: c.status })
        } else if c.error_rate > 0.0 {
            let status = c.status;
            let rate = c.error_rate;
            (unit(&mut self.rng) < rate).then_some(Fault::Random { status })
        } else {
            None
        };
        FaultDecision { latency, fault }
    }
}

fn take(counter: &mut u32) -> bool {
    if *counter > 0 {
        *counter -= 1;
        true
    } else {
        false
    }
}

/// SplitMix64 mapped to [0, 1): tiny, and the same sequence on every platform and version.
fn unit(state: &mut u64) -> f64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_run_down_in_order_and_only_on_matching_paths() {
        let mut s = FaultState::new(FaultConfig {
            hang_next: 1,
            drop_next: 1,
            trickle_next: 1,
            trickle_byte_ms: 30,
            rate_limit_next: 1,
            fail_next: 1,
            status: 502,
            retry_after: "7".into(),
            path_prefix: Some("/openapi/bot".into()),
            ..FaultConfig::default()
        });
        assert_eq!(s.decide("/openapi/messages"), FaultDecision::default());
        let faults: Vec<_> = (0..6).map(|_| s.decide("/openapi/bot/B1").fault).collect();
        assert_eq!(
            faults,
            vec![
                Some(Fault::Hang),
                Some(Fault::Drop),
                Some(Fault::Trickle {
                    byte_delay: Duration::from_millis(30)
                }),
                Some(Fault::RateLimit {
                    retry_after: "7".into()
                }),
                Some(Fault::Fail { status: 502 }),
                None
            ]
        );
    }

    #[test]
    fn error_rate_is_deterministic_for_a_seed_and_roughly_right() {
        let run = |seed| {
            let mut s = FaultState::new(FaultConfig {
                error_rate: 0.3,
                seed,
                ..FaultConfig::default()
            });
            (0..1000)
                .map(|_| s.decide("/openapi/bot").fault.is_some())
                .collect::<Vec<_>>()
        };
        assert_eq!(run(1), run(1));
        assert_ne!(run(1), run(2));
        let hits = run(1).iter().filter(|x| **x).count();
        assert!((220..=380).contains(&hits), "{hits}");
    }

    #[test]
    fn bad_configs_are_refused_with_every_reason() {
        let bad = FaultConfig {
            status: 200,
            error_rate: 1.5,
            trickle_byte_ms: MAX_LATENCY_MS + 1,
            retry_after: "a\nb".into(),
            ..FaultConfig::default()
        };
        let err = bad.validate().expect_err("invalid");
        assert!(
            err.contains("status")
                && err.contains("error_rate")
                && err.contains("retry_after")
                && err.contains("trickle_byte_ms")
        );
        assert!(FaultConfig::default().validate().is_ok());
    }
}
