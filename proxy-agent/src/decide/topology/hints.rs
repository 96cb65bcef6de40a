//! EndpointSlice hints (KEP-2433 Topology Aware Hints, and the node hints
//! `trafficDistribution: PreferSameNode` adds): the EndpointSlice
//! controllers write `hints.forZones` / `hints.forNodes` on each endpoint,
//! and kube-proxy (pkg/proxy/topology.go, `topologyModeFromHints`) follows
//! them only when every ready endpoint carries them.

use super::{Indexed, LABEL_ZONE, Model, View, indices_where};
use crate::model::Service;

/// Service annotation asking the EndpointSlice controller for zone hints.
pub(super) const ANNOTATION_TOPOLOGY_MODE: &str = "service.kubernetes.io/topology-mode";
/// Legacy spelling of [`ANNOTATION_TOPOLOGY_MODE`] (1.21-1.26).
pub(super) const ANNOTATION_TOPOLOGY_AWARE_HINTS: &str = "service.kubernetes.io/topology-aware-hints";

/// What the hints on the ready endpoints decide for this node.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Hints {
    /// The endpoints hinted for this node ([`Model::HintsNode`]) or for its
    /// zone ([`Model::HintsZone`]).
    Used(Model, Vec<usize>),
    /// Some ready endpoint carries hints, but kube-proxy would not filter
    /// by them here: they are incomplete, none is for this node or zone, or
    /// the node has no zone.
    Ignored,
    /// No ready endpoint carries any hint.
    Absent,
}

/// What, on the Service, asked the control plane for hints (for the
/// decision text only: kube-proxy follows hints whatever asked for them,
/// since the EndpointSlice controllers write them only when asked).
fn requested_by(svc: &Service) -> Option<String> {
    if let Some(td) = svc.traffic_distribution.as_deref().filter(|t| !t.is_empty()) {
        return Some(format!("trafficDistribution {td}"));
    }
    for ann in [ANNOTATION_TOPOLOGY_MODE, ANNOTATION_TOPOLOGY_AWARE_HINTS] {
        if let Some(v) = svc.annotations.get(ann) {
            return Some(format!("{ann}={v}"));
        }
    }
    None
}

fn has_hints(h: Option<&[std::sync::Arc<str>]>) -> bool {
    h.is_some_and(|v| !v.is_empty())
}

pub(super) fn hinted_for(h: Option<&[std::sync::Arc<str>]>, name: &str) -> bool {
    h.is_some_and(|v| v.iter().any(|x| &**x == name))
}

