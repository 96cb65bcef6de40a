//! The move from kube-proxy to the agent, run as the book's "Switching
//! from kube-proxy" guide (`docs/src/user-guide/migration.md`) says, on a
//! simulated node that holds kube-proxy's rules for the same Services:
//! iptables-nft, iptables-legacy and nftables, one test each.
//!
//! The guide's commands are read from that page (the fenced blocks after a
//! `<!-- migration-guide -->` marker) and run in order. Node commands
//! (`proxy-agent ...`, `conntrack ...`) run as written inside the node's
//! namespace; cluster commands (`helm`, `kubectl`), which need a cluster,
//! are mapped to what they do to a node (start or restart the agent, stop
//! or restart kube-proxy, run the chart's init step), and a command the test
//! does not know fails it, so the guide cannot change without the test.
//!
//! Isolated namespaces, no link to the host's:
//!
//! ```text
//!   client 10.0.1.1 --- a-c 10.0.1.2  node-a  a-b 10.0.3.1 --- b-a 10.0.3.2  node-b
//!                        a-pod 10.244.1.1                       b-pod 10.244.2.1
//!                          |                                      |
//!                        pod-a 10.244.1.10                      pod-b 10.244.2.10
//! ```
//!
//! node-a runs kube-proxy's rules and the agent (TC on a-c and a-b, socket
//! programs on a test cgroup standing for the node's processes); node-b only
//! routes to its pod. The client reaches the external IP and the load
//! balancer IP through node-a. What is checked, with kube-proxy's rules
//! proven live first (they translate while the agent is not running):
//! - every path is the agent's while both run: the packet counters of
//!   kube-proxy's DNAT and NodePort rules do not move, and netfilter's
//!   conntrack records no new NAT binding (nothing translated twice);
//! - replies reach the client from the address it dialled;
//! - a TCP connection kube-proxy translated before the agent started keeps
//!   working through the install, the clean-up, an agent restart and the
//!   roll-back.

mod support;

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::Stdio;
use std::sync::mpsc;
use std::time::Duration;

use proxy_test_support::kube_proxy::{ServicePort, iptables_counters, iptables_ruleset, nft_counters, nft_ruleset, run_in};
use proxy_test_support::sandbox::{Cgroup, Guarded, Netns, PinDir, command_in, echo_server, spawn_backend, spawn_in_netns};
use proxy_test_support::wait::{eventually, wait_limit};
use support::{TempDir, agent_bin, replies, require_root, set};

const CLIENT: &str = "10.0.1.1";
const NODE_A: &str = "10.0.1.2";
const POD_A: &str = "10.244.1.10";
const POD_B: &str = "10.244.2.10";
const CLUSTER_IP: &str = "10.96.0.10";
const EXTERNAL_IP: &str = "192.0.2.10";
const LB_IP: &str = "198.51.100.7";

/// The pin directory the chart uses, as the guide names it: the agent's
/// default (`datapath::pins`).
const GUIDE_PINS: &str = proxy_agent::DEFAULT_BPFFS;

const WEB: ServicePort = ServicePort {
    namespace: "default",
    name: "web",
    port_name: "http",
    proto: "tcp",
    cluster_ip: CLUSTER_IP,
    port: 80,
    node_port: Some(30080),
    external_ips: &[EXTERNAL_IP],
    load_balancer_ips: &[LB_IP],
    endpoints: &[(POD_A, 8080), (POD_B, 8080)],
};

/// Long-lived connections go here: pod-b's echo server (a remote backend,
/// so kube-proxy both DNATs and masquerades them).
const ECHO: ServicePort = ServicePort {
    namespace: "default",
    name: "echo",
    port_name: "echo",
    proto: "tcp",
    cluster_ip: "10.96.0.11",
    port: 81,
    node_port: Some(30081),
    external_ips: &[],
    load_balancer_ips: &[],
    endpoints: &[(POD_B, 8081)],
};

