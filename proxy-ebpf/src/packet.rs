//! Parsing and rewriting packets at the TC hook.
//!
//! Parsing reads the common case (IPv4 without options carrying TCP or UDP,
//! headers in the skb's linear data) directly through the packet pointers,
//! bounds-checked against `data_end`: that is one comparison where the
//! helper costs a call per field, on every packet the device carries
//! (`linear_v4`). Everything else goes through `bpf_skb_load_bytes`
//! (`TcContext::load`), which also works on non-linear skbs (GRO'd or paged
//! veth traffic) and bounds every access itself, so a truncated packet is a
//! failed load, never an out-of-bounds read. Reads need nothing from the
//! kernel; writes do, and they stay with `bpf_skb_store_bytes`:
//! a direct packet write anywhere in the program makes the verifier add a
//! prologue that un-clones every cloned skb the program sees
//! (`bpf_unclone_prologue`, net/core/filter.c; e.g. while a packet socket
//! taps the device), also the ones we pass untouched, and replacing the
//! rewrite's one `bpf_skb_store_bytes` that way measured no faster.
//!
//! Checksums are updated incrementally with the kernel's helpers:
//! `bpf_l3_csum_replace` for the IPv4 header checksum and
//! `bpf_l4_csum_replace` for TCP/UDP. Address changes pass
//! `BPF_F_PSEUDO_HDR` because the L4 checksum covers the pseudo header
//! (RFC 793/768); with `CHECKSUM_PARTIAL` skbs (what veth hands us for
//! locally generated traffic) the helper then updates only the pseudo-header
//! seed, as the device would finish the sum (`inet_proto_csum_replace4`).
//! UDP over IPv4 may carry no checksum (zero); `BPF_F_MARK_MANGLED_0` keeps a
//! zero as zero and turns a computed zero into 0xffff (RFC 768).

use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR},
    helpers::bpf_csum_diff,
    programs::TcContext,
};
use proxy_common::{CtValue, FAMILY_V4, FAMILY_V6, PROTO_TCP, PROTO_UDP, XdpNextHopValue, np_counter};

/// An address copied word by word. A plain `[u32; 4]` assignment between
/// two places LLVM cannot prove apart (two map values, say) becomes a call
/// to `memmove`, which bpf-linker leaves as a BPF subprogram: a frame of its
/// own, which the verifier charges 32 bytes for against the 512-byte stack
/// of the deepest call chain (kernel/bpf/verifier.c,
/// `check_max_stack_depth`: every frame is rounded up to 32 bytes, an empty
/// one too). Volatile loads keep LLVM from merging the four back into one
/// copy.
#[inline(always)]
pub fn addr_copy(src: &[u32; 4]) -> [u32; 4] {
    // SAFETY: four in-bounds, aligned reads of a live reference.
    unsafe {
        [
            core::ptr::read_volatile(&src[0]),
            core::ptr::read_volatile(&src[1]),
            core::ptr::read_volatile(&src[2]),
            core::ptr::read_volatile(&src[3]),
        ]
    }
}

pub const ETH_HLEN: usize = 14;
pub const ETH_P_IP: u16 = 0x0800;
pub const ETH_P_IPV6: u16 = 0x86dd;
const IPPROTO_ICMP: u8 = 1;
const IPPROTO_ICMPV6: u8 = 58;
/// IPv6 extension headers (RFC 8200 4): hop-by-hop options, routing,
/// fragment, destination options.
const IPPROTO_HOPOPTS: u8 = 0;
const IPPROTO_ROUTING: u8 = 43;
const IPPROTO_FRAGMENT: u8 = 44;
const IPPROTO_DSTOPTS: u8 = 60;
/// At most this many IPv6 extension headers are skipped to find the L4
/// header. RFC 8200 4.1 recommends at most one of each (destination options
/// twice), so four covers every sane chain, and the bound keeps the loop
/// small for the verifier; a longer chain passes untranslated.
const MAX_IPV6_EXT_HEADERS: usize = 4;

