//! The admin API, on a listener of its own (never rate-limited): look a caller up by key, inspect
//! it, top up or reduce its credit, block it for a while and unblock it. Every change is an operator transfer, so it is in the audit trail with who
//! (which secret) and why (a hash of the reason). Off unless a secret is configured.
//!
//! Authentication: `Authorization: Bearer <secret>`; 401 without it, 403 with a wrong one. Secrets
//! are kept only as SHA-256 digests and compared in constant time (every digest, every byte), so
//! neither a secret nor its length leaks through timing, logs, metrics or spans.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix_web::dev::Payload;
use actix_web::error::{InternalError, JsonPayloadError};
use actix_web::http::header::{
    HeaderValue, AUTHORIZATION, CONTENT_LENGTH, RETRY_AFTER, TRANSFER_ENCODING, WWW_AUTHENTICATE,
};
use actix_web::http::StatusCode;
use actix_web::{web, FromRequest, HttpRequest, HttpResponse};
use futures_util::future::LocalBoxFuture;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::future::{ready, Ready};

use super::guesses::{SecretGuesses, GUESS_WINDOW, WRONG_SECRETS_PER_WINDOW_MAX};
use super::headers;
use super::problem::{self, ProblemKind};
use crate::http::rules::KeySource;
use crate::ledger::audit::AccountAudit;
use crate::ledger::metrics::LedgerErrorKind;
use crate::ledger::model::{
    Actor, IdempotencyKey, IDEMPOTENCY_KEY_LENGTH_MAX, UNBLOCK_REASON_DEFAULT,
};
use crate::ledger::{Adjusted, Blocking, LedgerError, Unblocking};
use crate::limiter::caller::{CallerKey, KEY_LENGTH_MAX_LIMIT};
use crate::limiter::{BlockAct, Limiter};

pub use crate::ledger::model::REASON_LENGTH_MAX;
/// No single adjustment may move more than this much credit.
pub const AMOUNT_MAX: u64 = 1 << 40;
/// Secrets shorter than this are refused: a bearer token must not be guessable.
pub const SECRET_LENGTH_MIN: usize = 16;
/// The longest block: a week (a longer one is a plan change, or a key revoked).
pub const BLOCK_SECONDS_MAX: u32 = 7 * 24 * 3600;
const DEADLINE: Duration = Duration::from_secs(5);
const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// The largest admin request body: a few short fields, and a caller's key, which may be
/// [`KEY_LENGTH_MAX_LIMIT`] bytes, each written as two in JSON (`\"`, `\\`). At 4 KiB, an
/// operator could not look up or move a caller with a long key the middleware serves (413).
const JSON_BYTES_MAX: usize = 2 * KEY_LENGTH_MAX_LIMIT + 4096;
/// The largest Envoy descriptor look-up: its values are header values as Envoy sends them (a
/// token can be several KiB), up to Envoy's default bound on a request's headers, 60 KiB.
const DESCRIPTOR_JSON_BYTES_MAX: usize = 64 * 1024;
/// The answer to an action on an account a move closed for good.
pub const MOVED: &str = "this account was closed for good when its caller moved to another plan: look the caller up by key for its account";

/// The configured secrets, as digests, and the wrong ones presented, by peer (a clone shares
/// them). `Debug` shows how many, never which.
#[derive(Clone)]
pub struct AdminSecrets {
    digests: Vec<[u8; 32]>,
    guesses: Arc<SecretGuesses>,
}

impl std::fmt::Debug for AdminSecrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AdminSecrets({} configured)", self.digests.len())
    }
}

