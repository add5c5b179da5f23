//! The demo service's handlers.

use std::time::{Duration, Instant};

use actix_web::{web, HttpResponse, Responder};

use crate::ledger::embedded::GaveUp;
use crate::limiter::Limiter;

/// The rate-limited demo endpoint.
pub async fn greeting() -> impl Responder {
    HttpResponse::Ok().content_type("text/plain").body("hello")
}

/// Liveness: the process serves HTTP, and its embedded ledger (if it has one) has not been given
/// up on: a process without its ledger for good is better restarted whole.
pub async fn healthz(embedded: Option<web::Data<GaveUp>>) -> impl Responder {
    if embedded.is_some_and(|gave_up| gave_up.is_set()) {
        let body = "the embedded ledger kept exiting and is not restarted any more";
        return HttpResponse::ServiceUnavailable()
            .content_type("text/plain")
            .body(body);
    }
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
    /// A stop began: not ready, whatever the ledger says ([`Readiness::stop`]).
    stopping: std::sync::atomic::AtomicBool,
}

impl Readiness {
    /// A stop began: `/readyz` answers 503 from now on, so that a load balancer stops sending
    /// before the server stops taking connections (`drain_delay_seconds`).
    pub fn stop(&self) {
        (self.stopping).store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether a stop began.
    pub fn stopping(&self) -> bool {
        self.stopping.load(std::sync::atomic::Ordering::Relaxed)
    }

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
    if readiness.stopping() {
        return HttpResponse::ServiceUnavailable()
            .content_type("text/plain")
            .body("stopping");
    }
    match readiness.check(&limiter).await {
        Ok(()) => HttpResponse::Ok().content_type("text/plain").body("ready"),
        Err(error) => HttpResponse::ServiceUnavailable()
            .content_type("text/plain")
            .body(format!("ledger not ready: {error}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use actix_web::{test, App};

    #[actix_web::test]
    async fn healthz_fails_once_the_embedded_ledger_is_given_up_on() {
        let get = || test::TestRequest::get().uri("/healthz").to_request();
        let gave_up = GaveUp::default();
        let app = App::new()
            .app_data(web::Data::new(gave_up.clone()))
            .route("/healthz", web::get().to(healthz));
        let app = test::init_service(app).await;
        assert_eq!(test::call_service(&app, get()).await.status(), 200);
        gave_up.set_for_tests();
        assert_eq!(test::call_service(&app, get()).await.status(), 503);
        // Without the flag registered (a library user's app): alive.
        let bare = test::init_service(App::new().route("/healthz", web::get().to(healthz))).await;
        assert_eq!(test::call_service(&bare, get()).await.status(), 200);
    }
}
