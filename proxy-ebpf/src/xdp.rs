//! NodePort and LoadBalancer ingress at XDP, for flows to remote backends.
//!
//! Runs in the driver's receive path, before an skb exists (native XDP;
//! veth and virtio_net support it). A packet of a flow whose backend is on
//! another node is translated exactly as the TC path would do it in two
//! steps (DNAT to the backend at ingress, SNAT to this node's address and
//! reserved port at egress, see nodeport.rs), then sent straight out:
//! `XDP_TX` when the route to the backend leaves through the device it
//! came in on, `XDP_REDIRECT` to the route's device otherwise. Such a
//! packet never meets the stack, nor the TC programs.
//!
//! Conntrack is the TC path's: new flows are set up by nodeport.rs's own
//! `new_flow` (same backend pick, same `NP_CT` entries, same SNAT port
//! reservation), and a tracked flow is forwarded from its `CT_DIR_FORWARD`
//! and `CT_DIR_SNAT` entries. So the backend's replies, which come back
//! through TC, are translated there; and when this program is detached mid
//! flow, `np_ingress` finds the same entries and carries the flow on.
//!
//! Everything else returns `XDP_PASS` with the packet unchanged, for the
//! TC program (`np_ingress`) to handle as if XDP were not there: non-IPv4,
//! IPv4 with options, fragments, ICMP, IPv6 (extension headers included),
//! local backends (delivered by the stack), TCP FIN/RST (the closing state
//! of both directions' entries is kept by the TC path, `mark_closing`),
//! stale backends, new-flow errors, and any packet whose route
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
    macros::xdp,
    programs::XdpContext,
};
use proxy_common::{
    CT_DIR_FORWARD, CT_DIR_SNAT, CT_FLAG_SNAT, CT_REFRESH_S, CtKey, CtValue, FAMILY_V4, PROTO_TCP, PROTO_UDP, np_counter, np_port_bit,
};

use crate::kernel;
use crate::nodeport::{NEW_FLOW_ERR, TRANSLATE, backend_alive, new_flow};
use crate::nodeport_maps::{NP_CT, NP_PORTS, np_count};
use crate::packet::{ETH_HLEN, Pkt, TCP_FIN, TCP_RST, csum_replace2, csum_replace4};

const ETH_P_IP: u16 = 0x0800;
/// `AF_INET` for `bpf_fib_lookup`.
const AF_INET: u8 = 2;
/// `BPF_FIB_LKUP_RET_SUCCESS` (include/uapi/linux/bpf.h).
const FIB_SUCCESS: i64 = 0;
/// Offsets into the frame: IPv4 without options, then TCP or UDP.
const L3: usize = ETH_HLEN;
const L4: usize = ETH_HLEN + 20;
/// TCP's fixed header; UDP's is 8 bytes, and a datagram shorter than 20
/// bytes of L4 is left to TC (rare, and it keeps one bounds check).
const L4_MIN: usize = 20;

#[xdp]
pub fn xdp_nodeport(ctx: XdpContext) -> u32 {
    xdp_verdict(try_xdp::<{ kernel::FULL }>(&ctx))
}

/// For kernels without the coarse clock (see `kernel`).
#[xdp]
pub fn xdp_nodeport_compat(ctx: XdpContext) -> u32 {
    xdp_verdict(try_xdp::<{ kernel::COMPAT }>(&ctx))
}

/// `Err` carries a counter id: count it and pass the packet unchanged to
/// the TC program (fail open: XDP never drops what it does not handle).
#[inline(always)]
fn xdp_verdict(r: Result<u32, u32>) -> u32 {
    match r {
        Ok(v) => v,
        Err(reason) => {
            np_count(reason);
            XDP_PASS
        }
    }
}

/// A `T` read from the frame at `data + off`. The caller must have checked
/// `data + off + size_of::<T>() <= data_end`; `T` is an integer type.
#[inline(always)]
fn read_at<T: Copy>(data: usize, off: usize) -> T {
    // SAFETY: every caller reads below `L4 + L4_MIN` after checking
    // `data + L4 + L4_MIN <= data_end` (the verifier tracks the same bound
    // on the packet pointer and refuses the program otherwise); XDP frame
    // data stays in place until the program returns, as no helper that
    // moves it (`bpf_xdp_adjust_*`) is called. Unaligned: the IP header
    // follows the 14-byte Ethernet header.
    unsafe { core::ptr::read_unaligned((data + off) as *const T) }
}

