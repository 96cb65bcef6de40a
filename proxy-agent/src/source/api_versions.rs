//! Which versions of the APIs that changed between Kubernetes 1.17 and
//! today the agent uses, negotiated with the API server from its discovery
//! document (`GET /apis`, the APIGroupList every release serves):
//!
//! | group | served | used |
//! | --- | --- | --- |
//! | discovery.k8s.io (EndpointSlices) | v1beta1 in 1.17-1.24, v1 from 1.21 | v1 when served, else v1beta1 |
//! | events.k8s.io (Events) | v1beta1 in 1.8-1.24, v1 from 1.19 | v1 when served, else v1beta1 |
//!
//! Services and Nodes are core/v1 in every release and need no
//! negotiation. It runs in the background at start-up, retried with
//! backoff while the API server cannot be reached, so an agent started
//! during an outage keeps its pinned datapath and negotiates once the API
//! server answers; the EndpointSlice watcher and the Event poster wait for
//! the answer. Either asks again when the API server answers 404 for the
//! version in use: a control plane upgraded past 1.24 under a running agent
//! no longer serves the v1beta1 it chose. The choice is logged when it
//! changes and exported as `topoproxy_api_version{group, version} 1`.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::APIGroupList;
use kube::Client;
use kube::runtime::watcher::DefaultBackoff;
use tokio::sync::{Notify, watch};

use crate::observe::metrics::{Metrics, reason};
use crate::util::error_chain::error_chain;

/// The group of EndpointSlices.
pub const DISCOVERY_GROUP: &str = "discovery.k8s.io";
/// The group of the Events the agent posts.
pub const EVENTS_GROUP: &str = "events.k8s.io";

/// A version of a group: v1, or the v1beta1 before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Version {
    /// The group's GA version.
    V1,
    /// The beta before it (EndpointSlices before 1.21, Events before 1.19).
    V1beta1,
}

impl Version {
    /// `v1` or `v1beta1`, as in an API path.
    pub fn as_str(self) -> &'static str {
        match self {
            Version::V1 => "v1",
            Version::V1beta1 => "v1beta1",
        }
    }
}

/// The versions in use. `None`: the API server serves neither version of
/// the group (before 1.17 for EndpointSlices, or turned off with
/// `--runtime-config`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ApiVersions {
    /// `discovery.k8s.io`'s version.
    pub endpoint_slices: Option<Version>,
    /// `events.k8s.io`'s version.
    pub events: Option<Version>,
}

impl ApiVersions {
    /// The newest version of each group the API server serves.
    pub fn choose(groups: &APIGroupList) -> ApiVersions {
        let newest = |group: &str| {
            let served: Vec<&str> =
                groups.groups.iter().filter(|g| g.name == group).flat_map(|g| g.versions.iter().map(|v| v.version.as_str())).collect();
            [Version::V1, Version::V1beta1].into_iter().find(|v| served.contains(&v.as_str()))
        };
        ApiVersions { endpoint_slices: newest(DISCOVERY_GROUP), events: newest(EVENTS_GROUP) }
    }

    /// (group, version) of each group in use.
    pub fn in_use(&self) -> Vec<(&'static str, &'static str)> {
        [(DISCOVERY_GROUP, self.endpoint_slices), (EVENTS_GROUP, self.events)]
            .into_iter()
            .filter_map(|(g, v)| Some((g, v?.as_str())))
            .collect()
    }
}

impl fmt::Display for ApiVersions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let show = |group: &str, v: Option<Version>| {
            v.map_or(format!("{group}: neither v1 nor v1beta1 served"), |v| format!("{group}/{}", v.as_str()))
        };
        write!(f, "EndpointSlices {}, Events {}", show(DISCOVERY_GROUP, self.endpoint_slices), show(EVENTS_GROUP, self.events))
    }
}

/// The negotiated versions, shared by the tasks that depend on them.
#[derive(Clone)]
pub struct Negotiated {
    rx: watch::Receiver<Option<ApiVersions>>,
    again: Arc<Notify>,
}

impl Negotiated {
    /// The versions in use, once negotiated; `None` only when the agent is
    /// shutting down.
    pub async fn current(&mut self) -> Option<ApiVersions> {
        self.rx.wait_for(Option::is_some).await.ok().and_then(|v| *v)
    }

    /// Asks the API server again and returns its answer: for a caller that
    /// was told 404 for the version in use.
    pub async fn renegotiate(&mut self) -> Option<ApiVersions> {
        self.rx.mark_unchanged();
        self.again.notify_one();
        self.rx.changed().await.ok()?;
        *self.rx.borrow_and_update()
    }
}

