//! Staging frontends into chunks and writing a chunk in the order the
//! datapath never sees half done (the steps (1) to (5) of the writer's
//! documentation, one batch syscall each), with the room checks, id
//! allocation and the deletion of old generations. Apart from the writer
//! proper because this is the part that talks to the kernel in batches,
//! and its failure handling (retrying the frontends a failed batch did not
//! switch) is its own job.

use aya::maps::MapError;
use foldhash::{HashMap as FastHashMap, HashSet as FastHashSet};
use proxy_common as pc;
use proxy_common::{AffinityMatchKey, AffinityMatchValue, BackendKey, BackendValue, ServiceKey, ServiceValue, SlotKey, SlotValue};

use super::{ApplyError, MapWriter, Programmed, RangeKey, WriteError, affinity_scope, delete_keys, programmed_get};
use crate::datapath::maglev::maglev_tables;
use crate::datapath::maps::MapSpec;
use crate::datapath::maps::bpf_batch::{self, BatchError};
use crate::datapath::maps::keys::{service_key, source_range_key, tiered_backend_value};
use crate::decide::maglev::TableSize;
use crate::decide::plan::FrontendPolicy;
use crate::model::{Backend, Frontend};

impl MapWriter {
    /// Checks room for one frontend beside `chunk`, reserves its ids and
    /// queues its entries, taking `backends` when it does. Nothing is
    /// written and nothing changes but the id sets, so an error leaves the
    /// writer (and `backends`) as it was.
    pub(super) fn stage(
        &mut self,
        chunk: &mut Chunk,
        fe: &Frontend,
        backends: &mut Vec<Backend>,
        policy: &FrontendPolicy,
    ) -> Result<(), WriteError> {
        let old = programmed_get(&self.programmed, &self.appended, fe);
        // Graded spill-over: each backend once, in groups of equal weight
        // that the service entry weighs (`ServiceValue::groups`), so the
        // connect hit path looks up no more slots than without weights;
        // with more distinct weights than the entry holds, or with a
        // Maglev table (whose weights and sharing key are the repeats, see
        // `link_tables`), each backend in as many slots as its weight. The
        // list becomes the slot array (and the writer's record of it,
        // which `read_back` reads the weights back from, with the groups).
        let mut groups = [pc::SlotGroup::default(); pc::SLOT_GROUPS];
        if let Some(w) = &policy.slot_weights {
            match w.grouped(backends).filter(|_| self.maglev_size_for(fe).is_none()) {
                Some((slots, weighted)) => (*backends, groups) = (slots, weighted),
                None => *backends = w.expand(backends),
            }
        }
        let n = u32::try_from(backends.len()).unwrap_or(u32::MAX);

        // Room as the maps will hold it while the chunk is written: the
        // entries of the chunk's earlier frontends are in, their old
        // generations not yet out. With an empty chunk this is exactly the
        // one-at-a-time check: the frontend's own old generation stays
        // until its switch, so its new slots must fit beside it.
        if old.is_none() {
            let used = self.programmed_len() as u32 + chunk.new_services;
            if used >= self.max_services {
                return Err(full(self.maps.services, used, self.max_services, 1));
            }
        }
        let used_slots = self.slots_used.saturating_add(chunk.slot_keys.len() as u32);
        if used_slots.saturating_add(n) > self.max_slots {
            return Err(full(self.maps.slots, used_slots, self.max_slots, n));
        }
        // Each backend's id where it has one (in the maps, or new in the
        // chunk): looked up once, for the room check and the slots.
        let mut known: Vec<Option<u32>> =
            backends.iter().map(|b| self.backend_ids.get(b).map(|(id, _)| *id).or_else(|| chunk.created_id(b))).collect();
        let new_backends = known.iter().filter(|id| id.is_none()).count() as u32;
        let used_backends = (self.backend_ids.len() + chunk.created.len()) as u32;
        if used_backends.saturating_add(new_backends) > self.max_backends {
            return Err(full(self.maps.backends, used_backends, self.max_backends, new_backends));
        }
        // One match entry per distinct backend, however many slots it takes.
        let n_matches = if policy.affinity_timeout_s.is_some() { distinct(backends) } else { 0 };
        let used_matches = self.matches_used.saturating_add(chunk.match_keys.len() as u32);
        if used_matches.saturating_add(n_matches) > self.max_matches {
            return Err(full(self.maps.affinity_match, used_matches, self.max_matches, n_matches));
        }
        let ranges = policy.source_ranges.as_ref().map_or(&[][..], |r| r.cidrs.as_slice());
        let n_ranges = u32::try_from(ranges.len()).unwrap_or(u32::MAX);
        let used_ranges = self.ranges_used.saturating_add(chunk.range_keys.len() as u32);
        if used_ranges.saturating_add(n_ranges) > self.max_ranges {
            return Err(full(self.maps.source_ranges, used_ranges, self.max_ranges, n_ranges));
        }

        let service_id = if let Some(p) = old {
            p.value.service_id
        } else {
            // Service ids stay within 1..=the counting arrays' size, which
            // is the services capacity: the counts are indexed by id.
            let (set, limit) = (&self.service_id_set, self.service_id_limit());
            let id = Self::alloc_id(&mut self.next_service_id, |id| set.contains(id) || id > limit, "service")?;
            if self.next_service_id > limit {
                self.next_service_id = 1;
            }
            id
        };
        let generation = old.map_or(1, |p| p.value.generation.wrapping_add(1));
        let created_before = chunk.created.len();
        for (b, known) in backends.iter().zip(&mut known) {
            // A backend listed twice was created at its first listing.
            if let Some(id) = known.or_else(|| chunk.created_id(b)) {
                *known = Some(id);
            } else {
                let set = &self.backend_id_set;
                match Self::alloc_id(&mut self.next_backend_id, |id| set.contains(id), "backend") {
                    Ok(id) => {
                        self.backend_id_set.insert(id);
                        chunk.created_ids.insert(*b, chunk.created.len());
                        chunk.created.push((*b, id));
                        *known = Some(id);
                    }
                    Err(e) => {
                        for (b, id) in chunk.created.drain(created_before..) {
                            chunk.created_ids.remove(&b);
                            self.backend_id_set.remove(id);
                        }
                        return Err(e);
                    }
                }
            }
        }
        let ids = known.into_iter().flatten();
        if old.is_none() {
            self.service_id_set.insert(service_id);
            chunk.new_services += 1;
        }
        let matches_from = chunk.match_keys.len();
        let mut matched = std::collections::HashSet::new();
        for (slot, backend_id) in ids.enumerate() {
            chunk.slot_keys.push(SlotKey { service_id, generation, slot: slot as u32 });
            chunk.slot_values.push(SlotValue { backend_id });
            if let Some(timeout_s) = policy.affinity_timeout_s
                && matched.insert(backend_id)
            {
                chunk.match_keys.push(AffinityMatchKey { service_id, generation, backend_id });
                chunk.match_values.push(AffinityMatchValue { timeout_s });
            }
        }
        let ranges_from = chunk.range_keys.len();
        chunk.range_keys.extend(ranges.iter().map(|c| source_range_key(service_id, generation, c)));
        chunk.service_keys.push(service_key(fe));
        let maglev = self.maglev_size_for(fe).filter(|_| n > 0);
        if maglev.is_none() {
            // Asks for no table now (the annotation went, or no backends).
            self.maglev_refused.remove(fe);
        }
        let tier = self.topo.as_ref().map_or(0, |t| t.tier_bits_of(fe));
        let flags = policy_flags(policy) | maglev.map_or(0, maglev_tables::flags_of) | tier;
        chunk.service_values.push(ServiceValue { service_id, backend_count: n, generation, flags, groups });
        chunk.staged.push(Staged {
            maglev,
            frontend: *fe,
            // Kept as long as the frontend is programmed: no growth slack.
            backends: {
                let mut b = std::mem::take(backends);
                b.shrink_to_fit();
                b
            },
            old: old.cloned(),
            policy: policy.clone(),
            matches: matches_from..chunk.match_keys.len(),
            ranges: ranges_from..chunk.range_keys.len(),
        });
        chunk.frontends.insert(*fe);
        Ok(())
    }

