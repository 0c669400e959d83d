//! `idem plugins list|check` and `idem invoke`.

use super::CliError;
use crate::config::Config;
use crate::effects::Effect;
use crate::failure::{Code, ErrorClass};
use crate::plugins::{LoadedPlugin, PluginRegistry, registry::load_file};
use crate::providers::JOBS_PROVIDER;
use crate::sandbox::{JobInput, RunError, Sandbox, SandboxConfig};
use serde_json::json;
use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;

/// The sandbox settings of the configuration, with `extra_instances` in
/// the pool beyond `[sandbox] max_instances` (the worker's share): room for
/// replay previews beside a worker
/// ([`PREVIEW_SLOTS`](crate::ops::preview::PREVIEW_SLOTS)).
///
/// `let settings = sandbox_config(&config, PREVIEW_SLOTS);`
pub fn sandbox_config(config: &Config, extra_instances: u32) -> SandboxConfig {
    SandboxConfig {
        cache_dir: config
            .cache_dir
            .clone()
            .or_else(crate::sandbox::default_cache_dir),
        fuel: config.sandbox.fuel,
        pooling: config.sandbox.pooling,
        max_instances: config.sandbox.max_instances.saturating_add(extra_instances),
        max_memory: (config.sandbox.max_memory_mib as usize).saturating_mul(1 << 20),
        ..SandboxConfig::default()
    }
}

/// The sandbox the CLI uses, with the configured component cache.
pub fn sandbox(config: &Config) -> Result<Arc<Sandbox>, CliError> {
    sandbox_with(config, 0)
}

fn sandbox_with(config: &Config, extra_instances: u32) -> Result<Arc<Sandbox>, CliError> {
    let sandbox = Sandbox::new(sandbox_config(config, extra_instances))
        .map_err(|e| CliError::Runtime(e.into()))?;
    Ok(Arc::new(sandbox))
}

/// Loads the plugins folder, printing files that failed to stderr.
pub fn registry(config: &Config, dir: &Path) -> Result<Arc<PluginRegistry>, CliError> {
    registry_with(config, dir, 0)
}

/// [`registry`] over a pool `extra_instances` above the configured one
/// (`idem run --listen`: the previews' share).
pub fn registry_with(
    config: &Config,
    dir: &Path,
    extra_instances: u32,
) -> Result<Arc<PluginRegistry>, CliError> {
    if !dir.is_dir() {
        return Err(CliError::Usage(format!(
            "the plugins folder {} does not exist: build plugins with `cargo build --release --target wasm32-wasip2` and copy the .wasm files there, or pass --plugins-dir",
            dir.display()
        )));
    }
    let registry = Arc::new(PluginRegistry::new(
        sandbox_with(config, extra_instances)?,
        dir,
    ));
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
        "{:<28} {:<14} {:>9} {:>9} {:>8} {:>8}  {:<36} GRANTED",
        "NAME", "HASH", "SIZE", "DEADLINE", "MEMORY", "EFFECTS", "DECLARED"
    );
    for plugin in plugins {
        let limits = plugin.compiled.limits;
        let grants = &plugin.grants;
        let declared = match grants.declared() {
            Some(d) => compact(
                d.providers.iter().map(String::as_str),
                d.enqueues.iter().map(String::as_str),
            ),
            None => "undeclared".to_string(),
        };
        let mut granted = compact(grants.providers(), grants.enqueues());
        if grants.declared().is_none() {
            granted.push_str(" (operator file)");
        } else if grants.is_narrowed() {
            granted.push_str(" (narrowed)");
        }
        println!(
            "{:<28} {:<14} {:>9} {:>9} {:>8} {:>8}  {:<36} {}",
            plugin.name(),
            plugin.hash().short(),
            plugin.compiled.size,
            humantime::format_duration(limits.deadline).to_string(),
            format!("{}MiB", limits.memory >> 20),
            limits.output.max_effects,
            declared,
            granted,
        );
    }
    Ok(())
}

