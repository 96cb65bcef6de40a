//! Reference programs for `cargo xtask bench`, never used by the agent.
//!
//! They live in the same object so that the benchmark compares our programs
//! with programs built by the same toolchain and loaded the same way. The
//! agent loads programs only by name (`loader::PROGRAMS`,
//! `tc_loader::{INGRESS,EGRESS}_PROGRAM`); aya leaves every other program of
//! the object unloaded, so these cost nothing in the kernel unless the
//! benchmark asks for them.
//!
//! * `bench_empty_connect4`: a cgroup/connect4 program that lets every call
//!   through. The kernel's run-time statistics (`bpf_stats_enabled`) of our
//!   `connect4` are compared with its figure under the same connect() load.
//! * `bench_step{1..8}_connect4`: our connect4's work cut off after each of
//!   its steps (see `probe`), for a cost breakdown by difference: the
//!   benchmark attaches one at a time in a child of the bench cgroup, so it
//!   runs right before our `connect4` on the same connect() calls and sees
//!   the address the application asked for. `bench_alt_{storage,cilium}_connect4`:
//!   the same whole path with the previous build's record (socket storage)
//!   and Cilium's (a shared-list LRU insert keyed by {cookie, backend}).
//!   `bench_alt_cookie_array_connect4`: the record in an array indexed by
//!   the cookie's low bits, the whole cookie in the element, the hash only
//!   on a collision (issue #47's proposal, measured before it is built).
//! * `bench_empty_sock_release`, `bench_empty_recvmsg4`: the references for
//!   our `sock_release` per close and `recvmsg4` per received datagram.
//! * `bench_minimal_tc`: the least a TC program that looks at the same
//!   traffic must do: the parse of Ethernet + IPv4/IPv6 + TCP/UDP ports that
//!   `np_ingress` does, with exactly its bounds checks (it calls the same
//!   `packet::parse`), then pass. The NodePort target is "at most 2x this".
//! * `bench_empty_tc`: returns at once. Under BPF_PROG_TEST_RUN with one run
//!   per call, its figure is the harness' own overhead (timer reads, bh
//!   disable), which the benchmark subtracts from the other two.
//! * `bench_redirect_tc`: sends every packet to one device with
//!   `bpf_redirect`, the floor of the forwarding bench's TC rows.
//! * `bench_minimal_xdp`, `bench_tx_xdp`, `bench_drop_xdp`: an XDP program
//!   that passes every frame (the reference for `xdp_nodeport`'s own cost),
//!   and the traffic generator and the sink of the XDP forwarding bench.

use aya_ebpf::{
    EbpfContext,
    bindings::{BPF_NOEXIST, TC_ACT_OK, TC_ACT_UNSPEC},
    btf_maps::{Array, HashMap, LruHashMap, SkStorage},
    helpers::{bpf_get_prandom_u32, bpf_get_socket_cookie},
    macros::{btf_map, cgroup_sock, cgroup_sock_addr, classifier},
    programs::{SockAddrContext, SockContext, TcContext},
};
use proxy_common::{
    FAMILY_V4, PROTO_TCP, PROTO_UDP, SOCK_REC_COUNTED, ServiceKey, SockPeerValue, SockRecValue, SockRevNatKey, SockRevNatValue, counter,
    sock_rec_count_slot,
};

use core::ptr::{addr_of, addr_of_mut, read_volatile};

use crate::maps::{SERVICES, count};
use crate::packet::{Parsed, parse};
use crate::sockaddr::read_peer;

#[cgroup_sock_addr(connect4)]
pub fn bench_empty_connect4(_ctx: SockAddrContext) -> i32 {
    1 // allow the connect() unchanged
}

#[cgroup_sock_addr(connect4)]
pub fn bench_step1_connect4(ctx: SockAddrContext) -> i32 {
    probe::<1>(&ctx)
}

#[cgroup_sock_addr(connect4)]
pub fn bench_step2_connect4(ctx: SockAddrContext) -> i32 {
    probe::<2>(&ctx)
}

#[cgroup_sock_addr(connect4)]
pub fn bench_step3_connect4(ctx: SockAddrContext) -> i32 {
    probe::<3>(&ctx)
}

#[cgroup_sock_addr(connect4)]
pub fn bench_step4_connect4(ctx: SockAddrContext) -> i32 {
    probe::<4>(&ctx)
}

#[cgroup_sock_addr(connect4)]
pub fn bench_step5_connect4(ctx: SockAddrContext) -> i32 {
    probe::<5>(&ctx)
}

