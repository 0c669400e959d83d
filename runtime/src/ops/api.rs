//! The HTTP surface of a runtime: the API under `/api/` (its OpenAPI
//! document at `/api/openapi.json`), the dashboard at `/ui`, Prometheus
//! metrics at `/metrics` and `/healthz`. Served by `idem run --listen` and
//! `idem serve`.
//!
//! Every route but `/healthz` (and `/metrics` when it is left open) asks for
//! the bearer token; errors are JSON, `{"error":{"code","message"}}`;
//! bodies are capped; no input makes a handler panic.

use super::auth::Access;
use super::replay::{Pacer, ReplayRequest, replay, selected};
use super::view::{self, JobQuery};
use super::{OpsError, preview};
use crate::plugins::PluginRegistry;
use crate::providers::Providers;
use crate::store::{JobId, JobState, NewJob, Store};
use axum::Router;
use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::{StatusCode, Uri, header};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use metrics_exporter_prometheus::PrometheusHandle;
use serde::Deserialize;
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::Duration;

/// Largest request body accepted (a batch of jobs included).
pub const MAX_BODY_BYTES: usize = 4 << 20;
/// Most jobs in one `POST /api/jobs/batch`.
pub const MAX_BATCH: usize = 1000;
/// Most dead jobs one replay or preview request handles.
pub const MAX_REPLAY: u32 = 100;

/// What the routes need.
#[derive(Clone)]
pub struct ApiState {
    /// The store.
    pub store: Arc<dyn Store>,
    /// Loaded plugins (replay previews; the manifest's attempts on enqueue).
    pub registry: Option<Arc<PluginRegistry>>,
    /// The providers of this process (circuit states); empty for `idem serve`.
    pub providers: Providers,
    /// The tokens, sessions, trusted proxy and failure throttle; without a
    /// token only `/healthz` (and open metrics) answer.
    pub access: Arc<Access>,
    /// The Prometheus recorder's handle, for `/metrics`.
    pub metrics: Option<PrometheusHandle>,
    /// Serve `/metrics` without the token.
    pub metrics_open: bool,
    /// Paces replays across every request (the rate is the process's, not
    /// each request's).
    pub replay: Arc<Pacer>,
    /// Attempts of an enqueued job when neither request nor manifest says.
    pub default_max_attempts: u32,
    /// Whether a worker runs in this process (`idem run`).
    pub worker: bool,
    /// Paces replay previews across every request and bounds how many run
    /// a plugin at once (they share the sandbox with the worker).
    pub preview: Arc<preview::PreviewGate>,
    /// The configured `[[schedules]]`, for their cron, zone and next run.
    pub schedules: Arc<[crate::schedule::Schedule]>,
}

/// An error answer: a status and `{"error":{"code","message"}}`.
#[derive(Debug)]
pub struct ApiError {
    pub(super) status: StatusCode,
    pub(super) code: &'static str,
    pub(super) message: String,
}

impl ApiError {
    /// An error with a status, a code and a message.
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            code,
            message: message.into(),
        }
    }

    fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request", message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {"code": self.code, "message": self.message}});
        (self.status, axum::Json(body)).into_response()
    }
}

impl From<OpsError> for ApiError {
    fn from(error: OpsError) -> Self {
        let status = match &error {
            OpsError::NotFound(_) => StatusCode::NOT_FOUND,
            OpsError::Invalid(_) => StatusCode::BAD_REQUEST,
            OpsError::Store(e) if e.is_transient() => StatusCode::SERVICE_UNAVAILABLE,
            OpsError::Store(crate::store::StoreError::Invalid(_)) => StatusCode::BAD_REQUEST,
            OpsError::Store(_) | OpsError::Plugin(_) => StatusCode::SERVICE_UNAVAILABLE,
        };
        ApiError::new(status, error.code(), error.to_string())
    }
}

impl From<crate::store::StoreError> for ApiError {
    fn from(error: crate::store::StoreError) -> Self {
        OpsError::from(error).into()
    }
}

impl From<JsonRejection> for ApiError {
    fn from(rejection: JsonRejection) -> Self {
        let status = match &rejection {
            JsonRejection::MissingJsonContentType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            JsonRejection::BytesRejection(_) => StatusCode::PAYLOAD_TOO_LARGE,
            _ => StatusCode::BAD_REQUEST,
        };
        let code = if status == StatusCode::PAYLOAD_TOO_LARGE {
            "body_too_large"
        } else {
            "invalid_json"
        };
        ApiError::new(status, code, rejection.body_text())
    }
}

