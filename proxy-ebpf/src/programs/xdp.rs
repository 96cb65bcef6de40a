//! NodePort and LoadBalancer ingress at XDP, for flows to remote backends.
//!
//! Runs in the driver's receive path, before an skb exists (native XDP;
//! veth and virtio_net support it). A packet of a flow whose backend is on
//! another node is translated exactly as the TC path would do it in two
//! steps (DNAT to the backend at ingress, SNAT to this node's address and
//! reserved port at egress, see nodeport.rs), then sent straight out:
//! `XDP_TX` when the route to the backend leaves through the device it
//! came in on, `XDP_REDIRECT` to the route's device otherwise. Such a
//! packet never meets the stack, nor the TC programs. IPv4 and IPv6 take
//! the same path; only the header layout, the route lookup's family and the
//! checksums differ (IPv6 has no header checksum, and its addresses enter
//! the TCP/UDP pseudo header whole).
//!
//! The route to the backend comes from `bpf_fib_lookup`, whose answer is
//! kept per flow for a second in `XDP_NEXTHOP` (see `forward`): the lookup
//! is the largest single cost of a forwarded packet.
//!
//! Conntrack is the TC path's: new flows are set up by nodeport.rs's own
//! `new_flow` (same backend pick, same `NP_CT` entries, same SNAT port
//! reservation), and a tracked flow is forwarded from its `CT_DIR_FORWARD`
//! and `CT_DIR_SNAT` entries. So the backend's replies, which come back
//! through TC, are translated there; and when this program is detached mid
//! flow, `np_ingress` finds the same entries and carries the flow on.
//!
//! Everything else returns `XDP_PASS` with the packet unchanged, for the
//! TC program (`np_ingress`) to handle as if XDP were not there: neither
//! IPv4 nor IPv6, IPv4 with options, IPv4 fragments, ICMP and ICMPv6, IPv6
//! whose next header is not directly TCP or UDP (every extension header:
//! hop-by-hop, routing, fragment, destination options; TC's `parse` in
//! packet.rs walks them, while here one fixed L4 offset per family keeps
//! every bounds check a constant, and such packets are rare), local
//! backends (delivered by the stack), TCP FIN/RST (the closing state of
//! both directions' entries is kept by the TC path, `mark_closing`), stale
//! backends, new-flow errors, a TTL or hop limit of 1 or less (the stack
//! sends the time exceeded error), and any packet whose route
//! `bpf_fib_lookup` cannot resolve to a neighbour (the stack then resolves
//! it, and later packets take XDP).
//!
//! Checksums are updated incrementally (RFC 1624) on the packet bytes.
//! That is correct for frames with complete checksums, which is what a
//! device receives from the wire. A veth peer in the same host may hand
//! over `CHECKSUM_PARTIAL` frames (its sender offloaded the checksum);
//! their L4 field holds only the pseudo-header sum, and a frame forwarded
//! by XDP carries no skb to say so. Senders behind such a veth must turn
//! transmit checksum offload off (the tests do), as a real link delivers
//! complete checksums anyway.

use aya_ebpf::{
    bindings::{
        bpf_fib_lookup as FibParams,
        xdp_action::{XDP_PASS, XDP_TX},
    },
    helpers::{bpf_fib_lookup, bpf_redirect},
    programs::XdpContext,
};
use aya_ebpf::{macros::map, maps::LruHashMap};
use proxy_common::{
    CT_DIR_FORWARD, CT_DIR_SNAT, CT_FLAG_SNAT, CT_REFRESH_S, CtKey, CtValue, FAMILY_V4, FAMILY_V6, PROTO_TCP, PROTO_UDP, XdpNextHopKey,
    XdpNextHopValue, np_counter, np_port_bit, xdp_nexthop_usable,
};

use super::nodeport::{NEW_FLOW_ERR, TRANSLATE, keeps_backend, new_flow};
use crate::kernel;
use crate::nodeport_maps::{NP_CT, NP_PORTS, np_count};
use crate::packet::{
    self, ETH_HLEN, ETH_P_IP, ETH_P_IPV6, Pkt, TCP_FIN, TCP_RST, addr_copy, csum_replace2, csum_replace4, l4_pkt, read_at,
};

