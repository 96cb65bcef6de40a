//! External traffic at TC: NodePort and externalIPs from a client
//! outside the cluster, through two simulated nodes.
//!
//! Five isolated namespaces, no link to the host's:
//!
//! ```text
//!            client (10.0.1.1 / 10.0.2.1, fd00:1::1 / fd00:2::1)
//!            /                       \
//!   c-a -- a-c 10.0.1.2         c-b -- b-c 10.0.2.2
//!   node-a                           node-b
//!        a-b 10.0.3.1 ---------- b-a 10.0.3.2
//!   a-pod 10.244.1.1                 b-pod 10.244.2.1
//!     |                                |
//!   eth0 10.244.1.10 (pod-a)         eth0 10.244.2.10 (pod-b)
//! ```
//!
//! Each node runs its own agent inside its namespace (TC attach needs the
//! device in the agent's namespace). node-a names its two external links
//! in `--devices`; node-b runs with the default, `auto` (every device with
//! an address: b-a, b-c and the pod veth b-pod). Each node has a pod
//! namespace behind a veth pair, as a CNI would set it up: the node side
//! holds the pod subnet's gateway, the pod's default route points there.
//! Backends run in the pod namespaces; the nodes route each other's pod
//! range over the a-b link. The client has no route to any pod: it can only
//! reach backends through the nodes' translation. Replies of local backends
//! come in from the pod veth and are forwarded to the client-facing device,
//! whose TC egress turns their source back into the frontend.

mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::mpsc;
use std::time::Duration;

use proxy_agent::datapath::pins;
use proxy_test_support::sandbox::{Cgroup, Guarded, Netns, PinDir, command_in, echo_server, in_netns, spawn_backend, spawn_in_netns};
use proxy_test_support::wait::{eventually, wait_limit};
use support::*;

struct World {
    client: Netns,
    nodes: Vec<SimNode>,
    _backends: Vec<Guarded>,
}

struct SimNode {
    name: &'static str,
    ns: Netns,
    /// The namespace of this node's backend pod.
    pod: Netns,
    cgroup: Cgroup,
    pins: PinDir,
    manifests: TempDir,
    /// `--devices`; `None` runs the agent with the default (`auto`).
    devices: Option<&'static str>,
    extra: Vec<&'static str>,
    agent: Option<Guarded>,
    log: PathBuf,
}

impl SimNode {
    fn start_agent(&mut self) {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log).expect("open log");
        let mut cmd = command_in(agent_bin(), Some(&self.ns), None).expect("agent command");
        cmd.arg("run")
            .args(["--node", self.name])
            .arg("--manifests")
            .arg(&self.manifests.0)
            .arg("--cgroup")
            .arg(self.cgroup.path())
            .arg("--bpffs")
            .arg(self.pins.path())
            .args(["--poll-interval-ms", "50"])
            .args(self.devices.map(|d| ["--devices", d]).into_iter().flatten())
            .args(&self.extra)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("dup log"))
            .stderr(log);
        self.agent = Some(Guarded::spawn(&mut cmd).expect("start agent"));
    }

    fn stop_agent(&mut self) {
        if let Some(mut a) = self.agent.take() {
            a.terminate(Duration::from_secs(10)).expect("stop agent");
        }
    }

    fn write_manifest(&self, yaml: &str) {
        let tmp = self.manifests.0.join(".cluster.yaml.tmp");
        std::fs::write(&tmp, yaml).expect("write manifest");
        std::fs::rename(&tmp, self.manifests.0.join("cluster.yaml")).expect("rename manifest");
    }

    fn counters(&self) -> std::collections::BTreeMap<&'static str, u64> {
        proxy_agent::datapath::dump::np_counters(self.pins.path()).unwrap_or_default()
    }

    fn counter(&self, name: &str) -> u64 {
        self.counters().get(name).copied().unwrap_or(0)
    }
}

impl Drop for SimNode {
    fn drop(&mut self) {
        if let Some(mut a) = self.agent.take() {
            let _ = a.0.kill();
            let _ = a.0.wait();
        }
        if std::thread::panicking() {
            eprintln!("--- agent log of {} ---\n{}", self.name, std::fs::read_to_string(&self.log).unwrap_or_default());
        }
    }
}

const NODE_A: &str = "10.0.1.2";
const NODE_B: &str = "10.0.2.2";
const NODE_A6: &str = "fd00:1::2";
const POD_A: &str = "10.244.1.10";
const POD_B: &str = "10.244.2.10";
const POD_A6: &str = "fd00:244:1::10";
const POD_B6: &str = "fd00:244:2::10";

impl World {
    fn new() -> World {
        require_root();
        let client = Netns::new("tnp").expect("client netns");
        let mut nodes = Vec::new();
        for (name, dev_c, dev_n, dev_peer) in [("node-a", "a-c", "c-a", "a-b"), ("node-b", "b-c", "c-b", "b-a")] {
            let ns = Netns::new("tnp").expect("node netns");
            ns.veth(dev_c, &client, dev_n).expect("veth client-node");
            let pod = Netns::new("tnp").expect("pod netns");
            let manifests = TempDir::new("tnp-manifests");
            let log = manifests.0.join("agent.log.txt");
            nodes.push(SimNode {
                name,
                ns,
                pod,
                cgroup: Cgroup::new("tnp").expect("cgroup"),
                pins: PinDir::new("tnp").expect("pins"),
                manifests,
                // node-b finds its devices itself (every interface with an
                // address: b-a, b-c, b-pod); its SNAT address is then the
                // first one's (sorted by name), b-a's 10.0.3.2.
                devices: if name == "node-a" { Some("a-c,a-b") } else { None },
                extra: Vec::new(),
                agent: None,
                log,
            });
            let _ = dev_peer;
        }
        nodes[0].ns.veth("a-b", &nodes[1].ns, "b-a").expect("veth a-b");
        let (a, b) = (&nodes[0].ns, &nodes[1].ns);
        let addr = |ns: &Netns, cidr: &str, dev: &str| {
            let mut args = vec!["addr", "add", cidr, "dev", dev];
            if cidr.contains(':') {
                args.push("nodad");
            }
            ns.ip(&args).unwrap_or_else(|e| panic!("{cidr} on {dev}: {e}"));
        };
        addr(&client, "10.0.1.1/24", "c-a");
        addr(&client, "fd00:1::1/64", "c-a");
        addr(&client, "10.0.2.1/24", "c-b");
        addr(&client, "fd00:2::1/64", "c-b");
        addr(a, "10.0.1.2/24", "a-c");
        addr(a, "fd00:1::2/64", "a-c");
        addr(a, "10.0.3.1/24", "a-b");
        addr(a, "fd00:3::1/64", "a-b");
        addr(b, "10.0.2.2/24", "b-c");
        addr(b, "fd00:2::2/64", "b-c");
        addr(b, "10.0.3.2/24", "b-a");
        addr(b, "fd00:3::2/64", "b-a");
        // The pods: a veth pair per node, the gateway on the node side.
        for (node, dev, subnet) in [(&nodes[0], "a-pod", "1"), (&nodes[1], "b-pod", "2")] {
            node.ns.veth(dev, &node.pod, "eth0").expect("veth node-pod");
            addr(&node.ns, &format!("10.244.{subnet}.1/24"), dev);
            addr(&node.ns, &format!("fd00:244:{subnet}::1/64"), dev);
            addr(&node.pod, &format!("10.244.{subnet}.10/24"), "eth0");
            addr(&node.pod, &format!("fd00:244:{subnet}::10/64"), "eth0");
            node.pod.ip(&["route", "add", "default", "via", &format!("10.244.{subnet}.1")]).expect("pod route");
            node.pod.ip(&["-6", "route", "add", "default", "via", &format!("fd00:244:{subnet}::1")]).expect("pod route6");
        }
        // Static routes between the nodes only: pod ranges, and each node's
        // client-facing subnet (the SNAT address lives there).
        for (ns, args) in [
            (a, ["route", "add", "10.244.2.0/24", "via", "10.0.3.2"]),
            (a, ["route", "add", "10.0.2.0/24", "via", "10.0.3.2"]),
            (b, ["route", "add", "10.244.1.0/24", "via", "10.0.3.1"]),
            (b, ["route", "add", "10.0.1.0/24", "via", "10.0.3.1"]),
        ] {
            ns.ip(&args).expect("route");
        }
        for (ns, args) in [
            (a, ["-6", "route", "add", "fd00:244:2::/64", "via", "fd00:3::2"]),
            (a, ["-6", "route", "add", "fd00:2::/64", "via", "fd00:3::2"]),
            (b, ["-6", "route", "add", "fd00:244:1::/64", "via", "fd00:3::1"]),
            (b, ["-6", "route", "add", "fd00:1::/64", "via", "fd00:3::1"]),
        ] {
            ns.ip(&args).expect("route6");
        }
        for ns in [a, b] {
            ns.sysctl("net.ipv4.ip_forward", "1").expect("ip_forward");
            ns.sysctl("net.ipv6.conf.all.forwarding", "1").expect("ipv6 forwarding");
        }
        let mut backends = Vec::new();
        for (node, name, ips) in [(&nodes[0].pod, "pod-a", [POD_A, POD_A6]), (&nodes[1].pod, "pod-b", [POD_B, POD_B6])] {
            let listen: Vec<String> = ips
                .iter()
                .flat_map(|ip| {
                    let host = if ip.contains(':') { format!("[{ip}]") } else { ip.to_string() };
                    [format!("{host}:8080"), format!("{host}:5353")]
                })
                .collect();
            backends.push(spawn_backend(&agent_bin(), node, name, &listen).expect("backend"));
        }
        World { client, nodes, _backends: backends }
    }

    fn publish(&self, yaml: &str) {
        for n in &self.nodes {
            n.write_manifest(yaml);
        }
    }

    fn start(&mut self) {
        for n in &mut self.nodes {
            n.start_agent();
        }
    }

    fn probe(&self, args: &[&str]) -> Vec<serde_json::Value> {
        let mut cmd = command_in(agent_bin(), Some(&self.client), None).expect("probe command");
        cmd.arg("probe").args(args).stdin(Stdio::null()).stderr(Stdio::inherit());
        let out = cmd.output().expect("run probe");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("probe printed {l:?}: {e}")))
            .collect()
    }

    fn wait_for(&self, to: &str, extra: &[&str], want: &[&str]) {
        let want = set(want);
        eventually(&format!("{to} {extra:?} from the client to reach exactly {want:?}"), || {
            let mut args = vec!["--to", to, "--count", "24", "--timeout-ms", "1000"];
            args.extend_from_slice(extra);
            let r = self.probe(&args);
            let got = replies(&r);
            if got == want && r.iter().all(|x| x["ok"] == true) { Ok(()) } else { Err((got, r.into_iter().find(|x| x["ok"] != true))) }
        });
    }
}

