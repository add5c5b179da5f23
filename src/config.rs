//! Configuration: built-in defaults (the demo), overridden by a TOML file, overridden by CLI flags
//! or their `LEDGER_LIMITER_*` environment variables. Everything is validated at start; an error
//! names the setting at fault.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::num::{NonZeroU32, NonZeroU64, NonZeroUsize};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use actix_web::http::header::HeaderName;
use serde::Deserialize;
use thiserror::Error;

use crate::caller::{KeySource, KEY_LENGTH_MAX_DEFAULT};
use crate::limiter::{FailurePolicy, LimiterSettings};
use crate::middleware::{RateLimitPolicy, RouteCosts};
use crate::plan::{Plan, PlanBook, UnknownKeys};

/// The built-in configuration: the demo the README explains.
pub const DEFAULT_CONFIG_TOML: &str = include_str!("../config/default.toml");

/// Bounds on settings, so a typo cannot ask for something absurd.
pub const LEDGER_TIMEOUT_MS_MAX: u64 = 60_000;
pub const KEY_LENGTH_MAX_LIMIT: usize = 4096;
pub const KEYS_FILE_BYTES_MAX: u64 = 64 * 1024 * 1024;

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
    #[serde(default)]
    pub routes: RoutesFile,
}

#[derive(Debug, Default, Deserialize, Clone)]
#[serde(deny_unknown_fields)]
pub struct LedgerFile {
    pub addresses: Option<Vec<String>>,
    pub cluster_id: Option<u64>,
    pub timeout_ms: Option<u64>,
    pub failure_policy: Option<String>,
    pub in_flight_max: Option<usize>,
    pub local_callers_max: Option<usize>,
    pub expiry_margin_ms: Option<u64>,
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
    pub source: Option<String>,
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
}

#[derive(Debug, Default, Deserialize, Clone)]
#[serde(deny_unknown_fields)]
pub struct RoutesFile {
    pub exempt: Option<Vec<String>>,
    pub costs: Option<BTreeMap<String, u64>>,
}

impl FileConfig {
    pub fn parse(text: &str, origin: &str) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|e| invalid(origin, e.message().to_owned()))
    }

    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| invalid("config", format!("cannot read {}: {e}", path.display())))?;
        Self::parse(&text, &format!("config ({})", path.display()))
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
        take!(ledger.addresses);
        take!(ledger.cluster_id);
        take!(ledger.timeout_ms);
        take!(ledger.failure_policy);
        take!(ledger.in_flight_max);
        take!(ledger.local_callers_max);
        take!(ledger.expiry_margin_ms);
        take!(embedded.data_dir);
        take!(embedded.tigerbeetle_bin);
        take!(embedded.development);
        take!(caller.source);
        take!(caller.header);
        take!(caller.key_length_max);
        take!(caller.unknown_keys);
        take!(caller.keys_file);
        take!(default_plan);
        take!(plans);
        take!(key_prefixes);
        take!(routes.exempt);
        take!(routes.costs);
        self
    }
}

/// Where the ledger is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LedgerLocation {
    /// A running cluster (host names are resolved at start: the TigerBeetle client takes IPs).
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
    pub ledger: LedgerLocation,
    pub cluster_id: u128,
    pub in_flight_max: NonZeroUsize,
    pub limiter: LimiterSettings,
    pub plans: Arc<PlanBook>,
    pub policy: Arc<RateLimitPolicy>,
}

fn require<T>(value: Option<T>, setting: &str) -> Result<T, ConfigError> {
    value.ok_or_else(|| invalid(setting, "is required"))
}

