//! What one agent costs the API server as the cluster grows (issue #31):
//! the bytes of its Node watch while every kubelet reports status.
//!
//! The stand-in API server (`proxy_test_support::apiserver`, real list and
//! watch over HTTP, uncompressed JSON as kube-rs asks for it) holds N
//! realistic Nodes (`realistic_nodes`: labels, annotations, kubelet
//! managedFields, conditions, 30 images; about 10 KB each). A thread plays
//! the kubelets: R status reports per second in total, round robin over the
//! Nodes, each an update that changes the heartbeats (a new
//! resourceVersion). The stand-in counts the bytes of every list and watch
//! body per collection; the bench reads the Node counts.
//!
//! Each variant is a row, one client per stand-in:
//! - `no-label-keys`: the agent binary (`proxy-agent run --kubeconfig ...
//!   --node node-1`, its own cgroup and pin directory, `--devices none`)
//!   with one Service whose EndpointSlice has six endpoints, ranked by
//!   nothing that needs other Nodes' labels;
//! - `region-keyed`: the same with that Service ranked by region
//!   (`topoproxy.io/topology-keys: "topology.kubernetes.io/region, *"`;
//!   v1 slices carry no region, so other Nodes' labels are needed);
//! - `kube-proxy`: a kube-proxy-shaped client, this program started again
//!   as `--cps-kube-proxy-client KUBECONFIG NODE`: a kube-rs list and watch
//!   of `Api<Node>` with `fieldSelector=metadata.name=node-1`, every event
//!   decoded into a typed `Node` (as kube-proxy's informer does), one
//!   thread.
//!
//! Measured per run: first-sync bytes (list bodies until the agent logs its
//! first sync, or the client its first list); after a warm-up, over the
//! window: Node watch bytes per second, the client's CPU % (utime + stime
//! of `/proc/PID/stat`) and its RSS (VmRSS at the end of the window and
//! VmHWM); for the run's health, the reports achieved, the bench process's
//! own CPU (the stand-in and the reporter) and Node list bytes during the
//! window (a relist, if the watch was closed).
//!
//! The stand-in sends bookmarks every 60 s here (the API server's watch
//! cache sends them about once a minute), so that the kube-proxy row is
//! not made of bookmarks. Variants are interleaved, their order reversed
//! every other repeat; medians with min–max over repeats.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::fs;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use proxy_test_support::apiserver::ApiServer;
use proxy_test_support::sandbox::{Cgroup, Guarded, PinDir};
use serde_json::{Value, json};

use crate::real_server::RealServer;
use crate::realistic_nodes;
use crate::report::{Spread, Target, spread};

/// The node the agent (and the kube-proxy-shaped client) runs on.
const NODE_INDEX: usize = 1;
const NAMESPACE: &str = "bench";
/// In the real API server's `--service-cluster-ip-range` (10.96.0.0/16).
const SVC_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 100, 1);
const EP_BASE: Ipv4Addr = Ipv4Addr::new(10, 200, 0, 0);
/// Endpoints of the Service, on nodes 1.. (spanning the regions).
const ENDPOINTS: usize = 6;
/// Endpoints of the `region-keyed-wide` variant's Service, each on a Node
/// of its own: more Nodes than the agent names in a label selector
/// (`decide::topology::MAX_NAMED_NODES`, 100), so it watches every Node.
const WIDE_ENDPOINTS: usize = 150;
const REGION_KEYS: &str = "topology.kubernetes.io/region, *";
/// The subcommand that runs the kube-proxy-shaped client.
pub(crate) const CLIENT_FLAG: &str = "--cps-kube-proxy-client";
const KB: f64 = 1000.0;
const MIB: f64 = 1_048_576.0;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Variant {
    NoLabelKeys,
    RegionKeyed,
    RegionKeyedWide,
    KubeProxy,
}

impl Variant {
    const ALL: [Variant; 4] = [Variant::NoLabelKeys, Variant::RegionKeyed, Variant::RegionKeyedWide, Variant::KubeProxy];

    fn key(self) -> &'static str {
        match self {
            Variant::NoLabelKeys => "no-label-keys",
            Variant::RegionKeyed => "region-keyed",
            Variant::RegionKeyedWide => "region-keyed-wide",
            Variant::KubeProxy => "kube-proxy",
        }
    }

    fn parse(s: &str) -> Result<Variant> {
        Variant::ALL
            .into_iter()
            .find(|v| v.key() == s)
            .with_context(|| format!("unknown variant {s:?} (no-label-keys, region-keyed, region-keyed-wide, kube-proxy)"))
    }

    fn label(self) -> &'static str {
        match self {
            Variant::NoLabelKeys => "agent, no label-keyed Service",
            Variant::RegionKeyed => "agent, one region-keyed Service (6 endpoints on 6 Nodes)",
            Variant::RegionKeyedWide => "agent, one region-keyed Service with endpoints on 150 Nodes (every Node watched)",
            Variant::KubeProxy => "kube-proxy-shaped client (own Node only, `metadata.name` field selector)",
        }
    }

    fn keyed(self) -> bool {
        matches!(self, Variant::RegionKeyed | Variant::RegionKeyedWide)
    }

    fn endpoints(self) -> usize {
        if self == Variant::RegionKeyedWide { WIDE_ENDPOINTS } else { ENDPOINTS }
    }
}