#[cgroup_sock_addr(connect4)]
pub fn bench_step6_connect4(ctx: SockAddrContext) -> i32 {
    probe::<6>(&ctx)
}

#[cgroup_sock_addr(connect4)]
pub fn bench_step7_connect4(ctx: SockAddrContext) -> i32 {
    probe::<7>(&ctx)
}

#[cgroup_sock_addr(connect4)]
pub fn bench_step8_connect4(ctx: SockAddrContext) -> i32 {
    probe::<8>(&ctx)
}

/// The steps of `connect4` on a plain Service (no affinity, no source
/// ranges) up to and including step `STEPS`, never rewriting the address:
/// 1 the context reads (protocol, address, port); 2 the `SERVICES` lookup;
/// 3 the random pick and the `SLOTS` lookup; 4 the `BACKENDS` lookup; 5 the
/// socket cookie; 6 the per-socket record (an insert into a preallocated
/// hash with `SOCK_REC`'s key, value and capacity); 7 the `TRANSLATED`
/// counter; 8 the per-Service tier count (`SVC_CONN`, `SVC_TOPO`).
/// `ALT_STORAGE`, `ALT_CILIUM` and `ALT_COOKIE_ARRAY` replace steps 6
/// and 7 with the previous build's record, Cilium's and the proposed
/// cookie-indexed array.
/// `connect4` itself adds the address stores to step 7. Every probe lets
/// the call through unchanged; the compiler keeps each step all the same
/// (context loads are volatile, map operations and helpers are calls).
#[inline(always)]
fn probe<const STEPS: u8>(ctx: &SockAddrContext) -> i32 {
    let sa = ctx.sock_addr;
    // SAFETY: as in `try_forward`: the kernel's `bpf_sock_addr` context,
    // `protocol` read as one 4-byte load the verifier rewrites.
    let proto = unsafe { (*sa).protocol } as u8;
    if proto != PROTO_TCP && proto != PROTO_UDP {
        return 1;
    }
    let dst = read_peer::<FAMILY_V4>(sa);
    if STEPS < 2 {
        return 1;
    }
    let key = ServiceKey { ip_be: dst.ip_be, port_be: dst.port_be, proto, family: dst.family };
    // SAFETY: as in `try_forward`: valid value memory for the run, copied
    // out at once.
    let Some(svc) = (unsafe { SERVICES.get(&key) }).copied() else {
        return 1;
    };
    if STEPS < 3 || svc.backend_count == 0 {
        return 1;
    }
    // SAFETY: the helper takes no arguments and touches no memory of ours.
    let hash = unsafe { bpf_get_prandom_u32() };
    let Some(id) = super::sock::slot_backend_id(&svc, hash) else {
        return 1;
    };
    if STEPS < 4 {
        return 1;
    }
    let Some((backend, tier)) = super::sock::backend_addr(id) else {
        return 1;
    };
    if STEPS < 5 {
        return 1;
    }
    // SAFETY: the helper gets this program's own context, as it requires.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    if STEPS < 6 {
        return 1;
    }
    // The record of `connect4` (`record` in sock.rs), for the SOCK_REC
    // step and the cookie-indexed array; the other variants store their
    // own values, and their copies of this function drop it (`STEPS` is a
    // constant).
    let rec = SockRecValue {
        backend_ip_be: backend.ip_be,
        frontend_ip_be: dst.ip_be,
        service_id: svc.service_id,
        backend_port_be: backend.port_be,
        frontend_port_be: dst.port_be,
        family: backend.family,
        proto,
        counted: SOCK_REC_COUNTED,
        _pad: 0,
    };
    if STEPS == ALT_CILIUM {
        // Cilium's `sock4_update_revnat`: a shared-list LRU hash keyed by
        // {cookie, backend address, port}.
        let rev_key = SockRevNatKey::new(cookie, backend.ip_be, backend.port_be, backend.family);
        let rev_val = SockRevNatValue { ip_be: dst.ip_be, port_be: dst.port_be, family: dst.family, _pad: 0 };
        let _ = BENCH_LRU_SHARED.insert(&rev_key, &rev_val, 0);
        count(counter::TRANSLATED);
        return 1;
    }
    if STEPS == ALT_COOKIE_ARRAY {
        cookie_array_record(cookie, rec);
        count(counter::TRANSLATED);
        return 1;
    }
    if STEPS == ALT_STORAGE {
        let mut peer = SockPeerValue {
            backend_ip_be: backend.ip_be,
            frontend_ip_be: dst.ip_be,
            backend_port_be: backend.port_be,
            frontend_port_be: dst.port_be,
            family: backend.family,
            spilled: 0,
            _pad: [0; 2],
        };
        // SAFETY: as in `remember`: aya passes the context's socket, and
        // the helper copies `peer`, a value of the map's type on our
        // stack, into a new element. A map of its own, so that `connect4`
        // then records as it would without the probe.
        let _ = unsafe { BENCH_SK_STORAGE.get_or_insert_ptr_mut(ctx, Some(&mut peer)) };
        count(counter::TRANSLATED);
        return 1;
    }
    // `connect4`'s record (`record` in sock.rs), in maps of its own with
    // SOCK_REC's and SOCK_REC_COUNT's types and sizes, so that `connect4`
    // then records in SOCK_REC as it would without the probe; the
    // benchmark empties them after each run, as the release program
    // keeps SOCK_REC.
    if BENCH_SOCK_REC.insert(cookie, rec, u64::from(BPF_NOEXIST)).is_ok() {
        bench_count_add(cookie, 1);
    }
    if STEPS >= 7 {
        count(counter::TRANSLATED);
    }
    if STEPS >= 8 {
        // The per-Service tier count of this build (issue #34), into the
        // agent's own arrays: the bench reads no counts, and the element
        // is the one our connect4 then adds to, as on the real path.
        crate::maps::count_connection(&svc, tier);
    }
    1
}

