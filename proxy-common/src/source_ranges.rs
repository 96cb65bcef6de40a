//! `loadBalancerSourceRanges`: the client prefixes a frontend admits.

// SOURCE_RANGES: BPF_MAP_TYPE_LPM_TRIE, (prefix length, SourceRangeKey)
// -> u32. Written by the agent (map writer) per generation of a frontend
// with ranges; read by connect/sendmsg.
/// `loadBalancerSourceRanges` per frontend ([`SourceRangeKey`] -> u32), LPM
/// trie.
pub const SOURCE_RANGES_MAP: &str = "SOURCE_RANGES";
// NP_SOURCE_RANGES: BPF_MAP_TYPE_LPM_TRIE, as SOURCE_RANGES. Written by
// the agent; read by the TC programs.
/// As [`SOURCE_RANGES_MAP`], for `NP_SERVICES`' frontends.
pub const NP_SOURCE_RANGES_MAP: &str = "NP_SOURCE_RANGES";

/// The address part of a `SOURCE_RANGES` / `NP_SOURCE_RANGES` key (an LPM
/// trie key is this behind a `u32` prefix length in bits). The frontend's
/// service id and generation, and the family, always match in full
/// ([`SOURCE_RANGE_FIXED_BITS`]); the address matches the range's prefix.
/// The generation ties a frontend's ranges to its slot set, so a change of
/// ranges switches in the same hash map update as the backends (the agent
/// writes the new generation's ranges first and deletes the old ones after
/// the switch). Addresses in network byte order: the trie compares bytes
/// from the first, most significant, one.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SourceRangeKey {
    /// The frontend's service id.
    pub service_id: u32,
    /// The generation of its slot set the ranges belong to.
    pub generation: u32,
    /// `FAMILY_V4` or `FAMILY_V6`.
    pub family: u8,
    /// Two fields, see [`NpAffinityKey::_pad0`](crate::NpAffinityKey::_pad0).
    pub _pad0: u8,
    /// The rest of the padding (see `_pad0`).
    pub _pad1: u16,
    /// The range's address (a lookup: the client's), network byte order.
    pub addr_be: [u32; 4],
}

impl SourceRangeKey {
    /// A key with its padding zeroed.
    #[inline(always)]
    pub fn new(service_id: u32, generation: u32, family: u8, addr_be: [u32; 4]) -> Self {
        Self { service_id, generation, family, _pad0: 0, _pad1: 0, addr_be }
    }
}

/// Bits of a [`SourceRangeKey`] before the address: service id,
/// generation, family and padding. A range `a.b.c.d/n` is stored with
/// prefix length `SOURCE_RANGE_FIXED_BITS + n`; a lookup passes
/// `SOURCE_RANGE_FIXED_BITS + 128`.
pub const SOURCE_RANGE_FIXED_BITS: u32 = 96;

const _: () = {
    assert!(core::mem::size_of::<SourceRangeKey>() == 28);
    assert!(SOURCE_RANGE_FIXED_BITS as usize == 8 * core::mem::offset_of!(SourceRangeKey, addr_be));
};

#[cfg(feature = "user")]
mod pod {
    //! `aya::Pod` for the types above: each is `#[repr(C)]`, holds only
    //! integers and integer arrays (padding spelled out as `_pad` fields),
    //! and its fields add up to the size asserted above, so every byte is
    //! initialised and every bit pattern is a valid value (see the crate's
    //! `lib.rs`).

    use super::SourceRangeKey;

    // SAFETY: repr(C) integers only; 4 + 4 + 1 + 3 (`_pad`) + 16 = 28 bytes, no padding.
    unsafe impl aya::Pod for SourceRangeKey {}
}
