//! Reading the datapath's pinned maps back, for `proxy-agent dump`, and
//! checking that they hold what the map writer promises: every service
//! entry's `backend_count` slots exist under its generation, every slot names
//! a backend that exists, and nothing else is left lying around.
//!
//! Reading ([`read`]) and judging ([`check`]) are separate so that the
//! consistency rules are a pure function of map entries and can be tested
//! without a kernel. The maps are opened with `BPF_F_RDONLY`: a dump can
//! never change what the datapath serves.
//!
//! What frontends need besides their backends is decoded and checked the
//! same way for both datapaths: session affinity (each affine frontend's
//! timeout and match entries, every client's entry with its backend and
//! whether the programs would still honour it) and source ranges.
//!
//! A dump taken while an agent rewrites a service can catch the writer
//! between its steps (new slots written but not yet switched to, old ones
//! not yet deleted) and report orphans that vanish a moment later; the
//! errors, by contrast, are states the writer never produces.

use std::collections::{BTreeMap, BTreeSet};
use std::hash::Hash;
use std::io;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use aya::Pod;
use aya::maps::lpm_trie::LpmTrie;
use aya::maps::{Array, HashMap, HashOfMaps, Map, MapData, MapError, PerCpuArray};
use proxy_common as pc;
use proxy_common::{
    AddrKey, AffinityMatchKey, AffinityMatchValue, AffinityValue, BackendKey, BackendValue, CtKey, CtValue, NpAffinityKey, NpConfig,
    NpFlagsValue, ServiceKey, ServiceValue, SlotKey, SlotValue, SockAffinityKey, SockRevNatKey, SockRevNatValue, SourceRangeKey,
    SvcConnValue,
};
use serde::Serialize;

use crate::datapath::bpf_batch::read_all;
use crate::datapath::conntrack_gc::monotonic_now_s;
use crate::datapath::keys::{backend_of, frontend_of, ip_of};
use crate::datapath::maps::{self, Datapath, MapSpec, SOCKET_SERVICE_MAPS, ServiceMaps, TC_SERVICE_MAPS};
use crate::datapath::port_bits::{Bitmap, PortSet};

// The cause is part of each message and deliberately not a `source`:
// `main` prints error chains, which would repeat it.
#[derive(Debug, thiserror::Error)]
pub enum DumpError {
    #[error("cannot open pinned map {path}: {error}. Is the agent installed with this --bpffs, and do we have CAP_BPF?")]
    Open { path: PathBuf, error: io::Error },
    #[error("pinned map {path} is not what this agent expects: {error}")]
    Kind { path: PathBuf, error: MapError },
    #[error("reading map {map}: {error}")]
    Read { map: &'static str, error: MapError },
}

/// Everything the maps hold, as raw entries.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    pub services: Vec<(ServiceKey, ServiceValue)>,
    pub slots: Vec<(SlotKey, SlotValue)>,
    pub backends: Vec<(BackendKey, BackendValue)>,
    /// Per-CPU values summed, indexed by counter id.
    pub counters: Vec<u64>,
    pub maps: Vec<MapUsage>,
    /// `AFFINITY_MATCH`, `SOURCE_RANGES` and `AFFINITY`.
    pub policy: PolicySnapshot,
    /// The TC datapath's `NP_*` maps; `None` when they are not pinned (a
    /// datapath installed by an agent without external-traffic support).
    pub nodeport: Option<NpSnapshot>,
    /// Kernel bytes of the distinct arrays `SOCK_MAGLEV` links (8 per entry).
    pub maglev_table_bytes: u64,
    /// `SOCK_PORTS`; `None` when it is not pinned (pins of an agent version
    /// without it).
    pub socket_ports: Option<PortSet>,
    /// `SOCK_REC`: (cookie, record) of every translated connect() of a
    /// live socket; empty when it is not pinned.
    pub socket_records: Vec<(u64, pc::SockRecValue)>,
}

/// One datapath's policy maps, as raw entries; empty when they are not
/// pinned (a datapath installed by an agent version without them).
#[derive(Clone, Debug, Default)]
pub struct PolicySnapshot {
    pub matches: Vec<(AffinityMatchKey, AffinityMatchValue)>,
    /// Each source range entry: (prefix length in bits, key).
    pub ranges: Vec<(u32, SourceRangeKey)>,
    /// The clients' affinity entries: (affinity scope, client, entry). The
    /// client is `netns N` (a network namespace cookie) for the socket
    /// datapath and an address for the TC one.
    pub clients: Vec<(u32, String, AffinityValue)>,
    /// CLOCK_MONOTONIC nanoseconds when the entries were read (the clock
    /// of `AffinityValue::last_used_ns`).
    pub now_ns: Option<u64>,
}

/// Everything the `NP_*` maps hold, as raw entries.
#[derive(Clone, Debug, Default)]
pub struct NpSnapshot {
    pub services: Vec<(ServiceKey, ServiceValue)>,
    pub slots: Vec<(SlotKey, SlotValue)>,
    pub backends: Vec<(BackendKey, BackendValue)>,
    pub flags: Vec<(ServiceKey, NpFlagsValue)>,
    pub local: Vec<(AddrKey, u32)>,
    pub conntrack: Vec<(CtKey, CtValue)>,
    pub config: Option<NpConfig>,
    /// `NP_COUNTERS` summed over CPUs, indexed by counter id.
    pub counters: Vec<u64>,
    /// CLOCK_MONOTONIC seconds when the conntrack table was read, to show
    /// entries' ages (`seen_s` is on that clock).
    pub now_s: Option<u32>,
    /// `NP_AFFINITY_MATCH`, `NP_SOURCE_RANGES` and `NP_AFFINITY`.
    pub policy: PolicySnapshot,
    /// Kernel bytes of the distinct arrays `NP_MAGLEV` links (8 per entry).
    pub maglev_table_bytes: u64,
    /// `NP_PORTS`; `None` when it is not pinned (pins of an agent version
    /// without it).
    pub ports: Option<PortSet>,
    /// `NP_FAST_COUNTERS` summed over CPUs (empty when not pinned: pins of
    /// an agent version without the TC fast path).
    pub fast_counters: Vec<u64>,
    /// `NP_PEER_DEVS`: interface indexes of the veths the fast path hands
    /// local backends' packets to (empty when not pinned).
    pub peer_devices: Vec<u32>,
}

#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct MapUsage {
    pub name: &'static str,
    pub entries: u64,
    pub max_entries: u32,
}

/// `BPF_OBJ_GET` with `BPF_F_RDONLY`. aya's `MapData::from_pin` always asks
/// for a read-write descriptor, so the syscall is made here.
fn open_read_only(path: &Path) -> io::Result<OwnedFd> {
    // The BPF_OBJ_* member of `union bpf_attr` (include/uapi/linux/bpf.h);
    // the kernel zero-fills whatever lies beyond the size we pass.
    // `_pad` makes the tail explicit: the kernel rejects the call when bytes
    // past the last field it knows are not zero (CHECK_ATTR), and implicit
    // padding would be uninitialised.
    #[repr(C)]
    struct ObjGetAttr {
        pathname: u64,
        bpf_fd: u32,
        file_flags: u32,
        path_fd: i32,
        _pad: u32,
    }
    const BPF_OBJ_GET: libc::c_long = 7;
    const BPF_F_RDONLY: u32 = 1 << 3;
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let attr = ObjGetAttr { pathname: c_path.as_ptr() as u64, bpf_fd: 0, file_flags: BPF_F_RDONLY, path_fd: 0, _pad: 0 };
    // SAFETY: `attr` and the string it points to outlive the call; the size
    // passed is the size of `attr`.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, BPF_OBJ_GET, &raw const attr, std::mem::size_of::<ObjGetAttr>() as libc::c_uint) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = i32::try_from(fd).map_err(|_| io::Error::other("BPF_OBJ_GET returned an impossible descriptor"))?;
    // SAFETY: the kernel just handed us this descriptor; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn open(pin_dir: &Path, spec: &MapSpec) -> Result<(Map, u32), DumpError> {
    let path = pin_dir.join(spec.name);
    let fd = open_read_only(&path).map_err(|error| DumpError::Open { path: path.clone(), error })?;
    let kind = |error| DumpError::Kind { path: path.clone(), error };
    let data = MapData::from_fd(fd).map_err(kind)?;
    let max = data.info().map_err(kind)?.max_entries();
    Ok((Map::from_map_data(data).map_err(kind)?, max))
}

