//! OpenYurt's service topology: the `openyurt.io/topologyKeys` Service
//! annotation restricts a Service to the client's node or to its node pool
//! (a group of edge nodes, `apps.openyurt.io/nodepool`). OpenYurt applies it
//! in YurtHub's servicetopology filter, rewriting the EndpointSlices before
//! kube-proxy reads them; here the same selection is made on the endpoints
//! directly.

use super::{Indexed, TOPOLOGY_KEY_ANY, View, plural, usable};

/// OpenYurt's Service annotation (`AnnotationServiceTopologyKey` in
/// openyurt `pkg/yurthub/filter/servicetopology`).
pub(super) const ANNOTATION_OPENYURT_TOPOLOGY_KEYS: &str = "openyurt.io/topologyKeys";
/// OpenYurt annotation value meaning "same node".
pub(super) const OPENYURT_VALUE_NODE: &str = "kubernetes.io/hostname";
/// OpenYurt annotation value meaning "same node pool" (historic spelling).
pub(super) const OPENYURT_VALUE_ZONE: &str = "kubernetes.io/zone";
/// OpenYurt annotation value meaning "same node pool".
pub(super) const OPENYURT_VALUE_NODEPOOL: &str = "openyurt.io/nodepool";
/// Node label naming the OpenYurt node pool a node belongs to
/// (`projectinfo.GetNodePoolLabel()`, formerly
/// `nodepoolv1alpha1.LabelCurrentNodePool`).
pub(super) const LABEL_OPENYURT_NODEPOOL: &str = "apps.openyurt.io/nodepool";

/// What an `openyurt.io/topologyKeys` annotation asks for.
pub(super) struct YurtTopology {
    raw: String,
    node: bool,
    pool: bool,
    any: bool,
}

impl YurtTopology {
    /// Whether the ranking compares node pools (other Nodes' pool labels).
    pub(super) fn reads_pools(&self) -> bool {
        self.pool
    }

    /// The domains the annotation ranks by: (same node, same node pool).
    pub(super) fn domains(&self) -> (bool, bool) {
        (self.node, self.pool)
    }
}

/// Parses OpenYurt's annotation. Current OpenYurt
/// (`pkg/yurthub/filter/servicetopology/filter.go`) takes the value as one
/// of `kubernetes.io/hostname`, `kubernetes.io/zone`, `openyurt.io/nodepool`
/// and leaves the endpoints unfiltered for anything else. Earlier releases
/// (`handler.go`, `resolveServiceTopologyType`) also accepted a
/// comma-separated list of those values and `*`, whitespace trimmed and
/// unknown items dropped; that form is accepted here too (for a single
/// value both behave the same). Unknown values are reported; with no known
/// value there is no OpenYurt topology, as in OpenYurt.
pub(super) fn parse_openyurt(raw: &str, problems: &mut Vec<String>) -> Option<YurtTopology> {
    let mut t = YurtTopology { raw: raw.trim().to_string(), node: false, pool: false, any: false };
    let mut unknown = Vec::new();
    for item in raw.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        match item {
            OPENYURT_VALUE_NODE => t.node = true,
            OPENYURT_VALUE_ZONE | OPENYURT_VALUE_NODEPOOL => t.pool = true,
            TOPOLOGY_KEY_ANY => t.any = true,
            other => unknown.push(other.to_string()),
        }
    }
    if !unknown.is_empty() {
        problems.push(format!(
            "annotation {ANNOTATION_OPENYURT_TOPOLOGY_KEYS}: unsupported value(s) {unknown:?} ignored \
             (OpenYurt understands {OPENYURT_VALUE_NODE}, {OPENYURT_VALUE_ZONE}, {OPENYURT_VALUE_NODEPOOL})"
        ));
    }
    (t.node || t.pool || t.any).then_some(t)
}