impl From<QueryRejection> for ApiError {
    fn from(rejection: QueryRejection) -> Self {
        ApiError::bad_request(rejection.body_text())
    }
}

/// A path that does not decode (`%FF` is not UTF-8) is the caller's error,
/// answered in the API's JSON shape like every other one.
impl From<PathRejection> for ApiError {
    fn from(rejection: PathRejection) -> Self {
        ApiError::bad_request(format!("the path is not usable: {}", rejection.body_text()))
    }
}

type ApiResult = Result<Response, ApiError>;

fn ok(value: Value) -> ApiResult {
    Ok(axum::Json(value).into_response())
}

/// Every route, as the OpenAPI document lists them (a test keeps the two
/// in step).
pub const ROUTES: &[(&str, &str)] = &[
    ("get", "/healthz"),
    ("get", "/metrics"),
    ("get", "/api/openapi.json"),
    ("get", "/api/queues"),
    ("get", "/api/providers"),
    ("get", "/api/schedules"),
    ("get", "/api/jobs"),
    ("post", "/api/jobs"),
    ("post", "/api/jobs/batch"),
    ("get", "/api/jobs/{id}"),
    ("post", "/api/jobs/{id}/cancel"),
    ("get", "/api/dlq"),
    ("get", "/api/dlq/{id}"),
    ("post", "/api/dlq/replay"),
    ("post", "/api/dlq/preview"),
];

/// The OpenAPI 3 document of the API.
pub const OPENAPI: &str = include_str!("openapi.json");

/// The whole HTTP surface.
///
/// ```no_run
/// # async fn demo(state: idem::ops::api::ApiState) -> std::io::Result<()> {
/// let listener = tokio::net::TcpListener::bind("127.0.0.1:9090").await?;
/// axum::serve(listener, idem::ops::api::router(state)).await
/// # }
/// ```
pub fn router(state: ApiState) -> Router {
    let api = Router::new()
        .route("/api/queues", get(queues))
        .route("/api/providers", get(providers))
        .route("/api/schedules", get(schedules))
        .route("/api/jobs", get(list_jobs).post(enqueue))
        .route("/api/jobs/batch", post(enqueue_batch))
        .route("/api/jobs/{id}", get(show_job))
        .route("/api/jobs/{id}/cancel", post(cancel))
        .route("/api/dlq", get(dead_letters))
        .route("/api/dlq/{id}", get(show_dead))
        .route("/api/dlq/replay", post(replay_dead))
        .route("/api/dlq/preview", post(preview_dead))
        .route("/api/{*rest}", get(not_found).post(not_found))
        .merge(super::ui::routes())
        // Set before the token layer, so a wrong method is still answered
        // only to a caller with the token.
        .method_not_allowed_fallback(method_not_allowed)
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            super::gate::require_token,
        ));
    let metrics = Router::new().route("/metrics", get(prometheus));
    let metrics = if state.metrics_open || state.access.tokens.is_none() {
        metrics
    } else {
        metrics.route_layer(middleware::from_fn_with_state(
            state.clone(),
            super::gate::require_token,
        ))
    };
    Router::new()
        .route("/healthz", get(healthz))
        .route("/api/openapi.json", get(openapi))
        .merge(super::ui::public_routes())
        .merge(api)
        .merge(metrics)
        .method_not_allowed_fallback(method_not_allowed)
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        // Outermost, so every answer gets them: errors, fallbacks, redirects.
        .layer(middleware::map_response(super::headers::secure))
        .with_state(state)
}

async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such route")
}

/// A route asked with a method it does not take: the JSON error (axum adds
/// the `Allow` header), or the error page under `/ui`.
async fn method_not_allowed(uri: Uri) -> Response {
    let error = ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        format!("{} does not take this method (see Allow)", uri.path()),
    );
    if uri.path().starts_with("/ui") {
        super::ui::error_page(error)
    } else {
        error.into_response()
    }
}

