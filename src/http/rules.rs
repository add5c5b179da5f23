//! What the HTTP adapter asks of every request before the limiter sees it: is the path exempt, who
//! is calling, and what does this route cost. Built only through [`RequestRulesBuilder`], which
//! makes the same checks the configuration file gets, so a library user cannot bypass them.

use std::borrow::Cow;
use std::collections::HashMap;
use std::num::NonZeroU64;
use std::sync::Arc;

use actix_web::dev::ServiceRequest;
use actix_web::http::header::{HeaderName, HeaderValue, AUTHORIZATION};
use actix_web::http::StatusCode;
use thiserror::Error;

use super::client_ip::{client_ip, Cidr, ForwardedHeader};
use super::headers::{bearer_token, HeaderStyles};

use crate::limiter::caller::{
    CallerKey, Ipv6Prefix96, KeyError, KEY_LENGTH_MAX_DEFAULT, KEY_LENGTH_MAX_LIMIT,
};
use crate::limiter::extra::ROUTE_LIMITS_MAX;
use crate::limiter::plan::{Plan, PlanBook};

/// The header that carries the API key unless configured otherwise.
pub const KEY_HEADER_DEFAULT: &str = "x-api-key";
/// How many leading bits of an IPv6 address name a caller by default: a /64 is what one
/// subscriber is given (RFC 6177), and any address in it is theirs to use.
pub const IPV6_PREFIX_BITS_DEFAULT: u8 = 64;

/// Where the caller's identity comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySource {
    /// An API key in a request header (`X-Api-Key` by default).
    Header(HeaderName),
    /// The caller's address: the peer's, or what a trusted proxy forwarded for.
    PeerIp,
    /// The API key in this header if the request has one, else the caller's address (an
    /// anonymous tier, on its own plan).
    HeaderOrPeerIp(HeaderName),
}

/// A request, as the limiter needs to know it.
#[derive(Debug)]
pub enum Classified {
    /// Not rate-limited at all.
    Exempt,
    /// No usable key: answered 400/401 before any ledger call.
    Rejected(KeyError),
    /// Charge `cost` units to `key`; in `shadow` mode a refusal is recorded but not enforced.
    Charge {
        key: CallerKey,
        cost: NonZeroU64,
        shadow: bool,
        /// Give the credit back if the handler answers with a server error (5xx).
        refund: bool,
        /// The route's further limits, charged with the plan atomically (usually none). Shared
        /// with the rules, so the request's future keeps them without finding them again.
        limits: Option<Arc<[Plan]>>,
    },
}

/// Exempt paths, the key source and route costs. See [`RequestRules::builder`].
#[derive(Debug, Clone)]
pub struct RequestRules {
    key_source: KeySource,
    key_length_max: usize,
    /// Exact paths, or prefixes ending in `*`.
    exempt_paths: Vec<String>,
    route_costs: RouteCosts,
    /// Exact paths, or prefixes ending in `*`, decided as usual but never refused.
    shadow_paths: Vec<String>,
    /// Exact paths, or prefixes ending in `*`, whose 5xx answers give the caller's credit back.
    refund_paths: Vec<String>,
    header_styles: HeaderStyles,
    missing_key_status: StatusCode,
    /// Proxies whose `X-Forwarded-For` / `Forwarded` are believed; nobody else's are.
    trusted_proxies: Vec<Cidr>,
    /// The one header the trusted proxies name the caller in.
    forwarded_header: ForwardedHeader,
    /// How many leading bits of an IPv6 address name its caller (an IPv4 address is one).
    ipv6_prefix_bits: u8,
    /// The deployment's own stateless translators: their addresses are the IPv4 clients they carry.
    translators: Box<[Ipv6Prefix96]>,
    /// Routes (exact, or prefixes ending in `*`) charged against further limits; first match.
    route_limits: Vec<(String, Arc<[Plan]>)>,
    /// A response header in which handlers report what a request actually cost.
    cost_header: Option<HeaderName>,
    /// `WWW-Authenticate` for a 401 (RFC 9110 asks one of every 401): how to present a key.
    challenge: Option<HeaderValue>,
}

impl RequestRules {
    /// Defaults: the key in `X-Api-Key`, at most 128 bytes, nothing exempt, every route costs 1.
    pub fn builder() -> RequestRulesBuilder {
        RequestRulesBuilder::default()
    }

    /// Exempt, rejected or a charge: no ledger call is needed to tell.
    pub fn classify(&self, req: &ServiceRequest) -> Classified {
        // The path the router matches: percent-decoded, so `/%72eports` is `/reports` here too
        // and cannot dodge the route's cost, limits or shadow and refund rules.
        let path = req.match_info().as_str();
        if self.exempt_paths.iter().any(|p| path_matches(p, path)) {
            return Classified::Exempt;
        }
        // Read once for both: `None` when it is the routed path itself (no kept escape).
        let decoded = decoded_path(path);
        let decoded = match &decoded {
            Cow::Owned(decoded) => Some(decoded.as_str()),
            Cow::Borrowed(_) => None,
        };
        match self.caller_key(req) {
            Ok(key) => Classified::Charge {
                key,
                cost: self.cost(path, decoded),
                shadow: self.shadow_paths.iter().any(|p| path_matches(p, path)),
                refund: self.refund_paths.iter().any(|p| path_matches(p, path)),
                limits: self.limits(path, decoded),
            },
            Err(error) => Classified::Rejected(error),
        }
    }

    /// The route's cost: the higher of the routed path's and the decoded path's (`decoded`:
    /// [`decoded_path`], when it differs), so that `/api/admin%2Fexport` on a route
    /// `/api/{tail:.*}` (whose handler reads `admin/export`) costs what `/api/admin/*` does.
    fn cost(&self, path: &str, decoded: Option<&str>) -> NonZeroU64 {
        let routed = self.route_costs.cost(path);
        decoded.map_or(routed, |decoded| routed.max(self.route_costs.cost(decoded)))
    }

    /// The route limits of the routed path and of the decoded one (what the handler reads,
    /// [`RequestRules::cost`]): each limit of either, once (two routes may name one limit), the
    /// decoded path's first, so at most twice [`ROUTE_LIMITS_MAX`]. One form's alone, an escape
    /// could trade a route's strict limit for a lax one's.
    fn limits(&self, path: &str, decoded: Option<&str>) -> Option<Arc<[Plan]>> {
        let routed = self.route_limits(path);
        let Some(decoded) = decoded else {
            return routed.cloned();
        };
        match (self.route_limits(decoded), routed) {
            (Some(first), Some(then)) if !Arc::ptr_eq(first, then) => {
                let mut both = first.to_vec();
                let new = |plan: &&Plan| !first.iter().any(|had| had.name() == plan.name());
                both.extend(then.iter().filter(new).cloned());
                Some(both.into())
            }
            (first, then) => first.or(then).cloned(),
        }
    }

    /// The further limits of the route `path` is on (`None` for nearly every route).
    fn route_limits(&self, path: &str) -> Option<&Arc<[Plan]>> {
        let found = self
            .route_limits
            .iter()
            .find(|(p, _)| path_matches(p, path));
        found.map(|(_, limits)| limits)
    }

    /// The response header in which handlers report a request's actual cost, if configured.
    pub fn cost_header(&self) -> Option<&HeaderName> {
        self.cost_header.as_ref()
    }

    /// Which rate-limit header fields responses carry.
    pub fn header_styles(&self) -> HeaderStyles {
        self.header_styles
    }

    /// The status of a request without a key (401 unless configured 400).
    pub fn missing_key_status(&self) -> StatusCode {
        self.missing_key_status
    }

