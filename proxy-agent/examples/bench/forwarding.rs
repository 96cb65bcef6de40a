//! Forwarding through veth: NodePort traffic from a client namespace
//! through a node namespace to a backend in a pod namespace.
//!
//! ```text
//!   client  cl0 10.0.1.1 ---- nd0 10.0.1.2  node  nd1 10.0.5.1 ---- pd0 10.0.5.2  pod
//! ```
//!
//! Three copies of this topology, one per variant, built alike:
//! * `direct`: no translation; the client dials the backend, routed by the
//!   node (the floor: veth + forwarding only).
//! * `topoproxy`: our TC programs on nd0 (ingress DNAT, egress reverse), as
//!   `tc_loader::install` attaches them for `--devices nd0`.
//! * `iptables`: kube-proxy-shaped rules in iptables-legacy's nat table
//!   (PREROUTING -> KUBE-SERVICES -> KUBE-NODEPORTS -> KUBE-EXT-* ->
//!   KUBE-SVC-* -> KUBE-SEP-* DNAT, masquerade via KUBE-POSTROUTING, as
//!   pkg/proxy/iptables/proxier.go writes them for externalTrafficPolicy
//!   Cluster).
//!
//! Both translating variants carry the same population of NodePort
//! Services; the client dials the last one. Namespaces are linked only to
//! each other, never to the host's.

use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use proxy_agent::datapath::tc_loader::{self, TcMode};
use proxy_agent::decide::decision::ExternalState;
use proxy_agent::external::nodeport::NodePortWriter;
use proxy_agent::model::{Backend, Frontend, Protocol};
use proxy_test_support::sandbox::{Netns, PinDir, in_netns};
use serde_json::json;

use crate::report::{Section, percentile, spread, svg_bars};
use crate::workload::{self, Proto};

const NODE: Ipv4Addr = Ipv4Addr::new(10, 0, 1, 2);
const POD: Ipv4Addr = Ipv4Addr::new(10, 0, 5, 2);
const TCP_PORT: u16 = 8080;
const UDP_SINK_PORT: u16 = 5353;
const NODE_PORT_BASE: u16 = 30_000;
/// The client-facing device of the node, the one `--devices` names.
const NODE_DEVICE: &str = "nd0";
const CLUSTER_IP_BASE: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 0);

pub(crate) struct Options {
    pub services: usize,
    pub udp: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Options { services: 1_000, udp: Duration::from_secs(1) }
    }
}

const VARIANTS: [&str; 3] = ["direct", "topoproxy", "iptables"];

struct World {
    client: Netns,
    _node: Netns,
    pod: Netns,
    /// The TC datapath's pins (topoproxy only); dropping it unpins the tcx
    /// links, which detaches the programs.
    _pins: Option<PinDir>,
    sink: Arc<AtomicU64>,
}

