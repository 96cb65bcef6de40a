//! The socket datapath's frontends and their backend slots.
//!
//! The agent writes a frontend's backend set under a fresh generation in
//! `SLOTS` and only then replaces its `SERVICES` entry, so a reader sees the
//! old (count, generation) pair or the new one, never a mix (see the crate
//! documentation). The TC datapath's `NP_SERVICES`/`NP_SLOTS` use the same
//! types ([`crate::nodeport`]).

use crate::tier;

// SERVICES: BPF_MAP_TYPE_HASH (BPF_F_NO_PREALLOC), ServiceKey -> ServiceValue.
// Written by the agent (map writer, one entry per frontend); read by the
// socket programs (connect, sendmsg) to find a frontend's slot set.
/// The socket datapath's frontends: [`ServiceKey`] -> [`ServiceValue`].
pub const SERVICES_MAP: &str = "SERVICES";
// SLOTS: BPF_MAP_TYPE_HASH, SlotKey -> SlotValue. Written by the agent
// (a generation's slots before the frontend switches to it, the old
// generation's deleted after); read by the socket programs to pick a
// backend id.
/// The socket datapath's slots: [`SlotKey`] -> [`SlotValue`].
pub const SLOTS_MAP: &str = "SLOTS";

/// Default capacities; the agent can override each at load time.
pub const DEFAULT_MAX_SERVICES: u32 = 65_536;
/// Default capacity of `SLOTS` and `NP_SLOTS`: backend slots over all frontends and generations.
pub const DEFAULT_MAX_SLOTS: u32 = 1_048_576;

/// A frontend: what a client dials. IPv4 addresses live in `ip_be[0]`, the
/// other three words are zero, so the key stays the same size for both
/// families and the family byte keeps them apart.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceKey {
    /// The frontend's address, network byte order (IPv4 in the first word).
    pub ip_be: [u32; 4],
    /// The frontend's port, network byte order.
    pub port_be: u16,
    /// `PROTO_TCP` or `PROTO_UDP`: the same port over TCP and UDP are
    /// different Services in Kubernetes, so the protocol is part of the key.
    pub proto: u8,
    /// `FAMILY_V4` or `FAMILY_V6`.
    pub family: u8,
}

/// What a frontend resolves to.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServiceValue {
    /// Stable id of this frontend; slots are keyed by it.
    pub service_id: u32,
    /// Number of slots `0..backend_count` written under `generation`. Zero
    /// means the Service exists but has no usable backend: connect() is
    /// refused.
    pub backend_count: u32,
    /// Generation of the slot set this entry points at.
    pub generation: u32,
    /// `SVC_FLAG_*` bits (the low [`SVC_AFFINITY_SCOPE_SHIFT`] bits): what
    /// the frontend needs besides its backends. An agent version without
    /// them wrote zero, which the programs read as "neither". The bits
    /// above hold the session-affinity scope (see
    /// [`ServiceValue::affinity_scope`]).
    pub flags: u32,
    /// Weighted slots (graded spill-over, issue #48) in at most
    /// [`SLOT_GROUPS`] groups of equal weight: slot `0..groups[0].slot_end`
    /// is the first group, and so on. All zero (what an agent before them
    /// wrote, and every frontend without weights): one plain slot set,
    /// picked by hash modulo `backend_count`. See [`ServiceValue::slot_for`].
    pub groups: [SlotGroup; SLOT_GROUPS],
}

/// How many groups of equal weight [`ServiceValue::groups`] holds. A
/// weighted frontend with more distinct weights lists each backend as
/// often as its weight instead (plain slots, no groups).
pub const SLOT_GROUPS: usize = 4;

/// One group of a weighted frontend's slots: the backends in it are
/// picked alike, the group by its weight. The connect hit path then looks
/// up as many slots as without weights (one per backend): a weighted
/// frontend listing each backend as often as its weight spread its picks
/// over 1,000 slot entries, each one cold in the cache (issue #48's
/// benchmark measured 1.40x-1.66x the plain hit path for it).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SlotGroup {
    /// The slot index after the group's last; 0 ends the list.
    pub slot_end: u32,
    /// The sum of the weights of this group and those before it: the
    /// group's weight is this less the previous group's, spread evenly
    /// over its slots.
    pub weight_end: u32,
}

