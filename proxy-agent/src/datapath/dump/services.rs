//! The service, slot and backend maps of either datapath (`SERVICES`,
//! `SLOTS`, `BACKENDS` and their `NP_` twins): decoded per frontend and
//! checked against what the map writer promises.

use std::collections::{BTreeMap, BTreeSet};

use proxy_common::{BackendKey, BackendValue, ServiceKey, ServiceValue, SlotKey, SlotValue};
use serde::Serialize;

use crate::datapath::maps::keys::{backend_of, frontend_of};
use crate::datapath::maps::{SOCKET_SERVICE_MAPS, ServiceMaps};

use super::findings::{Finding, FindingKind, sort_findings};

/// One SERVICES entry with the slots of its current generation.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ServiceView {
    /// `10.96.0.10:80/TCP`, `[fd00::10]:53/UDP`; for an undecodable key the
    /// raw fields.
    pub frontend: String,
    /// The frontend's service id (the key of its slots).
    pub service_id: u32,
    /// The generation its slots are at.
    pub generation: u32,
    /// Slots of that generation.
    pub backend_count: u32,
    /// Those slots, by index.
    pub slots: Vec<SlotView>,
    /// TC frontends only: `Local` or `Cluster` (from `NP_FLAGS`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub external_traffic_policy: Option<&'static str>,
    /// `sessionAffinity: ClientIP`: the timeout of the current generation's
    /// match entries (0 when there are none).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub affinity_timeout_seconds: Option<u32>,
    /// With affinity: the scope its clients' entries are kept under, shared
    /// by the frontends of one Service port and family.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub affinity_scope: Option<u32>,
    /// `loadBalancerSourceRanges` in force: the ranges of the current
    /// generation (empty: nobody gets in).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub source_ranges: Option<Vec<String>>,
    /// Socket datapath: the node's own processes may connect without a
    /// bound address (a node address lies inside a range).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub source_ranges_node: bool,
    /// Entries of the current generation's Maglev table (`NP_MAGLEV`,
    /// `SOCK_MAGLEV`), when it has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub maglev_table_size: Option<u32>,
    /// The kernel bytes of that table (8 per entry; shared with the
    /// frontends of the same backends, see `Report::maglev_table_bytes`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub maglev_table_bytes: Option<u64>,
    /// Weighted slots (graded spill-over): the groups of the service
    /// entry (`ServiceValue::groups`), each with the slots it spans and
    /// its weight.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub slot_groups: Vec<SlotGroupView>,
}

/// One weighted group of a frontend's slots.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct SlotGroupView {
    /// Its first slot.
    pub first_slot: u32,
    /// The slot after its last.
    pub slot_end: u32,
    /// The group's weight (its share of new connections is this over the
    /// sum of the groups').
    pub weight: u32,
}

/// The groups of a service entry as listed (all zero: none).
fn slot_groups(value: &ServiceValue) -> Vec<SlotGroupView> {
    let (mut first_slot, mut before) = (0, 0);
    let mut out = Vec::new();
    for g in value.groups.iter().take_while(|g| g.slot_end != 0) {
        out.push(SlotGroupView { first_slot, slot_end: g.slot_end, weight: g.weight_end.wrapping_sub(before) });
        (first_slot, before) = (g.slot_end, g.weight_end);
    }
    out
}

/// One slot of a frontend's current generation.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct SlotView {
    /// Its index.
    pub slot: u32,
    /// `None` when the slot is missing.
    pub backend_id: Option<u32>,
    /// `None` when the slot or its backend is missing or undecodable.
    pub backend: Option<String>,
}

/// One BACKENDS (or NP_BACKENDS) entry.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct BackendView {
    /// Its id.
    pub backend_id: u32,
    /// `None` for an undecodable value.
    pub address: Option<String>,
    /// Live slots naming this backend.
    pub slots: u32,
}

/// One datapath's service maps, decoded and checked.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct Analysis {
    /// Each frontend with its slots.
    pub services: Vec<ServiceView>,
    /// Each backend with how many live slots name it.
    pub backends: Vec<BackendView>,
    /// What the checks found.
    pub findings: Vec<Finding>,
}

