//! Who is calling: the key extracted from a request, validated before any ledger call.
//!
//! The raw key is a secret. It leaves this module only as a [`KeyId`] (a hash prefix) and as the
//! account id derived from it, both safe to put in logs and traces.

use std::fmt;
use std::net::IpAddr;

use sha2::{Digest, Sha256};
use thiserror::Error;

/// Keys longer than this are refused outright: they are bugs or attacks, and we hash every key.
pub const KEY_LENGTH_MAX_DEFAULT: usize = 128;
/// No configuration may accept keys longer than this.
pub const KEY_LENGTH_MAX_LIMIT: usize = 4096;

/// The one rule for what a key may be, wherever keys come from (requests, the keys file):
/// 1..=`length_max` bytes of visible ASCII (0x21..=0x7e), so a key is never blank, never contains
/// spaces or control characters, and prints the same everywhere.
pub fn is_valid_key(value: &[u8], length_max: usize) -> bool {
    !value.is_empty() && value.len() <= length_max && value.iter().all(u8::is_ascii_graphic)
}

/// Why a request's key was refused. Each maps to a 4xx problem response.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum KeyError {
    #[error("the {header} header is missing")]
    Missing { header: String },
    #[error("the {header} header is empty")]
    Empty { header: String },
    #[error("the {header} header is longer than {length_max} bytes")]
    TooLong { header: String, length_max: usize },
    #[error("the {header} header must be printable ASCII without spaces")]
    Malformed { header: String },
    #[error("the {header} header is given more than once")]
    Repeated { header: String },
    #[error("the {header} header must be `Bearer <key>`")]
    NotBearer { header: String },
    #[error("the peer address is unknown")]
    NoPeerAddress,
    #[error("the API key is not known")]
    Unknown,
}

/// How a caller was identified, which decides how its plan is found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyKind {
    /// An API key: the keys file, then the prefixes, then the unknown-keys rule pick its plan.
    ApiKey,
    /// A network address: `caller.anonymous_plan` (the default plan unless set).
    Address,
}

/// A validated caller key. Deliberately not `Display`: it is a secret.
#[derive(Clone, PartialEq, Eq)]
pub struct CallerKey {
    secret: String,
    kind: KeyKind,
}

impl fmt::Debug for CallerKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CallerKey({})", self.key_id())
    }
}

impl CallerKey {
    /// Validates a raw header value: 1..=length_max bytes of visible ASCII (0x21..=0x7e).
    pub fn from_header_value(
        header: &str,
        value: &[u8],
        length_max: usize,
    ) -> Result<Self, KeyError> {
        if !is_valid_key(value, length_max) {
            let header = header.to_owned();
            return Err(if value.is_empty() {
                KeyError::Empty { header }
            } else if value.len() > length_max {
                KeyError::TooLong { header, length_max }
            } else {
                KeyError::Malformed { header }
            });
        }
        // Visible ASCII is UTF-8: the lossy conversion never replaces anything here.
        let secret = String::from_utf8_lossy(value).into_owned();
        Ok(CallerKey {
            secret,
            kind: KeyKind::ApiKey,
        })
    }

    /// A caller identified by address: the key is `ip ` and the canonical text of the IP. The
    /// space is what no API key may hold ([`is_valid_key`]), so no key spells an address's key
    /// and spends its allowance (the account id, the id cache and every per-key map derive from
    /// these bytes).
    pub fn from_ip(ip: IpAddr) -> Self {
        CallerKey {
            secret: format!("ip {ip}"),
            kind: KeyKind::Address,
        }
    }

    /// A caller identified by its address's network: an IPv4 address alone, an IPv6 one by its
    /// first `ipv6_prefix_bits` bits (`ip 2001:db8:1:2::/64`; 128 is [`CallerKey::from_ip`]).
    /// Why: one IPv6 subscriber is given a /64 (or more), and picks any address in it at will;
    /// counted per address, each one was a fresh allowance.
    ///
    /// `translators`: the /96 prefixes of the deployment's own stateless translators (NAT64,
    /// SIIT), beside the well-known `64:ff9b::/96`: each carries an IPv4 client in its last 32
    /// bits ([`Ipv6Prefix96`]).
    pub fn from_network(ip: IpAddr, ipv6_prefix_bits: u8, translators: &[Ipv6Prefix96]) -> Self {
        assert!(
            (1..=128).contains(&ipv6_prefix_bits),
            "validated by the rules"
        );
        match ip {
            IpAddr::V6(v6) if ipv6_prefix_bits < 128 => match embedded_ipv4(v6, translators) {
                Some(v4) => Self::from_ip(IpAddr::V4(v4)),
                None => Self::from_ipv6_network(v6, ipv6_prefix_bits),
            },
            _ => Self::from_ip(ip),
        }
    }