/// A Service with ClusterIP, NodePorts 30080/TCP and 30053/UDP, an external
/// IP and endpoints on `on` nodes (both families).
fn service(name: &str, policy: &str, hc_port: Option<u16>, on: &[&str], extra_ports: &str) -> String {
    let eps = |v6: bool| -> String {
        on.iter()
            .map(|n| {
                let ip = match (*n, v6) {
                    ("node-a", false) => POD_A,
                    ("node-a", true) => POD_A6,
                    ("node-b", false) => POD_B,
                    _ => POD_B6,
                };
                format!("- addresses: [\"{ip}\"]\n  conditions: {{ready: true}}\n  nodeName: {n}\n")
            })
            .collect()
    };
    let hc = hc_port.map(|p| format!("  healthCheckNodePort: {p}\n")).unwrap_or_default();
    let mut out = format!(
        "---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: default}}\nspec:\n  type: LoadBalancer\n  clusterIP: 10.96.0.10\n  clusterIPs: [10.96.0.10, \"fd00:96::10\"]\n  externalIPs: [\"192.0.2.10\"]\n  externalTrafficPolicy: {policy}\n{hc}  ports:\n  - {{name: http, port: 80, protocol: TCP, targetPort: 8080, nodePort: 30080}}\n  - {{name: dns, port: 53, protocol: UDP, targetPort: 5353, nodePort: 30053}}\n{extra_ports}status:\n  loadBalancer:\n    ingress: [{{ip: 198.51.100.7}}]\n"
    );
    for (fam, v6) in [("IPv4", false), ("IPv6", true)] {
        let e = eps(v6);
        out.push_str(&format!(
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}-{}\n  namespace: default\n  labels: {{kubernetes.io/service-name: {name}}}\naddressType: {fam}\nports:\n- {{name: http, port: 8080, protocol: TCP}}\n- {{name: dns, port: 5353, protocol: UDP}}\nendpoints:{}\n{e}",
            fam.to_lowercase(),
            if e.is_empty() { " []" } else { "" }
        ));
    }
    out
}

#[test]
fn cluster_policy_reaches_local_and_remote_backends_and_replies_come_from_the_node_port() {
    let mut w = World::new();
    w.publish(&service("web", "Cluster", None, &["node-a", "node-b"], ""));
    w.start();
    // TCP through either node reaches both backends (local: DNAT only;
    // remote: DNAT + SNAT, reply reversed at node-a's ingress).
    w.wait_for(&format!("{NODE_A}:30080"), &[], &["pod-a", "pod-b"]);
    w.wait_for(&format!("{NODE_B}:30080"), &[], &["pod-a", "pod-b"]);
    // UDP, unconnected: recvfrom must report the address the client used.
    w.wait_for(&format!("{NODE_A}:30053"), &["--udp"], &["pod-a", "pod-b"]);
    for r in w.probe(&["--to", &format!("{NODE_A}:30053"), "--udp", "--per-socket", "3", "--count", "12"]) {
        assert_eq!(r["ok"], true, "{r}");
        assert_eq!(r["sameBackend"], true, "one flow, one backend: {r}");
        for p in r["peers"].as_array().expect("peers") {
            assert_eq!(p, &format!("{NODE_A}:30053"), "reply must come from the node port: {r}");
        }
    }
    // IPv6 NodePort.
    w.wait_for(&format!("[{NODE_A6}]:30080"), &[], &["pod-a", "pod-b"]);
    w.wait_for(&format!("[{NODE_A6}]:30053"), &["--udp"], &["pod-a", "pod-b"]);
    let c = w.nodes[0].counters();
    assert!(c["new_flow"] > 0 && c["tracked"] > 0, "{c:?}");
    assert_eq!(c["rewrite_failed"], 0, "{c:?}");
    // The TC fast path (on by default) sent the remote backend's flows
    // both ways once the neighbours were resolved: on every kernel the
    // tests boot, the programs with it were loaded, not the fallback
    // without it (which would only say so in the log).
    let fast = proxy_agent::datapath::dump::np_fast_counters(w.nodes[0].pins.path()).unwrap_or_default();
    assert!(fast.get("tc_fast_forwarded").is_some_and(|n| *n > 0), "{fast:?}");
    assert!(fast.get("tc_fast_reply_forwarded").is_some_and(|n| *n > 0), "{fast:?}");
    // pod-a is local to node-a, behind its veth a-pod: by default (`auto`)
    // its packets go through the stack (`--tc-fast-path all` would hand
    // them to `bpf_redirect_peer`; tests/xdp.rs), which sees the pod's
    // replies as conntrack sees a flow it saw start.
    assert!(fast.get("tc_fast_local_forwarded").is_none_or(|n| *n == 0), "pod-a is local to node-a: {fast:?}");
    assert!(fast.get("tc_stack_local_not_peer").is_some_and(|n| *n > 0), "pod-a's packets counted as left to the stack: {fast:?}");
}

#[test]
fn load_balancer_and_external_ips_are_served_and_node_ports_work_from_the_node_itself() {
    let mut w = World::new();
    w.publish(&service("web", "Cluster", None, &["node-a", "node-b"], ""));
    // The client reaches the external IP through node-a.
    w.client.ip(&["route", "add", "192.0.2.10/32", "via", NODE_A]).expect("route to external IP");
    // ... and the LoadBalancer ingress IP through node-b (as a load
    // balancer in front of the nodes would send it).
    w.client.ip(&["route", "add", "198.51.100.7/32", "via", NODE_B]).expect("route to LB IP");
    w.start();
    w.wait_for("192.0.2.10:80", &[], &["pod-a", "pod-b"]);
    w.wait_for("192.0.2.10:53", &["--udp"], &["pod-a", "pod-b"]);
    w.wait_for("198.51.100.7:80", &[], &["pod-a", "pod-b"]);
    for r in w.probe(&["--to", "198.51.100.7:53", "--udp", "--count", "6"]) {
        assert_eq!(r["peer"], "198.51.100.7:53", "replies come from the LB IP: {r}");
    }
    // From node-a itself (a host process in the agent's cgroup): the socket
    // programs translate NodePorts on the node's addresses and on loopback.
    let node = &w.nodes[0];
    for to in [format!("{NODE_A}:30080"), "127.0.0.1:30080".to_string(), "[::1]:30080".to_string()] {
        eventually(&format!("{to} from node-a itself"), || {
            let mut cmd = command_in(agent_bin(), Some(&node.ns), Some(&node.cgroup)).expect("probe");
            cmd.arg("probe").args(["--to", &to, "--count", "20", "--timeout-ms", "1000"]).stdin(Stdio::null());
            let out = cmd.output().expect("probe");
            let r: Vec<serde_json::Value> =
                String::from_utf8_lossy(&out.stdout).lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
            let got = replies(&r);
            if got == set(&["pod-a", "pod-b"]) { Ok(()) } else { Err(r) }
        });
    }
}

fn http_get(ns: &Netns, to: &str) -> Result<(u16, serde_json::Value), String> {
    let to: SocketAddr = to.parse().expect("addr");
    in_netns(ns, move || -> Result<(u16, serde_json::Value), String> {
        let mut s = TcpStream::connect_timeout(&to, Duration::from_secs(1)).map_err(|e| e.to_string())?;
        s.set_read_timeout(Some(Duration::from_secs(2))).ok();
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: lb\r\n\r\n").map_err(|e| e.to_string())?;
        let mut resp = String::new();
        s.read_to_string(&mut resp).map_err(|e| e.to_string())?;
        let status = resp.split(' ').nth(1).and_then(|c| c.parse().ok()).ok_or(resp.clone())?;
        let body = resp.split("\r\n\r\n").nth(1).unwrap_or("");
        Ok((status, serde_json::from_str(body).map_err(|e| format!("{e}: {resp}"))?))
    })
    .map_err(|e| e.to_string())?
}

#[test]
fn local_policy_keeps_the_client_address_drops_without_local_endpoints_and_serves_health_checks() {
    let mut w = World::new();
    // Only node-b has an endpoint. Port 30081 goes to a server that reports
    // the client's address.
    let extra = "  - {name: peer, port: 81, protocol: TCP, targetPort: 8081, nodePort: 30081}\n";
    let mut yaml = service("web", "Local", Some(32000), &["node-b"], extra);
    yaml = yaml.replace(
        "- {name: dns, port: 5353, protocol: UDP}\n",
        "- {name: dns, port: 5353, protocol: UDP}\n- {name: peer, port: 8081, protocol: TCP}\n",
    );
    w.publish(&yaml);
    let peers = echo_server(&w.nodes[1].pod, format!("{POD_B}:8081").parse().expect("addr")).expect("echo server");
    w.start();
    w.wait_for(&format!("{NODE_B}:30080"), &[], &["pod-b"]);
    w.wait_for(&format!("{NODE_B}:30053"), &["--udp"], &["pod-b"]);
    // The client's own address reaches the backend.
    let r = w.probe(&["--to", &format!("{NODE_B}:30081"), "--message", "hi\n", "--timeout-ms", "1000"]);
    assert_eq!(r[0]["ok"], true, "{}", r[0]);
    let seen = peers.recv_timeout(Duration::from_secs(5)).expect("backend saw a connection");
    // The pod sees the client's own address (no SNAT; node-b forwarded the
    // DNAT'ed packet over the pod veth).
    assert_eq!(seen.ip().to_string(), "10.0.2.1", "externalTrafficPolicy Local preserves the client address");
    // node-a has no local endpoint: its NodePort drops (no RST, no reply).
    // (Until node-a's agent has synced, nothing translates and node-a's
    // stack refuses: wait for the drop.)
    eventually("node-a to drop Local-policy traffic", || {
        let r = w.probe(&["--to", &format!("{NODE_A}:30080"), "--timeout-ms", "700"]);
        if r[0]["error"] == "connection timed out" && w.nodes[0].counter("dropped_no_local") > 0 { Ok(()) } else { Err(r) }
    });
    // Health check node port, as kube-proxy answers it.
    let (status, body) = eventually("health check on node-b", || http_get(&w.client, &format!("{NODE_B}:32000")));
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["service"]["namespace"], "default");
    assert_eq!(body["service"]["name"], "web");
    assert_eq!(body["localEndpoints"], 1);
    assert_eq!(body["serviceProxyHealthy"], true, "{body}");
    let (status, body) = eventually("health check on node-a", || http_get(&w.client, &format!("{NODE_A}:32000")));
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["localEndpoints"], 0);
}

