//! Configuration: built-in defaults (the demo), overridden by a TOML file, overridden by CLI flags
//! or their `LEDGER_LIMITER_*` environment variables. Everything is validated at start; an error
//! names the setting at fault.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::num::{NonZeroU32, NonZeroU64, NonZeroUsize};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use thiserror::Error;

use crate::envoy::config::RlsConfig;
use crate::http::admin::AdminSecrets;
use crate::http::concurrency::CONCURRENCY_LIMIT_NAME;
use crate::http::{ForwardedHeader, RequestRules, RequestRulesBuilder, RulesError};
use crate::ledger::{model, LedgerSettings, BATCH_LINGER_MAX};
use crate::limiter::caller::{KEY_LENGTH_MAX_DEFAULT, KEY_LENGTH_MAX_LIMIT};
use crate::limiter::metrics::{CONCURRENCY_PLAN_PREFIX, PLAN_NONE};
use crate::limiter::plan::{Plan, PlanBook, PlanError, UnknownKeys};
use crate::limiter::{FailurePolicy, LimiterSettings};

mod keys_file;
mod lease;

pub use keys_file::KEYS_FILE_BYTES_MAX;

/// The built-in configuration: the demo the README explains.
pub const DEFAULT_CONFIG_TOML: &str = include_str!("../../config/default.toml");

/// Bounds on settings, so a typo cannot ask for something absurd.
pub const LEDGER_TIMEOUT_MS_MAX: u64 = 60_000;
pub const EXPIRY_MARGIN_MS_MAX: u64 = 10_000;
/// Bound on `workers`: a thread each.
pub const WORKERS_MAX: usize = 1024;
/// Bound on `drain_delay_seconds`: it adds to every stop.
pub const DRAIN_DELAY_SECONDS_MAX: u64 = 60;
/// Bound on `ledger.in_flight_max` (tokio's semaphore takes at most `usize::MAX >> 3` permits,
/// and a million calls in flight is far past what one client can send).
pub const IN_FLIGHT_MAX_LIMIT: usize = 1 << 20;
/// Bound on `ledger.local_callers_max`. A caller remembered costs about 100 bytes, and up to
/// 24 more per hold it has live (at most `HOLDS_PER_CALLER_MAX`, 1,024: about 24 KiB for a caller
/// that busy); the README gives the arithmetic.
pub const LOCAL_CALLERS_MAX_LIMIT: usize = 100_000_000;

#[derive(Debug, Error, PartialEq, Eq)]
#[error("invalid setting `{setting}`: {message}")]
pub struct ConfigError {
    pub setting: String,
    pub message: String,
}

fn invalid(setting: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError {
        setting: setting.into(),
        message: message.into(),
    }
}

/// The TOML file's shape. Every field is optional: missing ones keep the default.
#[derive(Debug, Default, Deserialize, Clone)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub listen: Option<String>,
    pub workers: Option<usize>,
    /// Seconds `/readyz` answers 503 at a stop before the server stops taking connections.
    pub drain_delay_seconds: Option<u64>,
    #[serde(default)]
    pub ledger: LedgerFile,
    #[serde(default)]
    pub embedded: EmbeddedFile,
    #[serde(default)]
    pub caller: CallerFile,
    pub default_plan: Option<String>,
    /// Replaces the default plans wholesale when given.
    pub plans: Option<BTreeMap<String, PlanFile>>,
    /// Replaces the default prefixes wholesale when given.
    pub key_prefixes: Option<BTreeMap<String, String>>,
    /// Limits that routes add to the caller's plan (`routes.limits`): per caller, all or none.
    pub limits: Option<BTreeMap<String, PlanFile>>,
    #[serde(default)]
    pub routes: RoutesFile,
    #[serde(default)]
    pub response: ResponseFile,
    #[serde(default)]
    pub admin: AdminFile,
    #[serde(default)]
    pub rls: RlsFile,
    #[serde(default)]
    pub metrics: MetricsFile,
}

/// Where `/metrics` and `/metrics/exemplars` are served: on `listen` by default, or on a listener
/// of their own, kept off the public port (they name every plan and its traffic).
#[derive(Debug, Default, Deserialize, Clone)]
#[serde(deny_unknown_fields)]
pub struct MetricsFile {
    pub listen: Option<String>,
}

/// The Envoy rate-limit service (gRPC): on when `listen` is set; `config` is envoyproxy/ratelimit
/// YAML (a file, or a directory of them).
#[derive(Debug, Default, Deserialize, Clone)]
#[serde(deny_unknown_fields)]
pub struct RlsFile {
    pub listen: Option<String>,
    pub config: Option<PathBuf>,
    pub connections_max: Option<usize>,
    pub calls_max: Option<usize>,
}

/// The Envoy front end's validated settings.
#[derive(Debug, Clone)]
pub struct RlsSettings {
    pub listen: String,
    pub config: Arc<RlsConfig>,
    /// Where `config` was read from (a file, or a folder of them): read again when it changes.
    pub config_path: PathBuf,
    /// The files `config` was read from, as [`crate::envoy::rules::fingerprint`] has them.
    pub config_read: u64,
    /// Connections open and calls in flight at once.
    pub bounds: crate::envoy::Bounds,
}

/// The admin API: on when `listen` is set and at least one secret is given.
#[derive(Default, Deserialize, Clone)]
#[serde(deny_unknown_fields)]
pub struct AdminFile {
    pub listen: Option<String>,
    /// Bearer tokens (several, for rotation). Prefer `LEDGER_LIMITER_ADMIN_SECRETS`.
    #[serde(default, deserialize_with = "secrets_unquoted")]
    pub secrets: Option<Vec<String>>,
}

/// `ledger.cluster_id` as an integer or a decimal string.
fn cluster_id<'de, D>(deserializer: D) -> Result<Option<u128>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    use serde::de::Error;
    let id = match Option::<toml::Value>::deserialize(deserializer)? {
        None => return Ok(None),
        Some(toml::Value::Integer(id)) => u128::try_from(id).ok(),
        Some(toml::Value::String(id)) => id.parse::<u128>().ok(),
        Some(_) => None,
    };
    let message = "must be an integer from 0 to 2^128 - 1 (a string for one above 2^63 - 1)";
    id.map(Some).ok_or_else(|| D::Error::custom(message))
}

/// `admin.secrets`, whose errors never quote what was found: serde's own would print a secret
/// given as one string (`invalid type: string "…"`) to the log.
fn secrets_unquoted<'de, D>(deserializer: D) -> Result<Option<Vec<String>>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    use serde::de::Error;
    let items = match Option::<toml::Value>::deserialize(deserializer)? {
        None => return Ok(None),
        Some(toml::Value::Array(items)) => items,
        Some(_) => return Err(D::Error::custom("must be a list of strings (not shown)")),
    };
    let strings = items.into_iter().map(|item| match item {
        toml::Value::String(secret) => Ok(secret),
        _ => Err(D::Error::custom("each secret must be a string (not shown)")),
    });
    strings.collect::<Result<Vec<_>, _>>().map(Some)
}

impl std::fmt::Debug for AdminFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdminFile")
            .field("listen", &self.listen)
            .field("secrets", &self.secrets.as_ref().map(Vec::len))
            .finish()
    }
}

/// The admin API's validated settings.
#[derive(Debug, Clone)]
pub struct AdminSettings {
    pub listen: String,
    pub secrets: AdminSecrets,
}

#[derive(Debug, Default, Deserialize, Clone)]
#[serde(deny_unknown_fields)]
pub struct LedgerFile {
    pub addresses: Option<Vec<String>>,
    /// TigerBeetle's 128-bit cluster id: an integer, or a decimal string for one past what TOML's
    /// integers hold (2^63 - 1), as a randomly chosen id usually is.
    #[serde(default, deserialize_with = "cluster_id")]
    pub cluster_id: Option<u128>,
    pub timeout_ms: Option<u64>,
    pub failure_policy: Option<String>,
    pub in_flight_max: Option<usize>,
    pub local_callers_max: Option<usize>,
    pub expiry_margin_ms: Option<u64>,
    pub batch_linger_ms: Option<u64>,
}

#[derive(Debug, Default, Deserialize, Clone)]
#[serde(deny_unknown_fields)]
pub struct EmbeddedFile {
    pub data_dir: Option<PathBuf>,
    pub tigerbeetle_bin: Option<PathBuf>,
    pub development: Option<bool>,
}

#[derive(Debug, Default, Deserialize, Clone)]
#[serde(deny_unknown_fields)]
pub struct CallerFile {
    /// `header`, `peer-ip`, or `header-or-peer-ip` (a key if sent, else the address).
    pub source: Option<String>,
    /// The plan of callers known by their address (no key); the default plan unless set.
    pub anonymous_plan: Option<String>,
    /// Proxies (addresses or blocks) whose X-Forwarded-For / Forwarded name the caller.
    pub trusted_proxies: Option<Vec<String>>,
    /// The header the trusted proxies write: `x-forwarded-for` (the default) or `forwarded`.
    pub forwarded_header: Option<String>,
    /// How many leading bits of an IPv6 address name a caller known by address (64; 128: each
    /// address alone).
    pub ipv6_prefix_length: Option<u8>,
    /// The /96 prefixes of the deployment's own stateless translators (NAT64, SIIT), beside
    /// the well-known `64:ff9b::/96`: an address in one is the IPv4 client it carries.
    pub ipv4_translation_prefixes: Option<Vec<String>>,
    pub header: Option<String>,
    pub key_length_max: Option<usize>,
    pub unknown_keys: Option<String>,
    pub keys_file: Option<PathBuf>,
}

#[derive(Debug, Deserialize, Clone)]
#[serde(deny_unknown_fields)]
pub struct PlanFile {
    pub capacity: u64,
    pub window_seconds: u32,
    /// Lease mode (both or neither): the most units one instance leases for a caller at a time.
    #[serde(default)]
    pub lease_units_max: Option<u64>,
    /// Lease mode: how long an instance admits from one lease (L) before settling it.
    #[serde(default)]
    pub lease_seconds: Option<u32>,
}

#[derive(Debug, Default, Deserialize, Clone)]
#[serde(deny_unknown_fields)]
pub struct RoutesFile {
    pub exempt: Option<Vec<String>>,
    pub costs: Option<BTreeMap<String, u64>>,
    /// Decided and recorded as usual, never refused (exact paths or `prefix*`; `/*` for all).
    pub shadow: Option<Vec<String>>,
    /// Paths whose server errors (5xx) give the caller's credit back.
    pub refund_server_errors: Option<Vec<String>>,
    /// Requests of one caller in flight at most, by path (exact or `prefix*`).
    pub concurrency: Option<BTreeMap<String, u64>>,
    /// How long a slot lasts if its instance dies before giving it back.
    pub concurrency_timeout_seconds: Option<u32>,
    /// Further limits (names from `[limits]`) a route is charged against with the plan, by path.
    pub limits: Option<BTreeMap<String, Vec<String>>>,
    /// A response header in which handlers report what a request actually cost.
    pub cost_header: Option<String>,
}

/// Bound on `routes.concurrency_timeout_seconds`.
pub const CONCURRENCY_TIMEOUT_SECONDS_MAX: u32 = 3600;

#[derive(Debug, Default, Deserialize, Clone)]
#[serde(deny_unknown_fields)]
pub struct ResponseFile {
    /// Which rate-limit header fields to send: `ietf`, `github`, `bucket4j` (one or several).
    pub header_styles: Option<Vec<String>>,
    /// The status for a request without a key: 401 (the default) or 400.
    pub missing_key_status: Option<u16>,
}

