//! Chatwoot's webhook signature (`lib/webhooks/trigger.rb`): `X-Chatwoot-Signature:
//! sha256=<lowercase hex HMAC-SHA256>` over `"{X-Chatwoot-Timestamp}.{raw body}"`, keyed with
//! the webhook secret as UTF-8. Checked in constant time; a timestamp more than
//! [`TOLERANCE_SECS`] from the daemon's clock is refused (a replayed delivery).

use hmac::{Hmac, Mac};
use sha2::Sha256;
use subtle::ConstantTimeEq;

pub const SIGNATURE_HEADER: &str = "x-chatwoot-signature";
pub const TIMESTAMP_HEADER: &str = "x-chatwoot-timestamp";
pub const DELIVERY_HEADER: &str = "x-chatwoot-delivery";

/// How far a delivery's timestamp may be from the daemon's clock (either way).
pub const TOLERANCE_SECS: i64 = 300;

/// The signature header's value for `body` sent at `timestamp` (Unix seconds, as sent).
pub fn sign(secret: &[u8], timestamp: &str, body: &[u8]) -> String {
    let digest = mac(secret, timestamp, body);
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256={hex}")
}

/// Whether `header` signs `body` at `timestamp` with `secret` (compared in constant time).
pub fn verify(secret: &[u8], timestamp: &str, body: &[u8], header: &str) -> bool {
    let expected = sign(secret, timestamp, body);
    expected.as_bytes().ct_eq(header.trim().as_bytes()).into()
}

/// Whether `timestamp` (Unix seconds) is within [`TOLERANCE_SECS`] of `now_secs`.
pub fn fresh(timestamp: &str, now_secs: i64) -> bool {
    timestamp
        .trim()
        .parse::<i64>()
        .is_ok_and(|at| now_secs.abs_diff(at) <= TOLERANCE_SECS.unsigned_abs())
}

fn mac(secret: &[u8], timestamp: &str, body: &[u8]) -> Vec<u8> {
    // HMAC takes a key of any length: `new_from_slice` cannot fail for it.
    let mut mac = match Hmac::<Sha256>::new_from_slice(secret) {
        Ok(mac) => mac,
        Err(_) => return Vec::new(),
    };
    mac.update(timestamp.as_bytes());
    mac.update(b".");
    mac.update(body);
    mac.finalize().into_bytes().to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A known vector, computed independently:
    /// `printf '%s' '1718870043.{"event":"message_created"}' |
    ///  openssl dgst -sha256 -hmac 'cw-webhook-secret'`.
    #[test]
    fn a_known_vector_signs_and_verifies() {
        let body = br#"{"event":"message_created"}"#;
        let header = sign(b"cw-webhook-secret", "1718870043", body);
        assert_eq!(
            header,
            "sha256=479bb3f20a7fbf2d234d2a1d65014de1c93b79c9d3445921fe1c976be77b6600"
        );
        assert!(verify(b"cw-webhook-secret", "1718870043", body, &header));
        assert!(!verify(b"other-secret", "1718870043", body, &header));
        assert!(!verify(b"cw-webhook-secret", "1718870044", body, &header));
        assert!(!verify(b"cw-webhook-secret", "1718870043", b"{}", &header));
        assert!(!verify(b"cw-webhook-secret", "1718870043", body, "sha256="));
        assert!(!verify(
            b"cw-webhook-secret",
            "1718870043",
            body,
            &header.to_uppercase()
        ));
    }

    #[test]
    fn a_timestamp_is_fresh_within_five_minutes_either_way() {
        assert!(fresh("1000", 1000 + 300));
        assert!(fresh("1300", 1000));
        assert!(!fresh("1000", 1301));
        assert!(!fresh("1301", 1000));
        assert!(!fresh("soon", 1000));
        assert!(!fresh("", 1000));
    }

    #[test]
    fn a_timestamp_at_the_ends_of_the_range_is_stale_not_a_panic() {
        let min = i64::MIN.to_string();
        let max = i64::MAX.to_string();
        assert!(!fresh(&min, 1_718_870_043));
        assert!(!fresh(&max, 1_718_870_043));
        assert!(!fresh(&min, i64::MAX));
        assert!(fresh(&min, i64::MIN + 300));
    }
}
