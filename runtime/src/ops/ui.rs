//! The dashboard at `/ui`: HTML rendered on the server from the same read
//! model as the API, a few lines of inline script for live counters, no
//! asset from anywhere else. Sign-in takes the API token and keeps it in an
//! HttpOnly, SameSite=Strict cookie; every page and form then goes through
//! the same token check as the API.

use super::api::{ApiError, ApiState, MAX_REPLAY};
use super::auth::COOKIE;
use super::replay::{ReplayRequest, replay};
use super::view::{self, JobQuery};
use super::{OpsError, preview};
use crate::store::{JobId, JobState};
use axum::Router;
use axum::extract::{Form, Path, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{Html, IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde_json::Value;
use std::fmt::Write as _;

/// Pages behind the token.
pub fn routes() -> Router<ApiState> {
    Router::new()
        .route("/ui", get(overview))
        .route("/ui/jobs", get(jobs))
        .route("/ui/jobs/{id}", get(job))
        .route("/ui/dlq", get(dlq))
        .route("/ui/dlq/{id}/preview", post(preview_one))
        .route("/ui/dlq/{id}/replay", post(replay_one))
        .route("/ui/logout", post(logout))
}

/// The sign-in page.
pub fn public_routes() -> Router<ApiState> {
    Router::new().route("/ui/login", get(login_page).post(login))
}

/// Where an unauthenticated browser is sent.
pub fn login_redirect(_from: &str) -> Response {
    Redirect::to("/ui/login").into_response()
}

/// Escapes text for HTML.
///
/// ```
/// assert_eq!(idem::ops::ui::escape("<a href=\"x\">&'"), "&lt;a href=&quot;x&quot;&gt;&amp;&#39;");
/// ```
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '&' => out.push_str("&amp;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

const STYLE: &str = "body{font:14px/1.45 system-ui,sans-serif;margin:0;color:#1d2433;background:#f5f6f8}\
header{background:#1d2433;color:#fff;padding:10px 24px;display:flex;gap:20px;align-items:center}\
header a{color:#cfd6e4;text-decoration:none}header a:hover{color:#fff}header b{margin-right:12px}\
main{padding:20px 24px;max-width:1200px}h1{font-size:20px;margin:0 0 14px}h2{font-size:16px;margin:22px 0 8px}\
table{border-collapse:collapse;background:#fff;width:100%;margin-bottom:12px}\
th,td{text-align:left;padding:6px 10px;border-bottom:1px solid #e3e6ec;vertical-align:top}\
th{background:#eef0f4;font-weight:600}td.n{text-align:right;font-variant-numeric:tabular-nums}\
.pill{display:inline-block;padding:1px 8px;border-radius:10px;font-size:12px;background:#e3e6ec}\
.succeeded{background:#d3f2dc}.dead,.failed,.open{background:#f9d6d5}.running,.processing,.half_open{background:#fdf0c4}\
.retrying{background:#fde3c4}.closed{background:#d3f2dc}\
pre{background:#fff;border:1px solid #e3e6ec;padding:10px;overflow:auto;max-height:320px}\
button{font:inherit;padding:4px 12px;border:1px solid #8590a6;border-radius:4px;background:#fff;cursor:pointer}\
button.primary{background:#2557d6;color:#fff;border-color:#2557d6}form.inline{display:inline}\
.note{background:#fff;border-left:4px solid #2557d6;padding:8px 12px;margin:10px 0}.muted{color:#6b7385}";

fn page(title: &str, body: &str) -> Response {
    let html = format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width,initial-scale=1\">\
         <title>{title} · idem</title><style>{STYLE}</style></head><body>\
         <header><b>idem</b><a href=\"/ui\">Overview</a><a href=\"/ui/jobs\">Jobs</a>\
         <a href=\"/ui/dlq\" id=\"nav-dlq\">Dead letters</a>\
         <form class=\"inline\" method=\"post\" action=\"/ui/logout\" style=\"margin-left:auto\">\
         <button>Sign out</button></form></header><main>{body}</main></body></html>",
        title = escape(title)
    );
    ([(header::CACHE_CONTROL, "no-store")], Html(html)).into_response()
}

fn error_page(error: ApiError) -> Response {
    let response = error.into_response();
    let status = response.status();
    page(
        "Error",
        &format!(
            "<h1>{}</h1><p class=\"note\">The request failed ({}). <a href=\"/ui\">Back</a></p>",
            status.as_u16(),
            escape(status.canonical_reason().unwrap_or("error"))
        ),
    )
}

fn pill(text: &str) -> String {
    format!("<span class=\"pill {0}\">{0}</span>", escape(text))
}

fn age(ms: Option<i64>) -> String {
    match ms {
        None => "-".into(),
        Some(ms) => humantime::format_duration(std::time::Duration::from_secs(
            u64::try_from(ms / 1000).unwrap_or(0),
        ))
        .to_string(),
    }
}

#[derive(Debug, Deserialize)]
struct LoginForm {
    token: String,
}

async fn login_page() -> Response {
    login_form(None)
}

fn login_form(error: Option<&str>) -> Response {
    let error = error
        .map(|e| format!("<p class=\"note\" id=\"login-error\">{}</p>", escape(e)))
        .unwrap_or_default();
    let html = format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>Sign in · idem</title>\
         <style>{STYLE}</style></head><body><main style=\"max-width:420px;margin:60px auto\">\
         <h1>Sign in to idem</h1>{error}<form method=\"post\" action=\"/ui/login\">\
         <p><label>API token<br><input type=\"password\" name=\"token\" id=\"token\" \
         autocomplete=\"current-password\" style=\"width:100%;padding:6px\"></label></p>\
         <button class=\"primary\" id=\"sign-in\">Sign in</button></form>\
         <p class=\"muted\">The token is the host's <code>IDEM_API_TOKEN</code>.</p></main></body></html>"
    );
    Html(html).into_response()
}

async fn login(
    State(state): State<ApiState>,
    form: Result<Form<LoginForm>, axum::extract::rejection::FormRejection>,
) -> Response {
    let Ok(Form(form)) = form else {
        return (
            StatusCode::BAD_REQUEST,
            login_form(Some("Enter the token.")),
        )
            .into_response();
    };
    let valid = state
        .token
        .as_ref()
        .is_some_and(|token| token.matches(&form.token));
    // A cookie value cannot hold every byte; such a token is not ours anyway.
    let cookie_safe = form
        .token
        .trim()
        .bytes()
        .all(|b| b.is_ascii_graphic() && b != b';' && b != b',' && b != b'"' && b != b'\\');
    if !valid || !cookie_safe {
        return (
            StatusCode::UNAUTHORIZED,
            login_form(Some("That token is not this host's API token.")),
        )
            .into_response();
    }
    let cookie = format!(
        "{COOKIE}={}; Path=/; HttpOnly; SameSite=Strict; Max-Age=43200",
        form.token.trim()
    );
    ([(header::SET_COOKIE, cookie)], Redirect::to("/ui")).into_response()
}

async fn logout() -> Response {
    let cookie = format!("{COOKIE}=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0");
    ([(header::SET_COOKIE, cookie)], Redirect::to("/ui/login")).into_response()
}

const LIVE: &str = "<script>\
async function refresh(){try{const r=await fetch('/api/queues',{credentials:'same-origin'});\
if(!r.ok)return;const o=await r.json();const set=(id,v)=>{const e=document.getElementById(id);if(e)e.textContent=v;};\
for(const q of [o.total].concat(o.queues)){for(const s in q.jobs){set('c-'+q.queue+'-'+s,q.jobs[s]);}\
set('c-'+q.queue+'-ready',q.ready);set('c-'+q.queue+'-ok1m',q.succeeded_last_minute);set('c-'+q.queue+'-dead1m',q.dead_last_minute);}\
set('refreshed',new Date().toLocaleTimeString());}catch(e){}}setInterval(refresh,2000);</script>";

async fn overview(State(state): State<ApiState>) -> Response {
    let overview = match view::overview(&*state.store).await {
        Ok(o) => o,
        Err(e) => return error_page(e.into()),
    };
    let mut body =
        String::from("<h1>Overview</h1><h2>Queues</h2><table id=\"queues\"><tr><th>Queue</th>");
    let states = ["available", "running", "retrying", "dead", "succeeded"];
    for s in states {
        let _ = write!(body, "<th>{s}</th>");
    }
    body.push_str(
        "<th>ready</th><th>oldest ready</th><th>succeeded/min</th><th>dead/min</th></tr>",
    );
    for q in std::iter::once(&overview.total).chain(overview.queues.iter()) {
        let name = escape(&q.queue);
        let label = if q.queue == "*" {
            "all queues".to_string()
        } else {
            name.clone()
        };
        let _ = write!(body, "<tr><td>{label}</td>");
        for s in states {
            let n = q.jobs.get(s).copied().unwrap_or(0);
            let _ = write!(
                body,
                "<td class=\"n\"><a id=\"c-{name}-{s}\" href=\"/ui/jobs?state={s}{queue}\">{n}</a></td>",
                queue = if q.queue == "*" {
                    String::new()
                } else {
                    format!("&amp;queue={name}")
                }
            );
        }
        let _ = write!(
            body,
            "<td class=\"n\" id=\"c-{name}-ready\">{}</td><td>{}</td><td class=\"n\" id=\"c-{name}-ok1m\">{}</td><td class=\"n\" id=\"c-{name}-dead1m\">{}</td></tr>",
            q.ready,
            age(q.oldest_ready_age_ms),
            q.succeeded_last_minute,
            q.dead_last_minute
        );
    }
    body.push_str("</table><p class=\"muted\">Counters refresh every 2 s (last: <span id=\"refreshed\">now</span>).</p>");
    body.push_str("<h2>Dead letters by code</h2>");
    if overview.dead_by_code.is_empty() {
        body.push_str("<p class=\"muted\">The dead-letter queue is empty.</p>");
    } else {
        body.push_str("<table><tr><th>Code</th><th>Jobs</th></tr>");
        for c in &overview.dead_by_code {
            let code = escape(&c.code);
            let _ = write!(
                body,
                "<tr><td><a href=\"/ui/dlq?code={code}\">{code}</a></td><td class=\"n\">{}</td></tr>",
                c.jobs
            );
        }
        body.push_str("</table>");
    }
    body.push_str("<h2>Providers</h2>");
    if state.providers.iter().next().is_none() {
        body.push_str("<p class=\"muted\">No worker runs in this process (idem serve): circuit states are those of each worker's own process; see <code>idem_provider_circuit_state</code> in its metrics.</p>");
    } else {
        body.push_str(
            "<table id=\"providers\"><tr><th>Provider</th><th>Circuit</th><th>In flight</th></tr>",
        );
        for p in state.providers.iter() {
            let _ = write!(
                body,
                "<tr><td>{}</td><td>{}</td><td class=\"n\">{}</td></tr>",
                escape(&p.name),
                pill(p.guard.circuit()),
                p.guard.in_flight()
            );
        }
        body.push_str("</table>");
    }
    body.push_str(LIVE);
    page("Overview", &body)
}

#[derive(Debug, Deserialize, Default)]
struct JobsQuery {
    state: Option<String>,
    queue: Option<String>,
    plugin: Option<String>,
    code: Option<String>,
    before: Option<i64>,
}

fn job_rows(jobs: &[Value], actions: bool) -> String {
    let mut rows = String::from(
        "<table class=\"jobs\"><tr><th>Id</th><th>Plugin</th><th>Queue</th><th>State</th><th>Attempts</th><th>Key</th><th>Last error</th><th>Created</th>",
    );
    if actions {
        rows.push_str("<th></th>");
    }
    rows.push_str("</tr>");
    for job in jobs {
        let id = job["id"].as_i64().unwrap_or(0);
        let text = |k: &str| escape(job[k].as_str().unwrap_or("-"));
        let error = job["last_error"]["code"]
            .as_str()
            .map(escape)
            .unwrap_or_else(|| "-".into());
        let _ = write!(
            rows,
            "<tr id=\"job-{id}\"><td><a href=\"/ui/jobs/{id}\">{id}</a></td><td>{}</td><td>{}</td><td>{}</td><td class=\"n\">{}/{}</td><td>{}</td><td>{error}</td><td>{}</td>",
            text("plugin"),
            text("queue"),
            pill(job["state"].as_str().unwrap_or("-")),
            job["attempt"],
            job["max_attempts"],
            text("idempotency_key"),
            text("created_at"),
        );
        if actions {
            let _ = write!(
                rows,
                "<td><form class=\"inline\" method=\"post\" action=\"/ui/dlq/{id}/preview\"><button id=\"preview-{id}\">Preview</button></form> \
                 <form class=\"inline\" method=\"post\" action=\"/ui/dlq/{id}/replay\"><button class=\"primary\" id=\"replay-{id}\">Replay</button></form></td>"
            );
        }
        rows.push_str("</tr>");
    }
    rows.push_str("</table>");
    rows
}

async fn jobs(
    State(state): State<ApiState>,
    query: Result<Query<JobsQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let query = query.map(|Query(q)| q).unwrap_or_default();
    let job_state = match query.state.as_deref() {
        None | Some("") => None,
        Some(s) => match JobState::ALL.into_iter().find(|st| st.as_str() == s) {
            Some(st) => Some(st),
            None => {
                return error_page(ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "invalid_request",
                    "unknown state",
                ));
            }
        },
    };
    let page_value = match view::job_page(
        &*state.store,
        JobQuery {
            state: job_state,
            queue: query.queue.clone().filter(|q| !q.is_empty()),
            plugin: query.plugin.clone().filter(|p| !p.is_empty()),
            code: query.code.clone().filter(|c| !c.is_empty()),
            before: query.before,
            limit: 50,
        },
    )
    .await
    {
        Ok(p) => p,
        Err(e) => return error_page(e.into()),
    };
    let mut body = String::from("<h1>Jobs</h1><p>");
    for s in JobState::ALL {
        let _ = write!(
            body,
            "<a href=\"/ui/jobs?state={0}\">{0}</a> · ",
            s.as_str()
        );
    }
    body.push_str("<a href=\"/ui/jobs\">all</a></p>");
    let jobs = page_value["jobs"].as_array().cloned().unwrap_or_default();
    if jobs.is_empty() {
        body.push_str("<p class=\"muted\">No jobs.</p>");
    } else {
        body.push_str(&job_rows(&jobs, false));
    }
    if let Some(next) = page_value["next_before"].as_i64() {
        let keep = |k: &str, v: &Option<String>| {
            v.as_ref()
                .map(|v| format!("&amp;{k}={}", escape(v)))
                .unwrap_or_default()
        };
        let _ = write!(
            body,
            "<p><a href=\"/ui/jobs?before={next}{}{}{}{}\">Older</a></p>",
            keep("state", &query.state),
            keep("queue", &query.queue),
            keep("plugin", &query.plugin),
            keep("code", &query.code)
        );
    }
    page("Jobs", &body)
}