/// OpenYurt's service topology filter, which YurtHub applies to
/// EndpointSlices before kube-proxy sees them
/// (`serviceTopologyHandler`, `nodeTopologyHandler`,
/// `nodePoolTopologyHandler`, `reassembleEndpointSlice`):
///
/// - `kubernetes.io/hostname`: the endpoints whose `nodeName` is this node.
///   None: an empty slice is returned, so no backends ("currentNode has no
///   endpoints on node" in filter_test.go); no fallback.
/// - `openyurt.io/nodepool` / `kubernetes.io/zone`: the endpoints whose
///   node is in this node's pool. The pool's member list
///   (`NodePool.status.nodes`) is maintained from the nodes'
///   `apps.openyurt.io/nodepool` label, which is what is compared here.
///   None in the pool: no backends ("currentNode has no endpoints in
///   nodepool"); no fallback to cluster-wide. This node not in any pool (no
///   or empty label, or the node itself unknown, so its pool name cannot be
///   resolved): "fall into node topology", i.e. same node only
///   ("currentNode is not in any nodepool").
/// - A list (older releases): same node first, then same pool, then `*`
///   (everything), whatever the order written; a tier counts as matched as
///   soon as it keeps any endpoint. OpenYurt decided this per EndpointSlice
///   object; here it is decided over all the port's endpoints, which is what
///   was meant.
///
/// The filter does not look at readiness (it rewrites the slice); kube-proxy
/// then applies its usual ready / serving-terminating rule to what is left,
/// and so does this function. An endpoint without `nodeName` never matches
/// (OpenYurt skips such addresses).
pub(super) fn rank_openyurt(view: &View<'_>, yurt: &YurtTopology) -> (Vec<usize>, String) {
    let all = view.all();
    let on_node = || -> Vec<Indexed<'_>> { all.iter().copied().filter(|(_, e)| view.is_local(e)).collect() };
    let mut log = Vec::new();
    let mut selected: Option<Vec<Indexed<'_>>> = None;

    if yurt.node {
        let sel = on_node();
        log.push(format!("{} on this node {}", plural(sel.len(), "endpoint", "endpoints"), view.node_name));
        if !sel.is_empty() {
            selected = Some(sel);
        }
    }
    if selected.is_none() && yurt.pool {
        let sel = match view.node_label(LABEL_OPENYURT_NODEPOOL).filter(|p| !p.is_empty()) {
            None => {
                let sel = on_node();
                log.push(format!(
                    "node is in no node pool (no label {LABEL_OPENYURT_NODEPOOL}), so node topology: {} on this node",
                    plural(sel.len(), "endpoint", "endpoints")
                ));
                sel
            }
            Some(pool) => {
                let sel: Vec<Indexed<'_>> =
                    all.iter().copied().filter(|(_, e)| view.endpoint_label(e, LABEL_OPENYURT_NODEPOOL) == Some(pool)).collect();
                log.push(format!("{} in node pool {pool}", plural(sel.len(), "endpoint", "endpoints")));
                sel
            }
        };
        if !sel.is_empty() {
            selected = Some(sel);
        }
    }
    if selected.is_none() && yurt.any {
        log.push(format!("{} anywhere via \"*\"", plural(all.len(), "endpoint", "endpoints")));
        selected = Some(all.clone());
    }

    let source = format!("annotation {ANNOTATION_OPENYURT_TOPOLOGY_KEYS}={}", yurt.raw);
    let Some(sel) = selected else {
        log.push("nothing selected: no backends for this node, connections are refused".to_string());
        return (Vec::new(), format!("{source}: {}", log.join("; ")));
    };
    let u = usable(sel, |_| true);
    log.push(match (u.indices.len(), u.terminating) {
        (0, _) => "none of them usable: no backends for this node".to_string(),
        (n, false) => format!("{n} ready"),
        (n, true) => format!("none ready, {n} serving terminating"),
    });
    (u.indices, format!("{source}: {}", log.join("; ")))
}

#[cfg(test)]
mod tests {
    use super::super::Model;
    use super::super::test_support::{Case, EpExt, SvcExt, ep, node, run, svc};
    use super::*;
    use crate::model::{Endpoint, Node};

    /// OpenYurt filter_test.go layout: node1 and node3 in pool hangzhou,
    /// node2 in pool shanghai.
    fn yurt_nodes() -> Vec<Node> {
        vec![
            node("node1", &[(LABEL_OPENYURT_NODEPOOL, "hangzhou")]),
            node("node2", &[(LABEL_OPENYURT_NODEPOOL, "shanghai")]),
            node("node3", &[(LABEL_OPENYURT_NODEPOOL, "hangzhou")]),
        ]
    }

    /// 10.244.1.2..5 on node1, node2, node1, node3.
    fn yurt_eps() -> Vec<Endpoint> {
        vec![ep(2, "node1"), ep(3, "node2"), ep(4, "node1"), ep(5, "node3")]
    }

