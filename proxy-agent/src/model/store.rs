//! The model kept between syncs, whatever the source.
//!
//! A source converts each object once, when it arrives (`source::kube_watch`
//! for the API server, `source::manifest` for files),
//! and hand over the result as a [`Delta`]; nothing else keeps the API
//! server's objects. A sync applies the deltas queued since the last one
//! to this model and learns which Services and EndpointSlices changed, so
//! that only those are decided again (`decide::cache`). Keeping converted
//! objects only is also what keeps the agent's memory small: a watched
//! EndpointSlice with ten endpoints is several kilobytes as a Kubernetes
//! object and a few hundred bytes in the model.

use std::collections::{BTreeMap, BTreeSet};

use crate::model::{Cluster, EndpointSlice, Node, ObjectRef, Service};
use crate::util::btree::repack_after;

/// The kinds of object the agent reads.
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

/// Why an object was left out.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct ObjectError {
    pub kind: String,
    /// `namespace/name`, or the manifest location when the object has no name.
    pub object: String,
    pub reason: String,
}

impl std::fmt::Display for ObjectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}: {}", self.kind, self.object, self.reason)
    }
}

/// What changed in the model since the last update.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Changes {
    /// Decide everything again (first sync, a Node's labels changed: node
    /// labels feed every topology decision).
    pub all: bool,
    /// Services added, changed or removed.
    pub services: BTreeSet<ObjectRef>,
    /// EndpointSlices added, changed or removed.
    pub slices: BTreeSet<ObjectRef>,
}

impl Changes {
    pub fn is_empty(&self) -> bool {
        !self.all && self.services.is_empty() && self.slices.is_empty()
    }
}

/// An object left out of the model, and the Service it concerns (for the
/// Event), if any.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectProblem {
    pub kind: Kind,
    pub error: ObjectError,
    /// The Service the problem belongs to: the Service itself, or the owner
    /// named by an EndpointSlice's `kubernetes.io/service-name` label.
    pub service: Option<ObjectRef>,
}

/// One object as converted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Object {
    Service(Service),
    Slice(EndpointSlice),
    Node(Node),
}

/// What a watcher saw happen to one object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Delta {
    pub kind: Kind,
    /// namespace/name; Nodes have an empty namespace.
    pub id: ObjectRef,
    /// Whether the object exists (false: deleted, or gone in a relist).
    pub present: bool,
    /// `metadata.uid` (Services: Events are attached by uid).
    pub uid: Option<String>,
    /// The converted object; `None` when deleted, ignored (headless,
    /// another proxy's...) or invalid.
    pub object: Option<Object>,
    /// Problems found while converting (the object may still be usable).
    pub problems: Vec<ObjectProblem>,
}

impl Delta {
    pub fn removed(kind: Kind, id: ObjectRef) -> Delta {
        Delta { kind, id, present: false, uid: None, object: None, problems: Vec::new() }
    }
}

/// The cluster as the sync loop sees it, with what was left out.
#[derive(Debug, Default)]
pub struct Model {
    pub cluster: Cluster,
    problems: BTreeMap<(Kind, ObjectRef), Vec<ObjectProblem>>,
    /// metadata.uid of every watched Service, valid or not (for Events).
    pub service_uids: BTreeMap<ObjectRef, String>,
}

impl Model {
    /// Applies deltas in order and returns what changed. An object whose
    /// conversion is the same as before (a resync, a Node heartbeat that
    /// touched only its status) changes nothing.
    pub fn apply(&mut self, deltas: impl IntoIterator<Item = Delta>) -> Changes {
        let mut changes = Changes::default();
        // New entries per map, to rebuild a map that grew by many.
        let (mut new_services, mut new_slices, mut new_uids) = (0, 0, 0);
        for d in deltas {
            let key = (d.kind, d.id.clone());
            if d.problems.is_empty() {
                self.problems.remove(&key);
            } else {
                self.problems.insert(key, d.problems);
            }
            match d.kind {
                Kind::Service => {
                    match d.uid.filter(|_| d.present) {
                        Some(uid) => {
                            new_uids += usize::from(self.service_uids.insert(d.id.clone(), uid).is_none());
                        }
                        None => {
                            self.service_uids.remove(&d.id);
                        }
                    }
                    let new = match d.object {
                        Some(Object::Service(s)) => Some(share_id(s, &d.id, |s| &mut s.id)),
                        _ => None,
                    };
                    if self.cluster.services.get(&d.id) != new.as_ref() {
                        match new {
                            Some(s) => new_services += usize::from(self.cluster.services.insert(d.id.clone(), s).is_none()),
                            None => drop(self.cluster.services.remove(&d.id)),
                        }
                        changes.services.insert(d.id);
                    }
                }
                Kind::EndpointSlice => {
                    let new = match d.object {
                        Some(Object::Slice(s)) => Some(share_id(s, &d.id, |s| &mut s.id)),
                        _ => None,
                    };
                    if self.cluster.slices.get(&d.id) != new.as_ref() {
                        match new {
                            Some(s) => new_slices += usize::from(self.cluster.slices.insert(d.id.clone(), s).is_none()),
                            None => drop(self.cluster.slices.remove(&d.id)),
                        }
                        changes.slices.insert(d.id);
                    }
                }
                Kind::Node => {
                    let new = match d.object {
                        Some(Object::Node(n)) => Some(n),
                        _ => None,
                    };
                    // Node labels feed every topology decision; whether a
                    // node is leaving feeds none (only this node's health),
                    // so that alone decides nothing again.
                    let old = self.cluster.nodes.get(&*d.id.name);
                    if old != new.as_ref() {
                        changes.all |= old.map(|n| &n.labels) != new.as_ref().map(|n| &n.labels);
                        match new {
                            Some(n) => self.cluster.nodes.insert(d.id.name.to_string(), n),
                            None => self.cluster.nodes.remove(&*d.id.name),
                        };
                    }
                }
            }
        }
        repack_after(&mut self.cluster.services, new_services);
        repack_after(&mut self.cluster.slices, new_slices);
        repack_after(&mut self.service_uids, new_uids);
        changes
    }

