//! The driver behind `cargo xtask demo`: a simulated cluster on this machine.
//!
//! Layout (all of it made here and removed at the end, also on failure,
//! panic or Ctrl-C):
//!
//! - one "cluster network" namespace with no link to the host: every pod
//!   address sits on its loopback, there is no default route, so a ClusterIP
//!   that is not translated ends in "network unreachable";
//! - per node from the manifests: a cgroup v2 directory (the node's pods run
//!   in it), a pin directory under /sys/fs/bpf and one `proxy-agent run
//!   --devices none` attached to that cgroup, reading the same manifests
//!   (the agents share the host's network namespace, whose interfaces must
//!   never get TC programs);
//! - one `proxy-agent serve-hostname` backend per pod named in the
//!   EndpointSlices, in its node's cgroup and the cluster namespace;
//! - a client pod per node (`proxy-agent probe`, in the node's cgroup and the
//!   cluster namespace) that requests every Service's ClusterIP.
//!
//! Everything comes from the manifests (`examples/demo/` by default): Nodes
//! give the nodes, Services the ClusterIPs, EndpointSlices the pods (by
//! `targetRef.name`), their addresses and nodes.
//!
//! Run it with `cargo xtask demo`; it needs root.

use std::collections::BTreeMap;
use std::fs;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use proxy_agent::datapath::{dump, maps};
use proxy_agent::model::{Frontend, Protocol};
use proxy_common::tier;
use proxy_test_support::sandbox::{Cgroup, Guarded, Netns, PinDir, command_in};
use proxy_test_support::scenario::{NodeSpec, PodSpec, ServiceSpec, Tally, print_table, read_scenario, tally};
use serde_json::Value;

/// ENETUNREACH: what a client sees before its node's agent programmed the
/// ClusterIP (the namespace has no route for it).
const ENETUNREACH: i64 = 101;
const STEPS: usize = 6;
/// The manifests this demo ships with (the closing remark is about them).
const BUNDLED_MANIFESTS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/demo");
/// Prefix of everything the demo creates; names continue `-PID-N`.
const PREFIX: &str = "tpdemo";

#[derive(Parser)]
#[command(name = "demo", about = "A simulated 3-node cluster with topology-aware Services (run via `cargo xtask demo`)")]
struct Args {
    /// The proxy-agent binary.
    #[arg(long)]
    agent: Option<PathBuf>,
    /// Manifest directory with Nodes, Services and EndpointSlices.
    #[arg(long)]
    manifests: Option<PathBuf>,
    /// Requests per Service from each node's client pod.
    #[arg(long, default_value_t = 20)]
    requests: u32,
    /// Keep the cluster running after the table until Ctrl-C, to look
    /// around (bpftool, proxy-agent probe, explain).
    #[arg(long)]
    hold: bool,
}

// ---------------------------------------------------------------------------
// Signals: Ctrl-C, SIGTERM and SIGHUP only raise a flag; the main flow checks
// it between steps and unwinds, so every Drop below runs.
// ---------------------------------------------------------------------------

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

fn install_signal_handlers() {
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: the handler only stores to an atomic (async-signal-safe);
        // the sigaction struct is fully initialised.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as *const () as libc::sighandler_t;
            sa.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&raw mut sa.sa_mask);
            libc::sigaction(sig, &raw const sa, std::ptr::null_mut());
        }
    }
}

fn check_interrupted() -> Result<()> {
    if INTERRUPTED.load(Ordering::SeqCst) {
        bail!("interrupted");
    }
    Ok(())
}

/// Children get SIGTERM when the demo dies, even by SIGKILL, so no agent,
/// pod or client outlives it. (Leftover namespaces, cgroups and pin directories of
/// a killed run are swept by the next run: their names carry our pid.)
fn die_with_parent(cmd: &mut Command) {
    // SAFETY: prctl is async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            Ok(())
        });
    }
}

// ---------------------------------------------------------------------------
// The running cluster. Fields drop in declaration order, which is the
// teardown order: agents stop, their programs and maps are removed, then
// the pods' cgroups (killing what runs in them) and the namespace go.
// ---------------------------------------------------------------------------

struct Agent {
    node: String,
    process: Guarded,
    log: PathBuf,
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.process.terminate(Duration::from_secs(3));
    }
}

