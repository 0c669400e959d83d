//! The dashboard's stylesheet and script, compiled into the binary and
//! served from `/ui/assets/`: the Content-Security-Policy (see
//! [`super::headers`]) lets pages load styles and scripts from their own
//! origin only, so nothing is inline. They hold no data, so they are served
//! without the token and may be cached; each page links them with a digest
//! of their content (`?v=`), so a new build is fetched at once.

use axum::Router;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use sha2::{Digest, Sha256};
use std::sync::LazyLock;

const STYLESHEET: &str = include_str!("assets/idem.css");
const LIVE_SCRIPT: &str = include_str!("assets/live.js");

/// Where the stylesheet is served.
pub const STYLESHEET_PATH: &str = "/ui/assets/idem.css";
/// Where the overview's live-counter script is served.
pub const LIVE_SCRIPT_PATH: &str = "/ui/assets/live.js";

/// How long a browser may keep an asset: a day, since the link changes
/// with the content anyway.
const CACHE: &str = "public, max-age=86400";

/// The two assets, public.
///
/// ```
/// let _routes: axum::Router<()> = idem::ops::assets::routes();
/// ```
pub fn routes<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new()
        .route(STYLESHEET_PATH, get(stylesheet))
        .route(LIVE_SCRIPT_PATH, get(live_script))
}

/// The `<link>` element of the stylesheet, for a page's `<head>`.
///
/// ```
/// assert!(idem::ops::assets::stylesheet_link().starts_with("<link rel=\"stylesheet\" href=\"/ui/assets/idem.css?v="));
/// ```
pub fn stylesheet_link() -> String {
    static LINK: LazyLock<String> = LazyLock::new(|| {
        format!(
            "<link rel=\"stylesheet\" href=\"{STYLESHEET_PATH}?v={}\">",
            version(STYLESHEET)
        )
    });
    LINK.clone()
}

/// The `<script>` element of the live counters, deferred so it runs once
/// the counters it fills are parsed.
///
/// ```
/// assert!(idem::ops::assets::live_script_tag().contains("src=\"/ui/assets/live.js?v="));
/// ```
pub fn live_script_tag() -> String {
    static TAG: LazyLock<String> = LazyLock::new(|| {
        format!(
            "<script src=\"{LIVE_SCRIPT_PATH}?v={}\" defer></script>",
            version(LIVE_SCRIPT)
        )
    });
    TAG.clone()
}

/// The first 12 hex digits of the content's SHA-256: enough to tell builds
/// apart, short enough for a URL.
fn version(content: &str) -> String {
    let digest = hex::encode(Sha256::digest(content.as_bytes()));
    digest[..12].to_string()
}

async fn stylesheet() -> Response {
    asset("text/css; charset=utf-8", STYLESHEET)
}

async fn live_script() -> Response {
    asset("text/javascript; charset=utf-8", LIVE_SCRIPT)
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, CACHE),
        ],
        body,
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_version_follows_the_content() {
        assert_eq!(version("a"), version("a"));
        assert_ne!(version("a"), version("b"));
        assert_eq!(version("a").len(), 12);
    }

    #[test]
    fn no_asset_holds_markup_a_page_would_need_inline() {
        // The policy refuses inline code: the script must not write any.
        assert!(!LIVE_SCRIPT.contains("<script"));
        assert!(!LIVE_SCRIPT.contains("innerHTML"));
        assert!(!STYLESHEET.contains("<style"));
    }
}
