//! Graded spill-over between topology tiers (issue #48) on the real socket
//! datapath: one agent (node-a, zone z1) and a Service keyed
//! `topology.kubernetes.io/zone, *` with `topoproxy.io/topology-spill:
//! "1.4"`. A rolling update of the zone's four pods walks the zone's health
//! down; at each step 10,000 new connects from a pod of node-a split
//! between the zone and `*` as the rule computes, within ±2 percentage
//! points, none fails, and a connection established before the shares
//! changed keeps its backend (the socket programs translate at connect()
//! only, so a share change never touches an established socket). The
//! update runs twice: with the agent's line-by-line backends and a
//! long-lived connection, and with nginx pods, wrk's load and a paced
//! download, as users would run it.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::io::BufRead;
use std::net::SocketAddr;
use std::process::Stdio;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use proxy_test_support::sandbox::{Guarded, command_in};
use proxy_test_support::wait::eventually;
use proxy_test_support::workloads::{Download, Nginx, Reply, Wrk, get_each, installed};
use support::*;

/// A serve-hostname backend answering line by line (`--lines`), so that a
/// long-lived connection (`probe --stream`) gets an answer per exchange; a
/// one-message probe half-closes and gets its one answer as usual.
fn line_backend(net: &PodNetwork, name: &str, ip: &str) -> Guarded {
    net.netns.add_loopback_addrs(&[&format!("{ip}/32")]).expect("pod address");
    let mut cmd = command_in(agent_bin(), Some(&net.netns), None).expect("backend command");
    cmd.args(["serve-hostname", "--name", name, "--lines", "--listen"]).arg(format!("{ip}:8080"));
    cmd.stdout(Stdio::piped()).stderr(Stdio::inherit()).stdin(Stdio::null());
    let mut g = Guarded::spawn(&mut cmd).expect("start backend");
    let out = g.0.stdout.take().expect("backend stdout");
    let mut line = String::new();
    std::io::BufReader::new(out).read_line(&mut line).expect("backend ready line");
    assert_eq!(line.trim(), "ready", "backend {name}");
    g
}

/// node-a's zone z1: four pods, two on node-a, two on node-b.
const ZONE: [(&str, &str, &str); 4] = [
    ("z1-1", "10.244.30.1", "node-a"),
    ("z1-2", "10.244.30.2", "node-b"),
    ("z1-3", "10.244.30.3", "node-a"),
    ("z1-4", "10.244.30.4", "node-b"),
];
/// Zone z2: two pods on node-c.
const OTHER: [(&str, &str, &str); 2] = [("z2-1", "10.244.30.11", "node-c"), ("z2-2", "10.244.30.12", "node-c")];

fn nodes_yaml() -> String {
    [("node-a", "z1"), ("node-b", "z1"), ("node-c", "z2")]
        .iter()
        .map(|(n, z)| {
            format!(
                "---\napiVersion: v1\nkind: Node\nmetadata:\n  name: {n}\n  labels:\n    kubernetes.io/hostname: {n}\n    topology.kubernetes.io/zone: {z}\n"
            )
        })
        .collect()
}

/// The cluster with the first `ready_in_zone` pods of z1 ready (the rest
/// listed, not ready: replaced pods that are starting).
fn cluster(ready_in_zone: usize, spill: bool) -> String {
    cluster_on(ready_in_zone, spill, 8080)
}

/// [`cluster`] with the pods serving on `port`.
fn cluster_on(ready_in_zone: usize, spill: bool, port: u16) -> String {
    let zone_of = |node: &str| if node == "node-c" { "z2" } else { "z1" };
    let endpoints: String = ZONE
        .iter()
        .enumerate()
        .map(|(i, e)| (e, i < ready_in_zone))
        .chain(OTHER.iter().map(|e| (e, true)))
        .map(|((_, ip, node), ready)| {
            format!("- addresses: [\"{ip}\"]\n  conditions: {{ready: {ready}}}\n  nodeName: {node}\n  zone: {}\n", zone_of(node))
        })
        .collect();
    let spill = if spill { ", topoproxy.io/topology-spill: \"1.4\"" } else { "" };
    format!(
        "{}---\napiVersion: v1\nkind: Service\nmetadata:\n  name: web\n  annotations: {{topoproxy.io/topology-keys: \"topology.kubernetes.io/zone, *\"{spill}}}\nspec:\n  clusterIP: 10.96.30.1\n  ports: [{{name: http, port: 80, targetPort: {port}}}]\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: web-1\n  labels: {{kubernetes.io/service-name: web}}\naddressType: IPv4\nports: [{{name: http, port: {port}}}]\nendpoints:\n{endpoints}",
        nodes_yaml()
    )
}

const CONNECTS: usize = 10_000;
const TO: &str = "10.96.30.1:80";

