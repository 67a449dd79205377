//! Who may call: secret tokens compared in constant time, and source-address allow-lists.

use ipnet::IpNet;
use model::secret::Secret;
use std::net::IpAddr;
use subtle::ConstantTimeEq;

/// Several valid tokens at once, so a token can be rotated without downtime.
#[derive(Clone)]
pub struct TokenSet(Vec<Secret>);

impl TokenSet {
    pub fn new(tokens: Vec<Secret>) -> Self {
        TokenSet(tokens.into_iter().filter(|t| !t.is_empty()).collect())
    }

    /// Every configured token is compared (no early exit), each in constant time.
    pub fn accepts(&self, candidate: &str) -> bool {
        let mut ok = subtle::Choice::from(0);
        for token in &self.0 {
            ok |= token.expose().as_bytes().ct_eq(candidate.as_bytes());
        }
        bool::from(ok)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// The token of an `Authorization: Bearer <token>` header value. The scheme is matched without
/// regard to case, as RFC 9110 says of every authentication scheme.
pub fn bearer_token(authorization: &str) -> Option<&str> {
    let (scheme, token) = authorization.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim_start_matches(' '))
}

/// An empty list allows every address.
#[derive(Clone, Debug)]
pub struct CidrList(Vec<IpNet>);

impl CidrList {
    /// IPv4-mapped networks (`::ffff:10.0.0.0/104`) become the IPv4 networks they name: clients
    /// are judged by their IPv4 address (see [`CidrList::contains`]), so as written they would
    /// never match.
    pub fn new(nets: Vec<IpNet>) -> Self {
        CidrList(nets.into_iter().map(unmap).collect())
    }

    /// Whether only loopback clients are allowed (an empty list allows everyone).
    pub fn loopback_only(&self) -> bool {
        !self.0.is_empty()
            && self
                .0
                .iter()
                .all(|net| net.network().is_loopback() && net.broadcast().is_loopback())
    }

    pub fn allows(&self, ip: Option<IpAddr>) -> bool {
        if self.0.is_empty() {
            return true;
        }
        ip.is_some_and(|ip| self.contains(ip))
    }

    /// Whether a listed network holds `ip`; an empty list holds none (unlike [`allows`]).
    ///
    /// [`allows`]: CidrList::allows
    pub fn contains(&self, ip: IpAddr) -> bool {
        // An IPv4 client on a dual-stack socket shows up as ::ffff:a.b.c.d.
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
            v4 => v4,
        };
        self.0.iter().any(|net| net.contains(&ip))
    }
}

/// `::ffff:a.b.c.d/n` (n >= 96) as `a.b.c.d/(n - 96)`; any other network as it is.
fn unmap(net: IpNet) -> IpNet {
    match net {
        IpNet::V6(v6) if v6.prefix_len() >= 96 => v6
            .network()
            .to_ipv4_mapped()
            .and_then(|v4| ipnet::Ipv4Net::new(v4, v6.prefix_len() - 96).ok())
            .map_or(net, IpNet::V4),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_of_several_tokens_is_accepted_and_nothing_else() {
        let set = TokenSet::new(vec![
            Secret::new("old-token-0123456789"),
            Secret::new("new-token-0123456789"),
            Secret::new(""),
        ]);
        assert!(set.accepts("old-token-0123456789"));
        assert!(set.accepts("new-token-0123456789"));
        assert!(!set.accepts(""));
        assert!(!set.accepts("new-token-012345678"));
        assert!(!set.accepts("new-token-01234567890"));
        assert!(!TokenSet::new(vec![]).accepts(""));
    }

    #[test]
    fn a_list_is_loopback_only_when_every_network_is_loopback() {
        let list =
            |nets: &[&str]| CidrList::new(nets.iter().map(|n| n.parse().expect("net")).collect());
        assert!(list(&["127.0.0.0/8", "::1/128"]).loopback_only());
        assert!(list(&["127.0.0.1/32"]).loopback_only());
        assert!(!list(&["127.0.0.0/8", "10.0.0.0/8"]).loopback_only());
        assert!(!list(&["0.0.0.0/0"]).loopback_only());
        assert!(!list(&[]).loopback_only(), "empty allows everyone");
    }

    #[test]
    fn the_bearer_scheme_is_matched_whatever_its_case() {
        for header in ["Bearer tok", "bearer tok", "BEARER  tok"] {
            assert_eq!(bearer_token(header), Some("tok"), "{header}");
        }
        for header in ["Basic tok", "Bearertok", "tok", ""] {
            assert_eq!(bearer_token(header), None, "{header}");
        }
    }

    #[test]
    fn cidr_list_matches_v4_v6_and_mapped_addresses() {
        let list = CidrList::new(vec![
            "127.0.0.0/8".parse().expect("net"),
            "::1/128".parse().expect("net"),
        ]);
        assert!(list.allows(Some("127.0.0.1".parse().expect("ip"))));
        assert!(list.allows(Some("::1".parse().expect("ip"))));
        assert!(list.allows(Some("::ffff:127.0.0.9".parse().expect("ip"))));
        assert!(!list.allows(Some("10.1.2.3".parse().expect("ip"))));
        assert!(!list.allows(None));
        assert!(CidrList::new(vec![]).allows(None));
        assert!(!CidrList::new(vec![]).contains("127.0.0.1".parse().expect("ip")));
        assert!(list.contains("::ffff:127.0.0.9".parse().expect("ip")));
    }

    #[test]
    fn an_ipv4_mapped_network_matches_ipv4_clients() {
        let list = CidrList::new(vec![
            "::ffff:10.0.0.0/104".parse().expect("net"),
            "2001:db8::/32".parse().expect("net"),
        ]);
        let ip = |s: &str| s.parse::<IpAddr>().expect("ip");
        assert!(list.contains(ip("10.1.2.3")));
        assert!(list.contains(ip("::ffff:10.1.2.3")));
        assert!(!list.contains(ip("11.1.2.3")));
        assert!(list.contains(ip("2001:db8::1")));
        // The whole mapped range is every IPv4 address.
        assert!(
            CidrList::new(vec!["::ffff:0:0/96".parse().expect("net")]).contains(ip("192.0.2.1"))
        );
    }
}
