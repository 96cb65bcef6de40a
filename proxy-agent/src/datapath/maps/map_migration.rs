//! Changing a pinned map's capacity without a gap: the kernel cannot resize
//! a map (`max_entries` is fixed at BPF_MAP_CREATE), and programs hold
//! their maps by fd from load time on. So a map whose capacity changes is
//! created anew beside its pin (at [`pins::staged_map`]), the old entries are
//! copied in, new programs are loaded against it and swapped in for the old
//! ones (socket_loader replaces the pinned cgroup links, tc_loader the tcx
//! links or cls_bpf filters), and only then is the new map's pin renamed
//! over the old one (rename(2) on bpffs is atomic, kernel/bpf/inode.c). The
//! old map lives on while old programs still run, and goes away with them.
//!
//! The agent is the only writer of the service maps and does not write
//! while it starts, so their copy is exact. The LRU maps are also written
//! by the old programs until the swap: they are copied once before it and
//! once after, where the second copy adds only what is missing.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use aya::maps::{Map, MapData, MapInfo, MapType, PerCpuArray, PerCpuValues};
use proxy_common::SvcConnValue;

use crate::datapath::loader::pins;
use crate::datapath::maps::bpf_batch::{self, BPF_MAP_GET_NEXT_KEY, BPF_MAP_LOOKUP_ELEM, BPF_MAP_UPDATE_ELEM};
use crate::datapath::maps::{self, MapSizes, MapSpec};

/// A map to be recreated with another capacity, or with the larger values
/// of this build ([`GROWN_VALUES`]).
#[derive(Debug)]
pub struct Migration {
    /// The map's entry in the table.
    pub spec: &'static MapSpec,
    /// Its capacity now.
    pub from: u32,
    /// The capacity it gets.
    pub to: u32,
    /// The value size it was pinned with, when smaller than this build's.
    pub grown_from: Option<usize>,
}

impl Migration {
    /// What changes, for the log.
    pub fn describe(&self, carried: u64) -> String {
        let name = self.spec.name;
        match self.grown_from {
            Some(old) if self.from == self.to => {
                format!("map {name} recreated with {}-byte values (was {old}; {carried} entries carried over)", self.spec.value_size)
            }
            Some(old) => format!(
                "map {name} resized from {} to {} entries, with {}-byte values (was {old}; {carried} entries carried over)",
                self.from, self.to, self.spec.value_size
            ),
            None => format!("map {name} resized from {} to {} entries ({carried} entries carried over)", self.from, self.to),
        }
    }
}

/// Maps whose value this build extends, with the value size earlier builds
/// pinned: their pins are migrated like a capacity change, each value
/// copied into the start of the new one and the added bytes zero, which
/// the programs read as the earlier meaning. `SERVICES` and `NP_SERVICES`
/// gained `ServiceValue::groups` (issue #48): all zero is plain slots.
pub const GROWN_VALUES: &[(&str, usize)] = &[(proxy_common::SERVICES_MAP, 16), (proxy_common::NP_SERVICES_MAP, 16)];

/// Whether a pin of `name` with `value_size` bytes per value is an earlier
/// build's layout that [`plan`] migrates.
pub fn value_grew(name: &str, value_size: usize) -> bool {
    GROWN_VALUES.iter().any(|(n, old)| *n == name && *old == value_size)
}

