//! The Envoy front end as Envoy calls it: a tonic client over a real socket, the real server
//! (`Application` with its RLS listener, or the binary), a real TigerBeetle.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{
    Entry, RateLimitOverride,
};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::UInt64Value;
use futures_util::future::join_all;
use ledger_limiter::config::{FileConfig, LedgerFile, RlsFile, Settings};
use ledger_limiter::startup::{Application, Exporters};
use tonic::transport::Channel;

type Client = RateLimitServiceClient<Channel>;

const ANOTHER: &str = include_str!("envoy_config/integration_another.yaml");
const BASIC: &str = include_str!("envoy_config/integration_basic.yaml");

/// Our own rules beside envoyproxy/ratelimit's: extensions and the features its integration
/// configs do not use.
const EXTRA: &str = r#"
domain: extra
descriptors:
  - key: unlimited
    rate_limit:
      unlimited: true
  - key: short
    rate_limit:
      requests_per_unit: 5
      window_seconds: 2
  - key: slot
    concurrency: true
    rate_limit:
      requests_per_unit: 2
      window_seconds: 2
  - key: costly
    rate_limit:
      requests_per_unit: 10
      unit: minute
  - key: shadowed
    shadow_mode: true
    rate_limit:
      requests_per_unit: 1
      unit: minute
  - key: costly_short
    rate_limit:
      requests_per_unit: 10
      window_seconds: 10
  - key: counted
    rate_limit:
      requests_per_unit: 10
      unit: minute
  - key: tallied
    rate_limit:
      requests_per_unit: 10
      unit: minute
  - key: counted_partner
    value: sk_partner_0123456789
    rate_limit:
      requests_per_unit: 10
      unit: minute
  - key: counted_shadow
    shadow_mode: true
    rate_limit:
      requests_per_unit: 1
      unit: minute
  - key: operated
    rate_limit:
      requests_per_unit: 10
      unit: minute
  - key: operated_shadow
    shadow_mode: true
    rate_limit:
      requests_per_unit: 10
      unit: minute
  - key: shadowed_pair
    shadow_mode: true
    rate_limit:
      requests_per_unit: 2
      unit: minute
  - key: general
    rate_limit:
      name: general
      requests_per_unit: 3
      unit: minute
  - key: specific
    rate_limit:
      name: specific
      requests_per_unit: 100
      unit: minute
      replaces:
        - name: general
  - key: vip
    rate_limit:
      unlimited: true
      replaces:
        - name: general
"#;

/// A directory with the three rule files. Kept until this test binary runs again (in cargo's
/// scratch folder for integration tests, emptied at the first of each run): each test's app
/// runs until the binary ends, and a folder deleted under it was a refused change, counted in
/// the process-wide metric that one test counts exactly.
struct RulesDir(std::path::PathBuf);

impl RulesDir {
    fn path(&self) -> &Path {
        &self.0
    }
}

fn rules_dir() -> RulesDir {
    static PARENT: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    let parent = PARENT.get_or_init(|| {
        let parent = Path::new(env!("CARGO_TARGET_TMPDIR")).join("envoy-rules");
        let _ = std::fs::remove_dir_all(&parent); // the last run's
        std::fs::create_dir_all(&parent).expect("the rules' folder");
        parent
    });
    let dir = tempfile::Builder::new()
        .tempdir_in(parent)
        .expect("tempdir")
        .keep();
    for (name, text) in [
        ("another.yaml", ANOTHER),
        ("basic.yaml", BASIC),
        ("extra.yaml", EXTRA),
    ] {
        std::fs::write(dir.join(name), text).unwrap();
    }
    RulesDir(dir)
}

fn rls_config(
    ledger: std::net::SocketAddr,
    rules: &Path,
    policy: &str,
    timeout_ms: u64,
) -> FileConfig {
    let mut config = test_config(ledger);
    config.ledger = LedgerFile {
        failure_policy: Some(policy.to_owned()),
        timeout_ms: Some(timeout_ms),
        ..config.ledger
    };
    config.rls = RlsFile {
        listen: Some("127.0.0.1:0".to_owned()),
        config: Some(rules.to_owned()),
        ..RlsFile::default()
    };
    config
}

/// An application with its RLS listener on, and a client connected to it.
async fn spawn_rls(config: FileConfig) -> (TestApp, Client) {
    let (app, port) = spawn_rls_port(config).await;
    (app, client(port).await)
}

/// An application with its RLS listener on, and that listener's port.
async fn spawn_rls_port(config: FileConfig) -> (TestApp, u16) {
    let settings = Settings::with_overrides(config).expect("valid test configuration");
    let application = Application::build(settings, Exporters::default())
        .await
        .expect("application builds");
    assert!(application.wait_for_ledger(Duration::from_secs(20)).await);
    let port = application.rls_port().expect("RLS listener on");
    (run(application), port)
}

async fn client(port: u16) -> Client {
    RateLimitServiceClient::connect(format!("http://127.0.0.1:{port}"))
        .await
        .expect("the RLS listener accepts")
}

fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(key, value)| Entry {
                key: (*key).to_owned(),
                value: (*value).to_owned(),
            })
            .collect(),
        ..RateLimitDescriptor::default()
    }
}

fn request(domain: &str, descriptors: Vec<RateLimitDescriptor>) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.to_owned(),
        descriptors,
        hits_addend: 0,
    }
}

async fn call(client: &mut Client, request: RateLimitRequest) -> RateLimitResponse {
    client
        .should_rate_limit(request)
        .await
        .expect("an answer")
        .into_inner()
}

fn header<'a>(response: &'a RateLimitResponse, name: &str) -> Option<&'a str> {
    response
        .response_headers_to_add
        .iter()
        .find(|h| h.key.eq_ignore_ascii_case(name))
        .map(|h| h.value.as_str())
}

