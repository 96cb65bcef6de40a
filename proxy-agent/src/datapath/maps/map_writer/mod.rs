//! Writing plans into the pinned maps in an order the datapath never sees
//! half done.
//!
//! For an update the writer (1) adds any new backends, (2) writes the new
//! slot set under a fresh generation, (3) replaces the service entry, which
//! switches readers to the new generation in one hash-map update, and only
//! then (4) deletes the old generation's slots and (5) backends no Service
//! uses any more. A reader that loaded the old entry just before (3) and
//! misses a slot deleted in (4) looks the service up again (see
//! `proxy-ebpf`), so it never sees a hole, a mix of two sets, or a count
//! larger than the slots written.
//!
//! Frontends are written in chunks, each step of a chunk in one batch
//! syscall (`bpf_batch`): every new backend and slot of the chunk, then
//! every service entry, then the old generations. Each frontend still goes
//! through (1)..(5) in that order, except that (1) and (2) may land in
//! either order: no program reads a new backend or slot before (3) points
//! it at their generation, so a large chunk (a cold sync) writes its new
//! backends on a thread of their own while its slots are written, and
//! that thread has finished before (3) starts. Room is checked in one
//! place, when a frontend joins a chunk, against what the maps physically
//! hold (old generations of the chunk included); a frontend that does not
//! fit beside the chunk is retried after writing it, so a frontend is
//! reported full exactly when writing frontends one at a time would have
//! reported it.
//! When a batch call fails, the frontends whose service entry it did not
//! write are written again in chunks of their own, so that a failure names
//! the frontend, map and reason.
//!
//! A frontend's policy goes with its generation. Session affinity: the
//! `AFFINITY_MATCH` entries (service id, generation, backend id) of the new
//! generation are written with its slots, before the switch, and the old
//! generation's go with its slots, after it; a program honours a client's
//! affinity entry only when its backend is listed under the generation it
//! read, so a removed or no longer eligible backend loses its clients at
//! the switch. Source ranges: the `SOURCE_RANGES` entries carry the
//! generation too, and follow the same order. The service entry's flags
//! switch with the rest. A frontend whose policy changes is therefore
//! rewritten under a fresh generation like one whose backends change, and
//! when a frontend drops affinity or goes away its clients' entries in the
//! affinity LRU map are deleted after the switch.
//!
//! Service and backend ids are read back from the maps when the writer is
//! opened, so they stay stable across agent restarts, and so is each
//! frontend's policy (its flags, match entries and ranges).
//!
//! The socket programs pass a call whose destination port has no bit in
//! `SOCK_PORTS` before they look at `SERVICES` (see `port_bits`), so the
//! socket datapath's writer sets the ports of a plan's frontends before it
//! writes anything, and clears a port only after the last frontend on it
//! was deleted. A bit left set costs a slower miss; a missing one would
//! hide a Service.
//!
//! The writer proper is here: opening the maps, applying a plan and the
//! bookkeeping of what each frontend is programmed with. Its parts:
//! `read_back` (adopting what the pinned maps hold when it opens them),
//! `chunk` (staging frontends and writing them a chunk at a time, steps
//! (1) to (5)), `maglev_link` (the Maglev tables that go with a generation,
//! within the memory budget) and `backend_ids` (the compact tables of
//! backend and id in use).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use aya::maps::lpm_trie::{Key, LpmTrie};
use aya::maps::{HashMap, Map, MapData, MapError};
use foldhash::HashSet as FastHashSet;
use proxy_common as pc;
use proxy_common::{
    AffinityMatchKey, AffinityMatchValue, AffinityValue, BackendKey, BackendValue, NpAffinityKey, ServiceKey, ServiceValue, SlotKey,
    SlotValue, SockAffinityKey, SourceRangeKey,
};

