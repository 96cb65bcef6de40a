//! `explain` against `run` over the same objects, for every topology
//! model (issue #47): `explain` scopes the manifests' Nodes as `run`'s
//! Node watch lists them (`sync::explain_input`) and decides in one pass;
//! `run` is played here as it meets an API server: the Services and
//! slices listed, or arriving by watch after a first sync without them,
//! the other Nodes listed as the watch would (`node_labels_delta`, the
//! watch's own conversion) once the sync loop says what it needs, and a
//! pass after each step. Both must end with the same decisions and maps,
//! and no pass of `run` may program a frontend with another set than the
//! one it ends with (`decide::label_wait`: hold, don't guess).

use std::time::Duration;

use super::*;
use crate::decide::label_wait::Listed;
use crate::model::store::{Delta, Kind, Model, Object};
use crate::model::{Node, Protocol};
use crate::source::node_scope;

const OWN: &str = "me";

/// This node and three others: (name, zone, region, pool, rack).
const NODES: [(&str, &str, &str, &str, &str); 4] =
    [("me", "z1", "r1", "p1", "k1"), ("a", "z1", "r1", "p1", "k1"), ("b", "z2", "r1", "p2", "k2"), ("c", "z3", "r2", "p2", "k2")];

fn nodes_yaml() -> String {
    NODES
        .iter()
        .map(|(n, z, r, p, k)| {
            format!(
                "kind: Node\nmetadata: {{name: {n}, labels: {{kubernetes.io/hostname: {n}, topology.kubernetes.io/zone: {z}, topology.kubernetes.io/region: {r}, apps.openyurt.io/nodepool: {p}, example.com/rack: {k}}}}}\n---\n"
            )
        })
        .collect()
}

/// A Service `web` with `spec` fields and `annotations`, and one slice
/// with `endpoints`.
fn objects(spec: &str, annotations: &str, endpoints: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: web, annotations: {{{annotations}}}}}\nspec: {{clusterIP: 10.96.0.10, ports: [{{port: 80}}]{spec}}}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: web-1, labels: {{kubernetes.io/service-name: web}}}}\naddressType: IPv4\nports: [{{port: 8080}}]\nendpoints: [{endpoints}]\n"
    )
}

/// One endpoint 10.244.0.`n` on `node`, with `extra` fields.
fn ep(n: u8, node: &str, extra: &str) -> String {
    format!("{{addresses: [10.244.0.{n}], nodeName: {node}{extra}}}")
}

fn zoned(n: u8, node: &str) -> String {
    let zone = NODES.iter().find(|x| x.0 == node).map_or("", |x| x.1);
    ep(n, node, &format!(", zone: {zone}"))
}

