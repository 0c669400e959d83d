//! Shared helpers for idem's whole-system tests: the built guest plugins and
//! ready-made sandboxes.

/// Paths of the guest plugins, built by `build.rs` from `plugins/`.
pub mod plugins {
    include!(concat!(env!("OUT_DIR"), "/gen.rs"));
}

use idem::plugins::{PluginRegistry, registry::load_file};
use idem::sandbox::{Sandbox, SandboxConfig};
use std::sync::Arc;

/// A sandbox with the default configuration (no disk cache).
pub fn sandbox() -> Arc<Sandbox> {
    Arc::new(Sandbox::new(SandboxConfig::default()).expect("sandbox"))
}

/// A registry over a temporary copy of the built plugins folder, so tests can
/// add, replace and remove files.
pub fn registry_copy() -> (tempfile::TempDir, Arc<PluginRegistry>) {
    let dir = tempfile::tempdir().expect("tempdir");
    for entry in std::fs::read_dir(plugins::PLUGINS_DIR).expect("plugins dir") {
        let path = entry.expect("entry").path();
        let dest = dir.path().join(path.file_name().expect("file name"));
        std::fs::copy(&path, dest).expect("copy plugin");
    }
    let registry = Arc::new(PluginRegistry::new(sandbox(), dir.path()));
    (dir, registry)
}

/// Loads one built plugin (with its manifest) into `sandbox`.
pub fn load(sandbox: &Sandbox, path: &str) -> idem::plugins::LoadedPlugin {
    load_file(sandbox, std::path::Path::new(path)).expect("load plugin")
}