impl FileConfig {
    /// Errors name `origin` (the file), the line and column, and what is wrong there.
    pub fn parse(text: &str, origin: &str) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|e| {
            let at = e.span().map(|span| line_and_column(text, span.start));
            let said = without_names(e.message());
            let message = match at {
                Some((line, column)) => format!("line {line}, column {column}: {said}"),
                None => said,
            };
            invalid(origin, message)
        })
    }

    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = read_bounded(path, CONFIG_FILE_BYTES_MAX)
            .map_err(|message| invalid("config", message))?;
        Self::parse(&text, &format!("config ({})", path.display()))
    }

    /// The file's `listen` alone, whatever else it holds (read as any TOML table): for
    /// `ledger-limiter probe` ([`Settings::listen_with_overrides`]).
    pub fn load_listen(path: &Path) -> Result<Self, ConfigError> {
        let name = format!("config ({})", path.display());
        let text = read_bounded(path, CONFIG_FILE_BYTES_MAX)
            .map_err(|message| invalid("config", message))?;
        // The parser's message names no key (a key prefix may be one): where is enough here.
        let table: toml::Table = text
            .parse()
            .map_err(|_| invalid(&name, "not a TOML file"))?;
        let listen = match table.get("listen") {
            None => None,
            Some(toml::Value::String(listen)) => Some(listen.clone()),
            Some(_) => return Err(invalid(&name, "listen must be a string")),
        };
        Ok(FileConfig {
            listen,
            ..FileConfig::default()
        })
    }

    /// The built-in defaults ([`DEFAULT_CONFIG_TOML`]).
    pub fn defaults() -> Result<Self, ConfigError> {
        Self::parse(DEFAULT_CONFIG_TOML, "built-in defaults")
    }

    /// `other`'s values win where given.
    pub fn merge(mut self, other: FileConfig) -> Self {
        macro_rules! take {
            ($($field:ident).+) => {
                if other.$($field).+.is_some() {
                    self.$($field).+ = other.$($field).+;
                }
            };
        }
        take!(listen);
        take!(workers);
        take!(drain_delay_seconds);
        take!(ledger.addresses);
        take!(ledger.cluster_id);
        take!(ledger.timeout_ms);
        take!(ledger.failure_policy);
        take!(ledger.in_flight_max);
        take!(ledger.local_callers_max);
        take!(ledger.expiry_margin_ms);
        take!(ledger.batch_linger_ms);
        take!(embedded.data_dir);
        take!(embedded.tigerbeetle_bin);
        take!(embedded.development);
        take!(caller.source);
        take!(caller.anonymous_plan);
        take!(caller.trusted_proxies);
        take!(caller.forwarded_header);
        take!(caller.ipv6_prefix_length);
        take!(caller.ipv4_translation_prefixes);
        take!(caller.header);
        take!(caller.key_length_max);
        take!(caller.unknown_keys);
        take!(caller.keys_file);
        take!(default_plan);
        // Plans of one's own replace the built-in ones whole, prefixes included: the defaults'
        // prefixes name the built-in plans (`basic_`, `pro_`) and would refuse the file.
        if other.plans.is_some() && other.key_prefixes.is_none() {
            self.key_prefixes = Some(BTreeMap::new());
        }
        take!(plans);
        take!(key_prefixes);
        take!(limits);
        take!(routes.exempt);
        take!(routes.costs);
        take!(routes.shadow);
        take!(routes.refund_server_errors);
        take!(routes.concurrency);
        take!(routes.concurrency_timeout_seconds);
        take!(routes.limits);
        take!(routes.cost_header);
        take!(response.header_styles);
        take!(response.missing_key_status);
        take!(admin.listen);
        take!(admin.secrets);
        take!(rls.listen);
        take!(rls.config);
        take!(rls.connections_max);
        take!(rls.calls_max);
        take!(metrics.listen);
        self
    }
}

/// A parser's message without the name it quotes of a key that is duplicate, or unknown and
/// not a misspelling of a setting: that name may be a `[key_prefixes]` entry (listed twice, or
/// under another table), which admits whoever knows it and never reaches a log. The line and
/// column say where it is. A misspelled setting (`timeout` for `timeout_ms`: lowercase and
/// underscores, not ending in one as prefixes do, and near a setting the table has) is still
/// named; a name like a setting but near none of the table's (`partnerx` under `[response]`)
/// is not.
fn without_names(message: &str) -> String {
    let like_a_setting = |name: &str, expected: &[&str]| {
        name.len() <= SETTING_NAME_BYTES_MAX
            && !name.ends_with('_')
            && name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
            && expected.iter().any(|setting| misspelling(name, setting))
    };
    for (lead, unknown) in [("unknown field `", true), ("duplicate key `", false)] {
        let Some(start) = message.find(lead).map(|at| at + lead.len()) else {
            continue;
        };
        let Some(length) = message[start..].find('`') else {
            continue;
        };
        // The table's settings, as the parser lists them after the name.
        let expected: Vec<&str> = message[start + length + 1..]
            .split('`')
            .skip(1)
            .step_by(2)
            .collect();
        if unknown && like_a_setting(&message[start..start + length], &expected) {
            return message.to_owned();
        }
        let (before, after) = (&message[..start], &message[start + length..]);
        return format!("{before}(not shown: it may be a key prefix){after}");
    }
    message.to_owned()
}

/// Whether `name` reads as a misspelling of `setting`: at most two edits apart, or one begun and
/// not finished (`timeout` for `timeout_ms`).
fn misspelling(name: &str, setting: &str) -> bool {
    let (a, b) = (name.as_bytes(), setting.as_bytes());
    let begun = a.len() >= 4 && b.starts_with(a);
    // Levenshtein's distance, one row at a time (names are at most 40 bytes).
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, x) in a.iter().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, y) in b.iter().enumerate() {
            let substituted = diagonal + usize::from(x != y);
            diagonal = row[j + 1];
            row[j + 1] = substituted.min(row[j] + 1).min(row[j + 1] + 1);
        }
    }
    begun || row[b.len()] <= 2
}

/// The longest name of a setting, with room: `ipv4_translation_prefixes` is 25 bytes.
const SETTING_NAME_BYTES_MAX: usize = 40;

/// 1-based line and column (in characters) of a byte offset.
fn line_and_column(text: &str, offset: usize) -> (usize, usize) {
    let before = text.get(..offset).unwrap_or(text);
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().unwrap_or("").chars().count() + 1;
    (line, column)
}

/// Where the ledger is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LedgerLocation {
    /// A running cluster. The TigerBeetle client takes IPs: host names are resolved at start and
    /// again every few seconds (`ledger::addresses`).
    Cluster { addresses: Vec<String> },
    /// Start and supervise a local single-replica TigerBeetle.
    Embedded {
        data_dir: PathBuf,
        tigerbeetle_bin: PathBuf,
        development: bool,
    },
}

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Settings {
    pub listen: String,
    pub workers: NonZeroUsize,
    /// How long `/readyz` answers 503 at a stop before the server stops taking connections.
    pub drain_delay: Duration,
    pub ledger: LedgerLocation,
    pub cluster_id: u128,
    pub in_flight_max: NonZeroUsize,
    /// How long a batch of single transfers waits for more (`ledger.batch_linger_ms`).
    pub batch_linger: Duration,
    pub limiter: LimiterSettings,
    pub plans: Arc<PlanBook>,
    pub rules: Arc<RequestRules>,
    /// Concurrency limits by path: requests of one caller in flight at most.
    pub concurrency: Vec<(String, NonZeroU64)>,
    pub concurrency_timeout_seconds: NonZeroU32,
    /// The admin API, when a listener and a secret are configured.
    pub admin: Option<AdminSettings>,
    /// The Envoy rate-limit service, when a listener is configured.
    pub rls: Option<RlsSettings>,
    /// The metrics' own listener (`metrics.listen`); `None`: they are served on `listen`.
    pub metrics_listen: Option<String>,
    /// Settings given (in the file, a flag or the environment) that nothing reads: the
    /// embedded ledger's beside `ledger.addresses`. Warned of at start, not refused: an
    /// environment shared by instances of a cluster and of an embedded ledger is fine.
    pub unread: Vec<&'static str>,
}

fn require<T>(value: Option<T>, setting: &str) -> Result<T, ConfigError> {
    value.ok_or_else(|| invalid(setting, "is required"))
}

/// A path that must be given, and not empty. Why: the file's `data_dir = ""` was taken as the
/// working directory, where the data file was then made (the flag's empty value is refused).
fn require_path(value: Option<PathBuf>, setting: &str) -> Result<PathBuf, ConfigError> {
    let path = require(value, setting)?;
    if path.as_os_str().is_empty() {
        return Err(invalid(setting, "must not be empty"));
    }
    Ok(path)
}

/// `value` must be one of `choices` (setting value, result).
fn one_of<T: Copy>(value: String, setting: &str, choices: &[(&str, T)]) -> Result<T, ConfigError> {
    match choices.iter().find(|(name, _)| *name == value) {
        Some((_, choice)) => Ok(*choice),
        None => {
            let names: Vec<String> = choices.iter().map(|(n, _)| format!("{n:?}")).collect();
            Err(invalid(
                setting,
                format!("{value:?} is neither {}", names.join(" nor ")),
            ))
        }
    }
}

impl Settings {
    /// Validates a merged configuration; the first error names its setting.
    pub fn from_file_config(file: FileConfig) -> Result<Self, ConfigError> {
        let listen = listen_address(require(file.listen, "listen")?, "listen")?;
        let (workers, drain_delay) = serving(file.workers, file.drain_delay_seconds)?;
        let ledger = ledger_location(file.ledger.addresses.clone(), file.embedded)?;
        let cluster_id = file.ledger.cluster_id.unwrap_or(0);
        let in_flight_max = in_flight_max(file.ledger.in_flight_max)?;
        let limiter = limiter_settings(&file.ledger)?;
        let batch_linger = batch_linger(&file.ledger, limiter.ledger_timeout)?;
        let caller = file.caller;
        let key_length_max = caller.key_length_max.unwrap_or(KEY_LENGTH_MAX_DEFAULT);
        if !(1..=KEY_LENGTH_MAX_LIMIT).contains(&key_length_max) {
            // Before the keys file is read with it; the builder checks it again for library users.
            let error = RulesError::KeyLengthMax;
            return Err(invalid(error.setting(), error.to_string()));
        }
        let listed = (file.plans.as_ref(), file.key_prefixes.as_ref());
        let keys = listed_keys(&caller, listed, key_length_max)?;
        let plans = plan_book(
            file.plans,
            file.default_plan,
            (file.key_prefixes, key_length_max),
            keys,
            caller.unknown_keys.clone(),
        )?;
        let plans = match &caller.anonymous_plan {
            Some(name) => plans
                .with_address_plan(name)
                .map_err(|e| invalid("caller.anonymous_plan", e.to_string()))?,
            None => plans,
        };
        let (concurrency, concurrency_timeout_seconds) = concurrency_limits(&file.routes)?;
        let side = (file.admin, file.rls, file.metrics);
        let (admin, rls, metrics_listen) = side_listeners(&listen, side)?;
        let rules = key_rules(&caller)?;
        let rules = rules.forwarded_header(forwarded_header(caller.forwarded_header)?);
        let rules = rules.key_length_max(key_length_max);
        let rules = match caller.ipv6_prefix_length {
            Some(bits) => rules.ipv6_prefix_bits(bits),
            None => rules,
        };
        let rules = route_limits(rules, file.limits, file.routes.limits.clone())?;
        let rules = request_rules(rules, file.routes, file.response)
            .build(&plans)
            .map_err(|e| invalid(e.setting(), e.to_string()))?;
        Ok(Settings {
            listen,
            workers,
            drain_delay,
            ledger,
            cluster_id,
            in_flight_max,
            batch_linger,
            limiter,
            plans: Arc::new(plans),
            rules: Arc::new(rules),
            concurrency,
            concurrency_timeout_seconds,
            admin,
            rls,
            metrics_listen,
            unread: Vec::new(),
        })
    }

    /// Only the listen address of `overrides` over the built-in defaults, nothing else read or
    /// checked: for `ledger-limiter probe`, which must not fail a running service's health
    /// check over a keys file edited since it started.
    pub fn listen_with_overrides(overrides: FileConfig) -> Result<String, ConfigError> {
        require(FileConfig::defaults()?.merge(overrides).listen, "listen")
    }

