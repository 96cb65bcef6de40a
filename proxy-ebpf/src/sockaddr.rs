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

#[inline(always)]
pub fn read_peer<const FAMILY: u8>(sa: *mut bpf_sock_addr) -> Addr {
    let family = FAMILY;
    // SAFETY: `sa` is the context pointer the kernel passed in.
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

#[inline(always)]
pub fn write_peer<const FAMILY: u8>(sa: *mut bpf_sock_addr, to: &Addr) {
    // SAFETY: as above; these fields are writable for every attach type we use.
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
