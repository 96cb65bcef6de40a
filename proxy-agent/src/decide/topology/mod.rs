//! Ranking a Service's endpoints for one node. Pure: no kube, aya or tokio.
//!
//! [`rank`] decides which of a Service port's endpoints this node sends
//! cluster-policy traffic to (`cluster`) and which it sends local-policy
//! traffic to (`local`), following the models Kubernetes and OpenYurt have
//! shipped, in this order of precedence:
//!
//! 1. A topology key list, hard constraints in priority order (Service
//!    Topology, KEP-536, Kubernetes 1.17-1.21; [`topology_keys`]). It comes
//!    from the first of `spec.topologyKeys`, this project's
//!    [`topology_keys::ANNOTATION_TOPOLOGY_KEYS`] annotation, or OpenYurt's
//!    [`openyurt::ANNOTATION_OPENYURT_TOPOLOGY_KEYS`] annotation (OpenYurt's
//!    own meaning, node pools; [`openyurt`]).
//! 2. EndpointSlice hints as today's kube-proxy reads them
//!    (`pkg/proxy/topology.go`: `CategorizeEndpoints`,
//!    `topologyModeFromHints`, `availableForTopology`; KEP-2433; [`hints`]).
//! 3. Otherwise every usable endpoint, cluster-wide. A Service's
//!    `spec.trafficDistribution` alone narrows nothing: kube-proxy follows
//!    only the hints the EndpointSlice controller writes for it
//!    ([`traffic_distribution`]).
//!
//! Independently of all that, `local` is the node-local usable endpoints
//! (internal/externalTrafficPolicy: Local): kube-proxy never applies
//! topology to them.
//!
//! "Usable" is kube-proxy's rule (KEP-1669, `CategorizeEndpoints`): ready
//! endpoints; when a set has none, the ones that are serving and
//! terminating, decided for `cluster` and `local` independently.
//!
//! This module holds what every model shares (the node's view of the
//! endpoints, the usable rule), picks the model and assembles the
//! [`Ranking`]; each model's own rule lives in its submodule.

mod hints;
mod openyurt;
pub(crate) mod spill;
mod spill_slots;
pub(crate) mod spill_tiers;
pub(crate) mod tier;
mod topology_keys;
mod traffic_distribution;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use crate::model::{Endpoint, Node, OtherNodes, Service};

use self::hints::Hints;
use self::openyurt::{ANNOTATION_OPENYURT_TOPOLOGY_KEYS, YurtTopology};
use self::topology_keys::{ANNOTATION_TOPOLOGY_KEYS, KeySource};

/// Well-known node label carrying the node's hostname. `spec.topologyKeys`
/// matches whatever label key it lists (`FilterTopologyEndpoint`) and
/// OpenYurt compares `nodeName`; the ranking names it only to read an
/// endpoint's `nodeName` as this label when the endpoint's Node is unknown
/// ([`View::endpoint_label`]).
pub(crate) const LABEL_HOSTNAME: &str = crate::model::LABEL_HOSTNAME;
/// Well-known node label carrying the node's zone; kube-proxy reads the
/// node's zone from it (`v1.LabelTopologyZone`).
pub(crate) const LABEL_ZONE: &str = crate::model::LABEL_ZONE;
/// The annotations that give a Service topology (this project's key list
/// and OpenYurt's).
pub(crate) const TOPOLOGY_ANNOTATIONS: [&str; 2] = [ANNOTATION_TOPOLOGY_KEYS, ANNOTATION_OPENYURT_TOPOLOGY_KEYS];
/// The catch-all topology key (`v1.TopologyKeyAny`), also accepted in
/// older OpenYurt annotation lists.
pub(crate) const TOPOLOGY_KEY_ANY: &str = "*";

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
}

impl Model {
    /// Every model, in declaration order; the tests check that the names
    /// [`Model::as_str`] gives stay stable and distinct.
    #[cfg(test)]
    pub(crate) const ALL: [Model; 5] = [Model::Cluster, Model::TopologyKeys, Model::OpenYurt, Model::HintsNode, Model::HintsZone];