    /// What a 401 answers in `WWW-Authenticate`: `Bearer` when the key is the `Authorization`
    /// token, else `ApiKey header="<name>"`; none when callers are known by address only.
    pub fn challenge(&self) -> Option<&HeaderValue> {
        self.challenge.as_ref()
    }

    /// Identifies the caller, before any ledger call.
    pub fn caller_key(&self, req: &ServiceRequest) -> Result<CallerKey, KeyError> {
        match &self.key_source {
            KeySource::HeaderOrPeerIp(name) if !req.headers().contains_key(name) => {
                self.address(req)
            }
            KeySource::Header(name) | KeySource::HeaderOrPeerIp(name) => {
                let mut values = req.headers().get_all(name);
                let header = name.as_str();
                let value = values.next().ok_or_else(|| KeyError::Missing {
                    header: header.to_owned(),
                })?;
                if values.next().is_some() {
                    return Err(KeyError::Repeated {
                        header: header.to_owned(),
                    });
                }
                // Keyed by a bearer token: the key is the token, not the scheme before it.
                let value = match (*name == AUTHORIZATION, bearer_token(value.as_bytes())) {
                    (false, _) => value.as_bytes(),
                    (true, Some(token)) => token,
                    // Another scheme's credentials are none of ours: a caller without a key
                    // (RFC 6750 §3.1), its address where that names it (a browser's Basic).
                    (true, None) if matches!(self.key_source, KeySource::HeaderOrPeerIp(_)) => {
                        return self.address(req);
                    }
                    (true, None) => {
                        let header = header.to_owned();
                        return Err(KeyError::NotBearer { header });
                    }
                };
                CallerKey::from_header_value(header, value, self.key_length_max)
            }
            KeySource::PeerIp => self.address(req),
        }
    }

    fn address(&self, req: &ServiceRequest) -> Result<CallerKey, KeyError> {
        client_ip(req, &self.trusted_proxies, self.forwarded_header)
            .map(|ip| CallerKey::from_network(ip, self.ipv6_prefix_bits, &self.translators))
            .ok_or(KeyError::NoPeerAddress)
    }

    pub fn key_source(&self) -> &KeySource {
        &self.key_source
    }

    /// A key an operator names (the admin API, the command line), held to what a request's key
    /// is held to: a key the middleware refuses (too long; any key where callers are known by
    /// their address alone) names no caller, and its account would be one no request reaches.
    pub fn operator_key(&self, key: &[u8]) -> Result<CallerKey, OperatorKeyError> {
        if matches!(self.key_source, KeySource::PeerIp) {
            return Err(OperatorKeyError::ByAddress);
        }
        CallerKey::from_header_value("key", key, self.key_length_max)
            .map_err(|_| OperatorKeyError::Invalid)
    }

    /// The caller a request from `ip` is (where callers are known by their address), as the
    /// middleware names it: IPv4-mapped addresses as IPv4, an IPv6 one by its network, one a
    /// translator carries by its IPv4 address. For the admin API's lookups and moves.
    pub fn address_key(&self, ip: std::net::IpAddr) -> CallerKey {
        let ip = ip.to_canonical();
        CallerKey::from_network(ip, self.ipv6_prefix_bits, &self.translators)
    }
}

/// `path` (a routed path) with the escapes actix's router keeps (`%2F`, `%2B`, `%25`) decoded, as
/// a handler's path extractors decode them: borrowed when there are none. Rules that restrict
/// look at it too, so that an escaped `/` in a path parameter cannot dodge them (a cost: the
/// higher of both forms'; route limits: both forms'; concurrency: the route with fewer slots);
/// rules that waive (exempt, shadow, refunds) only at the routed path, so that an escape cannot
/// earn them.
pub fn decoded_path(path: &str) -> Cow<'_, str> {
    let kept = |at: usize| match path.as_bytes().get(at + 1..at + 3) {
        Some([b'2', b'F' | b'f']) => Some(b'/'),
        Some([b'2', b'B' | b'b']) => Some(b'+'),
        Some([b'2', b'5']) => Some(b'%'),
        _ => None,
    };
    let bytes = path.as_bytes();
    let Some(first) = (0..bytes.len()).find(|&at| bytes[at] == b'%' && kept(at).is_some()) else {
        return Cow::Borrowed(path);
    };
    let mut decoded = bytes[..first].to_vec();
    let mut at = first;
    while at < bytes.len() {
        match (bytes[at] == b'%').then(|| kept(at)).flatten() {
            Some(byte) => {
                decoded.push(byte);
                at += 3;
            }
            None => {
                decoded.push(bytes[at]);
                at += 1;
            }
        }
    }
    // ASCII escapes replaced by ASCII bytes: still UTF-8.
    Cow::Owned(String::from_utf8(decoded).expect("ASCII for ASCII"))
}

/// Whether `path` is on the route `pattern` (an exact path, or a `prefix*`).
pub fn path_matches(pattern: &str, path: &str) -> bool {
    let (fixed, head) = match pattern.strip_suffix('*') {
        Some(prefix) => (prefix, path.as_bytes().get(..prefix.len())),
        None => (pattern, Some(path.as_bytes())),
    };
    let Some(head) = head else { return false };
    if !fixed.contains('%') {
        return fixed.as_bytes() == head;
    }
    // actix keeps `%2F`, `%25` and `%2B` as the client wrote them, and either case of their hex
    // digits means the same (RFC 3986 §2.1): `/a%2fb` must not dodge a rule on `/a%2Fb`.
    let mut hex_left: u8 = 0;
    fixed.len() == head.len()
        && fixed.bytes().zip(head).all(|(a, b)| {
            let same = match hex_left > 0 {
                true => a.eq_ignore_ascii_case(b),
                false => a == *b,
            };
            hex_left = if a == b'%' {
                2
            } else {
                hex_left.saturating_sub(1)
            };
            same
        })
}

/// `text` with the hex digits of its percent-escapes in upper case (`%2f` → `%2F`): a path's
/// kept escapes (`%2F`, `%25`, `%2B`) mean the same in either case. Borrowed when there is no
/// `%` (nearly every path).
/// Why a pattern is refused beside `earlier`, which [`first_twice`] found matching its paths.
pub fn again(earlier: &str) -> String {
    format!("is {earlier:?} again (percent-escapes match in either case)")
}

/// The first pattern of `patterns` that matches the same paths as one before it (they differ in
/// the case of a percent-escape alone, `%2f` and `%2F`), with that earlier one: two such entries
/// of one table were one rule, and which of them applied was the table's order's, silently.
pub fn first_twice<'a>(patterns: impl IntoIterator<Item = &'a str>) -> Option<(&'a str, &'a str)> {
    let mut seen: Vec<&str> = Vec::new();
    for pattern in patterns {
        let same = |other: &&&str| upper_escapes(other) == upper_escapes(pattern);
        if let Some(earlier) = seen.iter().find(same) {
            return Some((pattern, earlier));
        }
        seen.push(pattern);
    }
    None
}

fn upper_escapes(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.contains('%') {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut bytes = text.as_bytes().to_vec();
    for at in 0..bytes.len() {
        if bytes[at] == b'%' {
            for digit in bytes.iter_mut().skip(at + 1).take(2) {
                digit.make_ascii_uppercase();
            }
        }
    }
    // Only ASCII letters changed: still UTF-8.
    std::borrow::Cow::Owned(String::from_utf8(bytes).expect("ASCII changed only"))
}

/// The exempt pattern that takes every path `pattern` matches, if one does: an exact exempt
/// path the same exact pattern, or an exempt prefix the pattern's own text starts with.
pub fn exempt_over<'e>(exempt: &'e [String], pattern: &str) -> Option<&'e str> {
    let body = pattern.strip_suffix('*');
    exempt.iter().map(String::as_str).find(|exempt| {
        match exempt.ends_with('*') {
            // Every path a prefix pattern matches starts with its own text.
            true => path_matches(exempt, body.unwrap_or(pattern)),
            false => body.is_none() && path_matches(exempt, pattern),
        }
    })
}