/// Entries of a hash map (plain or LRU), in no particular order, through
/// the bounded [`read_all`]: a map that a live agent or the datapath keeps
/// changing cannot keep the dump from finishing. Records the map's usage.
fn hash_entries<K: Pod + Eq + Hash, V: Pod>(
    pin_dir: &Path,
    spec: &'static MapSpec,
    maps: &mut Vec<MapUsage>,
) -> Result<Vec<(K, V)>, DumpError> {
    let (map, max) = open(pin_dir, spec)?;
    let hash: HashMap<MapData, K, V> = HashMap::try_from(map).map_err(|error| DumpError::Kind { path: pin_dir.join(spec.name), error })?;
    let out = read_all(&hash).map_err(|error| DumpError::Read { map: spec.name, error })?;
    maps.push(MapUsage { name: spec.name, entries: out.len() as u64, max_entries: max });
    Ok(out)
}

/// [`hash_entries`] in key order.
fn sorted_entries<K: Pod + Ord + Hash, V: Pod>(
    pin_dir: &Path,
    spec: &'static MapSpec,
    maps: &mut Vec<MapUsage>,
) -> Result<Vec<(K, V)>, DumpError> {
    let mut out: Vec<(K, V)> = hash_entries(pin_dir, spec, maps)?;
    out.sort_unstable_by_key(|e| e.0);
    Ok(out)
}

/// Records the usage of a Maglev hash of maps (`NP_MAGLEV`,
/// `SOCK_MAGLEV`): how many keys link a table in. Returns the bytes of
/// backend ids of the distinct arrays they link (frontends with the same
/// backends share one). Nothing when it is not pinned (a datapath
/// installed by an agent without tables).
fn maglev_usage(pin_dir: &Path, spec: &'static MapSpec, maps: &mut Vec<MapUsage>) -> Result<u64, DumpError> {
    if !pin_dir.join(spec.name).exists() {
        return Ok(0);
    }
    let (map, max) = open(pin_dir, spec)?;
    let outer: HashOfMaps<MapData, pc::MaglevKey, MapData> =
        HashOfMaps::try_from(map).map_err(|error| DumpError::Kind { path: pin_dir.join(spec.name), error })?;
    // Bounded: a table linked in while the keys are listed must not keep
    // the dump going.
    let keys: Vec<pc::MaglevKey> = outer.keys().take(max as usize).flatten().collect();
    let mut arrays: BTreeMap<u32, u64> = BTreeMap::new();
    for k in &keys {
        // Unlinked meanwhile: skipped.
        if let Ok(inner) = outer.get(k, 0)
            && let Ok(info) = inner.info()
        {
            arrays.insert(info.id(), u64::from(info.max_entries()) * crate::decide::maglev::KERNEL_BYTES_PER_ENTRY);
        }
    }
    maps.push(MapUsage { name: spec.name, entries: keys.len() as u64, max_entries: max });
    Ok(arrays.values().sum())
}

/// A per-CPU array of counters summed over CPUs, indexed by counter id.
/// Records the map's usage.
fn counter_sums(pin_dir: &Path, spec: &'static MapSpec, maps: &mut Vec<MapUsage>) -> Result<Vec<u64>, DumpError> {
    let (map, max) = open(pin_dir, spec)?;
    let arr = PerCpuArray::<MapData, u64>::try_from(map).map_err(|error| DumpError::Kind { path: pin_dir.join(spec.name), error })?;
    let mut sums = Vec::with_capacity(max as usize);
    for i in 0..max {
        let per_cpu = arr.get(&i, 0).map_err(|error| DumpError::Read { map: spec.name, error })?;
        sums.push(per_cpu.iter().fold(0u64, |a, v| a.wrapping_add(*v)));
    }
    maps.push(MapUsage { name: spec.name, entries: u64::from(max), max_entries: max });
    Ok(sums)
}

/// The topology counts (issue #34) of service ids `ids` of one datapath
/// (`SVC_CONN` or `NP_SVC_CONN`, by `spec`), summed over CPUs; ids without
/// a slot (an older build's) are left out. Read-only; used by `/metrics`
/// and `explain --live`.
pub fn service_conn_sums(pin_dir: &Path, spec: &'static MapSpec, ids: &[u32]) -> Result<Vec<(u32, SvcConnValue)>, DumpError> {
    let (map, max) = open(pin_dir, spec)?;
    let arr =
        PerCpuArray::<MapData, SvcConnValue>::try_from(map).map_err(|error| DumpError::Kind { path: pin_dir.join(spec.name), error })?;
    let mut out = Vec::with_capacity(ids.len());
    for &id in ids {
        let index = pc::svc_conn_index(id);
        if index >= max {
            continue;
        }
        let per_cpu = arr.get(&index, 0).map_err(|error| DumpError::Read { map: spec.name, error })?;
        out.push((id, sum_conn(per_cpu.iter())));
    }
    Ok(out)
}

/// Per-CPU topology counts added up.
pub fn sum_conn<'a>(values: impl Iterator<Item = &'a SvcConnValue>) -> SvcConnValue {
    values.fold(SvcConnValue::default(), |mut a, v| {
        for (x, y) in a.tiers.iter_mut().zip(v.tiers) {
            *x = x.wrapping_add(y);
        }
        a.blind_remote_fp = a.blind_remote_fp.wrapping_add(v.blind_remote_fp);
        a
    })
}

/// The topology counts of every frontend of one datapath (`services` the
/// frontend map, `conn` its counting array), by frontend; nothing when the
/// counting array is not pinned (a datapath of an older build).
pub fn frontend_conn_counts(
    pin_dir: &Path,
    services: &'static MapSpec,
    conn: &'static MapSpec,
) -> Result<BTreeMap<crate::model::Frontend, SvcConnValue>, DumpError> {
    if !pin_dir.join(conn.name).exists() {
        return Ok(BTreeMap::new());
    }
    let entries: Vec<(ServiceKey, ServiceValue)> = hash_entries(pin_dir, services, &mut Vec::new())?;
    let ids: Vec<u32> = entries.iter().map(|(_, v)| v.service_id).collect();
    let counts: BTreeMap<u32, SvcConnValue> = service_conn_sums(pin_dir, conn, &ids)?.into_iter().collect();
    Ok(entries.iter().filter_map(|(k, v)| Some((crate::datapath::keys::frontend_of(k)?, *counts.get(&v.service_id)?))).collect())
}

/// Reads every map under `pin_dir`.
pub fn read(pin_dir: &Path) -> Result<Snapshot, DumpError> {
    let mut snap = Snapshot::default();
    let usage = &mut snap.maps;
    snap.services = sorted_entries(pin_dir, &maps::SERVICES, usage)?;
    snap.slots = sorted_entries(pin_dir, &maps::SLOTS, usage)?;
    snap.backends = sorted_entries(pin_dir, &maps::BACKENDS, usage)?;
    // Only the size of the reverse-translation table is interesting here.
    hash_entries::<SockRevNatKey, SockRevNatValue>(pin_dir, &maps::SOCK_REVNAT, usage)?;
    if pin_dir.join(maps::SOCK_REC.name).exists() {
        snap.socket_records = sorted_entries(pin_dir, &maps::SOCK_REC, usage)?;
    }
    snap.counters = counter_sums(pin_dir, &maps::COUNTERS, usage)?;
    snap.maglev_table_bytes = maglev_usage(pin_dir, &maps::SOCK_MAGLEV, usage)?;
    snap.socket_ports = read_ports(pin_dir, &maps::SOCK_PORTS, Bitmap::Socket)?;
    snap.policy =
        read_policy::<SockAffinityKey>(pin_dir, &SOCKET_SERVICE_MAPS, usage, |k| (k.scope_id, format!("netns {}", k.netns_cookie)))?;
    if pin_dir.join(maps::NP_SERVICES.name).exists() {
        snap.nodeport = Some(read_nodeport(pin_dir, usage)?);
    }
    Ok(snap)
}

