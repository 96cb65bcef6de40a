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
    /// `v1` Service.
    Service,
    /// `discovery.k8s.io` EndpointSlice.
    EndpointSlice,
    /// `v1` Node.
    Node,
}

impl Kind {
    /// Every kind.
    pub const ALL: [Kind; 3] = [Kind::Service, Kind::EndpointSlice, Kind::Node];

    /// The kind as Kubernetes spells it, for logs, metrics and Events.
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
    /// The object's kind.
    pub kind: String,
    /// `namespace/name`, or the manifest location when the object has no name.
    pub object: String,
    /// What is wrong with it.
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
    /// Whether nothing changed.
    pub fn is_empty(&self) -> bool {
        !self.all && self.services.is_empty() && self.slices.is_empty()
    }

    /// Adds what `later` changed.
    pub fn absorb(&mut self, later: Changes) {
        self.all |= later.all;
        if self.services.is_empty() {
            self.services = later.services;
        } else {
            self.services.extend(later.services);
        }
        if self.slices.is_empty() {
            self.slices = later.slices;
        } else {
            self.slices.extend(later.slices);
        }
    }
}

/// An object left out of the model, and the Service it concerns (for the
/// Event), if any.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectProblem {
    /// The object's kind.
    pub kind: Kind,
    /// What was wrong.
    pub error: ObjectError,
    /// The Service the problem belongs to: the Service itself, or the owner
    /// named by an EndpointSlice's `kubernetes.io/service-name` label.
    pub service: Option<ObjectRef>,
}

/// One object as converted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Object {
    /// A Service.
    Service(Service),
    /// An EndpointSlice.
    Slice(EndpointSlice),
    /// A Node.
    Node(Node),
}

/// What a watcher saw happen to one object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Delta {
    /// The object's kind.
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
    /// The object `id` of `kind` was deleted.
    pub fn removed(kind: Kind, id: ObjectRef) -> Delta {
        Delta { kind, id, present: false, uid: None, object: None, problems: Vec::new() }
    }
}

/// New entries per map in one [`Model::apply`], to rebuild a map that grew
/// by many (`repack_after`).
#[derive(Default)]
struct Grown {
    services: usize,
    slices: usize,
    uids: usize,
}

/// Deltas from this many up are applied to an empty model in bulk.
const BULK_FROM: usize = 1024;

