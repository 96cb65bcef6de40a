//! `spec.trafficDistribution` (KEP-4444) without hints. The EndpointSlice
//! controller normally turns the field into hints, each endpoint hinted for
//! its own zone (PreferSameZone / PreferClose) or node (PreferSameNode),
//! which [`super::hints`] reads. A control plane without that controller
//! writes none; the same preference is then derived here from the
//! endpoints' `nodeName` and zone.

use super::{Indexed, LABEL_ZONE, Model, View, indices_where};
use crate::model::Service;

/// `spec.trafficDistribution` values (PreferClose is the older name of
/// PreferSameZone, KEP-4444 / KEP-3015).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Distribution {
    SameNode,
    SameZone,
}

/// The Service's `spec.trafficDistribution` with its value as written. An
/// empty value is no preference; a value the API server would have refused
/// is reported and ignored.
pub(super) fn parse<'s>(svc: &'s Service, problems: &mut Vec<String>) -> Option<(Distribution, &'s str)> {
    let raw = svc.traffic_distribution.as_deref()?;
    match raw {
        "PreferSameNode" => Some((Distribution::SameNode, raw)),
        "PreferSameZone" | "PreferClose" => Some((Distribution::SameZone, raw)),
        "" => None,
        other => {
            problems.push(format!(
                "spec.trafficDistribution: Unsupported value: {other:?}: supported values: \
                 \"PreferClose\", \"PreferSameZone\", \"PreferSameNode\"; ignored"
            ));
            None
        }
    }
}