/// A datapath's policy maps (see [`PolicySnapshot`]); `client` names the
/// client of an affinity key.
fn read_policy<K: Pod + Eq + Hash>(
    pin_dir: &Path,
    names: &'static ServiceMaps,
    usage: &mut Vec<MapUsage>,
    client: impl Fn(&K) -> (u32, String),
) -> Result<PolicySnapshot, DumpError> {
    if !pin_dir.join(names.affinity_match.name).exists() {
        return Ok(PolicySnapshot::default());
    }
    let matches = sorted_entries(pin_dir, names.affinity_match, usage)?;
    let (map, max) = open(pin_dir, names.source_ranges)?;
    let path = pin_dir.join(names.source_ranges.name);
    let trie: LpmTrie<MapData, SourceRangeKey, u32> = LpmTrie::try_from(map).map_err(|error| DumpError::Kind { path, error })?;
    let mut ranges = Vec::new();
    for k in trie.keys() {
        let k = k.map_err(|error| DumpError::Read { map: names.source_ranges.name, error })?;
        ranges.push((k.prefix_len(), k.data()));
    }
    ranges.sort_unstable();
    usage.push(MapUsage { name: names.source_ranges.name, entries: ranges.len() as u64, max_entries: max });
    let entries: Vec<(K, AffinityValue)> = hash_entries(pin_dir, names.affinity, usage)?;
    let mut clients: Vec<(u32, String, AffinityValue)> = entries
        .iter()
        .map(|(k, v)| {
            let (sid, c) = client(k);
            (sid, c, *v)
        })
        .collect();
    clients.sort_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
    Ok(PolicySnapshot { matches, ranges, clients, now_ns: monotonic_now_ns() })
}

/// CLOCK_MONOTONIC in nanoseconds, the clock the programs' coarse reads
/// follow (to within a tick).
fn monotonic_now_ns() -> Option<u64> {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec into `ts`.
    if unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &raw mut ts) } != 0 {
        return None;
    }
    Some(u64::try_from(ts.tv_sec).ok()? * 1_000_000_000 + u64::try_from(ts.tv_nsec).ok()?)
}

/// The TC programs' `NP_COUNTERS` summed over CPUs, indexed by counter id
/// (`proxy_common::np_counter::NAMES`). Read-only; used by `/metrics`.
pub fn np_counter_sums(pin_dir: &Path) -> Result<Vec<u64>, DumpError> {
    counter_sums(pin_dir, &maps::NP_COUNTERS, &mut Vec::new())
}

/// The socket hooks' `COUNTERS` summed over CPUs, indexed by counter id
/// (`proxy_common::counter::NAMES`). Read-only; used by `/metrics`.
pub fn socket_counter_sums(pin_dir: &Path) -> Result<Vec<u64>, DumpError> {
    counter_sums(pin_dir, &maps::COUNTERS, &mut Vec::new())
}

/// The TC fast path's `NP_FAST_COUNTERS` summed over CPUs, indexed by
/// counter id (`proxy_common::np_fast_counter::NAMES`). Used by `/metrics`.
pub fn np_fast_counter_sums(pin_dir: &Path) -> Result<Vec<u64>, DumpError> {
    counter_sums(pin_dir, &maps::NP_FAST_COUNTERS, &mut Vec::new())
}

/// [`np_fast_counter_sums`] by name.
pub fn np_fast_counters(pin_dir: &Path) -> Result<BTreeMap<&'static str, u64>, DumpError> {
    Ok(pc::np_fast_counter::NAMES.iter().copied().zip(np_fast_counter_sums(pin_dir)?).collect())
}

/// [`np_counter_sums`] by name, for the counters this agent knows.
pub fn np_counters(pin_dir: &Path) -> Result<BTreeMap<&'static str, u64>, DumpError> {
    Ok(pc::np_counter::NAMES.iter().copied().zip(np_counter_sums(pin_dir)?).collect())
}

fn read_nodeport(pin_dir: &Path, usage: &mut Vec<MapUsage>) -> Result<NpSnapshot, DumpError> {
    let mut np = NpSnapshot {
        services: sorted_entries(pin_dir, &maps::NP_SERVICES, usage)?,
        slots: sorted_entries(pin_dir, &maps::NP_SLOTS, usage)?,
        backends: sorted_entries(pin_dir, &maps::NP_BACKENDS, usage)?,
        flags: sorted_entries(pin_dir, &maps::NP_FLAGS, usage)?,
        local: sorted_entries(pin_dir, &maps::NP_LOCAL, usage)?,
        conntrack: sorted_entries(pin_dir, &maps::NP_CT, usage)?,
        ..NpSnapshot::default()
    };
    np.now_s = monotonic_now_s().ok();
    let (map, max) = open(pin_dir, &maps::NP_CONFIG)?;
    let config =
        Array::<MapData, NpConfig>::try_from(map).map_err(|error| DumpError::Kind { path: pin_dir.join(pc::NP_CONFIG_MAP), error })?;
    np.config = Some(config.get(&0, 0).map_err(|error| DumpError::Read { map: pc::NP_CONFIG_MAP, error })?);
    usage.push(MapUsage { name: pc::NP_CONFIG_MAP, entries: u64::from(max), max_entries: max });
    np.counters = counter_sums(pin_dir, &maps::NP_COUNTERS, usage)?;
    if pin_dir.join(maps::NP_FAST_COUNTERS.name).exists() {
        np.fast_counters = counter_sums(pin_dir, &maps::NP_FAST_COUNTERS, usage)?;
    }
    if pin_dir.join(maps::NP_PEER_DEVS.name).exists() {
        np.peer_devices = sorted_entries::<u32, u32>(pin_dir, &maps::NP_PEER_DEVS, usage)?.into_iter().map(|(i, _)| i).collect();
    }
    np.ports = read_ports(pin_dir, &maps::NP_PORTS, Bitmap::Tc)?;
    np.maglev_table_bytes = maglev_usage(pin_dir, &maps::NP_MAGLEV, usage)?;
    np.policy = read_policy::<NpAffinityKey>(pin_dir, &TC_SERVICE_MAPS, usage, |k| {
        (k.scope_id, ip_of(k.client_be, k.family).map_or_else(|| format!("family {} {:08x?}", k.family, k.client_be), |ip| ip.to_string()))
    })?;
    Ok(np)
}

/// A port bitmap (`NP_PORTS` or `SOCK_PORTS`) as a set, or `None` when it
/// is not pinned.
fn read_ports(pin_dir: &Path, spec: &'static MapSpec, bitmap: Bitmap) -> Result<Option<PortSet>, DumpError> {
    let path = pin_dir.join(spec.name);
    if !path.exists() {
        return Ok(None);
    }
    let (map, _) = open(pin_dir, spec)?;
    let words = Array::<MapData, u64>::try_from(map).map_err(|error| DumpError::Kind { path: path.clone(), error })?;
    let words: Vec<u64> = words.iter().collect::<Result<_, _>>().map_err(|error| DumpError::Read { map: spec.name, error })?;
    Ok(PortSet::from_words_of(bitmap, words))
}

/// Counter values by name (`proxy_common::counter::NAMES`).
pub fn named_counters(sums: &[u64]) -> BTreeMap<String, u64> {
    named(sums, &pc::counter::NAMES)
}

/// `NP_COUNTERS` values by name (`proxy_common::np_counter::NAMES`).
pub fn named_np_counters(sums: &[u64]) -> BTreeMap<String, u64> {
    named(sums, &pc::np_counter::NAMES)
}

