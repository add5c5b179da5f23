//! HTTP request latency with trace exemplars, in OpenMetrics text.
//!
//! `metrics-exporter-prometheus` cannot emit exemplars (metrics-rs/metrics#175), so this one
//! histogram lives in a `prometheus-client` registry served on its own path
//! (`/metrics/exemplars`). An exemplar is attached only when the request's trace is sampled, so
//! every exemplar leads to a trace that was exported.

use std::cell::RefCell;
use std::collections::HashMap;
use std::future::{ready, Ready};
use std::rc::Rc;
use std::sync::Arc;
use std::time::Instant;

use actix_web::dev::{forward_ready, Service, ServiceRequest, ServiceResponse, Transform};
use actix_web::http::Method;
use actix_web::{Error, HttpRequest};
use futures_util::future::LocalBoxFuture;
use opentelemetry::trace::TraceContextExt;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::exemplar::HistogramWithExemplars;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use tracing_opentelemetry::OpenTelemetrySpanExt;

pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Buckets from OpenTelemetry's HTTP semantic conventions, with finer steps below 5 ms where a
/// healthy limiter lives.
pub const HTTP_BUCKETS_SECONDS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
    7.5, 10.0,
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub method: &'static str,
    /// The matched route pattern (never the raw path: that would be unbounded).
    pub route: String,
    pub status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TraceExemplar {
    pub trace_id: String,
}

type Series = HistogramWithExemplars<TraceExemplar>;
type Histograms = Family<RequestLabels, Series>;

/// The registry and its one histogram family.
pub struct HttpMetrics {
    registry: Registry,
    durations: Histograms,
}

impl Default for HttpMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl HttpMetrics {
    pub fn new() -> Self {
        let durations: Histograms = Family::new_with_constructor(|| {
            HistogramWithExemplars::new(HTTP_BUCKETS_SECONDS.iter().copied())
        });
        let mut registry = Registry::default();
        registry.register_with_unit(
            "http_server_request_duration",
            "Duration of HTTP server requests, with trace exemplars",
            prometheus_client::registry::Unit::Seconds,
            durations.clone(),
        );
        HttpMetrics {
            registry,
            durations,
        }
    }

    /// The series of `labels` (a handle sharing the family's data).
    fn series(&self, labels: &RequestLabels) -> Series {
        self.durations.get_or_create(labels).clone()
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }
}

/// Bounded method label: the standard methods, everything else `_OTHER` (as OpenTelemetry does).
fn method_label(method: &Method) -> &'static str {
    match *method {
        Method::GET => "GET",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::HEAD => "HEAD",
        Method::OPTIONS => "OPTIONS",
        Method::PATCH => "PATCH",
        Method::CONNECT => "CONNECT",
        Method::TRACE => "TRACE",
        _ => "_OTHER",
    }
}

/// The current span's trace id, if the trace is sampled (so the exemplar leads somewhere).
pub fn sampled_trace_id(span: &tracing::Span) -> Option<String> {
    if span.is_disabled() {
        return None;
    }
    let context = span.context();
    let span_ref = context.span();
    let span_context = span_ref.span_context();
    (span_context.is_valid() && span_context.is_sampled())
        .then(|| span_context.trace_id().to_string())
}

/// Middleware that times every request into [`HttpMetrics`]. Wrap it inside the tracing
/// middleware, so the request's span is current.
#[derive(Clone)]
pub struct RecordHttpMetrics {
    metrics: Option<Arc<HttpMetrics>>,
}

impl RecordHttpMetrics {
    pub fn new(metrics: Option<Arc<HttpMetrics>>) -> Self {
        RecordHttpMetrics { metrics }
    }
}

impl<S, B> Transform<S, ServiceRequest> for RecordHttpMetrics
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = Error> + 'static,
    B: 'static,
{
    type Response = ServiceResponse<B>;
    type Error = Error;
    type Transform = RecordHttpMetricsMiddleware<S>;
    type InitError = ();
    type Future = Ready<Result<Self::Transform, Self::InitError>>;

    fn new_transform(&self, service: S) -> Self::Future {
        let worker = self.metrics.clone().map(|metrics| {
            Rc::new(WorkerSeries {
                metrics,
                series: RefCell::default(),
            })
        });
        ready(Ok(RecordHttpMetricsMiddleware {
            service: Rc::new(service),
            worker,
        }))
    }
}

pub struct RecordHttpMetricsMiddleware<S> {
    service: Rc<S>,
    /// `None` when HTTP metrics are off.
    worker: Option<Rc<WorkerSeries>>,
}

/// One worker's handle on the histograms. A request clones this `Rc`, not the shared `Arc`:
/// with every worker counting references on one `Arc`, that count's cache line moves between
/// cores on each request.
struct WorkerSeries {
    metrics: Arc<HttpMetrics>,
    series: RefCell<SeriesByPath>,
}

/// Paths remembered per worker, beyond which a request's series is found the long way.
pub const SERIES_PATHS_MAX: usize = 64;
/// (method, status) series remembered per path.
const SERIES_PER_PATH_MAX: usize = 8;

