//! Per-Service connection counts by topology tier (issue #34) on the
//! demo's simulated cluster (`examples/demo`): three nodes, each with its
//! own agent (own cgroup, own pin directory), two zones and two OpenYurt
//! node pools that disagree on node-2, four pods in front of three
//! Services. From every node, the connections made to each Service are
//! counted in the datapath tier by tier, read back with `explain --live`:
//!
//! * the node-pool Service (`svc-ud1`): every connection `pool`;
//! * the zone-keyed Service (`svc-ud1-zone`): every connection `zone`;
//! * the Service without topology: each connection in the tier of the pod
//!   that answered (node, zone or region), spread over several;
//!
//! and the blind-remote sum grows by the share of the Service's pods
//! outside the node's zone per connection.

mod support;

use std::collections::BTreeMap;
use std::process::Stdio;

use serde_json::Value;
use support::*;

/// The demo's pods: (name, address, node).
const PODS: [(&str, &str, &str); 4] = [
    ("hangzhou-a", "10.244.1.2", "node-1"),
    ("hangzhou-b", "10.244.2.2", "node-2"),
    ("shanghai-a", "10.244.3.2", "node-3"),
    ("shanghai-b", "10.244.3.3", "node-3"),
];
const NODES: [&str; 3] = ["node-1", "node-2", "node-3"];
const POOL: &str = "svc-ud1";
const NO_TOPOLOGY: &str = "svc-ud1-without-topology";
const ZONE: &str = "svc-ud1-zone";
/// (Service, ClusterIP:port)
const SERVICES: [(&str, &str); 3] = [(POOL, "10.96.0.11:80"), (NO_TOPOLOGY, "10.96.0.12:80"), (ZONE, "10.96.0.13:80")];
const TIERS: [&str; 5] = ["other", "node", "zone", "region", "pool"];
/// Connections made per node and Service.
const CONNECTIONS: usize = 40;

/// Where a pod runs relative to a node, from the demo's labels: node-1
/// zone-a pool hangzhou, node-2 zone-b pool hangzhou, node-3 zone-b pool
/// shanghai, all region-1.
fn physical_tier(node: &str, pod: &str) -> &'static str {
    let on = PODS.iter().find(|p| p.0 == pod).expect("a demo pod").2;
    let zone = |n: &str| if n == "node-1" { "zone-a" } else { "zone-b" };
    if on == node {
        "node"
    } else if zone(on) == zone(node) {
        "zone"
    } else {
        "region"
    }
}

/// What each Service's ranking leaves a node (the demo's README).
fn reachable(node: &str, service: &str) -> Vec<&'static str> {
    match (service, node) {
        (POOL, "node-3") => vec!["shanghai-a", "shanghai-b"],
        (POOL, _) => vec!["hangzhou-a", "hangzhou-b"],
        (ZONE, "node-1") => vec!["hangzhou-a"],
        (ZONE, _) => vec!["hangzhou-b", "shanghai-a", "shanghai-b"],
        _ => PODS.iter().map(|p| p.0).collect(),
    }
}

/// Per Service: the counts per tier and the blind-remote sum, as
/// `explain --live` reads them from `node`'s pins.
fn live_counts(node: &Node) -> BTreeMap<String, (BTreeMap<String, u64>, f64)> {
    let out = std::process::Command::new(agent_bin())
        .args(["explain", "--node", &node.name, "--output", "json", "--live", "--bpffs"])
        .arg(node.pins.path())
        .arg("--manifests")
        .arg(&node.manifests.0)
        .stdin(Stdio::null())
        .output()
        .expect("run explain --live");
    assert!(out.status.success(), "explain --live: {}", String::from_utf8_lossy(&out.stderr));
    let doc: Value = serde_json::from_slice(&out.stdout).expect("explain JSON");
    doc["services"]
        .as_array()
        .expect("services")
        .iter()
        .map(|s| {
            let c = &s["connections"];
            let tiers = TIERS.iter().map(|t| ((*t).to_string(), c[*t].as_u64().expect("a count per tier"))).collect();
            (s["name"].as_str().expect("name").to_string(), (tiers, c["blindRemote"].as_f64().expect("blindRemote")))
        })
        .collect()
}

/// The demo's pods, and a node of the demo's cluster for each of `names`
/// with its agent started and every Service reachable as its topology
/// says.
fn demo(names: &[&str]) -> (PodNetwork, Vec<Node>) {
    let mut net = PodNetwork::new();
    for (pod, ip, _) in PODS {
        net.backend(pod, ip, &[9376]);
    }
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/demo");
    let mut nodes: Vec<Node> = names.iter().map(|n| Node::new(n)).collect();
    for n in &mut nodes {
        for file in ["nodes.yaml", "services.yaml", "endpointslices.yaml"] {
            n.write_manifest(file, &std::fs::read_to_string(dir.join(file)).expect("demo manifest"));
        }
        // A metrics port of its own: the test scrapes every node.
        n.start_agent_with(&["--healthz-bind-address", "127.0.0.1:0", "--metrics-bind-address", "127.0.0.1:0"]);
    }
    for n in &nodes {
        wait_reachable(&net, n);
    }
    (net, nodes)
}