    /// Writes a staged chunk: new backends, new slots, the switch, then the
    /// old generations. Empties `chunk`. The frontends a failed batch call
    /// did not switch are written again one per chunk; a frontend alone in
    /// its chunk that fails is reported in `errors`.
    pub(super) fn flush(&mut self, chunk: &mut Chunk, errors: &mut Vec<ApplyError>) {
        if chunk.staged.is_empty() {
            return;
        }
        let mut c = std::mem::take(chunk);
        let (switched, failure) = self.write_chunk(&mut c);
        let alone = c.staged.len() == 1;
        if let Some((map, e)) = &failure
            && !alone
        {
            tracing::debug!(map, error = %e, "batch update failed; writing the frontends not switched one at a time");
        }

        // Book-keeping for the frontends that switched: references on all
        // the new sets before any old one is dropped, so backends shared
        // with an old generation are never deleted. The references to the
        // chunk's new backends are counted in the chunk's table, and each
        // enters the writer's (a million entries at 100k Services x 10,
        // where every access misses the cache) once.
        let mut created_refs = vec![0u32; c.created.len()];
        for st in &c.staged[..switched] {
            for b in &st.backends {
                match c.created_ids.get(b) {
                    Some(i) => created_refs[*i] += 1,
                    None => {
                        if let Some(e) = self.backend_ids.get_mut(b) {
                            e.1 += 1;
                        }
                    }
                }
            }
        }
        for ((b, id), refs) in c.created.iter().zip(&created_refs) {
            if *refs > 0 {
                self.backend_ids.insert(*b, (*id, *refs));
            }
        }
        let mut dead = Dead::default();
        let mut retry = Vec::new();
        let mut failure = failure;
        for (i, (st, value)) in c.staged.drain(..).zip(c.service_values.drain(..)).enumerate() {
            if i < switched {
                self.slots_used = self.slots_used.saturating_add(value.backend_count);
                self.matches_used = self.matches_used.saturating_add(st.matches.len() as u32);
                self.ranges_used = self.ranges_used.saturating_add(st.ranges.len() as u32);
                if let Some(old) = &st.old {
                    self.drop_generation(old, &mut dead);
                    if old.policy().affinity_timeout_s.is_some() && Some(old.value.affinity_scope()) != affinity_scope(&value) {
                        self.affinity_gone.insert(old.value.affinity_scope());
                    }
                }
                self.maglev_stale.remove(&st.frontend);
                self.record(st.frontend, Programmed::new(value, st.backends, st.policy));
                continue;
            }
            // Not switched: its new slots, match entries and ranges go (some
            // may be written) and its service id is free again unless the
            // frontend had one before.
            dead.slots.extend((0..value.backend_count).map(|slot| SlotKey {
                service_id: value.service_id,
                generation: value.generation,
                slot,
            }));
            dead.matches.extend_from_slice(&c.match_keys[st.matches.clone()]);
            dead.ranges.extend_from_slice(&c.range_keys[st.ranges.clone()]);
            if st.maglev.is_some() {
                dead.tables.push(pc::MaglevKey { service_id: value.service_id, generation: value.generation });
            }
            if st.old.is_none() {
                self.service_id_set.remove(value.service_id);
            }
            match failure.take() {
                Some((map, e)) if alone => errors.push(ApplyError { frontend: st.frontend, error: syscall_error(map, e) }),
                _ => retry.push((st.frontend, st.backends, st.policy)),
            }
        }
        // Backends created for frontends that did not switch.
        for ((_, id), refs) in c.created.iter().zip(&created_refs) {
            if *refs == 0 {
                self.backend_id_set.remove(*id);
                dead.backends.push(BackendKey { backend_id: *id });
            }
        }
        // (4) and (5). Before the retries: their ids may be reused.
        self.delete_dead(&dead);
        // The next chunk reuses the buffers (and hash tables) of this one.
        c.clear();
        *chunk = c;

        for (fe, mut backends, policy) in retry {
            let mut own = Chunk::default();
            match self.stage(&mut own, &fe, &mut backends, &policy) {
                Ok(()) => self.flush(&mut own, errors),
                Err(error) => errors.push(ApplyError { frontend: fe, error }),
            }
        }
    }

