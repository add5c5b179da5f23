//! The Envoy front end's rules as they are now: read at start, and read again when their files
//! change, as envoyproxy/ratelimit reloads its runtime directory. Without it, a rule changed
//! during abuse waited for every instance's restart.
//!
//! The files are read every [`RULES_CHECK_INTERVAL`] and compared with what was last read (a
//! hash of their names and texts: a Kubernetes ConfigMap swaps a symlink and keeps modification
//! times). Rules that fail to load leave the ones in force, logged and counted once per change.
//! A call reads the rules once, at its start: it is decided under one set of rules whole.

use std::hash::{Hash, Hasher};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;

use super::config::{read_texts, RlsConfig};
use super::metrics::RlsMetrics;

/// How often the rules' files are read again, to see whether they changed.
pub const RULES_CHECK_INTERVAL: Duration = Duration::from_secs(2);

/// The rules in force, and where they are read from.
#[derive(Debug)]
pub struct LiveRules {
    current: ArcSwap<RlsConfig>,
    path: PathBuf,
    /// The hash of the files last read, loaded or not: a change is read once.
    read_last: AtomicU64,
}

/// What a reading of the rules' files came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reread {
    Unchanged,
    /// Changed, and in force now: how many domains and rules.
    Loaded {
        domains: usize,
        rules: usize,
    },
    /// Changed, but not loaded: why. The rules in force stay.
    Refused(String),
}

impl LiveRules {
    /// The rules `config`, read from `path` just now.
    pub fn new(config: Arc<RlsConfig>, path: PathBuf) -> Self {
        let read_last = read_texts(&path).map_or(0, |texts| fingerprint(&texts));
        LiveRules {
            current: ArcSwap::new(config),
            path,
            read_last: AtomicU64::new(read_last),
        }
    }

    /// The rules in force.
    pub fn current(&self) -> Arc<RlsConfig> {
        self.current.load_full()
    }

    /// Reads the files again, and puts their rules in force if they changed and load.
    pub fn reread(&self) -> Reread {
        let texts = match read_texts(&self.path) {
            Ok(texts) => texts,
            Err(error) => return self.refused(error.to_string()),
        };
        let read = fingerprint(&texts);
        if self.read_last.swap(read, Ordering::Relaxed) == read {
            return Reread::Unchanged;
        }
        match RlsConfig::from_texts(&texts) {
            Ok(config) => {
                let (domains, rules) = (config.domains(), config.rules());
                self.current.store(Arc::new(config));
                Reread::Loaded { domains, rules }
            }
            Err(error) => Reread::Refused(error.to_string()),
        }
    }

    /// Files that could not be read: a change to say once, as a text that does not load.
    fn refused(&self, why: String) -> Reread {
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        why.hash(&mut hasher);
        let read = hasher.finish();
        match self.read_last.swap(read, Ordering::Relaxed) == read {
            true => Reread::Unchanged,
            false => Reread::Refused(why),
        }
    }

    /// Rereads the files every `every`, for good (the task ends with its runtime), and says
    /// what came of each change.
    pub async fn follow(self: Arc<Self>, every: Duration, metrics: RlsMetrics) {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            // Blocking file reads, off the runtime's workers.
            let rules = self.clone();
            let Ok(reread) = tokio::task::spawn_blocking(move || rules.reread()).await else {
                continue;
            };
            match reread {
                Reread::Unchanged => {}
                Reread::Loaded { domains, rules } => {
                    metrics.record_rules_change(true);
                    tracing::info!(domains, rules, path = %self.path.display(), "Envoy rules changed: in force now");
                }
                Reread::Refused(error) => {
                    metrics.record_rules_change(false);
                    tracing::warn!(%error, path = %self.path.display(), "Envoy rules changed but do not load: the rules in force stay");
                }
            }
        }
    }
}

/// A hash of the files' names and texts, to tell a change.
fn fingerprint(texts: &[(String, String)]) -> u64 {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    texts.hash(&mut hasher);
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    const ONE: &str = "domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      requests_per_unit: 1\n      unit: minute\n";
    const TWO: &str = "domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      requests_per_unit: 1\n      unit: minute\n  - key: j\n    rate_limit:\n      requests_per_unit: 2\n      unit: minute\n";

    fn live(dir: &std::path::Path) -> LiveRules {
        let config = RlsConfig::load(dir).unwrap();
        LiveRules::new(Arc::new(config), dir.to_owned())
    }

    /// A change is loaded once; a change that does not load leaves the rules in force, and is
    /// said once; files gone are a change that does not load; the files back are loaded again.
    #[test]
    fn a_change_is_read_once_and_a_bad_one_leaves_the_rules_in_force() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("d.yaml");
        std::fs::write(&file, ONE).unwrap();
        let rules = live(dir.path());
        assert_eq!(rules.reread(), Reread::Unchanged);
        std::fs::write(&file, TWO).unwrap();
        let loaded = Reread::Loaded {
            domains: 1,
            rules: 2,
        };
        assert_eq!(rules.reread(), loaded);
        assert_eq!(rules.current().rules(), 2);
        assert_eq!(rules.reread(), Reread::Unchanged);
        std::fs::write(&file, "domain: d\ndescriptors: [oops").unwrap();
        assert!(matches!(rules.reread(), Reread::Refused(_)));
        assert_eq!(rules.reread(), Reread::Unchanged, "said once");
        assert_eq!(rules.current().rules(), 2, "the rules in force stay");
        std::fs::remove_file(&file).unwrap();
        let gone = rules.reread();
        assert!(
            matches!(&gone, Reread::Refused(why) if why.contains("no *.yaml")),
            "{gone:?}"
        );
        assert_eq!(rules.reread(), Reread::Unchanged, "said once");
        assert_eq!(rules.current().rules(), 2);
        std::fs::write(&file, ONE).unwrap();
        let back = Reread::Loaded {
            domains: 1,
            rules: 1,
        };
        assert_eq!(rules.reread(), back);
    }
}
