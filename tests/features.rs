//! Features for paying-API operators, against a real TigerBeetle over real sockets: shadow mode,
//! header styles existing clients parse, the status of a missing key.

mod common;

use std::sync::Arc;
use std::time::Duration;

use actix_web::{web, HttpResponse};
use common::*;
use futures_util::future::join_all;
use ledger_limiter::config::{FileConfig, ResponseFile, RoutesFile};
use ledger_limiter::http::RequestRules;

fn config(capacity: u64, routes: RoutesFile, response: ResponseFile) -> FileConfig {
    let mut config = test_config(shared_ledger().address);
    config.plans = Some([("free".to_owned(), plan(capacity, 60))].into());
    config.routes = routes;
    config.response = response;
    config
}

fn shadow_everything() -> RoutesFile {
    RoutesFile {
        shadow: Some(vec!["/*".into()]),
        ..RoutesFile::default()
    }
}

/// A plan for the tests that wire the library as a user would.
fn library_plan(
    name: &str,
    capacity: u64,
    window_seconds: u32,
) -> ledger_limiter::limiter::plan::Plan {
    use std::num::{NonZeroU32, NonZeroU64};
    let capacity = NonZeroU64::new(capacity).unwrap();
    let window = NonZeroU32::new(window_seconds).unwrap();
    ledger_limiter::limiter::plan::Plan::new(name, capacity, window).unwrap()
}

/// A library user's limiter on the shared ledger: one plan, `metered`, of 10 per minute.
fn metered_limiter() -> Arc<ledger_limiter::limiter::Limiter> {
    let ledger = ledger_client(vec![shared_ledger().address]);
    Arc::new(one_plan_limiter(ledger, library_plan("metered", 10, 60)))
}

/// Serves `routes` behind `RateLimit::new(limiter, rules)`, one worker on a free port, as a user
/// wires the library: the port, and the handle that stops it.
fn serve_library(
    limiter: &Arc<ledger_limiter::limiter::Limiter>,
    rules: RequestRules,
    routes: fn(&mut web::ServiceConfig),
) -> (u16, actix_web::dev::ServerHandle) {
    use actix_web::{App, HttpServer};
    use ledger_limiter::http::RateLimit;
    // Made outside the workers, as the README wires it.
    let rate_limit = RateLimit::new(limiter.clone(), Arc::new(rules));
    let server = HttpServer::new(move || App::new().wrap(rate_limit.clone()).configure(routes))
        .workers(1)
        .bind(("127.0.0.1", 0))
        .unwrap();
    let port = server.addrs()[0].port();
    let server = server.run();
    let handle = server.handle();
    tokio::spawn(server);
    (port, handle)
}

/// The account of `key`'s slots on the concurrency limit of route `pattern` (`slots` in flight).
fn slot_account(pattern: &str, slots: std::num::NonZeroU64, key: &str) -> u128 {
    use ledger_limiter::ledger::model::{self, LEDGER_CONCURRENCY};
    let plan = ledger_limiter::http::concurrency::plan_name(pattern);
    model::user_account_id(LEDGER_CONCURRENCY, &plan, slots, key.as_bytes())
}