/// Which API server the rows are measured against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ServerKind {
    /// The real kube-apiserver (`real_server`), the default.
    Real,
    /// The stand-in (`test-support/src/apiserver.rs`), which counts bytes
    /// per collection.
    StandIn,
}

/// `--cps-*` flags.
#[derive(Clone, Debug)]
pub(crate) struct Options {
    pub nodes: usize,
    /// Status reports per second, all Nodes together.
    pub rate: f64,
    /// The measured window.
    pub secs: u64,
    /// From the first sync to the window, reports already flowing.
    pub warmup_secs: u64,
    /// Another agent binary (before/after); default: the one built with
    /// the bench.
    pub agent: Option<PathBuf>,
    pub agent_flags: Vec<String>,
    pub variants: Vec<Variant>,
    pub server: ServerKind,
    /// The churn rows (`control_plane_churn`), in the same real cluster.
    pub churn: crate::control_plane_churn::Options,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            nodes: 5_000,
            rate: 20.0,
            secs: 60,
            warmup_secs: 5,
            agent: None,
            agent_flags: vec!["--devices".into(), "none".into()],
            variants: Variant::ALL.to_vec(),
            server: ServerKind::Real,
            churn: crate::control_plane_churn::Options::default(),
        }
    }
}

/// Handles one `--cps-*` flag; `false` if it is not one.
pub(crate) fn flag(o: &mut Options, name: &str, value: &str) -> Result<bool> {
    match name {
        "--cps-nodes" => o.nodes = value.parse()?,
        "--cps-rate" => o.rate = value.parse()?,
        "--cps-secs" => o.secs = value.parse()?,
        "--cps-warmup-secs" => o.warmup_secs = value.parse()?,
        "--cps-agent" => o.agent = Some(PathBuf::from(value)),
        "--cps-agent-flags" => o.agent_flags = value.split_whitespace().map(String::from).collect(),
        "--cps-variants" => {
            o.variants = value.split(',').map(str::trim).filter(|s| !s.is_empty()).map(Variant::parse).collect::<Result<_>>()?;
        }
        "--cps-server" => {
            o.server = match value {
                "real" => ServerKind::Real,
                "stand-in" => ServerKind::StandIn,
                _ => bail!("--cps-server is real or stand-in"),
            }
        }
        other => return crate::control_plane_churn::flag(&mut o.churn, other, value),
    }
    if o.variants.contains(&Variant::RegionKeyedWide) && o.nodes < NODE_INDEX + WIDE_ENDPOINTS {
        bail!("the region-keyed-wide variant needs --cps-nodes of at least {}", NODE_INDEX + WIDE_ENDPOINTS);
    }
    if o.nodes < ENDPOINTS || o.rate <= 0.0 || o.secs == 0 || o.variants.is_empty() {
        bail!("--cps-nodes must be at least {ENDPOINTS}, --cps-rate above 0, --cps-secs at least 1, and --cps-variants name one");
    }
    Ok(true)
}

pub(crate) const FLAGS_HELP: &str = "--cps-server real|stand-in --cps-nodes 5000 --cps-rate 20 --cps-secs 60 --cps-warmup-secs 5 --cps-agent PATH --cps-agent-flags '--devices none' --cps-variants no-label-keys,region-keyed,region-keyed-wide,kube-proxy --cps-churn-services 10000 --cps-churn-endpoints 10 --cps-churn-rate 100 --cps-churn-secs 60 (--cps-churn-services 0: no churn rows)";

/// One run of one variant.
#[derive(Clone, Debug, Default)]
struct Sample {
    /// Spawn to the agent's first sync (the client's first list).
    sync_s: f64,
    /// Node list bytes, and every collection's list bytes, until then.
    first_nodes: u64,
    first_all: u64,
    /// Node watch bytes over the window, and per second.
    watch_bytes: u64,
    watch_bps: f64,
    /// Status reports handed to the stand-in during the window.
    reports: u64,
    cpu_pct: f64,
    rss: u64,
    hwm: u64,
    /// The bench process (the stand-in and the reporter) over the window.
    server_cpu_pct: f64,
    /// Node list bytes during the window (a relist), and from spawn to the
    /// window's end (lists made after the first sync included, e.g. of a
    /// watch that starts once a Service needs it).
    window_list_bytes: u64,
    run_list_bytes: u64,
}

/// Everything measured.
#[derive(Default)]
pub(crate) struct Results {
    opts: Option<Options>,
    agent: String,
    samples: BTreeMap<Variant, Vec<Sample>>,
    /// Node JSON as stored (min, median, max), and one Node's watch event,
    /// whole and metadata-only.
    node_json: (usize, usize, usize),
    event_full: usize,
    event_meta: usize,
    repeats: usize,
    /// Creating the Nodes in the real API server (with one status report
    /// each), seconds.
    setup_s: f64,
    server_version: String,
    /// The churn rows, measured in the same real cluster.
    pub(crate) churn: Option<crate::control_plane_churn::Results>,
}

