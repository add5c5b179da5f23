//! The Envoy front end's connections: at most `rls.connections_max` open at once, and an accept
//! that fails for want of a resource pauses before the next.
//!
//! Why not tonic's own accepting alone: its server takes every connection it is offered (no
//! bound: each holds its buffers and up to [`super::STREAMS_PER_CONNECTION_MAX`] calls), and it
//! tries an accept that failed again at once. Out of file descriptors (`EMFILE`), the connection
//! stays in the listen backlog, so every try fails the same way: the loop spun a core for as long
//! as the shortage lasted, beside the calls it should have been serving. The HTTP server's
//! accepting (actix) has both: a bound per worker and a pause.

use std::io;
use std::num::NonZeroUsize;
use std::pin::Pin;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::{Stream, StreamExt};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::transport::server::{Connected, TcpConnectInfo, TcpIncoming};

/// How long accepting pauses after an accept failed for want of a resource (file descriptors,
/// memory): long enough that a shortage costs nothing, short enough that a connection waits
/// little once it ends. actix pauses 510 ms.
pub const ACCEPT_PAUSE: Duration = Duration::from_millis(500);

/// The wall-clock second a full house was last logged in ([`crate::telemetry::log_throttle`]).
static FULL_LOGGED_SECOND: AtomicU64 = AtomicU64::new(0);

/// An accepted connection, holding its place under the bound until it is dropped (when tonic's
/// connection task ends).
pub struct Connection {
    stream: TcpStream,
    _place: OwnedSemaphorePermit,
}

/// `incoming`'s connections, at most `connections_max` open at once: beyond, new ones wait in the
/// listen backlog (the kernel's queue, `somaxconn`) until one ends, as the HTTP server's do.
pub fn bounded(
    incoming: TcpIncoming,
    connections_max: NonZeroUsize,
) -> impl Stream<Item = io::Result<Connection>> {
    let places = Arc::new(Semaphore::new(connections_max.get()));
    futures_util::stream::unfold(
        (incoming, places),
        move |(mut incoming, places)| async move {
            if places.available_permits() == 0
                && crate::telemetry::log_throttle(&FULL_LOGGED_SECOND)
            {
                tracing::warn!(
                    connections_max = connections_max.get(),
                    "the Envoy front end has rls.connections_max connections open; new ones wait"
                );
            }
            let place = (places.clone()).acquire_owned().await;
            let place = place.expect("the bound's semaphore is never closed");
            let stream = accept(&mut incoming).await?;
            let connection = Connection {
                stream,
                _place: place,
            };
            Some((Ok(connection), (incoming, places)))
        },
    )
}

/// The next connection of `incoming`; `None` when it ends. A failure of the connection's own (reset
/// or aborted before it was accepted) is skipped at once: the next one may be fine. Any other (out
/// of file descriptors or memory) pauses accepting for [`ACCEPT_PAUSE`] first: trying again at
/// once fails the same way.
pub async fn accept<T, S>(incoming: &mut S) -> Option<T>
where
    S: Stream<Item = io::Result<T>> + Unpin,
{
    loop {
        match incoming.next().await? {
            Ok(stream) => return Some(stream),
            Err(error) if the_connections(&error) => {
                tracing::debug!(%error, "a connection to the Envoy front end failed before it was accepted");
            }
            Err(error) => {
                tracing::warn!(
                    %error,
                    pause_ms = ACCEPT_PAUSE.as_millis() as u64,
                    "the Envoy front end cannot accept a connection; pausing"
                );
                tokio::time::sleep(ACCEPT_PAUSE).await;
            }
        }
    }
}

/// Whether an accept failed for a reason of the connection's, not this process's.
fn the_connections(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    )
}

impl Connected for Connection {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.stream.connect_info()
    }
}

impl AsyncRead for Connection {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Connection {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failure(kind: io::ErrorKind) -> io::Result<u32> {
        Err(io::Error::from(kind))
    }

    /// EMFILE is `Uncategorized` in std; what matters is that it is none of the connection's.
    fn out_of_descriptors() -> io::Result<u32> {
        Err(io::Error::from_raw_os_error(24))
    }

    #[tokio::test(start_paused = true)]
    async fn a_shortage_pauses_accepting_and_a_failed_connection_does_not() {
        let started = tokio::time::Instant::now();
        let mut incoming = futures_util::stream::iter([
            out_of_descriptors(),
            out_of_descriptors(),
            failure(io::ErrorKind::ConnectionAborted),
            failure(io::ErrorKind::ConnectionReset),
            Ok(7),
            failure(io::ErrorKind::ConnectionRefused),
            Ok(8),
            failure(io::ErrorKind::OutOfMemory),
        ]);
        assert_eq!(accept(&mut incoming).await, Some(7));
        assert_eq!(
            started.elapsed(),
            2 * ACCEPT_PAUSE,
            "paused once per shortage"
        );
        assert_eq!(accept(&mut incoming).await, Some(8));
        assert_eq!(
            started.elapsed(),
            2 * ACCEPT_PAUSE,
            "no pause for the connection's"
        );
        assert_eq!(accept(&mut incoming).await, None, "ends with its stream");
        assert_eq!(started.elapsed(), 3 * ACCEPT_PAUSE);
    }
}
