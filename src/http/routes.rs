//! The demo service's handlers.

use std::time::Duration;

use actix_web::{web, HttpResponse, Responder};

use crate::limiter::Limiter;

/// The rate-limited demo endpoint.
pub async fn greeting() -> impl Responder {
    HttpResponse::Ok().content_type("text/plain").body("hello")
}

/// Liveness: the process serves HTTP.
pub async fn healthz() -> impl Responder {
    HttpResponse::Ok().content_type("text/plain").body("ok")
}

/// How long `/readyz` waits for the ledger.
pub const READY_TIMEOUT: Duration = Duration::from_secs(1);

/// Readiness: the ledger answers within [`READY_TIMEOUT`].
pub async fn readyz(limiter: web::Data<Limiter>) -> impl Responder {
    match limiter.ready(READY_TIMEOUT).await {
        Ok(()) => HttpResponse::Ok().content_type("text/plain").body("ready"),
        Err(error) => HttpResponse::ServiceUnavailable()
            .content_type("text/plain")
            .body(format!("ledger not ready: {error}")),
    }
}