/// A TCP or UDP packet we might translate.
#[derive(Clone, Copy)]
pub struct Pkt {
    pub family: u8,
    pub proto: u8,
    /// Offsets of the L3 and L4 headers from the start of the frame.
    pub l3: usize,
    pub l4: usize,
    pub saddr: [u32; 4],
    pub daddr: [u32; 4],
    pub sport_be: u16,
    pub dport_be: u16,
    /// TCP flags byte (FIN 0x01, SYN 0x02, RST 0x04, ...); zero for UDP.
    pub tcp_flags: u8,
}

pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_ACK: u8 = 0x10;

impl Pkt {
    #[inline(always)]
    fn csum_off(&self) -> usize {
        // tcphdr.check is at byte 16, udphdr.check at byte 6.
        self.l4 + if self.proto == PROTO_TCP { 16 } else { 6 }
    }

    #[inline(always)]
    fn l4_flags(&self) -> u64 {
        if self.proto == PROTO_UDP { BPF_F_MARK_MANGLED_0 as u64 } else { 0 }
    }
}

/// What `parse` found. `Other` is everything that is not ours to touch; the
/// counter says why.
pub enum Parsed {
    L4(Pkt),
    /// ICMP/ICMPv6: errors about tracked flows are translated (icmp.rs).
    Icmp(crate::programs::icmp::IcmpPkt),
    Other(u32),
    /// Not IP at all (ARP, LLDP, ...): not even worth a counter.
    NotIp,
}

/// Parses Ethernet + IPv4/IPv6 + TCP/UDP ports.
///
/// Passed untouched, by reason:
/// * IPv4 fragments (`MF` set or a non-zero offset): a non-first fragment
///   has no L4 header, and translating only the first would split a
///   datagram across two destinations.
/// * IPv6 fragments (a fragment header with a non-zero offset or the M flag),
///   for the same reason. An atomic fragment (offset 0, no M: RFC 6946) is
///   a whole packet and is translated.
/// * IPv6 packets with more than `MAX_IPV6_EXT_HEADERS` extension headers,
///   or with a routing header that still has segments left (the packet is
///   not at its final destination, and the L4 checksum covers the final
///   one: RFC 8200 8.1).
/// * Truncated headers: a failed load.
#[inline(always)]
pub fn parse(ctx: &TcContext) -> Parsed {
    if let Some(p) = linear_v4(ctx.data(), ctx.data_end()) {
        return Parsed::L4(p);
    }
    let Ok(eth_proto) = ctx.load::<u16>(12) else {
        return Parsed::NotIp;
    };
    let eth_proto = u16::from_be(eth_proto);
    let l3 = ETH_HLEN;
    let (family, proto, l4, saddr, daddr);
    if eth_proto == ETH_P_IP {
        let Ok(vihl) = ctx.load::<u8>(l3) else {
            return Parsed::Other(np_counter::PASS_UNPARSED);
        };
        let ihl = ((vihl & 0x0f) as usize) * 4;
        if vihl >> 4 != 4 || ihl < 20 {
            return Parsed::Other(np_counter::PASS_UNPARSED);
        }
        let Ok(frag) = ctx.load::<u16>(l3 + 6) else {
            return Parsed::Other(np_counter::PASS_UNPARSED);
        };
        // 0x3fff: the MF flag and the 13-bit fragment offset.
        if u16::from_be(frag) & 0x3fff != 0 {
            return Parsed::Other(np_counter::PASS_FRAGMENT);
        }
        let (Ok(p), Ok(s), Ok(d)) = (ctx.load::<u8>(l3 + 9), ctx.load::<u32>(l3 + 12), ctx.load::<u32>(l3 + 16)) else {
            return Parsed::Other(np_counter::PASS_UNPARSED);
        };
        family = FAMILY_V4;
        proto = p;
        // IP options are skipped by honouring IHL.
        l4 = l3 + ihl;
        saddr = [s, 0, 0, 0];
        daddr = [d, 0, 0, 0];
    } else if eth_proto == ETH_P_IPV6 {
        let (Ok(v), Ok(p), Ok(s), Ok(d)) =
            (ctx.load::<u8>(l3), ctx.load::<u8>(l3 + 6), ctx.load::<[u32; 4]>(l3 + 8), ctx.load::<[u32; 4]>(l3 + 24))
        else {
            return Parsed::Other(np_counter::PASS_UNPARSED);
        };
        if v >> 4 != 6 {
            return Parsed::Other(np_counter::PASS_UNPARSED);
        }
        family = FAMILY_V6;
        let found = ipv6_l4(ctx, p, l3 + 40);
        if found < 0 {
            return Parsed::Other((-found - 1) as u32);
        }
        proto = (found >> 32) as u8;
        l4 = (found & 0xffff_ffff) as usize;
        saddr = s;
        daddr = d;
    } else {
        return Parsed::NotIp;
    }
    if (family == FAMILY_V4 && proto == IPPROTO_ICMP) || (family == FAMILY_V6 && proto == IPPROTO_ICMPV6) {
        return Parsed::Icmp(crate::programs::icmp::IcmpPkt { family, l3, l4, saddr, daddr });
    }
    if proto != PROTO_TCP && proto != PROTO_UDP {
        return Parsed::Other(np_counter::PASS_UNPARSED);
    }
    // The whole fixed L4 header must be there, checksum included, before
    // anything is rewritten.
    let need = l4 + if proto == PROTO_TCP { 20 } else { 8 };
    if (ctx.len() as usize) < need {
        return Parsed::Other(np_counter::PASS_UNPARSED);
    }
    let (Ok(sport_be), Ok(dport_be)) = (ctx.load::<u16>(l4), ctx.load::<u16>(l4 + 2)) else {
        return Parsed::Other(np_counter::PASS_UNPARSED);
    };
    let tcp_flags = if proto == PROTO_TCP { ctx.load::<u8>(l4 + 13).unwrap_or(0) } else { 0 };
    Parsed::L4(Pkt { family, proto, l3, l4, saddr, daddr, sport_be, dport_be, tcp_flags })
}