fn overall(response: &RateLimitResponse) -> Code {
    Code::try_from(response.overall_code).expect("a known code")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wire_parity_with_envoyproxy_ratelimit_integration_cases() {
    let rules_kept = rules_dir();
    let rules = rules_kept.path().to_path_buf();
    let (_app, mut client) =
        spawn_rls(rls_config(shared_ledger().address, &rules, "closed", 5_000)).await;
    let value = fresh_key("v");
    // key2: 20 per minute. 20 OKs with limit_remaining 19 → 0, then OVER_LIMIT.
    for remaining in (0..20).rev() {
        let response = call(
            &mut client,
            request("another", vec![descriptor(&[("key2", &value)])]),
        )
        .await;
        assert_eq!(overall(&response), Code::Ok);
        assert_eq!(response.statuses.len(), 1);
        let status = &response.statuses[0];
        assert_eq!(status.code, Code::Ok as i32);
        assert_eq!(status.limit_remaining, remaining);
        let limit = status.current_limit.as_ref().expect("a current limit");
        assert_eq!(
            (limit.requests_per_unit, limit.unit),
            (20, 2),
            "20 per MINUTE"
        );
        assert!(status
            .duration_until_reset
            .is_some_and(|d| (1..=61).contains(&d.seconds)));
        assert_eq!(
            header(&response, "RateLimit-Policy"),
            Some("\"key2\";q=20;w=60")
        );
    }
    let limited = call(
        &mut client,
        request("another", vec![descriptor(&[("key2", &value)])]),
    )
    .await;
    assert_eq!(overall(&limited), Code::OverLimit);
    assert_eq!(limited.statuses[0].code, Code::OverLimit as i32);
    assert_eq!(limited.statuses[0].limit_remaining, 0);
    let retry_after: u64 = header(&limited, "Retry-After")
        .expect("Retry-After")
        .parse()
        .unwrap();
    assert!((1..=61).contains(&retry_after), "{retry_after}");
    assert!(header(&limited, "RateLimit").unwrap().contains(";r=0;"));

    // An unknown descriptor: OK, no current limit. Unlimited: the most there is. One status each.
    let mixed = request(
        "extra",
        vec![
            descriptor(&[("nothing", "x")]),
            descriptor(&[("unlimited", "x")]),
        ],
    );
    let response = call(&mut client, mixed).await;
    assert_eq!(overall(&response), Code::Ok);
    assert_eq!(response.statuses.len(), 2);
    assert_eq!(response.statuses[0].current_limit, None);
    assert_eq!(response.statuses[1].limit_remaining, u32::MAX);
    let unknown_domain = call(
        &mut client,
        request("nowhere", vec![descriptor(&[("key2", "x")])]),
    )
    .await;
    assert_eq!(overall(&unknown_domain), Code::Ok);
    assert_eq!(unknown_domain.statuses[0].current_limit, None);

    // A request Envoy's own configuration got wrong: INVALID_ARGUMENT, as envoyproxy/ratelimit
    // answers (these come from the proxy's configuration, not from a client).
    for bad in [
        request("", vec![descriptor(&[("key2", "x")])]),
        request("another", vec![]),
        request(
            "another",
            (0..65).map(|_| descriptor(&[("key2", "x")])).collect(),
        ),
    ] {
        let status = client.should_rate_limit(bad).await.expect_err("refused");
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    }
    // What a client can put in a descriptor is decided, never an error: Envoy lets a request
    // through when the call fails (its default), so an error skipped every limit. A value of any
    // length is counted like any other (it is hashed into its account's id).
    let long = fresh_key(&"x".repeat(300));
    let by_long_value = || request("another", vec![descriptor(&[("key2", &long)])]);
    let first = call(&mut client, by_long_value()).await;
    let second = call(&mut client, by_long_value()).await;
    assert_eq!(overall(&first), Code::Ok);
    assert!(first.statuses[0].current_limit.is_some(), "key2's rule");
    assert_eq!(
        second.statuses[0].limit_remaining + 1,
        first.statuses[0].limit_remaining,
        "counted"
    );
    // An empty descriptor is no limit; hits beyond any limit are over it.
    let mut huge = descriptor(&[("key2", &fresh_key("v"))]);
    huge.hits_addend = Some(UInt64Value { value: u64::MAX });
    let mixed = call(&mut client, request("another", vec![descriptor(&[]), huge])).await;
    assert_eq!(overall(&mixed), Code::OverLimit);
    assert_eq!(mixed.statuses[0].current_limit, None);
    assert_eq!(mixed.statuses[0].code, Code::Ok as i32);
    assert_eq!(mixed.statuses[1].code, Code::OverLimit as i32);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exhausted_hourly_descriptor_leaves_the_minute_one_untouched() {
    let rules_kept = rules_dir();
    let rules = rules_kept.path().to_path_buf();
    let (_app, mut client) =
        spawn_rls(rls_config(shared_ledger().address, &rules, "closed", 5_000)).await;
    let value = fresh_key("v");
    // key2 20/min and key3 10/h, as in envoyproxy/ratelimit's "another" integration test.
    let both = || {
        request(
            "another",
            vec![
                descriptor(&[("key2", &value)]),
                descriptor(&[("key3", &value)]),
            ],
        )
    };
    for i in 0..10u32 {
        let response = call(&mut client, both()).await;
        assert_eq!(overall(&response), Code::Ok, "request {i}");
        assert_eq!(response.statuses[0].limit_remaining, 19 - i);
        assert_eq!(response.statuses[1].limit_remaining, 9 - i);
    }
    for _ in 0..5 {
        let response = call(&mut client, both()).await;
        assert_eq!(overall(&response), Code::OverLimit);
        assert_eq!(response.statuses[0].code, Code::Ok as i32);
        assert_eq!(response.statuses[1].code, Code::OverLimit as i32);
        assert_eq!(
            response.statuses[0].limit_remaining, 10,
            "the minute limit did not move"
        );
    }
    // Nothing was held on key2 by the refusals: alone, it still has 10, as the ledger says (a
    // fresh instance reads the account; this one's memory never saw holds it did not place).
    let (_fresh, mut fresh) =
        spawn_rls(rls_config(shared_ledger().address, &rules, "closed", 5_000)).await;
    let alone = call(
        &mut fresh,
        request("another", vec![descriptor(&[("key2", &value)])]),
    )
    .await;
    assert_eq!(alone.statuses[0].limit_remaining, 9);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_instances_admit_exactly_the_limit_in_every_window() {
    let rules_kept = rules_dir();
    let rules = rules_kept.path().to_path_buf();
    let ledger = shared_ledger().address;
    let mut clients = Vec::new();
    let mut apps = Vec::new();
    for _ in 0..3 {
        let (app, client) = spawn_rls(rls_config(ledger, &rules, "closed", 5_000)).await;
        apps.push(app);
        clients.push(client);
    }
    let value = fresh_key("v");
    // "short": 5 per 2-second sliding window. Two rounds, one window apart.
    for round in 0..2 {
        let calls = (0..30).map(|i| {
            let mut client = clients[i % 3].clone();
            let request = request("extra", vec![descriptor(&[("short", &value)])]);
            async move { call(&mut client, request).await }
        });
        let responses = join_all(calls).await;
        let admitted = responses.iter().filter(|r| overall(r) == Code::Ok).count();
        assert_eq!(
            admitted, 5,
            "round {round}: exactly the limit across three instances"
        );
        // Past the window (2 s) and the local view's margin (250 ms), with room to spare on a
        // loaded machine: 2.4 s left 150 ms.
        tokio::time::sleep(Duration::from_millis(3_000)).await;
    }
}

/// The gRPC path of `ShouldRateLimit`, for calls made without the generated client.
const SHOULD_RATE_LIMIT: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// A connection to the RLS listener on `port`.
async fn connect(port: u16) -> Channel {
    Channel::from_shared(format!("http://127.0.0.1:{port}"))
        .unwrap()
        .connect()
        .await
        .expect("the RLS listener accepts")
}

/// `request` with `value` as raw bytes (what Envoy forwards of a client's header, UTF-8 or not),
/// sent as the generated client would, and its answer.
async fn call_raw(channel: Channel, value: &[u8]) -> Result<RateLimitResponse, tonic::Status> {
    use ledger_limiter::envoy::wire::{WireDescriptor, WireEntry, WireRequest};
    let request = WireRequest {
        domain: b"extra".to_vec(),
        descriptors: vec![WireDescriptor {
            entries: vec![WireEntry {
                key: b"short".to_vec(),
                value: value.to_vec(),
            }],
            ..WireDescriptor::default()
        }],
        hits_addend: 0,
    };
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.expect("connected");
    let path = tonic::codegen::http::uri::PathAndQuery::from_static(SHOULD_RATE_LIMIT);
    let codec = tonic_prost::ProstCodec::<WireRequest, RateLimitResponse>::default();
    let answer = grpc.unary(tonic::Request::new(request), path, codec).await;
    answer.map(tonic::Response::into_inner)
}

/// At most `rls.connections_max` connections are served at once: one more waits (in the listen
/// backlog) until one of them ends, then is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_bound_wait_until_one_ends() {
    let rules_kept = rules_dir();
    let mut config = rls_config(shared_ledger().address, rules_kept.path(), "closed", 5_000);
    config.rls.connections_max = Some(2);
    let (_app, port) = spawn_rls_port(config).await;
    let value = fresh_key("bounded");
    let one = || request("another", vec![descriptor(&[("key2", &value)])]);
    let (mut first, mut second) = (client(port).await, client(port).await);
    assert_eq!(overall(&call(&mut first, one()).await), Code::Ok);
    assert_eq!(overall(&call(&mut second, one()).await), Code::Ok);
    let mut third = client(port).await;
    let waiting = tokio::time::timeout(Duration::from_secs(1), third.should_rate_limit(one()));
    assert!(
        waiting.await.is_err(),
        "a third connection is not served while two are open"
    );
    drop(first);
    let served = tokio::time::timeout(Duration::from_secs(5), third.should_rate_limit(one()));
    let served = served.await.expect("served once a connection ended");
    assert_eq!(overall(&served.expect("an answer").into_inner()), Code::Ok);
    // The bound holds again: the second and third are open.
    let mut fourth = client(port).await;
    let waiting = tokio::time::timeout(Duration::from_secs(1), fourth.should_rate_limit(one()));
    assert!(
        waiting.await.is_err(),
        "the bound holds after a connection ended"
    );
    assert_eq!(overall(&call(&mut second, one()).await), Code::Ok);
}

/// Past `rls.calls_max` calls in flight, a call is answered at once under the failure policy
/// (`UNAVAILABLE` closed, `OK` with no statuses open), its body unread; once a place frees, calls
/// are decided again. Each such call is counted in `ledger_limiter_rls_shed_calls_total`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_past_the_bound_are_answered_at_once_under_the_failure_policy() {
    let recorder = recorder();
    let rules_kept = rules_dir();
    for policy in ["closed", "open"] {
        let mut config = rls_config(shared_ledger().address, rules_kept.path(), policy, 1_000);
        config.rls.calls_max = Some(1);
        // Only this test sheds: the count is its own, whatever runs beside it.
        let shed_before = shed_calls(recorder);
        let (_app, port) = spawn_rls_port(config).await;
        let mut client = client(port).await;
        let value = fresh_key("shed");
        let one = || request("another", vec![descriptor(&[("key2", &value)])]);
        let shed = |answer: &Result<tonic::Response<RateLimitResponse>, tonic::Status>| match answer
        {
            Err(status) => status.message().contains("rls.calls_max"),
            Ok(response) => response.get_ref().statuses.is_empty(),
        };
        // The only place: a call whose message never comes, held until its bound (1 s + 1 s).
        let mut holding = hold(port).await;
        let started = Instant::now();
        let answer = loop {
            let answer = client.should_rate_limit(one()).await;
            if shed(&answer) {
                break answer;
            }
            // Decided: the holding call was not in yet, or this one took the place first and
            // it was shed, or its bound ended it: hold the place again.
            if holding.is_finished() {
                holding = hold(port).await;
            }
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "{policy}: never shed"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert!(shed(&answer), "{policy}: not shed: {answer:?}");
        assert!(shed_calls(recorder) > shed_before, "{policy}: counted");
        match (policy, answer) {
            ("closed", Err(status)) => assert_eq!(status.code(), tonic::Code::Unavailable),
            ("open", Ok(response)) => assert_eq!(overall(response.get_ref()), Code::Ok),
            (_, answer) => panic!("{policy}: {answer:?}"),
        }
        let ended = holding.await.expect("the holding call's task");
        assert_eq!(
            ended.expect_err("never decided").code(),
            tonic::Code::Cancelled
        );
        let fresh = fresh_key("after");
        let after = request("another", vec![descriptor(&[("key2", &fresh)])]);
        let decided = call(&mut client, after).await;
        assert_eq!(
            decided.statuses.len(),
            1,
            "{policy}: decided once the place is free"
        );
        assert_eq!(overall(&decided), Code::Ok);
    }
}

/// This test binary's one `metrics` recorder, installed by the first test that reads it.
fn recorder() -> &'static metrics_exporter_prometheus::PrometheusHandle {
    static RECORDER: std::sync::OnceLock<metrics_exporter_prometheus::PrometheusHandle> =
        std::sync::OnceLock::new();
    RECORDER.get_or_init(|| {
        metrics_exporter_prometheus::PrometheusBuilder::new()
            .install_recorder()
            .expect("the only recorder of this test binary")
    })
}

/// The count of the counter `series` (its name and labels, as rendered) in `recorder` (0 before
/// any front end registered it).
fn count_of(recorder: &metrics_exporter_prometheus::PrometheusHandle, series: &str) -> u64 {
    let text = recorder.render();
    let line = text
        .lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '));
    line.map_or(0, |count| count.parse().unwrap())
}

/// `ledger_limiter_rls_shed_calls_total` as `recorder` renders it.
fn shed_calls(recorder: &metrics_exporter_prometheus::PrometheusHandle) -> u64 {
    count_of(recorder, "ledger_limiter_rls_shed_calls_total")
}

/// A call whose message never comes, on a connection of its own: it holds a place under
/// `rls.calls_max` until the server ends it (the decision's deadline and a second).
async fn hold(
    port: u16,
) -> tokio::task::JoinHandle<Result<tonic::Response<RateLimitResponse>, tonic::Status>> {
    use ledger_limiter::envoy::wire::WireRequest;
    let mut grpc = tonic::client::Grpc::new(connect(port).await);
    grpc.ready().await.expect("connected");
    let holding = tokio::spawn(async move {
        let path = tonic::codegen::http::uri::PathAndQuery::from_static(SHOULD_RATE_LIMIT);
        let codec = tonic_prost::ProstCodec::<WireRequest, RateLimitResponse>::default();
        let never = futures_util::stream::pending::<WireRequest>();
        grpc.client_streaming(tonic::Request::new(never), path, codec)
            .await
    });
    // Its headers on their way before the caller's next call.
    tokio::time::sleep(Duration::from_millis(50)).await;
    holding
}

/// An operator finds an Envoy caller's account by its descriptor (`/admin/envoy/lookup`) and
/// acts on it as on any caller's: inspected, it holds what the calls charged; blocked, its calls
/// are refused, and a shadow rule's pass of it is counted as blocked. Before, no path named such
/// an account (it derives from every entry of the descriptor): an abusive Envoy caller could not
/// be blocked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_finds_and_blocks_an_envoy_callers_account() {
    let recorder = recorder();
    let rules_kept = rules_dir();
    let mut config = rls_config(shared_ledger().address, rules_kept.path(), "closed", 5_000);
    const SECRET: &str = "admin-secret-for-tests-0002";
    config.admin = ledger_limiter::config::AdminFile {
        listen: Some("127.0.0.1:0".into()),
        secrets: Some(vec![SECRET.into()]),
    };
    let (app, port) = spawn_rls_port(config).await;
    let mut client = client(port).await;
    let admin = format!("http://127.0.0.1:{}/admin", app.admin_port.unwrap());
    let post = |path: &str, body: serde_json::Value| {
        let request = app.http.post(format!("{admin}{path}")).bearer_auth(SECRET);
        async move {
            let response = request.json(&body).send().await.unwrap();
            let status = response.status().as_u16();
            (status, response.json::<serde_json::Value>().await.unwrap())
        }
    };
    let value = fresh_key("sk_live_");
    let mut answers = Vec::new();
    let lookup = |key: &str| {
        let entries = serde_json::json!([{"key": key, "value": value}]);
        post(
            "/envoy/lookup",
            serde_json::json!({"domain": "extra", "entries": entries}),
        )
    };
    let one = |key: &str| request("extra", vec![descriptor(&[(key, &value)])]);
    for key in ["operated", "operated_shadow"] {
        assert_eq!(overall(&call(&mut client, one(key)).await), Code::Ok);
        let (status, found) = lookup(key).await;
        assert_eq!(status, 200, "{found}");
        answers.push(found.clone());
        assert_eq!(found["rule"], format!("extra.{key}"), "{found}");
        assert_eq!(found["requests_per_unit"], 10, "{found}");
        assert_eq!(found["window_seconds"], 60, "{found}");
        assert_eq!(found["shadow_mode"], key == "operated_shadow", "{found}");
        let id = found["account_id"].as_str().unwrap().to_owned();
        let inspected = app
            .http
            .get(format!("{admin}/callers/{id}"))
            .bearer_auth(SECRET);
        let audit: serde_json::Value = inspected.send().await.unwrap().json().await.unwrap();
        assert_eq!(audit["debits_pending"], 1, "the call's hold: {audit}");
        let block = serde_json::json!({"seconds": 60, "reason": "abuse"});
        let (status, blocked) = post(&format!("/callers/{id}/block"), block).await;
        assert_eq!(status, 200, "{blocked}");
    }
    // The block reaches the front end through the ledger (its local view learns it there).
    let refused = call(&mut client, one("operated")).await;
    assert_eq!(overall(&refused), Code::OverLimit, "{refused:?}");
    let passed = call(&mut client, one("operated_shadow")).await;
    assert_eq!(overall(&passed), Code::Ok, "shadow rules never deny");
    let series = r#"ledger_limiter_shadow_passed_total{frontend="envoy",decision="blocked",plan="extra.operated_shadow"} 1"#;
    let text = recorder.render();
    assert!(
        text.lines().any(|line| line == series),
        "{series} in:\n{text}"
    );
    // A value with U+FFFD (a caller chooses its key): looked up as the call decodes it, the
    // account its call holds on.
    let marked = format!("{value}\u{FFFD}");
    let call_marked = request("extra", vec![descriptor(&[("operated_shadow", &marked)])]);
    assert_eq!(overall(&call(&mut client, call_marked).await), Code::Ok);
    let entries = serde_json::json!([{"key": "operated_shadow", "value": marked}]);
    let body = serde_json::json!({"domain": "extra", "entries": entries});
    let (status, found) = post("/envoy/lookup", body).await;
    assert_eq!(status, 200, "{found}");
    let id = found["account_id"].as_str().unwrap();
    let inspected = app.http.get(format!("{admin}/callers/{id}"));
    let inspected = inspected.bearer_auth(SECRET).send().await.unwrap();
    assert_eq!(inspected.status(), 200, "the call's account");
    let audit: serde_json::Value = inspected.json().await.unwrap();
    assert_eq!(audit["debits_pending"], 1, "the call's hold: {audit}");
    // A descriptor no rule counts, and one past a call's bounds.
    let (status, problem) = lookup("no_such_key").await;
    assert_eq!(status, 404, "{problem}");
    answers.push(problem);
    let (status, problem) = lookup("unlimited").await;
    assert_eq!(status, 404, "{problem}");
    assert!(problem["detail"].as_str().unwrap().contains("unlimited"));
    answers.push(problem);
    let empty = serde_json::json!({"domain": "extra", "entries": []});
    let (status, problem) = post("/envoy/lookup", empty).await;
    assert_eq!(status, 400, "{problem}");
    // A value as long as a token in a header (Envoy sends headers of up to 60 KiB).
    let long = "t".repeat(20_000);
    let entries = serde_json::json!([{"key": "operated", "value": long}]);
    let body = serde_json::json!({"domain": "extra", "entries": entries});
    let (status, found) = post("/envoy/lookup", body).await;
    assert_eq!(status, 200, "{found}");
    // Values (API keys) never reach the answers of look-ups that carried one.
    for answer in answers {
        assert!(!answer.to_string().contains(&value), "{answer}");
    }
}

