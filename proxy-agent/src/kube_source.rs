//! The API server as a source of the model: kube-runtime watchers for
//! Services, EndpointSlices and Nodes that convert each object once, when
//! it arrives, and queue the result for the sync loop (`kube_model`).
//!
//! Objects are converted by the same `objects` functions that read
//! manifests, so both sources agree on every check. Services and
//! EndpointSlices are deserialized into the slim shapes of `wire`, which
//! keep only what conversion reads (and `spec.topologyKeys`, Kubernetes
//! 1.17-1.21, which today's typed `Service` would drop). Nodes are watched
//! metadata-only (`PartialObjectMetadata`): labels are all the agent reads
//! of a Node, and Node status is large and changes every few seconds
//! (heartbeats), which would wake the agent for nothing.
//!
//! The model only ever changes by whole relists or single events, and a
//! relist replaces a kind's objects only once it is complete
//! (`watcher::Event::InitDone`), so an API server outage or an expired
//! watch never shows the sync loop an empty or half-listed kind. No copy
//! of the API server's objects is kept (kube-runtime's reflector stores
//! would hold every object as received): only the converted model and, per
//! object, its resourceVersion, so a relist converts only what changed.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Debug;
use std::hash::Hash;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, PartialObjectMeta};
use kube::runtime::watcher::{self, DefaultBackoff};
use kube::runtime::WatchStreamExt;
use kube::{Client, Resource};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;
use tokio::sync::mpsc::UnboundedSender;

use crate::error_chain::error_chain;
pub use crate::kube_model::ObjectProblem;
use crate::kube_model::{Delta, Model, Object};
use crate::model::{Cluster, ObjectRef};
use crate::objects::{self, Converted, SERVICE_NAME_LABEL};
use crate::wire::{WireService, WireSlice};

/// Services another proxy implements, and headless Services, are not
/// watched at all; kube-proxy uses the same selector
/// (pkg/proxy/apis/config: `!service.kubernetes.io/service-proxy-name`,
/// `!service.kubernetes.io/headless`). The conversion checks both labels
/// again, so manifests behave the same.
pub const SERVICE_LABEL_SELECTOR: &str = "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless";

/// The EndpointSlice controller stamps this on slices: the time of the
/// last change (Pod, Service) that caused the slice to be updated. It is
/// what kube-proxy measures network programming latency from
/// (pkg/proxy/metrics: NetworkProgrammingLatency).
pub const TRIGGER_TIME_ANNOTATION: &str = "endpoints.kubernetes.io/last-change-trigger-time";

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    Service,
    EndpointSlice,
    Node,
}

impl Kind {
    pub const ALL: [Kind; 3] = [Kind::Service, Kind::EndpointSlice, Kind::Node];

    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Service => "Service",
            Kind::EndpointSlice => "EndpointSlice",
            Kind::Node => "Node",
        }
    }
}

/// What the watchers tell the sync loop. The stores hold the data; signals
/// only say that something changed and when.
#[derive(Debug)]
pub enum Signal {
    /// An object was added, changed or deleted while watching. `trigger`
    /// is when the change happened, as far as the agent can tell.
    Changed { kind: Kind, trigger: SystemTime },
    /// A complete (re)list landed in the store.
    Listed { kind: Kind },
    /// A list or watch failed; the watcher retries with backoff.
    /// `expired` marks an expired resourceVersion (410 Gone or "too large
    /// resource version"), after which a relist follows.
    Failed { kind: Kind, expired: bool, message: String },
    /// Something outside the API server that the sync depends on changed
    /// (e.g. the node's addresses, which NodePorts are served on): sync
    /// again.
    Resync { reason: &'static str },
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
        std::mem::take(&mut *self.queue.lock().unwrap_or_else(|p| p.into_inner()))
    }

    fn push(&self, deltas: impl IntoIterator<Item = Delta>) {
        self.queue.lock().unwrap_or_else(|p| p.into_inner()).extend(deltas);
    }