/// A `T` read from the packet at `data + off`, through the packet
/// pointers of a TC program (the skb's linear data) or an XDP program (the
/// frame). The caller must have checked `data + off + size_of::<T>() <=
/// data_end`, and `T` must be an integer type (any bits are a valid value).
#[inline(always)]
pub fn read_at<T: Copy>(data: usize, off: usize) -> T {
    // SAFETY: every caller (`linear_v4`, `l4_pkt`, `forward_v4`, the TC
    // fast path's `route` and the XDP program) reads integers below a
    // bound it checked against `data_end`, so the
    // bytes lie in the packet. The data stays in place until the program
    // calls a helper that may move it (`bpf_skb_*` or `bpf_xdp_adjust_*`),
    // and none runs between a check and its reads. The verifier tracks the
    // same bound on the packet pointer and refuses the program if a read
    // could pass `data_end`. Unaligned: the IP header follows a 14-byte
    // Ethernet header.
    unsafe { core::ptr::read_unaligned((data + off) as *const T) }
}

/// The packet between `data` and `end` (a TC program's linear data or an
/// XDP frame) when it is IPv4 without options (IHL 5) and not a fragment,
/// carrying TCP or UDP, with the Ethernet, IP and 20 bytes of L4 header in
/// it: read directly, no helper call. `None` for anything else, which
/// `parse` then parses (and classifies) with the helpers, and which the
/// XDP program passes to TC.
/// The stack has the headers in the linear area in practice: drivers copy
/// at least the headers there (`eth_get_headlen`), and locally built
/// packets are built there. 20 bytes of L4 also covers UDP's 8; a shorter
/// UDP frame takes the helper path.
#[inline(always)]
pub fn linear_v4(data: usize, end: usize) -> Option<Pkt> {
    const L4: usize = ETH_HLEN + 20;
    if data + L4 + 20 > end {
        return None;
    }
    if u16::from_be(read_at::<u16>(data, 12)) != ETH_P_IP || read_at::<u8>(data, ETH_HLEN) != 0x45 {
        return None;
    }
    // 0x3fff: the MF flag and the 13-bit fragment offset.
    if u16::from_be(read_at::<u16>(data, ETH_HLEN + 6)) & 0x3fff != 0 {
        return None;
    }
    let proto = read_at::<u8>(data, ETH_HLEN + 9);
    if proto != PROTO_TCP && proto != PROTO_UDP {
        // ICMP (errors about tracked flows, icmp.rs) and everything else.
        return None;
    }
    let saddr = [read_at::<u32>(data, ETH_HLEN + 12), 0, 0, 0];
    let daddr = [read_at::<u32>(data, ETH_HLEN + 16), 0, 0, 0];
    Some(l4_pkt::<L4>(data, FAMILY_V4, proto, saddr, daddr))
}

