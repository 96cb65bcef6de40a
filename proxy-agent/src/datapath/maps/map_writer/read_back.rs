//! Opening the writer on maps that already hold entries (an agent
//! restart, an upgrade): what the maps hold is read back into the
//! writer's record, so service and backend ids and each frontend's policy
//! stay stable across restarts, and what a previous agent left half done
//! (slots, match entries, ranges and backends of no current generation) is
//! deleted. Its own file because it is the one place that turns map
//! entries back into the planner's terms.

use std::collections::{BTreeMap, BTreeSet};

use foldhash::{HashMap as FastHashMap, HashSet as FastHashSet};
use proxy_common as pc;
use proxy_common::{AffinityMatchKey, AffinityMatchValue, BackendKey, BackendValue, ServiceKey, ServiceValue, SlotKey, SlotValue};

use super::{MapWriter, Programmed, RangeKey, WriteError, delete_keys};
use crate::datapath::maglev::maglev_tables;
use crate::datapath::maps::MapSpec;
use crate::datapath::maps::bpf_batch;
use crate::datapath::maps::keys::{backend_of, cidr_of, frontend_of};
use crate::decide::maglev::TableSize;
use crate::decide::plan::{FrontendPolicy, SourceRanges};
use crate::model::Frontend;

impl MapWriter {
    pub(super) fn read_back(&mut self) -> Result<(), WriteError> {
        let read_err = |spec: &'static MapSpec| move |source| WriteError::Read { map: spec.name, source };
        let backend_table: BTreeMap<u32, BackendValue> = bpf_batch::read_all(&self.backends)
            .map_err(read_err(self.maps.backends))?
            .into_iter()
            .map(|(k, v)| (k.backend_id, v))
            .collect();
        let entries: Vec<(ServiceKey, ServiceValue)> = bpf_batch::read_all(&self.services).map_err(read_err(self.maps.services))?;
        let slot_table: FastHashMap<SlotKey, SlotValue> =
            bpf_batch::read_all(&self.slots).map_err(read_err(self.maps.slots))?.into_iter().collect();
        let match_table: Vec<(AffinityMatchKey, AffinityMatchValue)> =
            bpf_batch::read_all(&self.affinity_match).map_err(read_err(self.maps.affinity_match))?;
        let range_table: Vec<RangeKey> = self.source_ranges.keys().collect::<Result<_, _>>().map_err(read_err(self.maps.source_ranges))?;
        // Per (service id, generation): the affinity timeout and how many
        // backends are listed, and the source ranges.
        let mut matches_of: BTreeMap<(u32, u32), (u32, u32)> = BTreeMap::new();
        for (k, v) in &match_table {
            let e = matches_of.entry((k.service_id, k.generation)).or_insert((v.timeout_s, 0));
            e.1 += 1;
        }
        let mut ranges_of: BTreeMap<(u32, u32), Vec<crate::model::Cidr>> = BTreeMap::new();
        for k in &range_table {
            let data = k.data();
            if let Some(c) = cidr_of(k) {
                ranges_of.entry((data.service_id, data.generation)).or_default().push(c);
            }
        }
        // The (service id, generation) of every frontend whose flags ask
        // for match entries, and for ranges.
        let mut live_matches: BTreeSet<(u32, u32)> = BTreeSet::new();
        let mut live_ranges: BTreeSet<(u32, u32)> = BTreeSet::new();
        let mut live_slots = FastHashSet::default();
        let mut live_tables: Vec<(pc::MaglevKey, TableSize, Frontend)> = Vec::new();
        let mut max_sid = 0;
        for (key, value) in entries {
            max_sid = max_sid.max(value.service_id);
            let Some(fe) = frontend_of(&key) else { continue };
            let (sid, generation) = (value.service_id, value.generation);
            if value.flags & pc::SVC_FLAG_AFFINITY != 0 {
                live_matches.insert((sid, generation));
            }
            if value.flags & pc::SVC_FLAG_SOURCE_RANGES != 0 {
                live_ranges.insert((sid, generation));
            }
            if let Some(size) = maglev_tables::size_of_value(&value) {
                live_tables.push((pc::MaglevKey { service_id: sid, generation }, size, fe));
            }
            let source_ranges = (value.flags & pc::SVC_FLAG_SOURCE_RANGES != 0).then(|| {
                let mut cidrs = ranges_of.get(&(sid, generation)).cloned().unwrap_or_default();
                cidrs.sort();
                SourceRanges { cidrs, node: value.flags & pc::SVC_FLAG_SOURCE_RANGES_NODE != 0 }
            });
            // Scope 0 (an agent without scopes) reads as "none": the next
            // plan rewrites the frontend with its Service port's scope.
            let affinity_scope = value.flags >> pc::SVC_AFFINITY_SCOPE_SHIFT;
            let mut list = Vec::new();
            for slot in 0..value.backend_count {
                let sk = SlotKey { service_id: value.service_id, generation: value.generation, slot };
                live_slots.insert(sk);
                if let Some(s) = slot_table.get(&sk)
                    && let Some(b) = backend_table.get(&s.backend_id).and_then(backend_of)
                {
                    list.push(b);
                    self.backend_ids.add_reference(b, s.backend_id);
                }
                // A missing slot or backend shows up as a shorter list, so
                // the next plan rewrites this frontend completely.
            }
            // A weighted frontend (graded spill-over) lists its backends
            // once in weighted groups, or as often as their weights, with
            // one match entry each.
            let slot_weights = if value.groups[0].slot_end == 0 {
                crate::decide::plan::SlotWeights::of_slots(&list)
            } else {
                crate::decide::plan::SlotWeights::of_groups(&list, &value.groups)
            };
            let listed = if slot_weights.is_some() { super::chunk::distinct(&list) } else { value.backend_count };
            // A timeout of 0 (never written) stands for entries this agent
            // cannot trust (some missing): the next plan rewrites the
            // frontend, as for a missing slot.
            let affinity_timeout_s = (value.flags & pc::SVC_FLAG_AFFINITY != 0).then(|| match matches_of.get(&(sid, generation)) {
                Some((timeout, n)) if *n == listed => *timeout,
                _ => 0,
            });
            let policy = FrontendPolicy { affinity_timeout_s, affinity_scope, source_ranges, slot_weights };
            self.slots_used += value.backend_count;
            self.service_id_set.insert(value.service_id);
            self.programmed.insert(fe, Programmed::new(value, list, policy));
        }
        // Orphans: slots, match entries and ranges of old generations,
        // backends nobody references. What cannot be deleted now is left
        // for the next agent to find.
        let stale_slots: Vec<SlotKey> = slot_table.keys().filter(|k| !live_slots.contains(*k)).copied().collect();
        let _ = delete_keys(&mut self.slots, &stale_slots);
        let (kept, stale_matches): (Vec<AffinityMatchKey>, Vec<AffinityMatchKey>) =
            match_table.iter().map(|(k, _)| *k).partition(|k| live_matches.contains(&(k.service_id, k.generation)));
        let _ = delete_keys(&mut self.affinity_match, &stale_matches);
        self.matches_used = kept.len() as u32;
        for k in &range_table {
            let data = k.data();
            if live_ranges.contains(&(data.service_id, data.generation)) {
                self.ranges_used += 1;
            } else {
                let _ = self.source_ranges.remove(k);
            }
        }
        self.backend_id_set = self.backend_ids.ids().collect();
        if let Some(t) = &mut self.topo {
            t.stored = Some(backend_table.iter().filter(|(_, v)| v.tier != pc::tier::OTHER).map(|(id, v)| (*id, v.tier)).collect());
            t.adopt(self.programmed.values().map(|p| p.value.service_id));
        }
        let orphans: Vec<BackendKey> =
            backend_table.keys().filter(|id| !self.backend_id_set.contains(**id)).map(|id| BackendKey { backend_id: *id }).collect();
        let _ = delete_keys(&mut self.backends, &orphans);
        if let Some(t) = &mut self.maglev {
            let live: Vec<(pc::MaglevKey, TableSize)> = live_tables.iter().map(|(k, size, _)| (*k, *size)).collect();
            let map = t.map_name();
            let missing = t.read_back(&live).map_err(|source| WriteError::Read { map, source })?;
            self.maglev_stale.extend(live_tables.iter().filter(|(k, _, _)| missing.contains(k)).map(|(_, _, fe)| *fe));
        }
        // Ids from 1 to the counting arrays' size (see `stage`).
        self.next_service_id = max_sid.wrapping_add(1).max(1);
        if self.next_service_id > self.service_id_limit() {
            self.next_service_id = 1;
        }
        self.next_backend_id = backend_table.keys().max().copied().unwrap_or(0).wrapping_add(1).max(1);
        Ok(())
    }
}
