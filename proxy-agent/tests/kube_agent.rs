//! The agent as a Kubernetes node agent: the real `proxy-agent run
//! --kubeconfig` against the stand-in API server (`proxy_test_support::apiserver`,
//! real list/watch protocol over HTTP), with clients in an isolated
//! namespace connecting through the datapath. The same agent against a real
//! kube-apiserver and EndpointSlice controller is `real_apiserver.rs`; each
//! test here says in one line (`Stand-in:`) why it needs the stand-in.

mod support;

use std::time::Duration;

use proxy_test_support::apiserver::{ApiServer, KubeVersion};
use proxy_test_support::http::{http_get, metric};
use proxy_test_support::wait::eventually;
use serde_json::{Value, json};
use support::*;

const ZONE: &str = "topology.kubernetes.io/zone";

fn service(name: &str, ip: &str, port: u16, extra_spec: Value, labels: Value) -> Value {
    let mut spec = json!({
        "type": "ClusterIP",
        "clusterIP": ip,
        "clusterIPs": [ip],
        "ports": [{"name": "http", "port": port, "protocol": "TCP", "targetPort": 8080}],
    });
    if let (Some(s), Some(extra)) = (spec.as_object_mut(), extra_spec.as_object()) {
        s.extend(extra.clone());
    }
    json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": "default", "labels": labels}, "spec": spec})
}

/// An EndpointSlice of Service `svc` with ready endpoints (address, node).
fn slice(svc: &str, name: &str, endpoints: &[(&str, &str)]) -> Value {
    let eps: Vec<Value> =
        endpoints.iter().map(|(ip, node)| json!({"addresses": [ip], "conditions": {"ready": true}, "nodeName": node})).collect();
    json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": "default",
            "labels": {"kubernetes.io/service-name": svc, "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"},
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": eps,
    })
}

/// [`slice`] with each endpoint's `zone`, as the EndpointSlice controller
/// copies it from the endpoint's Node: (address, node, zone).
fn slice_in_zones(svc: &str, name: &str, endpoints: &[(&str, &str, &str)]) -> Value {
    let mut s = slice(svc, name, &endpoints.iter().map(|(ip, node, _)| (*ip, *node)).collect::<Vec<_>>());
    for (e, (_, _, zone)) in s["endpoints"].as_array_mut().into_iter().flatten().zip(endpoints) {
        e["zone"] = json!(zone);
    }
    s
}

fn node_obj(name: &str, zone: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, ZONE: zone}},
        // Status is large on real nodes; the agent skips it while reading.
        "status": {"conditions": [{"type": "Ready", "status": "True"}], "nodeInfo": {"kubeletVersion": "v1.33.0"}},
    })
}

/// The API server, the kubeconfig that points at it, and one node.
struct Cluster {
    api: Option<ApiServer>,
    dir: TempDir,
}

impl Cluster {
    fn new(first_rv: u64) -> Cluster {
        Self::new_as(KubeVersion::CURRENT, first_rv)
    }

    /// An API server of release `kv` (1.21 for `spec.topologyKeys`, which
    /// today's API server drops).
    fn new_as(kv: KubeVersion, first_rv: u64) -> Cluster {
        let dir = TempDir::new("tpt-kube");
        let api = ApiServer::start_as(kv, "127.0.0.1:0".parse().expect("address"), first_rv, Vec::new());
        api.write_kubeconfig(&dir.0.join("kubeconfig"));
        Cluster { api: Some(api), dir }
    }

    fn api(&self) -> &ApiServer {
        self.api.as_ref().expect("the API server is running")
    }

    fn kubeconfig(&self) -> std::path::PathBuf {
        self.dir.0.join("kubeconfig")
    }
}

fn pod_ips(net: &mut PodNetwork, base: &str, n: usize) {
    for i in 1..=n {
        net.backend(&format!("pod-{i}"), &format!("{base}.{i}"), &[8080]);
    }
}

fn unreachable(node: &Node, net: &PodNetwork, to: &str) {
    eventually(&format!("{to} to be no longer translated"), || {
        let r = node.probe(net, &["--to", to, "--timeout-ms", "1000"]);
        if r[0]["errno"] == 101 { Ok(()) } else { Err(r) }
    });
}

fn metrics_text(node: &Node) -> String {
    let addr = node.metrics_address();
    eventually("/metrics to answer", || match http_get(addr, "/metrics") {
        Ok((200, body)) => Ok(body),
        other => Err(other),
    })
}

fn wait_metric(node: &Node, series: &str, ok: impl Fn(f64) -> bool) {
    eventually(&format!("metric {series}"), || {
        let text = metrics_text(node);
        match metric(&text, series) {
            Some(v) if ok(v) => Ok(()),
            v => Err(v),
        }
    });
}