/// The `Pkt` of a TCP or UDP header at offset `L4` behind an IP header at
/// `ETH_HLEN`, whose first 20 bytes the caller checked to be in the packet.
#[inline(always)]
pub fn l4_pkt<const L4: usize>(data: usize, family: u8, proto: u8, saddr: [u32; 4], daddr: [u32; 4]) -> Pkt {
    Pkt {
        family,
        proto,
        l3: ETH_HLEN,
        l4: L4,
        saddr,
        daddr,
        sport_be: read_at::<u16>(data, L4),
        dport_be: read_at::<u16>(data, L4 + 2),
        tcp_flags: if proto == PROTO_TCP { read_at::<u8>(data, L4 + 13) } else { 0 },
    }
}

/// Skips the IPv6 extension headers from `off` (where a header of type
/// `next` starts). Returns the upper-layer protocol in bits 32..40 and its
/// offset in the low 32 bits, or `-(counter + 1)` naming why the packet is
/// not ours. A BPF subprogram of its own with a plain integer result: its
/// locals then stay out of the calling program's frame, which shares the
/// verifier's 512-byte stack budget with the deepest call chain.
#[inline(never)]
fn ipv6_l4(ctx: &TcContext, next: u8, off: usize) -> i64 {
    match ipv6_l4_inner(ctx, next, off) {
        Ok((p, o)) => (i64::from(p) << 32) | (o as i64 & 0xffff_ffff),
        Err(reason) => -i64::from(reason) - 1,
    }
}

#[inline(always)]
fn ipv6_l4_inner(ctx: &TcContext, mut next: u8, mut off: usize) -> Result<(u8, usize), u32> {
    let mut i = 0;
    while i < MAX_IPV6_EXT_HEADERS {
        match next {
            IPPROTO_HOPOPTS | IPPROTO_ROUTING | IPPROTO_DSTOPTS => {
                // Next header, length in 8-octet units not counting the
                // first 8, then (routing) type and segments left.
                let Ok(h) = ctx.load::<[u8; 4]>(off) else {
                    return Err(np_counter::PASS_UNPARSED);
                };
                if next == IPPROTO_ROUTING && h[3] != 0 {
                    return Err(np_counter::PASS_UNPARSED);
                }
                next = h[0];
                off += (h[1] as usize + 1) * 8;
            }
            IPPROTO_FRAGMENT => {
                // Next header, reserved, then offset (13 bits), two
                // reserved bits and M.
                let Ok(h) = ctx.load::<[u8; 4]>(off) else {
                    return Err(np_counter::PASS_UNPARSED);
                };
                if u16::from_be_bytes([h[2], h[3]]) & 0xfff9 != 0 {
                    return Err(np_counter::PASS_FRAGMENT);
                }
                next = h[0];
                off += 8;
            }
            _ => return Ok((next, off)),
        }
        i += 1;
    }
    match next {
        IPPROTO_HOPOPTS | IPPROTO_ROUTING | IPPROTO_DSTOPTS | IPPROTO_FRAGMENT => Err(np_counter::PASS_UNPARSED),
        _ => Ok((next, off)),
    }
}

