//! Which Node labels the pass says it needs (`node_labels_needed`), as
//! Services that rank endpoints by them come and go.

use super::*;

/// Nodes `a` and `b` in `region`, and unless `deleted`, a Service ranked
/// by region (which its v1 slice does not carry).
fn cluster(region: &str, deleted: bool) -> Cluster {
    let mut yaml = format!(
        "kind: Node\nmetadata: {{name: a, labels: {{topology.kubernetes.io/region: {region}, kubernetes.io/hostname: a}}}}\n---\nkind: Node\nmetadata: {{name: b, labels: {{topology.kubernetes.io/region: {region}, kubernetes.io/hostname: b}}}}\n"
    );
    if !deleted {
        yaml.push_str("---\napiVersion: v1\nkind: Service\nmetadata: {name: regional, annotations: {topoproxy.io/topology-keys: \"topology.kubernetes.io/region, *\"}}\nspec: {clusterIP: 10.96.0.10, ports: [{port: 80}]}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: regional-1, labels: {kubernetes.io/service-name: regional}}\naddressType: IPv4\nports: [{port: 8080}]\nendpoints: [{addresses: [10.244.0.1], nodeName: a}, {addresses: [10.244.0.2], nodeName: b}]\n");
    }
    let (c, e) = crate::source::manifest_watch::cluster_from_text(&yaml);
    assert!(e.is_empty(), "{e:?}");
    c
}

/// A Service deleted in the pass that also takes a Node label change
/// (which decides everything again) takes its needs with it.
#[test]
fn a_deleted_service_needs_no_labels_even_in_a_full_update() {
    let mut pass = CachedSync::new("a");
    let mut maps = MemoryMaps::default();
    let c = cluster("r1", false);
    pass.pass(&mut maps, None, &c, &Changes { all: true, ..Changes::default() }, true);
    assert_eq!(pass.node_labels_needed(), ["topology.kubernetes.io/region".to_string()].into());
    // Only the other Node hosting an endpoint is watched, by name.
    let want = OtherNodes { labels: pass.node_labels_needed(), names: Some(["b".to_string()].into()) };
    assert_eq!(pass.other_nodes_needed(&c), want);
    assert_eq!(crate::decide::topology::node_labels_needed(&c, "a"), want, "the first sync's view agrees");
    let changes = Changes { all: true, services: [ObjectRef::new("default", "regional")].into(), ..Changes::default() };
    let c = cluster("r2", true);
    pass.pass(&mut maps, None, &c, &changes, false);
    assert!(pass.node_labels_needed().is_empty(), "{:?}", pass.node_labels_needed());
    assert!(!pass.other_nodes_needed(&c).any());
}