/// Stand-in: it records every request, so the test can count lists and
/// watches and read their selectors.
#[test]
fn services_and_slices_follow_the_api_server() {
    let mut net = PodNetwork::new();
    pod_ips(&mut net, "10.244.21", 3);
    let cluster = Cluster::new(100);
    let api = cluster.api();
    // Frequent bookmarks, and watches that end after a while: the agent
    // keeps resuming from the versions the bookmarks gave it.
    api.set_bookmark_interval(Duration::from_millis(100));
    api.set_watch_cutoff(Duration::from_millis(700));
    api.apply(node_obj("node-a", "z1"));
    api.apply(service("web", "10.96.21.10", 80, json!({}), json!({})));
    api.apply(slice("web", "web-1", &[("10.244.21.1", "node-a"), ("10.244.21.2", "node-a")]));
    let mut node = Node::new("node-a");
    node.start_kube_agent(&cluster.kubeconfig(), &[]);
    let web = "10.96.21.10:80";
    wait_for_backends(&node, &net, web, &[], &["pod-1", "pod-2"]);

    // Endpoint changes.
    api.apply(slice("web", "web-1", &[("10.244.21.1", "node-a"), ("10.244.21.2", "node-a"), ("10.244.21.3", "node-a")]));
    wait_for_backends(&node, &net, web, &[], &["pod-1", "pod-2", "pod-3"]);
    api.apply(slice("web", "web-1", &[("10.244.21.3", "node-a")]));
    wait_for_backends(&node, &net, web, &[], &["pod-3"]);
    // A Service's endpoints are the union of its slices.
    api.apply(slice("web", "web-2", &[("10.244.21.1", "node-a")]));
    wait_for_backends(&node, &net, web, &[], &["pod-1", "pod-3"]);
    assert!(api.delete("EndpointSlice", "default", "web-2"));
    wait_for_backends(&node, &net, web, &[], &["pod-3"]);

    // A Service update: the old port goes away, the new one appears.
    api.apply(service("web", "10.96.21.10", 81, json!({}), json!({})));
    wait_for_backends(&node, &net, "10.96.21.10:81", &[], &["pod-3"]);
    unreachable(&node, &net, web);

    // A second Service; then the first is deleted and nothing of it is left.
    api.apply(service("api", "10.96.21.11", 80, json!({}), json!({})));
    api.apply(slice("api", "api-1", &[("10.244.21.2", "node-a")]));
    wait_for_backends(&node, &net, "10.96.21.11:80", &[], &["pod-2"]);
    assert!(api.delete("Service", "default", "web"));
    unreachable(&node, &net, "10.96.21.10:81");
    wait_for_backends(&node, &net, "10.96.21.11:80", &[], &["pod-2"]);

    // Services of another proxy and headless Services are not ours, and a
    // Service that becomes another proxy's is removed.
    api.apply(service("other", "10.96.21.12", 80, json!({}), json!({"service.kubernetes.io/service-proxy-name": "someone-else"})));
    api.apply(slice("other", "other-1", &[("10.244.21.1", "node-a")]));
    api.apply(service("dns", "None", 53, json!({"clusterIPs": ["None"]}), json!({})));
    api.apply(service("api", "10.96.21.11", 80, json!({}), json!({"service.kubernetes.io/service-proxy-name": "someone-else"})));
    unreachable(&node, &net, "10.96.21.11:80");
    let r = node.probe(&net, &["--to", "10.96.21.12:80", "--timeout-ms", "1000"]);
    assert_eq!(r[0]["errno"], 101, "another proxy's Service must not be translated: {}", r[0]);

    // The watches were set up as intended, and bookmarks were understood:
    // not one list or watch failed.
    assert!(ApiServer::bookmarks_sent() > 0);
    // The agent may have followed every change above within one watch
    // window (700 ms); give the cutoff time to end the first watches.
    eventually("a watch to be resumed", || {
        let n = api.requests().iter().filter(|r| r.contains("watch=true")).count();
        if n > 3 { Ok(()) } else { Err(n) }
    });
    let log = node.agent_log();
    assert!(!log.contains("list/watch failed") && !log.contains("relist"), "{log}");
    let reqs = api.requests();
    // Besides the collections, the agent reads the discovery document once
    // (which EndpointSlice and Event versions are served).
    let lists = reqs.iter().filter(|r| r.starts_with("GET") && !r.contains("watch=true") && !r.starts_with("GET /apis [")).count();
    let watches = reqs.iter().filter(|r| r.contains("watch=true")).count();
    assert_eq!(lists, 3, "one list per kind, then only resumed watches: {reqs:#?}");
    assert_eq!(reqs.iter().filter(|r| r.starts_with("GET /apis [")).count(), 1, "{reqs:#?}");
    assert!(watches > 3, "watches were resumed: {reqs:#?}");
    let services_watch = reqs.iter().find(|r| r.contains("/api/v1/services?") && r.contains("watch=true")).expect("a Service watch");
    assert!(
        services_watch.contains("labelSelector=%21service.kubernetes.io%2Fservice-proxy-name%2C%21service.kubernetes.io%2Fheadless"),
        "{services_watch}"
    );
    // EndpointSlices with the same selector, as kube-proxy's informers.
    let slices_watch = reqs.iter().find(|r| r.contains("/endpointslices?") && r.contains("watch=true")).expect("an EndpointSlice watch");
    assert!(
        slices_watch.contains("labelSelector=%21service.kubernetes.io%2Fservice-proxy-name%2C%21service.kubernetes.io%2Fheadless"),
        "{slices_watch}"
    );
    // This node's Node is listed and watched whole (its taints are in the
    // spec, which metadata-only objects do not carry), and alone, by a
    // field selector as kube-proxy does; no Service needs other Nodes.
    let own = "fieldSelector=metadata.name%3Dnode-a";
    assert!(
        reqs.iter()
            .any(|r| r.contains("/api/v1/nodes?") && r.contains(own) && r.contains("watch=true") && !r.contains("PartialObjectMetadata")),
        "this Node is watched with its spec: {reqs:#?}"
    );
    assert!(reqs.iter().filter(|r| r.contains("/api/v1/nodes?")).all(|r| r.contains(own)), "no other Node is watched: {reqs:#?}");
    assert!(
        reqs.iter().any(|r| r.contains("/api/v1/nodes?") && !r.contains("watch=true") && !r.contains("PartialObjectMetadata")),
        "this Node is listed with its spec: {reqs:#?}"
    );
}

