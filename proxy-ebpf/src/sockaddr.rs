//! Reading and writing the destination/peer address of a `bpf_sock_addr`.
//!
//! The kernel only allows 4-byte accesses to `user_ip4`, `user_ip6[i]` and
//! `user_port` (`net/core/filter.c:sock_addr_is_valid_access`), so every
//! access is a single volatile u32 load or store that the compiler cannot
//! merge or split.

use aya_ebpf::bindings::bpf_sock_addr;
use core::ptr::{addr_of, addr_of_mut, read_volatile, write_volatile};
use proxy_common::{FAMILY_V4, FAMILY_V6};

/// An address in the maps' layout: IPv4 in `ip_be[0]`, network byte order.
#[derive(Clone, Copy)]
pub struct Addr {
    pub ip_be: [u32; 4],
    pub port_be: u16,
    pub family: u8,
}

/// The address the call names (connect, sendmsg) or reports (recvmsg,
/// getpeername). `sa` must be `ctx.sock_addr` of the running program, and
/// `FAMILY` the family of its attach type (`FAMILY_V4` for the *4 hooks,
/// `FAMILY_V6` for the *6 ones); every caller passes exactly that.
#[inline(always)]
pub fn read_peer<const FAMILY: u8>(sa: *mut bpf_sock_addr) -> Addr {
    let family = FAMILY;
    // SAFETY: `sa` is the running program's context (see the doc), valid for
    // the whole run. Each access is one aligned 4-byte volatile load of a
    // field that the program's attach type may read: `user_ip4` for the
    // IPv4 hooks, `user_ip6[i]` for the IPv6 ones, `user_port` for both
    // (`sock_addr_is_valid_access`; the verifier refuses the program
    // otherwise and turns each load into a read of the kernel's sockaddr).
    // `addr_of!` never creates a reference to the context.
    unsafe {
        let ip_be = if family == FAMILY_V4 {
            [read_volatile(addr_of!((*sa).user_ip4)), 0, 0, 0]
        } else {
            [
                read_volatile(addr_of!((*sa).user_ip6[0])),
                read_volatile(addr_of!((*sa).user_ip6[1])),
                read_volatile(addr_of!((*sa).user_ip6[2])),
                read_volatile(addr_of!((*sa).user_ip6[3])),
            ]
        };
        // user_port holds the network-order port in its first two bytes.
        let port_be = read_volatile(addr_of!((*sa).user_port)) as u16;
        Addr { ip_be, port_be, family }
    }
}

/// Replaces the address the call names or reports with `to`. Same
/// requirements on `sa` and `FAMILY` as `read_peer`.
#[inline(always)]
pub fn write_peer<const FAMILY: u8>(sa: *mut bpf_sock_addr, to: &Addr) {
    // SAFETY: as for `read_peer`: one aligned 4-byte volatile store per
    // field. `user_ip4`/`user_ip6[i]` and `user_port` are writable for the
    // connect, sendmsg, recvmsg and getpeername attach types of the matching
    // family (`sock_addr_is_valid_access`); the verifier turns each store
    // into a write to the kernel's copy of the sockaddr the call uses or
    // reports.
    unsafe {
        if FAMILY == FAMILY_V4 {
            write_volatile(addr_of_mut!((*sa).user_ip4), to.ip_be[0]);
        } else {
            write_volatile(addr_of_mut!((*sa).user_ip6[0]), to.ip_be[0]);
            write_volatile(addr_of_mut!((*sa).user_ip6[1]), to.ip_be[1]);
            write_volatile(addr_of_mut!((*sa).user_ip6[2]), to.ip_be[2]);
            write_volatile(addr_of_mut!((*sa).user_ip6[3]), to.ip_be[3]);
        }
        write_volatile(addr_of_mut!((*sa).user_port), u32::from(to.port_be));
    }
}

/// The address the socket is bound to (`bind()` before `connect()`), in
/// the family of the socket's attach type; all zero when it is not bound,
/// which is the common case: the kernel picks the source address only after
/// the connect and sendmsg hooks ran (`ip_route_connect`,
/// `udp_sendmsg`). Same requirements on `sa` and `FAMILY` as `read_peer`.
#[inline(always)]
pub fn bound_source<const FAMILY: u8>(sa: *mut bpf_sock_addr) -> Addr {
    // SAFETY: `sa` is the running program's context. `sk` is readable by
    // every sock_addr attach type as one 8-byte load, which the verifier
    // types as a non-null socket pointer (PTR_TO_SOCKET,
    // `sock_addr_is_valid_access`), valid for the run; `src_ip4` and each
    // word of `src_ip6` are readable from it as aligned 4-byte loads
    // (`bpf_sock_is_valid_access`), which the verifier turns into reads of
    // the socket's `inet_rcv_saddr` / `sk_v6_rcv_saddr`. `addr_of!` creates
    // no reference to kernel memory.
    unsafe {
        let sk = read_volatile(addr_of!((*sa).__bindgen_anon_1.sk));
        let ip_be = if FAMILY == FAMILY_V4 {
            [read_volatile(addr_of!((*sk).src_ip4)), 0, 0, 0]
        } else {
            [
                read_volatile(addr_of!((*sk).src_ip6[0])),
                read_volatile(addr_of!((*sk).src_ip6[1])),
                read_volatile(addr_of!((*sk).src_ip6[2])),
                read_volatile(addr_of!((*sk).src_ip6[3])),
            ]
        };
        Addr { ip_be, port_be: 0, family: FAMILY }
    }
}

/// The third word of an IPv4-mapped IPv6 address `::ffff:a.b.c.d` (RFC 4291
/// 2.5.5.2), as it sits in memory.
const V4_MAPPED_WORD2: u32 = u32::from_ne_bytes([0, 0, 0xff, 0xff]);

impl Addr {
    /// The IPv4 address inside an IPv4-mapped IPv6 address. An AF_INET6
    /// socket that is not IPV6_V6ONLY reaches IPv4 peers this way (Java and
    /// other dual-stack runtimes do so by default); the kernel then runs the
    /// *6 hooks with the mapped address (`tcp_v6_pre_connect`,
    /// `udpv6_recvmsg`), while the maps hold the IPv4 frontend.
    #[inline(always)]
    pub fn unmapped_v4(&self) -> Option<Addr> {
        if self.family == FAMILY_V6 && self.ip_be[0] == 0 && self.ip_be[1] == 0 && self.ip_be[2] == V4_MAPPED_WORD2 {
            Some(Addr { ip_be: [self.ip_be[3], 0, 0, 0], port_be: self.port_be, family: FAMILY_V4 })
        } else {
            None
        }
    }

    /// An IPv4 address as the IPv4-mapped IPv6 address an AF_INET6 socket
    /// sees.
    #[inline(always)]
    pub fn mapped_v6(&self) -> Addr {
        Addr { ip_be: [0, 0, V4_MAPPED_WORD2, self.ip_be[0]], port_be: self.port_be, family: FAMILY_V6 }
    }
}
