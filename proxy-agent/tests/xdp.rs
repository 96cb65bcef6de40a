//! NodePort at XDP (`--xdp`): flows to a remote backend are translated and
//! forwarded by the XDP program on the node's client-facing veth, sharing
//! conntrack with the TC programs, which handle the replies and everything
//! XDP passes on.
//!
//! Three isolated namespaces, no link to the host's:
//!
//! ```text
//!   client c-n 10.0.1.1 ---- n-c 10.0.1.2  node  n-b 10.0.3.1 ---- eth0 10.0.3.2 backend
//! ```
//!
//! The backend stands for a pod on another node: its endpoint names
//! another node, so the agent (node `node-a`, `--devices n-c,n-b`) DNATs
//! and SNATs to it. The client has no route to 10.0.3.0/24.
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

mod support;

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use proxy_test_support::sandbox::{Cgroup, Guarded, Netns, PinDir, command_in, echo_server, in_netns, spawn_backend};
use proxy_test_support::wait::eventually;
use support::*;

const NODE: &str = "10.0.1.2";
const BACKEND: &str = "10.0.3.2";

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
}

impl World {
    fn new() -> World {
        require_root();
        let client = Netns::new("txdp").expect("client netns");
        let node = Netns::new("txdp").expect("node netns");
        let backend = Netns::new("txdp").expect("backend netns");
        node.veth("n-c", &client, "c-n").expect("veth client-node");
        node.veth("n-b", &backend, "eth0").expect("veth node-backend");
        for (ns, cidr, dev) in [
            (&client, "10.0.1.1/24", "c-n"),
            (&node, "10.0.1.2/24", "n-c"),
            (&node, "10.0.3.1/24", "n-b"),
            (&backend, "10.0.3.2/24", "eth0"),
        ] {
            ns.ip(&["addr", "add", cidr, "dev", dev]).unwrap_or_else(|e| panic!("{cidr} on {dev}: {e}"));
        }
        backend.ip(&["route", "add", "default", "via", "10.0.3.1"]).expect("backend route");
        node.sysctl("net.ipv4.ip_forward", "1").expect("ip_forward");
        in_netns(&backend, || ethtool_set("eth0", ETHTOOL_SGRO, 1)).expect("netns").expect("GRO on the backend's eth0");
        in_netns(&client, || ethtool_set("c-n", ETHTOOL_STXCSUM, 0)).expect("netns").expect("tx checksum off on c-n");
        let listen = [format!("{BACKEND}:8080"), format!("{BACKEND}:5353")];
        let backend_proc = spawn_backend(&agent_bin(), &backend, "pod-b", &listen).expect("backend");
        let manifests = TempDir::new("txdp-manifests");
        let log = manifests.0.join("agent.log.txt");
        let w = World {
            client,
            node,
            backend,
            cgroup: Cgroup::new("txdp").expect("cgroup"),
            pins: PinDir::new("txdp").expect("pins"),
            manifests,
            log,
            agent: None,
            _backend_proc: backend_proc,
        };
        let yaml = format!(
            "---\napiVersion: v1\nkind: Service\nmetadata: {{name: web, namespace: default}}\nspec:\n  type: NodePort\n  clusterIP: 10.96.0.10\n  externalTrafficPolicy: Cluster\n  ports:\n  - {{name: http, port: 80, protocol: TCP, targetPort: 8080, nodePort: 30080}}\n  - {{name: dns, port: 53, protocol: UDP, targetPort: 5353, nodePort: 30053}}\n  - {{name: echo, port: 90, protocol: TCP, targetPort: 9090, nodePort: 30090}}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: web-ipv4\n  namespace: default\n  labels: {{kubernetes.io/service-name: web}}\naddressType: IPv4\nports:\n- {{name: http, port: 8080, protocol: TCP}}\n- {{name: dns, port: 5353, protocol: UDP}}\n- {{name: echo, port: 9090, protocol: TCP}}\nendpoints:\n- addresses: [\"{BACKEND}\"]\n  conditions: {{ready: true}}\n  nodeName: node-b\n"
        );
        std::fs::write(w.manifests.0.join("cluster.yaml"), yaml).expect("write manifest");
        w
    }