/// Stand-in: a 1.21 API server (`spec.topologyKeys`), an era no release
/// built here serves.
#[test]
fn a_node_label_change_reranks_topology_services() {
    let mut net = PodNetwork::new();
    net.backend("pod-b", "10.244.22.2", &[8080]);
    net.backend("pod-c", "10.244.22.3", &[8080]);
    let cluster = Cluster::new_as(KubeVersion::V1_21, 1);
    let api = cluster.api();
    api.apply_all(vec![
        node_obj("node-a", "z1"),
        node_obj("node-b", "z1"),
        node_obj("node-c", "z2"),
        service("zonal", "10.96.22.10", 80, json!({"topologyKeys": [ZONE]}), json!({})),
        slice_in_zones("zonal", "zonal-1", &[("10.244.22.2", "node-b", "z1"), ("10.244.22.3", "node-c", "z2")]),
        service("plain", "10.96.22.11", 80, json!({}), json!({})),
        slice("plain", "plain-1", &[("10.244.22.2", "node-b"), ("10.244.22.3", "node-c")]),
    ]);
    let mut node = Node::new("node-a");
    node.start_kube_agent(&cluster.kubeconfig(), &[]);
    wait_for_backends(&node, &net, "10.96.22.10:80", &[], &["pod-b"]);
    wait_for_backends(&node, &net, "10.96.22.11:80", &[], &["pod-b", "pod-c"]);

    // node-a moves to z2: only Node metadata changed, and the zonal Service
    // follows it.
    api.apply(node_obj("node-a", "z2"));
    wait_for_backends(&node, &net, "10.96.22.10:80", &[], &["pod-c"]);
    // node-b joins z2 as well: the EndpointSlice controller rewrites the
    // endpoint's zone, and both endpoints are in our zone now.
    api.apply(node_obj("node-b", "z2"));
    api.apply(slice_in_zones("zonal", "zonal-1", &[("10.244.22.2", "node-b", "z2"), ("10.244.22.3", "node-c", "z2")]));
    wait_for_backends(&node, &net, "10.96.22.10:80", &[], &["pod-b", "pod-c"]);
    wait_for_backends(&node, &net, "10.96.22.11:80", &[], &["pod-b", "pod-c"]);
}

/// Other Nodes are watched, metadata only, just while a Service's topology
/// needs a label their EndpointSlices do not carry (region on v1 slices,
/// OpenYurt's node pool): the decisions read those labels from the
/// metadata-only Nodes and follow their changes, and the watch stops once
/// no Service needs them (seed 004: a watch of every Node costs every
/// agent every kubelet's status report).
/// Stand-in: it records every request, so the test can see which Node
/// watches run, metadata-only or not, and when they stop.
#[test]
fn other_nodes_are_watched_metadata_only_while_a_services_topology_needs_them() {
    const REGION: &str = "topology.kubernetes.io/region";
    const POOL: &str = "apps.openyurt.io/nodepool";
    let mut net = PodNetwork::new();
    net.backend("pod-b", "10.244.23.2", &[8080]);
    net.backend("pod-c", "10.244.23.3", &[8080]);
    let node_with = |name: &str, zone: &str, region: &str, pool: &str| {
        let mut n = node_obj(name, zone);
        n["metadata"]["labels"][REGION] = json!(region);
        n["metadata"]["labels"][POOL] = json!(pool);
        n["metadata"]["labels"]["example.com/unused"] = json!("x");
        n
    };
    let eps = [("10.244.23.2", "node-b", "z2"), ("10.244.23.3", "node-c", "z3")];
    let cluster = Cluster::new(1);
    let api = cluster.api();
    api.apply_all(vec![
        node_with("node-a", "z1", "r1", "p1"),
        node_with("node-b", "z2", "r1", "p2"),
        node_with("node-c", "z3", "r2", "p1"),
        // Hosts no endpoint: its labels are never needed.
        node_with("node-d", "z3", "r2", "p1"),
        service("plain", "10.96.23.10", 80, json!({}), json!({})),
        slice_in_zones("plain", "plain-1", &eps),
    ]);
    let mut node = Node::new("node-a");
    node.start_kube_agent(&cluster.kubeconfig(), &[]);
    wait_for_backends(&node, &net, "10.96.23.10:80", &[], &["pod-b", "pod-c"]);
    let metadata_only =
        |reqs: &[String]| reqs.iter().filter(|r| r.contains("/api/v1/nodes?") && r.contains("PartialObjectMetadata")).count();
    assert_eq!(metadata_only(&api.requests()), 0, "no Service needs other Nodes");

    // Ranked by region: node-b shares ours (r1), node-c does not.
    let regional = |name: &str, ip: &str| {
        let mut s = service(name, ip, 80, json!({}), json!({}));
        s["metadata"]["annotations"] = json!({"topoproxy.io/topology-keys": format!("{REGION}, *")});
        s
    };
    api.apply_all(vec![regional("regional", "10.96.23.11"), slice_in_zones("regional", "regional-1", &eps)]);
    wait_for_backends(&node, &net, "10.96.23.11:80", &[], &["pod-b"]);
    let reqs = api.requests();
    let other = reqs
        .iter()
        .find(|r| r.contains("/api/v1/nodes?") && r.contains("PartialObjectMetadata") && r.contains("watch=true"))
        .unwrap_or_else(|| panic!("other Nodes are watched metadata-only: {reqs:#?}"));
    assert!(other.contains("fieldSelector=metadata.name%21%3Dnode-a"), "all but this Node: {other}");
    // Only the Nodes hosting the Service's endpoints, by their hostname
    // label (a set-based selector): a status report of node-d never
    // reaches this agent.
    let selector = other.split("labelSelector=").nth(1).and_then(|s| s.split('&').next()).unwrap_or_default();
    let selector =
        selector.replace("%2F", "/").replace("%28", "(").replace("%29", ")").replace("%2C", ",").replace(['+'], " ").replace("%20", " ");
    assert_eq!(selector, "kubernetes.io/hostname in (node-b,node-c)", "{other}");
    // node-c moves to our region: a label of another Node, read from its
    // metadata.
    api.apply(node_with("node-c", "z3", "r1", "p1"));
    wait_for_backends(&node, &net, "10.96.23.11:80", &[], &["pod-b", "pod-c"]);
    // pod-c moves to node-d (r2): the watch follows the endpoints to
    // node-d, and node-d's own move to our region counts.
    api.apply(slice_in_zones("regional", "regional-1", &[eps[0], ("10.244.23.3", "node-d", "z3")]));
    wait_for_backends(&node, &net, "10.96.23.11:80", &[], &["pod-b"]);
    api.apply(node_with("node-d", "z3", "r1", "p1"));
    wait_for_backends(&node, &net, "10.96.23.11:80", &[], &["pod-b", "pod-c"]);

    // OpenYurt's node pools: node-c shares ours (p1).
    let mut pooled = service("pooled", "10.96.23.12", 80, json!({}), json!({}));
    pooled["metadata"]["annotations"] = json!({"openyurt.io/topologyKeys": "openyurt.io/nodepool"});
    api.apply_all(vec![pooled, slice_in_zones("pooled", "pooled-1", &eps)]);
    wait_for_backends(&node, &net, "10.96.23.12:80", &[], &["pod-c"]);
    eventually("the labels in use to be logged", || {
        let log = node.agent_log();
        if log.contains(POOL) && log.contains(REGION) { Ok(()) } else { Err("not yet") }
    });
    assert!(!node.agent_log().contains("example.com/unused"), "a label no Service reads is not watched for");

    // No Service needs other Nodes any more: the watch stops, and the
    // plain Service is unaffected.
    api.delete("Service", "default", "regional");
    api.delete("Service", "default", "pooled");
    eventually("the other Nodes' watch to stop", || {
        if node.agent_log().contains("stopped watching other Nodes") { Ok(()) } else { Err("still watching") }
    });
    wait_for_backends(&node, &net, "10.96.23.10:80", &[], &["pod-b", "pod-c"]);
    eventually("Services, EndpointSlices and this Node to be the only watches", || {
        let n = api.open_watches();
        if n == 3 { Ok(()) } else { Err(n) }
    });
}