/// The same Services for the agent.
fn manifests() -> String {
    let slice = |name: &str, port: &str, eps: &[(&str, &str)]| {
        let eps: String =
            eps.iter().map(|(ip, node)| format!("- addresses: [\"{ip}\"]\n  conditions: {{ready: true}}\n  nodeName: {node}\n")).collect();
        format!(
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}-1\n  namespace: default\n  labels: {{kubernetes.io/service-name: {name}}}\naddressType: IPv4\nports:\n- {port}\nendpoints:\n{eps}"
        )
    };
    let mut y = format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: web, namespace: default}}\nspec:\n  type: LoadBalancer\n  clusterIP: {CLUSTER_IP}\n  clusterIPs: [{CLUSTER_IP}]\n  externalIPs: [\"{EXTERNAL_IP}\"]\n  ports:\n  - {{name: http, port: 80, protocol: TCP, targetPort: 8080, nodePort: 30080}}\nstatus:\n  loadBalancer:\n    ingress: [{{ip: {LB_IP}}}]\n"
    );
    y.push_str(&slice("web", "{name: http, port: 8080, protocol: TCP}", &[(POD_A, "node-a"), (POD_B, "node-b")]));
    y.push_str(
        "---\napiVersion: v1\nkind: Service\nmetadata: {name: echo, namespace: default}\nspec:\n  type: NodePort\n  clusterIP: 10.96.0.11\n  clusterIPs: [10.96.0.11]\n  ports:\n  - {name: echo, port: 81, protocol: TCP, targetPort: 8081, nodePort: 30081}\n",
    );
    y.push_str(&slice("echo", "{name: echo, port: 8081, protocol: TCP}", &[(POD_B, "node-b")]));
    y
}

#[derive(Clone, Copy, Debug)]
enum KubeProxy {
    IptablesNft,
    IptablesLegacy,
    Nftables,
}

impl KubeProxy {
    /// What kube-proxy writes at start (and again when it comes back).
    fn write_rules(self, ns: &Netns) {
        match self {
            KubeProxy::IptablesNft => run_in(ns, "iptables-nft-restore", &["--noflush"], Some(&iptables_ruleset(&[WEB, ECHO], false))),
            KubeProxy::IptablesLegacy => {
                run_in(ns, "iptables-legacy-restore", &["--noflush"], Some(&iptables_ruleset(&[WEB, ECHO], false)))
            }
            KubeProxy::Nftables => run_in(ns, "nft", &["-f", "-"], Some(&nft_ruleset(&[WEB, ECHO]))),
        }
        .unwrap_or_else(|e| panic!("{self:?} rules: {e}"));
    }

    /// Packets that reached kube-proxy's translation: its DNAT rules, and
    /// for nftables also its NodePort dispatch rule.
    fn translated_packets(self, ns: &Netns) -> u64 {
        let count = |v: Vec<(u64, String)>| v.iter().map(|(n, _)| n).sum();
        match self {
            KubeProxy::IptablesNft | KubeProxy::IptablesLegacy => {
                let save = if matches!(self, KubeProxy::IptablesNft) { "iptables-nft-save" } else { "iptables-legacy-save" };
                let out = run_in(ns, save, &["-c", "-t", "nat"], None).expect(save);
                count(iptables_counters(&out, "-j DNAT"))
            }
            KubeProxy::Nftables => {
                let out = run_in(ns, "nft", &["list", "ruleset"], None).expect("nft list ruleset");
                count(nft_counters(&out, "dnat to")) + count(nft_counters(&out, "@service-nodeports"))
            }
        }
    }

    /// Whether any of kube-proxy's state is in the namespace.
    fn present(self, ns: &Netns) -> bool {
        match self {
            KubeProxy::IptablesNft => run_in(ns, "iptables-nft-save", &[], None).expect("save").contains("KUBE-SVC-"),
            KubeProxy::IptablesLegacy => run_in(ns, "iptables-legacy-save", &[], None).expect("save").contains("KUBE-SVC-"),
            KubeProxy::Nftables => run_in(ns, "nft", &["list", "tables"], None).expect("nft").contains("kube-proxy"),
        }
    }
}