/// Rewrites the packet's source and destination (address and port) to the
/// given ones, fixing every checksum on the way. Fields that do not change
/// are not touched (IPv4 without options: written back with the bytes they
/// hold, see `rewrite_v4_block`). A BPF subprogram of its own (not inlined) to keep the
/// callers' stack frames small. Returns 0 or a negative error: a plain
/// integer, like every subprogram here, because a `Result` comes back
/// through a hidden pointer into the caller's stack, which costs an
/// argument register (BPF calls have five) and which LLVM may leave in r0,
/// a return the verifier refuses ("cannot return stack pointer to the
/// caller").
#[inline(never)]
pub fn rewrite(ctx: &TcContext, p: &Pkt, to: &CtValue) -> i64 {
    match rewrite_fields(ctx, p, to) {
        Ok(()) => 0,
        Err(e) => e.min(-1),
    }
}

#[inline(always)]
fn rewrite_fields(ctx: &TcContext, p: &Pkt, to: &CtValue) -> Result<(), i64> {
    // IPv4 without options (nearly every packet): addresses and ports sit
    // next to each other.
    if p.family == FAMILY_V4 && p.l3 == ETH_HLEN && p.l4 == ETH_HLEN + 20 {
        return rewrite_v4_block(ctx, p, to);
    }
    let (sport_be, dport_be) = (to.sport_be, to.dport_be);
    let rc = rewrite_addr(ctx, p, &to.saddr_be, true);
    if rc < 0 {
        return Err(rc);
    }
    let rc = rewrite_addr(ctx, p, &to.daddr_be, false);
    if rc < 0 {
        return Err(rc);
    }
    let csum = p.csum_off();
    let fl = p.l4_flags();
    if sport_be != p.sport_be {
        ctx.l4_csum_replace(csum, u64::from(p.sport_be), u64::from(sport_be), 2 | fl)?;
        ctx.store(p.l4, &sport_be, 0)?;
    }
    if dport_be != p.dport_be {
        ctx.l4_csum_replace(csum, u64::from(p.dport_be), u64::from(dport_be), 2 | fl)?;
        ctx.store(p.l4 + 2, &dport_be, 0)?;
    }
    Ok(())
}

/// Bytes 10..24 of an IPv4 packet without options: header checksum, source
/// and destination address, then the TCP/UDP source and destination port
/// (RFC 791, 793, 768), all in network byte order.
#[repr(C, packed)]
struct V4Block {
    check: u16,
    saddr_be: u32,
    daddr_be: u32,
    sport_be: u16,
    dport_be: u16,
}

/// `rewrite_fields` for IPv4 without options, with fewer helper calls (the
/// calls are the bulk of the rewrite's cost; a tracked packet changes an
/// address and a port):
///
/// * The 14 contiguous bytes from the IPv4 header checksum to the
///   destination port are written with one `bpf_skb_store_bytes` instead of
///   one store per changed field. Unchanged fields are written back with
///   the bytes they hold, and the flags are 0, so `skb->csum` is left
///   alone (the helper adjusts it only under `BPF_F_RECOMPUTE_CSUM`,
///   net/core/filter.c).
/// * The IPv4 header checksum is updated here (RFC 1624, eqn. 3) instead of
///   by `bpf_l3_csum_replace`, which does nothing else for a 4-byte change
///   (`csum_replace4` on the field; it never touches `skb->csum`, as the
///   header's sum stays the same). The old value is read directly from the
///   linear data when the header is there (always, in practice: the stack
///   pulls the IP header into the linear area before TC ingress, and at
///   egress it was built there), else with `bpf_skb_load_bytes`.
/// * The L4 checksum goes through `bpf_l4_csum_replace` (see `l4_csum_v4`).
#[inline(always)]
fn rewrite_v4_block(ctx: &TcContext, p: &Pkt, to: &CtValue) -> Result<(), i64> {
    let (s_old, s_new) = (p.saddr[0], to.saddr_be[0]);
    let (d_old, d_new) = (p.daddr[0], to.daddr_be[0]);
    if s_old == s_new && d_old == d_new && to.sport_be == p.sport_be && to.dport_be == p.dport_be {
        return Ok(());
    }
    // Read before the helpers below: they may move the packet data, and
    // the verifier invalidates packet pointers across them.
    let mut check = ipv4_check(ctx)?;
    if s_old != s_new {
        check = csum_replace4(check, s_old, s_new);
    }
    if d_old != d_new {
        check = csum_replace4(check, d_old, d_new);
    }
    l4_csum_v4(ctx, p, to)?;
    let block = V4Block { check, saddr_be: s_new, daddr_be: d_new, sport_be: to.sport_be, dport_be: to.dport_be };
    // iphdr.check is at byte 10.
    ctx.store(p.l3 + 10, &block, 0)?;
    Ok(())
}

