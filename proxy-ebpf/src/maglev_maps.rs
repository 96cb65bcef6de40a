//! The Maglev tables (see `proxy_common::MaglevKey`) of the TC datapath
//! and of the socket datapath's unconnected UDP. Each is a hash
//! of maps: the agent creates one array of M backend ids per frontend
//! generation and links it in under (service id, generation): nothing is
//! preallocated, so a frontend without a table costs nothing.
//!
//! BTF-defined: aya reads the inner map's definition (the template the
//! kernel checks every linked-in array against) from the BTF of the
//! `values` field. `BPF_F_INNER_MAP` on the template lets arrays of either
//! table size be linked in (the kernel then compares everything but
//! `max_entries`, kernel/bpf/arraymap.c `array_map_meta_equal`).
//! `BPF_F_MMAPABLE` lets the agent fill a new table through one shared
//! mapping instead of one syscall per entry. Every inner array the agent
//! creates carries the same flags, as the kernel requires equal
//! `map_flags`.

use aya_ebpf::{
    bindings::{BPF_F_INNER_MAP, BPF_F_MMAPABLE, BPF_F_NO_PREALLOC},
    btf_maps::{Array, HashOfMaps},
    macros::btf_map,
};
use proxy_common::{DEFAULT_MAX_MAGLEV, MAGLEV_SIZE_DEFAULT, MaglevKey};

/// One frontend generation's table: entry i is the backend id of the flows
/// whose `maglev_hash % M` is i.
pub type MaglevTable = Array<u32, { MAGLEV_SIZE_DEFAULT as usize }, { (BPF_F_INNER_MAP | BPF_F_MMAPABLE) as usize }>;

/// Not preallocated: only frontends with backends have a table, and the
/// capacity follows the frontends'.
#[btf_map(name = "NP_MAGLEV")]
pub static NP_MAGLEV: HashOfMaps<MaglevKey, MaglevTable, { DEFAULT_MAX_MAGLEV as usize }, { BPF_F_NO_PREALLOC as usize }> =
    HashOfMaps::new();

/// The socket datapath's tables (UDP frontends only), keyed by its own
/// service ids.
#[btf_map(name = "SOCK_MAGLEV")]
pub static SOCK_MAGLEV: HashOfMaps<MaglevKey, MaglevTable, { DEFAULT_MAX_MAGLEV as usize }, { BPF_F_NO_PREALLOC as usize }> =
    HashOfMaps::new();
