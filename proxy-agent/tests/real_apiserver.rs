//! The agent against a real control plane: etcd, kube-apiserver and
//! kube-controller-manager at the release pinned in tools/k8s/go.mod
//! (`proxy_test_support::real_cluster`, built by `cargo xtask k8s`). Unlike
//! kube_agent.rs, whose stand-in API server serves the EndpointSlices the
//! test writes, here the real EndpointSlice controller derives them from
//! Pods and Nodes, and the agent watches the real API server over TLS.
//!
//! Pods have no kubelet: each is created bound to its Node and its status
//! (IP, readiness) is written as a kubelet would. Their addresses live on
//! the loopback of the test's isolated pod namespace, where a backend
//! answers with the Pod's name, so a connect that is not translated has no
//! route and nothing leaves the machine. Clients are `proxy-agent probe`
//! processes in the simulated node's cgroup; long-lived ones (`--stream`)
//! are read line by line, each line stamped as it arrives, and the
//! controller's slice updates are followed with `kubectl get --watch`,
//! stamped the same way, so a deadline runs from the update that caused it.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufReader, Read, Write};
use std::net::{IpAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use proxy_test_support::http::{http_get, metric};
use proxy_test_support::real_cluster::{PodSpec, RealCluster};
use proxy_test_support::relay::Relay;
use proxy_test_support::sandbox::{Guarded, Netns, in_netns, spawn_backend};
use proxy_test_support::wait::{eventually, wait_limit};
use serde_json::{Value, json};
use support::*;

const ZONE: &str = "topology.kubernetes.io/zone";
const POOL: &str = "apps.openyurt.io/nodepool";
const NS: &str = "default";

const WEB: &str = "\
apiVersion: v1
kind: Service
metadata: {name: web, namespace: default}
spec:
  clusterIP: 10.96.30.10
  selector: {app: web}
  ports: [{name: http, port: 80, protocol: TCP, targetPort: 8080}]
";

/// (address, nodeName, zone, ready) of every endpoint of the slices.
fn endpoints(slices: &Value) -> BTreeSet<(String, String, String, bool)> {
    let s = |v: &Value| v.as_str().unwrap_or_default().to_string();
    slices["items"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|slice| slice["endpoints"].as_array().cloned().unwrap_or_default())
        .map(|e| (s(&e["addresses"][0]), s(&e["nodeName"]), s(&e["zone"]), e["conditions"]["ready"] == true))
        .collect()
}

/// Ready Pods with `labels`, one per `(name, node, ip)`.
fn ready_pods<'a>(labels: &'a [(&'a str, &'a str)], pods: &'a [(&'a str, &'a str, &'a str)]) -> Vec<PodSpec<'a>> {
    pods.iter().map(|&(name, node, ip)| PodSpec { name, node, ip, labels, ready: true }).collect()
}
#[test]
fn the_real_controllers_endpoint_slices_program_the_datapath_and_zone_topology() {
    require_root();
    let mut net = PodNetwork::new();
    net.backend("web-1", "10.244.30.1", &[8080]);
    net.backend("web-2", "10.244.30.2", &[8080]);
    let cluster = RealCluster::start("zone-topology").expect("start etcd, kube-apiserver and kube-controller-manager");
    cluster.create_node("node-1", &[(ZONE, "z1")]).expect("create node-1");
    cluster.create_node("node-2", &[(ZONE, "z2")]).expect("create node-2");
    cluster.apply(WEB).expect("create Service web");
    cluster.create_pod("default", "web-1", "node-1", "10.244.30.1", &[("app", "web")], true).expect("create pod web-1");
    cluster.create_pod("default", "web-2", "node-2", "10.244.30.2", &[("app", "web")], true).expect("create pod web-2");

    // The EndpointSlice controller publishes both Pods, ready, with their
    // Node and its zone.
    let want: BTreeSet<_> = [("10.244.30.1", "node-1", "z1"), ("10.244.30.2", "node-2", "z2")]
        .iter()
        .map(|(a, n, z)| ((*a).to_string(), (*n).to_string(), (*z).to_string(), true))
        .collect();
    eventually("the EndpointSlice controller to publish web-1 and web-2", || {
        let got = endpoints(&cluster.endpoint_slices("default", "web").expect("list EndpointSlices"));
        if got == want { Ok(()) } else { Err(got) }
    });

    // The agent of node-1 programs both for its pods.
    let mut node = Node::new("node-1");
    node.start_kube_agent(cluster.admin_kubeconfig(), &[]);
    wait_for_backends(&node, &net, "10.96.30.10:80", &[], &["web-1", "web-2"]);

    // Zone first, then anywhere: node-1 (z1) keeps to web-1.
    cluster
        .kubectl(&["-n", "default", "annotate", "service", "web", "topoproxy.io/topology-keys=topology.kubernetes.io/zone, *"])
        .expect("annotate Service web");
    wait_for_backends(&node, &net, "10.96.30.10:80", &[], &["web-1"]);
}

// ---------------------------------------------------------------------------
// Helpers: pods' servers, long-lived clients, the controller's slice updates,
// the programmed state.
// ---------------------------------------------------------------------------

/// Pods' backends in the pod namespace, served by one thread of the test:
/// on each Pod's address a TCP server that answers each line (and a
/// request ended by a half-close, as a one-shot probe sends it) with the
/// Pod's name and keeps the connection, and a UDP server that answers each
/// datagram with it. Many Pods cost one thread. Stopped on drop.
struct PodServers {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl PodServers {
    /// Serves `(name, address)` on `tcp_port` and `udp_port`; the addresses
    /// must be local in `netns` (a prefix on its loopback makes all of them
    /// local).
    fn start(netns: &Netns, pods: &[(String, String)], tcp_port: u16, udp_port: u16) -> PodServers {
        let pods: Vec<(String, IpAddr)> = pods.iter().map(|(n, ip)| (n.clone(), ip.parse().expect("pod address"))).collect();
        let sockets = in_netns(netns, move || -> std::io::Result<Vec<(String, TcpListener, UdpSocket)>> {
            pods.into_iter()
                .map(|(name, ip)| {
                    let l = TcpListener::bind((ip, tcp_port))?;
                    l.set_nonblocking(true)?;
                    let u = UdpSocket::bind((ip, udp_port))?;
                    u.set_nonblocking(true)?;
                    Ok((name, l, u))
                })
                .collect()
        })
        .expect("enter the pod namespace")
        .expect("bind the pods' servers");
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || serve_pods(&sockets, &flag));
        PodServers { stop, thread: Some(thread) }
    }
}

impl Drop for PodServers {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// `(name, address)` pairs as [`PodServers::start`] takes them.
fn named(pods: &[(&str, &str)]) -> Vec<(String, String)> {
    pods.iter().map(|(n, a)| ((*n).to_string(), (*a).to_string())).collect()
}

/// One accepted connection of [`serve_pods`].
struct Conn {
    pod: usize,
    stream: TcpStream,
    /// Bytes after the last newline (a request not ended by one yet).
    partial: bool,
    answered: bool,
}

fn serve_pods(sockets: &[(String, TcpListener, UdpSocket)], stop: &AtomicBool) {
    let mut conns: Vec<Conn> = Vec::new();
    let mut buf = [0u8; 4096];
    while !stop.load(Ordering::Relaxed) {
        let mut fds: Vec<libc::pollfd> = sockets
            .iter()
            .flat_map(|(_, l, u)| [l.as_raw_fd(), u.as_raw_fd()])
            .chain(conns.iter().map(|c| c.stream.as_raw_fd()))
            .map(|fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 })
            .collect();
        // SAFETY: poll(2) on an array of descriptors this thread owns.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 50) };
        if n <= 0 {
            continue;
        }
        let base = 2 * sockets.len();
        let mut closed = Vec::new();
        for (j, c) in conns.iter_mut().enumerate() {
            if fds[base + j].revents == 0 {
                continue;
            }
            let reply = format!("{}\n", sockets[c.pod].0);
            loop {
                match c.stream.read(&mut buf) {
                    Ok(0) => {
                        // The client half-closed: answer a request it did
                        // not end with a newline, then close.
                        if c.partial || !c.answered {
                            let _ = c.stream.write_all(reply.as_bytes());
                        }
                        closed.push(j);
                        break;
                    }
                    Ok(n) => {
                        for _ in 0..memchr::memchr_iter(b'\n', &buf[..n]).count() {
                            let _ = c.stream.write_all(reply.as_bytes());
                            c.answered = true;
                        }
                        c.partial = buf[n - 1] != b'\n';
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(_) => {
                        closed.push(j);
                        break;
                    }
                }
            }
        }
        for j in closed.into_iter().rev() {
            conns.swap_remove(j);
        }
        for (i, (name, l, u)) in sockets.iter().enumerate() {
            if fds[2 * i].revents != 0 {
                while let Ok((s, _)) = l.accept() {
                    if s.set_nonblocking(true).is_ok() {
                        conns.push(Conn { pod: i, stream: s, partial: false, answered: false });
                    }
                }
            }
            if fds[2 * i + 1].revents != 0 {
                while let Ok((_, from)) = u.recv_from(&mut buf) {
                    let _ = u.send_to(name.as_bytes(), from);
                }
            }
        }
    }
}

/// The moment `d` ago.
fn ago(d: Duration) -> Instant {
    Instant::now().checked_sub(d).unwrap_or_else(Instant::now)
}

/// A long-lived client through the Service whose first exchange reached
/// `pod`: new ones are started until one does.
fn stream_on(node: &Node, net: &PodNetwork, what: &str, args: &[&str], pod: &str) -> Stream {
    for i in 0..60 {
        let s = Stream::start(&format!("{what} (attempt {i})"), pod_probe(node, &net.netns, args));
        if s.first().as_deref() == Some(pod) {
            return s.named(what);
        }
    }
    panic!("60 connections of {what} and none reached {pod}");
}

/// A TCP connection kept open, a line each way every 20 ms.
const TCP_STREAM: [&str; 7] = ["--stream", "--count", "1000000", "--interval-ms", "20", "--timeout-ms", "2000"];
/// A connected UDP socket, a datagram each way every 20 ms.
const UDP_STREAM: [&str; 9] = ["--udp", "--connected", "--stream", "--count", "1000000", "--interval-ms", "20", "--timeout-ms", "500"];

fn args<'a>(to: &'a str, rest: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec!["--to", to];
    v.extend_from_slice(rest);
    v
}

/// New connections (TCP: `count` one-shot probes; `--udp` too with
/// `extra`): the set of pods that answered, and whether all did.
fn reached(node: &Node, net: &PodNetwork, to: &str, extra: &[&str], count: usize) -> (BTreeSet<String>, bool) {
    let count = count.to_string();
    let mut a = vec!["--to", to, "--count", &count, "--timeout-ms", "1000"];
    a.extend_from_slice(extra);
    let r = node.probe(net, &a);
    (replies(&r), r.iter().all(|x| x["ok"] == true))
}

/// Waits until every new connection from `node` to `to` is refused (a
/// topology constraint left it no endpoint).
fn wait_refused(node: &Node, net: &PodNetwork, to: &str) {
    let refused = refused_errno();
    eventually(&format!("{to} from {} to be refused", node.name), || {
        let r = node.probe(net, &["--to", to, "--count", "5", "--timeout-ms", "1000"]);
        if r.iter().all(|x| x["ok"] == false && x["errno"].as_i64() == Some(refused)) { Ok(()) } else { Err(r) }
    });
}

/// `kubectl get endpointslices --watch` of one Service: every event, stamped
/// as it arrived, so that a test knows when the controller's update was
/// published.
struct SliceWatch {
    _kubectl: Guarded,
    events: Arc<Mutex<Vec<(Instant, String, Value)>>>,
}

/// The Service's slices by name, after some events.
type Slices = BTreeMap<String, Value>;

