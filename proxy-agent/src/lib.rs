//! The per-node agent: from Kubernetes objects to the socket load
//! balancer's maps.
//!
//! Data flows one way: `manifest`/`objects` (input) -> `model` ->
//! `topology` and `decision` (pure) -> `plan` (pure diff) -> `map_writer`
//! (aya) -> kernel. `loader` installs the programs; `sync` runs one pass.

pub mod decision;
pub mod loader;
pub mod manifest;
pub mod map_writer;
pub mod model;
pub mod mounts;
pub mod objects;
pub mod plan;
pub mod sandbox;
pub mod sync;
pub mod topology;

/// Default pin directory under the BPF filesystem.
pub const DEFAULT_BPFFS: &str = "/sys/fs/bpf/topoproxy";