fn service(v: Variant) -> Value {
    let mut meta = json!({"name": "web", "namespace": NAMESPACE});
    if v.keyed() {
        meta["annotations"] = json!({"topoproxy.io/topology-keys": REGION_KEYS});
    }
    json!({"apiVersion": "v1", "kind": "Service", "metadata": meta,
           "spec": {"clusterIP": SVC_IP.to_string(), "clusterIPs": [SVC_IP.to_string()],
                    "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}]}})
}

fn slice(v: Variant) -> Value {
    let eps: Vec<Value> = (0..v.endpoints())
        .map(|j| {
            let n = NODE_INDEX + j;
            json!({"addresses": [Ipv4Addr::from(u32::from(EP_BASE) + 1 + j as u32).to_string()],
                   "conditions": {"ready": true, "serving": true, "terminating": false},
                   "nodeName": realistic_nodes::name(n), "zone": realistic_nodes::zone(n),
                   "targetRef": {"kind": "Pod", "namespace": NAMESPACE, "name": format!("web-{j}")}})
        })
        .collect();
    // Not the EndpointSlice controller's: the Service has no selector, and
    // the real controller leaves slices it does not manage alone.
    json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
           "metadata": {"name": "web-abcde", "namespace": NAMESPACE,
                        "labels": {"kubernetes.io/service-name": "web", "endpointslice.kubernetes.io/managed-by": "bench.topoproxy.io"}},
           "addressType": "IPv4", "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}], "endpoints": eps})
}

/// utime + stime of a process, in seconds.
pub(crate) fn cpu_seconds(pid: &str) -> f64 {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The fields after the command name (which may hold spaces): state is
    // the first, utime the 12th, stime the 13th.
    let fields: Vec<&str> = stat.rsplit_once(')').map(|(_, rest)| rest.split_whitespace().collect()).unwrap_or_default();
    let ticks = |i: usize| fields.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1);
    (ticks(11) + ticks(12)) as f64 / hz as f64
}

pub(crate) fn vm_rss(pid: u32) -> u64 {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status.lines().find_map(|l| l.strip_prefix("VmRSS:")).and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok()).unwrap_or(0) * 1024
}

/// The stand-in's Nodes.
struct Population {
    nodes: Vec<Value>,
}

impl Population {
    fn new(n: usize) -> Population {
        let now = realistic_nodes::now_rfc3339();
        let created = "2024-06-01T08:00:00Z";
        Population { nodes: (1..=n).map(|i| realistic_nodes::node(i, created, &now)).collect() }
    }

    /// The Nodes, the Service of variant `v` and its slice.
    fn objects(&self, v: Variant) -> Vec<Value> {
        self.nodes.iter().cloned().chain([service(v), slice(v)]).collect()
    }
}

pub(crate) fn run(o: &Options, repeats: usize, scratch: &Path) -> Result<Results> {
    let agent = match &o.agent {
        Some(a) => a.clone(),
        None => crate::control_plane::agent_binary()?,
    };
    if !agent.is_file() {
        bail!("no agent binary at {}", agent.display());
    }
    super::step(&format!("control plane at scale: generating {} realistic Nodes", o.nodes));
    let pop = Population::new(o.nodes);
    let mut sizes: Vec<usize> = pop.nodes.iter().map(|n| n.to_string().len()).collect();
    sizes.sort_unstable();
    let mut r = Results {
        opts: Some(o.clone()),
        agent: o.agent.as_ref().map_or_else(|| "the agent binary built with the bench".into(), |p| format!("`{}`", p.display())),
        node_json: (sizes[0], sizes[sizes.len() / 2], sizes[sizes.len() - 1]),
        repeats,
        ..Results::default()
    };
    let real = match o.server {
        ServerKind::StandIn => None,
        ServerKind::Real => {
            super::step(&format!("control plane at scale: starting the real control plane and creating {} Nodes", o.nodes));
            let rs = RealServer::start("bench-cps")?;
            let t0 = Instant::now();
            rs.create_nodes(&pop.nodes)?;
            r.setup_s = t0.elapsed().as_secs_f64();
            r.server_version = RealServer::version();
            rs.create_namespace(NAMESPACE)?;
            eprintln!("[bench]   {} Nodes created and reported once in {:.1} s", o.nodes, r.setup_s);
            // One Node's watch event as this server sends it, whole and
            // metadata-only (its own managedFields).
            let n = rs.node(&realistic_nodes::name(NODE_INDEX))?;
            r.event_full = json!({"type": "MODIFIED", "object": n}).to_string().len() + 1;
            let meta = json!({"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": n["metadata"]});
            r.event_meta = json!({"type": "MODIFIED", "object": meta}).to_string().len() + 1;
            Some(rs)
        }
    };
    for rep in 0..repeats {
        let order: Vec<Variant> = if rep % 2 == 0 { o.variants.clone() } else { o.variants.iter().rev().copied().collect() };
        for v in order {
            super::step(&format!(
                "control plane at scale: repeat {}/{repeats}: {} ({} Nodes, {} reports/s, {} s, {} API server)",
                rep + 1,
                v.key(),
                o.nodes,
                o.rate,
                o.secs,
                if real.is_some() { "real" } else { "stand-in" }
            ));
            let s = match &real {
                Some(rs) => one_run_real(o, v, &agent, &pop, scratch, rs)?,
                None => one_run(o, v, &agent, &pop, scratch, &mut r)?,
            };
            eprintln!(
                "[bench]   Node watch {:.1} KB/s ({} B over {} reports), first sync {:.2} s with {:.1} KB of lists, CPU {:.2} %, RSS {:.1} MiB (peak {:.1}), server side CPU {:.1} %",
                s.watch_bps / KB,
                s.watch_bytes,
                s.reports,
                s.sync_s,
                s.first_nodes as f64 / KB,
                s.cpu_pct,
                s.rss as f64 / MIB,
                s.hwm as f64 / MIB,
                s.server_cpu_pct
            );
            r.samples.entry(v).or_default().push(s);
        }
    }
    if let Some(rs) = &real
        && o.churn.services > 0
    {
        r.churn = Some(crate::control_plane_churn::run(&o.churn, rs, &agent, &o.agent_flags, o.nodes, scratch)?);
    }
    Ok(r)
}

/// Spawns the client of variant `v` against the stand-in; waits for its
/// first sync. Returns the process and the seconds it took.
fn spawn_client(
    o: &Options,
    v: Variant,
    agent: &Path,
    kubeconfig: &Path,
    log: &Path,
    cg: &Cgroup,
    pins: &PinDir,
) -> Result<(Guarded, f64)> {
    if v != Variant::KubeProxy {
        return spawn_agent(agent, &o.agent_flags, kubeconfig, log, cg, pins);
    }
    let t0 = Instant::now();
    let mut child = Guarded::spawn(
        Command::new(std::env::current_exe()?)
            .arg(CLIENT_FLAG)
            .arg(kubeconfig)
            .arg(realistic_nodes::name(NODE_INDEX))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(fs::File::create(log)?),
    )?;
    wait_logged(&mut child, log, "node synced", v.key())?;
    Ok((child, t0.elapsed().as_secs_f64()))
}

/// Spawns the agent (`proxy-agent run` on node-1 with `flags`, in `cg`
/// and `pins`) against `kubeconfig`; waits for its first sync. Returns the
/// process and the seconds it took.
pub(crate) fn spawn_agent(
    agent: &Path,
    flags: &[String],
    kubeconfig: &Path,
    log: &Path,
    cg: &Cgroup,
    pins: &PinDir,
) -> Result<(Guarded, f64)> {
    let t0 = Instant::now();
    let mut child = Guarded::spawn(
        Command::new(agent)
            .args([
                "run",
                "--node",
                &realistic_nodes::name(NODE_INDEX),
                "--healthz-bind-address",
                "127.0.0.1:0",
                "--metrics-bind-address",
                "127.0.0.1:0",
            ])
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .arg("--cgroup")
            .arg(cg.path())
            .arg("--bpffs")
            .arg(pins.path())
            .args(flags)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(fs::File::create(log)?),
    )?;
    wait_logged(&mut child, log, "first sync applied", "the agent")?;
    Ok((child, t0.elapsed().as_secs_f64()))
}

/// Waits until `log` holds `ready`, for at most 5 minutes.
fn wait_logged(child: &mut Guarded, log: &Path, ready: &str, who: &str) -> Result<()> {
    let deadline = Instant::now() + Duration::from_mins(5);
    loop {
        let text = fs::read_to_string(log).unwrap_or_default();
        if text.contains(ready) {
            break;
        }
        if Instant::now() > deadline || child.0.try_wait()?.is_some() {
            bail!("{who} did not sync: {}", text.lines().rev().take(20).collect::<Vec<_>>().join("\n"));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(())
}

fn one_run(o: &Options, v: Variant, agent: &Path, pop: &Population, scratch: &Path, r: &mut Results) -> Result<Sample> {
    let api = ApiServer::start_on("127.0.0.1:0".parse()?, 1, pop.objects(v));
    api.set_bookmark_interval(Duration::from_mins(1));
    if r.event_full == 0 {
        // One Node's watch event as the stand-in sends it, whole and
        // metadata-only (with the server's uid, resourceVersion, ...).
        let own = realistic_nodes::name(NODE_INDEX);
        if let Some(n) = api.objects().into_iter().find(|o| o["kind"] == "Node" && o["metadata"]["name"] == own.as_str()) {
            r.event_full = json!({"type": "MODIFIED", "object": n}).to_string().len() + 1;
            let meta = json!({"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": n["metadata"]});
            r.event_meta = json!({"type": "MODIFIED", "object": meta}).to_string().len() + 1;
        }
    }
    let kubeconfig = scratch.join("cps-kubeconfig");
    api.write_kubeconfig(&kubeconfig);
    let cg = Cgroup::new("tps")?;
    let pins = PinDir::new("tps")?;
    let log = scratch.join(format!("cps-{}.log", v.key()));
    api.reset_bytes_sent();
    let (mut child, sync_s) = spawn_client(o, v, agent, &kubeconfig, &log, &cg, &pins)?;
    let pid = child.0.id();
    let all = |api: &ApiServer| ["nodes", "services", "endpointslices"].iter().map(|c| api.list_bytes_sent(c)).sum::<u64>();
    let mut s = Sample { sync_s, first_nodes: api.list_bytes_sent("nodes"), first_all: all(&api), ..Sample::default() };
    if v != Variant::KubeProxy {
        check_programmed(&log)?;
    }

    // The kubelets: R reports per second, round robin from node-1.
    let stop = AtomicBool::new(false);
    let sent = AtomicU64::new(0);
    let mut nodes = pop.nodes.clone();
    std::thread::scope(|scope| -> Result<()> {
        let reporter = scope.spawn(|| {
            paced(o.rate, Duration::ZERO, &stop, |k| {
                let i = (k % nodes.len() as u64) as usize;
                realistic_nodes::report_status(&mut nodes[i], &realistic_nodes::now_rfc3339());
                api.apply(nodes[i].clone());
                sent.store(k + 1, Ordering::Relaxed);
            });
        });
        std::thread::sleep(Duration::from_secs(o.warmup_secs));
        let me = std::process::id().to_string();
        let (t0, w0, l0, c0, m0, k0) = (
            Instant::now(),
            api.watch_bytes_sent("nodes"),
            api.list_bytes_sent("nodes"),
            cpu_seconds(&pid.to_string()),
            cpu_seconds(&me),
            sent.load(Ordering::Relaxed),
        );
        std::thread::sleep(Duration::from_secs(o.secs));
        let (w1, l1, c1, m1, k1) = (
            api.watch_bytes_sent("nodes"),
            api.list_bytes_sent("nodes"),
            cpu_seconds(&pid.to_string()),
            cpu_seconds(&me),
            sent.load(Ordering::Relaxed),
        );
        let dt = t0.elapsed().as_secs_f64();
        stop.store(true, Ordering::Relaxed);
        let _ = reporter.join();
        s.watch_bytes = w1 - w0;
        s.watch_bps = s.watch_bytes as f64 / dt;
        s.window_list_bytes = l1 - l0;
        s.run_list_bytes = l1;
        s.cpu_pct = 100.0 * (c1 - c0) / dt;
        s.server_cpu_pct = 100.0 * (m1 - m0) / dt;
        s.reports = k1 - k0;
        Ok(())
    })?;
    s.rss = vm_rss(pid);
    s.hwm = crate::control_plane::vm_hwm(pid);
    if child.0.try_wait()?.is_some() {
        bail!("{} exited during the run: {}", v.key(), fs::read_to_string(&log).unwrap_or_default());
    }
    child.terminate(Duration::from_secs(10))?;
    drop(api);
    Ok(s)
}

/// One run of variant `v` against the real API server `rs`, which holds
/// the Nodes already: the variant's Service and slice are applied first
/// and deleted after.
fn one_run_real(o: &Options, v: Variant, agent: &Path, pop: &Population, scratch: &Path, rs: &RealServer) -> Result<Sample> {
    rs.apply_all(vec![service(v), slice(v)])?;
    let kubeconfig = scratch.join("cps-kubeconfig");
    rs.write_kubeconfig(&kubeconfig)?;
    let cg = Cgroup::new("tps")?;
    let pins = PinDir::new("tps")?;
    let log = scratch.join(format!("cps-{}.log", v.key()));
    let b0 = rs.bytes_to_clients();
    let (mut child, sync_s) = spawn_client(o, v, agent, &kubeconfig, &log, &cg, &pins)?;
    let pid = child.0.id();
    let first = rs.bytes_to_clients() - b0;
    let mut s = Sample { sync_s, first_nodes: first, first_all: first, ..Sample::default() };
    if v != Variant::KubeProxy {
        check_programmed(&log)?;
    }
    let stop = AtomicBool::new(false);
    let sent = AtomicU64::new(0);
    let failed = AtomicU64::new(0);
    let names: Vec<String> = (1..=pop.nodes.len()).map(realistic_nodes::name).collect();
    std::thread::scope(|scope| -> Result<()> {
        let reporter = scope.spawn(|| {
            paced(o.rate, Duration::ZERO, &stop, |k| {
                let i = (k % names.len() as u64) as usize;
                if rs.report_status(&names[i], &realistic_nodes::now_rfc3339()).is_err() {
                    failed.fetch_add(1, Ordering::Relaxed);
                }
                sent.store(k + 1, Ordering::Relaxed);
            });
        });
        std::thread::sleep(Duration::from_secs(o.warmup_secs));
        let server = server_pids();
        let server_cpu = || server.iter().map(|p| cpu_seconds(p)).sum::<f64>();
        let (t0, w0, c0, m0, k0) =
            (Instant::now(), rs.bytes_to_clients(), cpu_seconds(&pid.to_string()), server_cpu(), sent.load(Ordering::Relaxed));
        std::thread::sleep(Duration::from_secs(o.secs));
        let (w1, c1, m1, k1) = (rs.bytes_to_clients(), cpu_seconds(&pid.to_string()), server_cpu(), sent.load(Ordering::Relaxed));
        let dt = t0.elapsed().as_secs_f64();
        stop.store(true, Ordering::Relaxed);
        let _ = reporter.join();
        s.watch_bytes = w1 - w0;
        s.watch_bps = s.watch_bytes as f64 / dt;
        s.run_list_bytes = w1 - b0;
        s.cpu_pct = 100.0 * (c1 - c0) / dt;
        s.server_cpu_pct = 100.0 * (m1 - m0) / dt;
        s.reports = k1 - k0;
        Ok(())
    })?;
    let failed = failed.load(Ordering::Relaxed);
    if failed > 0 {
        eprintln!("[bench]   {failed} status reports failed");
    }
    s.rss = vm_rss(pid);
    s.hwm = crate::control_plane::vm_hwm(pid);
    if child.0.try_wait()?.is_some() {
        bail!("{} exited during the run: {}", v.key(), fs::read_to_string(&log).unwrap_or_default());
    }
    child.terminate(Duration::from_secs(10))?;
    rs.delete_service(NAMESPACE, "web")?;
    rs.delete_slice(NAMESPACE, "web-abcde")?;
    Ok(s)
}

/// The real control plane's kube-apiserver and etcd processes.
fn server_pids() -> Vec<String> {
    let Ok(dir) = fs::read_dir("/proc") else { return Vec::new() };
    dir.filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str().filter(|n| n.bytes().all(|b| b.is_ascii_digit())).map(String::from))
        .filter(|pid| matches!(fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default().trim(), "kube-apiserver" | "etcd"))
        .collect()
}

/// Calls `f(k)` for k = 0, 1, ... at `rate` calls per second, the first
/// after `offset`, until `stop` is raised; a late call is not made up by
/// a burst beyond catching up with the schedule.
pub(crate) fn paced(rate: f64, offset: Duration, stop: &AtomicBool, mut f: impl FnMut(u64)) {
    let period = Duration::from_secs_f64(1.0 / rate);
    let begin = Instant::now() + offset;
    let mut k: u64 = 0;
    while !stop.load(Ordering::Relaxed) {
        let due = begin + period.mul_f64(k as f64);
        let now = Instant::now();
        if due > now {
            std::thread::sleep(due - now);
        }
        f(k);
        k += 1;
    }
}

/// The agent's /metrics, at the address its log names.
pub(crate) fn agent_metrics(log: &Path) -> Result<String> {
    let text = fs::read_to_string(log).unwrap_or_default();
    let addr = text
        .rsplit("metrics_bind_address=")
        .next()
        .and_then(|s| s.split_whitespace().next())
        .filter(|_| text.contains("metrics_bind_address="))
        .context("the agent logged no metrics address")?;
    crate::control_plane::http_get(addr, "/metrics")
}

/// The agent programmed the Service (its /metrics).
fn check_programmed(log: &Path) -> Result<()> {
    let m = agent_metrics(log)?;
    let fes = crate::control_plane::metric(&m, "topoproxy_frontends_programmed").unwrap_or(0.0);
    if fes < 1.0 {
        bail!("after its first sync the agent programmed {fes} frontends, expected the Service's");
    }
    Ok(())
}

/// `--cps-kube-proxy-client KUBECONFIG NODE`: lists and watches one Node
/// as kube-proxy does (its informer on `metadata.name=NODE`), each event
/// decoded into a typed Node; logs "node synced" to stderr after the first
/// list. Runs until killed.
pub(crate) fn kube_proxy_client(kubeconfig: &Path, node: &str) -> Result<()> {
    use futures::StreamExt;
    use k8s_openapi::api::core::v1::Node;
    use kube::runtime::WatchStreamExt;
    use kube::runtime::watcher;

    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        let kc = kube::config::Kubeconfig::read_from(kubeconfig)?;
        let config = kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default()).await?;
        let client = kube::Client::try_from(config)?;
        let api: kube::Api<Node> = kube::Api::all(client);
        let fields = format!("metadata.name={node}");
        let mut stream = watcher::watcher(api, watcher::Config::default().fields(&fields)).default_backoff().boxed();
        let mut current: Option<Node> = None;
        let mut events = 0u64;
        while let Some(ev) = stream.next().await {
            match ev {
                Ok(watcher::Event::InitDone) => eprintln!("node synced ({} object)", usize::from(current.is_some())),
                Ok(watcher::Event::Apply(n) | watcher::Event::InitApply(n)) => {
                    events += 1;
                    current = Some(n);
                }
                Ok(watcher::Event::Delete(_)) => current = None,
                Ok(watcher::Event::Init) => {}
                Err(e) => eprintln!("watch error after {events} events: {e}"),
            }
        }
        anyhow::Ok(())
    })
}

