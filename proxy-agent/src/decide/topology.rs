//! Ranking a Service's endpoints for one node. Pure: no kube, aya or tokio.
//!
//! [`rank`] decides which of a Service port's endpoints this node sends
//! cluster-policy traffic to (`cluster`) and which it sends local-policy
//! traffic to (`local`), following the models Kubernetes and OpenYurt have
//! shipped, in this order of precedence:
//!
//! 1. A topology key list, hard constraints in priority order (Service
//!    Topology, Kubernetes 1.17-1.21). It comes from the first of
//!    `spec.topologyKeys`, this project's [`ANNOTATION_TOPOLOGY_KEYS`]
//!    annotation, or OpenYurt's [`ANNOTATION_OPENYURT_TOPOLOGY_KEYS`]
//!    annotation (OpenYurt's own meaning, see [`rank_openyurt`]).
//! 2. EndpointSlice hints as today's kube-proxy reads them
//!    (`pkg/proxy/topology.go`: `CategorizeEndpoints`,
//!    `topologyModeFromHints`, `availableForTopology`).
//! 3. `spec.trafficDistribution` derived from the endpoints' node and zone
//!    when the control plane wrote no hints (e.g. a control plane without
//!    the controller that writes them).
//! 4. Otherwise every usable endpoint, cluster-wide.
//!
//! Independently of all that, `local` is the node-local usable endpoints
//! (internal/externalTrafficPolicy: Local): kube-proxy never applies
//! topology to them.
//!
//! "Usable" is kube-proxy's rule (KEP-1669, `CategorizeEndpoints`): ready
//! endpoints; when a set has none, the ones that are serving and
//! terminating, decided for `cluster` and `local` independently.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use crate::model::{Endpoint, Node, Service};

/// Well-known node label carrying the node's hostname.
pub(crate) const LABEL_HOSTNAME: &str = "kubernetes.io/hostname";
/// Well-known node label carrying the node's zone; kube-proxy reads the
/// node's zone from it (`v1.LabelTopologyZone`).
pub(crate) const LABEL_ZONE: &str = "topology.kubernetes.io/zone";
/// The catch-all topology key (`v1.TopologyKeyAny`).
pub(crate) const TOPOLOGY_KEY_ANY: &str = "*";
/// `core.MaxServiceTopologyKeys`.
pub(crate) const MAX_TOPOLOGY_KEYS: usize = 16;
/// This project's annotation: a comma-separated topology key list with the
/// meaning of `spec.topologyKeys`, for clusters whose API server no longer
/// accepts the field (it left the API in 1.22).
pub(crate) const ANNOTATION_TOPOLOGY_KEYS: &str = "topoproxy.io/topology-keys";
/// OpenYurt's Service annotation (`AnnotationServiceTopologyKey` in
/// openyurt `pkg/yurthub/filter/servicetopology`).
pub(crate) const ANNOTATION_OPENYURT_TOPOLOGY_KEYS: &str = "openyurt.io/topologyKeys";
/// OpenYurt annotation value meaning "same node".
pub(crate) const OPENYURT_VALUE_NODE: &str = "kubernetes.io/hostname";
/// OpenYurt annotation value meaning "same node pool" (historic spelling).
pub(crate) const OPENYURT_VALUE_ZONE: &str = "kubernetes.io/zone";
/// OpenYurt annotation value meaning "same node pool".
pub(crate) const OPENYURT_VALUE_NODEPOOL: &str = "openyurt.io/nodepool";
/// Node label naming the OpenYurt node pool a node belongs to
/// (`projectinfo.GetNodePoolLabel()`, formerly
/// `nodepoolv1alpha1.LabelCurrentNodePool`).
pub(crate) const LABEL_OPENYURT_NODEPOOL: &str = "apps.openyurt.io/nodepool";
/// Service annotation asking the EndpointSlice controller for zone hints.
pub(crate) const ANNOTATION_TOPOLOGY_MODE: &str = "service.kubernetes.io/topology-mode";
/// Legacy spelling of [`ANNOTATION_TOPOLOGY_MODE`] (1.21-1.26).
pub(crate) const ANNOTATION_TOPOLOGY_AWARE_HINTS: &str = "service.kubernetes.io/topology-aware-hints";

