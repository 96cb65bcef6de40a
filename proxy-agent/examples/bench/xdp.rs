//! NodePort at XDP (`--only xdp`): the XDP program's per-packet cost under
//! BPF_PROG_TEST_RUN against a minimal XDP program, and packets per second
//! through a veth NodePort path to a remote backend (DNAT + SNAT) with XDP
//! in front of TC, TC alone (with and without its fast path), and iptables
//! DNAT + MASQUERADE, beside the floor of any TC path (`tc-floor`: a
//! program that only redirects, see `bench_redirect_tc`).
//!
//! ```text
//!   client  cl0 10.0.1.1 ---- nd0 10.0.1.2  node  nd1 10.0.5.1 ---- pd0 10.0.5.2  backend
//! ```
//!
//! Two traffic generators send one prebuilt UDP frame to the NodePort from
//! the client namespace, each for the same time and on every variant:
//!
//! * `xdp-gen`: `bench_tx_xdp` under BPF_PROG_TEST_RUN in live-frames mode
//!   on `cl0` (the way xdp-trafficgen works): every run sends a fresh copy
//!   of the frame out of `cl0` with XDP_TX, so it reaches `nd0` as an
//!   `xdp_frame` through veth's NAPI ring, with no skb, as frames from a
//!   NIC reach native XDP. The XDP variant then never builds an skb on the
//!   node; TC and iptables build one from the frame. This is the row the
//!   ">= 2x TC" target reads.
//! * `af_packet`: an `AF_PACKET` socket (`PACKET_QDISC_BYPASS`: no qdisc,
//!   no client stack). Its skbs reach `nd0` through `veth_xmit`; in front
//!   of XDP, veth converts (copies) each one into an XDP buffer first, a
//!   cost no NIC driver has, so this row measures XDP at a disadvantage.
//!
//! What the node forwarded is counted at the backend's veth end (`ip -s
//! link`), where `bench_drop_xdp` drops every UDP frame: the backend's own
//! stack would otherwise cost as much per packet as the node, the same in
//! every variant, and hide the difference measured. The whole path (the
//! generator, the node, the sink) runs on the generator's CPU: veth
//! schedules its NAPI on the CPU that queued the frame. Threaded NAPI, to
//! give the node its own CPU, was tried and rejected: with the generator
//! on the other CPU outrunning the node, the forwarded rate collapsed to a
//! fraction of the one-CPU figure (page-pool pages returned across CPUs,
//! ring drops), a measure of overload rather than of the path.
//!
//! A veth takes frames redirected into it (XDP_TX, XDP_REDIRECT) only
//! while its peer's queue runs NAPI, i.e. has an XDP program or GRO on
//! (drivers/net/veth.c, `veth_xdp_xmit`): `pd0` has its sink (and GRO) in
//! every variant, and `nd0` has GRO on (where no XDP program is there)
//! during the `xdp-gen` floods only, so that the `af_packet` rows take the
//! plain `veth_xmit` path.
//!
//! After the floods, NodePort TCP requests (connect, one byte echoed,
//! close) go through the same four nodes to an echo server in the
//! backend's namespace, for each variant's request p50 and p99. The sink
//! drops only UDP, so they reach it. `--xdp-flood-ms` sets each flood's
//! length; `--xdp-perf DIR` keeps a `perf record` profile of every flood of
//! the first repeat there (`GENERATOR-VARIANT.data`).