/// 10,000 connects from a pod of node-a: how many each backend answered.
/// Every connect must succeed.
fn split(node: &Node, net: &PodNetwork) -> BTreeMap<String, usize> {
    let count = CONNECTS.to_string();
    let r = node.probe(net, &["--to", TO, "--count", &count, "--timeout-ms", "2000"]);
    assert_eq!(r.len(), CONNECTS);
    let failed: Vec<&serde_json::Value> = r.iter().filter(|x| x["ok"] != true).collect();
    assert!(failed.is_empty(), "{} of {CONNECTS} connects failed, e.g. {:?}", failed.len(), failed.first());
    let mut by = BTreeMap::new();
    for x in &r {
        *by.entry(x["reply"].as_str().unwrap_or_default().to_string()).or_insert(0) += 1;
    }
    by
}

/// The share of `names` in `by`, in percent.
fn percent_of(by: &BTreeMap<String, usize>, names: &[&str]) -> f64 {
    let n: usize = names.iter().map(|k| by.get(*k).copied().unwrap_or(0)).sum();
    100.0 * n as f64 / CONNECTS as f64
}

/// Waits until the agent programmed the step: explain (the same decision
/// path) says the zone's share, and a short probe reaches exactly `want`.
fn wait_for_step(node: &Node, net: &PodNetwork, want: &[&str]) {
    wait_for_backends(node, net, TO, &[], want);
}

#[test]
fn a_rolling_update_spills_new_connections_by_the_zones_health() {
    let _serial = serial();
    let net = PodNetwork::new();
    let _backends: Vec<Guarded> = ZONE.iter().chain(&OTHER).map(|(name, ip, _)| line_backend(&net, name, ip)).collect();
    let mut node = Node::new("node-a");
    node.write_manifest("cluster.yaml", &cluster(4, true));
    node.start_agent();
    let zone: Vec<&str> = ZONE.iter().map(|(n, _, _)| *n).collect();
    let other: Vec<&str> = OTHER.iter().map(|(n, _, _)| *n).collect();

    // Full health: the zone keeps everything, exactly as without spill.
    wait_for_step(&node, &net, &zone);

    // A long-lived connection, established before any share changes.
    let held = Stream::start("held", pod_probe(&node, &net.netns, &["--to", TO, "--stream", "--count", "100000", "--interval-ms", "20"]));
    let held_backend = held.first().expect("the held connection's first exchange");
    assert!(zone.contains(&held_backend.as_str()), "{held_backend}");

    // (ready pods of z1, the zone's share in percent: min(1, ready/4 × 1.4)).
    let steps: [(usize, f64); 4] = [(3, 100.0), (2, 70.0), (1, 35.0), (0, 0.0)];
    for (ready, zone_share) in steps {
        node.write_manifest("cluster.yaml", &cluster(ready, true));
        let ready_zone: Vec<&str> = zone[..ready].to_vec();
        let mut want: Vec<&str> = if zone_share > 0.0 { ready_zone.clone() } else { Vec::new() };
        if zone_share < 100.0 {
            want.extend(&other);
        }
        wait_for_step(&node, &net, &want);
        let by = split(&node, &net);
        let got = percent_of(&by, &ready_zone);
        eprintln!("{ready} of 4 ready in z1: the zone took {got:.2} % of {CONNECTS} connects (computed {zone_share} %): {by:?}");
        assert!((got - zone_share).abs() <= 2.0, "{ready} of 4 ready: the zone took {got:.2} %, want {zone_share} % ± 2 ({by:?})");
        let spilled = percent_of(&by, &other);
        assert!((spilled - (100.0 - zone_share)).abs() <= 2.0, "{ready} of 4 ready: `*` took {spilled:.2} % ({by:?})");
        // Within a tier the ready pods share alike.
        for name in &ready_zone {
            let each = zone_share / ready as f64;
            let got = percent_of(&by, &[name]);
            assert!((got - each).abs() <= 2.0, "{ready} of 4 ready: {name} took {got:.2} %, want {each:.1} % ± 2");
        }
    }

    // The established connection kept its backend through every change
    // (its pod still runs; only its readiness went), and never failed.
    let replies = held.replies();
    assert!(replies.len() > 10, "{replies:?} {:?}", held.lines().iter().rev().take(3).collect::<Vec<_>>());
    assert!(
        replies.iter().all(|r| *r == held_backend),
        "the held connection moved: {:?}",
        replies.iter().collect::<std::collections::BTreeSet<_>>()
    );
    let (_, failed) = held.counts();
    assert!(failed.is_empty(), "the held connection failed: {failed:?}");

    // Without the annotation: strict tiers again, `*` only once the zone
    // has no ready pod, and one ready pod takes the zone's whole load.
    node.write_manifest("cluster.yaml", &cluster(1, false));
    wait_for_step(&node, &net, &zone[..1]);
    eventually("the agent to log no problem", || if node.agent_log().contains("topology-spill") { Err(()) } else { Ok(()) });
}

