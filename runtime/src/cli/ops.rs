//! `idem serve`, `idem jobs list|show`, and the HTTP surface that `idem run
//! --listen` starts beside its worker.

use super::queue::store;
use super::{CliError, printable};
use crate::config::Config;
use crate::ops::api::{self, ApiState};
use crate::ops::auth::{Access, Tokens};
use crate::ops::hosts::AllowedHosts;
use crate::ops::preview::PreviewGate;
use crate::ops::server::Limits;
use crate::ops::view::{self, JobQuery};
use crate::plugins::PluginRegistry;
use crate::providers::Providers;
use crate::store::{JobId, JobState, Store};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Options of the HTTP surface (`idem run --listen`, `idem serve`).
#[derive(Debug, Clone, clap::Args)]
pub struct HttpArgs {
    /// A file holding the API token (`IDEM_API_TOKEN` wins when set); a
    /// second line is the previous token, still accepted during a rotation.
    #[arg(long)]
    pub api_token_file: Option<PathBuf>,
    /// How long a dashboard sign-in lasts (its session in the store and
    /// the cookie's Max-Age).
    #[arg(long, value_parser = parse_session_ttl, default_value = "12h")]
    pub session_ttl: std::time::Duration,
    /// Believe the reverse proxy in front: the last `X-Forwarded-For` entry
    /// is the client's address (for throttling) and `X-Forwarded-Proto:
    /// https` makes the session cookie `__Host-` and `Secure`. Only when
    /// every request comes through that proxy.
    #[arg(long)]
    pub trust_proxy: bool,
    /// Serve `/metrics` without the token (for a scraper on a trusted network).
    #[arg(long)]
    pub metrics_open: bool,
    /// Dead jobs replayed per second through the API and the dashboard.
    #[arg(long, default_value = "10/s")]
    pub replay_rate: String,
    /// Dead jobs previewed per second through the API and the dashboard
    /// (default: the replay rate); at most two run a plugin at once.
    #[arg(long)]
    pub preview_rate: Option<String>,
    /// Time from waiting for a request (a new connection, or the previous
    /// answer sent) to the end of its headers; a client still sending them
    /// is disconnected.
    #[arg(long, value_parser = positive_duration, default_value = "10s")]
    pub header_timeout: Duration,
    /// Time from the end of a request's headers to the end of its body; a
    /// body still arriving is answered 408.
    #[arg(long, value_parser = positive_duration, default_value = "30s")]
    pub body_timeout: Duration,
    /// A connection on which nothing is read or written for this long, and
    /// no request is being handled, is closed (a keep-alive connection
    /// between requests waits at most this or --header-timeout, the shorter).
    #[arg(long, value_parser = positive_duration, default_value = "5s")]
    pub idle_timeout: Duration,
    /// Connections served at once; more wait in the listen backlog, holding
    /// no file descriptor of this process.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_connections: u32,
    /// Host names (or addresses) requests may be addressed to, comma
    /// separated, without ports: any other `Host` is answered 421
    /// `host_not_allowed` (`/healthz` excepted). Default: any host; set it
    /// when the dashboard is reachable by a name (DNS rebinding).
    #[arg(long, value_delimiter = ',')]
    pub allowed_hosts: Vec<String>,
    /// Serve metrics and the health check only (`idem run --metrics-listen`).
    #[arg(skip)]
    pub metrics_only: bool,
}

impl HttpArgs {
    /// `/metrics` without a token and `/healthz`; the API and the dashboard
    /// refuse everything whatever `IDEM_API_TOKEN` says. The connection
    /// limits and the Host allow-list stay as given.
    pub fn metrics_only(&self) -> Self {
        HttpArgs {
            api_token_file: None,
            session_ttl: crate::ops::auth::DEFAULT_SESSION_TTL,
            trust_proxy: false,
            metrics_open: true,
            replay_rate: "10/s".into(),
            preview_rate: None,
            metrics_only: true,
            ..self.clone()
        }
    }

    /// The limits of every connection.
    pub fn limits(&self) -> Limits {
        Limits {
            header_timeout: self.header_timeout,
            body_timeout: self.body_timeout,
            idle_timeout: self.idle_timeout,
            max_connections: self.max_connections as usize,
        }
    }

