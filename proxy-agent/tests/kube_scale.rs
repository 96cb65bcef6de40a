//! 1,000 Services with 10 endpoints each, created at once on the stand-in
//! API server (Stand-in: 10,000 endpoints written in one step, faster than
//! Pods through a real controller): all programmed exactly (checked through the agent's metrics,
//! by reading the pinned maps back and by connecting), then all deleted and
//! the maps are empty. Deadlines are only for waiting; speed is measured
//! by the benchmarks, not here.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use proxy_agent::datapath::map_writer::MapWriter;
use proxy_agent::model::{Backend, Frontend, Protocol};
use proxy_test_support::apiserver::ApiServer;
use proxy_test_support::http::{http_get, metric};
use proxy_test_support::sandbox::spawn_backend;
use serde_json::{Value, json};
use support::*;

const SERVICES: usize = 1000;
const ENDPOINTS: usize = 10;

fn svc_ip(i: usize) -> String {
    format!("10.97.{}.{}", i / 250, i % 250 + 1)
}

fn ep_ip(i: usize, j: usize) -> String {
    let k = i * ENDPOINTS + j;
    format!("10.245.{}.{}", k / 250, k % 250 + 1)
}

fn objects() -> Vec<Value> {
    let mut out = Vec::new();
    for i in 0..SERVICES {
        let name = format!("svc-{i}");
        out.push(json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": "scale"},
            "spec": {"clusterIP": svc_ip(i), "clusterIPs": [svc_ip(i)], "ports": [{"port": 80, "protocol": "TCP", "targetPort": 8080}]},
        }));
        let eps: Vec<Value> =
            (0..ENDPOINTS).map(|j| json!({"addresses": [ep_ip(i, j)], "conditions": {"ready": true}, "nodeName": "node-a"})).collect();
        out.push(json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": format!("{name}-abcde"), "namespace": "scale", "labels": {"kubernetes.io/service-name": name}},
            "addressType": "IPv4",
            "ports": [{"port": 8080, "protocol": "TCP"}],
            "endpoints": eps,
        }));
    }
    out
}

fn expected() -> BTreeMap<Frontend, BTreeSet<Backend>> {
    (0..SERVICES)
        .map(|i| {
            let fe = Frontend { ip: svc_ip(i).parse().expect("ip"), port: 80, protocol: Protocol::Tcp };
            let bes = (0..ENDPOINTS).map(|j| Backend { ip: ep_ip(i, j).parse().expect("ip"), port: 8080 }).collect();
            (fe, bes)
        })
        .collect()
}

/// Like `eventually`, with a deadline sized for a loaded 2-core machine.
fn wait_long<D: std::fmt::Debug>(what: &str, mut check: impl FnMut() -> Result<(), D>) {
    let deadline = Instant::now() + Duration::from_mins(3);
    loop {
        match check() {
            Ok(()) => return,
            Err(last) if Instant::now() > deadline => panic!("timed out waiting for {what}; last saw {last:?}"),
            Err(_) => std::thread::sleep(Duration::from_millis(250)),
        }
    }
}

