//! A response body that holds its request's concurrency slot until the last byte is sent (or
//! the client goes away): a streamed response is in flight until it ends, not when its handler
//! returns.

use std::pin::Pin;
use std::task::{Context, Poll};

use actix_web::body::{BodySize, BoxBody, MessageBody};
use actix_web::web::Bytes;
use pin_project_lite::pin_project;

use super::concurrency::Slot;

pin_project! {
    pub struct SlotBody<B> {
        #[pin]
        body: B,
        // Dropped (so given back) at the end of the body, or with it. Boxed: few routes have
        // slots, and every response's future carries this body, moved at each layer.
        slot: Option<Box<Slot>>,
    }
}

impl<B> SlotBody<B> {
    pub fn new(body: B, slot: Option<Slot>) -> Self {
        SlotBody {
            body,
            slot: slot.map(Box::new),
        }
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

    /// A body without a slot is its inner body: a whole one (a handler's `Bytes`) is handed
    /// over as bytes, which actix writes without polling a stream.
    fn try_into_bytes(self) -> Result<Bytes, Self> {
        match self.slot {
            None => self.body.try_into_bytes().map_err(SlotBody::plain),
            // The slot is given back when the body is sent, so the body stays a stream.
            Some(_) => Err(self),
        }
    }

    /// Without a slot, the inner body boxed, which is no allocation for a body that is already a
    /// `BoxBody` (every handler's `HttpResponse`): a route with middleware boxes each response's
    /// body, and this one would otherwise be a second box around the first.
    fn boxed(self) -> BoxBody
    where
        Self: 'static,
    {
        match self.slot {
            None => self.body.boxed(),
            Some(_) => BoxBody::new(self),
        }
    }
}

#[cfg(test)]
mod tests {
    use actix_web::body::{BodyStream, EitherBody};

    use super::*;

    fn hello() -> BoxBody {
        BoxBody::new(Bytes::from_static(b"hello"))
    }

    /// What a route with middleware does to each response: its body boxed. A handler's bytes
    /// without a slot stay bytes (one box, written at once), not a stream in a second box.
    #[test]
    fn a_body_without_a_slot_is_its_inner_body() {
        let plain = SlotBody::plain(hello());
        assert_eq!(
            plain.try_into_bytes().ok(),
            Some(Bytes::from_static(b"hello"))
        );
        let served = EitherBody::<SlotBody<BoxBody>, BoxBody>::left(SlotBody::plain(hello()));
        let boxed = served.boxed();
        assert_eq!(boxed.size(), BodySize::Sized(5));
        assert_eq!(
            boxed.try_into_bytes().ok(),
            Some(Bytes::from_static(b"hello"))
        );
    }

    /// Each response's future holds its body and is moved at each layer of middleware: a slot
    /// adds a pointer to the body, not the slot.
    #[test]
    fn a_slot_adds_a_pointer_to_the_body() {
        let added = std::mem::size_of::<SlotBody<BoxBody>>() - std::mem::size_of::<BoxBody>();
        assert_eq!(added, std::mem::size_of::<usize>());
    }

    #[test]
    fn a_streamed_body_stays_a_stream() {
        let chunks =
            futures_util::stream::iter([Ok::<_, std::io::Error>(Bytes::from_static(b"x"))]);
        let streamed = SlotBody::plain(BodyStream::new(chunks));
        assert!(streamed.try_into_bytes().is_err());
    }
}
