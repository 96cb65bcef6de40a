//! The API server as a source of the model: kube-runtime watchers for
//! Services, EndpointSlices and Nodes that convert each object once, when
//! it arrives, and queue the result for the sync loop (`source::feed`).
//!
//! Objects are converted by the same `objects` functions that read
//! manifests, so both sources agree on every check. Services,
//! EndpointSlices and Nodes are deserialized into the slim shapes of
//! `wire`, which keep only what conversion reads (and `spec.topologyKeys`,
//! Kubernetes 1.17-1.21, which today's typed `Service` would drop).
//!
//! Nodes cost the most on the wire: every kubelet status report rewrites
//! its Node, and a watch of every Node carries every report of the cluster
//! to every agent, which grows with the square of the cluster (seed 004;
//! why Service Topology moved to EndpointSlices, and why kube-proxy watches
//! only its own Node by a field selector). So this node's Node is watched
//! alone, whole (its labels, `deletionTimestamp` and taints' keys feed its
//! zone and `/healthz`; its status is skipped while deserializing), and
//! other Nodes only while some Service's topology reads a label that its
//! EndpointSlices do not carry (`decide::topology::other_node_labels`),
//! metadata-only (`PartialObjectMetadata`), keeping just those labels
//! (`watch_nodes`).
//!
//! EndpointSlices are watched in the version `api_versions` negotiated
//! with the API server: discovery.k8s.io/v1, or v1beta1 on 1.17-1.20.
//! Every watcher lists, then watches (kube-runtime's default, not the
//! streaming list, `sendInitialEvents`, that only 1.27 and later serve),
//! and asks for bookmarks, which a server without them ignores: the watch
//! then resumes from the last object it delivered.
//!
//! The model only ever changes by whole relists or single events, and a
//! relist replaces a kind's objects only once it is complete
//! (`watcher::Event::InitDone`), so an API server outage or an expired
//! watch never shows the sync loop an empty or half-listed kind. No copy
//! of the API server's objects is kept (kube-runtime's reflector stores
//! would hold every object as received): only the converted model and, per
//! object, its resourceVersion, so a relist converts only what changed.

use std::collections::{BTreeSet, HashMap};
use std::fmt::Debug;
use std::hash::Hash;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use futures::StreamExt;
use futures::stream::BoxStream;
use kube::api::Api;
use kube::core::PartialObjectMeta;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, DefaultBackoff};
use kube::{Client, Resource};
use serde::de::DeserializeOwned;
use tokio::sync::mpsc::{UnboundedSender, unbounded_channel};
use tokio::sync::watch;

use crate::model::store::{Delta, Kind};
use crate::model::{ObjectRef, OtherNodes};
use crate::source::api_versions::{Negotiated, Version};
use crate::source::delta::{node_delta, node_labels_delta, service_delta, slice_delta};
use crate::source::feed::{Signal, Stores};
use crate::source::node_scope;
use crate::source::wire::{WireNode, WireService, WireSlice};
use crate::source::wire_v1beta1::WireSliceV1beta1;
use crate::util::error_chain::error_chain;

/// Services another proxy implements, and headless Services, are not
/// watched at all, nor EndpointSlices with either label; kube-proxy uses
/// the same selector for both kinds (pkg/proxy/apis/config:
/// `!service.kubernetes.io/service-proxy-name`,
/// `!service.kubernetes.io/headless`; cmd/kube-proxy/app/server.go applies
/// it to its one informer factory). A slice that gains a label leaves the
/// watch as a deletion. The conversion checks both labels again, so
/// manifests behave the same.
pub const SERVICE_LABEL_SELECTOR: &str = "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless";

/// The EndpointSlice controller stamps this on slices: the time of the
/// last change (Pod, Service) that caused the slice to be updated. It is
/// what kube-proxy measures network programming latency from
/// (pkg/proxy/metrics: NetworkProgrammingLatency).
pub const TRIGGER_TIME_ANNOTATION: &str = "endpoints.kubernetes.io/last-change-trigger-time";