use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::fd::{AsFd, AsRawFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use proxy_agent::datapath::tc_loader::{self, TcFastPath, TcMode};
use proxy_agent::datapath::xdp_loader::{self, XdpMode};
use proxy_agent::decide::decision::ExternalState;
use proxy_agent::external::nodeport::NodePortWriter;
use proxy_agent::model::{Backend, Frontend, Protocol};
use proxy_common::{XdpNextHopKey, XdpNextHopValue};
use proxy_test_support::sandbox::{Netns, PinDir, in_netns};
use serde_json::json;

use crate::report::{Section, Target, percentile, spread};
use crate::workload::{self, Proto};

const NODE: Ipv4Addr = Ipv4Addr::new(10, 0, 1, 2);
const BACKEND: Ipv4Addr = Ipv4Addr::new(10, 0, 5, 2);
const NODE_PORT: u16 = 30_053;
const BACKEND_PORT: u16 = 5353;
/// Interleaved in this order in every repeat; `tc-fast` is the TC
/// programs with the fast path (`--tc-fast-path auto`, the agent's
/// default), `tc` without it (`off`: the stack forwards).
/// `tc-floor` is no NodePort at all: `bench_redirect_tc` sends every
/// frame from `nd0`'s ingress to `nd1`, the least a TC path can do.
const VARIANTS: [&str; 5] = ["xdp", "tc-fast", "tc", "iptables", "tc-floor"];
const GENERATORS: [&str; 2] = ["xdp-gen", "af_packet"];
/// What `--only xdp` takes from the command line.
pub(crate) struct Options {
    /// Flood per generator, variant and repeat (`--xdp-flood-ms`).
    pub flood: Duration,
    /// Where to keep a `perf record` CPU profile of each flood of the first
    /// repeat (`--xdp-perf DIR`), to see where the forwarding CPU goes.
    pub perf: Option<PathBuf>,
}

impl Default for Options {
    fn default() -> Self {
        Options { flood: Duration::from_secs(1), perf: None }
    }
}
/// BPF_PROG_TEST_RUN calls per program and repeat.
const TEST_RUNS: usize = 20_000;

struct World {
    client: Netns,
    node: Netns,
    backend: Netns,
    /// The TC datapath's pins (xdp, tc-fast, tc); dropping them detaches the
    /// programs.
    pins: Option<PinDir>,
}

fn world(variant: &str, txgen: &mut Generator, stop: &Arc<AtomicBool>) -> Result<World> {
    let client = Netns::new("tpbx")?;
    let node = Netns::new("tpbx")?;
    let backend = Netns::new("tpbx")?;
    client.veth("cl0", &node, "nd0")?;
    node.veth("nd1", &backend, "pd0")?;
    client.ip(&["addr", "add", "10.0.1.1/24", "dev", "cl0"])?;
    node.ip(&["addr", "add", "10.0.1.2/24", "dev", "nd0"])?;
    node.ip(&["addr", "add", "10.0.5.1/24", "dev", "nd1"])?;
    backend.ip(&["addr", "add", "10.0.5.2/24", "dev", "pd0"])?;
    backend.ip(&["route", "add", "default", "via", "10.0.5.1"])?;
    node.sysctl("net.ipv4.ip_forward", "1")?;
    in_netns(&backend, || ethtool_set("pd0", ETHTOOL_SGRO, 1))?.context("GRO on pd0")?;
    // The TCP requests' senders fill in their checksums, as a sender
    // behind a real link does: XDP forwards frames without an skb to say
    // a checksum is only partial (see xdp.rs in proxy-ebpf).
    in_netns(&client, || ethtool_set("cl0", ETHTOOL_STXCSUM, 0))?.context("tx checksum off on cl0")?;
    in_netns(&backend, || ethtool_set("pd0", ETHTOOL_STXCSUM, 0))?.context("tx checksum off on pd0")?;
    txgen.attach_sink(&backend, variant)?;
    // The TCP requests' server; the sink drops only UDP.
    workload::start_echo(&backend.path(), &[SocketAddr::new(IpAddr::V4(BACKEND), BACKEND_PORT)], stop.clone())?;
    // The backend's neighbour entry exists before the flood (XDP passes a
    // flow's packets to the stack until it does).
    let mac = mac_of(&backend, "pd0")?;
    node.ip(&["neigh", "replace", "10.0.5.2", "lladdr", &mac, "dev", "nd1", "nud", "permanent"])?;
    let mut pins = None;
    match variant {
        "xdp" | "tc" | "tc-fast" => {
            let p = PinDir::new("tpbx")?;
            let dir = p.path().to_path_buf();
            let devices = vec!["nd0".to_string(), "nd1".to_string()];
            let xdp = if variant == "xdp" { XdpMode::Native } else { XdpMode::Off };
            // Writer first: the programs need the SNAT address.
            let fast = variant == "tc-fast";
            in_netns(&node, {
                let (dir, devices) = (dir.clone(), devices.clone());
                move || -> Result<()> {
                    if fast {
                        let installed = tc_loader::install_external(&dir, &devices, TcMode::Auto, TcFastPath::Auto, false)?;
                        if !installed.fast {
                            bail!("the TC fast path did not load: {:?}", installed.notes);
                        }
                    } else {
                        tc_loader::install(&dir, &devices, TcMode::Auto)?;
                    }
                    Ok(())
                }
            })??;
            let mut w = NodePortWriter::open(p.path())?;
            w.set_config(Some(NODE), None, (61_000, 65_535))?;
            let o = w.sync(&nodeport());
            if let Some(e) = o.failures.first() {
                bail!("writing the NodePort maps: {e}");
            }
            in_netns(&node, move || xdp_loader::install(&dir, &devices, xdp))??;
            pins = Some(p);
        }
        "tc-floor" => txgen.attach_floor(&node)?,
        _ => {
            let rules = format!(
                "*nat\n:PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\n-A PREROUTING -d {NODE}/32 -p udp -m udp --dport {NODE_PORT} -j DNAT --to-destination {BACKEND}:{BACKEND_PORT}\n-A PREROUTING -d {NODE}/32 -p tcp -m tcp --dport {NODE_PORT} -j DNAT --to-destination {BACKEND}:{BACKEND_PORT}\n-A POSTROUTING -o nd1 -j MASQUERADE\nCOMMIT\n"
            );
            let path = std::env::temp_dir().join(format!("tpbx-{}.rules", std::process::id()));
            std::fs::write(&path, rules)?;
            let st = std::process::Command::new("ip").args(["netns", "exec", node.name(), "iptables-legacy-restore"]).arg(&path).status();
            let _ = std::fs::remove_file(&path);
            if !st.is_ok_and(|s| s.success()) {
                bail!("iptables-legacy-restore failed");
            }
        }
    }
    Ok(World { client, node, backend, pins })
}

/// One NodePort, UDP (the floods) and TCP (the requests), on the node
/// address with the remote backend.
fn nodeport() -> ExternalState {
    let mut ext = ExternalState::default();
    for protocol in [Protocol::Udp, Protocol::Tcp] {
        let fe = Frontend { ip: IpAddr::V4(NODE), port: NODE_PORT, protocol };
        ext.tc.insert(fe, [Backend { ip: IpAddr::V4(BACKEND), port: BACKEND_PORT }].into_iter().collect());
    }
    ext
}

fn mac_of(ns: &Netns, dev: &str) -> Result<String> {
    let out = std::process::Command::new("ip").args(["-n", ns.name(), "-j", "link", "show", "dev", dev]).output()?;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).context("ip -j link output")?;
    Ok(v[0]["address"].as_str().context("no MAC")?.to_string())
}