/// The flows' next hops (see `XdpNextHopKey`), shared with the TC fast
/// path (tc_fast.rs). One entry in the object: the loads that run this
/// program or the TC fast path give it `XDP_NEXTHOP_ENTRIES`, and the
/// other loads of the object create it that small.
/// LRU, as `NP_CT`: a cache that evicts rather than fills.
#[map(name = "XDP_NEXTHOP")]
pub(crate) static XDP_NEXTHOP: LruHashMap<XdpNextHopKey, XdpNextHopValue> = LruHashMap::with_max_entries(1, 0);

/// `AF_INET` and `AF_INET6` for `bpf_fib_lookup`.
pub(crate) const AF_INET: u8 = 2;
pub(crate) const AF_INET6: u8 = 10;
/// `BPF_FIB_LKUP_RET_SUCCESS` (include/uapi/linux/bpf.h).
pub(crate) const FIB_SUCCESS: i64 = 0;
/// Offsets into the frame: the IP header, then TCP or UDP after IPv4
/// without options (`L4_V4`) or after IPv6's fixed header (`L4_V6`).
const L3: usize = ETH_HLEN;
const L4_V4: usize = L3 + 20;
const L4_V6: usize = L3 + 40;
/// TCP's fixed header; UDP's is 8 bytes, and a datagram shorter than 20
/// bytes of L4 is left to TC (rare, and it keeps one bounds check).
const L4_MIN: usize = 20;
/// `forward`'s answer for "the frame is no longer covered by the bounds
/// checked before" (cannot happen: nothing moves XDP frame data here).
const OUT_OF_BOUNDS: i64 = -1;

/// `Err` carries a counter id: count it and pass the packet unchanged to
/// the TC program (fail open: XDP never drops what it does not handle).
#[inline(always)]
pub(crate) fn xdp_verdict(r: Result<u32, u32>) -> u32 {
    match r {
        Ok(v) => v,
        Err(reason) => {
            np_count(reason);
            XDP_PASS
        }
    }
}

/// Writes `v` into the frame at `data + off`; same contract as
/// `packet::read_at`.
#[inline(always)]
fn write_at<T: Copy>(data: usize, off: usize, v: T) {
    // SAFETY: as `read_at`: the bytes lie inside the checked bounds of the
    // frame, which the program owns (XDP frames are writable, no clone
    // exists before an skb does).
    unsafe { core::ptr::write_unaligned((data + off) as *mut T, v) }
}

/// Writes a MAC address into the frame as one 4-byte and one 2-byte
/// store. A `[u8; 6]` written whole becomes a call to `memmove`, which
/// bpf-linker leaves as a BPF subprogram: a call per forwarded frame, and a
/// frame that counts against the verifier's 512-byte call-chain stack
/// (kernel/bpf/verifier.c, `check_max_stack_depth`).
#[inline(always)]
fn write_mac(data: usize, off: usize, mac: &[u8; 6]) {
    write_at(data, off, u32::from_ne_bytes([mac[0], mac[1], mac[2], mac[3]]));
    write_at(data, off + 4, u16::from_ne_bytes([mac[4], mac[5]]));
}

/// Zeroes the FIB lookup parameters at `fib` with one 4-byte store per
/// word: `mem::zeroed` becomes a call to `memset` (see `write_mac`), and
/// volatile stores cannot be merged back into one.
#[inline(always)]
pub(crate) fn zero_fib_params(fib: &mut core::mem::MaybeUninit<FibParams>) -> &mut FibParams {
    const WORDS: usize = core::mem::size_of::<FibParams>() / 4;
    const _: () = assert!(core::mem::size_of::<FibParams>() == WORDS * 4 && core::mem::align_of::<FibParams>() >= 4);
    let words = fib.as_mut_ptr().cast::<u32>();
    let mut i = 0;
    while i < WORDS {
        // SAFETY: `i < WORDS` keeps each aligned 4-byte store inside
        // `fib`, which is at least 4-byte aligned (asserted above).
        unsafe { core::ptr::write_volatile(words.add(i), 0) };
        i += 1;
    }
    // SAFETY: every byte was written, and all-zero bytes are a valid
    // `bpf_fib_lookup` (integers and unions of integers).
    unsafe { fib.assume_init_mut() }
}