/// kube-proxy's `topologyModeFromHints`, over the ready endpoints (`ready`
/// is not empty; the caller handles the no-ready fallback):
/// - every ready endpoint has a node hint and one is hinted for this node:
///   PreferSameNode (the endpoints hinted for this node; kube-proxy: behind
///   the PreferSameTrafficDistribution gate, on by default since it went
///   beta);
/// - else every ready endpoint has a zone hint, this node has a zone and
///   one is hinted for it: PreferSameZone (the endpoints hinted for it);
/// - else no topology ("node in different zone, no endpoint filtering",
///   "missing hints, no filtering applied", "only unready endpoints in same
///   zone (should not filter)", "empty zone label").
///
/// Each tier tried is logged to `log`.
pub(super) fn rank_by_hints(svc: &Service, view: &View<'_>, ready: &[Indexed<'_>], log: &mut Vec<String>) -> Hints {
    let zone = view.zone();
    let requested = requested_by(svc).map(|r| format!(" ({r})")).unwrap_or_default();

    let node_hinted = ready.iter().filter(|(_, e)| has_hints(e.hint_nodes())).count();
    let zone_hinted = ready.iter().filter(|(_, e)| has_hints(e.hint_zones())).count();

    if node_hinted == ready.len() {
        let sel = indices_where(ready, |e| hinted_for(e.hint_nodes(), view.node_name));
        if !sel.is_empty() {
            log.push(format!("node hints{requested}: {} hinted for {}", sel.len(), view.node_name));
            return Hints::Used(Model::HintsNode, sel);
        }
        log.push(format!("node hints ignored: none for {}", view.node_name));
    } else if node_hinted > 0 {
        log.push(format!("node hints ignored: missing on {} of {} ready endpoints", ready.len() - node_hinted, ready.len()));
    }

    if zone_hinted == ready.len() {
        match zone {
            None => log.push(format!("zone hints ignored: node lacks label {LABEL_ZONE}")),
            Some(z) => {
                let sel = indices_where(ready, |e| hinted_for(e.hint_zones(), z));
                if !sel.is_empty() {
                    log.push(format!("zone hints{requested}: {} hinted for zone {z}", sel.len()));
                    return Hints::Used(Model::HintsZone, sel);
                }
                log.push(format!("zone hints ignored: none for zone {z}"));
            }
        }
    } else if zone_hinted > 0 {
        log.push(format!("zone hints ignored: missing on {} of {} ready endpoints", ready.len() - zone_hinted, ready.len()));
    }

    if node_hinted > 0 || zone_hinted > 0 { Hints::Ignored } else { Hints::Absent }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{Case, EpExt, SvcExt, ep, node, run, svc};
    use super::*;

    // ----- hints (kube-proxy TestCategorizeEndpoints) -----

    #[test]
    fn hints() {
        let za = || vec![node("n1", &[(LABEL_ZONE, "zone-a")])];
        let four = || vec![ep(3, "x").zh(&["zone-a"]), ep(4, "x").zh(&["zone-b"]), ep(5, "x").zh(&["zone-c"]), ep(6, "x").zh(&["zone-a"])];
        run(vec![
            Case {
                name: "should use topology since all endpoints have hints, node has a zone label and there are endpoints for the node's zone",
                nodes: za(),
                eps: four(),
                model: Model::HintsZone,
                cluster: vec![0, 3],
                says: vec!["zone hints: 2 hinted for zone zone-a"],
                ..Default::default()
            },
            Case {
                name: "hints with topology-mode Auto annotation",
                svc: svc().ann(ANNOTATION_TOPOLOGY_MODE, "Auto"),
                nodes: za(),
                eps: four(),
                model: Model::HintsZone,
                cluster: vec![0, 3],
                says: vec!["service.kubernetes.io/topology-mode=Auto"],
                ..Default::default()
            },
            Case {
                name: "hints with legacy topology-aware-hints annotation",
                svc: svc().ann(ANNOTATION_TOPOLOGY_AWARE_HINTS, "auto"),
                nodes: za(),
                eps: four(),
                model: Model::HintsZone,
                cluster: vec![0, 3],
                ..Default::default()
            },
            Case {
                name: "externalTrafficPolicy: Local, topology ignored for Local endpoints",
                svc: svc().etp_local(),
                nodes: za(),
                eps: vec![ep(3, "n1").zh(&["zone-a"]), ep(4, "n1").zh(&["zone-b"]), ep(5, "x").zh(&["zone-c"]), ep(6, "x").zh(&["zone-a"])],
                model: Model::HintsZone,
                cluster: vec![0, 3],
                local: vec![0, 1],
                says: vec!["local: 2 ready on n1"],
                ..Default::default()
            },
            Case {
                name: "internalTrafficPolicy: Local, topology ignored for Local endpoints",
                svc: svc().itp_local(),
                nodes: za(),
                eps: vec![ep(3, "n1").zh(&["zone-a"]), ep(4, "n1").zh(&["zone-b"]), ep(5, "x").zh(&["zone-c"]), ep(6, "x").zh(&["zone-a"])],
                model: Model::HintsZone,
                cluster: vec![0, 3],
                local: vec![0, 1],
                ..Default::default()
            },
            Case {
                name: "empty node labels",
                nodes: vec![node("n1", &[])],
                eps: vec![ep(3, "x").zh(&["zone-a"])],
                cluster: vec![0],
                says: vec!["zone hints ignored: node lacks label topology.kubernetes.io/zone"],
                ..Default::default()
            },
            Case { name: "unknown node", eps: vec![ep(3, "x").zh(&["zone-a"])], cluster: vec![0], ..Default::default() },
            Case {
                name: "empty zone label",
                nodes: vec![node("n1", &[(LABEL_ZONE, "")])],
                eps: vec![ep(3, "x").zh(&["zone-a"])],
                cluster: vec![0],
                ..Default::default()
            },
            Case {
                name: "node in different zone, no endpoint filtering",
                nodes: vec![node("n1", &[(LABEL_ZONE, "zone-b")])],
                eps: vec![ep(3, "x").zh(&["zone-a"])],
                cluster: vec![0],
                says: vec!["zone hints ignored: none for zone zone-b", "1 ready endpoint cluster-wide"],
                ..Default::default()
            },
            Case {
                name: "unready endpoint",
                nodes: za(),
                eps: {
                    let mut e = four();
                    e[3].ready = false;
                    e
                },
                model: Model::HintsZone,
                cluster: vec![0],
                ..Default::default()
            },
            Case {
                name: "only unready endpoints in same zone (should not filter)",
                nodes: za(),
                eps: {
                    let mut e = four();
                    e[0].ready = false;
                    e[3].ready = false;
                    e
                },
                cluster: vec![1, 2],
                ..Default::default()
            },
            Case {
                name: "missing hints, no filtering applied",
                nodes: za(),
                eps: {
                    let mut e = four();
                    e[2].edit_extra(|x| x.hint_zones = None);
                    e
                },
                cluster: vec![0, 1, 2, 3],
                says: vec!["zone hints ignored: missing on 1 of 4 ready endpoints"],
                ..Default::default()
            },
            Case {
                name: "empty hint list counts as missing",
                nodes: za(),
                eps: {
                    let mut e = four();
                    e[2].edit_extra(|x| x.hint_zones = Some(Box::new([])));
                    e
                },
                cluster: vec![0, 1, 2, 3],
                ..Default::default()
            },
            Case {
                name: "unready endpoint without hints does not disable hints",
                nodes: za(),
                eps: {
                    let mut e = four();
                    e.push(ep(7, "x").unready());
                    e
                },
                model: Model::HintsZone,
                cluster: vec![0, 3],
                ..Default::default()
            },
            Case {
                name: "multiple hints per endpoint, filtering includes any endpoint with zone included",
                nodes: vec![node("n1", &[(LABEL_ZONE, "zone-c")])],
                eps: vec![
                    ep(3, "x").zh(&["zone-a", "zone-b", "zone-c"]),
                    ep(4, "x").zh(&["zone-b", "zone-c"]),
                    ep(5, "x").zh(&["zone-b", "zone-d"]),
                    ep(6, "x").zh(&["zone-c"]),
                ],
                model: Model::HintsZone,
                cluster: vec![0, 1, 3],
                ..Default::default()
            },
            Case {
                name: "conflicting topology and localness require merging allEndpoints",
                svc: svc().etp_local(),
                nodes: za(),
                eps: vec![ep(0, "n1").zh(&["zone-a"]), ep(1, "n1").zh(&["zone-b"]), ep(2, "x").zh(&["zone-a"]), ep(3, "x").zh(&["zone-b"])],
                model: Model::HintsZone,
                cluster: vec![0, 2],
                local: vec![0, 1],
                ..Default::default()
            },
            Case {
                name: "node hints: every ready endpoint hinted, some for this node",
                svc: svc().td("PreferSameNode"),
                nodes: za(),
                eps: vec![
                    ep(1, "n1").nh(&["n1"]).zh(&["zone-a"]),
                    ep(2, "n2").nh(&["n2"]).zh(&["zone-a"]),
                    ep(3, "n3").nh(&["n3"]).zh(&["zone-b"]),
                ],
                model: Model::HintsNode,
                cluster: vec![0],
                local: vec![0],
                says: vec!["node hints (trafficDistribution PreferSameNode): 1 hinted for n1"],
                ..Default::default()
            },
            Case {
                name: "node hints: none for this node, zone hints used",
                svc: svc().td("PreferSameNode"),
                nodes: za(),
                eps: vec![ep(2, "n2").nh(&["n2"]).zh(&["zone-a"]), ep(3, "n3").nh(&["n3"]).zh(&["zone-b"])],
                model: Model::HintsZone,
                cluster: vec![0],
                says: vec!["node hints ignored: none for n1"],
                ..Default::default()
            },
            Case {
                name: "node hints: one endpoint lacks a node hint, zone hints used",
                nodes: za(),
                eps: vec![ep(1, "n1").nh(&["n1"]).zh(&["zone-a"]), ep(2, "n2").zh(&["zone-a"]), ep(3, "n3").nh(&["n3"]).zh(&["zone-b"])],
                model: Model::HintsZone,
                cluster: vec![0, 1],
                local: vec![0],
                says: vec!["node hints ignored: missing on 1 of 3 ready endpoints"],
                ..Default::default()
            },
            Case {
                name: "node hints without zone hints, none for this node: cluster-wide",
                nodes: za(),
                eps: vec![ep(2, "n2").nh(&["n2"]), ep(3, "n3").nh(&["n3"])],
                cluster: vec![0, 1],
                ..Default::default()
            },
            Case {
                name: "node hints work without any node labels",
                this: "n9",
                eps: vec![ep(2, "n9").nh(&["n9"]), ep(3, "n3").nh(&["n3"])],
                model: Model::HintsNode,
                cluster: vec![0],
                local: vec![0],
                ..Default::default()
            },
        ]);
    }
}
