//! The objects of a set of manifest files, kept file by file, so that a
//! change costs reading the file that changed:
//!
//! - Each file is known by a stamp (device, inode, size, mtime, ctime).
//!   [`ManifestSet::refresh`] lists the files (a stat each) and reads only
//!   those whose stamp changed, the new ones, and the ones gone.
//! - A file that parses replaces what it held: its objects become deltas,
//!   and an object it no longer holds is removed. A file that does not
//!   parse (half written, or garbage) keeps the objects of its last good
//!   read, and says so; a file deleted from a directory takes its objects
//!   with it. A path the agent was given that is missing, or a directory
//!   replaced by a file that does not parse, keeps the objects it had, as
//!   an API server that cannot be reached keeps the datapath as it was.
//! - An object defined in several files is taken from the last file in
//!   path order, and the duplicate is reported on it. Only an index of
//!   which files define which objects is kept here (the model holds the
//!   objects), so when the winning definition moves to a file that did
//!   not change, that file is read again.
//!
//! Objects are converted as they are parsed, into the same deltas the API
//! server's watchers make: JSON text straight into the watchers' wire
//! shapes (`source::wire`), YAML documents through their JSON value, as
//! `delta::delta_from_value` does for the tests' objects.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::Value;

use crate::model::ObjectRef;
use crate::model::store::{Delta, Kind, ObjectError, ObjectProblem};
use crate::source::delta::{delta_from_value, node_delta, service_delta, slice_delta};
use crate::source::manifest::{self, ManifestError, Object, Sink};
use crate::source::wire::{WireNode, WireService, WireSlice};
use crate::source::wire_v1beta1::WireSliceV1beta1;

/// The kind an object declares, if it is one the agent reads. Other kinds
/// (Deployments and the like, often in the same directory) are skipped
/// silently.
fn kind_of(object: &Object<'_>) -> Result<Option<Kind>, String> {
    match object.kind().unwrap_or_default() {
        "Service" => Ok(Some(Kind::Service)),
        "EndpointSlice" => Ok(Some(Kind::EndpointSlice)),
        "Node" => Ok(Some(Kind::Node)),
        "" => Err("object has no kind".into()),
        _ => Ok(None),
    }
}

/// Converts one object given as JSON text, as the watchers convert what
/// they receive (`delta::*_delta` over the wire shapes). Text the wire
/// shapes refuse is converted through its JSON value instead, which names
/// the object and the malformed field exactly as for any other source.
pub(crate) fn delta_from_json(kind: Kind, api_version: Option<&str>, text: &str) -> Delta {
    let typed = match kind {
        Kind::Service => serde_json::from_str::<WireService>(text).map(service_delta),
        // What `kubectl get endpointslices -o json` gives on 1.17-1.20.
        Kind::EndpointSlice if api_version == Some("discovery.k8s.io/v1beta1") => {
            serde_json::from_str::<WireSliceV1beta1>(text).map(|s| slice_delta(s.into_v1()))
        }
        Kind::EndpointSlice => serde_json::from_str::<WireSlice>(text).map(slice_delta),
        Kind::Node => serde_json::from_str::<WireNode>(text).map(node_delta),
    };
    match typed {
        Ok(d) => d,
        Err(_) => match serde_json::from_str::<Value>(text) {
            Ok(v) => delta_from_value(kind, &v),
            // Only a value nested deeper than serde_json's recursion limit
            // gets here.
            Err(e) => {
                let mut d = Delta::removed(kind, ObjectRef::new("", ""));
                d.present = true;
                let error = ObjectError { kind: kind.as_str().into(), object: String::new(), reason: format!("malformed: {e}") };
                d.problems.push(ObjectProblem { kind, error, service: None });
                d
            }
        },
    }
}

/// What one file holds, converted as it is parsed.
#[derive(Debug, Default)]
pub(crate) struct FileObjects {
    /// In file order; [`FileObjects::finish`] keeps the last definition
    /// of each object.
    pub deltas: Vec<Delta>,
    /// Documents that are not objects, objects without a kind.
    pub problems: Vec<ManifestError>,
}

impl Sink for FileObjects {
    fn object(&mut self, location: &str, object: Object<'_>) {
        let kind = match kind_of(&object) {
            Ok(Some(k)) => k,
            Ok(None) => return,
            Err(reason) => return self.problems.push(ManifestError { location: location.to_string(), reason }),
        };
        let mut d = match &object {
            Object::Json { text, api_version, .. } => delta_from_json(kind, api_version.as_deref(), text),
            Object::Value(v) => delta_from_value(kind, v),
        };
        // Nodes are cluster-scoped: no namespace, as the watcher has them,
        // so that one Node written with and without one is one object.
        if kind == Kind::Node {
            d.id.namespace = "".into();
        }
        // A nameless object is reported under its location ("file.yaml#2"),
        // so that two of them do not replace each other.
        if d.id.name.is_empty() {
            d.id.name = location.into();
        }
        for p in &mut d.problems {
            if p.error.object.is_empty() {
                p.error.object = location.to_string();
            }
        }
        self.deltas.push(d);
    }