fn named(sums: &[u64], names: &[&str]) -> BTreeMap<String, u64> {
    sums.iter().enumerate().map(|(i, v)| (names.get(i).map_or_else(|| format!("counter{i}"), |n| (*n).to_string()), *v)).collect()
}

#[derive(Clone, Copy, Debug, Serialize, PartialEq, Eq, PartialOrd, Ord)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    /// The datapath serves this state, but it is left over: harmless for
    /// traffic, cleaned up by the next agent start.
    Warning,
    /// Traffic to some frontend is not what the agent meant.
    Error,
}

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
pub const DATAPATH_TC: &str = Datapath::Tc.label();

#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Finding {
    pub severity: Severity,
    pub kind: FindingKind,
    /// `socket` (SERVICES, SLOTS, BACKENDS) or `tc` (the NP_* maps).
    pub datapath: &'static str,
    pub message: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub service_id: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub generation: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slot: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub backend_id: Option<u32>,
}

impl Finding {
    fn new(kind: FindingKind, message: String) -> Finding {
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
    fn service(mut self, id: u32, generation: u32) -> Finding {
        self.service_id = Some(id);
        self.generation = Some(generation);
        self
    }
    fn slot(mut self, slot: u32) -> Finding {
        self.slot = Some(slot);
        self
    }
    fn backend(mut self, id: u32) -> Finding {
        self.backend_id = Some(id);
        self
    }
}

/// One SERVICES entry with the slots of its current generation.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ServiceView {
    /// `10.96.0.10:80/TCP`, `[fd00::10]:53/UDP`; for an undecodable key the
    /// raw fields.
    pub frontend: String,
    pub service_id: u32,
    pub generation: u32,
    pub backend_count: u32,
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
}

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

#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct SlotView {
    pub slot: u32,
    /// `None` when the slot is missing.
    pub backend_id: Option<u32>,
    /// `None` when the slot or its backend is missing or undecodable.
    pub backend: Option<String>,
}

#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct BackendView {
    pub backend_id: u32,
    /// `None` for an undecodable value.
    pub address: Option<String>,
    /// Live slots naming this backend.
    pub slots: u32,
}

#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct Analysis {
    pub services: Vec<ServiceView>,
    pub backends: Vec<BackendView>,
    pub findings: Vec<Finding>,
}

/// At most this many missing slots are reported one by one per service; a
/// corrupt `backend_count` of four billion must not produce four billion
/// findings.
const MISSING_SLOTS_LISTED: usize = 16;

fn raw_key(k: &ServiceKey) -> String {
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

/// Decodes a datapath's policy maps onto its frontends (`views`, as
/// [`check_maps`] made them from `services`): each affine frontend's
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
        let shown = crate::datapath::keys::cidr_of(&key).map_or_else(|| format!("prefix {len} of {:08x?}", k.addr_be), |c| c.to_string());
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

/// Errors first; within a severity, socket before TC, grouped by kind and
/// in map order.
fn sort_findings(findings: &mut [Finding]) {
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

/// One `NP_CT` entry, decoded.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct CtView {
    /// `forward` (ingress, client -> frontend), `reply` (egress, backend ->
    /// client), `snat` (egress, client -> remote backend), `reply-snat`
    /// (ingress, remote backend -> node:SNAT port); `dir N` if unknown.
    pub direction: String,
    /// `TCP`, `UDP`, or `proto N`.
    pub protocol: String,
    /// The packet as it is matched: `source -> destination`.
    pub tuple: String,
    /// What the packet becomes.
    pub translated: String,
    pub backend_id: u32,
    /// `snat`, `closing`, `fin-client`, `fin-backend`.
    pub flags: Vec<&'static str>,
    /// CLOCK_MONOTONIC seconds of the last matching packet.
    pub seen_s: u32,
    /// Seconds since then, when the clock could be read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub age_seconds: Option<u32>,
}

#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct NpConfigView {
    pub snat_v4: Option<String>,
    pub snat_v6: Option<String>,
    pub snat_port_min: u16,
    pub snat_port_max: u16,
}

/// The TC datapath's maps, decoded (`nodeport` in `dump --output json`).
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct NodePortReport {
    pub config: Option<NpConfigView>,
    /// NP_SERVICES with their slots (NP_SLOTS) and policy (NP_FLAGS).
    pub services: Vec<ServiceView>,
    pub backends: Vec<BackendView>,
    /// NP_LOCAL: endpoint addresses on this node (never SNAT'ed).
    pub local_endpoints: Vec<String>,
    pub conntrack: Vec<CtView>,
    pub counters: BTreeMap<String, u64>,
    /// NP_AFFINITY: each client's backend per affine frontend.
    pub affinity: Vec<AffinityView>,
    /// NP_PORTS: ports whose packets the programs look at; `None` when
    /// the map is not pinned.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub port_bits: Option<PortBitsView>,
    /// Devices with the XDP program in front of TC (native mode, a pinned
    /// link each); every other device of the datapath runs TC alone.
    pub xdp_devices: Vec<String>,
    /// XDP_NEXTHOP: the next hop the XDP program caches for each flow it
    /// forwards (empty when XDP is off).
    pub xdp_next_hops: Vec<NextHopView>,
    /// NP_FAST_COUNTERS by name: what the TC fast path sent to the next
    /// hop (`tc_fast_*`) and why it left translated packets to the stack
    /// (`tc_stack_*`). Fragments and ICMP errors never reach it: they are
    /// `pass_fragment` and `icmp_translated` in `counters`.
    pub fast_path: BTreeMap<String, u64>,
    /// NP_PEER_DEVS: the interface indexes of this namespace's veths whose
    /// peer is in another namespace (a pod's), where the fast path
    /// delivers local backends' packets with `bpf_redirect_peer`.
    pub peer_devices: Vec<u32>,
}

/// One flow's cached next hop (`XDP_NEXTHOP`).
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct NextHopView {
    /// `TCP`/`UDP` and the packet as it leaves: `SNAT source -> backend`.
    pub flow: String,
    pub ingress_ifindex: u32,
    /// The device the flow's packets leave by, and the MACs written.
    pub ifindex: u32,
    pub dmac: String,
    pub smac: String,
    /// The longest packet (IP length) checked against the route's MTU.
    pub max_len: u16,
    /// CLOCK_MONOTONIC seconds of the route lookup; reused while younger
    /// than `XDP_NEXTHOP_TTL_S`.
    pub checked_s: u32,
}

/// The view of cached next hops, ordered by flow.
pub fn next_hop_views(entries: &[(pc::XdpNextHopKey, pc::XdpNextHopValue)]) -> Vec<NextHopView> {
    let mac = |m: &[u8; 6]| m.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":");
    let mut out: Vec<NextHopView> = entries
        .iter()
        .map(|(k, v)| {
            let protocol = protocol_name(k.proto);
            NextHopView {
                flow: format!(
                    "{protocol} {} -> {}",
                    endpoint(k.saddr_be, k.sport_be, k.family),
                    endpoint(k.daddr_be, k.dport_be, k.family)
                ),
                ingress_ifindex: k.ingress_ifindex,
                ifindex: v.ifindex,
                dmac: mac(&v.dmac),
                smac: mac(&v.smac),
                max_len: v.max_len_host,
                checked_s: v.checked_s,
            }
        })
        .collect();
    out.sort_by(|a, b| (&a.flow, a.ingress_ifindex).cmp(&(&b.flow, b.ingress_ifindex)));
    out
}

#[derive(Clone, Copy, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct PortBitsView {
    pub ingress_ports: usize,
    pub egress_ports: usize,
}

/// `TCP`, `UDP`, or `proto N`, as conntrack and next-hop entries show it.
fn protocol_name(proto: u8) -> String {
    match proto {
        pc::PROTO_TCP => "TCP".to_string(),
        pc::PROTO_UDP => "UDP".to_string(),
        p => format!("proto {p}"),
    }
}

fn endpoint(ip_be: [u32; 4], port_be: u16, family: u8) -> String {
    match backend_of(&BackendValue { ip_be, port_be, family, tier: 0 }) {
        Some(b) => b.to_string(),
        None => format!("family {family} {ip_be:08x?}:{}", u16::from_be(port_be)),
    }
}

