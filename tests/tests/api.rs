//! The HTTP API, end to end over a real socket: the token, every route's
//! answers, the JSON errors, the replay with its preview, and a randomized
//! run of malformed requests that must never get a 500 or a panic.

use idem::ops::api::{ROUTES, router};
use idem::store::{JobState, NewJob};
use idem_provider_server::Fault;
use idem_tests::{Backend, Harness, both_backends};
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

const TOKEN: &str = "test-token-0123456789abcdef";
const KEY: &str = "send_invoice_email/invoice:42:email:v1";

struct Api {
    base: String,
    client: reqwest::Client,
    _server: tokio::task::JoinHandle<()>,
}

impl Api {
    async fn start(h: &Harness) -> Api {
        Api::serving(h.api_state(TOKEN, false)).await
    }

    async fn serving(state: idem::ops::api::ApiState) -> Api {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let server = tokio::spawn(async move {
            axum::serve(listener, router(state)).await.unwrap();
        });
        Api {
            base,
            client: reqwest::Client::new(),
            _server: server,
        }
    }

    async fn call(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        let mut request = self
            .client
            .request(method.parse().unwrap(), format!("{}{path}", self.base))
            .bearer_auth(TOKEN);
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request.send().await.unwrap();
        let status = response.status().as_u16();
        let text = response.text().await.unwrap();
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    async fn get(&self, path: &str) -> (u16, Value) {
        self.call("GET", path, None).await
    }

    async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        self.call("POST", path, Some(body)).await
    }
}

fn error_code(body: &Value) -> &str {
    body["error"]["code"].as_str().unwrap_or("<no error code>")
}

async fn every_route_but_healthz_asks_for_the_token(backend: Backend) {
    let h = Harness::new(backend).await;
    let api = Api::start(&h).await;
    let anonymous = reqwest::Client::new();
    for (method, path) in ROUTES {
        let path = path.replace("{id}", "1");
        let response = anonymous
            .request(
                method.to_uppercase().parse().unwrap(),
                format!("{}{path}", api.base),
            )
            .send()
            .await
            .unwrap();
        let status = response.status().as_u16();
        match path.as_str() {
            "/healthz" | "/api/openapi.json" => assert_eq!(status, 200, "{path}"),
            _ => {
                assert_eq!(status, 401, "{method} {path} without a token");
                let body: Value = response.json().await.unwrap();
                assert_eq!(error_code(&body), "unauthorized", "{path}");
            }
        }
    }
    let wrong = anonymous
        .get(format!("{}/api/queues", api.base))
        .bearer_auth("test-token-0123456789abcdeX")
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status().as_u16(), 401);
    let (status, _) = api.get("/api/queues").await;
    assert_eq!(status, 200);
    // The dashboard sends a browser without a session to sign in.
    let page = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
        .get(format!("{}/ui", api.base))
        .send()
        .await
        .unwrap();
    assert_eq!(page.status().as_u16(), 303);
    assert_eq!(page.headers()["location"], "/ui/login");
}