async fn healthz(State(state): State<ApiState>) -> Response {
    match state.store.job_get(JobId(0)).await {
        Ok(_) => axum::Json(json!({"status": "ok", "backend": state.store.backend().as_str(), "worker": state.worker})).into_response(),
        Err(error) => {
            // The detail (hosts, users, paths) goes to the log, not to
            // whoever asks without a token.
            tracing::warn!(%error, "health check: the store cannot be read");
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "store_unavailable",
                "the store cannot be read (see the runtime's log)",
            )
            .into_response()
        }
    }
}

async fn openapi() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], OPENAPI).into_response()
}

async fn prometheus(State(state): State<ApiState>) -> Response {
    match &state.metrics {
        Some(handle) => (
            [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
            handle.render(),
        )
            .into_response(),
        None => ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            "metrics are not recorded by this process",
        )
        .into_response(),
    }
}

async fn queues(State(state): State<ApiState>) -> ApiResult {
    let overview = view::overview(&*state.store).await?;
    ok(serde_json::to_value(overview).unwrap_or_default())
}

async fn schedules(State(state): State<ApiState>) -> ApiResult {
    let list = view::schedules(&*state.store, &state.schedules).await?;
    ok(json!({ "schedules": list }))
}

async fn providers(State(state): State<ApiState>) -> ApiResult {
    let list: Vec<Value> = state
        .providers
        .iter()
        .map(|p| {
            json!({
                "name": p.name,
                "circuit": p.guard.circuit(),
                "in_flight": p.guard.in_flight(),
                "timeout_ms": p.provider.timeout().as_millis() as u64,
            })
        })
        .collect();
    ok(json!({"worker": state.worker, "providers": list}))
}

/// Query of `GET /api/jobs`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ListQuery {
    state: Option<String>,
    queue: Option<String>,
    plugin: Option<String>,
    code: Option<String>,
    before: Option<i64>,
    limit: Option<u32>,
}

fn parse_state(text: Option<&str>) -> Result<Option<JobState>, ApiError> {
    text.map(|s| {
        JobState::ALL
            .into_iter()
            .find(|state| state.as_str() == s)
            .ok_or_else(|| {
                ApiError::bad_request(format!(
                    "unknown state {s:?}: one of available, blocked, running, retrying, succeeded, dead, cancelled"
                ))
            })
    })
    .transpose()
}

async fn list_jobs(
    State(state): State<ApiState>,
    query: Result<Query<ListQuery>, QueryRejection>,
) -> ApiResult {
    let Query(query) = query?;
    let page = view::job_page(
        &*state.store,
        JobQuery {
            state: parse_state(query.state.as_deref())?,
            queue: query.queue,
            plugin: query.plugin,
            code: query.code,
            before: query.before,
            limit: query.limit.unwrap_or(50),
        },
    )
    .await?;
    ok(page)
}

fn job_id(text: &str) -> Result<JobId, ApiError> {
    text.parse::<i64>()
        .ok()
        .filter(|id| *id > 0)
        .map(JobId)
        .ok_or_else(|| ApiError::bad_request(format!("not a job id: {text:?}")))
}

/// The job id of a `{id}` route: a path that does not decode and an id
/// that is not a positive integer are both 400 `invalid_request`.
fn path_job_id(path: Result<Path<String>, PathRejection>) -> Result<JobId, ApiError> {
    let Path(text) = path?;
    job_id(&text)
}

async fn show_job(
    State(state): State<ApiState>,
    path: Result<Path<String>, PathRejection>,
) -> ApiResult {
    ok(view::job_detail(&*state.store, path_job_id(path)?).await?)
}

/// `GET /api/dlq/{id}`: the job only while it is dead, so the dead-letter
/// queue's own route never shows a job that is not in it.
async fn show_dead(
    State(state): State<ApiState>,
    path: Result<Path<String>, PathRejection>,
) -> ApiResult {
    let id = path_job_id(path)?;
    let detail = view::job_detail(&*state.store, id).await?;
    if detail["state"] != "dead" {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!(
                "job {id} is not dead (it is {}): GET /api/jobs/{id} shows it",
                detail["state"].as_str().unwrap_or("in no known state")
            ),
        ));
    }
    ok(detail)
}

