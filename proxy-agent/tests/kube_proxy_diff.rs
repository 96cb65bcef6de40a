//! The differential test of issue #45: real kube-proxy v1.37 (nftables
//! mode) is the judge of endpoint selection. Generated cluster states go
//! to a real API server; one real kube-proxy per simulated node (each in
//! a network namespace of its own, `proxy_test_support::real_kube_proxy`)
//! programs them, and `proxy-agent explain --manifests` decides over the
//! same objects, read back from the server, for each node. Per state,
//! node and Service port, the Cluster-policy, Local-policy and external
//! endpoint sets must be equal, or the difference must be of a kind
//! listed for kube-proxy 1.37 in docs/src/reference/kube-proxy-differences.md
//! (nothing else is excused).
//!
//! A run is epochs of [`STATES_PER_EPOCH`] states: one epoch labels the six
//! Nodes afresh (zones named for the epoch, so a kube-proxy that has not
//! seen its Node's new zone yet is told apart; the last node has none) and
//! writes each state into a namespace of its own, over a subset of 3 to 6
//! of the Nodes, so one kube-proxy sync judges every port of every state.
//! Each epoch is generated from its own seed: a failure names it, and
//! `TOPOPROXY_DIFF_SEED=<seed> TOPOPROXY_DIFF_STATES=<states per epoch>`
//! runs that epoch alone. `TOPOPROXY_DIFF_STATES` sets the number of
//! states (default 200; e.g. 5000 for a long run).
//!
//! What each state has: Services of type ClusterIP, NodePort and
//! LoadBalancer with one or two ports (named or not; TCP, UDP, now and
//! then SCTP), internal and external traffic policy Local,
//! `trafficDistribution` (PreferClose, PreferSameZone, PreferSameNode) and
//! `service.kubernetes.io/topology-mode: Auto`, `publishNotReadyAddresses`;
//! one to three hand-written slices per Service with ready, not ready,
//! serving-terminating and terminating endpoints, on the state's Nodes, on
//! a Node that does not exist, or on none; an address in two slices (one
//! copy terminating); hints as the EndpointSlice
//! controller would write them (own zone, own node), hand-written
//! `forZones`/`forNodes`, none, or one endpoint's left out.
//!
//! Skipped, saying why, only when the kube-proxy binary is absent
//! (`cargo xtask k8s` builds it, and `cargo xtask test` runs that first).

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::fs;
use std::net::Ipv4Addr;
use std::process::Command;

use proxy_test_support::real_cluster::RealCluster;
use proxy_test_support::real_kube_proxy::{KubeProxies, PortKey, Sets, explain_sets, kube_proxy_bin};
use proxy_test_support::rng::Rng;
use serde_json::{Value, json};
use support::*;

/// States written at once, each in its own namespace.
const STATES_PER_EPOCH: usize = 25;
/// Simulated nodes (kube-proxies); a state uses 3 to 6 of them.
const NODES: usize = 6;
/// The kube-proxy version judged here, as the deviations file names it.
const VERSION: &str = "1.37";
/// The label every generated object carries, with its epoch.
const EPOCH_LABEL: &str = "topoproxy.io/diff-epoch";
const DEVIATIONS: &str = "docs/src/reference/kube-proxy-differences.md";

fn node_name(i: usize) -> String {
    format!("node-{i}")
}

fn node_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 250, 0, u8::try_from(i + 1).unwrap_or(250))
}

/// The ids of the deviations listed for `version`: the table rows whose
/// first cell is an id in backticks and whose second lists the version.
fn deviations(version: &str) -> BTreeSet<String> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(DEVIATIONS);
    let text = fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let mut out = BTreeSet::new();
    for line in text.lines() {
        let cells: Vec<&str> = line.trim().trim_matches('|').split('|').map(str::trim).collect();
        let (Some(id), Some(versions)) = (cells.first(), cells.get(1)) else { continue };
        let Some(id) = id.strip_prefix('`').and_then(|i| i.strip_suffix('`')) else { continue };
        if versions.split(',').any(|v| v.trim() == version) {
            out.insert(id.to_string());
        }
    }
    out
}

/// Which listed kind a difference on `key` is, when the test can tell.
fn kind_of(key: &PortKey) -> Option<&'static str> {
    (key.2 == "SCTP").then_some("sctp-port-skipped")
}

