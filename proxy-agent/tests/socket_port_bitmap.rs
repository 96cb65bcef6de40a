//! The socket programs' port bitmap (`SOCK_PORTS`): a connect() to a port
//! no frontend uses returns before the `SERVICES` lookup; the map writer
//! sets a port's bit before it writes the first frontend on it and clears
//! it after the last one is deleted; the socket loader fills it from the
//! pinned `SERVICES` before new programs run over pins that had none.
//!
//! Clients run in a network namespace of the test's own with the backends
//! on its loopback; a ClusterIP that is not translated has no route there.

mod support;

use std::net::IpAddr;
use std::path::Path;
use std::process::Stdio;

use aya::maps::{Array, Map, MapData};
use proxy_agent::datapath::dump;
use proxy_agent::datapath::map_writer::MapWriter;
use proxy_agent::datapath::maps::Capacities;
use proxy_agent::datapath::port_bits::{self, Bitmap, PortBits, PortSet};
use proxy_agent::datapath::socket_loader;
use proxy_agent::decide::plan::Plan;
use proxy_agent::model::{Backend, Frontend, Protocol};
use proxy_common as pc;
use proxy_test_support::sandbox::{Cgroup, PinDir, command_in};
use proxy_test_support::wait::eventually;
use support::*;

const ENETUNREACH: i64 = 101;

/// `SOCK_PORTS` as the map holds it.
fn bits(pins: &Path) -> PortSet {
    let data = MapData::from_pin(pins.join(pc::SOCK_PORTS_MAP)).expect("open SOCK_PORTS");
    let map: Array<MapData, u64> = Array::try_from(Map::Array(data)).expect("SOCK_PORTS is an array");
    assert_eq!(map.len(), pc::SOCK_PORTS_ENTRIES);
    let words: Vec<u64> = map.iter().collect::<Result<_, _>>().expect("read SOCK_PORTS");
    PortSet::from_words_of(Bitmap::Socket, words).expect("every word")
}

fn probe(net: &PodNetwork, cg: &Cgroup, to: &str) -> serde_json::Value {
    let mut cmd = command_in(agent_bin(), Some(&net.netns), Some(cg)).expect("probe");
    cmd.arg("probe").args(["--to", to]).stdin(Stdio::null());
    let out = cmd.output().expect("run probe");
    let line = String::from_utf8_lossy(&out.stdout).lines().next().map(str::to_string).expect("one result line");
    serde_json::from_str(&line).expect("json line")
}

fn fe(ip: &str, port: u16) -> Frontend {
    Frontend { ip: ip.parse::<IpAddr>().expect("literal"), port, protocol: Protocol::Tcp }
}

fn plan(upserts: &[Frontend], deletes: &[Frontend]) -> Plan {
    let backend = Backend { ip: "10.244.5.1".parse().expect("literal"), port: 8080 };
    Plan { upserts: upserts.iter().map(|f| (*f, vec![backend])).collect(), deletes: deletes.to_vec(), ..Plan::default() }
}

/// The consistency check of `dump` sees every frontend's port covered.
fn assert_dump_consistent(pins: &Path, ports: usize) {
    let snap = dump::read(pins).expect("dump read");
    let report = dump::report(pins, &snap);
    assert_eq!(report.socket_port_bits, Some(ports));
    assert!(report.findings.iter().all(|f| !f.message.contains(pc::SOCK_PORTS_MAP)), "{:?}", report.findings);
}