struct NodeRuntime {
    spec: NodeSpec,
    cgroup: Cgroup,
}

struct Cluster {
    agents: Vec<Agent>,
    pins: Vec<PinDir>,
    pods: Vec<Guarded>,
    nodes: Vec<NodeRuntime>,
    netns: Netns,
    workdir: WorkDir,
}

/// A scratch directory for the agents' logs.
struct WorkDir(PathBuf);

impl Drop for WorkDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// Removes the scratch directories of earlier runs that were killed (the
/// sandbox sweeps their namespaces, cgroups and pin directories the same way).
fn sweep_workdirs() {
    let Ok(rd) = fs::read_dir(std::env::temp_dir()) else { return };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name.strip_prefix(PREFIX).and_then(|r| r.strip_prefix('-')).and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = fs::remove_dir_all(e.path());
        }
    }
}

/// `path` relative to the current directory when it lies below it.
fn relative(path: &Path) -> PathBuf {
    std::env::current_dir().ok().and_then(|cwd| path.strip_prefix(cwd).ok().map(Path::to_path_buf)).unwrap_or_else(|| path.to_path_buf())
}

impl Cluster {
    fn cgroup_of(&self, node: &str) -> Option<&Cgroup> {
        self.nodes.iter().find(|n| n.spec.name == node).map(|n| &n.cgroup)
    }

    /// What is left on the machine if the teardown failed.
    fn footprint(&self) -> Vec<PathBuf> {
        let mut v = vec![self.netns.path(), self.workdir.0.clone()];
        v.extend(self.pins.iter().map(|p| p.path().to_path_buf()));
        v.extend(self.nodes.iter().map(|n| n.cgroup.path().to_path_buf()));
        v
    }
}

fn step(n: usize, text: &str) {
    println!("[{n}/{STEPS}] {text}");
}

