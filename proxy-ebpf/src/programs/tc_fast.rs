//! The TC fast path (`--tc-fast-path auto`): a NodePort, LoadBalancer or
//! externalIP packet of a flow to a remote backend, and that backend's
//! reply, leaves from TC ingress straight to its next hop.
//!
//! Without it, `np_ingress` rewrites the destination and returns
//! `TC_ACT_UNSPEC`: the packet then walks `ip_rcv`, the routing decision,
//! netfilter's PREROUTING, FORWARD and POSTROUTING chains and conntrack,
//! and `np_egress` rewrites the source after routing. Here both rewrites
//! happen at ingress (the source rewrite at ingress is safe because the
//! packet never meets `fib_validate_source`, which is what keeps it at
//! egress on the stack path: nodeport.rs), the route comes from
//! `bpf_fib_lookup` and the packet goes out with `bpf_redirect` to the
//! egress of the route's device (`skb_do_redirect` -> `dev_queue_xmit`),
//! with the MACs the lookup returned. That is what the stack's forwarding
//! does without its hooks: so netfilter, its conntrack and a host
//! firewall's rules never see these packets.
//!
//! The next hop is the XDP program's (xdp.rs): the same per-flow cache
//! `XDP_NEXTHOP` (key: the packet as it leaves and its input device), the
//! same rule for its lifetime (a second) and for the MTU (a packet longer
//! than the cached entry was checked for asks the helper again, which
//! answers "fragmentation needed" where the route's MTU is smaller). One
//! map serves both programs: the agent loads them from one object.
//!
//! The neighbour must be resolved: `BPF_FIB_LKUP_RET_NO_NEIGH` (and any
//! other failed lookup) leaves the packet to the stack, which resolves it,
//! and later packets of the flow go fast. `bpf_redirect_neigh` (5.10) would
//! resolve it from here, but a flow's first packets are few and the stack
//! handles them correctly, so one helper set serves every kernel from the
//! 5.10 floor (`bpf_fib_lookup` 4.18, `bpf_redirect` 4.4).
//!
//! A backend on this node (a pod) gets its packets with
//! `bpf_redirect_peer` (Linux 5.10, TC ingress only): the skb moves to the
//! ingress of the route's veth's peer, inside the pod's namespace, without
//! the host's forwarding, the veth's transmit and the backlog queue
//! (`skb_do_redirect` with `BPF_F_PEER`, net/core/filter.c). The helper
//! drops the packet when the device has no peer or the peer is in this
//! namespace, which the program cannot tell from the device index: the
//! agent lists the devices where it works in `NP_PEER_DEVS` (veths whose
//! peer is in another namespace), and a local backend routed through any
//! other device (a bridge, the node itself for a host-network endpoint)
//! goes to the stack. Only the forward direction: the pod's reply enters
//! through its veth, where no program of ours runs, and the stack forwards
//! it (`np_egress` turns its source back, as without the fast path).
//!
//! Fails open: every packet it cannot send is translated as before and
//! passed to the stack, counted by reason in `NP_FAST_COUNTERS`.

use aya_ebpf::{
    bindings::{BPF_FIB_LKUP_RET_FRAG_NEEDED, BPF_FIB_LKUP_RET_NOT_FWDED, bpf_fib_lookup as FibParams},
    helpers::{bpf_fib_lookup, bpf_redirect, bpf_redirect_peer},
    macros::map,
    maps::PerCpuArray,
    programs::TcContext,
};
use proxy_common::{CtValue, FAMILY_V4, XdpNextHopKey, XdpNextHopValue, np_fast_counter, xdp_nexthop_usable};

use super::xdp::{AF_INET, AF_INET6, FIB_SUCCESS, XDP_NEXTHOP, fib_params_for, remember_next_hop};
use crate::nodeport_maps::NP_PEER_DEVS;
use crate::packet::{ETH_HLEN, Pkt, V4_FRAME_LEN, addr_copy, forward_v4, read_at};

/// 1 when the loader turned the fast path on (`TC_FAST_PATH_GLOBAL`). In
/// `.rodata`, frozen at load (aya freezes read-only data maps), so the
/// verifier knows its value and drops the branch not taken.
#[unsafe(no_mangle)]
static TC_FAST_PATH: u8 = 0;

