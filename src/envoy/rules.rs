//! The Envoy front end's rules as they are now: read at start, and read again when their files
//! change, as envoyproxy/ratelimit reloads its runtime directory. Without it, a rule changed
//! during abuse waited for every instance's restart.
//!
//! The files are read every [`RULES_CHECK_INTERVAL`] and compared with what was last read (a
//! hash of their names and texts: a Kubernetes ConfigMap swaps a symlink and keeps modification
//! times). A change is acted on once two readings in a row agree (within two intervals), so a
//! folder caught mid-edit is not loaded. Rules that fail to load leave the ones in force, logged
//! and counted once per change. A call reads the rules once, at its start: it is decided under
//! one set of rules whole.

use std::hash::{Hash, Hasher};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;

use super::config::{read_texts, RlsConfig};
use super::metrics::RlsMetrics;
use crate::sync::lock;

/// How often the rules' files are read again, to see whether they changed.
pub const RULES_CHECK_INTERVAL: Duration = Duration::from_secs(2);

/// The rules in force, and where they are read from.
#[derive(Debug)]
pub struct LiveRules {
    current: ArcSwap<RlsConfig>,
    path: PathBuf,
    reads: Mutex<Reads>,
}

/// What the files were when last read, and when last acted on, each as a hash ([`fingerprint`];
/// files that could not be read, as the hash of why).
#[derive(Debug)]
struct Reads {
    seen: u64,
    acted: u64,
}

/// What a reading of the rules' files came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reread {
    /// As when last acted on; or changed since the last reading, and left for the next to
    /// confirm. Why: a folder read while it is being edited (several files, or a ConfigMap's
    /// symlink swapped between two files' reads) may give a mix that loads and leaves a domain
    /// out, or that does not load although the edit does.
    Unchanged,
    /// Changed, the same two readings in a row, and in force now: how many domains and rules.
    Loaded { domains: usize, rules: usize },
    /// Changed, the same two readings in a row, but not loaded: why. The rules in force stay.
    Refused(String),
}

impl LiveRules {
    /// The rules `config`, read from `path` as files whose [`fingerprint`] is `read`.
    pub fn new(config: Arc<RlsConfig>, path: PathBuf, read: u64) -> Self {
        LiveRules {
            current: ArcSwap::new(config),
            path,
            reads: Mutex::new(Reads {
                seen: read,
                acted: read,
            }),
        }
    }

    /// The rules in force, for as long as a call is matched (a guard: no count of the shared
    /// `Arc` moved on every call, which each core's calls would contend for).
    pub fn current(&self) -> arc_swap::Guard<Arc<RlsConfig>> {
        self.current.load()
    }

    /// Reads the files again, and puts their rules in force if they changed, read the same as
    /// at the last reading, and load.
    pub fn reread(&self) -> Reread {
        let texts = read_texts(&self.path);
        let seen = match &texts {
            Ok(texts) => fingerprint(texts),
            Err(error) => hash_of(&error.to_string()),
        };
        {
            let mut reads = lock(&self.reads);
            let confirmed = reads.seen == seen;
            reads.seen = seen;
            if reads.acted == seen || !confirmed {
                return Reread::Unchanged;
            }
            reads.acted = seen;
        }
        match texts.and_then(|texts| RlsConfig::from_texts(&texts)) {
            Ok(config) => {
                let (domains, rules) = (config.domains(), config.rules());
                self.current.store(Arc::new(config));
                Reread::Loaded { domains, rules }
            }
            Err(error) => Reread::Refused(error.to_string()),
        }
    }

    /// A reread, waited for as long as it takes (another would block as this one does), but
    /// said once it is late: a read blocked for good (a pipe nobody writes, a hung mount) stops
    /// every later change from loading, and would otherwise go unsaid.
    async fn waited(
        &self,
        mut reread: tokio::task::JoinHandle<Reread>,
    ) -> Result<Reread, tokio::task::JoinError> {
        match tokio::time::timeout(REREAD_LATE_AFTER, &mut reread).await {
            Ok(reread) => reread,
            Err(_) => {
                tracing::warn!(path = %self.path.display(), late_seconds = REREAD_LATE_AFTER.as_secs(), "Envoy rules reread still blocked reading the files: no change loads until it ends");
                reread.await
            }
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
            let Ok(reread) = self
                .waited(tokio::task::spawn_blocking(move || rules.reread()))
                .await
            else {
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

/// How long a rules reread may take before it is said to be late: reading a few files takes
/// milliseconds.
const REREAD_LATE_AFTER: Duration = Duration::from_secs(10);

/// A hash of the rules files' names and texts ([`read_texts`]), to tell a change.
pub fn fingerprint(texts: &[(String, String)]) -> u64 {
    hash_of(texts)
}

fn hash_of<T: Hash + ?Sized>(value: &T) -> u64 {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    value.hash(&mut hasher);
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    const ONE: &str = "domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      requests_per_unit: 1\n      unit: minute\n";
    const TWO: &str = "domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      requests_per_unit: 1\n      unit: minute\n  - key: j\n    rate_limit:\n      requests_per_unit: 2\n      unit: minute\n";

    fn live(dir: &std::path::Path) -> LiveRules {
        let texts = read_texts(dir).unwrap();
        let config = RlsConfig::from_texts(&texts).unwrap();
        LiveRules::new(Arc::new(config), dir.to_owned(), fingerprint(&texts))
    }

    /// A change is loaded once two readings agree, and once only; a change that does not load
    /// leaves the rules in force, and is said once; files gone are a change that does not load;
    /// the files back are loaded again; a reading between two edits is not acted on.
    #[test]
    fn a_change_is_read_once_and_a_bad_one_leaves_the_rules_in_force() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("d.yaml");
        std::fs::write(&file, ONE).unwrap();
        let rules = live(dir.path());
        assert_eq!(rules.reread(), Reread::Unchanged);
        std::fs::write(&file, TWO).unwrap();
        assert_eq!(
            rules.reread(),
            Reread::Unchanged,
            "left for the next reading"
        );
        let loaded = Reread::Loaded {
            domains: 1,
            rules: 2,
        };
        assert_eq!(rules.reread(), loaded);
        assert_eq!(rules.current().rules(), 2);
        assert_eq!(rules.reread(), Reread::Unchanged);
        std::fs::write(&file, "domain: d\ndescriptors: [oops").unwrap();
        assert_eq!(rules.reread(), Reread::Unchanged);
        assert!(matches!(rules.reread(), Reread::Refused(_)));
        assert_eq!(rules.reread(), Reread::Unchanged, "said once");
        assert_eq!(rules.current().rules(), 2, "the rules in force stay");
        std::fs::remove_file(&file).unwrap();
        assert_eq!(rules.reread(), Reread::Unchanged);
        let gone = rules.reread();
        assert!(
            matches!(&gone, Reread::Refused(why) if why.contains("no *.yaml")),
            "{gone:?}"
        );
        assert_eq!(rules.reread(), Reread::Unchanged, "said once");
        assert_eq!(rules.current().rules(), 2);
        // Read mid-edit (one reading of a text that does not stay): never acted on.
        std::fs::write(&file, TWO).unwrap();
        assert_eq!(rules.reread(), Reread::Unchanged);
        std::fs::write(&file, ONE).unwrap();
        assert_eq!(rules.reread(), Reread::Unchanged);
        let back = Reread::Loaded {
            domains: 1,
            rules: 1,
        };
        assert_eq!(rules.reread(), back);
    }
}
