//! `explain` runs `run`'s decision path: the same conversion, model and
//! sync pass (against in-memory maps), so it warns where `run` warns,
//! address clashes and full maps included. Unprivileged: no kernel needed.

use std::path::PathBuf;
use std::process::Command;

struct Dir(PathBuf);

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn explain(manifest: &str) -> serde_json::Value {
    // One directory per call: the tests of this file run in parallel.
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = Dir(std::env::temp_dir().join(format!("topoproxy-explain-{}-{n}", std::process::id())));
    std::fs::create_dir_all(&dir.0).expect("temp dir");
    let path = dir.0.join("cluster.yaml");
    std::fs::write(&path, manifest).expect("write manifest");
    let out = Command::new(env!("CARGO_BIN_EXE_proxy-agent"))
        .args(["explain", "--node", "a", "--output", "json", "--manifests"])
        .arg(&path)
        .output()
        .expect("run explain");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("explain prints JSON")
}

fn service(name: &str, ip: &str, endpoint: &str) -> String {
    format!(
        "---
kind: Service
metadata: {{name: {name}, namespace: shop}}
spec: {{clusterIP: {ip}, ports: [{{port: 80, targetPort: 8080}}]}}
---
kind: EndpointSlice
metadata: {{name: {name}-1, namespace: shop, labels: {{kubernetes.io/service-name: {name}}}}}
addressType: IPv4
ports: [{{port: 8080}}]
endpoints: [{{addresses: [{endpoint}], nodeName: a}}]
"
    )
}

#[test]
fn explain_warns_about_clashes_like_run() {
    let doc = explain(&format!(
        "kind: Node\nmetadata: {{name: a}}\n{}{}{}",
        service("one", "10.96.0.30", "10.244.1.1"),
        service("two", "10.96.0.30", "10.244.1.2"),
        "---\nkind: Service\nmetadata: {name: bad, namespace: shop}\nspec: {clusterIP: 10.96.0.999, ports: [{port: 80}]}\n"
    ));
    let warnings: Vec<&str> = doc["warnings"].as_array().expect("warnings").iter().filter_map(|w| w.as_str()).collect();
    assert!(warnings.iter().any(|w| w.contains("Service shop/two") && w.contains("already used by Service shop/one")), "{warnings:?}");
    assert!(warnings.iter().any(|w| w.contains("shop/bad") && w.contains("10.96.0.999")), "{warnings:?}");
    let services = doc["services"].as_array().expect("services");
    let one = services.iter().find(|s| s["name"] == "one").expect("one is explained");
    assert_eq!(one["clusterEndpoints"], serde_json::json!(["10.244.1.1:8080"]));
}

/// `clusterEndpoints` and `localEndpoints` are null when no traffic of the
/// port uses that set, as kube-proxy's CategorizeEndpoints returns them.
#[test]
fn explain_shows_only_the_endpoint_sets_in_use() {
    let svc = |name: &str, ip: &str, spec: &str| {
        format!(
            "---
kind: Service
metadata: {{name: {name}, namespace: shop}}
spec: {{clusterIP: {ip}, {spec}ports: [{{port: 80, targetPort: 8080{}}}]}}
---
kind: EndpointSlice
metadata: {{name: {name}-1, namespace: shop, labels: {{kubernetes.io/service-name: {name}}}}}
addressType: IPv4
ports: [{{port: 8080}}]
endpoints: [{{addresses: [10.244.1.1], nodeName: a}}, {{addresses: [10.244.2.1], nodeName: b}}]
",
            if spec.contains("NodePort") { ", nodePort: 30080" } else { "" }
        )
    };
    let doc = explain(&format!(
        "kind: Node\nmetadata: {{name: a}}\n{}{}{}{}{}",
        svc("plain", "10.96.0.40", ""),
        svc("itp-local", "10.96.0.41", "internalTrafficPolicy: Local, "),
        svc("itp-local-np", "10.96.0.42", "type: NodePort, internalTrafficPolicy: Local, "),
        svc("etp-local", "10.96.0.43", "type: LoadBalancer, externalTrafficPolicy: Local, externalIPs: [192.0.2.1], "),
        svc("etp-local-unreachable", "10.96.0.44", "externalTrafficPolicy: Local, "),
    ));
    let both = serde_json::json!(["10.244.1.1:8080", "10.244.2.1:8080"]);
    let here = serde_json::json!(["10.244.1.1:8080"]);
    let null = serde_json::Value::Null;
    let want = [
        ("plain", &both, &null),
        ("itp-local", &null, &here),
        // Reachable from outside: the node's own connections to the NodePort
        // use the cluster-wide set.
        ("itp-local-np", &both, &here),
        ("etp-local", &both, &here),
        ("etp-local-unreachable", &both, &null),
    ];
    let services = doc["services"].as_array().expect("services");
    for (name, cluster, local) in want {
        let s = services.iter().find(|s| s["name"] == name).unwrap_or_else(|| panic!("{name} is explained"));
        assert_eq!(&s["clusterEndpoints"], cluster, "{name}: {s}");
        assert_eq!(&s["localEndpoints"], local, "{name}: {s}");
    }
}

