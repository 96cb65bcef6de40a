//! `sessionAffinity: ClientIP` at the socket layer, end to end: a real
//! agent programs the socket programs of a test cgroup; client pods (each
//! its own network namespace, the client identity at connect()) dial a
//! ClusterIP whose three backends answer with their names.

mod support;

use std::time::Duration;

use proxy_agent::datapath::dump;
use proxy_test_support::sandbox::{Netns, command_in};
use proxy_test_support::wait::eventually;
use serde_json::Value;
use support::*;

const WEB: &str = "10.96.0.10:80";

fn web(affinity: &str, endpoints: &[(&str, bool, &str)]) -> String {
    ServiceSpec {
        name: "web",
        cluster_ips: &["10.96.0.10"],
        ports: &[("http", 80, "TCP", 8080), ("dns", 80, "UDP", 5353)],
        endpoints,
        extra_spec: affinity,
        annotations: "",
    }
    .yaml()
}

const CLIENT_IP: &str = "  sessionAffinity: ClientIP\n";
const THREE: [(&str, bool, &str); 3] = [("10.244.0.1", true, "node-a"), ("10.244.0.2", true, "node-a"), ("10.244.0.3", true, "node-a")];

/// Three backends (TCP 8080 as pod-*, UDP 5353 as dns-*) and an agent
/// serving `yaml`.
fn setup(yaml: &str) -> (PodNetwork, Node) {
    let mut net = PodNetwork::new();
    for (i, ip) in ["10.244.0.1", "10.244.0.2", "10.244.0.3"].iter().enumerate() {
        let n = ["a", "b", "c"][i];
        net.backend(&format!("pod-{n}"), ip, &[8080]);
        net.backend(&format!("dns-{n}"), ip, &[5353]);
    }
    let mut node = Node::new("node-a");
    node.write_manifest("web.yaml", yaml);
    node.start_agent();
    (net, node)
}

/// A second client pod: its own network namespace, linked to the pod
/// network (where the backends live) by a veth pair and nothing else.
struct OtherPod {
    ns: Netns,
}

impl OtherPod {
    fn new(net: &PodNetwork) -> OtherPod {
        let ns = Netns::new("tpa").expect("pod netns");
        ns.veth("eth0", &net.netns, "to-pod2").expect("veth");
        ns.ip(&["addr", "add", "10.244.9.2/24", "dev", "eth0"]).expect("pod address");
        net.netns.ip(&["addr", "add", "10.244.9.1/24", "dev", "to-pod2"]).expect("gateway address");
        ns.ip(&["route", "add", "default", "via", "10.244.9.1"]).expect("pod route");
        OtherPod { ns }
    }

    fn probe(&self, node: &Node, args: &[&str]) -> Vec<Value> {
        let mut cmd = command_in(agent_bin(), Some(&self.ns), Some(&node.cgroup)).expect("probe command");
        cmd.arg("probe").args(args).stdin(std::process::Stdio::null()).stderr(std::process::Stdio::inherit());
        let out = cmd.output().expect("run probe");
        String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).expect("probe output")).collect()
    }
}

/// The one backend that answered every attempt (all must have succeeded).
fn one_backend(what: &str, results: &[Value]) -> String {
    assert!(results.iter().all(|r| r["ok"] == true), "{what}: {:?}", results.iter().find(|r| r["ok"] != true));
    let got = replies(results);
    assert_eq!(got.len(), 1, "{what}: every connection must reach one backend, got {got:?}");
    got.into_iter().next().unwrap_or_default()
}

fn counter(node: &Node, name: &str) -> u64 {
    let snap = dump::read(node.pins.path()).expect("read maps");
    dump::report(node.pins.path(), &snap).counters.get(name).copied().unwrap_or(0)
}

/// The backends the agent programmed for the TCP frontend.
fn programmed(node: &Node) -> usize {
    let snap = dump::read(node.pins.path()).expect("read maps");
    dump::report(node.pins.path(), &snap).services.iter().find(|s| s.frontend == "10.96.0.10:80/TCP").map_or(0, |s| s.slots.len())
}

fn first_ok(node: &Node, net: &PodNetwork, args: &[&str]) -> String {
    eventually("the Service to answer", || {
        let r = node.probe(net, args);
        if r[0]["ok"] == true { Ok(r[0]["reply"].as_str().unwrap_or_default().to_string()) } else { Err(r) }
    })
}

