//! Per-Service connection counts by topology tier (issue #34): how much
//! of a Service's traffic stayed near.

/// Topology tiers: where a connection's backend runs relative to the node
/// that sent it, or the domain the Service's topology chose it by (issue
/// #34: how much of a Service's traffic stayed near). The order of the
/// checks is node, zone, region, pool; the first shared domain wins.
pub mod tier {
    /// None of the domains below is shared, or it is not known.
    pub const OTHER: u8 = 0;
    /// The same node.
    pub const NODE: u8 = 1;
    /// The same zone (`topology.kubernetes.io/zone`).
    pub const ZONE: u8 = 2;
    /// The same region (`topology.kubernetes.io/region`).
    pub const REGION: u8 = 3;
    /// The same OpenYurt node pool (`apps.openyurt.io/nodepool`).
    pub const POOL: u8 = 4;
    /// The number of tiers.
    pub const COUNT: usize = 5;
    /// Names for display and metric labels, indexed by code.
    pub const NAMES: [&str; COUNT] = ["other", "node", "zone", "region", "pool"];
}

// SVC_CONN: BPF_MAP_TYPE_PERCPU_ARRAY, svc_conn_index(service id) ->
// SvcConnValue. Written by connect/sendmsg (one add per new connection or
// flow); read by the agent (metrics, dump).
// SVC_TOPO: BPF_MAP_TYPE_ARRAY, same index -> SvcTopoValue. Written by the
// agent (map writer); read by connect/sendmsg.
// NP_SVC_CONN / NP_SVC_TOPO: the same for the TC and XDP programs.
/// Per-CPU array of [`SvcConnValue`], indexed by [`svc_conn_index`] of a
/// socket-datapath service id: new connections (connect) and new
/// unconnected-UDP flows (sendmsg) per frontend and tier.
pub const SVC_CONN_MAP: &str = "SVC_CONN";
/// Array of [`SvcTopoValue`], indexed as `SVC_CONN`: what the agent tells
/// the socket programs to add per counted connection.
pub const SVC_TOPO_MAP: &str = "SVC_TOPO";
/// The TC datapath's `SVC_CONN` (new NodePort/LoadBalancer/externalIP flows,
/// TC and XDP), indexed by its own service ids.
pub const NP_SVC_CONN_MAP: &str = "NP_SVC_CONN";
/// The TC datapath's `SVC_TOPO`.
pub const NP_SVC_TOPO_MAP: &str = "NP_SVC_TOPO";

/// Fixed-point one for [`SvcTopoValue::blind_remote_share_fp`] and
/// [`SvcConnValue::blind_remote_fp`]: a share of 1/3 is 21,845.
pub const SHARE_ONE: u32 = 1 << 16;

/// The `SVC_CONN`/`SVC_TOPO` index of a service id. The agent hands out
/// service ids from 1 to the services capacity, so index
/// `0..capacity` covers them; an older build's larger ids (and 0) fall
/// outside the arrays and are not counted (`counter::TOPO_UNCOUNTED`).
#[inline(always)]
pub fn svc_conn_index(service_id: u32) -> u32 {
    service_id.wrapping_sub(1)
}

/// One frontend's counts on one CPU.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SvcConnValue {
    /// New connections or flows per [`tier`] code.
    pub tiers: [u64; tier::COUNT],
    /// The sum of [`SvcTopoValue::blind_remote_share_fp`] over the counted
    /// connections: divided by [`SHARE_ONE`], how many of them a pick
    /// blind to topology would be expected to have sent out of this node's
    /// zone.
    pub blind_remote_fp: u64,
}

/// What the agent writes per frontend for the counting.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SvcTopoValue {
    /// The share of the Service port's serving endpoints outside this
    /// node's zone, in [`SHARE_ONE`]ths.
    pub blind_remote_share_fp: u32,
}

const _: () = {
    assert!(core::mem::size_of::<SvcConnValue>() == 48);
    assert!(core::mem::size_of::<SvcTopoValue>() == 4);
    assert!(tier::COUNT < 8);
};

#[cfg(feature = "user")]
mod pod {
    //! `aya::Pod` for the types above: each is `#[repr(C)]`, holds only
    //! integers and integer arrays (padding spelled out as `_pad` fields),
    //! and its fields add up to the size asserted above, so every byte is
    //! initialised and every bit pattern is a valid value (see the crate's
    //! `lib.rs`).

    use super::{SvcConnValue, SvcTopoValue};

    // SAFETY: repr(C), six u64 = 48 bytes, no padding.
    unsafe impl aya::Pod for SvcConnValue {}
    // SAFETY: repr(C), one u32, no padding.
    unsafe impl aya::Pod for SvcTopoValue {}
}
