//! Standard Webhooks signatures (<https://www.standardwebhooks.com/>): help desks verify what the
//! bridge sends with the libraries they already have, so this follows the specification to the
//! byte. Signed content is `{webhook-id}.{webhook-timestamp}.{body}`; the key is the base64 part
//! of a `whsec_` secret; the header lists one `v1,<base64 HMAC-SHA256>` per valid secret,
//! space-separated, which lets an operator rotate secrets without a window of failed checks.

use base64::Engine;
use hmac::{Hmac, Mac};
use model::secret::Secret;
use sha2::Sha256;
use std::fmt;

/// The prefix the specification gives secrets, so they are recognisable (and base64 follows).
pub const SECRET_PREFIX: &str = "whsec_";

/// The specification's bounds on a decoded secret: shorter keys are weak, longer ones are hashed
/// down by HMAC anyway and usually mean a pasting mistake.
pub const MIN_KEY_BYTES: usize = 24;
pub const MAX_KEY_BYTES: usize = 64;

pub const ID_HEADER: &str = "webhook-id";
pub const TIMESTAMP_HEADER: &str = "webhook-timestamp";
pub const SIGNATURE_HEADER: &str = "webhook-signature";

/// A decoded signing key. Never printed: `Debug` masks it like [`Secret`].
#[derive(Clone, PartialEq, Eq)]
pub struct SigningKey(Vec<u8>);

impl fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SigningKey(****)")
    }
}

/// Why a configured secret cannot be used. Carries no part of the secret.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("must start with `whsec_`")]
    Prefix,
    #[error("the part after `whsec_` is not standard base64")]
    Base64,
    #[error("decodes to {0} bytes; Standard Webhooks secrets are 24 to 64 bytes")]
    Length(usize),
}

impl SigningKey {
    /// The key of a `whsec_<base64>` secret.
    pub fn from_secret(secret: &Secret) -> Result<SigningKey, KeyError> {
        let encoded = secret
            .expose()
            .strip_prefix(SECRET_PREFIX)
            .ok_or(KeyError::Prefix)?;
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(encoded)
            .map_err(|_| KeyError::Base64)?;
        if !(MIN_KEY_BYTES..=MAX_KEY_BYTES).contains(&bytes.len()) {
            return Err(KeyError::Length(bytes.len()));
        }
        Ok(SigningKey(bytes))
    }

    /// One signature, `v1,<base64>`.
    pub fn sign(&self, id: &str, timestamp: i64, body: &[u8]) -> String {
        // HMAC takes keys of any length, so this cannot fail; the fallback keeps it total.
        let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(&self.0) else {
            return String::new();
        };
        mac.update(id.as_bytes());
        mac.update(b".");
        mac.update(timestamp.to_string().as_bytes());
        mac.update(b".");
        mac.update(body);
        let tag = mac.finalize().into_bytes();
        format!(
            "v1,{}",
            base64::engine::general_purpose::STANDARD.encode(tag)
        )
    }
}

/// The three headers of one delivery attempt: every key signs, so a receiver that knows any of
/// them (old or new during a rotation) accepts it.
pub fn headers(
    keys: &[SigningKey],
    id: &str,
    timestamp: i64,
    body: &[u8],
) -> Vec<(String, String)> {
    let signatures: Vec<String> = keys.iter().map(|k| k.sign(id, timestamp, body)).collect();
    vec![
        (ID_HEADER.to_owned(), id.to_owned()),
        (TIMESTAMP_HEADER.to_owned(), timestamp.to_string()),
        (SIGNATURE_HEADER.to_owned(), signatures.join(" ")),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPEC_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

    #[test]
    fn the_published_test_vector_reproduces_exactly() {
        // From the Standard Webhooks reference libraries' tests: only matching a signature
        // computed elsewhere proves a receiver's library will accept ours.
        let key = SigningKey::from_secret(&Secret::new(SPEC_SECRET)).expect("valid secret");
        assert_eq!(
            key.sign(
                "msg_p5jXN8AQM9LWM0D4loKWxJek",
                1_614_265_330,
                br#"{"test": 2432232314}"#
            ),
            "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
        );
    }

    #[test]
    fn every_key_signs_and_the_signatures_are_space_separated() {
        let old = SigningKey::from_secret(&Secret::new(SPEC_SECRET)).expect("old");
        let new = SigningKey::from_secret(&Secret::new(format!(
            "whsec_{}",
            base64::engine::general_purpose::STANDARD.encode([7u8; 32])
        )))
        .expect("new");
        let h = headers(&[old.clone(), new.clone()], "id-1", 1_700_000_000, b"{}");
        assert_eq!(h[0], ("webhook-id".into(), "id-1".into()));
        assert_eq!(h[1], ("webhook-timestamp".into(), "1700000000".into()));
        let sigs: Vec<&str> = h[2].1.split(' ').collect();
        assert_eq!(sigs.len(), 2);
        assert_eq!(sigs[0], old.sign("id-1", 1_700_000_000, b"{}"));
        assert_eq!(sigs[1], new.sign("id-1", 1_700_000_000, b"{}"));
        assert_ne!(sigs[0], sigs[1]);
        assert_ne!(
            old.sign("id-1", 1_700_000_001, b"{}"),
            sigs[0],
            "the timestamp is signed"
        );
    }

    #[test]
    fn bad_secrets_are_refused_without_showing_them() {
        let bad = |s: &str| SigningKey::from_secret(&Secret::new(s)).expect_err(s);
        assert_eq!(bad("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"), KeyError::Prefix);
        assert_eq!(bad("whsec_not base64!"), KeyError::Base64);
        assert_eq!(bad("whsec_c2hvcnQ="), KeyError::Length(5));
        let key = SigningKey::from_secret(&Secret::new(SPEC_SECRET)).expect("valid");
        assert!(!format!("{key:?}").contains("MfKQ"));
        assert!(!KeyError::Base64.to_string().contains("not base64!"));
    }
}