/// The API server goes away while clients connect and comes back with a
/// new history (a fresh etcd: resourceVersions restart far below the
/// agent's, so resuming the watches fails with "too large resource
/// version"); then it goes away again and the agent is restarted without
/// it. Traffic to Services whose backends stayed up never fails, and the
/// agent converges to each new server's state.
/// Stand-in: an injected fault (a new history with resourceVersions far
/// below the agent's, as after an etcd restore).
#[test]
fn api_server_outage_and_new_history_keep_traffic_flowing() {
    let mut net = PodNetwork::new();
    pod_ips(&mut net, "10.244.23", 3);
    let mut cluster = Cluster::new(50_000);
    let addr = cluster.api().addr();
    cluster.api().apply_all(vec![
        node_obj("node-a", "z1"),
        service("stable", "10.96.23.10", 80, json!({}), json!({})),
        slice("stable", "stable-1", &[("10.244.23.1", "node-a"), ("10.244.23.2", "node-a")]),
        service("moving", "10.96.23.11", 80, json!({}), json!({})),
        slice("moving", "moving-1", &[("10.244.23.3", "node-a")]),
    ]);
    let mut node = Node::new("node-a");
    node.start_kube_agent(&cluster.kubeconfig(), &[]);
    wait_for_backends(&node, &net, "10.96.23.10:80", &[], &["pod-1", "pod-2"]);
    wait_for_backends(&node, &net, "10.96.23.11:80", &[], &["pod-3"]);
    eventually("three open watches", || if cluster.api().open_watches() >= 3 { Ok(()) } else { Err(cluster.api().open_watches()) });
    let client = Client::start(&node, &net, "10.96.23.10:80");

    // Outage 1.
    let objects = cluster.api().objects();
    if let Some(api) = cluster.api.take() {
        api.stop();
    }
    std::thread::sleep(Duration::from_secs(2));
    assert!(node.agent_running(), "the agent must survive an API server outage: {}", node.agent_log());
    let (code, body) = http_get(node.healthz_address(), "/readyz").expect("readyz");
    assert_eq!(code, 200, "an agent that synced once stays ready through an outage: {body}");
    let (code, _) = http_get(node.healthz_address(), "/healthz").expect("healthz");
    assert_eq!(code, 200);
    wait_for_backends(&node, &net, "10.96.23.11:80", &[], &["pod-3"]);

    // Back with a new history, versions from 10, and "moving" changed
    // meanwhile.
    let moved = |objects: Vec<Value>, to: &str| -> Vec<Value> {
        objects
            .into_iter()
            .map(|o| if o["metadata"]["name"] == "moving-1" { slice("moving", "moving-1", &[(to, "node-a")]) } else { o })
            .collect()
    };
    cluster.api = Some(ApiServer::start_on(addr, 10, moved(objects, "10.244.23.1")));
    wait_for_backends(&node, &net, "10.96.23.11:80", &[], &["pod-1"]);
    let text = metrics_text(&node);
    assert!(
        metric(&text, "topoproxy_errors_total{reason=\"watch_expired\"}").is_some_and(|v| v >= 1.0),
        "the new history's lower versions must be detected (504 too large resource version): {text}"
    );
    // And it is followed from then on.
    cluster.api().apply(slice("stable", "stable-1", &[("10.244.23.1", "node-a"), ("10.244.23.2", "node-a"), ("10.244.23.3", "node-a")]));
    wait_for_backends(&node, &net, "10.96.23.10:80", &[], &["pod-1", "pod-2", "pod-3"]);

    // Outage 2, and a new agent that never reaches the API server keeps
    // the pinned state.
    let objects = cluster.api().objects();
    if let Some(api) = cluster.api.take() {
        api.stop();
    }
    node.stop_agent();
    node.start_kube_agent(&cluster.kubeconfig(), &[]);
    std::thread::sleep(Duration::from_secs(2));
    let (code, body) = http_get(node.healthz_address(), "/readyz").expect("readyz");
    assert_eq!(code, 503, "not ready before the first list: {body}");
    assert!(body.contains("waiting for"), "{body}");
    wait_for_backends(&node, &net, "10.96.23.11:80", &[], &["pod-1"]);
    cluster.api = Some(ApiServer::start_on(addr, 1_000_000, moved(objects, "10.244.23.2")));
    wait_for_backends(&node, &net, "10.96.23.11:80", &[], &["pod-2"]);
    eventually("readiness after the API server returned", || match http_get(node.healthz_address(), "/readyz") {
        Ok((200, _)) => Ok(()),
        other => Err(other),
    });
    wait_for_backends(&node, &net, "10.96.23.10:80", &[], &["pod-1", "pod-2", "pod-3"]);
    assert_no_failures("stable Service during the outages", client.finish());
}

