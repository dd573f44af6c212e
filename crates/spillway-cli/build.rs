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
/// Only lld and mold take the file; GNU ld and gold refuse the option and would fail the
/// link. Which linker `cc` runs depends on how rustc was built (rustup's rustc uses its own
/// lld on x86_64 Linux, a distribution's often does not) and on the build's settings, so
/// the option is tried on an empty program first, with the same compiler, target, linker
/// and flags, and passed only if that links. Names the file gives that the build does not
/// have (after a toolchain or dependency update) are skipped: the code then lies as it would
/// without the file, and `make bench` says how much of it is found.
fn link_order() {
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("link-order.txt");
    println!("cargo:rerun-if-changed={}", file.display());
    let var = |k: &str| std::env::var(k).unwrap_or_default();
    if var("PROFILE") != "release" || !file.is_file() {
        return;
    }
    let args = [
        "-Xlinker".to_string(),
        format!("--symbol-ordering-file={}", file.display()),
        "-Xlinker".to_string(),
        "--no-warn-symbol-ordering".to_string(),
    ];
    if linker_takes(&args) {
        for arg in args {
            println!("cargo:rustc-link-arg-bin=spillway={arg}");
        }
    } else {
        println!(
            "cargo:warning=the linker does not take --symbol-ordering-file: `spillway` is linked without link-order.txt (idle RSS is higher; see README, Code layout)"
        );
    }
}

/// Whether an empty program links with `args` passed to the linker, built the way cargo
/// builds this crate (`RUSTC`, `TARGET`, the configured linker, `CARGO_ENCODED_RUSTFLAGS`).
fn linker_takes(args: &[String]) -> bool {
    let Some(out) = std::env::var_os("OUT_DIR") else {
        return false;
    };
    let out = Path::new(&out);
    let src = out.join("link-probe.rs");
    if std::fs::write(&src, "fn main() {}\n").is_err() {
        return false;
    }
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let mut cmd = Command::new(rustc);
    cmd.arg("--target").arg(std::env::var_os("TARGET").unwrap_or_default());
    cmd.arg("-o").arg(out.join("link-probe")).arg(&src);
    if let Some(linker) = std::env::var_os("RUSTC_LINKER") {
        cmd.arg("-C").arg(format!("linker={}", linker.to_string_lossy()));
    }
    let flags = std::env::var("CARGO_ENCODED_RUSTFLAGS").unwrap_or_default();
    cmd.args(flags.split('\x1f').filter(|f| !f.is_empty()));
    for arg in args {
        cmd.arg("-C").arg(format!("link-arg={arg}"));
    }
    cmd.stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    cmd.status().is_ok_and(|s| s.success())
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
