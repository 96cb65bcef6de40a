//! B-tree maps rebuilt after they grew by many inserts.
//!
//! A `BTreeMap` splits a full node in the middle, so a map filled one
//! insert at a time has its nodes half full (55% for keys in order, about
//! 65% in the order manifests list objects): at 100k Services the empty
//! slots of the model's, the decision cache's and the map writer's maps
//! came to 60 MiB of the agent. Built from sorted entries (`collect`, a
//! bulk build) every node is full.

use std::collections::BTreeMap;

/// Fewer new entries than this are never worth a rebuild.
const MIN_INSERTED: usize = 4096;

/// Rebuilds `map` with full nodes when the `inserted` entries it gained
/// since it was last built are a quarter of it or more (and many). The
/// entries are moved, not cloned; a copy of their slots is held meanwhile.
pub(crate) fn repack_after<K: Ord, V>(map: &mut BTreeMap<K, V>, inserted: usize) {
    if inserted >= MIN_INSERTED && inserted * 4 >= map.len() {
        *map = std::mem::take(map).into_iter().collect();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_large_growth_is_rebuilt_with_the_same_entries() {
        let mut m: BTreeMap<u32, String> = (0..10_000).map(|i| (i, i.to_string())).collect();
        let before = m.clone();
        repack_after(&mut m, 10);
        assert_eq!(m, before, "few inserts: left alone");
        repack_after(&mut m, 10_000);
        assert_eq!(m, before, "rebuilt: the same entries");
    }
}
