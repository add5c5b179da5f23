//! # ledger-limiter
//!
//! An exact, durable, distributed rate limiter for actix-web whose book-keeping lives in
//! TigerBeetle. Every request places a *pending* transfer (a hold) from the caller's account to the
//! operator's; the account cannot go below zero (`debits_must_not_exceed_credits`), so when its
//! credit is all held the ledger answers `exceeds_credits` and the request is limited. Holds expire
//! after the plan's window and their credit returns. See `docs/ARCHITECTURE.md`.
//!
//! The layers, each depending only on the ones below it:
//! - [`startup`] and [`config`]: wiring and validated settings (the binary's concern);
//! - [`http`]: the actix-web adapter ([`http::RateLimit`], [`http::RequestRules`]); beside it,
//!   [`envoy`]: Envoy's rate-limit service (gRPC), a second adapter over the same decision;
//! - [`limiter`]: one decision, "limited" being a value, never an error; plans, caller keys, the
//!   local view;
//! - [`ledger`]: every TigerBeetle call, each with a deadline and a bound; the model; the embedded
//!   server.
//!
//! [`telemetry`] stands beside them: the request span and the OTLP export.

pub mod config;
pub mod envoy;
pub mod http;
pub mod ledger;
pub mod limiter;
pub mod outstanding;
pub mod startup;
mod sync;
pub mod telemetry;

/// The README's Rust examples compile as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