fn rx_packets(ns: &Netns, dev: &str) -> Result<u64> {
    let out = std::process::Command::new("ip").args(["-n", ns.name(), "-j", "-s", "link", "show", "dev", dev]).output()?;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).context("ip -j -s link output")?;
    v[0]["stats64"]["rx"]["packets"].as_u64().context("no rx packet count")
}

fn parse_mac(s: &str) -> [u8; 6] {
    let mut m = [0u8; 6];
    for (b, p) in m.iter_mut().zip(s.split(':')) {
        *b = u8::from_str_radix(p, 16).unwrap_or(0);
    }
    m
}

/// Ethernet + IPv4 + UDP (no UDP checksum, allowed over IPv4) with 22
/// bytes of payload: a 64-byte frame, the size `bench_tx_xdp` writes.
fn udp_frame(dst_mac: [u8; 6], src_mac: [u8; 6], src: Ipv4Addr, dst: Ipv4Addr, dport: u16) -> Vec<u8> {
    let mut f = Vec::with_capacity(64);
    f.extend_from_slice(&dst_mac);
    f.extend_from_slice(&src_mac);
    f.extend_from_slice(&[0x08, 0x00]);
    let mut ip = vec![0x45, 0, 0, 50, 0, 1, 0, 0, 64, 17, 0, 0];
    ip.extend_from_slice(&src.octets());
    ip.extend_from_slice(&dst.octets());
    let mut sum: u32 = ip.chunks(2).map(|c| u32::from(u16::from_be_bytes([c[0], c[1]]))).sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    ip[10..12].copy_from_slice(&(!(sum as u16)).to_be_bytes());
    f.extend_from_slice(&ip);
    f.extend_from_slice(&40_000u16.to_be_bytes());
    f.extend_from_slice(&dport.to_be_bytes());
    f.extend_from_slice(&[0, 30, 0, 0]);
    f.extend_from_slice(&[0x55; 22]);
    f
}

/// The interface index of `dev` in the calling thread's namespace.
fn device_index(dev: &str) -> std::io::Result<u32> {
    match proxy_agent::external::node_addresses::ifindex(dev) {
        0 => Err(std::io::Error::other(format!("no device {dev}"))),
        i => Ok(i),
    }
}

/// Sends `frame` out of `dev` (in the calling thread's namespace) with an
/// AF_PACKET socket for `dur`; returns how many sends succeeded.
fn raw_flood(dev: &str, frame: &[u8], dur: Duration) -> std::io::Result<u64> {
    let ifindex = device_index(dev)?;
    // SAFETY: plain socket creation; the fd is closed below.
    let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: zeroed sockaddr_ll is valid; filled below.
    let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    sll.sll_family = libc::AF_PACKET as u16;
    sll.sll_ifindex = ifindex as i32;
    sll.sll_halen = 6;
    sll.sll_addr[..6].copy_from_slice(&frame[..6]);
    let one: libc::c_int = 1;
    // SAFETY: `one` is a live int of the size passed. Best effort: without
    // it the frames take the device's qdisc.
    unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_PACKET,
            libc::PACKET_QDISC_BYPASS,
            (&raw const one).cast(),
            std::mem::size_of::<libc::c_int>() as u32,
        )
    };
    let t = Instant::now();
    let mut sent = 0u64;
    while t.elapsed() < dur {
        for _ in 0..64 {
            // SAFETY: `frame` and `sll` are live for the call and their
            // sizes are passed.
            let n = unsafe {
                libc::sendto(
                    fd,
                    frame.as_ptr().cast(),
                    frame.len(),
                    0,
                    (&raw const sll).cast(),
                    std::mem::size_of::<libc::sockaddr_ll>() as u32,
                )
            };
            if n > 0 {
                sent += 1;
            }
        }
    }
    // SAFETY: our own descriptor.
    unsafe { libc::close(fd) };
    Ok(sent)
}

const ETHTOOL_SGRO: u32 = 0x2c;
const ETHTOOL_STXCSUM: u32 = 0x17;

/// One legacy ethtool "set" command on `dev` through `SIOCETHTOOL`, in the
/// calling thread's namespace (there is no ethtool binary on the machine).
fn ethtool_set(dev: &str, cmd: u32, value: u32) -> std::io::Result<()> {
    #[repr(C)]
    struct EthtoolValue {
        cmd: u32,
        data: u32,
    }
    let mut v = EthtoolValue { cmd, data: value };
    // SAFETY: an all-zero `ifreq` is valid.
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
    // SAFETY: `ifr` names the device and points at `v`, live for the call.
    let rc = unsafe { libc::ioctl(fd, libc::SIOCETHTOOL, &raw mut ifr) };
    let err = std::io::Error::last_os_error();
    // SAFETY: our own descriptor.
    unsafe { libc::close(fd) };
    if rc < 0 { Err(err) } else { Ok(()) }
}