/// Stand-in: the restarts run against a server whose history the test
/// controls (resourceVersions chosen); the real server's case is in
/// real_apiserver.rs.
#[test]
fn agent_restarts_do_not_interrupt_traffic() {
    let mut net = PodNetwork::new();
    pod_ips(&mut net, "10.244.24", 2);
    let cluster = Cluster::new(1);
    let api = cluster.api();
    api.apply_all(vec![
        node_obj("node-a", "z1"),
        service("web", "10.96.24.10", 80, json!({}), json!({})),
        slice("web", "web-1", &[("10.244.24.1", "node-a"), ("10.244.24.2", "node-a")]),
    ]);
    let mut node = Node::new("node-a");
    node.start_kube_agent(&cluster.kubeconfig(), &[]);
    wait_for_backends(&node, &net, "10.96.24.10:80", &[], &["pod-1", "pod-2"]);
    let client = Client::start(&node, &net, "10.96.24.10:80");
    std::thread::sleep(Duration::from_millis(300));
    for round in 0..3 {
        if round == 1 {
            node.kill_agent();
        } else {
            node.stop_agent();
        }
        std::thread::sleep(Duration::from_millis(300));
        node.start_kube_agent(&cluster.kubeconfig(), &[]);
        std::thread::sleep(Duration::from_millis(1500));
    }
    api.apply(slice("web", "web-1", &[("10.244.24.2", "node-a")]));
    wait_for_backends(&node, &net, "10.96.24.10:80", &[], &["pod-2"]);
    assert_no_failures("restarts", client.finish());
    assert!(node.agent_log().contains("adopted_frontends=1"), "{}", node.agent_log());
}

/// Every open watch is told its version expired (410 Gone, as after an etcd
/// compaction): the agent relists, keeps the maps meanwhile and converges,
/// including a change made while it was relisting.
/// Stand-in: an injected fault (every open watch expired with 410 at the
/// moment the test chooses).
#[test]
fn an_expired_watch_relists_without_flushing() {
    let mut net = PodNetwork::new();
    pod_ips(&mut net, "10.244.25", 3);
    let cluster = Cluster::new(1);
    let api = cluster.api();
    api.apply_all(vec![
        node_obj("node-a", "z1"),
        service("a", "10.96.25.10", 80, json!({}), json!({})),
        slice("a", "a-1", &[("10.244.25.1", "node-a"), ("10.244.25.2", "node-a")]),
        service("b", "10.96.25.11", 80, json!({}), json!({})),
        slice("b", "b-1", &[("10.244.25.3", "node-a")]),
    ]);
    let mut node = Node::new("node-a");
    node.start_kube_agent(&cluster.kubeconfig(), &[]);
    wait_for_backends(&node, &net, "10.96.25.10:80", &[], &["pod-1", "pod-2"]);
    wait_for_backends(&node, &net, "10.96.25.11:80", &[], &["pod-3"]);
    eventually("three open watches", || if api.open_watches() >= 3 { Ok(()) } else { Err(api.open_watches()) });
    let lists_before = api.requests().iter().filter(|r| !r.contains("watch=true") && r.starts_with("GET")).count();
    let client = Client::start(&node, &net, "10.96.25.10:80");
    std::thread::sleep(Duration::from_millis(300));

    api.expire_watches();
    api.apply(slice("b", "b-1", &[("10.244.25.1", "node-a")]));
    wait_for_backends(&node, &net, "10.96.25.11:80", &[], &["pod-1"]);
    wait_metric(&node, "topoproxy_errors_total{reason=\"watch_expired\"}", |v| v >= 3.0);
    eventually("a relist of every kind", || {
        let lists = api.requests().iter().filter(|r| !r.contains("watch=true") && r.starts_with("GET")).count();
        if lists >= lists_before + 3 { Ok(()) } else { Err(lists) }
    });
    // Converged on a change made after the relist too.
    api.apply(slice("a", "a-1", &[("10.244.25.2", "node-a")]));
    wait_for_backends(&node, &net, "10.96.25.10:80", &[], &["pod-2"]);
    assert_no_failures("relist", client.finish());
}