/// Which routing model decided the `cluster` set.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Model {
    /// No topology preference (or every preference fell back): every usable
    /// endpoint.
    Cluster,
    /// A topology key list (`spec.topologyKeys` or the
    /// `topoproxy.io/topology-keys` annotation) decided, including deciding
    /// that this node has no backends.
    TopologyKeys,
    /// OpenYurt's `openyurt.io/topologyKeys` annotation decided (same node
    /// or same node pool).
    OpenYurt,
    /// EndpointSlice `hints.forNodes` for this node (PreferSameNode).
    HintsNode,
    /// EndpointSlice `hints.forZones` for this node's zone (PreferSameZone,
    /// PreferClose, topology-mode Auto).
    HintsZone,
    /// `spec.trafficDistribution: PreferSameNode` without hints, derived from
    /// the endpoints' `nodeName`: endpoints on this node.
    TrafficDistributionNode,
    /// `spec.trafficDistribution` without hints, derived from the endpoints'
    /// zone: endpoints in this node's zone.
    TrafficDistributionZone,
}

impl Model {
    /// Every model, in declaration order.
    pub(crate) const ALL: [Model; 7] = [
        Model::Cluster,
        Model::TopologyKeys,
        Model::OpenYurt,
        Model::HintsNode,
        Model::HintsZone,
        Model::TrafficDistributionNode,
        Model::TrafficDistributionZone,
    ];

    /// Stable name, used in JSON output.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Model::Cluster => "Cluster",
            Model::TopologyKeys => "TopologyKeys",
            Model::OpenYurt => "OpenYurt",
            Model::HintsNode => "HintsNode",
            Model::HintsZone => "HintsZone",
            Model::TrafficDistributionNode => "TrafficDistributionNode",
            Model::TrafficDistributionZone => "TrafficDistributionZone",
        }
    }
}

impl fmt::Display for Model {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The outcome for one Service port on one node. Indices point into the
/// endpoint slice given to [`rank`], in ascending order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Ranking {
    pub model: Model,
    /// Endpoints for cluster-policy traffic.
    pub cluster: Vec<usize>,
    /// Endpoints for local-policy traffic (internal/externalTrafficPolicy: Local).
    pub local: Vec<usize>,
    /// Why, in words, for `explain` and logs.
    pub decision: String,
    /// Problems with the Service's topology configuration (reported with the
    /// Service's name by the caller; the ranking still falls back sensibly).
    pub problems: Vec<String>,
}

/// What the ranking needs to know about where it runs.
#[derive(Clone, Copy, Debug)]
pub struct NodeContext<'a> {
    pub name: &'a str,
    /// All known Nodes by name, this one included when known.
    pub nodes: &'a BTreeMap<String, Node>,
}

/// Ranks `endpoints` (all endpoints of one Service port) for the node
/// described by `node`.
pub(crate) fn rank(svc: &Service, endpoints: &[&Endpoint], node: NodeContext<'_>) -> Ranking {
    let view = View::new(endpoints, node);
    let mut problems = Vec::new();
    let mut notes = Vec::new();

    let (model, cluster, decision) = match constraint(svc, &mut problems, &mut notes) {
        Some(Constraint::Keys { source, keys }) => {
            let (cluster, decision) = rank_by_keys(&view, &source, &keys);
            (Model::TopologyKeys, cluster, decision)
        }
        Some(Constraint::OpenYurt(yurt)) => {
            let (cluster, decision) = rank_openyurt(&view, &yurt);
            (Model::OpenYurt, cluster, decision)
        }
        None => rank_by_preference(svc, &view, &mut problems),
    };

    // kube-proxy computes the Local-policy set from node-local endpoints
    // only, ignoring topology ("topology ignored for Local endpoints" in
    // pkg/proxy/topology_test.go), with its own terminating fallback.
    let local = usable(view.all(), |e| view.is_local(e));

    let mut parts = notes;
    parts.push(decision);
    if svc.internal_policy_local || svc.external_policy_local {
        parts.push(format!("local: {}", local.describe_on(view.node_name)));
    }

    Ranking { model, cluster: sorted_unique(cluster), local: local.indices, decision: parts.join("; "), problems }
}

/// Sorts and deduplicates a result (the tiers produce ascending indices
/// already; this keeps the documented guarantee whatever the path).
fn sorted_unique(mut v: Vec<usize>) -> Vec<usize> {
    v.sort_unstable();
    v.dedup();
    v
}

// ---------------------------------------------------------------------------
// The endpoints as seen from this node.
// ---------------------------------------------------------------------------

/// An endpoint with its index in the caller's slice.
type Indexed<'a> = (usize, &'a Endpoint);

