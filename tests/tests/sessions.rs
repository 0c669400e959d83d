//! Dashboard sessions, throttling and token rules against real `idem serve`
//! processes (issue 24, items 1 and 4): the cookie is an opaque session
//! kept in the store, not the token; signing out ends it on every node;
//! a changed token ends the sessions made with the old one; two tokens
//! work during a rotation; failed sign-ins and wrong tokens are throttled
//! by client address; weak tokens are refused at start-up.

use reqwest::header::HeaderMap;
use sha2::{Digest, Sha256};
use std::time::Duration;
use tokio::process::{Child, Command};

const TOKEN: &str = "9f86d081884c7d659a2feaa0c55ad015";
const OTHER: &str = "2c26b46b68ffc68ff99b453c1d304134";
const THIRD: &str = "fcde2b2edba56bf408601fb721fe9b5c";

/// A store (an SQLite file) that several nodes share.
struct Store {
    dir: tempfile::TempDir,
}

impl Store {
    fn new() -> Store {
        Store {
            dir: tempfile::tempdir().expect("a temp dir"),
        }
    }

    fn url(&self) -> String {
        format!("sqlite://{}", self.dir.path().join("idem.db").display())
    }

    /// `idem serve` on this store with `env` set and `args` added.
    async fn node(&self, env: &[(&str, &str)], args: &[&str]) -> Node {
        let mut child = self.command(env, args);
        child.stdout(std::process::Stdio::null());
        child.stderr(std::process::Stdio::null());
        let port = free_port();
        child.args(["--listen", &format!("127.0.0.1:{port}")]);
        let child = child.spawn().expect("idem serve");
        let node = Node {
            base: format!("http://127.0.0.1:{port}"),
            client: reqwest::Client::builder()
                .redirect(reqwest::redirect::Policy::none())
                .build()
                .expect("a client"),
            _child: child,
        };
        for _ in 0..300 {
            if node
                .client
                .get(node.url("/healthz"))
                .send()
                .await
                .is_ok_and(|r| r.status() == 200)
            {
                return node;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("idem serve did not answer /healthz on {}", node.base);
    }

    fn command(&self, env: &[(&str, &str)], args: &[&str]) -> Command {
        let mut command = Command::new(env!("CARGO_BIN_EXE_idem-test"));
        command
            .args(["--database-url", &self.url()])
            .args(["--plugins-dir", &self.dir.path().display().to_string()])
            .arg("serve")
            .args(args)
            .env_remove("IDEM_API_TOKEN")
            .env_remove("IDEM_API_TOKEN_PREVIOUS")
            .env_remove("IDEM_DATABASE_URL")
            .envs(env.iter().copied())
            .current_dir(self.dir.path())
            .kill_on_drop(true);
        command
    }

    /// The digests the `sessions` table holds.
    async fn stored_digests(&self) -> Vec<String> {
        use sqlx::Connection;
        let mut conn = sqlx::SqliteConnection::connect(&self.url())
            .await
            .expect("the store");
        sqlx::query_scalar("SELECT id_digest FROM sessions")
            .fetch_all(&mut conn)
            .await
            .expect("sessions")
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// One `idem serve` process (killed when dropped).
struct Node {
    base: String,
    client: reqwest::Client,
    _child: Child,
}

/// An answer: status, headers, body.
struct Answer {
    status: u16,
    headers: HeaderMap,
    body: String,
}

impl Answer {
    fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_else(|| panic!("no {name} header ({})", self.status))
    }

    /// The `name=value` part of the `Set-Cookie` header.
    fn cookie(&self) -> String {
        self.header("set-cookie")
            .split(';')
            .next()
            .expect("a cookie")
            .to_string()
    }

    fn error_code(&self) -> String {
        let body: serde_json::Value =
            serde_json::from_str(&self.body).unwrap_or_else(|_| panic!("not JSON: {}", self.body));
        body["error"]["code"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    }
}

impl Node {
    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    async fn send(&self, request: reqwest::RequestBuilder) -> Answer {
        let response = request.send().await.expect("an answer");
        Answer {
            status: response.status().as_u16(),
            headers: response.headers().clone(),
            body: response.text().await.expect("a body"),
        }
    }

    /// `POST /ui/login` with `token` and these extra headers.
    async fn sign_in(&self, token: &str, headers: &[(&str, &str)]) -> Answer {
        let mut request = self
            .client
            .post(self.url("/ui/login"))
            .form(&[("token", token)]);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        self.send(request).await
    }

    /// A GET with a raw `Cookie` header, as curl sends it.
    async fn get_with_cookie(&self, path: &str, cookie: &str) -> Answer {
        self.send(self.client.get(self.url(path)).header("cookie", cookie))
            .await
    }

    async fn get_with_bearer(&self, path: &str, token: &str, from: Option<&str>) -> Answer {
        let mut request = self.client.get(self.url(path)).bearer_auth(token);
        if let Some(from) = from {
            request = request.header("x-forwarded-for", from);
        }
        self.send(request).await
    }

    /// Signs in with `token` and returns the `idem_session=...` pair.
    async fn session(&self, token: &str) -> String {
        let answer = self.sign_in(token, &[]).await;
        assert_eq!(answer.status, 303, "{}", answer.body);
        answer.cookie()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cookie_is_an_opaque_session_and_sign_out_ends_it_on_every_node() {
    let store = Store::new();
    let env = [("IDEM_API_TOKEN", TOKEN)];
    let a = store.node(&env, &[]).await;
    let b = store.node(&env, &[]).await;

    let signed_in = a.sign_in(TOKEN, &[]).await;
    assert_eq!(signed_in.status, 303);
    assert_eq!(signed_in.header("location"), "/ui");
    let set_cookie = signed_in.header("set-cookie").to_string();
    let cookie = signed_in.cookie();
    let value = cookie
        .strip_prefix("idem_session=")
        .unwrap_or_else(|| panic!("{set_cookie}"));
    assert!(
        !set_cookie.contains(TOKEN),
        "the cookie holds the token: {set_cookie}"
    );
    assert_eq!(value.len(), 64, "{value}");
    assert!(value.bytes().all(|b| b.is_ascii_hexdigit()));
    assert_eq!(
        set_cookie,
        format!("{cookie}; Path=/; HttpOnly; SameSite=Strict; Max-Age=43200"),
        "plain HTTP: no Secure, no __Host- prefix"
    );
    // The store holds the id's digest, not the id.
    assert_eq!(
        store.stored_digests().await,
        vec![hex::encode(Sha256::digest(value.as_bytes()))]
    );

    for node in [&a, &b] {
        let page = node.get_with_cookie("/ui", &cookie).await;
        assert_eq!(page.status, 200, "{}", page.body);
        assert!(page.body.contains("id=\"queues\""));
        let api = node.get_with_cookie("/api/queues", &cookie).await;
        assert_eq!(api.status, 200, "{}", api.body);
    }

    let signed_out = a
        .send(
            a.client
                .post(a.url("/ui/logout"))
                .header("cookie", &cookie)
                .header("origin", &a.base),
        )
        .await;
    assert_eq!(signed_out.status, 303);
    assert_eq!(signed_out.header("location"), "/ui/login");
    assert!(
        signed_out
            .header("set-cookie")
            .starts_with("idem_session=;")
            && signed_out.header("set-cookie").ends_with("Max-Age=0"),
        "{}",
        signed_out.header("set-cookie")
    );

    // The old cookie, replayed on either node, opens nothing.
    for node in [&a, &b] {
        let api = node.get_with_cookie("/api/queues", &cookie).await;
        assert_eq!(api.status, 401, "{}", api.body);
        assert_eq!(api.error_code(), "unauthorized");
        let page = node.get_with_cookie("/ui", &cookie).await;
        assert_eq!(page.status, 303);
        assert_eq!(page.header("location"), "/ui/login");
    }
    // Signing out takes the dashboard's own origin, as every change does.
    let other = b.session(TOKEN).await;
    let cross = b
        .send(
            b.client
                .post(b.url("/ui/logout"))
                .header("cookie", &other)
                .header("origin", "http://127.0.0.1:1"),
        )
        .await;
    assert_eq!(cross.status, 403);
    assert_eq!(b.get_with_cookie("/api/queues", &other).await.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_a_trusted_proxy_over_https_the_cookie_is_host_prefixed_and_secure() {
    let store = Store::new();
    let env = [("IDEM_API_TOKEN", TOKEN)];
    let proxied = store
        .node(&env, &["--trust-proxy", "--session-ttl", "2h"])
        .await;
    let https = [("x-forwarded-proto", "https")];
    let signed_in = proxied.sign_in(TOKEN, &https).await;
    assert_eq!(signed_in.status, 303);
    let cookie = signed_in.cookie();
    assert!(cookie.starts_with("__Host-idem_session="), "{cookie}");
    assert_eq!(
        signed_in.header("set-cookie"),
        format!("{cookie}; Path=/; Secure; HttpOnly; SameSite=Strict; Max-Age=7200")
    );
    let page = proxied
        .send(
            proxied
                .client
                .get(proxied.url("/ui"))
                .header("cookie", &cookie)
                .header("x-forwarded-proto", "https"),
        )
        .await;
    assert_eq!(page.status, 200);
    // The proxy says http: the plain cookie.
    let plain = proxied
        .sign_in(TOKEN, &[("x-forwarded-proto", "http")])
        .await;
    assert!(plain.cookie().starts_with("idem_session="));
    assert!(!plain.header("set-cookie").contains("Secure"));

    // Without --trust-proxy, a request's own X-Forwarded-Proto counts for
    // nothing.
    let direct = store.node(&env, &[]).await;
    let spoofed = direct.sign_in(TOKEN, &https).await;
    assert!(spoofed.cookie().starts_with("idem_session="));
    assert!(!spoofed.header("set-cookie").contains("Secure"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_token_ends_old_sessions_and_a_rotation_accepts_both() {
    let store = Store::new();
    let first = store.node(&[("IDEM_API_TOKEN", TOKEN)], &[]).await;
    let old_session = first.session(TOKEN).await;
    assert_eq!(first.get_with_cookie("/ui", &old_session).await.status, 200);
    drop(first);

    // A rotation: the new token current, the old one previous.
    let rotating = store
        .node(
            &[
                ("IDEM_API_TOKEN", OTHER),
                ("IDEM_API_TOKEN_PREVIOUS", TOKEN),
            ],
            &[],
        )
        .await;
    assert_eq!(
        rotating.get_with_cookie("/ui", &old_session).await.status,
        200,
        "a session made with the previous token lives on during the rotation"
    );
    for token in [TOKEN, OTHER] {
        let answer = rotating.get_with_bearer("/api/queues", token, None).await;
        assert_eq!(answer.status, 200, "bearer {token}");
    }
    let new_session = rotating.session(OTHER).await;
    let previous_session = rotating.session(TOKEN).await;
    drop(rotating);

    // The rotation is over: sessions made with the old token are not.
    let rotated = store.node(&[("IDEM_API_TOKEN", OTHER)], &[]).await;
    for session in [&old_session, &previous_session] {
        let answer = rotated.get_with_cookie("/api/queues", session).await;
        assert_eq!(answer.status, 401, "{}", answer.body);
    }
    assert_eq!(
        rotated
            .get_with_cookie("/api/queues", &new_session)
            .await
            .status,
        200
    );
    assert_eq!(
        rotated
            .get_with_bearer("/api/queues", TOKEN, None)
            .await
            .status,
        401
    );
    drop(rotated);

    // A token file of two lines: the current token, then the previous one.
    let file = store.dir.path().join("tokens");
    std::fs::write(&file, format!("{THIRD}\n{OTHER}\n")).unwrap();
    let from_file = store
        .node(&[], &["--api-token-file", &file.display().to_string()])
        .await;
    for (token, status) in [(THIRD, 200), (OTHER, 200), (TOKEN, 401)] {
        let answer = from_file.get_with_bearer("/api/queues", token, None).await;
        assert_eq!(answer.status, status, "bearer {token}");
    }
    assert_eq!(
        from_file
            .get_with_cookie("/api/queues", &new_session)
            .await
            .status,
        200
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_sign_ins_and_wrong_tokens_are_throttled_by_client_address() {
    let store = Store::new();
    let env = [("IDEM_API_TOKEN", TOKEN)];
    let node = store.node(&env, &["--trust-proxy"]).await;
    let from = |address: &'static str| [("x-forwarded-for", address)];

    // Sign-in: the first five wrong tokens are 401, the rest 429.
    let mut statuses = Vec::new();
    for i in 0..30 {
        let answer = node
            .sign_in(
                &format!("wrong-token-{i:02}-0123456789"),
                &from("203.0.113.5"),
            )
            .await;
        if answer.status == 429 {
            let wait: u64 = answer.header("retry-after").parse().unwrap();
            assert!((1..=60).contains(&wait), "Retry-After: {wait}");
            assert!(
                answer.body.contains("Too many failed sign-ins"),
                "{}",
                answer.body
            );
        }
        statuses.push(answer.status);
    }
    assert_eq!(statuses[..5], [401; 5]);
    assert!(statuses[5..].iter().all(|s| *s == 429), "{statuses:?}");
    let blocked = node.sign_in(TOKEN, &from("203.0.113.5")).await;
    assert_eq!(blocked.status, 429, "the right token during the block");
    assert!(blocked.headers.get("set-cookie").is_none());
    let elsewhere = node.sign_in(TOKEN, &from("203.0.113.6")).await;
    assert_eq!(elsewhere.status, 303, "another address is served");
    // The block covers the API from that address too.
    let api = node
        .get_with_bearer("/api/queues", TOKEN, Some("203.0.113.5"))
        .await;
    assert_eq!(api.status, 429);

    // Bearer tokens on the API: the same.
    let mut statuses = Vec::new();
    for i in 0..30 {
        let answer = node
            .get_with_bearer(
                "/api/queues",
                &format!("wrong-token-{i:02}-0123456789"),
                Some("203.0.113.7"),
            )
            .await;
        if answer.status == 429 {
            assert_eq!(answer.error_code(), "too_many_attempts");
            let wait: u64 = answer.header("retry-after").parse().unwrap();
            assert!((1..=60).contains(&wait), "Retry-After: {wait}");
        }
        statuses.push(answer.status);
    }
    assert_eq!(statuses[..5], [401; 5]);
    assert!(statuses[5..].iter().all(|s| *s == 429), "{statuses:?}");
    let right = node
        .get_with_bearer("/api/queues", TOKEN, Some("203.0.113.7"))
        .await;
    assert_eq!(right.status, 429, "the right token during the block");
    assert_eq!(right.error_code(), "too_many_attempts");
    let elsewhere = node
        .get_with_bearer("/api/queues", TOKEN, Some("203.0.113.8"))
        .await;
    assert_eq!(elsewhere.status, 200);
    // A forged cookie counts as a wrong credential too.
    for _ in 0..5 {
        let answer = node
            .send(
                node.client
                    .get(node.url("/api/queues"))
                    .header("cookie", format!("idem_session={}", "ab".repeat(32)))
                    .header("x-forwarded-for", "203.0.113.9"),
            )
            .await;
        assert_eq!(answer.status, 401);
    }
    let right = node
        .get_with_bearer("/api/queues", TOKEN, Some("203.0.113.9"))
        .await;
    assert_eq!(right.status, 429);
    drop(node);

    // Without --trust-proxy a forged X-Forwarded-For changes nothing: the
    // address is the peer's.
    let direct = store.node(&env, &[]).await;
    for i in 0..5 {
        let forged = format!("198.51.100.{i}");
        let answer = direct
            .send(
                direct
                    .client
                    .get(direct.url("/api/queues"))
                    .bearer_auth("wrong-token-0123456789")
                    .header("x-forwarded-for", forged),
            )
            .await;
        assert_eq!(answer.status, 401);
    }
    let answer = direct
        .get_with_bearer("/api/queues", TOKEN, Some("198.51.100.200"))
        .await;
    assert_eq!(answer.status, 429, "the peer 127.0.0.1 is blocked");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weak_tokens_are_refused_at_start_naming_the_rule() {
    let store = Store::new();
    let start = |env: Vec<(&'static str, String)>| {
        let mut command = store.command(&[], &["--listen", "127.0.0.1:0"]);
        command.envs(env);
        async move {
            let out = tokio::time::timeout(Duration::from_secs(60), command.output())
                .await
                .expect("idem serve exits")
                .expect("idem serve runs");
            (
                out.status.code(),
                String::from_utf8_lossy(&out.stderr).into_owned(),
            )
        }
    };
    for (env, rule) in [
        (
            vec![("IDEM_API_TOKEN", "a".repeat(16))],
            "at least 8 distinct characters",
        ),
        (
            vec![("IDEM_API_TOKEN", "ab".repeat(12))],
            "at least 8 distinct characters",
        ),
        (
            vec![("IDEM_API_TOKEN", "0123456789abc".into())],
            "at least 16 characters",
        ),
        (
            vec![
                ("IDEM_API_TOKEN", TOKEN.into()),
                ("IDEM_API_TOKEN_PREVIOUS", "x".repeat(40)),
            ],
            "IDEM_API_TOKEN_PREVIOUS is refused",
        ),
    ] {
        let (code, stderr) = start(env.clone()).await;
        assert_eq!(code, Some(2), "{env:?}: {stderr}");
        assert!(stderr.contains(rule), "{env:?}: {stderr}");
    }
}
