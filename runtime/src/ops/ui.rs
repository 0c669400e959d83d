//! The dashboard at `/ui`: HTML rendered on the server from the same read
//! model as the API, one stylesheet and a small live-counter script served
//! from `/ui/assets/` (nothing inline, nothing from anywhere else, so the
//! strict Content-Security-Policy of [`super::headers`] holds). Sign-in
//! takes the API token and gives the browser a session ([`super::session`]:
//! an opaque id in an HttpOnly, SameSite=Strict cookie, never the token);
//! every page and form then goes through the same check as the API
//! ([`super::gate`]). Failed sign-ins are throttled by client address.

use super::api::{ApiError, ApiState, MAX_REPLAY};
use super::client::Caller;
use super::replay::{ReplayRequest, replay};
use super::session;
use super::view::{self, JobQuery};
use super::{OpsError, assets, preview};
use crate::store::{JobId, JobState};
use axum::Router;
use axum::extract::rejection::PathRejection;
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

/// The sign-in page and the static assets.
pub fn public_routes() -> Router<ApiState> {
    Router::new()
        .route("/ui/login", get(login_page).post(login))
        .merge(assets::routes())
}

/// Where an unauthenticated browser is sent.
pub fn login_redirect() -> Response {
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

/// A page of the dashboard. Its headers (the policy, `no-store`) come from
/// the router's layer, [`super::headers::secure`].
fn page(title: &str, body: &str) -> Response {
    page_with_script(title, body, "")
}

/// A page that also loads a script from [`assets`] (`script` is its tag).
fn page_with_script(title: &str, body: &str, script: &str) -> Response {
    let html = format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width,initial-scale=1\">\
         <title>{title} · idem</title>{stylesheet}{script}</head><body>\
         <header><b>idem</b><a href=\"/ui\">Overview</a><a href=\"/ui/jobs\">Jobs</a>\
         <a href=\"/ui/dlq\" id=\"nav-dlq\">Dead letters</a>\
         <form class=\"inline sign-out\" method=\"post\" action=\"/ui/logout\">\
         <button>Sign out</button></form></header><main>{body}</main></body></html>",
        title = escape(title),
        stylesheet = assets::stylesheet_link(),
    );
    Html(html).into_response()
}

/// An error as the dashboard's page, with the error's status.
pub(super) fn error_page(error: ApiError) -> Response {
    let html = page(
        "Error",
        &format!(
            "<h1>{} {}</h1><p class=\"note\" id=\"error\"><b>{}</b>: {}</p><p><a href=\"/ui\">Back to the overview</a></p>",
            error.status.as_u16(),
            escape(error.status.canonical_reason().unwrap_or("error")),
            error.code,
            escape(&error.message)
        ),
    );
    (error.status, html).into_response()
}

fn bad(message: &str) -> Response {
    error_page(ApiError::new(
        StatusCode::BAD_REQUEST,
        "invalid_request",
        message,
    ))
}

/// A query-string value, encoded.
fn enc(value: &str) -> String {
    url::form_urlencoded::byte_serialize(value.as_bytes()).collect()
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
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width,initial-scale=1\">\
         <title>Sign in · idem</title>{stylesheet}</head><body><main class=\"narrow\">\
         <h1>Sign in to idem</h1>{error}<form method=\"post\" action=\"/ui/login\">\
         <p><label>API token<br><input type=\"password\" name=\"token\" id=\"token\" \
         autocomplete=\"current-password\" class=\"wide\"></label></p>\
         <button class=\"primary\" id=\"sign-in\">Sign in</button></form>\
         <p class=\"muted\">The token is the host's <code>IDEM_API_TOKEN</code>.</p></main></body></html>",
        stylesheet = assets::stylesheet_link(),
    );
    Html(html).into_response()
}