use crate::datapath::loader::pins;
use crate::datapath::maglev::maglev_tables::MaglevTables;
use crate::datapath::maps::bpf_batch;
use crate::datapath::maps::keys::{service_key, tiered_backend_value};
use crate::datapath::maps::port_bits::{Bitmap, PortBits, PortBitsError, PortSet};
use crate::datapath::maps::service_topo::{SharedTiers, TopoMaps};
use crate::datapath::maps::{Datapath, MapSpec, NP_MAGLEV, SOCK_MAGLEV, SOCKET_SERVICE_MAPS, ServiceMaps};
use crate::decide::maglev::TableSize;
use crate::decide::plan::{FrontendPolicy, Plan, Policies, State};
use crate::model::{Backend, Frontend};
use crate::util::btree::repack_after;

mod backend_ids;
mod chunk;
mod maglev_link;
mod read_back;

use backend_ids::{BackendIds, IdSet};
use chunk::{CHUNK_FRONTENDS, CHUNK_SLOTS, Chunk};

/// Why a frontend could not be written (or the maps opened).
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// A pinned map could not be opened.
    #[error("cannot open pinned map {map}: {source}")]
    Open {
        /// The map.
        map: &'static str,
        /// The error.
        source: MapError,
    },
    /// A pinned map could not be read back.
    #[error("cannot read back pinned map {map}: {source}")]
    Read {
        /// The map.
        map: &'static str,
        /// The error.
        source: MapError,
    },
    /// A map has no room for what the frontend needs; the frontend is tried again when room is
    /// freed.
    #[error("map {map} is full ({used} of {max} entries in use, {needed} more needed); raise {flag}")]
    Full {
        /// The map.
        map: &'static str,
        /// Entries in use.
        used: u32,
        /// Its capacity.
        max: u32,
        /// Entries the write needs beyond those.
        needed: u32,
        /// The flag that raises the capacity.
        flag: &'static str,
    },
    /// A map update or delete failed.
    #[error("writing map {map} failed: {source}")]
    Syscall {
        /// The map.
        map: &'static str,
        /// The error.
        source: MapError,
    },
    /// Every id of a kind is taken (service ids are bounded by the counting arrays' size).
    #[error("no free {what} id")]
    NoId {
        /// `service` or `backend`.
        what: &'static str,
    },
}

/// A frontend that could not be written; it was left exactly as it was.
#[derive(Debug, thiserror::Error)]
#[error("{frontend}: {error}")]
pub struct ApplyError {
    /// The frontend.
    pub frontend: Frontend,
    /// Why.
    pub error: WriteError,
}

#[derive(Clone, Debug)]
struct Programmed {
    value: ServiceValue,
    backends: Vec<Backend>,
    /// `None` for the default policy, which nearly every frontend has: a
    /// policy inline is 48 bytes of each of 100k entries.
    policy: Option<Box<FrontendPolicy>>,
}

impl Programmed {
    fn new(value: ServiceValue, backends: Vec<Backend>, policy: FrontendPolicy) -> Programmed {
        Programmed { value, backends, policy: (!policy.is_default()).then(|| Box::new(policy)) }
    }

    fn policy(&self) -> &FrontendPolicy {
        static DEFAULT: FrontendPolicy =
            FrontendPolicy { affinity_timeout_s: None, affinity_scope: 0, source_ranges: None, slot_weights: None };
        self.policy.as_deref().unwrap_or(&DEFAULT)
    }
}

/// A datapath's affinity LRU map; the two datapaths key clients
/// differently (network namespace, source address).
enum AffinityTable {
    Socket(HashMap<MapData, SockAffinityKey, AffinityValue>),
    Tc(HashMap<MapData, NpAffinityKey, AffinityValue>),
}

type RangeKey = Key<SourceRangeKey>;