struct Node {
    client: Netns,
    ns: Netns,
    _pod_a: Netns,
    _node_b: Netns,
    pod_b: Netns,
    cgroup: Cgroup,
    pins: PinDir,
    /// The agent's manifests directory; also where guide commands run.
    dir: TempDir,
    agent: Option<Guarded>,
    log: std::path::PathBuf,
    _backends: Vec<Guarded>,
}

impl Node {
    fn new() -> Node {
        require_root();
        let client = Netns::new("tkm").expect("client");
        let ns = Netns::new("tkm").expect("node-a");
        let pod_a = Netns::new("tkm").expect("pod-a");
        let node_b = Netns::new("tkm").expect("node-b");
        let pod_b = Netns::new("tkm").expect("pod-b");
        ns.veth("a-c", &client, "c-a").expect("veth");
        ns.veth("a-pod", &pod_a, "eth0").expect("veth");
        ns.veth("a-b", &node_b, "b-a").expect("veth");
        node_b.veth("b-pod", &pod_b, "eth0").expect("veth");
        for (n, cidr, dev) in [
            (&client, "10.0.1.1/24", "c-a"),
            (&ns, "10.0.1.2/24", "a-c"),
            (&ns, "10.244.1.1/24", "a-pod"),
            (&ns, "10.0.3.1/24", "a-b"),
            (&pod_a, "10.244.1.10/24", "eth0"),
            (&node_b, "10.0.3.2/24", "b-a"),
            (&node_b, "10.244.2.1/24", "b-pod"),
            (&pod_b, "10.244.2.10/24", "eth0"),
        ] {
            n.ip(&["addr", "add", cidr, "dev", dev]).unwrap_or_else(|e| panic!("{cidr}: {e}"));
        }
        for (n, args) in [
            (&pod_a, vec!["route", "add", "default", "via", "10.244.1.1"]),
            (&pod_b, vec!["route", "add", "default", "via", "10.244.2.1"]),
            (&node_b, vec!["route", "add", "10.244.1.0/24", "via", "10.0.3.1"]),
            (&node_b, vec!["route", "add", "10.0.1.0/24", "via", "10.0.3.1"]),
            (&ns, vec!["route", "add", "10.244.2.0/24", "via", "10.0.3.2"]),
            // A node has a default route; kube-proxy's OUTPUT DNAT needs one
            // for a ClusterIP to be routable at all. It leads to node-b,
            // which has nowhere further to send it.
            (&ns, vec!["route", "add", "default", "via", "10.0.3.2"]),
            (&client, vec!["route", "add", "192.0.2.10/32", "via", NODE_A]),
            (&client, vec!["route", "add", "198.51.100.7/32", "via", NODE_A]),
        ] {
            n.ip(&args).unwrap_or_else(|e| panic!("{args:?}: {e}"));
        }
        for n in [&ns, &node_b] {
            n.sysctl("net.ipv4.ip_forward", "1").expect("forwarding");
        }
        let backends = vec![
            spawn_backend(&agent_bin(), &pod_a, "pod-a", &[format!("{POD_A}:8080")]).expect("pod-a"),
            spawn_backend(&agent_bin(), &pod_b, "pod-b", &[format!("{POD_B}:8080")]).expect("pod-b"),
        ];
        let dir = TempDir::new("tkm");
        let log = dir.0.join("agent.log.txt");
        std::fs::write(dir.0.join("services.yaml"), manifests()).expect("manifests");
        Node {
            client,
            ns,
            _pod_a: pod_a,
            _node_b: node_b,
            pod_b,
            cgroup: Cgroup::new("tkm").expect("cgroup"),
            pins: PinDir::new("tkm").expect("pins"),
            dir,
            agent: None,
            log,
            _backends: backends,
        }
    }

