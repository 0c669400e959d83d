//! The headers every answer of the HTTP surface carries, set by one layer
//! on the whole router (see [`super::api::router`]) so no route can forget
//! them:
//!
//! - `Content-Security-Policy`: only the dashboard's own origin may provide
//!   scripts, styles, images and fetches, forms post only there, and
//!   `frame-ancestors 'none'` means no page may frame it (so a page on
//!   another port of the same host cannot clickjack Replay).
//! - `X-Frame-Options: DENY`, the same refusal for browsers without CSP 2.
//! - `X-Content-Type-Options: nosniff`, `Referrer-Policy: no-referrer`.
//! - `Cache-Control: no-store` unless the route chose its own (only the
//!   static assets do): pages, API answers and the sign-in page hold
//!   operator data or credentials and stay out of every cache.

use axum::http::header::{self, HeaderValue};
use axum::response::Response;

/// The policy of every answer: nothing from anywhere but this origin,
/// nothing inline, no framing.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; \
     style-src 'self'; img-src 'self'; connect-src 'self'; form-action 'self'; \
     frame-ancestors 'none'; base-uri 'none'";

/// Adds the security headers to an answer, keeping a `Cache-Control` the
/// route set itself. Used with `axum::middleware::map_response`.
///
/// ```
/// use axum::response::IntoResponse;
/// let answer = futures::executor::block_on(idem::ops::headers::secure("hi".into_response()));
/// assert_eq!(answer.headers()["x-frame-options"], "DENY");
/// assert_eq!(answer.headers()["cache-control"], "no-store");
/// ```
pub async fn secure(mut response: Response) -> Response {
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CONTENT_SECURITY_POLICY),
    );
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    headers
        .entry(header::CACHE_CONTROL)
        .or_insert(HeaderValue::from_static("no-store"));
    response
}