    fn from_ipv6_network(v6: std::net::Ipv6Addr, ipv6_prefix_bits: u8) -> Self {
        let mask = u128::MAX << (128 - u32::from(ipv6_prefix_bits));
        let network = std::net::Ipv6Addr::from(u128::from(v6) & mask);
        CallerKey {
            secret: format!("ip {network}/{ipv6_prefix_bits}"),
            kind: KeyKind::Address,
        }
    }

    pub fn kind(&self) -> KeyKind {
        self.kind
    }

    /// The secret itself, for plan lookup and account-id derivation only.
    pub fn expose_secret(&self) -> &str {
        &self.secret
    }

    /// A short one-way identifier for logs and traces (a guessable key can still be found by
    /// hashing candidates: README, "Observability").
    pub fn key_id(&self) -> KeyId {
        let digest = Sha256::digest(self.secret.as_bytes());
        let mut id = [0u8; 8];
        id.copy_from_slice(&digest[..8]);
        KeyId(id)
    }
}

/// The first 8 bytes of the key's SHA-256, shown as hex. Safe to log.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct KeyId([u8; 8]);

impl fmt::Display for KeyId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

impl fmt::Debug for KeyId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// A stateless translator's /96 prefix (RFC 6052: the IPv4 address in the last 32 bits), as
/// `caller.ipv4_translation_prefixes` gives it (`64:ff9b:1::/96`, an operator's own).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ipv6Prefix96(u128);

impl Ipv6Prefix96 {
    /// `address/96`, with the last 32 bits 0; `None` otherwise (another length would put the
    /// IPv4 address elsewhere, which this does not read).
    pub fn parse(text: &str) -> Option<Self> {
        let (address, length) = text.split_once('/')?;
        let address: std::net::Ipv6Addr = address.parse().ok()?;
        let bits = u128::from(address);
        (length == "96" && bits as u32 == 0).then_some(Ipv6Prefix96(bits >> 32))
    }
}

