//! Who may call the agent API: a bearer token from `helpdesk.tokens`, compared in constant time
//! (the webhook's [`TokenSet`]). Several may be valid at once, for rotation.
//!
//! A missing and a wrong token both get 401 `unauthorized`: a bearer token only says "a help desk
//! we trust", there are no scopes that a known token could lack, so 403 would tell nothing more
//! (and would tell a guesser that the header was read). With no token configured the API answers
//! 503 `helpdesk_api_disabled`: it is mounted, so the answer says why nothing works instead of a
//! 404 that looks like a wrong URL.

use crate::http_error::ApiError;
use crate::intake::auth::TokenSet;
use actix_web::http::StatusCode;

/// Check a request's `Authorization` header against the configured tokens.
pub fn check(tokens: &TokenSet, authorization: Option<&str>) -> Result<(), ApiError> {
    if tokens.is_empty() {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "helpdesk_api_disabled",
            "the agent API has no tokens configured (helpdesk.tokens)",
        ));
    }
    let token = authorization.and_then(|v| v.strip_prefix("Bearer "));
    if token.is_some_and(|t| tokens.accepts(t)) {
        Ok(())
    } else {
        Err(ApiError::unauthorized("missing or invalid agent API token"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Secret;

    #[test]
    fn any_configured_token_passes_and_nothing_else() {
        let tokens = TokenSet::new(vec![
            Secret::new("old-helpdesk-token-01"),
            Secret::new("new-helpdesk-token-01"),
        ]);
        assert!(check(&tokens, Some("Bearer old-helpdesk-token-01")).is_ok());
        assert!(check(&tokens, Some("Bearer new-helpdesk-token-01")).is_ok());
        for bad in [None, Some("Bearer wrong"), Some("old-helpdesk-token-01")] {
            let e = check(&tokens, bad).expect_err("refused");
            assert_eq!((e.status.as_u16(), e.code), (401, "unauthorized"));
            assert!(!e.message.contains("helpdesk-token"), "no secret in errors");
        }
        let e = check(&TokenSet::new(vec![]), Some("Bearer x")).expect_err("disabled");
        assert_eq!((e.status.as_u16(), e.code), (503, "helpdesk_api_disabled"));
    }
}
