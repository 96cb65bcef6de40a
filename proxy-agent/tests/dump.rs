//! `proxy-agent dump` against a real installed datapath: it shows what the
//! map writer programmed and the counters the programs bumped, and it flags
//! maps that were corrupted behind the agent's back. Also: the maps carry
//! BTF, so bpftool prints their fields by name.

mod support;

use std::net::IpAddr;
use std::path::Path;
use std::process::{Command, Output};

use aya::maps::{HashMap, Map, MapData};
use proxy_agent::datapath::map_writer::MapWriter;
use proxy_agent::datapath::maps::Capacities;
use proxy_agent::datapath::pins as pin_layout;
use proxy_agent::datapath::socket_loader;
use proxy_agent::decide::plan::Plan;
use proxy_agent::model::{Backend, Frontend, Protocol};
use proxy_common::{BackendKey, BackendValue, SlotKey, SlotValue};
use proxy_test_support::sandbox::{Cgroup, PinDir};
use serde_json::Value;
use support::*;

fn be(ip: &str, port: u16) -> Backend {
    Backend { ip: ip.parse::<IpAddr>().expect("literal"), port }
}

fn fe(ip: &str, port: u16, protocol: Protocol) -> Frontend {
    Frontend { ip: ip.parse().expect("literal"), port, protocol }
}

fn dump(pins: &Path, output: &str) -> Output {
    Command::new(agent_bin()).args(["dump", "--output", output, "--bpffs"]).arg(pins).output().expect("run proxy-agent dump")
}

fn dump_json(pins: &Path) -> (Option<i32>, Value) {
    let out = dump(pins, "json");
    let text = String::from_utf8_lossy(&out.stdout);
    let doc = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("dump printed no JSON ({e}): {text}\n{}", String::from_utf8_lossy(&out.stderr)));
    (out.status.code(), doc)
}

fn service<'a>(doc: &'a Value, frontend: &str) -> &'a Value {
    doc["services"]
        .as_array()
        .and_then(|s| s.iter().find(|s| s["frontend"] == frontend))
        .unwrap_or_else(|| panic!("{frontend} not in {doc:#}"))
}

fn slot_backends(svc: &Value) -> Vec<String> {
    svc["slots"].as_array().map(|s| s.iter().map(|x| x["backend"].as_str().unwrap_or("-").to_string()).collect()).unwrap_or_default()
}