/// The lookup parameters every next-hop question shares (this path's and
/// the TC fast path's): the flow's protocol and ports, the receiving
/// device and the length to check against the route's MTU. The caller
/// adds the family, addresses and TOS or flow label.
#[inline(always)]
pub(crate) fn fib_params_for<'a>(
    params: &'a mut core::mem::MaybeUninit<FibParams>,
    proto: u8,
    key: &XdpNextHopKey,
    hop: &XdpNextHopValue,
) -> &'a mut FibParams {
    let fib = zero_fib_params(params);
    fib.l4_protocol = proto;
    fib.sport = key.sport_be;
    fib.dport = key.dport_be;
    fib.ifindex = key.ingress_ifindex;
    fib.__bindgen_anon_1.tot_len = hop.max_len_host;
    fib
}

/// After a successful lookup: fills `hop`'s device and MACs from `fib` and
/// caches it for the flow, in `stale` (its cached entry) when the answer
/// is the one it holds, as a new element otherwise. Shared by this path
/// and the TC fast path, whose cache this is too.
#[inline(always)]
pub(crate) fn remember_next_hop(fib: &FibParams, key: &XdpNextHopKey, hop: &mut XdpNextHopValue, stale: Option<&mut XdpNextHopValue>) {
    hop.ifindex = fib.ifindex;
    hop.dmac = fib.dmac;
    hop.smac = fib.smac;
    if let Some(c) = stale
        && c.ifindex == hop.ifindex
        && c.dmac == hop.dmac
        && c.smac == hop.smac
    {
        // The length first, then the time: until the new time shows, a
        // reader on another CPU finds the entry stale and asks the helper
        // itself. Only the length checked now is trusted (the route's MTU
        // may have shrunk).
        c.max_len_host = hop.max_len_host;
        c.checked_s = hop.checked_s;
        return;
    }
    // A failed insert (memory short) only means the next packet asks
    // again; the answer in `hop` is used for this one either way.
    let _ = XDP_NEXTHOP.insert(key, hop, 0);
}