fn digest(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

impl AdminSecrets {
    /// `Err` names the first bad secret's position (never the secret): too short, with spaces
    /// around it (a list written `"a, b"`: no bearer token carries them, so it could never be
    /// presented), or the same as an earlier one (who acted would be two secrets at once).
    pub fn new(secrets: &[String]) -> Result<Self, String> {
        let mut digests: Vec<[u8; 32]> = Vec::with_capacity(secrets.len());
        for (index, secret) in secrets.iter().enumerate() {
            let at = index + 1;
            if secret.len() < SECRET_LENGTH_MIN {
                return Err(format!(
                    "secret #{at} is shorter than {SECRET_LENGTH_MIN} bytes"
                ));
            }
            if secret.trim() != secret {
                return Err(format!("secret #{at} begins or ends with white space"));
            }
            let digest = digest(secret.as_bytes());
            if let Some(earlier) = digests.iter().position(|d| *d == digest) {
                return Err(format!("secret #{at} is secret #{} again", earlier + 1));
            }
            digests.push(digest);
        }
        Ok(AdminSecrets {
            digests,
            guesses: Arc::default(),
        })
    }

    pub fn is_empty(&self) -> bool {
        self.digests.is_empty()
    }

    /// Which secret (1-based) `presented` is, comparing against every one in constant time.
    pub fn who(&self, presented: &[u8]) -> Option<u64> {
        let presented = digest(presented);
        let mut found = 0u64;
        for (index, known) in self.digests.iter().enumerate() {
            let difference = known
                .iter()
                .zip(presented.iter())
                .fold(0u8, |acc, (a, b)| acc | (a ^ b));
            // Branch-free: keep the index where the difference is zero.
            let equal = u64::from(difference == 0);
            found |= equal * (index as u64 + 1);
        }
        (found != 0).then_some(found)
    }
}

/// What the admin handlers share.
pub struct AdminState {
    pub limiter: Arc<Limiter>,
    pub secrets: AdminSecrets,
    /// How the middleware names callers by their address (a lookup or move by `address`).
    pub rules: Arc<crate::http::rules::RequestRules>,
    /// The Envoy front end's accounts, when it is on (given by `startup`: this layer knows
    /// nothing of Envoy).
    pub envoy: Option<Arc<dyn DescriptorAccounts>>,
}

/// How the admin API finds the account of an Envoy descriptor (`/admin/envoy/lookup`).
pub trait DescriptorAccounts: Send + Sync {
    /// The account Envoy's calls with `entries` (key, value) in `domain` are charged to.
    fn find(&self, domain: &str, entries: Vec<(String, String)>) -> DescriptorFound;
}

/// What [`DescriptorAccounts::find`] found.
pub enum DescriptorFound {
    /// The request is not a descriptor a call could carry: why (a 400).
    Invalid(String),
    /// There is no account: why (a 404).
    NoAccount(String),
    Counted {
        /// The rule, as metrics name it (never a configured value).
        rule: String,
        account: crate::ledger::model::UserAccount,
        shadow_mode: bool,
    },
}

/// The admin routes, under `/admin`: one scope, which alone reads bodies up to the admin's bound
/// and answers its unknown paths (401 without a secret, else 404), so that an app mounting it
/// beside its own routes keeps its own 404s and JSON bounds (an App-level default service
/// answered every unknown path of the app as the admin API's, and counted it as a refused
/// secret). The bundled admin server answers paths outside `/admin` the same ([`unknown_path`]).
pub fn configure(config: &mut web::ServiceConfig) {
    metrics::describe_counter!(
        ADMIN_REFUSED_TOTAL,
        "Admin requests refused for their secret (missing or not accepted), by reason"
    );
    // Exported from the start at 0, as every closed label set is: an alert on its rate, or an
    // `absent()` check, sees a series before the first refusal. (`increment(0)` and
    // `absolute(0)` alike keep a count when a worker is made again: the exporter's `absolute`
    // keeps the larger value.)
    for reason in [MISSING_SECRET, WRONG_SECRET, THROTTLED] {
        metrics::counter!(ADMIN_REFUSED_TOTAL, "reason" => reason).increment(0);
    }
    // Only authorized requests get this far ([`Authorized`] comes first), so the fields' names
    // in a refusal of a body are not for strangers.
    let json = json_config(JSON_BYTES_MAX);
    // One resource per path, the fixed ones first: a method a path does not take is a 405 there,
    // not a match of the next pattern (`GET /admin/callers/lookup` was read as an account id).
    let resource = |path: &str, allow: &'static str| {
        web::resource(path).default_service(web::to(move |who| not_allowed(who, allow)))
    };
    let scope = web::scope("/admin")
        .app_data(json)
        .service(resource("/callers/lookup", "POST").route(web::post().to(lookup)))
        .service(resource("/callers/move", "POST").route(web::post().to(move_caller)))
        .service(
            resource("/envoy/lookup", "POST")
                .app_data(json_config(DESCRIPTOR_JSON_BYTES_MAX))
                .route(web::post().to(lookup_descriptor)),
        )
        .service(resource("/callers/{account_id}", "GET").route(web::get().to(inspect)))
        .service(resource("/callers/{account_id}/debit", "POST").route(web::post().to(reduce)))
        .service(resource("/callers/{account_id}/credit", "POST").route(web::post().to(top_up)))
        .service(
            resource("/callers/{account_id}/block", "POST, DELETE")
                .route(web::post().to(block))
                .route(web::delete().to(unblock)),
        )
        .default_service(web::to(not_found));
    config.service(scope);
}

/// How an admin request's JSON body is read: at most `bytes_max` (bodies are small), and a body
/// that is not what a handler takes is a problem+json like every other refusal: 413 when too
/// large, 415 when not JSON, else 400.
fn json_config(bytes_max: usize) -> web::JsonConfig {
    web::JsonConfig::default()
        .limit(bytes_max)
        .error_handler(|error, _| {
            let status = match &error {
                JsonPayloadError::Overflow { .. }
                | JsonPayloadError::OverflowKnownLength { .. } => StatusCode::PAYLOAD_TOO_LARGE,
                JsonPayloadError::ContentType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
                _ => StatusCode::BAD_REQUEST,
            };
            let response = admin_problem(status, &error.to_string());
            InternalError::from_response(error, response).into()
        })
}