/// Writes plans into one datapath's service maps in an order the programs never see half-done (see
/// the module's documentation), keeping a copy of what they hold.
pub struct MapWriter {
    /// The maps this writer owns: the socket datapath's, or the TC
    /// datapath's `NP_*` ones.
    maps: &'static ServiceMaps,
    services: HashMap<MapData, ServiceKey, ServiceValue>,
    slots: HashMap<MapData, SlotKey, SlotValue>,
    backends: HashMap<MapData, BackendKey, BackendValue>,
    affinity_match: HashMap<MapData, AffinityMatchKey, AffinityMatchValue>,
    source_ranges: LpmTrie<MapData, SourceRangeKey, u32>,
    affinity: AffinityTable,
    max_services: u32,
    max_slots: u32,
    max_backends: u32,
    max_matches: u32,
    max_ranges: u32,
    /// Entries in `affinity_match` and `source_ranges` (current generations).
    matches_used: u32,
    ranges_used: u32,
    programmed: BTreeMap<Frontend, Programmed>,
    /// During an `apply`, the frontends it wrote whose address is beyond
    /// every one in `programmed`, in order: joined to it at the end, in
    /// bulk when they are many (a cold sync writes every frontend in
    /// order, and a B-tree filled in order has its nodes half full, 7 MiB
    /// more at 100k Services, at the agent's memory peak). Empty between
    /// applies.
    appended: Vec<(Frontend, Programmed)>,
    /// Entries `programmed` gained one by one in the current `apply`.
    grown: usize,
    /// Backend address to (id, number of frontends using it).
    backend_ids: BackendIds,
    /// Slots in use across all frontends (current generations only).
    slots_used: u32,
    service_id_set: IdSet,
    backend_id_set: IdSet,
    next_service_id: u32,
    next_backend_id: u32,
    /// Affinity scopes (see `ServiceValue::affinity_scope`) of frontends
    /// that dropped affinity, changed scope or went away during the current
    /// `apply`: their clients' entries are swept at its end unless another
    /// frontend still uses the scope.
    affinity_gone: BTreeSet<u32>,
    /// The TC datapath's Maglev tables (`None` for the socket datapath, and
    /// for a TC datapath pinned without them).
    maglev: Option<MaglevTables>,
    /// Frontends whose current generation announces a Maglev table that
    /// is not linked in (found so at start-up).
    maglev_stale: BTreeSet<Frontend>,
    /// Frontends written without the table they ask for because it did not
    /// fit the tables' share of the memory budget. They are not rewritten
    /// for it (every pass would otherwise write a new generation, and warn)
    /// until the budget has room for a table of their size again.
    maglev_refused: BTreeSet<Frontend>,
    /// Table sizes set per frontend (the Service annotation); the others
    /// get the writer's default.
    maglev_sizes: BTreeMap<Frontend, TableSize>,
    /// `SOCK_PORTS`, for the socket datapath (`None` for the TC one, whose
    /// `NP_PORTS` the NodePort writer claims).
    ports: Option<PortBits>,
    /// The topology counting's maps and records (issue #34,
    /// `service_topo`); `None` when the datapath has no counting maps.
    topo: Option<TopoMaps>,
    /// The endpoint tier table `topo` reads (`set_tiers`): new backends
    /// take their tier from it, once per chunk (`write_chunk`).
    tier_table: Option<SharedTiers>,
    /// A second handle on the backends' map, which `write_chunk` hands to
    /// the thread that writes a large chunk's new backends (`None` while it
    /// has it, or when the map could not be opened twice).
    backends_aside: Option<HashMap<MapData, BackendKey, BackendValue>>,
}

fn open_hash<K: aya::Pod, V: aya::Pod>(pin_dir: &Path, spec: &'static MapSpec) -> Result<(HashMap<MapData, K, V>, u32), WriteError> {
    let err = |source| WriteError::Open { map: spec.name, source };
    let data = MapData::from_pin(pins::map(pin_dir, spec.name)).map_err(err)?;
    let max = data.info().map_err(err)?.max_entries();
    let map = if spec.map_type == aya::maps::MapType::LruHash { Map::LruHashMap(data) } else { Map::HashMap(data) };
    Ok((HashMap::try_from(map).map_err(err)?, max))
}

fn open_lpm(pin_dir: &Path, spec: &'static MapSpec) -> Result<(LpmTrie<MapData, SourceRangeKey, u32>, u32), WriteError> {
    let err = |source| WriteError::Open { map: spec.name, source };
    let data = MapData::from_pin(pins::map(pin_dir, spec.name)).map_err(err)?;
    let max = data.info().map_err(err)?.max_entries();
    Ok((LpmTrie::try_from(Map::LpmTrie(data)).map_err(err)?, max))
}

