//! envoyproxy/ratelimit's YAML configuration, read as it is: domains, nested descriptors with
//! `key` / `value`, wildcard values, `rate_limit {unit, requests_per_unit, unlimited, name,
//! replaces}`, `shadow_mode`, `detailed_metric`; the same most-specific-match rule, and the same
//! strict rejection of unknown keys (with the file and line). Keys envoyproxy/ratelimit has that are
//! not implemented here (`quota_mode`, `value_to_metric`, `share_threshold`, `metadata`) are
//! rejected by name, never silently ignored.
//!
//! Extensions: `rate_limit.window_seconds` (any window, not only a unit; every window slides), and
//! `concurrency: true` on a descriptor (its holds are given back by `is_negative_hits`, possibly
//! through another instance, so no instance refuses it from memory).

use std::collections::HashMap;
use std::num::{NonZeroU32, NonZeroU64};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Deserialize;
use thiserror::Error;

use crate::limiter::metrics::{CONCURRENCY_PLAN_PREFIX, PLAN_NONE};

/// A configuration file larger than this is refused (they are hand-written rule sets).
pub const CONFIG_FILE_BYTES_MAX: u64 = 1 << 20;
/// At most this many files in a configuration directory.
pub const CONFIG_FILES_MAX: usize = 256;
/// At most this many rules (descriptors with a `rate_limit`) in all: each is a metric label.
pub const RULES_MAX: usize = 4096;
/// Descriptors nest at most this deep (a request's descriptor has at most as many entries).
pub const DEPTH_MAX: usize = 16;
/// Keys and values in rule files are at most this long. A request's descriptor with a longer
/// key matches no rule (`OK`, as envoyproxy/ratelimit answers it); its values are never judged
/// (an API key may be longer, and is its own caller).
pub const KEY_VALUE_LENGTH_MAX: usize = 256;

/// The time units of `rate_limit.unit`, as Envoy's `RateLimitResponse.RateLimit.Unit` numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    Second,
    Minute,
    Hour,
    Day,
    Week,
    /// 30 days: windows slide, there are no calendar months.
    Month,
    /// 365 days.
    Year,
}

impl Unit {
    fn parse(text: &str) -> Option<Unit> {
        Some(match text.to_ascii_uppercase().as_str() {
            "SECOND" => Unit::Second,
            "MINUTE" => Unit::Minute,
            "HOUR" => Unit::Hour,
            "DAY" => Unit::Day,
            "WEEK" => Unit::Week,
            "MONTH" => Unit::Month,
            "YEAR" => Unit::Year,
            _ => return None,
        })
    }

    pub fn seconds(self) -> u32 {
        match self {
            Unit::Second => 1,
            Unit::Minute => 60,
            Unit::Hour => 3_600,
            Unit::Day => 86_400,
            Unit::Week => 7 * 86_400,
            Unit::Month => 30 * 86_400,
            Unit::Year => 365 * 86_400,
        }
    }

    /// The protobuf enum number (`envoy.service.ratelimit.v3...RateLimit.Unit`).
    pub fn proto(self) -> i32 {
        match self {
            Unit::Second => 1,
            Unit::Minute => 2,
            Unit::Hour => 3,
            Unit::Day => 4,
            Unit::Month => 5,
            Unit::Year => 6,
            Unit::Week => 7,
        }
    }

    /// The unit of a protobuf enum number (a request's limit override); `None` for UNKNOWN.
    pub fn from_proto(number: i32) -> Option<Unit> {
        [
            Unit::Second,
            Unit::Minute,
            Unit::Hour,
            Unit::Day,
            Unit::Week,
            Unit::Month,
            Unit::Year,
        ]
        .into_iter()
        .find(|u| u.proto() == number)
    }

    /// The unit whose length is exactly `seconds`, if one is.
    fn of_seconds(seconds: u32) -> Option<Unit> {
        [
            Unit::Second,
            Unit::Minute,
            Unit::Hour,
            Unit::Day,
            Unit::Week,
            Unit::Month,
            Unit::Year,
        ]
        .into_iter()
        .find(|u| u.seconds() == seconds)
    }
}

/// What a matched rule does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RuleLimit {
    /// `unlimited: true`: always OK, never counted.
    Unlimited,
    Counted {
        requests_per_unit: NonZeroU64,
        window_seconds: NonZeroU32,
        /// The unit Envoy is told (`None`: a `window_seconds` that is no whole unit).
        unit: Option<Unit>,
    },
}

/// One descriptor with a `rate_limit`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    /// `domain.key_value.key...`: as envoyproxy/ratelimit names its stats key.
    pub path: Arc<str>,
    /// The `plan` metric label when the rule has no `name`: its path with each configured value
    /// as 8 hex digits of its SHA-256 (`domain.api_key_1a2b3c4d`), as a value in a rules file
    /// may be a partner's API key, and values never reach metrics.
    pub label: Arc<str>,
    pub name: Option<String>,
    pub limit: RuleLimit,
    pub replaces: Vec<String>,
    pub shadow_mode: bool,
    pub detailed_metric: bool,
    pub concurrency: bool,
}