impl SliceWatch {
    fn start(cluster: &RealCluster, service: &str) -> SliceWatch {
        let selector = format!("kubernetes.io/service-name={service}");
        let mut cmd = cluster.kubectl_command(&[
            "-n",
            NS,
            "get",
            "endpointslices",
            "-l",
            &selector,
            "--watch",
            "--output-watch-events",
            "-o",
            "json",
        ]);
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::null());
        let mut kubectl = Guarded::spawn(&mut cmd).expect("start kubectl --watch");
        let stdout = kubectl.0.stdout.take().expect("kubectl stdout");
        let events = Arc::new(Mutex::new(Vec::new()));
        let sink = events.clone();
        std::thread::spawn(move || {
            for v in serde_json::Deserializer::from_reader(BufReader::new(stdout)).into_iter::<Value>() {
                let Ok(v) = v else { break };
                let kind = v["type"].as_str().unwrap_or_default().to_string();
                sink.lock().unwrap_or_else(PoisonError::into_inner).push((Instant::now(), kind, v["object"].clone()));
            }
        });
        let w = SliceWatch { _kubectl: kubectl, events };
        eventually(&format!("the watch of {service}'s slices to list them"), || if w.events().is_empty() { Err(()) } else { Ok(()) });
        w
    }

    fn events(&self) -> Vec<(Instant, String, Value)> {
        self.events.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// The slices after each event: `(when, slices)`.
    fn history(&self) -> Vec<(Instant, Slices)> {
        let mut state = Slices::new();
        self.events()
            .into_iter()
            .map(|(t, kind, slice)| {
                let name = slice["metadata"]["name"].as_str().unwrap_or_default().to_string();
                if kind == "DELETED" {
                    state.remove(&name);
                } else {
                    state.insert(name, slice);
                }
                (t, state.clone())
            })
            .collect()
    }

    /// When the first event at or after `since` left the slices in a state
    /// `pred` accepts (waits for it).
    fn when(&self, since: Instant, what: &str, pred: impl Fn(&Slices) -> bool) -> Instant {
        eventually(&format!("the controller's slices to show {what}"), || {
            let h = self.history();
            h.iter().find(|(t, s)| *t >= since && pred(s)).map(|(t, _)| *t).ok_or_else(|| h.last().map(|(_, s)| summary(s)))
        })
    }

    /// The longest time, from `since` on, during which `address` was in no
    /// slice of the Service.
    fn longest_absence(&self, since: Instant, address: &str) -> Duration {
        let mut longest = Duration::ZERO;
        let mut gone_at: Option<Instant> = None;
        for (t, s) in self.history() {
            let present = endpoint(&s, address).is_some();
            match (present, gone_at) {
                (false, None) => gone_at = Some(t.max(since)),
                (true, Some(g)) => {
                    longest = longest.max(t.saturating_duration_since(g));
                    gone_at = None;
                }
                _ => {}
            }
        }
        if let Some(g) = gone_at {
            longest = longest.max(Instant::now().saturating_duration_since(g));
        }
        longest
    }
}

/// `(slice name, endpoint)` of `address` in the slices.
fn endpoint<'a>(slices: &'a Slices, address: &str) -> Option<(&'a str, &'a Value)> {
    slices.iter().find_map(|(name, s)| s["endpoints"].as_array()?.iter().find(|e| e["addresses"][0] == address).map(|e| (name.as_str(), e)))
}

/// Each endpoint as `address name ready/serving/terminating`, for messages.
fn summary(slices: &Slices) -> Vec<String> {
    slices
        .values()
        .flat_map(|s| s["endpoints"].as_array().cloned().unwrap_or_default())
        .map(|e| {
            let c = &e["conditions"];
            format!("{} {} r={} s={} t={}", e["addresses"][0], e["targetRef"]["name"], c["ready"], c["serving"], c["terminating"])
        })
        .collect()
}

/// The conditions of `address`'s endpoint, `(ready, serving, terminating)`.
fn conditions(slices: &Slices, address: &str) -> Option<(bool, bool, bool)> {
    endpoint(slices, address).map(|(_, e)| {
        let c = &e["conditions"];
        (c["ready"] == true, c["serving"] == true, c["terminating"] == true)
    })
}

/// The slices of a Service as [`Slices`], listed now.
fn list_slices(cluster: &RealCluster, service: &str) -> Slices {
    let list = cluster.endpoint_slices(NS, service).expect("list EndpointSlices");
    list["items"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|s| (s["metadata"]["name"].as_str().unwrap_or_default().to_string(), s.clone()))
        .collect()
}

/// address -> slice name.
fn placement(slices: &Slices) -> BTreeMap<String, String> {
    slices
        .iter()
        .flat_map(|(name, s)| {
            s["endpoints"].as_array().cloned().unwrap_or_default().into_iter().map(move |e| (e["addresses"][0].to_string(), name.clone()))
        })
        .map(|(a, n)| (a.trim_matches('"').to_string(), n))
        .collect()
}

/// `address:port` of every ready endpoint.
fn ready_backends(slices: &Slices, port: u16) -> BTreeSet<String> {
    slices
        .values()
        .flat_map(|s| s["endpoints"].as_array().cloned().unwrap_or_default())
        .filter(|e| e["conditions"]["ready"] == true)
        .filter_map(|e| e["addresses"][0].as_str().map(|a| format!("{a}:{port}")))
        .collect()
}

/// The backends the maps hold for `frontend` (`10.96.0.10:80/TCP`), as
/// `proxy-agent dump` reads them from the node's pins; empty while the
/// agent has not installed its maps yet.
fn programmed(node: &Node, frontend: &str) -> BTreeSet<String> {
    let out = Command::new(agent_bin()).args(["dump", "--output", "json", "--bpffs"]).arg(node.pins.path()).output().expect("run dump");
    let Ok(doc) = serde_json::from_slice::<Value>(&out.stdout) else { return BTreeSet::new() };
    doc["services"]
        .as_array()
        .and_then(|s| s.iter().find(|s| s["frontend"] == frontend))
        .and_then(|s| s["slots"].as_array())
        .map(|slots| slots.iter().filter_map(|x| x["backend"].as_str().map(str::to_string)).collect())
        .unwrap_or_default()
}

/// The agent's /readyz: (status, body).
fn readyz(node: &Node) -> (u16, String) {
    http_get(node.healthz_address(), "/readyz").unwrap_or((0, String::new()))
}

/// The agent's WARN lines.
fn warnings(node: &Node) -> Vec<String> {
    node.agent_log().lines().filter(|l| l.contains(" WARN ")).map(str::to_string).collect()
}

/// A ClusterIP Service of `app` Pods: `(name, port, protocol, targetPort)`
/// each, with `annotations` and `extra` spec lines (YAML, indented by 2).
fn service(name: &str, cluster_ip: &str, app: &str, ports: &[(&str, u16, &str, u16)], annotations: &str, extra: &str) -> String {
    let ports: String =
        ports.iter().map(|(n, p, proto, t)| format!("  - {{name: {n}, port: {p}, protocol: {proto}, targetPort: {t}}}\n")).collect();
    format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: {NS}\n  annotations: {{{annotations}}}\nspec:\n  clusterIP: {cluster_ip}\n  selector: {{app: {app}}}\n{extra}  ports:\n{ports}"
    )
}

/// Waits until the controller published exactly `want` (address -> ready)
/// for the Service.
fn wait_published(cluster: &RealCluster, svc: &str, want: &BTreeMap<String, bool>) {
    wait_published_for(cluster, svc, want, wait_limit());
}