/// What a decision says, to compare.
type Said = Vec<(String, u16, &'static str, Vec<Backend>, Vec<Backend>)>;

fn said(pass: &CachedSync) -> Said {
    let mut v: Said = pass.decisions().map(|d| (d.service.to_string(), d.port.port, d.model, d.cluster.clone(), d.local.clone())).collect();
    v.sort();
    v
}

fn state(maps: &MemoryMaps) -> BTreeMap<Frontend, Vec<Backend>> {
    maps.state_entries().map(|(fe, b)| (fe, b.to_vec())).collect()
}

/// `explain --manifests`: the manifests scoped, one pass.
fn explain(yaml: &str) -> (Said, BTreeMap<Frontend, Vec<Backend>>, Vec<String>) {
    let read = crate::source::manifest_watch::read_text(yaml);
    assert!(read.errors.is_empty(), "{:?}", read.errors);
    let scoped = crate::sync::explain_input::scope_manifest_deltas(read.deltas.into_values(), OWN);
    let mut model = Model::default();
    model.apply(scoped.deltas);
    let mut pass = CachedSync::new(OWN);
    let mut maps = MemoryMaps::default();
    pass.pass(&mut maps, None, &model.cluster, &Changes { all: true, ..Changes::default() }, true);
    (said(&pass), state(&maps), scoped.notes)
}

/// The other-Node watch: what it has listed, and the Nodes as the API
/// server would serve them (whole; the watch keeps what it keeps).
struct NodeWatch {
    all: Vec<Node>,
    watching: Option<OtherNodes>,
}

impl NodeWatch {
    /// Relists for `needed` if it changes what is watched (as
    /// `kube_watch::watch_nodes`): the Node deltas, and what was listed.
    fn relist(&mut self, needed: &OtherNodes, model: &Model) -> Option<(Vec<Delta>, Listed)> {
        let w = node_scope::watched(needed);
        if w == self.watching {
            return None;
        }
        self.watching = w;
        let mut deltas = Vec::new();
        for n in &self.all {
            if !node_scope::selects(self.watching.as_ref(), &n.labels) {
                if model.cluster.nodes.contains_key(&n.name) {
                    deltas.push(Delta::removed(Kind::Node, ObjectRef::new("", n.name.clone())));
                }
                continue;
            }
            let labels: BTreeMap<&str, &str> = n.labels.iter().map(|(k, v)| (&**k, &**v)).collect();
            let meta: kube::core::PartialObjectMeta<crate::source::wire::WireNode> = serde_json::from_value(serde_json::json!({
                "apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
                "metadata": {"name": n.name, "labels": labels, "resourceVersion": "1"},
            }))
            .expect("PartialObjectMetadata");
            let keep = self.watching.as_ref().map(|w| w.labels.clone()).unwrap_or_default();
            deltas.push(crate::source::delta::node_labels_delta(meta, &keep));
        }
        let listed = self.watching.clone().unwrap_or(OtherNodes { labels: BTreeSet::new(), names: Some(BTreeSet::new()) });
        Some((deltas, Listed::Only(listed)))
    }
}

/// `run` against an API server that holds `yaml`: with `by_watch`, a
/// first sync sees only this node's Node and the Services and slices
/// arrive by watch; else they are in the first list. After each pass,
/// `check` sees the maps.
fn run(yaml: &str, by_watch: bool, mut check: impl FnMut(&str, &MemoryMaps)) -> (Said, BTreeMap<Frontend, Vec<Backend>>) {
    let read = crate::source::manifest_watch::read_text(yaml);
    let (mut others, mut own, mut rest) = (Vec::new(), Vec::new(), Vec::new());
    for d in read.deltas.into_values() {
        match (&d.kind, &d.object) {
            (Kind::Node, Some(Object::Node(n))) if n.name != OWN => others.push(n.clone()),
            (Kind::Node, _) => own.push(d),
            _ => rest.push(d),
        }
    }
    let mut watch = NodeWatch { all: others, watching: None };
    let mut model = Model::default();
    let mut pass = CachedSync::new(OWN).with_label_wait(Duration::from_secs(10));
    pass.set_listed(Listed::Only(OtherNodes { labels: BTreeSet::new(), names: Some(BTreeSet::new()) }));
    let mut maps = MemoryMaps::default();
    let at = Instant::now();
    model.apply(own);
    if !by_watch {
        model.apply(std::mem::take(&mut rest));
    }
    // Before the Nodes' listing, the sync loop says what it needs of
    // other Nodes (`node_labels_needed`), and the watch lists them.
    let needed = crate::decide::topology::node_labels_needed(&model.cluster, OWN);
    if let Some((deltas, listed)) = watch.relist(&needed, &model) {
        model.apply(deltas);
        pass.set_listed(listed);
    }
    pass.pass_at(&mut maps, None, &model.cluster, &Changes { all: true, ..Changes::default() }, true, at);
    check("first sync", &maps);
    if by_watch {
        let changes = model.apply(std::mem::take(&mut rest));
        pass.pass_at(&mut maps, None, &model.cluster, &changes, false, at);
        check("the Service and its slice by watch", &maps);
    }
    // After each pass the sync loop publishes what it needs; the watch
    // relists when that changes what it watches.
    for round in 0..4 {
        let needed = pass.other_nodes_needed(&model.cluster);
        let Some((deltas, listed)) = watch.relist(&needed, &model) else { break };
        let changes = model.apply(deltas);
        pass.set_listed(listed);
        pass.pass_at(&mut maps, None, &model.cluster, &changes, false, at);
        check(&format!("relist {round}"), &maps);
    }
    assert!(pass.waiting().is_empty(), "still waiting: {:?}", pass.waiting());
    (said(&pass), state(&maps))
}

#[test]
fn explain_decides_as_run_for_every_model() {
    let yurt = "openyurt.io/topologyKeys: openyurt.io/nodepool";
    let keys = |k: &str| format!("topoproxy.io/topology-keys: \"{k}\"");
    let e3 = |f: fn(u8, &str) -> String| [f(1, "a"), f(2, "b"), f(3, "c")].join(", ");
    let bare = |n: u8, node: &str| ep(n, node, "");
    let backend = |n: u8| Backend { ip: format!("10.244.0.{n}").parse().unwrap(), port: 8080 };
    // (name, Service fields, annotations, endpoints, model, cluster set)
    type Case = (&'static str, String, String, String, &'static str, Vec<u8>);
    let cases: Vec<Case> = vec![
        ("no topology", String::new(), String::new(), e3(zoned), "Cluster", vec![1, 2, 3]),
        ("region key", String::new(), keys("topology.kubernetes.io/region, *"), e3(zoned), "TopologyKeys", vec![1, 2]),
        ("custom key", String::new(), keys("example.com/rack, *"), e3(zoned), "TopologyKeys", vec![1]),
        ("zone key, slices with zone", String::new(), keys("topology.kubernetes.io/zone, *"), e3(zoned), "TopologyKeys", vec![1]),
        ("zone key, slices without zone", String::new(), keys("topology.kubernetes.io/zone, *"), e3(bare), "TopologyKeys", vec![1]),
        (
            "spec.topologyKeys, region",
            ", topologyKeys: [topology.kubernetes.io/region]".into(),
            String::new(),
            e3(zoned),
            "TopologyKeys",
            vec![1, 2],
        ),
        ("OpenYurt node pool", String::new(), yurt.into(), e3(zoned), "OpenYurt", vec![1]),
        (
            "hints for nodes",
            ", trafficDistribution: PreferSameNode".into(),
            String::new(),
            [
                ep(1, "me", ", zone: z1, hints: {forNodes: [{name: me}], forZones: [{name: z1}]}"),
                ep(2, "b", ", zone: z2, hints: {forNodes: [{name: b}], forZones: [{name: z2}]}"),
            ]
            .join(", "),
            "HintsNode",
            vec![1],
        ),
        (
            "hints for zones",
            ", trafficDistribution: PreferClose".into(),
            String::new(),
            [ep(1, "a", ", zone: z1, hints: {forZones: [{name: z1}]}"), ep(2, "b", ", zone: z2, hints: {forZones: [{name: z2}]}")]
                .join(", "),
            "HintsZone",
            vec![1],
        ),
        (
            "trafficDistribution PreferSameNode, no hints: every endpoint, as kube-proxy",
            ", trafficDistribution: PreferSameNode".into(),
            String::new(),
            [bare(1, "me"), bare(2, "a"), bare(3, "b")].join(", "),
            "Cluster",
            vec![1, 2, 3],
        ),
        (
            "trafficDistribution PreferClose, no hints, slices with zone: every endpoint",
            ", trafficDistribution: PreferClose".into(),
            String::new(),
            e3(zoned),
            "Cluster",
            vec![1, 2, 3],
        ),
        (
            "trafficDistribution PreferClose, no hints, slices without zone: every endpoint",
            ", trafficDistribution: PreferClose".into(),
            String::new(),
            e3(bare),
            "Cluster",
            vec![1, 2, 3],
        ),
    ];
    let fe = Frontend { ip: "10.96.0.10".parse().unwrap(), port: 80, protocol: Protocol::Tcp };
    for (name, spec, annotations, endpoints, model, want) in cases {
        let yaml = nodes_yaml() + &objects(&spec, &annotations, &endpoints);
        let (said_explain, maps_explain, _notes) = explain(&yaml);
        let want: Vec<Backend> = want.into_iter().map(backend).collect();
        assert_eq!(said_explain.first().map(|s| s.2), Some(model), "{name}: explain's model ({said_explain:?})");
        assert_eq!(said_explain.first().map(|s| s.3.clone()), Some(want.clone()), "{name}: explain's set");
        for by_watch in [false, true] {
            let mut never_wrong = |step: &str, maps: &MemoryMaps| {
                if let Some(set) = maps.backends_of(&fe) {
                    assert_eq!(set, want.as_slice(), "{name} (by watch: {by_watch}), {step}: programmed another set");
                }
            };
            let (said_run, maps_run) = run(&yaml, by_watch, &mut never_wrong);
            assert_eq!(said_run, said_explain, "{name} (by watch: {by_watch}): run and explain decide apart");
            assert_eq!(maps_run, maps_explain, "{name} (by watch: {by_watch}): run and explain program apart");
        }
    }
}