/// Starts one watcher task per kind and returns the queue they fill.
/// EndpointSlices are watched in the version `versions` negotiates; Nodes
/// as `watch_nodes` says, for node `node`, with the labels of other Nodes
/// that the sync loop publishes on `node_labels`. The tasks run until the
/// runtime shuts down.
pub fn start(
    client: Client,
    versions: Negotiated,
    tx: UnboundedSender<Signal>,
    node: &str,
    node_labels: watch::Receiver<Option<OtherNodes>>,
) -> Stores {
    let stores = Stores::default();
    let services: Api<WireService> = Api::all(client.clone());
    let svc_config = watcher::Config::default().labels(SERVICE_LABEL_SELECTOR);
    tokio::spawn(watch_kind(
        services,
        svc_config,
        stores.clone(),
        Kind::Service,
        tx.clone(),
        |_| None,
        Arc::new(|s| Some(service_delta(s))),
    ));

    tokio::spawn(watch_slices(client.clone(), versions, stores.clone(), tx.clone()));

    tokio::spawn(watch_nodes(client, node.to_string(), node_labels, stores.clone(), tx));

    stores
}

/// This node's Node, whole, by the field selector `metadata.name=<node>`
/// (kube-proxy's own Node watch); and, while `needed` names labels, every
/// other Node metadata-only (`metadata.name!=<node>`), keeping those labels
/// and `node_scope::ALWAYS_KEPT` (`node_scope::watched`, which `explain`
/// shares). The Nodes' listing is announced to the sync loop
/// once this node's Node is listed, `needed` is known (the sync loop
/// publishes it once Services and EndpointSlices are listed) and, if it
/// names labels, the other Nodes are listed too: the first sync then
/// decides with every label it reads. A change of the labels needed
/// relists the other Nodes (their labels were filtered); none needed any
/// more stops that watch and forgets the other Nodes.
async fn watch_nodes(
    client: Client,
    node: String,
    mut needed: watch::Receiver<Option<OtherNodes>>,
    stores: Stores,
    tx: UnboundedSender<Signal>,
) {
    let kind = Kind::Node;
    let (own_tx, mut own_rx) = unbounded_channel();
    let own: Api<WireNode> = Api::all(client.clone());
    let own_config = watcher::Config::default().fields(&format!("metadata.name={node}"));
    tokio::spawn(watch_kind(own, own_config, stores.clone(), kind, own_tx, |_| None, Arc::new(|n| Some(node_delta(n)))));
    let mut others: HashMap<ObjectRef, String> = HashMap::new();
    let mut watching: Option<OtherNodes> = None;
    let mut listed = Listing::default();
    loop {
        let want = needed.borrow_and_update().clone();
        listed.need = want.as_ref().map(|_| ());
        let keys = want.as_ref().and_then(node_scope::watched);
        if keys != watching {
            match &keys {
                None => {
                    tracing::info!(nodes = others.len(), "no Service needs other Nodes' labels: stopped watching other Nodes");
                    stores.push(others.drain().map(|(id, _)| Delta::removed(kind, id)));
                    if tx.send(Signal::Changed { kind, trigger: SystemTime::now(), stamped: false }).is_err() {
                        return;
                    }
                }
                Some(k) => {
                    let labels: Vec<&str> = k.labels.iter().map(String::as_str).collect();
                    if let Some(names) = &k.names {
                        tracing::info!(
                            labels = %labels.join(","),
                            nodes = names.len(),
                            "watching the other Nodes that host endpoints of those Services, by hostname label, metadata only, for these labels"
                        );
                    } else {
                        tracing::info!(labels = %labels.join(","), "watching every other Node, metadata only, for these labels");
                    }
                    // Their labels were filtered for the old set: convert
                    // every one again; the relist removes the Nodes no
                    // longer selected.
                    others.values_mut().for_each(String::clear);
                }
            }
            watching = keys;
            listed.others = false;
            // Not watching other Nodes: nothing of theirs to wait for, and
            // nothing listed.
            if watching.is_none() {
                let none = OtherNodes { labels: BTreeSet::new(), names: Some(BTreeSet::new()) };
                if tx.send(Signal::NodeLabelsListed { listed: none }).is_err() {
                    return;
                }
            }
        }
        if watching.is_none() {
            listed.others = true;
        }
        // A channel per watch of other Nodes: a listing the previous watch
        // queued before it was dropped must not pass for this one's.
        let (other_tx, mut other_rx) = unbounded_channel();
        if !listed.announce(&tx) {
            return;
        }
        let other = Watch {
            open: other_nodes(client.clone(), &node, watching.as_ref().and_then(|w| w.names.as_ref())),
            kind,
            trigger_of: |_| None,
            convert_of: {
                let (node, keys) = (node.clone(), Arc::new(watching.as_ref().map(|w| w.labels.clone()).unwrap_or_default()));
                Arc::new(move |m: PartialObjectMeta<WireNode>| {
                    (m.metadata.name.as_deref() != Some(node.as_str())).then(|| node_labels_delta(m, &keys))
                })
            },
        };
        let active = watching.is_some();
        let run_other = async {
            if active {
                watch_until(&other, &stores, &other_tx, &mut others, false).await;
            } else {
                std::future::pending::<()>().await;
            }
        };
        tokio::pin!(run_other);
        // Until the labels needed change.
        loop {
            tokio::select! {
                () = &mut run_other => return,
                s = own_rx.recv() => {
                    let Some(s) = s else { return };
                    if !listed.forward(&tx, s, true) { return; }
                }
                s = other_rx.recv() => {
                    let Some(s) = s else { return };
                    // The sync loop learns what this listing covered
                    // before it hears of it (`decide::label_wait`).
                    if let (Signal::Listed { .. }, Some(w)) = (&s, &watching)
                        && tx.send(Signal::NodeLabelsListed { listed: w.clone() }).is_err()
                    {
                        return;
                    }
                    if !listed.forward(&tx, s, false) { return; }
                }
                r = needed.changed() => {
                    if r.is_err() { return; }
                    break;
                }
            }
        }
    }
}

