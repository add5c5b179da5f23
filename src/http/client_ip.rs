//! The caller's address: the peer's, or, only when the peer is a configured trusted proxy, the
//! address that proxy says it forwarded for, in the one header the proxies write
//! (`X-Forwarded-For` or RFC 7239 `Forwarded`, [`ForwardedHeader`]). Anyone else's forwarding
//! headers are ignored, and so is the other header (a client may send it through a proxy that
//! passes it on): a client cannot choose whose allowance it spends. IPv4 addresses mapped into
//! IPv6 (`::ffff:10.1.2.3`, what a dual-stack listener sees) are taken as the IPv4 address.

use std::net::IpAddr;

use actix_web::dev::ServiceRequest;
use actix_web::http::header::{HeaderName, FORWARDED};

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
/// At most this many forwarded addresses are read from a request (a bound on attacker input).
const FORWARDED_HOPS_MAX: usize = 32;

/// The header trusted proxies name the caller in; the other one is never read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ForwardedHeader {
    /// `X-Forwarded-For` (nginx, HAProxy, Envoy, cloud load balancers).
    #[default]
    XForwardedFor,
    /// RFC 7239 `Forwarded: for=`.
    Forwarded,
}

impl ForwardedHeader {
    /// `x-forwarded-for` or `forwarded`, as the configuration names them.
    pub fn parse(name: &str) -> Option<Self> {
        match name.to_ascii_lowercase().as_str() {
            "x-forwarded-for" => Some(ForwardedHeader::XForwardedFor),
            "forwarded" => Some(ForwardedHeader::Forwarded),
            _ => None,
        }
    }
}

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
        if prefix_bits > width {
            return None;
        }
        // A block of IPv4 addresses mapped into IPv6 (`::ffff:10.0.0.0/104`) is the IPv4 block:
        // peers and forwarded addresses are compared as IPv4. One shorter than the mapped range
        // (/96) mixes in addresses that are not IPv4: no such block.
        match network.to_canonical() {
            IpAddr::V4(v4) if network.is_ipv6() => Some(Cidr {
                network: IpAddr::V4(v4),
                prefix_bits: prefix_bits.checked_sub(96)?,
            }),
            _ => Some(Cidr {
                network,
                prefix_bits,
            }),
        }
    }

    /// Whether the block is wider than any network of proxies: an IPv4 block shorter than /8,
    /// an IPv6 one shorter than /7 (`fc00::/7`, every unique local address, is the widest).
    /// Trusted, a few such blocks (`0.0.0.0/1` and `128.0.0.0/1`) believe every client.
    pub fn is_too_wide(&self) -> bool {
        let floor = if self.network.is_ipv4() { 8 } else { 7 };
        self.prefix_bits < floor
    }

    pub fn contains(&self, address: IpAddr) -> bool {
        let (network, address, width) = match (self.network, address.to_canonical()) {
            (IpAddr::V4(n), IpAddr::V4(a)) => (u32::from(n).into(), u32::from(a).into(), 32),
            (IpAddr::V6(n), IpAddr::V6(a)) => (u128::from(n), u128::from(a), 128),
            _ => return false,
        };
        let shift = width - u32::from(self.prefix_bits);
        let mask: u128 = if shift >= 128 { 0 } else { !0u128 << shift };
        (network & mask) == (address & mask)
    }
}

/// The caller's address as `trusted` proxies report it in `header`, or the peer's own.
pub fn client_ip(
    req: &ServiceRequest,
    trusted: &[Cidr],
    header: ForwardedHeader,
) -> Option<IpAddr> {
    let peer = req.peer_addr()?.ip().to_canonical();
    let is_trusted = |ip: IpAddr| trusted.iter().any(|cidr| cidr.contains(ip));
    if !is_trusted(peer) {
        return Some(peer);
    }
    // From the nearest hop outwards: the first address not of a trusted proxy is the client. A
    // hop that names no address ends the walk at the proxy that wrote it: what lies beyond, the
    // client may have written itself. All trusted: the farthest proxy.
    let mut nearest = peer;
    for hop in forwarded_for(req, header).iter().rev() {
        match hop {
            Some(ip) if is_trusted(*ip) => nearest = *ip,
            Some(ip) => return Some(*ip),
            None => return Some(nearest),
        }
    }
    Some(nearest)
}