    /// [`Self::push`] for a whole relist: taken over as the queue when the
    /// sync loop has drained it, rather than copied (at 10k objects that
    /// copy was megabytes more at the agent's memory peak, issue #7).
    fn push_all(&self, mut deltas: Vec<Delta>) {
        let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        if q.is_empty() {
            *q = deltas;
        } else {
            q.append(&mut deltas);
        }
    }

    /// Objects of `kind` the API server holds, as of the last event.
    pub fn len(&self, kind: Kind) -> usize {
        self.counts[kind as usize].load(Ordering::Relaxed)
    }
}

/// Starts one watcher task per kind and returns the queue they fill.
/// The tasks run until the runtime shuts down.
pub fn start(client: Client, tx: UnboundedSender<Signal>) -> Stores {
    let stores = Stores::default();
    let services: Api<WireService> = Api::all(client.clone());
    let svc_config = watcher::Config::default().labels(SERVICE_LABEL_SELECTOR);
    tokio::spawn(watch_kind(services, svc_config, stores.clone(), Kind::Service, tx.clone(), |_| None, |s| Some(service_delta(s))));

    let slices: Api<WireSlice> = Api::all(client.clone());
    tokio::spawn(watch_kind(slices, watcher::Config::default(), stores.clone(), Kind::EndpointSlice, tx.clone(), slice_trigger_time, |s| Some(slice_delta(s))));

    // `Api<PartialObjectMeta<K>>` makes list and watch send the
    // `as=PartialObjectMetadata[List];g=meta.k8s.io;v=v1` Accept header
    // (what kube's deprecated `metadata_watcher` did).
    let nodes: Api<PartialObjectMeta<Node>> = Api::all(client);
    tokio::spawn(watch_kind(nodes, watcher::Config::default(), stores.clone(), Kind::Node, tx, |_| None, |o| convert(Kind::Node, &o)));

    stores
}

fn slice_trigger_time(s: &WireSlice) -> Option<SystemTime> {
    let raw = s.metadata.annotations.as_ref()?.get(TRIGGER_TIME_ANNOTATION)?;
    parse_trigger_time(raw)
}

/// Parses an RFC 3339 time as the EndpointSlice controller writes it.
pub fn parse_trigger_time(raw: &str) -> Option<SystemTime> {
    raw.parse::<k8s_openapi::jiff::Timestamp>().ok().map(SystemTime::from)
}

/// Whether a watcher error means our resourceVersion is unusable and only
/// a relist helps.
///
/// - 410 Gone as a watch ERROR event: the watcher relists by itself.
/// - 410 Gone as the HTTP status of the watch request (some proxies and
///   older servers answer so), and 504 "Too large resource version" (the
///   API server's watch cache is behind our version, e.g. after etcd was
///   restored or replaced, apiserver storage/cacher): kube-runtime's
///   watcher would retry the same version forever, so the caller restarts
///   it, as client-go's reflector does for both
///   (`isExpiredError`/`isTooLargeResourceVersionError` -> relist).
fn classify(e: &watcher::Error) -> (bool, bool) {
    let status = match e {
        watcher::Error::WatchError(s) => return (s.code == 410, false),
        watcher::Error::WatchStartFailed(kube::Error::Api(s)) => s,
        watcher::Error::InitialListFailed(kube::Error::Api(s)) => return (s.code == 410, false),
        _ => return (false, false),
    };
    let too_large = status.code == 504
        && (status.message.contains("Too large resource version")
            || status
                .details
                .as_ref()
                .is_some_and(|d| d.causes.iter().any(|c| c.reason == "ResourceVersionTooLarge")));
    let expired = status.code == 410 || too_large;
    (expired, expired)
}

/// namespace/name (Nodes: empty namespace) and resourceVersion of an object.
fn key_of<K: Resource>(obj: &K) -> (ObjectRef, String) {
    let m = obj.meta();
    (
        ObjectRef::new(m.namespace.clone().unwrap_or_default(), m.name.clone().unwrap_or_default()),
        m.resource_version.clone().unwrap_or_default(),
    )
}

/// Converts one object as received.
fn convert<K: Serialize>(kind: Kind, obj: &K) -> Option<Delta> {
    // Serializing a value that was deserialized from JSON cannot fail in
    // practice; an object that somehow does is skipped like a bad object.
    let v = serde_json::to_value(obj).ok()?;
    Some(delta_from_value(kind, &v))
}