/// Why a map's capacity could not be changed; the old map stays in place and in use.
#[derive(Debug, thiserror::Error)]
pub enum MigrationError {
    /// A pin could not be opened.
    #[error("map {map}: cannot open {path}: {source}")]
    Open {
        /// The map.
        map: &'static str,
        /// The pin.
        path: PathBuf,
        /// The error.
        source: aya::maps::MapError,
    },
    /// The entries could not be copied.
    #[error("map {map}: copying its entries into the new map failed: {source}")]
    Copy {
        /// The map.
        map: &'static str,
        /// The error.
        source: io::Error,
    },
    /// The new map's pin could not be renamed over the old one.
    #[error("map {map}: cannot move the new map's pin over the old one at {path}: {source}")]
    Rename {
        /// The map.
        map: &'static str,
        /// The old pin.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
}

/// The capacity of every pinned map of `datapath` that a capacity flag
/// sizes, in [`maps::Capacity::ALL`] order (the first pinned map of each
/// wins; a datapath's maps of one capacity are created together, while the
/// TC datapath's may be sized apart: see `MapSizes`).
pub fn pinned_datapath_capacities(pin_dir: &Path, datapath: maps::Datapath) -> [Option<u32>; 6] {
    let mut out = [None; 6];
    for m in maps::MAPS.iter().filter(|m| m.datapath == datapath) {
        let Some(c) = m.capacity else { continue };
        let i = maps::Capacity::ALL.iter().position(|&x| x == c).unwrap_or(0);
        if out[i].is_none()
            && let Ok(info) = MapInfo::from_pin(pins::map(pin_dir, m.name))
        {
            out[i] = Some(info.max_entries());
        }
    }
    out
}

/// The pinned maps whose capacity differs from `caps`. A hash map holding
/// more entries than its new capacity is kept as it is (the copy could not
/// hold them), with a warning; an LRU map is shrunk anyway, as it would
/// evict when full.
pub fn plan(pin_dir: &Path, caps: &MapSizes) -> (Vec<Migration>, Vec<String>) {
    let mut out = Vec::new();
    let mut warnings = Vec::new();
    // The socket hooks' and the TC fast path's counter arrays grow as
    // reasons are added (`counter::COUNT`, `np_fast_counter::COUNT`); one
    // pinned by an older build is recreated at the new size, its counts
    // carried over (see `add_counters`), so that the new reasons count
    // without a `proxy-agent reset`. (NP_COUNTERS keeps its size: see
    // socket_loader's `check_pinned_maps`.)
    for (spec, count) in [(&maps::COUNTERS, proxy_common::counter::COUNT), (&maps::NP_FAST_COUNTERS, proxy_common::np_fast_counter::COUNT)]
    {
        if let Ok(info) = MapInfo::from_pin(pins::map(pin_dir, spec.name))
            && info.max_entries() < count
        {
            out.push(Migration { spec, from: info.max_entries(), to: count, grown_from: None });
        }
    }
    for m in maps::MAPS {
        let path = pins::map(pin_dir, m.name);
        let Ok(info) = MapInfo::from_pin(&path) else { continue };
        let from = info.max_entries();
        let pinned_value = info.value_size() as usize;
        let grown_from = (pinned_value != m.value_size && value_grew(m.name, pinned_value)).then_some(pinned_value);
        let to = caps.of(m).unwrap_or(from);
        if from == to && grown_from.is_none() {
            continue;
        }
        if m.map_type != MapType::LruHash {
            let used = MapData::from_pin(&path).ok().map_or(0, |d| count(d.fd().as_fd(), m.key_size));
            if used > u64::from(to) {
                warnings.push(format!("map {} holds {used} entries, more than the {to} asked for; it is kept at {from} entries", m.name));
                if grown_from.is_none() {
                    continue;
                }
                // Its values must grow all the same.
                out.push(Migration { spec: m, from, to: from, grown_from });
                continue;
            }
        }
        out.push(Migration { spec: m, from, to, grown_from });
    }
    (out, warnings)
}

/// Copies every entry of the pinned map into its staged copy; with
/// `only_missing`, keeps the entries the copy already has. Returns how many
/// entries were written.
pub fn copy(pin_dir: &Path, m: &Migration, only_missing: bool) -> Result<u64, MigrationError> {
    let name = m.spec.name;
    let open = |path: PathBuf| MapData::from_pin(&path).map_err(|source| MigrationError::Open { map: name, path, source });
    if m.spec.map_type == MapType::PerCpuArray {
        // Counters are added once, after the swap (`add_counters`): a copy
        // before it would miss what the old programs count until then.
        if !only_missing {
            return Ok(0);
        }
        let (old, new) = (open(pins::map(pin_dir, name))?, open(pins::staged_map(pin_dir, name))?);
        return if m.spec.value_size == size_of::<SvcConnValue>() {
            add_counters::<SvcConnValue>(old, new, m)
        } else {
            add_counters::<u64>(old, new, m)
        };
    }
    let old = open(pins::map(pin_dir, name))?;
    let new = open(pins::staged_map(pin_dir, name))?;
    copy_entries(old.fd().as_fd(), new.fd().as_fd(), m.spec, u64::from(m.from), only_missing)
        .map_err(|source| MigrationError::Copy { map: name, source })
}

/// Adds every per-CPU count of the old counter array to the new one's,
/// index by index. Called once the old programs are detached, so the old
/// counts are final; the new array already holds what the new programs
/// counted since they were attached, hence an addition rather than a copy.
/// A count the new programs add on a CPU between this read and write is
/// lost (the programs themselves increment without atomics, per CPU), a
/// window of one syscall per index at start-up. Returns how many indices
/// carried a count.
fn add_counters<V: Counts>(old: MapData, new: MapData, m: &Migration) -> Result<u64, MigrationError> {
    let name = m.spec.name;
    let err = |e: aya::maps::MapError| MigrationError::Copy { map: name, source: io::Error::other(e) };
    let old: PerCpuArray<MapData, V> = PerCpuArray::try_from(Map::PerCpuArray(old)).map_err(err)?;
    let mut new: PerCpuArray<MapData, V> = PerCpuArray::try_from(Map::PerCpuArray(new)).map_err(err)?;
    let mut carried = 0;
    for i in 0..m.from.min(m.to) {
        let before = old.get(&i, 0).map_err(err)?;
        if before.iter().all(|v| *v == V::default()) {
            continue;
        }
        let now = new.get(&i, 0).map_err(err)?;
        let sum: Vec<V> = before.iter().zip(now.iter()).map(|(a, b)| a.plus(b)).collect();
        let values = PerCpuValues::try_from(sum).map_err(|e| MigrationError::Copy { map: name, source: e })?;
        new.set(i, values, 0).map_err(err)?;
        carried += 1;
    }
    Ok(carried)
}

/// A per-CPU array element whose counts add up: the reason counters
/// (`u64`) and the topology counts (`SvcConnValue`).
trait Counts: aya::Pod + Default + PartialEq {
    fn plus(&self, other: &Self) -> Self;
}

impl Counts for u64 {
    fn plus(&self, other: &Self) -> Self {
        self.wrapping_add(*other)
    }
}

impl Counts for SvcConnValue {
    fn plus(&self, other: &Self) -> Self {
        let mut out = *self;
        for (a, b) in out.tiers.iter_mut().zip(other.tiers) {
            *a = a.wrapping_add(b);
        }
        out.blind_remote_fp = out.blind_remote_fp.wrapping_add(other.blind_remote_fp);
        out
    }
}

/// Renames the staged copy over the old pin.
pub fn commit(pin_dir: &Path, m: &Migration) -> Result<(), MigrationError> {
    let path = pins::map(pin_dir, m.spec.name);
    std::fs::rename(pins::staged_map(pin_dir, m.spec.name), &path).map_err(|source| MigrationError::Rename {
        map: m.spec.name,
        path,
        source,
    })
}

const BPF_NOEXIST: u64 = 1;

/// [`bpf_batch::elem`] on buffers of the map's key and value size.
fn elem(cmd: libc::c_long, fd: BorrowedFd<'_>, key: *const u8, value: *mut u8, flags: u64) -> io::Result<()> {
    // SAFETY: the callers pass buffers of the map's key and value size
    // (from the maps table, checked against the pinned map at start-up),
    // alive across the call.
    unsafe { bpf_batch::elem(cmd, fd, key, value, flags) }
}

/// The keys of a map, walked with BPF_MAP_GET_NEXT_KEY, handed to `f`. At
/// most `limit` steps: a key deleted under the walk (an LRU eviction)
/// restarts it at the first key (kernel/bpf/hashtab.c:
/// htab_map_get_next_key), so a walk of a busy map is bounded, not exact.
fn walk(fd: BorrowedFd<'_>, key_size: usize, limit: u64, mut f: impl FnMut(&[u8]) -> io::Result<()>) -> io::Result<()> {
    let mut key = vec![0u8; key_size];
    let mut next = vec![0u8; key_size];
    let mut first = true;
    for _ in 0..limit {
        let prev = if first { std::ptr::null() } else { key.as_ptr() };
        match elem(BPF_MAP_GET_NEXT_KEY, fd, prev, next.as_mut_ptr(), 0) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(()),
            Err(e) => return Err(e),
        }
        first = false;
        std::mem::swap(&mut key, &mut next);
        f(&key)?;
    }
    Ok(())
}