    /// The built-in defaults with `overrides` applied. The built-in prefixes (`basic_`, `pro_`)
    /// are the demo's: they let any caller pick its plan by how it names its key. A configuration
    /// that lists its keys (a keys file, or unknown keys rejected) has only prefixes of its own.
    pub fn with_overrides(overrides: FileConfig) -> Result<Self, ConfigError> {
        let own_prefixes = overrides.key_prefixes.is_some();
        let defaults = FileConfig::defaults()?;
        let own_caller = beside_defaults(overrides.caller.clone(), &defaults.caller);
        let own_embedded = embedded_given(&overrides.embedded);
        let listed_prefixes = overrides
            .key_prefixes
            .as_ref()
            .is_some_and(|p| !p.is_empty());
        // Only a status of one's own (a copy of the defaults sets the default's).
        let own_status = (overrides.response.missing_key_status)
            .is_some_and(|status| Some(status) != defaults.response.missing_key_status);
        let mut merged = defaults.merge(overrides);
        if let Some(source) = &merged.caller.source {
            unread_caller_settings(&own_caller, (listed_prefixes, own_status), source)?;
        }
        let caller = &merged.caller;
        let lists_keys =
            caller.keys_file.is_some() || caller.unknown_keys.as_deref() == Some("reject");
        if lists_keys && !own_prefixes {
            merged.key_prefixes = Some(BTreeMap::new());
        }
        refuses_every_key(&merged)?;
        let mut settings = Self::from_file_config(merged)?;
        if matches!(settings.ledger, LedgerLocation::Cluster { .. }) {
            settings.unread = own_embedded;
        }
        Ok(settings)
    }

    /// What [`Ledger::connect`](crate::ledger::Ledger::connect) needs from this configuration,
    /// for the ledger at `addresses` (resolved: the embedded one's, or the cluster's).
    pub fn ledger_settings(&self, addresses: Vec<SocketAddr>) -> LedgerSettings {
        LedgerSettings {
            cluster_id: self.cluster_id,
            addresses,
            ledger_id: model::LEDGER_REQUEST_RATE,
            in_flight_max: self.in_flight_max,
            batch_linger: self.batch_linger,
        }
    }
}

/// A listen address as `host:port` (a name, an IPv4 address or a bracketed IPv6 one; port 0
/// picks a free port): checked here, where a mistake names its setting, rather than at the
/// bind, after an embedded ledger was started for nothing.
fn listen_address(value: String, setting: &str) -> Result<String, ConfigError> {
    let shape = "must be host:port, like 127.0.0.1:8080 or [::]:8080";
    let (host, port) = value
        .rsplit_once(':')
        .ok_or_else(|| invalid(setting, shape))?;
    let host_ok = match host.strip_prefix('[') {
        // An IPv6 address: brackets around it, so its colons are not the port's.
        Some(inner) => inner.strip_suffix(']').is_some_and(|ip| !ip.is_empty()),
        None => !host.is_empty() && !host.contains([':', ']']),
    };
    if !host_ok || port.parse::<u16>().is_err() {
        return Err(invalid(setting, shape));
    }
    Ok(value)
}

/// The admin API, the Envoy front end and the metrics' own listener, each when configured.
type SideListeners = (Option<AdminSettings>, Option<RlsSettings>, Option<String>);

/// The admin API's, the Envoy front end's and the metrics' settings, each listener checked and
/// apart from the others and from `listen`.
fn side_listeners(
    listen: &str,
    (admin, rls, metrics): (AdminFile, RlsFile, MetricsFile),
) -> Result<SideListeners, ConfigError> {
    let admin = admin_settings(admin)?;
    let rls = rls_settings(rls)?;
    let metrics = metrics.listen;
    let metrics = metrics.map(|address| listen_address(address, "metrics.listen"));
    let metrics = metrics.transpose()?;
    Listeners {
        listen,
        admin: admin.as_ref().map(|admin| admin.listen.as_str()),
        rls: rls.as_ref().map(|rls| rls.listen.as_str()),
        metrics: metrics.as_deref(),
    }
    .distinct()?;
    Ok((admin, rls, metrics))
}

/// The service's checked listen addresses: the public one and those configured beside it.
struct Listeners<'a> {
    listen: &'a str,
    admin: Option<&'a str>,
    rls: Option<&'a str>,
    metrics: Option<&'a str>,
}

impl Listeners<'_> {
    /// Each on an address of its own (port 0 picks a free one each): the first setting that
    /// shares one with a setting before it is named.
    fn distinct(&self) -> Result<(), ConfigError> {
        let listeners = [
            ("listen", Some(self.listen)),
            ("admin.listen", self.admin),
            ("rls.listen", self.rls),
            ("metrics.listen", self.metrics),
        ];
        let set: Vec<(&str, &str)> = listeners
            .into_iter()
            .filter_map(|(setting, address)| Some((setting, address?)))
            .collect();
        for (index, (setting, address)) in set.iter().enumerate() {
            let earlier = set[..index].iter().find(|(_, other)| clash(address, other));
            if let Some((other, _)) = earlier {
                return Err(invalid(
                    *setting,
                    format!("is on `{other}`'s address and port"),
                ));
            }
        }
        Ok(())
    }
}

/// Whether two checked listen addresses would bind the same port on a shared address: the same
/// port (not 0) and the same host, or either on every interface (`0.0.0.0`, `[::]`). (Two
/// names of one address, `localhost` and `127.0.0.1`, are left to the bind.)
fn clash(a: &str, b: &str) -> bool {
    let (Some((host_a, port_a)), Some((host_b, port_b))) = (a.rsplit_once(':'), b.rsplit_once(':'))
    else {
        return false;
    };
    let every = |host: &str| host == "0.0.0.0" || host == "[::]";
    // As numbers: `08080` is port 8080 (`listen_address` checked both parse).
    let (port_a, port_b) = (port_a.parse::<u16>().ok(), port_b.parse::<u16>().ok());
    port_a == port_b
        && port_a.is_some_and(|port| port != 0)
        && (host_a.eq_ignore_ascii_case(host_b) || every(host_a) || every(host_b))
}

/// The Envoy front end is off without a listener; with one it needs its rules.
fn rls_settings(rls: RlsFile) -> Result<Option<RlsSettings>, ConfigError> {
    let Some(listen) = rls.listen else {
        // Rules given and never read was a surprise found only when Envoy got no answers.
        for (key, given) in [
            ("rls.config", rls.config.is_some()),
            ("rls.connections_max", rls.connections_max.is_some()),
            ("rls.calls_max", rls.calls_max.is_some()),
        ] {
            if given {
                let off =
                    format!("the Envoy front end is off: set rls.listen too (or remove {key})");
                return Err(invalid(key, off));
            }
        }
        return Ok(None);
    };
    let listen = listen_address(listen, "rls.listen")?;
    let path = rls
        .config
        .ok_or_else(|| invalid("rls.config", "is required when rls.listen is set"))?;
    // The texts kept for what they were: a change after this reading is one to load.
    let texts = crate::envoy::config::read_texts(&path);
    let texts = texts.map_err(|e| invalid("rls.config", e.to_string()))?;
    let config = RlsConfig::from_texts(&texts).map_err(|e| invalid("rls.config", e.to_string()))?;
    let config_read = crate::envoy::rules::fingerprint(&texts);
    use crate::envoy::CONNECTIONS_MAX_MAX as CONNECTIONS_MAX;
    use crate::envoy::{CALLS_MAX_DEFAULT, CALLS_MAX_MAX, CONNECTIONS_MAX_DEFAULT};
    let connections = (
        rls.connections_max,
        CONNECTIONS_MAX_DEFAULT,
        CONNECTIONS_MAX,
    );
    let bounds = crate::envoy::Bounds {
        connections_max: bound("rls.connections_max", connections)?,
        calls_max: bound(
            "rls.calls_max",
            (rls.calls_max, CALLS_MAX_DEFAULT, CALLS_MAX_MAX),
        )?,
    };
    Ok(Some(RlsSettings {
        listen,
        config: Arc::new(config),
        config_path: path,
        config_read,
        bounds,
    }))
}

/// A bound given (or its default), 1 to its most.
fn bound(
    setting: &str,
    (given, default, most): (Option<usize>, usize, usize),
) -> Result<NonZeroUsize, ConfigError> {
    NonZeroUsize::new(given.unwrap_or(default))
        .filter(|bound| bound.get() <= most)
        .ok_or_else(|| invalid(setting, format!("must be 1 to {most}")))
}

/// The admin API: on with a listener and a secret, off with neither; either alone is an error.
fn admin_settings(admin: AdminFile) -> Result<Option<AdminSettings>, ConfigError> {
    // Named both ways: the variable wins over the file, and often the file has no secrets.
    let secrets = AdminSecrets::new(&admin.secrets.unwrap_or_default())
        .map_err(|message| invalid("LEDGER_LIMITER_ADMIN_SECRETS (or admin.secrets)", message))?;
    match admin.listen {
        Some(listen) if !secrets.is_empty() => {
            let listen = listen_address(listen, "admin.listen")?;
            Ok(Some(AdminSettings { listen, secrets }))
        }
        // Asked for, and silently off, was a surprise found only when the API did not answer.
        Some(_) => Err(invalid(
            "admin.listen",
            "the admin API needs a secret too: LEDGER_LIMITER_ADMIN_SECRETS (which wins when \
             set, even empty) or admin.secrets names none",
        )),
        // The other way round too: secrets set in a deployment's environment, the listener
        // forgotten, and the API the operator means to call is off without a word.
        None if !secrets.is_empty() => Err(invalid(
            "admin.listen",
            "is not set, so the admin API is off and its secrets (LEDGER_LIMITER_ADMIN_SECRETS \
             or admin.secrets) are unused: set admin.listen, or unset the secrets",
        )),
        None => Ok(None),
    }
}

/// `[routes.concurrency]` and its slot timeout.
fn concurrency_limits(
    routes: &RoutesFile,
) -> Result<(Vec<(String, NonZeroU64)>, NonZeroU32), ConfigError> {
    let timeout = routes.concurrency_timeout_seconds.unwrap_or(60);
    let timeout = NonZeroU32::new(timeout)
        .filter(|t| t.get() <= CONCURRENCY_TIMEOUT_SECONDS_MAX)
        .ok_or_else(|| {
            let message = format!("must be between 1 and {CONCURRENCY_TIMEOUT_SECONDS_MAX}");
            invalid("routes.concurrency_timeout_seconds", message)
        })?;
    let listed = routes.concurrency.clone().unwrap_or_default();
    if let Some((route, earlier)) =
        crate::http::rules::first_twice(listed.keys().map(String::as_str))
    {
        let why = crate::http::rules::again(earlier);
        return Err(invalid(format!("routes.concurrency.\"{route}\""), why));
    }
    let mut limits = Vec::new();
    for (route, in_flight_max) in listed {
        let setting = format!("routes.concurrency.\"{route}\"");
        if !crate::http::rules::is_route_pattern(&route) {
            return Err(invalid(setting, crate::http::rules::ROUTE_PATTERN_RULE));
        }
        let exempt = routes.exempt.as_deref().unwrap_or_default();
        if let Some(exempt) = crate::http::rules::exempt_over(exempt, &route) {
            let why =
                format!("the route is exempt (routes.exempt {exempt:?}): no slot would be taken");
            return Err(invalid(setting, why));
        }
        // A slot plan's capacity, bounded as a plan's: past it, the start failed late (the
        // ledger up), naming a hashed plan, not this setting.
        use crate::limiter::plan::CAPACITY_MAX;
        let in_flight_max = NonZeroU64::new(in_flight_max)
            .filter(|max| max.get() <= CAPACITY_MAX)
            .ok_or_else(|| invalid(&setting, format!("must be 1 to {CAPACITY_MAX}")))?;
        limits.push((route, in_flight_max));
    }
    Ok((limits, timeout))
}

/// Callers known by their key alone, unknown keys rejected, and no key listed (no keys file, no
/// prefix): every request would be a 401, which no one means (as an Envoy rule of 0 requests is
/// refused). A keys file that lists nothing is caught where it is read (`listed_keys`).
fn refuses_every_key(config: &FileConfig) -> Result<(), ConfigError> {
    let caller = &config.caller;
    let every = caller.source.as_deref() == Some("header")
        && caller.unknown_keys.as_deref() == Some("reject")
        && caller.keys_file.is_none()
        && config.key_prefixes.as_ref().is_none_or(BTreeMap::is_empty);
    match every {
        true => Err(invalid(
            "caller.unknown_keys",
            "\"reject\" with no caller.keys_file and no [key_prefixes] refuses every key",
        )),
        false => Ok(()),
    }
}

/// `[plans]` as the file gives it.
type PlansTable = BTreeMap<String, PlanFile>;