/// Each node's /metrics, written to `<target>/tmp/dashboard/<node>.prom`,
/// and the dashboard's picture drawn from them by the book's script
/// (`docs/scripts/render_dashboard.py`, which `cargo xtask docs
/// --dashboard` runs to make the guide's image): its panels from these
/// real counts. The script needs matplotlib, which `cargo xtask setup`
/// installs into `<target>/chart-venv`.
fn scrape_and_draw(nodes: &[Node]) {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("dashboard");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scrape directory");
    let mut files = Vec::new();
    for n in nodes {
        let (code, body) = proxy_test_support::http::http_get(n.metrics_address(), "/metrics").expect("scrape /metrics");
        assert_eq!(code, 200, "{body}");
        assert!(body.contains("topoproxy_service_connections_total{"), "{} exports no connection counts:\n{body}", n.name);
        let file = dir.join(format!("{}.prom", n.name));
        std::fs::write(&file, body).expect("write scrape");
        files.push(file);
    }
    let python = std::path::Path::new(env!("CARGO_BIN_EXE_proxy-agent"))
        .ancestors()
        .map(|d| d.join("chart-venv/bin/python"))
        .find(|p| p.exists())
        .expect("<target>/chart-venv (cargo xtask setup)");
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/scripts/render_dashboard.py");
    let png = dir.join("dashboard.png");
    let out = std::process::Command::new(python).arg(script).arg(&png).args(&files).output().expect("run render_dashboard.py");
    assert!(out.status.success(), "render_dashboard.py: {}", String::from_utf8_lossy(&out.stderr));
    let bytes = std::fs::read(&png).expect("the picture");
    assert!(bytes.starts_with(b"\x89PNG") && bytes.len() > 10_000, "not a picture: {} bytes", bytes.len());
}

fn wait_reachable(net: &PodNetwork, n: &Node) {
    for (service, to) in SERVICES {
        wait_for_backends(n, net, to, &[], &reachable(&n.name, service));
    }
}

/// Makes `CONNECTIONS` connections from `n` to each Service and checks
/// that its counts grew by exactly those, tier by tier, and the
/// blind-remote sum by the share per connection. Returns how many tiers
/// the Service without topology used.
fn connect_and_check(net: &PodNetwork, n: &Node) -> usize {
    let before = live_counts(n);
    let mut want: BTreeMap<&str, BTreeMap<&str, u64>> = BTreeMap::new();
    for (service, to) in SERVICES {
        let count = CONNECTIONS.to_string();
        let r = n.probe(net, &["--to", to, "--count", &count, "--timeout-ms", "2000"]);
        assert_eq!(r.len(), CONNECTIONS);
        let w = want.entry(service).or_default();
        for attempt in &r {
            assert_eq!(attempt["ok"], true, "{service} from {}: {attempt}", n.name);
            let pod = attempt["reply"].as_str().expect("reply");
            let tier = match service {
                POOL => "pool",
                ZONE => "zone",
                _ => physical_tier(&n.name, pod),
            };
            *w.entry(tier).or_default() += 1;
        }
    }
    let after = live_counts(n);
    for (service, _) in SERVICES {
        let (b, a) = (&before[service], &after[service]);
        let got: BTreeMap<&str, u64> = TIERS.iter().map(|t| (*t, a.0[*t] - b.0[*t])).filter(|(_, d)| *d > 0).collect();
        assert_eq!(got, want[service], "{service} from {}, tier by tier", n.name);
        // Of the demo's four pods, node-1's zone holds one: a blind pick
        // leaves it 3 times in 4; node-2's and node-3's zone hold three.
        let share = if n.name == "node-1" { 0.75 } else { 0.25 };
        let blind = a.1 - b.1;
        assert!((blind - share * CONNECTIONS as f64).abs() < 1e-6, "{service} from {}: blind remote {blind}", n.name);
    }
    want[NO_TOPOLOGY].len()
}

#[test]
fn each_services_tier_counts_equal_the_connections_made_tier_by_tier() {
    let (net, nodes) = demo(&NODES);
    let mut spread = BTreeMap::new();
    for n in &nodes {
        spread.insert(n.name.clone(), connect_and_check(&net, n));
    }
    // Without topology the connections land wherever the pick sends them:
    // from every node on more than one tier (40 connections over four pods
    // in at least two tiers).
    assert!(spread.values().all(|tiers| *tiers >= 2), "{spread:?}");
    scrape_and_draw(&nodes);
}