fn main() -> std::process::ExitCode {
    install_signal_handlers();
    let args = Args::parse();
    match run(&args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("demo failed: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<()> {
    let agent = match &args.agent {
        Some(p) => p.clone(),
        // target/debug/examples/demo -> target/debug/proxy-agent
        None => std::env::current_exe()?.parent().and_then(Path::parent).context("locating proxy-agent")?.join("proxy-agent"),
    };
    let manifests = args.manifests.clone().unwrap_or_else(|| PathBuf::from(BUNDLED_MANIFESTS));
    let manifests = manifests.canonicalize().with_context(|| format!("manifest directory {}", manifests.display()))?;
    anyhow::ensure!(agent.is_file(), "{} not found; build it with `cargo build -p proxy-agent`", agent.display());
    let scenario = read_scenario(&manifests).map_err(anyhow::Error::msg)?;

    let (cluster, started) = start(&agent, &manifests, scenario.nodes, &scenario.pods);
    let result = started.and_then(|()| exercise(&agent, &manifests, cluster.as_ref(), &scenario.services, &scenario.pods, args));
    if result.is_err() {
        for a in cluster.iter().flat_map(|c| &c.agents) {
            print_log_tail(a);
        }
    }
    step(6, "tearing down: agents stopped, pinned programs and maps reset, cgroups and namespace removed");
    let footprint = cluster.as_ref().map(Cluster::footprint).unwrap_or_default();
    drop(cluster);
    let left: Vec<String> = footprint.iter().filter(|p| p.exists()).map(|p| p.display().to_string()).collect();
    if left.is_empty() {
        println!("      nothing left behind");
    } else {
        eprintln!("warning: could not remove: {}", left.join(", "));
    }
    result
}

/// Builds the cluster. What was made is handed back even when a later part
/// fails, so that the caller's teardown removes all of it.
fn start(agent: &Path, manifests: &Path, nodes: Vec<NodeSpec>, pods: &[PodSpec]) -> (Option<Cluster>, Result<()>) {
    step(
        2,
        &format!(
            "creating {} nodes: a cluster network namespace (pod addresses on its loopback, no route out) and a cgroup per node",
            nodes.len()
        ),
    );
    let netns = match Netns::new(PREFIX).context("creating the network namespace") {
        Ok(n) => n,
        Err(e) => return (None, Err(e)),
    };
    sweep_workdirs();
    let workdir = WorkDir(std::env::temp_dir().join(format!("{PREFIX}-{}", std::process::id())));
    let mut cluster = Cluster { agents: Vec::new(), pins: Vec::new(), pods: Vec::new(), nodes: Vec::new(), netns, workdir };
    let result = populate(&mut cluster, agent, manifests, nodes, pods);
    (Some(cluster), result)
}

fn populate(cluster: &mut Cluster, agent: &Path, manifests: &Path, nodes: Vec<NodeSpec>, pods: &[PodSpec]) -> Result<()> {
    fs::create_dir_all(&cluster.workdir.0)?;
    let addrs: Vec<String> = pods.iter().map(|p| format!("{}/{}", p.ip, if p.ip.is_ipv4() { 32 } else { 128 })).collect();
    let addrs: Vec<&str> = addrs.iter().map(String::as_str).collect();
    cluster.netns.add_loopback_addrs(&addrs).context("adding pod addresses")?;
    for spec in nodes {
        let cgroup = Cgroup::new(&format!("{PREFIX}-{}", spec.name)).with_context(|| format!("creating the cgroup of {}", spec.name))?;
        cluster.nodes.push(NodeRuntime { spec, cgroup });
    }
    for n in &cluster.nodes {
        println!("      {:<8} zone {:<8} pool {:<10} cgroup {}", n.spec.name, n.spec.zone, n.spec.pool, n.cgroup.path().display());
    }
    check_interrupted()?;

    step(3, &format!("starting {} backend pods (serve_hostname: they answer with their own name)", pods.len()));
    for pod in pods {
        let cgroup = cluster.cgroup_of(&pod.node);
        let listen: Vec<String> = pod.ports.iter().map(|p| SocketAddr::new(pod.ip, *p).to_string()).collect();
        let backend = spawn_pod(agent, &cluster.netns, cgroup, &pod.name, &listen)?;
        cluster.pods.push(backend);
        println!("      {:<12} on {:<8} {}", pod.name, pod.node, listen.join(", "));
        check_interrupted()?;
    }

    step(4, &format!("starting one proxy-agent per node ({} agents)", cluster.nodes.len()));
    for i in 0..cluster.nodes.len() {
        let name = cluster.nodes[i].spec.name.clone();
        let pin = PinDir::new(&format!("{PREFIX}-{name}")).with_context(|| format!("creating the pin directory of {name}"))?;
        let log = cluster.workdir.0.join(format!("agent-{name}.log"));
        let mut cmd = command_in(agent, None, None)?;
        cmd.arg("run")
            .args(["--node", &name, "--manifests"])
            .arg(manifests)
            .arg("--cgroup")
            .arg(cluster.nodes[i].cgroup.path())
            .arg("--bpffs")
            .arg(pin.path())
            // Small maps: a demo needs a handful of entries.
            .args(["--max-services", "64", "--max-slots", "1024", "--max-backends", "256", "--max-sock-revnat", "1024"])
            // The agents run in the host's network namespace (the nodes are
            // cgroups): no TC program may go on the host's interfaces.
            .args(["--devices", "none"])
            .env("LOG_LEVEL", "info")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(fs::File::create(&log)?);
        die_with_parent(&mut cmd);
        println!(
            "      {name}: proxy-agent run --node {name} --manifests {} --cgroup {} --bpffs {} --devices none",
            relative(manifests).display(),
            cluster.nodes[i].cgroup.path().display(),
            pin.path().display()
        );
        cluster.pins.push(pin);
        let process = Guarded::spawn(&mut cmd).context("starting proxy-agent run")?;
        cluster.agents.push(Agent { node: name, process, log });
    }
    Ok(())
}

/// A backend pod: `proxy-agent serve-hostname` in its node's cgroup and the
/// cluster namespace; returns once it reports its sockets bound.
fn spawn_pod(agent: &Path, netns: &Netns, cgroup: Option<&Cgroup>, name: &str, listen: &[String]) -> Result<Guarded> {
    let mut cmd = command_in(agent, Some(netns), cgroup)?;
    cmd.arg("serve-hostname").args(["--name", name, "--listen"]).args(listen);
    cmd.env("LOG_LEVEL", "warn").stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::inherit());
    die_with_parent(&mut cmd);
    let mut g = Guarded::spawn(&mut cmd).with_context(|| format!("starting pod {name}"))?;
    let out = g.0.stdout.take().context("no stdout")?;
    let mut line = String::new();
    BufReader::new(out).read_line(&mut line)?;
    if line.trim() != "ready" {
        bail!("pod {name} did not start on {listen:?}");
    }
    Ok(g)
}

/// One `proxy-agent probe` run from a client pod on `node`.
fn probe(agent: &Path, cluster: &Cluster, node: &str, svc: &ServiceSpec, count: u32, timeout_ms: u64) -> Result<Vec<Value>> {
    let mut cmd = command_in(agent, Some(&cluster.netns), cluster.cgroup_of(node))?;
    cmd.arg("probe").arg("--to").arg(svc.frontend.to_string()).arg("--count").arg(count.to_string());
    cmd.arg("--timeout-ms").arg(timeout_ms.to_string()).arg("--message").arg(format!("GET / from {node}"));
    if svc.udp {
        cmd.arg("--udp");
    }
    cmd.env("LOG_LEVEL", "warn").stdin(Stdio::null());
    die_with_parent(&mut cmd);
    let out = cmd.output().context("running proxy-agent probe")?;
    let lines: Vec<Value> = String::from_utf8_lossy(&out.stdout).lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
    if lines.is_empty() {
        bail!("proxy-agent probe printed nothing ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(lines)
}

fn errno(v: &Value) -> Option<i64> {
    v.get("errno").and_then(Value::as_i64)
}

/// Waits until every node's agent has programmed every ClusterIP: a client
/// then no longer gets "network unreachable".
fn wait_programmed(agent: &Path, cluster: &Cluster, services: &[ServiceSpec]) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    for a in &cluster.agents {
        for svc in services {
            loop {
                check_interrupted()?;
                let first = probe(agent, cluster, &a.node, svc, 1, 500)?.remove(0);
                if errno(&first) != Some(ENETUNREACH) {
                    break;
                }
                if exited(a) {
                    bail!("the agent of {} exited", a.node);
                }
                if Instant::now() > deadline {
                    bail!("the agent of {} did not program {} within 30 s", a.node, svc.frontend);
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
    Ok(())
}

fn exercise(
    agent: &Path,
    manifests: &Path,
    cluster: Option<&Cluster>,
    services: &[ServiceSpec],
    pods: &[PodSpec],
    args: &Args,
) -> Result<()> {
    let cluster = cluster.context("no cluster")?;
    wait_for_agents(agent, cluster, services)?;

    step(5, &format!("requesting each ClusterIP {} times from a client pod on every node", args.requests));
    for s in services {
        println!("      {:<26} {:<16} {}", s.name, s.frontend, s.topology);
    }
    let counted_before = tier_counts(cluster, services);
    let mut results: Vec<(String, Vec<Tally>)> = Vec::new();
    for n in &cluster.nodes {
        let mut row = Vec::new();
        for svc in services {
            check_interrupted()?;
            row.push(tally(&probe(agent, cluster, &n.spec.name, svc, args.requests, 2000)?));
        }
        results.push((n.spec.label(), row));
    }
    check_interrupted()?;

    println!();
    print_table(services, &results);
    println!();
    print_tier_counts(cluster, services, &counted_before, &tier_counts(cluster, services));
    println!();
    let mut placement: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for p in pods {
        placement.entry(p.node.as_str()).or_default().push(&p.name);
    }
    let placement: Vec<String> = placement.iter().map(|(node, names)| format!("{} on {node}", names.join(" and "))).collect();
    println!("Pods: {}.", placement.join("; "));
    if Path::new(BUNDLED_MANIFESTS).canonicalize().is_ok_and(|b| b == manifests) {
        println!(
            "Notice: without topology every node reaches all pods; with the node-pool annotation each node only reaches \
             pods in its own pool; with the zone key node-2 (pool hangzhou, zone zone-b) is kept in zone-b instead."
        );
    }
    println!(
        "Why: `{} explain --node NODE --manifests {}` prints each node's decision.",
        relative(agent).display(),
        relative(manifests).display()
    );

    if args.hold {
        println!();
        println!("Holding the cluster; press Ctrl-C to tear it down. Try:");
        if let Some(pin) = cluster.pins.first() {
            println!("  bpftool map dump pinned {}/SERVICES", pin.path().display());
        }
        if let (Some(n), Some(s)) = (cluster.nodes.first(), services.first()) {
            println!(
                "  bash -c 'echo $$ > {}/cgroup.procs; exec nsenter --net={} {} probe --to {} --count 5'",
                n.cgroup.path().display(),
                cluster.netns.path().display(),
                agent.display(),
                s.frontend
            );
        }
        while !INTERRUPTED.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    Ok(())
}

/// Per node (in `cluster.nodes` order) and Service, the connections its
/// datapath counted by topology tier so far (`SVC_CONN`, read from the
/// node's pins as `explain --live` does); a node whose maps cannot be read
/// counts nothing.
fn tier_counts(cluster: &Cluster, services: &[ServiceSpec]) -> Vec<Vec<[u64; tier::COUNT]>> {
    cluster
        .pins
        .iter()
        .map(|pin| {
            let counts = dump::frontend_conn_counts(pin.path(), &maps::SERVICES, &maps::SVC_CONN).unwrap_or_default();
            services
                .iter()
                .map(|s| {
                    let protocol = if s.udp { Protocol::Udp } else { Protocol::Tcp };
                    let fe = Frontend { ip: s.frontend.ip(), port: s.frontend.port(), protocol };
                    counts.get(&fe).map_or([0; tier::COUNT], |v| v.tiers)
                })
                .collect()
        })
        .collect()
}

/// The tiers the requests above were counted in, node by node: what
/// `topoproxy_service_connections_total` exports.
fn print_tier_counts(cluster: &Cluster, services: &[ServiceSpec], before: &[Vec<[u64; tier::COUNT]>], after: &[Vec<[u64; tier::COUNT]>]) {
    println!("Counted by topology tier in each node's datapath (topoproxy_service_connections_total, explain --live):");
    let width = services.iter().map(|s| s.name.len()).max().unwrap_or(0).max(28);
    let mut line = format!("      {:<26}", "");
    for s in services {
        line.push_str(&format!(" {:<width$}", s.name));
    }
    println!("{}", line.trim_end());
    for (i, n) in cluster.nodes.iter().enumerate() {
        let mut line = format!("      {:<26}", n.spec.label());
        for j in 0..services.len() {
            let (b, a) = (before.get(i).and_then(|r| r.get(j)), after.get(i).and_then(|r| r.get(j)));
            let cell: Vec<String> = (0..tier::COUNT)
                .filter_map(|t| {
                    let d = a.map_or(0, |a| a[t]).saturating_sub(b.map_or(0, |b| b[t]));
                    (d > 0).then(|| format!("{} {d}", tier::NAMES[t]))
                })
                .collect();
            line.push_str(&format!(" {:<width$}", if cell.is_empty() { "-".to_string() } else { cell.join(", ") }));
        }
        println!("{}", line.trim_end());
    }
}

/// Waits for the agents, and notices one that exits early.
fn wait_for_agents(agent: &Path, cluster: &Cluster, services: &[ServiceSpec]) -> Result<()> {
    println!("      waiting until every agent has programmed every ClusterIP");
    wait_programmed(agent, cluster, services)?;
    if let Some(a) = cluster.agents.iter().find(|a| exited(a)) {
        bail!("the agent of {} exited", a.node);
    }
    Ok(())
}

/// Whether an agent has exited (a zombie not yet reaped, or gone). Reading
/// /proc keeps the Child untouched for the teardown.
fn exited(a: &Agent) -> bool {
    fs::read_to_string(format!("/proc/{}/stat", a.process.0.id()))
        .map_or(true, |s| s.rsplit_once(')').is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')))
}

fn print_log_tail(a: &Agent) {
    let Ok(text) = fs::read_to_string(&a.log) else { return };
    let lines: Vec<&str> = text.lines().collect();
    eprintln!("--- last lines of the agent log of {} ---", a.node);
    for l in &lines[lines.len().saturating_sub(15)..] {
        eprintln!("{l}");
    }
}
