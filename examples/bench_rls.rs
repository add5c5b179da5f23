//! The Envoy front end against the HTTP middleware, side by side: one in-process service with both
//! listeners on one TigerBeetle, the same callers, the same concurrency, every call admitted (one
//! hold each). Prints calls/s and latency percentiles per front end.
//!
//!     cargo run --release --example bench_rls            # starts a production-mode TigerBeetle
//!     BENCH_SECONDS=5 BENCH_CONCURRENCY=64 BENCH_DEVELOPMENT=1 cargo run --release --example bench_rls
//!
//! The load generator shares the machine (and this process) with the service and the ledger:
//! compare the two rows of one run, not runs on different machines.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use ledger_limiter::config::{FileConfig, LedgerFile, PlanFile, RlsFile, Settings};
use ledger_limiter::startup::{Application, Exporters};

const KEYS: usize = 10_000;

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A TigerBeetle of its own (killed with this process: its stdin is ours).
fn start_tigerbeetle(dir: &std::path::Path, development: bool) -> (std::process::Child, u16) {
    let file = dir.join("0_0.tigerbeetle");
    let mode: &[&str] = if development { &["--development"] } else { &[] };
    let status = Command::new(".tools/tigerbeetle")
        .args(["format", "--cluster=0", "--replica=0", "--replica-count=1"])
        .args(mode)
        .arg(&file)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect(".tools/tigerbeetle (scripts/setup)");
    assert!(status.success(), "tigerbeetle format");
    let mut child = Command::new(".tools/tigerbeetle")
        .args(["start", "--addresses=0"])
        .args(mode)
        .arg(&file)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("tigerbeetle start");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let port = lines.next().unwrap().unwrap().trim().parse().unwrap();
    std::thread::spawn(move || for _ in lines {});
    (child, port)
}

fn config(ledger_port: u16, rules: &std::path::Path) -> FileConfig {
    let plan = PlanFile {
        capacity: 1_000_000_000,
        window_seconds: 60,
        lease_units_max: None,
        lease_seconds: None,
    };
    FileConfig {
        listen: Some("127.0.0.1:0".into()),
        workers: Some(2),
        ledger: LedgerFile {
            addresses: Some(vec![format!("127.0.0.1:{ledger_port}")]),
            timeout_ms: Some(5_000),
            ..LedgerFile::default()
        },
        plans: Some([("bench".to_owned(), plan)].into()),
        default_plan: Some("bench".into()),
        key_prefixes: Some(Default::default()),
        rls: RlsFile {
            listen: Some("127.0.0.1:0".into()),
            config: Some(rules.to_owned()),
            ..RlsFile::default()
        },
        ..FileConfig::default()
    }
}

fn rls_request(key: usize) -> RateLimitRequest {
    RateLimitRequest {
        domain: "bench".into(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![Entry {
                key: "user".into(),
                value: format!("k{key}"),
            }],
            ..RateLimitDescriptor::default()
        }],
        hits_addend: 0,
    }
}

/// Runs `concurrency` loops of `call` for `seconds`; (calls/s, sorted latencies in µs, failures).
async fn measure<F, Fut>(seconds: u64, concurrency: usize, call: F) -> (f64, Vec<u64>, usize)
where
    F: Fn(usize) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = bool> + Send,
{
    let end = Instant::now() + Duration::from_secs(seconds);
    let started = Instant::now();
    let workers = (0..concurrency).map(|w| {
        let call = call.clone();
        tokio::spawn(async move {
            let (mut latencies, mut failures, mut i) = (Vec::new(), 0, w);
            while Instant::now() < end {
                let t = Instant::now();
                failures += usize::from(!call(i % KEYS).await);
                latencies.push(t.elapsed().as_micros() as u64);
                i += concurrency;
            }
            (latencies, failures)
        })
    });
    let mut all = Vec::new();
    let mut failures = 0;
    for worker in futures_util::future::join_all(workers).await {
        let (latencies, failed) = worker.unwrap();
        all.extend(latencies);
        failures += failed;
    }
    let rate = all.len() as f64 / started.elapsed().as_secs_f64();
    all.sort_unstable();
    (rate, all, failures)
}

