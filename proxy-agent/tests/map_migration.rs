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
    let entries_before = earlier_layout(&pins.join("SERVICES"), 16);
    earlier_layout(&pins.join("NP_SERVICES"), 16);
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

/// Replaces the hash map pinned at `pin` by one with the same keys, flags
/// and capacity whose values are the first `value_size` bytes of the old
/// ones, pinned at the same path. Returns how many entries it copied.
fn earlier_layout(pin: &std::path::Path, value_size: u32) -> usize {
    use std::os::fd::{AsFd, AsRawFd};
    const BPF_MAP_CREATE: libc::c_long = 0;
    const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
    const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
    const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;
    const BPF_OBJ_PIN: libc::c_long = 6;
    #[repr(C)]
    struct Create {
        map_type: u32,
        key_size: u32,
        value_size: u32,
        max_entries: u32,
        map_flags: u32,
    }
    #[repr(C)]
    struct Elem {
        map_fd: u32,
        _pad: u32,
        key: u64,
        value: u64,
        flags: u64,
    }
    #[repr(C)]
    struct Pin {
        pathname: u64,
        bpf_fd: u32,
        file_flags: u32,
    }
    fn bpf<T>(cmd: libc::c_long, attr: &T) -> i64 {
        // SAFETY: `attr` is the member of `union bpf_attr` that `cmd`
        // reads, with every pointer in it valid for the call.
        unsafe { libc::syscall(libc::SYS_bpf, cmd, std::ptr::from_ref(attr), size_of::<T>()) }
    }
    let old = aya::maps::MapData::from_pin(pin).expect("open the pinned map");
    let info = MapInfo::from_pin(pin).expect("map info");
    let (ks, vs) = (info.key_size() as usize, info.value_size() as usize);
    let old_fd = old.fd().as_fd().as_raw_fd() as u32;
    let create = Create { map_type: 1, key_size: ks as u32, value_size, max_entries: info.max_entries(), map_flags: info.map_flags() };
    let new_fd = bpf(BPF_MAP_CREATE, &create);
    assert!(new_fd >= 0, "BPF_MAP_CREATE: {}", std::io::Error::last_os_error());
    let (mut key, mut next, mut value) = (vec![0u8; ks], vec![0u8; ks], vec![0u8; vs]);
    let mut copied = 0;
    let mut first = true;
    loop {
        let prev = if first { 0 } else { key.as_ptr() as u64 };
        let walk = Elem { map_fd: old_fd, _pad: 0, key: prev, value: next.as_mut_ptr() as u64, flags: 0 };
        if bpf(BPF_MAP_GET_NEXT_KEY, &walk) != 0 {
            break;
        }
        first = false;
        std::mem::swap(&mut key, &mut next);
        let lookup = Elem { map_fd: old_fd, _pad: 0, key: key.as_ptr() as u64, value: value.as_mut_ptr() as u64, flags: 0 };
        assert_eq!(bpf(BPF_MAP_LOOKUP_ELEM, &lookup), 0, "lookup: {}", std::io::Error::last_os_error());
        let update = Elem { map_fd: new_fd as u32, _pad: 0, key: key.as_ptr() as u64, value: value.as_ptr() as u64, flags: 0 };
        assert_eq!(bpf(BPF_MAP_UPDATE_ELEM, &update), 0, "update: {}", std::io::Error::last_os_error());
        copied += 1;
    }
    std::fs::remove_file(pin).expect("unpin the map");
    let path = std::ffi::CString::new(pin.as_os_str().as_encoded_bytes()).expect("pin path");
    let pin_attr = Pin { pathname: path.as_ptr() as u64, bpf_fd: new_fd as u32, file_flags: 0 };
    assert_eq!(bpf(BPF_OBJ_PIN, &pin_attr), 0, "BPF_OBJ_PIN: {}", std::io::Error::last_os_error());
    // SAFETY: the fd came from BPF_MAP_CREATE above and is ours; the pin
    // keeps the map.
    unsafe { libc::close(new_fd as i32) };
    copied
}
