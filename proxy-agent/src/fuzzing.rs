//! Entry points for the fuzz targets (`fuzz/`, cargo-fuzz, a workspace of
//! its own): each feeds one kind of outside input through the agent's own
//! code, the way the agent reads it, and checks what must hold of the
//! result. A broken property panics, which libFuzzer reports as a crash.
//!
//! Not part of the agent's API (hidden from the docs): these functions are
//! public only so that the targets, another crate, reach the crate-private
//! conversion code without that code being made public.

use std::collections::BTreeSet;
use std::net::IpAddr;

use kube::core::{ObjectList, WatchEvent};
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::decide::decision::{self, PortDecision};
use crate::model::store::{Delta, Kind, Model};
use crate::model::{Backend, Cluster, Family, Frontend};
use crate::source::delta::{delta_from_value, node_delta, service_delta, slice_delta};
use crate::source::manifest::{self, Document};
use crate::source::wire::{WireNode, WireService, WireSlice};
use crate::source::wire_v1beta1::WireSliceV1beta1;

/// The node addresses external frontends are expanded on.
const NODE_ADDRS: [&str; 2] = ["192.0.2.1", "2001:db8::1"];

/// A manifest file's text, as `--manifests` reads it: every document
/// (YAML streams, JSON, `List`s) converted into the model, then decided
/// for the nodes it names.
pub fn manifest(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let mut docs = Vec::new();
    let mut errors = Vec::new();
    manifest::parse_into("fuzz.yaml", text, &mut docs, &mut errors);
    for e in &errors {
        assert!(!e.location.is_empty() && !e.reason.is_empty(), "an unclear manifest error: {e:?}");
    }
    let deltas: Vec<Delta> = docs.iter().filter_map(document_delta).collect();
    check_model_and_decisions(deltas);
}

/// The kind a manifest document declares, when the agent reads it
/// (`manifest_watch` skips the rest).
fn document_delta(doc: &Document) -> Option<Delta> {
    let kind = match doc.value.get("kind").and_then(Value::as_str)? {
        "Service" => Kind::Service,
        "EndpointSlice" => Kind::EndpointSlice,
        "Node" => Kind::Node,
        _ => return None,
    };
    Some(delta_from_value(kind, &doc.value))
}

/// A response body of the API server as the watchers deserialize it: a
/// list (`ObjectList`), a watch event (`WatchEvent`, one line of a watch
/// stream) or a bare object, of each kind the agent watches, in the slim
/// wire shapes; what deserializes is converted into the model and decided.
pub fn watch_body(data: &[u8]) {
    let mut deltas = Vec::new();
    deltas.extend(wire_objects::<WireService>(data).into_iter().map(service_delta));
    deltas.extend(wire_objects::<WireSlice>(data).into_iter().map(slice_delta));
    deltas.extend(wire_objects::<WireSliceV1beta1>(data).into_iter().map(|s| slice_delta(s.into_v1())));
    deltas.extend(wire_objects::<WireNode>(data).into_iter().map(node_delta));
    check_model_and_decisions(deltas);
}

/// The objects of `data` read as a list, a watch event or one object of
/// type `K` (whichever deserializes).
fn wire_objects<K: DeserializeOwned + Clone>(data: &[u8]) -> Vec<K> {
    if let Ok(list) = serde_json::from_slice::<ObjectList<K>>(data) {
        return list.items;
    }
    match serde_json::from_slice::<WatchEvent<K>>(data) {
        Ok(WatchEvent::Added(o) | WatchEvent::Modified(o) | WatchEvent::Deleted(o)) => return vec![o],
        Ok(WatchEvent::Bookmark(_) | WatchEvent::Error(_)) => return Vec::new(),
        Err(_) => {}
    }
    serde_json::from_slice::<K>(data).map(|o| vec![o]).unwrap_or_default()
}

/// Objects given as JSON values (`kind` says which), converted like the
/// manifests' and the tests' objects, then decided.
pub fn objects(values: &[Value]) {
    let deltas: Vec<Delta> = values
        .iter()
        .filter_map(|v| {
            let kind = match v.get("kind").and_then(Value::as_str)? {
                "Service" => Kind::Service,
                "EndpointSlice" => Kind::EndpointSlice,
                "Node" => Kind::Node,
                _ => return None,
            };
            Some(delta_from_value(kind, v))
        })
        .collect();
    check_model_and_decisions(deltas);
}

/// Applies `deltas` to a fresh model, checks what every converted object
/// must satisfy, and checks the decisions for the nodes the cluster names.
fn check_model_and_decisions(deltas: Vec<Delta>) {
    for d in &deltas {
        for p in &d.problems {
            assert!(!p.error.kind.is_empty() && !p.error.reason.is_empty(), "a problem without kind or reason: {p:?}");
        }
    }
    let mut model = Model::default();
    model.apply(deltas);
    check_model(&model.cluster);
    for node in nodes_of(&model.cluster) {
        check_decisions(&model.cluster, &node);
    }
}

/// What conversion guarantees the decision code and the datapath: every
/// Service has a ClusterIP and only ports in range, every endpoint is of
/// its slice's family, every slice port in range.
pub fn check_model(cluster: &Cluster) {
    for svc in cluster.services.values() {
        assert!(!svc.id.name.is_empty(), "a Service without a name: {svc:?}");
        assert!(!svc.cluster_ips.is_empty(), "a Service without a ClusterIP: {svc:?}");
        for p in &svc.ports {
            assert!(p.port != 0 && p.node_port != Some(0), "port 0 in {}: {p:?}", svc.id);
        }
        assert!(svc.health_check_node_port != Some(0), "health check node port 0 in {}", svc.id);
        if let Some(t) = svc.session_affinity {
            assert!((1..=86_400).contains(&t), "affinity timeout {t} of {}", svc.id);
        }
    }
    for slice in cluster.slices.values() {
        assert!(!slice.service_name.is_empty(), "a slice without a Service: {}", slice.id);
        for p in &slice.ports {
            assert!(p.port != 0, "port 0 in slice {}", slice.id);
        }
        for e in &slice.endpoints {
            assert_eq!(Family::of(&e.address), slice.family, "endpoint {} in slice {}", e.address, slice.id);
        }
    }
}

