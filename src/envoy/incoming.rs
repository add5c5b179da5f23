//! The Envoy front end's connections: at most `rls.connections_max` open at once, each given
//! [`PREFACE_TIMEOUT`] to start speaking HTTP/2, and an accept that fails for want of a resource
//! pauses before the next.
//!
//! Why not tonic's own accepting alone: its server takes every connection it is offered (no
//! bound: each holds its buffers and up to [`super::STREAMS_PER_CONNECTION_MAX`] calls), and it
//! tries an accept that failed again at once. Out of file descriptors (`EMFILE`), the connection
//! stays in the listen backlog, so every try fails the same way: the loop spun a core for as long
//! as the shortage lasted, beside the calls it should have been serving. The HTTP server's
//! accepting (actix) has both: a bound per worker and a pause.

use std::future::Future;
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

/// How long a connection may take to send HTTP/2's preface, its first 24 bytes. Why: until then
/// nothing else ends it (HTTP/2's keepalive pings start after the handshake, TCP's find dead
/// peers only), and under the bound a connection that never speaks held its place for good:
/// `rls.connections_max` of them would have kept Envoy out.
pub const PREFACE_TIMEOUT: Duration = Duration::from_secs(10);

/// The HTTP/2 client preface's length (`PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n`).
const PREFACE_BYTES: usize = 24;

/// The wall-clock second a full house was last logged in ([`crate::telemetry::log_throttle`]).
static FULL_LOGGED_SECOND: AtomicU64 = AtomicU64::new(0);
/// The wall-clock second a paused accept was last logged in.
static PAUSE_LOGGED_SECOND: AtomicU64 = AtomicU64::new(0);

/// An accepted connection, holding its place under the bound until it is dropped (when tonic's
/// connection task ends).
pub struct Connection {
    stream: TcpStream,
    _place: OwnedSemaphorePermit,
    /// Until the preface has come: how much of it has, and when it is too late.
    preface: Option<(usize, Pin<Box<tokio::time::Sleep>>)>,
}

impl Connection {
    /// `stream`, holding `place`; it must send HTTP/2's preface within [`PREFACE_TIMEOUT`].
    fn new(stream: TcpStream, place: OwnedSemaphorePermit) -> Self {
        let deadline = Box::pin(tokio::time::sleep(PREFACE_TIMEOUT));
        Connection {
            stream,
            _place: place,
            preface: Some((0, deadline)),
        }
    }
}

/// `incoming`'s connections, at most `connections_max` open at once: beyond, new ones wait in the
/// listen backlog ([`crate::startup::LISTEN_BACKLOG`]; past it, a new connection's handshake goes
/// unanswered and its client tries again) until one ends, as the HTTP server's do.
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
            Some((Ok(Connection::new(stream, place)), (incoming, places)))
        },
    )
}

/// The next connection of `incoming`; `None` when it ends. A failure of the connection's own (reset
/// or aborted before it was accepted, a network error Linux passes on) is skipped at once: the
/// next one may be fine. Any other (out of file descriptors or memory, or one not known) pauses
/// accepting for [`ACCEPT_PAUSE`] first: trying again at once may fail the same way.
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
                if crate::telemetry::log_throttle(&PAUSE_LOGGED_SECOND) {
                    tracing::warn!(
                        %error,
                        pause_ms = ACCEPT_PAUSE.as_millis() as u64,
                        "the Envoy front end cannot accept a connection; pausing"
                    );
                }
                tokio::time::sleep(ACCEPT_PAUSE).await;
            }
        }
    }
}

