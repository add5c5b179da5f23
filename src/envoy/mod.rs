//! The Envoy front end: envoyproxy's `RateLimitService` v3 gRPC API, beside the HTTP adapter, on
//! the same limiter (one ledger client, one local view). Knows gRPC and Envoy's protobufs; the
//! limiter and the ledger know nothing of it.
//!
//! - [`config`]: envoyproxy/ratelimit's YAML rules, strictly read;
//! - [`health`]: gRPC's health check on the same port, as envoyproxy/ratelimit serves it;
//! - [`incoming`]: the connections, bounded in number, accepted with a pause on a shortage;
//! - [`service`]: `ShouldRateLimit`: descriptors → rules → accounts → one linked chain of holds;
//! - [`metrics`]: the decision counters with `frontend="envoy"`;
//! - [`wire`]: the gRPC service, reading the request's strings as bytes.

pub mod config;
pub mod health;
pub mod incoming;
pub mod metrics;
pub mod rules;
pub mod service;
pub mod wire;

use std::future::Future;
use std::num::NonZeroUsize;
use std::time::Duration;

pub use service::RateLimitServer;

/// A request message larger than this is refused (`OUT_OF_RANGE`): 64 descriptors of 16 entries
/// of 256-byte keys and values fit with room to spare. Values have no bound of their own: one
/// header at Envoy's default limit (60 KiB) read into 18 entries passes it (README).
pub const REQUEST_BYTES_MAX: usize = 1 << 20;

/// Calls in flight on one connection, at most. Envoy multiplexes its calls over a few
/// connections; without a bound (tonic's default is none), one peer could hold any number of
/// calls and their buffers.
pub const STREAMS_PER_CONNECTION_MAX: u32 = 1024;

/// Connections open at once by default (`rls.connections_max`): Envoy opens about one per worker
/// thread to each rate-limit service host, so a few hundred proxies fit.
pub const CONNECTIONS_MAX_DEFAULT: usize = 4096;
/// The most `rls.connections_max` may be: each connection is a file descriptor.
pub const CONNECTIONS_MAX_MAX: usize = 1 << 20;

/// Calls in flight at once by default, over every connection (`rls.calls_max`): each may hold a
/// message of up to [`REQUEST_BYTES_MAX`] while it is read, its strings as bytes and as text
/// (the text at most as large, its escapes counted: `wire.rs`), so this bounds their memory
/// (about 3 MiB a call, 12 GiB at most, where Envoy's messages are a few hundred bytes). 4,096
/// calls of 1 ms each are 4 million a second; of a ledger's whole deadline (250 ms), 16,000.
pub const CALLS_MAX_DEFAULT: usize = 4096;
/// The most `rls.calls_max` may be.
pub const CALLS_MAX_MAX: usize = 1 << 20;

/// The bounds of the Envoy front end's work (`rls.connections_max`, `rls.calls_max`).
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    pub connections_max: NonZeroUsize,
    pub calls_max: NonZeroUsize,
}

/// What a call may take beyond the decision's deadline (`ledger.timeout_ms`): its body's arrival
/// and the answer's encoding.
const CALL_SLACK: Duration = Duration::from_secs(1);

/// How often an idle connection is pinged, and how long the answer may take before the
/// connection is closed: a peer that went away (half-open) frees its calls.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves `server` on `listener` (HTTP/2, plaintext), within `bounds`, until `shutdown`
/// completes, then lets calls in flight finish.
pub async fn serve(
    server: RateLimitServer,
    (listener, bounds): (tokio::net::TcpListener, Bounds),
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    let incoming = tonic::transport::server::TcpIncoming::from(listener)
        .with_nodelay(Some(true))
        .with_keepalive(Some(KEEPALIVE_INTERVAL));
    let incoming = incoming::bounded(incoming, bounds.connections_max);
    // A call ends within the decision's deadline and a little more (its body's arrival
    // included): a stream whose body never ends otherwise held its place (and its buffer) for
    // as long as its peer kept the connection alive.
    let call_max = server.decision_timeout() + CALL_SLACK;
    let service = wire::WireServer::new(server, REQUEST_BYTES_MAX, bounds.calls_max);
    tonic::transport::Server::builder()
        .timeout(call_max)
        .max_concurrent_streams(STREAMS_PER_CONNECTION_MAX)
        .http2_keepalive_interval(Some(KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT))
        .add_service(service)
        .add_service(health::HealthServer)
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
}