/// A path of the admin API asked with a method it does not take: the methods it takes in
/// `Allow` (RFC 9110). Only for the secret's holders ([`Authorized`] first, a 401 for anyone
/// else), as is [`not_found`]: a stranger learns no path of the API.
async fn not_allowed(_: Authorized, allow: &'static str) -> HttpResponse {
    let mut response = admin_problem(
        StatusCode::METHOD_NOT_ALLOWED,
        "this path does not take that method",
    );
    let allow = actix_web::http::header::HeaderValue::from_static(allow);
    response
        .headers_mut()
        .insert(actix_web::http::header::ALLOW, allow);
    response
}

/// No such path in the admin API: a problem like every other answer.
/// The bundled admin server's answer to a path outside `/admin`: 401 without a secret, else 404.
pub fn unknown_path() -> actix_web::Route {
    web::to(not_found)
}

/// An unknown admin path: 401 without a secret (strangers learn no path), else 404.
async fn not_found(_: Authorized) -> HttpResponse {
    admin_problem(StatusCode::NOT_FOUND, "no such admin path")
}

/// Names the account's plan in its audit, when the configuration tells it unambiguously.
fn with_plan(mut audit: AccountAudit, state: &AdminState) -> AccountAudit {
    let window_seconds = audit.window_seconds;
    let plan = state
        .limiter
        .plans()
        .plan_with(audit.capacity, window_seconds);
    audit.plan = plan.map(|plan| plan.name().to_owned());
    audit
}

fn admin_problem(status: StatusCode, detail: &str) -> HttpResponse {
    problem::with_status(ProblemKind::Admin, status, detail)
}

/// Why an action conflicts with the caller's state (409): the problem's `cause` member, for
/// scripts, beside its `detail`, for people. Nine causes shared one type and differed only in
/// their English: a script could not tell "not enough credit" from "blocked".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Conflict {
    NotEnoughCredit,
    Blocked,
    Moved,
    KeyRefusedBefore,
    AlreadyBlocked,
    NotBlocked,
    SamePlan,
    MovedMeanwhile,
    MovedElsewhere,
    TargetBlocked,
}

impl Conflict {
    pub fn as_str(self) -> &'static str {
        match self {
            Conflict::NotEnoughCredit => "not_enough_credit",
            Conflict::Blocked => "blocked",
            Conflict::Moved => "moved",
            Conflict::KeyRefusedBefore => "key_refused_before",
            Conflict::AlreadyBlocked => "already_blocked",
            Conflict::NotBlocked => "not_blocked",
            Conflict::SamePlan => "same_plan",
            Conflict::MovedMeanwhile => "moved_meanwhile",
            Conflict::MovedElsewhere => "moved_elsewhere",
            Conflict::TargetBlocked => "target_blocked",
        }
    }
}

fn conflict(cause: Conflict, detail: &str) -> HttpResponse {
    let member = ("cause", cause.as_str());
    problem::with_member(ProblemKind::Admin, StatusCode::CONFLICT, detail, member)
}

/// Admin requests refused before any action, by reason (`missing_secret`, `wrong_secret`,
/// `throttled`).
pub const ADMIN_REFUSED_TOTAL: &str = "ledger_limiter_admin_refused_total";
/// [`ADMIN_REFUSED_TOTAL`]'s reasons: no bearer secret, or one not accepted.
const MISSING_SECRET: &str = "missing_secret";
const WRONG_SECRET: &str = "wrong_secret";
/// A peer past its budget of wrong secrets ([`SecretGuesses`]): refused before any comparison.
const THROTTLED: &str = "throttled";

/// The wall-clock second a refused admin request was last logged in.
static REFUSED_LOGGED_SECOND: AtomicU64 = AtomicU64::new(0);

/// Counts and logs (once a second at most, the peer's address alone: never what was presented)
/// an admin request refused for its secret. Unseen, a client guessing secrets, or one left with
/// a rotated-out secret, went unnoticed.
fn refused(req: &HttpRequest, reason: &'static str) {
    metrics::counter!(ADMIN_REFUSED_TOTAL, "reason" => reason).increment(1);
    if crate::telemetry::log_throttle(&REFUSED_LOGGED_SECOND) {
        let peer = req.peer_addr().map(|peer| peer.ip());
        tracing::warn!(?peer, reason, "an admin request was refused for its secret");
    }
}