/// Starts negotiating in the background.
pub fn negotiate(client: Client, metrics: Arc<Metrics>) -> Negotiated {
    let (tx, rx) = watch::channel(None);
    let again = Arc::new(Notify::new());
    tokio::spawn(negotiate_loop(client, metrics, tx, again.clone()));
    Negotiated { rx, again }
}

async fn negotiate_loop(client: Client, metrics: Arc<Metrics>, tx: watch::Sender<Option<ApiVersions>>, again: Arc<Notify>) {
    // Exponential 0.8 s .. 30 s with jitter, like the watchers.
    let mut backoff = DefaultBackoff::default();
    let mut failing = false;
    loop {
        match client.list_api_groups().await {
            Ok(groups) => {
                let chosen = ApiVersions::choose(&groups);
                if *tx.borrow() != Some(chosen) {
                    tracing::info!(
                        endpoint_slices = chosen.endpoint_slices.map_or("none", Version::as_str),
                        events = chosen.events.map_or("none", Version::as_str),
                        "API versions negotiated from the API server's discovery document: {chosen}"
                    );
                    metrics.set_api_versions(&chosen.in_use());
                }
                failing = false;
                backoff = DefaultBackoff::default();
                // Wakes whoever asked, also when the answer is the same.
                tx.send_replace(Some(chosen));
                again.notified().await;
            }
            Err(e) => {
                metrics.error(reason::API_DISCOVERY);
                let message = error_chain(&e);
                if failing {
                    tracing::debug!("reading the API server's discovery document (/apis) still fails: {message}");
                } else {
                    tracing::warn!(
                        "cannot read the API server's discovery document (/apis); EndpointSlices and Events wait for it: {message}"
                    );
                }
                failing = true;
                tokio::time::sleep(backoff.next().unwrap_or(Duration::from_secs(30))).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    /// An APIGroupList with the given groups and their versions.
    fn groups(served: &[(&str, &[&str])]) -> APIGroupList {
        let groups: Vec<serde_json::Value> = served
            .iter()
            .map(|(name, versions)| {
                let versions: Vec<serde_json::Value> =
                    versions.iter().map(|v| json!({"groupVersion": format!("{name}/{v}"), "version": v})).collect();
                json!({"name": name, "versions": versions, "preferredVersion": versions.first()})
            })
            .collect();
        serde_json::from_value(json!({"groups": groups})).expect("APIGroupList")
    }

    #[test]
    fn the_newest_served_version_of_each_group() {
        use Version::{V1, V1beta1};
        let apps: (&str, &[&str]) = ("apps", &["v1"]);
        let cases: [(&str, APIGroupList, Option<Version>, Option<Version>); 6] = [
            ("1.16: no EndpointSlices", groups(&[apps, (EVENTS_GROUP, &["v1beta1"])]), None, Some(V1beta1)),
            (
                "1.18: v1beta1 only",
                groups(&[apps, (DISCOVERY_GROUP, &["v1beta1"]), (EVENTS_GROUP, &["v1beta1"])]),
                Some(V1beta1),
                Some(V1beta1),
            ),
            (
                "1.19, 1.20: events v1",
                groups(&[(DISCOVERY_GROUP, &["v1beta1"]), (EVENTS_GROUP, &["v1", "v1beta1"])]),
                Some(V1beta1),
                Some(V1),
            ),
            ("1.21-1.24: both", groups(&[(DISCOVERY_GROUP, &["v1", "v1beta1"]), (EVENTS_GROUP, &["v1", "v1beta1"])]), Some(V1), Some(V1)),
            ("1.25 on: v1 only", groups(&[(EVENTS_GROUP, &["v1"]), (DISCOVERY_GROUP, &["v1"]), apps]), Some(V1), Some(V1)),
            ("versions listed oldest first", groups(&[(DISCOVERY_GROUP, &["v1beta1", "v1"])]), Some(V1), None),
        ];
        for (name, list, slices, events) in cases {
            assert_eq!(ApiVersions::choose(&list), ApiVersions { endpoint_slices: slices, events }, "{name}");
        }
    }

    #[test]
    fn choices_read_well_and_export_what_is_in_use() {
        let v = ApiVersions { endpoint_slices: Some(Version::V1beta1), events: None };
        assert_eq!(v.to_string(), "EndpointSlices discovery.k8s.io/v1beta1, Events events.k8s.io: neither v1 nor v1beta1 served");
        assert_eq!(v.in_use(), [("discovery.k8s.io", "v1beta1")]);
    }
}
