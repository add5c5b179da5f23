//! gRPC's health-checking protocol (`grpc.health.v1.Health/Check`) on the Envoy front end's port,
//! as envoyproxy/ratelimit serves it on its own. Why: an Envoy cluster with a
//! `grpc_health_check`, or a Kubernetes `grpc` probe, pointed at a port that answers
//! `UNIMPLEMENTED` marks every host unhealthy (Envoy then stops calling, or, past its panic
//! threshold, calls all the same) or restarts the pods, when the service is up.
//!
//! `SERVING` for the server as a whole (`""`) and for the rate-limit service by name, while the
//! port serves: a stop closes the port to new calls (HTTP/2's GOAWAY), so the check fails then.
//! `Watch`, a stream, is `UNIMPLEMENTED` (Envoy and Kubernetes call `Check`).

use std::convert::Infallible;

use prost::Message;
use tonic::codegen::{http, BoxFuture, Context, Poll, Service, StdError};
use tonic::{Request, Response, Status};

/// The one method served.
const CHECK: &str = "/grpc.health.v1.Health/Check";

/// A check's message is a service's name: a few dozen bytes.
const CHECK_BYTES_MAX: usize = 1024;

/// `grpc.health.v1.HealthCheckRequest`.
#[derive(Clone, PartialEq, Message)]
pub struct HealthCheckRequest {
    #[prost(string, tag = "1")]
    pub service: String,
}

/// `grpc.health.v1.HealthCheckResponse`.
#[derive(Clone, PartialEq, Message)]
pub struct HealthCheckResponse {
    /// `ServingStatus`: 1 is `SERVING`.
    #[prost(int32, tag = "1")]
    pub status: i32,
}

/// `HealthCheckResponse.ServingStatus.SERVING`.
pub const SERVING: i32 = 1;

/// The names a check may ask about: the server's (empty), the rate-limit service's, and
/// `ratelimit`, the one envoyproxy/ratelimit reports its health under (its `NewHealthChecker`),
/// which migrated Envoy clusters and Kubernetes probes ask for: answered `NOT_FOUND`, every host
/// was unhealthy and every readiness probe failed.
const NAMES: [&str; 3] = [
    "",
    "ratelimit",
    <super::wire::WireServer as tonic::server::NamedService>::NAME,
];

/// The health service beside [`super::wire::WireServer`].
#[derive(Clone, Copy, Default)]
pub struct HealthServer;

impl tonic::server::NamedService for HealthServer {
    const NAME: &'static str = "grpc.health.v1.Health";
}

struct Check;

impl tonic::server::UnaryService<HealthCheckRequest> for Check {
    type Response = HealthCheckResponse;
    type Future = BoxFuture<Response<HealthCheckResponse>, Status>;

    fn call(&mut self, request: Request<HealthCheckRequest>) -> Self::Future {
        let known = NAMES.contains(&request.get_ref().service.as_str());
        Box::pin(async move {
            match known {
                true => Ok(Response::new(HealthCheckResponse { status: SERVING })),
                // As the protocol asks of a name the server does not know; never echoed back
                // (a caller's text).
                false => Err(Status::not_found("no such service")),
            }
        })
    }
}

impl<B> Service<http::Request<B>> for HealthServer
where
    B: tonic::codegen::Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Infallible>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        if request.uri().path() != CHECK {
            return Box::pin(async { Ok(Status::unimplemented("").into_http()) });
        }
        Box::pin(async move {
            let codec =
                tonic_prost::ProstCodec::<HealthCheckResponse, HealthCheckRequest>::default();
            let mut grpc = tonic::server::Grpc::new(codec)
                .apply_max_message_size_config(Some(CHECK_BYTES_MAX), None);
            Ok(grpc.unary(Check, request).await)
        })
    }
}