    /// Stable name, used in JSON output.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Model::Cluster => "Cluster",
            Model::TopologyKeys => "TopologyKeys",
            Model::OpenYurt => "OpenYurt",
            Model::HintsNode => "HintsNode",
            Model::HintsZone => "HintsZone",
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
    /// The `proxy_common::tier` every connection to `cluster` counts in,
    /// when the topology chose it by one domain ([`tier::chosen`]); `None`:
    /// each backend's own physical tier.
    pub tier: Option<u8>,
    /// The share of the port's usable endpoints outside this node's zone,
    /// in `proxy_common::SHARE_ONE`ths ([`tier::blind_remote_share`]).
    pub blind_remote_share: u32,
    /// Graded spill-over between the tiers, when the Service asks for it
    /// ([`spill::ANNOTATION_TOPOLOGY_SPILL`]) and some tier has a ready
    /// endpoint: each tier's share and the backends' slot counts. `cluster`
    /// is then the endpoints it selected.
    pub spill: Option<spill_tiers::Spill>,
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

    let found = constraint(svc, &mut problems, &mut notes);
    let (model, cluster, decision) = match &found {
        Some(Constraint::Keys { source, keys }) => {
            let (cluster, decision) = topology_keys::rank_by_keys(&view, source, keys);
            (Model::TopologyKeys, cluster, decision)
        }
        Some(Constraint::OpenYurt(yurt)) => {
            let (cluster, decision) = openyurt::rank_openyurt(&view, yurt);
            (Model::OpenYurt, cluster, decision)
        }
        None => rank_by_preference(svc, &view, &mut problems),
    };
    let mut cluster = sorted_unique(cluster);
    let mut chosen = tier::chosen(&view, model, found.as_ref(), &cluster);
    let mut spill_notes = Vec::new();
    let spill = spill_for(svc, &view, model, found.as_ref(), &mut problems, &mut spill_notes);
    if let Some(s) = &spill {
        cluster.clone_from(&s.selected);
        // Spread over several tiers, each connection counts in its
        // backend's own tier, so the per-tier counters show the spill.
        if s.spreads {
            chosen = None;
        }
        spill_notes.push(s.describe());
    }

    // kube-proxy computes the Local-policy set from node-local endpoints
    // only, ignoring topology ("topology ignored for Local endpoints" in
    // pkg/proxy/topology_test.go), with its own terminating fallback.
    let local = usable(view.all(), |e| view.is_local(e));

    let mut parts = notes;
    parts.push(decision);
    parts.extend(spill_notes);
    if svc.internal_policy_local || svc.external_policy_local {
        parts.push(format!("local: {}", local.describe_on(view.node_name)));
    }

    let blind_remote_share = tier::blind_remote_share(&view);
    Ranking { model, cluster, local: local.indices, decision: parts.join("; "), problems, tier: chosen, blind_remote_share, spill }
}

/// Graded spill-over for this port, when the Service's annotation asks for
/// it and its model has tiers to grade: the topology keys, or a
/// `trafficDistribution` the hints decided. OpenYurt's annotation stays
/// strict, as yurthub's filter is. An invalid factor, or one that would
/// need too many slots, is reported in `problems` and the tiers stay
/// strict; an annotation without tiers to grade is noted in `notes`.
fn spill_for(
    svc: &Service,
    view: &View<'_>,
    model: Model,
    found: Option<&Constraint>,
    problems: &mut Vec<String>,
    notes: &mut Vec<String>,
) -> Option<spill_tiers::Spill> {
    use spill::ANNOTATION_TOPOLOGY_SPILL;
    let factor = match spill::annotated(&svc.annotations) {
        Ok(f) => f?,
        Err(e) => {
            problems.push(format!("annotation {ANNOTATION_TOPOLOGY_SPILL}: {e}; the tiers stay strict"));
            return None;
        }
    };
    let tiers = match (model, found) {
        (Model::TopologyKeys, Some(Constraint::Keys { keys, .. })) => spill_tiers::by_keys(view, keys),
        (Model::OpenYurt, _) => {
            // Worded without the annotation's name, so that the Event's
            // reason is InvalidTopology, not InvalidTopologyKeys (the key
            // list itself is fine).
            problems.push(format!(
                "annotation {ANNOTATION_TOPOLOGY_SPILL} ignored: OpenYurt's node-pool topology stays strict, as yurthub's filter is"
            ));
            return None;
        }
        (Model::HintsNode | Model::HintsZone, _) => {
            if traffic_distribution::parse(svc, &mut Vec::new()).is_none() {
                notes.push("spill not applied: the hints were not asked for by trafficDistribution".to_string());
                return None;
            }
            spill_tiers::by_hints(view, model == Model::HintsNode)
        }
        _ => {
            notes.push("spill not applied: no topology keys or trafficDistribution hints decided".to_string());
            return None;
        }
    };
    match spill_tiers::grade(view, &tiers, factor) {
        Ok(s) => s,
        Err(e) => {
            problems.push(format!("annotation {ANNOTATION_TOPOLOGY_SPILL}: {e}; the tiers stay strict"));
            None
        }
    }
}

