//! Loading the plugins folder and keeping it current.

use super::grants::{self, Grants};
use super::manifest::Manifest;
use crate::sandbox::{CompiledPlugin, ContentHash, Sandbox};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

/// One loaded plugin: the compiled component, its manifest and its grants.
#[derive(Debug, Clone)]
pub struct LoadedPlugin {
    /// Compiled and linked component.
    pub compiled: CompiledPlugin,
    /// The manifest (defaults when there is no sidecar file).
    pub manifest: Manifest,
    /// What the plugin declares, narrowed by the manifest: decides every effect.
    pub grants: Grants,
    /// Where the `.wasm` was read from.
    pub path: PathBuf,
    manifest_text: Option<String>,
}

impl LoadedPlugin {
    /// Plugin name.
    pub fn name(&self) -> &str {
        &self.compiled.name
    }

    /// Content hash of the `.wasm`.
    pub fn hash(&self) -> &ContentHash {
        &self.compiled.hash
    }

    /// The operator file `<name>.toml` beside the `.wasm`, when there is one.
    ///
    /// ```no_run
    /// # let plugin: idem::plugins::LoadedPlugin = todo!();
    /// if let Some(file) = plugin.manifest_file() { println!("narrowed by {}", file.display()); }
    /// ```
    pub fn manifest_file(&self) -> Option<PathBuf> {
        self.manifest_text
            .as_ref()
            .map(|_| self.path.with_extension("toml"))
    }
}

/// What a (re)load of the folder did.
#[derive(Debug, Default)]
pub struct LoadReport {
    /// Plugins (re)loaded.
    pub loaded: Vec<String>,
    /// Plugins removed because their file disappeared.
    pub removed: Vec<String>,
    /// Files that could not be loaded, with the reason.
    pub errors: Vec<(PathBuf, String)>,
}

