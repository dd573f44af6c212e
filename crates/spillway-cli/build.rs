//! Two things before the `spillway` binary is built:
//!
//! - The console is compiled into the binary from `ui/dist`. When that is missing (a fresh
//!   clone built with plain `cargo build` or `cargo install --path crates/spillway-cli`),
//!   build it first with npm if npm is there; otherwise the binary says it has no console.
//!   `make` builds the console itself before any cargo step. SPILLWAY_SKIP_UI_BUILD=1
//!   skips this.
//! - A release build links its code in the order of `link-order.txt` (see [`link_order`]).

use std::path::Path;
use std::process::Command;

fn main() {
    link_order();
    console();
}

/// Release builds of `spillway` place the functions that start-up and a request run, in
/// that order, at the front of the code, in the order `link-order.txt` lists them (made by
/// `make link-order`, which records what a gateway runs under callgrind). The linker
/// otherwise scatters them over the 18 MB of code; the kernel maps a file's pages 64 KiB
/// around each one touched, so a gateway that had only started held 12 MiB of its code
/// resident, and 5 with this order.
///
/// Only with the linker rustc itself uses on x86_64 Linux (its own lld), which takes the
/// file; a build that chose another linker links as before. Names the file gives that the
/// build does not have (after a toolchain or dependency update) are skipped: the code then
/// lies as it would without the file, and `make bench` says how much of it is found.
fn link_order() {
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("link-order.txt");
    println!("cargo:rerun-if-changed={}", file.display());
    println!("cargo:rerun-if-env-changed=RUSTC_LINKER");
    let var = |k: &str| std::env::var(k).unwrap_or_default();
    let rustc_lld = var("CARGO_CFG_TARGET_ARCH") == "x86_64"
        && var("CARGO_CFG_TARGET_OS") == "linux"
        && var("CARGO_CFG_TARGET_ENV") == "gnu"
        && std::env::var_os("RUSTC_LINKER").is_none()
        && !var("CARGO_ENCODED_RUSTFLAGS").contains("link");
    if var("PROFILE") == "release" && rustc_lld && file.is_file() {
        println!(
            "cargo:rustc-link-arg-bin=spillway=-Wl,--symbol-ordering-file={}",
            file.display()
        );
        println!("cargo:rustc-link-arg-bin=spillway=-Wl,--no-warn-symbol-ordering");
    }
}

fn console() {
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
