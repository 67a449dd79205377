//! Rate limits (governor): a global quota and one per endpoint class. A limited call waits for
//! its turn; it never fails for being limited.
//!
//! The clock follows tokio's, so tests under `tokio::time::pause()` see limits in virtual time.

use governor::clock::Clock;
use governor::middleware::NoOpMiddleware;
use governor::state::{InMemoryState, NotKeyed};
use governor::{Quota, RateLimiter};
use model::contract::EndpointClass;
use serde::{Deserialize, Serialize};
use std::num::NonZeroU32;
use std::time::Duration;

/// Time since the limiter was created, on tokio's clock.
#[derive(Clone, Copy, Debug)]
pub struct TokioClock {
    start: tokio::time::Instant,
}

impl TokioClock {
    /// A clock that starts now.
    pub fn new() -> Self {
        TokioClock {
            start: tokio::time::Instant::now(),
        }
    }
}

impl Default for TokioClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for TokioClock {
    type Instant = Duration;
    fn now(&self) -> Duration {
        self.start.elapsed()
    }
}

/// A reader's own rate limit besides the client's (the reconciliation sweeper's, backfill's), so
/// its reads stay below the outbox's share of the global quota.
pub struct OwnLimit {
    limiter: Limiter,
    clock: TokioClock,
}

impl OwnLimit {
    /// `per_second` calls a second at most (no burst); fails unless positive and finite.
    pub fn new(name: &str, per_second: f64) -> Result<Self, String> {
        if !(per_second.is_finite() && per_second > 0.0) {
            return Err(format!("{name} must be a positive number"));
        }
        let quota = Quota::with_period(Duration::from_secs_f64(1.0 / per_second))
            .ok_or_else(|| format!("{name} is too large"))?;
        let clock = TokioClock::new();
        Ok(OwnLimit {
            limiter: RateLimiter::direct_with_clock(quota, clock),
            clock,
        })
    }

    /// Wait for the next call's turn.
    pub async fn wait(&self) {
        while let Err(not_until) = self.limiter.check() {
            tokio::time::sleep(not_until.wait_time_from(self.clock.now())).await;
        }
    }
}

/// A direct limiter on [`TokioClock`].
pub type Limiter = RateLimiter<NotKeyed, InMemoryState, TokioClock, NoOpMiddleware<Duration>>;

/// One quota: sustained rate and burst (calls allowed at once after a quiet period).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rate {
    pub per_second: f64,
    pub burst: u32,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsConfig {
    pub global: Rate,
    pub write: Rate,
    pub partner_send: Rate,
    pub notify: Rate,
}

pub struct Limits {
    clock: TokioClock,
    global: Limiter,
    write: Limiter,
    partner_send: Limiter,
    notify: Limiter,
    /// Write, partner-send, notify.
    turns: [tokio::sync::Mutex<()>; 3],
}

impl Limits {
    /// Fails on a rate that is not positive and finite or a zero burst.
    pub fn new(config: &LimitsConfig) -> Result<Self, String> {
        let clock = TokioClock::new();
        let make = |name: &str, rate: Rate| -> Result<Limiter, String> {
            let burst = NonZeroU32::new(rate.burst)
                .ok_or_else(|| format!("{name}: burst must be at least 1"))?;
            if !(rate.per_second.is_finite() && rate.per_second > 0.0) {
                return Err(format!("{name}: per_second must be a positive number"));
            }
            let period = Duration::from_secs_f64(1.0 / rate.per_second);
            let quota = Quota::with_period(period)
                .ok_or_else(|| format!("{name}: per_second is too large"))?
                .allow_burst(burst);
            Ok(RateLimiter::direct_with_clock(quota, clock))
        };
        Ok(Limits {
            global: make("global", config.global)?,
            write: make("write", config.write)?,
            partner_send: make("partner_send", config.partner_send)?,
            notify: make("notify", config.notify)?,
            turns: Default::default(),
            clock,
        })
    }

    /// Wait until both the class quota and the global quota allow one call. Both are taken at
    /// the same instant, just before the call goes out, so both hold where the upstream sees the
    /// calls: a global slot is taken first, then the class is checked; if the class is not ready,
    /// that global slot is given up (limits only ever err on the slow side) and both are tried
    /// again once the class is due.
    pub async fn acquire(&self, class: EndpointClass) {
        let (limiter, turn) = match class {
            EndpointClass::Read => (None, None),
            EndpointClass::Write => (Some(&self.write), Some(&self.turns[0])),
            EndpointClass::PartnerSend => (Some(&self.partner_send), Some(&self.turns[1])),
            EndpointClass::Notify => (Some(&self.notify), Some(&self.turns[2])),
        };
        // One contender per class at a time, so waiting callers of a class do not each burn a
        // global slot when the class comes due.
        let _turn = match turn {
            Some(t) => Some(t.lock().await),
            None => None,
        };
        loop {
            self.wait(&self.global).await;
            let Some(limiter) = limiter else { return };
            match limiter.check() {
                Ok(()) => return,
                Err(not_until) => {
                    tokio::time::sleep(not_until.wait_time_from(self.clock.now())).await
                }
            }
        }
    }

    async fn wait(&self, limiter: &Limiter) {
        while let Err(not_until) = limiter.check() {
            tokio::time::sleep(not_until.wait_time_from(self.clock.now())).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(global: f64, burst: u32) -> LimitsConfig {
        let rate = Rate {
            per_second: global,
            burst,
        };
        LimitsConfig {
            global: rate,
            write: rate,
            partner_send: Rate {
                per_second: 2.0,
                burst: 1,
            },
            notify: rate,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn an_own_limit_spaces_its_calls() {
        assert!(OwnLimit::new("x.per_second", 0.0).is_err());
        assert!(OwnLimit::new("x.per_second", f64::NAN).is_err());
        let limit = OwnLimit::new("x.per_second", 5.0).expect("limit");
        let start = tokio::time::Instant::now();
        for _ in 0..6 {
            limit.wait().await;
        }
        // The first at once, then one every 200 ms.
        assert_eq!(start.elapsed(), Duration::from_millis(1000));
    }

    #[tokio::test(start_paused = true)]
    async fn a_burst_passes_at_once_then_calls_are_spaced_by_the_rate() {
        let limits = Limits::new(&config(10.0, 5)).expect("limits");
        let start = tokio::time::Instant::now();
        let mut at = Vec::new();
        for _ in 0..15 {
            limits.acquire(EndpointClass::Read).await;
            at.push(start.elapsed());
        }
        assert!(at[..5].iter().all(|d| d.is_zero()), "{at:?}");
        for pair in at[5..].windows(2) {
            let gap = pair[1] - pair[0];
            assert!(
                gap >= Duration::from_millis(99) && gap <= Duration::from_millis(101),
                "{gap:?}"
            );
        }
        assert!(at[14] >= Duration::from_millis(990), "{at:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn the_class_quota_applies_on_top_of_the_global_one() {
        let limits = Limits::new(&config(100.0, 100)).expect("limits");
        let start = tokio::time::Instant::now();
        for _ in 0..5 {
            limits.acquire(EndpointClass::PartnerSend).await;
        }
        // 2/s with burst 1: the 5th call waits 4 periods of 500 ms.
        assert_eq!(start.elapsed().as_millis(), 2000);
    }

    #[test]
    fn invalid_rates_are_refused() {
        assert!(Limits::new(&config(0.0, 1)).is_err());
        assert!(Limits::new(&config(f64::NAN, 1)).is_err());
        assert!(Limits::new(&config(1.0, 0)).is_err());
    }
}
