//! The Envoy front end: envoyproxy's `RateLimitService` v3 gRPC API, beside the HTTP adapter, on
//! the same limiter (one ledger client, one local view). Knows gRPC and Envoy's protobufs; the
//! limiter and the ledger know nothing of it.
//!
//! - [`config`]: envoyproxy/ratelimit's YAML rules, strictly read;
//! - [`service`]: `ShouldRateLimit`: descriptors → rules → accounts → one linked chain of holds;
//! - [`metrics`]: the decision counters with `frontend="envoy"`.

pub mod config;
pub mod metrics;
pub mod service;

use std::future::Future;

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitServiceServer;
pub use service::RateLimitServer;

/// A request message larger than this is refused (`RESOURCE_EXHAUSTED`): 64 descriptors of 16
/// entries of 256-byte keys and values fit with room to spare.
pub const REQUEST_BYTES_MAX: usize = 1 << 20;

/// Serves `server` on `listener` (HTTP/2, plaintext) until `shutdown` completes, then lets calls in
/// flight finish.
pub async fn serve(
    server: RateLimitServer,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    let service = RateLimitServiceServer::new(server).max_decoding_message_size(REQUEST_BYTES_MAX);
    tonic::transport::Server::builder()
        .add_service(service)
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
}