/// Rules are read again when their files change, as envoyproxy/ratelimit reloads its runtime
/// directory: a domain added to the folder is in force within a few seconds, without a restart;
/// a file that does not load leaves the rules in force, and is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changed_rules_are_in_force_without_a_restart_and_bad_ones_are_not() {
    let recorder = recorder();
    let rules_kept = rules_dir();
    let config = rls_config(shared_ledger().address, rules_kept.path(), "closed", 5_000);
    let (_app, mut client) = spawn_rls(config).await;
    let value = fresh_key("later_");
    let one = |value: &str| request("later", vec![descriptor(&[("k", value)])]);
    let unlimited = call(&mut client, one(&value)).await;
    assert_eq!(
        unlimited.statuses[0].current_limit, None,
        "no such domain yet"
    );
    // Written whole, then renamed in: a half-written file is never read.
    let write = |text: &str| {
        let staged = rules_kept.path().join("later.staged");
        std::fs::write(&staged, text).unwrap();
        std::fs::rename(&staged, rules_kept.path().join("later.yaml")).unwrap();
    };
    write("domain: later\ndescriptors:\n  - key: k\n    rate_limit:\n      requests_per_unit: 1\n      unit: minute\n");
    let started = Instant::now();
    loop {
        let response = call(&mut client, one(&value)).await;
        if response.statuses[0].current_limit.is_some() {
            assert_eq!(overall(&response), Code::Ok, "the first of 1 a minute");
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "never in force"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        overall(&call(&mut client, one(&value)).await),
        Code::OverLimit
    );
    let refused = |recorder| {
        count_of(
            recorder,
            r#"ledger_limiter_rls_rules_changes_total{outcome="refused"}"#,
        )
    };
    let refused_before = refused(recorder);
    write("domain: later\ndescriptors: [oops");
    // Counted, once (a change is acted on once two readings agree, and not again while it
    // stands): no other app of this test binary refuses a change (their folders stay).
    let started = Instant::now();
    let read_twice = 3 * ledger_limiter::envoy::rules::RULES_CHECK_INTERVAL;
    while refused(recorder) == refused_before || started.elapsed() < read_twice {
        assert!(started.elapsed() < Duration::from_secs(20), "never read");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(refused(recorder), refused_before + 1, "counted once");
    // The rules in force stay: a fresh caller of the domain is still limited.
    let fresh = fresh_key("later_");
    let response = call(&mut client, one(&fresh)).await;
    assert!(response.statuses[0].current_limit.is_some(), "{response:?}");
    assert_eq!(
        overall(&call(&mut client, one(&fresh)).await),
        Code::OverLimit
    );
}

/// Every listener (HTTP, Envoy, admin, metrics) keeps up to 2,048 connections waiting to be
/// accepted (actix-server's default), not std's 128: past that, a burst of new connections had
/// its handshakes dropped, each client trying again a second or more later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listeners_keep_a_backlog_of_2048() {
    let rules_kept = rules_dir();
    let mut config = rls_config(shared_ledger().address, rules_kept.path(), "closed", 5_000);
    config.admin = ledger_limiter::config::AdminFile {
        listen: Some("127.0.0.1:0".into()),
        secrets: Some(vec!["admin-secret-for-tests-0001".into()]),
    };
    config.metrics = ledger_limiter::config::MetricsFile {
        listen: Some("127.0.0.1:0".into()),
    };
    let (app, rls_port) = spawn_rls_port(config).await;
    let somaxconn = std::fs::read_to_string("/proc/sys/net/core/somaxconn").unwrap();
    let somaxconn = somaxconn.trim().parse::<u32>().unwrap();
    assert!(
        somaxconn > 128,
        "net.core.somaxconn {somaxconn} hides std's 128"
    );
    let expected = somaxconn.min(2048);
    let side = [app.admin_port, app.metrics_port].map(|port| port.expect("listening"));
    for port in [app.port, rls_port, side[0], side[1]] {
        // A listening socket's Send-Q, in `ss`, is its backlog.
        let filter = format!("sport = :{port}");
        let ss = std::process::Command::new("ss")
            .args(["-ltnH", &filter])
            .output()
            .expect("ss (iproute2, scripts/setup installs it)");
        let text = String::from_utf8(ss.stdout).unwrap();
        let backlog = text.split_whitespace().nth(2).map(str::parse::<u32>);
        assert_eq!(backlog, Some(Ok(expected)), "port {port}: {text:?}");
    }
}