#[inline(always)]
pub(crate) fn try_xdp<const KERNEL: u8>(ctx: &XdpContext) -> Result<u32, u32> {
    let Some(p) = parse(ctx) else {
        return Ok(XDP_PASS);
    };
    // The TC path's first test (nodeport.rs, `port_bit`): no frontend
    // or tracked flow uses this destination port, so nothing below can
    // match. Not counted here: TC counts it as `pass_not_ours`.
    let (word, mask) = np_port_bit(u16::from_be(p.dport_be), false);
    if NP_PORTS.get(word).is_some_and(|w| *w & mask == 0) {
        return Ok(XDP_PASS);
    }
    if p.proto == PROTO_TCP && p.tcp_flags & (TCP_FIN | TCP_RST) != 0 {
        // The TC path marks both directions' entries closing.
        return Err(np_counter::XDP_PASS_TO_TC);
    }
    // One key on the stack, for the forward entry and then the SNAT entry:
    // this frame and `new_flow`'s share the verifier's 512 bytes of stack
    // for the call chain, and IPv6 addresses leave little to spare.
    let mut key = CtKey {
        saddr_be: p.saddr,
        daddr_be: p.daddr,
        sport_be: p.sport_be,
        dport_be: p.dport_be,
        proto: p.proto,
        family: p.family,
        dir: CT_DIR_FORWARD,
        _pad: 0,
    };
    let mut fwd = NP_CT.get_ptr_mut(&key);
    if fwd.is_none() {
        // A new flow (or not ours): the TC path's own set-up, which writes
        // every entry, reserves the SNAT port and counts `new_flow`. Any
        // other answer than "translate" (not a frontend, a drop, a refusal
        // through the node's stack, an error) is left to np_ingress, which
        // decides the same again and counts it once.
        let r = new_flow::<KERNEL>(&p, &key);
        if r >= NEW_FLOW_ERR || r as i32 != TRANSLATE {
            return Ok(XDP_PASS);
        }
        fwd = NP_CT.get_ptr_mut(&key);
    }
    let Some(fwd) = fwd else {
        // A refusal (`no_backend` keeps no forward entry), or evicted.
        return Ok(XDP_PASS);
    };
    // SAFETY: a non-null NP_CT value pointer; valid for the run (RCU, and
    // the LRU map's elements are preallocated and never freed while the map
    // exists). Other CPUs may use the entry meanwhile; only aligned u32
    // fields are loaded and stored, and every bit pattern is a valid
    // `CtValue` (see nodeport.rs, `try_nodeport`).
    let fwd = unsafe { &mut *fwd };
    if fwd.flags & CT_FLAG_SNAT == 0 {
        // A local backend: the stack delivers it. Decided before the clock
        // is read, which only the forwarded flows need.
        return Err(np_counter::XDP_PASS_TO_TC);
    }
    let now = (kernel::now_ns::<KERNEL>() / 1_000_000_000) as u32;
    if !keeps_backend(p.proto, fwd, now) {
        // A UDP flow's backend gone: the TC path picks another.
        return Err(np_counter::XDP_PASS_TO_TC);
    }
    // The SNAT leg: client -> backend.
    key.daddr_be = addr_copy(&fwd.daddr_be);
    key.dport_be = fwd.dport_be;
    key.dir = CT_DIR_SNAT;
    let Some(snat) = NP_CT.get_ptr_mut(&key) else {
        return Err(np_counter::XDP_PASS_TO_TC);
    };
    // SAFETY: an NP_CT value pointer, valid for the run; races as above.
    let snat = unsafe { &mut *snat };
    // The entry is read in place, as the TC path's `rewrite` reads its
    // entries: a copy would take 48 more bytes of this frame (see `key`).
    // Only a reuse of the element for another entry can change it under
    // us (an update, a deletion or an eviction returns the old element to
    // the LRU map's free list at once, kernel/bpf/hashtab.c), a window
    // TC's rewrite has too.
    let rc = forward(ctx, &p, snat, now);
    if rc == i64::from(XDP_PASS) {
        // No usable route or neighbour, or a TTL/hop limit the stack must
        // answer.
        return Err(np_counter::XDP_PASS_NO_ROUTE);
    }
    if rc < 0 {
        return Err(np_counter::XDP_PASS_TO_TC);
    }
    // The flow is in use (both legs the TC path would have refreshed, at
    // ingress and at egress). Written only when stale, not per packet (see
    // nodeport.rs, `touch`).
    if now.wrapping_sub(fwd.seen_s) >= CT_REFRESH_S {
        fwd.seen_s = now;
    }
    if now.wrapping_sub(snat.seen_s) >= CT_REFRESH_S {
        snat.seen_s = now;
    }
    np_count(np_counter::XDP_FORWARDED);
    Ok(rc as u32)
}

/// The TCP or UDP packet in the frame, read directly through the packet
/// pointers, when it has one of the two layouts this program forwards:
/// IPv4 without options and not a fragment, or IPv6 whose fixed header is
/// followed directly by TCP or UDP. `None` for everything else, which
/// passes unchanged and is not counted here (TC parses it and counts it).
#[inline(always)]
fn parse(ctx: &XdpContext) -> Option<Pkt> {
    let (data, end) = (ctx.data(), ctx.data_end());
    // The shorter layout's bound; it covers the Ethernet type too.
    if data + L4_V4 + L4_MIN > end {
        return None;
    }
    let eth_proto = u16::from_be(read_at::<u16>(data, 12));
    if eth_proto == ETH_P_IP {
        // IPv4 options, fragments, ICMP and the rest: the TC path parses them.
        return packet::linear_v4(data, end);
    }
    if eth_proto == ETH_P_IPV6 && data + L4_V6 + L4_MIN <= end {
        return parse_v6(data);
    }
    None
}

/// `parse` for IPv6; the caller checked `data + L4_V6 + L4_MIN <= end`.
#[inline(always)]
fn parse_v6(data: usize) -> Option<Pkt> {
    if read_at::<u8>(data, L3) >> 4 != 6 {
        return None;
    }
    // The next header of the fixed header (RFC 8200 3). Anything but TCP
    // or UDP goes to TC: ICMPv6 (errors about tracked flows are translated
    // there, icmp.rs; neighbour discovery is the stack's), and every
    // extension header, fragments included (a fragment header is one:
    // RFC 8200 4.5), with all they imply (hop-by-hop options the stack
    // must process, routing headers with segments left).
    let proto = read_at::<u8>(data, L3 + 6);
    if proto != PROTO_TCP && proto != PROTO_UDP {
        return None;
    }
    let saddr = read_addr6(data, L3 + 8);
    let daddr = read_addr6(data, L3 + 24);
    Some(l4_pkt::<L4_V6>(data, FAMILY_V6, proto, saddr, daddr))
}