/// The nodes worth deciding for: a few the cluster names (Nodes and
/// endpoints' `nodeName`), and one it does not.
fn nodes_of(cluster: &Cluster) -> Vec<String> {
    let mut names: BTreeSet<String> = cluster.nodes.keys().take(3).cloned().collect();
    for slice in cluster.slices.values() {
        for e in &slice.endpoints {
            if names.len() >= 5 {
                break;
            }
            if let Some(n) = &e.node_name {
                names.insert(n.to_string());
            }
        }
    }
    names.insert("fuzz-unknown-node".to_string());
    names.into_iter().collect()
}

/// The decision's properties on node `node`:
/// - every backend it returns, for either policy, is an endpoint of the
///   Service port (matched by port name and protocol, the first slice
///   listing an address and port wins, as in `decide_service`) that is
///   ready or serving;
/// - a Local policy never returns a remote endpoint: every `local`
///   backend runs on `node`, and the ports with a Local policy send that
///   traffic only there, also in the datapath state derived from them;
/// - backend lists are sorted and free of duplicates;
/// - the state for the maps gives each frontend only backends of its own
///   family, taken from the port's backends.
pub fn check_decisions(cluster: &Cluster, node: &str) {
    let decisions = decision::decide(cluster, node);
    for d in &decisions {
        check_port(cluster, node, d);
    }
    let (state, _) = decision::desired_state(&decisions);
    for (fe, backends) in &state {
        let owner = decisions.iter().find(|d| d.frontends.contains(fe)).expect("a frontend of the state comes from a decision");
        for b in backends {
            assert_eq!(Family::of(&b.ip), Family::of(&fe.ip), "{fe} gets {b} of the other family");
            assert!(owner.internal_backends().contains(b), "{fe} gets {b}, not a backend of {}", owner.service);
        }
    }
    let node_addrs: Vec<IpAddr> = NODE_ADDRS.iter().filter_map(|a| a.parse().ok()).collect();
    let ext = decision::external_state(&decisions, &node_addrs);
    let local: BTreeSet<Backend> = decisions.iter().flat_map(|d| d.local.iter().copied()).collect();
    for fe in &ext.policy_local {
        let backends = ext.tc.get(fe).expect("a Local-policy frontend is in the TC state");
        assert!(backends.is_subset(&local), "Local-policy frontend {fe} sends outside traffic to a remote endpoint: {backends:?}");
    }
    for (fe, backends) in ext.tc.iter().chain(&ext.socket) {
        for b in backends {
            assert_eq!(Family::of(&b.ip), Family::of(&fe.ip), "{fe} gets {b} of the other family");
        }
    }
    check_frontends_unique(&decisions);
}

fn check_port(cluster: &Cluster, node: &str, d: &PortDecision) {
    let svc = cluster.services.get(&d.service).expect("a decision names a Service of the cluster");
    // The endpoint behind each (address, port) of this Service port.
    let mut endpoints = std::collections::BTreeMap::new();
    for slice in cluster.slices_of(&svc.id) {
        let Some(sp) = slice.ports.iter().find(|p| p.name == d.port.name && p.protocol == d.port.protocol) else { continue };
        for e in &slice.endpoints {
            // The decision's rule for an address in two slices: the first
            // copy, unless it terminates and this one does not
            // (kube-proxy's endpointslicecache.go `addEndpoints`).
            let kept = endpoints.entry(Backend { ip: e.address, port: sp.port }).or_insert(e);
            if kept.terminating && !e.terminating {
                *kept = e;
            }
        }
    }
    for (set, what) in [(&d.cluster, "cluster"), (&d.local, "local")] {
        assert!(set.windows(2).all(|w| w[0] < w[1]), "{} {}: {what} backends unsorted or repeated: {set:?}", d.service, d.port.name);
        for b in set {
            let e =
                endpoints.get(b).unwrap_or_else(|| panic!("{} {}: {what} backend {b} is no endpoint of the port", d.service, d.port.name));
            assert!(e.ready || e.serving, "{} {}: {what} backend {b} is neither ready nor serving: {e:?}", d.service, d.port.name);
        }
    }
    for b in &d.local {
        let e = endpoints[b];
        assert_eq!(e.node_name.as_deref(), Some(node), "{} {}: local backend {b} runs elsewhere", d.service, d.port.name);
    }
    if d.internal_local {
        assert_eq!(d.internal_backends(), &d.local[..], "{}: internalTrafficPolicy Local uses the local set", d.service);
    }
    if d.external_local {
        assert_eq!(d.external_backends(), &d.local[..], "{}: externalTrafficPolicy Local uses the local set", d.service);
    }
    assert_eq!(d.frontends.len(), svc.cluster_ips.len(), "{}: one frontend per ClusterIP", d.service);
}

/// Every frontend of the state has one owner (clashes are reported, not
/// merged).
fn check_frontends_unique(decisions: &[PortDecision]) {
    let (state, clashes) = decision::desired_state(decisions);
    let all: BTreeSet<Frontend> = decisions.iter().flat_map(|d| d.frontends.iter().copied()).collect();
    assert_eq!(state.len(), all.len(), "every frontend is in the state once");
    for c in &clashes {
        assert!(c.starts_with("Service ") && c.contains(" is already used by "), "an unclear clash: {c}");
    }
}
