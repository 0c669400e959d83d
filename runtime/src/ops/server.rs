//! The accept loop of the HTTP surface: HTTP/1.1 connections served by
//! hyper with the limits a listener open to a network needs, which
//! `axum::serve` does not set.
//!
//! - **At most [`Limits::max_connections`] connections at once.** A permit
//!   is taken *before* `accept`, so a connection beyond the limit waits in
//!   the kernel's listen backlog (its request is answered once another
//!   connection closes) and holds no file descriptor of this process: under
//!   `idem run --listen`, HTTP clients cannot use up the descriptors the
//!   worker needs for its store and providers.
//! - **Header read timeout** ([`Limits::header_timeout`], hyper's own): the
//!   time from the moment a connection waits for a request (accepted, or
//!   its previous answer sent) to the end of that request's headers. A
//!   client trickling its headers is disconnected without an answer.
//! - **Body read timeout** ([`Limits::body_timeout`]): a request's body
//!   must have arrived that long after its headers; a body still trickling
//!   then is answered 408 `body_timeout` and the connection closed.
//! - **Idle timeout** ([`Limits::idle_timeout`]): a connection on which no
//!   byte has moved either way for that long, while no handler works on one
//!   of its requests, is closed: a keep-alive connection between requests
//!   (also bounded by the header timeout, whichever is shorter) and a client
//!   that stops reading its answer.
//! - **Graceful shutdown**: when `shutdown` is cancelled, no connection is
//!   accepted any more, idle ones close and a request being handled gets
//!   its answer; [`serve`] returns once every connection has closed.
//!
//! Every request carries `axum::extract::ConnectInfo<SocketAddr>`, the
//! peer's address.

use super::body::{BodyDeadline, DeadlineBody};
use super::headers;
use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::http::{HeaderValue, Request, Response, StatusCode, header};
use axum::response::IntoResponse;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// The limits of every connection (see the module's documentation).
///
/// ```
/// let limits = idem::ops::server::Limits::default();
/// assert_eq!(limits.max_connections, 256);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// From waiting for a request to the end of its headers.
    pub header_timeout: Duration,
    /// From the end of a request's headers to the end of its body.
    pub body_timeout: Duration,
    /// Nothing read or written, no handler running: the connection closes.
    pub idle_timeout: Duration,
    /// Connections served at once; more wait in the listen backlog.
    pub max_connections: usize,
}

/// `--header-timeout`'s default.
pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// `--body-timeout`'s default.
pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(30);
/// `--idle-timeout`'s default.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(5);
/// `--max-connections`'s default.
pub const DEFAULT_MAX_CONNECTIONS: usize = 256;

impl Default for Limits {
    fn default() -> Self {
        Limits {
            header_timeout: DEFAULT_HEADER_TIMEOUT,
            body_timeout: DEFAULT_BODY_TIMEOUT,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            max_connections: DEFAULT_MAX_CONNECTIONS,
        }
    }
}

/// How long to wait after `accept` fails (out of descriptors, say) before
/// trying again, so a failing accept does not spin a core.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Serves `app` on `listener` within `limits` until `shutdown` is
/// cancelled and every open connection has closed.
///
/// ```no_run
/// # async fn demo(app: axum::Router) -> std::io::Result<()> {
/// let listener = tokio::net::TcpListener::bind("127.0.0.1:9090").await?;
/// let shutdown = tokio_util::sync::CancellationToken::new();
/// idem::ops::server::serve(listener, app, idem::ops::server::Limits::default(), shutdown).await;
/// # Ok(())
/// # }
/// ```
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: Limits,
    shutdown: CancellationToken,
) {
    let permits = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let connections = TaskTracker::new();
    loop {
        let permit = tokio::select! {
            _ = shutdown.cancelled() => break,
            permit = permits.clone().acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => break,
            },
        };
        let (stream, peer) = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    tracing::warn!(%error, "HTTP: accept failed");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            },
        };
        let (app, shutdown) = (app.clone(), shutdown.clone());
        connections.spawn(async move {
            serve_connection(stream, peer, app, limits, shutdown).await;
            drop(permit);
        });
    }
    drop(listener);
    connections.close();
    connections.wait().await;
}

/// One connection, from accept to close.
async fn serve_connection(
    stream: TcpStream,
    peer: SocketAddr,
    app: Router,
    limits: Limits,
    shutdown: CancellationToken,
) {
    let activity = Arc::new(Activity::new());
    let io = TokioIo::new(Watched {
        inner: stream,
        activity: activity.clone(),
    });
    let service = {
        let activity = activity.clone();
        let app = TowerToHyperService::new(app);
        hyper::service::service_fn(move |request: Request<Incoming>| {
            let handling = activity.handling();
            let app = app.clone();
            async move {
                let response = answer(&app, request, peer, limits.body_timeout).await;
                drop(handling);
                Ok::<_, Infallible>(response)
            }
        })
    };
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .keep_alive(true);
    let connection = builder.serve_connection(io, service);
    tokio::pin!(connection);
    let mut closing = false;
    loop {
        let idle_check = activity.idle_deadline(limits.idle_timeout);
        tokio::select! {
            result = connection.as_mut() => {
                if let Err(error) = result {
                    tracing::debug!(%error, %peer, "HTTP connection ended");
                }
                return;
            }
            _ = shutdown.cancelled(), if !closing => {
                closing = true;
                connection.as_mut().graceful_shutdown();
            }
            _ = tokio::time::sleep_until(idle_check) => {
                if activity.is_idle(limits.idle_timeout) {
                    tracing::debug!(%peer, "HTTP connection idle: closed");
                    return;
                }
            }
        }
    }
}

