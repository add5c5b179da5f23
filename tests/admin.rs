//! The admin API over real sockets against a real TigerBeetle: bearer secrets (401, 403), looking
//! a caller up and inspecting it, reducing its credit as an operator transfer in the audit trail,
//! problem+json for bad input, and secrets that never reach the log.

mod common;

use std::process::Command;

use common::*;
use ledger_limiter::config::{AdminFile, FileConfig};
use serde_json::{json, Value};

/// Asks `/greeting` for `key` until it answers `status`, for at most 10 s (the last status then
/// fails the test): for what other instances learn when they next read the operator epoch (once
/// a second), and for a block's end. Every answer before it is a refusal, which spends nothing.
async fn until_status(app: &TestApp, key: &str, status: u16) {
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let seen = app.get("/greeting", Some(key)).await.status();
        if seen == status {
            return;
        }
        assert!(std::time::Instant::now() < until, "{seen}, never {status}");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

const SECRET: &str = "admin-secret-for-tests-0001";
const ROTATED: &str = "admin-secret-for-tests-0002";

fn config(capacity: u64) -> FileConfig {
    let mut config = test_config(shared_ledger().address);
    config.plans = Some([("free".to_owned(), plan(capacity, 60))].into());
    config.admin = AdminFile {
        listen: Some("127.0.0.1:0".into()),
        secrets: Some(vec![SECRET.into(), ROTATED.into()]),
    };
    config
}

struct Admin<'a> {
    app: &'a TestApp,
}

impl Admin<'_> {
    fn url(&self, path: &str) -> String {
        format!(
            "http://127.0.0.1:{}{path}",
            self.app.admin_port.expect("admin on")
        )
    }

    async fn send(
        &self,
        method: &str,
        path: &str,
        secret: Option<&str>,
        body: Option<Value>,
    ) -> (u16, Value) {
        let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
        let mut request = self.app.http.request(method, self.url(path));
        if let Some(secret) = secret {
            request = request.bearer_auth(secret);
        }
        if let Some(body) = body {
            request = request.json(&body);
        }
        // Required on adjustments: a fresh one, each a new adjustment.
        if path.ends_with("/credit") || path.ends_with("/debit") {
            request = request.header("Idempotency-Key", fresh_key("once_"));
        }
        let response = request.send().await.unwrap();
        let status = response.status().as_u16();
        (status, response.json().await.unwrap_or(Value::Null))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_looks_up_inspects_and_reduces_a_callers_credit() {
    let app = spawn_app(config(2)).await;
    let admin = Admin { app: &app };
    let key = fresh_key("k_");
    assert_eq!(app.get("/greeting", Some(&key)).await.status(), 200);
    assert_eq!(app.get("/greeting", Some(&key)).await.status(), 200);
    assert_eq!(app.get("/greeting", Some(&key)).await.status(), 429);

    // Addressed by key over the authenticated API, by account id after that.
    let (status, found) = admin
        .send(
            "POST",
            "/admin/callers/lookup",
            Some(SECRET),
            Some(json!({"key": key})),
        )
        .await;
    assert_eq!(status, 200, "{found}");
    let id = found["account_id"].as_str().unwrap().to_owned();
    assert_eq!(id, format!("{:032x}", account_id(&app, &key)));
    assert_eq!(found["plan"], "free");
    let (status, seen) = admin
        .send("GET", &format!("/admin/callers/{id}"), Some(ROTATED), None)
        .await;
    assert_eq!(status, 200, "{seen}");
    assert_eq!(
        (seen["capacity"].as_u64(), seen["available"].as_u64()),
        (Some(2), Some(0))
    );
    assert_eq!(seen["holds"], 2);
    assert_eq!(
        seen["plan"], "free",
        "the one plan with its capacity and window"
    );

    // A reduction of more than is free is refused; nothing changes.
    let path = format!("/admin/callers/{id}/debit");
    let too_much = json!({"amount": 1, "reason": "abuse"});
    let (status, problem) = admin
        .send("POST", &path, Some(SECRET), Some(too_much))
        .await;
    assert_eq!(status, 409, "{problem}");
    assert_eq!(problem["type"], "urn:ledger-limiter:problem:admin");
    assert_eq!(problem["cause"], "not_enough_credit", "{problem}");
    let (_, after) = admin
        .send("GET", &format!("/admin/callers/{id}"), Some(SECRET), None)
        .await;
    assert_eq!(
        (&after["available"], &after["holds"], &after["reductions"]),
        (&json!(0), &json!(2), &json!(0)),
        "{after}"
    );

    // On a caller with credit free, a reduction is an operator transfer in the audit trail, and
    // the ledger admits that much less from then on.
    let other = fresh_key("k_");
    let (_, found) = admin
        .send(
            "POST",
            "/admin/callers/lookup",
            Some(SECRET),
            Some(json!({"key": other})),
        )
        .await;
    let other_id = found["account_id"].as_str().unwrap().to_owned();
    assert_eq!(
        app.get("/greeting", Some(&other)).await.status(),
        200,
        "provisioned"
    );
    let path = format!("/admin/callers/{other_id}/debit");
    let reduce = json!({"amount": 1, "reason": "abuse report 7"});
    let (status, after) = admin.send("POST", &path, Some(ROTATED), Some(reduce)).await;
    assert_eq!(status, 200, "{after}");
    assert_eq!(
        (after["available"].as_u64(), after["reductions"].as_u64()),
        (Some(0), Some(1))
    );
    // Its latest transfers, oldest first: the grant, the request's hold, the reduction.
    let kinds: Vec<&str> = after["recent"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["kind"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["grant", "hold", "reduction"], "{after}");
    assert_eq!(app.get("/greeting", Some(&other)).await.status(), 429);
    app.stop().await;
}

impl Admin<'_> {
    async fn account_of(&self, key: &str) -> String {
        self.account_of_plan(key).await.0
    }

    /// The lookup of `key`: its account and plan.
    async fn account_of_plan(&self, key: &str) -> (String, String) {
        let lookup = json!({"key": key});
        let path = "/admin/callers/lookup";
        let (status, found) = self.send("POST", path, Some(SECRET), Some(lookup)).await;
        assert_eq!(status, 200, "{found}");
        let text = |field: &str| found[field].as_str().unwrap().to_owned();
        (text("account_id"), text("plan"))
    }
}

/// A top-up raises the caller's limit per window at once on this instance and within about a
/// second on another (which reads the ledger's operator epoch once a second and then forgets what
/// it remembered of callers).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_top_up_raises_the_limit_on_every_instance() {
    let app = spawn_app(config(2)).await;
    let other = spawn_app(config(2)).await;
    let admin = Admin { app: &app };
    let key = fresh_key("k_");
    for _ in 0..2 {
        assert_eq!(app.get("/greeting", Some(&key)).await.status(), 200);
    }
    assert_eq!(other.get("/greeting", Some(&key)).await.status(), 429);
    assert_eq!(
        other.get("/greeting", Some(&key)).await.status(),
        429,
        "local"
    );
    let id = admin.account_of(&key).await;
    let path = format!("/admin/callers/{id}/credit");
    let top_up = json!({"amount": 3, "reason": "upgrade ticket 12"});
    let (status, after) = admin.send("POST", &path, Some(SECRET), Some(top_up)).await;
    assert_eq!(status, 200, "{after}");
    assert_eq!(
        (after["available"].as_u64(), after["top_ups"].as_u64()),
        (Some(3), Some(1))
    );
    assert_eq!(app.get("/greeting", Some(&key)).await.status(), 200);
    // The other instance refuses from memory until it reads the operator epoch (once a second).
    until_status(&other, &key, 200).await;
    assert_eq!(other.get("/greeting", Some(&key)).await.status(), 200);
    // 2 + 3 credit, all held now: exactly five admitted.
    assert_eq!(app.get("/greeting", Some(&key)).await.status(), 429);
    let (_, seen) = admin
        .send("GET", &format!("/admin/callers/{id}"), Some(SECRET), None)
        .await;
    assert_eq!(
        (seen["holds"].as_u64(), seen["available"].as_u64()),
        (Some(5), Some(0))
    );
    app.stop().await;
    other.stop().await;
}

