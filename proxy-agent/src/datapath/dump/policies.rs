//! What frontends need besides their backends, for either datapath:
//! session affinity (`AFFINITY`, `AFFINITY_MATCH` and their `NP_` twins)
//! and source ranges (`SOURCE_RANGES`, `NP_SOURCE_RANGES`), decoded onto
//! the frontends and checked.

use std::collections::{BTreeMap, BTreeSet};

use proxy_common as pc;
use proxy_common::{BackendKey, BackendValue, ServiceKey, ServiceValue};
use serde::Serialize;

use crate::datapath::maps::ServiceMaps;
use crate::datapath::maps::keys::backend_of;

use super::findings::{Finding, FindingKind};
use super::read::PolicySnapshot;
use super::services::ServiceView;

/// A client's affinity entry.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct AffinityView {
    /// The affinity scope (one per Service port and family, see
    /// `ServiceValue::affinity_scope`).
    pub scope: u32,
    /// The affine frontends of the scope, or `scope N` when none has it.
    pub frontend: String,
    /// `netns N` (socket datapath) or the client's address (TC).
    pub client: String,
    /// The backend the client was sent to.
    pub backend_id: u32,
    /// `None` when the backend is gone or undecodable.
    pub backend: Option<String>,
    /// Milliseconds since a connection last used the entry.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub idle_ms: Option<u64>,
    /// Whether the programs would send the client's next connection to
    /// this backend through at least one of the scope's frontends: the
    /// frontend is affine, lists the backend under its current generation,
    /// and the entry has not expired.
    pub honoured: bool,
}

/// Decodes a datapath's policy maps onto its frontends (`views`, as
/// [`check_maps`](super::services::check_maps) made them from `services`): each affine frontend's
/// timeout, each filtered frontend's ranges, and every client's affinity
/// entry. Finds affine frontends whose backends lack a match entry, and
/// match entries or ranges that belong to no current generation.
pub fn check_policies(
    names: &ServiceMaps,
    services: &[(ServiceKey, ServiceValue)],
    backends: &[(BackendKey, BackendValue)],
    p: &PolicySnapshot,
    views: &mut [ServiceView],
) -> (Vec<AffinityView>, Vec<Finding>) {
    let mut findings = Vec::new();
    let view_of: BTreeMap<u32, usize> = views.iter().enumerate().map(|(i, v)| (v.service_id, i)).collect();
    let current: BTreeMap<u32, &ServiceValue> = services.iter().map(|(_, v)| (v.service_id, v)).collect();
    let mut matches: BTreeMap<(u32, u32), BTreeMap<u32, u32>> = BTreeMap::new();
    for (k, v) in &p.matches {
        matches.entry((k.service_id, k.generation)).or_default().insert(k.backend_id, v.timeout_s);
    }
    let mut ranges: BTreeMap<(u32, u32), Vec<String>> = BTreeMap::new();
    for (len, k) in &p.ranges {
        let key = aya::maps::lpm_trie::Key::new(*len, *k);
        let shown =
            crate::datapath::maps::keys::cidr_of(&key).map_or_else(|| format!("prefix {len} of {:08x?}", k.addr_be), |c| c.to_string());
        ranges.entry((k.service_id, k.generation)).or_default().push(shown);
    }
    let mut live = BTreeSet::new();
    for (sid, v) in &current {
        let name = view_of.get(sid).map_or_else(|| format!("service id {sid}"), |i| views[*i].frontend.clone());
        let Some(view) = view_of.get(sid).map(|i| &mut views[*i]) else { continue };
        if v.flags & pc::SVC_FLAG_AFFINITY != 0 {
            live.insert(("match", *sid, v.generation));
            let listed = matches.get(&(*sid, v.generation));
            view.affinity_timeout_seconds = Some(listed.and_then(|m| m.values().next().copied()).unwrap_or(0));
            view.affinity_scope = Some(v.affinity_scope());
            for slot in &view.slots {
                if let Some(id) = slot.backend_id
                    && !listed.is_some_and(|m| m.contains_key(&id))
                {
                    findings.push(
                        Finding::new(
                            FindingKind::MissingAffinityMatch,
                            format!(
                                "{name}: backend #{id} has no {} entry under generation {}: its clients' affinity is ignored",
                                names.affinity_match.name, v.generation
                            ),
                        )
                        .service(*sid, v.generation)
                        .slot(slot.slot)
                        .backend(id),
                    );
                }
            }
        }
        if v.flags & pc::SVC_FLAG_SOURCE_RANGES != 0 {
            live.insert(("range", *sid, v.generation));
            view.source_ranges = Some(ranges.get(&(*sid, v.generation)).cloned().unwrap_or_default());
            view.source_ranges_node = v.flags & pc::SVC_FLAG_SOURCE_RANGES_NODE != 0;
        }
    }
    for (what, map, keys) in [
        ("match", names.affinity_match.name, matches.iter().map(|(k, m)| (*k, m.len())).collect::<Vec<_>>()),
        ("range", names.source_ranges.name, ranges.iter().map(|(k, r)| (*k, r.len())).collect::<Vec<_>>()),
    ] {
        for ((sid, generation), n) in keys {
            if !live.contains(&(what, sid, generation)) {
                let why = match current.get(&sid) {
                    None => "no service entry has this id".to_string(),
                    Some(v) if v.generation != generation => format!("the service is at generation {}", v.generation),
                    Some(_) => "the frontend's flags do not ask for them".to_string(),
                };
                findings.push(
                    Finding::new(
                        FindingKind::OrphanPolicyEntries,
                        format!(
                            "{n} {map} entr{} of service id {sid} generation {generation} are unused: {why}",
                            if n == 1 { "y" } else { "ies" }
                        ),
                    )
                    .service(sid, generation),
                );
            }
        }
    }
    let backend_table: BTreeMap<u32, &BackendValue> = backends.iter().map(|(k, v)| (k.backend_id, v)).collect();
    // The affine frontends of each scope.
    let mut members: BTreeMap<u32, Vec<&ServiceValue>> = BTreeMap::new();
    for v in current.values().filter(|v| v.flags & pc::SVC_FLAG_AFFINITY != 0) {
        members.entry(v.affinity_scope()).or_default().push(v);
    }
    let clients = p
        .clients
        .iter()
        .map(|(scope, client, v)| {
            let sharing = members.get(scope).map_or(&[][..], Vec::as_slice);
            let frontend = if sharing.is_empty() {
                format!("scope {scope}")
            } else {
                let names: Vec<String> = sharing
                    .iter()
                    .map(|s| {
                        view_of.get(&s.service_id).map_or_else(|| format!("service id {}", s.service_id), |i| views[*i].frontend.clone())
                    })
                    .collect();
                names.join(", ")
            };
            let idle_ms = p.now_ns.map(|now| now.saturating_sub(v.last_used_ns) / 1_000_000);
            let honoured = sharing.iter().any(|s| {
                matches
                    .get(&(s.service_id, s.generation))
                    .and_then(|m| m.get(&v.backend_id))
                    .is_some_and(|t| p.now_ns.is_none_or(|now| !pc::affinity_expired(now, v.last_used_ns, *t)))
            });
            AffinityView {
                scope: *scope,
                frontend,
                client: client.clone(),
                backend_id: v.backend_id,
                backend: backend_table.get(&v.backend_id).and_then(|b| backend_of(b)).map(|b| b.to_string()),
                idle_ms,
                honoured,
            }
        })
        .collect();
    for f in &mut findings {
        f.datapath = names.datapath().label();
    }
    (clients, findings)
}