fn ct_flag_names(flags: u32) -> Vec<&'static str> {
    [
        (pc::CT_FLAG_SNAT, "snat"),
        (pc::CT_FLAG_CLOSING, "closing"),
        (pc::CT_FLAG_FIN_CLIENT, "fin-client"),
        (pc::CT_FLAG_FIN_BACKEND, "fin-backend"),
    ]
    .into_iter()
    .filter(|(bit, _)| flags & bit != 0)
    .map(|(_, n)| n)
    .collect()
}

/// Decodes the `NP_*` maps and applies the consistency rules: those of the
/// socket maps to NP_SERVICES/NP_SLOTS/NP_BACKENDS, plus policy flags
/// without a frontend, conntrack entries naming a backend that is gone or
/// holding what the programs never write, and an empty SNAT port range.
pub fn check_nodeport(np: &NpSnapshot) -> (NodePortReport, Vec<Finding>) {
    let a = check_maps(&TC_SERVICE_MAPS, &np.services, &np.slots, &np.backends);
    let mut findings = a.findings;
    let mut views = a.services;
    let (affinity, policy_findings) = check_policies(&TC_SERVICE_MAPS, &np.services, &np.backends, &np.policy, &mut views);
    findings.extend(policy_findings);
    let tc = |kind, message| Finding { datapath: DATAPATH_TC, ..Finding::new(kind, message) };

    let flags: BTreeMap<ServiceKey, u32> = np.flags.iter().map(|(k, v)| (*k, v.flags)).collect();
    let services: BTreeSet<ServiceKey> = np.services.iter().map(|(k, _)| *k).collect();
    let keys_by_name: BTreeMap<String, ServiceKey> =
        np.services.iter().map(|(k, _)| (frontend_of(k).map_or_else(|| raw_key(k), |f| f.to_string()), *k)).collect();
    for v in &mut views {
        let local = keys_by_name.get(&v.frontend).and_then(|k| flags.get(k)).is_some_and(|f| f & pc::NP_FLAG_POLICY_LOCAL != 0);
        v.external_traffic_policy = Some(if local { "Local" } else { "Cluster" });
    }
    for k in flags.keys().filter(|k| !services.contains(k)) {
        let name = frontend_of(k).map_or_else(|| raw_key(k), |f| f.to_string());
        findings.push(tc(
            FindingKind::OrphanFlags,
            format!("{}: policy flags for {name}, which is not in {}", pc::NP_FLAGS_MAP, pc::NP_SERVICES_MAP),
        ));
    }

    let backends: BTreeMap<u32, &BackendValue> = np.backends.iter().map(|(k, v)| (k.backend_id, v)).collect();
    let mut conntrack = Vec::with_capacity(np.conntrack.len());
    for (k, v) in &np.conntrack {
        let direction = match k.dir {
            pc::CT_DIR_FORWARD => "forward".to_string(),
            pc::CT_DIR_REPLY => "reply".to_string(),
            pc::CT_DIR_SNAT => "snat".to_string(),
            pc::CT_DIR_REPLY_SNAT => "reply-snat".to_string(),
            d => format!("dir {d}"),
        };
        let protocol = protocol_name(k.proto);
        let tuple = format!("{} -> {}", endpoint(k.saddr_be, k.sport_be, k.family), endpoint(k.daddr_be, k.dport_be, k.family));
        let translated = format!("{} -> {}", endpoint(v.saddr_be, v.sport_be, k.family), endpoint(v.daddr_be, v.dport_be, k.family));
        let known = k.dir <= pc::CT_DIR_REPLY_SNAT
            && (k.proto == pc::PROTO_TCP || k.proto == pc::PROTO_UDP)
            && (k.family == pc::FAMILY_V4 || k.family == pc::FAMILY_V6);
        if !known {
            findings.push(tc(
                FindingKind::UnknownConntrackEntry,
                format!("{}: entry {direction} {protocol} family {} {tuple} is nothing the TC programs write", pc::NP_CT_MAP, k.family),
            ));
        } else if k.dir == pc::CT_DIR_FORWARD {
            // The datapath's own test (backend_alive in nodeport.rs).
            let alive = backends.get(&v.backend_id).is_some_and(|b| b.ip_be == v.daddr_be && b.port_be == v.dport_be);
            if !alive {
                findings.push(
                    tc(
                        FindingKind::StaleFlow,
                        format!(
                            "{}: flow {protocol} {tuple} names backend #{} ({}), which is not in {}; its next packet picks another backend and the conntrack GC removes it",
                            pc::NP_CT_MAP,
                            v.backend_id,
                            endpoint(v.daddr_be, v.dport_be, k.family),
                            pc::NP_BACKENDS_MAP
                        ),
                    )
                    .backend(v.backend_id),
                );
            }
        }
        if known && let Some(ports) = &np.ports {
            let mut needs = PortSet::default();
            needs.insert_conntrack(k);
            if !ports.covers(&needs) {
                findings.push(tc(
                    FindingKind::MissingPortBit,
                    format!(
                        "{}: flow {direction} {protocol} {tuple} uses a port without its bit; its packets pass untranslated",
                        pc::NP_PORTS_MAP
                    ),
                ));
            }
        }
        conntrack.push(CtView {
            direction,
            protocol,
            tuple,
            translated,
            backend_id: v.backend_id,
            flags: ct_flag_names(v.flags),
            seen_s: v.seen_s,
            age_seconds: np.now_s.map(|now| now.saturating_sub(v.seen_s)),
        });
    }

    let config = np.config.map(|c| {
        let v4 = (c.snat_v4_be != 0).then(|| std::net::Ipv4Addr::from(c.snat_v4_be.to_ne_bytes()).to_string());
        let v6 = (c.snat_v6_be != [0; 4]).then(|| ip_of(c.snat_v6_be, pc::FAMILY_V6)).flatten().map(|ip| ip.to_string());
        // An all-zero config is "no TC datapath configured", not an error.
        if (v4.is_some() || v6.is_some()) && (c.snat_port_min == 0 || c.snat_port_min > c.snat_port_max) {
            findings.push(tc(
                FindingKind::BadSnatConfig,
                format!(
                    "{}: SNAT port range {}-{} is empty; flows to backends on other nodes pass untranslated",
                    pc::NP_CONFIG_MAP,
                    c.snat_port_min,
                    c.snat_port_max
                ),
            ));
        }
        NpConfigView { snat_v4: v4, snat_v6: v6, snat_port_min: c.snat_port_min, snat_port_max: c.snat_port_max }
    });
    let mut local_endpoints: Vec<String> = np
        .local
        .iter()
        .map(|(k, _)| match ip_of(k.ip_be, k.family) {
            Some(ip) => ip.to_string(),
            None => format!("family {} {:08x?}", k.family, k.ip_be),
        })
        .collect();
    local_endpoints.sort();
    if let Some(ports) = &np.ports {
        for (k, _) in &np.services {
            if !ports.contains(u16::from_be(k.port_be), false) {
                let name = frontend_of(k).map_or_else(|| raw_key(k), |f| f.to_string());
                findings.push(tc(
                    FindingKind::MissingPortBit,
                    format!("{}: frontend {name} has no bit for its port; its packets pass untranslated", pc::NP_PORTS_MAP),
                ));
            }
        }
        for (k, v) in &np.backends {
            if !ports.contains(u16::from_be(v.port_be), true) {
                findings.push(
                    tc(
                        FindingKind::MissingPortBit,
                        format!(
                            "{}: backend #{} ({}) has no egress bit for its port; its replies pass untranslated",
                            pc::NP_PORTS_MAP,
                            k.backend_id,
                            endpoint(v.ip_be, v.port_be, v.family)
                        ),
                    )
                    .backend(k.backend_id),
                );
            }
        }
    }
    sort_findings(&mut findings);
    let port_bits = np.ports.as_ref().map(|p| {
        let (ingress_ports, egress_ports) = p.counts();
        PortBitsView { ingress_ports, egress_ports }
    });
    let report = NodePortReport {
        config,
        services: views,
        backends: a.backends,
        local_endpoints,
        conntrack,
        counters: named_np_counters(&np.counters),
        affinity,
        port_bits,
        xdp_devices: Vec::new(),
        xdp_next_hops: Vec::new(),
        fast_path: named(&np.fast_counters, &pc::np_fast_counter::NAMES),
        peer_devices: np.peer_devices.clone(),
    };
    (report, findings)
}