fn world(variant: &str, opts: &Options, scratch: &Path, stop: &Arc<AtomicBool>) -> Result<World> {
    let client = Netns::new("tpbf")?;
    let node = Netns::new("tpbf")?;
    let pod = Netns::new("tpbf")?;
    client.veth("cl0", &node, NODE_DEVICE)?;
    node.veth("nd1", &pod, "pd0")?;
    client.ip(&["addr", "add", "10.0.1.1/24", "dev", "cl0"])?;
    node.ip(&["addr", "add", "10.0.1.2/24", "dev", NODE_DEVICE])?;
    node.ip(&["addr", "add", "10.0.5.1/24", "dev", "nd1"])?;
    pod.ip(&["addr", "add", "10.0.5.2/24", "dev", "pd0"])?;
    // The client reaches the pod subnet only through the node (the direct
    // variant); the pod answers the client subnet through the node.
    client.ip(&["route", "add", "10.0.5.0/24", "via", "10.0.1.2"])?;
    pod.ip(&["route", "add", "10.0.1.0/24", "via", "10.0.5.1"])?;
    node.sysctl("net.ipv4.ip_forward", "1")?;
    // Thousands of short connections from one client address.
    client.sysctl("net.ipv4.tcp_tw_reuse", "1")?;

    // The backend: TCP (and UDP) echo on 8080, a counting UDP sink on 5353.
    workload::start_echo(&pod.path(), &[SocketAddr::new(IpAddr::V4(POD), TCP_PORT)], stop.clone())?;
    let sink = udp_sink(&pod.path(), SocketAddr::new(IpAddr::V4(POD), UDP_SINK_PORT), stop.clone())?;

    let mut pins = None;
    match variant {
        "topoproxy" => {
            let p = PinDir::new("tpbf")?;
            let dir = p.path().to_path_buf();
            // Attach from a thread inside the node namespace: device names
            // resolve there, so nd0 can only be the node's veth end.
            let warnings = in_netns(&node, move || tc_loader::install(&dir, &[NODE_DEVICE.to_string()], TcMode::Auto))??;
            if let Some(w) = warnings.first() {
                crate::step(&format!("TC attach: {w}"));
            }
            let mut w = NodePortWriter::open(p.path())?;
            w.set_config(Some(NODE), None, (61_000, 65_535))?;
            let o = w.sync(&nodeports(opts.services));
            if let Some(e) = o.failures.first() {
                bail!("writing the NodePort maps: {e}");
            }
            pins = Some(p);
        }
        "iptables" => {
            crate::load_file(&node, &["iptables-legacy-restore"], &iptables_nodeports(opts.services), scratch, "fwd-ipt.rules")?;
        }
        _ => {}
    }
    Ok(World { client, _node: node, pod, _pins: pins, sink })
}

fn node_port(opts: &Options) -> u16 {
    NODE_PORT_BASE + opts.services as u16 - 1
}

/// `services` NodePort Services (TCP and UDP each) on the node address,
/// each with the pod as its one, local, endpoint.
fn nodeports(services: usize) -> ExternalState {
    let mut ext = ExternalState::default();
    for i in 0..services {
        for (protocol, port) in [(Protocol::Tcp, TCP_PORT), (Protocol::Udp, UDP_SINK_PORT)] {
            let fe = Frontend { ip: IpAddr::V4(NODE), port: NODE_PORT_BASE + i as u16, protocol };
            ext.tc.insert(fe, [Backend { ip: IpAddr::V4(POD), port }].into_iter().collect());
        }
    }
    ext.local_endpoints.insert(IpAddr::V4(POD));
    ext
}

/// The same Services as kube-proxy (iptables mode) writes them: every
/// Service's ClusterIP rule in KUBE-SERVICES first, then the jump to
/// KUBE-NODEPORTS for local destinations as its last rule.
fn iptables_nodeports(services: usize) -> String {
    let mut s = String::from(
        "*nat\n:PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\n:KUBE-SERVICES - [0:0]\n:KUBE-NODEPORTS - [0:0]\n:KUBE-POSTROUTING - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n",
    );
    let protos = [("tcp", TCP_PORT), ("udp", UDP_SINK_PORT)];
    for (p, _) in protos {
        let _ = writeln!(s, ":KUBE-SEP-BENCH-{} - [0:0]", p.to_uppercase());
    }
    for i in 0..services {
        for (p, _) in protos {
            let _ = writeln!(s, ":KUBE-SVC-{i:012X}{} - [0:0]\n:KUBE-EXT-{i:012X}{} - [0:0]", p.to_uppercase(), p.to_uppercase());
        }
    }
    s.push_str("-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n");
    s.push_str("-A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n");
    s.push_str("-A POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING\n");
    s.push_str("-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN\n");
    s.push_str("-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000\n");
    s.push_str("-A KUBE-POSTROUTING -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE --random-fully\n");
    s.push_str("-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000\n");
    for (p, port) in protos {
        let sep = format!("KUBE-SEP-BENCH-{}", p.to_uppercase());
        let _ = writeln!(s, "-A {sep} -s {POD}/32 -m comment --comment \"bench/pod\" -j KUBE-MARK-MASQ");
        let _ = writeln!(s, "-A {sep} -p {p} -m comment --comment \"bench/pod\" -m {p} -j DNAT --to-destination {POD}:{port}");
    }
    for i in 0..services {
        let ip = crate::rules::service_ip(CLUSTER_IP_BASE, i);
        let np = NODE_PORT_BASE + i as u16;
        for (p, _) in protos {
            let (svc, ext) = (format!("KUBE-SVC-{i:012X}{}", p.to_uppercase()), format!("KUBE-EXT-{i:012X}{}", p.to_uppercase()));
            let _ = writeln!(
                s,
                "-A KUBE-SERVICES -d {ip}/32 -p {p} -m comment --comment \"bench/svc{i}:{p} cluster IP\" -m {p} --dport 80 -j {svc}"
            );
            let _ = writeln!(s, "-A KUBE-NODEPORTS -p {p} -m comment --comment \"bench/svc{i}:{p}\" -m {p} --dport {np} -j {ext}");
            let _ = writeln!(
                s,
                "-A {ext} -m comment --comment \"masquerade traffic for bench/svc{i}:{p} external destinations\" -j KUBE-MARK-MASQ"
            );
            let _ = writeln!(s, "-A {ext} -j {svc}");
            let _ = writeln!(s, "-A {svc} -m comment --comment \"bench/svc{i}:{p} -> pod\" -j KUBE-SEP-BENCH-{}", p.to_uppercase());
        }
    }
    s.push_str("-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS\n");
    s.push_str("COMMIT\n");
    s
}