/// The cluster as the sync loop sees it, with what was left out.
#[derive(Debug, Default)]
pub struct Model {
    /// Every object converted without error.
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
        let deltas: Vec<Delta> = deltas.into_iter().collect();
        let deltas = match self.apply_bulk(deltas) {
            Ok(changes) => return changes,
            Err(deltas) => deltas,
        };
        let mut changes = Changes::default();
        // New entries per map, to rebuild a map that grew by many.
        let mut grown = Grown::default();
        for d in deltas {
            self.apply_one(d, &mut changes, &mut grown);
        }
        repack_after(&mut self.cluster.services, grown.services);
        repack_after(&mut self.cluster.slices, grown.slices);
        repack_after(&mut self.service_uids, grown.uids);
        changes
    }

    /// [`Self::apply`] into an empty model (the first list): the maps are
    /// built from the deltas sorted by id, in bulk, rather than by an
    /// insert each, which compares the key with a B-tree path's worth of
    /// others (at 100k Services, 200k objects and three maps, a quarter of
    /// a second of the cold start). Gives the deltas back, untouched, when
    /// the model is not empty, the batch is small, or an object comes twice
    /// (their order matters then).
    fn apply_bulk(&mut self, mut deltas: Vec<Delta>) -> Result<Changes, Vec<Delta>> {
        let empty = self.cluster.services.is_empty()
            && self.cluster.slices.is_empty()
            && self.cluster.nodes.is_empty()
            && self.problems.is_empty()
            && self.service_uids.is_empty();
        if !empty || deltas.len() < BULK_FROM {
            return Err(deltas);
        }
        let mut order: Vec<u32> = (0..deltas.len() as u32).collect();
        let key = |i: &u32| {
            let d = &deltas[*i as usize];
            (d.kind, &d.id)
        };
        // Stable, so it finds the runs already in order (a source hands
        // its objects over sorted, file by file) and merges them.
        order.sort_by(|a, b| key(a).cmp(&key(b)));
        if order.windows(2).any(|w| key(&w[0]) == key(&w[1])) {
            return Err(deltas);
        }
        // In id order, so each map is collected without a sort; from an
        // empty model every object that converted is a change.
        let mut changes = Changes::default();
        let (mut services, mut slices, mut uids, mut problems) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut nodes = Vec::new();
        for i in order {
            let d = &mut deltas[i as usize];
            if d.kind == Kind::Node {
                // Few, keyed by name, and followed for labels: one by one.
                nodes.push(std::mem::replace(d, Delta::removed(Kind::Node, d.id.clone())));
                continue;
            }
            if !d.problems.is_empty() {
                problems.push(((d.kind, d.id.clone()), std::mem::take(&mut d.problems)));
            }
            match (d.kind, d.object.take()) {
                (Kind::Service, object) => {
                    if let Some(uid) = d.uid.take().filter(|_| d.present) {
                        uids.push((d.id.clone(), uid));
                    }
                    if let Some(Object::Service(s)) = object {
                        services.push((d.id.clone(), share_id(s, &d.id, |s| &mut s.id)));
                    }
                }
                (Kind::EndpointSlice, Some(Object::Slice(s))) => slices.push((d.id.clone(), share_id(s, &d.id, |s| &mut s.id))),
                (Kind::EndpointSlice | Kind::Node, _) => {}
            }
        }
        drop(deltas);
        changes.services = services.iter().map(|(id, _)| id.clone()).collect();
        changes.slices = slices.iter().map(|(id, _)| id.clone()).collect();
        self.cluster.services = services.into_iter().collect();
        self.cluster.slices = slices.into_iter().collect();
        self.service_uids = uids.into_iter().collect();
        self.problems = problems.into_iter().collect();
        let mut grown = Grown::default();
        for d in nodes {
            self.apply_one(d, &mut changes, &mut grown);
        }
        Ok(changes)
    }

    /// Applies one delta.
    fn apply_one(&mut self, d: Delta, changes: &mut Changes, grown: &mut Grown) {
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
                        grown.uids += usize::from(self.service_uids.insert(d.id.clone(), uid).is_none());
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
                        Some(s) => grown.services += usize::from(self.cluster.services.insert(d.id.clone(), s).is_none()),
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
                        Some(s) => grown.slices += usize::from(self.cluster.slices.insert(d.id.clone(), s).is_none()),
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

    /// A first list of many objects (some invalid, some with problems, a
    /// few Nodes) gives the same model and changes in bulk as one by one.
    #[test]
    fn a_first_list_in_bulk_is_the_same_as_one_by_one() {
        let mut yaml = String::from(
            "kind: Node\nmetadata: {name: a, labels: {topology.kubernetes.io/zone: z1}}\n---\nkind: Node\nmetadata: {name: b}\n",
        );
        for i in (0..BULK_FROM).rev() {
            let ip = if i % 97 == 0 { "10.96.999.1".to_string() } else { format!("10.96.{}.{}", i / 250, i % 250 + 1) };
            yaml.push_str(&format!(
                "---\nkind: Service\nmetadata: {{name: s{i}, namespace: ns{}, uid: u{i}}}\nspec: {{clusterIP: {ip}, ports: [{{port: 80}}]}}\n",
                i % 3
            ));
            let address = if i % 89 == 0 { "nope" } else { "10.244.0.1" };
            yaml.push_str(&format!(
                "---\nkind: EndpointSlice\nmetadata: {{name: s{i}-1, namespace: ns{}, labels: {{kubernetes.io/service-name: s{i}}}}}\naddressType: IPv4\nports: [{{port: 8080}}]\nendpoints: [{{addresses: [{address}], nodeName: a}}]\n",
                i % 3
            ));
        }
        let read = crate::source::manifest_watch::read_text(&yaml);
        let deltas: Vec<Delta> = read.deltas.into_values().collect();
        assert!(deltas.len() > BULK_FROM);

        let mut bulk = Model::default();
        let changes = bulk.apply(deltas.clone());
        let mut one_by_one = Model::default();
        let mut rest = deltas.clone();
        let first = rest.remove(rest.len() / 2);
        let mut want = one_by_one.apply([first]);
        let more = one_by_one.apply(rest);
        want.all |= more.all;
        want.services.extend(more.services);
        want.slices.extend(more.slices);
        assert_eq!(bulk.cluster, one_by_one.cluster);
        assert_eq!(bulk.service_uids, one_by_one.service_uids);
        assert_eq!(bulk.problems, one_by_one.problems);
        assert!(bulk.problems().count() > 10, "invalid objects are among them");
        assert_eq!(changes, want);
        assert!(changes.all, "Nodes came");

        // An object listed twice: applied in order, the last one counts.
        let mut twice = deltas;
        twice.push(svc("late", 80));
        let mut gone = svc("late", 80);
        gone.present = false;
        gone.object = None;
        gone.uid = None;
        twice.push(gone);
        let mut m = Model::default();
        m.apply(twice);
        assert!(!m.cluster.services.contains_key(&ObjectRef::new("ns", "late")));
        assert!(!m.service_uids.contains_key(&ObjectRef::new("ns", "late")));
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
