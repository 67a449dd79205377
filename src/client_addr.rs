//! Who is calling: the client address every allow-list judges (`webhook.allow_cidrs`,
//! `admin.allow_cidrs`, `helpdesk.allow_cidrs`).
//!
//! Without `server.trusted_proxies` it is the TCP peer, and forwarding headers are ignored. When
//! the peer is a trusted proxy, the client is read from the one header the proxies append to
//! (`server.proxy_header`: `X-Forwarded-For`, or RFC 7239 `Forwarded`'s `for=`): walking from the
//! right (the hop nearest to us), the first address that is not itself a trusted proxy; when every
//! address is trusted, the rightmost (the one our nearest proxy wrote from its own TCP peer; the
//! leftmost is whatever the client wrote). Entries left of that are the client's own words and are
//! never believed. A header that does not parse, or an unknown hop (`unknown`, an obfuscated name)
//! reached before an untrusted address, makes the client unknown (`None`): a non-empty allow-list
//! then refuses. A trusted peer that sends no header is itself the client.

use crate::config::ProxyHeader;
use crate::intake::auth::CidrList;
use actix_web::http::header::HeaderMap;
use std::net::{IpAddr, SocketAddr};

/// The trusted proxies and the header they write.
#[derive(Clone, Debug)]
pub struct Proxies {
    pub trusted: CidrList,
    pub header: ProxyHeader,
}

impl Proxies {
    pub fn new(trusted: Vec<ipnet::IpNet>, header: ProxyHeader) -> Self {
        Proxies {
            trusted: CidrList::new(trusted),
            header,
        }
    }

    /// No proxy trusted: the peer is always the client.
    pub fn none() -> Self {
        Self::new(Vec::new(), ProxyHeader::XForwardedFor)
    }

    /// The client address of `req`: its TCP peer, or what a trusted proxy says.
    pub fn of_request(&self, req: &actix_web::HttpRequest) -> Option<IpAddr> {
        self.client_ip(req.peer_addr().map(|a| a.ip()), req.headers())
    }

    /// Whether `req` reached the client over TLS: this listener's own, or a trusted proxy's that
    /// says so (`X-Forwarded-Proto: https`, or `proto=https` in `Forwarded`, the header it is
    /// configured with). An untrusted peer's headers are not believed.
    pub fn over_tls(&self, req: &actix_web::HttpRequest) -> bool {
        if req.app_config().secure() {
            return true;
        }
        let peer = req.peer_addr().map(|a| canonical(a.ip()));
        if !peer.is_some_and(|p| self.trusted.contains(p)) {
            return false;
        }
        let header = |name: &str| {
            req.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_ascii_lowercase)
        };
        match self.header {
            ProxyHeader::XForwardedFor => {
                header("x-forwarded-proto").is_some_and(|v| v.trim() == "https")
            }
            ProxyHeader::Forwarded => header("forwarded")
                .is_some_and(|v| v.split([';', ',']).any(|p| p.trim() == "proto=https")),
        }
    }

    /// The client address of a request whose TCP peer is `peer`.
    pub fn client_ip(&self, peer: Option<IpAddr>, headers: &HeaderMap) -> Option<IpAddr> {
        let peer = peer.map(canonical)?;
        if !self.trusted.contains(peer) {
            return Some(peer);
        }
        let name = match self.header {
            ProxyHeader::XForwardedFor => "x-forwarded-for",
            ProxyHeader::Forwarded => "forwarded",
        };
        let mut values = headers.get_all(name).peekable();
        if values.peek().is_none() {
            return Some(peer);
        }
        // Several header lines are one list, in order.
        let mut hops = Vec::new();
        for value in values {
            let text = value.to_str().ok()?;
            let parsed = match self.header {
                ProxyHeader::XForwardedFor => parse_xff(text),
                ProxyHeader::Forwarded => parse_forwarded(text),
            };
            hops.extend(parsed?);
        }
        self.pick(&hops)
    }

    /// The rightmost hop that is not a trusted proxy; the rightmost when all are (what our nearest
    /// proxy saw; anything left of it may be the client's own words).
    fn pick(&self, hops: &[Hop]) -> Option<IpAddr> {
        for hop in hops.iter().rev() {
            match hop {
                Hop::Ip(ip) if self.trusted.contains(*ip) => continue,
                Hop::Ip(ip) => return Some(*ip),
                Hop::Unknown => return None,
            }
        }
        match hops.last() {
            Some(Hop::Ip(ip)) => Some(*ip),
            _ => None,
        }
    }
}