/// The labels of other Nodes that ranking `svc` reads and that its
/// endpoints (`endpoints`, of every slice of the Service) do not report
/// themselves, so that the agent watches other Nodes (metadata only) just
/// for these, and only while some Service needs one (seed 004: a watch of
/// every Node costs every agent every kubelet's status report).
///
/// An endpoint carries its node's name (`kubernetes.io/hostname` when no
/// Node says otherwise) and zone in v1 EndpointSlices, and its hostname,
/// zone and region in v1beta1's `topology` map; hints and
/// `trafficDistribution` read only those. A topology key list reads any
/// label: region on v1 slices, or a custom label, needs the Nodes; so does
/// OpenYurt's node pool (`apps.openyurt.io/nodepool`). A key every endpoint
/// with a node reports in its `topology` needs nothing. An invalid key list
/// is ignored by the ranking, and needs nothing either.
///
/// The zone is read from the slices, and from the endpoint's Node where a
/// slice leaves it out ([`View::endpoint_zone`]: hand-written slices, or a
/// Node labelled after its slice was written). A key list naming the zone
/// therefore asks for the zone label too when some endpoint on a Node has
/// none in its slice, so that `run` reads the same zone `explain` finds on
/// the manifests' Nodes (issue #47).
pub(crate) fn other_node_labels(svc: &Service, endpoints: &[&Endpoint]) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let zone_missing = || {
        endpoints.iter().filter(|e| e.node_name.is_some()).any(|e| {
            e.zone.as_deref().is_none_or(str::is_empty) && e.topology().is_none_or(|t| t.get(LABEL_ZONE).is_none_or(|z| z.is_empty()))
        })
    };
    let constraint = constraint(svc, &mut Vec::new(), &mut Vec::new());
    // Only a key list reads endpoints' zones: trafficDistribution reads the
    // hints and this node's own zone (kube-proxy, pkg/proxy/topology.go),
    // OpenYurt the node pools.
    let reads_zone = matches!(&constraint, Some(Constraint::Keys { keys, .. }) if keys.iter().any(|k| k == LABEL_ZONE));
    if reads_zone && zone_missing() {
        out.insert(LABEL_ZONE.to_string());
    }
    match constraint {
        Some(Constraint::Keys { keys, .. }) => {
            for key in keys.into_iter().filter(|k| ![TOPOLOGY_KEY_ANY, LABEL_HOSTNAME, LABEL_ZONE].contains(&k.as_str())) {
                let reported =
                    endpoints.iter().filter(|e| e.node_name.is_some()).all(|e| e.topology().is_some_and(|t| t.contains_key(key.as_str())));
                let any = endpoints.iter().any(|e| e.node_name.is_some());
                if !(any && reported) {
                    out.insert(key);
                }
            }
        }
        Some(Constraint::OpenYurt(yurt)) if yurt.reads_pools() => {
            out.insert(openyurt::LABEL_OPENYURT_NODEPOOL.to_string());
        }
        Some(Constraint::OpenYurt(_)) | None => {}
    }
    out
}