/// Bench-only maps: the agent's loads of the object create every map in
/// it, so they are declared with one element and the benchmark sizes them
/// like `SOCK_REC` and `SOCK_REVNAT` when it loads the object itself;
/// socket storage costs nothing until used.
#[btf_map(name = "BENCH_SOCK_REC")]
static BENCH_SOCK_REC: HashMap<u64, SockRecValue, 1> = HashMap::new();

#[btf_map(name = "BENCH_LRU_SHARED")]
static BENCH_LRU_SHARED: LruHashMap<SockRevNatKey, SockRevNatValue, 1> = LruHashMap::new();

/// The probes' `SOCK_REC_COUNT` (the benchmark gives it as many slots).
#[btf_map(name = "BENCH_SOCK_REC_COUNT")]
static BENCH_SOCK_REC_COUNT: Array<u64, 1> = Array::new();

/// `add_to_record_count` (sock.rs) on the probes' count.
#[inline(always)]
fn bench_count_add(cookie: u64, delta: u64) {
    if let Some(c) = BENCH_SOCK_REC_COUNT.get_ptr_mut(sock_rec_count_slot(cookie)) {
        // SAFETY: an aligned u64 of an array element, valid for the run,
        // updated only atomically.
        unsafe { super::sock::atomic_add(c, delta) };
    }
}

/// One element of the cookie-indexed record array: exactly a 64-byte
/// cache line's worth (the array rounds values to 8 bytes, so consecutive
/// cookies take consecutive lines). Bench-only: userspace never reads it,
/// so it stays here rather than in proxy-common.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CookieRecSlot {
    /// The cookie whose record this is; 0 when free (the kernel never
    /// hands out cookie 0: `sock_gen_cookie` starts its counter at 1).
    cookie: u64,
    /// Records of cookies with this slot that went to the hash because the
    /// slot was taken: the release looks the hash up only when it is not 0,
    /// as `SOCK_REC_COUNT` tells it today.
    in_hash: u64,
    rec: SockRecValue,
    _pad: u32,
}

const _: () = assert!(core::mem::size_of::<CookieRecSlot>() == 64);

/// The cookie-indexed records; the benchmark gives it `SOCK_REC_COUNT`'s
/// number of slots, the lines today's count already touches.
#[btf_map(name = "BENCH_REC_ARRAY")]
static BENCH_REC_ARRAY: Array<CookieRecSlot, 1> = Array::new();

/// `*p = new` if `*p == expected`, as one atomic instruction
/// (`BPF_ATOMIC | BPF_CMPXCHG`, Linux 5.12); returns what `*p` was.
/// Needed because connects of sockets whose cookies share a slot run on
/// every CPU at once: only one of them may take a free slot.
///
/// # Safety
/// `p` must point to an aligned u64 of map value memory valid for the run.
#[inline(always)]
unsafe fn compare_exchange(p: *mut u64, expected: u64, new: u64) -> u64 {
    let old: u64;
    // SAFETY: as the caller vouches; the instruction writes only `*p`
    // (and r0, declared).
    unsafe {
        core::arch::asm!(
            "r0 = cmpxchg_64({p} + 0, r0, {v})",
            p = in(reg) p,
            v = in(reg) new,
            inout("r0") expected => old,
            options(nostack),
        );
    }
    old
}

