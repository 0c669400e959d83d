//! The axum application, and a listener whose connections a handler can kill.

use std::{
    io,
    net::SocketAddr,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};

use axum::{
    Json, Router,
    body::{Body, Bytes},
    extract::{ConnectInfo, Request, State, connect_info::Connected},
    http::{HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
    routing::{get, post},
    serve::{IncomingStream, Listener},
};
use serde::Deserialize;
use serde_json::json;
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::{TcpListener, TcpStream},
};

use super::{
    fault::Fault,
    state::{Begin, Delivery, IncomingRequest, LOOKUP_PREFIX, Reply, Shared, error_reply},
};

/// Request bodies above this size are refused (413) by axum.
const BODY_LIMIT: usize = 4 * 1024 * 1024;

pub(crate) fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/_calls", get(calls))
        .route("/_effects", get(effects))
        .route("/_reset", post(reset))
        .route("/_faults", post(script_faults))
        .route("/_health", get(health))
        .fallback(provider)
        .layer(axum::extract::DefaultBodyLimit::max(BODY_LIMIT))
        .with_state(shared)
}

async fn calls(State(shared): State<Arc<Shared>>) -> Response {
    Json(json!({ "calls": shared.calls() })).into_response()
}

async fn effects(State(shared): State<Arc<Shared>>) -> Response {
    Json(json!({ "effects": shared.effects() })).into_response()
}

async fn reset(State(shared): State<Arc<Shared>>) -> Response {
    shared.reset();
    Json(json!({ "reset": true })).into_response()
}

async fn health() -> Response {
    Json(json!({ "ok": true })).into_response()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FaultScript {
    key: Option<String>,
    path: Option<String>,
    faults: Vec<Fault>,
}

async fn script_faults(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    let script: FaultScript = match serde_json::from_slice(&body) {
        Ok(script) => script,
        Err(e) => return invalid_script(&e.to_string()),
    };
    match (script.key, script.path) {
        (Some(key), None) => {
            let queued = shared.script_key(&key, script.faults);
            Json(json!({ "key": key, "queued": queued })).into_response()
        }
        (None, Some(path)) => {
            let queued = shared.script_path(&path, script.faults);
            Json(json!({ "path": path, "queued": queued })).into_response()
        }
        _ => invalid_script("give exactly one of `key` and `path`"),
    }
}

fn invalid_script(message: &str) -> Response {
    to_response(error_reply(400, "invalid_fault_script", message, &[]))
}

async fn provider(
    State(shared): State<Arc<Shared>>,
    ConnectInfo(conn): ConnectInfo<ConnHandle>,
    request: Request,
) -> Response {
    let (parts, body) = request.into_parts();
    if parts.uri.path().starts_with("/_") {
        return to_response(error_reply(404, "not_found", "unknown control path", &[]));
    }
    if matches!(parts.method.as_str(), "GET" | "HEAD")
        && parts.uri.path().starts_with(LOOKUP_PREFIX)
    {
        let reply = shared.look_up(IncomingRequest {
            method: parts.method.as_str().to_owned(),
            path: parts.uri.path().to_owned(),
            key_header: None,
            fault_header: parts
                .headers
                .get("x-idem-fault")
                .map(|v| v.as_bytes().to_vec()),
            body: Bytes::new(),
        });
        return deliver(reply, &conn).await;
    }
    let body = match axum::body::to_bytes(body, BODY_LIMIT).await {
        Ok(body) => body,
        Err(e) => {
            return to_response(error_reply(400, "unreadable_body", &e.to_string(), &[]));
        }
    };
    let header_bytes = |name: &str| parts.headers.get(name).map(|v| v.as_bytes().to_vec());
    let incoming = IncomingRequest {
        method: parts.method.as_str().to_owned(),
        path: parts.uri.path().to_owned(),
        key_header: header_bytes("idempotency-key"),
        fault_header: header_bytes("x-idem-fault"),
        body,
    };
    tracing::debug!(
        method = %incoming.method,
        path = %incoming.path,
        remote = %conn.remote,
        "provider request"
    );
    let reply = match shared.begin(incoming) {
        Begin::Reply(reply) => reply,
        Begin::Process(in_flight) => {
            tokio::time::sleep(shared.config.processing_delay).await;
            in_flight.finish()
        }
    };
    deliver(reply, &conn).await
}

/// Sends `reply` now, late, or never (its connection killed).
async fn deliver(reply: Reply, conn: &ConnHandle) -> Response {
    match reply.delivery {
        Delivery::Now => to_response(reply),
        Delivery::Late(by) => {
            tokio::time::sleep(by).await;
            to_response(reply)
        }
        Delivery::Drop => {
            conn.kill();
            // Never written: the killed connection fails the write and is closed.
            StatusCode::INTERNAL_SERVER_ERROR.into_response()
        }
    }
}

fn to_response(reply: Reply) -> Response {
    let mut response = Response::new(Body::from(reply.body));
    *response.status_mut() =
        StatusCode::from_u16(reply.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    for (name, value) in reply.headers {
        if let Ok(value) = HeaderValue::from_str(&value) {
            headers.insert(name, value);
        }
    }
    response
}

/// A TCP listener whose streams carry a kill switch, so a handler can make its own
/// connection vanish without a response (the `drop` fault).
pub(crate) struct KillableListener(pub TcpListener);

impl Listener for KillableListener {
    type Io = KillableStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            match self.0.accept().await {
                Ok((stream, addr)) => {
                    if let Err(e) = stream.set_nodelay(true) {
                        tracing::trace!("set_nodelay failed: {e}");
                    }
                    let stream = KillableStream {
                        inner: stream,
                        killed: Arc::new(AtomicBool::new(false)),
                    };
                    return (stream, addr);
                }
                Err(e) => {
                    // Per-connection errors are harmless; others (e.g. EMFILE) need a pause.
                    if !matches!(
                        e.kind(),
                        io::ErrorKind::ConnectionRefused
                            | io::ErrorKind::ConnectionAborted
                            | io::ErrorKind::ConnectionReset
                    ) {
                        tracing::warn!("provider server accept error: {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.0.local_addr()
    }
}

pub(crate) struct KillableStream {
    inner: TcpStream,
    killed: Arc<AtomicBool>,
}

impl KillableStream {
    fn check(&self) -> io::Result<()> {
        if self.killed.load(Ordering::Acquire) {
            Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "connection dropped by injected fault",
            ))
        } else {
            Ok(())
        }
    }
}

impl AsyncRead for KillableStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.check()?;
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for KillableStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.check()?;
        Pin::new(&mut this.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.check()?;
        Pin::new(&mut this.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.check()?;
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// Per-connection info handed to handlers: the peer and the connection's kill switch.
#[derive(Clone)]
pub(crate) struct ConnHandle {
    remote: SocketAddr,
    killed: Arc<AtomicBool>,
}

impl ConnHandle {
    fn kill(&self) {
        self.killed.store(true, Ordering::Release);
    }
}

impl Connected<IncomingStream<'_, KillableListener>> for ConnHandle {
    fn connect_info(stream: IncomingStream<'_, KillableListener>) -> Self {
        Self {
            remote: *stream.remote_addr(),
            killed: Arc::clone(&stream.io().killed),
        }
    }
}
