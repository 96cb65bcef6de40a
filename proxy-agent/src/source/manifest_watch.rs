//! Manifest files as a source of the model, fed to the same sync loop as
//! the API server's watchers.
//!
//! The files are watched with inotify (the `notify` crate), with a slow
//! poll as a safety net for what inotify does not see (network file
//! systems, a lost event queue, a watch that could not be added). Either
//! only starts a refresh of the `ManifestSet`: a stat of every file, and
//! a read of those that changed, so nothing is read while no file changes.
//!
//! A file written in place is read once its writer closes it (inotify's
//! IN_CLOSE_WRITE), or once it has not been written for [`QUIET`]; a read
//! that finds it unparsable keeps its previous objects (see
//! `manifest_set`). Whatever changed is queued as deltas, and the sync
//! loop is told which kinds changed, as the watchers tell it.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use notify::event::{AccessKind, AccessMode, EventKind, ModifyKind};
use notify::{RecursiveMode, Watcher};
use tokio::sync::mpsc::UnboundedSender;

use crate::model::ObjectRef;
use crate::model::store::{Delta, Kind};
use crate::observe::metrics::{Metrics, reason};
use crate::source::feed::{Signal, Stores};
use crate::source::manifest::ManifestError;
use crate::source::manifest_set::ManifestSet;

/// Everything the manifest files hold, converted.
#[derive(Debug, Default)]
pub struct ManifestRead {
    /// One delta per object, keyed by kind and namespace/name.
    pub deltas: BTreeMap<(Kind, ObjectRef), Delta>,
    /// Files and documents that could not be read.
    pub errors: Vec<ManifestError>,
}

/// Reads and converts every object under `paths` once (`explain`).
pub fn read(paths: &[PathBuf]) -> ManifestRead {
    let update = ManifestSet::new(paths.to_vec()).refresh(&|_| false);
    let deltas = update.deltas.into_iter().map(|d| ((d.kind, d.id.clone()), d)).collect();
    ManifestRead { deltas, errors: update.errors }
}

/// Events are gathered for this long before a refresh, so that a burst
/// (a file written aside then renamed, a directory copied) costs one.
const DEBOUNCE: Duration = Duration::from_millis(30);

/// A file modified in place and not closed since is read once it has not
/// been written for this long: its writer may keep it open.
pub const QUIET: Duration = Duration::from_secs(2);

/// Starts the task that reads `paths` now and whenever they change
/// (inotify, and a check every `poll`), and queues what it read; returns
/// the queue.
pub fn start(paths: Vec<PathBuf>, poll: Duration, metrics: Arc<Metrics>, tx: UnboundedSender<Signal>) -> Stores {
    let stores = Stores::default();
    // Absolute, so that the paths inotify reports compare with the files
    // listed (notify joins the names it reports to the watched path).
    let paths = paths.into_iter().map(|p| std::path::absolute(&p).unwrap_or(p)).collect();
    tokio::spawn(watch(paths, poll, metrics, stores.clone(), tx));
    stores
}

/// What file events have said since the last refresh.
#[derive(Default)]
struct Pending {
    /// When the first event of the next refresh came.
    since: Option<SystemTime>,
    /// Files modified in place and not closed yet, with their last write.
    writing: HashMap<PathBuf, Instant>,
}

impl Pending {
    /// Takes in one event on a path under `roots`; whether it may have
    /// changed a file.
    fn note(&mut self, event: &notify::Event, roots: &[PathBuf]) -> bool {
        let ours = event.paths.iter().any(|p| roots.iter().any(|r| p.starts_with(r)));
        if !ours && !event.need_rescan() {
            return false;
        }
        match event.kind {
            // The agent's own reads (and anyone else's).
            EventKind::Access(AccessKind::Open(_) | AccessKind::Read | AccessKind::Close(AccessMode::Read)) => return false,
            EventKind::Modify(ModifyKind::Data(_) | ModifyKind::Any) => {
                for p in &event.paths {
                    self.writing.insert(p.clone(), Instant::now());
                }
            }
            // Closed after writing, or replaced, created, removed: whatever
            // is there now is complete.
            EventKind::Access(AccessKind::Close(_))
            | EventKind::Create(_)
            | EventKind::Remove(_)
            | EventKind::Modify(ModifyKind::Name(_)) => {
                for p in &event.paths {
                    self.writing.remove(p);
                }
            }
            _ => {}
        }
        self.since.get_or_insert_with(SystemTime::now);
        true
    }

    /// Whether `path` is still being written, and until when it is held.
    fn held_until(&self, path: &Path, now: Instant) -> Option<Instant> {
        self.writing.get(path).map(|t| *t + QUIET).filter(|until| *until > now)
    }
}

