//! Who is asking and how: the client's address and whether the request
//! came over HTTPS. By default the address is the TCP peer's and nothing a
//! request says about itself counts; with `--trust-proxy` (idem runs behind
//! a reverse proxy the operator controls) the proxy's `X-Forwarded-For` and
//! `X-Forwarded-Proto` are believed.
//!
//! Only the **last** `X-Forwarded-For` entry is taken: a proxy appends the
//! address it saw, so entries before it are whatever the client sent and
//! can be forged.

use axum::extract::ConnectInfo;
use axum::http::{HeaderMap, Request};
use std::net::{IpAddr, SocketAddr};

/// What a request tells about its client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caller {
    /// The client's address: the TCP peer, or the trusted proxy's
    /// forwarded one; `None` when the server recorded no peer.
    pub address: Option<IpAddr>,
    /// Whether the browser reached us over HTTPS (only a trusted proxy can
    /// say so: idem itself serves plain HTTP).
    pub https: bool,
}

impl Caller {
    /// The caller of a request, from its headers and the peer address the
    /// server recorded (`ConnectInfo`).
    ///
    /// ```
    /// use axum::http::Request;
    /// use idem::ops::client::Caller;
    /// let request = Request::builder()
    ///     .header("x-forwarded-for", "203.0.113.9")
    ///     .body(())
    ///     .unwrap();
    /// assert_eq!(Caller::of(&request, false).address, None);
    /// assert_eq!(
    ///     Caller::of(&request, true).address,
    ///     Some("203.0.113.9".parse().unwrap())
    /// );
    /// ```
    pub fn of<B>(request: &Request<B>, trust_proxy: bool) -> Caller {
        let peer = request
            .extensions()
            .get::<ConnectInfo<SocketAddr>>()
            .map(|ConnectInfo(addr)| addr.ip());
        Caller::from_parts(request.headers(), peer, trust_proxy)
    }

    /// [`Caller::of`] from the parts: the headers and the TCP peer.
    pub fn from_parts(headers: &HeaderMap, peer: Option<IpAddr>, trust_proxy: bool) -> Caller {
        if !trust_proxy {
            return Caller {
                address: peer,
                https: false,
            };
        }
        Caller {
            address: last_value(headers, "x-forwarded-for")
                .and_then(|text| parse_forwarded_address(&text))
                .or(peer),
            https: last_value(headers, "x-forwarded-proto")
                .is_some_and(|proto| proto.eq_ignore_ascii_case("https")),
        }
    }
}

/// The last comma-separated entry of the last header of that name (the
/// one the nearest proxy wrote).
fn last_value(headers: &HeaderMap, name: &str) -> Option<String> {
    let value = headers.get_all(name).iter().next_back()?.to_str().ok()?;
    let last = value.rsplit(',').next()?.trim();
    (!last.is_empty()).then(|| last.to_string())
}

/// An address as proxies write it: `203.0.113.9`, `2001:db8::1`,
/// `[2001:db8::1]:4711` or `203.0.113.9:4711`.
fn parse_forwarded_address(text: &str) -> Option<IpAddr> {
    text.parse::<IpAddr>()
        .ok()
        .or_else(|| text.parse::<SocketAddr>().ok().map(|a| a.ip()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(*name, HeaderValue::from_static(value));
        }
        map
    }

    const PEER: &str = "10.0.0.7";

    fn peer() -> Option<IpAddr> {
        PEER.parse().ok()
    }

    #[test]
    fn without_the_flag_forwarded_headers_are_ignored() {
        let spoofed = headers(&[
            ("x-forwarded-for", "203.0.113.9"),
            ("x-forwarded-proto", "https"),
        ]);
        let caller = Caller::from_parts(&spoofed, peer(), false);
        assert_eq!(caller.address, peer(), "a spoofed X-Forwarded-For");
        assert!(!caller.https, "a spoofed X-Forwarded-Proto");
    }

    #[test]
    fn with_the_flag_the_proxys_last_entry_is_the_client() {
        let forwarded = headers(&[
            ("x-forwarded-for", "198.51.100.1, 203.0.113.9"),
            ("x-forwarded-proto", "HTTPS"),
        ]);
        let caller = Caller::from_parts(&forwarded, peer(), true);
        assert_eq!(caller.address, "203.0.113.9".parse().ok());
        assert!(caller.https);
        // Two headers: the client's forged one first, the proxy's last.
        let two = headers(&[
            ("x-forwarded-for", "203.0.113.9"),
            ("x-forwarded-for", "[2001:db8::1]:4711"),
            ("x-forwarded-proto", "https"),
            ("x-forwarded-proto", "http"),
        ]);
        let caller = Caller::from_parts(&two, peer(), true);
        assert_eq!(caller.address, "2001:db8::1".parse().ok());
        assert!(!caller.https, "the proxy says http");
    }

    #[test]
    fn with_the_flag_a_missing_or_garbled_header_falls_back_to_the_peer() {
        for case in [
            headers(&[]),
            headers(&[("x-forwarded-for", "not-an-address")]),
            headers(&[("x-forwarded-for", "203.0.113.9, ")]),
        ] {
            let caller = Caller::from_parts(&case, peer(), true);
            assert_eq!(caller.address, peer(), "{case:?}");
            assert!(!caller.https);
        }
        let caller = Caller::from_parts(
            &headers(&[("x-forwarded-for", "203.0.113.9:80")]),
            None,
            true,
        );
        assert_eq!(caller.address, "203.0.113.9".parse().ok());
    }

    #[test]
    fn the_peer_comes_from_connect_info() {
        let mut request = Request::builder()
            .header("x-forwarded-for", "203.0.113.9")
            .body(())
            .unwrap();
        request
            .extensions_mut()
            .insert(ConnectInfo(SocketAddr::from(([10, 0, 0, 7], 5555))));
        assert_eq!(Caller::of(&request, false).address, peer());
        assert_eq!(
            Caller::of(&request, true).address,
            "203.0.113.9".parse().ok()
        );
    }
}
