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

/// Where the caller's identity comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySource {
    /// An API key in a request header (`X-Api-Key` by default).
    Header(actix_web::http::header::HeaderName),
    /// The peer's IP address (behind a proxy, every caller would share one: use a header then).
    PeerIp,
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
    #[error("the peer address is unknown")]
    NoPeerAddress,
    #[error("the API key is not known")]
    Unknown,
}

/// A validated caller key. Deliberately not `Display`: it is a secret.
#[derive(Clone, PartialEq, Eq)]
pub struct CallerKey(String);

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
        if value.is_empty() {
            return Err(KeyError::Empty {
                header: header.to_owned(),
            });
        }
        if value.len() > length_max {
            return Err(KeyError::TooLong {
                header: header.to_owned(),
                length_max,
            });
        }
        if !value.iter().all(|b| (0x21..=0x7e).contains(b)) {
            return Err(KeyError::Malformed {
                header: header.to_owned(),
            });
        }
        // Every byte is ASCII, so this cannot fail.
        let key = String::from_utf8(value.to_vec()).expect("visible ASCII is UTF-8");
        Ok(CallerKey(key))
    }

    /// A caller identified by address: the key is the canonical text of the IP.
    pub fn from_ip(ip: IpAddr) -> Self {
        CallerKey(format!("ip:{ip}"))
    }

    /// The secret itself, for plan lookup and account-id derivation only.
    pub fn expose_secret(&self) -> &str {
        &self.0
    }

    /// A short, non-reversible identifier for logs and traces.
    pub fn key_id(&self) -> KeyId {
        let digest = Sha256::digest(self.0.as_bytes());
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

    #[test]
    fn debug_never_shows_the_secret() {
        let key = CallerKey::from_header_value(H, b"super-secret", 64).unwrap();
        let shown = format!("{key:?} {}", key.key_id());
        assert!(!shown.contains("super-secret"), "{shown}");
    }

    proptest! {
        #[test]
        fn accepted_keys_are_exactly_visible_ascii_within_bounds(
            value in proptest::collection::vec(any::<u8>(), 0..40),
            length_max in 1usize..32,
        ) {
            let accepted = CallerKey::from_header_value(H, &value, length_max).is_ok();
            let expected = !value.is_empty()
                && value.len() <= length_max
                && value.iter().all(|b| (0x21..=0x7e).contains(b));
            prop_assert_eq!(accepted, expected);
        }
    }
}