    /// Objects left out or converted in part, by kind then name.
    pub fn problems(&self) -> impl Iterator<Item = &ObjectProblem> {
        self.problems.values().flatten()
    }
}

/// `object` with its own id made the same copy as the key it is kept
/// under, when they are equal (they are unless the source named a nameless
/// object after its location): one copy of the names per object.
fn share_id<T>(mut object: T, key: &ObjectRef, id: fn(&mut T) -> &mut ObjectRef) -> T {
    let own = id(&mut object);
    if own == key {
        own.clone_from(key);
    }
    object
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Protocol;

    fn svc(name: &str, port: u16) -> Delta {
        let s = Service {
            id: ObjectRef::new("ns", name),
            service_type: crate::model::ServiceType::ClusterIp,
            cluster_ips: vec!["10.96.0.1".parse().unwrap()],
            ports: vec![crate::model::ServicePort { name: String::new(), port, protocol: Protocol::Tcp, node_port: None }],
            topology_keys: None,
            annotations: BTreeMap::new(),
            internal_policy_local: false,
            external_policy_local: false,
            traffic_distribution: None,
            external_ips: Vec::new(),
            load_balancer_ips: Vec::new(),
            health_check_node_port: None,
            session_affinity: None,
            load_balancer_source_ranges: None,
        };
        Delta {
            kind: Kind::Service,
            id: s.id.clone(),
            present: true,
            uid: Some(format!("uid-{name}")),
            object: Some(Object::Service(s)),
            problems: Vec::new(),
        }
    }

    #[test]
    fn only_real_changes_are_reported() {
        let mut m = Model::default();
        let c = m.apply([svc("a", 80), svc("b", 80)]);
        assert_eq!(c.services.len(), 2);
        assert_eq!(m.service_uids.len(), 2);
        let c = m.apply([svc("a", 80)]);
        assert!(c.is_empty(), "the same object again changes nothing");
        let c = m.apply([svc("a", 81)]);
        assert_eq!(c.services.into_iter().collect::<Vec<_>>(), [ObjectRef::new("ns", "a")]);
        let c = m.apply([Delta::removed(Kind::Service, ObjectRef::new("ns", "b"))]);
        assert_eq!(c.services.len(), 1);
        assert!(!m.cluster.services.contains_key(&ObjectRef::new("ns", "b")));
        assert!(!m.service_uids.contains_key(&ObjectRef::new("ns", "b")));

        let node = |zone: &str, leaving: Option<&'static str>| Delta {
            kind: Kind::Node,
            id: ObjectRef::new("", "n1"),
            present: true,
            uid: None,
            object: Some(Object::Node(Node { name: "n1".into(), labels: [("zone".into(), zone.into())].into(), leaving })),
            problems: Vec::new(),
        };
        assert!(m.apply([node("z1", None)]).all);
        assert!(m.apply([node("z1", None)]).is_empty(), "a heartbeat without label changes is nothing");
        assert!(m.apply([node("z2", None)]).all);
        // Leaving changes the node, not any decision.
        assert!(m.apply([node("z2", Some("deletionTimestamp"))]).is_empty());
        assert_eq!(m.cluster.nodes["n1"].leaving, Some("deletionTimestamp"));
        assert!(m.apply([Delta::removed(Kind::Node, ObjectRef::new("", "n1"))]).all, "a node's labels are gone with it");
    }

    #[test]
    fn problems_follow_their_object() {
        let mut m = Model::default();
        let mut bad = svc("a", 80);
        bad.object = None;
        bad.problems = vec![ObjectProblem {
            kind: Kind::Service,
            error: ObjectError { kind: "Service".into(), object: "ns/a".into(), reason: "bad".into() },
            service: Some(ObjectRef::new("ns", "a")),
        }];
        m.apply([bad]);
        assert_eq!(m.problems().count(), 1);
        assert_eq!(m.service_uids.len(), 1, "invalid Services keep their uid for Events");
        m.apply([svc("a", 80)]);
        assert_eq!(m.problems().count(), 0);
        assert_eq!(m.cluster.services.len(), 1);
    }
}