#[test]
fn a_service_without_endpoints_rejects_external_flows() {
    let mut w = World::new();
    w.publish(&service("web", "Cluster", None, &[], ""));
    w.start();
    eventually("connection refused on a NodePort without endpoints", || {
        let r = w.probe(&["--to", &format!("{NODE_A}:30080"), "--timeout-ms", "700"]);
        if r[0]["errno"] == 111 && w.nodes[0].counter("rejected_no_backend") > 0 { Ok(()) } else { Err(r) }
    });
    // A connected UDP socket gets the ICMP error (unconnected ones do not,
    // without IP_RECVERR).
    let r = w.probe(&["--to", &format!("{NODE_A}:30053"), "--udp", "--connected", "--timeout-ms", "700"]);
    assert_eq!(r[0]["errno"], 111, "ICMP port unreachable turns into ECONNREFUSED: {}", r[0]);
    // An external IP that is not any node's address is rejected too (the
    // RST/ICMP leaves with the external IP as source), in both families.
    w.client.ip(&["route", "add", "192.0.2.10/32", "via", NODE_A]).expect("route to external IP");
    for (to, udp) in [("192.0.2.10:80", false), ("192.0.2.10:53", true), (&*format!("[{NODE_A6}]:30080"), false)] {
        let mut args = vec!["--to", to, "--timeout-ms", "700"];
        if udp {
            args.extend(["--udp", "--connected"]);
        }
        eventually(&format!("ECONNREFUSED from {to}"), || {
            let r = w.probe(&args);
            if r[0]["errno"] == 111 { Ok(()) } else { Err(r) }
        });
    }
}

#[test]
fn icmp_port_unreachable_from_a_backend_reaches_the_client() {
    let mut w = World::new();
    // Port 30099 leads to pod-a's UDP port 5999, where nothing listens.
    let extra = "  - {name: closed, port: 99, protocol: UDP, targetPort: 5999, nodePort: 30099}\n";
    let yaml = service("web", "Cluster", None, &["node-a"], extra).replace(
        "- {name: dns, port: 5353, protocol: UDP}\n",
        "- {name: dns, port: 5353, protocol: UDP}\n- {name: closed, port: 5999, protocol: UDP}\n",
    );
    w.publish(&yaml);
    w.start();
    w.wait_for(&format!("{NODE_A}:30053"), &["--udp"], &["pod-a"]);
    w.wait_for(&format!("{NODE_B}:30053"), &["--udp"], &["pod-a"]);
    // Local backend (node-a's own stack answers, translated at egress) and
    // remote backend (node-a answers node-b's SNAT address; node-b
    // translates at ingress). Without translation the quoted header would
    // match no socket and the client would wait for its timeout.
    for (to, node) in [(format!("{NODE_A}:30099"), 0), (format!("[{NODE_A6}]:30099"), 0), (format!("{NODE_B}:30099"), 1)] {
        eventually(&format!("ECONNREFUSED from {to}"), || {
            let r = w.probe(&["--to", &to, "--udp", "--connected", "--timeout-ms", "700"]);
            if r[0]["errno"] == 111 { Ok(()) } else { Err(r) }
        });
        assert!(w.nodes[node].counter("icmp_translated") > 0);
    }
}

#[test]
fn an_established_flow_survives_an_agent_restart_and_a_backend_set_change() {
    established_flow_survives_restart("tcx", &[]);
}

/// The same with clsact + cls_bpf filters attached over netlink (what
/// kernels before 6.6 get).
#[test]
fn with_clsact_filters_an_established_flow_survives_an_agent_restart() {
    established_flow_survives_restart("netlink", &[]);
}

/// Auto mode, the default: tcx on Linux >= 6.6, clsact + cls_bpf before.
/// `cargo xtask vmtest` runs this on 6.1 and 6.12 with
/// TOPOPROXY_EXPECT_TC_MODE set to the mechanism that kernel must get.
#[test]
fn in_auto_mode_an_established_flow_survives_an_agent_restart() {
    established_flow_survives_restart("auto", &[]);
}

/// A restart that changes capacities migrates the pinned maps (new maps,
/// entries copied, programs swapped; see map_migration.rs): the
/// established flow's conntrack entries move to the new NP_CT with it.
#[test]
fn an_established_flow_survives_a_restart_that_resizes_the_maps() {
    established_flow_survives_restart("auto", &["--max-np-conntrack", "50000", "--max-services", "3000", "--max-slots", "30000"]);
}

fn established_flow_survives_restart(mode: &'static str, restart_flags: &[&'static str]) {
    let mut w = World::new();
    for n in &mut w.nodes {
        n.extra = vec!["--tc-mode", mode];
    }
    // Remote backend only (through node-a: DNAT + SNAT + conntrack).
    let extra = "  - {name: peer, port: 81, protocol: TCP, targetPort: 8081, nodePort: 30081}\n";
    let with_peer = |on: &[&str]| {
        service("web", "Cluster", None, on, extra).replace(
            "- {name: dns, port: 5353, protocol: UDP}\n",
            "- {name: dns, port: 5353, protocol: UDP}\n- {name: peer, port: 8081, protocol: TCP}\n",
        )
    };
    w.publish(&with_peer(&["node-b"]));
    let _peers = echo_server(&w.nodes[1].pod, format!("{POD_B}:8081").parse().expect("addr")).expect("echo server");
    w.start();
    w.wait_for(&format!("{NODE_A}:30080"), &[], &["pod-b"]);
    let (cmd_tx, cmd_rx) = mpsc::channel::<String>();
    let (res_tx, res_rx) = mpsc::channel::<Result<String, String>>();
    let to: SocketAddr = format!("{NODE_A}:30081").parse().unwrap();
    spawn_in_netns(&w.client, move || {
        let s = match TcpStream::connect_timeout(&to, Duration::from_secs(2)) {
            Ok(s) => s,
            Err(e) => {
                let _ = res_tx.send(Err(e.to_string()));
                return;
            }
        };
        s.set_read_timeout(Some(Duration::from_secs(5))).ok();
        let mut r = BufReader::new(s.try_clone().expect("clone"));
        let mut s = s;
        for msg in cmd_rx {
            let out = s.write_all(format!("{msg}\n").as_bytes()).map_err(|e| e.to_string()).and_then(|()| {
                let mut line = String::new();
                r.read_line(&mut line).map_err(|e| e.to_string())?;
                Ok(line.trim().to_string())
            });
            let _ = res_tx.send(out);
        }
    })
    .expect("client thread");
    let say = |m: &str| -> String {
        cmd_tx.send(m.to_string()).unwrap();
        res_rx.recv_timeout(wait_limit()).expect("client answered").unwrap_or_else(|e| panic!("{m}: {e}"))
    };
    assert_eq!(say("one"), "echo one");
    // Restart node-a's agent: the pinned tcx links get the new program in
    // place, conntrack is pinned.
    w.nodes[0].stop_agent();
    assert_eq!(say("while stopped"), "echo while stopped");
    w.nodes[0].extra.extend_from_slice(restart_flags);
    w.nodes[0].start_agent();
    eventually("the restarted agent to resync", || {
        let log = std::fs::read_to_string(&w.nodes[0].log).unwrap_or_default();
        let mut runs = log.split("external traffic datapath ready");
        let _ = runs.next();
        if runs.nth(1).is_some_and(|second| second.contains("synced")) { Ok(()) } else { Err(()) }
    });
    assert_eq!(say("after restart"), "echo after restart");
    if !restart_flags.is_empty() {
        let log = std::fs::read_to_string(&w.nodes[0].log).unwrap_or_default();
        assert!(log.contains("map NP_CT resized from") && log.contains("to 50000 entries"), "{log}");
    }
    // A backend set change that keeps this flow's backend.
    w.publish(&with_peer(&["node-a", "node-b"]));
    w.wait_for(&format!("{NODE_A}:30080"), &[], &["pod-a", "pod-b"]);
    for i in 0..5 {
        assert_eq!(say(&format!("still {i}")), format!("echo still {i}"));
    }
    drop(cmd_tx);
    // The restart replaced the program inside the pinned tcx links (or our
    // cls_bpf filters): one program per hook, not two, and by one mechanism
    // only. A tcx query fails on kernels without tcx (before 6.6), which
    // counts as no tcx program.
    let mut used = std::collections::BTreeSet::new();
    for dev in ["a-c", "a-b"] {
        for (hook, t) in [("ingress", aya::programs::TcAttachType::Ingress), ("egress", aya::programs::TcAttachType::Egress)] {
            let tcx = in_netns(&w.nodes[0].ns, move || aya::programs::SchedClassifier::query_tcx(dev, t).map_or(0, |(_, p)| p.len()))
                .expect("netns");
            let out = std::process::Command::new("tc")
                .args(["-n", w.nodes[0].ns.name(), "filter", "show", "dev", dev, hook])
                .output()
                .expect("tc");
            let text = String::from_utf8_lossy(&out.stdout);
            let filters = text.matches(" handle ").count();
            match (tcx, filters) {
                (1, 0) => used.insert("tcx"),
                (0, 1) => used.insert("netlink"),
                other => panic!("{dev} {hook}: (tcx programs, cls_bpf filters) = {other:?}: {text}"),
            };
        }
    }
    // In auto mode the agent must pick what the kernel has; `cargo xtask
    // vmtest` names it for the kernel it boots (clsact on 6.1, tcx on 6.12).
    let want = match mode {
        "auto" => std::env::var("TOPOPROXY_EXPECT_TC_MODE").ok(),
        forced => Some(forced.to_string()),
    };
    assert_eq!(used.len(), 1, "mixed attach mechanisms: {used:?}");
    if let Some(want) = want {
        assert_eq!(used.into_iter().next(), Some(want.as_str()), "TC attach mechanism in {mode} mode");
    }
}

/// A line-echo connection from the client to `to`, kept open: each call
/// sends one line and returns the answer.
fn echo_client(w: &World, to: SocketAddr) -> impl Fn(&str) -> String + use<> {
    let (cmd_tx, cmd_rx) = mpsc::channel::<String>();
    let (res_tx, res_rx) = mpsc::channel::<Result<String, String>>();
    spawn_in_netns(&w.client, move || {
        let s = match TcpStream::connect_timeout(&to, Duration::from_secs(2)) {
            Ok(s) => s,
            Err(e) => {
                let _ = res_tx.send(Err(e.to_string()));
                return;
            }
        };
        s.set_read_timeout(Some(Duration::from_secs(5))).ok();
        let mut r = BufReader::new(s.try_clone().expect("clone"));
        let mut s = s;
        for msg in cmd_rx {
            let out = s.write_all(format!("{msg}\n").as_bytes()).map_err(|e| e.to_string()).and_then(|()| {
                let mut line = String::new();
                r.read_line(&mut line).map_err(|e| e.to_string())?;
                Ok(line.trim().to_string())
            });
            let _ = res_tx.send(out);
        }
    })
    .expect("client thread");
    move |m: &str| -> String {
        cmd_tx.send(m.to_string()).expect("client thread alive");
        res_rx.recv_timeout(wait_limit()).expect("client answered").unwrap_or_else(|e| panic!("{m}: {e}"))
    }
}