    /// Steps (1) to (3) for a whole chunk, one batch call each. Returns how
    /// many frontends had their service entry written, which is a prefix
    /// (the kernel applies a batch in order and stops at the first
    /// failure), and the call that stopped the rest.
    fn write_chunk(&mut self, c: &mut Chunk) -> (usize, Option<(&'static str, BatchError)>) {
        let backend_keys: Vec<BackendKey> = c.created.iter().map(|(_, id)| BackendKey { backend_id: *id }).collect();
        // Each new backend carries its physical tier (issue #34), from the
        // table the counting maps follow; `other` without them.
        let tiers = self.topo.as_ref().and(self.tier_table.clone());
        let values = move |created: &[Backend]| -> Vec<BackendValue> {
            let table = tiers.as_ref().map(|t| t.read().unwrap_or_else(std::sync::PoisonError::into_inner));
            created.iter().map(|b| tiered_backend_value(b, table.as_ref().map_or(pc::tier::OTHER, |t| t.tier(&b.ip)))).collect()
        };
        // (1) on a thread of its own, beside (2) and the rest of what goes
        // before (3), when the chunk is large (a cold sync): no program
        // reads a new backend, slot, match entry, range or table before (3)
        // switches the service entry to their generation, so they may land
        // in any order, and hash map updates of two maps on two CPUs take
        // about half the time of one after the other. A failure stops the
        // chunk before (3), as when they ran one after the other, and the
        // first in that order is reported; what was written meanwhile goes
        // with the frontends not switched (shares stay, as when (3) fails).
        // Updates stay atomic per Service as the datapath sees them: the
        // thread is joined, and its result checked, before (3) writes any
        // service entry, so a frontend becomes visible only once every
        // backend of its new generation is in the map.
        let parallel = backend_keys.len().min(c.slot_keys.len()) >= PARALLEL_FROM;
        let aside = if parallel { self.backends_aside.take() } else { None };
        let created: Vec<Backend> = c.created.iter().map(|(b, _)| *b).collect();
        let (written, rest) = if let Some(mut aside) = aside {
            let (aside, written, rest) = std::thread::scope(|scope| {
                let written = scope.spawn(move || {
                    let written = bpf_batch::update(&mut aside, &backend_keys, &values(&created));
                    (aside, written)
                });
                let rest = self.before_switch(c);
                let (aside, written) = written.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic));
                (aside, written, rest)
            });
            self.backends_aside = Some(aside);
            (written, rest)
        } else {
            match bpf_batch::update(&mut self.backends, &backend_keys, &values(&created)) {
                Ok(()) => (Ok(()), self.before_switch(c)),
                Err(e) => (Err(e), None),
            }
        };
        if let Err(e) = written {
            return (0, Some((self.maps.backends.name, e)));
        }
        if let Some(failure) = rest {
            return (0, Some(failure));
        }
        match bpf_batch::update(&mut self.services, &c.service_keys, &c.service_values) {
            Ok(()) => (c.staged.len(), None),
            Err(e) => (e.applied.min(c.staged.len()), Some((self.maps.services.name, e))),
        }
    }

    /// (2) and the rest of what goes before (3) besides the new backends:
    /// the slots, match entries, source ranges, Maglev tables and shares of
    /// a chunk; the call that failed, if one did.
    fn before_switch(&mut self, c: &mut Chunk) -> Option<(&'static str, BatchError)> {
        if let Err(e) = bpf_batch::update(&mut self.slots, &c.slot_keys, &c.slot_values) {
            return Some((self.maps.slots.name, e));
        }
        if let Err(e) = bpf_batch::update(&mut self.affinity_match, &c.match_keys, &c.match_values) {
            return Some((self.maps.affinity_match.name, e));
        }
        // LPM tries take no batch updates (kernel/bpf/lpm_trie.c has no
        // map_update_batch); a LoadBalancer has a handful of ranges.
        for (applied, k) in c.range_keys.iter().enumerate() {
            if let Err(e) = self.source_ranges.insert(k, 0, 0) {
                return Some((self.maps.source_ranges.name, BatchError { applied, source: std::io::Error::other(e) }));
            }
        }
        self.link_tables(c);
        // The shares before the entries: a frontend's first connections
        // already add its own.
        if let Some(t) = &mut self.topo
            && let Err(e) = t.write_shares(c.staged.iter().zip(&c.service_values).map(|(st, value)| (&st.frontend, value.service_id)))
        {
            tracing::debug!(error = %e, "writing the blind-remote shares failed");
        }
        None
    }

    /// Removes frontends: their service entries, then their slots, then
    /// backends nobody uses any more. Returns how many service entries
    /// could not be deleted.
    pub(super) fn delete_all(&mut self, frontends: &[Frontend]) -> usize {
        let mut keys = Vec::new();
        let mut olds = Vec::new();
        for fe in frontends {
            self.maglev_refused.remove(fe);
            if let Some(old) = self.programmed.remove(fe) {
                self.service_id_set.remove(old.value.service_id);
                if let Some(t) = &mut self.topo {
                    t.forget(fe, old.value.service_id);
                }
                if old.policy().affinity_timeout_s.is_some() {
                    self.affinity_gone.insert(old.value.affinity_scope());
                }
                keys.push(service_key(fe));
                olds.push((fe, old));
            }
        }
        let failed = delete_keys(&mut self.services, &keys);
        for (i, e) in &failed {
            tracing::warn!(frontend = %olds[*i].0, error = %e, "removing service entry failed");
        }
        let mut dead = Dead::default();
        for (_, old) in &olds {
            self.drop_generation(old, &mut dead);
        }
        self.delete_dead(&dead);
        failed.len()
    }

    /// Drops the references of an old generation that is no longer in use
    /// and queues what it leaves behind for deletion.
    fn drop_generation(&mut self, old: &Programmed, dead: &mut Dead) {
        let (service_id, generation) = (old.value.service_id, old.value.generation);
        dead.slots.extend((0..old.value.backend_count).map(|slot| SlotKey { service_id, generation, slot }));
        self.slots_used = self.slots_used.saturating_sub(old.value.backend_count);
        // Match entries name backend ids, which go with the last reference
        // below: collect them first.
        if old.policy().affinity_timeout_s.is_some() {
            let from = dead.matches.len();
            // A weighted frontend lists a backend in several slots but has
            // one match entry for it.
            let mut seen = std::collections::HashSet::new();
            dead.matches.extend(
                old.backends
                    .iter()
                    .filter_map(|b| self.backend_ids.get(b))
                    .filter(|(backend_id, _)| seen.insert(*backend_id))
                    .map(|(backend_id, _)| AffinityMatchKey { service_id, generation, backend_id: *backend_id }),
            );
            self.matches_used = self.matches_used.saturating_sub((dead.matches.len() - from) as u32);
        }
        if maglev_tables::size_of_value(&old.value).is_some() {
            dead.tables.push(pc::MaglevKey { service_id, generation });
        }
        if let Some(r) = &old.policy().source_ranges {
            dead.ranges.extend(r.cidrs.iter().map(|c| source_range_key(service_id, generation, c)));
            self.ranges_used = self.ranges_used.saturating_sub(r.cidrs.len() as u32);
        }
        for b in &old.backends {
            let last = match self.backend_ids.get_mut(b) {
                Some(e) => {
                    e.1 = e.1.saturating_sub(1);
                    (e.1 == 0).then_some(e.0)
                }
                None => None,
            };
            if let Some(backend_id) = last {
                self.backend_ids.remove(b);
                self.backend_id_set.remove(backend_id);
                dead.backends.push(BackendKey { backend_id });
            }
        }
    }

    /// Slots, match entries and tables first: none ever names a backend
    /// that is gone.
    fn delete_dead(&mut self, dead: &Dead) {
        if let Some(t) = &mut self.maglev {
            t.unlink_all(&dead.tables);
        }
        for (_, e) in delete_keys(&mut self.slots, &dead.slots) {
            tracing::debug!(map = self.maps.slots.name, error = %e, "removing a stale slot failed");
        }
        for (_, e) in delete_keys(&mut self.affinity_match, &dead.matches) {
            tracing::debug!(map = self.maps.affinity_match.name, error = %e, "removing a stale affinity match failed");
        }
        for k in &dead.ranges {
            match self.source_ranges.remove(k) {
                Err(e) if !bpf_batch::is_not_found(&e) => {
                    tracing::debug!(map = self.maps.source_ranges.name, error = %e, "removing a stale source range failed");
                }
                _ => {}
            }
        }
        for (_, e) in delete_keys(&mut self.backends, &dead.backends) {
            tracing::debug!(map = self.maps.backends.name, error = %e, "removing an unused backend failed");
        }
    }

    fn alloc_id(next: &mut u32, used: impl Fn(u32) -> bool, what: &'static str) -> Result<u32, WriteError> {
        // Ids only need to be unique; scanning from a moving hint keeps
        // allocation O(1) in the common case and still reuses freed ids after
        // the counter wraps.
        for _ in 0..1_000_000 {
            let id = *next;
            *next = next.wrapping_add(1).max(1);
            if id != 0 && !used(id) {
                return Ok(id);
            }
        }
        Err(WriteError::NoId { what })
    }
}

