//! `cargo xtask build-ebpf`: the agent's build script builds the eBPF crate
//! (nightly, `-Z build-std=core`, bpf-linker) and embeds the object, so
//! building the agent is building the object.

use std::path::PathBuf;

use anyhow::{Result, bail};

use crate::{setup, util};

/// Where proxy-agent's build.rs leaves the object.
pub(crate) fn object_path() -> PathBuf {
    util::target_dir().join("ebpf/bpfel-unknown-none/release/proxy-ebpf")
}

pub(crate) fn run() -> Result<()> {
    setup::ensure()?;
    util::run(util::cargo().args(["build", "-p", "proxy-agent"]))?;
    let obj = object_path();
    if !obj.is_file() {
        bail!("the build succeeded but {} is missing", obj.display());
    }
    println!("{}", obj.display());
    Ok(())
}