impl MapWriter {
    /// Opens the socket datapath's pinned maps and reads back what they
    /// hold. Slots and backends that no current service references (left by
    /// an agent that died mid-update) are removed.
    pub fn open(pin_dir: &Path) -> Result<MapWriter, WriteError> {
        Self::open_maps(pin_dir, &SOCKET_SERVICE_MAPS)
    }

    /// Like [`MapWriter::open`] for either datapath's service maps.
    pub fn open_maps(pin_dir: &Path, maps: &'static ServiceMaps) -> Result<MapWriter, WriteError> {
        let (services, max_services) = open_hash(pin_dir, maps.services)?;
        let (slots, max_slots) = open_hash(pin_dir, maps.slots)?;
        let (backends, max_backends) = open_hash(pin_dir, maps.backends)?;
        let (affinity_match, max_matches) = open_hash(pin_dir, maps.affinity_match)?;
        let (source_ranges, max_ranges) = open_lpm(pin_dir, maps.source_ranges)?;
        let affinity = match maps.datapath() {
            Datapath::Socket => AffinityTable::Socket(open_hash(pin_dir, maps.affinity)?.0),
            Datapath::Tc => AffinityTable::Tc(open_hash(pin_dir, maps.affinity)?.0),
        };
        let maglev_spec = match maps.datapath() {
            Datapath::Socket => &SOCK_MAGLEV,
            Datapath::Tc => &NP_MAGLEV,
        };
        let maglev = MaglevTables::open(pin_dir, maglev_spec).map_err(|source| WriteError::Open { map: maglev_spec.name, source })?;
        let ports = match maps.datapath() {
            Datapath::Socket => Some(
                PortBits::open_bitmap(pin_dir, Bitmap::Socket)
                    .map_err(|source| WriteError::Open { map: Bitmap::Socket.map_name(), source })?,
            ),
            Datapath::Tc => None,
        };
        let topo = TopoMaps::open(pin_dir, maps).map_err(|source| WriteError::Open { map: maps.topo.name, source })?;
        let mut w = MapWriter {
            maps,
            services,
            slots,
            backends,
            affinity_match,
            source_ranges,
            affinity,
            max_services,
            max_slots,
            max_backends,
            max_matches,
            max_ranges,
            matches_used: 0,
            ranges_used: 0,
            programmed: BTreeMap::new(),
            appended: Vec::new(),
            grown: 0,
            backend_ids: BackendIds::default(),
            slots_used: 0,
            service_id_set: IdSet::default(),
            backend_id_set: IdSet::default(),
            next_service_id: 1,
            next_backend_id: 1,
            affinity_gone: BTreeSet::new(),
            maglev,
            maglev_stale: BTreeSet::new(),
            maglev_refused: BTreeSet::new(),
            maglev_sizes: BTreeMap::new(),
            ports,
            topo,
            tier_table: None,
            backends_aside: open_hash(pin_dir, maps.backends).ok().map(|(m, _)| m),
        };
        w.read_back()?;
        // The loader filled the bitmap from these entries before it
        // attached the programs; setting them again covers pins it did not
        // fill, and costs no write when they are set.
        if let Some(bits) = &mut w.ports {
            bits.add(&socket_ports(w.programmed.keys())).map_err(|e| ports_failed(&e))?;
        }
        Ok(w)
    }

    /// What the maps hold, in the planner's terms. A frontend whose Maglev
    /// table is missing or of another size than this writer would write
    /// shows without backends, so that the next plan rewrites it.
    pub fn state(&self) -> State {
        let retries = self.maglev_retries();
        self.programmed
            .iter()
            .map(|(fe, p)| {
                let set = if self.maglev_is_stale(fe, p, &retries) { BTreeSet::new() } else { p.backends.iter().copied().collect() };
                (*fe, set)
            })
            .collect()
    }

