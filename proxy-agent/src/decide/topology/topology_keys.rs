//! Service Topology (KEP-536, Kubernetes 1.17-1.21): an ordered list of
//! node label keys, hard constraints tried in priority order. Read from
//! `spec.topologyKeys` or, where the API server no longer has that field,
//! from this project's [`ANNOTATION_TOPOLOGY_KEYS`]; validated as the API
//! server validated the field, and applied as kube-proxy's
//! `FilterTopologyEndpoint` (pkg/proxy/topology.go) applied it.

use std::collections::BTreeSet;

use super::{Indexed, TOPOLOGY_KEY_ANY, View};
use crate::model::Service;

/// `core.MaxServiceTopologyKeys`.
const MAX_TOPOLOGY_KEYS: usize = 16;
/// This project's annotation: a comma-separated topology key list with the
/// meaning of `spec.topologyKeys`, for clusters whose API server no longer
/// accepts the field (it left the API in 1.22).
pub(super) const ANNOTATION_TOPOLOGY_KEYS: &str = "topoproxy.io/topology-keys";

/// The Service's Kubernetes-style topology key list and where it was read
/// from: `spec.topologyKeys` when non-empty ("If this is not specified or
/// empty, no topology constraints will be applied"), else
/// [`ANNOTATION_TOPOLOGY_KEYS`], its items whitespace trimmed and empty
/// ones dropped. Not yet validated.
pub(super) fn declared_keys(svc: &Service) -> Option<(KeySource, Vec<String>)> {
    let spec = svc.topology_keys.as_ref().filter(|k| !k.is_empty()).map(|k| (KeySource::Spec, k.clone()));
    let ours = svc
        .annotations
        .get(ANNOTATION_TOPOLOGY_KEYS)
        .map(|raw| raw.split(',').map(str::trim).filter(|k| !k.is_empty()).map(str::to_string).collect::<Vec<_>>())
        .filter(|k| !k.is_empty())
        .map(|k| (KeySource::Annotation, k));
    spec.or(ours)
}

/// Where a Kubernetes-style topology key list was read from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum KeySource {
    Spec,
    Annotation,
}

impl KeySource {
    /// How the decision and problems name the list.
    pub(super) fn label(self) -> &'static str {
        match self {
            KeySource::Spec => "spec.topologyKeys",
            KeySource::Annotation => "annotation topoproxy.io/topology-keys",
        }
    }

    /// The field path validation errors refer to.
    pub(super) fn path(self) -> &'static str {
        match self {
            KeySource::Spec => "spec.topologyKeys",
            KeySource::Annotation => "metadata.annotations[topoproxy.io/topology-keys]",
        }
    }
}

/// Validates a topology key list as the API server did for
/// `spec.topologyKeys` (`ValidateService`, pkg/apis/core/validation,
/// 1.17-1.21): not with externalTrafficPolicy=Local, at most
/// [`MAX_TOPOLOGY_KEYS`] keys, no duplicates, `"*"` only last, every other
/// key a qualified name (a valid label key). Messages follow the API
/// server's field errors.
pub(super) fn validate_topology_keys(path: &str, keys: &[String], external_policy_local: bool) -> Vec<String> {
    let mut errs = Vec::new();
    if keys.is_empty() {
        return errs;
    }
    if external_policy_local {
        errs.push(format!("{path}: Forbidden: may not be specified when `externalTrafficPolicy=Local`"));
    }
    if keys.len() > MAX_TOPOLOGY_KEYS {
        errs.push(format!("{path}: Too many: {}: must have at most {MAX_TOPOLOGY_KEYS} items", keys.len()));
    }
    let mut seen = BTreeSet::new();
    for (i, key) in keys.iter().enumerate() {
        let at = format!("{path}[{i}]");
        if !seen.insert(key.as_str()) {
            errs.push(format!("{at}: Duplicate value: {key:?}"));
        }
        if key == TOPOLOGY_KEY_ANY {
            if i != keys.len() - 1 {
                errs.push(format!("{at}: Invalid value: \"*\": \"*\" must be the last value specified"));
            }
        } else {
            for msg in qualified_name_errors(key) {
                errs.push(format!("{at}: Invalid value: {key:?}: {msg}"));
            }
        }
    }
    errs
}

const QUALIFIED_NAME_MSG: &str = "must consist of alphanumeric characters, '-', '_' or '.', \
     and must start and end with an alphanumeric character";