/// A refused call marks each descriptor with no room for its hits over its limit, not only the
/// one the refusal names (as envoyproxy/ratelimit marks each).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_spent_descriptor_of_a_refused_call_is_over_its_limit() {
    let rules_kept = rules_dir();
    let rules = rules_kept.path().to_path_buf();
    let (_app, mut client) =
        spawn_rls(rls_config(shared_ledger().address, &rules, "closed", 5_000)).await;
    let value = fresh_key("v");
    let counted = || descriptor(&[("counted", &value)]);
    // "counted" is 10 per minute: spent, then asked for twice in one call.
    for _ in 0..10 {
        assert_eq!(
            overall(&call(&mut client, request("extra", vec![counted()])).await),
            Code::Ok
        );
    }
    for _ in 0..2 {
        let twice = call(&mut client, request("extra", vec![counted(), counted()])).await;
        assert_eq!(overall(&twice), Code::OverLimit);
        let codes: Vec<i32> = twice.statuses.iter().map(|s| s.code).collect();
        assert_eq!(codes, [Code::OverLimit as i32; 2], "{twice:?}");
    }
}

/// A call whose body never ends (headers, then nothing: no grpc-timeout either) is ended within
/// the decision's deadline and a second. Before, it held its stream and buffer for as long as
/// its peer kept the connection alive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_whose_body_never_ends_is_ended_in_time() {
    use ledger_limiter::envoy::wire::WireRequest;
    let rules_kept = rules_dir();
    let rules = rules_kept.path().to_path_buf();
    let config = rls_config(shared_ledger().address, &rules, "closed", 500);
    let (_app, port) = spawn_rls_port(config).await;
    let mut grpc = tonic::client::Grpc::new(connect(port).await);
    grpc.ready().await.expect("connected");
    let path = tonic::codegen::http::uri::PathAndQuery::from_static(SHOULD_RATE_LIMIT);
    let codec = tonic_prost::ProstCodec::<WireRequest, RateLimitResponse>::default();
    let never = futures_util::stream::pending::<WireRequest>();
    let started = std::time::Instant::now();
    let call = grpc.client_streaming(tonic::Request::new(never), path, codec);
    let answer = tokio::time::timeout(Duration::from_secs(10), call).await;
    let answer = answer.expect("ended by the server, not by this test");
    let status = answer.expect_err("no decision without a request");
    // Ended by the server's bound on a call, not refused at once for some other reason.
    assert_eq!(status.code(), tonic::Code::Cancelled, "{status:?}");
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(500 + 1_000)
            && took < Duration::from_millis(500 + 1_000 + 3_000),
        "took {took:?}"
    );
}