    // ----- OpenYurt service topology (servicetopology filter_test.go) -----

    #[test]
    fn openyurt() {
        let yurt = |v: &str| svc().ann(ANNOTATION_OPENYURT_TOPOLOGY_KEYS, v);
        run(vec![
            Case {
                name: "topologyKeys is kubernetes.io/hostname",
                svc: yurt(OPENYURT_VALUE_NODE),
                nodes: yurt_nodes(),
                this: "node1",
                eps: yurt_eps(),
                model: Model::OpenYurt,
                cluster: vec![0, 2],
                local: vec![0, 2],
                ..Default::default()
            },
            Case {
                name: "topologyKeys is openyurt.io/nodepool",
                svc: yurt(OPENYURT_VALUE_NODEPOOL),
                nodes: yurt_nodes(),
                this: "node1",
                eps: yurt_eps(),
                model: Model::OpenYurt,
                cluster: vec![0, 2, 3],
                local: vec![0, 2],
                says: vec!["3 endpoints in node pool hangzhou"],
                ..Default::default()
            },
            Case {
                name: "topologyKeys is kubernetes.io/zone (means node pool)",
                svc: yurt(OPENYURT_VALUE_ZONE),
                nodes: yurt_nodes(),
                this: "node1",
                eps: yurt_eps(),
                model: Model::OpenYurt,
                cluster: vec![0, 2, 3],
                local: vec![0, 2],
                ..Default::default()
            },
            Case {
                name: "without openyurt.io/topologyKeys",
                nodes: yurt_nodes(),
                this: "node1",
                eps: yurt_eps(),
                model: Model::Cluster,
                cluster: vec![0, 1, 2, 3],
                local: vec![0, 2],
                ..Default::default()
            },
            Case {
                name: "currentNode is not in any nodepool: falls into node topology",
                svc: yurt(OPENYURT_VALUE_NODEPOOL),
                nodes: vec![
                    node("node1", &[]),
                    node("node2", &[(LABEL_OPENYURT_NODEPOOL, "shanghai")]),
                    node("node3", &[(LABEL_OPENYURT_NODEPOOL, "hangzhou")]),
                ],
                this: "node1",
                eps: yurt_eps(),
                model: Model::OpenYurt,
                cluster: vec![0, 2],
                local: vec![0, 2],
                says: vec!["node is in no node pool"],
                ..Default::default()
            },
            Case {
                name: "currentNode has an empty pool label: node topology",
                svc: yurt(OPENYURT_VALUE_NODEPOOL),
                nodes: vec![node("node1", &[(LABEL_OPENYURT_NODEPOOL, "")]), node("node2", &[(LABEL_OPENYURT_NODEPOOL, "")])],
                this: "node1",
                eps: yurt_eps(),
                model: Model::OpenYurt,
                cluster: vec![0, 2],
                local: vec![0, 2],
                ..Default::default()
            },
            Case {
                name: "currentNode unknown: pool unresolvable, node topology",
                svc: yurt(OPENYURT_VALUE_NODEPOOL),
                nodes: yurt_nodes(),
                this: "node9",
                eps: vec![ep(2, "node9"), ep(3, "node2")],
                model: Model::OpenYurt,
                cluster: vec![0],
                local: vec![0],
                ..Default::default()
            },
            Case {
                name: "currentNode not in a pool and no endpoints on node: none",
                svc: yurt(OPENYURT_VALUE_NODEPOOL),
                nodes: vec![node("node1", &[]), node("node2", &[(LABEL_OPENYURT_NODEPOOL, "shanghai")])],
                this: "node1",
                eps: vec![ep(3, "node2")],
                model: Model::OpenYurt,
                cluster: vec![],
                ..Default::default()
            },
            Case {
                name: "currentNode has no endpoints on node",
                svc: yurt(OPENYURT_VALUE_NODE),
                nodes: yurt_nodes(),
                this: "node1",
                eps: vec![ep(2, "node2"), ep(3, "node2"), ep(4, "node3"), ep(5, "node3")],
                model: Model::OpenYurt,
                cluster: vec![],
                says: vec!["connections are refused"],
                ..Default::default()
            },
            Case {
                name: "currentNode has no endpoints in nodepool",
                svc: yurt(OPENYURT_VALUE_NODEPOOL),
                nodes: vec![
                    node("node1", &[(LABEL_OPENYURT_NODEPOOL, "shanghai")]),
                    node("node2", &[(LABEL_OPENYURT_NODEPOOL, "hangzhou")]),
                    node("node3", &[(LABEL_OPENYURT_NODEPOOL, "hangzhou")]),
                ],
                this: "node1",
                eps: vec![ep(2, "node2"), ep(3, "node2"), ep(4, "node3"), ep(5, "node3")],
                model: Model::OpenYurt,
                cluster: vec![],
                ..Default::default()
            },
            Case {
                name: "endpoints on unknown nodes or without nodeName are in no pool",
                svc: yurt(OPENYURT_VALUE_NODEPOOL),
                nodes: yurt_nodes(),
                this: "node1",
                eps: vec![ep(2, "ghost"), ep(3, ""), ep(4, "node3")],
                model: Model::OpenYurt,
                cluster: vec![2],
                ..Default::default()
            },
            Case {
                name: "unsupported value: no filtering, reported",
                svc: yurt("topology.kubernetes.io/zone"),
                nodes: yurt_nodes(),
                this: "node1",
                eps: yurt_eps(),
                model: Model::Cluster,
                cluster: vec![0, 1, 2, 3],
                local: vec![0, 2],
                problems: 1,
                ..Default::default()
            },
            Case {
                name: "list (older OpenYurt): same node first",
                svc: yurt("kubernetes.io/hostname, openyurt.io/nodepool, *"),
                nodes: yurt_nodes(),
                this: "node1",
                eps: yurt_eps(),
                model: Model::OpenYurt,
                cluster: vec![0, 2],
                local: vec![0, 2],
                ..Default::default()
            },
            Case {
                name: "list (older OpenYurt): pool when nothing on the node, order irrelevant",
                svc: yurt("openyurt.io/nodepool,kubernetes.io/hostname"),
                nodes: yurt_nodes(),
                this: "node3",
                eps: vec![ep(2, "node1"), ep(3, "node2")],
                model: Model::OpenYurt,
                cluster: vec![0],
                ..Default::default()
            },
            Case {
                name: "list (older OpenYurt): '*' when nothing in the pool",
                svc: yurt("kubernetes.io/hostname,openyurt.io/nodepool,*"),
                nodes: yurt_nodes(),
                this: "node2",
                eps: vec![ep(2, "node1"), ep(4, "node3")],
                model: Model::OpenYurt,
                cluster: vec![0, 1],
                says: vec!["0 endpoints on this node node2; 0 endpoints in node pool shanghai; 2 endpoints anywhere"],
                ..Default::default()
            },
            Case {
                name: "list with an unknown item: known ones used, unknown reported",
                svc: yurt("kubernetes.io/hostname,rack"),
                nodes: yurt_nodes(),
                this: "node1",
                eps: yurt_eps(),
                model: Model::OpenYurt,
                cluster: vec![0, 2],
                local: vec![0, 2],
                problems: 1,
                ..Default::default()
            },
            Case {
                name: "filter ignores readiness: pool selected with only unready endpoints, none usable",
                svc: yurt("openyurt.io/nodepool,*"),
                nodes: yurt_nodes(),
                this: "node1",
                eps: vec![ep(2, "node3").unready(), ep(3, "node2")],
                model: Model::OpenYurt,
                cluster: vec![],
                ..Default::default()
            },
            Case {
                name: "serving terminating fallback within the pool",
                svc: yurt(OPENYURT_VALUE_NODEPOOL),
                nodes: yurt_nodes(),
                this: "node1",
                eps: vec![ep(2, "node3").term(), ep(3, "node2"), ep(4, "node1").gone()],
                model: Model::OpenYurt,
                cluster: vec![0],
                says: vec!["none ready, 1 serving terminating"],
                ..Default::default()
            },
            Case {
                name: "OpenYurt with externalTrafficPolicy Local is fine; local set node-local",
                svc: yurt(OPENYURT_VALUE_NODEPOOL).etp_local(),
                nodes: yurt_nodes(),
                this: "node1",
                eps: yurt_eps(),
                model: Model::OpenYurt,
                cluster: vec![0, 2, 3],
                local: vec![0, 2],
                ..Default::default()
            },
        ]);
    }
}