/// A top-up of a caller whose grant never landed grants it first: the caller has its capacity
/// and the top-up. (The top-up counted as the grant, which no request then finished: the caller
/// kept 3 in place of 2 + 3, for good.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_top_up_of_an_account_never_granted_grants_it_first() {
    use ledger_limiter::ledger::model;
    use tigerbeetle_unofficial as tb;
    let app = spawn_app(config(2)).await;
    let admin = Admin { app: &app };
    let key = fresh_key("k_");
    let (id, _) = admin.account_of_plan(&key).await;
    // The account as a first request whose grant failed leaves it: created, never credited.
    let account = model::UserAccount {
        id: u128::from_str_radix(&id, 16).unwrap(),
        capacity: 2.try_into().unwrap(),
        window_seconds: 60.try_into().unwrap(),
    };
    let ledger = model::LEDGER_REQUEST_RATE;
    let raw = tb::Client::new(0, shared_ledger().address.to_string()).unwrap();
    let accounts = vec![
        model::operator_account(ledger),
        model::user_account(&account, ledger),
    ];
    let _ = raw.create_accounts(accounts).await; // the operator's exists: the caller's is new
    let (_, seen) = admin
        .send("GET", &format!("/admin/callers/{id}"), Some(SECRET), None)
        .await;
    assert_eq!(seen["grants"].as_u64(), Some(0), "{seen}");
    let body = json!({"amount": 3, "reason": "goodwill"});
    let path = format!("/admin/callers/{id}/credit");
    let (status, done) = admin.send("POST", &path, Some(SECRET), Some(body)).await;
    assert_eq!(status, 200, "{done}");
    for _ in 0..5 {
        assert_eq!(app.get("/greeting", Some(&key)).await.status(), 200);
    }
    assert_eq!(app.get("/greeting", Some(&key)).await.status(), 429);
    app.stop().await;
}

/// An adjustment retried with its `Idempotency-Key` (its first answer lost, say) is applied once,
/// with another secret too (a rotation renumbers them); the key reused for a different
/// adjustment changes nothing (422); a malformed one is a 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adjustment_retried_with_its_idempotency_key_is_applied_once() {
    let app = spawn_app(config(2)).await;
    let admin = Admin { app: &app };
    let key = fresh_key("k_");
    assert_eq!(app.get("/greeting", Some(&key)).await.status(), 200);
    let id = admin.account_of(&key).await;
    let send_as = |secret: &str, action: &str, once: &str, amount: u64| {
        let request = app
            .http
            .post(admin.url(&format!("/admin/callers/{id}/{action}")))
            .bearer_auth(secret)
            .header("Idempotency-Key", once)
            .json(&json!({"amount": amount, "reason": "ticket 7"}));
        async move {
            let response = request.send().await.unwrap();
            let status = response.status().as_u16();
            (
                status,
                response.json::<Value>().await.unwrap_or(Value::Null),
            )
        }
    };
    let send = |action, once, amount| send_as(SECRET, action, once, amount);
    let once = fresh_key("adj_");
    let (status, first) = send("credit", &once, 3).await;
    assert_eq!(status, 200, "{first}");
    let (status, again) = send("credit", &once, 3).await;
    assert_eq!(status, 200, "{again}");
    assert_eq!(again["top_ups"].as_u64(), Some(1), "applied once: {again}");
    assert_eq!(again["credits_posted"], first["credits_posted"]);
    // Sent again with the other secret: the same adjustment (the secret's number, in the
    // ledger's `user_data_64`, is who sent it, not what it is).
    let (status, rotated) = send_as(ROTATED, "credit", &once, 3).await;
    assert_eq!(status, 200, "{rotated}");
    assert_eq!(
        rotated["top_ups"].as_u64(),
        Some(1),
        "applied once: {rotated}"
    );
    for (action, amount) in [("credit", 4), ("debit", 3)] {
        let (status, problem) = send(action, &once, amount).await;
        assert_eq!(status, 422, "{action} {amount}: {problem}");
    }
    let (status, _) = send("credit", "has space", 3).await;
    assert_eq!(status, 400);
    // A key whose adjustment was refused (more than the caller has free) answers 409 on every
    // retry, never a 503: the ledger keeps a refused id refused.
    let refused = fresh_key("adj_");
    let (status, problem) = send("debit", &refused, 1000).await;
    assert_eq!(status, 409, "{problem}");
    let (status, problem) = send("debit", &refused, 1000).await;
    assert_eq!(status, 409, "{problem}");
    assert!(problem.to_string().contains("new key"), "{problem}");
    assert_eq!(problem["cause"], "key_refused_before", "{problem}");
    // Another key is another adjustment.
    let (status, other) = send("credit", &fresh_key("adj_"), 3).await;
    assert_eq!(
        (status, other["top_ups"].as_u64()),
        (200, Some(2)),
        "{other}"
    );
    app.stop().await;
}

/// The account's latest unblock in the ledger (a void of code 5).
async fn unblock_of(account_id: &str) -> tigerbeetle_unofficial::Transfer {
    use tigerbeetle_unofficial as tb;
    let client = tb::Client::new(0, shared_ledger().address.to_string()).unwrap();
    let id = u128::from_str_radix(account_id, 16).unwrap();
    let filter = tb::account::Filter::new(id, 100)
        .with_flags(tb::account::FilterFlags::DEBITS | tb::account::FilterFlags::REVERSED);
    let transfers = client
        .get_account_transfers(Box::new(filter))
        .await
        .unwrap();
    *transfers
        .iter()
        .find(|t| {
            t.code() == 5
                && t.flags()
                    .contains(tb::transfer::Flags::VOID_PENDING_TRANSFER)
        })
        .expect("an unblock in the ledger")
}

