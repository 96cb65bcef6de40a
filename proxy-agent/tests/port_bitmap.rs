//! The TC programs' port bitmap (`NP_PORTS`): a packet whose port has no
//! bit passes before any hash lookup and is counted (`pass_not_ours`); the
//! NodePort writer sets the bits of what it writes, the conntrack GC clears
//! a bit only once no frontend, backend or tracked flow uses the port, and
//! the bitmap is filled from the pinned maps before new programs run over
//! pins that had none.
//!
//! The programs run unattached under BPF_PROG_TEST_RUN on frames built in
//! memory (as in nodeport_conntrack.rs): nothing is sent anywhere. The
//! agent-level upgrade over such pins is in nodeport.rs
//! (`an_upgrade_over_pins_without_the_port_bitmap_keeps_an_established_flow`).

mod support;

use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::{AsFd, AsRawFd};
use std::path::Path;

use aya::maps::{HashMap, Map, MapData};
use proxy_agent::datapath::conntrack_gc::{self, Timeouts};
use proxy_agent::datapath::port_bits::{self, PortBits, PortSet};
use proxy_agent::datapath::tc_loader;
use proxy_agent::decide::decision::ExternalState;
use proxy_agent::external::nodeport::NodePortWriter;
use proxy_agent::model::{Backend, Frontend, Protocol};
use proxy_common as pc;
use proxy_common::{CtKey, CtValue};
use proxy_test_support::sandbox::PinDir;
use support::*;

const PASS: i32 = -1; // TC_ACT_UNSPEC
const CLIENT: [u8; 4] = [10, 0, 1, 1];
const NODE: [u8; 4] = [10, 0, 1, 2];
const SNAT: [u8; 4] = [10, 0, 3, 1];
const LOCAL_BE: [u8; 4] = [10, 244, 1, 1];
const SYN: u8 = 0x02;
const ACK: u8 = 0x10;

fn run(prog_fd: i32, frame: &[u8]) -> (i32, Vec<u8>) {
    let mut out = vec![0u8; frame.len() + 128];
    let r = proxy_test_support::prog_test_run::run(prog_fd, frame, &mut out, 1).expect("BPF_PROG_TEST_RUN");
    out.truncate(r.out_len);
    (r.retval, out)
}

/// Ethernet + IPv4 (header checksum filled in) + TCP without options; the
/// TCP checksum stays zero (the programs update it incrementally and never
/// verify it).
fn tcp(src: [u8; 4], sport: u16, dst: [u8; 4], dport: u16, flags: u8) -> Vec<u8> {
    let mut f = vec![0x02, 0, 0, 0, 0, 1, 0x02, 0, 0, 0, 0, 2, 0x08, 0x00];
    let mut ip = vec![0x45, 0, 0, 40, 0, 1, 0, 0, 64, 6, 0, 0];
    ip.extend_from_slice(&src);
    ip.extend_from_slice(&dst);
    let mut sum: u32 = ip.chunks(2).map(|c| u32::from(u16::from_be_bytes([c[0], c[1]]))).sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    ip[10..12].copy_from_slice(&(!(sum as u16)).to_be_bytes());
    f.extend_from_slice(&ip);
    f.extend_from_slice(&sport.to_be_bytes());
    f.extend_from_slice(&dport.to_be_bytes());
    f.extend_from_slice(&[0, 0, 0, 1, 0, 0, 0, 1, 0x50, flags, 0xff, 0xff, 0, 0, 0, 0]);
    f
}

fn fe(port: u16) -> Frontend {
    Frontend { ip: IpAddr::V4(Ipv4Addr::from(NODE)), port, protocol: Protocol::Tcp }
}

fn be(ip: [u8; 4], port: u16) -> Backend {
    Backend { ip: IpAddr::V4(Ipv4Addr::from(ip)), port }
}

fn ct(pins: &Path) -> HashMap<MapData, CtKey, CtValue> {
    let data = MapData::from_pin(pins.join(pc::NP_CT_MAP)).expect("open NP_CT");
    HashMap::try_from(Map::LruHashMap(data)).expect("NP_CT is an LRU hash")
}

fn ct_len(pins: &Path) -> usize {
    ct(pins).keys().count()
}