/// A descriptor value that is not UTF-8 (a client's header bytes, which Envoy forwards as they
/// are) is limited like any other, on an account of its own. The call used to fail (`INTERNAL`),
/// and Envoy then lets the request through with none of its limits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_value_that_is_not_utf8_is_limited_like_any_other() {
    let rules_kept = rules_dir();
    let rules = rules_kept.path().to_path_buf();
    let config = rls_config(shared_ledger().address, &rules, "closed", 5_000);
    let (app, port) = spawn_rls_port(config).await;
    let channel = connect(port).await;
    let mut value = b"\xff".to_vec();
    value.extend(fresh_key("v").as_bytes());
    // "short": 5 per 2-second window.
    let mut codes = Vec::new();
    for _ in 0..6 {
        let response = call_raw(channel.clone(), &value).await.expect("an answer");
        codes.push(overall(&response));
    }
    assert_eq!(&codes[..5], &[Code::Ok; 5], "{codes:?}");
    assert_eq!(codes[5], Code::OverLimit, "limited like any value");
    // Another byte is another caller.
    value[0] = 0xfe;
    let other = call_raw(channel.clone(), &value).await.expect("an answer");
    assert_eq!(overall(&other), Code::Ok);
    // A message under the gRPC bound (1 MiB) whose text would be over it once escaped (each
    // invalid byte five): refused, where each call in flight held five times its size.
    let hostile = vec![0xff_u8; 300 * 1024];
    let refused = call_raw(channel, &hostile).await.expect_err("refused");
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hits_addend_precedence_and_costs_above_what_remains() {
    let rules_kept = rules_dir();
    let rules = rules_kept.path().to_path_buf();
    let (app, mut client) =
        spawn_rls(rls_config(shared_ledger().address, &rules, "closed", 5_000)).await;
    // Started first: the reset asserted below counts from the second charge, and must not count
    // the start of an instance (a second or more on a loaded machine) too.
    let (other_app, mut other) =
        spawn_rls(rls_config(shared_ledger().address, &rules, "closed", 5_000)).await;
    let value = fresh_key("v");
    let costly = |request_hits: u32, descriptor_hits: Option<u64>| {
        let mut d = descriptor(&[("costly", &value)]);
        d.hits_addend = descriptor_hits.map(|value| UInt64Value { value });
        RateLimitRequest {
            hits_addend: request_hits,
            ..request("extra", vec![d])
        }
    };
    // The request's hits_addend (3), then a descriptor's own (4) wins over the request's (1).
    assert_eq!(
        call(&mut client, costly(3, None)).await.statuses[0].limit_remaining,
        7
    );
    // Two seconds apart: the first 3 units come back two seconds before the next 4 do.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        call(&mut client, costly(1, Some(4))).await.statuses[0].limit_remaining,
        3
    );
    // A check (a descriptor's hits_addend of 0) holds nothing and reads the ledger: an instance
    // that never saw the caller says 3 left, not its capacity.
    let calls = request_calls(other_app.limiter.ledger());
    let check = call(&mut other, costly(0, Some(0))).await;
    assert_eq!(
        (overall(&check), check.statuses[0].limit_remaining),
        (Code::Ok, 3)
    );
    // 7 of 10 held: not whole now (a reset of 0 said so), at the latest a window on.
    let reset = check.statuses[0].duration_until_reset.unwrap();
    assert!(reset.seconds >= 1, "{reset:?}");
    // One lookup (not counted here): a check that passes lists no holds.
    let listed = request_calls(other_app.limiter.ledger()) - calls;
    assert_eq!(listed, 0, "no listing");
    // 5 > 3 remaining: OVER_LIMIT, and the 3 are spent, as envoyproxy/ratelimit's counter goes
    // past its limit: a charge reported after the response (tokens counted at stream end) that
    // does not fit still exhausts the budget.
    let over = call(&mut client, costly(5, None)).await;
    assert_eq!(
        (overall(&over), over.statuses[0].limit_remaining),
        (Code::OverLimit, 0)
    );
    // Not when the first 3 units are back (2 more than were free, about 58 s from now): the 3
    // spent now are held a whole window, so 5 are free only once that hold has expired too.
    let reset = over.statuses[0].duration_until_reset.unwrap().seconds;
    assert!((60..=61).contains(&reset), "{reset}");
    let retry: i64 = header(&over, "Retry-After").unwrap().parse().unwrap();
    assert_eq!(retry, reset);
    // Then checks refuse on every instance, and so does a charge of 1.
    for client in [&mut client, &mut other] {
        let check = call(client, costly(0, Some(0))).await;
        assert_eq!(overall(&check), Code::OverLimit, "nothing free");
        let reset = check.statuses[0].duration_until_reset.unwrap().seconds;
        assert!((1..=61).contains(&reset), "{reset}");
    }
    assert_eq!(
        overall(&call(&mut client, costly(1, None)).await),
        Code::OverLimit
    );
    // Nothing free, as that refusal's listing said: a charge above it is refused from memory,
    // with no hold of nothing written.
    let calls = request_calls(app.limiter.ledger());
    let again = call(&mut client, costly(5, None)).await;
    assert_eq!(overall(&again), Code::OverLimit);
    assert_eq!(request_calls(app.limiter.ledger()), calls, "no ledger call");
}

/// A charge refused by one of the call's descriptors counts on the others as far as they go, as
/// envoyproxy/ratelimit adds the hits to every descriptor: a charge reported after the response
/// (tokens counted at the end) that overran the short budget still counts on the long one.
/// Before, only the refusing descriptor was charged, and the long budget never ran out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_charge_counts_on_the_calls_other_descriptors() {
    let rules_kept = rules_dir();
    let rules = rules_kept.path().to_path_buf();
    let (_app, mut client) =
        spawn_rls(rls_config(shared_ledger().address, &rules, "closed", 5_000)).await;
    let value = fresh_key("v");
    let hits = |key: &str, value_hits: u64| {
        let mut d = descriptor(&[(key, &value)]);
        d.hits_addend = Some(UInt64Value { value: value_hits });
        d
    };
    let charge = |short: u64, long: u64| {
        request(
            "extra",
            vec![hits("costly_short", short), hits("costly", long)],
        )
    };
    // The short budget (10 per 10 s) down to 2, the long one (10 a minute) to 9.
    let first = call(&mut client, charge(8, 1)).await;
    let remaining = |r: &RateLimitResponse| -> Vec<u32> {
        r.statuses.iter().map(|s| s.limit_remaining).collect()
    };
    assert_eq!(remaining(&first), [2, 9]);
    // 5 on both: the short one refuses (and spends its 2); the long one is charged the 5.
    let over = call(&mut client, charge(5, 5)).await;
    assert_eq!(overall(&over), Code::OverLimit);
    assert_eq!(remaining(&over), [0, 4]);
    // A check of the long one alone reads the ledger.
    let check = call(&mut client, request("extra", vec![hits("costly", 0)])).await;
    assert_eq!((overall(&check), remaining(&check)), (Code::Ok, vec![4]));
}

