//! Connection tracking of the TC datapath over time: the programs keep
//! `seen_s` fresh and follow TCP's FIN/RST (under BPF_PROG_TEST_RUN, on
//! the real verifier-checked programs), the agent's conntrack GC deletes
//! whole flows once idle past their timeout or once their backend is gone,
//! and a running agent sweeps by itself and exports the TC counters in
//! /metrics.
//!
//! Nothing here attaches a TC program: the programs are loaded unattached
//! and run on frames built in memory, and the agent runs with
//! `--devices none` (as every agent of tests/support does).

mod support;

use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::{AsFd, AsRawFd};
use std::path::Path;

use aya::maps::{HashMap, Map, MapData};
use proxy_agent::datapath::conntrack_gc::{self, Timeouts};
use proxy_agent::datapath::tc_loader;
use proxy_agent::decide::decision::ExternalState;
use proxy_agent::external::nodeport::NodePortWriter;
use proxy_agent::model::{Backend, Frontend, Protocol};
use proxy_common as pc;
use proxy_common::{CtKey, CtValue};
use proxy_test_support::http::{http_get, metric};
use proxy_test_support::sandbox::PinDir;
use proxy_test_support::wait::eventually;
use support::*;

const PASS: i32 = -1; // TC_ACT_UNSPEC
const CLIENT: [u8; 4] = [10, 0, 1, 1];
const NODE: [u8; 4] = [10, 0, 1, 2];
const SNAT: [u8; 4] = [10, 0, 3, 1];

/// BPF_PROG_TEST_RUN of `prog_fd` on `frame`: (return value, frame after).
fn run(prog_fd: i32, frame: &[u8]) -> (i32, Vec<u8>) {
    let mut out = vec![0u8; frame.len() + 128];
    let r = proxy_test_support::prog_test_run::run(prog_fd, frame, &mut out, 1).expect("BPF_PROG_TEST_RUN");
    out.truncate(r.out_len);
    (r.retval, out)
}