struct View<'a> {
    endpoints: &'a [&'a Endpoint],
    node_name: &'a str,
    nodes: &'a BTreeMap<String, Node>,
    /// This node's labels; `None` when the node is unknown, in which case
    /// it has no label at all (as kube-proxy with empty node labels).
    labels: Option<&'a BTreeMap<String, String>>,
}

impl<'a> View<'a> {
    fn new(endpoints: &'a [&'a Endpoint], node: NodeContext<'a>) -> Self {
        View { endpoints, node_name: node.name, nodes: node.nodes, labels: node.nodes.get(node.name).map(|n| &n.labels) }
    }

    fn all(&self) -> Vec<Indexed<'a>> {
        self.endpoints.iter().copied().enumerate().collect()
    }

    /// This node's value for label `key`.
    fn node_label(&self, key: &str) -> Option<&'a str> {
        self.labels.and_then(|l| l.get(key)).map(String::as_str)
    }

    /// The value of label `key` on the Node an endpoint runs on. An endpoint
    /// without `nodeName`, or whose Node is unknown, has no labels.
    fn endpoint_label(&self, ep: &Endpoint, key: &str) -> Option<&'a str> {
        let node = self.nodes.get(ep.node_name.as_deref()?)?;
        node.labels.get(key).map(String::as_str)
    }

    fn is_local(&self, ep: &Endpoint) -> bool {
        ep.node_name.as_deref() == Some(self.node_name)
    }

    /// This node's zone; an empty label value is no zone (kube-proxy logs
    /// "node is missing label" for both).
    fn zone(&self) -> Option<&'a str> {
        self.node_label(LABEL_ZONE).filter(|z| !z.is_empty())
    }

    /// An endpoint's zone: the EndpointSlice's `zone`, which the EndpointSlice
    /// controller copies from the Node's zone label; when the slice does not
    /// carry it (hand-written manifests), the Node's label directly.
    fn endpoint_zone(&self, ep: &'a Endpoint) -> Option<&'a str> {
        match ep.zone.as_deref() {
            Some(z) if !z.is_empty() => Some(z),
            _ => self.endpoint_label(ep, LABEL_ZONE).filter(|z| !z.is_empty()),
        }
    }
}

/// The usable endpoints among a candidate set.
struct Usable {
    indices: Vec<usize>,
    /// No candidate was ready; `indices` are serving and terminating ones.
    terminating: bool,
}

impl Usable {
    fn describe_on(&self, node: &str) -> String {
        match (self.indices.len(), self.terminating) {
            (0, _) => format!("no usable endpoint on {node}"),
            (n, false) => format!("{n} ready on {node}"),
            (n, true) => format!("no ready endpoint on {node}, {n} serving terminating"),
        }
    }
}

/// Ready endpoints among the candidates `keep` accepts; when none is ready,
/// the ones that are serving and terminating (kube-proxy's fallback,
/// KEP-1669 / `CategorizeEndpoints`).
fn usable(candidates: Vec<Indexed<'_>>, keep: impl Fn(&Endpoint) -> bool) -> Usable {
    let pick =
        |f: &dyn Fn(&Endpoint) -> bool| -> Vec<usize> { candidates.iter().filter(|(_, e)| keep(e) && f(e)).map(|(i, _)| *i).collect() };
    let ready = pick(&|e| e.ready);
    if !ready.is_empty() {
        return Usable { indices: ready, terminating: false };
    }
    Usable { indices: pick(&|e| e.serving && e.terminating), terminating: true }
}

