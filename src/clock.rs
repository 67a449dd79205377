//! Wall-clock time in the service's unit (Unix milliseconds).

use crate::webhook::model::Millis;
use std::time::{SystemTime, UNIX_EPOCH};

pub fn now_millis() -> Millis {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| {
        Millis::try_from(d.as_millis()).unwrap_or(Millis::MAX)
    })
}