/// The secret's number (who acted), or the 401/403 answer.
fn authorize(req: &HttpRequest, state: &AdminState) -> Result<u64, Box<HttpResponse>> {
    let bearer = req
        .headers()
        .get(AUTHORIZATION)
        .and_then(|v| headers::bearer_token(v.as_bytes()));
    let Some(presented) = bearer else {
        refused(req, MISSING_SECRET);
        let mut response = admin_problem(StatusCode::UNAUTHORIZED, "a bearer token is required");
        let challenge = HeaderValue::from_static("Bearer realm=\"ledger-limiter admin\"");
        response.headers_mut().insert(WWW_AUTHENTICATE, challenge);
        return Err(Box::new(response));
    };
    let (peer, now) = (req.peer_addr().map(|peer| peer.ip()), Instant::now());
    let guesses = &state.secrets.guesses;
    if let Some(wait) = guesses.refused_for(peer, now) {
        refused(req, THROTTLED);
        return Err(Box::new(throttled(wait)));
    }
    state.secrets.who(presented).ok_or_else(|| {
        guesses.wrong(peer, now);
        refused(req, WRONG_SECRET);
        Box::new(admin_problem(
            StatusCode::FORBIDDEN,
            "the bearer token is not accepted",
        ))
    })
}

/// A peer past its budget of wrong secrets: 429 until its window ends, whatever it presents
/// (a right secret among its guesses would otherwise be found at the rate a worker hashes).
fn throttled(wait: Duration) -> HttpResponse {
    let detail = format!(
        "{WRONG_SECRETS_PER_WINDOW_MAX} wrong secrets from this address within {} s: \
         refused until the window ends",
        GUESS_WINDOW.as_secs()
    );
    let mut response = admin_problem(StatusCode::TOO_MANY_REQUESTS, &detail);
    let seconds = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    let seconds = HeaderValue::from(seconds.max(1));
    response.headers_mut().insert(RETRY_AFTER, seconds);
    response
}

/// Who acts: the number of the secret presented. Every handler takes it first: actix extracts
/// a handler's arguments in order and stops at the first refusal, so a request without a valid
/// secret is answered 401/403 before its body is read or judged.
struct Authorized(u64);

impl FromRequest for Authorized {
    type Error = actix_web::Error;
    type Future = Ready<Result<Self, Self::Error>>;

    fn from_request(req: &HttpRequest, _: &mut Payload) -> Self::Future {
        let state = req.app_data::<web::Data<AdminState>>();
        let state = state.expect("the admin routes are served with their state");
        let authorized = authorize(req, state).map(Authorized).map_err(|response| {
            InternalError::from_response("admin authorization", *response).into()
        });
        ready(authorized)
    }
}

fn account_id(path: &str) -> Result<u128, Box<HttpResponse>> {
    let message = "an account id is 32 hex digits";
    let id = crate::ledger::model::parse_account_id(path)
        .ok_or_else(|| Box::new(admin_problem(StatusCode::BAD_REQUEST, message)))?;
    if !crate::ledger::model::is_caller_account_id(id) {
        let message = "no such caller: the operator's own accounts are not callers";
        return Err(Box::new(admin_problem(StatusCode::NOT_FOUND, message)));
    }
    Ok(id)
}