/// The proposed record: the cookie's own slot when it is free (one
/// compare-and-exchange and the stores, on the line of the slot next to
/// the last sockets'), the preallocated hash when another live socket's
/// cookie holds the slot (and the slot's `in_hash` raised, so that the
/// release knows to look there).
#[inline(always)]
fn cookie_array_record(cookie: u64, rec: SockRecValue) {
    let Some(slot) = BENCH_REC_ARRAY.get_ptr_mut(sock_rec_count_slot(cookie)) else {
        return;
    };
    // SAFETY: an array element, never freed while the map exists; its
    // first field is an aligned u64.
    let owner = unsafe { compare_exchange(addr_of_mut!((*slot).cookie), 0, cookie) };
    if owner == 0 || owner == cookie {
        // SAFETY: the slot is this socket's now; only its connect (under
        // the socket lock) and its release write the record.
        unsafe { (*slot).rec = rec };
        return;
    }
    if BENCH_SOCK_REC.insert(cookie, rec, u64::from(BPF_NOEXIST)).is_ok() {
        // SAFETY: an aligned u64 of the element, updated only atomically.
        unsafe { super::sock::atomic_add(addr_of_mut!((*slot).in_hash), 1) };
    }
}

/// The release side of `cookie_array_record`.
#[inline(always)]
fn cookie_array_release(cookie: u64) {
    let Some(slot) = BENCH_REC_ARRAY.get_ptr_mut(sock_rec_count_slot(cookie)) else {
        return;
    };
    // SAFETY: as in `cookie_array_record`.
    unsafe {
        if compare_exchange(addr_of_mut!((*slot).cookie), cookie, 0) == cookie {
            return;
        }
        if read_volatile(addr_of!((*slot).in_hash)) != 0 && BENCH_SOCK_REC.remove(cookie).is_ok() {
            super::sock::atomic_add(addr_of_mut!((*slot).in_hash), u64::MAX);
        }
    }
}

#[btf_map(name = "BENCH_SK_STORAGE")]
static BENCH_SK_STORAGE: SkStorage<SockPeerValue> = SkStorage::new();

/// The whole hit path with the previous build's record: the steps up to
/// the socket cookie, a socket storage element created (`SOCK_PEER`'s
/// layout), the counter.
#[cgroup_sock_addr(connect4)]
pub fn bench_alt_storage_connect4(ctx: SockAddrContext) -> i32 {
    probe::<{ ALT_STORAGE }>(&ctx)
}

/// The whole hit path shaped like Cilium's: the steps up to the socket
/// cookie, a shared-list LRU insert keyed by {cookie, backend}, the
/// counter.
#[cgroup_sock_addr(connect4)]
pub fn bench_alt_cilium_connect4(ctx: SockAddrContext) -> i32 {
    probe::<{ ALT_CILIUM }>(&ctx)
}

/// The whole hit path with the cookie-indexed record array: the steps up
/// to the socket cookie, the record in the cookie's slot (the hash on a
/// collision), the counter.
#[cgroup_sock_addr(connect4)]
pub fn bench_alt_cookie_array_connect4(ctx: SockAddrContext) -> i32 {
    probe::<{ ALT_COOKIE_ARRAY }>(&ctx)
}

const ALT_STORAGE: u8 = 100;
const ALT_CILIUM: u8 = 101;
const ALT_COOKIE_ARRAY: u8 = 102;

/// The reference for `sock_release`: runs on the same closes, does nothing.
#[cgroup_sock(sock_release)]
pub fn bench_empty_sock_release(_ctx: SockContext) -> i32 {
    1
}