/// Every label of the endpoints' Nodes that ranking `svc` can read,
/// whether or not its slices carry it: the keys of its key list (but `*`
/// and the hostname, which `nodeName` stands for), OpenYurt's node pool,
/// and the zone when it reads endpoints' zones. `explain` names those of
/// them that manifests carry and the Node watch would not.
pub(crate) fn labels_read(svc: &Service) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    match constraint(svc, &mut Vec::new(), &mut Vec::new()) {
        Some(Constraint::Keys { keys, .. }) => {
            out.extend(keys.into_iter().filter(|k| ![TOPOLOGY_KEY_ANY, LABEL_HOSTNAME].contains(&k.as_str())));
        }
        Some(Constraint::OpenYurt(yurt)) if yurt.reads_pools() => {
            out.insert(openyurt::LABEL_OPENYURT_NODEPOOL.to_string());
        }
        Some(Constraint::OpenYurt(_)) | None => {}
    }
    out
}

/// [`other_nodes_needed`] over every Service of `cluster`: what the agent
/// needs of other Nodes before its first sync, when no decision is cached
/// yet (`sync::pass::CachedSync` keeps it current after that).
pub(crate) fn node_labels_needed(cluster: &crate::model::Cluster, own: &str) -> OtherNodes {
    let mut slices: std::collections::HashMap<(&str, &str), Vec<&crate::model::EndpointSlice>> = std::collections::HashMap::new();
    for s in cluster.slices.values() {
        slices.entry((&*s.id.namespace, s.service_name.as_str())).or_default().push(s);
    }
    let mut needs = Vec::new();
    for svc in cluster.services.values() {
        let of = slices.get(&(&*svc.id.namespace, &*svc.id.name)).map(Vec::as_slice).unwrap_or_default();
        let endpoints: Vec<&Endpoint> = of.iter().flat_map(|s| s.endpoints.iter()).collect();
        let labels = other_node_labels(svc, &endpoints);
        if !labels.is_empty() {
            needs.push((labels, endpoint_nodes(&endpoints)));
        }
    }
    other_nodes_needed(needs.iter().map(|(l, n)| (l, n)), cluster.nodes.get(own), own)
}

/// At most this many Nodes are named in the other-Node watch's label
/// selector (`kubernetes.io/hostname in (...)`); beyond it every Node is
/// watched. The selector travels in the request line: 100 names of at
/// most 63 characters stay under the 8 KB that proxies in front of API
/// servers commonly accept, and a watch of every Node costs no more than
/// one of 100 named ones once a Service spans that much of the cluster.
pub(crate) const MAX_NAMED_NODES: usize = 100;

/// The Nodes that `endpoints` run on (`nodeName`).
pub(crate) fn endpoint_nodes(endpoints: &[&Endpoint]) -> BTreeSet<String> {
    endpoints.iter().filter_map(|e| e.node_name.as_deref()).map(str::to_string).collect()
}

/// What the source watches of other Nodes, from each Service that needs
/// labels: its labels ([`other_node_labels`]) and its endpoints' Nodes
/// ([`endpoint_nodes`]). A ranking compares this node's labels with those
/// of the endpoints' Nodes only, so only those Nodes are watched, selected
/// by their `kubernetes.io/hostname` label (an API server has no
/// set-based field selector on `metadata.name`): a watch of N Nodes
/// carries N of the cluster's status reports instead of all of them
/// (seed 004). Every Node is watched instead when the Nodes are too many
/// to name ([`MAX_NAMED_NODES`]), when a name cannot be a label value, or
/// when this node's hostname label differs from its name: such a cluster
/// names its Nodes apart from their hostnames (the kubelet's
/// `--hostname-override` left out), and a selector by hostname would miss
/// them (or carries none: Nodes not made by a kubelet). A Node labelled
/// apart from its name in a cluster whose other Nodes are not goes unseen:
/// its endpoints rank as in no zone, region or pool (README).
pub(crate) fn other_nodes_needed<'a>(
    needs: impl IntoIterator<Item = (&'a BTreeSet<String>, &'a BTreeSet<String>)>,
    own: Option<&Node>,
    own_name: &str,
) -> OtherNodes {
    let mut out = OtherNodes { labels: BTreeSet::new(), names: Some(BTreeSet::new()) };
    for (labels, nodes) in needs {
        out.labels.extend(labels.iter().cloned());
        if let Some(names) = &mut out.names {
            names.extend(nodes.iter().filter(|n| n.as_str() != own_name).cloned());
        }
    }
    // Not known yet (the first sync may come before this node's Node is
    // listed): assume the kubelet's default, hostname label = name.
    let hostname_differs = own.is_some_and(|n| n.labels.get(LABEL_HOSTNAME).is_none_or(|h| &**h != own_name));
    if out.names.as_ref().is_some_and(|n| n.len() > MAX_NAMED_NODES || !n.iter().all(|n| is_label_value(n))) || hostname_differs {
        out.names = None;
    }
    if out.labels.is_empty() {
        out.names = Some(BTreeSet::new());
    }
    out
}