async fn inspect(
    _: Authorized,
    path: web::Path<String>,
    state: web::Data<AdminState>,
) -> HttpResponse {
    let id = match account_id(&path) {
        Ok(id) => id,
        Err(response) => return *response,
    };
    match state
        .limiter
        .ledger()
        .audit_caller(id, Instant::now() + DEADLINE)
        .await
    {
        Ok(Some(audit)) => HttpResponse::Ok().json(with_plan(audit, &state)),
        Ok(None) => admin_problem(StatusCode::NOT_FOUND, "no such account"),
        Err(error) => unavailable(&error),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Lookup {
    key: Option<String>,
    address: Option<String>,
}

/// Who a lookup or a move is about: `key` (an API key), or `address` (a caller known by its
/// address, under `caller.source = "peer-ip"` or `"header-or-peer-ip"`: without it, the callers
/// most often abusive could not be found nor moved, but by an id read from a trace).
fn caller_key(
    (key, address): (&Option<String>, &Option<String>),
    state: &AdminState,
) -> Result<CallerKey, Box<HttpResponse>> {
    let bad = |detail: &str| Box::new(admin_problem(StatusCode::BAD_REQUEST, detail));
    match (key, address) {
        (Some(key), None) => state
            .rules
            .operator_key(key.as_bytes())
            .map_err(|error| bad(&error.to_string())),
        (None, Some(address)) => {
            let ip = address.parse().map_err(|_| bad("not an IP address"))?;
            // Keys alone: an address names no caller here (its account would be one no
            // request is ever charged to).
            if let KeySource::Header(_) = state.rules.key_source() {
                return Err(bad(
                    "callers are known by their key here, not their address",
                ));
            }
            Ok(state.rules.address_key(ip))
        }
        _ => Err(bad("name the caller by one of `key` and `address`")),
    }
}

#[derive(Serialize)]
struct Found {
    account_id: String,
    plan: String,
}

/// A caller's account from its key (over this authenticated API only; the key is never logged).
async fn lookup(
    _: Authorized,
    body: web::Json<Lookup>,
    state: web::Data<AdminState>,
) -> HttpResponse {
    let key = match caller_key((&body.key, &body.address), &state) {
        Ok(key) => key,
        Err(response) => return *response,
    };
    // Following the caller's moves in the ledger: one made elsewhere closed the account its key
    // derives, and every action on that one would miss the caller.
    let deadline = Instant::now() + DEADLINE;
    match state.limiter.current_account(&key, deadline).await {
        Ok(Some((id, plan))) => HttpResponse::Ok().json(Found {
            account_id: format!("{id:032x}"),
            plan: plan.name().to_owned(),
        }),
        Ok(None) => admin_problem(StatusCode::NOT_FOUND, "the key has no plan"),
        Err(error) => unavailable(&error),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DescriptorLookup {
    domain: String,
    entries: Vec<DescriptorEntry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DescriptorEntry {
    key: String,
    value: String,
}

#[derive(Serialize)]
struct FoundDescriptor {
    account_id: String,
    rule: String,
    requests_per_unit: u64,
    window_seconds: u32,
    shadow_mode: bool,
}

/// The account an Envoy descriptor's calls are charged to, found as a call finds it, for the
/// caller routes (inspect, credit, debit, block) to act on. Without it an operator had no way to
/// name an Envoy caller's account: it derives from every entry of the descriptor. No ledger
/// call; the values (API keys, often) are never logged.
async fn lookup_descriptor(
    _: Authorized,
    body: web::Json<DescriptorLookup>,
    state: web::Data<AdminState>,
) -> HttpResponse {
    let Some(accounts) = &state.envoy else {
        return admin_problem(StatusCode::NOT_FOUND, "the Envoy front end is off here");
    };
    let DescriptorLookup { domain, entries } = body.into_inner();
    let entries = (entries.into_iter()).map(|e| (e.key, e.value)).collect();
    match accounts.find(&domain, entries) {
        DescriptorFound::Invalid(detail) => admin_problem(StatusCode::BAD_REQUEST, &detail),
        DescriptorFound::NoAccount(detail) => admin_problem(StatusCode::NOT_FOUND, &detail),
        DescriptorFound::Counted {
            rule,
            account,
            shadow_mode,
        } => HttpResponse::Ok().json(FoundDescriptor {
            account_id: format!("{:032x}", account.id),
            rule,
            requests_per_unit: account.capacity.get(),
            window_seconds: account.window_seconds.get(),
            shadow_mode,
        }),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Adjustment {
    amount: u64,
    reason: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Block {
    seconds: u32,
    reason: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Unblock {
    reason: String,
}

/// An unblock's reason: its JSON body's (`{"reason": …}`), or [`UNBLOCK_REASON_DEFAULT`] for a
/// request without a body (a bare `DELETE`). A body that is there is judged as any other.
struct UnblockReason(String);

impl FromRequest for UnblockReason {
    type Error = actix_web::Error;
    type Future = LocalBoxFuture<'static, Result<Self, Self::Error>>;

    fn from_request(req: &HttpRequest, payload: &mut Payload) -> Self::Future {
        // HTTP/1.1 without a length or a transfer coding has no body, whatever its type says
        // (`curl -X DELETE -H 'Content-Type: application/json'` sends none): it was a 400.
        let length = req.headers().get(CONTENT_LENGTH);
        let bodiless = req.headers().get(TRANSFER_ENCODING).is_none()
            && length.is_none_or(|length| length.as_bytes() == b"0");
        if bodiless {
            let reason = UnblockReason(UNBLOCK_REASON_DEFAULT.to_owned());
            return Box::pin(ready(Ok(reason)));
        }
        let body = web::Json::<Unblock>::from_request(req, payload);
        Box::pin(async move { Ok(UnblockReason(body.await?.into_inner().reason)) })
    }
}

/// Who acts and why: the secret's number, and the reason's SHA-256 (truncated) for the ledger.
fn actor(who: u64, reason: &str) -> Result<Actor, Box<HttpResponse>> {
    Actor::from_reason(who, reason).ok_or_else(|| {
        let detail = format!("reason must be 1-{REASON_LENGTH_MAX} bytes, no control characters");
        Box::new(admin_problem(StatusCode::BAD_REQUEST, &detail))
    })
}

fn amount(amount: u64) -> Result<u64, Box<HttpResponse>> {
    if amount == 0 || amount > AMOUNT_MAX {
        let detail = "amount must be between 1 and 2^40";
        return Err(Box::new(admin_problem(StatusCode::BAD_REQUEST, detail)));
    }
    Ok(amount)
}

/// A ledger failure's answer: 503 with `Retry-After: 1` (slow, failing over, down: a retry
/// with the same Idempotency-Key is safe), or 500 for an answer the ledger should never give,
/// which a retry would meet again.
fn unavailable(error: &LedgerError) -> HttpResponse {
    if error.kind() == LedgerErrorKind::Unexpected {
        return admin_problem(StatusCode::INTERNAL_SERVER_ERROR, &error.to_string());
    }
    let mut response = admin_problem(StatusCode::SERVICE_UNAVAILABLE, &error.to_string());
    let retry = HeaderValue::from_static("1");
    response.headers_mut().insert(RETRY_AFTER, retry);
    response
}

/// The account's audit after a change (200), or 200 without a body if it cannot be read now.
/// `act`: what the change did to the caller's block.
async fn changed(state: &AdminState, id: u128, act: BlockAct, deadline: Instant) -> HttpResponse {
    // This instance forgets what it knew; the others when they read the operator epoch (1 s).
    state.limiter.forget_acted_on(id, act);
    // The action may have spent its deadline: the audit that answers it has time of its own.
    let deadline = crate::ledger::follow_up_deadline(deadline);
    match state.limiter.ledger().audit_caller(id, deadline).await {
        Ok(Some(audit)) => HttpResponse::Ok().json(with_plan(audit, state)),
        _ => HttpResponse::Ok().finish(),
    }
}

fn adjusted_problem(adjusted: Adjusted) -> HttpResponse {
    match adjusted {
        Adjusted::Done | Adjusted::AlreadyDone => HttpResponse::Ok().finish(),
        Adjusted::NotEnoughCredit => conflict(
            Conflict::NotEnoughCredit,
            "the caller has less credit not held than that",
        ),
        // The ledger keeps a refused transfer's id for good: the key's retries would meet a 409
        // "refused before" once the account is made, unexplained.
        Adjusted::NoSuchAccount => admin_problem(
            StatusCode::NOT_FOUND,
            "no such account (a caller's account is made at its first request); this \
             Idempotency-Key is spent: a new one applies the adjustment once the account exists",
        ),
        Adjusted::Blocked => conflict(Conflict::Blocked, "the caller is blocked; unblock it first"),
        Adjusted::Moved => conflict(Conflict::Moved, MOVED),
        Adjusted::KeyReused => admin_problem(
            StatusCode::UNPROCESSABLE_ENTITY,
            "the Idempotency-Key names a different adjustment of this caller; nothing changed",
        ),
        Adjusted::KeyFailed => conflict(
            Conflict::KeyRefusedBefore,
            "the Idempotency-Key's adjustment was refused before; nothing changed: send it again \
             with a new key",
        ),
    }
}

/// The request's `Idempotency-Key`: a retry with the same key (after a 503, say, whose
/// transfer may have gone through) is the same adjustment, applied once. Required (400 without
/// one, as the IETF draft has it for an operation that requires it): a top-up retried without
/// one, by a client's timeout or `curl --retry`, was applied twice. 400 if malformed.
struct Once(IdempotencyKey);

impl FromRequest for Once {
    type Error = actix_web::Error;
    type Future = Ready<Result<Self, Self::Error>>;

    fn from_request(req: &HttpRequest, _: &mut Payload) -> Self::Future {
        let key = req.headers().get(IDEMPOTENCY_KEY);
        ready(
            match key.map(|value| IdempotencyKey::new(value.as_bytes())) {
                Some(Some(key)) => Ok(Once(key)),
                found => {
                    let detail = match found {
                        None => "an Idempotency-Key header is required (your name for this \
                             adjustment: send it again with the same one, and it is applied once)"
                            .to_owned(),
                        Some(_) => format!(
                            "Idempotency-Key must be 1-{IDEMPOTENCY_KEY_LENGTH_MAX} visible ASCII \
                         characters"
                        ),
                    };
                    let response = admin_problem(StatusCode::BAD_REQUEST, &detail);
                    Err(InternalError::from_response("idempotency key", response).into())
                }
            },
        )
    }
}

/// Takes credit from a caller for good (`reduce: true`, abuse, a refund owed to us) or gives it
/// more for good (a top-up: a higher limit per window). Only credit not held can be taken (409).
async fn adjust(
    (Authorized(who), Once(once)): (Authorized, Once),
    path: &str,
    body: &Adjustment,
    state: &AdminState,
    reduce: bool,
) -> Result<HttpResponse, Box<HttpResponse>> {
    let id = account_id(path)?;
    let amount = amount(body.amount)?;
    let actor = actor(who, &body.reason)?;
    let deadline = Instant::now() + DEADLINE;
    let ledger = state.limiter.ledger();
    let result = if reduce {
        ledger
            .reduce_credit(id, amount, (actor, Some(&once)), deadline)
            .await
    } else {
        ledger
            .top_up(id, amount, (actor, Some(&once)), deadline)
            .await
    };
    match result {
        Ok(done @ (Adjusted::Done | Adjusted::AlreadyDone)) => {
            // The log is the service's record of operators' actions: a retry is not a second one.
            let action = match (reduce, done == Adjusted::AlreadyDone) {
                (true, false) => "credit reduced",
                (false, false) => "credit topped up",
                (true, true) => "credit reduction retried: applied before, nothing changed",
                (false, true) => "credit top-up retried: applied before, nothing changed",
            };
            tracing::info!(account_id = %format_args!("{id:032x}"), amount, secret = who, reason = %body.reason, "{action}");
            // Done: the ledger took a transfer on the account, so it is open (a closed one
            // refuses it, `Adjusted::Blocked`). A retry's proves nothing now.
            let act = match done {
                Adjusted::Done => BlockAct::Lifted,
                _ => BlockAct::Unchanged,
            };
            Ok(changed(state, id, act, deadline).await)
        }
        Ok(other) => Ok(adjusted_problem(other)),
        Err(error) => Ok(unavailable(&error)),
    }
}

async fn reduce(
    who: Authorized,
    once: Once,
    path: web::Path<String>,
    body: web::Json<Adjustment>,
    state: web::Data<AdminState>,
) -> HttpResponse {
    adjust((who, once), &path, &body, &state, true)
        .await
        .unwrap_or_else(|response| *response)
}

async fn top_up(
    who: Authorized,
    once: Once,
    path: web::Path<String>,
    body: web::Json<Adjustment>,
    state: web::Data<AdminState>,
) -> HttpResponse {
    adjust((who, once), &path, &body, &state, false)
        .await
        .unwrap_or_else(|response| *response)
}

/// Refuses every request of the caller, on every instance, for `seconds` (403 with Retry-After),
/// or until unblocked. The caller's holds still expire as usual.
async fn block(
    Authorized(who): Authorized,
    path: web::Path<String>,
    body: web::Json<Block>,
    state: web::Data<AdminState>,
) -> HttpResponse {
    let blocked = async {
        let id = account_id(&path)?;
        if body.seconds == 0 || body.seconds > BLOCK_SECONDS_MAX {
            let detail = format!("seconds must be between 1 and {BLOCK_SECONDS_MAX}");
            return Err(Box::new(admin_problem(StatusCode::BAD_REQUEST, &detail)));
        }
        let actor = actor(who, &body.reason)?;
        let deadline = Instant::now() + DEADLINE;
        let ledger = state.limiter.ledger();
        Ok(
            match ledger.block(id, body.seconds, actor, deadline).await {
                Ok(Blocking::Done { .. }) => {
                    tracing::info!(account_id = %format_args!("{id:032x}"), seconds = body.seconds, secret = who, reason = %body.reason, "caller blocked");
                    let until = Instant::now() + Duration::from_secs(body.seconds.into());
                    changed(&state, id, BlockAct::Blocked(until), deadline).await
                }
                Ok(Blocking::AlreadyBlocked) => {
                    state.limiter.forget_local(id);
                    conflict(Conflict::AlreadyBlocked, "the caller is blocked already")
                }
                Ok(Blocking::Moved) => conflict(Conflict::Moved, MOVED),
                Ok(Blocking::NoSuchAccount) => {
                    admin_problem(StatusCode::NOT_FOUND, "no such account")
                }
                Err(error) => unavailable(&error),
            },
        )
    };
    blocked.await.unwrap_or_else(|response| *response)
}

/// Ends a block now.
async fn unblock(
    Authorized(who): Authorized,
    path: web::Path<String>,
    UnblockReason(reason): UnblockReason,
    state: web::Data<AdminState>,
) -> HttpResponse {
    let (id, actor) = match account_id(&path).and_then(|id| Ok((id, actor(who, &reason)?))) {
        Ok(found) => found,
        Err(response) => return *response,
    };
    let deadline = Instant::now() + DEADLINE;
    match state.limiter.ledger().unblock(id, actor, deadline).await {
        Ok(Unblocking::Done) => {
            tracing::info!(account_id = %format_args!("{id:032x}"), secret = who, reason = %reason, "caller unblocked");
            changed(&state, id, BlockAct::Lifted, deadline).await
        }
        Ok(Unblocking::NotBlocked) => {
            // A retry of an unblock that was done: this instance forgets the block too.
            state.limiter.forget_acted_on(id, BlockAct::Lifted);
            conflict(Conflict::NotBlocked, "the caller is not blocked")
        }
        Ok(Unblocking::Moved) => conflict(Conflict::Moved, MOVED),
        Ok(Unblocking::NoSuchAccount) => admin_problem(StatusCode::NOT_FOUND, "no such account"),
        Err(error) => unavailable(&error),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Move {
    key: Option<String>,
    address: Option<String>,
    plan: String,
    reason: String,
}

/// Moves a caller (by key: the new plan's account derives from it) to another plan, carrying
/// what it holds, so the move gives it no fresh credit. Every instance follows the move.
async fn move_caller(
    Authorized(who): Authorized,
    body: web::Json<Move>,
    state: web::Data<AdminState>,
) -> HttpResponse {
    use crate::limiter::moves::MoveError;
    let moved = async {
        let actor = actor(who, &body.reason)?;
        let key = caller_key((&body.key, &body.address), &state)?;
        let deadline = Instant::now() + DEADLINE;
        let result = state
            .limiter
            .move_caller(&key, &body.plan, actor, deadline)
            .await;
        Ok(match result {
            Ok(report) => {
                tracing::info!(from = %report.from_account_id, to = %report.to_account_id, plan = %report.to_plan, carried = report.carried, secret = who, reason = %body.reason, "caller moved");
                HttpResponse::Ok().json(report)
            }
            Err(error) => {
                let (status, cause) = match error {
                    MoveError::UnknownPlan(_) => (StatusCode::BAD_REQUEST, None),
                    MoveError::UnknownKey | MoveError::NoSuchAccount => {
                        (StatusCode::NOT_FOUND, None)
                    }
                    MoveError::SamePlan(_) => (StatusCode::CONFLICT, Some(Conflict::SamePlan)),
                    MoveError::Blocked => (StatusCode::CONFLICT, Some(Conflict::Blocked)),
                    MoveError::TargetBlocked { .. } => {
                        (StatusCode::CONFLICT, Some(Conflict::TargetBlocked))
                    }
                    MoveError::MovedMeanwhile => {
                        (StatusCode::CONFLICT, Some(Conflict::MovedMeanwhile))
                    }
                    MoveError::LostTrack => (StatusCode::CONFLICT, Some(Conflict::MovedElsewhere)),
                    MoveError::Ledger(error) => return Ok(unavailable(&error)),
                };
                match cause {
                    Some(cause) => conflict(cause, &error.to_string()),
                    None => admin_problem(status, &error.to_string()),
                }
            }
        })
    };
    moved
        .await
        .unwrap_or_else(|response: Box<HttpResponse>| *response)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_found_by_digest_and_never_shown() {
        let secrets =
            AdminSecrets::new(&["first-secret-0123456".into(), "second-secret-012345".into()])
                .unwrap();
        assert_eq!(secrets.who(b"first-secret-0123456"), Some(1));
        assert_eq!(secrets.who(b"second-secret-012345"), Some(2));
        assert_eq!(secrets.who(b"second-secret-01234"), None);
        assert_eq!(secrets.who(b""), None);
        let shown = format!("{secrets:?}");
        assert!(!shown.contains("secret-"), "{shown}");
        assert!(AdminSecrets::new(&["short".into()])
            .unwrap_err()
            .contains("#1"));
        let first = "first-secret-0123456".to_owned();
        let refused = |secrets: &[String]| AdminSecrets::new(secrets).unwrap_err();
        let twice = refused(&[first.clone(), "other-secret-0123456".into(), first.clone()]);
        assert_eq!(twice, "secret #3 is secret #1 again");
        let spaced = refused(&[first.clone(), format!(" {first}")]);
        assert_eq!(spaced, "secret #2 begins or ends with white space");
    }

    /// A ledger that is slow or down is worth a retry, a second on; an answer it should never
    /// give is not (a retry meets it again).
    #[test]
    fn ledger_failures_answer_503_with_retry_after_and_unexpected_ones_500() {
        use crate::ledger::metrics::Operation;
        let timeout = unavailable(&LedgerError::Timeout {
            operation: Operation::CreateTransfers,
        });
        assert_eq!(timeout.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(timeout.headers().get(RETRY_AFTER).unwrap(), "1");
        let unexpected = unavailable(&LedgerError::Unexpected {
            operation: Operation::CreateTransfers,
            message: "ExceedsDebits".into(),
        });
        assert_eq!(unexpected.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert!(unexpected.headers().get(RETRY_AFTER).is_none());
    }

    #[test]
    fn the_bearer_scheme_is_named_in_any_case() {
        let token = headers::bearer_token;
        assert_eq!(token(b"Bearer abc"), Some(&b"abc"[..]));
        assert_eq!(token(b"bearer abc"), Some(&b"abc"[..]));
        assert_eq!(token(b"BEARER  abc"), Some(&b"abc"[..]));
        assert_eq!(token(b"Bearer "), None);
        assert_eq!(token(b"Basic abc"), None);
        assert_eq!(token(b"Bearerabc"), None);
        assert_eq!(token(b""), None);
    }

    #[test]
    fn account_ids_are_32_hex_digits() {
        assert!(account_id("80000000000000000000000000000001").is_ok());
        assert!(account_id("0x80000000000000000000000000000001").is_ok());
        assert!(account_id("0x0x80000000000000000000000000000001").is_err());
        // The operator's own accounts (top bit clear) are no caller's.
        assert!(account_id("00000000000000000000000000000001").is_err());
        assert!(account_id("1").is_err());
        assert!(account_id("zz000000000000000000000000000001").is_err());
    }
}
