//! The control plane through the stand-in Kubernetes API server
//! (`proxy_test_support::apiserver`, real list/watch over HTTP, so the agent's
//! unmodified kube-rs watchers run against it):
//!
//! - cold sync: `proxy-agent run` in Kubernetes mode starts against a server
//!   that already holds N Services x 10 endpoints (distinct endpoint
//!   addresses, as pods have). Measured from spawning the agent until it
//!   logs its first sync ("first sync applied"), which it does only after
//!   every kind was listed and every frontend was written; the bench then
//!   checks the counts in /metrics. Also the agent's peak RSS (VmHWM) and
//!   the kernel memory of its maps (`memlock` in the maps' fdinfo).
//!   Against `iptables-restore` and `nft -f` of the kube-proxy-shaped
//!   rulesets for the same population (every Service its own ten endpoint
//!   chains), in namespaces of their own.
//! - change latency: while a thread pushes EndpointSlice changes into the
//!   API server at a fixed rate (each flips one endpoint's `ready`, so each
//!   is a real backend-set change), the bench replaces one endpoint of a
//!   probe Service and polls the pinned SERVICES map from outside the agent
//!   until that Service's entry switches to a new generation whose slots
//!   hold the new address. Latency = from just before the change is handed
//!   to the API server to the moment the new set is visible to the
//!   datapath, so it includes the watch delivery, the agent's coalescing
//!   interval and the sync; the poll adds at most ~0.1 ms.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::fs;
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, Result, bail};
use aya::maps::{HashMap as BpfHashMap, Map, MapData};
use proxy_agent::datapath::keys::{backend_of, service_key};
use proxy_agent::model::{Frontend, Protocol};
use proxy_common::{BackendKey, BackendValue, ServiceKey, ServiceValue, SlotKey, SlotValue};
use proxy_test_support::apiserver::ApiServer;
use proxy_test_support::sandbox::{Cgroup, Guarded, Netns, PinDir};
use serde_json::{Value, json};

use crate::report::{Target, percentile, spread};

const ENDPOINTS: usize = 10;
const NAMESPACE: &str = "bench";
const NODE: &str = "node-0";
const SVC_BASE: Ipv4Addr = Ipv4Addr::new(10, 100, 0, 0);
const EP_BASE: Ipv4Addr = Ipv4Addr::new(10, 200, 0, 0);
const PROBE_BASE: Ipv4Addr = Ipv4Addr::new(10, 250, 0, 0);
const EP_PORT: u16 = 8080;

/// `--cp-*` flags.
#[derive(Clone, Debug)]
pub(crate) struct Options {
    pub services: usize,
    /// Probe changes per repeat for the change latency.
    pub probes: usize,
    /// Background EndpointSlice changes per second.
    pub rate: u32,
    /// Rule loaders to compare with (`iptables`, `nft`); empty for none.
    pub rules: Vec<String>,
    /// Extra flags for the agent. The default keeps TC programs off the
    /// host's interfaces (the agent runs in the host's network namespace).
    pub agent_flags: Vec<String>,
    /// Another agent binary to measure, here and in the manifest cold
    /// start of main.rs (e.g. an older build, for a
    /// before/after comparison); default: the one built with the bench.
    pub agent: Option<PathBuf>,
    /// Repeats of the rule loaders (default: every repeat). `nft -f` of
    /// 10k Services with their endpoint chains takes minutes.
    pub rule_repeats: Option<usize>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            services: 10_000,
            probes: 200,
            rate: 1000,
            rules: vec!["iptables".into(), "nft".into()],
            agent_flags: vec!["--devices".into(), "none".into()],
            agent: None,
            rule_repeats: None,
        }
    }
}

/// Handles one `--cp-*` flag; `false` if it is not one.
pub(crate) fn flag(o: &mut Options, name: &str, value: &str) -> Result<bool> {
    match name {
        "--cp-services" => o.services = value.parse()?,
        "--cp-probes" => o.probes = value.parse()?,
        "--cp-rate" => o.rate = value.parse()?,
        "--cp-rules" => o.rules = value.split(',').map(str::trim).filter(|s| !s.is_empty() && *s != "none").map(String::from).collect(),
        "--cp-agent-flags" => o.agent_flags = value.split_whitespace().map(String::from).collect(),
        "--cp-agent" => o.agent = Some(PathBuf::from(value)),
        "--cp-rule-repeats" => o.rule_repeats = Some(value.parse()?),
        _ => return Ok(false),
    }
    if o.services < 2 || o.rate == 0 {
        bail!("--cp-services must be at least 2 and --cp-rate at least 1");
    }
    Ok(true)
}

