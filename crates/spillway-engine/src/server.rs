//! The listener and every client connection's limits: a cap on open connections (past it
//! a connection is answered 503 and closed), HTTP/1.1 and HTTP/2 on one port with a cap
//! on concurrent HTTP/2 streams, and a watchdog per connection that closes it when
//! - it sits idle between requests longer than `keep_alive_idle_ms`,
//! - a request's headers take longer than `header_read_timeout_ms` from its first byte
//!   (slowloris),
//! - the client stops reading its answer for `write_timeout_ms`: the connection is cut, the
//!   response (a stream above all) is dropped, and its channel and key slots come free; the
//!   request is recorded as `client_stalled`.
//!
//! The watchdog costs the request path nothing: the socket and the request only stamp
//! times into atomics, and the watchdog reads them when it wakes — at the soonest deadline
//! the stamps allow, and at least every half of the shortest limit, so a deadline that a
//! newer stamp brings forward is still met on time (each is longer than that interval).
//!
//! Shutdown is two steps ([`crate::state::Shutdown`]): draining stops the accept loop and
//! asks each connection to finish gracefully; cancelling drops what is left.

use crate::state::AppState;
use axum::Router;
use axum::body::Body;
use bytes::Bytes;
use http::{Request, Response};
use http_body::{Body as HttpBody, Frame, SizeHint};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tokio_util::task::TaskTracker;

/// What the watchdog knows of one client connection. Requests find it in their
/// extensions (to tell a stalled reader from one that hung up).
pub struct ConnState {
    pub peer: SocketAddr,
    base: Instant,
    /// Requests in flight on the connection.
    busy: AtomicU32,
    /// Milliseconds since `base` when the connection last became idle.
    idle_since: AtomicU64,
    /// 1 + milliseconds since `base` of the first byte read while idle (a request head
    /// arriving); 0 when none.
    head_at: AtomicU64,
    /// 1 + milliseconds since `base` since writes have been pending; 0 when they are not.
    write_blocked: AtomicU64,
    stalled: AtomicBool,
    /// The client speaks HTTP/2 (its first bytes were the preface): pings and window
    /// updates arrive while it idles, so bytes read say nothing about a request head.
    h2: AtomicBool,
    /// How much of the HTTP/2 preface the first bytes matched so far (`u32::MAX`: not it).
    preface: AtomicU32,
}

impl ConnState {
    fn new(peer: SocketAddr) -> ConnState {
        ConnState {
            peer,
            base: Instant::now(),
            busy: AtomicU32::new(0),
            idle_since: AtomicU64::new(0),
            // A new connection owes its first request's head at once: one that never
            // sends a byte gets the header deadline, not the idle one.
            head_at: AtomicU64::new(1),
            write_blocked: AtomicU64::new(0),
            stalled: AtomicBool::new(false),
            h2: AtomicBool::new(false),
            preface: AtomicU32::new(0),
        }
    }

    fn ms(&self) -> u64 {
        self.base.elapsed().as_millis() as u64
    }

    /// The client stopped reading and the connection was cut for it.
    pub fn stalled(&self) -> bool {
        self.stalled.load(Ordering::Acquire)
    }

    fn request_started(&self) {
        self.busy.fetch_add(1, Ordering::AcqRel);
        self.head_at.store(0, Ordering::Release);
    }

