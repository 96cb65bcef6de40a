//! Reading the pinned maps as raw entries ([`Snapshot`]), read-only and
//! bounded, with each map's usage.

use std::collections::BTreeMap;
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
};
use serde::Serialize;

use crate::datapath::conntrack::conntrack_gc::monotonic_now_s;
use crate::datapath::loader::pins;
use crate::datapath::maps::bpf_batch::read_all;
use crate::datapath::maps::keys::ip_of;
use crate::datapath::maps::port_bits::{Bitmap, PortSet};
use crate::datapath::maps::{self, MapSpec, SOCKET_SERVICE_MAPS, ServiceMaps, TC_SERVICE_MAPS};

// The cause is part of each message and deliberately not a `source`:
// `main` prints error chains, which would repeat it.
/// Why the maps could not be read.
#[derive(Debug, thiserror::Error)]
pub enum DumpError {
    /// A pin could not be opened.
    #[error("cannot open pinned map {path}: {error}. Is the agent installed with this --bpffs, and do we have CAP_BPF?")]
    Open {
        /// The pin.
        path: PathBuf,
        /// The error.
        error: io::Error,
    },
    /// A pin holds a map of another kind than expected.
    #[error("pinned map {path} is not what this agent expects: {error}")]
    Kind {
        /// The pin.
        path: PathBuf,
        /// The error.
        error: MapError,
    },
    /// A map could not be read.
    #[error("reading map {map}: {error}")]
    Read {
        /// The map.
        map: &'static str,
        /// The error.
        error: MapError,
    },
}

/// Everything the maps hold, as raw entries.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    /// SERVICES.
    pub services: Vec<(ServiceKey, ServiceValue)>,
    /// SLOTS.
    pub slots: Vec<(SlotKey, SlotValue)>,
    /// BACKENDS.
    pub backends: Vec<(BackendKey, BackendValue)>,
    /// Per-CPU values summed, indexed by counter id.
    pub counters: Vec<u64>,
    /// Each map's entries and capacity.
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
    /// The affinity match entries.
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
    /// NP_SERVICES.
    pub services: Vec<(ServiceKey, ServiceValue)>,
    /// NP_SLOTS.
    pub slots: Vec<(SlotKey, SlotValue)>,
    /// NP_BACKENDS.
    pub backends: Vec<(BackendKey, BackendValue)>,
    /// NP_FLAGS.
    pub flags: Vec<(ServiceKey, NpFlagsValue)>,
    /// NP_LOCAL.
    pub local: Vec<(AddrKey, u32)>,
    /// NP_CT.
    pub conntrack: Vec<(CtKey, CtValue)>,
    /// NP_CONFIG's one element.
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

/// One map's use against its capacity.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct MapUsage {
    /// The map's name (its pin's name).
    pub name: &'static str,
    /// Entries it holds.
    pub entries: u64,
    /// Its capacity (`max_entries`).
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

pub(super) fn open(pin_dir: &Path, spec: &MapSpec) -> Result<(Map, u32), DumpError> {
    let path = pins::map(pin_dir, spec.name);
    let fd = open_read_only(&path).map_err(|error| DumpError::Open { path: path.clone(), error })?;
    let kind = |error| DumpError::Kind { path: path.clone(), error };
    let data = MapData::from_fd(fd).map_err(kind)?;
    let max = data.info().map_err(kind)?.max_entries();
    Ok((Map::from_map_data(data).map_err(kind)?, max))
}

