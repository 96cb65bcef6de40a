//! The TC programs under random and mutated packets (BPF_PROG_TEST_RUN on
//! the real, verifier-checked programs): truncated headers, odd IPv4
//! options, IPv6 extension chains, ICMP errors quoting anything, VLAN tags,
//! fragments, and bytes flipped at random on top.
//!
//! The invariant, for every packet that matches no frontend and no tracked
//! flow: both programs pass it (`TC_ACT_UNSPEC`) byte for byte unchanged,
//! no map changes, and the only counters that move are the "passed
//! untouched" ones (`pass_unparsed`, `pass_fragment`). A packet can match
//! only if it carries, somewhere in its bytes, one of the addresses of a
//! frontend, of the SNAT configuration or of a tracked flow, and somewhere
//! one of their ports; packets that carry neither pair are checked. The
//! others run too (no verdict but pass or drop, no error), and the state
//! they leave is the next packets' starting point.
//!
//! Maps: the programs write only `NP_CT`, `NP_AFFINITY` and
//! `NP_COUNTERS`; those are compared around every checked packet, and
//! every pinned `NP_*` map (raw bytes, every entry) around the whole run.
//!
//! The seed is fixed and the count bounded (`TOPOPROXY_PACKET_FUZZ_SEED`,
//! `TOPOPROXY_PACKET_FUZZ_COUNT` change them; `cargo xtask fuzz --packets
//! N` runs a longer one). It runs on a thread inside a network namespace of
//! its own: BPF_PROG_TEST_RUN sends nothing anywhere, and the skb it builds
//! belongs to that namespace's loopback.

mod support;

use std::collections::BTreeMap;
use std::ffi::CString;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::Instant;

use proxy_agent::datapath::maps::{self, Datapath, MapSpec};
use proxy_agent::datapath::tc_loader::{self, EGRESS_PROGRAM, INGRESS_PROGRAM};
use proxy_agent::decide::decision::ExternalState;
use proxy_agent::external::nodeport::NodePortWriter;
use proxy_agent::model::{Backend, Frontend, Protocol};
use proxy_common::np_counter;
use proxy_test_support::rng::Rng;
use proxy_test_support::sandbox::{Netns, PinDir, in_netns};
use support::require_root;

const PASS: i32 = -1; // TC_ACT_UNSPEC
const SHOT: i32 = 2; // TC_ACT_SHOT

