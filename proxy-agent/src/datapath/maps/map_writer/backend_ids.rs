//! The writer's memory-lean tables of what is in use: backend address to
//! (id, references) (`BackendIds`) and id sets as bitmaps (`IdSet`).
//! They are the writer's largest structures at scale (a million
//! backends), hence their own file with their own unit tests.

use std::collections::BTreeMap;

use foldhash::HashMap as FastHashMap;

use crate::model::Backend;
use crate::util::u64_map::U64Map;

/// Backend address to (id, number of frontends using it). An IPv4
/// backend's address and port fit in a `u64` key: 16 bytes an entry
/// instead of 28 with the 20-byte `Backend`, in a table sized to its
/// entries rather than to a power of two (`U64Map`): the writer's largest
/// table, 58 MiB at 1M backends with `Backend` keys, 34 MiB in a
/// `HashMap` of `u64` keys, 21 MiB now.
#[derive(Default)]
pub(super) struct BackendIds {
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
    pub(super) fn get(&self, b: &Backend) -> Option<&(u32, u32)> {
        match v4_key(b) {
            Some(k) => self.v4.get(k),
            None => self.v6.get(b),
        }
    }

    pub(super) fn get_mut(&mut self, b: &Backend) -> Option<&mut (u32, u32)> {
        match v4_key(b) {
            Some(k) => self.v4.get_mut(k),
            None => self.v6.get_mut(b),
        }
    }

    pub(super) fn contains_key(&self, b: &Backend) -> bool {
        self.get(b).is_some()
    }

    pub(super) fn insert(&mut self, b: Backend, v: (u32, u32)) {
        match v4_key(&b) {
            Some(k) => self.v4.insert(k, v),
            None => self.v6.insert(b, v),
        };
    }

    pub(super) fn remove(&mut self, b: &Backend) {
        match v4_key(b) {
            Some(k) => self.v4.remove(k),
            None => self.v6.remove(b),
        };
    }

    /// One more reference to `b`, known under `id` if it is new.
    pub(super) fn add_reference(&mut self, b: Backend, id: u32) {
        let e = match v4_key(&b) {
            Some(k) => self.v4.get_or_insert(k, (id, 0)),
            None => self.v6.entry(b).or_insert((id, 0)),
        };
        e.1 += 1;
    }

    pub(super) fn len(&self) -> usize {
        self.v4.len() + self.v6.len()
    }

    pub(super) fn ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.v4.values().chain(self.v6.values()).map(|(id, _)| *id)
    }

    /// Every backend with its id.
    pub(super) fn entries(&self) -> impl Iterator<Item = (Backend, u32)> + '_ {
        let v4 = self.v4.iter().map(|(k, (id, _))| {
            let ip = std::net::Ipv4Addr::from((k >> 16) as u32);
            (Backend { ip: std::net::IpAddr::V4(ip), port: k as u16 }, *id)
        });
        v4.chain(self.v6.iter().map(|(b, (id, _))| (*b, *id)))
    }

    /// Room for those of `backends` not known yet, at most `room` in all.
    pub(super) fn reserve_for<'a>(&mut self, backends: impl Iterator<Item = &'a Backend>, room: usize) {
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
pub(super) struct IdSet(BTreeMap<u32, u64>);

impl IdSet {
    pub(super) fn contains(&self, id: u32) -> bool {
        self.0.get(&(id / 64)).is_some_and(|w| w & (1 << (id % 64)) != 0)
    }

    pub(super) fn insert(&mut self, id: u32) {
        *self.0.entry(id / 64).or_default() |= 1 << (id % 64);
    }

    pub(super) fn remove(&mut self, id: u32) {
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

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

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