/// Median BPF_PROG_TEST_RUN duration (ns, one run per call) of the XDP
/// program on a tracked flow to a remote backend whose route and
/// neighbour resolve (the full path: lookups, the next hop from the cache
/// or `bpf_fib_lookup`, rewrite, `bpf_redirect`), and of
/// `bench_minimal_xdp`, per repeat.
fn test_run(repeats: usize) -> Result<TestRuns> {
    // The test run looks routes up in the caller's namespace: one of our
    // own, with the backend's subnet on a veth and a fixed neighbour.
    let ns = Netns::new("tpbx")?;
    let other = Netns::new("tpbx")?;
    ns.veth("x0", &other, "x1")?;
    ns.ip(&["addr", "add", "10.0.5.1/24", "dev", "x0"])?;
    ns.ip(&["neigh", "replace", "10.0.5.2", "lladdr", "02:00:00:00:05:02", "dev", "x0", "nud", "permanent"])?;
    // Forwarding on, or `bpf_fib_lookup` answers "forwarding disabled" for
    // the test run's ingress device and the program passes every frame
    // (verdict XDP_PASS) without its rewrite and redirect.
    ns.sysctl("net.ipv4.ip_forward", "1")?;
    ns.ip(&["link", "set", "lo", "up"])?;
    let pins = PinDir::new("tpbx")?;
    let mut ebpf = xdp_loader::load_unattached(pins.path())?;
    let mut w = NodePortWriter::open(pins.path())?;
    w.set_config(Some(NODE), None, (61_000, 65_535))?;
    let o = w.sync(&nodeport());
    if let Some(e) = o.failures.first() {
        bail!("writing the NodePort maps: {e}");
    }
    let fd_of = |ebpf: &mut aya::Ebpf, name: &str, load: bool| -> Result<i32> {
        let p: &mut aya::programs::Xdp = ebpf.program_mut(name).with_context(|| format!("{name} missing"))?.try_into()?;
        if load {
            p.load()?;
        }
        Ok(p.fd()?.as_fd().as_raw_fd())
    };
    let ours = fd_of(&mut ebpf, &xdp_loader::loaded_name(), false)?;
    let minimal = fd_of(&mut ebpf, "bench_minimal_xdp", true)?;
    // The program's next-hop cache, made stale or emptied before each call
    // of those runs (outside the timed run): every packet then pays the
    // route lookup, as a flow's first packet of each second does, and the
    // entry's refresh or insert.
    let mut nexthops: aya::maps::HashMap<aya::maps::MapData, XdpNextHopKey, XdpNextHopValue> =
        aya::maps::HashMap::try_from(ebpf.take_map(proxy_common::XDP_NEXTHOP_MAP).context("XDP_NEXTHOP missing")?)?;
    let frame = udp_frame([2, 0, 0, 0, 1, 2], [2, 0, 0, 0, 1, 1], Ipv4Addr::new(10, 0, 1, 1), NODE, NODE_PORT);
    let runs = in_netns(&ns, move || -> Result<TestRuns> {
        let mut out = vec![0u8; frame.len() + 256];
        let mut one = |fd: i32, cache: Cache| -> Result<(f64, i32)> {
            let mut d = Vec::with_capacity(TEST_RUNS);
            let mut rv = 0;
            for _ in 0..TEST_RUNS {
                let entries: Vec<(XdpNextHopKey, XdpNextHopValue)> =
                    if cache == Cache::Used { Vec::new() } else { nexthops.iter().flatten().collect() };
                for (k, mut v) in entries {
                    if cache == Cache::Absent {
                        nexthops.remove(&k)?;
                    } else {
                        // Checked at boot: older than any TTL.
                        v.checked_s = 0;
                        nexthops.insert(k, v, 0)?;
                    }
                }
                let r = proxy_test_support::prog_test_run::run(fd, &frame, &mut out, 1)?;
                d.push(f64::from(r.duration_ns));
                rv = r.retval;
            }
            Ok((spread(&d).median, rv))
        };
        // The first run sets the flow up (new_flow); the rest are tracked.
        one(ours, Cache::Used)?;
        let mut runs = TestRuns::default();
        for _ in 0..repeats.max(1) {
            let (x, v) = one(ours, Cache::Used)?;
            runs.cached.push(x);
            runs.verdict = v;
            runs.stale.push(one(ours, Cache::Stale)?.0);
            runs.uncached.push(one(ours, Cache::Absent)?.0);
            runs.minimal.push(one(minimal, Cache::Used)?.0);
        }
        Ok(runs)
    })??;
    Ok(runs)
}

/// What each test run finds in the next-hop cache: the flow's fresh entry
/// (what the last run left), its entry checked too long ago (the lookup
/// confirms it and refreshes it in place), or none (the lookup's answer is
/// inserted: a flow's first packet, or a changed next hop).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Cache {
    Used,
    Stale,
    Absent,
}

/// BPF_PROG_TEST_RUN medians (ns) per repeat: our program with the flow's
/// next hop cached (`cached`), stale (`stale`) and absent (`uncached`),
/// the minimal program, and our program's verdict.
#[derive(Default)]
struct TestRuns {
    cached: Vec<f64>,
    stale: Vec<f64>,
    uncached: Vec<f64>,
    minimal: Vec<f64>,
    verdict: i32,
}

/// `median ns (min–max)`.
fn ns_spread(v: &[f64]) -> String {
    let s = spread(v);
    format!("{:.0} ns ({:.0}–{:.0})", s.median, s.min, s.max)
}

