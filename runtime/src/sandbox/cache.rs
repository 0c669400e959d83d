//! On-disk cache of precompiled components, keyed by content hash and the
//! engine's compatibility hash (wasmtime version + configuration), so a
//! restart does not recompile and an upgrade never loads a stale artifact.

use super::{ContentHash, Result, SandboxError};
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use wasmtime::Engine;
use wasmtime::component::Component;

/// The cache file for a plugin version under this engine.
pub fn path_for(engine: &Engine, dir: &Path, hash: &ContentHash) -> PathBuf {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    engine.precompile_compatibility_hash().hash(&mut hasher);
    dir.join(format!("{}-{:016x}.cwasm", hash.0, hasher.finish()))
}

/// Loads the precompiled component, or compiles it once and stores the
/// artifact. A broken or unwritable cache only costs a compile; it never
/// fails the load.
#[allow(unsafe_code)] // `Component::deserialize` of our own artifacts; see SAFETY below.
pub fn load_or_compile(
    engine: &Engine,
    dir: &Path,
    hash: &ContentHash,
    wasm: &[u8],
) -> Result<Component> {
    let path = path_for(engine, dir, hash);
    // Read, not mmap (`deserialize_file`): a file truncated under a mapping
    // would kill the process with SIGBUS.
    if let Ok(artifact) = std::fs::read(&path) {
        // SAFETY: the file was written by `Engine::precompile_component` of an
        // engine with the same compatibility hash, into a directory idem owns;
        // wasmtime checks its header and version before using it.
        match unsafe { Component::deserialize(engine, &artifact) } {
            Ok(component) => return Ok(component),
            Err(error) => {
                tracing::warn!(path = %path.display(), %error, "ignoring a broken cache entry")
            }
        }
    }
    let artifact = engine
        .precompile_component(wasm)
        .map_err(|e| SandboxError::NotAComponent(format!("{e:#}")))?;
    if let Err(error) = store(&path, &artifact) {
        tracing::warn!(path = %path.display(), %error, "cannot write the component cache");
    }
    // SAFETY: `artifact` was produced just now by this engine.
    unsafe { Component::deserialize(engine, &artifact) }
        .map_err(|e| SandboxError::NotAComponent(format!("{e:#}")))
}

fn store(path: &Path, artifact: &[u8]) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    // A name of this write's own: two threads of one process storing the
    // same artifact at once (tests share one cache across parallel
    // sandboxes) would otherwise write one file together, and the first
    // rename could publish the other's half-written bytes.
    static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = path.with_extension(format!("tmp{}-{n}", std::process::id()));
    std::fs::write(&tmp, artifact)?;
    std::fs::rename(&tmp, path)
}
