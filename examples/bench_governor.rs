//! Benchmark comparison: actix-web with an in-memory `governor` limiter (GCRA) keyed by the
//! `X-Api-Key` header, one keyed limiter per plan of the bench configuration: a plan of `capacity`
//! per `window` becomes a burst of `capacity` refilling one request every `window / capacity`.
//! 429 with `Retry-After` when limited, 401 without a key; the same IETF `RateLimit` fields as
//! ledger-limiter on every limited-path response.
//!
//!     cargo run --release --example bench_governor -- --config bench.toml [--listen ADDR]
//!
//! Prints `listening on port N` to stderr once bound. See `scripts/bench`.

#[path = "bench_support/mod.rs"]
mod bench_support;

use std::future::ready;
use std::num::NonZeroU32;
use std::sync::Arc;

use actix_web::dev::Service;
use actix_web::http::header::{HeaderName, HeaderValue, RETRY_AFTER};
use actix_web::{web, App, HttpResponse, HttpServer};
use bench_support::{BenchPlan, BenchPlans, KEY_HEADER};
use futures_util::future::Either;
use governor::clock::{Clock, DefaultClock};
use governor::middleware::StateInformationMiddleware;
use governor::state::keyed::DefaultKeyedStateStore;
use governor::{Quota, RateLimiter};

const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

type KeyedLimiter =
    RateLimiter<String, DefaultKeyedStateStore<String>, DefaultClock, StateInformationMiddleware>;

enum Verdict {
    /// Admitted: the `RateLimit-Policy` and `RateLimit` values to send.
    Admit {
        policy: HeaderValue,
        state: HeaderValue,
    },
    Refuse(HttpResponse),
}

struct Limits {
    plans: BenchPlans,
    /// One keyed limiter per plan, in the order of `plans.plans`.
    limiters: Vec<KeyedLimiter>,
    clock: DefaultClock,
}

fn quota(plan: &BenchPlan) -> Quota {
    let burst = u32::try_from(plan.capacity).unwrap_or(u32::MAX);
    let burst = NonZeroU32::new(burst).expect("capacity is at least 1");
    let period = plan.window / burst.get();
    Quota::with_period(period.max(std::time::Duration::from_nanos(1)))
        .expect("a non-zero period")
        .allow_burst(burst)
}

impl Limits {
    fn new(plans: BenchPlans) -> Self {
        let limiters = plans
            .plans
            .iter()
            .map(|plan| {
                RateLimiter::keyed(quota(plan)).with_middleware::<StateInformationMiddleware>()
            })
            .collect();
        Limits {
            plans,
            limiters,
            clock: DefaultClock::default(),
        }
    }

    /// The headers to add when admitted, or the refusal.
    fn check(&self, key: Option<&HeaderValue>) -> Verdict {
        let key = match key.map(|k| k.to_str()) {
            Some(Ok(key)) if !key.is_empty() => key,
            _ => {
                return Verdict::Refuse(
                    HttpResponse::Unauthorized()
                        .content_type("text/plain")
                        .body("missing X-Api-Key"),
                )
            }
        };
        let index = self.plans.plan_for_key(key);
        let plan = &self.plans.plans[index];
        let policy = HeaderValue::from_str(&bench_support::ratelimit_policy(plan)).expect("ascii");
        match self.limiters[index].check_key(&key.to_owned()) {
            Ok(snapshot) => {
                let remaining = u64::from(snapshot.remaining_burst_capacity());
                let used = plan.capacity.saturating_sub(remaining);
                // Time until the bucket is full again.
                let reset = (plan.window.as_secs_f64() * used as f64 / plan.capacity as f64).ceil();
                let state = bench_support::ratelimit(plan, remaining, reset as u64);
                Verdict::Admit {
                    policy,
                    state: HeaderValue::from_str(&state).expect("ascii"),
                }
            }
            Err(not_until) => {
                let wait = not_until.wait_time_from(self.clock.now());
                let retry_after = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
                let retry_after = retry_after.max(1);
                let state = bench_support::ratelimit(plan, 0, retry_after);
                Verdict::Refuse(
                    HttpResponse::TooManyRequests()
                        .insert_header((RATELIMIT_POLICY, policy))
                        .insert_header((RATELIMIT, state))
                        .insert_header((RETRY_AFTER, retry_after))
                        .content_type("text/plain")
                        .body(format!("rate limited; retry after {retry_after} s")),
                )
            }
        }
    }
}

async fn greeting() -> HttpResponse {
    HttpResponse::Ok().content_type("text/plain").body("hello")
}

#[actix_web::main]
async fn main() -> std::io::Result<()> {
    let args = bench_support::args();
    let limits = Arc::new(Limits::new(bench_support::load_plans(&args)));
    let (listener, port) = bench_support::bind(&args.listen)?;
    let server = HttpServer::new(move || {
        let limits = limits.clone();
        App::new()
            .wrap_fn(
                move |req, srv| match limits.check(req.headers().get(KEY_HEADER)) {
                    Verdict::Admit { policy, state } => {
                        let call = srv.call(req);
                        Either::Left(async move {
                            let mut response = call.await?;
                            let headers = response.headers_mut();
                            headers.insert(RATELIMIT_POLICY, policy);
                            headers.insert(RATELIMIT, state);
                            Ok(response)
                        })
                    }
                    Verdict::Refuse(refusal) => {
                        Either::Right(ready(Ok(req.into_response(refusal))))
                    }
                },
            )
            .route("/greeting", web::get().to(greeting))
    })
    .workers(args.workers)
    .listen(listener)?
    .run();
    eprintln!("listening on port {port}");
    server.await
}
