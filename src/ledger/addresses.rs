//! Following the replicas' addresses. The TigerBeetle client takes IP addresses, so host names are
//! resolved before it is made; a replica that comes back elsewhere (a recreated container with a
//! new IP) would leave the client talking to nobody. [`follow_addresses`] resolves them again
//! periodically and reconnects when the answer changes, with no restart.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use super::Ledger;

/// How often host names are resolved again: about a DNS TTL; a failover inside the cluster needs
/// no resolution at all (the client knows every replica).
pub const RESOLVE_INTERVAL: Duration = Duration::from_secs(5);

static RESOLVE_FAILURE_LOGGED_SECOND: AtomicU64 = AtomicU64::new(0);

/// Every `every`, asks `resolve` for the addresses and points `ledger` at them if they changed.
/// A failed resolution keeps the current addresses. Runs until its task is dropped or aborted.
pub async fn follow_addresses<F, Fut, E>(ledger: Ledger, every: Duration, mut resolve: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Vec<SocketAddr>, E>>,
    E: std::fmt::Display,
{
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        // First, and whether or not the names resolve: a replaced client's calls end on their own.
        ledger.close_replaced_clients();
        // Bounded: a resolver that does not answer (glibc retries each name server for
        // seconds) would hold up the next look and the closing of replaced clients.
        let error = match tokio::time::timeout(every, resolve()).await {
            Ok(Ok(addresses)) => match ledger.reconnect(&addresses) {
                Ok(true) => {
                    tracing::info!(?addresses, "the ledger's addresses changed; reconnected");
                    continue;
                }
                Ok(false) => continue,
                Err(error) => error.to_string(),
            },
            Ok(Err(error)) => error.to_string(),
            Err(_) => format!("no answer from the resolver within {every:?}"),
        };
        if crate::telemetry::log_throttle(&RESOLVE_FAILURE_LOGGED_SECOND) {
            tracing::warn!(%error, "cannot follow the ledger's addresses; keeping the current ones");
        }
    }
}
