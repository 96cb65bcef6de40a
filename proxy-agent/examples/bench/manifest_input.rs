//! Manifest mode at scale: the agent binary's cold start from the files
//! `kubectl get services,endpointslices -A -o json` leaves (one `List` of
//! Services, one of EndpointSlices), and from the same objects as one
//! multi-document YAML stream; its peak RSS; and what it costs while no
//! file changes (CPU time and bytes read over an idle window).
//!
//! - cold start: from spawning `proxy-agent run --manifests DIR` on empty
//!   pins until the last Service's frontend is in the pinned SERVICES map
//!   (read from outside the agent), i.e. until the datapath would answer
//!   for every Service. The agent logs its first sync just before; the map
//!   is checked so that the figure means the same for any agent build.
//! - peak RSS: VmHWM at the end of the run (cold start plus idle window).
//! - idle: after the cold start, the agent's CPU time summed over its
//!   threads (`/proc/PID/task/*/schedstat`, nanoseconds) and the bytes it
//!   read (`rchar` in `/proc/PID/io`) over `--mi-idle-secs`, with no file
//!   touched meanwhile.
//!
//! The files follow kubectl's JSON: an unstructured `List` with its keys in
//! kubectl's (alphabetical) order, so `items` comes before `kind`, and each
//! EndpointSlice has `endpoints` before `kind`; one item per line. Every
//! endpoint has its own address, as pods do, so 100k x 10 needs 1M
//! backends: the agent runs at default flags, its maps sized from the first
//! list (no `--max-*`).
//!
//! `--mi-compare LABEL=PATH` measures another agent binary (an older build,
//! for before/after) interleaved with this one: every repeat runs each
//! binary once, in alternating order, on the same files.

use std::fmt::Write as _;
use std::fs;
use std::io::{BufWriter, Write};
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use aya::maps::{HashMap as BpfHashMap, Map, MapData};
use proxy_agent::datapath::keys::service_key;
use proxy_agent::model::{Frontend, Protocol};
use proxy_common::{ServiceKey, ServiceValue};
use proxy_test_support::sandbox::{Cgroup, Guarded, PinDir};
use serde_json::{Value, json};

use crate::report::{Section, Spread, Target, spread};

const ENDPOINTS: usize = 10;
const SVC_BASE: Ipv4Addr = Ipv4Addr::new(10, 100, 0, 0);
const EP_BASE: Ipv4Addr = Ipv4Addr::new(10, 200, 0, 0);
const NAMESPACE: &str = "bench";

/// `--mi-*` flags.
#[derive(Clone, Debug)]
pub(crate) struct Options {
    pub sizes: Vec<usize>,
    pub formats: Vec<Format>,
    pub idle: Duration,
    /// Repeats of the sizes above 10k (each is a large agent run).
    pub big_repeats: Option<usize>,
    /// Other agent binaries measured beside the one built with the bench.
    pub compare: Vec<(String, PathBuf)>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            sizes: vec![10_000, 100_000],
            formats: vec![Format::JsonLists, Format::YamlStream],
            idle: Duration::from_secs(10),
            big_repeats: Some(2),
            compare: Vec::new(),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Format {
    /// `kubectl get -o json` output: services.json and endpointslices.json.
    JsonLists,
    /// One multi-document YAML file, a document per object.
    YamlStream,
}

impl Format {
    fn label(self) -> &'static str {
        match self {
            Format::JsonLists => "kubectl -o json Lists",
            Format::YamlStream => "YAML stream",
        }
    }
    fn key(self) -> &'static str {
        match self {
            Format::JsonLists => "json_lists",
            Format::YamlStream => "yaml_stream",
        }
    }
}

pub(crate) const FLAGS_HELP: &str =
    "--mi-sizes 10000,100000 --mi-formats json,yaml --mi-idle-secs 10 --mi-big-repeats 2 --mi-compare LABEL=PATH";