/// A block refuses every request with 403 and Retry-After on every instance, even on a caller
/// with credit; an unblock (or the block's end) lets it in again. Both are in the audit trail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_refuses_everywhere_until_unblocked_or_over() {
    let app = spawn_app(config(5)).await;
    let other = spawn_app(config(5)).await;
    let admin = Admin { app: &app };
    let key = fresh_key("k_");
    assert_eq!(app.get("/greeting", Some(&key)).await.status(), 200);
    let id = admin.account_of(&key).await;
    let path = format!("/admin/callers/{id}/block");
    let block = json!({"seconds": 600, "reason": "abuse report 9"});
    let (status, after) = admin
        .send("POST", &path, Some(SECRET), Some(block.clone()))
        .await;
    assert_eq!(status, 200, "{after}");
    assert_eq!(
        (after["blocked"].as_bool(), after["blocks"].as_u64()),
        (Some(true), Some(1))
    );
    let (status, problem) = admin.send("POST", &path, Some(SECRET), Some(block)).await;
    assert_eq!(status, 409, "blocked already");
    assert_eq!(problem["cause"], "already_blocked", "{problem}");
    for instance in [&app, &other] {
        let refused = instance.get("/greeting", Some(&key)).await;
        assert_eq!(refused.status(), 403);
        let retry: u64 = refused.headers()["retry-after"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        assert!((590..=601).contains(&retry), "{retry}");
        let body: Value = refused.json().await.unwrap();
        assert_eq!(body["type"], "urn:ledger-limiter:problem:blocked");
    }
    // Credit changes wait for the unblock.
    let top_up = json!({"amount": 1, "reason": "x"});
    let credit = format!("/admin/callers/{id}/credit");
    let (status, problem) = admin
        .send("POST", &credit, Some(SECRET), Some(top_up))
        .await;
    assert_eq!((status, &problem["cause"]), (409, &json!("blocked")));
    for bad in [json!({"reason": ""}), json!({"why": "appeal"})] {
        let (status, problem) = admin.send("DELETE", &path, Some(ROTATED), Some(bad)).await;
        assert_eq!(status, 400, "{problem}");
    }
    let appeal = json!({"reason": "appeal granted"});
    let (status, after) = admin
        .send("DELETE", &path, Some(ROTATED), Some(appeal))
        .await;
    assert_eq!(status, 200, "{after}");
    assert_eq!(
        (after["blocked"].as_bool(), after["unblocks"].as_u64()),
        (Some(false), Some(1))
    );
    assert_eq!(after["voids"], 0, "an unblock is not a refund");
    // The unblock is its own operator's, for its own reason (a void's zero fields would be
    // the block's).
    let unblock = unblock_of(&id).await;
    let actor = ledger_limiter::ledger::model::Actor::from_reason(2, "appeal granted").unwrap();
    assert_eq!(
        (unblock.user_data_64(), unblock.user_data_128()),
        (actor.who, actor.why)
    );
    let (status, problem) = admin.send("DELETE", &path, Some(SECRET), None).await;
    assert_eq!(status, 409, "not blocked");
    assert_eq!(problem["cause"], "not_blocked", "{problem}");
    // A JSON type on no body is a bare DELETE too (curl -X DELETE -H 'Content-Type: …'), not
    // a JSON body that ended too soon (a 400).
    let typed = app.http.delete(admin.url(&path)).bearer_auth(SECRET);
    let typed = typed
        .header("Content-Type", "application/json")
        .send()
        .await
        .unwrap();
    assert_eq!(typed.status().as_u16(), 409, "judged as a bare DELETE");
    assert_eq!(app.get("/greeting", Some(&key)).await.status(), 200);
    until_status(&other, &key, 200).await;

    // A short block ends by itself (TigerBeetle expires the closing transfer). Long enough (3 s)
    // for the 403 to be seen first on a loaded machine.
    let short = json!({"seconds": 3, "reason": "cool down"});
    let (status, _) = admin.send("POST", &path, Some(SECRET), Some(short)).await;
    assert_eq!(status, 200);
    assert_eq!(app.get("/greeting", Some(&key)).await.status(), 403);
    until_status(&app, &key, 200).await;
    let bad = json!({"seconds": 0, "reason": "x"});
    let (status, _) = admin.send("POST", &path, Some(SECRET), Some(bad)).await;
    assert_eq!(status, 400);
    app.stop().await;
    other.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_secret_is_401_a_wrong_one_403_and_bad_input_a_problem() {
    let app = spawn_app(config(2)).await;
    let admin = Admin { app: &app };
    let path = format!("/admin/callers/{:032x}", 7u128 | 1 << 127);
    let (status, problem) = admin.send("GET", &path, None, None).await;
    assert_eq!(status, 401, "{problem}");
    let (status, _) = admin
        .send("GET", &path, Some("admin-secret-for-tests-0003"), None)
        .await;
    assert_eq!(status, 403);
    let (status, _) = admin.send("GET", &path, Some(SECRET), None).await;
    assert_eq!(status, 404, "no such account");
    // Unknown paths, in the admin scope or not: strangers learn none (401), operators a 404.
    for unknown in ["/admin/nope", "/nope"] {
        let (status, _) = admin.send("GET", unknown, None, None).await;
        assert_eq!(status, 401, "{unknown}");
        let (status, problem) = admin.send("GET", unknown, Some(SECRET), None).await;
        assert_eq!(
            (status, problem["status"].as_u64()),
            (404, Some(404)),
            "{unknown}"
        );
    }
    // A top-up of no account spends its key (the ledger keeps the refused id): said so.
    let response = (admin.app.http)
        .post(admin.url(&format!("{path}/credit")))
        .bearer_auth(SECRET)
        .header("Idempotency-Key", "welcome")
        .json(&json!({"amount": 1, "reason": "x"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 404);
    let problem: Value = response.json().await.unwrap();
    let detail = problem["detail"].as_str().unwrap();
    assert!(detail.contains("Idempotency-Key is spent"), "{problem}");
    // The operator's own accounts (the grants' source, the operator epoch) are nobody's to block.
    for internal in [1u128, 1 << 64 | 1] {
        let block = json!({"seconds": 60, "reason": "x"});
        let internal = format!("/admin/callers/{internal:032x}/block");
        let (status, problem) = admin
            .send("POST", &internal, Some(SECRET), Some(block))
            .await;
        assert_eq!(status, 404, "{internal}: {problem}");
    }
    let (status, problem) = admin
        .send("GET", "/admin/callers/nope", Some(SECRET), None)
        .await;
    assert_eq!((status, problem["status"].as_u64()), (400, Some(400)));
    // A key the middleware refuses (longer than caller.key_length_max, 128) names no caller.
    let too_long = json!({"key": "k".repeat(129)});
    let (status, problem) = admin
        .send(
            "POST",
            "/admin/callers/lookup",
            Some(SECRET),
            Some(too_long),
        )
        .await;
    assert_eq!(status, 400, "{problem}");
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .contains("key_length_max"),
        "{problem}"
    );
    // An adjustment without an Idempotency-Key: a retry of it would apply it twice.
    let unnamed = admin
        .app
        .http
        .post(admin.url(&format!("{path}/credit")))
        .bearer_auth(SECRET)
        .json(&json!({"amount": 1, "reason": "x"}))
        .send()
        .await
        .unwrap();
    assert_eq!(unnamed.status(), 400);
    let problem: Value = unnamed.json().await.unwrap();
    let detail = problem["detail"].as_str().unwrap();
    assert!(
        detail.contains("Idempotency-Key header is required"),
        "{problem}"
    );
    let zero = json!({"amount": 0, "reason": "x"});
    let (status, _) = admin
        .send("POST", &format!("{path}/debit"), Some(SECRET), Some(zero))
        .await;
    assert_eq!(status, 400);
    // A reason is logged as written: a line break in it would forge a line of that log.
    let forged = json!({"amount": 1, "reason": "ok\nINFO caller blocked secret=2"});
    let (status, problem) = admin
        .send(
            "POST",
            &format!("{path}/credit"),
            Some(SECRET),
            Some(forged),
        )
        .await;
    assert_eq!(status, 400, "{problem}");
    let unknown = json!({"amount": 1, "reason": "x", "extra": true});
    let (status, problem) = admin
        .send(
            "POST",
            &format!("{path}/debit"),
            Some(SECRET),
            Some(unknown),
        )
        .await;
    assert_eq!(status, 400);
    assert_eq!(
        problem["type"], "urn:ledger-limiter:problem:admin",
        "{problem}"
    );
    // A path asked with a method it does not take is a 405, not another path's 400; a path
    // that is not the admin API's a 404: problems both.
    for (method, path, expected) in [
        ("GET", "/admin/callers/lookup", 405),
        ("DELETE", "/admin/callers/move", 405),
        ("PUT", &*format!("{path}/credit"), 405),
        ("GET", "/admin/nothing", 404),
    ] {
        let (status, problem) = admin.send(method, path, Some(SECRET), None).await;
        assert_eq!(status, expected, "{method} {path}: {problem}");
        assert_eq!(
            problem["type"], "urn:ledger-limiter:problem:admin",
            "{problem}"
        );
        // Without the secret, nothing tells a stranger which paths exist.
        let (status, _) = admin.send(method, path, None, None).await;
        assert_eq!(status, 401, "{method} {path} without the secret");
    }
    // Envoy's callers are looked up only where its front end is on.
    let descriptor = json!({"domain": "d", "entries": [{"key": "k", "value": "v"}]});
    let (status, problem) = admin
        .send(
            "POST",
            "/admin/envoy/lookup",
            Some(SECRET),
            Some(descriptor),
        )
        .await;
    assert_eq!(status, 404, "{problem}");
    assert!(problem["detail"]
        .as_str()
        .unwrap()
        .contains("Envoy front end is off"));
    // A 405 says what the path takes.
    let wrong_method = app
        .http
        .delete(admin.url(&format!("{path}/credit")))
        .bearer_auth(SECRET)
        .send()
        .await
        .unwrap();
    assert_eq!(wrong_method.status(), 405);
    assert_eq!(wrong_method.headers()["allow"], "POST");
    // The admin API is not on the service's own listener: a request a caller may send, with the
    // secret, finds nothing there (without a key it would be a 401 either way).
    let on_service = app
        .http
        .get(format!("{}/admin/callers/{:032x}", app.address, 7))
        .header("X-Api-Key", common::fresh_key("k_"))
        .bearer_auth(SECRET)
        .send()
        .await
        .unwrap();
    assert_eq!(
        on_service.status(),
        404,
        "the service's listener only knows callers"
    );
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_is_judged_only_after_the_secret_and_with_the_right_status() {
    let app = spawn_app(config(2)).await;
    let admin = Admin { app: &app };
    let url = admin.url("/admin/callers/lookup");
    let post = |secret: Option<&str>, content_type: &str, body: String| {
        let mut request = app.http.post(&url).header("content-type", content_type);
        if let Some(secret) = secret {
            request = request.bearer_auth(secret);
        }
        async move { request.body(body).send().await.unwrap().status().as_u16() }
    };
    let json = "application/json";
    let unknown_field = r#"{"nope": 1}"#.to_owned();
    // Strangers learn nothing of the body's shape: the secret is judged first.
    assert_eq!(post(None, json, unknown_field.clone()).await, 401);
    let wrong = Some("admin-secret-for-tests-0003");
    assert_eq!(post(wrong, json, unknown_field.clone()).await, 403);
    // An operator's mistakes, each with its own status.
    assert_eq!(post(Some(SECRET), json, unknown_field).await, 400);
    let key = r#"{"key": "k"}"#.to_owned();
    assert_eq!(post(Some(SECRET), "text/plain", key).await, 415);
    // The longest key any configuration allows (4,096 bytes), each byte escaped, is read (and
    // refused here, past this service's `caller.key_length_max`), not refused for its size.
    let longest = format!(r#"{{"key": "{}"}}"#, r#"\""#.repeat(4096));
    assert_eq!(post(Some(SECRET), json, longest).await, 400);
    let huge = format!(r#"{{"key": "{}"}}"#, "k".repeat(16 * 1024));
    assert_eq!(post(Some(SECRET), json, huge).await, 413);
    app.stop().await;
}

/// An app that mounts the admin routes beside its own keeps its own answers: its unknown paths
/// are its 404s (not the admin API's 401, counted as a refused secret), and its JSON bodies
/// have its own bound (not the admin's 12 KiB). Only `/admin` is the admin API's (the bundled
/// server's unknown paths stay its 401 and 404: `no_secret_is_401_a_wrong_one_403_and_bad_input_a_problem`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_app_mounting_the_admin_routes_keeps_its_own_answers() {
    use actix_web::{web, App, HttpServer};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = HttpServer::new(|| {
        App::new()
            .route(
                "/mine",
                web::post()
                    .to(|body: web::Json<Value>| async move { body.to_string().len().to_string() }),
            )
            .configure(ledger_limiter::http::admin::configure)
    })
    .workers(1)
    .listen(listener)
    .unwrap()
    .run();
    let handle = server.handle();
    let running = tokio::spawn(server);
    let http = reqwest::Client::new();
    let url = |path: &str| format!("http://127.0.0.1:{port}{path}");
    let unknown = http.get(url("/elsewhere")).send().await.unwrap();
    assert_eq!(unknown.status().as_u16(), 404);
    assert!(
        unknown.headers().get("content-type").is_none(),
        "the app's own 404, not a problem+json"
    );
    let large = json!({"text": "x".repeat(20 * 1024)});
    let mine = http.post(url("/mine")).json(&large).send().await.unwrap();
    assert_eq!(mine.status().as_u16(), 200, "the app's JSON bound");
    handle.stop(true).await;
    running.await.unwrap().unwrap();
}

/// A secret cannot be guessed online: past ten wrong ones in a minute, a peer is answered 429
/// (with when to come back) before anything it presents is compared, the right secret too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_guessing_secrets_is_refused_before_any_comparison() {
    let app = spawn_app(config(2)).await;
    let admin = Admin { app: &app };
    let path = format!("/admin/callers/{:032x}", 7u128 | 1 << 127);
    for guess in 0..10 {
        let wrong = format!("admin-secret-guess-{guess:08}");
        let (status, _) = admin.send("GET", &path, Some(&wrong), None).await;
        assert_eq!(status, 403, "guess {guess}");
    }
    let response = app
        .http
        .get(admin.url(&path))
        .bearer_auth(SECRET)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 429);
    let retry_after: u64 = response.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=60).contains(&retry_after), "{retry_after}");
    let problem: Value = response.json().await.unwrap();
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .contains("wrong secrets"),
        "{problem}"
    );
    // Without a token it is still told what is missing: that is no guess.
    let (status, _) = admin.send("GET", &path, None, None).await;
    assert_eq!(status, 401);
    app.stop().await;
}