/// What [`is_route_pattern`] asks, for the errors that name a pattern.
pub const ROUTE_PATTERN_RULE: &str = "must start with /, with a `*` only at its end, and \
    no `{`, `}`, `?`, `#` or white space (paths are compared as written: no placeholders), and \
    no percent-escape but `%2F`, `%25` and `%2B` (paths are compared decoded: write `/café`, \
    not `/caf%C3%A9`)";

/// A route pattern as the configuration writes it: starts with `/`, and `*` (a prefix) only at
/// its end. Elsewhere a `*` would be compared literally and never match, silently; so would an
/// actix placeholder (`/reports/{id}`), a query or fragment, or white space; and so would a
/// percent-escape that actix decodes before rules see the path (all but `/`, `%` and `+`).
pub fn is_route_pattern(pattern: &str) -> bool {
    let body = pattern.strip_suffix('*').unwrap_or(pattern);
    let never_in_a_path = |c: char| matches!(c, '*' | '{' | '}' | '?' | '#') || c.is_whitespace();
    let kept_encoded = |escape: &str| {
        let code = escape.get(1..3).map(str::to_ascii_uppercase);
        matches!(code.as_deref(), Some("2F" | "25" | "2B"))
    };
    let escapes_kept = body
        .match_indices('%')
        .all(|(at, _)| kept_encoded(&body[at..]));
    pattern.starts_with('/') && !body.contains(never_in_a_path) && escapes_kept
}

/// Orders patterns so that the first that matches a path is the most specific: exact paths
/// first, then prefixes, longest first (as route costs are chosen). In the configuration's
/// order, `/upload*` came before `/upload/big` and took its requests.
pub fn most_specific_first<T>(patterns: &mut [(String, T)]) {
    patterns.sort_by_key(|(pattern, _)| match pattern.strip_suffix('*') {
        None => (0, 0),
        Some(prefix) => (1, usize::MAX - prefix.len()),
    });
}

/// The cost of a request by path: exact paths first, then the longest matching `prefix*`, then 1.
#[derive(Debug, Clone, Default)]
struct RouteCosts {
    /// A fast hash: its keys come from the configuration, so a request's path cannot make them
    /// collide, and SipHash was a tenth of a refusal's classification.
    exact: HashMap<String, NonZeroU64, foldhash::fast::RandomState>,
    /// Longest first.
    prefixes: Vec<(String, NonZeroU64)>,
}

impl RouteCosts {
    fn new(costs: impl IntoIterator<Item = (String, NonZeroU64)>) -> Self {
        let mut exact = HashMap::default();
        let mut prefixes = Vec::new();
        for (pattern, cost) in costs {
            // Kept escapes in one case, as the request's path is looked up (`cost`).
            let pattern = upper_escapes(&pattern).into_owned();
            match pattern.strip_suffix('*') {
                Some(prefix) => prefixes.push((prefix.to_owned(), cost)),
                None => {
                    exact.insert(pattern, cost);
                }
            }
        }
        prefixes.sort_by_key(|(prefix, _)| std::cmp::Reverse(prefix.len()));
        RouteCosts { exact, prefixes }
    }

    /// The highest cost of any path `pattern` matches: the cost that applies to the pattern as a
    /// whole, and for a prefix, every exact path and narrower prefix with a cost of its own,
    /// written plainly or with an escape (`/a%2F*` is charged on `/a/x` too: `RequestRules::cost`).
    fn cost_max_under(&self, pattern: &str) -> NonZeroU64 {
        let pattern = &*upper_escapes(pattern);
        let own = self.cost(pattern);
        let Some(prefix) = pattern.strip_suffix('*') else {
            return own;
        };
        let under = |path: &str| path.starts_with(prefix) || decoded_path(path).starts_with(prefix);
        let exact = (self.exact.iter())
            .filter(|(path, _)| under(path))
            .map(|(_, cost)| *cost);
        let narrower = (self.prefixes.iter())
            .filter(|(other, _)| under(other))
            .map(|(_, cost)| *cost);
        exact.chain(narrower).fold(own, NonZeroU64::max)
    }

    fn cost(&self, path: &str) -> NonZeroU64 {
        let path = &*upper_escapes(path);
        if let Some(cost) = self.exact.get(path) {
            return *cost;
        }
        self.prefixes
            .iter()
            .find(|(prefix, _)| path.starts_with(prefix.as_str()))
            .map(|(_, cost)| *cost)
            .unwrap_or(NonZeroU64::MIN)
    }
}

/// Why a key an operator named names no caller ([`RequestRules::operator_key`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum OperatorKeyError {
    #[error("callers are known by their address here, not a key")]
    ByAddress,
    #[error("not a valid key (visible ASCII, up to caller.key_length_max bytes)")]
    Invalid,
}

/// `routes.cost_header`'s field: a valid name, and one of the handler's own.
fn cost_header(name: String) -> Result<HeaderName, RulesError> {
    match HeaderName::try_from(name.as_str()) {
        Err(_) => Err(RulesError::CostHeader(name)),
        Ok(header) if is_standard_field(&header) => Err(RulesError::CostHeaderStandard(name)),
        Ok(header) => Ok(header),
    }
}

/// Response fields HTTP gives a meaning (representation, framing, caching, cookies, hop by hop)
/// or this limiter writes (its header styles, `Retry-After`): none may be the cost header.
fn is_standard_field(name: &HeaderName) -> bool {
    const FIELDS: [&str; 24] = [
        "age",
        "allow",
        "cache-control",
        "connection",
        "content-disposition",
        "content-encoding",
        "content-language",
        "content-length",
        "content-location",
        "content-range",
        "content-type",
        "date",
        "etag",
        "expires",
        "keep-alive",
        "last-modified",
        "location",
        "retry-after",
        "server",
        "set-cookie",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "vary",
    ];
    use super::headers::{
        RATELIMIT, RATELIMIT_POLICY, X_RATELIMIT_LIMIT, X_RATELIMIT_REMAINING, X_RATELIMIT_RESET,
        X_RATELIMIT_USED, X_RATE_LIMIT_REMAINING, X_RATE_LIMIT_RETRY_AFTER_SECONDS,
    };
    // What this limiter writes, each style's fields (a field of one's own beside them, such as
    // `x-ratelimit-cost`, is the handler's to name).
    let ours = [
        RATELIMIT,
        RATELIMIT_POLICY,
        X_RATELIMIT_LIMIT,
        X_RATELIMIT_REMAINING,
        X_RATELIMIT_RESET,
        X_RATELIMIT_USED,
        X_RATE_LIMIT_REMAINING,
        X_RATE_LIMIT_RETRY_AFTER_SECONDS,
        actix_web::http::header::WWW_AUTHENTICATE,
    ];
    FIELDS.contains(&name.as_str()) || ours.contains(name)
}