/// A UDP socket in the pod namespace that counts what arrives.
fn udp_sink(ns: &Path, addr: SocketAddr, stop: Arc<AtomicBool>) -> Result<Arc<AtomicU64>> {
    let count = Arc::new(AtomicU64::new(0));
    let c = count.clone();
    workload::serve_in_netns(
        ns,
        move || UdpSocket::bind(addr),
        move |s| {
            let _ = s.set_read_timeout(Some(Duration::from_millis(50)));
            let mut b = [0u8; 2048];
            while !stop.load(Ordering::Relaxed) {
                if s.recv(&mut b).is_ok() {
                    c.fetch_add(1, Ordering::Relaxed);
                }
            }
        },
    )
    .context("UDP sink thread")?;
    Ok(count)
}

/// Packets the pod's veth end has received: what the node forwarded,
/// whether or not the receiving socket kept up.
fn pod_rx_packets(pod: &Netns) -> Result<u64> {
    let out = std::process::Command::new("ip")
        .args(["-n", pod.name(), "-j", "-s", "link", "show", "dev", "pd0"])
        .stdin(std::process::Stdio::null())
        .output()?;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).context("ip -j -s link output")?;
    v[0]["stats64"]["rx"]["packets"].as_u64().context("no rx packet count for pd0")
}

const WARMUP_DATAGRAMS: u64 = 100;

/// Sends 64-byte datagrams to `to` as fast as one thread can for `dur`;
/// returns how many were sent.
fn udp_flood(ns: &Path, to: SocketAddr, dur: Duration) -> Result<u64> {
    let ns: PathBuf = ns.to_path_buf();
    std::thread::spawn(move || -> std::io::Result<u64> {
        workload::enter_netns(&ns)?;
        let s = UdpSocket::bind("0.0.0.0:0")?;
        s.connect(to)?;
        let payload = [0x55u8; 64];
        // Warm up: ARP and the flow's first packet (a new flow in conntrack
        // or in our table) are not what is measured.
        for _ in 0..WARMUP_DATAGRAMS {
            let _ = s.send(&payload);
        }
        std::thread::sleep(Duration::from_millis(20));
        let t = Instant::now();
        let mut sent = 0u64;
        while t.elapsed() < dur {
            for _ in 0..64 {
                // ENOBUFS under overload is part of the measurement.
                if s.send(&payload).is_ok() {
                    sent += 1;
                }
            }
        }
        Ok(sent)
    })
    .join()
    .map_err(|_| anyhow::anyhow!("UDP sender panicked"))?
    .map_err(Into::into)
}

