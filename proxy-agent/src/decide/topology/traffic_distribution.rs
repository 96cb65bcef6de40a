//! `spec.trafficDistribution` (KEP-4444). The field is the EndpointSlice
//! controller's input, not kube-proxy's: the controller turns it into
//! hints, each endpoint hinted for its own zone (PreferSameZone /
//! PreferClose) or node too (PreferSameNode), and kube-proxy follows only
//! those hints (pkg/proxy/topology.go: `CategorizeEndpoints` reads
//! `topologyModeFromHints`, never the Service's field). So the agent reads
//! the hints ([`super::hints`]) and, like kube-proxy, uses every ready
//! endpoint when a Service asks for a distribution but its slices carry no
//! hints (a control plane without that controller, or hand-written
//! slices). This module only validates the value and says so in the
//! decision text.

use crate::model::Service;

/// The Service's `spec.trafficDistribution` as written, when it is one the
/// API server accepts (PreferClose is the older name of PreferSameZone,
/// KEP-4444 / KEP-3015). An empty value is no preference; a value the API
/// server would have refused is reported and ignored.
pub(super) fn parse<'s>(svc: &'s Service, problems: &mut Vec<String>) -> Option<&'s str> {
    let raw = svc.traffic_distribution.as_deref()?;
    match raw {
        "PreferSameNode" | "PreferSameZone" | "PreferClose" => Some(raw),
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

/// The decision text for a distribution whose slices carry no hint.
pub(super) fn without_hints(raw: &str) -> String {
    format!("trafficDistribution {raw}: no hints on the slices, not filtered (kube-proxy follows only hints)")
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{Case, EpExt, SvcExt, ep, node, run, svc};
    use super::super::{LABEL_ZONE, Model};

    // ----- trafficDistribution without hints: every ready endpoint, as
    // kube-proxy (it reads only the hints the controller writes) -----

    #[test]
    fn traffic_distribution_without_hints_is_not_filtered() {
        let nodes = || {
            vec![node("n1", &[(LABEL_ZONE, "za")]), node("n2", &[(LABEL_ZONE, "za")]), node("n3", &[(LABEL_ZONE, "zb")]), node("nz", &[])]
        };
        let eps = || vec![ep(1, "n1").zone("za"), ep(2, "n2").zone("za"), ep(3, "n3").zone("zb")];
        run(vec![
            Case {
                name: "PreferClose, no hints: every ready endpoint",
                svc: svc().td("PreferClose"),
                nodes: nodes(),
                this: "n2",
                eps: eps(),
                cluster: vec![0, 1, 2],
                local: vec![1],
                says: vec!["trafficDistribution PreferClose: no hints on the slices, not filtered", "3 ready endpoints cluster-wide"],
                ..Default::default()
            },
            Case {
                name: "PreferSameZone, no hints, no zone on the slices: every ready endpoint",
                svc: svc().td("PreferSameZone"),
                nodes: nodes(),
                this: "n3",
                eps: vec![ep(1, "n1"), ep(2, "n3"), ep(3, "ghost")],
                cluster: vec![0, 1, 2],
                local: vec![1],
                ..Default::default()
            },
            Case {
                name: "PreferSameNode, no hints: every ready endpoint, not only this node's",
                svc: svc().td("PreferSameNode"),
                nodes: nodes(),
                this: "n1",
                eps: eps(),
                model: Model::Cluster,
                cluster: vec![0, 1, 2],
                local: vec![0],
                says: vec!["trafficDistribution PreferSameNode: no hints on the slices"],
                ..Default::default()
            },
            Case {
                name: "PreferSameNode, no hints, node without zone: every ready endpoint",
                svc: svc().td("PreferSameNode"),
                nodes: nodes(),
                this: "nz",
                eps: eps(),
                cluster: vec![0, 1, 2],
                ..Default::default()
            },
            Case {
                name: "PreferClose: unready endpoints never used, ready ones cluster-wide",
                svc: svc().td("PreferClose"),
                nodes: nodes(),
                this: "n1",
                eps: vec![ep(1, "n1").zone("za").unready(), ep(2, "n3").zone("zb")],
                cluster: vec![1],
                ..Default::default()
            },
            Case {
                name: "PreferSameNode: a terminating endpoint on this node is not used while others are ready",
                svc: svc().td("PreferSameNode"),
                nodes: nodes(),
                this: "n1",
                eps: vec![ep(1, "n1").term(), ep(2, "n2").zone("za"), ep(3, "n3").zone("zb")],
                cluster: vec![1, 2],
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
                name: "written hints are followed (Auto-style allocation across zones)",
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
                name: "incomplete hints: cluster-wide as kube-proxy",
                svc: svc().td("PreferClose"),
                nodes: nodes(),
                this: "n1",
                eps: vec![ep(1, "n1").zone("za").zh(&["za"]), ep(3, "n3").zone("zb")],
                cluster: vec![0, 1],
                local: vec![0],
                says: vec!["zone hints ignored: missing on 1 of 2 ready endpoints"],
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