// The node, its SNAT addresses and port range, the clients of the tracked
// flows and the backends.
const NODE: [u8; 4] = [10, 0, 1, 2];
const NODE6: [u8; 16] = [0xfd, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2];
const LB: [u8; 4] = [192, 0, 2, 10];
const SNAT: [u8; 4] = [10, 0, 3, 1];
const SNAT6: [u8; 16] = [0xfd, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
const CLIENT: [u8; 4] = [10, 0, 9, 1];
const CLIENT6: [u8; 16] = [0xfd, 0, 0, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
const LOCAL_BE: [u8; 4] = [10, 244, 1, 1];
const REMOTE_BE: [u8; 4] = [10, 244, 2, 1];
const REMOTE_BE6: [u8; 16] = [0xfd, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
const SNAT_PORTS: (u16, u16) = (61000, 61003);
const NODE_PORT_TCP: u16 = 31337;
const NODE_PORT_UDP: u16 = 31338;
const NODE_PORT_EMPTY: u16 = 31339;
const LB_PORT: u16 = 8443;
const BACKEND_PORT: u16 = 8080;
const CLIENT_PORT: u16 = 40000;

/// Addresses a matching packet must carry somewhere.
fn reserved_addresses() -> Vec<Vec<u8>> {
    let v4 = [NODE, LB, SNAT, CLIENT, LOCAL_BE, REMOTE_BE].map(|a| a.to_vec());
    let v6 = [NODE6, SNAT6, CLIENT6, REMOTE_BE6].map(|a| a.to_vec());
    v4.into_iter().chain(v6).collect()
}

/// Ports (big-endian) a matching packet must carry somewhere.
fn reserved_ports() -> Vec<[u8; 2]> {
    let mut p = vec![NODE_PORT_TCP, NODE_PORT_UDP, NODE_PORT_EMPTY, LB_PORT, BACKEND_PORT, CLIENT_PORT, CLIENT_PORT + 1];
    p.extend(SNAT_PORTS.0..=SNAT_PORTS.1);
    p.into_iter().map(u16::to_be_bytes).collect()
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// Whether `frame` could match a frontend or a tracked flow (see the
/// module comment): conservative, never false for one that can.
fn may_match(frame: &[u8], addrs: &[Vec<u8>], ports: &[[u8; 2]]) -> bool {
    addrs.iter().any(|a| contains(frame, a)) && ports.iter().any(|p| contains(frame, p))
}

// ---------------------------------------------------------------------------
// Frames.
// ---------------------------------------------------------------------------

fn checksum(data: &[u8]) -> u16 {
    let mut sum: u32 = data.chunks(2).map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]))).sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

fn addr4(r: &mut Rng) -> [u8; 4] {
    match r.below(10) {
        0..=2 => *r.pick(&[NODE, LB, SNAT, CLIENT, LOCAL_BE, REMOTE_BE]),
        // Near misses: the same networks, other hosts.
        3..=5 => *r.pick(&[[10, 0, 1, 3], [10, 0, 3, 2], [10, 0, 9, 2], [10, 244, 1, 2], [192, 0, 2, 11], [10, 0, 1, 255]]),
        _ => [r.byte(), r.byte(), r.byte(), r.byte()],
    }
}

fn addr6(r: &mut Rng) -> [u8; 16] {
    match r.below(10) {
        0..=2 => *r.pick(&[NODE6, SNAT6, CLIENT6, REMOTE_BE6]),
        3..=5 => {
            let mut a = *r.pick(&[NODE6, SNAT6, CLIENT6, REMOTE_BE6]);
            a[15] ^= 1 + r.byte() % 254;
            a
        }
        _ => {
            let mut a = [0u8; 16];
            for b in &mut a {
                *b = r.byte();
            }
            a
        }
    }
}

fn port(r: &mut Rng) -> u16 {
    if r.chance(15) {
        *r.pick(&[NODE_PORT_TCP, NODE_PORT_UDP, NODE_PORT_EMPTY, LB_PORT, BACKEND_PORT, CLIENT_PORT, SNAT_PORTS.0, SNAT_PORTS.1])
    } else if r.chance(30) {
        *r.pick(&[0, 1, 53, 80, 443, 30000, 32767, 60999, 61004, 65535])
    } else {
        r.next() as u16
    }
}

/// TCP or UDP header and payload.
fn l4(r: &mut Rng, proto: u8) -> Vec<u8> {
    let mut h = Vec::new();
    h.extend_from_slice(&port(r).to_be_bytes());
    h.extend_from_slice(&port(r).to_be_bytes());
    if proto == 6 {
        h.extend_from_slice(&r.bytes(8)); // seq, ack
        let offset = if r.chance(80) { 5 } else { r.below(16) as u8 };
        let flags = if r.chance(70) { *r.pick(&[0x02, 0x10, 0x12, 0x11, 0x14, 0x04, 0x18, 0x01, 0x00, 0x3f]) } else { r.byte() };
        h.extend_from_slice(&[offset << 4, flags, 0xff, 0xff, 0, 0, 0, 0]);
        if offset > 5 {
            h.extend_from_slice(&r.bytes((usize::from(offset) - 5) * 4));
        }
    } else {
        let len = r.next() as u16;
        h.extend_from_slice(&len.to_be_bytes());
        h.extend_from_slice(&[0, 0]);
    }
    let n = r.below(48);
    h.extend_from_slice(&r.bytes(n));
    h
}

/// An ICMP or ICMPv6 message; errors quote a packet (often a whole
/// header, sometimes truncated, of either family).
fn icmp(r: &mut Rng, v6: bool, depth: u32) -> Vec<u8> {
    let ty = if v6 { *r.pick(&[1, 2, 3, 4, 128, 129, 135, 0, 255]) } else { *r.pick(&[3, 11, 0, 8, 4, 5, 12, 255]) };
    let any = r.byte();
    let mut m = vec![ty, *r.pick(&[0, 1, 3, 4, any]), 0, 0];
    m.extend_from_slice(&r.bytes(4));
    let quote_v6 = if r.chance(80) { v6 } else { !v6 };
    let mut quote = if depth < 2 {
        ip_packet(r, quote_v6, depth + 1)
    } else {
        let n = r.below(40);
        r.bytes(n)
    };
    if r.chance(40) {
        let keep = r.below(quote.len() + 1);
        quote.truncate(keep);
    }
    m.extend_from_slice(&quote);
    m
}

fn payload(r: &mut Rng, proto: u8, v6: bool, depth: u32) -> Vec<u8> {
    match proto {
        6 | 17 => l4(r, proto),
        1 if !v6 => icmp(r, false, depth),
        58 if v6 => icmp(r, true, depth),
        _ => {
            let n = r.below(40);
            r.bytes(n)
        }
    }
}

fn proto(r: &mut Rng, v6: bool) -> u8 {
    match r.below(20) {
        0..=6 => 6,
        7..=12 => 17,
        13..=16 => {
            if v6 {
                58
            } else {
                1
            }
        }
        _ => {
            let any = r.byte();
            *r.pick(&[0, 1, 4, 41, 47, 50, 58, 132, 255, any])
        }
    }
}

/// An IPv4 or IPv6 packet (no Ethernet header).
fn ip_packet(r: &mut Rng, v6: bool, depth: u32) -> Vec<u8> {
    if v6 { ipv6_packet(r, depth) } else { ipv4_packet(r, depth) }
}

fn ipv4_packet(r: &mut Rng, depth: u32) -> Vec<u8> {
    let ihl: u8 = if r.chance(70) { 5 } else { r.below(16) as u8 };
    let options_len = usize::from(ihl.saturating_sub(5)) * 4;
    let mut options = Vec::new();
    while options.len() < options_len {
        // NOP, end of list, record route, timestamp, router alert, or any
        // type with any length.
        let any = r.byte();
        let kind = *r.pick(&[1, 0, 7, 68, 148, any]);
        options.push(kind);
        if kind > 1 {
            let any = r.byte();
            options.push(*r.pick(&[0, 1, 2, 4, 40, any]));
        }
    }
    options.truncate(options_len);
    let p = proto(r, false);
    let body = payload(r, p, false, depth);
    let frag: u16 = match r.below(10) {
        0..=5 => 0,
        6 => 0x4000,
        7 => 0x2000,
        8 => r.next() as u16 & 0x1fff,
        _ => r.next() as u16,
    };
    let version_ihl = if r.chance(97) { 0x40 | (ihl & 0x0f) } else { r.byte() };
    let total = (20 + options.len() + body.len()) as u16;
    let total = if r.chance(90) { total } else { r.next() as u16 };
    let mut h = vec![version_ihl, r.byte()];
    h.extend_from_slice(&total.to_be_bytes());
    h.extend_from_slice(&r.bytes(2));
    h.extend_from_slice(&frag.to_be_bytes());
    h.extend_from_slice(&[r.byte(), p, 0, 0]);
    h.extend_from_slice(&addr4(r));
    h.extend_from_slice(&addr4(r));
    h.extend_from_slice(&options);
    let sum = if r.chance(90) { checksum(&h) } else { r.next() as u16 };
    h[10..12].copy_from_slice(&sum.to_be_bytes());
    h.extend_from_slice(&body);
    h
}

fn ipv6_packet(r: &mut Rng, depth: u32) -> Vec<u8> {
    let chain_len = if r.chance(50) { 0 } else { r.below(7) };
    let exts: Vec<u8> = (0..chain_len).map(|_| *r.pick(&[0, 43, 44, 60, 51, 59, 135])).collect();
    let last = proto(r, true);
    let mut body = Vec::new();
    for (i, ext) in exts.iter().enumerate() {
        let next = exts.get(i + 1).copied().unwrap_or(last);
        if *ext == 44 {
            // Fragment header: offset and M chosen, sometimes an atomic
            // fragment (offset 0, no M).
            let off_m: u16 = if r.chance(40) { 0 } else { r.next() as u16 & 0xfff9 };
            body.extend_from_slice(&[next, 0]);
            body.extend_from_slice(&off_m.to_be_bytes());
            body.extend_from_slice(&r.bytes(4));
        } else {
            let len = r.below(3);
            body.push(next);
            body.push(len as u8);
            if *ext == 43 {
                // Routing type, segments left (0: at its destination).
                body.push(r.byte());
                body.push(if r.chance(50) { 0 } else { r.byte() });
                body.extend_from_slice(&r.bytes(4 + len * 8));
            } else {
                body.extend_from_slice(&r.bytes(6 + len * 8));
            }
        }
    }
    body.extend_from_slice(&payload(r, last, true, depth));
    let first = exts.first().copied().unwrap_or(last);
    let plen = if r.chance(90) { body.len() as u16 } else { r.next() as u16 };
    let mut h = vec![if r.chance(97) { 0x60 } else { r.byte() }, 0, 0, 0];
    h.extend_from_slice(&plen.to_be_bytes());
    h.extend_from_slice(&[first, 64]);
    h.extend_from_slice(&addr6(r));
    h.extend_from_slice(&addr6(r));
    h.extend_from_slice(&body);
    h
}

/// A frame: Ethernet (sometimes VLAN or QinQ tagged, sometimes not IP at
/// all) around an IPv4 or IPv6 packet, sometimes truncated.
fn frame(r: &mut Rng) -> Vec<u8> {
    let mut f = vec![0x02, 0, 0, 0, 0, 1, 0x02, 0, 0, 0, 0, 2];
    let v6 = r.chance(40);
    let ether_ip: [u8; 2] = if v6 { [0x86, 0xdd] } else { [0x08, 0x00] };
    match r.below(20) {
        0 => f.extend_from_slice(&[0x81, 0x00, 0, r.byte(), ether_ip[0], ether_ip[1]]),
        1 => f.extend_from_slice(&[0x88, 0xa8, 0, 1, 0x81, 0x00, 0, 2, ether_ip[0], ether_ip[1]]),
        2 => {
            let any = [r.byte(), r.byte()];
            let ethertype: [u8; 2] = *r.pick(&[[0x08, 0x06], [0x88, 0xcc], [0x88, 0x47], any]);
            f.extend_from_slice(&ethertype);
        }
        3 => f.extend_from_slice(&if v6 { [0x08, 0x00] } else { [0x86, 0xdd] }),
        _ => f.extend_from_slice(&ether_ip),
    }
    f.extend_from_slice(&ip_packet(r, v6, 0));
    if r.chance(20) {
        let keep = 14 + r.below(f.len() - 13);
        f.truncate(keep);
    }
    f
}

/// Flips, overwrites, inserts or removes bytes of a frame.
fn mutate(r: &mut Rng, f: &mut Vec<u8>) {
    for _ in 0..=r.below(4) {
        let at = r.below(f.len());
        match r.below(5) {
            0 => f[at] ^= 1 << r.below(8),
            1 => f[at] = *r.pick(&[0, 0xff, 0x45, 0x46, 0x4f, 0x60, 0x06, 0x11, 0x01, 0x3a, 0x2c, 0x20, 0x40]),
            2 => f.insert(at, r.byte()),
            3 if f.len() > 15 => {
                f.remove(at);
            }
            _ => {
                let n = r.below(8).min(f.len() - at);
                f[at..at + n].iter_mut().for_each(|b| *b = r.byte());
            }
        }
    }
    if f.len() < 14 {
        f.resize(14, 0);
    }
}

// ---------------------------------------------------------------------------
// Map snapshots, raw: every pinned NP_* map, whatever its type.
// ---------------------------------------------------------------------------

const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;
const BPF_OBJ_GET: libc::c_long = 7;

fn bpf(cmd: libc::c_long, attr: &mut [u64; 8]) -> std::io::Result<i64> {
    // SAFETY: `attr` is a zero-padded `union bpf_attr` prefix of 64 bytes
    // whose pointers (set by the callers) point at buffers that outlive the
    // call and are as large as the map's key and value.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_mut_ptr(), std::mem::size_of_val(attr)) };
    if rc < 0 { Err(std::io::Error::last_os_error()) } else { Ok(rc) }
}

fn possible_cpus() -> usize {
    // "0-1", "0", "0-3,5"
    let text = std::fs::read_to_string("/sys/devices/system/cpu/possible").expect("possible CPUs");
    text.trim()
        .split(',')
        .map(|part| match part.split_once('-') {
            Some((a, b)) => b.parse::<usize>().expect("cpu") - a.parse::<usize>().expect("cpu") + 1,
            None => 1,
        })
        .sum()
}

type Entries = Vec<(Vec<u8>, Vec<u8>)>;

/// Every entry of the map pinned at `pins/spec.name`, as raw bytes.
fn dump_map(pins: &Path, spec: &MapSpec) -> Entries {
    let path = CString::new(pins.join(spec.name).as_os_str().as_bytes()).expect("path");
    let mut attr = [0u64; 8];
    attr[0] = path.as_ptr() as u64;
    let fd = bpf(BPF_OBJ_GET, &mut attr).unwrap_or_else(|e| panic!("open pinned {}: {e}", spec.name)) as i32;
    let per_cpu = matches!(spec.map_type, aya::maps::MapType::PerCpuArray | aya::maps::MapType::PerCpuHash);
    let value_len = if per_cpu { spec.value_size.div_ceil(8) * 8 * possible_cpus() } else { spec.value_size };
    let mut out = Vec::new();
    let mut key: Option<Vec<u8>> = None;
    loop {
        let mut next = vec![0u8; spec.key_size];
        let mut attr = [0u64; 8];
        attr[0] = u64::from(fd as u32);
        attr[1] = key.as_ref().map_or(0, |k| k.as_ptr() as u64);
        attr[2] = next.as_mut_ptr() as u64;
        if bpf(BPF_MAP_GET_NEXT_KEY, &mut attr).is_err() {
            break; // ENOENT: the last key
        }
        let mut value = vec![0u8; value_len];
        let mut attr = [0u64; 8];
        attr[0] = u64::from(fd as u32);
        attr[1] = next.as_ptr() as u64;
        attr[2] = value.as_mut_ptr() as u64;
        // An entry deleted in between (none here: nothing else runs).
        if bpf(BPF_MAP_LOOKUP_ELEM, &mut attr).is_ok() {
            out.push((next.clone(), value));
        }
        key = Some(next);
    }
    // SAFETY: `fd` is ours, from BPF_OBJ_GET above.
    unsafe { libc::close(fd) };
    out.sort();
    out
}

/// The TC datapath's pinned maps, all of them or only those the programs
/// write.
fn snapshot(pins: &Path, written_only: bool) -> BTreeMap<&'static str, Entries> {
    let written = [maps::NP_CT.name, maps::NP_AFFINITY.name, maps::NP_COUNTERS.name];
    maps::MAPS
        .iter()
        .filter(|m| m.datapath == Datapath::Tc && (!written_only || written.contains(&m.name)))
        .map(|m| (m.name, dump_map(pins, m)))
        .collect()
}