#[test]
fn fifty_connects_from_one_pod_land_on_one_backend_and_another_pod_chooses_its_own() {
    let (net, node) = setup(&web(CLIENT_IP, &THREE));
    first_ok(&node, &net, &["--to", WEB]);
    let hits = counter(&node, "affinity_hit");
    let first = one_backend("pod 1, TCP", &node.probe(&net, &["--to", WEB, "--count", "50"]));
    assert!(counter(&node, "affinity_hit") >= hits + 50, "the affinity entry chose each backend");
    let other = OtherPod::new(&net);
    let second = one_backend("pod 2, TCP", &other.probe(&node, &["--to", WEB, "--count", "50"]));
    eprintln!("pod 1 sticks to {first}, pod 2 to {second}");
    // UDP: every socket of a pod, unconnected or connected, reaches the
    // pod's one backend.
    let udp = one_backend("pod 1, UDP", &node.probe(&net, &["--to", WEB, "--udp", "--per-socket", "3", "--count", "10"]));
    let connected = one_backend("pod 1, connected UDP", &node.probe(&net, &["--to", WEB, "--udp", "--connected", "--count", "10"]));
    assert_eq!(udp, connected);
    // The dump shows the two pods' entries for the TCP frontend, honoured.
    let snap = dump::read(node.pins.path()).expect("read maps");
    let r = dump::report(node.pins.path(), &snap);
    let tcp: Vec<&dump::AffinityView> = r.affinity.iter().filter(|a| a.frontend == "10.96.0.10:80/TCP").collect();
    assert_eq!(tcp.len(), 2, "{:?}", r.affinity);
    assert!(tcp.iter().all(|a| a.honoured), "{tcp:?}");
    let view = r.services.iter().find(|s| s.frontend == "10.96.0.10:80/TCP").expect("frontend");
    assert_eq!(view.affinity_timeout_seconds, Some(10_800));
    assert!(r.consistent, "{:?}", r.findings);
}

/// kube-proxy keeps a client's choice per Service port, so a pod that
/// reaches the port through its ClusterIP and through its external IP keeps
/// one backend: the first connect through the second frontend is already an
/// affinity hit, and the dump lists one entry for the two frontends.
#[test]
fn the_frontends_of_one_service_port_share_a_clients_choice() {
    let external = format!("{CLIENT_IP}  externalIPs: [192.0.2.10]\n");
    let (net, node) = setup(&web(&external, &THREE));
    let first = first_ok(&node, &net, &["--to", WEB]);
    let hits = counter(&node, "affinity_hit");
    let via_external = one_backend("pod 1 through the external IP", &node.probe(&net, &["--to", "192.0.2.10:80", "--count", "20"]));
    assert_eq!(via_external, first, "the ClusterIP's choice holds for the external IP");
    assert!(counter(&node, "affinity_hit") >= hits + 20, "every connect through the external IP was an affinity hit");
    // And the other way round, for a second pod.
    let other = OtherPod::new(&net);
    let second = one_backend("pod 2 through the external IP", &other.probe(&node, &["--to", "192.0.2.10:80"]));
    assert_eq!(one_backend("pod 2 through the ClusterIP", &other.probe(&node, &["--to", WEB, "--count", "20"])), second);
    let snap = dump::read(node.pins.path()).expect("read maps");
    let r = dump::report(node.pins.path(), &snap);
    let tcp: Vec<&dump::AffinityView> = r.affinity.iter().filter(|a| a.frontend.contains("10.96.0.10:80/TCP")).collect();
    assert_eq!(tcp.len(), 2, "one entry per pod for the TCP port, not one per frontend: {:?}", r.affinity);
    assert!(tcp.iter().all(|a| a.frontend.contains("192.0.2.10:80/TCP") && a.honoured), "{tcp:?}");
    let scopes: std::collections::BTreeSet<Option<u32>> =
        r.services.iter().filter(|s| s.frontend.ends_with(":80/TCP")).map(|s| s.affinity_scope).collect();
    assert_eq!(scopes.len(), 1, "the port's frontends carry one scope: {scopes:?}");
    assert!(r.consistent, "{:?}", r.findings);
}

