//! The connection-disruption suite: steady traffic through one node while
//! the agent and its surroundings are broken in turn, counting failed
//! connects, broken established connections and lost or misrouted
//! datagrams per fault.
//!
//! Three isolated namespaces, no link to the host's:
//!
//! ```text
//!   client 10.0.1.1 (c-n) ---- (n-c) 10.0.1.2  node  10.244.1.1 (n-pod) ---- (eth0) pod 10.244.1.10, .11
//! ```
//!
//! The agent runs in the node namespace with the TC programs on `n-c`
//! (NodePort from the client) and the socket programs on a test cgroup,
//! whose processes in the pod namespace are the cluster's clients
//! (ClusterIP). Two backends (`pod-a`, `pod-b`) serve every Service: a
//! serve-hostname (TCP and UDP 8080) and a line-echo server (TCP 7000) each.
//! The stand-in API server listens on the node namespace's loopback
//! (Stand-in: injected faults, an outage then a compacted history, and
//! 1,000 EndpointSlice changes a second written directly).
//! Besides the two Services that carry traffic there are filler Services
//! that carry none: they give each sync work to be interrupted and they
//! are what the EndpointSlice churn changes, so that no fault removes a
//! backend an established flow uses (which would rightly end it).
//!
//! The faults, in turn: SIGKILL of the agent mid-sync (10 times), an
//! upgrade from the previous release's pin layout, an API server outage of
//! 30 s ending in a relist after 410 Gone, 1,000 EndpointSlice changes per
//! second for 10 s, a map filled beyond capacity, the manifest files
//! replaced by garbage and restored (after a switch to manifests mode), the
//! pinned maps deleted under the running agent, and a node address added
//! and removed. Every fault must cost zero failures. The table (fault,
//! attempts, failures) is printed and written to
//! `$TOPOPROXY_CONN_DISRUPT_REPORT` (default
//! `target/tmp/conn-disrupt.md`), which `cargo xtask bench` shows.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use aya::maps::MapInfo;
use proxy_agent::datapath::dump;
use proxy_agent::datapath::maps::MAPS;
use proxy_test_support::apiserver::ApiServer;
use proxy_test_support::http::{http_get, metric};
use proxy_test_support::sandbox::{Cgroup, Guarded, Netns, PinDir, command_in, echo_server, in_netns, spawn_backend};
use proxy_test_support::traffic::{self, Flow, Kind, Row, Snapshot, Traffic};
use serde_json::{Value, json};
use support::{TempDir, agent_bin, require_root};

const NODE: &str = "node-a";
const CLIENT_IP: &str = "10.0.1.1";
const NODE_IP: &str = "10.0.1.2";
/// The address fault 8 adds to the node's device and takes away again.
const NODE_IP2: &str = "10.0.1.3";
const POD_A: &str = "10.244.1.10";
const POD_B: &str = "10.244.1.11";
/// ClusterIP of `web`, reached from the pods.
const WEB: &str = "10.96.50.10";
/// ClusterIP of `edge`, the NodePort Service.
const EDGE: &str = "10.96.50.20";
const NODE_PORT_TCP: u16 = 30080;
const NODE_PORT_ECHO: u16 = 30700;
const NODE_PORT_UDP: u16 = 30053;
/// Services that carry no traffic (see the module comment).
const FILLERS: usize = 300;
/// `--max-services`: room for every frontend of the suite (the fillers,
/// `web`, `edge` and its NodePorts on the node's addresses) and not for
/// the extra Services of fault 5.
const MAX_SERVICES: u32 = 400;
/// Services fault 5 adds beyond what fits.
const EXTRA: usize = 150;
/// How long traffic runs after a fault before its window closes, so that
/// late effects count against it.
const SETTLE: Duration = Duration::from_millis(3500);
/// How long a connect or a reply may take before it counts as failed
/// (shorter than `SETTLE`, so a fault's failures fall in its window).
const TIMEOUT: Duration = Duration::from_secs(3);

// ---------------------------------------------------------------------------
// Objects
// ---------------------------------------------------------------------------

/// (port name, port, protocol, target port, node port)
type PortSpec = (&'static str, u16, &'static str, u16, Option<u16>);

const PORTS: [PortSpec; 3] = [
    ("http", 80, "TCP", 8080, Some(NODE_PORT_TCP)),
    ("echo", 7000, "TCP", 7000, Some(NODE_PORT_ECHO)),
    ("dns", 53, "UDP", 8080, Some(NODE_PORT_UDP)),
];

fn service(name: &str, ip: &str, ports: &[PortSpec], node_port: bool) -> Value {
    let ports: Vec<Value> = ports
        .iter()
        .map(|(n, p, proto, t, np)| {
            let mut v = json!({"name": n, "port": p, "protocol": proto, "targetPort": t});
            if node_port && let Some(np) = np {
                v["nodePort"] = json!(np);
            }
            v
        })
        .collect();
    let mut spec = json!({"type": "ClusterIP", "clusterIP": ip, "clusterIPs": [ip], "ports": ports});
    if node_port {
        spec["type"] = json!("NodePort");
        spec["externalTrafficPolicy"] = json!("Cluster");
    }
    json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": "default"}, "spec": spec})
}

/// An EndpointSlice of `svc` with endpoints (address, ready).
fn slice(svc: &str, ports: &[PortSpec], endpoints: &[(String, bool)]) -> Value {
    let ports: Vec<Value> = ports.iter().map(|(n, _, proto, t, _)| json!({"name": n, "port": t, "protocol": proto})).collect();
    let eps: Vec<Value> = endpoints
        .iter()
        .map(|(ip, ready)| json!({"addresses": [ip], "conditions": {"ready": ready, "serving": ready}, "nodeName": NODE}))
        .collect();
    json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": format!("{svc}-1"), "namespace": "default", "labels": {"kubernetes.io/service-name": svc}},
        "addressType": "IPv4",
        "ports": ports,
        "endpoints": eps,
    })
}