/// A rule the builder refused. [`RulesError::setting`] names the configuration setting at fault.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum RulesError {
    #[error("{0:?} is not a valid header name")]
    KeyHeader(String),
    #[error("must be between 1 and {KEY_LENGTH_MAX_LIMIT}")]
    KeyLengthMax,
    #[error("{0} is not between 1 and 128")]
    Ipv6PrefixBits(u8),
    #[error("{0:?} is not an IPv6 /96 prefix such as \"64:ff9b:1::/96\"")]
    Translator(String),
    #[error("{0:?} {ROUTE_PATTERN_RULE}")]
    ExemptPath(String),
    #[error("{0:?} {ROUTE_PATTERN_RULE}")]
    ShadowPath(String),
    #[error("{0:?} {ROUTE_PATTERN_RULE}")]
    RefundPath(String),
    #[error("{0:?} is not one of \"ietf\", \"github\", \"bucket4j\" (and at least one is needed)")]
    HeaderStyle(String),
    #[error("{0} is neither 401 nor 400")]
    MissingKeyStatus(u16),
    #[error("{0:?} is not an address or an address block such as 10.0.0.0/8")]
    TrustedProxy(String),
    #[error(
        "{0:?} is wider than any network of proxies (IPv4 from /8, IPv6 from /7): trusted, it \
         believes what clients write in their forwarding headers, and a client could spend \
         whose allowance it likes; list your proxies' addresses or blocks"
    )]
    TrustedTooWide(String),
    #[error("route {0:?} {ROUTE_PATTERN_RULE}")]
    CostRoute(String),
    /// Two patterns one path matches alike (`%2f` and `%2F`): the last one's cost was kept,
    /// without a word.
    #[error("route {:?} {}", .0, again(.1))]
    CostRouteTwice(String, String),
    #[error("route {0:?} {1}")]
    RouteLimits(String, String),
    #[error("{0:?} is not a valid header name")]
    CostHeader(String),
    /// The cost header is removed from every response: a field HTTP or this limiter gives a
    /// meaning of its own would be lost, and read as a cost.
    #[error("{0:?} is a standard response field (it would be removed from every response and read as a cost): name a field of your own, such as x-cost")]
    CostHeaderStandard(String),
    /// A reported cost replaces the request's hold; a request admitted from a lease has none,
    /// and was silently charged its estimate.
    #[error("cannot be charged on plan {0:?}, whose requests are admitted from leases (a reported cost replaces a request's own hold, and a lease admission has none): drop the plan's lease, or the cost header")]
    CostHeaderWithLeases(String),
    #[error("must be at least 1")]
    CostZero(String),
    #[error("cost {cost} exceeds the smallest plan capacity ({capacity}): such a request could never be admitted")]
    CostAboveCapacity {
        route: String,
        cost: u64,
        capacity: u64,
    },
    /// A rule on paths that `routes.exempt` takes first: it would never apply.
    #[error("{route:?} is exempt (routes.exempt {exempt:?}): the rule would never apply")]
    UnderExempt {
        setting: &'static str,
        route: String,
        exempt: String,
    },
}

impl RulesError {
    /// The configuration setting this rule comes from.
    pub fn setting(&self) -> String {
        match self {
            RulesError::KeyHeader(_) => "caller.header".to_owned(),
            RulesError::KeyLengthMax => "caller.key_length_max".to_owned(),
            RulesError::Ipv6PrefixBits(_) => "caller.ipv6_prefix_length".to_owned(),
            RulesError::Translator(_) => "caller.ipv4_translation_prefixes".to_owned(),
            RulesError::ExemptPath(_) => "routes.exempt".to_owned(),
            RulesError::ShadowPath(_) => "routes.shadow".to_owned(),
            RulesError::RefundPath(_) => "routes.refund_server_errors".to_owned(),
            RulesError::HeaderStyle(_) => "response.header_styles".to_owned(),
            RulesError::RouteLimits(..) => "routes.limits".to_owned(),
            RulesError::CostHeader(_)
            | RulesError::CostHeaderStandard(_)
            | RulesError::CostHeaderWithLeases(_) => "routes.cost_header".to_owned(),
            RulesError::MissingKeyStatus(_) => "response.missing_key_status".to_owned(),
            RulesError::TrustedProxy(_) | RulesError::TrustedTooWide(_) => {
                "caller.trusted_proxies".to_owned()
            }
            RulesError::CostRoute(route)
            | RulesError::CostRouteTwice(route, _)
            | RulesError::CostZero(route)
            | RulesError::CostAboveCapacity { route, .. } => format!("routes.costs.\"{route}\""),
            RulesError::UnderExempt { setting, route, .. } => match *setting {
                "routes.costs" | "routes.limits" => format!("{setting}.\"{route}\""),
                _ => (*setting).to_owned(),
            },
        }
    }
}

/// Collects rules; [`RequestRulesBuilder::build`] checks them all against the plans.
#[derive(Debug, Clone)]
pub struct RequestRulesBuilder {
    key_header: Option<String>,
    /// With a key header: callers without the header are known by their address.
    anonymous: bool,
    trusted_proxies: Vec<String>,
    forwarded_header: ForwardedHeader,
    ipv6_prefix_bits: u8,
    translators: Vec<String>,
    key_length_max: usize,
    exempt_paths: Vec<String>,
    costs: Vec<(String, u64)>,
    shadow_paths: Vec<String>,
    refund_paths: Vec<String>,
    header_styles: Option<Vec<String>>,
    missing_key_status: u16,
    route_limits: Vec<(String, Vec<Plan>)>,
    cost_header: Option<String>,
}

impl Default for RequestRulesBuilder {
    fn default() -> Self {
        RequestRulesBuilder {
            key_header: Some(KEY_HEADER_DEFAULT.to_owned()),
            anonymous: false,
            trusted_proxies: Vec::new(),
            forwarded_header: ForwardedHeader::default(),
            ipv6_prefix_bits: IPV6_PREFIX_BITS_DEFAULT,
            translators: Vec::new(),
            key_length_max: KEY_LENGTH_MAX_DEFAULT,
            exempt_paths: Vec::new(),
            costs: Vec::new(),
            shadow_paths: Vec::new(),
            refund_paths: Vec::new(),
            header_styles: None,
            missing_key_status: 401,
            route_limits: Vec::new(),
            cost_header: None,
        }
    }
}

impl RequestRulesBuilder {
    /// Callers are named by an API key in this header.
    pub fn key_header(mut self, name: impl Into<String>) -> Self {
        self.key_header = Some(name.into());
        self
    }

    /// Callers are named by their address (all on the address plan: the default plan unless
    /// [`PlanBook::with_address_plan`] says otherwise).
    pub fn peer_ip(mut self) -> Self {
        self.key_header = None;
        self
    }

    /// Callers are named by an API key in this header when they send one, else by their address.
    pub fn key_header_or_peer_ip(mut self, name: impl Into<String>) -> Self {
        self.key_header = Some(name.into());
        self.anonymous = true;
        self
    }

    /// A proxy (an address or a block such as `10.0.0.0/8`) whose forwarding headers name the
    /// caller's address. No proxy is trusted by default.
    pub fn trusted_proxy(mut self, cidr: impl Into<String>) -> Self {
        self.trusted_proxies.push(cidr.into());
        self
    }

    /// The header the trusted proxies write (`X-Forwarded-For` unless set); the other is ignored.
    pub fn forwarded_header(mut self, header: ForwardedHeader) -> Self {
        self.forwarded_header = header;
        self
    }

    /// How many leading bits of an IPv6 address name a caller known by its address (64 unless
    /// set: a subscriber's usual allocation; 128: each address alone).
    /// The /96 prefixes (`64:ff9b:1::/96`) of the deployment's own stateless translators,
    /// beside the well-known `64:ff9b::/96`: an address in one is the IPv4 client it carries.
    pub fn ipv4_translation_prefixes(mut self, prefixes: Vec<String>) -> Self {
        self.translators = prefixes;
        self
    }