#[map(name = "NP_FAST_COUNTERS")]
static NP_FAST_COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(np_fast_counter::COUNT, 0);

/// `BPF_FIB_LKUP_RET_FRAG_NEEDED` (include/uapi/linux/bpf.h).
const FIB_FRAG_NEEDED: i64 = BPF_FIB_LKUP_RET_FRAG_NEEDED as i64;
/// `BPF_FIB_LKUP_RET_NOT_FWDED`: the destination is this node (a local
/// route), not something to forward.
const FIB_NOT_FWDED: i64 = BPF_FIB_LKUP_RET_NOT_FWDED as i64;

/// `route`'s answer when the packet must go to the stack as it is (the
/// reason has been counted).
pub const TO_STACK: i64 = -1;

/// Set in `route`'s answer (above the device index) when it has also
/// translated the packet (`packet::forward_v4`); otherwise the caller
/// still rewrites the addresses and ports.
pub const TRANSLATED: i64 = 1 << 32;

#[inline(always)]
pub fn enabled() -> bool {
    // SAFETY: a plain read of a static the loader may have patched; volatile
    // so that the compiler does not fold the initial 0 in.
    unsafe { core::ptr::read_volatile(&TC_FAST_PATH) != 0 }
}

/// Bumps one fast-path counter of this CPU (no other TC program runs on it
/// until this one returns, see `np_count`).
#[inline(always)]
pub fn count(reason: u32) {
    if let Some(p) = NP_FAST_COUNTERS.get_ptr_mut(reason) {
        // SAFETY: this CPU's slot of a bounds-checked array element, never
        // freed while the map exists; no other reference to it is live.
        unsafe { *p += 1 };
    }
}

/// Sends the packet out with `bpf_redirect` to `ifindex` (what `route`
/// returned), after the caller rewrote it.
#[inline(always)]
pub fn redirect(ifindex: u32) -> i32 {
    // SAFETY: no memory is passed; the helper records the target for this
    // CPU and returns TC_ACT_REDIRECT (flags 0: the device's egress).
    unsafe { bpf_redirect(ifindex, 0) as i32 }
}

/// Hands the packet to the ingress of the peer of the veth `ifindex` (what
/// `route` returned for a local backend, checked against `NP_PEER_DEVS`),
/// after the caller rewrote it.
#[inline(always)]
pub fn redirect_peer(ifindex: u32) -> i32 {
    // SAFETY: no memory is passed; the helper records the target for this
    // CPU and returns TC_ACT_REDIRECT (flags must be 0).
    unsafe { bpf_redirect_peer(ifindex, 0) as i32 }
}

/// Prepares the packet `p`, which is about to be rewritten to `to` (the
/// flow's packet as it leaves), for its next hop: checks the TTL or hop
/// limit, finds the route (cache or `bpf_fib_lookup`), then decrements the
/// TTL or hop limit and writes the MACs. For IPv4 without options whose
/// headers are in the linear data (nearly every packet) it translates the
/// packet to `to` in the same writes (`packet::forward_v4`: one store and
/// the L4 checksum, where the steps one by one take a dozen helper calls)
/// and sets `TRANSLATED` in its answer. Returns the output device's index
/// (with that bit), `TO_STACK` (nothing written, reason counted) or
/// another negative value when a store failed (the packet may be half
/// written: the caller drops it). With `peer` (a backend on this node, for
/// `redirect_peer`), the output device must be in `NP_PEER_DEVS`. Its own
/// subprogram: the key and the next hop stay out of the caller's frame.
#[inline(never)]
pub fn route(ctx: &TcContext, p: &Pkt, to: &CtValue, now_s: u32, peer: bool) -> i64 {
    match route_inner(ctx, p, to, now_s, peer) {
        Ok(answer) => answer,
        Err(TO_STACK) => TO_STACK,
        // A helper's error (negative errno) is never `TO_STACK` (-EPERM
        // is -1): kept apart all the same.
        Err(e) => e.min(-2),
    }
}