async fn cancel(
    State(state): State<ApiState>,
    path: Result<Path<String>, PathRejection>,
) -> ApiResult {
    let id = path_job_id(path)?;
    if state.store.job_get(id).await?.is_none() {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no job {id}"),
        ));
    }
    if state.store.job_cancel(id).await? {
        ok(json!({"id": id, "cancelled": true}))
    } else {
        Err(ApiError::new(
            StatusCode::CONFLICT,
            "not_cancellable",
            format!("job {id} is running or finished: only waiting jobs can be cancelled"),
        ))
    }
}

/// One job to enqueue (`POST /api/jobs`, and each of a batch).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnqueueBody {
    plugin: String,
    #[serde(default)]
    payload: Value,
    key: Option<String>,
    queue: Option<String>,
    #[serde(default, with = "humantime_serde::option")]
    delay: Option<Duration>,
    priority: Option<i32>,
    max_attempts: Option<u32>,
    correlation_id: Option<String>,
    /// Concurrency key: at most one job of a group runs at a time.
    group: Option<String>,
}

fn new_job(state: &ApiState, body: EnqueueBody) -> Result<NewJob, String> {
    if let Some(key) = &body.key {
        idem_sdk::key::validate(key).map_err(|e| format!("key: {e}"))?;
    }
    let manifest = state
        .registry
        .as_ref()
        .and_then(|r| r.get(&body.plugin))
        .and_then(|p| p.manifest.max_attempts);
    let job = NewJob {
        queue: body.queue.unwrap_or_else(|| "default".into()),
        payload: serde_json::to_vec(&body.payload).map_err(|e| e.to_string())?,
        idempotency_key: body.key,
        priority: body.priority.unwrap_or(0),
        delay: body.delay.unwrap_or_default(),
        max_attempts: body
            .max_attempts
            .or(manifest)
            .unwrap_or(state.default_max_attempts),
        correlation_id: body.correlation_id,
        plugin: body.plugin,
        group: body.group,
    };
    crate::store::check_new_job(&job).map_err(|e| e.to_string())?;
    Ok(job)
}

async fn enqueue(
    State(state): State<ApiState>,
    body: Result<axum::Json<EnqueueBody>, JsonRejection>,
) -> ApiResult {
    let axum::Json(body) = body?;
    let job = new_job(&state, body).map_err(ApiError::bad_request)?;
    let enqueued = state.store.job_insert(job).await?;
    let status = if enqueued.inserted {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((
        status,
        axum::Json(json!({"id": enqueued.id, "inserted": enqueued.inserted})),
    )
        .into_response())
}

/// `POST /api/jobs/batch`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct BatchBody {
    jobs: Vec<EnqueueBody>,
}

async fn enqueue_batch(
    State(state): State<ApiState>,
    body: Result<axum::Json<BatchBody>, JsonRejection>,
) -> ApiResult {
    let axum::Json(body) = body?;
    if body.jobs.is_empty() || body.jobs.len() > MAX_BATCH {
        return Err(ApiError::bad_request(format!(
            "a batch holds 1 to {MAX_BATCH} jobs, not {}",
            body.jobs.len()
        )));
    }
    let mut jobs = Vec::with_capacity(body.jobs.len());
    for (i, job) in body.jobs.into_iter().enumerate() {
        jobs.push(
            new_job(&state, job)
                .map_err(|why| ApiError::bad_request(format!("jobs[{i}]: {why}")))?,
        );
    }
    let enqueued = state.store.job_insert_many(jobs).await?;
    ok(
        json!({"jobs": enqueued.iter().map(|e| json!({"id": e.id, "inserted": e.inserted})).collect::<Vec<_>>()}),
    )
}

/// Query of `GET /api/dlq`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct DlqQuery {
    plugin: Option<String>,
    code: Option<String>,
    before: Option<i64>,
    limit: Option<u32>,
}

async fn dead_letters(
    State(state): State<ApiState>,
    query: Result<Query<DlqQuery>, QueryRejection>,
) -> ApiResult {
    let Query(query) = query?;
    let mut codes = state.store.queue_stats(None).await?.dead_by_code;
    codes.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut page = view::job_page(
        &*state.store,
        JobQuery {
            state: Some(JobState::Dead),
            plugin: query.plugin,
            code: query.code,
            before: query.before,
            limit: query.limit.unwrap_or(50),
            ..JobQuery::default()
        },
    )
    .await?;
    page["by_code"] = codes
        .into_iter()
        .map(|(code, jobs)| json!({"code": code, "jobs": jobs}))
        .collect::<Vec<_>>()
        .into();
    ok(page)
}

