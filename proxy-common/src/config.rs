//! Node-wide settings the agent writes once per install or configuration
//! change: one-element arrays the programs read on their paths.

// SOCK_CONFIG: BPF_MAP_TYPE_ARRAY, one element, u32 0 -> SockConfig.
// Written by the agent when it adopts a datapath; read by
// getpeername/recvmsg.
/// One-element array holding [`SockConfig`], the socket programs' settings.
pub const SOCK_CONFIG_MAP: &str = "SOCK_CONFIG";
// NODE_NETNS: BPF_MAP_TYPE_ARRAY, one element, u32 0 -> NodeNetns. Written
// by the agent at install; read by connect/sendmsg (source ranges and
// affinity of the node's own processes).
/// One-element array holding [`NodeNetns`].
pub const NODE_NETNS_MAP: &str = "NODE_NETNS";
// NP_CONFIG: BPF_MAP_TYPE_ARRAY, one element, u32 0 -> NpConfig. Written
// by the agent (SNAT addresses and port range); read by the TC programs.
/// One-element array holding [`NpConfig`].
pub const NP_CONFIG_MAP: &str = "NP_CONFIG";

/// The single element of `SOCK_CONFIG` (an array the agent writes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockConfig {
    /// Sockets translated by an agent version without `SOCK_PEER` have
    /// their reverse entry only in `SOCK_REVNAT`. The agent that first
    /// adopts such a datapath records here one above the largest cookie
    /// with a `SOCK_REVNAT` entry (cookies are not ordered across CPUs, so
    /// the next cookie the kernel hands out is no bound);
    /// a socket without `SOCK_PEER` storage and a cookie below this value
    /// may be such a socket, so the reverse path consults `SOCK_REVNAT` for
    /// it. 0: no such sockets.
    pub legacy_revnat_cookie_below: u64,
}

/// The single element of `NODE_NETNS`, which the agent writes when it
/// installs the datapath.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeNetns {
    /// The cookie (`SO_NETNS_COOKIE`, `bpf_get_netns_cookie`) of the node's
    /// own network namespace: the agent's, which runs with the host's
    /// network. Sockets there are the node's processes, whose source
    /// address is one of the node's. 0 until written: no socket is then
    /// taken for the node's.
    pub netns_cookie: u64,
}

/// Node-wide settings written by the agent.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NpConfig {
    /// Source address for flows sent to another node's backend, so that the
    /// reply comes back through this node. Zero: such flows are passed
    /// untranslated (and counted).
    pub snat_v4_be: u32,
    /// Padding, always zero.
    pub _pad0: u32,
    /// The IPv6 SNAT source address, network byte order; zero as for `snat_v4_be`.
    pub snat_v6_be: [u32; 4],
    /// SNAT source ports are taken from `snat_port_min..=snat_port_max`
    /// (host order); the default range lies above Linux's ephemeral range
    /// (net.ipv4.ip_local_port_range 32768-60999) so that it never collides
    /// with the node's own connections.
    pub snat_port_min: u16,
    /// The last SNAT source port (host order), inclusive.
    pub snat_port_max: u16,
    /// Padding, always zero.
    pub _pad1: u32,
}

/// The first SNAT source port by default.
pub const DEFAULT_SNAT_PORT_MIN: u16 = 61_000;
/// The last SNAT source port by default.
pub const DEFAULT_SNAT_PORT_MAX: u16 = 65_535;

const _: () = {
    assert!(core::mem::size_of::<SockConfig>() == 8);
    assert!(core::mem::size_of::<NodeNetns>() == 8);
    assert!(core::mem::size_of::<NpConfig>() == 32);
};

#[cfg(feature = "user")]
mod pod {
    //! `aya::Pod` for the types above: each is `#[repr(C)]`, holds only
    //! integers and integer arrays (padding spelled out as `_pad` fields),
    //! and its fields add up to the size asserted above, so every byte is
    //! initialised and every bit pattern is a valid value (see the crate's
    //! `lib.rs`).

    use super::{NodeNetns, NpConfig, SockConfig};

    // SAFETY: repr(C), one u64, no padding.
    unsafe impl aya::Pod for SockConfig {}
    // SAFETY: repr(C), one u64, no padding.
    unsafe impl aya::Pod for NodeNetns {}
    // SAFETY: repr(C) integers only; 4 + 4 (`_pad0`) + 16 + 2 + 2 + 4 (`_pad1`) = 32 bytes, no padding.
    unsafe impl aya::Pod for NpConfig {}
}