/// An upgrade from the previous build's pins: no counting maps, backends
/// written without a tier (the byte was padding, 0), service entries
/// without tier bits, and a socket counter array one reason shorter. The
/// new agent creates the counting maps, rewrites the backends' tiers and
/// the entries' bits, migrates the counter array, and counts as before.
#[test]
fn an_upgrade_from_the_previous_pin_layout_counts_every_connection_in_its_tier() {
    use aya::maps::{HashMap, Map, MapData};
    use proxy_common as pc;

    let (net, mut nodes) = demo(&["node-2"]);
    let n = &mut nodes[0];
    n.stop_agent();
    let pins = n.pins.path().to_path_buf();
    for map in [pc::SVC_CONN_MAP, pc::SVC_TOPO_MAP, pc::NP_SVC_CONN_MAP, pc::NP_SVC_TOPO_MAP] {
        let _ = std::fs::remove_file(pins.join(map));
    }
    for map in [pc::BACKENDS_MAP, pc::NP_BACKENDS_MAP] {
        let Ok(data) = MapData::from_pin(pins.join(map)) else { continue };
        let mut m: HashMap<_, pc::BackendKey, pc::BackendValue> = HashMap::try_from(Map::HashMap(data)).expect("a hash map");
        let entries: Vec<_> = m.iter().filter_map(Result::ok).collect();
        for (k, v) in entries {
            m.insert(k, pc::BackendValue { tier: 0, ..v }, 0).expect("rewrite backend");
        }
    }
    for map in [pc::SERVICES_MAP, pc::NP_SERVICES_MAP] {
        let Ok(data) = MapData::from_pin(pins.join(map)) else { continue };
        let mut m: HashMap<_, pc::ServiceKey, pc::ServiceValue> = HashMap::try_from(Map::HashMap(data)).expect("a hash map");
        let entries: Vec<_> = m.iter().filter_map(Result::ok).collect();
        for (k, v) in entries {
            m.insert(k, pc::ServiceValue { flags: v.flags & !pc::SVC_TIER_MASK, ..v }, 0).expect("rewrite service");
        }
    }
    let counters = pins.join(pc::COUNTERS_MAP);
    std::fs::remove_file(&counters).expect("remove COUNTERS");
    let out = std::process::Command::new("bpftool")
        .args(["map", "create"])
        .arg(&counters)
        .args(["type", "percpu_array", "key", "4", "value", "8", "entries", &(pc::counter::COUNT - 1).to_string(), "name", "COUNTERS"])
        .output()
        .expect("run bpftool");
    assert!(out.status.success(), "bpftool map create: {}", String::from_utf8_lossy(&out.stderr));

    n.start_agent();
    // The old programs serve until the new agent swaps its own in: wait
    // for its first sync.
    proxy_test_support::wait::eventually("the upgraded agent's first sync", || {
        if n.agent_log().matches("first sync applied").count() >= 2 { Ok(()) } else { Err(()) }
    });
    wait_reachable(&net, n);
    for map in [pc::SVC_CONN_MAP, pc::SVC_TOPO_MAP] {
        assert!(pins.join(map).exists(), "{map} is pinned after the upgrade");
    }
    let resized = format!("map COUNTERS resized from {} to {}", pc::counter::COUNT - 1, pc::counter::COUNT);
    assert!(n.agent_log().contains(&resized), "{}", n.agent_log());
    connect_and_check(&net, n);
}

/// UDP: an unconnected socket counts one new flow for its first datagram
/// to a frontend, not one per datagram (sendmsg runs per datagram); a
/// connected one counts its connect(). Each in the tier of the pod that
/// answered (a Service without topology, from node-2).
#[test]
fn udp_flows_count_once_per_socket() {
    let (net, nodes) = demo(&["node-2"]);
    let n = &nodes[0];
    let endpoints: String = PODS
        .iter()
        .map(|(pod, ip, node)| {
            let zone = if *node == "node-1" { "zone-a" } else { "zone-b" };
            format!("  - addresses: [\"{ip}\"]\n    nodeName: {node}\n    zone: {zone}\n    targetRef: {{kind: Pod, name: {pod}}}\n")
        })
        .collect();
    n.write_manifest(
        "udp.yaml",
        &format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: dns, namespace: default}}\nspec:\n  clusterIP: 10.96.0.14\n  ports: [{{port: 53, protocol: UDP, targetPort: 9376}}]\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: dns-1, namespace: default, labels: {{kubernetes.io/service-name: dns}}}}\naddressType: IPv4\nports: [{{port: 9376, protocol: UDP}}]\nendpoints:\n{endpoints}"
        ),
    );
    let all: Vec<&str> = PODS.iter().map(|p| p.0).collect();
    wait_for_backends(n, &net, "10.96.0.14:53", &["--udp"], &all);
    for connected in [false, true] {
        let before = live_counts(n);
        let mut args = vec!["--to", "10.96.0.14:53", "--udp", "--per-socket", "5", "--count", "10"];
        if connected {
            args.push("--connected");
        }
        let r = n.probe(&net, &args);
        let mut want: BTreeMap<&str, u64> = BTreeMap::new();
        for socket in &r {
            assert_eq!(socket["ok"], true, "{socket}");
            assert_eq!(socket["sameBackend"], true, "{socket}");
            *want.entry(physical_tier("node-2", socket["reply"].as_str().expect("reply"))).or_default() += 1;
        }
        let after = live_counts(n);
        let got: BTreeMap<&str, u64> =
            TIERS.iter().map(|t| (*t, after["dns"].0[*t] - before["dns"].0[*t])).filter(|(_, d)| *d > 0).collect();
        assert_eq!(got, want, "10 sockets of 5 datagrams each, connected: {connected}");
    }
}