async fn job(State(state): State<ApiState>, Path(id): Path<String>) -> Response {
    let Some(id) = id.parse::<i64>().ok().filter(|i| *i > 0) else {
        return error_page(ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            "not a job id",
        ));
    };
    let detail = match view::job_detail(&*state.store, JobId(id)).await {
        Ok(d) => d,
        Err(e) => return error_page(e.into()),
    };
    let text = |v: &Value| escape(v.as_str().unwrap_or("-"));
    let mut body = format!(
        "<h1>Job {id} <span id=\"job-state\">{}</span></h1><table><tr><th>Plugin</th><td>{}</td><th>Queue</th><td>{}</td></tr>\
         <tr><th>Attempts</th><td>{}/{}</td><th>Key</th><td>{}</td></tr>\
         <tr><th>Correlation id</th><td>{}</td><th>Rescues</th><td>{}</td></tr></table>",
        pill(detail["state"].as_str().unwrap_or("-")),
        text(&detail["plugin"]),
        text(&detail["queue"]),
        detail["attempt"],
        detail["max_attempts"],
        text(&detail["idempotency_key"]),
        text(&detail["correlation_id"]),
        detail["rescues"],
    );
    if detail["state"] == "dead" {
        let _ = write!(
            body,
            "<p><form class=\"inline\" method=\"post\" action=\"/ui/dlq/{id}/preview\"><button id=\"preview-{id}\">Preview replay</button></form> \
             <form class=\"inline\" method=\"post\" action=\"/ui/dlq/{id}/replay\"><button class=\"primary\" id=\"replay-{id}\">Replay</button></form></p>"
        );
    }
    body.push_str("<h2>Timeline</h2><table id=\"timeline\"><tr><th>When</th><th>Event</th><th>Detail</th></tr>");
    for event in detail["timeline"].as_array().into_iter().flatten() {
        let detail_text = match event["event"].as_str() {
            Some("attempt_failed") => format!(
                "attempt {} · {} · <b>{}</b> · {}",
                event["attempt"],
                text(&event["class"]),
                text(&event["code"]),
                text(&event["message"])
            ),
            _ => String::new(),
        };
        let _ = write!(
            body,
            "<tr><td>{}</td><td>{}</td><td>{detail_text}</td></tr>",
            text(&event["at"]),
            pill(event["event"].as_str().unwrap_or("-"))
        );
    }
    body.push_str("</table><h2>Effects</h2>");
    let effects = detail["effects"].as_array().cloned().unwrap_or_default();
    if effects.is_empty() {
        body.push_str("<p class=\"muted\">No stored plan yet.</p>");
    } else {
        body.push_str("<table id=\"effects\"><tr><th>Key</th><th>Provider</th><th>Action</th><th>Status</th><th>Result</th><th>Last error</th></tr>");
        for e in &effects {
            let _ = write!(
                body,
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                text(&e["key"]),
                text(&e["provider"]),
                text(&e["action"]),
                pill(e["status"].as_str().unwrap_or("-")),
                text(&e["result_ref"]),
                text(&e["last_error_code"]),
            );
        }
        body.push_str("</table>");
    }
    let pretty = |v: &Value| escape(&serde_json::to_string_pretty(v).unwrap_or_default());
    let _ = write!(
        body,
        "<h2>Payload</h2><pre>{}</pre><h2>Stored plan</h2><pre>{}</pre>",
        pretty(&detail["payload"]),
        pretty(&detail["plan"])
    );
    page(&format!("Job {id}"), &body)
}