/// Whether `port` has its bit in the `NP_PORTS` pinned under `pins`.
fn port_bit(pins: &std::path::Path, port: u16, egress: bool) -> bool {
    let data = aya::maps::MapData::from_pin(pins.join(proxy_common::NP_PORTS_MAP)).expect("open NP_PORTS");
    let map: aya::maps::Array<_, u64> = aya::maps::Array::try_from(aya::maps::Map::Array(data)).expect("NP_PORTS is an array");
    let (word, mask) = proxy_common::np_port_bit(port, egress);
    map.get(&word, 0).expect("NP_PORTS word") & mask != 0
}

/// An upgrade over the pins of an agent version without the port bitmap
/// (no `NP_PORTS`): the new agent creates it and fills it from the pinned
/// maps before its programs replace the old ones, so an established flow
/// goes on, also one whose NodePort was removed meanwhile (then only its
/// conntrack entries name that port). The conntrack GC keeps that port's
/// bit while the flow lives and clears the bits nothing uses.
#[test]
fn an_upgrade_over_pins_without_the_port_bitmap_keeps_an_established_flow() {
    let mut w = World::new();
    w.nodes[0].extra =
        vec!["--conntrack-gc-interval-secs", "1", "--healthz-bind-address", "127.0.0.1:0", "--metrics-bind-address", "127.0.0.1:0"];
    // Remote backend only (through node-a: DNAT + SNAT + conntrack).
    let manifest = |peer_node_port: u16, dns_node_port: u16| {
        let extra = format!("  - {{name: peer, port: 81, protocol: TCP, targetPort: 8081, nodePort: {peer_node_port}}}\n");
        service("web", "Cluster", None, &["node-b"], &extra)
            .replace(
                "- {name: dns, port: 5353, protocol: UDP}\n",
                "- {name: dns, port: 5353, protocol: UDP}\n- {name: peer, port: 8081, protocol: TCP}\n",
            )
            .replace("nodePort: 30053", &format!("nodePort: {dns_node_port}"))
    };
    w.publish(&manifest(30081, 30053));
    let _peers = echo_server(&w.nodes[1].pod, format!("{POD_B}:8081").parse().expect("addr")).expect("echo server");
    w.start();
    w.wait_for(&format!("{NODE_A}:30080"), &[], &["pod-b"]);
    let say = echo_client(&w, format!("{NODE_A}:30081").parse().expect("addr"));
    assert_eq!(say("one"), "echo one");
    let pins = w.nodes[0].pins.path().to_path_buf();
    assert!(port_bit(&pins, 30081, false) && port_bit(&pins, 8081, true));

    // Back to pins as an older version left them, and the flow's NodePort
    // moves (its backend stays in use by the new one), as does the UDP one.
    w.nodes[0].stop_agent();
    std::fs::remove_file(pins.join(proxy_common::NP_PORTS_MAP)).expect("unpin NP_PORTS");
    assert_eq!(say("while stopped"), "echo while stopped");
    w.nodes[0].write_manifest(&manifest(30082, 30054));
    w.nodes[0].start_agent();
    eventually("the new agent to resync", || {
        let log = std::fs::read_to_string(&w.nodes[0].log).unwrap_or_default();
        let mut runs = log.split("external traffic datapath ready");
        let _ = runs.next();
        if runs.nth(1).is_some_and(|second| second.contains("synced")) { Ok(()) } else { Err(()) }
    });
    assert_eq!(say("after the upgrade"), "echo after the upgrade");
    // The GC has swept with the new agent's claim: the old UDP NodePort
    // (no flow) lost its bit, the flow's old NodePort kept it.
    eventually("the GC to clear the unused NodePort's bit", || {
        let old_udp = port_bit(&pins, 30053, false);
        if !old_udp && port_bit(&pins, 30054, false) { Ok(()) } else { Err(old_udp) }
    });
    assert!(port_bit(&pins, 30081, false), "kept: the flow's conntrack entries use it");
    assert!(port_bit(&pins, 30082, false) && port_bit(&pins, 8081, true));
    // /metrics (served in node-a's namespace) shows what the GC left.
    let want = proxy_agent::datapath::port_bits::counts(&pins).expect("NP_PORTS counts");
    eventually("topoproxy_nodeport_ports to show the bitmap", || {
        let text = metrics_of(&w.nodes[0])?;
        let got = ["ingress", "egress"].map(|d| {
            proxy_test_support::http::metric(&text, &format!("topoproxy_nodeport_ports{{direction=\"{d}\"}}")).map(|v| v as usize)
        });
        if got == [Some(want.0), Some(want.1)] { Ok(()) } else { Err(format!("{got:?} vs {want:?}")) }
    });
    for i in 0..3 {
        assert_eq!(say(&format!("still {i}")), format!("echo still {i}"));
    }
}

#[test]
fn explain_shows_the_external_frontends_of_the_one_decision_path() {
    let dir = TempDir::new("tnp-explain");
    std::fs::write(dir.0.join("c.yaml"), service("web", "Local", Some(32000), &["node-a"], "")).unwrap();
    let out = std::process::Command::new(agent_bin())
        .args(["explain", "--node", "node-a", "--output", "json", "--manifests"])
        .arg(&dir.0)
        .output()
        .expect("explain");
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let http = &doc["services"][0];
    assert_eq!(http["nodePort"], 30080, "{http}");
    assert_eq!(http["externalFrontends"], serde_json::json!(["192.0.2.10:80", "198.51.100.7:80"]), "{http}");
    assert_eq!(http["externalTrafficPolicy"], "Local");
    assert_eq!(http["externalEndpoints"], serde_json::json!([format!("{POD_A}:8080"), format!("[{POD_A6}]:8080")]), "{http}");
    assert_eq!(http["healthCheckNodePort"], 32000);
    // eTP Local and reachable from outside: both sets are used (the node's
    // own connections to the NodePort take the cluster-wide one).
    assert!(http["clusterEndpoints"].is_array() && http["localEndpoints"].is_array(), "{http}");
}

/// `/metrics` of a node's agent (started with `--metrics-bind-address`), read in
/// the node's namespace at the address the agent logged.
fn metrics_of(node: &SimNode) -> Result<String, String> {
    let log = std::fs::read_to_string(&node.log).unwrap_or_default();
    let key = "metrics_bind_address=";
    let addr: SocketAddr = log
        .rmatch_indices(key)
        .next()
        .and_then(|(i, _)| log[i + key.len()..].split_whitespace().next()?.parse().ok())
        .ok_or("no metrics address in the log yet")?;
    Ok(in_netns(&node.ns, move || proxy_test_support::http::http_get(addr, "/metrics")).map_err(|e| e.to_string())??.1)
}

#[test]
fn node_address_changes_are_followed_without_a_restart() {
    let mut w = World::new();
    w.nodes[1].extra = vec!["--healthz-bind-address", "127.0.0.1:0", "--metrics-bind-address", "127.0.0.1:0"];
    w.publish(&service("web", "Cluster", None, &["node-a", "node-b"], ""));
    w.start();
    w.wait_for(&format!("{NODE_A}:30080"), &[], &["pod-a", "pod-b"]);
    let pids: Vec<u32> = w.nodes.iter().map(|n| n.agent.as_ref().expect("agent").0.id()).collect();

    // A second address on node-a's listed device: its NodePorts appear
    // there (TC frontends for the client, socket entries for the node).
    const EXTRA: &str = "10.0.1.3";
    w.nodes[0].ns.ip(&["addr", "add", &format!("{EXTRA}/24"), "dev", "a-c"]).expect("add address");
    w.wait_for(&format!("{EXTRA}:30080"), &[], &["pod-a", "pod-b"]);
    w.wait_for(&format!("{EXTRA}:30053"), &["--udp"], &["pod-a", "pod-b"]);
    // ... and go when the address goes (no address, no frontend: the
    // client's SYN is no longer translated and gets no answer).
    w.nodes[0].ns.ip(&["addr", "del", &format!("{EXTRA}/24"), "dev", "a-c"]).expect("delete address");
    eventually(&format!("{EXTRA}:30080 to stop answering"), || {
        let r = w.probe(&["--to", &format!("{EXTRA}:30080"), "--count", "3", "--timeout-ms", "500"]);
        if r.iter().all(|x| x["ok"] == false) { Ok(()) } else { Err(r) }
    });
    w.wait_for(&format!("{NODE_A}:30080"), &[], &["pod-a", "pod-b"]);

    // node-b runs with `--devices auto`: a new link with an address gets
    // the TC programs (a reply from either backend leaves through b-x and
    // must be translated at its egress), and loses them when it goes.
    let (b, client) = (&w.nodes[1].ns, &w.client);
    b.veth("b-x", client, "c-x").expect("veth b-x");
    client.ip(&["addr", "add", "10.0.4.1/24", "dev", "c-x"]).expect("client address");
    b.ip(&["addr", "add", "10.0.4.2/24", "dev", "b-x"]).expect("node address");
    w.wait_for("10.0.4.2:30080", &[], &["pod-a", "pod-b"]);
    w.wait_for("10.0.4.2:30053", &["--udp"], &["pod-a", "pod-b"]);
    let attached = || ["ingress", "egress"].iter().any(|hook| pins::tc_link(w.nodes[1].pins.path(), "b-x", hook).exists());
    let legacy_marked = || {
        std::fs::read_dir(pins::tc_legacy(w.nodes[1].pins.path()))
            .is_ok_and(|rd| rd.flatten().any(|e| e.file_name().to_string_lossy().starts_with("b-x-")))
    };
    assert!(attached() || legacy_marked(), "no TC attachment recorded for b-x");
    // /metrics lists the new device (TC alone: no `--xdp`), and drops it
    // with the link.
    let device_metric = |want: Option<f64>| {
        let node = &w.nodes[1];
        eventually(&format!("topoproxy_xdp_device{{device=\"b-x\"}} to be {want:?}"), || {
            let got = metrics_of(node).map(|text| proxy_test_support::http::metric(&text, "topoproxy_xdp_device{device=\"b-x\"}"))?;
            if got == want { Ok(()) } else { Err(format!("{got:?}")) }
        });
    };
    device_metric(Some(0.0));
    w.nodes[1].ns.ip(&["link", "del", "b-x"]).expect("delete link");
    eventually("the TC attachment of the deleted b-x to go", || if attached() || legacy_marked() { Err(()) } else { Ok(()) });
    device_metric(None);
    w.wait_for(&format!("{NODE_B}:30080"), &[], &["pod-a", "pod-b"]);

    // The same agent processes did all of it.
    for (n, pid) in w.nodes.iter_mut().zip(pids) {
        let a = n.agent.as_mut().expect("agent");
        assert_eq!(a.0.id(), pid);
        assert!(matches!(a.0.try_wait(), Ok(None)), "the agent of {} exited", n.name);
        let log = std::fs::read_to_string(&n.log).unwrap_or_default();
        assert_eq!(log.matches("external traffic datapath ready").count(), 1, "{} restarted", n.name);
        assert!(log.contains("node addresses changed"), "{}: {log}", n.name);
    }
}

