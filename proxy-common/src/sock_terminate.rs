//! Socket termination: the BPF socket iterators (`iter/tcp`, `iter/udp`)
//! that abort the sockets translated to a backend that left its frontend.

// SOCK_TERMINATE: BPF_MAP_TYPE_HASH, SockTerminateKey ->
// SockTerminateValue. Written by the agent for one walk (not pinned);
// read and counted into by the socket iterators.
/// The frontend-backend pairs whose sockets the iterators abort, written by
/// the agent for one walk of the node's namespaces and emptied after it.
/// Not pinned: it holds nothing between walks.
pub const SOCK_TERMINATE_MAP: &str = "SOCK_TERMINATE";
/// Pairs per walk; a batch with more is split into several walks.
pub const MAX_SOCK_TERMINATE: u32 = 4_096;

/// One pair: a socket of protocol `proto` whose `SOCK_REVNAT` entry says it
/// was translated from the frontend to the backend, and whose peer is that
/// backend now, is aborted. IPv4 in the first word, as in [`ServiceKey`](crate::ServiceKey);
/// an IPv4 peer of an IPv6 socket (`::ffff:a.b.c.d`) is matched in IPv4
/// form, as the connect hook remembers it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SockTerminateKey {
    /// The frontend, network byte order (IPv4 in the first word).
    pub frontend_ip_be: [u32; 4],
    /// The backend that left it, network byte order.
    pub backend_ip_be: [u32; 4],
    /// The frontend's port, network byte order.
    pub frontend_port_be: u16,
    /// The backend's port, network byte order.
    pub backend_port_be: u16,
    /// `FAMILY_V4` or `FAMILY_V6`.
    pub family: u8,
    /// `PROTO_TCP` or `PROTO_UDP`.
    pub proto: u8,
    /// Padding, always zero.
    pub _pad: [u8; 2],
}

/// What the iterators did for one pair (the agent reads it back for its
/// metrics and logs; the programs never log per socket).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockTerminateValue {
    /// Sockets aborted.
    pub terminated: u64,
    /// `bpf_sock_destroy` refused (the socket is left as it is).
    pub failed: u64,
}

/// Offsets in `struct sock_common` (include/net/sock.h) of what the
/// iterators read: the peer address and port, the family and the state.
/// The layout has been the same since Linux 3.13 on 64-bit kernels built
/// with network namespaces; the agent checks these against the running
/// kernel's BTF before it loads the iterators, and uses netlink otherwise.
pub const SKC_DADDR_OFF: usize = 0;
/// `skc_dport`: the peer's port, network byte order.
pub const SKC_DPORT_OFF: usize = 12;
/// `skc_family`.
pub const SKC_FAMILY_OFF: usize = 16;
/// `skc_state` (`include/net/tcp_states.h`).
pub const SKC_STATE_OFF: usize = 18;
/// `skc_v6_daddr`: the peer's IPv6 address.
pub const SKC_V6_DADDR_OFF: usize = 56;

/// The `imm` of the iterators' `bpf_sock_destroy` call as compiled: aya
/// 0.14 has no kfunc relocation, so the program carries this placeholder
/// in a `BPF_PSEUDO_KFUNC_CALL` instruction and the agent writes the
/// kfunc's BTF id of the running kernel over it before loading (what
/// libbpf does for `__ksym` externs).
pub const SOCK_DESTROY_KFUNC_PLACEHOLDER: u32 = 0x7f5d_0d35;
/// That instruction as 8 little-endian bytes: `call` (0x85) with src_reg
/// `BPF_PSEUDO_KFUNC_CALL` (2), off 0 (vmlinux BTF), imm the placeholder.
pub const SOCK_DESTROY_KFUNC_INSN: u64 = 0x2085 | ((SOCK_DESTROY_KFUNC_PLACEHOLDER as u64) << 32);

const _: () = {
    assert!(core::mem::size_of::<SockTerminateKey>() == 40);
    assert!(core::mem::size_of::<SockTerminateValue>() == 16);
};

#[cfg(feature = "user")]
mod pod {
    //! `aya::Pod` for the types above: each is `#[repr(C)]`, holds only
    //! integers and integer arrays (padding spelled out as `_pad` fields),
    //! and its fields add up to the size asserted above, so every byte is
    //! initialised and every bit pattern is a valid value (see the crate's
    //! `lib.rs`).

    use super::{SockTerminateKey, SockTerminateValue};

    // SAFETY: repr(C) integers only; 16 + 16 + 2 + 2 + 1 + 1 + 2 (`_pad`) = 40 bytes, no padding.
    unsafe impl aya::Pod for SockTerminateKey {}
    // SAFETY: repr(C), two u64, no padding.
    unsafe impl aya::Pod for SockTerminateValue {}
}
