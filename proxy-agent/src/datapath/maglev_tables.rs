//! A datapath's Maglev tables in its pinned hash of maps (`NP_MAGLEV` for
//! the TC programs, `SOCK_MAGLEV` for the socket programs' unconnected
//! UDP): one array of backend ids per frontend generation, linked in under
//! (service id, generation).
//!
//! A table is created and filled completely before it is linked in, and
//! linked in before the frontend's service entry switches to its
//! generation (the map writer does the switch), so the programs never see
//! a partly filled table; an old generation's table is unlinked after the
//! switch, and the kernel frees the array once no program run still uses
//! it (inner maps are released after an RCU grace period,
//! kernel/bpf/map_in_map.c `bpf_map_fd_put_ptr`). Only the outer map is
//! pinned: the arrays live as long as it links them, so a restarted agent
//! finds every table through it.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;

use aya::maps::{Array, HashOfMaps, IterableMap, Map, MapData, MapError};
use proxy_common as pc;
use proxy_common::{MaglevKey, ServiceValue};

use crate::datapath::maps::MapSpec;
use crate::decide::maglev::{Table, TableSize};
use crate::model::Backend;

/// `BPF_F_INNER_MAP` (include/uapi/linux/bpf.h): arrays of either table
/// size may be linked in. `BPF_F_MMAPABLE`: the array can be filled
/// through a shared mapping. The template in the object carries both, and
/// the kernel requires equal flags (`bpf_map_meta_equal`).
const BPF_F_INNER_MAP: u32 = 1 << 12;
const BPF_F_MMAPABLE: u32 = 1 << 10;

pub(crate) struct MaglevTables {
    spec: &'static MapSpec,
    outer: HashOfMaps<MapData, MaglevKey, Array<MapData, u32>>,
    /// The size new tables get, `None` for none: only frontends whose
    /// Service asks for a size get one.
    pub(crate) size: Option<TableSize>,
    /// The inner array (by kernel map id) each linked key names.
    linked: HashMap<MaglevKey, u32>,
    /// The inner arrays linked in, by map id.
    tables: HashMap<u32, Shared>,
    /// Arrays this writer filled, by what they were computed from. The
    /// frontends of one Service port (a NodePort on each node address, a
    /// LoadBalancer IP, externalIPs) have the same backends and so the
    /// same table: they link one array under each of their keys, and the
    /// memory is paid once.
    by_content: HashMap<Content, u32>,
}

/// What a table is computed from: its size and backend set (addresses, in
/// order). The table is a function of these alone (`decide::maglev`).
type Content = (TableSize, Vec<Backend>);

struct Shared {
    size: TableSize,
    /// Keys that link the array.
    refs: u32,
    /// `None` for arrays adopted from an earlier agent (their content is
    /// not read back: they are shared no further).
    content: Option<Content>,
}

/// Entries of a table as backend ids: `table.entries` index into
/// `table.backends`, and `id_of` names each backend's id.
pub(crate) fn table_ids(table: &Table, id_of: impl Fn(&Backend) -> Option<u32>) -> Option<Vec<u32>> {
    let ids: Vec<u32> = table.backends.iter().map(id_of).collect::<Option<_>>()?;
    table.entries.iter().map(|&i| ids.get(i as usize).copied()).collect()
}

/// The table size a service entry's flags announce, if any.
pub(crate) fn size_of_value(value: &ServiceValue) -> Option<TableSize> {
    match value.maglev_size() {
        pc::MAGLEV_SIZE_DEFAULT => Some(TableSize::Default),
        pc::MAGLEV_SIZE_LARGE => Some(TableSize::Large),
        _ => None,
    }
}

/// `ServiceValue.flags` bits of a generation with a table of `size`.
pub(crate) fn flags_of(size: TableSize) -> u32 {
    match size {
        TableSize::Default => pc::SVC_FLAG_MAGLEV,
        TableSize::Large => pc::SVC_FLAG_MAGLEV | pc::SVC_FLAG_MAGLEV_LARGE,
    }
}

