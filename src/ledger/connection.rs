//! One TigerBeetle client and the addresses it was made for, and how a replaced one closes.
//!
//! Why replaced clients need closing: [`super::Ledger::reconnect`] swaps in a client for new
//! addresses when a replica comes back elsewhere. Calls already sent on the old client wait for its
//! answer, and a client whose replicas are gone never answers (it retries forever). Each such call
//! kept a place under the in-flight bound, and the old client (its I/O thread, its buffers) with
//! it: a few reconnects with calls in flight could leave every place taken, and the instance
//! refusing all it decides. So a replaced connection is *retired*: its calls still unanswered
//! [`RETIRED_CALLS_GRACE`] later (and past their own deadlines) are given up, which gives their
//! places back; once nothing uses it, the client is closed on a thread of its own
//! ([`close_unused`]), as closing joins its I/O thread.
//!
//! A given-up call's outcome is unknown, as a timeout's is: a hold it placed expires on its own
//! timeout, so nothing is admitted that was not paid for.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tigerbeetle_unofficial as tb;
use tokio::sync::watch;

use super::ConnectError;

/// When a failed void of abandoned holds was last logged (seconds since the epoch).
static VOID_FAILURE_LOGGED_SECOND: AtomicU64 = AtomicU64::new(0);

/// How long a replaced client's unanswered calls still get, once their callers have left: a
/// client that can reach its cluster answers in milliseconds, one that cannot never does.
pub const RETIRED_CALLS_GRACE: Duration = Duration::from_secs(5);

/// Replaced clients still closing above which each reconnect says so in the log. Each closes
/// within [`RETIRED_CALLS_GRACE`] of its callers' deadlines, so more means addresses that change
/// faster than clients close, or something keeping them. The reconnect still happens: staying
/// on addresses known to be wrong would refuse (or admit) every request.
pub const RETIRED_CLIENTS_MAX: usize = 8;

pub(crate) struct Connection {
    pub(crate) client: Arc<tb::Client>,
    pub(crate) addresses: Vec<SocketAddr>,
    /// When another connection replaced this one; `None` while it is the one in use.
    retired: watch::Sender<Option<Instant>>,
    /// The client can send nothing more ([`is_client_gone`]): the next call replaces it.
    gone: AtomicBool,
}

