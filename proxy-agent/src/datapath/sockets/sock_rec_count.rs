//! Keeping `SOCK_REC_COUNT` covering every `SOCK_REC` record.
//!
//! The release and reverse programs read a cookie's slot in
//! `SOCK_REC_COUNT` before they look the cookie up in `SOCK_REC`, and stop
//! at a 0 (see `proxy_common::SOCK_REC_COUNT_SLOTS`). The connect program
//! counts every record it creates and marks it `counted`; the release
//! program takes the count back when it deletes such a record. Two kinds
//! of record were never counted and would hide behind a 0:
//!
//! * those of a build without `SOCK_REC_COUNT`, whose pins this agent
//!   adopts (the count map is then created empty beside them);
//! * the copies a capacity migration makes (`map_migration` clears their
//!   mark, since the count of the original may be taken back by the old
//!   release program while both run).
//!
//! [`cover_uncounted`] raises the slot of each to at least
//! `SOCK_REC_UNCOUNTED`, which no release brings back to 0: such a record
//! is looked up and deleted at its release like any other. The install
//! calls it before the new programs are attached (what the pins hold) and
//! again after the old ones are detached (what they wrote meanwhile); a
//! record whose socket went in that window is the sweep's
//! (`sock_rec_sweep`), which runs next.
//!
//! Slots come back down too. The array is mappable
//! (`proxy_common::SOCK_REC_COUNT_FLAGS`), and [`MappedCounts`] changes a
//! slot with the same atomic read-modify-write the programs use, so
//! nothing a connect or release does meanwhile is lost: the sweep takes
//! back the count of each counted record it deletes, and the mark
//! ([`pc::SOCK_REC_UNCOUNTED_ADDED`]) of a slot left with no uncounted
//! record. On pins of an older build, whose array cannot be mapped, slots
//! are only raised, with a plain write, as before.

use std::collections::{BTreeMap, BTreeSet};
use std::os::fd::AsFd;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

use aya::maps::{Array, HashMap, Map, MapData, MapError};
use proxy_common as pc;
use proxy_common::SockRecValue;

use crate::datapath::loader::pins;
use crate::datapath::maps::bpf_batch;

/// Why the slots could not be covered; the records stay as they are.
#[derive(Debug, thiserror::Error)]
pub enum CoverError {
    /// A map could not be opened.
    #[error("cannot open {map}: {source}")]
    Open {
        /// The map.
        map: &'static str,
        /// The error.
        source: MapError,
    },
    /// `SOCK_REC` could not be read.
    #[error("cannot read SOCK_REC: {0}")]
    Read(MapError),
    /// The mappable array could not be mapped.
    #[error("cannot map SOCK_REC_COUNT: {0}")]
    Map(std::io::Error),
    /// A slot could not be written.
    #[error("cannot write slot {slot} of SOCK_REC_COUNT: {source}")]
    Write {
        /// The slot.
        slot: u32,
        /// The error.
        source: MapError,
    },
}

/// `SOCK_REC_COUNT` mapped into the agent's memory (`mmap(2)` of the
/// `BPF_F_MMAPABLE` array: element `i` at byte `8 * i`). The programs
/// change a slot with `BPF_ATOMIC | BPF_ADD`, which the JITs emit as the
/// CPU's atomic add (`lock add` on x86-64, LSE or an exclusive-access loop
/// on arm64) on these very pages; `AtomicU64` here is the same kind of
/// operation on the same location, so neither side loses the other's.
pub struct MappedCounts {
    base: NonNull<AtomicU64>,
    slots: u32,
}

// SAFETY: the mapping is shared memory accessed only through atomics.
unsafe impl Send for MappedCounts {}