impl Settings {
    /// Validates a merged configuration. `base_dir` resolves relative paths in the keys file.
    pub fn from_file_config(file: FileConfig) -> Result<Self, ConfigError> {
        let listen = require(file.listen, "listen")?;
        let workers = NonZeroUsize::new(require(file.workers, "workers")?)
            .ok_or_else(|| invalid("workers", "must be at least 1"))?;

        let ledger_file = file.ledger;
        let addresses = ledger_file.addresses.unwrap_or_default();
        let ledger = if addresses.is_empty() {
            LedgerLocation::Embedded {
                data_dir: require(file.embedded.data_dir, "embedded.data_dir")?,
                tigerbeetle_bin: require(
                    file.embedded.tigerbeetle_bin,
                    "embedded.tigerbeetle_bin",
                )?,
                development: file.embedded.development.unwrap_or(true),
            }
        } else {
            for address in &addresses {
                if address
                    .rsplit_once(':')
                    .and_then(|(_, p)| p.parse::<u16>().ok())
                    .is_none()
                {
                    return Err(invalid(
                        "ledger.addresses",
                        format!("{address:?} is not host:port"),
                    ));
                }
            }
            LedgerLocation::Cluster { addresses }
        };
        let timeout_ms = require(ledger_file.timeout_ms, "ledger.timeout_ms")?;
        if timeout_ms == 0 || timeout_ms > LEDGER_TIMEOUT_MS_MAX {
            return Err(invalid(
                "ledger.timeout_ms",
                format!("must be between 1 and {LEDGER_TIMEOUT_MS_MAX}"),
            ));
        }
        let failure_policy =
            match require(ledger_file.failure_policy, "ledger.failure_policy")?.as_str() {
                "open" => FailurePolicy::Open,
                "closed" => FailurePolicy::Closed,
                other => {
                    return Err(invalid(
                        "ledger.failure_policy",
                        format!("{other:?} is neither \"open\" nor \"closed\""),
                    ))
                }
            };
        let in_flight_max =
            NonZeroUsize::new(require(ledger_file.in_flight_max, "ledger.in_flight_max")?)
                .ok_or_else(|| invalid("ledger.in_flight_max", "must be at least 1"))?;
        let local_callers_max = require(ledger_file.local_callers_max, "ledger.local_callers_max")?;
        let expiry_margin_ms = require(ledger_file.expiry_margin_ms, "ledger.expiry_margin_ms")?;
        if expiry_margin_ms > 10_000 {
            return Err(invalid("ledger.expiry_margin_ms", "must be at most 10000"));
        }

        let mut plans = Vec::new();
        for (name, plan) in require(file.plans, "plans")? {
            let setting = |field: &str| format!("plans.{name}.{field}");
            let capacity = NonZeroU64::new(plan.capacity)
                .ok_or_else(|| invalid(setting("capacity"), "must be at least 1"))?;
            let window = NonZeroU32::new(plan.window_seconds)
                .ok_or_else(|| invalid(setting("window_seconds"), "must be at least 1"))?;
            plans.push(
                Plan::new(&name, capacity, window)
                    .map_err(|e| invalid(format!("plans.{name}"), e.to_string()))?,
            );
        }

        let caller = file.caller;
        let key_length_max = caller.key_length_max.unwrap_or(KEY_LENGTH_MAX_DEFAULT);
        if key_length_max == 0 || key_length_max > KEY_LENGTH_MAX_LIMIT {
            return Err(invalid(
                "caller.key_length_max",
                format!("must be between 1 and {KEY_LENGTH_MAX_LIMIT}"),
            ));
        }
        let key_source = match require(caller.source, "caller.source")?.as_str() {
            "header" => {
                let header = require(caller.header, "caller.header")?;
                KeySource::Header(HeaderName::try_from(header.as_str()).map_err(|_| {
                    invalid(
                        "caller.header",
                        format!("{header:?} is not a valid header name"),
                    )
                })?)
            }
            "peer-ip" => KeySource::PeerIp,
            other => {
                return Err(invalid(
                    "caller.source",
                    format!("{other:?} is neither \"header\" nor \"peer-ip\""),
                ))
            }
        };
        let unknown_keys = match require(caller.unknown_keys, "caller.unknown_keys")?.as_str() {
            "default-plan" => UnknownKeys::DefaultPlan,
            "reject" => UnknownKeys::Reject,
            other => {
                return Err(invalid(
                    "caller.unknown_keys",
                    format!("{other:?} is neither \"default-plan\" nor \"reject\""),
                ))
            }
        };
        let keys = match &caller.keys_file {
            Some(path) => load_keys_file(path, key_length_max)?,
            None => Vec::new(),
        };
        let default_plan = require(file.default_plan, "default_plan")?;
        let prefixes = file.key_prefixes.unwrap_or_default();
        let book = PlanBook::new(plans, &default_plan, prefixes, keys, unknown_keys)
            .map_err(|e| invalid("plans", e.to_string()))?;

        let mut costs = Vec::new();
        for (route, cost) in file.routes.costs.unwrap_or_default() {
            let setting = format!("routes.costs.\"{route}\"");
            if !route.starts_with('/') {
                return Err(invalid(setting, "routes must start with /"));
            }
            let cost =
                NonZeroU64::new(cost).ok_or_else(|| invalid(&setting, "must be at least 1"))?;
            if cost > book.capacity_min() {
                return Err(invalid(
                    setting,
                    format!(
                        "cost {cost} exceeds the smallest plan capacity ({}): such a request could never be admitted",
                        book.capacity_min()
                    ),
                ));
            }
            costs.push((route, cost));
        }
        let exempt_paths = file.routes.exempt.unwrap_or_default();
        if let Some(bad) = exempt_paths.iter().find(|p| !p.starts_with('/')) {
            return Err(invalid(
                "routes.exempt",
                format!("{bad:?} must start with /"),
            ));
        }

        Ok(Settings {
            listen,
            workers,
            ledger,
            cluster_id: ledger_file.cluster_id.unwrap_or(0).into(),
            in_flight_max,
            limiter: LimiterSettings {
                ledger_timeout: Duration::from_millis(timeout_ms),
                failure_policy,
                local_callers_max,
                expiry_margin: Duration::from_millis(expiry_margin_ms),
            },
            plans: Arc::new(book),
            policy: Arc::new(RateLimitPolicy {
                key_source,
                key_length_max,
                exempt_paths,
                route_costs: RouteCosts::new(costs),
            }),
        })
    }