#[test]
fn dump_shows_the_programmed_state_and_flags_corruption() {
    let mut net = PodNetwork::new();
    net.backend("pod-a", "10.244.4.1", &[8080]);
    net.backend("pod-b", "10.244.4.2", &[8080]);
    let cg = Cgroup::new("tpt").expect("cgroup");
    let pins = PinDir::new("tpt").expect("pins");
    socket_loader::install(cg.path(), pins.path(), Capacities { services: 100, ..Capacities::default() }).expect("install");
    let mut writer = MapWriter::open(pins.path()).expect("open maps");
    let web = fe("10.96.0.40", 80, Protocol::Tcp);
    let dns = fe("fd00:96::40", 53, Protocol::Udp);
    let plan = Plan {
        upserts: vec![(web, vec![be("10.244.4.1", 8080), be("10.244.4.2", 8080)]), (dns, vec![be("fd00:244::4", 5353)])],
        deletes: vec![],
        ..Plan::default()
    };
    assert!(writer.apply(&plan).is_empty());
    // Traffic, so that the counters have something to show.
    let mut probe = proxy_test_support::sandbox::command_in(agent_bin(), Some(&net.netns), Some(&cg)).expect("probe");
    let probed = probe.args(["probe", "--to", "10.96.0.40:80", "--count", "5"]).output().expect("run probe");
    assert!(probed.status.success(), "{}", String::from_utf8_lossy(&probed.stdout));

    let (code, doc) = dump_json(pins.path());
    assert_eq!(code, Some(0), "{doc:#}");
    assert_eq!(doc["consistent"], true);
    assert_eq!(doc["pinDir"], pins.path().display().to_string());
    assert_eq!(doc["findings"], serde_json::json!([]));
    let web_view = service(&doc, "10.96.0.40:80/TCP");
    assert_eq!(web_view["backendCount"], 2);
    assert_eq!(web_view["generation"], 1);
    let mut got = slot_backends(web_view);
    got.sort();
    assert_eq!(got, ["10.244.4.1:8080", "10.244.4.2:8080"]);
    assert_eq!(slot_backends(service(&doc, "[fd00:96::40]:53/UDP")), ["[fd00:244::4]:5353"]);
    assert_eq!(doc["backends"].as_array().map(Vec::len), Some(3));
    let usage = |name: &str| doc["maps"].as_array().and_then(|m| m.iter().find(|m| m["name"] == name)).cloned().expect("map usage");
    assert_eq!(usage("SERVICES")["entries"], 2);
    assert_eq!(usage("SERVICES")["maxEntries"], 100);
    assert_eq!(usage("SLOTS")["entries"], 3);
    assert_eq!(usage("BACKENDS")["entries"], 3);
    // TCP sockets keep their translation in their own storage (SOCK_PEER,
    // which has no entries to count from user space), not in SOCK_REVNAT.
    assert_eq!(usage("SOCK_REVNAT")["entries"], 0, "{doc:#}");
    assert!(doc["counters"]["translated"].as_u64() >= Some(5), "{doc:#}");
    assert_eq!(doc["counters"]["slot_miss"], 0);

    // The table says the same in words.
    let table = dump(pins.path(), "table");
    assert!(table.status.success());
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(text.contains("10.96.0.40:80/TCP  id ") && text.contains("consistent: no findings"), "{text}");

    // Corrupt the maps behind the agent's back: drop a backend that a slot
    // names, and leave a slot that no service owns.
    let victim = web_view["slots"][0]["backendId"].as_u64().and_then(|id| u32::try_from(id).ok()).expect("backend id");
    let data = MapData::from_pin(pin_layout::map(pins.path(), proxy_common::BACKENDS_MAP)).expect("open BACKENDS");
    let mut backends: HashMap<MapData, BackendKey, BackendValue> = HashMap::try_from(Map::HashMap(data)).expect("hash map");
    backends.remove(&BackendKey { backend_id: victim }).expect("delete backend");
    let data = MapData::from_pin(pin_layout::map(pins.path(), proxy_common::SLOTS_MAP)).expect("open SLOTS");
    let mut slots: HashMap<MapData, SlotKey, SlotValue> = HashMap::try_from(Map::HashMap(data)).expect("hash map");
    slots.insert(SlotKey { service_id: 999, generation: 1, slot: 0 }, SlotValue { backend_id: victim }, 0).expect("stray slot");

    let (code, doc) = dump_json(pins.path());
    assert_eq!(code, Some(2), "inconsistent maps exit with 2: {doc:#}");
    assert_eq!(doc["consistent"], false);
    let findings = doc["findings"].as_array().cloned().unwrap_or_default();
    let missing: Vec<&Value> = findings.iter().filter(|f| f["kind"] == "missing-backend").collect();
    assert_eq!(missing.len(), 1, "{findings:#?}");
    assert_eq!(missing[0]["severity"], "error");
    assert_eq!(missing[0]["backendId"], victim);
    assert_eq!(missing[0]["serviceId"], web_view["serviceId"]);
    assert!(missing[0]["message"].as_str().is_some_and(|m| m.contains("10.96.0.40:80/TCP")), "{findings:#?}");
    assert!(findings.iter().any(|f| f["kind"] == "orphan-slots" && f["serviceId"] == 999 && f["severity"] == "warning"), "{findings:#?}");
    assert_eq!(findings[0]["severity"], "error", "errors come first");
    assert_eq!(service(&doc, "10.96.0.40:80/TCP")["slots"][0]["backend"], Value::Null);

    let table = dump(pins.path(), "table");
    assert_eq!(table.status.code(), Some(2));
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(text.contains(&format!("#{victim} (no such backend)")) && text.contains("error: "), "{text}");
}