impl MappedCounts {
    /// Maps the `SOCK_REC_COUNT` pinned under `pin_dir`. `None` when there
    /// is none, or when it was created without `BPF_F_MMAPABLE` (the pins
    /// of an older build, adopted as they are).
    pub fn open(pin_dir: &Path) -> Result<Option<MappedCounts>, CoverError> {
        let path = pins::map(pin_dir, pc::SOCK_REC_COUNT_MAP);
        if !path.exists() {
            return Ok(None);
        }
        let data = MapData::from_pin(&path).map_err(|source| CoverError::Open { map: pc::SOCK_REC_COUNT_MAP, source })?;
        let info = data.info().map_err(|source| CoverError::Open { map: pc::SOCK_REC_COUNT_MAP, source })?;
        if info.map_flags() & pc::SOCK_REC_COUNT_FLAGS == 0 || info.value_size() != 8 {
            return Ok(None);
        }
        let slots = info.max_entries();
        let len = slots as usize * 8;
        // SAFETY: a new shared mapping of the map's value area (offset 0,
        // `len` bytes: what array_map_mmap allows for this map); no Rust
        // reference points into it, and `Drop` unmaps it.
        let ptr = unsafe {
            libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, data.fd().as_fd().as_raw_fd(), 0)
        };
        if ptr == libc::MAP_FAILED {
            return Err(CoverError::Map(std::io::Error::last_os_error()));
        }
        // The mapping outlives the descriptor (mmap holds the map).
        let base = NonNull::new(ptr.cast::<AtomicU64>()).ok_or_else(|| CoverError::Map(std::io::Error::other("mmap returned null")))?;
        Ok(Some(MappedCounts { base, slots }))
    }

    fn slot(&self, slot: u32) -> Option<&AtomicU64> {
        // SAFETY: within the mapping (slot < slots), 8-byte aligned (page
        // aligned base), and only ever accessed atomically, here and by
        // the programs.
        (slot < self.slots).then(|| unsafe { &*self.base.as_ptr().add(slot as usize) })
    }

    /// The count of `slot` now.
    pub fn get(&self, slot: u32) -> Option<u64> {
        self.slot(slot).map(|c| c.load(Ordering::SeqCst))
    }

    /// Adds `delta` to `slot`, atomically.
    pub fn add(&self, slot: u32, delta: u64) {
        if let Some(c) = self.slot(slot) {
            c.fetch_add(delta, Ordering::SeqCst);
        }
    }

    /// Subtracts `delta` from `slot` if it holds at least `floor + delta`
    /// (compare-and-swap, retried while the programs change it). Returns
    /// whether it did.
    pub fn sub_if_at_least(&self, slot: u32, delta: u64, floor: u64) -> bool {
        let Some(c) = self.slot(slot) else { return false };
        c.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| (v >= floor.saturating_add(delta)).then(|| v - delta)).is_ok()
    }
}

impl Drop for MappedCounts {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `open`, of this length.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.slots as usize * 8) };
    }
}