#[derive(Default)]
struct Cell {
    tcp_rate: Vec<f64>,
    tcp_p50: Vec<f64>,
    udp_forwarded: Vec<f64>,
    udp_delivered: Vec<f64>,
    udp_sent: Vec<f64>,
    failed: usize,
}

pub(crate) fn run(opts: &Options, repeats: usize, rounds: usize, scratch: &Path) -> Result<Section> {
    if !(1..=2000).contains(&opts.services) {
        bail!("--fwd-services must be 1..=2000 (NodePorts 30000..32767)");
    }
    crate::step(&format!("forwarding through veth: building three topologies with {} NodePort Services", opts.services));
    let stop = Arc::new(AtomicBool::new(false));
    let result = (|| -> Result<Section> {
        let worlds: Vec<World> = VARIANTS.iter().map(|v| world(v, opts, scratch, &stop)).collect::<Result<_>>()?;
        let target = |v: &str, port_direct: u16| -> SocketAddr {
            if v == "direct" { SocketAddr::new(IpAddr::V4(POD), port_direct) } else { SocketAddr::new(IpAddr::V4(NODE), node_port(opts)) }
        };
        let mut cells: Vec<Cell> = VARIANTS.iter().map(|_| Cell::default()).collect();
        for rep in 0..repeats {
            crate::step(&format!("forwarding: repeat {}/{repeats}", rep + 1));
            // Interleaved: each variant once per repeat and protocol.
            for (i, v) in VARIANTS.iter().enumerate() {
                let t = Instant::now();
                let (mut lat, failed) = workload::measure(&worlds[i].client.path(), &[target(v, TCP_PORT)], Proto::Tcp, rounds)?;
                let wall = t.elapsed().as_secs_f64();
                lat.sort_unstable();
                cells[i].tcp_rate.push(lat.len() as f64 / wall);
                cells[i].tcp_p50.push(percentile(&lat, 0.5));
                cells[i].failed += failed;
            }
            for (i, v) in VARIANTS.iter().enumerate() {
                let before = worlds[i].sink.load(Ordering::Relaxed);
                let rx_before = pod_rx_packets(&worlds[i].pod)?;
                let sent = udp_flood(&worlds[i].client.path(), target(v, UDP_SINK_PORT), opts.udp)?;
                // Let the receiver drain what is queued.
                std::thread::sleep(Duration::from_millis(100));
                let got = worlds[i].sink.load(Ordering::Relaxed) - before;
                // Minus the flood's warm-up datagrams.
                let forwarded = (pod_rx_packets(&worlds[i].pod)? - rx_before).saturating_sub(WARMUP_DATAGRAMS);
                let secs = opts.udp.as_secs_f64();
                cells[i].udp_forwarded.push(forwarded as f64 / secs);
                cells[i].udp_delivered.push(got as f64 / secs);
                cells[i].udp_sent.push(sent as f64 / secs);
            }
        }
        Ok(section(opts, repeats, rounds, &cells))
    })();
    // Echo and sink threads end with the stop flag (the TCP listeners when
    // the process exits); the namespaces were removed with the worlds.
    stop.store(true, Ordering::Relaxed);
    result
}