// ---------------------------------------------------------------------------
// The TC programs alone, under BPF_PROG_TEST_RUN.
// ---------------------------------------------------------------------------

mod test_run {
    use super::*;
    use proxy_agent::datapath::tc_loader;
    use proxy_agent::decide::decision::ExternalState;
    use proxy_agent::model::{Backend, Frontend, Protocol};
    use proxy_test_support::checksum::csum;
    use std::os::fd::{AsFd, AsRawFd};

    /// Runs the program once on `frame`; returns (retval, output frame).
    fn run(prog_fd: i32, frame: &[u8]) -> (i32, Vec<u8>) {
        let mut out = vec![0u8; frame.len() + 256];
        let r = proxy_test_support::prog_test_run::run(prog_fd, frame, &mut out, 1).expect("BPF_PROG_TEST_RUN");
        out.truncate(r.out_len);
        (r.retval, out)
    }

    /// An Ethernet frame with an IPv4 header (plus `options`) and `l4`.
    fn ipv4(proto: u8, src: [u8; 4], dst: [u8; 4], options: &[u8], frag: u16, l4: &[u8]) -> Vec<u8> {
        let mut f = vec![0x02, 0, 0, 0, 0, 1, 0x02, 0, 0, 0, 0, 2, 0x08, 0x00];
        let ihl = (20 + options.len()) / 4;
        let total = (20 + options.len() + l4.len()) as u16;
        let mut ip = vec![0x40 | ihl as u8, 0];
        ip.extend_from_slice(&total.to_be_bytes());
        ip.extend_from_slice(&[0, 1]);
        ip.extend_from_slice(&frag.to_be_bytes());
        ip.extend_from_slice(&[64, proto, 0, 0]);
        ip.extend_from_slice(&src);
        ip.extend_from_slice(&dst);
        ip.extend_from_slice(options);
        let c = csum(&ip, 0);
        ip[10..12].copy_from_slice(&c.to_be_bytes());
        f.extend_from_slice(&ip);
        f.extend_from_slice(l4);
        f
    }

    fn pseudo4(src: &[u8], dst: &[u8], proto: u8, len: usize) -> u32 {
        let mut p = Vec::new();
        p.extend_from_slice(src);
        p.extend_from_slice(dst);
        p.extend_from_slice(&[0, proto]);
        p.extend_from_slice(&(len as u16).to_be_bytes());
        p.chunks(2).map(|c| u32::from(u16::from_be_bytes([c[0], c[1]]))).sum()
    }

    fn tcp_syn(sport: u16, dport: u16) -> Vec<u8> {
        let mut t = Vec::new();
        t.extend_from_slice(&sport.to_be_bytes());
        t.extend_from_slice(&dport.to_be_bytes());
        t.extend_from_slice(&[0, 0, 0, 1, 0, 0, 0, 0, 0x50, 0x02, 0xff, 0xff, 0, 0, 0, 0]);
        t.extend_from_slice(b"payload!");
        t
    }

    fn with_l4_csum4(mut frame: Vec<u8>, csum_at: usize) -> Vec<u8> {
        let ihl = usize::from(frame[14] & 0xf) * 4;
        let l4 = 14 + ihl;
        let (src, dst, proto) = (frame[26..30].to_vec(), frame[30..34].to_vec(), frame[23]);
        frame[l4 + csum_at] = 0;
        frame[l4 + csum_at + 1] = 0;
        let c = csum(&frame[l4..], pseudo4(&src, &dst, proto, frame.len() - l4));
        frame[l4 + csum_at..l4 + csum_at + 2].copy_from_slice(&c.to_be_bytes());
        frame
    }

    /// Both checksums of an IPv4 TCP/UDP frame verify.
    fn checksums_ok4(frame: &[u8]) -> bool {
        let ihl = usize::from(frame[14] & 0xf) * 4;
        let l4 = 14 + ihl;
        csum(&frame[14..l4], 0) == 0 && csum(&frame[l4..], pseudo4(&frame[26..30], &frame[30..34], frame[23], frame.len() - l4)) == 0
    }

    struct Loaded {
        _ebpf: aya::Ebpf,
        ingress: i32,
        egress: i32,
        pins: PinDir,
    }

    fn load(tc: &[(Frontend, &[Backend])], local: &[&str], policy_local: &[Frontend]) -> Loaded {
        load_with_ports(tc, local, policy_local, (61000, 65535))
    }

    fn load_with_ports(tc: &[(Frontend, &[Backend])], local: &[&str], policy_local: &[Frontend], ports: (u16, u16)) -> Loaded {
        require_root();
        let pins = PinDir::new("tnpr").expect("pins");
        let mut ebpf = proxy_agent::datapath::tc_loader::load_unattached(pins.path()).expect("load");
        let prog: &mut aya::programs::SchedClassifier =
            ebpf.program_mut(&tc_loader::loaded_name(tc_loader::INGRESS_PROGRAM)).expect("np_ingress").try_into().expect("classifier");
        let ingress = prog.fd().expect("fd").as_fd().as_raw_fd();
        let prog: &mut aya::programs::SchedClassifier =
            ebpf.program_mut(&tc_loader::loaded_name(tc_loader::EGRESS_PROGRAM)).expect("np_egress").try_into().expect("classifier");
        let egress = prog.fd().expect("fd").as_fd().as_raw_fd();
        let mut w = proxy_agent::external::nodeport::NodePortWriter::open(pins.path()).expect("writer");
        w.set_config(Some("10.0.3.1".parse().unwrap()), Some("fd00:3::1".parse().unwrap()), ports).expect("config");
        let ext = ExternalState {
            tc: tc.iter().map(|(f, b)| (*f, b.iter().copied().collect())).collect(),
            local_endpoints: local.iter().map(|s| s.parse().unwrap()).collect(),
            policy_local: policy_local.iter().copied().collect(),
            ..Default::default()
        };
        let o = w.sync(&ext);
        assert!(o.failures.is_empty(), "{:?}", o.failures);
        Loaded { _ebpf: ebpf, ingress, egress, pins }
    }

    fn fe(s: &str, proto: Protocol) -> Frontend {
        let a: SocketAddr = s.parse().unwrap();
        Frontend { ip: a.ip(), port: a.port(), protocol: proto }
    }
    fn be(s: &str) -> Backend {
        let a: SocketAddr = s.parse().unwrap();
        Backend { ip: a.ip(), port: a.port() }
    }

    const PASS: i32 = -1; // TC_ACT_UNSPEC
    const SHOT: i32 = 2;

    #[test]
    fn dnat_to_a_local_backend_keeps_checksums_valid_with_and_without_ip_options() {
        let l = load(&[(fe("10.0.1.2:30080", Protocol::Tcp), &[be("10.244.1.1:8080")])], &["10.244.1.1"], &[]);
        for options in [&[][..], &[1, 1, 1, 0][..] /* NOP NOP NOP EOL */] {
            let frame = with_l4_csum4(ipv4(6, [10, 0, 1, 1], [10, 0, 1, 2], options, 0, &tcp_syn(40000, 30080)), 16);
            assert!(checksums_ok4(&frame));
            let (rc, out) = run(l.ingress, &frame);
            assert_eq!(rc, PASS);
            let l4 = 14 + 20 + options.len();
            assert_eq!(&out[30..34], &[10, 244, 1, 1], "DNAT to the backend");
            assert_eq!(&out[26..30], &[10, 0, 1, 1], "local backend: client address kept");
            assert_eq!(&out[l4 + 2..l4 + 4], &8080u16.to_be_bytes());
            assert!(checksums_ok4(&out), "checksums after DNAT (options {options:?})");
            assert_eq!(&out[l4 + 20..], b"payload!");
        }
        let c = proxy_agent::datapath::dump::np_counters(l.pins.path()).unwrap();
        assert_eq!(c["new_flow"], 1, "{c:?}");
        assert_eq!(c["tracked"], 1, "the second packet is the same flow: {c:?}");
    }

    #[test]
    fn remote_backends_get_snat_and_the_reply_is_reversed() {
        let l = load(&[(fe("10.0.1.2:30053", Protocol::Udp), &[be("10.244.2.1:5353")])], &[], &[]);
        let udp = |sport: u16, dport: u16, zero_csum: bool| {
            let mut u = Vec::new();
            u.extend_from_slice(&sport.to_be_bytes());
            u.extend_from_slice(&dport.to_be_bytes());
            u.extend_from_slice(&12u16.to_be_bytes());
            u.extend_from_slice(&[0, 0]);
            u.extend_from_slice(b"ping");
            let f = ipv4(17, [10, 0, 1, 1], [10, 0, 1, 2], &[], 0, &u);
            if zero_csum { f } else { with_l4_csum4(f, 6) }
        };
        // Ingress: DNAT only (a local source address arriving from outside
        // would be dropped by the IPv4 stack).
        let (rc, out) = run(l.ingress, &udp(40001, 30053, false));
        assert_eq!(rc, PASS);
        assert_eq!(&out[26..30], &[10, 0, 1, 1], "client address kept at ingress");
        assert_eq!(&out[30..34], &[10, 244, 2, 1]);
        assert!(checksums_ok4(&out));
        // Egress towards node-b: SNAT.
        let (rc, out) = run(l.egress, &out);
        assert_eq!(rc, PASS);
        assert_eq!(&out[26..30], &[10, 0, 3, 1], "SNAT to the node address");
        assert_eq!(&out[30..34], &[10, 244, 2, 1]);
        let snat_port = u16::from_be_bytes([out[34], out[35]]);
        assert!((61000..=65535).contains(&snat_port), "{snat_port}");
        assert!(checksums_ok4(&out));
        // The backend's reply, as it arrives from node-b: the destination
        // becomes the client at ingress...
        let mut u = Vec::new();
        u.extend_from_slice(&5353u16.to_be_bytes());
        u.extend_from_slice(&snat_port.to_be_bytes());
        u.extend_from_slice(&[0, 13, 0, 0]);
        u.extend_from_slice(b"pod-b");
        let reply = with_l4_csum4(ipv4(17, [10, 244, 2, 1], [10, 0, 3, 1], &[], 0, &u), 6);
        let (rc, back) = run(l.ingress, &reply);
        assert_eq!(rc, PASS);
        assert_eq!(&back[26..30], &[10, 244, 2, 1]);
        assert_eq!(&back[30..34], &[10, 0, 1, 1]);
        assert_eq!(&back[36..38], &40001u16.to_be_bytes());
        assert!(checksums_ok4(&back));
        // ... and the source the frontend at egress towards the client.
        let (rc, back) = run(l.egress, &back);
        assert_eq!(rc, PASS);
        assert_eq!(&back[26..30], &[10, 0, 1, 2], "reply comes from the address the client used");
        assert_eq!(&back[30..34], &[10, 0, 1, 1]);
        assert_eq!(&back[34..36], &30053u16.to_be_bytes());
        assert_eq!(&back[36..38], &40001u16.to_be_bytes());
        assert!(checksums_ok4(&back));
        // UDP without checksum (allowed over IPv4) stays without one.
        let (_, out) = run(l.ingress, &udp(40002, 30053, true));
        assert_eq!(&out[30..34], &[10, 244, 2, 1]);
        assert_eq!(&out[40..42], &[0, 0], "a zero UDP checksum stays zero");
    }