/// Errors reading a plugin from disk.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// Reading the file failed.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The component is invalid or breaks the contract.
    #[error(transparent)]
    Sandbox(#[from] crate::sandbox::SandboxError),
    /// The manifest is invalid.
    #[error(transparent)]
    Manifest(#[from] super::ManifestError),
    /// The declaration is malformed, or the manifest widens it.
    #[error(transparent)]
    Grants(#[from] super::GrantsError),
    /// The plugin's name (its file's name) breaks the name rule: no job of
    /// it could be enqueued, so it is refused where it is loaded.
    #[error("plugin {0}")]
    Name(#[from] crate::boundary::Refused),
}

/// The plugins of one folder, by name.
///
/// ```no_run
/// # use std::sync::Arc;
/// use idem::{plugins::PluginRegistry, sandbox::{Sandbox, SandboxConfig}};
/// let sandbox = Arc::new(Sandbox::new(SandboxConfig::default())?);
/// let registry = PluginRegistry::new(sandbox, "./plugins");
/// let report = registry.refresh();
/// for (path, why) in &report.errors { eprintln!("{}: {why}", path.display()); }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct PluginRegistry {
    sandbox: Arc<Sandbox>,
    dir: PathBuf,
    plugins: RwLock<HashMap<String, Arc<LoadedPlugin>>>,
}

impl PluginRegistry {
    /// A registry for `dir`; nothing is loaded until [`refresh`](Self::refresh).
    pub fn new(sandbox: Arc<Sandbox>, dir: impl Into<PathBuf>) -> Self {
        PluginRegistry {
            sandbox,
            dir: dir.into(),
            plugins: RwLock::new(HashMap::new()),
        }
    }

    /// The folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The sandbox plugins run in.
    pub fn sandbox(&self) -> &Arc<Sandbox> {
        &self.sandbox
    }

    /// The current version of a plugin.
    pub fn get(&self, name: &str) -> Option<Arc<LoadedPlugin>> {
        self.plugins
            .read()
            .expect("registry poisoned")
            .get(name)
            .cloned()
    }

    /// All loaded plugins, sorted by name.
    pub fn list(&self) -> Vec<Arc<LoadedPlugin>> {
        let mut all: Vec<_> = self
            .plugins
            .read()
            .expect("registry poisoned")
            .values()
            .cloned()
            .collect();
        all.sort_by(|a, b| a.name().cmp(b.name()));
        all
    }

    /// Rescans the folder: loads new plugins, reloads changed ones (by content
    /// hash of the `.wasm` and manifest text), drops removed ones. A plugin
    /// that fails to reload keeps its previous version.
    pub fn refresh(&self) -> LoadReport {
        let mut report = LoadReport::default();
        let files = match wasm_files(&self.dir) {
            Ok(files) => files,
            Err(error) => {
                report.errors.push((self.dir.clone(), error.to_string()));
                return report;
            }
        };
        let mut seen = Vec::with_capacity(files.len());
        for (name, path) in files {
            seen.push(name.clone());
            let current = self.get(&name);
            match self.load_if_changed(&name, &path, current.as_deref()) {
                Ok(Some(plugin)) => {
                    tracing::info!(plugin = %name, hash = %plugin.hash().short(), "plugin loaded");
                    self.plugins
                        .write()
                        .expect("registry poisoned")
                        .insert(name.clone(), Arc::new(plugin));
                    report.loaded.push(name);
                }
                Ok(None) => {}
                Err(error) => {
                    report.errors.push((path, error.to_string()));
                }
            }
        }
        let mut plugins = self.plugins.write().expect("registry poisoned");
        plugins.retain(|name, _| {
            let keep = seen.contains(name);
            if !keep {
                report.removed.push(name.clone());
            }
            keep
        });
        report
    }

    fn load_if_changed(
        &self,
        name: &str,
        path: &Path,
        current: Option<&LoadedPlugin>,
    ) -> Result<Option<LoadedPlugin>, LoadError> {
        let wasm = std::fs::read(path).map_err(|source| LoadError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let manifest_path = path.with_extension("toml");
        let manifest_text = match std::fs::read_to_string(&manifest_path) {
            Ok(text) => Some(text),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(source) => {
                return Err(LoadError::Io {
                    path: manifest_path,
                    source,
                });
            }
        };
        if let Some(current) = current
            && current.compiled.hash == ContentHash::of(&wasm)
            && current.manifest_text == manifest_text
        {
            return Ok(None);
        }
        load(&self.sandbox, name, path, &wasm, manifest_text).map(Some)
    }

    /// Watches the folder and refreshes on changes (debounced), until the
    /// returned watcher is dropped. Falls back to nothing on platforms where
    /// watching fails; callers may also call [`refresh`](Self::refresh) on a timer.
    pub fn watch(self: &Arc<Self>) -> notify::Result<notify::RecommendedWatcher> {
        use notify::{RecursiveMode, Watcher};
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let mut watcher =
            notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
                if event.is_ok() {
                    let _ = tx.send(());
                }
            })?;
        watcher.watch(&self.dir, RecursiveMode::NonRecursive)?;
        let registry = Arc::downgrade(self);
        std::thread::Builder::new()
            .name("idem-plugin-watch".into())
            .spawn(move || {
                while rx.recv().is_ok() {
                    // Let a writer finish its file before reading it.
                    std::thread::sleep(Duration::from_millis(100));
                    while rx.try_recv().is_ok() {}
                    match registry.upgrade() {
                        Some(registry) => {
                            for (path, error) in registry.refresh().errors {
                                tracing::warn!(path = %path.display(), %error, "plugin not loaded");
                            }
                        }
                        None => break,
                    }
                }
            })
            .map_err(|e| notify::Error::generic(&e.to_string()))?;
        Ok(watcher)
    }
}

/// Loads one plugin from its bytes and optional manifest text.
pub fn load(
    sandbox: &Sandbox,
    name: &str,
    path: &Path,
    wasm: &[u8],
    manifest_text: Option<String>,
) -> Result<LoadedPlugin, LoadError> {
    crate::boundary::name(name)?;
    let manifest = match &manifest_text {
        Some(text) => Manifest::parse(text)?,
        None => Manifest::default(),
    };
    let compiled = sandbox.load(name, wasm, manifest.limits())?;
    let declared = grants::read_declaration(wasm)?;
    if declared.is_none() {
        tracing::warn!(
            plugin = %name,
            "the plugin declares nothing (no {} section): its grants come from {name}.toml alone; build it with #[plugin(providers = [..])]",
            idem_sdk::declaration::SECTION
        );
    }
    let grants = Grants::resolve(name, declared, &manifest)?;
    Ok(LoadedPlugin {
        compiled,
        manifest,
        grants,
        path: path.to_path_buf(),
        manifest_text,
    })
}

/// Loads a single `.wasm` file (with its sidecar manifest, if any).
pub fn load_file(sandbox: &Sandbox, path: &Path) -> Result<LoadedPlugin, LoadError> {
    let name = path
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or("plugin")
        .to_string();
    let wasm = std::fs::read(path).map_err(|source| LoadError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let manifest_path = path.with_extension("toml");
    let manifest_text = std::fs::read_to_string(&manifest_path).ok();
    load(sandbox, &name, path, &wasm, manifest_text)
}

fn wasm_files(dir: &Path) -> std::io::Result<Vec<(String, PathBuf)>> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "wasm")
            && path.is_file()
            && let Some(name) = path.file_stem().and_then(|s| s.to_str())
        {
            files.push((name.to_string(), path.clone()));
        }
    }
    files.sort();
    Ok(files)
}