/// Gives back what the connect4 probes recorded for a closing socket, as
/// the agent's `sock_release` does for `SOCK_REC` and Cilium's for its LRU
/// map (cilium/cilium#39486), so that the probes' inserts reuse freed
/// elements as the real ones do. Attached next to the probes only; not
/// measured. Cilium's key is rebuilt from the socket's peer, the backend.
#[cgroup_sock(sock_release)]
pub fn bench_release_probe_maps(ctx: SockContext) -> i32 {
    // SAFETY: the helper gets this program's own context.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    cookie_array_release(cookie);
    if BENCH_SOCK_REC.remove(cookie).is_ok() {
        bench_count_add(cookie, u64::MAX);
    }
    // SAFETY: `ctx.sock` is the kernel's `bpf_sock` context; the verifier
    // rewrites these loads into reads of the socket.
    let (ip, port) = unsafe { (read_volatile(addr_of!((*ctx.sock).dst_ip4)), read_volatile(addr_of!((*ctx.sock).dst_port))) };
    let _ = BENCH_LRU_SHARED.remove(&SockRevNatKey::new(cookie, [ip, 0, 0, 0], port, FAMILY_V4));
    1
}

/// `sock_release`'s work cut off after each step, for its breakdown on a
/// miss: 1 the protocol load; 2 the socket cookie; 3 the cookie's
/// `SOCK_REC_COUNT` slot (our whole miss path: the slot is 0).
/// `RELEASE_ALT_LOOKUP` replaces the slot read with the `SOCK_REC` lookup
/// the previous build made on every release, the alternative the count
/// saves.
#[inline(always)]
fn release_probe<const STEPS: u8>(ctx: &SockContext) -> i32 {
    // SAFETY: as in `try_release`.
    let proto = unsafe { read_volatile(addr_of!((*ctx.sock).protocol)) } as u8;
    if STEPS < 2 || (proto != PROTO_TCP && proto != PROTO_UDP) {
        return 1;
    }
    // SAFETY: the helper gets this program's own context.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    if STEPS == RELEASE_ALT_LOOKUP {
        let _ = crate::maps::SOCK_REC.get_ptr(cookie);
        return 1;
    }
    if STEPS < 3 {
        return 1;
    }
    if super::sock::may_have_record(cookie) {
        // Never on the benchmark's miss runs; there so that the compiler
        // keeps the slot read.
        let _ = crate::maps::SOCK_REC.get_ptr(cookie);
    }
    1
}

const RELEASE_ALT_LOOKUP: u8 = 100;

#[cgroup_sock(sock_release)]
pub fn bench_release_step1(ctx: SockContext) -> i32 {
    release_probe::<1>(&ctx)
}

#[cgroup_sock(sock_release)]
pub fn bench_release_step2(ctx: SockContext) -> i32 {
    release_probe::<2>(&ctx)
}

#[cgroup_sock(sock_release)]
pub fn bench_release_step3(ctx: SockContext) -> i32 {
    release_probe::<3>(&ctx)
}

#[cgroup_sock(sock_release)]
pub fn bench_release_alt_lookup(ctx: SockContext) -> i32 {
    release_probe::<{ RELEASE_ALT_LOOKUP }>(&ctx)
}

/// The reference for `recvmsg4` on a UDP socket we never translated.
#[cgroup_sock_addr(recvmsg4)]
pub fn bench_empty_recvmsg4(_ctx: SockAddrContext) -> i32 {
    1
}

#[classifier]
pub fn bench_minimal_tc(ctx: TcContext) -> i32 {
    try_minimal_tc(&ctx)
}

#[inline(always)]
fn try_minimal_tc(ctx: &TcContext) -> i32 {
    // The verdict depends on every parsed field, so that the compiler
    // keeps the whole parse: the common case reads the packet directly
    // (no helper calls it could not drop), and a result nobody uses would
    // let it drop those reads. Both verdicts let the packet pass.
    let mix = match parse(ctx) {
        Parsed::L4(p) => {
            p.saddr.iter().chain(p.daddr.iter()).fold(0u32, |a, w| a ^ w)
                ^ (u32::from(p.sport_be) << 16 | u32::from(p.dport_be))
                ^ u32::from(p.tcp_flags)
                ^ u32::from(p.proto) << 8
                ^ (p.l4 as u32) << 24
        }
        Parsed::Icmp(i) => i.saddr[0] ^ i.daddr[0],
        Parsed::Other(reason) => reason,
        Parsed::NotIp => 1,
    };
    if mix == 0x5a5a_5a5a { TC_ACT_UNSPEC } else { TC_ACT_OK }
}

#[classifier]
pub fn bench_empty_tc(_ctx: TcContext) -> i32 {
    TC_ACT_OK
}

/// The device `bench_redirect_tc` sends every packet to (element 0; 0 =
/// none), written by the benchmark.
#[btf_map(name = "BENCH_REDIRECT_TO")]
static BENCH_REDIRECT_TO: Array<u32, 1> = Array::new();

