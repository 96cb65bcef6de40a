//! External traffic at TC: NodePort, LoadBalancer ingress IPs and
//! externalIPs, translated per packet on the node's devices.
//!
//! The TC programs keep their own service/slot/backend maps (same layouts as
//! the socket ones) because the same frontend can need a different backend
//! set depending on where the client is: traffic from outside a node follows
//! `externalTrafficPolicy` (Local: only this node's endpoints), while traffic
//! from the node itself to the same address uses the cluster-wide set, as
//! kube-proxy does for node-originated traffic.

use crate::fmix32;

// NP_SERVICES: BPF_MAP_TYPE_HASH (BPF_F_NO_PREALLOC), ServiceKey ->
// ServiceValue; NP_SLOTS: BPF_MAP_TYPE_HASH, SlotKey -> SlotValue;
// NP_BACKENDS: BPF_MAP_TYPE_HASH, BackendKey -> BackendValue. Written by
// the agent (map writer); read by the TC and XDP programs.
/// The TC datapath's frontends: [`ServiceKey`](crate::ServiceKey) -> [`ServiceValue`](crate::ServiceValue).
pub const NP_SERVICES_MAP: &str = "NP_SERVICES";
/// The TC datapath's slots: [`SlotKey`](crate::SlotKey) -> [`SlotValue`](crate::SlotValue).
pub const NP_SLOTS_MAP: &str = "NP_SLOTS";
/// The TC datapath's backends: [`BackendKey`](crate::BackendKey) -> [`BackendValue`](crate::BackendValue).
pub const NP_BACKENDS_MAP: &str = "NP_BACKENDS";
// NP_FLAGS: BPF_MAP_TYPE_HASH (BPF_F_NO_PREALLOC), ServiceKey ->
// NpFlagsValue. Written by the agent; read by the TC programs.
/// Per-frontend policy flags ([`NpFlagsValue`]), keyed by [`ServiceKey`](crate::ServiceKey).
pub const NP_FLAGS_MAP: &str = "NP_FLAGS";
// NP_LOCAL: BPF_MAP_TYPE_HASH (BPF_F_NO_PREALLOC), AddrKey -> u32. Written
// by the agent (this node's endpoints); read by the TC programs.
/// Addresses of endpoints that live on this node ([`AddrKey`] -> u32).
pub const NP_LOCAL_MAP: &str = "NP_LOCAL";

/// Default capacity of `NP_LOCAL`: endpoint addresses on this node.
pub const DEFAULT_MAX_NP_LOCAL: u32 = 65_536;

/// `NpFlagsValue.flags`: the frontend follows `externalTrafficPolicy:
/// Local`. With no local endpoint its packets are dropped (kube-proxy drops
/// them too) instead of rejected.
pub const NP_FLAG_POLICY_LOCAL: u32 = 1;

/// `NP_FLAGS` value: what a TC frontend needs besides its backends.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NpFlagsValue {
    /// `NP_FLAG_*` bits.
    pub flags: u32,
}

/// An address on its own (same layout rules as [`ServiceKey`](crate::ServiceKey)).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AddrKey {
    /// The address, network byte order (IPv4 in the first word).
    pub ip_be: [u32; 4],
    /// `FAMILY_V4` or `FAMILY_V6`.
    pub family: u8,
    /// Two fields, see [`NpAffinityKey::_pad0`](crate::NpAffinityKey::_pad0).
    pub _pad0: u8,
    /// The rest of the padding (see `_pad0`).
    pub _pad1: u16,
}

impl AddrKey {
    /// A key with its padding zeroed.
    #[inline(always)]
    pub fn new(ip_be: [u32; 4], family: u8) -> Self {
        Self { ip_be, family, _pad0: 0, _pad1: 0 }
    }
}

/// Hash of a flow's 5-tuple (fmix32 finaliser, as [`socket_hash`](crate::socket_hash)). Every
/// packet of a flow hashes alike, so a flow whose conntrack entry was lost
/// lands on the same slot again while the backend set is unchanged.
#[inline(always)]
pub fn flow_hash(saddr: &[u32; 4], sport_be: u16, proto: u8) -> u32 {
    let h = saddr[0] ^ saddr[1].rotate_left(7) ^ saddr[2].rotate_left(13) ^ saddr[3].rotate_left(19);
    fmix32(h ^ ((u32::from(sport_be) << 16) | u32::from(proto)))
}

const _: () = {
    assert!(core::mem::size_of::<NpFlagsValue>() == 4);
    assert!(core::mem::size_of::<AddrKey>() == 20);
};

#[cfg(feature = "user")]
mod pod {
    //! `aya::Pod` for the types above: each is `#[repr(C)]`, holds only
    //! integers and integer arrays (padding spelled out as `_pad` fields),
    //! and its fields add up to the size asserted above, so every byte is
    //! initialised and every bit pattern is a valid value (see the crate's
    //! `lib.rs`).

    use super::{AddrKey, NpFlagsValue};

    // SAFETY: repr(C), one u32, no padding.
    unsafe impl aya::Pod for NpFlagsValue {}
    // SAFETY: repr(C) integers only; 16 + 1 + 3 (`_pad`) = 20 bytes, no padding.
    unsafe impl aya::Pod for AddrKey {}
}
