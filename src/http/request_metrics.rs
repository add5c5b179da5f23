//! HTTP request latency with trace exemplars, in OpenMetrics text.
//!
//! `metrics-exporter-prometheus` cannot emit exemplars (metrics-rs/metrics#175), so this one
//! histogram is served on its own path (`/metrics/exemplars`). An exemplar is attached only when
//! the request's trace is sampled: sent for export, so its exemplar leads to it unless the
//! exporter dropped it (its queue full, or the trace store not yet up).
//!
//! Each worker counts into series of its own, summed when the text is made: one series shared
//! by every worker (as `prometheus-client`'s histograms are) takes two locks per request that
//! the workers fight over, and its counts' cache lines move between cores on each request. The
//! text is what `prometheus-client` writes for the same observations (a test checks it).

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::future::{ready, Future, Ready};
use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{ready, Context, Poll};
use std::time::{Instant, SystemTime};

use actix_web::dev::{forward_ready, Service, ServiceRequest, ServiceResponse, Transform};
use actix_web::{Error, HttpRequest};
use opentelemetry::trace::TraceContextExt;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::sync::lock;
use crate::telemetry::span::method_label;

pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Buckets from OpenTelemetry's HTTP semantic conventions, with finer steps below 5 ms where a
/// healthy limiter lives.
pub const HTTP_BUCKETS_SECONDS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
    7.5, 10.0,
];

/// The family's name, unit included, as OpenMetrics wants it.
const NAME: &str = "http_server_request_duration_seconds";
const HELP: &str = "Duration of HTTP server requests, with trace exemplars.";

/// A series' labels. Every value is bounded: a method label, a route pattern, a status.
#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub struct RequestLabels {
    pub method: &'static str,
    /// The matched route pattern (never the raw path: that would be unbounded).
    pub route: String,
    pub status: u16,
}

/// The latest observation of a bucket that came with a sampled trace.
#[derive(Clone, Debug)]
struct Exemplar {
    trace_id: String,
    seconds: f64,
    /// Written with the exemplar. Why: one without a timestamp takes each scrape's, so the last
    /// exemplar of a bucket rarely hit (seconds-long requests) looks new for the process's
    /// whole life, to a Prometheus that lost its stored copy, long after its trace is gone.
    observed_at: SystemTime,
}

/// One worker's counts for one series. Only that worker writes them (so its cache lines stay on
/// its core); whichever worker renders reads them.
#[derive(Debug)]
struct Cells {
    /// Observations per bucket, not cumulative; the last one is `+Inf`'s.
    buckets: Box<[AtomicU64]>,
    sum_bits: AtomicU64,
    /// Per bucket; locked only to record an exemplar and to render.
    exemplars: Mutex<Box<[Option<Exemplar>]>>,
}

impl Cells {
    fn new() -> Self {
        let buckets = HTTP_BUCKETS_SECONDS.len() + 1;
        Cells {
            buckets: (0..buckets).map(|_| AtomicU64::new(0)).collect(),
            sum_bits: AtomicU64::new(0f64.to_bits()),
            exemplars: Mutex::new(vec![None; buckets].into_boxed_slice()),
        }
    }

    /// Only the worker that owns these cells calls this: a load and a store, not a locked
    /// read-modify-write, since no other thread writes them.
    fn observe(&self, seconds: f64, trace_id: Option<String>) {
        // The wall clock only for an exemplar: most requests have none (no trace, or not
        // sampled), and a clock read per request was a measurable part of a refusal's cost.
        let observed_at = trace_id
            .as_ref()
            .map_or(SystemTime::UNIX_EPOCH, |_| SystemTime::now());
        self.observe_at(seconds, trace_id, observed_at);
    }

