//! The pinned maps: their table (`specs`, re-exported here, so
//! `datapath::maps::MapSpec` names the table's types), how frontends and
//! backends are encoded in their keys and values (`keys`), their capacities
//! (`sizing`), carrying them over from an older agent's layout
//! (`map_migration`), the TC and socket port bitmaps (`port_bits`) and the
//! figures the topology counts add (`service_topo`).
//!
//! Batch I/O (`datapath::bpf_batch`) and the map writer
//! (`datapath::map_writer`) belong here too; they stay one level up until
//! a later step moves them.

pub mod keys;
pub mod map_migration;
pub mod port_bits;
pub mod service_topo;
pub mod sizing;
mod specs;

pub use specs::*;
