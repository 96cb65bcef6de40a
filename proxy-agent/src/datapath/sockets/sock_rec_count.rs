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
//! [`cover_uncounted`] raises the slot of each to
//! `SOCK_REC_UNCOUNTED`, which no release brings back to 0: such a record
//! is looked up and deleted at its release like any other. The install
//! calls it before the new programs are attached (what the pins hold) and
//! again after the old ones are detached (what they wrote meanwhile); a
//! record whose socket went in that window is the sweep's
//! (`sock_rec_sweep`), which runs next.

use std::path::Path;

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
    /// A slot could not be written.
    #[error("cannot write slot {slot} of SOCK_REC_COUNT: {source}")]
    Write {
        /// The slot.
        slot: u32,
        /// The error.
        source: MapError,
    },
}

/// Raises the `SOCK_REC_COUNT` slot of every uncounted `SOCK_REC` record
/// (pinned under `pin_dir`) to `SOCK_REC_UNCOUNTED`. Returns how many
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
        // drop increments made since.
        if counts.get(&slot, 0).is_ok_and(|c| c >= pc::SOCK_REC_UNCOUNTED) {
            continue;
        }
        counts.set(slot, pc::SOCK_REC_UNCOUNTED, 0).map_err(|source| CoverError::Write { slot, source })?;
        raised += 1;
    }
    Ok(raised)
}
