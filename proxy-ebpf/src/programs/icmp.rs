//! ICMP errors about tracked flows, translated like the flows themselves.
//!
//! An ICMP error quotes the header of the packet that caused it (RFC 792,
//! RFC 4443): the receiver matches that quote to a socket. A quote of a
//! translated packet carries addresses the other side never used, so the
//! error would be ignored (a client's "port unreachable" would never become
//! ECONNREFUSED, a "fragmentation needed"/"packet too big" would never lower
//! the path MTU and the flow would stall). So the quote and the outer header
//! are translated back:
//!
//! * egress, quote `client -> backend` (the node's own stack answered a
//!   DNAT'ed packet: local backend port unreachable, or an MTU error while
//!   forwarding to a remote backend): quote destination and outer source
//!   become the frontend.
//! * egress, quote `backend -> client` going to a remote backend (this node
//!   could not forward the backend's reply): the quote's destination becomes
//!   the SNAT address the backend knows.
//! * ingress, quote `SNAT address -> backend` (the remote backend's node or
//!   a router on the way answered): quote becomes `client -> frontend`,
//!   outer destination the client.
//! * ingress, quote `frontend -> client` (a router between us and the client
//!   answered a reply): quote becomes `backend -> client` (or the SNAT
//!   address), outer destination the backend.
//!
//! Checksums: for IPv4 the quoted header keeps a valid checksum
//! (bpf_l3_csum_replace on the quoted `check`), which also leaves the ICMP
//! checksum unchanged for address rewrites (the two changes cancel in the
//! one's-complement sum); quoted ports are folded into the ICMP checksum
//! with bpf_l4_csum_replace. ICMPv6's checksum also covers the quoted
//! addresses (no quoted checksum to absorb them) and a pseudo header
//! with the outer addresses, hence BPF_F_PSEUDO_HDR for outer rewrites only.
//! The quoted TCP/UDP checksum is left alone: receivers do not verify it
//! (it may be truncated anyway).

use aya_ebpf::{
    bindings::{BPF_F_PSEUDO_HDR, TC_ACT_SHOT},
    helpers::bpf_csum_diff,
    programs::TcContext,
};
use proxy_common::{
    CT_DIR_FORWARD, CT_DIR_REPLY, CT_DIR_REPLY_SNAT, CT_DIR_SNAT, CT_FLAG_SNAT, CtKey, FAMILY_V4, PROTO_TCP, PROTO_UDP, np_counter,
};

use crate::nodeport_maps::{NP_CT, np_count};
use crate::packet::addr_copy;
use aya_ebpf::{macros::map, maps::PerCpuArray};

/// Per-CPU scratch for `handle`: the quote, the lookup key and the
/// translation live here instead of on the stack, which the verifier caps
/// at 512 bytes for the whole call chain. Not pinned (no state between runs).
#[repr(C)]
struct IcmpScratch {
    q: Quote,
    key: CtKey,
    x: Xlate,
}

#[map(name = "NP_ICMP_SCRATCH")]
static NP_ICMP_SCRATCH: PerCpuArray<IcmpScratch> = PerCpuArray::with_max_entries(1, 0);

const PASS: i32 = aya_ebpf::bindings::TC_ACT_UNSPEC;

/// An ICMP or ICMPv6 packet as `packet::parse` found it.
#[derive(Clone, Copy)]
pub struct IcmpPkt {
    pub family: u8,
    pub l3: usize,
    /// Offset of the ICMP header.
    pub l4: usize,
    pub saddr: [u32; 4],
    pub daddr: [u32; 4],
}

/// The quoted (inner) packet's 5-tuple and where its fields are.
#[repr(C)]
struct Quote {
    l3: usize,
    l4: usize,
    proto: u8,
    saddr: [u32; 4],
    daddr: [u32; 4],
    sport_be: u16,
    dport_be: u16,
}

/// Not inlined: its own stack frame (the verifier's 512-byte budget covers
/// the caller's frame plus this one).
#[inline(never)]
pub fn handle(ctx: &TcContext, p: &IcmpPkt, ingress: bool) -> i32 {
    match try_handle(ctx, p, ingress) {
        Ok(v) => v,
        Err(reason) => {
            np_count(reason);
            PASS
        }
    }
}