const BPF_MAP_GET_FD_BY_ID: libc::c_long = 14;

/// An fd of the map with kernel id `id` (`BPF_MAP_GET_FD_BY_ID`).
fn map_fd_by_id(id: u32) -> io::Result<OwnedFd> {
    #[repr(C)]
    struct GetFdAttr {
        map_id: u32,
        next_id: u32,
        open_flags: u32,
    }
    let attr = GetFdAttr { map_id: id, next_id: 0, open_flags: 0 };
    // SAFETY: the attribute is the `BPF_*_GET_FD_BY_ID` member of `union
    // bpf_attr`, read by the kernel during the call.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, BPF_MAP_GET_FD_BY_ID, std::ptr::from_ref(&attr), size_of::<GetFdAttr>()) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = i32::try_from(fd).map_err(io::Error::other)?;
    // SAFETY: the kernel returned a new descriptor that nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn count(fd: BorrowedFd<'_>, key_size: usize) -> u64 {
    let mut n = 0;
    let _ = walk(fd, key_size, u64::from(u32::MAX), |_| {
        n += 1;
        Ok(())
    });
    n
}

fn copy_entries(old: BorrowedFd<'_>, new: BorrowedFd<'_>, spec: &MapSpec, capacity: u64, only_missing: bool) -> io::Result<u64> {
    let mut value = vec![0u8; spec.value_size];
    let mut copied = 0;
    let flags = if only_missing { BPF_NOEXIST } else { 0 };
    let outer = matches!(spec.map_type, MapType::HashOfMaps | MapType::ArrayOfMaps);
    walk(old, spec.key_size, capacity.saturating_mul(2).max(1024), |key| {
        match elem(BPF_MAP_LOOKUP_ELEM, old, key.as_ptr(), value.as_mut_ptr(), 0) {
            Ok(()) => {}
            // Gone since the walk saw it (evicted or expired).
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(()),
            Err(e) => return Err(e),
        }
        // A map of maps reads back the inner map's id but is written with
        // an fd of it (kernel/bpf/map_in_map.c: bpf_map_fd_get_ptr and
        // bpf_map_fd_sys_lookup_elem).
        let inner = if outer { Some(map_fd_by_id(u32::from_ne_bytes([value[0], value[1], value[2], value[3]]))?) } else { None };
        // A copied record was not counted in SOCK_REC_COUNT by a program
        // of the new map: the old release program may take back its
        // original's count while both run. Unmarked, no release takes it
        // back again, and `sock_rec_count` covers its slot.
        if spec.name == proxy_common::SOCK_REC_MAP {
            value[proxy_common::SOCK_REC_COUNTED_OFFSET] = 0;
        }
        let mut fd_value;
        let value_ptr = match &inner {
            Some(fd) => {
                fd_value = fd.as_raw_fd().to_ne_bytes();
                fd_value.as_mut_ptr()
            }
            None => value.as_mut_ptr(),
        };
        match elem(BPF_MAP_UPDATE_ELEM, new, key.as_ptr(), value_ptr, flags) {
            Ok(()) => copied += 1,
            Err(e) if only_missing && e.raw_os_error() == Some(libc::EEXIST) => {}
            Err(e) => return Err(e),
        }
        Ok(())
    })?;
    Ok(copied)
}
