//! Maglev consistent hashing (Eisenbud et al., NSDI 2016): a frontend's
//! new flows pick their backend from a lookup table of a prime size M
//! instead of `hash % backend_count`, so a backend that comes or goes moves
//! only about its own share of flows, and every node with the same backend
//! set picks the same backend for a flow.

use crate::{DEFAULT_MAX_SERVICES, SVC_AFFINITY_SCOPE_SHIFT, ServiceValue, fmix32};

// NP_MAGLEV: BPF_MAP_TYPE_HASH_OF_MAPS (BPF_F_NO_PREALLOC), MaglevKey ->
// BPF_MAP_TYPE_ARRAY of M u32 backend ids. Written by the agent (maglev
// tables, map writer); read by the TC programs for a new flow.
// SOCK_MAGLEV: the same for the socket datapath, read by sendmsg.
/// Hash of maps, [`MaglevKey`] -> an array of M `u32` backend ids (the
/// frontend's table). Tables exist only for frontends that have one, so a
/// frontend without (zero backends, socket datapath) costs nothing.
pub const NP_MAGLEV_MAP: &str = "NP_MAGLEV";
/// The socket datapath's tables, laid out as `NP_MAGLEV`: the per-socket
/// pick of unconnected UDP (sendmsg) takes its backend from the UDP
/// frontend's table, so a backend that leaves moves only its own sockets.
pub const SOCK_MAGLEV_MAP: &str = "SOCK_MAGLEV";
/// The default table size: a prime (every skip of a backend's permutation
/// is then coprime with M), 64 KiB of ids per table.
pub const MAGLEV_SIZE_DEFAULT: u32 = 16_381;
/// The large table size, for Services with hundreds of backends (the
/// shares stay within about 1 % of each other while M is above 100 times
/// the backend count).
pub const MAGLEV_SIZE_LARGE: u32 = 65_521;
/// Keys the outer map holds: one per frontend with backends (frontends
/// with the same backends link one array), plus the old generations of the
/// frontends being rewritten. The agent sizes it like `SERVICES`; neither
/// the outer map (not preallocated) nor the arrays cost anything before
/// they are used. A table that finds no room is not written: its frontend
/// takes the modulo pick.
pub const DEFAULT_MAX_MAGLEV: u32 = DEFAULT_MAX_SERVICES;

/// `ServiceValue.flags`: the frontend's generation has a Maglev table in
/// `NP_MAGLEV` under (service id, generation); new flows pick from it.
/// Without it (a datapath written by an agent without tables) they take the
/// modulo slot pick.
pub const SVC_FLAG_MAGLEV: u32 = 8;
/// `ServiceValue.flags`, with [`SVC_FLAG_MAGLEV`]: the table has
/// [`MAGLEV_SIZE_LARGE`] entries; without it, [`MAGLEV_SIZE_DEFAULT`].
pub const SVC_FLAG_MAGLEV_LARGE: u32 = 16;

/// `NP_MAGLEV` key: the table of one generation of one frontend, written
/// before the frontend's service entry switches to that generation and
/// removed after it switched away (as the slots are).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MaglevKey {
    /// The frontend's service id.
    pub service_id: u32,
    /// The generation of its backend set the table was computed for.
    pub generation: u32,
}

impl ServiceValue {
    /// M of this frontend's Maglev table, or 0 when it has none.
    #[inline(always)]
    pub fn maglev_size(&self) -> u32 {
        if self.flags & SVC_FLAG_MAGLEV == 0 {
            0
        } else if self.flags & SVC_FLAG_MAGLEV_LARGE != 0 {
            MAGLEV_SIZE_LARGE
        } else {
            MAGLEV_SIZE_DEFAULT
        }
    }
}

/// The hash that picks a new flow's table entry. It leaves out the
/// destination address, which for a NodePort is the receiving node's own:
/// what is left (client address and port, frontend port, protocol) is the
/// same on every node a flow's packets may reach, so two nodes with the
/// same table pick the same backend. With session affinity only the
/// client's address counts (kube-proxy's ClientIP), so all of a client's
/// flows agree too.
#[inline(always)]
pub fn maglev_hash(saddr: &[u32; 4], sport_be: u16, dport_be: u16, proto: u8, client_only: bool) -> u32 {
    let a = saddr[0] ^ saddr[1].rotate_left(7) ^ saddr[2].rotate_left(13) ^ saddr[3].rotate_left(19);
    if client_only {
        return fmix32(a);
    }
    fmix32(fmix32(a) ^ ((u32::from(sport_be) << 16) | u32::from(dport_be)) ^ (u32::from(proto) << 8))
}

const _: () = {
    assert!(core::mem::size_of::<MaglevKey>() == 8);
    assert!(SVC_FLAG_MAGLEV_LARGE < (1 << SVC_AFFINITY_SCOPE_SHIFT));
};

#[cfg(feature = "user")]
mod pod {
    //! `aya::Pod` for the types above: each is `#[repr(C)]`, holds only
    //! integers and integer arrays (padding spelled out as `_pad` fields),
    //! and its fields add up to the size asserted above, so every byte is
    //! initialised and every bit pattern is a valid value (see the crate's
    //! `lib.rs`).

    use super::MaglevKey;

    // SAFETY: repr(C), two u32 = 8 bytes, no padding.
    unsafe impl aya::Pod for MaglevKey {}
}