fn section(opts: &Options, repeats: usize, rounds: usize, cells: &[Cell]) -> Section {
    let mut md = format!(
        "## NodePort forwarding through veth\n\nClient namespace -> node namespace -> backend in a pod namespace, over veth pairs. `direct`: the client dials the backend, routed by the node, no translation. `topoproxy`: our TC programs on the node's client-facing veth (DNAT at ingress, reverse at egress; the backend is local to the node, so no SNAT). `iptables`: kube-proxy-shaped NodePort rules in iptables-legacy (KUBE-SERVICES with {n} ClusterIP rules per protocol, then KUBE-NODEPORTS; masquerade as for externalTrafficPolicy Cluster). The translating variants hold {n} NodePort Services (TCP and UDP); the client dials the last one. TCP: {rounds} sequential connect + 1-byte exchange + close per repeat (every SYN takes the new-flow path). UDP: one sender thread floods 64-byte datagrams for {:.1} s on one flow (the tracked-flow path); the whole path runs in the sender's softirq context on its CPU, so the sender's rate is bounded by the per-packet cost of client stack + forwarding + delivery. Forwarded = received by the pod's veth end (what the node forwarded); delivered = read by the backend socket (one receiving thread; it falls behind, so this is bounded by the receiver, not by forwarding). Median (min–max) over {repeats} repeats, variants interleaved.\n\n| variant | TCP connects/s | TCP p50 | UDP forwarded (pkt/s) | UDP delivered (pkt/s) | UDP sent (pkt/s) | failed |\n|---|---|---|---|---|---|---|\n",
        opts.udp.as_secs_f64(),
        n = opts.services,
    );
    let mut rows = Vec::new();
    for (i, v) in VARIANTS.iter().enumerate() {
        let c = &cells[i];
        let (r, p, f, d, s) =
            (spread(&c.tcp_rate), spread(&c.tcp_p50), spread(&c.udp_forwarded), spread(&c.udp_delivered), spread(&c.udp_sent));
        let _ = writeln!(
            md,
            "| {v} | {:.0} ({:.0}–{:.0}) | {} | {:.0} ({:.0}–{:.0}) | {:.0} ({:.0}–{:.0}) | {:.0} ({:.0}–{:.0}) | {} |",
            r.median,
            r.min,
            r.max,
            p.us(),
            f.median,
            f.min,
            f.max,
            d.median,
            d.min,
            d.max,
            s.median,
            s.min,
            s.max,
            c.failed
        );
        rows.push(json!({"variant": v, "tcp_connects_per_s": r.json(), "tcp_p50_ns": p.json(), "udp_forwarded_per_s": f.json(), "udp_delivered_per_s": d.json(), "udp_sent_per_s": s.json(), "failed": c.failed}));
    }
    let m = |i: usize, f: fn(&Cell) -> &Vec<f64>| spread(f(&cells[i])).median;
    fn tcp(c: &Cell) -> &Vec<f64> {
        &c.tcp_rate
    }
    fn udp(c: &Cell) -> &Vec<f64> {
        &c.udp_forwarded
    }
    let ratios = json!({
        "tcp_topoproxy_vs_direct": m(1, tcp) / m(0, tcp),
        "tcp_topoproxy_vs_iptables": m(1, tcp) / m(2, tcp),
        "udp_forwarded_topoproxy_vs_direct": m(1, udp) / m(0, udp),
        "udp_forwarded_topoproxy_vs_iptables": m(1, udp) / m(2, udp),
    });
    let _ = writeln!(
        md,
        "\nRatios of medians (rate, higher is better): TCP connects/s topoproxy/direct {:.3}, topoproxy/iptables {:.3}; UDP forwarded topoproxy/direct {:.3}, topoproxy/iptables {:.3}. The issue sets no target for the forwarding rate; the per-packet cost target is in the BPF_PROG_TEST_RUN section. Plot: `nodeport_forwarding.svg`.\n",
        m(1, tcp) / m(0, tcp),
        m(1, tcp) / m(2, tcp),
        m(1, udp) / m(0, udp),
        m(1, udp) / m(2, udp)
    );
    let xs: Vec<String> = vec!["TCP connects/s (x1000)".into(), "UDP forwarded pkt/s (x10000)".into()];
    let series: Vec<(String, Vec<f64>)> =
        VARIANTS.iter().enumerate().map(|(i, v)| (v.to_string(), vec![m(i, tcp) / 1e3, m(i, udp) / 1e4])).collect();
    Section {
        key: "nodeport_forwarding",
        markdown: md,
        json: json!({"services": opts.services, "udp_seconds": opts.udp.as_secs_f64(), "rounds": rounds, "variants": rows, "ratios": ratios}),
        svgs: vec![("nodeport_forwarding.svg".into(), svg_bars("NodePort forwarding through veth", "rate", &xs, &series))],
        targets: Vec::new(),
    }
}
