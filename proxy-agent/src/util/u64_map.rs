//! A map from `u64` keys below 2^64 - 1 to small `Copy` values, kept in
//! one array of (key, value) slots filled up to three quarters (open
//! addressing, linear probing, Robin Hood order).
//!
//! The map writer keeps one entry per IPv4 backend (a million at 100k
//! Services x 10), at the agent's memory peak. A `HashMap` (hashbrown)
//! sizes its table to a power of two at most 7/8 full: a million entries
//! take 2^21 slots, 34 MiB with its control bytes, a table less than half
//! full. Here the table is sized to what the entries need (the room is
//! reserved up front, `reserve`), 21 MiB for a million.
//!
//! Slots are found by a hash of the key scaled to the table's length
//! (`index`), so any length works. Entries along a probe
//! run are kept in order of their home slot (Robin Hood: an insert takes
//! the place of an entry nearer its home), so a lookup of an absent key
//! stops as soon as it passes the place its key would hold, after about
//! as many slots as one of a present key; a cold sync looks up every
//! backend before it exists. A removal shifts the entries after it back
//! (no tombstones).

/// The key of an empty slot: no key is this large (a map key is an IPv4
/// backend, 48 bits).
const EMPTY: u64 = u64::MAX;

/// Entries at most this share of the slots (numerator, denominator).
const LOAD: (usize, usize) = (3, 4);

#[derive(Clone, Debug)]
pub(crate) struct U64Map<V> {
    slots: Box<[(u64, V)]>,
    len: usize,
}

impl<V: Copy + Default> Default for U64Map<V> {
    fn default() -> Self {
        U64Map { slots: Box::default(), len: 0 }
    }
}

impl<V: Copy + Default> U64Map<V> {
    /// The home slot of `key` in a table of `n` slots (`n` > 0).
    fn index(key: u64, n: usize) -> usize {
        // MurmurHash3's 64-bit finalizer: every key bit moves every hash
        // bit (a multiplication alone left backends a port's shift apart,
        // `ip << 16 | port`, on a fifth of the slots); scaled to [0, n) by
        // the high half of a 128-bit product rather than a modulo.
        let mut h = key;
        h ^= h >> 33;
        h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
        h ^= h >> 33;
        h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        h ^= h >> 33;
        ((u128::from(h) * n as u128) >> 64) as usize
    }

    fn next(&self, i: usize) -> usize {
        if i + 1 == self.slots.len() { 0 } else { i + 1 }
    }

    /// How far slot `i` is past the home slot of `key`.
    fn distance(&self, i: usize, key: u64) -> usize {
        let (n, home) = (self.slots.len(), Self::index(key, self.slots.len()));
        if i >= home { i - home } else { i + n - home }
    }

    /// The slot holding `key`.
    fn find(&self, key: u64) -> Option<usize> {
        if self.len == 0 {
            return None;
        }
        let mut i = Self::index(key, self.slots.len());
        let mut d = 0;
        loop {
            let k = self.slots[i].0;
            if k == key {
                return Some(i);
            }
            // An empty slot, or an entry nearer its home than `key` would
            // be here: `key` would have taken this place.
            if k == EMPTY || self.distance(i, k) < d {
                return None;
            }
            i = self.next(i);
            d += 1;
        }
    }