impl MaglevTables {
    /// Opens the pinned outer map. `None` when the datapath has none (pinned
    /// by an agent without tables and not reloaded since): its programs
    /// pick by slot, and so the writer writes no tables.
    pub(crate) fn open(pin_dir: &Path, spec: &'static MapSpec) -> Result<Option<MaglevTables>, MapError> {
        let path = pin_dir.join(spec.name);
        if !path.exists() {
            return Ok(None);
        }
        let data = MapData::from_pin(path)?;
        let outer = HashOfMaps::try_from(Map::HashOfMaps(data))?;
        Ok(Some(MaglevTables { spec, outer, size: None, linked: HashMap::new(), tables: HashMap::new(), by_content: HashMap::new() }))
    }

    /// Keeps the tables of `live` (the current generations that announce
    /// one, with their sizes) and unlinks every other (left by an agent that
    /// stopped between linking a table and switching to it, or between the
    /// switch and the unlink). Returns the live generations that have no
    /// table linked in, or one of another size than announced.
    pub(crate) fn read_back(&mut self, live: &[(MaglevKey, TableSize)]) -> Result<BTreeSet<MaglevKey>, MapError> {
        let linked: BTreeSet<MaglevKey> = self.outer.keys().collect::<Result<_, _>>()?;
        let wanted: BTreeMap<MaglevKey, TableSize> = live.iter().copied().collect();
        let mut missing: BTreeSet<MaglevKey> = wanted.keys().filter(|k| !linked.contains(*k)).copied().collect();
        for k in linked {
            let Some(size) = wanted.get(&k) else {
                let _ = self.remove(k);
                continue;
            };
            // The array's kernel id tells which keys share one.
            let inner = match self.outer.get(&k, 0) {
                Ok(inner) => inner,
                Err(MapError::KeyNotFound) => {
                    missing.insert(k);
                    continue;
                }
                Err(e) => return Err(e),
            };
            let info = IterableMap::map(&inner).info()?;
            if info.max_entries() != size.entries() {
                missing.insert(k);
                continue;
            }
            self.linked.insert(k, info.id());
            self.tables.entry(info.id()).or_insert(Shared { size: *size, refs: 0, content: None }).refs += 1;
        }
        Ok(missing)
    }

    /// Links the table of `backends` (sorted, distinct) at `size` in under
    /// `key`: the array of another key with the same content when this
    /// writer filled one, else a new array of `compute()`'s ids, created
    /// and filled first. Nothing is linked in on error.
    pub(crate) fn link(
        &mut self,
        key: MaglevKey,
        size: TableSize,
        backends: &[Backend],
        compute: impl FnOnce() -> Option<Vec<u32>>,
    ) -> Result<(), MapError> {
        let content: Content = (size, backends.to_vec());
        if let Some(&id) = self.by_content.get(&content) {
            match MapData::from_id(id).and_then(|data| Array::try_from(Map::from_map_data(data)?)) {
                Ok(inner) => {
                    self.outer.insert(key, &inner, 0)?;
                    self.add_ref(key, id);
                    return Ok(());
                }
                // Gone behind this writer's back: fill a new one.
                Err(e) => {
                    tracing::debug!(map = self.spec.name, error = %e, "a shared Maglev table is gone; filling a new one");
                    self.by_content.remove(&content);
                }
            }
        }
        let ids = compute().ok_or(MapError::KeyNotFound)?;
        let m = u32::try_from(ids.len()).map_err(|_| MapError::OutOfBounds { index: u32::MAX, max_entries: u32::MAX })?;
        let inner = Array::<MapData, u32>::create(m, BPF_F_INNER_MAP | BPF_F_MMAPABLE)?;
        // The array is private to this agent until linked in below; the
        // link (a syscall that publishes the pointer under RCU) orders the
        // stores before any program can reach the array.
        fill(IterableMap::map(&inner), &ids).map_err(MapError::IoError)?;
        let id = IterableMap::map(&inner).info()?.id();
        self.outer.insert(key, &inner, 0)?;
        self.tables.insert(id, Shared { size, refs: 0, content: Some(content.clone()) });
        self.by_content.insert(content, id);
        self.add_ref(key, id);
        // `inner` is dropped here: its fd closes, and the outer map's
        // reference keeps the array.
        Ok(())
    }