/// Each Node's labels in one epoch: zone `e<epoch>-z<k>` over two or
/// three zones and a region each; the last node has no zone.
fn node_labels(rng: &mut Rng, epoch_tag: &str) -> Vec<Vec<(String, String)>> {
    let zones = 2 + rng.below(2);
    (0..NODES)
        .map(|i| {
            let mut l = vec![("kubernetes.io/hostname".to_string(), node_name(i))];
            if i + 1 < NODES {
                let z = rng.below(zones);
                l.push(("topology.kubernetes.io/zone".into(), format!("{epoch_tag}-z{z}")));
                l.push(("topology.kubernetes.io/region".into(), format!("{epoch_tag}-r{}", z % 2)));
            }
            l
        })
        .collect()
}

fn zone_of(labels: &[Vec<(String, String)>], i: usize) -> Option<&str> {
    labels.get(i)?.iter().find(|(k, _)| k == "topology.kubernetes.io/zone").map(|(_, v)| v.as_str())
}

/// One generated state: its namespace, Nodes and objects (JSON).
struct State {
    ns: String,
    nodes: Vec<usize>,
    objects: Vec<Value>,
}

/// A state over `nodes`, in namespace `ns`.
fn gen_state(rng: &mut Rng, ns: &str, epoch: &str, labels: &[Vec<(String, String)>], state_ix: usize) -> State {
    let mut nodes: Vec<usize> = (0..NODES).collect();
    let want = 3 + rng.below(NODES - 2);
    while nodes.len() > want {
        let i = rng.below(nodes.len());
        nodes.remove(i);
    }
    let zones: Vec<String> = nodes.iter().filter_map(|&i| zone_of(labels, i)).map(str::to_string).collect();
    let meta_labels = json!({EPOCH_LABEL: epoch});
    let mut objects = Vec::new();
    let services = 3 + rng.below(4);
    for s in 0..services {
        let name = format!("s{s}");
        let kind = *rng.pick(&["ClusterIP", "ClusterIP", "NodePort", "LoadBalancer"]);
        let nports = 1 + rng.below(2);
        let mut ports = Vec::new();
        for p in 0..nports {
            let protocol = if rng.chance(5) { "SCTP" } else { *rng.pick(&["TCP", "UDP"]) };
            let pname = if nports == 1 && rng.chance(40) { String::new() } else { format!("p{p}-{}", protocol.to_lowercase()) };
            ports.push((pname, protocol, 80 + p as u16, 8000 + rng.below(100) as u16));
        }
        let td = *rng.pick(&[None, None, Some("PreferClose"), Some("PreferSameZone"), Some("PreferSameNode")]);
        let auto = rng.chance(20);
        let mut spec = json!({
            "type": kind,
            "ports": ports.iter().map(|(n, proto, port, target)| {
                let mut p = json!({"protocol": proto, "port": port, "targetPort": target});
                if !n.is_empty() { p["name"] = json!(n); }
                p
            }).collect::<Vec<_>>(),
        });
        if let Some(td) = td {
            spec["trafficDistribution"] = json!(td);
        }
        if rng.chance(20) {
            spec["internalTrafficPolicy"] = json!("Local");
        }
        if kind != "ClusterIP" && rng.chance(35) {
            spec["externalTrafficPolicy"] = json!("Local");
        }
        if rng.chance(15) {
            spec["publishNotReadyAddresses"] = json!(true);
        }
        let mut annotations = json!({});
        if auto {
            annotations["service.kubernetes.io/topology-mode"] = json!("Auto");
        }
        objects.push(json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": ns, "labels": meta_labels, "annotations": annotations},
            "spec": spec,
        }));

        // How this Service's endpoints are hinted.
        let hinting = *rng.pick(&["none", "none", "controller", "controller", "zones", "nodes", "missing-one"]);
        let nslices = 1 + rng.below(3);
        let mut ep_ix = 0u8;
        // Each address written so far, and whether it was terminating.
        let mut written: Vec<(String, bool)> = Vec::new();
        for sl in 0..nslices {
            let mut endpoints = Vec::new();
            for _ in 0..rng.below(5) {
                ep_ix += 1;
                let mut ip = format!("10.{}.{}.{}", 100 + state_ix, s, ep_ix);
                // Now and then an address of an earlier slice again, one
                // copy terminating and the other not: kube-proxy keeps the
                // one that is not (between two of a kind its choice is
                // its map's order, so those are not generated).
                let mut forced: Option<Value> = None;
                if sl > 0 && !written.is_empty() && rng.chance(15) {
                    // Taken out: an address has at most two copies (a
                    // third would make two of a kind).
                    let (prev_ip, prev_term) = written.remove(rng.below(written.len()));
                    ip = prev_ip;
                    forced = Some(if prev_term {
                        rng.pick(&[json!({"ready": true}), json!({"ready": false, "serving": false})]).clone()
                    } else {
                        rng.pick(&[
                            json!({"ready": false, "serving": true, "terminating": true}),
                            json!({"ready": false, "serving": false, "terminating": true}),
                        ])
                        .clone()
                    });
                }
                let node = match rng.below(10) {
                    0 => None,
                    1 => Some("gone-node".to_string()),
                    _ => Some(node_name(*rng.pick(&nodes))),
                };
                let mut e = json!({"addresses": [ip]});
                let cond = match rng.below(8) {
                    0 => json!({"ready": false, "serving": false}),
                    1 => json!({"ready": false, "serving": true, "terminating": true}),
                    2 => json!({"ready": false, "serving": false, "terminating": true}),
                    3 => json!({}),
                    _ => json!({"ready": true, "serving": true, "terminating": false}),
                };
                let duplicate = forced.is_some();
                let cond = forced.unwrap_or(cond);
                let terminating = cond["terminating"].as_bool() == Some(true);
                if !duplicate {
                    written.push((ip.clone(), terminating));
                }
                e["conditions"] = cond;
                let zone = node.as_deref().and_then(|n| n.strip_prefix("node-")?.parse::<usize>().ok()).and_then(|i| zone_of(labels, i));
                if let Some(n) = &node {
                    e["nodeName"] = json!(n);
                }
                if let Some(z) = zone
                    && rng.chance(85)
                {
                    e["zone"] = json!(z);
                }
                let own_zone = zone.map_or_else(|| format!("{epoch}-z9"), str::to_string);
                let hints = match hinting {
                    "controller" => {
                        let mut h = json!({"forZones": [{"name": own_zone}]});
                        if td == Some("PreferSameNode")
                            && let Some(n) = &node
                        {
                            h["forNodes"] = json!([{"name": n}]);
                        }
                        Some(h)
                    }
                    "zones" if !zones.is_empty() => {
                        let k = 1 + rng.below(2);
                        let z: BTreeSet<&String> = (0..k).map(|_| rng.pick(&zones)).collect();
                        Some(json!({"forZones": z.iter().map(|z| json!({"name": z})).collect::<Vec<_>>()}))
                    }
                    "nodes" => {
                        let n = node_name(*rng.pick(&nodes));
                        Some(json!({"forNodes": [{"name": n}], "forZones": [{"name": own_zone}]}))
                    }
                    "missing-one" if ep_ix != 1 => Some(json!({"forZones": [{"name": own_zone}]})),
                    _ => None,
                };
                if let Some(h) = hints {
                    e["hints"] = h;
                }
                endpoints.push(e);
            }
            let slice_ports: Vec<Value> =
                ports.iter().map(|(n, proto, _, target)| json!({"name": n, "protocol": proto, "port": target})).collect();
            objects.push(json!({
                "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"name": format!("{name}-{sl}"), "namespace": ns,
                             "labels": {"kubernetes.io/service-name": name, EPOCH_LABEL: epoch}},
                "addressType": "IPv4",
                "ports": slice_ports,
                "endpoints": endpoints,
            }));
        }
    }
    State { ns: ns.to_string(), nodes, objects }
}

