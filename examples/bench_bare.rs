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

#[actix_web::main]
async fn main() -> std::io::Result<()> {
    let listener = TcpListener::bind(listen_address())?;
    let port = listener.local_addr()?.port();
    let server = HttpServer::new(|| App::new().route("/greeting", web::get().to(greeting)))
        .workers(workers())
        .listen(listener)?
        .run();
    eprintln!("listening on port {port}");
    server.await
}