/// The admin API is not traced (its listener has no tracing middleware), so no span can carry a
/// secret; the log and the metrics are checked here.
#[test]
fn secrets_never_reach_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let mut command = binary_command();
    command
        .current_dir(dir.path())
        .env("RUST_LOG", "debug")
        .env(
            "LEDGER_LIMITER_ADMIN_SECRETS",
            format!("{SECRET},{ROTATED}"),
        )
        .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
        .args(["--ledger-addresses", &shared_ledger().address.to_string()]);
    let (running, admin_port, log) = start_binary_logged(command, "admin API listening on port ");
    let url = format!("http://127.0.0.1:{admin_port}/admin/callers/lookup");
    // The right secret gets the caller's account, the wrong one a 403: both reached the API.
    for (secret, expected) in [(SECRET, "200"), ("a-wrong-secret-0000000", "403")] {
        let status = Command::new("curl")
            .args([
                "-s",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
                "-X",
                "POST",
                &url,
            ])
            .args(["-H", &format!("Authorization: Bearer {secret}")])
            .args([
                "-H",
                "Content-Type: application/json",
                "-d",
                r#"{"key":"k"}"#,
            ])
            .output()
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&status.stdout), expected);
    }
    // Nor the metrics: scrape the service's own listener.
    let service_port = || {
        let logged = log.lock().unwrap().clone();
        let rest = logged.split("ledger-limiter listening on port ").nth(1)?;
        rest.split(|c: char| !c.is_ascii_digit())
            .next()
            .map(str::to_owned)
    };
    let started = std::time::Instant::now();
    let port = loop {
        match service_port() {
            Some(port) => break port,
            None if started.elapsed() < std::time::Duration::from_secs(30) => {
                std::thread::sleep(std::time::Duration::from_millis(100))
            }
            None => panic!("the service's port never reached the log"),
        }
    };
    let metrics = Command::new("curl")
        .args(["-s", &format!("http://127.0.0.1:{port}/metrics")])
        .output()
        .unwrap();
    let metrics = String::from_utf8_lossy(&metrics.stdout).to_string();
    assert!(metrics.contains("ledger_limiter_"), "{metrics}");
    for secret in [SECRET, ROTATED, "a-wrong-secret-0000000"] {
        assert!(!metrics.contains(secret), "a secret reached the metrics");
    }
    // The wrong one is counted (and logged, below), never shown.
    let refused = "ledger_limiter_admin_refused_total{reason=\"wrong_secret\"} 1";
    assert!(metrics.contains(refused), "{metrics}");
    // The other reason is exported at 0 before its first count.
    let missing = "ledger_limiter_admin_refused_total{reason=\"missing_secret\"} 0";
    assert!(metrics.contains(missing), "{metrics}");
    // Stopped by the guard (SIGKILL); the log is whole once its reader saw the stream end.
    drop(running);
    let ended = wait_logged(&log, LOG_ENDED, std::time::Duration::from_secs(10));
    assert!(ended, "the log never ended");
    let log = log.lock().unwrap().clone();
    assert!(log.contains("admin API listening"), "{log}");
    assert!(
        log.contains("an admin request was refused for its secret"),
        "{log}"
    );
    for secret in [SECRET, ROTATED, "a-wrong-secret-0000000"] {
        assert!(!log.contains(secret), "a secret reached the log");
    }
    // --check-config shows how many secrets, never which.
    let mut check = binary_command();
    let shown = check
        .current_dir(dir.path())
        .env("LEDGER_LIMITER_ADMIN_SECRETS", SECRET)
        .args(["--admin-listen", "127.0.0.1:0", "--check-config"])
        .output()
        .unwrap();
    let shown = String::from_utf8_lossy(&shown.stdout);
    assert!(shown.contains("AdminSecrets(1 configured)"), "{shown}");
    assert!(!shown.contains(SECRET));
}

