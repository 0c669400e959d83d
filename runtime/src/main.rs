//! The `idem` binary. See `idem --help`; exit codes are documented in `idem::cli`.
use clap::Parser;

fn main() {
    let cli = idem::cli::Cli::parse();
    init_logging(&cli.log);
    let code = match try_main(cli) {
        Ok(()) => 0,
        Err(error) => {
            if !matches!(error, idem::cli::CliError::Failed(_)) {
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

fn try_main(cli: idem::cli::Cli) -> Result<(), idem::cli::CliError> {
    let runtime =
        tokio::runtime::Runtime::new().map_err(|e| idem::cli::CliError::Runtime(e.into()))?;
    runtime.block_on(idem::cli::run(cli))
}

fn init_logging(filter: &str) {
    let filter = tracing_subscriber::EnvFilter::try_new(filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();
}
