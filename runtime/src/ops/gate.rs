//! The check in front of every route behind the token: the throttle first
//! (a blocked address gets 429 whatever it presents), then the bearer
//! token or the session cookie, then, for a change made with the cookie,
//! the same-origin rule. Wrong credentials count against the client's
//! address ([`super::throttle`]); a request without any does not.

use super::api::{ApiError, ApiState};
use super::auth::{self, Credential};
use super::client::Caller;
use super::session;
use axum::extract::{FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::time::Duration;

/// The caller of a request as this server sees it (`--trust-proxy`
/// decides whether forwarded headers count).
impl FromRequestParts<ApiState> for Caller {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &ApiState,
    ) -> Result<Self, Self::Rejection> {
        let peer = parts
            .extensions
            .get::<axum::extract::ConnectInfo<std::net::SocketAddr>>()
            .map(|info| info.0.ip());
        Ok(Caller::from_parts(
            &parts.headers,
            peer,
            state.access.trust_proxy,
        ))
    }
}

/// 429 `too_many_attempts` with `Retry-After`: the JSON error, or the
/// dashboard's error page under `/ui`.
pub fn too_many_attempts(wait: Duration, page: bool) -> Response {
    let secs = super::throttle::retry_after_secs(wait);
    let error = ApiError::new(
        StatusCode::TOO_MANY_REQUESTS,
        "too_many_attempts",
        format!(
            "too many failed sign-ins or wrong tokens from this address: try again in {secs} s"
        ),
    );
    let mut response = if page {
        super::ui::error_page(error)
    } else {
        error.into_response()
    };
    with_retry_after(&mut response, secs);
    response
}

/// Adds `Retry-After: secs`.
pub fn with_retry_after(response: &mut Response, secs: u64) {
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(secs));
}

/// The token check (an `axum::middleware::from_fn_with_state` layer).
pub async fn require_token(
    State(state): State<ApiState>,
    mut request: Request,
    next: Next,
) -> Response {
    let access = &state.access;
    let Some(tokens) = &access.tokens else {
        return ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "no API token is configured on this host: set IDEM_API_TOKEN (or --api-token-file) and restart",
        )
        .into_response();
    };
    let caller = Caller::of(&request, access.trust_proxy);
    let page = request.uri().path().starts_with("/ui");
    if let Err(wait) = access.throttle.check(caller.address) {
        return too_many_attempts(wait, page);
    }
    let refused = match auth::presented(request.headers(), caller.https) {
        None => return unauthenticated(page, "send the API token: Authorization: Bearer <token>"),
        Some(Credential::Bearer(candidate)) => {
            if tokens.matching(&candidate).is_some() {
                return next.run(request).await;
            }
            "the token is wrong"
        }
        Some(Credential::Session(Some(id))) => {
            match session::is_live(&*state.store, &id, tokens).await {
                Ok(true) => {
                    let safe = matches!(*request.method(), Method::GET | Method::HEAD);
                    if !safe && !auth::same_origin(request.headers()) {
                        return ApiError::new(
                            StatusCode::FORBIDDEN,
                            "cross_origin_refused",
                            "a change made with the dashboard's cookie must come from the dashboard's own pages",
                        )
                        .into_response();
                    }
                    request.extensions_mut().insert(session::Current(id));
                    return next.run(request).await;
                }
                Ok(false) => {
                    "the session is over (it expired, was signed out, or the token changed): sign in again"
                }
                Err(error) => {
                    let error = ApiError::from(error);
                    return if page {
                        super::ui::error_page(error)
                    } else {
                        error.into_response()
                    };
                }
            }
        }
        Some(Credential::Session(None)) => "the session cookie is not a session: sign in again",
    };
    access.throttle.failed(caller.address);
    let mut response = unauthenticated(page, refused);
    // The browser drops a dead session cookie, so its later requests (the
    // overview's refresh) carry none and are not counted as failures.
    if let Ok(clear) = HeaderValue::from_str(&session::clear_cookie(caller.https)) {
        response.headers_mut().append(header::SET_COOKIE, clear);
    }
    response
}

/// 401 with `WWW-Authenticate: Bearer`, or the way to the sign-in page
/// under `/ui`.
fn unauthenticated(page: bool, message: &str) -> Response {
    if page {
        return super::ui::login_redirect();
    }
    let mut response =
        ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", message).into_response();
    response
        .headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    response
}