async fn watch_kind<K>(
    api: Api<K>,
    config: watcher::Config,
    stores: Stores,
    kind: Kind,
    tx: UnboundedSender<Signal>,
    trigger_of: fn(&K) -> Option<SystemTime>,
    convert_of: fn(K) -> Option<Delta>,
) where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Eq + Hash + Clone + Send + Sync,
{
    let mut restart_backoff = DefaultBackoff::default();
    // The objects the model holds for this kind, with their
    // resourceVersions; kept across watcher restarts like a store would be.
    let mut known: HashMap<ObjectRef, String> = HashMap::new();
    // A relist in progress: what it has seen, and the deltas it will hand
    // over when complete.
    let mut relist: Option<(HashMap<ObjectRef, String>, Vec<Delta>)> = None;
    loop {
        // default_backoff: exponential 0.8 s .. 30 s with jitter between
        // failed attempts (client-go's reflector values), reset by success.
        let mut stream = watcher::watcher(api.clone(), config.clone()).default_backoff().boxed();
        let mut restart = false;
        while let Some(item) = stream.next().await {
            match item {
                Ok(event) => {
                    let signal = match event {
                        watcher::Event::Apply(obj) => {
                            let (id, rv) = key_of(&obj);
                            let trigger = trigger_of(&obj).unwrap_or_else(SystemTime::now);
                            stores.push(convert_of(obj));
                            known.insert(id, rv);
                            stores.counts[kind as usize].store(known.len(), Ordering::Relaxed);
                            Some(Signal::Changed { kind, trigger })
                        }
                        // A deleted slice's trigger annotation describes its
                        // last update, not the deletion.
                        watcher::Event::Delete(obj) => {
                            let (id, _) = key_of(&obj);
                            known.remove(&id);
                            stores.push([Delta::removed(kind, id)]);
                            stores.counts[kind as usize].store(known.len(), Ordering::Relaxed);
                            Some(Signal::Changed { kind, trigger: SystemTime::now() })
                        }
                        watcher::Event::Init => {
                            relist = Some((HashMap::new(), Vec::new()));
                            None
                        }
                        watcher::Event::InitApply(obj) => {
                            let (id, rv) = key_of(&obj);
                            let (seen, deltas) = relist.get_or_insert_with(Default::default);
                            // Unchanged since we last saw it: nothing to convert.
                            if known.get(&id) != Some(&rv) {
                                deltas.extend(convert_of(obj));
                            }
                            seen.insert(id, rv);
                            None
                        }
                        watcher::Event::InitDone => {
                            let (seen, mut deltas) = relist.take().unwrap_or_default();
                            deltas.extend(known.keys().filter(|k| !seen.contains_key(*k)).map(|k| Delta::removed(kind, k.clone())));
                            known = seen;
                            stores.push_all(deltas);
                            stores.counts[kind as usize].store(known.len(), Ordering::Relaxed);
                            Some(Signal::Listed { kind })
                        }
                    };
                    if let Some(s) = signal
                        && tx.send(s).is_err()
                    {
                        return; // the sync loop is gone: shutting down
                    }
                }
                Err(e) => {
                    let (expired, needs_restart) = classify(&e);
                    let message = error_chain(&e);
                    if tx.send(Signal::Failed { kind, expired, message }).is_err() {
                        return;
                    }
                    if needs_restart {
                        restart = true;
                        break;
                    }
                }
            }
        }
        // The watcher stream never ends by itself; getting here means a
        // restart was asked for. Wait like the backoff would have.
        let delay = if restart { restart_backoff.next().unwrap_or(Duration::from_secs(1)) } else { Duration::from_secs(1) };
        tokio::time::sleep(delay).await;
    }
}

/// The model built from a set of objects, with what was left out.
#[derive(Debug, Default)]
pub struct Snapshot {
    pub cluster: Cluster,
    pub problems: Vec<ObjectProblem>,
    /// metadata.uid of every watched Service, valid or not (for Events).
    pub service_uids: BTreeMap<ObjectRef, String>,
}