const QUALIFIED_NAME_MAX_LEN: usize = 63;
const DNS1123_SUBDOMAIN_MAX_LEN: usize = 253;

/// apimachinery's `IsQualifiedName`: `[prefix/]name`, the prefix a DNS-1123
/// subdomain, the name at most 63 characters of
/// `([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]`. Empty when valid.
fn qualified_name_errors(value: &str) -> Vec<String> {
    let mut errs = Vec::new();
    let parts: Vec<&str> = value.split('/').collect();
    let name = match parts.as_slice() {
        [name] => *name,
        [prefix, name] => {
            if prefix.is_empty() {
                errs.push("prefix part must be non-empty".to_string());
            } else {
                errs.extend(dns1123_subdomain_errors(prefix).into_iter().map(|m| format!("prefix part {m}")));
            }
            *name
        }
        _ => {
            return vec![format!(
                "a qualified name {QUALIFIED_NAME_MSG} with an optional DNS subdomain prefix and '/' (e.g. 'example.com/MyName')"
            )];
        }
    };
    if name.is_empty() {
        errs.push("name part must be non-empty".to_string());
        return errs;
    }
    if name.len() > QUALIFIED_NAME_MAX_LEN {
        errs.push(format!("name part must be no more than {QUALIFIED_NAME_MAX_LEN} characters"));
    }
    let inner_ok = name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if !inner_ok || !starts_and_ends_alnum(name, |c| c.is_ascii_alphanumeric()) {
        errs.push(format!("name part {QUALIFIED_NAME_MSG}"));
    }
    errs
}

/// apimachinery's `IsDNS1123Subdomain`.
fn dns1123_subdomain_errors(value: &str) -> Vec<String> {
    let mut errs = Vec::new();
    if value.len() > DNS1123_SUBDOMAIN_MAX_LEN {
        errs.push(format!("must be no more than {DNS1123_SUBDOMAIN_MAX_LEN} characters"));
    }
    let lower_alnum = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit();
    let ok = value.split('.').all(|label| label.chars().all(|c| lower_alnum(c) || c == '-') && starts_and_ends_alnum(label, lower_alnum));
    if !ok {
        errs.push(
            "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', \
             and must start and end with an alphanumeric character"
                .to_string(),
        );
    }
    errs
}

fn starts_and_ends_alnum(s: &str, alnum: impl Fn(char) -> bool) -> bool {
    matches!((s.chars().next(), s.chars().last()), (Some(a), Some(b)) if alnum(a) && alnum(b))
}

/// Kubernetes' `FilterTopologyEndpoint` (pkg/proxy/topology.go, 1.17-1.21):
/// for each key in order, the endpoints whose Node has the same value for
/// that label as this node; the first key with a match wins. A key this node
/// lacks is skipped; an endpoint whose Node lacks the label does not match
/// (one whose Node is unknown is matched by the labels its EndpointSlice
/// reported, v1beta1's `topology`, as kube-proxy matched every endpoint:
/// `View::endpoint_label`); `"*"` matches every endpoint. No match: no backends, the
/// connection is refused ("If this field is specified, but all entries have
/// no backends that match the topology of the client, the service has no
/// backends for that client and connections should fail").
///
/// A key matches only with an available endpoint (kube-proxy 1.17-1.19 kept
/// only ready endpoints in its endpoint cache, so the filter only ever saw
/// those): the tiers are tried over ready endpoints first. When no tier has
/// a ready endpoint, they are tried again over serving terminating
/// endpoints: kube-proxy's fallback (KEP-1669), but keeping the keys, which
/// are hard constraints (a `["kubernetes.io/hostname"]` Service must never
/// reach another node).
pub(super) fn rank_by_keys(view: &View<'_>, source: &str, keys: &[String]) -> (Vec<usize>, String) {
    let all = view.all();
    let ready: Vec<Indexed<'_>> = all.iter().copied().filter(|(_, e)| e.ready).collect();
    let terminating: Vec<Indexed<'_>> = all.iter().copied().filter(|(_, e)| !e.ready && e.serving && e.terminating).collect();

    let mut log = Vec::new();
    if ready.is_empty() {
        log.push("no ready endpoints".to_string());
    } else if let Some(sel) = match_keys(view, keys, &ready, &mut log) {
        return (sel, format!("{source}: {}", log.join("; ")));
    }
    if !terminating.is_empty() {
        let mut log2 = Vec::new();
        let found = match_keys(view, keys, &terminating, &mut log2);
        let what = if ready.is_empty() { "" } else { "no ready endpoint matched; " };
        log.push(format!("{what}serving terminating endpoints: {}", log2.join("; ")));
        if let Some(sel) = found {
            return (sel, format!("{source}: {}", log.join("; ")));
        }
    }
    log.push("no key matched: no backends for this node, connections are refused".to_string());
    (Vec::new(), format!("{source}: {}", log.join("; ")))
}

