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

/// An upgrade over pins of a build whose `SERVICES` and `NP_SERVICES` held
/// 16-byte values (before `ServiceValue::groups`, issue #48). The agent
/// recreates both with this build's values, each carried over with the new
/// bytes zero (plain slots), and swaps the programs over while a client
/// keeps connecting to a ClusterIP: not one connect fails. The earlier
/// build's pins are made here from the running datapath's (the same
/// entries, cut to 16 bytes); its programs keep the maps they hold.
#[test]
fn services_pinned_with_an_earlier_builds_smaller_values_are_migrated_without_a_failed_connect() {
    let (net, mut node) = serving_web();
    let client = Client::start(&node, &net, "10.96.0.20:80");
    std::thread::sleep(Duration::from_millis(300));
    node.stop_agent();
    let pins = node.pins.path().to_path_buf();
    let value_size = |map: &str| MapInfo::from_pin(pins.join(map)).expect("map info").value_size();
    let entries_before = earlier_layout(&pins.join("SERVICES"));
    earlier_layout(&pins.join("NP_SERVICES"));
    assert_eq!((value_size("SERVICES"), value_size("NP_SERVICES")), (16, 16));
    assert_eq!(entries_before, 1, "web's frontend");

    node.start_agent();
    let full = size_of::<proxy_common::ServiceValue>() as u32;
    proxy_test_support::wait::eventually("the agent to migrate SERVICES", || {
        if value_size("SERVICES") == full && value_size("NP_SERVICES") == full { Ok(()) } else { Err(value_size("SERVICES")) }
    });
    wait_for_backends(&node, &net, "10.96.0.20:80", &[], &["pod-1", "pod-2"]);
    std::thread::sleep(Duration::from_millis(300));
    assert_no_failures("the value-size migration", client.finish());
    let log = node.agent_log();
    assert!(log.contains(&format!("map SERVICES recreated with {full}-byte values (was 16; 1 entries carried over)")), "{log}");
    assert!(log.contains(&format!("map NP_SERVICES recreated with {full}-byte values (was 16;")), "{log}");
}

/// Replaces the `SERVICES`-layout hash map pinned at `pin` by one with the
/// same keys, flags and capacity whose values are the first 16 bytes of
/// the old ones (the layout before `ServiceValue::groups`), pinned at the
/// same path. Returns how many entries it copied.
fn earlier_layout(pin: &std::path::Path) -> usize {
    use aya::maps::{HashMap, Map, MapData};
    use proxy_common::{ServiceKey, ServiceValue};
    const BPF_MAP_TYPE_HASH: u32 = 1;
    let info = MapInfo::from_pin(pin).expect("map info");
    let old: HashMap<MapData, ServiceKey, ServiceValue> =
        HashMap::try_from(Map::HashMap(MapData::from_pin(pin).expect("open the pinned map"))).expect("a SERVICES-layout map");
    let entries = proxy_agent::datapath::bpf_batch::read_all(&old).expect("read the entries");
    std::fs::remove_file(pin).expect("unpin the map");
    let fd = pin_new_map(pin, BPF_MAP_TYPE_HASH, info.key_size(), 16, info.max_entries(), info.map_flags());
    let mut new: HashMap<MapData, ServiceKey, [u8; 16]> =
        HashMap::try_from(Map::HashMap(MapData::from_fd(fd).expect("the new map"))).expect("a 16-byte-value map");
    for (k, v) in &entries {
        // The earlier layout is this one's first 16 bytes: service_id,
        // backend_count, generation, flags.
        let mut short = [0u8; 16];
        for (at, word) in [v.service_id, v.backend_count, v.generation, v.flags].into_iter().enumerate() {
            short[at * 4..at * 4 + 4].copy_from_slice(&word.to_ne_bytes());
        }
        new.insert(k, short, 0).expect("copy an entry");
    }
    entries.len()
}