/// The epoch's probe: one endpoint per node, hinted for that node's zone.
/// It is written last; a kube-proxy that programmed it as this epoch's
/// zones say has every object of the epoch and its Node's new labels.
fn probe(epoch: &str, ns: &str, labels: &[Vec<(String, String)>]) -> (Vec<Value>, Vec<BTreeSet<String>>) {
    let ip = |i: usize| format!("10.99.0.{}", i + 1);
    let endpoints: Vec<Value> = (0..NODES)
        .map(|i| {
            let z = zone_of(labels, i).map_or_else(|| format!("{epoch}-none"), str::to_string);
            json!({"addresses": [ip(i)], "nodeName": node_name(i), "conditions": {"ready": true}, "hints": {"forZones": [{"name": z}]}})
        })
        .collect();
    let want: Vec<BTreeSet<String>> = (0..NODES)
        .map(|i| match zone_of(labels, i) {
            Some(z) => (0..NODES).filter(|&j| zone_of(labels, j) == Some(z)).map(|j| format!("{}:9000", ip(j))).collect(),
            None => (0..NODES).map(|j| format!("{}:9000", ip(j))).collect(),
        })
        .collect();
    let objects = vec![
        json!({"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": "probe", "namespace": ns, "labels": {EPOCH_LABEL: epoch}},
               "spec": {"ports": [{"name": "p", "protocol": "TCP", "port": 80, "targetPort": 9000}]}}),
        json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
               "metadata": {"name": "probe", "namespace": ns, "labels": {"kubernetes.io/service-name": "probe", EPOCH_LABEL: epoch}},
               "addressType": "IPv4", "ports": [{"name": "p", "protocol": "TCP", "port": 9000}], "endpoints": endpoints}),
    ];
    (objects, want)
}

