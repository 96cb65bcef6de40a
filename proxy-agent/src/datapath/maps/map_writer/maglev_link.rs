//! The writer's side of the Maglev tables: which table size a frontend
//! gets, when a frontend whose table is missing, of another size, or was
//! refused by the memory budget is written again, and linking in the
//! tables of a chunk under their new generation (`link_tables`, called by
//! the chunk writer before the switch). Apart from the chunk writer
//! because the budget and its retries are a concern of their own.

use std::collections::{BTreeMap, BTreeSet};

use proxy_common as pc;

use super::chunk::Chunk;
use super::{MapWriter, Programmed};
use crate::datapath::maglev::maglev_tables;
use crate::datapath::maps::Datapath;
use crate::decide::maglev::{self, TableSize};
use crate::model::{Backend, Frontend};

impl MapWriter {
    pub(super) fn maglev_is_stale(&self, fe: &Frontend, p: &Programmed, retries: &BTreeSet<Frontend>) -> bool {
        if self.maglev_refused.contains(fe) && !retries.contains(fe) {
            return false;
        }
        p.value.backend_count > 0 && (self.maglev_stale.contains(fe) || maglev_tables::size_of_value(&p.value) != self.maglev_size_for(fe))
    }

    /// The frontends the budget refused a table that the next plan tries
    /// again: as many as the room in the budget holds now, in frontend
    /// order. Retrying every one whenever one table's room appears would
    /// rewrite them all (a new generation each) for one table.
    pub(super) fn maglev_retries(&self) -> BTreeSet<Frontend> {
        let Some(t) = &self.maglev else { return BTreeSet::new() };
        let mut room = t.room();
        self.maglev_refused
            .iter()
            .filter(|fe| match self.maglev_size_for(fe) {
                Some(size) if size.bytes() <= room => {
                    room -= size.bytes();
                    true
                }
                _ => false,
            })
            .copied()
            .collect()
    }

    /// The size of the table `fe` gets when written with backends; `None`
    /// without tables: a datapath pinned without them, and at the socket
    /// layer every TCP frontend (connect() picks at random: a connection
    /// is balanced once, and its socket keeps its backend).
    pub(super) fn maglev_size_for(&self, fe: &Frontend) -> Option<TableSize> {
        if self.maps.datapath() == Datapath::Socket && fe.protocol != crate::model::Protocol::Udp {
            return None;
        }
        self.maglev.as_ref().and_then(|t| self.maglev_sizes.get(fe).copied().or(t.size))
    }

    /// Sets the default size of the Maglev tables written from now on
    /// (`None`: tables only where the Service annotation asks for one).
    /// Frontends programmed with another size are rewritten by the next
    /// plan computed against [`MapWriter::state`] (every TC sync; the
    /// socket datapath's full passes).
    pub fn set_maglev_size(&mut self, size: Option<TableSize>) {
        if let Some(t) = &mut self.maglev {
            t.size = size;
        }
    }

    /// Sets the frontends whose table size differs from the default (the
    /// Service annotation); like [`MapWriter::set_maglev_size`], a change
    /// rewrites the frontends concerned with the next plan.
    pub fn set_maglev_sizes(&mut self, sizes: &BTreeMap<Frontend, TableSize>) {
        if self.maglev_sizes != *sizes {
            self.maglev_sizes.clone_from(sizes);
        }
    }

    /// The Maglev table size written, the tables linked in and the bytes
    /// of backend ids they hold; `None` without tables.
    pub fn maglev_usage(&self) -> Option<(Option<TableSize>, u32, u64)> {
        self.maglev.as_ref().map(|t| {
            let (tables, bytes) = t.usage();
            (t.size, tables, bytes)
        })
    }

    /// Charges this writer's Maglev tables to `budget` (the tables' share
    /// of --map-memory-budget, shared with the other datapath's writer);
    /// without one, tables are not capped.
    pub fn set_maglev_budget(&mut self, budget: std::sync::Arc<crate::datapath::maglev_budget::MaglevBudget>) {
        if let Some(t) = &mut self.maglev {
            t.set_budget(budget);
        }
    }

