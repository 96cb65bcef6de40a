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
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::sync::Arc;

use aya::maps::{Array, HashOfMaps, IterableMap, Map, MapData, MapError};
use proxy_common as pc;
use proxy_common::{MaglevKey, ServiceValue};

use crate::datapath::loader::pins;
use crate::datapath::maglev::maglev_budget::{MaglevBudget, OverBudget};
use crate::datapath::maps::MapSpec;
use crate::datapath::maps::bpf_batch::{self, BPF_MAP_DELETE_ELEM, BPF_MAP_UPDATE_ELEM};
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
    /// The outer map's descriptor again, for the raw link calls made from
    /// several threads (`link_all`, `unlink_all`).
    outer_fd: OwnedFd,
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
    /// The tables' share of the memory budget, charged for every array in
    /// `tables` (shared with the other datapath's writer).
    budget: Arc<MaglevBudget>,
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
        let path = pins::map(pin_dir, spec.name);
        if !path.exists() {
            return Ok(None);
        }
        let data = MapData::from_pin(path)?;
        let outer_fd = data.fd().as_fd().try_clone_to_owned().map_err(MapError::IoError)?;
        let outer = HashOfMaps::try_from(Map::HashOfMaps(data))?;
        Ok(Some(MaglevTables {
            spec,
            outer,
            outer_fd,
            size: None,
            linked: HashMap::new(),
            tables: HashMap::new(),
            by_content: HashMap::new(),
            budget: Arc::new(MaglevBudget::unlimited()),
        }))
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
            let budget = &self.budget;
            self.tables
                .entry(info.id())
                .or_insert_with(|| {
                    budget.take_anyway(size.bytes());
                    Shared { size: *size, refs: 0, content: None }
                })
                .refs += 1;
        }
        Ok(missing)
    }

    /// Links in the table of each request under its key, and returns, in
    /// request order, whether it was. A request's table is the array of
    /// another key with the same content when this writer filled one, else
    /// a new array of its `compute()`'s ids, created and filled first; a
    /// request whose array cannot be made is not linked.
    ///
    /// Every update of a map-in-map entry from user space waits for an RCU
    /// grace period before the syscall returns (kernel/bpf/syscall.c,
    /// `maybe_wait_bpf_programs`, so that no program run still holds the
    /// inner map the call replaced), about 20 ms here. A grace period ends
    /// every wait that began before it, so the links are made from several
    /// threads at once (see `concurrently`): a chunk of frontends pays
    /// about one grace period per thread's share instead of one per table.
    pub(crate) fn link_all(&mut self, requests: Vec<LinkRequest<'_>>) -> Vec<Result<(), MapError>> {
        // Arrays made or opened for this call, by kernel id: each stays
        // open (and so alive) until every link that names it is made.
        let mut open: HashMap<u32, Array<MapData, u32>> = HashMap::new();
        let mut prepared: Vec<Result<(MaglevKey, u32), MapError>> = Vec::with_capacity(requests.len());
        for r in requests {
            prepared.push(self.prepare(r, &mut open));
        }
        let links: Vec<(usize, MaglevKey, BorrowedFd<'_>)> = prepared
            .iter()
            .enumerate()
            .filter_map(|(i, p)| p.as_ref().ok().and_then(|(key, id)| open.get(id).map(|a| (i, *key, IterableMap::map(a).fd().as_fd()))))
            .collect();
        let outer_fd = self.outer_fd.as_fd();
        let done = concurrently(&links, |(_, key, inner)| elem_call(BPF_MAP_UPDATE_ELEM, outer_fd, key, Some(inner.as_raw_fd() as u32)));
        let mut results: Vec<Result<(), MapError>> = prepared.iter().map(|p| p.as_ref().map(|_| ()).map_err(clone_error)).collect();
        for ((i, _, _), r) in links.iter().zip(done) {
            if let Err(e) = r {
                results[*i] = Err(MapError::IoError(e));
            }
        }
        for (p, r) in prepared.iter().zip(&results) {
            if let (Ok((key, id)), Ok(())) = (p, r) {
                self.add_ref(*key, *id);
            }
        }
        // Arrays this call filled that no link names after all.
        let unused: Vec<u32> = self.tables.iter().filter(|(_, t)| t.refs == 0).map(|(id, _)| *id).collect();
        for id in unused {
            self.forget(id);
        }
        results
    }

    /// The array a request links: a shared one of the same content, else a
    /// new one, created and filled. The array is private to this agent
    /// until linked in; the link (a syscall that publishes the pointer under
    /// RCU) orders the stores before any program can reach it.
    fn prepare(&mut self, r: LinkRequest<'_>, open: &mut HashMap<u32, Array<MapData, u32>>) -> Result<(MaglevKey, u32), MapError> {
        let content: Content = (r.size, r.backends);
        if let Some(&id) = self.by_content.get(&content) {
            if open.contains_key(&id) {
                return Ok((r.key, id));
            }
            match MapData::from_id(id).and_then(|data| Array::try_from(Map::from_map_data(data)?)) {
                Ok(inner) => {
                    open.insert(id, inner);
                    return Ok((r.key, id));
                }
                // Gone behind this writer's back: fill a new one.
                Err(e) => {
                    tracing::debug!(map = self.spec.name, error = %e, "a shared Maglev table is gone; filling a new one");
                    self.by_content.remove(&content);
                }
            }
        }
        // Charged before the table is computed: a refusal costs nothing.
        self.budget.take(r.size.bytes()).map_err(|e| MapError::IoError(std::io::Error::other(e)))?;
        let made = (|| -> Result<(Array<MapData, u32>, u32), MapError> {
            let ids = (r.compute)().ok_or(MapError::KeyNotFound)?;
            let m = u32::try_from(ids.len()).map_err(|_| MapError::OutOfBounds { index: u32::MAX, max_entries: u32::MAX })?;
            let inner = Array::<MapData, u32>::create(m, BPF_F_INNER_MAP | BPF_F_MMAPABLE)?;
            fill(IterableMap::map(&inner), &ids).map_err(MapError::IoError)?;
            let id = IterableMap::map(&inner).info()?.id();
            Ok((inner, id))
        })();
        let (inner, id) = made.inspect_err(|_| self.budget.give_back(r.size.bytes()))?;
        self.tables.insert(id, Shared { size: r.size, refs: 0, content: Some(content.clone()) });
        self.by_content.insert(content, id);
        open.insert(id, inner);
        Ok((r.key, id))
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
        if t.refs == 0 {
            self.forget(id);
        }
    }

    /// Stops tracking an array no key links any more (the kernel frees it
    /// with its last link).
    fn forget(&mut self, id: u32) {
        if let Some(t) = self.tables.remove(&id) {
            self.budget.give_back(t.size.bytes());
            if let Some(content) = t.content {
                self.by_content.remove(&content);
            }
        }
    }

    /// Unlinks tables, where linked, from several threads at once (each
    /// unlink waits for a grace period, see [`MaglevTables::link_all`]).
    /// The kernel frees an array with its last link.
    pub(crate) fn unlink_all(&mut self, keys: &[MaglevKey]) {
        let outer_fd = self.outer_fd.as_fd();
        let done = concurrently(keys, |key| elem_call(BPF_MAP_DELETE_ELEM, outer_fd, key, None));
        for (key, r) in keys.iter().zip(done) {
            match r {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    tracing::debug!(map = self.spec.name, error = %e, "removing a Maglev table failed");
                }
                _ => {}
            }
            // Forgotten also when the unlink failed: the next agent's
            // `read_back` removes what is left.
            if let Some(id) = self.linked.remove(key) {
                self.drop_ref(id);
            }
        }
    }

    fn remove(&mut self, key: MaglevKey) -> bool {
        match self.outer.remove(&key) {
            Ok(()) => true,
            Err(e) if bpf_batch::is_not_found(&e) => false,
            Err(e) => {
                tracing::debug!(map = self.spec.name, error = %e, "removing a Maglev table failed");
                false
            }
        }
    }

    /// Charges this writer's tables to `budget` from now on (moving the
    /// tables it tracks already, adopted or made, over to it).
    pub(crate) fn set_budget(&mut self, budget: Arc<MaglevBudget>) {
        let bytes: u64 = self.tables.values().map(|t| t.size.bytes()).sum();
        self.budget.give_back(bytes);
        budget.take_anyway(bytes);
        self.budget = budget;
    }

    /// Bytes of new tables the budget takes now.
    pub(crate) fn room(&self) -> u64 {
        self.budget.room()
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

/// One table to link in: under `key`, the table of `backends` (sorted,
/// distinct) at `size`, computed by `compute` when no array of that
/// content exists.
pub(crate) struct LinkRequest<'a> {
    pub(crate) key: MaglevKey,
    pub(crate) size: TableSize,
    pub(crate) backends: Vec<Backend>,
    pub(crate) compute: Box<dyn FnOnce() -> Option<Vec<u32>> + 'a>,
}

