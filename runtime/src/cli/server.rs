//! `idem provider-server`: runs the `idem-provider-server` dev tool, which
//! lives in its own crate so the runtime library does not carry it.

use super::{CliError, signal::shutdown_signal};
use idem_provider_server::{ProviderServerConfig, serve};

/// Arguments of `idem provider-server`.
#[derive(Debug, clap::Args)]
pub struct ProviderServerArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8025")]
    pub listen: String,
    /// Random faults per request, e.g. `500=0.1,429=0.05,late=0.02,drop=0.01`.
    #[arg(long)]
    pub fault_rates: Option<String>,
    /// How late a `late` fault answers (after applying the request).
    #[arg(long)]
    pub late_by: Option<String>,
    /// Answer 400 to requests whose body contains this text (repeatable).
    #[arg(long)]
    pub reject_matching: Vec<String>,
}

/// Serves until Ctrl-C / SIGTERM.
pub async fn run(args: ProviderServerArgs) -> Result<(), CliError> {
    let config = ProviderServerConfig::from_cli(
        args.fault_rates.as_deref(),
        args.late_by.as_deref(),
        args.reject_matching,
    )
    .map_err(|e| CliError::Usage(e.to_string()))?;
    let listener = tokio::net::TcpListener::bind(&args.listen)
        .await
        .map_err(|e| CliError::Usage(format!("cannot listen on {}: {e}", args.listen)))?;
    eprintln!("provider server listening on http://{}", args.listen);
    serve(listener, config, shutdown_signal())
        .await
        .map_err(|e| CliError::Runtime(e.into()))
}