/// Whether an accept failed for a reason of the connection's, not this process's: reset or
/// aborted before it was accepted, refused by a firewall, or a network error of its own that
/// Linux's `accept` passes on (accept(2)).
fn the_connections(error: &io::Error) -> bool {
    let networks = [
        libc::ECONNABORTED,
        libc::ECONNRESET,
        libc::ECONNREFUSED,
        libc::EPERM,
        libc::ETIMEDOUT,
        libc::ENETDOWN,
        libc::EPROTO,
        libc::ENOPROTOOPT,
        libc::EHOSTDOWN,
        libc::ENONET,
        libc::EHOSTUNREACH,
        libc::EOPNOTSUPP,
        libc::ENETUNREACH,
    ];
    error
        .raw_os_error()
        .is_some_and(|code| networks.contains(&code))
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
        let this = &mut *self;
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.stream).poll_read(cx, buf);
        if let Some((read, deadline)) = &mut this.preface {
            *read += buf.filled().len() - before;
            if *read >= PREFACE_BYTES {
                this.preface = None;
            } else if polled.is_pending() && deadline.as_mut().poll(cx).is_ready() {
                let late = format!("no HTTP/2 preface within {PREFACE_TIMEOUT:?}");
                return Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, late)));
            }
        }
        polled
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

    fn failure(code: i32) -> io::Result<u32> {
        Err(io::Error::from_raw_os_error(code))
    }

    #[tokio::test(start_paused = true)]
    async fn a_shortage_pauses_accepting_and_a_failed_connection_does_not() {
        let started = tokio::time::Instant::now();
        let mut incoming = futures_util::stream::iter([
            failure(libc::EMFILE),
            failure(libc::ENFILE),
            failure(libc::ECONNABORTED),
            failure(libc::EHOSTUNREACH),
            Ok(7),
            failure(libc::EPROTO),
            Ok(8),
            failure(libc::ENOBUFS),
        ]);
        assert_eq!(accept(&mut incoming).await, Some(7));
        let paused = started.elapsed();
        assert_eq!(paused, 2 * ACCEPT_PAUSE, "paused once per shortage");
        assert_eq!(accept(&mut incoming).await, Some(8));
        let paused = started.elapsed();
        assert_eq!(paused, 2 * ACCEPT_PAUSE, "no pause for the connection's");
        assert_eq!(accept(&mut incoming).await, None, "ends with its stream");
        assert_eq!(started.elapsed(), 3 * ACCEPT_PAUSE);
    }

    /// A connection with a place, and its peer.
    async fn connected() -> (Connection, TcpStream) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let peer = TcpStream::connect(listener.local_addr().unwrap());
        let (peer, accepted) = tokio::join!(peer, listener.accept());
        let place = Arc::new(Semaphore::new(1)).try_acquire_owned().unwrap();
        (Connection::new(accepted.unwrap().0, place), peer.unwrap())
    }

    const PREFACE: &[u8; PREFACE_BYTES] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

    /// A connection that never sends HTTP/2's preface, or half of it, is ended at its deadline
    /// (it held its place for good); one that sent it may then stay quiet as long as it likes.
    #[tokio::test(start_paused = true)]
    async fn a_connection_that_never_speaks_is_ended_and_one_that_did_is_not() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut buffer = [0u8; 64];
        let (mut silent, _peer) = connected().await;
        let started = tokio::time::Instant::now();
        let read = tokio::time::timeout(2 * PREFACE_TIMEOUT, silent.read(&mut buffer)).await;
        let error = read.expect("ended in time").expect_err("ended");
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
        assert_eq!(started.elapsed(), PREFACE_TIMEOUT);
        let (mut halfway, mut peer) = connected().await;
        peer.write_all(&PREFACE[..12]).await.unwrap();
        assert_eq!(halfway.read(&mut buffer).await.unwrap(), 12);
        let read = tokio::time::timeout(2 * PREFACE_TIMEOUT, halfway.read(&mut buffer)).await;
        let error = read.expect("ended in time").expect_err("ended");
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
        let (mut spoke, mut peer) = connected().await;
        peer.write_all(PREFACE).await.unwrap();
        let mut preface = [0u8; PREFACE_BYTES];
        spoke.read_exact(&mut preface).await.unwrap();
        let quiet = tokio::time::timeout(10 * PREFACE_TIMEOUT, spoke.read(&mut buffer)).await;
        assert!(quiet.is_err(), "still open, waiting: {quiet:?}");
    }
}