    /// The agent as the DaemonSet runs it on this node.
    fn start_agent(&mut self) {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log).expect("log");
        let mut cmd = command_in(agent_bin(), Some(&self.ns), None).expect("agent");
        cmd.args(["run", "--node", "node-a", "--manifests"])
            .arg(self.dir.0.join("services.yaml"))
            .arg("--cgroup")
            .arg(self.cgroup.path())
            .arg("--bpffs")
            .arg(self.pins.path())
            .args(["--poll-interval-ms", "50", "--devices", "a-c,a-b"])
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log);
        self.agent = Some(Guarded::spawn(&mut cmd).expect("start agent"));
        let runs = self.agent_log().matches("external traffic datapath ready").count();
        // Ready: this run's TC datapath is attached and the first sync done.
        eventually("the agent's first sync", || {
            let log = self.agent_log();
            let this = log.rsplit("external traffic datapath ready").next().unwrap_or_default();
            if log.matches("external traffic datapath ready").count() > runs && this.contains("synced") { Ok(()) } else { Err(()) }
        });
    }

    fn stop_agent(&mut self) {
        if let Some(mut a) = self.agent.take() {
            a.terminate(Duration::from_secs(10)).expect("stop agent");
        }
    }

    fn agent_log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// `proxy-agent probe ARGS` from the client, or (`on_node`) from a
    /// process of node-a in the agent's cgroup.
    fn probe(&self, on_node: bool, args: &[&str]) -> Vec<serde_json::Value> {
        let mut cmd = if on_node {
            command_in(agent_bin(), Some(&self.ns), Some(&self.cgroup))
        } else {
            command_in(agent_bin(), Some(&self.client), None)
        }
        .expect("probe");
        cmd.arg("probe").args(args).stdin(Stdio::null()).stderr(Stdio::inherit());
        let out = cmd.output().expect("probe");
        String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}"))).collect()
    }

    /// Every Service path: ClusterIP from the node, NodePort, external IP
    /// and load balancer IP from the client. Each reaches both backends,
    /// and every reply comes from the address dialled.
    fn check_every_path(&self, what: &str) {
        for (on_node, to) in [
            (true, format!("{CLUSTER_IP}:80")),
            (false, format!("{NODE_A}:30080")),
            (false, format!("{EXTERNAL_IP}:80")),
            (false, format!("{LB_IP}:80")),
        ] {
            eventually(&format!("{what}: {to} reaches both pods"), || {
                let r = self.probe(on_node, &["--to", &to, "--count", "24", "--timeout-ms", "1000"]);
                let peers_ok = r.iter().all(|x| x["ok"] == true && x["peer"] == to.as_str());
                if replies(&r) == set(&["pod-a", "pod-b"]) && peers_ok {
                    Ok(())
                } else {
                    Err(r.into_iter().find(|x| x["ok"] != true || x["peer"] != to.as_str()))
                }
            });
        }
    }

    /// `conntrack -L ARGS` on the node: the original-direction tuples
    /// (`src= dst= sport= dport=`) of the listed entries.
    fn conntrack(&self, args: &[&str]) -> BTreeSet<String> {
        let mut a = vec!["-L"];
        a.extend_from_slice(args);
        tuples(&run_in(&self.ns, "conntrack", &a, None).expect("conntrack"))
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Some(mut a) = self.agent.take() {
            let _ = a.0.kill();
            let _ = a.0.wait();
        }
        if std::thread::panicking() {
            eprintln!("--- agent log ---\n{}", self.agent_log());
        }
    }
}

/// Whether a `conntrack -L` line's NAT changed an address: the destination
/// (`dst`: the reply comes from another address than the original went
/// to) or the source (the reply goes to another address than the original
/// came from). A port alone can change without any rule: netfilter's clash
/// resolution.
fn address_translated(line: &str, dst: bool) -> bool {
    let src: Vec<&str> = line.split_whitespace().filter_map(|w| w.strip_prefix("src=")).collect();
    let to: Vec<&str> = line.split_whitespace().filter_map(|w| w.strip_prefix("dst=")).collect();
    src.len() == 2 && to.len() == 2 && if dst { src[1] != to[0] } else { to[1] != src[0] }
}

/// Original-direction tuples of `conntrack -L` lines.
fn tuples(listing: &str) -> BTreeSet<String> {
    listing
        .lines()
        .filter_map(|l| {
            let words: Vec<&str> = l.split_whitespace().collect();
            let i = words.iter().position(|w| w.starts_with("src="))?;
            Some(words.get(i..i + 4)?.join(" "))
        })
        .collect()
}