/// Sends `frame` from `cl0` for `dur` with `bench_tx_xdp` in live-frames
/// mode, in the calling thread's namespace; returns how many frames the
/// generator ran on.
fn xdp_gen_flood(gen_fd: i32, frame: &[u8], dur: Duration) -> std::io::Result<u64> {
    const CHUNK: u32 = 1 << 16;
    let ifindex = device_index("cl0")?;
    let t = Instant::now();
    let mut sent = 0u64;
    while t.elapsed() < dur {
        proxy_test_support::prog_test_run::xdp_live_frames(gen_fd, frame, ifindex, CHUNK)?;
        sent += u64::from(CHUNK);
    }
    Ok(sent)
}

/// Forwarded packets per second, counted at the backend's veth end, for
/// one flood of `dur` by `generator` in world `w`; and the generator's own
/// rate. With `perf` (a file name), a system-wide CPU profile with call
/// graphs of the flood is kept there.
fn flood(w: &World, generator: &str, txgen: &mut Generator, dur: Duration, perf: Option<&Path>) -> Result<(f64, f64)> {
    let gen_fd = txgen.fd;
    let dst = parse_mac(&mac_of(&w.node, "nd0")?);
    let src = parse_mac(&mac_of(&w.client, "cl0")?);
    let frame = udp_frame(dst, src, Ipv4Addr::new(10, 0, 1, 1), NODE, NODE_PORT);
    let xdp_gen = generator == "xdp-gen";
    if xdp_gen {
        txgen.set_frame(&frame)?;
    }
    in_netns(&w.node, move || ethtool_set("nd0", ETHTOOL_SGRO, u32::from(xdp_gen)))?.context("GRO on nd0")?;
    let send = move |f: Vec<u8>, d: Duration| {
        in_netns(&w.client, move || if xdp_gen { xdp_gen_flood(gen_fd, &f, d) } else { raw_flood("cl0", &f, d) })
    };
    // Warm-up: the flow's first packet (conntrack set-up).
    send(frame.clone(), Duration::from_millis(50))??;
    std::thread::sleep(Duration::from_millis(50));
    let profile = perf.map(|out| Profile::start(out, dur)).transpose()?;
    let before = rx_packets(&w.backend, "pd0")?;
    let t = Instant::now();
    let n = send(frame, dur)??;
    let secs = t.elapsed().as_secs_f64();
    if let Some(p) = profile {
        p.finish()?;
    }
    std::thread::sleep(Duration::from_millis(100));
    let got = rx_packets(&w.backend, "pd0")? - before;
    Ok((got as f64 / secs, n as f64 / secs))
}

/// `perf record` of every CPU (the software clock: the VM has no hardware
/// counters) for the length of one flood, started just before it.
struct Profile(std::process::Child);

impl Profile {
    fn start(out: &Path, dur: Duration) -> Result<Profile> {
        let child = std::process::Command::new("perf")
            .args(["record", "-q", "-e", "cpu-clock", "-F", "4999", "-a", "-g", "-o"])
            .arg(out)
            .args(["--", "sleep", &format!("{:.3}", dur.as_secs_f64())])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .spawn()
            .context("starting perf record (is perf installed?)")?;
        // perf needs a moment to open its events on every CPU.
        std::thread::sleep(Duration::from_millis(300));
        Ok(Profile(child))
    }

    fn finish(mut self) -> Result<()> {
        let st = self.0.wait()?;
        if !st.success() {
            bail!("perf record failed: {st}");
        }
        Ok(())
    }
}

/// `rounds` NodePort TCP requests (connect, one byte there and back,
/// close; one after the other from one client thread) through world `w`:
/// each request's latency in ns, sorted, and how many failed. The node's
/// client-facing veth takes the plain `veth_xmit` path (no GRO), as in
/// the `af_packet` floods.
fn tcp_requests(w: &World, rounds: usize) -> Result<(Vec<u64>, usize)> {
    in_netns(&w.node, || ethtool_set("nd0", ETHTOOL_SGRO, 0))?.context("GRO off on nd0")?;
    let to = SocketAddr::new(IpAddr::V4(NODE), NODE_PORT);
    let (mut lat, failed) = workload::measure(&w.client.path(), &[to], Proto::Tcp, rounds)?;
    lat.sort_unstable();
    Ok((lat, failed))
}

/// `bench_tx_xdp`, loaded (not attached), for the live-frames generator;
/// and the sink, `bench_drop_xdp`, which every world attaches to `pd0`.
struct Generator {
    ebpf: aya::Ebpf,
    fd: i32,
    pins: PinDir,
}

impl Generator {
    fn load() -> Result<Self> {
        let pins = PinDir::new("tpbx")?;
        let mut ebpf = xdp_loader::load_unattached(pins.path())?;
        let p: &mut aya::programs::Xdp = ebpf.program_mut("bench_tx_xdp").context("bench_tx_xdp missing")?.try_into()?;
        p.load()?;
        let fd = p.fd()?.as_fd().as_raw_fd();
        let sink: &mut aya::programs::Xdp = ebpf.program_mut("bench_drop_xdp").context("bench_drop_xdp missing")?.try_into()?;
        sink.load()?;
        Ok(Self { ebpf, fd, pins })
    }

