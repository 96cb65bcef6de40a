//! The agent against API servers of the releases where the seed documents'
//! features were born, and today's (Stand-in: API eras, 1.18 and 1.21,
//! that no release built here serves): the real `proxy-agent run
//! --kubeconfig` (kube-rs client, list/watch over HTTP) on every node of a
//! simulated cluster, against the stand-in API server behaving as
//! - Kubernetes 1.18 (OpenYurt's walk-through: EndpointSlices and Events in
//!   v1beta1 only, `spec.topologyKeys`, no `trafficDistribution`),
//! - Kubernetes 1.21 (v1 and v1beta1 of both; `spec.topologyKeys` for the
//!   last time),
//! - today's (v1 only; `spec.topologyKeys` is dropped, so the ordered keys
//!   come from the `topoproxy.io/topology-keys` annotation),
//!
//! each with seed 002's node pools (`openyurt.io/topologyKeys:
//! openyurt.io/nodepool` against a Service without topology) and an ordered
//! topology key list (`kubernetes.io/hostname`, `topology.kubernetes.io/zone`,
//! `*`) whose tiers empty one after the other, with clients on every node
//! connecting through the datapath.

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use proxy_test_support::apiserver::{ApiServer, KubeVersion};
use proxy_test_support::http::{http_get, metric};
use proxy_test_support::wait::eventually;
use serde_json::{Value, json};
use support::*;

const HOSTNAME: &str = "kubernetes.io/hostname";
const ZONE: &str = "topology.kubernetes.io/zone";
const POOL: &str = "apps.openyurt.io/nodepool";

/// Seed 002's nodes (kind's names) with their node pools, plus zones for
/// the topology key list.
const NODES: [(&str, &str, &str); 3] =
    [("kind-control-plane", "beijing", "zone-a"), ("kind-worker", "hangzhou", "zone-a"), ("kind-worker2", "shanghai", "zone-b")];

/// A serve_hostname pod: name, address, node, zone.
struct Pod {
    name: &'static str,
    ip: &'static str,
    node: &'static str,
    zone: &'static str,
}

/// united-deployment1's pods: two in pool hangzhou, two in pool shanghai.
const PODS: [Pod; 4] = [
    Pod { name: "hangzhou-a", ip: "10.244.20.2", node: "kind-worker", zone: "zone-a" },
    Pod { name: "hangzhou-b", ip: "10.244.20.3", node: "kind-worker", zone: "zone-a" },
    Pod { name: "shanghai-a", ip: "10.244.20.4", node: "kind-worker2", zone: "zone-b" },
    Pod { name: "shanghai-b", ip: "10.244.20.5", node: "kind-worker2", zone: "zone-b" },
];

/// A pod on a node the API server has no Node object for (yet): only its
/// EndpointSlice says where it is.
const EDGE: Pod = Pod { name: "edge-a", ip: "10.244.20.6", node: "kind-worker3", zone: "zone-a" };

const SVC_UD1: &str = "10.96.20.11:80";
const SVC_PLAIN: &str = "10.96.20.12:80";
const SVC_KEYS: &str = "10.96.20.13:80";
const KEYS: [&str; 3] = [HOSTNAME, ZONE, "*"];

fn node_obj(name: &str, pool: &str, zone: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {HOSTNAME: name, ZONE: zone, "topology.kubernetes.io/region": "region-1", POOL: pool}},
        "status": {"conditions": [{"type": "Ready", "status": "True"}]},
    })
}

fn service(name: &str, frontend: &str, annotations: Value, extra_spec: Value) -> Value {
    let ip = frontend.trim_end_matches(":80");
    let mut spec =
        json!({"type": "ClusterIP", "clusterIP": ip, "clusterIPs": [ip], "ports": [{"port": 80, "protocol": "TCP", "targetPort": 9376}]});
    if let (Some(s), Some(extra)) = (spec.as_object_mut(), extra_spec.as_object()) {
        s.extend(extra.clone());
    }
    json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": "default", "annotations": annotations}, "spec": spec})
}