    pub fn ipv6_prefix_bits(mut self, bits: u8) -> Self {
        self.ipv6_prefix_bits = bits;
        self
    }

    pub fn key_length_max(mut self, bytes: usize) -> Self {
        self.key_length_max = bytes;
        self
    }

    /// An exact path, or a prefix ending in `*`, that bypasses the limiter.
    pub fn exempt(mut self, pattern: impl Into<String>) -> Self {
        self.exempt_paths.push(pattern.into());
        self
    }

    /// A path (exact, or a prefix ending in `*`; `/*` for every path) in shadow mode: decided,
    /// counted and held exactly as usual, but a refusal lets the request through.
    pub fn shadow(mut self, pattern: impl Into<String>) -> Self {
        self.shadow_paths.push(pattern.into());
        self
    }

    /// A path (exact, or a prefix ending in `*`) whose server errors (5xx) give the caller's
    /// credit back: the hold is voided, so callers are not charged for our failures.
    pub fn refund_server_errors(mut self, pattern: impl Into<String>) -> Self {
        self.refund_paths.push(pattern.into());
        self
    }

    /// Rate-limit header fields by name: `ietf` (`RateLimit`, `RateLimit-Policy`; the default),
    /// `github` (`X-RateLimit-Limit`, `-Remaining`, `-Reset` in epoch seconds, `-Used`),
    /// `bucket4j` (`X-Rate-Limit-Remaining`, `X-Rate-Limit-Retry-After-Seconds` on a refusal).
    pub fn header_styles<S: Into<String>>(mut self, styles: impl IntoIterator<Item = S>) -> Self {
        self.header_styles = Some(styles.into_iter().map(Into::into).collect());
        self
    }

    /// 401 (the default) or 400 for a request without a key.
    pub fn missing_key_status(mut self, status: u16) -> Self {
        self.missing_key_status = status;
        self
    }

    /// Requests to `route` (exact, or a prefix ending in `*`) are charged against these limits as
    /// well as the caller's plan, all or none (for example 10 per second and 10,000 per day).
    pub fn limits(mut self, route: impl Into<String>, limits: Vec<Plan>) -> Self {
        self.route_limits.push((route.into(), limits));
        self
    }

    /// Handlers may report a request's actual cost in this response header (digits); the
    /// middleware removes it and charges that instead of the route's cost.
    pub fn cost_header(mut self, name: impl Into<String>) -> Self {
        self.cost_header = Some(name.into());
        self
    }

    /// What a request to `route` (exact, or a prefix ending in `*`) costs; 1 otherwise.
    pub fn cost(mut self, route: impl Into<String>, cost: u64) -> Self {
        self.costs.push((route.into(), cost));
        self
    }

    /// Every path pattern is one that can match, and none is on paths `routes.exempt` takes
    /// first (an exempt request is neither charged nor looked at further: a cost, a shadow, a
    /// refund or a route limit there would silently never apply).
    fn check_paths(&self) -> Result<(), RulesError> {
        if let Some(bad) = self.exempt_paths.iter().find(|p| !is_route_pattern(p)) {
            return Err(RulesError::ExemptPath(bad.clone()));
        }
        if let Some(bad) = self.shadow_paths.iter().find(|p| !is_route_pattern(p)) {
            return Err(RulesError::ShadowPath(bad.clone()));
        }
        if let Some(bad) = self.refund_paths.iter().find(|p| !is_route_pattern(p)) {
            return Err(RulesError::RefundPath(bad.clone()));
        }
        let rules = (self.costs.iter().map(|(route, _)| ("routes.costs", route)))
            .chain(self.shadow_paths.iter().map(|p| ("routes.shadow", p)))
            .chain((self.refund_paths.iter()).map(|p| ("routes.refund_server_errors", p)))
            .chain(
                self.route_limits
                    .iter()
                    .map(|(route, _)| ("routes.limits", route)),
            );
        for (setting, route) in rules {
            if let Some(exempt) = exempt_over(&self.exempt_paths, route) {
                let (route, exempt) = (route.clone(), exempt.to_owned());
                return Err(RulesError::UnderExempt {
                    setting,
                    route,
                    exempt,
                });
            }
        }
        Ok(())
    }

    /// No two cost patterns, nor two route-limit patterns, match the same paths.
    fn check_twice(&self) -> Result<(), RulesError> {
        let costs = self.costs.iter().map(|(route, _)| route.as_str());
        if let Some((route, earlier)) = first_twice(costs) {
            return Err(RulesError::CostRouteTwice(
                route.to_owned(),
                earlier.to_owned(),
            ));
        }
        let limits = self.route_limits.iter().map(|(route, _)| route.as_str());
        if let Some((route, earlier)) = first_twice(limits) {
            return Err(RulesError::RouteLimits(route.to_owned(), again(earlier)));
        }
        Ok(())
    }

    pub fn build(self, plans: &PlanBook) -> Result<RequestRules, RulesError> {
        self.check_paths()?;
        self.check_twice()?;
        let key_source = key_source(self.key_header, self.anonymous)?;
        let trusted_proxies = self
            .trusted_proxies
            .iter()
            .map(|cidr| match Cidr::parse(cidr) {
                None => Err(RulesError::TrustedProxy(cidr.clone())),
                Some(block) if block.is_too_wide() => Err(RulesError::TrustedTooWide(cidr.clone())),
                Some(block) => Ok(block),
            })
            .collect::<Result<Vec<_>, _>>()?;
        if self.key_length_max == 0 || self.key_length_max > KEY_LENGTH_MAX_LIMIT {
            return Err(RulesError::KeyLengthMax);
        }
        if !(1..=128).contains(&self.ipv6_prefix_bits) {
            return Err(RulesError::Ipv6PrefixBits(self.ipv6_prefix_bits));
        }
        let translators = (self.translators.iter())
            .map(|p| Ipv6Prefix96::parse(p).ok_or_else(|| RulesError::Translator(p.clone())))
            .collect::<Result<Box<[_]>, _>>()?;
        let header_styles = match &self.header_styles {
            Some(names) => HeaderStyles::parse(names).map_err(RulesError::HeaderStyle)?,
            None => HeaderStyles::default(),
        };
        let missing_key_status = match self.missing_key_status {
            400 => StatusCode::BAD_REQUEST,
            401 => StatusCode::UNAUTHORIZED,
            other => return Err(RulesError::MissingKeyStatus(other)),
        };
        let mut costs = Vec::with_capacity(self.costs.len());
        for (route, cost) in self.costs {
            costs.push(checked_cost(route, cost, plans)?);
        }
        let route_costs = RouteCosts::new(costs);
        let cost_header = self.cost_header.map(cost_header).transpose()?;
        let leased = plans.plans().iter().find(|plan| plan.lease().is_some());
        if let (Some(_), Some(plan)) = (&cost_header, leased) {
            return Err(RulesError::CostHeaderWithLeases(plan.name().to_owned()));
        }
        let mut route_limits = self
            .route_limits
            .into_iter()
            .map(|(route, limits)| checked_limits(route, limits, &route_costs, plans))
            .collect::<Result<Vec<_>, _>>()?;
        most_specific_first(&mut route_limits);
        let challenge = challenge(&key_source);
        Ok(RequestRules {
            key_source,
            key_length_max: self.key_length_max,
            exempt_paths: self.exempt_paths,
            route_costs,
            shadow_paths: self.shadow_paths,
            refund_paths: self.refund_paths,
            header_styles,
            missing_key_status,
            trusted_proxies,
            forwarded_header: self.forwarded_header,
            ipv6_prefix_bits: self.ipv6_prefix_bits,
            translators,
            route_limits,
            cost_header,
            challenge,
        })
    }
}