/// Whether the Nodes' listing can be announced ([`watch_nodes`]): this
/// node's Node listed, the other Nodes listed (or not watched), and the
/// labels needed known (`need`, the sync loop's latest word).
#[derive(Default)]
struct Listing {
    own: bool,
    others: bool,
    announced: bool,
    need: Option<()>,
}

impl Listing {
    /// Announces the listing if it is complete and was not announced yet;
    /// false once the sync loop is gone.
    fn announce(&mut self, tx: &UnboundedSender<Signal>) -> bool {
        if self.announced || !(self.own && self.need.is_some() && self.others) {
            return true;
        }
        self.announced = true;
        tx.send(Signal::Listed { kind: Kind::Node }).is_ok()
    }

    /// Passes a Node watcher's signal on, holding its `Listed` back until
    /// the listing is complete; false once the sync loop is gone.
    fn forward(&mut self, tx: &UnboundedSender<Signal>, s: Signal, own: bool) -> bool {
        let s = match s {
            Signal::Listed { kind } => {
                if own {
                    self.own = true;
                } else {
                    self.others = true;
                }
                if !self.announced {
                    return self.announce(tx);
                }
                Signal::Listed { kind }
            }
            other => other,
        };
        tx.send(s).is_ok()
    }
}

/// The metadata-only watch stream of the Nodes `names` (every Node when
/// `None`) but `node` (an `Api<PartialObjectMeta<_>>` asks for
/// `PartialObjectMetadata`). Named Nodes are selected by their hostname
/// label with a set-based label selector, since field selectors have no
/// `in` (`decide::topology::other_nodes_needed` checks that the names can
/// be label values and that hostname labels match names here).
fn other_nodes(client: Client, node: &str, names: Option<&BTreeSet<String>>) -> Opener<PartialObjectMeta<WireNode>> {
    let mut config = watcher::Config::default().fields(&format!("metadata.name!={node}"));
    if let Some(names) = names {
        let list: Vec<&str> = names.iter().map(String::as_str).collect();
        config = config.labels(&format!("{} in ({})", crate::model::LABEL_HOSTNAME, list.join(",")));
    }
    opener(Api::all(client), config)
}

fn slice_trigger_time<K: Resource>(s: &K) -> Option<SystemTime> {
    let raw = s.meta().annotations.as_ref()?.get(TRIGGER_TIME_ANNOTATION)?;
    parse_trigger_time(raw)
}

