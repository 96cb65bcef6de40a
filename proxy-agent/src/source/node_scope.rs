//! What the agent knows of other Nodes when it reads the API server: the
//! Node watch (`kube_watch::watch_nodes`) lists other Nodes only while a
//! Service's topology needs labels its EndpointSlices do not carry, only
//! the Nodes hosting those Services' endpoints (by their hostname label),
//! and keeps only those labels and [`ALWAYS_KEPT`]
//! (`decide::topology::other_nodes_needed`, seed 004).
//!
//! The watch and `explain` share these rules
//! (`sync::explain_input`), so that `explain` over manifests (`kubectl get
//! … -o yaml`, which carry every Node whole) decides with what `run` would
//! know, not more (issue #47).

use crate::model::{LABEL_HOSTNAME, LABEL_ZONE, OtherNodes};

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
