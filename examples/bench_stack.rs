//! What the service's own code costs per request, without sockets, wrk or the kernel: the
//! `ledger-limiter` stack (rate limit, HTTP metrics with exemplars, routing, the handler) against
//! a bare app with the same route, each called in-process through actix's service API on one
//! thread, in alternating rounds. Prints nanoseconds per request for:
//!
//! - `bare`: the route alone (the request's construction is in every row);
//! - `refused`: a caller over its limit, refused from the local view (the abusive workload);
//! - `leased`: a hot caller on a lease plan, admitted from its lease (the hot workload);
//! - `refused_many`: 10,000 callers over their limits in turn, each refused from the local view:
//!   what the per-caller state costs when each caller's entries were last touched 10,000
//!   requests before (the admitted workload's pattern, without the ledger).
//!
//! Then the heap allocations a request makes on each path, and on the admitted path (1,000
//! callers in turn on a plan of one transfer per request, each request a ledger round trip): a
//! count, unlike a time, does not move with a shared machine's noise.
//!
//! Run it:
//!
//!     cargo run --release --example bench_stack             # a development-mode TigerBeetle
//!     BENCH_REQUESTS=200000 BENCH_ROUNDS=5 cargo run --release --example bench_stack
//!
//! The timed rows touch the ledger only while warming up (the first 100 holds of the refused
//! caller, the units and the refusal of each of the many, the leases of the hot one), so a
//! development-mode ledger is fine here; the admitted path's count is of allocations, not time.
//! The sockets' share of a request is in `scripts/bench`'s figures; this one isolates what our
//! code adds to it.

use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use actix_web::dev::{Service, ServiceResponse};
use actix_web::{test, web, App, HttpResponse};
use ledger_limiter::config::{FileConfig, Settings};
use ledger_limiter::http::request_metrics::{HttpMetrics, RecordHttpMetrics};
use ledger_limiter::http::RateLimit;
use ledger_limiter::ledger::Ledger;
use ledger_limiter::limiter::caller::CallerKey;
use ledger_limiter::limiter::{Limiter, Outcome};

/// Heap allocations (and reallocations) so far, by every thread of this process.
static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

/// The service's allocator (mimalloc, as `src/main.rs` sets it), counting allocations.
struct Counting;