    /// [`Cells::observe`] at the wall-clock time `observed_at` (read only with a `trace_id`).
    fn observe_at(&self, seconds: f64, trace_id: Option<String>, observed_at: SystemTime) {
        // The first bucket whose bound is at least `seconds` (`le`), else `+Inf`.
        let bucket = HTTP_BUCKETS_SECONDS.partition_point(|bound| *bound < seconds);
        let count = &self.buckets[bucket];
        count.store(count.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
        let sum = f64::from_bits(self.sum_bits.load(Ordering::Relaxed)) + seconds;
        self.sum_bits.store(sum.to_bits(), Ordering::Relaxed);
        if let Some(trace_id) = trace_id {
            lock(&self.exemplars)[bucket] = Some(Exemplar {
                trace_id,
                seconds,
                observed_at,
            });
        }
    }
}

/// One series as rendered: every worker's cells summed, the latest exemplar of each bucket.
struct Summed {
    buckets: Vec<u64>,
    sum_seconds: f64,
    exemplars: Vec<Option<Exemplar>>,
}

impl Summed {
    fn new() -> Self {
        let buckets = HTTP_BUCKETS_SECONDS.len() + 1;
        Summed {
            buckets: vec![0; buckets],
            sum_seconds: 0.0,
            exemplars: vec![None; buckets],
        }
    }

    fn add(&mut self, cells: &Cells) {
        for (total, count) in self.buckets.iter_mut().zip(cells.buckets.iter()) {
            *total += count.load(Ordering::Relaxed);
        }
        self.sum_seconds += f64::from_bits(cells.sum_bits.load(Ordering::Relaxed));
        for (latest, exemplar) in self.exemplars.iter_mut().zip(lock(&cells.exemplars).iter()) {
            let Some(exemplar) = exemplar else { continue };
            if latest
                .as_ref()
                .is_none_or(|l| exemplar.observed_at > l.observed_at)
            {
                *latest = Some(exemplar.clone());
            }
        }
    }
}

/// Every worker's series, and the text made from them.
#[derive(Debug, Default)]
pub struct HttpMetrics {
    /// One entry per worker and label set: added when a worker first sees the labels.
    cells: Mutex<Vec<(RequestLabels, Arc<Cells>)>>,
}

impl HttpMetrics {
    pub fn new() -> Self {
        Self::default()
    }

    /// New cells for one worker's series of `labels`.
    fn register(&self, labels: RequestLabels) -> Arc<Cells> {
        let cells = Arc::new(Cells::new());
        lock(&self.cells).push((labels, cells.clone()));
        cells
    }

