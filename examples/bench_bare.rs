//! Benchmark baseline: bare actix-web, `GET /greeting` → "hello", no limiter (the ceiling).
//!
//!     cargo run --release --example bench_bare -- [LISTEN_ADDR]
//!
//! The listen address comes from the first argument, else `BENCH_LISTEN`, else `127.0.0.1:0` (a free
//! port). Prints `listening on port N` to stderr once bound, like the `ledger-limiter` binary. Runs
//! the same number of workers as the limiter's bench configuration (`BENCH_WORKERS`, default 2).
//! See `scripts/bench`.

use std::net::TcpListener;

use actix_web::{web, App, HttpResponse, HttpServer};

fn listen_address() -> String {
    std::env::args()
        .nth(1)
        .or_else(|| std::env::var("BENCH_LISTEN").ok())
        .unwrap_or_else(|| "127.0.0.1:0".to_owned())
}

fn workers() -> usize {
    std::env::var("BENCH_WORKERS")
        .ok()
        .and_then(|w| w.parse().ok())
        .unwrap_or(2)
}

async fn greeting() -> HttpResponse {
    HttpResponse::Ok().content_type("text/plain").body("hello")
}

/// The bytes of ledger-limiter's 429 (same headers and body), served statically: the floor for
/// answering a refusal at all (`BENCH_BARE_REFUSAL=1`).
async fn refusal() -> HttpResponse {
    HttpResponse::TooManyRequests()
        .insert_header(("ratelimit-policy", "\"abuse\";q=100;w=10"))
        .insert_header(("retry-after", "8"))
        .insert_header(("ratelimit", "\"abuse\";r=0;t=11"))
        .content_type("application/problem+json")
        .body(REFUSAL_BODY)
}

const REFUSAL_BODY: &str = r#"{"type":"urn:ledger-limiter:problem:rate-limited","title":"Rate limit exceeded","status":429,"detail":"plan abuse allows 100 units per 10 s; retry after 8 s"}"#;

#[actix_web::main]
async fn main() -> std::io::Result<()> {
    let listener = TcpListener::bind(listen_address())?;
    let port = listener.local_addr()?.port();
    let refuse = std::env::var("BENCH_BARE_REFUSAL").is_ok_and(|v| v == "1");
    let server = HttpServer::new(move || {
        if refuse {
            App::new().route("/greeting", web::get().to(refusal))
        } else {
            App::new().route("/greeting", web::get().to(greeting))
        }
    })
    .workers(workers())
    .listen(listener)?
    .run();
    eprintln!("listening on port {port}");
    server.await
}