#[test]
fn a_port_bit_is_set_before_its_first_frontend_and_cleared_after_its_last() {
    let mut net = PodNetwork::new();
    net.backend("pod-a", "10.244.5.1", &[8080]);
    let cg = Cgroup::new("tpt").expect("cgroup");
    let pins = PinDir::new("tpt").expect("pins");
    socket_loader::install(cg.path(), pins.path(), Capacities::default()).expect("install");
    let mut writer = MapWriter::open(pins.path()).expect("open maps");
    assert_eq!(bits(pins.path()).counts(), (0, 0), "no frontend, no bit");
    assert_eq!(port_bits::socket_count(pins.path()).expect("count"), 0);

    // A direct dial to a port no Service uses is untouched.
    let direct = probe(&net, &cg, "10.244.5.1:8080");
    assert_eq!((&direct["reply"], &direct["peer"]), (&"pod-a".into(), &"10.244.5.1:8080".into()), "{direct}");

    // A Service on a new port answers on the very first connect after the
    // write returns: its bit went in first.
    let (a, b, c) = (fe("10.96.5.1", 9090), fe("10.96.5.2", 9090), fe("10.96.5.3", 9191));
    assert!(writer.apply(&plan(&[a], &[])).is_empty());
    let first = probe(&net, &cg, "10.96.5.1:9090");
    assert_eq!((&first["reply"], &first["peer"]), (&"pod-a".into(), &"10.96.5.1:9090".into()), "{first}");
    assert!(bits(pins.path()).contains_socket(9090));
    assert_dump_consistent(pins.path(), 1);
    // The programs do rely on the bit: without it the Service is passed
    // untranslated (and `dump` says why); with it back it answers again.
    let mut handle = PortBits::open_bitmap(pins.path(), Bitmap::Socket).expect("open SOCK_PORTS");
    assert_eq!(handle.keep_only(&PortSet::empty(Bitmap::Socket)).expect("clear"), 1);
    assert_eq!(probe(&net, &cg, "10.96.5.1:9090")["errno"], ENETUNREACH);
    let report = dump::report(pins.path(), &dump::read(pins.path()).expect("dump read"));
    assert!(
        report.findings.iter().any(|f| f.message.contains(pc::SOCK_PORTS_MAP) && f.message.contains("10.96.5.1")),
        "{:?}",
        report.findings
    );
    let mut again = PortSet::empty(Bitmap::Socket);
    again.insert_socket(9090);
    handle.add(&again).expect("set");
    assert_eq!(probe(&net, &cg, "10.96.5.1:9090")["reply"], "pod-a");

    // Two frontends share 9090; one more on 9191.
    assert!(writer.apply(&plan(&[b, c], &[])).is_empty());
    assert_eq!(bits(pins.path()).counts(), (2, 0));
    // The first of 9090's frontends goes: the other still needs the bit.
    assert!(writer.apply(&plan(&[], &[a])).is_empty());
    let s = bits(pins.path());
    assert!(s.contains_socket(9090) && s.contains_socket(9191), "9090 is still used by {b}");
    assert_eq!(probe(&net, &cg, "10.96.5.2:9090")["reply"], "pod-a");
    assert_eq!(probe(&net, &cg, "10.96.5.1:9090")["errno"], ENETUNREACH, "deleted: not translated");
    // The last one goes: so does the bit; 9191 stays.
    assert!(writer.apply(&plan(&[], &[b])).is_empty());
    let s = bits(pins.path());
    assert!(!s.contains_socket(9090) && s.contains_socket(9191));
    assert_eq!(s.counts(), (1, 0));
    assert_eq!(probe(&net, &cg, "10.96.5.2:9090")["errno"], ENETUNREACH);
    assert_eq!(probe(&net, &cg, "10.96.5.3:9191")["reply"], "pod-a");
    assert_dump_consistent(pins.path(), 1);

    // A writer opened afresh (an agent restart) keeps the bits of what the
    // maps hold.
    drop(writer);
    let mut writer = MapWriter::open(pins.path()).expect("reopen maps");
    assert_eq!(bits(pins.path()).counts(), (1, 0));
    assert!(writer.apply(&plan(&[], &[c])).is_empty());
    assert_eq!(bits(pins.path()).counts(), (0, 0));
    let direct = probe(&net, &cg, "10.244.5.1:8080");
    assert_eq!(direct["peer"], "10.244.5.1:8080", "{direct}");
}

/// An upgrade from an agent version without `SOCK_PORTS`: the restarted
/// agent creates it and fills it from the pinned `SERVICES` before its
/// programs replace the old ones, so not one connect fails meanwhile.
#[test]
fn an_upgrade_over_pins_without_the_socket_port_bitmap_keeps_services_answering() {
    let mut net = PodNetwork::new();
    net.backend("pod-a", "10.244.0.1", &[8080]);
    net.backend("pod-b", "10.244.0.2", &[8080]);
    let mut node = Node::new("node-a");
    let web = ServiceSpec {
        name: "web",
        cluster_ips: &["10.96.0.10"],
        ports: &[("http", 80, "TCP", 8080)],
        endpoints: &[("10.244.0.1", true, "node-a"), ("10.244.0.2", true, "node-a")],
        extra_spec: "",
        annotations: "",
    };
    node.write_manifest("web.yaml", &web.yaml());
    node.start_agent();
    wait_for_backends(&node, &net, "10.96.0.10:80", &[], &["pod-a", "pod-b"]);
    let pins = node.pins.path().to_path_buf();
    assert_eq!(bits(&pins).counts(), (1, 0));

    let client = Client::start(&node, &net, "10.96.0.10:80");
    std::thread::sleep(std::time::Duration::from_millis(300));
    node.stop_agent();
    std::fs::remove_file(pins.join(pc::SOCK_PORTS_MAP)).expect("unpin SOCK_PORTS");
    node.start_agent();
    eventually("the restarted agent to sync", || {
        let log = node.agent_log();
        if log.matches("first sync applied; ready").count() >= 2 { Ok(()) } else { Err(()) }
    });
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert_no_failures("upgrade over pins without SOCK_PORTS", client.finish());
    let s = bits(&pins);
    assert!(s.contains_socket(80), "filled from SERVICES");
    assert_eq!(s.counts(), (1, 0));
    wait_for_backends(&node, &net, "10.96.0.10:80", &[], &["pod-a", "pod-b"]);
}