/// /healthz, /readyz and /metrics; Events for bad Services, posted once.
/// Stand-in: an injected fault (the API server absent when the agent
/// starts) and Events read back as posted.
#[test]
fn health_metrics_and_events() {
    let mut net = PodNetwork::new();
    pod_ips(&mut net, "10.244.26", 2);
    let mut cluster = Cluster::new(1);
    let addr = cluster.api().addr();
    // The API server is down when the agent starts.
    if let Some(api) = cluster.api.take() {
        api.stop();
    }
    let mut node = Node::new("node-a");
    // Frequent periodic syncs, to show they do not repeat Events.
    node.start_kube_agent(&cluster.kubeconfig(), &["--sync-period-secs", "1"]);
    let haddr = node.healthz_address();
    eventually("/readyz to say what it waits for", || match http_get(haddr, "/readyz") {
        Ok((503, body)) if body.contains("waiting for Services, EndpointSlices and Nodes to be listed") => Ok(()),
        other => Err(other),
    });
    let (code, body) = http_get(haddr, "/healthz").expect("healthz");
    assert_eq!(code, 200, "an unreachable API server does not make the agent unhealthy: {body}");
    let v: Value = serde_json::from_str(&body).expect("/healthz answers JSON");
    assert_eq!(v["nodeEligible"], true, "eligible until a Node says otherwise: {v}");
    let (code, _) = http_get(haddr, "/nope").expect("404");
    assert_eq!(code, 404);

    let trigger = "2020-01-01T00:00:00Z";
    let mut with_trigger = slice("web", "web-1", &[("not-an-ip", "node-a"), ("10.244.26.1", "node-a"), ("10.244.26.2", "node-a")]);
    with_trigger["metadata"]["annotations"] = json!({"endpoints.kubernetes.io/last-change-trigger-time": trigger});
    // 1.21: the last release with spec.topologyKeys.
    cluster.api = Some(ApiServer::start_as(
        KubeVersion::V1_21,
        addr,
        1,
        vec![
            node_obj("node-a", "z1"),
            service("web", "10.96.26.10", 80, json!({}), json!({})),
            with_trigger,
            // "*" must be last (ValidateService in 1.17-1.21).
            service("keys", "10.96.26.11", 80, json!({"topologyKeys": ["*", ZONE]}), json!({})),
            slice("keys", "keys-1", &[("10.244.26.1", "node-a")]),
            service("badip", "10.96.26.300", 80, json!({}), json!({})),
        ],
    ));
    let api = cluster.api();
    wait_for_backends(&node, &net, "10.96.26.10:80", &[], &["pod-1", "pod-2"]);
    // Invalid topology keys are ignored (reported), the Service still works.
    wait_for_backends(&node, &net, "10.96.26.11:80", &[], &["pod-1"]);
    // Ready once the first sync is applied and the socket termination
    // mechanism is known (found beside that sync), which can trail the
    // first programmed backends.
    eventually("/readyz to answer ok", || match http_get(haddr, "/readyz") {
        Ok((200, body)) if body.trim() == "ok" => Ok(()),
        other => Err(format!("{other:?}")),
    });

    let want = [("web", "InvalidEndpointSlice"), ("keys", "InvalidTopologyKeys"), ("badip", "InvalidService")];
    let summary = |evs: &[Value]| -> Vec<(String, String)> {
        let mut v: Vec<(String, String)> = evs
            .iter()
            .map(|e| (e["regarding"]["name"].as_str().unwrap_or("").to_string(), e["reason"].as_str().unwrap_or("").to_string()))
            .collect();
        v.sort();
        v
    };
    let mut expected: Vec<(String, String)> = want.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect();
    expected.sort();
    eventually("an Event for each bad Service", || {
        let got = summary(&api.events());
        if got == expected { Ok(()) } else { Err(got) }
    });
    for e in api.events() {
        assert_eq!(e["reportingController"], "topoproxy", "{e}");
        assert_eq!(e["reportingInstance"], "topoproxy-node-a", "{e}");
        assert_eq!(e["type"], "Warning", "{e}");
        assert_eq!(e["regarding"]["kind"], "Service", "{e}");
        assert!(e["regarding"]["uid"].as_str().is_some_and(|u| !u.is_empty()), "{e}");
        assert_eq!(e["metadata"]["namespace"], "default", "{e}");
    }
    let badip = api.events().into_iter().find(|e| e["regarding"]["name"] == "badip").expect("badip event");
    assert!(badip["note"].as_str().is_some_and(|n| n.contains("10.96.26.300") && n.contains("is not an IP address")), "{badip}");
    let keys = api.events().into_iter().find(|e| e["regarding"]["name"] == "keys").expect("keys event");
    assert!(keys["note"].as_str().is_some_and(|n| n.contains("topologyKeys")), "{keys}");

    // More syncs (an EndpointSlice change that keeps the bad endpoint, a
    // periodic resync) do not repeat the Events.
    let mut changed = slice("web", "web-1", &[("not-an-ip", "node-a"), ("10.244.26.1", "node-a")]);
    changed["metadata"]["annotations"] = json!({"endpoints.kubernetes.io/last-change-trigger-time": trigger});
    api.apply(changed);
    wait_for_backends(&node, &net, "10.96.26.10:80", &[], &["pod-1"]);
    let syncs = metric(&metrics_text(&node), "topoproxy_syncs_total").unwrap_or(0.0);
    wait_metric(&node, "topoproxy_syncs_total", |v| v >= syncs + 2.0);
    assert_eq!(summary(&api.events()), expected, "Events are posted once per problem");

    let text = metrics_text(&node);
    let m = |s: &str| metric(&text, s).unwrap_or_else(|| panic!("{s} missing from\n{text}"));
    assert!(m("topoproxy_sync_duration_seconds_count") >= 2.0);
    assert_eq!(m("topoproxy_services_programmed"), 2.0);
    assert_eq!(m("topoproxy_frontends_programmed"), 2.0);
    assert_eq!(m("topoproxy_endpoints_programmed"), 2.0);
    assert_eq!(m("topoproxy_map_entries{map=\"SERVICES\"}"), 2.0);
    assert_eq!(m("topoproxy_map_entries{map=\"BACKENDS\"}"), 1.0);
    assert!(m("topoproxy_map_capacity{map=\"SLOTS\"}") > 0.0);
    assert_eq!(m("topoproxy_objects{kind=\"Service\"}"), 3.0);
    assert!(m("topoproxy_errors_total{reason=\"invalid_service\"}") >= 1.0);
    assert!(m("topoproxy_errors_total{reason=\"invalid_endpoint_slice\"}") >= 1.0);
    assert!(m("topoproxy_errors_total{reason=\"invalid_topology\"}") >= 1.0);
    assert!(m("topoproxy_errors_total{reason=\"watch\"}") >= 1.0, "the initial outage is counted");
    assert_eq!(m("topoproxy_kubernetes_events_posted_total"), 3.0);
    // The slice change carried a trigger time years ago: programming latency
    // is measured from it, like kube-proxy does.
    assert_eq!(m("topoproxy_network_programming_duration_seconds_count{kind=\"EndpointSlice\"}"), 1.0);
    assert!(m("topoproxy_network_programming_duration_seconds_sum{kind=\"EndpointSlice\"}") > 86_400.0 * 365.0);
    // kube-proxy's names for the same figures.
    assert!(m("kubeproxy_sync_proxy_rules_duration_seconds_count") >= m("topoproxy_sync_duration_seconds_count"));
    assert!(m("kubeproxy_sync_proxy_rules_last_timestamp_seconds") > 1.7e9);
    assert_eq!(m("kubeproxy_network_programming_duration_seconds_count"), 1.0, "the EndpointSlice change");
    assert_eq!(m("kubeproxy_network_programming_duration_seconds_bucket{le=\"300.0\"}"), 0.0, "a trigger years ago");
    assert!(m("kubeproxy_sync_proxy_rules_service_changes_total") >= 2.0, "two valid Services listed");
    assert!(m("kubeproxy_sync_proxy_rules_endpoint_changes_total") >= 3.0, "two slices listed, one changed");
    assert_eq!(m("kubeproxy_sync_proxy_rules_no_local_endpoints_total{traffic_policy=\"internal\"}"), 0.0);
    assert!(m("kubeproxy_proxy_healthz_total{code=\"200\"}") >= 1.0);
    let log = node.agent_log();
    assert!(log.contains("default/badip") && log.contains("is not an IP address"), "{log}");
    assert_eq!(log.matches("object skipped: spec.clusterIPs: \"10.96.26.300\"").count(), 1, "a bad object is logged once: {log}");
}