/// Where keys come from: a header (`anonymous`: or, without it, the address), else the address.
fn key_source(header: Option<String>, anonymous: bool) -> Result<KeySource, RulesError> {
    let Some(header) = header else {
        return Ok(KeySource::PeerIp);
    };
    let name = HeaderName::try_from(header.as_str()).map_err(|_| RulesError::KeyHeader(header))?;
    Ok(match anonymous {
        true => KeySource::HeaderOrPeerIp(name),
        false => KeySource::Header(name),
    })
}

/// A route's limits: a path, 1 to [`ROUTE_LIMITS_MAX`] distinct limits, each able to afford
/// the route's cost, none named as a plan (the `RateLimit-Policy` items of a response name the
/// caller's plan and the route's limits: two items of one name could not be told apart).
fn checked_limits(
    route: String,
    limits: Vec<Plan>,
    costs: &RouteCosts,
    plans: &PlanBook,
) -> Result<(String, Arc<[Plan]>), RulesError> {
    let invalid = |why: String| Err(RulesError::RouteLimits(route.clone(), why));
    if !is_route_pattern(&route) {
        return invalid(ROUTE_PATTERN_RULE.into());
    }
    if limits.is_empty() || limits.len() > ROUTE_LIMITS_MAX {
        return invalid(format!("needs 1 to {ROUTE_LIMITS_MAX} limits"));
    }
    for (index, limit) in limits.iter().enumerate() {
        if limits[..index].iter().any(|l| l.name() == limit.name()) {
            return invalid(format!("names limit {:?} twice", limit.name()));
        }
        // The configuration refused these; a library user's builder did not, and a slot's
        // refusal then listed two items named `concurrency`.
        if super::concurrency::reserved_name(limit.name()) {
            let why = "is reserved (none, concurrency, concurrency-…: labels of their own)";
            return invalid(format!("names limit {:?}, which {why}", limit.name()));
        }
        if plans.by_name(limit.name()).is_some() {
            let why = "is also a plan's name: responses could not tell the two policies apart";
            return invalid(format!("names limit {:?}, which {why}", limit.name()));
        }
        // Every path under the route, with its own cost: one that costs more than the limit's
        // whole capacity would be refused forever. A route written with an escape (`%2F`) is
        // charged its decoded form's cost too (`RequestRules::cost`).
        let decoded = decoded_path(&route);
        let cost = (costs.cost_max_under(&route)).max(costs.cost_max_under(&decoded));
        let cost = cost.get();
        if cost > limit.capacity().get() {
            return invalid(format!(
                "has a path that costs {cost}, more than limit {:?} allows in a whole window",
                limit.name()
            ));
        }
    }
    Ok((route, limits.into()))
}

/// The `WWW-Authenticate` challenge for callers keyed by `source` (see
/// [`RequestRules::challenge`]).
fn challenge(source: &KeySource) -> Option<HeaderValue> {
    let (KeySource::Header(name) | KeySource::HeaderOrPeerIp(name)) = source else {
        return None;
    };
    if *name == AUTHORIZATION {
        return Some(HeaderValue::from_static("Bearer"));
    }
    // A header name is a token: always a valid field value.
    HeaderValue::from_str(&format!("ApiKey header=\"{name}\"")).ok()
}