    fn problem(&mut self, error: ManifestError) {
        self.problems.push(error);
    }

    fn restart(&mut self) {
        self.deltas.clear();
        self.problems.clear();
    }
}

impl manifest::PartSink for FileObjects {
    fn with_room(objects: usize) -> Self {
        FileObjects { deltas: Vec::with_capacity(objects), problems: Vec::new() }
    }

    fn append(&mut self, mut later: Self) {
        if self.deltas.is_empty() {
            std::mem::swap(&mut self.deltas, &mut later.deltas);
        } else {
            self.deltas.append(&mut later.deltas);
        }
        self.problems.append(&mut later.problems);
    }
}

impl FileObjects {
    /// Keeps the last definition of each object, and reports the
    /// duplicate on it when both definitions were usable. The objects end
    /// up sorted by kind and id: the model takes a first list of them in
    /// bulk, in that order (`Model::apply`), without sorting them again.
    pub(crate) fn finish(&mut self) {
        let mut order: Vec<u32> = (0..self.deltas.len() as u32).collect();
        // Stable: the definitions of one object stay in file order.
        order.sort_by(|a, b| {
            let (a, b) = (&self.deltas[*a as usize], &self.deltas[*b as usize]);
            (a.kind, &a.id).cmp(&(b.kind, &b.id))
        });
        permute(&mut self.deltas, &order);
        drop(order);
        let mut drop = vec![false; self.deltas.len()];
        let mut told = Vec::new();
        for second in 1..self.deltas.len() {
            let first = second - 1;
            let (a, b) = (&self.deltas[first], &self.deltas[second]);
            if (a.kind, &a.id) == (b.kind, &b.id) {
                // `second` comes later in the file.
                drop[first] = true;
                if a.object.is_some() && b.object.is_some() {
                    told.push(second);
                }
            }
        }
        for i in told {
            duplicate(&mut self.deltas[i], "defined more than once; the last definition wins".into());
        }
        if drop.iter().any(|d| *d) {
            let mut i = 0;
            self.deltas.retain(|_| {
                i += 1;
                !drop[i - 1]
            });
        }
        self.deltas.shrink_to_fit();
    }
}

/// Puts `items` in `order` (`items[k]` becomes what `items[order[k]]` was,
/// `order` a permutation), in place: one swap per item moved, by following
/// each cycle of the permutation once.
fn permute<T>(items: &mut [T], order: &[u32]) {
    let mut placed = vec![false; items.len()];
    for start in 0..items.len() {
        if placed[start] {
            continue;
        }
        let mut at = start;
        loop {
            placed[at] = true;
            let from = order[at] as usize;
            if from == start {
                break;
            }
            items.swap(at, from);
            at = from;
        }
    }
}

fn duplicate(d: &mut Delta, reason: String) {
    let service = (d.kind == Kind::Service).then(|| d.id.clone());
    let object = if d.kind == Kind::Node { d.id.name.to_string() } else { d.id.to_string() };
    d.problems.push(ObjectProblem { kind: d.kind, error: ObjectError { kind: d.kind.as_str().into(), object, reason }, service });
}

/// Reads one file's objects.
pub(crate) fn read_file(path: &Path) -> Result<FileObjects, ManifestError> {
    let mut objects = FileObjects::default();
    manifest::read_file_in_parts(path, &mut objects)?;
    objects.finish();
    Ok(objects)
}

/// What identifies a file's content without reading it. A file written in
/// place changes its size, mtime or ctime; one replaced by a rename
/// changes its inode; one behind a swapped symlink, its device or inode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stamp {
    dev: u64,
    ino: u64,
    len: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl Stamp {
    fn of(m: &std::fs::Metadata) -> Stamp {
        Stamp { dev: m.dev(), ino: m.ino(), len: m.len(), mtime: (m.mtime(), m.mtime_nsec()), ctime: (m.ctime(), m.ctime_nsec()) }
    }
}

/// A file of the set, by number (the index stores numbers, not paths).
type FileId = u32;

#[derive(Debug)]
struct FileState {
    id: FileId,
    /// The stamp of the last read, parsed or not.
    stamp: Stamp,
    /// Whether a read parsed, and how many objects the last one that did
    /// held.
    parsed: bool,
    objects: usize,
}

/// An object's identity in the index: its kind and id. The id shares its
/// strings with the deltas (and so with the model), so the index (one
/// entry per object of the cluster) holds no copy of them; at 100k
/// Services a copy per key was 200k allocations on the cold start's path.
type IndexKey = (Kind, ObjectRef);

/// The index and the maps beside it: keys are ids, hashed often (twice per
/// object at a cold start).
type FastMap<K, V> = foldhash::HashMap<K, V>;