/// Frontends whose entries are staged, not yet written.
#[derive(Default)]
pub(super) struct Chunk {
    pub(super) staged: Vec<Staged>,
    pub(super) frontends: FastHashSet<Frontend>,
    pub(super) service_keys: Vec<ServiceKey>,
    pub(super) service_values: Vec<ServiceValue>,
    pub(super) slot_keys: Vec<SlotKey>,
    pub(super) slot_values: Vec<SlotValue>,
    pub(super) match_keys: Vec<AffinityMatchKey>,
    pub(super) match_values: Vec<AffinityMatchValue>,
    pub(super) range_keys: Vec<RangeKey>,
    /// Backends the chunk adds, with the ids reserved for them, and each
    /// one's place in `created`.
    pub(super) created: Vec<(Backend, u32)>,
    pub(super) created_ids: FastHashMap<Backend, usize>,
    /// Frontends of the chunk that are not in the maps yet.
    pub(super) new_services: u32,
}

impl Chunk {
    /// The id reserved for `b`, if the chunk adds it.
    pub(super) fn created_id(&self, b: &Backend) -> Option<u32> {
        self.created_ids.get(b).map(|i| self.created[*i].1)
    }

    /// Empties the chunk, keeping its buffers.
    pub(super) fn clear(&mut self) {
        self.staged.clear();
        self.frontends.clear();
        self.service_keys.clear();
        self.service_values.clear();
        self.slot_keys.clear();
        self.slot_values.clear();
        self.match_keys.clear();
        self.match_values.clear();
        self.range_keys.clear();
        self.created.clear();
        self.created_ids.clear();
        self.new_services = 0;
    }
}