    /// Puts `key` (absent, with room) in its place; returns its slot.
    fn place(&mut self, key: u64, value: V) -> usize {
        let (mut entry, mut i, mut d) = ((key, value), Self::index(key, self.slots.len()), 0);
        let mut placed = None;
        loop {
            let k = self.slots[i].0;
            if k == EMPTY {
                self.slots[i] = entry;
                self.len += 1;
                return placed.unwrap_or(i);
            }
            let theirs = self.distance(i, k);
            if theirs < d {
                // Robin Hood: the entry nearer its home moves on.
                entry = std::mem::replace(&mut self.slots[i], entry);
                placed.get_or_insert(i);
                d = theirs;
            }
            i = self.next(i);
            d += 1;
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn get(&self, key: u64) -> Option<&V> {
        self.find(key).map(|i| &self.slots[i].1)
    }

    pub(crate) fn get_mut(&mut self, key: u64) -> Option<&mut V> {
        self.find(key).map(|i| &mut self.slots[i].1)
    }

    /// Sets `key`'s value; returns the one it replaces.
    pub(crate) fn insert(&mut self, key: u64, value: V) -> Option<V> {
        debug_assert!(key != EMPTY, "a key must be below 2^64 - 1");
        if let Some(i) = self.find(key) {
            return Some(std::mem::replace(&mut self.slots[i].1, value));
        }
        self.reserve(1);
        self.place(key, value);
        None
    }

    /// `key`'s value, set to `value` first if `key` has none.
    pub(crate) fn get_or_insert(&mut self, key: u64, value: V) -> &mut V {
        debug_assert!(key != EMPTY, "a key must be below 2^64 - 1");
        let i = if let Some(i) = self.find(key) {
            i
        } else {
            self.reserve(1);
            self.place(key, value)
        };
        &mut self.slots[i].1
    }

    /// Removes `key`; returns its value.
    pub(crate) fn remove(&mut self, key: u64) -> Option<V> {
        let mut hole = self.find(key)?;
        let value = self.slots[hole].1;
        // The entries after it that are not at home move back one slot.
        loop {
            let next = self.next(hole);
            let k = self.slots[next].0;
            if k == EMPTY || self.distance(next, k) == 0 {
                break;
            }
            self.slots[hole] = self.slots[next];
            hole = next;
        }
        self.slots[hole] = (EMPTY, V::default());
        self.len -= 1;
        Some(value)
    }

    /// Room for `additional` more entries without a rebuild: one rebuild
    /// now if needed, to the size they need (at least twice the current
    /// one, so that inserts one at a time cost O(1) on average).
    pub(crate) fn reserve(&mut self, additional: usize) {
        let needed = self.len + additional;
        if needed * LOAD.1 <= self.slots.len() * LOAD.0 {
            return;
        }
        let slots = (needed * LOAD.1).div_ceil(LOAD.0).max(self.slots.len() * 2).max(16);
        let old = std::mem::replace(&mut self.slots, vec![(EMPTY, V::default()); slots].into_boxed_slice());
        self.len = 0;
        for (key, value) in old.iter().filter(|(k, _)| *k != EMPTY) {
            self.place(*key, *value);
        }
    }

    /// Every entry, in no particular order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, &V)> + '_ {
        self.slots.iter().filter(|(k, _)| *k != EMPTY).map(|(k, v)| (*k, v))
    }

    /// Every value, in no particular order.
    pub(crate) fn values(&self) -> impl Iterator<Item = &V> + '_ {
        self.iter().map(|(_, v)| v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// A long run of random inserts, updates and removes (keys from a small
    /// range, so that they collide and chains wrap around the table's end)
    /// gives what a `HashMap` gives, after every step.
    #[test]
    fn behaves_like_a_hash_map() {
        let mut ours: U64Map<(u32, u32)> = U64Map::default();
        let mut want: HashMap<u64, (u32, u32)> = HashMap::new();
        let mut x: u64 = 0x2545_F491_4F6C_DD1D;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for step in 0..200_000u32 {
            let r = next();
            let key = (r >> 8) % 3000;
            match r % 5 {
                0 | 1 => assert_eq!(ours.insert(key, (step, 1)), want.insert(key, (step, 1)), "step {step}"),
                2 => assert_eq!(ours.remove(key), want.remove(&key), "step {step}"),
                3 => {
                    *ours.get_or_insert(key, (step, 0)) = (step, 7);
                    want.insert(key, (step, 7));
                }
                _ => {
                    if let (Some(a), Some(b)) = (ours.get_mut(key), want.get_mut(&key)) {
                        a.1 += 1;
                        b.1 += 1;
                    }
                }
            }
            assert_eq!(ours.len(), want.len(), "step {step}");
            if step % 10_000 == 0 {
                let got: HashMap<u64, (u32, u32)> = ours.iter().map(|(k, v)| (k, *v)).collect();
                assert_eq!(got, want, "step {step}");
            }
            assert_eq!(ours.get(key).copied(), want.get(&key).copied(), "step {step}");
        }
        for key in 0..3000 {
            assert_eq!(ours.get(key).copied(), want.get(&key).copied());
        }
    }

    #[test]
    fn reserving_sizes_the_table_to_the_entries() {
        let mut m: U64Map<(u32, u32)> = U64Map::default();
        m.reserve(1_000_000);
        assert_eq!(m.slots.len(), 1_333_334, "a million entries at three quarters, not 2^21 slots");
        for k in 0..1_000_000u64 {
            m.insert((k << 16) | 0x1f90, (k as u32, 1));
        }
        assert_eq!(m.slots.len(), 1_333_334, "no rebuild while filling what was reserved");
        assert_eq!(m.get((999_999 << 16) | 0x1f90), Some(&(999_999, 1)));
        assert_eq!(m.values().count(), 1_000_000);
    }
}
