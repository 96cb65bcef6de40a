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

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use aya::maps::lpm_trie::{Key, LpmTrie};
use aya::maps::{HashMap, Map, MapData, MapError};
use foldhash::{HashMap as FastHashMap, HashSet as FastHashSet};
use proxy_common as pc;
use proxy_common::{
    AffinityMatchKey, AffinityMatchValue, AffinityValue, BackendKey, BackendValue, NpAffinityKey, ServiceKey, ServiceValue, SlotKey,
    SlotValue, SockAffinityKey, SourceRangeKey,
};

use crate::datapath::bpf_batch::{self, BatchError};
use crate::datapath::keys::{backend_of, cidr_of, frontend_of, service_key, source_range_key, tiered_backend_value};
use crate::datapath::loader::pins;
use crate::datapath::maglev_tables::{self, MaglevTables};
use crate::datapath::maps::{Datapath, MapSpec, NP_MAGLEV, SOCK_MAGLEV, SOCKET_SERVICE_MAPS, ServiceMaps};
use crate::datapath::port_bits::{Bitmap, PortBits, PortBitsError, PortSet};
use crate::datapath::service_topo::{SharedTiers, TopoMaps};
use crate::decide::maglev::{self, TableSize};
use crate::decide::plan::{FrontendPolicy, Plan, Policies, SourceRanges, State};
use crate::model::{Backend, Frontend};
use crate::util::btree::repack_after;
use crate::util::u64_map::U64Map;

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
        static DEFAULT: FrontendPolicy = FrontendPolicy { affinity_timeout_s: None, affinity_scope: 0, source_ranges: None };
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

    fn read_back(&mut self) -> Result<(), WriteError> {
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
            // A timeout of 0 (never written) stands for entries this agent
            // cannot trust (some missing): the next plan rewrites the
            // frontend, as for a missing slot.
            let affinity_timeout_s = (value.flags & pc::SVC_FLAG_AFFINITY != 0).then(|| match matches_of.get(&(sid, generation)) {
                Some((timeout, n)) if *n == value.backend_count => *timeout,
                _ => 0,
            });
            let source_ranges = (value.flags & pc::SVC_FLAG_SOURCE_RANGES != 0).then(|| {
                let mut cidrs = ranges_of.get(&(sid, generation)).cloned().unwrap_or_default();
                cidrs.sort();
                SourceRanges { cidrs, node: value.flags & pc::SVC_FLAG_SOURCE_RANGES_NODE != 0 }
            });
            // Scope 0 (an agent without scopes) reads as "none": the next
            // plan rewrites the frontend with its Service port's scope.
            let affinity_scope = value.flags >> pc::SVC_AFFINITY_SCOPE_SHIFT;
            let policy = FrontendPolicy { affinity_timeout_s, affinity_scope, source_ranges };
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

    fn maglev_is_stale(&self, fe: &Frontend, p: &Programmed, retries: &BTreeSet<Frontend>) -> bool {
        if self.maglev_refused.contains(fe) && !retries.contains(fe) {
            return false;
        }
        p.value.backend_count > 0 && (self.maglev_stale.contains(fe) || maglev_tables::size_of_value(&p.value) != self.maglev_size_for(fe))
    }

    /// The frontends the budget refused a table that the next plan tries
    /// again: as many as the room in the budget holds now, in frontend
    /// order. Retrying every one whenever one table's room appears would
    /// rewrite them all (a new generation each) for one table.
    fn maglev_retries(&self) -> BTreeSet<Frontend> {
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
    fn maglev_size_for(&self, fe: &Frontend) -> Option<TableSize> {
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

    /// Checks room for one frontend beside `chunk`, reserves its ids and
    /// queues its entries, taking `backends` when it does. Nothing is
    /// written and nothing changes but the id sets, so an error leaves the
    /// writer (and `backends`) as it was.
    fn stage(&mut self, chunk: &mut Chunk, fe: &Frontend, backends: &mut Vec<Backend>, policy: &FrontendPolicy) -> Result<(), WriteError> {
        let old = programmed_get(&self.programmed, &self.appended, fe);
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
        let n_matches = if policy.affinity_timeout_s.is_some() { n } else { 0 };
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
        for (slot, backend_id) in ids.enumerate() {
            chunk.slot_keys.push(SlotKey { service_id, generation, slot: slot as u32 });
            chunk.slot_values.push(SlotValue { backend_id });
            if let Some(timeout_s) = policy.affinity_timeout_s {
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
        chunk.service_values.push(ServiceValue { service_id, backend_count: n, generation, flags });
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
    fn flush(&mut self, chunk: &mut Chunk, errors: &mut Vec<ApplyError>) {
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

    /// Computes and links in the Maglev table of each staged frontend that
    /// gets one, under its new generation. A table is computed, written and
    /// dropped one frontend at a time: a chunk of 16,384 frontends' tables
    /// held at once would take a GiB.
    ///
    /// A table that cannot be linked (the outer map is full, memory is
    /// short) does not keep the frontend from being written: its new
    /// generation goes without one, so new flows take the modulo pick, and
    /// [`MapWriter::state`] reports it for rewriting by the next full plan.
    fn link_tables(&mut self, c: &mut Chunk) {
        let Some(t) = &mut self.maglev else { return };
        let backend_ids = &self.backend_ids;
        let created_ids = &c.created_ids;
        let created = &c.created;
        let mut requests = Vec::new();
        let mut which = Vec::new();
        for (i, (st, value)) in c.staged.iter().zip(&c.service_values).enumerate() {
            let Some(size) = st.maglev else { continue };
            let mut set = st.backends.clone();
            set.sort_unstable();
            set.dedup();
            // Every backend of a staged frontend has an id (stage reserved
            // the missing ones), so `compute` never comes back empty.
            let id_of = move |b: &Backend| backend_ids.get(b).map(|(id, _)| *id).or_else(|| created_ids.get(b).map(|i| created[*i].1));
            let computed_from = set.clone();
            let compute = Box::new(move || maglev_tables::table_ids(&maglev::table(&computed_from, size), id_of));
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

    /// Removes frontends: their service entries, then their slots, then
    /// backends nobody uses any more. Returns how many service entries
    /// could not be deleted.
    fn delete_all(&mut self, frontends: &[Frontend]) -> usize {
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
            dead.matches.extend(old.backends.iter().filter_map(|b| self.backend_ids.get(b)).map(|(backend_id, _)| AffinityMatchKey {
                service_id,
                generation,
                backend_id: *backend_id,
            }));
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

/// Backend address to (id, number of frontends using it). An IPv4
/// backend's address and port fit in a `u64` key: 16 bytes an entry
/// instead of 28 with the 20-byte `Backend`, in a table sized to its
/// entries rather than to a power of two (`U64Map`): the writer's largest
/// table, 58 MiB at 1M backends with `Backend` keys, 34 MiB in a
/// `HashMap` of `u64` keys, 21 MiB now.
#[derive(Default)]
struct BackendIds {
    v4: U64Map<(u32, u32)>,
    v6: FastHashMap<Backend, (u32, u32)>,
}

/// The `BackendIds` key of an IPv4 backend.
fn v4_key(b: &Backend) -> Option<u64> {
    match b.ip {
        std::net::IpAddr::V4(ip) => Some((u64::from(u32::from(ip)) << 16) | u64::from(b.port)),
        std::net::IpAddr::V6(_) => None,
    }
}

impl BackendIds {
    fn get(&self, b: &Backend) -> Option<&(u32, u32)> {
        match v4_key(b) {
            Some(k) => self.v4.get(k),
            None => self.v6.get(b),
        }
    }

    fn get_mut(&mut self, b: &Backend) -> Option<&mut (u32, u32)> {
        match v4_key(b) {
            Some(k) => self.v4.get_mut(k),
            None => self.v6.get_mut(b),
        }
    }

    fn contains_key(&self, b: &Backend) -> bool {
        self.get(b).is_some()
    }

    fn insert(&mut self, b: Backend, v: (u32, u32)) {
        match v4_key(&b) {
            Some(k) => self.v4.insert(k, v),
            None => self.v6.insert(b, v),
        };
    }

    fn remove(&mut self, b: &Backend) {
        match v4_key(b) {
            Some(k) => self.v4.remove(k),
            None => self.v6.remove(b),
        };
    }

    /// One more reference to `b`, known under `id` if it is new.
    fn add_reference(&mut self, b: Backend, id: u32) {
        let e = match v4_key(&b) {
            Some(k) => self.v4.get_or_insert(k, (id, 0)),
            None => self.v6.entry(b).or_insert((id, 0)),
        };
        e.1 += 1;
    }

    fn len(&self) -> usize {
        self.v4.len() + self.v6.len()
    }

    fn ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.v4.values().chain(self.v6.values()).map(|(id, _)| *id)
    }

    /// Every backend with its id.
    fn entries(&self) -> impl Iterator<Item = (Backend, u32)> + '_ {
        let v4 = self.v4.iter().map(|(k, (id, _))| {
            let ip = std::net::Ipv4Addr::from((k >> 16) as u32);
            (Backend { ip: std::net::IpAddr::V4(ip), port: k as u16 }, *id)
        });
        v4.chain(self.v6.iter().map(|(b, (id, _))| (*b, *id)))
    }

    /// Room for those of `backends` not known yet, at most `room` in all.
    fn reserve_for<'a>(&mut self, backends: impl Iterator<Item = &'a Backend>, room: usize) {
        let (mut v4, mut v6) = (0, 0);
        for b in backends.filter(|b| !self.contains_key(b)) {
            if v4_key(b).is_some() {
                v4 += 1;
            } else {
                v6 += 1;
            }
        }
        self.v4.reserve(v4.min(room));
        self.v6.reserve(v6.min(room.saturating_sub(v4)));
    }
}

/// Ids in use, as a bitmap of 64-id words, only the words that hold one:
/// ids are handed out in sequence, so the live ones lie in runs (a
/// `BTreeSet<u32>` took 11 MiB at 1M backends, this a fraction of one).
#[derive(Default)]
struct IdSet(BTreeMap<u32, u64>);

impl IdSet {
    fn contains(&self, id: u32) -> bool {
        self.0.get(&(id / 64)).is_some_and(|w| w & (1 << (id % 64)) != 0)
    }

    fn insert(&mut self, id: u32) {
        *self.0.entry(id / 64).or_default() |= 1 << (id % 64);
    }

    fn remove(&mut self, id: u32) {
        if let Some(w) = self.0.get_mut(&(id / 64)) {
            *w &= !(1 << (id % 64));
            if *w == 0 {
                self.0.remove(&(id / 64));
            }
        }
    }
}

impl FromIterator<u32> for IdSet {
    fn from_iter<I: IntoIterator<Item = u32>>(ids: I) -> Self {
        let mut set = IdSet::default();
        for id in ids {
            set.insert(id);
        }
        set
    }
}

/// Frontends whose entries are staged, not yet written.
#[derive(Default)]
struct Chunk {
    staged: Vec<Staged>,
    frontends: FastHashSet<Frontend>,
    service_keys: Vec<ServiceKey>,
    service_values: Vec<ServiceValue>,
    slot_keys: Vec<SlotKey>,
    slot_values: Vec<SlotValue>,
    match_keys: Vec<AffinityMatchKey>,
    match_values: Vec<AffinityMatchValue>,
    range_keys: Vec<RangeKey>,
    /// Backends the chunk adds, with the ids reserved for them, and each
    /// one's place in `created`.
    created: Vec<(Backend, u32)>,
    created_ids: FastHashMap<Backend, usize>,
    /// Frontends of the chunk that are not in the maps yet.
    new_services: u32,
}

impl Chunk {
    /// The id reserved for `b`, if the chunk adds it.
    fn created_id(&self, b: &Backend) -> Option<u32> {
        self.created_ids.get(b).map(|i| self.created[*i].1)
    }

    /// Empties the chunk, keeping its buffers.
    fn clear(&mut self) {
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

struct Staged {
    frontend: Frontend,
    /// The size of the Maglev table its new generation gets, if any.
    maglev: Option<TableSize>,
    backends: Vec<Backend>,
    old: Option<Programmed>,
    policy: FrontendPolicy,
    /// Its entries in the chunk's `match_keys` and `range_keys`.
    matches: std::ops::Range<usize>,
    ranges: std::ops::Range<usize>,
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
const CHUNK_SLOTS: usize = 32_768;
const CHUNK_FRONTENDS: usize = 8_192;

/// A chunk that adds at least this many backends and slots writes its new
/// backends on a thread of their own (`write_chunk`); below it, a thread
/// costs more than it saves.
const PARALLEL_FROM: usize = 4_096;

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

fn full(map: &'static MapSpec, used: u32, max: u32, needed: u32) -> WriteError {
    WriteError::Full { map: map.name, used, max, needed, flag: map.flag() }
}

fn syscall_error(map: &'static str, e: BatchError) -> WriteError {
    WriteError::Syscall { map, source: MapError::SyscallError(aya::sys::SyscallError { call: "bpf_map_update_batch", io_error: e.source }) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn id_sets_hold_what_was_inserted_and_not_removed() {
        let ids = [1, 63, 64, 65, 1_000_000, u32::MAX];
        let mut set: IdSet = ids.iter().copied().collect();
        assert!(ids.iter().all(|id| set.contains(*id)));
        assert!(![0, 2, 62, 66, 999_999, u32::MAX - 1].iter().any(|id| set.contains(*id)));
        for id in ids {
            set.remove(id);
            assert!(!set.contains(id));
        }
        assert!(set.0.is_empty(), "an empty word is dropped");
    }

    #[test]
    fn backend_ids_key_both_families_apart() {
        let v4 = Backend { ip: "10.0.0.1".parse().unwrap(), port: 80 };
        let v4_other_port = Backend { ip: "10.0.0.1".parse().unwrap(), port: 81 };
        let v6 = Backend { ip: "::ffff:10.0.0.1".parse().unwrap(), port: 80 };
        let mut ids = BackendIds::default();
        ids.add_reference(v4, 7);
        ids.add_reference(v4, 9);
        ids.insert(v6, (8, 1));
        assert_eq!(ids.get(&v4), Some(&(7, 2)), "the first id, two references");
        assert_eq!(ids.get(&v4_other_port), None);
        assert_eq!(ids.get(&v6), Some(&(8, 1)), "an IPv4-mapped IPv6 address is another backend");
        assert_eq!((ids.len(), ids.ids().collect::<BTreeSet<_>>()), (2, [7, 8].into()));
        ids.remove(&v4);
        assert!(!ids.contains_key(&v4) && ids.contains_key(&v6));
    }
}