#[derive(Debug, Deserialize, Default)]
struct DlqQuery {
    code: Option<String>,
    plugin: Option<String>,
}

async fn dlq(
    State(state): State<ApiState>,
    query: Result<Query<DlqQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let query = query.map(|Query(q)| q).unwrap_or_default();
    let overview = match view::overview(&*state.store).await {
        Ok(o) => o,
        Err(e) => return error_page(e.into()),
    };
    let mut body = String::from("<h1>Dead letters</h1>");
    if overview.dead_by_code.is_empty() {
        body.push_str("<p class=\"muted\">The dead-letter queue is empty.</p>");
    }
    for group in &overview.dead_by_code {
        if query
            .code
            .as_deref()
            .is_some_and(|c| !c.is_empty() && c != group.code)
        {
            continue;
        }
        let page_value = match view::job_page(
            &*state.store,
            JobQuery {
                state: Some(JobState::Dead),
                code: Some(group.code.clone()),
                plugin: query.plugin.clone().filter(|p| !p.is_empty()),
                limit: 50,
                ..JobQuery::default()
            },
        )
        .await
        {
            Ok(p) => p,
            Err(e) => return error_page(e.into()),
        };
        let code = escape(&group.code);
        let _ = write!(
            body,
            "<h2 id=\"code-{code}\">{code} <span class=\"muted\">({} jobs)</span></h2>",
            group.jobs
        );
        let jobs = page_value["jobs"].as_array().cloned().unwrap_or_default();
        body.push_str(&job_rows(&jobs, true));
    }
    page("Dead letters", &body)
}