/// What `proxy-agent dump --output json` prints. Field names are part of
/// the command's interface: add fields, never rename them.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Report {
    pub pin_dir: String,
    /// No findings at all.
    pub consistent: bool,
    pub maps: Vec<MapUsage>,
    pub services: Vec<ServiceView>,
    pub backends: Vec<BackendView>,
    pub counters: BTreeMap<String, u64>,
    /// AFFINITY: each client's backend per affine frontend.
    pub affinity: Vec<AffinityView>,
    /// Findings about both datapaths (`datapath` says which).
    pub findings: Vec<Finding>,
    /// The TC datapath (NodePort, LoadBalancer IPs, externalIPs); absent
    /// when its maps are not pinned.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nodeport: Option<NodePortReport>,
    /// Bytes of backend ids in the Maglev tables of both datapaths, each
    /// array counted once (frontends with the same backends share one).
    pub maglev_table_bytes: u64,
    /// SOCK_PORTS: destination ports whose calls the socket programs look
    /// up in SERVICES; absent when the map is not pinned.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub socket_port_bits: Option<usize>,
    /// Which record each translated connect() took: one line per socket
    /// recorded in `SOCK_REC` (path `sock_rec`), and how many connects
    /// found it full and were recorded in their socket's storage instead
    /// (path `socket_storage`, `sock_record_full`; socket storage cannot
    /// be listed from the maps).
    pub sockets: SocketsView,
}

/// Sockets by the record their connect() took.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct SocketsView {
    pub records: Vec<SocketRecordView>,
    /// Connects recorded in socket storage because `SOCK_REC` was full
    /// (the `sock_record_full` counter).
    pub socket_storage_fallbacks: u64,
}

#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct SocketRecordView {
    pub cookie: u64,
    pub protocol: String,
    pub frontend: String,
    pub backend: String,
    pub service_id: u32,
    /// `sock_rec`: the record is in `SOCK_REC`.
    pub path: &'static str,
}

