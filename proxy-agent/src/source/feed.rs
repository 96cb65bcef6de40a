//! What a source hands the sync loop: converted objects queued in
//! [`Stores`], and [`Signal`]s that say something changed and when. The
//! API server's watchers (`kube_watch`) and the manifest reader
//! (`manifest_watch`) fill the same queue, so one sync loop serves both.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use crate::model::store::{Delta, Kind};

/// What the watchers tell the sync loop. The stores hold the data; signals
/// only say that something changed and when.
#[derive(Debug)]
pub enum Signal {
    /// An object was added, changed or deleted while watching.
    Changed {
        /// The object's kind.
        kind: Kind,
        /// When the change happened, as far as the agent can tell.
        trigger: SystemTime,
        /// `trigger` is the EndpointSlice controller's own
        /// `endpoints.kubernetes.io/last-change-trigger-time`, the only
        /// start kube-proxy's network programming latency counts from.
        stamped: bool,
    },
    /// A complete (re)list landed in the store.
    Listed {
        /// The kind listed.
        kind: Kind,
    },
    /// The watch of other Nodes completed a listing with these labels of
    /// these Nodes (`node_scope::watched`; no labels: other Nodes are not
    /// watched), sent before the `Listed` it comes with: the Services
    /// waiting for those labels can be decided (`decide::label_wait`).
    NodeLabelsListed {
        /// What the listing covered.
        listed: crate::model::OtherNodes,
    },
    /// A list or watch failed; the watcher retries with backoff.
    Failed {
        /// The kind whose list or watch failed.
        kind: Kind,
        /// The resourceVersion expired (410 Gone or "too large resource
        /// version"): a relist follows.
        expired: bool,
        /// The error, for the log.
        message: String,
    },
    /// Something outside the API server that the sync depends on changed
    /// (e.g. the node's addresses, which NodePorts are served on): sync
    /// again.
    Resync {
        /// What changed, for the log.
        reason: &'static str,
    },
}

/// What the watchers have converted and not yet handed to the sync loop,
/// and how many objects of each kind exist.
#[derive(Clone, Default)]
pub struct Stores {
    queue: Arc<Mutex<Vec<Delta>>>,
    counts: Arc<[AtomicUsize; 3]>,
}

impl Stores {
    /// Takes every delta queued so far, oldest first.
    pub fn drain(&self) -> Vec<Delta> {
        std::mem::take(&mut *self.queue.lock().unwrap_or_else(std::sync::PoisonError::into_inner))
    }

    /// Runs `f` over the deltas queued so far without taking them: the
    /// agent sizes its maps from the initial state before the first sync
    /// takes it.
    pub fn with_queued<R>(&self, f: impl FnOnce(&[Delta]) -> R) -> R {
        f(&self.queue.lock().unwrap_or_else(std::sync::PoisonError::into_inner))
    }

    pub(crate) fn push(&self, deltas: impl IntoIterator<Item = Delta>) {
        self.queue.lock().unwrap_or_else(std::sync::PoisonError::into_inner).extend(deltas);
    }

    /// [`Self::push`] for a whole relist: taken over as the queue when the
    /// sync loop has drained it, rather than copied (at 10k objects that
    /// copy was megabytes more at the agent's memory peak).
    pub(crate) fn push_all(&self, mut deltas: Vec<Delta>) {
        let mut q = self.queue.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if q.is_empty() {
            *q = deltas;
        } else {
            q.append(&mut deltas);
        }
    }

    /// Records how many objects of `kind` the source holds.
    pub(crate) fn set_len(&self, kind: Kind, n: usize) {
        self.counts[kind as usize].store(n, Ordering::Relaxed);
    }

    /// Objects of `kind` the source holds, as of the last event.
    pub fn len(&self, kind: Kind) -> usize {
        self.counts[kind as usize].load(Ordering::Relaxed)
    }
}
