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
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
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

/// How long a connection may take to send HTTP/2's preface, its first 24 bytes, while every place
/// is taken. Why: until then nothing else ends it (HTTP/2's keepalive pings start after the
/// handshake, TCP's find dead peers only), and under the bound a connection that never speaks
/// held its place for good: `rls.connections_max` of them would have kept Envoy out. Not while a
/// place is free: Envoy opens connections ahead of its requests (`preconnect_policy`, or a request
/// its own timeout cancelled during the connect) and sends nothing on them until the next one,
/// and a connection closed under it fails that request.
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
    /// Held until the connection ends (dropped with it).
    _place: OwnedSemaphorePermit,
    /// Until the preface has come: how much of it has, when it is too late (if a connection
    /// waits for a place then), and how long each wait for it is.
    preface: Option<(usize, Pin<Box<tokio::time::Sleep>>, Duration)>,
    /// Whether an accepted connection waits for a place ([`bounded`]).
    waiting: Arc<AtomicBool>,
}

impl Connection {
    /// `stream`, holding `place`; it must send HTTP/2's preface within `timeout` whenever a
    /// connection waits for a place (`waiting`, [`PREFACE_TIMEOUT`]).
    fn new(
        stream: TcpStream,
        place: OwnedSemaphorePermit,
        (timeout, waiting): (Duration, Arc<AtomicBool>),
    ) -> Self {
        let deadline = Box::pin(tokio::time::sleep(timeout));
        Connection {
            stream,
            _place: place,
            preface: Some((0, deadline, timeout)),
            waiting,
        }
    }

    /// Whether a connection still silent at its deadline is closed: when another waits for a
    /// place, so that it may have this one's. Else it waits another `timeout`. (Every place
    /// taken is not enough: the last one taken, nobody waits.)
    fn too_late(&mut self, cx: &mut Context<'_>) -> bool {
        let Some((_, deadline, timeout)) = &mut self.preface else {
            return false;
        };
        while deadline.as_mut().poll(cx).is_ready() {
            if self.waiting.load(Ordering::Relaxed) {
                return true;
            }
            let again = tokio::time::Instant::now() + *timeout;
            deadline.as_mut().reset(again);
        }
        false
    }
}

/// `incoming`'s connections, at most `connections_max` open at once: beyond, one accepted waits
/// for a place and the next ones in the listen backlog ([`crate::startup::LISTEN_BACKLOG`]; past
/// it, a new connection's handshake goes unanswered and its client tries again) until one ends,
/// as the HTTP server's do. Accepted first, then placed: a place taken while the next
/// connection was awaited made the bound look full one connection early, and a silent
/// connection was closed then with nobody waiting for its place.
pub fn bounded(
    incoming: TcpIncoming,
    connections_max: NonZeroUsize,
) -> impl Stream<Item = io::Result<Connection>> {
    bounded_with(incoming, connections_max, PREFACE_TIMEOUT)
}