    /// Frontends written without the Maglev table they ask for, because
    /// it did not fit the tables' share of the memory budget.
    pub fn maglev_refused(&self) -> usize {
        self.maglev_refused.len()
    }

    /// Computes and links in the Maglev table of each staged frontend that
    /// gets one, under its new generation. A table is computed, written and
    /// dropped one frontend at a time: a chunk of 16,384 frontends' tables
    /// held at once would take a GiB.
    ///
    /// A table that cannot be linked (the outer map is full, memory is
    /// short) does not keep the frontend from being written: its new
    /// generation goes without one, so new flows take the modulo pick, and
    /// [`MapWriter::state`] reports it for rewriting by the next full plan.
    pub(super) fn link_tables(&mut self, c: &mut Chunk) {
        let Some(t) = &mut self.maglev else { return };
        let backend_ids = &self.backend_ids;
        let created_ids = &c.created_ids;
        let created = &c.created;
        let mut requests = Vec::new();
        let mut which = Vec::new();
        for (i, (st, value)) in c.staged.iter().zip(&c.service_values).enumerate() {
            let Some(size) = st.maglev else { continue };
            // Sorted with its repeats: a weighted frontend (graded
            // spill-over) lists a backend once per slot, and the sorted
            // list with repeats is both the table's weights and the key
            // tables are shared by.
            let mut set = st.backends.clone();
            set.sort_unstable();
            // Every backend of a staged frontend has an id (stage reserved
            // the missing ones), so `compute` never comes back empty.
            let id_of = move |b: &Backend| backend_ids.get(b).map(|(id, _)| *id).or_else(|| created_ids.get(b).map(|i| created[*i].1));
            let mut weighted: Vec<maglev::Weighted> = Vec::new();
            for b in &set {
                match weighted.last_mut() {
                    Some(w) if w.backend == *b => w.weight += 1,
                    _ => weighted.push(maglev::Weighted { backend: *b, weight: 1 }),
                }
            }
            let compute = Box::new(move || maglev_tables::table_ids(&maglev::weighted_table(&weighted, size), id_of));
            let key = pc::MaglevKey { service_id: value.service_id, generation: value.generation };
            requests.push(maglev_tables::LinkRequest { key, size, backends: set, compute });
            which.push(i);
        }
        let results = t.link_all(requests);
        let mut refused = Vec::new();
        for (i, r) in which.into_iter().zip(results) {
            let st = &mut c.staged[i];
            if let Err(e) = r {
                if !maglev_tables::is_over_budget(&e) {
                    tracing::warn!(
                        frontend = %st.frontend,
                        map = t.map_name(),
                        error = %e,
                        "Maglev table not linked; new flows to this frontend take the modulo pick until it is rewritten"
                    );
                } else if self.maglev_refused.insert(st.frontend) {
                    // Said once per frontend (it is not retried until the
                    // budget has room, `maglev_is_stale`), and summed up
                    // below: a cold start may refuse thousands.
                    tracing::debug!(frontend = %st.frontend, map = t.map_name(), error = %e, "Maglev table not made");
                    refused.push((st.frontend, e));
                }
                st.maglev = None;
                c.service_values[i].flags &= !(pc::SVC_FLAG_MAGLEV | pc::SVC_FLAG_MAGLEV_LARGE);
            } else {
                self.maglev_refused.remove(&st.frontend);
            }
        }
        if let Some((_, e)) = refused.first() {
            let named: Vec<String> = refused.iter().take(5).map(|(fe, _)| fe.to_string()).collect();
            tracing::warn!(
                map = t.map_name(),
                frontends = refused.len(),
                named = %named.join(", "),
                waiting = self.maglev_refused.len(),
                error = %e,
                "Maglev tables not made; new flows to these frontends take the modulo pick until tables that are no longer needed make room (or a larger --map-memory-budget at the next restart)"
            );
        }
    }
}