fn plural(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

// ---------------------------------------------------------------------------
// Where a topology key list comes from, and its validation.
// ---------------------------------------------------------------------------

enum Constraint {
    /// Kubernetes Service Topology keys, already validated.
    Keys { source: String, keys: Vec<String> },
    /// OpenYurt's service topology.
    OpenYurt(YurtTopology),
}

/// Finds the Service's topology key list: the first of `spec.topologyKeys`
/// (non-empty: "If this is not specified or empty, no topology constraints
/// will be applied"), [`ANNOTATION_TOPOLOGY_KEYS`],
/// [`ANNOTATION_OPENYURT_TOPOLOGY_KEYS`]. The first source present is the
/// one that counts: when it is invalid the Service gets no key-based
/// topology at all (the lower sources are not consulted), as if it had no
/// keys, until it is fixed.
fn constraint(svc: &Service, problems: &mut Vec<String>, notes: &mut Vec<String>) -> Option<Constraint> {
    let spec = svc.topology_keys.as_ref().filter(|k| !k.is_empty()).map(|k| (KeySource::Spec, k.clone()));
    let ours = svc
        .annotations
        .get(ANNOTATION_TOPOLOGY_KEYS)
        .map(|raw| raw.split(',').map(str::trim).filter(|k| !k.is_empty()).map(str::to_string).collect::<Vec<_>>())
        .filter(|k| !k.is_empty())
        .map(|k| (KeySource::Annotation, k));
    let yurt = svc.annotations.get(ANNOTATION_OPENYURT_TOPOLOGY_KEYS);

    let Some((source, keys)) = spec.or(ours) else {
        return parse_openyurt(yurt?, problems).map(Constraint::OpenYurt);
    };
    if source == KeySource::Spec && svc.annotations.contains_key(ANNOTATION_TOPOLOGY_KEYS) {
        notes.push(format!("annotation {ANNOTATION_TOPOLOGY_KEYS} ignored: spec.topologyKeys takes precedence"));
    }
    if yurt.is_some() {
        notes.push(format!("annotation {ANNOTATION_OPENYURT_TOPOLOGY_KEYS} ignored: {} takes precedence", source.label()));
    }
    let errors = validate_topology_keys(source.path(), &keys, svc.external_policy_local);
    if !errors.is_empty() {
        problems.push(format!("{} ignored until fixed: {}", source.label(), errors.join("; ")));
        notes.push(format!("{} is invalid and ignored (see problems)", source.label()));
        return None;
    }
    let source = format!("{} [{}]", source.label(), keys.join(", "));
    Some(Constraint::Keys { source, keys })
}

/// Where a Kubernetes-style topology key list was read from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum KeySource {
    Spec,
    Annotation,
}

