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
//! * `bench_step{1..7}_connect4`: our connect4's work cut off after each of
//!   its steps (see `probe`), for a cost breakdown by difference: the
//!   benchmark attaches one at a time in a child of the bench cgroup, so it
//!   runs right before our `connect4` on the same connect() calls and sees
//!   the address the application asked for.
//! * `bench_minimal_tc`: the least a TC program that looks at the same
//!   traffic must do: the parse of Ethernet + IPv4/IPv6 + TCP/UDP ports that
//!   `np_ingress` does, with exactly its bounds checks (it calls the same
//!   `packet::parse`), then pass. The NodePort target is "at most 2x this".
//! * `bench_empty_tc`: returns at once. Under BPF_PROG_TEST_RUN with one run
//!   per call, its figure is the harness' own overhead (timer reads, bh
//!   disable), which the benchmark subtracts from the other two.
//! * `bench_minimal_xdp`, `bench_tx_xdp`, `bench_drop_xdp`: an XDP program
//!   that passes every frame (the reference for `xdp_nodeport`'s own cost),
//!   and the traffic generator and the sink of the XDP forwarding bench.

use aya_ebpf::{
    EbpfContext,
    bindings::{BPF_F_NO_COMMON_LRU, TC_ACT_OK, TC_ACT_UNSPEC},
    btf_maps::{Array, LruHashMap, SkStorage},
    helpers::{bpf_get_prandom_u32, bpf_get_socket_cookie},
    macros::{btf_map, cgroup_sock_addr, classifier},
    programs::{SockAddrContext, TcContext},
};
use proxy_common::{FAMILY_V4, PROTO_TCP, PROTO_UDP, ServiceKey, SockPeerValue, SockRevNatKey, SockRevNatValue, counter};

use crate::maps::{SERVICES, SOCK_REVNAT, count};
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

/// The steps of `connect4` on a plain Service (no affinity, no source
/// ranges) up to and including step `STEPS`, never rewriting the address:
/// 1 the context reads (protocol, address, port); 2 the `SERVICES` lookup;
/// 3 the random pick and the `SLOTS` lookup; 4 the `BACKENDS` lookup; 5 the
/// socket cookie; 6 the per-socket record (a socket storage element with
/// `SOCK_PEER`'s layout, created); 7 the `TRANSLATED` counter.
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
    let Some(id) = crate::slot_backend_id(&svc, hash) else {
        return 1;
    };
    if STEPS < 4 {
        return 1;
    }
    let Some(backend) = crate::backend_addr(id) else {
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
    // The top bit keeps the alternatives' entries apart from any `connect4`
    // then inserts for the same socket (cookies count up from 1).
    let rev_key = SockRevNatKey::new(cookie | 1 << 63, backend.ip_be, backend.port_be, backend.family);
    let rev_val = SockRevNatValue { ip_be: dst.ip_be, port_be: dst.port_be, family: dst.family, _pad: 0 };
    if STEPS == ALT_PERCPU_LRU {
        let _ = BENCH_LRU_PERCPU.insert(&rev_key, &rev_val, 0);
        return 1;
    }
    if STEPS == ALT_REVNAT_LRU {
        let _ = SOCK_REVNAT.insert(&rev_key, &rev_val, 0);
        return 1;
    }
    if STEPS == ALT_RECYCLED {
        // The entry is removed again at once, so the next insert on this
        // CPU reuses the element just freed (the LRU's local free list is
        // LIFO, kernel/bpf/bpf_lru_list.c): what an insert costs when
        // entries are deleted as their sockets close instead of aging out.
        let _ = SOCK_REVNAT.insert(&rev_key, &rev_val, 0);
        let _ = SOCK_REVNAT.remove(&rev_key);
        return 1;
    }
    let mut peer = SockPeerValue {
        backend_ip_be: backend.ip_be,
        frontend_ip_be: dst.ip_be,
        backend_port_be: backend.port_be,
        frontend_port_be: dst.port_be,
        family: backend.family,
        spilled: 0,
        _pad: [0; 2],
    };
    // SAFETY: as in `remember`: aya passes the context's socket, and the
    // helper copies `peer`, a value of the map's type on our stack, into a
    // new element. A map of its own, so that `connect4` then creates its
    // element in SOCK_PEER as it would without the probe.
    let _ = unsafe { BENCH_SK_STORAGE.get_or_insert_ptr_mut(ctx, Some(&mut peer)) };
    if STEPS >= 7 {
        count(counter::TRANSLATED);
    }
    1
}

/// Alternatives to step 6 (the record in socket storage), measured the
/// same way: the same steps up to the socket cookie, then the translation
/// recorded as a `SOCK_REVNAT` entry (the LRU map UDP connect() and
/// spilled translations use), in an LRU map with per-CPU LRU lists
/// (`BPF_F_NO_COMMON_LRU`), or in `SOCK_REVNAT` and deleted at once.
/// Bench-only maps: the agent's loads of the object create every map in
/// it, so the LRU map is declared with one element (the kernel rounds a
/// per-CPU LRU up to one per possible CPU, `htab_map_alloc`) and the
/// benchmark sizes it like `SOCK_REVNAT` when it loads the object itself;
/// socket storage costs nothing until used.
#[btf_map(name = "BENCH_LRU_PERCPU")]
static BENCH_LRU_PERCPU: LruHashMap<SockRevNatKey, SockRevNatValue, 1, { BPF_F_NO_COMMON_LRU as usize }> = LruHashMap::new();

#[btf_map(name = "BENCH_SK_STORAGE")]
static BENCH_SK_STORAGE: SkStorage<SockPeerValue> = SkStorage::new();

#[cgroup_sock_addr(connect4)]
pub fn bench_alt_percpu_lru_connect4(ctx: SockAddrContext) -> i32 {
    probe::<{ ALT_PERCPU_LRU }>(&ctx)
}

#[cgroup_sock_addr(connect4)]
pub fn bench_alt_revnat_lru_connect4(ctx: SockAddrContext) -> i32 {
    probe::<{ ALT_REVNAT_LRU }>(&ctx)
}

#[cgroup_sock_addr(connect4)]
pub fn bench_alt_recycled_connect4(ctx: SockAddrContext) -> i32 {
    probe::<{ ALT_RECYCLED }>(&ctx)
}

const ALT_PERCPU_LRU: u8 = 100;
const ALT_REVNAT_LRU: u8 = 101;
const ALT_RECYCLED: u8 = 102;

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

/// The least an XDP program can do: pass every frame. The reference for
/// `xdp_nodeport`'s per-packet cost under BPF_PROG_TEST_RUN: its figure is
/// the harness' own overhead plus an XDP program's entry and exit.
#[aya_ebpf::macros::xdp]
pub fn bench_minimal_xdp(_ctx: aya_ebpf::programs::XdpContext) -> u32 {
    aya_ebpf::bindings::xdp_action::XDP_PASS
}

/// The receiving end of the XDP forwarding bench, on the backend's veth:
/// drops every frame, so that what the benchmark compares is the node's
/// forwarding and not the backend's stack (the veth counts a frame as
/// received before its XDP program runs, drivers/net/veth.c
/// `veth_xdp_rcv`).
#[aya_ebpf::macros::xdp]
pub fn bench_drop_xdp(_ctx: aya_ebpf::programs::XdpContext) -> u32 {
    aya_ebpf::bindings::xdp_action::XDP_DROP
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