fn print_row(name: &str, (rate, latencies, failures): &(f64, Vec<u64>, usize)) {
    let at = |q: f64| {
        latencies[((latencies.len() as f64 * q) as usize).min(latencies.len() - 1)] as f64 / 1000.0
    };
    println!(
        "| {name} | {rate:.0} | {:.2} | {:.2} | {:.2} | {} |",
        at(0.50),
        at(0.90),
        at(0.99),
        failures
    );
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let seconds = env_or("BENCH_SECONDS", 5);
    let concurrency = env_or("BENCH_CONCURRENCY", 64) as usize;
    let dir = tempfile::tempdir().unwrap();
    let (_tigerbeetle, port) = start_tigerbeetle(dir.path(), env_or("BENCH_DEVELOPMENT", 0) == 1);
    let rules = dir.path().join("rules.yaml");
    let yaml = "domain: bench\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 1000000000}\n";
    std::fs::write(&rules, yaml).unwrap();
    let settings = Settings::with_overrides(config(port, &rules)).unwrap();
    let app = Application::build(settings, Exporters::default())
        .await
        .unwrap();
    assert!(app.wait_for_ledger(Duration::from_secs(30)).await);
    let (http_port, rls_port) = (app.port(), app.rls_port().unwrap());
    tokio::spawn(app.run_until_stopped());

    let channel = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{rls_port}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let rls = RateLimitServiceClient::new(channel);
    let http = Arc::new(
        reqwest::Client::builder()
            .pool_max_idle_per_host(256)
            .build()
            .unwrap(),
    );
    let base = Arc::new(format!("http://127.0.0.1:{http_port}/greeting"));
    let rls_call = move |key: usize| {
        let mut client = rls.clone();
        async move {
            let response = client.should_rate_limit(rls_request(key)).await;
            response.is_ok_and(|r| r.into_inner().overall_code == Code::Ok as i32)
        }
    };
    let http_call = move |key: usize| {
        let (http, base) = (http.clone(), base.clone());
        async move {
            let response = http
                .get(base.as_str())
                .header("x-api-key", format!("k{key}"))
                .send()
                .await;
            response.is_ok_and(|r| r.status() == 200)
        }
    };
    // Every caller provisioned first (both front ends), so the runs measure known callers.
    eprintln!("provisioning {KEYS} callers on each front end ...");
    measure_keys(rls_call.clone(), http_call.clone()).await;
    println!("| front end | calls/s | p50 ms | p90 ms | p99 ms | not admitted |");
    println!("|---|--:|--:|--:|--:|--:|");
    print_row(
        "Envoy RLS (gRPC ShouldRateLimit)",
        &measure(seconds, concurrency, rls_call.clone()).await,
    );
    print_row(
        "HTTP middleware (GET /greeting)",
        &measure(seconds, concurrency, http_call.clone()).await,
    );
    print_row(
        "Envoy RLS, again",
        &measure(seconds, concurrency, rls_call).await,
    );
    print_row(
        "HTTP middleware, again",
        &measure(seconds, concurrency, http_call).await,
    );
}

async fn measure_keys<R, RF, H, HF>(rls: R, http: H)
where
    R: Fn(usize) -> RF + Clone,
    RF: std::future::Future<Output = bool>,
    H: Fn(usize) -> HF + Clone,
    HF: std::future::Future<Output = bool>,
{
    use futures_util::StreamExt;
    futures_util::stream::iter(0..KEYS)
        .for_each_concurrent(64, |key| {
            let (rls, http) = (rls.clone(), http.clone());
            async move {
                rls(key).await;
                http(key).await;
            }
        })
        .await;
}
