//! The limiter end to end: real HTTP over sockets, a real TigerBeetle process.

mod common;

use std::time::{Duration, Instant};

use common::*;
use futures_util::future::join_all;
use ledger_limiter::config::{CallerFile, FileConfig, LedgerFile, RoutesFile};
use ledger_limiter::ledger::{self, model};
use ledger_limiter::limiter::Outcome;
use tigerbeetle_unofficial as tb;

fn header<'a>(response: &'a reqwest::Response, name: &str) -> &'a str {
    response
        .headers()
        .get(name)
        .unwrap_or_else(|| panic!("{name} header missing"))
        .to_str()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admits_capacity_then_limits_with_headers_then_admits_after_retry_after() {
    let ledger = shared_ledger();
    let mut config = test_config(ledger.address);
    config.plans = Some([("free".to_owned(), plan(3, 2))].into());
    let app = spawn_app(config).await;
    let key = fresh_key("k_");

    for expected_remaining in [2, 1, 0] {
        let response = app.get("/greeting", Some(&key)).await;
        assert_eq!(response.status(), 200);
        assert_eq!(header(&response, "ratelimit-policy"), "\"free\";q=3;w=2");
        assert_eq!(remaining(&response), expected_remaining);
        assert_eq!(response.text().await.unwrap(), "hello");
    }

    let limited = app.get("/greeting", Some(&key)).await;
    assert_eq!(limited.status(), 429);
    assert_eq!(header(&limited, "content-type"), "application/problem+json");
    assert_eq!(header(&limited, "ratelimit-policy"), "\"free\";q=3;w=2");
    assert_eq!(remaining(&limited), 0);
    let retry_after: u64 = header(&limited, "retry-after").parse().unwrap();
    assert!((1..=3).contains(&retry_after), "Retry-After {retry_after}");
    let body: serde_json::Value = limited.json().await.unwrap();
    assert_eq!(body["status"], 429);
    assert_eq!(body["type"], "urn:ledger-limiter:problem:rate-limited");

    // The next one is answered from this instance's memory of the exhausted caller.
    let calls = request_calls(app.limiter.ledger());
    let again = app.get("/greeting", Some(&key)).await;
    assert_eq!(again.status(), 429);
    assert_eq!(request_calls(app.limiter.ledger()), calls, "from memory");
    let retry_after_again: u64 = header(&again, "retry-after").parse().unwrap();
    assert!(retry_after_again <= retry_after);

    // Waiting exactly Retry-After then succeeds.
    tokio::time::sleep(Duration::from_secs(retry_after_again)).await;
    let after = app.get("/greeting", Some(&key)).await;
    assert_eq!(after.status(), 200, "admitted again after Retry-After");
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_from_the_ledger_is_honoured_across_instances() {
    // Instance A spends the credit; instance B has never seen the caller, so its 429 comes from
    // the ledger (exceeds_credits), and its Retry-After from the ledger's holds.
    let ledger = shared_ledger();
    let mut config = test_config(ledger.address);
    config.plans = Some([("free".to_owned(), plan(2, 3))].into());
    let a = spawn_app(config.clone()).await;
    let b = spawn_app(config).await;
    let key = fresh_key("k_");
    assert_eq!(a.get("/greeting", Some(&key)).await.status(), 200);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(a.get("/greeting", Some(&key)).await.status(), 200);

    let limited = b.get("/greeting", Some(&key)).await;
    assert_eq!(limited.status(), 429);
    let retry_after: u64 = header(&limited, "retry-after").parse().unwrap();
    // The oldest hold was placed ~1.1 s ago with a 3 s window: it is released in ~1.9 s.
    assert!((1..=3).contains(&retry_after), "Retry-After {retry_after}");
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(retry_after)).await;
    let after = b.get("/greeting", Some(&key)).await;
    assert_eq!(after.status(), 200, "waited {:?}", started.elapsed());
    a.stop().await;
    b.stop().await;
}

async fn burst(apps: &[&TestApp], key: &str, path: &str, requests: usize) -> (usize, usize) {
    let futures = (0..requests).map(|i| {
        let app = apps[i % apps.len()];
        async move { app.get(path, Some(key)).await.status().as_u16() }
    });
    let statuses = join_all(futures).await;
    let admitted = statuses.iter().filter(|s| **s == 200).count();
    let limited = statuses.iter().filter(|s| **s == 429).count();
    assert_eq!(admitted + limited, requests, "statuses: {statuses:?}");
    (admitted, limited)
}

