//! The caller's address: the peer's, or, only when the peer is a configured trusted proxy, the
//! address that proxy says it forwarded for (`X-Forwarded-For`, else RFC 7239 `Forwarded`).
//! Anyone else's forwarding headers are ignored: a client cannot choose whose allowance it spends.

use std::net::IpAddr;

use actix_web::dev::ServiceRequest;
use actix_web::http::header::{HeaderName, FORWARDED};

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
/// At most this many forwarded addresses are read from a request (a bound on attacker input).
const FORWARDED_HOPS_MAX: usize = 32;

/// An address block: `10.0.0.0/8`, `::1/128`, or a single address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    network: IpAddr,
    prefix_bits: u8,
}

impl Cidr {
    pub fn parse(text: &str) -> Option<Cidr> {
        let (address, bits) = match text.split_once('/') {
            Some((address, bits)) => (address, Some(bits.parse::<u8>().ok()?)),
            None => (text, None),
        };
        let network: IpAddr = address.parse().ok()?;
        let width = if network.is_ipv4() { 32 } else { 128 };
        let prefix_bits = bits.unwrap_or(width);
        (prefix_bits <= width).then_some(Cidr {
            network,
            prefix_bits,
        })
    }

    pub fn contains(&self, address: IpAddr) -> bool {
        let (network, address, width) = match (self.network, address) {
            (IpAddr::V4(n), IpAddr::V4(a)) => (u32::from(n).into(), u32::from(a).into(), 32),
            (IpAddr::V6(n), IpAddr::V6(a)) => (u128::from(n), u128::from(a), 128),
            _ => return false,
        };
        let shift = width - u32::from(self.prefix_bits);
        let mask: u128 = if shift >= 128 { 0 } else { !0u128 << shift };
        (network & mask) == (address & mask)
    }
}

/// The caller's address as `trusted` proxies report it, or the peer's own.
pub fn client_ip(req: &ServiceRequest, trusted: &[Cidr]) -> Option<IpAddr> {
    let peer = req.peer_addr()?.ip();
    let is_trusted = |ip: IpAddr| trusted.iter().any(|cidr| cidr.contains(ip));
    if !is_trusted(peer) {
        return Some(peer);
    }
    let hops = forwarded_for(req);
    // From the nearest hop outwards: the first address not of a trusted proxy is the client.
    Some(
        hops.iter()
            .rev()
            .copied()
            .find(|ip| !is_trusted(*ip))
            .or_else(|| hops.first().copied())
            .unwrap_or(peer),
    )
}

/// The forwarded-for chain, oldest first: `X-Forwarded-For` if present, else `Forwarded: for=`.
fn forwarded_for(req: &ServiceRequest) -> Vec<IpAddr> {
    let headers = req.headers();
    let xff: Vec<&str> = headers
        .get_all(X_FORWARDED_FOR)
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .collect();
    let items: Vec<String> = if !xff.is_empty() {
        xff.iter().map(|s| s.trim().to_owned()).collect()
    } else {
        headers
            .get_all(FORWARDED)
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .filter_map(|element| {
                element.split(';').find_map(|pair| {
                    let (name, value) = pair.trim().split_once('=')?;
                    name.eq_ignore_ascii_case("for")
                        .then(|| value.trim().to_owned())
                })
            })
            .collect()
    };
    items
        .iter()
        .rev()
        .take(FORWARDED_HOPS_MAX)
        .rev()
        .filter_map(|item| parse_node(item))
        .collect()
}

/// `1.2.3.4`, `1.2.3.4:80`, `"[2001:db8::1]:443"`, `2001:db8::1`; `unknown` and obfuscated
/// identifiers are no address.
fn parse_node(item: &str) -> Option<IpAddr> {
    let item = item.trim().trim_matches('"');
    if let Ok(ip) = item.parse::<IpAddr>() {
        return Some(ip);
    }
    if let Some(rest) = item.strip_prefix('[') {
        return rest.split(']').next()?.parse().ok();
    }
    item.rsplit_once(':')?.0.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use actix_web::test::TestRequest;
    use proptest::prelude::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn blocks_contain_their_addresses() {
        let block = Cidr::parse("10.0.0.0/8").unwrap();
        assert!(block.contains(ip("10.200.3.4")));
        assert!(!block.contains(ip("11.0.0.1")));
        assert!(!block.contains(ip("::1")));
        assert!(Cidr::parse("::1").unwrap().contains(ip("::1")));
        assert!(Cidr::parse("0.0.0.0/0").unwrap().contains(ip("8.8.8.8")));
        assert!(Cidr::parse("10.0.0.0/33").is_none());
        assert!(Cidr::parse("nope").is_none());
    }

    #[test]
    fn forwarding_headers_count_only_from_trusted_proxies() {
        let proxy = [Cidr::parse("127.0.0.1").unwrap()];
        let from = |peer: &str, header: (&str, &str)| {
            let req = TestRequest::default()
                .peer_addr(format!("{peer}:5000").parse().unwrap())
                .insert_header(header)
                .to_srv_request();
            client_ip(&req, &proxy).unwrap()
        };
        // A stranger's claim is ignored.
        assert_eq!(
            from("9.9.9.9", ("x-forwarded-for", "1.2.3.4")),
            ip("9.9.9.9")
        );
        // The proxy's is believed: the nearest address that is not a trusted proxy.
        let xff = ("x-forwarded-for", "6.6.6.6, 1.2.3.4, 127.0.0.1");
        assert_eq!(from("127.0.0.1", xff), ip("1.2.3.4"));
        let fwd = ("forwarded", "for=\"[2001:db8::1]:443\";proto=https");
        assert_eq!(from("127.0.0.1", fwd), ip("2001:db8::1"));
        assert_eq!(
            from("127.0.0.1", ("forwarded", "for=unknown")),
            ip("127.0.0.1")
        );
    }

    proptest! {
        #[test]
        fn any_forwarding_header_is_read_without_panic(value in "[ -~]{0,200}") {
            let req = TestRequest::default()
                .peer_addr("127.0.0.1:1".parse().unwrap())
                .insert_header(("x-forwarded-for", value.clone()))
                .insert_header(("forwarded", value))
                .to_srv_request();
            let trusted = [Cidr::parse("127.0.0.0/8").unwrap()];
            prop_assert!(client_ip(&req, &trusted).is_some());
        }
    }
}
