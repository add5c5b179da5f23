//! Tracing and OpenTelemetry: one server span per request (with the limiter's outcome, see
//! [`span`]), a child span per ledger call, exported over OTLP in batches when an OTLP endpoint is
//! configured through the standard `OTEL_*` environment variables.

pub mod span;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::SdkTracerProvider;
use thiserror::Error;
use tracing::subscriber::Interest;
use tracing_subscriber::filter::FilterExt;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::Layer;

/// Events with this target go to traces (as span events) but never to the log: they happen per
/// request.
pub const SPAN_EVENTS_TARGET: &str = "ledger_limiter::span_events";

/// True at most once per wall-clock second per `last` (a throttle for per-request warnings).
pub fn log_throttle(last: &std::sync::atomic::AtomicU64) -> bool {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs();
    last.swap(now, std::sync::atomic::Ordering::Relaxed) != now
}

#[derive(Debug, Error)]
pub enum TelemetryError {
    #[error("cannot build the OTLP exporter: {0}")]
    Exporter(String),
    #[error("cannot install the tracing subscriber: {0}")]
    Subscriber(String),
}

/// Flushes and shuts the tracer provider down when dropped (at the end of `main`).
pub struct TelemetryGuard {
    provider: Option<SdkTracerProvider>,
}

impl TelemetryGuard {
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }

    pub fn shutdown(&mut self) {
        if let Some(provider) = self.provider.take() {
            if let Err(error) = provider.shutdown() {
                eprintln!("flushing traces failed: {error}");
            }
        }
    }
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn env_set(name: &str) -> bool {
    std::env::var_os(name).is_some_and(|v| !v.is_empty())
}

/// A Prometheus exporter set up for this crate's metrics: the ledger calls' latency as a
/// histogram with [`LEDGER_CALL_BUCKETS_SECONDS`](crate::ledger::metrics::LEDGER_CALL_BUCKETS_SECONDS)
/// (its `_bucket` series are what the dashboard's latency and headroom panels read; the
/// exporter's default makes a summary, which they cannot). Install it, or add to it, in an app
/// of your own.
pub fn prometheus_builder(
) -> Result<metrics_exporter_prometheus::PrometheusBuilder, metrics_exporter_prometheus::BuildError>
{
    use crate::ledger::metrics::{LEDGER_CALL_BUCKETS_SECONDS, LEDGER_CALL_DURATION_SECONDS};
    let calls = metrics_exporter_prometheus::Matcher::Full(LEDGER_CALL_DURATION_SECONDS.to_owned());
    metrics_exporter_prometheus::PrometheusBuilder::new()
        .set_buckets_for_metric(calls, LEDGER_CALL_BUCKETS_SECONDS)
}