/// Entries in a pinned map as the kernel holds them (bpftool), without
/// going through the agent's own bookkeeping.
fn raw_entries(pins: &std::path::Path, map: &str) -> usize {
    let out =
        std::process::Command::new("bpftool").args(["--json", "map", "dump", "pinned"]).arg(pins.join(map)).output().expect("run bpftool");
    assert!(out.status.success(), "bpftool: {}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).expect("bpftool JSON");
    v.as_array().map_or(0, Vec::len)
}

fn metrics_of(node: &Node) -> String {
    http_get(node.metrics_address(), "/metrics").map(|(_, b)| b).unwrap_or_default()
}

fn wait_programmed(node: &Node, frontends: f64, endpoints: f64) {
    wait_long(&format!("{frontends} frontends with {endpoints} endpoints programmed"), || {
        let text = metrics_of(node);
        let got = (
            metric(&text, "topoproxy_frontends_programmed"),
            metric(&text, "topoproxy_endpoints_programmed"),
            metric(&text, "topoproxy_services_programmed"),
        );
        if got == (Some(frontends), Some(endpoints), Some(frontends)) { Ok(()) } else { Err(got) }
    });
}

#[test]
fn a_thousand_services_with_ten_endpoints_each() {
    let net = PodNetwork::new();
    // Real listeners for the Services that are probed: one process per
    // Service answering on all ten endpoint addresses with the Service's name.
    let probed = [0usize, 499, 999];
    let mut backends = Vec::new();
    for &i in &probed {
        let cidrs: Vec<String> = (0..ENDPOINTS).map(|j| format!("{}/32", ep_ip(i, j))).collect();
        net.netns.add_loopback_addrs(&cidrs.iter().map(String::as_str).collect::<Vec<_>>()).expect("addresses");
        let listen: Vec<String> = (0..ENDPOINTS).map(|j| format!("{}:8080", ep_ip(i, j))).collect();
        backends.push(spawn_backend(&agent_bin(), &net.netns, &format!("svc-{i}"), &listen).expect("backend"));
    }

    let dir = TempDir::new("tpt-kube-scale");
    let kubeconfig = dir.0.join("kubeconfig");
    let api = ApiServer::start(1);
    api.write_kubeconfig(&kubeconfig);
    api.apply(json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a", "labels": {"topology.kubernetes.io/zone": "z1"}}}));
    let mut node = Node::new("node-a");
    node.start_kube_agent(&kubeconfig, &[]);
    wait_long("readiness", || match http_get(node.healthz_address(), "/readyz") {
        Ok((200, _)) => Ok(()),
        other => Err(other),
    });

    // All at once.
    let syncs_before = metric(&metrics_of(&node), "topoproxy_syncs_total").unwrap_or(0.0);
    api.apply_all(objects());
    wait_programmed(&node, SERVICES as f64, (SERVICES * ENDPOINTS) as f64);
    // Level-triggered and coalescing: 2,000 watch events are applied by a
    // few recomputations, not one each (the bound is loose on purpose).
    let text = metrics_of(&node);
    let events = metric(&text, "topoproxy_watch_events_total{kind=\"Service\"}").unwrap_or(0.0)
        + metric(&text, "topoproxy_watch_events_total{kind=\"EndpointSlice\"}").unwrap_or(0.0);
    let syncs = metric(&text, "topoproxy_syncs_total").unwrap_or(0.0) - syncs_before;
    assert_eq!(events, (2 * SERVICES) as f64, "{text}");
    eprintln!("{syncs} syncs applied {events} watch events");
    assert!(syncs < 100.0, "{syncs} syncs for {events} events");
    for &i in &probed {
        wait_for_backends(&node, &net, &format!("{}:80", svc_ip(i)), &[], &[&format!("svc-{i}")]);
    }
    let text = metrics_of(&node);
    assert_eq!(metric(&text, "topoproxy_map_entries{map=\"SERVICES\"}"), Some(SERVICES as f64), "{text}");
    assert_eq!(metric(&text, "topoproxy_map_entries{map=\"SLOTS\"}"), Some((SERVICES * ENDPOINTS) as f64));
    assert_eq!(metric(&text, "topoproxy_map_entries{map=\"BACKENDS\"}"), Some((SERVICES * ENDPOINTS) as f64));

    // Read the maps back with the agent stopped (opening a writer cleans up
    // orphans, which must never race a running agent's update).
    node.stop_agent();
    assert_eq!(raw_entries(node.pins.path(), "SERVICES"), SERVICES);
    assert_eq!(raw_entries(node.pins.path(), "SLOTS"), SERVICES * ENDPOINTS);
    assert_eq!(raw_entries(node.pins.path(), "BACKENDS"), SERVICES * ENDPOINTS);
    let state = MapWriter::open(node.pins.path()).expect("open pinned maps").state();
    let want = expected();
    assert_eq!(state.len(), want.len());
    for (fe, bes) in &want {
        assert_eq!(state.get(fe), Some(bes), "frontend {fe}");
    }

    // A restarted agent adopts the 1,000 frontends and then follows the
    // deletion of everything.
    node.start_kube_agent(&kubeconfig, &[]);
    wait_long("the restarted agent to be ready", || match http_get(node.healthz_address(), "/readyz") {
        Ok((200, _)) => Ok(()),
        other => Err(other),
    });
    assert!(node.agent_log().contains("adopted_frontends=1000"), "{}", node.agent_log());
    api.delete_all("Service");
    api.delete_all("EndpointSlice");
    wait_programmed(&node, 0.0, 0.0);
    let text = metrics_of(&node);
    for map in ["SERVICES", "SLOTS", "BACKENDS"] {
        assert_eq!(metric(&text, &format!("topoproxy_map_entries{{map=\"{map}\"}}")), Some(0.0), "{map}: {text}");
    }
    let r = node.probe(&net, &["--to", &format!("{}:80", svc_ip(499)), "--timeout-ms", "1000"]);
    assert_eq!(r[0]["errno"], 101, "a deleted Service is no longer translated: {}", r[0]);
    node.stop_agent();
    for map in ["SERVICES", "SLOTS", "BACKENDS"] {
        assert_eq!(raw_entries(node.pins.path(), map), 0, "map {map} holds entries after every Service was deleted");
    }
    let w = MapWriter::open(node.pins.path()).expect("open pinned maps");
    assert!(w.state().is_empty());
    for (map, used, _) in w.occupancy() {
        assert_eq!(used, 0, "map {map} is not empty");
    }
    drop(backends);
}