impl KeySource {
    /// How the decision and problems name the list.
    fn label(self) -> &'static str {
        match self {
            KeySource::Spec => "spec.topologyKeys",
            KeySource::Annotation => "annotation topoproxy.io/topology-keys",
        }
    }

    /// The field path validation errors refer to.
    fn path(self) -> &'static str {
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
pub(crate) fn validate_topology_keys(path: &str, keys: &[String], external_policy_local: bool) -> Vec<String> {
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

// ---------------------------------------------------------------------------
// Kubernetes Service Topology (topologyKeys, 1.17-1.21).
// ---------------------------------------------------------------------------

/// Kubernetes' `FilterTopologyEndpoint` (pkg/proxy/topology.go, 1.17-1.21):
/// for each key in order, the endpoints whose Node has the same value for
/// that label as this node; the first key with a match wins. A key this node
/// lacks is skipped; an endpoint whose Node is unknown or lacks the label
/// does not match; `"*"` matches every endpoint. No match: no backends, the
/// connection is refused ("If this field is specified, but all entries have
/// no backends that match the topology of the client, the service has no
/// backends for that client and connections should fail").
///
/// A key matches only with an available endpoint (kube-proxy 1.17-1.19 kept
/// only ready endpoints in its endpoint cache, so the filter only ever saw
/// those): the tiers are tried over ready endpoints first. When no tier has a ready endpoint, they are tried
/// again over serving terminating endpoints: kube-proxy's fallback
/// (KEP-1669), but keeping the keys, which are hard constraints (a
/// `["kubernetes.io/hostname"]` Service must never reach another node).
fn rank_by_keys(view: &View<'_>, source: &str, keys: &[String]) -> (Vec<usize>, String) {
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

// ---------------------------------------------------------------------------
// OpenYurt service topology.
// ---------------------------------------------------------------------------

/// What an `openyurt.io/topologyKeys` annotation asks for.
struct YurtTopology {
    raw: String,
    node: bool,
    pool: bool,
    any: bool,
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
fn parse_openyurt(raw: &str, problems: &mut Vec<String>) -> Option<YurtTopology> {
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
fn rank_openyurt(view: &View<'_>, yurt: &YurtTopology) -> (Vec<usize>, String) {
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

// ---------------------------------------------------------------------------
// Hints and trafficDistribution (today's kube-proxy).
// ---------------------------------------------------------------------------

/// `spec.trafficDistribution` values (PreferClose is the older name of
/// PreferSameZone, KEP-4444 / KEP-3015).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Distribution {
    SameNode,
    SameZone,
}

fn traffic_distribution<'s>(svc: &'s Service, problems: &mut Vec<String>) -> Option<(Distribution, &'s str)> {
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

/// What, on the Service, asked the control plane for hints (for the
/// decision text only: kube-proxy follows hints whatever asked for them,
/// since the EndpointSlice controllers write them only when asked).
fn hints_requested_by(svc: &Service) -> Option<String> {
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

fn hinted_for(h: Option<&[std::sync::Arc<str>]>, name: &str) -> bool {
    h.is_some_and(|v| v.iter().any(|x| &**x == name))
}

/// No topology keys: kube-proxy's `CategorizeEndpoints` for the Cluster
/// set, then trafficDistribution derived without hints, else cluster-wide.
///
/// `topologyModeFromHints`, over ready endpoints only:
/// - no ready endpoint: no topology;
/// - every ready endpoint has a node hint and one is hinted for this node:
///   PreferSameNode (the endpoints hinted for this node);
/// - else every ready endpoint has a zone hint, this node has a zone and
///   one is hinted for it: PreferSameZone (the endpoints hinted for it);
/// - else no topology: every ready endpoint ("node in different zone, no
///   endpoint filtering", "missing hints, no filtering applied", "only
///   unready endpoints in same zone (should not filter)", "empty zone
///   label").
///
/// Then, if the cluster set has no ready endpoint, every serving terminating
/// endpoint, without topology ("we would already have chosen to ignore
/// topology if there were no ready endpoints for the given topology").
///
/// When no ready endpoint carries any hint at all and
/// `spec.trafficDistribution` is set, the same preference is derived from
/// the endpoints' `nodeName` and zone, as the control plane's
/// trafficDistribution controller would have hinted them (each endpoint for
/// its own node and zone). Incomplete hints are the control plane's call
/// and lead to cluster-wide, as in kube-proxy.
fn rank_by_preference(svc: &Service, view: &View<'_>, problems: &mut Vec<String>) -> (Model, Vec<usize>, String) {
    let td = traffic_distribution(svc, problems);
    let all = view.all();
    let ready: Vec<Indexed<'_>> = all.iter().copied().filter(|(_, e)| e.ready).collect();

    if ready.is_empty() {
        let u = usable(all, |_| true);
        let decision = if u.indices.is_empty() {
            "no usable endpoints".to_string()
        } else {
            format!(
                "no ready endpoints: {} cluster-wide (topology is not applied to the fallback, as in kube-proxy)",
                plural(u.indices.len(), "serving terminating endpoint", "serving terminating endpoints")
            )
        };
        return (Model::Cluster, u.indices, decision);
    }

    let zone = view.zone();
    let requested = hints_requested_by(svc).map(|r| format!(" ({r})")).unwrap_or_default();
    let select = |f: &dyn Fn(&Endpoint) -> bool| -> Vec<usize> { ready.iter().filter(|(_, e)| f(e)).map(|(i, _)| *i).collect() };
    let mut log = Vec::new();

    let node_hinted = ready.iter().filter(|(_, e)| has_hints(e.hint_nodes.as_deref())).count();
    let zone_hinted = ready.iter().filter(|(_, e)| has_hints(e.hint_zones.as_deref())).count();

    // PreferSameNode from hints (kube-proxy: behind the
    // PreferSameTrafficDistribution gate, on by default since it went beta).
    if node_hinted == ready.len() {
        let sel = select(&|e| hinted_for(e.hint_nodes.as_deref(), view.node_name));
        if !sel.is_empty() {
            log.push(format!("node hints{requested}: {} hinted for {}", sel.len(), view.node_name));
            return (Model::HintsNode, sel, log.join("; "));
        }
        log.push(format!("node hints ignored: none for {}", view.node_name));
    } else if node_hinted > 0 {
        log.push(format!("node hints ignored: missing on {} of {} ready endpoints", ready.len() - node_hinted, ready.len()));
    }

    if zone_hinted == ready.len() {
        match zone {
            None => log.push(format!("zone hints ignored: node lacks label {LABEL_ZONE}")),
            Some(z) => {
                let sel = select(&|e| hinted_for(e.hint_zones.as_deref(), z));
                if !sel.is_empty() {
                    log.push(format!("zone hints{requested}: {} hinted for zone {z}", sel.len()));
                    return (Model::HintsZone, sel, log.join("; "));
                }
                log.push(format!("zone hints ignored: none for zone {z}"));
            }
        }
    } else if zone_hinted > 0 {
        log.push(format!("zone hints ignored: missing on {} of {} ready endpoints", ready.len() - zone_hinted, ready.len()));
    }

    if let Some((dist, raw)) = td {
        if node_hinted > 0 || zone_hinted > 0 {
            log.push(format!("trafficDistribution {raw}: hints were written, not deriving"));
        } else {
            let mut tiers = Vec::new();
            if dist == Distribution::SameNode {
                let sel = select(&|e| view.is_local(e));
                if !sel.is_empty() {
                    tiers.push(format!("{} on this node {}", sel.len(), view.node_name));
                    log.push(format!("trafficDistribution {raw} (no hints; derived): {}", tiers.join("; ")));
                    return (Model::TrafficDistributionNode, sel, log.join("; "));
                }
                tiers.push(format!("none on this node {}", view.node_name));
            }
            match zone {
                None => tiers.push(format!("node lacks label {LABEL_ZONE}")),
                Some(z) => {
                    let sel = select(&|e| view.endpoint_zone(e) == Some(z));
                    if !sel.is_empty() {
                        tiers.push(format!("{} in zone {z}", sel.len()));
                        log.push(format!("trafficDistribution {raw} (no hints; derived): {}", tiers.join("; ")));
                        return (Model::TrafficDistributionZone, sel, log.join("; "));
                    }
                    tiers.push(format!("none in zone {z}"));
                }
            }
            log.push(format!("trafficDistribution {raw} (no hints; derived): {}", tiers.join("; ")));
        }
    }

    let sel = select(&|_| true);
    log.push(format!("{} cluster-wide", plural(sel.len(), "ready endpoint", "ready endpoints")));
    (Model::Cluster, sel, log.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{ObjectRef, ServiceType};
    use std::net::{IpAddr, Ipv4Addr};

    // ----- builders -----

    fn svc() -> Service {
        Service {
            id: ObjectRef::new("default", "svc1"),
            service_type: ServiceType::ClusterIp,
            cluster_ips: vec![IpAddr::V4(Ipv4Addr::new(10, 96, 0, 10))],
            ports: Vec::new(),
            topology_keys: None,
            annotations: BTreeMap::new(),
            internal_policy_local: false,
            external_policy_local: false,
            traffic_distribution: None,
            external_ips: Vec::new(),
            load_balancer_ips: Vec::new(),
            health_check_node_port: None,
        }
    }

    trait SvcExt {
        fn keys(self, keys: &[&str]) -> Self;
        fn ann(self, k: &str, v: &str) -> Self;
        fn td(self, v: &str) -> Self;
        fn itp_local(self) -> Self;
        fn etp_local(self) -> Self;
    }

    impl SvcExt for Service {
        fn keys(mut self, keys: &[&str]) -> Self {
            self.topology_keys = Some(keys.iter().map(std::string::ToString::to_string).collect());
            self
        }
        fn ann(mut self, k: &str, v: &str) -> Self {
            self.annotations.insert(k.to_string(), v.to_string());
            self
        }
        fn td(mut self, v: &str) -> Self {
            self.traffic_distribution = Some(v.to_string());
            self
        }
        fn itp_local(mut self) -> Self {
            self.internal_policy_local = true;
            self
        }
        fn etp_local(mut self) -> Self {
            self.external_policy_local = true;
            self.service_type = ServiceType::NodePort;
            self
        }
    }

    /// A ready endpoint 10.0.0.`n` on `node` (`""`: no nodeName).
    fn ep(n: u8, node: &str) -> Endpoint {
        Endpoint {
            address: IpAddr::V4(Ipv4Addr::new(10, 0, 0, n)),
            ready: true,
            serving: true,
            terminating: false,
            node_name: (!node.is_empty()).then(|| node.into()),
            zone: None,
            hint_zones: None,
            hint_nodes: None,
        }
    }

    trait EpExt {
        fn unready(self) -> Self;
        /// Not ready, serving, terminating.
        fn term(self) -> Self;
        /// Not ready, not serving, terminating.
        fn gone(self) -> Self;
        fn zone(self, z: &str) -> Self;
        fn zh(self, zones: &[&str]) -> Self;
        fn nh(self, nodes: &[&str]) -> Self;
    }

    impl EpExt for Endpoint {
        fn unready(mut self) -> Self {
            self.ready = false;
            self.serving = false;
            self
        }
        fn term(mut self) -> Self {
            self.ready = false;
            self.serving = true;
            self.terminating = true;
            self
        }
        fn gone(mut self) -> Self {
            self.ready = false;
            self.serving = false;
            self.terminating = true;
            self
        }
        fn zone(mut self, z: &str) -> Self {
            self.zone = Some(z.into());
            self
        }
        fn zh(mut self, zones: &[&str]) -> Self {
            self.hint_zones = Some(zones.iter().map(|z| (*z).into()).collect());
            self
        }
        fn nh(mut self, nodes: &[&str]) -> Self {
            self.hint_nodes = Some(nodes.iter().map(|z| (*z).into()).collect());
            self
        }
    }

    fn node(name: &str, labels: &[(&str, &str)]) -> Node {
        Node { name: name.to_string(), labels: labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect() }
    }

    const REGION: &str = "topology.kubernetes.io/region";

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

    struct Case {
        name: &'static str,
        svc: Service,
        nodes: Vec<Node>,
        this: &'static str,
        eps: Vec<Endpoint>,
        model: Model,
        cluster: Vec<usize>,
        local: Vec<usize>,
        /// How many problems are reported.
        problems: usize,
        /// Substrings the decision must contain.
        says: Vec<&'static str>,
    }

    impl Default for Case {
        fn default() -> Self {
            Case {
                name: "",
                svc: svc(),
                nodes: Vec::new(),
                this: "n1",
                eps: Vec::new(),
                model: Model::Cluster,
                cluster: Vec::new(),
                local: Vec::new(),
                problems: 0,
                says: Vec::new(),
            }
        }
    }

    fn run(cases: Vec<Case>) {
        for c in cases {
            let nodes: BTreeMap<String, Node> = c.nodes.into_iter().map(|n| (n.name.clone(), n)).collect();
            let refs: Vec<&Endpoint> = c.eps.iter().collect();
            let r = rank(&c.svc, &refs, NodeContext { name: c.this, nodes: &nodes });
            assert_eq!(r.model, c.model, "{}: model ({})", c.name, r.decision);
            assert_eq!(r.cluster, c.cluster, "{}: cluster ({})", c.name, r.decision);
            assert_eq!(r.local, c.local, "{}: local ({})", c.name, r.decision);
            assert_eq!(r.problems.len(), c.problems, "{}: problems {:?}", c.name, r.problems);
            for s in &c.says {
                assert!(r.decision.contains(s), "{}: decision {:?} lacks {:?}", c.name, r.decision, s);
            }
        }
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
                    e[2].hint_zones = None;
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
                    e[2].hint_zones = Some(Box::new([]));
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

    // ----- traffic policies and terminating endpoints (TestCategorizeEndpoints) -----

    #[test]
    fn policies_and_termination() {
        run(vec![
            Case {
                name: "internalTrafficPolicy: Local, with empty endpoints",
                svc: svc().itp_local(),
                says: vec!["local: no usable endpoint on n1"],
                ..Default::default()
            },
            Case {
                name: "internalTrafficPolicy: Local, but all endpoints are remote",
                svc: svc().itp_local(),
                eps: vec![ep(0, "x"), ep(1, "x")],
                cluster: vec![0, 1],
                local: vec![],
                ..Default::default()
            },
            Case {
                name: "internalTrafficPolicy: Local, all endpoints are local",
                svc: svc().itp_local(),
                eps: vec![ep(0, "n1"), ep(1, "n1")],
                cluster: vec![0, 1],
                local: vec![0, 1],
                ..Default::default()
            },
            Case {
                name: "internalTrafficPolicy: Local, some endpoints are local",
                svc: svc().itp_local(),
                eps: vec![ep(0, "n1"), ep(1, "x")],
                cluster: vec![0, 1],
                local: vec![0],
                ..Default::default()
            },
            Case {
                name: "Cluster traffic policy, endpoints not Ready",
                eps: vec![ep(0, "x").unready(), ep(1, "x").unready()],
                cluster: vec![],
                says: vec!["no usable endpoints"],
                ..Default::default()
            },
            Case {
                name: "Cluster traffic policy, some endpoints are Ready",
                eps: vec![ep(0, "x").unready(), ep(1, "x")],
                cluster: vec![1],
                ..Default::default()
            },
            Case {
                name: "Cluster traffic policy, all endpoints are terminating",
                eps: vec![ep(0, "n1").term(), ep(1, "x").term()],
                cluster: vec![0, 1],
                local: vec![0],
                says: vec!["no ready endpoints: 2 serving terminating endpoints cluster-wide"],
                ..Default::default()
            },
            Case {
                name: "terminating but not serving endpoints are never used",
                eps: vec![ep(0, "n1").gone(), ep(1, "x").gone()],
                cluster: vec![],
                local: vec![],
                ..Default::default()
            },
            Case {
                name: "iTP: Local, eTP: Cluster, some endpoints local",
                svc: svc().itp_local(),
                eps: vec![ep(0, "n1"), ep(1, "x")],
                cluster: vec![0, 1],
                local: vec![0],
                ..Default::default()
            },
            Case {
                name: "iTP: Cluster, eTP: Local, some endpoints local",
                svc: svc().etp_local(),
                eps: vec![ep(0, "n1"), ep(1, "x")],
                cluster: vec![0, 1],
                local: vec![0],
                ..Default::default()
            },
            Case {
                name: "iTP: Local, eTP: Local, all endpoints remote",
                svc: svc().itp_local().etp_local(),
                eps: vec![ep(0, "x"), ep(1, "x")],
                cluster: vec![0, 1],
                local: vec![],
                ..Default::default()
            },
            Case {
                name: "iTP: Local, eTP: Local, all endpoints remote and terminating",
                svc: svc().itp_local().etp_local(),
                eps: vec![ep(0, "x").term(), ep(1, "x").term()],
                cluster: vec![0, 1],
                local: vec![],
                ..Default::default()
            },
            Case {
                name: "iTP: Cluster, eTP: Local, with terminating endpoints",
                svc: svc().etp_local(),
                eps: vec![ep(0, "x"), ep(1, "n1").unready(), ep(2, "n1").term(), ep(3, "x").term()],
                cluster: vec![0],
                local: vec![2],
                says: vec!["local: no ready endpoint on n1, 1 serving terminating"],
                ..Default::default()
            },
            Case {
                name: "local ready endpoints win over local terminating ones",
                svc: svc().itp_local(),
                eps: vec![ep(0, "n1").term(), ep(1, "n1"), ep(2, "x")],
                cluster: vec![1, 2],
                local: vec![1],
                ..Default::default()
            },
            Case {
                name: "zone hints with no ready endpoints: terminating fallback ignores topology",
                nodes: vec![node("n1", &[(LABEL_ZONE, "zone-a")])],
                eps: vec![ep(0, "x").zh(&["zone-a"]).term(), ep(1, "x").zh(&["zone-b"]).term()],
                cluster: vec![0, 1],
                ..Default::default()
            },
        ]);
    }

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

    #[test]
    fn model_names_are_stable_and_unique() {
        let names: Vec<&str> = Model::ALL.iter().map(|m| m.as_str()).collect();
        assert_eq!(
            names,
            ["Cluster", "TopologyKeys", "OpenYurt", "HintsNode", "HintsZone", "TrafficDistributionNode", "TrafficDistributionZone"]
        );
        let unique: BTreeSet<&str> = names.iter().copied().collect();
        assert_eq!(unique.len(), names.len());
        assert_eq!(Model::HintsZone.to_string(), "HintsZone");
    }

    #[test]
    fn decision_reads_well() {
        let nodes: BTreeMap<String, Node> = [
            node("node-a", &[(LABEL_HOSTNAME, "node-a"), (LABEL_ZONE, "z1")]),
            node("node-b", &[(LABEL_HOSTNAME, "node-b"), (LABEL_ZONE, "z1")]),
            node("node-c", &[(LABEL_HOSTNAME, "node-c"), (LABEL_ZONE, "z2")]),
        ]
        .into_iter()
        .map(|n| (n.name.clone(), n))
        .collect();
        let eps = [ep(1, "node-b"), ep(2, "node-b"), ep(3, "node-c")];
        let refs: Vec<&Endpoint> = eps.iter().collect();
        let s = svc().keys(&[LABEL_HOSTNAME, LABEL_ZONE, REGION, "*"]);
        let r = rank(&s, &refs, NodeContext { name: "node-a", nodes: &nodes });
        assert_eq!(
            r.decision,
            "spec.topologyKeys [kubernetes.io/hostname, topology.kubernetes.io/zone, topology.kubernetes.io/region, *]: \
             none in kubernetes.io/hostname=node-a; 2 in topology.kubernetes.io/zone=z1"
        );
        assert_eq!(r.model.as_str(), "TopologyKeys");

        let s = svc().keys(&["*", LABEL_HOSTNAME]);
        let r = rank(&s, &refs, NodeContext { name: "node-a", nodes: &nodes });
        assert_eq!(r.problems.len(), 1);
        assert!(
            r.problems[0].starts_with("spec.topologyKeys ignored until fixed: spec.topologyKeys[0]: Invalid value"),
            "{:?}",
            r.problems
        );
        assert_eq!(r.decision, "spec.topologyKeys is invalid and ignored (see problems); 3 ready endpoints cluster-wide");
    }
}