fn cell(v: &[f64], scale: f64, digits: usize) -> String {
    let s = spread(v);
    if s.median.is_nan() {
        return "n/a".into();
    }
    format!("{:.d$} ({:.d$}–{:.d$})", s.median * scale, s.min * scale, s.max * scale, d = digits)
}

impl Results {
    fn of(&self, v: Variant, f: impl Fn(&Sample) -> f64) -> Vec<f64> {
        self.samples.get(&v).map(|s| s.iter().map(f).collect()).unwrap_or_default()
    }

    fn median(&self, v: Variant, f: impl Fn(&Sample) -> f64) -> f64 {
        spread(&self.of(v, f)).median
    }

    pub(crate) fn targets(&self) -> Vec<Target> {
        let Some(o) = &self.opts else { return Vec::new() };
        let at = format!("{} Nodes reporting {} times/s", o.nodes, o.rate);
        let server = match o.server {
            ServerKind::Real => "real kube-apiserver, every byte it sends the agent",
            ServerKind::StandIn => "stand-in API server",
        };
        let mut t = Vec::new();
        for (v, goal, limit) in [
            (Variant::NoLabelKeys, "<= 2 KB/s", 2.0),
            (Variant::RegionKeyed, "<= 50 KB/s", 50.0),
            (Variant::RegionKeyedWide, "<= 50 KB/s", 50.0),
        ] {
            if !self.samples.contains_key(&v) {
                continue;
            }
            let m = self.median(v, |s| s.watch_bps) / KB;
            let what = match v {
                Variant::NoLabelKeys => "without label-keyed Services",
                Variant::RegionKeyed => "with one region-keyed Service (endpoints on 6 Nodes)",
                _ => "with one region-keyed Service whose endpoints span 150 Nodes (every Node watched)",
            };
            t.push(Target {
                name: format!("Node watch bytes per agent {what}, {at} ({server})"),
                goal: goal.into(),
                measured: if m.is_nan() { "–".into() } else { format!("{m:.3} KB/s") },
                met: m.is_finite().then_some(m <= limit),
            });
        }
        t
    }

