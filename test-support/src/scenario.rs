//! The demo's simulated cluster as data, and the table it prints: which
//! nodes, Services and pods a manifest directory describes, how the replies
//! of `proxy-agent probe` are tallied, and the client-node-by-Service table
//! of the backends that answered. `cargo xtask demo` (processes) and the
//! container image test (the chart's DaemonSet in podman) show the same
//! table through these.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::path::Path;

use proxy_agent::source::manifest;
use serde_json::Value;

const LABEL_ZONE: &str = "topology.kubernetes.io/zone";
const LABEL_POOL: &str = "apps.openyurt.io/nodepool";
const ANNOTATION_OPENYURT: &str = "openyurt.io/topologyKeys";
const ANNOTATION_TOPOPROXY: &str = "topoproxy.io/topology-keys";

pub struct NodeSpec {
    pub name: String,
    pub zone: String,
    pub pool: String,
}

impl NodeSpec {
    /// The row label of the table, e.g. `node-1 (zone-a, hangzhou)`.
    pub fn label(&self) -> String {
        format!("{} ({}, {})", self.name, self.zone, self.pool)
    }
}

pub struct ServiceSpec {
    pub name: String,
    pub frontend: SocketAddr,
    pub udp: bool,
    /// How the Service asks for topology, for the legend.
    pub topology: String,
}

pub struct PodSpec {
    pub name: String,
    pub node: String,
    pub ip: IpAddr,
    pub ports: BTreeSet<u16>,
}

pub struct Scenario {
    /// Sorted by name.
    pub nodes: Vec<NodeSpec>,
    pub services: Vec<ServiceSpec>,
    pub pods: Vec<PodSpec>,
}

fn str_at<'a>(v: &'a Value, path: &[&str]) -> Option<&'a str> {
    path.iter().try_fold(v, |v, k| v.get(*k))?.as_str()
}

/// Reads a manifest directory: Nodes give the nodes, Services the ClusterIPs
/// (first port), EndpointSlices the pods (by `targetRef.name`), their
/// addresses, ports and nodes.
pub fn read_scenario(dir: &Path) -> Result<Scenario, String> {
    let (docs, errors) = manifest::load(&[dir.to_path_buf()]);
    if let Some(e) = errors.first() {
        return Err(format!("reading {}: {e}", dir.display()));
    }
    let mut nodes = Vec::new();
    let mut services = Vec::new();
    let mut pods: BTreeMap<String, PodSpec> = BTreeMap::new();
    for d in &docs {
        let v = &d.value;
        let name = str_at(v, &["metadata", "name"]).unwrap_or_default().to_string();
        match str_at(v, &["kind"]) {
            Some("Node") => {
                let label = |k: &str| str_at(v, &["metadata", "labels", k]).unwrap_or("-").to_string();
                nodes.push(NodeSpec { name, zone: label(LABEL_ZONE), pool: label(LABEL_POOL) });
            }
            Some("Service") => {
                let Some(ip) = str_at(v, &["spec", "clusterIP"]).and_then(|s| s.parse::<IpAddr>().ok()) else {
                    continue;
                };
                let Some(port) = v.pointer("/spec/ports/0") else { continue };
                let number = port.get("port").and_then(Value::as_u64).and_then(|p| u16::try_from(p).ok()).unwrap_or(0);
                let udp = port.get("protocol").and_then(Value::as_str) == Some("UDP");
                let annotation = |k: &str| str_at(v, &["metadata", "annotations", k]).map(|a| format!("{k}: {a}"));
                let topology = annotation(ANNOTATION_OPENYURT)
                    .or_else(|| annotation(ANNOTATION_TOPOPROXY))
                    .or_else(|| v.pointer("/spec/topologyKeys").map(|k| format!("spec.topologyKeys: {k}")))
                    .or_else(|| str_at(v, &["spec", "trafficDistribution"]).map(|t| format!("trafficDistribution: {t}")))
                    .unwrap_or_else(|| "no topology".into());
                services.push(ServiceSpec { name, frontend: SocketAddr::new(ip, number), udp, topology });
            }
            Some("EndpointSlice") => {
                let port_numbers: Vec<u16> = v
                    .get("ports")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .filter_map(|p| p.get("port").and_then(Value::as_u64).and_then(|p| u16::try_from(p).ok()))
                    .collect();
                for ep in v.get("endpoints").and_then(Value::as_array).into_iter().flatten() {
                    let Some(ip) = ep.pointer("/addresses/0").and_then(Value::as_str).and_then(|s| s.parse::<IpAddr>().ok()) else {
                        continue;
                    };
                    let pod_name = str_at(ep, &["targetRef", "name"]).map_or_else(|| ip.to_string(), str::to_string);
                    let node = str_at(ep, &["nodeName"]).unwrap_or("-").to_string();
                    let pod = pods.entry(pod_name.clone()).or_insert_with(|| PodSpec {
                        name: pod_name.clone(),
                        node,
                        ip,
                        ports: BTreeSet::new(),
                    });
                    if pod.ip != ip {
                        return Err(format!("pod {pod_name} has two addresses in the EndpointSlices ({} and {ip})", pod.ip));
                    }
                    pod.ports.extend(&port_numbers);
                }
            }
            _ => {}
        }
    }
    nodes.sort_by(|a, b| a.name.cmp(&b.name));
    if nodes.is_empty() || services.is_empty() || pods.is_empty() {
        return Err(format!("{} needs Nodes, Services with a clusterIP and EndpointSlices", dir.display()));
    }
    Ok(Scenario { nodes, services, pods: pods.into_values().collect() })
}

