//! Benchmark: the ledger alone. How many decisions per second one shared TigerBeetle client makes
//! when N submitters each place one pending transfer (a hold) per call, in a loop, for a fixed time.
//! This is the ceiling of admitted traffic through ledger-limiter on this machine, whatever the
//! HTTP layer does.
//!
//!     cargo run --release --example bench_ledger_ceiling -- --ledger-addresses 127.0.0.1:3000 \
//!         [--concurrency 64,512] [--duration 5] [--warmup 1] [--accounts 1024] [--mode library,raw]
//!
//! Modes: `library` goes through `ledger_limiter::ledger::Ledger::hold` (what the limiter does for
//! every admitted request: in-flight bound, a task per call, deadline, metrics); `raw` calls
//! `tigerbeetle_unofficial::Client::create_transfers` with one transfer directly; `lookup` calls
//! `lookup_accounts` for one account (the first read of the limited path). Accounts are
//! provisioned once through `Ledger::provision` on a plan large enough never to be exhausted.
//! Prints one line per run, and a JSON line starting with `RESULT ` for scripts.

use std::num::{NonZeroU32, NonZeroU64, NonZeroUsize};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ledger_limiter::ledger::model::UserAccount;
use ledger_limiter::ledger::{model, HoldReply, Ledger, LedgerSettings};
use tigerbeetle_unofficial as tb;

struct Args {
    addresses: Vec<std::net::SocketAddr>,
    cluster_id: u128,
    concurrency: Vec<usize>,
    duration: Duration,
    warmup: Duration,
    accounts: usize,
    modes: Vec<String>,
}

fn usage() -> ! {
    eprintln!(
        "usage: bench_ledger_ceiling --ledger-addresses HOST:PORT[,..] [--cluster-id 0] \
         [--concurrency 64,512] [--duration SECS] [--warmup SECS] [--accounts N] [--mode library,raw]"
    );
    std::process::exit(2)
}

fn parse_args() -> Args {
    let mut args = Args {
        addresses: vec![],
        cluster_id: 0,
        concurrency: vec![64, 512],
        duration: Duration::from_secs(5),
        warmup: Duration::from_secs(1),
        accounts: 1024,
        modes: vec!["library".into(), "raw".into()],
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let value = it.next().unwrap_or_else(|| usage());
        let secs = |v: &str| Duration::from_secs_f64(v.parse::<f64>().unwrap_or_else(|_| usage()));
        match arg.as_str() {
            "--ledger-addresses" => {
                args.addresses = value
                    .split(',')
                    .map(|a| a.parse().unwrap_or_else(|_| usage()))
                    .collect()
            }
            "--cluster-id" => args.cluster_id = value.parse().unwrap_or_else(|_| usage()),
            "--concurrency" => {
                args.concurrency = value
                    .split(',')
                    .map(|c| c.parse().unwrap_or_else(|_| usage()))
                    .collect()
            }
            "--duration" => args.duration = secs(&value),
            "--warmup" => args.warmup = secs(&value),
            "--accounts" => args.accounts = value.parse().unwrap_or_else(|_| usage()),
            "--mode" => args.modes = value.split(',').map(str::to_owned).collect(),
            _ => usage(),
        }
    }
    if args.addresses.is_empty() || args.accounts == 0 {
        usage()
    }
    args
}

#[derive(Default)]
struct Tally {
    admitted: AtomicU64,
    other: AtomicU64,
    errors: AtomicU64,
}

fn percentile(sorted: &[u32], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    f64::from(sorted[rank.clamp(1, sorted.len()) - 1])
}

/// Runs `concurrency` submitters; each calls `submit(account)` in a loop. Only calls started after
/// the warm-up and before the end count. Returns (decisions/s, p50 µs, p99 µs, tally).
async fn run<F, Fut>(
    concurrency: usize,
    accounts: Arc<Vec<u128>>,
    warmup: Duration,
    duration: Duration,
    submit: F,
) -> (f64, f64, f64, Arc<Tally>)
where
    F: Fn(u128) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<bool, String>> + Send,
{
    let tally = Arc::new(Tally::default());
    let start = Instant::now();
    let measure_from = start + warmup;
    let end = measure_from + duration;
    let mut tasks = Vec::with_capacity(concurrency);
    for submitter in 0..concurrency {
        let submit = submit.clone();
        let accounts = accounts.clone();
        let tally = tally.clone();
        tasks.push(tokio::spawn(async move {
            let mut latencies_us: Vec<u32> = Vec::with_capacity(4096);
            let mut i = submitter;
            loop {
                let t0 = Instant::now();
                if t0 >= end {
                    break;
                }
                let account = accounts[i % accounts.len()];
                i += concurrency;
                let result = submit(account).await;
                if t0 < measure_from {
                    continue;
                }
                latencies_us.push(t0.elapsed().as_micros().min(u128::from(u32::MAX)) as u32);
                match result {
                    Ok(true) => tally.admitted.fetch_add(1, Ordering::Relaxed),
                    Ok(false) => tally.other.fetch_add(1, Ordering::Relaxed),
                    Err(error) => {
                        if tally.errors.fetch_add(1, Ordering::Relaxed) == 0 {
                            eprintln!("first error: {error}");
                        }
                        0
                    }
                };
            }
            latencies_us
        }));
    }
    let mut all = Vec::new();
    for task in tasks {
        all.extend(task.await.expect("submitter task"));
    }
    all.sort_unstable();
    let rate = all.len() as f64 / duration.as_secs_f64();
    (rate, percentile(&all, 50.0), percentile(&all, 99.0), tally)
}