/// `ServiceValue.flags`: `sessionAffinity: ClientIP`. A client's choice is
/// kept in `AFFINITY`/`NP_AFFINITY` and honoured while `AFFINITY_MATCH`/
/// `NP_AFFINITY_MATCH` lists its backend under the frontend's current
/// generation (which also carries the timeout).
pub const SVC_FLAG_AFFINITY: u32 = 1;
/// `ServiceValue.flags`: `loadBalancerSourceRanges` apply: only clients
/// whose address matches an entry of `SOURCE_RANGES`/`NP_SOURCE_RANGES`
/// under the frontend's (service id, generation) get through. No entry at
/// all means no client does (the filter fails closed).
pub const SVC_FLAG_SOURCE_RANGES: u32 = 2;
/// `ServiceValue.flags`, socket programs only: with `SVC_FLAG_SOURCE_RANGES`,
/// the node's own processes (its network namespace, `NODE_NETNS`) may
/// connect although their socket has no source address yet: one of the
/// node's addresses lies inside a range (kube-proxy lets the node through
/// in that case too).
pub const SVC_FLAG_SOURCE_RANGES_NODE: u32 = 4;

/// `ServiceValue.flags` bits 5..8: the tier every connection to this
/// frontend counts in, plus one, when the Service's topology chose its
/// backends by one domain (a topology key, OpenYurt's node pool, hints,
/// trafficDistribution); 0: each backend's own [`BackendValue::tier`](crate::BackendValue::tier)
/// (no topology, or a fall-through to anywhere). See
/// [`ServiceValue::counted_tier`].
pub const SVC_TIER_SHIFT: u32 = 5;
/// The mask of those three bits.
pub const SVC_TIER_MASK: u32 = 7 << SVC_TIER_SHIFT;

/// `ServiceValue.flags` above this many bits: the affinity scope id, 24
/// bits, 0 for none.
pub const SVC_AFFINITY_SCOPE_SHIFT: u32 = 8;
/// The largest affinity scope id `ServiceValue.flags` can carry.
pub const SVC_AFFINITY_SCOPE_MAX: u32 = u32::MAX >> SVC_AFFINITY_SCOPE_SHIFT;

impl ServiceValue {
    /// The key under which clients' affinity choices for this frontend are
    /// kept. kube-proxy keeps ClientIP affinity per Service port (its
    /// `recent` lists hang off the port's endpoint chains, shared by the
    /// ClusterIP, NodePort and LoadBalancer rules), so all frontends of one
    /// Service port and family carry the same scope id. A value written by
    /// an agent without scopes (0) keeps its choices per frontend, under
    /// the service id.
    #[inline(always)]
    pub fn affinity_scope(&self) -> u32 {
        match self.flags >> SVC_AFFINITY_SCOPE_SHIFT {
            0 => self.service_id,
            scope => scope,
        }
    }

    /// The [`tier`] a connection to this frontend through a backend of
    /// tier `backend_tier` counts in: the frontend's own tier when its
    /// flags carry one, else the backend's. Always below [`tier::COUNT`]
    /// (an unknown code counts as [`tier::OTHER`]), so it indexes
    /// [`SvcConnValue::tiers`](crate::SvcConnValue::tiers) without a further check.
    #[inline(always)]
    pub fn counted_tier(&self, backend_tier: u8) -> usize {
        let t = match (self.flags & SVC_TIER_MASK) >> SVC_TIER_SHIFT {
            0 => u32::from(backend_tier),
            t => t - 1,
        };
        if t < tier::COUNT as u32 { t as usize } else { tier::OTHER as usize }
    }

    /// The slot of this service's current generation that `hash` selects.
    /// `backend_count` must be non-zero (see [`select_slot`]).
    #[inline(always)]
    pub fn slot_for(&self, hash: u32) -> SlotKey {
        SlotKey { service_id: self.service_id, generation: self.generation, slot: self.slot_index(hash) }
    }