/// The EndpointSlice of Service `svc` as the release's EndpointSlice
/// controller writes it: before 1.21, discovery.k8s.io/v1beta1 with the
/// node's labels in `topology` (and no `nodeName` before 1.20); from 1.21,
/// v1 with `nodeName` and `zone`. `pods` with whether each is ready.
fn slice(kv: KubeVersion, svc: &str, pods: &[(&Pod, bool)]) -> Value {
    let beta = kv.minor < 21;
    let endpoints: Vec<Value> = pods
        .iter()
        .map(|(p, ready)| {
            let mut ep = json!({"addresses": [p.ip], "conditions": {"ready": ready}, "targetRef": {"kind": "Pod", "namespace": "default", "name": p.name}});
            if beta {
                ep["topology"] = json!({HOSTNAME: p.node, ZONE: p.zone, "topology.kubernetes.io/region": "region-1"});
            } else {
                ep["nodeName"] = json!(p.node);
                ep["zone"] = json!(p.zone);
            }
            ep
        })
        .collect();
    json!({
        "apiVersion": if beta { "discovery.k8s.io/v1beta1" } else { "discovery.k8s.io/v1" },
        "kind": "EndpointSlice",
        "metadata": {"name": format!("{svc}-abc12"), "namespace": "default", "labels": {"kubernetes.io/service-name": svc}},
        "addressType": "IPv4",
        "ports": [{"name": "", "port": 9376, "protocol": "TCP"}],
        "endpoints": endpoints,
    })
}

/// The ordered key list: `spec.topologyKeys` where the API server has the
/// field (1.17-1.21), this project's annotation where it does not.
fn keys_service(kv: KubeVersion) -> Value {
    if (17..=21).contains(&kv.minor) {
        service("svc-keys", SVC_KEYS, json!({}), json!({"topologyKeys": KEYS}))
    } else {
        service("svc-keys", SVC_KEYS, json!({"topoproxy.io/topology-keys": KEYS.join(", ")}), json!({}))
    }
}

fn keys_slice(kv: KubeVersion, hangzhou_ready: bool, shanghai_ready: bool, edge_ready: bool) -> Value {
    let [a, b, c, d] = &PODS;
    slice(kv, "svc-keys", &[(a, hangzhou_ready), (b, hangzhou_ready), (c, shanghai_ready), (d, shanghai_ready), (&EDGE, edge_ready)])
}

fn cluster(kv: KubeVersion) -> Vec<Value> {
    let all: Vec<(&Pod, bool)> = PODS.iter().map(|p| (p, true)).collect();
    let mut objects: Vec<Value> = NODES.iter().map(|(n, pool, zone)| node_obj(n, pool, zone)).collect();
    objects.extend([
        // Seed 002: the same pods behind a node-pool Service and a plain one.
        service("svc-ud1", SVC_UD1, json!({"openyurt.io/topologyKeys": "openyurt.io/nodepool"}), json!({})),
        slice(kv, "svc-ud1", &all),
        service("svc-ud1-without-topology", SVC_PLAIN, json!({}), json!({})),
        slice(kv, "svc-ud1-without-topology", &all),
        keys_service(kv),
        keys_slice(kv, true, true, true),
        // A Service the API server accepted but the agent cannot program:
        // reported as an Event in the negotiated events.k8s.io version.
        service("svc-bad", "10.96.20.300:80", json!({}), json!({})),
    ]);
    objects
}

struct World {
    kv: KubeVersion,
    net: PodNetwork,
    nodes: Vec<Node>,
    api: Option<ApiServer>,
    dir: TempDir,
}

impl World {
    fn new(kv: KubeVersion) -> World {
        let mut net = PodNetwork::new();
        for p in PODS.iter().chain([&EDGE]) {
            net.backend(p.name, p.ip, &[9376]);
        }
        let dir = TempDir::new("tpt-kube-versions");
        let api = ApiServer::start_as(kv, "127.0.0.1:0".parse().expect("address"), 1, cluster(kv));
        api.write_kubeconfig(&dir.0.join("kubeconfig"));
        let nodes = NODES.iter().map(|(n, _, _)| Node::new(n)).collect();
        World { kv, net, nodes, api: Some(api), dir }
    }

    fn api(&self) -> &ApiServer {
        self.api.as_ref().expect("the API server is running")
    }