    /// [`MapWriter::state`] one frontend at a time, in order, each set as
    /// the frontend's slots list it, without a copy of the whole state (30
    /// MiB at 100k Services x 10, every periodic full pass).
    pub fn state_entries(&self) -> impl Iterator<Item = (Frontend, &[Backend])> + '_ {
        let retries = self.maglev_retries();
        self.programmed.iter().map(move |(fe, p)| (*fe, if self.maglev_is_stale(fe, p, &retries) { &[][..] } else { &p.backends[..] }))
    }

    /// The policies of the programmed frontends that have one.
    pub fn policies(&self) -> Policies {
        self.programmed.iter().filter_map(|(fe, p)| Some((*fe, p.policy.as_deref()?.clone()))).collect()
    }

    /// The policy `fe` is programmed with.
    pub fn policy_of(&self, fe: &Frontend) -> Option<&FrontendPolicy> {
        self.programmed.get(fe).map(Programmed::policy)
    }

    /// Applies a plan. Each frontend is written completely or not at all;
    /// the ones that failed are returned and the rest is applied.
    pub fn apply(&mut self, plan: &Plan) -> Vec<ApplyError> {
        self.reserve_backends(plan);
        let errors = self.apply_with(plan, |i| plan.upserts[i].1.clone());
        self.settle();
        errors
    }

    /// [`MapWriter::apply`] taking the plan: each upsert's backend list
    /// becomes the writer's record of its frontend instead of a copy (a
    /// cold sync at 100k Services x 10 held both, 21 MiB).
    pub fn apply_owned(&mut self, mut plan: Plan) -> Vec<ApplyError> {
        self.reserve_backends(&plan);
        // Held to the end: without the room it grew into (a cold sync's
        // plan is 100k entries).
        plan.upserts.shrink_to_fit();
        // A writer with nothing programmed (a cold sync) appends every
        // upsert that succeeds (`record`): room for them at once.
        if self.programmed.is_empty() {
            self.appended.reserve_exact(plan.upserts.len());
        }
        let mut lists: Vec<Vec<Backend>> = plan.upserts.iter_mut().map(|(_, b)| std::mem::take(b)).collect();
        let errors = self.apply_with(&plan, |i| std::mem::take(&mut lists[i]));
        drop((lists, plan));
        self.settle();
        errors
    }

    /// Frontends programmed, during an `apply` too.
    fn programmed_len(&self) -> usize {
        self.programmed.len() + self.appended.len()
    }

    /// Every programmed frontend in order, during an `apply` too (the
    /// appended ones come after every other).
    fn programmed_iter(&self) -> impl Iterator<Item = (&Frontend, &Programmed)> {
        self.programmed.iter().chain(self.appended.iter().map(|(fe, p)| (fe, p)))
    }

    /// Records what `fe` is programmed with now.
    fn record(&mut self, fe: Frontend, p: Programmed) {
        let last = self.appended.last().map(|(k, _)| k).or_else(|| self.programmed.last_key_value().map(|(k, _)| k));
        if last.is_none_or(|last| fe > *last) {
            self.appended.push((fe, p));
            return;
        }
        if let Ok(i) = self.appended.binary_search_by(|(k, _)| k.cmp(&fe)) {
            self.appended[i].1 = p;
            return;
        }
        // Before one of the appended ones: they join the map first, so
        // that each stays beyond every key in it.
        self.join_appended();
        self.grown += usize::from(self.programmed.insert(fe, p).is_none());
    }

    /// Moves the appended entries into `programmed`: in bulk when they
    /// are many (the result has full nodes), else one by one.
    fn join_appended(&mut self) {
        let appended = std::mem::take(&mut self.appended);
        if appended.len() >= BULK_JOIN && appended.len() * 4 >= self.programmed.len() {
            let mut more: BTreeMap<Frontend, Programmed> = appended.into_iter().collect();
            self.programmed.append(&mut more);
        } else {
            self.grown += appended.len();
            self.programmed.extend(appended);
        }
    }

    /// Ends an `apply`: the appended entries join the map, and a map that
    /// grew by many inserts is rebuilt with full nodes.
    fn settle(&mut self) {
        self.join_appended();
        repack_after(&mut self.programmed, std::mem::take(&mut self.grown));
    }

    /// Applies `plan`, whose `i`th upsert's backends `backends(i)` gives
    /// (its own list is not read).
    fn apply_with(&mut self, plan: &Plan, mut backends_of: impl FnMut(usize) -> Vec<Backend>) -> Vec<ApplyError> {
        let mut errors = Vec::new();
        // Ports first: a frontend whose port has no bit is invisible to
        // the socket programs. Without the bits no upsert is written.
        let ports_set = match &mut self.ports {
            Some(bits) => bits.add(&socket_ports(plan.upserts.iter().map(|(fe, _)| fe))),
            None => Ok(0),
        };
        // Deletes first: they free room for the upserts.
        let undeleted = self.delete_all(&plan.deletes);
        if let Err(e) = ports_set {
            errors.extend(plan.upserts.iter().map(|(fe, _)| ApplyError { frontend: *fe, error: ports_failed(&e) }));
            return errors;
        }
        let mut chunk = Chunk::default();
        for (i, (fe, _)) in plan.upserts.iter().enumerate() {
            let mut backends = backends_of(i);
            // A frontend listed twice is written twice, in order.
            if chunk.frontends.contains(fe) {
                self.flush(&mut chunk, &mut errors);
            }
            let policy = plan.policy_of(fe);
            let staged = match self.stage(&mut chunk, fe, &mut backends, policy) {
                // Full only beside the chunk's own entries (old generations
                // not yet deleted): write the chunk, then try again.
                Err(WriteError::Full { .. }) if !chunk.staged.is_empty() => {
                    self.flush(&mut chunk, &mut errors);
                    self.stage(&mut chunk, fe, &mut backends, policy)
                }
                staged => staged,
            };
            if let Err(error) = staged {
                errors.push(ApplyError { frontend: *fe, error });
            }
            if chunk.slot_keys.len() >= CHUNK_SLOTS || chunk.staged.len() >= CHUNK_FRONTENDS {
                self.flush(&mut chunk, &mut errors);
            }
        }
        self.flush(&mut chunk, &mut errors);
        // After the deletes: a port goes with the last frontend on it. A
        // service entry that could not be deleted keeps every bit this
        // round (it may be the last on its port).
        if self.ports.is_some()
            && !plan.deletes.is_empty()
            && undeleted == 0
            && let ports = socket_ports(self.programmed_iter().map(|(fe, _)| fe))
            && let Some(bits) = &mut self.ports
            && let Err(e) = bits.keep_only(&ports)
        {
            tracing::warn!(map = Bitmap::Socket.map_name(), error = %e, "clearing unused port bits failed; they stay set (slower misses only)");
        }
        let mut gone = std::mem::take(&mut self.affinity_gone);
        // A scope is shared by the frontends of one Service port: it goes
        // only with the last of them.
        if !gone.is_empty() {
            for (_, p) in self.programmed_iter() {
                if let Some(scope) = affinity_scope(&p.value) {
                    gone.remove(&scope);
                }
            }
        }
        self.sweep_affinity(&gone);
        errors
    }

    /// Deletes the clients' affinity entries of the scopes in `gone`, whose
    /// last frontend dropped affinity or was removed: no program honours
    /// them any more (their match entries are gone), and an LRU map would
    /// keep them until pushed out. One pass over the map, only when some
    /// affine scope went.
    fn sweep_affinity(&mut self, gone: &BTreeSet<u32>) {
        if gone.is_empty() {
            return;
        }
        let swept = match &mut self.affinity {
            AffinityTable::Socket(m) => sweep(m, gone, |k| k.scope_id),
            AffinityTable::Tc(m) => sweep(m, gone, |k| k.scope_id),
        };
        match swept {
            Ok(n) => tracing::debug!(map = self.maps.affinity.name, entries = n, "removed the affinity of frontends that dropped it"),
            // Harmless: without match entries nothing honours them, and the
            // LRU map ages them out.
            Err(e) => tracing::warn!(map = self.maps.affinity.name, error = %e, "removing stale affinity entries failed"),
        }
    }

    /// Room in the backend address table for the backends `plan` adds,
    /// made before the first is added: growing it while it is being
    /// filled holds the old table beside the new one (at 1M backends, 17
    /// MiB beside 34, at the agent's memory peak). An upper bound (a
    /// backend shared by several upserts counts for each), never more than
    /// the map holds.
    fn reserve_backends(&mut self, plan: &Plan) {
        let room = (self.max_backends as usize).saturating_sub(self.backend_ids.len());
        self.backend_ids.reserve_for(plan.upserts.iter().flat_map(|(_, b)| b), room);
    }

    /// The backends programmed for `fe`, in slot order (without copying
    /// the whole state as [`MapWriter::state`] does).
    pub fn backends_of(&self, fe: &Frontend) -> Option<&[Backend]> {
        self.programmed.get(fe).map(|p| p.backends.as_slice())
    }

    /// Frontends programmed.
    pub fn frontends(&self) -> usize {
        self.programmed.len()
    }

    /// Backends programmed, summed over all frontends (the slots in use).
    pub fn endpoints(&self) -> usize {
        self.slots_used as usize
    }

    /// The largest service id the counting arrays hold (their size, the
    /// services capacity); without them, any.
    fn service_id_limit(&self) -> u32 {
        self.topo.as_ref().map_or(u32::MAX, |t| t.capacity().max(1))
    }

    /// Follows the endpoint tier table (issue #34): backends whose
    /// physical tier is not what they carry are rewritten in place, an
    /// unchanged address with another tier, which readers see whole.
    pub fn set_tiers(&mut self, tiers: &SharedTiers) {
        let Some(t) = &mut self.topo else { return };
        self.tier_table = Some(tiers.clone());
        let Some(check) = t.set_tiers(tiers) else { return };
        let (mut keys, mut values) = (Vec::new(), Vec::new());
        match (t.stored.take(), check) {
            (Some(stored), _) => {
                for (b, id) in self.backend_ids.entries() {
                    let now = t.backend_tier(&b);
                    if now != stored.get(&id).copied().unwrap_or(pc::tier::OTHER) {
                        keys.push(BackendKey { backend_id: id });
                        values.push(tiered_backend_value(&b, now));
                    }
                }
            }
            (None, moved) => {
                let moved: Option<FastHashSet<std::net::IpAddr>> = moved.map(|m| m.into_iter().collect());
                for (b, id) in self.backend_ids.entries() {
                    if moved.as_ref().is_none_or(|m| m.contains(&b.ip)) {
                        keys.push(BackendKey { backend_id: id });
                        values.push(tiered_backend_value(&b, t.backend_tier(&b)));
                    }
                }
            }
        }
        if let Err(e) = bpf_batch::update(&mut self.backends, &keys, &values) {
            tracing::warn!(map = self.maps.backends.name, error = %e, "writing backends' topology tiers failed; their connections count in their old tier");
        }
    }

    /// Publishes the owner (Service port) of each counted frontend's
    /// service id in `owners` (for `/metrics`), under `datapath`'s code.
    pub fn set_counter_owners(&mut self, owners: crate::observe::service_connections::Owners) {
        let code = match self.maps.datapath() {
            Datapath::Socket => crate::observe::service_connections::SOCKET,
            Datapath::Tc => crate::observe::service_connections::TC,
        };
        if let Some(t) = &mut self.topo {
            t.set_owners(code, owners);
        }
    }

    /// Sets how the frontends in `frontends` count their connections (their
    /// chosen tier and blind-remote share, issue #34). A programmed
    /// frontend whose tier changed gets its service entry rewritten in
    /// place (same generation and backends, other flags), and its share;
    /// the others get theirs when they are written.
    pub fn set_topology(&mut self, frontends: &[(Frontend, crate::decide::decision::FrontendTopo)]) {
        let Some(t) = &mut self.topo else { return };
        for fe in t.set_topology(frontends) {
            let Some(p) = self.programmed.get_mut(&fe) else { continue };
            let flags = (p.value.flags & !pc::SVC_TIER_MASK) | t.tier_bits_of(&fe);
            if flags != p.value.flags {
                let value = ServiceValue { flags, ..p.value };
                match self.services.insert(service_key(&fe), value, 0) {
                    Ok(()) => p.value = value,
                    Err(e) => tracing::warn!(frontend = %fe, error = %e, "rewriting the frontend's topology tier failed"),
                }
            }
            if let Err(e) = t.write_share(&fe, p.value.service_id) {
                tracing::debug!(frontend = %fe, error = %e, "writing the blind-remote share failed");
            }
        }
    }

    /// (map, entries in use, capacity) per map, for metrics and `dump`.
    pub fn occupancy(&self) -> [(&'static str, u32, u32); 5] {
        [
            (self.maps.services.name, self.programmed.len() as u32, self.max_services),
            (self.maps.slots.name, self.slots_used, self.max_slots),
            (self.maps.backends.name, self.backend_ids.len() as u32, self.max_backends),
            (self.maps.affinity_match.name, self.matches_used, self.max_matches),
            (self.maps.source_ranges.name, self.ranges_used, self.max_ranges),
        ]
    }
}