    /// Starts the agent with `--xdp <xdp>`; an empty `xdp` leaves the
    /// flag out (the default).
    fn start_agent(&mut self, xdp: &str) {
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
            .args(["--poll-interval-ms", "50", "--devices", "n-c,n-b", "--node-ip", NODE])
            .args(if xdp.is_empty() { Vec::new() } else { vec!["--xdp", xdp] })
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
        eventually(&format!("{to} {extra:?} to answer from pod-b"), || {
            let mut args = vec!["--to", to, "--count", "8", "--timeout-ms", "1000"];
            args.extend_from_slice(extra);
            let r = self.probe(&args);
            if replies(&r) == set(&["pod-b"]) && r.iter().all(|x| x["ok"] == true) { Ok(()) } else { Err(r) }
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
        }
        // The pins (XDP link included) go with `pins`, the devices with the
        // namespaces.
        let _ = &self.backend;
    }
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
    // neighbour unresolved (XDP passes it to TC, which resolves it); then
    // XDP forwards.
    w.wait_answers(&format!("{NODE}:30080"), &[]);
    w.wait_answers(&format!("{NODE}:30053"), &["--udp"]);
    let before = w.counter("xdp_forwarded");
    w.wait_answers(&format!("{NODE}:30080"), &[]);
    let after = w.counter("xdp_forwarded");
    assert!(after > before, "XDP forwarded nothing: {before} -> {after}");
    // Replies come back through TC (ingress reverses the SNAT, egress the
    // DNAT): the entries XDP used are the TC path's.
    assert!(w.counter("tracked") > 0);
    assert_eq!(w.counter("rewrite_failed"), 0);

    // A long-lived connection, then XDP removed under it.
    let _accepted = echo_server(&w.backend, format!("{BACKEND}:9090").parse().expect("addr")).expect("echo server");
    let mut s = connect(&w.client, format!("{NODE}:30090").parse().expect("addr"));
    let mut r = BufReader::new(s.try_clone().expect("clone"));
    for i in 0..5 {
        echo(&mut s, &mut r, &format!("xdp {i}"));
    }
    let forwarded = w.counter("xdp_forwarded");
    assert!(forwarded > after, "the echo connection did not go through XDP");

    // Restart with XDP on: the pinned link is adopted (same pin, program
    // swapped in place), the connection goes on.
    let pin = w.pins.path().join("links").join("xdp-n-c");
    let ino = || std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(&pin).expect("xdp link pin"));
    let ino_before = ino();
    w.stop_agent();
    assert!(w.kernel_has_xdp("n-c"), "XDP must stay attached while no agent runs");
    echo(&mut s, &mut r, "between agents");
    w.start_agent("native");
    eventually("the restarted agent to serve", || {
        let r = w.probe(&["--to", &format!("{NODE}:30080"), "--count", "2", "--timeout-ms", "1000"]);
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

#[test]
fn auto_attaches_native_xdp_on_veth_and_the_default_is_off() {
    let mut w = World::new();
    // veth takes native XDP, so `auto` attaches it.
    w.start_agent("auto");
    eventually("auto to attach XDP on n-c and n-b", || {
        let d = w.xdp_devices();
        if d == ["n-b", "n-c"] && w.kernel_has_xdp("n-c") { Ok(()) } else { Err(d) }
    });
    w.wait_answers(&format!("{NODE}:30080"), &[]);
    w.stop_agent();
    // Without the flag: off, and what an earlier run attached is detached.
    w.start_agent("");
    eventually("the default to detach XDP", || {
        if w.xdp_devices().is_empty() && !w.kernel_has_xdp("n-c") { Ok(()) } else { Err(w.xdp_devices()) }
    });
    let forwarded = w.counter("xdp_forwarded");
    w.wait_answers(&format!("{NODE}:30080"), &[]);
    assert_eq!(w.counter("xdp_forwarded"), forwarded, "no XDP by default");
    w.stop_agent();
}

/// Ethernet + IPv4 (header checksum filled in, `frag` as the flags and
/// offset word) + `l4`.
fn ipv4(proto: u8, dst: [u8; 4], frag: u16, l4: &[u8]) -> Vec<u8> {
    let mut f = vec![0x02, 0, 0, 0, 0, 1, 0x02, 0, 0, 0, 0, 2, 0x08, 0x00];
    let mut ip = vec![0x45, 0];
    ip.extend_from_slice(&((20 + l4.len()) as u16).to_be_bytes());
    ip.extend_from_slice(&[0, 1]);
    ip.extend_from_slice(&frag.to_be_bytes());
    ip.extend_from_slice(&[64, proto, 0, 0, 10, 0, 1, 1]);
    ip.extend_from_slice(&dst);
    let mut sum: u32 = ip.chunks(2).map(|c| u32::from(u16::from_be_bytes([c[0], c[1]]))).sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    ip[10..12].copy_from_slice(&(!(sum as u16)).to_be_bytes());
    f.extend_from_slice(&ip);
    f.extend_from_slice(l4);
    f
}

/// A TCP SYN from 10.0.1.1:40000 to `dst:dport`.
fn syn(dst: [u8; 4], dport: u16, frag: u16) -> Vec<u8> {
    let mut t = Vec::new();
    t.extend_from_slice(&40000u16.to_be_bytes());
    t.extend_from_slice(&dport.to_be_bytes());
    t.extend_from_slice(&[0, 0, 0, 1, 0, 0, 0, 0, 0x50, 0x02, 0xff, 0xff, 0, 0, 0, 0]);
    ipv4(6, dst, frag, &t)
}

const XDP_PASS: i32 = 2;
const TC_PASS: i32 = -1; // TC_ACT_UNSPEC

#[test]
fn xdp_passes_what_it_does_not_forward_unchanged_and_tc_continues_from_its_conntrack() {
    use std::net::{IpAddr, Ipv4Addr};
    use std::os::fd::{AsFd, AsRawFd};

    use proxy_agent::datapath::{tc_loader, xdp_loader};
    use proxy_agent::decide::decision::ExternalState;
    use proxy_agent::model::{Backend, Frontend, Protocol};

    require_root();
    let pins = PinDir::new("txdpr").expect("pins");
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
    writer.set_config(Some(Ipv4Addr::new(10, 0, 3, 1)), None, (61000, 65535)).expect("config");
    let v4 = |a: [u8; 4]| IpAddr::V4(Ipv4Addr::from(a));
    let node = [10, 0, 1, 2];
    let remote = Backend { ip: v4([10, 244, 2, 10]), port: 8080 };
    let local = Backend { ip: v4([10, 244, 1, 10]), port: 8080 };
    let ext = ExternalState {
        tc: [
            (Frontend { ip: v4(node), port: 30080, protocol: Protocol::Tcp }, [remote].into_iter().collect()),
            (Frontend { ip: v4(node), port: 30081, protocol: Protocol::Tcp }, [local].into_iter().collect()),
        ]
        .into_iter()
        .collect(),
        local_endpoints: [local.ip].into_iter().collect(),
        ..Default::default()
    };
    let o = writer.sync(&ext);
    assert!(o.failures.is_empty(), "{:?}", o.failures);
    let counters = || proxy_agent::datapath::dump::np_counters(pins.path()).expect("counters");
    let run = |fd: i32, frame: Vec<u8>| -> (i32, Vec<u8>) {
        let mut out = vec![0u8; frame.len() + 128];
        let r = proxy_test_support::prog_test_run::run(fd, &frame, &mut out, 1).expect("BPF_PROG_TEST_RUN");
        out.truncate(r.out_len);
        (r.retval, out)
    };
    // In a namespace of our own: an XDP test run looks routes up in the
    // caller's namespace (`bpf_fib_lookup` on the loopback device's), and
    // this one has none, so no packet can be forwarded anywhere.
    let scratch = Netns::new("txdpr").expect("netns");
    let ((icmp, frag, local_syn, tc_local, remote_syn, tc_remote), sent) = in_netns(&scratch, move || {
        let icmp_frame = ipv4(1, node, 0, &[8, 0, 0, 0, 0, 1, 0, 1]);
        let frag_frame = syn(node, 30080, 0x2000);
        let local_frame = syn(node, 30081, 0);
        let remote_frame = syn(node, 30080, 0);
        let r = (
            run(xdp_fd, icmp_frame.clone()),
            run(xdp_fd, frag_frame.clone()),
            run(xdp_fd, local_frame.clone()),
            run(ingress, local_frame.clone()),
            run(xdp_fd, remote_frame.clone()),
            {
                let (rc, out) = run(ingress, remote_frame.clone());
                assert_eq!(rc, TC_PASS);
                run(egress, out)
            },
        );
        (r, (icmp_frame, frag_frame, local_frame, remote_frame))
    })
    .expect("netns");
    let (icmp_frame, frag_frame, local_frame, remote_frame) = sent;
    // ICMP and fragments: passed untouched, nothing tracked.
    assert_eq!(icmp, (XDP_PASS, icmp_frame));
    assert_eq!(frag, (XDP_PASS, frag_frame));
    // A local backend: XDP sets the flow up (TC's own `new_flow`) and
    // passes the frame unchanged; TC ingress finds the entry and DNATs.
    assert_eq!(local_syn, (XDP_PASS, local_frame));
    assert_eq!(tc_local.0, TC_PASS);
    assert_eq!(tc_local.1[30..34], [10, 244, 1, 10], "TC DNATs to the local backend");
    // A remote backend without a usable route: unchanged, and TC carries
    // the flow XDP set up (DNAT and the SNAT port XDP reserved).
    assert_eq!(remote_syn, (XDP_PASS, remote_frame));
    assert_eq!(tc_remote.0, TC_PASS);
    assert_eq!(tc_remote.1[26..30], [10, 0, 3, 1], "SNAT to the node");
    assert_eq!(tc_remote.1[30..34], [10, 244, 2, 10], "DNAT to the remote backend");
    let c = counters();
    assert_eq!(c["new_flow"], 2, "each flow set up once, by XDP: {c:?}");
    assert_eq!(c["xdp_pass_to_tc"], 1, "{c:?}");
    assert_eq!(c["xdp_pass_no_route"], 1, "{c:?}");
    assert_eq!(c["xdp_forwarded"], 0, "{c:?}");
    assert_eq!(c["pass_fragment"], 0, "XDP leaves the counting of fragments to TC: {c:?}");
}