/// Whether `error` says the client can send nothing more: the cluster evicted its session
/// (more clients than the cluster keeps sessions for, a release it no longer serves), or it was
/// closed. Why it matters: from then on the client takes calls and never answers them (the
/// crate drops a submit the C client refuses), so every call would wait out its deadline and
/// keep its in-flight place for good.
pub(crate) fn is_client_gone(error: &(dyn std::error::Error + 'static)) -> bool {
    use tb::error::{SendError, SendErrorKind as K};
    let send = error
        .downcast_ref::<SendError>()
        .or_else(|| error.source()?.downcast_ref::<SendError>());
    send.is_some_and(|send| {
        matches!(
            send.kind(),
            K::ClientEvicted | K::ClientReleaseTooLow | K::ClientReleaseTooHigh | K::ClientShutdown
        )
    })
}

impl Connection {
    pub(crate) fn new(cluster_id: u128, addresses: &[SocketAddr]) -> Result<Self, ConnectError> {
        if addresses.is_empty() {
            return Err(ConnectError::NoAddresses);
        }
        let list = addresses
            .iter()
            .map(|a| a.to_string())
            .collect::<Vec<_>>()
            .join(",");
        let client =
            tb::Client::new(cluster_id, list).map_err(|e| ConnectError::Client(e.to_string()))?;
        Ok(Connection {
            client: Arc::new(client),
            addresses: addresses.to_vec(),
            retired: watch::Sender::new(None),
            gone: AtomicBool::new(false),
        })
    }

    /// Marks the client as able to send nothing more (see [`is_client_gone`]).
    pub(crate) fn mark_gone(&self) {
        self.gone.store(true, Ordering::Relaxed);
    }

    pub(crate) fn is_gone(&self) -> bool {
        self.gone.load(Ordering::Relaxed)
    }

    /// Marks this connection replaced: its calls that nobody waits for any more are given up
    /// [`RETIRED_CALLS_GRACE`] from now.
    pub(crate) fn retire(&self) {
        self.retired.send_replace(Some(Instant::now()));
    }

    /// The rest of a call on this connection's client whose callers have all left: its answer, or
    /// `None` once the connection has been retired and its callers gone for
    /// [`RETIRED_CALLS_GRACE`] without one (from the later of the two: counted from the retiring
    /// alone, a call whose caller waited out a deadline longer than the grace got none, and its
    /// hold, landing a moment later, was never voided). On the connection in use, it waits for
    /// the answer as long as the client does.
    ///
    /// Only for calls nobody waits for: so the calls answered in time (nearly all) never pay
    /// for the watch.
    pub(crate) async fn unless_given_up<F: Future>(&self, call: F) -> Option<F::Output> {
        let left = Instant::now();
        let mut retired = self.retired.subscribe();
        let given_up = async move {
            let at = *retired
                .wait_for(Option::is_some)
                .await
                .expect("the connection, and so its sender, outlives this call");
            let at = at.expect("waited for");
            tokio::time::sleep_until((at.max(left) + RETIRED_CALLS_GRACE).into()).await;
        };
        tokio::select! {
            biased;
            answer = call => Some(answer),
            () = given_up => None,
        }
    }

    /// [`Connection::void_abandoned`] in a task of its own, from code that cannot wait (a drop,
    /// a call's task that has answered). Outside a runtime (a future dropped after its runtime
    /// ended) there is nothing to run it on: the holds expire after their timeout.
    pub(crate) fn void_abandoned_later(self: Arc<Self>, voids: Vec<tb::Transfer>) {
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move { self.void_abandoned(voids).await });
        }
    }

    /// Voids holds that landed after their callers left. Best effort: a hold not voided expires
    /// after its timeout. Nobody waits for it, so it is given up like any such call.
    pub(crate) async fn void_abandoned(&self, voids: Vec<tb::Transfer>) {
        let void = self.client.create_transfers(voids);
        let Some(Err(error)) = self.unless_given_up(void).await else {
            return;
        };
        // Evicted: no other call may be in flight to tell (every later one then timed out).
        if is_client_gone(&error) {
            self.mark_gone();
        }
        // At most once a second: a slow ledger fails every batch's.
        if crate::telemetry::log_throttle(&VOID_FAILURE_LOGGED_SECOND) {
            tracing::warn!(%error, "could not void every hold whose callers left (one may have ended already); those not voided expire (logged at most once a second)");
        }
    }
}

/// Closes the retired connections nothing uses any more (the caller's list holds the last
/// reference): on a thread of its own, as closing a client joins its I/O thread, which must not
/// stall a runtime's worker.
pub(crate) fn close_unused(retired: &mut Vec<Arc<Connection>>) {
    let (unused, busy): (Vec<_>, Vec<_>) = retired
        .drain(..)
        .partition(|c| Arc::strong_count(c) == 1 && Arc::strong_count(&c.client) == 1);
    *retired = busy;
    if unused.is_empty() {
        return;
    }
    let closing = std::thread::Builder::new()
        .name("ledger-close".to_owned())
        .spawn(move || drop(unused));
    if let Err(error) = closing {
        // The closure, and with it the clients, was dropped here: closed on this thread instead.
        tracing::warn!(%error, "closed replaced ledger clients on a runtime thread");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client retired longer ago than the grace still gives a call whose callers just left its
    /// grace: counted from the retiring, it had none, and a hold landing a moment later was
    /// never voided.
    #[tokio::test]
    async fn a_call_left_after_the_retiring_gets_its_whole_grace() {
        let address: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let connection = Connection::new(0, &[address]).unwrap();
        let long_ago = Instant::now() - RETIRED_CALLS_GRACE - Duration::from_secs(1);
        connection.retired.send_replace(Some(long_ago));
        let answer = tokio::time::sleep(Duration::from_millis(20));
        assert_eq!(connection.unless_given_up(answer).await, Some(()));
        // A call that never answers is still given up (the grace from when its callers left).
        let given_up = tokio::time::timeout(
            RETIRED_CALLS_GRACE + Duration::from_secs(2),
            connection.unless_given_up(std::future::pending::<()>()),
        );
        assert_eq!(given_up.await, Ok(None));
    }
}