fn ready(ips: &[&str]) -> Vec<(String, bool)> {
    ips.iter().map(|ip| (ip.to_string(), true)).collect()
}

/// The backends that serve `web` and `edge`, plus (for the churn) a
/// not-ready endpoint that changes the slice but not what is programmed.
fn serving_slice(svc: &str, with_not_ready: bool) -> Value {
    let mut eps = ready(&[POD_A, POD_B]);
    if with_not_ready {
        eps.push(("10.244.1.99".to_string(), false));
    }
    slice(svc, &PORTS, &eps)
}

const FILLER_PORT: [PortSpec; 1] = [("http", 80, "TCP", 8080, None)];

fn filler_ip(i: usize) -> String {
    format!("10.96.{}.{}", 100 + i / 250, i % 250 + 1)
}

/// Filler `i`'s endpoints in version `v`: one or two of 250 addresses
/// that nothing listens on (no traffic goes there).
fn filler_endpoints(i: usize, v: usize) -> Vec<String> {
    let a = format!("10.244.9.{}", (i + v) % 250 + 1);
    if v.is_multiple_of(2) { vec![a] } else { vec![a, format!("10.244.9.{}", (i + v + 1) % 250 + 1)] }
}

fn filler_slice(i: usize, v: usize) -> Value {
    let eps: Vec<(String, bool)> = filler_endpoints(i, v).into_iter().map(|a| (a, true)).collect();
    slice(&format!("filler-{i}"), &FILLER_PORT, &eps)
}

fn extra_ip(i: usize) -> String {
    format!("10.96.120.{}", i + 1)
}

fn initial_objects() -> Vec<Value> {
    let mut objs = vec![
        json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE, "labels": {"kubernetes.io/hostname": NODE}}}),
        service("web", WEB, &PORTS, false),
        serving_slice("web", false),
        service("edge", EDGE, &PORTS, true),
        serving_slice("edge", false),
    ];
    for i in 0..FILLERS {
        objs.push(service(&format!("filler-{i}"), &filler_ip(i), &FILLER_PORT, false));
        objs.push(filler_slice(i, 0));
    }
    objs
}

// ---------------------------------------------------------------------------
// The world
// ---------------------------------------------------------------------------

#[derive(Clone, Copy, PartialEq, Eq)]
enum Source {
    Kube,
    Manifests,
}

struct World {
    client: Netns,
    node: Netns,
    pod: Netns,
    cgroup: Cgroup,
    pins: PinDir,
    dir: TempDir,
    api: Option<ApiServer>,
    api_addr: SocketAddr,
    source: Source,
    agent: Option<Guarded>,
    log: PathBuf,
    /// Where the running agent's part of the log starts.
    log_mark: usize,
    _backends: Vec<Guarded>,
}

impl World {
    fn new() -> World {
        require_root();
        let client = Netns::new("tcd").expect("client netns");
        let node = Netns::new("tcd").expect("node netns");
        let pod = Netns::new("tcd").expect("pod netns");
        node.veth("n-c", &client, "c-n").expect("veth client-node");
        node.veth("n-pod", &pod, "eth0").expect("veth node-pod");
        for (ns, cidr, dev) in [
            (&client, &*format!("{CLIENT_IP}/24"), "c-n"),
            (&node, &*format!("{NODE_IP}/24"), "n-c"),
            (&node, "10.244.1.1/24", "n-pod"),
            (&pod, &*format!("{POD_A}/24"), "eth0"),
            (&pod, &*format!("{POD_B}/24"), "eth0"),
        ] {
            ns.ip(&["addr", "add", cidr, "dev", dev]).unwrap_or_else(|e| panic!("{cidr} on {dev}: {e}"));
        }
        pod.ip(&["route", "add", "default", "via", "10.244.1.1"]).expect("pod route");
        node.sysctl("net.ipv4.ip_forward", "1").expect("ip_forward");
        let mut backends = Vec::new();
        for (name, ip) in [("pod-a", POD_A), ("pod-b", POD_B)] {
            backends.push(spawn_backend(&agent_bin(), &pod, name, &[format!("{ip}:8080")]).expect("backend"));
            echo_server(&pod, format!("{ip}:7000").parse().expect("address")).expect("echo server");
        }
        let dir = TempDir::new("tcd");
        fs::create_dir_all(dir.0.join("manifests")).expect("manifest dir");
        let log = dir.0.join("agent.log.txt");
        // The API server lives on the node namespace's loopback, where the
        // agent runs (the thread that starts it joins the namespace, and the
        // server's own thread inherits it).
        let api = in_netns(&node, || ApiServer::start_on("127.0.0.1:0".parse().expect("address"), 1, initial_objects()))
            .expect("API server in the node namespace");
        let api_addr = api.addr();
        api.write_kubeconfig(&dir.0.join("kubeconfig"));
        World {
            client,
            node,
            pod,
            cgroup: Cgroup::new("tcd").expect("cgroup"),
            pins: PinDir::new("tcd").expect("pin dir"),
            dir,
            api: Some(api),
            api_addr,
            source: Source::Kube,
            agent: None,
            log,
            log_mark: 0,
            _backends: backends,
        }
    }

    fn api(&self) -> &ApiServer {
        self.api.as_ref().expect("the API server is running")
    }

    fn manifests(&self) -> PathBuf {
        self.dir.0.join("manifests")
    }

