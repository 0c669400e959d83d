//! The HTTP surface's limits (issue 24, item 3, and the Host allow-list),
//! against a real `idem serve` / `idem run --listen` started with short
//! limits: trickled headers and bodies are cut off, the sign-in form's
//! body is capped, idle connections close, connections beyond the cap wait
//! in the backlog, and only the allowed host names are served.
//!
//! Requests are written by hand on a `TcpStream`, so they can trickle and
//! carry any `Host`.

use serde_json::Value;
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const TOKEN: &str = "serve-limits-token-0123456789";

/// A running `idem` process serving HTTP; killed when dropped.
struct Served {
    addr: SocketAddr,
    _child: tokio::process::Child,
    _dir: tempfile::TempDir,
}

/// `idem serve` (or, with `worker`, `idem run --listen`) on a fresh SQLite
/// store, with `flags` after the command, answering `/healthz`.
async fn start(worker: bool, flags: &[&str]) -> Served {
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("idem.db").display());
    let plugins = dir.path().join("plugins");
    std::fs::create_dir(&plugins).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_idem-test"))
        .current_dir(dir.path())
        .arg("--plugins-dir")
        .arg(&plugins)
        .args(["--database-url", &db])
        .args(if worker {
            ["run", "--listen"]
        } else {
            ["serve", "--listen"]
        })
        .arg(addr.to_string())
        .args(flags)
        .env("IDEM_API_TOKEN", TOKEN)
        .env("IDEM_LOG", "error")
        .env(
            "IDEM_CACHE_DIR",
            std::env::temp_dir().join("idem-serve-limits-cache"),
        )
        .env_remove("IDEM_DATABASE_URL")
        .env_remove("IDEM_CONFIG")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let served = Served {
        addr,
        _child: child,
        _dir: dir,
    };
    for _ in 0..300 {
        if send(addr, &get("/healthz", "127.0.0.1", None)).await.0 == 200 {
            return served;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("idem does not answer /healthz on {addr}");
}

/// A GET request with `Host: host` (and the token), closing the connection.
fn get(path: &str, host: &str, token: Option<&str>) -> String {
    let auth = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    format!("GET {path} HTTP/1.1\r\nHost: {host}\r\n{auth}Connection: close\r\n\r\n")
}

/// What came back on a connection.
#[derive(Debug, PartialEq)]
enum Answer {
    /// An HTTP answer: status and body.
    Http(u16, String),
    /// The connection closed (or was reset) without a byte.
    Closed,
    /// Nothing yet, and the connection is still open.
    Nothing,
}

impl Answer {
    fn status(&self) -> u16 {
        match self {
            Answer::Http(status, _) => *status,
            _ => 0,
        }
    }

    fn error_code(&self) -> String {
        match self {
            Answer::Http(_, body) => serde_json::from_str::<Value>(body)
                .ok()
                .and_then(|v| v["error"]["code"].as_str().map(str::to_string))
                .unwrap_or_else(|| format!("<no error code in {body:?}>")),
            other => format!("<{other:?}>"),
        }
    }
}

/// Reads one answer (status line, headers, a `Content-Length` body) within
/// `wait`.
async fn read_answer(stream: &mut (impl AsyncReadExt + Unpin), wait: Duration) -> Answer {
    let deadline = tokio::time::Instant::now() + wait;
    let mut bytes = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        if let Some(answer) = parse(&bytes) {
            return answer;
        }
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Err(_) if bytes.is_empty() => return Answer::Nothing,
            Err(_) => panic!("a partial answer: {}", String::from_utf8_lossy(&bytes)),
            Ok(Ok(0)) | Ok(Err(_)) if bytes.is_empty() => return Answer::Closed,
            Ok(Ok(0)) | Ok(Err(_)) => {
                panic!("cut off answer: {}", String::from_utf8_lossy(&bytes))
            }
            Ok(Ok(n)) => bytes.extend_from_slice(&buf[..n]),
        }
    }
}

/// A whole answer in `bytes`, if there is one yet.
fn parse(bytes: &[u8]) -> Option<Answer> {
    let text = String::from_utf8_lossy(bytes);
    let (head, body) = text.split_once("\r\n\r\n")?;
    let status: u16 = head.split(' ').nth(1)?.parse().ok()?;
    let length: usize = head
        .lines()
        .find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse().ok())?
        })
        .unwrap_or(0);
    (body.len() >= length).then(|| Answer::Http(status, body[..length].to_string()))
}

/// Sends `request` on a new connection and reads the answer.
async fn send(addr: SocketAddr, request: &str) -> (u16, Answer) {
    let Ok(mut stream) = TcpStream::connect(addr).await else {
        return (0, Answer::Closed);
    };
    if stream.write_all(request.as_bytes()).await.is_err() {
        return (0, Answer::Closed);
    }
    let answer = read_answer(&mut stream, Duration::from_secs(5)).await;
    (answer.status(), answer)
}

