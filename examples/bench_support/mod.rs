//! Shared by the comparison servers of `scripts/bench` (`bench_governor`, `bench_redis`): the
//! command line, and the plans read from the same TOML file the bench passes to `ledger-limiter`,
//! through the library's own configuration and plan rules, so every limiter enforces the same
//! quotas on the same keys.

#![allow(dead_code)] // each example uses a different part of this module

use std::net::TcpListener;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use ledger_limiter::config::{FileConfig, Settings};
use ledger_limiter::limiter::plan::PlanBook;

/// The header that names the caller, as in the bench configuration of ledger-limiter.
pub const KEY_HEADER: &str = "x-api-key";

/// A quota: `capacity` requests per `window`.
#[derive(Debug, Clone)]
pub struct BenchPlan {
    pub name: String,
    pub capacity: u64,
    pub window: Duration,
}

/// The plans and the key → plan rules.
#[derive(Debug, Clone)]
pub struct BenchPlans {
    pub plans: Vec<BenchPlan>,
    book: Arc<PlanBook>,
}

impl BenchPlans {
    /// Reads and validates the file exactly as `ledger-limiter --config FILE` does.
    pub fn load(path: &std::path::Path) -> Result<Self, String> {
        let settings = FileConfig::load(path)
            .and_then(Settings::with_overrides)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        let plans = settings
            .plans
            .plans()
            .iter()
            .map(|plan| BenchPlan {
                name: plan.name().to_owned(),
                capacity: plan.capacity().get(),
                window: Duration::from_secs(plan.window_seconds().get().into()),
            })
            .collect();
        Ok(BenchPlans {
            plans,
            book: settings.plans,
        })
    }

    /// The index (into `plans`) of the plan for `key`: the library's rule (listed keys, longest
    /// prefix, default plan; an unknown key that would be refused counts on the default plan).
    pub fn plan_for_key(&self, key: &str) -> usize {
        self.book
            .plan_for_key(key)
            .unwrap_or(self.book.default_plan())
            .index()
    }
}

/// `EXAMPLE [--listen ADDR] [--workers N] --config FILE [--redis URL]`; each flag also reads
/// `BENCH_LISTEN`, `BENCH_WORKERS`, `BENCH_CONFIG`, `BENCH_REDIS_URL`.
#[derive(Debug)]
pub struct Args {
    pub listen: String,
    pub workers: usize,
    pub config: PathBuf,
    pub redis_url: Option<String>,
}

pub fn args() -> Args {
    let mut listen = std::env::var("BENCH_LISTEN").unwrap_or_else(|_| "127.0.0.1:0".to_owned());
    let mut workers = std::env::var("BENCH_WORKERS")
        .ok()
        .and_then(|w| w.parse().ok())
        .unwrap_or(2);
    let mut config = std::env::var_os("BENCH_CONFIG").map(PathBuf::from);
    let mut redis_url = std::env::var("BENCH_REDIS_URL").ok();
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = |name: &str| {
            it.next().unwrap_or_else(|| {
                eprintln!("{name} needs a value");
                std::process::exit(2)
            })
        };
        match arg.as_str() {
            "--listen" => listen = value("--listen"),
            "--workers" => {
                workers = value("--workers").parse().unwrap_or_else(|_| {
                    eprintln!("--workers takes a number");
                    std::process::exit(2)
                })
            }
            "--config" => config = Some(PathBuf::from(value("--config"))),
            "--redis" => redis_url = Some(value("--redis")),
            other => {
                eprintln!("unknown argument {other:?}; usage: [--listen ADDR] [--workers N] --config FILE [--redis URL]");
                std::process::exit(2)
            }
        }
    }
    let Some(config) = config else {
        eprintln!("--config FILE (the bench TOML with [plans] and [key_prefixes]) is required");
        std::process::exit(2)
    };
    Args {
        listen,
        workers,
        config,
        redis_url,
    }
}

pub fn bind(listen: &str) -> std::io::Result<(TcpListener, u16)> {
    let listener = TcpListener::bind(listen)?;
    let port = listener.local_addr()?.port();
    Ok((listener, port))
}

pub fn load_plans(args: &Args) -> BenchPlans {
    BenchPlans::load(&args.config).unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(2)
    })
}

/// The draft IETF fields ledger-limiter sends, so every server writes comparable responses.
pub fn ratelimit_policy(plan: &BenchPlan) -> String {
    format!(
        "\"{}\";q={};w={}",
        plan.name,
        plan.capacity,
        plan.window.as_secs()
    )
}

pub fn ratelimit(plan: &BenchPlan, remaining: u64, reset_seconds: u64) -> String {
    format!("\"{}\";r={remaining};t={reset_seconds}", plan.name)
}
