//! The real deployment, on loopback: a 3-replica TigerBeetle cluster, two limiter instances under
//! steady load, and the faults a cluster meets: a backup dies, the primary dies, one instance is
//! replaced, the whole cluster goes down and comes back. After all of it, an audit of every
//! caller read back from the ledger: what the clients were told was admitted is exactly what the
//! ledger holds, and nobody was credited twice.
//!
//! Bounded: about a minute. The phases' figures are printed (`cargo test --test failover --
//! --nocapture`, or `scripts/failover`).

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use ledger_limiter::config::FileConfig;

/// The decision deadline of both instances.
const DEADLINE: Duration = Duration::from_millis(500);
/// What a request may take beyond the deadline on this shared, 2-core machine.
const MARGIN: Duration = Duration::from_millis(1500);
const KEYS: usize = 24;
const HOT_KEYS: usize = 2;
const HOT_CAPACITY: u64 = 50;

#[derive(Debug, Clone)]
struct Sample {
    key: usize,
    status: u16,
    at: Duration,
    took: Duration,
}

fn key_name(run: &str, i: usize) -> String {
    if i < HOT_KEYS {
        format!("hot_{run}_{i}")
    } else {
        format!("k_{run}_{i}")
    }
}

fn config(cluster: &TestCluster) -> FileConfig {
    let mut config = test_config(cluster.addresses[0]);
    config.ledger.addresses = Some(cluster.address_list());
    config.ledger.timeout_ms = Some(DEADLINE.as_millis() as u64);
    config.ledger.failure_policy = Some("closed".into());
    // Windows longer than the test: every admitted hold is still pending at the audit.
    config.plans = Some(
        [
            ("free".to_owned(), plan(100_000, 600)),
            ("hot".to_owned(), plan(HOT_CAPACITY, 600)),
        ]
        .into(),
    );
    config.key_prefixes = Some([("hot_".to_owned(), "hot".to_owned())].into());
    config
}

/// Steady load: `workers` loops over both instances, each request to a random caller.
struct Load {
    stop: Arc<AtomicBool>,
    samples: Arc<Mutex<Vec<Sample>>>,
    urls: Arc<Mutex<Vec<String>>>,
    workers: Vec<tokio::task::JoinHandle<()>>,
    started: Instant,
}

impl Load {
    fn start(urls: Vec<String>, run: &str, workers: usize) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let samples = Arc::new(Mutex::new(Vec::new()));
        let urls = Arc::new(Mutex::new(urls));
        let started = Instant::now();
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .build()
            .unwrap();
        let workers = (0..workers)
            .map(|worker| {
                let (stop, samples, urls, http) =
                    (stop.clone(), samples.clone(), urls.clone(), http.clone());
                let run = run.to_owned();
                tokio::spawn(async move {
                    let mut n = worker;
                    while !stop.load(Ordering::Relaxed) {
                        n += 1;
                        let key = rand::random::<u32>() as usize % KEYS;
                        let url = urls.lock().unwrap()[n % 2].clone();
                        let at = started.elapsed();
                        let sent = Instant::now();
                        let status = match http
                            .get(format!("{url}/greeting"))
                            .header("X-Api-Key", key_name(&run, key))
                            .send()
                            .await
                        {
                            Ok(response) => response.status().as_u16(),
                            Err(_) => 0,
                        };
                        let took = sent.elapsed();
                        samples.lock().unwrap().push(Sample {
                            key,
                            status,
                            at,
                            took,
                        });
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                })
            })
            .collect();
        Load {
            stop,
            samples,
            urls,
            workers,
            started,
        }
    }

    fn now(&self) -> Duration {
        self.started.elapsed()
    }

    fn between(&self, from: Duration, to: Duration) -> Vec<Sample> {
        let samples = self.samples.lock().unwrap();
        samples
            .iter()
            .filter(|s| s.at >= from && s.at < to)
            .cloned()
            .collect()
    }

    async fn finish(self) -> Vec<Sample> {
        self.stop.store(true, Ordering::Relaxed);
        for worker in self.workers {
            worker.await.unwrap();
        }
        let samples = self.samples.lock().unwrap().clone();
        samples
    }
}

fn count(samples: &[Sample], status: u16) -> usize {
    samples.iter().filter(|s| s.status == status).count()
}

fn report(phase: &str, samples: &[Sample]) {
    let slowest = samples.iter().map(|s| s.took).max().unwrap_or_default();
    eprintln!(
        "failover: {phase:<28} {:>6} requests: {:>6} admitted, {:>5} limited, {:>5} failed (503), slowest {slowest:?}",
        samples.len(),
        count(samples, 200),
        count(samples, 429),
        count(samples, 503),
    );
}