/// Sets `seen_s` of every NP_CT entry to `age` seconds ago.
fn age_all(pins: &Path, age: u32) {
    let now = conntrack_gc::monotonic_now_s().expect("clock");
    let mut map = ct(pins);
    let keys: Vec<CtKey> = map.keys().filter_map(Result::ok).collect();
    for k in keys {
        let mut v = map.get(&k, 0).expect("entry");
        v.seen_s = now - age;
        map.insert(k, v, 0).expect("rewrite entry");
    }
}

/// The bitmap as the map holds it.
fn bits(pins: &Path) -> PortSet {
    let data = MapData::from_pin(pins.join(pc::NP_PORTS_MAP)).expect("open NP_PORTS");
    let map: aya::maps::Array<MapData, u64> = aya::maps::Array::try_from(Map::Array(data)).expect("NP_PORTS is an array");
    assert_eq!(map.len(), pc::NP_PORTS_ENTRIES);
    let mut s = PortSet::default();
    for word in 0..pc::NP_PORTS_ENTRIES {
        let w = map.get(&word, 0).expect("word");
        for bit in 0..64 {
            if w & (1 << bit) != 0 {
                let port = ((word % pc::NP_PORT_WORDS) * 64 + bit) as u16;
                s.insert(port, word >= pc::NP_PORTS_EGRESS_BASE);
            }
        }
    }
    s
}

struct Loaded {
    ebpf: Option<aya::Ebpf>,
    ingress: i32,
    egress: i32,
    writer: NodePortWriter,
    pins: PinDir,
}

impl Loaded {
    fn new(tc: &[(Frontend, Vec<Backend>)]) -> Loaded {
        require_root();
        let pins = PinDir::new("tnpbits").expect("pins");
        let (ebpf, ingress, egress) = load_programs(pins.path());
        let mut writer = NodePortWriter::open(pins.path()).expect("open the TC maps");
        writer.set_config(Some(Ipv4Addr::from(SNAT)), None, (61000, 65535)).expect("config");
        let mut l = Loaded { ebpf: Some(ebpf), ingress, egress, writer, pins };
        l.program(tc);
        l
    }

    fn program(&mut self, tc: &[(Frontend, Vec<Backend>)]) {
        let ext = ExternalState {
            tc: tc.iter().map(|(f, b)| (*f, b.iter().copied().collect())).collect(),
            local_endpoints: [IpAddr::V4(Ipv4Addr::from(LOCAL_BE))].into_iter().collect(),
            ..Default::default()
        };
        let o = self.writer.sync(&ext);
        assert!(o.failures.is_empty(), "{:?}", o.failures);
    }

    fn path(&self) -> &Path {
        self.pins.path()
    }

    fn counter(&self, name: &str) -> u64 {
        proxy_agent::datapath::dump::np_counters(self.path()).expect("counters")[name]
    }

    /// Ingress then egress, as a forwarded packet passes the node.
    fn through(&self, frame: &[u8]) -> Vec<u8> {
        let (rc, out) = run(self.ingress, frame);
        assert_eq!(rc, PASS);
        let (rc, out) = run(self.egress, &out);
        assert_eq!(rc, PASS);
        out
    }
}

/// The TC programs loaded (not attached) with their maps at `pins`.
fn load_programs(pins: &Path) -> (aya::Ebpf, i32, i32) {
    let mut ebpf = tc_loader::load_unattached(pins).expect("load the TC programs");
    let mut fd = |name: &'static str| {
        let prog: &mut aya::programs::SchedClassifier =
            ebpf.program_mut(&tc_loader::loaded_name(name)).expect(name).try_into().expect("classifier");
        prog.fd().expect("fd").as_fd().as_raw_fd()
    };
    let (ingress, egress) = (fd(tc_loader::INGRESS_PROGRAM), fd(tc_loader::EGRESS_PROGRAM));
    (ebpf, ingress, egress)
}

