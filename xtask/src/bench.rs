//! `cargo xtask bench`: builds the agent and the benchmark driver
//! (`proxy-agent/examples/bench/`) with optimisations, then hands the process
//! over to the driver. The report goes to `results/bench/` unless `--out`
//! says otherwise. A full run (no `--only`) first runs the
//! connection-disruption suite and keeps its table beside the report.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use crate::{setup, util};

pub(crate) fn run(args: &[String]) -> Result<()> {
    if !util::is_root() {
        bail!("the benchmark creates network namespaces and cgroups and loads eBPF programs, so it needs root");
    }
    setup::ensure()?;
    if !args.iter().any(|a| a == "--only") {
        conn_disrupt(&out_dir(args))?;
    }
    println!("building proxy-agent and the benchmark driver (release)");
    util::run(util::cargo().args(["build", "--quiet", "--release", "-p", "proxy-agent", "--bin", "proxy-agent", "--example", "bench"]))?;
    let driver = util::target_dir().join("release/examples/bench");
    if !driver.is_file() {
        bail!("the build succeeded but {} is missing", driver.display());
    }
    let mut c = util::cmd(&driver);
    if !args.iter().any(|a| a == "--out") {
        c.arg("--out").arg(util::workspace_root().join("results/bench"));
    }
    c.args(args);
    let err = c.exec();
    bail!("cannot run {}: {err}", driver.display())
}

/// Where the driver writes its report: `--out DIR` (relative to the
/// current directory, as the driver reads it), else `results/bench`.
fn out_dir(args: &[String]) -> PathBuf {
    match args.iter().position(|a| a == "--out").and_then(|i| args.get(i + 1)) {
        Some(dir) => std::path::absolute(dir).unwrap_or_else(|_| PathBuf::from(dir)),
        None => util::workspace_root().join("results/bench"),
    }
}

/// The connection-disruption suite (`proxy-agent/tests/conn_disrupt.rs`, a
/// test: debug build, a few minutes) before the measurements, so that its
/// load does not overlap them. Its table (fault, attempts, failures) is
/// printed and kept as `conn-disrupt.md` beside the report; a failing
/// suite is reported and the benchmark still runs.
fn conn_disrupt(out: &Path) -> Result<()> {
    let table = out.join("conn-disrupt.md");
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let _ = std::fs::remove_file(&table);
    println!("running the connection-disruption suite (a few minutes)");
    let status = util::cargo()
        .args(["test", "--quiet", "-p", "proxy-agent", "--test", "conn_disrupt", "--", "connections_survive_every_fault"])
        .env("TOPOPROXY_CONN_DISRUPT_REPORT", &table)
        .status()
        .context("running the connection-disruption suite")?;
    match std::fs::read_to_string(&table) {
        Ok(text) => println!("{text}\n(kept in {})", table.display()),
        Err(_) => println!("the connection-disruption suite wrote no table"),
    }
    if !status.success() {
        eprintln!("xtask: the connection-disruption suite failed ({status}); see its output above");
    }
    Ok(())
}
