//! Paths and process helpers shared by the xtask commands.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};

/// The workspace root (the parent of this crate).
pub(crate) fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask lives in the workspace").to_path_buf()
}

/// `$CARGO_HOME`, or `~/.cargo`.
pub(crate) fn cargo_home() -> PathBuf {
    if let Some(h) = std::env::var_os("CARGO_HOME").filter(|h| !h.is_empty()) {
        return PathBuf::from(h);
    }
    let home = std::env::var_os("HOME").filter(|h| !h.is_empty()).unwrap_or_else(|| "/root".into());
    PathBuf::from(home).join(".cargo")
}

/// `PATH` with `~/.cargo/bin` in front (when missing): rustup, cargo and
/// bpf-linker live there, and the nested nightly build needs bpf-linker.
pub(crate) fn path_with_cargo_bin() -> OsString {
    let bin = cargo_home().join("bin");
    let current = std::env::var_os("PATH").unwrap_or_default();
    let mut parts: Vec<PathBuf> = std::env::split_paths(&current).collect();
    if !parts.iter().any(|p| p == &bin) {
        parts.insert(0, bin);
    }
    std::env::join_paths(parts).unwrap_or(current)
}

/// A command with the cargo bin directory on PATH and no stdin (CI has none).
pub(crate) fn cmd(program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut c = Command::new(program);
    c.env("PATH", path_with_cargo_bin()).stdin(Stdio::null());
    c
}

/// The cargo that runs us (`$CARGO`), so nested builds use the same toolchain.
pub(crate) fn cargo() -> Command {
    let mut c = cmd(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    c.current_dir(workspace_root());
    c
}

/// The cargo target directory: `$CARGO_TARGET_DIR` (relative to the current
/// directory, as cargo reads it) or `<workspace>/target`.
pub(crate) fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR").filter(|d| !d.is_empty()) {
        Some(d) => {
            let p = PathBuf::from(d);
            if p.is_absolute() { p } else { std::env::current_dir().unwrap_or_default().join(p) }
        }
        None => workspace_root().join("target"),
    }
}

/// Runs a command with inherited stdout/stderr and fails when it fails.
pub(crate) fn run(c: &mut Command) -> Result<()> {
    let status = c.status().with_context(|| format!("cannot run {}", describe(c)))?;
    if !status.success() {
        bail!("{} failed ({status})", describe(c));
    }
    Ok(())
}

/// Runs a command and returns its stdout when it succeeds; `None` when it
/// cannot be started or fails.
pub(crate) fn output(c: &mut Command) -> Option<String> {
    let out = c.stderr(Stdio::null()).output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

pub(crate) fn describe(c: &Command) -> String {
    let mut s = c.get_program().to_string_lossy().into_owned();
    for a in c.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}

/// Whether we run as root (`id -u`).
pub(crate) fn is_root() -> bool {
    output(cmd("id").arg("-u")).is_some_and(|o| o.trim() == "0")
}