/// The floor of any TC forwarding path, for the forwarding bench's
/// `tc-floor` row: every packet goes to the egress of one device with
/// `bpf_redirect`, unparsed and unwritten (the bench's sink drops the
/// frames whatever their addresses). What a TC fast path costs above the
/// skb's own path (building it, GRO, `dev_queue_xmit`, the veth) is the
/// distance between this row and `tc-fast`.
#[classifier]
pub fn bench_redirect_tc(_ctx: TcContext) -> i32 {
    match BENCH_REDIRECT_TO.get(0) {
        // SAFETY: no memory is passed; the helper records the target.
        Some(&ifindex) if ifindex != 0 => unsafe { aya_ebpf::helpers::bpf_redirect(ifindex, 0) as i32 },
        _ => TC_ACT_OK,
    }
}

/// The least an XDP program can do: pass every frame. The reference for
/// `xdp_nodeport`'s per-packet cost under BPF_PROG_TEST_RUN: its figure is
/// the harness' own overhead plus an XDP program's entry and exit.
#[aya_ebpf::macros::xdp]
pub fn bench_minimal_xdp(_ctx: aya_ebpf::programs::XdpContext) -> u32 {
    aya_ebpf::bindings::xdp_action::XDP_PASS
}

/// The receiving end of the XDP forwarding bench, on the backend's veth:
/// drops every IPv4 UDP frame (the floods), so that what the benchmark
/// compares is the node's forwarding and not the backend's stack (the veth
/// counts a frame as received before its XDP program runs,
/// drivers/net/veth.c `veth_xdp_rcv`). Everything else (the TCP requests
/// measured through the same node, ARP) passes to the backend's stack.
#[aya_ebpf::macros::xdp]
pub fn bench_drop_xdp(ctx: aya_ebpf::programs::XdpContext) -> u32 {
    use aya_ebpf::bindings::xdp_action::{XDP_DROP, XDP_PASS};
    let (data, end) = (ctx.data(), ctx.data_end());
    // Ethernet type at 12, IPv4's protocol at 14 + 9.
    if data + 24 > end {
        return XDP_PASS;
    }
    // SAFETY: both bytes lie inside the frame (checked above).
    let (ty, proto) = unsafe { (*((data + 12) as *const [u8; 2]), *((data + 23) as *const u8)) };
    if ty == [0x08, 0x00] && proto == 17 { XDP_DROP } else { XDP_PASS }
}

/// The frame `bench_tx_xdp` sends, written by the benchmark: 64 bytes.
#[btf_map(name = "BENCH_TX_FRAME")]
static BENCH_TX_FRAME: Array<[u64; 8], 1> = Array::new();

/// The traffic generator of the XDP forwarding bench: run under
/// BPF_PROG_TEST_RUN in live-frames mode with the client's veth as the
/// ingress device, XDP_TX sends each frame out of that veth into its peer,
/// the node's device, as an `xdp_frame` (no skb), the way a NIC hands
/// frames to native XDP. The frame is written from `BENCH_TX_FRAME` on
/// every run: live-frames mode fills a page with the caller's frame only
/// when its page pool first creates the page (net/bpf/test_run.c,
/// `xdp_test_run_init_page`), and the node rewrites the frame in place
/// (DNAT) before the page comes back, so an unwritten recycled page would
/// carry the translated frame instead.
#[aya_ebpf::macros::xdp]
pub fn bench_tx_xdp(ctx: aya_ebpf::programs::XdpContext) -> u32 {
    try_tx(&ctx).unwrap_or(aya_ebpf::bindings::xdp_action::XDP_ABORTED)
}

fn try_tx(ctx: &aya_ebpf::programs::XdpContext) -> Option<u32> {
    let frame = BENCH_TX_FRAME.get(0)?;
    let start = ctx.data();
    if start + 64 > ctx.data_end() {
        return None;
    }
    let p = start as *mut u64;
    for (i, w) in frame.iter().enumerate() {
        // SAFETY: the 64 bytes at `start` are inside the frame (checked
        // above); XDP data starts XDP_PACKET_HEADROOM (256) bytes into its
        // page, so the words are aligned. Volatile word stores keep the
        // copy from becoming a memcpy call.
        unsafe { p.add(i).write_volatile(*w) };
    }
    Some(aya_ebpf::bindings::xdp_action::XDP_TX)
}