    /// The Host allow-list; `None` (any host) without `--allowed-hosts`.
    pub fn allowed_hosts(&self) -> Result<Option<AllowedHosts>, CliError> {
        if self.allowed_hosts.is_empty() {
            return Ok(None);
        }
        AllowedHosts::parse(&self.allowed_hosts)
            .map(Some)
            .map_err(|e| CliError::Usage(format!("--allowed-hosts: {e}")))
    }
}

/// A duration flag's value: humantime (`10s`, `1m30s`, `500ms`), not zero.
fn positive_duration(text: &str) -> Result<Duration, String> {
    match humantime::parse_duration(text) {
        Ok(d) if d.is_zero() => Err("must be more than zero".into()),
        Ok(d) => Ok(d),
        Err(e) => Err(e.to_string()),
    }
}

/// `--session-ttl`: a duration between a minute and 30 days.
fn parse_session_ttl(text: &str) -> Result<std::time::Duration, String> {
    let ttl = humantime::parse_duration(text).map_err(|e| e.to_string())?;
    let (min, max) = (
        std::time::Duration::from_secs(60),
        std::time::Duration::from_secs(30 * 24 * 3600),
    );
    if ttl < min || ttl > max {
        return Err("a session lasts between 1m and 30days".into());
    }
    Ok(ttl)
}

/// Binds the HTTP address before anything else starts, so a taken port is
/// a usage error at once.
pub async fn bind(addr: SocketAddr) -> Result<tokio::net::TcpListener, CliError> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| CliError::Usage(format!("--listen {addr}: {e}")))
}

/// Installs the metrics recorder and serves the HTTP surface until
/// `shutdown`; without a token only `/healthz` and `/metrics` answer.
#[allow(clippy::too_many_arguments)]
pub fn start(
    listener: tokio::net::TcpListener,
    args: &HttpArgs,
    config: &Config,
    store: Arc<dyn Store>,
    registry: Option<Arc<PluginRegistry>>,
    providers: Providers,
    worker: bool,
    shutdown: CancellationToken,
) -> Result<tokio::task::JoinHandle<()>, CliError> {
    let tokens = if args.metrics_only {
        None
    } else {
        Tokens::from_config(args.api_token_file.as_deref()).map_err(CliError::Usage)?
    };
    if tokens.is_none() && !args.metrics_only {
        eprintln!(
            "warning: no API token (IDEM_API_TOKEN or --api-token-file): only /healthz and /metrics answer; the API and the dashboard refuse every request"
        );
    }
    let pacer = crate::ops::replay::parse_rate(&args.replay_rate)
        .and_then(crate::ops::replay::Pacer::per_second)
        .map_err(|e| CliError::Usage(format!("--replay-rate: {e}")))?;
    let preview = preview_gate(args)?;
    let (limits, allowed_hosts) = (args.limits(), args.allowed_hosts()?);
    let metrics = crate::metrics::install_prometheus().map_err(|e| {
        CliError::Runtime(anyhow::anyhow!("cannot install the metrics recorder: {e}"))
    })?;
    let state = ApiState {
        store,
        registry,
        providers,
        access: Arc::new(Access {
            session_ttl: args.session_ttl,
            trust_proxy: args.trust_proxy,
            ..Access::new(tokens)
        }),
        metrics: Some(metrics),
        metrics_open: args.metrics_open,
        replay: Arc::new(pacer),
        default_max_attempts: config.worker.max_attempts,
        worker,
        preview: Arc::new(preview),
        schedules: config.schedules.clone().into(),
    };
    let addr = listener.local_addr().ok();
    if allowed_hosts.is_none() && !args.metrics_only && addr.is_some_and(|a| !a.ip().is_loopback())
    {
        eprintln!(
            "warning: no --allowed-hosts: a web page whose name is made to resolve to this address (DNS rebinding) reaches the sign-in form; name the hosts the dashboard is reached by"
        );
    }
    tracing::info!(
        ?addr,
        "HTTP surface listening: /api, /ui, /metrics, /healthz"
    );
    Ok(tokio::spawn(async move {
        api::serve_with(listener, state, limits, allowed_hosts, shutdown).await;
    }))
}

