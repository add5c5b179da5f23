//! Benchmark comparison: actix-web with `actix-extensible-rate-limit` and its Redis backend (a
//! fixed window per key: one atomic BITFIELD/EXPIRE/TTL pipeline per request over one multiplexed
//! connection), keyed by the `X-Api-Key` header, with each plan of the bench configuration as
//! `capacity` requests per `window`. 429 when limited (the crate's `add_headers()` responses), 401
//! without a key, 500 when Redis fails (the crate's default: fail closed).
//!
//!     cargo run --release --example bench_redis -- --config bench.toml --redis redis://127.0.0.1:6379/ [--listen ADDR]
//!
//! Prints `listening on port N` to stderr once bound. See `scripts/bench`, which starts a
//! `redis-server` with persistence off on a free loopback port.

#[path = "bench_support/mod.rs"]
mod bench_support;

use std::future::{ready, Ready};
use std::sync::Arc;

use actix_extensible_rate_limit::backend::redis::RedisBackend;
use actix_extensible_rate_limit::backend::SimpleInput;
use actix_extensible_rate_limit::RateLimiter;
use actix_web::dev::ServiceRequest;
use actix_web::{web, App, HttpResponse, HttpServer};
use bench_support::{BenchPlans, KEY_HEADER};
use redis::aio::ConnectionManager;

async fn greeting() -> HttpResponse {
    HttpResponse::Ok().content_type("text/plain").body("hello")
}

/// The rate-limit input of a request: its key, and its plan's window and capacity.
fn input(plans: &BenchPlans, req: &ServiceRequest) -> Ready<Result<SimpleInput, actix_web::Error>> {
    let key = match req.headers().get(KEY_HEADER).map(|k| k.to_str()) {
        Some(Ok(key)) if !key.is_empty() => key,
        _ => {
            return ready(Err(actix_web::error::ErrorUnauthorized(
                "missing X-Api-Key",
            )))
        }
    };
    let plan = &plans.plans[plans.plan_for_key(key)];
    ready(Ok(SimpleInput {
        interval: plan.window,
        max_requests: plan.capacity,
        // The plan is part of the key, as ledger-limiter's account id includes it.
        key: format!("{}:{key}", plan.name),
    }))
}

#[actix_web::main]
async fn main() -> std::io::Result<()> {
    let args = bench_support::args();
    let plans = Arc::new(bench_support::load_plans(&args));
    let Some(url) = args.redis_url.clone() else {
        eprintln!("--redis URL (e.g. redis://127.0.0.1:6379/) is required");
        std::process::exit(2)
    };
    let client = redis::Client::open(url.as_str()).map_err(std::io::Error::other)?;
    let manager = ConnectionManager::new(client)
        .await
        .map_err(std::io::Error::other)?;
    let backend = RedisBackend::builder(manager)
        .key_prefix(Some("bench:"))
        .build();
    let (listener, port) = bench_support::bind(&args.listen)?;
    let server = HttpServer::new(move || {
        let plans = plans.clone();
        let limiter = RateLimiter::builder(backend.clone(), move |req: &ServiceRequest| {
            input(&plans, req)
        })
        .add_headers()
        .build();
        App::new()
            .wrap(limiter)
            .route("/greeting", web::get().to(greeting))
    })
    .workers(args.workers)
    .listen(listener)?
    .run();
    eprintln!("listening on port {port}");
    server.await
}