/// The inotify watches on the manifest paths.
struct Watches {
    watcher: Option<notify::RecommendedWatcher>,
    /// Watched paths, by the directory's identity (device, inode) when
    /// watched: a directory replaced under the same name is watched anew.
    watched: HashMap<PathBuf, (u64, u64)>,
    /// Paths whose watch failed, reported once.
    failed: HashMap<PathBuf, String>,
}

impl Watches {
    fn new(events: UnboundedSender<notify::Event>) -> Watches {
        let handler = move |res: notify::Result<notify::Event>| {
            // A failed read of the event queue: rescan to be safe.
            let event = res.unwrap_or_else(|_| notify::Event::new(EventKind::Other).set_flag(notify::event::Flag::Rescan));
            let _ = events.send(event);
        };
        let watcher = match notify::recommended_watcher(handler) {
            Ok(w) => Some(w),
            Err(e) => {
                tracing::warn!("cannot watch the manifests with inotify ({e}); checking them every poll interval only");
                None
            }
        };
        Watches { watcher, watched: HashMap::new(), failed: HashMap::new() }
    }

    /// Watches each path (a directory recursively) and its parent
    /// directory, which sees the path itself replaced, renamed over or
    /// created. Called after every refresh: a directory that was replaced
    /// is watched again.
    fn ensure(&mut self, paths: &[PathBuf]) {
        use std::os::unix::fs::MetadataExt;
        let Some(watcher) = self.watcher.as_mut() else { return };
        let mut wanted: Vec<(PathBuf, RecursiveMode)> = Vec::new();
        for p in paths {
            if let Some(parent) = p.parent() {
                wanted.push((parent.to_path_buf(), RecursiveMode::NonRecursive));
            }
            if p.is_dir() {
                wanted.push((p.clone(), RecursiveMode::Recursive));
            }
        }
        for (path, mode) in wanted {
            let Ok(meta) = std::fs::metadata(&path) else { continue };
            let id = (meta.dev(), meta.ino());
            match self.watched.get(&path) {
                Some(old) if *old == id => continue,
                Some(_) => {
                    let _ = watcher.unwatch(&path);
                }
                None => {}
            }
            match watcher.watch(&path, mode) {
                Ok(()) => {
                    self.watched.insert(path.clone(), id);
                    self.failed.remove(&path);
                }
                Err(e) => {
                    let msg = e.to_string();
                    if self.failed.get(&path) != Some(&msg) {
                        tracing::warn!(path = %path.display(), "cannot watch for changes ({msg}); the poll still sees them");
                        self.failed.insert(path, msg);
                    }
                }
            }
        }
    }
}

async fn watch(paths: Vec<PathBuf>, poll: Duration, metrics: Arc<Metrics>, stores: Stores, tx: UnboundedSender<Signal>) {
    let (event_tx, mut events) = tokio::sync::mpsc::unbounded_channel();
    let mut watches = Watches::new(event_tx);
    // Watched before the first read: a change during it is seen.
    watches.ensure(&paths);
    // Shared with the blocking thread that refreshes it; a panic there
    // (a bug) leaves it usable for the next refresh.
    let set = Arc::new(std::sync::Mutex::new(ManifestSet::new(paths.clone())));
    let mut pending = Pending::default();
    let mut listed = false;
    let mut next_poll = Instant::now() + poll;
    // The first refresh is due at once.
    let mut due = Some(Instant::now());
    // Closed when inotify could not be set up: the poll alone remains.
    let mut watching = true;
    loop {
        let wake = due.map_or(next_poll, |d| d.min(next_poll));
        tokio::select! {
            event = events.recv(), if watching => {
                let Some(event) = event else {
                    watching = false;
                    continue;
                };
                if pending.note(&event, &paths) {
                    let soon = Instant::now() + DEBOUNCE;
                    due = Some(due.map_or(soon, |d| d.min(soon)));
                }
                continue;
            }
            () = tokio::time::sleep_until(wake.into()) => {}
        }
        let now = Instant::now();
        if now >= next_poll {
            next_poll = now + poll;
        } else if due.is_none_or(|d| now < d) {
            continue;
        }
        due = None;
        let trigger = pending.since.take().unwrap_or_else(SystemTime::now);
        // Files written in place and not closed wait until they are quiet.
        let held: HashMap<PathBuf, Instant> =
            pending.writing.keys().filter_map(|p| pending.held_until(p, now).map(|t| (p.clone(), t))).collect();
        pending.writing.retain(|p, _| held.contains_key(p));
        if let Some(t) = held.values().min() {
            due = Some(*t);
        }
        // Listing, reading and parsing is blocking file I/O and CPU work:
        // off the runtime's workers, so the health server keeps answering.
        let started = Instant::now();
        let shared = set.clone();
        let refreshed = tokio::task::spawn_blocking(move || {
            let mut manifests = shared.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let update = manifests.refresh(&|p| held.contains_key(p));
            (update, manifests.counts())
        })
        .await;
        let Ok((update, counts)) = refreshed else {
            tracing::error!("reading the manifests panicked; the model keeps its objects, and the next change is read again");
            metrics.error(reason::MANIFEST);
            continue;
        };
        watches.ensure(&paths);
        metrics.errors_by(reason::MANIFEST, update.errors.len());
        for e in &update.errors {
            tracing::warn!(location = %e.location, "manifest: {}", e.reason);
        }
        if update.read > 0 {
            tracing::debug!(files = update.read, deltas = update.deltas.len(), took_ms = started.elapsed().as_millis(), "manifests read");
        }
        let mut kinds: Vec<Kind> = update.deltas.iter().map(|d| d.kind).collect();
        kinds.sort_unstable();
        kinds.dedup();
        stores.push_all(update.deltas);
        for kind in Kind::ALL {
            stores.set_len(kind, counts.get(&kind).copied().unwrap_or(0));
        }
        // The first read is the list every kind waits for; after it, a
        // change is a change of the kinds it touched.
        let signals: Vec<Signal> = if listed {
            kinds.into_iter().map(|kind| Signal::Changed { kind, trigger, stamped: false }).collect()
        } else {
            listed = true;
            Kind::ALL.into_iter().map(|kind| Signal::Listed { kind }).collect()
        };
        for signal in signals {
            if tx.send(signal).is_err() {
                return; // the sync loop is gone: shutting down
            }
        }
    }
}