#[test]
fn a_packet_whose_port_has_no_bit_passes_untouched_and_is_counted() {
    let l = Loaded::new(&[(fe(30080), vec![be(LOCAL_BE, 8080)])]);
    let b = bits(l.path());
    assert!(b.contains(30080, false) && b.contains(8080, true) && b.contains(0, true), "{b:?}");
    assert_eq!(b.counts(), (1, 2), "the frontend's port at ingress; the backend's and the refusal's port 0 at egress");

    // (hook, frame, counted as not ours)
    let cases = [
        ("ingress", tcp(CLIENT, 40000, NODE, 22, SYN), true),
        ("ingress", tcp(CLIENT, 40000, NODE, 8080, SYN), true), // a backend's port means nothing at ingress
        ("egress", tcp(NODE, 22, CLIENT, 40000, ACK), true),
        ("egress", tcp(NODE, 30080, CLIENT, 40000, ACK), true), // nor a frontend's at egress
        // The frontend's port on another address: past the bitmap, the
        // frontend lookup misses.
        ("ingress", tcp(CLIENT, 40000, [10, 0, 1, 99], 30080, SYN), false),
        // A backend's port either way at egress: past the bitmap, the
        // conntrack lookups miss.
        ("egress", tcp([10, 244, 1, 7], 8080, CLIENT, 40000, ACK), false),
        ("egress", tcp(CLIENT, 40000, [10, 244, 1, 7], 8080, ACK), false),
    ];
    for (hook, frame, not_ours) in cases {
        let before = l.counter("pass_not_ours");
        let prog = if hook == "ingress" { l.ingress } else { l.egress };
        let (rc, out) = run(prog, &frame);
        assert_eq!((rc, &out), (PASS, &frame), "{hook} {:?}: passed untouched", &frame[26..38]);
        assert_eq!(l.counter("pass_not_ours") - before, u64::from(not_ours), "{hook} {:?}", &frame[26..38]);
    }
    assert_eq!(ct_len(l.path()), 0, "nothing tracked");
    assert_eq!(l.counter("new_flow"), 0);

    // The frontend itself is served.
    let out = l.through(&tcp(CLIENT, 40001, NODE, 30080, SYN));
    assert_eq!((&out[30..34], u16::from_be_bytes([out[36], out[37]])), (&LOCAL_BE[..], 8080));
    let (_, back) = run(l.egress, &tcp(LOCAL_BE, 8080, CLIENT, 40001, ACK));
    assert_eq!((&back[26..30], u16::from_be_bytes([back[34], back[35]])), (&NODE[..], 30080), "the reply leaves from the frontend");
}

#[test]
fn a_node_port_added_later_gets_its_bit_and_works() {
    let mut l = Loaded::new(&[(fe(30080), vec![be(LOCAL_BE, 8080)])]);
    let syn = tcp(CLIENT, 40000, NODE, 30090, SYN);
    assert_eq!(run(l.ingress, &syn), (PASS, syn.clone()));
    assert_eq!(l.counter("pass_not_ours"), 1);
    // A NodePort to a remote backend on another port: both bits come with it.
    l.program(&[(fe(30080), vec![be(LOCAL_BE, 8080)]), (fe(30090), vec![be([10, 244, 2, 1], 9090)])]);
    let b = bits(l.path());
    assert!(b.contains(30090, false) && b.contains(9090, true), "{b:?}");
    let out = l.through(&syn);
    assert_eq!(&out[30..34], &[10, 244, 2, 1], "DNAT to the backend");
    assert_eq!(&out[26..30], &SNAT, "SNAT at egress");
    let snat_port = u16::from_be_bytes([out[34], out[35]]);
    // The backend's answer to the SNAT port (ingress: the SNAT range, not
    // a bit) and on to the client (egress: the backend's port).
    let out = l.through(&tcp([10, 244, 2, 1], 9090, SNAT, snat_port, SYN | ACK));
    assert_eq!((&out[26..30], &out[30..34]), (&NODE[..], &CLIENT[..]));
    assert_eq!(l.counter("pass_not_ours"), 1, "nothing of the flow was skipped");
    assert_eq!(l.counter("new_flow"), 1);
}

