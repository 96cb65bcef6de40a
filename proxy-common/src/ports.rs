//! Port bitmaps: which ports the programs may have to translate, so that
//! traffic that is not ours passes after an array lookup instead of hash
//! lookups that miss.

// NP_PORTS: BPF_MAP_TYPE_ARRAY, word index -> u64. Written by the agent
// (port bits, from the frontends, backends and tracked flows); read by the
// TC and XDP programs.
/// Array of `u64` words, one bit per port: bit `port % 64` of word
/// `port / 64`, the port in host byte order, for ingress (destination
/// ports: frontends, and the frontends of tracked flows) in words
/// `0..NP_PORT_WORDS`, and for egress (source or destination ports:
/// backends of frontends and of tracked flows) in words
/// `NP_PORTS_EGRESS_BASE..`. A set bit only means "look further".
pub const NP_PORTS_MAP: &str = "NP_PORTS";
/// Words per direction: 65536 ports / 64 bits.
pub const NP_PORT_WORDS: u32 = 1024;
/// Index of the first egress word.
pub const NP_PORTS_EGRESS_BASE: u32 = NP_PORT_WORDS;
/// Entries of `NP_PORTS`: both directions, 16 KiB.
pub const NP_PORTS_ENTRIES: u32 = 2 * NP_PORT_WORDS;

/// The `NP_PORTS` word index and bit mask of a port in host byte order,
/// `egress` selecting the direction.
#[inline(always)]
pub fn np_port_bit(port: u16, egress: bool) -> (u32, u64) {
    let base = if egress { NP_PORTS_EGRESS_BASE } else { 0 };
    (base + u32::from(port >> 6), 1u64 << (port & 63))
}

// SOCK_PORTS: BPF_MAP_TYPE_ARRAY, word index -> u64. Written by the agent
// (from the SERVICES keys); read by connect/sendmsg.
/// Array of `u64` words, one bit per destination port of a `SERVICES` key
/// (any frontend the socket programs translate): bit `port % 64` of word
/// `port / 64`, the port in host byte order. The layout of `NP_PORTS`'
/// ingress half. A set bit only means "look further".
pub const SOCK_PORTS_MAP: &str = "SOCK_PORTS";
/// Entries of `SOCK_PORTS`: 65536 ports / 64 bits, 8 KiB.
pub const SOCK_PORTS_ENTRIES: u32 = NP_PORT_WORDS;

/// The `SOCK_PORTS` word index and bit mask of a port in host byte order.
#[inline(always)]
pub fn sock_port_bit(port_host: u16) -> (u32, u64) {
    np_port_bit(port_host, false)
}