    fn start_agent(&mut self) {
        let log = fs::OpenOptions::new().create(true).append(true).open(&self.log).expect("open log");
        self.log_mark = fs::metadata(&self.log).map_or(0, |m| usize::try_from(m.len()).unwrap_or(0));
        let mut cmd = command_in(agent_bin(), Some(&self.node), None).expect("agent command");
        cmd.args(["run", "--node", NODE, "--cgroup"])
            .arg(self.cgroup.path())
            .arg("--bpffs")
            .arg(self.pins.path())
            .args(["--devices", "n-c", "--healthz-bind-address", "127.0.0.1:0", "--metrics-bind-address", "127.0.0.1:0"])
            .args(["--max-services", &MAX_SERVICES.to_string()]);
        // A finer log for chasing a failure, e.g. `proxy_agent=debug,kube_runtime=debug`.
        if let Ok(level) = std::env::var("TOPOPROXY_TEST_AGENT_LOG") {
            cmd.args(["--log-level", &level]);
        }
        match self.source {
            Source::Kube => cmd.arg("--kubeconfig").arg(self.dir.0.join("kubeconfig")),
            Source::Manifests => cmd.arg("--manifests").arg(self.manifests()).args(["--poll-interval-ms", "50"]),
        };
        cmd.stdin(Stdio::null()).stdout(log.try_clone().expect("dup log")).stderr(log);
        self.agent = Some(Guarded::spawn(&mut cmd).expect("start agent"));
    }

    /// SIGTERM, as a rollout does.
    fn stop_agent(&mut self) {
        if let Some(mut a) = self.agent.take() {
            a.terminate(Duration::from_secs(10)).expect("stop agent");
        }
    }

    fn kill_agent(&mut self) {
        if let Some(mut a) = self.agent.take() {
            let _ = a.0.kill();
            let _ = a.0.wait();
        }
    }

    /// The running agent's part of the log.
    fn log(&self) -> String {
        let all = fs::read_to_string(&self.log).unwrap_or_default();
        all.get(self.log_mark..).unwrap_or_default().to_string()
    }

    /// The address the running agent logged under `key` (on the node
    /// namespace's loopback): `healthz_bind_address=` or
    /// `metrics_bind_address=`.
    fn logged_address(&self, key: &str) -> SocketAddr {
        wait_for(&format!("the agent to log its {key}"), Duration::from_secs(30), || {
            let log = self.log();
            log.rmatch_indices(key).next().and_then(|(i, _)| log[i + key.len()..].split_whitespace().next()?.parse().ok()).ok_or(())
        })
    }

    /// `path` on the listener that serves it: `/metrics` apart from the
    /// health endpoints, as kube-proxy serves them.
    fn get(&self, path: &'static str) -> Result<(u16, String), String> {
        let addr = self.logged_address(if path == "/metrics" { "metrics_bind_address=" } else { "healthz_bind_address=" });
        in_netns(&self.node, move || http_get(addr, path)).map_err(|e| e.to_string())?
    }

    fn metric(&self, series: &str) -> Option<f64> {
        self.get("/metrics").ok().and_then(|(_, body)| metric(&body, series))
    }

    /// Waits until the running agent has applied its first sync.
    fn wait_ready(&self) {
        wait_for("the agent to be ready (first sync applied)", Duration::from_mins(1), || match self.get("/readyz") {
            Ok((200, _)) => Ok(()),
            other => Err(other),
        });
    }

    /// What the pinned maps hold: frontend -> backends, both datapaths.
    fn programmed(&self) -> BTreeMap<String, BTreeSet<String>> {
        let snap = dump::read(self.pins.path()).expect("read the pinned maps");
        let report = dump::report(self.pins.path(), &snap);
        let mut out = BTreeMap::new();
        let tc = report.nodeport.iter().flat_map(|np| np.services.iter());
        for s in report.services.iter().chain(tc) {
            out.insert(s.frontend.clone(), s.slots.iter().filter_map(|sl| sl.backend.clone()).collect());
        }
        out
    }

    /// Findings of `proxy-agent dump`'s consistency check.
    fn findings(&self) -> Vec<String> {
        let snap = dump::read(self.pins.path()).expect("read the pinned maps");
        dump::report(self.pins.path(), &snap).findings.iter().map(|f| format!("{:?} {}: {}", f.severity, f.datapath, f.message)).collect()
    }

    /// Waits until every filler `i` is programmed with its endpoints of
    /// version `version_of(i)`.
    fn wait_fillers(&self, what: &str, limit: Duration, version_of: impl Fn(usize) -> usize) {
        wait_for(what, limit, || {
            let programmed = self.programmed();
            let wrong: Vec<String> = (0..FILLERS)
                .filter(|&i| {
                    let want: BTreeSet<String> = filler_endpoints(i, version_of(i)).into_iter().map(|a| format!("{a}:8080")).collect();
                    programmed.get(&format!("{}:80/TCP", filler_ip(i))) != Some(&want)
                })
                .map(|i| format!("filler-{i}"))
                .collect();
            if wrong.is_empty() { Ok(()) } else { Err(format!("{} fillers not (yet) as expected, e.g. {:?}", wrong.len(), &wrong[..1])) }
        });
    }

    /// Runs `proxy-agent probe ARGS` in `netns` (and `cgroup`) once and
    /// returns its lines.
    fn probe(netns: &Netns, cgroup: Option<&Cgroup>, args: &[&str]) -> Vec<Value> {
        let mut cmd = command_in(agent_bin(), Some(netns), cgroup).expect("probe command");
        cmd.arg("probe").args(args).stdin(Stdio::null()).stderr(Stdio::inherit());
        let out = cmd.output().expect("run probe");
        String::from_utf8_lossy(&out.stdout).lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
    }

    /// Writes the objects as manifest files, grouped by what they serve.
    fn write_manifests(&self, objects: &[Value]) {
        let mut files: BTreeMap<&str, Vec<Value>> = BTreeMap::new();
        for o in objects {
            let name = o["metadata"]["name"].as_str().unwrap_or_default();
            let file = if name.starts_with("filler-") {
                "fillers.json"
            } else if name.starts_with("web") {
                "web.json"
            } else if name.starts_with("edge") {
                "edge.json"
            } else {
                "node.json"
            };
            files.entry(file).or_default().push(o.clone());
        }
        for (file, items) in files {
            write_atomically(
                &self.manifests().join(file),
                json!({"apiVersion": "v1", "kind": "List", "items": items}).to_string().as_bytes(),
            );
        }
    }
}

