//! Kernel memory of the pinned maps: the agent binary at default flags
//! (`--devices none`, no `--max-*`, so the maps size themselves) on the
//! demo manifests (3 Services) and on generated populations (10k and 100k
//! Services x 10 endpoints, each endpoint its own address), after its first
//! sync. Per map, the `memlock` the kernel reports in the map fd's
//! /proc/self/fdinfo (what `bpftool map show` prints: `map->ops->
//! map_mem_usage`, kernel/bpf/syscall.c:bpf_map_show_fdinfo), summed over
//! every pin under the agent's pin directory.

use std::fmt::Write as _;
use std::fs;
use std::os::fd::{AsFd, AsRawFd};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use aya::maps::MapData;
use proxy_test_support::sandbox::{Cgroup, Guarded, PinDir};
use serde_json::json;

use crate::report::{Section, Target};

const MIB: f64 = 1_048_576.0;
/// The goal for the demo manifests at default flags.
const GOAL_DEFAULTS_MIB: f64 = 96.0;

/// `memlock` of every map pinned directly under `pin_dir`, by pin name.
pub(crate) fn pinned_memlock(pin_dir: &Path) -> Result<Vec<(String, u64)>> {
    let mut out = Vec::new();
    for e in fs::read_dir(pin_dir)?.flatten() {
        let path = e.path();
        if !path.is_file() {
            continue;
        }
        let Ok(map) = MapData::from_pin(&path) else { continue };
        let fd = map.fd().as_fd().as_raw_fd();
        let info = fs::read_to_string(format!("/proc/self/fdinfo/{fd}"))?;
        let memlock: u64 = info
            .lines()
            .find_map(|l| l.strip_prefix("memlock:"))
            .and_then(|v| v.trim().parse().ok())
            .with_context(|| format!("no memlock in the fdinfo of {}", path.display()))?;
        out.push((e.file_name().to_string_lossy().into_owned(), memlock));
    }
    out.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    Ok(out)
}

/// One measured population.
struct Row {
    label: String,
    maps: Vec<(String, u64)>,
    /// Frontends the first sync could not program (a map full).
    failed: bool,
}

impl Row {
    fn total(&self) -> u64 {
        self.maps.iter().map(|(_, b)| b).sum()
    }
}

/// Starts the agent at default flags on `manifests`, waits for its first
/// sync, and measures the pinned maps.
fn measure(agent: &Path, manifests: &Path, label: String, log: &Path) -> Result<Row> {
    let cg = Cgroup::new("tpk")?;
    let pins = PinDir::new("tpk")?;
    let mut child = Guarded::spawn(
        Command::new(agent)
            .args(["run", "--node", "node-0", "--manifests"])
            .arg(manifests)
            .arg("--cgroup")
            .arg(cg.path())
            .arg("--bpffs")
            .arg(pins.path())
            // Host network namespace: no TC program on the host's interfaces.
            .args(["--devices", "none"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(fs::File::create(log)?),
    )?;
    let deadline = Instant::now() + Duration::from_mins(10);
    while !fs::read_to_string(log).unwrap_or_default().contains("first sync applied") {
        if Instant::now() > deadline || child.0.try_wait()?.is_some() {
            bail!("{label}: the agent never finished its first sync: {}", fs::read_to_string(log).unwrap_or_default());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let maps = pinned_memlock(pins.path())?;
    child.terminate(Duration::from_secs(10))?;
    let text = fs::read_to_string(log).unwrap_or_default();
    let failed = !text.lines().any(|l| l.contains(" synced ") && l.contains(" failed=0 "));
    Ok(Row { label, maps, failed })
}

/// The demo manifests, found from the crate's directory.
fn demo_manifests() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/demo")
}

pub(crate) fn run(sizes: &[usize], scratch: &Path, agent: Option<&Path>) -> Result<Section> {
    let agent = match agent {
        Some(a) => a.to_path_buf(),
        None => super::control_plane::agent_binary()?,
    };
    let log = scratch.join("km-agent.log");
    super::step("kernel memory: demo manifests at default flags");
    let mut rows = vec![measure(&agent, &demo_manifests(), "demo manifests (3 Services)".into(), &log)?];
    for &size in sizes {
        let dir = scratch.join(format!("km-{size}"));
        super::step(&format!("kernel memory: {size} Services x 10 at default flags"));
        super::manifest_input::write_population(&dir, size, super::manifest_input::Format::JsonLists)?;
        let row = measure(&agent, &dir, format!("{size} Services x 10"), &log);
        fs::remove_dir_all(&dir)?;
        rows.push(row?);
    }
    for r in &rows {
        println!("kernel memory of the pinned maps, {}: {:.1} MiB", r.label, r.total() as f64 / MIB);
    }

    let mut md = String::from("## Kernel memory of the pinned maps\n\n");
    md.push_str(
        "The agent binary at default flags (no `--max-*`: capacities sized from the first list within `--map-memory-budget`; `--devices none`), empty pins, after its first sync: `memlock` of every pinned map from its fd's fdinfo (as `bpftool map show`). The five largest maps of each run are listed.\n\n",
    );
    md.push_str("| population | total (MiB) | largest maps (MiB) |\n|---|---|---|\n");
    for r in &rows {
        let top: Vec<String> = r.maps.iter().take(5).map(|(n, b)| format!("{n} {:.1}", *b as f64 / MIB)).collect();
        let note = if r.failed { " (frontends failed: a map full)" } else { "" };
        let _ = writeln!(md, "| {}{note} | {:.1} | {} |", r.label, r.total() as f64 / MIB, top.join(", "));
    }
    md.push('\n');
    let demo = rows[0].total() as f64 / MIB;
    let mut targets = vec![Target {
        name: "kernel memory of the pinned maps, demo manifests (3 Services) at default flags".into(),
        goal: format!("<= {GOAL_DEFAULTS_MIB:.0} MiB"),
        measured: format!("{demo:.1} MiB"),
        met: Some(demo <= GOAL_DEFAULTS_MIB),
    }];
    if let Some(r) = rows.iter().skip(1).find(|r| r.label.starts_with("100000 ")) {
        targets.push(Target {
            name: "100k Services x 10 endpoints at default flags (maps size themselves)".into(),
            goal: "works".into(),
            measured: format!(
                "{}; maps {:.1} MiB",
                if r.failed { "frontends failed (a map full)" } else { "every frontend programmed" },
                r.total() as f64 / MIB
            ),
            met: Some(!r.failed),
        });
    }
    let json = json!(
        rows.iter()
            .map(|r| json!({
                "population": r.label,
                "total_bytes": r.total(),
                "first_sync_failed": r.failed,
                "maps": r.maps.iter().map(|(n, b)| json!({"name": n, "memlock_bytes": b})).collect::<Vec<_>>(),
            }))
            .collect::<Vec<_>>()
    );
    Ok(Section { key: "kernel_memory", markdown: md, json, svgs: Vec::new(), targets })
}