/// One pass over the keys with the given candidates; logs each tier.
fn match_keys(view: &View<'_>, keys: &[String], candidates: &[Indexed<'_>], log: &mut Vec<String>) -> Option<Vec<usize>> {
    for key in keys {
        if key == TOPOLOGY_KEY_ANY {
            log.push(format!("{} anywhere via \"*\"", candidates.len()));
            return Some(candidates.iter().map(|(i, _)| *i).collect());
        }
        let Some(value) = view.node_label(key) else {
            log.push(format!("node lacks label {key}"));
            continue;
        };
        let sel: Vec<usize> = candidates.iter().filter(|(_, e)| view.endpoint_label(e, key) == Some(value)).map(|(i, _)| *i).collect();
        if sel.is_empty() {
            log.push(format!("none in {key}={value}"));
        } else {
            log.push(format!("{} in {key}={value}", sel.len()));
            return Some(sel);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::super::openyurt::{ANNOTATION_OPENYURT_TOPOLOGY_KEYS, LABEL_OPENYURT_NODEPOOL, OPENYURT_VALUE_NODE};
    use super::super::test_support::{Case, EpExt, REGION, SvcExt, ep, node, run, svc};
    use super::super::{LABEL_HOSTNAME, LABEL_ZONE, Model};
    use super::*;
    use crate::model::{Endpoint, Node};

    /// kube-proxy's topology_test.go layout: hostname, zone and region on
    /// every node; n1, n2 in zone 90001, n3, n4 in 90002, n5 in 90003.
    fn k8s_nodes() -> Vec<Node> {
        [("n1", "90001"), ("n2", "90001"), ("n3", "90002"), ("n4", "90002"), ("n5", "90003")]
            .iter()
            .map(|(n, z)| node(n, &[(LABEL_HOSTNAME, n), (LABEL_ZONE, z), (REGION, "cd")]))
            .collect()
    }

    /// Two endpoints on each of n1..n4: indices 0,1 on n1, 2,3 on n2, 4,5
    /// on n3, 6,7 on n4.
    fn k8s_eps() -> Vec<Endpoint> {
        (0u8..8).map(|i| ep(i + 1, ["n1", "n2", "n3", "n4"][usize::from(i / 2)])).collect()
    }

    // ----- topologyKeys (kube-proxy TestFilterTopologyEndpoint, 1.17-1.21) -----

    #[test]
    fn topology_keys() {
        let hz = [LABEL_HOSTNAME, LABEL_ZONE];
        run(vec![
            Case { name: "no topology key and no endpoints", nodes: k8s_nodes(), ..Default::default() },
            Case {
                name: "no topology key but have endpoints",
                nodes: k8s_nodes(),
                eps: k8s_eps(),
                cluster: (0..8).collect(),
                local: vec![0, 1],
                ..Default::default()
            },
            Case {
                name: "empty spec.topologyKeys is no topology",
                svc: svc().keys(&[]),
                nodes: k8s_nodes(),
                eps: k8s_eps(),
                cluster: (0..8).collect(),
                local: vec![0, 1],
                ..Default::default()
            },
            Case {
                name: "one topology key with one node matched",
                svc: svc().keys(&[LABEL_HOSTNAME]),
                nodes: k8s_nodes(),
                eps: k8s_eps(),
                model: Model::TopologyKeys,
                cluster: vec![0, 1],
                says: vec!["2 in kubernetes.io/hostname=n1"],
                local: vec![0, 1],
                ..Default::default()
            },
            Case {
                name: "one topology key without node matched: refused",
                svc: svc().keys(&[LABEL_HOSTNAME]),
                nodes: k8s_nodes(),
                this: "n5",
                eps: k8s_eps(),
                model: Model::TopologyKeys,
                cluster: vec![],
                says: vec!["none in kubernetes.io/hostname=n5", "connections are refused"],
                ..Default::default()
            },
            Case {
                name: "one topology key with multiple nodes matched",
                svc: svc().keys(&[LABEL_ZONE]),
                nodes: k8s_nodes(),
                this: "n2",
                eps: k8s_eps(),
                model: Model::TopologyKeys,
                cluster: vec![0, 1, 2, 3],
                local: vec![2, 3],
                ..Default::default()
            },
            Case {
                name: "early match in multiple topology keys",
                svc: svc().keys(&hz),
                nodes: k8s_nodes(),
                this: "n2",
                eps: k8s_eps(),
                model: Model::TopologyKeys,
                cluster: vec![2, 3],
                local: vec![2, 3],
                ..Default::default()
            },
            Case {
                name: "later match in multiple topology keys",
                svc: svc().keys(&hz),
                nodes: {
                    let mut n = k8s_nodes();
                    n.push(node("n6", &[(LABEL_HOSTNAME, "n6"), (LABEL_ZONE, "90002")]));
                    n
                },
                this: "n6",
                eps: k8s_eps(),
                model: Model::TopologyKeys,
                cluster: vec![4, 5, 6, 7],
                says: vec!["none in kubernetes.io/hostname=n6; 4 in topology.kubernetes.io/zone=90002"],
                ..Default::default()
            },
            Case {
                name: "multiple topology keys without node matched",
                svc: svc().keys(&hz),
                nodes: k8s_nodes(),
                this: "n5",
                eps: k8s_eps(),
                model: Model::TopologyKeys,
                cluster: vec![],
                ..Default::default()
            },
            Case {
                name: "multiple topology keys matched node when 'Any' key ignored",
                svc: svc().keys(&[LABEL_HOSTNAME, "*"]),
                nodes: k8s_nodes(),
                eps: k8s_eps(),
                model: Model::TopologyKeys,
                cluster: vec![0, 1],
                local: vec![0, 1],
                ..Default::default()
            },
            Case {
                name: "two topology keys matched node with 'Any' key",
                svc: svc().keys(&[LABEL_HOSTNAME, "*"]),
                nodes: k8s_nodes(),
                this: "n5",
                eps: k8s_eps(),
                model: Model::TopologyKeys,
                cluster: (0..8).collect(),
                says: vec!["8 anywhere via \"*\""],
                ..Default::default()
            },
            Case {
                name: "multiple topology keys matched node with 'Any' key",
                svc: svc().keys(&[LABEL_HOSTNAME, LABEL_ZONE, REGION, "*"]),
                nodes: {
                    let mut n = k8s_nodes();
                    n.push(node("n7", &[(LABEL_HOSTNAME, "n7"), (LABEL_ZONE, "90009"), (REGION, "bj")]));
                    n
                },
                this: "n7",
                eps: k8s_eps(),
                model: Model::TopologyKeys,
                cluster: (0..8).collect(),
                ..Default::default()
            },
            Case {
                name: "region tier after zone tier",
                svc: svc().keys(&[LABEL_HOSTNAME, LABEL_ZONE, REGION]),
                nodes: k8s_nodes(),
                this: "n5",
                eps: k8s_eps(),
                model: Model::TopologyKeys,
                cluster: (0..8).collect(),
                says: vec!["none in topology.kubernetes.io/zone=90003; 8 in topology.kubernetes.io/region=cd"],
                ..Default::default()
            },
            Case {
                name: "a key the node lacks is skipped",
                svc: svc().keys(&[LABEL_HOSTNAME, "rack", LABEL_ZONE]),
                nodes: k8s_nodes(),
                this: "n5",
                eps: vec![ep(1, "n1"), ep(2, "n5").unready(), ep(3, "n4")],
                model: Model::TopologyKeys,
                cluster: vec![],
                local: vec![],
                says: vec!["node lacks label rack"],
                ..Default::default()
            },
            Case {
                name: "unknown node: only '*' can match",
                svc: svc().keys(&[LABEL_HOSTNAME, LABEL_ZONE, "*"]),
                nodes: k8s_nodes(),
                this: "ghost",
                eps: k8s_eps(),
                model: Model::TopologyKeys,
                cluster: (0..8).collect(),
                says: vec!["node lacks label kubernetes.io/hostname; node lacks label topology.kubernetes.io/zone"],
                ..Default::default()
            },
            Case {
                name: "unknown node without '*': refused",
                svc: svc().keys(&[LABEL_HOSTNAME, LABEL_ZONE]),
                nodes: k8s_nodes(),
                this: "ghost",
                eps: k8s_eps(),
                model: Model::TopologyKeys,
                cluster: vec![],
                ..Default::default()
            },
            Case {
                name: "endpoint on unknown node or without nodeName matches only '*'",
                svc: svc().keys(&[LABEL_ZONE, "*"]),
                nodes: k8s_nodes(),
                this: "n3",
                eps: vec![ep(1, "ghost"), ep(2, ""), ep(3, "n4")],
                model: Model::TopologyKeys,
                cluster: vec![2],
                ..Default::default()
            },
            Case {
                name: "endpoint on unknown node or without nodeName, no match in zone, '*'",
                svc: svc().keys(&[LABEL_ZONE, "*"]),
                nodes: k8s_nodes(),
                this: "n5",
                eps: vec![ep(1, "ghost"), ep(2, ""), ep(3, "n4")],
                model: Model::TopologyKeys,
                cluster: vec![0, 1, 2],
                ..Default::default()
            },
            Case {
                name: "endpoint node lacking the label does not match",
                svc: svc().keys(&["rack"]),
                nodes: vec![node("a", &[("rack", "r1")]), node("b", &[]), node("c", &[("rack", "r1")])],
                this: "a",
                eps: vec![ep(1, "b"), ep(2, "c")],
                model: Model::TopologyKeys,
                cluster: vec![1],
                ..Default::default()
            },
            Case {
                name: "any node label key works: custom rack then node pool",
                svc: svc().keys(&["example.com/rack", LABEL_OPENYURT_NODEPOOL, "*"]),
                nodes: vec![
                    node("a", &[("example.com/rack", "r1"), (LABEL_OPENYURT_NODEPOOL, "p1")]),
                    node("b", &[("example.com/rack", "r2"), (LABEL_OPENYURT_NODEPOOL, "p1")]),
                    node("c", &[("example.com/rack", "r3"), (LABEL_OPENYURT_NODEPOOL, "p2")]),
                ],
                this: "a",
                eps: vec![ep(1, "b"), ep(2, "c")],
                model: Model::TopologyKeys,
                cluster: vec![0],
                says: vec!["none in example.com/rack=r1; 1 in apps.openyurt.io/nodepool=p1"],
                ..Default::default()
            },
            Case {
                name: "a tier with only unready endpoints is skipped",
                svc: svc().keys(&hz),
                nodes: k8s_nodes(),
                this: "n1",
                eps: vec![ep(1, "n1").unready(), ep(2, "n2"), ep(3, "n3")],
                model: Model::TopologyKeys,
                cluster: vec![1],
                ..Default::default()
            },
            Case {
                name: "only ready endpoints of the matching tier",
                svc: svc().keys(&[LABEL_ZONE]),
                nodes: k8s_nodes(),
                this: "n1",
                eps: vec![ep(1, "n1"), ep(2, "n2").unready(), ep(3, "n2").term(), ep(4, "n3")],
                model: Model::TopologyKeys,
                cluster: vec![0],
                local: vec![0],
                ..Default::default()
            },
            Case {
                name: "no ready endpoint matches: serving terminating ones, keys kept",
                svc: svc().keys(&[LABEL_HOSTNAME]),
                nodes: k8s_nodes(),
                this: "n1",
                eps: vec![ep(1, "n1").term(), ep(2, "n2"), ep(3, "n1").gone()],
                model: Model::TopologyKeys,
                cluster: vec![0],
                local: vec![0],
                says: vec!["no ready endpoint matched; serving terminating endpoints: 1 in kubernetes.io/hostname=n1"],
                ..Default::default()
            },
            Case {
                name: "no ready endpoints at all: serving terminating via '*'",
                svc: svc().keys(&[LABEL_HOSTNAME, "*"]),
                nodes: k8s_nodes(),
                this: "n5",
                eps: vec![ep(1, "n1").term(), ep(2, "n2").term(), ep(3, "n3").unready()],
                model: Model::TopologyKeys,
                cluster: vec![0, 1],
                says: vec!["no ready endpoints"],
                ..Default::default()
            },
            Case {
                name: "terminating endpoints never reach another node under hostname-only",
                svc: svc().keys(&[LABEL_HOSTNAME]),
                nodes: k8s_nodes(),
                this: "n1",
                eps: vec![ep(1, "n2").term(), ep(2, "n3").term()],
                model: Model::TopologyKeys,
                cluster: vec![],
                ..Default::default()
            },
            Case {
                name: "keys take precedence over hints and trafficDistribution",
                svc: svc().keys(&[LABEL_HOSTNAME]).td("PreferClose"),
                nodes: k8s_nodes(),
                this: "n1",
                eps: vec![ep(1, "n1").zh(&["90002"]), ep(2, "n3").zh(&["90001"])],
                model: Model::TopologyKeys,
                cluster: vec![0],
                local: vec![0],
                ..Default::default()
            },
            Case {
                name: "internalTrafficPolicy Local with keys: local set is node-local, cluster set by keys",
                svc: svc().keys(&[LABEL_ZONE]).itp_local(),
                nodes: k8s_nodes(),
                this: "n1",
                eps: vec![ep(1, "n1"), ep(2, "n2"), ep(3, "n3")],
                model: Model::TopologyKeys,
                cluster: vec![0, 1],
                local: vec![0],
                says: vec!["local: 1 ready on n1"],
                ..Default::default()
            },
        ]);
    }

    #[test]
    fn topology_keys_sources_and_validation() {
        let many: Vec<String> = (0..17).map(|i| format!("k{i}")).collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        let long_name = "a".repeat(64);
        let long_key: &'static str = Box::leak(long_name.into_boxed_str());
        run(vec![
            Case {
                name: "project annotation: comma list, whitespace trimmed, empty items dropped",
                svc: svc().ann(ANNOTATION_TOPOLOGY_KEYS, " kubernetes.io/hostname ,, topology.kubernetes.io/zone,"),
                nodes: k8s_nodes(),
                this: "n2",
                eps: vec![ep(1, "n1"), ep(2, "n3")],
                model: Model::TopologyKeys,
                cluster: vec![0],
                says: vec![
                    "annotation topoproxy.io/topology-keys [kubernetes.io/hostname, topology.kubernetes.io/zone]",
                    "none in kubernetes.io/hostname=n2; 1 in topology.kubernetes.io/zone=90001",
                ],
                ..Default::default()
            },
            Case {
                name: "empty project annotation is no topology",
                svc: svc().ann(ANNOTATION_TOPOLOGY_KEYS, " , "),
                nodes: k8s_nodes(),
                eps: vec![ep(1, "n1"), ep(2, "n3")],
                cluster: vec![0, 1],
                local: vec![0],
                ..Default::default()
            },
            Case {
                name: "spec.topologyKeys takes precedence over the annotations",
                svc: svc()
                    .keys(&[LABEL_ZONE])
                    .ann(ANNOTATION_TOPOLOGY_KEYS, LABEL_HOSTNAME)
                    .ann(ANNOTATION_OPENYURT_TOPOLOGY_KEYS, OPENYURT_VALUE_NODE),
                nodes: k8s_nodes(),
                this: "n2",
                eps: vec![ep(1, "n1"), ep(2, "n3")],
                model: Model::TopologyKeys,
                cluster: vec![0],
                says: vec!["takes precedence"],
                ..Default::default()
            },
            Case {
                name: "project annotation takes precedence over OpenYurt's",
                svc: svc().ann(ANNOTATION_TOPOLOGY_KEYS, "*").ann(ANNOTATION_OPENYURT_TOPOLOGY_KEYS, OPENYURT_VALUE_NODE),
                nodes: k8s_nodes(),
                this: "n2",
                eps: vec![ep(1, "n1"), ep(2, "n3")],
                model: Model::TopologyKeys,
                cluster: vec![0, 1],
                ..Default::default()
            },
            Case {
                name: "invalid: '*' not last; programmed without topology",
                svc: svc().keys(&["*", LABEL_HOSTNAME]),
                nodes: k8s_nodes(),
                eps: vec![ep(1, "n1"), ep(2, "n3")],
                model: Model::Cluster,
                cluster: vec![0, 1],
                problems: 1,
                says: vec!["invalid and ignored"],
                local: vec![0],
                ..Default::default()
            },
            Case {
                name: "invalid: duplicate key",
                svc: svc().keys(&[LABEL_HOSTNAME, LABEL_HOSTNAME]),
                nodes: k8s_nodes(),
                eps: vec![ep(1, "n1"), ep(2, "n3")],
                cluster: vec![0, 1],
                problems: 1,
                local: vec![0],
                ..Default::default()
            },
            Case {
                name: "invalid: more than 16 keys",
                svc: svc().keys(&many),
                nodes: k8s_nodes(),
                eps: vec![ep(1, "n1"), ep(2, "n3")],
                cluster: vec![0, 1],
                problems: 1,
                local: vec![0],
                ..Default::default()
            },
            Case {
                name: "invalid: not a label key",
                svc: svc().keys(&["-bad-", LABEL_ZONE]),
                nodes: k8s_nodes(),
                eps: vec![ep(1, "n1"), ep(2, "n3")],
                cluster: vec![0, 1],
                problems: 1,
                local: vec![0],
                ..Default::default()
            },
            Case {
                name: "invalid: name part too long",
                svc: svc().keys(&[long_key]),
                nodes: k8s_nodes(),
                eps: vec![ep(1, "n1")],
                cluster: vec![0],
                problems: 1,
                local: vec![0],
                ..Default::default()
            },
            Case {
                name: "invalid: with externalTrafficPolicy Local",
                svc: svc().keys(&[LABEL_HOSTNAME]).etp_local(),
                nodes: k8s_nodes(),
                this: "n5",
                eps: vec![ep(1, "n1"), ep(2, "n5")],
                cluster: vec![0, 1],
                local: vec![1],
                problems: 1,
                ..Default::default()
            },
            Case {
                name: "invalid annotation with externalTrafficPolicy Local",
                svc: svc().ann(ANNOTATION_TOPOLOGY_KEYS, "kubernetes.io/hostname").etp_local(),
                nodes: k8s_nodes(),
                this: "n5",
                eps: vec![ep(1, "n1"), ep(2, "n5")],
                cluster: vec![0, 1],
                local: vec![1],
                problems: 1,
                ..Default::default()
            },
            Case {
                name: "invalid spec keys shadow the annotation (as if no keys)",
                svc: svc().keys(&["a/b/c"]).ann(ANNOTATION_TOPOLOGY_KEYS, LABEL_HOSTNAME),
                nodes: k8s_nodes(),
                eps: vec![ep(1, "n1"), ep(2, "n3")],
                cluster: vec![0, 1],
                problems: 1,
                local: vec![0],
                ..Default::default()
            },
            Case {
                name: "invalid keys: hints still apply, as with no keys",
                svc: svc().keys(&["*", "*"]),
                nodes: k8s_nodes(),
                this: "n1",
                eps: vec![ep(1, "n1").zh(&["90001"]), ep(2, "n3").zh(&["90002"])],
                model: Model::HintsZone,
                cluster: vec![0],
                problems: 1,
                local: vec![0],
                ..Default::default()
            },
        ]);
    }

    // ----- endpoints whose Node is unknown: the labels their slice reported -----

    #[test]
    fn reported_topology_stands_in_for_unknown_nodes() {
        // "ghost" and "edge" have no Node object; what their slices said
        // about them (v1beta1 `topology`, v1 `zone` and `nodeName`) is all
        // there is, as it was all kube-proxy 1.17-1.21 ever read.
        let region = |ep: Endpoint, r: &str| ep.topo(&[(REGION, r)]);
        run(vec![
            Case {
                name: "zone from the slice's zone of an endpoint on an unknown node",
                svc: svc().keys(&[LABEL_HOSTNAME, LABEL_ZONE, "*"]),
                nodes: k8s_nodes(),
                this: "n3",
                eps: vec![ep(1, "ghost").zone("90002"), ep(2, "ghost").zone("90001"), ep(3, "n1")],
                model: Model::TopologyKeys,
                cluster: vec![0],
                says: vec!["none in kubernetes.io/hostname=n3; 1 in topology.kubernetes.io/zone=90002"],
                ..Default::default()
            },
            Case {
                name: "any reported label, here the region",
                svc: svc().keys(&[LABEL_ZONE, REGION]),
                nodes: k8s_nodes(),
                this: "n5",
                eps: vec![region(ep(1, "ghost"), "cd"), region(ep(2, "ghost"), "us"), ep(3, "n1")],
                model: Model::TopologyKeys,
                // n1 is a known node in region cd too.
                cluster: vec![0, 2],
                says: vec!["none in topology.kubernetes.io/zone=90003; 2 in topology.kubernetes.io/region=cd"],
                ..Default::default()
            },
            Case {
                name: "nodeName stands for the hostname label of an unknown node",
                svc: svc().keys(&[LABEL_HOSTNAME]),
                nodes: vec![node("edge", &[]), node("n1", &[(LABEL_HOSTNAME, "edge")])],
                this: "n1",
                eps: vec![ep(1, "gone"), ep(2, "edge")],
                model: Model::TopologyKeys,
                // "edge" is known and has no hostname label: no match; the
                // unknown "gone" reports its name, which is not "edge".
                cluster: vec![],
                ..Default::default()
            },
            Case {
                name: "a reported hostname label that differs from nodeName is that label",
                svc: svc().keys(&[LABEL_HOSTNAME]),
                nodes: vec![node("n1", &[(LABEL_HOSTNAME, "host-1")])],
                this: "n1",
                eps: vec![ep(1, "n1.example").topo(&[(LABEL_HOSTNAME, "host-1")]), ep(2, "host-1.example")],
                model: Model::TopologyKeys,
                cluster: vec![0],
                ..Default::default()
            },
            Case {
                name: "a known Node's labels win over what the slice reported",
                svc: svc().keys(&[LABEL_ZONE, "*"]),
                nodes: k8s_nodes(),
                this: "n1",
                // n3 moved from zone 90001 (as the slice still says) to 90002.
                eps: vec![ep(1, "n3").zone("90001").topo(&[(REGION, "cd")]), ep(2, "n2")],
                model: Model::TopologyKeys,
                cluster: vec![1],
                ..Default::default()
            },
            Case {
                name: "OpenYurt's node pool of an unknown node is read the same way",
                svc: svc().ann(ANNOTATION_OPENYURT_TOPOLOGY_KEYS, "openyurt.io/nodepool"),
                nodes: vec![node("n1", &[(LABEL_OPENYURT_NODEPOOL, "hangzhou")])],
                this: "n1",
                eps: vec![ep(1, "ghost").topo(&[(LABEL_OPENYURT_NODEPOOL, "hangzhou")]), ep(2, "ghost")],
                model: Model::OpenYurt,
                cluster: vec![0],
                ..Default::default()
            },
        ]);
    }

    #[test]
    fn validation_messages() {
        let v = |keys: &[&str], etp: bool| {
            let keys: Vec<String> = keys.iter().map(std::string::ToString::to_string).collect();
            validate_topology_keys("spec.topologyKeys", &keys, etp)
        };
        assert!(v(&[LABEL_HOSTNAME, LABEL_ZONE, REGION, "*"], false).is_empty());
        assert!(v(&["rack", "example.com/My_Rack.1", "*"], false).is_empty());
        assert!(v(&[], true).is_empty(), "no keys, nothing to forbid");
        assert_eq!(
            v(&["*", "a"], false),
            vec!["spec.topologyKeys[0]: Invalid value: \"*\": \"*\" must be the last value specified".to_string()]
        );
        assert_eq!(v(&["a", "a"], false), vec!["spec.topologyKeys[1]: Duplicate value: \"a\"".to_string()]);
        assert_eq!(
            v(&["a"], true),
            vec!["spec.topologyKeys: Forbidden: may not be specified when `externalTrafficPolicy=Local`".to_string()]
        );
        let many: Vec<String> = (0..17).map(|i| format!("k{i}")).collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        assert_eq!(v(&many, false), vec!["spec.topologyKeys: Too many: 17: must have at most 16 items".to_string()]);
        assert_eq!(v(&many[..16], false), Vec::<String>::new());
        for bad in ["", "-a", "a-", "a b", "/a", "a/", "Upper.Case/a", "a/b/c", "a..b/c", "-a.com/b", "a.com-/b"] {
            assert!(!qualified_name_errors(bad).is_empty(), "{bad:?} should be invalid");
        }
        for good in ["a", "A", "a.b_c-d", "example.com/a", "a1-b.c2/Z", "9"] {
            assert!(qualified_name_errors(good).is_empty(), "{good:?} should be valid: {:?}", qualified_name_errors(good));
        }
        assert!(!qualified_name_errors(&format!("{}/a", "a".repeat(254))).is_empty());
        assert!(KeySource::Annotation.label().ends_with(ANNOTATION_TOPOLOGY_KEYS));
        assert_eq!(KeySource::Annotation.path(), format!("metadata.annotations[{ANNOTATION_TOPOLOGY_KEYS}]"));
    }
}
