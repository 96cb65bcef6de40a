//! Topology-aware selection on a simulated 3-node cluster: one agent per
//! node (own cgroup, own pin directory), nodes in two zones and two
//! OpenYurt node pools, one backend pod per node.

mod support;

use proxy_test_support::wait::eventually;
use support::*;

struct NodeInfo {
    name: &'static str,
    zone: &'static str,
    pool: &'static str,
    pod: &'static str,
    ip: &'static str,
}

const NODES: [NodeInfo; 3] = [
    NodeInfo { name: "node-a", zone: "z1", pool: "beijing", pod: "pod-a", ip: "10.244.10.1" },
    NodeInfo { name: "node-b", zone: "z1", pool: "beijing", pod: "pod-b", ip: "10.244.10.2" },
    NodeInfo { name: "node-c", zone: "z2", pool: "hangzhou", pod: "pod-c", ip: "10.244.10.3" },
];

fn nodes_yaml(zone_of_c: &str) -> String {
    NODES
        .iter()
        .map(|n| {
            let zone = if n.name == "node-c" { zone_of_c } else { n.zone };
            format!(
                "---\napiVersion: v1\nkind: Node\nmetadata:\n  name: {}\n  labels:\n    kubernetes.io/hostname: {}\n    topology.kubernetes.io/zone: {zone}\n    topology.kubernetes.io/region: r1\n    apps.openyurt.io/nodepool: {}\n",
                n.name, n.name, n.pool
            )
        })
        .collect()
}

/// A Service on `ip`:80 whose endpoints are the pods of `on` (ready unless
/// listed in `unready`).
fn service(name: &str, ip: &str, extra_spec: &str, annotations: &str, on: &[&str], unready: &[&str]) -> String {
    let endpoints: String = NODES
        .iter()
        .filter(|n| on.contains(&n.name))
        .map(|n| {
            format!(
                "- addresses: [\"{}\"]\n  conditions: {{ready: {}}}\n  nodeName: {}\n  zone: {}\n",
                n.ip,
                !unready.contains(&n.name),
                n.name,
                n.zone
            )
        })
        .collect();
    format!(
        "---\napiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  annotations: {{{annotations}}}\nspec:\n  clusterIP: {ip}\n{extra_spec}  ports: [{{name: http, port: 80, targetPort: 8080}}]\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}-1\n  labels: {{kubernetes.io/service-name: {name}}}\naddressType: IPv4\nports: [{{name: http, port: 8080}}]\nendpoints:\n{endpoints}"
    )
}

struct World {
    net: PodNetwork,
    nodes: Vec<Node>,
}

impl World {
    fn new() -> World {
        let mut net = PodNetwork::new();
        for n in &NODES {
            net.backend(n.pod, n.ip, &[8080]);
        }
        let nodes = NODES.iter().map(|n| Node::new(n.name)).collect();
        World { net, nodes }
    }

    /// Every node's agent gets the same cluster state, as from one API server.
    fn publish(&self, yaml: &str) {
        for n in &self.nodes {
            n.write_manifest("cluster.yaml", yaml);
        }
    }

    fn start(&mut self) {
        for n in &mut self.nodes {
            n.start_agent();
        }
    }

    fn node(&self, name: &str) -> &Node {
        self.nodes.iter().find(|n| n.name == name).expect("known node")
    }

    fn expect(&self, node: &str, to: &str, want: &[&str]) {
        wait_for_backends(self.node(node), &self.net, to, &[], want);
    }

    fn expect_refused(&self, node: &str, to: &str) {
        let n = self.node(node);
        eventually(&format!("{to} refused from {node}"), || {
            let r = n.probe(&self.net, &["--to", to]);
            if r[0]["errno"] == 111 { Ok(()) } else { Err(r) }
        });
    }
}

const KEYS: &str = "  topologyKeys: [\"kubernetes.io/hostname\", \"topology.kubernetes.io/zone\", \"*\"]\n";
const ZONE_ONLY: &str = "  topologyKeys: [\"topology.kubernetes.io/zone\"]\n";
const HOST_ONLY: &str = "  topologyKeys: [\"kubernetes.io/hostname\"]\n";
const ALL: [&str; 3] = ["node-a", "node-b", "node-c"];

fn cluster(zone_of_c: &str, keys_unready: &[&str]) -> String {
    [
        nodes_yaml(zone_of_c),
        service("keys", "10.96.1.1", KEYS, "", &ALL, keys_unready),
        service("zone-only", "10.96.1.2", ZONE_ONLY, "", &ALL, &[]),
        service("host-only", "10.96.1.3", HOST_ONLY, "", &["node-c"], &[]),
        service("pool", "10.96.1.4", "", "openyurt.io/topologyKeys: openyurt.io/nodepool", &ALL, &[]),
        service("plain", "10.96.1.5", "", "", &ALL, &[]),
        service("annotated", "10.96.1.6", "", "topoproxy.io/topology-keys: \"topology.kubernetes.io/zone, *\"", &ALL, &[]),
        service("node-local", "10.96.1.7", "  internalTrafficPolicy: Local\n", "", &["node-b", "node-c"], &[]),
    ]
    .concat()
}