/// `/healthz`, as cloud load balancers probe it (KEP-3836), fails while this
/// node is going away: its Node gets a `deletionTimestamp`, or the cluster
/// autoscaler's `ToBeDeletedByClusterAutoscaler` taint. Through the real
/// watcher; `/livez` (the kubelet's liveness probe) and the traffic are not
/// affected.
/// Stand-in: a Node with a deletionTimestamp that stays (a real server
/// deletes a Node without finalizers at once).
#[test]
fn healthz_fails_while_this_node_is_going_away() {
    let mut net = PodNetwork::new();
    pod_ips(&mut net, "10.244.29", 1);
    let cluster = Cluster::new(1);
    let api = cluster.api();
    api.apply_all(vec![
        node_obj("node-a", "z1"),
        node_obj("node-b", "z1"),
        service("web", "10.96.29.10", 80, json!({}), json!({})),
        slice("web", "web-1", &[("10.244.29.1", "node-a")]),
        service("only-local", "10.96.29.11", 80, json!({"internalTrafficPolicy": "Local"}), json!({})),
        slice("only-local", "only-local-1", &[("10.244.29.1", "node-b")]),
    ]);
    let mut node = Node::new("node-a");
    node.start_kube_agent(&cluster.kubeconfig(), &[]);
    wait_for_backends(&node, &net, "10.96.29.10:80", &[], &["pod-1"]);
    let haddr = node.healthz_address();
    let get = |path: &str| -> (u16, Value) {
        let (code, body) = http_get(haddr, path).unwrap_or_else(|e| panic!("{path}: {e}"));
        (code, serde_json::from_str(&body).unwrap_or_else(|e| panic!("{path} {body:?}: {e}")))
    };
    let healthz_is = |want: u16| {
        eventually(&format!("/healthz {want}"), || match get("/healthz") {
            (code, v) if code == want => Ok(v),
            other => Err(other),
        })
    };
    let v = healthz_is(200);
    assert_eq!(v["nodeEligible"], true, "{v}");
    let time = |v: &Value, field: &str| -> k8s_openapi::jiff::Timestamp {
        v[field].as_str().and_then(|t| t.parse().ok()).unwrap_or_else(|| panic!("{field} is no RFC 3339 time: {v}"))
    };
    assert_eq!(time(&v, "lastUpdated"), time(&v, "currentTime"), "healthy: lastUpdated is now, as kube-proxy answers: {v}");

    // Being deleted (the finalizers of a real cluster keep it around).
    let mut deleting = node_obj("node-a", "z1");
    deleting["metadata"]["deletionTimestamp"] = json!("2024-05-01T10:00:00Z");
    api.apply(deleting);
    let v = healthz_is(503);
    assert_eq!(v["nodeEligible"], false, "{v}");
    assert!(time(&v, "lastUpdated") <= time(&v, "currentTime"), "{v}");
    let (code, v) = get("/livez");
    assert_eq!(code, 200, "a node going away is no reason to restart its proxy: {v}");
    assert!(v.get("nodeEligible").is_none() && v["lastUpdated"].is_string(), "{v}");
    // The datapath keeps serving until the node is gone.
    wait_for_backends(&node, &net, "10.96.29.10:80", &[], &["pod-1"]);
    assert!(node.agent_log().contains("this node is going away (its Node has a deletionTimestamp)"), "{}", node.agent_log());

    // Back to normal, then tainted by the cluster autoscaler.
    api.apply(node_obj("node-a", "z1"));
    healthz_is(200);
    let mut tainted = node_obj("node-a", "z1");
    tainted["spec"] = json!({"taints": [{"key": "ToBeDeletedByClusterAutoscaler", "value": "1714557600", "effect": "NoSchedule"}]});
    api.apply(tainted);
    let v = healthz_is(503);
    assert_eq!(v["nodeEligible"], false, "{v}");
    // Another node's taint is not ours.
    api.apply(node_obj("node-a", "z1"));
    let mut other = node_obj("node-b", "z1");
    other["spec"] = json!({"taints": [{"key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule"}]});
    api.apply(other);
    healthz_is(200);

    let text = metrics_text(&node);
    let m = |s: &str| metric(&text, s).unwrap_or_else(|| panic!("{s} missing from\n{text}"));
    assert!(m("kubeproxy_proxy_healthz_total{code=\"503\"}") >= 2.0, "{text}");
    assert!(m("kubeproxy_proxy_healthz_total{code=\"200\"}") >= 3.0, "{text}");
    assert!(m("kubeproxy_proxy_livez_total{code=\"200\"}") >= 1.0, "{text}");
    assert_eq!(m("kubeproxy_sync_proxy_rules_no_local_endpoints_total{traffic_policy=\"internal\"}"), 1.0, "only-local: {text}");
    assert_eq!(m("kubeproxy_sync_proxy_rules_no_local_endpoints_total{traffic_policy=\"external\"}"), 0.0, "{text}");
    assert!(m("kubeproxy_sync_proxy_rules_duration_seconds_count") >= 1.0);
    assert!(m("kubeproxy_sync_proxy_rules_service_changes_total") >= 2.0);
    assert!(m("kubeproxy_sync_proxy_rules_endpoint_changes_total") >= 2.0);
}

