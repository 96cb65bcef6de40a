//! Manifest files as a source of the model, fed to the same sync loop as
//! the API server's watchers.
//!
//! Every time the files change, all of them are read again and handed over
//! like a relist: one delta per object, and a removal for every object the
//! previous read had and this one has not. The model compares each delta
//! with what it holds, so an unchanged object costs its conversion and
//! nothing more.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use tokio::sync::mpsc::UnboundedSender;

use crate::model::ObjectRef;
use crate::model::store::{Delta, Kind, ObjectError, ObjectProblem};
use crate::observe::metrics::{Metrics, reason};
use crate::source::delta::delta_from_value;
use crate::source::feed::{Signal, Stores};
use crate::source::manifest::{self, Document, ManifestError};

/// Everything the manifest files hold, converted.
#[derive(Debug, Default)]
pub struct ManifestRead {
    /// One delta per object, keyed by kind and namespace/name.
    pub deltas: BTreeMap<(Kind, ObjectRef), Delta>,
    /// Files and documents that could not be read.
    pub errors: Vec<ManifestError>,
}

/// The kind a manifest document declares, if it is one the agent reads.
/// Other kinds (Deployments and the like, often in the same directory) are
/// skipped silently.
fn kind_of(doc: &Document) -> Result<Option<Kind>, ManifestError> {
    match doc.value.get("kind").and_then(Value::as_str).unwrap_or_default() {
        "Service" => Ok(Some(Kind::Service)),
        "EndpointSlice" => Ok(Some(Kind::EndpointSlice)),
        "Node" => Ok(Some(Kind::Node)),
        "" => Err(ManifestError { location: doc.location.clone(), reason: "object has no kind".into() }),
        _ => Ok(None),
    }
}

/// Converts one document into `read`. An object defined twice keeps the
/// last definition and reports the duplicate on it.
fn add(read: &mut ManifestRead, doc: &Document) {
    let kind = match kind_of(doc) {
        Ok(Some(k)) => k,
        Ok(None) => return,
        Err(e) => return read.errors.push(e),
    };
    let mut d = delta_from_value(kind, &doc.value);
    // A nameless object is reported under its location ("file.yaml#2"), so
    // that two of them do not replace each other.
    if d.id.name.is_empty() {
        d.id.name.clone_from(&doc.location);
    }
    for p in &mut d.problems {
        if p.error.object.is_empty() {
            p.error.object.clone_from(&doc.location);
        }
    }
    let key = (kind, d.id.clone());
    if read.deltas.get(&key).is_some_and(|old| old.object.is_some()) && d.object.is_some() {
        let service = (kind == Kind::Service).then(|| d.id.clone());
        let reason = "defined more than once; the last definition wins".to_string();
        d.problems.push(ObjectProblem {
            kind,
            error: ObjectError { kind: kind.as_str().into(), object: d.id.to_string(), reason },
            service,
        });
    }
    read.deltas.insert(key, d);
}

/// Reads and converts every object under `paths`, one document at a time.
pub fn read(paths: &[PathBuf]) -> ManifestRead {
    let mut read = ManifestRead::default();
    let errors = manifest::for_each(paths, |doc| add(&mut read, &doc));
    read.errors.splice(0..0, errors);
    read
}

/// The objects of the last read, by kind.
pub(crate) type Known = BTreeMap<Kind, BTreeSet<ObjectRef>>;

/// The deltas that take the model from the objects of the last read
/// (`known`, updated) to `read`'s: every object read, and a removal for
/// each object that is gone. Like a relist, whose unchanged objects the
/// model recognises as such.
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

/// Starts the task that reads `paths` whenever they change (checked every
/// `interval`) and queues what it read; returns the queue.
pub fn start(paths: Vec<PathBuf>, interval: Duration, metrics: Arc<Metrics>, tx: UnboundedSender<Signal>) -> Stores {
    let stores = Stores::default();
    tokio::spawn(watch(paths, interval, metrics, stores.clone(), tx));
    stores
}

async fn watch(paths: Vec<PathBuf>, interval: Duration, metrics: Arc<Metrics>, stores: Stores, tx: UnboundedSender<Signal>) {
    let paths = Arc::new(paths);
    let mut last = None;
    let mut known = Known::new();
    loop {
        let p = paths.clone();
        // Reading and parsing is blocking file I/O and CPU work: off the
        // runtime's workers, so the health server keeps answering.
        let fp = tokio::task::spawn_blocking(move || manifest::fingerprint(&p)).await.ok();
        if fp.is_some() && fp != last {
            last = fp;
            let p = paths.clone();
            let Ok(read) = tokio::task::spawn_blocking(move || read(&p)).await else {
                tracing::error!("reading the manifests panicked; keeping the previous objects");
                continue;
            };
            metrics.errors_by(reason::MANIFEST, read.errors.len());
            for e in &read.errors {
                tracing::warn!(location = %e.location, "manifest skipped: {}", e.reason);
            }
            let deltas = relist(&mut known, read.deltas);
            stores.push_all(deltas);
            for kind in Kind::ALL {
                stores.set_len(kind, known.get(&kind).map_or(0, BTreeSet::len));
            }
            for kind in Kind::ALL {
                if tx.send(Signal::Listed { kind }).is_err() {
                    return; // the sync loop is gone: shutting down
                }
            }
        }
        tokio::time::sleep(interval).await;
    }
}

/// What one manifest file's `text` reads as: a delta per object, and the
/// problems of its documents. For the tests of the layers above the source.
#[cfg(test)]
pub(crate) fn read_text(text: &str) -> ManifestRead {
    let mut parsed = Vec::new();
    let mut errors = Vec::new();
    manifest::parse_into("t.yaml", text, &mut parsed, &mut errors);
    let mut read = ManifestRead { errors, ..ManifestRead::default() };
    for d in &parsed {
        add(&mut read, d);
    }
    read
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
}