pub(crate) const FLAGS_HELP: &str = "--cp-services 10000 --cp-probes 200 --cp-rate 1000 --cp-rules iptables,nft|none --cp-agent-flags '--devices none ...' --cp-agent PATH --cp-rule-repeats N";

fn svc_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(SVC_BASE) + 1 + i as u32)
}

fn ep_ip(i: usize, j: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(EP_BASE) + 1 + (i * ENDPOINTS + j) as u32)
}

fn service(i: usize) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": format!("s{i}"), "namespace": NAMESPACE},
        "spec": {"clusterIP": svc_ip(i).to_string(), "clusterIPs": [svc_ip(i).to_string()],
                 "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": EP_PORT}]},
    })
}

/// Service `i`'s slice; `first` replaces endpoint 0's address and `unready`
/// marks endpoint 9 not ready.
fn slice(i: usize, first: Option<Ipv4Addr>, unready: bool) -> Value {
    let eps: Vec<Value> = (0..ENDPOINTS)
        .map(|j| {
            let ip = if j == 0 { first.unwrap_or_else(|| ep_ip(i, 0)) } else { ep_ip(i, j) };
            let ready = !(unready && j == ENDPOINTS - 1);
            json!({"addresses": [ip.to_string()], "conditions": {"ready": ready, "serving": ready, "terminating": false},
                   "nodeName": format!("node-{}", j % 3), "zone": format!("zone-{}", j % 3),
                   "targetRef": {"kind": "Pod", "namespace": NAMESPACE, "name": format!("s{i}-pod-{j}")}})
        })
        .collect();
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": format!("s{i}-abcde"), "namespace": NAMESPACE,
                     "labels": {"kubernetes.io/service-name": format!("s{i}"), "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": EP_PORT, "protocol": "TCP"}],
        "endpoints": eps,
    })
}

fn population(n: usize) -> Vec<Value> {
    let mut out: Vec<Value> = (0..3)
        .map(|z| json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": format!("node-{z}"), "labels": {"topology.kubernetes.io/zone": format!("zone-{z}"), "kubernetes.io/hostname": format!("node-{z}")}}}))
        .collect();
    for i in 0..n {
        out.push(service(i));
        out.push(slice(i, None, false));
    }
    out
}

/// Everything measured, per repeat where it varies.
#[derive(Default)]
pub(crate) struct Results {
    pub opts: Option<Options>,
    pub cold_sync_s: Vec<f64>,
    /// Seconds from spawn to: datapath installed, all kinds listed; and the
    /// first sync's own duration (from the agent's log).
    pub phases: Vec<(f64, f64, f64)>,
    pub rss_after_sync: Vec<u64>,
    pub rss_peak: Vec<u64>,
    /// memlock bytes per pinned map (last repeat).
    pub map_memlock: BTreeMap<String, u64>,
    pub p50_ms: Vec<f64>,
    pub p99_ms: Vec<f64>,
    pub all_ms: Vec<f64>,
    pub lost: usize,
    pub rate: Vec<f64>,
    pub rules_s: BTreeMap<String, Vec<f64>>,
    pub agent_flags: Vec<String>,
    /// Syncs per second and mean sync duration (seconds) during the stream,
    /// from the agent's /metrics.
    pub syncs_per_s: Vec<f64>,
    pub sync_mean_s: Vec<f64>,
}

/// The agent built with the bench (target/<profile>/proxy-agent).
pub(crate) fn agent_binary() -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    exe.parent().and_then(Path::parent).map(|d| d.join("proxy-agent")).context("locating the agent binary")
}

/// Peak RSS of a running process, in bytes.
pub(crate) fn vm_hwm(pid: u32) -> u64 {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status.lines().find_map(|l| l.strip_prefix("VmHWM:")).and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok()).unwrap_or(0) * 1024
}