async fn login(
    State(state): State<ApiState>,
    caller: Caller,
    form: Result<Form<LoginForm>, axum::extract::rejection::FormRejection>,
) -> Response {
    let access = &state.access;
    if let Err(wait) = access.throttle.check(caller.address) {
        let secs = super::throttle::retry_after_secs(wait);
        let mut response = (
            StatusCode::TOO_MANY_REQUESTS,
            login_form(Some(&format!(
                "Too many failed sign-ins from your address. Try again in {secs} seconds."
            ))),
        )
            .into_response();
        super::gate::with_retry_after(&mut response, secs);
        return response;
    }
    let Ok(Form(form)) = form else {
        return (
            StatusCode::BAD_REQUEST,
            login_form(Some("Enter the token.")),
        )
            .into_response();
    };
    let Some(tokens) = &access.tokens else {
        return (
            StatusCode::UNAUTHORIZED,
            login_form(Some(
                "No API token is configured on this host: set IDEM_API_TOKEN and restart.",
            )),
        )
            .into_response();
    };
    let Some(token) = tokens.matching(&form.token) else {
        access.throttle.failed(caller.address);
        return (
            StatusCode::UNAUTHORIZED,
            login_form(Some("That token is not this host's API token.")),
        )
            .into_response();
    };
    match session::start(&*state.store, token, access.session_ttl).await {
        Ok(id) => {
            let cookie = session::set_cookie(&id, caller.https, access.session_ttl);
            ([(header::SET_COOKIE, cookie)], Redirect::to("/ui")).into_response()
        }
        Err(error) => error_page(error.into()),
    }
}

/// Signs the session out in the store (so no node accepts its cookie any
/// more) and has the browser drop the cookie.
async fn logout(
    State(state): State<ApiState>,
    caller: Caller,
    current: Option<axum::Extension<session::Current>>,
) -> Response {
    if let Some(axum::Extension(session::Current(id))) = current
        && let Err(error) = session::end(&*state.store, &id).await
    {
        return error_page(error.into());
    }
    let cookie = session::clear_cookie(caller.https);
    ([(header::SET_COOKIE, cookie)], Redirect::to("/ui/login")).into_response()
}