/// One forwarding hop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hop {
    Ip(IpAddr),
    /// `unknown` or an obfuscated identifier (RFC 7239 section 6).
    Unknown,
}

/// An IPv4 client on a dual-stack socket shows up as `::ffff:a.b.c.d`.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// `X-Forwarded-For: client, proxy1, proxy2`. Each entry an address, maybe with a port
/// (`1.2.3.4:5`, `[::1]:5`), or `unknown`. `None` when any entry is something else or empty.
pub fn parse_xff(text: &str) -> Option<Vec<Hop>> {
    text.split(',').map(|entry| node(entry.trim())).collect()
}

/// `Forwarded: for=1.2.3.4;proto=https, for="[2001:db8::1]:4711"`. Each element must name its
/// `for=` once; parameters and quoting as RFC 7239 has them. `None` when it does not parse.
pub fn parse_forwarded(text: &str) -> Option<Vec<Hop>> {
    let mut hops = Vec::new();
    for element in split_outside_quotes(text, ',')? {
        let mut found = None;
        for pair in split_outside_quotes(element, ';')? {
            let pair = pair.trim();
            if pair.is_empty() {
                continue;
            }
            let (key, value) = pair.split_once('=')?;
            let key = key.trim();
            if key.is_empty() || !key.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') {
                return None;
            }
            if !key.eq_ignore_ascii_case("for") {
                continue;
            }
            let value = value.trim();
            let value = match value.strip_prefix('"') {
                Some(rest) => rest.strip_suffix('"')?,
                None => value,
            };
            if found.replace(node(value)?).is_some() {
                return None; // `for` twice in one element
            }
        }
        hops.push(found?);
    }
    Some(hops)
}

/// Split on `sep` outside double quotes; `None` for an unterminated quote.
fn split_outside_quotes(text: &str, sep: char) -> Option<Vec<&str>> {
    let mut parts = Vec::new();
    let (mut start, mut quoted, mut escaped) = (0, false, false);
    for (i, c) in text.char_indices() {
        if escaped {
            escaped = false;
        } else if quoted && c == '\\' {
            escaped = true;
        } else if c == '"' {
            quoted = !quoted;
        } else if c == sep && !quoted {
            parts.push(&text[start..i]);
            start = i + c.len_utf8();
        }
    }
    if quoted {
        return None;
    }
    parts.push(&text[start..]);
    Some(parts)
}

