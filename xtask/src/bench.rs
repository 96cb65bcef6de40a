//! `cargo xtask bench`: builds the agent and the benchmark driver
//! (`proxy-agent/examples/bench/`) with optimisations, then hands the process
//! over to the driver. The report goes to `results/bench/` unless `--out`
//! says otherwise.

use std::os::unix::process::CommandExt;

use anyhow::{Result, bail};

use crate::{setup, util};

pub(crate) fn run(args: &[String]) -> Result<()> {
    if !util::is_root() {
        bail!("the benchmark creates network namespaces and cgroups and loads eBPF programs, so it needs root");
    }
    setup::ensure()?;
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
