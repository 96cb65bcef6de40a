//! Backend addresses, by the id the slots name.

// BACKENDS: BPF_MAP_TYPE_HASH, BackendKey -> BackendValue. Written by the
// agent (map writer, an id per backend address, its tier rewritten when
// the node's topology changes); read by the socket programs after the slot
// pick, and by the agent's dump. The TC datapath's `NP_BACKENDS` has the
// same layout.
/// The socket datapath's backend addresses: [`BackendKey`] -> [`BackendValue`].
pub const BACKENDS_MAP: &str = "BACKENDS";

/// Default capacity of `BACKENDS` and `NP_BACKENDS`: distinct backend addresses.
pub const DEFAULT_MAX_BACKENDS: u32 = 262_144;

/// `BACKENDS` / `NP_BACKENDS` key: a backend id the agent hands out.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BackendKey {
    /// The id a `SlotValue` names.
    pub backend_id: u32,
}

/// A backend address. Same address layout as [`ServiceKey`](crate::ServiceKey).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BackendValue {
    /// The backend's address, network byte order (IPv4 in the first word).
    pub ip_be: [u32; 4],
    /// The backend's port, network byte order.
    pub port_be: u16,
    /// `FAMILY_V4` or `FAMILY_V6`.
    pub family: u8,
    /// Where the backend runs relative to this node (a [`tier`](crate::tier) code), for
    /// the per-Service connection counts. It was padding (0, [`tier::OTHER`](crate::tier::OTHER))
    /// in builds before the counts; the agent rewrites it when it adopts
    /// such a map. Read in the same lookup as the address, so counting adds
    /// no lookup to the hit path.
    pub tier: u8,
}

const _: () = {
    assert!(core::mem::size_of::<BackendKey>() == 4);
    assert!(core::mem::size_of::<BackendValue>() == 20);
};

#[cfg(feature = "user")]
mod pod {
    //! `aya::Pod` for the types above: each is `#[repr(C)]`, holds only
    //! integers and integer arrays (padding spelled out as `_pad` fields),
    //! and its fields add up to the size asserted above, so every byte is
    //! initialised and every bit pattern is a valid value (see the crate's
    //! `lib.rs`).

    use super::{BackendKey, BackendValue};

    // SAFETY: repr(C), one u32, no padding.
    unsafe impl aya::Pod for BackendKey {}
    // SAFETY: repr(C) integers only; 16 + 2 + 1 + 1 (`tier`) = 20 bytes, no padding.
    unsafe impl aya::Pod for BackendValue {}
}