#[test]
fn a_bit_is_cleared_only_once_no_frontend_backend_or_flow_uses_the_port() {
    let other_be = be([10, 244, 1, 2], 8081);
    // Two frontends share the backend: when the first goes, the backend
    // stays, and so does the first frontend's flow.
    let mut l = Loaded::new(&[(fe(30080), vec![be(LOCAL_BE, 8080)]), (fe(30081), vec![be(LOCAL_BE, 8080)])]);
    let out = l.through(&tcp(CLIENT, 40000, NODE, 30080, SYN));
    assert_eq!(&out[30..34], &LOCAL_BE);
    l.program(&[(fe(30081), vec![be(LOCAL_BE, 8080)])]);
    let stats = conntrack_gc::sweep(l.path(), &Timeouts::default()).expect("sweep");
    assert_eq!((stats.expired_flows, stats.stale_flows), (0, 0), "{stats:?}");
    assert!(stats.ports_cleared.is_some(), "the writer has claimed: the GC looks at the bits: {stats:?}");
    assert!(bits(l.path()).contains(30080, false), "the flow's frontend port stays while its NP_CT entries do");
    let (_, out) = run(l.ingress, &tcp(CLIENT, 40000, NODE, 30080, ACK));
    assert_eq!(&out[30..34], &LOCAL_BE, "the flow through the removed frontend goes on");

    // A backend replaced under a frontend: an established TCP flow keeps
    // its backend (as netfilter's conntrack keeps kube-proxy's DNAT), its
    // replies their translation and its ports their bits; once it has been
    // idle past its timeout the GC deletes it, and only then does the
    // backend's port lose its bit.
    l.program(&[(fe(30081), vec![other_be])]);
    let (_, back) = run(l.egress, &tcp(LOCAL_BE, 8080, CLIENT, 40000, ACK));
    assert_eq!(&back[26..30], &NODE, "the reply is still translated");
    let stats = conntrack_gc::sweep(l.path(), &Timeouts::default()).expect("sweep");
    assert_eq!((stats.expired_flows, stats.stale_flows), (0, 0), "a TCP flow is never stale: {stats:?}");
    assert!(bits(l.path()).contains(8080, true) && bits(l.path()).contains(30080, false));
    // (A 10 s timeout stands for the 6 h default: the clock may not have
    // run that long since boot.)
    age_all(l.path(), 20);
    let stats = conntrack_gc::sweep(l.path(), &Timeouts { tcp_s: 10, ..Timeouts::default() }).expect("sweep");
    assert_eq!((stats.expired_flows, stats.deleted_expired), (1, 2), "{stats:?}");
    assert_eq!(stats.ports_cleared, Some(2), "the flow's frontend port (ingress) and its backend's port (egress)");
    let b = bits(l.path());
    assert!(!b.contains(30080, false) && !b.contains(8080, true), "{b:?}");
    assert!(b.contains(30081, false) && b.contains(8081, true) && b.contains(0, true), "{b:?}");
    let before = l.counter("pass_not_ours");
    let reply = tcp(LOCAL_BE, 8080, CLIENT, 40000, ACK);
    assert_eq!(run(l.egress, &reply), (PASS, reply.clone()));
    assert_eq!(l.counter("pass_not_ours"), before + 1);

    // An idle flow that expires takes its port's bit with it.
    let out = l.through(&tcp(CLIENT, 40001, NODE, 30081, SYN));
    assert_eq!(&out[30..34], &[10, 244, 1, 2]);
    l.program(&[]);
    age_all(l.path(), 20);
    let stats = conntrack_gc::sweep(l.path(), &Timeouts { tcp_syn_s: 10, ..Timeouts::default() }).expect("sweep");
    assert_eq!(stats.expired_flows, 1, "unanswered past its timeout: {stats:?}");
    assert_eq!(bits(l.path()).counts(), (0, 1), "only port 0 at egress is left");
}

#[test]
fn a_flow_keeps_its_bits_while_its_conntrack_entries_live() {
    // A frontend removed with its backend still used elsewhere, as above,
    // but the flow is only idle (not past its timeout): it keeps both bits
    // through any number of sweeps, and loses them once it expires.
    let mut l = Loaded::new(&[(fe(30080), vec![be(LOCAL_BE, 8080)]), (fe(30081), vec![be(LOCAL_BE, 8080)])]);
    l.through(&tcp(CLIENT, 40000, NODE, 30080, SYN));
    l.program(&[(fe(30081), vec![be(LOCAL_BE, 8080)])]);
    age_all(l.path(), 30);
    for _ in 0..3 {
        let stats = conntrack_gc::sweep(l.path(), &Timeouts::default()).expect("sweep");
        assert_eq!(stats.ports_cleared, Some(0), "{stats:?}");
    }
    assert!(bits(l.path()).contains(30080, false));
    age_all(l.path(), 61); // past the timeout of an unanswered SYN
    let stats = conntrack_gc::sweep(l.path(), &Timeouts::default()).expect("sweep");
    assert_eq!((stats.expired_flows, stats.ports_cleared), (1, Some(1)), "{stats:?}");
    assert!(!bits(l.path()).contains(30080, false));
    assert!(bits(l.path()).contains(8080, true), "the backend is still in use");
}