/// Handles one `--mi-*` flag; `false` if it is not one.
pub(crate) fn flag(o: &mut Options, name: &str, value: &str) -> Result<bool> {
    match name {
        "--mi-sizes" => o.sizes = value.split(',').map(|s| s.trim().parse()).collect::<Result<_, _>>()?,
        "--mi-formats" => {
            o.formats = value
                .split(',')
                .map(|f| match f.trim() {
                    "json" => Ok(Format::JsonLists),
                    "yaml" => Ok(Format::YamlStream),
                    other => bail!("unknown manifest format {other} (json, yaml)"),
                })
                .collect::<Result<_>>()?;
        }
        "--mi-idle-secs" => o.idle = Duration::from_secs_f64(value.parse()?),
        "--mi-big-repeats" => o.big_repeats = Some(value.parse()?),
        "--mi-compare" => {
            let (label, path) = value.split_once('=').context("--mi-compare takes LABEL=PATH")?;
            o.compare.push((label.to_string(), PathBuf::from(path)));
        }
        _ => return Ok(false),
    }
    if o.sizes.is_empty() || o.formats.is_empty() {
        bail!("--mi-sizes and --mi-formats need at least one value");
    }
    Ok(true)
}

fn svc_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(SVC_BASE) + 1 + i as u32)
}

fn ep_ip(i: usize, j: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(EP_BASE) + 1 + (i * ENDPOINTS + j) as u32)
}

/// Service `i` as kubectl prints it, on one line (the fields a Service
/// without a selector carries; 3.4 MB for 10k, as in the issue's files).
fn service_json(i: usize) -> String {
    let ip = svc_ip(i);
    format!(
        r#"{{"apiVersion":"v1","kind":"Service","metadata":{{"name":"s{i}","namespace":"{NAMESPACE}","resourceVersion":"{rv}","uid":"00000000-0000-4000-8000-{i:012}"}},"spec":{{"clusterIP":"{ip}","clusterIPs":["{ip}"],"ports":[{{"name":"http","port":80,"protocol":"TCP","targetPort":8080}}],"type":"ClusterIP"}},"status":{{"loadBalancer":{{}}}}}}"#,
        rv = 1000 + i
    )
}

/// Service `i`'s EndpointSlice as kubectl prints it (unstructured, so its
/// keys sorted: `endpoints` before `kind`), on one line (14 MB for 10k).
fn slice_json(i: usize) -> String {
    let mut eps = String::with_capacity(ENDPOINTS * 120);
    for j in 0..ENDPOINTS {
        if j > 0 {
            eps.push(',');
        }
        let _ = write!(
            eps,
            r#"{{"addresses":["{}"],"conditions":{{"ready":true,"serving":true,"terminating":false}},"nodeName":"node-{}"}}"#,
            ep_ip(i, j),
            j % 3
        );
    }
    format!(
        r#"{{"addressType":"IPv4","apiVersion":"discovery.k8s.io/v1","endpoints":[{eps}],"kind":"EndpointSlice","metadata":{{"labels":{{"kubernetes.io/service-name":"s{i}"}},"name":"s{i}-abcde","namespace":"{NAMESPACE}"}},"ports":[{{"name":"http","port":8080,"protocol":"TCP"}}]}}"#
    )
}