/// The objects of the last read, by kind.
#[cfg(test)]
pub(crate) type Known = std::collections::BTreeMap<Kind, std::collections::BTreeSet<ObjectRef>>;

/// The deltas that take the model from the objects of the last read
/// (`known`, updated) to `read`'s: every object read, and a removal for
/// each object that is gone. For the tests of the layers above, which
/// hand over one text at a time.
#[cfg(test)]
pub(crate) fn relist(known: &mut Known, read: BTreeMap<(Kind, ObjectRef), Delta>) -> Vec<Delta> {
    let mut now = Known::new();
    for (kind, id) in read.keys() {
        now.entry(*kind).or_default().insert(id.clone());
    }
    let mut deltas: Vec<Delta> = read.into_values().collect();
    for (kind, ids) in &*known {
        let current = now.get(kind);
        deltas.extend(ids.iter().filter(|id| !current.is_some_and(|c| c.contains(*id))).map(|id| Delta::removed(*kind, id.clone())));
    }
    *known = now;
    deltas
}

/// What the agent makes of one manifest file's `text` (`source` names it):
/// its objects converted as `run` converts them (JSON items straight into
/// the wire shapes), and its problems. When the text does not parse, its
/// error is among them, and `run` would keep the file's previous objects
/// rather than take these.
pub fn read_file_text(source: &str, text: &str) -> ManifestRead {
    let mut objects = crate::source::manifest_set::FileObjects::default();
    let result = crate::source::manifest::parse_text(source, text, &mut objects);
    objects.finish();
    let mut errors = objects.problems;
    errors.extend(result.err());
    ManifestRead { deltas: objects.deltas.into_iter().map(|d| ((d.kind, d.id.clone()), d)).collect(), errors }
}

/// [`read_file_text`] of a file named `t.yaml`, for the tests of the layers
/// above the source.
#[cfg(test)]
pub(crate) fn read_text(text: &str) -> ManifestRead {
    read_file_text("t.yaml", text)
}