    pub(crate) fn markdown(&self) -> String {
        let Some(o) = &self.opts else { return String::new() };
        let mut md = String::from("## Control plane at scale: the Node watch\n\n");
        if o.server == ServerKind::Real {
            let _ = write!(
                md,
                "Against the **real kube-apiserver** {} (`test-support/src/real_cluster.rs`: etcd, kube-apiserver, kube-controller-manager on loopback). It holds {} Nodes made from `realistic_nodes.rs` (labels, annotations, five conditions, 30 images, nodeInfo; {} B of JSON each as generated, {}–{}), created through the API with the field manager `kubelet` and reported once each ({:.0} s for all); the server computes their managedFields. They report status {} times a second in total, round robin, each a strategic-merge patch of `nodes/NAME/status` by `kubelet` that changes the four heartbeats. One Node's watch event from this server is {} B whole, {} B metadata-only. The client reaches the server through a byte-counting TCP relay: **the byte figures are everything the server sends that client on all its connections** (TLS records and HTTP framing included; Services and EndpointSlices do not change in the window, so beyond the Node watches they are bookmarks). Server CPU = kube-apiserver + etcd.",
                self.server_version,
                o.nodes,
                self.node_json.1,
                self.node_json.0,
                self.node_json.2,
                self.setup_s,
                o.rate,
                self.event_full,
                self.event_meta,
            );
        } else {
            let _ = write!(
                md,
                "Against the **stand-in API server** (`test-support/src/apiserver.rs`: real list/watch over HTTP, uncompressed JSON, bookmarks every 60 s), not a real kube-apiserver. It holds {} realistic Nodes (`realistic_nodes.rs`: labels, annotations, kubelet managedFields, five conditions, 30 images, nodeInfo; {} B of JSON each, {}–{}) that report status {} times a second in total, round robin (each report a new resourceVersion with new heartbeats). One Node's watch event is {} B whole, {} B metadata-only (`PartialObjectMetadata`, managedFields included).",
                o.nodes, self.node_json.1, self.node_json.0, self.node_json.2, o.rate, self.event_full, self.event_meta,
            );
        }
        let _ = writeln!(
            md,
            " Agent: {} (`proxy-agent run --kubeconfig ... --node {} {}`, its own cgroup and pin directory). Window {} s after {} s of warm-up; {} repeats, variants interleaved; medians (min–max). KB = 1000 B.\n",
            self.agent,
            realistic_nodes::name(NODE_INDEX),
            o.agent_flags.join(" "),
            o.secs,
            o.warmup_secs,
            self.repeats
        );
        let _ = writeln!(
            md,
            "| variant | {} | per report | {} | spawn to first sync, s | CPU % | RSS MiB (VmRSS) | peak RSS MiB (VmHWM) |\n|---|---|---|---|---|---|---|---|---|---|",
            if o.server == ServerKind::Real {
                "Node watch KB/s (all bytes sent) | bytes in the window"
            } else {
                "Node watch KB/s | Node watch bytes in the window"
            },
            if o.server == ServerKind::Real {
                "bytes until first sync, KB | bytes, whole run, KB"
            } else {
                "Node lists until first sync, KB | Node lists, whole run, KB"
            },
        );
        for &v in self.samples.keys() {
            let per_report = if v == Variant::KubeProxy {
                "–".to_string()
            } else {
                cell(&self.of(v, |s| if s.reports > 0 { s.watch_bytes as f64 / s.reports as f64 } else { f64::NAN }), 1.0, 0)
            };
            let _ = writeln!(
                md,
                "| {} | {} | {} | {per_report} | {} | {} | {} | {} | {} | {} |",
                v.label(),
                cell(&self.of(v, |s| s.watch_bps), 1.0 / KB, 2),
                cell(&self.of(v, |s| s.watch_bytes as f64), 1.0, 0),
                cell(&self.of(v, |s| s.first_nodes as f64), 1.0 / KB, 1),
                cell(&self.of(v, |s| s.run_list_bytes as f64), 1.0 / KB, 1),
                cell(&self.of(v, |s| s.sync_s), 1.0, 2),
                cell(&self.of(v, |s| s.cpu_pct), 1.0, 2),
                cell(&self.of(v, |s| s.rss as f64), 1.0 / MIB, 1),
                cell(&self.of(v, |s| s.hwm as f64), 1.0 / MIB, 1),
            );
        }
        let _ = writeln!(
            md,
            "\nRun health: reports handed to the API server per second during the window; the server side's CPU (the stand-in and the reporter in the bench process, or kube-apiserver and etcd; it shares the machine's cores with the client); Node list bytes during the window (stand-in only; non-zero: the watch was closed and the client relisted); and the list bytes until the first sync (of every kind; with the real server, everything it sent).\n\n| variant | reports/s achieved | server side CPU % | Node list KB during the window | lists of every kind until first sync, KB |\n|---|---|---|---|---|"
        );
        for &v in self.samples.keys() {
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} |",
                v.key(),
                cell(&self.of(v, |s| s.reports as f64 / o.secs as f64), 1.0, 2),
                cell(&self.of(v, |s| s.server_cpu_pct), 1.0, 1),
                cell(&self.of(v, |s| s.window_list_bytes as f64), 1.0 / KB, 1),
                cell(&self.of(v, |s| s.first_all as f64), 1.0 / KB, 1),
            );
        }
        if let Some(c) = &self.churn {
            md.push_str(&c.markdown());
        }
        let per_node = o.rate / o.nodes as f64;
        let _ = writeln!(
            md,
            "\nThe kube-proxy-shaped client's own Node reports {per_node:.3} times a second here, so its steady cost is about {:.0} B/s ({per_node:.3} x {} B); a window holds only a few of its reports, so its measured figure is coarse (bookmarks, about 100 B each, come once a minute). A watch of every other Node metadata-only would still carry every report, at {} B each: about {:.1} KB/s at this rate.\n",
            per_node * self.event_full as f64,
            self.event_full,
            self.event_meta,
            o.rate * self.event_meta as f64 / KB
        );
        md
    }

    pub(crate) fn json(&self) -> Value {
        let Some(o) = &self.opts else { return Value::Null };
        let rows: serde_json::Map<String, Value> = self
            .samples
            .iter()
            .map(|(v, ss)| {
                let sp = |f: fn(&Sample) -> f64| -> Spread { spread(&ss.iter().map(f).collect::<Vec<_>>()) };
                (
                    v.key().to_string(),
                    json!({
                        "node_watch_bytes_per_second": sp(|s| s.watch_bps).json(),
                        "node_watch_bytes": ss.iter().map(|s| s.watch_bytes).collect::<Vec<_>>(),
                        "reports": ss.iter().map(|s| s.reports).collect::<Vec<_>>(),
                        "first_sync_node_list_bytes": sp(|s| s.first_nodes as f64).json(),
                        "first_sync_list_bytes_all_kinds": sp(|s| s.first_all as f64).json(),
                        "spawn_to_first_sync_seconds": sp(|s| s.sync_s).json(),
                        "cpu_percent": sp(|s| s.cpu_pct).json(),
                        "rss_bytes": sp(|s| s.rss as f64).json(),
                        "peak_rss_bytes": sp(|s| s.hwm as f64).json(),
                        "standin_and_reporter_cpu_percent": sp(|s| s.server_cpu_pct).json(),
                        "node_list_bytes_during_window": ss.iter().map(|s| s.window_list_bytes).collect::<Vec<_>>(),
                        "node_list_bytes_whole_run": sp(|s| s.run_list_bytes as f64).json(),
                    }),
                )
            })
            .collect();
        json!({
            "api_server": match o.server { ServerKind::Real => "real kube-apiserver (test-support/src/real_cluster.rs), bytes through a counting relay, all connections", ServerKind::StandIn => "stand-in (test-support/src/apiserver.rs)" },
            "node_setup_seconds": self.setup_s,
            "churn": self.churn.as_ref().map(crate::control_plane_churn::Results::json),
            "nodes": o.nodes,
            "reports_per_second": o.rate,
            "window_seconds": o.secs,
            "warmup_seconds": o.warmup_secs,
            "repeats": self.repeats,
            "agent": self.agent,
            "node_json_bytes": {"min": self.node_json.0, "median": self.node_json.1, "max": self.node_json.2},
            "node_watch_event_bytes": {"full": self.event_full, "metadata_only": self.event_meta},
            "variants": rows,
        })
    }
}

/// The report of a `--only control-plane-scale` run: printed, and written
/// to `control-plane-scale.md` and `control-plane-scale.json` in `out`
/// (the full report, `report.md`, is left alone).
pub(crate) fn write_alone(out: &Path, r: &Results) -> Result<()> {
    let mut targets = r.targets();
    if let Some(c) = &r.churn {
        targets.extend(c.targets());
    }
    let md = format!(
        "# topoproxy benchmark: control plane at scale only\n\n{}\n\n{}{}",
        crate::report::machine(),
        r.markdown(),
        crate::report::targets_markdown(&targets)
    );
    let mut doc = json!({"control_plane_scale": r.json()});
    doc["targets"] = crate::report::targets_json(&targets);
    fs::create_dir_all(out)?;
    fs::write(out.join("control-plane-scale.md"), &md)?;
    fs::write(out.join("control-plane-scale.json"), serde_json::to_string_pretty(&doc)?)?;
    println!("{md}");
    println!("report written to {}", out.join("control-plane-scale.md").display());
    Ok(())
}
