//! NodePort at XDP (`--xdp`): flows to a remote backend are translated and
//! forwarded by the XDP program on the node's client-facing veth, sharing
//! conntrack with the TC programs, which handle the replies and everything
//! XDP passes on. Both families: IPv4, and IPv6 without extension headers.
//!
//! Three isolated namespaces, no link to the host's:
//!
//! ```text
//!   client c-n 10.0.1.1  ---- n-c 10.0.1.2   node  n-b 10.0.3.1  ---- eth0 10.0.3.2  backend
//!              fd00:1::1           fd00:1::2           fd00:3::1           fd00:3::2
//! ```
//!
//! The backend stands for a pod on another node: its endpoints name
//! another node, so the agent (node `node-a`, `--devices n-c,n-b`) DNATs
//! and SNATs to it. The client has no route to 10.0.3.0/24 or fd00:3::/64.
//!
//! Two veth settings make XDP forwarding work, both set here with the
//! ethtool ioctl (no ethtool binary needed):
//! * GRO on the backend's `eth0`: a veth accepts frames redirected into its
//!   peer only when its receive queue runs NAPI, which GRO (or an XDP
//!   program) turns on (drivers/net/veth.c, `veth_xdp_xmit`); without it the
//!   redirect drops the frame.
//! * Transmit checksum offload off on the client's `c-n`: otherwise the
//!   client's TCP segments cross the veth with partial checksums, which a
//!   forwarded XDP frame cannot carry (a NIC always delivers complete ones).
//!   `ETHTOOL_STXCSUM` switches every transmit checksum feature of the
//!   device, IPv6's included (net/ethtool/ioctl.c, `NETIF_F_CSUM_MASK`).
//!
//! The raw-frame tests at the end run the programs with BPF_PROG_TEST_RUN
//! in namespaces of their own: what XDP passes and how TC continues, and
//! the bytes of frames XDP forwards (checksums above all).

mod support;

use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use proxy_test_support::checksum::csum;
use proxy_test_support::sandbox::{Cgroup, Guarded, Netns, PinDir, command_in, echo_server, in_netns, spawn_backend};
use proxy_test_support::wait::eventually;
use support::*;

/// The node's client-facing and the backend's address, of one family, and
/// the local pod's (`World::with_local`).
#[derive(Clone, Copy, Debug)]
struct Family {
    node: &'static str,
    backend: &'static str,
    local: &'static str,
}

const V4: Family = Family { node: "10.0.1.2", backend: "10.0.3.2", local: "10.0.4.2" };
const V6: Family = Family { node: "fd00:1::2", backend: "fd00:3::2", local: "fd00:4::2" };

/// `ip:port` as a socket address string (`[ip]:port` for IPv6).
fn at(ip: &str, port: u16) -> String {
    SocketAddr::new(ip.parse().expect("test address"), port).to_string()
}

struct World {
    client: Netns,
    node: Netns,
    backend: Netns,
    cgroup: Cgroup,
    pins: PinDir,
    manifests: TempDir,
    log: PathBuf,
    agent: Option<Guarded>,
    _backend_proc: Guarded,
    /// `with_local`'s backends (processes first: dropped before their
    /// namespaces).
    local_procs: Vec<Guarded>,
    local_ns: Vec<Netns>,
}

impl World {
    fn new() -> World {
        World::build(false)
    }

    /// `new`, plus backends on the node itself (node `node-a`), for the
    /// TC fast path's local delivery:
    ///
    /// ```text
    ///   node n-l 10.0.4.1 fd00:4::1 ---- eth0 10.0.4.2 fd00:4::2   pod-l (a pod behind its veth)
    ///   node br-l 10.0.5.1 [n-q] ------- eth0 10.0.5.2             pod-q (a pod behind a bridge)
    ///   node 10.0.1.2:7070                                         host-a (a host-network endpoint)
    /// ```
    ///
    /// Service `local` (NodePorts 30081 TCP, 30054 UDP) has pod-l as its
    /// only endpoint, `bridged` (30083) pod-q, `hostnet` (30082) host-a.
    /// n-l and n-q are not in `--devices`: the TC programs do not run on
    /// them.
    fn with_local() -> World {
        World::build(true)
    }

    fn build(local: bool) -> World {
        require_root();
        let client = Netns::new("txdp").expect("client netns");
        let node = Netns::new("txdp").expect("node netns");
        let backend = Netns::new("txdp").expect("backend netns");
        node.veth("n-c", &client, "c-n").expect("veth client-node");
        node.veth("n-b", &backend, "eth0").expect("veth node-backend");
        for (ns, cidr, dev) in [
            (&client, "10.0.1.1/24", "c-n"),
            (&client, "fd00:1::1/64", "c-n"),
            (&node, "10.0.1.2/24", "n-c"),
            (&node, "fd00:1::2/64", "n-c"),
            (&node, "10.0.3.1/24", "n-b"),
            (&node, "fd00:3::1/64", "n-b"),
            (&backend, "10.0.3.2/24", "eth0"),
            (&backend, "fd00:3::2/64", "eth0"),
        ] {
            // No duplicate address detection: the addresses are usable at
            // once instead of tentative for a second or more.
            let mut args = vec!["addr", "add", cidr, "dev", dev];
            if cidr.contains(':') {
                args.push("nodad");
            }
            ns.ip(&args).unwrap_or_else(|e| panic!("{cidr} on {dev}: {e}"));
        }
        backend.ip(&["route", "add", "default", "via", "10.0.3.1"]).expect("backend route");
        backend.ip(&["-6", "route", "add", "default", "via", "fd00:3::1"]).expect("backend route6");
        node.sysctl("net.ipv4.ip_forward", "1").expect("ip_forward");
        // Also what lets `bpf_fib_lookup` answer for IPv6 at all: it
        // refuses to forward from a device without it
        // (`BPF_FIB_LKUP_RET_FWD_DISABLED`, net/core/filter.c).
        node.sysctl("net.ipv6.conf.all.forwarding", "1").expect("ipv6 forwarding");
        in_netns(&backend, || ethtool_set("eth0", ETHTOOL_SGRO, 1)).expect("netns").expect("GRO on the backend's eth0");
        in_netns(&client, || ethtool_set("c-n", ETHTOOL_STXCSUM, 0)).expect("netns").expect("tx checksum off on c-n");
        let listen: Vec<String> = [V4, V6].iter().flat_map(|f| [at(f.backend, 8080), at(f.backend, 5353)]).collect();
        let backend_proc = spawn_backend(&agent_bin(), &backend, "pod-b", &listen).expect("backend");
        let manifests = TempDir::new("txdp-manifests");
        let log = manifests.0.join("agent.log.txt");
        let mut w = World {
            client,
            node,
            backend,
            cgroup: Cgroup::new("txdp").expect("cgroup"),
            pins: PinDir::new("txdp").expect("pins"),
            manifests,
            log,
            agent: None,
            _backend_proc: backend_proc,
            local_procs: Vec::new(),
            local_ns: Vec::new(),
        };
        if local {
            (w.local_procs, w.local_ns) = local_backends(&w.node);
        }
        let mut yaml = "---\napiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: default}\nspec:\n  type: NodePort\n  clusterIP: 10.96.0.10\n  clusterIPs: [10.96.0.10, \"fd00:96::10\"]\n  ipFamilies: [IPv4, IPv6]\n  ipFamilyPolicy: RequireDualStack\n  externalTrafficPolicy: Cluster\n  ports:\n  - {name: http, port: 80, protocol: TCP, targetPort: 8080, nodePort: 30080}\n  - {name: dns, port: 53, protocol: UDP, targetPort: 5353, nodePort: 30053}\n  - {name: echo, port: 90, protocol: TCP, targetPort: 9090, nodePort: 30090}\n".to_string();
        for (fam, ip) in [("IPv4", V4.backend), ("IPv6", V6.backend)] {
            yaml.push_str(&format!(
                "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: web-{}\n  namespace: default\n  labels: {{kubernetes.io/service-name: web}}\naddressType: {fam}\nports:\n- {{name: http, port: 8080, protocol: TCP}}\n- {{name: dns, port: 5353, protocol: UDP}}\n- {{name: echo, port: 9090, protocol: TCP}}\nendpoints:\n- addresses: [\"{ip}\"]\n  conditions: {{ready: true}}\n  nodeName: node-b\n",
                fam.to_lowercase()
            ));
        }
        if local {
            yaml.push_str(LOCAL_MANIFEST);
        }
        std::fs::write(w.manifests.0.join("cluster.yaml"), yaml).expect("write manifest");
        w
    }

    /// Starts the agent with `--xdp <xdp>`; an empty `xdp` leaves the
    /// flag out (the default).
    fn start_agent(&mut self, xdp: &str) {
        self.start_agent_with(xdp, &[]);
    }

    /// Waits until the agent started `runs`-th in this world has attached
    /// its programs (the old ones serve until then: a probe that answers
    /// proves nothing about the new agent), with the fast path as `fast`.
    fn wait_attached(&self, runs: usize, fast: bool) {
        let want = format!("tc_fast_path={fast}");
        eventually(&format!("agent run {runs} to attach its programs with {want}"), || {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            let ready: Vec<&str> = log.lines().filter(|l| l.contains("external traffic datapath ready")).collect();
            if ready.len() >= runs && ready[runs - 1].contains(&want) { Ok(()) } else { Err(ready.len()) }
        });
    }

    /// `start_agent` with more flags (`--tc-fast-path`).
    fn start_agent_with(&mut self, xdp: &str, extra: &[&str]) {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log).expect("open log");
        let mut cmd = command_in(agent_bin(), Some(&self.node), None).expect("agent command");
        cmd.arg("run")
            .args(["--node", "node-a"])
            .arg("--manifests")
            .arg(&self.manifests.0)
            .arg("--cgroup")
            .arg(self.cgroup.path())
            .arg("--bpffs")
            .arg(self.pins.path())
            .args(["--poll-interval-ms", "50", "--devices", "n-c,n-b", "--node-ip", &format!("{},{}", V4.node, V6.node)])
            .args(if xdp.is_empty() { Vec::new() } else { vec!["--xdp", xdp] })
            .args(extra)
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