/// Kernel memory charged for every map pinned in `dir` (`memlock` in fdinfo).
fn memlock_all(dir: &Path) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    let Ok(rd) = fs::read_dir(dir) else { return out };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Ok(data) = MapData::from_pin(e.path()) else { continue };
        use std::os::fd::{AsFd, AsRawFd};
        let fd = data.fd().as_fd().as_raw_fd();
        let v = fs::read_to_string(format!("/proc/self/fdinfo/{fd}"))
            .ok()
            .and_then(|s| s.lines().find_map(|l| l.strip_prefix("memlock:").and_then(|v| v.trim().parse().ok())))
            .unwrap_or(0);
        out.insert(name, v);
    }
    out
}

/// Reads one frontend straight from the pinned maps, as the datapath sees
/// it: (generation, backend addresses).
struct MapReader {
    services: BpfHashMap<MapData, ServiceKey, ServiceValue>,
    slots: BpfHashMap<MapData, SlotKey, SlotValue>,
    backends: BpfHashMap<MapData, BackendKey, BackendValue>,
}

impl MapReader {
    fn open(pins: &Path) -> Result<MapReader> {
        let open = |name: &str| -> Result<Map> {
            Ok(Map::HashMap(MapData::from_pin(pins.join(name)).with_context(|| format!("opening pinned {name}"))?))
        };
        Ok(MapReader {
            services: BpfHashMap::try_from(open(proxy_common::SERVICES_MAP)?)?,
            slots: BpfHashMap::try_from(open(proxy_common::SLOTS_MAP)?)?,
            backends: BpfHashMap::try_from(open(proxy_common::BACKENDS_MAP)?)?,
        })
    }

    fn entry(&self, fe: &Frontend) -> Option<ServiceValue> {
        self.services.get(&service_key(fe), 0).ok()
    }

    fn backends(&self, v: &ServiceValue) -> Vec<IpAddr> {
        (0..v.backend_count)
            .filter_map(|slot| {
                let s = self.slots.get(&SlotKey { service_id: v.service_id, generation: v.generation, slot }, 0).ok()?;
                let b = self.backends.get(&BackendKey { backend_id: s.backend_id }, 0).ok()?;
                backend_of(&b).map(|b| b.ip)
            })
            .collect()
    }
}

/// Seconds since the Unix epoch of a tracing line's RFC 3339 timestamp.
fn log_time(line: &str) -> Option<f64> {
    let ts = line.split_whitespace().next()?;
    let t: k8s_openapi::jiff::Timestamp = ts.parse().ok()?;
    Some(t.as_nanosecond() as f64 / 1e9)
}

fn unix(t: SystemTime) -> f64 {
    t.duration_since(SystemTime::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

pub(crate) fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
        .and_then(|l| l[series.len()..].split_whitespace().next()?.parse().ok())
}

pub(crate) fn http_get(addr: &str, path: &str) -> Result<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut buf = String::new();
    s.read_to_string(&mut buf)?;
    Ok(buf.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default())
}

/// A small deterministic generator for the gaps between probes, so probes do
/// not lock onto the agent's sync rhythm.
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        self.0 >> 33
    }
}

pub(crate) fn run(o: &Options, repeats: usize, scratch: &Path) -> Result<Results> {
    let agent = match &o.agent {
        Some(a) => a.clone(),
        None => agent_binary()?,
    };
    let mut r = Results { opts: Some(o.clone()), agent_flags: o.agent_flags.clone(), ..Results::default() };
    let objects = population(o.services);
    let rules = RuleTexts::new(o, scratch)?;
    for rep in 0..repeats {
        super::step(&format!(
            "control plane: repeat {}/{repeats}: agent cold sync of {} Services x {ENDPOINTS} through the API server",
            rep + 1,
            o.services
        ));
        one_agent_run(o, &agent, &objects, scratch, &mut r)?;
        // Interleaved with the agent runs: the rule loaders, each into a
        // namespace of its own.
        for tool in o.rules.iter().filter(|_| rep < o.rule_repeats.unwrap_or(repeats)) {
            super::step(&format!("control plane: repeat {}/{repeats}: {tool} of the equivalent ruleset", rep + 1));
            let secs = rules.load(tool)?;
            r.rules_s.entry(tool.clone()).or_default().push(secs);
        }
    }
    Ok(r)
}