async fn overview(State(state): State<ApiState>) -> Response {
    let overview = match view::overview(&*state.store).await {
        Ok(o) => o,
        Err(e) => return error_page(e.into()),
    };
    let mut body =
        String::from("<h1>Overview</h1><h2>Queues</h2><table id=\"queues\"><tr><th>Queue</th>");
    let states = [
        "available",
        "blocked",
        "running",
        "retrying",
        "dead",
        "succeeded",
    ];
    for s in states {
        let _ = write!(body, "<th>{s}</th>");
    }
    body.push_str(
        "<th>ready</th><th>oldest ready</th><th>succeeded/min</th><th>dead/min</th></tr>",
    );
    let rows =
        std::iter::once((true, &overview.total)).chain(overview.queues.iter().map(|q| (false, q)));
    for (is_total, q) in rows {
        // Counter ids: `c-total-STATE` and `c-q-QUEUE-STATE`, so no queue
        // name can stand for the totals.
        let name = if is_total {
            "total".to_string()
        } else {
            format!("q-{}", escape(&q.queue))
        };
        let label = if is_total {
            "all queues".to_string()
        } else {
            escape(&q.queue)
        };
        let _ = write!(body, "<tr><td>{label}</td>");
        for s in states {
            let n = q.jobs.get(s).copied().unwrap_or(0);
            let _ = write!(
                body,
                "<td class=\"n\"><a id=\"c-{name}-{s}\" href=\"/ui/jobs?state={s}{queue}\">{n}</a></td>",
                queue = if is_total {
                    String::new()
                } else {
                    format!("&amp;queue={}", escape(&enc(&q.queue)))
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
                "<tr><td><a href=\"/ui/dlq?code={}\">{code}</a></td><td class=\"n\">{}</td></tr>",
                escape(&enc(&c.code)),
                c.jobs
            );
        }
        body.push_str("</table>");
    }
    match view::schedules(&*state.store, &state.schedules).await {
        Ok(schedules) => schedule_rows(&mut body, &schedules),
        Err(e) => return error_page(e.into()),
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
    page_with_script("Overview", &body, &assets::live_script_tag())
}

/// The schedules table of the overview: next run, last tick, last job and
/// its state.
fn schedule_rows(body: &mut String, schedules: &[view::ScheduleView]) {
    body.push_str("<h2>Schedules</h2>");
    if schedules.is_empty() {
        body.push_str(
            "<p class=\"muted\">No <code>[[schedules]]</code> in this configuration.</p>",
        );
        return;
    }
    body.push_str("<table id=\"schedules\"><tr><th>Schedule</th><th>Cron</th><th>Time zone</th><th>Next run</th><th>Last tick</th><th>Last job</th><th>Last outcome</th></tr>");
    let text = |value: &Option<String>| value.as_deref().map(escape).unwrap_or_else(|| "-".into());
    for s in schedules {
        let cron = match &s.cron {
            Some(cron) => escape(cron),
            None => "<span class=\"muted\">not configured</span>".into(),
        };
        let job = match s.last_job_id {
            Some(id) => format!("<a href=\"/ui/jobs/{0}\">{0}</a>", id.0),
            None => "-".into(),
        };
        let _ = write!(
            body,
            "<tr><td>{}</td><td><code>{cron}</code></td><td>{}</td><td>{}</td><td>{}</td><td class=\"n\">{job}</td><td>{}</td></tr>",
            escape(&s.name),
            text(&s.timezone),
            text(&s.next_run),
            text(&s.last_tick),
            s.last_outcome.map(pill).unwrap_or_else(|| "-".into()),
        );
    }
    body.push_str("</table>");
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
            view::count_or_dash(&job["max_attempts"]),
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
    let query = match query {
        Ok(Query(query)) => query,
        Err(rejection) => return bad(&rejection.body_text()),
    };
    let job_state = match query.state.as_deref() {
        None | Some("") => None,
        Some(s) => match JobState::ALL.into_iter().find(|st| st.as_str() == s) {
            Some(st) => Some(st),
            None => return bad("unknown state"),
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
                .map(|v| format!("&amp;{k}={}", escape(&enc(v))))
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

/// The job id of a `{id}` page, or the error page: a path that does not
/// decode (`%FF`) and an id that is not a positive integer are both 400.
fn page_job_id(path: Result<Path<String>, PathRejection>) -> Result<i64, ApiError> {
    let Path(text) = path?;
    text.parse::<i64>().ok().filter(|i| *i > 0).ok_or_else(|| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            format!("not a job id: {text:?}"),
        )
    })
}

async fn job(State(state): State<ApiState>, path: Result<Path<String>, PathRejection>) -> Response {
    let id = match page_job_id(path) {
        Ok(id) => id,
        Err(error) => return error_page(error),
    };
    let detail = match view::job_detail(&*state.store, JobId(id)).await {
        Ok(d) => d,
        Err(e) => return error_page(e.into()),
    };
    let text = |v: &Value| escape(v.as_str().unwrap_or("-"));
    let mut body = format!(
        "<h1>Job {id} <span id=\"job-state\">{}</span></h1><table><tr><th>Plugin</th><td>{}</td><th>Queue</th><td>{}</td></tr>\
         <tr><th>Attempts</th><td>{}/{}</td><th>Key</th><td>{}</td></tr>\
         <tr><th>Correlation id</th><td>{}</td><th>Rescues</th><td>{}</td></tr>\
         <tr><th>Group</th><td id=\"job-group\">{}</td><th></th><td></td></tr></table>",
        pill(detail["state"].as_str().unwrap_or("-")),
        text(&detail["plugin"]),
        text(&detail["queue"]),
        detail["attempt"],
        view::count_or_dash(&detail["max_attempts"]),
        text(&detail["idempotency_key"]),
        text(&detail["correlation_id"]),
        detail["rescues"],
        text(&detail["group"]),
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
    before: Option<i64>,
}

async fn dlq(
    State(state): State<ApiState>,
    query: Result<Query<DlqQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let query = match query {
        Ok(Query(query)) => query,
        Err(rejection) => return bad(&rejection.body_text()),
    };
    let mut codes = match state.store.queue_stats(None).await {
        Ok(stats) => stats.dead_by_code,
        Err(e) => return error_page(e.into()),
    };
    codes.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let only = query.code.clone().filter(|c| !c.is_empty());
    // All codes: the newest few of each; one code: pages of 50.
    let per_code = if only.is_some() { 50 } else { 10 };
    let mut body = String::from("<h1>Dead letters</h1>");
    if codes.is_empty() {
        body.push_str("<p class=\"muted\">The dead-letter queue is empty.</p>");
    }
    for (group, count) in &codes {
        if only.as_deref().is_some_and(|c| c != group) {
            continue;
        }
        let page_value = match view::job_page(
            &*state.store,
            JobQuery {
                state: Some(JobState::Dead),
                code: Some(group.clone()),
                plugin: query.plugin.clone().filter(|p| !p.is_empty()),
                before: query.before.filter(|_| only.is_some()),
                limit: per_code,
                ..JobQuery::default()
            },
        )
        .await
        {
            Ok(p) => p,
            Err(e) => return error_page(e.into()),
        };
        let code = escape(group);
        let _ = write!(
            body,
            "<h2 id=\"code-{code}\">{code} <span class=\"muted\">({count} jobs)</span></h2>"
        );
        let jobs = page_value["jobs"].as_array().cloned().unwrap_or_default();
        body.push_str(&job_rows(&jobs, true));
        if let Some(next) = page_value["next_before"].as_i64() {
            let _ = write!(
                body,
                "<p><a href=\"/ui/dlq?code={}&amp;before={}\">More {code} jobs</a></p>",
                escape(&enc(group)),
                if only.is_some() { next } else { i64::MAX }
            );
        }
    }
    page("Dead letters", &body)
}

async fn preview_one(
    State(state): State<ApiState>,
    path: Result<Path<String>, PathRejection>,
) -> Response {
    let id = match page_job_id(path) {
        Ok(id) => id,
        Err(error) => return error_page(error),
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
    let previews = match preview::preview_jobs(
        &*state.store,
        registry,
        std::slice::from_ref(&job),
        Some(&state.preview),
    )
    .await
    {
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

async fn replay_one(
    State(state): State<ApiState>,
    path: Result<Path<String>, PathRejection>,
) -> Response {
    let id = match page_job_id(path) {
        Ok(id) => id,
        Err(error) => return error_page(error),
    };
    let request = ReplayRequest {
        ids: vec![JobId(id)],
        limit: MAX_REPLAY,
        ..ReplayRequest::default()
    };
    match replay(&*state.store, request, &state.replay).await {
        Ok(report) if report.refused.is_empty() && !report.replayed.is_empty() => {
            Redirect::to(&format!("/ui/jobs/{id}")).into_response()
        }
        Ok(report) => {
            let mut body = format!("<h1>Job {id} was not replayed</h1>");
            for r in report.refused.iter().chain(&report.skipped) {
                let _ = write!(
                    body,
                    "<p class=\"note\"><b>{}</b>: {}</p>",
                    r.reason,
                    escape(&r.message)
                );
            }
            if report.refused.is_empty() && report.skipped.is_empty() {
                body.push_str("<p class=\"note\">It is not in the dead-letter queue.</p>");
            }
            let _ = write!(body, "<p><a href=\"/ui/jobs/{id}\">Back to the job</a></p>");
            page("Not replayed", &body)
        }
        Err(e) => error_page(e.into()),
    }
}