/// Raises the `SOCK_REC_COUNT` slot of every uncounted `SOCK_REC` record
/// (pinned under `pin_dir`) to at least `SOCK_REC_UNCOUNTED`: by adding
/// `SOCK_REC_UNCOUNTED_ADDED` when the array is mapped (so that the sweep
/// can take exactly that back), else with a plain write. Returns how many
/// slots it raised. A datapath without either map has nothing to cover.
pub fn cover_uncounted(pin_dir: &Path) -> Result<usize, CoverError> {
    let (rec_path, count_path) = (pins::map(pin_dir, pc::SOCK_REC_MAP), pins::map(pin_dir, pc::SOCK_REC_COUNT_MAP));
    if !rec_path.exists() || !count_path.exists() {
        return Ok(0);
    }
    let open = |map: &'static str, path: &Path| MapData::from_pin(path).map_err(|source| CoverError::Open { map, source });
    let records: HashMap<MapData, u64, SockRecValue> = HashMap::try_from(Map::HashMap(open(pc::SOCK_REC_MAP, &rec_path)?))
        .map_err(|source| CoverError::Open { map: pc::SOCK_REC_MAP, source })?;
    let mut counts: Array<MapData, u64> = Array::try_from(Map::Array(open(pc::SOCK_REC_COUNT_MAP, &count_path)?))
        .map_err(|source| CoverError::Open { map: pc::SOCK_REC_COUNT_MAP, source })?;
    let mapped = MappedCounts::open(pin_dir)?;
    let mut slots: Vec<u32> = bpf_batch::read_all(&records)
        .map_err(CoverError::Read)?
        .into_iter()
        .filter(|(_, v)| v.counted != pc::SOCK_REC_COUNTED)
        .map(|(cookie, _)| pc::sock_rec_count_slot(cookie))
        .collect();
    slots.sort_unstable();
    slots.dedup();
    let mut raised = 0;
    for slot in slots {
        // A slot already raised keeps its value: rewriting it could only
        // drop increments made since, and raising it twice would leave a
        // mark no sweep takes back.
        let now = match &mapped {
            Some(m) => m.get(slot),
            None => counts.get(&slot, 0).ok(),
        };
        if now.is_some_and(|c| c >= pc::SOCK_REC_UNCOUNTED) {
            continue;
        }
        match &mapped {
            Some(m) => m.add(slot, pc::SOCK_REC_UNCOUNTED_ADDED),
            None => counts.set(slot, pc::SOCK_REC_UNCOUNTED, 0).map_err(|source| CoverError::Write { slot, source })?,
        }
        raised += 1;
    }
    Ok(raised)
}

/// What [`settle`] did to the counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Settled {
    /// Counts of deleted counted records taken back.
    pub taken_back: usize,
    /// Slots whose uncounted mark was taken back.
    pub lowered: usize,
}

/// After the sweep deleted `deleted` (records it read, with their values,
/// before deleting them; each delete succeeded, so no release program
/// took their count back), brings `SOCK_REC_COUNT` back to what the
/// remaining records need:
///
/// * the count of each deleted counted record is taken back;
/// * a slot marked with `SOCK_REC_UNCOUNTED_ADDED` loses the mark when no
///   record of `kept` (what the sweep read and did not delete) in it is
///   uncounted, and the rest of its count still covers the counted ones
///   of `kept`. Only an install writes uncounted records (an older build's
///   programs while they run, a capacity migration's copies), before the
///   sweeps of its agent, so no uncounted record appears after `kept` was
///   read; records released since only make the check stricter.
///
/// Nothing happens on an array that cannot be mapped.
pub fn settle(pin_dir: &Path, deleted: &[(u64, SockRecValue)], kept: &[(u64, SockRecValue)]) -> Result<Settled, CoverError> {
    let Some(mapped) = MappedCounts::open(pin_dir)? else {
        return Ok(Settled::default());
    };
    let mut out = Settled::default();
    for (cookie, rec) in deleted {
        if rec.counted == pc::SOCK_REC_COUNTED {
            // The connect program added 1 for it and no release will
            // subtract it (the record is gone); the slot holds at least
            // that 1.
            if mapped.sub_if_at_least(pc::sock_rec_count_slot(*cookie), 1, 0) {
                out.taken_back += 1;
            }
        }
    }
    let mut counted: BTreeMap<u32, u64> = BTreeMap::new();
    let mut uncounted: BTreeSet<u32> = BTreeSet::new();
    for (cookie, rec) in kept {
        let slot = pc::sock_rec_count_slot(*cookie);
        if rec.counted == pc::SOCK_REC_COUNTED {
            *counted.entry(slot).or_default() += 1;
        } else {
            uncounted.insert(slot);
        }
    }
    for slot in 0..mapped.slots {
        if uncounted.contains(&slot) || mapped.get(slot).is_none_or(|c| c < pc::SOCK_REC_UNCOUNTED_ADDED) {
            continue;
        }
        if mapped.sub_if_at_least(slot, pc::SOCK_REC_UNCOUNTED_ADDED, counted.get(&slot).copied().unwrap_or(0)) {
            out.lowered += 1;
        }
    }
    Ok(out)
}