    /// The slot index `hash` selects: with [`ServiceValue::groups`], a
    /// group by a second hash of `hash` against the groups' cumulative
    /// weights, then a slot of that group by `hash`; without, `hash`
    /// modulo the slot count. Groups that do not fit the slot count (an
    /// end past it, or not after the previous one) are read as none.
    #[inline(always)]
    pub fn slot_index(&self, hash: u32) -> u32 {
        // Only computed where it is the answer: the weighted path takes
        // its own modulos.
        let plain = || select_slot(hash, self.backend_count);
        if self.groups[0].slot_end == 0 {
            return plain();
        }
        // The groups in use must fit the slot count, in order.
        let (mut total, mut end) = (0, 0);
        for g in &self.groups {
            if g.slot_end == 0 {
                break;
            }
            if g.slot_end <= end || g.slot_end > self.backend_count || g.weight_end < total {
                return plain();
            }
            (total, end) = (g.weight_end, g.slot_end);
        }
        if total == 0 {
            return plain();
        }
        // fmix32 of a remixed hash: independent of `hash % n` below, so the
        // group and the slot in it are picked apart.
        let coin = fmix32(hash ^ 0x5bd1_e995) % total;
        let mut start = 0;
        for g in &self.groups {
            if coin < g.weight_end && g.slot_end > start {
                return start + hash % (g.slot_end - start);
            }
            start = g.slot_end;
        }
        plain()
    }
}

/// One slot of a service's backend set.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SlotKey {
    /// The frontend's service id.
    pub service_id: u32,
    /// The generation of its slot set.
    pub generation: u32,
    /// The slot's index, `0..backend_count`.
    pub slot: u32,
}

/// `SLOTS` / `NP_SLOTS` value: the backend in a slot.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SlotValue {
    /// A `BACKENDS` / `NP_BACKENDS` id.
    pub backend_id: u32,
}

/// The slot a connection lands on: `hash` spread over `count` slots.
/// `count` must be non-zero (the datapath refuses zero-backend services
/// before selecting).
#[inline(always)]
pub fn select_slot(hash: u32, count: u32) -> u32 {
    if count == 0 { 0 } else { hash % count }
}

/// Hash for sendmsg() on unconnected UDP sockets: every datagram of one
/// socket must reach the same backend, so the hash depends only on the
/// socket cookie (`bpf_get_socket_cookie`) and the service. Mixing in the
/// service id keeps one socket that talks to several Services from landing
/// on the same slot index everywhere. The finaliser is MurmurHash3's fmix32
/// so that consecutive cookies spread evenly.
#[inline(always)]
pub fn socket_hash(cookie: u64, service_id: u32) -> u32 {
    fmix32((cookie as u32) ^ ((cookie >> 32) as u32) ^ service_id.wrapping_mul(0x9e37_79b9))
}

/// MurmurHash3's 32-bit finaliser: every input bit affects every output bit,
/// so nearby inputs (sequential cookies, neighbouring ports) spread evenly.
#[inline(always)]
pub fn fmix32(mut h: u32) -> u32 {
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^= h >> 16;
    h
}

const _: () = {
    assert!(core::mem::size_of::<ServiceKey>() == 20);
    assert!(core::mem::size_of::<SlotGroup>() == 8);
    assert!(core::mem::size_of::<ServiceValue>() == 16 + 8 * SLOT_GROUPS);
    assert!(core::mem::size_of::<SlotKey>() == 12);
    assert!(core::mem::size_of::<SlotValue>() == 4);
    assert!(SVC_TIER_MASK < (1 << SVC_AFFINITY_SCOPE_SHIFT));
};

#[cfg(feature = "user")]
mod pod {
    //! `aya::Pod` for the types above: each is `#[repr(C)]`, holds only
    //! integers and integer arrays (padding spelled out as `_pad` fields),
    //! and its fields add up to the size asserted above, so every byte is
    //! initialised and every bit pattern is a valid value (see the crate's
    //! `lib.rs`).

    use super::{ServiceKey, ServiceValue, SlotGroup, SlotKey, SlotValue};

    // SAFETY: repr(C) integers only; 16 + 2 + 1 + 1 = 20 bytes, no padding.
    unsafe impl aya::Pod for ServiceKey {}
    // SAFETY: repr(C), four u32 and four SlotGroup = 48 bytes, no padding.
    unsafe impl aya::Pod for ServiceValue {}
    // SAFETY: repr(C), two u32 = 8 bytes, no padding.
    unsafe impl aya::Pod for SlotGroup {}
    // SAFETY: repr(C), three u32 = 12 bytes, no padding.
    unsafe impl aya::Pod for SlotKey {}
    // SAFETY: repr(C), one u32, no padding.
    unsafe impl aya::Pod for SlotValue {}
}

#[cfg(test)]
mod tests {
    extern crate std;
    use crate::*;