/// The gate of replay previews: `--preview-rate`, else `--replay-rate`.
fn preview_gate(args: &HttpArgs) -> Result<PreviewGate, CliError> {
    let (flag, rate) = match &args.preview_rate {
        Some(rate) => ("--preview-rate", rate),
        None => ("--replay-rate", &args.replay_rate),
    };
    crate::ops::replay::parse_rate(rate)
        .and_then(PreviewGate::per_second)
        .map_err(|e| CliError::Usage(format!("{flag}: {e}")))
}

/// Arguments of `idem serve`.
#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// Address to serve on.
    #[arg(long, default_value = "127.0.0.1:9090")]
    pub listen: SocketAddr,
    #[command(flatten)]
    pub http: HttpArgs,
}

/// `idem serve`: the API and the dashboard without a worker.
pub async fn serve(config: &Config, plugins_dir: &Path, args: ServeArgs) -> Result<(), CliError> {
    let listener = bind(args.listen).await?;
    let store = store(config).await?;
    // Plugins are loaded for replay previews (and kept current, so a fixed
    // `.wasm` dropped in the folder is what the preview runs); a folder that
    // cannot be read leaves previews unavailable, not the API.
    let registry = match super::plugins::registry(config, plugins_dir) {
        Ok(registry) => Some(registry),
        Err(error) => {
            eprintln!("warning: no plugins for replay previews: {error}");
            None
        }
    };
    let _watcher = registry.as_ref().and_then(|r| r.watch().ok());
    let shutdown = CancellationToken::new();
    let signal = shutdown.clone();
    tokio::spawn(async move {
        super::signal::shutdown_signal().await;
        signal.cancel();
    });
    eprintln!(
        "serving the API on http://{}/api and the dashboard on http://{}/ui",
        args.listen, args.listen
    );
    let server = start(
        listener,
        &args.http,
        config,
        store,
        registry,
        Providers::default(),
        false,
        shutdown.clone(),
    )?;
    shutdown.cancelled().await;
    let _ = tokio::time::timeout(std::time::Duration::from_secs(5), server).await;
    Ok(())
}

/// `idem jobs ...`
#[derive(Debug, clap::Subcommand)]
pub enum JobsCommand {
    /// List jobs, newest first.
    List {
        /// Only this state (available, blocked, running, retrying, succeeded, dead, cancelled).
        #[arg(long)]
        state: Option<String>,
        /// Only this queue.
        #[arg(long)]
        queue: Option<String>,
        /// Only this plugin.
        #[arg(long)]
        plugin: Option<String>,
        /// Only ids below this one (the next page).
        #[arg(long)]
        before: Option<i64>,
        /// Most rows.
        #[arg(long, default_value_t = 50)]
        limit: u32,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// A job's timeline: attempts, errors, its plan and each effect.
    Show {
        /// Job id.
        id: i64,
        /// Print JSON instead of the timeline.
        #[arg(long)]
        json: bool,
    },
}

/// Runs a jobs command.
pub async fn jobs(config: &Config, command: JobsCommand) -> Result<(), CliError> {
    let store = store(config).await?;
    let runtime = |e: crate::ops::OpsError| match e {
        crate::ops::OpsError::NotFound(m) => CliError::Failed(m),
        crate::ops::OpsError::Invalid(m) => CliError::Usage(m),
        other => CliError::Runtime(other.into()),
    };
    match command {
        JobsCommand::List {
            state,
            queue,
            plugin,
            before,
            limit,
            json,
        } => {
            let state = state
                .map(|s| {
                    JobState::ALL
                        .into_iter()
                        .find(|st| st.as_str() == s)
                        .ok_or_else(|| CliError::Usage(format!("--state: unknown state {s:?}")))
                })
                .transpose()?;
            let page = view::job_page(
                &*store,
                JobQuery {
                    state,
                    queue,
                    plugin,
                    before,
                    limit,
                    ..JobQuery::default()
                },
            )
            .await
            .map_err(runtime)?;
            if json {
                println!("{page}");
                return Ok(());
            }
            println!(
                "{:>8} {:<22} {:<12} {:<10} {:>8} {:<28} {:<24}",
                "ID", "PLUGIN", "QUEUE", "STATE", "ATTEMPTS", "LAST ERROR", "CREATED"
            );
            for job in page["jobs"].as_array().into_iter().flatten() {
                println!("{}", job_row(job));
            }
            if let Some(next) = page["next_before"].as_i64() {
                eprintln!("more: --before {next}");
            }
            Ok(())
        }
        JobsCommand::Show { id, json } => {
            let detail = view::job_detail(&*store, JobId(id))
                .await
                .map_err(runtime)?;
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&detail).unwrap_or_default()
                );
                return Ok(());
            }
            print!("{}", timeline_text(&detail));
            Ok(())
        }
    }
}