/// Ethernet + IPv4 (header checksum filled in) + `l4`. The L4 checksums are
/// left at zero: these tests look at conntrack state, and the programs
/// update checksums incrementally without verifying them.
fn ipv4(proto: u8, src: [u8; 4], dst: [u8; 4], frag: u16, l4: &[u8]) -> Vec<u8> {
    let mut f = vec![0x02, 0, 0, 0, 0, 1, 0x02, 0, 0, 0, 0, 2, 0x08, 0x00];
    let mut ip = vec![0x45, 0];
    ip.extend_from_slice(&((20 + l4.len()) as u16).to_be_bytes());
    ip.extend_from_slice(&[0, 1]);
    ip.extend_from_slice(&frag.to_be_bytes());
    ip.extend_from_slice(&[64, proto, 0, 0]);
    ip.extend_from_slice(&src);
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

fn tcp(src: [u8; 4], sport: u16, dst: [u8; 4], dport: u16, flags: u8) -> Vec<u8> {
    let mut t = Vec::new();
    t.extend_from_slice(&sport.to_be_bytes());
    t.extend_from_slice(&dport.to_be_bytes());
    t.extend_from_slice(&[0, 0, 0, 1, 0, 0, 0, 1, 0x50, flags, 0xff, 0xff, 0, 0, 0, 0]);
    ipv4(6, src, dst, 0, &t)
}

fn udp(src: [u8; 4], sport: u16, dst: [u8; 4], dport: u16) -> Vec<u8> {
    let mut u = Vec::new();
    u.extend_from_slice(&sport.to_be_bytes());
    u.extend_from_slice(&dport.to_be_bytes());
    u.extend_from_slice(&[0, 12, 0, 0]);
    u.extend_from_slice(b"ping");
    ipv4(17, src, dst, 0, &u)
}

const SYN: u8 = 0x02;
const ACK: u8 = 0x10;
const FIN_ACK: u8 = 0x11;
const RST_ACK: u8 = 0x14;

fn ip_be(a: [u8; 4]) -> [u32; 4] {
    [u32::from_ne_bytes(a), 0, 0, 0]
}

fn key(proto: u8, s: ([u8; 4], u16), d: ([u8; 4], u16), dir: u8) -> CtKey {
    CtKey {
        saddr_be: ip_be(s.0),
        daddr_be: ip_be(d.0),
        sport_be: s.1.to_be(),
        dport_be: d.1.to_be(),
        proto,
        family: pc::FAMILY_V4,
        dir,
        _pad: 0,
    }
}

fn ct(pins: &Path) -> HashMap<MapData, CtKey, CtValue> {
    let data = MapData::from_pin(pins.join(pc::NP_CT_MAP)).expect("open NP_CT");
    HashMap::try_from(Map::LruHashMap(data)).expect("NP_CT is an LRU hash")
}

fn entries(pins: &Path) -> Vec<(CtKey, CtValue)> {
    ct(pins).iter().filter_map(Result::ok).collect()
}

fn entry(pins: &Path, k: &CtKey) -> CtValue {
    ct(pins).get(k, 0).unwrap_or_else(|e| panic!("no NP_CT entry {k:?}: {e}"))
}

/// Sets `seen_s` of the given entries to `now - age`, as if the flow had
/// been idle that long.
fn age(pins: &Path, keys: &[CtKey], age: u32) {
    let now = conntrack_gc::monotonic_now_s().expect("clock");
    let mut map = ct(pins);
    for k in keys {
        let mut v = map.get(k, 0).expect("entry to age");
        v.seen_s = now - age;
        map.insert(k, v, 0).expect("rewrite entry");
    }
}

fn fe(ip: [u8; 4], port: u16, protocol: Protocol) -> Frontend {
    Frontend { ip: IpAddr::V4(Ipv4Addr::from(ip)), port, protocol }
}

fn be(ip: [u8; 4], port: u16) -> Backend {
    Backend { ip: IpAddr::V4(Ipv4Addr::from(ip)), port }
}

struct Loaded {
    _ebpf: aya::Ebpf,
    ingress: i32,
    egress: i32,
    writer: NodePortWriter,
    pins: PinDir,
}

impl Loaded {
    /// The TC programs loaded (not attached) on fresh pins, with `tc`
    /// programmed; addresses in `local` are this node's endpoints.
    fn new(tc: &[(Frontend, Vec<Backend>)], local: &[[u8; 4]], snat_ports: (u16, u16)) -> Loaded {
        require_root();
        let pins = PinDir::new("tnpct").expect("pins");
        let mut ebpf = proxy_agent::datapath::tc_loader::load_unattached(pins.path()).expect("load the TC programs");
        let mut fd = |name: &str| {
            let prog: &mut aya::programs::SchedClassifier = ebpf.program_mut(name).expect(name).try_into().expect("classifier");
            prog.fd().expect("fd").as_fd().as_raw_fd()
        };
        let (ingress, egress) =
            (fd(&tc_loader::loaded_name(tc_loader::INGRESS_PROGRAM)), fd(&tc_loader::loaded_name(tc_loader::EGRESS_PROGRAM)));
        let mut writer = NodePortWriter::open(pins.path()).expect("open the TC maps");
        writer.set_config(Some(Ipv4Addr::from(SNAT)), None, snat_ports).expect("config");
        let mut l = Loaded { _ebpf: ebpf, ingress, egress, writer, pins };
        l.program(tc, local);
        l
    }

    fn program(&mut self, tc: &[(Frontend, Vec<Backend>)], local: &[[u8; 4]]) {
        let ext = ExternalState {
            tc: tc.iter().map(|(f, b)| (*f, b.iter().copied().collect())).collect(),
            local_endpoints: local.iter().map(|a| IpAddr::V4(Ipv4Addr::from(*a))).collect(),
            ..Default::default()
        };
        let o = self.writer.sync(&ext);
        assert!(o.failures.is_empty(), "{:?}", o.failures);
    }

    fn path(&self) -> &Path {
        self.pins.path()
    }

    /// A client packet through ingress and then egress, as a forwarded
    /// packet passes the node.
    fn client_packet(&self, frame: &[u8]) -> Vec<u8> {
        let (rc, out) = run(self.ingress, frame);
        assert_eq!(rc, PASS);
        let (rc, out) = run(self.egress, &out);
        assert_eq!(rc, PASS);
        out
    }

    fn counter(&self, name: &str) -> u64 {
        proxy_agent::datapath::dump::np_counters(self.path()).expect("counters")[name]
    }
}

fn snat_port(out: &[u8]) -> u16 {
    u16::from_be_bytes([out[34], out[35]])
}

/// The four entries of a flow to a remote backend.
fn remote_keys(proto: u8, client: u16, frontend: u16, backend: ([u8; 4], u16), snat_port: u16) -> [CtKey; 4] {
    [
        key(proto, (CLIENT, client), (NODE, frontend), pc::CT_DIR_FORWARD),
        key(proto, (CLIENT, client), backend, pc::CT_DIR_SNAT),
        key(proto, backend, (SNAT, snat_port), pc::CT_DIR_REPLY_SNAT),
        key(proto, backend, (CLIENT, client), pc::CT_DIR_REPLY),
    ]
}

#[test]
fn fin_from_both_sides_or_one_rst_marks_every_entry_of_the_flow_closing() {
    let local_be = ([10, 244, 1, 1], 8080);
    let remote_be = ([10, 244, 2, 1], 8080);
    let l = Loaded::new(
        &[
            (fe(NODE, 30080, Protocol::Tcp), vec![be(local_be.0, local_be.1)]),
            (fe(NODE, 30081, Protocol::Tcp), vec![be(remote_be.0, remote_be.1)]),
        ],
        &[local_be.0],
        (61000, 65535),
    );
    let tcp_ = pc::PROTO_TCP;

    // A flow to a local backend: forward entry (ingress) and reply entry
    // (egress).
    l.client_packet(&tcp(CLIENT, 40000, NODE, 30080, SYN));
    let fwd = key(tcp_, (CLIENT, 40000), (NODE, 30080), pc::CT_DIR_FORWARD);
    let rev = key(tcp_, local_be, (CLIENT, 40000), pc::CT_DIR_REPLY);
    assert_eq!((entry(l.path(), &fwd).flags, entry(l.path(), &rev).flags), (0, 0));
    // The client half-closes: both entries know, the flow is not closing
    // (the backend may go on sending).
    let (rc, _) = run(l.ingress, &tcp(CLIENT, 40000, NODE, 30080, FIN_ACK));
    assert_eq!(rc, PASS);
    assert_eq!(entry(l.path(), &fwd).flags, pc::CT_FLAG_FIN_CLIENT);
    assert_eq!(entry(l.path(), &rev).flags, pc::CT_FLAG_FIN_CLIENT, "marked on the other direction's entry too");
    // The backend's FIN (leaving towards the client at egress) closes it.
    let (rc, out) = run(l.egress, &tcp(local_be.0, local_be.1, CLIENT, 40000, FIN_ACK));
    assert_eq!(rc, PASS);
    assert_eq!(&out[26..30], &NODE, "the reply still leaves from the frontend");
    let both = pc::CT_FLAG_FIN_CLIENT | pc::CT_FLAG_FIN_BACKEND | pc::CT_FLAG_CLOSING;
    assert_eq!(entry(l.path(), &rev).flags, both | pc::CT_FLAG_REPLIED, "the backend's packet marks its own leg replied");
    assert_eq!(entry(l.path(), &fwd).flags, both);
    // The last ACK still goes through (a closing flow is translated until
    // it times out).
    let (_, out) = run(l.ingress, &tcp(CLIENT, 40000, NODE, 30080, ACK));
    assert_eq!(&out[30..34], &local_be.0);

    // A flow to a remote backend (four entries), reset by the backend.
    let out = l.client_packet(&tcp(CLIENT, 40001, NODE, 30081, SYN));
    let port = snat_port(&out);
    let keys = remote_keys(tcp_, 40001, 30081, remote_be, port);
    for k in &keys {
        assert_eq!(entry(l.path(), k).flags & pc::CT_FLAG_CLOSING, 0);
    }
    let (rc, back) = run(l.ingress, &tcp(remote_be.0, remote_be.1, SNAT, port, RST_ACK));
    assert_eq!(rc, PASS);
    assert_eq!(&back[30..34], &CLIENT);
    let (rc, back) = run(l.egress, &back);
    assert_eq!(rc, PASS);
    assert_eq!(&back[26..30], &NODE);
    for k in &keys {
        let v = entry(l.path(), k);
        assert_eq!(v.flags & pc::CT_FLAG_CLOSING, pc::CT_FLAG_CLOSING, "dir {}: {v:?}", k.dir);
        assert_eq!(v.flags & pc::CT_FLAG_SNAT == 0, k.dir == pc::CT_DIR_REPLY, "dir {}", k.dir);
    }
    // Closing flows expire after 10 s, established ones after 6 h.
    let now = conntrack_gc::monotonic_now_s().expect("clock");
    let v = entry(l.path(), &keys[0]);
    assert!(!conntrack_gc::expired(tcp_, &v, now, &Timeouts::default()));
    assert!(conntrack_gc::expired(tcp_, &v, now + 11, &Timeouts::default()));
}

#[test]
fn packets_of_either_direction_keep_seen_s_fresh() {
    let backend = ([10, 244, 2, 1], 5353);
    let l = Loaded::new(&[(fe(NODE, 30053, Protocol::Udp), vec![be(backend.0, backend.1)])], &[], (61000, 65535));
    let out = l.client_packet(&udp(CLIENT, 40000, NODE, 30053));
    let keys = remote_keys(pc::PROTO_UDP, 40000, 30053, backend, snat_port(&out));
    let [fwd, snat, reply_snat, reply] = keys;
    age(l.path(), &keys, 30);
    let now = conntrack_gc::monotonic_now_s().expect("clock");
    let fresh = |k: &CtKey| now.saturating_sub(entry(l.path(), k).seen_s) <= 1;
    assert!(keys.iter().all(|k| !fresh(k)));
    let replied = |k: &CtKey| entry(l.path(), k).flags & pc::CT_FLAG_REPLIED != 0;
    assert!(!keys.iter().any(replied), "no answer yet");

    // The client sends: its legs (ingress forward, egress SNAT) are refreshed.
    l.client_packet(&udp(CLIENT, 40000, NODE, 30053));
    assert!(fresh(&fwd) && fresh(&snat), "client legs refreshed");
    assert!(!fresh(&reply_snat) && !fresh(&reply), "reply legs untouched");
    // The backend answers: the reply legs are refreshed.
    let (_, back) = run(l.ingress, &udp(backend.0, backend.1, SNAT, snat_port(&out)));
    run(l.egress, &back);
    assert!(keys.iter().all(fresh), "every leg refreshed");
    assert!(replied(&reply_snat) && replied(&reply), "the answer marks the reply legs");
    assert!(!replied(&fwd) && !replied(&snat), "client legs stay as they were");
    // Every packet after the first one's ingress matched an entry.
    assert_eq!(l.counter("tracked"), 5);
}

#[test]
fn a_snat_port_stays_reserved_while_the_client_still_sends() {
    // One SNAT port, and a one-way UDP stream: the backend never answers,
    // so only the client's legs are fresh.
    let backend = ([10, 244, 2, 1], 5353);
    let l = Loaded::new(&[(fe(NODE, 30053, Protocol::Udp), vec![be(backend.0, backend.1)])], &[], (61000, 61000));
    let out = l.client_packet(&udp(CLIENT, 40000, NODE, 30053));
    assert_eq!(snat_port(&out), 61000);
    let keys = remote_keys(pc::PROTO_UDP, 40000, 30053, backend, 61000);
    age(l.path(), &keys[2..], 100); // reply legs: older than the UDP timeout
    let second = udp(CLIENT, 40001, NODE, 30053);
    assert_eq!(run(l.ingress, &second), (PASS, second.clone()), "port still in use: passed untranslated");
    assert_eq!(l.counter("snat_failed"), 1);
    // Once the client has been silent that long too, the port is free.
    age(l.path(), &keys[..2], 100);
    let out = l.client_packet(&second);
    assert_eq!((&out[26..30], snat_port(&out)), (&SNAT[..], 61000), "port taken over");
}

#[test]
fn the_gc_deletes_idle_and_stale_flows_whole_and_keeps_the_rest() {
    let idle_be = ([10, 244, 2, 1], 5353);
    let busy_be = ([10, 244, 2, 2], 5353);
    let gone_be = ([10, 244, 1, 1], 8080);
    let kept_be = ([10, 244, 1, 4], 8080);
    let moved_be = ([10, 244, 1, 6], 8080);
    let (idle_fe, busy_fe, gone_fe, kept_fe) =
        (fe(NODE, 30053, Protocol::Udp), fe(NODE, 30054, Protocol::Udp), fe(NODE, 30080, Protocol::Udp), fe(NODE, 30081, Protocol::Tcp));
    let moved_fe = fe(NODE, 30082, Protocol::Tcp);
    let local = [gone_be.0, kept_be.0, moved_be.0, [10, 244, 1, 5], [10, 244, 1, 9]];
    let mut l = Loaded::new(
        &[
            (idle_fe, vec![be(idle_be.0, idle_be.1)]),
            (busy_fe, vec![be(busy_be.0, busy_be.1)]),
            (gone_fe, vec![be(gone_be.0, gone_be.1)]),
            (kept_fe, vec![be(kept_be.0, kept_be.1)]),
            (moved_fe, vec![be(moved_be.0, moved_be.1)]),
        ],
        &local,
        (61000, 65535),
    );
    let out = l.client_packet(&udp(CLIENT, 40000, NODE, 30053));
    let idle = remote_keys(pc::PROTO_UDP, 40000, 30053, idle_be, snat_port(&out));
    let out = l.client_packet(&udp(CLIENT, 40001, NODE, 30054));
    let busy = remote_keys(pc::PROTO_UDP, 40001, 30054, busy_be, snat_port(&out));
    l.client_packet(&udp(CLIENT, 40002, NODE, 30080));
    let gone = [
        key(pc::PROTO_UDP, (CLIENT, 40002), (NODE, 30080), pc::CT_DIR_FORWARD),
        key(pc::PROTO_UDP, gone_be, (CLIENT, 40002), pc::CT_DIR_REPLY),
    ];
    l.client_packet(&tcp(CLIENT, 40003, NODE, 30081, SYN));
    let kept = [
        key(pc::PROTO_TCP, (CLIENT, 40003), (NODE, 30081), pc::CT_DIR_FORWARD),
        key(pc::PROTO_TCP, kept_be, (CLIENT, 40003), pc::CT_DIR_REPLY),
    ];
    l.client_packet(&tcp(CLIENT, 40004, NODE, 30082, SYN));
    let moved = [
        key(pc::PROTO_TCP, (CLIENT, 40004), (NODE, 30082), pc::CT_DIR_FORWARD),
        key(pc::PROTO_TCP, moved_be, (CLIENT, 40004), pc::CT_DIR_REPLY),
    ];
    assert_eq!(entries(l.path()).len(), 14);

    // UDP idle past 60 s; the busy UDP flow was quiet 50 s on one leg only.
    age(l.path(), &idle, 61);
    age(l.path(), &busy[2..], 50);
    // The UDP frontend's only backend is replaced (its flow is stale); the
    // first TCP one's set grows but keeps its backend; the second TCP one's
    // only backend is replaced, and its connection keeps it all the same,
    // as netfilter's conntrack keeps kube-proxy's DNAT.
    l.program(
        &[
            (idle_fe, vec![be(idle_be.0, idle_be.1)]),
            (busy_fe, vec![be(busy_be.0, busy_be.1)]),
            (gone_fe, vec![be([10, 244, 1, 9], 8080)]),
            (kept_fe, vec![be(kept_be.0, kept_be.1), be([10, 244, 1, 5], 8080)]),
            (moved_fe, vec![be([10, 244, 1, 5], 8080)]),
        ],
        &local,
    );

    let stats = conntrack_gc::sweep(l.path(), &Timeouts::default()).expect("sweep");
    assert_eq!(stats.entries, 14);
    assert_eq!((stats.expired_flows, stats.deleted_expired), (1, 4), "{stats:?}");
    assert_eq!((stats.stale_flows, stats.deleted_stale), (1, 2), "{stats:?}");
    let left: Vec<CtKey> = entries(l.path()).into_iter().map(|(k, _)| k).collect();
    for k in idle.iter().chain(&gone) {
        assert!(!left.contains(k), "deleted: {k:?}");
    }
    for k in busy.iter().chain(&kept).chain(&moved) {
        assert!(left.contains(k), "kept: {k:?}");
    }
    assert_eq!(left.len(), 8);
    // The kept flow still goes to its backend, and so does the connection
    // whose backend left the set.
    let (_, out) = run(l.ingress, &tcp(CLIENT, 40003, NODE, 30081, ACK));
    assert_eq!(&out[30..34], &kept_be.0);
    let (_, out) = run(l.ingress, &tcp(CLIENT, 40004, NODE, 30082, ACK));
    assert_eq!(&out[30..34], &moved_be.0, "an established TCP connection keeps its backend");

    // A closed TCP flow goes 10 s after its last packet; shorter timeouts
    // from the flags apply as given.
    let (_, _) = run(l.ingress, &tcp(CLIENT, 40003, NODE, 30081, RST_ACK));
    age(l.path(), &kept, 5);
    let stats = conntrack_gc::sweep(l.path(), &Timeouts::default()).expect("sweep");
    assert_eq!(stats.expired_flows, 0, "closing, but only 5 s idle");
    let stats = conntrack_gc::sweep(l.path(), &Timeouts { tcp_closing_s: 4, ..Timeouts::default() }).expect("sweep");
    assert_eq!((stats.expired_flows, stats.deleted_expired), (1, 2), "{stats:?}");
    assert_eq!(entries(l.path()).len(), 6);
}

#[test]
fn a_running_agent_sweeps_conntrack_and_exports_the_tc_counters() {
    let mut node = Node::new("node-ct");
    // Node agents run with `--devices none` (tests/support): no TC program
    // is attached anywhere.
    node.start_agent_with(&[
        "--healthz-bind-address",
        "127.0.0.1:0",
        "--metrics-bind-address",
        "127.0.0.1:0",
        "--conntrack-gc-interval-secs",
        "1",
    ]);
    let addr = node.metrics_address();
    let health = node.healthz_address();
    eventually("the agent to be ready", || match http_get(health, "/readyz") {
        Ok((200, _)) => Ok(()),
        other => Err(other),
    });
    // Bump a TC counter: an IPv4 fragment through the agent's own maps
    // (programs loaded here, unattached, on the agent's pins).
    let mut ebpf = proxy_agent::datapath::tc_loader::load_unattached(node.pins.path()).expect("load the TC programs");
    let prog: &mut aya::programs::SchedClassifier =
        ebpf.program_mut(&tc_loader::loaded_name(tc_loader::INGRESS_PROGRAM)).expect("np_ingress").try_into().expect("classifier");
    let ingress = prog.fd().expect("fd").as_fd().as_raw_fd();
    let fragment = ipv4(17, CLIENT, NODE, 0x2000, &[0; 16]);
    assert_eq!(run(ingress, &fragment).0, PASS);

    // Two flows written straight into the pinned map: one idle for 100 s
    // (past UDP's 60 s), one fresh.
    let now = conntrack_gc::monotonic_now_s().expect("clock");
    let old = key(pc::PROTO_UDP, ([10, 244, 2, 1], 53), (CLIENT, 40000), pc::CT_DIR_REPLY);
    let new = key(pc::PROTO_UDP, ([10, 244, 2, 1], 53), (CLIENT, 40001), pc::CT_DIR_REPLY);
    let value = |seen_s| CtValue { saddr_be: ip_be(NODE), daddr_be: ip_be(CLIENT), seen_s, ..Default::default() };
    let mut map = ct(node.pins.path());
    map.insert(old, value(now - 100), 0).expect("insert idle entry");
    map.insert(new, value(now), 0).expect("insert fresh entry");

    let text = eventually("the GC to delete the idle entry", || {
        let text = http_get(addr, "/metrics").map(|(_, b)| b).unwrap_or_default();
        match metric(&text, "topoproxy_conntrack_gc_entries_deleted_total{reason=\"expired\"}") {
            Some(v) if v >= 1.0 => Ok(text),
            _ => Err(text.lines().filter(|l| l.contains("conntrack")).map(str::to_string).collect::<Vec<_>>()),
        }
    });
    let left: Vec<CtKey> = entries(node.pins.path()).into_iter().map(|(k, _)| k).collect();
    assert_eq!(left, vec![new], "the idle entry is gone, the fresh one stays");
    assert_eq!(metric(&text, "topoproxy_conntrack_gc_flows_deleted_total{reason=\"expired\"}"), Some(1.0), "{text}");
    assert!(metric(&text, "topoproxy_conntrack_gc_runs_total").is_some_and(|v| v >= 1.0), "{text}");
    assert!(metric(&text, "topoproxy_map_capacity{map=\"NP_CT\"}").is_some_and(|v| v > 0.0), "{text}");

    // NP_COUNTERS, by reason, summed over CPUs, without the reserved slots.
    assert_eq!(metric(&text, "topoproxy_nodeport_packets_total{reason=\"pass_fragment\"}"), Some(1.0), "{text}");
    assert_eq!(metric(&text, "topoproxy_nodeport_packets_total{reason=\"new_flow\"}"), Some(0.0), "{text}");
    assert!(text.contains("# TYPE topoproxy_nodeport_packets counter"), "{text}");
    assert!(!text.contains("reserved"), "{text}");
}