/// The TCP/UDP checksum of an IPv4 packet `p` being rewritten to `to`, in at
/// most two `bpf_l4_csum_replace` calls rather than one per changed field:
/// the addresses' change as one difference with `BPF_F_PSEUDO_HDR`, the
/// ports' as another without (size 0: the helper takes `to` as a checksum
/// difference, `inet_proto_csum_replace_by_diff`). They cannot be one: only
/// the kernel knows whether the skb is `CHECKSUM_PARTIAL` (then only the
/// pseudo-header part, the addresses, may change the field, since the
/// device sums the ports itself) or `CHECKSUM_COMPLETE` (then `skb->csum`
/// follows pseudo-header changes), see `inet_proto_csum_replace4`. The two
/// ports are adjacent 16-bit words, so their change is one difference of
/// the 32-bit word they form (the one's complement sum does not depend on
/// where a 16-bit word sits, RFC 1071 2(A)).
#[inline(always)]
fn l4_csum_v4(ctx: &TcContext, p: &Pkt, to: &CtValue) -> Result<(), i64> {
    let csum = p.csum_off();
    let fl = p.l4_flags();
    let (s_old, s_new) = (p.saddr[0], to.saddr_be[0]);
    let (d_old, d_new) = (p.daddr[0], to.daddr_be[0]);
    if s_old != s_new || d_old != d_new {
        let diff = csum_add(csum_add(!s_old, s_new), csum_add(!d_old, d_new));
        ctx.l4_csum_replace(csum, 0, u64::from(diff), fl | BPF_F_PSEUDO_HDR as u64)?;
    }
    let ports_old = u32::from(p.sport_be) | u32::from(p.dport_be) << 16;
    let ports_new = u32::from(to.sport_be) | u32::from(to.dport_be) << 16;
    if ports_old != ports_new {
        ctx.l4_csum_replace(csum, 0, u64::from(csum_add(!ports_old, ports_new)), fl)?;
    }
    Ok(())
}

/// One's complement addition of two 32-bit partial sums, as the kernel's
/// `csum_add` (the carry goes around).
#[inline(always)]
fn csum_add(a: u32, b: u32) -> u32 {
    let (s, carry) = a.overflowing_add(b);
    s.wrapping_add(u32::from(carry))
}

/// Bytes 22..38 of an Ethernet frame carrying IPv4 without options and TCP
/// or UDP: the IPv4 header from the TTL on, and the ports, as they sit in
/// the frame.
#[repr(C, packed)]
struct V4Tail {
    ttl_proto: u16,
    check: u16,
    saddr_be: u32,
    daddr_be: u32,
    sport_be: u16,
    dport_be: u16,
}