    fn request_ended(&self) {
        if self.busy.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.idle_since.store(self.ms(), Ordering::Release);
            self.head_at.store(0, Ordering::Release);
        }
    }

    fn read_some(&self, bytes: &[u8]) {
        const PREFACE: &[u8] = b"PRI * HTTP/2.0";
        let seen = self.preface.load(Ordering::Acquire) as usize;
        if seen < PREFACE.len() {
            let want = &PREFACE[seen..];
            let n = want.len().min(bytes.len());
            if bytes[..n] != want[..n] {
                self.preface.store(u32::MAX, Ordering::Release);
            } else if seen + n == PREFACE.len() {
                self.preface.store(u32::MAX, Ordering::Release);
                self.h2.store(true, Ordering::Release);
                // The preface is not a request head: an HTTP/2 client is idle until it asks.
                self.head_at.store(0, Ordering::Release);
            } else {
                self.preface.store((seen + n) as u32, Ordering::Release);
            }
        }
        if self.h2.load(Ordering::Acquire) {
            return;
        }
        if self.busy.load(Ordering::Acquire) == 0 && self.head_at.load(Ordering::Acquire) == 0 {
            self.head_at.store(self.ms() + 1, Ordering::Release);
        }
    }

    fn write_pending(&self) {
        if self.write_blocked.load(Ordering::Acquire) == 0 {
            self.write_blocked.store(self.ms() + 1, Ordering::Release);
        }
    }

    fn write_done(&self) {
        if self.write_blocked.load(Ordering::Relaxed) != 0 {
            self.write_blocked.store(0, Ordering::Release);
        }
    }

    /// When the connection must be closed if nothing changes, and why.
    fn deadline(&self, limits: &Limits) -> Option<(Instant, Expiry)> {
        let at = |ms: u64| self.base + Duration::from_millis(ms);
        let mut soonest: Option<(Instant, Expiry)> = None;
        let mut consider = |t: Instant, why: Expiry| {
            if soonest.is_none_or(|(s, _)| t < s) {
                soonest = Some((t, why));
            }
        };
        let blocked = self.write_blocked.load(Ordering::Acquire);
        if blocked != 0 {
            consider(at(blocked - 1) + limits.write, Expiry::Stalled);
        }
        if self.busy.load(Ordering::Acquire) == 0 {
            match self.head_at.load(Ordering::Acquire) {
                0 => consider(at(self.idle_since.load(Ordering::Acquire)) + limits.idle, Expiry::Idle),
                head => consider(at(head - 1) + limits.header, Expiry::Header),
            }
        }
        soonest
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Expiry {
    Idle,
    Header,
    Stalled,
}

#[derive(Clone, Copy)]
struct Limits {
    header: Duration,
    idle: Duration,
    write: Duration,
}

impl Limits {
    /// How often the watchdog looks again at the latest: half the shortest limit.
    fn recheck(&self) -> Duration {
        self.header.min(self.idle).min(self.write) / 2
    }
}

/// A client socket that tells the watchdog when bytes arrive and when writes stall.
struct WatchedIo {
    inner: TcpStream,
    conn: Arc<ConnState>,
}

impl AsyncRead for WatchedIo {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.conn.read_some(&buf.filled()[before..]);
        }
        r
    }
}

impl WatchedIo {
    fn note<T>(&self, r: &Poll<std::io::Result<T>>) {
        match r {
            Poll::Pending => self.conn.write_pending(),
            Poll::Ready(_) => self.conn.write_done(),
        }
    }
}

impl AsyncWrite for WatchedIo {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.note(&r);
        r
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.note(&r);
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_flush(cx);
        self.note(&r);
        r
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// A response body that tells the watchdog when its request is over.
struct Tracked {
    inner: Body,
    conn: Option<Arc<ConnState>>,
}

impl Tracked {
    fn end(&mut self) {
        if let Some(c) = self.conn.take() {
            c.request_ended();
        }
    }
}

impl HttpBody for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let r = Pin::new(&mut self.inner).poll_frame(cx);
        if matches!(r, Poll::Ready(None) | Poll::Ready(Some(Err(_)))) {
            self.end();
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.end();
    }
}

/// The router as a hyper service that hands each request its connection's state.
#[derive(Clone)]
struct Svc {
    router: Router,
    conn: Arc<ConnState>,
}

impl hyper::service::Service<Request<Incoming>> for Svc {
    type Response = Response<Tracked>;
    type Error = std::convert::Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn call(&self, mut req: Request<Incoming>) -> Self::Future {
        use tower::ServiceExt;
        self.conn.request_started();
        req.extensions_mut().insert(self.conn.clone());
        let (router, conn) = (self.router.clone(), self.conn.clone());
        Box::pin(async move {
            // Ends the request for the watchdog even if the handler never answers (the
            // client hung up first); handed to the response body once there is one.
            let mut pending = Tracked {
                inner: Body::empty(),
                conn: Some(conn),
            };
            let resp = match router.oneshot(req.map(Body::new)).await {
                Ok(r) => r,
                Err(never) => match never {},
            };
            let conn = pending.conn.take();
            Ok(resp.map(|inner| Tracked { inner, conn }))
        })
    }
}

/// A bare 503 for a connection over the cap, written without waiting on the client.
static OVER_CAPACITY: std::sync::LazyLock<Vec<u8>> = std::sync::LazyLock::new(|| {
    let body = r#"{"error":{"message":"The gateway has too many open connections. Retry shortly.","type":"api_error","code":"service_unavailable"}}"#;
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
});