#[inline(always)]
fn route_inner(ctx: &TcContext, p: &Pkt, to: &CtValue, now_s: u32, peer: bool) -> Result<i64, i64> {
    let v4 = p.family == FAMILY_V4;
    // IPv4 options and IPv6 extension headers: the stack processes what a
    // router must (record route and timestamps, `ip_forward_options`;
    // hop-by-hop options, `ip6_forward`), so such packets go its way, as
    // XDP leaves them to TC.
    if p.l4 != p.l3 + if v4 { 20 } else { 40 } {
        count(np_fast_counter::STACK_IP_OPTIONS);
        return Err(TO_STACK);
    }
    // The length `bpf_fib_lookup` compares with the route's MTU, as the XDP
    // path gives it (see xdp.rs, `forward`): IPv4's total length, IPv6's
    // payload length plus the fixed header. A GRO aggregate carries the
    // aggregate's length (`inet_gro_complete`), so it goes to the stack,
    // which segments it.
    // The common case, IPv4 without options with the headers and ports in
    // the linear data, is read directly (and written whole below).
    let (data, end) = (ctx.data(), ctx.data_end());
    let linear_v4 = v4 && p.l3 == ETH_HLEN && data + V4_FRAME_LEN <= end;
    let (len, hops) = if linear_v4 {
        (u16::from_be(read_at::<u16>(data, ETH_HLEN + 2)), read_at::<u8>(data, ETH_HLEN + 8))
    } else if v4 {
        (u16::from_be(ctx.load::<u16>(p.l3 + 2)?), ctx.load::<u8>(p.l3 + 8)?)
    } else {
        (u16::from_be(ctx.load::<u16>(p.l3 + 4)?).saturating_add(40), ctx.load::<u8>(p.l3 + 7)?)
    };
    if hops <= 1 {
        // The stack sends time exceeded (`ip_forward`, `ip6_forward`).
        count(np_fast_counter::STACK_TTL);
        return Err(TO_STACK);
    }
    // SAFETY: the context is this program's `__sk_buff`; a field read.
    let ingress_ifindex = unsafe { (*ctx.skb.skb).ingress_ifindex };
    let key = XdpNextHopKey {
        saddr_be: addr_copy(&to.saddr_be),
        daddr_be: addr_copy(&to.daddr_be),
        sport_be: to.sport_be,
        dport_be: to.dport_be,
        ingress_ifindex,
        proto: p.proto,
        family: p.family,
        _pad: [0; 2],
    };
    let mut looked_up = XdpNextHopValue { checked_s: now_s, max_len_host: len, ..XdpNextHopValue::default() };
    let cached = XDP_NEXTHOP.get_ptr_mut(&key);
    // SAFETY: a map value pointer, valid for the run (RCU; LRU elements are
    // preallocated and never freed while the map exists); races as in
    // xdp.rs, `forward`: a changed answer replaces the element whole.
    let hop: &XdpNextHopValue = match cached.map(|c| unsafe { &mut *c }) {
        Some(c) if xdp_nexthop_usable(c, len, now_s) => c,
        stale => {
            let rc = next_hop(ctx, p, &key, &mut looked_up, stale);
            if rc != FIB_SUCCESS {
                count(if rc == FIB_FRAG_NEEDED {
                    np_fast_counter::STACK_MTU
                } else if peer && rc == FIB_NOT_FWDED {
                    // A host-network endpoint: the node is the backend.
                    np_fast_counter::STACK_LOCAL_BACKEND
                } else {
                    np_fast_counter::STACK_NO_ROUTE
                });
                return Err(TO_STACK);
            }
            &looked_up
        }
    };
    // A local backend's device must take `bpf_redirect_peer` (see the
    // module comment); checked before anything is written. The cached
    // next hop is the route's answer, and the list only says what kind of
    // device that is, so one lookup per packet of a local flow.
    if peer && NP_PEER_DEVS.get_ptr(&hop.ifindex).is_none() {
        count(np_fast_counter::STACK_LOCAL_NOT_PEER);
        return Err(TO_STACK);
    }
    // From here the packet is ours to send.
    if linear_v4 {
        match forward_v4(ctx, p, to, hop) {
            0 => {
                clear_tstamp(ctx);
                return Ok(i64::from(hop.ifindex) | TRANSLATED);
            }
            // The data moved since the check above (it cannot): nothing
            // written, the steps below do it.
            1 => {}
            e => return Err(e),
        }
    }
    // TTL or hop limit first, as `ip_forward`/`ip6_forward` do it.
    if v4 {
        // The TTL shares a 16-bit word with the protocol in the header
        // checksum (RFC 791, 1624).
        let old = ctx.load::<u16>(p.l3 + 8)?;
        ctx.store(p.l3 + 8, &(hops - 1), 0)?;
        let new = ctx.load::<u16>(p.l3 + 8)?;
        ctx.l3_csum_replace(p.l3 + 10, u64::from(old), u64::from(new), 2)?;
    } else {
        ctx.store(p.l3 + 7, &(hops - 1), 0)?;
    }
    ctx.store(0, &hop.dmac, 0)?;
    ctx.store(6, &hop.smac, 0)?;
    clear_tstamp(ctx);
    Ok(i64::from(hop.ifindex))
}

