//! The `idem` command line.
//!
//! Exit codes: 0 success; 1 the job or check failed (a classified error is
//! printed); 2 bad usage or configuration; 3 the runtime failed (database,
//! I/O). Every error tells the user what to do next.
//!
//! # Layout
//! - this module: argument definitions and dispatch.
//! - [`plugins`]: `idem plugins list|check` and `idem invoke`.
//! - [`queue`]: `idem migrate|enqueue|run|stats`.
//! - [`dlq`]: `idem dlq list|show|replay`.
//! - [`effects`]: `idem effects show|resolve`.
//! - [`ops`]: `idem serve`, `idem jobs list|show`, the HTTP surface of `idem run --listen`.
//! - [`bench`]: `idem bench`, throughput and latency on a clean store.
//! - `chaos`: `idem chaos`, kills and faults against a real setup, then
//!   checks 0 lost and 0 duplicates (with the `provider-server` feature).
//! - `server`: `idem provider-server` (only with the default `provider-server`
//!   feature).
//! - [`sources`]: `idem sources list|bench` (brokers whose messages become jobs).
//! - [`schedules`]: `idem schedules list` (periodic jobs, next and last runs).
//! - [`signal`]: Ctrl-C / SIGTERM for the long-running commands.

pub mod bench;
#[cfg(feature = "provider-server")]
pub mod chaos;
pub mod dlq;
pub mod effects;
pub mod ops;
pub mod plugins;
pub mod queue;
pub mod schedules;
#[cfg(feature = "provider-server")]
pub mod server;
pub mod signal;
pub mod sources;

use clap::{Parser, Subcommand};
use std::path::PathBuf;

/// A classified CLI failure with its exit code.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// The job, plugin or check failed; already reported on stdout.
    #[error("{0}")]
    Failed(String),
    /// Bad usage or configuration.
    #[error("{0}")]
    Usage(String),
    /// The runtime failed.
    #[error(transparent)]
    Runtime(#[from] anyhow::Error),
}

/// Most bytes of one stored value printed to the terminal.
const PRINTED_MAX: usize = crate::boundary::MAX_MESSAGE;

/// A stored value (a name, an id, a message) as the command line prints it:
/// control characters written as escapes, so a row stored before the input
/// checks existed can neither forge a line nor move the terminal; cut to
/// [`PRINTED_MAX`] bytes.
///
/// `assert_eq!(printable("a\u{1b}[2J"), "a\\u{1b}[2J");`
pub fn printable(text: &str) -> String {
    crate::boundary::log_line(text, PRINTED_MAX)
}

impl CliError {
    /// The process exit code.
    pub fn exit_code(&self) -> i32 {
        match self {
            CliError::Failed(_) => 1,
            CliError::Usage(_) => 2,
            CliError::Runtime(_) => 3,
        }
    }
}

/// idem: exactly-once business effects from at-least-once delivery.
#[derive(Debug, Parser)]
#[command(name = "idem", version, about, long_about = None)]
pub struct Cli {
    /// Configuration file (default: ./idem.toml when it exists).
    #[arg(long, global = true, env = "IDEM_CONFIG")]
    pub config: Option<PathBuf>,
    /// Folder of plugins (`*.wasm` + optional `<name>.toml`).
    #[arg(long, global = true)]
    pub plugins_dir: Option<PathBuf>,
    /// Database URL: `sqlite://PATH` (default `sqlite://idem.db`) or `postgres://...`.
    #[arg(long, global = true, env = "IDEM_DATABASE_URL")]
    pub database_url: Option<String>,
    /// Log filter, e.g. `info` or `idem=debug` (logs go to stderr).
    #[arg(long, global = true, env = "IDEM_LOG", default_value = "warn")]
    pub log: String,
    /// Log lines as `text` or `json` (one object per line, with the job's
    /// id, plugin, attempt, key and correlation id, and the effect's key).
    #[arg(long, global = true, env = "IDEM_LOG_FORMAT", default_value = "text")]
    pub log_format: LogFormat,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Inspect plugins.
    #[command(subcommand)]
    Plugins(PluginsCommand),
    /// Dry run: call a plugin once in the sandbox and print its effects as JSON. Nothing is executed.
    Invoke {
        /// Plugin name (file stem in the plugins folder).
        plugin: String,
        /// The job's payload (JSON).
        #[arg(long)]
        payload: String,
        /// The job's own idempotency key.
        #[arg(long)]
        key: Option<String>,
    },
    /// Create or upgrade the database schema (or, with --provider, a sql
    /// provider's guard table in its own database).
    Migrate {
        /// A `sql` provider whose guard table to create.
        #[arg(long)]
        provider: Option<String>,
    },
    /// Enqueue a job; prints its id (the existing job's for a duplicate key).
    Enqueue(queue::EnqueueArgs),
    /// Run the worker: claim jobs, run plugins, carry out effects.
    Run(queue::RunArgs),
    /// Measure throughput and pickup latency on a clean store (a fresh
    /// SQLite file, or a fresh schema of a `--database-url postgres://...`).
    Bench(bench::BenchArgs),
    /// Job counts per state, readiness, the last minute's rates, dead
    /// jobs by code and the schedules (next run, last run and outcome), as
    /// JSON (the same numbers as `GET /api/queues` and `GET /api/schedules`).
    Stats {
        /// Only this queue.
        #[arg(long)]
        queue: Option<String>,
    },
    /// The dead-letter queue.
    #[command(subcommand)]
    Dlq(dlq::DlqCommand),
    /// Effect ledger: show a key, resolve an effect in doubt.
    #[command(subcommand)]
    Effects(effects::EffectsCommand),
    /// Jobs: list them, or show one's timeline.
    #[command(subcommand)]
    Jobs(ops::JobsCommand),
    /// Serve the HTTP API and the dashboard without a worker.
    Serve(ops::ServeArgs),
    /// Brokers whose messages become jobs: list them, measure one.
    #[command(subcommand)]
    Sources(sources::SourcesCommand),
    /// Periodic jobs (`[[schedules]]`): next runs, last ticks and outcomes.
    #[command(subcommand)]
    Schedules(schedules::SchedulesCommand),
    /// Prove exactly-once effects here: kill and stop workers, inject
    /// provider faults, then check 0 lost and 0 duplicates.
    #[cfg(feature = "provider-server")]
    Chaos(chaos::ChaosArgs),
    /// Run the local idempotent provider server (for demos and tests).
    #[cfg(feature = "provider-server")]
    ProviderServer(server::ProviderServerArgs),
}

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// For people.
    Text,
    /// One JSON object per line, for log pipelines.
    Json,
}

