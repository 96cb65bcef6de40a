//! Parsing and rewriting packets at the TC hook.
//!
//! Everything goes through `bpf_skb_load_bytes`/`bpf_skb_store_bytes`
//! (`TcContext::load`/`store`) rather than direct packet pointers: the
//! helpers work on non-linear skbs too (GRO'd or paged veth traffic) and
//! bound every access themselves, so a truncated packet is a failed load,
//! never an out-of-bounds read.
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
use proxy_common::{CtValue, FAMILY_V4, FAMILY_V6, PROTO_TCP, PROTO_UDP, np_counter};

pub const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const IPPROTO_ICMP: u8 = 1;
const IPPROTO_ICMPV6: u8 = 58;

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
pub const TCP_RST: u8 = 0x04;

impl Pkt {
    #[inline(always)]
    fn csum_off(&self) -> usize {
        // tcphdr.check is at byte 16, udphdr.check at byte 6.
        self.l4 + if self.proto == PROTO_TCP { 16 } else { 6 }
    }

    #[inline(always)]
    fn l4_flags(&self) -> u64 {
        if self.proto == PROTO_UDP {
            BPF_F_MARK_MANGLED_0 as u64
        } else {
            0
        }
    }
}

/// What `parse` found. `Other` is everything that is not ours to touch; the
/// counter says why.
pub enum Parsed {
    L4(Pkt),
    /// ICMP/ICMPv6: errors about tracked flows are translated (icmp.rs).
    Icmp(crate::icmp::IcmpPkt),
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
/// * IPv6 packets whose first next-header is not TCP/UDP (extension headers
///   are rare for this traffic; walking them costs verifier complexity).
/// * Truncated headers: a failed load.
#[inline(always)]
pub fn parse(ctx: &TcContext) -> Parsed {
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
        let (Ok(p), Ok(s), Ok(d)) = (
            ctx.load::<u8>(l3 + 9),
            ctx.load::<u32>(l3 + 12),
            ctx.load::<u32>(l3 + 16),
        ) else {
            return Parsed::Other(np_counter::PASS_UNPARSED);
        };
        family = FAMILY_V4;
        proto = p;
        // IP options are skipped by honouring IHL.
        l4 = l3 + ihl;
        saddr = [s, 0, 0, 0];
        daddr = [d, 0, 0, 0];
    } else if eth_proto == ETH_P_IPV6 {
        let (Ok(v), Ok(p), Ok(s), Ok(d)) = (
            ctx.load::<u8>(l3),
            ctx.load::<u8>(l3 + 6),
            ctx.load::<[u32; 4]>(l3 + 8),
            ctx.load::<[u32; 4]>(l3 + 24),
        ) else {
            return Parsed::Other(np_counter::PASS_UNPARSED);
        };
        if v >> 4 != 6 {
            return Parsed::Other(np_counter::PASS_UNPARSED);
        }
        family = FAMILY_V6;
        proto = p;
        l4 = l3 + 40;
        saddr = s;
        daddr = d;
    } else {
        return Parsed::NotIp;
    }
    if (family == FAMILY_V4 && proto == IPPROTO_ICMP)
        || (family == FAMILY_V6 && proto == IPPROTO_ICMPV6)
    {
        return Parsed::Icmp(crate::icmp::IcmpPkt {
            family,
            l3,
            l4,
            saddr,
            daddr,
        });
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
    let tcp_flags = if proto == PROTO_TCP {
        ctx.load::<u8>(l4 + 13).unwrap_or(0)
    } else {
        0
    };
    Parsed::L4(Pkt {
        family,
        proto,
        l3,
        l4,
        saddr,
        daddr,
        sport_be,
        dport_be,
        tcp_flags,
    })
}

/// Rewrites the packet's source and destination (address and port) to the
/// given ones, fixing every checksum on the way. Fields that do not change
/// are not touched. A BPF subprogram of its own (not inlined) to keep the
/// callers' stack frames small.
#[inline(never)]
pub fn rewrite(ctx: &TcContext, p: &Pkt, to: &CtValue) -> Result<(), i64> {
    let (sport_be, dport_be) = (to.sport_be, to.dport_be);
    // Plain integer returns: BPF calls pass at most five arguments in
    // registers, and a `Result` would add a hidden return pointer.
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
        // SAFETY: both buffers are 16 bytes on our stack.
        let diff = unsafe { bpf_csum_diff(from.as_mut_ptr(), 16, to.as_mut_ptr(), 16, 0) };
        if diff < 0 {
            return Err(diff);
        }
        ctx.l4_csum_replace(csum, 0, diff as u64, fl)?;
        ctx.store(off, new, 0)?;
    }
    Ok(())
}