fn list(items: Vec<Value>) -> String {
    json!({"apiVersion": "v1", "kind": "List", "items": items}).to_string()
}

fn env_usize(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
}

#[test]
fn kube_proxy_and_the_agent_choose_the_same_endpoints() {
    if let Err(e) = kube_proxy_bin() {
        eprintln!("SKIPPED: the differential test needs the real kube-proxy: {e}");
        return;
    }
    require_root();
    let states = env_usize("TOPOPROXY_DIFF_STATES").unwrap_or(200) as usize;
    let base_seed = env_usize("TOPOPROXY_DIFF_SEED").unwrap_or(45);
    let epochs = states.div_ceil(STATES_PER_EPOCH);
    let excused_kinds = deviations(VERSION);

    let cluster = RealCluster::start("kube-proxy-diff").expect("start the real cluster");
    let nodes: Vec<(String, Ipv4Addr)> = (0..NODES).map(|i| (node_name(i), node_ip(i))).collect();
    for (name, ip) in &nodes {
        cluster.create_node(name, &[]).expect("create Node");
        let status =
            json!({"status": {"addresses": [{"type": "InternalIP", "address": ip.to_string()}, {"type": "Hostname", "address": name}]}});
        cluster
            .kubectl(&["patch", "node", name, "--subresource=status", "--type=merge", "-p", &status.to_string()])
            .expect("Node status addresses");
    }
    let mut proxies = KubeProxies::start(&cluster, &nodes).expect("start the kube-proxies");
    let dir = TempDir::new("kube-proxy-diff");

    let mut compared = 0usize;
    // How many of kube-proxy's sets had endpoints, and how many external
    // sets differed from the Cluster set (Local policy): a test that
    // compared only empty sets would prove nothing.
    let mut programmed = 0usize;
    let mut narrowed_external = 0usize;
    let mut excused: BTreeMap<&'static str, usize> = BTreeMap::new();
    let mut failures = String::new();
    let mut done_states = 0usize;
    for epoch in 0..epochs {
        let seed = base_seed.wrapping_add(epoch as u64);
        let mut rng = Rng(seed);
        let tag = format!("e{seed}");
        let labels = node_labels(&mut rng, &tag);
        let in_epoch = STATES_PER_EPOCH.min(states - done_states);
        let generated: Vec<State> = (0..in_epoch).map(|k| gen_state(&mut rng, &format!("{tag}-d{k}"), &tag, &labels, k)).collect();
        done_states += in_epoch;

        // The previous epoch's namespaces go (the namespace controller
        // empties them in the background; only this epoch's namespaces
        // are compared), the Nodes get their labels, then the states,
        // each in a namespace of its own, and last the probe.
        let started = std::time::Instant::now();
        if epoch > 0 {
            let prev = format!("{EPOCH_LABEL}=e{}", seed.wrapping_sub(1));
            cluster.kubectl(&["delete", "namespaces", "-l", &prev, "--wait=false"]).expect("delete the previous epoch");
        }
        let marks = proxies.sync_marks().expect("sync marks");
        let node_objs: Vec<Value> = (0..NODES)
            .map(|i| {
                let l: serde_json::Map<String, Value> = labels[i].iter().map(|(k, v)| (k.clone(), json!(v))).collect();
                json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": node_name(i), "labels": l}})
            })
            .collect();
        cluster.apply(&list(node_objs)).expect("label the Nodes");
        let probe_ns = format!("{tag}-probe");
        let mut objects: Vec<Value> = generated
            .iter()
            .map(|s| s.ns.as_str())
            .chain([probe_ns.as_str()])
            .map(|ns| json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns, "labels": {EPOCH_LABEL: tag}}}))
            .collect();
        objects.extend(generated.iter().flat_map(|s| s.objects.iter().cloned()));
        let (probe_objs, probe_want) = probe(&tag, &probe_ns, &labels);
        objects.extend(probe_objs);
        // `create`, one request per object (apply reads each first).
        let file = dir.0.join(format!("epoch-{epoch}-objects.json"));
        fs::write(&file, list(objects)).expect("write the objects");
        cluster.kubectl(&["create", "-f", &file.display().to_string()]).expect("create the states");
        let written = started.elapsed();
        let probe_key: PortKey = (probe_ns.clone(), "probe".into(), "TCP".into(), "p".into());
        proxies.wait_synced(&marks, &probe_key, &probe_want).unwrap_or_else(|e| panic!("epoch seed {seed}: {e}"));
        let synced = started.elapsed();

        // The same objects, as the server has them, for the agent.
        let manifests = dir.0.join(format!("epoch-{epoch}.json"));
        let got = cluster.kubectl(&["get", "nodes,services,endpointslices", "-A", "-o", "json"]).expect("read the objects back");
        fs::write(&manifests, &got).expect("write manifests");

        for (i, (node, _)) in nodes.iter().enumerate() {
            let kp = proxies.sets(i).expect("read kube-proxy's table");
            let out = Command::new(agent_bin())
                .args(["explain", "--node", node, "--output", "json", "--manifests"])
                .arg(&manifests)
                .output()
                .expect("run explain");
            assert!(out.status.success(), "explain failed: {}", String::from_utf8_lossy(&out.stderr));
            let doc: Value = serde_json::from_slice(&out.stdout).expect("explain JSON");
            let agent = explain_sets(&doc).expect("explain sets");
            for st in generated.iter().filter(|s| s.nodes.contains(&i)) {
                let keys: BTreeSet<&PortKey> = kp.keys().chain(agent.keys()).filter(|k| k.0 == st.ns).collect();
                for key in keys {
                    compared += 1;
                    let empty = Sets::default();
                    let (a, b) = (kp.get(key).unwrap_or(&empty), agent.get(key).unwrap_or(&empty));
                    if !a.cluster.is_empty() || !a.local.is_empty() {
                        programmed += 1;
                    }
                    if a.cluster != a.external && !a.external.is_empty() {
                        narrowed_external += 1;
                    }
                    if a == b {
                        continue;
                    }
                    if let Some(kind) = kind_of(key).filter(|k| excused_kinds.contains(*k)) {
                        *excused.entry(kind).or_default() += 1;
                        continue;
                    }
                    let svc = st
                        .objects
                        .iter()
                        .filter(|o| o["metadata"]["name"].as_str().is_some_and(|n| n == key.1 || n.starts_with(&format!("{}-", key.1))))
                        .map(Value::to_string)
                        .collect::<Vec<_>>()
                        .join("\n");
                    let before = failures.len();
                    let _ = writeln!(
                        failures,
                        "\nepoch seed {seed} (reproduce: TOPOPROXY_DIFF_SEED={seed} TOPOPROXY_DIFF_STATES={STATES_PER_EPOCH}), node {node}, {}/{} {} port {:?}:\n  kube-proxy {a:?}\n  agent      {b:?}\n  objects:\n{svc}",
                        key.0, key.1, key.2, key.3
                    );
                    eprint!("{}", &failures[before..]);
                }
            }
        }
        eprintln!(
            "epoch {epoch} (seed {seed}): {in_epoch} states, {compared} node × port sets compared so far \
             (written {:.1} s, synced {:.1} s, compared {:.1} s)",
            written.as_secs_f64(),
            synced.as_secs_f64(),
            started.elapsed().as_secs_f64()
        );
    }
    proxies.finish().expect("the host is as it was");
    eprintln!(
        "{done_states} states, {compared} node × Service-port sets compared ({programmed} with endpoints, \
         {narrowed_external} external sets apart from the Cluster set); excused as listed deviations: {excused:?}"
    );
    assert!(programmed * 3 >= compared, "too few of kube-proxy's sets had endpoints ({programmed} of {compared}): the read-back is broken");
    assert!(failures.is_empty(), "kube-proxy v1.37 and the agent differ (fix the agent, or list the kind in {DEVIATIONS}):{failures}");
}