/// At most this many threads wait for grace periods at once.
const MAX_THREADS: usize = 32;

/// Runs `op` on every item, spread over up to [`MAX_THREADS`] scoped
/// threads, and returns the results in item order. A thread that panicked
/// (it cannot: `op` is a syscall) reports its items as failed.
fn concurrently<T: Sync>(items: &[T], op: impl Fn(&T) -> std::io::Result<()> + Sync) -> Vec<std::io::Result<()>> {
    if items.len() <= 1 {
        return items.iter().map(&op).collect();
    }
    let per_thread = items.len().div_ceil(MAX_THREADS);
    std::thread::scope(|s| {
        let op = &op;
        let handles: Vec<_> =
            items.chunks(per_thread).map(|chunk| (chunk.len(), s.spawn(move || chunk.iter().map(op).collect::<Vec<_>>()))).collect();
        handles
            .into_iter()
            .flat_map(|(n, h)| h.join().unwrap_or_else(|_| (0..n).map(|_| Err(std::io::Error::other("link thread panicked"))).collect()))
            .collect()
    })
}

/// One `BPF_MAP_UPDATE_ELEM` (linking the array `inner_fd` in under `key`)
/// or `BPF_MAP_DELETE_ELEM` on the outer map, through the raw
/// [`bpf_batch::elem`]: aya's `HashOfMaps` needs `&mut` and so one caller
/// at a time.
fn elem_call(cmd: libc::c_long, outer: BorrowedFd<'_>, key: &MaglevKey, inner_fd: Option<u32>) -> std::io::Result<()> {
    let value = inner_fd.as_ref().map_or(std::ptr::null_mut(), |fd| std::ptr::from_ref(fd).cast_mut().cast::<u8>());
    // SAFETY: `outer` is an open hash-of-maps descriptor whose key is a
    // `MaglevKey` and whose value is an inner map's fd (u32); `key` and
    // `value` point at one of each, alive across the call, which only
    // reads them.
    unsafe { bpf_batch::elem(cmd, outer, std::ptr::from_ref(key).cast::<u8>(), value, 0) }
}

/// A copy of a preparation error for the caller's list (`MapError` is not
/// `Clone`); the message is what matters there, and whether it was the
/// budget's refusal ([`is_over_budget`]).
fn clone_error(e: &MapError) -> MapError {
    match over_budget(e) {
        Some(o) => MapError::IoError(std::io::Error::other(OverBudget { ..*o })),
        None => MapError::IoError(std::io::Error::other(e.to_string())),
    }
}

fn over_budget(e: &MapError) -> Option<&OverBudget> {
    match e {
        MapError::IoError(io) => io.get_ref().and_then(|inner| inner.downcast_ref::<OverBudget>()),
        _ => None,
    }
}

/// Whether a link failed because the table did not fit the tables' share
/// of the memory budget (not for a kernel error).
pub(crate) fn is_over_budget(e: &MapError) -> bool {
    over_budget(e).is_some()
}

/// Writes `ids` into a fresh mmap-able array of exactly `ids.len()` `u32`
/// entries through one shared mapping: three syscalls for a table of
/// 16,381 or 65,521 entries instead of one per entry (aya 0.14 has no
/// batch update for arrays).
fn fill(map: &MapData, ids: &[u32]) -> std::io::Result<()> {
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