/// How much of the frame `forward_v4` needs in the linear data: Ethernet,
/// IPv4 without options, the ports.
pub const V4_FRAME_LEN: usize = ETH_HLEN + 20 + 4;
const V4_TAIL_AT: usize = ETH_HLEN + 8;
const _: () = assert!(V4_TAIL_AT + core::mem::size_of::<V4Tail>() == V4_FRAME_LEN);

/// The TC fast path's whole write for IPv4 without options (tc_fast.rs),
/// in one `bpf_skb_store_bytes` and the L4 checksum (`l4_csum_v4`), where
/// the steps one by one take a dozen helper calls: the frame's first 38
/// bytes, with the next hop's MACs (`dmac` and `smac` of `hop`), the TTL
/// less one, the translation to `to` and the IPv4 header checksum for
/// both (computed here, RFC 1624), and the bytes between (the Ethernet
/// type, the IPv4 header up to the TTL) as they were. The flags
/// are 0, so `skb->csum` is left alone, which is right: the IPv4 header's
/// sum does not change (its checksum field takes up every change), and
/// the MACs lie before the network header, where a received
/// `CHECKSUM_COMPLETE` sum starts. Returns 0 when written, 1 when the
/// bytes are not all in the linear data (nothing written: the caller takes
/// the general path), or a negative error (the packet may be half
/// written).
///
/// The caller checked that the TTL is above 1 and that `p` is IPv4 without
/// options. A BPF subprogram of its own, with a small frame: it is the third
/// of a call chain whose stacks the verifier adds up (512 bytes at most).
#[inline(never)]
pub fn forward_v4(ctx: &TcContext, p: &Pkt, to: &CtValue, hop: &XdpNextHopValue) -> i64 {
    match forward_v4_inner(ctx, p, to, hop) {
        Ok(r) => r,
        Err(e) => e.min(-1),
    }
}

#[inline(always)]
fn forward_v4_inner(ctx: &TcContext, p: &Pkt, to: &CtValue, hop: &XdpNextHopValue) -> Result<i64, i64> {
    let (data, end) = (ctx.data(), ctx.data_end());
    if data + V4_FRAME_LEN > end {
        return Ok(1);
    }
    let ttl_proto: u16 = read_at(data, V4_TAIL_AT);
    let [ttl, proto] = ttl_proto.to_ne_bytes();
    let new_ttl_proto = u16::from_ne_bytes([ttl.wrapping_sub(1), proto]);
    let (s_new, d_new) = (to.saddr_be[0], to.daddr_be[0]);
    let mut check: u16 = read_at(data, ETH_HLEN + 10);
    check = csum_replace2(check, ttl_proto, new_ttl_proto);
    if p.saddr[0] != s_new {
        check = csum_replace4(check, p.saddr[0], s_new);
    }
    if p.daddr[0] != d_new {
        check = csum_replace4(check, p.daddr[0], d_new);
    }
    let frame = V4Frame {
        dmac: hop.dmac,
        smac: hop.smac,
        // The Ethernet type and the IPv4 header up to the TTL, written
        // back as they are.
        unchanged: read_at(data, ETH_HLEN - 2),
        tail: V4Tail { ttl_proto: new_ttl_proto, check, saddr_be: s_new, daddr_be: d_new, sport_be: to.sport_be, dport_be: to.dport_be },
    };
    // The helpers below may move the packet data; nothing above is read
    // after them.
    l4_csum_v4(ctx, p, to)?;
    ctx.store(0, &frame, 0)?;
    Ok(0)
}

/// The first `V4_FRAME_LEN` bytes of the frame as `forward_v4` writes them,
/// in one `bpf_skb_store_bytes` (a helper call less per packet than the
/// MACs and the rest apart, #33).
#[repr(C, packed)]
struct V4Frame {
    dmac: [u8; 6],
    smac: [u8; 6],
    unchanged: [u8; 10],
    tail: V4Tail,
}
const _: () = assert!(core::mem::size_of::<V4Frame>() == V4_FRAME_LEN);