/// The files defining one object, in path order: the last one wins.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Owners {
    One(FileId),
    Many(Box<[FileId]>),
}

impl Owners {
    fn ids(&self) -> &[FileId] {
        match self {
            Owners::One(id) => std::slice::from_ref(id),
            Owners::Many(ids) => ids,
        }
    }
    fn winner(&self) -> FileId {
        *self.ids().last().unwrap_or(&FileId::MAX)
    }
    fn is_duplicate(&self) -> bool {
        self.ids().len() > 1
    }
}

/// What one refresh found.
#[derive(Debug, Default)]
pub(crate) struct Update {
    /// One delta per object that may have changed (the model tells the
    /// unchanged ones apart), and a removal per object gone.
    pub deltas: Vec<Delta>,
    /// Files that could not be read or do not parse, documents that are
    /// not objects, paths that cannot be listed.
    pub errors: Vec<ManifestError>,
    /// Files read.
    pub read: usize,
}

/// The manifest files under some paths, and which objects each holds.
#[derive(Debug)]
pub(crate) struct ManifestSet {
    paths: Vec<PathBuf>,
    files: BTreeMap<Arc<Path>, FileState>,
    /// Paths by file number (`None`: a number free for reuse).
    by_id: Vec<Option<Arc<Path>>>,
    index: FastMap<IndexKey, Owners>,
    /// The listing errors reported last time, so that a path that stays
    /// missing is reported once, not on every refresh.
    listing_errors: Vec<ManifestError>,
}

/// What became of a file in one refresh.
enum Outcome {
    Parsed(FileObjects),
    Failed(ManifestError),
    Gone,
}

impl ManifestSet {
    pub(crate) fn new(paths: Vec<PathBuf>) -> ManifestSet {
        ManifestSet { paths, files: BTreeMap::new(), by_id: Vec::new(), index: FastMap::default(), listing_errors: Vec::new() }
    }

    /// Objects of each kind the files hold.
    pub(crate) fn counts(&self) -> BTreeMap<Kind, usize> {
        let mut counts = BTreeMap::new();
        for (kind, _) in self.index.keys() {
            *counts.entry(*kind).or_default() += 1;
        }
        counts
    }

    fn path(&self, id: FileId) -> Option<&Arc<Path>> {
        self.by_id.get(id as usize).and_then(Option::as_ref)
    }

    /// Lists the files, reads those that changed (except the ones `hold`
    /// says are still being written), and returns what changed.
    pub(crate) fn refresh(&mut self, hold: &dyn Fn(&Path) -> bool) -> Update {
        let mut update = Update::default();
        let listing = manifest::list(&self.paths);
        if listing.errors != self.listing_errors {
            update.errors.extend(listing.errors.iter().filter(|e| !self.listing_errors.contains(e)).cloned());
            self.listing_errors = listing.errors;
        }
        let mut batch: Vec<(FileId, Outcome)> = Vec::new();
        let mut present: HashSet<&Path> = HashSet::new();
        for (path, meta) in &listing.files {
            present.insert(path.as_path());
            let stamp = Stamp::of(meta);
            let known = self.files.get(path.as_path());
            if known.is_some_and(|f| f.stamp == stamp) || hold(path) {
                continue;
            }
            // A file emptied in place (same inode) that held objects is a
            // rewrite caught between its truncation and its first write:
            // `kubectl get -o json > file` truncates before kubectl has
            // fetched anything, and an in-place writer's close can be read
            // after the next writer's O_TRUNC. Removing its objects would
            // cut their traffic for that moment, so it is taken as not
            // parsing. An empty file renamed over it (a whole write),
            // deleting it, or a comment alone in it removes them.
            let emptied =
                stamp.len == 0 && known.is_some_and(|f| (f.stamp.dev, f.stamp.ino) == (stamp.dev, stamp.ino) && f.parsed && f.objects > 0);
            let id = if let Some(state) = self.files.get_mut(path.as_path()) {
                state.stamp = stamp;
                state.id
            } else {
                let id = self.by_id.iter().position(Option::is_none).unwrap_or_else(|| {
                    self.by_id.push(None);
                    self.by_id.len() - 1
                }) as FileId;
                let shared: Arc<Path> = Arc::from(path.as_path());
                self.by_id[id as usize] = Some(shared.clone());
                self.files.insert(shared, FileState { id, stamp, parsed: false, objects: 0 });
                id
            };
            update.read += 1;
            batch.push((id, if emptied { Outcome::Failed(emptied_error(path)) } else { read(path) }));
        }
        // A given path that is now a file which does not parse (a
        // directory replaced by garbage) keeps what was under it.
        let broken_roots: Vec<&PathBuf> = self
            .paths
            .iter()
            .filter(|root| present.contains(root.as_path()))
            .filter(|root| match self.files.get(root.as_path()) {
                Some(f) => match batch.iter().find(|(id, _)| *id == f.id) {
                    Some((_, outcome)) => !matches!(outcome, Outcome::Parsed(_)),
                    None => !f.parsed,
                },
                None => true,
            })
            .collect();
        for (path, state) in &self.files {
            // Files under a directory that could not be listed, or under a
            // given path that is missing or broken, are unknown, not gone.
            let unknown = listing.unlisted.iter().any(|u| path.starts_with(u))
                || broken_roots.iter().any(|root| path.starts_with(root) && **path != ***root);
            if !present.contains(&**path) && !unknown {
                batch.push((state.id, Outcome::Gone));
            }
        }
        self.apply(batch, &mut update);
        update
    }