/// The hold window of every transfer placed: long, so that holds expire at the creation rate
/// only after the first minute.
const WINDOW_SECONDS: u32 = 60;

/// Every account the submitters spend from, provisioned on a plan no benchmark can exhaust.
async fn provision_accounts(ledger: &Ledger, count: usize) -> anyhow::Result<Vec<u128>> {
    let capacity = NonZeroU64::new(1 << 60).unwrap();
    let window_seconds = NonZeroU32::new(WINDOW_SECONDS).unwrap();
    let accounts: Vec<u128> = (0..count)
        .map(|i| {
            let key = format!("ceiling-{i}");
            model::user_account_id(ledger.ledger_id(), "ceiling", capacity, key.as_bytes())
        })
        .collect();
    let provisioning = Instant::now();
    let mut provisions = Vec::new();
    for account in accounts.iter().copied() {
        let ledger = ledger.clone();
        let account = UserAccount {
            id: account,
            capacity,
            window_seconds,
        };
        provisions.push(tokio::spawn(async move {
            // The first request of a new client takes ~0.6 s; be generous.
            ledger
                .provision(&account, Instant::now() + Duration::from_secs(30))
                .await
        }));
    }
    for p in provisions {
        p.await??;
    }
    eprintln!(
        "provisioned {} accounts in {:.1} s",
        accounts.len(),
        provisioning.elapsed().as_secs_f64()
    );
    Ok(accounts)
}

/// One run of `mode` at `concurrency` submitters: (decisions/s, p50 µs, p99 µs, tally).
async fn run_mode(
    mode: &str,
    concurrency: usize,
    args: &Args,
    ledger: &Ledger,
    client: &Arc<tb::Client>,
    accounts: &Arc<Vec<u128>>,
) -> anyhow::Result<(f64, f64, f64, Arc<Tally>)> {
    let (warmup, duration) = (args.warmup, args.duration);
    let accounts = accounts.clone();
    Ok(match mode {
        "library" => {
            let ledger = ledger.clone();
            let submit = move |account| {
                let ledger = ledger.clone();
                async move {
                    let deadline = Instant::now() + Duration::from_secs(5);
                    match ledger
                        .hold(account, 1, WINDOW_SECONDS, deadline, false)
                        .await
                    {
                        Ok(HoldReply::Held { .. }) => Ok(true),
                        Ok(_) => Ok(false),
                        Err(e) => Err(e.to_string()),
                    }
                }
            };
            run(concurrency, accounts, warmup, duration, submit).await
        }
        "raw" => {
            let client = client.clone();
            let submit = move |account| {
                let client = client.clone();
                async move {
                    let ledger_id = model::LEDGER_REQUEST_RATE;
                    let transfer = model::hold_transfer(account, ledger_id, 1, WINDOW_SECONDS);
                    match client.create_transfers(vec![transfer]).await {
                        Ok(()) => Ok(true),
                        Err(tb::error::CreateTransfersError::Api(_)) => Ok(false),
                        Err(e) => Err(e.to_string()),
                    }
                }
            };
            run(concurrency, accounts, warmup, duration, submit).await
        }
        "lookup" => {
            // The limited path's first read: one lookup_accounts per call.
            let client = client.clone();
            let submit = move |account| {
                let client = client.clone();
                async move {
                    match client.lookup_accounts(vec![account]).await {
                        Ok(found) => Ok(!found.is_empty()),
                        Err(e) => Err(e.to_string()),
                    }
                }
            };
            run(concurrency, accounts, warmup, duration, submit).await
        }
        other => anyhow::bail!("unknown mode {other:?} (library, raw or lookup)"),
    })
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args = parse_args();
    let ledger = Ledger::connect(&LedgerSettings {
        cluster_id: args.cluster_id,
        addresses: args.addresses.clone(),
        ledger_id: model::LEDGER_REQUEST_RATE,
        in_flight_max: NonZeroUsize::new(65_536).unwrap(),
        batch_linger: std::time::Duration::ZERO,
    })?;
    let accounts = Arc::new(provision_accounts(&ledger, args.accounts).await?);
    let client = Arc::new(tb::Client::new(
        args.cluster_id,
        args.addresses
            .iter()
            .map(|a| a.to_string())
            .collect::<Vec<_>>()
            .join(","),
    )?);
    for mode in &args.modes {
        for &concurrency in &args.concurrency {
            let (rate, p50, p99, tally) =
                run_mode(mode, concurrency, &args, &ledger, &client, &accounts).await?;
            let admitted = tally.admitted.load(Ordering::Relaxed);
            let other = tally.other.load(Ordering::Relaxed);
            let errors = tally.errors.load(Ordering::Relaxed);
            println!(
                "{mode:>7} {concurrency:>4} submitters: {rate:>9.0} decisions/s  p50 {:>6.2} ms  p99 {:>6.2} ms  (held {admitted}, refused {other}, errors {errors})",
                p50 / 1000.0,
                p99 / 1000.0
            );
            println!(
                "RESULT {{\"mode\":\"{mode}\",\"submitters\":{concurrency},\"decisions_per_s\":{rate:.0},\"p50_ms\":{:.3},\"p99_ms\":{:.3},\"held\":{admitted},\"refused\":{other},\"errors\":{errors},\"duration_s\":{}}}",
                p50 / 1000.0,
                p99 / 1000.0,
                args.duration.as_secs_f64()
            );
        }
    }
    Ok(())
}