/// A charge refused with 3 free and 7 held, due back in 7 s: the 3 are spent for a window
/// (10 s), and the charge of 5 fits once the 7 are back, in about 7 s. The refusal says so,
/// counting the over-charge, rather than when the over-charge itself expires (10 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_over_charge_is_counted_in_when_the_charge_fits() {
    let rules_kept = rules_dir();
    let rules = rules_kept.path().to_path_buf();
    let (_app, mut client) =
        spawn_rls(rls_config(shared_ledger().address, &rules, "closed", 5_000)).await;
    let value = fresh_key("v");
    let charge = |hits: u32| RateLimitRequest {
        hits_addend: hits,
        ..request("extra", vec![descriptor(&[("costly_short", &value)])])
    };
    let placed = std::time::Instant::now();
    let first = call(&mut client, charge(7)).await;
    // The 7 were placed within this call (its provisioning included).
    let first_done = placed.elapsed().as_secs_f64();
    assert_eq!(first.statuses[0].limit_remaining, 3);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let asked = placed.elapsed().as_secs_f64();
    let over = call(&mut client, charge(5)).await;
    let answered = placed.elapsed().as_secs_f64();
    assert_eq!(
        (overall(&over), over.statuses[0].limit_remaining),
        (Code::OverLimit, 0)
    );
    // The 7 are back 10 s after they were placed: from when the refusal was decided, whatever
    // the machine's delays (not the over-charge's own 10 s). Whole seconds, rounded up, and a
    // second more for the ledger's expiry to be seen.
    let reset = over.statuses[0].duration_until_reset.unwrap().seconds as f64;
    let due = (10.0 - answered - 1.0)..=(10.0 + first_done - asked + 2.0);
    assert!(due.contains(&reset), "{reset} s, not in {due:?}");
    // Then it fits.
    tokio::time::sleep(Duration::from_secs(reset as u64)).await;
    assert_eq!(overall(&call(&mut client, charge(5)).await), Code::Ok);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_hits_enforce_a_concurrency_limit_whose_lost_slots_expire() {
    let rules_kept = rules_dir();
    let rules = rules_kept.path().to_path_buf();
    let ledger = shared_ledger().address;
    let (_a, mut a) = spawn_rls(rls_config(ledger, &rules, "closed", 5_000)).await;
    let (_b, mut b) = spawn_rls(rls_config(ledger, &rules, "closed", 5_000)).await;
    let value = fresh_key("v");
    let acquire = || request("extra", vec![descriptor(&[("slot", &value)])]);
    let release = || {
        let mut d = descriptor(&[("slot", &value)]);
        d.is_negative_hits = true;
        request("extra", vec![d])
    };
    // More slots than there are: refused, and none is spent (a slot comes back by a negative
    // hit, one request at a time).
    let mut greedy = descriptor(&[("slot", &value)]);
    greedy.hits_addend = Some(UInt64Value { value: 3 });
    let refused = call(&mut a, request("extra", vec![greedy])).await;
    assert_eq!(overall(&refused), Code::OverLimit);
    assert_eq!(overall(&call(&mut a, acquire()).await), Code::Ok);
    assert_eq!(overall(&call(&mut b, acquire()).await), Code::Ok);
    assert_eq!(
        overall(&call(&mut a, acquire()).await),
        Code::OverLimit,
        "2 in flight"
    );
    // A negative hit of nothing (a refund of what was all used) gives back nothing, and is no
    // check: before, it was one, refused on the full slots.
    let mut nothing = descriptor(&[("slot", &value)]);
    nothing.is_negative_hits = true;
    nothing.hits_addend = Some(UInt64Value { value: 0 });
    assert_eq!(
        overall(&call(&mut b, request("extra", vec![nothing])).await),
        Code::Ok
    );
    assert_eq!(
        overall(&call(&mut a, acquire()).await),
        Code::OverLimit,
        "still 2"
    );
    // Released through the other instance: a slot is free again on both.
    let released = call(&mut b, release()).await;
    assert_eq!(overall(&released), Code::Ok);
    assert_eq!(released.statuses[0].limit_remaining, 1);
    assert_eq!(overall(&call(&mut a, acquire()).await), Code::Ok);
    // Never below zero: releasing more than is held gives back only what is held.
    for _ in 0..3 {
        call(&mut a, release()).await;
    }
    assert_eq!(call(&mut a, release()).await.statuses[0].limit_remaining, 2);
    // A slot whose request never ended (the proxy died) expires with its window (2 s).
    call(&mut a, acquire()).await;
    call(&mut a, acquire()).await;
    assert_eq!(overall(&call(&mut a, acquire()).await), Code::OverLimit);
    tokio::time::sleep(Duration::from_millis(3_000)).await;
    assert_eq!(overall(&call(&mut a, acquire()).await), Code::Ok);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shadow_rules_never_deny_replaced_rules_do_not_apply_and_overrides_do() {
    let rules_kept = rules_dir();
    let rules = rules_kept.path().to_path_buf();
    let (_app, mut client) =
        spawn_rls(rls_config(shared_ledger().address, &rules, "closed", 5_000)).await;
    let value = fresh_key("v");
    for _ in 0..3 {
        let response = call(
            &mut client,
            request("extra", vec![descriptor(&[("shadowed", &value)])]),
        )
        .await;
        assert_eq!(overall(&response), Code::Ok, "shadow mode never denies");
        assert_eq!(response.statuses[0].code, Code::Ok as i32);
    }
    // A request the enforced descriptors refuse consumes nothing on a shadow one either, as
    // enforcing it would: "costly" (10/min) exhausted, then refused beside "shadowed_pair"
    // (2/min, shadow), which then still has one left after its own first request.
    let exhausted = fresh_key("v");
    let costly = || descriptor(&[("costly", &exhausted)]);
    for _ in 0..10 {
        let response = call(&mut client, request("extra", vec![costly()])).await;
        assert_eq!(overall(&response), Code::Ok);
    }
    let pair = fresh_key("v");
    let both = request(
        "extra",
        vec![costly(), descriptor(&[("shadowed_pair", &pair)])],
    );
    assert_eq!(overall(&call(&mut client, both).await), Code::OverLimit);
    // The shadow hold is voided after the answer, in a task of its own: looked at (a hits_addend
    // of 0 holds nothing) until it is.
    let mut look = descriptor(&[("shadowed_pair", &pair)]);
    look.hits_addend = Some(UInt64Value { value: 0 });
    let voided_by = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let response = call(&mut client, request("extra", vec![look.clone()])).await;
        if response.statuses[0].limit_remaining == 2 {
            break;
        }
        assert!(std::time::Instant::now() < voided_by, "never voided");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let alone = request("extra", vec![descriptor(&[("shadowed_pair", &pair)])]);
    let response = call(&mut client, alone).await;
    assert_eq!(
        response.statuses[0].limit_remaining, 1,
        "charged once, not twice"
    );
    // A charge of 3 on "shadowed_pair" (2/min) is refused in shadow, and spends what remains,
    // as enforced it would: the next charge of 1 is refused in shadow too (enforced, it would
    // be refused). Before, the refused charge spent nothing and the next one passed with 1 left.
    let spent = fresh_key("v");
    let mut three = descriptor(&[("shadowed_pair", &spent)]);
    three.hits_addend = Some(UInt64Value { value: 3 });
    let response = call(&mut client, request("extra", vec![three])).await;
    assert_eq!(overall(&response), Code::Ok, "shadow mode never denies");
    let one = request("extra", vec![descriptor(&[("shadowed_pair", &spent)])]);
    let response = call(&mut client, one).await;
    assert_eq!(overall(&response), Code::Ok);
    assert_eq!(response.statuses[0].limit_remaining, 0, "spent in shadow");
    // "general" (3/min) is replaced by "specific" when both match: 5 requests pass.
    for _ in 0..5 {
        let both = request(
            "extra",
            vec![
                descriptor(&[("general", &value)]),
                descriptor(&[("specific", &value)]),
            ],
        );
        let response = call(&mut client, both).await;
        assert_eq!(overall(&response), Code::Ok);
        assert_eq!(response.statuses[0].current_limit, None, "replaced");
    }
    // An unlimited rule's `replaces` apply too (as envoyproxy/ratelimit's): a VIP is not held
    // to "general", which 3 requests of another value exhaust first.
    let other = fresh_key("v");
    let general = || descriptor(&[("general", &other)]);
    for _ in 0..3 {
        let response = call(&mut client, request("extra", vec![general()])).await;
        assert_eq!(overall(&response), Code::Ok);
    }
    let alone = call(&mut client, request("extra", vec![general()])).await;
    assert_eq!(overall(&alone), Code::OverLimit);
    let as_vip = request("extra", vec![general(), descriptor(&[("vip", "yes")])]);
    let response = call(&mut client, as_vip).await;
    assert_eq!(overall(&response), Code::Ok, "general is replaced");
    assert_eq!(response.statuses[0].current_limit, None);
    assert_eq!(response.statuses[1].limit_remaining, u32::MAX);
    // A request's own limit (RateLimitOverride) applies in a configured domain, to any descriptor.
    let overridden = |domain: &str| {
        let mut d = descriptor(&[("anything", &value)]);
        d.limit = Some(RateLimitOverride {
            requests_per_unit: 2,
            unit: 3, // HOUR
        });
        request(domain, vec![d])
    };
    for remaining in [1, 0] {
        let response = call(&mut client, overridden("extra")).await;
        assert_eq!(response.statuses[0].limit_remaining, remaining);
        let limit = response.statuses[0].current_limit.as_ref().unwrap();
        assert_eq!((limit.requests_per_unit, limit.unit), (2, 3));
    }
    assert_eq!(
        overall(&call(&mut client, overridden("extra")).await),
        Code::OverLimit
    );
    let elsewhere = call(&mut client, overridden("nowhere")).await;
    assert_eq!(
        elsewhere.statuses[0].current_limit, None,
        "not in an unknown domain"
    );
    // An override it cannot apply (0 requests, no unit) leaves the configured rule in force,
    // and the call never fails (Envoy would let the request through with no limit at all).
    for (requests_per_unit, unit) in [(0, 3), (7, 0)] {
        let mut d = descriptor(&[("short", &value)]);
        d.limit = Some(RateLimitOverride {
            requests_per_unit,
            unit,
        });
        let response = call(&mut client, request("extra", vec![d])).await;
        let limit = response.statuses[0]
            .current_limit
            .as_ref()
            .expect("a limit");
        assert_eq!(limit.requests_per_unit, 5, "the configured short rule");
    }
}

/// The decision deadline of the dead-ledger test's instances.
const DEAD_LEDGER_TIMEOUT: Duration = Duration::from_millis(300);
/// What the machine may add to that deadline before the answer reaches the test's client; a call
/// that hung would take the client's whole timeout instead.
const ANSWER_SLACK: Duration = Duration::from_secs(3);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_ledger_is_unavailable_or_ok_within_the_deadline() {
    let rules_kept = rules_dir();
    let rules = rules_kept.path().to_path_buf();
    let ledger = TestLedger::start();
    let timeout_ms = DEAD_LEDGER_TIMEOUT.as_millis() as u64;
    let (_closed, mut closed) =
        spawn_rls(rls_config(ledger.address, &rules, "closed", timeout_ms)).await;
    let (_open, mut open) = spawn_rls(rls_config(ledger.address, &rules, "open", timeout_ms)).await;
    let value = fresh_key("v");
    let one = || request("another", vec![descriptor(&[("key2", &value)])]);
    // A new ledger and a new client: their first round trips (connecting, then provisioning the
    // caller) can outlast the 300 ms deadline on a busy machine. Warm up until the ledger answers.
    let mut answered = None;
    for _ in 0..25 {
        match closed.should_rate_limit(one()).await {
            Ok(response) => {
                answered = Some(overall(&response.into_inner()));
                break;
            }
            Err(status) if status.code() == tonic::Code::Unavailable => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(status) => panic!("{status:?}"),
        }
    }
    assert_eq!(answered, Some(Code::Ok), "the live ledger admits");
    ledger.kill();
    let started = Instant::now();
    let status = closed
        .should_rate_limit(one())
        .await
        .expect_err("unavailable");
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    // Which way it failed, in the ledger error's own words.
    let said = status.message();
    assert!(
        said.starts_with("the ledger could not decide: ledger call "),
        "{said}"
    );
    assert!(said.ends_with("missed its deadline"), "{said}");
    let elapsed = started.elapsed();
    assert!(elapsed < DEAD_LEDGER_TIMEOUT + ANSWER_SLACK, "{elapsed:?}");
    let started = Instant::now();
    let response = call(&mut open, one()).await;
    assert_eq!(overall(&response), Code::Ok, "the open policy admits");
    let elapsed = started.elapsed();
    assert!(elapsed < DEAD_LEDGER_TIMEOUT + ANSWER_SLACK, "{elapsed:?}");
    // Envoy gives up sooner than the decision's deadline (`grpc-timeout`): the policy here
    // answers by then. Dropped by tonic instead, the call was CANCELLED, and Envoy applied its
    // own `failure_mode_deny`, whatever this policy said.
    let mut sooner = tonic::Request::new(one());
    sooner.set_timeout(DEAD_LEDGER_TIMEOUT / 3);
    let response = open.should_rate_limit(sooner).await.expect("answered");
    assert_eq!(
        overall(&response.into_inner()),
        Code::Ok,
        "the open policy admits"
    );
}

#[test]
fn the_binary_serves_rls_and_a_restart_keeps_limit_remaining() {
    let rules_kept = rules_dir();
    let rules = rules_kept.path().to_path_buf();
    let value = fresh_key("v");
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let remaining_after = |guard_port: u16| {
        runtime.block_on(async {
            let mut client = client(guard_port).await;
            let response = call(
                &mut client,
                request("another", vec![descriptor(&[("key2", &value)])]),
            )
            .await;
            response.statuses[0].limit_remaining
        })
    };
    let start = || {
        let command = rls_binary(&rules);
        start_binary_logged(command, "Envoy rate-limit service listening on port ")
    };
    let (mut first, port, log) = start();
    for expected in [19, 18, 17] {
        assert_eq!(remaining_after(port), expected);
    }
    // SIGTERM: the HTTP server drains, then the gRPC server stops, then the process exits 0.
    let exit = first
        .terminate(Duration::from_secs(20))
        .unwrap_or_else(|| panic!("still running after SIGTERM:\n{}", log.lock().unwrap()));
    assert!(exit.success(), "{exit:?}");
    assert!(
        wait_logged(
            &log,
            "Envoy rate-limit service stopped",
            Duration::from_secs(5)
        ),
        "{}",
        log.lock().unwrap()
    );
    let (_second, port, _) = start();
    assert_eq!(
        remaining_after(port),
        16,
        "the ledger, not the instance, remembers"
    );
}

/// The binary with its Envoy front end on `rules`, both listeners on free ports, on the shared
/// ledger.
fn rls_binary(rules: &Path) -> std::process::Command {
    let mut command = binary_command();
    command
        .arg("--listen=127.0.0.1:0")
        .arg(format!("--ledger-addresses={}", shared_ledger().address))
        // The RLS listener is up before the client's first ledger call (~0.6 s) is done.
        .arg("--ledger-timeout-ms=5000")
        .arg("--rls-listen=127.0.0.1:0")
        .arg(format!("--rls-config={}", rules.display()));
    command
}

/// Out of file descriptors, the Envoy front end pauses accepting: it tried again at once, and
/// every try failed the same way (the connection stays in the listen backlog), a core spun for as
/// long as the shortage lasted. Once connections end, it serves again.
#[test]
fn out_of_file_descriptors_the_envoy_front_end_pauses_and_serves_again() {
    let rules_kept = rules_dir();
    let mut command = rls_binary(rules_kept.path());
    // The process's own descriptors, and a few dozen for connections.
    const DESCRIPTORS_MAX: libc::rlim_t = 128;
    limit_open_files(&mut command, DESCRIPTORS_MAX, DESCRIPTORS_MAX);
    let (guard, port, log) =
        start_binary_logged(command, "Envoy rate-limit service listening on port ");
    let runtime = tokio::runtime::Runtime::new().unwrap();
    // Everything started first (its ledger connection, the HTTP workers): the shortage is the
    // connections'.
    runtime.block_on(ready(&log));
    let connections: Vec<_> = (0..DESCRIPTORS_MAX)
        .map(|_| std::net::TcpStream::connect(("127.0.0.1", port)).expect("in the backlog"))
        .collect();
    let pausing = "the Envoy front end cannot accept a connection; pausing";
    assert!(
        wait_logged(&log, pausing, Duration::from_secs(10)),
        "{}",
        log.lock().unwrap()
    );
    let before = cpu_ticks(guard.pid());
    std::thread::sleep(Duration::from_secs(2));
    let used = cpu_ticks(guard.pid()) - before;
    // A tick is 10 ms of CPU (USER_HZ 100): trying again at once takes about 200 in 2 s.
    assert!(used < 50, "{used} ticks of CPU in 2 s out of descriptors");
    drop(connections);
    runtime.block_on(async {
        let mut client = client(port).await;
        let answer = client.should_rate_limit(request(
            "another",
            vec![descriptor(&[("key2", &fresh_key("fd"))])],
        ));
        let answer = tokio::time::timeout(Duration::from_secs(5), answer).await;
        let answer = answer.unwrap_or_else(|_| panic!("not served:\n{}", log.lock().unwrap()));
        let answer = answer.expect("an answer").into_inner();
        assert_eq!(overall(&answer), Code::Ok);
    });
}

/// Once the binary whose log is `log` answers `/readyz` with a 200.
async fn ready(log: &Log) {
    let marker = "ledger-limiter listening on port ";
    assert!(
        wait_logged(log, marker, Duration::from_secs(20)),
        "{}",
        log.lock().unwrap()
    );
    let text = log.lock().unwrap().clone();
    let port = text
        .split(marker)
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next());
    let url = format!("http://127.0.0.1:{}/readyz", port.expect("a port"));
    let deadline = Instant::now() + Duration::from_secs(20);
    while !reqwest::get(&url).await.is_ok_and(|r| r.status() == 200) {
        assert!(Instant::now() < deadline, "never ready:\n{text}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The CPU time `pid` has used, in clock ticks (user and system, `/proc/<pid>/stat`).
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("the process runs");
    // The fields after the command's name, which ends with the last ')'.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .unwrap()
        .1
        .split_whitespace()
        .collect();
    // utime and stime: fields 14 and 15 of the file, 12 and 13 after the name.
    fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
}

/// Envoy cannot run here: the compose stack's envoy.yaml is checked statically against what the
/// app serves (the filter, its gRPC cluster on HTTP/2 at the app's RLS port, a timeout above the
/// decision deadline, failure_mode_deny, a domain the rules define).
#[test]
fn the_compose_envoy_configuration_points_at_the_rate_limit_service() {
    use ledger_limiter::envoy::config::RlsConfig;
    use serde_norway::Value;

    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("envoy/envoy.yaml")).unwrap();
    let envoy: Value = serde_norway::from_str(&text).expect("envoy.yaml parses");
    let manager = &envoy["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        ["typed_config"];
    let filter = &manager["http_filters"][0];
    assert_eq!(
        filter["name"].as_str(),
        Some("envoy.filters.http.ratelimit")
    );
    let filter = &filter["typed_config"];
    assert_eq!(filter["failure_mode_deny"].as_bool(), Some(true));
    let timeout_ms: f64 = filter["timeout"]
        .as_str()
        .unwrap()
        .trim_end_matches('s')
        .parse::<f64>()
        .unwrap()
        * 1000.0;
    let defaults: toml::Value =
        toml::from_str(ledger_limiter::config::DEFAULT_CONFIG_TOML).unwrap();
    let deadline_ms = defaults["ledger"]["timeout_ms"].as_integer().unwrap() as f64;
    assert!(
        timeout_ms > deadline_ms,
        "{timeout_ms} ms: above the default decision deadline (ledger.timeout_ms, {deadline_ms} ms)"
    );
    let service = &filter["rate_limit_service"];
    assert_eq!(service["transport_api_version"].as_str(), Some("V3"));
    let cluster_name = service["grpc_service"]["envoy_grpc"]["cluster_name"]
        .as_str()
        .unwrap();
    let clusters = envoy["static_resources"]["clusters"].as_sequence().unwrap();
    let cluster = clusters
        .iter()
        .find(|c| c["name"].as_str() == Some(cluster_name))
        .expect("the cluster");
    let options = &cluster["typed_extension_protocol_options"]
        ["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"];
    assert!(
        options["explicit_http_config"]["http2_protocol_options"].is_mapping(),
        "gRPC needs HTTP/2"
    );
    let address = &cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
        ["address"]["socket_address"];
    assert_eq!(address["address"].as_str(), Some("app"));
    let compose: Value =
        serde_norway::from_str(&std::fs::read_to_string(root.join("docker-compose.yml")).unwrap())
            .unwrap();
    let app = &compose["services"]["app"]["environment"];
    let listen = app["LEDGER_LIMITER_RLS_LISTEN"].as_str().unwrap();
    assert_eq!(
        listen.rsplit(':').next(),
        Some(address["port_value"].as_u64().unwrap().to_string().as_str())
    );
    assert!(compose["services"]["envoy"]["image"]
        .as_str()
        .unwrap()
        .starts_with("envoyproxy/envoy:v"));
    // The domain and every descriptor key Envoy sends are rules of the mounted configuration.
    let rules = RlsConfig::load(&root.join("envoy/ratelimit")).expect("the demo rules load");
    let domain = filter["domain"].as_str().unwrap();
    let routes = manager["route_config"]["virtual_hosts"][0]["routes"]
        .as_sequence()
        .unwrap();
    let rate_limits: Vec<&Value> = routes
        .iter()
        .filter_map(|route| route["route"]["rate_limits"].as_sequence())
        .flatten()
        .collect();
    assert!(
        !rate_limits.is_empty(),
        "the demo's routes send descriptors"
    );
    for rate_limit in &rate_limits {
        let actions = rate_limit["actions"].as_sequence().unwrap();
        let entries: Vec<(&str, &str)> = actions.iter().map(descriptor_entry).collect();
        assert!(
            rules.rule_for(domain, entries.iter().copied()).is_some(),
            "{entries:?}"
        );
    }
    // A request without a key is limited too (by its address): an entry of `request_headers`
    // alone makes no descriptor when the header is absent. The keyless entry is sent only when
    // the key's header is absent (a keyed caller limited per address too shared its budget),
    // and the address is the connection's (else the client picks it in X-Forwarded-For).
    let key_header = rate_limits[0]["actions"][0]["request_headers"]["header_name"].clone();
    let absent = |action: &Value| {
        let matched = &action["header_value_match"];
        matched["expect_match"].as_bool() == Some(false)
            && matched["headers"][0]["name"] == key_header
            && matched["headers"][0]["present_match"].as_bool() == Some(true)
    };
    let keyless = rate_limits.iter().any(|limit| {
        let actions = limit["actions"].as_sequence().unwrap();
        absent(&actions[0]) && actions.iter().any(|a| a.get("remote_address").is_some())
    });
    assert!(keyless, "a request without X-Api-Key would go unlimited");
    assert_eq!(manager["use_remote_address"].as_bool(), Some(true));
}

/// The descriptor entry an Envoy rate-limit action makes (a sample value where Envoy supplies
/// it), for the actions the demo uses.
fn descriptor_entry(action: &serde_norway::Value) -> (&str, &str) {
    if let Some(headers) = action.get("request_headers") {
        return (headers["descriptor_key"].as_str().unwrap(), "k");
    }
    if let Some(matched) = action.get("header_value_match") {
        let key = matched["descriptor_key"].as_str().unwrap_or("header_match");
        return (key, matched["descriptor_value"].as_str().unwrap());
    }
    if action.get("remote_address").is_some() {
        return ("remote_address", "203.0.113.9");
    }
    panic!("an action the demo does not use: {action:?}")
}

/// Decisions are counted in the middleware's families with `frontend="envoy"`, labelled by rule;
/// descriptor values (which can be API keys) are never labels.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decisions_are_counted_with_the_envoy_frontend_label() {
    let recorder = recorder();
    let rules_kept = rules_dir();
    let rules = rules_kept.path().to_path_buf();
    let (_app, mut client) =
        spawn_rls(rls_config(shared_ledger().address, &rules, "closed", 5_000)).await;
    let value = fresh_key("secret_");
    let one = || {
        request(
            "extra",
            vec![
                descriptor(&[("counted_shadow", &value)]),
                descriptor(&[("tallied", &value)]),
                descriptor(&[("counted_partner", PARTNER_KEY)]),
            ],
        )
    };
    // Rules of this test alone: the recorder is the binary's, and the other tests run beside it.
    for _ in 0..2 {
        call(&mut client, one()).await;
    }
    // A call the enforced descriptors refuse counts nothing admitted for its shadow one (its
    // hold is voided): "tallied" (10/min) spent, then beside a fresh value's shadow descriptor.
    let tallied = || descriptor(&[("tallied", &value)]);
    for _ in 0..8 {
        call(&mut client, request("extra", vec![tallied()])).await;
    }
    let fresh = fresh_key("secret_");
    let refused = request(
        "extra",
        vec![descriptor(&[("counted_shadow", &fresh)]), tallied()],
    );
    assert_eq!(overall(&call(&mut client, refused).await), Code::OverLimit);
    let text = recorder.render();
    let line = |needle: &str| text.lines().find(|l| l.contains(needle)).map(str::to_owned);
    let admitted =
        line(r#"decision="admitted",plan="extra.tallied",source="ledger""#).expect(&text);
    assert!(
        admitted.contains(r#"frontend="envoy""#) && admitted.ends_with(" 10"),
        "{admitted}"
    );
    let shadow_admitted = line(r#"decision="admitted",plan="extra.counted_shadow""#);
    assert!(shadow_admitted.is_some_and(|l| l.ends_with(" 1")), "{text}");
    let shadow = line(
        r#"ledger_limiter_shadow_passed_total{frontend="envoy",decision="limited",plan="extra.counted_shadow"}"#,
    );
    assert!(shadow.is_some_and(|l| l.ends_with(" 1")), "{text}");
    assert!(!text.contains(&value), "a descriptor value became a label");
    // A rule's own value (here a partner's key) is a hash in its label.
    let digest = {
        use sha2::{Digest, Sha256};
        hex::encode(&Sha256::digest(PARTNER_KEY.as_bytes())[..4])
    };
    let partner = format!(r#"decision="admitted",plan="extra.counted_partner_{digest}""#);
    assert!(line(&partner).is_some_and(|l| l.ends_with(" 2")), "{text}");
    assert!(
        !text.contains(PARTNER_KEY),
        "a configured value became a label"
    );
}

/// A value configured in `EXTRA`'s rules.
const PARTNER_KEY: &str = "sk_partner_0123456789";

/// Envoy's `grpc_health_check` and Kubernetes' `grpc` probes ask the rate-limit port itself, as
/// envoyproxy/ratelimit answers on its own: `SERVING`, for the server and for the rate-limit
/// service by name; `NOT_FOUND` for another name; `Watch` is not served. Before, every path but
/// `ShouldRateLimit` was `UNIMPLEMENTED`: a cluster health-checked so marked every host
/// unhealthy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_port_answers_grpcs_health_check() {
    use ledger_limiter::envoy::health::{HealthCheckRequest, HealthCheckResponse, SERVING};
    let rules_kept = rules_dir();
    let config = rls_config(shared_ledger().address, rules_kept.path(), "closed", 5_000);
    let (_app, port) = spawn_rls_port(config).await;
    let channel = Channel::from_shared(format!("http://127.0.0.1:{port}")).unwrap();
    let channel = channel.connect().await.expect("the RLS listener accepts");
    let ask = |service: &str, path: &'static str| {
        let mut grpc = tonic::client::Grpc::new(channel.clone());
        let request = tonic::Request::new(HealthCheckRequest {
            service: service.into(),
        });
        async move {
            grpc.ready().await.unwrap();
            let codec =
                tonic_prost::ProstCodec::<HealthCheckRequest, HealthCheckResponse>::default();
            let path = tonic::codegen::http::uri::PathAndQuery::from_static(path);
            grpc.unary(request, path, codec).await
        }
    };
    const CHECK: &str = "/grpc.health.v1.Health/Check";
    for service in [
        "",
        "ratelimit",
        "envoy.service.ratelimit.v3.RateLimitService",
    ] {
        let answer = ask(service, CHECK).await.expect("answered");
        assert_eq!(answer.get_ref().status, SERVING, "{service:?}");
    }
    let unknown = ask("some.other.Service", CHECK).await.unwrap_err();
    assert_eq!(unknown.code(), tonic::Code::NotFound, "{unknown:?}");
    let watch = ask("", "/grpc.health.v1.Health/Watch").await.unwrap_err();
    assert_eq!(watch.code(), tonic::Code::Unimplemented, "{watch:?}");
    // And the rate-limit service beside it, on the same connection.
    let mut client = RateLimitServiceClient::new(channel);
    let one = request("extra", vec![descriptor(&[("unlimited", "k")])]);
    assert_eq!(overall(&call(&mut client, one).await), Code::Ok);
}