#[inline(always)]
fn try_handle(ctx: &TcContext, p: &IcmpPkt, ingress: bool) -> Result<i32, u32> {
    let ty: u8 = ctx.load(p.l4).map_err(|_| np_counter::PASS_UNPARSED)?;
    let is_error = if p.family == FAMILY_V4 {
        // Destination unreachable (all codes, incl. 3 port unreachable and
        // 4 fragmentation needed), time exceeded.
        ty == 3 || ty == 11
    } else {
        // Destination unreachable, packet too big, time exceeded.
        ty == 1 || ty == 2 || ty == 3
    };
    if !is_error {
        return Ok(PASS); // echo and friends: not ours
    }
    let Some(sp) = NP_ICMP_SCRATCH.get_ptr_mut(0) else {
        return Err(np_counter::CT_UPDATE_FAILED);
    };
    // SAFETY: this CPU's slot of NP_ICMP_SCRATCH element 0, never freed
    // while the map exists. Only this function uses the map, once per run,
    // and no other TC program runs on this CPU until this one returns
    // (bottom halves are disabled), so no other reference to it is live.
    let sc = unsafe { &mut *sp };
    quote(ctx, p, &mut sc.q)?;
    let q = &sc.q;
    sc.key = CtKey {
        saddr_be: q.daddr,
        daddr_be: q.saddr,
        sport_be: q.dport_be,
        dport_be: q.sport_be,
        proto: q.proto,
        family: p.family,
        dir: CT_DIR_REPLY,
        _pad: 0,
    };
    let key = &mut sc.key;
    // New quote and outer addresses; start from what is there.
    let x = &mut sc.x;
    x.qs = q.saddr;
    x.qsp = q.sport_be;
    x.qd = q.daddr;
    x.qdp = q.dport_be;
    x.os = p.saddr;
    x.od = p.daddr;
    // The `NP_CT.get` calls below: the references are valid memory for the
    // run (RCU, preallocated LRU elements) and only read; this function
    // updates no map entry, so no insert of ours can evict and reuse them,
    // and one on another CPU leaves stale integers, never an invalid value.
    if !ingress {
        // SAFETY: see above.
        if let Some(v) = unsafe { NP_CT.get(&*key) } {
            // Quote client -> backend: swapped, it is the reply key.
            x.qd = addr_copy(&v.saddr_be);
            x.qdp = v.sport_be;
            if x.os == q.daddr {
                x.os = addr_copy(&v.saddr_be);
            }
        } else {
            // Quote backend -> client, towards a remote backend (this node
            // could not forward the backend's reply, e.g. MTU): the backend
            // knows the flow as backend -> SNAT address.
            key.dir = CT_DIR_SNAT;
            // SAFETY: see above.
            let Some(v) = (unsafe { NP_CT.get(&*key) }) else {
                return Ok(PASS);
            };
            x.qd = addr_copy(&v.saddr_be);
            x.qdp = v.sport_be;
        }
    } else {
        key.dir = CT_DIR_REPLY_SNAT;
        // SAFETY: see above.
        if let Some(v) = unsafe { NP_CT.get(&*key) } {
            // Quote SNAT -> backend. v's destination is the client; the
            // frontend comes from the backend -> client reply entry.
            x.qs = addr_copy(&v.daddr_be);
            x.qsp = v.dport_be;
            key.dir = CT_DIR_REPLY;
            key.daddr_be = addr_copy(&v.daddr_be);
            key.dport_be = v.dport_be;
            // SAFETY: see above.
            let Some(r) = (unsafe { NP_CT.get(&*key) }) else {
                return Ok(PASS);
            };
            x.qd = addr_copy(&r.saddr_be);
            x.qdp = r.sport_be;
            x.od = x.qs;
        } else {
            // Quote frontend -> client: swapped, the forward key.
            key.dir = CT_DIR_FORWARD;
            // SAFETY: see above.
            let Some(v) = (unsafe { NP_CT.get(&*key) }) else {
                return Ok(PASS);
            };
            x.qs = addr_copy(&v.daddr_be);
            x.qsp = v.dport_be;
            x.od = addr_copy(&v.daddr_be);
            if v.flags & CT_FLAG_SNAT != 0 {
                // The backend saw the SNAT address as its peer.
                key.dir = CT_DIR_SNAT;
                key.saddr_be = addr_copy(&q.daddr);
                key.sport_be = q.dport_be;
                key.daddr_be = addr_copy(&v.daddr_be);
                key.dport_be = v.dport_be;
                // SAFETY: see above.
                let Some(s) = (unsafe { NP_CT.get(&*key) }) else {
                    return Ok(PASS);
                };
                x.qd = addr_copy(&s.saddr_be);
                x.qdp = s.sport_be;
            }
        }
    }
    if apply(ctx, p, &sc.q, &sc.x) < 0 {
        np_count(np_counter::REWRITE_FAILED);
        return Ok(TC_ACT_SHOT);
    }
    np_count(np_counter::ICMP_TRANSLATED);
    Ok(PASS)
}

/// The translated quote and outer addresses.
#[repr(C)]
struct Xlate {
    qs: [u32; 4],
    qd: [u32; 4],
    os: [u32; 4],
    od: [u32; 4],
    qsp: u16,
    qdp: u16,
}

