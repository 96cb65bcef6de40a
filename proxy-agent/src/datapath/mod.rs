//! The kernel side: loading and pinning the programs and maps, writing
//! plans into the maps, batch map I/O, the conntrack GC, keeping the pins
//! in place under a running agent, and reading the maps back for `dump`.
//!
//! One folder per job, from the bottom up (`tests/layers.rs` checks the
//! order):
//!
//! - `maps/`: the table of pinned maps (`specs`), how frontends and
//!   backends are encoded in them (`keys`), their sizes, their migration
//!   across agent versions, the port bitmaps and the topology counts'
//!   figures;
//! - `loader/`: the kernel's features and BTF, the bpffs and cgroup mounts
//!   and the pin directory's layout (`pins`, which every folder that opens
//!   a pin uses: these three are below `maps/`),
//!   the eBPF object (`object`, below everything else in the folder), and
//!   above it the attach loaders (socket, TC, XDP) and the pin guard;
//! - `conntrack/`: the TC datapath's conntrack GC;
//! - `maglev/`: Maglev tables in the maps, within a memory budget;
//! - `sockets/`: terminating the sockets of departed backends (network
//!   namespaces, sock_diag, the BPF socket iterators) and sweeping the
//!   socket records;
//! - `dump/`: reading the maps back and checking them, by map family.
//!
//! `bpf_batch` (whole-map I/O) and `map_writer` (plans into the maps) stay
//! at this level for now; they move into `maps/` later. The modules' flat
//! paths (`datapath::keys`, `datapath::tc_loader`, ...) are re-exported
//! below for the callers outside the folders (those two files, `sync`,
//! `cmd`, tests, examples and benches).

pub mod bpf_batch;
pub mod conntrack;
pub mod dump;
pub mod loader;
pub mod maglev;
pub mod map_writer;
pub mod maps;
pub mod sockets;

pub use conntrack::conntrack_gc;
pub use loader::{kernel_btf, kernel_features, mounts, object, pin_guard, pins, socket_loader, tc_loader, xdp_loader};
pub use maglev::{maglev_budget, maglev_tables};
pub use maps::{keys, map_migration, port_bits, service_topo, sizing};
pub use sockets::{netns, sock_destroy, sock_diag, sock_iter, sock_rec_sweep};