#[test]
fn the_gc_leaves_the_bits_alone_without_a_claim_or_when_the_claim_changed() {
    let mut l = Loaded::new(&[(fe(30080), vec![be(LOCAL_BE, 8080)])]);
    let mut handle = PortBits::open(l.path()).expect("open NP_PORTS");
    // A claim made while a sweep was reading NP_CT: that sweep clears
    // nothing (the claim's new ports may already have flows).
    let g = handle.generation();
    l.program(&[(fe(30090), vec![be(LOCAL_BE, 9090)])]);
    assert_eq!(handle.clear_unused(g, &PortSet::default()).expect("clear"), None);
    assert!(bits(l.path()).contains(30080, false), "untouched");
    // The next one does.
    let g = handle.generation();
    assert_eq!(handle.clear_unused(g, &PortSet::default()).expect("clear"), Some(2));
    assert_eq!(bits(l.path()).counts(), (1, 2));

    // Pins no writer of this process has claimed (an agent that just
    // started, or a GC without the TC datapath): nothing is cleared.
    let other = PinDir::new("tnpbits").expect("pins");
    let (_ebpf, _, _) = load_programs(other.path());
    port_bits::fill_from_maps(other.path()).expect("fill");
    let mut map = PortBits::open(other.path()).expect("open");
    let g = map.generation();
    let mut fake = PortSet::default();
    fake.insert_frontend(1234);
    assert_eq!(map.clear_unused(g, &fake).expect("clear"), None);
    let stats = conntrack_gc::sweep(other.path(), &Timeouts::default()).expect("sweep");
    assert_eq!(stats.ports_cleared, None, "{stats:?}");
}

#[test]
fn new_programs_over_pins_without_the_bitmap_pass_tracked_flows_only_once_it_is_filled() {
    // Frontends and flows written by an agent (local and remote backends).
    let remote = (fe(30090), vec![be([10, 244, 2, 1], 9090)]);
    let mut l = Loaded::new(&[(fe(30080), vec![be(LOCAL_BE, 8080)]), (fe(30081), vec![be(LOCAL_BE, 8080)]), remote.clone()]);
    l.through(&tcp(CLIENT, 40000, NODE, 30080, SYN));
    let out = l.through(&tcp(CLIENT, 40001, NODE, 30090, SYN));
    let snat_port = u16::from_be_bytes([out[34], out[35]]);
    // Then the frontend of the first flow goes while its backend stays
    // (only the conntrack entries name port 30080 now).
    l.program(&[(fe(30081), vec![be(LOCAL_BE, 8080)]), remote]);
    let entries = ct_len(l.path());
    assert_eq!(entries, 6);

    // An upgrade from a version without NP_PORTS: its pins lack the map, so
    // the new programs' load creates an empty one.
    drop(l.ebpf.take());
    std::fs::remove_file(l.path().join(pc::NP_PORTS_MAP)).expect("unpin NP_PORTS");
    let (_ebpf, ingress, egress) = load_programs(l.path());
    assert_eq!(bits(l.path()).counts(), (0, 0), "a new, empty bitmap");
    let tracked = tcp(CLIENT, 40000, NODE, 30080, ACK);
    assert_eq!(run(ingress, &tracked), (PASS, tracked.clone()), "what an empty bitmap would do to a tracked flow");

    // What the TC loader does before it attaches them.
    let (ingress_ports, egress_ports) = port_bits::fill_from_maps(l.path()).expect("fill");
    assert_eq!((ingress_ports, egress_ports), (3, 3), "30080 (a flow), 30081, 30090; 8080, 9090, 0");
    let (_, out) = run(ingress, &tracked);
    assert_eq!(&out[30..34], &LOCAL_BE, "the first flow, through its removed frontend");
    let (_, out) = run(egress, &tcp(LOCAL_BE, 8080, CLIENT, 40000, ACK));
    assert_eq!(&out[26..30], &NODE, "and its reply");
    let (_, out) = run(ingress, &tcp(CLIENT, 40001, NODE, 30090, ACK));
    let (_, out) = run(egress, &out);
    assert_eq!((&out[26..30], u16::from_be_bytes([out[34], out[35]])), (&SNAT[..], snat_port), "the SNAT'ed flow keeps its port");
    let (_, out) = run(ingress, &tcp([10, 244, 2, 1], 9090, SNAT, snat_port, ACK));
    let (_, out) = run(egress, &out);
    assert_eq!((&out[26..30], &out[30..34]), (&NODE[..], &CLIENT[..]), "and its reply");
    assert_eq!(ct_len(l.path()), entries, "no flow was replaced");
}