/// Writes `x` into the packet, returning a plain integer (negative on a
/// helper failure). Inlined into `handle`: as a third frame below the TC
/// program and `handle` it would make the call chain too deep for 6.1,
/// whose verifier rounds every frame up to 32 bytes before checking the
/// 512-byte budget ("combined stack size of 3 calls is 544"; newer kernels
/// such as 6.12 round JITed frames to 16 and accept it). `cargo xtask
/// vmtest` loads the programs on 6.1.
#[inline(always)]
fn apply(ctx: &TcContext, p: &IcmpPkt, q: &Quote, x: &Xlate) -> i64 {
    let icmp_csum = p.l4 + 2;
    let v4 = p.family == FAMILY_V4;
    if let Err(e) = set_port(ctx, icmp_csum, q.l4, q.sport_be, x.qsp) {
        return e;
    }
    if let Err(e) = set_port(ctx, icmp_csum, q.l4 + 2, q.dport_be, x.qdp) {
        return e;
    }
    // Quoted addresses: IPv4 keeps the quoted header checksum right;
    // ICMPv6 absorbs the change in its own checksum (no pseudo header).
    if let Err(e) = set_addr(ctx, v4, q.l3 + if v4 { 12 } else { 8 }, &q.saddr, &x.qs, q.l3 + 10, icmp_csum, 0) {
        return e;
    }
    if let Err(e) = set_addr(ctx, v4, q.l3 + if v4 { 16 } else { 24 }, &q.daddr, &x.qd, q.l3 + 10, icmp_csum, 0) {
        return e;
    }
    // Outer addresses: IPv4 header checksum; ICMPv6 pseudo header.
    let ps = BPF_F_PSEUDO_HDR as u64;
    if let Err(e) = set_addr(ctx, v4, p.l3 + if v4 { 12 } else { 8 }, &p.saddr, &x.os, p.l3 + 10, icmp_csum, ps) {
        return e;
    }
    if let Err(e) = set_addr(ctx, v4, p.l3 + if v4 { 16 } else { 24 }, &p.daddr, &x.od, p.l3 + 10, icmp_csum, ps) {
        return e;
    }
    0
}

#[inline(always)]
fn quote(ctx: &TcContext, p: &IcmpPkt, out: &mut Quote) -> Result<(), u32> {
    let bad = |_| np_counter::PASS_UNPARSED;
    // The quote starts after the 8-byte ICMP header.
    let l3 = p.l4 + 8;
    let (proto, l4, saddr, daddr) = if p.family == FAMILY_V4 {
        let vihl: u8 = ctx.load(l3).map_err(bad)?;
        let ihl = ((vihl & 0x0f) as usize) * 4;
        if vihl >> 4 != 4 || ihl < 20 {
            return Err(np_counter::PASS_UNPARSED);
        }
        let proto: u8 = ctx.load(l3 + 9).map_err(bad)?;
        let s: u32 = ctx.load(l3 + 12).map_err(bad)?;
        let d: u32 = ctx.load(l3 + 16).map_err(bad)?;
        (proto, l3 + ihl, [s, 0, 0, 0], [d, 0, 0, 0])
    } else {
        let proto: u8 = ctx.load(l3 + 6).map_err(bad)?;
        let s: [u32; 4] = ctx.load(l3 + 8).map_err(bad)?;
        let d: [u32; 4] = ctx.load(l3 + 24).map_err(bad)?;
        (proto, l3 + 40, s, d)
    };
    if proto != PROTO_TCP && proto != PROTO_UDP {
        return Err(np_counter::PASS_UNPARSED);
    }
    // RFC 792 guarantees the first 8 bytes of the quoted payload: the ports.
    let sport_be: u16 = ctx.load(l4).map_err(bad)?;
    let dport_be: u16 = ctx.load(l4 + 2).map_err(bad)?;
    *out = Quote { l3, l4, proto, saddr, daddr, sport_be, dport_be };
    Ok(())
}

#[inline(always)]
fn set_port(ctx: &TcContext, icmp_csum: usize, off: usize, old: u16, new: u16) -> Result<(), i64> {
    if old == new {
        return Ok(());
    }
    ctx.l4_csum_replace(icmp_csum, u64::from(old), u64::from(new), 2)?;
    ctx.store(off, &new, 0)
}

/// Replaces the address at `off`. IPv4: fixes the IPv4 header checksum at
/// `ip_csum` (the enclosing ICMP sum then stays valid by itself). IPv6:
/// folds the difference into the ICMPv6 checksum, with `pseudo` set when
/// the address is part of the pseudo header.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn set_addr(
    ctx: &TcContext,
    v4: bool,
    off: usize,
    old: &[u32; 4],
    new: &[u32; 4],
    ip_csum: usize,
    icmp_csum: usize,
    pseudo: u64,
) -> Result<(), i64> {
    if v4 {
        if old[0] == new[0] {
            return Ok(());
        }
        ctx.l3_csum_replace(ip_csum, u64::from(old[0]), u64::from(new[0]), 4)?;
        return ctx.store(off, &new[0], 0);
    }
    if old == new {
        return Ok(());
    }
    let mut from = *old;
    let mut to = *new;
    // SAFETY: `from` and `to` are 16-byte arrays on our stack and the sizes
    // passed are theirs; the helper only reads them (read-only memory of
    // the given size in its prototype, checked by the verifier).
    let diff = unsafe { bpf_csum_diff(from.as_mut_ptr(), 16, to.as_mut_ptr(), 16, 0) };
    if diff < 0 {
        return Err(diff);
    }
    ctx.l4_csum_replace(icmp_csum, 0, diff as u64, pseudo)?;
    ctx.store(off, new, 0)
}