/// The same actions from the command line, straight on the ledger: the key is read from standard
/// input, never an argument; bad input is a clear error and exit status 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_command_line_credits_blocks_unblocks_and_audits() {
    use std::io::Write;
    let app = spawn_app(config(2)).await;
    let key = fresh_key("k_");
    assert_eq!(app.get("/greeting", Some(&key)).await.status(), 200);
    let address = shared_ledger().address.to_string();
    // The same plans as the app's, so that a key derives the same account; and the service's
    // admin listener, whose secrets live in the service's environment, not the operator's,
    // and its Envoy rules, on the service's host: the commands need neither.
    let dir = tempfile::tempdir().unwrap();
    let plans = dir.path().join("plans.toml");
    std::fs::write(
        &plans,
        "[plans.free]\ncapacity = 2\nwindow_seconds = 60\n[key_prefixes]\n\
         [admin]\nlisten = \"127.0.0.1:0\"\n[rls]\nlisten = \"127.0.0.1:0\"\n\
         config = \"/nonexistent/rules\"\n",
    )
    .unwrap();
    let plans = plans.to_str().unwrap().to_owned();
    let run = |args: &[&str], stdin: Option<&str>| {
        let mut command = binary_command();
        command
            .env_remove("LEDGER_LIMITER_ADMIN_SECRETS")
            .args(["--config", &plans, "--ledger-addresses", &address])
            .args(args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        let mut child = command.spawn().unwrap();
        if let Some(input) = stdin {
            writeln!(child.stdin.take().unwrap(), "{input}").unwrap();
        }
        let output = child.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout).to_string();
        let stderr = String::from_utf8_lossy(&output.stderr).to_string();
        (output.status.code(), stdout, stderr)
    };
    let id = format!("{:032x}", account_id(&app, &key));
    let credit = [
        "admin",
        "credit",
        "--key-stdin",
        "--amount",
        "2",
        "--reason",
        "r",
    ];
    let (code, out, err) = run(&credit, Some(&key));
    assert_eq!(code, Some(0), "{err}");
    let audit: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(audit["account_id"], id.as_str());
    assert_eq!(
        (audit["top_ups"].as_u64(), audit["available"].as_u64()),
        (Some(1), Some(3))
    );
    // Run twice with one idempotency key (a retry after a timeout): applied once.
    let once = [
        "admin",
        "credit",
        "--account-id",
        &id,
        "--amount",
        "1",
        "--reason",
        "r",
    ];
    let once = [&once[..], &["--idempotency-key", "ticket-9"]].concat();
    for _ in 0..2 {
        let (code, out, err) = run(&once, None);
        assert_eq!(code, Some(0), "{err}");
        let audit: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(audit["top_ups"].as_u64(), Some(2), "{audit}");
    }
    let block = [
        "admin",
        "block",
        "--account-id",
        &id,
        "--seconds",
        "300",
        "--reason",
        "r",
    ];
    let (code, out, err) = run(&block, None);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("\"blocked\": true"), "{out}");
    assert_eq!(app.get("/greeting", Some(&key)).await.status(), 403);
    let (code, _, err) = run(&block, None);
    assert_eq!(code, Some(1));
    assert!(err.contains("blocked already"), "{err}");
    let unblock = [
        "admin",
        "unblock",
        "--account-id",
        &id,
        "--reason",
        "by phone",
    ];
    let (code, out, err) = run(&unblock, None);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("\"unblocks\": 1"), "{out}");
    let by_phone = ledger_limiter::ledger::model::Actor::from_reason(0, "by phone").unwrap();
    assert_eq!(unblock_of(&id).await.user_data_128(), by_phone.why);
    until_status(&app, &key, 200).await;
    let (code, out, _) = run(&["audit", "--account-id", &id], None);
    assert_eq!(code, Some(0));
    assert!(out.contains("\"holds\": 2"), "{out}");
    // Bad input: a clear message, never the key.
    let zero = [
        "admin",
        "debit",
        "--key-stdin",
        "--amount",
        "0",
        "--reason",
        "r",
    ];
    let (code, _, err) = run(&zero, Some(&key));
    assert_eq!(code, Some(1));
    assert!(err.contains("--amount") && !err.contains(&key), "{err}");
    let gold = ["admin", "move", "--plan", "gold", "--reason", "r"];
    let (code, _, err) = run(&gold, Some(&key));
    assert_eq!(code, Some(1));
    assert!(err.contains("no plan named \"gold\""), "{err}");
    let (code, _, err) = run(&["admin", "unblock", "--account-id", "xyz"], None);
    assert_eq!(code, Some(1));
    assert!(err.contains("32 hex digits"), "{err}");
    let operator = format!("{:032x}", 1);
    let (code, _, err) = run(&["admin", "unblock", "--account-id", &operator], None);
    assert_eq!(code, Some(1));
    assert!(err.contains("operator's own account"), "{err}");
    app.stop().await;
}