/// Reply counts per backend name, or per failure reason in parentheses.
pub type Tally = BTreeMap<String, u32>;

/// Tallies the JSON lines of one `proxy-agent probe` run.
pub fn tally(lines: &[Value]) -> Tally {
    let mut tally = Tally::new();
    for line in lines {
        let key = if line.get("ok") == Some(&Value::Bool(true)) {
            line.get("reply").and_then(Value::as_str).unwrap_or("?").to_string()
        } else {
            match line.get("errno").and_then(Value::as_i64) {
                Some(111) => "(refused)".to_string(),
                Some(101) => "(unreachable)".to_string(),
                _ => format!("({})", line.get("error").and_then(Value::as_str).unwrap_or("failed")),
            }
        };
        *tally.entry(key).or_default() += 1;
    }
    tally
}

/// Prints the table: rows are client nodes (labels), columns Services,
/// cells one line per backend that answered, with its count.
pub fn print_table(services: &[ServiceSpec], results: &[(String, Vec<Tally>)]) {
    let cell_lines = |t: &Tally| -> Vec<String> { t.iter().map(|(k, v)| format!("{k} x{v}")).collect() };
    let mut widths = vec![results.iter().map(|(r, _)| r.len()).chain(["client pod on node".len()]).max().unwrap_or(0)];
    for (i, s) in services.iter().enumerate() {
        let w = results.iter().flat_map(|(_, row)| cell_lines(&row[i])).map(|l| l.len()).chain([s.name.len()]).max().unwrap_or(0);
        widths.push(w);
    }
    let line = |cells: &[&str]| {
        let s: Vec<String> = cells.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect();
        println!("{}", s.join("  |  ").trim_end());
    };
    let header: Vec<&str> = std::iter::once("client pod on node").chain(services.iter().map(|s| s.name.as_str())).collect();
    line(&header);
    let rule: Vec<String> = widths.iter().map(|w| "-".repeat(*w)).collect();
    println!("{}", rule.join("--+--"));
    for (label, row) in results {
        let cells: Vec<Vec<String>> = row.iter().map(cell_lines).collect();
        let height = cells.iter().map(Vec::len).max().unwrap_or(1).max(1);
        for k in 0..height {
            let first = if k == 0 { label.as_str() } else { "" };
            let mut out: Vec<&str> = vec![first];
            out.extend(cells.iter().map(|c| c.get(k).map_or("", String::as_str)));
            line(&out);
        }
        println!("{}", rule.join("--+--"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn tallies_replies_and_failures_by_reason() {
        let lines = [
            json!({"ok": true, "reply": "pod-a"}),
            json!({"ok": true, "reply": "pod-a"}),
            json!({"ok": true, "reply": "pod-b"}),
            json!({"ok": false, "stage": "connect", "errno": 111}),
            json!({"ok": false, "stage": "connect", "errno": 101}),
            json!({"ok": false, "error": "timed out"}),
        ];
        let t = tally(&lines);
        let want: Tally = [("pod-a", 2), ("pod-b", 1), ("(refused)", 1), ("(unreachable)", 1), ("(timed out)", 1)]
            .map(|(k, v)| (k.to_string(), v))
            .into();
        assert_eq!(t, want);
    }

    #[test]
    fn the_bundled_demo_manifests_describe_three_nodes_three_services_four_pods() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/demo");
        let s = read_scenario(&dir).expect("the demo manifests read");
        assert_eq!(s.nodes.iter().map(|n| n.name.as_str()).collect::<Vec<_>>(), ["node-1", "node-2", "node-3"]);
        assert_eq!(s.nodes[1].label(), "node-2 (zone-b, hangzhou)");
        assert_eq!(s.services.len(), 3);
        assert_eq!(s.pods.len(), 4);
        assert!(s.pods.iter().all(|p| p.ports.contains(&9376)));
    }
}