impl Drop for World {
    fn drop(&mut self) {
        self.kill_agent();
        if std::thread::panicking() {
            let all = fs::read_to_string(&self.log).unwrap_or_default();
            // The whole log outlives the temporary directory, for a failure
            // that its last lines do not explain.
            let kept = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("conn-disrupt-agent-{}.log", std::process::id()));
            if fs::write(&kept, &all).is_ok() {
                eprintln!("the whole agent log is kept in {}", kept.display());
            }
            let tail: Vec<&str> = all.lines().rev().take(150).collect();
            eprintln!("--- last lines of the agent log ---");
            for l in tail.iter().rev() {
                eprintln!("{l}");
            }
        }
    }
}

fn write_atomically(path: &Path, bytes: &[u8]) {
    let tmp = path.with_file_name(format!(".{}.tmp", path.file_name().and_then(|n| n.to_str()).unwrap_or("x")));
    fs::write(&tmp, bytes).expect("write manifest");
    fs::rename(&tmp, path).expect("rename manifest");
}

/// Polls `check` until it returns `Ok`, for at most `limit`; panics with the
/// last observation. Waits for the agent to converge; asserts no speed.
fn wait_for<T, D: std::fmt::Debug>(what: &str, limit: Duration, mut check: impl FnMut() -> Result<T, D>) -> T {
    let deadline = Instant::now() + limit.max(proxy_test_support::wait::wait_limit());
    loop {
        match check() {
            Ok(v) => return v,
            Err(last) if Instant::now() > deadline => panic!("timed out waiting for {what}; last saw {last:?}"),
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

/// A small deterministic generator for the kill delays (a fixed seed, so a
/// failing run can be repeated).
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 33) % n.max(1)
    }
}

// ---------------------------------------------------------------------------
// Traffic
// ---------------------------------------------------------------------------

fn flows(w: &World) -> Vec<Flow> {
    let names: BTreeSet<String> = ["pod-a", "pod-b"].iter().map(|s| (*s).to_string()).collect();
    let echo: BTreeSet<String> = std::iter::once("echo ping".to_string()).collect();
    let addr = |ip: &str, port: u16| -> SocketAddr { format!("{ip}:{port}").parse().expect("address") };
    let mut out = Vec::new();
    for (path, netns, cgroup, ip, (http, echo_port, dns)) in [
        ("ClusterIP", w.pod.path(), Some(w.cgroup.path().to_path_buf()), WEB, (80, 7000, 53)),
        ("NodePort", w.client.path(), None, NODE_IP, (NODE_PORT_TCP, NODE_PORT_ECHO, NODE_PORT_UDP)),
    ] {
        let flow = |kind: Kind, to: SocketAddr, replies: &BTreeSet<String>, every_ms: u64| Flow {
            path: path.to_string(),
            kind,
            to,
            netns: netns.clone(),
            cgroup: cgroup.clone(),
            replies: replies.clone(),
            interval: Duration::from_millis(every_ms),
            timeout: TIMEOUT,
        };
        out.push(flow(Kind::TcpLongLived, addr(ip, echo_port), &echo, 100));
        out.push(flow(Kind::TcpLongLived, addr(ip, echo_port), &echo, 100));
        out.push(flow(Kind::TcpNew, addr(ip, http), &names, 50));
        out.push(flow(Kind::UdpConnectedLongLived, addr(ip, dns), &names, 100));
        out.push(flow(Kind::UdpUnconnectedLongLived, addr(ip, dns), &names, 100));
        out.push(flow(Kind::UdpConnectedNew, addr(ip, dns), &names, 200));
        out.push(flow(Kind::UdpUnconnectedNew, addr(ip, dns), &names, 200));
    }
    out
}

/// The rows of the table, and where the run started.
struct Suite {
    rows: Vec<Row>,
    origin: Instant,
}

impl Suite {
    /// Closes a fault's window: traffic runs `SETTLE` longer, then the
    /// window from `before` becomes a row.
    fn row(&mut self, traffic: &Traffic, fault: &str, before: &Snapshot, note: String) {
        std::thread::sleep(SETTLE);
        let window = traffic.snapshot().since(before);
        eprintln!("{fault}: {} attempts, {} failures ({:.1} s) {note}", window.attempts, window.failures, window.took.as_secs_f64());
        if window.failures > 0 {
            eprint!("{}", window.examples(self.origin, 10));
        }
        self.rows.push(Row { fault: fault.to_string(), window, note });
    }
}

// ---------------------------------------------------------------------------
// The suite
// ---------------------------------------------------------------------------