/// A credit run without an idempotency key says the key it made up before it sends anything:
/// a run cut short (Ctrl-C while the ledger is slow) said it only on an error, so the same
/// command run again under a key of its own could credit twice.
#[test]
fn the_command_line_names_its_idempotency_key_before_it_sends() {
    use std::io::BufRead;
    let address = dead_address().to_string();
    let id = format!("{:032x}", rand::random::<u128>() | 1 << 127);
    let mut child = binary_command()
        .env_remove("LEDGER_LIMITER_ADMIN_SECRETS")
        .args(["--ledger-addresses", &address, "admin", "credit"])
        .args(["--account-id", &id, "--amount", "1", "--reason", "r"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = std::io::BufReader::new(child.stderr.take().unwrap());
    let (said, heard) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in stderr.lines().map_while(Result::ok) {
            if said.send(line).is_err() {
                break;
            }
        }
    });
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut lines = Vec::new();
    let named = loop {
        let left = until.saturating_duration_since(std::time::Instant::now());
        match heard.recv_timeout(left) {
            Ok(line) if line.contains("--idempotency-key cli-") => break Some(line),
            Ok(line) => lines.push(line),
            Err(_) => break None,
        }
    };
    let running = child.try_wait().unwrap().is_none();
    let _ = child.kill();
    let _ = child.wait();
    let named = named.unwrap_or_else(|| panic!("no key named within 10 s: {lines:?}"));
    assert!(
        running,
        "named while the credit waits for the ledger: {named}"
    );
}

/// `audit` prints a caller's account only, as the admin API's audit does: a concurrency limit's
/// slots (another ledger, an id of a caller's kind) were printed as a caller's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_command_lines_audit_is_of_callers_only() {
    let ledger = ledger_client(vec![shared_ledger().address]);
    let id: u128 = rand::random::<u128>() | 1 << 127;
    let slots = ledger_limiter::ledger::model::UserAccount {
        id,
        capacity: std::num::NonZeroU64::new(2).unwrap(),
        window_seconds: std::num::NonZeroU32::new(60).unwrap(),
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    ledger
        .on_ledger(2)
        .provision(&slots, deadline)
        .await
        .unwrap();
    let address = shared_ledger().address.to_string();
    let output = binary_command()
        .env_remove("LEDGER_LIMITER_ADMIN_SECRETS")
        .args(["--ledger-addresses", &address, "audit"])
        .args(["--account-id", &format!("{id:032x}")])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{said}");
    assert!(said.contains("no caller's account"), "{said}");
    assert!(output.stdout.is_empty(), "nothing printed as a caller's");
}

