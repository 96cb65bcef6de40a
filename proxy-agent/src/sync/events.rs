//! Kubernetes Events about Services the agent could not program as asked,
//! so that `kubectl describe service` shows why.
//!
//! Events are events.k8s.io Events (the API that replaced core/v1 Events
//! for new writers) with `reportingController: topoproxy` and
//! `reportingInstance: topoproxy-<node>`, type Warning, regarding the
//! Service. They are posted in the version negotiated with the API server
//! (`source::api_versions`): v1 from Kubernetes 1.19, v1beta1 before,
//! whose Event has the same fields under another `apiVersion`. A 404 for
//! the version in use (a control plane upgraded past 1.24 no longer serves
//! v1beta1) negotiates again; an API server that serves neither gets no
//! Events, which is said once.
//!
//! Every node sees the same bad object; each node's agent reports it once
//! (per problem, while it lasts), which matches how kube-proxy and the
//! kubelet report per-node observations.
//!
//! Deduplication: a problem is posted once and remembered while it is
//! current. When it goes away and later comes back it is posted again. A
//! failed post is forgotten, so it is retried on a later round.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, PostParams, TypeMeta};
use tokio::sync::watch;

use crate::model::ObjectRef;
use crate::observe::metrics::{Metrics, reason as metric_reason};
use crate::source::api_versions::{EVENTS_GROUP, Negotiated, Version};

/// `reportingController` of every Event the agent posts.
pub const REPORTING_CONTROLLER: &str = "topoproxy";

/// Event reasons (CamelCase, as Kubernetes components use).
pub const REASON_INVALID_SERVICE: &str = "InvalidService";
/// A Service's EndpointSlice, or an endpoint or port of it, was rejected.
pub const REASON_INVALID_ENDPOINT_SLICE: &str = "InvalidEndpointSlice";
/// A Service's `topologyKeys` are invalid and were ignored.
pub const REASON_INVALID_TOPOLOGY_KEYS: &str = "InvalidTopologyKeys";
/// A Service's other topology settings (annotations, `trafficDistribution`) are invalid and were ignored.
pub const REASON_INVALID_TOPOLOGY: &str = "InvalidTopologyConfiguration";

/// A Service whose topology reads labels of other Nodes waited longer
/// than `--node-label-wait-secs` for the Node watch to list them and was
/// programmed without them (`decide::label_wait`).
pub const REASON_NODE_LABELS_NOT_LISTED: &str = "TopologyNodeLabelsNotListed";

/// The API server rejects Event notes longer than this (events.k8s.io/v1
/// validation: note must be at most 1 kB).
const MAX_NOTE: usize = 1024;

/// reportingInstance, action and reason are limited to 128 characters.
const MAX_FIELD: usize = 128;

fn truncate(s: &str, max: usize) -> &str {
    let mut cut = s.len().min(max);
    while !s.is_char_boundary(cut) {
        cut -= 1;
    }
    &s[..cut]
}

/// One thing wrong with one Service (or with a slice of it), as it would
/// be reported in an Event.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServiceProblem {
    /// The Service the Event is about.
    pub service: ObjectRef,
    /// The Service's metadata.uid when known; Events refer to it so that a
    /// recreated Service does not inherit its predecessor's Events.
    pub uid: Option<String>,
    /// The Event's reason (one of the `REASON_*`).
    pub reason: &'static str,
    /// The Event's note.
    pub message: String,
}

/// Chooses the Event reason for a problem `decision::decide` found in a
/// Service's topology configuration. The problems are sentences naming the
/// field they are about (see `topology.rs`).
pub fn topology_reason(problem: &str) -> &'static str {
    if problem.contains("topologyKeys") || problem.contains("topology-keys") {
        REASON_INVALID_TOPOLOGY_KEYS
    } else {
        REASON_INVALID_TOPOLOGY
    }
}

/// Remembers which problems were reported.
#[derive(Debug, Default)]
pub struct Deduper {
    reported: BTreeSet<ServiceProblem>,
}

impl Deduper {
    /// The problems of `current` not reported yet. Problems reported before
    /// that are no longer current are forgotten.
    pub fn fresh(&mut self, current: &[ServiceProblem]) -> Vec<ServiceProblem> {
        let now: BTreeSet<&ServiceProblem> = current.iter().collect();
        self.reported.retain(|p| now.contains(p));
        let mut out = Vec::new();
        for p in now {
            if self.reported.insert(p.clone()) {
                out.push(p.clone());
            }
        }
        out
    }

    /// Forgets a problem whose Event could not be posted, so that it is
    /// tried again.
    pub fn forget(&mut self, p: &ServiceProblem) {
        self.reported.remove(p);
    }
}