/// One node: an address with or without a port, `unknown`, or (RFC 7239) an obfuscated `_name`.
fn node(text: &str) -> Option<Hop> {
    if text.eq_ignore_ascii_case("unknown")
        || (text.starts_with('_')
            && text.len() > 1
            && text[1..]
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-'))
    {
        return Some(Hop::Unknown);
    }
    if let Ok(ip) = text.parse::<IpAddr>() {
        return Some(Hop::Ip(canonical(ip)));
    }
    if let Ok(addr) = text.parse::<SocketAddr>() {
        return Some(Hop::Ip(canonical(addr.ip())));
    }
    // `[v6]` without a port.
    let bracketed = text.strip_prefix('[')?.strip_suffix(']')?;
    bracketed
        .parse::<std::net::Ipv6Addr>()
        .ok()
        .map(|v6| Hop::Ip(canonical(IpAddr::V6(v6))))
}

#[cfg(test)]
mod tests {
    use super::*;
    use actix_web::http::header::{HeaderName, HeaderValue};

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("ip")
    }

    #[test]
    fn only_a_trusted_proxy_is_believed_when_it_says_the_client_used_tls() {
        use actix_web::test::TestRequest;
        let proxies = Proxies::new(
            vec!["10.0.0.0/8".parse().expect("net")],
            ProxyHeader::XForwardedFor,
        );
        let req = |peer: &str, proto: &str| {
            TestRequest::default()
                .peer_addr(format!("{peer}:4000").parse().expect("addr"))
                .insert_header(("x-forwarded-proto", proto))
                .to_http_request()
        };
        assert!(proxies.over_tls(&req("10.1.2.3", "https")));
        assert!(proxies.over_tls(&req("10.1.2.3", " HTTPS ")));
        assert!(!proxies.over_tls(&req("10.1.2.3", "http")));
        assert!(
            !proxies.over_tls(&req("192.0.2.1", "https")),
            "an untrusted peer"
        );
        let plain = TestRequest::default()
            .peer_addr("10.1.2.3:4000".parse().expect("addr"))
            .to_http_request();
        assert!(!proxies.over_tls(&plain));
        let forwarded = Proxies::new(
            vec!["10.0.0.0/8".parse().expect("net")],
            ProxyHeader::Forwarded,
        );
        let req = TestRequest::default()
            .peer_addr("10.1.2.3:4000".parse().expect("addr"))
            .insert_header(("forwarded", "for=192.0.2.9;proto=https"))
            .to_http_request();
        assert!(forwarded.over_tls(&req));
    }

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (k, v) in pairs {
            map.append(
                HeaderName::from_bytes(k.as_bytes()).expect("name"),
                HeaderValue::from_str(v).expect("value"),
            );
        }
        map
    }

    fn proxies(header: ProxyHeader) -> Proxies {
        Proxies::new(
            vec![
                "127.0.0.0/8".parse().expect("net"),
                "10.9.0.0/16".parse().expect("net"),
            ],
            header,
        )
    }

    #[test]
    fn xff_entries_parse_with_ports_brackets_spaces_and_v6() {
        assert_eq!(
            parse_xff(" 203.0.113.9 ,10.0.0.5:8080,[2001:db8::1]:443, 2001:db8::2 ,[::1],unknown"),
            Some(vec![
                Hop::Ip(ip("203.0.113.9")),
                Hop::Ip(ip("10.0.0.5")),
                Hop::Ip(ip("2001:db8::1")),
                Hop::Ip(ip("2001:db8::2")),
                Hop::Ip(ip("::1")),
                Hop::Unknown,
            ])
        );
        assert_eq!(
            parse_xff("::ffff:192.0.2.1"),
            Some(vec![Hop::Ip(ip("192.0.2.1"))]),
            "mapped v4 is v4"
        );
        for garbage in [
            "",
            " ",
            "1.2.3.4,",
            ",1.2.3.4",
            "1.2.3",
            "300.1.1.1",
            "example.com",
            "1.2.3.4 5.6.7.8",
            "[1.2.3.4]",
            "2001:db8::1:443]",
            "1.2.3.4:99999",
            "<script>",
        ] {
            assert_eq!(parse_xff(garbage), None, "{garbage:?}");
        }
    }

    #[test]
    fn forwarded_elements_parse_for_with_quotes_params_and_case() {
        assert_eq!(
            parse_forwarded(
                r#"for=192.0.2.60;proto=http;by=203.0.113.43, For="[2001:db8:cafe::17]:4711", for=unknown;host="a,b", for=_hidden"#
            ),
            Some(vec![
                Hop::Ip(ip("192.0.2.60")),
                Hop::Ip(ip("2001:db8:cafe::17")),
                Hop::Unknown,
                Hop::Unknown,
            ])
        );
        for garbage in [
            "",
            "proto=https",
            "for=1.2.3.4;for=5.6.7.8",
            "for=\"1.2.3.4",
            "for=1.2.3.4, ",
            "for",
            "for=nothing-here",
            "=1.2.3.4",
            "fo r=1.2.3.4",
        ] {
            assert_eq!(parse_forwarded(garbage), None, "{garbage:?}");
        }
    }

    #[test]
    fn all_hops_trusted_the_client_is_the_rightmost_not_what_the_client_wrote() {
        // The client wrote `127.0.0.1` itself; our proxy (peer 10.9.1.2) appended the peer it
        // saw, 10.9.1.1. With loopback trusted too (a sidecar), every hop is trusted: the client
        // is what our proxy wrote, never the loopback address the client claimed.
        let headers = headers(&[("x-forwarded-for", "127.0.0.1, 10.9.1.1")]);
        let both = Proxies::new(
            vec![
                "10.0.0.0/8".parse().expect("net"),
                "127.0.0.0/8".parse().expect("net"),
            ],
            ProxyHeader::XForwardedFor,
        );
        assert_eq!(
            both.client_ip(Some(ip("10.9.1.2")), &headers),
            Some(ip("10.9.1.1"))
        );
        // Only 10/8 trusted: 127.0.0.1 is the rightmost untrusted hop, as for any address.
        let ten = Proxies::new(
            vec!["10.0.0.0/8".parse().expect("net")],
            ProxyHeader::XForwardedFor,
        );
        assert_eq!(
            ten.client_ip(Some(ip("10.9.1.2")), &headers),
            Some(ip("127.0.0.1"))
        );
    }

    #[test]
    fn the_client_is_the_rightmost_untrusted_hop_behind_a_trusted_peer() {
        let p = proxies(ProxyHeader::XForwardedFor);
        let lo = Some(ip("127.0.0.1"));
        let xff = |v: &str| headers(&[("x-forwarded-for", v)]);
        assert_eq!(
            p.client_ip(lo, &xff("203.0.113.9")),
            Some(ip("203.0.113.9"))
        );
        // A spoofed left entry does not win over the address the proxy saw.
        assert_eq!(
            p.client_ip(lo, &xff("10.0.0.5, 203.0.113.9")),
            Some(ip("203.0.113.9"))
        );
        // Trusted hops on the right are skipped; all trusted: the rightmost (the one our nearest
        // proxy wrote; the leftmost could be the client's own).
        assert_eq!(
            p.client_ip(lo, &xff("198.51.100.7, 10.9.1.1, 127.0.0.2")),
            Some(ip("198.51.100.7"))
        );
        assert_eq!(
            p.client_ip(lo, &xff("10.9.0.1, 10.9.0.2")),
            Some(ip("10.9.0.2"))
        );
        // Several header lines are one list.
        assert_eq!(
            p.client_ip(
                lo,
                &headers(&[
                    ("x-forwarded-for", "10.0.0.5"),
                    ("x-forwarded-for", "203.0.113.9")
                ])
            ),
            Some(ip("203.0.113.9"))
        );
        // Malformed, or an unknown hop before any untrusted address: unknown.
        assert_eq!(p.client_ip(lo, &xff("10.0.0.5, garbage")), None);
        assert_eq!(p.client_ip(lo, &xff("203.0.113.9, unknown")), None);
        // An unknown hop left of the client does not matter.
        assert_eq!(
            p.client_ip(lo, &xff("unknown, 203.0.113.9")),
            Some(ip("203.0.113.9"))
        );
        // No header: the proxy itself; the other header kind is not read.
        assert_eq!(p.client_ip(lo, &HeaderMap::new()), lo);
        assert_eq!(
            p.client_ip(lo, &headers(&[("forwarded", "for=203.0.113.9")])),
            lo
        );
        // An untrusted peer's headers are ignored; mapped peers count as v4.
        let outside = Some(ip("192.0.2.1"));
        assert_eq!(p.client_ip(outside, &xff("10.0.0.5")), outside);
        assert_eq!(
            p.client_ip(Some(ip("::ffff:127.0.0.1")), &xff("203.0.113.9")),
            Some(ip("203.0.113.9"))
        );
        assert_eq!(p.client_ip(None, &xff("203.0.113.9")), None);
        // Without trusted proxies nothing is read.
        assert_eq!(Proxies::none().client_ip(lo, &xff("203.0.113.9")), lo);
    }

    #[test]
    fn forwarded_is_read_only_when_configured() {
        let p = proxies(ProxyHeader::Forwarded);
        let lo = Some(ip("127.0.0.1"));
        assert_eq!(
            p.client_ip(
                lo,
                &headers(&[(
                    "forwarded",
                    "for=10.0.0.5, for=\"[2001:db8::9]:80\";proto=https"
                )])
            ),
            Some(ip("2001:db8::9"))
        );
        assert_eq!(
            p.client_ip(lo, &headers(&[("x-forwarded-for", "203.0.113.9")])),
            lo,
            "X-Forwarded-For is not the configured header"
        );
        assert_eq!(p.client_ip(lo, &headers(&[("forwarded", "for=")])), None);
    }
}