/// This worker's series by request path: a path's route pattern (a walk of the resource map into
/// a new `String`) and its labelled series (a hash and a lock) are found once, then reused; they
/// were a tenth of a refusal's cost. The route for a path and method never changes within an app.
/// Bounded: a scan of distinct paths (404s) fills it, then its requests take the long way.
#[derive(Default)]
struct SeriesByPath(HashMap<Box<str>, Vec<(&'static str, u16, Series)>>);

impl SeriesByPath {
    fn observe(
        &mut self,
        metrics: &HttpMetrics,
        request: &HttpRequest,
        (method, status): (&'static str, u16),
        seconds: f64,
        trace_id: Option<String>,
    ) {
        let exemplar = trace_id.map(|trace_id| TraceExemplar { trace_id });
        let path = request.path();
        let known = self
            .0
            .get(path)
            .and_then(|series| series.iter().find(|(m, s, _)| *m == method && *s == status));
        if let Some((_, _, series)) = known {
            series.observe(seconds, exemplar, None);
            return;
        }
        let route = request
            .match_pattern()
            .unwrap_or_else(|| "unmatched".to_owned());
        let series = metrics.series(&RequestLabels {
            method,
            route,
            status,
        });
        series.observe(seconds, exemplar, None);
        if let Some(known) = self.0.get_mut(path) {
            if known.len() < SERIES_PER_PATH_MAX {
                known.push((method, status, series));
            }
        } else if self.0.len() < SERIES_PATHS_MAX {
            self.0.insert(path.into(), vec![(method, status, series)]);
        }
    }
}

impl<S, B> Service<ServiceRequest> for RecordHttpMetricsMiddleware<S>
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = Error> + 'static,
    B: 'static,
{
    type Response = ServiceResponse<B>;
    type Error = Error;
    type Future = LocalBoxFuture<'static, Result<Self::Response, Self::Error>>;

    forward_ready!(service);

    fn call(&self, req: ServiceRequest) -> Self::Future {
        let Some(worker) = self.worker.clone() else {
            return Box::pin(self.service.call(req));
        };
        let started = Instant::now();
        let method = method_label(req.method());
        let span = tracing::Span::current();
        let future = self.service.call(req);
        Box::pin(async move {
            let response = future.await?;
            worker.series.borrow_mut().observe(
                &worker.metrics,
                response.request(),
                (method, response.status().as_u16()),
                started.elapsed().as_secs_f64(),
                sampled_trace_id(&span),
            );
            Ok(response)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_openmetrics_with_exemplars() {
        let metrics = HttpMetrics::new();
        let labels = RequestLabels {
            method: "GET",
            route: "/greeting".into(),
            status: 200,
        };
        let series = metrics.series(&labels);
        let trace_id = "0af7651916cd43dd8448eb211c80319c".to_owned();
        series.observe(0.003, Some(TraceExemplar { trace_id }), None);
        series.observe(0.2, None, None);
        let text = metrics.render();
        assert!(
            text.contains("# TYPE http_server_request_duration_seconds histogram"),
            "{text}"
        );
        assert!(
            text.contains(r#"http_server_request_duration_seconds_bucket{le="0.005",method="GET",route="/greeting",status="200"} 1 # {trace_id="0af7651916cd43dd8448eb211c80319c"} 0.003"#),
            "{text}"
        );
        assert!(text.trim_end().ends_with("# EOF"), "{text}");
        assert_eq!(
            method_label(&Method::from_bytes(b"BREW").unwrap()),
            "_OTHER"
        );
    }

    fn count(text: &str, route: &str, status: u16) -> u64 {
        let line = format!(
            r#"http_server_request_duration_seconds_count{{method="GET",route="{route}",status="{status}"}} "#
        );
        text.lines()
            .find_map(|l| l.strip_prefix(&line))
            .map_or(0, |n| n.trim().parse().expect("a count"))
    }

    /// Remembered series count like the long way, past the bound too.
    #[actix_web::test]
    async fn series_are_counted_alike_whether_remembered_or_not() {
        use actix_web::{test, web, App};
        let metrics = Arc::new(HttpMetrics::new());
        let app = test::init_service(
            App::new()
                .wrap(RecordHttpMetrics::new(Some(metrics.clone())))
                .route("/greeting", web::get().to(|| async { "hello" }))
                .route("/users/{id}", web::get().to(|| async { "user" })),
        )
        .await;
        let get = |uri: String| test::TestRequest::get().uri(&uri).to_request();
        for _ in 0..3 {
            test::call_service(&app, get("/greeting".into())).await;
        }
        let users = SERIES_PATHS_MAX + 10;
        for id in 0..users {
            test::call_service(&app, get(format!("/users/{id}"))).await;
        }
        for _ in 0..2 {
            test::call_service(&app, get("/nowhere".into())).await;
            test::call_service(&app, get("/greeting".into())).await;
        }
        let text = metrics.render();
        assert_eq!(count(&text, "/greeting", 200), 5, "{text}");
        assert_eq!(count(&text, "/users/{id}", 200), users as u64, "{text}");
        assert_eq!(count(&text, "unmatched", 404), 2, "{text}");
    }
}