/// A move to another plan carries what the caller holds (no fresh credit), every instance
/// follows it (one that never heard of it learns it from the ledger), and a move back works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_moved_caller_keeps_what_it_holds_on_every_instance() {
    let to_of = |moved: &Value| moved["to_account_id"].as_str().unwrap().to_owned();
    let two_plans = || {
        let mut config = config(2);
        config.plans = Some(
            [
                ("free".to_owned(), plan(2, 60)),
                ("pro".to_owned(), plan(5, 60)),
            ]
            .into(),
        );
        config.default_plan = Some("free".into());
        config
    };
    let app = spawn_app(two_plans()).await;
    let other = spawn_app(two_plans()).await;
    let admin = Admin { app: &app };
    let key = fresh_key("k_");
    let send_move = |plan: &str| {
        let body = json!({"key": key, "plan": plan, "reason": "upgrade"});
        admin.send("POST", "/admin/callers/move", Some(SECRET), Some(body))
    };
    let (status, _) = send_move("pro").await;
    assert_eq!(status, 404, "no account before its first request");
    for _ in 0..2 {
        assert_eq!(app.get("/greeting", Some(&key)).await.status(), 200);
    }
    assert_eq!(app.get("/greeting", Some(&key)).await.status(), 429);
    let (status, moved) = send_move("pro").await;
    assert_eq!(status, 200, "{moved}");
    assert_eq!(
        (moved["from_plan"].as_str(), moved["to_plan"].as_str()),
        (Some("free"), Some("pro"))
    );
    assert_eq!(moved["carried"], 2);
    // pro allows 5 per window; 2 are carried: exactly 3 more, across both instances.
    let first = other.get("/greeting", Some(&key)).await;
    assert_eq!(first.status(), 200, "the other instance follows the move");
    assert!(first.headers()["ratelimit-policy"]
        .to_str()
        .unwrap()
        .contains("\"pro\""));
    assert_eq!(app.get("/greeting", Some(&key)).await.status(), 200);
    assert_eq!(other.get("/greeting", Some(&key)).await.status(), 200);
    assert_eq!(app.get("/greeting", Some(&key)).await.status(), 429);
    assert_eq!(other.get("/greeting", Some(&key)).await.status(), 429);
    let to = moved["to_account_id"].as_str().unwrap();
    let (_, seen) = admin
        .send("GET", &format!("/admin/callers/{to}"), Some(SECRET), None)
        .await;
    assert_eq!(
        (seen["carried_in"].as_u64(), seen["holds"].as_u64()),
        (Some(1), Some(3)),
        "{seen}"
    );
    let from = moved["from_account_id"].as_str().unwrap();
    let (_, old) = admin
        .send("GET", &format!("/admin/callers/{from}"), Some(SECRET), None)
        .await;
    assert_eq!(
        (old["moves_out"].as_u64(), old["blocked"].as_bool()),
        (Some(1), Some(true))
    );
    // Errors: the same plan, a plan that does not exist, an unblock of a moved account.
    let (status, problem) = send_move("pro").await;
    assert_eq!((status, &problem["cause"]), (409, &json!("same_plan")));
    // An instance that never met the caller looks its key up in the ledger: the moved-to
    // account, not the closed one its key derives.
    let fresh = spawn_app(two_plans()).await;
    let found = Admin { app: &fresh }.account_of_plan(&key).await;
    assert_eq!((found.0, found.1.as_str()), (to_of(&moved), "pro"));
    fresh.stop().await;
    let (status, _) = send_move("gold").await;
    assert_eq!(status, 400);
    // Actions on the account the move closed say so (they used to say "blocked", and an
    // unblock then "not blocked").
    let credit = json!({"amount": 1, "reason": "goodwill"});
    for (method, action, body) in [
        ("DELETE", "block", None),
        (
            "POST",
            "block",
            Some(json!({"seconds": 60, "reason": "abuse"})),
        ),
        ("POST", "credit", Some(credit)),
    ] {
        let path = format!("/admin/callers/{from}/{action}");
        let (status, problem) = admin.send(method, &path, Some(SECRET), body).await;
        assert_eq!(status, 409, "{method} {action}: {problem}");
        let detail = problem["detail"].as_str().unwrap_or_default();
        assert!(detail.contains("moved to another plan"), "{problem}");
    }
    // Back to free: its account reopens with its own holds still live, so still refused.
    let (status, back) = send_move("free").await;
    assert_eq!(status, 200, "{back}");
    assert_eq!(back["from_plan"], "pro");
    assert_eq!(app.get("/greeting", Some(&key)).await.status(), 429);
    let (_, old) = admin
        .send("GET", &format!("/admin/callers/{from}"), Some(SECRET), None)
        .await;
    assert_eq!(
        (old["moves_back"].as_u64(), old["blocked"].as_bool()),
        (Some(1), Some(false))
    );
    app.stop().await;
    other.stop().await;
}

/// A move to a plan whose account for the caller is blocked says so, naming that account (a
/// key the keys file moved between plans leaves its old plan's account as it was): it said
/// "the caller is blocked", which no lookup of the caller showed and no unblock of it lifted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_to_a_blocked_account_names_it() {
    use ledger_limiter::ledger::model;
    use std::num::{NonZeroU32, NonZeroU64};
    let mut config = config(2);
    let plans = [("free", plan(2, 60)), ("pro", plan(5, 60))];
    config.plans = Some(plans.map(|(name, plan)| (name.to_owned(), plan)).into());
    config.default_plan = Some("free".into());
    let app = spawn_app(config).await;
    let admin = Admin { app: &app };
    let key = fresh_key("k_");
    let ledger = app.limiter.ledger();
    let five = NonZeroU64::new(5).unwrap();
    let pro = model::UserAccount {
        id: model::user_account_id(ledger.ledger_id(), "pro", five, key.as_bytes()),
        capacity: five,
        window_seconds: NonZeroU32::new(60).unwrap(),
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    ledger.provision(&pro, deadline).await.unwrap();
    let pro_id = format!("{:032x}", pro.id);
    let path = format!("/admin/callers/{pro_id}/block");
    let block = json!({"seconds": 600, "reason": "abuse on pro"});
    let (status, _) = admin.send("POST", &path, Some(SECRET), Some(block)).await;
    assert_eq!(status, 200);
    assert_eq!(app.get("/greeting", Some(&key)).await.status(), 200);
    let body = json!({"key": key, "plan": "pro", "reason": "upgrade"});
    let send_move = || {
        admin.send(
            "POST",
            "/admin/callers/move",
            Some(SECRET),
            Some(body.clone()),
        )
    };
    let (status, problem) = send_move().await;
    assert_eq!((status, &problem["cause"]), (409, &json!("target_blocked")));
    let detail = problem["detail"].as_str().unwrap_or_default();
    assert!(detail.contains(&pro_id), "{problem}");
    // The named account's unblock lets the move go.
    let (status, _) = admin.send("DELETE", &path, Some(SECRET), None).await;
    assert_eq!(status, 200);
    let (status, moved) = send_move().await;
    assert_eq!(status, 200, "{moved}");
    app.stop().await;
}