/// The forwarded-for chain in `header`, oldest first, at most [`FORWARDED_HOPS_MAX`] hops: each
/// an address, or `None` for a hop that names none (`unknown`, an obfuscated name, a `Forwarded`
/// element without `for=`, bytes that are not text). Split on the raw bytes, so that a client's
/// bad byte spoils its own item only, not the addresses its proxies appended to the same line.
fn forwarded_for(req: &ServiceRequest, header: ForwardedHeader) -> Vec<Option<IpAddr>> {
    let name = match header {
        ForwardedHeader::XForwardedFor => X_FORWARDED_FOR,
        ForwardedHeader::Forwarded => FORWARDED,
    };
    // `Forwarded` elements may quote a comma (`by="a,b"`), and are read from the nearest.
    let quoted = matches!(header, ForwardedHeader::Forwarded);
    let mut nearest_first: Vec<&[u8]> = Vec::new();
    for line in req.headers().get_all(name).rev() {
        let left = FORWARDED_HOPS_MAX - nearest_first.len();
        nearest_first.extend(split_from_the_right(line.as_bytes(), b',', quoted, left));
        if nearest_first.len() >= FORWARDED_HOPS_MAX {
            break;
        }
    }
    (nearest_first.iter().rev())
        .map(|item| {
            let item = std::str::from_utf8(item).ok()?;
            let node = match header {
                ForwardedHeader::XForwardedFor => item,
                ForwardedHeader::Forwarded => for_parameter(item)?,
            };
            parse_node(node).map(|ip| ip.to_canonical())
        })
        .collect()
}

/// `bytes` split at each `separator`, nearest (rightmost) first, at most `parts_max` of them,
/// outside quoted strings (RFC 7230's, `\` escaping the byte after it) when `quoted`. From the
/// right because that is where proxies write, well formed: what a client wrote comes first on
/// the line, and a quote it left open, or one it made a proxy escape (its own `Host` in a
/// proxy's `host="..."`), would shift a left-to-right reading of every element after it, and
/// its text be read as a proxy's hop.
fn split_from_the_right(bytes: &[u8], separator: u8, quoted: bool, parts_max: usize) -> Vec<&[u8]> {
    let (mut parts, mut end, mut in_quotes) = (Vec::new(), bytes.len(), false);
    let mut at = bytes.len();
    while at > 0 && parts.len() < parts_max {
        at -= 1;
        match bytes[at] {
            // A quote is escaped by an odd run of backslashes before it.
            b'"' if quoted => {
                let run = bytes[..at]
                    .iter()
                    .rev()
                    .take_while(|b| **b == b'\\')
                    .count();
                if run % 2 == 0 {
                    in_quotes = !in_quotes;
                }
            }
            byte if byte == separator && !in_quotes => {
                parts.push(&bytes[at + 1..end]);
                end = at;
            }
            _ => {}
        }
    }
    if parts.len() < parts_max {
        parts.push(&bytes[..end]);
    }
    parts
}

/// The `for=` value of one `Forwarded` element (`for=1.2.3.4;proto=https`).
fn for_parameter(element: &str) -> Option<&str> {
    let pairs = split_from_the_right(element.as_bytes(), b';', true, usize::MAX);
    pairs.into_iter().rev().find_map(|pair| {
        let pair = std::str::from_utf8(pair).ok()?;
        let (name, value) = pair.trim().split_once('=')?;
        name.trim()
            .eq_ignore_ascii_case("for")
            .then(|| value.trim())
    })
}