/// An IPv6 address at `data + off`, as four words in network byte order
/// (the layout of `CtKey`'s and `CtValue`'s addresses). Four 4-byte loads:
/// a `[u32; 4]` read whole may become a `memcpy` call (see `write_mac`).
#[inline(always)]
fn read_addr6(data: usize, off: usize) -> [u32; 4] {
    [read_at::<u32>(data, off), read_at::<u32>(data, off + 4), read_at::<u32>(data, off + 8), read_at::<u32>(data, off + 12)]
}

/// Writes an IPv6 address (network byte order words) at `data + off`.
#[inline(always)]
fn write_addr6(data: usize, off: usize, a: &[u32; 4]) {
    write_at(data, off, a[0]);
    write_at(data, off + 4, a[1]);
    write_at(data, off + 8, a[2]);
    write_at(data, off + 12, a[3]);
}

/// Sends the frame towards `to` (the flow's packet after DNAT and SNAT)
/// without the stack, when the route to it is usable from here: rewrites
/// the frame to `to` (addresses, ports, MACs, TTL or hop limit, checksums)
/// and returns `XDP_TX` or the verdict of `bpf_redirect`. Otherwise the
/// frame is untouched and the answer is `XDP_PASS` (or `OUT_OF_BOUNDS`).
///
/// The route and neighbour come from the flow's entry in `XDP_NEXTHOP`
/// while it is fresh (`XDP_NEXTHOP_TTL_S`) and was checked for a packet at
/// least this long, otherwise from `bpf_fib_lookup` (`next_hop`), whose
/// answer is cached for the flow's next packets. Its own subprogram, with
/// a plain integer result, to keep the key and the next hop out of the
/// caller's frame; one for both families.
#[inline(never)]
fn forward(ctx: &XdpContext, p: &Pkt, to: &CtValue, now_s: u32) -> i64 {
    let (data, end) = (ctx.data(), ctx.data_end());
    // The length `bpf_fib_lookup` compares with the route's MTU, host
    // order: IPv4's total length (`bpf_ipv4_fib_lookup`); IPv6's payload
    // length leaves out the fixed header, which the MTU counts
    // (`bpf_ipv6_fib_lookup` compares with `ip6_mtu_from_fib6`). No
    // jumbograms: those carry a hop-by-hop header, and TC has them.
    let len = if p.family == FAMILY_V4 {
        if data + L4_V4 + L4_MIN > end {
            return OUT_OF_BOUNDS;
        }
        if read_at::<u8>(data, L3 + 8) <= 1 {
            // TTL: the stack sends the ICMP time exceeded (`ip_forward`).
            return i64::from(XDP_PASS);
        }
        u16::from_be(read_at::<u16>(data, L3 + 2))
    } else {
        if data + L4_V6 + L4_MIN > end {
            return OUT_OF_BOUNDS;
        }
        if read_at::<u8>(data, L3 + 7) <= 1 {
            // Hop limit: the stack sends the ICMPv6 time exceeded
            // (`ip6_forward`).
            return i64::from(XDP_PASS);
        }
        u16::from_be(read_at::<u16>(data, L3 + 4)).saturating_add(40)
    };
    let key = XdpNextHopKey {
        saddr_be: addr_copy(&to.saddr_be),
        daddr_be: addr_copy(&to.daddr_be),
        sport_be: to.sport_be,
        dport_be: to.dport_be,
        ingress_ifindex: ctx.ingress_ifindex() as u32,
        proto: p.proto,
        family: p.family,
        _pad: [0; 2],
    };
    // What `next_hop` fills in on a miss; it reads the length and time
    // from here (a BPF call takes five arguments at most).
    let mut looked_up = XdpNextHopValue { checked_s: now_s, max_len_host: len, ..XdpNextHopValue::default() };
    let cached = XDP_NEXTHOP.get_ptr_mut(&key);
    // SAFETY: a map value pointer, valid for the run (RCU; LRU elements
    // are preallocated and never freed while the map exists). A changed
    // next hop replaces the element whole (`next_hop` inserts a new one),
    // so the element holds one lookup's device and MACs; only the check
    // time and length are written in place. An eviction that reuses the
    // element for another flow meanwhile leaves that flow's answer, at
    // most a second old, for this frame: the window `NP_CT`'s entries have
    // too (see `try_xdp`).
    let hop: &XdpNextHopValue = match cached.map(|c| unsafe { &mut *c }) {
        Some(c) if xdp_nexthop_usable(c, len, now_s) => c,
        stale => {
            if next_hop(ctx, p, &key, &mut looked_up, stale) != FIB_SUCCESS {
                return i64::from(XDP_PASS);
            }
            &looked_up
        }
    };
    // The lookup does not move frame data; bounds checked again all the
    // same, as the verifier wants a fresh check for new pointers.
    let (data, end) = (ctx.data(), ctx.data_end());
    if p.family == FAMILY_V4 {
        if data + L4_V4 + L4_MIN > end {
            return OUT_OF_BOUNDS;
        }
        rewrite_v4(data, p, to);
    } else {
        if data + L4_V6 + L4_MIN > end {
            return OUT_OF_BOUNDS;
        }
        rewrite_v6(data, p, to);
    }
    write_mac(data, 0, &hop.dmac);
    write_mac(data, 6, &hop.smac);
    if hop.ifindex == key.ingress_ifindex {
        return i64::from(XDP_TX);
    }
    // SAFETY: no memory is passed; the helper only records the target
    // device for this CPU and returns XDP_REDIRECT (or XDP_ABORTED for
    // bad flags, none here).
    unsafe { bpf_redirect(hop.ifindex, 0) }
}

