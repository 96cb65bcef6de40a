//! ClientIP session affinity (`sessionAffinity: ClientIP`): a client's
//! backend per Service port, honoured while the frontend's current
//! generation still lists that backend.

// AFFINITY: BPF_MAP_TYPE_LRU_HASH, SockAffinityKey -> AffinityValue.
// Written and read by connect/sendmsg (the socket programs); the agent
// only reads it (dump).
/// ClientIP session affinity of the socket programs ([`SockAffinityKey`]
/// -> [`AffinityValue`]), LRU.
pub const AFFINITY_MAP: &str = "AFFINITY";
// AFFINITY_MATCH: BPF_MAP_TYPE_HASH (BPF_F_NO_PREALLOC), AffinityMatchKey
// -> AffinityMatchValue. Written by the agent (map writer) per generation
// of an affine frontend; read by connect/sendmsg.
/// The backends an affinity entry may still name ([`AffinityMatchKey`] ->
/// [`AffinityMatchValue`]).
pub const AFFINITY_MATCH_MAP: &str = "AFFINITY_MATCH";
// NP_AFFINITY: BPF_MAP_TYPE_LRU_HASH, NpAffinityKey -> AffinityValue.
// Written and read by the TC programs.
/// The TC programs' session affinity ([`NpAffinityKey`] -> [`AffinityValue`]), LRU.
pub const NP_AFFINITY_MAP: &str = "NP_AFFINITY";
// NP_AFFINITY_MATCH: BPF_MAP_TYPE_HASH (BPF_F_NO_PREALLOC), as
// AFFINITY_MATCH. Written by the agent; read by the TC programs.
/// As [`AFFINITY_MATCH_MAP`], for `NP_SERVICES`' frontends.
pub const NP_AFFINITY_MATCH_MAP: &str = "NP_AFFINITY_MATCH";

/// Clients remembered per datapath for ClusterIP session affinity (one
/// entry per client and affine frontend; the least recently used go first).
pub const DEFAULT_MAX_AFFINITY: u32 = 65_536;

/// `AFFINITY` key: the client, as the socket programs see it, and the
/// Service port. At connect() a socket has no source address yet (the kernel
/// picks it after the hook, `ip_route_connect`), so the client is its
/// network namespace: one pod is one namespace (`bpf_get_netns_cookie`),
/// and every process of the node's own namespace is one client, as all of
/// them reach a Service from the node's address.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SockAffinityKey {
    /// The client: the cookie of the socket's network namespace (`bpf_get_netns_cookie`).
    pub netns_cookie: u64,
    /// [`ServiceValue::affinity_scope`](crate::ServiceValue::affinity_scope): the Service port, not the frontend.
    pub scope_id: u32,
    /// Padding, always zero.
    pub _pad: u32,
}

/// `NP_AFFINITY` key: the client's source address as the TC programs see
/// it (kube-proxy's ClientIP), and the Service port.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NpAffinityKey {
    /// The client's source address, network byte order (IPv4 in the first word).
    pub client_be: [u32; 4],
    /// [`ServiceValue::affinity_scope`](crate::ServiceValue::affinity_scope): the Service port, not the frontend.
    pub scope_id: u32,
    /// `FAMILY_V4` or `FAMILY_V6`.
    pub family: u8,
    /// Two fields rather than `[u8; 3]`: a zeroed byte array becomes a
    /// `memset` call in the eBPF object (bpf-linker expands only `memcpy`
    /// inline), and each such call is a BPF subprogram frame that the
    /// verifier charges at least 32 bytes for against the 512-byte stack of
    /// the deepest call chain (kernel/bpf/verifier.c,
    /// `check_max_stack_depth`). Build keys with `new`.
    pub _pad0: u8,
    /// The rest of the padding (see `_pad0`).
    pub _pad1: u16,
}

impl NpAffinityKey {
    /// A key with its padding zeroed.
    #[inline(always)]
    pub fn new(client_be: [u32; 4], scope_id: u32, family: u8) -> Self {
        Self { client_be, scope_id, family, _pad0: 0, _pad1: 0 }
    }
}

/// A client's backend for one Service port, and when a connection (or a UDP
/// flow) last used it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AffinityValue {
    /// `bpf_ktime_get_coarse_ns` (CLOCK_MONOTONIC) of the last use,
    /// refreshed at most every [`AFFINITY_REFRESH_NS`].
    pub last_used_ns: u64,
    /// The backend the client was sent to (a `BACKENDS`/`NP_BACKENDS` id).
    pub backend_id: u32,
    /// Padding, always zero.
    pub _pad: u32,
}

