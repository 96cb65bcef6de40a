//! The Helm chart's tests (charts/tests, Python: Helm's real template engine
//! and the Kubernetes schemas) run as part of `cargo test`, so that the one
//! test command covers the chart too. They live beside the agent because
//! they also check the chart's arguments against this agent binary.
//!
//! The Python environment is made by `cargo xtask setup`.

use std::path::{Path, PathBuf};
use std::process::Command;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("proxy-agent lives in the workspace").to_path_buf()
}

/// `<target>/chart-venv`, found from the agent binary's location so that a
/// custom CARGO_TARGET_DIR works the same as the default.
fn venv_python() -> Option<PathBuf> {
    Path::new(env!("CARGO_BIN_EXE_proxy-agent")).ancestors().map(|dir| dir.join("chart-venv/bin/python")).find(|p| p.exists())
}

/// The chart's default pin directory (`bpf.root`/`bpf.pinDir`) is the
/// agent's (`datapath::pins`), so that `proxy-agent dump` and `reset`
/// without `--bpffs` find what the chart's agent pinned.
#[test]
fn the_charts_pin_directory_is_the_agents_default() {
    let path = workspace().join("charts/topoproxy/values.yaml");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let values: serde_yaml::Value = serde_yaml::from_str(&text).expect("values.yaml parses");
    let field = |k: &str| values["bpf"][k].as_str().unwrap_or_else(|| panic!("bpf.{k} is not a string")).to_string();
    assert_eq!(format!("{}/{}", field("root").trim_end_matches('/'), field("pinDir")), proxy_agent::DEFAULT_BPFFS);
}

#[test]
fn helm_chart_renders_and_validates() {
    let Some(python) = venv_python() else {
        panic!("the chart test environment (<target>/chart-venv) is missing; run `cargo xtask setup`");
    };
    let root = workspace();
    let out = Command::new(&python)
        .args(["-m", "pytest", "charts/tests", "-q", "-rs", "-p", "no:cacheprovider"])
        .current_dir(&root)
        .env("PROXY_AGENT_BIN", env!("CARGO_BIN_EXE_proxy-agent"))
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", python.display()));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    // Shown with --nocapture, and on failure.
    println!("{stdout}{stderr}");
    assert!(out.status.success(), "chart tests failed ({}):\n{stdout}{stderr}", out.status);
    assert!(stdout.contains(" passed"), "pytest ran no test:\n{stdout}");
}
