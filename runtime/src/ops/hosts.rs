//! The Host allow-list (`--allowed-hosts`): a defence against DNS
//! rebinding. A page on `evil.example` whose name is made to resolve to
//! this host's address reaches the HTTP surface from the victim's browser
//! with `Host: evil.example`; without the list, the routes that need no
//! token (the sign-in form, `/metrics` when open) answer it. With the list,
//! a request whose `Host` (port stripped, case ignored) is not on it is
//! answered 421 `host_not_allowed` before the token check and before any
//! route. `/healthz` is exempt: probes come by address.

use super::api::ApiError;
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::collections::HashSet;
use std::net::Ipv6Addr;
use std::sync::Arc;

/// The host names (or addresses) requests may be addressed to.
///
/// ```
/// let hosts = idem::ops::hosts::AllowedHosts::parse(["idem.example.com", "127.0.0.1"]).unwrap();
/// assert!(hosts.allows("IDEM.example.com:9090"));
/// assert!(!hosts.allows("evil.example"));
/// ```
#[derive(Debug, Clone)]
pub struct AllowedHosts(Arc<HashSet<String>>);

impl AllowedHosts {
    /// The list from names without ports: `idem.example.com`, `127.0.0.1`,
    /// `::1` or `[::1]`. A name with a port, a scheme or a path is refused
    /// (the port is never compared), as is an empty list.
    pub fn parse<S: AsRef<str>>(names: impl IntoIterator<Item = S>) -> Result<Self, String> {
        let mut hosts = HashSet::new();
        for name in names {
            let name = name.as_ref().trim();
            hosts.insert(entry(name)?);
        }
        if hosts.is_empty() {
            return Err("name at least one host".into());
        }
        Ok(AllowedHosts(Arc::new(hosts)))
    }

    /// Whether a `Host` header's value (with or without its port) is on
    /// the list.
    pub fn allows(&self, host: &str) -> bool {
        self.0.contains(&bare_host(host))
    }
}

/// One entry of the list, checked and in the form `bare_host` gives.
fn entry(name: &str) -> Result<String, String> {
    let usable = !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_' | ':' | '[' | ']'));
    if !usable {
        return Err(format!(
            "{name:?} is not a host name (letters, digits, `.`, `-`; an IP address)"
        ));
    }
    let inner = name.trim_start_matches('[').trim_end_matches(']');
    if inner.contains(':') && inner.parse::<Ipv6Addr>().is_err() {
        return Err(format!(
            "{name:?}: name the host without a port (the port is not compared)"
        ));
    }
    Ok(bare_host(name))
}

/// A `Host` value without its port, brackets or trailing dot, in lower
/// case: `IDEM.example.:9090` → `idem.example`, `[::1]:80` → `::1`.
fn bare_host(host: &str) -> String {
    let host = host.trim();
    let name = if let Some(rest) = host.strip_prefix('[') {
        rest.split(']').next().unwrap_or_default()
    } else if host.matches(':').count() == 1 {
        host.split(':').next().unwrap_or_default()
    } else {
        // No port, or an IPv6 address without brackets.
        host
    };
    name.trim_end_matches('.').to_ascii_lowercase()
}

/// Middleware: refuses a request addressed to a host not on the list
/// (`/healthz` excepted); without a list, everything passes.
pub async fn check(
    State(allowed): State<Option<AllowedHosts>>,
    request: Request,
    next: Next,
) -> Response {
    let Some(allowed) = allowed else {
        return next.run(request).await;
    };
    if request.uri().path() == "/healthz" {
        return next.run(request).await;
    }
    // An absolute-form target (`GET http://name/ HTTP/1.1`) names the host
    // the request is for; otherwise the `Host` header does.
    let host = match request.uri().authority() {
        Some(authority) => Some(authority.as_str().to_string()),
        None => request
            .headers()
            .get(header::HOST)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string),
    };
    match host {
        Some(host) if allowed.allows(&host) => next.run(request).await,
        _ => ApiError::new(
            StatusCode::MISDIRECTED_REQUEST,
            "host_not_allowed",
            "this host does not serve that name (see --allowed-hosts)",
        )
        .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_port_case_and_brackets_do_not_count() {
        let hosts = AllowedHosts::parse(["Idem.Example.com", "127.0.0.1", "[::1]"]).unwrap();
        for host in [
            "idem.example.com",
            "IDEM.EXAMPLE.COM:9090",
            "idem.example.com.",
            "127.0.0.1:80",
            "[::1]:9090",
            "[::1]",
        ] {
            assert!(hosts.allows(host), "{host}");
        }
        for host in [
            "evil.example",
            "idem.example.com.evil.example",
            "127.0.0.2",
            "",
            "[::2]:9090",
        ] {
            assert!(!hosts.allows(host), "{host}");
        }
        assert!(AllowedHosts::parse(["::1"]).unwrap().allows("[::1]:1"));
    }

    #[test]
    fn an_entry_with_a_port_a_scheme_or_nothing_is_refused() {
        for bad in ["idem.example:9090", "http://idem.example", "a/b", "", "a b"] {
            assert!(AllowedHosts::parse([bad]).is_err(), "{bad:?}");
        }
        assert!(AllowedHosts::parse(Vec::<String>::new()).is_err());
    }
}
