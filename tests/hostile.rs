//! Hostile traffic over real sockets: slow clients, oversized and repeated headers, floods of idle
//! connections and of new callers. Each is answered or cut off within a bound, and the service
//! goes on serving everyone else.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::*;
use futures_util::future::join_all;
use ledger_limiter::limiter::caller::CallerKey;
use ledger_limiter::startup::CLIENT_REQUEST_TIMEOUT;

async fn app() -> TestApp {
    spawn_app(test_config(shared_ledger().address)).await
}

fn connect(app: &TestApp) -> TcpStream {
    let stream = TcpStream::connect(("127.0.0.1", app.port)).unwrap();
    stream
        .set_read_timeout(Some(CLIENT_REQUEST_TIMEOUT + Duration::from_secs(5)))
        .unwrap();
    stream
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_trickling_its_headers_is_cut_off_and_others_are_served() {
    let app = app().await;
    let started = Instant::now();
    let slow = tokio::task::spawn_blocking({
        let mut stream = connect(&app);
        move || {
            stream
                .write_all(b"GET /greeting HTTP/1.1\r\nHost: x\r\n")
                .unwrap();
            // ... and never the rest. The server answers 408 or closes: either way, not forever.
            let mut buffer = Vec::new();
            let ended = stream.read_to_end(&mut buffer).map_err(|e| e.kind());
            (ended, String::from_utf8_lossy(&buffer).into_owned())
        }
    });
    // Meanwhile everyone else is served.
    for _ in 0..5 {
        let status = app.get("/greeting", Some(&fresh_key("k_"))).await.status();
        assert_eq!(status, 200);
    }
    let (ended, answer) = slow.await.unwrap();
    let took = started.elapsed();
    // Closed by the server (a reset if it closed with the request unread), not the client's
    // own read timeout.
    assert!(
        matches!(ended, Ok(_) | Err(std::io::ErrorKind::ConnectionReset)),
        "{ended:?}"
    );
    assert!(
        took < CLIENT_REQUEST_TIMEOUT + Duration::from_secs(3),
        "held for {took:?}"
    );
    assert!(
        answer.is_empty() || answer.starts_with("HTTP/1.1 408"),
        "{answer}"
    );
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_headers_are_refused_before_the_limiter() {
    let app = app().await;
    let calls = request_calls(app.limiter.ledger());
    // A head past actix's limit (128 KiB) beside a valid key, and a request with thousands of
    // headers: each would be admitted (200) if it reached the limiter. Refused by the server
    // with 431 (or 400), or the connection is reset before the answer can be read; either way
    // not by the limiter (whose refusals are problem+json).
    let refused = |answer: &Result<(u16, String), reqwest::Error>| match answer {
        Ok((status, content_type)) => {
            [400, 431].contains(status) && !content_type.contains("problem+json")
        }
        Err(error) => error.is_request(),
    };
    let answer = |response: reqwest::Response| {
        let content_type = response.headers().get("content-type");
        let content_type = content_type.map(|v| v.to_str().unwrap_or("").to_owned());
        (response.status().as_u16(), content_type.unwrap_or_default())
    };
    // The refused requests go on a client of their own: the server closes their connections,
    // and the shared client could take one from its pool for the next request before it sees
    // the close (one CI run failed so, `IncompleteMessage`).
    let hostile = reqwest::Client::new();
    let filler = "f".repeat(160 * 1024);
    let status = hostile
        .get(format!("{}/greeting", app.address))
        .header("X-Api-Key", fresh_key("k_"))
        .header("x-filler", &filler)
        .send()
        .await
        .map(answer);
    assert!(refused(&status), "{status:?}");
    let mut request = hostile.get(format!("{}/greeting", app.address));
    for i in 0..2000 {
        request = request.header(format!("x-filler-{i}"), "1");
    }
    let status = request
        .header("X-Api-Key", fresh_key("k_"))
        .send()
        .await
        .map(answer);
    assert!(refused(&status), "{status:?}");
    assert_eq!(request_calls(app.limiter.ledger()), calls, "no ledger call");
    assert_eq!(
        app.get("/greeting", Some(&fresh_key("k_"))).await.status(),
        200
    );
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_idle_connections_does_not_stop_service() {
    let app = app().await;
    let idle: Vec<TcpStream> = (0..1000).map(|_| connect(&app)).collect();
    let statuses = join_all((0..50).map(|_| async {
        app.get("/greeting", Some(&fresh_key("k_")))
            .await
            .status()
            .as_u16()
    }))
    .await;
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    drop(idle);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_far_beyond_the_in_flight_bound_is_answered_in_time() {
    let ledger = shared_ledger();
    let mut config = test_config(ledger.address);
    config.ledger.in_flight_max = Some(4);
    // Long enough for a new caller's three calls on a loaded machine, short beside what a queue
    // for places would take (it would admit all 500).
    config.ledger.timeout_ms = Some(1_000);
    let app = spawn_app(config).await;
    let started = Instant::now();
    let answers = join_all((0..500).map(|_| async {
        let sent = Instant::now();
        let response = app.get("/greeting", Some(&fresh_key("k_"))).await;
        let status = response.status().as_u16();
        (status, response.text().await.unwrap(), sent.elapsed())
    }))
    .await;
    for (status, body, took) in &answers {
        // Admitted, or refused at once for want of a place (not queued for one: a queue would
        // answer each past the deadline, as a 503 of the timeout).
        let overloaded = *status == 503 && body.contains("(overloaded)");
        assert!(*status == 200 || overloaded, "{status} {body}");
        assert!(*took < Duration::from_secs(5), "took {took:?}");
    }
    let admitted = answers.iter().filter(|(s, ..)| *s == 200).count();
    eprintln!(
        "500 new callers at once, in_flight_max 4: {admitted} admitted, the rest refused as overloaded, in {:?}",
        started.elapsed()
    );
    // Both: the bound admits some and refuses the rest (each new caller takes three calls).
    assert!(admitted > 0 && admitted < 500, "{admitted} admitted");
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_key_reaches_another_callers_account_or_the_operators() {
    use ledger_limiter::ledger::model::OPERATOR_ACCOUNT_ID;
    use tigerbeetle_unofficial as tb;

    let ledger = shared_ledger();
    let app = app().await;
    let victim = fresh_key("k_");
    assert_eq!(app.get("/greeting", Some(&victim)).await.status(), 200);
    let victim_id = account_id(&app, &victim);
    // Keys that spell the victim's or the operator's account id, in every way a request could.
    let attacks = [
        format!("{victim_id:032x}"),
        format!("0x{victim_id:032x}"),
        victim_id.to_string(),
        OPERATOR_ACCOUNT_ID.to_string(),
        format!("{OPERATOR_ACCOUNT_ID:032x}"),
        format!("ip:{victim}"),
        "ip:127.0.0.1".to_owned(),
    ];
    // Each is a well-formed key (visible ASCII), so each is admitted on an account of its own.
    for attack in &attacks {
        let status = app.get("/greeting", Some(attack)).await.status().as_u16();
        assert_eq!(status, 200, "{attack:?}");
        let id = account_id(&app, attack);
        assert_ne!(id, victim_id, "{attack:?}");
        assert_ne!(id, OPERATOR_ACCOUNT_ID, "{attack:?}");
    }
    let client = tb::Client::new(0, ledger.address.to_string()).unwrap();
    let victim_account = client.lookup_accounts(vec![victim_id]).await.unwrap()[0];
    assert_eq!(victim_account.debits_pending(), 1, "only its own request");
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_readiness_probes_is_a_few_ledger_reads() {
    let app = app().await;
    let calls = app.limiter.ledger().calls_started();
    let started = Instant::now();
    let probes = join_all((0..200).map(|_| async { app.get("/readyz", None).await.status() }));
    let statuses = probes.await;
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    // One probe per 500 ms at most, whatever the flood: two per second it lasted, plus one;
    // and the operator-epoch follower's read, once a second (both are account reads).
    let reads = app.limiter.ledger().calls_started() - calls;
    let bound = 3 * started.elapsed().as_secs() + 3;
    assert!(
        reads <= bound,
        "{reads} ledger reads for 200 probes (bound {bound})"
    );
    app.stop().await;
}

/// One request over a raw socket, the path exactly as written (no client library normalises
/// it); the answer's head, lowercased.
fn raw_get(app: &TestApp, path: &str, key: &str) -> String {
    let mut stream = connect(app);
    let request =
        format!("GET {path} HTTP/1.1\r\nHost: x\r\nX-Api-Key: {key}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).unwrap();
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).expect("the server closes");
    let answer = String::from_utf8_lossy(&answer).to_lowercase();
    answer
        .split("\r\n\r\n")
        .next()
        .unwrap_or_default()
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_encoded_path_pays_its_routes_cost() {
    let mut config = test_config(shared_ledger().address);
    config.routes.costs = Some([("/greeting".to_owned(), 3)].into());
    let app = spawn_app(config).await;
    // The router decodes `%67` to `g` and serves /greeting; the rules must see that path too.
    for path in ["/greeting", "/%67reeting", "/gr%65eting?x=1"] {
        let key = fresh_key("k_");
        let head = tokio::task::block_in_place(|| raw_get(&app, path, &key));
        assert!(head.starts_with("http/1.1 200"), "{path}: {head}");
        // "free" holds 5: a cost of 3 leaves 2.
        assert!(head.contains("ratelimit: \"free\";r=2;"), "{path}: {head}");
    }
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_spelling_an_address_spends_its_own_allowance() {
    // Keyless callers on the default plan (no anonymous plan), unknown keys welcome: a key that
    // spells the address's key must still be a caller of its own.
    let mut config = test_config(shared_ledger().address);
    // A plan of this test's own, so no other test's keyless requests share its accounts.
    let name = format!("free{:08x}", rand::random::<u32>());
    config.plans = Some([(name.clone(), plan(2, 60))].into());
    config.default_plan = Some(name);
    config.caller.source = Some("header-or-peer-ip".into());
    let app = spawn_app(config).await;
    let address = CallerKey::from_ip("127.0.0.1".parse().unwrap());
    let address_account = app.limiter.account_of(&address).unwrap();
    let before = held_by(&app, address_account).await;
    for spelling in ["ip:127.0.0.1", "ip_127.0.0.1", "127.0.0.1"] {
        assert_ne!(account_id(&app, spelling), address_account, "{spelling}");
        assert_eq!(app.get("/greeting", Some(spelling)).await.status(), 200);
    }
    assert_eq!(
        held_by(&app, address_account).await,
        before,
        "a key spent the address's"
    );
    app.stop().await;
}

async fn held_by(app: &TestApp, account_id: u128) -> u128 {
    let deadline = Instant::now() + Duration::from_secs(10);
    let audit = app
        .limiter
        .ledger()
        .audit(account_id, deadline)
        .await
        .unwrap();
    audit.map_or(0, |audit| audit.debits_pending)
}

/// The smoke of `scripts/soak-callers` (a million new callers, RSS sampled): a stream of callers
/// never seen before keeps this instance's per-caller memory within its capacity.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_of_new_callers_keeps_per_caller_memory_bounded() {
    let mut config = test_config(shared_ledger().address);
    config.ledger.local_callers_max = Some(128);
    let app = spawn_app(config).await;
    let run = format!("{:08x}", rand::random::<u32>());
    for wave in 0..30 {
        let statuses = join_all((0..100).map(|i| {
            let key = format!("new_{run}_{wave}_{i}");
            let app = &app;
            async move { app.get("/greeting", Some(&key)).await.status().as_u16() }
        }))
        .await;
        assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
        // 64 shards of at most ceil(128 / 64) = 2 callers each.
        assert!(
            app.limiter.local_callers() <= 128,
            "{}",
            app.limiter.local_callers()
        );
    }
    app.stop().await;
}
