//! The Maglev tables' share of `--map-memory-budget`, shared by the socket
//! and the TC writers.
//!
//! A table is a kernel array of its own (16,381 or 65,521 entries, 8 bytes
//! each, see `decide::maglev::KERNEL_BYTES_PER_ENTRY`), created on demand
//! and freed with its last link, so unlike the other maps its memory is
//! not fixed by a capacity at creation: without a cap, a cluster of many
//! NodePort Services with distinct backends would take 128 KiB per Service
//! port outside the budget. `sizing` sets this share from the first list;
//! a table that would exceed it is not made, and its frontend takes the
//! modulo slot pick until tables that are no longer needed make room.

use std::sync::atomic::{AtomicU64, Ordering};

/// A table was not made: it would take the tables past their share.
#[derive(Debug, thiserror::Error)]
#[error("a table of {wanted} bytes would take the Maglev tables past their share of --map-memory-budget ({used} of {cap} bytes in use)")]
pub struct OverBudget {
    /// Bytes the table would take.
    pub wanted: u64,
    /// Bytes of tables in use.
    pub used: u64,
    /// The tables' share of `--map-memory-budget`, in bytes.
    pub cap: u64,
}

/// Bytes of Maglev tables in use, against a cap.
#[derive(Debug)]
pub struct MaglevBudget {
    cap: u64,
    used: AtomicU64,
}

impl MaglevBudget {
    /// A budget of `cap_bytes`, nothing in use.
    pub fn new(cap_bytes: u64) -> MaglevBudget {
        MaglevBudget { cap: cap_bytes, used: AtomicU64::new(0) }
    }

    /// No cap (writers opened by tools and tests that set none).
    pub fn unlimited() -> MaglevBudget {
        MaglevBudget::new(u64::MAX)
    }

    /// The cap, in bytes.
    pub fn cap(&self) -> u64 {
        self.cap
    }

    /// Bytes of tables in use.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    /// Whether a table of `bytes` would fit now.
    pub fn has_room(&self, bytes: u64) -> bool {
        bytes <= self.room()
    }

    /// Bytes that new tables may still take.
    pub fn room(&self) -> u64 {
        self.cap.saturating_sub(self.used())
    }

    /// Takes `bytes` for a new table, or says why not.
    pub fn take(&self, bytes: u64) -> Result<(), OverBudget> {
        self.used
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |used| {
                let after = used.saturating_add(bytes);
                (after <= self.cap).then_some(after)
            })
            .map(|_| ())
            .map_err(|used| OverBudget { wanted: bytes, used, cap: self.cap })
    }

    /// Counts `bytes` of a table that exists already (adopted from the
    /// pinned maps at start-up), even beyond the cap: the memory is in use
    /// whatever the cap says.
    pub fn take_anyway(&self, bytes: u64) {
        let _ = self.used.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |used| Some(used.saturating_add(bytes)));
    }

    /// Returns the bytes of a table that was dropped.
    pub fn give_back(&self, bytes: u64) {
        let _ = self.used.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |used| Some(used.saturating_sub(bytes)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_are_taken_while_they_fit_and_room_comes_back_with_drops() {
        // (step, bytes, taken?, used after)
        enum Step {
            Take(u64, bool),
            Adopt(u64),
            Drop(u64),
        }
        let b = MaglevBudget::new(300);
        let steps = [
            (Step::Take(128, true), 128),
            (Step::Take(128, true), 256),
            (Step::Take(128, false), 256),
            (Step::Take(44, true), 300),
            (Step::Take(1, false), 300),
            (Step::Drop(128), 172),
            (Step::Take(128, true), 300),
            (Step::Adopt(128), 428),
            (Step::Take(1, false), 428),
            (Step::Drop(500), 0),
        ];
        for (i, (step, used)) in steps.into_iter().enumerate() {
            match step {
                Step::Take(bytes, fits) => {
                    assert_eq!(b.has_room(bytes), fits, "step {i}");
                    let r = b.take(bytes);
                    assert_eq!(r.is_ok(), fits, "step {i}");
                    if let Err(e) = r {
                        assert_eq!((e.wanted, e.cap), (bytes, 300), "step {i}");
                        assert!(e.to_string().contains("--map-memory-budget"), "step {i}: {e}");
                    }
                }
                Step::Adopt(bytes) => b.take_anyway(bytes),
                Step::Drop(bytes) => b.give_back(bytes),
            }
            assert_eq!(b.used(), used, "step {i}");
        }
        assert!(MaglevBudget::unlimited().has_room(u64::MAX));
    }
}