    fn add_ref(&mut self, key: MaglevKey, id: u32) {
        if let Some(old) = self.linked.insert(key, id) {
            self.drop_ref(old);
        }
        if let Some(t) = self.tables.get_mut(&id) {
            t.refs += 1;
        }
    }

    fn drop_ref(&mut self, id: u32) {
        let Some(t) = self.tables.get_mut(&id) else { return };
        t.refs = t.refs.saturating_sub(1);
        if t.refs == 0
            && let Some(t) = self.tables.remove(&id)
            && let Some(content) = t.content
        {
            self.by_content.remove(&content);
        }
    }

    /// Unlinks a table, if linked. The kernel frees the array with its
    /// last link.
    pub(crate) fn unlink(&mut self, key: MaglevKey) {
        self.remove(key);
        // Forgotten also when the unlink failed: the next agent's
        // `read_back` removes what is left.
        if let Some(id) = self.linked.remove(&key) {
            self.drop_ref(id);
        }
    }

    fn remove(&mut self, key: MaglevKey) -> bool {
        match self.outer.remove(&key) {
            Ok(()) => true,
            Err(e) if crate::datapath::bpf_batch::is_not_found(&e) => false,
            Err(e) => {
                tracing::debug!(map = self.spec.name, error = %e, "removing a Maglev table failed");
                false
            }
        }
    }

    /// The pinned outer map's name, for errors.
    pub(crate) fn map_name(&self) -> &'static str {
        self.spec.name
    }

    /// Distinct arrays linked in for current generations, and the bytes of
    /// backend ids they hold (kernel overhead per array aside).
    pub(crate) fn usage(&self) -> (u32, u64) {
        (self.tables.len() as u32, self.tables.values().map(|t| t.size.bytes()).sum())
    }
}

/// Writes `ids` into a fresh mmap-able array of exactly `ids.len()` `u32`
/// entries through one shared mapping: three syscalls for a table of
/// 16,381 or 65,521 entries instead of one per entry (aya 0.14 has no
/// batch update for arrays).
fn fill(map: &MapData, ids: &[u32]) -> std::io::Result<()> {
    use std::os::fd::{AsFd, AsRawFd};
    // An array lays its values out every `round_up(value_size, 8)` bytes
    // (kernel/bpf/arraymap.c `array_map_alloc`), so a u32 table has an
    // 8-byte stride: the id, then 4 bytes of padding.
    type Slot = [u32; 2];
    let len = std::mem::size_of::<Slot>() * ids.len();
    let fd = map.fd().as_fd().as_raw_fd();
    // SAFETY: a new shared mapping of the first `len` bytes of a BPF array
    // created with BPF_F_MMAPABLE and `ids.len()` elements
    // (`array_map_mmap` maps the value area from offset 0). No existing
    // memory is touched; the result is checked before use.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0) };
    if p == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    let base = p.cast::<Slot>();
    for (i, id) in ids.iter().enumerate() {
        // SAFETY: slot `i < ids.len()` lies inside the writable mapping
        // made above, and is aligned (the mapping is page aligned, the
        // stride a multiple of 4).
        unsafe { base.add(i).write([*id, 0]) };
    }
    // SAFETY: unmaps exactly the mapping made above, which nothing refers
    // to any more.
    if unsafe { libc::munmap(p, len) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Every table linked in under the pinned outer map `spec` (`NP_MAGLEV`
/// or `SOCK_MAGLEV`), as backend ids by entry (for `dump` and tests).
/// Empty when the datapath has no tables.
pub fn read_all(pin_dir: &Path, spec: &'static MapSpec) -> Result<BTreeMap<MaglevKey, Vec<u32>>, MapError> {
    let Some(t) = MaglevTables::open(pin_dir, spec)? else { return Ok(BTreeMap::new()) };
    let mut out = BTreeMap::new();
    for key in t.outer.keys() {
        let key = key?;
        let inner: Array<MapData, u32> = match t.outer.get(&key, 0) {
            Ok(inner) => inner,
            // Unlinked between the listing and the lookup.
            Err(MapError::KeyNotFound) => continue,
            Err(e) => return Err(e),
        };
        let ids = inner.iter().collect::<Result<Vec<u32>, _>>()?;
        out.insert(key, ids);
    }
    Ok(out)
}
