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
    let dir = Dir(std::env::temp_dir().join(format!("topoproxy-explain-{}", std::process::id())));
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