/// One TCP connection from the client that stays open; `say` sends a line
/// and returns the answer.
struct Connection {
    tx: mpsc::Sender<String>,
    rx: mpsc::Receiver<Result<String, String>>,
    local: SocketAddr,
}

impl Connection {
    fn open(client: &Netns, to: &str) -> Connection {
        let to: SocketAddr = to.parse().expect("addr");
        let (tx, cmd_rx) = mpsc::channel::<String>();
        let (res_tx, rx) = mpsc::channel();
        let (local_tx, local_rx) = mpsc::channel();
        spawn_in_netns(client, move || {
            let s = TcpStream::connect_timeout(&to, Duration::from_secs(2)).expect("connect");
            local_tx.send(s.local_addr().expect("local")).expect("local");
            s.set_read_timeout(Some(Duration::from_secs(5))).ok();
            let mut r = BufReader::new(s.try_clone().expect("clone"));
            let mut w = s;
            for msg in cmd_rx {
                let out = w.write_all(format!("{msg}\n").as_bytes()).map_err(|e| e.to_string()).and_then(|()| {
                    let mut line = String::new();
                    r.read_line(&mut line).map_err(|e| e.to_string())?;
                    if line.is_empty() { Err("closed".to_string()) } else { Ok(line.trim().to_string()) }
                });
                let _ = res_tx.send(out);
            }
        })
        .expect("client thread");
        let local = local_rx.recv_timeout(Duration::from_secs(5)).expect("connected");
        Connection { tx, rx, local }
    }

    fn say(&self, msg: &str) {
        let got = self.try_say(msg).unwrap_or_else(|e| panic!("{msg}: the connection broke: {e}"));
        assert_eq!(got, format!("echo {msg}"));
    }

    fn try_say(&self, msg: &str) -> Result<String, String> {
        self.tx.send(msg.to_string()).map_err(|e| e.to_string())?;
        self.rx.recv_timeout(wait_limit()).map_err(|e| e.to_string())?
    }
}

/// The guide's commands: the lines of each fenced block after a
/// `<!-- migration-guide -->` marker in the guide's page of the book,
/// continuation lines joined, comments skipped.
fn guide_commands() -> Vec<String> {
    let page = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/src/user-guide/migration.md");
    let guide = std::fs::read_to_string(&page).unwrap_or_else(|e| panic!("reading {}: {e}", page.display()));
    let mut out = Vec::new();
    let mut lines = guide.lines();
    while let Some(l) = lines.next() {
        if l.trim() != "<!-- migration-guide -->" {
            continue;
        }
        assert_eq!(lines.next().map(str::trim), Some("```sh"), "a migration-guide marker must precede a ```sh block");
        let mut cmd = String::new();
        for l in lines.by_ref() {
            if l.trim() == "```" {
                break;
            }
            let l = l.trim();
            if l.is_empty() || l.starts_with('#') {
                continue;
            }
            if let Some(head) = l.strip_suffix('\\') {
                cmd.push_str(head.trim_end());
                cmd.push(' ');
            } else {
                cmd.push_str(l);
                out.push(std::mem::take(&mut cmd));
            }
        }
    }
    out
}

/// The guide's cluster commands, as the test carries them out on the node.
const HELM_INSTALL: &str =
    "helm install topoproxy charts/topoproxy -n kube-system --set kubernetes.apiServerHost=API_HOST --set kubernetes.apiServerPort=6443";