#[test]
fn each_node_reaches_only_what_its_topology_allows() {
    let mut w = World::new();
    w.publish(&cluster("z2", &[]));
    w.start();

    // hostname first: every node keeps traffic on itself.
    w.expect("node-a", "10.96.1.1:80", &["pod-a"]);
    w.expect("node-b", "10.96.1.1:80", &["pod-b"]);
    w.expect("node-c", "10.96.1.1:80", &["pod-c"]);
    // zone only.
    w.expect("node-a", "10.96.1.2:80", &["pod-a", "pod-b"]);
    w.expect("node-c", "10.96.1.2:80", &["pod-c"]);
    // hostname only, and the only endpoint is elsewhere: refused.
    w.expect_refused("node-a", "10.96.1.3:80");
    w.expect("node-c", "10.96.1.3:80", &["pod-c"]);
    // OpenYurt node pool.
    w.expect("node-b", "10.96.1.4:80", &["pod-a", "pod-b"]);
    w.expect("node-c", "10.96.1.4:80", &["pod-c"]);
    // No preference: everything, from everywhere.
    w.expect("node-a", "10.96.1.5:80", &["pod-a", "pod-b", "pod-c"]);
    // The project's annotation.
    w.expect("node-c", "10.96.1.6:80", &["pod-c"]);
    w.expect("node-a", "10.96.1.6:80", &["pod-a", "pod-b"]);

    // internalTrafficPolicy: Local uses this node's endpoints only, and a
    // node without one refuses.
    w.expect("node-b", "10.96.1.7:80", &["pod-b"]);
    w.expect_refused("node-a", "10.96.1.7:80");

    // The preferred tier empties: move to the next one, then to "*".
    w.publish(&cluster("z2", &["node-a"]));
    w.expect("node-a", "10.96.1.1:80", &["pod-b"]);
    w.expect("node-b", "10.96.1.1:80", &["pod-b"]);
    w.publish(&cluster("z2", &["node-a", "node-b"]));
    w.expect("node-a", "10.96.1.1:80", &["pod-c"]);

    // A node's labels change: its traffic moves. node-c joins zone z1.
    w.publish(&cluster("z1", &[]));
    w.expect("node-a", "10.96.1.2:80", &["pod-a", "pod-b", "pod-c"]);
    w.expect("node-c", "10.96.1.2:80", &["pod-a", "pod-b", "pod-c"]);
}

#[test]
fn explain_prints_the_documented_json_shape() {
    let dir = TempDir::new("tpt-explain");
    std::fs::write(dir.0.join("cluster.yaml"), cluster("z2", &["node-a"])).expect("write");
    let out = std::process::Command::new(agent_bin())
        .args(["explain", "--node", "node-a", "--output", "json", "--manifests"])
        .arg(&dir.0)
        .output()
        .expect("run explain");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(doc["node"], "node-a");
    let keys = doc["services"].as_array().expect("services").iter().find(|s| s["name"] == "keys").expect("keys service");
    assert_eq!(keys["namespace"], "default");
    assert_eq!(keys["port"], serde_json::json!({"name": "http", "port": 80, "protocol": "TCP"}));
    assert_eq!(keys["frontends"], serde_json::json!(["10.96.1.1:80"]));
    assert_eq!(keys["model"], "TopologyKeys");
    assert_eq!(keys["clusterEndpoints"], serde_json::json!(["10.244.10.2:8080"]));
    // No Local policy: no traffic of the port uses the node-local set.
    assert_eq!(keys["localEndpoints"], serde_json::Value::Null);
    // internalTrafficPolicy: Local and no way in from outside: the
    // cluster-wide set is not used; node-a has no endpoint of its own.
    let node_local = doc["services"].as_array().expect("services").iter().find(|s| s["name"] == "node-local").expect("node-local");
    assert_eq!(node_local["clusterEndpoints"], serde_json::Value::Null, "{node_local}");
    assert_eq!(node_local["localEndpoints"], serde_json::json!([]), "{node_local}");
    let decision = keys["decision"].as_str().expect("decision");
    assert!(decision.contains("kubernetes.io/hostname") && decision.contains("topology.kubernetes.io/zone=z1"), "{decision}");

    let table = std::process::Command::new(agent_bin())
        .args(["explain", "--node", "node-a", "--manifests"])
        .arg(&dir.0)
        .output()
        .expect("run explain");
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(text.contains("default/keys port http (80/TCP)") && text.contains("model:     TopologyKeys"), "{text}");
    assert!(text.contains("  local:     (not used)") && text.contains("  cluster:   (not used)"), "{text}");
}
