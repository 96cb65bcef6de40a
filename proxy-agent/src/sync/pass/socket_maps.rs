//! What a pass writes to: the socket datapath's maps behind the
//! [`SocketMaps`] trait, implemented by the pinned maps' writer
//! (`MapWriter`) in the agent and by an in-memory set ([`MemoryMaps`]) in
//! `explain` and the unit tests. Apart from the pass because it is the
//! seam between the pass and the kernel, and the in-memory set is a
//! datapath of its own.

use std::collections::BTreeMap;

use crate::datapath::map_writer::{ApplyError, MapWriter, WriteError};
use crate::datapath::maps;
use crate::datapath::service_topo::SharedTiers;
use crate::decide::decision::FrontendTopo;
use crate::decide::plan::{self, FrontendPolicy, Plan, Policies};
use crate::model::{Backend, Frontend};

/// What a pass needs of the socket datapath's maps.
pub trait SocketMaps {
    /// What the maps hold, in the planner's terms.
    fn state(&self) -> plan::State;
    /// [`Self::state`] one frontend at a time, in frontend order, each set
    /// in any order.
    fn state_entries(&self) -> impl Iterator<Item = (Frontend, &[Backend])>;
    /// The backends programmed for `fe`, in slot order.
    fn backends_of(&self, fe: &Frontend) -> Option<&[Backend]>;
    /// Follows the endpoint tier table and sets how frontends count their
    /// connections (issue #34, `datapath::service_topo`); the in-memory
    /// maps count nothing.
    fn set_tiers(&mut self, _tiers: &SharedTiers) {}
    /// Sets how each frontend counts its connections (tier and blind-remote share); the in-memory
    /// maps count nothing.
    fn set_topology(&mut self, _frontends: &[(Frontend, FrontendTopo)]) {}
    /// The programmed frontends whose policy is not the default.
    fn policies(&self) -> Policies;
    /// The policy `fe` is programmed with.
    fn policy_of(&self, fe: &Frontend) -> Option<&FrontendPolicy>;
    /// Applies a plan; each frontend is written completely or not at all,
    /// and the ones that failed are returned.
    fn apply(&mut self, plan: &Plan) -> Vec<ApplyError>;
    /// [`Self::apply`], keeping the plan's backend lists rather than
    /// copies of them where the maps are mirrored.
    fn apply_owned(&mut self, plan: Plan) -> Vec<ApplyError> {
        self.apply(&plan)
    }
    /// Frontends programmed.
    fn frontends(&self) -> usize;
    /// Backends programmed, summed over all frontends.
    fn endpoints(&self) -> usize;
    /// (map, entries in use, capacity) per map, for metrics.
    fn occupancy(&self) -> Vec<(&'static str, u32, u32)>;
    /// The Maglev table size, tables linked in and their bytes, for
    /// metrics; `None` where there are no tables (maps held in memory).
    fn maglev_usage(&self) -> Option<(Option<crate::decide::maglev::TableSize>, u32, u64)> {
        None
    }
    /// Frontends without the Maglev table they ask for, because it did not
    /// fit the tables' share of the memory budget.
    fn maglev_refused(&self) -> usize {
        0
    }
}

impl SocketMaps for MapWriter {
    fn state(&self) -> plan::State {
        MapWriter::state(self)
    }
    fn state_entries(&self) -> impl Iterator<Item = (Frontend, &[Backend])> {
        MapWriter::state_entries(self)
    }
    fn backends_of(&self, fe: &Frontend) -> Option<&[Backend]> {
        MapWriter::backends_of(self, fe)
    }
    fn policies(&self) -> Policies {
        MapWriter::policies(self)
    }
    fn policy_of(&self, fe: &Frontend) -> Option<&FrontendPolicy> {
        MapWriter::policy_of(self, fe)
    }
    fn apply(&mut self, plan: &Plan) -> Vec<ApplyError> {
        MapWriter::apply(self, plan)
    }
    fn set_tiers(&mut self, tiers: &SharedTiers) {
        MapWriter::set_tiers(self, tiers);
    }
    fn set_topology(&mut self, frontends: &[(Frontend, FrontendTopo)]) {
        MapWriter::set_topology(self, frontends);
    }
    fn apply_owned(&mut self, plan: Plan) -> Vec<ApplyError> {
        MapWriter::apply_owned(self, plan)
    }
    fn frontends(&self) -> usize {
        MapWriter::frontends(self)
    }
    fn endpoints(&self) -> usize {
        MapWriter::endpoints(self)
    }
    fn occupancy(&self) -> Vec<(&'static str, u32, u32)> {
        MapWriter::occupancy(self).to_vec()
    }
    fn maglev_usage(&self) -> Option<(Option<crate::decide::maglev::TableSize>, u32, u64)> {
        MapWriter::maglev_usage(self)
    }
    fn maglev_refused(&self) -> usize {
        MapWriter::maglev_refused(self)
    }
}

/// The socket maps held in memory: what `explain` shows the agent would
/// program, and what the sync loop's unit tests read back. `capacity`
/// bounds the frontends like `--max-services` bounds the real map.
#[derive(Debug, Default)]
pub struct MemoryMaps {
    /// Each programmed frontend's backends, in slot order.
    pub programmed: BTreeMap<Frontend, Vec<Backend>>,
    /// The programmed frontends' policies, where not the default.
    pub policies: Policies,
    /// At most this many frontends; `None`: unbounded.
    pub capacity: Option<u32>,
}

impl SocketMaps for MemoryMaps {
    fn state(&self) -> plan::State {
        self.programmed.iter().map(|(fe, b)| (*fe, b.iter().copied().collect())).collect()
    }
    fn state_entries(&self) -> impl Iterator<Item = (Frontend, &[Backend])> {
        self.programmed.iter().map(|(fe, b)| (*fe, b.as_slice()))
    }
    fn backends_of(&self, fe: &Frontend) -> Option<&[Backend]> {
        self.programmed.get(fe).map(Vec::as_slice)
    }
    fn policies(&self) -> Policies {
        self.policies.clone()
    }
    fn policy_of(&self, fe: &Frontend) -> Option<&FrontendPolicy> {
        static DEFAULT: FrontendPolicy =
            FrontendPolicy { affinity_timeout_s: None, affinity_scope: 0, source_ranges: None, slot_weights: None };
        self.programmed.contains_key(fe).then(|| self.policies.get(fe).unwrap_or(&DEFAULT))
    }
    fn apply(&mut self, plan: &Plan) -> Vec<ApplyError> {
        for fe in &plan.deletes {
            self.programmed.remove(fe);
            self.policies.remove(fe);
        }
        let mut failures = Vec::new();
        for (fe, backends) in &plan.upserts {
            let used = u32::try_from(self.programmed.len()).unwrap_or(u32::MAX);
            match self.capacity {
                Some(max) if !self.programmed.contains_key(fe) && used >= max => failures.push(ApplyError {
                    frontend: *fe,
                    error: WriteError::Full { map: maps::SERVICES.name, used, max, needed: 1, flag: maps::SERVICES.flag() },
                }),
                _ => {
                    self.programmed.insert(*fe, backends.clone());
                    match plan.policies.get(fe) {
                        Some(p) => self.policies.insert(*fe, p.clone()),
                        None => self.policies.remove(fe),
                    };
                }
            }
        }
        failures
    }
    fn frontends(&self) -> usize {
        self.programmed.len()
    }
    fn endpoints(&self) -> usize {
        self.programmed.values().map(Vec::len).sum()
    }
    fn occupancy(&self) -> Vec<(&'static str, u32, u32)> {
        let used = u32::try_from(self.programmed.len()).unwrap_or(u32::MAX);
        vec![(proxy_common::SERVICES_MAP, used, self.capacity.unwrap_or(u32::MAX))]
    }
}