/// `AFFINITY_MATCH` / `NP_AFFINITY_MATCH` key: backend `backend_id` is in
/// the slot set of generation `generation` of frontend `service_id` (the
/// same fields as [`SlotKey`](crate::SlotKey), with the backend in place of the slot). The
/// agent writes these for every backend of an affine frontend's new
/// generation before switching the frontend to it, and deletes the old
/// generation's afterwards, so the set a program sees is always the one of
/// the generation it read: an affinity entry is honoured only while its
/// backend is one the frontend currently sends to (a removed, no longer
/// serving or no longer topology-eligible backend drops out at once).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AffinityMatchKey {
    /// The frontend's service id.
    pub service_id: u32,
    /// The generation of its slot set the backend belongs to.
    pub generation: u32,
    /// A backend of that generation.
    pub backend_id: u32,
}

/// `AFFINITY_MATCH` / `NP_AFFINITY_MATCH` value: the frontend's affinity timeout.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AffinityMatchValue {
    /// `sessionAffinityConfig.clientIP.timeoutSeconds`: an entry unused
    /// for longer is ignored (and replaced by the next choice).
    pub timeout_s: u32,
}

/// The programs rewrite an affinity entry's `last_used_ns` only when it is
/// at least this old, not on every connect() or datagram: a store takes the
/// entry's cache line exclusive (see `touch` in `proxy-ebpf/src/programs/nodeport.rs`
/// for the same reasoning). Timeouts are whole seconds (at least 1), so an
/// entry may expire up to this much early.
pub const AFFINITY_REFRESH_NS: u64 = 100_000_000;

/// Whether an affinity entry last used at `last_used_ns` has expired at
/// `now_ns` under a timeout of `timeout_s` seconds (kube-proxy: the entry
/// lives `timeoutSeconds` after its last use). A clock that went backwards
/// (never for CLOCK_MONOTONIC) counts as fresh.
#[inline(always)]
pub fn affinity_expired(now_ns: u64, last_used_ns: u64, timeout_s: u32) -> bool {
    now_ns.saturating_sub(last_used_ns) > u64::from(timeout_s) * 1_000_000_000
}

const _: () = {
    assert!(core::mem::size_of::<SockAffinityKey>() == 16);
    assert!(core::mem::size_of::<NpAffinityKey>() == 24);
    assert!(core::mem::size_of::<AffinityValue>() == 16);
    assert!(core::mem::size_of::<AffinityMatchKey>() == 12);
    assert!(core::mem::size_of::<AffinityMatchValue>() == 4);
};

#[cfg(feature = "user")]
mod pod {
    //! `aya::Pod` for the types above: each is `#[repr(C)]`, holds only
    //! integers and integer arrays (padding spelled out as `_pad` fields),
    //! and its fields add up to the size asserted above, so every byte is
    //! initialised and every bit pattern is a valid value (see the crate's
    //! `lib.rs`).

    use super::{AffinityMatchKey, AffinityMatchValue, AffinityValue, NpAffinityKey, SockAffinityKey};

    // SAFETY: repr(C) integers only; 8 + 4 + 4 (`_pad`) = 16 bytes, no padding.
    unsafe impl aya::Pod for SockAffinityKey {}
    // SAFETY: repr(C) integers only; 16 + 4 + 1 + 3 (`_pad`) = 24 bytes, no padding.
    unsafe impl aya::Pod for NpAffinityKey {}
    // SAFETY: repr(C) integers only; 8 + 4 + 4 (`_pad`) = 16 bytes, no padding.
    unsafe impl aya::Pod for AffinityValue {}
    // SAFETY: repr(C), three u32 = 12 bytes, no padding.
    unsafe impl aya::Pod for AffinityMatchKey {}
    // SAFETY: repr(C), one u32, no padding.
    unsafe impl aya::Pod for AffinityMatchValue {}
}

#[cfg(test)]
mod tests {
    extern crate std;
    use crate::*;

    #[test]
    fn affinity_expires_after_its_timeout_without_use() {
        let s = 1_000_000_000u64;
        // (now, last used, timeout) -> expired
        let cases = [
            (10 * s, 10 * s, 1, false),
            (11 * s, 10 * s, 1, false),
            (11 * s + 1, 10 * s, 1, true),
            (10 * s + 10_800 * s, 10 * s, 10_800, false),
            (10 * s + 10_800 * s + 1, 10 * s, 10_800, true),
            // A clock that reads earlier than the entry: fresh, not 584 years old.
            (5 * s, 10 * s, 1, false),
            (u64::MAX, 0, 86_400, true),
        ];
        for (now, last, timeout, want) in cases {
            assert_eq!(affinity_expired(now, last, timeout), want, "{now} {last} {timeout}");
        }
        assert!(AFFINITY_REFRESH_NS < s, "refreshes finer than the shortest timeout");
    }
}