/// EndpointSlices in the version negotiated with the API server: v1, or
/// v1beta1 converted into v1's shape as it arrives (`wire_v1beta1`), so the
/// model is the same. When the API server answers 404 for the version in
/// use, the version is negotiated again and the watch continues in the new
/// one with the objects it knows, whose relist then replaces them without
/// a gap (an object keeps its resourceVersion across versions, so only
/// changed ones are converted again).
async fn watch_slices(client: Client, mut versions: Negotiated, stores: Stores, tx: UnboundedSender<Signal>) {
    let kind = Kind::EndpointSlice;
    let mut known = HashMap::new();
    let Some(mut chosen) = versions.current().await else { return };
    let mut backoff = DefaultBackoff::default();
    loop {
        let stopped = match chosen.endpoint_slices {
            Some(Version::V1) => {
                let w: Watch<WireSlice> = Watch {
                    open: opener(Api::all(client.clone()), watcher::Config::default().labels(SERVICE_LABEL_SELECTOR)),
                    kind,
                    trigger_of: slice_trigger_time,
                    convert_of: Arc::new(|s| Some(slice_delta(s))),
                };
                watch_until(&w, &stores, &tx, &mut known, true).await
            }
            Some(Version::V1beta1) => {
                let w: Watch<WireSliceV1beta1> = Watch {
                    open: opener(Api::all(client.clone()), watcher::Config::default().labels(SERVICE_LABEL_SELECTOR)),
                    kind,
                    trigger_of: slice_trigger_time,
                    convert_of: Arc::new(|s| Some(slice_delta(s.into_v1()))),
                };
                watch_until(&w, &stores, &tx, &mut known, true).await
            }
            None => {
                let message = "the API server serves neither discovery.k8s.io/v1 nor v1beta1 EndpointSlices (Kubernetes 1.17 \
                               and later do): no endpoints can be listed, the datapath stays as it is; asking again"
                    .to_string();
                if tx.send(Signal::Failed { kind, expired: false, message }).is_err() {
                    return;
                }
                Stopped::NotServed
            }
        };
        if stopped == Stopped::Shutdown {
            return;
        }
        if let Some(was) = chosen.endpoint_slices {
            let was = was.as_str();
            tracing::warn!(
                version = was,
                "the API server no longer serves discovery.k8s.io/{was} EndpointSlices; negotiating the version again"
            );
        }
        tokio::time::sleep(backoff.next().unwrap_or(Duration::from_secs(30))).await;
        let Some(next) = versions.renegotiate().await else { return };
        if next.endpoint_slices != chosen.endpoint_slices {
            backoff = DefaultBackoff::default();
        }
        chosen = next;
    }
}

/// Parses an RFC 3339 time as the EndpointSlice controller writes it.
pub fn parse_trigger_time(raw: &str) -> Option<SystemTime> {
    raw.parse::<k8s_openapi::jiff::Timestamp>().ok().map(SystemTime::from)
}