    /// Takes the files' new contents into the index and works out the
    /// deltas.
    fn apply(&mut self, mut batch: Vec<(FileId, Outcome)>, update: &mut Update) {
        // For every object a file read here defined or defines: the winning
        // file and whether it was a duplicate, before this refresh.
        let mut before: FastMap<IndexKey, (Option<FileId>, bool)> = FastMap::default();
        let mut done: HashSet<FileId> = HashSet::new();
        while !batch.is_empty() {
            // The objects the changed files held, by file: one pass over the
            // index for the whole batch (files never read or without
            // objects need none).
            let changed: HashSet<FileId> = batch
                .iter()
                .filter(|(id, o)| {
                    !matches!(o, Outcome::Failed(_)) && self.path(*id).and_then(|p| self.files.get(p)).is_some_and(|f| f.objects > 0)
                })
                .map(|(id, _)| *id)
                .collect();
            let mut old: HashMap<FileId, Vec<IndexKey>> = HashMap::new();
            if !changed.is_empty() {
                for (key, owners) in &self.index {
                    for id in owners.ids() {
                        if changed.contains(id) {
                            old.entry(*id).or_default().push(key.clone());
                        }
                    }
                }
            }
            // Phase 1: the index as the files now are.
            let mut parsed: Vec<(FileId, Vec<Delta>)> = Vec::new();
            // Whether every object read here is new to the index: then each
            // file read wins all it defines (a first read, as a rule).
            let mut all_new = true;
            for (id, outcome) in batch.drain(..) {
                done.insert(id);
                let deltas = match outcome {
                    Outcome::Failed(e) => {
                        let kept = match self.path(id).and_then(|p| self.files.get(p)) {
                            Some(f) if f.parsed => format!("keeping the {} objects of its last good read", f.objects),
                            _ => "nothing in it is used until it parses".into(),
                        };
                        update.errors.push(ManifestError { location: e.location, reason: format!("{}; {kept}", e.reason) });
                        continue;
                    }
                    Outcome::Parsed(objects) => {
                        update.errors.extend(objects.problems);
                        if let Some(state) = self.path(id).cloned().and_then(|p| self.files.get_mut(&p)) {
                            state.parsed = true;
                            state.objects = objects.deltas.len();
                        }
                        objects.deltas
                    }
                    Outcome::Gone => {
                        if let Some(path) = self.by_id.get_mut(id as usize).and_then(Option::take) {
                            self.files.remove(&path);
                        }
                        Vec::new()
                    }
                };
                let old = old.remove(&id).unwrap_or_default();
                if !old.is_empty() {
                    let new: foldhash::HashSet<(Kind, &ObjectRef)> = deltas.iter().map(|d| (d.kind, &d.id)).collect();
                    for key in old {
                        if !new.contains(&(key.0, &key.1)) {
                            self.remove_owner(key, id, &mut before, update);
                        }
                    }
                }
                for d in &deltas {
                    all_new &= self.add_owner((d.kind, d.id.clone()), id, &mut before);
                }
                parsed.push((id, deltas));
            }
            // Phase 2: each object's winning definition. A file read here
            // hands over the objects it wins.
            for (id, mut deltas) in parsed {
                deltas.retain_mut(|d| {
                    if all_new {
                        return true;
                    }
                    let Some(owners) = self.index.get(&(d.kind, d.id.clone())) else {
                        return false;
                    };
                    if owners.winner() != id {
                        return false;
                    }
                    if owners.is_duplicate() {
                        let files: Vec<String> =
                            owners.ids().iter().filter_map(|o| self.path(*o)).map(|p| p.display().to_string()).collect();
                        let winner = self.path(id).map(|p| p.display().to_string()).unwrap_or_default();
                        duplicate(d, format!("defined in more than one file ({}); the one in {winner} wins", files.join(", ")));
                    }
                    true
                });
                // The first file's deltas become the list (no copy of
                // 10k deltas at a cold start).
                if update.deltas.is_empty() {
                    update.deltas = deltas;
                } else {
                    update.deltas.append(&mut deltas);
                }
            }
            // Objects whose winner did not change here but whose standing
            // did (another file took or gave up a definition): their
            // winner's file is read again for its definition.
            let mut again: BTreeSet<FileId> = BTreeSet::new();
            for (key, (winner_before, dup_before)) in &before {
                let Some(owners) = self.index.get(key) else { continue };
                let winner = owners.winner();
                if done.contains(&winner) || (Some(winner), owners.is_duplicate()) == (*winner_before, *dup_before) {
                    // Handed over above, or the file no longer parses (the
                    // model keeps what it has), or nothing changed for it.
                    continue;
                }
                again.insert(winner);
            }
            for id in again {
                let Some(path) = self.path(id).cloned() else { continue };
                update.read += 1;
                batch.push((id, read(&path)));
            }
        }
    }