/// Writes `text` one byte every `every` on its own task, ignoring errors
/// (the server is expected to hang up).
fn trickle(
    mut writer: tokio::net::tcp::OwnedWriteHalf,
    text: String,
    every: Duration,
) -> tokio::task::JoinHandle<tokio::net::tcp::OwnedWriteHalf> {
    tokio::spawn(async move {
        for byte in text.bytes() {
            if writer.write_all(&[byte]).await.is_err() {
                break;
            }
            tokio::time::sleep(every).await;
        }
        writer
    })
}

#[tokio::test]
async fn headers_trickled_past_the_header_timeout_are_cut_off() {
    let served = start(false, &["--header-timeout", "1s", "--idle-timeout", "30s"]).await;
    let (mut reader, writer) = TcpStream::connect(served.addr).await.unwrap().into_split();
    // 40 header lines, one byte every 20 ms: about 13 s to send.
    let mut request = "GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n".to_string();
    for i in 0..40 {
        request.push_str(&format!("X-Slow-{i}: a\r\n"));
    }
    request.push_str("\r\n");
    let started = Instant::now();
    let _trickler = trickle(writer, request, Duration::from_millis(20));
    let answer = read_answer(&mut reader, Duration::from_secs(5)).await;
    let took = started.elapsed();
    assert!(
        answer == Answer::Closed || answer.status() == 408,
        "trickled headers: {answer:?}"
    );
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(3),
        "cut off after the 1 s header timeout, long before the trickle ends: {took:?}"
    );
    // A request sent at once is still served.
    assert_eq!(
        send(served.addr, &get("/healthz", "127.0.0.1", None))
            .await
            .0,
        200
    );
}

#[tokio::test]
async fn a_trickled_body_is_answered_408_within_the_body_timeout() {
    let served = start(
        false,
        &[
            "--body-timeout",
            "1s",
            "--header-timeout",
            "30s",
            "--idle-timeout",
            "30s",
        ],
    )
    .await;
    let sign_in = format!("token={TOKEN}&padding=aaaaaaaaaaaaaaaaaaaaaaaaa");
    let job = r#"{"plugin": "noop", "payload": {"n": 1}, "key": "trickled-1"}"#.to_string();
    for (what, head, body) in [
        (
            "the sign-in form, without the token",
            format!(
                "POST /ui/login HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\n\r\n",
                sign_in.len()
            ),
            sign_in.clone(),
        ),
        (
            "an enqueue, with the token",
            format!(
                "POST /api/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
                job.len()
            ),
            job.clone(),
        ),
    ] {
        let stream = TcpStream::connect(served.addr).await.unwrap();
        let (mut reader, mut writer) = stream.into_split();
        writer.write_all(head.as_bytes()).await.unwrap();
        let started = Instant::now();
        // One byte every 100 ms: 5 s or more for the body.
        let _trickler = trickle(writer, body, Duration::from_millis(100));
        let answer = read_answer(&mut reader, Duration::from_secs(5)).await;
        let took = started.elapsed();
        assert_eq!(answer.status(), 408, "{what}: {answer:?}");
        assert_eq!(answer.error_code(), "body_timeout", "{what}");
        assert!(
            took >= Duration::from_millis(900) && took < Duration::from_secs(3),
            "{what}: answered after the 1 s body timeout, long before the body ends: {took:?}"
        );
    }
    // The same bodies sent at once are served.
    let (status, answer) = send(
        served.addr,
        &format!(
            "POST /api/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{job}",
            job.len()
        ),
    )
    .await;
    assert_eq!(status, 201, "{answer:?}");
}

