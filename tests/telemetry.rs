//! Span attributes and metric names, in process, against a real ledger: the service's own OTLP
//! tracer provider (`telemetry::otlp_tracer_provider`, batches over gRPC) exporting to a real OTLP
//! receiver, and the real Prometheus recorder.

mod common;

use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use common::span_attribute as attribute;
use common::*;
use fake_opentelemetry_collector::ExportedSpan;
use ledger_limiter::http::concurrency;
use ledger_limiter::http::request_metrics::HttpMetrics;
use ledger_limiter::startup::{Application, Exporters};
use metrics_exporter_prometheus::PrometheusHandle;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::layer::SubscriberExt;

struct Telemetry {
    /// What the OTLP receiver got, drained as it arrives (its channel is small, and a full one
    /// stalls the exporter).
    spans: Arc<Mutex<Vec<ExportedSpan>>>,
    provider: SdkTracerProvider,
    prometheus: PrometheusHandle,
    /// Runs the receiver and the exporter's gRPC channel: each test has a runtime of its own,
    /// which ends with it, and these must serve every test.
    _runtime: tokio::runtime::Runtime,
}

/// Process-wide: the subscriber and the recorder are globals, shared by actix's worker threads.
fn telemetry() -> &'static Telemetry {
    static TELEMETRY: OnceLock<Telemetry> = OnceLock::new();
    // Set up on a thread of its own: a test's runtime cannot start another inside it.
    TELEMETRY.get_or_init(|| std::thread::spawn(set_up_telemetry).join().unwrap())
}

