//! The per-node agent: from Kubernetes objects to the load balancer's maps.
//!
//! The folders are the data flow, in order:
//!
//! ```text
//! source/ ──> model/ ──> decide/ ──> datapath/ ──> kernel
//!  (manifests,  (Cluster,   (topology,   (maps, loaders,
//!   API server)  store)      decision,    writer, GC, dump)
//!                            plan)
//!                                 external/ (NodePort devices, addresses,
//!                                            health check node ports)
//! sync/ drives one loop over all of them; util/ sits below everything and
//! imports nothing from the crate's folders; observe/ (metrics, HTTP) sits
//! just above model/, whose `PortLabel` names the per-Service counts, and
//! below everything that reports to it.
//! migrate/ stands beside the flow: it reads what kube-proxy left on a node
//! (`proxy-agent cleanup-kube-proxy`) and uses nothing above util.
//! `fuzzing` sits on top: the fuzz targets' entry points into all of it.
//! ```
//!
//! A folder imports only from folders below it in this order: `util`,
//! `model`/`migrate`, `observe`, `source`/`decide`, `datapath`, `external`,
//! `sync` (`tests/layers.rs` checks it). Modules are `pub` only where another
//! crate (the binary, the tests, the bench, proxy-test-support) uses them.

#![deny(missing_docs)]

pub mod datapath;
pub mod decide;
pub mod external;
/// Entry points for the fuzz targets in `fuzz/`; not the agent's API.
#[doc(hidden)]
pub mod fuzzing;
pub mod migrate;
pub mod model;
pub mod observe;
pub mod source;
pub mod sync;
pub(crate) mod util;

/// Default pin directory under the BPF filesystem (`--bpffs`); the layout
/// under it is [`datapath::pins`]'s.
pub use datapath::loader::pins::DEFAULT_PIN_DIR as DEFAULT_BPFFS;
