//! `explain`'s input: manifest deltas made into what `run`'s watches would
//! have listed of the API server (issue #47). Manifests from `kubectl get
//! … -o yaml` carry every Node whole; `run`'s Node watch lists other Nodes
//! only while a Service's topology needs their labels, only the Nodes
//! hosting its endpoints, and keeps only those labels
//! (`source::node_scope`). Deciding with more than `run` knows would show
//! a decision the node does not make, so what the watch would not list is
//! left out, and said so.

use std::collections::{BTreeMap, BTreeSet};

use crate::model::Node;
use crate::model::store::{Delta, Kind, Object};
use crate::source::node_scope::{keeps, selects, watched};

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
/// sync), then the other Nodes through [`node_scope::watched`] and [`selects`].
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