async fn ready(url: &str) -> u16 {
    reqwest::get(format!("{url}/readyz"))
        .await
        .map(|r| r.status().as_u16())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replicated_ledger_survives_failover_outage_and_instance_restarts() {
    let mut cluster = TestCluster::start(3);
    let a = spawn_app(config(&cluster)).await;
    let b = spawn_app(config(&cluster)).await;
    let run = format!("{:08x}", rand::random::<u32>());
    let load = Load::start(vec![a.address.clone(), b.address.clone()], &run, 8);

    pause(4).await;
    report("steady", &load.between(Duration::ZERO, load.now()));

    let backup_down = kill_a_backup(&mut cluster, &load).await;
    kill_the_primary(&mut cluster, &load).await;

    // One instance is replaced mid-load: a new one takes its place, the old one drains, then it
    // stops. Without the drain, a request that picked b just before the switch could go out on
    // a keep-alive connection that b's stop was closing, and fail in the client (one CI run).
    let c = spawn_app(config(&cluster)).await;
    load.urls.lock().unwrap()[1] = c.address.clone();
    pause(1).await;
    b.stop().await;
    let from = load.now();
    pause(3).await;
    report("instance b replaced by c", &load.between(from, load.now()));

    take_the_whole_cluster_down(&mut cluster, &load, [&a, &c]).await;

    let samples = load.finish().await;
    check_every_answer(&samples, &backup_down);
    audit(&cluster, &a, &run, &samples).await;
    a.stop().await;
    c.stop().await;
}

async fn pause(seconds: u64) {
    tokio::time::sleep(Duration::from_secs(seconds)).await;
}

/// A backup dies: a quorum of two goes on. Returns the samples while it was down.
async fn kill_a_backup(cluster: &mut TestCluster, load: &Load) -> Vec<Sample> {
    // The primary is found from the replicas' logs: on a fresh cluster it is not always
    // replica 0.
    let primary = tokio::task::block_in_place(|| cluster.wait_for_primary(Duration::from_secs(20)));
    let backup = (primary + 1) % 3;
    let from = load.now();
    cluster.kill(backup);
    pause(4).await;
    let backup_down = load.between(from, load.now());
    report(&format!("backup {backup} killed"), &backup_down);
    cluster.restart(backup);
    tokio::task::block_in_place(|| {
        cluster.wait_listening(LISTEN_TIMEOUT);
        cluster.wait_normal(backup, Duration::from_secs(30))
    });
    backup_down
}

/// The primary dies: the others elect a new one; decisions fail over to the policy meanwhile.
async fn kill_the_primary(cluster: &mut TestCluster, load: &Load) {
    let primary = tokio::task::block_in_place(|| cluster.wait_for_primary(Duration::from_secs(20)));
    let view = cluster.view(primary).expect("the primary's view");
    let killed_at = load.now();
    cluster.kill(primary);
    // Recovered: admitting again, with no failed decision in the last two seconds. (A later
    // stray 503 under load must not make recovery look endless.)
    let deadline = Instant::now() + Duration::from_secs(60);
    let recovered_at = loop {
        pause(1).await;
        let now = load.now();
        let since = load.between(killed_at, now);
        let last_failed = since.iter().rfind(|s| s.status == 503).map(|s| s.at);
        let first_admitted = since
            .iter()
            .find(|s| s.status == 200 && last_failed.is_none_or(|failed| s.at > failed));
        if let Some(first) = first_admitted {
            if now.saturating_sub(last_failed.unwrap_or_default()) > Duration::from_secs(2) {
                break first.at;
            }
        }
        let primary_now = tokio::task::block_in_place(|| cluster.primary());
        assert!(
            Instant::now() < deadline,
            "no recovery within 60 s after the primary died (primary now: {primary_now:?})"
        );
    };
    // A view change happened: another replica leads a later view (a backup killed for a
    // primary misread from the logs would pass everything above without one).
    let next = tokio::task::block_in_place(|| cluster.wait_for_primary(Duration::from_secs(20)));
    let next_view = cluster.view(next).expect("the new primary's view");
    assert!(
        next_view > view,
        "primary {primary} of view {view} killed; primary now {next} of view {next_view}"
    );
    let failing = load.between(killed_at, recovered_at);
    report(&format!("primary {primary} killed"), &failing);
    let failed: Vec<_> = failing.iter().filter(|s| s.status == 503).collect();
    let window = match (failed.first(), failed.last()) {
        (Some(first), Some(last)) => last.at + last.took - first.at,
        _ => Duration::ZERO,
    };
    eprintln!(
        "failover: decisions failed over to the policy for {window:?}; admitting again {:?} after the kill",
        recovered_at - killed_at
    );
    cluster.restart(primary);
    tokio::task::block_in_place(|| {
        cluster.wait_listening(LISTEN_TIMEOUT);
        cluster.wait_normal(primary, Duration::from_secs(30))
    });
}

/// The whole cluster goes down: every request follows the policy within the deadline, and
/// /readyz says so; then it comes back and the instances recover by themselves.
async fn take_the_whole_cluster_down(
    cluster: &mut TestCluster,
    load: &Load,
    instances: [&TestApp; 2],
) {
    let [a, c] = instances;
    let outage_at = load.now();
    for replica in 0..3 {
        cluster.kill(replica);
    }
    pause(3).await;
    let outage = load.between(outage_at + Duration::from_secs(1), load.now());
    report("cluster down", &outage);
    assert!(!outage.is_empty());
    // Down means the policy (closed: 503), or a local refusal of a caller known to be exhausted,
    // which needs no ledger; never an admission.
    assert_eq!(count(&outage, 200), 0, "admitted without a ledger");
    assert_eq!(count(&outage, 503) + count(&outage, 429), outage.len());
    assert!(count(&outage, 503) > 0);
    assert_eq!(ready(&a.address).await, 503);
    assert_eq!(ready(&c.address).await, 503);
    for replica in 0..3 {
        cluster.restart(replica);
    }
    // The instances' 30 s to be ready again count from when the replicas listen: their recovery
    // of their logs is the ledger's time, not the service's.
    tokio::task::block_in_place(|| cluster.wait_listening(LISTEN_TIMEOUT));
    let restarted_at = load.now();
    let deadline = Instant::now() + Duration::from_secs(30);
    while ready(&a.address).await != 200 || ready(&c.address).await != 200 {
        assert!(
            Instant::now() < deadline,
            "not ready again after the outage"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let back = load.now();
    eprintln!(
        "failover: ready again {:?} after the restarted cluster listened",
        back - restarted_at
    );
    pause(3).await;
    let after = load.between(back + Duration::from_secs(1), load.now());
    report("after the outage", &after);
    assert!(count(&after, 200) > 0, "admitting again");
}

/// Every request answered, with a decision, within the deadline plus a margin; a dead backup
/// costs (almost) nothing.
fn check_every_answer(samples: &[Sample], backup_down: &[Sample]) {
    let late: Vec<_> = samples
        .iter()
        .filter(|s| s.took > DEADLINE + MARGIN)
        .collect();
    assert!(late.is_empty(), "answered late: {late:?}");
    let unanswered: Vec<_> = samples
        .iter()
        .filter(|s| ![200, 429, 503].contains(&s.status))
        .collect();
    assert!(unanswered.is_empty(), "not answered: {unanswered:?}");
    assert!(
        count(backup_down, 503) * 100 <= backup_down.len(),
        "a dead backup failed {} of {}",
        count(backup_down, 503),
        backup_down.len()
    );
}

/// What the clients saw admitted is what the ledger holds; each caller credited once.
async fn audit(cluster: &TestCluster, app: &TestApp, run: &str, samples: &[Sample]) {
    let mut seen: HashMap<usize, u64> = HashMap::new();
    for sample in samples.iter().filter(|s| s.status == 200) {
        *seen.entry(sample.key).or_default() += 1;
    }
    let ledger = ledger_client(cluster.addresses.clone());
    for key in 0..KEYS {
        let admitted = seen.get(&key).copied().unwrap_or(0);
        let account_id = account_id(app, &key_name(run, key));
        // Holds that landed after their request was refused are voided when they land: wait
        // for the last voids of the outage.
        let deadline = Instant::now() + Duration::from_secs(30);
        let audit = loop {
            let audit = ledger
                .audit(account_id, Instant::now() + Duration::from_secs(10))
                .await
                .unwrap();
            match audit {
                Some(audit) if audit.admitted() == admitted || Instant::now() > deadline => {
                    break Some(audit)
                }
                None if admitted == 0 => break None,
                None if Instant::now() > deadline => {
                    panic!("caller {key}: {admitted} admitted, and no account in the ledger")
                }
                _ => tokio::time::sleep(Duration::from_millis(500)).await,
            }
        };
        let Some(audit) = audit else { continue };
        assert!(audit.complete);
        assert_eq!(audit.grants, 1, "caller {key} credited once: {audit:?}");
        assert_eq!(audit.admitted(), admitted, "caller {key}: {audit:?}");
        assert_eq!(audit.debits_pending, u128::from(admitted), "{audit:?}");
        if key < HOT_KEYS {
            assert!(admitted <= HOT_CAPACITY, "caller {key}: {admitted}");
        }
    }
    let total: u64 = seen.values().sum();
    eprintln!("failover: audit of {KEYS} callers: {total} admitted = {total} held by the ledger");
}