pub(super) struct Staged {
    pub(super) frontend: Frontend,
    /// The size of the Maglev table its new generation gets, if any.
    pub(super) maglev: Option<TableSize>,
    pub(super) backends: Vec<Backend>,
    pub(super) old: Option<Programmed>,
    pub(super) policy: FrontendPolicy,
    /// Its entries in the chunk's `match_keys` and `range_keys`.
    pub(super) matches: std::ops::Range<usize>,
    pub(super) ranges: std::ops::Range<usize>,
}

/// Entries to delete once nothing refers to them.
#[derive(Default)]
struct Dead {
    slots: Vec<SlotKey>,
    matches: Vec<AffinityMatchKey>,
    ranges: Vec<RangeKey>,
    tables: Vec<pc::MaglevKey>,
    backends: Vec<BackendKey>,
}

/// Bounds on a chunk: they keep the staging buffers small and, for a
/// plan that rewrites existing frontends, the old generations the maps
/// must hold beside the new ones at a time. A cold sync of 10,000
/// frontends x 10 backends takes four chunks. Twice as large, the buffers
/// were 10 MiB at the agent's memory peak (a cold sync at 100k Services);
/// a batch call of 32k entries costs about what two of 16k do.
pub(super) const CHUNK_SLOTS: usize = 32_768;
pub(super) const CHUNK_FRONTENDS: usize = 8_192;