#[test]
fn dump_fails_plainly_without_a_datapath() {
    let dir = TempDir::new("tpt-nodump");
    let out = dump(&dir.0, "json");
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("SERVICES") && err.contains("--bpffs"), "{err}");
}

#[test]
fn bpftool_prints_map_fields_by_name() {
    require_root();
    let cg = Cgroup::new("tpt").expect("cgroup");
    let pins = PinDir::new("tpt").expect("pins");
    socket_loader::install(cg.path(), pins.path(), Capacities::default()).expect("install");
    let mut writer = MapWriter::open(pins.path()).expect("open maps");
    let plan =
        Plan { upserts: vec![(fe("10.96.0.41", 443, Protocol::Tcp), vec![be("10.244.4.9", 8443)])], deletes: vec![], ..Plan::default() };
    assert!(writer.apply(&plan).is_empty());
    for (map, fields) in [
        ("SERVICES", &["ip_be", "port_be", "proto", "family", "service_id", "backend_count", "generation"][..]),
        ("SLOTS", &["service_id", "generation", "slot", "backend_id"][..]),
        ("BACKENDS", &["backend_id", "ip_be", "port_be", "family"][..]),
    ] {
        let out = Command::new("bpftool")
            .args(["-j", "map", "dump", "pinned"])
            .arg(pins.path().join(map))
            .output()
            .expect("run bpftool (cargo xtask setup installs it)");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let doc: Value = serde_json::from_slice(&out.stdout).expect("bpftool JSON");
        // With BTF, bpftool adds a `formatted` object with the decoded key
        // and value; without it there are only hex byte arrays.
        let entry = &doc[0]["formatted"];
        for f in fields {
            assert!(entry["key"].get(f).is_some() || entry["value"].get(f).is_some(), "{map}: no field {f} in {entry}");
        }
    }
}