    fn start_agents(&mut self) {
        let kubeconfig = self.dir.0.join("kubeconfig");
        for n in &mut self.nodes {
            n.start_kube_agent(&kubeconfig, &[]);
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
            let r = n.probe(&self.net, &["--to", to, "--timeout-ms", "1000"]);
            if r[0]["errno"] == 111 { Ok(()) } else { Err(r) }
        });
    }

    fn metrics(&self, node: &str) -> String {
        let addr = self.node(node).metrics_address();
        eventually("/metrics to answer", || match http_get(addr, "/metrics") {
            Ok((200, body)) => Ok(body),
            other => Err(other),
        })
    }

    /// Seed 002 (OpenYurt's walk-through): from a pod in pool shanghai, the
    /// node-pool Service reaches only shanghai's pods and the plain one
    /// reaches all four; pool hangzhou likewise; pool beijing has none of
    /// the pods, and OpenYurt's node-pool topology does not fall back.
    fn node_pools(&self) {
        self.expect("kind-worker2", SVC_UD1, &["shanghai-a", "shanghai-b"]);
        self.expect("kind-worker2", SVC_PLAIN, &["hangzhou-a", "hangzhou-b", "shanghai-a", "shanghai-b"]);
        self.expect("kind-worker", SVC_UD1, &["hangzhou-a", "hangzhou-b"]);
        self.expect("kind-worker", SVC_PLAIN, &["hangzhou-a", "hangzhou-b", "shanghai-a", "shanghai-b"]);
        self.expect_refused("kind-control-plane", SVC_UD1);
        self.expect("kind-control-plane", SVC_PLAIN, &["hangzhou-a", "hangzhou-b", "shanghai-a", "shanghai-b"]);
    }

    /// hostname, then zone, then anywhere. edge-a's node has no Node
    /// object: its slice's zone puts it in zone-a.
    fn ordered_keys(&self) {
        let api = self.api();
        self.expect("kind-worker", SVC_KEYS, &["hangzhou-a", "hangzhou-b"]);
        self.expect("kind-worker2", SVC_KEYS, &["shanghai-a", "shanghai-b"]);
        self.expect("kind-control-plane", SVC_KEYS, &["edge-a", "hangzhou-a", "hangzhou-b"]);
        // No ready endpoint on kind-worker: its zone.
        api.apply(keys_slice(self.kv, false, true, true));
        self.expect("kind-worker", SVC_KEYS, &["edge-a"]);
        self.expect("kind-control-plane", SVC_KEYS, &["edge-a"]);
        self.expect("kind-worker2", SVC_KEYS, &["shanghai-a", "shanghai-b"]);
        // None ready in zone-a either: anywhere.
        api.apply(keys_slice(self.kv, false, true, false));
        self.expect("kind-worker", SVC_KEYS, &["shanghai-a", "shanghai-b"]);
        self.expect("kind-control-plane", SVC_KEYS, &["shanghai-a", "shanghai-b"]);
    }

    /// The versions the agents chose: logged, in /metrics, and the only
    /// ones they asked the API server for.
    fn negotiated(&self, slices: &str, events: &str) {
        for n in &self.nodes {
            let text = self.metrics(&n.name);
            for (group, version) in [("discovery.k8s.io", slices), ("events.k8s.io", events)] {
                let series = format!("topoproxy_api_version{{group=\"{group}\",version=\"{version}\"}}");
                assert_eq!(metric(&text, &series), Some(1.0), "{} on {}:\n{text}", series, n.name);
            }
            let log = n.agent_log();
            assert!(log.contains(&format!("EndpointSlices discovery.k8s.io/{slices}, Events events.k8s.io/{events}")), "{log}");
            assert!(!log.contains("list/watch failed"), "no watch failed on {}: {log}", n.name);
        }
        let reqs = self.api().requests();
        let slice_paths: Vec<&String> = reqs.iter().filter(|r| r.contains("/endpointslices")).collect();
        assert!(
            !slice_paths.is_empty() && slice_paths.iter().all(|r| r.contains(&format!("/apis/discovery.k8s.io/{slices}/endpointslices"))),
            "{slice_paths:#?}"
        );
        assert!(reqs.iter().any(|r| r.starts_with("GET /apis [")), "discovery document read: {reqs:#?}");
        // The bad Service, reported once per node, in the negotiated version.
        let api = self.api();
        eventually("an Event from every node", || {
            let evs = api.events();
            if evs.len() >= self.nodes.len() { Ok(()) } else { Err(evs) }
        });
        for e in api.events() {
            assert_eq!(e["apiVersion"], format!("events.k8s.io/{events}"), "{e}");
            assert_eq!((e["regarding"]["name"].as_str(), e["reason"].as_str()), (Some("svc-bad"), Some("InvalidService")), "{e}");
        }
    }

    /// The API server comes back as release `kv`, after an etcd restore
    /// (a new, lower history: resuming the watches is "too large resource
    /// version") or an upgrade (a version no longer served is a 404); the
    /// agents relist (in the version now served) instead of retrying in a
    /// loop, and follow the new state.
    /// `continued`: the new history starts where the old one ended (an
    /// upgrade keeps etcd), else it starts over.
    fn restart_api_server(&mut self, kv: KubeVersion, continued: bool, objects: Vec<Value>) {
        let addr: SocketAddr = self.api().addr();
        let first_rv = if continued { self.api().resource_version() } else { 1 };
        if let Some(api) = self.api.take() {
            api.stop();
        }
        std::thread::sleep(Duration::from_millis(500));
        self.kv = kv;
        self.api = Some(ApiServer::start_as(kv, addr, first_rv, objects));
    }

    fn wait_metric(&self, node: &str, series: &str, ok: impl Fn(f64) -> bool) {
        eventually(&format!("{series} on {node}"), || {
            let text = self.metrics(node);
            match metric(&text, series) {
                Some(v) if ok(v) => Ok(()),
                v => Err(v),
            }
        });
    }
}