    /// The OpenMetrics text: every series, its workers' counts summed.
    pub fn render(&self) -> String {
        let mut series: BTreeMap<RequestLabels, Summed> = BTreeMap::new();
        for (labels, cells) in lock(&self.cells).iter() {
            series
                .entry(labels.clone())
                .or_insert_with(Summed::new)
                .add(cells);
        }
        let mut out =
            format!("# HELP {NAME} {HELP}\n# TYPE {NAME} histogram\n# UNIT {NAME} seconds\n");
        for (labels, summed) in &series {
            write_series(&mut out, labels, summed);
        }
        out.push_str("# EOF\n");
        out
    }
}

/// One series' lines: sum, count, then the cumulative buckets with their exemplars.
fn write_series(out: &mut String, labels: &RequestLabels, summed: &Summed) {
    let RequestLabels {
        method,
        route,
        status,
    } = labels;
    let route = escape_label_value(route);
    let labels = format!("method=\"{method}\",route=\"{route}\",status=\"{status}\"");
    let count: u64 = summed.buckets.iter().sum();
    // `{:?}` writes an f64 as prometheus-client does: always with a fraction or an exponent.
    let _ = writeln!(out, "{NAME}_sum{{{labels}}} {:?}", summed.sum_seconds);
    let _ = writeln!(out, "{NAME}_count{{{labels}}} {count}");
    let mut cumulative = 0;
    for (index, observed) in summed.buckets.iter().enumerate() {
        cumulative += observed;
        let bound = HTTP_BUCKETS_SECONDS
            .get(index)
            .map_or_else(|| "+Inf".to_owned(), |bound| format!("{bound:?}"));
        let _ = write!(out, "{NAME}_bucket{{le=\"{bound}\",{labels}}} {cumulative}");
        if let Some(exemplar) = &summed.exemplars[index] {
            let trace_id = escape_label_value(&exemplar.trace_id);
            let _ = write!(out, " # {{trace_id=\"{trace_id}\"}} {:?}", exemplar.seconds);
            let since_epoch = exemplar.observed_at.duration_since(SystemTime::UNIX_EPOCH);
            let _ = write!(out, " {:?}", since_epoch.unwrap_or_default().as_secs_f64());
        }
        out.push('\n');
    }
}

/// OpenMetrics label values escape `\`, `"` and line feeds.
fn escape_label_value(value: &str) -> std::borrow::Cow<'_, str> {
    if !value.contains(['\\', '"', '\n']) {
        return value.into();
    }
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
        .into()
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

/// One worker's series. A request clones this `Rc`, not a shared `Arc`: with every worker
/// counting references on one `Arc`, that count's cache line moves between cores on each
/// request.
struct WorkerSeries {
    metrics: Arc<HttpMetrics>,
    series: RefCell<SeriesByPath>,
}

/// Paths remembered per worker, beyond which a request's series is found the long way.
pub const SERIES_PATHS_MAX: usize = 64;
/// (method, status) series remembered per path.
const SERIES_PER_PATH_MAX: usize = 8;

/// A path's series for one (method, status).
type PathSeries = (&'static str, u16, Arc<Cells>);

/// This worker's series, by labels and by request path. A path's route pattern (a walk of the
/// resource map into a new `String`) and its series (a hash of the labels) are found once, then
/// reused; they were a tenth of a refusal's cost. The route for a path and method never changes
/// within an app. Bounded: a scan of distinct paths (404s) fills the paths, then its requests
/// take the long way; the label sets are bounded by the app's routes and statuses.
#[derive(Default)]
struct SeriesByPath {
    /// A fast hash: a request's path is looked up on every request, and the map holds at most
    /// [`SERIES_PATHS_MAX`] paths, so colliding paths could not make it slow.
    by_path: HashMap<Box<str>, Vec<PathSeries>, foldhash::fast::RandomState>,
    by_labels: HashMap<RequestLabels, Arc<Cells>>,
}

impl SeriesByPath {
    fn observe(
        &mut self,
        metrics: &HttpMetrics,
        request: &HttpRequest,
        (method, status): (&'static str, u16),
        seconds: f64,
        trace_id: Option<String>,
    ) {
        // Decoded as the router decodes it, so an encoded spelling counts under its route.
        let path = request.match_info().as_str();
        let known = self
            .by_path
            .get(path)
            .and_then(|series| series.iter().find(|(m, s, _)| *m == method && *s == status));
        if let Some((_, _, cells)) = known {
            cells.observe(seconds, trace_id);
            return;
        }
        let route = request
            .match_pattern()
            .unwrap_or_else(|| "unmatched".to_owned());
        let labels = RequestLabels {
            method,
            route,
            status,
        };
        let cells = match self.by_labels.get(&labels) {
            Some(cells) => cells.clone(),
            None => {
                let cells = metrics.register(labels.clone());
                self.by_labels.insert(labels, cells.clone());
                cells
            }
        };
        cells.observe(seconds, trace_id);
        if let Some(known) = self.by_path.get_mut(path) {
            if known.len() < SERIES_PER_PATH_MAX {
                known.push((method, status, cells));
            }
        } else if self.by_path.len() < SERIES_PATHS_MAX {
            self.by_path
                .insert(path.into(), vec![(method, status, cells)]);
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
    type Future = Timed<S::Future>;

    forward_ready!(service);

    fn call(&self, req: ServiceRequest) -> Self::Future {
        let timer = self.worker.clone().map(|worker| Timer {
            worker,
            started: Instant::now(),
            method: method_label(req.method()),
            span: tracing::Span::current(),
        });
        Timed {
            response: self.service.call(req),
            timer,
        }
    }
}

/// What a request's observation needs from its start.
struct Timer {
    worker: Rc<WorkerSeries>,
    started: Instant,
    method: &'static str,
    span: tracing::Span,
}

pin_project_lite::pin_project! {
    /// The inner service's future, observed into the worker's series when it answers. Not boxed:
    /// it is the request's path, and the enclosing future holds it in place.
    pub struct Timed<F> {
        #[pin]
        response: F,
        // `None` when HTTP metrics are off.
        timer: Option<Timer>,
    }
}

impl<F, B> Future for Timed<F>
where
    F: Future<Output = Result<ServiceResponse<B>, Error>>,
{
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let response = ready!(this.response.poll(cx))?;
        if let Some(timer) = this.timer.take() {
            timer.worker.series.borrow_mut().observe(
                &timer.worker.metrics,
                response.request(),
                (timer.method, response.status().as_u16()),
                timer.started.elapsed().as_secs_f64(),
                sampled_trace_id(&timer.span),
            );
        }
        Poll::Ready(Ok(response))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn greeting(status: u16) -> RequestLabels {
        RequestLabels {
            method: "GET",
            route: "/greeting".into(),
            status,
        }
    }

    const TRACE_ID: &str = "0af7651916cd43dd8448eb211c80319c";

    #[test]
    fn renders_openmetrics_with_exemplars() {
        let metrics = HttpMetrics::new();
        let series = metrics.register(greeting(200));
        series.observe(0.003, Some(TRACE_ID.to_owned()));
        series.observe(0.2, None);
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
            method_label(&actix_web::http::Method::from_bytes(b"BREW").unwrap()),
            "_OTHER"
        );
    }

    /// What `prometheus-client` (the reference, one series shared by every worker) writes for
    /// the same observations.
    fn reference_text(observations: &[(RequestLabels, f64, Option<&str>)]) -> String {
        let observed_at = |index: usize| SystemTime::UNIX_EPOCH + Duration::from_secs(index as u64);
        use prometheus_client::encoding::EncodeLabelSet;
        use prometheus_client::metrics::exemplar::HistogramWithExemplars;
        use prometheus_client::metrics::family::Family;
        use prometheus_client::registry::{Registry, Unit};
        #[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
        struct Labels {
            method: &'static str,
            route: String,
            status: u16,
        }
        #[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
        struct Trace {
            trace_id: String,
        }
        let family: Family<Labels, HistogramWithExemplars<Trace>> =
            Family::new_with_constructor(|| {
                HistogramWithExemplars::new(HTTP_BUCKETS_SECONDS.iter().copied())
            });
        let mut registry = Registry::default();
        let help = "Duration of HTTP server requests, with trace exemplars";
        let name = "http_server_request_duration";
        registry.register_with_unit(name, help, Unit::Seconds, family.clone());
        for (index, (labels, seconds, trace_id)) in observations.iter().enumerate() {
            let labels = Labels {
                method: labels.method,
                route: labels.route.clone(),
                status: labels.status,
            };
            let trace = trace_id.map(|id| Trace {
                trace_id: id.to_owned(),
            });
            let at = Some(observed_at(index));
            family.get_or_create(&labels).observe(*seconds, trace, at);
        }
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &registry).unwrap();
        out
    }

    /// Two workers' cells for one series render as the reference's one series; series come
    /// out in a fixed order (the reference's order is its hash map's).
    #[test]
    fn renders_what_prometheus_client_renders() {
        let observations = [
            (greeting(200), 0.0002, None),
            (greeting(200), 0.003, Some(TRACE_ID)),
            (greeting(200), 0.2, None),
            (
                greeting(200),
                12.0,
                Some("ffffffffffffffffffffffffffffffff"),
            ),
            (
                greeting(200),
                0.004,
                Some("11111111111111111111111111111111"),
            ),
            (greeting(429), 0.0007, None),
            (greeting(429), 0.0005, None),
        ];
        let metrics = HttpMetrics::new();
        let workers = [
            metrics.register(greeting(200)),
            metrics.register(greeting(200)),
        ];
        let refusals = metrics.register(greeting(429));
        for (index, (labels, seconds, trace_id)) in observations.iter().enumerate() {
            let cells = if labels.status == 429 {
                &refusals
            } else {
                &workers[index % 2]
            };
            let at = SystemTime::UNIX_EPOCH + Duration::from_secs(index as u64);
            cells.observe_at(*seconds, trace_id.map(str::to_owned), at);
        }
        let ours = metrics.render();
        let reference = reference_text(&observations);
        // Numbers compared as numbers: the reference's float formatting is not always the
        // shortest (0.0012000000000000002 for what `{:?}` writes as 0.0012000000000000001).
        let number = |token: &str| match token.parse::<f64>() {
            Ok(value) => format!("{value:?}"),
            Err(_) => token.to_owned(),
        };
        let lines = |text: &str| {
            let line = |l: &str| l.split(' ').map(number).collect::<Vec<_>>().join(" ");
            let mut lines: Vec<String> = text.lines().map(line).collect();
            lines.sort();
            lines
        };
        assert_eq!(
            lines(&ours),
            lines(&reference),
            "ours:\n{ours}\nreference:\n{reference}"
        );
        let first_429 = ours.find("status=\"429\"").unwrap();
        assert!(ours.rfind("status=\"200\"").unwrap() < first_429, "{ours}");
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape_label_value("/users/{id}"), "/users/{id}");
        assert_eq!(escape_label_value("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
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
