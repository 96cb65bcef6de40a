//! The kernel side: loading and pinning the programs and maps, writing
//! plans into the maps, batch map I/O, the conntrack GC, keeping the pins
//! in place under a running agent, and reading the maps back for `dump`.
//!
//! Below everything else here: `maps` (the table of pinned maps), `keys`
//! (how frontends and backends are encoded in them) and `bpf_batch` (whole
//! map I/O); `object` loads the eBPF object with the maps at their pins.

pub mod bpf_batch;
pub mod conntrack_gc;
pub mod dump;
pub mod kernel_btf;
pub mod kernel_features;
pub mod keys;
pub mod maglev_budget;
pub mod maglev_tables;
pub mod map_migration;
pub mod map_writer;
pub mod maps;
pub mod mounts;
pub mod netns;
pub mod object;
pub mod pin_guard;
pub mod port_bits;
pub mod service_topo;
pub mod sizing;
pub mod sock_destroy;
pub mod sock_diag;
pub mod sock_iter;
pub mod sock_rec_sweep;
pub mod socket_loader;
pub mod tc_loader;
pub mod xdp_loader;
