//! What the agent knows of other Nodes when it reads the API server: the
//! Node watch (`kube_watch::watch_nodes`) lists other Nodes only while a
//! Service's topology needs labels its EndpointSlices do not carry, only
//! the Nodes hosting those Services' endpoints (by their hostname label),
//! and keeps only those labels and [`ALWAYS_KEPT`]
//! (`decide::topology::other_nodes_needed`, seed 004).
//!
//! The watch and `explain` share these rules, so that `explain` over
//! manifests (`kubectl get … -o yaml`, which carry every Node whole)
//! decides with what `run` would know, not more (issue #47): what the
//! manifests carry beyond it is left out, and said so.

use std::collections::{BTreeMap, BTreeSet};

use crate::model::store::{Delta, Kind, Object};
use crate::model::{LABEL_HOSTNAME, LABEL_ZONE, Node, OtherNodes};

/// Labels every watched Node keeps besides the ones Services need: the
/// two an endpoint's `nodeName` and `zone` stand for when its Node is
/// unknown (`decide::topology`, `View::endpoint_label`), so that a Node
/// being known never hides them.
pub(crate) const ALWAYS_KEPT: [&str; 2] = [LABEL_HOSTNAME, LABEL_ZONE];

/// What the watch of other Nodes selects and keeps for `needed`: `None`
/// when it does not run (no label needed, or no Node to name); else the
/// labels kept ([`ALWAYS_KEPT`] added) and the Nodes selected.
pub(crate) fn watched(needed: &OtherNodes) -> Option<OtherNodes> {
    needed.any().then(|| {
        let mut k = needed.clone();
        k.labels.extend(ALWAYS_KEPT.iter().map(|l| (*l).to_string()));
        k
    })
}

/// Whether the watch `watching` selects another Node with these labels:
/// its `kubernetes.io/hostname` label is among the names
/// (`kubernetes.io/hostname in (...)`), or every Node is watched.
pub(crate) fn selects(watching: Option<&OtherNodes>, labels: &crate::model::NodeTopology) -> bool {
    match watching {
        None => false,
        Some(OtherNodes { names: None, .. }) => true,
        Some(OtherNodes { names: Some(names), .. }) => labels.get(LABEL_HOSTNAME).is_some_and(|h| names.contains(&**h)),
    }
}

/// Whether label `key` of another Node is kept by the watch `watching`.
pub(crate) fn keeps(watching: &OtherNodes, key: &str) -> bool {
    watching.labels.contains(key)
}

/// Manifest deltas made into what `run`'s watches would have listed for
/// node `own`, and the notes saying what was left out.
pub struct Scoped {
    /// The deltas: every Service and EndpointSlice, this node's Node whole,
    /// other Nodes as the Node watch would have them.
    pub deltas: Vec<Delta>,
    /// What the manifests carry that the watch would not list, in words.
    pub notes: Vec<String>,
}

/// Scopes manifest deltas as `run` lists the API server: Services and
/// EndpointSlices first, from which the labels needed of other Nodes
/// follow (`decide::topology::node_labels_needed`, as before `run`'s first
/// sync), then the other Nodes through [`watched`] and [`selects`].
pub fn scope_manifest_deltas(deltas: impl IntoIterator<Item = Delta>, own: &str) -> Scoped {
    let (mut others, mut rest): (Vec<Delta>, Vec<Delta>) = (Vec::new(), Vec::new());
    for d in deltas {
        if d.kind == Kind::Node && *d.id.name != *own {
            others.push(d);
        } else {
            rest.push(d);
        }
    }
    // The Services, slices and this Node, to learn what is needed.
    let mut first = crate::model::store::Model::default();
    first.apply(rest.clone());
    let needed = crate::decide::topology::node_labels_needed(&first.cluster, own);
    let watching = watched(&needed);
    let read: BTreeSet<String> = first.cluster.services.values().flat_map(crate::decide::topology::labels_read).collect();
    let mut notes = Vec::new();
    let mut unwatched = Vec::new();
    let mut dropped: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for mut d in others {
        let Some(Object::Node(node)) = d.object.take() else {
            rest.push(d);
            continue;
        };
        if !selects(watching.as_ref(), &node.labels) {
            unwatched.push(node.name);
            continue;
        }
        let Some(w) = watching.as_ref() else { continue };
        let (kept, left): (Vec<_>, Vec<_>) = node.labels.into_iter().partition(|(k, _)| keeps(w, k));
        for (k, v) in left.into_iter().filter(|(k, _)| read.contains(&**k)) {
            dropped.entry(node.name.clone()).or_default().push(format!("{k}={v}"));
        }
        d.object = Some(Object::Node(Node { name: node.name, labels: kept.into_iter().collect(), leaving: None }));
        rest.push(d);
    }
    if !unwatched.is_empty() {
        let why = match &watching {
            None => "no Service's topology needs a label of other Nodes that its EndpointSlices do not carry".to_string(),
            Some(_) => "they host no endpoint of a Service whose topology needs their labels".to_string(),
        };
        notes.push(format!(
            "Nodes {} left out: run does not watch them ({why}); their endpoints rank by what their EndpointSlices say",
            unwatched.join(", ")
        ));
    }
    for (node, labels) in dropped {
        notes.push(format!(
            "Node {node}: labels {} left out: run keeps of other Nodes only the labels some Service needs beyond its EndpointSlices",
            labels.join(", ")
        ));
    }
    Scoped { deltas: rest, notes }
}

#[cfg(test)]
mod tests;