    #[test]
    fn what_is_not_ours_passes_untouched() {
        let l = load(&[(fe("10.0.1.2:30080", Protocol::Tcp), &[be("10.244.1.1:8080")])], &["10.244.1.1"], &[]);
        let syn = with_l4_csum4(ipv4(6, [10, 0, 1, 1], [10, 0, 1, 2], &[], 0, &tcp_syn(40000, 30080)), 16);
        let cases: Vec<(&str, Vec<u8>)> = vec![
            // BPF_PROG_TEST_RUN itself refuses frames shorter than an IPv4
            // header, so truncation is shown by headers that claim more
            // than the frame holds.
            ("IHL beyond the frame", {
                let mut f = syn[..14 + 24].to_vec();
                f[14] = 0x4f;
                f
            }),
            ("IHL below the minimum", {
                let mut f = syn.clone();
                f[14] = 0x44;
                f
            }),
            ("truncated TCP header", syn[..14 + 20 + 10].to_vec()),
            ("first fragment", ipv4(6, [10, 0, 1, 1], [10, 0, 1, 2], &[], 0x2000, &tcp_syn(40000, 30080))),
            ("later fragment", ipv4(6, [10, 0, 1, 1], [10, 0, 1, 2], &[], 0x0004, &tcp_syn(40000, 30080))),
            ("unknown protocol (GRE)", ipv4(47, [10, 0, 1, 1], [10, 0, 1, 2], &[], 0, &tcp_syn(40000, 30080))),
            ("another port", with_l4_csum4(ipv4(6, [10, 0, 1, 1], [10, 0, 1, 2], &[], 0, &tcp_syn(40000, 30081)), 16)),
            ("ARP", {
                let mut f = syn.clone();
                f[12..14].copy_from_slice(&[0x08, 0x06]);
                f
            }),
        ];
        for (name, frame) in cases {
            let (rc, out) = run(l.ingress, &frame);
            assert_eq!(rc, PASS, "{name}");
            assert_eq!(out, frame, "{name}: untouched");
        }
        let c = proxy_agent::datapath::dump::np_counters(l.pins.path()).unwrap();
        assert_eq!(c["pass_fragment"], 2, "{c:?}");
        assert!(c["pass_unparsed"] >= 3, "{c:?}");
        assert_eq!(c["new_flow"], 0, "{c:?}");
    }

    #[test]
    fn a_source_outside_the_ranges_is_dropped_whatever_its_tcp_flags() {
        use proxy_agent::decide::plan::{FrontendPolicy, SourceRanges};
        use proxy_agent::model::Cidr;
        require_root();
        let lb = fe("10.0.9.9:80", Protocol::Tcp);
        let pins = PinDir::new("tnsr").expect("pins");
        let mut ebpf = proxy_agent::datapath::tc_loader::load_unattached(pins.path()).expect("load");
        let prog: &mut aya::programs::SchedClassifier =
            ebpf.program_mut(&tc_loader::loaded_name(tc_loader::INGRESS_PROGRAM)).expect("np_ingress").try_into().expect("classifier");
        let ingress = prog.fd().expect("fd").as_fd().as_raw_fd();
        let mut w = proxy_agent::external::nodeport::NodePortWriter::open(pins.path()).expect("writer");
        w.set_config(Some("10.0.3.1".parse().unwrap()), None, (61000, 65535)).expect("config");
        let policy = FrontendPolicy {
            source_ranges: Some(SourceRanges { cidrs: vec![Cidr::parse("10.0.1.0/24").unwrap()], node: false }),
            ..Default::default()
        };
        let ext = ExternalState {
            tc: [(lb, [be("10.244.1.1:8080")].into_iter().collect())].into_iter().collect(),
            local_endpoints: ["10.244.1.1".parse().unwrap()].into_iter().collect(),
            tc_policies: [(lb, policy)].into_iter().collect(),
            ..Default::default()
        };
        let o = w.sync(&ext);
        assert!(o.failures.is_empty(), "{:?}", o.failures);
        let segment = |src: [u8; 4], flags: u8| {
            let mut t = tcp_syn(40000, 80);
            t[13] = flags;
            with_l4_csum4(ipv4(6, src, [10, 0, 9, 9], &[], 0, &t), 16)
        };
        // (flags, name): a non-SYN segment of an untracked flow would pass
        // to netfilter from an allowed source; from any other it is dropped
        // like the SYN.
        let flags = [(0x02, "SYN"), (0x10, "ACK"), (0x18, "PSH|ACK"), (0x04, "RST"), (0x11, "FIN|ACK"), (0x12, "SYN|ACK")];
        for (f, name) in flags {
            let frame = segment([192, 0, 2, 7], f);
            let (rc, out) = run(ingress, &frame);
            assert_eq!(rc, SHOT, "{name} from outside the ranges");
            assert_eq!(out, frame, "{name}: not rewritten");
        }
        let c = proxy_agent::datapath::dump::np_counters(pins.path()).unwrap();
        assert_eq!(c["dropped_source_range"], flags.len() as u64, "{c:?}");
        assert_eq!(c["pass_untracked_tcp"], 0, "{c:?}");
        // Inside the ranges the untracked pass still applies.
        let frame = segment([10, 0, 1, 1], 0x10);
        let (rc, out) = run(ingress, &frame);
        assert_eq!((rc, out), (PASS, frame), "an allowed client's untracked ACK goes to the stack");
        let c = proxy_agent::datapath::dump::np_counters(pins.path()).unwrap();
        assert_eq!((c["dropped_source_range"], c["pass_untracked_tcp"]), (flags.len() as u64, 1), "{c:?}");
    }

    #[test]
    fn local_policy_without_local_endpoints_drops_and_cluster_policy_rejects() {
        let local = fe("10.0.1.2:30080", Protocol::Tcp);
        let cluster = fe("10.0.1.2:30081", Protocol::Tcp);
        let l = load(&[(local, &[]), (cluster, &[])], &[], &[local]);
        let syn = |dport| with_l4_csum4(ipv4(6, [10, 0, 1, 1], [10, 0, 1, 2], &[], 0, &tcp_syn(40000, dport)), 16);
        assert_eq!(run(l.ingress, &syn(30080)).0, SHOT);
        // Rejected: DNAT'ed to port 0 of the node address, where the stack
        // answers with a RST; that RST leaves with the frontend as source.
        let (rc, out) = run(l.ingress, &syn(30081));
        assert_eq!(rc, PASS);
        assert_eq!(&out[30..34], &[10, 0, 3, 1]);
        assert_eq!(&out[36..38], &[0, 0], "port 0: nothing can listen there");
        assert!(checksums_ok4(&out));
        let mut rst = tcp_syn(0, 40000);
        rst[13] = 0x14; // RST|ACK
        let rst = with_l4_csum4(ipv4(6, [10, 0, 3, 1], [10, 0, 1, 1], &[], 0, &rst), 16);
        let (rc, out) = run(l.egress, &rst);
        assert_eq!(rc, PASS);
        assert_eq!(&out[26..30], &[10, 0, 1, 2], "the RST comes from the address the client used");
        assert_eq!(&out[34..36], &30081u16.to_be_bytes());
        assert!(checksums_ok4(&out));
        let c = proxy_agent::datapath::dump::np_counters(l.pins.path()).unwrap();
        assert_eq!((c["dropped_no_local"], c["rejected_no_backend"]), (1, 1), "{c:?}");
    }

    #[test]
    fn ipv6_dnat_and_snat_keep_the_tcp_checksum_valid() {
        let l = load(&[(fe("[fd00:1::2]:30080", Protocol::Tcp), &[be("[fd00:244:2::1]:8080")])], &[], &[]);
        let src: std::net::Ipv6Addr = "fd00:1::1".parse().unwrap();
        let dst: std::net::Ipv6Addr = "fd00:1::2".parse().unwrap();
        let mut t = tcp_syn(40000, 30080);
        let pseudo6 = |s: &[u8], d: &[u8], len: usize| -> u32 {
            let mut p = Vec::new();
            p.extend_from_slice(s);
            p.extend_from_slice(d);
            p.extend_from_slice(&(len as u32).to_be_bytes());
            p.extend_from_slice(&[0, 0, 0, 6]);
            p.chunks(2).map(|c| u32::from(u16::from_be_bytes([c[0], c[1]]))).sum()
        };
        let c = csum(&t, pseudo6(&src.octets(), &dst.octets(), t.len()));
        t[16..18].copy_from_slice(&c.to_be_bytes());
        let mut f = vec![0x02, 0, 0, 0, 0, 1, 0x02, 0, 0, 0, 0, 2, 0x86, 0xdd, 0x60, 0, 0, 0];
        f.extend_from_slice(&(t.len() as u16).to_be_bytes());
        f.extend_from_slice(&[6, 64]);
        f.extend_from_slice(&src.octets());
        f.extend_from_slice(&dst.octets());
        f.extend_from_slice(&t);
        let (rc, out) = run(l.ingress, &f);
        assert_eq!(rc, PASS);
        let (rc, out) = run(l.egress, &out);
        assert_eq!(rc, PASS);
        let new_src: std::net::Ipv6Addr = <[u8; 16]>::try_from(&out[22..38]).unwrap().into();
        let new_dst: std::net::Ipv6Addr = <[u8; 16]>::try_from(&out[38..54]).unwrap().into();
        assert_eq!(new_dst.to_string(), "fd00:244:2::1");
        assert_eq!(new_src.to_string(), "fd00:3::1");
        assert_eq!(u16::from_be_bytes([out[56], out[57]]), 8080);
        assert_eq!(csum(&out[54..], pseudo6(&out[22..38], &out[38..54], out.len() - 54)), 0, "TCP checksum after IPv6 NAT");
    }