    fn counter(&self, name: &str) -> u64 {
        proxy_agent::datapath::dump::np_counters(self.pins.path()).unwrap_or_default().get(name).copied().unwrap_or(0)
    }

    /// A TC fast-path counter (`NP_FAST_COUNTERS`), summed over CPUs.
    fn fast_counter(&self, name: &str) -> u64 {
        proxy_agent::datapath::dump::np_fast_counters(self.pins.path()).unwrap_or_default().get(name).copied().unwrap_or(0)
    }

    /// Packets the node's FORWARD chain saw for `fam` (the counter of a
    /// rule `forward_counter_rule` put first in the chain).
    fn forward_packets(&self, fam: Family) -> u64 {
        let tool = if fam.node.contains(':') { "ip6tables" } else { "iptables" };
        let out = command_in(tool, Some(&self.node), None)
            .expect("iptables")
            .args(["-w", "-L", "FORWARD", "1", "-v", "-x", "-n"])
            .output()
            .expect("run iptables");
        let text = String::from_utf8_lossy(&out.stdout);
        text.split_whitespace().next().and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("{tool} -L FORWARD 1 printed {text:?}"))
    }

    /// A counting rule (no target) first in the node's FORWARD chain of both
    /// families, whose packet count `forward_packets` reads: every
    /// packet the stack forwards passes it.
    fn forward_counter_rule(&self) {
        for tool in ["iptables", "ip6tables"] {
            let st = command_in(tool, Some(&self.node), None)
                .expect("iptables")
                .args(["-w", "-I", "FORWARD", "1", "-m", "comment", "--comment", "topoproxy-test"])
                .status()
                .expect("run iptables");
            assert!(st.success(), "{tool} -I FORWARD failed");
        }
    }

    /// `forward_counter_rule` for the packets to `fam`'s local pod only
    /// (the client's way in; the pod's replies enter from its veth, where
    /// no program of ours runs, and the stack forwards them).
    fn forward_to_local_rule(&self, fam: Family) {
        let tool = if fam.node.contains(':') { "ip6tables" } else { "iptables" };
        let st = command_in(tool, Some(&self.node), None)
            .expect("iptables")
            .args(["-w", "-I", "FORWARD", "1", "-d", fam.local, "-m", "comment", "--comment", "topoproxy-test-local"])
            .status()
            .expect("run iptables");
        assert!(st.success(), "{tool} -I FORWARD -d {} failed", fam.local);
    }

    fn xdp_devices(&self) -> Vec<String> {
        proxy_agent::datapath::xdp_loader::attached_devices(self.pins.path())
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

    /// Waits until `to` answers from the client, every probe of a round.
    fn wait_answers(&self, to: &str, extra: &[&str]) {
        self.wait_answers_from(to, extra, "pod-b");
    }

    /// `wait_answers` from the backend named `name`.
    fn wait_answers_from(&self, to: &str, extra: &[&str], name: &str) {
        eventually(&format!("{to} {extra:?} to answer from {name}"), || {
            let mut args = vec!["--to", to, "--count", "8", "--timeout-ms", "1000"];
            args.extend_from_slice(extra);
            let r = self.probe(&args);
            if replies(&r) == set(&[name]) && r.iter().all(|x| x["ok"] == true) { Ok(()) } else { Err(r) }
        });
    }

    /// `proxy-agent dump` as text and as JSON.
    fn dump(&self) -> (String, serde_json::Value) {
        let run = |output: &str| {
            let out = std::process::Command::new(agent_bin())
                .args(["dump", "--output", output, "--bpffs"])
                .arg(self.pins.path())
                .output()
                .expect("run proxy-agent dump");
            String::from_utf8_lossy(&out.stdout).into_owned()
        };
        let json = run("json");
        (run("table"), serde_json::from_str(&json).unwrap_or_else(|e| panic!("dump printed {json:?}: {e}")))
    }

    /// Whether the XDP program is attached to `dev` in the node's
    /// namespace, as the kernel reports it (`ip link` shows `xdp`).
    fn kernel_has_xdp(&self, dev: &str) -> bool {
        let out = command_in("ip", Some(&self.node), None).expect("ip").args(["-d", "link", "show", dev]).output().expect("ip link");
        let text = String::from_utf8_lossy(&out.stdout);
        text.contains("prog/xdp") || text.contains(" xdp ")
    }
}

impl Drop for World {
    fn drop(&mut self) {
        if let Some(mut a) = self.agent.take() {
            let _ = a.0.kill();
            let _ = a.0.wait();
        }
        if std::thread::panicking() {
            eprintln!("--- agent log ---\n{}", std::fs::read_to_string(&self.log).unwrap_or_default());
            eprintln!("--- dump ---\n{}", self.dump().0);
        }
        // The pins (XDP link included) go with `pins`, the devices with the
        // namespaces.
        let _ = &self.backend;
        // The local backends' processes end before their namespaces go
        // (field order), after the agent.
        let _ = (&self.local_procs, &self.local_ns);
    }
}

/// `World::with_local`'s Services: each with one endpoint on `node-a`.
const LOCAL_MANIFEST: &str = "---
apiVersion: v1
kind: Service
metadata: {name: local, namespace: default}
spec:
  type: NodePort
  clusterIP: 10.96.0.11
  clusterIPs: [10.96.0.11, \"fd00:96::11\"]
  ipFamilies: [IPv4, IPv6]
  ipFamilyPolicy: RequireDualStack
  ports:
  - {name: http, port: 80, protocol: TCP, targetPort: 8080, nodePort: 30081}
  - {name: dns, port: 53, protocol: UDP, targetPort: 5353, nodePort: 30054}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: local-ipv4, namespace: default, labels: {kubernetes.io/service-name: local}}