/// [`bounded`], each connection given `preface_timeout` (tests wait less than 10 s).
fn bounded_with(
    incoming: TcpIncoming,
    connections_max: NonZeroUsize,
    preface_timeout: Duration,
) -> impl Stream<Item = io::Result<Connection>> {
    let places = Arc::new(Semaphore::new(connections_max.get()));
    let waiting = Arc::new(AtomicBool::new(false));
    futures_util::stream::unfold(
        (incoming, places, waiting),
        move |(mut incoming, places, waiting)| async move {
            let stream = accept(&mut incoming).await?;
            let place = match places.clone().try_acquire_owned() {
                Ok(place) => place,
                Err(_) => {
                    if crate::telemetry::log_throttle(&FULL_LOGGED_SECOND) {
                        tracing::warn!(
                            connections_max = connections_max.get(),
                            "the Envoy front end has rls.connections_max connections open; new ones wait"
                        );
                    }
                    waiting.store(true, Ordering::Relaxed);
                    let place = (places.clone()).acquire_owned().await;
                    waiting.store(false, Ordering::Relaxed);
                    place.expect("the bound's semaphore is never closed")
                }
            };
            let connection = Connection::new(stream, place, (preface_timeout, waiting.clone()));
            Some((Ok(connection), (incoming, places, waiting)))
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
/// aborted before it was accepted, or a network error of its own that Linux's `accept` passes
/// on (accept(2)). Not `EPERM` nor `EOPNOTSUPP`: a seccomp filter or a security module answers
/// every accept so, and skipping them at once spun a core.
fn the_connections(error: &io::Error) -> bool {
    let networks = [
        libc::ECONNABORTED,
        libc::ECONNRESET,
        libc::ECONNREFUSED,
        libc::ETIMEDOUT,
        libc::ENETDOWN,
        libc::EPROTO,
        libc::ENOPROTOOPT,
        libc::EHOSTDOWN,
        libc::ENONET,
        libc::EHOSTUNREACH,
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
        if let Some((read, _, _)) = &mut this.preface {
            *read += buf.filled().len() - before;
            if *read >= PREFACE_BYTES {
                this.preface = None;
            } else if polled.is_pending() && this.too_late(cx) {
                let late = "no HTTP/2 preface in time, and every place taken";
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

    /// Each wait for the preface, in these tests (real time: paused time jumped past deadlines
    /// while loopback data was on its way).
    const SHORT: Duration = Duration::from_millis(200);

    /// A connection holding a place, another connection waiting for one or not, and its peer.
    async fn connected(waiting: bool) -> (Connection, TcpStream) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let peer = TcpStream::connect(listener.local_addr().unwrap());
        let (peer, accepted) = tokio::join!(peer, listener.accept());
        let place = Arc::new(Semaphore::new(1)).try_acquire_owned().unwrap();
        let waiting = Arc::new(AtomicBool::new(waiting));
        (
            Connection::new(accepted.unwrap().0, place, (SHORT, waiting)),
            peer.unwrap(),
        )
    }

    const PREFACE: &[u8; PREFACE_BYTES] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

    async fn read_within(
        connection: &mut Connection,
        within: Duration,
    ) -> Option<io::Result<usize>> {
        use tokio::io::AsyncReadExt;
        let mut buffer = [0u8; 64];
        tokio::time::timeout(within, connection.read(&mut buffer))
            .await
            .ok()
    }

    /// While a connection waits for a place, one that has not sent HTTP/2's preface, or only
    /// half of it, is ended at its deadline (it held its place for good); one that sent it may
    /// stay quiet as long as it likes, and so may a silent one while nobody waits, every place
    /// taken or not (Envoy's connections opened ahead of their requests).
    #[tokio::test]
    async fn a_silent_connection_is_ended_when_another_waits_for_its_place() {
        use tokio::io::AsyncWriteExt;
        let (mut silent, _peer) = connected(true).await;
        let started = std::time::Instant::now();
        let ended = read_within(&mut silent, 20 * SHORT)
            .await
            .expect("ended in time");
        assert_eq!(ended.expect_err("ended").kind(), io::ErrorKind::TimedOut);
        assert!(started.elapsed() >= SHORT);
        let (mut halfway, mut peer) = connected(true).await;
        peer.write_all(&PREFACE[..12]).await.unwrap();
        let read = read_within(&mut halfway, 20 * SHORT).await;
        assert_eq!(read.expect("read").unwrap(), 12);
        let ended = read_within(&mut halfway, 20 * SHORT)
            .await
            .expect("ended in time");
        assert_eq!(ended.expect_err("ended").kind(), io::ErrorKind::TimedOut);
        let (mut spoke, mut peer) = connected(true).await;
        peer.write_all(&[&PREFACE[..], b"SETTINGS"].concat())
            .await
            .unwrap();
        let mut got = 0;
        while got < PREFACE_BYTES + 8 {
            got += read_within(&mut spoke, 20 * SHORT)
                .await
                .expect("read")
                .unwrap();
        }
        assert!(
            read_within(&mut spoke, 5 * SHORT).await.is_none(),
            "kept, waiting"
        );
        let (mut unwaited, _peer) = connected(false).await;
        assert!(
            read_within(&mut unwaited, 5 * SHORT).await.is_none(),
            "kept, nobody waits for its place"
        );
        // Still watched: once another waits, it is ended at its next deadline.
        unwaited.waiting.store(true, Ordering::Relaxed);
        let ended = read_within(&mut unwaited, 20 * SHORT)
            .await
            .expect("ended in time");
        assert_eq!(ended.expect_err("ended").kind(), io::ErrorKind::TimedOut);
        let (mut closed, peer) = connected(true).await;
        drop(peer);
        let read = read_within(&mut closed, 20 * SHORT).await;
        assert_eq!(read.expect("read").unwrap(), 0, "its end, as it came");
    }

    /// Through the bound itself, one place: a silent connection keeps its place past its
    /// deadlines while nobody waits (the last place taken is not a wait); a second connection
    /// is accepted and waits, and the silent one is ended at its next deadline, its place the
    /// second's.
    #[tokio::test]
    async fn the_bound_ends_a_silent_connection_once_another_is_accepted_and_waits() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let incoming = TcpIncoming::from(listener);
        let mut connections = Box::pin(bounded_with(incoming, NonZeroUsize::MIN, SHORT));
        let _silent_peer = TcpStream::connect(address).await.unwrap();
        let mut silent = connections.next().await.unwrap().unwrap();
        assert!(
            read_within(&mut silent, 5 * SHORT).await.is_none(),
            "kept, nobody waits"
        );
        let _next_peer = TcpStream::connect(address).await.unwrap();
        let next = connections.next();
        tokio::pin!(next);
        let placed = tokio::time::timeout(2 * SHORT, &mut next).await;
        assert!(placed.is_err(), "accepted, waiting for the one place");
        let ended = read_within(&mut silent, 20 * SHORT)
            .await
            .expect("ended in time");
        assert_eq!(ended.expect_err("ended").kind(), io::ErrorKind::TimedOut);
        drop(silent);
        let placed = tokio::time::timeout(20 * SHORT, next).await;
        let placed = placed.expect("placed once the silent one ended");
        assert!(placed.expect("a connection").is_ok());
    }
}
