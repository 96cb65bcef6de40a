//! The socket records (`SOCK_REC`) and the socket port bitmap
//! (`SOCK_PORTS`), decoded and checked.

use proxy_common as pc;
use proxy_common::{ServiceKey, ServiceValue};
use serde::Serialize;

use crate::datapath::maps::keys::frontend_of;
use crate::datapath::maps::port_bits::PortSet;

use super::findings::{Finding, FindingKind};
use super::nodeport::{endpoint, protocol_name};
use super::read::Snapshot;
use super::services::raw_key;

/// Sockets by the record their connect() took.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct SocketsView {
    /// One per `SOCK_REC` record.
    pub records: Vec<SocketRecordView>,
    /// Connects recorded in socket storage because `SOCK_REC` was full
    /// (the `sock_record_full` counter).
    pub socket_storage_fallbacks: u64,
}

/// One socket's record.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct SocketRecordView {
    /// The socket's cookie.
    pub cookie: u64,
    /// `TCP` or `UDP`.
    pub protocol: String,
    /// The frontend it connected to.
    pub frontend: String,
    /// The backend it was sent to.
    pub backend: String,
    /// The frontend's service id.
    pub service_id: u32,
    /// `sock_rec`: the record is in `SOCK_REC`.
    pub path: &'static str,
}

pub(super) fn sockets_view(snap: &Snapshot) -> SocketsView {
    let records = snap
        .socket_records
        .iter()
        .map(|(cookie, r)| SocketRecordView {
            cookie: *cookie,
            protocol: protocol_name(r.proto),
            frontend: endpoint(r.frontend_ip_be, r.frontend_port_be, r.family),
            backend: endpoint(r.backend_ip_be, r.backend_port_be, r.family),
            service_id: r.service_id,
            path: "sock_rec",
        })
        .collect();
    let fallbacks = snap.counters.get(pc::counter::SOCK_RECORD_FULL as usize).copied().unwrap_or(0);
    SocketsView { records, socket_storage_fallbacks: fallbacks }
}

/// Frontends in `SERVICES` whose destination port has no bit in
/// `SOCK_PORTS`: the socket programs pass their calls untranslated.
pub(super) fn missing_socket_port_bits(services: &[(ServiceKey, ServiceValue)], ports: &PortSet) -> Vec<Finding> {
    services
        .iter()
        .filter(|(k, _)| !ports.contains_socket(u16::from_be(k.port_be)))
        .map(|(k, _)| {
            let name = frontend_of(k).map_or_else(|| raw_key(k), |f| f.to_string());
            Finding::new(
                FindingKind::MissingPortBit,
                format!("{}: frontend {name} has no bit for its port; calls to it pass untranslated", pc::SOCK_PORTS_MAP),
            )
        })
        .collect()
}
