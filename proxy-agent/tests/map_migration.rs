//! Changing a map capacity on restart: the agent recreates the pinned maps
//! at the new size, copies their entries, and swaps the programs over
//! while a client keeps connecting to a ClusterIP. Not one connect may
//! fail.

mod support;

use std::time::Duration;

use aya::maps::MapInfo;
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

const MAPS: [&str; 6] = ["SERVICES", "SLOTS", "BACKENDS", "SOCK_REVNAT", "NP_SERVICES", "AFFINITY"];

#[test]
fn capacity_changes_on_restart_migrate_the_maps_without_a_failed_connect() {
    let mut net = PodNetwork::new();
    for i in 1..=2 {
        net.backend(&format!("pod-{i}"), &format!("10.244.1.{i}"), &[8080]);
    }
    let mut node = Node::new("node-a");
    node.write_manifest("web.yaml", &web());
    // Self-sized first (no --max-* flag).
    node.start_agent();
    wait_for_backends(&node, &net, "10.96.0.20:80", &[], &["pod-1", "pod-2"]);
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
