//! The plugins folder: every `*.wasm` is a plugin named after its file stem,
//! with an optional `<name>.toml` manifest. A bad file is reported with its
//! name and reason while the others load; changed files are picked up while
//! running (new jobs use the new version).
//!
//! What a plugin may do is declared in its code (`#[plugin(providers = ..)]`,
//! stored in the component) and may only be narrowed by the manifest.
//!
//! # Layout
//! - [`manifest`]: the sidecar manifest (limits, attempts, lease, backoff, narrowing grants).
//! - [`grants`]: reading the declaration from the component; effective grants.
//! - [`registry`]: loading the folder, reloading changes, watching it.

pub mod grants;
pub mod manifest;
pub mod registry;

pub use grants::{Grants, GrantsError, NotGranted};
pub use manifest::{Manifest, ManifestError};
pub use registry::{LoadReport, LoadedPlugin, PluginRegistry};