#[test]
fn connections_survive_every_fault() {
    let mut w = World::new();
    w.start_agent();
    w.wait_ready();
    // Everything answers before the traffic starts counting.
    for (ns, cg, to, udp) in [
        (&w.pod, Some(&w.cgroup), format!("{WEB}:80"), false),
        (&w.pod, Some(&w.cgroup), format!("{WEB}:53"), true),
        (&w.client, None, format!("{NODE_IP}:{NODE_PORT_TCP}"), false),
        (&w.client, None, format!("{NODE_IP}:{NODE_PORT_UDP}"), true),
    ] {
        wait_for(&format!("{to} to answer"), Duration::from_secs(30), || {
            let mut args = vec!["--to", to.as_str(), "--count", "4", "--timeout-ms", "1000"];
            if udp {
                args.push("--udp");
            }
            let r = World::probe(ns, cg, &args);
            if !r.is_empty() && r.iter().all(|x| x["ok"] == true) { Ok(()) } else { Err(r) }
        });
    }
    let baseline_frontends = w.programmed().len();

    let traffic = Traffic::start(&agent_bin(), flows(&w));
    let mut suite = Suite { rows: Vec::new(), origin: Instant::now() };
    let start = traffic.snapshot();
    std::thread::sleep(Duration::from_secs(3));
    suite.row(&traffic, "none (baseline)", &start, format!("{} flows, {baseline_frontends} frontends programmed", flows(&w).len()));

    kill_mid_sync(&mut w, &traffic, &mut suite);
    upgrade_from_previous_layout(&mut w, &traffic, &mut suite);
    api_server_outage(&mut w, &traffic, &mut suite);
    slice_churn(&w, &traffic, &mut suite);
    map_full(&w, &traffic, &mut suite, baseline_frontends);
    switch_to_manifests(&mut w, &traffic, &mut suite);
    garbage_manifests(&w, &traffic, &mut suite);
    pins_deleted(&mut w, &traffic, &mut suite);
    node_address_change(&w, &traffic, &mut suite);

    let end = traffic.stop();
    let table = traffic::table(&suite.rows);
    let report = format!(
        "# Connection disruption\n\nSteady traffic through one node ({} flows: ClusterIP and NodePort; TCP long-lived and new; UDP connected and unconnected, long-lived and new sockets) while each fault is applied in turn. Failures are failed connects, broken established connections, and lost or misrouted datagrams.\n\n{table}",
        flows(&w).len()
    );
    println!("\n{report}");
    write_report(&report);
    let failed: Vec<&Row> = suite.rows.iter().filter(|r| r.window.failures > 0).collect();
    let idle: Vec<(&str, Vec<&str>)> =
        suite.rows.iter().map(|r| (r.fault.as_str(), r.window.idle_flows())).filter(|(_, i)| !i.is_empty()).collect();
    let everything = end.since(&start);
    assert!(
        failed.is_empty(),
        "{table}\nfailures:\n{}",
        failed.iter().map(|r| format!("{}:\n{}", r.fault, r.window.examples(suite.origin, 10))).collect::<String>()
    );
    assert!(idle.is_empty(), "{table}\nflows without a single attempt during a fault: {idle:?}");
    assert!(everything.attempts > 10_000, "the traffic made only {} attempts: {table}", everything.attempts);
}

fn write_report(report: &str) {
    let path = std::env::var_os("TOPOPROXY_CONN_DISRUPT_REPORT")
        .map_or_else(|| Path::new(env!("CARGO_TARGET_TMPDIR")).join("conn-disrupt.md"), PathBuf::from);
    if let Some(parent) = path.parent() {
        let _ = fs::create_dir_all(parent);
    }
    match fs::write(&path, report) {
        Ok(()) => println!("table written to {}", path.display()),
        Err(e) => println!("cannot write the table to {}: {e}", path.display()),
    }
}

/// Kills of fault 1.
const KILLS: usize = 10;

/// The filler version of fault 1's change before kill `round` (the
/// measuring change is 1).
fn kill_version(round: usize) -> usize {
    round + 1
}

/// How many fillers the pinned maps hold at version `v`.
fn fillers_at(w: &World, v: usize) -> usize {
    let programmed = w.programmed();
    (0..FILLERS)
        .filter(|&i| {
            let want: BTreeSet<String> = filler_endpoints(i, v).into_iter().map(|a| format!("{a}:8080")).collect();
            programmed.get(&format!("{}:80/TCP", filler_ip(i))) == Some(&want)
        })
        .count()
}

/// Fault 1: SIGKILL, ten times. Odd kills land in a restart (install,
/// list, first sync), at a moment drawn over how long a restart takes;
/// even ones land after a change of every filler was published, at a
/// moment drawn over how long writing it takes. After each kill the pinned
/// maps show whether it interrupted the change (some fillers written, not
/// all) and a frontend's write (leftovers `dump` reports: slots of an old
/// generation, backends nothing uses); a new agent starts at once, as the
/// DaemonSet's pod restarts.
fn kill_mid_sync(w: &mut World, traffic: &Traffic, suite: &mut Suite) {
    let before = traffic.snapshot();
    // How long a restart and a change of every filler take here.
    w.stop_agent();
    let t = Instant::now();
    w.start_agent();
    w.wait_ready();
    let restart_ms = u64::try_from(t.elapsed().as_millis()).unwrap_or(u64::MAX);
    let t = Instant::now();
    w.api().apply_all((0..FILLERS).map(|i| filler_slice(i, 1)).collect());
    w.wait_fillers("the measuring change", Duration::from_secs(30), |_| 1);
    let change_ms = u64::try_from(t.elapsed().as_millis()).unwrap_or(u64::MAX);

    let mut rng = Lcg(0x5eed);
    let (mut in_restart, mut mid_change, mut mid_write) = (0, 0, 0);
    for round in 1..=KILLS {
        let v = kill_version(round);
        let restarting = round % 2 == 1;
        if restarting {
            w.api().apply_all((0..FILLERS).map(|i| filler_slice(i, v)).collect());
            w.stop_agent();
            w.start_agent();
            std::thread::sleep(Duration::from_millis(rng.below(restart_ms)));
        } else {
            w.wait_ready();
            w.api().apply_all((0..FILLERS).map(|i| filler_slice(i, v)).collect());
            std::thread::sleep(Duration::from_millis(rng.below(change_ms)));
        }
        let started = w.log().contains("first sync applied");
        w.kill_agent();
        if restarting && !started {
            in_restart += 1;
        }
        let written = fillers_at(w, v);
        if written > 0 && written < FILLERS {
            mid_change += 1;
        }
        if !w.findings().is_empty() {
            mid_write += 1;
        }
        w.start_agent();
    }
    w.wait_ready();
    w.wait_fillers("the last change after the kills", Duration::from_mins(1), |_| kill_version(KILLS));
    let findings = w.findings();
    assert!(findings.is_empty(), "the maps after {KILLS} kills and a restart: {findings:?}");
    let note = format!(
        "{KILLS} kills: {in_restart} during a restart (takes ~{restart_ms} ms), {mid_change} with a change of all {FILLERS} fillers half applied (~{change_ms} ms), {mid_write} inside a frontend's write (dump found its leftovers; the next agent removed them); maps consistent"
    );
    suite.row(traffic, "1. SIGKILL mid-sync (x10)", &before, note);
}