/// `explain` (the decision path `run` uses) prints each tier's health,
/// the factor and the share, in the table and in JSON.
#[test]
fn explain_shows_each_tiers_health_factor_and_share() {
    let dir = TempDir::new("tpt-spill-explain");
    std::fs::write(dir.0.join("cluster.yaml"), cluster(2, true)).expect("write");
    let run = |json: bool| {
        let mut cmd = std::process::Command::new(agent_bin());
        cmd.args(["explain", "--node", "node-a", "--manifests"]).arg(&dir.0);
        if json {
            cmd.args(["--output", "json"]);
        }
        let out = cmd.output().expect("run explain");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let text = run(false);
    assert!(text.contains("  spill:     factor 1.4\n"), "{text}");
    assert!(text.contains("    topology.kubernetes.io/zone=z1: 2/4 ready (health 50.0%), share 70.0%\n"), "{text}");
    assert!(text.contains("    *: 2/2 ready (health 100.0%), share 30.0%\n"), "{text}");
    let doc: serde_json::Value = serde_json::from_str(&run(true)).expect("json");
    let web = doc["services"].as_array().expect("services").iter().find(|s| s["name"] == "web").expect("web");
    assert_eq!(web["spill"]["factor"], "1.4");
    let tiers = web["spill"]["tiers"].as_array().expect("tiers");
    assert_eq!(tiers.len(), 2);
    assert_eq!(tiers[0]["tier"], "topology.kubernetes.io/zone=z1");
    assert_eq!((tiers[0]["ready"].as_u64(), tiers[0]["total"].as_u64()), (Some(2), Some(4)));
    assert!((tiers[0]["share"].as_f64().unwrap_or_default() - 0.7).abs() < 1e-9, "{tiers:?}");
    assert!((tiers[1]["share"].as_f64().unwrap_or_default() - 0.3).abs() < 1e-9, "{tiers:?}");
    // Both tiers' ready endpoints are in the cluster set.
    assert_eq!(web["clusterEndpoints"].as_array().map(Vec::len), Some(4), "{web}");
    // Without the annotation: strict, no spill field.
    std::fs::write(dir.0.join("cluster.yaml"), cluster(2, false)).expect("write");
    let doc: serde_json::Value = serde_json::from_str(&run(true)).expect("json");
    let web = doc["services"].as_array().expect("services").iter().find(|s| s["name"] == "web").expect("web");
    assert_eq!(web["spill"], serde_json::Value::Null);
    assert_eq!(web["clusterEndpoints"], serde_json::json!(["10.244.30.1:8080", "10.244.30.2:8080"]));
}

/// The same rolling update with the workloads (#48): nginx as the
/// six pods, wrk opening a new connection per request from a pod of node-a
/// the whole time, and a paced download through the Service established
/// at full health. At each step 10,000 new connections by curl split
/// between the tiers as computed, within ±2 points; no request of curl or
/// wrk fails, and the download, whose pod only loses its readiness, comes
/// through whole.
#[test]
fn a_rolling_update_under_wrk_spills_nginx_connections_and_keeps_a_download() {
    let _serial = serial();
    require_root();
    for program in ["nginx", "curl", "wrk"] {
        assert!(installed(program), "{program} is not installed: run `cargo xtask setup`");
    }
    let net = PodNetwork::new();
    const FILE: u64 = 16 << 20;
    let _pods: Vec<Nginx> = ZONE
        .iter()
        .chain(&OTHER)
        .map(|(name, ip, _)| {
            net.netns.add_loopback_addrs(&[&format!("{ip}/32")]).expect("pod address");
            Nginx::start(&net.netns, name, SocketAddr::new(ip.parse().expect("pod address"), 80), FILE, None).expect("start nginx")
        })
        .collect();
    let mut node = Node::new("node-a");
    node.write_manifest("cluster.yaml", &cluster_on(4, true, 80));
    node.start_agent();
    let zone: Vec<&str> = ZONE.iter().map(|(n, _, _)| *n).collect();
    let other: Vec<&str> = OTHER.iter().map(|(n, _, _)| *n).collect();
    let url = format!("http://{TO}{}", Nginx::NAME_PATH);
    wait_for_http(&node, &net, &url, &zone);

    // wrk from the same node through the whole update, a new connection
    // per request, so every one of its connects takes the current shares.
    let mut wrk = Wrk::start(&net.netns, Some(&node.cgroup), &url, 2, Duration::from_mins(10), &["Connection: close"]).expect("start wrk");

    // Full health, under wrk's load: the zone takes everything. How long
    // these 10,000 connects take sets the download's pace, so that it
    // outlasts the four steps below on a slow machine too.
    let t0 = Instant::now();
    let by = http_split(&node, &net, &url);
    let step = t0.elapsed();
    assert_eq!(percent_of(&by, &zone), 100.0, "{by:?}");
    let lasts = (step * 4 * 3 + Duration::from_secs(10)).min(Duration::from_secs(100));
    let rate = (FILE as f64 / lasts.as_secs_f64()) as u64;
    eprintln!("10,000 connects took {step:?} under wrk; the download is paced at {rate} B/s to last {lasts:?}");
    let file_url = format!("http://{TO}{}?rate={rate}", Nginx::FILE_PATH);
    let mut download = Download::start(&net.netns, Some(&node.cgroup), &file_url, None).expect("start curl");
    std::thread::sleep(Duration::from_secs(1));
    assert!(download.running(), "the download ended at once: {:?}", download.finish(Duration::from_secs(1)));

    let steps: [(usize, f64); 4] = [(3, 100.0), (2, 70.0), (1, 35.0), (0, 0.0)];
    for (ready, zone_share) in steps {
        node.write_manifest("cluster.yaml", &cluster_on(ready, true, 80));
        let ready_zone: Vec<&str> = zone[..ready].to_vec();
        let mut want: Vec<&str> = if zone_share > 0.0 { ready_zone.clone() } else { Vec::new() };
        if zone_share < 100.0 {
            want.extend(&other);
        }
        wait_for_http(&node, &net, &url, &want);
        let by = http_split(&node, &net, &url);
        let got = percent_of(&by, &ready_zone);
        eprintln!("nginx, {ready} of 4 ready in z1: the zone took {got:.2} % of {CONNECTS} connects (computed {zone_share} %): {by:?}");
        assert!((got - zone_share).abs() <= 2.0, "{ready} of 4 ready: the zone took {got:.2} %, want {zone_share} % ± 2 ({by:?})");
        let spilled = percent_of(&by, &other);
        assert!((spilled - (100.0 - zone_share)).abs() <= 2.0, "{ready} of 4 ready: `*` took {spilled:.2} % ({by:?})");
        assert!(download.running(), "the download ended at the step to {ready} ready: {:?}", download.finish(Duration::from_secs(1)));
    }

    assert!(wrk.running(), "wrk ended before the rolling update did");
    let (report, text) = wrk.stop().expect("wrk");
    eprintln!("wrk -t1 -c2, a new connection per request, through the update: {report}");
    assert!(report.requests > 0, "wrk made no request:\n{text}");
    assert_eq!((report.socket_errors(), report.non_2xx_3xx), (0, 0), "every wrk request got a 200: {report}\n{text}");

    // The download began at full health, so on a pod of z1; that pod lost
    // its readiness on the way but kept running, and its connection was
    // never touched.
    let r = download.finish(lasts + Duration::from_secs(30)).expect("the download");
    assert!(
        r.exit == Some(0) && r.http_code == 200 && r.size_download == FILE && r.bytes_written == FILE && zone.contains(&r.backend.as_str()),
        "the download is whole ({FILE} bytes, HTTP 200, curl exit 0, from a pod of z1): {r:?}"
    );
}

/// 10,000 new connections to `url` by curl from a pod of node-a: how many
/// each pod answered. Every request must get a 200.
fn http_split(node: &Node, net: &PodNetwork, url: &str) -> BTreeMap<String, usize> {
    let r = get_each(&net.netns, Some(&node.cgroup), url, CONNECTS).expect("run curl");
    assert_eq!(r.len(), CONNECTS, "curl reported {} of {CONNECTS} requests", r.len());
    let failed: Vec<&Reply> = r.iter().filter(|x| x.http_code != 200).collect();
    assert!(failed.is_empty(), "{} of {CONNECTS} requests failed, e.g. {:?}", failed.len(), failed.first());
    let mut by = BTreeMap::new();
    for x in r {
        *by.entry(x.backend).or_insert(0) += 1;
    }
    by
}

/// Waits until 200 new HTTP connections reach only pods of `want`, and
/// each of them: the agent programmed the step.
fn wait_for_http(node: &Node, net: &PodNetwork, url: &str, want: &[&str]) {
    eventually(&format!("new connections to {url} to reach exactly {want:?}"), || {
        let r = get_each(&net.netns, Some(&node.cgroup), url, 200).map_err(|e| e.to_string())?;
        let seen: BTreeSet<&str> = r.iter().map(|x| x.backend.as_str()).collect();
        let ok = r.len() == 200 && r.iter().all(|x| x.http_code == 200) && seen == want.iter().copied().collect();
        if ok { Ok(()) } else { Err(format!("{seen:?}")) }
    });
}

/// One test at a time: each drives 10,000 connects per step, and wrk keeps
/// a core busy.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}