/// The TC datapath's maps: frontends with their policy, slots and
/// backends, local endpoints, SNAT configuration, conntrack entries and
/// counters, and what is wrong with them.
#[test]
fn dump_decodes_the_tc_maps_and_flags_their_inconsistencies() {
    use proxy_agent::decide::decision::ExternalState;
    use proxy_common as pc;
    use proxy_common::{CtKey, CtValue};

    let cg = Cgroup::new("tpt").expect("cgroup");
    let pins = PinDir::new("tpt").expect("pins");
    socket_loader::install(cg.path(), pins.path(), Capacities::default()).expect("install");
    let mut np = proxy_agent::external::nodeport::NodePortWriter::open(pins.path()).expect("open the TC maps");
    np.set_config(Some("10.0.3.1".parse().expect("literal")), None, (61000, 65535)).expect("config");
    let local_fe = fe("10.0.1.2", 30080, Protocol::Tcp);
    let cluster_fe = fe("10.0.1.2", 30053, Protocol::Udp);
    let ext = ExternalState {
        tc: [(local_fe, [be("10.244.1.1", 8080)].into()), (cluster_fe, [be("10.244.2.1", 5353), be("10.244.1.1", 5353)].into())].into(),
        local_endpoints: ["10.244.1.1".parse().expect("literal")].into(),
        policy_local: [local_fe].into(),
        ..Default::default()
    };
    assert!(np.sync(&ext).failures.is_empty());

    // A tracked flow to the local backend, as the TC programs write it:
    // forward (client -> frontend) and reply (backend -> client).
    let ip = |s: &str| [u32::from_ne_bytes(s.parse::<std::net::Ipv4Addr>().expect("literal").octets()), 0, 0, 0];
    let key = |s: &str, sp: u16, d: &str, dp: u16, dir| CtKey {
        saddr_be: ip(s),
        daddr_be: ip(d),
        sport_be: sp.to_be(),
        dport_be: dp.to_be(),
        proto: pc::PROTO_TCP,
        family: pc::FAMILY_V4,
        dir,
        _pad: 0,
    };
    let doc = dump_json(pins.path()).1;
    let backend_id = doc["nodeport"]["backends"]
        .as_array()
        .and_then(|b| b.iter().find(|b| b["address"] == "10.244.1.1:8080"))
        .and_then(|b| b["backendId"].as_u64())
        .and_then(|id| u32::try_from(id).ok())
        .unwrap_or_else(|| panic!("local backend in {doc:#}"));
    let seen_s = proxy_agent::datapath::conntrack_gc::monotonic_now_s().expect("clock");
    let value = |s: &str, sp: u16, d: &str, dp: u16| CtValue {
        saddr_be: ip(s),
        daddr_be: ip(d),
        sport_be: sp.to_be(),
        dport_be: dp.to_be(),
        flags: pc::CT_FLAG_FIN_CLIENT,
        backend_id,
        seen_s,
    };
    let data = MapData::from_pin(pin_layout::map(pins.path(), proxy_common::NP_CT_MAP)).expect("open NP_CT");
    let mut ct: HashMap<MapData, CtKey, CtValue> = HashMap::try_from(Map::LruHashMap(data)).expect("LRU hash");
    ct.insert(key("10.0.1.1", 40000, "10.0.1.2", 30080, pc::CT_DIR_FORWARD), value("10.0.1.1", 40000, "10.244.1.1", 8080), 0)
        .expect("forward entry");
    ct.insert(key("10.244.1.1", 8080, "10.0.1.1", 40000, pc::CT_DIR_REPLY), value("10.0.1.2", 30080, "10.0.1.1", 40000), 0)
        .expect("reply entry");

    let (code, doc) = dump_json(pins.path());
    assert_eq!(code, Some(0), "{doc:#}");
    let n = &doc["nodeport"];
    let np_service = |frontend: &str| {
        n["services"]
            .as_array()
            .and_then(|s| s.iter().find(|s| s["frontend"] == frontend))
            .cloned()
            .unwrap_or_else(|| panic!("{frontend} in {n:#}"))
    };
    let local = np_service("10.0.1.2:30080/TCP");
    assert_eq!(local["externalTrafficPolicy"], "Local");
    assert_eq!(slot_backends(&local), ["10.244.1.1:8080"]);
    let cluster = np_service("10.0.1.2:30053/UDP");
    assert_eq!(cluster["externalTrafficPolicy"], "Cluster");
    let mut got = slot_backends(&cluster);
    got.sort();
    assert_eq!(got, ["10.244.1.1:5353", "10.244.2.1:5353"]);
    assert_eq!(n["localEndpoints"], serde_json::json!(["10.244.1.1"]));
    assert_eq!(n["config"]["snatV4"], "10.0.3.1");
    assert_eq!((n["config"]["snatPortMin"].as_u64(), n["config"]["snatPortMax"].as_u64()), (Some(61000), Some(65535)));
    let ct_view = n["conntrack"].as_array().cloned().unwrap_or_default();
    assert_eq!(ct_view.len(), 2, "{n:#}");
    let fwd = ct_view.iter().find(|c| c["direction"] == "forward").expect("forward entry");
    assert_eq!(fwd["protocol"], "TCP");
    assert_eq!(fwd["tuple"], "10.0.1.1:40000 -> 10.0.1.2:30080");
    assert_eq!(fwd["translated"], "10.0.1.1:40000 -> 10.244.1.1:8080");
    assert_eq!(fwd["flags"], serde_json::json!(["fin-client"]));
    assert!(fwd["ageSeconds"].as_u64().is_some_and(|a| a < 60), "{fwd}");
    assert_eq!(n["counters"]["new_flow"], 0);
    let usage = |name: &str| {
        doc["maps"].as_array().and_then(|m| m.iter().find(|m| m["name"] == name)).cloned().unwrap_or_else(|| panic!("{name} usage"))
    };
    assert_eq!(usage("NP_CT")["entries"], 2);
    assert_eq!(usage("NP_SERVICES")["entries"], 2);
    assert_eq!(usage("NP_BACKENDS")["entries"], 3);
    assert_eq!(usage("NP_FLAGS")["entries"], 1);
    assert_eq!(usage("NP_COUNTERS")["entries"], usage("NP_COUNTERS")["maxEntries"]);

    let table = dump(pins.path(), "table");
    assert!(table.status.success());
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(text.contains("external traffic (TC"), "{text}");
    assert!(text.contains("10.0.1.2:30080/TCP  id ") && text.contains("policy Local"), "{text}");
    assert!(text.contains("forward    TCP 10.0.1.1:40000 -> 10.0.1.2:30080  =>  10.0.1.1:40000 -> 10.244.1.1:8080"), "{text}");
    assert!(text.contains("local endpoints: 10.244.1.1") && text.contains("SNAT: 10.0.3.1"), "{text}");
    // The port bitmap: both NodePorts at ingress; 8080, 5353 and port 0
    // (the node's refusals) at egress.
    assert_eq!(n["portBits"], serde_json::json!({"ingressPorts": 2, "egressPorts": 3}), "{n:#}");
    assert!(text.contains("port bitmap (NP_PORTS): 2 ingress, 3 egress ports"), "{text}");
    // A cleared bit behind the agent's back: the frontend and the flow on
    // that port are reported.
    let data = MapData::from_pin(pins.path().join(pc::NP_PORTS_MAP)).expect("open NP_PORTS");
    let mut bits: aya::maps::Array<MapData, u64> = aya::maps::Array::try_from(Map::Array(data)).expect("array");
    let (word, mask) = pc::np_port_bit(30080, false);
    let w = bits.get(&word, 0).expect("word");
    bits.set(word, w & !mask, 0).expect("clear the bit");
    let (code, doc) = dump_json(pins.path());
    assert_eq!(code, Some(2), "{doc:#}");
    let findings = doc["findings"].as_array().cloned().unwrap_or_default();
    let unbitten: Vec<&Value> = findings.iter().filter(|f| f["kind"] == "missing-port-bit").collect();
    assert_eq!(unbitten.len(), 2, "the frontend and the flow's forward entry: {findings:#?}");
    bits.set(word, w, 0).expect("restore the bit");

    // Corrupt: remove the local backend behind the agent's back. Its slots
    // now name nothing, and the tracked flow's backend is gone.
    let data = MapData::from_pin(pin_layout::map(pins.path(), proxy_common::NP_BACKENDS_MAP)).expect("open NP_BACKENDS");
    let mut backends: HashMap<MapData, BackendKey, BackendValue> = HashMap::try_from(Map::HashMap(data)).expect("hash map");
    backends.remove(&BackendKey { backend_id }).expect("delete backend");
    let (code, doc) = dump_json(pins.path());
    assert_eq!(code, Some(2), "{doc:#}");
    let findings = doc["findings"].as_array().cloned().unwrap_or_default();
    let missing: Vec<&Value> = findings.iter().filter(|f| f["kind"] == "missing-backend").collect();
    assert_eq!(missing.len(), 1, "the one slot naming it: {findings:#?}");
    assert!(missing.iter().all(|f| f["datapath"] == "tc" && f["severity"] == "error" && f["backendId"] == backend_id), "{findings:#?}");
    assert!(missing.iter().any(|f| f["message"].as_str().is_some_and(|m| m.contains("not in NP_BACKENDS"))), "{findings:#?}");
    let stale: Vec<&Value> = findings.iter().filter(|f| f["kind"] == "stale-flow").collect();
    assert_eq!(stale.len(), 1, "{findings:#?}");
    assert_eq!((&stale[0]["severity"], &stale[0]["datapath"]), (&Value::from("warning"), &Value::from("tc")));
    let table = dump(pins.path(), "table");
    assert_eq!(table.status.code(), Some(2));
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(text.contains(&format!("#{backend_id} (no such backend)")), "{text}");
}