/// Fault 2: an upgrade from the previous release's pins: its layout had no
/// session affinity, source range or node namespace maps, 8 socket and 16
/// TC counters, and maps created without BTF. The agent stops (SIGTERM),
/// the pins are made to look like that, and the new agent adopts them.
fn upgrade_from_previous_layout(w: &mut World, traffic: &Traffic, suite: &mut Suite) {
    use proxy_common as pc;
    let before = traffic.snapshot();
    w.stop_agent();
    let pins = w.pins.path().to_path_buf();
    for map in [
        pc::NODE_NETNS_MAP,
        pc::AFFINITY_MAP,
        pc::AFFINITY_MATCH_MAP,
        pc::SOURCE_RANGES_MAP,
        pc::NP_AFFINITY_MAP,
        pc::NP_AFFINITY_MATCH_MAP,
        pc::NP_SOURCE_RANGES_MAP,
    ] {
        fs::remove_file(pins.join(map)).unwrap_or_else(|e| panic!("remove {map}: {e}"));
    }
    // The running programs keep their own counter arrays; the pins get
    // the old sizes, as `bpftool` (no BTF) makes them.
    for (map, entries) in [(pc::COUNTERS_MAP, 8), (pc::NP_COUNTERS_MAP, 16)] {
        let path = pins.join(map);
        fs::remove_file(&path).unwrap_or_else(|e| panic!("remove {map}: {e}"));
        let out = std::process::Command::new("bpftool")
            .args(["map", "create"])
            .arg(&path)
            .args(["type", "percpu_array", "key", "4", "value", "8", "entries", &entries.to_string(), "name", map])
            .output()
            .expect("run bpftool");
        assert!(out.status.success(), "bpftool map create {map}: {}", String::from_utf8_lossy(&out.stderr));
    }
    w.start_agent();
    w.wait_ready();
    let log = w.log();
    // The socket hooks' counter array grows with new reasons: an older
    // build's is recreated at this build's size, its counts carried over
    // (map_migration::plan).
    assert!(log.contains("map COUNTERS resized from 8 to"), "the old counter array is migrated and reported: {log}");
    for m in MAPS {
        assert!(pins.join(m.name).exists(), "{} is pinned after the upgrade", m.name);
    }
    suite.row(
        traffic,
        "2. upgrade from the previous pin layout",
        &before,
        "7 maps the old layout lacks created, the old socket counter array (8) migrated to this build's size, the NodePort one (16) adopted".to_string(),
    );
}

/// Fault 3: the API server is gone for 30 s (connections refused); it comes
/// back with its history compacted past every version the agent saw, so
/// the watches get 410 Gone and the agent relists. A change made during the
/// outage must arrive.
fn api_server_outage(w: &mut World, traffic: &Traffic, suite: &mut Suite) {
    let before = traffic.snapshot();
    let expired_before = w.metric("topoproxy_errors_total{reason=\"watch_expired\"}").unwrap_or(0.0);
    let api = w.api.take().expect("API server");
    let rv = api.resource_version();
    let mut objects = api.objects();
    api.stop();
    let outage = Instant::now();
    while outage.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_secs(5));
        let (code, body) = w.get("/readyz").expect("readyz during the outage");
        assert_eq!(code, 200, "an agent that synced once stays ready while the API server is away: {body}");
    }
    // Meanwhile filler-0 moved.
    for o in &mut objects {
        if o["kind"] == "EndpointSlice" && o["metadata"]["name"] == "filler-0-1" {
            *o = filler_slice(0, kill_version(KILLS) + 1);
        }
    }
    let addr = w.api_addr;
    w.api = Some(in_netns(&w.node, move || ApiServer::start_on(addr, rv + 1000, objects)).expect("API server back"));
    let back = Instant::now();
    w.wait_fillers("the change made during the outage", Duration::from_mins(2), |i| kill_version(KILLS) + usize::from(i == 0));
    let converged = back.elapsed();
    let expired = w.metric("topoproxy_errors_total{reason=\"watch_expired\"}").unwrap_or(0.0) - expired_before;
    assert!(expired >= 1.0, "the watches must have been told 410 Gone: {}", w.log());
    suite.row(
        traffic,
        "3. API server outage 30 s, then 410 Gone",
        &before,
        format!("{expired} watches expired and relisted; converged {:.1} s after the API server returned", converged.as_secs_f64()),
    );
}

/// Fault 4: 1,000 EndpointSlice changes per second for 10 s: the fillers'
/// endpoints (no traffic) and, every tenth change, the serving slices
/// (a not-ready endpoint in and out: what is programmed stays).
fn slice_churn(w: &World, traffic: &Traffic, suite: &mut Suite) {
    let before = traffic.snapshot();
    let api = w.api();
    // Where the earlier faults left the fillers.
    let mut version: Vec<usize> = (0..FILLERS).map(|i| kill_version(KILLS) + usize::from(i == 0)).collect();
    let started = Instant::now();
    let mut changes = 0usize;
    for tick in 0..1000usize {
        let mut batch = Vec::with_capacity(10);
        for k in 0..10 {
            let n = tick * 10 + k;
            if n % 10 == 0 {
                let svc = if n % 20 == 0 { "web" } else { "edge" };
                batch.push(serving_slice(svc, n % 40 < 20));
            } else {
                let i = n % FILLERS;
                version[i] += 1;
                batch.push(filler_slice(i, version[i]));
            }
        }
        changes += batch.len();
        api.apply_all(batch);
        // 10 changes every 10 ms, on schedule.
        let due = started + Duration::from_millis(10 * (tick as u64 + 1));
        std::thread::sleep(due.saturating_duration_since(Instant::now()));
    }
    let took = started.elapsed();
    // The serving slices end as they began.
    api.apply_all(vec![serving_slice("web", false), serving_slice("edge", false)]);
    w.wait_fillers("the last churned endpoints", Duration::from_mins(1), |i| version[i]);
    suite.row(
        traffic,
        "4. 1,000 EndpointSlice changes/s for 10 s",
        &before,
        format!("{changes} changes in {:.1} s; every filler converged to its last version", took.as_secs_f64()),
    );
}

