//! Changing a map capacity on restart: the agent recreates the pinned maps
//! at the new size, copies their entries, and swaps the programs over
//! while a client keeps connecting to a ClusterIP. Not one connect may
//! fail.

mod support;

use std::time::Duration;

use aya::maps::MapInfo;
use proxy_agent::datapath::maps::Capacities;
use proxy_agent::datapath::socket_loader;
use support::*;

fn web() -> String {
    let endpoints = [("10.244.1.1", true, "node-a"), ("10.244.1.2", true, "node-a")];
    ServiceSpec {
        name: "web",
        cluster_ips: &["10.96.0.20"],
        ports: &[("", 80, "TCP", 8080)],
        endpoints: &endpoints,
        extra_spec: "",
        annotations: "",
    }
    .yaml()
}

fn capacity(node: &Node, map: &str) -> u32 {
    MapInfo::from_pin(node.pins.path().join(map)).unwrap_or_else(|e| panic!("{map}: {e}")).max_entries()
}

/// Two pods behind `web`, and an agent at default flags serving them.
fn serving_web() -> (PodNetwork, Node) {
    let mut net = PodNetwork::new();
    for i in 1..=2 {
        net.backend(&format!("pod-{i}"), &format!("10.244.1.{i}"), &[8080]);
    }
    let mut node = Node::new("node-a");
    node.write_manifest("web.yaml", &web());
    node.start_agent();
    wait_for_backends(&node, &net, "10.96.0.20:80", &[], &["pod-1", "pod-2"]);
    (net, node)
}

const MAPS: [&str; 6] = ["SERVICES", "SLOTS", "BACKENDS", "SOCK_REVNAT", "NP_SERVICES", "AFFINITY"];

#[test]
fn capacity_changes_on_restart_migrate_the_maps_without_a_failed_connect() {
    // Self-sized first (no --max-* flag).
    let (net, mut node) = serving_web();
    let sized: Vec<u32> = MAPS.iter().map(|m| capacity(&node, m)).collect();

    let client = Client::start(&node, &net, "10.96.0.20:80");
    std::thread::sleep(Duration::from_millis(300));
    let rounds: [[&str; 2]; 2] = [["2000", "30000"], ["3000", "40000"]];
    for [services, slots] in rounds {
        node.stop_agent();
        node.start_agent_with(&[
            "--max-services",
            services,
            "--max-slots",
            slots,
            "--max-backends",
            "5000",
            "--max-sock-revnat",
            slots,
            "--max-affinity",
            services,
        ]);
        proxy_test_support::wait::eventually("the agent to resize the maps", || {
            let got = capacity(&node, "SERVICES").to_string();
            if got == services { Ok(()) } else { Err(got) }
        });
        // Still the same backends, through the new maps.
        wait_for_backends(&node, &net, "10.96.0.20:80", &[], &["pod-1", "pod-2"]);
        let s: u32 = services.parse().unwrap();
        let sl: u32 = slots.parse().unwrap();
        assert_eq!(MAPS.map(|m| capacity(&node, m)), [s, sl, 5000, sl, s, s], "sized at first: {sized:?}");
        std::thread::sleep(Duration::from_millis(300));
    }
    let result = client.finish();
    assert_no_failures("capacity migrations", result);

    let log = node.agent_log();
    assert!(log.contains("map SERVICES resized from 2000 to 3000 entries (1 entries carried over)"), "{log}");
    assert!(log.contains("map SLOTS resized from 30000 to 40000 entries (2 entries carried over)"), "{log}");
    // No staged copy is left behind.
    let leftovers: Vec<String> = std::fs::read_dir(node.pins.path())
        .expect("pin dir")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| proxy_agent::datapath::pins::is_staged(n))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

/// With `--devices none` (these tests' agents run in the host's network
/// namespace, so always with it) no TC program runs, and the TC datapath's
/// maps are created small (their floors) rather than at the sized
/// capacities. An install at full size (as a start with devices makes)
/// grows them like any capacity change, and a later start without devices
/// leaves them as they are: no copy either way.
#[test]
fn tc_maps_stay_small_while_no_device_is_attached_and_grow_when_one_is() {
    let (net, mut node) = serving_web();
    // The floors of `sizing` (Services 1024, slots 16,384, backends 8192,
    // conntrack 16,384).
    let tc = ["NP_SERVICES", "NP_SLOTS", "NP_BACKENDS", "NP_CT"];
    assert_eq!(tc.map(|m| capacity(&node, m)), [1024, 16_384, 8192, 16_384]);
    let socket = ["SERVICES", "SLOTS", "BACKENDS"].map(|m| capacity(&node, m));
    assert!(socket[1] > 16_384, "the socket maps are sized as before: {socket:?}");

    node.stop_agent();
    let full = Capacities {
        services: socket[0],
        slots: socket[1],
        backends: socket[2],
        sock_revnat: capacity(&node, "SOCK_REVNAT"),
        np_conntrack: 65_536,
        affinity: capacity(&node, "AFFINITY"),
    };
    socket_loader::install(node.cgroup.path(), node.pins.path(), full).expect("install at full size");
    let grown = [full.services, full.slots, full.backends, full.np_conntrack];
    assert_eq!(tc.map(|m| capacity(&node, m)), grown);

    node.start_agent();
    wait_for_backends(&node, &net, "10.96.0.20:80", &[], &["pod-1", "pod-2"]);
    assert_eq!(tc.map(|m| capacity(&node, m)), grown, "kept as pinned while no device is attached");
    let log = node.agent_log();
    assert!(!log.contains("map NP_SLOTS resized"), "{log}");
}
