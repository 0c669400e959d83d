//! `idem plugins list|check` and `idem invoke`.

use super::CliError;
use crate::config::Config;
use crate::plugins::{LoadedPlugin, PluginRegistry, registry::load_file};
use crate::sandbox::{JobInput, Sandbox, SandboxConfig};
use serde_json::json;
use std::path::Path;
use std::sync::Arc;

/// The sandbox the CLI uses, with the configured component cache.
pub fn sandbox(config: &Config) -> Result<Arc<Sandbox>, CliError> {
    let sandbox = Sandbox::new(SandboxConfig {
        cache_dir: config
            .cache_dir
            .clone()
            .or_else(crate::sandbox::default_cache_dir),
        fuel: config.sandbox.fuel,
        pooling: config.sandbox.pooling,
        max_instances: config.sandbox.max_instances,
        max_memory: (config.sandbox.max_memory_mib as usize).saturating_mul(1 << 20),
        ..SandboxConfig::default()
    })
    .map_err(|e| CliError::Runtime(e.into()))?;
    Ok(Arc::new(sandbox))
}

/// Loads the plugins folder, printing files that failed to stderr.
pub fn registry(config: &Config, dir: &Path) -> Result<Arc<PluginRegistry>, CliError> {
    if !dir.is_dir() {
        return Err(CliError::Usage(format!(
            "the plugins folder {} does not exist: build plugins with `cargo build --release --target wasm32-wasip2` and copy the .wasm files there, or pass --plugins-dir",
            dir.display()
        )));
    }
    let registry = Arc::new(PluginRegistry::new(sandbox(config)?, dir));
    for (path, why) in registry.refresh().errors {
        eprintln!("warning: {} not loaded: {why}", path.display());
    }
    Ok(registry)
}

/// `idem plugins list`
pub fn list(config: &Config, dir: &Path) -> Result<(), CliError> {
    let registry = registry(config, dir)?;
    let plugins = registry.list();
    if plugins.is_empty() {
        eprintln!("no plugins loaded from {}", dir.display());
    }
    println!(
        "{:<28} {:<14} {:>9} {:>9} {:>8} {:>8}  providers",
        "NAME", "HASH", "SIZE", "DEADLINE", "MEMORY", "EFFECTS"
    );
    for plugin in plugins {
        let limits = plugin.compiled.limits;
        let providers = plugin
            .manifest
            .providers
            .as_deref()
            .unwrap_or_default()
            .join(",");
        println!(
            "{:<28} {:<14} {:>9} {:>9} {:>8} {:>8}  {}",
            plugin.name(),
            plugin.hash().short(),
            plugin.compiled.size,
            humantime::format_duration(limits.deadline).to_string(),
            format!("{}MiB", limits.memory >> 20),
            limits.output.max_effects,
            if providers.is_empty() {
                "-"
            } else {
                &providers
            },
        );
    }
    Ok(())
}

/// `idem plugins check FILE`
pub fn check(config: &Config, file: &Path) -> Result<(), CliError> {
    let sandbox = sandbox(config)?;
    match load_file(&sandbox, file) {
        Ok(plugin) => {
            println!(
                "ok: {} is a valid idem plugin (name {}, sha256 {}, {} bytes)",
                file.display(),
                plugin.name(),
                plugin.hash(),
                plugin.compiled.size
            );
            Ok(())
        }
        Err(error) => {
            println!("invalid: {}: {error}", file.display());
            Err(CliError::Failed(format!(
                "{} is not a valid idem plugin",
                file.display()
            )))
        }
    }
}

/// `idem invoke PLUGIN --payload JSON`: prints `{"effects": [...]}` (exit 0)
/// or `{"error": {...}}` (exit 1). Nothing is executed.
pub async fn invoke(
    config: &Config,
    dir: &Path,
    name: &str,
    payload: &str,
    key: Option<String>,
) -> Result<(), CliError> {
    let registry = registry(config, dir)?;
    let plugin: Arc<LoadedPlugin> = registry.get(name).ok_or_else(|| {
        let known: Vec<_> = registry
            .list()
            .iter()
            .map(|p| p.name().to_string())
            .collect();
        CliError::Usage(format!(
            "no plugin named {name:?} in {} (loaded: {})",
            dir.display(),
            if known.is_empty() {
                "none".into()
            } else {
                known.join(", ")
            }
        ))
    })?;
    let job = JobInput {
        id: 0,
        queue: "default".into(),
        payload: payload.as_bytes().to_vec(),
        attempt: 1,
        max_attempts: plugin
            .manifest
            .max_attempts
            .unwrap_or(config.worker.max_attempts),
        idempotency_key: key,
        correlation_id: "invoke".into(),
        enqueued_at_ms: chrono::Utc::now().timestamp_millis(),
    };
    let sandbox = registry.sandbox().clone();
    let compiled = plugin.compiled.clone();
    let outcome = tokio::task::spawn_blocking(move || sandbox.run(&compiled, &job))
        .await
        .map_err(|e| CliError::Runtime(e.into()))?;
    match outcome {
        Ok(effects) => {
            println!("{}", json!({ "effects": effects }));
            Ok(())
        }
        Err(failure) => {
            println!(
                "{}",
                json!({ "error": {
                    "class": failure.class,
                    "code": failure.code,
                    "message": failure.message,
                    "retry_after_ms": failure.retry_after.map(|d| d.as_millis() as u64),
                }})
            );
            Err(CliError::Failed(format!("{name} failed: {}", failure.code)))
        }
    }
}