/// `partner,jobs[send_invoice_email]`: providers, with the child plugins
/// after `jobs`; `-` for nothing.
fn compact<'a>(
    providers: impl Iterator<Item = &'a str>,
    enqueues: impl Iterator<Item = &'a str>,
) -> String {
    let enqueues: Vec<&str> = enqueues.collect();
    let providers: Vec<String> = providers
        .map(|p| {
            if p == JOBS_PROVIDER {
                format!("{p}[{}]", enqueues.join(","))
            } else {
                p.to_string()
            }
        })
        .collect();
    if providers.is_empty() {
        "-".to_string()
    } else {
        providers.join(",")
    }
}

/// `providers = ["a", "b"], enqueues = []`
fn lists<'a>(
    providers: impl Iterator<Item = &'a str>,
    enqueues: impl Iterator<Item = &'a str>,
) -> String {
    let quoted = |names: Vec<&str>| {
        names
            .iter()
            .map(|n| format!("{n:?}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    format!(
        "providers = [{}], enqueues = [{}]",
        quoted(providers.collect()),
        quoted(enqueues.collect())
    )
}

/// The declared and effective grants, as `plugins check` prints them.
fn describe_grants(plugin: &LoadedPlugin) -> String {
    let grants = &plugin.grants;
    let file = plugin.manifest_file();
    let file_name = format!("{}.toml", plugin.name());
    let granted = lists(grants.providers(), grants.enqueues());
    match grants.declared() {
        Some(declared) => {
            let source = match (&file, grants.is_narrowed()) {
                (None, _) => format!("all it declares; no {file_name}"),
                (Some(_), false) => format!("all it declares; {file_name} narrows nothing"),
                (Some(_), true) => format!("narrowed by {file_name}"),
            };
            format!(
                "declared: {}\ngranted:  {granted} ({source})",
                lists(
                    declared.providers.iter().map(String::as_str),
                    declared.enqueues.iter().map(String::as_str)
                )
            )
        }
        None => format!(
            "declared: nothing readable (no {} section: built without #[idem_sdk::plugin(..)] or with an older SDK)\ngranted:  {granted} ({})",
            idem_sdk::declaration::SECTION,
            if file.is_some() {
                format!("from {file_name} alone")
            } else {
                format!("nothing: no {file_name} grants anything")
            }
        ),
    }
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
            println!("{}", describe_grants(&plugin));
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
/// or `{"error": {...}}` (exit 1). Nothing is executed. Effects outside the
/// plugin's grants are the error a worker would record
/// (`effect_not_allowed`, with `not_granted` listing each and what to add).
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
    let outcome = registry.sandbox().call(&plugin.compiled, &job).await;
    match outcome {
        Ok(effects) => {
            let refusals = plugin.grants.refusals(&effects);
            if let Some(first) = refusals.first() {
                println!(
                    "{}",
                    json!({
                        "effects": effects,
                        "error": {
                            "class": ErrorClass::Permanent,
                            "code": Code::EffectNotAllowed.as_str(),
                            "message": first.to_string(),
                            "not_granted": refusals.iter().map(ToString::to_string).collect::<Vec<_>>(),
                        },
                    })
                );
                let mut message = format!(
                    "{name} returned effects it is not granted: a worker would dead-letter the job with {} and execute nothing:",
                    Code::EffectNotAllowed
                );
                for refusal in &refusals {
                    message.push_str(&format!("\n  {refusal}"));
                }
                return Err(CliError::Failed(message));
            }
            for provider in unconfigured(config, &effects) {
                eprintln!(
                    "warning: no provider {provider:?} is configured ([providers.{provider}] in idem.toml): `idem run` with this configuration fails such effects with provider_not_configured"
                );
            }
            println!("{}", json!({ "effects": effects }));
            Ok(())
        }
        Err(RunError::Unavailable(why)) => Err(CliError::Runtime(anyhow::anyhow!(
            "no sandbox instance is free: {why}"
        ))),
        Err(RunError::Plugin(failure)) => {
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

/// Providers the effects use that the configuration does not define.
fn unconfigured<'a>(config: &Config, effects: &'a [Effect]) -> BTreeSet<&'a str> {
    effects
        .iter()
        .map(|e| e.provider.as_str())
        .filter(|p| *p != JOBS_PROVIDER && !config.providers.contains_key(*p))
        .collect()
}