/// Runs one request through `app`: the peer's address in its extensions,
/// its body under the body deadline. A body that missed the deadline is
/// answered 408, whatever the route made of the failed read.
async fn answer(
    app: &TowerToHyperService<Router>,
    request: Request<Incoming>,
    peer: SocketAddr,
    body_timeout: Duration,
) -> Response<Body> {
    use hyper::service::Service as _;
    let deadline = BodyDeadline::after(body_timeout);
    let mut request = request.map(|body| Body::new(DeadlineBody::new(body, deadline.clone())));
    request.extensions_mut().insert(ConnectInfo(peer));
    let response = match app.call(request).await {
        Ok(response) => response,
        Err(never) => match never {},
    };
    if deadline.missed() {
        let mut refused = super::api::ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "body_timeout",
            format!(
                "the request's body did not arrive within {}",
                humantime::format_duration(body_timeout)
            ),
        )
        .into_response();
        refused
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
        return headers::secure(refused).await;
    }
    response
}

/// When bytes last moved on a connection and whether a handler is at work
/// on one of its requests: what the idle timeout looks at.
struct Activity {
    /// The connection's start, the origin of `last`.
    opened: Instant,
    /// Milliseconds from `opened` to the last byte read or written.
    last: AtomicU64,
    /// Requests being handled.
    handling: AtomicUsize,
}

impl Activity {
    fn new() -> Self {
        Activity {
            opened: Instant::now(),
            last: AtomicU64::new(0),
            handling: AtomicUsize::new(0),
        }
    }

    fn touch(&self) {
        let since = u64::try_from(self.opened.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last.store(since, Ordering::Relaxed);
    }

    fn last(&self) -> Instant {
        self.opened + Duration::from_millis(self.last.load(Ordering::Relaxed))
    }

    /// When to look again: `idle` after the last byte, or `idle` from now
    /// while a handler runs.
    fn idle_deadline(&self, idle: Duration) -> Instant {
        if self.handling.load(Ordering::Relaxed) > 0 {
            Instant::now() + idle
        } else {
            self.last() + idle
        }
    }

    fn is_idle(&self, idle: Duration) -> bool {
        self.handling.load(Ordering::Relaxed) == 0 && self.last().elapsed() >= idle
    }

    /// Counts a request as handled until the guard is dropped (its answer
    /// made, or the connection gone).
    fn handling(self: &Arc<Self>) -> Handling {
        self.handling.fetch_add(1, Ordering::Relaxed);
        Handling(self.clone())
    }
}

struct Handling(Arc<Activity>);

impl Drop for Handling {
    fn drop(&mut self) {
        self.0.handling.fetch_sub(1, Ordering::Relaxed);
        self.0.touch();
    }
}

/// A stream that records in [`Activity`] every read or write that moved a
/// byte.
struct Watched {
    inner: TcpStream,
    activity: Arc<Activity>,
}

impl AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.touch();
        }
        polled
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        polled
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_connection_is_idle_only_when_nothing_moved_and_no_handler_runs() {
        let idle = Duration::from_secs(5);
        let activity = Arc::new(Activity::new());
        assert!(!activity.is_idle(idle));
        tokio::time::advance(Duration::from_secs(6)).await;
        assert!(activity.is_idle(idle), "nothing moved for 6 s");
        activity.touch();
        assert!(!activity.is_idle(idle));
        assert_eq!(activity.idle_deadline(idle), Instant::now() + idle);
        let handling = activity.handling();
        tokio::time::advance(Duration::from_secs(60)).await;
        assert!(!activity.is_idle(idle), "a handler is at work");
        drop(handling);
        assert!(!activity.is_idle(idle), "its answer counts as activity");
        tokio::time::advance(idle).await;
        assert!(activity.is_idle(idle));
    }

    #[tokio::test]
    async fn every_request_carries_the_peers_address_and_shutdown_closes_idle_connections() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = Router::new().route(
            "/",
            axum::routing::get(|ConnectInfo(peer): ConnectInfo<SocketAddr>| async move {
                peer.to_string()
            }),
        );
        let shutdown = CancellationToken::new();
        let server = tokio::spawn(serve(listener, app, Limits::default(), shutdown.clone()));
        let mut stream = TcpStream::connect(addr).await.unwrap();
        let local = stream.local_addr().unwrap();
        stream
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut text = String::new();
        stream.read_to_string(&mut text).await.unwrap();
        assert!(text.ends_with(&local.to_string()), "{text}");

        let mut idle = TcpStream::connect(addr).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(2), server)
            .await
            .expect("serve returns once its connections closed")
            .unwrap();
        let mut rest = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(1), idle.read_to_end(&mut rest)).await;
        assert!(
            matches!(read, Ok(Ok(0)) | Ok(Err(_))),
            "the idle connection is closed: {read:?}"
        );
    }
}
