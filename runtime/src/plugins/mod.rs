//! The plugins folder: every `*.wasm` is a plugin named after its file stem,
//! with an optional `<name>.toml` manifest. A bad file is reported with its
//! name and reason while the others load; changed files are picked up while
//! running (new jobs use the new version).
//!
//! # Layout
//! - [`manifest`]: the sidecar manifest (limits, attempts, lease, backoff, grants).
//! - [`registry`]: loading the folder, reloading changes, watching it.

pub mod manifest;
pub mod registry;

pub use manifest::{Manifest, ManifestError};
pub use registry::{LoadReport, LoadedPlugin, PluginRegistry};