/// Kubernetes 1.18: v1beta1 EndpointSlices (topology maps, no nodeName,
/// ready only) and Events; watches that end often and carry no bookmarks;
/// a restored etcd answered with 1.18's "too large resource version"
/// (a message, no cause); then the control plane is replaced by today's,
/// which no longer serves v1beta1 (404 in plain text before, a Status
/// now): the agents negotiate again and continue in v1.
#[test]
fn a_1_18_server_serves_v1beta1_only() {
    let kv = KubeVersion::V1_18;
    let mut w = World::new(kv);
    w.api().set_bookmarks_served(false);
    w.api().set_watch_cutoff(Duration::from_millis(700));
    w.start_agents();
    w.node_pools();
    w.ordered_keys();
    w.negotiated("v1beta1", "v1beta1");

    let mut objects: Vec<Value> = w.api().objects().into_iter().filter(|o| o["metadata"]["name"] != "svc-keys-abc12").collect();
    assert!(objects.iter().any(|o| o["apiVersion"] == "discovery.k8s.io/v1beta1"), "served back as v1beta1: {objects:#?}");
    objects.push(keys_slice(kv, true, true, true));
    w.restart_api_server(kv, false, objects);
    w.expect("kind-worker", SVC_KEYS, &["hangzhou-a", "hangzhou-b"]);
    w.expect("kind-control-plane", SVC_KEYS, &["edge-a", "hangzhou-a", "hangzhou-b"]);
    let text = w.metrics("kind-worker");
    assert!(metric(&text, "topoproxy_errors_total{reason=\"watch_expired\"}").is_some_and(|v| v >= 1.0), "{text}");
    w.node_pools();

    // Upgraded to today's control plane, with shanghai's pods gone meanwhile.
    let mut objects: Vec<Value> = cluster(KubeVersion::CURRENT).into_iter().filter(|o| o["metadata"]["name"] != "svc-keys-abc12").collect();
    objects.push(keys_slice(KubeVersion::CURRENT, true, false, true));
    w.restart_api_server(KubeVersion::CURRENT, true, objects);
    for (node, _, _) in NODES {
        w.wait_metric(node, "topoproxy_api_version{group=\"discovery.k8s.io\",version=\"v1\"}", |v| v == 1.0);
    }
    w.expect("kind-worker2", SVC_KEYS, &["edge-a", "hangzhou-a", "hangzhou-b"]);
    w.expect("kind-worker", SVC_KEYS, &["hangzhou-a", "hangzhou-b"]);
    w.node_pools();
    let log = w.node("kind-worker").agent_log();
    assert!(log.contains("no longer serves discovery.k8s.io/v1beta1"), "{log}");
    let text = w.metrics("kind-worker");
    assert_eq!(metric(&text, "topoproxy_api_version{group=\"discovery.k8s.io\",version=\"v1beta1\"}"), None, "{text}");
}

/// Kubernetes 1.21: both versions served; the agents take v1.
#[test]
fn a_1_21_server_serves_both_versions() {
    let mut w = World::new(KubeVersion::V1_21);
    w.start_agents();
    w.node_pools();
    w.ordered_keys();
    w.negotiated("v1", "v1");
}

/// Today's API server: v1 only, and `spec.topologyKeys` is gone.
#[test]
fn a_current_server_serves_v1_only() {
    let mut w = World::new(KubeVersion::CURRENT);
    w.start_agents();
    let keys = w.api().objects().into_iter().find(|o| o["metadata"]["name"] == "svc-keys").expect("svc-keys");
    assert!(keys["spec"].get("topologyKeys").is_none(), "{keys}");
    w.node_pools();
    w.ordered_keys();
    w.negotiated("v1", "v1");
}
