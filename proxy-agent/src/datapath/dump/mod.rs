//! Reading the datapath's pinned maps back, for `proxy-agent dump`, and
//! checking that they hold what the map writer promises: every service
//! entry's `backend_count` slots exist under its generation, every slot names
//! a backend that exists, and nothing else is left lying around.
//!
//! Reading ([`read`]) and judging ([`check`]) are separate so that the
//! consistency rules are a pure function of map entries and can be tested
//! without a kernel. The maps are opened with `BPF_F_RDONLY`: a dump can
//! never change what the datapath serves.
//!
//! What frontends need besides their backends is decoded and checked the
//! same way for both datapaths: session affinity (each affine frontend's
//! timeout and match entries, every client's entry with its backend and
//! whether the programs would still honour it) and source ranges.
//!
//! A dump taken while an agent rewrites a service can catch the writer
//! between its steps (new slots written but not yet switched to, old ones
//! not yet deleted) and report orphans that vanish a moment later; the
//! errors, by contrast, are states the writer never produces.
//!
//! One file per map family: [`read`] reads the raw entries,
//! `services`, `policies`, `nodeport` and `sockets` decode and check their
//! maps, `counters` sums the counting arrays, `findings` is what the checks
//! report. Their public items are re-exported here.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Serialize;

use crate::datapath::maps::SOCKET_SERVICE_MAPS;

use findings::sort_findings;
use sockets::{missing_socket_port_bits, sockets_view};

mod counters;
mod findings;
mod nodeport;
mod policies;
mod read;
mod services;
mod sockets;
#[cfg(test)]
mod tests;

pub use counters::{
    frontend_conn_counts, named_counters, named_np_counters, np_counter_sums, np_counters, np_fast_counter_sums, np_fast_counters,
    service_conn_sums, socket_counter_sums, sum_conn,
};
pub use findings::{DATAPATH_SOCKET, DATAPATH_TC, Finding, FindingKind, Severity};
pub use nodeport::{CtView, NextHopView, NodePortReport, NpConfigView, PortBitsView, check_nodeport, next_hop_views};
pub use policies::{AffinityView, check_policies};
pub use read::{DumpError, MapUsage, NpSnapshot, PolicySnapshot, Snapshot, read};
pub use services::{Analysis, BackendView, ServiceView, SlotView, check, check_maps};
pub use sockets::{SocketRecordView, SocketsView};

/// What `proxy-agent dump --output json` prints. Field names are part of
/// the command's interface: add fields, never rename them.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Report {
    /// The pin directory read.
    pub pin_dir: String,
    /// No findings at all.
    pub consistent: bool,
    /// Each map's entries and capacity.
    pub maps: Vec<MapUsage>,
    /// SERVICES with their slots.
    pub services: Vec<ServiceView>,
    /// BACKENDS, with how many live slots name each.
    pub backends: Vec<BackendView>,
    /// COUNTERS by name, summed over CPUs.
    pub counters: BTreeMap<String, u64>,
    /// AFFINITY: each client's backend per affine frontend.
    pub affinity: Vec<AffinityView>,
    /// Findings about both datapaths (`datapath` says which).
    pub findings: Vec<Finding>,
    /// The TC datapath (NodePort, LoadBalancer IPs, externalIPs); absent
    /// when its maps are not pinned.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nodeport: Option<NodePortReport>,
    /// Bytes of backend ids in the Maglev tables of both datapaths, each
    /// array counted once (frontends with the same backends share one).
    pub maglev_table_bytes: u64,
    /// SOCK_PORTS: destination ports whose calls the socket programs look
    /// up in SERVICES; absent when the map is not pinned.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub socket_port_bits: Option<usize>,
    /// Which record each translated connect() took: one line per socket
    /// recorded in `SOCK_REC` (path `sock_rec`), and how many connects
    /// found it full and were recorded in their socket's storage instead
    /// (path `socket_storage`, `sock_record_full`; socket storage cannot
    /// be listed from the maps).
    pub sockets: SocketsView,
}

/// Decodes and checks a snapshot into what `dump` prints.
pub fn report(pin_dir: &Path, snap: &Snapshot) -> Report {
    let a = check(&snap.services, &snap.slots, &snap.backends);
    let mut findings = a.findings;
    let mut services = a.services;
    let (affinity, policy_findings) = check_policies(&SOCKET_SERVICE_MAPS, &snap.services, &snap.backends, &snap.policy, &mut services);
    findings.extend(policy_findings);
    if let Some(ports) = &snap.socket_ports {
        findings.extend(missing_socket_port_bits(&snap.services, ports));
    }
    let nodeport = snap.nodeport.as_ref().map(|np| {
        let (mut r, f) = check_nodeport(np);
        findings.extend(f);
        r.xdp_devices = crate::datapath::loader::xdp_loader::attached_devices(pin_dir);
        match crate::datapath::loader::xdp_loader::next_hops(pin_dir) {
            Ok(entries) => r.xdp_next_hops = next_hop_views(&entries),
            Err(e) => tracing::debug!(error = %e, "XDP next hops not read"),
        }
        r
    });
    sort_findings(&mut findings);
    let maglev_table_bytes = snap.maglev_table_bytes + snap.nodeport.as_ref().map_or(0, |np| np.maglev_table_bytes);
    Report {
        pin_dir: pin_dir.display().to_string(),
        consistent: findings.is_empty(),
        maps: snap.maps.clone(),
        services,
        backends: a.backends,
        counters: named_counters(&snap.counters),
        affinity,
        findings,
        nodeport,
        maglev_table_bytes,
        socket_port_bits: snap.socket_ports.as_ref().map(|p| p.counts().0),
        sockets: sockets_view(snap),
    }
}