/// `1.2.3.4`, `1.2.3.4:80`, `"[2001:db8::1]:443"`, `2001:db8::1` (RFC 7239's node, with a
/// port or an obfuscated one, `_x`); `unknown`, obfuscated identifiers and anything malformed
/// (an unbalanced quote, a port that is none, text after the brackets) are no address.
fn parse_node(item: &str) -> Option<IpAddr> {
    let item = item.trim();
    let item = match item.strip_prefix('"') {
        Some(quoted) => quoted.strip_suffix('"')?,
        None => item,
    };
    if let Ok(ip) = item.parse::<IpAddr>() {
        return Some(ip);
    }
    // RFC 7239: a port of 1 to 5 digits, or `_` and 1*(ALPHA / DIGIT / "." / "_" / "-").
    let port = |port: &str| match port.strip_prefix('_') {
        Some(name) => {
            let valid = |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-');
            !name.is_empty() && name.bytes().all(valid)
        }
        None => (1..=5).contains(&port.len()) && port.bytes().all(|b| b.is_ascii_digit()),
    };
    if let Some(rest) = item.strip_prefix('[') {
        let (ip, after) = rest.split_once(']')?;
        let after_ok = after.is_empty() || after.strip_prefix(':').is_some_and(port);
        return after_ok.then(|| ip.parse().ok()).flatten();
    }
    // Unbracketed with a port: IPv4 only (an IPv6 address's last group is no port).
    let (ip, after) = item.rsplit_once(':')?;
    let ip = ip.parse::<std::net::Ipv4Addr>().ok()?;
    port(after).then_some(IpAddr::V4(ip))
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
        // Mapped IPv4 blocks are IPv4 blocks, as the addresses they are compared with are.
        let mapped = Cidr::parse("::ffff:10.0.0.0/104").unwrap();
        assert!(mapped.contains(ip("10.9.8.7")));
        assert!(mapped.contains(ip("::ffff:10.9.8.7")));
        assert!(!mapped.contains(ip("11.0.0.1")));
        assert!(Cidr::parse("::ffff:10.0.0.5")
            .unwrap()
            .contains(ip("10.0.0.5")));
        assert!(Cidr::parse("::ffff:0.0.0.0/95").is_none());
    }

    /// A hop that names no address, or that a client's bad byte spoiled, must not let the walk
    /// reach an address the client wrote; and a bad byte spoils only the client's own item.
    #[test]
    fn a_hop_without_an_address_ends_the_walk_at_the_proxy_that_wrote_it() {
        let proxies = [Cidr::parse("10.0.0.0/8").unwrap()];
        let from = |value: &[u8], written| {
            let header = match written {
                ForwardedHeader::XForwardedFor => "x-forwarded-for",
                ForwardedHeader::Forwarded => "forwarded",
            };
            let value = actix_web::http::header::HeaderValue::from_bytes(value).unwrap();
            let req = TestRequest::default()
                .peer_addr("10.0.0.1:5000".parse().unwrap())
                .insert_header((header, value))
                .to_srv_request();
            client_ip(&req, &proxies, written).unwrap()
        };
        let (xff, fwd) = (ForwardedHeader::XForwardedFor, ForwardedHeader::Forwarded);
        let commas = format!(
            "a\";for=6.6.6.6;y=, for=203.0.113.7;host=\"{}\"",
            "a,".repeat(40)
        );
        let lines: [(ForwardedHeader, &[u8], &str); 13] = [
            // The client wrote 6.6.6.6; the outer proxy (10.0.0.2) could not name the client.
            (fwd, b"for=6.6.6.6, for=unknown, for=10.0.0.2", "10.0.0.2"),
            (fwd, b"for=6.6.6.6, proto=https;by=10.0.0.2", "10.0.0.1"),
            (xff, b"for=6.6.6.6, _hidden", "10.0.0.1"),
            // The client's own line had a byte that is not text: the address its proxy
            // appended still counts.
            (xff, b"\xff, 203.0.113.7", "203.0.113.7"),
            (fwd, b"for=\xff, for=203.0.113.7", "203.0.113.7"),
            // A proxy's quoted comma is part of its element, not a hop of its own.
            (
                fwd,
                b"for=6.6.6.6, for=203.0.113.7;by=\"a,b\", for=10.0.0.2",
                "203.0.113.7",
            ),
            // A quote the client left open swallows nothing its proxy appended to the line.
            (fwd, b"for=1.2.3.4;by=\", for=203.0.113.7", "203.0.113.7"),
            (fwd, b"for=\"1.2.3.4, for=203.0.113.7", "203.0.113.7"),
            // Nor is a proxy's quoted value split after a client's open quote: its commas and
            // semicolons (a `host=` carrying the client's own Host) are no hops.
            (
                fwd,
                b"for=\"x, for=203.0.113.7;host=\"a,for=6.6.6.6;x=\", for=10.0.0.2",
                "203.0.113.7",
            ),
            (
                fwd,
                b"for=\"x, for=203.0.113.7;by=\"a,b\", for=10.0.0.2",
                "203.0.113.7",
            ),
            // A quote in that Host, escaped by the proxy, or enough commas to pass any bound on
            // how far to look, no more.
            (
                fwd,
                b"for=\"x, for=203.0.113.7;host=\"a,for=6.6.6.6;x=\\\"\", for=10.0.0.2",
                "203.0.113.7",
            ),
            (fwd, commas.as_bytes(), "203.0.113.7"),
            // The same line as X-Forwarded-For has no quotes: its last item is the client.
            (xff, b"6.6.6.6, 203.0.113.7", "203.0.113.7"),
        ];
        for (written, line, caller) in lines {
            let shown = String::from_utf8_lossy(line);
            assert_eq!(from(line, written), ip(caller), "{written:?}: {shown}");
        }
    }

    /// Nodes as RFC 7239 and the usual X-Forwarded-For write them; anything malformed names
    /// no address, and so ends the walk.
    #[test]
    fn a_node_is_an_address_only_when_well_formed() {
        for (node, expected) in [
            ("1.2.3.4", Some("1.2.3.4")),
            ("1.2.3.4:80", Some("1.2.3.4")),
            ("\"1.2.3.4\"", Some("1.2.3.4")),
            ("\"[2001:db8::1]:443\"", Some("2001:db8::1")),
            ("[2001:db8::1]", Some("2001:db8::1")),
            ("[2001:db8::1]:_hidden", Some("2001:db8::1")),
            ("[2001:db8::1]:_p-1", Some("2001:db8::1")),
            ("192.0.2.1:_a.b", Some("192.0.2.1")),
            ("192.0.2.1:65535", Some("192.0.2.1")),
            ("192.0.2.1:123456", None),
            ("192.0.2.1:_", None),
            ("192.0.2.1:_a/b", None),
            ("2001:db8::1", Some("2001:db8::1")),
            ("\"1.2.3.4", None),
            ("1.2.3.4\"", None),
            ("1.2.3.4:notaport", None),
            ("1.2.3.4:", None),
            ("[2001:db8::1]junk", None),
            ("[2001:db8::1]:", None),
            ("2001:db8::1:_x", None),
            ("unknown", None),
            ("_hidden", None),
        ] {
            assert_eq!(parse_node(node), expected.map(ip), "{node}");
        }
    }

    #[test]
    fn forwarding_headers_count_only_from_trusted_proxies() {
        let proxy = [Cidr::parse("127.0.0.1").unwrap()];
        let from = |peer: &str, header: (&str, &str), written: ForwardedHeader| {
            let req = TestRequest::default()
                .peer_addr(format!("{peer}:5000").parse().unwrap())
                .insert_header(header)
                .to_srv_request();
            client_ip(&req, &proxy, written).unwrap()
        };
        let xff = ForwardedHeader::XForwardedFor;
        // A stranger's claim is ignored.
        assert_eq!(
            from("9.9.9.9", ("x-forwarded-for", "1.2.3.4"), xff),
            ip("9.9.9.9")
        );
        // The proxy's is believed: the nearest address that is not a trusted proxy.
        let chain = ("x-forwarded-for", "6.6.6.6, 1.2.3.4, 127.0.0.1");
        assert_eq!(from("127.0.0.1", chain, xff), ip("1.2.3.4"));
        let fwd = ("forwarded", "for=\"[2001:db8::1]:443\";proto=https");
        let written = ForwardedHeader::Forwarded;
        assert_eq!(from("127.0.0.1", fwd, written), ip("2001:db8::1"));
        let unknown = ("forwarded", "for=unknown");
        assert_eq!(from("127.0.0.1", unknown, written), ip("127.0.0.1"));
        // The header the proxies do not write is the client's own: never read.
        assert_eq!(from("127.0.0.1", fwd, xff), ip("127.0.0.1"));
        assert_eq!(from("127.0.0.1", chain, written), ip("127.0.0.1"));
    }

    #[test]
    fn mapped_ipv4_is_the_ipv4_address() {
        let proxy = [Cidr::parse("10.0.0.0/8").unwrap()];
        let req = TestRequest::default()
            .peer_addr("[::ffff:10.1.2.3]:5000".parse().unwrap())
            .insert_header(("x-forwarded-for", "::ffff:203.0.113.7"))
            .to_srv_request();
        let found = client_ip(&req, &proxy, ForwardedHeader::XForwardedFor);
        assert_eq!(found, Some(ip("203.0.113.7")));
        let req = TestRequest::default()
            .peer_addr("[::ffff:192.0.2.1]:5000".parse().unwrap())
            .to_srv_request();
        let found = client_ip(&req, &proxy, ForwardedHeader::XForwardedFor);
        assert_eq!(found, Some(ip("192.0.2.1")));
    }

    #[test]
    fn forwarded_header_names() {
        let parse = ForwardedHeader::parse;
        assert_eq!(
            parse("X-Forwarded-For"),
            Some(ForwardedHeader::XForwardedFor)
        );
        assert_eq!(parse("forwarded"), Some(ForwardedHeader::Forwarded));
        assert_eq!(parse("x-real-ip"), None);
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
            for header in [ForwardedHeader::XForwardedFor, ForwardedHeader::Forwarded] {
                prop_assert!(client_ip(&req, &trusted, header).is_some());
            }
        }
    }
}