    /// The built-in defaults with `overrides` applied.
    pub fn with_overrides(overrides: FileConfig) -> Result<Self, ConfigError> {
        let defaults = FileConfig::parse(DEFAULT_CONFIG_TOML, "built-in defaults")
            .expect("the built-in configuration parses");
        Self::from_file_config(defaults.merge(overrides))
    }
}

/// A keys file: one `key plan` pair per line; blank lines and `#` comments are skipped.
fn load_keys_file(
    path: &Path,
    key_length_max: usize,
) -> Result<Vec<(String, String)>, ConfigError> {
    let setting = "caller.keys_file";
    let metadata = std::fs::metadata(path)
        .map_err(|e| invalid(setting, format!("cannot read {}: {e}", path.display())))?;
    if metadata.len() > KEYS_FILE_BYTES_MAX {
        return Err(invalid(
            setting,
            format!("larger than {KEYS_FILE_BYTES_MAX} bytes"),
        ));
    }
    let text = std::fs::read_to_string(path)
        .map_err(|e| invalid(setting, format!("cannot read {}: {e}", path.display())))?;
    let mut keys = Vec::new();
    for (index, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let mut fields = line.split_whitespace();
        let (Some(key), Some(plan), None) = (fields.next(), fields.next(), fields.next()) else {
            return Err(invalid(
                setting,
                format!("{}:{}: expected `<key> <plan>`", path.display(), index + 1),
            ));
        };
        if key.len() > key_length_max || !key.bytes().all(|b| (0x21..=0x7e).contains(&b)) {
            // Never echo the key: it is a secret.
            return Err(invalid(
                setting,
                format!(
                    "{}:{}: the key is not 1-{key_length_max} printable ASCII characters",
                    path.display(),
                    index + 1
                ),
            ));
        }
        keys.push((key.to_owned(), plan.to_owned()));
    }
    Ok(keys)
}

/// Resolves `host:port` strings to socket addresses (the TigerBeetle client takes IPs only).
pub async fn resolve_addresses(addresses: &[String]) -> Result<Vec<SocketAddr>, ConfigError> {
    let mut resolved = Vec::new();
    for address in addresses {
        let found = tokio::net::lookup_host(address.as_str())
            .await
            .map_err(|e| {
                invalid(
                    "ledger.addresses",
                    format!("cannot resolve {address:?}: {e}"),
                )
            })?
            .find(|a| a.is_ipv4())
            .ok_or_else(|| {
                invalid(
                    "ledger.addresses",
                    format!("{address:?} has no IPv4 address"),
                )
            })?;
        resolved.push(found);
    }
    Ok(resolved)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(text: &str) -> Result<Settings, ConfigError> {
        Settings::with_overrides(FileConfig::parse(text, "test").unwrap())
    }

    #[test]
    fn defaults_are_valid() {
        let s = with("").unwrap();
        assert_eq!(s.plans.plans().len(), 3);
        assert!(matches!(s.ledger, LedgerLocation::Embedded { .. }));
        assert_eq!(s.limiter.failure_policy, FailurePolicy::Closed);
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
        let err = with("[ledger]\naddresses = [\"nope\"]").unwrap_err();
        assert_eq!(err.setting, "ledger.addresses");
        let err = with("default_plan = \"gold\"").unwrap_err();
        assert_eq!(err.setting, "plans");
        let err = with("[caller]\nheader = \"bad header\"").unwrap_err();
        assert_eq!(err.setting, "caller.header");
        let err = FileConfig::parse("[ledger]\ntimeout = 5", "f.toml").unwrap_err();
        assert!(err.message.contains("unknown field"), "{}", err.message);
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
        assert_eq!(s.plans.get(pro).name(), "pro");
        assert!(s.plans.plan_for_key("k3").is_none());
        std::fs::write(&path, "secret-key-123 pro extra\n").unwrap();
        let err = with(&format!("[caller]\nkeys_file = {:?}", path)).unwrap_err();
        assert!(!err.to_string().contains("secret-key-123"));
        std::fs::write(&path, "secret-key-123 gold\n").unwrap();
        let err = with(&format!("[caller]\nkeys_file = {:?}", path)).unwrap_err();
        assert!(!err.to_string().contains("secret-key-123"), "{err}");
    }
}
