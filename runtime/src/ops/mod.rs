//! The operator surface: what an operator sees and does, written once and
//! shared by the command line, the HTTP API and the dashboard, so `idem
//! stats` and `GET /api/queues` show the same numbers and a replay is
//! refused for the same reasons everywhere.
//!
//! # Layout
//! - [`view`]: the read model (queues, jobs with their timeline, dead letters by code).
//! - [`replay`]: dead-letter replay, rate-limited, with its refusals.
//! - [`preview`]: a dry run of the current plugin on dead jobs, its plan beside the stored one.
//! - [`auth`]: the tokens (rules, rotation), compared in constant time, and what a request presents.
//! - [`session`]: dashboard sessions kept in the store; the cookie holds an opaque id.
//! - [`client`]: the client's address and scheme (`--trust-proxy`).
//! - [`throttle`]: failed sign-ins and wrong credentials, by client address.
//! - [`gate`]: the check in front of every route behind the token.
//! - [`api`]: the HTTP routes under `/api/`, `/metrics` and `/healthz`.
//! - [`ui`]: the dashboard at `/ui`, rendered on the server.
//! - [`assets`]: the dashboard's stylesheet and script, served from `/ui/assets/`.
//! - [`headers`]: the security headers every answer carries (CSP, no framing, no-store).
//! - [`server`]: the accept loop: connection cap, header, body and idle timeouts.
//! - [`body`]: the body deadline and the sign-in form's body cap.
//! - [`hosts`]: the Host allow-list (`--allowed-hosts`).

pub mod api;
pub mod assets;
pub mod auth;
pub mod body;
pub mod client;
pub mod gate;
pub mod headers;
pub mod hosts;
pub mod preview;
pub mod replay;
pub mod server;
pub mod session;
pub mod throttle;
pub mod ui;
pub mod view;

use crate::store::StoreError;

/// Why an operator request failed.
#[derive(Debug, thiserror::Error)]
pub enum OpsError {
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// No such job (or other thing).
    #[error("{0}")]
    NotFound(String),
    /// The request cannot be carried out as asked.
    #[error("{0}")]
    Invalid(String),
    /// The plugin could not be run for a preview.
    #[error("{0}")]
    Plugin(String),
}

impl OpsError {
    /// A machine-readable code for API errors.
    pub fn code(&self) -> &'static str {
        match self {
            OpsError::Store(_) => "store_unavailable",
            OpsError::NotFound(_) => "not_found",
            OpsError::Invalid(_) => "invalid_request",
            OpsError::Plugin(_) => "plugin_unavailable",
        }
    }
}