/// At most this many missing slots are reported one by one per service; a
/// corrupt `backend_count` of four billion must not produce four billion
/// findings.
pub(super) const MISSING_SLOTS_LISTED: usize = 16;

pub(super) fn raw_key(k: &ServiceKey) -> String {
    format!("ip_be={:08x?} port_be={} proto={} family={}", k.ip_be, k.port_be, k.proto, k.family)
}

/// The consistency rules, over plain entries of the socket maps.
pub fn check(services: &[(ServiceKey, ServiceValue)], slots: &[(SlotKey, SlotValue)], backends: &[(BackendKey, BackendValue)]) -> Analysis {
    check_maps(&SOCKET_SERVICE_MAPS, services, slots, backends)
}

/// The same rules for either datapath's service, slot and backend maps
/// (the TC ones have the socket ones' layout and are written by the same
/// map writer); `names` says which, for messages.
pub fn check_maps(
    names: &ServiceMaps,
    services: &[(ServiceKey, ServiceValue)],
    slots: &[(SlotKey, SlotValue)],
    backends: &[(BackendKey, BackendValue)],
) -> Analysis {
    let mut findings = Vec::new();
    let backend_table: BTreeMap<u32, &BackendValue> = backends.iter().map(|(k, v)| (k.backend_id, v)).collect();
    let slot_table: BTreeMap<SlotKey, u32> = slots.iter().map(|(k, v)| (*k, v.backend_id)).collect();
    let mut references: BTreeMap<u32, u32> = BTreeMap::new();
    let mut live: BTreeSet<SlotKey> = BTreeSet::new();

    for (id, v) in &backend_table {
        if backend_of(v).is_none() {
            findings.push(
                Finding::new(FindingKind::UnknownBackendEncoding, format!("backend #{id} has unknown address family {}", v.family))
                    .backend(*id),
            );
        }
    }

    // Decoded frontends first, in address order; undecodable keys after.
    let mut ordered: Vec<(Option<crate::model::Frontend>, &ServiceKey, &ServiceValue)> =
        services.iter().map(|(k, v)| (frontend_of(k), k, v)).collect();
    ordered.sort_by(|a, b| (a.0.is_none(), a.0, a.1).cmp(&(b.0.is_none(), b.0, b.1)));

    let mut users: BTreeMap<u32, Vec<String>> = BTreeMap::new();
    let mut views = Vec::new();
    for (fe, key, value) in ordered {
        let name = if let Some(fe) = fe {
            fe.to_string()
        } else {
            let raw = raw_key(key);
            findings.push(
                Finding::new(
                    FindingKind::UnknownServiceKey,
                    format!("{} key {raw} has a protocol or family this agent never writes", names.services.name),
                )
                .service(value.service_id, value.generation),
            );
            raw
        };
        users.entry(value.service_id).or_default().push(name.clone());
        let (sid, generation) = (value.service_id, value.generation);
        let lo = SlotKey { service_id: sid, generation, slot: 0 };
        let present: Vec<(u32, u32)> = slot_table
            .range(lo..)
            .take_while(|(k, _)| k.service_id == sid && k.generation == generation && k.slot < value.backend_count)
            .map(|(k, b)| (k.slot, *b))
            .collect();
        // Gaps in 0..backend_count are missing slots. Walking the present
        // ones keeps this linear in what exists, not in the count.
        let mut missing: Vec<u32> = Vec::new();
        let mut missing_total: u64 = 0;
        let mut expect = 0u32;
        let mut note_gap = |from: u32, to: u32, missing: &mut Vec<u32>| {
            missing_total += u64::from(to - from);
            missing.extend((from..to).take(MISSING_SLOTS_LISTED.saturating_sub(missing.len())));
        };
        let mut slot_views = Vec::with_capacity(present.len());
        for (slot, backend_id) in &present {
            note_gap(expect, *slot, &mut missing);
            expect = slot + 1;
            live.insert(SlotKey { service_id: sid, generation, slot: *slot });
            let backend = backend_table.get(backend_id);
            match backend {
                None => findings.push(
                    Finding::new(
                        FindingKind::MissingBackend,
                        format!("{name}: slot {slot} names backend #{backend_id}, which is not in {}", names.backends.name),
                    )
                    .service(sid, generation)
                    .slot(*slot)
                    .backend(*backend_id),
                ),
                Some(b) => {
                    *references.entry(*backend_id).or_default() += 1;
                    if fe.is_some() && b.family != key.family {
                        findings.push(
                            Finding::new(
                                FindingKind::FamilyMismatch,
                                format!(
                                    "{name}: slot {slot} names backend #{backend_id} of address family {}, the frontend's is {}",
                                    b.family, key.family
                                ),
                            )
                            .service(sid, generation)
                            .slot(*slot)
                            .backend(*backend_id),
                        );
                    }
                }
            }
            let address = backend.and_then(|b| backend_of(b)).map(|a| a.to_string());
            slot_views.push(SlotView { slot: *slot, backend_id: Some(*backend_id), backend: address });
        }
        note_gap(expect, value.backend_count, &mut missing);
        for slot in &missing {
            findings.push(
                Finding::new(
                    FindingKind::MissingSlot,
                    format!("{name}: slot {slot} of {} (generation {generation}) is missing", value.backend_count),
                )
                .service(sid, generation)
                .slot(*slot),
            );
            slot_views.push(SlotView { slot: *slot, backend_id: None, backend: None });
        }
        let unlisted = missing_total - missing.len() as u64;
        if unlisted > 0 {
            findings.push(
                Finding::new(FindingKind::MissingSlot, format!("{name}: {unlisted} more slots (generation {generation}) are missing"))
                    .service(sid, generation),
            );
        }
        slot_views.sort_by_key(|v| v.slot);
        views.push(ServiceView {
            frontend: name,
            service_id: sid,
            generation,
            backend_count: value.backend_count,
            slots: slot_views,
            external_traffic_policy: None,
            affinity_timeout_seconds: None,
            affinity_scope: None,
            source_ranges: None,
            source_ranges_node: false,
            maglev_table_size: Some(value.maglev_size()).filter(|m| *m > 0),
            maglev_table_bytes: Some(u64::from(value.maglev_size()) * crate::decide::maglev::KERNEL_BYTES_PER_ENTRY).filter(|b| *b > 0),
            slot_groups: slot_groups(value),
        });
    }

    for (sid, names) in &users {
        if names.len() > 1 {
            findings.push(Finding {
                service_id: Some(*sid),
                ..Finding::new(FindingKind::DuplicateServiceId, format!("service id {sid} is used by {}", names.join(", ")))
            });
        }
    }

    // Orphans, grouped by (service id, generation) so that a stale
    // generation of 1000 slots is one finding, not 1000.
    let current: BTreeMap<u32, u32> = services.iter().map(|(_, v)| (v.service_id, v.generation)).collect();
    let mut orphans: BTreeMap<(u32, u32), Vec<u32>> = BTreeMap::new();
    for k in slot_table.keys().filter(|k| !live.contains(k)) {
        orphans.entry((k.service_id, k.generation)).or_default().push(k.slot);
    }
    for ((sid, generation), slots) in orphans {
        let why = match current.get(&sid) {
            None => "no service entry has this id".to_string(),
            Some(g) if *g != generation => format!("the service is at generation {g}"),
            Some(_) => "they lie beyond the service's backend count".to_string(),
        };
        findings.push(
            Finding::new(
                FindingKind::OrphanSlots,
                format!("{} slot(s) of service id {sid} generation {generation} are unused: {why}", slots.len()),
            )
            .service(sid, generation)
            .slot(slots[0]),
        );
    }

    let mut backend_views = Vec::with_capacity(backend_table.len());
    for (id, v) in &backend_table {
        let used = references.get(id).copied().unwrap_or(0);
        let address = backend_of(v).map(|b| b.to_string());
        if used == 0 {
            let shown = address.clone().unwrap_or_else(|| format!("family {}", v.family));
            findings
                .push(Finding::new(FindingKind::UnreferencedBackend, format!("backend #{id} ({shown}) is used by no slot")).backend(*id));
        }
        backend_views.push(BackendView { backend_id: *id, address, slots: used });
    }

    for f in &mut findings {
        f.datapath = names.datapath().label();
    }
    sort_findings(&mut findings);
    Analysis { services: views, backends: backend_views, findings }
}