async fn preview_one(State(state): State<ApiState>, Path(id): Path<String>) -> Response {
    let Some(id) = id.parse::<i64>().ok().filter(|i| *i > 0) else {
        return error_page(ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            "not a job id",
        ));
    };
    let Some(registry) = &state.registry else {
        return error_page(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "plugin_unavailable",
            "no plugins loaded",
        ));
    };
    let job = match state.store.job_get(JobId(id)).await {
        Ok(Some(job)) => job,
        Ok(None) => return error_page(OpsError::NotFound(format!("no job {id}")).into()),
        Err(e) => return error_page(e.into()),
    };
    let previews =
        match preview::preview_jobs(&*state.store, registry, std::slice::from_ref(&job)).await {
            Ok(p) => p,
            Err(e) => return error_page(e.into()),
        };
    let mut body = format!("<h1>Replay preview of job <a href=\"/ui/jobs/{id}\">{id}</a></h1>");
    for p in &previews {
        let _ = write!(
            body,
            "<p class=\"note\" id=\"verdict\">{}</p><table><tr><th>Plugin version then</th><td>{}</td></tr><tr><th>Plugin version now</th><td>{}</td></tr></table>",
            escape(&p.verdict),
            escape(p.stored_plugin_hash.as_deref().unwrap_or("-")),
            escape(p.current_plugin_hash.as_deref().unwrap_or("-")),
        );
        if let Some(error) = &p.error {
            let _ = write!(
                body,
                "<p class=\"note\">The current plugin fails: <b>{}</b> ({}) {}</p>",
                escape(&error.code),
                error.class,
                escape(&error.message)
            );
        }
        body.push_str("<table id=\"preview\"><tr><th>Key</th><th>Provider</th><th>Action</th><th>Stored plan → new plan</th><th>Ledger</th><th>Result</th></tr>");
        for k in &p.keys {
            let _ = write!(
                body,
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                escape(&k.key),
                escape(&k.provider),
                k.action,
                pill(k.change),
                escape(&k.ledger),
                escape(k.result_ref.as_deref().unwrap_or("-"))
            );
        }
        body.push_str("</table>");
    }
    let _ = write!(
        body,
        "<form method=\"post\" action=\"/ui/dlq/{id}/replay\"><button class=\"primary\" id=\"replay-{id}\">Replay job {id}</button></form>"
    );
    page("Replay preview", &body)
}

async fn replay_one(State(state): State<ApiState>, Path(id): Path<String>) -> Response {
    let Some(id) = id.parse::<i64>().ok().filter(|i| *i > 0) else {
        return error_page(ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            "not a job id",
        ));
    };
    let request = ReplayRequest {
        ids: vec![JobId(id)],
        per_second: state.replay_per_second,
        limit: MAX_REPLAY,
        ..ReplayRequest::default()
    };
    match replay(&*state.store, request).await {
        Ok(report) if report.refused.is_empty() && !report.replayed.is_empty() => {
            Redirect::to(&format!("/ui/jobs/{id}")).into_response()
        }
        Ok(report) => {
            let mut body = format!("<h1>Job {id} was not replayed</h1>");
            for r in &report.refused {
                let _ = write!(
                    body,
                    "<p class=\"note\"><b>{}</b>: {}</p>",
                    r.reason,
                    escape(&r.message)
                );
            }
            if report.refused.is_empty() {
                body.push_str("<p class=\"note\">It is not in the dead-letter queue.</p>");
            }
            let _ = write!(body, "<p><a href=\"/ui/jobs/{id}\">Back to the job</a></p>");
            page("Not replayed", &body)
        }
        Err(e) => error_page(e.into()),
    }
}
