//! Builds the guest plugins in `plugins/` for wasm32-wasip2 and generates
//! constants with their paths (the way wasmtime's `test-programs` does), so
//! `cargo test` needs no manual step.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    let manifest_dir =
        PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let root = manifest_dir.parent().expect("workspace root").to_path_buf();
    let plugins_src = root.join("plugins");
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR"));
    // Relative to this package, not absolute: the build cache is shared by
    // checkouts at other paths (CI clones), and an absolute path would keep
    // pointing at the checkout that built it last.
    for watched in ["../plugins", "../sdk", "../wit", "build.rs"] {
        println!("cargo:rerun-if-changed={watched}");
    }

    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let guest_target = out_dir.join("guests");
    let mut build = Command::new(cargo);
    build
        .args([
            "build",
            "--release",
            "--target",
            "wasm32-wasip2",
            "--manifest-path",
        ])
        .arg(plugins_src.join("Cargo.toml"))
        .env("CARGO_TARGET_DIR", &guest_target);
    // The outer build's flags are for the host, not the guests.
    for var in [
        "RUSTFLAGS",
        "CARGO_ENCODED_RUSTFLAGS",
        "CARGO_BUILD_RUSTFLAGS",
        "CARGO_BUILD_TARGET",
        "CARGO_PROFILE_RELEASE_DEBUG",
        "RUSTC_WORKSPACE_WRAPPER",
    ] {
        build.env_remove(var);
    }
    let status = build
        .status()
        .expect("cannot run cargo to build the guest plugins");
    if !status.success() {
        panic!(
            "building the guest plugins failed. Is the target installed? Run `rustup target add wasm32-wasip2`."
        );
    }

    let built = guest_target.join("wasm32-wasip2").join("release");
    let plugins_out = out_dir.join("plugins");
    std::fs::create_dir_all(&plugins_out).expect("create plugins dir");
    let mut generated = String::new();
    generated.push_str(&format!(
        "/// Folder holding every built plugin (`<name>.wasm` + `<name>.toml`).\npub const PLUGINS_DIR: &str = {:?};\n",
        plugins_out.display().to_string()
    ));
    let mut names = Vec::new();
    for crate_dir in plugin_crates(&plugins_src) {
        let name = crate_dir
            .file_name()
            .and_then(|n| n.to_str())
            .expect("utf-8 name")
            .to_string();
        let wasm = built.join(format!("{name}.wasm"));
        let dest = plugins_out.join(format!("{name}.wasm"));
        std::fs::copy(&wasm, &dest).unwrap_or_else(|e| panic!("copy {}: {e}", wasm.display()));
        let manifest = crate_dir.join("plugin.toml");
        let dest_manifest = plugins_out.join(format!("{name}.toml"));
        if manifest.exists() {
            std::fs::copy(&manifest, &dest_manifest).expect("copy manifest");
        } else {
            let _ = std::fs::remove_file(&dest_manifest);
        }
        generated.push_str(&format!(
            "/// Path of the built `{name}` plugin.\npub const {}: &str = {:?};\n",
            name.to_uppercase(),
            dest.display().to_string()
        ));
        names.push(name);
    }
    generated.push_str(&format!(
        "/// Every plugin's name.\npub const ALL: &[&str] = &{names:?};\n"
    ));
    std::fs::write(out_dir.join("gen.rs"), generated).expect("write gen.rs");
}

fn plugin_crates(plugins: &Path) -> Vec<PathBuf> {
    let mut crates: Vec<PathBuf> = std::fs::read_dir(plugins)
        .expect("read plugins/")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("Cargo.toml").exists())
        .collect();
    crates.sort();
    crates
}
