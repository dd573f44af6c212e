//! The console is compiled into the binary from `ui/dist`. When that is missing (a fresh
//! clone built with plain `cargo build` or `cargo install --path crates/spillway-cli`),
//! build it first with npm if npm is there; otherwise the binary says it has no console.
//! `make` builds the console itself before any cargo step. SPILLWAY_SKIP_UI_BUILD=1
//! skips this.

use std::path::Path;
use std::process::Command;

fn main() {
    let ui = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../ui");
    let dist = ui.join("dist");
    println!("cargo:rerun-if-changed={}", dist.display());
    println!("cargo:rerun-if-changed={}", dist.join("index.html").display());
    println!("cargo:rerun-if-env-changed=SPILLWAY_SKIP_UI_BUILD");
    if dist.join("index.html").is_file() || std::env::var_os("SPILLWAY_SKIP_UI_BUILD").is_some() {
        return;
    }
    if !ui.join("package.json").is_file() {
        println!("cargo:warning=ui/ is missing: the binary will have no console");
        return;
    }
    let npm = |args: &[&str]| {
        Command::new("npm")
            .args(args)
            .current_dir(&ui)
            .status()
            .is_ok_and(|s| s.success())
    };
    let installed = ui.join("node_modules").is_dir() || npm(&["ci", "--no-audit", "--no-fund"]);
    if !(installed && npm(&["run", "build"])) {
        println!(
            "cargo:warning=could not build the console (needs Node.js and npm; run `make ui`): the binary will have no console"
        );
    }
}
