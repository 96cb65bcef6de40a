//! Paths and process helpers shared by the xtask commands.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

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

/// Variables every command gets from now on ([`set_command_env`]).
static COMMAND_ENV: std::sync::OnceLock<Vec<(&'static str, std::ffi::OsString)>> = std::sync::OnceLock::new();

/// Sets, once, variables that every later [`cmd`] gets: the compiler
/// cache's `RUSTC_WRAPPER` (`compiler_cache::enable`), so that each cargo
/// xtask starts uses it. util stays below the modules that use it (no
/// import back, `tests/layers.rs`).
pub(crate) fn set_command_env(env: Vec<(&'static str, std::ffi::OsString)>) {
    let _ = COMMAND_ENV.set(env);
}

/// A command with the cargo bin directory on PATH and no stdin (CI has
/// none), with the variables of [`set_command_env`].
pub(crate) fn cmd(program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut c = Command::new(program);
    c.env("PATH", path_with_cargo_bin()).stdin(Stdio::null());
    if let Some(env) = COMMAND_ENV.get() {
        c.envs(env.iter().map(|(k, v)| (*k, v)));
    }
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

/// One line saying how much disk the target directory takes and how much
/// is left on its filesystem, before a step that needs room: a CI run ran
/// out of disk once, and its log did not say how close it had come.
pub(crate) fn print_disk(step: &str) {
    let dir = target_dir();
    let used = std::process::Command::new("du").args(["-sm"]).arg(&dir).output().ok().and_then(|o| first_number(&o.stdout));
    let free = std::process::Command::new("df")
        .args(["-BM", "--output=avail"])
        .arg(if dir.exists() { dir.as_path() } else { std::path::Path::new("/") })
        .output()
        .ok()
        .and_then(|o| first_number(&o.stdout));
    let mib = |v: Option<u64>| v.map_or_else(|| "?".to_string(), |n| format!("{n} MiB"));
    println!("disk before {step}: target {}, {} free", mib(used), mib(free));
}

/// The first run of digits in a command's output.
fn first_number(out: &[u8]) -> Option<u64> {
    let text = String::from_utf8_lossy(out);
    let start = text.find(|c: char| c.is_ascii_digit())?;
    let digits: String = text[start..].chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// Runs a command with inherited stdout/stderr and fails when it fails.
pub(crate) fn run(c: &mut Command) -> Result<()> {
    let status = c.status().with_context(|| format!("cannot run {}", describe(c)))?;
    if !status.success() {
        bail!("{} failed ({status})", describe(c));
    }
    Ok(())
}

/// Runs a command that fetches from the network (apt-get, mmdebstrap, pip,
/// rustup) and runs it again after a pause when it fails. A Debian mirror
/// caught in the middle of a sync, or a dropped connection, fails the whole
/// run even with apt's own per-file retries, and is gone minutes later
/// (seen in CI as mmdebstrap's `apt-get update --error-on=any` exiting 25
/// once, on a run whose other fetches all worked). `make` builds the
/// command afresh for each attempt.
pub(crate) fn run_fetching(make: impl FnMut() -> Command) -> Result<()> {
    const PAUSES: [Duration; 3] = [Duration::from_secs(15), Duration::from_mins(1), Duration::from_mins(3)];
    run_retrying(&PAUSES, make)
}

/// Runs `make()`'s command until it succeeds, sleeping `pauses[i]` after
/// the `i`-th failure; the last failure, once the pauses are used up.
fn run_retrying(pauses: &[Duration], mut make: impl FnMut() -> Command) -> Result<()> {
    let mut attempt = 0;
    loop {
        let Err(e) = run(&mut make()) else { return Ok(()) };
        let Some(&pause) = pauses.get(attempt) else {
            return Err(e).with_context(|| format!("gave up after {} attempts", attempt + 1));
        };
        println!("note: {e:#}; trying again in {} s", pause.as_secs());
        std::thread::sleep(pause);
        attempt += 1;
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A command that fails until it has run `fail_times` times, counting
    /// its runs in a file of its own.
    fn flaky(counter: &Path, fail_times: u32) -> Command {
        let mut c = cmd("sh");
        c.arg("-c")
            .arg(format!("n=$(cat \"$0\" 2>/dev/null || echo 0); n=$((n+1)); echo $n > \"$0\"; [ $n -gt {fail_times} ]"))
            .arg(counter);
        c
    }

    #[test]
    fn the_first_number_of_du_and_df_output_is_read() {
        // (output, number)
        let cases: [(&[u8], Option<u64>); 4] =
            [(b"10829\t/tmp/x/target\n", Some(10829)), (b" Avail\n81794M\n", Some(81794)), (b"", None), (b"Avail\n", None)];
        for (out, want) in cases {
            assert_eq!(first_number(out), want, "{}", String::from_utf8_lossy(out));
        }
    }

    #[test]
    fn a_fetch_that_fails_is_tried_again_until_it_works_or_the_pauses_run_out() {
        let dir = std::env::temp_dir().join(format!("xtask-retry-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let pauses = [Duration::ZERO; 3];
        // (failures before success, succeeds, runs seen)
        for (case, (failures, ok, runs)) in [(0, true, 1), (2, true, 3), (3, true, 4), (4, false, 4), (9, false, 4)].into_iter().enumerate()
        {
            let counter = dir.join(format!("case-{case}"));
            let result = run_retrying(&pauses, || flaky(&counter, failures));
            assert_eq!(result.is_ok(), ok, "case {case}: {result:?}");
            if let Err(e) = result {
                assert!(format!("{e:#}").contains("gave up after 4 attempts"), "case {case}: {e:#}");
            }
            let seen: u32 = std::fs::read_to_string(&counter).unwrap().trim().parse().unwrap();
            assert_eq!(seen, runs, "case {case}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