const AGENT_ROLLOUT: &str = "kubectl -n kube-system rollout status daemonset/topoproxy";
const GET_OBJECTS: &str = "kubectl get services,endpointslices,nodes -A -o yaml > cluster.yaml";
const STOP_KUBE_PROXY: &str = r#"kubectl -n kube-system patch daemonset kube-proxy --type merge -p '{"spec":{"template":{"spec":{"nodeSelector":{"topoproxy.io/kube-proxy":"disabled"}}}}}'"#;
const KUBE_PROXY_ROLLOUT: &str = "kubectl -n kube-system rollout status daemonset/kube-proxy";
const HELM_CLEANUP: &str = "helm upgrade topoproxy charts/topoproxy -n kube-system --reuse-values --set kubeProxyCleanup.enabled=true";
const START_KUBE_PROXY: &str = r#"kubectl -n kube-system patch daemonset kube-proxy --type json -p '[{"op":"remove","path":"/spec/template/spec/nodeSelector/topoproxy.io~1kube-proxy"}]'"#;
const HELM_UNINSTALL: &str = "helm uninstall topoproxy -n kube-system";
/// What the chart's init step runs (charts/topoproxy, `kubeProxyCleanup`;
/// charts/tests checks the rendered arguments), with the node's root
/// filesystem, which the chart mounts at /host, being this test's own.
const CHART_INIT_STEP: &[&str] = &["cleanup-kube-proxy", "--host-root", "/"];
/// `kubectl exec` into the agent's pod runs the rest on the node.
const EXEC_PREFIX: &str = "kubectl -n kube-system exec POD -- ";
/// So does a debug pod on the node, which has the node's root at /host.
const DEBUG_PREFIX: &str = "kubectl debug node/NODE -it --profile=sysadmin --image=IMAGE -- ";

/// A node command as the guide writes it, run in node-a's namespace by
/// `sh` (with the agent binary first in PATH); (exit code, stdout).
fn on_node(node: &Node, command: &str) -> (i32, String) {
    // The node's root is this test's root; its pin directory the test's.
    let pins = node.pins.path().to_string_lossy();
    let command = command
        .replace(&format!("/host{GUIDE_PINS}"), &pins)
        .replace(GUIDE_PINS, &pins)
        .replace("--host-root /host", "--host-root /")
        .replace("NODE", "node-a");
    let bin_dir = agent_bin().parent().expect("bin dir").to_path_buf();
    let path = format!("{}:{}", bin_dir.display(), std::env::var("PATH").unwrap_or_default());
    let mut cmd = command_in("sh", Some(&node.ns), None).expect("sh");
    cmd.args(["-c", &command]).env("PATH", path).current_dir(&node.dir.0).stdin(Stdio::null()).stderr(Stdio::inherit());
    let out = cmd.output().expect("sh");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    println!("--- {command} ---\n{stdout}");
    (out.status.code().unwrap_or(-1), stdout)
}