    /// An ICMPv4 error (type, code) from `src` to `dst` quoting `quoted`
    /// (an IPv4 packet without Ethernet header), with valid checksums.
    fn icmp4(src: [u8; 4], dst: [u8; 4], ty: u8, code: u8, quoted: &[u8]) -> Vec<u8> {
        let mut icmp = vec![ty, code, 0, 0, 0, 0, 0x05, 0xdc]; // MTU 1500 for code 4
        icmp.extend_from_slice(quoted);
        let c = csum(&icmp, 0);
        icmp[2..4].copy_from_slice(&c.to_be_bytes());
        ipv4(1, src, dst, &[], 0, &icmp)
    }

    fn icmp_ok4(frame: &[u8]) -> bool {
        csum(&frame[14..34], 0) == 0 && csum(&frame[34..], 0) == 0 && csum(&frame[42..62], 0) == 0
    }

    fn udp4(src: [u8; 4], dst: [u8; 4], sport: u16, dport: u16) -> Vec<u8> {
        let mut u = Vec::new();
        u.extend_from_slice(&sport.to_be_bytes());
        u.extend_from_slice(&dport.to_be_bytes());
        u.extend_from_slice(&[0, 12, 0, 0]);
        u.extend_from_slice(b"ping");
        with_l4_csum4(ipv4(17, src, dst, &[], 0, &u), 6)
    }

    #[test]
    fn icmp_errors_about_tracked_flows_are_translated_back() {
        let local_fe = fe("10.0.1.2:30053", Protocol::Udp);
        let remote_fe = fe("10.0.1.2:30054", Protocol::Udp);
        let l = load(&[(local_fe, &[be("10.244.1.1:5999")]), (remote_fe, &[be("10.244.2.1:5353")])], &["10.244.1.1"], &[]);
        // Local backend with no listener: the node's stack answers the
        // DNAT'ed datagram with port unreachable, quoting client -> backend.
        let (_, dnat) = run(l.ingress, &udp4([10, 0, 1, 1], [10, 0, 1, 2], 40000, 30053));
        let err = icmp4([10, 244, 1, 1], [10, 0, 1, 1], 3, 3, &dnat[14..]);
        assert!(icmp_ok4(&err));
        let (rc, out) = run(l.egress, &err);
        assert_eq!(rc, PASS);
        assert_eq!(&out[26..30], &[10, 0, 1, 2], "outer source: the frontend");
        assert_eq!(&out[58..62], &[10, 0, 1, 2], "quoted destination: the frontend");
        assert_eq!(&out[64..66], &30053u16.to_be_bytes(), "quoted destination port");
        assert_eq!(&out[54..58], &[10, 0, 1, 1], "quoted source: the client");
        assert!(icmp_ok4(&out), "IP, ICMP and quoted IP checksums");

        // Remote backend: fragmentation needed from a router behind us,
        // quoting the SNAT'ed packet.
        let (_, dnat) = run(l.ingress, &udp4([10, 0, 1, 1], [10, 0, 1, 2], 40001, 30054));
        let (_, snat) = run(l.egress, &dnat);
        let snat_port = u16::from_be_bytes([snat[34], snat[35]]);
        let err = icmp4([10, 0, 3, 2], [10, 0, 3, 1], 3, 4, &snat[14..]);
        let (rc, out) = run(l.ingress, &err);
        assert_eq!(rc, PASS);
        assert_eq!(&out[30..34], &[10, 0, 1, 1], "outer destination: the client");
        assert_eq!(&out[54..58], &[10, 0, 1, 1], "quoted source: the client");
        assert_eq!(&out[62..64], &40001u16.to_be_bytes());
        assert_eq!(&out[58..62], &[10, 0, 1, 2], "quoted destination: the frontend");
        assert_eq!(&out[64..66], &30054u16.to_be_bytes());
        assert!(icmp_ok4(&out));
        let _ = snat_port;

        // A router towards the client rejects a reply (frontend -> client):
        // the error goes to the backend, quoting what the backend sent.
        let reply = udp4([10, 0, 1, 2], [10, 0, 1, 1], 30054, 40001);
        let err = icmp4([10, 0, 1, 254], [10, 0, 1, 2], 3, 4, &reply[14..]);
        let (rc, out) = run(l.ingress, &err);
        assert_eq!(rc, PASS);
        assert_eq!(&out[30..34], &[10, 244, 2, 1], "outer destination: the backend");
        assert_eq!(&out[54..58], &[10, 244, 2, 1], "quoted source: the backend");
        assert_eq!(&out[62..64], &5353u16.to_be_bytes());
        assert_eq!(&out[58..62], &[10, 0, 3, 1], "quoted destination: the SNAT address");
        assert_eq!(&out[64..66], &snat_port.to_be_bytes());
        assert!(icmp_ok4(&out));

        // This node cannot forward the remote backend's reply to the client
        // (MTU): its error goes back to the backend quoting backend ->
        // client, which the backend knows as backend -> SNAT address.
        let fwd_reply = udp4([10, 244, 2, 1], [10, 0, 1, 1], 5353, 40001);
        let err = icmp4([10, 0, 3, 1], [10, 244, 2, 1], 3, 4, &fwd_reply[14..]);
        let (rc, out) = run(l.egress, &err);
        assert_eq!(rc, PASS);
        assert_eq!(&out[58..62], &[10, 0, 3, 1], "quoted destination: the SNAT address");
        assert_eq!(&out[64..66], &snat_port.to_be_bytes());
        assert_eq!(&out[54..58], &[10, 244, 2, 1]);
        assert!(icmp_ok4(&out));

        // Errors about unknown flows and non-errors pass untouched.
        let echo = icmp4([10, 0, 1, 1], [10, 0, 1, 2], 8, 0, &[0; 28]);
        assert_eq!(run(l.ingress, &echo), (PASS, echo.clone()));
        let stray = icmp4([10, 0, 3, 2], [10, 0, 3, 1], 3, 3, &udp4([10, 0, 3, 1], [10, 9, 9, 9], 1, 2)[14..]);
        assert_eq!(run(l.ingress, &stray), (PASS, stray.clone()));
        let c = proxy_agent::datapath::dump::np_counters(l.pins.path()).unwrap();
        assert_eq!(c["icmp_translated"], 4, "{c:?}");
    }

    #[test]
    fn a_snat_port_is_reused_only_after_its_flow_closed_and_timed_out() {
        // One SNAT port only.
        let l = load_with_ports(&[(fe("10.0.1.2:30080", Protocol::Tcp), &[be("10.244.2.1:8080")])], &[], &[], (61000, 61000));
        let syn = |sport| with_l4_csum4(ipv4(6, [10, 0, 1, 1], [10, 0, 1, 2], &[], 0, &tcp_syn(sport, 30080)), 16);
        let (_, out) = run(l.ingress, &syn(40000));
        let (_, out) = run(l.egress, &out);
        assert_eq!(&out[34..36], &61000u16.to_be_bytes());
        // A second flow finds the port taken: it is passed untranslated and
        // counted, never given a port another flow's replies use.
        let frame = syn(40001);
        assert_eq!(run(l.ingress, &frame), (PASS, frame.clone()));
        assert_eq!(proxy_agent::datapath::dump::np_counters(l.pins.path()).unwrap()["snat_failed"], 1);
        // The backend resets the first flow...
        let mut rst = tcp_syn(8080, 61000);
        rst[13] = 0x14;
        let rst = with_l4_csum4(ipv4(6, [10, 244, 2, 1], [10, 0, 3, 1], &[], 0, &rst), 16);
        let (_, back) = run(l.ingress, &rst);
        assert_eq!(&back[30..34], &[10, 0, 1, 1], "the RST reaches the client");
        // ... and once the closing timeout (10 s) has passed, the port is free.
        std::thread::sleep(Duration::from_secs(12));
        let (_, out) = run(l.ingress, &frame);
        assert_eq!(&out[30..34], &[10, 244, 2, 1]);
        let (_, out) = run(l.egress, &out);
        assert_eq!(&out[34..36], &61000u16.to_be_bytes(), "port taken over");
        assert!(checksums_ok4(&out));
    }

    #[test]
    fn a_new_flow_finds_the_last_free_snat_port_of_a_small_range() {
        // 32 ports, a power of two and as many as a new flow tries: the
        // tries step by an odd number modulo the range, so together they
        // visit every port, and a flow finds the one port left however the
        // others were taken (at 8 tries it mostly did not).
        let l = load_with_ports(&[(fe("10.0.1.2:30080", Protocol::Tcp), &[be("10.244.2.1:8080")])], &[], &[], (61000, 61031));
        let syn = |sport| with_l4_csum4(ipv4(6, [10, 0, 1, 1], [10, 0, 1, 2], &[], 0, &tcp_syn(sport, 30080)), 16);
        let mut taken = std::collections::BTreeSet::new();
        for client in 40000..40032u16 {
            let (_, out) = run(l.ingress, &syn(client));
            let (_, out) = run(l.egress, &out);
            let port = u16::from_be_bytes([out[34], out[35]]);
            assert!((61000..=61031).contains(&port), "flow {client}: port {port}");
            assert!(taken.insert(port), "flow {client} was given port {port} twice");
        }
        assert_eq!(taken.len(), 32);
        assert_eq!(proxy_agent::datapath::dump::np_counters(l.pins.path()).unwrap()["snat_failed"], 0);
        // The 33rd finds none: passed untranslated and counted.
        let frame = syn(40032);
        assert_eq!(run(l.ingress, &frame), (PASS, frame.clone()));
        assert_eq!(proxy_agent::datapath::dump::np_counters(l.pins.path()).unwrap()["snat_failed"], 1);
    }

    fn pseudo6(src: &[u8], dst: &[u8], len: usize, next: u8) -> u32 {
        let mut p = Vec::new();
        p.extend_from_slice(src);
        p.extend_from_slice(dst);
        p.extend_from_slice(&(len as u32).to_be_bytes());
        p.extend_from_slice(&[0, 0, 0, next]);
        p.chunks(2).map(|c| u32::from(u16::from_be_bytes([c[0], c[1]]))).sum()
    }

