//! Embeds the scenario library (`../scenarios/*.toml`) into the simulator, so that
//! `millrace-sim` finds every scenario wherever it runs: writes
//! `$OUT_DIR/scenarios.rs`, a sorted list of (name, path, text) with `include_str!`.

use std::fmt::Write as _;
use std::path::PathBuf;

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default());
    let dir = manifest.join("..").join("scenarios");
    println!("cargo:rerun-if-changed={}", dir.display());
    let mut files: Vec<(String, PathBuf)> = Vec::new();
    if let Ok(entries) = std::fs::read_dir(&dir) {
        for e in entries.flatten() {
            let path = e.path();
            if path.extension().is_some_and(|x| x == "toml") {
                if let Some(stem) = path.file_stem().and_then(|s| s.to_str()) {
                    println!("cargo:rerun-if-changed={}", path.display());
                    files.push((stem.to_string(), path));
                }
            }
        }
    }
    files.sort();
    let mut out = String::from(
        "/// The scenario files embedded at build time: (name, path shown in errors, text).\n\
         pub const EMBEDDED: &[(&str, &str, &str)] = &[\n",
    );
    for (name, path) in &files {
        let _ = writeln!(
            out,
            "    ({name:?}, \"scenarios/{name}.toml\", include_str!({:?})),",
            path.display().to_string()
        );
    }
    out.push_str("];\n");
    let target =
        PathBuf::from(std::env::var_os("OUT_DIR").unwrap_or_default()).join("scenarios.rs");
    if let Err(e) = std::fs::write(&target, out) {
        panic!("cannot write {}: {e}", target.display());
    }
}