/// The programmed entry of `fe` in `programmed` or, during an `apply`,
/// among the `appended` ones (`MapWriter::appended`).
fn programmed_get<'a>(
    programmed: &'a BTreeMap<Frontend, Programmed>,
    appended: &'a [(Frontend, Programmed)],
    fe: &Frontend,
) -> Option<&'a Programmed> {
    match appended.binary_search_by(|(k, _)| k.cmp(fe)) {
        Ok(i) => Some(&appended[i].1),
        Err(_) => programmed.get(fe),
    }
}

/// The affinity scope of a frontend written as `value`, if it is affine.
fn affinity_scope(value: &ServiceValue) -> Option<u32> {
    (value.flags & pc::SVC_FLAG_AFFINITY != 0).then(|| value.affinity_scope())
}

/// Deletes the entries of an affinity map whose scope is in `gone`;
/// returns how many there were.
fn sweep<K: aya::Pod + Eq + std::hash::Hash>(
    map: &mut HashMap<MapData, K, AffinityValue>,
    gone: &BTreeSet<u32>,
    scope_id: impl Fn(&K) -> u32,
) -> Result<usize, MapError> {
    let keys: Vec<K> = bpf_batch::read_all(map)?.into_iter().map(|(k, _)| k).filter(|k| gone.contains(&scope_id(k))).collect();
    let failed = delete_keys(map, &keys);
    Ok(keys.len() - failed.len())
}

