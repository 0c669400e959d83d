//! Limits on request bodies: a deadline for the whole body (so a client
//! trickling one byte at a time cannot hold a handler, and the connection,
//! for as long as it likes) and a small cap on the unauthenticated sign-in
//! form, refused before its body is read.

use super::api::ApiError;
use axum::body::Body;
use axum::extract::Request;
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures::StreamExt as _;
use hyper::body::{Body as HttpBody, Frame, SizeHint};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

/// Largest body of `POST /ui/login` (a form with one token field).
pub const LOGIN_MAX_BODY_BYTES: usize = 4 << 10;

/// The deadline of one request's body, shared by the body and the server
/// that answers 408 when it was missed.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let deadline = idem::ops::body::BodyDeadline::after(std::time::Duration::from_secs(30));
/// assert!(!deadline.missed());
/// # }
/// ```
#[derive(Clone)]
pub struct BodyDeadline {
    at: tokio::time::Instant,
    missed: Arc<AtomicBool>,
}

impl BodyDeadline {
    /// A deadline `timeout` from now.
    pub fn after(timeout: Duration) -> Self {
        BodyDeadline {
            at: tokio::time::Instant::now() + timeout,
            missed: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Whether the body was still arriving when the deadline passed.
    pub fn missed(&self) -> bool {
        self.missed.load(Ordering::Relaxed)
    }
}

/// Why a body read failed at its deadline.
#[derive(Debug, thiserror::Error)]
#[error("the request's body did not arrive in time")]
pub struct BodyTimedOut;

/// A request body that fails with [`BodyTimedOut`] when it is still
/// waiting for bytes at its deadline. Bytes already received are always
/// delivered: only waiting past the deadline fails.
pub struct DeadlineBody<B> {
    inner: B,
    deadline: BodyDeadline,
    sleep: Pin<Box<tokio::time::Sleep>>,
}

impl<B> DeadlineBody<B> {
    /// `inner`, failing once `deadline` passes.
    pub fn new(inner: B, deadline: BodyDeadline) -> Self {
        let sleep = Box::pin(tokio::time::sleep_until(deadline.at));
        DeadlineBody {
            inner,
            deadline,
            sleep,
        }
    }
}

impl<B> HttpBody for DeadlineBody<B>
where
    B: HttpBody + Unpin,
    B::Error: Into<axum::BoxError>,
{
    type Data = B::Data;
    type Error = axum::BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.get_mut();
        if let Poll::Ready(frame) = Pin::new(&mut this.inner).poll_frame(cx) {
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        if this.sleep.as_mut().poll(cx).is_ready() {
            this.deadline.missed.store(true, Ordering::Relaxed);
            return Poll::Ready(Some(Err(Box::new(BodyTimedOut))));
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Middleware: the body of `POST /ui/login` is read here, at most
/// [`LOGIN_MAX_BODY_BYTES`]; a larger one is answered 413 `body_too_large`
/// as soon as its `Content-Length` or its first bytes past the cap say so,
/// without waiting for the rest. Other requests pass untouched.
pub async fn cap_login_body(request: Request, next: Next) -> Response {
    if request.method() != axum::http::Method::POST || request.uri().path() != "/ui/login" {
        return next.run(request).await;
    }
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > LOGIN_MAX_BODY_BYTES as u64) {
        return too_large();
    }
    let (parts, body) = request.into_parts();
    let mut chunks = body.into_data_stream();
    let mut read = Vec::new();
    while let Some(chunk) = chunks.next().await {
        let Ok(chunk) = chunk else {
            // A deadline missed is answered 408 by the server, whatever
            // this says; anything else is a broken request.
            return ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_request",
                "the request's body could not be read",
            )
            .into_response();
        };
        if read.len() + chunk.len() > LOGIN_MAX_BODY_BYTES {
            return too_large();
        }
        read.extend_from_slice(&chunk);
    }
    next.run(Request::from_parts(parts, Body::from(read))).await
}

fn too_large() -> Response {
    let mut response = ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "body_too_large",
        format!("the sign-in form takes at most {LOGIN_MAX_BODY_BYTES} bytes"),
    )
    .into_response();
    // The rest of the body is not read: the connection cannot carry
    // another request.
    response.headers_mut().insert(
        header::CONNECTION,
        header::HeaderValue::from_static("close"),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A body that never sends anything.
    struct Silent;

    impl HttpBody for Silent {
        type Data = bytes::Bytes;
        type Error = std::convert::Infallible;
        fn poll_frame(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
            Poll::Pending
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_still_waiting_at_its_deadline_fails_and_says_so() {
        let deadline = BodyDeadline::after(Duration::from_secs(1));
        let body = Body::new(DeadlineBody::new(Silent, deadline.clone()));
        let started = tokio::time::Instant::now();
        let read = axum::body::to_bytes(body, 1024).await;
        assert!(read.is_err());
        assert_eq!(started.elapsed(), Duration::from_secs(1));
        assert!(deadline.missed());
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_already_there_is_read_after_the_deadline() {
        let deadline = BodyDeadline::after(Duration::from_secs(1));
        tokio::time::advance(Duration::from_secs(5)).await;
        let body = Body::new(DeadlineBody::new(Body::from("token=x"), deadline.clone()));
        let read = axum::body::to_bytes(body, 1024).await.unwrap();
        assert_eq!(&read[..], b"token=x");
        assert!(!deadline.missed());
    }
}
