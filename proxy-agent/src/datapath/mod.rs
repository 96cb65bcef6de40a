//! The kernel side: loading and pinning the programs and maps, writing
//! plans into the maps, batch map I/O, the conntrack GC, keeping the pins
//! in place under a running agent, and reading the maps back for `dump`.
//!
//! One folder per job, from the bottom up (`tests/layers.rs` checks the
//! order):
//!
//! - `maps/`: the table of pinned maps (`specs`), how frontends and
//!   backends are encoded in them (`keys`), whole-map batch I/O
//!   (`bpf_batch`), their sizes, their migration across agent versions,
//!   the port bitmaps, the topology counts' figures, and the writer that
//!   puts plans into them (`map_writer`, above the Maglev tables it links
//!   in);
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
//! The modules' flat paths (`datapath::keys`, `datapath::map_writer`,
//! `datapath::tc_loader`, ...) are re-exported below for the callers
//! outside the folders (`sync`, `external`, `cmd`, tests, examples and
//! benches).

pub mod conntrack;
pub mod dump;
pub mod loader;
pub mod maglev;
pub mod maps;
pub mod sockets;

pub use conntrack::conntrack_gc;
pub use loader::{kernel_btf, kernel_features, mounts, object, pin_guard, pins, socket_loader, tc_loader, xdp_loader};
pub use maglev::{maglev_budget, maglev_tables};
pub use maps::{bpf_batch, keys, map_migration, map_writer, port_bits, service_topo, sizing};
pub use sockets::{netns, sock_destroy, sock_diag, sock_iter, sock_rec_sweep};