/// A caller moved through every plan is followed to its end: a lookup, a request and a move, each
/// on an instance that never heard of the moves (one decision or lookup followed at most three
/// moves: the lookup failed, the request was refused as blocked, and a fifth move as "moved
/// elsewhere"); and a move by an instance that knows where the caller is reads from there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_moved_through_every_plan_is_followed_to_its_end() {
    let names = ["p0", "p1", "p2", "p3", "p4"];
    let five_plans = || {
        let mut config = config(2);
        let plans = names.iter().zip(2..);
        config.plans = Some(plans.map(|(n, c)| (n.to_string(), plan(c, 60))).collect());
        config.default_plan = Some("p0".into());
        config
    };
    let app = spawn_app(five_plans()).await;
    let key = fresh_key("k_");
    assert_eq!(app.get("/greeting", Some(&key)).await.status(), 200);
    let send_move = |app, plan: &str| {
        let body = json!({"key": key, "plan": plan, "reason": "upgrade"});
        let path = "/admin/callers/move";
        async move {
            Admin { app }
                .send("POST", path, Some(SECRET), Some(body))
                .await
        }
    };
    for (from, to) in names.iter().zip(&names[1..]) {
        let (status, moved) = send_move(&app, to).await;
        assert_eq!(status, 200, "{from} to {to}: {moved}");
        assert_eq!(moved["from_plan"], *from, "{moved}");
    }
    // A lookup, then a request, on an instance that learns the moves from the ledger.
    let looking = spawn_app(five_plans()).await;
    let (_, plan) = Admin { app: &looking }.account_of_plan(&key).await;
    assert_eq!(plan, "p4");
    let admitted = looking.get("/greeting", Some(&key)).await;
    assert_eq!(admitted.status(), 200);
    let policy = admitted.headers()["ratelimit-policy"].to_str().unwrap();
    assert!(policy.contains("\"p4\""), "{policy}");
    let fresh = spawn_app(five_plans()).await;
    assert_eq!(fresh.get("/greeting", Some(&key)).await.status(), 200);
    // A move back, from where this instance last found the caller, then another by an instance
    // that walks the whole chain from the caller's home to find it: the walk's listings, each
    // closed account's, are the difference.
    let listings = |app: &TestApp| {
        let operation = ledger_limiter::ledger::metrics::Operation::GetAccountTransfers;
        app.limiter.ledger().calls_started_of(operation)
    };
    let before = listings(&app);
    let (status, back) = send_move(&app, "p3").await;
    assert_eq!(status, 200, "{back}");
    let from_known = listings(&app) - before;
    let moving = spawn_app(five_plans()).await;
    let before = listings(&moving);
    let (status, back) = send_move(&moving, "p2").await;
    assert_eq!(status, 200, "{back}");
    let from_home = listings(&moving) - before;
    assert_eq!(
        (&back["from_plan"], &back["to_plan"]),
        (&json!("p3"), &json!("p2"))
    );
    assert!(from_known < from_home, "{from_known} against {from_home}");
    for app in [app, looking, fresh, moving] {
        app.stop().await;
    }
}

/// An application dropped without being run stops what it started beside its server: its admin
/// API no longer serves a limiter that nobody runs (it did, for the life of the process).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_application_dropped_unrun_stops_its_admin_api() {
    use ledger_limiter::config::Settings;
    use ledger_limiter::startup::{Application, Exporters};

    let settings = Settings::with_overrides(config(5)).expect("valid test configuration");
    let application = Application::build(settings, Exporters::default())
        .await
        .expect("application builds");
    let port = application.admin_port().expect("admin API on");
    let connects = || std::net::TcpStream::connect(("127.0.0.1", port)).is_ok();
    assert!(connects(), "the admin API listens once built");
    drop(application);
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while connects() {
        assert!(
            std::time::Instant::now() < until,
            "the admin API still serves"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// A caller known by its address (no key) is found, and moved, by that address: the callers
/// most often abusive could be found only by an id read from a trace. An IPv4-mapped address
/// names the same caller, as the middleware counts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_known_by_its_address_is_looked_up_by_it() {
    let mut by_address = config(7);
    by_address.caller.source = Some("header-or-peer-ip".into());
    let plans = by_address.plans.as_mut().unwrap();
    plans.insert("pro".to_owned(), plan(70, 60));
    let app = spawn_app(by_address).await;
    let admin = Admin { app: &app };
    assert_eq!(app.get("/greeting", None).await.status(), 200, "keyless");
    let lookup = "/admin/callers/lookup";
    let by = |body: Value| admin.send("POST", lookup, Some(SECRET), Some(body));
    let (status, found) = by(json!({"address": "127.0.0.1"})).await;
    assert_eq!(status, 200, "{found}");
    let (_, mapped) = by(json!({"address": "::ffff:127.0.0.1"})).await;
    assert_eq!(mapped["account_id"], found["account_id"]);
    let id = found["account_id"].as_str().unwrap();
    let (status, seen) = admin
        .send("GET", &format!("/admin/callers/{id}"), Some(SECRET), None)
        .await;
    assert_eq!(
        (status, seen["holds"].as_u64()),
        (200, Some(1)),
        "its request"
    );
    // Moved by its address too, carrying its hold.
    let moving = json!({"address": "127.0.0.1", "plan": "pro", "reason": "upgrade"});
    let path = "/admin/callers/move";
    let (status, report) = admin.send("POST", path, Some(SECRET), Some(moving)).await;
    assert_eq!(status, 200, "{report}");
    let from = report["from_account_id"].as_str();
    assert_eq!((from, report["carried"].as_u64()), (Some(id), Some(1)));
    let (_, moved) = by(json!({"address": "127.0.0.1"})).await;
    assert_eq!(moved["plan"], "pro", "{moved}");
    for bad in [
        json!({"address": "nope"}),
        json!({"key": "k", "address": "127.0.0.1"}),
        json!({}),
    ] {
        let (status, problem) = by(bad.clone()).await;
        assert_eq!(status, 400, "{bad}: {problem}");
    }
    app.stop().await;
    // Where callers are known by key alone, an address names none; and the other way round.
    let keys_only = spawn_app(config(7)).await;
    let admin = Admin { app: &keys_only };
    let body = json!({"address": "127.0.0.1"});
    let (status, problem) = admin.send("POST", lookup, Some(SECRET), Some(body)).await;
    assert_eq!(status, 400, "{problem}");
    keys_only.stop().await;
    let mut addresses_only = config(7);
    addresses_only.caller.source = Some("peer-ip".into());
    let addresses_only = spawn_app(addresses_only).await;
    let admin = Admin {
        app: &addresses_only,
    };
    let body = json!({"key": "k"});
    let (status, problem) = admin.send("POST", lookup, Some(SECRET), Some(body)).await;
    assert_eq!(status, 400, "{problem}");
    addresses_only.stop().await;
}