/// The cluster `text` describes, as `run` builds it, with the problems of
/// its objects and documents.
#[cfg(test)]
pub(crate) fn cluster_from_text(text: &str) -> (crate::model::Cluster, Vec<String>) {
    let read = read_text(text);
    let mut model = crate::model::store::Model::default();
    model.apply(read.deltas.into_values());
    let mut problems: Vec<String> = read.errors.iter().map(ToString::to_string).collect();
    problems.extend(model.problems().map(|p| p.error.to_string()));
    (model.cluster, problems)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn duplicates_keep_the_last_and_nameless_objects_keep_their_location() {
        let read = read_text(
            "kind: Service\nmetadata: {name: a}\nspec: {clusterIP: 10.96.0.1, ports: [{port: 80}]}\n---\n\
             kind: Service\nmetadata: {name: a}\nspec: {clusterIP: 10.96.0.2, ports: [{port: 80}]}\n---\n\
             kind: Service\nspec: {clusterIP: 10.96.0.3, ports: [{port: 80}]}\n---\n\
             metadata: {name: kindless}\n---\n\
             kind: Deployment\nmetadata: {name: ignored}\n",
        );
        let a = &read.deltas[&(Kind::Service, ObjectRef::new("default", "a"))];
        assert!(a.problems.iter().any(|p| p.error.reason.contains("more than once")), "{a:?}");
        let nameless: Vec<_> = read.deltas.keys().filter(|(_, id)| id.name.starts_with("t.yaml")).collect();
        assert_eq!(nameless.len(), 1, "{:?}", read.deltas.keys());
        assert_eq!(read.errors.len(), 1, "{:?}", read.errors);
        assert!(read.errors[0].reason.contains("no kind"));
        assert_eq!(read.deltas.len(), 2, "the Deployment is skipped");
    }

    /// The next signal, within a generous limit (a stuck watcher fails the
    /// test instead of hanging it).
    async fn next(rx: &mut tokio::sync::mpsc::UnboundedReceiver<Signal>) -> Signal {
        tokio::time::timeout(Duration::from_secs(20), rx.recv()).await.expect("a signal in time").expect("the watcher runs")
    }

    #[tokio::test]
    async fn the_first_read_lists_and_later_changes_come_through_inotify() {
        let dir = std::env::temp_dir().join(format!("tp-manifest-watch-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("mkdir");
        let svc =
            |name: &str, ip: &str| format!("kind: Service\nmetadata: {{name: {name}}}\nspec: {{clusterIP: {ip}, ports: [{{port: 80}}]}}\n");
        std::fs::write(dir.join("a.yaml"), svc("a", "10.96.0.1")).expect("write");
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        // No poll within the test: what arrives comes through inotify.
        let stores = start(vec![dir.clone()], Duration::from_hours(1), Arc::new(Metrics::new()), tx);
        for kind in Kind::ALL {
            assert!(matches!(next(&mut rx).await, Signal::Listed { kind: k } if k == kind));
        }
        assert_eq!(stores.drain().len(), 1);
        assert_eq!(stores.len(Kind::Service), 1);

        // A file renamed into place.
        std::fs::write(dir.join(".b.yaml.tmp"), svc("b", "10.96.0.2")).expect("write");
        std::fs::rename(dir.join(".b.yaml.tmp"), dir.join("b.yaml")).expect("rename");
        assert!(matches!(next(&mut rx).await, Signal::Changed { kind: Kind::Service, .. }));
        let deltas = stores.drain();
        assert_eq!(deltas.iter().map(|d| &*d.id.name).collect::<Vec<_>>(), ["b"], "only the new file is read");

        // Written in place and closed; then deleted.
        std::fs::write(dir.join("a.yaml"), svc("a", "10.96.0.3")).expect("write");
        assert!(matches!(next(&mut rx).await, Signal::Changed { kind: Kind::Service, .. }));
        let deltas = stores.drain();
        assert!(matches!(&deltas[..], [d] if &*d.id.name == "a" && d.object.is_some()), "{deltas:?}");
        std::fs::remove_file(dir.join("a.yaml")).expect("rm");
        assert!(matches!(next(&mut rx).await, Signal::Changed { kind: Kind::Service, .. }));
        let deltas = stores.drain();
        assert!(matches!(&deltas[..], [d] if &*d.id.name == "a" && !d.present), "{deltas:?}");
        assert_eq!(stores.len(Kind::Service), 1);
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn event(kind: EventKind, path: &str) -> notify::Event {
        notify::Event::new(kind).add_path(PathBuf::from(path))
    }

    #[test]
    fn in_place_writes_are_held_until_closed_or_quiet() {
        let roots = [PathBuf::from("/m")];
        let mut p = Pending::default();
        let now = Instant::now();
        assert!(!p.note(&event(EventKind::Access(AccessKind::Open(AccessMode::Any)), "/m/a.yaml"), &roots), "reads are no change");
        assert!(!p.note(&event(EventKind::Modify(ModifyKind::Data(notify::event::DataChange::Any)), "/elsewhere/a.yaml"), &roots));
        assert!(p.note(&event(EventKind::Modify(ModifyKind::Data(notify::event::DataChange::Any)), "/m/a.yaml"), &roots));
        assert!(p.held_until(Path::new("/m/a.yaml"), now).is_some(), "written, not closed");
        assert!(p.held_until(Path::new("/m/a.yaml"), now + QUIET + Duration::from_millis(50)).is_none(), "quiet for long enough");
        assert!(p.note(&event(EventKind::Access(AccessKind::Close(AccessMode::Write)), "/m/a.yaml"), &roots));
        assert!(p.held_until(Path::new("/m/a.yaml"), now).is_none(), "closed");
        p.note(&event(EventKind::Modify(ModifyKind::Data(notify::event::DataChange::Any)), "/m/b.yaml"), &roots);
        p.note(&event(EventKind::Modify(ModifyKind::Name(notify::event::RenameMode::To)), "/m/b.yaml"), &roots);
        assert!(p.held_until(Path::new("/m/b.yaml"), now).is_none(), "replaced by a rename");
        assert!(p.since.is_some());
    }
}