fn set_up_telemetry() -> Telemetry {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (endpoint, spans) = runtime.block_on(otlp_receiver());
    // The service reads its exporter's settings from the environment, as in production. Each
    // test calls `telemetry()` before it starts anything, so no thread of a test reads the
    // environment while this writes it (std's own readers also take its lock).
    std::env::set_var("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint);
    let provider = {
        let _entered = runtime.enter();
        ledger_limiter::telemetry::otlp_tracer_provider("telemetry-test").unwrap()
    };
    opentelemetry::global::set_text_map_propagator(
        opentelemetry_sdk::propagation::TraceContextPropagator::new(),
    );
    let subscriber = tracing_subscriber::registry()
        .with(tracing_subscriber::EnvFilter::new("info"))
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
    tracing::subscriber::set_global_default(subscriber).unwrap();
    // The library's exporter settings, as the binary's and an app of one's own.
    let prometheus = ledger_limiter::telemetry::prometheus_builder()
        .unwrap()
        .install_recorder()
        .unwrap();
    Telemetry {
        spans,
        provider,
        prometheus,
        _runtime: runtime,
    }
}

async fn spawn_observed_app(
    config: ledger_limiter::config::FileConfig,
) -> (TestApp, std::sync::Arc<HttpMetrics>) {
    let t = telemetry();
    let http_metrics = std::sync::Arc::new(HttpMetrics::new());
    let settings = ledger_limiter::config::Settings::with_overrides(config).unwrap();
    let application = Application::build(
        settings,
        Exporters {
            prometheus: Some(t.prometheus.clone()),
            http_metrics: Some(http_metrics.clone()),
            trace_requests: true,
        },
    )
    .await
    .unwrap();
    assert!(application.wait_for_ledger(Duration::from_secs(20)).await);
    (run(application), http_metrics)
}

/// The server span of a request's trace: the one that carries the limiter's decision.
fn decided_span(spans: &[ExportedSpan]) -> &ExportedSpan {
    let decided = spans
        .iter()
        .find(|s| attribute(s, "ratelimit.decision").is_some());
    decided.expect("a server span with the decision")
}

/// The spans of `trace_id` the receiver got over OTLP, once the one with the decision is among
/// them: the provider is flushed (it exports in batches), then the receiver polled, at most 10 s.
async fn server_spans_of_trace(trace_id: &str) -> Vec<ExportedSpan> {
    let t = telemetry();
    let flushed = tokio::task::spawn_blocking(|| telemetry().provider.force_flush())
        .await
        .unwrap();
    if let Err(error) = flushed {
        panic!("the spans could not be exported over OTLP: {error}");
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let spans: Vec<ExportedSpan> = t
            .spans
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.trace_id == trace_id)
            .cloned()
            .collect();
        if spans
            .iter()
            .any(|s| attribute(s, "ratelimit.decision").is_some())
        {
            return spans;
        }
        assert!(
            Instant::now() < deadline,
            "no server span of trace {trace_id} received over OTLP: {spans:#?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn traced_get(app: &TestApp, key: &str, trace_id: &str) -> reqwest::Response {
    app.http
        .get(format!("{}/greeting", app.address))
        .header("X-Api-Key", key)
        .header("traceparent", format!("00-{trace_id}-00f067aa0ba902b7-01"))
        .send()
        .await
        .unwrap()
}

/// An attribute exported as an integer (`IntValue`), as the conventions type a status code or a
/// port: `None` when absent or of another type (a text "429" included).
fn int_attribute(span: &ExportedSpan, key: &str) -> Option<i64> {
    let raw = span.attributes.get(key)?;
    let inner = raw.split_once("IntValue(")?.1;
    inner.split_once(')')?.0.parse().ok()
}
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_spans_carry_the_caller_and_the_decision_and_never_the_key() {
    telemetry(); // first: it sets the environment, before this test starts anything
                 // A request without a key below: the count of rejected keys is process-wide.
    let _keyless = KEYLESS.lock().await;
    let ledger = shared_ledger();
    let mut config = test_config(ledger.address);
    config.plans = Some([("free".to_owned(), plan(1, 30))].into());
    let (app, _) = spawn_observed_app(config).await;
    let key = fresh_key("secret_");

    let admitted_trace = format!("{:032x}", rand::random::<u128>());
    assert_eq!(traced_get(&app, &key, &admitted_trace).await.status(), 200);
    let limited_trace = format!("{:032x}", rand::random::<u128>());
    assert_eq!(traced_get(&app, &key, &limited_trace).await.status(), 429);

    let spans = server_spans_of_trace(&admitted_trace).await;
    let server = decided_span(&spans);
    assert_eq!(attribute(server, "ratelimit.decision").unwrap(), "admitted");
    assert_eq!(attribute(server, "ratelimit.plan").unwrap(), "free");
    assert_eq!(attribute(server, "ratelimit.cost").unwrap(), "1");
    assert_eq!(server.kind, "SPAN_KIND_SERVER");
    let user_id = attribute(server, "user.id").unwrap();
    assert_eq!(user_id.len(), 32, "the account id in hex: {user_id}");
    assert_eq!(
        server.parent_span_id, "00f067aa0ba902b7",
        "traceparent honoured"
    );
    // Each ledger call is a child span of the server span, with its outcome.
    let ledger_spans: Vec<_> = spans
        .iter()
        .filter(|s| attribute(s, "db.system.name").as_deref() == Some("tigerbeetle"))
        .collect();
    assert!(!ledger_spans.is_empty(), "ledger spans: {spans:#?}");
    for span in &ledger_spans {
        assert_eq!(span.parent_span_id, server.span_id);
        assert_eq!(span.kind, "SPAN_KIND_CLIENT");
        assert_eq!(attribute(span, "ledger.outcome").as_deref(), Some("ok"));
    }
    assert!(ledger_spans.iter().any(|s| s.name == "create_transfers"));

    let spans = server_spans_of_trace(&limited_trace).await;
    let server = decided_span(&spans);
    assert_eq!(attribute(server, "ratelimit.decision").unwrap(), "limited");
    assert_eq!(
        attribute(server, "user.id").unwrap(),
        user_id,
        "same caller, same id"
    );
    assert!(
        server.events.iter().any(|e| e.name == "limited"),
        "a `limited` event: {:?}",
        server.events
    );

    // A method a client invented names no span (span metrics would be series per method).
    let invented_trace = format!("{:032x}", rand::random::<u128>());
    let method = reqwest::Method::from_bytes(b"BREW42").unwrap();
    let invented = app
        .http
        .request(method, format!("{}/greeting", app.address))
        .header("X-Api-Key", &key)
        .header(
            "traceparent",
            format!("00-{invented_trace}-00f067aa0ba902b7-01"),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(invented.status(), 429, "charged as any request");
    let spans = server_spans_of_trace(&invented_trace).await;
    let server = decided_span(&spans);
    assert_eq!(server.name, "HTTP /greeting");
    let method = attribute(server, "http.request.method");
    assert_eq!(method.as_deref(), Some("_OTHER"));
    let original = attribute(server, "http.request.method_original");
    assert_eq!(original.as_deref(), Some("BREW42"));

    // A query string is no span's (a token in it would be exported), nor an address a client
    // claims: the target is the path, the client the connection's peer.
    let queried_trace = format!("{:032x}", rand::random::<u128>());
    let queried = app
        .http
        .get(format!(
            "{}/greeting?access_token=s3cr3t-token",
            app.address
        ))
        .header("X-Api-Key", &key)
        .header("X-Forwarded-For", "203.0.113.9")
        .header("X-Forwarded-Host", "claimed.example")
        .header("X-Forwarded-Proto", "https")
        .header("User-Agent", "u".repeat(4000))
        .header(
            "traceparent",
            format!("00-{queried_trace}-00f067aa0ba902b7-01"),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(queried.status(), 429);
    let spans = server_spans_of_trace(&queried_trace).await;
    let server = decided_span(&spans);
    assert_eq!(attribute(server, "url.path").as_deref(), Some("/greeting"));
    assert_eq!(attribute(server, "url.query"), None);
    let client = attribute(server, "client.address");
    assert_eq!(client.as_deref(), Some("127.0.0.1"));
    // The request's own host and the listener's scheme, not what the client claims; and no
    // more of its user agent than a span's share.
    let address = attribute(server, "server.address");
    assert_eq!(address.as_deref(), Some("127.0.0.1"));
    assert_eq!(
        int_attribute(server, "server.port"),
        Some(i64::from(app.port))
    );
    assert_eq!(attribute(server, "url.scheme").as_deref(), Some("http"));
    let user_agent = attribute(server, "user_agent.original").unwrap();
    assert_eq!(user_agent.len(), 256, "{user_agent}");
    let route = attribute(server, "http.route");
    assert_eq!(route.as_deref(), Some("/greeting"));
    let version = attribute(server, "network.protocol.version");
    assert_eq!(version.as_deref(), Some("1.1"));
    let status = int_attribute(server, "http.response.status_code");
    assert_eq!(status, Some(429));
    // A 429 is no error: no `error.type`, the span's status unset.
    assert_eq!(attribute(server, "error.type"), None);
    let status = server.status.as_ref().map(|s| s.code.as_str());
    assert!(
        matches!(status, None | Some("STATUS_CODE_UNSET")),
        "{status:?}"
    );
    assert_eq!(
        attribute(server, "trace_id").as_deref(),
        Some(&*queried_trace)
    );
    // Nor more of a long path than a span's share (any path is traced, unknown ones too).
    let long_trace = format!("{:032x}", rand::random::<u128>());
    let long = app
        .http
        .get(format!("{}/{}", app.address, "p".repeat(4000)))
        .header(
            "traceparent",
            format!("00-{long_trace}-00f067aa0ba902b7-01"),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(long.status(), 401, "no key");
    let spans = server_spans_of_trace(&long_trace).await;
    let server = spans.iter().find(|s| s.kind == "SPAN_KIND_SERVER").unwrap();
    let path = attribute(server, "url.path");
    assert_eq!(path.map(|t| t.len()), Some(256));
    // A path no route matches: no `http.route`, the span named by its method alone.
    assert_eq!(attribute(server, "http.route"), None);
    assert_eq!(server.name, "GET");

    // The raw key is a secret: it is in no attribute or event of any span received; nor is a
    // query's token, nor a claimed address.
    for span in telemetry().spans.lock().unwrap().iter() {
        let shown = format!("{:?} {:?}", span.attributes, span.events);
        assert!(!shown.contains(&key), "key leaked into {}", span.name);
        assert!(!shown.contains("s3cr3t-token"), "a query in {}", span.name);
        assert!(
            !shown.contains("203.0.113.9") && !shown.contains("claimed.example"),
            "a claimed address in {}",
            span.name
        );
    }
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_have_bounded_labels_and_exemplars_only_for_sampled_traces() {
    telemetry(); // first: it sets the environment, before this test starts anything
                 // Counts its one request without a key, exactly: no other test's may land meanwhile.
    let _keyless = KEYLESS.lock().await;
    let ledger = shared_ledger();
    let mut config = test_config(ledger.address);
    config.plans = Some([("free".to_owned(), plan(1, 30))].into());
    let (app, http_metrics) = spawn_observed_app(config).await;
    let key = fresh_key("secret_");
    let sampled = format!("{:032x}", rand::random::<u128>());
    assert_eq!(traced_get(&app, &key, &sampled).await.status(), 200);
    // Not sampled (flags 00): no exemplar may point at it.
    let unsampled = format!("{:032x}", rand::random::<u128>());
    let response = app
        .http
        .get(format!("{}/greeting", app.address))
        .header("X-Api-Key", &key)
        .header("traceparent", format!("00-{unsampled}-00f067aa0ba902b7-00"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 429);
    // Every series is registered at zero at startup, so only a difference shows the count.
    let rejected = ["decision=\"rejected_key\""];
    let before = app.get("/metrics", None).await.text().await.unwrap();
    let before = metric_sum(&before, "ledger_limiter_decisions_total", &rejected);
    assert_eq!(app.get("/greeting", None).await.status(), 401);

    let text = app.get("/metrics", None).await.text().await.unwrap();
    let after = metric_sum(&text, "ledger_limiter_decisions_total", &rejected);
    assert_eq!(
        after - before,
        1.0,
        "the request without a key is counted once"
    );
    for expected in [
        "# TYPE ledger_limiter_decisions_total counter",
        "# TYPE ledger_limiter_ledger_errors_total counter",
        "# TYPE ledger_limiter_ledger_in_flight gauge",
        "# TYPE ledger_limiter_ledger_call_duration_seconds histogram",
        "ledger_limiter_ledger_call_duration_seconds_bucket{",
        "ledger_limiter_decisions_total{decision=\"rejected_key\",plan=\"none\",source=\"none\"}",
        "ledger_limiter_decisions_total{decision=\"failed_closed\",plan=\"free\",source=\"none\"}",
        "ledger_limiter_ledger_errors_total{kind=\"timeout\"}",
        "operation=\"create_transfers\"",
    ] {
        assert!(text.contains(expected), "missing {expected}:\n{text}");
    }
    // The admitted request's hold went in a batch, counted at the scrape.
    let batches = text
        .lines()
        .find_map(|l| l.strip_prefix("ledger_limiter_ledger_batches_total "))
        .and_then(|n| n.trim().parse::<f64>().ok());
    assert!(batches.is_some_and(|n| n >= 1.0), "batches: {batches:?}");
    assert!(!text.contains(&key), "keys never become labels");
    // Every label value is from a closed set (or a configured plan name).
    for line in text.lines().filter(|l| l.starts_with("ledger_limiter_")) {
        let labels = line
            .split('{')
            .nth(1)
            .map(|l| l.split('}').next().unwrap())
            .unwrap_or("");
        for pair in labels.split(',').filter(|p| !p.is_empty()) {
            let (name, value) = pair.split_once('=').unwrap();
            let value = value.trim_matches('"');
            let allowed: &[&str] = match name {
                "decision" => &[
                    "admitted",
                    "limited",
                    "failed_open",
                    "failed_closed",
                    "rejected_key",
                    "blocked",
                ],
                // The plans of this binary's tests (the recorder is the process'), and none.
                "plan" if value == concurrency::plan_name("/greeting") => continue,
                // The Envoy front end's: `<domain>.<rule>` (`an_envoy_call_continues_...`).
                "plan" => &[
                    "free",
                    "basic",
                    "pro",
                    "slots",
                    "shadowed",
                    "scraped",
                    "leasedroute",
                    "none",
                    "traced.k",
                ],
                "frontend" => &["envoy"],
                "source" => &["ledger", "local_view", "none"],
                "kind" => &["timeout", "overloaded", "client", "unexpected"],
                "operation" => &[
                    "create_accounts",
                    "create_transfers",
                    "lookup_accounts",
                    "get_account_transfers",
                ],
                // A ledger call's; the Envoy rules' changes'.
                "outcome" => &["ok", "error", "loaded", "refused"],
                // Histograms (the dashboard reads `_bucket`), never a summary's quantiles.
                "le" => continue,
                other => panic!("unexpected label {other} in {line}"),
            };
            assert!(allowed.contains(&value), "{name}={value} in {line}");
        }
    }

    let exemplars = app.get("/metrics/exemplars", None).await;
    assert_eq!(
        exemplars.headers().get("content-type").unwrap(),
        ledger_limiter::http::request_metrics::OPENMETRICS_CONTENT_TYPE
    );
    let text = exemplars.text().await.unwrap();
    assert!(text.contains(&format!("trace_id=\"{sampled}\"")), "{text}");
    assert!(!text.contains(&unsampled), "{text}");
    assert!(
        text.contains("route=\"/greeting\",status=\"429\""),
        "{text}"
    );
    // Scrapes are not traffic: /metrics was read above, and is not in the latency histogram.
    assert!(!text.contains("route=\"/metrics"), "{text}");
    assert!(http_metrics.render().contains(&sampled));
    app.stop().await;
}

/// The sum of `name`'s series in a scrape whose labels include every one of `labels`.
fn metric_sum(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|line| line.starts_with(&format!("{name}{{")))
        .filter(|line| labels.iter().all(|label| line.contains(label)))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// `metrics.listen` moves the scrapes off the public port: there they are gone (a 404, charged
/// to nobody), and the metrics' own listener serves both, with the public port's traffic in them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_on_a_listener_of_their_own_are_not_served_to_callers() {
    telemetry();
    let ledger = shared_ledger();
    let mut config = test_config(ledger.address);
    // A plan of its own: the recorder is the process', and another test's scrape of `free`
    // met the check below whatever this app's listener served.
    config.plans = Some([("scraped".to_owned(), plan(1, 30))].into());
    config.default_plan = Some("scraped".to_owned());
    config.metrics.listen = Some("127.0.0.1:0".into());
    // Not exempt here: the public port's 404 must not depend on it (else a 401, and charged).
    config.routes.exempt = Some(vec!["/healthz".into(), "/readyz".into()]);
    let (app, _) = spawn_observed_app(config).await;
    let key = fresh_key("scraped_");
    let sampled = format!("{:032x}", rand::random::<u128>());
    assert_eq!(traced_get(&app, &key, &sampled).await.status(), 200);
    for path in ["/metrics", "/metrics/exemplars"] {
        let public = app.get(path, None).await;
        assert_eq!(public.status(), 404, "{path} on the public port");
        let posted = app.http.post(format!("{}{path}", app.address)).send().await;
        assert_eq!(
            posted.unwrap().status(),
            404,
            "POST {path} on the public port"
        );
    }
    let port = app.metrics_port.expect("the metrics' own port");
    assert_ne!(port, app.port);
    let scrape = |path: &'static str| {
        let url = format!("http://127.0.0.1:{port}{path}");
        let http = app.http.clone();
        async move { http.get(url).send().await.unwrap() }
    };
    let text = scrape("/metrics").await.text().await.unwrap();
    let admitted = ["decision=\"admitted\"", "plan=\"scraped\""];
    assert_eq!(
        metric_sum(&text, "ledger_limiter_decisions_total", &admitted),
        1.0,
        "{text}"
    );
    assert!(!text.contains(&key), "keys never reach metrics");
    let exemplars = scrape("/metrics/exemplars").await;
    assert_eq!(exemplars.status(), 200);
    let exemplars = exemplars.text().await.unwrap();
    assert!(
        exemplars.contains(&format!("trace_id=\"{sampled}\"")),
        "{exemplars}"
    );
    app.stop().await;
}

/// A concurrency slot is a second decision on the request: it must not overwrite the caller's
/// span fields, its counts are in the next scrape, a request refused a slot is no refund, and
/// in shadow mode a refused slot is counted as passed in shadow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrency_slots_keep_the_callers_span_and_are_counted_as_what_they_are() {
    telemetry(); // first: it sets the environment, before this test starts anything
                 // A plan of this test's alone in this binary (its refunds are counted by plan).
    let plan_name = "slots".to_owned();
    let config = |shadow: bool| {
        let mut config = test_config(shared_ledger().address);
        config.plans = Some([(plan_name.clone(), plan(1000, 30))].into());
        config.default_plan = Some(plan_name.clone());
        config.routes.concurrency = Some([("/greeting".to_owned(), 1)].into());
        config.routes.shadow = shadow.then(|| vec!["/*".to_owned()]);
        config
    };
    let (app, _) = spawn_observed_app(config(false)).await;
    let key = fresh_key("secret_");
    let trace = format!("{:032x}", rand::random::<u128>());
    assert_eq!(traced_get(&app, &key, &trace).await.status(), 200);
    let spans = server_spans_of_trace(&trace).await;
    let server = decided_span(&spans);
    assert_eq!(attribute(server, "ratelimit.plan").unwrap(), plan_name);
    let account = app.limiter.account_of(&caller(&key)).unwrap();
    let user_id = attribute(server, "user.id").unwrap();
    assert_eq!(
        user_id,
        format!("{account:032x}"),
        "the caller's own account"
    );

    // One slot, many requests at once: some are refused a slot (429), none of them a refund.
    let traces: Vec<String> = (0..40)
        .map(|_| format!("{:032x}", rand::random::<u128>()))
        .collect();
    let requests = traces.iter().map(|trace| traced_get(&app, &key, trace));
    let statuses = futures_util::future::join_all(requests).await;
    let refused_traces: Vec<&String> = (traces.iter().zip(&statuses))
        .filter(|(_, response)| response.status() == 429)
        .map(|(trace, _)| trace)
        .collect();
    let refused = refused_traces.len();
    assert!(refused > 0, "40 requests at once on one slot: none refused");
    // Its span says so: the rate's decision on it (admitted) was recorded first.
    let spans = server_spans_of_trace(refused_traces[0]).await;
    let server = decided_span(&spans);
    assert_eq!(attribute(server, "ratelimit.decision").unwrap(), "limited");
    assert_eq!(attribute(server, "ratelimit.limit").unwrap(), "concurrency");
    assert_eq!(attribute(server, "ratelimit.plan").unwrap(), plan_name);
    assert!(
        server.events.iter().any(|e| e.name == "limited"),
        "a `limited` event: {:?}",
        server.events
    );
    let text = app.get("/metrics", None).await.text().await.unwrap();
    let plan = format!("plan=\"{plan_name}\"");
    assert_eq!(
        metric_sum(&text, "ledger_limiter_refunds_total", &[&plan]),
        0.0
    );
    let slot_plan = format!("plan=\"{}\"", concurrency::plan_name("/greeting"));
    let slots = [slot_plan.as_str(), "decision=\"limited\""];
    let counted = metric_sum(&text, "ledger_limiter_decisions_total", &slots);
    assert_eq!(counted, refused as f64, "each refused slot in this scrape");
    app.stop().await;

    let (app, _) = spawn_observed_app(config(true)).await;
    let statuses = burst(&app, &key).await;
    assert!(statuses.iter().all(|s| s.as_u16() == 200), "{statuses:?}");
    let text = app.get("/metrics", None).await.text().await.unwrap();
    let slots = [slot_plan.as_str()];
    let shadowed = metric_sum(&text, "ledger_limiter_shadow_passed_total", &slots);
    assert!(
        shadowed > 0.0,
        "refused slots let through in shadow are counted"
    );
    app.stop().await;
}

/// A refusal let through on a shadow route is no 429: its span says `ratelimit.shadow` and has
/// no `limited` event (the README's "on every 429"); it had one, as the refusal was built first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shadow_pass_has_no_limited_event() {
    telemetry(); // first: it sets the environment, before this test starts anything
    let mut config = test_config(shared_ledger().address);
    config.plans = Some([("shadowed".to_owned(), plan(1, 30))].into());
    config.default_plan = Some("shadowed".to_owned());
    config.routes.shadow = Some(vec!["/*".to_owned()]);
    let (app, _) = spawn_observed_app(config).await;
    let key = fresh_key("secret_");
    let traces = [0, 1].map(|_| format!("{:032x}", rand::random::<u128>()));
    for trace in &traces {
        assert_eq!(traced_get(&app, &key, trace).await.status(), 200);
    }
    let spans = server_spans_of_trace(&traces[1]).await;
    let server = decided_span(&spans);
    assert_eq!(attribute(server, "ratelimit.decision").unwrap(), "limited");
    assert_eq!(attribute(server, "ratelimit.shadow").unwrap(), "true");
    let events: Vec<_> = server.events.iter().map(|e| &e.name).collect();
    assert!(!events.iter().any(|name| *name == "limited"), "{events:?}");
    app.stop().await;
}

/// A lease plan on a route with route limits holds per request (one chain each): its holds count
/// in `lease_transfers_total`, the numerator of the transfers per admitted request the README
/// has operators read; they were left out, and the ratio read low on such routes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_plans_hold_under_a_route_limit_is_a_transfer_counted() {
    use ledger_limiter::config::PlanFile;
    telemetry();
    let mut config = test_config(shared_ledger().address);
    let mut leased = plan(100, 60);
    leased.lease_units_max = Some(10);
    leased.lease_seconds = Some(5);
    config.plans = Some([("leasedroute".to_owned(), leased)].into());
    config.default_plan = Some("leasedroute".to_owned());
    let limits: [(String, PlanFile); 1] = [("burst".into(), plan(10, 60))];
    config.limits = Some(limits.into());
    config.routes.limits = Some([("/greeting".to_owned(), vec!["burst".into()])].into());
    let (app, _) = spawn_observed_app(config).await;
    let key = fresh_key("k_");
    assert_eq!(app.get("/greeting", Some(&key)).await.status(), 200);
    let text = app.get("/metrics", None).await.text().await.unwrap();
    let plan = ["plan=\"leasedroute\""];
    let admitted = ["decision=\"admitted\"", "plan=\"leasedroute\""];
    assert_eq!(
        metric_sum(&text, "ledger_limiter_decisions_total", &admitted),
        1.0
    );
    assert_eq!(
        metric_sum(&text, "ledger_limiter_lease_transfers_total", &plan),
        1.0,
        "{text}"
    );
    app.stop().await;
}

/// 40 requests of `key` at once.
async fn burst(app: &TestApp, key: &str) -> Vec<reqwest::StatusCode> {
    let requests = (0..40).map(|_| async { app.get("/greeting", Some(key)).await.status() });
    futures_util::future::join_all(requests).await
}

/// A give-back waits for a place under a full in-flight bound, and the wait is part of the call:
/// one that waits out its deadline is a call failed at its deadline, in the latency histogram
/// and the errors alike, not a refusal at once that left no duration.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_void_that_waits_out_its_deadline_is_counted_as_a_call_failed_at_it() {
    let _alone = LEDGER_FAILURES.lock().await;
    let prometheus = &telemetry().prometheus;
    let process = TestLedger::start(); // its own: stopped for a while below
    let full = full_bound(&process).await;
    let failed = ["operation=\"create_transfers\"", "outcome=\"error\""];
    let histogram = |text: &str| {
        let count = metric_sum(
            text,
            "ledger_limiter_ledger_call_duration_seconds_count",
            &failed,
        );
        let sum = metric_sum(
            text,
            "ledger_limiter_ledger_call_duration_seconds_sum",
            &failed,
        );
        (count, sum)
    };
    let overloaded = ["kind=\"overloaded\""];
    let errors = |text: &str| metric_sum(text, "ledger_limiter_ledger_errors_total", &overloaded);
    let before = prometheus.render();
    let ((count, sum), errors_before) = (histogram(&before), errors(&before));
    let deadline = Instant::now() + Duration::from_millis(300);
    let void = full.ledger.void(full.transfer_id, deadline).await;
    process.pause(false);
    let after = prometheus.render();
    let ((count_after, sum_after), errors_after) = (histogram(&after), errors(&after));
    assert!(matches!(
        void,
        Err(ledger_limiter::ledger::LedgerError::Overloaded { .. })
    ));
    // Exactly this call: no other test of this binary fails a ledger call meanwhile (they
    // take `LEDGER_FAILURES`), so another's failure cannot stand in for it.
    assert_eq!(count_after - count, 1.0, "the call failed, once");
    assert_eq!(
        errors_after - errors_before,
        1.0,
        "an error of its kind, once"
    );
    // Timed from the wait's start, a little after this test's deadline was set.
    let waited = sum_after - sum;
    assert!((0.25..1.5).contains(&waited), "at its deadline: {waited}");
}

/// Taken by each test of this binary that sends a request without a key, for its whole run: the
/// count of rejected keys is process-wide, and one test counts its own exactly.
static KEYLESS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Taken by each test of this binary that makes ledger calls fail, for its whole run: the
/// failure counters are process-wide, and one test's failures must not count as another's.
static LEDGER_FAILURES: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A request failed closed by a stopped ledger is an error in its trace: its server span (a
/// 503 the limiter answers itself, which tracing-actix-web's default exported `OK`) and the
/// ledger call that missed its deadline. A 429 is not an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_failed_closed_is_an_error_in_its_trace() {
    telemetry(); // first: it sets the environment, before this test starts anything
    let _alone = LEDGER_FAILURES.lock().await;
    let ledger = TestLedger::start();
    let mut config = test_config(ledger.address);
    config.ledger.failure_policy = Some("closed".into());
    config.ledger.timeout_ms = Some(300);
    let (app, _) = spawn_observed_app(config).await;
    let key = fresh_key("k_");
    let admitted = format!("{:032x}", rand::random::<u128>());
    assert_eq!(traced_get(&app, &key, &admitted).await.status(), 200);
    ledger.pause(true);
    let failed = format!("{:032x}", rand::random::<u128>());
    assert_eq!(traced_get(&app, &key, &failed).await.status(), 503);
    ledger.pause(false);
    let status_of = |spans: &[ExportedSpan], kind: &str| {
        let span = spans.iter().find(|s| s.kind == kind).expect(kind);
        span.status.as_ref().map(|s| s.code.clone())
    };
    let spans = server_spans_of_trace(&failed).await;
    let error = Some("STATUS_CODE_ERROR".to_owned());
    assert_eq!(status_of(&spans, "SPAN_KIND_SERVER"), error, "{spans:#?}");
    let server = spans.iter().find(|s| s.kind == "SPAN_KIND_SERVER").unwrap();
    let status = int_attribute(server, "http.response.status_code");
    assert_eq!(status, Some(503));
    assert_eq!(attribute(server, "error.type").as_deref(), Some("503"));
    assert_eq!(status_of(&spans, "SPAN_KIND_CLIENT"), error, "{spans:#?}");
    let spans = server_spans_of_trace(&admitted).await;
    assert_ne!(status_of(&spans, "SPAN_KIND_SERVER"), error, "{spans:#?}");
    app.stop().await;
}

/// The Envoy front end's span continues the trace Envoy sends (`traceparent` in the call's
/// metadata), as the HTTP front end's does: each call was the root of a trace of its own, apart
/// from the request it decided.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_envoy_call_continues_the_trace_envoy_sends() {
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
    use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
    telemetry(); // first: it sets the environment, before this test starts anything
    let rules = tempfile::tempdir().unwrap();
    let rule = "domain: traced\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: minute\n      requests_per_unit: 5\n";
    std::fs::write(rules.path().join("traced.yaml"), rule).unwrap();
    let mut config = test_config(shared_ledger().address);
    config.rls = ledger_limiter::config::RlsFile {
        listen: Some("127.0.0.1:0".to_owned()),
        config: Some(rules.path().to_owned()),
        ..ledger_limiter::config::RlsFile::default()
    };
    let (app, _) = spawn_observed_app(config).await;
    let port = app.rls_port.expect("the Envoy front end on");
    let address = format!("http://127.0.0.1:{port}");
    let mut client = RateLimitServiceClient::connect(address).await.unwrap();
    let descriptor = RateLimitDescriptor {
        entries: vec![Entry {
            key: "k".to_owned(),
            value: fresh_key("v_"),
        }],
        ..RateLimitDescriptor::default()
    };
    let mut call = tonic::Request::new(RateLimitRequest {
        domain: "traced".to_owned(),
        descriptors: vec![descriptor],
        hits_addend: 0,
    });
    let trace_id = format!("{:032x}", rand::random::<u128>());
    let traceparent = format!("00-{trace_id}-00f067aa0ba902b7-01");
    call.metadata_mut()
        .insert("traceparent", traceparent.parse().unwrap());
    client.should_rate_limit(call).await.unwrap();
    let span = envoy_span_of_trace(&trace_id).await;
    assert_eq!(span.parent_span_id, "00f067aa0ba902b7", "in Envoy's trace");
    assert_eq!(span.kind, "SPAN_KIND_SERVER");
    app.stop().await;
}

/// The Envoy front end's span of `trace_id`, once the receiver got it over OTLP (at most 10 s).
async fn envoy_span_of_trace(trace_id: &str) -> ExportedSpan {
    let t = telemetry();
    let flushed = tokio::task::spawn_blocking(|| telemetry().provider.force_flush()).await;
    flushed.unwrap().expect("the spans are exported over OTLP");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let found = {
            let spans = t.spans.lock().unwrap();
            let found = spans
                .iter()
                .find(|s| s.trace_id == trace_id && s.name == "ShouldRateLimit");
            found.cloned()
        };
        if let Some(span) = found {
            return span;
        }
        assert!(
            Instant::now() < deadline,
            "no Envoy span of trace {trace_id}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