fn one_agent_run(o: &Options, agent: &Path, objects: &[Value], scratch: &Path, r: &mut Results) -> Result<()> {
    let api = ApiServer::start_on("127.0.0.1:0".parse()?, 1, objects.to_vec());
    let kubeconfig = scratch.join("cp-kubeconfig");
    api.write_kubeconfig(&kubeconfig);
    let cg = Cgroup::new("tpc")?;
    let pins = PinDir::new("tpc")?;
    let log = scratch.join("cp-agent.log");
    let started_wall = SystemTime::now();
    let t0 = Instant::now();
    let mut child = Guarded::spawn(
        Command::new(agent)
            .args(["run", "--node", NODE, "--healthz-bind-address", "127.0.0.1:0", "--metrics-bind-address", "127.0.0.1:0"])
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .arg("--cgroup")
            .arg(cg.path())
            .arg("--bpffs")
            .arg(pins.path())
            .args(&o.agent_flags)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(fs::File::create(&log)?),
    )?;
    let deadline = Instant::now() + Duration::from_mins(5);
    let text = loop {
        let text = fs::read_to_string(&log).unwrap_or_default();
        if text.contains("first sync applied") {
            break text;
        }
        if Instant::now() > deadline || child.0.try_wait()?.is_some() {
            bail!("agent did not sync: {}", text.lines().rev().take(20).collect::<Vec<_>>().join("\n"));
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    let cold = t0.elapsed().as_secs_f64();
    let pid = child.0.id();
    r.rss_after_sync.push(vm_hwm(pid));
    r.cold_sync_s.push(cold);

    // Where the time went, from the agent's own timestamps.
    let start = unix(started_wall);
    let at = |needle: &str| text.lines().filter(|l| l.contains(needle)).filter_map(log_time).next_back().map_or(f64::NAN, |t| t - start);
    let installed = at("datapath installed");
    let listed = at(" listed");
    let sync_ms: f64 = text
        .lines()
        .find(|l| l.contains(" synced"))
        .and_then(|l| l.split("took_ms=").nth(1)?.split_whitespace().next()?.parse().ok())
        .unwrap_or(f64::NAN);
    r.phases.push((installed, listed, sync_ms / 1e3));

    let addr = text
        .rsplit("metrics_bind_address=")
        .next()
        .and_then(|s| s.split_whitespace().next())
        .context("the agent logged no metrics address")?
        .to_string();
    let m = http_get(&addr, "/metrics")?;
    let fes = metric(&m, "topoproxy_frontends_programmed").unwrap_or(0.0);
    let eps = metric(&m, "topoproxy_endpoints_programmed").unwrap_or(0.0);
    if fes != o.services as f64 || eps != (o.services * ENDPOINTS) as f64 {
        bail!(
            "after the first sync the agent reports {fes} frontends / {eps} endpoints, expected {} / {}",
            o.services,
            o.services * ENDPOINTS
        );
    }
    r.map_memlock = memlock_all(pins.path());

    // Change latency under a stream of EndpointSlice changes.
    let reader = MapReader::open(pins.path())?;
    let probe_fe = Frontend { ip: IpAddr::V4(svc_ip(0)), port: 80, protocol: Protocol::Tcp };
    let stop = AtomicBool::new(false);
    let sent = AtomicU64::new(0);
    let mut lat_ms: Vec<f64> = Vec::with_capacity(o.probes);
    let mut lost = 0usize;
    let syncs_before =
        (metric(&m, "topoproxy_syncs_total").unwrap_or(0.0), metric(&m, "topoproxy_sync_duration_seconds_sum").unwrap_or(0.0));
    let t_stream = Instant::now();
    let achieved_rate = std::thread::scope(|s| -> Result<f64> {
        let streamer = s.spawn(|| {
            let period = Duration::from_secs_f64(1.0 / f64::from(o.rate));
            let begin = Instant::now();
            let mut k: u64 = 0;
            while !stop.load(Ordering::Relaxed) {
                let due = begin + period.mul_f64(k as f64);
                let now = Instant::now();
                if due > now {
                    std::thread::sleep(due - now);
                }
                // Services 1.. in turn; each visit flips endpoint 9.
                let n = (o.services - 1) as u64;
                let i = 1 + (k % n) as usize;
                let unready = (k / n).is_multiple_of(2);
                api.apply(slice(i, None, unready));
                k += 1;
                sent.store(k, Ordering::Relaxed);
            }
            begin.elapsed().as_secs_f64()
        });
        // Let the stream reach its rate before probing.
        std::thread::sleep(Duration::from_secs(1));
        let sent_before = sent.load(Ordering::Relaxed);
        let t_probe = Instant::now();
        let mut rng = Lcg(0x5eed);
        for p in 0..o.probes {
            std::thread::sleep(Duration::from_millis(20 + rng.next() % 40));
            let before = reader.entry(&probe_fe).map(|v| v.generation);
            let new_ip = Ipv4Addr::from(u32::from(PROBE_BASE) + 1 + p as u32);
            let t = Instant::now();
            api.apply(slice(0, Some(new_ip), false));
            let limit = t + Duration::from_secs(5);
            loop {
                if let Some(v) = reader.entry(&probe_fe)
                    && Some(v.generation) != before
                    && reader.backends(&v).contains(&IpAddr::V4(new_ip))
                {
                    lat_ms.push(t.elapsed().as_secs_f64() * 1e3);
                    break;
                }
                if Instant::now() > limit {
                    lost += 1;
                    break;
                }
                std::thread::sleep(Duration::from_micros(100));
            }
        }
        let rate = (sent.load(Ordering::Relaxed) - sent_before) as f64 / t_probe.elapsed().as_secs_f64();
        stop.store(true, Ordering::Relaxed);
        let _ = streamer.join();
        Ok(rate)
    })?;
    r.rate.push(achieved_rate);
    let m = http_get(&addr, "/metrics")?;
    let syncs = metric(&m, "topoproxy_syncs_total").unwrap_or(0.0) - syncs_before.0;
    let sync_secs = metric(&m, "topoproxy_sync_duration_seconds_sum").unwrap_or(0.0) - syncs_before.1;
    r.syncs_per_s.push(syncs / t_stream.elapsed().as_secs_f64());
    r.sync_mean_s.push(if syncs > 0.0 { sync_secs / syncs } else { f64::NAN });
    r.rss_peak.push(vm_hwm(pid));
    let mut sorted: Vec<u64> = lat_ms.iter().map(|ms| (ms * 1e6) as u64).collect();
    sorted.sort_unstable();
    r.p50_ms.push(percentile(&sorted, 0.5) / 1e6);
    r.p99_ms.push(percentile(&sorted, 0.99) / 1e6);
    r.all_ms.extend(lat_ms);
    r.lost += lost;
    child.terminate(Duration::from_secs(10))?;
    drop(api);
    Ok(())
}

/// kube-proxy-shaped rulesets for the same population: every Service with
/// its own ten endpoint chains (KUBE-SEP-* / endpoint chains), one TCP port.
struct RuleTexts {
    dir: PathBuf,
}

impl RuleTexts {
    fn new(o: &Options, scratch: &Path) -> Result<RuleTexts> {
        let dir = scratch.join("cp-rules");
        fs::create_dir_all(&dir)?;
        let n = o.services;
        if o.rules.iter().any(|t| t == "iptables") {
            let mut s = String::with_capacity(n * 3000);
            s.push_str("*nat\n:PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\n:KUBE-SERVICES - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n");
            for i in 0..n {
                let _ = writeln!(s, ":KUBE-SVC-{i:016X} - [0:0]");
                for j in 0..ENDPOINTS {
                    let _ = writeln!(s, ":KUBE-SEP-{i:012X}{j:04X} - [0:0]");
                }
            }
            s.push_str("-A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n");
            s.push_str("-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000\n");
            for i in 0..n {
                let _ = writeln!(
                    s,
                    "-A KUBE-SERVICES -d {}/32 -p tcp -m comment --comment \"{NAMESPACE}/s{i}:http cluster IP\" -m tcp --dport 80 -j KUBE-SVC-{i:016X}",
                    svc_ip(i)
                );
                for j in 0..ENDPOINTS {
                    let left = ENDPOINTS - j;
                    let prob = if left > 1 {
                        format!(" -m statistic --mode random --probability {:.11}", 1.0 / left as f64)
                    } else {
                        String::new()
                    };
                    let _ = writeln!(
                        s,
                        "-A KUBE-SVC-{i:016X} -m comment --comment \"{NAMESPACE}/s{i}:http -> {}:{EP_PORT}\"{prob} -j KUBE-SEP-{i:012X}{j:04X}",
                        ep_ip(i, j)
                    );
                    let _ = writeln!(
                        s,
                        "-A KUBE-SEP-{i:012X}{j:04X} -s {}/32 -m comment --comment \"{NAMESPACE}/s{i}:http\" -j KUBE-MARK-MASQ",
                        ep_ip(i, j)
                    );
                    let _ = writeln!(
                        s,
                        "-A KUBE-SEP-{i:012X}{j:04X} -p tcp -m comment --comment \"{NAMESPACE}/s{i}:http\" -m tcp -j DNAT --to-destination {}:{EP_PORT}",
                        ep_ip(i, j)
                    );
                }
            }
            s.push_str("COMMIT\n");
            fs::write(dir.join("iptables.rules"), s)?;
        }
        if o.rules.iter().any(|t| t == "nft") {
            let mut s = String::with_capacity(n * 2500);
            s.push_str("table ip kube-proxy {\n");
            s.push_str("  chain mark-for-masquerade {\n    mark set mark or 0x4000\n  }\n");
            for i in 0..n {
                for j in 0..ENDPOINTS {
                    let _ = writeln!(
                        s,
                        "  chain endpoint-{i}-{j} {{\n    ip saddr {} jump mark-for-masquerade\n    meta l4proto tcp dnat to {}:{EP_PORT}\n  }}",
                        ep_ip(i, j),
                        ep_ip(i, j)
                    );
                }
                let vmap: Vec<String> = (0..ENDPOINTS).map(|j| format!("{j} : goto endpoint-{i}-{j}")).collect();
                let _ = writeln!(s, "  chain service-{i} {{\n    numgen random mod {ENDPOINTS} vmap {{ {} }}\n  }}", vmap.join(", "));
            }
            s.push_str("  map service-ips {\n    type ipv4_addr . inet_proto . inet_service : verdict\n    elements = {\n");
            for i in 0..n {
                let sep = if i + 1 == n { "" } else { "," };
                let _ = writeln!(s, "      {} . tcp . 80 : goto service-{i}{sep}", svc_ip(i));
            }
            s.push_str("    }\n  }\n  chain services {\n    ip daddr . meta l4proto . th dport vmap @service-ips\n  }\n");
            s.push_str("  chain output {\n    type nat hook output priority -100; policy accept;\n    jump services\n  }\n}\n");
            fs::write(dir.join("rules.nft"), s)?;
        }
        Ok(RuleTexts { dir })
    }

    /// Loads one ruleset into a fresh namespace; seconds the tool took.
    fn load(&self, tool: &str) -> Result<f64> {
        let ns = Netns::new("tpc")?;
        let (argv, file): (&[&str], &str) = match tool {
            "iptables" => (&["iptables-legacy-restore"], "iptables.rules"),
            "nft" => (&["nft", "-f"], "rules.nft"),
            other => bail!("unknown rule loader {other} (iptables, nft)"),
        };
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", ns.name()]).args(argv).arg(self.dir.join(file));
        Ok(super::run(&mut cmd)?.as_secs_f64())
    }
}

const TOOL_NAMES: [(&str, &str); 2] = [("iptables", "iptables-restore (legacy)"), ("nft", "nft -f")];

fn mib(b: f64) -> String {
    format!("{:.1} MiB", b / 1048576.0)
}

fn s_spread(v: &[f64], unit: &str, scale: f64, digits: usize) -> String {
    let s = spread(v);
    if s.median.is_nan() {
        return "n/a".into();
    }
    format!("{:.d$} {unit} ({:.d$}–{:.d$})", s.median * scale, s.min * scale, s.max * scale, d = digits)
}

impl Results {
    fn pooled(&self, p: f64) -> f64 {
        let mut v: Vec<u64> = self.all_ms.iter().map(|ms| (ms * 1e6) as u64).collect();
        v.sort_unstable();
        percentile(&v, p) / 1e6
    }

    pub(crate) fn targets(&self) -> Vec<Target> {
        let Some(o) = &self.opts else { return Vec::new() };
        let cold = spread(&self.cold_sync_s).median;
        let p99 = spread(&self.p99_ms).median;
        let rss = spread(&self.rss_peak.iter().map(|b| *b as f64).collect::<Vec<_>>()).median;
        vec![
            Target {
                name: format!(
                    "cold sync through the API server, {} Services x {ENDPOINTS} endpoints (agent start to every map written)",
                    o.services
                ),
                goal: "<= 1 s".into(),
                measured: format!("{cold:.2} s"),
                met: cold.is_finite().then_some(cold <= 1.0),
            },
            Target {
                name: format!("change latency p99 (event sent to maps written) under {} EndpointSlice events/s", o.rate),
                goal: "<= 10 ms".into(),
                measured: format!("{p99:.2} ms"),
                met: p99.is_finite().then_some(p99 <= 10.0 && self.lost == 0),
            },
            Target {
                name: format!("agent peak RSS (VmHWM), API server mode, {} x {ENDPOINTS}", o.services),
                goal: "<= 100 MiB".into(),
                measured: mib(rss),
                met: rss.is_finite().then_some(rss <= 100.0 * 1048576.0),
            },
        ]
    }

    pub(crate) fn markdown(&self) -> String {
        let Some(o) = &self.opts else { return String::new() };
        let mut md = String::new();
        let n = self.cold_sync_s.len();
        let _ = writeln!(md, "## Control plane through the API server\n");
        let _ = writeln!(
            md,
            "{} in Kubernetes mode (`proxy-agent run --kubeconfig ...`{}) against the stand-in API server (`test-support/src/apiserver.rs`: real list/watch over HTTP, kube-rs's unmodified watchers, list pages of 500; it keeps each object's JSON rendered, because a real API server would not share the agent's cores). {} Services x {ENDPOINTS} endpoints, every endpoint a distinct address, one TCP port each. {n} repeats; medians with the spread (min–max).\n",
            self.agent_label(),
            if self.agent_flags.is_empty() { String::new() } else { format!(" `{}`", self.agent_flags.join(" ")) },
            o.services
        );
        let _ = writeln!(md, "| what | median (min–max) |\n|---|---|");
        let _ = writeln!(
            md,
            "| cold sync: agent spawned until its first sync has written every map | {} |",
            s_spread(&self.cold_sync_s, "s", 1.0, 3)
        );
        let ph = |f: fn(&(f64, f64, f64)) -> f64| self.phases.iter().map(f).collect::<Vec<_>>();
        let _ = writeln!(
            md,
            "| &nbsp;&nbsp;of which: datapath installed (BPF load, attach), since spawn | {} |",
            s_spread(&ph(|p| p.0), "s", 1.0, 3)
        );
        let _ = writeln!(md, "| &nbsp;&nbsp;every kind listed, since spawn | {} |", s_spread(&ph(|p| p.1), "s", 1.0, 3));
        let _ = writeln!(
            md,
            "| &nbsp;&nbsp;the first sync itself (decide, diff, write {} frontends / {} slots) | {} |",
            o.services,
            o.services * ENDPOINTS,
            s_spread(&ph(|p| p.2), "s", 1.0, 3)
        );
        for (tool, label) in TOOL_NAMES {
            if let Some(v) = self.rules_s.get(tool) {
                let _ = writeln!(
                    md,
                    "| {label} of the kube-proxy-shaped ruleset for the same Services and endpoints | {} |",
                    s_spread(v, "s", 1.0, 3)
                );
            }
        }
        let rss_sync: Vec<f64> = self.rss_after_sync.iter().map(|b| *b as f64).collect();
        let rss_peak: Vec<f64> = self.rss_peak.iter().map(|b| *b as f64).collect();
        let _ = writeln!(md, "| agent peak RSS (VmHWM) after the cold sync | {} |", s_spread(&rss_sync, "MiB", 1.0 / 1048576.0, 1));
        let _ =
            writeln!(md, "| agent peak RSS (VmHWM) after the change-latency stream | {} |", s_spread(&rss_peak, "MiB", 1.0 / 1048576.0, 1));
        let main: u64 = ["SERVICES", "SLOTS", "BACKENDS"].iter().filter_map(|m| self.map_memlock.get(*m)).sum();
        let all: u64 = self.map_memlock.values().sum();
        let _ = writeln!(md, "| kernel memory (memlock) of SERVICES + SLOTS + BACKENDS at the default capacities | {} |", mib(main as f64));
        let _ = writeln!(md, "| kernel memory (memlock) of every pinned map of the agent | {} |", mib(all as f64));
        let _ = writeln!(md, "| change latency p50 | {} |", s_spread(&self.p50_ms, "ms", 1.0, 2));
        let _ = writeln!(md, "| change latency p99 | {} |", s_spread(&self.p99_ms, "ms", 1.0, 2));
        let _ = writeln!(
            md,
            "| change latency p50 / p99 / max over all {} probes | {:.2} / {:.2} / {:.2} ms |",
            self.all_ms.len(),
            self.pooled(0.5),
            self.pooled(0.99),
            self.pooled(1.0)
        );
        let _ = writeln!(md, "| background EndpointSlice changes achieved during probing | {} |", s_spread(&self.rate, "/s", 1.0, 0));
        let _ = writeln!(md, "| agent syncs per second during the stream (its /metrics) | {} |", s_spread(&self.syncs_per_s, "/s", 1.0, 0));
        let _ = writeln!(md, "| mean duration of those syncs (its /metrics) | {} |", s_spread(&self.sync_mean_s, "ms", 1e3, 2));
        let _ = writeln!(md, "| probes not visible within 5 s | {} |\n", self.lost);
        let _ = writeln!(
            md,
            "Change latency: {} probes per repeat, 20–60 ms apart, each replacing one endpoint address of Service `s0`; the time runs from just before the change is handed to the API server until the bench, reading the pinned maps itself (100 µs poll), sees `s0`'s entry switched to a generation whose slots hold the new address. Meanwhile a thread changes the other Services' slices at {}/s (each flips one endpoint's readiness, so each is a real map write). The rulesets are kube-proxy's shape (KUBE-SERVICES -> KUBE-SVC-* -> KUBE-SEP-*; nftables service-ips verdict map -> service chain -> endpoint chains), each loaded into a fresh namespace; kube-proxy would also write the filter table and, for nftables, more chains, so theirs are lower bounds. Map memory: the hash maps are preallocated at their capacity (`--max-services`, `--max-slots`, `--max-backends`), so it depends on those flags, not on the Services present.\n",
            o.probes, o.rate
        );
        md
    }

    pub(crate) fn json(&self) -> Value {
        let Some(o) = &self.opts else { return Value::Null };
        json!({
            "services": o.services,
            "endpoints_per_service": ENDPOINTS,
            "agent_flags": self.agent_flags,
            "cold_sync_seconds": self.cold_sync_s,
            "cold_sync_seconds_spread": spread(&self.cold_sync_s).json(),
            "phases_seconds": self.phases.iter().map(|p| json!({"datapath_installed": p.0, "listed": p.1, "first_sync": p.2})).collect::<Vec<_>>(),
            "rss_after_sync_bytes": self.rss_after_sync,
            "rss_peak_bytes": self.rss_peak,
            "map_memlock_bytes": self.map_memlock,
            "change_latency_ms": {"p50": spread(&self.p50_ms).json(), "p99": spread(&self.p99_ms).json(), "pooled_p50": self.pooled(0.5), "pooled_p99": self.pooled(0.99), "max": self.pooled(1.0), "samples": self.all_ms.len(), "lost": self.lost},
            "stream_events_per_second": self.rate,
            "agent_syncs_per_second": self.syncs_per_s,
            "agent_sync_mean_seconds": self.sync_mean_s,
            "rule_load_seconds": self.rules_s,
        })
    }

    /// Which agent was measured, for the report.
    fn agent_label(&self) -> String {
        match self.opts.as_ref().and_then(|o| o.agent.as_ref()) {
            Some(p) => format!("`{}`", p.display()),
            None => "the agent binary".into(),
        }
    }
}

/// The report of a `--only control-plane` run.
pub(crate) fn write_alone(out: &Path, r: &Results) -> Result<()> {
    let doc = json!({"control_plane": {"api_server": r.json()}});
    Ok(crate::report::write_part(out, "control plane", &r.markdown(), doc, &r.targets(), &[])?)
}