/// Converts one object of `kind` (as JSON, the API server's or a test's)
/// into what the model needs. The same `objects::*_from_json` functions
/// read manifests, so both sources agree on every check.
pub fn delta_from_value(kind: Kind, v: &Value) -> Delta {
    let (ns, name) = objects::object_ref(v);
    let id = ObjectRef::new(ns, name);
    let mut d = Delta { kind, id: id.clone(), present: true, uid: None, object: None, problems: Vec::new() };
    match kind {
        Kind::Service => {
            d.uid = v.get("metadata").and_then(|m| m.get("uid")).and_then(Value::as_str).map(str::to_string);
            record(&mut d, Some(id), objects::service_from_json(v), Object::Service);
        }
        Kind::EndpointSlice => {
            let owner = v
                .get("metadata")
                .and_then(|m| m.get("labels"))
                .and_then(|l| l.get(SERVICE_NAME_LABEL))
                .and_then(Value::as_str)
                .map(|name| ObjectRef::new(id.namespace.clone(), name));
            record(&mut d, owner, objects::slice_from_json(v), Object::Slice);
        }
        Kind::Node => match objects::node_from_json(v) {
            Ok(n) => d.object = Some(Object::Node(n)),
            Err(error) => d.problems.push(ObjectProblem { kind: Kind::Node, error, service: None }),
        },
    }
    d
}

/// A Service as the watcher receives it, converted like
/// [`delta_from_value`] converts one given as JSON.
fn service_delta(s: WireService) -> Delta {
    let (ns, name) = objects::meta_ref(&s.metadata);
    let id = ObjectRef::new(ns, name);
    let mut d = Delta { kind: Kind::Service, id: id.clone(), present: true, uid: s.metadata.uid.clone(), object: None, problems: Vec::new() };
    record(&mut d, Some(id), objects::service_from_wire(s), Object::Service);
    d
}

/// Puts a conversion's object and problems into `d`; problems are reported
/// on `service` (a slice's owner, or the Service itself).
fn record<T>(d: &mut Delta, service: Option<ObjectRef>, result: objects::Conversion<T>, wrap: fn(T) -> Object) {
    let kind = d.kind;
    let problem = |error| ObjectProblem { kind, error, service: service.clone() };
    match result {
        Ok((converted, partial)) => {
            d.problems.extend(partial.into_iter().map(problem));
            if let Converted::Ok(o) = converted {
                d.object = Some(wrap(o));
            }
        }
        Err(error) => d.problems.push(problem(error)),
    }
}

/// A slice as the watcher receives it, converted like
/// [`delta_from_value`] converts one given as JSON.
fn slice_delta(s: WireSlice) -> Delta {
    let (ns, name) = objects::meta_ref(&s.metadata);
    let id = ObjectRef::new(ns, name);
    let owner = s.metadata.labels.as_ref().and_then(|l| l.get(SERVICE_NAME_LABEL)).map(|name| ObjectRef::new(id.namespace.clone(), name));
    let mut d = Delta { kind: Kind::EndpointSlice, id, present: true, uid: None, object: None, problems: Vec::new() };
    record(&mut d, owner, objects::slice_from_wire(s), Object::Slice);
    d
}