/// Serves `router` on `listener` until the state's shutdown says stop. Returns when the
/// listener is closed and every connection has ended.
pub async fn serve(listener: TcpListener, router: Router, st: Arc<AppState>) {
    let cfg = &st.config.server;
    let limits = Limits {
        header: Duration::from_millis(cfg.header_read_timeout_ms),
        idle: Duration::from_millis(cfg.keep_alive_idle_ms),
        write: Duration::from_millis(cfg.write_timeout_ms),
    };
    let slots = Arc::new(Semaphore::new(cfg.max_connections as usize));
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    // The watchdog owns header and idle deadlines: hyper's own header timer also runs
    // while a keep-alive connection idles, which would make the two one.
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(None)
        .keep_alive(true);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(cfg.max_http2_streams)
        .keep_alive_interval(Some(Duration::from_secs(20)))
        .keep_alive_timeout(Duration::from_secs(20));
    let builder = Arc::new(builder);
    let tracker = TaskTracker::new();
    // Connections over the cap are answered by a few short-lived tasks at most.
    let refusers = Arc::new(Semaphore::new(64));
    let draining = st.shutdown.draining.clone();
    let mut refused_logged = false;
    loop {
        let (stream, peer) = tokio::select! {
            biased;
            _ = draining.cancelled() => break,
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    // Out of file descriptors, most likely: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            if !refused_logged {
                tracing::warn!(
                    max = cfg.max_connections,
                    "connection cap reached; refusing new connections with 503"
                );
                refused_logged = true;
            }
            refuse(stream, &refusers);
            continue;
        };
        refused_logged = false;
        let _ = stream.set_nodelay(true);
        let _ = socket2::SockRef::from(&stream)
            .set_tcp_keepalive(&socket2::TcpKeepalive::new().with_time(Duration::from_secs(60)));
        let conn = Arc::new(ConnState::new(peer));
        let io = TokioIo::new(WatchedIo {
            inner: stream,
            conn: conn.clone(),
        });
        let svc = Svc {
            router: router.clone(),
            conn: conn.clone(),
        };
        let (builder, st) = (builder.clone(), st.clone());
        tracker.spawn(async move {
            let _slot = slot;
            let conn_fut = builder.serve_connection(io, svc);
            tokio::pin!(conn_fut);
            // Registered once per connection, not at every wake-up.
            let draining = st.shutdown.draining.cancelled();
            tokio::pin!(draining);
            let cancel = st.shutdown.cancel.cancelled();
            tokio::pin!(cancel);
            let wake = tokio::time::sleep(limits.recheck());
            tokio::pin!(wake);
            let mut drained = false;
            // Once the shutdown cuts requests, their answers (a 503, a stream's closing
            // error event) get a moment to be written before the connection goes.
            let mut last_call: Option<Instant> = None;
            loop {
                tokio::select! {
                    _ = &mut conn_fut => break,
                    _ = &mut cancel, if last_call.is_none() => {
                        let t = Instant::now() + Duration::from_secs(1);
                        last_call = Some(t);
                        wake.as_mut().reset(t);
                        if !drained {
                            drained = true;
                            conn_fut.as_mut().graceful_shutdown();
                        }
                    }
                    _ = &mut draining, if !drained => {
                        drained = true;
                        conn_fut.as_mut().graceful_shutdown();
                    }
                    _ = &mut wake => {
                        let now = Instant::now();
                        if last_call.is_some_and(|t| t <= now) {
                            break;
                        }
                        let next = match conn.deadline(&limits) {
                            Some((at, why)) if at <= now => {
                                if why == Expiry::Stalled {
                                    conn.stalled.store(true, Ordering::Release);
                                    tracing::info!(peer = %conn.peer, "client stopped reading its answer; connection closed");
                                }
                                break;
                            }
                            Some((at, _)) => at.min(now + limits.recheck()),
                            None => now + limits.recheck(),
                        };
                        let next = last_call.map_or(next, |t| next.min(t));
                        wake.as_mut().reset(next);
                    }
                }
            }
        });
    }
    drop(listener);
    tracker.close();
    tracker.wait().await;
}

/// Answers a connection over the cap with a 503 and closes it. The client's request may
/// already be on its way: it is read and thrown away for a moment, or closing the socket
/// on unread bytes would reset the connection and the 503 would never be seen.
fn refuse(stream: TcpStream, refusers: &Arc<Semaphore>) {
    let Ok(permit) = refusers.clone().try_acquire_owned() else {
        return;
    };
    tokio::spawn(async move {
        let _permit = permit;
        let mut stream = stream;
        let _ = tokio::time::timeout(Duration::from_millis(500), async {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            stream.write_all(&OVER_CAPACITY).await?;
            stream.shutdown().await?;
            let mut sink = [0u8; 4096];
            while stream.read(&mut sink).await? > 0 {}
            Ok::<_, std::io::Error>(())
        })
        .await;
    });
}
