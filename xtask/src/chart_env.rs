//! The Python environment of the Helm chart tests (`charts/tests`): a venv
//! in `<target>/chart-venv` with the pinned packages of
//! `charts/tests/requirements.txt` (Helm's engine as a library, the
//! Kubernetes schemas, pytest, and matplotlib for the picture of the
//! chart's Grafana dashboard that `docs/scripts/render_dashboard.py` draws).
//!
//! A copy of the requirements file is kept inside the venv once pip has
//! succeeded; when it matches, nothing runs, so this step is a fast no-op
//! without network. Editing the requirements reinstalls.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use crate::{setup, util};

/// Where the venv lives; the chart test (proxy-agent/tests/chart.rs) looks
/// for it next to its own binary's target directory.
pub(crate) fn venv_dir() -> PathBuf {
    util::target_dir().join("chart-venv")
}

fn requirements() -> PathBuf {
    util::workspace_root().join("charts/tests/requirements.txt")
}

/// Records which requirements the venv was built from.
const STAMP: &str = "topoproxy-requirements.txt";

pub(crate) fn ensure() -> Result<()> {
    let venv = venv_dir();
    let req_path = requirements();
    let wanted = fs::read_to_string(&req_path).with_context(|| format!("reading {}", req_path.display()))?;
    let python = venv.join("bin/python");
    let stamp = venv.join(STAMP);
    if python.exists() && fs::read_to_string(&stamp).is_ok_and(|s| s == wanted) {
        println!("ok: chart test environment present ({})", venv.display());
        return Ok(());
    }
    println!("installing: chart test environment in {} (python3 -m venv; pip install -r {})", venv.display(), req_path.display());
    if !python.exists() {
        create_venv(&venv)?;
    }
    util::run_fetching(|| {
        let mut c = util::cmd(&python);
        c.args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "-r"]).arg(&req_path);
        c
    })?;
    fs::write(&stamp, &wanted).with_context(|| format!("writing {}", stamp.display()))?;
    Ok(())
}

/// `python3 -m venv`, with Debian's python3-venv installed when missing.
pub(crate) fn create_venv(venv: &Path) -> Result<()> {
    let _ = fs::remove_dir_all(venv); // a half-made venv from an interrupted run
    if util::run(util::cmd("python3").args(["-m", "venv"]).arg(venv)).is_ok() {
        return Ok(());
    }
    // Debian's own python3 ships venv support in a package of its own.
    let _ = fs::remove_dir_all(venv);
    if !util::is_root() || util::output(util::cmd("dpkg-query").arg("--version")).is_none() {
        bail!("`python3 -m venv` failed; install Python 3 with venv support (Debian: python3-venv)");
    }
    setup::ensure_debian_packages(&["python3-venv"], false)?;
    util::run(util::cmd("/usr/bin/python3").args(["-m", "venv"]).arg(venv))
}
