//! Single transfers sent together: the requests one thread has ready at once share one
//! `create_transfers` call.
//!
//! Why: the TigerBeetle client runs its own I/O thread. Each call is a submit to that thread and a
//! completion that wakes the caller's thread, two cross-thread wake-ups (and their context
//! switches) per request. They, not the ledger, made most of an admitted request's CPU. The
//! client already packs concurrent calls into one request to the cluster; this packs them
//! before they cross threads, so a batch of n holds costs two wake-ups instead of 2n.
//!
//! How: the first transfer a thread sends opens a batch and spawns one task for it. That task
//! yields once (every request this thread has ready joins meanwhile), sends the batch and hands
//! each transfer its own result. Results are per event, as TigerBeetle gives them: a batch is n
//! independent transfers, never a linked chain (those keep their own calls). Bounded:
//! [`BATCH_TRANSFERS_MAX`] transfers per call.
//!
//! The batch's task, not the request, owns what must outlive a request that stops waiting: each
//! member's in-flight permit (given back when the ledger answers) and, for a hold, the void that
//! gives its credit back if it lands after its caller left. So a request waits on a channel and
//! its deadline only: one task per batch, not one per request.

use std::cell::RefCell;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tb::error::CreateTransferErrorKind;
use tigerbeetle_unofficial as tb;
use tokio::sync::oneshot;

use super::metrics::Operation;
use super::{client_error, model, InFlight, LedgerError};
use crate::sync::lock;

/// Transfers per call: well under a development-mode cluster's 32 KiB request (about 255).
pub const BATCH_TRANSFERS_MAX: usize = 128;

/// One transfer's result: `None` when created.
pub type TransferResult = Result<Option<CreateTransferErrorKind>, LedgerError>;

struct Batch {
    client: Arc<tb::Client>,
    transfers: Vec<tb::Transfer>,
    members: Vec<Member>,
    /// Taken to be sent: nothing may join any more.
    sent: bool,
}

/// One transfer's caller, as the batch sees it.
struct Member {
    reply: oneshot::Sender<TransferResult>,
    /// Held until the ledger answers: the in-flight bound counts calls at the ledger, not
    /// callers still waiting.
    _in_flight: InFlight,
    /// A hold created after its caller stopped waiting is voided with this code.
    void_if_abandoned: Option<u16>,
}

/// What a transfer's caller leaves with the batch ([`create_transfer`]).
pub struct Leave {
    pub in_flight: InFlight,
    pub void_if_abandoned: Option<u16>,
}

thread_local! {
    /// The batch this thread is filling (the task its first transfer spawned sends it after one
    /// yield).
    static FILLING: RefCell<Option<Arc<Mutex<Batch>>>> = const { RefCell::new(None) };
}

/// Creates `transfer` (not linked) in the batch this thread is filling; the result is its own,
/// waited for until `deadline` at most (`Timeout` after it). What `leave` holds stays with the
/// batch until the ledger answers.
pub async fn create_transfer(
    client: Arc<tb::Client>,
    transfer: tb::Transfer,
    leave: Leave,
    deadline: Instant,
) -> TransferResult {
    assert!(
        !transfer.flags().contains(tb::transfer::Flags::LINKED),
        "a linked chain is not a batch of independent transfers"
    );
    let (reply, result) = oneshot::channel();
    let member = Member {
        reply,
        _in_flight: leave.in_flight,
        void_if_abandoned: leave.void_if_abandoned,
    };
    if let Some(opened) = join_or_open(client, transfer, member) {
        tokio::spawn(async move {
            // Every request this thread has ready gets to join before the batch goes.
            tokio::task::yield_now().await;
            send(&opened).await;
        });
    }
    let Ok(answer) = tokio::time::timeout_at(deadline.into(), result).await else {
        let operation = Operation::CreateTransfers;
        return Err(LedgerError::Timeout { operation });
    };
    answer.unwrap_or_else(|_| {
        Err(LedgerError::Unexpected {
            operation: Operation::CreateTransfers,
            message: "a batch ended without an answer".to_owned(),
        })
    })
}

/// Joins this thread's open batch when it is for the same client and has room; else opens one
/// (returned: the caller has it sent).
fn join_or_open(
    client: Arc<tb::Client>,
    transfer: tb::Transfer,
    member: Member,
) -> Option<Arc<Mutex<Batch>>> {
    FILLING.with(|filling| {
        let mut filling = filling.borrow_mut();
        if let Some(open) = filling.as_ref() {
            let mut batch = lock(open);
            let fits = !batch.sent && batch.transfers.len() < BATCH_TRANSFERS_MAX;
            if fits && Arc::ptr_eq(&batch.client, &client) {
                batch.transfers.push(transfer);
                batch.members.push(member);
                return None;
            }
        }
        let opened = Arc::new(Mutex::new(Batch {
            client,
            transfers: vec![transfer],
            members: vec![member],
            sent: false,
        }));
        *filling = Some(opened.clone());
        Some(opened)
    })
}

/// Sends the batch (closed to newcomers first) and answers each of its transfers; voids the
/// holds that landed after their callers left.
async fn send(opened: &Arc<Mutex<Batch>>) {
    let (client, transfers, members) = {
        let mut batch = lock(opened);
        assert!(!batch.sent);
        batch.sent = true;
        let transfers = std::mem::take(&mut batch.transfers);
        let members = std::mem::take(&mut batch.members);
        (batch.client.clone(), transfers, members)
    };
    // Whichever thread this task runs on, its own open batch is another one: leave it.
    FILLING.with(|filling| {
        let mut filling = filling.borrow_mut();
        if filling
            .as_ref()
            .is_some_and(|open| Arc::ptr_eq(open, opened))
        {
            *filling = None;
        }
    });
    assert_eq!(transfers.len(), members.len());
    let count = transfers.len();
    let ids: Vec<(u128, u32)> = transfers.iter().map(|t| (t.id(), t.ledger())).collect();
    let results = results(client.create_transfers(transfers).await, count);
    let mut voids = Vec::new();
    for ((member, result), (id, ledger_id)) in members.into_iter().zip(results).zip(ids) {
        let created = matches!(result, Ok(None));
        let left = member.reply.send(result).is_err();
        if let (true, true, Some(code)) = (left, created, member.void_if_abandoned) {
            voids.push(model::void_transfer(id, ledger_id).with_code(code));
        }
        // The member's in-flight permit goes here: the ledger has answered.
    }
    if !voids.is_empty() {
        // Best effort: if it fails, the holds still expire after their timeouts.
        if let Err(error) = client.create_transfers(voids).await {
            tracing::warn!(%error, "could not void holds whose callers left; they will expire");
        }
    }
}

/// Each transfer's result from the call's.
fn results(
    answer: Result<(), tb::error::CreateTransfersError>,
    count: usize,
) -> Vec<TransferResult> {
    match answer {
        Ok(()) => vec![Ok(None); count],
        Err(tb::error::CreateTransfersError::Api(errors)) => {
            let mut kinds: Vec<TransferResult> = vec![Ok(None); count];
            for error in errors.as_slice() {
                // An index outside the batch would be the client's bug: that transfer's caller
                // gets no kind, the others theirs.
                if let Some(kind) = kinds.get_mut(error.index() as usize) {
                    *kind = Ok(Some(error.kind()));
                }
            }
            kinds
        }
        Err(error) => {
            let error = client_error(Operation::CreateTransfers, error);
            vec![Err(error); count]
        }
    }
}