    /// An Ethernet + IPv6 frame carrying `payload` (next header `next`) with
    /// its L4 checksum (at `csum_at` in the payload) filled in.
    fn ipv6(next: u8, src: &str, dst: &str, mut payload: Vec<u8>, csum_at: usize) -> Vec<u8> {
        let src: std::net::Ipv6Addr = src.parse().unwrap();
        let dst: std::net::Ipv6Addr = dst.parse().unwrap();
        let c = csum(&payload, pseudo6(&src.octets(), &dst.octets(), payload.len(), next));
        payload[csum_at..csum_at + 2].copy_from_slice(&c.to_be_bytes());
        let mut f = vec![0x02, 0, 0, 0, 0, 1, 0x02, 0, 0, 0, 0, 2, 0x86, 0xdd, 0x60, 0, 0, 0];
        f.extend_from_slice(&(payload.len() as u16).to_be_bytes());
        f.extend_from_slice(&[next, 64]);
        f.extend_from_slice(&src.octets());
        f.extend_from_slice(&dst.octets());
        f.extend_from_slice(&payload);
        f
    }

    fn v6_at(f: &[u8], off: usize) -> String {
        std::net::Ipv6Addr::from(<[u8; 16]>::try_from(&f[off..off + 16]).unwrap()).to_string()
    }

    #[test]
    fn icmpv6_packet_too_big_for_a_snat_flow_reaches_the_client_with_valid_checksums() {
        let l = load(&[(fe("[fd00:1::2]:30053", Protocol::Udp), &[be("[fd00:244:2::1]:5353")])], &[], &[]);
        let mut u = Vec::new();
        u.extend_from_slice(&40000u16.to_be_bytes());
        u.extend_from_slice(&30053u16.to_be_bytes());
        u.extend_from_slice(&[0, 12, 0, 0]);
        u.extend_from_slice(b"ping");
        let (_, dnat) = run(l.ingress, &ipv6(17, "fd00:1::1", "fd00:1::2", u, 6));
        let (_, snat) = run(l.egress, &dnat);
        assert_eq!(v6_at(&snat, 22), "fd00:3::1");
        // Packet too big (type 2) from a router towards node-b.
        let mut icmp = vec![2, 0, 0, 0, 0, 0, 0x05, 0x00];
        icmp.extend_from_slice(&snat[14..]);
        let err = ipv6(58, "fd00:3::2", "fd00:3::1", icmp, 2);
        let (rc, out) = run(l.ingress, &err);
        assert_eq!(rc, PASS);
        assert_eq!(v6_at(&out, 38), "fd00:1::1", "outer destination: the client");
        let q = 14 + 40 + 8;
        assert_eq!(v6_at(&out, q + 8), "fd00:1::1", "quoted source: the client");
        assert_eq!(v6_at(&out, q + 24), "fd00:1::2", "quoted destination: the frontend");
        assert_eq!(&out[q + 40..q + 42], &40000u16.to_be_bytes());
        assert_eq!(&out[q + 42..q + 44], &30053u16.to_be_bytes());
        assert_eq!(csum(&out[54..], pseudo6(&out[22..38], &out[38..54], out.len() - 54, 58)), 0, "ICMPv6 checksum");
    }

    /// An IPv6 TCP SYN from [fd00:1::1]:`sport` to [fd00:1::2]:30080 behind
    /// the extension headers `exts` (type, header bytes with the next-header
    /// byte left to fill in); the TCP checksum is valid (its pseudo header
    /// names TCP, not the extension headers: RFC 8200 8.1).
    fn ipv6_with_ext(exts: &[(u8, Vec<u8>)], sport: u16) -> Vec<u8> {
        let src: std::net::Ipv6Addr = "fd00:1::1".parse().unwrap();
        let dst: std::net::Ipv6Addr = "fd00:1::2".parse().unwrap();
        let mut t = tcp_syn(sport, 30080);
        let c = csum(&t, pseudo6(&src.octets(), &dst.octets(), t.len(), 6));
        t[16..18].copy_from_slice(&c.to_be_bytes());
        let mut chain = Vec::new();
        for (i, (_, h)) in exts.iter().enumerate() {
            let mut h = h.clone();
            h[0] = exts.get(i + 1).map_or(6, |(ty, _)| *ty);
            chain.extend_from_slice(&h);
        }
        chain.extend_from_slice(&t);
        let mut f = vec![0x02, 0, 0, 0, 0, 1, 0x02, 0, 0, 0, 0, 2, 0x86, 0xdd, 0x60, 0, 0, 0];
        f.extend_from_slice(&(chain.len() as u16).to_be_bytes());
        f.extend_from_slice(&[exts.first().map_or(6, |(ty, _)| *ty), 64]);
        f.extend_from_slice(&src.octets());
        f.extend_from_slice(&dst.octets());
        f.extend_from_slice(&chain);
        f
    }

    #[test]
    fn ipv6_extension_headers_are_skipped_and_ipv6_fragments_pass() {
        let l = load(&[(fe("[fd00:1::2]:30080", Protocol::Tcp), &[be("[fd00:244:1::1]:8080")])], &["fd00:244:1::1"], &[]);
        // Hop-by-hop and destination options with one PadN option, a
        // routing header with no segments left, fragment headers.
        let hop = || (0u8, vec![0, 0, 1, 4, 0, 0, 0, 0]);
        let dst = || (60u8, vec![0, 0, 1, 4, 0, 0, 0, 0]);
        let dst16 = || (60u8, vec![0, 1, 1, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        let routing = |segments_left: u8| (43u8, vec![0, 0, 4, segments_left, 0, 0, 0, 0]);
        let fragment = |offset_and_m: u16| {
            let o = offset_and_m.to_be_bytes();
            (44u8, vec![0, 0, o[0], o[1], 0, 0, 0, 7])
        };
        type Chain = Vec<(u8, Vec<u8>)>;
        let translated: Vec<(&str, Chain)> = vec![
            ("hop-by-hop", vec![hop()]),
            ("hop-by-hop + destination options (16 bytes)", vec![hop(), dst16()]),
            ("four headers", vec![hop(), dst(), routing(0), dst()]),
            ("atomic fragment (RFC 6946)", vec![fragment(0)]),
        ];
        for (i, (name, exts)) in translated.iter().enumerate() {
            let frame = ipv6_with_ext(exts, 41000 + i as u16);
            let (rc, out) = run(l.ingress, &frame);
            assert_eq!(rc, PASS, "{name}");
            let l4 = 14 + 40 + exts.iter().map(|(_, h)| h.len()).sum::<usize>();
            assert_eq!(v6_at(&out, 38), "fd00:244:1::1", "{name}: DNAT");
            assert_eq!(&out[l4 + 2..l4 + 4], &8080u16.to_be_bytes(), "{name}: port");
            assert_eq!(&out[14 + 40..l4], &frame[14 + 40..l4], "{name}: extension headers kept");
            assert_eq!(csum(&out[l4..], pseudo6(&out[22..38], &out[38..54], out.len() - l4, 6)), 0, "{name}: TCP checksum");
        }
        let passed: Vec<(&str, Vec<u8>)> = vec![
            ("five headers", ipv6_with_ext(&[hop(), dst(), routing(0), dst(), dst()], 42000)),
            ("routing header with segments left", ipv6_with_ext(&[routing(1)], 42001)),
            ("first fragment", ipv6_with_ext(&[fragment(1)], 42002)),
            ("later fragment", ipv6_with_ext(&[fragment(8 << 3)], 42003)),
            ("extension header longer than the frame", {
                let mut f = ipv6_with_ext(&[hop()], 42004);
                f[14 + 40 + 1] = 200;
                f
            }),
        ];
        for (name, frame) in passed {
            assert_eq!(run(l.ingress, &frame), (PASS, frame.clone()), "{name}: untouched");
        }
        let c = proxy_agent::datapath::dump::np_counters(l.pins.path()).unwrap();
        assert_eq!((c["new_flow"], c["pass_fragment"], c["pass_unparsed"]), (4, 2, 3), "{c:?}");
    }
}

/// Issue #34: an external client's new flows through a NodePort are
/// counted in `NP_SVC_CONN` by the tier of the backend relative to the
/// node that received them: its own pod `node`, the other node's `region`
/// (the nodes share a region, not a zone); and the blind-remote sum grows
/// by the share of the port's endpoints outside the receiving node's zone
/// (half of them) per flow.
#[test]
fn external_flows_are_counted_by_the_receiving_nodes_tier() {
    use proxy_agent::datapath::{dump, maps};
    use proxy_agent::model::{Frontend, Protocol};
    use proxy_common::{SHARE_ONE, tier};

    let mut w = World::new();
    let nodes = "---\napiVersion: v1\nkind: Node\nmetadata: {name: node-a, labels: {topology.kubernetes.io/zone: z1, topology.kubernetes.io/region: r1}}\n\
                 ---\napiVersion: v1\nkind: Node\nmetadata: {name: node-b, labels: {topology.kubernetes.io/zone: z2, topology.kubernetes.io/region: r1}}\n";
    w.publish(&format!("{nodes}{}", service("web", "Cluster", None, &["node-a", "node-b"], "")));
    w.start();
    for (i, (node, own)) in [(NODE_A, "pod-a"), (NODE_B, "pod-b")].into_iter().enumerate() {
        let to = format!("{node}:30080");
        w.wait_for(&to, &[], &["pod-a", "pod-b"]);
        let fe = Frontend { ip: node.parse().expect("address"), port: 30080, protocol: Protocol::Tcp };
        let counts = || {
            dump::frontend_conn_counts(w.nodes[i].pins.path(), &maps::NP_SERVICES, &maps::NP_SVC_CONN)
                .expect("read NP_SVC_CONN")
                .get(&fe)
                .copied()
                .unwrap_or_default()
        };
        let before = counts();
        let r = w.probe(&["--to", &to, "--count", "40", "--timeout-ms", "2000"]);
        let local = r.iter().filter(|x| x["ok"] == true && x["reply"] == own).count() as u64;
        assert!(r.iter().all(|x| x["ok"] == true), "{r:?}");
        let after = counts();
        let delta: Vec<u64> = after.tiers.iter().zip(before.tiers).map(|(a, b)| a - b).collect();
        let mut want = vec![0; tier::COUNT];
        want[usize::from(tier::NODE)] = local;
        want[usize::from(tier::REGION)] = 40 - local;
        assert_eq!(delta, want, "flows through {node} by tier ({:?})", tier::NAMES);
        assert_eq!(after.blind_remote_fp - before.blind_remote_fp, 40 * u64::from(SHARE_ONE / 2), "through {node}");
    }
}