fn run_the_guide(kube_proxy: KubeProxy) {
    let mut node = Node::new();
    echo_server(&node.pod_b, format!("{POD_B}:8081").parse().expect("addr")).expect("echo server");

    // kube-proxy alone: its rules are live and translate every path.
    kube_proxy.write_rules(&node.ns);
    node.check_every_path("kube-proxy alone");
    let by_kube_proxy = kube_proxy.translated_packets(&node.ns);
    assert!(by_kube_proxy > 0, "kube-proxy's rules translated nothing");
    // A connection through kube-proxy's DNAT (and masquerade: pod-b is
    // behind node-b) that stays open through the whole migration.
    let conn = Connection::open(&node.client, &format!("{NODE_A}:30081"));
    conn.say("before the agent");
    let old_tuple = format!("src={CLIENT} dst={NODE_A} sport={} dport=30081", conn.local.port());
    let mut old = Some(conn);
    let say = |old: &Option<Connection>, msg: &str| {
        if let Some(c) = old {
            c.say(msg);
        }
    };
    let nat_before = node.conntrack(&["--dst-nat"]);
    assert!(nat_before.contains(&old_tuple), "kube-proxy's NAT binding of the connection: {nat_before:#?}");
    let snat_before = node.conntrack(&["--src-nat"]);

    let commands = guide_commands();
    assert!(commands.len() >= 15, "the guide's commands: {commands:#?}");
    let mut rollouts = 0;
    let mut dry_runs = 0;
    let mut agent_translations = 0;
    for command in &commands {
        match command.as_str() {
            HELM_INSTALL => node.start_agent(),
            AGENT_ROLLOUT => {
                rollouts += 1;
                assert!(node.agent.is_some(), "{command}: no agent");
                // Both run; every path is the agent's: kube-proxy's rules
                // see no packet and conntrack gets no NAT binding.
                let before = kube_proxy.translated_packets(&node.ns);
                node.check_every_path(&format!("rollout {rollouts}"));
                if kube_proxy.present(&node.ns) {
                    assert_eq!(kube_proxy.translated_packets(&node.ns), before, "kube-proxy translated packets while the agent ran");
                }
                let listing = run_in(&node.ns, "conntrack", &["-L", "--dst-nat"], None).expect("conntrack");
                let new_nat: Vec<&str> =
                    listing.lines().filter(|l| address_translated(l, true) && tuples(l).is_disjoint(&nat_before)).collect();
                if !new_nat.is_empty() {
                    let all = run_in(&node.ns, "conntrack", &["-L"], None).unwrap_or_default();
                    panic!("NAT bindings made while the agent ran: {new_nat:#?}\nconntrack -L:\n{all}\nagent log:\n{}", node.agent_log());
                }
                // A source NAT that keeps the address is no masquerade:
                // netfilter moves a new connection to another source port
                // when its reply tuple is taken (here by a connection
                // kube-proxy masqueraded before, nf_nat_used_tuple).
                let listing = run_in(&node.ns, "conntrack", &["-L", "--src-nat"], None).expect("conntrack");
                let masqueraded: Vec<&str> =
                    listing.lines().filter(|l| address_translated(l, false) && tuples(l).is_disjoint(&snat_before)).collect();
                assert!(masqueraded.is_empty(), "masquerade bindings made while the agent ran: {masqueraded:#?}");
                let counters = proxy_agent::datapath::dump::np_counters(node.pins.path()).unwrap_or_default();
                assert!(
                    counters.get("new_flow").copied().unwrap_or(0) > agent_translations,
                    "the agent's TC datapath translated nothing: {counters:?}"
                );
                agent_translations = counters.get("new_flow").copied().unwrap_or(0);
                say(&old, &format!("after rollout {rollouts}"));
                if old.is_some() {
                    // The old connection's segments went by untranslated.
                    let counters = proxy_agent::datapath::dump::np_counters(node.pins.path()).unwrap_or_default();
                    assert!(counters.get("pass_untracked_tcp").copied().unwrap_or(0) > 0, "{counters:?}");
                }
            }
            GET_OBJECTS => std::fs::write(node.dir.0.join("cluster.yaml"), manifests()).expect("cluster.yaml"),
            STOP_KUBE_PROXY | KUBE_PROXY_ROLLOUT => {
                // kube-proxy's pod goes (or comes back, below); its rules
                // stay as they are either way until something removes them.
                say(&old, command);
            }
            HELM_CLEANUP => {
                // Each agent pod restarts with the init step first.
                node.stop_agent();
                say(&old, "agent stopped");
                let mut cmd = command_in(agent_bin(), Some(&node.ns), None).expect("init step");
                cmd.args(CHART_INIT_STEP).stdin(Stdio::null()).stderr(Stdio::inherit());
                let out = cmd.output().expect("init step");
                let log = String::from_utf8_lossy(&out.stdout);
                println!("--- init step ---\n{log}");
                assert!(out.status.success(), "{log}");
                assert!(log.contains("removed ") && log.trim_end().ends_with("errors 0"), "{log}");
                assert!(!kube_proxy.present(&node.ns), "kube-proxy's rules are still there");
                if matches!(kube_proxy, KubeProxy::Nftables) {
                    // nftables mode's table held the node's only NAT chains:
                    // the clean-up says that connections kube-proxy
                    // translated end with it, and so they do. (iptables
                    // modes leave the nat table's built-in chains, and with
                    // them netfilter's NAT, in place.)
                    assert!(log.contains("note: kube-proxy's tables hold the only NAT chains at ip prerouting"), "{log}");
                    let c = old.take().expect("connection");
                    assert!(c.try_say("after the clean-up").is_err(), "the connection outlived netfilter's NAT hooks");
                }
                node.start_agent();
            }
            START_KUBE_PROXY => {
                kube_proxy.write_rules(&node.ns);
                say(&old, "kube-proxy is back");
            }
            HELM_UNINSTALL => {
                node.stop_agent();
                // The pinned datapath keeps serving without an agent.
                node.check_every_path("agent uninstalled, datapath pinned");
            }
            c if c.starts_with("proxy-agent explain ") => {
                let (code, out) = on_node(&node, c);
                assert_eq!(code, 0, "{c}");
                assert!(out.contains(&format!("{CLUSTER_IP}:80")) && out.contains("10.96.0.11:81"), "{c}: {out}");
            }
            c if c.starts_with(&format!("{EXEC_PREFIX}proxy-agent dump ")) => {
                let (code, out) = on_node(&node, &c[EXEC_PREFIX.len()..]);
                assert_eq!(code, 0, "{c}: {out}");
                assert_eq!(out.trim_end().lines().last(), Some("consistent: no findings"), "{c}");
                assert!(out.contains(&format!("{CLUSTER_IP}:80")), "{c}: {out}");
            }
            "conntrack -L --dst-nat" => {
                let (code, out) = on_node(&node, command);
                assert_eq!(code, 0, "{command}");
                let listed = tuples(&out);
                assert!(listed.contains(&old_tuple), "the connection from before the agent keeps its NAT: {listed:#?}");
                let new: Vec<&str> = out.lines().filter(|l| address_translated(l, true) && tuples(l).is_disjoint(&nat_before)).collect();
                assert!(new.is_empty(), "connections NATed by netfilter after the agent started: {new:#?}");
            }
            c if c == format!("{DEBUG_PREFIX}proxy-agent cleanup-kube-proxy --dry-run --host-root /host") => {
                dry_runs += 1;
                let before = kube_proxy.present(&node.ns);
                let (code, out) = on_node(&node, &c[DEBUG_PREFIX.len()..]);
                assert_eq!(code, 0, "{command}: {out}");
                let summary = out.lines().last().unwrap_or_default();
                if dry_runs == 1 {
                    assert!(out.contains("would remove "), "{out}");
                    assert!(!summary.contains("would remove 0,"), "{summary}");
                } else {
                    assert!(summary.contains("would remove 0,"), "{summary}");
                }
                assert_eq!(kube_proxy.present(&node.ns), before, "--dry-run changed something");
            }
            c if c.starts_with(&format!("{DEBUG_PREFIX}proxy-agent reset ")) => {
                let (code, out) = on_node(&node, &c[DEBUG_PREFIX.len()..]);
                assert_eq!(code, 0, "{c}: {out}");
                assert!(out.is_empty(), "{c}: {out}");
                let (code, _) = on_node(&node, &format!("proxy-agent dump --bpffs /host{GUIDE_PINS}"));
                assert_eq!(code, 1, "dump after reset finds no maps");
                // kube-proxy serves again: its counters move.
                let before = kube_proxy.translated_packets(&node.ns);
                node.check_every_path("after the roll-back");
                assert!(kube_proxy.translated_packets(&node.ns) > before, "kube-proxy does not translate after the roll-back");
            }
            other => panic!("the guide has a command this test does not know; teach the test what it does on a node: {other}"),
        }
    }
    assert_eq!((rollouts, dry_runs), (2, 2), "the guide's steps changed: {commands:#?}");
    say(&old, "at the end");
}

#[test]
fn the_migration_guide_next_to_iptables_nft_rules() {
    run_the_guide(KubeProxy::IptablesNft);
}

#[test]
fn the_migration_guide_next_to_iptables_legacy_rules() {
    run_the_guide(KubeProxy::IptablesLegacy);
}

#[test]
fn the_migration_guide_next_to_nftables_rules() {
    run_the_guide(KubeProxy::Nftables);
}

#[test]
fn the_guide_is_found_in_the_readme() {
    let c = guide_commands();
    assert_eq!(c.first().map(String::as_str), Some(HELM_INSTALL), "{c:#?}");
    assert_eq!(c.last().map(String::as_str), Some(&*format!("{DEBUG_PREFIX}proxy-agent reset --bpffs /host{GUIDE_PINS}")), "{c:#?}");
}