fn exactness_config(ledger: std::net::SocketAddr, capacity: u64, cost: u64) -> FileConfig {
    let mut config = test_config(ledger);
    config.plans = Some([("free".to_owned(), plan(capacity, 60))].into());
    config.routes = RoutesFile {
        exempt: None,
        costs: Some([("/greeting".to_owned(), cost)].into()),
        shadow: None,
        refund_server_errors: None,
        concurrency: None,
        concurrency_timeout_seconds: None,
        limits: None,
        cost_header: None,
    };
    config
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_capacity_over_cost_admitted_under_concurrency() {
    let ledger = shared_ledger();
    for (capacity, cost) in [(10, 1), (10, 3), (7, 7)] {
        let app = spawn_app(exactness_config(ledger.address, capacity, cost)).await;
        let key = fresh_key("k_");
        let (admitted, _) = burst(&[&app], &key, "/greeting", 300).await;
        assert_eq!(
            admitted as u64,
            capacity / cost,
            "capacity {capacity} cost {cost}"
        );
        app.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exact_across_two_instances_sharing_one_ledger() {
    let ledger = shared_ledger();
    let a = spawn_app(exactness_config(ledger.address, 25, 2)).await;
    let b = spawn_app(exactness_config(ledger.address, 25, 2)).await;
    let key = fresh_key("k_");
    let (admitted, limited) = burst(&[&a, &b], &key, "/greeting", 400).await;
    assert_eq!(admitted, 12);
    assert_eq!(limited, 388);
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_first_requests_provision_and_credit_exactly_once() {
    let ledger = shared_ledger();
    let a = spawn_app(exactness_config(ledger.address, 1000, 1)).await;
    let b = spawn_app(exactness_config(ledger.address, 1000, 1)).await;
    let key = fresh_key("k_");
    let (admitted, _) = burst(&[&a, &b], &key, "/greeting", 200).await;
    assert_eq!(
        admitted, 200,
        "every first request of a new caller is admitted"
    );

    // Look at the ledger itself: one account, credited once, with 200 units held.
    let client = tb::Client::new(0, ledger.address.to_string()).unwrap();
    let account_id = account_id(&a, &key);
    let accounts = client.lookup_accounts(vec![account_id]).await.unwrap();
    assert_eq!(accounts.len(), 1);
    assert_eq!(accounts[0].credits_posted(), 1000, "credited exactly once");
    assert_eq!(accounts[0].debits_pending(), 200);
    assert_eq!(accounts[0].debits_posted(), 0);
    let grants = client
        .get_account_transfers(Box::new(
            tb::account::Filter::new(account_id, 10).with_flags(tb::account::FilterFlags::CREDITS),
        ))
        .await
        .unwrap();
    assert_eq!(grants.len(), 1);
    assert_eq!(grants[0].id(), model::grant_transfer_id(account_id));
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_callers_capacity_is_all_admitted_while_it_is_being_provisioned() {
    // Requests trickle in while the first ones provision the account: one may find the account
    // created but not yet credited. That must not become a false 429.
    let ledger = shared_ledger();
    let a = spawn_app(exactness_config(ledger.address, 50, 1)).await;
    let b = spawn_app(exactness_config(ledger.address, 50, 1)).await;
    for _ in 0..3 {
        let key = fresh_key("k_");
        let apps = [&a, &b];
        // Staggered by 0.5 ms each, so that later ones arrive mid-provisioning.
        let statuses = join_all((0..50).map(|i| {
            let app = apps[i % 2];
            let key = key.clone();
            async move {
                tokio::time::sleep(Duration::from_micros(500 * i as u64)).await;
                app.get("/greeting", Some(&key)).await.status().as_u16()
            }
        }))
        .await;
        assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    }
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plans_by_prefix_and_costs_by_route() {
    let ledger = shared_ledger();
    let mut config = test_config(ledger.address);
    config.plans = Some(
        [
            ("free".to_owned(), plan(2, 60)),
            ("pro".to_owned(), plan(8, 60)),
        ]
        .into(),
    );
    config.key_prefixes = Some([("pro_".to_owned(), "pro".to_owned())].into());
    config.routes = RoutesFile {
        exempt: Some(vec!["/healthz".into()]),
        costs: Some([("/greeting".to_owned(), 2)].into()),
        shadow: None,
        refund_server_errors: None,
        concurrency: None,
        concurrency_timeout_seconds: None,
        limits: None,
        cost_header: None,
    };
    let app = spawn_app(config).await;
    let free = fresh_key("free_");
    let pro = fresh_key("pro_");

    let (admitted, _) = burst(&[&app], &free, "/greeting", 10).await;
    assert_eq!(admitted, 1, "free: capacity 2, cost 2");
    let (admitted, _) = burst(&[&app], &pro, "/greeting", 10).await;
    assert_eq!(admitted, 4, "pro: capacity 8, cost 2");
    let response = app.get("/greeting", Some(&pro)).await;
    assert_eq!(header(&response, "ratelimit-policy"), "\"pro\";q=8;w=60");
    // Unrouted paths cost the default 1 and are limited too (404 still counts).
    let response = app.get("/nope", Some(&fresh_key("pro_"))).await;
    assert_eq!(response.status(), 404);
    assert_eq!(remaining(&response), 7);
    // Exempt paths need no key.
    assert_eq!(app.get("/healthz", None).await.status(), 200);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_keys_get_problem_responses_before_any_ledger_call() {
    let ledger = shared_ledger();
    let mut config = test_config(ledger.address);
    config.caller = CallerFile {
        unknown_keys: Some("reject".into()),
        ..CallerFile::default()
    };
    config.key_prefixes = Some([("pro_".to_owned(), "pro".to_owned())].into());
    let app = spawn_app(config).await;
    let calls_before = request_calls(app.limiter.ledger());

    let cases: Vec<(Option<Vec<u8>>, u16, &str)> = vec![
        (None, 401, "missing-api-key"),
        (Some(b"".to_vec()), 400, "invalid-api-key"),
        (Some(vec![b'k'; 129]), 400, "invalid-api-key"),
        (Some(b"pro_has space".to_vec()), 400, "invalid-api-key"),
        (Some(b"pro_\ttab".to_vec()), 400, "invalid-api-key"),
        (Some("pro_é".as_bytes().to_vec()), 400, "invalid-api-key"),
        (Some(b"not-a-customer".to_vec()), 401, "unknown-api-key"),
    ];
    for (key, status, problem) in cases {
        let mut request = app.http.get(format!("{}/greeting", app.address));
        if let Some(key) = &key {
            request = request.header(
                "X-Api-Key",
                reqwest::header::HeaderValue::from_bytes(key).unwrap(),
            );
        }
        let response = request.send().await.unwrap();
        assert_eq!(response.status(), status, "key {key:?}");
        assert_eq!(
            header(&response, "content-type"),
            "application/problem+json"
        );
        // Every 401 says how to present a key (RFC 9110 section 11.6.1).
        let challenge = response.headers().get("www-authenticate");
        let challenge = challenge.map(|value| value.to_str().unwrap());
        let expected = (status == 401).then_some("ApiKey header=\"x-api-key\"");
        assert_eq!(challenge, expected, "key {key:?}");
        let body: serde_json::Value = response.json().await.unwrap();
        assert_eq!(
            body["type"],
            format!("urn:ledger-limiter:problem:{problem}")
        );
        assert_eq!(body["status"], status);
        if let Some(key) = &key {
            let shown = body.to_string();
            if key.len() > 3 {
                assert!(!shown.contains(&String::from_utf8_lossy(key).to_string()));
            }
        }
    }
    // The same key twice is ambiguous.
    let response = app
        .http
        .get(format!("{}/greeting", app.address))
        .header("X-Api-Key", "pro_a")
        .header("X-Api-Key", "pro_b")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 400);

    // None of them reached the ledger: not one call was started.
    assert_eq!(request_calls(app.limiter.ledger()), calls_before);
    // The counter does count: a valid key costs a call.
    assert_eq!(app.get("/greeting", Some("pro_valid")).await.status(), 200);
    assert!(request_calls(app.limiter.ledger()) > calls_before);
    app.stop().await;
}

/// The decision deadline of [`down_config`]'s instances.
const DOWN_TIMEOUT: Duration = Duration::from_millis(200);

fn down_config(policy: &str) -> FileConfig {
    let mut config = test_config(dead_address());
    config.ledger = LedgerFile {
        addresses: Some(vec![dead_address().to_string()]),
        timeout_ms: Some(DOWN_TIMEOUT.as_millis() as u64),
        failure_policy: Some(policy.into()),
        ..LedgerFile::default()
    };
    config
}

/// What the machine may add to a decision's deadline before its answer reaches the test's client
/// (two loaded cores, 50 requests at once, a ledger formatting beside them). A request that hung
/// would instead take the client's whole timeout (the ledger client has none of its own).
const ANSWER_SLACK: Duration = Duration::from_secs(3);

/// Sends `requests` requests from new callers at once and checks each is answered `status`
/// within `deadline` (plus [`ANSWER_SLACK`]); returns their content types.
async fn burst_answered(
    app: &TestApp,
    requests: usize,
    status: u16,
    deadline: Duration,
) -> Vec<Option<String>> {
    let futures = (0..requests).map(|_| async {
        let started = Instant::now();
        let response = app.get("/greeting", Some(&fresh_key("k_"))).await;
        let elapsed = started.elapsed();
        assert_eq!(response.status().as_u16(), status);
        assert!(elapsed < deadline + ANSWER_SLACK, "took {elapsed:?}");
        response
            .headers()
            .get("content-type")
            .map(|v| v.to_str().unwrap().to_owned())
    });
    join_all(futures).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ledger_down_fail_closed_answers_503_within_the_deadline() {
    let app = spawn_app_without_ledger(down_config("closed")).await;
    for content_type in burst_answered(&app, 50, 503, DOWN_TIMEOUT).await {
        assert_eq!(content_type.as_deref(), Some("application/problem+json"));
    }
    assert_eq!(app.get("/readyz", None).await.status(), 503);
    assert_eq!(app.get("/healthz", None).await.status(), 200);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ledger_down_fail_open_admits_within_the_deadline() {
    let app = spawn_app_without_ledger(down_config("open")).await;
    burst_answered(&app, 50, 200, DOWN_TIMEOUT).await;
    app.stop().await;
}

/// A route with a concurrency limit decides twice, the rate then the slot, by the request's one
/// deadline: with the ledger down and failing open, its answer comes within one
/// `ledger.timeout_ms` (a deadline per decision made it two; the timeout is longer than
/// [`ANSWER_SLACK`], so two cannot pass for one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ledger_down_a_concurrency_route_answers_within_one_deadline() {
    let timeout = Duration::from_secs(4);
    let mut config = down_config("open");
    config.ledger.timeout_ms = Some(timeout.as_millis() as u64);
    config.routes.concurrency = Some([("/greeting".to_owned(), 2)].into());
    let app = spawn_app_without_ledger(config).await;
    burst_answered(&app, 10, 200, timeout).await;
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ledger_that_dies_mid_flight_never_hangs_a_request() {
    let ledger = TestLedger::start();
    let deadline = Duration::from_millis(300);
    let mut config = test_config(ledger.address);
    config.ledger.timeout_ms = Some(deadline.as_millis() as u64);
    let app = spawn_app(config).await;
    let key = fresh_key("k_");
    assert_eq!(app.get("/greeting", Some(&key)).await.status(), 200);
    // Calls at the ledger when it dies: it is stopped, a burst sent, and killed while those
    // wait (a burst sent after the kill met a ledger already gone).
    ledger.pause(true);
    let before = app.limiter.ledger().batches_sent();
    let burst = burst_answered(&app, 20, 503, deadline);
    let kill = async {
        // Once the burst's holds are at the ledger (a batch sent; the operator-epoch
        // follower's reads are none), however late on a loaded machine: a kill before would
        // test a ledger already gone, not one dying mid-flight.
        let by = Instant::now() + deadline;
        while app.limiter.ledger().batches_sent() == before && Instant::now() < by {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let sent = app.limiter.ledger().batches_sent() - before;
        ledger.kill();
        sent
    };
    let (_, sent) = futures_util::join!(burst, kill);
    assert!(sent > 0, "killed with the burst's holds in flight");
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_placed_after_its_request_was_refused_is_voided() {
    let ledger = TestLedger::start(); // its own: stopped for a while below
    let key = fresh_key("k_");
    // Provision the caller through a normal instance: one hold of 1.
    let warm = spawn_app(exactness_config(ledger.address, 5, 1)).await;
    assert_eq!(warm.get("/greeting", Some(&key)).await.status(), 200);

    // Another instance, the closed policy, and a ledger stopped while its request is decided:
    // the hold is sent in time and answered late, so the request is refused, but the hold still
    // reaches the ledger once it continues. (A deadline of 1 ms once did this on a cold client;
    // a hold is no longer sent once its deadline has passed.)
    let mut config = exactness_config(ledger.address, 5, 1);
    config.ledger.timeout_ms = Some(300);
    config.ledger.failure_policy = Some("closed".into());
    let cold = spawn_app_without_ledger(config).await;
    ledger.pause(true);
    let refused = cold.get("/greeting", Some(&key)).await.status();
    ledger.pause(false);
    assert_eq!(refused, 503);

    // Once the late answer arrives, the hold is voided: only the first one is still pending.
    let client = tb::Client::new(0, ledger.address.to_string()).unwrap();
    let account_id = account_id(&warm, &key);
    let started = Instant::now();
    loop {
        let transfers = client
            .get_account_transfers(Box::new(
                tb::account::Filter::new(account_id, 100)
                    .with_flags(tb::account::FilterFlags::DEBITS),
            ))
            .await
            .unwrap();
        let voids = transfers
            .iter()
            .filter(|t| {
                t.flags()
                    .contains(tb::transfer::Flags::VOID_PENDING_TRANSFER)
            })
            .count();
        if voids == 1 {
            // Read after the void was seen, not before: the ledger is linearizable, so this
            // read includes it (read first, it could miss a void that lands in between).
            let account = client.lookup_accounts(vec![account_id]).await.unwrap()[0];
            assert_eq!(
                account.debits_pending(),
                1,
                "the late hold no longer holds credit"
            );
            assert_eq!(transfers.len(), 3, "first hold, late hold, its void");
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "never voided: {} transfers",
            transfers.len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    warm.stop().await;
    cold.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_in_flight_bound_refuses_at_once_and_holds_nothing() {
    let ledger = shared_ledger();
    let mut config = exactness_config(ledger.address, 1000, 1);
    config.ledger.in_flight_max = Some(1);
    let app = spawn_app(config).await;
    let key = fresh_key("k_");
    // The first request's calls (the account made, then the hold) may meet the operator-epoch
    // follower's read, which waits for the one place once a second (as an operator's action
    // does): refused at once then, it holds nothing, and the next try is admitted.
    let mut first = Vec::new();
    while first.len() < 20 && first.last() != Some(&200) {
        first.push(app.get("/greeting", Some(&key)).await.status().as_u16());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(first.last(), Some(&200), "{first:?}");
    let requests = (0..64).map(|_| async {
        let sent = std::time::Instant::now();
        let response = app.get("/greeting", Some(&key)).await;
        let status = response.status().as_u16();
        let body = response.text().await.unwrap();
        ((status, body), sent.elapsed())
    });
    let (results, took): (Vec<_>, Vec<_>) = join_all(requests).await.into_iter().unzip();
    let admitted = results.iter().filter(|(s, _)| *s == 200).count();
    let overloaded = results
        .iter()
        .filter(|(s, body)| *s == 503 && body.contains("(overloaded)"))
        .count();
    assert!(overloaded > 0, "one call in flight at most: {results:?}");
    // At once: not after waiting for a place until the deadline (5 s here), as a give-back does.
    let slowest = (results.iter().zip(&took))
        .filter(|((status, _), _)| *status == 503)
        .map(|(_, took)| *took)
        .max();
    assert!(slowest < Some(Duration::from_millis(2_500)), "{slowest:?}");
    assert_eq!(admitted + overloaded, results.len(), "{results:?}");
    // Exact: a refused request holds nothing, every admitted one holds one unit.
    let client = tb::Client::new(0, ledger.address.to_string()).unwrap();
    let account = client
        .lookup_accounts(vec![account_id(&app, &key)])
        .await
        .unwrap()[0];
    assert_eq!(account.debits_pending(), 1 + admitted as u128);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fail_open_answer_carries_the_rate_limit_fields() {
    let app = spawn_app_without_ledger(down_config("open")).await;
    let response = app.get("/greeting", Some(&fresh_key("k_"))).await;
    assert_eq!(response.status(), 200);
    assert_eq!(header(&response, "ratelimit-policy"), "\"free\";q=5;w=30");
    // Nothing is known of the caller: its whole quota.
    assert_eq!(header(&response, "ratelimit"), "\"free\";r=5;t=0");
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_by_peer_address_are_limited_on_the_default_plan() {
    let ledger = shared_ledger();
    let mut config = test_config(ledger.address);
    // A plan of this test's own: every test here calls from 127.0.0.1.
    let plan_name = format!("anon{:08x}", rand::random::<u32>());
    config.plans = Some([(plan_name.clone(), plan(3, 30))].into());
    config.default_plan = Some(plan_name.clone());
    config.caller = CallerFile {
        source: Some("peer-ip".into()),
        ..CallerFile::default()
    };
    let app = spawn_app(config).await;
    for expected in [200, 200, 200, 429] {
        // No key at all: the address is the caller.
        let response = app.get("/greeting", None).await;
        assert_eq!(response.status(), expected);
        let policy = format!("\"{plan_name}\";q=3;w=30");
        assert_eq!(header(&response, "ratelimit-policy"), policy);
    }
    app.stop().await;
}

/// A caller holding more than a listing reads: the listing says it is incomplete, and the
/// refusal it makes stands for a second: the ledger's next refusal of that caller is one call
/// (its hold), not a hold and a listing of up to 17 calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listing_of_more_holds_than_it_reads_says_it_is_incomplete_and_stands() {
    use ledger_limiter::ledger::HoldReply;
    use ledger_limiter::ledger::{TRANSFERS_PAGES_MAX, TRANSFERS_PAGE_LIMIT};
    use ledger_limiter::limiter::plan::Plan;
    use std::num::{NonZeroU32, NonZeroU64};

    let readable = TRANSFERS_PAGES_MAX * TRANSFERS_PAGE_LIMIT as usize;
    let holds = readable + 10;
    let capacity = NonZeroU64::new(holds as u64).unwrap();
    let plan = Plan::new("listing", capacity, NonZeroU32::new(60).unwrap()).unwrap();
    let limiter = one_plan_limiter(ledger_client(vec![shared_ledger().address]), plan);
    let ledger = limiter.ledger();
    let key = caller(&fresh_key("listing_"));
    let account = limiter.account_of(&key).expect("the default plan");
    let deadline = || Instant::now() + Duration::from_secs(20);
    let user_account = model::UserAccount {
        id: account,
        capacity,
        window_seconds: NonZeroU32::new(60).unwrap(),
    };
    ledger.provision(&user_account, deadline()).await.unwrap();
    for chunk in (0..holds).collect::<Vec<_>>().chunks(1024) {
        let placed = join_all(
            chunk
                .iter()
                .map(|_| ledger.hold(account, 1, 60, deadline(), false)),
        )
        .await;
        assert!(placed
            .iter()
            .all(|p| matches!(p, Ok(HoldReply::Held { .. }))));
    }
    let view = ledger
        .account_view(account, 60, deadline())
        .await
        .unwrap()
        .expect("the account exists");
    assert!(
        !view.complete,
        "{holds} holds cannot be listed in {readable}"
    );
    assert_eq!(view.holds.len(), readable);
    assert_eq!((view.credit, view.available), (capacity.get(), 0));

    let refused = |decision: &ledger_limiter::limiter::Decision<'_>| {
        matches!(
            decision.outcome,
            Outcome::Limited {
                retry_after_seconds: 1,
                ..
            }
        )
    };
    let first = limiter.check(&key, NonZeroU64::MIN).await.unwrap();
    assert!(refused(&first), "{:?}", first.outcome);
    let calls = request_calls(ledger);
    let again = limiter.check(&key, NonZeroU64::MIN).await.unwrap();
    assert!(refused(&again), "{:?}", again.outcome);
    assert_eq!(request_calls(ledger) - calls, 1, "the hold alone");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_follows_its_ledger_to_a_new_address_without_a_restart() {
    use ledger_limiter::ledger::addresses::follow_addresses;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};

    let old = shared_ledger();
    let new = TestLedger::start();
    let app = spawn_app(test_config(old.address)).await;
    // What the ledger's host name resolves to: the old address, then the new one (as when a
    // container comes back with another IP).
    let resolved = Arc::new(Mutex::new(vec![old.address]));
    let answer = resolved.clone();
    // Set: the next look never answers (a resolver retrying dead name servers). The follower
    // gives up on it after its interval and looks again.
    let hang_once = Arc::new(AtomicBool::new(false));
    let hang = hang_once.clone();
    let resolve = move || {
        let addresses = answer.lock().unwrap().clone();
        let hangs = hang.swap(false, Ordering::SeqCst);
        async move {
            if hangs {
                std::future::pending::<()>().await;
            }
            Ok::<_, String>(addresses)
        }
    };
    let ledger = app.limiter.ledger().clone();
    let follower = tokio::spawn(follow_addresses(
        ledger.clone(),
        Duration::from_millis(100),
        resolve,
    ));
    let before = fresh_key("k_");
    assert_eq!(app.get("/greeting", Some(&before)).await.status(), 200);

    hang_once.store(true, Ordering::SeqCst);
    *resolved.lock().unwrap() = vec![new.address];
    let started = Instant::now();
    while ledger.addresses() != [new.address] {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "never followed (held up by a resolver that did not answer?)"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!hang_once.load(Ordering::SeqCst), "a look did not answer");
    let after = fresh_key("k_");
    let deadline = Instant::now() + Duration::from_secs(20);
    // The new client's first request takes a while; the policy answers meanwhile.
    while app.get("/greeting", Some(&after)).await.status() != 200 {
        assert!(Instant::now() < deadline, "the new ledger never answered");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let on = |address: std::net::SocketAddr, key: &str| {
        let id = account_id(&app, key);
        async move {
            let client = tb::Client::new(0, address.to_string()).unwrap();
            !client.lookup_accounts(vec![id]).await.unwrap().is_empty()
        }
    };
    assert!(
        on(new.address, &after).await,
        "the new caller is on the new ledger"
    );
    assert!(!on(old.address, &after).await, "and not on the old one");
    assert!(on(old.address, &before).await);
    follower.abort();
    app.stop().await;
}

/// Holds sent from one thread at once share a batch (`ledger/batch.rs`); each still times out at
/// its own deadline, not at the batch's earliest.
#[tokio::test]
async fn holds_in_one_batch_each_time_out_at_their_own_deadline() {
    let ledger = ledger_client_bounded(vec![dead_address()], 8);
    let started = Instant::now();
    let hold = |deadline_ms: u64| {
        let ledger = ledger.clone();
        async move {
            let deadline = started + Duration::from_millis(deadline_ms);
            let result = ledger.hold(fresh_id(), 1, 30, deadline, true).await;
            (result, started.elapsed())
        }
    };
    let ((early, early_at), (late, late_at)) = tokio::join!(hold(100), hold(3_000));
    let timeout = ledger::LedgerError::Timeout {
        operation: ledger::metrics::Operation::CreateTransfers,
    };
    assert_eq!(early.unwrap_err(), timeout);
    assert_eq!(late.unwrap_err(), timeout);
    // The premise: in separate batches each would time out at its own deadline trivially.
    assert_eq!(ledger.batches_sent(), 1, "the two holds shared a batch");
    assert!(
        early_at >= Duration::from_millis(100) && early_at < Duration::from_secs(2),
        "the early hold at {early_at:?}"
    );
    assert!(
        late_at >= Duration::from_secs(3),
        "the late hold at {late_at:?}"
    );
    // Their callers left, but the ledger has not answered: the batch still holds their places.
    assert_eq!(ledger.calls_in_flight(), 2);
}

/// A batch holds one in-flight place per transfer until the ledger answers, then gives them all
/// back: the bound refuses a call beyond it at once, and frees up after the answer.
#[tokio::test]
async fn a_batch_takes_a_place_per_transfer_and_gives_them_back_when_answered() {
    let ledger = ledger_client_bounded(vec![shared_ledger().address], 3);
    let deadline = Instant::now() + Duration::from_secs(10);
    let round = || join_all((0..4).map(|_| ledger.hold(fresh_id(), 1, 30, deadline, true)));
    for _ in 0..2 {
        let results = round().await;
        // Accounts nobody created: the ledger answers each transfer, and refuses none for credit.
        let answered = results
            .iter()
            .filter(|r| matches!(r, Ok(ledger::HoldReply::AccountNotFound)))
            .count();
        let overloaded = results
            .iter()
            .filter(|r| matches!(r, Err(ledger::LedgerError::Overloaded { in_flight_max: 3 })))
            .count();
        assert_eq!((answered, overloaded), (3, 1), "{results:?}");
        assert_eq!(ledger.calls_in_flight(), 0, "every place given back");
    }
}

/// Two holds a millisecond apart on one thread: without a linger each goes in a call of its own
/// (the first batch went before the second hold came); with one, the second joins the first's
/// batch, and both get their own answers.
///
/// Up to three tries each: the millisecond apart is a timer's, and a thread descheduled for a
/// few milliseconds (a loaded machine) moves the second hold across the first batch's send.
#[tokio::test]
async fn a_linger_lets_transfers_that_come_apart_share_one_call() {
    for (linger, calls_expected) in [(Duration::ZERO, 2), (ledger::BATCH_LINGER_MAX, 1)] {
        let mut calls = Vec::new();
        while calls.len() < 3 && !calls.contains(&calls_expected) {
            calls.push(two_holds_apart(linger).await);
        }
        assert_eq!(
            calls.last(),
            Some(&calls_expected),
            "linger {linger:?}: {calls:?}"
        );
    }
}

/// Two holds 1 ms apart on this thread, through a new client with `linger`: the calls it made.
async fn two_holds_apart(linger: Duration) -> u64 {
    let ledger = ledger_client_with(vec![shared_ledger().address], 8, linger);
    let deadline = Instant::now() + Duration::from_secs(10);
    let first = ledger.hold(fresh_id(), 1, 30, deadline, true);
    let second = async {
        // Well inside the linger: the timer wheel's 1 ms granularity leaves 3 ms of slack.
        tokio::time::sleep(Duration::from_millis(1)).await;
        ledger.hold(fresh_id(), 1, 30, deadline, true).await
    };
    let (first, second) = tokio::join!(first, second);
    for result in [first, second] {
        assert!(
            matches!(result, Ok(ledger::HoldReply::AccountNotFound)),
            "{result:?}"
        );
    }
    assert_eq!(ledger.calls_in_flight(), 0, "every place given back");
    ledger.batches_sent()
}

/// A transfer due before a lingering batch goes does not join it (it would be answered late, and
/// sent for nothing): it goes in a batch of its own, which lingers at most half its time left.
///
/// Up to three tries, as [`a_linger_lets_transfers_that_come_apart_share_one_call`]: a thread
/// descheduled for 2 ms spends the second hold's deadline before it opens a batch.
#[tokio::test]
async fn a_transfer_due_before_a_lingering_batch_goes_opens_its_own() {
    let mut calls = Vec::new();
    while calls.len() < 3 && !calls.contains(&2) {
        calls.push(a_lingering_batch_and_one_due_before_it().await);
    }
    assert_eq!(calls.last(), Some(&2), "a batch each: {calls:?}");
}

/// A hold in a lingering batch, then one due 2 ms later on the same thread: the calls made.
async fn a_lingering_batch_and_one_due_before_it() -> u64 {
    let ledger = ledger_client_with(vec![shared_ledger().address], 8, ledger::BATCH_LINGER_MAX);
    let first = ledger.hold(
        fresh_id(),
        1,
        30,
        Instant::now() + Duration::from_secs(10),
        true,
    );
    // Polled right after the first opened its batch (one task, in order), and due 2 ms from
    // then: it would go on its own within 1 ms, before that batch goes (5 ms), unless this
    // thread stalls 4 ms between the two polls.
    let second = async {
        let deadline = Instant::now() + Duration::from_millis(2);
        ledger.hold(fresh_id(), 1, 30, deadline, true).await
    };
    let (first, second) = tokio::join!(first, second);
    assert!(
        matches!(first, Ok(ledger::HoldReply::AccountNotFound)),
        "{first:?}"
    );
    assert!(
        matches!(
            second,
            Ok(ledger::HoldReply::AccountNotFound) | Err(ledger::LedgerError::Timeout { .. })
        ),
        "{second:?}"
    );
    ledger.batches_sent()
}

/// A linger past the most is refused when the ledger handle is made, not when a batch waits.
#[test]
fn a_linger_past_the_most_is_refused_at_connect() {
    let too_long = ledger::BATCH_LINGER_MAX + Duration::from_millis(1);
    let settings = ledger_settings(vec![dead_address()], 8, too_long);
    let refused = ledger::Ledger::connect(&settings).map(|_| ()).unwrap_err();
    assert!(
        matches!(refused, ledger::ConnectError::BatchLinger { .. }),
        "{refused}"
    );
}

/// A client of the shared ledger, and a new account on it of 5 units per 60 s.
async fn provisioned_account() -> (ledger::Ledger, model::UserAccount) {
    use std::num::{NonZeroU32, NonZeroU64};
    let ledger = ledger_client(vec![shared_ledger().address]);
    let account = model::UserAccount {
        id: fresh_id(),
        capacity: NonZeroU64::new(5).unwrap(),
        window_seconds: NonZeroU32::new(60).unwrap(),
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    ledger.provision(&account, deadline).await.unwrap();
    (ledger, account)
}

/// A hold answered just as its request went away (the answer sent, never read) is voided: the
/// batch saw it delivered and voided nothing, so the receiving end's drop does. Before, it stayed
/// held for its whole timeout (a concurrency slot for a minute, a lease for window + L).
///
/// On one thread: the batch's task and the chain's call then run only once this test awaits.
/// With worker threads they could send, and the ledger answer, while this thread was descheduled
/// between its two first polls (a CI run saw it): the hold was then read, not left unread.
#[tokio::test]
async fn a_hold_answered_as_its_request_went_away_is_voided() {
    use ledger_limiter::ledger::ChainLink;

    let (ledger, account) = provisioned_account().await;
    let far = || Instant::now() + Duration::from_secs(20);
    let link = ChainLink {
        account_id: account.id,
        amount: 1,
        timeout_seconds: 60,
    };
    // Both ways a hold goes: in a batch, and as a call of its own (a chain).
    let mut hold = Box::pin(ledger.hold(account.id, 1, 60, far(), true));
    let mut chain = Box::pin(ledger.hold_chain(vec![link], far(), true));
    assert!(futures_util::poll!(hold.as_mut()).is_pending(), "sent");
    assert!(futures_util::poll!(chain.as_mut()).is_pending(), "sent");
    // Within 5 s, the account has `available` free, or the test fails saying `otherwise`.
    let becomes = |available: u64, otherwise: &'static str| {
        let ledger = &ledger;
        async move {
            let by = Instant::now() + Duration::from_secs(5);
            loop {
                let view = ledger.account_view(account.id, 60, far()).await.unwrap();
                if view.unwrap().available == available {
                    return;
                }
                assert!(Instant::now() < by, "{otherwise}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    // Not polled again while the ledger answers: the answers wait, unread.
    becomes(3, "both holds landed").await;
    drop((hold, chain));
    becomes(5, "a hold nobody read stayed held").await;
}

/// A transfer whose deadline has passed is not sent: its caller has given up on it, and a void
/// that landed then would give back credit that the caller's view still counts as held.
#[tokio::test]
async fn a_transfer_past_its_deadline_is_not_sent() {
    use ledger_limiter::ledger::HoldReply;

    let (ledger, account) = provisioned_account().await;
    let far = || Instant::now() + Duration::from_secs(20);
    let hold = match ledger.hold(account.id, 1, 60, far(), true).await.unwrap() {
        HoldReply::Held { transfer_id, .. } => transfer_id,
        other => panic!("not held: {other:?}"),
    };
    let gone = Instant::now() - Duration::from_millis(1);
    assert!(
        matches!(
            ledger.void(hold, gone).await,
            Err(ledger::LedgerError::Timeout { .. })
        ),
        "a void with no time left"
    );
    assert!(
        ledger.hold(account.id, 1, 60, gone, true).await.is_err(),
        "a hold with no time left"
    );
    // One client answers in order: had either been sent, this void would see it.
    let view = ledger.account_view(account.id, 60, far()).await.unwrap();
    assert_eq!(view.unwrap().available, 4, "only the first hold landed");
    assert!(
        ledger.void(hold, far()).await.unwrap(),
        "the hold was still pending"
    );
}

/// The cluster evicts a client's session when it needs the room (it keeps 64) or no longer
/// serves its release. The evicted client then takes calls and never answers them: every call
/// waited out its deadline and kept its in-flight place for good, until the instance refused
/// everything as overloaded. The instance now makes a new client, and the stranded calls give
/// their places back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evicted_client_is_replaced_and_its_stranded_calls_give_their_places_back() {
    use ledger_limiter::ledger::HoldReply;

    let private = TestLedger::start(); // its sessions are this test's alone
    let ledger = ledger_client(vec![private.address]);
    let within = |ms| Instant::now() + Duration::from_millis(ms);
    let answered = |reply: &Result<HoldReply, ledger::LedgerError>| {
        matches!(reply, Ok(HoldReply::AccountNotFound))
    };
    assert!(answered(
        &ledger.hold(fresh_id(), 1, 30, within(10_000), true).await
    ));
    // 64 clients register after ours, four at a time, each closing its connection after (a
    // server takes few connections at once, and a session outlives its connection): the
    // cluster evicts the oldest session, ours.
    let register = || async {
        let other = tb::Client::new(0, private.address.to_string()).unwrap();
        other.lookup_accounts(vec![1]).await.unwrap();
        tokio::task::spawn_blocking(move || drop(other))
            .await
            .unwrap();
    };
    for _ in 0..64 / 4 {
        join_all((0..4).map(|_| register())).await;
    }
    // Our next call learns of the eviction; soon a new client answers.
    let replaced_by = within(30_000);
    let mut unanswered = 0;
    while !answered(&ledger.hold(fresh_id(), 1, 30, within(1_000), true).await) {
        unanswered += 1;
        assert!(
            Instant::now() < replaced_by,
            "the evicted client was never replaced"
        );
    }
    // Else our session was not evicted, and nothing here was tested.
    assert!(
        unanswered > 0,
        "the first call after 64 registrations was answered"
    );
    places_given_back(
        &ledger,
        "calls stranded on the evicted client kept their places",
    )
    .await;
}

/// Waits until `ledger`'s calls stranded on a retired client are given up (their grace, and
/// some slack), failing with `why` if they are not.
async fn places_given_back(ledger: &ledger::Ledger, why: &str) {
    let given_up_by = Instant::now() + ledger::RETIRED_CALLS_GRACE + Duration::from_secs(5);
    while ledger.calls_in_flight() > 0 {
        assert!(Instant::now() < given_up_by, "{why}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// An id no account has.
fn fresh_id() -> u128 {
    rand::random()
}

/// A replaced client whose replicas never answer gives its calls' places back
/// (`ledger/connection.rs`). Before, each call in flight on it kept its place under the in-flight
/// bound for good: a few reconnects with calls in flight left an instance refusing everything as
/// overloaded, and kept every old client (its I/O thread) alive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_stranded_on_a_replaced_client_give_their_places_back() {
    use ledger_limiter::ledger::ChainLink;

    let ledger = ledger_client_bounded(vec![dead_address()], 4);
    let soon = Instant::now() + Duration::from_millis(300);
    let link = || ChainLink {
        account_id: fresh_id(),
        amount: 1,
        timeout_seconds: 30,
    };
    // Both ways a call goes: single holds share a batch, a chain is a call of its own.
    let holds = join_all((0..2).map(|_| ledger.hold(fresh_id(), 1, 30, soon, true)));
    let chains = join_all((0..2).map(|_| ledger.hold_chain(vec![link(), link()], soon, true)));
    let (holds, chains) = tokio::join!(holds, chains);
    assert!(holds.iter().all(|r| r.is_err()), "{holds:?}");
    assert!(chains.iter().all(|r| r.is_err()), "{chains:?}");
    assert_eq!(
        ledger.calls_in_flight(),
        4,
        "every place held for the dead address"
    );

    let live = shared_ledger().address;
    assert!(ledger.reconnect(&[live]).unwrap());
    assert_eq!(ledger.close_replaced_clients(), 1, "still in use");
    let far = || Instant::now() + Duration::from_secs(5);
    let refused = ledger.hold(fresh_id(), 1, 30, far(), true).await;
    assert!(
        matches!(refused, Err(ledger::LedgerError::Overloaded { .. })),
        "within the grace the old calls keep their places: {refused:?}"
    );

    places_given_back(&ledger, "the stranded calls kept their places").await;
    let answered = ledger.hold(fresh_id(), 1, 30, far(), true).await;
    assert!(
        matches!(answered, Ok(ledger::HoldReply::AccountNotFound)),
        "the new client answers: {answered:?}"
    );
    // The next look at the addresses closes the old client.
    assert!(!ledger.reconnect(&[live]).unwrap(), "the same addresses");
    let closed_by = Instant::now() + Duration::from_secs(5);
    while ledger.close_replaced_clients() > 0 {
        assert!(
            Instant::now() < closed_by,
            "the replaced client was never closed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A plan whose window reaches before 1970 (a lifetime quota, `u32::MAX` seconds): its account is
/// read like any other (the listing's lower bound used to be a time before the epoch, which the
/// client's filter panics on).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_account_under_a_window_of_decades_is_read() {
    use ledger_limiter::limiter::plan::Plan;
    use std::num::{NonZeroU32, NonZeroU64};
    let ledger = ledger_client(vec![shared_ledger().address]);
    let lifetime = Plan::new("lifetime", NonZeroU64::MIN, NonZeroU32::MAX).unwrap();
    let limiter = one_plan_limiter(ledger, lifetime);
    let key = caller(&fresh_key("k_"));
    let admitted = limiter
        .check(&key, std::num::NonZeroU64::MIN)
        .await
        .unwrap();
    assert_eq!(admitted.outcome, ledger_limiter::limiter::Outcome::Admitted);
    let deadline = Instant::now() + Duration::from_secs(10);
    let account = limiter.account_of(&key).unwrap();
    let view = limiter
        .ledger()
        .account_view(account, u32::MAX, deadline)
        .await;
    let view = view.unwrap().expect("the account exists");
    assert_eq!((view.credit, view.available, view.holds.len()), (1, 0, 1));
}

/// A give-back (a void: a concurrency slot whose request is done, a refund) waits for a place
/// under the in-flight bound, until its deadline. Refused at once while a burst, or a stalled
/// ledger, held every place, it was lost: its units stayed held for the rest of their timeout
/// (a concurrency slot for a minute, the caller refused "too many in flight" with none).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_void_waits_for_a_place_under_a_full_in_flight_bound() {
    let process = TestLedger::start(); // its own: stopped for a while below
    let full = common::full_bound(&process).await;
    let deadline = Instant::now() + Duration::from_secs(5);
    // Polled first: the void asks for its place before the ledger resumes, so it waited.
    let (void, ()) = tokio::join!(
        full.ledger.void(full.transfer_id, deadline),
        common::resume_after(&process, Duration::from_millis(300)),
    );
    assert!(matches!(
        full.other.await.unwrap(),
        Ok(ledger::HoldReply::Held { .. })
    ));
    assert_eq!(void, Ok(true), "given back once a place was free");
}

/// A give-back that cannot land now (the in-flight bound full past its deadline, a ledger slow
/// or failing over) is sent again until it lands: a concurrency slot given back once and lost
/// kept its caller refused until the slot's timeout, with nothing in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_give_back_is_sent_again_until_it_lands() {
    use ledger_limiter::limiter::plan::Plan;
    use ledger_limiter::limiter::HoldReceipt;
    use std::num::{NonZeroU32, NonZeroU64};
    let process = TestLedger::start(); // its own: stopped for a while below
    let full = common::full_bound(&process).await;
    let plan = Plan::new(
        "slots",
        NonZeroU64::new(5).unwrap(),
        NonZeroU32::new(60).unwrap(),
    );
    let mut settings = library_settings();
    settings.ledger_timeout = Duration::from_millis(200);
    let limiter = ledger_limiter::limiter::Limiter::new(
        (*full.ledger).clone(),
        std::sync::Arc::new(
            ledger_limiter::limiter::plan::PlanBook::new(
                vec![plan.unwrap()],
                "slots",
                [],
                [],
                ledger_limiter::limiter::plan::UnknownKeys::DefaultPlan,
            )
            .unwrap(),
        ),
        settings,
    );
    let hold = HoldReceipt {
        transfer_id: full.transfer_id,
        amount: 1,
        expires_at: Instant::now() + Duration::from_secs(55),
    };
    // The first tries (200 ms each, then 200 and 400 ms apart) find no place: the ledger resumes
    // after a second, and a later try lands.
    tokio::join!(
        limiter.release_until_expired(full.account.id, hold),
        common::resume_after(&process, Duration::from_secs(1)),
    );
    assert!(matches!(
        full.other.await.unwrap(),
        Ok(ledger::HoldReply::Held { .. })
    ));
    let deadline = Instant::now() + Duration::from_secs(10);
    let audit = full.ledger.audit(full.account.id, deadline).await;
    let audit = audit.unwrap().unwrap();
    assert_eq!(audit.voids, 1, "given back, late: {audit:?}");
}

/// The same for a release by amount (Envoy's negative hits: a concurrency slot given back).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_waits_for_a_place_under_a_full_in_flight_bound() {
    let process = TestLedger::start(); // its own: stopped for a while below
    let full = common::full_bound(&process).await;
    let deadline = Instant::now() + Duration::from_secs(5);
    let (release, ()) = tokio::join!(
        full.ledger.release_units(full.account.id, 1, 60, deadline),
        common::resume_after(&process, Duration::from_millis(300)),
    );
    assert!(matches!(
        full.other.await.unwrap(),
        Ok(ledger::HoldReply::Held { .. })
    ));
    let released = release.expect("given back once a place was free");
    assert_eq!(released.units, 1);
}

/// A recharge (a cost known after the response) waits for a place too: refused at once, one
/// that gives back kept the estimate held, and one that charges more left the request held for
/// less than it cost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recharge_waits_for_a_place_under_a_full_in_flight_bound() {
    use ledger_limiter::ledger::settle::{Recharge, Recharged};
    let process = TestLedger::start(); // its own: stopped for a while below
    let full = common::full_bound(&process).await;
    let recharge = Recharge {
        pending_id: full.transfer_id,
        account_id: full.account.id,
        amount: 3,
        timeout_seconds: 50,
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    let recharges = [recharge];
    let (recharged, ()) = tokio::join!(
        full.ledger.recharge(&recharges, deadline),
        common::resume_after(&process, Duration::from_millis(300)),
    );
    assert!(matches!(
        full.other.await.unwrap(),
        Ok(ledger::HoldReply::Held { .. })
    ));
    assert!(matches!(recharged, Ok(Recharged::Done(_))), "{recharged:?}");
}

/// A caller whose credit an operator reduced to 0 is spent, not new: its refusal read a credit
/// of 0 as a grant that had not landed, and provisioned it again (its accounts, its grant, a
/// second hold and listing) at its first request after each operator action.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_reduced_to_nothing_is_refused_not_provisioned_again() {
    use ledger::metrics::Operation;
    use ledger_limiter::limiter::plan::Plan;
    let ledger = ledger_client(vec![shared_ledger().address]);
    let plan = Plan::new(
        "free",
        std::num::NonZeroU64::new(5).unwrap(),
        std::num::NonZeroU32::new(60).unwrap(),
    );
    let limiter = common::one_plan_limiter(ledger, plan.unwrap());
    let key = fresh_key("k_");
    let id = limiter.account_of(&caller(&key)).unwrap();
    let account = model::UserAccount {
        id,
        capacity: std::num::NonZeroU64::new(5).unwrap(),
        window_seconds: std::num::NonZeroU32::new(60).unwrap(),
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    let ledger = limiter.ledger();
    ledger.provision(&account, deadline).await.unwrap();
    let actor = model::Actor::from_reason(1, "test").unwrap();
    ledger
        .reduce_credit(id, 5, (actor, None), deadline)
        .await
        .unwrap();
    let accounts = ledger.calls_started_of(Operation::CreateAccounts);
    let decision = limiter
        .check(&caller(&key), std::num::NonZeroU64::MIN)
        .await
        .unwrap();
    assert!(
        matches!(decision.outcome, Outcome::Limited { .. }),
        "{:?}",
        decision.outcome
    );
    let provisioned = ledger.calls_started_of(Operation::CreateAccounts) - accounts;
    assert_eq!(provisioned, 0, "not provisioned again");
}

/// Builds an app on the shared ledger (readiness waited for) with a task of the test's tied to
/// it, and runs it: its port, its stop handle (as the binary's signals stop it), and the run.
async fn app_watching(
    config: FileConfig,
    task: tokio::task::JoinHandle<()>,
) -> (
    u16,
    ledger_limiter::startup::StopHandle,
    tokio::task::JoinHandle<std::io::Result<()>>,
) {
    use ledger_limiter::startup::{Application, Exporters};
    let settings = ledger_limiter::config::Settings::with_overrides(config).unwrap();
    let mut application = Application::build(settings, Exporters::default())
        .await
        .expect("application builds");
    assert!(application.wait_for_ledger(Duration::from_secs(20)).await);
    application.watch_task("test companion", task);
    let (port, handle) = (application.port(), application.stop_handle());
    (port, handle, tokio::spawn(application.run_until_stopped()))
}

/// A companion that ends before the stop (here a task tied to the service as its admin API,
/// metrics server, Envoy front end and followers are) stops it: not ready at once, no more
/// connections after the drain delay, and the run ends with an error that names it. Before,
/// the service served on without it, looking alive, until its stop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_companion_that_ends_stops_the_service_saying_which() {
    let mut config = test_config(shared_ledger().address);
    config.drain_delay_seconds = Some(1);
    let (fail, failed) = tokio::sync::oneshot::channel::<()>();
    let companion = tokio::spawn(async move {
        let _ = failed.await;
        panic!("lost its way");
    });
    let (port, _, running) = app_watching(config, companion).await;
    let client = reqwest::Client::new();
    let readyz = format!("http://127.0.0.1:{port}/readyz");
    assert_eq!(client.get(&readyz).send().await.unwrap().status(), 200);
    fail.send(()).unwrap();
    let not_ready = Instant::now() + Duration::from_secs(5);
    loop {
        let answer = client
            .get(&readyz)
            .send()
            .await
            .expect("served during the delay");
        if answer.status() == 503 {
            assert!(answer.text().await.unwrap().contains("stopping"));
            break;
        }
        assert!(
            Instant::now() < not_ready,
            "still ready 5 s after the companion ended"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let ran = tokio::time::timeout(Duration::from_secs(30), running)
        .await
        .expect("the service stopped")
        .expect("the run did not panic");
    let error = ran
        .expect_err("a companion's end is the run's error")
        .to_string();
    assert!(error.contains("test companion"), "{error}");
    assert!(error.contains("it panicked: lost its way"), "{error}");
    assert!(client.get(&readyz).send().await.is_err(), "still serving");
}

/// A tied task that ends during a stop (here in its drain delay, as a task of the embedder's
/// that ends on the same signal would) is no failure: the run ends well, after one drain delay.
/// Before, it was taken for a companion's failure: a second stop, and an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_companion_that_ends_during_the_stop_is_no_failure() {
    let mut config = test_config(shared_ledger().address);
    config.drain_delay_seconds = Some(1);
    let (end, ended) = tokio::sync::oneshot::channel::<()>();
    let companion = tokio::spawn(async move {
        let _ = ended.await;
    });
    let (port, stop, running) = app_watching(config, companion).await;
    let readyz = format!("http://127.0.0.1:{port}/readyz");
    assert_eq!(reqwest::get(&readyz).await.unwrap().status(), 200);
    let stopping = tokio::spawn(async move { stop.stop().await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(reqwest::get(&readyz).await.unwrap().status(), 503);
    end.send(()).unwrap();
    let ran = tokio::time::timeout(Duration::from_secs(30), running)
        .await
        .expect("the service stopped")
        .expect("the run did not panic");
    ran.expect("the run ended well");
    stopping.await.unwrap();
}

/// A hold voided on another instance (a refund there; a late hold's void or a concurrency
/// slot's give-back do the same) frees credit that this instance's listing still counts as
/// held. The listing refuses from memory for `LISTING_TRUSTED_FOR` (5 s) at most: then one
/// request lists the account again, finds room, and the ledger admits it. Before, this instance refused the
/// caller from memory until the voided hold's end (a minute here; a window, an hour on an
/// hourly plan).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_voided_on_another_instance_frees_its_credit_within_seconds() {
    use ledger_limiter::limiter::plan::Plan;
    use ledger_limiter::limiter::DecisionSource;
    use std::num::{NonZeroU32, NonZeroU64};
    let plan = Plan::new(
        "free",
        NonZeroU64::new(2).unwrap(),
        NonZeroU32::new(60).unwrap(),
    );
    let plan = plan.unwrap();
    let a = one_plan_limiter(ledger_client(vec![shared_ledger().address]), plan.clone());
    let b = one_plan_limiter(ledger_client(vec![shared_ledger().address]), plan);
    let key = caller(&fresh_key("k_"));
    let one = NonZeroU64::new(1).unwrap();
    let mut first = a.check(&key, one).await.unwrap();
    let second = a.check(&key, one).await.unwrap();
    assert_eq!(
        (first.outcome.clone(), second.outcome),
        (Outcome::Admitted, Outcome::Admitted)
    );
    let source = |outcome: &Outcome| match outcome {
        Outcome::Limited { source, .. } => Some(*source),
        _ => None,
    };
    // B: the ledger refuses, and B lists the account (both holds); then B refuses from memory.
    let refused = b.check(&key, one).await.unwrap().outcome;
    let listed_at = Instant::now(); // after the listing was stored: its word is younger
    assert_eq!(
        source(&refused),
        Some(DecisionSource::Ledger),
        "{refused:?}"
    );
    let refused = b.check(&key, one).await.unwrap().outcome;
    assert_eq!(
        source(&refused),
        Some(DecisionSource::LocalView),
        "{refused:?}"
    );
    // A gives one back: the ledger has room for one request, which B's listing counts as held.
    assert!(a.refund(&mut first).await.unwrap(), "given back");
    let trusted = ledger_limiter::limiter::local_view::LISTING_TRUSTED_FOR;
    let lapsed = listed_at + trusted + Duration::from_millis(100);
    tokio::time::sleep_until(lapsed.into()).await;
    // One request lists the account again, finds room, and the ledger admits it.
    let admitted = b.check(&key, one).await.unwrap().outcome;
    assert_eq!(admitted, Outcome::Admitted, "once B's listing is 5 s old");
    // And the credit is spent again: refused.
    let refused = b.check(&key, one).await.unwrap().outcome;
    assert!(source(&refused).is_some(), "{refused:?}");
}