    /// (groups as (slot end, weight end), slot count, each slot's share of
    /// 200,000 consecutive hashes, within 0.5 points).
    #[test]
    fn grouped_slots_are_picked_by_their_weights() {
        type Case = (&'static [(u32, u32)], u32, &'static [f64]);
        let cases: &[Case] = &[
            (&[], 3, &[1.0 / 3.0; 3]),
            // 70 % over two slots, 30 % over four.
            (&[(2, 700), (6, 1000)], 6, &[0.35, 0.35, 0.075, 0.075, 0.075, 0.075]),
            (&[(1, 1), (2, 3), (4, 7)], 4, &[1.0 / 7.0, 2.0 / 7.0, 2.0 / 7.0, 2.0 / 7.0]),
            // An empty group in the middle takes nothing.
            (&[(1, 1), (2, 1), (3, 2)], 3, &[0.5, 0.0, 0.5]),
            // Malformed: an end past the slot count, or not after the
            // previous one: plain slots.
            (&[(5, 10)], 3, &[1.0 / 3.0; 3]),
            (&[(2, 5), (2, 10)], 3, &[1.0 / 3.0; 3]),
        ];
        for (groups, count, want) in cases {
            let mut v = ServiceValue { service_id: 7, backend_count: *count, generation: 1, ..Default::default() };
            for (g, (end, weight)) in v.groups.iter_mut().zip(groups.iter()) {
                *g = SlotGroup { slot_end: *end, weight_end: *weight };
            }
            let n = 200_000u32;
            let mut hits = std::vec![0u32; *count as usize];
            for h in 0..n {
                let slot = v.slot_index(fmix32(h));
                assert!(slot < *count, "{groups:?}: slot {slot}");
                hits[slot as usize] += 1;
            }
            for (i, w) in want.iter().enumerate() {
                let got = f64::from(hits[i]) / f64::from(n);
                assert!((got - w).abs() < 0.005, "{groups:?}: slot {i} took {got:.4}, want {w:.4} ({hits:?})");
            }
        }
    }

    #[test]
    fn the_counted_tier_is_the_frontends_when_set_else_the_backends() {
        let v = |t: u32| ServiceValue {
            flags: (t << SVC_TIER_SHIFT) | SVC_FLAG_AFFINITY | (9 << SVC_AFFINITY_SCOPE_SHIFT),
            ..Default::default()
        };
        // (frontend's field, backend's tier, counted)
        let cases = [
            (0, tier::NODE, tier::NODE),
            (0, tier::POOL, tier::POOL),
            (0, 200, tier::OTHER), // an unknown code
            (1 + u32::from(tier::ZONE), tier::NODE, tier::ZONE),
            (1 + u32::from(tier::POOL), tier::OTHER, tier::POOL),
            (7, tier::NODE, tier::OTHER), // 6 is past the last tier
        ];
        for (field, backend, want) in cases {
            assert_eq!(v(field).counted_tier(backend), usize::from(want), "{field} {backend}");
            assert_eq!(v(field).affinity_scope(), 9, "the tier bits leave the scope alone");
        }
        assert_eq!(svc_conn_index(1), 0);
        assert_eq!(svc_conn_index(0), u32::MAX, "id 0 is never counted");
    }

    #[test]
    fn slots_stay_in_range() {
        for count in [1u32, 2, 3, 7, 1000] {
            for hash in [0u32, 1, 2, 12345, u32::MAX - 1, u32::MAX] {
                assert!(select_slot(hash, count) < count);
            }
        }
        assert_eq!(select_slot(5, 0), 0, "zero count never divides by zero");
    }

    #[test]
    fn socket_hash_is_stable_and_spreads_consecutive_cookies() {
        assert_eq!(socket_hash(42, 7), socket_hash(42, 7));
        // Cookies are handed out sequentially by the kernel; they must not
        // all land on a few slots.
        let count = 3u32;
        let mut hits = [0u32; 3];
        for cookie in 1000u64..4000 {
            hits[select_slot(socket_hash(cookie, 1), count) as usize] += 1;
        }
        for h in hits {
            assert!((800..1200).contains(&h), "{hits:?}");
        }
        // Different services see the same socket differently.
        let differs = (0u64..100).filter(|c| select_slot(socket_hash(*c, 1), 8) != select_slot(socket_hash(*c, 2), 8)).count();
        assert!(differs > 50, "{differs}");
    }
}