/// [`wait_published`] for up to `limit`: after an API server restart the
/// controller manager's informers come back after their own backoff (up to
/// 30 s in client-go), which the agent has no part in.
fn wait_published_for(cluster: &RealCluster, svc: &str, want: &BTreeMap<String, bool>, limit: Duration) {
    let deadline = Instant::now() + limit;
    loop {
        let got: BTreeMap<String, bool> = list_slices(cluster, svc)
            .values()
            .flat_map(|s| s["endpoints"].as_array().cloned().unwrap_or_default())
            .filter_map(|e| Some((e["addresses"][0].as_str()?.to_string(), e["conditions"]["ready"] == true)))
            .collect();
        if &got == want {
            return;
        }
        assert!(Instant::now() < deadline, "the EndpointSlice controller did not publish {svc}'s endpoints {want:?} in {limit:?}: {got:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn all_ready(addresses: &[&str]) -> BTreeMap<String, bool> {
    addresses.iter().map(|a| ((*a).to_string(), true)).collect()
}

// ---------------------------------------------------------------------------
// 1. The chart's RBAC.
// ---------------------------------------------------------------------------

/// The namespace the chart is installed into, as in charts/tests.
const CHART_NS: &str = "kube-system";

/// `<target>/chart-venv`'s Python (made by `cargo xtask setup`), found from
/// the agent binary's location as chart.rs does.
fn venv_python() -> PathBuf {
    std::path::Path::new(env!("CARGO_BIN_EXE_proxy-agent"))
        .ancestors()
        .map(|dir| dir.join("chart-venv/bin/python"))
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("the chart test environment (<target>/chart-venv) is missing; run `cargo xtask setup`"))
}

/// The chart's ServiceAccount, ClusterRole and ClusterRoleBinding, rendered
/// by Helm's real template engine (helm-python-sdk, as charts/tests does)
/// with the default values, release `tp` in [`CHART_NS`].
fn chart_rbac() -> (Value, Value, Value) {
    const RENDER: &str = "
import json, pathlib, sys
import helm_python as helm
import yaml
with helm.Chart.load(pathlib.Path(sys.argv[1])) as chart:
    manifests = chart.render(values=None, name='tp', namespace=sys.argv[2], is_install=True)
objects = [d for path, text in sorted(manifests.items()) if not path.endswith('NOTES.txt') for d in yaml.safe_load_all(text) if d]
print(json.dumps(objects))
";
    let chart = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../charts/topoproxy");
    let out = Command::new(venv_python())
        .args(["-c", RENDER])
        .arg(&chart)
        .arg(CHART_NS)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .expect("run the chart venv's python");
    assert!(out.status.success(), "rendering the chart failed: {}", String::from_utf8_lossy(&out.stderr));
    let objects: Vec<Value> = serde_json::from_slice(&out.stdout).expect("rendered objects as JSON");
    let one = |kind: &str| {
        let found: Vec<&Value> = objects.iter().filter(|o| o["kind"] == kind).collect();
        assert_eq!(found.len(), 1, "one {kind} in the chart");
        found[0].clone()
    };
    (one("ServiceAccount"), one("ClusterRole"), one("ClusterRoleBinding"))
}

/// A cluster with node-1, Service web (web-1 behind it, served) and
/// Service bad-keys (invalid topology keys: `*` must come last), the
/// chart's RBAC objects after `edit` changed the ClusterRole's rules, and a
/// kubeconfig with the chart's ServiceAccount's token; node-1's agent
/// started with it.
fn rbac_setup(name: &str, edit: impl FnOnce(&mut Vec<Value>)) -> (RealCluster, PodNetwork, Node, TempDir) {
    require_root();
    let mut net = PodNetwork::new();
    net.backend("web-1", "10.244.31.1", &[8080]);
    let (sa, mut role, binding) = chart_rbac();
    let mut rules = role["rules"].as_array().cloned().expect("rules");
    edit(&mut rules);
    role["rules"] = Value::Array(rules);
    let cluster = RealCluster::start(name).expect("start the real cluster");
    cluster.create_node("node-1", &[(ZONE, "z1")]).expect("create node-1");
    cluster
        .apply(&format!(
            "{}---\n{}",
            service("web", "10.96.31.10", "web", &[("http", 80, "TCP", 8080)], "", ""),
            service(
                "bad-keys",
                "10.96.31.11",
                "web",
                &[("http", 80, "TCP", 8080)],
                "topoproxy.io/topology-keys: \"*, kubernetes.io/hostname\"",
                ""
            )
        ))
        .expect("create the Services");
    cluster.create_pod(NS, "web-1", "node-1", "10.244.31.1", &[("app", "web")], true).expect("create web-1");
    let sa_name = sa["metadata"]["name"].as_str().expect("ServiceAccount name").to_string();
    assert_eq!(sa["metadata"]["namespace"], CHART_NS);
    assert_eq!(binding["subjects"][0]["name"], sa_name.as_str(), "the binding names the chart's ServiceAccount");
    let dir = TempDir::new("tpt-rbac");
    let kubeconfig = dir.0.join("agent.kubeconfig");
    cluster.service_account_kubeconfig(CHART_NS, &sa_name, &kubeconfig).expect("token kubeconfig");
    let list = json!({"apiVersion": "v1", "kind": "List", "items": [sa, role, binding]});
    cluster.apply(&list.to_string()).expect("apply the chart's RBAC objects");
    // The rendered objects are what the API server now holds.
    let bound = cluster.kubectl(&[
        "auth",
        "can-i",
        "list",
        "endpointslices.discovery.k8s.io",
        &format!("--as=system:serviceaccount:{CHART_NS}:{sa_name}"),
    ]);
    assert_eq!(bound.map(|s| s.trim().to_string()).ok().as_deref(), Some("yes"), "the binding is in force");
    let mut node = Node::new("node-1");
    node.start_kube_agent(&kubeconfig, &[]);
    (cluster, net, node, dir)
}

/// The Events about `service` the agent posted (events.k8s.io/v1,
/// `reportingController: topoproxy`), read as the admin. Others are left
/// out: under load the real EndpointSlice controller posts its own
/// Warnings about a Service (`FailedToUpdateEndpointSlices` on a write
/// conflict).
fn events_about(cluster: &RealCluster, service: &str) -> Vec<Value> {
    let out = cluster.kubectl(&["-n", NS, "get", "events.v1.events.k8s.io", "-o", "json"]).expect("list Events");
    let list: Value = serde_json::from_str(&out).expect("Events as JSON");
    list["items"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .filter(|e| e["regarding"]["name"] == service && e["reportingController"] == "topoproxy")
        .collect()
}

/// With the chart's RBAC, and nothing else, the agent lists and watches
/// Services, EndpointSlices and Nodes (it becomes ready and programs a
/// Service) and posts Events: a Warning about a Service whose topology keys
/// are invalid.
#[test]
fn the_charts_rbac_is_all_the_agent_needs_to_program_services_and_post_events() {
    let (cluster, net, node, _dir) = rbac_setup("chart-rbac", |_| {});
    wait_for_backends(&node, &net, "10.96.31.10:80", &[], &["web-1"]);
    // Invalid keys are ignored (reported): the Service still works.
    wait_for_backends(&node, &net, "10.96.31.11:80", &[], &["web-1"]);
    // Ready once the first sync is applied and the socket termination
    // mechanism is known: it can trail the first programmed backends.
    eventually("/readyz to answer ok", || match readyz(&node) {
        (200, body) if body.trim() == "ok" => Ok(()),
        other => Err(format!("{other:?}")),
    });
    let event = eventually("a Warning Event about bad-keys", || {
        events_about(&cluster, "bad-keys").into_iter().find(|e| e["reason"] == "InvalidTopologyKeys").ok_or(())
    });
    assert_eq!(event["type"], "Warning", "{event}");
    assert_eq!(event["reportingController"], "topoproxy", "{event}");
    assert_eq!(event["reportingInstance"], "topoproxy-node-1", "{event}");
    assert_eq!(event["regarding"]["kind"], "Service", "{event}");
    assert!(event["note"].as_str().is_some_and(|n| n.contains("topology-keys")), "{event}");
    let denied: Vec<String> = node.agent_log().lines().filter(|l| tells_of_a_refusal(l)).map(str::to_string).collect();
    assert!(denied.is_empty(), "the chart's RBAC denied the agent something: {denied:#?}");
}

/// Whether an agent log line reports the API server refusing a request:
/// "forbidden" (the Status reason kube-apiserver sends with 403) or 403 as a
/// number of its own. Not any "403": a timestamp's microseconds or a bound
/// port (`127.0.0.1:40345`, which failed the clean-clone run) hold it too.
fn tells_of_a_refusal(line: &str) -> bool {
    if line.to_ascii_lowercase().contains("forbidden") {
        return true;
    }
    let bytes = line.as_bytes();
    line.match_indices("403").any(|(at, _)| {
        let before = at.checked_sub(1).map(|i| bytes[i]);
        let after = bytes.get(at + 3).copied();
        !before.is_some_and(|b| b.is_ascii_digit() || b == b':' || b == b'.')
            && !after.is_some_and(|b| b.is_ascii_digit() || b == b'.' || b == b':')
    })
}

/// The chart as `helm install --dry-run=server` renders it against the real
/// API server with `values` (Helm reads the API groups the server serves
/// into `.Capabilities`, as a real install does; an offline render has
/// only the built-in ones), as JSON objects.
fn chart_installed_dry_run(kubeconfig: &std::path::Path, home: &std::path::Path, values: &Value) -> Vec<Value> {
    const INSTALL: &str = "
import json, pathlib, sys
import helm_python as helm
import yaml
config = helm.Config(kubeconfig_path=sys.argv[3], namespace=sys.argv[2], storage_driver='memory')
with helm.Chart.load(pathlib.Path(sys.argv[1])) as chart:
    release = config.install(chart, 'tp', values=json.loads(sys.argv[4]), namespace=sys.argv[2], dry_run='server')
print(json.dumps([d for d in yaml.safe_load_all(release['manifest']) if d]))
";
    let chart = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../charts/topoproxy");
    let out = Command::new(venv_python())
        .args(["-c", INSTALL])
        .arg(&chart)
        .arg(CHART_NS)
        .arg(kubeconfig)
        .arg(values.to_string())
        .env("PYTHONDONTWRITEBYTECODE", "1")
        // Helm's discovery cache goes under the test's own directory.
        .env("HOME", home)
        .env("XDG_CACHE_HOME", home.join("cache"))
        .output()
        .expect("run the chart venv's python");
    assert!(out.status.success(), "helm install --dry-run=server failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("rendered objects as JSON")
}

/// `metrics.serviceMonitor.enabled: auto` against a real API server: no
/// ServiceMonitor (and no metrics Service) while the server does not serve
/// monitoring.coreos.com/v1; once Prometheus Operator's own ServiceMonitor
/// CRD is installed, the chart renders one, and the server stores it as
/// rendered: the operator's schema prunes none of its fields.
#[test]
fn the_auto_service_monitor_appears_once_the_server_serves_prometheus_operators_api() {
    let crd = proxy_test_support::real_cluster::service_monitor_crd().expect("the ServiceMonitor CRD (cargo xtask k8s)");
    let cluster = RealCluster::start("chart-servicemonitor").expect("start the real cluster");
    let home = TempDir::new("tpt-helm");
    let values = json!({"metrics": {"serviceMonitor": {"enabled": "auto"}}});
    let kinds = |objects: &[Value]| objects.iter().filter_map(|o| o["kind"].as_str().map(str::to_string)).collect::<BTreeSet<_>>();
    let before = chart_installed_dry_run(cluster.admin_kubeconfig(), &home.0, &values);
    assert!(!kinds(&before).contains("ServiceMonitor"), "no ServiceMonitor without its API: {:?}", kinds(&before));
    assert!(!before.iter().any(|o| o["kind"] == "Service"), "no metrics Service either");
    let yaml = std::fs::read_to_string(&crd).expect("read the CRD");
    cluster.apply(&yaml).expect("install Prometheus Operator's ServiceMonitor CRD");
    cluster
        .kubectl(&["wait", "--for=condition=Established", "--timeout=60s", "crd/servicemonitors.monitoring.coreos.com"])
        .expect("the CRD is established");
    let after = chart_installed_dry_run(cluster.admin_kubeconfig(), &home.0, &values);
    let monitors: Vec<&Value> = after.iter().filter(|o| o["kind"] == "ServiceMonitor").collect();
    assert_eq!(monitors.len(), 1, "one ServiceMonitor once the API is served: {:?}", kinds(&after));
    assert!(after.iter().any(|o| o["kind"] == "Service"), "the ServiceMonitor's Service comes with it");
    // /metrics stays on loopback until something scrapes it, then listens
    // where the ServiceMonitor's Service reaches it.
    let metrics_bind = |objects: &[Value]| {
        objects
            .iter()
            .filter(|o| o["kind"] == "DaemonSet")
            .flat_map(|d| d["spec"]["template"]["spec"]["containers"].as_array().cloned().unwrap_or_default())
            .flat_map(|c| c["args"].as_array().cloned().unwrap_or_default())
            .find_map(|a| a.as_str().and_then(|a| a.strip_prefix("--metrics-bind-address=")).map(str::to_string))
    };
    assert_eq!(metrics_bind(&before).as_deref(), Some("127.0.0.1:10249"));
    assert_eq!(metrics_bind(&after).as_deref(), Some("0.0.0.0:10249"));
    let monitor = monitors[0].clone();
    assert_eq!(monitor["spec"]["endpoints"][0]["honorLabels"], true, "{monitor}");
    // Stored as rendered: a field the operator's schema did not know would
    // have been pruned by the server (which adds its defaults, such as a
    // relabeling's `action: replace`).
    cluster.apply(&monitor.to_string()).expect("the server accepts the ServiceMonitor");
    let name = monitor["metadata"]["name"].as_str().expect("name");
    let stored: Value =
        serde_json::from_str(&cluster.kubectl(&["-n", CHART_NS, "get", "servicemonitor", name, "-o", "json"]).expect("get it"))
            .expect("ServiceMonitor as JSON");
    assert!(
        kept(&monitor["spec"], &stored["spec"]),
        "the server pruned or changed part of the spec:\n{}\n{}",
        monitor["spec"],
        stored["spec"]
    );
    assert_eq!(stored["metadata"]["labels"], monitor["metadata"]["labels"]);
}

/// Whether everything of `sent` is in `stored` unchanged; `stored` may hold
/// more (the server's defaults).
fn kept(sent: &Value, stored: &Value) -> bool {
    match (sent, stored) {
        (Value::Object(a), Value::Object(b)) => a.iter().all(|(k, v)| b.get(k).is_some_and(|w| kept(v, w))),
        (Value::Array(a), Value::Array(b)) => a.len() == b.len() && a.iter().zip(b).all(|(v, w)| kept(v, w)),
        _ => sent == stored,
    }
}

/// The chart's ClusterRole without `nodes`: the agent cannot list its Node,
/// says so (403), and never becomes ready.
#[test]
fn without_the_charts_nodes_permission_the_agent_reports_403_and_never_becomes_ready() {
    let (_cluster, _net, mut node, _dir) = rbac_setup("chart-rbac-no-nodes", |rules| {
        for r in rules.iter_mut() {
            if let Some(res) = r["resources"].as_array_mut() {
                res.retain(|x| x != "nodes");
            }
        }
        rules.retain(|r| r["resources"].as_array().is_some_and(|x| !x.is_empty()));
    });
    let denied = eventually("the agent to log that listing Nodes is forbidden", || {
        warnings(&node).into_iter().find(|l| l.contains("nodes") && tells_of_a_refusal(l)).ok_or_else(|| warnings(&node))
    });
    eprintln!("the agent says: {denied}");
    // Not ready, and it stays so while Nodes stay forbidden.
    let until = Instant::now() + Duration::from_secs(5);
    while Instant::now() < until {
        let (code, body) = readyz(&node);
        assert_eq!(code, 503, "/readyz while Nodes are forbidden: {body}");
        std::thread::sleep(Duration::from_millis(250));
    }
    assert!(node.agent_running(), "the agent keeps running (and retrying)");
    assert!(!node.agent_log().contains("first sync applied"), "no sync without the Nodes");
}

/// The chart's ClusterRole without Events: the agent still programs
/// Services and is ready, and warns that it cannot post Events.
#[test]
fn without_the_charts_events_permission_the_agent_works_and_warns() {
    let (cluster, net, node, _dir) = rbac_setup("chart-rbac-no-events", |rules| {
        rules.retain(|r| !r["resources"].as_array().is_some_and(|x| x.iter().any(|x| x == "events")));
    });
    wait_for_backends(&node, &net, "10.96.31.10:80", &[], &["web-1"]);
    wait_for_backends(&node, &net, "10.96.31.11:80", &[], &["web-1"]);
    // Ready without Events (once the first sync is applied and the socket
    // termination mechanism is known, which can trail the backends).
    eventually("/readyz to answer 200 without Events", || match readyz(&node) {
        (200, _) => Ok(()),
        other => Err(format!("{other:?}")),
    });
    // The agent tried to post the Event about bad-keys and was refused.
    let series = "topoproxy_errors_total{reason=\"event_post\"}";
    let refused = eventually("the agent's Event post to be refused", || {
        let m = http_get(node.metrics_address(), "/metrics").map(|(_, b)| b).unwrap_or_default();
        metric(&m, series).filter(|n| *n >= 1.0).ok_or(())
    });
    eprintln!("{series} = {refused}");
    let warned = eventually("a warning that Events cannot be posted", || {
        warnings(&node).into_iter().find(|l| l.contains("Event") && tells_of_a_refusal(l)).ok_or_else(|| {
            (warnings(&node), node.agent_log().lines().filter(|l| l.contains("Event")).map(str::to_string).collect::<Vec<_>>())
        })
    });
    eprintln!("the agent says: {warned}");
    let posted = events_about(&cluster, "bad-keys");
    assert!(posted.is_empty(), "no Event of the agent's could be posted, yet: {posted:?}");
}

// ---------------------------------------------------------------------------
// 2. Topology from the real controller.
// ---------------------------------------------------------------------------

/// Seed 002's walk-through (OpenYurt's Service Topology): Nodes in the node
/// pools hangzhou and shanghai (label `apps.openyurt.io/nodepool`), a
/// serve_hostname workload on port 9376, `svc-ud1` annotated
/// `openyurt.io/topologyKeys: openyurt.io/nodepool` and
/// `svc-ud1-without-topology`; next to them a Service ordered
/// `[kubernetes.io/hostname, topology.kubernetes.io/zone, *]`. Pools and
/// zones cross: node-1 (hangzhou, z1), node-2 (shanghai, z1), node-3
/// (hangzhou, z2), one Pod on each, and an agent on node-1 and on node-3.
/// As Pods go, each node's choice follows: the pool has no fallback, the
/// ordered list falls back from node to zone to anywhere.
#[test]
fn openyurt_node_pools_and_ordered_topology_keys_with_the_real_controller() {
    require_root();
    let mut net = PodNetwork::new();
    for (pod, ip) in [("ud1-n1", "10.244.34.1"), ("ud1-n2", "10.244.34.2"), ("ud1-n3", "10.244.34.3")] {
        net.backend(pod, ip, &[9376]);
    }
    let cluster = RealCluster::start("openyurt-pools").expect("start the real cluster");
    for (node, zone, pool) in [("node-1", "z1", "hangzhou"), ("node-2", "z1", "shanghai"), ("node-3", "z2", "hangzhou")] {
        cluster.create_node(node, &[(ZONE, zone), (POOL, pool)]).expect("create node");
    }
    let port = [("http", 80, "TCP", 9376)];
    cluster
        .apply(
            &[
                service("svc-ud1", "10.96.34.10", "ud1", &port, "openyurt.io/topologyKeys: openyurt.io/nodepool", ""),
                service("svc-ud1-without-topology", "10.96.34.11", "ud1", &port, "", ""),
                service(
                    "svc-ordered",
                    "10.96.34.12",
                    "ud1",
                    &port,
                    "topoproxy.io/topology-keys: \"kubernetes.io/hostname, topology.kubernetes.io/zone, *\"",
                    "",
                ),
            ]
            .join("---\n"),
        )
        .expect("create the Services");
    let pods = ready_pods(
        &[("app", "ud1")],
        &[("ud1-n1", "node-1", "10.244.34.1"), ("ud1-n2", "node-2", "10.244.34.2"), ("ud1-n3", "node-3", "10.244.34.3")],
    );
    cluster.create_pods(NS, &pods).expect("create the Pods");
    wait_published(&cluster, "svc-ud1", &all_ready(&["10.244.34.1", "10.244.34.2", "10.244.34.3"]));

    let mut n1 = Node::new("node-1");
    let mut n3 = Node::new("node-3");
    n1.start_kube_agent(cluster.admin_kubeconfig(), &[]);
    n3.start_kube_agent(cluster.admin_kubeconfig(), &[]);
    let (pool, anywhere, ordered) = ("10.96.34.10:80", "10.96.34.11:80", "10.96.34.12:80");
    wait_for_backends(&n1, &net, anywhere, &[], &["ud1-n1", "ud1-n2", "ud1-n3"]);
    // The pool: hangzhou is node-1 and node-3, whichever zone.
    wait_for_backends(&n1, &net, pool, &[], &["ud1-n1", "ud1-n3"]);
    wait_for_backends(&n3, &net, pool, &[], &["ud1-n1", "ud1-n3"]);
    // The ordered list: the node's own Pod.
    wait_for_backends(&n1, &net, ordered, &[], &["ud1-n1"]);
    wait_for_backends(&n3, &net, ordered, &[], &["ud1-n3"]);

    // node-1's Pod goes: node-1 falls back to its zone (node-2's Pod, in
    // shanghai), its pool keeps to node-3's.
    cluster.force_delete_pod(NS, "ud1-n1").expect("delete ud1-n1");
    wait_for_backends(&n1, &net, pool, &[], &["ud1-n3"]);
    wait_for_backends(&n1, &net, ordered, &[], &["ud1-n2"]);
    wait_for_backends(&n3, &net, ordered, &[], &["ud1-n3"]);

    // node-3's Pod goes: hangzhou has no endpoint left and OpenYurt does not
    // fall back; the ordered list does, to anywhere for node-3.
    cluster.force_delete_pod(NS, "ud1-n3").expect("delete ud1-n3");
    wait_refused(&n1, &net, pool);
    wait_refused(&n3, &net, pool);
    wait_for_backends(&n1, &net, ordered, &[], &["ud1-n2"]);
    wait_for_backends(&n3, &net, ordered, &[], &["ud1-n2"]);
    wait_for_backends(&n3, &net, anywhere, &[], &["ud1-n2"]);
}

/// A region-keyed Service (v1 slices carry no region) against the real
/// API server: the agent watches only the other Nodes hosting its
/// endpoints, metadata-only, selected by their hostname label (the audit
/// log shows the request), follows a label change on one of them, follows
/// an endpoint to a Node it did not watch, and stops watching when the
/// Service goes. node-1 and node-2 in r1, node-3 and node-4 in r2; Pods on
/// node-1, node-2 and node-3; the agent on node-1.
#[test]
fn other_nodes_are_watched_by_name_while_a_region_keyed_service_needs_them() {
    const REGION: &str = "topology.kubernetes.io/region";
    require_root();
    let mut net = PodNetwork::new();
    for (pod, ip) in [("rg-1", "10.244.36.1"), ("rg-2", "10.244.36.2"), ("rg-3", "10.244.36.3"), ("rg-4", "10.244.36.4")] {
        net.backend(pod, ip, &[9376]);
    }
    let cluster = RealCluster::start("region-keyed").expect("start the real cluster");
    for (node, region) in [("node-1", "r1"), ("node-2", "r1"), ("node-3", "r2"), ("node-4", "r2")] {
        cluster.create_node(node, &[(REGION, region)]).expect("create node");
    }
    let port = [("http", 80, "TCP", 9376)];
    cluster
        .apply(&service("regional", "10.96.36.10", "rg", &port, "topoproxy.io/topology-keys: \"topology.kubernetes.io/region, *\"", ""))
        .expect("create the Service");
    let pods = ready_pods(
        &[("app", "rg")],
        &[("rg-1", "node-1", "10.244.36.1"), ("rg-2", "node-2", "10.244.36.2"), ("rg-3", "node-3", "10.244.36.3")],
    );
    cluster.create_pods(NS, &pods).expect("create the Pods");
    wait_published(&cluster, "regional", &all_ready(&["10.244.36.1", "10.244.36.2", "10.244.36.3"]));

    let mut n1 = Node::new("node-1");
    n1.start_kube_agent(cluster.admin_kubeconfig(), &[]);
    let frontend = "10.96.36.10:80";
    wait_for_backends(&n1, &net, frontend, &[], &["rg-1", "rg-2"]);
    let audit = cluster.audit_log();
    let watch = audit
        .lines()
        .find(|l| l.contains("/api/v1/nodes?") && l.contains("labelSelector") && l.contains("watch=true"))
        .unwrap_or_else(|| panic!("a watch of other Nodes by label selector: {audit}"));
    for (want, what) in [("node-2", "hosts an endpoint"), ("node-3", "hosts an endpoint")] {
        assert!(watch.contains(want), "{want} {what}: {watch}");
    }
    assert!(!watch.contains("node-4"), "node-4 hosts no endpoint: {watch}");

    // node-3 joins r1: a label of another Node, read from its metadata.
    cluster.kubectl(&["label", "node", "node-3", &format!("{REGION}=r1"), "--overwrite"]).expect("relabel node-3");
    wait_for_backends(&n1, &net, frontend, &[], &["rg-1", "rg-2", "rg-3"]);
    // A Pod on node-4 (r2), which was not watched: once its endpoint is
    // published the watch takes node-4 in, and node-4's move to r1 counts.
    cluster
        .create_pods(NS, &[PodSpec { name: "rg-4", node: "node-4", ip: "10.244.36.4", labels: &[("app", "rg")], ready: true }])
        .expect("create rg-4");
    wait_published(&cluster, "regional", &all_ready(&["10.244.36.1", "10.244.36.2", "10.244.36.3", "10.244.36.4"]));
    cluster.kubectl(&["label", "node", "node-4", &format!("{REGION}=r1"), "--overwrite"]).expect("relabel node-4");
    wait_for_backends(&n1, &net, frontend, &[], &["rg-1", "rg-2", "rg-3", "rg-4"]);

    // No Service needs other Nodes any more: the watch stops.
    cluster.kubectl(&["-n", NS, "delete", "service", "regional"]).expect("delete the Service");
    eventually("the other Nodes' watch to stop", || {
        if n1.agent_log().contains("stopped watching other Nodes") { Ok(()) } else { Err("still watching") }
    });
}

/// `spec.trafficDistribution`: `PreferClose`, `PreferSameZone` and
/// `PreferSameNode`, whose hints the real EndpointSlice controller writes
/// (`forZones`; `forNodes` too for PreferSameNode): the test only creates
/// Pods. node-1 and node-2 in z1, node-3 in z2, one Pod on each; agents on
/// node-1 and node-3. When node-1's Pod fails readiness the controller
/// drops its hints and node-1 falls back to its zone.
#[test]
fn traffic_distribution_hints_from_the_real_controller() {
    require_root();
    let mut net = PodNetwork::new();
    for (pod, ip) in [("td-1", "10.244.35.1"), ("td-2", "10.244.35.2"), ("td-3", "10.244.35.3")] {
        net.backend(pod, ip, &[9376]);
    }
    let cluster = RealCluster::start("traffic-distribution").expect("start the real cluster");
    for (node, zone) in [("node-1", "z1"), ("node-2", "z1"), ("node-3", "z2")] {
        cluster.create_node(node, &[(ZONE, zone)]).expect("create node");
    }
    let port = [("http", 80, "TCP", 9376)];
    let kinds = [
        ("close", "10.96.35.10", "PreferClose"),
        ("same-zone", "10.96.35.11", "PreferSameZone"),
        ("same-node", "10.96.35.12", "PreferSameNode"),
    ];
    let yaml: Vec<String> =
        kinds.iter().map(|(svc, ip, td)| service(svc, ip, "td", &port, "", &format!("  trafficDistribution: {td}\n"))).collect();
    cluster.apply(&yaml.join("---\n")).expect("create the Services");
    for (svc, _, td) in kinds {
        let got = cluster.kubectl(&["-n", NS, "get", "service", svc, "-o", "jsonpath={.spec.trafficDistribution}"]).expect("get Service");
        assert_eq!(got, td, "the API server keeps spec.trafficDistribution {td}");
    }
    let pods = ready_pods(
        &[("app", "td")],
        &[("td-1", "node-1", "10.244.35.1"), ("td-2", "node-2", "10.244.35.2"), ("td-3", "node-3", "10.244.35.3")],
    );
    cluster.create_pods(NS, &pods).expect("create the Pods");

    // The hints are the controller's: each ready endpoint is hinted for its
    // own zone (and node, for PreferSameNode), in slices it manages.
    let zone_of = |node: &str| if node == "node-3" { "z2" } else { "z1" };
    for (svc, _, td) in kinds {
        eventually(&format!("the controller's hints on {svc}'s slices ({td})"), || {
            let slices = list_slices(&cluster, svc);
            let mut seen = BTreeSet::new();
            for s in slices.values() {
                assert_eq!(s["metadata"]["labels"]["endpointslice.kubernetes.io/managed-by"], "endpointslice-controller.k8s.io", "{s}");
                for e in s["endpoints"].as_array().into_iter().flatten() {
                    let node = e["nodeName"].as_str().unwrap_or_default();
                    let zones = json!([{"name": zone_of(node)}]);
                    let nodes = if td == "PreferSameNode" { json!([{"name": node}]) } else { Value::Null };
                    if e["hints"]["forZones"] != zones || e["hints"]["forNodes"] != nodes || e["zone"] != zone_of(node) {
                        return Err(format!("{svc}: {e}"));
                    }
                    seen.insert(node.to_string());
                }
            }
            if seen.len() == 3 { Ok(()) } else { Err(format!("{svc}: endpoints on {seen:?}")) }
        });
    }

    let mut n1 = Node::new("node-1");
    let mut n3 = Node::new("node-3");
    n1.start_kube_agent(cluster.admin_kubeconfig(), &[]);
    n3.start_kube_agent(cluster.admin_kubeconfig(), &[]);
    let (close, same_zone, same_node) = ("10.96.35.10:80", "10.96.35.11:80", "10.96.35.12:80");
    wait_for_backends(&n1, &net, close, &[], &["td-1", "td-2"]);
    wait_for_backends(&n1, &net, same_zone, &[], &["td-1", "td-2"]);
    wait_for_backends(&n1, &net, same_node, &[], &["td-1"]);
    for to in [close, same_zone, same_node] {
        wait_for_backends(&n3, &net, to, &[], &["td-3"]);
    }

    // td-1 fails readiness: no endpoint is hinted for node-1 any more, so
    // PreferSameNode falls back to the zone hints (kube-proxy's rule).
    cluster.set_ready(NS, "td-1", false).expect("td-1 not ready");
    for to in [close, same_zone, same_node] {
        wait_for_backends(&n1, &net, to, &[], &["td-2"]);
        wait_for_backends(&n3, &net, to, &[], &["td-3"]);
    }
}

// ---------------------------------------------------------------------------
// 3. Termination the way Kubernetes does it.
// ---------------------------------------------------------------------------

/// Issue 29's rules against the real controller's updates. A Service with
/// TCP port 80 and UDP port 53 over Pods app-a and app-b; a long-lived TCP
/// connection and a connected UDP socket on app-a. app-a is deleted with a
/// grace period (the controller marks it terminating, still serving: its
/// Pod is Ready), then fails readiness (not serving), then is
/// force-deleted (gone). TCP survives terminating and not serving, and is
/// aborted within the window once the endpoint is gone; the connected UDP
/// socket is aborted once app-a stops serving, and reconnects to app-b;
/// new connections avoid app-a from the first change on.
#[test]
fn termination_as_kubernetes_does_it_ends_tcp_only_once_the_pod_is_gone() {
    require_root();
    let net = PodNetwork::new();
    net.netns.add_loopback_addrs(&["10.244.33.0/24"]).expect("pod addresses");
    let (a, b) = ("10.244.33.1", "10.244.33.2");
    let _servers = PodServers::start(&net.netns, &named(&[("app-a", a), ("app-b", b)]), 8080, 5353);
    let cluster = RealCluster::start("termination").expect("start the real cluster");
    cluster.create_node("node-1", &[(ZONE, "z1")]).expect("create node-1");
    cluster
        .apply(&service("app", "10.96.33.10", "app", &[("http", 80, "TCP", 8080), ("dns", 53, "UDP", 5353)], "", ""))
        .expect("create Service app");
    let labels = [("app", "app")];
    let pods = [
        PodSpec { name: "app-a", node: "node-1", ip: a, labels: &labels, ready: true },
        PodSpec { name: "app-b", node: "node-1", ip: b, labels: &labels, ready: true },
    ];
    cluster.create_pods(NS, &pods).expect("create the Pods");
    wait_published(&cluster, "app", &all_ready(&[a, b]));
    let mut node = Node::new("node-1");
    node.start_kube_agent(cluster.admin_kubeconfig(), &[]);
    let (tcp_to, udp_to) = ("10.96.33.10:80", "10.96.33.10:53");
    wait_for_backends(&node, &net, tcp_to, &[], &["app-a", "app-b"]);
    wait_for_backends(&node, &net, udp_to, &["--udp"], &["app-a", "app-b"]);
    let watch = SliceWatch::start(&cluster, "app");

    let tcp = stream_on(&node, &net, "the TCP connection on app-a", &args(tcp_to, &TCP_STREAM), "app-a");
    let mut udp_args = args(udp_to, &UDP_STREAM);
    udp_args.push("--reconnect");
    let udp = stream_on(&node, &net, "the connected UDP socket on app-a", &udp_args, "app-a");
    let avoid_a = |since: Instant, what: &str| {
        let at = eventually(&format!("new connections to avoid app-a once it is {what}"), || {
            let (t, t_ok) = reached(&node, &net, tcp_to, &[], 20);
            let (u, u_ok) = reached(&node, &net, udp_to, &["--udp"], 20);
            if t_ok && u_ok && t == set(&["app-b"]) && u == set(&["app-b"]) { Ok(Instant::now()) } else { Err((t, u)) }
        });
        let late = at.saturating_duration_since(since);
        eprintln!("new connections avoided app-a {late:?} after the update ({what})");
        assert!(late <= within(), "new connections reached app-a until {late:?} after it was {what}");
    };

    // 1. Deleted with a grace period: terminating, still serving.
    let t0 = Instant::now();
    cluster.delete_pod(NS, "app-a", 30).expect("delete app-a gracefully");
    let terminating = watch.when(t0, "app-a terminating and serving", |s| conditions(s, a) == Some((false, true, true)));
    avoid_a(terminating, "terminating");
    std::thread::sleep(Duration::from_millis(1500));
    for s in [&tcp, &udp] {
        assert_eq!(s.first_failure_at(t0), None, "{} stays while app-a is terminating and serving", s.name);
        assert!(s.replies_since(terminating + Duration::from_secs(1)).iter().all(|r| r == "app-a"), "{} still on app-a", s.name);
        assert!(s.replies_since(terminating + Duration::from_secs(1)).len() > 5, "{} still exchanges", s.name);
    }

    // 2. Not ready: not serving. The connected UDP socket is ended (and
    // reconnects to app-b); TCP stays.
    let t1 = Instant::now();
    cluster.set_ready(NS, "app-a", false).expect("app-a not ready");
    let not_serving = watch.when(t1, "app-a terminating and not serving", |s| conditions(s, a) == Some((false, false, true)));
    let (failed_at, failure) = eventually("the connected UDP socket to be ended", || udp.first_failure_at(t1).ok_or(()));
    let late = failed_at.saturating_duration_since(not_serving);
    eprintln!("connected UDP ended {late:?} after the slice said app-a no longer serves: {failure}");
    assert!(udp_aborted(&failure), "the agent aborted the UDP socket: {failure}");
    assert!(late <= within(), "the UDP socket was ended {late:?} after the update, later than {:?}", within());
    avoid_a(not_serving, "not serving");
    std::thread::sleep(Duration::from_millis(1500));
    let after_udp = udp.replies_since(failed_at);
    assert!(after_udp.len() > 5 && after_udp.iter().all(|r| r == "app-b"), "the UDP client reconnected to app-b: {after_udp:?}");
    assert_eq!(tcp.first_failure_at(t0), None, "TCP stays while app-a is terminating and not serving");
    let tcp_late = tcp.replies_since(not_serving + Duration::from_secs(1));
    assert!(tcp_late.len() > 5 && tcp_late.iter().all(|r| r == "app-a"), "TCP still exchanges with app-a: {}", tcp_late.len());

    // 3. Force-deleted: gone after terminating. TCP to it is aborted.
    let t2 = Instant::now();
    cluster.force_delete_pod(NS, "app-a").expect("force-delete app-a");
    let gone = watch.when(t2, "app-a gone", |s| endpoint(s, a).is_none() && endpoint(s, b).is_some());
    let (aborted_at, failure) = eventually("the TCP connection to be aborted", || tcp.first_failure_at(t2).ok_or(()));
    let late = aborted_at.saturating_duration_since(gone);
    eprintln!("TCP aborted {late:?} after the slice dropped app-a: {failure}");
    let errno = failure["errno"].as_i64();
    assert!(errno == Some(ECONNABORTED) || errno == Some(ECONNRESET), "aborted or reset: {failure}");
    // "Gone" holds 250 ms before it counts (a move between slices).
    assert!(late <= within() + Duration::from_millis(250), "TCP aborted {late:?} after the update, later than {:?} + 250 ms", within());
    eventually("the rule to be logged", || {
        let log = node.agent_log();
        if log.contains("gone_after_terminating") || log.contains("tcp rule") { Ok(()) } else { Err("no rule in the log yet") }
    });
    assert!(udp.replies_since(aborted_at).iter().all(|r| r == "app-b"), "the reconnected UDP client stays on app-b");
}

// ---------------------------------------------------------------------------
// 4. Slice churn.
// ---------------------------------------------------------------------------

/// A Service of 130 Pods on two Nodes (5 of them not ready), which the
/// controller spreads over two slices of at most 100 endpoints. Pods are
/// added and removed; plain adds and removals leave every endpoint in its
/// slice (the controller fills slices, it does not rebalance them), so the
/// test also replaces Pods the way IPAM does, a new Pod on the address of
/// one that went, in the same controller sync (the controller batches Pod
/// changes for 2 s here): the new endpoint lands in another slice when a
/// fuller slice has room. After each step the programmed set equals the
/// Service's ready endpoints, and no long-lived socket (a TCP connection
/// and a connected UDP socket, on endpoints that stay or move) is ended.
#[test]
fn slice_churn_over_130_endpoints_ends_no_live_socket() {
    require_root();
    let net = PodNetwork::new();
    net.netns.add_loopback_addrs(&["10.244.36.0/24"]).expect("pod addresses");
    let ip = |i: usize| format!("10.244.36.{i}");
    // Every address a Pod may get has a server (named after the address's
    // first Pod).
    let all: Vec<(String, String)> = (1..=200).map(|i| (ip(i), ip(i))).collect();
    let _servers = PodServers::start(&net.netns, &all, 8080, 5353);
    let cluster = RealCluster::start_with("slice-churn", &["--endpointslice-updates-batch-period=2s"]).expect("start the real cluster");
    cluster.create_node("node-1", &[(ZONE, "z1")]).expect("create node-1");
    cluster.create_node("node-2", &[(ZONE, "z1")]).expect("create node-2");
    cluster
        .apply(&service("churn", "10.96.36.10", "churn", &[("http", 80, "TCP", 8080), ("dns", 53, "UDP", 5353)], "", ""))
        .expect("Service");
    let labels = [("app", "churn")];
    // name -> address, of the Pods that exist.
    let mut pods: BTreeMap<String, String> = BTreeMap::new();
    let names: Vec<(String, String, &str, bool)> =
        (1..=130).map(|i| (format!("ch-{i}"), ip(i), if i % 2 == 0 { "node-2" } else { "node-1" }, i <= 125)).collect();
    let specs: Vec<PodSpec> =
        names.iter().map(|(n, a, node, ready)| PodSpec { name: n, node, ip: a, labels: &labels, ready: *ready }).collect();
    cluster.create_pods(NS, &specs).expect("create 130 Pods");
    pods.extend(names.iter().map(|(n, a, _, _)| (n.clone(), a.clone())));
    let want: BTreeMap<String, bool> = names.iter().map(|(_, a, _, ready)| (a.clone(), *ready)).collect();
    wait_published(&cluster, "churn", &want);
    let first = list_slices(&cluster, "churn");
    let sizes: Vec<usize> = first.values().map(|s| s["endpoints"].as_array().map_or(0, Vec::len)).collect();
    eprintln!("130 endpoints in slices of {sizes:?}");
    assert!(sizes.len() >= 2 && sizes.iter().all(|n| *n <= 100), "several slices of at most 100: {sizes:?}");

    let mut node = Node::new("node-1");
    node.start_kube_agent(cluster.admin_kubeconfig(), &[]);
    let (tcp_fe, udp_fe) = ("10.96.36.10:80/TCP", "10.96.36.10:53/UDP");
    let converged = |what: &str| {
        eventually(&format!("the programmed set to equal the ready endpoints ({what})"), || {
            let slices = list_slices(&cluster, "churn");
            let (tcp, udp) = (programmed(&node, tcp_fe), programmed(&node, udp_fe));
            let (want_tcp, want_udp) = (ready_backends(&slices, 8080), ready_backends(&slices, 5353));
            if tcp == want_tcp && udp == want_udp {
                Ok(())
            } else {
                Err(format!(
                    "tcp: {} programmed, {} ready; udp: {} programmed, {} ready",
                    tcp.len(),
                    want_tcp.len(),
                    udp.len(),
                    want_udp.len()
                ))
            }
        });
    };
    converged("130 Pods");
    let watch = SliceWatch::start(&cluster, "churn");

    // Long-lived sockets on ready endpoints of the smaller slice: the
    // replacements below move them to the fuller one.
    let slices = list_slices(&cluster, "churn");
    let small = slices.iter().min_by_key(|(_, s)| s["endpoints"].as_array().map_or(0, Vec::len)).map(|(n, _)| n.clone()).expect("slices");
    let in_small = placement(&slices);
    let on_small = |what: &str, to: &str, rest: &[&str]| {
        for i in 0..60 {
            let s = Stream::start(&format!("{what} (attempt {i})"), pod_probe(&node, &net.netns, &args(to, rest)));
            if let Some(on) = s.first().filter(|a| in_small.get(a) == Some(&small)) {
                return (s.named(what), on);
            }
        }
        panic!("60 attempts of {what} and none reached an endpoint of slice {small}");
    };
    let (tcp, tcp_on) = on_small("the TCP connection", "10.96.36.10:80", &TCP_STREAM);
    let (udp, udp_on) = on_small("the connected UDP socket", "10.96.36.10:53", &UDP_STREAM);
    eprintln!("TCP on {tcp_on}, UDP on {udp_on}, in slice {small}");
    let on = [tcp_on.clone(), udp_on.clone()];
    let t0 = Instant::now();
    let sockets_alive = |what: &str| {
        for (s, addr) in [(&tcp, &tcp_on), (&udp, &udp_on)] {
            if let Some((at, failure)) = s.first_failure_at(t0) {
                let absent = watch.longest_absence(t0, addr);
                panic!(
                    "{} on {addr} ended ({what}): {failure}, {:?} after the start; {addr} was in no slice for at most {absent:?}",
                    s.name,
                    at - t0
                );
            }
            let recent = s.replies_since(ago(Duration::from_millis(500)));
            assert!(!recent.is_empty() && recent.iter().all(|r| r == addr), "{} still exchanges with {addr} ({what}): {recent:?}", s.name);
        }
    };
    let mut next_ip = 131;
    let mut moved_total = 0;

    // Plain adds, then plain removals.
    let before = placement(&list_slices(&cluster, "churn"));
    let added: Vec<(String, String)> = (0..10).map(|k| (format!("ch-{}", next_ip + k), ip(next_ip + k))).collect();
    next_ip += 10;
    let specs: Vec<PodSpec> = added.iter().map(|(n, a)| PodSpec { name: n, node: "node-2", ip: a, labels: &labels, ready: true }).collect();
    cluster.create_pods(NS, &specs).expect("add 10 Pods");
    pods.extend(added.iter().cloned());
    let mut want = want;
    want.extend(added.iter().map(|(_, a)| (a.clone(), true)));
    wait_published(&cluster, "churn", &want);
    converged("10 Pods added");
    let after = placement(&list_slices(&cluster, "churn"));
    let moved = before.iter().filter(|(a, s)| after.get(*a).is_some_and(|t| t != *s)).count();
    eprintln!("adding 10 Pods moved {moved} endpoints between slices");
    moved_total += moved;
    sockets_alive("10 Pods added");

    let before = after;
    let gone: Vec<String> = pods.iter().filter(|(_, a)| !on.contains(a)).map(|(n, _)| n.clone()).step_by(9).take(12).collect();
    let gone_refs: Vec<&str> = gone.iter().map(String::as_str).collect();
    cluster.force_delete_pods(NS, &gone_refs).expect("remove 12 Pods");
    for n in &gone {
        if let Some(a) = pods.remove(n) {
            want.remove(&a);
        }
    }
    wait_published(&cluster, "churn", &want);
    converged("12 Pods removed");
    let after = placement(&list_slices(&cluster, "churn"));
    let moved = before.iter().filter(|(a, s)| after.get(*a).is_some_and(|t| t != *s)).count();
    eprintln!("removing 12 Pods moved {moved} endpoints between slices");
    moved_total += moved;
    sockets_alive("12 Pods removed");

    // Replacements on the sockets' addresses, until one of them moved. The
    // Pods on the sockets' addresses go and new ones take their addresses;
    // five more new Pods come, and as many Pods as are new go from the
    // fullest other slice. In the one sync, that slice is the fullest one
    // written and has room for every new endpoint: the controller fills it
    // first.
    let mut socket_moved = false;
    for round in 1..=3 {
        let slices = list_slices(&cluster, "churn");
        let before = placement(&slices);
        let round_start = Instant::now();
        let old: Vec<String> = pods.iter().filter(|(_, a)| on.contains(a)).map(|(n, _)| n.clone()).collect();
        let their_slices: BTreeSet<&String> = on.iter().filter_map(|a| before.get(a)).collect();
        let fullest = slices
            .iter()
            .filter(|(n, _)| !their_slices.contains(n))
            .max_by_key(|(_, s)| s["endpoints"].as_array().map_or(0, Vec::len))
            .map(|(n, _)| n.clone())
            .expect("another slice");
        let mut fresh: Vec<(String, String)> = on.iter().map(|a| (format!("re{round}-{}", a.replace('.', "-")), a.clone())).collect();
        fresh.dedup_by(|x, y| x.1 == y.1);
        for k in 0..5 {
            fresh.push((format!("ch-{}", next_ip + k), ip(next_ip + k)));
        }
        next_ip += 5;
        let others: Vec<String> = pods
            .iter()
            .filter(|(_, a)| !on.contains(a) && before.get(*a) == Some(&fullest))
            .map(|(n, _)| n.clone())
            .take(fresh.len())
            .collect();
        let specs: Vec<PodSpec> =
            fresh.iter().map(|(n, a)| PodSpec { name: n, node: "node-1", ip: a, labels: &labels, ready: true }).collect();
        let mut removed: Vec<&str> = old.iter().map(String::as_str).collect();
        removed.extend(others.iter().map(String::as_str));
        let started = Instant::now();
        // One controller sync sees the Pods go and their replacements
        // come, as when its informer keeps up: with the controller
        // running, a slow machine may let its batch timer fire between
        // the deletions and the creations, and then the reused address
        // is in no slice for a whole batch period, a true departure
        // whose UDP socket the agent rightly ends (seen in CI: 1.97 s).
        let paused = cluster.pause_controllers();
        cluster.force_delete_pods(NS, &removed).expect("remove Pods");
        cluster.create_pods(NS, &specs).expect("replace Pods");
        drop(paused);
        eprintln!("round {round}: removed {removed:?}, created {} Pods, in {:?}", fresh.len(), started.elapsed());
        for n in removed {
            if let Some(a) = pods.remove(n) {
                want.remove(&a);
            }
        }
        for (n, a) in &fresh {
            pods.insert(n.clone(), a.clone());
            want.insert(a.clone(), true);
        }
        // Published: the new Pods' names on the reused addresses.
        eventually(&format!("round {round} to be published"), || {
            let slices = list_slices(&cluster, "churn");
            let names_ok = fresh.iter().all(|(n, a)| endpoint(&slices, a).is_some_and(|(_, e)| e["targetRef"]["name"] == n.as_str()));
            let got: BTreeMap<String, bool> = slices
                .values()
                .flat_map(|s| s["endpoints"].as_array().cloned().unwrap_or_default())
                .filter_map(|e| Some((e["addresses"][0].as_str()?.to_string(), e["conditions"]["ready"] == true)))
                .collect();
            if names_ok && got == want { Ok(()) } else { Err(summary(&slices).len()) }
        });
        converged(&format!("replacement round {round}"));
        let after = placement(&list_slices(&cluster, "churn"));
        let moved: Vec<&String> = before.keys().filter(|a| after.get(*a).is_some_and(|t| Some(t) != before.get(*a))).collect();
        for a in &on {
            let absent = watch.longest_absence(round_start, a);
            eprintln!("round {round}: {a} from {:?} to {:?}, in no slice for at most {absent:?}", before.get(a), after.get(a));
        }
        moved_total += moved.len();
        sockets_alive(&format!("replacement round {round}"));
        if moved.iter().any(|a| on.contains(a)) {
            socket_moved = true;
            break;
        }
    }
    assert!(socket_moved, "in 3 rounds the controller never moved a socket's endpoint to another slice");

    // The controller rewrites every slice when the Service's ports change:
    // endpoints are spread over the slices anew.
    let before = placement(&list_slices(&cluster, "churn"));
    let t_ports = Instant::now();
    cluster
        .apply(&service(
            "churn",
            "10.96.36.10",
            "churn",
            &[("http", 80, "TCP", 8080), ("dns", 53, "UDP", 5353), ("extra", 81, "TCP", 8081)],
            "",
            "",
        ))
        .expect("add a port");
    eventually("the slices to carry the new port", || {
        let slices = list_slices(&cluster, "churn");
        if slices.values().all(|s| s["ports"].as_array().is_some_and(|p| p.len() == 3)) { Ok(()) } else { Err(slices.len()) }
    });
    converged("a port added");
    let after = placement(&list_slices(&cluster, "churn"));
    let moved = before.iter().filter(|(a, s)| after.get(*a).is_some_and(|t| t != *s)).count();
    eprintln!("adding a port moved {moved} endpoints between slices ({:?})", t_ports.elapsed());
    moved_total += moved;
    std::thread::sleep(Duration::from_secs(1));
    sockets_alive("a port added");
    eprintln!("{moved_total} endpoint moves in all; the sockets on {on:?} lived through them");
}

// ---------------------------------------------------------------------------
// 5. Watch semantics.
// ---------------------------------------------------------------------------

/// Connections through the Service while the API server restarts (its
/// watches end), and while etcd is compacted and the API server restarts
/// again (the watches resume from versions too old: 410, relist): a new
/// connection every 5 ms never fails, a long-lived one is never ended, and
/// changes made after each restart arrive: a Pod added (through the
/// controller), and after the relist a Service's topology keys (straight
/// from the agent's Service watch) and another Pod. The agent's watches
/// ask for bookmarks (the API server's audit log of watch requests).
#[test]
fn api_server_restarts_and_a_relist_after_compaction_lose_no_connection() {
    require_root();
    let net = PodNetwork::new();
    net.netns.add_loopback_addrs(&["10.244.37.0/24"]).expect("pod addresses");
    let ips = ["10.244.37.1", "10.244.37.2", "10.244.37.3", "10.244.37.4"];
    let _servers = PodServers::start(&net.netns, &named(&[("w-1", ips[0]), ("w-2", ips[1]), ("w-3", ips[2]), ("w-4", ips[3])]), 8080, 5353);
    let mut cluster = RealCluster::start("watch-restarts").expect("start the real cluster");
    cluster.create_node("node-1", &[(ZONE, "z1")]).expect("create node-1");
    cluster.create_node("node-2", &[(ZONE, "z1")]).expect("create node-2");
    cluster.apply(&service("w", "10.96.37.10", "w", &[("http", 80, "TCP", 8080)], "", "")).expect("Service");
    let pod = |name: &'static str, node: &'static str, ip: &'static str| PodSpec { name, node, ip, labels: &[("app", "w")], ready: true };
    cluster.create_pods(NS, &[pod("w-1", "node-1", ips[0]), pod("w-2", "node-2", ips[1])]).expect("create w-1, w-2");
    wait_published(&cluster, "w", &all_ready(&ips[..2]));
    let mut node = Node::new("node-1");
    node.start_kube_agent(cluster.admin_kubeconfig(), &[]);
    let to = "10.96.37.10:80";
    wait_for_backends(&node, &net, to, &[], &["w-1", "w-2"]);

    let conns = Stream::start(
        "new connections",
        pod_probe(&node, &net.netns, &["--to", to, "--count", "1000000", "--interval-ms", "5", "--timeout-ms", "2000"]),
    );
    let stream = stream_on(&node, &net, "the long-lived connection", &args(to, &TCP_STREAM), "w-1");
    let t0 = Instant::now();
    let expired = |node: &Node| node.agent_log().matches("watch expired").count();

    let started = Instant::now();
    cluster.restart_apiserver().expect("restart kube-apiserver");
    eprintln!("kube-apiserver restarted in {:?}", started.elapsed());
    let changed = Instant::now();
    cluster.create_pods(NS, &[pod("w-3", "node-1", ips[2])]).expect("create w-3");
    wait_published_for(&cluster, "w", &all_ready(&ips[..3]), wait_limit() * 2);
    let published = changed.elapsed();
    wait_for_backends(&node, &net, to, &[], &["w-1", "w-2", "w-3"]);
    eprintln!("w-3 added after the restart: published {published:?}, programmed {:?} later", changed.elapsed());
    // A restart alone re-initializes the watch cache at a newer version.
    let after_restart = expired(&node);
    eprintln!("{after_restart} watches expired (410) after the plain restart");

    let revision = cluster.compact_etcd().expect("compact etcd");
    let started = Instant::now();
    cluster.restart_apiserver().expect("restart kube-apiserver after the compaction");
    eprintln!("etcd compacted at revision {revision}; kube-apiserver restarted in {:?}", started.elapsed());
    let relisted = eventually("the agent's watches to expire (410) and relist", || {
        let n = expired(&node);
        if n > after_restart {
            Ok(n - after_restart)
        } else {
            Err(node.agent_log().lines().rev().take(5).map(str::to_string).collect::<Vec<_>>())
        }
    });
    eprintln!("{relisted} watches expired after the compaction and were relisted");
    // Straight from the Service watch: node-1 keeps to its own Pods.
    let changed = Instant::now();
    cluster
        .kubectl(&["-n", NS, "annotate", "service", "w", "topoproxy.io/topology-keys=kubernetes.io/hostname"])
        .expect("annotate Service w");
    wait_for_backends(&node, &net, to, &[], &["w-1", "w-3"]);
    eprintln!("topology keys set after the relist: programmed {:?} later", changed.elapsed());
    let changed = Instant::now();
    cluster.create_pods(NS, &[pod("w-4", "node-1", ips[3])]).expect("create w-4");
    wait_published_for(&cluster, "w", &all_ready(&ips), wait_limit() * 2);
    let published = changed.elapsed();
    wait_for_backends(&node, &net, to, &[], &["w-1", "w-3", "w-4"]);
    eprintln!("w-4 added after the relist: published {published:?}, programmed {:?} later", changed.elapsed());
    // More traffic after the relist.
    std::thread::sleep(Duration::from_secs(1));

    let (ok, failed) = conns.counts();
    eprintln!("{ok} new connections, {} failed, across two API server restarts", failed.len());
    assert!(ok > 200, "the client kept connecting ({ok})");
    assert!(failed.is_empty(), "{} of {} new connections failed, e.g. {:?}", failed.len(), ok + failed.len(), failed.first());
    assert_eq!(stream.first_failure_at(t0), None, "the long-lived connection stays");
    assert!(stream.replies_since(ago(Duration::from_millis(500))).iter().all(|r| r == "w-1"), "still on w-1");

    // Every watch the agent opened asked for bookmarks. The agent is the
    // admin's other client: kubectl and the controller manager name
    // themselves in the User-Agent.
    let audit = cluster.audit_log();
    let agent_watches: Vec<Value> = audit
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|e| e["stage"] == "ResponseStarted")
        .filter(|e| {
            let ua = e["userAgent"].as_str().unwrap_or_default();
            !ua.starts_with("kubectl") && !ua.starts_with("kube-controller-manager") && !ua.starts_with("kube-apiserver")
        })
        .collect();
    let uris: Vec<&str> = agent_watches.iter().filter_map(|e| e["requestURI"].as_str()).collect();
    eprintln!("the agent's watch requests: {uris:#?}");
    for kind in ["/api/v1/services", "/apis/discovery.k8s.io/v1/endpointslices", "/api/v1/nodes"] {
        assert!(uris.iter().any(|u| u.starts_with(kind)), "the agent watched {kind}: {uris:#?}");
    }
    let without: Vec<&&str> = uris.iter().filter(|u| !u.contains("allowWatchBookmarks=true")).collect();
    assert!(without.is_empty(), "watches without bookmarks: {without:#?}");
}

// ---------------------------------------------------------------------------
// 6. Agent restart.
// ---------------------------------------------------------------------------

/// The agent stops (SIGTERM, as a DaemonSet rollout does) and starts again
/// while clients connect: the pinned maps keep translating, no new
/// connection fails, the long-lived TCP connection and connected UDP socket
/// stay, and what changed while it was down (a Pod added, one removed)
/// arrives: new connections follow it, and of the sockets on the removed
/// Pod (never seen terminating) the connected UDP one is ended, the TCP one
/// kept.
#[test]
fn an_agent_restart_against_the_real_server_loses_no_connection() {
    require_root();
    let net = PodNetwork::new();
    net.netns.add_loopback_addrs(&["10.244.38.0/24"]).expect("pod addresses");
    let ips = ["10.244.38.1", "10.244.38.2", "10.244.38.3"];
    let _servers = PodServers::start(&net.netns, &named(&[("r-1", ips[0]), ("r-2", ips[1]), ("r-3", ips[2])]), 8080, 5353);
    let cluster = RealCluster::start("agent-restart").expect("start the real cluster");
    cluster.create_node("node-1", &[(ZONE, "z1")]).expect("create node-1");
    cluster.apply(&service("r", "10.96.38.10", "r", &[("http", 80, "TCP", 8080), ("dns", 53, "UDP", 5353)], "", "")).expect("Service");
    let pod = |name: &'static str, ip: &'static str| PodSpec { name, node: "node-1", ip, labels: &[("app", "r")], ready: true };
    cluster.create_pods(NS, &[pod("r-1", ips[0]), pod("r-2", ips[1])]).expect("create r-1, r-2");
    wait_published(&cluster, "r", &all_ready(&ips[..2]));
    let mut node = Node::new("node-1");
    node.start_kube_agent(cluster.admin_kubeconfig(), &[]);
    let (tcp_to, udp_to) = ("10.96.38.10:80", "10.96.38.10:53");
    wait_for_backends(&node, &net, tcp_to, &[], &["r-1", "r-2"]);

    let conns = Stream::start(
        "new connections",
        pod_probe(&node, &net.netns, &["--to", tcp_to, "--count", "1000000", "--interval-ms", "5", "--timeout-ms", "2000"]),
    );
    let tcp = stream_on(&node, &net, "the TCP connection", &args(tcp_to, &TCP_STREAM), "r-1");
    let udp = stream_on(&node, &net, "the connected UDP socket", &args(udp_to, &UDP_STREAM), "r-1");
    // And on r-2, which goes while the agent is down.
    let tcp_2 = stream_on(&node, &net, "the TCP connection on r-2", &args(tcp_to, &TCP_STREAM), "r-2");
    let udp_2 = stream_on(&node, &net, "the connected UDP socket on r-2", &args(udp_to, &UDP_STREAM), "r-2");
    let t0 = Instant::now();

    node.stop_agent();
    let down = Instant::now();
    cluster.create_pods(NS, &[pod("r-3", ips[2])]).expect("create r-3");
    cluster.force_delete_pod(NS, "r-2").expect("delete r-2");
    wait_published(&cluster, "r", &all_ready(&[ips[0], ips[2]]));
    std::thread::sleep(Duration::from_millis(500));
    node.start_kube_agent(cluster.admin_kubeconfig(), &[]);
    eventually("the new agent's first sync", || if node.agent_log().matches("first sync applied").count() >= 2 { Ok(()) } else { Err(()) });
    eprintln!("the agent was down for {:?}", down.elapsed());
    wait_for_backends(&node, &net, tcp_to, &[], &["r-1", "r-3"]);
    wait_for_backends(&node, &net, udp_to, &["--udp"], &["r-1", "r-3"]);
    std::thread::sleep(Duration::from_secs(1));

    let (ok, failed) = conns.counts();
    eprintln!("{ok} new connections, {} failed, across the agent's restart", failed.len());
    assert!(ok > 200, "the client kept connecting ({ok})");
    assert!(failed.is_empty(), "{} of {} new connections failed, e.g. {:?}", failed.len(), ok + failed.len(), failed.first());
    for s in [&tcp, &udp] {
        assert_eq!(s.first_failure_at(t0), None, "{} stays across the restart", s.name);
        let recent = s.replies_since(ago(Duration::from_millis(500)));
        assert!(!recent.is_empty() && recent.iter().all(|r| r == "r-1"), "{} still exchanges with r-1: {recent:?}", s.name);
    }
    // r-2 left while the agent was down, without ever being seen
    // terminating: its connected UDP socket is ended (gone), its TCP
    // connection kept.
    let (_, failure) = eventually("the connected UDP socket on r-2 to be ended", || udp_2.first_failure_at(t0).ok_or(()));
    assert!(udp_aborted(&failure), "aborted by the agent: {failure}");
    assert_eq!(tcp_2.first_failure_at(t0), None, "TCP to r-2, gone without terminating, stays");
    let m = http_get(node.metrics_address(), "/metrics").map(|(_, b)| b).unwrap_or_default();
    let series = "topoproxy_sockets_terminated_total{protocol=\"udp\",reason=\"deleted\"}";
    assert!(metric(&m, series).is_some_and(|n| n >= 1.0), "{series}: {:?}", metric(&m, series));
}

// ---------------------------------------------------------------------------
// Hold, don't guess (issue #47).
// ---------------------------------------------------------------------------

/// New connections from `node` to `to` one after the other, 1 ms apart,
/// for as long as the test runs: a frontend programmed with another set
/// for a moment is seen.
fn tight_loop(node: &Node, net: &PodNetwork, to: &str) -> Stream {
    let args = ["--to", to, "--count", "100000000", "--interval-ms", "1", "--timeout-ms", "300"];
    Stream::start(&format!("new connections to {to}"), pod_probe(node, &net.netns, &args))
}

/// Waits until the tight loop has reached every backend of `want`, and
/// 200 connections more; then no connection it made may have reached
/// another backend than those `allowed`.
fn assert_only(client: &Stream, want: &[&str], allowed: &[&str]) {
    let want = set(want);
    let seen = |c: &Stream| c.replies().into_iter().collect::<BTreeSet<String>>();
    eventually(&format!("{} to reach {want:?}", client.name), || {
        let got = seen(client);
        if want.is_subset(&got) { Ok(()) } else { Err(got) }
    });
    let n = client.replies().len();
    eventually(&format!("{} to make 200 more connections", client.name), || {
        if client.replies().len() >= n + 200 { Ok(()) } else { Err(client.replies().len()) }
    });
    let allowed = set(allowed);
    let outside: Vec<String> = client.replies().into_iter().filter(|r| !allowed.contains(r)).collect();
    assert!(outside.is_empty(), "{}: {} connections reached a backend outside {allowed:?}: {:?}", client.name, outside.len(), {
        let mut o = outside.clone();
        o.dedup();
        o
    });
}

/// A Service with OpenYurt's `openyurt.io/nodepool, *` created by watch
/// while the agent runs: its slice names other Nodes whose pool the agent
/// has not listed (it watches other Nodes only for labels a Service
/// needs). Before issue #47 the agent programmed it once from the slice
/// alone (no endpoint matched a pool, so `*`: every endpoint), and
/// connections went to the other pool until the Nodes were listed. Now
/// it holds the Service until they are, and a client connecting in a
/// tight loop from the moment the Service exists only ever reaches its
/// pool. node-1 (the agent's, no Pod) and node-3 in hangzhou, node-2 in
/// shanghai; Pods on node-2 and node-3.
#[test]
fn a_node_pool_service_created_by_watch_never_reaches_another_pool() {
    require_root();
    let mut net = PodNetwork::new();
    for (pod, ip) in [("np-2", "10.244.47.2"), ("np-3", "10.244.47.3")] {
        net.backend(pod, ip, &[9376]);
    }
    let cluster = RealCluster::start("hold-node-pool").expect("start the real cluster");
    for (node, pool) in [("node-1", "hangzhou"), ("node-2", "shanghai"), ("node-3", "hangzhou")] {
        cluster.create_node(node, &[(POOL, pool)]).expect("create node");
    }
    let pods = ready_pods(&[("app", "np")], &[("np-2", "node-2", "10.244.47.2"), ("np-3", "node-3", "10.244.47.3")]);
    cluster.create_pods(NS, &pods).expect("create the Pods");
    let mut n1 = Node::new("node-1");
    n1.start_kube_agent(cluster.admin_kubeconfig(), &[]);
    eventually("the agent to be ready", || if readyz(&n1).0 == 200 { Ok(()) } else { Err(readyz(&n1)) });

    let frontend = "10.96.47.10:80";
    let client = tight_loop(&n1, &net, frontend);
    let port = [("http", 80, "TCP", 9376)];
    cluster
        .apply(&service("pooled", "10.96.47.10", "np", &port, "openyurt.io/topologyKeys: \"openyurt.io/nodepool, *\"", ""))
        .expect("create the Service");
    assert_only(&client, &["np-3"], &["np-3"]);
    let log = n1.agent_log();
    assert!(log.contains("holding the Service as programmed"), "the agent said it held the Service: {log}");
    assert!(log.contains("the labels it waited for are listed: programmed"), "{log}");
}

/// The same hold for traffic from outside (issue #47): a NodePort Service
/// with `openyurt.io/nodepool, *` created by watch, reached from a client
/// namespace on node-1's link in a tight loop from the moment it exists.
/// The agent runs in node-1's own namespace, with its TC programs on the
/// client-facing device, and reaches the API server through a relay. Its
/// TC entry stays unwritten while the pools are not listed (a guess from
/// the slice alone would be `*`, both Pods), then holds only np-3. The two
/// Pods live in one pod namespace behind node-1 (the slices place them on
/// node-2 and node-3; routing does not care):
///
/// ```text
/// client 10.0.47.1 -- 10.0.47.2 node-1 10.244.47.1 -- pods 10.244.47.2 (np-2), .3 (np-3)
/// ```
#[test]
fn a_node_pool_node_port_created_by_watch_never_reaches_another_pool_from_outside() {
    require_root();
    let cluster = RealCluster::start("hold-node-pool-tc").expect("start the real cluster");
    for (node, pool) in [("node-1", "hangzhou"), ("node-2", "shanghai"), ("node-3", "hangzhou")] {
        cluster.create_node(node, &[(POOL, pool)]).expect("create node");
    }
    let node_ns = Netns::new("tph").expect("node netns");
    let client = Netns::new("tph").expect("client netns");
    let pods_ns = Netns::new("tph").expect("pod netns");
    node_ns.veth("n-c", &client, "c-n").expect("veth node-client");
    node_ns.veth("n-pod", &pods_ns, "eth0").expect("veth node-pods");
    for (ns, cidr, dev) in [
        (&client, "10.0.47.1/24", "c-n"),
        (&node_ns, "10.0.47.2/24", "n-c"),
        (&node_ns, "10.244.47.1/24", "n-pod"),
        (&pods_ns, "10.244.47.2/24", "eth0"),
        (&pods_ns, "10.244.47.3/24", "eth0"),
    ] {
        ns.ip(&["addr", "add", cidr, "dev", dev]).unwrap_or_else(|e| panic!("{cidr} on {dev}: {e}"));
    }
    pods_ns.ip(&["route", "add", "default", "via", "10.244.47.1"]).expect("pod route");
    node_ns.sysctl("net.ipv4.ip_forward", "1").expect("ip_forward");
    let _pods: Vec<Guarded> = [("np-2", "10.244.47.2:9376"), ("np-3", "10.244.47.3:9376")]
        .iter()
        .map(|(name, listen)| spawn_backend(&agent_bin(), &pods_ns, name, &[listen.to_string()]).expect("backend"))
        .collect();
    let pods = ready_pods(&[("app", "tc")], &[("np-2", "node-2", "10.244.47.2"), ("np-3", "node-3", "10.244.47.3")]);
    cluster.create_pods(NS, &pods).expect("create the Pods");

    let api: std::net::SocketAddr = cluster.apiserver_url().trim_start_matches("https://").parse().expect("API server address");
    let relayed = std::net::SocketAddr::from(([127, 0, 0, 1], 6443));
    let _relay = Relay::start(&node_ns, relayed, api).expect("relay to the API server");
    let kubeconfig = cluster.admin_kubeconfig().with_file_name("node-1-relayed.kubeconfig");
    let admin = std::fs::read_to_string(cluster.admin_kubeconfig()).expect("read the kubeconfig");
    std::fs::write(&kubeconfig, admin.replace(&cluster.apiserver_url(), &format!("https://{relayed}"))).expect("write the kubeconfig");
    let mut n1 = Node::new("node-1");
    // TC on both links: a Pod the slices place on another Node gets the
    // client's flow from node-1's address (SNAT), and its reply comes back
    // on n-pod, whose TC ingress turns it back.
    n1.start_kube_agent_in(Some(&node_ns), &kubeconfig, "n-c,n-pod", &[]);
    eventually("the agent to attach its TC programs and sync", || {
        let log = n1.agent_log();
        if log.contains("external traffic datapath ready") && log.contains("first sync applied; ready") { Ok(()) } else { Err(()) }
    });

    let mut probe = proxy_test_support::sandbox::command_in(agent_bin(), Some(&client), None).expect("probe command");
    probe.arg("probe").args(["--to", "10.0.47.2:30047", "--count", "100000000", "--interval-ms", "1", "--timeout-ms", "300"]);
    let from_outside = Stream::start("new connections from outside to node-1:30047", probe);
    cluster
        .apply(&format!(
            "apiVersion: v1\nkind: Service\nmetadata:\n  name: pooled-np\n  namespace: {NS}\n  annotations: {{openyurt.io/topologyKeys: \"openyurt.io/nodepool, *\"}}\nspec:\n  type: NodePort\n  clusterIP: 10.96.47.20\n  selector: {{app: tc}}\n  ports:\n  - {{name: http, port: 80, protocol: TCP, targetPort: 9376, nodePort: 30047}}\n"
        ))
        .expect("create the Service");
    assert_only(&from_outside, &["np-3"], &["np-3"]);
    let log = n1.agent_log();
    assert!(log.contains("holding the Service as programmed"), "the agent said it held the Service: {log}");
}

/// A Service whose keys change to a label the agent does not watch yet:
/// from OpenYurt's node pool to `example.com/rack, *`. Until the Node
/// watch lists the racks, the agent keeps the pool's set (not a guess from
/// the slices, which carry no rack: `*`, every endpoint); then the rack's.
/// A client connecting in a tight loop never reaches node-4's Pod, in
/// neither pool nor rack. node-1 (the agent's, no Pod): hangzhou, k1;
/// node-2: shanghai, k1; node-3: hangzhou, k2; node-4: shanghai, k2.
#[test]
fn a_service_whose_keys_change_to_a_new_label_keeps_its_set_until_it_is_listed() {
    const RACK: &str = "example.com/rack";
    require_root();
    let mut net = PodNetwork::new();
    for (pod, ip) in [("kc-2", "10.244.48.2"), ("kc-3", "10.244.48.3"), ("kc-4", "10.244.48.4")] {
        net.backend(pod, ip, &[9376]);
    }
    let cluster = RealCluster::start("hold-new-label").expect("start the real cluster");
    for (node, pool, rack) in
        [("node-1", "hangzhou", "k1"), ("node-2", "shanghai", "k1"), ("node-3", "hangzhou", "k2"), ("node-4", "shanghai", "k2")]
    {
        cluster.create_node(node, &[(POOL, pool), (RACK, rack)]).expect("create node");
    }
    let mut n1 = Node::new("node-1");
    n1.start_kube_agent(cluster.admin_kubeconfig(), &[]);
    eventually("the agent to be ready", || if readyz(&n1).0 == 200 { Ok(()) } else { Err(readyz(&n1)) });
    let frontend = "10.96.48.10:80";
    let client = tight_loop(&n1, &net, frontend);
    let port = [("http", 80, "TCP", 9376)];
    cluster
        .apply(&service("racked", "10.96.48.10", "kc", &port, "openyurt.io/topologyKeys: openyurt.io/nodepool", ""))
        .expect("create the Service");
    let pods = ready_pods(
        &[("app", "kc")],
        &[("kc-2", "node-2", "10.244.48.2"), ("kc-3", "node-3", "10.244.48.3"), ("kc-4", "node-4", "10.244.48.4")],
    );
    cluster.create_pods(NS, &pods).expect("create the Pods");
    assert_only(&client, &["kc-3"], &["kc-3"]);

    cluster
        .kubectl(&[
            "-n",
            NS,
            "annotate",
            "service",
            "racked",
            "openyurt.io/topologyKeys-",
            &format!("topoproxy.io/topology-keys={RACK}, *"),
        ])
        .expect("change the keys");
    assert_only(&client, &["kc-2"], &["kc-2", "kc-3"]);
    // Programmed once: from then on, the rack's set alone.
    let since = Instant::now();
    let n = client.replies().len();
    eventually("200 more connections", || if client.replies().len() >= n + 200 { Ok(()) } else { Err(client.replies().len()) });
    let after: BTreeSet<String> = client.replies_since(since).into_iter().collect();
    assert_eq!(after, set(&["kc-2"]), "the rack's set once listed");
    let log = n1.agent_log();
    assert!(log.contains("holding the Service as programmed"), "the agent said it held the Service: {log}");
}
