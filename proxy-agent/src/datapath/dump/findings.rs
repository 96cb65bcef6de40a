//! What the consistency rules report: findings, their kinds and
//! severities, and their order.

use serde::Serialize;

use crate::datapath::maps::Datapath;

/// How much a finding matters.
#[derive(Clone, Copy, Debug, Serialize, PartialEq, Eq, PartialOrd, Ord)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    /// The datapath serves this state, but it is left over: harmless for
    /// traffic, cleaned up by the next agent start.
    Warning,
    /// Traffic to some frontend is not what the agent meant.
    Error,
}

/// What a consistency rule found.
#[derive(Clone, Copy, Debug, Serialize, PartialEq, Eq, PartialOrd, Ord)]
#[serde(rename_all = "kebab-case")]
pub enum FindingKind {
    /// A SERVICES key with a protocol or family the agent never writes.
    UnknownServiceKey,
    /// A BACKENDS value with a family the agent never writes.
    UnknownBackendEncoding,
    /// Two frontends share a service id and so each other's slots.
    DuplicateServiceId,
    /// A slot below `backend_count` of the current generation is absent.
    MissingSlot,
    /// A slot names a backend id that BACKENDS does not hold.
    MissingBackend,
    /// A backend of the other address family than its frontend.
    FamilyMismatch,
    /// Slots that no service entry's current generation covers.
    OrphanSlots,
    /// A backend that no live slot uses.
    UnreferencedBackend,
    /// An `NP_FLAGS` entry for a frontend that `NP_SERVICES` does not hold.
    OrphanFlags,
    /// A conntrack forward entry whose backend left `NP_BACKENDS`: its next
    /// packet picks a new backend, and the conntrack GC deletes the flow.
    StaleFlow,
    /// A conntrack entry with a direction, protocol or family the programs
    /// never write.
    UnknownConntrackEntry,
    /// `NP_CONFIG`'s SNAT port range is empty (min above max, or port 0).
    BadSnatConfig,
    /// An affine frontend's backend without an affinity match entry under
    /// the current generation: its clients' affinity is ignored.
    MissingAffinityMatch,
    /// Affinity match entries or source ranges of a generation no frontend
    /// is at (or of a frontend without affinity / source ranges).
    OrphanPolicyEntries,
    /// A frontend, backend or conntrack entry whose port has no bit in
    /// `NP_PORTS`: the TC programs pass its packets untranslated.
    MissingPortBit,
}

impl FindingKind {
    /// Whether the datapath still serves what the agent meant (warning) or not (error).
    pub fn severity(self) -> Severity {
        match self {
            FindingKind::OrphanSlots
            | FindingKind::UnreferencedBackend
            | FindingKind::OrphanFlags
            | FindingKind::StaleFlow
            | FindingKind::OrphanPolicyEntries => Severity::Warning,
            _ => Severity::Error,
        }
    }
}

/// Which datapath's maps a finding is about.
pub const DATAPATH_SOCKET: &str = Datapath::Socket.label();
/// The TC datapath's maps (the `NP_*` family).
pub const DATAPATH_TC: &str = Datapath::Tc.label();

/// One inconsistency between the maps, with where it lies.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Finding {
    /// How much it matters.
    pub severity: Severity,
    /// Which rule found it.
    pub kind: FindingKind,
    /// `socket` (SERVICES, SLOTS, BACKENDS) or `tc` (the NP_* maps).
    pub datapath: &'static str,
    /// What is wrong, in words.
    pub message: String,
    /// The service id concerned, when one is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub service_id: Option<u32>,
    /// The generation concerned, when one is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub generation: Option<u32>,
    /// The slot concerned, when one is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slot: Option<u32>,
    /// The backend id concerned, when one is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub backend_id: Option<u32>,
}

impl Finding {
    pub(super) fn new(kind: FindingKind, message: String) -> Finding {
        Finding {
            severity: kind.severity(),
            kind,
            datapath: DATAPATH_SOCKET,
            message,
            service_id: None,
            generation: None,
            slot: None,
            backend_id: None,
        }
    }
    pub(super) fn service(mut self, id: u32, generation: u32) -> Finding {
        self.service_id = Some(id);
        self.generation = Some(generation);
        self
    }
    pub(super) fn slot(mut self, slot: u32) -> Finding {
        self.slot = Some(slot);
        self
    }
    pub(super) fn backend(mut self, id: u32) -> Finding {
        self.backend_id = Some(id);
        self
    }
}

/// Errors first; within a severity, socket before TC, grouped by kind and
/// in map order.
pub(super) fn sort_findings(findings: &mut [Finding]) {
    findings.sort_by(|a, b| {
        b.severity.cmp(&a.severity).then_with(|| {
            (a.datapath != DATAPATH_SOCKET, a.kind, a.service_id, a.slot, a.backend_id).cmp(&(
                b.datapath != DATAPATH_SOCKET,
                b.kind,
                b.service_id,
                b.slot,
                b.backend_id,
            ))
        })
    });
}