/// The keys file's keys. One that lists none, where `refuses_every_key` would refuse the
/// configuration without the file, is refused too: an empty file (a deploy that wrote it late,
/// a template) answered every request 401.
fn listed_keys(
    caller: &CallerFile,
    (plans, prefixes): (Option<&PlansTable>, Option<&BTreeMap<String, String>>),
    key_length_max: usize,
) -> Result<Vec<(String, String)>, ConfigError> {
    let Some(path) = &caller.keys_file else {
        return Ok(Vec::new());
    };
    let is_plan = |name: &str| plans.is_some_and(|plans| plans.contains_key(name));
    let keys = keys_file::load(path, key_length_max, &is_plan)?;
    let every_key_refused = keys.is_empty()
        && caller.source.as_deref() == Some("header")
        && caller.unknown_keys.as_deref() == Some("reject")
        && prefixes.is_none_or(BTreeMap::is_empty);
    match every_key_refused {
        true => Err(invalid(
            "caller.keys_file",
            "lists no key, and with unknown_keys = \"reject\" and no [key_prefixes] every key \
             would be refused",
        )),
        false => Ok(keys),
    }
}

/// What `own` sets otherwise than the built-in defaults: a copy of `config/default.toml`, the
/// starting point the README gives, sets `forwarded_header` and `ipv6_prefix_length` to their
/// defaults, and was refused for settings `caller.source = "header"` never reads.
fn beside_defaults(mut own: CallerFile, defaults: &CallerFile) -> CallerFile {
    fn unless_default<T: PartialEq>(own: &mut Option<T>, default: &Option<T>) {
        if own.is_some() && own == default {
            *own = None;
        }
    }
    unless_default(&mut own.anonymous_plan, &defaults.anonymous_plan);
    unless_default(&mut own.forwarded_header, &defaults.forwarded_header);
    unless_default(&mut own.ipv6_prefix_length, &defaults.ipv6_prefix_length);
    unless_default(&mut own.keys_file, &defaults.keys_file);
    unless_default(&mut own.unknown_keys, &defaults.unknown_keys);
    unless_default(&mut own.header, &defaults.header);
    unless_default(&mut own.key_length_max, &defaults.key_length_max);
    own
}

/// A setting given (in the file or by a flag) that `source` never reads is an error: an
/// anonymous plan that never applies, or a keys file never consulted, was a surprise found only
/// when callers were limited otherwise. (The built-in defaults set some of these; only what
/// `own` sets counts.)
fn unread_caller_settings(
    own: &CallerFile,
    (listed_prefixes, own_missing_key_status): (bool, bool),
    source: &str,
) -> Result<(), ConfigError> {
    let (unread, why): (&[(&str, bool)], &str) = match source {
        "header" => (
            &[
                ("caller.anonymous_plan", own.anonymous_plan.is_some()),
                (
                    "caller.trusted_proxies",
                    own.trusted_proxies.as_ref().is_some_and(|p| !p.is_empty()),
                ),
                ("caller.forwarded_header", own.forwarded_header.is_some()),
                (
                    "caller.ipv6_prefix_length",
                    own.ipv6_prefix_length.is_some(),
                ),
                (
                    "caller.ipv4_translation_prefixes",
                    (own.ipv4_translation_prefixes.as_ref()).is_some_and(|p| !p.is_empty()),
                ),
            ],
            "callers are known by their key alone (caller.source = \"header\")",
        ),
        "peer-ip" => (
            &[
                ("caller.keys_file", own.keys_file.is_some()),
                ("caller.unknown_keys", own.unknown_keys.is_some()),
                ("key_prefixes", listed_prefixes),
                ("caller.header", own.header.is_some()),
                ("caller.key_length_max", own.key_length_max.is_some()),
                // No request lacks a key: none is looked for.
                ("response.missing_key_status", own_missing_key_status),
            ],
            "callers are known by their address alone (caller.source = \"peer-ip\")",
        ),
        _ => (&[], ""),
    };
    if let Some((setting, _)) = unread.iter().find(|(_, given)| *given) {
        return Err(invalid(*setting, format!("is never read: {why}")));
    }
    // Each address counts alone at 128 bits: no translator's client is looked for.
    let translators = own.ipv4_translation_prefixes.as_ref();
    if own.ipv6_prefix_length == Some(128) && translators.is_some_and(|p| !p.is_empty()) {
        let why = "is never read with caller.ipv6_prefix_length = 128 (each IPv6 address is a \
                   caller of its own, translated or not)";
        return Err(invalid("caller.ipv4_translation_prefixes", why));
    }
    Ok(())
}

/// Where callers' keys come from, and which proxies may name a caller's address.
fn key_rules(caller: &CallerFile) -> Result<RequestRulesBuilder, ConfigError> {
    let header = || require(caller.header.clone(), "caller.header");
    let rules = match require(caller.source.clone(), "caller.source")?.as_str() {
        "header" => RequestRules::builder().key_header(header()?),
        "header-or-peer-ip" => RequestRules::builder().key_header_or_peer_ip(header()?),
        "peer-ip" => RequestRules::builder().peer_ip(),
        other => {
            return Err(invalid(
                "caller.source",
                format!("{other:?} is none of \"header\", \"peer-ip\", \"header-or-peer-ip\""),
            ))
        }
    };
    let translators = caller.ipv4_translation_prefixes.clone().unwrap_or_default();
    let proxies = caller.trusted_proxies.clone().unwrap_or_default();
    Ok(proxies
        .into_iter()
        .fold(rules, RequestRulesBuilder::trusted_proxy)
        .ipv4_translation_prefixes(translators))
}

/// The header trusted proxies name callers in; `X-Forwarded-For` unless set.
fn forwarded_header(name: Option<String>) -> Result<ForwardedHeader, ConfigError> {
    let Some(name) = name else {
        return Ok(ForwardedHeader::default());
    };
    ForwardedHeader::parse(&name).ok_or_else(|| {
        let detail = format!("{name:?} is neither \"x-forwarded-for\" nor \"forwarded\"");
        invalid("caller.forwarded_header", detail)
    })
}

/// The `[routes]` and `[response]` rules, for the builder to check against the plans.
fn request_rules(
    mut rules: RequestRulesBuilder,
    routes: RoutesFile,
    response: ResponseFile,
) -> RequestRulesBuilder {
    for pattern in routes.exempt.unwrap_or_default() {
        rules = rules.exempt(pattern);
    }
    for (route, cost) in routes.costs.unwrap_or_default() {
        rules = rules.cost(route, cost);
    }
    for pattern in routes.shadow.unwrap_or_default() {
        rules = rules.shadow(pattern);
    }
    for pattern in routes.refund_server_errors.unwrap_or_default() {
        rules = rules.refund_server_errors(pattern);
    }
    if let Some(header) = routes.cost_header {
        rules = rules.cost_header(header);
    }
    if let Some(styles) = response.header_styles {
        rules = rules.header_styles(styles);
    }
    if let Some(status) = response.missing_key_status {
        rules = rules.missing_key_status(status);
    }
    rules
}