/// Writes `v` into the frame at `data + off`; same contract as `read_at`.
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
fn zero_fib_params(fib: &mut core::mem::MaybeUninit<FibParams>) -> &mut FibParams {
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

#[inline(always)]
fn try_xdp<const KERNEL: u8>(ctx: &XdpContext) -> Result<u32, u32> {
    let (data, end) = (ctx.data(), ctx.data_end());
    if data + L4 + L4_MIN > end || u16::from_be(read_at::<u16>(data, 12)) != ETH_P_IP {
        return Ok(XDP_PASS);
    }
    if read_at::<u8>(data, L3) != 0x45 {
        // IPv4 options (or not IPv4 at all): the TC path parses them.
        return Ok(XDP_PASS);
    }
    // 0x3fff: the MF flag and the 13-bit fragment offset.
    if u16::from_be(read_at::<u16>(data, L3 + 6)) & 0x3fff != 0 {
        return Ok(XDP_PASS);
    }
    let proto = read_at::<u8>(data, L3 + 9);
    if proto != PROTO_TCP && proto != PROTO_UDP {
        // ICMP (errors about tracked flows, icmp.rs) and everything else.
        return Ok(XDP_PASS);
    }
    let p = Pkt {
        family: FAMILY_V4,
        proto,
        l3: L3,
        l4: L4,
        saddr: [read_at::<u32>(data, L3 + 12), 0, 0, 0],
        daddr: [read_at::<u32>(data, L3 + 16), 0, 0, 0],
        sport_be: read_at::<u16>(data, L4),
        dport_be: read_at::<u16>(data, L4 + 2),
        tcp_flags: if proto == PROTO_TCP { read_at::<u8>(data, L4 + 13) } else { 0 },
    };
    // The TC path's first test (nodeport.rs, `port_in_use`): no frontend
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
    let key = CtKey {
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
    if fwd.flags & CT_FLAG_SNAT == 0 || !backend_alive(fwd) {
        // A local backend (the stack delivers it), or a backend gone (the
        // TC path picks another).
        return Err(np_counter::XDP_PASS_TO_TC);
    }
    let skey = CtKey {
        saddr_be: p.saddr,
        daddr_be: fwd.daddr_be,
        sport_be: p.sport_be,
        dport_be: fwd.dport_be,
        proto: p.proto,
        family: p.family,
        dir: CT_DIR_SNAT,
        _pad: 0,
    };
    let Some(snat) = NP_CT.get_ptr_mut(&skey) else {
        return Err(np_counter::XDP_PASS_TO_TC);
    };
    // SAFETY: an NP_CT value pointer, valid for the run; races as above.
    let snat = unsafe { &mut *snat };
    let out = *snat;
    let rc = forward(ctx, &p, &out);
    if rc == i64::from(XDP_PASS) {
        return Err(np_counter::XDP_PASS_NO_ROUTE);
    }
    if rc < 0 {
        return Err(np_counter::XDP_PASS_TO_TC);
    }
    // The flow is in use (both legs the TC path would have refreshed, at
    // ingress and at egress). Written only when stale, not per packet (see
    // nodeport.rs, `touch`).
    let now = (kernel::now_ns::<KERNEL>() / 1_000_000_000) as u32;
    if now.wrapping_sub(fwd.seen_s) >= CT_REFRESH_S {
        fwd.seen_s = now;
    }
    if now.wrapping_sub(snat.seen_s) >= CT_REFRESH_S {
        snat.seen_s = now;
    }
    np_count(np_counter::XDP_FORWARDED);
    Ok(rc as u32)
}

/// Looks the route to `to`'s destination up, and only when the kernel can
/// forward there without the stack (`BPF_FIB_LKUP_RET_SUCCESS`: a route, a
/// resolved neighbour, a device up, within its MTU) rewrites the frame to
/// `to` (addresses, ports, MACs, TTL, checksums) and returns `XDP_TX` or
/// the verdict of `bpf_redirect`. Otherwise the frame is untouched and the
/// answer is `XDP_PASS` (or negative for a frame the bounds no longer
/// cover). Its own subprogram, with a plain integer result, to keep the
/// 64-byte lookup parameters out of the caller's frame.
#[inline(never)]
fn forward(ctx: &XdpContext, p: &Pkt, to: &CtValue) -> i64 {
    let (data, end) = (ctx.data(), ctx.data_end());
    if data + L4 + L4_MIN > end {
        return -1;
    }
    let ttl = read_at::<u8>(data, L3 + 8);
    if ttl <= 1 {
        // The stack sends the ICMP time exceeded.
        return i64::from(XDP_PASS);
    }
    let mut params = core::mem::MaybeUninit::<FibParams>::uninit();
    let fib = zero_fib_params(&mut params);
    fib.family = AF_INET;
    fib.l4_protocol = p.proto;
    fib.sport = to.sport_be;
    fib.dport = to.dport_be;
    // Host order: compared with the device MTU (`bpf_ipv4_fib_lookup`).
    fib.__bindgen_anon_1.tot_len = u16::from_be(read_at::<u16>(data, L3 + 2));
    fib.__bindgen_anon_2.tos = read_at::<u8>(data, L3 + 1);
    fib.__bindgen_anon_3.ipv4_src = to.saddr_be[0];
    fib.__bindgen_anon_4.ipv4_dst = to.daddr_be[0];
    fib.ifindex = ctx.ingress_ifindex() as u32;
    // SAFETY: `fib` is a local of the size passed; the helper reads and
    // writes only it, and the context is this program's own.
    let rc = unsafe { bpf_fib_lookup(ctx.ctx.cast(), core::ptr::from_mut(fib), core::mem::size_of::<FibParams>() as i32, 0) };
    if rc != FIB_SUCCESS {
        return i64::from(XDP_PASS);
    }
    // The helper does not move frame data; bounds checked again all the
    // same, as the verifier wants a fresh check for new pointers.
    let (data, end) = (ctx.data(), ctx.data_end());
    if data + L4 + L4_MIN > end {
        return -1;
    }
    write_mac(data, 0, &fib.dmac);
    write_mac(data, 6, &fib.smac);
    // IPv4 header: TTL (the 16-bit word TTL|protocol), then the addresses.
    let mut check = read_at::<u16>(data, L3 + 10);
    let ttl_word_old = read_at::<u16>(data, L3 + 8);
    write_at(data, L3 + 8, ttl - 1);
    let ttl_word_new = read_at::<u16>(data, L3 + 8);
    check = csum_replace2(check, ttl_word_old, ttl_word_new);
    check = csum_replace4(check, p.saddr[0], to.saddr_be[0]);
    check = csum_replace4(check, p.daddr[0], to.daddr_be[0]);
    write_at(data, L3 + 10, check);
    write_at(data, L3 + 12, to.saddr_be[0]);
    write_at(data, L3 + 16, to.daddr_be[0]);
    // L4: ports, and the checksum over the pseudo header and the ports.
    // tcphdr.check is at byte 16, udphdr.check at byte 6.
    let csum_at = if p.proto == PROTO_TCP { L4 + 16 } else { L4 + 6 };
    let old = read_at::<u16>(data, csum_at);
    // A UDP datagram without a checksum (zero, RFC 768) keeps none.
    if p.proto == PROTO_TCP || old != 0 {
        let mut c = csum_replace4(old, p.saddr[0], to.saddr_be[0]);
        c = csum_replace4(c, p.daddr[0], to.daddr_be[0]);
        c = csum_replace2(c, p.sport_be, to.sport_be);
        c = csum_replace2(c, p.dport_be, to.dport_be);
        if p.proto == PROTO_UDP && c == 0 {
            // A computed zero is sent as all ones (RFC 768).
            c = 0xffff;
        }
        write_at(data, csum_at, c);
    }
    write_at(data, L4, to.sport_be);
    write_at(data, L4 + 2, to.dport_be);
    if fib.ifindex == ctx.ingress_ifindex() as u32 {
        return i64::from(XDP_TX);
    }
    // SAFETY: no memory is passed; the helper only records the target
    // device for this CPU and returns XDP_REDIRECT (or XDP_ABORTED for
    // bad flags, none here).
    unsafe { bpf_redirect(fib.ifindex, 0) }
}