async fn enqueue_list_show_and_cancel(backend: Backend) {
    let h = Harness::new(backend).await;
    let api = Api::start(&h).await;
    let job = json!({"plugin": "noop", "payload": {"n": 1}, "key": "order-1", "queue": "billing", "priority": 3, "correlation_id": "c-1", "group": "order:1"});
    let (status, first) = api.post("/api/jobs", job.clone()).await;
    assert_eq!(status, 201, "{first}");
    let (status, again) = api.post("/api/jobs", job).await;
    assert_eq!(status, 200, "a repeated key returns the same job");
    assert_eq!(again["id"], first["id"]);
    assert_eq!(again["inserted"], false);
    let (status, batch) = api
        .post(
            "/api/jobs/batch",
            json!({"jobs": [{"plugin": "noop", "group": "order:2"}, {"plugin": "noop", "delay": "1h"}, {"plugin": "noop", "key": "order-1", "queue": "billing"}]}),
        )
        .await;
    assert_eq!(status, 200, "{batch}");
    let ids: Vec<i64> = batch["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["id"].as_i64().unwrap())
        .collect();
    assert_eq!(
        ids[2],
        first["id"].as_i64().unwrap(),
        "dedup inside a batch"
    );

    let (_, page) = api.get("/api/jobs?limit=2").await;
    assert_eq!(page["jobs"].as_array().unwrap().len(), 2);
    let next = page["next_before"].as_i64().expect("a second page");
    let (_, rest) = api.get(&format!("/api/jobs?limit=2&before={next}")).await;
    assert_eq!(rest["jobs"].as_array().unwrap().len(), 1);
    assert_eq!(rest["next_before"], Value::Null);
    let (_, billing) = api.get("/api/jobs?queue=billing").await;
    assert_eq!(billing["jobs"].as_array().unwrap().len(), 1);

    let id = first["id"].as_i64().unwrap();
    let (status, detail) = api.get(&format!("/api/jobs/{id}")).await;
    assert_eq!(status, 200);
    assert_eq!(detail["state"], "available");
    assert_eq!(detail["queue"], "billing");
    assert_eq!(detail["payload"], json!({"n": 1}));
    assert_eq!(detail["correlation_id"], "c-1");
    assert_eq!(detail["group"], "order:1");
    let (_, batched) = api.get(&format!("/api/jobs/{}", ids[0])).await;
    assert_eq!(batched["group"], "order:2", "a batch's job keeps its group");
    assert_eq!(detail["timeline"][0]["event"], "enqueued");

    let (status, cancelled) = api.post(&format!("/api/jobs/{id}/cancel"), json!({})).await;
    assert_eq!(status, 200, "{cancelled}");
    let (status, again) = api.post(&format!("/api/jobs/{id}/cancel"), json!({})).await;
    assert_eq!(status, 409, "{again}");
    assert_eq!(error_code(&again), "not_cancellable");
    let (status, missing) = api.get("/api/jobs/999999").await;
    assert_eq!((status, error_code(&missing)), (404, "not_found"));
    let (status, queues) = api.get("/api/queues").await;
    assert_eq!(status, 200);
    assert_eq!(queues["total"]["jobs"]["cancelled"], 1);
    let names: Vec<&str> = queues["queues"]
        .as_array()
        .unwrap()
        .iter()
        .map(|q| q["queue"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["billing", "default"]);
}

async fn bad_requests_get_clear_json_errors(backend: Backend) {
    let h = Harness::new(backend).await;
    let api = Api::start(&h).await;
    let cases: Vec<(&str, &str, Option<Value>, u16, &str)> = vec![
        (
            "POST",
            "/api/jobs",
            Some(json!({"payload": {}})),
            400,
            "invalid_json",
        ),
        (
            "POST",
            "/api/jobs",
            Some(json!({"plugin": "noop", "surprise": 1})),
            400,
            "invalid_json",
        ),
        (
            "POST",
            "/api/jobs",
            Some(json!({"plugin": "noop", "key": "bad\nkey"})),
            400,
            "invalid_request",
        ),
        (
            "POST",
            "/api/jobs",
            Some(json!({"plugin": "noop", "group": "bad\u{0}group"})),
            400,
            "invalid_request",
        ),
        (
            "POST",
            "/api/jobs",
            Some(json!({"plugin": "noop", "group": ""})),
            400,
            "invalid_request",
        ),
        (
            "POST",
            "/api/jobs",
            Some(json!({"plugin": "", "payload": 1})),
            400,
            "invalid_request",
        ),
        (
            "POST",
            "/api/jobs",
            Some(json!({"plugin": "noop", "delay": "soon"})),
            400,
            "invalid_json",
        ),
        (
            "POST",
            "/api/jobs/batch",
            Some(json!({"jobs": []})),
            400,
            "invalid_request",
        ),
        (
            "GET",
            "/api/jobs?state=exploded",
            None,
            400,
            "invalid_request",
        ),
        ("GET", "/api/jobs?limit=-1", None, 400, "invalid_request"),
        ("GET", "/api/jobs/abc", None, 400, "invalid_request"),
        ("GET", "/api/jobs/-3", None, 400, "invalid_request"),
        (
            "POST",
            "/api/dlq/replay",
            Some(json!({})),
            400,
            "invalid_request",
        ),
        (
            "POST",
            "/api/dlq/replay",
            Some(json!({"ids": [0]})),
            400,
            "invalid_request",
        ),
        ("GET", "/api/nothing-here", None, 404, "not_found"),
        // Issue 24, item 7: a path that does not decode, on every `{id}`
        // route, and a method a route does not take.
        ("GET", "/api/jobs/%FF", None, 400, "invalid_request"),
        ("POST", "/api/jobs/%FF/cancel", None, 400, "invalid_request"),
        ("GET", "/api/dlq/%FF", None, 400, "invalid_request"),
        ("DELETE", "/api/jobs/1", None, 405, "method_not_allowed"),
        ("PUT", "/api/dlq/replay", None, 405, "method_not_allowed"),
        // Issue 24, item 6: bounded ids, no control characters.
        (
            "POST",
            "/api/jobs",
            Some(json!({"plugin": "noop", "correlation_id": "c".repeat(3 << 20)})),
            400,
            "invalid_request",
        ),
        (
            "POST",
            "/api/jobs",
            Some(json!({"plugin": "noop", "queue": "a\nb"})),
            400,
            "invalid_request",
        ),
        (
            "POST",
            "/api/jobs",
            Some(json!({"plugin": "\u{1b}[2J"})),
            400,
            "invalid_request",
        ),
    ];
    for (method, path, body, status, code) in cases {
        let (got, answer) = api.call(method, path, body).await;
        assert_eq!(
            (got, error_code(&answer)),
            (status, code),
            "{method} {path}: {answer}"
        );
        assert!(
            answer["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty())
        );
    }
    // Each refusal names the field, and a batch the job.
    let refusals = [
        (
            json!({"plugin": "noop", "correlation_id": "c".repeat(3 << 20)}),
            "correlation id",
        ),
        (json!({"plugin": "noop", "queue": "a\nb"}), "queue"),
        (json!({"plugin": "\u{1b}[2J"}), "plugin"),
    ];
    for (job, field) in refusals {
        let (_, single) = api.post("/api/jobs", job.clone()).await;
        let message = single["error"]["message"].as_str().unwrap_or("");
        assert!(message.contains(field), "{field}: {message}");
        assert!(message.len() < 1024, "the value is not echoed whole");
        let batch = json!({"jobs": [{"plugin": "noop"}, job]});
        let (status, answer) = api.post("/api/jobs/batch", batch).await;
        assert_eq!((status, error_code(&answer)), (400, "invalid_request"));
        let message = answer["error"]["message"].as_str().unwrap_or("");
        assert!(
            message.starts_with("jobs[1]: ") && message.contains(field),
            "{field}: {message}"
        );
    }
    // The undecodable path is JSON (not axum's text/plain), a wrong method
    // says which ones it takes, and the dashboard answers with its page.
    for (method, path, status, content_type) in [
        ("GET", "/api/jobs/%FF", 400, "application/json"),
        ("DELETE", "/api/jobs/1", 405, "application/json"),
        ("GET", "/ui/jobs/%FF", 400, "text/html"),
        ("POST", "/ui/dlq/%FF/preview", 400, "text/html"),
        ("POST", "/ui/dlq/%FF/replay", 400, "text/html"),
        ("DELETE", "/ui/jobs/1", 405, "text/html"),
    ] {
        let response = api
            .client
            .request(method.parse().unwrap(), format!("{}{path}", api.base))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status().as_u16(), status, "{method} {path}");
        let got = response.headers()["content-type"]
            .to_str()
            .unwrap()
            .to_string();
        assert!(got.starts_with(content_type), "{method} {path}: {got}");
        if status == 405 {
            assert!(response.headers().contains_key("allow"), "{method} {path}");
        }
        let body = response.text().await.unwrap();
        let code = if status == 400 {
            "invalid_request"
        } else {
            "method_not_allowed"
        };
        assert!(body.contains(code), "{method} {path}: {body}");
    }
    // A wrong method is answered only to a caller with the token.
    let anonymous = reqwest::Client::new()
        .delete(format!("{}/api/jobs/1", api.base))
        .send()
        .await
        .unwrap();
    assert_eq!(anonymous.status().as_u16(), 401);
    // `/api/dlq/{id}` shows dead jobs only.
    let fresh = h
        .store
        .job_insert(NewJob::new("noop", b"{}".to_vec()))
        .await
        .unwrap()
        .id;
    let (status, answer) = api.get(&format!("/api/dlq/{fresh}")).await;
    assert_eq!(
        (status, error_code(&answer)),
        (404, "not_found"),
        "{answer}"
    );
    assert!(
        answer["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("not dead") && m.contains("available")),
        "{answer}"
    );
    let (status, _) = api.get(&format!("/api/jobs/{fresh}")).await;
    assert_eq!(status, 200);
    h.store.job_cancel(fresh).await.unwrap();
    // Not JSON at all, and a body over the cap.
    let raw = api
        .client
        .post(format!("{}/api/jobs", api.base))
        .bearer_auth(TOKEN)
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(raw.status().as_u16(), 400);
    let huge = "x".repeat(idem::ops::api::MAX_BODY_BYTES + 10);
    let big = api
        .client
        .post(format!("{}/api/jobs", api.base))
        .bearer_auth(TOKEN)
        .json(&json!({"plugin": "noop", "payload": huge}))
        .send()
        .await
        .unwrap();
    assert_eq!(big.status().as_u16(), 413);
    let body: Value = big.json().await.unwrap();
    assert_eq!(error_code(&body), "body_too_large");
    // Nothing was enqueued by any of it.
    assert_eq!(
        h.store
            .queue_stats(None)
            .await
            .unwrap()
            .count(JobState::Available),
        0
    );
}

async fn a_dead_job_is_previewed_then_replayed(backend: Backend) {
    let h = Harness::new(backend).await;
    let id = h
        .store
        .job_insert(NewJob::new(
            "send_invoice_email",
            br#"{"invoice_id": 42, "recipient": "ana@example.com"}"#.to_vec(),
        ))
        .await
        .unwrap()
        .id;
    h.provider.script_faults(KEY, vec![Fault::BadRequest]);
    h.drain().await;
    let api = Api::start(&h).await;
    let (_, dlq) = api.get("/api/dlq").await;
    assert_eq!(dlq["by_code"], json!([{"code": "bad_request", "jobs": 1}]));
    assert_eq!(dlq["jobs"][0]["id"], id.0);
    let (status, dead) = api.get(&format!("/api/dlq/{id}")).await;
    assert_eq!((status, &dead["state"]), (200, &json!("dead")), "{dead}");

    let (status, preview) = api.post("/api/dlq/preview", json!({"ids": [id.0]})).await;
    assert_eq!(status, 200, "{preview}");
    let job = &preview["jobs"][0];
    assert_eq!(job["keys"][0]["key"], KEY);
    assert_eq!(job["keys"][0]["change"], "same");
    assert_eq!(job["keys"][0]["ledger"], "failed");
    assert!(job["verdict"].as_str().unwrap().contains("safe"), "{job}");
    // The dry run changed nothing.
    assert_eq!(
        h.store.job_get(id).await.unwrap().unwrap().state,
        JobState::Dead
    );
    let (_, dry) = api
        .post("/api/dlq/replay", json!({"ids": [id.0], "dry_run": true}))
        .await;
    assert_eq!(dry["dry_run"], true);

    let (status, report) = api
        .post("/api/dlq/replay", json!({"code": "bad_request"}))
        .await;
    assert_eq!(status, 200, "{report}");
    assert_eq!(report["replayed"][0]["id"], id.0);
    assert_eq!(report["refused"], json!([]));
    h.drain().await;
    let (_, detail) = api.get(&format!("/api/jobs/{id}")).await;
    assert_eq!(detail["state"], "succeeded", "{detail}");
    assert_eq!(detail["effects"][0]["status"], "succeeded");
    assert_eq!(h.provider.applied(KEY), 1);
}

async fn the_openapi_document_lists_every_route(_backend: Backend) {
    let doc: Value = serde_json::from_str(idem::ops::api::OPENAPI).unwrap();
    assert_eq!(doc["openapi"], "3.0.3");
    for (method, path) in ROUTES {
        assert!(
            doc["paths"][path][method].is_object(),
            "{method} {path} is not documented"
        );
    }
    let documented: usize = doc["paths"]
        .as_object()
        .unwrap()
        .values()
        .map(|p| p.as_object().unwrap().len())
        .sum();
    assert_eq!(documented, ROUTES.len(), "a documented route is not served");
}

/// Randomized requests: mutated bodies, odd query strings and paths. None
/// may produce a 5xx other than 503, every error is the JSON error shape,
/// and the server keeps answering.
async fn malformed_requests_never_break_the_api(backend: Backend) {
    let h = Harness::new(backend).await;
    let api = Api::start(&h).await;
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x1de5);
    let seeds = [
        r#"{"plugin":"noop","payload":{"a":[1,2,{"b":null}]},"key":"k-1","delay":"5s","priority":1}"#,
        r#"{"jobs":[{"plugin":"noop"},{"plugin":"noop","queue":"q"}]}"#,
        r#"{"ids":[1,2,3],"discard_plan":false,"dry_run":true}"#,
        r#"{"code":"bad_request","all":false}"#,
    ];
    let posts = [
        "/api/jobs",
        "/api/jobs/batch",
        "/api/dlq/replay",
        "/api/dlq/preview",
        "/api/jobs/1/cancel",
    ];
    let alphabet: Vec<char> = "{}[]\":,0123456789-.eE truefalsnul\\/\u{0}\u{7f}é€😀"
        .chars()
        .collect();
    for round in 0..400 {
        let seed = seeds[round % seeds.len()];
        let mut body: Vec<char> = seed.chars().collect();
        for _ in 0..rng.random_range(1..6) {
            let at = rng.random_range(0..=body.len());
            match rng.random_range(0..4) {
                0 if at < body.len() => {
                    body.remove(at);
                }
                1 => body.insert(at, alphabet[rng.random_range(0..alphabet.len())]),
                2 => body.truncate(at),
                _ => {
                    let n = rng.random_range(0..3000);
                    body.splice(at..at, std::iter::repeat_n('9', n));
                }
            }
        }
        let body: String = body.into_iter().collect();
        let path = posts[rng.random_range(0..posts.len())];
        let response = api
            .client
            .post(format!("{}{path}", api.base))
            .bearer_auth(TOKEN)
            .header("content-type", "application/json")
            .body(body.clone())
            .send()
            .await
            .unwrap();
        let status = response.status().as_u16();
        let text = response.text().await.unwrap();
        assert!(
            status < 500 || status == 503,
            "{path} {body:?} -> {status} {text}"
        );
        if status >= 400 {
            let answer: Value =
                serde_json::from_str(&text).unwrap_or_else(|_| panic!("not JSON: {text}"));
            assert!(answer["error"]["code"].is_string(), "{text}");
        }
        let query: String = (0..rng.random_range(0..40))
            .map(|_| {
                [
                    "state=",
                    "limit=",
                    "before=",
                    "&",
                    "%",
                    "%FF",
                    "=",
                    "dead",
                    "-1",
                    "99999999999999999999",
                    "queue=",
                    "😀",
                ][rng.random_range(0..12)]
            })
            .collect();
        let get = format!("/api/jobs?{query}");
        let (status, answer) = api.get(&get).await;
        assert!(status < 500 || status == 503, "{get} -> {status} {answer}");
        if status >= 400 {
            assert!(answer["error"]["code"].is_string(), "{get}: {answer}");
        }
    }
    let (status, _) = api.get("/api/queues").await;
    assert_eq!(status, 200, "still serving");
}

/// `GET /api/schedules` and the dashboard's table show each schedule's
/// configuration, next run, last tick, last job and its state.
async fn schedules_show_their_next_and_last_runs(backend: Backend) {
    let h = Harness::new(backend).await;
    let nightly: idem::schedule::Schedule = toml::from_str(
        "name = \"nightly\"\ncron = \"30 2 * * *\"\ntimezone = \"Europe/Paris\"\nplugin = \"noop\"",
    )
    .unwrap();
    let tick = 1_796_607_000_000; // 2026-12-07T01:30:00Z, 02:30 in Paris
    let ticked = h
        .store
        .schedule_tick(idem::store::ScheduleTick {
            name: "nightly".into(),
            tick_ms: tick,
            job: Some(nightly.job(tick, 5)),
        })
        .await
        .unwrap();
    let idem::store::Ticked::Enqueued(job) = ticked else {
        panic!("{ticked:?}")
    };
    let api = Api::serving(idem::ops::api::ApiState {
        schedules: std::sync::Arc::from(vec![nightly]),
        ..h.api_state(TOKEN, false)
    })
    .await;
    let (status, body) = api.get("/api/schedules").await;
    assert_eq!(status, 200, "{body}");
    let listed = &body["schedules"][0];
    assert_eq!(
        body["schedules"].as_array().map(Vec::len),
        Some(1),
        "{body}"
    );
    assert_eq!(listed["name"], "nightly");
    assert_eq!(listed["configured"], true);
    assert_eq!(listed["timezone"], "Europe/Paris");
    assert_eq!(listed["missed"], "one");
    assert_eq!(listed["last_tick"], "2026-12-07T01:30:00Z");
    assert_eq!(listed["last_job_id"], job.id.0);
    assert_eq!(listed["last_outcome"], "available");
    let next = listed["next_run"].as_str().unwrap_or_default();
    assert!(next.ends_with(":30:00Z"), "{listed}");
    let (status, page) = api.get("/ui").await;
    assert_eq!(status, 200);
    let html = page.as_str().unwrap_or_default();
    for part in [
        "<table id=\"schedules\">",
        "<code>30 2 * * *</code>",
        "Europe/Paris",
        next,
        "2026-12-07T01:30:00Z",
        &format!("<a href=\"/ui/jobs/{0}\">{0}</a>", job.id.0),
        "pill available",
    ] {
        assert!(html.contains(part), "{part:?} is not on the overview");
    }
    // A configuration without the schedule: the store's row is still
    // listed, as not configured.
    let bare = Api::start(&h).await;
    let (_, body) = bare.get("/api/schedules").await;
    assert_eq!(body["schedules"][0]["configured"], false, "{body}");
    assert!(body["schedules"][0]["next_run"].is_null(), "{body}");
    let (_, page) = bare.get("/ui").await;
    assert!(
        page.as_str().unwrap_or_default().contains("not configured"),
        "{page}"
    );
}

both_backends!(
    schedules_show_their_next_and_last_runs,
    every_route_but_healthz_asks_for_the_token,
    enqueue_list_show_and_cancel,
    bad_requests_get_clear_json_errors,
    a_dead_job_is_previewed_then_replayed,
    the_openapi_document_lists_every_route,
    malformed_requests_never_break_the_api,
);

/// A browser sends the dashboard's session cookie along with a form
/// another page on the same site submits: a change made with the cookie
/// must come from the dashboard's own origin.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cookie_alone_cannot_change_anything_from_another_origin() {
    let h = Harness::new(Backend::Sqlite).await;
    let api = Api::start(&h).await;
    let id = h
        .store
        .job_insert(NewJob::new("noop", b"{}".to_vec()))
        .await
        .unwrap()
        .id;
    let host = api.base.trim_start_matches("http://").to_string();
    let signed_in = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
        .post(format!("{}/ui/login", api.base))
        .form(&[("token", TOKEN)])
        .send()
        .await
        .unwrap();
    assert_eq!(signed_in.status().as_u16(), 303);
    let cookie = signed_in.headers()["set-cookie"]
        .to_str()
        .unwrap()
        .split(';')
        .next()
        .unwrap()
        .to_string();
    let cancel = |origin: Option<String>, site: Option<&'static str>| {
        let mut request = api
            .client
            .post(format!("{}/api/jobs/{id}/cancel", api.base))
            .header("cookie", cookie.clone());
        if let Some(origin) = origin {
            request = request.header("origin", origin);
        }
        if let Some(site) = site {
            request = request.header("sec-fetch-site", site);
        }
        request.send()
    };
    let read = api
        .client
        .get(format!("{}/api/jobs/{id}", api.base))
        .header("cookie", cookie.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(
        read.status().as_u16(),
        200,
        "reading with the cookie is fine"
    );
    for (origin, site) in [
        (None, None),
        (Some("http://127.0.0.1:1".to_string()), None),
        (Some(format!("http://{host}")), Some("same-site")),
    ] {
        let refused = cancel(origin.clone(), site).await.unwrap();
        assert_eq!(refused.status().as_u16(), 403, "{origin:?} {site:?}");
        let body: Value = refused.json().await.unwrap();
        assert_eq!(error_code(&body), "cross_origin_refused");
    }
    assert_eq!(
        h.store.job_get(id).await.unwrap().unwrap().state,
        JobState::Available
    );
    let allowed = cancel(Some(format!("http://{host}")), None).await.unwrap();
    assert_eq!(allowed.status().as_u16(), 200);
    assert_eq!(
        h.store.job_get(id).await.unwrap().unwrap().state,
        JobState::Cancelled
    );
}

/// Every answer carries the security headers (one layer on the router, so
/// no route can forget them): a strict Content-Security-Policy that also
/// forbids framing, `X-Frame-Options`, `nosniff`, no referrer; `no-store`
/// on everything but the static assets, which hold no data.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_answer_carries_the_security_headers() {
    let h = Harness::new(Backend::Sqlite).await;
    let api = Api::start(&h).await;
    let fetch = |path: &str, token: bool| {
        let mut request = api.client.get(format!("{}{path}", api.base));
        if token {
            request = request.bearer_auth(TOKEN);
        }
        request.send()
    };
    let csp = idem::ops::headers::CONTENT_SECURITY_POLICY;
    assert!(csp.contains("frame-ancestors 'none'") && csp.contains("script-src 'self'"));
    let mut pages = Vec::new();
    for (path, token, status, cache) in [
        ("/ui", true, 200, "no-store"),
        ("/ui/jobs", true, 200, "no-store"),
        ("/ui/dlq", true, 200, "no-store"),
        ("/ui/login", false, 200, "no-store"),
        ("/api/queues", true, 200, "no-store"),
        ("/api/queues", false, 401, "no-store"),
        ("/api/nothing-here", true, 404, "no-store"),
        ("/healthz", false, 200, "no-store"),
        ("/ui/assets/idem.css", false, 200, "public, max-age=86400"),
        ("/ui/assets/live.js", false, 200, "public, max-age=86400"),
    ] {
        let answer = fetch(path, token).await.unwrap();
        assert_eq!(answer.status().as_u16(), status, "{path}");
        let headers = answer.headers();
        let header = |name: &str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_else(|| panic!("{path} has no {name}"))
                .to_string()
        };
        assert_eq!(header("content-security-policy"), csp, "{path}");
        assert_eq!(header("x-frame-options"), "DENY", "{path}");
        assert_eq!(header("x-content-type-options"), "nosniff", "{path}");
        assert_eq!(header("referrer-policy"), "no-referrer", "{path}");
        assert_eq!(header("cache-control"), cache, "{path}");
        let content_type = header("content-type");
        let body = answer.text().await.unwrap();
        match path.rsplit('.').next() {
            Some("css") => assert_eq!(content_type, "text/css; charset=utf-8"),
            Some("js") => assert_eq!(content_type, "text/javascript; charset=utf-8"),
            _ if path.starts_with("/ui") => {
                assert!(content_type.starts_with("text/html"), "{path}");
                pages.push((path, body));
            }
            _ => {}
        }
    }
    // The policy refuses inline styles and scripts: no page may hold any,
    // and what the pages link to is served.
    for (path, html) in pages {
        assert!(!html.contains("<style"), "{path} has a <style> element");
        assert!(!html.contains(" style="), "{path} has a style attribute");
        assert!(!html.contains("<script>"), "{path} has an inline script");
        let stylesheet = html
            .split("href=\"")
            .map(|rest| rest.split('"').next().unwrap_or_default())
            .find(|href| href.starts_with("/ui/assets/idem.css?v="))
            .unwrap_or_else(|| panic!("{path} links no stylesheet"));
        assert_eq!(fetch(stylesheet, false).await.unwrap().status(), 200);
        if path == "/ui" {
            assert!(
                html.contains("<script src=\"/ui/assets/live.js?v="),
                "the overview loads its live counters"
            );
        }
    }
}