/// Fault 5: more Services than `--max-services` holds.
fn map_full(w: &World, traffic: &Traffic, suite: &mut Suite, baseline: usize) {
    let before = traffic.snapshot();
    let full_before = w.metric("topoproxy_errors_total{reason=\"map_full\"}").unwrap_or(0.0);
    let mut objs = Vec::new();
    for i in 0..EXTRA {
        let name = format!("extra-{i}");
        objs.push(service(&name, &extra_ip(i), &FILLER_PORT, false));
        // Addresses nothing listens on: removing these Services later must
        // not touch a backend that carries traffic.
        objs.push(slice(&name, &FILLER_PORT, &[(format!("10.244.8.{}", i + 1), true)]));
    }
    w.api().apply_all(objs);
    wait_for("the full map to be reported", Duration::from_secs(30), || {
        let full = w.metric("topoproxy_errors_total{reason=\"map_full\"}").unwrap_or(0.0) - full_before;
        if full >= 1.0 { Ok(()) } else { Err(full) }
    });
    let log = w.log();
    assert!(log.contains("map SERVICES is full") && log.contains("raise --max-services"), "a clear error: {log}");
    let programmed = w.programmed();
    let extras = (0..EXTRA).filter(|&i| programmed.contains_key(&format!("{}:80/TCP", extra_ip(i)))).count();
    assert!(extras < EXTRA, "not every extra Service fits into {MAX_SERVICES} entries");
    let findings = w.findings();
    assert!(findings.is_empty(), "every frontend is written completely or not at all: {findings:?}");
    for i in 0..EXTRA {
        let name = format!("extra-{i}");
        w.api().delete("Service", "default", &name);
        w.api().delete("EndpointSlice", "default", &format!("{name}-1"));
    }
    wait_for("the extra Services to go", Duration::from_secs(30), || {
        let n = w.programmed().len();
        if n == baseline { Ok(()) } else { Err(n) }
    });
    suite.row(
        traffic,
        "5. map filled beyond --max-services",
        &before,
        format!("{EXTRA} extra Services, {extras} fitted, {} reported (\"map SERVICES is full ... raise --max-services\")", EXTRA - extras),
    );
}

/// Between faults 5 and 6: the agent restarts in manifests mode on the same
/// objects (written out as files) and pins.
fn switch_to_manifests(w: &mut World, traffic: &Traffic, suite: &mut Suite) {
    let before = traffic.snapshot();
    w.write_manifests(&w.api().objects());
    let programmed = count_socket_frontends(w);
    w.stop_agent();
    w.source = Source::Manifests;
    w.start_agent();
    w.wait_ready();
    let log = w.log();
    assert!(log.contains(&format!("adopted_frontends={programmed}")), "{log}");
    suite.row(traffic, "(restart: API server -> manifests)", &before, "same objects from files; the maps are adopted".to_string());
}

/// Socket frontends (the `adopted_frontends` the agent logs) among the
/// programmed ones, which include the TC datapath's.
fn count_socket_frontends(w: &World) -> usize {
    let snap = dump::read(w.pins.path()).expect("read the pinned maps");
    dump::report(w.pins.path(), &snap).services.len()
}

/// Fault 6: every manifest file replaced by garbage (atomically, as an
/// editor or a broken deploy would), plus a garbage file more; then the
/// files come back with a change.
fn garbage_manifests(w: &World, traffic: &Traffic, suite: &mut Suite) {
    let before = traffic.snapshot();
    let last = last_versions(w);
    let errors_before = w.metric("topoproxy_errors_total{reason=\"manifest\"}").unwrap_or(0.0);
    let dir = w.manifests();
    let mut files: Vec<PathBuf> = fs::read_dir(&dir)
        .expect("manifest dir")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    let saved: Vec<(PathBuf, Vec<u8>)> = files.iter().map(|f| (f.clone(), fs::read(f).expect("read manifest"))).collect();
    let garbage: [&[u8]; 4] = [
        b"{\"apiVersion\": \"v1\", \"kind\": \"List\", \"items\": [{\"kind\": \"Serv",
        b"kind: [this is not yaml\n",
        b"\xff\xfe\x00garbage\x00",
        b"::: {{{ ]]]\n",
    ];
    for (i, f) in files.iter().enumerate() {
        write_atomically(f, garbage[i % garbage.len()]);
    }
    write_atomically(&dir.join("zz-garbage.yaml"), b"- - - : : :\n\t\x01");
    wait_for("every garbage file to be reported", Duration::from_secs(30), || {
        let log = w.log();
        let missing: Vec<String> = files
            .iter()
            .chain(std::iter::once(&dir.join("zz-garbage.yaml")))
            .map(|f| f.display().to_string())
            .filter(|f| !log.contains(f.as_str()))
            .collect();
        if missing.is_empty() { Ok(()) } else { Err(missing) }
    });
    // Several polls with garbage in place.
    std::thread::sleep(Duration::from_secs(2));
    let errors = w.metric("topoproxy_errors_total{reason=\"manifest\"}").unwrap_or(0.0) - errors_before;
    // Restored, with filler-1 moved.
    for (f, bytes) in &saved {
        let mut bytes = bytes.clone();
        if f.ends_with("fillers.json") {
            let mut v: Value = serde_json::from_slice(&bytes).expect("saved fillers");
            for item in v["items"].as_array_mut().into_iter().flatten() {
                if item["kind"] == "EndpointSlice" && item["metadata"]["name"] == "filler-1-1" {
                    *item = filler_slice(1, last[1] + 1);
                }
            }
            bytes = v.to_string().into_bytes();
        }
        write_atomically(f, &bytes);
    }
    fs::remove_file(dir.join("zz-garbage.yaml")).expect("remove the garbage file");
    w.wait_fillers("the restored manifests with their change", Duration::from_secs(30), |i| last[i] + usize::from(i == 1));
    suite.row(
        traffic,
        "6. manifest files replaced by garbage, then restored",
        &before,
        format!("{} files garbage for ~3 s, {errors} read errors reported; the datapath kept its state", files.len() + 1),
    );
}