/// One level of a domain's descriptor tree.
#[derive(Debug, Default)]
struct Node {
    /// By `key` or `key_value`, as envoyproxy/ratelimit names them (and as the rules' paths, so
    /// the accounts, are named), each child saying which it was configured with.
    children: HashMap<String, Node>,
    /// The children whose value has a `*`: the name they are stored by, their key and their
    /// value split on the `*`s, in file order.
    wildcards: Vec<(String, String, Vec<String>)>,
    /// What a request's entry must carry to reach this node.
    entry: Entry,
    rule: Option<Arc<Rule>>,
}

/// How a node was configured: a key alone (any value), or a key and a value.
///
/// Why both: envoyproxy/ratelimit joins a key and a value with `_` and looks the join up among
/// names configured either way, so an entry (`api_key`, `daily`) reached a rule configured as the
/// key `api_key_daily` alone: a caller choosing its own value picked another rule (in the demo's
/// configuration, a day's limit instead of a minute's). Here a name reached by `key_value`
/// matches only a node configured with that very key and value.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum Entry {
    #[default]
    Key,
    KeyValue {
        key_length: usize,
    },
}

impl Entry {
    /// A configured descriptor's kind, and the name it is stored by (`key` or `key_value`).
    fn named(key: &str, value: &str) -> (Entry, String) {
        match value.is_empty() {
            true => (Entry::Key, key.to_owned()),
            false => {
                let key_length = key.len();
                (Entry::KeyValue { key_length }, format!("{key}_{value}"))
            }
        }
    }
}

/// Every domain's rules.
#[derive(Default)]
pub struct RlsConfig {
    domains: HashMap<String, Node>,
    rules: usize,
}