/// Issue 24, item 9: previews asked over HTTP beside a worker that fills
/// its whole share of the sandbox (`max_instances` equal to the queue's
/// concurrency, every handler in a plugin that loops to its deadline) still
/// complete, paced at the preview rate, with at most two plugin runs at
/// once in the instances kept for them; the worker never finds its pool
/// full (a deferral would say so).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn previews_beside_a_full_worker_are_paced_and_take_none_of_its_instances() {
    use idem::failure::ErrorClass;
    use idem::ops::preview::{PREVIEW_SLOTS, PreviewGate};
    use idem::store::ErrorRecord;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    let h = Harness::new(Backend::Sqlite).await;
    let mut config = idem::config::Config::default();
    config.sandbox.max_instances = 2;
    // The pool as `idem run --listen` sizes it; no disk cache in tests.
    let mut sandbox = idem::cli::plugins::sandbox_config(&config, PREVIEW_SLOTS);
    sandbox.cache_dir = None;
    assert_eq!(sandbox.max_instances, 2 + PREVIEW_SLOTS);
    let sandbox = Arc::new(idem::sandbox::Sandbox::new(sandbox).unwrap());
    let registry = Arc::new(idem::plugins::PluginRegistry::new(
        sandbox,
        h.plugins_dir.path(),
    ));
    registry.refresh();

    let dead = |plugin: &str| {
        let job = NewJob::new(plugin, b"{}".to_vec());
        let error = ErrorRecord {
            attempt: 1,
            class: ErrorClass::Permanent,
            code: "bad_request".into(),
            message: "died".into(),
            at_ms: 0,
        };
        (job, error)
    };
    let mut noops = Vec::new();
    for _ in 0..20 {
        let (job, error) = dead("noop");
        noops.push(h.store.job_insert_dead(job, error).await.unwrap().0);
    }
    let mut loops = Vec::new();
    for _ in 0..3 {
        let (job, error) = dead("hostile_loop");
        loops.push(h.store.job_insert_dead(job, error).await.unwrap().0);
    }
    // Work for both handlers for about 3.6 s (300 ms a job).
    let mut busy = Vec::new();
    for _ in 0..24 {
        let mut job = NewJob::new("hostile_loop", b"{}".to_vec());
        job.max_attempts = 1;
        busy.push(h.store.job_insert(job).await.unwrap().id);
    }
    let mut settings = h.settings("preview-neighbour");
    settings.queues = std::collections::BTreeMap::from([("default".to_string(), 2)]);
    let worker =
        idem::queue::Worker::new(h.store.clone(), registry.clone(), h.providers(), settings);
    let worker = tokio::spawn(worker.run(tokio_util::sync::CancellationToken::new()));
    tokio::time::timeout(Duration::from_secs(30), async {
        while h
            .store
            .queue_stats(None)
            .await
            .unwrap()
            .count(JobState::Running)
            < 2
        {
            h.store.wait_for_jobs(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("both handlers run a job");

    let mut state = h.api_state(TOKEN, true);
    state.registry = Some(registry);
    state.preview = Arc::new(PreviewGate::per_second(10.0).unwrap());
    let api = Api::serving(state).await;
    // Twenty quick previews in one request, and three of a plugin that
    // holds its instance for 300 ms, each in its own request, all at once.
    let started = Instant::now();
    let paced = async {
        let answer = api.post("/api/dlq/preview", json!({"ids": noops})).await;
        (answer, started.elapsed())
    };
    let slow = futures::future::join_all(
        loops
            .iter()
            .map(|id| api.post("/api/dlq/preview", json!({"ids": [id]}))),
    );
    let (((status, previews), took), slow) = tokio::join!(paced, slow);
    assert_eq!(status, 200, "{previews}");
    assert_eq!(previews["jobs"].as_array().unwrap().len(), 20);
    for preview in previews["jobs"].as_array().unwrap() {
        assert!(preview["error"].is_null(), "{preview}");
    }
    // Twenty turns of a 10/s pacer: the last one 1.9 s after the first.
    assert!(took >= Duration::from_millis(1900), "not paced: {took:?}");
    for (status, preview) in slow {
        assert_eq!(status, 200, "an instance was free for it: {preview}");
        assert_eq!(preview["jobs"][0]["error"]["code"], "plugin_timeout");
    }

    let stats = tokio::time::timeout(Duration::from_secs(60), worker)
        .await
        .expect("the worker drains")
        .unwrap()
        .unwrap();
    assert_eq!(
        stats.deferred, 0,
        "the worker found its pool full: {stats:?}"
    );
    for id in busy {
        let job = h.store.job_get(id).await.unwrap().unwrap();
        assert_eq!(job.last_error_code.as_deref(), Some("plugin_timeout"));
        assert_eq!(job.attempt, 1);
    }
}