/// Whether the environment asks for OTLP trace export.
pub fn otlp_requested() -> bool {
    let disabled = std::env::var("OTEL_SDK_DISABLED").is_ok_and(|v| v.eq_ignore_ascii_case("true"))
        || std::env::var("OTEL_TRACES_EXPORTER")
            .is_ok_and(|v| v.trim().eq_ignore_ascii_case("none"));
    !disabled
        && (env_set("OTEL_EXPORTER_OTLP_ENDPOINT") || env_set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
}

/// Why the OTLP export the environment asks for cannot be made here, if it cannot. This build
/// exports over plain gRPC (no TLS: a collector beside the service forwards over TLS), so an
/// `https` endpoint, or another protocol, is refused at the start and by `--check-config`,
/// saying what to do: the exporter's own error told an operator to rebuild with a Cargo
/// feature, and `http/protobuf` was sent gRPC to an HTTP port. The endpoint itself is never
/// printed (a URL may carry credentials).
pub fn otlp_refused() -> Option<String> {
    if !otlp_requested() {
        return None;
    }
    // The traces' own variable wins over the general one, as the exporter reads them.
    let first_set = |names: [&'static str; 2]| {
        names.into_iter().find_map(|name| {
            let value = std::env::var(name).ok()?;
            (!value.trim().is_empty()).then(|| (name, value.trim().to_ascii_lowercase()))
        })
    };
    let endpoints = [
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
    ];
    if let Some((name, endpoint)) = first_set(endpoints) {
        if endpoint.starts_with("https://") {
            return Some(format!("{name} is an https endpoint: this build exports traces over gRPC without TLS; point it at a collector over http:// (one beside the service can forward over TLS)"));
        }
    }
    let protocols = [
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
    ];
    if let Some((name, protocol)) = first_set(protocols) {
        if protocol != "grpc" {
            return Some(format!("{name} is {protocol:?}: this build exports traces over OTLP/gRPC only (\"grpc\", port 4317 by default)"));
        }
    }
    None
}

/// Builds a tracer provider exporting over OTLP/gRPC in batches, configured by `OTEL_*` variables
/// (endpoint, headers, timeout, sampler, resource). Must run inside a Tokio runtime.
pub fn otlp_tracer_provider(
    default_service_name: &str,
) -> Result<SdkTracerProvider, TelemetryError> {
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .build()
        .map_err(|e| TelemetryError::Exporter(e.to_string()))?;
    let mut resource = opentelemetry_sdk::Resource::builder();
    // The default only where the deployment named none: `with_service_name` overrode the one
    // read from OTEL_RESOURCE_ATTRIBUTES, and Tempo filed the service under our name.
    let attributes = std::env::var("OTEL_RESOURCE_ATTRIBUTES").unwrap_or_default();
    if !env_set("OTEL_SERVICE_NAME") && !names_the_service(&attributes) {
        resource = resource.with_service_name(default_service_name.to_owned());
    }
    Ok(SdkTracerProvider::builder()
        .with_resource(resource.build())
        .with_batch_exporter(exporter)
        .build())
}

/// Whether OTEL_RESOURCE_ATTRIBUTES (`key=value` pairs, comma-separated) gives `service.name`.
fn names_the_service(attributes: &str) -> bool {
    attributes
        .split(',')
        .filter_map(|pair| pair.split_once('='))
        .any(|(key, value)| key.trim() == "service.name" && !value.trim().is_empty())
}

/// Events, not spans, decided once per callsite: a filter without a callsite answer is asked
/// again at every event, which cost a refusal from memory about 0.1 µs.
#[derive(Clone, Copy)]
struct EventsOnly;

// Why the hints matter: `tracing` skips a `trace!` or `debug!` with one comparison only while
// every filter states a maximum level. One filter without a hint (`None`) made the whole
// subscriber's hint "any level", and every disabled callsite in actix-http and Tokio was then
// asked again at each use: 0.4–1.0 µs per request (see BENCHMARKS.md).

/// The OpenTelemetry SDK's own events (an export that failed, a span dropped): with the
/// collector down, an error line per failed batch, tens a second under load, unthrottled. At
/// most one a second reaches the log.
fn is_opentelemetrys(metadata: &tracing::Metadata<'_>) -> bool {
    metadata.target().starts_with("opentelemetry")
}

/// The wall-clock second an OpenTelemetry SDK event was last logged in.
static OPENTELEMETRY_LOGGED_SECOND: std::sync::atomic::AtomicU64 =
    std::sync::atomic::AtomicU64::new(0);

impl<S> tracing_subscriber::layer::Filter<S> for EventsOnly {
    fn enabled(
        &self,
        metadata: &tracing::Metadata<'_>,
        _: &tracing_subscriber::layer::Context<'_, S>,
    ) -> bool {
        metadata.is_event()
            && (!is_opentelemetrys(metadata) || log_throttle(&OPENTELEMETRY_LOGGED_SECOND))
    }

    fn callsite_enabled(&self, metadata: &'static tracing::Metadata<'static>) -> Interest {
        match (metadata.is_event(), is_opentelemetrys(metadata)) {
            (true, false) => Interest::always(),
            // Asked at each event: the throttle decides.
            (true, true) => Interest::sometimes(),
            (false, _) => Interest::never(),
        }
    }

    /// Any level: the log's `EnvFilter` beside it sets the maximum (`And` takes the lower hint,
    /// but no hint at all if either has none).
    fn max_level_hint(&self) -> Option<tracing::level_filters::LevelFilter> {
        Some(tracing::level_filters::LevelFilter::TRACE)
    }
}

/// The log's filter from `RUST_LOG`'s value: `info` when it is unset or empty, and when it does
/// not parse, which is said on stderr (the log is not up yet). Why: an empty value parsed as no
/// directive at all, which drops every line, errors too; a misspelt one fell back without a word.
fn log_filter(value: Result<String, std::env::VarError>) -> EnvFilter {
    let value = match value {
        Ok(value) if !value.trim().is_empty() => value,
        Ok(_) | Err(std::env::VarError::NotPresent) => return EnvFilter::new("info"),
        Err(std::env::VarError::NotUnicode(_)) => {
            eprintln!("RUST_LOG is not UTF-8: logging at info");
            return EnvFilter::new("info");
        }
    };
    EnvFilter::try_new(&value).unwrap_or_else(|error| {
        eprintln!("RUST_LOG={value:?} is not a log filter ({error}): logging at info");
        EnvFilter::new("info")
    })
}

/// The log alone (standard error, `RUST_LOG`, `info` by default), no traces: for the command
/// line's `audit` and `admin`, whose library calls warn of what an operator must know (a move's
/// holds not carried, a client replaced); without a subscriber they said nothing.
pub fn init_log_only() -> Result<(), TelemetryError> {
    (tracing_subscriber::registry().with(log_layer()))
        .try_init()
        .map_err(|e| TelemetryError::Subscriber(e.to_string()))
}

/// The log: events only (RUST_LOG, default info), never the per-request span events. Spans are
/// for traces: keeping them from the log layer spares formatting their fields on every request,
/// and without OTLP export they are not even created.
fn log_layer<S>() -> impl Layer<S>
where
    S: tracing::Subscriber + for<'span> tracing_subscriber::registry::LookupSpan<'span>,
{
    let log_filter = log_filter(std::env::var("RUST_LOG")).add_directive(
        format!("{SPAN_EVENTS_TARGET}=off")
            .parse()
            .expect("a valid directive"),
    );
    tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_filter(log_filter.and(EventsOnly))
}

/// Installs the global subscriber: logs to stderr (filtered by `RUST_LOG`, default `info`), and
/// spans to OTLP when [`otlp_requested`]. W3C `traceparent` from callers is honoured.
pub fn init(default_service_name: &str) -> Result<TelemetryGuard, TelemetryError> {
    opentelemetry::global::set_text_map_propagator(
        opentelemetry_sdk::propagation::TraceContextPropagator::new(),
    );
    let fmt = log_layer();
    let provider = if otlp_requested() {
        Some(otlp_tracer_provider(default_service_name)?)
    } else {
        None
    };
    // Traces: every INFO span and event, whatever the log level. Without OTLP there is no
    // second layer at all: an absent layer (`Option::None`) answers "always" for every callsite,
    // which turns each callsite the log filters out into one asked again at every use.
    let installed = match &provider {
        Some(p) => {
            let otel = tracing_opentelemetry::layer()
                .with_tracer(p.tracer("ledger-limiter"))
                .with_filter(tracing_subscriber::filter::LevelFilter::INFO);
            tracing_subscriber::registry()
                .with(fmt)
                .with(otel)
                .try_init()
        }
        None => tracing_subscriber::registry().with(fmt).try_init(),
    };
    installed.map_err(|e| TelemetryError::Subscriber(e.to_string()))?;
    if let Some(p) = &provider {
        opentelemetry::global::set_tracer_provider(p.clone());
    }
    Ok(TelemetryGuard { provider })
}

#[cfg(test)]
mod tests {
    use super::names_the_service;

    #[test]
    fn names_the_service_finds_service_name_among_the_resource_attributes() {
        assert!(names_the_service("service.name=checkout"));
        assert!(names_the_service(
            "deployment.environment=prod, service.name = checkout"
        ));
        assert!(!names_the_service(""));
        assert!(!names_the_service(
            "service.namespace=shop,service.instance.id=a"
        ));
        assert!(!names_the_service("service.name="));
    }

    /// An empty `RUST_LOG` logs at info (it dropped every line, errors too), as does one that
    /// does not parse; a valid one is used.
    #[test]
    fn rust_log_empty_or_invalid_logs_at_info() {
        use std::env::VarError;
        use tracing_subscriber::filter::LevelFilter;
        let hint = |value: Result<&str, VarError>| {
            super::log_filter(value.map(str::to_owned)).max_level_hint()
        };
        let info = Some(LevelFilter::INFO);
        assert_eq!(hint(Err(VarError::NotPresent)), info);
        assert_eq!(hint(Ok("")), info);
        assert_eq!(hint(Ok("  ")), info);
        assert_eq!(hint(Ok("debug,x=bogus")), info);
        assert_eq!(hint(Ok("debug")), Some(LevelFilter::DEBUG));
        assert_eq!(hint(Ok("warn")), Some(LevelFilter::WARN));
    }

    /// With the collector down the SDK logs an error per failed batch: at most one a second
    /// reaches the log; the service's own events all do.
    #[test]
    fn the_sdks_own_events_reach_the_log_once_a_second() {
        use std::sync::{Arc, Mutex};
        use tracing_subscriber::layer::SubscriberExt;
        use tracing_subscriber::Layer;
        let written = Arc::new(Mutex::new(Vec::<u8>::new()));
        let sink = written.clone();
        let writer = move || Sink(sink.clone());
        let layer = tracing_subscriber::fmt::layer()
            .with_writer(writer)
            .with_filter(super::EventsOnly);
        let subscriber = tracing_subscriber::registry().with(layer);
        tracing::subscriber::with_default(subscriber, || {
            for _ in 0..50 {
                tracing::error!(target: "opentelemetry_sdk", "BatchSpanProcessor.ExportError");
                tracing::warn!("the service's own");
            }
        });
        let text = String::from_utf8(written.lock().unwrap().clone()).unwrap();
        let sdk = text.matches("ExportError").count();
        assert!((1..=2).contains(&sdk), "{sdk} lines: the second may turn");
        assert_eq!(text.matches("the service's own").count(), 50);
    }

    struct Sink(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

    impl std::io::Write for Sink {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
}
