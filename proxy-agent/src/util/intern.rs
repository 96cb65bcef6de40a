//! One shared copy of the short strings that repeat across endpoints:
//! node names, zones and topology hints. A cluster has a handful of zones
//! and at most a few thousand nodes, but every endpoint names its node and
//! zone; at 100k endpoints, one heap string each for both was the largest
//! part of the model (agent peak RSS, `cargo xtask bench`).
//!
//! Strings no endpoint uses any more are dropped from the table when it has
//! doubled since the last sweep, so node churn (autoscaling) does not make
//! it grow without bound.

use std::sync::{Arc, Mutex};

/// Below this many entries the table is never swept.
const MIN_SWEEP: usize = 1024;

/// Hashed with foldhash: the strings are short and the table is asked
/// once per endpoint (a million times converting 100k Services x 10),
/// from the threads that convert a large manifest in parallel, under its
/// lock.
#[derive(Default)]
struct Table {
    set: foldhash::HashSet<Arc<str>>,
    sweep_at: usize,
}

impl Table {
    fn get(&mut self, s: &str) -> Arc<str> {
        if let Some(a) = self.set.get(s) {
            return a.clone();
        }
        if self.set.len() >= self.sweep_at.max(MIN_SWEEP) {
            // Only the table holds these: nothing refers to them any more.
            self.set.retain(|a| Arc::strong_count(a) > 1);
            self.sweep_at = self.set.len() * 2;
        }
        let a: Arc<str> = Arc::from(s);
        self.set.insert(a.clone());
        a
    }
}

/// Process-wide, because objects are converted by plain functions from
/// several places (watchers, manifests, tests); the lock is uncontended in
/// practice (one watcher converts EndpointSlices).
static TABLE: Mutex<Option<Table>> = Mutex::new(None);

/// The shared copy of `s`.
pub(crate) fn intern(s: &str) -> Arc<str> {
    let mut t = TABLE.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    t.get_or_insert_with(Table::default).get(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_strings_share_one_copy_and_unused_ones_are_swept() {
        let a = intern("zone-a");
        let b = intern("zone-a");
        assert!(Arc::ptr_eq(&a, &b));
        let mut t = Table::default();
        let kept = t.get("kept");
        for i in 0..MIN_SWEEP {
            t.get(&format!("gone-{i}"));
        }
        assert!(t.set.len() < 10, "unused strings stay: {}", t.set.len());
        assert!(Arc::ptr_eq(&kept, &t.get("kept")));
    }
}
