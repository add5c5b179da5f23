//! The demo service's handlers.

use std::time::{Duration, Instant};

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
/// How long one probe's answer is given again: `/readyz` is unauthenticated, so a flood of it is
/// at most two ledger reads a second instead of one per request, each taking a permit decisions
/// need when the ledger is slow.
pub const READY_REUSE: Duration = Duration::from_millis(500);

/// The last readiness probe, shared by every worker; one probe runs at a time, and requests
/// that come meanwhile wait for its answer (at most [`READY_TIMEOUT`]).
#[derive(Default)]
pub struct Readiness {
    last: tokio::sync::Mutex<Option<(Instant, Result<(), String>)>>,
}

impl Readiness {
    /// Whether the ledger answers: a probe at most every [`READY_REUSE`].
    pub async fn check(&self, limiter: &Limiter) -> Result<(), String> {
        let mut last = self.last.lock().await;
        if let Some((probed_at, answer)) = last.as_ref() {
            if probed_at.elapsed() < READY_REUSE {
                return answer.clone();
            }
        }
        let answer = limiter
            .ready(READY_TIMEOUT)
            .await
            .map_err(|e| e.to_string());
        *last = Some((Instant::now(), answer.clone()));
        answer
    }
}

/// Readiness: the ledger answered within [`READY_TIMEOUT`], at most [`READY_REUSE`] ago.
pub async fn readyz(
    limiter: web::Data<Limiter>,
    readiness: web::Data<Readiness>,
) -> impl Responder {
    match readiness.check(&limiter).await {
        Ok(()) => HttpResponse::Ok().content_type("text/plain").body("ready"),
        Err(error) => HttpResponse::ServiceUnavailable()
            .content_type("text/plain")
            .body(format!("ledger not ready: {error}")),
    }
}