/// A label value: at most 63 characters, alphanumerics with `-`, `_` and
/// `.` inside (apimachinery's `IsValidLabelValue`). Node names are DNS
/// subdomains of up to 253 characters, so a long one is not.
fn is_label_value(v: &str) -> bool {
    let b = v.as_bytes();
    let edge = |c: &u8| c.is_ascii_alphanumeric();
    b.len() <= 63
        && (b.is_empty()
            || (b.first().is_some_and(edge)
                && b.last().is_some_and(edge)
                && b.iter().all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))))
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
    labels: Option<&'a crate::model::NodeTopology>,
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
        self.labels.and_then(|l| l.get(key)).map(|v| &**v)
    }

    /// The value of label `key` on the Node an endpoint runs on.
    ///
    /// When the agent knows that Node, its own labels, which the Node
    /// watch keeps current. When it does not (a Node not listed yet, or
    /// never readable), the labels the endpoint's EndpointSlice reported
    /// for it, which is what kube-proxy 1.17-1.21 matched topology keys
    /// against (`FilterTopologyEndpoint` read `endpoint.Topology`, filled
    /// from discovery.k8s.io/v1beta1's `topology` map, pkg/proxy/topology.go):
    /// [`Endpoint::topology`], then `zone` as `topology.kubernetes.io/zone`
    /// and `nodeName` as `kubernetes.io/hostname`, the two labels v1 (and
    /// the API server's v1beta1 conversion) moved out of that map. An
    /// endpoint with neither a known Node nor reported labels has none.
    fn endpoint_label<'e>(&self, ep: &'e Endpoint, key: &str) -> Option<&'e str>
    where
        'a: 'e,
    {
        if let Some(node) = ep.node_name.as_deref().and_then(|n| self.nodes.get(n)) {
            return node.labels.get(key).map(|v| &**v);
        }
        if let Some(value) = ep.topology().and_then(|t| t.get(key)) {
            return Some(value);
        }
        match key {
            LABEL_ZONE => ep.zone.as_deref(),
            LABEL_HOSTNAME => ep.node_name.as_deref(),
            _ => None,
        }
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

/// The indices of the candidates `keep` accepts, in the candidates' order.
fn indices_where(candidates: &[Indexed<'_>], keep: impl Fn(&Endpoint) -> bool) -> Vec<usize> {
    candidates.iter().filter(|(_, e)| keep(e)).map(|(i, _)| *i).collect()
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
// Model selection.
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
    let yurt = svc.annotations.get(ANNOTATION_OPENYURT_TOPOLOGY_KEYS);

    let Some((source, keys)) = topology_keys::declared_keys(svc) else {
        return openyurt::parse_openyurt(yurt?, problems).map(Constraint::OpenYurt);
    };
    if source == KeySource::Spec && svc.annotations.contains_key(ANNOTATION_TOPOLOGY_KEYS) {
        notes.push(format!("annotation {ANNOTATION_TOPOLOGY_KEYS} ignored: spec.topologyKeys takes precedence"));
    }
    if yurt.is_some() {
        notes.push(format!("annotation {ANNOTATION_OPENYURT_TOPOLOGY_KEYS} ignored: {} takes precedence", source.label()));
    }
    let errors = topology_keys::validate_topology_keys(source.path(), &keys, svc.external_policy_local);
    if !errors.is_empty() {
        problems.push(format!("{} ignored until fixed: {}", source.label(), errors.join("; ")));
        notes.push(format!("{} is invalid and ignored (see problems)", source.label()));
        return None;
    }
    let source = format!("{} [{}]", source.label(), keys.join(", "));
    Some(Constraint::Keys { source, keys })
}

/// No topology keys: kube-proxy's `CategorizeEndpoints` for the Cluster
/// set. With no ready endpoint at all, every serving terminating endpoint,
/// without topology ("we would already have chosen to ignore topology if
/// there were no ready endpoints for the given topology"). Otherwise the
/// hints written on the EndpointSlices ([`hints::rank_by_hints`]); hints
/// that do not apply, and no hints at all, lead to every ready endpoint,
/// whatever `spec.trafficDistribution` says: kube-proxy never reads that
/// field (`topologyModeFromHints` looks at the endpoints' hints only), it
/// is the EndpointSlice controller's input.
fn rank_by_preference(svc: &Service, view: &View<'_>, problems: &mut Vec<String>) -> (Model, Vec<usize>, String) {
    let td = traffic_distribution::parse(svc, problems);
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

    let mut log = Vec::new();
    let by_hints = hints::rank_by_hints(svc, view, &ready, &mut log);
    if let Hints::Used(model, sel) = by_hints {
        return (model, sel, log.join("; "));
    }
    if let Some(raw) = td.filter(|_| by_hints == Hints::Absent) {
        log.push(traffic_distribution::without_hints(raw));
    }

    let sel = indices_where(&ready, |_| true);
    log.push(format!("{} cluster-wide", plural(sel.len(), "ready endpoint", "ready endpoints")));
    (Model::Cluster, sel, log.join("; "))
}

/// Builders and the table runner every model's tests share.
#[cfg(test)]
mod test_support;

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::test_support::{Case, EpExt, REGION, SvcExt, ep, node, run, svc};
    use super::*;

    /// Which other Nodes' labels a Service's ranking needs: (name, Service,
    /// its endpoints, labels).
    #[test]
    fn other_node_labels_are_those_the_slices_do_not_carry() {
        const YURT: &str = "openyurt.io/topologyKeys";
        const KEYS: &str = "topoproxy.io/topology-keys";
        let v1 = || vec![ep(0, "a").zone("z1"), ep(1, "b").zone("z2")];
        let v1beta1 = || vec![ep(0, "a").topo(&[(REGION, "r1")]), ep(1, "b").topo(&[(REGION, "r2")])];
        let cases: Vec<(&str, Service, Vec<Endpoint>, Vec<&str>)> = vec![
            ("no topology", svc(), v1(), vec![]),
            ("hostname, zone, *", svc().keys(&[LABEL_HOSTNAME, LABEL_ZONE, "*"]), v1(), vec![]),
            ("region on v1 slices", svc().keys(&[LABEL_HOSTNAME, REGION, "*"]), v1(), vec![REGION]),
            ("region on v1beta1 slices, which carry it", svc().keys(&[REGION, "*"]), v1beta1(), vec![]),
            (
                "region, one endpoint without it",
                svc().keys(&[REGION, "*"]),
                vec![ep(0, "a").topo(&[(REGION, "r1")]), ep(1, "b")],
                vec![REGION],
            ),
            ("region, no endpoint yet", svc().keys(&[REGION, "*"]), vec![], vec![REGION]),
            ("a custom label, from the annotation", svc().ann(KEYS, "example.com/rack, *"), v1(), vec!["example.com/rack"]),
            ("an invalid list is ignored", svc().keys(&["*", REGION]), v1(), vec![]),
            ("OpenYurt node pools", svc().ann(YURT, "openyurt.io/nodepool"), v1(), vec![openyurt::LABEL_OPENYURT_NODEPOOL]),
            ("OpenYurt, same node only", svc().ann(YURT, "kubernetes.io/hostname"), v1(), vec![]),
            ("hints and trafficDistribution read the slices", svc().td("PreferClose"), v1(), vec![]),
            (
                "trafficDistribution, a slice without zone: nothing (it reads only hints, as kube-proxy)",
                svc().td("PreferClose"),
                vec![ep(0, "a").zone("z1"), ep(1, "b")],
                vec![],
            ),
            ("zone key, a slice without zone", svc().keys(&[LABEL_ZONE, "*"]), vec![ep(0, "a"), ep(1, "b")], vec![LABEL_ZONE]),
            ("zone key, v1beta1 topology carries it", svc().keys(&[LABEL_ZONE, "*"]), vec![ep(0, "a").topo(&[(LABEL_ZONE, "z1")])], vec![]),
            ("no topology reads no zone", svc(), vec![ep(0, "a"), ep(1, "b")], vec![]),
            ("an endpoint on no Node has no Node to ask", svc().td("PreferClose"), vec![ep(0, "").zone("z1")], vec![]),
            ("internalTrafficPolicy Local reads nodeName", svc().itp_local(), v1(), vec![]),
        ];
        for (name, s, eps, want) in cases {
            let want: BTreeSet<String> = want.into_iter().map(str::to_string).collect();
            assert_eq!(other_node_labels(&s, &eps.iter().collect::<Vec<_>>()), want, "{name}");
        }
    }

    /// What to watch of other Nodes: (name, each Service's labels and
    /// endpoint Nodes, this node's hostname label, want: labels and names,
    /// `None` for every Node).
    #[test]
    fn other_nodes_are_the_endpoints_nodes_while_they_can_be_named() {
        let set = |v: &[&str]| v.iter().map(|s| (*s).to_string()).collect::<BTreeSet<String>>();
        let many: Vec<String> = (0..=MAX_NAMED_NODES).map(|i| format!("n{i}")).collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        let long = "x".repeat(64);
        type Case<'a> = (&'a str, Vec<(&'a [&'a str], Vec<&'a str>)>, Option<&'a str>, (&'a [&'a str], Option<Vec<&'a str>>));
        let cases: Vec<Case<'_>> = vec![
            ("no Service needs labels", vec![], Some("me"), (&[], Some(vec![]))),
            ("one region-keyed Service", vec![(&[REGION], vec!["a", "b"])], Some("me"), (&[REGION], Some(vec!["a", "b"]))),
            ("this node is left out", vec![(&[REGION], vec!["me", "a"])], Some("me"), (&[REGION], Some(vec!["a"]))),
            (
                "two Services: labels and Nodes joined",
                vec![(&[REGION], vec!["a"]), (&["rack"], vec!["b"])],
                Some("me"),
                (&["rack", REGION], Some(vec!["a", "b"])),
            ),
            ("this Node not listed yet: names assumed hostnames", vec![(&[REGION], vec!["a"])], None, (&[REGION], Some(vec!["a"]))),
            ("hostname label differs from the name", vec![(&[REGION], vec!["a"])], Some("me.example.com"), (&[REGION], None)),
            ("no hostname label", vec![(&[REGION], vec!["a"])], Some(""), (&[REGION], None)),
            ("too many to name", vec![(&[REGION], many.clone())], Some("me"), (&[REGION], None)),
            ("a name that is no label value", vec![(&[REGION], vec!["a", long.as_str()])], Some("me"), (&[REGION], None)),
            ("labels, no endpoint on a Node yet", vec![(&[REGION], vec![])], Some("me"), (&[REGION], Some(vec![]))),
        ];
        for (name, needs, hostname, (labels, names)) in cases {
            let needs: Vec<(BTreeSet<String>, BTreeSet<String>)> = needs.into_iter().map(|(l, n)| (set(l), set(&n))).collect();
            let own = hostname.map(|h| {
                let mut n = node("me", &[]);
                if !h.is_empty() {
                    n.labels.insert(LABEL_HOSTNAME.into(), h.into());
                }
                n
            });
            let got = other_nodes_needed(needs.iter().map(|(l, n)| (l, n)), own.as_ref(), "me");
            assert_eq!(got, OtherNodes { labels: set(labels), names: names.map(|n| set(&n)) }, "{name}");
            assert_eq!(got.any(), !labels.is_empty() && got.names.as_ref().is_none_or(|n| !n.is_empty()), "{name}");
        }
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

    #[test]
    fn model_names_are_stable_and_unique() {
        let names: Vec<&str> = Model::ALL.iter().map(|m| m.as_str()).collect();
        assert_eq!(names, ["Cluster", "TopologyKeys", "OpenYurt", "HintsNode", "HintsZone"]);
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
