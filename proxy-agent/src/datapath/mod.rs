//! The kernel side: loading and pinning the programs and maps, writing
//! plans into the maps, batch map I/O, the conntrack GC, and reading the
//! maps back for `dump`.

pub mod bpf_batch;
pub mod conntrack_gc;
pub mod dump;
pub mod map_writer;
pub mod mounts;
pub mod socket_loader;
pub mod tc_loader;