/// NP_COUNTERS summed over CPUs, by counter id.
fn counter_sums(snap: &BTreeMap<&'static str, Entries>) -> Vec<u64> {
    snap[maps::NP_COUNTERS.name]
        .iter()
        .map(|(_, v)| v.chunks(8).map(|c| u64::from_ne_bytes(c.try_into().expect("8 bytes"))).sum())
        .collect()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

// ---------------------------------------------------------------------------
// The run.
// ---------------------------------------------------------------------------

fn fe(ip: IpAddr, port: u16, protocol: Protocol) -> Frontend {
    Frontend { ip, port, protocol }
}

fn be(ip: IpAddr, port: u16) -> Backend {
    Backend { ip, port }
}

/// BPF_PROG_TEST_RUN of `prog_fd` on `frame`: (return value, frame after).
fn run(prog_fd: i32, frame: &[u8]) -> (i32, Vec<u8>) {
    try_run(prog_fd, frame).unwrap_or_else(|e| panic!("BPF_PROG_TEST_RUN on {}: {e}", hex(frame)))
}

/// [`run`], or `None` for a frame the kernel's test runner refuses
/// (EINVAL): it checks more of a frame than a TC hook ever does, e.g. it
/// wants a whole IP header after an IP ethertype (net/bpf/test_run.c).
fn try_run(prog_fd: i32, frame: &[u8]) -> std::io::Result<(i32, Vec<u8>)> {
    let mut out = vec![0u8; frame.len() + 256];
    let r = proxy_test_support::prog_test_run::run(prog_fd, frame, &mut out, 1)?;
    out.truncate(r.out_len);
    Ok((r.retval, out))
}

/// TCP SYN or UDP datagram with a valid IPv4 header, for the flows that
/// are tracked before the run.
fn flow_packet(proto: u8, src: [u8; 4], sport: u16, dst: [u8; 4], dport: u16) -> Vec<u8> {
    let mut l4 = Vec::new();
    l4.extend_from_slice(&sport.to_be_bytes());
    l4.extend_from_slice(&dport.to_be_bytes());
    if proto == 6 {
        l4.extend_from_slice(&[0, 0, 0, 1, 0, 0, 0, 0, 0x50, 0x02, 0xff, 0xff, 0, 0, 0, 0]);
    } else {
        l4.extend_from_slice(&[0, 12, 0, 0, b'p', b'i', b'n', b'g']);
    }
    let mut ip = vec![0x45, 0];
    ip.extend_from_slice(&((20 + l4.len()) as u16).to_be_bytes());
    ip.extend_from_slice(&[0, 1, 0, 0, 64, proto, 0, 0]);
    ip.extend_from_slice(&src);
    ip.extend_from_slice(&dst);
    let sum = checksum(&ip);
    ip[10..12].copy_from_slice(&sum.to_be_bytes());
    let mut f = vec![0x02, 0, 0, 0, 0, 1, 0x02, 0, 0, 0, 0, 2, 0x08, 0x00];
    f.extend_from_slice(&ip);
    f.extend_from_slice(&l4);
    f
}

#[derive(Debug, Default)]
struct Report {
    packets: u64,
    checked: u64,
    may_match: u64,
    mutated: u64,
    /// Runs the kernel's test runner refused (see [`try_run`]).
    refused: u64,
    counters: Vec<u64>,
}

fn fuzz(pins: &Path, seed: u64, count: u64) -> Report {
    let mut ebpf = tc_loader::load_unattached(pins).expect("load the TC programs");
    let mut fd = |name: &'static str| {
        let name = tc_loader::loaded_name(name);
        let prog: &mut aya::programs::SchedClassifier = ebpf.program_mut(&name).expect("TC program").try_into().expect("classifier");
        prog.fd().expect("fd").as_fd().as_raw_fd()
    };
    let (ingress, egress) = (fd(INGRESS_PROGRAM), fd(EGRESS_PROGRAM));
    let mut writer = NodePortWriter::open(pins).expect("open the TC maps");
    writer.set_config(Some(Ipv4Addr::from(SNAT)), Some(Ipv6Addr::from(SNAT6)), SNAT_PORTS).expect("config");
    let v4 = |a: [u8; 4]| IpAddr::V4(Ipv4Addr::from(a));
    let v6 = |a: [u8; 16]| IpAddr::V6(Ipv6Addr::from(a));
    let tc: BTreeMap<Frontend, _> = [
        (fe(v4(NODE), NODE_PORT_TCP, Protocol::Tcp), vec![be(v4(REMOTE_BE), BACKEND_PORT)]),
        (fe(v4(NODE), NODE_PORT_UDP, Protocol::Udp), vec![be(v4(LOCAL_BE), BACKEND_PORT)]),
        (fe(v4(NODE), NODE_PORT_EMPTY, Protocol::Tcp), vec![]),
        (fe(v4(LB), LB_PORT, Protocol::Tcp), vec![be(v4(LOCAL_BE), BACKEND_PORT), be(v4(REMOTE_BE), BACKEND_PORT)]),
        (fe(v6(NODE6), NODE_PORT_TCP, Protocol::Tcp), vec![be(v6(REMOTE_BE6), BACKEND_PORT)]),
    ]
    .into_iter()
    .map(|(f, b)| (f, b.into_iter().collect()))
    .collect();
    let ext = ExternalState { tc, local_endpoints: [v4(LOCAL_BE)].into_iter().collect(), ..ExternalState::default() };
    let outcome = writer.sync(&ext);
    assert!(outcome.failures.is_empty(), "{:?}", outcome.failures);

    // Tracked flows: to a remote backend (SNAT) and to a local one.
    for (proto, dport) in [(6, NODE_PORT_TCP), (17, NODE_PORT_UDP)] {
        let (rc, out) = run(ingress, &flow_packet(proto, CLIENT, CLIENT_PORT, NODE, dport));
        assert_eq!(rc, PASS);
        let (rc, _) = run(egress, &out);
        assert_eq!(rc, PASS);
    }
    let before_all = snapshot(pins, false);
    assert!(before_all[maps::NP_CT.name].len() >= 6, "the tracked flows are in NP_CT");

    let (addrs, ports) = (reserved_addresses(), reserved_ports());
    let mut r = Rng(seed);
    let mut report = Report::default();
    let mut state = snapshot(pins, true);
    for i in 0..count {
        let mut f = frame(&mut r);
        if r.chance(30) {
            mutate(&mut r, &mut f);
            report.mutated += 1;
        }
        report.packets += 1;
        let checked = !may_match(&f, &addrs, &ports);
        for (prog, hook) in [(ingress, "ingress"), (egress, "egress")] {
            let (rc, out) = match try_run(prog, &f) {
                Ok(r) => r,
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    report.refused += 1;
                    continue;
                }
                Err(e) => panic!("BPF_PROG_TEST_RUN on {}: {e}", hex(&f)),
            };
            let after = snapshot(pins, true);
            let what = || format!("packet {i} (seed {seed}) at {hook}: {}", hex(&f));
            assert!(rc == PASS || rc == SHOT, "{}: verdict {rc}", what());
            if checked {
                assert_eq!(rc, PASS, "{}: not ours, yet not passed", what());
                assert!(out == f, "{}: not ours, yet changed to {}", what(), hex(&out));
                for name in [maps::NP_CT.name, maps::NP_AFFINITY.name] {
                    assert!(after[name] == state[name], "{}: not ours, yet {name} changed", what());
                }
                let (old, new) = (counter_sums(&state), counter_sums(&after));
                for (id, (a, b)) in old.iter().zip(&new).enumerate() {
                    let passed = [np_counter::PASS_UNPARSED, np_counter::PASS_FRAGMENT, np_counter::PASS_NOT_OURS].contains(&(id as u32));
                    assert!(
                        a == b || (passed && *b == a + 1),
                        "{}: not ours, yet counter {} went {a} -> {b}",
                        what(),
                        np_counter::NAMES[id]
                    );
                }
            }
            state = after;
        }
        if checked {
            report.checked += 1;
        } else {
            report.may_match += 1;
        }
    }
    // Nothing but the written maps moved, whatever ran: the flows, the
    // affinity entries, the counters, and the per-Service connection counts
    // (NP_SVC_CONN: every new flow to a frontend counts in its tier).
    let after_all = snapshot(pins, false);
    for (name, entries) in &before_all {
        if ![maps::NP_CT.name, maps::NP_AFFINITY.name, maps::NP_COUNTERS.name, maps::NP_SVC_CONN.name].contains(name) {
            assert!(after_all[name] == *entries, "{name} changed during the run; the programs never write it");
        }
    }
    report.counters = counter_sums(&after_all);
    report
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