addressType: IPv4
ports:
- {name: http, port: 8080, protocol: TCP}
- {name: dns, port: 5353, protocol: UDP}
endpoints:
- {addresses: [\"10.0.4.2\"], conditions: {ready: true}, nodeName: node-a}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: local-ipv6, namespace: default, labels: {kubernetes.io/service-name: local}}
addressType: IPv6
ports:
- {name: http, port: 8080, protocol: TCP}
- {name: dns, port: 5353, protocol: UDP}
endpoints:
- {addresses: [\"fd00:4::2\"], conditions: {ready: true}, nodeName: node-a}
---
apiVersion: v1
kind: Service
metadata: {name: hostnet, namespace: default}
spec:
  type: NodePort
  clusterIP: 10.96.0.12
  ports:
  - {name: http, port: 80, protocol: TCP, targetPort: 7070, nodePort: 30082}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: hostnet-ipv4, namespace: default, labels: {kubernetes.io/service-name: hostnet}}
addressType: IPv4
ports:
- {name: http, port: 7070, protocol: TCP}
endpoints:
- {addresses: [\"10.0.1.2\"], conditions: {ready: true}, nodeName: node-a}
---
apiVersion: v1
kind: Service
metadata: {name: bridged, namespace: default}
spec:
  type: NodePort
  clusterIP: 10.96.0.13
  ports:
  - {name: http, port: 80, protocol: TCP, targetPort: 8080, nodePort: 30083}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: bridged-ipv4, namespace: default, labels: {kubernetes.io/service-name: bridged}}
addressType: IPv4
ports:
- {name: http, port: 8080, protocol: TCP}
endpoints:
- {addresses: [\"10.0.5.2\"], conditions: {ready: true}, nodeName: node-a}
";

/// The local backends of `World::with_local` around `node`: their
/// processes and namespaces.
fn local_backends(node: &Netns) -> (Vec<Guarded>, Vec<Netns>) {
    let pod = Netns::new("txdp").expect("pod-l netns");
    let bridged = Netns::new("txdp").expect("pod-q netns");
    node.veth("n-l", &pod, "eth0").expect("veth node-pod");
    node.veth("n-q", &bridged, "eth0").expect("veth node-bridged");
    node.ip(&["link", "add", "br-l", "type", "bridge"]).expect("bridge");
    node.ip(&["link", "set", "n-q", "master", "br-l"]).expect("enslave n-q");
    node.ip(&["link", "set", "br-l", "up"]).expect("bridge up");
    for (ns, cidr, dev) in [
        (node, "10.0.4.1/24", "n-l"),
        (node, "fd00:4::1/64", "n-l"),
        (&pod, "10.0.4.2/24", "eth0"),
        (&pod, "fd00:4::2/64", "eth0"),
        (node, "10.0.5.1/24", "br-l"),
        (&bridged, "10.0.5.2/24", "eth0"),
    ] {
        let mut args = vec!["addr", "add", cidr, "dev", dev];
        if cidr.contains(':') {
            args.push("nodad");
        }
        ns.ip(&args).unwrap_or_else(|e| panic!("{cidr} on {dev}: {e}"));
    }
    pod.ip(&["route", "add", "default", "via", "10.0.4.1"]).expect("pod-l route");
    pod.ip(&["-6", "route", "add", "default", "via", "fd00:4::1"]).expect("pod-l route6");
    bridged.ip(&["route", "add", "default", "via", "10.0.5.1"]).expect("pod-q route");
    let listen: Vec<String> = [V4, V6].iter().flat_map(|f| [at(f.local, 8080), at(f.local, 5353)]).collect();
    let procs = vec![
        spawn_backend(&agent_bin(), &pod, "pod-l", &listen).expect("pod-l"),
        spawn_backend(&agent_bin(), &bridged, "pod-q", &[at("10.0.5.2", 8080)]).expect("pod-q"),
        spawn_backend(&agent_bin(), node, "host-a", &[at(V4.node, 7070)]).expect("host-a"),
    ];
    (procs, vec![pod, bridged])
}

const ETHTOOL_STXCSUM: u32 = 0x17;
const ETHTOOL_SGRO: u32 = 0x2c;

/// One legacy ethtool "set" command (`struct ethtool_value`) on `dev`
/// through `SIOCETHTOOL`, in the calling thread's namespace.
fn ethtool_set(dev: &str, cmd: u32, value: u32) -> std::io::Result<()> {
    #[repr(C)]
    struct EthtoolValue {
        cmd: u32,
        data: u32,
    }
    let mut v = EthtoolValue { cmd, data: value };
    // SAFETY: an all-zero `ifreq` is valid (a name and a union of integers
    // and pointers).
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in ifr.ifr_name.iter_mut().zip(dev.bytes()) {
        *d = s as libc::c_char;
    }
    ifr.ifr_ifru.ifru_data = (&raw mut v).cast();
    // SAFETY: a plain datagram socket, closed below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `ifr` names the device and points at `v`, both live for the
    // call; the kernel reads `v` (`ethtool_set_value`).
    let rc = unsafe { libc::ioctl(fd, libc::SIOCETHTOOL, &raw mut ifr) };
    let err = std::io::Error::last_os_error();
    // SAFETY: our own descriptor.
    unsafe { libc::close(fd) };
    if rc < 0 { Err(err) } else { Ok(()) }
}

/// A TCP connection from the client namespace to `to`.
fn connect(client: &Netns, to: SocketAddr) -> TcpStream {
    let s = in_netns(client, move || TcpStream::connect_timeout(&to, Duration::from_secs(5))).expect("netns").expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
    s
}

fn echo(s: &mut TcpStream, r: &mut BufReader<TcpStream>, msg: &str) {
    s.write_all(format!("{msg}\n").as_bytes()).expect("write");
    let mut line = String::new();
    r.read_line(&mut line).unwrap_or_else(|e| panic!("no echo of {msg}: {e}"));
    assert_eq!(line, format!("echo {msg}\n"));
}

#[test]
fn remote_backend_answers_through_xdp_conntrack_is_shared_and_restart_and_removal_keep_the_flow() {
    remote_backend_through_xdp(V4);
}

#[test]
fn remote_backend_answers_over_ipv6_through_xdp_conntrack_is_shared_and_restart_and_removal_keep_the_flow() {
    remote_backend_through_xdp(V6);
}

/// One family's flows to the remote backend: forwarded by XDP (TCP and
/// UDP), the replies translated by TC from the same conntrack entries, and
/// a long-lived connection carried on across an agent restart (the pinned
/// XDP link adopted) and the removal of XDP (TC takes the flow over).
fn remote_backend_through_xdp(fam: Family) {
    let mut w = World::new();
    w.start_agent("native");
    eventually("the XDP link to be pinned on n-c and n-b", || {
        let d = w.xdp_devices();
        if d == ["n-b", "n-c"] { Ok(()) } else { Err(d) }
    });
    assert!(w.kernel_has_xdp("n-c"), "the kernel shows no XDP program on n-c");
    let (text, json) = w.dump();
    assert!(text.contains("xdp: native on n-b n-c"), "{text}");
    assert_eq!(json["nodeport"]["xdpDevices"], serde_json::json!(["n-b", "n-c"]));
    // TCP and UDP: the first packet of the first flow finds the backend's
    // neighbour unresolved (XDP passes it to TC, which resolves it through
    // the stack: ARP, or neighbour discovery for IPv6); then XDP forwards.
    let (http, dns) = (at(fam.node, 30080), at(fam.node, 30053));
    w.wait_answers(&http, &[]);
    w.wait_answers(&dns, &["--udp"]);
    let before = w.counter("xdp_forwarded");
    w.wait_answers(&http, &[]);
    let after = w.counter("xdp_forwarded");
    assert!(after > before, "XDP forwarded nothing: {before} -> {after}");
    // Replies come back through TC (ingress reverses the SNAT, egress the
    // DNAT): the entries XDP used are the TC path's.
    assert!(w.counter("tracked") > 0);
    assert_eq!(w.counter("rewrite_failed"), 0);

    // A long-lived connection, then XDP removed under it.
    let _accepted = echo_server(&w.backend, at(fam.backend, 9090).parse().expect("addr")).expect("echo server");
    let mut s = connect(&w.client, at(fam.node, 30090).parse().expect("addr"));
    let mut r = BufReader::new(s.try_clone().expect("clone"));
    for i in 0..5 {
        echo(&mut s, &mut r, &format!("xdp {i}"));
    }
    let forwarded = w.counter("xdp_forwarded");
    assert!(forwarded > after, "the echo connection did not go through XDP");

    // Restart with XDP on: the pinned link is adopted (same pin, program
    // swapped in place), the connection goes on.
    let pin = proxy_agent::datapath::pins::xdp_link(w.pins.path(), "n-c");
    let ino = || std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(&pin).expect("xdp link pin"));
    let ino_before = ino();
    w.stop_agent();
    assert!(w.kernel_has_xdp("n-c"), "XDP must stay attached while no agent runs");
    echo(&mut s, &mut r, "between agents");
    w.start_agent("native");
    eventually("the restarted agent to serve", || {
        let r = w.probe(&["--to", &http, "--count", "2", "--timeout-ms", "1000"]);
        if r.iter().all(|x| x["ok"] == true) && !r.is_empty() { Ok(()) } else { Err(r) }
    });
    assert_eq!(ino(), ino_before, "the restart must adopt the pinned XDP link, not replace it");
    echo(&mut s, &mut r, "after restart");

    // --xdp off: the link is unpinned and detached; TC carries the same
    // flow on from NP_CT.
    w.stop_agent();
    w.start_agent("off");
    eventually("XDP to be detached", || if w.xdp_devices().is_empty() && !w.kernel_has_xdp("n-c") { Ok(()) } else { Err(w.xdp_devices()) });
    let (text, _) = w.dump();
    assert!(text.contains("xdp: off (TC alone)"), "{text}");
    let tracked = w.counter("tracked");
    let forwarded = w.counter("xdp_forwarded");
    for i in 0..5 {
        echo(&mut s, &mut r, &format!("tc {i}"));
    }
    assert_eq!(w.counter("xdp_forwarded"), forwarded, "XDP is detached");
    assert!(w.counter("tracked") > tracked, "TC did not carry the flow on");
    w.stop_agent();
}

// ---------------------------------------------------------------------------
// The TC fast path (`--tc-fast-path`, proxy-ebpf/src/programs/tc_fast.rs), XDP off:
// the same topology, the node's FORWARD chain counted by iptables.
// ---------------------------------------------------------------------------

#[test]
fn tc_fast_path_forwards_remote_flows_past_the_forward_chain_and_off_restores_the_stack() {
    tc_fast_path_bypasses_forward(V4);
}

#[test]
fn tc_fast_path_forwards_remote_flows_over_ipv6_past_the_forward_chain_and_off_restores_the_stack() {
    tc_fast_path_bypasses_forward(V6);
}

/// One family, TCP and UDP to the remote backend, XDP off: with the fast
/// path (the default) the flows' packets, both ways, leave from TC ingress
/// and the FORWARD chain's counter stays still; a long-lived connection
/// goes on across a restart that adopts the pinned programs and across
/// one to `--tc-fast-path off`, after which the stack forwards again and
/// the counter moves.
fn tc_fast_path_bypasses_forward(fam: Family) {
    let mut w = World::new();
    w.forward_counter_rule();
    w.start_agent("");
    w.wait_attached(1, true);
    let (http, dns) = (at(fam.node, 30080), at(fam.node, 30053));
    // The first flows resolve the neighbours through the stack (the fast
    // path needs a resolved one: `tc_stack_no_route`).
    w.wait_answers(&http, &[]);
    w.wait_answers(&dns, &["--udp"]);
    let echo_addr: SocketAddr = at(fam.node, 30090).parse().expect("addr");
    let _accepted = echo_server(&w.backend, at(fam.backend, 9090).parse().expect("addr")).expect("echo server");
    let mut s = connect(&w.client, echo_addr);
    let mut r = BufReader::new(s.try_clone().expect("clone"));
    echo(&mut s, &mut r, "warm");
    let (fwd, fast, reply) = (w.forward_packets(fam), w.fast_counter("tc_fast_forwarded"), w.fast_counter("tc_fast_reply_forwarded"));
    // New TCP connections (SYN included) and UDP flows, and the long-lived one.
    w.wait_answers(&http, &[]);
    w.wait_answers(&dns, &["--udp"]);
    for i in 0..5 {
        echo(&mut s, &mut r, &format!("fast {i}"));
    }
    assert_eq!(w.forward_packets(fam), fwd, "the stack forwarded packets the fast path should have sent");
    assert!(w.fast_counter("tc_fast_forwarded") > fast, "nothing went the fast way to the backend");
    assert!(w.fast_counter("tc_fast_reply_forwarded") > reply, "no reply went the fast way to the client");
    assert_eq!(w.counter("rewrite_failed"), 0);
    let (text, json) = w.dump();
    assert!(text.contains("tc fast path: "), "{text}");
    assert!(json["nodeport"]["fastPath"]["tc_fast_forwarded"].as_u64().is_some_and(|n| n > 0), "{json}");

    // A restart adopts the pinned programs (tcx links or clsact filters)
    // with the fast path on: the connection goes on, fast.
    w.stop_agent();
    echo(&mut s, &mut r, "between agents");
    w.start_agent("");
    w.wait_attached(2, true);
    w.wait_answers(&http, &[]);
    let fast = w.fast_counter("tc_fast_forwarded");
    echo(&mut s, &mut r, "after restart");
    assert!(w.fast_counter("tc_fast_forwarded") > fast, "the restarted programs did not take the fast path");

    // `off`: the stack forwards again, FORWARD counts, the flow goes on.
    w.stop_agent();
    w.start_agent_with("", &["--tc-fast-path", "off"]);
    w.wait_attached(3, false);
    w.wait_answers(&http, &[]);
    let (fwd, fast, reply) = (w.forward_packets(fam), w.fast_counter("tc_fast_forwarded"), w.fast_counter("tc_fast_reply_forwarded"));
    w.wait_answers(&http, &[]);
    w.wait_answers(&dns, &["--udp"]);
    for i in 0..5 {
        echo(&mut s, &mut r, &format!("stack {i}"));
    }
    assert!(w.forward_packets(fam) > fwd, "with --tc-fast-path off the FORWARD chain saw nothing");
    assert_eq!(w.fast_counter("tc_fast_forwarded"), fast, "--tc-fast-path off still sent packets the fast way");
    assert_eq!(w.fast_counter("tc_fast_reply_forwarded"), reply, "--tc-fast-path off still sent replies the fast way");
    w.stop_agent();
}

#[test]
fn tc_fast_path_all_delivers_to_a_local_pod_with_redirect_peer_and_auto_or_off_restore_the_stack() {
    tc_fast_path_delivers_locally(V4);
}

#[test]
fn tc_fast_path_all_delivers_to_a_local_pod_over_ipv6_with_redirect_peer_and_auto_or_off_restore_the_stack() {
    tc_fast_path_delivers_locally(V6);
}

/// One family, TCP and UDP to a pod on this node behind its veth, XDP off:
/// with the fast path the client's packets go into the pod's namespace
/// with `all`, with `bpf_redirect_peer` (`tc_fast_local_forwarded`), and
/// the FORWARD chain never sees them; with `auto` (remote backends only,
/// the default) and with `off` it does again.
fn tc_fast_path_delivers_locally(fam: Family) {
    let mut w = World::with_local();
    w.forward_to_local_rule(fam);
    w.start_agent_with("", &["--tc-fast-path", "all"]);
    w.wait_attached(1, true);
    let (http, dns) = (at(fam.node, 30081), at(fam.node, 30054));
    // The first flows resolve the pod's neighbour through the stack.
    w.wait_answers_from(&http, &[], "pod-l");
    w.wait_answers_from(&dns, &["--udp"], "pod-l");
    let (fwd, fast) = (w.forward_packets(fam), w.fast_counter("tc_fast_local_forwarded"));
    w.wait_answers_from(&http, &[], "pod-l");
    w.wait_answers_from(&dns, &["--udp"], "pod-l");
    assert_eq!(w.forward_packets(fam), fwd, "the stack forwarded packets to the local pod the fast path should have delivered");
    assert!(w.fast_counter("tc_fast_local_forwarded") > fast, "nothing went the fast way into the local pod");
    assert_eq!(w.counter("rewrite_failed"), 0);
    let (text, json) = w.dump();
    assert!(json["nodeport"]["fastPath"]["tc_fast_local_forwarded"].as_u64().is_some_and(|n| n > 0), "{json}");
    // The agent listed the pod's veth (and the node's other veths, whose
    // peers are in the client's and the backend's namespaces), not the
    // bridge.
    let index = |dev: &'static str| in_netns(&w.node, move || proxy_agent::external::node_addresses::ifindex(dev)).expect("netns");
    let peers: Vec<u64> =
        json["nodeport"]["peerDevices"].as_array().map(|a| a.iter().filter_map(serde_json::Value::as_u64).collect()).unwrap_or_default();
    assert!(peers.contains(&u64::from(index("n-l"))), "n-l is not in NP_PEER_DEVS: {peers:?}");
    assert!(!peers.contains(&u64::from(index("br-l"))), "the bridge is in NP_PEER_DEVS: {peers:?}");
    assert!(text.contains("tc fast path peer devices (ifindex): "), "{text}");

    // `auto`: the fast path stays on (for remote backends), but no device
    // is listed, so the local pod's packets go through the stack.
    w.stop_agent();
    w.start_agent_with("", &["--tc-fast-path", "auto"]);
    w.wait_attached(2, true);
    w.wait_answers_from(&http, &[], "pod-l");
    let (fwd, fast, not_peer) =
        (w.forward_packets(fam), w.fast_counter("tc_fast_local_forwarded"), w.fast_counter("tc_stack_local_not_peer"));
    w.wait_answers_from(&http, &[], "pod-l");
    w.wait_answers_from(&dns, &["--udp"], "pod-l");
    assert!(w.forward_packets(fam) > fwd, "with --tc-fast-path auto the FORWARD chain saw nothing for the local pod");
    assert_eq!(w.fast_counter("tc_fast_local_forwarded"), fast, "--tc-fast-path auto delivered into the local pod the fast way");
    assert!(w.fast_counter("tc_stack_local_not_peer") > not_peer, "the local pod's packets were not counted as left to the stack");
    let (_, json) = w.dump();
    assert_eq!(json["nodeport"]["peerDevices"].as_array().map(Vec::len), Some(0), "auto left devices listed: {json}");

    // `off`: the stack forwards to the pod again.
    w.stop_agent();
    w.start_agent_with("", &["--tc-fast-path", "off"]);
    w.wait_attached(3, false);
    w.wait_answers_from(&http, &[], "pod-l");
    let (fwd, fast) = (w.forward_packets(fam), w.fast_counter("tc_fast_local_forwarded"));
    w.wait_answers_from(&http, &[], "pod-l");
    w.wait_answers_from(&dns, &["--udp"], "pod-l");
    assert!(w.forward_packets(fam) > fwd, "with --tc-fast-path off the FORWARD chain saw nothing for the local pod");
    assert_eq!(w.fast_counter("tc_fast_local_forwarded"), fast, "--tc-fast-path off still delivered into the pod the fast way");
    w.stop_agent();
}

/// Local backends the fast path must not hand to `bpf_redirect_peer`: a
/// host-network endpoint (the node's own address: the lookup says "not
/// forwarded", `tc_stack_local_backend`) and a pod behind a bridge (the
/// route's device is no veth, `tc_stack_local_not_peer`). Both are
/// answered through the stack.
#[test]
fn tc_fast_path_leaves_host_network_and_bridged_local_backends_to_the_stack() {
    let mut w = World::with_local();
    // `all`, the mode that delivers to local pods: not to these.
    w.start_agent_with("", &["--tc-fast-path", "all"]);
    w.wait_attached(1, true);
    let (hostnet, bridged) = (at(V4.node, 30082), at(V4.node, 30083));
    w.wait_answers_from(&hostnet, &[], "host-a");
    w.wait_answers_from(&bridged, &[], "pod-q");
    let peer = w.fast_counter("tc_fast_local_forwarded");
    let host = w.fast_counter("tc_stack_local_backend");
    w.wait_answers_from(&hostnet, &[], "host-a");
    assert!(w.fast_counter("tc_stack_local_backend") > host, "the host-network endpoint's packets were not counted as left to the stack");
    eventually("the bridged pod's packets to be counted as left to the stack", || {
        let before = w.fast_counter("tc_stack_local_not_peer");
        w.wait_answers_from(&bridged, &[], "pod-q");
        let after = w.fast_counter("tc_stack_local_not_peer");
        if after > before { Ok(()) } else { Err(format!("{before}->{after}")) }
    });
    assert_eq!(w.fast_counter("tc_fast_local_forwarded"), peer, "a local backend not behind a pod's veth went the redirect_peer way");
    assert_eq!(w.counter("rewrite_failed"), 0);
    w.stop_agent();
}

/// An agent upgraded over pins of a build with fewer fast-path reasons
/// (8, before the local ones): its `NP_FAST_COUNTERS` is recreated at this
/// build's size (`map_migration::plan`), so the local reasons count
/// without a `proxy-agent reset`.
#[test]
fn an_older_builds_fast_path_counter_array_is_migrated_and_local_deliveries_count() {
    let mut w = World::with_local();
    w.start_agent_with("", &["--tc-fast-path", "all"]);
    w.wait_attached(1, true);
    let http = at(V4.node, 30081);
    w.wait_answers_from(&http, &[], "pod-l");
    w.stop_agent();
    // The pin gets the old size, as `bpftool` (no BTF) makes it; the
    // running programs keep their own array.
    let path = w.pins.path().join(proxy_common::NP_FAST_COUNTERS_MAP);
    std::fs::remove_file(&path).expect("remove NP_FAST_COUNTERS");
    let out = std::process::Command::new("bpftool")
        .args(["map", "create"])
        .arg(&path)
        .args(["type", "percpu_array", "key", "4", "value", "8", "entries", "8", "name", "NP_FAST_COUNTERS"])
        .output()
        .expect("run bpftool");
    assert!(out.status.success(), "bpftool map create: {}", String::from_utf8_lossy(&out.stderr));
    w.start_agent_with("", &["--tc-fast-path", "all"]);
    w.wait_attached(2, true);
    let log = std::fs::read_to_string(&w.log).unwrap_or_default();
    let resized = format!("map NP_FAST_COUNTERS resized from 8 to {}", proxy_common::np_fast_counter::COUNT);
    assert!(log.contains(&resized), "{log}");
    eventually("a local delivery to be counted in the migrated array", || {
        w.wait_answers_from(&http, &[], "pod-l");
        let n = w.fast_counter("tc_fast_local_forwarded");
        if n > 0 { Ok(()) } else { Err(n) }
    });
    w.stop_agent();
}

#[test]
fn tc_fast_path_follows_a_neighbour_change_and_leaves_ip_options_and_packets_over_the_mtu_to_the_stack() {
    let mut w = World::new();
    w.backend.ip(&["link", "set", "eth0", "address", BACKEND_ETH0_MAC]).expect("backend MAC");
    w.forward_counter_rule();
    w.start_agent("");
    let dns = at(V4.node, 30053);
    w.wait_answers(&dns, &["--udp"]);
    let to: SocketAddr = dns.parse().expect("addr");
    let sock = in_netns(&w.client, move || -> std::io::Result<std::net::UdpSocket> {
        let s = std::net::UdpSocket::bind("10.0.1.1:0")?;
        s.connect(to)?;
        s.set_read_timeout(Some(Duration::from_millis(300)))?;
        Ok(s)
    })
    .expect("netns")
    .expect("client socket");
    let ask = |len: usize| -> Result<String, String> {
        sock.send(&vec![b'x'; len]).map_err(|e| format!("send: {e}"))?;
        let mut buf = [0u8; 2048];
        let n = sock.recv(&mut buf).map_err(|e| format!("recv: {e}"))?;
        Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
    };
    let fast_answer = |w: &World| -> Result<(), String> {
        let (before, fwd) = (w.fast_counter("tc_fast_forwarded"), w.forward_packets(V4));
        let answer = ask(32)?;
        let (after, fwd_after) = (w.fast_counter("tc_fast_forwarded"), w.forward_packets(V4));
        if answer.contains("pod-b") && after > before && fwd_after == fwd {
            Ok(())
        } else {
            Err(format!("{answer:?} {before}->{after} forward {fwd}->{fwd_after}"))
        }
    };
    eventually("the flow to be answered through the fast path", || fast_answer(&w));
    // The neighbour changes under the flow: the cached next hop follows
    // once older than XDP_NEXTHOP_TTL_S (datagrams then go to a MAC nobody
    // has, and get no answer), and back again.
    w.node.ip(&["neigh", "replace", "10.0.3.2", "lladdr", NOBODY_MAC, "dev", "n-b", "nud", "permanent"]).expect("neigh");
    eventually("the flow's next hop to follow the changed neighbour", || match ask(32) {
        Err(_) => Ok(()),
        Ok(a) => Err(a),
    });
    w.node.ip(&["neigh", "replace", "10.0.3.2", "lladdr", BACKEND_ETH0_MAC, "dev", "n-b", "nud", "permanent"]).expect("neigh");
    eventually("the same flow to be answered through the fast path again", || fast_answer(&w));

    // IPv4 options go to the stack, which processes them as a router must
    // (here record route, `ip_forward_options`): counted
    // `tc_stack_ip_options`, and answered.
    let with_options = in_netns(&w.client, move || -> std::io::Result<std::net::UdpSocket> {
        let s = std::net::UdpSocket::bind("10.0.1.1:0")?;
        // Record route (type 7, RFC 791): length 11, pointer 4, two empty
        // slots, then an end-of-options byte to fill the 12-byte header
        // extension.
        let opt: [u8; 12] = [7, 11, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        // SAFETY: `opt` is live for the call and its length is passed.
        let rc = unsafe { libc::setsockopt(s.as_raw_fd(), libc::IPPROTO_IP, libc::IP_OPTIONS, opt.as_ptr().cast(), opt.len() as u32) };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
        s.connect(to)?;
        s.set_read_timeout(Some(Duration::from_millis(300)))?;
        Ok(s)
    })
    .expect("netns")
    .expect("client socket with IP options");
    eventually("a datagram with IPv4 options to go through the stack and be answered", || {
        let before = w.fast_counter("tc_stack_ip_options");
        with_options.send(b"options").map_err(|e| format!("send: {e}"))?;
        let mut buf = [0u8; 2048];
        let n = with_options.recv(&mut buf).map_err(|e| format!("recv: {e}"))?;
        let answer = String::from_utf8_lossy(&buf[..n]).into_owned();
        let after = w.fast_counter("tc_stack_ip_options");
        if answer.contains("pod-b") && after > before { Ok(()) } else { Err(format!("{answer:?} {before}->{after}")) }
    });

    // A packet longer than the route's MTU goes to the stack: counted
    // `tc_stack_mtu`; the stack answers the DF datagram with fragmentation
    // needed (`ip_forward` checks the MTU before the FORWARD hook), which
    // the TC programs translate back to the client, whose socket reports
    // EMSGSIZE. Short ones stay on the fast path.
    w.node.ip(&["link", "set", "n-b", "mtu", "1000"]).expect("mtu");
    eventually("short datagrams to go the fast way at the lower MTU", || fast_answer(&w));
    let (mtu, fast, icmp) = (w.fast_counter("tc_stack_mtu"), w.fast_counter("tc_fast_forwarded"), w.counter("icmp_translated"));
    let long = ask(1200);
    assert!(w.fast_counter("tc_stack_mtu") > mtu, "a datagram longer than the MTU was not left to the stack");
    assert_eq!(w.fast_counter("tc_fast_forwarded"), fast, "the fast path sent a datagram longer than the route's MTU");
    assert!(w.counter("icmp_translated") > icmp, "the stack's fragmentation needed did not reach the client");
    assert!(long.as_ref().is_err_and(|e| e.contains("os error 90")), "no EMSGSIZE for the long datagram: {long:?}");
    w.stop_agent();
}

/// The backend's MAC in `next_hop_follows_the_neighbour_and_longer_packets_are_checked_again`.
const BACKEND_ETH0_MAC: &str = "02:00:00:00:03:02";
/// A MAC no device has.
const NOBODY_MAC: &str = "02:00:00:00:00:99";

#[test]
fn a_flows_cached_next_hop_follows_a_neighbour_change_and_longer_packets_are_checked_again() {
    let mut w = World::new();
    // A known MAC, set before anyone resolves it.
    w.backend.ip(&["link", "set", "eth0", "address", BACKEND_ETH0_MAC]).expect("backend MAC");
    w.start_agent("native");
    eventually("the XDP link to be pinned", || if w.xdp_devices().len() == 2 { Ok(()) } else { Err(w.xdp_devices()) });
    let dns = at(V4.node, 30053);
    w.wait_answers(&dns, &["--udp"]);
    // One flow: a connected UDP socket of the client (it stays in the
    // client's namespace after the thread that made it returns).
    let to: SocketAddr = dns.parse().expect("addr");
    let sock = in_netns(&w.client, move || -> std::io::Result<std::net::UdpSocket> {
        let s = std::net::UdpSocket::bind("10.0.1.1:0")?;
        s.connect(to)?;
        s.set_read_timeout(Some(Duration::from_millis(300)))?;
        Ok(s)
    })
    .expect("netns")
    .expect("client socket");
    let ask = |len: usize| -> Result<String, String> {
        sock.send(&vec![b'x'; len]).map_err(|e| format!("send: {e}"))?;
        let mut buf = [0u8; 2048];
        let n = sock.recv(&mut buf).map_err(|e| format!("recv: {e}"))?;
        Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
    };
    // The next hops the XDP program cached for flows to the backend's DNS
    // port: this socket's flow and the probes' before it, each under the
    // SNAT port the node gave it.
    let cached = |w: &World| -> Vec<serde_json::Value> {
        let (_, json) = w.dump();
        let all = json["nodeport"]["xdpNextHops"].as_array().cloned().unwrap_or_default();
        all.into_iter().filter(|h| h["flow"].as_str().is_some_and(|f| f.starts_with("UDP ") && f.ends_with("-> 10.0.3.2:5353"))).collect()
    };
    let with_mac = |hops: &[serde_json::Value], mac: &str| hops.iter().any(|h| h["dmac"] == mac);
    eventually("the flow to be answered through XDP with its next hop cached", || {
        let before = w.counter("xdp_forwarded");
        let answer = ask(32)?;
        let hops = cached(&w);
        if answer.contains("pod-b") && w.counter("xdp_forwarded") > before && with_mac(&hops, BACKEND_ETH0_MAC) {
            Ok(())
        } else {
            Err(format!("answer {answer:?}, next hops {hops:?}"))
        }
    });
    let (text, _) = w.dump();
    assert!(text.contains("xdp next hops cached: "), "{text}");

    // The neighbour changes under the flow: the flow's cached next hop
    // follows once it is older than XDP_NEXTHOP_TTL_S (meanwhile packets
    // go to the old MAC; after it, to a MAC nobody has, and get no answer).
    // Only this socket sends, so its flow is the one whose next hop moves.
    w.node.ip(&["neigh", "replace", "10.0.3.2", "lladdr", NOBODY_MAC, "dev", "n-b", "nud", "permanent"]).expect("neigh");
    let mine: String = eventually("the cached next hop to follow the changed neighbour", || {
        let _ = ask(32);
        let hops = cached(&w);
        hops.iter().find(|h| h["dmac"] == NOBODY_MAC).and_then(|h| h["flow"].as_str().map(str::to_string)).ok_or(hops)
    });
    assert!(ask(32).is_err(), "the backend answered frames sent to another MAC");
    // And back: the same flow is answered again, through XDP.
    w.node.ip(&["neigh", "replace", "10.0.3.2", "lladdr", BACKEND_ETH0_MAC, "dev", "n-b", "nud", "permanent"]).expect("neigh");
    eventually("the same flow to be answered again through XDP", || {
        let before = w.counter("xdp_forwarded");
        let answer = ask(32)?;
        let hops = cached(&w);
        let back = hops.iter().any(|h| h["flow"] == mine.as_str() && h["dmac"] == BACKEND_ETH0_MAC);
        if answer.contains("pod-b") && w.counter("xdp_forwarded") > before && back { Ok(()) } else { Err(format!("{answer:?} {hops:?}")) }
    });

    // A longer packet than the cache checked is checked against the
    // route's MTU again: with n-b's MTU at 1000, `bpf_fib_lookup` answers
    // "fragmentation needed" for a 1200-byte datagram, which XDP leaves to
    // the stack (counted `xdp_pass_no_route`) while short ones go on.
    w.node.ip(&["link", "set", "n-b", "mtu", "1000"]).expect("mtu");
    eventually("short datagrams to go through XDP at the lower MTU", || {
        let before = w.counter("xdp_forwarded");
        let answer = ask(32)?;
        if answer.contains("pod-b") && w.counter("xdp_forwarded") > before { Ok(()) } else { Err(answer) }
    });
    let (no_route, forwarded) = (w.counter("xdp_pass_no_route"), w.counter("xdp_forwarded"));
    let _ = ask(1200);
    assert!(w.counter("xdp_pass_no_route") > no_route, "a datagram longer than the MTU was not checked again");
    assert_eq!(w.counter("xdp_forwarded"), forwarded, "XDP forwarded a datagram longer than the route's MTU");
    w.stop_agent();
}

#[test]
fn auto_attaches_native_xdp_on_veth_and_the_default_is_off() {
    let mut w = World::new();
    // veth takes native XDP, so `auto` attaches it.
    w.start_agent("auto");
    eventually("auto to attach XDP on n-c and n-b", || {
        let d = w.xdp_devices();
        if d == ["n-b", "n-c"] && w.kernel_has_xdp("n-c") { Ok(()) } else { Err(d) }
    });
    w.wait_answers(&at(V4.node, 30080), &[]);
    w.stop_agent();
    // Without the flag: off, and what an earlier run attached is detached.
    w.start_agent("");
    eventually("the default to detach XDP", || {
        if w.xdp_devices().is_empty() && !w.kernel_has_xdp("n-c") { Ok(()) } else { Err(w.xdp_devices()) }
    });
    let forwarded = w.counter("xdp_forwarded");
    w.wait_answers(&at(V4.node, 30080), &[]);
    assert_eq!(w.counter("xdp_forwarded"), forwarded, "no XDP by default");
    w.stop_agent();
}

// ---------------------------------------------------------------------------
// Raw frames through BPF_PROG_TEST_RUN
// ---------------------------------------------------------------------------

const CLIENT_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 2];
const NODE_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 1];
const IPPROTO_TCP: u8 = 6;
const IPPROTO_UDP: u8 = 17;
const IPPROTO_ICMP: u8 = 1;
const IPPROTO_ICMPV6: u8 = 58;
/// IPv6 extension headers (RFC 8200 4).
const IPPROTO_HOPOPTS: u8 = 0;
const IPPROTO_FRAGMENT: u8 = 44;

/// A frame to build: Ethernet, IPv4 (no options, header checksum filled
/// in) or IPv6 (the fixed header, then `ext`), then `l4` with its checksum
/// at `csum_at` computed over the pseudo header (RFC 793/768, RFC 8200
/// 8.1), unless `None`.
#[derive(Clone)]
struct Frame {
    src: IpAddr,
    dst: IpAddr,
    proto: u8,
    /// TTL or hop limit.
    ttl: u8,
    /// IPv4's flags and fragment offset word.
    frag: u16,
    /// IPv6 extension headers in order: (type, bytes), the next-header
    /// byte of each filled in by `build`.
    ext: Vec<(u8, Vec<u8>)>,
    l4: Vec<u8>,
    csum_at: Option<usize>,
}

impl Frame {
    fn new(src: &str, dst: &str, proto: u8, l4: Vec<u8>, csum_at: Option<usize>) -> Frame {
        Frame { src: src.parse().expect("src"), dst: dst.parse().expect("dst"), proto, ttl: 64, frag: 0, ext: Vec::new(), l4, csum_at }
    }

    /// A TCP segment (`flags`) with a payload.
    fn tcp(src: &str, dst: &str, sport: u16, dport: u16, flags: u8) -> Frame {
        let mut t = Vec::new();
        t.extend_from_slice(&sport.to_be_bytes());
        t.extend_from_slice(&dport.to_be_bytes());
        t.extend_from_slice(&[0, 0, 0, 1, 0, 0, 0, 0, 0x50, flags, 0xff, 0xff, 0, 0, 0, 0]);
        t.extend_from_slice(b"payload!");
        Frame::new(src, dst, IPPROTO_TCP, t, Some(16))
    }

    fn syn(src: &str, dst: &str, sport: u16, dport: u16) -> Frame {
        Frame::tcp(src, dst, sport, dport, 0x02)
    }

    /// A UDP datagram carrying `payload`.
    fn udp(src: &str, dst: &str, sport: u16, dport: u16, payload: &[u8]) -> Frame {
        let mut u = Vec::new();
        u.extend_from_slice(&sport.to_be_bytes());
        u.extend_from_slice(&dport.to_be_bytes());
        u.extend_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
        u.extend_from_slice(&[0, 0]);
        u.extend_from_slice(payload);
        Frame::new(src, dst, IPPROTO_UDP, u, Some(6))
    }

    /// An ICMP (IPv4) or ICMPv6 echo request.
    fn echo_request(src: &str, dst: &str) -> Frame {
        let v6 = dst.contains(':');
        let (ty, proto) = if v6 { (128, IPPROTO_ICMPV6) } else { (8, IPPROTO_ICMP) };
        let mut f = Frame::new(src, dst, proto, vec![ty, 0, 0, 0, 0, 1, 0, 1], Some(2));
        if !v6 {
            // ICMP's checksum has no pseudo header: filled in here.
            let c = csum(&f.l4, 0);
            f.l4[2..4].copy_from_slice(&c.to_be_bytes());
            f.csum_at = None;
        }
        f
    }

    fn build(&self) -> Vec<u8> {
        let mut l4 = self.l4.clone();
        if let Some(at) = self.csum_at {
            l4[at..at + 2].copy_from_slice(&[0, 0]);
            let mut c = csum(&l4, pseudo(self.src, self.dst, self.proto, l4.len()));
            if c == 0 && self.proto == IPPROTO_UDP {
                // RFC 768, RFC 8200 8.1: a computed zero is sent as ones.
                c = 0xffff;
            }
            l4[at..at + 2].copy_from_slice(&c.to_be_bytes());
        }
        let mut f = Vec::new();
        f.extend_from_slice(&NODE_MAC);
        f.extend_from_slice(&CLIENT_MAC);
        match (self.src, self.dst) {
            (IpAddr::V4(s), IpAddr::V4(d)) => {
                f.extend_from_slice(&[0x08, 0x00]);
                let mut ip = vec![0x45, 0];
                ip.extend_from_slice(&((20 + l4.len()) as u16).to_be_bytes());
                ip.extend_from_slice(&[0, 1]);
                ip.extend_from_slice(&self.frag.to_be_bytes());
                ip.extend_from_slice(&[self.ttl, self.proto, 0, 0]);
                ip.extend_from_slice(&s.octets());
                ip.extend_from_slice(&d.octets());
                let c = csum(&ip, 0);
                ip[10..12].copy_from_slice(&c.to_be_bytes());
                f.extend_from_slice(&ip);
            }
            (IpAddr::V6(s), IpAddr::V6(d)) => {
                let mut chain = Vec::new();
                for (i, (_, h)) in self.ext.iter().enumerate() {
                    let mut h = h.clone();
                    h[0] = self.ext.get(i + 1).map_or(self.proto, |(ty, _)| *ty);
                    chain.extend_from_slice(&h);
                }
                // Traffic class 0x28 and a flow label, which XDP hands to
                // the route lookup and must leave as they are.
                f.extend_from_slice(&[0x86, 0xdd, 0x62, 0x81, 0x23, 0x45]);
                f.extend_from_slice(&((chain.len() + l4.len()) as u16).to_be_bytes());
                f.extend_from_slice(&[self.ext.first().map_or(self.proto, |(ty, _)| *ty), self.ttl]);
                f.extend_from_slice(&s.octets());
                f.extend_from_slice(&d.octets());
                f.extend_from_slice(&chain);
            }
            _ => panic!("mixed families"),
        }
        f.extend_from_slice(&l4);
        f
    }
}

/// The one's-complement sum of the TCP/UDP pseudo header. IPv4's (source,
/// destination, zero and protocol, length) and IPv6's (source,
/// destination, 32-bit length, three zero bytes and next header) sum to the
/// same 16-bit words but for the address widths.
fn pseudo(src: IpAddr, dst: IpAddr, proto: u8, len: usize) -> u32 {
    let octets = |a: IpAddr| match a {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    };
    let mut p = octets(src);
    p.extend(octets(dst));
    p.extend_from_slice(&[0, proto]);
    p.extend_from_slice(&(len as u16).to_be_bytes());
    p.chunks(2).map(|c| u32::from(u16::from_be_bytes([c[0], c[1]]))).sum()
}

/// What a test needs to know of a frame: its addresses, TTL or hop limit,
/// upper-layer protocol and where that header starts (IPv6 extension
/// headers skipped).
#[derive(Debug)]
struct Headers {
    src: IpAddr,
    dst: IpAddr,
    ttl: u8,
    proto: u8,
    l4: usize,
}

fn headers(f: &[u8]) -> Headers {
    if f[12..14] == [0x08, 0x00] {
        let ip4 = |o: usize| IpAddr::from(<[u8; 4]>::try_from(&f[o..o + 4]).expect("4 bytes"));
        return Headers { src: ip4(26), dst: ip4(30), ttl: f[22], proto: f[23], l4: 14 + usize::from(f[14] & 0xf) * 4 };
    }
    assert_eq!(f[12..14], [0x86, 0xdd], "neither IPv4 nor IPv6");
    let ip6 = |o: usize| IpAddr::from(<[u8; 16]>::try_from(&f[o..o + 16]).expect("16 bytes"));
    let (mut next, mut off) = (f[20], 54);
    while matches!(next, 0 | 43 | 44 | 60) {
        let len = if next == IPPROTO_FRAGMENT { 8 } else { (usize::from(f[off + 1]) + 1) * 8 };
        next = f[off];
        off += len;
    }
    Headers { src: ip6(22), dst: ip6(38), ttl: f[21], proto: next, l4: off }
}

fn ports(f: &[u8]) -> (u16, u16) {
    let l4 = headers(f).l4;
    (u16::from_be_bytes([f[l4], f[l4 + 1]]), u16::from_be_bytes([f[l4 + 2], f[l4 + 3]]))
}

/// The TCP/UDP header and payload without the ports and the checksum,
/// which translation changes.
fn l4_rest(f: &[u8]) -> Vec<u8> {
    let h = headers(f);
    let mut l4 = f[h.l4..].to_vec();
    let at = if h.proto == IPPROTO_TCP { 16 } else { 6 };
    l4[..4].fill(0);
    l4[at..at + 2].fill(0);
    l4
}

/// Whether the IPv4 header checksum (IPv6 has none) and the TCP/UDP
/// checksum verify; a UDP checksum of zero ("none") does not.
fn checksums_ok(f: &[u8]) -> bool {
    let h = headers(f);
    let ip_ok = f[12..14] != [0x08, 0x00] || csum(&f[14..h.l4], 0) == 0;
    let at = h.l4 + if h.proto == IPPROTO_TCP { 16 } else { 6 };
    ip_ok && f[at..at + 2] != [0, 0] && csum(&f[h.l4..], pseudo(h.src, h.dst, h.proto, f.len() - h.l4)) == 0
}

const XDP_PASS: i32 = 2;
const XDP_REDIRECT: i32 = 4;
const TC_PASS: i32 = -1; // TC_ACT_UNSPEC

/// The XDP and TC programs loaded (not attached) over fresh pins, with
/// NodePorts on the node's address of each family: 30080/TCP and
/// 30053/UDP to a remote backend (DNAT + SNAT), 30081/TCP to a local one.
struct Loaded {
    _tc: aya::Ebpf,
    _xdp: aya::Ebpf,
    xdp: i32,
    ingress: i32,
    egress: i32,
    pins: PinDir,
}

/// The SNAT addresses `Loaded` configures.
const SNAT4: &str = "10.0.3.1";
const SNAT6: &str = "fd00:3::1";

impl Loaded {
    /// `remote` is the remote backend's address of each family, v4 first.
    fn new(prefix: &str, remote: [&str; 2]) -> Loaded {
        use std::os::fd::{AsFd, AsRawFd};

        use proxy_agent::datapath::{tc_loader, xdp_loader};
        use proxy_agent::decide::decision::ExternalState;
        use proxy_agent::model::{Backend, Frontend, Protocol};

        require_root();
        let pins = PinDir::new(prefix).expect("pins");
        let mut tc = tc_loader::load_unattached(pins.path()).expect("load the TC programs");
        let mut xdp = xdp_loader::load_unattached(pins.path()).expect("load the XDP program");
        let xdp_fd = {
            let p: &mut aya::programs::Xdp = xdp.program_mut(&xdp_loader::loaded_name()).expect("xdp").try_into().expect("xdp program");
            p.fd().expect("fd").as_fd().as_raw_fd()
        };
        let mut tc_fd = |name: &str| {
            let p: &mut aya::programs::SchedClassifier = tc.program_mut(name).expect(name).try_into().expect("classifier");
            p.fd().expect("fd").as_fd().as_raw_fd()
        };
        let (ingress, egress) =
            (tc_fd(&tc_loader::loaded_name(tc_loader::INGRESS_PROGRAM)), tc_fd(&tc_loader::loaded_name(tc_loader::EGRESS_PROGRAM)));
        let mut writer = proxy_agent::external::nodeport::NodePortWriter::open(pins.path()).expect("open the TC maps");
        writer.set_config(Some(SNAT4.parse().expect("v4")), Some(SNAT6.parse().expect("v6")), (61000, 65535)).expect("config");
        let ip = |s: &str| -> IpAddr { s.parse().expect("address") };
        let mut tc_frontends = std::collections::BTreeMap::new();
        let mut local_endpoints = std::collections::BTreeSet::new();
        for (fam, remote, local) in [(V4, remote[0], "10.244.1.10"), (V6, remote[1], "fd00:244:1::10")] {
            let remote = Backend { ip: ip(remote), port: 8080 };
            let remote_udp = Backend { ip: remote.ip, port: 5353 };
            let local = Backend { ip: ip(local), port: 8080 };
            let node = ip(fam.node);
            tc_frontends.insert(Frontend { ip: node, port: 30080, protocol: Protocol::Tcp }, [remote].into_iter().collect());
            tc_frontends.insert(Frontend { ip: node, port: 30053, protocol: Protocol::Udp }, [remote_udp].into_iter().collect());
            tc_frontends.insert(Frontend { ip: node, port: 30081, protocol: Protocol::Tcp }, [local].into_iter().collect());
            local_endpoints.insert(local.ip);
        }
        let ext = ExternalState { tc: tc_frontends, local_endpoints, ..Default::default() };
        let o = writer.sync(&ext);
        assert!(o.failures.is_empty(), "{:?}", o.failures);
        Loaded { _tc: tc, _xdp: xdp, xdp: xdp_fd, ingress, egress, pins }
    }

    fn counters(&self) -> std::collections::BTreeMap<&'static str, u64> {
        proxy_agent::datapath::dump::np_counters(self.pins.path()).expect("counters")
    }
}

/// Runs the program once on `frame`: (return value, frame after the run).
fn run(fd: i32, frame: &[u8]) -> (i32, Vec<u8>) {
    let mut out = vec![0u8; frame.len() + 128];
    let r = proxy_test_support::prog_test_run::run(fd, frame, &mut out, 1).expect("BPF_PROG_TEST_RUN");
    out.truncate(r.out_len);
    (r.retval, out)
}

/// What TC ingress must do with a frame XDP passed.
#[derive(Clone, Copy, Debug)]
enum AtTc {
    /// Pass it untouched (not ours, or a fragment TC counts).
    Untouched,
    /// Translate it: DNAT to the remote backend (the new flow is TC's).
    Dnat,
}

#[test]
fn xdp_passes_what_it_does_not_forward_unchanged_and_tc_continues_from_its_conntrack() {
    let node = V4.node;
    passes_to_tc(
        V4,
        "10.244.2.10",
        vec![
            ("ICMP echo request", Frame::echo_request("10.0.1.1", node), AtTc::Untouched),
            ("first fragment", Frame { frag: 0x2000, ..Frame::syn("10.0.1.1", node, 40001, 30080) }, AtTc::Untouched),
        ],
    );
}

#[test]
fn xdp_passes_ipv6_with_extension_headers_and_icmpv6_unchanged_and_tc_handles_them_as_without_xdp() {
    let node = V6.node;
    let hop_by_hop = (IPPROTO_HOPOPTS, vec![0, 0, 1, 4, 0, 0, 0, 0]);
    // Offset 0 with the M flag: the first fragment of a datagram.
    let fragment = (IPPROTO_FRAGMENT, vec![0, 0, 0, 1, 0, 0, 0, 7]);
    passes_to_tc(
        V6,
        "fd00:244:2::10",
        vec![
            ("ICMPv6 echo request", Frame::echo_request("fd00:1::1", node), AtTc::Untouched),
            ("hop-by-hop options", Frame { ext: vec![hop_by_hop], ..Frame::syn("fd00:1::1", node, 40001, 30080) }, AtTc::Dnat),
            ("first fragment", Frame { ext: vec![fragment], ..Frame::syn("fd00:1::1", node, 40002, 30080) }, AtTc::Untouched),
        ],
    );
}

/// Frames of `fam` that XDP must pass unchanged without setting anything
/// up (`cases`: name, frame, what TC ingress then does with it), a SYN to
/// a local backend (XDP sets the flow up and passes it) and one to the
/// remote backend `remote` without a route (likewise): TC carries on from
/// the entries XDP wrote.
fn passes_to_tc(fam: Family, remote: &str, cases: Vec<(&'static str, Frame, AtTc)>) {
    let client = if fam.node.contains(':') { "fd00:1::1" } else { "10.0.1.1" };
    let l = Loaded::new("txdpr", if fam.node.contains(':') { ["10.244.2.10", remote] } else { [remote, "fd00:244:2::10"] });
    let (xdp, ingress, egress) = (l.xdp, l.ingress, l.egress);
    let frames: Vec<Vec<u8>> = cases.iter().map(|(_, f, _)| f.build()).collect();
    let local_frame = Frame::syn(client, fam.node, 40100, 30081).build();
    let remote_frame = Frame::syn(client, fam.node, 40101, 30080).build();
    // In a namespace of our own: an XDP test run looks routes up in the
    // caller's namespace (`bpf_fib_lookup` on the loopback device's), and
    // this one has none, so no packet can be forwarded anywhere.
    let scratch = Netns::new("txdpr").expect("netns");
    let (xdp_runs, counters_after_xdp, tc_runs, local, remote_runs) = {
        let frames = frames.clone();
        let (local_frame, remote_frame) = (local_frame.clone(), remote_frame.clone());
        let pins = l.pins.path().to_path_buf();
        in_netns(&scratch, move || {
            let xdp_runs: Vec<_> = frames.iter().map(|f| run(xdp, f)).collect();
            let counters = proxy_agent::datapath::dump::np_counters(&pins).expect("counters");
            let tc_runs: Vec<_> = frames.iter().map(|f| run(ingress, f)).collect();
            let local = (run(xdp, &local_frame), run(ingress, &local_frame));
            let remote = {
                let x = run(xdp, &remote_frame);
                let (rc, out) = run(ingress, &remote_frame);
                (x, rc, run(egress, &out))
            };
            (xdp_runs, counters, tc_runs, local, remote)
        })
        .expect("netns")
    };
    for (((name, _, at_tc), frame), (xdp_run, tc_run)) in cases.iter().zip(&frames).zip(xdp_runs.iter().zip(&tc_runs)) {
        assert_eq!(xdp_run, &(XDP_PASS, frame.clone()), "{name}: XDP passes it untouched");
        assert_eq!(tc_run.0, TC_PASS, "{name}");
        match at_tc {
            AtTc::Untouched => assert_eq!(&tc_run.1, frame, "{name}: TC passes it untouched too"),
            AtTc::Dnat => {
                let h = headers(&tc_run.1);
                assert_eq!(h.dst, remote.parse::<IpAddr>().expect("remote"), "{name}: TC DNATs it");
                assert_eq!(ports(&tc_run.1).1, 8080, "{name}");
                assert!(checksums_ok(&tc_run.1), "{name}: checksums after TC's DNAT");
            }
        }
    }
    // XDP neither set up nor counted any of them.
    let c = &counters_after_xdp;
    assert_eq!(
        (c["new_flow"], c["xdp_pass_to_tc"], c["xdp_pass_no_route"], c["xdp_forwarded"], c["pass_fragment"]),
        (0, 0, 0, 0, 0),
        "XDP leaves their counting to TC: {c:?}"
    );
    // A local backend: XDP sets the flow up (TC's own `new_flow`) and
    // passes the frame unchanged; TC ingress finds the entry and DNATs.
    let ((xdp_local, tc_local), local_ip) = (local, if fam.node.contains(':') { "fd00:244:1::10" } else { "10.244.1.10" });
    assert_eq!(xdp_local, (XDP_PASS, local_frame));
    assert_eq!(tc_local.0, TC_PASS);
    assert_eq!(headers(&tc_local.1).dst, local_ip.parse::<IpAddr>().expect("local"), "TC DNATs to the local backend");
    // A remote backend without a usable route: unchanged, and TC carries
    // the flow XDP set up (DNAT and the SNAT port XDP reserved).
    let (xdp_remote, tc_remote_rc, tc_remote) = remote_runs;
    assert_eq!(xdp_remote, (XDP_PASS, remote_frame));
    assert_eq!((tc_remote_rc, tc_remote.0), (TC_PASS, TC_PASS));
    let h = headers(&tc_remote.1);
    let snat = if fam.node.contains(':') { SNAT6 } else { SNAT4 };
    assert_eq!(h.src, snat.parse::<IpAddr>().expect("snat"), "SNAT to the node");
    assert_eq!(h.dst, remote.parse::<IpAddr>().expect("remote"), "DNAT to the remote backend");
    assert!(checksums_ok(&tc_remote.1), "checksums after TC's DNAT and SNAT");
    let translated = cases.iter().filter(|(_, _, t)| matches!(t, AtTc::Dnat)).count() as u64;
    let fragments = cases.iter().filter(|(name, _, _)| name.contains("fragment")).count() as u64;
    let c = l.counters();
    assert_eq!(c["new_flow"], 2 + translated, "each flow set up once, two by XDP: {c:?}");
    assert_eq!(c["xdp_pass_to_tc"], 1, "{c:?}");
    assert_eq!(c["xdp_pass_no_route"], 1, "{c:?}");
    assert_eq!(c["xdp_forwarded"], 0, "{c:?}");
    assert_eq!(c["pass_fragment"], fragments, "counted once, by TC: {c:?}");
}

/// The MAC address of the node's device towards the backends, and the
/// backend's (a permanent neighbour entry), in `forwarded_frames...`.
const OUT_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x0a];
const BACKEND_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x0b];

#[test]
fn forwarded_frames_are_fully_translated_with_valid_checksums_in_both_families() {
    // The backends are on-link behind x0, their neighbours resolved: the
    // route lookup of an XDP test run succeeds and the program rewrites the
    // frame and asks to redirect it to x0 (which a test run only reports,
    // net/bpf/test_run.c: the frame comes back rewritten).
    //
    // Every 32-bit word of the IPv6 source changes with the SNAT (client
    // fd00:1:a:b:c1:c2:c3:c4 -> fd00:3::1), and the destination's first
    // and last two (fd00:1::2 -> the backend): the pseudo header's sum
    // must follow each of them.
    let backends = ["10.0.3.2", "fd00:3::ab:cd:ef:12"];
    let l = Loaded::new("txdpf", backends);
    let scratch = Netns::new("txdpf").expect("netns");
    let peer = Netns::new("txdpf").expect("peer netns");
    scratch.veth("x0", &peer, "x1").expect("veth");
    scratch.ip(&["link", "set", "x0", "address", "02:00:00:00:00:0a"]).expect("x0 MAC");
    scratch.ip(&["addr", "add", "10.0.3.1/24", "dev", "x0"]).expect("v4 address");
    scratch.ip(&["addr", "add", "fd00:3::1/64", "dev", "x0", "nodad"]).expect("v6 address");
    for backend in backends {
        scratch
            .ip(&["neigh", "replace", backend, "lladdr", "02:00:00:00:00:0b", "dev", "x0", "nud", "permanent"])
            .unwrap_or_else(|e| panic!("neighbour {backend}: {e}"));
    }
    // The test run's frames arrive on loopback: forwarding on for every
    // device of the namespace, which the route lookup checks on the
    // receiving one.
    scratch.sysctl("net.ipv4.ip_forward", "1").expect("ip_forward");
    scratch.sysctl("net.ipv6.conf.all.forwarding", "1").expect("ipv6 forwarding");

    for (fam, client, backend) in [(V4, "10.0.1.1", backends[0]), (V6, "fd00:1:a:b:c1:c2:c3:c4", backends[1])] {
        let v6 = fam.node.contains(':');
        let snat: IpAddr = (if v6 { SNAT6 } else { SNAT4 }).parse().expect("snat");
        let backend: IpAddr = backend.parse().expect("backend");
        let syn = Frame::syn(client, fam.node, 41000, 30080);
        // Payloads of 12 bytes or more: XDP leaves datagrams with less
        // than 20 bytes of UDP to TC.
        let udp = Frame::udp(client, fam.node, 41001, 30053, b"ping ping ping!!");
        let no_csum = {
            let mut f = Frame::udp(client, fam.node, 41002, 30053, b"ping ping ping!!");
            f.csum_at = None;
            f
        };
        let xdp = l.xdp;
        let sent = [syn.build(), udp.build(), no_csum.build()];
        let outs = {
            let sent = sent.clone();
            in_netns(&scratch, move || sent.iter().map(|f| run(xdp, f)).collect::<Vec<_>>()).expect("netns")
        };
        for (name, (frame, (rc, out))) in ["TCP SYN", "UDP", "UDP without checksum"].iter().zip(sent.iter().zip(&outs)) {
            let name = format!("{name} over {}", if v6 { "IPv6" } else { "IPv4" });
            assert_eq!(*rc, XDP_REDIRECT, "{name}: forwarded to x0");
            assert_eq!(out.len(), frame.len(), "{name}");
            assert_eq!(out[0..6], BACKEND_MAC, "{name}: destination MAC, the backend's neighbour entry");
            assert_eq!(out[6..12], OUT_MAC, "{name}: source MAC, x0's");
            let (h, sent_h) = (headers(out), headers(frame));
            assert_eq!((h.src, h.dst), (snat, backend), "{name}: SNAT and DNAT at once");
            assert_eq!(h.ttl, sent_h.ttl - 1, "{name}: TTL or hop limit decremented");
            let (sport, dport) = ports(out);
            assert!((61000..=65535).contains(&sport), "{name}: SNAT port {sport}");
            assert_eq!(dport, if h.proto == IPPROTO_TCP { 8080 } else { 5353 }, "{name}");
            if v6 {
                assert_eq!(out[14..18], frame[14..18], "{name}: version, traffic class and flow label kept");
            }
            assert_eq!(l4_rest(out), l4_rest(frame), "{name}: nothing else of TCP/UDP changed");
            if name.starts_with("UDP without") {
                // Kept as it is, as TC keeps it (BPF_F_MARK_MANGLED_0).
                assert_eq!(out[h.l4 + 6..h.l4 + 8], [0, 0], "{name}: a zero UDP checksum stays zero");
                assert!(v6 || csum(&out[14..h.l4], 0) == 0, "{name}: IPv4 header checksum");
            } else {
                assert!(checksums_ok(out), "{name}: checksums after XDP's translation");
            }
        }

        // The UDP flow again, its payload chosen so that the translated
        // datagram's checksum computes to zero: it must leave as 0xffff
        // (a zero would read as "no checksum", which IPv6 does not allow).
        let snat_port = ports(&outs[1].1).0;
        let mut zero = udp.clone();
        let words = |l4: &[u8]| -> u32 { l4.chunks(2).map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]))).sum() };
        let mut translated = zero.l4.clone();
        translated[0..2].copy_from_slice(&snat_port.to_be_bytes());
        translated[2..4].copy_from_slice(&5353u16.to_be_bytes());
        translated[6..8].copy_from_slice(&[0, 0]);
        translated[12..14].copy_from_slice(&[0, 0]);
        let mut sum = pseudo(snat, backend, IPPROTO_UDP, translated.len()) + words(&translated);
        while sum > 0xffff {
            sum = (sum & 0xffff) + (sum >> 16);
        }
        // Two payload bytes that bring the sum to 0xffff.
        zero.l4[12..14].copy_from_slice(&(0xffff - sum as u16).to_be_bytes());
        let frame = zero.build();
        let (rc, out) = in_netns(&scratch, move || run(xdp, &frame)).expect("netns");
        assert_eq!(rc, XDP_REDIRECT);
        let h = headers(&out);
        assert_eq!(ports(&out).0, snat_port, "the same flow, the same SNAT port");
        assert_eq!(out[h.l4 + 6..h.l4 + 8], [0xff, 0xff], "a computed zero UDP checksum is sent as 0xffff (v6: {v6})");
        assert!(checksums_ok(&out));

        // A hop limit or TTL of 1 in a tracked flow: the stack must answer
        // with time exceeded, so XDP passes the frame unchanged.
        let last_hop = Frame { ttl: 1, ..Frame::tcp(client, fam.node, 41000, 30080, 0x10) }.build();
        let sent = last_hop.clone();
        let r = in_netns(&scratch, move || run(xdp, &sent)).expect("netns");
        assert_eq!(r, (XDP_PASS, last_hop), "TTL/hop limit 1 (v6: {v6})");
    }
    let c = l.counters();
    assert_eq!(c["xdp_forwarded"], 8, "three frames and the zero-sum datagram per family: {c:?}");
    assert_eq!(c["xdp_pass_no_route"], 2, "the two last-hop frames: {c:?}");
    assert_eq!(c["new_flow"], 6, "{c:?}");
    assert_eq!(c["xdp_pass_to_tc"], 0, "{c:?}");
}