/// The domains and how many rules, never the rules themselves: a rule's path holds its
/// configured values, and a value may be a partner's API key (`--check-config` prints the
/// settings, and said it printed no secret).
impl std::fmt::Debug for RlsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut domains: Vec<&str> = self.domains.keys().map(String::as_str).collect();
        domains.sort_unstable();
        (f.debug_struct("RlsConfig"))
            .field("domains", &domains)
            .field("rules", &self.rules)
            .finish()
    }
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum RlsConfigError {
    #[error("{file}: cannot read: {message}")]
    Read { file: String, message: String },
    #[error("{file}: larger than {CONFIG_FILE_BYTES_MAX} bytes")]
    TooLarge { file: String },
    #[error("{0}: more than {CONFIG_FILES_MAX} configuration files")]
    TooManyFiles(String),
    #[error("{file}{}: {message}", line.map(|l| format!(":{l}")).unwrap_or_default())]
    Invalid {
        file: String,
        line: Option<usize>,
        message: String,
    },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct YamlRoot {
    #[serde(default)]
    domain: String,
    #[serde(default)]
    descriptors: Vec<YamlDescriptor>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct YamlDescriptor {
    #[serde(default)]
    key: String,
    #[serde(default)]
    value: String,
    rate_limit: Option<YamlRateLimit>,
    #[serde(default)]
    descriptors: Vec<YamlDescriptor>,
    #[serde(default)]
    shadow_mode: bool,
    #[serde(default)]
    detailed_metric: bool,
    #[serde(default)]
    concurrency: bool,
    // envoyproxy/ratelimit keys not implemented: named so that the error says so.
    quota_mode: Option<serde_norway::Value>,
    value_to_metric: Option<serde_norway::Value>,
    share_threshold: Option<serde_norway::Value>,
    metadata: Option<serde_norway::Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct YamlRateLimit {
    #[serde(default)]
    requests_per_unit: u32,
    #[serde(default)]
    unit: String,
    #[serde(default)]
    unlimited: bool,
    #[serde(default)]
    name: String,
    #[serde(default)]
    replaces: Vec<YamlReplaces>,
    window_seconds: Option<u32>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct YamlReplaces {
    #[serde(default)]
    name: String,
}

/// The name and text of each rules file at `path` ([`RlsConfig::load`]), in name order.
pub fn read_texts(path: &Path) -> Result<Vec<(String, String)>, RlsConfigError> {
    let files = config_files(path)?;
    let mut texts = Vec::with_capacity(files.len());
    for file in files {
        let name = file.display().to_string();
        let text = read_rules(&file, &name)?;
        texts.push((name, text));
    }
    Ok(texts)
}

/// A rules file's text, read through [`CONFIG_FILE_BYTES_MAX`], not after a size check: a pipe
/// (`<(...)`), `/dev/zero` or a file still being written has a size that does not say what a
/// read would take.
fn read_rules(file: &Path, name: &str) -> Result<String, RlsConfigError> {
    use std::io::Read;
    let read_error = |message: String| RlsConfigError::Read {
        file: name.to_owned(),
        message,
    };
    let opened = std::fs::File::open(file).map_err(|e| read_error(e.to_string()))?;
    let mut bytes = Vec::new();
    opened
        .take(CONFIG_FILE_BYTES_MAX + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| read_error(e.to_string()))?;
    if bytes.len() as u64 > CONFIG_FILE_BYTES_MAX {
        return Err(RlsConfigError::TooLarge {
            file: name.to_owned(),
        });
    }
    String::from_utf8(bytes).map_err(|_| read_error("not UTF-8 text".to_owned()))
}

impl RlsConfig {
    /// One YAML file, or every `*.yaml` / `*.yml` file of a directory (in name order), as
    /// envoyproxy/ratelimit reads its runtime directory.
    pub fn load(path: &Path) -> Result<RlsConfig, RlsConfigError> {
        RlsConfig::from_texts(&read_texts(path)?)
    }

    /// The rules of `texts`, each a file's name and text, in order.
    pub fn from_texts(texts: &[(String, String)]) -> Result<RlsConfig, RlsConfigError> {
        let mut config = RlsConfig::default();
        for (name, text) in texts {
            config.add(name, text)?;
        }
        Ok(config)
    }

    /// Adds one file's domain (`file` names it in errors).
    pub fn add(&mut self, file: &str, text: &str) -> Result<(), RlsConfigError> {
        let root: YamlRoot = serde_norway::from_str(text).map_err(|e| RlsConfigError::Invalid {
            file: file.to_owned(),
            line: e.location().map(|l| l.line()),
            message: e.to_string(),
        })?;
        let invalid = |message: String| RlsConfigError::Invalid {
            file: file.to_owned(),
            line: None,
            message,
        };
        if root.domain.is_empty() {
            return Err(invalid("config file cannot have empty domain".into()));
        }
        check_length(&root.domain, "the domain").map_err(invalid)?;
        // The domain begins its descriptors' labels, which name their `plan` on the metrics.
        if root.domain.starts_with(CONCURRENCY_PLAN_PREFIX) {
            return Err(invalid(format!("domain '{}': {RESERVED}", root.domain)));
        }
        // As a request's domain is read (`wire::text`), like keys and values: a U+FFFD in it is
        // two there, and a domain kept as written never matched.
        let domain = super::wire::text(root.domain.into_bytes());
        if self.domains.contains_key(&domain) {
            return Err(invalid(format!(
                "duplicate domain '{domain}' in config file"
            )));
        }
        let mut node = Node::default();
        let mut rules = self.rules;
        let prefix = format!("{domain}.");
        let parents = (prefix.as_str(), prefix.as_str());
        load_level(&mut node, parents, &root.descriptors, 1, &mut rules).map_err(invalid)?;
        self.rules = rules;
        self.domains.insert(domain, node);
        Ok(())
    }

    pub fn has_domain(&self, domain: &str) -> bool {
        self.domains.contains_key(domain)
    }

    pub fn domains(&self) -> usize {
        self.domains.len()
    }

    pub fn rules(&self) -> usize {
        self.rules
    }

    /// The rule for one request descriptor's entries, by envoyproxy/ratelimit's rule: at each
    /// level `key_value` exactly, else the first wildcard that matches it, else `key` alone; the
    /// rule applies only if it is on the level of the descriptor's last entry.
    pub fn rule_for<'a>(
        &self,
        domain: &str,
        entries: impl ExactSizeIterator<Item = (&'a str, &'a str)>,
    ) -> Option<Arc<Rule>> {
        let mut node = self.domains.get(domain)?;
        let last = entries.len().checked_sub(1)?;
        let mut found = None;
        for (index, (key, value)) in entries.enumerate() {
            let key_value = format!("{key}_{value}");
            let with_value = Entry::KeyValue {
                key_length: key.len(),
            };
            let next = node
                .children
                .get(&key_value)
                .filter(|child| child.entry == with_value)
                .or_else(|| {
                    let (name, _, _) = node.wildcards.iter().find(|(_, wild_key, parts)| {
                        wild_key == key && wildcard_match(parts, value)
                    })?;
                    node.children.get(name)
                })
                .or_else(|| node.children.get(key).filter(|c| c.entry == Entry::Key))?;
            if index == last {
                found = next.rule.clone();
            }
            if next.children.is_empty() {
                break;
            }
            node = next;
        }
        found
    }
}

/// How deep a rules folder's subfolders are read (deeper ones are not).
const CONFIG_FOLDER_DEPTH_MAX: usize = 8;

/// The rules' files: `path` itself, or the `*.yaml` and `*.yml` files of the folder and its
/// subfolders (as envoyproxy/ratelimit's runtime loads a folder's tree: rules in a subfolder
/// were skipped, and their descriptors answered `OK` with no limit), hidden ones left out.
fn config_files(path: &Path) -> Result<Vec<PathBuf>, RlsConfigError> {
    let name = path.display().to_string();
    let read_error = |e: std::io::Error| RlsConfigError::Read {
        file: name.clone(),
        message: e.to_string(),
    };
    if !std::fs::metadata(path).map_err(read_error)?.is_dir() {
        return Ok(vec![path.to_owned()]);
    }
    let mut files = Vec::new();
    let mut folders = vec![(path.to_owned(), 0)];
    while let Some((folder, depth)) = folders.pop() {
        let folder_error = |e: std::io::Error| RlsConfigError::Read {
            file: folder.display().to_string(),
            message: e.to_string(),
        };
        for entry in std::fs::read_dir(&folder).map_err(folder_error)? {
            let entry = entry.map_err(folder_error)?;
            let file = entry.path();
            // Hidden: an editor's, or Kubernetes' `..data` and `..<time>` copies of a mounted
            // ConfigMap (read, each domain would be defined twice).
            if entry.file_name().as_encoded_bytes().starts_with(b".") {
                continue;
            }
            // Not a link to one: a link may loop.
            if entry.file_type().map_err(folder_error)?.is_dir() {
                if depth < CONFIG_FOLDER_DEPTH_MAX {
                    folders.push((file, depth + 1));
                }
                continue;
            }
            let yaml = matches!(
                file.extension().and_then(|e| e.to_str()),
                Some("yaml" | "yml")
            );
            if yaml {
                files.push(file);
            }
            if files.len() > CONFIG_FILES_MAX {
                return Err(RlsConfigError::TooManyFiles(name));
            }
        }
    }
    if files.is_empty() {
        // A folder without rules (the runtime's root rather than its config folder, say) would
        // answer OK to every request: refused at the start instead.
        return Err(RlsConfigError::Read {
            file: name,
            message: "no *.yaml or *.yml file in this folder".to_owned(),
        });
    }
    files.sort();
    Ok(files)
}

/// `what` names the text in the error, never the text itself: a descriptor's value may be a
/// partner's API key, and start-up errors go to the log.
fn check_length(text: &str, what: &str) -> Result<(), String> {
    if text.len() > KEY_VALUE_LENGTH_MAX {
        return Err(format!(
            "{what} is {} bytes, longer than {KEY_VALUE_LENGTH_MAX}",
            text.len()
        ));
    }
    Ok(())
}

/// `parents`: the path and the metric label of the level above, each ending in `.`.
fn load_level(
    node: &mut Node,
    (parent, parent_label): (&str, &str),
    descriptors: &[YamlDescriptor],
    depth: usize,
    rules: &mut usize,
) -> Result<(), String> {
    if depth > DEPTH_MAX && !descriptors.is_empty() {
        return Err(format!(
            "descriptors nest deeper than {DEPTH_MAX} under '{parent_label}'"
        ));
    }
    for descriptor in descriptors {
        if descriptor.key.is_empty() {
            return Err("descriptor has empty key".into());
        }
        let under = format!("under '{parent_label}'");
        check_length(&descriptor.key, &format!("a descriptor's key {under}"))?;
        check_length(
            &descriptor.value,
            &format!("the value of key '{}' {under}", descriptor.key),
        )?;
        // As a request's key and value are read (`wire::text`): a U+FFFD in one is two there.
        let key = super::wire::text(descriptor.key.clone().into_bytes());
        let value = super::wire::text(descriptor.value.clone().into_bytes());
        let (entry, final_key) = Entry::named(&key, &value);
        let path = format!("{parent}{final_key}");
        let label = match descriptor.value.is_empty() {
            true => format!("{parent_label}{key}", key = descriptor.key),
            false => format!(
                "{parent_label}{}_{}",
                descriptor.key,
                value_digest(&descriptor.value)
            ),
        };
        // Errors name a descriptor by its label, its values hashed: a value may be a partner's
        // API key, and start-up errors go to the log.
        reject_unimplemented(descriptor, &label)?;
        if node.children.contains_key(&final_key) {
            return Err(format!("duplicate descriptor composite key '{label}'"));
        }
        let mut child = Node {
            entry,
            ..Node::default()
        };
        if let Some(rate_limit) = &descriptor.rate_limit {
            *rules += 1;
            if *rules > RULES_MAX {
                return Err(format!("more than {RULES_MAX} rules"));
            }
            child.rule = Some(Arc::new(rule(descriptor, rate_limit, (&path, &label))?));
        }
        load_level(
            &mut child,
            (&format!("{path}."), &format!("{label}.")),
            &descriptor.descriptors,
            depth + 1,
            rules,
        )?;
        if value.contains('*') {
            let parts = value.split('*').map(str::to_owned).collect();
            node.wildcards.push((final_key.clone(), key.clone(), parts));
        }
        node.children.insert(final_key, child);
    }
    Ok(())
}

fn reject_unimplemented(descriptor: &YamlDescriptor, label: &str) -> Result<(), String> {
    let unimplemented = [
        ("quota_mode", descriptor.quota_mode.is_some()),
        ("value_to_metric", descriptor.value_to_metric.is_some()),
        ("share_threshold", descriptor.share_threshold.is_some()),
        ("metadata", descriptor.metadata.is_some()),
    ];
    match unimplemented.iter().find(|(_, present)| *present) {
        Some((key, _)) => Err(format!(
            "'{key}' (descriptor '{label}') is an envoyproxy/ratelimit key ledger-limiter does not implement yet"
        )),
        None => Ok(()),
    }
}

/// A configured value as a metric may show it: 8 hex digits of its SHA-256.
fn value_digest(value: &str) -> String {
    use sha2::{Digest, Sha256};
    hex::encode(&Sha256::digest(value.as_bytes())[..4])
}

/// Why a rule's name (its `plan` on the decision metrics) or a domain (which begins the label
/// of its rules without one) may not be `none` or start `concurrency-`: there they mean keys
/// refused before any plan and the HTTP front end's concurrency slots, which the dashboard's
/// request panels leave out (the HTTP configuration refuses them as plan names too).
const RESERVED: &str = "reserved: the metrics' plan \"none\" and plans starting \"concurrency-\" \
                        are labels of their own; choose another name";

fn rule(
    descriptor: &YamlDescriptor,
    yaml: &YamlRateLimit,
    (path, label): (&str, &str),
) -> Result<Rule, String> {
    let unit = (!yaml.unit.is_empty())
        .then(|| {
            Unit::parse(&yaml.unit)
                .ok_or_else(|| format!("invalid rate limit unit '{}'", yaml.unit))
        })
        .transpose()?;
    let limit = if yaml.unlimited {
        if unit.is_some() || yaml.window_seconds.is_some() {
            return Err("should not specify rate limit unit when unlimited".into());
        }
        RuleLimit::Unlimited
    } else {
        let window_seconds = match (unit, yaml.window_seconds) {
            // Two windows for one rule: which one was meant is not ours to guess.
            (Some(_), Some(_)) => {
                return Err(format!(
                    "'{label}': give either unit or window_seconds, not both"
                ))
            }
            (None, Some(seconds)) => NonZeroU32::new(seconds)
                .ok_or_else(|| format!("'{label}': window_seconds must be at least 1"))?,
            (Some(unit), None) => NonZeroU32::new(unit.seconds()).expect("units are not empty"),
            (None, None) => return Err(format!("invalid rate limit unit '{}'", yaml.unit)),
        };
        let requests_per_unit = NonZeroU64::new(yaml.requests_per_unit.into()).ok_or_else(|| {
            format!("'{label}': requests_per_unit must be at least 1 (0, refusing everything, is not implemented)")
        })?;
        RuleLimit::Counted {
            requests_per_unit,
            window_seconds,
            unit: Unit::of_seconds(window_seconds.get()),
        }
    };
    for replaces in &yaml.replaces {
        if replaces.name.is_empty() {
            return Err("should not have an empty replaces entry".into());
        }
        if replaces.name == yaml.name {
            return Err("replaces should not contain name of same descriptor".into());
        }
    }
    if yaml.name == PLAN_NONE || yaml.name.starts_with(CONCURRENCY_PLAN_PREFIX) {
        return Err(format!("'{label}': name '{}': {RESERVED}", yaml.name));
    }
    Ok(Rule {
        path: path.into(),
        label: label.into(),
        name: (!yaml.name.is_empty()).then(|| yaml.name.clone()),
        limit,
        replaces: yaml.replaces.iter().map(|r| r.name.clone()).collect(),
        shadow_mode: descriptor.shadow_mode,
        detailed_metric: descriptor.detailed_metric,
        concurrency: descriptor.concurrency,
    })
}

/// Whether `value` matches a pattern split on `*` (each `*` matches any run, empty included).
fn wildcard_match(parts: &[String], value: &str) -> bool {
    let (Some(first), Some(last)) = (parts.first(), parts.last()) else {
        return false;
    };
    if parts.len() == 1 {
        return first == value;
    }
    let fixed: usize = parts.iter().map(String::len).sum();
    if value.len() < fixed || !value.starts_with(first.as_str()) || !value.ends_with(last.as_str())
    {
        return false;
    }
    let mut rest = &value[first.len()..value.len() - last.len()];
    for part in &parts[1..parts.len() - 1] {
        match rest.find(part.as_str()) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    true
}

/// A table-driven port of envoyproxy/ratelimit's `test/config/config_test.go`, on its own files.
#[cfg(test)]
mod tests {
    use super::*;

    macro_rules! file {
        ($name:literal) => {
            (
                $name,
                include_str!(concat!("../../tests/envoy_config/", $name, ".yaml")),
            )
        };
    }

    /// A source whose size says nothing (`/dev/zero`: 0 bytes, endless) is read through the
    /// bound, and a file past it refused, not read whole.
    #[test]
    fn a_rules_file_is_read_up_to_its_bound() {
        let endless = RlsConfig::load(Path::new("/dev/zero"));
        assert!(matches!(endless, Err(RlsConfigError::TooLarge { .. })));
        let dir = tempfile::tempdir().unwrap();
        let large = dir.path().join("large.yaml");
        let comment = format!("# {}\n", "x".repeat(1022));
        std::fs::write(&large, comment.repeat(1025)).unwrap();
        let refused = RlsConfig::load(&large);
        assert!(matches!(refused, Err(RlsConfigError::TooLarge { .. })));
    }

    fn load(files: &[(&str, &str)]) -> Result<RlsConfig, RlsConfigError> {
        let mut config = RlsConfig::default();
        for (name, text) in files {
            config.add(name, text)?;
        }
        Ok(config)
    }

    /// (requests per unit, unit) of the rule a descriptor matches, if any.
    fn limit_of(config: &RlsConfig, domain: &str, entries: &[(&str, &str)]) -> Option<(u64, Unit)> {
        let rule = config.rule_for(domain, entries.iter().copied())?;
        match rule.limit {
            RuleLimit::Counted {
                requests_per_unit,
                unit,
                ..
            } => Some((requests_per_unit.get(), unit.expect("a unit"))),
            RuleLimit::Unlimited => Some((u64::MAX, Unit::Second)),
        }
    }

    #[test]
    fn basic_config_matches_the_most_specific_rule() {
        let config = load(&[file!("basic_config")]).unwrap();
        let d = "test-domain";
        type Case<'a> = (&'a [(&'a str, &'a str)], Option<(u64, Unit)>);
        let cases: &[Case] = &[
            (&[("foo", "bar")], None),
            (&[("key1", "value1")], None),
            (
                &[("key1", "value1"), ("subkey1", "something")],
                Some((5, Unit::Second)),
            ),
            (
                &[("key1", "value1"), ("subkey1", "subvalue1")],
                Some((10, Unit::Second)),
            ),
            (&[("key2", "something")], Some((20, Unit::Minute))),
            (&[("key2", "value2")], Some((30, Unit::Minute))),
            (&[("key2", "value3")], None),
            (&[("key3", "foo")], Some((1, Unit::Hour))),
            (&[("key4", "foo")], Some((1, Unit::Day))),
            (&[("key5", "value5")], Some((15, Unit::Day))),
            (
                &[("key5", "value5"), ("subkey5", "subvalue5")],
                Some((25, Unit::Day)),
            ),
            (&[("key6", "foo")], Some((u64::MAX, Unit::Second))),
            // More entries than the config has levels: the rule is not on the last level.
            (&[("key2", "value2"), ("subkey", "subvalue")], None),
        ];
        for (entries, expected) in cases {
            assert_eq!(limit_of(&config, d, entries), *expected, "{entries:?}");
        }
        assert_eq!(limit_of(&config, "other-domain", &[("key2", "x")]), None);
        let key4 = config.rule_for(d, [("key4", "x")].into_iter()).unwrap();
        assert_eq!(key4.name.as_deref(), Some("key4_rate_limit"));
        assert_eq!(&*key4.path, "test-domain.key4");
        let key7 = config.rule_for(d, [("key7", "x")].into_iter()).unwrap();
        assert!(key7.detailed_metric);
    }

    #[test]
    fn wildcards_match_as_envoyproxy_ratelimit_matches_them() {
        let config = load(&[file!("wildcard")]).unwrap();
        let d = "test-domain";
        let rule = |entries: &[(&str, &str)]| config.rule_for(d, entries.iter().copied());
        let path = |entries: &[(&str, &str)]| rule(entries).map(|r| r.path.to_string());
        assert_eq!(
            path(&[("wild", "foo1")]),
            Some("test-domain.wild_foo*".into())
        );
        assert_eq!(rule(&[("wild", "foo1")]), rule(&[("wild", "foo2")]));
        assert!(rule(&[("nestedWild", "val1"), ("wild", "goo2")]).is_some());
        assert_eq!(rule(&[("wild", "bar")]), None);
        assert_eq!(rule(&[("noWild", "foo1")]), None, "no eager match");
        assert!(rule(&[("noVal", "foo1")]).is_some());
        assert_eq!(
            path(&[("midWild", "bar123b")]),
            Some("test-domain.midWild_bar*b".into())
        );
        assert!(
            rule(&[("midWild", "barb")]).is_some(),
            "* matches the empty string"
        );
        assert_eq!(rule(&[("midWild", "bara")]), None);
        assert_eq!(rule(&[("midWild", "xbarb")]), None);
        assert!(rule(&[("multiWild", "foo1bar2baz")]).is_some());
        assert!(rule(&[("multiWild", "foobarbaz")]).is_some());
        assert_eq!(rule(&[("multiWild", "foobaz")]), None);
    }

    #[test]
    fn an_entry_reaches_only_a_rule_configured_with_its_own_key_and_value() {
        let demo = ("demo.yaml", include_str!("../../envoy/ratelimit/demo.yaml"));
        let config = load(&[demo]).unwrap();
        let path = |entries: &[(&str, &str)]| {
            let rule = config.rule_for("demo", entries.iter().copied());
            rule.map(|r| r.path.to_string())
        };
        // A caller whose X-Api-Key is `daily` stays on the minute's limit.
        assert_eq!(path(&[("api_key", "daily")]), Some("demo.api_key".into()));
        assert_eq!(
            path(&[("api_key_daily", "x")]),
            Some("demo.api_key_daily".into())
        );
        let yaml = "domain: d\ndescriptors:\n  - key: a\n    value: b_c\n    rate_limit: {unit: minute, requests_per_unit: 1}\n  - key: w\n    value: x*\n    rate_limit: {unit: minute, requests_per_unit: 1}\n";
        let config = load(&[("kv.yaml", yaml)]).unwrap();
        let rule = |entries: &[(&str, &str)]| config.rule_for("d", entries.iter().copied());
        assert!(rule(&[("a", "b_c")]).is_some());
        assert_eq!(
            rule(&[("a_b", "c")]),
            None,
            "another key and value, the same join"
        );
        assert!(rule(&[("w", "x1")]).is_some());
        assert_eq!(
            rule(&[("w_x", "1")]),
            None,
            "a wildcard matches its own key only"
        );
    }

    #[test]
    fn shadow_mode_is_read_per_rule() {
        let config = load(&[file!("shadowmode_config")]).unwrap();
        let shadow = |entries: &[(&str, &str)]| {
            let rule = config
                .rule_for("test-domain", entries.iter().copied())
                .unwrap();
            rule.shadow_mode
        };
        assert!(!shadow(&[("key1", "value1"), ("subkey1", "x")]));
        assert!(shadow(&[("key1", "value1"), ("subkey1", "subvalue1")]));
        assert!(shadow(&[("key2", "x")]));
    }

    #[test]
    fn bad_files_are_rejected_with_the_file_and_what_is_wrong() {
        let cases: &[((&str, &str), &str)] = &[
            (
                file!("empty_domain"),
                "empty_domain: config file cannot have empty domain",
            ),
            (file!("empty_key"), "empty_key: descriptor has empty key"),
            // envoyproxy/ratelimit names `key1_value1`; here the value is hashed, as in metrics:
            // a value may be a partner's API key, and start-up errors go to the log.
            (
                file!("duplicate_key"),
                "duplicate descriptor composite key 'test-domain.key1_3c968301'",
            ),
            (file!("bad_limit_unit"), "invalid rate limit unit 'foo'"),
            (
                file!("unlimited_with_unit"),
                "should not specify rate limit unit when unlimited",
            ),
            (
                file!("replaces_self"),
                "replaces should not contain name of same descriptor",
            ),
            (
                file!("replaces_empty"),
                "should not have an empty replaces entry",
            ),
            // Unknown keys: the file, the line, and the key.
            (
                file!("misspelled_key"),
                "misspelled_key:5: descriptors[0]: unknown field `ratelimit`",
            ),
            (
                file!("misspelled_key2"),
                "misspelled_key2:7: descriptors[0].rate_limit: unknown field `requestsperunit`",
            ),
            (
                file!("non_string_key"),
                "non_string_key:1: unknown field `0.25`",
            ),
            (
                file!("non_map_list"),
                "non_map_list:3: descriptors[0]: invalid type",
            ),
            (file!("bad_yaml"), "bad_yaml:"),
        ];
        for (file, expected) in cases {
            let error = load(&[*file]).unwrap_err().to_string();
            assert!(error.contains(expected), "{}: {error}", file.0);
            assert!(error.starts_with(file.0), "{error}");
        }
        let twice = load(&[file!("basic_config"), file!("basic_config")]).unwrap_err();
        assert!(twice.to_string().contains("duplicate domain 'test-domain'"));
    }

    /// A rule's name is its `plan` on the metrics, and a domain begins the label of its rules
    /// without one: `none` and `concurrency-…` there mean something else (keys refused before
    /// any plan; the HTTP front end's slots, which the dashboard's request panels leave out).
    #[test]
    fn names_the_metrics_reserve_are_refused() {
        let rule = |domain: &str, name: &str| {
            format!(
                "domain: {domain}\ndescriptors:\n  - key: k\n    rate_limit: {{name: {name}, \
                 unit: second, requests_per_unit: 1}}\n"
            )
        };
        for (domain, name) in [
            ("d", "concurrency-uploads"),
            ("d", "none"),
            ("concurrency-api", "uploads"),
        ] {
            let error = load(&[("r.yaml", &rule(domain, name))])
                .unwrap_err()
                .to_string();
            assert!(error.contains("reserved"), "{domain} {name}: {error}");
            assert!(error.starts_with("r.yaml"), "{error}");
        }
        for (domain, name) in [("d", "concurrency"), ("d", "nones"), ("concurrency", "x")] {
            let loaded = load(&[("r.yaml", &rule(domain, name))]);
            assert!(loaded.is_ok(), "{domain} {name}: {:?}", loaded.err());
        }
    }

    #[test]
    fn keys_not_implemented_and_extensions() {
        for key in [
            "quota_mode: true",
            "value_to_metric: true",
            "share_threshold: true",
            "metadata: {a: 1}",
        ] {
            let text = format!("domain: d\ndescriptors:\n  - key: k\n    {key}\n");
            let error = load(&[("f.yaml", &text)]).unwrap_err().to_string();
            assert!(error.contains("does not implement yet"), "{error}");
        }
        let text = "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {requests_per_unit: 0, unit: second}\n";
        assert!(load(&[("f", text)])
            .unwrap_err()
            .to_string()
            .contains("at least 1"));
        let text = "domain: d\ndescriptors:\n  - key: k\n    concurrency: true\n    rate_limit: {requests_per_unit: 2, window_seconds: 90}\n";
        let config = load(&[("f", text)]).unwrap();
        let rule = config.rule_for("d", [("k", "v")].into_iter()).unwrap();
        assert!(rule.concurrency);
        let RuleLimit::Counted {
            window_seconds,
            unit,
            ..
        } = rule.limit
        else {
            panic!("counted")
        };
        assert_eq!((window_seconds.get(), unit), (90, None));
        let text = "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {requests_per_unit: 2, unit: minute, window_seconds: 90}\n";
        let error = load(&[("f", text)]).unwrap_err().to_string();
        assert!(error.contains("not both"), "{error}");
    }

    #[test]
    fn a_rule_value_with_the_escape_mark_matches_the_same_value_sent() {
        let text = "domain: d\ndescriptors:\n  - key: k\n    value: \"a\\uFFFDb\"\n    rate_limit: {requests_per_unit: 2, unit: second}\n";
        let config = load(&[("f", text)]).unwrap();
        let sent = super::super::wire::text("a\u{FFFD}b".as_bytes().to_vec());
        assert!(config
            .rule_for("d", [("k", sent.as_str())].into_iter())
            .is_some());
        let raw = super::super::wire::text(b"a\xffb".to_vec());
        assert!(config
            .rule_for("d", [("k", raw.as_str())].into_iter())
            .is_none());
        // So does a domain with it.
        let text = "domain: \"d\\uFFFD\"\ndescriptors:\n  - key: k\n    rate_limit: {requests_per_unit: 2, unit: second}\n";
        let config = load(&[("f", text)]).unwrap();
        let sent = super::super::wire::text("d\u{FFFD}".as_bytes().to_vec());
        assert!(config.has_domain(&sent));
        assert!(config.rule_for(&sent, [("k", "v")].into_iter()).is_some());
    }

    /// An error about a rule never quotes a value (a value may be a partner's API key): a
    /// value too long, or a rule nested too deep under one, names its key and the hashed label.
    #[test]
    fn errors_about_a_rule_never_quote_its_values() {
        let long = format!("sk_live_{}", "x".repeat(300));
        let text = format!("domain: d\ndescriptors:\n  - key: k\n    value: {long}\n");
        let error = load(&[("f", &text)]).unwrap_err().to_string();
        assert!(error.contains("the value of key 'k'"), "{error}");
        assert!(!error.contains("sk_live"), "{error}");
        let mut deep = String::from("domain: d\ndescriptors:\n");
        for level in 0..=DEPTH_MAX {
            let indent = "  ".repeat(2 * level);
            deep.push_str(&format!(
                "{indent}  - key: k\n{indent}    value: sk_live_{level}\n"
            ));
            deep.push_str(&format!("{indent}    descriptors:\n"));
        }
        deep.push_str(&format!(
            "{}  - key: last\n",
            "  ".repeat(2 * (DEPTH_MAX + 1))
        ));
        let error = load(&[("f", &deep)]).unwrap_err().to_string();
        assert!(error.contains("nest deeper"), "{error}");
        assert!(!error.contains("sk_live"), "{error}");
    }

    /// Rules in subfolders are read (envoyproxy/ratelimit's runtime reads a folder's tree);
    /// hidden files and folders are not (Kubernetes mounts a ConfigMap's files twice, the
    /// second time under `..<time>/`).
    #[test]
    fn a_folders_tree_is_read_but_not_its_hidden_entries() {
        let dir = tempfile::tempdir().unwrap();
        let rules = |domain: &str| {
            format!("domain: {domain}\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: minute\n      requests_per_unit: 1\n")
        };
        std::fs::write(dir.path().join("top.yaml"), rules("top")).unwrap();
        let team = dir.path().join("team-a");
        std::fs::create_dir(&team).unwrap();
        std::fs::write(team.join("nested.yml"), rules("nested")).unwrap();
        let copy = dir.path().join("..2026_12_07");
        std::fs::create_dir(&copy).unwrap();
        std::fs::write(copy.join("top.yaml"), rules("top")).unwrap();
        std::fs::write(dir.path().join(".top.yaml.swp"), "not rules").unwrap();
        let files = config_files(dir.path()).unwrap();
        assert_eq!(
            files,
            [
                dir.path().join("team-a/nested.yml"),
                dir.path().join("top.yaml")
            ]
        );
        let config = RlsConfig::load(dir.path()).unwrap();
        assert_eq!(config.domains.len(), 2);
    }

    #[test]
    fn a_folder_without_rules_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("notes.txt"), "not rules").unwrap();
        let error = RlsConfig::load(dir.path()).unwrap_err().to_string();
        assert!(error.contains("no *.yaml"), "{error}");
    }
}