#[test]
fn packets_that_are_not_ours_pass_unchanged_and_change_no_map() {
    require_root();
    let seed = env_u64("TOPOPROXY_PACKET_FUZZ_SEED", 0x7a11_5eed);
    let count = env_u64("TOPOPROXY_PACKET_FUZZ_COUNT", 3000);
    let netns = Netns::new("tpfz").expect("netns");
    let pins = PinDir::new("tpfz").expect("pins");
    let path = pins.path().to_path_buf();
    let started = Instant::now();
    let report = in_netns(&netns, move || fuzz(&path, seed, count)).expect("fuzz run in its namespace");
    let named: BTreeMap<&str, u64> =
        np_counter::NAMES.iter().zip(&report.counters).filter(|(_, n)| **n > 0).map(|(name, n)| (*name, *n)).collect();
    println!(
        "packet fuzz: seed {seed:#x}, {} packets ({} mutated) through ingress and egress in {:.1?}: {} checked, {} could match, {} runs refused by the test runner; counters {named:?}",
        report.packets,
        report.mutated,
        started.elapsed(),
        report.checked,
        report.may_match,
        report.refused
    );
    assert!(report.checked * 2 > report.packets, "most packets must be checkable: {report:?}");
    assert!(report.refused * 10 < report.packets * 2, "the test runner refused too many runs: {report:?}");
    // The generator reaches the parser's every way out.
    for reason in [np_counter::PASS_UNPARSED, np_counter::PASS_FRAGMENT] {
        assert!(report.counters[reason as usize] > 0, "no packet counted {}: {report:?}", np_counter::NAMES[reason as usize]);
    }
}