    /// Attaches the sink to `pd0` in `backend`, pinned as
    /// `bench-sink-VARIANT`: it goes with `pd0` when the namespace does, or
    /// with the pin directory.
    fn attach_sink(&mut self, backend: &Netns, variant: &str) -> Result<()> {
        let sink: &mut aya::programs::Xdp = self.ebpf.program_mut("bench_drop_xdp").context("bench_drop_xdp missing")?.try_into()?;
        attach_pinned(self.pins.path(), backend, &format!("bench-sink-{variant}"), || {
            let id = sink.attach("pd0", aya::programs::XdpMode::Driver)?;
            Ok(sink.take_link(id)?.try_into()?)
        })
        .context("the XDP sink on pd0")
    }

    /// Attaches `bench_redirect_tc` to `nd0`'s ingress in `node`, sending
    /// every frame to `nd1` (the `tc-floor` world), pinned as the sink is.
    fn attach_floor(&mut self, node: &Netns) -> Result<()> {
        let to = in_netns(node, || device_index("nd1"))??;
        let mut m: aya::maps::Array<_, u32> = self.ebpf.map_mut("BENCH_REDIRECT_TO").context("BENCH_REDIRECT_TO missing")?.try_into()?;
        m.set(0, to, 0)?;
        let prog: &mut aya::programs::SchedClassifier =
            self.ebpf.program_mut("bench_redirect_tc").context("bench_redirect_tc missing")?.try_into()?;
        if prog.fd().is_err() {
            prog.load()?;
        }
        attach_pinned(self.pins.path(), node, "bench-floor", || {
            let id = prog.attach("nd0", aya::programs::TcAttachType::Ingress)?;
            Ok(prog.take_link(id)?.try_into()?)
        })
        .context("bench_redirect_tc on nd0")
    }

    /// The 64-byte frame the program writes on every run.
    fn set_frame(&mut self, frame: &[u8]) -> Result<()> {
        let mut words = [0u64; 8];
        for (w, c) in words.iter_mut().zip(frame.chunks(8)) {
            let mut b = [0u8; 8];
            b[..c.len()].copy_from_slice(c);
            *w = u64::from_ne_bytes(b);
        }
        let mut m: aya::maps::Array<_, [u64; 8]> = self.ebpf.map_mut("BENCH_TX_FRAME").context("BENCH_TX_FRAME missing")?.try_into()?;
        m.set(0, words, 0)?;
        Ok(())
    }
}

/// Runs `attach` on a thread that has joined `ns` and pins the link it
/// returns as `name` in the links directory of `pins` (whose reset unpins
/// it). The thread enters the namespace by hand, scoped so that `attach`
/// may borrow a loaded program: `ip -n` cannot attach a pinned program, as
/// it mounts a fresh sysfs without bpffs.
fn attach_pinned(pins: &Path, ns: &Netns, name: &str, attach: impl FnOnce() -> Result<aya::programs::links::FdLink> + Send) -> Result<()> {
    let links = proxy_agent::datapath::pins::links(pins);
    std::fs::create_dir_all(&links)?;
    let link_pin = links.join(name);
    let ns = std::fs::File::open(ns.path())?;
    std::thread::scope(|s| {
        s.spawn(|| -> Result<()> {
            // SAFETY: a namespace fd, for this thread only; it ends right
            // after.
            if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(std::io::Error::last_os_error().into());
            }
            attach()?.pin(&link_pin)?;
            Ok(())
        })
        .join()
        .map_err(|_| anyhow::anyhow!("the thread attaching {name} panicked"))?
    })
}