/// Writes the population of `size` Services in `format` into `dir`;
/// returns the files' total size.
pub(crate) fn write_population(dir: &Path, size: usize, format: Format) -> Result<u64> {
    fs::create_dir_all(dir)?;
    let mut total = 0;
    let mut file = |name: &str, body: &mut dyn FnMut(&mut dyn Write) -> std::io::Result<()>| -> Result<()> {
        let path = dir.join(name);
        let mut w = BufWriter::with_capacity(1 << 20, fs::File::create(&path)?);
        body(&mut w)?;
        w.flush()?;
        total += fs::metadata(&path)?.len();
        Ok(())
    };
    match format {
        Format::JsonLists => {
            for (name, item) in [("services.json", service_json as fn(usize) -> String), ("endpointslices.json", slice_json)] {
                file(name, &mut |w| {
                    w.write_all(b"{\n    \"apiVersion\": \"v1\",\n    \"items\": [\n")?;
                    for i in 0..size {
                        w.write_all(item(i).as_bytes())?;
                        w.write_all(if i + 1 == size { b"\n" } else { b",\n" })?;
                    }
                    w.write_all(b"    ],\n    \"kind\": \"List\",\n    \"metadata\": {\n        \"resourceVersion\": \"\"\n    }\n}\n")
                })?;
            }
        }
        Format::YamlStream => {
            file("cluster.yaml", &mut |w| {
                for i in 0..size {
                    for doc in [service_json(i), slice_json(i)] {
                        // Block style, as `kubectl get -o yaml` writes objects.
                        let v: Value = serde_json::from_str(&doc).map_err(std::io::Error::other)?;
                        let yaml = serde_yaml::to_string(&v).map_err(std::io::Error::other)?;
                        w.write_all(b"---\n")?;
                        w.write_all(yaml.as_bytes())?;
                    }
                }
                Ok(())
            })?;
        }
    }
    Ok(total)
}

/// CPU time of every thread of `pid`, in nanoseconds.
fn cpu_ns(pid: u32) -> u64 {
    let Ok(rd) = fs::read_dir(format!("/proc/{pid}/task")) else { return 0 };
    rd.flatten()
        .filter_map(|t| fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

/// Bytes `pid` has read through read(2) and friends.
fn rchar(pid: u32) -> u64 {
    fs::read_to_string(format!("/proc/{pid}/io"))
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("rchar:").and_then(|v| v.trim().parse().ok())))
        .unwrap_or(0)
}

/// One run of one agent binary.
#[derive(Clone, Copy)]
struct Run {
    cold_s: f64,
    rss: u64,
    idle_cpu_percent: f64,
    idle_read_bytes: u64,
}