/// A forwarded packet carries no receive timestamp out: the stack clears
/// it (`skb_clear_tstamp` in `ip_forward`/`ip6_forward`, since "net: clear
/// skb->tstamp in forwarding paths", Linux 5.3), or the fq qdisc would take
/// the receive time for a departure time.
#[inline(always)]
fn clear_tstamp(ctx: &TcContext) {
    // SAFETY: a write of a field TC programs may write (`tc_cls_act_is_valid_access`).
    unsafe { (*ctx.skb.skb).tstamp = 0 };
}

/// `bpf_fib_lookup` for the packet `key` of length `hop.max_len_host`
/// coming in on `key.ingress_ifindex`, as the stack would forward it; on
/// success fills `hop` and caches it, as xdp.rs's `next_hop` does (an
/// unchanged answer refreshes the cached element in place). Returns the
/// helper's answer. Its own subprogram, so that the 64-byte parameters take
/// stack only while it runs.
#[inline(never)]
fn next_hop(ctx: &TcContext, p: &Pkt, key: &XdpNextHopKey, hop: &mut XdpNextHopValue, stale: Option<&mut XdpNextHopValue>) -> i64 {
    let mut params = core::mem::MaybeUninit::<FibParams>::uninit();
    // With a length set, the skb lookup checks it against the route's MTU
    // (Linux >= 5.12, `bpf_skb_fib_lookup`'s `check_mtu`); on 5.10 the
    // helper checks the skb against the output device's MTU instead
    // (`is_skb_forwardable`).
    let fib = fib_params_for(&mut params, p.proto, key, hop);
    if p.family == FAMILY_V4 {
        fib.family = AF_INET;
        fib.__bindgen_anon_2.tos = match ctx.load::<u8>(p.l3 + 1) {
            Ok(t) => t,
            Err(e) => return e.min(-1),
        };
        fib.__bindgen_anon_3.ipv4_src = key.saddr_be[0];
        fib.__bindgen_anon_4.ipv4_dst = key.daddr_be[0];
    } else {
        fib.family = AF_INET6;
        // Traffic class and flow label (see xdp.rs, `next_hop`).
        fib.__bindgen_anon_2.flowinfo = match ctx.load::<u32>(p.l3) {
            Ok(w) => w & 0x0fff_ffffu32.to_be(),
            Err(e) => return e.min(-1),
        };
        fib.__bindgen_anon_3.ipv6_src = addr_copy(&key.saddr_be);
        fib.__bindgen_anon_4.ipv6_dst = addr_copy(&key.daddr_be);
    }
    // SAFETY: `fib` is a local of the size passed; the helper reads and
    // writes only it, and the context is this program's own.
    let rc = unsafe { bpf_fib_lookup(ctx.skb.skb.cast(), core::ptr::from_mut(fib), core::mem::size_of::<FibParams>() as i32, 0) };
    if rc != FIB_SUCCESS {
        return rc;
    }
    remember_next_hop(fib, key, hop, stale);
    FIB_SUCCESS
}