/// A map that is too small: what does not fit is logged and counted, the
/// rest works, and the Service is programmed once there is room.
/// Stand-in: hundreds of Services written in one step, with no controller
/// in between.
#[test]
fn a_full_map_is_reported_and_retried() {
    let mut net = PodNetwork::new();
    pod_ips(&mut net, "10.244.27", 1);
    let cluster = Cluster::new(1);
    let api = cluster.api();
    api.apply(node_obj("node-a", "z1"));
    for (i, name) in ["s1", "s2", "s3"].iter().enumerate() {
        api.apply(service(name, &format!("10.96.27.{}", 10 + i), 80, json!({}), json!({})));
        api.apply(slice(name, &format!("{name}-1"), &[("10.244.27.1", "node-a")]));
    }
    let mut node = Node::new("node-a");
    node.start_kube_agent(&cluster.kubeconfig(), &["--max-services", "2"]);
    wait_metric(&node, "topoproxy_errors_total{reason=\"map_full\"}", |v| v >= 1.0);
    wait_metric(&node, "topoproxy_frontends_programmed", |v| v == 2.0);
    let log = node.agent_log();
    assert!(log.contains("map SERVICES is full") && log.contains("--max-services"), "{log}");
    // Frontends are written in address order: s3 (10.96.27.12) did not fit.
    wait_for_backends(&node, &net, "10.96.27.10:80", &[], &["pod-1"]);
    let r = node.probe(&net, &["--to", "10.96.27.12:80", "--timeout-ms", "1000"]);
    assert_eq!(r[0]["errno"], 101, "{}", r[0]);
    // Room again: the next sync programs it.
    assert!(api.delete("Service", "default", "s1"));
    wait_for_backends(&node, &net, "10.96.27.12:80", &[], &["pod-1"]);
    unreachable(&node, &net, "10.96.27.10:80");
}

/// The same health and metrics server in manifests mode, when asked for.
#[test]
fn manifests_mode_serves_health_and_metrics_when_asked() {
    let mut net = PodNetwork::new();
    pod_ips(&mut net, "10.244.28", 1);
    let mut node = Node::new("node-a");
    node.write_manifest(
        "web.yaml",
        &ServiceSpec {
            name: "web",
            cluster_ips: &["10.96.28.10"],
            ports: &[("", 80, "TCP", 8080)],
            endpoints: &[("10.244.28.1", true, "node-a")],
            extra_spec: "",
            annotations: "",
        }
        .yaml(),
    );
    node.write_manifest("node.yaml", "apiVersion: v1\nkind: Node\nmetadata: {name: node-a}\n");
    node.start_agent_with(&["--healthz-bind-address", "127.0.0.1:0", "--metrics-bind-address", "127.0.0.1:0"]);
    wait_for_backends(&node, &net, "10.96.28.10:80", &[], &["pod-1"]);
    // Ready once the first sync is applied and the socket termination
    // mechanism is known (found beside that sync): it can trail the first
    // programmed backends.
    eventually("/readyz to answer ok", || match http_get(node.healthz_address(), "/readyz") {
        Ok((200, body)) if body.trim() == "ok" => Ok(()),
        other => Err(format!("{other:?}")),
    });
    wait_metric(&node, "topoproxy_frontends_programmed", |v| v == 1.0);
    wait_metric(&node, "topoproxy_map_entries{map=\"BACKENDS\"}", |v| v == 1.0);
    wait_metric(&node, "kubeproxy_sync_proxy_rules_service_changes_total", |v| v == 1.0);
    wait_metric(&node, "kubeproxy_sync_proxy_rules_endpoint_changes_total", |v| v >= 1.0);

    // The Node manifest says the node is going away, then that it is not.
    let haddr = node.healthz_address();
    let healthz_is = |want: u16, eligible: bool| {
        eventually(&format!("/healthz {want}"), || match http_get(haddr, "/healthz") {
            Ok((code, body)) if code == want => {
                let v: Value = serde_json::from_str(&body).map_err(|e| format!("{body:?}: {e}"))?;
                if v["nodeEligible"] == eligible { Ok(()) } else { Err(body) }
            }
            other => Err(format!("{other:?}")),
        });
    };
    healthz_is(200, true);
    let leaving = "apiVersion: v1\nkind: Node\nmetadata: {name: node-a, deletionTimestamp: \"2024-05-01T10:00:00Z\"}\n";
    node.write_manifest("node.yaml", leaving);
    healthz_is(503, false);
    let (code, _) = http_get(haddr, "/livez").expect("livez");
    assert_eq!(code, 200);
    node.write_manifest("node.yaml", "apiVersion: v1\nkind: Node\nmetadata: {name: node-a}\n");
    healthz_is(200, true);
    let tainted = "apiVersion: v1\nkind: Node\nmetadata: {name: node-a}\nspec:\n  taints: [{key: ToBeDeletedByClusterAutoscaler, effect: NoSchedule}]\n";
    node.write_manifest("node.yaml", tainted);
    healthz_is(503, false);
    wait_for_backends(&node, &net, "10.96.28.10:80", &[], &["pod-1"]);
}