/// A route's cost must be positive and affordable on every plan: a request that costs more than a
/// plan's whole capacity could never be admitted.
fn checked_cost(
    route: String,
    cost: u64,
    plans: &PlanBook,
) -> Result<(String, NonZeroU64), RulesError> {
    if !is_route_pattern(&route) {
        return Err(RulesError::CostRoute(route));
    }
    let Some(cost) = NonZeroU64::new(cost) else {
        return Err(RulesError::CostZero(route));
    };
    let capacity = plans.capacity_min();
    if cost > capacity {
        return Err(RulesError::CostAboveCapacity {
            route,
            cost: cost.get(),
            capacity: capacity.get(),
        });
    }
    Ok((route, cost))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::plan::{test_plan, UnknownKeys};
    use actix_web::test::TestRequest;

    fn plans() -> PlanBook {
        PlanBook::new(
            vec![test_plan("free", 5)],
            "free",
            [],
            [],
            UnknownKeys::DefaultPlan,
        )
        .unwrap()
    }

    fn rules() -> RequestRules {
        RequestRules::builder()
            .exempt("/healthz")
            .exempt("/metrics*")
            .cost("/expensive", 5)
            .cost("/batch/*", 3)
            .build(&plans())
            .unwrap()
    }

    fn cost_of(rules: &RequestRules, path: &str) -> u64 {
        let req = TestRequest::with_uri(path)
            .insert_header(("X-Api-Key", "abc"))
            .to_srv_request();
        match rules.classify(&req) {
            Classified::Charge { cost, .. } => cost.get(),
            other => panic!("{path}: {other:?}"),
        }
    }

    #[test]
    fn exempt_paths_and_costs() {
        let r = rules();
        let exempt = |path| {
            let req = TestRequest::with_uri(path).to_srv_request();
            matches!(r.classify(&req), Classified::Exempt)
        };
        assert!(exempt("/healthz"));
        assert!(exempt("/metrics/exemplars"));
        assert!(!exempt("/healthz/x"));
        assert_eq!(cost_of(&r, "/expensive"), 5);
        assert_eq!(cost_of(&r, "/batch/7"), 3);
        assert_eq!(cost_of(&r, "/greeting"), 1);
    }

    #[test]
    fn the_decoded_path_is_what_a_handler_reads() {
        assert!(matches!(decoded_path("/api/admin/x"), Cow::Borrowed(_)));
        assert!(matches!(decoded_path("/a%C3%A9"), Cow::Borrowed(_)));
        assert_eq!(decoded_path("/api/admin%2Fexport"), "/api/admin/export");
        assert_eq!(decoded_path("/q/c%2b%2B"), "/q/c++");
        // Once: `%252F` is `%2F` to a handler, not `/`.
        assert_eq!(decoded_path("/a%252Fb"), "/a%2Fb");
        assert_eq!(decoded_path("/a%2"), "/a%2");
        assert_eq!(decoded_path("/%2F%"), "//%");
    }

    /// A route's cost, limits and slots apply to a path whose parameter hides a `/` or `+` in an
    /// escape (`/api/{tail:.*}` reads `admin/export` from `/api/admin%2Fexport`); what waives a
    /// charge (exempt) is not earned by one.
    #[test]
    fn an_escaped_slash_dodges_no_route_rule() {
        let r = RequestRules::builder()
            .cost("/api/admin/*", 5)
            .cost("/search/c++", 4)
            .cost("/files/*", 5)
            .cost("/files/a/*", 1)
            .exempt("/public/*")
            .build(&plans())
            .unwrap();
        // The higher of both forms: the decoded path may reach a cheaper, more specific route.
        assert_eq!(cost_of(&r, "/files/a%2Fb"), 5);
        assert_eq!(cost_of(&r, "/api/admin%2Fexport"), 5);
        assert_eq!(cost_of(&r, "/api/admin%2fexport"), 5);
        assert_eq!(cost_of(&r, "/search/c%2B%2B"), 4);
        assert_eq!(cost_of(&r, "/api/other%2Fexport"), 1);
        // Not exempt: the routed path is not under `/public/`.
        assert_eq!(cost_of(&r, "/public%2Fx"), 1);
    }

    #[test]
    fn a_caller_keyed_by_its_bearer_token_is_the_token() {
        let r = RequestRules::builder()
            .key_header("authorization")
            .build(&plans())
            .unwrap();
        let key = |value: &str| {
            let req = TestRequest::default()
                .insert_header(("Authorization", value))
                .to_srv_request();
            r.caller_key(&req).map(|k| k.expose_secret().to_owned())
        };
        assert_eq!(key("Bearer tok_123").unwrap(), "tok_123");
        assert_eq!(key("bearer tok_123").unwrap(), "tok_123", "the same caller");
        assert!(matches!(
            key("Basic dXNlcg=="),
            Err(KeyError::NotBearer { .. })
        ));
        assert!(matches!(key("Bearer "), Err(KeyError::NotBearer { .. })));
        assert!(matches!(key("Bearer a b"), Err(KeyError::Malformed { .. })));
        // Where a keyless caller is its address, another scheme's credentials are no key.
        let either = RequestRules::builder()
            .key_header_or_peer_ip("authorization")
            .build(&plans())
            .unwrap();
        let req = TestRequest::default()
            .insert_header(("Authorization", "Basic dXNlcg=="))
            .peer_addr("10.1.2.3:4000".parse().unwrap())
            .to_srv_request();
        let caller = either
            .caller_key(&req)
            .map(|k| k.expose_secret().to_owned());
        assert_eq!(caller.unwrap(), "ip 10.1.2.3");
    }

    /// A deployment's own translator prefix makes its addresses the IPv4 clients they carry; a
    /// prefix that is not an IPv6 /96 is refused, naming the setting.
    #[test]
    fn an_own_translator_prefix_keys_its_clients_by_ipv4() {
        let peer = |rules: &RequestRules| {
            let req = TestRequest::default()
                .peer_addr("[64:ff9b:1::c000:201]:4000".parse().unwrap())
                .to_srv_request();
            rules.caller_key(&req).unwrap().expose_secret().to_owned()
        };
        let builder = || RequestRules::builder().peer_ip();
        assert_eq!(
            peer(&builder().build(&plans()).unwrap()),
            "ip 64:ff9b:1::/64"
        );
        let own = builder().ipv4_translation_prefixes(vec!["64:ff9b:1::/96".into()]);
        assert_eq!(peer(&own.build(&plans()).unwrap()), "ip 192.0.2.1");
        let bad = builder().ipv4_translation_prefixes(vec!["64:ff9b:1::/48".into()]);
        let err = bad.build(&plans()).unwrap_err();
        assert_eq!(err.setting(), "caller.ipv4_translation_prefixes");
    }

    #[test]
    fn caller_key_from_headers() {
        let r = rules();
        let req = TestRequest::default().to_srv_request();
        assert!(matches!(r.caller_key(&req), Err(KeyError::Missing { .. })));
        let req = TestRequest::default()
            .insert_header(("X-Api-Key", "abc"))
            .to_srv_request();
        assert_eq!(r.caller_key(&req).unwrap().expose_secret(), "abc");
        let req = TestRequest::default()
            .append_header(("X-Api-Key", "a"))
            .append_header(("X-Api-Key", "b"))
            .to_srv_request();
        assert!(matches!(r.caller_key(&req), Err(KeyError::Repeated { .. })));
        let long = "k".repeat(KEY_LENGTH_MAX_DEFAULT + 1);
        let req = TestRequest::default()
            .insert_header(("X-Api-Key", long))
            .to_srv_request();
        assert!(matches!(r.caller_key(&req), Err(KeyError::TooLong { .. })));
    }

    #[test]
    fn caller_key_from_peer() {
        let r = RequestRules::builder().peer_ip().build(&plans()).unwrap();
        let req = TestRequest::default()
            .peer_addr("10.1.2.3:4000".parse().unwrap())
            .to_srv_request();
        assert_eq!(r.caller_key(&req).unwrap().expose_secret(), "ip 10.1.2.3");
        let req = TestRequest::default().to_srv_request();
        assert_eq!(r.caller_key(&req), Err(KeyError::NoPeerAddress));
    }

    #[test]
    fn the_builder_refuses_what_the_config_file_refuses() {
        let build = |b: RequestRulesBuilder| b.build(&plans()).unwrap_err();
        let e = build(RequestRules::builder().cost("/greeting", 6));
        assert_eq!(e.setting(), "routes.costs.\"/greeting\"");
        assert!(e.to_string().contains("exceeds"), "{e}");
        let e = build(RequestRules::builder().cost("/greeting", 0));
        assert_eq!(e, RulesError::CostZero("/greeting".into()));
        let e = build(RequestRules::builder().cost("greeting", 1));
        assert_eq!(e, RulesError::CostRoute("greeting".into()));
        let twice = RequestRules::builder()
            .cost("/f/a%2fb", 2)
            .cost("/f/a%2Fb", 1);
        let e = build(twice);
        assert_eq!(e.setting(), "routes.costs.\"/f/a%2Fb\"", "{e}");
        let e = build(RequestRules::builder().key_length_max(0));
        assert_eq!(e.setting(), "caller.key_length_max");
        for standard in [
            "Content-Type",
            "retry-after",
            "RateLimit-Policy",
            "X-RateLimit-Used",
        ] {
            let e = build(RequestRules::builder().cost_header(standard));
            assert_eq!(e, RulesError::CostHeaderStandard(standard.into()));
            assert_eq!(e.setting(), "routes.cost_header");
        }
        for own in ["X-Cost", "X-RateLimit-Cost", "RateLimit-Cost"] {
            let built = RequestRules::builder().cost_header(own).build(&plans());
            assert!(built.is_ok(), "{own}: a field of one's own");
        }
        let e = build(RequestRules::builder().key_length_max(KEY_LENGTH_MAX_LIMIT + 1));
        assert_eq!(e, RulesError::KeyLengthMax);
        let e = build(RequestRules::builder().exempt("healthz"));
        assert_eq!(e.setting(), "routes.exempt");
        let e = build(RequestRules::builder().key_header("bad header"));
        assert_eq!(e.setting(), "caller.header");
        let e = build(RequestRules::builder().shadow("beta"));
        assert_eq!(e.setting(), "routes.shadow");
        let e = build(RequestRules::builder().header_styles(["ietf", "x"]));
        assert_eq!(e, RulesError::HeaderStyle("x".into()));
        let e = build(RequestRules::builder().header_styles(Vec::<String>::new()));
        assert_eq!(e.setting(), "response.header_styles");
        let e = build(RequestRules::builder().missing_key_status(403));
        assert_eq!(e.setting(), "response.missing_key_status");
        // A `*` anywhere but the end would never match: refused, not ignored.
        let e = build(RequestRules::builder().exempt("/users/*/avatar"));
        assert_eq!(e.setting(), "routes.exempt");
        let e = build(RequestRules::builder().cost("/api/**", 1));
        assert_eq!(e, RulesError::CostRoute("/api/**".into()));
    }

    #[test]
    fn route_patterns_have_their_star_at_the_end() {
        assert!(is_route_pattern("/a") && is_route_pattern("/a*") && is_route_pattern("/*"));
        assert!(!is_route_pattern("a") && !is_route_pattern("/a/*/b") && !is_route_pattern("/**"));
        for never_matches in ["/reports/{id}", "/search?q=1", "/a#b", "/a b", "/a\t"] {
            assert!(!is_route_pattern(never_matches), "{never_matches}");
        }
        // actix decodes a path's escapes before rules see it, all but `/`, `%` and `+`.
        for decoded_first in ["/caf%C3%A9", "/a%20b", "/a%41*", "/a%", "/a%2", "/a%é1"] {
            assert!(!is_route_pattern(decoded_first), "{decoded_first}");
        }
        for kept in ["/café", "/a%2Fb", "/a%2fb", "/100%25", "/c%2B%2B*"] {
            assert!(is_route_pattern(kept), "{kept}");
        }
    }

    /// What the rules compare a pattern with: the path as actix's router decodes it.
    #[test]
    fn route_patterns_are_compared_with_the_decoded_path() {
        let url = |path: &str| actix_web::dev::Url::new(path.parse().unwrap());
        assert_eq!(url("/caf%C3%A9").path(), "/café");
        assert_eq!(url("/a%2Fb%25%2B").path(), "/a%2Fb%25%2B");
        // Kept as the client wrote it, in either case: a rule matches both.
        assert_eq!(url("/a%2fb").path(), "/a%2fb");
        assert!(path_matches("/a%2Fb", url("/a%2fb").path()));
        assert!(path_matches("/a%2fb", url("/a%2Fb").path()));
        assert!(path_matches("/files/a%2F*", url("/files/a%2fb/x").path()));
        assert!(path_matches("/c%2B%2B*", "/c%2b%2B/x"));
        assert!(!path_matches("/a%2Fb", "/a%2Fc"));
        assert!(
            !path_matches("/a%2Fb", "/A%2Fb"),
            "only the escapes' digits"
        );
        assert!(!path_matches("/a%2Fb", "/a%2Fbc"));
        assert!(!path_matches("/a%2Fb*", "/a%2F"));
        assert!(path_matches("/é*", "/éa") && !path_matches("/é", "/e"));
        // Costs too, exact and prefix.
        let costs = RouteCosts::new([
            ("/a%2fb".to_owned(), NonZeroU64::new(50).unwrap()),
            ("/c%2B*".to_owned(), NonZeroU64::new(7).unwrap()),
        ]);
        assert_eq!(costs.cost(url("/a%2Fb").path()).get(), 50);
        assert_eq!(costs.cost(url("/a%2fb").path()).get(), 50);
        assert_eq!(costs.cost(url("/c%2bx").path()).get(), 7);
        assert_eq!(costs.cost("/a/b").get(), 1);
    }

    #[test]
    fn the_most_specific_route_limit_applies() {
        let free = test_plan("per_min", 5);
        let big = test_plan("per_hour", 5);
        let rules = RequestRules::builder()
            .limits("/upload*", vec![big])
            .limits("/upload/big", vec![free])
            .build(&plans())
            .unwrap();
        let name = |path: &str| rules.route_limits(path).map(|l| l[0].name().to_owned());
        assert_eq!(
            name("/upload/big").as_deref(),
            Some("per_min"),
            "exact first"
        );
        assert_eq!(name("/upload/small").as_deref(), Some("per_hour"));
        // Through `classify`, an escaped `/` in a parameter finds the limit too.
        let req = TestRequest::with_uri("/upload%2Fbig")
            .insert_header(("X-Api-Key", "abc"))
            .to_srv_request();
        let Classified::Charge { limits, .. } = rules.classify(&req) else {
            panic!("a charge");
        };
        let names: Vec<String> = limits
            .unwrap()
            .iter()
            .map(|l| l.name().to_owned())
            .collect();
        assert_eq!(
            names,
            ["per_min", "per_hour"],
            "both routes' limits, once each"
        );
        // The same route by both forms: its limits once.
        let req = TestRequest::with_uri("/upload%2Fsmall")
            .insert_header(("X-Api-Key", "abc"))
            .to_srv_request();
        let Classified::Charge { limits, .. } = rules.classify(&req) else {
            panic!("a charge");
        };
        assert_eq!(limits.unwrap().len(), 1);
        // Two routes' full sets: every one of their limits, none cut.
        let set = |prefix: &str| {
            (0..ROUTE_LIMITS_MAX)
                .map(|n| test_plan(&format!("{prefix}{n}"), 5))
                .collect::<Vec<_>>()
        };
        let rules = RequestRules::builder()
            .limits("/a/*", set("wide"))
            .limits("/a%2Fb", set("tight"))
            .build(&plans())
            .unwrap();
        let req = TestRequest::with_uri("/a%2Fb")
            .insert_header(("X-Api-Key", "abc"))
            .to_srv_request();
        let Classified::Charge { limits, .. } = rules.classify(&req) else {
            panic!("a charge");
        };
        assert_eq!(limits.unwrap().len(), 2 * ROUTE_LIMITS_MAX);
        let mut patterns = vec![
            ("/a*".to_owned(), ()),
            ("/a/b*".to_owned(), ()),
            ("/a/b".to_owned(), ()),
        ];
        most_specific_first(&mut patterns);
        let order: Vec<&str> = patterns.iter().map(|(p, _)| p.as_str()).collect();
        assert_eq!(order, ["/a/b", "/a/b*", "/a*"]);
    }

    #[test]
    fn a_route_limit_is_refused_when_a_path_under_it_costs_more_than_it_holds() {
        let limit = || vec![test_plan("per_min", 4)];
        let build = |b: RequestRulesBuilder| b.build(&plans());
        // The prefix itself costs 1, but one path under it costs 5: refused forever.
        let e = build(
            RequestRules::builder()
                .cost("/api/export", 5)
                .limits("/api/*", limit()),
        );
        assert!(matches!(e, Err(RulesError::RouteLimits(..))), "{e:?}");
        let e = build(
            RequestRules::builder()
                .cost("/api/big/*", 5)
                .limits("/api/*", limit()),
        );
        assert!(matches!(e, Err(RulesError::RouteLimits(..))), "{e:?}");
        // A broader cost overridden by a narrower one that covers the whole limit: allowed.
        let ok = RequestRules::builder()
            .cost("/*", 5)
            .cost("/api/*", 1)
            .limits("/api/*", limit());
        assert!(build(ok).is_ok());
        // Paths outside the limit do not count.
        let ok = RequestRules::builder()
            .cost("/other", 5)
            .limits("/api/*", limit());
        assert!(build(ok).is_ok());
        // A route written with an escape is charged its decoded form's cost too: `/f/a%2Fb`
        // costs what `/f/a/b` does, so its limit of 4 could never hold it.
        let e = build(
            RequestRules::builder()
                .cost("/f/a/b", 5)
                .limits("/f/a%2Fb", limit()),
        );
        assert!(matches!(e, Err(RulesError::RouteLimits(..))), "{e:?}");
        // And the other way: a cost written with an escape is charged on the path its decoded
        // form is, here under the limit's route (`/a%2Fx` costs 5, limited by `/a/*`).
        let e = build(
            RequestRules::builder()
                .cost("/a%2F*", 5)
                .limits("/a/*", limit()),
        );
        assert!(matches!(e, Err(RulesError::RouteLimits(..))), "{e:?}");
    }

    #[test]
    fn a_route_limit_named_as_a_plan_is_refused() {
        let named_free = RequestRules::builder().limits("/api/*", vec![test_plan("free", 10)]);
        let e = named_free.build(&plans()).unwrap_err();
        assert!(e.to_string().contains("plan's name"), "{e}");
        assert_eq!(e.setting(), "routes.limits");
    }

    /// As the configuration refuses them: a library user's builder took them.
    #[test]
    fn a_route_limit_with_a_reserved_name_is_refused() {
        for name in ["none", "concurrency", "concurrency-1"] {
            let reserved = RequestRules::builder().limits("/api/*", vec![test_plan(name, 10)]);
            let e = reserved.build(&plans()).unwrap_err();
            assert!(e.to_string().contains("reserved"), "{name}: {e}");
        }
    }
}