/// The IPv4 address an IPv6 one carries, where that IPv4 address is the caller: a stateless
/// translator's (`64:ff9b::/96`, RFC 6052, before IPv6-only servers), 6to4's (`2002::/16`) and
/// Teredo's (`2001::/32`, the client's address inverted in the last 32 bits). Why: counted by
/// its network, every IPv4 client behind one translator, or of one Teredo server, was one
/// caller (one could spend all their allowances), and one 6to4 host was 65,536 callers.
fn embedded_ipv4(
    v6: std::net::Ipv6Addr,
    translators: &[Ipv6Prefix96],
) -> Option<std::net::Ipv4Addr> {
    let bits = u128::from(v6);
    let low = bits as u32; // the last 32 bits
    let prefix = bits >> 32;
    if prefix == 0x0064_ff9b_0000_0000_0000_0000 || translators.iter().any(|t| t.0 == prefix) {
        return Some(low.into());
    }
    if bits >> 112 == 0x2002 {
        return Some(((bits >> 80) as u32).into());
    }
    if bits >> 96 == 0x2001_0000 {
        return Some((!low).into());
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const H: &str = "x-api-key";

    #[test]
    fn key_validation_errors() {
        assert_eq!(
            CallerKey::from_header_value(H, b"", 8),
            Err(KeyError::Empty { header: H.into() })
        );
        assert_eq!(
            CallerKey::from_header_value(H, b"123456789", 8),
            Err(KeyError::TooLong {
                header: H.into(),
                length_max: 8
            })
        );
        assert_eq!(
            CallerKey::from_header_value(H, b"a b", 8),
            Err(KeyError::Malformed { header: H.into() })
        );
        assert_eq!(
            CallerKey::from_header_value(H, "ké".as_bytes(), 8),
            Err(KeyError::Malformed { header: H.into() })
        );
        assert!(CallerKey::from_header_value(H, b"12345678", 8).is_ok());
    }

    /// An IPv6 address that carries an IPv4 caller is that caller, keyed by network (a prefix
    /// below 128; at 128, every address is a caller of its own anyway).
    #[test]
    fn an_ipv6_address_carrying_an_ipv4_caller_is_that_caller() {
        let key = |ip: &str| {
            let ip: IpAddr = ip.parse().unwrap();
            CallerKey::from_network(ip, 64, &[])
                .expose_secret()
                .to_owned()
        };
        // A stateless translator (SIIT-DC): one /64 for every IPv4 client, before.
        assert_eq!(key("64:ff9b::c000:201"), "ip 192.0.2.1");
        assert_eq!(key("64:ff9b::c633:6401"), "ip 198.51.100.1");
        // 6to4: one IPv4 host's /48.
        assert_eq!(key("2002:c000:201:1::5"), "ip 192.0.2.1");
        assert_eq!(key("2002:c000:201:ffff::5"), "ip 192.0.2.1");
        // Teredo: the client's address, inverted (192.0.2.45 behind server 65.54.227.120).
        assert_eq!(key("2001:0:4136:e378:8000:63bf:3fff:fdd2"), "ip 192.0.2.45");
        // Anything else is its network.
        assert_eq!(key("2001:db8:1:2::5"), "ip 2001:db8:1:2::/64");
        // A deployment's own translator (RFC 8215's local-use prefix, here), when configured.
        let own = Ipv6Prefix96::parse("64:ff9b:1::/96").unwrap();
        let translated = |ip: &str| {
            let key = CallerKey::from_network(ip.parse().unwrap(), 64, &[own]);
            key.expose_secret().to_owned()
        };
        assert_eq!(
            key("64:ff9b:1::c000:201"),
            "ip 64:ff9b:1::/64",
            "not configured"
        );
        assert_eq!(translated("64:ff9b:1::c000:201"), "ip 192.0.2.1");
        assert_eq!(translated("64:ff9b:1::c633:6401"), "ip 198.51.100.1");
        assert_eq!(
            translated("64:ff9b:1:0:1::5"),
            "ip 64:ff9b:1::/64",
            "outside the /96"
        );
        for bad in [
            "64:ff9b:1::/64",
            "64:ff9b:1::1/96",
            "10.0.0.0/96",
            "64:ff9b:1::",
            "x/96",
        ] {
            assert_eq!(Ipv6Prefix96::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn debug_never_shows_the_secret() {
        let key = CallerKey::from_header_value(H, b"super-secret", 64).unwrap();
        let shown = format!("{key:?} {}", key.key_id());
        assert!(!shown.contains("super-secret"), "{shown}");
    }

    proptest! {
        #[test]
        fn accepted_keys_are_exactly_visible_ascii_within_bounds(
            // Any bytes, and visible ASCII of every length around the bound (rare among any
            // bytes: about 1 % of those are accepted, nearly all 1 to 3 bytes long).
            value in prop_oneof![
                proptest::collection::vec(any::<u8>(), 0..40),
                proptest::collection::vec(0x21u8..=0x7e, 0..40),
            ],
            length_max in 1usize..32,
        ) {
            let accepted = CallerKey::from_header_value(H, &value, length_max).is_ok();
            // Spelled out independently of `is_valid_key`: 0x21..=0x7e is visible ASCII.
            let expected = !value.is_empty()
                && value.len() <= length_max
                && value.iter().all(|b| (0x21..=0x7e).contains(b));
            prop_assert_eq!(accepted, expected);
        }

        #[test]
        fn an_ipv6_network_is_one_caller_and_ipv4_addresses_are_each_one(
            v6 in any::<u128>(),
            host in any::<u64>(),
            v4 in any::<u32>(),
            bits in 1u8..=128,
        ) {
            let network = |ip: u128| {
                let key = CallerKey::from_network(IpAddr::V6(ip.into()), bits, &[]);
                key.expose_secret().to_owned()
            };
            let mask = u128::MAX.checked_shl(128 - u32::from(bits)).unwrap_or(0);
            let same_network = (v6 & mask) | (u128::from(host) & !mask);
            let other_network = v6 ^ (1u128 << (128 - u32::from(bits)));
            // Addresses that carry an IPv4 caller are that caller (below).
            let embedding = |ip: u128| embedded_ipv4(ip.into(), &[]).is_some();
            prop_assume!(![v6, same_network, other_network].into_iter().any(embedding));
            prop_assert_eq!(network(v6), network(same_network));
            // One bit inside the prefix apart: another caller.
            prop_assert_ne!(network(v6), network(other_network));
            let v4 = IpAddr::V4(v4.into());
            let by_network = CallerKey::from_network(v4, bits, &[]);
            let alone = CallerKey::from_ip(v4);
            prop_assert_eq!(by_network.expose_secret(), alone.expose_secret());
        }

        #[test]
        fn no_api_key_spells_an_address(
            ip in any::<std::net::IpAddr>(),
            spelling in prop_oneof![Just("ip:"), Just("ip "), Just("ip"), Just("")],
        ) {
            let address = CallerKey::from_ip(ip);
            let typed = format!("{spelling}{ip}");
            if let Ok(key) = CallerKey::from_header_value(H, typed.as_bytes(), 128) {
                prop_assert_ne!(key.expose_secret(), address.expose_secret());
                prop_assert_ne!(key.key_id(), address.key_id());
            }
            // The address's own bytes are never a key.
            let own = address.expose_secret().as_bytes();
            prop_assert!(CallerKey::from_header_value(H, own, 128).is_err());
        }
    }
}
