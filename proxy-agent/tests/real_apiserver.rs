//! The agent against a real control plane: etcd, kube-apiserver and
//! kube-controller-manager at the release pinned in tools/k8s/go.mod
//! (`proxy_test_support::real_cluster`, built by `cargo xtask k8s`). Unlike
//! kube_agent.rs, whose stand-in API server serves the EndpointSlices the
//! test writes, here the real EndpointSlice controller derives them from
//! Pods and Nodes, and the agent watches the real API server over TLS.
//!
//! Pods have no kubelet: each is created bound to its Node and its status
//! (IP, readiness) is written as a kubelet would. Their addresses live on
//! the loopback of the test's isolated pod namespace, where a serve-hostname
//! backend answers with the Pod's name, so a connect that is not translated
//! has no route and nothing leaves the machine.

mod support;

use std::collections::BTreeSet;

use proxy_test_support::real_cluster::RealCluster;
use proxy_test_support::wait::eventually;
use serde_json::Value;
use support::*;

const ZONE: &str = "topology.kubernetes.io/zone";

const WEB: &str = "\
apiVersion: v1
kind: Service
metadata: {name: web, namespace: default}
spec:
  clusterIP: 10.96.30.10
  selector: {app: web}
  ports: [{name: http, port: 80, protocol: TCP, targetPort: 8080}]
";

/// (address, nodeName, zone, ready) of every endpoint of the slices.
fn endpoints(slices: &Value) -> BTreeSet<(String, String, String, bool)> {
    let s = |v: &Value| v.as_str().unwrap_or_default().to_string();
    slices["items"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|slice| slice["endpoints"].as_array().cloned().unwrap_or_default())
        .map(|e| (s(&e["addresses"][0]), s(&e["nodeName"]), s(&e["zone"]), e["conditions"]["ready"] == true))
        .collect()
}

#[test]
fn the_real_controllers_endpoint_slices_program_the_datapath_and_zone_topology() {
    require_root();
    let mut net = PodNetwork::new();
    net.backend("web-1", "10.244.30.1", &[8080]);
    net.backend("web-2", "10.244.30.2", &[8080]);
    let cluster = RealCluster::start("zone-topology").expect("start etcd, kube-apiserver and kube-controller-manager");
    cluster.create_node("node-1", &[(ZONE, "z1")]).expect("create node-1");
    cluster.create_node("node-2", &[(ZONE, "z2")]).expect("create node-2");
    cluster.apply(WEB).expect("create Service web");
    cluster.create_pod("default", "web-1", "node-1", "10.244.30.1", &[("app", "web")], true).expect("create pod web-1");
    cluster.create_pod("default", "web-2", "node-2", "10.244.30.2", &[("app", "web")], true).expect("create pod web-2");

    // The EndpointSlice controller publishes both Pods, ready, with their
    // Node and its zone.
    let want: BTreeSet<_> = [("10.244.30.1", "node-1", "z1"), ("10.244.30.2", "node-2", "z2")]
        .iter()
        .map(|(a, n, z)| ((*a).to_string(), (*n).to_string(), (*z).to_string(), true))
        .collect();
    eventually("the EndpointSlice controller to publish web-1 and web-2", || {
        let got = endpoints(&cluster.endpoint_slices("default", "web").expect("list EndpointSlices"));
        if got == want { Ok(()) } else { Err(got) }
    });

    // The agent of node-1 programs both for its pods.
    let mut node = Node::new("node-1");
    node.start_kube_agent(cluster.admin_kubeconfig(), &[]);
    wait_for_backends(&node, &net, "10.96.30.10:80", &[], &["web-1", "web-2"]);

    // Zone first, then anywhere: node-1 (z1) keeps to web-1.
    cluster
        .kubectl(&["-n", "default", "annotate", "service", "web", "topoproxy.io/topology-keys=topology.kubernetes.io/zone, *"])
        .expect("annotate Service web");
    wait_for_backends(&node, &net, "10.96.30.10:80", &[], &["web-1"]);
}
