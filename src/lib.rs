//! # ledger-limiter
//!
//! An exact, durable, distributed rate limiter for actix-web whose book-keeping lives in
//! TigerBeetle. Every request places a *pending* transfer (a hold) from the caller's account to the
//! operator's; the account cannot go below zero (`debits_must_not_exceed_credits`), so when its
//! credit is all held the ledger answers `exceeds_credits` and the request is limited. Holds expire
//! after the plan's window and their credit returns. See `docs/ARCHITECTURE.md`.
//!
//! The pieces, from the outside in:
//! - [`middleware::RateLimit`]: the actix-web middleware (`.wrap()` it around any app or scope);
//! - [`limiter::Limiter`]: one decision, "limited" being a value, never an error;
//! - [`ledger::Ledger`]: every TigerBeetle call, each with a deadline and a bound;
//! - [`plan`], [`caller`], [`config`]: plans, keys, validated settings.

pub mod caller;
pub mod config;
pub mod headers;
pub mod http_metrics;
pub mod ledger;
pub mod limiter;
pub mod local_view;
pub mod metrics;
pub mod middleware;
pub mod plan;
pub mod problem;
pub mod routes;
pub mod startup;
pub mod supervisor;
pub mod telemetry;

/// The README's Rust examples compile as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