// SAFETY: every call is passed on unchanged to mimalloc, a correct allocator; the count is a
// relaxed atomic add with no effect on the memory returned.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract for `alloc` is mimalloc's.
        unsafe { mimalloc::MiMalloc.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from mimalloc through this allocator, with `layout`.
        unsafe { mimalloc::MiMalloc.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: `ptr` came from mimalloc through this allocator, with `layout`.
        unsafe { mimalloc::MiMalloc.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn one() -> std::num::NonZeroU64 {
    std::num::NonZeroU64::MIN
}

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

const CONFIG: &str = r#"
workers = 1
default_plan = "abuse"
[embedded]
data_dir = "DATA_DIR"
tigerbeetle_bin = ".tools/tigerbeetle"
development = true
[plans.abuse]
capacity = 100
window_seconds = 60
[plans.hot]
capacity = 1000000000
window_seconds = 5
lease_units_max = 200000
lease_seconds = 1
[plans.admit]
capacity = 1000000000
window_seconds = 5
[plans.one]
capacity = 1
window_seconds = 60
[key_prefixes]
"hot_" = "hot"
"one_" = "one"
"admit_" = "admit"
[routes.costs]
"/greeting" = 1
"#;

async fn greeting() -> HttpResponse {
    HttpResponse::Ok().content_type("text/plain").body("hello")
}

/// Sends `GET /greeting` as `key`; the answer must be `status`.
async fn call_as<S, B>(app: &S, key: &str, status: u16)
where
    S: Service<actix_http::Request, Response = ServiceResponse<B>, Error = actix_web::Error>,
{
    let request = test::TestRequest::get()
        .uri("/greeting")
        .insert_header(("x-api-key", key))
        .to_request();
    let response = app.call(request).await.expect("a response");
    assert_eq!(response.status().as_u16(), status, "{key}");
}

/// ns per request over `requests` calls with `key`, all of which must answer `status`.
async fn measure<S, B>(app: &S, key: &str, status: u16, requests: usize) -> f64
where
    S: Service<actix_http::Request, Response = ServiceResponse<B>, Error = actix_web::Error>,
{
    measure_keys(app, &[key], status, requests).await
}

/// Callers of the `refused_many` row.
const MANY_CALLERS: usize = 10_000;

/// ns per request over `requests` calls, with `keys` in turn, all of which must answer `status`.
async fn measure_keys<S, B, K>(app: &S, keys: &[K], status: u16, requests: usize) -> f64
where
    S: Service<actix_http::Request, Response = ServiceResponse<B>, Error = actix_web::Error>,
    K: AsRef<str>,
{
    let started = Instant::now();
    for key in keys.iter().cycle().take(requests) {
        call_as(app, key.as_ref(), status).await;
    }
    started.elapsed().as_nanos() as f64 / requests as f64
}

/// Heap allocations per request over `requests` calls, with `keys` in turn.
async fn allocations_per_request<S, B, K>(app: &S, keys: &[K], status: u16, requests: usize) -> f64
where
    S: Service<actix_http::Request, Response = ServiceResponse<B>, Error = actix_web::Error>,
    K: AsRef<str>,
{
    let before = ALLOCATIONS.load(Ordering::Relaxed);
    measure_keys(app, keys, status, requests).await;
    (ALLOCATIONS.load(Ordering::Relaxed) - before) as f64 / requests as f64
}

/// Spends each caller's one unit on the ledger, then has the ledger refuse it once (which the
/// local view then knows): 256 callers at a time.
async fn exhaust<S, B>(app: &S, keys: &[String])
where
    S: Service<actix_http::Request, Response = ServiceResponse<B>, Error = actix_web::Error>,
{
    for status in [200, 429] {
        for chunk in keys.chunks(256) {
            let calls = chunk.iter().map(|key| call_as(app, key, status));
            futures_util::future::join_all(calls).await;
        }
    }
}

/// A decision's future is moved (copied) at each level on every request: its size is part of
/// what a request costs, and the ledger's paths are boxed to keep it small.
fn print_future_sizes(limiter: &Limiter) {
    let key = CallerKey::from_header_value("x-api-key", b"abuse_1", 64).expect("a valid key");
    let check = std::mem::size_of_val(&limiter.check(&key, one()));
    let check_with = std::mem::size_of_val(&limiter.check_with(&key, one(), &[]));
    println!("future bytes: Limiter::check {check}, Limiter::check_with {check_with}");
}

fn settings(data_dir: &std::path::Path) -> Settings {
    let path = data_dir.join("bench.toml");
    let text = CONFIG.replace("DATA_DIR", &data_dir.join("ledger").display().to_string());
    std::fs::write(&path, text).expect("write the configuration");
    FileConfig::load(&path)
        .and_then(Settings::with_overrides)
        .expect("a valid configuration")
}

/// The embedded ledger `settings` name, and a limiter on it.
async fn start(
    settings: &Settings,
) -> anyhow::Result<(
    ledger_limiter::ledger::embedded::EmbeddedLedger,
    Arc<Limiter>,
)> {
    let ledger_location = settings.ledger.clone();
    let ledger_limiter::config::LedgerLocation::Embedded {
        data_dir,
        tigerbeetle_bin,
        development,
    } = ledger_location
    else {
        unreachable!("the configuration above embeds the ledger")
    };
    let embedded = ledger_limiter::ledger::embedded::EmbeddedLedger::start(
        ledger_limiter::ledger::embedded::EmbeddedOptions {
            bin: tigerbeetle_bin,
            data_dir,
            cluster_id: settings.cluster_id,
            development,
        },
    )
    .await?;
    let ledger = Ledger::connect(&settings.ledger_settings(vec![embedded.address()]))?;
    let limiter = Arc::new(Limiter::new(
        ledger,
        settings.plans.clone(),
        settings.limiter.clone(),
    ));
    Ok((embedded, limiter))
}

/// Prints the least and the median over rounds of each column: bare's cost, then what each row adds.
fn report(rows: &[[f64; 4]]) {
    // The machine is shared: the least of the rounds is the best estimate of the code's own cost,
    // the median says how noisy the rounds were.
    let summary = |column: usize| {
        let mut values: Vec<f64> = rows.iter().map(|row| row[column]).collect();
        values.sort_by(f64::total_cmp);
        (values[0], values[values.len() / 2])
    };
    let (bare_min, bare_median) = summary(0);
    let (refused_min, refused_median) = summary(1);
    let (leased_min, leased_median) = summary(2);
    let (many_min, many_median) = summary(3);
    println!(
        "RESULT {{\"bare_ns\":[{bare_min:.0},{bare_median:.0}],\"refused_added_ns\":[{refused_min:.0},{refused_median:.0}],\"leased_added_ns\":[{leased_min:.0},{leased_median:.0}],\"refused_many_added_ns\":[{many_min:.0},{many_median:.0}]}} (least, median)"
    );
}

/// Prints the heap allocations a request makes on each row's path, and on the admitted path.
async fn print_allocations<S, T, B, C>(bare: &S, limited: &T, many: &[String], requests: usize)
where
    S: Service<actix_http::Request, Response = ServiceResponse<B>, Error = actix_web::Error>,
    T: Service<actix_http::Request, Response = ServiceResponse<C>, Error = actix_web::Error>,
{
    let admitted: Vec<String> = (0..1_000).map(|n| format!("admit_{n:04}")).collect();
    measure_keys(limited, &admitted, 200, admitted.len()).await; // provisions each caller
    let allocations = [
        allocations_per_request(bare, &["bare_00001"], 200, requests).await,
        allocations_per_request(limited, &["abuse_00001"], 429, requests).await,
        allocations_per_request(limited, &["hot_00001"], 200, requests).await,
        allocations_per_request(limited, many, 429, requests).await,
        allocations_per_request(limited, &admitted, 200, 2 * admitted.len()).await,
    ];
    let [bare_a, refused_a, leased_a, many_a, admitted_a] = allocations;
    println!(
        "ALLOCATIONS per request: bare {bare_a:.2}, refused {refused_a:.2}, leased {leased_a:.2}, refused_many {many_a:.2}, admitted {admitted_a:.2}"
    );
}

#[actix_web::main]
async fn main() -> anyhow::Result<()> {
    let requests = env_or("BENCH_REQUESTS", 100_000);
    let rounds = env_or("BENCH_ROUNDS", 5);
    let dir = tempfile::tempdir()?;
    let settings = settings(dir.path());
    let (embedded, limiter) = start(&settings).await?;
    ledger_limiter::limiter::lease::spawn_settler(&limiter);
    print_future_sizes(&limiter);
    let metrics = Arc::new(HttpMetrics::new());
    let limited = test::init_service(
        App::new().service(
            web::resource("/greeting")
                .wrap(RateLimit::new(limiter.clone(), settings.rules.clone()))
                .wrap(RecordHttpMetrics::new(Some(metrics)))
                .route(web::get().to(greeting)),
        ),
    )
    .await;
    let bare = test::init_service(App::new().route("/greeting", web::get().to(greeting))).await;

    // Warm up: the ledger's first answer (a new client's first request is slow), then the refused
    // caller spends its 100 units on the ledger and the hot one takes leases.
    for _ in 0..100 {
        if limiter
            .check(
                &CallerKey::from_header_value("x-api-key", b"probe", 128)?,
                one(),
            )
            .await
            .is_ok_and(|d| d.outcome == Outcome::Admitted)
        {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    measure(&limited, "abuse_00001", 200, 100).await;
    measure(&limited, "abuse_00001", 429, 1_000).await;
    measure(&limited, "hot_00001", 200, requests / 10).await;
    measure(&bare, "bare_00001", 200, requests / 10).await;
    let many: Vec<String> = (0..MANY_CALLERS).map(|n| format!("one_{n:05}")).collect();
    exhaust(&limited, &many).await;
    measure_keys(&limited, &many, 429, MANY_CALLERS).await;

    println!("round | bare ns | refused ns | leased ns | refused_many ns | refused − bare | leased − bare | refused_many − bare");
    let mut rows = Vec::new();
    for round in 1..=rounds {
        let bare_ns = measure(&bare, "bare_00001", 200, requests).await;
        let refused_ns = measure(&limited, "abuse_00001", 429, requests).await;
        let leased_ns = measure(&limited, "hot_00001", 200, requests).await;
        let many_ns = measure_keys(&limited, &many, 429, requests).await;
        let row = [
            bare_ns,
            refused_ns - bare_ns,
            leased_ns - bare_ns,
            many_ns - bare_ns,
        ];
        let [_, refused_added, leased_added, many_added] = row;
        println!(
            "{round} | {bare_ns:.0} | {refused_ns:.0} | {leased_ns:.0} | {many_ns:.0} | {refused_added:.0} | {leased_added:.0} | {many_added:.0}"
        );
        rows.push(row);
    }
    report(&rows);
    print_allocations(&bare, &limited, &many, requests).await;
    drop(embedded);
    Ok(())
}