/// Text of a JSON field as the terminal shows it (`-` when absent).
fn cell(value: &serde_json::Value) -> String {
    printable(value.as_str().unwrap_or("-"))
}

/// One row of `idem jobs list`.
fn job_row(job: &serde_json::Value) -> String {
    format!(
        "{:>8} {:<22} {:<12} {:<10} {:>8} {:<28} {:<24}",
        job["id"].to_string(),
        cell(&job["plugin"]),
        cell(&job["queue"]),
        cell(&job["state"]),
        format!(
            "{}/{}",
            job["attempt"],
            view::count_or_dash(&job["max_attempts"])
        ),
        cell(&job["last_error"]["code"]),
        cell(&job["created_at"]),
    )
}

/// A job's detail as a terminal timeline.
pub fn timeline_text(detail: &serde_json::Value) -> String {
    use std::fmt::Write as _;
    let s = cell;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "job {}  {}  plugin {}  queue {}  attempt {}/{}  key {}  correlation {}",
        detail["id"],
        s(&detail["state"]).to_uppercase(),
        s(&detail["plugin"]),
        s(&detail["queue"]),
        detail["attempt"],
        view::count_or_dash(&detail["max_attempts"]),
        s(&detail["idempotency_key"]),
        s(&detail["correlation_id"]),
    );
    let _ = writeln!(out, "\ntimeline");
    for event in detail["timeline"].as_array().into_iter().flatten() {
        let extra = if event["event"] == "attempt_failed" {
            format!(
                "  attempt {} {} {}: {}",
                event["attempt"],
                s(&event["class"]),
                s(&event["code"]),
                s(&event["message"])
            )
        } else {
            String::new()
        };
        let _ = writeln!(out, "  {}  {}{extra}", s(&event["at"]), s(&event["event"]));
    }
    let _ = writeln!(out, "\neffects");
    let effects = detail["effects"].as_array().cloned().unwrap_or_default();
    if effects.is_empty() {
        let _ = writeln!(out, "  (no stored plan)");
    }
    for e in &effects {
        let _ = writeln!(
            out,
            "  {:<11} {:<44} {:<12} {:<8} result {}{}",
            s(&e["status"]),
            s(&e["key"]),
            s(&e["provider"]),
            s(&e["action"]),
            s(&e["result_ref"]),
            e["last_error_code"]
                .as_str()
                .map(|c| format!("  last error {}", printable(c)))
                .unwrap_or_default()
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        http: HttpArgs,
    }

    #[test]
    fn the_flags_defaults_are_the_documented_limits() {
        let cli = Cli::try_parse_from(["idem"]).unwrap();
        assert_eq!(cli.http.limits(), Limits::default());
        assert!(cli.http.allowed_hosts().unwrap().is_none());
        let cli = Cli::try_parse_from([
            "idem",
            "--header-timeout",
            "500ms",
            "--max-connections",
            "4",
            "--allowed-hosts",
            "a.example,b.example",
        ])
        .unwrap();
        assert_eq!(cli.http.limits().header_timeout, Duration::from_millis(500));
        assert_eq!(cli.http.limits().max_connections, 4);
        let hosts = cli.http.allowed_hosts().unwrap().unwrap();
        assert!(hosts.allows("b.example:9090") && !hosts.allows("c.example"));
        // `--metrics-listen` keeps the limits and the list.
        assert_eq!(cli.http.metrics_only().limits(), cli.http.limits());
        assert_eq!(cli.http.metrics_only().allowed_hosts.len(), 2);
    }
}
