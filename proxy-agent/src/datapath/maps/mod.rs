//! The pinned maps: their table (`specs`, re-exported here, so
//! `datapath::maps::MapSpec` names the table's types), how frontends and
//! backends are encoded in their keys and values (`keys`), reading and
//! writing them whole in batch syscalls (`bpf_batch`), their capacities
//! (`sizing`), carrying them over from an older agent's layout
//! (`map_migration`), the TC and socket port bitmaps (`port_bits`), the
//! figures the topology counts add (`service_topo`), and writing plans
//! into the service maps (`map_writer`, a folder of its own; it links in
//! the Maglev tables, so `tests/layers.rs` ranks it above `maglev/`).

pub mod bpf_batch;
pub mod keys;
pub mod map_migration;
pub mod map_writer;
pub mod port_bits;
pub mod service_topo;
pub mod sizing;
mod specs;

pub use specs::*;
