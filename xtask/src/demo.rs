//! `cargo xtask demo`: builds the agent and the demo driver
//! (`proxy-agent/examples/demo.rs`, which uses `proxy_test_support::sandbox`),
//! then hands the process over to the driver so that Ctrl-C reaches it
//! directly and it can tear the simulated cluster down.

use std::os::unix::process::CommandExt;

use anyhow::{Result, bail};

use crate::{setup, util};

pub(crate) fn run(args: &[String]) -> Result<()> {
    let help = args.iter().any(|a| a == "-h" || a == "--help");
    if !help && !util::is_root() {
        bail!("the demo creates network namespaces and cgroups and loads eBPF programs, so it needs root");
    }
    setup::ensure()?;
    println!(
        "[1/6] building proxy-agent, its eBPF object and the demo driver (cargo build -p proxy-agent --bin proxy-agent --example demo)"
    );
    util::run(util::cargo().args(["build", "--quiet", "-p", "proxy-agent", "--bin", "proxy-agent", "--example", "demo"]))?;
    let debug = util::target_dir().join("debug");
    let agent = debug.join("proxy-agent");
    let driver = debug.join("examples/demo");
    let manifests = util::workspace_root().join("examples/demo");
    for p in [&agent, &driver] {
        if !p.is_file() {
            bail!("the build succeeded but {} is missing", p.display());
        }
    }
    let mut c = util::cmd(&driver);
    c.arg("--agent").arg(&agent).arg("--manifests").arg(&manifests).args(args);
    c.stdin(std::process::Stdio::inherit());
    // exec only returns on failure.
    let err = c.exec();
    bail!("cannot run {}: {err}", driver.display())
}