/// Builds the Event for a problem.
pub fn event_for(p: &ServiceProblem, instance: &str, now: Timestamp) -> Event {
    let note = if p.message.len() > MAX_NOTE { format!("{}...", truncate(&p.message, MAX_NOTE - 3)) } else { p.message.clone() };
    Event {
        metadata: ObjectMeta {
            // The naming client-go's recorder uses: object name, a dot, a
            // unique hex suffix.
            name: Some(format!("{}.{:x}", p.service.name, now.as_nanosecond())),
            namespace: Some(p.service.namespace.to_string()),
            ..Default::default()
        },
        event_time: Some(MicroTime(now)),
        action: Some("Skipped".into()),
        reason: Some(p.reason.into()),
        note: Some(note),
        type_: Some("Warning".into()),
        reporting_controller: Some(REPORTING_CONTROLLER.into()),
        reporting_instance: Some(truncate(instance, MAX_FIELD).to_string()),
        regarding: Some(ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Service".into()),
            namespace: Some(p.service.namespace.to_string()),
            name: Some(p.service.name.to_string()),
            uid: p.uid.clone(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// `event` as an events.k8s.io Event of `version`: v1beta1's Event has
/// v1's fields, so only `apiVersion` differs.
pub fn event_object(event: &Event, version: Version) -> Result<(ApiResource, DynamicObject), serde_json::Error> {
    let resource = ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(EVENTS_GROUP, version.as_str(), "Event"), "events");
    let mut obj: DynamicObject = serde_json::from_value(serde_json::to_value(event)?)?;
    obj.types = Some(TypeMeta { api_version: resource.api_version.clone(), kind: resource.kind.clone() });
    Ok((resource, obj))
}

/// Posts Events in the background. The sync loop publishes the complete
/// list of current problems after each sync (`publish`); only the latest
/// list matters, so a slow or unavailable API server never holds up the
/// datapath.
pub struct EventReporter {
    tx: watch::Sender<Arc<Vec<ServiceProblem>>>,
}

impl EventReporter {
    /// Starts the posting task. `instance` is the reportingInstance (the
    /// API server limits it to 128 characters); Events wait for `versions`
    /// to be negotiated.
    pub fn spawn(client: Client, instance: String, metrics: Arc<Metrics>, versions: Negotiated) -> EventReporter {
        let (tx, rx) = watch::channel(Arc::new(Vec::new()));
        tokio::spawn(post_loop(client, instance, metrics, versions, rx));
        EventReporter { tx }
    }

    /// Hands over every problem the latest sync found (the whole set: only the newest is kept); the poster posts an Event for each one not already reported.
    pub fn publish(&self, problems: Vec<ServiceProblem>) {
        let _ = self.tx.send(Arc::new(problems));
    }
}

async fn post_loop(
    client: Client,
    instance: String,
    metrics: Arc<Metrics>,
    mut versions: Negotiated,
    mut rx: watch::Receiver<Arc<Vec<ServiceProblem>>>,
) {
    let mut dedup = Deduper::default();
    let mut retry = false;
    let Some(mut chosen) = versions.current().await else { return };
    let mut said_unserved = false;
    // A refusal (401/403) is a configuration problem an operator must see:
    // warned once, until a post succeeds again; other failures (the API
    // server unreachable, a conflict) are retried quietly.
    let mut said_forbidden = false;
    loop {
        if retry {
            // Some posts failed: look again after a while even if nothing
            // new is published.
            tokio::select! {
                r = rx.changed() => if r.is_err() { return },
                () = tokio::time::sleep(Duration::from_secs(10)) => {}
            }
        } else if rx.changed().await.is_err() {
            return;
        }
        let current = rx.borrow_and_update().clone();
        retry = false;
        let Some(version) = chosen.events else {
            if !said_unserved {
                tracing::warn!(
                    "the API server serves neither events.k8s.io/v1 nor v1beta1: problems are logged and counted, not posted as Events"
                );
                said_unserved = true;
            }
            continue;
        };
        let mut not_served = false;
        let mut forbidden: Option<String> = None;
        for p in dedup.fresh(&current) {
            let posted = match event_object(&event_for(&p, &instance, Timestamp::now()), version) {
                Ok((resource, obj)) => {
                    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &p.service.namespace, &resource);
                    api.create(&PostParams::default(), &obj).await.map(drop).map_err(|e| {
                        not_served |= matches!(&e, kube::Error::Api(s) if s.code == 404);
                        if matches!(&e, kube::Error::Api(s) if s.code == 401 || s.code == 403) {
                            forbidden.get_or_insert_with(|| e.to_string());
                        }
                        e.to_string()
                    })
                }
                Err(e) => Err(e.to_string()),
            };
            match posted {
                Ok(()) => {
                    metrics.event_posted();
                    said_forbidden = false;
                }
                Err(e) => {
                    tracing::debug!(service = %p.service, reason = p.reason, error = %e, "posting Event failed; will retry");
                    metrics.error(metric_reason::EVENT_POST);
                    dedup.forget(&p);
                    retry = true;
                }
            }
        }
        if let Some(e) = forbidden.filter(|_| !said_forbidden) {
            tracing::warn!(
                "the API server refuses the agent's Events ({e}): grant its ServiceAccount `create` on {EVENTS_GROUP} events \
                 (the chart's ClusterRole does); problems are still logged and counted in topoproxy_errors_total{{reason=\"event_post\"}}"
            );
            said_forbidden = true;
        }
        if not_served {
            tracing::warn!("the API server answers 404 for {EVENTS_GROUP}/{}; negotiating the version again", version.as_str());
            match versions.renegotiate().await {
                Some(v) => chosen = v,
                None => return,
            }
            said_unserved = false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(name: &str, msg: &str) -> ServiceProblem {
        ServiceProblem { service: ObjectRef::new("default", name), uid: None, reason: REASON_INVALID_SERVICE, message: msg.into() }
    }

    #[test]
    fn dedup_reports_once_while_current_and_again_after_it_went_away() {
        let mut d = Deduper::default();
        assert_eq!(d.fresh(&[p("a", "x"), p("b", "y")]).len(), 2);
        assert!(d.fresh(&[p("a", "x"), p("b", "y")]).is_empty(), "same problems are not re-reported");
        assert_eq!(d.fresh(&[p("a", "x"), p("b", "z")]), vec![p("b", "z")], "a changed message is a new problem");
        assert!(d.fresh(&[]).is_empty());
        assert_eq!(d.fresh(&[p("a", "x")]), vec![p("a", "x")], "fixed and broken again is reported again");
        d.forget(&p("a", "x"));
        assert_eq!(d.fresh(&[p("a", "x")]), vec![p("a", "x")], "a failed post is retried");
    }

    #[test]
    fn event_shape() {
        let mut prob = p("web", &"é".repeat(600));
        prob.uid = Some("u-1".into());
        let e = event_for(&prob, "topoproxy-node-a", Timestamp::UNIX_EPOCH);
        assert_eq!(e.reporting_controller.as_deref(), Some("topoproxy"));
        assert_eq!(e.reason.as_deref(), Some("InvalidService"));
        assert!(e.note.as_ref().is_some_and(|n| n.len() <= MAX_NOTE && n.ends_with("...")));
        let r = e.regarding.as_ref().expect("regarding");
        assert_eq!((r.kind.as_deref(), r.name.as_deref(), r.uid.as_deref()), (Some("Service"), Some("web"), Some("u-1")));
        assert_eq!(e.metadata.namespace.as_deref(), Some("default"));
        let long = event_for(&prob, &"n".repeat(300), Timestamp::UNIX_EPOCH);
        assert_eq!(long.reporting_instance.map(|i| i.len()), Some(MAX_FIELD));
    }

    #[test]
    fn v1beta1_events_have_v1s_fields() {
        let e = event_for(&p("web", "bad"), "topoproxy-node-a", Timestamp::UNIX_EPOCH);
        let (v1_res, v1) = event_object(&e, Version::V1).expect("v1");
        let (beta_res, beta) = event_object(&e, Version::V1beta1).expect("v1beta1");
        assert_eq!((v1_res.api_version.as_str(), v1_res.plural.as_str()), ("events.k8s.io/v1", "events"));
        assert_eq!(beta_res.api_version, "events.k8s.io/v1beta1");
        let json = |o: &DynamicObject| serde_json::to_value(o).expect("json");
        let (mut a, b) = (json(&v1), json(&beta));
        assert_eq!(b["apiVersion"], "events.k8s.io/v1beta1");
        assert_eq!(b["kind"], "Event");
        a["apiVersion"] = b["apiVersion"].clone();
        assert_eq!(a, b, "only apiVersion differs");
        for field in ["eventTime", "reportingController", "reportingInstance", "action", "reason", "note", "type", "regarding"] {
            assert!(b.get(field).is_some(), "{field} missing: {b}");
        }
    }

    #[test]
    fn topology_reasons() {
        assert_eq!(topology_reason("spec.topologyKeys ignored until fixed: ..."), REASON_INVALID_TOPOLOGY_KEYS);
        assert_eq!(topology_reason("annotation topoproxy.io/topology-keys ignored until fixed"), REASON_INVALID_TOPOLOGY_KEYS);
        assert_eq!(topology_reason("spec.trafficDistribution: Unsupported value"), REASON_INVALID_TOPOLOGY);
    }
}