/// The IPv4 header checksum field as stored (network byte order), of a
/// packet whose IPv4 header starts at `ETH_HLEN` (as `parse` found it).
#[inline(always)]
fn ipv4_check(ctx: &TcContext) -> Result<u16, i64> {
    const AT: usize = ETH_HLEN + 10;
    let (data, end) = (ctx.data(), ctx.data_end());
    if data + AT + 2 <= end {
        // SAFETY: the two bytes end at or before `data_end`, checked just
        // above, so they are in the skb's linear data (the verifier tracks
        // the same bound and refuses an unchecked read); no helper runs in
        // between to move the data. Read unaligned, as in `read_at`.
        return Ok(unsafe { core::ptr::read_unaligned((data + AT) as *const u16) });
    }
    ctx.load::<u16>(AT)
}

/// RFC 1624 eqn. 3, HC' = ~(~HC + ~m + m'), for a 32-bit field, as the
/// kernel's `csum_replace4`. The one's complement sum does not depend on
/// byte order (RFC 1071 2(B)), so the checksum and the values are used as
/// loaded from the packet (network byte order), like the kernel does.
/// Also the XDP path's, which rewrites the frame itself.
#[inline(always)]
pub(crate) fn csum_replace4(check: u16, from: u32, to: u32) -> u16 {
    let mut sum = u32::from(!check) + (!from & 0xffff) + (!from >> 16) + (to & 0xffff) + (to >> 16);
    // Five 16-bit terms: two folds bring any carry back in.
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    !(sum as u16)
}

/// `csum_replace4` for a 16-bit field.
#[inline(always)]
pub(crate) fn csum_replace2(check: u16, from: u16, to: u16) -> u16 {
    let mut sum = u32::from(!check) + u32::from(!from) + u32::from(to);
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    !(sum as u16)
}

// Its own BPF subprogram too, so that the IPv6 copies below do not sit in
// `rewrite`'s frame.
#[inline(never)]
fn rewrite_addr(ctx: &TcContext, p: &Pkt, new: &[u32; 4], source: bool) -> i64 {
    match rewrite_addr_inner(ctx, p, new, source) {
        Ok(()) => 0,
        Err(e) => e,
    }
}

#[inline(always)]
fn rewrite_addr_inner(ctx: &TcContext, p: &Pkt, new: &[u32; 4], source: bool) -> Result<(), i64> {
    let old = if source { &p.saddr } else { &p.daddr };
    let csum = p.csum_off();
    let fl = p.l4_flags() | BPF_F_PSEUDO_HDR as u64;
    if p.family == FAMILY_V4 {
        if old[0] == new[0] {
            return Ok(());
        }
        let off = p.l3 + if source { 12 } else { 16 };
        ctx.l4_csum_replace(csum, u64::from(old[0]), u64::from(new[0]), 4 | fl)?;
        // iphdr.check is at byte 10.
        ctx.l3_csum_replace(p.l3 + 10, u64::from(old[0]), u64::from(new[0]), 4)?;
        ctx.store(off, &new[0], 0)?;
    } else {
        if old == new {
            return Ok(());
        }
        let off = p.l3 + if source { 8 } else { 24 };
        // 128-bit addresses do not fit the helper's 2/4-byte replace: take
        // the one's-complement difference with bpf_csum_diff and feed it to
        // bpf_l4_csum_replace with size 0 ("from" must then be zero).
        let mut from = *old;
        let mut to = *new;
        // SAFETY: `from` and `to` are 16-byte arrays on our stack, and the
        // sizes passed are their sizes; the helper only reads them (the
        // kernel declares them read-only memory of the given size, checked
        // by the verifier) and returns the checksum difference or a
        // negative error.
        let diff = unsafe { bpf_csum_diff(from.as_mut_ptr(), 16, to.as_mut_ptr(), 16, 0) };
        if diff < 0 {
            return Err(diff);
        }
        ctx.l4_csum_replace(csum, 0, diff as u64, fl)?;
        ctx.store(off, new, 0)?;
    }
    Ok(())
}