/// Frontends appended by one `apply` from this many on join the map in
/// bulk (`MapWriter::join_appended`), as a B-tree repacks (`repack_after`).
const BULK_JOIN: usize = 4096;

/// Deletes `keys` from a map, in one batch call where the kernel takes it
/// and one at a time from where it did not. A key that is already gone is
/// fine. Returns the keys that could not be deleted, by index.
fn delete_keys<K: aya::Pod, V: aya::Pod>(map: &mut HashMap<MapData, K, V>, keys: &[K]) -> Vec<(usize, MapError)> {
    let from = match bpf_batch::delete(map, keys) {
        Ok(()) => return Vec::new(),
        Err(e) => e.applied.min(keys.len()),
    };
    keys[from..]
        .iter()
        .enumerate()
        .filter_map(|(i, k)| match map.remove(k) {
            Err(e) if !bpf_batch::is_not_found(&e) => Some((from + i, e)),
            _ => None,
        })
        .collect()
}

/// The destination ports of `frontends`, laid out as `SOCK_PORTS` is (the
/// port of each frontend's `SERVICES` key).
fn socket_ports<'a>(frontends: impl Iterator<Item = &'a Frontend>) -> PortSet {
    let mut s = PortSet::empty(Bitmap::Socket);
    for fe in frontends {
        s.insert_socket(u16::from_be(service_key(fe).port_be));
    }
    s
}

/// A frontend's share of a failed bitmap write (one `WriteError` each:
/// they own their source).
fn ports_failed(e: &PortBitsError) -> WriteError {
    let io_error = std::io::Error::other(e.to_string());
    WriteError::Syscall { map: Bitmap::Socket.map_name(), source: aya::sys::SyscallError { call: "bpf_map_update_elem", io_error }.into() }
}