    fn record_before(&self, key: &IndexKey, before: &mut FastMap<IndexKey, (Option<FileId>, bool)>) {
        if !before.contains_key(key) {
            let state = self.index.get(key).map_or((None, false), |o| (Some(o.winner()), o.is_duplicate()));
            before.insert(key.clone(), state);
        }
    }

    /// `id` no longer defines `key`.
    fn remove_owner(&mut self, key: IndexKey, id: FileId, before: &mut FastMap<IndexKey, (Option<FileId>, bool)>, update: &mut Update) {
        match self.index.get(&key) {
            Some(Owners::One(only)) if *only == id => {
                self.index.remove(&key);
                update.deltas.push(Delta::removed(key.0, key.1));
            }
            Some(Owners::Many(ids)) => {
                self.record_before(&key, before);
                let rest: Vec<FileId> = ids.iter().copied().filter(|o| *o != id).collect();
                let owners = if rest.len() == 1 { Owners::One(rest[0]) } else { Owners::Many(rest.into_boxed_slice()) };
                self.index.insert(key, owners);
            }
            _ => {}
        }
    }

    /// `id` defines `key`.
    /// Whether no file defined `key` before.
    fn add_owner(&mut self, key: IndexKey, id: FileId, before: &mut FastMap<IndexKey, (Option<FileId>, bool)>) -> bool {
        let owners = match self.index.get(&key) {
            None => {
                self.index.insert(key, Owners::One(id));
                return true;
            }
            Some(owners) if owners.ids().contains(&id) => return false,
            Some(owners) => owners.ids().to_vec(),
        };
        self.record_before(&key, before);
        let mut ids = owners;
        ids.push(id);
        ids.sort_by(|a, b| self.path(*a).cmp(&self.path(*b)));
        self.index.insert(key, Owners::Many(ids.into_boxed_slice()));
        false
    }
}

fn emptied_error(path: &Path) -> ManifestError {
    ManifestError {
        location: path.display().to_string(),
        reason: "emptied in place, taken as a rewrite in progress (to remove its objects, delete the file, rename an empty one over it, or leave only a comment in it)".into(),
    }
}

