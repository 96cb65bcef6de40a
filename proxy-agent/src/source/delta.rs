//! Converting one object, as JSON or in its slim wire shape, into the
//! [`Delta`] a source queues for the model. Both sources call these, so
//! they agree on every check.

use std::collections::BTreeSet;

use serde_json::Value;

use crate::model::store::{Delta, Kind, Object, ObjectProblem};
use crate::model::{Node, ObjectRef};
use crate::source::objects::{self, Converted, SERVICE_NAME_LABEL};
use crate::source::wire::{WireNode, WireService, WireSlice};
use crate::util::intern::intern;

/// Converts one object of `kind` (as JSON, the API server's or a test's)
/// into what the model needs. The same `objects::*_from_json` functions
/// read manifests, so both sources agree on every check.
pub(crate) fn delta_from_value(kind: Kind, v: &Value) -> Delta {
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
                .filter(|name| !name.is_empty())
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
pub(crate) fn service_delta(s: WireService) -> Delta {
    let (ns, name) = objects::meta_ref(&s.metadata);
    let id = ObjectRef::new(ns, name);
    let mut d =
        Delta { kind: Kind::Service, id: id.clone(), present: true, uid: s.metadata.uid.clone(), object: None, problems: Vec::new() };
    record(&mut d, Some(id), objects::service_from_wire(s), Object::Service);
    d
}

/// A Node as the watcher receives it, converted like [`delta_from_value`]
/// converts one given as JSON.
pub(crate) fn node_delta(n: WireNode) -> Delta {
    let id = ObjectRef::new("", n.metadata.name.clone().unwrap_or_default());
    let mut d = Delta { kind: Kind::Node, id, present: true, uid: None, object: None, problems: Vec::new() };
    match objects::node_from_wire(n) {
        Ok(n) => d.object = Some(Object::Node(n)),
        Err(error) => d.problems.push(ObjectProblem { kind: Kind::Node, error, service: None }),
    }
    d
}

/// Another Node, as a metadata-only watch delivers it: its name and, of
/// its labels, only `keep` (interned). Nothing else of another Node is
/// read: its taints and deletion matter only to its own agent.
pub(crate) fn node_labels_delta(m: kube::core::PartialObjectMeta<WireNode>, keep: &BTreeSet<String>) -> Delta {
    let name = m.metadata.name.unwrap_or_default();
    let id = ObjectRef::new("", name.clone());
    let mut d = Delta { kind: Kind::Node, id, present: true, uid: None, object: None, problems: Vec::new() };
    if name.is_empty() {
        d.problems.push(ObjectProblem { kind: Kind::Node, error: objects::node_without_name(), service: None });
        return d;
    }
    let labels = m.metadata.labels.unwrap_or_default();
    let labels = labels.iter().filter(|(k, _)| keep.contains(k.as_str())).map(|(k, v)| (intern(k), intern(v))).collect();
    d.object = Some(Object::Node(Node { name, labels, leaving: None }));
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
            match converted {
                Converted::Ok(o) => d.object = Some(wrap(o)),
                Converted::Ignored(why) => tracing::debug!(kind = kind.as_str(), object = %d.id, "not ours: {why}"),
            }
        }
        Err(error) => d.problems.push(problem(error)),
    }
}

/// A slice as the watcher receives it, converted like
/// [`delta_from_value`] converts one given as JSON.
pub(crate) fn slice_delta(s: WireSlice) -> Delta {
    let (ns, name) = objects::meta_ref(&s.metadata);
    let id = ObjectRef::new(ns, name);
    let owner = s
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(SERVICE_NAME_LABEL))
        .filter(|name| !name.is_empty())
        .map(|name| ObjectRef::new(id.namespace.clone(), name.as_str()));
    let mut d = Delta { kind: Kind::EndpointSlice, id, present: true, uid: None, object: None, problems: Vec::new() };
    record(&mut d, owner, objects::slice_from_wire(s), Object::Slice);
    d
}

#[cfg(test)]
mod tests {

    /// Another Node as the metadata-only watch brings it keeps its name and
    /// the labels in use, nothing else.
    #[test]
    fn another_node_keeps_only_the_labels_in_use() {
        let meta: kube::core::PartialObjectMeta<WireNode> = serde_json::from_value(serde_json::json!({
            "apiVersion": "meta.k8s.io/v1",
            "kind": "PartialObjectMetadata",
            "metadata": {
                "name": "n2",
                "labels": {"topology.kubernetes.io/region": "r1", "topology.kubernetes.io/zone": "z1", "example.com/team": "a", "kubernetes.io/os": "linux"},
                "annotations": {"node.alpha.kubernetes.io/ttl": "0"},
                "managedFields": [{"manager": "kubelet", "operation": "Update"}],
            },
        }))
        .expect("PartialObjectMetadata");
        let keep: BTreeSet<String> = ["topology.kubernetes.io/region", "topology.kubernetes.io/zone"].map(str::to_string).into();
        let d = node_labels_delta(meta, &keep);
        let Some(Object::Node(n)) = &d.object else { panic!("{d:?}") };
        assert_eq!(n.name, "n2");
        let labels: Vec<(&str, &str)> = n.labels.iter().map(|(k, v)| (&**k, &**v)).collect();
        assert_eq!(labels, [("topology.kubernetes.io/region", "r1"), ("topology.kubernetes.io/zone", "z1")]);
        assert_eq!(n.leaving, None, "another Node's taints and deletion are its own agent's");
        assert!(d.problems.is_empty());
    }

    use std::collections::BTreeMap;

    use serde_json::json;

    use super::*;
    use crate::model::Cluster;
    use crate::model::store::Model;
    use crate::source::wire::WireSlice;

    /// The model built from a set of objects, with what was left out.
    #[derive(Debug, Default)]
    struct Snapshot {
        pub cluster: Cluster,
        pub problems: Vec<ObjectProblem>,
        /// metadata.uid of every watched Service, valid or not (for Events).
        pub service_uids: BTreeMap<ObjectRef, String>,
    }

    /// Builds the model from objects as JSON (the API server's or a test's).
    fn snapshot_from_values(services: &[Value], slices: &[Value], nodes: &[Value]) -> Snapshot {
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
        assert_eq!(&*s.cluster.nodes["n1"].labels["topology.kubernetes.io/zone"], "z1");
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
    fn watched_nodes_convert_like_json_ones() {
        let v = json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": "n1", "labels": {"topology.kubernetes.io/zone": "z1"}},
            "spec": {"taints": [{"key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule"}]},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}
        });
        let wire: crate::source::wire::WireNode = serde_json::from_value(v.clone()).expect("wire node");
        let d = node_delta(wire);
        assert_eq!(d.object, delta_from_value(Kind::Node, &v).object);
        assert!(matches!(&d.object, Some(Object::Node(n)) if n.leaving.is_some() && n.labels.len() == 1), "{d:?}");
        assert_eq!((&*d.id.namespace, &*d.id.name), ("", "n1"), "Nodes are not namespaced");
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
}
