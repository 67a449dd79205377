//! Who may call the agent API: a caller from `helpdesk.allow_cidrs` (the webhook's and admin
//! API's [`CidrList`]; empty allows any) with a bearer token from `helpdesk.tokens`, compared in
//! constant time (the webhook's [`TokenSet`]). Several tokens may be valid at once, for rotation.
//!
//! The address is checked first: a caller outside the list gets 403 `forbidden` whatever it
//! sends, so the network boundary holds even for a leaked token and a guesser outside it learns
//! nothing about tokens. Inside it, a missing and a wrong token both get 401 `unauthorized`: a
//! token has no scopes a known one could lack, so there is no other 403. With no token
//! configured the API answers 503 `helpdesk_api_disabled`: it is mounted, so the answer says why
//! nothing works instead of a 404 that looks like a wrong URL.

use crate::intake::auth::{CidrList, TokenSet};
use actix_web::http::StatusCode;
use api_error::ApiError;
use std::net::IpAddr;

/// Check a caller's address against `helpdesk.allow_cidrs`.
pub fn check_peer(cidrs: &CidrList, peer: Option<IpAddr>) -> Result<(), ApiError> {
    if cidrs.allows(peer) {
        Ok(())
    } else {
        Err(ApiError::forbidden(
            "the agent API is not open to this address (helpdesk.allow_cidrs)",
        ))
    }
}

/// Check a request's `Authorization` header against the configured tokens.
pub fn check(tokens: &TokenSet, authorization: Option<&str>) -> Result<(), ApiError> {
    if tokens.is_empty() {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "helpdesk_api_disabled",
            "the agent API has no tokens configured (helpdesk.tokens)",
        ));
    }
    let token = authorization.and_then(crate::intake::auth::bearer_token);
    if token.is_some_and(|t| tokens.accepts(t)) {
        Ok(())
    } else {
        Err(ApiError::unauthorized("missing or invalid agent API token"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use model::secret::Secret;

    #[test]
    fn any_configured_token_passes_and_nothing_else() {
        let tokens = TokenSet::new(vec![
            Secret::new("old-helpdesk-token-01"),
            Secret::new("new-helpdesk-token-01"),
        ]);
        assert!(check(&tokens, Some("Bearer old-helpdesk-token-01")).is_ok());
        assert!(check(&tokens, Some("Bearer new-helpdesk-token-01")).is_ok());
        assert!(check(&tokens, Some("bearer new-helpdesk-token-01")).is_ok());
        for bad in [None, Some("Bearer wrong"), Some("old-helpdesk-token-01")] {
            let e = check(&tokens, bad).expect_err("refused");
            assert_eq!((e.status.as_u16(), e.code), (401, "unauthorized"));
            assert!(!e.message.contains("helpdesk-token"), "no secret in errors");
        }
        let e = check(&TokenSet::new(vec![]), Some("Bearer x")).expect_err("disabled");
        assert_eq!((e.status.as_u16(), e.code), (503, "helpdesk_api_disabled"));
    }

    #[test]
    fn only_listed_addresses_may_call_and_an_empty_list_allows_any() {
        let lo = Some(IpAddr::from([127, 0, 0, 1]));
        let list = CidrList::new(vec!["10.0.0.0/8".parse().expect("cidr")]);
        let e = check_peer(&list, lo).expect_err("outside");
        assert_eq!((e.status.as_u16(), e.code), (403, "forbidden"));
        assert!(check_peer(&list, Some(IpAddr::from([10, 1, 2, 3]))).is_ok());
        assert!(
            check_peer(&list, None).is_err(),
            "an unknown peer is outside"
        );
        assert!(check_peer(&CidrList::new(vec![]), lo).is_ok());
    }
}
