//! The eBPF object both loaders load, and its place under the pin
//! directory: every map of the [`maps::MAPS`] table pinned by its name
//! (the layout is `pins`'s).

use std::path::Path;

use aya::{Ebpf, EbpfError, EbpfLoader, VerifierLogLevel};
use proxy_common as pc;

use crate::datapath::loader::pins;
use crate::datapath::maps::{self, MapSizes};

/// The eBPF object, built by build.rs from the `proxy-ebpf` crate.
pub static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/proxy-ebpf"));

/// Loads `object` (no program yet) with every pinned map at its pin under
/// `pin_dir`: aya reuses a map pinned there instead of creating one, and
/// pins the ones it creates (`EbpfLoader::map_pin_path`), so every load of
/// either datapath shares one copy of each map. With `caps`, a map created
/// now gets its capacity; a pinned map keeps the size it was created with.
pub fn load(object: &[u8], pin_dir: &Path, caps: Option<&MapSizes>) -> Result<Ebpf, EbpfError> {
    load_staged(object, pin_dir, caps, &[])
}

/// [`load`], with the maps named in `staged` at their staged pins
/// ([`pins::staged_map`]): created there, with `caps`, when none is
/// pinned there yet. For a capacity change (see `map_migration`).
pub fn load_staged(object: &[u8], pin_dir: &Path, caps: Option<&MapSizes>, staged: &[&str]) -> Result<Ebpf, EbpfError> {
    load_with(object, pin_dir, caps, staged, |_| {})
}

/// [`load`] for the XDP program: its private next-hop cache
/// (`XDP_NEXTHOP`, proxy-common) gets its working capacity. Every other
/// load creates that map with the object's single entry, as none of their
/// programs uses it.
pub fn load_xdp(object: &[u8], pin_dir: &Path) -> Result<Ebpf, EbpfError> {
    load_with(object, pin_dir, None, &[], |loader| {
        loader.map_max_entries(pc::XDP_NEXTHOP_MAP, pc::XDP_NEXTHOP_ENTRIES);
    })
}

/// The TC fast path's value of the programs' `TC_FAST_PATH` global.
static FAST_ON: u8 = 1;

/// [`load`] for the external-traffic programs of a node (TC, and XDP from
/// the same object): with `fast`, the TC programs' fast path is on
/// (`TC_FAST_PATH`, a read-only global fixed at load). The next-hop cache
/// the fast path and the XDP program share (`XDP_NEXTHOP`) gets its
/// working capacity when either runs (`nexthops`).
pub fn load_external(object: &[u8], pin_dir: &Path, fast: bool, nexthops: bool) -> Result<Ebpf, EbpfError> {
    load_with(object, pin_dir, None, &[], |loader| {
        if nexthops {
            loader.map_max_entries(pc::XDP_NEXTHOP_MAP, pc::XDP_NEXTHOP_ENTRIES);
        }
        if fast {
            loader.override_global(pc::TC_FAST_PATH_GLOBAL, &FAST_ON, true);
        }
    })
}

fn load_with(
    object: &[u8],
    pin_dir: &Path,
    caps: Option<&MapSizes>,
    staged: &[&str],
    private: impl FnOnce(&mut EbpfLoader<'_>),
) -> Result<Ebpf, EbpfError> {
    let mut loader = EbpfLoader::new();
    // A refused program is loaded again for the verifier's log (aya's
    // retry_with_verifier_logs). At aya's default level (1 | STATS) the log
    // holds every instruction of every path; for our larger programs it
    // overflows, and each retry (up to ten, the buffer growing tenfold to
    // 16 MiB) verifies the whole program again while printing it: minutes
    // of CPU before the error (or the fast path's fallback) is seen. With
    // STATS alone the kernel still writes the error's own messages
    // (verbose() logs at any nonzero level, kernel/bpf/verifier.c) but not
    // the instruction dump, so one retry tells why.
    loader.verifier_log_level(VerifierLogLevel::STATS);
    private(&mut loader);
    for m in maps::MAPS {
        let pin = if staged.contains(&m.name) { pins::staged_map(pin_dir, m.name) } else { pins::map(pin_dir, m.name) };
        loader.map_pin_path(m.name, pin);
        if let Some(max) = caps.and_then(|caps| caps.of(m)) {
            loader.map_max_entries(m.name, max);
        }
    }
    loader.load(object)
}
