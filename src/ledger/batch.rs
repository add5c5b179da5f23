//! Single transfers sent together: the requests one thread has ready at once share one
//! `create_transfers` call.
//!
//! Why: the TigerBeetle client runs its own I/O thread. Each call is a submit to that thread and a
//! completion that wakes the caller's thread, two cross-thread wake-ups (and their context
//! switches) per request. They, not the ledger, made most of an admitted request's CPU. The
//! client already packs concurrent calls into one request to the cluster; this packs them
//! before they cross threads, so a batch of n holds costs two wake-ups instead of 2n.
//!
//! How: the first transfer a thread sends opens a batch and, after one yield (every request this
//! thread has ready joins meanwhile), sends it and hands each transfer its own result. Results
//! are per event, as TigerBeetle gives them: a batch is n independent transfers, never a linked
//! chain (those keep their own calls). Bounded: [`BATCH_TRANSFERS_MAX`] transfers per call.

use std::cell::RefCell;
use std::sync::{Arc, Mutex, MutexGuard};

use tb::error::CreateTransferErrorKind;
use tigerbeetle_unofficial as tb;
use tokio::sync::oneshot;

use super::metrics::Operation;
use super::{client_error, LedgerError};

/// Transfers per call: well under a development-mode cluster's 32 KiB request (about 255).
pub const BATCH_TRANSFERS_MAX: usize = 128;

/// One transfer's result: `None` when created.
pub type TransferResult = Result<Option<CreateTransferErrorKind>, LedgerError>;

struct Batch {
    client: Arc<tb::Client>,
    transfers: Vec<tb::Transfer>,
    replies: Vec<oneshot::Sender<TransferResult>>,
    /// Taken to be sent: nothing may join any more.
    sent: bool,
}

thread_local! {
    /// The batch this thread is filling (its opener sends it after one yield).
    static FILLING: RefCell<Option<Arc<Mutex<Batch>>>> = const { RefCell::new(None) };
}

fn lock(batch: &Mutex<Batch>) -> MutexGuard<'_, Batch> {
    batch.lock().unwrap_or_else(|e| e.into_inner())
}

/// Creates `transfer` (not linked) in the batch this thread is filling; the result is its own.
pub async fn create_transfer(client: Arc<tb::Client>, transfer: tb::Transfer) -> TransferResult {
    assert!(
        !transfer.flags().contains(tb::transfer::Flags::LINKED),
        "a linked chain is not a batch of independent transfers"
    );
    let (reply, result) = oneshot::channel();
    if let Some(opened) = join_or_open(client, transfer, reply) {
        // Every request this thread has ready gets to join before the batch goes.
        tokio::task::yield_now().await;
        send(&opened).await;
    }
    result.await.unwrap_or_else(|_| {
        Err(LedgerError::Unexpected {
            operation: Operation::CreateTransfers,
            message: "a batch ended without an answer".to_owned(),
        })
    })
}

/// Joins this thread's open batch when it is for the same client and has room; else opens one
/// (returned: the caller sends it).
fn join_or_open(
    client: Arc<tb::Client>,
    transfer: tb::Transfer,
    reply: oneshot::Sender<TransferResult>,
) -> Option<Arc<Mutex<Batch>>> {
    FILLING.with(|filling| {
        let mut filling = filling.borrow_mut();
        if let Some(open) = filling.as_ref() {
            let mut batch = lock(open);
            let fits = !batch.sent && batch.transfers.len() < BATCH_TRANSFERS_MAX;
            if fits && Arc::ptr_eq(&batch.client, &client) {
                batch.transfers.push(transfer);
                batch.replies.push(reply);
                return None;
            }
        }
        let opened = Arc::new(Mutex::new(Batch {
            client,
            transfers: vec![transfer],
            replies: vec![reply],
            sent: false,
        }));
        *filling = Some(opened.clone());
        Some(opened)
    })
}

/// Sends the batch (closed to newcomers first) and answers each of its transfers.
async fn send(opened: &Arc<Mutex<Batch>>) {
    let (client, transfers, replies) = {
        let mut batch = lock(opened);
        assert!(!batch.sent);
        batch.sent = true;
        let transfers = std::mem::take(&mut batch.transfers);
        let replies = std::mem::take(&mut batch.replies);
        (batch.client.clone(), transfers, replies)
    };
    // Whichever thread this task resumed on, its own open batch is another one: leave it.
    FILLING.with(|filling| {
        let mut filling = filling.borrow_mut();
        if filling
            .as_ref()
            .is_some_and(|open| Arc::ptr_eq(open, opened))
        {
            *filling = None;
        }
    });
    assert_eq!(transfers.len(), replies.len());
    let count = transfers.len();
    match client.create_transfers(transfers).await {
        Ok(()) => replies.into_iter().for_each(|reply| {
            let _ = reply.send(Ok(None));
        }),
        Err(tb::error::CreateTransfersError::Api(errors)) => {
            let mut kinds: Vec<Option<CreateTransferErrorKind>> = vec![None; count];
            for error in errors.as_slice() {
                // An index outside the batch would be the client's bug: that transfer's caller
                // gets no kind, the others theirs.
                if let Some(kind) = kinds.get_mut(error.index() as usize) {
                    *kind = Some(error.kind());
                }
            }
            for (reply, kind) in replies.into_iter().zip(kinds) {
                let _ = reply.send(Ok(kind));
            }
        }
        Err(error) => {
            let error = client_error(Operation::CreateTransfers, error);
            for reply in replies {
                let _ = reply.send(Err(error.clone()));
            }
        }
    }
}