/// `idem plugins ...`
#[derive(Debug, Subcommand)]
pub enum PluginsCommand {
    /// List loaded plugins with hash, size and limits; report files that failed to load.
    List,
    /// Validate a `.wasm` against the contract without running a job.
    Check {
        /// The file.
        file: PathBuf,
    },
}

/// The `idem` program: parses the arguments, sets up logging, runs the
/// command and exits with its documented code (printing the error chain).
///
/// ```no_run
/// // src/main.rs of a binary that is `idem`:
/// idem::cli::main()
/// ```
pub fn main() -> ! {
    let cli = Cli::parse();
    init_logging(&cli.log, cli.log_format);
    let code = match try_main(cli) {
        Ok(()) => 0,
        Err(error) => {
            if !matches!(error, CliError::Failed(_)) {
                eprintln!("error: {error}");
                let mut source = std::error::Error::source(&error);
                while let Some(cause) = source {
                    eprintln!("  caused by: {cause}");
                    source = cause.source();
                }
            } else {
                eprintln!("{error}");
            }
            error.exit_code()
        }
    };
    std::process::exit(code);
}

fn try_main(cli: Cli) -> Result<(), CliError> {
    let runtime = tokio::runtime::Runtime::new().map_err(|e| CliError::Runtime(e.into()))?;
    runtime.block_on(run(cli))
}

fn init_logging(filter: &str, format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_new(filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        // Spans carry the job's and the effect's fields onto every line.
        LogFormat::Json => builder
            .json()
            .with_current_span(true)
            .with_span_list(true)
            .init(),
        LogFormat::Text => builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
    }
}

/// Runs a parsed command line.
pub async fn run(cli: Cli) -> Result<(), CliError> {
    let mut config = crate::config::Config::load(cli.config.as_deref())
        .map_err(|e| CliError::Usage(e.to_string()))?;
    let explicit_url = cli.database_url.clone();
    if let Some(url) = cli.database_url {
        config.database_url = url;
    }
    let plugins_dir = cli
        .plugins_dir
        .clone()
        .unwrap_or_else(|| config.plugins_dir.clone());
    match cli.command {
        Command::Plugins(PluginsCommand::List) => plugins::list(&config, &plugins_dir),
        Command::Plugins(PluginsCommand::Check { file }) => plugins::check(&config, &file),
        Command::Invoke {
            plugin,
            payload,
            key,
        } => plugins::invoke(&config, &plugins_dir, &plugin, &payload, key).await,
        #[cfg(feature = "provider-server")]
        Command::ProviderServer(args) => server::run(args).await,
        #[cfg(feature = "provider-server")]
        Command::Chaos(args) => chaos::run(&config, &plugins_dir, args).await,
        Command::Migrate { provider } => queue::migrate(&config, provider.as_deref()).await,
        Command::Enqueue(args) => queue::enqueue(&config, &plugins_dir, args).await,
        Command::Run(args) => queue::run(&config, &plugins_dir, args).await,
        Command::Bench(args) => {
            bench::run(&config, &plugins_dir, explicit_url.as_deref(), args).await
        }
        Command::Stats { queue } => queue::stats(&config, queue.as_deref()).await,
        Command::Dlq(command) => dlq::run(&config, &plugins_dir, command).await,
        Command::Effects(command) => effects::run(&config, command).await,
        Command::Jobs(command) => ops::jobs(&config, command).await,
        Command::Serve(args) => ops::serve(&config, &plugins_dir, args).await,
        Command::Sources(command) => sources::run(&config, explicit_url.as_deref(), command).await,
        Command::Schedules(command) => schedules::run(&config, command).await,
    }
}
