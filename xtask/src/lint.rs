//! `cargo xtask lint`: the checks `cargo xtask test` runs before any test.
//!
//! - `cargo fmt --all --check`: the host workspace's layout (rustfmt.toml);
//! - `cargo +nightly fmt --check` in `proxy-ebpf/`: the eBPF crate is a
//!   workspace of its own, built with nightly, so nightly's rustfmt checks
//!   it (the same rustfmt.toml applies, found in the parent directory);
//! - `cargo clippy --workspace --all-targets -- -D warnings`: the lints of
//!   `[workspace.lints]` in the root Cargo.toml, every warning an error;
//! - nightly clippy on `proxy-ebpf/` for `bpfel-unknown-none` (a check
//!   build: no bpf-linker needed), with that crate's own `[lints]`, which
//!   deny an `unsafe` block without a SAFETY comment.
//!
//! Every check runs even when an earlier one fails, so that one run names
//! every failing check. `setup` installs rustfmt and clippy for the
//! toolchain that runs xtask and for nightly.

use std::process::Command;

use anyhow::{Result, bail};

use crate::{setup, util};

/// One check: what it looks at, the command as a developer would type it,
/// and how to fix what it finds.
struct Check {
    what: &'static str,
    /// Whether it compiles (clippy builds every crate's metadata), for
    /// the step table's compile column.
    compiles: bool,
    shown: &'static str,
    fix: &'static str,
    command: Command,
}

fn checks() -> Vec<Check> {
    let root = util::workspace_root();
    let mut fmt = util::cargo();
    fmt.args(["fmt", "--all", "--check"]);
    // The rustup proxy (first on PATH), since `+nightly` means nothing to
    // the toolchain's own cargo that `util::cargo` runs.
    // The pinned nightly (proxy-ebpf/rust-toolchain.toml).
    let toolchain = format!("+{}", crate::setup::nightly_channel().unwrap_or_else(|_| "nightly".to_string()));
    let mut ebpf_fmt = util::cmd("cargo");
    ebpf_fmt.args([toolchain.as_str(), "fmt", "--check"]).current_dir(root.join("proxy-ebpf"));
    let mut clippy = util::cargo();
    clippy.args(["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"]);
    let mut ebpf_clippy = util::cmd("cargo");
    ebpf_clippy
        .args([toolchain.as_str(), "clippy", "--target", "bpfel-unknown-none", "-Z", "build-std=core", "--", "-D", "warnings"])
        .current_dir(root.join("proxy-ebpf"));
    // The toolchain that runs xtask must not leak into the nightly build.
    for key in ["RUSTC", "RUSTC_WORKSPACE_WRAPPER", "RUSTC_WRAPPER", "RUSTUP_TOOLCHAIN", "CARGO_TARGET_DIR", "RUSTFLAGS"] {
        ebpf_clippy.env_remove(key);
    }
    vec![
        Check {
            what: "formatting of the host workspace",
            compiles: false,
            shown: "cargo fmt --all --check",
            fix: "`cargo fmt --all` rewrites the files",
            command: fmt,
        },
        Check {
            what: "formatting of proxy-ebpf (nightly rustfmt)",
            compiles: false,
            shown: "cd proxy-ebpf && cargo +nightly fmt --check",
            fix: "`cd proxy-ebpf && cargo +nightly fmt` rewrites the files",
            command: ebpf_fmt,
        },
        Check {
            what: "clippy on the host workspace",
            compiles: true,
            shown: "cargo clippy --workspace --all-targets -- -D warnings",
            fix: "fix the warnings clippy printed above",
            command: clippy,
        },
        Check {
            what: "clippy on proxy-ebpf (nightly, bpfel-unknown-none)",
            compiles: true,
            shown: "cd proxy-ebpf && cargo +nightly clippy --target bpfel-unknown-none -Z build-std=core -- -D warnings",
            fix: "fix the warnings clippy printed above",
            command: ebpf_clippy,
        },
    ]
}

/// `cargo xtask lint`.
pub(crate) fn run() -> Result<()> {
    setup::ensure()?;
    check().map(drop)
}

/// Runs every check; fails naming each one that failed. Returns the time
/// the compiling checks (clippy) took.
pub(crate) fn check() -> Result<std::time::Duration> {
    let mut failed = Vec::new();
    let mut compiled = std::time::Duration::ZERO;
    for mut c in checks() {
        println!("lint: checking {}: {}", c.what, c.shown);
        let started = std::time::Instant::now();
        let status = c.command.status();
        if c.compiles {
            compiled += started.elapsed();
        }
        let why = match status {
            Ok(status) if status.success() => None,
            Ok(status) => Some(status.to_string()),
            Err(e) => Some(format!("cannot run it: {e}")),
        };
        match why {
            None => println!("lint: ok: {}", c.what),
            Some(why) => {
                println!("lint: FAILED: {} (`{}`: {why}); {}", c.what, c.shown, c.fix);
                failed.push(c);
            }
        }
    }
    if failed.is_empty() {
        println!("lint: all checks passed");
        return Ok(compiled);
    }
    let list: Vec<String> = failed.iter().map(|c| format!("{} (`{}`)", c.what, c.shown)).collect();
    bail!("lint failed: {}", list.join("; "))
}