fn sockets_view(snap: &Snapshot) -> SocketsView {
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

pub fn report(pin_dir: &Path, snap: &Snapshot) -> Report {
    let a = check(&snap.services, &snap.slots, &snap.backends);
    let mut findings = a.findings;
    let mut services = a.services;
    let (affinity, policy_findings) = check_policies(&SOCKET_SERVICE_MAPS, &snap.services, &snap.backends, &snap.policy, &mut services);
    findings.extend(policy_findings);
    if let Some(ports) = &snap.socket_ports {
        findings.extend(missing_socket_port_bits(&snap.services, ports));
    }
    let nodeport = snap.nodeport.as_ref().map(|np| {
        let (mut r, f) = check_nodeport(np);
        findings.extend(f);
        r.xdp_devices = crate::datapath::xdp_loader::attached_devices(pin_dir);
        match crate::datapath::xdp_loader::next_hops(pin_dir) {
            Ok(entries) => r.xdp_next_hops = next_hop_views(&entries),
            Err(e) => tracing::debug!(error = %e, "XDP next hops not read"),
        }
        r
    });
    sort_findings(&mut findings);
    let maglev_table_bytes = snap.maglev_table_bytes + snap.nodeport.as_ref().map_or(0, |np| np.maglev_table_bytes);
    Report {
        pin_dir: pin_dir.display().to_string(),
        consistent: findings.is_empty(),
        maps: snap.maps.clone(),
        services,
        backends: a.backends,
        counters: named_counters(&snap.counters),
        affinity,
        findings,
        nodeport,
        maglev_table_bytes,
        socket_port_bits: snap.socket_ports.as_ref().map(|p| p.counts().0),
        sockets: sockets_view(snap),
    }
}

/// Frontends in `SERVICES` whose destination port has no bit in
/// `SOCK_PORTS`: the socket programs pass their calls untranslated.
fn missing_socket_port_bits(services: &[(ServiceKey, ServiceValue)], ports: &PortSet) -> Vec<Finding> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datapath::keys::{backend_value, service_key};
    use crate::model::{Backend, Frontend, Protocol};

    fn fe(s: &str, port: u16) -> ServiceKey {
        service_key(&Frontend { ip: s.parse().expect("literal"), port, protocol: Protocol::Tcp })
    }
    fn svc(id: u32, count: u32, generation: u32) -> ServiceValue {
        ServiceValue { service_id: id, backend_count: count, generation, flags: 0 }
    }
    fn slot(id: u32, generation: u32, slot: u32, backend: u32) -> (SlotKey, SlotValue) {
        (SlotKey { service_id: id, generation, slot }, SlotValue { backend_id: backend })
    }
    fn be(id: u32, ip: &str) -> (BackendKey, BackendValue) {
        (BackendKey { backend_id: id }, backend_value(&Backend { ip: ip.parse().expect("literal"), port: 8080 }))
    }
    fn kinds(a: &Analysis) -> Vec<FindingKind> {
        a.findings.iter().map(|f| f.kind).collect()
    }

    type Entries = (Vec<(ServiceKey, ServiceValue)>, Vec<(SlotKey, SlotValue)>, Vec<(BackendKey, BackendValue)>);

    /// Two frontends sharing one backend, as the writer leaves them.
    fn healthy() -> Entries {
        (
            vec![(fe("10.96.0.10", 80), svc(1, 2, 3)), (fe("10.96.0.11", 53), svc(2, 1, 1))],
            vec![slot(1, 3, 0, 10), slot(1, 3, 1, 11), slot(2, 1, 0, 11)],
            vec![be(10, "10.244.1.2"), be(11, "10.244.1.3")],
        )
    }

    #[test]
    fn a_consistent_state_has_no_findings() {
        let (s, sl, b) = healthy();
        let a = check(&s, &sl, &b);
        assert_eq!(a.findings, vec![]);
        assert_eq!(a.services.len(), 2);
        assert_eq!(a.services[0].frontend, "10.96.0.10:80/TCP");
        assert_eq!(
            a.services[0].slots,
            vec![
                SlotView { slot: 0, backend_id: Some(10), backend: Some("10.244.1.2:8080".into()) },
                SlotView { slot: 1, backend_id: Some(11), backend: Some("10.244.1.3:8080".into()) },
            ]
        );
        assert_eq!(a.backends.iter().map(|b| (b.backend_id, b.slots)).collect::<Vec<_>>(), vec![(10, 1), (11, 2)]);
        // A service with no backends is consistent too (connections refused).
        let a = check(&[(fe("10.96.0.12", 80), svc(3, 0, 1))], &[], &[]);
        assert_eq!(a.findings, vec![]);
        assert!(a.services[0].slots.is_empty());
    }

    #[test]
    fn a_slot_naming_a_missing_backend_is_an_error() {
        let (s, sl, mut b) = healthy();
        b.retain(|(k, _)| k.backend_id != 10);
        let a = check(&s, &sl, &b);
        assert_eq!(kinds(&a), vec![FindingKind::MissingBackend]);
        let f = &a.findings[0];
        assert_eq!((f.severity, f.service_id, f.generation, f.slot, f.backend_id), (Severity::Error, Some(1), Some(3), Some(0), Some(10)));
        assert!(f.message.contains("10.96.0.10:80/TCP"), "{}", f.message);
        assert_eq!(a.services[0].slots[0].backend, None);
    }

    #[test]
    fn a_count_larger_than_the_slots_written_is_an_error() {
        let (mut s, mut sl, b) = healthy();
        s[0].1.backend_count = 4; // slots 2 and 3 do not exist
        sl.retain(|(k, _)| !(k.service_id == 1 && k.slot == 0)); // nor does 0 any more
        let a = check(&s, &sl, &b);
        let missing: Vec<Option<u32>> = a.findings.iter().filter(|f| f.kind == FindingKind::MissingSlot).map(|f| f.slot).collect();
        assert_eq!(missing, vec![Some(0), Some(2), Some(3)]);
        assert_eq!(
            a.services[0].slots.iter().map(|v| (v.slot, v.backend_id)).collect::<Vec<_>>(),
            vec![(0, None), (1, Some(11)), (2, None), (3, None)]
        );
        // Backend 10 lost its only slot.
        assert!(kinds(&a).contains(&FindingKind::UnreferencedBackend));
    }

    #[test]
    fn a_huge_corrupt_count_is_summarised() {
        let a = check(&[(fe("10.96.0.10", 80), svc(1, u32::MAX, 1))], &[slot(1, 1, 5, 10)], &[be(10, "10.244.1.2")]);
        let missing: Vec<&Finding> = a.findings.iter().filter(|f| f.kind == FindingKind::MissingSlot).collect();
        assert_eq!(missing.len(), MISSING_SLOTS_LISTED + 1);
        let last = missing.iter().find(|f| f.slot.is_none()).expect("summary finding");
        // u32::MAX slots, one present, 16 listed.
        assert!(last.message.contains(&format!("{} more", u32::MAX as usize - 1 - MISSING_SLOTS_LISTED)), "{}", last.message);
    }

    #[test]
    fn stale_generations_and_strays_are_orphans() {
        let (s, mut sl, b) = healthy();
        sl.push(slot(1, 2, 0, 10)); // the previous generation, left by a killed agent
        sl.push(slot(1, 2, 1, 10));
        sl.push(slot(2, 1, 7, 11)); // beyond the count
        sl.push(slot(9, 1, 0, 10)); // no such service
        let a = check(&s, &sl, &b);
        let orphans: Vec<(Option<u32>, Option<u32>, &str)> = a
            .findings
            .iter()
            .filter(|f| f.kind == FindingKind::OrphanSlots)
            .map(|f| (f.service_id, f.generation, f.message.as_str()))
            .collect();
        assert_eq!(orphans.len(), 3, "{orphans:?}");
        assert!(orphans[0].2.starts_with("2 slot(s) of service id 1 generation 2") && orphans[0].2.contains("at generation 3"));
        assert!(orphans[1].2.contains("beyond the service's backend count"));
        assert!(orphans[2].2.contains("no service entry has this id"));
        assert!(a.findings.iter().all(|f| f.severity == Severity::Warning));
        // Orphan slots do not count as references.
        assert_eq!(a.backends.iter().map(|b| b.slots).collect::<Vec<_>>(), vec![1, 2]);
    }

    #[test]
    fn unreferenced_backends_are_warnings() {
        let (s, sl, mut b) = healthy();
        b.push(be(12, "10.244.9.9"));
        let a = check(&s, &sl, &b);
        assert_eq!(kinds(&a), vec![FindingKind::UnreferencedBackend]);
        assert_eq!(a.findings[0].backend_id, Some(12));
        assert_eq!(a.findings[0].severity, Severity::Warning);
    }

    #[test]
    fn unknown_encodings_duplicates_and_family_mismatches_are_errors() {
        let (mut s, sl, mut b) = healthy();
        let mut odd = fe("10.96.0.99", 80);
        odd.proto = 1; // ICMP: never written by the agent
        s.push((odd, svc(3, 0, 1)));
        b[0].1.family = 7;
        let a = check(&s, &sl, &b);
        assert!(kinds(&a).contains(&FindingKind::UnknownServiceKey));
        assert!(kinds(&a).contains(&FindingKind::UnknownBackendEncoding));
        assert_eq!(a.services.last().map(|v| v.frontend.contains("proto=1")), Some(true));

        let (mut s, sl, b) = healthy();
        s[1].1.service_id = 1; // two frontends on one slot set
        s[1].1.generation = 3;
        s[1].1.backend_count = 2;
        let a = check(&s, &sl, &b);
        assert!(kinds(&a).contains(&FindingKind::DuplicateServiceId), "{:?}", a.findings);

        let (s, sl, mut b) = healthy();
        b[1] = (BackendKey { backend_id: 11 }, backend_value(&Backend { ip: "fd00::3".parse().expect("literal"), port: 8080 }));
        let a = check(&s, &sl, &b);
        assert_eq!(kinds(&a), vec![FindingKind::FamilyMismatch, FindingKind::FamilyMismatch]);
    }

    #[test]
    fn findings_list_errors_first() {
        let (s, mut sl, mut b) = healthy();
        b.push(be(12, "10.244.9.9")); // warning
        sl.retain(|(k, _)| k.service_id != 2); // error: missing slot
        let a = check(&s, &sl, &b);
        assert_eq!(a.findings.first().map(|f| f.severity), Some(Severity::Error));
        assert_eq!(a.findings.last().map(|f| f.severity), Some(Severity::Warning));
    }

    fn ct(dir: u8, s: (&str, u16), d: (&str, u16), to: ((&str, u16), (&str, u16)), backend_id: u32) -> (CtKey, CtValue) {
        let a = |ip: &str, port: u16| backend_value(&Backend { ip: ip.parse().expect("literal"), port });
        let (ks, kd, vs, vd) = (a(s.0, s.1), a(d.0, d.1), a(to.0.0, to.0.1), a(to.1.0, to.1.1));
        (
            CtKey {
                saddr_be: ks.ip_be,
                daddr_be: kd.ip_be,
                sport_be: ks.port_be,
                dport_be: kd.port_be,
                proto: pc::PROTO_TCP,
                family: ks.family,
                dir,
                _pad: 0,
            },
            CtValue {
                saddr_be: vs.ip_be,
                daddr_be: vd.ip_be,
                sport_be: vs.port_be,
                dport_be: vd.port_be,
                flags: pc::CT_FLAG_CLOSING,
                backend_id,
                seen_s: 90,
            },
        )
    }

    fn healthy_np() -> NpSnapshot {
        let (services, slots, backends) = healthy();
        let local = fe("10.96.0.10", 80);
        NpSnapshot {
            services,
            slots,
            backends,
            flags: vec![(local, NpFlagsValue { flags: pc::NP_FLAG_POLICY_LOCAL })],
            local: vec![(AddrKey::new(be(10, "10.244.1.2").1.ip_be, pc::FAMILY_V4), 1)],
            conntrack: vec![
                ct(pc::CT_DIR_FORWARD, ("10.0.0.1", 40000), ("10.96.0.10", 80), (("10.0.0.1", 40000), ("10.244.1.2", 8080)), 10),
                ct(pc::CT_DIR_REPLY, ("10.244.1.2", 8080), ("10.0.0.1", 40000), (("10.96.0.10", 80), ("10.0.0.1", 40000)), 10),
            ],
            fast_counters: Vec::new(),
            peer_devices: Vec::new(),
            config: Some(NpConfig {
                snat_v4_be: u32::from_ne_bytes([10, 0, 3, 1]),
                snat_port_min: 61000,
                snat_port_max: 65535,
                ..Default::default()
            }),
            counters: vec![3, 7],
            now_s: Some(100),
            policy: PolicySnapshot::default(),
            maglev_table_bytes: 0,
            ports: Some({
                let mut p = PortSet::base();
                p.insert_frontend(80);
                p.insert_frontend(53);
                p.insert_backend(8080);
                p
            }),
        }
    }

    #[test]
    fn the_tc_maps_are_decoded() {
        let (r, findings) = check_nodeport(&healthy_np());
        assert_eq!(findings, vec![]);
        assert_eq!(r.services[0].frontend, "10.96.0.10:80/TCP");
        assert_eq!(r.services[0].external_traffic_policy, Some("Local"));
        assert_eq!(r.services[1].external_traffic_policy, Some("Cluster"));
        assert_eq!(r.local_endpoints, vec!["10.244.1.2"]);
        assert_eq!(r.config.as_ref().and_then(|c| c.snat_v4.clone()), Some("10.0.3.1".into()));
        assert_eq!(r.counters["new_flow"], 3);
        assert_eq!(r.counters["tracked"], 7);
        let fwd = &r.conntrack[0];
        assert_eq!(
            (fwd.direction.as_str(), fwd.protocol.as_str(), fwd.tuple.as_str(), fwd.translated.as_str()),
            ("forward", "TCP", "10.0.0.1:40000 -> 10.96.0.10:80", "10.0.0.1:40000 -> 10.244.1.2:8080")
        );
        assert_eq!((fwd.flags.clone(), fwd.age_seconds), (vec!["closing"], Some(10)));
        assert_eq!(r.conntrack[1].direction, "reply");
        assert_eq!(r.port_bits, Some(PortBitsView { ingress_ports: 2, egress_ports: 2 }));
    }

    #[test]
    fn tc_inconsistencies_are_found() {
        // (name, corruption, expected kind)
        type Corrupt = fn(&mut NpSnapshot);
        let cases: [(&str, Corrupt, FindingKind); 8] = [
            ("slot naming a missing backend", |np| np.backends.retain(|(k, _)| k.backend_id != 10), FindingKind::MissingBackend),
            ("flags without a frontend", |np| np.services.retain(|(k, _)| *k != fe("10.96.0.10", 80)), FindingKind::OrphanFlags),
            ("flow to a removed backend", |np| np.conntrack[0].1.backend_id = 12, FindingKind::StaleFlow),
            ("flow to a backend id now at another address", |np| np.conntrack[0].1.dport_be = 9u16.to_be(), FindingKind::StaleFlow),
            ("unknown direction", |np| np.conntrack[1].0.dir = 9, FindingKind::UnknownConntrackEntry),
            ("a frontend's port without its bit", |np| np.ports = Some(PortSet::base()), FindingKind::MissingPortBit),
            (
                "a flow's port without its bit",
                |np| {
                    let mut p = PortSet::base();
                    p.insert_frontend(80);
                    p.insert_frontend(53);
                    p.insert_backend(8080);
                    np.ports = Some(p);
                    np.conntrack[0].0.dport_be = 81u16.to_be();
                },
                FindingKind::MissingPortBit,
            ),
            (
                "empty SNAT port range",
                |np| {
                    if let Some(c) = np.config.as_mut() {
                        c.snat_port_min = 65000;
                        c.snat_port_max = 64000;
                    }
                },
                FindingKind::BadSnatConfig,
            ),
        ];
        for (name, corrupt, kind) in cases {
            let mut np = healthy_np();
            corrupt(&mut np);
            let (_, findings) = check_nodeport(&np);
            assert!(findings.iter().any(|f| f.kind == kind && f.datapath == DATAPATH_TC), "{name}: {findings:?}");
            if kind == FindingKind::MissingBackend {
                assert!(findings.iter().any(|f| f.message.contains("not in NP_BACKENDS")), "{name}: {findings:?}");
            }
        }
        // No TC datapath configured: an all-zero NP_CONFIG is fine.
        let mut np = healthy_np();
        np.config = Some(NpConfig::default());
        assert_eq!(check_nodeport(&np).1, vec![]);
    }

    #[test]
    fn reports_merge_both_datapaths_findings_errors_first() {
        let (services, slots, backends) = healthy();
        let mut np = healthy_np();
        np.conntrack[0].1.backend_id = 12; // warning
        let mut snap = Snapshot { services, slots, backends, nodeport: Some(np), ..Snapshot::default() };
        snap.backends.retain(|(k, _)| k.backend_id != 10); // socket error
        let r = report(Path::new("/x"), &snap);
        assert!(!r.consistent);
        assert_eq!((r.findings[0].datapath, r.findings[0].severity), (DATAPATH_SOCKET, Severity::Error));
        assert_eq!(r.findings.last().map(|f| (f.datapath, f.kind)), Some((DATAPATH_TC, FindingKind::StaleFlow)));
        assert!(r.nodeport.is_some());
    }

    #[test]
    fn affinity_and_source_ranges_are_decoded_and_checked() {
        let (mut s, sl, b) = healthy();
        // 10.96.0.10:80 (id 1, generation 3, backends #10 and #11) is
        // affine; 10.96.0.11:53 (id 2) filtered, with the node allowed.
        s[0].1.flags = pc::SVC_FLAG_AFFINITY;
        s[1].1.flags = pc::SVC_FLAG_SOURCE_RANGES | pc::SVC_FLAG_SOURCE_RANGES_NODE;
        let m = |sid, generation, backend_id, timeout_s| {
            (AffinityMatchKey { service_id: sid, generation, backend_id }, AffinityMatchValue { timeout_s })
        };
        let range = |sid, generation, text: &str| {
            let k = crate::datapath::keys::source_range_key(sid, generation, &crate::model::Cidr::parse(text).expect("literal"));
            (k.prefix_len(), k.data())
        };
        let s_ns = 1_000_000_000u64;
        let entry = |backend_id, last_used_ns| AffinityValue { last_used_ns, backend_id, _pad: 0 };
        let p = PolicySnapshot {
            matches: vec![m(1, 3, 10, 2), m(1, 3, 11, 2), m(1, 2, 10, 2)],
            ranges: vec![range(2, 1, "10.0.0.0/8"), range(2, 1, "192.0.2.0/24")],
            clients: vec![
                (1, "netns 7".into(), entry(10, 99 * s_ns)),
                (1, "netns 8".into(), entry(11, 90 * s_ns)),
                (1, "netns 9".into(), entry(12, 99 * s_ns)),
            ],
            now_ns: Some(100 * s_ns),
        };
        let mut views = check(&s, &sl, &b).services;
        let (clients, findings) = check_policies(&SOCKET_SERVICE_MAPS, &s, &b, &p, &mut views);
        assert_eq!(views[0].affinity_timeout_seconds, Some(2));
        assert_eq!(views[1].source_ranges, Some(vec!["10.0.0.0/8".to_string(), "192.0.2.0/24".to_string()]));
        assert!(views[1].source_ranges_node && views[0].source_ranges.is_none());
        // Fresh and listed; expired; a backend the frontend does not use.
        let honoured: Vec<(&str, bool)> = clients.iter().map(|c| (c.client.as_str(), c.honoured)).collect();
        assert_eq!(honoured, [("netns 7", true), ("netns 8", false), ("netns 9", false)]);
        assert_eq!(
            (clients[0].frontend.as_str(), clients[0].backend.as_deref(), clients[0].idle_ms),
            ("10.96.0.10:80/TCP", Some("10.244.1.2:8080"), Some(1000))
        );
        // The previous generation's match entry is left over.
        assert_eq!(findings.iter().map(|f| (f.kind, f.generation)).collect::<Vec<_>>(), [(FindingKind::OrphanPolicyEntries, Some(2))]);

        // A backend without its match entry loses its clients' affinity.
        let p = PolicySnapshot { matches: vec![m(1, 3, 10, 2)], ..p };
        let mut views = check(&s, &sl, &b).services;
        let (_, findings) = check_policies(&SOCKET_SERVICE_MAPS, &s, &b, &p, &mut views);
        let missing: Vec<(FindingKind, Severity, Option<u32>)> = findings.iter().map(|f| (f.kind, f.severity, f.backend_id)).collect();
        assert_eq!(missing, [(FindingKind::MissingAffinityMatch, Severity::Error, Some(11))]);
    }

    #[test]
    fn counters_are_named() {
        let named = named_counters(&[5, 0, 1, 0, 2, 0, 0, 0]);
        assert_eq!(named["translated"], 5);
        assert_eq!(named["slot_miss"], 1);
        assert_eq!(named["reversed"], 2);
        assert_eq!(named.len(), 8);
        assert_eq!(named_counters(&[0; 16])["affinity_hit"], 0);
    }
}