fn read(path: &Path) -> Outcome {
    match read_file(path) {
        Ok(objects) => Outcome::Parsed(objects),
        Err(e) => Outcome::Failed(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::store::Object as ModelObject;

    #[test]
    fn a_permutation_puts_every_item_in_its_place() {
        for order in [vec![], vec![0], vec![1, 0], vec![2, 0, 1], vec![0, 2, 1, 4, 3], vec![3, 4, 0, 1, 2, 5]] {
            let mut items: Vec<u32> = (10..10 + order.len() as u32).collect();
            let want: Vec<u32> = order.iter().map(|i| 10 + i).collect();
            permute(&mut items, &order);
            assert_eq!(items, want, "{order:?}");
        }
    }

    #[test]
    fn json_text_converts_like_a_json_value() {
        let objects = [
            r#"{"apiVersion":"v1","kind":"Service","metadata":{"name":"web","namespace":"shop","uid":"u1","labels":{"a":"b"}},"spec":{"clusterIP":"10.96.0.10","ports":[{"name":"http","port":80,"protocol":"TCP","nodePort":30080}],"type":"NodePort","topologyKeys":["kubernetes.io/hostname","*"],"sessionAffinity":"ClientIP"},"status":{"loadBalancer":{}}}"#,
            r#"{"kind":"Service","metadata":{"name":"bad","uid":"u2"},"spec":{"clusterIP":"10.96.0.999","ports":[{"port":80}]}}"#,
            r#"{"kind":"Service","metadata":{"name":"typo"},"spec":{"ports":[{"port":"http"}]}}"#,
            r#"{"kind":"Service","metadata":{"name":"twice","name":"again"},"spec":{"clusterIP":"10.96.0.11","ports":[{"port":80}]}}"#,
            r#"{"kind":"Service","spec":{"clusterIP":"10.96.0.12"}}"#,
            r#"{"kind":"Service","metadata":{"name":"headless"},"spec":{"clusterIP":"None"}}"#,
            r#"{"addressType":"IPv4","apiVersion":"discovery.k8s.io/v1","endpoints":[{"addresses":["10.244.0.1"],"conditions":{"ready":true},"nodeName":"a","zone":"z"},{"addresses":["nope"]}],"kind":"EndpointSlice","metadata":{"labels":{"kubernetes.io/service-name":"web"},"name":"web-1","namespace":"shop"},"ports":[{"port":8080}]}"#,
            r#"{"addressType":"IPv4","apiVersion":"discovery.k8s.io/v1beta1","endpoints":[{"addresses":["10.244.0.2"],"topology":{"kubernetes.io/hostname":"b","topology.kubernetes.io/zone":"z2"}}],"kind":"EndpointSlice","metadata":{"labels":{"kubernetes.io/service-name":"web"},"name":"web-2","namespace":"shop"}}"#,
            r#"{"addressType":"IPv4","kind":"EndpointSlice","metadata":{"labels":{"kubernetes.io/service-name":7},"name":"web-3"}}"#,
            r#"{"kind":"Node","metadata":{"name":"n1","labels":{"topology.kubernetes.io/zone":"z1"},"deletionTimestamp":"2024-05-01T10:00:00Z"},"status":{"conditions":[]}}"#,
            r#"{"kind":"Node","metadata":{"labels":{"a":"b"}}}"#,
        ];
        for text in objects {
            let value: Value = serde_json::from_str(text).expect("test object");
            let kind = match value["kind"].as_str() {
                Some("Service") => Kind::Service,
                Some("EndpointSlice") => Kind::EndpointSlice,
                _ => Kind::Node,
            };
            let mut from_value = delta_from_value(kind, &value);
            if kind == Kind::Node {
                from_value.id.namespace = "".into();
            }
            let api_version = value["apiVersion"].as_str();
            assert_eq!(delta_from_json(kind, api_version, text), from_value, "{text}");
        }
        let d = delta_from_json(Kind::EndpointSlice, Some("discovery.k8s.io/v1beta1"), objects[7]);
        assert!(matches!(&d.object, Some(ModelObject::Slice(s)) if s.endpoints[0].node_name.as_deref() == Some("b")), "{d:?}");
    }

    struct Dir(PathBuf);

    impl Dir {
        fn new(name: &str) -> Dir {
            let p = std::env::temp_dir().join(format!("tp-manifest-set-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&p);
            std::fs::create_dir_all(&p).expect("mkdir");
            Dir(p)
        }
        fn write(&self, name: &str, text: &str) {
            let tmp = self.0.join(format!(".{name}.tmp"));
            std::fs::write(&tmp, text).expect("write");
            std::fs::rename(&tmp, self.0.join(name)).expect("rename");
        }

        /// Truncates and writes the file itself, as `>` and most editors do.
        fn write_in_place(&self, name: &str, text: &str) {
            std::fs::write(self.0.join(name), text).expect("write in place");
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn svc(name: &str, ip: &str) -> String {
        format!("---\nkind: Service\nmetadata: {{name: {name}}}\nspec: {{clusterIP: {ip}, ports: [{{port: 80}}]}}\n")
    }

    /// (name, ClusterIP or "-" for a removal, problems) of each delta.
    fn show(u: &Update) -> Vec<(String, String, usize)> {
        let mut v: Vec<_> = u
            .deltas
            .iter()
            .map(|d| {
                let ip = match &d.object {
                    Some(ModelObject::Service(s)) => s.cluster_ips[0].to_string(),
                    _ => "-".into(),
                };
                (d.id.name.to_string(), ip, d.problems.len())
            })
            .collect();
        v.sort();
        v
    }

    fn s(name: &str, ip: &str, problems: usize) -> (String, String, usize) {
        (name.into(), ip.into(), problems)
    }

    #[test]
    fn only_changed_files_are_read_and_a_broken_file_keeps_its_objects() {
        let dir = Dir::new("files");
        dir.write("a.yaml", &(svc("a1", "10.96.0.1") + &svc("a2", "10.96.0.2")));
        dir.write("b.json", r#"{"kind":"List","items":[{"kind":"Service","metadata":{"name":"b1"},"spec":{"clusterIP":"10.96.0.3","ports":[{"port":80}]}}]}"#);
        let mut set = ManifestSet::new(vec![dir.0.clone()]);
        let u = set.refresh(&|_| false);
        assert_eq!((u.read, show(&u)), (2, vec![s("a1", "10.96.0.1", 0), s("a2", "10.96.0.2", 0), s("b1", "10.96.0.3", 0)]));
        assert_eq!(set.counts()[&Kind::Service], 3);

        let u = set.refresh(&|_| false);
        assert_eq!((u.read, u.deltas.len(), u.errors.len()), (0, 0, 0), "nothing changed, nothing read");

        // Half written: the file keeps its objects and the problem is told.
        dir.write("b.json", r#"{"kind":"List","items":[{"kind":"Service","metadata":{"name":"b1"},"spec":{"clusterIP":"10.9"#);
        let u = set.refresh(&|_| false);
        assert_eq!((u.read, u.deltas.len()), (1, 0));
        assert_eq!(u.errors.len(), 1, "{:?}", u.errors);
        assert!(u.errors[0].location.ends_with("b.json#1"), "{:?}", u.errors);
        assert!(u.errors[0].reason.contains("not valid JSON") && u.errors[0].reason.contains("keeping the 1 objects"), "{:?}", u.errors);

        // Written out: one object changed, one added, a2 gone from a.yaml.
        dir.write("b.json", r#"{"kind":"List","items":[{"kind":"Service","metadata":{"name":"b1"},"spec":{"clusterIP":"10.96.0.4","ports":[{"port":80}]}},{"kind":"Service","metadata":{"name":"b2"},"spec":{"clusterIP":"10.96.0.5","ports":[{"port":80}]}}]}"#);
        dir.write("a.yaml", &svc("a1", "10.96.0.1"));
        let u = set.refresh(&|_| false);
        assert_eq!(u.read, 2);
        assert_eq!(show(&u), [s("a1", "10.96.0.1", 0), s("a2", "-", 0), s("b1", "10.96.0.4", 0), s("b2", "10.96.0.5", 0)]);

        // A file being written is left alone until it is done.
        dir.write("a.yaml", &svc("a1", "10.96.0.9"));
        let u = set.refresh(&|p| p.ends_with("a.yaml"));
        assert_eq!((u.read, u.deltas.len()), (0, 0));
        let u = set.refresh(&|_| false);
        assert_eq!(show(&u), [s("a1", "10.96.0.9", 0)]);

        // Deleted: its objects go.
        std::fs::remove_file(dir.0.join("b.json")).expect("rm");
        let u = set.refresh(&|_| false);
        assert_eq!((u.read, show(&u)), (0, vec![s("b1", "-", 0), s("b2", "-", 0)]));
        assert_eq!(set.counts()[&Kind::Service], 1);
    }

    #[test]
    fn a_file_that_never_parsed_adds_nothing_and_the_rest_works() {
        let dir = Dir::new("never");
        dir.write("a.yaml", &svc("a1", "10.96.0.1"));
        dir.write("garbage.yaml", "kind: [this is not yaml\n");
        let mut set = ManifestSet::new(vec![dir.0.clone()]);
        let u = set.refresh(&|_| false);
        assert_eq!(show(&u), [s("a1", "10.96.0.1", 0)]);
        assert_eq!(u.errors.len(), 1);
        assert!(u.errors[0].reason.contains("not valid YAML") && u.errors[0].reason.contains("nothing in it is used until it parses"));
        std::fs::remove_file(dir.0.join("garbage.yaml")).expect("rm");
        let u = set.refresh(&|_| false);
        assert!(u.deltas.is_empty() && u.errors.is_empty(), "{u:?}");
    }

    #[test]
    fn duplicates_across_files_follow_the_last_file() {
        let dir = Dir::new("dups");
        dir.write("a.yaml", &(svc("x", "10.96.0.1") + &svc("only-a", "10.96.0.7")));
        dir.write("b.yaml", &svc("x", "10.96.0.2"));
        let mut set = ManifestSet::new(vec![dir.0.clone()]);
        let u = set.refresh(&|_| false);
        assert_eq!(show(&u), [s("only-a", "10.96.0.7", 0), s("x", "10.96.0.2", 1)]);
        let d = u.deltas.iter().find(|d| &*d.id.name == "x").expect("x");
        assert!(d.problems[0].error.reason.contains("defined in more than one file"), "{:?}", d.problems);

        // a.yaml changes, b.yaml still wins: nothing to hand over for x.
        dir.write("a.yaml", &(svc("x", "10.96.0.3") + &svc("only-a", "10.96.0.7")));
        let u = set.refresh(&|_| false);
        assert_eq!(show(&u), [s("only-a", "10.96.0.7", 0)]);

        // x leaves b.yaml: a.yaml's definition takes over, read again.
        dir.write("b.yaml", "");
        let u = set.refresh(&|_| false);
        assert_eq!((u.read, show(&u)), (2, vec![s("only-a", "10.96.0.7", 0), s("x", "10.96.0.3", 0)]));

        // x comes back in b.yaml: b wins again, with the duplicate told.
        dir.write("b.yaml", &svc("x", "10.96.0.2"));
        let u = set.refresh(&|_| false);
        assert_eq!(show(&u), [s("x", "10.96.0.2", 1)]);

        // And leaves a.yaml: b's definition is no longer a duplicate.
        dir.write("a.yaml", &svc("only-a", "10.96.0.7"));
        let u = set.refresh(&|_| false);
        assert_eq!(show(&u), [s("only-a", "10.96.0.7", 0), s("x", "10.96.0.2", 0)]);
    }

    #[test]
    fn a_given_path_gone_or_replaced_by_garbage_keeps_its_objects() {
        let dir = Dir::new("roots");
        let root = dir.0.join("manifests");
        std::fs::create_dir_all(&root).expect("mkdir");
        std::fs::write(root.join("a.yaml"), svc("a1", "10.96.0.1")).expect("write");
        std::fs::write(root.join("b.yaml"), svc("b1", "10.96.0.2")).expect("write");
        let mut set = ManifestSet::new(vec![root.clone()]);
        assert_eq!(set.refresh(&|_| false).deltas.len(), 2);

        // The directory replaced by a garbage file: nothing is removed.
        std::fs::rename(&root, dir.0.join("saved")).expect("mv");
        std::fs::write(&root, "kind: [garbage\n").expect("garbage");
        let u = set.refresh(&|_| false);
        assert!(u.deltas.is_empty(), "{u:?}");
        assert_eq!(u.errors.len(), 1, "{:?}", u.errors);

        // Gone altogether: still nothing removed, and said once.
        std::fs::remove_file(&root).expect("rm");
        let u = set.refresh(&|_| false);
        assert!(u.deltas.is_empty(), "{u:?}");
        assert!(u.errors[0].reason.contains("cannot read"), "{:?}", u.errors);
        assert!(set.refresh(&|_| false).errors.is_empty());

        // Back, with b.yaml deleted meanwhile: that one goes.
        std::fs::rename(dir.0.join("saved"), &root).expect("mv back");
        std::fs::remove_file(root.join("b.yaml")).expect("rm b");
        let u = set.refresh(&|_| false);
        assert_eq!(show(&u), [s("b1", "-", 0)]);

        // Replaced by a file that parses: that file is the manifests now.
        std::fs::remove_dir_all(&root).expect("rm dir");
        std::fs::write(&root, svc("c1", "10.96.0.3")).expect("file");
        let u = set.refresh(&|_| false);
        assert_eq!(show(&u), [s("a1", "-", 0), s("c1", "10.96.0.3", 0)]);
    }

    #[test]
    fn an_emptied_file_keeps_its_objects_until_written_or_deleted() {
        let dir = Dir::new("emptied");
        dir.write("a.yaml", &svc("a1", "10.96.0.1"));
        let mut set = ManifestSet::new(vec![dir.0.clone()]);
        assert_eq!(show(&set.refresh(&|_| false)), [s("a1", "10.96.0.1", 0)]);
        // Truncated, as `> a.yaml` leaves it before the writer writes.
        dir.write_in_place("a.yaml", "");
        let u = set.refresh(&|_| false);
        assert!(u.deltas.is_empty(), "{u:?}");
        assert_eq!(u.errors.len(), 1, "{:?}", u.errors);
        assert!(u.errors[0].location.ends_with("a.yaml"), "{:?}", u.errors);
        assert!(u.errors[0].reason.contains("empty") && u.errors[0].reason.contains("keeping the 1 objects"), "{:?}", u.errors);
        // The writer's content arrives: taken.
        dir.write_in_place("a.yaml", &svc("a1", "10.96.0.9"));
        assert_eq!(show(&set.refresh(&|_| false)), [s("a1", "10.96.0.9", 0)]);
        // A new empty file (or one that held nothing) is just empty.
        dir.write("b.yaml", "");
        let u = set.refresh(&|_| false);
        assert!(u.deltas.is_empty() && u.errors.is_empty(), "{u:?}");
        // A comment alone is a file with no objects: they go.
        dir.write_in_place("a.yaml", "# moved\n");
        assert_eq!(show(&set.refresh(&|_| false)), [s("a1", "-", 0)]);
        // So do they when an empty file is renamed over it: a whole write.
        dir.write_in_place("a.yaml", &svc("a1", "10.96.0.9"));
        assert_eq!(show(&set.refresh(&|_| false)), [s("a1", "10.96.0.9", 0)]);
        dir.write("a.yaml", "");
        assert_eq!(show(&set.refresh(&|_| false)), [s("a1", "-", 0)]);
        // Deleting the emptied file removes its objects.
        dir.write_in_place("a.yaml", &svc("a1", "10.96.0.9"));
        assert_eq!(show(&set.refresh(&|_| false)), [s("a1", "10.96.0.9", 0)]);
        dir.write_in_place("a.yaml", "");
        assert_eq!(set.refresh(&|_| false).errors.len(), 1);
        std::fs::remove_file(dir.0.join("a.yaml")).expect("rm");
        assert_eq!(show(&set.refresh(&|_| false)), [s("a1", "-", 0)]);
    }

    #[test]
    fn a_missing_path_is_reported_once() {
        let dir = Dir::new("missing");
        let mut set = ManifestSet::new(vec![dir.0.join("nope")]);
        assert_eq!(set.refresh(&|_| false).errors.len(), 1);
        assert!(set.refresh(&|_| false).errors.is_empty());
        dir.write("nope", &svc("late", "10.96.0.1"));
        let u = set.refresh(&|_| false);
        assert_eq!(show(&u), [s("late", "10.96.0.1", 0)]);
    }
}