pub(crate) fn run(repeats: usize, rounds: usize, opts: &Options) -> Result<Section> {
    crate::step("XDP: BPF_PROG_TEST_RUN of xdp_nodeport against bench_minimal_xdp");
    let runs = test_run(repeats)?;
    let (ours, stale, uncached, minimal, verdict) = (&runs.cached, &runs.stale, &runs.uncached, &runs.minimal, runs.verdict);
    crate::step("XDP: building five veth paths (xdp, tc-fast, tc, iptables, tc-floor)");
    let mut txgen = Generator::load()?;
    let stop = Arc::new(AtomicBool::new(false));
    let worlds: Vec<World> = VARIANTS.iter().map(|v| world(v, &mut txgen, &stop)).collect::<Result<_>>()?;
    if let Some(dir) = &opts.perf {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    // pps[g][v], sent[g][v]: one sample per repeat. Generators and
    // variants are interleaved within each repeat, so that a slow spell
    // of the VM hits every cell alike. p50[v], p99[v]: the TCP requests'.
    let mut pps = vec![vec![Vec::new(); VARIANTS.len()]; GENERATORS.len()];
    let mut sent = pps.clone();
    let mut p50 = vec![Vec::new(); VARIANTS.len()];
    let mut p99 = p50.clone();
    let mut failed = vec![0usize; VARIANTS.len()];
    let r = repeats.max(1);
    for rep in 0..r {
        crate::step(&format!("XDP: flood repeat {}/{r}", rep + 1));
        for (g, generator) in GENERATORS.iter().enumerate() {
            for (i, w) in worlds.iter().enumerate() {
                let perf = opts.perf.as_ref().filter(|_| rep == 0).map(|d| d.join(format!("{generator}-{}.data", VARIANTS[i])));
                let (p, s) = flood(w, generator, &mut txgen, opts.flood, perf.as_deref())?;
                pps[g][i].push(p);
                sent[g][i].push(s);
            }
        }
    }
    // What the fast path did in its world over every flood: proof that the
    // `tc-fast` row measured it, not the stack.
    let fast_counts = worlds
        .iter()
        .zip(VARIANTS)
        .find(|(_, v)| *v == "tc-fast")
        .and_then(|(w, _)| w.pins.as_ref())
        .map(|p| proxy_agent::datapath::dump::np_fast_counters(p.path()))
        .transpose()?
        .unwrap_or_default();
    let fast_line = fast_counts
        .iter()
        .filter(|(k, v)| **v > 0 && !k.starts_with("reserved"))
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(", ");
    // The TCP requests after the floods (whose fast-path counts are read
    // above), variants interleaved in each repeat.
    for rep in 0..r {
        crate::step(&format!("XDP: TCP requests repeat {}/{r}", rep + 1));
        for (i, w) in worlds.iter().enumerate() {
            // The floor translates nothing: no request could arrive.
            if VARIANTS[i] == "tc-floor" {
                continue;
            }
            let (lat, f) = tcp_requests(w, rounds)?;
            p50[i].push(percentile(&lat, 0.5));
            p99[i].push(percentile(&lat, 0.99));
            failed[i] += f;
        }
    }
    // Why a BPF variant's request failed, from its counters: a new flow
    // that found no free SNAT port in its tries is dropped (`snat_failed`),
    // and its client's SYN retransmits after a second.
    let snat_failed: Vec<Option<u64>> = worlds
        .iter()
        .map(|w| {
            w.pins
                .as_ref()
                .and_then(|p| proxy_agent::datapath::dump::np_counters(p.path()).ok())
                .and_then(|c| c.get("snat_failed").copied())
        })
        .collect();
    // The echo servers' threads end with the flag (the TCP listener's on
    // its next connection, or with the process).
    stop.store(true, Ordering::Relaxed);
    let med = |v: &[f64]| spread(v).median;
    let mut md = format!(
        "## NodePort at XDP\n\nBPF_PROG_TEST_RUN, one run per call, median of {TEST_RUNS} calls per repeat, {r} repeats: `xdp_nodeport` on a tracked UDP flow to a remote backend (forward and SNAT entries, the next hop, rewrite, `bpf_redirect`; verdict {verdict}, 4 = XDP_REDIRECT) {} with the flow's next hop cached (`XDP_NEXTHOP`: every packet but a flow's first of each second), {} with it stale (`bpf_fib_lookup` to a resolved neighbour confirms it, refreshed in place: a flow's first packet of each second), {} without it (the lookup's answer inserted: a flow's first packet, or a changed next hop), `bench_minimal_xdp` (returns XDP_PASS) {}; the differences, {:.0}, {:.0} and {:.0} ns, are the program's own per-packet cost (the stale and absent runs also meet the entry's memory cold, as the syscall that prepared them replaced or freed it).\n\nForwarding through veth, client -> node -> remote backend (DNAT + SNAT), one UDP flow of 64-byte frames for {:.1} s per repeat, counted at the backend's veth end, where an XDP program drops them (the backend's stack would cost as much as the node in every variant); the whole path runs on the generator's CPU. Generators: `xdp-gen` sends each frame with XDP_TX from BPF_PROG_TEST_RUN in live-frames mode, so the node's veth receives `xdp_frame`s as from a NIC (no skb until something needs one); `af_packet` sends skbs from an AF_PACKET socket (`PACKET_QDISC_BYPASS`), which veth must copy into an XDP buffer before an XDP program sees them, a cost no NIC driver has. Variants: `xdp`, our XDP program in front of TC on the node's veths; `tc-fast`, the TC programs alone with the fast path (`--tc-fast-path auto`, the default: translated at ingress, `bpf_fib_lookup` through the shared next-hop cache, `bpf_redirect`); `tc`, the TC programs alone without it (`off`: the stack routes and forwards); `iptables`, one DNAT rule in PREROUTING plus MASQUERADE (iptables-legacy); `tc-floor`, no NodePort at all: `bench_redirect_tc` at `nd0`'s ingress sends every frame to `nd1` with `bpf_redirect`, unparsed and untranslated, and no program runs at `nd1`'s egress, the least any TC forwarding path pays (the skb's build, GRO, `dev_queue_xmit`, the veth, the sink). Median (min–max) over {r} repeats, generators and variants interleaved.\n\n| generator | variant | forwarded (pkt/s) | sent (pkt/s) |\n|---|---|---|---|\n",
        ns_spread(ours),
        ns_spread(stale),
        ns_spread(uncached),
        ns_spread(minimal),
        med(ours) - med(minimal),
        med(stale) - med(minimal),
        med(uncached) - med(minimal),
        opts.flood.as_secs_f64(),
    );
    let mut rows = Vec::new();
    for (g, generator) in GENERATORS.iter().enumerate() {
        for (i, v) in VARIANTS.iter().enumerate() {
            let (p, s) = (spread(&pps[g][i]), spread(&sent[g][i]));
            let _ = writeln!(
                md,
                "| {generator} | {v} | {:.0} ({:.0}–{:.0}) | {:.0} ({:.0}–{:.0}) |",
                p.median, p.min, p.max, s.median, s.min, s.max
            );
            rows.push(json!({"generator": generator, "variant": v, "forwarded_per_s": p.json(), "sent_per_s": s.json()}));
        }
    }
    let _ = writeln!(md, "\nThe `tc-fast` world's fast-path counters after every flood: {fast_line}.");
    let _ = writeln!(
        md,
        "\nNodePort TCP requests through the same four nodes: connect, one byte to the backend's echo server and back, close, {rounds} one after the other from one client thread per repeat (every request a new flow: its SYN takes each variant's new-flow path). Latency from connect() to the echoed byte; median (min–max) over {r} repeats of each repeat's p50 and p99, variants interleaved.\n\n| variant | p50 | p99 | failed | snat_failed (floods included) |\n|---|---|---|---|---|"
    );
    let us = |v: &[f64]| {
        let s = spread(v);
        format!("{:.1} µs ({:.1}–{:.1})", s.median / 1e3, s.min / 1e3, s.max / 1e3)
    };
    let mut tcp_rows = Vec::new();
    for (i, v) in VARIANTS.iter().enumerate().filter(|(_, v)| **v != "tc-floor") {
        let snat = snat_failed[i].map_or_else(|| "-".to_string(), |n| n.to_string());
        let _ = writeln!(md, "| {v} | {} | {} | {} | {snat} |", us(&p50[i]), us(&p99[i]), failed[i]);
        tcp_rows.push(json!({"variant": v, "p50_ns": spread(&p50[i]).json(), "p99_ns": spread(&p99[i]).json(), "failed": failed[i], "snat_failed": snat_failed[i]}));
    }
    let at = |v: &str| VARIANTS.iter().position(|x| *x == v).unwrap_or(0);
    let (xdp, fast, tc, ipt, floor) = (at("xdp"), at("tc-fast"), at("tc"), at("iptables"), at("tc-floor"));
    let ratio = |g: usize, one: usize, other: usize| med(&pps[g][one]) / med(&pps[g][other]);
    let _ = writeln!(
        md,
        "\nXDP / TC forwarded: {:.2} with `xdp-gen`, {:.2} with `af_packet`; XDP / iptables: {:.2} and {:.2}; TC fast path / iptables: {:.2} and {:.2}; TC fast path / TC: {:.2} and {:.2}; TC floor / iptables: {:.2} and {:.2}; TC fast path / TC floor: {:.2} and {:.2}. From the `xdp-gen` medians: the floor takes {:.0} ns a packet and the fast path {:.0} ns more; 1.5x iptables means {:.0} ns a packet, which leaves {:.0} ns above the floor for everything the fast path does (parse, conntrack, translation, next hop, the output device's egress program).\n",
        ratio(0, xdp, tc),
        ratio(1, xdp, tc),
        ratio(0, xdp, ipt),
        ratio(1, xdp, ipt),
        ratio(0, fast, ipt),
        ratio(1, fast, ipt),
        ratio(0, fast, tc),
        ratio(1, fast, tc),
        ratio(0, floor, ipt),
        ratio(1, floor, ipt),
        ratio(0, fast, floor),
        ratio(1, fast, floor),
        1e9 / med(&pps[0][floor]),
        1e9 / med(&pps[0][fast]) - 1e9 / med(&pps[0][floor]),
        1e9 / (1.5 * med(&pps[0][ipt])),
        1e9 / (1.5 * med(&pps[0][ipt])) - 1e9 / med(&pps[0][floor]),
    );
    let target = ratio(0, xdp, tc);
    let (fast_vs_ipt, xdp_vs_ipt) = (ratio(0, fast, ipt), ratio(0, xdp, ipt));
    let targets = vec![
        Target {
            name: "XDP NodePort forwarding rate vs TC (veth, XDP live-frames generator)".into(),
            goal: ">= 2x".into(),
            measured: format!("{target:.2}x"),
            met: Some(target >= 2.0),
        },
        Target {
            name: "TC fast path NodePort forwarding rate vs iptables (veth, XDP live-frames generator)".into(),
            goal: ">= 1.5x".into(),
            measured: format!("{fast_vs_ipt:.2}x"),
            met: Some(fast_vs_ipt >= 1.5),
        },
        Target {
            name: "XDP NodePort forwarding rate vs iptables (veth, XDP live-frames generator)".into(),
            goal: ">= 2x".into(),
            measured: format!("{xdp_vs_ipt:.2}x"),
            met: Some(xdp_vs_ipt >= 2.0),
        },
    ];
    let json = json!({
        "test_run_ns": {"xdp_nodeport": spread(ours).json(), "xdp_nodeport_stale": spread(stale).json(), "xdp_nodeport_uncached": spread(uncached).json(), "bench_minimal_xdp": spread(minimal).json(), "verdict": verdict},
        "veth": rows,
        "tcp_requests": tcp_rows,
        "ratio_xdp_vs_tc": target,
        "ratio_xdp_vs_tc_af_packet": ratio(1, xdp, tc),
        "ratio_tc_fast_vs_iptables": fast_vs_ipt,
        "ratio_tc_fast_vs_iptables_af_packet": ratio(1, fast, ipt),
        "ratio_xdp_vs_iptables": xdp_vs_ipt,
        "ratio_tc_fast_vs_tc": ratio(0, fast, tc),
        "ratio_tc_floor_vs_iptables": ratio(0, floor, ipt),
        "ratio_tc_fast_vs_tc_floor": ratio(0, fast, floor),
    });
    Ok(Section { key: "xdp", markdown: md, json, svgs: Vec::new(), targets })
}
