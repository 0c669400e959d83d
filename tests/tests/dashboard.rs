//! The dashboard in a real browser: Debian's headless Chromium driven
//! through chromedriver (both installed by `scripts/setup`). It signs in with
//! the token, opens a dead job, previews and replays it, and sees it
//! succeed. With `IDEM_SCREENSHOTS=DIR` it saves a screenshot of each page
//! there (`docs/screenshots` holds the committed ones).

use fantoccini::{ClientBuilder, Locator};
use idem::store::NewJob;
use idem_provider_server::Fault;
use idem_tests::{Backend, Harness};
use std::time::Duration;

const TOKEN: &str = "dashboard-token-0123456789";
const KEY: &str = "send_invoice_email/invoice:7:email:v1";

struct Chromedriver(std::process::Child);

impl Drop for Chromedriver {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

async fn chromedriver() -> (Chromedriver, String) {
    let port = free_port();
    let driver = Chromedriver(
        std::process::Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("chromedriver (Debian's chromium-driver; `bash scripts/setup` installs it)"),
    );
    let url = format!("http://127.0.0.1:{port}");
    for _ in 0..100 {
        if tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
        {
            return (driver, url);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("chromedriver did not start listening on {url}");
}

/// The element with this id once the page that has it is loaded (a click
/// that navigates returns before the next page is there).
/// A lookup that lands while the browser navigates fails ("aborted by
/// navigation", no such element): it is asked again until the page is there.
async fn wait_for(client: &fantoccini::Client, id: &str) -> fantoccini::elements::Element {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        match client.find(Locator::Id(id)).await {
            Ok(element) => return element,
            Err(error) if tokio::time::Instant::now() > deadline => {
                panic!("#{id} did not appear: {error}")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

/// A headless Chromium session through a chromedriver of its own.
async fn browser() -> (Chromedriver, fantoccini::Client) {
    let (driver, driver_url) = chromedriver().await;
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".into(),
        serde_json::json!({
            "binary": "/usr/bin/chromium",
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,900"]
        }),
    );
    // chromedriver listens on loopback: plain HTTP, no TLS connector.
    let connector = hyper_util::client::legacy::connect::HttpConnector::new();
    let client = ClientBuilder::new(connector)
        .capabilities(caps)
        .connect(&driver_url)
        .await
        .expect("a chromium session through chromedriver");
    (driver, client)
}

/// Signs in on the sign-in page the browser shows, with the right token.
async fn sign_in(client: &fantoccini::Client) {
    wait_for(client, "token")
        .await
        .send_keys(TOKEN)
        .await
        .unwrap();
    wait_for(client, "sign-in").await.click().await.unwrap();
}

/// The text of the element with this id once `done` accepts it.
async fn wait_until_text(
    client: &fantoccini::Client,
    id: &str,
    done: impl Fn(&str) -> bool,
) -> String {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let text = wait_for(client, id).await.text().await.unwrap_or_default();
        if done(&text) {
            return text;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "#{id} still reads {text:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn screenshot(client: &fantoccini::Client, name: &str) {
    let Ok(dir) = std::env::var("IDEM_SCREENSHOTS") else {
        return;
    };
    let png = client.screenshot().await.expect("screenshot");
    std::fs::create_dir_all(&dir).expect("screenshot dir");
    std::fs::write(std::path::Path::new(&dir).join(format!("{name}.png")), png)
        .expect("write screenshot");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_operator_signs_in_previews_and_replays_a_dead_job() {
    let h = Harness::new(Backend::Sqlite).await;
    // A job that died of a provider's refusal (one of its invoice's group),
    // plus some history.
    let dead = h
        .store
        .job_insert(NewJob {
            group: Some("invoice:7".into()),
            ..NewJob::new(
                "send_invoice_email",
                br#"{"invoice_id": 7, "recipient": "ana@example.com"}"#.to_vec(),
            )
        })
        .await
        .unwrap()
        .id;
    for i in 1..=3 {
        h.store
            .job_insert(NewJob::new(
                "send_invoice_email",
                format!(
                    r#"{{"invoice_id": {}, "recipient": "bo@example.com"}}"#,
                    100 + i
                )
                .into_bytes(),
            ))
            .await
            .unwrap();
    }
    h.provider.script_faults(KEY, vec![Fault::BadRequest]);
    h.drain().await;
    assert_eq!(
        h.store.job_get(dead).await.unwrap().unwrap().state,
        idem::store::JobState::Dead
    );

    // The runtime: a worker and the HTTP surface, as `idem run --listen`.
    let stop = tokio_util::sync::CancellationToken::new();
    let mut settings = h.settings("dashboard-worker");
    settings.exit_when_drained = false;
    let worker =
        idem::queue::Worker::new(h.store.clone(), h.registry.clone(), h.providers(), settings);
    let worker = tokio::spawn({
        let stop = stop.clone();
        async move { worker.run(stop).await }
    });
    let state = h.api_state(TOKEN, true);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let server = tokio::spawn(idem::ops::api::serve(listener, state, stop.clone()));

    let (_driver, client) = browser().await;

    // Not signed in: the dashboard sends the browser to sign in.
    client.goto(&format!("{base}/ui")).await.unwrap();
    assert!(
        client
            .current_url()
            .await
            .unwrap()
            .path()
            .ends_with("/ui/login")
    );
    wait_for(&client, "token")
        .await
        .send_keys("not-the-token")
        .await
        .unwrap();
    wait_for(&client, "sign-in").await.click().await.unwrap();
    let refused = wait_for(&client, "login-error").await.text().await.unwrap();
    assert!(refused.contains("not this host's"), "{refused}");
    screenshot(&client, "login").await;
    sign_in(&client).await;
    let queues = wait_for(&client, "queues").await.text().await.unwrap();
    assert_eq!(client.current_url().await.unwrap().path(), "/ui");
    assert!(queues.contains("all queues"), "{queues}");
    // The stylesheet and the live counters are served files, allowed by
    // the Content-Security-Policy: the page is styled, and the script
    // reads /api/queues and stamps the time of its refresh.
    let header = client.find(Locator::Css("header")).await.unwrap();
    assert_eq!(
        header.css_value("background-color").await.unwrap(),
        "rgba(29, 36, 51, 1)",
        "the stylesheet applies"
    );
    let refreshed = wait_until_text(&client, "refreshed", |text| text != "now").await;
    assert!(refreshed.contains(':'), "a time: {refreshed}");
    let dead_count = wait_for(&client, "c-total-dead")
        .await
        .text()
        .await
        .unwrap();
    assert_eq!(dead_count, "1");
    screenshot(&client, "overview").await;

    // The dead-letter queue, grouped by code.
    wait_for(&client, "nav-dlq").await.click().await.unwrap();
    let group = wait_for(&client, "code-bad_request")
        .await
        .text()
        .await
        .unwrap();
    assert!(group.contains("1 jobs"), "{group}");
    screenshot(&client, "dead-letters").await;

    // Open the job, preview its replay.
    client
        .find(Locator::Css(&format!("#job-{} a", dead.0)))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let state = wait_for(&client, "job-state").await.text().await.unwrap();
    assert_eq!(state, "dead");
    let group = wait_for(&client, "job-group").await.text().await.unwrap();
    assert_eq!(group, "invoice:7", "the job page shows the group");
    let timeline = wait_for(&client, "timeline").await.text().await.unwrap();
    assert!(timeline.contains("bad_request"), "{timeline}");
    screenshot(&client, "job-dead").await;
    client
        .find(Locator::Id(&format!("preview-{}", dead.0)))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let verdict = wait_for(&client, "verdict").await.text().await.unwrap();
    assert!(verdict.contains("safe"), "{verdict}");
    let diff = wait_for(&client, "preview").await.text().await.unwrap();
    assert!(diff.contains(KEY) && diff.contains("same"), "{diff}");
    screenshot(&client, "replay-preview").await;
    assert_eq!(h.provider.requests(KEY), 1, "the preview sent nothing");

    // Replay it and watch it succeed.
    client
        .find(Locator::Id(&format!("replay-{}", dead.0)))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    wait_for(&client, "timeline").await;
    assert_eq!(
        client.current_url().await.unwrap().path(),
        format!("/ui/jobs/{}", dead.0)
    );
    let mut seen = String::new();
    for _ in 0..100 {
        seen = wait_for(&client, "job-state").await.text().await.unwrap();
        if seen == "succeeded" {
            break;
        }
        // The worker polls every 50 ms; the page is reloaded as a person would.
        tokio::time::sleep(Duration::from_millis(100)).await;
        client.refresh().await.unwrap();
    }
    assert_eq!(seen, "succeeded");
    let effects = wait_for(&client, "effects").await.text().await.unwrap();
    assert!(effects.contains("succeeded"), "{effects}");
    screenshot(&client, "job-succeeded").await;
    assert_eq!(h.provider.applied(KEY), 1);

    client.close().await.unwrap();
    stop.cancel();
    let _ = server.await;
    let _ = worker.await;
}

/// Which of these ids, if any, the current frame shows within `within`.
async fn any_shown(client: &fantoccini::Client, ids: &[&str], within: Duration) -> Option<String> {
    let deadline = tokio::time::Instant::now() + within;
    while tokio::time::Instant::now() < deadline {
        for id in ids {
            if client.find(Locator::Id(id)).await.is_ok() {
                return Some((*id).to_string());
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    None
}

/// Clickjacking: a page on another port of the same host is the same site,
/// so a signed-in browser sends the dashboard's cookie into a frame it
/// embeds, and a click there would pass the same-origin check. The
/// dashboard refuses to be framed (`frame-ancestors 'none'`,
/// `X-Frame-Options: DENY`): the frame shows nothing of it, neither the
/// overview nor the sign-in form.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_page_on_another_port_cannot_frame_the_dashboard() {
    let h = Harness::new(Backend::Sqlite).await;
    let stop = tokio_util::sync::CancellationToken::new();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let server = tokio::spawn(idem::ops::api::serve(
        listener,
        h.api_state(TOKEN, false),
        stop.clone(),
    ));
    // The other page: another port of the same host, framing the overview.
    let framer = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let framer_url = format!("http://{}/", framer.local_addr().unwrap());
    let framing_page = format!(
        "<!doctype html><html><body><p id=\"framer\">Win a prize!</p>\
         <iframe src=\"{base}/ui\" width=\"1000\" height=\"700\"></iframe></body></html>"
    );
    let framer_server = tokio::spawn(async move {
        let app = axum::Router::new().route(
            "/",
            axum::routing::get(move || async move { axum::response::Html(framing_page) }),
        );
        axum::serve(framer, app).await
    });

    let (_driver, client) = browser().await;
    client.goto(&format!("{base}/ui")).await.unwrap();
    sign_in(&client).await;
    wait_for(&client, "queues").await;

    client.goto(&framer_url).await.unwrap();
    wait_for(&client, "framer").await;
    client.enter_frame(Some(0)).await.unwrap();
    let shown = any_shown(&client, &["queues", "sign-in"], Duration::from_secs(3)).await;
    assert_eq!(shown, None, "the framed dashboard shows #{shown:?}");

    client.close().await.unwrap();
    stop.cancel();
    let _ = server.await;
    framer_server.abort();
}