async fn held(app: &TestApp, key: &str) -> ledger_limiter::ledger::audit::AccountAudit {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    app.limiter
        .ledger()
        .audit(account_id(app, key), deadline)
        .await
        .unwrap()
        .expect("the account exists")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shadow_mode_decides_and_holds_as_usual_but_never_refuses() {
    let a = spawn_app(config(3, shadow_everything(), ResponseFile::default())).await;
    let b = spawn_app(config(3, shadow_everything(), ResponseFile::default())).await;
    let key = fresh_key("k_");
    let answers = join_all((0..20).map(|i| {
        let app = if i % 2 == 0 { &a } else { &b };
        let key = key.clone();
        async move {
            let response = app.get("/greeting", Some(&key)).await;
            let ratelimit = response.headers()["ratelimit"].to_str().unwrap().to_owned();
            (
                response.status().as_u16(),
                ratelimit,
                response.headers().get("retry-after").is_some(),
            )
        }
    }))
    .await;
    assert!(answers.iter().all(|(s, _, _)| *s == 200), "{answers:?}");
    // What enforcing would have refused is visible to the caller as r=0, without Retry-After.
    let would_refuse = answers
        .iter()
        .filter(|(_, r, _)| r.contains(";r=0;"))
        .count();
    assert!(would_refuse >= 20 - 3, "{answers:?}");
    assert!(answers.iter().all(|(_, _, retry)| !retry));
    // Exactly as usual in the ledger: the capacity is held, the refusals hold nothing.
    let audit = held(&a, &key).await;
    assert_eq!(audit.admitted(), 3, "{audit:?}");
    assert_eq!(audit.debits_pending, 3);
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_shadow_routes_let_refusals_through() {
    let routes = RoutesFile {
        shadow: Some(vec!["/beta*".into()]),
        ..RoutesFile::default()
    };
    let app = spawn_app(config(1, routes, ResponseFile::default())).await;
    let key = fresh_key("k_");
    assert_eq!(app.get("/greeting", Some(&key)).await.status(), 200);
    assert_eq!(app.get("/greeting", Some(&key)).await.status(), 429);
    // A shadow path is decided (and refused) the same, then let through: here to a 404, with
    // the fields of a refusal (nothing left) but no Retry-After.
    let shadowed = app.get("/beta/x", Some(&key)).await;
    assert_eq!(shadowed.status(), 404);
    let ratelimit = shadowed.headers()["ratelimit"].to_str().unwrap();
    assert!(ratelimit.starts_with("\"free\";r=0;"), "{ratelimit}");
    assert!(shadowed.headers().get("retry-after").is_none());
    assert_eq!(app.get("/greeting", Some(&key)).await.status(), 429);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn github_and_bucket4j_header_styles() {
    let response = ResponseFile {
        header_styles: Some(vec!["github".into(), "bucket4j".into()]),
        ..ResponseFile::default()
    };
    let app = spawn_app(config(2, RoutesFile::default(), response)).await;
    let key = fresh_key("k_");
    let first = app.get("/greeting", Some(&key)).await;
    assert_eq!(first.status(), 200);
    let h = |r: &reqwest::Response, name: &str| {
        r.headers()
            .get(name)
            .map(|v| v.to_str().unwrap().to_owned())
    };
    assert_eq!(h(&first, "x-ratelimit-limit").as_deref(), Some("2"));
    assert_eq!(h(&first, "x-ratelimit-remaining").as_deref(), Some("1"));
    assert_eq!(h(&first, "x-ratelimit-used").as_deref(), Some("1"));
    let reset: u64 = h(&first, "x-ratelimit-reset").unwrap().parse().unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    assert!((now + 55..=now + 62).contains(&reset), "{reset} vs {now}");
    assert_eq!(h(&first, "x-rate-limit-remaining").as_deref(), Some("1"));
    assert_eq!(h(&first, "ratelimit"), None, "ietf not asked for");
    app.get("/greeting", Some(&key)).await;
    let refused = app.get("/greeting", Some(&key)).await;
    assert_eq!(refused.status(), 429);
    let retry = h(&refused, "x-rate-limit-retry-after-seconds").unwrap();
    assert_eq!(Some(retry), h(&refused, "retry-after"));
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_key_can_be_a_400() {
    let response = ResponseFile {
        missing_key_status: Some(400),
        ..ResponseFile::default()
    };
    let app = spawn_app(config(5, RoutesFile::default(), response)).await;
    let missing = app.get("/greeting", None).await;
    assert_eq!(missing.status(), 400);
    let body: serde_json::Value = missing.json().await.unwrap();
    assert_eq!(body["type"], "urn:ledger-limiter:problem:missing-api-key");
    assert_eq!(body["status"], 400, "the body says the same status");
    app.stop().await;
}

/// Callers keyed by their bearer token (`caller.header = "authorization"`): the token is the key,
/// whatever the scheme's case; another scheme is no key (401, with the challenge).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_keyed_by_their_bearer_token() {
    let mut config = config(2, RoutesFile::default(), ResponseFile::default());
    config.caller.header = Some("authorization".into());
    let app = spawn_app(config).await;
    let token = fresh_key("tok_");
    let get = |authorization: String| {
        let request = app.http.get(format!("{}/greeting", app.address));
        async move {
            let response = request.header("Authorization", authorization).send().await;
            response.unwrap().status().as_u16()
        }
    };
    assert_eq!(get(format!("Bearer {token}")).await, 200);
    assert_eq!(get(format!("bearer {token}")).await, 200, "the same caller");
    assert_eq!(get(format!("Bearer {token}")).await, 429);
    assert_eq!(get(format!("Bearer {}", fresh_key("tok_"))).await, 200);
    // Another scheme's credentials are no key: 401, with the challenge (RFC 6750 §3.1).
    let basic = app.http.get(format!("{}/greeting", app.address));
    let basic = basic
        .header("Authorization", "Basic dXNlcjpwYXNz")
        .send()
        .await
        .unwrap();
    assert_eq!(basic.status(), 401);
    let challenge = basic
        .headers()
        .get("www-authenticate")
        .map(|v| v.to_str().unwrap());
    assert!(
        challenge.is_some_and(|c| c.starts_with("Bearer")),
        "{challenge:?}"
    );
    app.stop().await;
}

/// Keyless callers on a plan of this test's own (every test here calls from 127.0.0.1).
fn anonymous(trusted_proxies: Option<Vec<String>>) -> (FileConfig, String) {
    let mut config = config(5, RoutesFile::default(), ResponseFile::default());
    let anon = format!("anon{:08x}", rand::random::<u32>());
    config.plans = Some(
        [
            ("free".to_owned(), plan(5, 60)),
            (anon.clone(), plan(2, 60)),
        ]
        .into(),
    );
    config.default_plan = Some("free".into());
    config.caller = ledger_limiter::config::CallerFile {
        source: Some("header-or-peer-ip".into()),
        anonymous_plan: Some(anon.clone()),
        trusted_proxies,
        ..Default::default()
    };
    (config, anon)
}

async fn get_from(app: &TestApp, forwarded_for: &str) -> (u16, String) {
    let response = app
        .http
        .get(format!("{}/greeting", app.address))
        .header("X-Forwarded-For", forwarded_for)
        .send()
        .await
        .unwrap();
    let policy = response.headers()["ratelimit-policy"]
        .to_str()
        .unwrap()
        .to_owned();
    (response.status().as_u16(), policy)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyless_callers_get_the_anonymous_plan_and_keyed_callers_theirs() {
    let (config, anon) = anonymous(None);
    let app = spawn_app(config).await;
    let anon_policy = format!("\"{anon}\";q=2;w=60");
    for expected in [200, 200, 429] {
        let response = app.get("/greeting", None).await;
        assert_eq!(response.status(), expected);
        assert_eq!(response.headers()["ratelimit-policy"], anon_policy.as_str());
    }
    let keyed = app.get("/greeting", Some(&fresh_key("k_"))).await;
    assert_eq!(keyed.status(), 200);
    assert_eq!(keyed.headers()["ratelimit-policy"], "\"free\";q=5;w=60");
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwarded_for_is_believed_only_from_trusted_proxies() {
    // Not trusted: a client that claims to be someone else still spends its own allowance.
    let (config, _) = anonymous(None);
    let app = spawn_app(config).await;
    let spoofed = [
        get_from(&app, "198.51.100.1").await.0,
        get_from(&app, "198.51.100.2").await.0,
        get_from(&app, "198.51.100.3").await.0,
    ];
    assert_eq!(spoofed, [200, 200, 429], "the spoofed header was believed");
    app.stop().await;

    // Trusted (this test's client is the proxy): each forwarded caller has its own allowance.
    let (config, _) = anonymous(Some(vec!["127.0.0.1".into()]));
    let app = spawn_app(config).await;
    let run = rand::random::<u8>();
    for client in 1..=3 {
        let address = format!("203.0.{run}.{client}");
        assert_eq!(get_from(&app, &address).await.0, 200);
        assert_eq!(get_from(&app, &address).await.0, 200);
        assert_eq!(get_from(&app, &address).await.0, 429, "{address}");
    }
    app.stop().await;

    // A proxy that writes `Forwarded` and passes the client's own `X-Forwarded-For` on: only
    // the header the proxy writes names the caller, so the client's claim spends nothing.
    let (mut config, _) = anonymous(Some(vec!["127.0.0.1".into()]));
    config.caller.forwarded_header = Some("forwarded".into());
    let app = spawn_app(config).await;
    let victim = format!("198.51.{run}.9");
    for (client, expected) in [(1, 200), (2, 200), (3, 200)] {
        let response = app
            .http
            .get(format!("{}/greeting", app.address))
            .header("Forwarded", format!("for=203.0.{run}.{client}"))
            .header("X-Forwarded-For", victim.as_str())
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), expected, "{client}");
    }
    assert_eq!(
        get_forwarded(&app, &victim).await,
        200,
        "the victim's allowance was spent"
    );
    assert_eq!(get_forwarded(&app, &victim).await, 200);
    assert_eq!(get_forwarded(&app, &victim).await, 429);
    app.stop().await;

    // An IPv6 caller is its /64 (a subscriber's allocation, any address of which is theirs):
    // another address in it is the same caller, another /64 another one.
    let (config, _) = anonymous(Some(vec!["127.0.0.1".into()]));
    let app = spawn_app(config).await;
    let network = format!("2001:db8:{run:x}:1");
    assert_eq!(get_from(&app, &format!("{network}::1")).await.0, 200);
    assert_eq!(get_from(&app, &format!("{network}::2")).await.0, 200);
    let same = format!("{network}:ffff::3");
    assert_eq!(get_from(&app, &same).await.0, 429, "the same /64");
    let other = format!("2001:db8:{run:x}:2::1");
    assert_eq!(get_from(&app, &other).await.0, 200, "another /64");
    app.stop().await;
}

async fn get_forwarded(app: &TestApp, address: &str) -> u16 {
    let response = app
        .http
        .get(format!("{}/greeting", app.address))
        .header("Forwarded", format!("for={address}"))
        .send()
        .await
        .unwrap();
    response.status().as_u16()
}

/// A middleware inside the limiter that fails (a session store that is down): its error is
/// the request's response, refunded on a refund route as a handler's 500 is. Before, the
/// error passed the limiter by, charged.
async fn failing_middleware(
    _: actix_web::dev::ServiceRequest,
    _: actix_web::middleware::Next<impl actix_web::body::MessageBody>,
) -> Result<actix_web::dev::ServiceResponse, actix_web::Error> {
    Err(actix_web::error::ErrorInternalServerError(
        "a store is down",
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_from_a_middleware_inside_is_refunded() {
    let ledger = ledger_client(vec![shared_ledger().address]);
    let limiter = Arc::new(one_plan_limiter(ledger, library_plan("free", 2, 60)));
    let rules = RequestRules::builder()
        .refund_server_errors("/err")
        .cost_header("X-Cost")
        .exempt("/public")
        .build(limiter.plans());
    let (port, handle) = serve_library(&limiter, rules.unwrap(), |routes| {
        let failing = actix_web::middleware::from_fn(failing_middleware);
        let costly = || async { HttpResponse::Ok().insert_header(("X-Cost", "7")).finish() };
        routes
            .service(
                web::resource("/err")
                    .wrap(failing)
                    .route(web::get().to(HttpResponse::Ok)),
            )
            .route("/public", web::get().to(costly));
    });
    let http = reqwest::Client::new();
    let key = fresh_key("k_");
    let get = |path: &str| {
        http.get(format!("http://127.0.0.1:{port}{path}"))
            .header("X-Api-Key", &key)
            .send()
    };
    for _ in 0..5 {
        let response = get("/err").await.unwrap();
        assert_eq!(response.status(), 500, "refunded: never refused");
    }
    // The cost header a handler sets never reaches the client, on an exempt path too.
    let public = get("/public").await.unwrap();
    assert_eq!(public.status(), 200);
    assert!(public.headers().get("x-cost").is_none(), "{public:?}");
    handle.stop(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_errors_give_the_credit_back_on_refund_routes_only() {
    // The library as a user wires it, around handlers that fail.
    let ledger = ledger_client(vec![shared_ledger().address]);
    let limiter = Arc::new(one_plan_limiter(ledger, library_plan("free", 2, 60)));
    let rules = RequestRules::builder()
        .refund_server_errors("/boom")
        .build(limiter.plans());
    let (port, handle) = serve_library(&limiter, rules.unwrap(), |routes| {
        let failing = || web::get().to(HttpResponse::InternalServerError);
        routes
            .route("/boom", failing())
            .route("/charged-boom", failing())
            .route("/ok", web::get().to(HttpResponse::Ok));
    });
    let http = reqwest::Client::new();
    let key = fresh_key("k_");
    let get = |path: &str| {
        let request = http
            .get(format!("http://127.0.0.1:{port}{path}"))
            .header("X-Api-Key", &key);
        async move { request.send().await.unwrap().status().as_u16() }
    };
    // Five failures on a refund route cost nothing: the capacity of 2 is still whole, and
    // their fields say so.
    for _ in 0..5 {
        assert_eq!(get("/boom").await, 500);
    }
    let refunded = http
        .get(format!("http://127.0.0.1:{port}/boom"))
        .header("X-Api-Key", &key)
        .send()
        .await
        .unwrap();
    let ratelimit = refunded
        .headers()
        .get("ratelimit")
        .unwrap()
        .to_str()
        .unwrap();
    assert!(ratelimit.starts_with("\"free\";r=2;"), "{ratelimit}");
    assert_eq!(get("/ok").await, 200);
    // A failure elsewhere is charged as usual.
    assert_eq!(get("/charged-boom").await, 500);
    assert_eq!(get("/ok").await, 429);
    let account_id = {
        let caller = caller(&key);
        limiter.account_of(&caller).unwrap()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let audit = limiter
        .ledger()
        .audit(account_id, deadline)
        .await
        .unwrap()
        .unwrap();
    assert_eq!((audit.holds, audit.voids), (8, 6), "{audit:?}");
    assert_eq!(audit.debits_pending, 2);
    handle.stop(true).await;
}

/// Holds the handlers of [`slow_instance`] until the test opens it: while the first requests of a
/// burst hold their slots, every later one is refused, however late it starts on a loaded machine.
type Gate = tokio::sync::watch::Sender<bool>;

/// How long a handler waits for its gate at most, so that a broken test fails rather than hangs.
const GATE_WAIT_MAX: std::time::Duration = std::time::Duration::from_secs(10);

/// Waits until the gate opens, at most [`GATE_WAIT_MAX`].
async fn opened(mut open: tokio::sync::watch::Receiver<bool>) {
    let _ = tokio::time::timeout(GATE_WAIT_MAX, open.wait_for(|open| *open)).await;
}

/// Sends `requests` at once with the gate shut, opens it once `refusals` of them were refused (or
/// after [`GATE_WAIT_MAX`]), and returns every answer.
async fn gated<T>(
    gate: &Gate,
    requests: Vec<impl std::future::Future<Output = T>>,
    refusals: usize,
    refused: impl Fn(&T) -> bool,
) -> Vec<T> {
    use futures_util::stream::{FuturesUnordered, StreamExt};
    gate.send_replace(false);
    let mut pending: FuturesUnordered<_> = requests.into_iter().collect();
    let mut answers = Vec::new();
    let opening = tokio::time::sleep(GATE_WAIT_MAX);
    tokio::pin!(opening);
    while answers.iter().filter(|a| refused(a)).count() < refusals {
        tokio::select! {
            Some(answer) = pending.next() => answers.push(answer),
            _ = &mut opening => break,
            else => break,
        }
    }
    gate.send_replace(true);
    while let Some(answer) = pending.next().await {
        answers.push(answer);
    }
    answers
}

/// An instance as a library user wires one: `/slow` (answers when `gate` opens) and `/stream`
/// (its first chunk at once, its last when `gate` opens) with at most 2 requests of a caller in
/// flight, a plan far above the test's load, its own ledger client.
async fn slow_instance(
    gate: &Gate,
) -> (
    u16,
    actix_web::dev::ServerHandle,
    std::sync::Arc<ledger_limiter::limiter::Limiter>,
) {
    use actix_web::{web, App, HttpResponse, HttpServer};
    use ledger_limiter::http::{ConcurrencyLimits, RateLimit, RequestRules};
    use ledger_limiter::limiter::plan::{Plan, PlanBook, UnknownKeys};
    use ledger_limiter::limiter::Limiter;
    use std::num::{NonZeroU32, NonZeroU64};
    use std::sync::Arc;

    let ledger = ledger_client(vec![shared_ledger().address]);
    let settings = library_settings();
    let two = NonZeroU64::new(2).unwrap();
    let slots = [("/slow".to_owned(), two), ("/stream".to_owned(), two)];
    let timeout = NonZeroU32::new(30).unwrap();
    let limits = ConcurrencyLimits::new(&ledger, &slots, timeout, &settings).unwrap();
    let big = Plan::new("big", NonZeroU64::new(1000).unwrap(), timeout).unwrap();
    let plans = PlanBook::new(vec![big], "big", [], [], UnknownKeys::DefaultPlan).unwrap();
    let limiter = Arc::new(Limiter::new(ledger, Arc::new(plans), settings));
    let rules = Arc::new(RequestRules::builder().build(limiter.plans()).unwrap());
    let rate_limit = RateLimit::new(limiter.clone(), rules).with_concurrency(limits);
    let open = gate.subscribe();
    let slow = {
        let open = open.clone();
        move || {
            let open = open.clone();
            async move {
                opened(open).await;
                HttpResponse::Ok().finish()
            }
        }
    };
    // Answers at once, then streams its last chunk when the gate opens: in flight until then.
    let stream = move || {
        let open = open.clone();
        async move {
            let chunks = futures_util::stream::unfold((0, open), |(sent, open)| async move {
                if sent == 2 {
                    return None;
                }
                if sent == 1 {
                    opened(open.clone()).await;
                }
                let chunk = actix_web::web::Bytes::from_static(b"chunk\n");
                Some((Ok::<_, std::convert::Infallible>(chunk), (sent + 1, open)))
            });
            HttpResponse::Ok().streaming(chunks)
        }
    };
    let server = HttpServer::new(move || {
        App::new()
            .wrap(rate_limit.clone())
            .route("/slow", web::get().to(slow.clone()))
            .route("/stream", web::get().to(stream.clone()))
    })
    .workers(2)
    .bind(("127.0.0.1", 0))
    .unwrap();
    let port = server.addrs()[0].port();
    let server = server.run();
    let handle = server.handle();
    tokio::spawn(server);
    (port, handle, limiter)
}

/// A library user's timeout: the request's future is dropped after 2 s.
async fn two_seconds_at_most(
    req: actix_web::dev::ServiceRequest,
    next: actix_web::middleware::Next<impl actix_web::body::MessageBody + 'static>,
) -> Result<actix_web::dev::ServiceResponse<impl actix_web::body::MessageBody>, actix_web::Error> {
    let inner = next.call(req);
    match tokio::time::timeout(Duration::from_secs(2), inner).await {
        Ok(served) => served,
        Err(_) => Err(actix_web::error::ErrorGatewayTimeout("timed out")),
    }
}

/// A request dropped while its concurrency slot is decided is never served: its rate hold is
/// given back, as a slot refusal's is. Before, it stayed held for the window. (actix itself runs
/// a request's future on when its client goes away; a library user's timeout around the
/// middleware, as here, drops it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_dropped_while_its_slot_is_decided_gives_its_rate_back() {
    use actix_web::{App, HttpServer};
    use ledger_limiter::http::{ConcurrencyLimits, RateLimit};
    use ledger_limiter::limiter::plan::{Plan, PlanBook, UnknownKeys};
    use ledger_limiter::limiter::Limiter;
    use std::num::{NonZeroU32, NonZeroU64};
    use std::time::Instant;

    // Slots on a ledger of their own, stopped below: the slot's decision waits (5 s deadline).
    let slots_process = common::TestLedger::start();
    let slots_ledger = ledger_client(vec![slots_process.address]);
    let settings = library_settings();
    let routes = [("/slow".to_owned(), NonZeroU64::new(2).unwrap())];
    let timeout = NonZeroU32::new(30).unwrap();
    let limits = ConcurrencyLimits::new(&slots_ledger, &routes, timeout, &settings).unwrap();
    let ledger = ledger_client(vec![shared_ledger().address]);
    let big = Plan::new("big", NonZeroU64::new(1000).unwrap(), timeout).unwrap();
    let plans = PlanBook::new(vec![big], "big", [], [], UnknownKeys::DefaultPlan).unwrap();
    let limiter = Arc::new(Limiter::new(ledger, Arc::new(plans), settings));
    let rules = Arc::new(RequestRules::builder().build(limiter.plans()).unwrap());
    let rate_limit = RateLimit::new(limiter.clone(), rules).with_concurrency(limits);
    let server = HttpServer::new(move || {
        App::new()
            .wrap(rate_limit.clone())
            .wrap(actix_web::middleware::from_fn(two_seconds_at_most))
            .route(
                "/slow",
                web::get().to(|| async { HttpResponse::Ok().finish() }),
            )
    })
    .workers(1)
    .bind(("127.0.0.1", 0))
    .unwrap();
    let port = server.addrs()[0].port();
    let server = server.run();
    let handle = server.handle();
    tokio::spawn(server);
    let key = fresh_key("k_");
    // The slot's account exists first (provisioned), so the stopped ledger holds the slot's hold.
    let url = format!("http://127.0.0.1:{port}/slow");
    let http = reqwest::Client::new();
    let send = || http.get(&url).header("X-Api-Key", &key).send();
    assert_eq!(send().await.unwrap().status(), 200);
    slots_process.pause(true);
    let timed_out = send().await.unwrap();
    assert_eq!(
        timed_out.status(),
        504,
        "dropped before its slot was decided"
    );
    let account_id = limiter.account_of(&caller(&key)).unwrap();
    let given_back_by = Instant::now() + Duration::from_secs(4);
    let audit = loop {
        let deadline = Instant::now() + Duration::from_secs(5);
        let audit = limiter.ledger().audit(account_id, deadline).await.unwrap();
        let audit = audit.unwrap();
        if audit.debits_pending == 1 || Instant::now() > given_back_by {
            break audit;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    // Two rate holds placed (the dropped request's was, before its slot), one voided.
    assert_eq!((audit.holds, audit.voids), (2, 1), "{audit:?}");
    assert_eq!(audit.debits_pending, 1, "the served request's hold alone");
    slots_process.pause(false);
    handle.stop(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_concurrency_limit_holds_slots_across_instances_and_gives_them_back() {
    use std::num::NonZeroU64;
    use std::time::Duration;

    let gate = Gate::new(false);
    let (a, stop_a, limiter) = slow_instance(&gate).await;
    let (b, stop_b, _) = slow_instance(&gate).await;
    let http = reqwest::Client::new();
    let key = fresh_key("k_");
    let burst = |n: usize, refusals: usize| {
        let requests = (0..n).map(|i| {
            let port = if i % 2 == 0 { a } else { b };
            let request = http
                .get(format!("http://127.0.0.1:{port}/slow"))
                .header("X-Api-Key", &key);
            async move {
                let response = request.send().await.unwrap();
                let field = |name: &str| {
                    let value = response.headers().get(name)?;
                    Some(value.to_str().unwrap().to_owned())
                };
                let fields = (field("ratelimit-policy"), field("ratelimit"));
                (response.status().as_u16(), fields)
            }
        });
        gated(&gate, requests.collect(), refusals, |(status, _)| {
            *status == 429
        })
    };
    let first = burst(6, 4).await;
    let mut statuses: Vec<u16> = first.iter().map(|(status, _)| *status).collect();
    statuses.sort();
    assert_eq!(
        statuses,
        [200, 200, 429, 429, 429, 429],
        "two slots across both instances"
    );
    // A slot's 429 has the rate's fields, as every 429 does, with the rate given back: of the
    // plan's 1,000 the two requests served (at most) are spent. Beside them, the concurrency
    // limit that refused, spent for a second (it showed the rate's quota alone, units left).
    for (_, (policy, ratelimit)) in first.iter().filter(|(status, _)| *status == 429) {
        let slots = "\"concurrency\";q=2;qu=\"concurrent-requests\"";
        assert_eq!(
            policy.as_deref(),
            Some(&*format!("\"big\";q=1000;w=30, {slots}"))
        );
        let ratelimit = ratelimit.as_deref().expect("a RateLimit field");
        let slot = ratelimit.strip_suffix(", \"concurrency\";r=0;t=1");
        let ratelimit = slot.expect(ratelimit);
        let remaining: u64 = ratelimit
            .strip_prefix("\"big\";r=")
            .and_then(|rest| rest.split(';').next())
            .and_then(|r| r.parse().ok())
            .expect(ratelimit);
        assert!((998..=1000).contains(&remaining), "{ratelimit}");
    }
    // The slots come back when the requests end: soon after their bodies, not at once (each a
    // void sent as the body is dropped), so the ledger is asked until none is held.
    let ledger = ledger_client(vec![shared_ledger().address]);
    let caller = caller(&key);
    let slot_account = slot_account("/slow", NonZeroU64::new(2).unwrap(), &key);
    let no_slot_held = || async {
        let given_back = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            let audit = ledger.audit(slot_account, deadline).await.unwrap().unwrap();
            if audit.debits_pending == 0 {
                return audit;
            }
            assert!(std::time::Instant::now() < given_back, "{audit:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    no_slot_held().await;
    let statuses: Vec<u16> = burst(2, 0).await.iter().map(|(s, _)| *s).collect();
    assert_eq!(statuses, [200, 200]);

    // In the ledger: no slot is held now, and the refused requests were not charged.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let slots_audit = no_slot_held().await;
    assert_eq!(
        slots_audit.admitted(),
        0,
        "every slot given back: {slots_audit:?}"
    );
    let rate = ledger
        .audit(limiter.account_of(&caller).unwrap(), deadline)
        .await;
    let rate = rate.unwrap().unwrap();
    assert_eq!(
        rate.admitted(),
        4,
        "only the served requests are charged: {rate:?}"
    );
    stop_a.stop(true).await;
    stop_b.stop(true).await;
}

/// A route charged against the plan and two route limits at once, from two instances at once:
/// exactly the tightest limit is admitted, a refused request holds nothing on any limit, and the
/// 429 and the `RateLimit` fields say which limit was hit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_limits_per_request_admit_exactly_the_tightest_and_name_it() {
    use ledger_limiter::config::PlanFile;
    use ledger_limiter::limiter::extra::route_limit_account;
    use ledger_limiter::limiter::plan::Plan;
    let with_limits = || {
        let routes = RoutesFile {
            limits: Some([("/greeting".to_owned(), vec!["short".into(), "long".into()])].into()),
            ..RoutesFile::default()
        };
        let mut config = config(10, routes, ResponseFile::default());
        let limits: [(String, PlanFile); 2] =
            [("short".into(), plan(3, 60)), ("long".into(), plan(5, 600))];
        config.limits = Some(limits.into());
        config
    };
    let a = spawn_app(with_limits()).await;
    let b = spawn_app(with_limits()).await;
    let key = fresh_key("k_");
    let answers = join_all((0..20).map(|i| {
        let app = if i % 2 == 0 { &a } else { &b };
        let key = key.clone();
        async move {
            let response = app.get("/greeting", Some(&key)).await;
            let status = response.status().as_u16();
            let policy = response.headers()["ratelimit-policy"]
                .to_str()
                .unwrap()
                .to_owned();
            let ratelimit = response.headers()["ratelimit"].to_str().unwrap().to_owned();
            let body = response.text().await.unwrap();
            (status, policy, ratelimit, body)
        }
    }))
    .await;
    let admitted = answers.iter().filter(|a| a.0 == 200).count();
    assert_eq!(admitted, 3, "{answers:?}");
    for (status, policy, ratelimit, body) in &answers {
        assert_eq!(
            policy,
            "\"free\";q=10;w=60, \"short\";q=3;w=60, \"long\";q=5;w=600"
        );
        assert_eq!(ratelimit.matches(";r=").count(), 3, "{ratelimit}");
        if *status == 429 {
            assert!(
                body.contains("limit short allows 3 units per 60 s"),
                "{body} {answers:#?}"
            );
            assert!(ratelimit.contains("\"short\";r=0;"), "{ratelimit}");
        }
    }
    // Nothing held for the 17 refused, on any limit.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let ledger = a.limiter.ledger();
    let plan_audit = held(&a, &key).await;
    assert_eq!((plan_audit.admitted(), plan_audit.debits_pending), (3, 3));
    let caller = caller(&key);
    for (name, capacity, window) in [("short", 3, 60), ("long", 5, 600)] {
        let limit = Plan::new(
            name,
            capacity.try_into().unwrap(),
            std::num::NonZeroU32::new(window).unwrap(),
        )
        .unwrap();
        let account = route_limit_account(ledger.ledger_id(), &limit, &caller);
        let audit = ledger
            .audit(account.id, deadline)
            .await
            .unwrap()
            .expect("provisioned");
        assert_eq!(
            (audit.admitted(), audit.debits_pending),
            (3, 3),
            "{name}: {audit:?}"
        );
    }
    // Another route has the plan only.
    let other = a.get("/elsewhere", Some(&key)).await;
    assert_eq!(other.headers()["ratelimit-policy"], "\"free\";q=10;w=60");
    a.stop().await;
    b.stop().await;
}

/// A request refused while two of its limits are spent is told to wait for the later one: the
/// plan (2 per 3 s) comes back first, the route's "hour" (2 per 60 s) later. Before, Retry-After
/// was the first spent limit's (the plan's, about 3 s), and waiting it out met another 429.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_waits_for_every_spent_limit() {
    use ledger_limiter::config::PlanFile;
    let routes = RoutesFile {
        limits: Some([("/greeting".to_owned(), vec!["hour".into()])].into()),
        ..RoutesFile::default()
    };
    let mut config = config(2, routes, ResponseFile::default());
    config.plans = Some([("free".to_owned(), plan(2, 3))].into());
    let limits: [(String, PlanFile); 1] = [("hour".into(), plan(2, 60))];
    config.limits = Some(limits.into());
    let app = spawn_app(config).await;
    let key = fresh_key("k_");
    for _ in 0..2 {
        assert_eq!(app.get("/greeting", Some(&key)).await.status(), 200);
    }
    // The ledger's refusal (the chain stops at the plan's link), then memory's (both listed).
    for source in ["ledger", "local view"] {
        let calls = request_calls(app.limiter.ledger());
        let refused = app.get("/greeting", Some(&key)).await;
        assert_eq!(refused.status(), 429, "{source}");
        // Each source asserted, not only named: a second trip to the ledger left memory's
        // Retry-After untested.
        let asked = request_calls(app.limiter.ledger()) - calls;
        assert_eq!(
            asked > 0,
            source == "ledger",
            "{source}: {asked} ledger calls"
        );
        let retry = refused.headers()["retry-after"]
            .to_str()
            .unwrap()
            .to_owned();
        let ratelimit = refused.headers()["ratelimit"].to_str().unwrap().to_owned();
        let body = refused.text().await.unwrap();
        let retry: u64 = retry.parse().unwrap();
        assert!(retry >= 55, "{source}: Retry-After {retry} {body}");
        assert!(
            body.contains("limit hour allows 2 units per 60 s"),
            "{source}: {body}"
        );
        assert!(ratelimit.contains("\"hour\";r=0;"), "{source}: {ratelimit}");
    }
    app.stop().await;
}

/// Route limits must exist, be distinct, and afford the route's cost.
#[test]
fn bad_route_limits_are_refused_with_the_setting_named() {
    use ledger_limiter::config::Settings;
    let parse = |text: &str| {
        let file = FileConfig::parse(text, "test.toml").unwrap();
        Settings::with_overrides(file).unwrap_err().to_string()
    };
    let e = parse("[routes.limits]\n\"/a\" = [\"nope\"]\n");
    assert!(e.contains("routes.limits") && e.contains("\"nope\""), "{e}");
    let e = parse("[limits.x]\ncapacity = 0\nwindow_seconds = 1\n");
    assert!(e.contains("limits.x.capacity"), "{e}");
    let e = parse(
        "[limits.x]\ncapacity = 2\nwindow_seconds = 1\n[routes.limits]\n\"/a\" = [\"x\", \"x\"]\n",
    );
    assert!(e.contains("twice"), "{e}");
    let e = parse("[limits.x]\ncapacity = 2\nwindow_seconds = 1\n[routes]\ncosts = { \"/a\" = 3 }\n[routes.limits]\n\"/a\" = [\"x\"]\n");
    assert!(e.contains("costs 3"), "{e}");
    // Defined, never named by a route: it would never apply.
    let e = parse("[limits.x]\ncapacity = 2\nwindow_seconds = 1\n[limits.y]\ncapacity = 2\nwindow_seconds = 1\n[routes.limits]\n\"/a\" = [\"x\"]\n");
    assert!(e.contains("limits.y") && e.contains("never apply"), "{e}");
}

/// A streamed response holds its concurrency slot until its body ends, not when its handler
/// returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_response_holds_its_slot_until_the_body_ends() {
    let gate = Gate::new(false);
    let (port, stop, _) = slow_instance(&gate).await;
    let http = reqwest::Client::new();
    let key = fresh_key("k_");
    let url = format!("http://127.0.0.1:{port}/stream");
    let send = || http.get(&url).header("X-Api-Key", &key).send();
    // Two streams whose handlers have returned (their headers are here), their bodies not ended.
    let first = send().await.unwrap();
    let second = send().await.unwrap();
    assert_eq!(
        (first.status().as_u16(), second.status().as_u16()),
        (200, 200)
    );
    // Both slots are held by the bodies still streaming: a third is refused.
    assert_eq!(send().await.unwrap().status(), 429);
    gate.send_replace(true);
    assert_eq!(first.text().await.unwrap().len(), 12);
    assert_eq!(second.text().await.unwrap().len(), 12);
    // Every body ended, so both slots come back (each by a void at the ledger: soon, not at once,
    // and long before the slots' 30 s timeout).
    let slots = slot_account("/stream", std::num::NonZeroU64::new(2).unwrap(), &key);
    let ledger = ledger_client(vec![shared_ledger().address]);
    let given_back_by = std::time::Instant::now() + Duration::from_secs(5);
    let audit = loop {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        let audit = ledger.audit(slots, deadline).await.unwrap().unwrap();
        if audit.debits_pending == 0 || std::time::Instant::now() > given_back_by {
            break audit;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(
        (audit.holds, audit.voids),
        (2, 2),
        "both slots given back: {audit:?}"
    );
    stop.stop(true).await;
}

/// A handler reports what a request really cost (tokens, bytes) in the configured header: the
/// header is removed, the hold replaced by one of the actual cost (never more than the caller
/// has free), and the next requests see it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cost_reported_after_the_response_replaces_the_estimate() {
    let limiter = metered_limiter();
    let rules = RequestRules::builder()
        .cost_header("x-cost")
        .refund_server_errors("/failing")
        .build(limiter.plans());
    let (port, handle) = serve_library(&limiter, rules.unwrap(), |routes| {
        let tokens = |n: web::Path<String>| async move {
            HttpResponse::Ok()
                .insert_header(("x-cost", n.into_inner()))
                .finish()
        };
        // A handler that fails after reporting a cost: refunded, and its report still ours.
        let failing = || async {
            HttpResponse::InternalServerError()
                .insert_header(("x-cost", "3"))
                .finish()
        };
        // Two reports (a handler's and an inner middleware's, say): neither is picked.
        let twice = || async {
            HttpResponse::Ok()
                .append_header(("x-cost", "3"))
                .append_header(("x-cost", "500"))
                .finish()
        };
        routes
            .route("/tokens/{n}", web::get().to(tokens))
            .route("/failing", web::get().to(failing))
            .route("/twice", web::get().to(twice));
    });
    let http = reqwest::Client::new();
    let key = fresh_key("k_");
    let get = |n: &str| {
        let request = http
            .get(format!("http://127.0.0.1:{port}/tokens/{n}"))
            .header("X-Api-Key", &key);
        async move { request.send().await.unwrap() }
    };
    let first = get("4").await;
    assert_eq!(first.status(), 200);
    assert!(
        first.headers().get("x-cost").is_none(),
        "the report is ours, not the caller's"
    );
    assert_eq!(remaining(&first), 6);
    // A report of nothing (a cache hit): the hold is voided, nothing is held, no reset to wait
    // for. `t` stayed at the voided hold's window.
    let nothing = http
        .get(format!("http://127.0.0.1:{port}/tokens/0"))
        .header("X-Api-Key", fresh_key("k_"))
        .send()
        .await
        .unwrap();
    let fields = nothing
        .headers()
        .get("ratelimit")
        .unwrap()
        .to_str()
        .unwrap();
    assert!(fields.ends_with(";r=10;t=0"), "{fields}");
    let failed = http
        .get(format!("http://127.0.0.1:{port}/failing"))
        .header("X-Api-Key", &key)
        .send()
        .await
        .unwrap();
    assert_eq!(failed.status(), 500);
    assert!(
        failed.headers().get("x-cost").is_none(),
        "refunded, and still ours"
    );
    // Not a number: the estimate (1) stands.
    assert_eq!(remaining(&get("lots").await), 5);
    let twice = http
        .get(format!("http://127.0.0.1:{port}/twice"))
        .header("X-Api-Key", &key)
        .send()
        .await
        .unwrap();
    assert!(twice.headers().get("x-cost").is_none(), "both are ours");
    assert_eq!(remaining(&twice), 4, "two reports: the estimate (1) stands");
    // More than is free: the ledger takes what is free (5), and the caller is out.
    assert_eq!(get("7").await.status(), 200);
    assert_eq!(get("1").await.status(), 429);
    let caller = caller(&key);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let audit = limiter
        .ledger()
        .audit(limiter.account_of(&caller).unwrap(), deadline)
        .await;
    let audit = audit.unwrap().unwrap();
    assert_eq!(audit.debits_pending, 10, "{audit:?}");
    assert_eq!(
        (audit.holds, audit.voids),
        (7, 3),
        "5 requests, 2 recharged, 1 refunded: {audit:?}"
    );
    handle.stop(true).await;
}

/// A slot whose request is cut short as its worker's runtime shuts down (a stream still running
/// when a stop's drain ends) is counted out until it is back, and given back from the runtime
/// the limits were made on: its worker's runtime dropped the give-back unrun, and the slot was
/// held until its timeout (its caller refused meanwhile, across a rolling deploy).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_cut_short_by_a_worker_shutting_down_is_given_back() {
    use ledger_limiter::http::ConcurrencyLimits;
    use std::num::{NonZeroU32, NonZeroU64};
    let ledger = ledger_client(vec![shared_ledger().address]);
    let one = NonZeroU64::new(1).unwrap();
    let routes = [("/stream".to_owned(), one)];
    let timeout = NonZeroU32::new(60).unwrap();
    // The service's main runtime: the limits are made on it, and it is not driven until the
    // worker below is gone, so what it runs is what was handed to it.
    let main = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let limits = {
        let _made_on = main.enter();
        ConcurrencyLimits::new(&ledger, &routes, timeout, &library_settings()).unwrap()
    };
    let limits = Arc::new(limits);
    let out = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let key = fresh_key("k_");
    // A worker of its own: takes the slot in a request that never ends, then shuts down.
    let worker = {
        let (limits, key, out) = (limits.clone(), caller(&key), out.clone());
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async {
                let deadline = std::time::Instant::now() + Duration::from_secs(10);
                let slot = limits.take("/stream", &key, false, deadline).await;
                let slot = slot.ok().flatten().expect("a slot");
                tokio::spawn(async move {
                    let _in_flight = slot;
                    std::future::pending::<()>().await
                });
                tokio::task::yield_now().await;
                let held = limits.slots_out().back(Duration::ZERO).await;
                out.store(held, std::sync::atomic::Ordering::Relaxed);
            });
            drop(runtime); // the request's task, and its slot, dropped as the runtime goes
        })
    };
    worker.join().unwrap();
    assert_eq!(
        out.load(std::sync::atomic::Ordering::Relaxed),
        1,
        "counted out while held"
    );
    // Handed to the main runtime, and still out until it runs there.
    assert_eq!(
        limits.slots_out().back(Duration::ZERO).await,
        1,
        "handed off"
    );
    let back = {
        let limits = limits.clone();
        std::thread::spawn(move || {
            let back = main.block_on(limits.slots_out().back(Duration::from_secs(10)));
            drop(main);
            back
        })
    };
    assert_eq!(back.join().unwrap(), 0, "back");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let audit = ledger.audit(slot_account("/stream", one, &key), deadline);
    let audit = audit.await.unwrap().unwrap();
    assert_eq!((audit.holds, audit.voids), (1, 1), "given back: {audit:?}");
}

/// A slot's `release` dropped before its give-back is sent (it waits to be sent again: the
/// in-flight bound was full) goes on from the runtime the limits were made on. It was lost with
/// the future, and the slot held until its timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_release_dropped_before_it_is_sent_goes_on() {
    use ledger_limiter::http::ConcurrencyLimits;
    use std::num::{NonZeroU32, NonZeroU64};
    let process = TestLedger::start();
    let ledger = Arc::new(ledger_client_bounded(vec![process.address], 1));
    let one = NonZeroU64::new(1).unwrap();
    let routes = [("/stream".to_owned(), one)];
    let timeout = NonZeroU32::new(60).unwrap();
    let limits = ConcurrencyLimits::new(&ledger, &routes, timeout, &library_settings()).unwrap();
    let key = fresh_key("k_");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let slot = limits.take("/stream", &caller(&key), false, deadline).await;
    let slot = slot.ok().flatten().expect("a slot");
    // The bound's only place taken, at a stopped ledger: the give-back cannot be sent, and
    // waits for a place (up to a ledger timeout, 5 s).
    let other = take_the_only_place(&process, &ledger, 1).await;
    let release = tokio::time::timeout(Duration::from_millis(200), slot.release()).await;
    assert!(release.is_err(), "not sent: the bound is full");
    assert_eq!(
        limits.slots_out().back(Duration::ZERO).await,
        1,
        "handed on"
    );
    process.pause(false);
    let _ = other.await;
    let back = limits.slots_out().back(Duration::from_secs(20)).await;
    assert_eq!(back, 0, "given back");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let audit = ledger.audit(slot_account("/stream", one, &key), deadline);
    let audit = audit.await.unwrap().unwrap();
    assert_eq!((audit.holds, audit.voids), (1, 1), "given back: {audit:?}");
}

/// A cost reported after other requests took what was free: the ledger charges what is free
/// (capped), and the response's `r` says what is left, not the admission's quota less the
/// difference (it said 4 of 10 with nothing left).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_capped_recharge_says_what_is_left() {
    // The slow handler reports its cost once the test has sent the 7 others, however slowly a
    // loaded machine sends them (a static: `serve_library` takes a plain fn). Whatever the
    // order the first of them and the slow one are admitted in, nothing is left in the end.
    static REPORT: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(0);
    let limiter = metered_limiter();
    let rules = RequestRules::builder()
        .cost_header("x-cost")
        .build(limiter.plans());
    let (port, handle) = serve_library(&limiter, rules.unwrap(), |routes| {
        let slow = || async {
            let _ = tokio::time::timeout(GATE_WAIT_MAX, REPORT.acquire()).await;
            HttpResponse::Ok().insert_header(("x-cost", "5")).finish()
        };
        routes
            .route("/slow", web::get().to(slow))
            .route("/fast", web::get().to(HttpResponse::Ok));
    });
    let http = reqwest::Client::new();
    let key = fresh_key("k_");
    let get = |path: &str| {
        let request = http
            .get(format!("http://127.0.0.1:{port}{path}"))
            .header("X-Api-Key", &key);
        async move { request.send().await.unwrap() }
    };
    // The first request provisions the caller (so the slow one is admitted at once), then the
    // slow one (1 held) runs while 7 more take 7 of the 8 left.
    assert_eq!(remaining(&get("/fast").await), 9);
    let slow = tokio::spawn(get("/slow"));
    tokio::time::sleep(Duration::from_millis(300)).await;
    for _ in 0..7 {
        assert_eq!(get("/fast").await.status(), 200);
    }
    REPORT.add_permits(1);
    let slow = slow.await.unwrap();
    assert_eq!(slow.status(), 200);
    assert_eq!(
        remaining(&slow),
        0,
        "5 reported, 1 held and 1 free: nothing left"
    );
    handle.stop(true).await;
}

/// A handler that panics on a refund route is our failure, as a 500 is: the request's hold is
/// given back (the task's future is dropped while the panic unwinds), and on a route that is not
/// refunded it stays charged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_handler_on_a_refund_route_is_not_charged() {
    let limiter = metered_limiter();
    let rules = RequestRules::builder()
        .refund_server_errors("/refunded")
        .build(limiter.plans());
    let (port, handle) = serve_library(&limiter, rules.unwrap(), |routes| {
        let panics = || async {
            panic!("a handler's bug (this test's, on purpose)");
            #[allow(unreachable_code)]
            HttpResponse::Ok().finish()
        };
        routes
            .route("/refunded", web::get().to(panics))
            .route("/charged", web::get().to(panics));
    });
    let http = reqwest::Client::new();
    let audit = |key: String| {
        let limiter = limiter.clone();
        async move {
            let account = limiter.account_of(&caller(&key)).unwrap();
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            limiter
                .ledger()
                .audit(account, deadline)
                .await
                .unwrap()
                .unwrap()
        }
    };
    for (path, voids) in [("/refunded", 1), ("/charged", 0)] {
        let key = fresh_key("k_");
        let sent = http
            .get(format!("http://127.0.0.1:{port}{path}"))
            .header("X-Api-Key", &key)
            .send()
            .await;
        assert!(sent.is_err(), "{path}: the connection is closed, no answer");
        // The give-back is a void sent from a task of its own: soon, not at once. Where none
        // is due, a second (longer than the refunded one's took) for one that should not be.
        let given_back = std::time::Instant::now() + Duration::from_secs(5);
        if voids == 0 {
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        let mut held = audit(key.clone()).await;
        while held.voids < voids && std::time::Instant::now() < given_back {
            tokio::time::sleep(Duration::from_millis(50)).await;
            held = audit(key.clone()).await;
        }
        assert_eq!((held.holds, held.voids), (1, voids), "{path}: {held:?}");
    }
    handle.stop(true).await;
}

/// A request that outlives a short limit's window (a per-second limit under a long completion) is
/// charged what it reported on the limits whose holds still live: the expired hold has nothing
/// left to charge, and used to fail every other hold's recharge with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reported_cost_is_charged_where_holds_live_when_a_shorter_one_expired() {
    let ledger = ledger_client(vec![shared_ledger().address]);
    let limiter = Arc::new(one_plan_limiter(ledger, library_plan("metered", 100, 60)));
    let rules = RequestRules::builder()
        .cost_header("x-cost")
        .limits("/slow/*", vec![library_plan("per_second", 10, 1)])
        .build(limiter.plans());
    // Past the per-second limit's window (and its expiry margin), then reports its cost.
    let (port, handle) = serve_library(&limiter, rules.unwrap(), |routes| {
        let slow = |n: web::Path<String>| async move {
            tokio::time::sleep(Duration::from_millis(2500)).await;
            HttpResponse::Ok()
                .insert_header(("x-cost", n.into_inner()))
                .finish()
        };
        routes.route("/slow/{n}", web::get().to(slow));
    });
    let key = fresh_key("k_");
    let response = reqwest::Client::new()
        .get(format!("http://127.0.0.1:{port}/slow/40"))
        .header("X-Api-Key", &key)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let policy = response.headers()["ratelimit-policy"].to_str().unwrap();
    assert!(
        policy.contains("\"per_second\""),
        "both limits apply: {policy}"
    );
    assert_eq!(
        remaining(&response),
        60,
        "the plan's field shows the report"
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let account = limiter.account_of(&caller(&key)).unwrap();
    let audit = limiter.ledger().audit(account, deadline).await;
    let audit = audit.unwrap().unwrap();
    assert_eq!(
        audit.debits_pending, 40,
        "the report, not the estimate: {audit:?}"
    );
    assert_eq!((audit.holds, audit.voids), (2, 1), "{audit:?}");
    // The per-second hold had expired when the report came: left out, not charged 10 of 40.
    let per_second = library_plan("per_second", 10, 1);
    let short = ledger_limiter::limiter::extra::route_limit_account(
        limiter.ledger().ledger_id(),
        &per_second,
        &caller(&key),
    );
    let short = limiter.ledger().audit(short.id, deadline).await;
    let short = short.unwrap().expect("provisioned");
    // (Its expiry may not be processed yet: the hold's count, not the pending balance.)
    assert_eq!(
        (short.holds, short.voids),
        (1, 0),
        "the estimate's hold alone, neither voided nor recharged: {short:?}"
    );
    handle.stop(true).await;
}

/// A route's slots are found for a path whose parameter hides a `/` in an escape (the handler
/// of `/reports/{tail:.*}` reads `big` from `/reports%2Fbig`), and of two routes the path's two
/// forms are on, the one with fewer slots: routed alone, the escape dodged `/reports/*`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_escaped_slash_finds_the_routes_slots_and_the_fewer_of_two() {
    use ledger_limiter::http::ConcurrencyLimits;
    use std::num::{NonZeroU32, NonZeroU64};
    let ledger = ledger_client(vec![shared_ledger().address]);
    let timeout = NonZeroU32::new(30).unwrap();
    // The slots of the route `path` is on, among `routes` (pattern, slots).
    let slots_of = |routes: &[(&str, u64)], path: &str| {
        let routes: Vec<_> = (routes.iter())
            .map(|(pattern, n)| (pattern.to_string(), NonZeroU64::new(*n).unwrap()))
            .collect();
        let limits = ConcurrencyLimits::new(&ledger, &routes, timeout, &library_settings());
        let limits = limits.unwrap();
        let slots = limits.for_path(path);
        slots.map(|l| l.plans().capacity_min().get())
    };
    let three = [("/reports/*", 3), ("/reports/big", 1), ("/rep*", 5)];
    assert_eq!(slots_of(&three, "/reports/x"), Some(3));
    // Routed, `/rep*` (5); decoded, `/reports/*` (3): the fewer.
    assert_eq!(slots_of(&three, "/reports%2Fx"), Some(3));
    assert_eq!(slots_of(&three, "/reports%2fbig"), Some(1));
    assert_eq!(slots_of(&three, "/other%2Fx"), None);
    // The routed form's route the stricter: its slots, not the decoded form's.
    let two = [("/reports/*", 3), ("/rep*", 1)];
    assert_eq!(slots_of(&two, "/reports/x"), Some(3));
    assert_eq!(slots_of(&two, "/reports%2Fx"), Some(1));
}

/// Concurrency limits of 3 on `/reports/*` and 2 on `/rep*` (30 s slots) over `ledger`, and a
/// fresh caller: `/reports%2Fx` is on both routes.
fn reports_and_rep(
    ledger: &ledger_limiter::ledger::Ledger,
) -> (
    ledger_limiter::http::ConcurrencyLimits,
    ledger_limiter::limiter::caller::CallerKey,
) {
    use std::num::{NonZeroU32, NonZeroU64};
    let routes = [("/reports/*", 3), ("/rep*", 2)]
        .map(|(pattern, n)| (pattern.to_owned(), NonZeroU64::new(n).unwrap()));
    let timeout = NonZeroU32::new(30).unwrap();
    let settings = library_settings();
    let limits = ledger_limiter::http::ConcurrencyLimits::new(ledger, &routes, timeout, &settings);
    (limits.unwrap(), caller(&fresh_key("k")))
}

/// A path whose two forms are on two routes takes a slot on each, both or neither:
/// `/reports%2Fx` counts on `/reports/*` as well as on `/rep*`. It took `/rep*`'s alone, and
/// came in as a fourth request in flight beside three `/reports/x` under a limit of three.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_escaped_slash_takes_a_slot_on_both_routes() {
    use std::num::NonZeroU64;
    use std::time::Instant;
    let ledger = ledger_client(vec![shared_ledger().address]);
    let (limits, key) = reports_and_rep(&ledger);
    let take = |path: &'static str| {
        let deadline = Instant::now() + Duration::from_secs(5);
        limits.take(path, &key, false, deadline)
    };
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(take("/reports/x").await.ok().flatten().expect("a slot"));
    }
    let refused = take("/reports%2Fx")
        .await
        .err()
        .expect("/reports/* is full");
    assert_eq!(refused.response.status().as_u16(), 429);
    // Refused by `/reports/*`, the looser route (taken second): its slots named, not `/rep*`'s.
    assert_eq!(refused.in_flight_max.map(NonZeroU64::get), Some(3));
    // The `/rep*` slot it took first went back with the refusal: both are free.
    for _ in 0..2 {
        held.push(take("/repx").await.ok().flatten().expect("a /rep* slot"));
    }
    for slot in held.drain(..) {
        slot.release().await;
    }
    // Taken on both routes: one of `/reports/*`'s three, one of `/rep*`'s two.
    held.push(take("/reports%2Fx").await.ok().flatten().expect("both"));
    for _ in 0..2 {
        held.push(take("/reports/x").await.ok().flatten().expect("a slot"));
    }
    assert!(
        take("/reports/x").await.is_err(),
        "three in flight on /reports/*"
    );
    held.push(
        take("/repx")
            .await
            .ok()
            .flatten()
            .expect("the last /rep* slot"),
    );
    assert!(take("/repx").await.is_err(), "two in flight on /rep*");
    for slot in held {
        slot.release().await;
    }
}

/// A path on two routes refused by the second answers by its deadline however slow the first
/// slot's give-back: the refusal waited for it inline, sent again until it landed or the slot
/// would have expired (30 s here), and held the request and its connection that long.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_on_the_second_route_answers_by_its_deadline() {
    use ledger_limiter::ledger::model::TRANSFER_CODE_REQUEST;
    use std::time::Instant;
    let proxy = LedgerProxy::start(shared_ledger().address).await;
    let ledger = ledger_client(vec![proxy.address]);
    let (limits, key) = reports_and_rep(&ledger);
    let take =
        |path: &'static str, by: Duration| limits.take(path, &key, false, Instant::now() + by);
    // `/reports/*` full; `/rep*`'s account made, so its next slot is one hold.
    let mut held = Vec::new();
    for _ in 0..3 {
        let slot = take("/reports/x", Duration::from_secs(5)).await;
        held.push(slot.ok().flatten().expect("a slot"));
    }
    let rep = take("/repx", Duration::from_secs(5)).await;
    rep.ok().flatten().expect("a /rep* slot").release().await;
    // `/rep*`'s hold goes through; every later call of the client (its give-back) waits 20 s.
    let (caught, go) = proxy.lose_answer_to(TRANSFER_CODE_REQUEST, Instant::now());
    proxy.hold_later_requests_until(Instant::now() + Duration::from_secs(20));
    let started = Instant::now();
    let (refused, ()) = tokio::join!(take("/reports%2Fx", Duration::from_secs(2)), async {
        let heard = tokio::time::timeout(Duration::from_secs(10), caught).await;
        heard.expect("the /rep* hold is sent").unwrap();
        let _ = go.send(());
    });
    let took = started.elapsed();
    let refused = refused.err().expect("/reports/* is full");
    assert!([429, 503].contains(&refused.response.status().as_u16()));
    assert!(took < Duration::from_secs(4), "answered in {took:?}");
    drop(held); // given back from their tasks, late: the proxy holds them
}