/// Asks `bpf_fib_lookup` where the flow's packet `key` of length
/// `hop.max_len_host` goes, as the stack would forward it
/// (`BPF_FIB_LKUP_RET_SUCCESS`: forwarding enabled on the receiving
/// device, a route, a resolved neighbour, a device up, within its MTU). On
/// success fills in `hop`'s device and MACs and caches it for the flow,
/// checked at `hop.checked_s`: in `stale`, the flow's cached entry, when
/// the answer is the one it holds (the common case, a flow's first packet
/// of each second: two stores instead of an LRU insert, which costs about
/// a microsecond); as a new element otherwise. Returns the helper's
/// answer. Its own subprogram, so that the 64-byte lookup parameters take
/// stack only while it runs.
#[inline(never)]
fn next_hop(ctx: &XdpContext, p: &Pkt, key: &XdpNextHopKey, hop: &mut XdpNextHopValue, stale: Option<&mut XdpNextHopValue>) -> i64 {
    let mut params = core::mem::MaybeUninit::<FibParams>::uninit();
    let fib = fib_params_for(&mut params, p.proto, key, hop);
    let (data, end) = (ctx.data(), ctx.data_end());
    if p.family == FAMILY_V4 {
        if data + L4_V4 + L4_MIN > end {
            return OUT_OF_BOUNDS;
        }
        fib.family = AF_INET;
        fib.__bindgen_anon_2.tos = read_at::<u8>(data, L3 + 1);
        fib.__bindgen_anon_3.ipv4_src = key.saddr_be[0];
        fib.__bindgen_anon_4.ipv4_dst = key.daddr_be[0];
    } else {
        if data + L4_V6 + L4_MIN > end {
            return OUT_OF_BOUNDS;
        }
        fib.family = AF_INET6;
        // Traffic class and flow label, as the stack's own lookup of a
        // forwarded packet takes them (`ip6_route_input`: `ip6_flowinfo`,
        // the first word without the version); multipath routes hash the
        // flow label (`rt6_multipath_hash`). One flow keeps them, so the
        // cached answer holds for its later packets.
        fib.__bindgen_anon_2.flowinfo = read_at::<u32>(data, L3) & 0x0fff_ffffu32.to_be();
        fib.__bindgen_anon_3.ipv6_src = addr_copy(&key.saddr_be);
        fib.__bindgen_anon_4.ipv6_dst = addr_copy(&key.daddr_be);
    }
    // SAFETY: `fib` is a local of the size passed; the helper reads and
    // writes only it, and the context is this program's own.
    let rc = unsafe { bpf_fib_lookup(ctx.ctx.cast(), core::ptr::from_mut(fib), core::mem::size_of::<FibParams>() as i32, 0) };
    if rc != FIB_SUCCESS {
        return rc;
    }
    remember_next_hop(fib, key, hop, stale);
    FIB_SUCCESS
}