#[tokio::test]
async fn a_big_sign_in_body_is_refused_before_it_is_read() {
    let served = start(false, &[]).await;
    // A 4 MiB form announced: refused on its headers alone.
    let mut stream = TcpStream::connect(served.addr).await.unwrap();
    stream
        .write_all(
            format!(
                "POST /ui/login HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\n\r\ntoken=",
                4 << 20
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    let started = Instant::now();
    let answer = read_answer(&mut stream, Duration::from_secs(5)).await;
    assert_eq!(answer.status(), 413, "{answer:?}");
    assert_eq!(answer.error_code(), "body_too_large");
    assert!(started.elapsed() < Duration::from_secs(1));
    // A chunked one, without a length: refused once 4 KiB have come, with
    // the body still open.
    let mut stream = TcpStream::connect(served.addr).await.unwrap();
    let chunk = format!("token={}", "a".repeat(5000));
    stream
        .write_all(
            format!(
                "POST /ui/login HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/x-www-form-urlencoded\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{chunk}\r\n",
                chunk.len()
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    let answer = read_answer(&mut stream, Duration::from_secs(5)).await;
    assert_eq!(answer.status(), 413, "{answer:?}");
    assert_eq!(answer.error_code(), "body_too_large");
    // A form of ordinary size still reaches the sign-in.
    let form = "token=not-the-token-0123456789";
    let (status, answer) = send(
        served.addr,
        &format!(
            "POST /ui/login HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{form}",
            form.len()
        ),
    )
    .await;
    assert_eq!(
        status, 401,
        "a wrong token is refused by the sign-in: {answer:?}"
    );
}

#[tokio::test]
async fn idle_connections_are_closed() {
    let served = start(false, &["--idle-timeout", "1s", "--header-timeout", "30s"]).await;
    // A connection that never sends a byte.
    let mut silent = TcpStream::connect(served.addr).await.unwrap();
    let started = Instant::now();
    assert_eq!(
        read_answer(&mut silent, Duration::from_secs(5)).await,
        Answer::Closed
    );
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(3),
        "{took:?}"
    );
    // A keep-alive connection after its answer.
    let mut kept = TcpStream::connect(served.addr).await.unwrap();
    kept.write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        .await
        .unwrap();
    assert_eq!(
        read_answer(&mut kept, Duration::from_secs(5))
            .await
            .status(),
        200
    );
    let started = Instant::now();
    assert_eq!(
        read_answer(&mut kept, Duration::from_secs(5)).await,
        Answer::Closed
    );
    assert!(started.elapsed() < Duration::from_secs(3));
}

/// Under `idem run --listen`: four idle connections hold the four places;
/// a fifth is not served until one of them closes, and the worker's
/// `/healthz` answers once they are gone.
#[tokio::test]
async fn connections_beyond_the_limit_wait_until_one_closes() {
    let served = start(
        true,
        &[
            "--max-connections",
            "4",
            "--header-timeout",
            "30s",
            "--idle-timeout",
            "30s",
        ],
    )
    .await;
    // The probe in `start` has closed; let the server see it.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut idle = Vec::new();
    for _ in 0..4 {
        idle.push(TcpStream::connect(served.addr).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut fifth = TcpStream::connect(served.addr).await.unwrap();
    fifth
        .write_all(get("/healthz", "127.0.0.1", None).as_bytes())
        .await
        .unwrap();
    assert_eq!(
        read_answer(&mut fifth, Duration::from_millis(1500)).await,
        Answer::Nothing,
        "not served while four connections are open"
    );
    drop(idle.pop());
    let answer = read_answer(&mut fifth, Duration::from_secs(3)).await;
    assert_eq!(answer.status(), 200, "served once one closed: {answer:?}");
    drop(idle);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (status, answer) = send(served.addr, &get("/healthz", "127.0.0.1", None)).await;
    assert_eq!(status, 200, "{answer:?}");
    let Answer::Http(_, body) = answer else {
        unreachable!()
    };
    assert!(body.contains("\"worker\":true"), "{body}");
}

#[tokio::test]
async fn only_the_allowed_hosts_are_served() {
    let served = start(false, &["--allowed-hosts", "idem.test,127.0.0.1"]).await;
    let port = served.addr.port();
    for (path, token) in [
        ("/api/queues", Some(TOKEN)),
        ("/ui", Some(TOKEN)),
        ("/ui/login", None),
        ("/metrics", Some(TOKEN)),
        ("/api/openapi.json", None),
    ] {
        for host in [
            "evil.example",
            &format!("evil.example:{port}"),
            "idem.test.evil.example",
        ] {
            let (status, answer) = send(served.addr, &get(path, host, token)).await;
            assert_eq!(status, 421, "{path} for {host}: {answer:?}");
            assert_eq!(answer.error_code(), "host_not_allowed");
        }
    }
    for host in [
        format!("idem.test:{port}"),
        "IDEM.TEST".to_string(),
        format!("127.0.0.1:{port}"),
    ] {
        let (status, answer) = send(served.addr, &get("/api/queues", &host, Some(TOKEN))).await;
        assert_eq!(status, 200, "{host}: {answer:?}");
    }
    // The token check comes after: the right host without the token is 401.
    let (status, _) = send(served.addr, &get("/api/queues", "idem.test", None)).await;
    assert_eq!(status, 401);
    // Probes come by address, under any name.
    let (status, answer) = send(served.addr, &get("/healthz", "evil.example", None)).await;
    assert_eq!(status, 200, "{answer:?}");
    // No Host at all (HTTP/1.0) is not on the list either.
    let (status, _) = send(served.addr, "GET /api/queues HTTP/1.0\r\n\r\n").await;
    assert_eq!(status, 421);
}

#[tokio::test]
async fn without_the_list_any_host_is_served() {
    let served = start(false, &[]).await;
    let (status, answer) = send(
        served.addr,
        &get("/api/queues", "evil.example", Some(TOKEN)),
    )
    .await;
    assert_eq!(status, 200, "{answer:?}");
}

#[test]
fn bad_limits_are_refused_at_start() {
    for (flags, says) in [
        (&["--allowed-hosts", "idem.test:9090"][..], "without a port"),
        (&["--header-timeout", "0s"][..], "more than zero"),
        (&["--body-timeout", "soon"][..], "--body-timeout"),
        (&["--max-connections", "0"][..], "--max-connections"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_idem-test"))
            .current_dir(dir.path())
            .args([
                "--database-url",
                &format!("sqlite://{}", dir.path().join("idem.db").display()),
            ])
            .args(["serve", "--listen", "127.0.0.1:0"])
            .args(flags)
            .env("IDEM_API_TOKEN", TOKEN)
            .env_remove("IDEM_DATABASE_URL")
            .env_remove("IDEM_CONFIG")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flags:?}: {stderr}");
        assert!(stderr.contains(says), "{flags:?}: {stderr}");
    }
}
