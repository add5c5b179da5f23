//! The actix-web adapter: request → [`Classified`](rules::Classified) → the limiter's decision →
//! response. Everything HTTP lives here (headers, problem bodies, the demo routes, the request
//! latency histogram with exemplars); the decision itself does not know about HTTP.

pub mod admin;
pub mod client_ip;
pub mod concurrency;
pub mod guesses;
pub mod headers;
pub mod middleware;
/// Kept at its old path: it serves the ledger's background work too now.
pub use crate::outstanding;
pub mod problem;
mod repeats;
pub mod request_metrics;
pub mod respond;
pub mod routes;
pub mod rules;
pub mod slot_body;

pub use client_ip::ForwardedHeader;
pub use concurrency::{ConcurrencyLimits, SlotRefused};
pub use middleware::RateLimit;
pub use rules::{KeySource, RequestRules, RequestRulesBuilder, RulesError};