/// A chunk that adds at least this many backends and slots writes its new
/// backends on a thread of their own (`write_chunk`); below it, a thread
/// costs more than it saves.
const PARALLEL_FROM: usize = 4_096;

/// `ServiceValue.flags` for a policy.
fn policy_flags(p: &FrontendPolicy) -> u32 {
    let mut flags = 0;
    if p.affinity_timeout_s.is_some() {
        flags |= pc::SVC_FLAG_AFFINITY | ((p.affinity_scope & pc::SVC_AFFINITY_SCOPE_MAX) << pc::SVC_AFFINITY_SCOPE_SHIFT);
    }
    if let Some(r) = &p.source_ranges {
        flags |= pc::SVC_FLAG_SOURCE_RANGES;
        if r.node {
            flags |= pc::SVC_FLAG_SOURCE_RANGES_NODE;
        }
    }
    flags
}

fn full(map: &'static MapSpec, used: u32, max: u32, needed: u32) -> WriteError {
    WriteError::Full { map: map.name, used, max, needed, flag: map.flag() }
}

fn syscall_error(map: &'static str, e: BatchError) -> WriteError {
    WriteError::Syscall { map, source: MapError::SyscallError(aya::sys::SyscallError { call: "bpf_map_update_batch", io_error: e.source }) }
}

/// The distinct backends of a slot list (weighted frontends list some
/// more than once).
pub(super) fn distinct(backends: &[Backend]) -> u32 {
    if backends.windows(2).all(|w| w[0] < w[1]) {
        return u32::try_from(backends.len()).unwrap_or(u32::MAX);
    }
    let set: std::collections::BTreeSet<&Backend> = backends.iter().collect();
    u32::try_from(set.len()).unwrap_or(u32::MAX)
}