#[test]
fn use_refreshes_the_entry_and_after_the_timeout_new_choices_are_made() {
    // 3 s: short enough to wait out.
    let short = "  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 3}}\n";
    let (net, node) = setup(&web(short, &THREE));
    first_ok(&node, &net, &["--to", WEB]);
    // Used every second for six seconds, twice the timeout but never idle
    // for as long, so the choice stays: one probe process makes the seven
    // connects, a new socket each, 1 s apart. A process started per
    // connect could leave the entry idle past 3 s under a TCG guest's
    // load (process start alone takes seconds there; seen on 6.1 in CI),
    // and then the next connect rightly chose again.
    let refreshed = node.probe(&net, &["--to", WEB, "--count", "7", "--interval-ms", "1000"]);
    assert_eq!(refreshed.len(), 7, "{refreshed:?}");
    one_backend("refreshed every second", &refreshed);
    // Idle for longer than the timeout: the entry has expired and the next
    // connection chooses again (and may well choose the same backend).
    let stale = counter(&node, "affinity_stale");
    std::thread::sleep(Duration::from_secs(4));
    one_backend("after the timeout", &node.probe(&net, &["--to", WEB]));
    assert_eq!(counter(&node, "affinity_stale"), stale + 1, "the expired entry was not used");
    // With three backends, one of a few expirations lands elsewhere.
    let backend = one_backend("chosen again", &node.probe(&net, &["--to", WEB]));
    let mut changed = false;
    for _ in 0..10 {
        std::thread::sleep(Duration::from_millis(3600));
        let now = one_backend("after another timeout", &node.probe(&net, &["--to", WEB, "--count", "3"]));
        if now != backend {
            changed = true;
            break;
        }
    }
    assert!(changed, "ten expirations never chose another backend than {backend}");
}

#[test]
fn a_backend_removed_or_no_longer_ready_loses_its_clients_at_once() {
    let (net, mut node) = setup(&web(CLIENT_IP, &THREE));
    let first = first_ok(&node, &net, &["--to", WEB]);
    one_backend("before", &node.probe(&net, &["--to", WEB, "--count", "5"]));
    // The affine backend leaves the EndpointSlice.
    let ip = |name: &str| format!("10.244.0.{}", 1 + ["pod-a", "pod-b", "pod-c"].iter().position(|n| *n == name).expect("a pod name"));
    let rest: Vec<(String, bool, &str)> =
        THREE.iter().filter(|(a, _, _)| *a != ip(&first)).map(|(a, r, n)| (a.to_string(), *r, *n)).collect();
    let eps: Vec<(&str, bool, &str)> = rest.iter().map(|(a, r, n)| (a.as_str(), *r, *n)).collect();
    node.write_manifest("web.yaml", &web(CLIENT_IP, &eps));
    eventually("the agent to program two backends", || if programmed(&node) == 2 { Ok(()) } else { Err(programmed(&node)) });
    // The very next connection goes elsewhere, and the client sticks there.
    let second = one_backend("after the removal", &node.probe(&net, &["--to", WEB, "--count", "20"]));
    assert_ne!(second, first, "the removed backend kept its client");
    // That backend stops being ready while the other one serves.
    let eps: Vec<(&str, bool, &str)> = eps.iter().map(|(a, r, n)| (*a, *r && *a != ip(&second), *n)).collect();
    node.write_manifest("web.yaml", &web(CLIENT_IP, &eps));
    eventually("the agent to program one backend", || if programmed(&node) == 1 { Ok(()) } else { Err(programmed(&node)) });
    let third = one_backend("after it stopped being ready", &node.probe(&net, &["--to", WEB, "--count", "20"]));
    assert!(third != first && third != second, "{first} {second} {third}");
    let r = dump::report(node.pins.path(), &dump::read(node.pins.path()).expect("read maps"));
    assert!(r.consistent, "{:?}", r.findings);
    node.stop_agent();
}

#[test]
fn an_agent_restart_keeps_every_client_on_its_backend_and_dropping_affinity_forgets_them() {
    let (net, mut node) = setup(&web(CLIENT_IP, &THREE));
    let first = first_ok(&node, &net, &["--to", WEB]);
    node.stop_agent();
    // While no agent runs, and after the next one adopted the maps.
    assert_eq!(one_backend("no agent", &node.probe(&net, &["--to", WEB, "--count", "10"])), first);
    node.start_agent();
    eventually("the new agent to take over", || if node.agent_log().matches("first sync applied").count() >= 2 { Ok(()) } else { Err(()) });
    // It read every frontend's affinity back from the maps: nothing to
    // rewrite.
    let log = node.agent_log();
    let synced = log.lines().rfind(|l| l.contains("synced")).unwrap_or_default();
    assert!(synced.contains("upserts=0"), "the restarted agent rewrote frontends: {synced}");
    assert_eq!(one_backend("restarted", &node.probe(&net, &["--to", WEB, "--count", "20"])), first);
    // Affinity dropped: the clients' entries are deleted and connections
    // spread over every backend again.
    node.write_manifest("web.yaml", &web("", &THREE));
    eventually("the pod's affinity entries to go", || {
        let r = dump::report(node.pins.path(), &dump::read(node.pins.path()).map_err(|e| e.to_string())?);
        if r.affinity.is_empty() && r.services.iter().all(|s| s.affinity_timeout_seconds.is_none()) {
            Ok(())
        } else {
            Err(format!("{:?}", r.affinity))
        }
    });
    wait_for_backends(&node, &net, WEB, &[], &["pod-a", "pod-b", "pod-c"]);
}
