//! The per-node agent: from Kubernetes objects to the socket load
//! balancer's maps.
//!
//! Data flows one way: `manifest`/`objects` (input) -> `model` ->
//! `topology` and `decision` (pure) -> `plan` (pure diff) -> `map_writer`
//! (aya) -> kernel. `loader` installs the programs; `sync` runs one pass.

pub mod bpf_batch;
pub mod conntrack_gc;
pub mod decision;
pub mod decision_cache;
pub mod error_chain;
pub mod events;
pub mod health_server;
pub mod healthcheck_server;
pub mod intern;
pub mod kube_model;
pub mod kube_source;
pub mod kube_sync;
pub mod loader;
pub mod manifest;
pub mod map_dump;
pub mod map_writer;
pub mod metrics;
pub mod model;
pub mod node_addresses;
pub mod nodeport;
pub mod mounts;
pub mod objects;
pub mod plan;
pub mod prog_test_run;
pub mod sandbox;
pub mod sync;
pub mod tc_loader;
pub mod topology;
pub mod wire;

/// Default pin directory under the BPF filesystem.
pub const DEFAULT_BPFFS: &str = "/sys/fs/bpf/topoproxy";