/// `POST /api/dlq/replay` and `/api/dlq/preview`: which dead jobs.
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct ReplayBody {
    #[serde(default)]
    ids: Vec<i64>,
    plugin: Option<String>,
    code: Option<String>,
    #[serde(default)]
    all: bool,
    #[serde(default)]
    discard_plan: bool,
    #[serde(default)]
    dry_run: bool,
}

fn replay_request(body: &ReplayBody) -> Result<ReplayRequest, ApiError> {
    if body.ids.iter().any(|id| *id <= 0) {
        return Err(ApiError::bad_request("job ids are positive integers"));
    }
    if body.ids.len() > MAX_REPLAY as usize {
        return Err(ApiError::bad_request(format!(
            "at most {MAX_REPLAY} ids per request"
        )));
    }
    Ok(ReplayRequest {
        ids: body.ids.iter().copied().map(JobId).collect(),
        plugin: body.plugin.clone(),
        code: body.code.clone(),
        all: body.all,
        discard_plan: body.discard_plan,
        limit: MAX_REPLAY,
    })
}

async fn replay_dead(
    State(state): State<ApiState>,
    body: Result<axum::Json<ReplayBody>, JsonRejection>,
) -> ApiResult {
    let axum::Json(body) = body?;
    if body.dry_run {
        return preview_body(&state, &body).await;
    }
    let request = replay_request(&body)?;
    let report = replay(&*state.store, request, &state.replay).await?;
    ok(serde_json::to_value(report).unwrap_or_default())
}

async fn preview_dead(
    State(state): State<ApiState>,
    body: Result<axum::Json<ReplayBody>, JsonRejection>,
) -> ApiResult {
    let axum::Json(body) = body?;
    preview_body(&state, &body).await
}

async fn preview_body(state: &ApiState, body: &ReplayBody) -> ApiResult {
    let Some(registry) = &state.registry else {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "plugin_unavailable",
            "this process loads no plugins: start it with a plugins folder",
        ));
    };
    let request = replay_request(body)?;
    let mut jobs = selected(&*state.store, &request).await?;
    let more = jobs.len() > MAX_REPLAY as usize;
    jobs.truncate(MAX_REPLAY as usize);
    let previews =
        preview::preview_jobs(&*state.store, registry, &jobs, Some(&state.preview)).await?;
    ok(json!({"dry_run": true, "jobs": previews, "more": more}))
}

/// Serves the HTTP surface on `listener` with the default
/// [`Limits`](super::server::Limits) and no Host allow-list until
/// `shutdown` fires and its connections close (see [`serve_with`]).
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: ApiState,
    shutdown: tokio_util::sync::CancellationToken,
) -> std::io::Result<()> {
    serve_with(
        listener,
        state,
        super::server::Limits::default(),
        None,
        shutdown,
    )
    .await;
    Ok(())
}

/// Serves the HTTP surface on `listener` within `limits` (see
/// [`super::server`]), answering only the `allowed_hosts` when given, until
/// `shutdown` fires and its connections close.
pub async fn serve_with(
    listener: tokio::net::TcpListener,
    state: ApiState,
    limits: super::server::Limits,
    allowed_hosts: Option<super::hosts::AllowedHosts>,
    shutdown: tokio_util::sync::CancellationToken,
) {
    super::server::serve(listener, app(state, allowed_hosts), limits, shutdown).await
}

/// The router with what guards it before any route: the Host allow-list
/// (outermost, so a refused name reaches neither the token check nor a
/// route) and the sign-in form's body cap.
///
/// ```
/// # fn demo(state: idem::ops::api::ApiState) {
/// let hosts = idem::ops::hosts::AllowedHosts::parse(["idem.example.com"]).ok();
/// let app: axum::Router = idem::ops::api::app(state, hosts);
/// # }
/// ```
pub fn app(state: ApiState, allowed_hosts: Option<super::hosts::AllowedHosts>) -> Router {
    router(state)
        .layer(middleware::from_fn(super::body::cap_login_body))
        .layer(middleware::from_fn_with_state(
            allowed_hosts,
            super::hosts::check,
        ))
        // Their refusals get the security headers too.
        .layer(middleware::map_response(super::headers::secure))
}