/// The endpoints among `ready` (not empty) that the control plane would
/// have hinted for this node: for PreferSameNode those on this node; when
/// none is, and for PreferSameZone / PreferClose, those in this node's zone
/// ([`View::endpoint_zone`]). `None` when no tier has any or the node has
/// no zone: the caller goes cluster-wide, as kube-proxy does when no
/// endpoint is hinted for the node. The tiers tried are logged to `log`.
pub(super) fn derive(
    view: &View<'_>,
    ready: &[Indexed<'_>],
    dist: Distribution,
    raw: &str,
    log: &mut Vec<String>,
) -> Option<(Model, Vec<usize>)> {
    let mut tiers = Vec::new();
    if dist == Distribution::SameNode {
        let sel = indices_where(ready, |e| view.is_local(e));
        if !sel.is_empty() {
            tiers.push(format!("{} on this node {}", sel.len(), view.node_name));
            log.push(format!("trafficDistribution {raw} (no hints; derived): {}", tiers.join("; ")));
            return Some((Model::TrafficDistributionNode, sel));
        }
        tiers.push(format!("none on this node {}", view.node_name));
    }
    match view.zone() {
        None => tiers.push(format!("node lacks label {LABEL_ZONE}")),
        Some(z) => {
            let sel = indices_where(ready, |e| view.endpoint_zone(e) == Some(z));
            if !sel.is_empty() {
                tiers.push(format!("{} in zone {z}", sel.len()));
                log.push(format!("trafficDistribution {raw} (no hints; derived): {}", tiers.join("; ")));
                return Some((Model::TrafficDistributionZone, sel));
            }
            tiers.push(format!("none in zone {z}"));
        }
    }
    log.push(format!("trafficDistribution {raw} (no hints; derived): {}", tiers.join("; ")));
    None
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{Case, EpExt, SvcExt, ep, node, run, svc};
    use super::*;

    // ----- trafficDistribution without hints -----

    #[test]
    fn traffic_distribution_derived() {
        let nodes = || {
            vec![node("n1", &[(LABEL_ZONE, "za")]), node("n2", &[(LABEL_ZONE, "za")]), node("n3", &[(LABEL_ZONE, "zb")]), node("nz", &[])]
        };
        let eps = || vec![ep(1, "n1").zone("za"), ep(2, "n2").zone("za"), ep(3, "n3").zone("zb")];
        run(vec![
            Case {
                name: "PreferClose: same zone",
                svc: svc().td("PreferClose"),
                nodes: nodes(),
                this: "n2",
                eps: eps(),
                model: Model::TrafficDistributionZone,
                cluster: vec![0, 1],
                local: vec![1],
                says: vec!["trafficDistribution PreferClose (no hints; derived): 2 in zone za"],
                ..Default::default()
            },
            Case {
                name: "PreferSameZone: same zone, endpoint zone from the Node when the slice has none",
                svc: svc().td("PreferSameZone"),
                nodes: nodes(),
                this: "n3",
                eps: vec![ep(1, "n1"), ep(2, "n3"), ep(3, "ghost")],
                model: Model::TrafficDistributionZone,
                cluster: vec![1],
                local: vec![1],
                ..Default::default()
            },
            Case {
                name: "PreferSameZone: none in zone, cluster-wide",
                svc: svc().td("PreferSameZone"),
                nodes: {
                    let mut n = nodes();
                    n.push(node("n4", &[(LABEL_ZONE, "zc")]));
                    n
                },
                this: "n4",
                eps: eps(),
                cluster: vec![0, 1, 2],
                says: vec!["none in zone zc", "3 ready endpoints cluster-wide"],
                ..Default::default()
            },
            Case {
                name: "PreferClose: node has no zone label, cluster-wide",
                svc: svc().td("PreferClose"),
                nodes: nodes(),
                this: "nz",
                eps: eps(),
                cluster: vec![0, 1, 2],
                says: vec!["node lacks label topology.kubernetes.io/zone"],
                ..Default::default()
            },
            Case {
                name: "PreferClose: only unready endpoints in zone, cluster-wide ready",
                svc: svc().td("PreferClose"),
                nodes: nodes(),
                this: "n1",
                eps: vec![ep(1, "n1").zone("za").unready(), ep(2, "n3").zone("zb")],
                cluster: vec![1],
                ..Default::default()
            },
            Case {
                name: "PreferSameNode: same node",
                svc: svc().td("PreferSameNode"),
                nodes: nodes(),
                this: "n1",
                eps: eps(),
                model: Model::TrafficDistributionNode,
                cluster: vec![0],
                local: vec![0],
                says: vec!["1 on this node n1"],
                ..Default::default()
            },
            Case {
                name: "PreferSameNode: nothing on node, same zone",
                svc: svc().td("PreferSameNode"),
                nodes: nodes(),
                this: "n2",
                eps: vec![ep(1, "n1").zone("za"), ep(3, "n3").zone("zb")],
                model: Model::TrafficDistributionZone,
                cluster: vec![0],
                says: vec!["none on this node n2; 1 in zone za"],
                ..Default::default()
            },
            Case {
                name: "PreferSameNode: nothing on node, no zone, cluster-wide",
                svc: svc().td("PreferSameNode"),
                nodes: nodes(),
                this: "nz",
                eps: eps(),
                cluster: vec![0, 1, 2],
                ..Default::default()
            },
            Case {
                name: "PreferSameNode: only a terminating endpoint on node, other nodes ready",
                svc: svc().td("PreferSameNode"),
                nodes: nodes(),
                this: "n1",
                eps: vec![ep(1, "n1").term(), ep(2, "n2").zone("za"), ep(3, "n3").zone("zb")],
                model: Model::TrafficDistributionZone,
                cluster: vec![1],
                local: vec![0],
                ..Default::default()
            },
            Case {
                name: "no ready endpoints: terminating fallback cluster-wide",
                svc: svc().td("PreferClose"),
                nodes: nodes(),
                this: "n1",
                eps: vec![ep(1, "n1").zone("za").term(), ep(2, "n3").zone("zb").term()],
                cluster: vec![0, 1],
                local: vec![0],
                ..Default::default()
            },
            Case {
                name: "written hints win over derivation (Auto-style allocation across zones)",
                svc: svc().td("PreferClose"),
                nodes: nodes(),
                this: "n1",
                eps: vec![ep(1, "n1").zone("za").zh(&["zb"]), ep(3, "n3").zone("zb").zh(&["za"])],
                model: Model::HintsZone,
                cluster: vec![1],
                local: vec![0],
                ..Default::default()
            },
            Case {
                name: "incomplete hints: cluster-wide as kube-proxy, no derivation",
                svc: svc().td("PreferClose"),
                nodes: nodes(),
                this: "n1",
                eps: vec![ep(1, "n1").zone("za").zh(&["za"]), ep(3, "n3").zone("zb")],
                cluster: vec![0, 1],
                local: vec![0],
                says: vec!["hints were written, not deriving"],
                ..Default::default()
            },
            Case {
                name: "unsupported trafficDistribution: reported, cluster-wide",
                svc: svc().td("PreferFarAway"),
                nodes: nodes(),
                this: "n1",
                eps: eps(),
                cluster: vec![0, 1, 2],
                local: vec![0],
                problems: 1,
                ..Default::default()
            },
        ]);
    }
}