/// The filler versions as programmed now (after the churn each filler is
/// at its own version).
fn last_versions(w: &World) -> Vec<usize> {
    let programmed = w.programmed();
    (0..FILLERS)
        .map(|i| {
            let got = programmed.get(&format!("{}:80/TCP", filler_ip(i)));
            (0..200)
                .find(|&v| {
                    let want: BTreeSet<String> = filler_endpoints(i, v).into_iter().map(|a| format!("{a}:8080")).collect();
                    got == Some(&want)
                })
                .unwrap_or(0)
        })
        .collect()
}

/// Fault 7: every map pin deleted under the running agent. It must pin the
/// same maps again (the programs never stopped using them), so that the
/// next agent adopts them instead of starting empty.
fn pins_deleted(w: &mut World, traffic: &Traffic, suite: &mut Suite) {
    let before = traffic.snapshot();
    let pins = w.pins.path().to_path_buf();
    let ids: BTreeMap<&str, u32> = MAPS.iter().map(|m| (m.name, MapInfo::from_pin(pins.join(m.name)).expect("pinned map").id())).collect();
    for m in MAPS {
        fs::remove_file(pins.join(m.name)).unwrap_or_else(|e| panic!("remove {}: {e}", m.name));
    }
    let deleted = Instant::now();
    wait_for("the agent to pin its maps again", Duration::from_secs(30), || {
        let wrong: Vec<String> = MAPS
            .iter()
            .filter(|m| MapInfo::from_pin(pins.join(m.name)).map(|i| i.id()).ok() != ids.get(m.name).copied())
            .map(|m| m.name.to_string())
            .collect();
        if wrong.is_empty() { Ok(()) } else { Err(wrong) }
    });
    let restored_after = deleted.elapsed();
    let log = w.log();
    assert!(log.contains("pinned map was removed under the running agent; pinned it again"), "{log}");
    // The proof that matters: a restart adopts everything.
    let programmed = count_socket_frontends(w);
    w.stop_agent();
    w.start_agent();
    w.wait_ready();
    let log = w.log();
    assert!(log.contains(&format!("adopted_frontends={programmed}")), "{log}");
    suite.row(
        traffic,
        "7. pinned maps deleted under the running agent",
        &before,
        format!(
            "{} map pins deleted; the same maps pinned again after {:.1} s; a restart then adopted every frontend",
            MAPS.len(),
            restored_after.as_secs_f64()
        ),
    );
}

/// Fault 8: an address added to the node's device and removed again: its
/// NodePorts come and go; nothing else moves.
fn node_address_change(w: &World, traffic: &Traffic, suite: &mut Suite) {
    let before = traffic.snapshot();
    w.node.ip(&["addr", "add", &format!("{NODE_IP2}/24"), "dev", "n-c"]).expect("add node address");
    let to = format!("{NODE_IP2}:{NODE_PORT_TCP}");
    let added = Instant::now();
    wait_for("the new node address's NodePort to answer", Duration::from_secs(30), || {
        let r = World::probe(&w.client, None, &["--to", &to, "--count", "3", "--timeout-ms", "1000"]);
        if !r.is_empty() && r.iter().all(|x| x["ok"] == true) { Ok(()) } else { Err(r) }
    });
    let served_after = added.elapsed();
    let r = World::probe(&w.client, None, &["--to", &to, "--count", "20", "--timeout-ms", "5000"]);
    let ok = r.iter().filter(|x| x["ok"] == true).count();
    assert_eq!(ok, 20, "{r:?}");
    w.node.ip(&["addr", "del", &format!("{NODE_IP2}/24"), "dev", "n-c"]).expect("remove node address");
    wait_for("the removed address's NodePorts to go", Duration::from_secs(30), || {
        let left: Vec<String> = w.programmed().into_keys().filter(|f| f.starts_with(NODE_IP2)).collect();
        if left.is_empty() { Ok(()) } else { Err(left) }
    });
    suite.row(
        traffic,
        "8. node address added, then removed",
        &before,
        format!(
            "{NODE_IP2} served {:.1} s after it appeared ({ok}/20 new connections); its NodePorts gone after removal",
            served_after.as_secs_f64()
        ),
    );
}

/// The socket programs' link pins deleted under a running agent: that
/// detaches the programs (connections to Services fail meanwhile, unlike
/// a map pin's removal); the agent installs them again on the same maps.
#[test]
fn removed_link_pins_are_installed_again() {
    use proxy_agent::datapath::socket_loader::PROGRAMS;
    use support::{Node, PodNetwork, ServiceSpec, wait_for_backends};

    let mut net = PodNetwork::new();
    net.backend("pod-1", "10.244.2.1", &[8080]);
    let mut node = Node::new("node-a");
    node.write_manifest(
        "web.yaml",
        &ServiceSpec {
            name: "web",
            cluster_ips: &["10.96.2.10"],
            ports: &[("", 80, "TCP", 8080)],
            endpoints: &[("10.244.2.1", true, "node-a")],
            extra_spec: "",
            annotations: "",
        }
        .yaml(),
    );
    node.start_agent();
    wait_for_backends(&node, &net, "10.96.2.10:80", &[], &["pod-1"]);
    let link = |p: &str| proxy_agent::datapath::pins::socket_link(node.pins.path(), p);
    for p in PROGRAMS {
        fs::remove_file(link(p)).unwrap_or_else(|e| panic!("remove link {p}: {e}"));
    }
    // The guard notices within its poll interval; traffic never depended
    // on the pins (the agent holds every link open), so wait for the pins
    // themselves, then check that traffic still flows.
    proxy_test_support::wait::eventually("every link pinned again", || {
        let missing: Vec<&str> = PROGRAMS.iter().copied().filter(|p| !link(p).exists()).collect();
        if missing.is_empty() { Ok(()) } else { Err(missing) }
    });
    wait_for_backends(&node, &net, "10.96.2.10:80", &[], &["pod-1"]);
    assert!(node.agent_log().contains("link pins were removed"), "{}", node.agent_log());
}