fn one_run(agent: &Path, dir: &Path, size: usize, idle: Duration, log: &Path) -> Result<Run> {
    let cg = Cgroup::new("tpm")?;
    let pins = PinDir::new("tpm")?;
    let t = Instant::now();
    let mut child = Guarded::spawn(
        Command::new(agent)
            .args(["run", "--node", "node-0", "--manifests"])
            .arg(dir)
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
    let last = Frontend { ip: IpAddr::V4(svc_ip(size - 1)), port: 80, protocol: Protocol::Tcp };
    let key = service_key(&last);
    let deadline = Instant::now() + Duration::from_mins(10);
    let mut services: Option<BpfHashMap<MapData, ServiceKey, ServiceValue>> = None;
    loop {
        if services.is_none() {
            // The map exists once the datapath is installed.
            services = MapData::from_pin(pins.path().join(proxy_common::SERVICES_MAP))
                .ok()
                .and_then(|m| BpfHashMap::try_from(Map::HashMap(m)).ok());
        }
        if services.as_ref().is_some_and(|m| m.get(&key, 0).is_ok()) {
            break;
        }
        if Instant::now() > deadline || child.0.try_wait()?.is_some() {
            bail!("the agent never programmed the last Service: {}", tail(log));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    let cold_s = t.elapsed().as_secs_f64();
    let pid = child.0.id();
    // Let the first sync finish its bookkeeping before the idle window.
    std::thread::sleep(Duration::from_millis(500));
    let (cpu0, read0, t0) = (cpu_ns(pid), rchar(pid), Instant::now());
    std::thread::sleep(idle);
    let (cpu1, read1, secs) = (cpu_ns(pid), rchar(pid), t0.elapsed().as_secs_f64());
    let rss = super::control_plane::vm_hwm(pid);
    if child.0.try_wait()?.is_some() {
        bail!("the agent exited during the idle window: {}", tail(log));
    }
    child.terminate(Duration::from_secs(10))?;
    Ok(Run { cold_s, rss, idle_cpu_percent: (cpu1 - cpu0) as f64 / 1e9 / secs * 100.0, idle_read_bytes: read1 - read0 })
}

fn tail(log: &Path) -> String {
    let text = fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

/// Every run of one (size, format, agent).
#[derive(Default)]
pub(crate) struct Cell {
    runs: Vec<Run>,
    bytes: u64,
}

impl Cell {
    fn spread(&self, f: fn(&Run) -> f64) -> Spread {
        spread(&self.runs.iter().map(f).collect::<Vec<_>>())
    }
}

/// Results by (size, format, agent label).
pub(crate) struct Results {
    opts: Options,
    repeats: usize,
    cells: Vec<((usize, Format, String), Cell)>,
}

pub(crate) fn run(o: &Options, repeats: usize, scratch: &Path, agent: Option<&Path>) -> Result<Results> {
    let own = match agent {
        Some(a) => a.to_path_buf(),
        None => super::control_plane::agent_binary()?,
    };
    let mut agents = vec![("this build".to_string(), own)];
    agents.extend(o.compare.iter().cloned());
    let mut r = Results { opts: o.clone(), repeats, cells: Vec::new() };
    for &size in &o.sizes {
        for &format in &o.formats {
            let dir = scratch.join(format!("mi-{size}-{}", format.key()));
            super::step(&format!("manifest input: writing {size} Services x {ENDPOINTS} as {}", format.label()));
            let bytes = write_population(&dir, size, format)?;
            let reps = if size > 10_000 { o.big_repeats.unwrap_or(repeats).min(repeats) } else { repeats }.max(1);
            for rep in 0..reps {
                // Alternate the order so that drift on the machine hits
                // every binary alike.
                let order: Vec<usize> = if rep % 2 == 0 { (0..agents.len()).collect() } else { (0..agents.len()).rev().collect() };
                for i in order {
                    let (label, path) = &agents[i];
                    super::step(&format!("manifest input: {size} x {ENDPOINTS}, {}, {label}, repeat {}/{reps}", format.label(), rep + 1));
                    let run = one_run(path, &dir, size, o.idle, &scratch.join("mi-agent.log"))?;
                    println!(
                        "{size} x {ENDPOINTS} {} [{label}]: cold start {:.3} s, peak RSS {:.1} MiB, idle CPU {:.3} % of a core, read while idle {} bytes",
                        format.label(),
                        run.cold_s,
                        run.rss as f64 / 1048576.0,
                        run.idle_cpu_percent,
                        run.idle_read_bytes
                    );
                    let key = (size, format, label.clone());
                    match r.cells.iter_mut().find(|(k, _)| *k == key) {
                        Some((_, c)) => c.runs.push(run),
                        None => r.cells.push((key, Cell { runs: vec![run], bytes })),
                    }
                }
            }
            fs::remove_dir_all(&dir)?;
        }
    }
    Ok(r)
}

fn fmt(s: Spread, digits: usize, scale: f64) -> String {
    if s.median.is_nan() {
        return "n/a".into();
    }
    format!("{:.d$} ({:.d$}–{:.d$})", s.median * scale, s.min * scale, s.max * scale, d = digits)
}

impl Results {
    fn cell(&self, size: usize, format: Format, label: &str) -> Option<&Cell> {
        self.cells.iter().find(|((s, f, l), _)| *s == size && *f == format && l == label).map(|(_, c)| c)
    }

    pub(crate) fn section(&self) -> Section {
        let mut md = String::from("## Manifest input (standalone mode)\n\n");
        let _ = writeln!(
            md,
            "The agent binary on `--manifests` (`--devices none`), empty pins: cold start = spawn until the last Service's frontend is in the pinned SERVICES map; peak RSS = VmHWM over the run; idle = CPU time of all its threads and bytes it read over {:.0} s with no file touched. `kubectl -o json Lists`: `services.json` and `endpointslices.json` as `kubectl get -o json` writes them (a `List`, `items` before `kind`); `YAML stream`: the same objects, one document each, in one file. Every endpoint its own address. {} repeats at 10k, {} above; medians with the spread (min–max).\n",
            self.opts.idle.as_secs_f64(),
            self.repeats,
            self.opts.big_repeats.unwrap_or(self.repeats).min(self.repeats)
        );
        let _ = writeln!(
            md,
            "| Services x 10 | input | files | agent | cold start (s) | peak RSS (MiB) | idle CPU (% of a core) | read while idle (bytes) |\n|---|---|---|---|---|---|---|---|"
        );
        for ((size, format, label), c) in &self.cells {
            let _ = writeln!(
                md,
                "| {size} | {} | {:.1} MB | {label} | {} | {} | {} | {} |",
                format.label(),
                c.bytes as f64 / 1e6,
                fmt(c.spread(|r| r.cold_s), 3, 1.0),
                fmt(c.spread(|r| r.rss as f64), 1, 1.0 / 1048576.0),
                fmt(c.spread(|r| r.idle_cpu_percent), 3, 1.0),
                fmt(c.spread(|r| r.idle_read_bytes as f64), 0, 1.0),
            );
        }
        md.push('\n');
        let mut targets = Vec::new();
        if let Some(c) = self.cell(10_000, Format::JsonLists, "this build") {
            let cold = c.spread(|r| r.cold_s).median;
            let rss = c.spread(|r| r.rss as f64).median;
            let idle = c.spread(|r| r.idle_cpu_percent).median;
            targets.push(Target {
                name: "cold start from `kubectl get -o json` Lists, 10k Services x 10 endpoints (spawn to the last Service programmed)"
                    .into(),
                goal: "<= 1 s".into(),
                measured: format!("{cold:.2} s"),
                met: cold.is_finite().then_some(cold <= 1.0),
            });
            targets.push(Target {
                name: "agent peak RSS, 10k x 10 from `kubectl get -o json` Lists".into(),
                goal: "<= 100 MiB".into(),
                measured: format!("{:.1} MiB", rss / 1048576.0),
                met: rss.is_finite().then_some(rss <= 100.0 * 1048576.0),
            });
            targets.push(Target {
                name: format!("idle CPU in manifest mode at 10k, no file changing ({:.0} s window)", self.opts.idle.as_secs_f64()),
                goal: "~0 (<= 0.1 % of a core)".into(),
                measured: format!("{idle:.3} %"),
                met: idle.is_finite().then_some(idle <= 0.1),
            });
        }
        if let Some(c) = self.cell(100_000, Format::JsonLists, "this build") {
            let cold = c.spread(|r| r.cold_s).median;
            let rss = c.spread(|r| r.rss as f64).median;
            // Issue #31's goals for 100k x 10.
            targets.push(Target {
                name: "programming 100k Services x 10 endpoints from `kubectl get -o json` Lists (cold start, spawn to the last Service programmed)".into(),
                goal: "<= 3 s".into(),
                measured: format!("{cold:.2} s"),
                met: cold.is_finite().then_some(cold <= 3.0),
            });
            targets.push(Target {
                name: "agent peak RSS, 100k x 10 from `kubectl get -o json` Lists".into(),
                goal: "<= 400 MiB".into(),
                measured: format!("{:.1} MiB", rss / 1048576.0),
                met: rss.is_finite().then_some(rss <= 400.0 * 1048576.0),
            });
        }
        let json = json!(
            self.cells
                .iter()
                .map(|((size, format, label), c)| json!({
                    "services": size, "endpoints_per_service": ENDPOINTS, "input": format.key(), "agent": label, "file_bytes": c.bytes,
                    "cold_start_seconds": c.spread(|r| r.cold_s).json(),
                    "peak_rss_bytes": c.spread(|r| r.rss as f64).json(),
                    "idle_cpu_percent_of_a_core": c.spread(|r| r.idle_cpu_percent).json(),
                    "idle_read_bytes": c.spread(|r| r.idle_read_bytes as f64).json(),
                    "runs": c.runs.iter().map(|r| json!({"cold_start_seconds": r.cold_s, "peak_rss_bytes": r.rss, "idle_cpu_percent": r.idle_cpu_percent, "idle_read_bytes": r.idle_read_bytes})).collect::<Vec<Value>>(),
                }))
                .collect::<Vec<_>>()
        );
        Section { key: "manifest_input", markdown: md, json, svgs: Vec::new(), targets }
    }
}