/// Whether a watcher error means our resourceVersion is unusable and only
/// a relist helps.
///
/// - 410 Gone as a watch ERROR event: the watcher relists by itself. A
///   Status whose `code` is 0 ("0 if not set", metav1.Status) that says
///   `Expired` or `Gone` only in its `reason`: kube-runtime's watcher
///   relists only on code 410 and would resume the expired version
///   forever, so the caller restarts it.
/// - 410 Gone as the HTTP status of the watch request (some proxies and
///   older servers answer so), and 504 "Too large resource version" (the
///   API server's watch cache is behind our version, e.g. after etcd was
///   restored or replaced, apiserver storage/cacher): kube-runtime's
///   watcher would retry the same version forever, so the caller restarts
///   it, as client-go's reflector does for both
///   (`isExpiredError`/`isTooLargeResourceVersionError` -> relist). API
///   servers before 1.19 say "too large" only in the message (the
///   `ResourceVersionTooLarge` cause came later).
fn classify(e: &watcher::Error) -> (bool, bool) {
    let status = match e {
        watcher::Error::WatchError(s) => {
            let by_reason = s.code == 0 && matches!(s.reason.as_str(), "Expired" | "Gone");
            return (s.code == 410 || by_reason, by_reason);
        }
        watcher::Error::WatchStartFailed(kube::Error::Api(s)) => s,
        watcher::Error::InitialListFailed(kube::Error::Api(s)) => return (s.code == 410, false),
        _ => return (false, false),
    };
    let too_large = status.code == 504
        && (status.message.contains("Too large resource version")
            || status.details.as_ref().is_some_and(|d| d.causes.iter().any(|c| c.reason == "ResourceVersionTooLarge")));
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

/// Opens a watcher stream (lists, then watches) of objects `K`.
type Opener<K> = Arc<dyn Fn() -> BoxStream<'static, watcher::Result<watcher::Event<K>>> + Send + Sync>;

/// The watcher stream of `api` with `config`, as an [`Opener`].
fn opener<K>(api: Api<K>, config: watcher::Config) -> Opener<K>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
    K::DynamicType: Default + Eq + Hash + Clone + Send,
{
    Arc::new(move || watcher::watcher(api.clone(), config.clone()).boxed())
}

/// One kind's watch: what to watch, and how its objects become deltas.
struct Watch<K> {
    open: Opener<K>,
    kind: Kind,
    trigger_of: fn(&K) -> Option<SystemTime>,
    convert_of: Arc<dyn Fn(K) -> Option<Delta> + Send + Sync>,
}

/// Why a watch ended.
#[derive(Debug, PartialEq, Eq)]
enum Stopped {
    /// The sync loop is gone: shutting down.
    Shutdown,
    /// The API server answered 404 for the collection: it does not serve
    /// this version (any more).
    NotServed,
}

/// A 404 for the list or the watch itself: the group version is not
/// served. API servers before 1.24 answer it in plain text ("404 page not
/// found"), which kube turns into a Status with only the code.
fn not_served(e: &watcher::Error) -> bool {
    matches!(e, watcher::Error::InitialListFailed(kube::Error::Api(s)) | watcher::Error::WatchStartFailed(kube::Error::Api(s)) if s.code == 404)
}

/// Watches a kind for as long as the agent runs (core/v1, which every
/// release serves: a 404 is retried like any other failure).
async fn watch_kind<K>(
    api: Api<K>,
    config: watcher::Config,
    stores: Stores,
    kind: Kind,
    tx: UnboundedSender<Signal>,
    trigger_of: fn(&K) -> Option<SystemTime>,
    convert_of: Arc<dyn Fn(K) -> Option<Delta> + Send + Sync>,
) where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + Hash + Clone + Send + Sync,
{
    let mut known = HashMap::new();
    watch_until(&Watch { open: opener(api, config), kind, trigger_of, convert_of }, &stores, &tx, &mut known, false).await;
}

/// Runs a watch until the agent shuts down or, with `stop_if_not_served`,
/// until the API server answers 404 for it. `known` holds the objects the
/// model has of this kind, with their resourceVersions; kept across
/// watcher restarts (and versions) like a store would be.
async fn watch_until<K>(
    w: &Watch<K>,
    stores: &Stores,
    tx: &UnboundedSender<Signal>,
    known: &mut HashMap<ObjectRef, String>,
    stop_if_not_served: bool,
) -> Stopped
where
    K: Resource + Send + 'static,
{
    let (kind, trigger_of, convert_of) = (w.kind, w.trigger_of, &w.convert_of);
    let mut restart_backoff = DefaultBackoff::default();
    // A relist in progress: what it has seen, and the deltas it will hand
    // over when complete.
    let mut relist: Option<(HashMap<ObjectRef, String>, Vec<Delta>)> = None;
    loop {
        // default_backoff: exponential 0.8 s .. 30 s with jitter between
        // failed attempts (client-go's reflector values), reset by success.
        let mut stream = (w.open)().default_backoff().boxed();
        let mut restart = false;
        while let Some(item) = stream.next().await {
            match item {
                Ok(event) => {
                    let signal = match event {
                        watcher::Event::Apply(obj) => {
                            let (id, rv) = key_of(&obj);
                            let stamped = trigger_of(&obj);
                            let trigger = stamped.unwrap_or_else(SystemTime::now);
                            stores.push(convert_of(obj));
                            known.insert(id, rv);
                            stores.set_len(kind, known.len());
                            Some(Signal::Changed { kind, trigger, stamped: stamped.is_some() })
                        }
                        // A deleted slice's trigger annotation describes its
                        // last update, not the deletion.
                        watcher::Event::Delete(obj) => {
                            let (id, _) = key_of(&obj);
                            known.remove(&id);
                            stores.push([Delta::removed(kind, id)]);
                            stores.set_len(kind, known.len());
                            Some(Signal::Changed { kind, trigger: SystemTime::now(), stamped: false })
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
                            *known = seen;
                            stores.push_all(deltas);
                            stores.set_len(kind, known.len());
                            Some(Signal::Listed { kind })
                        }
                    };
                    if let Some(s) = signal
                        && tx.send(s).is_err()
                    {
                        return Stopped::Shutdown;
                    }
                }
                Err(e) => {
                    let (expired, needs_restart) = classify(&e);
                    let message = error_chain(&e);
                    if tx.send(Signal::Failed { kind, expired, message }).is_err() {
                        return Stopped::Shutdown;
                    }
                    if stop_if_not_served && not_served(&e) {
                        return Stopped::NotServed;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trigger_time_parses_rfc3339() {
        let t = parse_trigger_time("2024-05-01T10:00:00Z").expect("parses");
        assert_eq!(t.duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_secs()).ok(), Some(1_714_557_600));
        assert!(parse_trigger_time("yesterday").is_none());
    }

    #[test]
    fn expired_versions_are_recognised() {
        let status = |code: u16, message: &str| kube::core::Status { code, message: message.into(), ..Default::default() };
        let e = watcher::Error::WatchError(Box::new(status(410, "too old resource version")));
        assert_eq!(classify(&e), (true, false), "the watcher relists on a 410 event itself");
        let e = watcher::Error::WatchStartFailed(kube::Error::Api(Box::new(status(504, "Too large resource version: 9, current: 3"))));
        assert_eq!(classify(&e), (true, true));
        let e = watcher::Error::WatchStartFailed(kube::Error::Api(Box::new(status(500, "boom"))));
        assert_eq!(classify(&e), (false, false));
    }

    #[test]
    fn older_error_shapes_are_recognised() {
        let status = |code: u16, reason: &str, message: &str| kube::core::Status {
            code,
            reason: reason.into(),
            message: message.into(),
            ..Default::default()
        };
        // 1.17-1.18: "too large" in the message only, no cause.
        let e = watcher::Error::WatchStartFailed(kube::Error::Api(Box::new(status(
            504,
            "Timeout",
            "Too large resource version: 9, current: 3",
        ))));
        assert_eq!(classify(&e), (true, true));
        // An expiry told by reason alone: kube-runtime would not relist.
        let e = watcher::Error::WatchError(Box::new(status(0, "Expired", "too old resource version")));
        assert_eq!(classify(&e), (true, true));
        let e = watcher::Error::WatchError(Box::new(status(0, "InternalError", "etcd")));
        assert_eq!(classify(&e), (false, false));
        // A 504 for another reason is not an expiry.
        let e = watcher::Error::WatchStartFailed(kube::Error::Api(Box::new(status(504, "Timeout", "request timed out"))));
        assert_eq!(classify(&e), (false, false));
    }

    #[test]
    fn a_404_means_not_served_whatever_its_body() {
        // What kube makes of a plain-text "404 page not found" (API
        // servers before 1.24) and of a 404 Status.
        let plain = kube::core::Status::failure("404 page not found", "Failed to parse error data").with_code(404);
        let json = kube::core::Status { code: 404, reason: "NotFound".into(), ..Default::default() };
        for s in [plain, json] {
            assert!(not_served(&watcher::Error::InitialListFailed(kube::Error::Api(Box::new(s.clone())))));
            assert!(not_served(&watcher::Error::WatchStartFailed(kube::Error::Api(Box::new(s.clone())))));
            assert!(!not_served(&watcher::Error::WatchError(Box::new(s))), "a 404 event inside a watch is the watch's business");
        }
        let e = watcher::Error::InitialListFailed(kube::Error::Api(Box::new(kube::core::Status { code: 403, ..Default::default() })));
        assert!(!not_served(&e));
    }
}