/// The IPv4 header (TTL, addresses, header checksum) and TCP/UDP of an
/// IPv4 frame without options; the caller checked
/// `data + L4_V4 + L4_MIN <= end` and that the TTL is above 1.
#[inline(always)]
fn rewrite_v4(data: usize, p: &Pkt, to: &CtValue) {
    // TTL (in the 16-bit word TTL|protocol the header checksum sums),
    // then the addresses.
    let mut check = read_at::<u16>(data, L3 + 10);
    let ttl_word_old = read_at::<u16>(data, L3 + 8);
    write_at(data, L3 + 8, read_at::<u8>(data, L3 + 8).wrapping_sub(1));
    let ttl_word_new = read_at::<u16>(data, L3 + 8);
    check = csum_replace2(check, ttl_word_old, ttl_word_new);
    check = csum_replace4(check, p.saddr[0], to.saddr_be[0]);
    check = csum_replace4(check, p.daddr[0], to.daddr_be[0]);
    write_at(data, L3 + 10, check);
    write_at(data, L3 + 12, to.saddr_be[0]);
    write_at(data, L3 + 16, to.daddr_be[0]);
    rewrite_l4::<L4_V4, 1>(data, p, to);
}

/// The IPv6 fixed header (hop limit, addresses) and TCP/UDP of an IPv6
/// frame without extension headers; the caller checked
/// `data + L4_V6 + L4_MIN <= end` and that the hop limit is above 1. IPv6
/// has no header checksum (RFC 8200 3): only the L4 checksum changes.
#[inline(always)]
fn rewrite_v6(data: usize, p: &Pkt, to: &CtValue) {
    write_at(data, L3 + 7, read_at::<u8>(data, L3 + 7).wrapping_sub(1));
    write_addr6(data, L3 + 8, &to.saddr_be);
    write_addr6(data, L3 + 24, &to.daddr_be);
    rewrite_l4::<L4_V6, 4>(data, p, to);
}

/// TCP/UDP at `L4`: the ports, and the checksum over the pseudo header
/// (whose addresses are the first `WORDS` words of `saddr`/`daddr`: 1 for
/// IPv4, all 4 for IPv6; RFC 793, 768, RFC 8200 8.1) and the ports. The
/// caller checked `data + L4 + L4_MIN <= end`.
///
/// A UDP checksum of zero stays zero, a computed zero is sent as 0xffff:
/// what the TC path gives (`BPF_F_MARK_MANGLED_0`, net/core/filter.c
/// `bpf_l4_csum_replace`), so a flow's packets look the same whichever
/// program forwarded them. Over IPv4, zero means "no checksum" (RFC 768).
/// Over IPv6 a zero is invalid except where RFC 6935/6936 allow it for
/// tunnels (`udp6_csum_init` lets it through, and only a socket with
/// `UDP_NO_CHECK6_RX` takes it); an incremental update of it would only
/// produce a wrong non-zero sum, while kept as it is the datagram is
/// exactly as acceptable to the backend as it was to us. A computed zero,
/// though, must never go out as zero (it would read as "none").
#[inline(always)]
fn rewrite_l4<const L4: usize, const WORDS: usize>(data: usize, p: &Pkt, to: &CtValue) {
    // tcphdr.check is at byte 16, udphdr.check at byte 6.
    let csum_at = if p.proto == PROTO_TCP { L4 + 16 } else { L4 + 6 };
    let old = read_at::<u16>(data, csum_at);
    if p.proto == PROTO_TCP || old != 0 {
        let mut c = old;
        let sources = p.saddr.iter().zip(&to.saddr_be).take(WORDS);
        let destinations = p.daddr.iter().zip(&to.daddr_be).take(WORDS);
        for (old_word, new_word) in sources.chain(destinations) {
            c = csum_replace4(c, *old_word, *new_word);
        }
        c = csum_replace2(c, p.sport_be, to.sport_be);
        c = csum_replace2(c, p.dport_be, to.dport_be);
        if p.proto == PROTO_UDP && c == 0 {
            c = 0xffff;
        }
        write_at(data, csum_at, c);
    }
    write_at(data, L4, to.sport_be);
    write_at(data, L4 + 2, to.dport_be);
}
