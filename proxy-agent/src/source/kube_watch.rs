//! The API server as a source of the model: kube-runtime watchers for
//! Services, EndpointSlices and Nodes that convert each object once, when
//! it arrives, and queue the result for the sync loop (`source::feed`).
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

use std::collections::HashMap;
use std::fmt::Debug;
use std::hash::Hash;
use std::time::{Duration, SystemTime};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, PartialObjectMeta};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, DefaultBackoff};
use kube::{Client, Resource};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::mpsc::UnboundedSender;

use crate::model::ObjectRef;
use crate::model::store::{Delta, Kind};
use crate::source::delta::{delta_from_value, service_delta, slice_delta};
use crate::source::feed::{Signal, Stores};
use crate::source::wire::{WireService, WireSlice};
use crate::util::error_chain::error_chain;

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

/// Starts one watcher task per kind and returns the queue they fill.
/// The tasks run until the runtime shuts down.
pub fn start(client: Client, tx: UnboundedSender<Signal>) -> Stores {
    let stores = Stores::default();
    let services: Api<WireService> = Api::all(client.clone());
    let svc_config = watcher::Config::default().labels(SERVICE_LABEL_SELECTOR);
    tokio::spawn(watch_kind(services, svc_config, stores.clone(), Kind::Service, tx.clone(), |_| None, |s| Some(service_delta(s))));

    let slices: Api<WireSlice> = Api::all(client.clone());
    tokio::spawn(watch_kind(
        slices,
        watcher::Config::default(),
        stores.clone(),
        Kind::EndpointSlice,
        tx.clone(),
        slice_trigger_time,
        |s| Some(slice_delta(s)),
    ));

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
                            stores.set_len(kind, known.len());
                            Some(Signal::Changed { kind, trigger })
                        }
                        // A deleted slice's trigger annotation describes its
                        // last update, not the deletion.
                        watcher::Event::Delete(obj) => {
                            let (id, _) = key_of(&obj);
                            known.remove(&id);
                            stores.push([Delta::removed(kind, id)]);
                            stores.set_len(kind, known.len());
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
                            stores.set_len(kind, known.len());
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
}
