//! Manifests scoped as `run`'s Node watch would list them.

use super::*;
use crate::model::Cluster;

/// Nodes me (this node), a, b and c, each with hostname, zone, region and
/// a rack label; Services and slices from `objects`.
fn scoped(objects: &str) -> (Cluster, Vec<String>) {
    let mut yaml = String::new();
    for (n, zone) in [("me", "z1"), ("a", "z1"), ("b", "z2"), ("c", "z2")] {
        yaml.push_str(&format!(
            "kind: Node\nmetadata: {{name: {n}, labels: {{kubernetes.io/hostname: {n}, topology.kubernetes.io/zone: {zone}, topology.kubernetes.io/region: r-{n}, example.com/rack: rack-{n}}}}}\n---\n"
        ));
    }
    yaml.push_str(objects);
    let read = crate::source::manifest_watch::read_text(&yaml);
    assert!(read.errors.is_empty(), "{:?}", read.errors);
    let s = scope_manifest_deltas(read.deltas.into_values(), "me");
    let mut model = crate::model::store::Model::default();
    model.apply(s.deltas);
    (model.cluster, s.notes)
}

fn service(name: &str, extra: &str) -> String {
    // A ClusterIP of its own per name length: the tests' names differ in it.
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}{extra}}}\nspec: {{clusterIP: 10.96.0.{}, ports: [{{port: 80}}]}}\n---\n",
        name.len()
    )
}

fn slice(service: &str, endpoints: &str) -> String {
    format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {service}-1, labels: {{kubernetes.io/service-name: {service}}}}}\naddressType: IPv4\nports: [{{port: 8080}}]\nendpoints: [{endpoints}]\n---\n"
    )
}

fn labels(c: &Cluster, node: &str) -> Option<Vec<String>> {
    c.nodes.get(node).map(|n| n.labels.keys().map(ToString::to_string).collect())
}

/// (name, objects, Nodes listed besides this one with the label keys kept,
/// substrings of the notes).
#[test]
fn other_nodes_are_what_the_watch_lists() {
    let region = ", annotations: {topoproxy.io/topology-keys: \"topology.kubernetes.io/region, *\"}";
    let rack_and_region = ", annotations: {topoproxy.io/topology-keys: \"example.com/rack, topology.kubernetes.io/region, *\"}";
    let zoned = "{addresses: [10.244.0.1], nodeName: a, zone: z1}, {addresses: [10.244.0.2], nodeName: b, zone: z2}";
    let unzoned = "{addresses: [10.244.0.1], nodeName: a}, {addresses: [10.244.0.2], nodeName: b}";
    let all4 = ["example.com/rack", "kubernetes.io/hostname", "topology.kubernetes.io/region", "topology.kubernetes.io/zone"];
    let kept3 = ["kubernetes.io/hostname", "topology.kubernetes.io/region", "topology.kubernetes.io/zone"];
    let zone2 = ["kubernetes.io/hostname", "topology.kubernetes.io/zone"];
    type Case<'a> = (&'a str, String, Vec<(&'a str, &'a [&'a str])>, Vec<&'a str>);
    let cases: Vec<Case<'_>> = vec![
        (
            "no topology: no other Node",
            service("plain", "") + &slice("plain", zoned),
            vec![],
            vec!["Nodes a, b, c left out", "no Service's topology needs"],
        ),
        (
            "region keys: the endpoints' Nodes, region and the labels always kept",
            service("regional", region) + &slice("regional", zoned),
            vec![("a", &kept3), ("b", &kept3)],
            vec!["Nodes c left out", "host no endpoint"],
        ),
        (
            "rack and region keys: both kept",
            service("racked", rack_and_region) + &slice("racked", zoned),
            vec![("a", &all4), ("b", &all4)],
            vec!["Nodes c left out"],
        ),
        (
            "trafficDistribution, slices with zone: no other Node",
            service("close", "").replace("ports: [{port: 80}]", "ports: [{port: 80}], trafficDistribution: PreferClose")
                + &slice("close", zoned),
            vec![],
            vec!["Nodes a, b, c left out"],
        ),
        (
            "trafficDistribution, slices without zone: no other Node (it reads only hints, as kube-proxy)",
            service("close", "").replace("ports: [{port: 80}]", "ports: [{port: 80}], trafficDistribution: PreferClose")
                + &slice("close", unzoned),
            vec![],
            vec!["Nodes a, b, c left out"],
        ),
        (
            "zone keys, slices without zone: the zone of the endpoints' Nodes",
            service("zonekeys", ", annotations: {topoproxy.io/topology-keys: \"topology.kubernetes.io/zone, *\"}")
                + &slice("zonekeys", unzoned),
            vec![("a", &zone2), ("b", &zone2)],
            vec!["Nodes c left out"],
        ),
    ];
    for (name, objects, want, notes) in cases {
        let (c, got_notes) = scoped(&objects);
        assert_eq!(labels(&c, "me").map(|l| l.len()), Some(4), "{name}: this Node is whole");
        let others: Vec<(String, Vec<String>)> =
            c.nodes.keys().filter(|n| n.as_str() != "me").map(|n| (n.clone(), labels(&c, n).unwrap_or_default())).collect();
        let want: Vec<(String, Vec<String>)> =
            want.iter().map(|(n, l)| ((*n).to_string(), l.iter().map(|s| (*s).to_string()).collect())).collect();
        assert_eq!(others, want, "{name}");
        for n in notes {
            assert!(got_notes.iter().any(|g| g.contains(n)), "{name}: notes {got_notes:?} lack {n:?}");
        }
    }
}

/// A label a Service reads that the watch would not keep is named: the
/// region of Nodes that a zone-keyed Service lists, whose slices carry no
/// zone, is dropped while a second Service reads it from slices that do.
#[test]
fn a_label_read_but_not_kept_is_named() {
    let zone = ", annotations: {topoproxy.io/topology-keys: \"topology.kubernetes.io/zone, *\"}";
    let region = ", annotations: {topoproxy.io/topology-keys: \"topology.kubernetes.io/region, *\"}";
    let objects = service("zoned", zone)
        + &slice("zoned", "{addresses: [10.244.0.1], nodeName: a}")
        + &service("regional", region)
        + "apiVersion: discovery.k8s.io/v1beta1\nkind: EndpointSlice\nmetadata: {name: regional-1, labels: {kubernetes.io/service-name: regional}}\naddressType: IPv4\nports: [{port: 8080}]\nendpoints: [{addresses: [10.244.0.3], nodeName: a, topology: {kubernetes.io/hostname: a, topology.kubernetes.io/region: r-a}}]\n";
    let (c, notes) = scoped(&objects);
    assert_eq!(labels(&c, "a"), Some(vec!["kubernetes.io/hostname".into(), "topology.kubernetes.io/zone".into()]));
    assert!(notes.iter().any(|n| n.contains("Node a: labels topology.kubernetes.io/region=r-a left out")), "{notes:?}");
}