/// `[limits]` by name, attached to the routes of `routes.limits`.
fn route_limits(
    mut rules: RequestRulesBuilder,
    defined: Option<BTreeMap<String, PlanFile>>,
    routes: Option<BTreeMap<String, Vec<String>>>,
) -> Result<RequestRulesBuilder, ConfigError> {
    let mut limits = BTreeMap::new();
    for (name, limit) in defined.unwrap_or_default() {
        if limit.lease_units_max.is_some() || limit.lease_seconds.is_some() {
            let why = "leases apply to plans, not to route limits";
            return Err(invalid(format!("limits.{name}"), why));
        }
        let plan = plan_from_file(&name, &limit, "limits")?;
        limits.insert(name, plan);
    }
    let routes = routes.unwrap_or_default();
    // A limit defined and never named by a route was silently never applied.
    let named = |name: &String| routes.values().any(|names| names.contains(name));
    if let Some(unused) = limits.keys().find(|name| !named(name)) {
        let why = "no route names it in [routes.limits], so it would never apply";
        return Err(invalid(format!("limits.{unused}"), why));
    }
    for (route, names) in routes {
        let chosen = names
            .iter()
            .map(|name| {
                limits.get(name).cloned().ok_or_else(|| {
                    let why = format!("route {route:?} names limit {name:?}, not in [limits]");
                    invalid("routes.limits", why)
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        rules = rules.limits(route, chosen);
    }
    Ok(rules)
}

/// A plan (or a route limit) from its table, `section.name`.
fn plan_from_file(name: &str, plan: &PlanFile, section: &str) -> Result<Plan, ConfigError> {
    let setting = |field: &str| format!("{section}.{name}.{field}");
    let capacity = NonZeroU64::new(plan.capacity)
        .ok_or_else(|| invalid(setting("capacity"), "must be at least 1"))?;
    let window = NonZeroU32::new(plan.window_seconds)
        .ok_or_else(|| invalid(setting("window_seconds"), "must be at least 1"))?;
    // Names are the `plan` label of the decision metrics, where these two mean something else:
    // a plan named `none` was counted nowhere (the label of keys refused before any plan), and
    // one named `concurrency-…` was left out of the dashboard's request panels.
    // And `concurrency` names the slots in a refusal: the `ratelimit.limit` of its span, and
    // the item of its RateLimit fields beside the plan's (two items of one name otherwise).
    if crate::http::concurrency::reserved_name(name) {
        let why = format!(
            "the name is reserved: \"{PLAN_NONE}\", \"{CONCURRENCY_LIMIT_NAME}\" and names \
             starting \"{CONCURRENCY_PLAN_PREFIX}\" are labels of their own"
        );
        return Err(invalid(format!("{section}.{name}"), why));
    }
    Plan::new(name, capacity, window).map_err(|e| match e {
        PlanError::Capacity(_) => invalid(setting("capacity"), e.to_string()),
        _ => invalid(format!("{section}.{name}"), e.to_string()),
    })
}

/// The embedded ledger's settings given (not the defaults'), by name.
fn embedded_given(embedded: &EmbeddedFile) -> Vec<&'static str> {
    let given = [
        ("embedded.data_dir", embedded.data_dir.is_some()),
        (
            "embedded.tigerbeetle_bin",
            embedded.tigerbeetle_bin.is_some(),
        ),
        ("embedded.development", embedded.development.is_some()),
    ];
    given
        .iter()
        .filter(|(_, set)| *set)
        .map(|(name, _)| *name)
        .collect()
}

/// Replica addresses when given, else the embedded ledger.
fn ledger_location(
    addresses: Option<Vec<String>>,
    embedded: EmbeddedFile,
) -> Result<LedgerLocation, ConfigError> {
    let addresses = addresses.unwrap_or_default();
    if addresses.is_empty() {
        return Ok(LedgerLocation::Embedded {
            data_dir: require_path(embedded.data_dir, "embedded.data_dir")?,
            tigerbeetle_bin: require_path(embedded.tigerbeetle_bin, "embedded.tigerbeetle_bin")?,
            development: embedded.development.unwrap_or(true),
        });
    }
    // `a:3000, b:3000` from a shell is two addresses: the space was kept, the name never
    // resolved, and that replica stood in by a loopback address for good.
    let addresses: Vec<String> = addresses.iter().map(|a| a.trim().to_owned()).collect();
    check_addresses(&addresses)?;
    Ok(LedgerLocation::Cluster { addresses })
}

/// Each `host:port` (an IPv4 address or a name: the TigerBeetle client takes IPv4), once, at
/// most one per replica of the largest cluster.
fn check_addresses(addresses: &[String]) -> Result<(), ConfigError> {
    let error = |message: String| invalid("ledger.addresses", message);
    if addresses.len() > REPLICAS_MAX {
        let count = addresses.len();
        return Err(error(format!(
            "{count} addresses: a TigerBeetle cluster has {REPLICAS_MAX} replicas at most"
        )));
    }
    for (i, address) in addresses.iter().enumerate() {
        let (host, port) = address.rsplit_once(':').unwrap_or(("", ""));
        let port_ok = port.parse::<u16>().is_ok_and(|port| port != 0);
        if host.is_empty() || host.contains([':', ' ', '\t']) || !port_ok {
            return Err(error(format!(
                "{address:?} is not host:port (an IPv4 address or a name: TigerBeetle's client takes IPv4; a port from 1)"
            )));
        }
        // As the client reads them: a name in any case, a port with leading zeros or a `+`
        // (`a:3000` and `A:03000` are one replica, which the client refused, unnamed).
        let same = |other: &String| endpoint(other) == endpoint(address);
        if addresses[..i].iter().any(same) {
            return Err(error(format!("{address:?} is given twice")));
        }
    }
    Ok(())
}

/// A checked `host:port` as one replica's address: the host's letters in one case, the port's
/// number.
fn endpoint(address: &str) -> (String, Option<u16>) {
    let (host, port) = address.rsplit_once(':').unwrap_or((address, ""));
    (host.to_ascii_lowercase(), port.parse().ok())
}

/// The HTTP workers (`workers`) and the stop's drain delay (`drain_delay_seconds`), bounded.
fn serving(
    workers: Option<usize>,
    drain_delay_seconds: Option<u64>,
) -> Result<(NonZeroUsize, Duration), ConfigError> {
    let workers = NonZeroUsize::new(require(workers, "workers")?)
        .filter(|n| n.get() <= WORKERS_MAX)
        .ok_or_else(|| invalid("workers", format!("must be 1 to {WORKERS_MAX}")))?;
    let drain_delay = require(drain_delay_seconds, "drain_delay_seconds")?;
    if drain_delay > DRAIN_DELAY_SECONDS_MAX {
        let why = format!("must be 0 to {DRAIN_DELAY_SECONDS_MAX}");
        return Err(invalid("drain_delay_seconds", why));
    }
    Ok((workers, Duration::from_secs(drain_delay)))
}

/// `ledger.in_flight_max`, bounded.
fn in_flight_max(in_flight_max: Option<usize>) -> Result<NonZeroUsize, ConfigError> {
    NonZeroUsize::new(require(in_flight_max, "ledger.in_flight_max")?)
        .filter(|n| n.get() <= IN_FLIGHT_MAX_LIMIT)
        .ok_or_else(|| {
            let message = format!("must be 1 to {IN_FLIGHT_MAX_LIMIT}");
            invalid("ledger.in_flight_max", message)
        })
}

fn limiter_settings(ledger: &LedgerFile) -> Result<LimiterSettings, ConfigError> {
    let timeout_ms = require(ledger.timeout_ms, "ledger.timeout_ms")?;
    if timeout_ms == 0 || timeout_ms > LEDGER_TIMEOUT_MS_MAX {
        return Err(invalid(
            "ledger.timeout_ms",
            format!("must be between 1 and {LEDGER_TIMEOUT_MS_MAX}"),
        ));
    }
    let policy = require(ledger.failure_policy.clone(), "ledger.failure_policy")?;
    let failure_policy = one_of(
        policy,
        "ledger.failure_policy",
        &[
            ("open", FailurePolicy::Open),
            ("closed", FailurePolicy::Closed),
        ],
    )?;
    let local_callers_max = require(ledger.local_callers_max, "ledger.local_callers_max")?;
    if local_callers_max > LOCAL_CALLERS_MAX_LIMIT {
        let message = format!("must be at most {LOCAL_CALLERS_MAX_LIMIT} (0 turns the view off)");
        return Err(invalid("ledger.local_callers_max", message));
    }
    let expiry_margin_ms = require(ledger.expiry_margin_ms, "ledger.expiry_margin_ms")?;
    if expiry_margin_ms > EXPIRY_MARGIN_MS_MAX {
        return Err(invalid(
            "ledger.expiry_margin_ms",
            format!("must be at most {EXPIRY_MARGIN_MS_MAX}"),
        ));
    }
    Ok(LimiterSettings {
        ledger_timeout: Duration::from_millis(timeout_ms),
        failure_policy,
        local_callers_max,
        expiry_margin: Duration::from_millis(expiry_margin_ms),
    })
}

/// `ledger.batch_linger_ms`: at most [`BATCH_LINGER_MAX`], and shorter than a decision's
/// deadline (a linger as long would time out every batch's first request).
fn batch_linger(ledger: &LedgerFile, ledger_timeout: Duration) -> Result<Duration, ConfigError> {
    let linger_ms = require(ledger.batch_linger_ms, "ledger.batch_linger_ms")?;
    let linger = Duration::from_millis(linger_ms);
    if linger > BATCH_LINGER_MAX || (!linger.is_zero() && linger >= ledger_timeout) {
        let max_ms = BATCH_LINGER_MAX.as_millis();
        return Err(invalid(
            "ledger.batch_linger_ms",
            format!("must be between 0 and {max_ms}, and less than ledger.timeout_ms"),
        ));
    }
    Ok(linger)
}

fn plan_book(
    plans: Option<BTreeMap<String, PlanFile>>,
    default_plan: Option<String>,
    (prefixes, key_length_max): (Option<BTreeMap<String, String>>, usize),
    keys: Vec<(String, String)>,
    unknown_keys: Option<String>,
) -> Result<PlanBook, ConfigError> {
    let mut list = Vec::new();
    for (name, plan) in require(plans, "plans")? {
        let built = plan_from_file(&name, &plan, "plans")?;
        list.push(lease::plan_with_lease(built, &name, &plan)?);
    }
    let unknown_keys = one_of(
        require(unknown_keys, "caller.unknown_keys")?,
        "caller.unknown_keys",
        &[
            ("default-plan", UnknownKeys::DefaultPlan),
            ("reject", UnknownKeys::Reject),
        ],
    )?;
    let default_plan = require(default_plan, "default_plan")?;
    if !list.iter().any(|plan| plan.name() == default_plan) {
        let names: Vec<&str> = list.iter().map(|plan| plan.name()).collect();
        let message = format!(
            "{default_plan:?} is not among the plans ({}) (a file's [plans] replace the \
             built-in ones)",
            names.join(", ")
        );
        return Err(invalid("default_plan", message));
    }
    let prefixes = prefixes.unwrap_or_default();
    check_prefixes(&prefixes, &list, key_length_max)?;
    PlanBook::new(list, &default_plan, prefixes, keys, unknown_keys)
        .map_err(|e| invalid("plans", e.to_string()))
}

/// The most a configuration file is read of: a configuration is a few kilobytes.
pub const CONFIG_FILE_BYTES_MAX: u64 = 1024 * 1024;

/// The text of the file at `path`, if at most `bytes_max` long; else why not, naming the file.
/// Read through a bound, not after a size check: a pipe, `/dev/zero` or a file still growing
/// has a size that does not say what a read would take.
fn read_bounded(path: &Path, bytes_max: u64) -> Result<String, String> {
    use std::io::Read;
    let unreadable = |e: std::io::Error| format!("cannot read {}: {e}", path.display());
    let file = std::fs::File::open(path).map_err(unreadable)?;
    let mut bytes = Vec::new();
    file.take(bytes_max + 1)
        .read_to_end(&mut bytes)
        .map_err(unreadable)?;
    // The size first: a cut inside a character would otherwise read as text that is not UTF-8.
    if bytes.len() as u64 > bytes_max {
        return Err(format!(
            "{} is larger than {bytes_max} bytes",
            path.display()
        ));
    }
    String::from_utf8(bytes).map_err(|_| format!("{} is not UTF-8 text", path.display()))
}

/// `[key_prefixes]`, each named in its error by its plan, never by its text (nor by its place in
/// the table, sorted by that text): under
/// `unknown_keys = "reject"` a prefix admits whoever knows it (the book's own errors would name
/// `plans`). A prefix no key could start with (a key is visible ASCII, at most
/// `key_length_max` bytes) would match nothing, silently.
fn check_prefixes(
    prefixes: &BTreeMap<String, String>,
    plans: &[Plan],
    key_length_max: usize,
) -> Result<(), ConfigError> {
    for (prefix, plan) in prefixes {
        let fail = |why: &str| {
            let message = format!("a prefix for plan {plan:?} {why}");
            Err(invalid("key_prefixes", message))
        };
        if prefix.is_empty() {
            return fail("must not be empty");
        }
        if !crate::limiter::caller::is_valid_key(prefix.as_bytes(), key_length_max) {
            return fail(&format!(
                "can start no key: keys are visible ASCII (no spaces), at most \
                 caller.key_length_max ({key_length_max}) bytes"
            ));
        }
        if !plans.iter().any(|p| p.name() == plan) {
            let names: Vec<&str> = plans.iter().map(|p| p.name()).collect();
            return fail(&format!(
                "names a plan not among the plans ({})",
                names.join(", ")
            ));
        }
    }
    Ok(())
}

/// How long one ledger address' lookup may take: a resolver that never answers must not hold
/// up a start or an operator's command for good.
pub const RESOLVE_TIME_MAX: Duration = Duration::from_secs(10);

/// Resolves `host:port` strings to socket addresses (the TigerBeetle client takes IPs only),
/// each within [`RESOLVE_TIME_MAX`], all at once.
pub async fn resolve_addresses(addresses: &[String]) -> Result<Vec<SocketAddr>, ConfigError> {
    let lookups = addresses.iter().map(|address| async move {
        let found = lookup(address).await.map_err(|e| unresolved(address, &e))?;
        lowest_ipv4(address, found)
    });
    futures_util::future::join_all(lookups)
        .await
        .into_iter()
        .collect()
}

/// [`resolve_addresses`] for the address follower: a name that does not resolve keeps its
/// replica's `current` address (a warning says so, once a second at most), and the others are
/// followed. All or nothing, one missing name (Docker's and Kubernetes' DNS drop a stopped
/// replica's) kept a replica that came back at a new address unfollowed too, while the cluster
/// had its quorum. An error (which the follower logs) when a name does not resolve and nothing
/// else changed.
pub async fn resolve_addresses_keeping(
    addresses: &[String],
    current: &[SocketAddr],
) -> Result<Vec<SocketAddr>, ConfigError> {
    assert_eq!(addresses.len(), current.len(), "one address per replica");
    let lookups = addresses.iter().map(|address| lookup(address));
    let found = futures_util::future::join_all(lookups).await;
    let mut resolved = Vec::with_capacity(addresses.len());
    let mut kept = Vec::new();
    let mut first_error = None;
    for (replica, ((address, found), current)) in
        addresses.iter().zip(found).zip(current).enumerate()
    {
        // A name with no IPv4 address (for now) is kept as one that does not resolve.
        let found = found.map_err(|error| unresolved(address, &error));
        match found.and_then(|found| lowest_ipv4(address, found)) {
            Ok(found) => resolved.push(found),
            Err(error) => {
                first_error.get_or_insert(error);
                kept.push(replica);
                resolved.push(*current);
            }
        }
    }
    // A kept address another replica resolves to now (a platform reuses a stopped replica's
    // IP): the client refuses two replicas at one address, and the new one was never followed.
    for replica in kept {
        let taken = (resolved.iter().enumerate())
            .any(|(other, at)| other != replica && *at == resolved[replica]);
        if taken {
            resolved[replica] = stand_in_address(replica);
        }
    }
    match first_error {
        Some(error) if resolved == current => Err(error),
        Some(error) => {
            if crate::telemetry::log_throttle(&KEPT_LOGGED_SECOND) {
                tracing::warn!(%error, "a replica's address does not resolve; it keeps the last one, and the others are followed");
            }
            Ok(resolved)
        }
        None => Ok(resolved),
    }
}

static KEPT_LOGGED_SECOND: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// [`resolve_addresses`] for a service that starts: a name that does not resolve stands in as
/// an address nothing answers at (loopback, port 1 up: one per replica, in its place, since the
/// client takes the replicas in order), with a warning, and the service starts. Why: Docker's
/// and Kubernetes' DNS drop a stopped replica's name, and a service restarted then exited,
/// restarted and exited, while the other replicas served (or, with the whole cluster down, never
/// answered with its failure policy). The addresses are followed: once every name resolves,
/// the client is pointed at them. A name that resolves to no IPv4 address is an error still.
pub async fn resolve_addresses_or_stand_ins(
    addresses: &[String],
) -> Result<Vec<SocketAddr>, ConfigError> {
    let lookups = addresses.iter().map(|address| lookup(address));
    let found = futures_util::future::join_all(lookups).await;
    let mut resolved = Vec::with_capacity(addresses.len());
    for (replica, (address, found)) in addresses.iter().zip(found).enumerate() {
        match found {
            Ok(found) => resolved.push(lowest_ipv4(address, found)?),
            Err(error) => {
                let stand_in = stand_in_address(replica);
                let error = unresolved(address, &error);
                tracing::warn!(%error, %stand_in, "a replica's address does not resolve; it stands in until it does");
                resolved.push(stand_in);
            }
        }
    }
    Ok(resolved)
}

/// Where an unresolved replica `replica` is looked for meanwhile: a loopback port below 1024
/// nothing listens at (a connection is refused at once), one per replica (the client refuses
/// two replicas at one address).
pub fn stand_in_address(replica: usize) -> SocketAddr {
    assert!(replica < REPLICAS_MAX, "ledger.addresses is validated");
    let port = u16::try_from(replica + 1).expect("at most REPLICAS_MAX");
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// TigerBeetle's largest cluster (active replicas; a client is given those).
pub const REPLICAS_MAX: usize = 6;

async fn lookup(address: &str) -> std::io::Result<Vec<SocketAddr>> {
    let lookup = tokio::time::timeout(RESOLVE_TIME_MAX, tokio::net::lookup_host(address)).await;
    match lookup {
        Ok(found) => Ok(found?.collect()),
        Err(_) => {
            let late = format!("no answer within {RESOLVE_TIME_MAX:?}");
            Err(std::io::Error::new(std::io::ErrorKind::TimedOut, late))
        }
    }
}

fn unresolved(address: &str, error: &std::io::Error) -> ConfigError {
    invalid(
        "ledger.addresses",
        format!("cannot resolve {address:?}: {error}"),
    )
}

/// The lowest of several records, not the first: the order DNS gives them in changes, and each
/// change of address would reconnect the ledger client.
fn lowest_ipv4(address: &str, found: Vec<SocketAddr>) -> Result<SocketAddr, ConfigError> {
    found
        .into_iter()
        .filter(|a| a.is_ipv4())
        .min()
        .ok_or_else(|| {
            invalid(
                "ledger.addresses",
                format!("{address:?} has no IPv4 address"),
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2048))]

        /// Hostile configuration text (arbitrary, and TOML-shaped with arbitrary values) is an
        /// error naming where it is, or a valid configuration: never a panic.
        #[test]
        fn any_config_text_is_an_error_or_valid(
            text in prop_oneof![
                ".{0,200}",
                "(\\[(ledger|caller|routes|plans\\.[a-z]{1,3}|routes\\.costs)\\]\n)?[a-z_]{1,16} = (-?[0-9]{1,20}|\"[ -~]{0,20}\"|\\[\\]|true)\n{1,3}"
            ],
        ) {
            match FileConfig::parse(&text, "fuzz.toml") {
                Ok(file) => {
                    if let Err(err) = Settings::with_overrides(file) {
                        prop_assert!(!err.setting.is_empty() && !err.message.is_empty(), "{err}");
                    }
                }
                Err(err) => {
                    prop_assert_eq!(err.setting.as_str(), "fuzz.toml");
                    prop_assert!(!err.message.is_empty());
                }
            }
        }

        #[test]
        fn line_and_column_never_panics(text in ".{0,64}", offset in 0usize..80) {
            let (line, column) = line_and_column(&text, offset);
            prop_assert!(line >= 1 && column >= 1);
        }
    }

    fn with(text: &str) -> Result<Settings, ConfigError> {
        Settings::with_overrides(FileConfig::parse(text, "test").unwrap())
    }

    /// Every ```toml block of the README, as an operator would paste it into an empty file.
    #[test]
    fn every_configuration_example_in_the_readme_is_valid() {
        let readme = include_str!("../../README.md");
        let blocks: Vec<&str> = readme
            .split("```toml\n")
            .skip(1)
            .map(|rest| rest.split("```").next().unwrap())
            .collect();
        assert!(blocks.len() >= 8, "the README's examples: {}", blocks.len());
        for block in blocks {
            if let Err(error) = with(block) {
                panic!("{error}, in the README's example:\n{block}");
            }
        }
    }

    /// `rls.connections_max` and `rls.calls_max`: 4,096 by default, 1 to 2^20, and an error
    /// without the listener, as `rls.config` is.
    #[test]
    fn the_envoy_front_ends_connection_bound_is_checked() {
        let rules = concat!(env!("CARGO_MANIFEST_DIR"), "/envoy/ratelimit");
        let rls = |extra: &str| {
            with(&format!(
                "[rls]\nlisten = \"127.0.0.1:0\"\nconfig = {rules:?}\n{extra}"
            ))
        };
        let bounds = |settings: Settings| {
            let bounds = settings.rls.expect("on").bounds;
            (bounds.connections_max.get(), bounds.calls_max.get())
        };
        assert_eq!(bounds(rls("").unwrap()), (4096, 4096));
        let least = rls("connections_max = 1\ncalls_max = 1").unwrap();
        assert_eq!(bounds(least), (1, 1));
        let most = rls("connections_max = 1048576\ncalls_max = 1048576").unwrap();
        assert_eq!(bounds(most), (1 << 20, 1 << 20));
        for key in ["connections_max", "calls_max"] {
            for bad in ["0", "1048577"] {
                let err = rls(&format!("{key} = {bad}")).unwrap_err();
                assert_eq!(err.setting, format!("rls.{key}"), "{bad}");
                assert!(err.message.contains("1 to 1048576"), "{err}");
            }
            let off = with(&format!("[rls]\n{key} = 8")).unwrap_err();
            assert_eq!(off.setting, format!("rls.{key}"));
            assert!(off.message.contains("set rls.listen"), "{off}");
        }
    }

    #[test]
    fn plans_of_ones_own_without_the_default_plan_name_the_setting() {
        let err = with("[plans.anon]\ncapacity = 2\nwindow_seconds = 60").unwrap_err();
        assert_eq!(err.setting, "default_plan");
        assert!(err.message.contains("replace the built-in"), "{err}");
        let ok = with("default_plan = \"anon\"\n[plans.anon]\ncapacity = 2\nwindow_seconds = 60");
        assert_eq!(ok.unwrap().plans.plans().len(), 1);
    }

    /// A plan's name is its decisions' `plan` label, where `none` and `concurrency-…` mean
    /// something else: such a plan's decisions were counted nowhere, or left off the dashboard.
    #[test]
    fn plan_and_limit_names_that_are_metric_labels_of_their_own_are_refused() {
        for (section, name) in [
            ("plans", "none"),
            ("plans", "concurrency-x"),
            ("limits", "concurrency-"),
            // A route limit's refusals are `ratelimit.limit = <name>`, a slot's `concurrency`;
            // and a slot's 429 lists `"concurrency"` beside the plan in its RateLimit fields.
            ("limits", "concurrency"),
            ("plans", "concurrency"),
        ] {
            let text = format!("default_plan = \"a\"\n[plans.a]\ncapacity = 2\nwindow_seconds = 60\n[{section}.{name}]\ncapacity = 2\nwindow_seconds = 60");
            let err = with(&text).unwrap_err();
            assert_eq!(err.setting, format!("{section}.{name}"));
            assert!(err.message.contains("reserved"), "{err}");
        }
        let fine = "default_plan = \"nonea\"\n[plans.nonea]\ncapacity = 2\nwindow_seconds = 60";
        assert!(with(fine).is_ok());
    }

    #[test]
    fn a_caller_setting_the_source_never_reads_is_an_error() {
        let err = with("[caller]\nanonymous_plan = \"free\"").unwrap_err();
        assert_eq!(err.setting, "caller.anonymous_plan");
        assert!(err.message.contains("by their key alone"), "{err}");
        let peer = "[caller]\nsource = \"peer-ip\"\n";
        let err = with(&format!("{peer}unknown_keys = \"reject\"")).unwrap_err();
        assert_eq!(err.setting, "caller.unknown_keys");
        let err = with(&format!("[key_prefixes]\n\"p_\" = \"pro\"\n{peer}")).unwrap_err();
        assert_eq!(err.setting, "key_prefixes");
        let err = with(&format!("{peer}key_length_max = 64")).unwrap_err();
        assert_eq!(err.setting, "caller.key_length_max");
        let whole = "ipv6_prefix_length = 128\nipv4_translation_prefixes = [\"64:ff9b:1::/96\"]";
        let err = with(&format!("{peer}{whole}")).unwrap_err();
        assert_eq!(err.setting, "caller.ipv4_translation_prefixes");
        assert!(with(&format!("{peer}ipv6_prefix_length = 128")).is_ok());
        // What the defaults set is no error, nor an empty list, nor a setting the source reads.
        assert!(with(peer).is_ok());
        assert!(with("[caller]\ntrusted_proxies = []").is_ok());
        let either = "[caller]\nsource = \"header-or-peer-ip\"\nanonymous_plan = \"free\"";
        assert!(with(either).is_ok());
    }

    /// Two patterns of one table that match the same paths (they differ in the case of a
    /// percent-escape alone) are refused, naming the second: one of them silently never applied.
    #[test]
    fn patterns_one_path_matches_alike_are_refused() {
        let per_day = "[limits.per_day]\ncapacity = 100\nwindow_seconds = 86400\n";
        for (table, setting) in [
            ("[routes.costs]\n\"/f/a%2fb\" = 2\n\"/f/a%2Fb\" = 1", "routes.costs.\"/f/a%2fb\""),
            ("[routes.concurrency]\n\"/f/a%2fb\" = 2\n\"/f/a%2Fb\" = 1", "routes.concurrency.\"/f/a%2fb\""),
            (
                &format!("{per_day}[routes.limits]\n\"/f/a%2fb\" = [\"per_day\"]\n\"/f/a%2Fb\" = [\"per_day\"]"),
                "routes.limits",
            ),
        ] {
            let err = with(table).unwrap_err();
            assert_eq!(err.setting, setting, "{err}");
            assert!(err.message.contains("again") && err.to_string().contains("/f/a%2fb"), "{err}");
        }
        let apart = "[routes.costs]\n\"/f/a%2fb\" = 2\n\"/f/a%2fc\" = 1";
        assert!(with(apart).is_ok());
    }

    /// Trusting a block wider than any network of proxies (a family, or its two halves) believes
    /// every client's forwarding header: each could name an address of its choosing per request.
    #[test]
    fn trusting_blocks_wider_than_any_proxy_network_is_refused() {
        let peer = "[caller]\nsource = \"peer-ip\"\n";
        let too_wide = [
            "0.0.0.0/0",
            "::/0",
            "::ffff:0.0.0.0/96",
            "10.0.0.0/0",
            "0.0.0.0/1",
            "128.0.0.0/1",
            "8000::/1",
            "10.0.0.0/7",
            "fc00::/6",
            "::ffff:10.0.0.0/103",
        ];
        for wide in too_wide {
            let config = format!("{peer}trusted_proxies = [\"10.0.0.0/8\", {wide:?}]");
            let err = with(&config).unwrap_err();
            assert_eq!(err.setting, "caller.trusted_proxies", "{wide}");
            assert!(err.message.contains("wider than any network"), "{err}");
        }
        let widest = [
            "10.0.0.0/8",
            "100.64.0.0/10",
            "fc00::/7",
            "::ffff:10.0.0.0/104",
        ];
        let config = format!("{peer}trusted_proxies = {widest:?}");
        assert!(
            with(&config).is_ok(),
            "the widest private blocks are proxies' networks"
        );
    }

    #[test]
    fn a_key_prefix_error_names_its_plan_never_the_prefix() {
        let err = with("[key_prefixes]\n\"sk_secret_\" = \"gold\"").unwrap_err();
        assert_eq!(err.setting, "key_prefixes");
        assert!(
            err.message
                .contains("a prefix for plan \"gold\" names a plan not among the plans (basic"),
            "{err}"
        );
        assert!(!err.to_string().contains("sk_secret_"), "{err}");
        let err = with("[key_prefixes]\n\"\" = \"free\"").unwrap_err();
        assert!(err.message.contains("must not be empty"), "{err}");
        assert!(with("[key_prefixes]\n\"gold_\" = \"pro\"").is_ok());
        // A prefix no key can start with matched nothing, silently.
        for never in ["\"pro key_\"", "\"clé_\"", "\"0123456789\""] {
            let text = format!("[caller]\nkey_length_max = 8\n[key_prefixes]\n{never} = \"pro\"");
            let err = with(&text).unwrap_err();
            assert_eq!(err.setting, "key_prefixes", "{never}");
            assert!(err.message.contains("can start no key"), "{err}");
        }
    }

    #[test]
    fn listen_addresses_are_host_and_port_each_its_own() {
        for good in [
            "127.0.0.1:0",
            "0.0.0.0:8080",
            "[::]:8080",
            "[::1]:1",
            "localhost:80",
        ] {
            assert!(with(&format!("listen = {good:?}")).is_ok(), "{good}");
        }
        for bad in [
            "nonsense",
            "8080",
            ":8080",
            "127.0.0.1:http",
            "::1:80",
            "[::1:80",
            "a:70000",
        ] {
            let err = with(&format!("listen = {bad:?}")).unwrap_err();
            assert_eq!(err.setting, "listen", "{bad}: {err}");
        }
        let secret = "secrets = [\"0123456789abcdef\"]";
        let same =
            format!("listen = \"127.0.0.1:8080\"\n[admin]\nlisten = \"127.0.0.1:8080\"\n{secret}");
        assert_eq!(with(&same).unwrap_err().setting, "admin.listen");
        let bad = format!("[admin]\nlisten = \"nonsense\"\n{secret}");
        assert_eq!(with(&bad).unwrap_err().setting, "admin.listen");
        let overlapping = "listen = \"0.0.0.0:8080\"\n[admin]\nlisten = \"127.0.0.1:8080\"";
        let overlapping = format!("{overlapping}\n{secret}");
        assert_eq!(with(&overlapping).unwrap_err().setting, "admin.listen");
        let apart = "listen = \"127.0.0.1:8080\"\n[admin]\nlisten = \"127.0.0.1:9091\"";
        assert!(with(&format!("{apart}\n{secret}")).is_ok());
        let padded =
            format!("listen = \"127.0.0.1:08080\"\n[admin]\nlisten = \"127.0.0.1:8080\"\n{secret}");
        assert_eq!(
            with(&padded).unwrap_err().setting,
            "admin.listen",
            "one port, written twice"
        );
        let both_free =
            format!("listen = \"127.0.0.1:0\"\n[admin]\nlisten = \"127.0.0.1:0\"\n{secret}");
        assert!(with(&both_free).is_ok());
        let metrics =
            |listen: &str| format!("listen = \"127.0.0.1:8080\"\n[metrics]\nlisten = {listen:?}");
        assert_eq!(
            with(&metrics("nonsense")).unwrap_err().setting,
            "metrics.listen"
        );
        let err = with(&metrics("0.0.0.0:8080")).unwrap_err();
        assert_eq!(err.setting, "metrics.listen");
        assert!(err.message.contains("`listen`'s"), "{err}");
        let with_admin = format!(
            "{}\n[admin]\nlisten = \"127.0.0.1:9091\"\n{secret}",
            metrics("127.0.0.1:9091")
        );
        let err = with(&with_admin).unwrap_err();
        assert_eq!(err.setting, "metrics.listen");
        assert!(err.message.contains("`admin.listen`'s"), "{err}");
        let apart = with(&metrics("127.0.0.1:9464")).unwrap();
        assert_eq!(apart.metrics_listen.as_deref(), Some("127.0.0.1:9464"));
        assert_eq!(
            with("").unwrap().metrics_listen,
            None,
            "on `listen` by default"
        );
    }

    #[test]
    fn defaults_are_valid() {
        let s = with("").unwrap();
        assert_eq!(s.plans.plans().len(), 3);
        assert!(matches!(s.ledger, LedgerLocation::Embedded { .. }));
        assert_eq!(s.limiter.failure_policy, FailurePolicy::Closed);
        assert_eq!(s.batch_linger, Duration::ZERO, "a linger is opt-in");
    }

    /// A translator prefix of one's own is an IPv6 /96, read where callers may be known by
    /// their address only.
    #[test]
    fn translation_prefixes_are_ipv6_96s_read_only_for_addresses() {
        let prefixes = "ipv4_translation_prefixes = [\"64:ff9b:1::/96\"]";
        let peer = format!("[caller]\nsource = \"peer-ip\"\n{prefixes}");
        assert!(with(&peer).is_ok());
        let err = with(&format!("[caller]\n{prefixes}")).unwrap_err();
        assert_eq!(err.setting, "caller.ipv4_translation_prefixes");
        assert!(err.message.contains("never read"), "{err}");
        let bad =
            "[caller]\nsource = \"peer-ip\"\nipv4_translation_prefixes = [\"64:ff9b:1::/64\"]";
        assert_eq!(
            with(bad).unwrap_err().setting,
            "caller.ipv4_translation_prefixes"
        );
    }

    /// The README's starting point, `config/default.toml` copied as one's own file, is valid as
    /// it is (it spells out defaults the key source does not read, which alone are no error).
    #[test]
    fn the_built_in_file_is_a_valid_file_of_ones_own() {
        let built_in = include_str!("../../config/default.toml");
        assert!(with(built_in).is_ok(), "{:?}", with(built_in).err());
        let peer = built_in.replace("source = \"header\"", "source = \"peer-ip\"");
        assert_ne!(peer, built_in);
        let err = with(&peer).unwrap_err();
        assert!(err.message.contains("is never read"), "{err}");
        // Not for the defaults it spells out: for the prefixes, which name plans by keys.
        assert_eq!(err.setting, "key_prefixes", "{err}");
        // Without them, the file is an address-keyed one's: what it spells out of the key
        // settings (the header, the key length) is the defaults', and no error.
        let (start, end) = (
            peer.find("[key_prefixes]").unwrap(),
            peer.find("[routes]").unwrap(),
        );
        let no_prefixes = format!("{}[key_prefixes]\n{}", &peer[..start], &peer[end..]);
        assert!(with(&no_prefixes).is_ok(), "{:?}", with(&no_prefixes).err());
    }

    /// An exempt request is neither charged nor looked at further: a rule on exempt paths would
    /// silently never apply, so it is refused, naming the rule.
    #[test]
    fn rules_on_exempt_paths_are_refused() {
        let exempt = "[routes]\nexempt = [\"/public/*\", \"/ping\"]\n";
        let limit = "[limits.per_day]\ncapacity = 100\nwindow_seconds = 86400\n";
        for (rule, setting) in [
            (
                "[routes.costs]\n\"/public/export\" = 3",
                "routes.costs.\"/public/export\"",
            ),
            (
                "[routes.costs]\n\"/public/*\" = 3",
                "routes.costs.\"/public/*\"",
            ),
            (
                "[routes.concurrency]\n\"/ping\" = 2",
                "routes.concurrency.\"/ping\"",
            ),
            (
                &format!("[routes.limits]\n\"/public/a\" = [\"per_day\"]\n{limit}"),
                "routes.limits.\"/public/a\"",
            ),
        ] {
            let err = with(&format!("{exempt}{rule}")).unwrap_err();
            assert_eq!(err.setting, setting, "{err}");
            assert!(err.message.contains("exempt"), "{err}");
        }
        let shadow = format!("{exempt}shadow = [\"/public/x\"]");
        assert_eq!(with(&shadow).unwrap_err().setting, "routes.shadow");
        // A pattern reaching past the exempt paths still applies somewhere: accepted.
        assert!(with(&format!(
            "{exempt}[routes.costs]\n\"/pub*\" = 3\n\"/ping*\" = 2"
        ))
        .is_ok());
    }

    /// The embedded ledger's settings given beside `ledger.addresses` are named as unread (the
    /// binary warns of each): they were ignored without a word. Not the defaults', nor any
    /// without addresses.
    #[test]
    fn embedded_settings_beside_ledger_addresses_are_named_unread() {
        let cluster = "[ledger]\naddresses = [\"127.0.0.1:3000\"]\n";
        assert!(
            with(cluster).unwrap().unread.is_empty(),
            "the defaults' are not named"
        );
        let given = format!("{cluster}[embedded]\ndata_dir = \"d\"\ndevelopment = false\n");
        let unread = with(&given).unwrap().unread;
        assert_eq!(unread, ["embedded.data_dir", "embedded.development"]);
        let embedded = with("[embedded]\ndata_dir = \"d\"\n").unwrap();
        assert!(embedded.unread.is_empty(), "read by the embedded ledger");
    }

    /// None of these can reach a replica: refused here, not stood in for at the start.
    #[test]
    fn ledger_addresses_are_ipv4_or_names_each_once_six_at_most() {
        let seven = (1..=7)
            .map(|i| format!("\"r{i}:3000\""))
            .collect::<Vec<_>>()
            .join(", ");
        for bad in [
            "\"[::1]:3000\"",
            "\":3000\"",
            "\"a:1\", \"a:1\"",
            "\"a::1\"",
            "\"a:0\"",
            "\"a b:3000\"",
            "\"a:1\", \" a:1\"",
            &seven,
        ] {
            let err = with(&format!("[ledger]\naddresses = [{bad}]")).unwrap_err();
            assert_eq!(err.setting, "ledger.addresses", "{bad}");
        }
        let six = (1..=6)
            .map(|i| format!("\"r{i}:3000\""))
            .collect::<Vec<_>>()
            .join(", ");
        assert!(with(&format!("[ledger]\naddresses = [{six}]")).is_ok());
        // As a shell's `a:3000, b:3000` splits: the space is no part of the name.
        let spaced = with("[ledger]\naddresses = [\"a:3000\", \" b:3000 \"]").unwrap();
        let expected = ["a:3000", "b:3000"].map(str::to_owned).to_vec();
        assert_eq!(
            spaced.ledger,
            LedgerLocation::Cluster {
                addresses: expected
            }
        );
    }

    /// A capacity past what a field's integer carries names its setting.
    #[test]
    fn a_capacity_past_15_digits_names_the_setting() {
        let err = with("[plans.free]\ncapacity = 1000000000000000\nwindow_seconds = 30");
        let err = err.unwrap_err();
        assert_eq!(err.setting, "plans.free.capacity");
        assert!(with("[plans.free]\ncapacity = 999999999999999\nwindow_seconds = 30").is_ok());
    }

    /// An empty path in the file was the working directory, where the data file was made.
    #[test]
    fn an_empty_embedded_path_is_refused() {
        for path in ["data_dir", "tigerbeetle_bin"] {
            let err = with(&format!("[embedded]\n{path} = \"\"")).unwrap_err();
            assert_eq!(err.setting, format!("embedded.{path}"));
        }
    }

    /// Values the code could not serve, refused at their setting: slots past a plan's capacity
    /// (the start failed late, naming a hashed plan), one replica spelt twice (the client
    /// refused it, unnamed), a missing-key status that `peer-ip` never reads.
    #[test]
    fn values_refused_late_or_never_read_name_their_setting() {
        // Slots bounded as a plan's capacity, refused here, not at the start's end.
        let err = with("[routes.concurrency]\n\"/greeting\" = 1000000000000000").unwrap_err();
        assert_eq!(err.setting, "routes.concurrency.\"/greeting\"");
        assert!(with("[routes.concurrency]\n\"/greeting\" = 999999999999999").is_ok());
        let err = with("workers = 100000").unwrap_err();
        assert_eq!(err.setting, "workers");
        let err = with("drain_delay_seconds = 61").unwrap_err();
        assert_eq!(err.setting, "drain_delay_seconds");
        assert_eq!(
            with("drain_delay_seconds = 60")
                .unwrap()
                .drain_delay
                .as_secs(),
            60
        );
        for twice in [
            "\"a:3000\", \"a:03000\"",
            "\"a:3000\", \"A:3000\"",
            "\"a:3000\", \"a:+3000\"",
        ] {
            let err = with(&format!("[ledger]\naddresses = [{twice}]")).unwrap_err();
            assert_eq!(err.setting, "ledger.addresses", "{twice}");
            assert!(err.message.contains("twice"), "{err}");
        }
        assert!(with("[ledger]\naddresses = [\"a:3000\", \"a:3001\"]").is_ok());
        let peer_ip = "[caller]\nsource = \"peer-ip\"\n[response]\nmissing_key_status = ";
        let err = with(&format!("{peer_ip}400")).unwrap_err();
        assert_eq!(err.setting, "response.missing_key_status");
        assert!(
            with(&format!("{peer_ip}401")).is_ok(),
            "a copy of the default"
        );
    }

    #[test]
    fn errors_name_the_setting() {
        let err = with("[plans.free]\ncapacity = 0\nwindow_seconds = 30").unwrap_err();
        assert_eq!(err.setting, "plans.free.capacity");
        let err = with("[plans.free]\ncapacity = 5\nwindow_seconds = 0").unwrap_err();
        assert_eq!(err.setting, "plans.free.window_seconds");
        let err = with("[routes.costs]\n\"/greeting\" = 6").unwrap_err();
        assert_eq!(err.setting, "routes.costs.\"/greeting\"");
        assert!(err.message.contains("exceeds"), "{}", err.message);
        let err = with("[ledger]\nfailure_policy = \"maybe\"").unwrap_err();
        assert_eq!(err.setting, "ledger.failure_policy");
        let err = with("[ledger]\ntimeout_ms = 0").unwrap_err();
        assert_eq!(err.setting, "ledger.timeout_ms");
        let err = with("[ledger]\nbatch_linger_ms = 6").unwrap_err();
        assert_eq!(err.setting, "ledger.batch_linger_ms");
        let err = with("[ledger]\nbatch_linger_ms = 5\ntimeout_ms = 5").unwrap_err();
        assert_eq!(err.setting, "ledger.batch_linger_ms");
        let ok = with("[ledger]\nbatch_linger_ms = 5\ntimeout_ms = 6").unwrap();
        assert_eq!(ok.batch_linger, Duration::from_millis(5));
        let err = with("[ledger]\naddresses = [\"nope\"]").unwrap_err();
        assert_eq!(err.setting, "ledger.addresses");
        let err = with("default_plan = \"gold\"").unwrap_err();
        assert_eq!(err.setting, "default_plan");
        let err = with("[caller]\nheader = \"bad header\"").unwrap_err();
        assert_eq!(err.setting, "caller.header");
        let big = "340282366920938463463374607431768211455"; // 2^128 - 1
        let id = with(&format!("[ledger]\ncluster_id = \"{big}\""))
            .unwrap()
            .cluster_id;
        assert_eq!(id, u128::MAX);
        assert_eq!(with("[ledger]\ncluster_id = 7").unwrap().cluster_id, 7);
        for bad in ["-1", "\"0x10\"", "1.5"] {
            let err = FileConfig::parse(&format!("[ledger]\ncluster_id = {bad}"), "f").unwrap_err();
            assert!(err.message.contains("2^128 - 1"), "{bad}: {}", err.message);
        }
        let err = with("[admin]\nlisten = \"127.0.0.1:9091\"").unwrap_err();
        assert_eq!(err.setting, "admin.listen");
        let secrets_alone = "[admin]\nsecrets = [\"admin-secret-for-tests-0001\"]";
        let err = with(secrets_alone).unwrap_err();
        assert_eq!(err.setting, "admin.listen");
        assert!(err.message.starts_with("is not set"), "{err}");
        assert!(!err.to_string().contains("admin-secret-for-tests"), "{err}");
        assert!(with("[admin]\nsecrets = []").unwrap().admin.is_none());
        let err = with("[routes.concurrency]\n\"/a/*/b\" = 1").unwrap_err();
        assert_eq!(err.setting, "routes.concurrency.\"/a/*/b\"");
        let err = with("[ledger]\nin_flight_max = 4611686018427387904").unwrap_err();
        assert_eq!(err.setting, "ledger.in_flight_max");
        let err = with("[ledger]\nlocal_callers_max = 1000000000000").unwrap_err();
        assert_eq!(err.setting, "ledger.local_callers_max");
        // Plans of one's own, without prefixes: the built-in prefixes go with the built-in plans.
        let own = with("default_plan = \"gold\"\n[plans.gold]\ncapacity = 5\nwindow_seconds = 30");
        assert_eq!(own.unwrap().plans.plans().len(), 1);
        let by_address = "[caller]\nsource = \"header-or-peer-ip\"\n";
        let err = with(&format!("{by_address}forwarded_header = \"x-real-ip\"")).unwrap_err();
        assert_eq!(err.setting, "caller.forwarded_header");
        assert!(err.message.contains("neither"), "{err}");
        assert!(with(&format!("{by_address}forwarded_header = \"Forwarded\"")).is_ok());
        let err = FileConfig::parse("[ledger]\ntimeout = 5", "f.toml").unwrap_err();
        assert!(err.message.contains("unknown field"), "{}", err.message);
        assert!(
            err.message.starts_with("line 2, column 1:"),
            "{}",
            err.message
        );
        assert_eq!(err.setting, "f.toml");
    }

    /// A parser's error names no key prefix: one listed twice, or under another table.
    #[test]
    fn a_key_prefix_never_reaches_a_parse_error() {
        let prefix = "acme_7f3k2_";
        for text in [
            format!("[key_prefixes]\n\"{prefix}\" = \"pro\"\n\"{prefix}\" = \"free\""),
            format!("[caller]\n\"{prefix}\" = \"pro\""),
            "[caller]\n\"Acme7F3k2\" = \"pro\"".to_owned(),
            // Shaped like a setting, but near none of the table's.
            "[response]\n\"acme7f3k2\" = \"pro\"".to_owned(),
        ] {
            let err = FileConfig::parse(&text, "f.toml").unwrap_err();
            assert!(!err.to_string().contains(prefix), "{err}");
            assert!(!err.to_string().contains("Acme7F3k2"), "{err}");
            assert!(!err.to_string().contains("acme7f3k2"), "{err}");
            assert!(err.to_string().contains("not shown"), "{err}");
            assert!(err.message.starts_with("line "), "{err}");
        }
        // A misspelled setting is still named: begun, or two edits off.
        let err = FileConfig::parse("[ledger]\ntimeout = 5", "f.toml").unwrap_err();
        assert!(err.message.contains("unknown field `timeout`"), "{err}");
        let err = FileConfig::parse("[ledger]\ntimeuot_ms = 5", "f.toml").unwrap_err();
        assert!(err.message.contains("unknown field `timeuot_ms`"), "{err}");
    }

    #[test]
    fn admin_secrets_of_the_wrong_type_are_refused_unquoted() {
        let secret = "a-secret-given-as-one-string";
        for text in [
            format!("[admin]\nsecrets = \"{secret}\""),
            format!("[admin]\nsecrets = [\"{secret}\", 1234567890123456789]"),
            "[admin]\nsecrets = 1234567890123456789".to_owned(),
        ] {
            let err = FileConfig::parse(&text, "f.toml").unwrap_err();
            assert!(!err.to_string().contains(secret), "{err}");
            assert!(!err.to_string().contains("1234567890"), "{err}");
            assert!(err.to_string().contains("string"), "{err}");
        }
        let file = FileConfig::parse(&format!("[admin]\nsecrets = [\"{secret}\"]"), "f").unwrap();
        assert_eq!(file.admin.secrets, Some(vec![secret.to_owned()]));
        assert_eq!(
            FileConfig::parse("[admin]", "f").unwrap().admin.secrets,
            None
        );
    }

    /// A key named like a built-in prefix (`pro_…`) picks its plan only in the demo's
    /// configuration: once the keys are listed, an invented `pro_` key gets no plan (rejected)
    /// or the default plan, unless the operator wrote the prefix.
    #[test]
    fn the_built_in_prefixes_stand_only_while_no_keys_are_listed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys");
        std::fs::write(&path, "k1 basic\n").unwrap();
        let plan_of = |text: &str, key: &str| {
            let s = with(text).unwrap();
            let plan = s.plans.plan_for_key(key);
            plan.map(|id| s.plans.get(id).unwrap().name().to_owned())
        };
        assert_eq!(plan_of("", "pro_x").as_deref(), Some("pro"), "the demo");
        let keys = format!("[caller]\nkeys_file = {path:?}\n");
        let reject = format!("{keys}unknown_keys = \"reject\"\n");
        assert_eq!(plan_of(&reject, "pro_x"), None);
        assert_eq!(plan_of(&reject, "k1").as_deref(), Some("basic"));
        assert_eq!(plan_of(&keys, "pro_x").as_deref(), Some("free"));
        // Nothing listed and nothing else to know callers by: every key refused, so refused.
        let reject_alone = "[caller]\nunknown_keys = \"reject\"\n";
        assert_eq!(
            with(reject_alone).unwrap_err().setting,
            "caller.unknown_keys"
        );
        let by_address = "[caller]\nsource = \"header-or-peer-ip\"\nunknown_keys = \"reject\"\n";
        assert_eq!(
            plan_of(by_address, "pro_x"),
            None,
            "keyless callers still served"
        );
        let own = format!("{reject}[key_prefixes]\n\"pro_\" = \"pro\"\n");
        assert_eq!(plan_of(&own, "pro_x").as_deref(), Some("pro"), "its own");
    }

    /// A keys file with nothing in it (a deploy that wrote it late, a template) under
    /// `unknown_keys = "reject"` answered every request 401; with a prefix, or keys by address
    /// too, some callers are still served.
    #[test]
    fn a_keys_file_listing_no_key_is_refused_where_it_would_refuse_every_key() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys");
        std::fs::write(&path, "# to be filled in\n\n").unwrap();
        let reject = format!("[caller]\nkeys_file = {path:?}\nunknown_keys = \"reject\"\n");
        let err = with(&reject).unwrap_err();
        assert_eq!(err.setting, "caller.keys_file", "{err}");
        assert!(err.message.starts_with("lists no key"), "{err}");
        let with_prefix = format!("{reject}[key_prefixes]\n\"pro_\" = \"pro\"\n");
        assert!(with(&with_prefix).is_ok());
        let by_address = reject.replace("[caller]\n", "[caller]\nsource = \"header-or-peer-ip\"\n");
        assert!(with(&by_address).is_ok());
        let unknown_served = format!("[caller]\nkeys_file = {path:?}\n");
        assert!(with(&unknown_served).is_ok());
    }

    /// The follower's look: a name that does not resolve keeps its replica's address, and a
    /// replica that came back elsewhere is followed all the same (all or nothing, one missing
    /// name kept every address). Nothing changed beside a missing name: an error to log.
    #[tokio::test]
    async fn a_missing_name_keeps_its_address_and_the_others_are_followed() {
        let hosts = [
            "127.0.0.1:3001".to_owned(),
            "replica-down.invalid:3002".to_owned(),
            "127.0.0.1:3003".to_owned(),
        ];
        let at = |text: &str| text.parse::<std::net::SocketAddr>().unwrap();
        let current = [
            at("127.0.0.1:3001"),
            at("10.0.0.2:3002"),
            at("10.0.0.3:3003"),
        ];
        let followed = resolve_addresses_keeping(&hosts, &current).await.unwrap();
        let moved = [
            at("127.0.0.1:3001"),
            at("10.0.0.2:3002"),
            at("127.0.0.1:3003"),
        ];
        assert_eq!(followed, moved);
        let err = resolve_addresses_keeping(&hosts, &moved).await.unwrap_err();
        assert_eq!(err.setting, "ledger.addresses");
        assert!(err.message.contains("replica-down.invalid"), "{err}");
        // The missing replica's address is another's now: it stands in instead.
        let reused = [
            at("127.0.0.1:3001"),
            at("127.0.0.1:3003"),
            at("10.0.0.3:3003"),
        ];
        let followed = resolve_addresses_keeping(&hosts, &reused).await.unwrap();
        let stand_in = stand_in_address(1);
        assert_eq!(
            followed,
            [at("127.0.0.1:3001"), stand_in, at("127.0.0.1:3003")]
        );
    }

    #[test]
    fn keys_file_is_parsed_and_never_echoes_keys() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys");
        std::fs::write(&path, "# comment\nk1 pro\n\nk2 basic\n").unwrap();
        let s = with(&format!(
            "[caller]\nkeys_file = {:?}\nunknown_keys = \"reject\"",
            path
        ))
        .unwrap();
        let pro = s.plans.plan_for_key("k1").unwrap();
        assert_eq!(s.plans.get(pro).unwrap().name(), "pro");
        assert!(s.plans.plan_for_key("k3").is_none());
        std::fs::write(&path, "secret-key-123 pro extra\n").unwrap();
        let err = with(&format!("[caller]\nkeys_file = {:?}", path)).unwrap_err();
        assert!(!err.to_string().contains("secret-key-123"));
        std::fs::write(&path, "secret-key-123 gold\n").unwrap();
        let err = with(&format!("[caller]\nkeys_file = {:?}", path)).unwrap_err();
        assert!(!err.to_string().contains("secret-key-123"), "{err}");
        assert_eq!(err.setting, "caller.keys_file", "{err}");
        assert!(
            err.message
                .ends_with(":1: the line's second field names no configured plan (`<key> <plan>`)"),
            "{err}"
        );
    }
}
