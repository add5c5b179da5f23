//! A response body that holds its request's concurrency slot until the last byte is sent (or
//! the client goes away): a streamed response is in flight until it ends, not when its handler
//! returns.

use std::pin::Pin;
use std::task::{Context, Poll};

use actix_web::body::{BodySize, MessageBody};
use actix_web::web::Bytes;
use pin_project_lite::pin_project;

use super::concurrency::Slot;

pin_project! {
    pub struct SlotBody<B> {
        #[pin]
        body: B,
        // Dropped (so given back) at the end of the body, or with it.
        slot: Option<Slot>,
    }
}

impl<B> SlotBody<B> {
    pub fn new(body: B, slot: Option<Slot>) -> Self {
        SlotBody { body, slot }
    }

    /// A body that holds no slot.
    pub fn plain(body: B) -> Self {
        SlotBody { body, slot: None }
    }
}

impl<B: MessageBody> MessageBody for SlotBody<B> {
    type Error = B::Error;

    fn size(&self) -> BodySize {
        self.body.size()
    }

    fn poll_next(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Bytes, Self::Error>>> {
        let this = self.project();
        let polled = this.body.poll_next(cx);
        if matches!(polled, Poll::Ready(None) | Poll::Ready(Some(Err(_)))) {
            this.slot.take();
        }
        polled
    }
}