/// Builds the model from objects as JSON (the API server's or a test's).
pub fn snapshot_from_values(services: &[Value], slices: &[Value], nodes: &[Value]) -> Snapshot {
    let mut model = Model::default();
    let deltas = services
        .iter()
        .map(|v| delta_from_value(Kind::Service, v))
        .chain(slices.iter().map(|v| delta_from_value(Kind::EndpointSlice, v)))
        .chain(nodes.iter().map(|v| delta_from_value(Kind::Node, v)));
    model.apply(deltas);
    let problems = model.problems().cloned().collect();
    Snapshot { problems, service_uids: std::mem::take(&mut model.service_uids), cluster: model.cluster }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn converts_like_manifests_and_keeps_topology_keys() {
        let svc = json!({
            "metadata": {"name": "web", "namespace": "shop", "uid": "u1"},
            "spec": {"clusterIP": "10.96.0.10", "ports": [{"port": 80}], "topologyKeys": ["kubernetes.io/hostname", "*"]}
        });
        let bad = json!({"metadata": {"name": "bad", "namespace": "shop", "uid": "u2"}, "spec": {"clusterIP": "10.96.0.999", "ports": [{"port": 80}]}});
        let slice = json!({
            "metadata": {"name": "web-1", "namespace": "shop", "labels": {"kubernetes.io/service-name": "web"}},
            "addressType": "IPv4", "ports": [{"port": 8080}],
            "endpoints": [{"addresses": ["10.244.0.1"]}, {"addresses": ["nope"]}]
        });
        let orphan = json!({"metadata": {"name": "orphan", "namespace": "shop"}, "addressType": "IPv4", "endpoints": []});
        let node = json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata", "metadata": {"name": "n1", "labels": {"topology.kubernetes.io/zone": "z1"}}});
        let s = snapshot_from_values(&[svc, bad], &[slice, orphan], &[node]);
        let web = &s.cluster.services[&ObjectRef::new("shop", "web")];
        assert_eq!(web.topology_keys.as_deref().map(<[String]>::len), Some(2));
        assert_eq!(s.cluster.slices[&ObjectRef::new("shop", "web-1")].endpoints.len(), 1);
        assert_eq!(s.cluster.nodes["n1"].labels["topology.kubernetes.io/zone"], "z1");
        assert_eq!(s.service_uids[&ObjectRef::new("shop", "bad")], "u2");
        let got: Vec<(Kind, Option<String>, String)> =
            s.problems.iter().map(|p| (p.kind, p.service.as_ref().map(ToString::to_string), p.error.to_string())).collect();
        assert_eq!(got.len(), 3, "{got:?}");
        assert_eq!(got[0].1.as_deref(), Some("shop/bad"));
        assert!(got[0].2.contains("is not an IP address"));
        // Problems come by kind, then namespace/name: shop/orphan, shop/web-1.
        assert_eq!((got[1].0, got[1].1.as_deref()), (Kind::EndpointSlice, None), "an orphan slice has no Service");
        assert_eq!((got[2].0, got[2].1.as_deref()), (Kind::EndpointSlice, Some("shop/web")), "a bad endpoint is reported on its Service");
    }

    #[test]
    fn watched_slices_convert_like_json_ones() {
        let v = json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "web-1", "namespace": "shop", "resourceVersion": "7", "labels": {"kubernetes.io/service-name": "web"}},
            "addressType": "IPv4", "ports": [{"name": "http", "port": 8080}, {"port": 0}],
            "endpoints": [{"addresses": ["10.244.0.1"], "nodeName": "a", "conditions": {"ready": false}}, {"addresses": ["nope"]}]
        });
        let wire: WireSlice = serde_json::from_value(v.clone()).expect("wire slice");
        let d = slice_delta(wire);
        assert_eq!(d, delta_from_value(Kind::EndpointSlice, &v));
        assert_eq!(d.problems.len(), 2, "{:?}", d.problems);
        assert!(matches!(&d.object, Some(Object::Slice(s)) if s.endpoints.len() == 1 && s.ports.len() == 1));
    }

    #[test]
    fn trigger_time_parses_rfc3339() {
        let t = parse_trigger_time("2024-05-01T10:00:00Z").expect("parses");
        assert_eq!(t.duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_secs()).ok(), Some(1_714_557_600));
        assert!(parse_trigger_time("yesterday").is_none());
    }

    #[test]
    fn expired_versions_are_recognised() {
        let status = |code: u16, message: &str| kube::core::Status {
            code,
            message: message.into(),
            ..Default::default()
        };
        let e = watcher::Error::WatchError(Box::new(status(410, "too old resource version")));
        assert_eq!(classify(&e), (true, false), "the watcher relists on a 410 event itself");
        let e = watcher::Error::WatchStartFailed(kube::Error::Api(Box::new(status(504, "Too large resource version: 9, current: 3"))));
        assert_eq!(classify(&e), (true, true));
        let e = watcher::Error::WatchStartFailed(kube::Error::Api(Box::new(status(500, "boom"))));
        assert_eq!(classify(&e), (false, false));
    }
}
