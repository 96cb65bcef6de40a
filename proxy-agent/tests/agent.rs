//! The standalone agent end to end: manifest edits, bad input, restarts
//! under load, reset.

mod support;

use std::time::Duration;

use proxy_test_support::wait::eventually;
use support::*;

fn web(endpoints: &[(&str, bool, &str)]) -> String {
    ServiceSpec { name: "web", cluster_ips: &["10.96.0.20"], ports: &[("", 80, "TCP", 8080)], endpoints, extra_spec: "", annotations: "" }
        .yaml()
}

fn pods(net: &mut PodNetwork, n: usize) {
    for i in 1..=n {
        net.backend(&format!("pod-{i}"), &format!("10.244.1.{i}"), &[8080]);
    }
}

fn eps(ips: &[&'static str]) -> Vec<(&'static str, bool, &'static str)> {
    ips.iter().map(|ip| (*ip, true, "node-a")).collect()
}

#[test]
fn connects_follow_manifest_edits() {
    let mut net = PodNetwork::new();
    pods(&mut net, 3);
    let mut node = Node::new("node-a");
    node.write_manifest("web.yaml", &web(&eps(&["10.244.1.1", "10.244.1.2"])));
    node.start_agent();
    let to = "10.96.0.20:80";
    wait_for_backends(&node, &net, to, &[], &["pod-1", "pod-2"]);

    node.write_manifest("web.yaml", &web(&eps(&["10.244.1.1", "10.244.1.2", "10.244.1.3"])));
    wait_for_backends(&node, &net, to, &[], &["pod-1", "pod-2", "pod-3"]);

    node.write_manifest("web.yaml", &web(&eps(&["10.244.1.3"])));
    wait_for_backends(&node, &net, to, &[], &["pod-3"]);

    node.write_manifest("web.yaml", &web(&[]));
    eventually("scale to zero refuses connections", || {
        let r = node.probe(&net, &["--to", to]);
        if r[0]["errno"] == 111 { Ok(()) } else { Err(r) }
    });

    node.write_manifest("web.yaml", &web(&eps(&["10.244.1.1", "10.244.1.2"])));
    wait_for_backends(&node, &net, to, &[], &["pod-1", "pod-2"]);

    // Deleting the Service removes the frontend: the ClusterIP is no longer
    // ours and is unreachable again.
    std::fs::remove_file(node.manifests.0.join("web.yaml")).expect("remove manifest");
    eventually("a deleted Service is no longer translated", || {
        let r = node.probe(&net, &["--to", to]);
        if r[0]["errno"] == 101 { Ok(()) } else { Err(r) }
    });
}

#[test]
fn bad_objects_are_reported_and_the_rest_keeps_working() {
    let mut net = PodNetwork::new();
    pods(&mut net, 1);
    let mut node = Node::new("node-a");
    node.write_manifest("web.yaml", &web(&eps(&["10.244.1.1"])));
    node.write_manifest(
        "broken.yaml",
        "apiVersion: v1\nkind: Service\nmetadata: {name: broken}\nspec: {clusterIP: 10.96.0.300, ports: [{port: 80}]}\n",
    );
    node.write_manifest("garbage.yaml", "kind: [this is not yaml\n");
    node.start_agent();
    wait_for_backends(&node, &net, "10.96.0.20:80", &[], &["pod-1"]);
    let log = node.agent_log();
    assert!(log.contains("default/broken") && log.contains("is not an IP address"), "{log}");
    assert!(log.contains("garbage.yaml") && log.contains("not valid YAML"), "{log}");
}

/// A client connects in a loop while the agent is stopped, killed and
/// restarted: not one connect may fail, because the pinned programs and
/// maps keep serving and the new agent adopts them.
#[test]
fn agent_restarts_do_not_interrupt_traffic() {
    let mut net = PodNetwork::new();
    pods(&mut net, 2);
    let mut node = Node::new("node-a");
    node.write_manifest("web.yaml", &web(&eps(&["10.244.1.1", "10.244.1.2"])));
    node.start_agent();
    wait_for_backends(&node, &net, "10.96.0.20:80", &[], &["pod-1", "pod-2"]);

    let client = Client::start(&node, &net, "10.96.0.20:80");

    std::thread::sleep(Duration::from_millis(300));
    for round in 0..3 {
        if round == 1 {
            node.kill_agent();
        } else {
            node.stop_agent();
        }
        std::thread::sleep(Duration::from_millis(300));
        node.start_agent();
        std::thread::sleep(Duration::from_millis(700));
    }
    // The restarted agent is in charge: an edit is still applied.
    node.write_manifest("web.yaml", &web(&eps(&["10.244.1.2"])));
    wait_for_backends(&node, &net, "10.96.0.20:80", &[], &["pod-2"]);

    let result = client.finish();
    assert!(result.0 > 100, "the client made only {} connects", result.0);
    assert_no_failures("agent restarts", result);
    let log = node.agent_log();
    assert!(log.contains("adopted_frontends=1"), "a restarted agent adopts the pinned state: {log}");
}

#[test]
fn reset_removes_everything_the_agent_installed() {
    let mut net = PodNetwork::new();
    pods(&mut net, 1);
    let mut node = Node::new("node-a");
    node.write_manifest("web.yaml", &web(&eps(&["10.244.1.1"])));
    node.start_agent();
    wait_for_backends(&node, &net, "10.96.0.20:80", &[], &["pod-1"]);
    node.stop_agent();
    // Still served with the agent gone.
    assert_eq!(replies(&node.probe(&net, &["--to", "10.96.0.20:80"])), set(&["pod-1"]));

    let out = std::process::Command::new(agent_bin()).args(["reset", "--bpffs"]).arg(node.pins.path()).output().expect("run reset");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(!node.pins.path().exists(), "pin directory left behind");
    let r = node.probe(&net, &["--to", "10.96.0.20:80"]);
    assert_eq!(r[0]["errno"], 101, "after reset the ClusterIP is unreachable again: {}", r[0]);
    // Reset is idempotent.
    let again = std::process::Command::new(agent_bin()).args(["reset", "--bpffs"]).arg(node.pins.path()).output().expect("reset");
    assert!(again.status.success());
}

#[test]
fn devices_none_mixed_with_interface_names_is_rejected_before_anything_runs() {
    // `reset` shares the datapath flags with `run`; clap rejects the value
    // while parsing, so nothing is installed or removed (the pin directory
    // does not even exist).
    let dir = TempDir::new("tpt-devices");
    for value in ["eth0,none", "none,eth0", "auto,eth0"] {
        let out = std::process::Command::new(agent_bin())
            .args(["reset", "--devices", value, "--bpffs"])
            .arg(dir.0.join("pins"))
            .output()
            .expect("run reset");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "--devices {value} accepted: {stderr}");
        assert!(stderr.contains("cannot be combined with interface names (eth0)"), "--devices {value}: {stderr}");
    }
}