/// Entries of a hash map (plain or LRU), in no particular order, through
/// the bounded [`read_all`]: a map that a live agent or the datapath keeps
/// changing cannot keep the dump from finishing. Records the map's usage.
pub(super) fn hash_entries<K: Pod + Eq + Hash, V: Pod>(
    pin_dir: &Path,
    spec: &'static MapSpec,
    maps: &mut Vec<MapUsage>,
) -> Result<Vec<(K, V)>, DumpError> {
    let (map, max) = open(pin_dir, spec)?;
    let hash: HashMap<MapData, K, V> =
        HashMap::try_from(map).map_err(|error| DumpError::Kind { path: pins::map(pin_dir, spec.name), error })?;
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
    if !pins::map(pin_dir, spec.name).exists() {
        return Ok(0);
    }
    let (map, max) = open(pin_dir, spec)?;
    let outer: HashOfMaps<MapData, pc::MaglevKey, MapData> =
        HashOfMaps::try_from(map).map_err(|error| DumpError::Kind { path: pins::map(pin_dir, spec.name), error })?;
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
pub(super) fn counter_sums(pin_dir: &Path, spec: &'static MapSpec, maps: &mut Vec<MapUsage>) -> Result<Vec<u64>, DumpError> {
    let (map, max) = open(pin_dir, spec)?;
    let arr = PerCpuArray::<MapData, u64>::try_from(map).map_err(|error| DumpError::Kind { path: pins::map(pin_dir, spec.name), error })?;
    let mut sums = Vec::with_capacity(max as usize);
    for i in 0..max {
        let per_cpu = arr.get(&i, 0).map_err(|error| DumpError::Read { map: spec.name, error })?;
        sums.push(per_cpu.iter().fold(0u64, |a, v| a.wrapping_add(*v)));
    }
    maps.push(MapUsage { name: spec.name, entries: u64::from(max), max_entries: max });
    Ok(sums)
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
    if pins::map(pin_dir, maps::SOCK_REC.name).exists() {
        snap.socket_records = sorted_entries(pin_dir, &maps::SOCK_REC, usage)?;
    }
    snap.counters = counter_sums(pin_dir, &maps::COUNTERS, usage)?;
    snap.maglev_table_bytes = maglev_usage(pin_dir, &maps::SOCK_MAGLEV, usage)?;
    snap.socket_ports = read_ports(pin_dir, &maps::SOCK_PORTS, Bitmap::Socket)?;
    snap.policy =
        read_policy::<SockAffinityKey>(pin_dir, &SOCKET_SERVICE_MAPS, usage, |k| (k.scope_id, format!("netns {}", k.netns_cookie)))?;
    if pins::map(pin_dir, maps::NP_SERVICES.name).exists() {
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
    if !pins::map(pin_dir, names.affinity_match.name).exists() {
        return Ok(PolicySnapshot::default());
    }
    let matches = sorted_entries(pin_dir, names.affinity_match, usage)?;
    let (map, max) = open(pin_dir, names.source_ranges)?;
    let path = pins::map(pin_dir, names.source_ranges.name);
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
    let config = Array::<MapData, NpConfig>::try_from(map)
        .map_err(|error| DumpError::Kind { path: pins::map(pin_dir, pc::NP_CONFIG_MAP), error })?;
    np.config = Some(config.get(&0, 0).map_err(|error| DumpError::Read { map: pc::NP_CONFIG_MAP, error })?);
    usage.push(MapUsage { name: pc::NP_CONFIG_MAP, entries: u64::from(max), max_entries: max });
    np.counters = counter_sums(pin_dir, &maps::NP_COUNTERS, usage)?;
    if pins::map(pin_dir, maps::NP_FAST_COUNTERS.name).exists() {
        np.fast_counters = counter_sums(pin_dir, &maps::NP_FAST_COUNTERS, usage)?;
    }
    if pins::map(pin_dir, maps::NP_PEER_DEVS.name).exists() {
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
    let path = pins::map(pin_dir, spec.name);
    if !path.exists() {
        return Ok(None);
    }
    let (map, _) = open(pin_dir, spec)?;
    let words = Array::<MapData, u64>::try_from(map).map_err(|error| DumpError::Kind { path: path.clone(), error })?;
    let words: Vec<u64> = words.iter().collect::<Result<_, _>>().map_err(|error| DumpError::Read { map: spec.name, error })?;
    Ok(PortSet::from_words_of(bitmap, words))
}