/// Manifests as `kubectl get nodes,services,endpointslices -o yaml` writes
/// them carry every Node whole; `explain` decides with what `run`'s Node
/// watch would list (issue #47) and says what it left out. A Service keyed
/// by zone whose slice has no zone reads the zone of
/// the endpoint's Node b (which `run` then watches for it), not c's, and
/// not b's rack.
#[test]
fn explain_uses_only_what_runs_node_watch_lists_and_says_what_it_left_out() {
    let node = |n: &str, zone: &str| {
        format!(
            "---\nkind: Node\nmetadata: {{name: {n}, labels: {{kubernetes.io/hostname: {n}, topology.kubernetes.io/zone: {zone}, example.com/rack: r-{n}}}}}\n"
        )
    };
    let text = format!(
        "{}{}{}---
kind: Service
metadata: {{name: close, namespace: shop, annotations: {{topoproxy.io/topology-keys: topology.kubernetes.io/zone}}}}
spec: {{clusterIP: 10.96.0.40, ports: [{{port: 80, targetPort: 8080}}]}}
---
kind: EndpointSlice
metadata: {{name: close-1, namespace: shop, labels: {{kubernetes.io/service-name: close}}}}
addressType: IPv4
ports: [{{port: 8080}}]
endpoints: [{{addresses: [10.244.2.1], nodeName: b}}, {{addresses: [10.244.3.1], nodeName: c}}]
",
        node("a", "z1"),
        node("b", "z1"),
        node("c", "z2")
    );
    let doc = explain(&text);
    let svc = &doc["services"][0];
    assert_eq!(svc["model"], "TopologyKeys", "{svc}");
    assert_eq!(svc["clusterEndpoints"], serde_json::json!(["10.244.2.1:8080"]), "b is in a's zone: {svc}");
    assert_eq!(svc["otherNodeLabels"], serde_json::json!(["topology.kubernetes.io/zone"]), "{svc}");
    let notes: Vec<&str> = doc["notes"].as_array().expect("notes").iter().filter_map(|n| n.as_str()).collect();
    assert!(notes.is_empty() || notes.iter().all(|n| !n.contains("zone")), "the zone is what run watches: {notes:?}");

    // No Service reads other Nodes: run watches none, explain uses none.
    let plain = format!("{}{}{}", node("a", "z1"), node("b", "z1"), service("plain", "10.96.0.41", "10.244.1.1"));
    let doc = explain(&plain);
    let notes: Vec<&str> = doc["notes"].as_array().expect("notes").iter().filter_map(|n| n.as_str()).collect();
    assert!(notes.iter().any(|n| n.starts_with("Nodes b left out: run does not watch them")), "{notes:?}");
}
