//! Updates are atomic per service as the datapath sees them: a connect
//! during an update sees the old or the new backend set, never a hole, a mix
//! or a count larger than the slots written. And a full map leaves the
//! service as it was.

mod support;

use std::net::IpAddr;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use proxy_agent::datapath::map_writer::{MapWriter, WriteError};
use proxy_agent::datapath::maps::Capacities;
use proxy_agent::datapath::socket_loader;
use proxy_agent::decide::plan::Plan;
use proxy_agent::model::{Backend, Frontend, Protocol};
use proxy_test_support::sandbox::{Cgroup, PinDir, command_in};
use support::*;

fn be(ip: &str) -> Backend {
    Backend { ip: ip.parse::<IpAddr>().expect("literal"), port: 8080 }
}

fn upsert(fe: Frontend, backends: &[Backend]) -> Plan {
    Plan { upserts: vec![(fe, backends.to_vec())], deletes: vec![], ..Plan::default() }
}

fn probe(net: &PodNetwork, cg: &Cgroup, args: &[&str]) -> Vec<serde_json::Value> {
    let mut cmd = command_in(agent_bin(), Some(&net.netns), Some(cg)).expect("probe");
    cmd.arg("probe").args(args).stdin(Stdio::null());
    let out = cmd.output().expect("run probe");
    String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).expect("json line")).collect()
}

#[test]
fn connects_during_rewrites_never_see_a_partial_set() {
    let mut net = PodNetwork::new();
    for i in 1..=5 {
        net.backend(&format!("pod-{i}"), &format!("10.244.2.{i}"), &[8080]);
    }
    let cg = Cgroup::new("tpt").expect("cgroup");
    let pins = PinDir::new("tpt").expect("pins");
    socket_loader::install(cg.path(), pins.path(), Capacities::default()).expect("install");
    let mut writer = MapWriter::open(pins.path()).expect("open maps");
    let fe = Frontend { ip: "10.96.0.30".parse().expect("literal"), port: 80, protocol: Protocol::Tcp };
    // Two sets of different sizes: a reader mixing the count of one with the
    // slots of the other would hit an empty slot or a backend of the wrong set.
    let a = [be("10.244.2.1"), be("10.244.2.2")];
    let b = [be("10.244.2.3"), be("10.244.2.4"), be("10.244.2.5")];
    assert!(writer.apply(&upsert(fe, &a)).is_empty());

    let stop = Arc::new(AtomicBool::new(false));
    let flips = Arc::new(AtomicU64::new(0));
    let churn = {
        let (stop, flips) = (stop.clone(), flips.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                for set in [&b[..], &a[..]] {
                    let errors = writer.apply(&upsert(fe, set));
                    assert!(errors.is_empty(), "{errors:?}");
                    flips.fetch_add(1, Ordering::Relaxed);
                }
            }
            writer
        })
    };
    let results = probe(&net, &cg, &["--to", "10.96.0.30:80", "--count", "1500", "--timeout-ms", "2000"]);
    stop.store(true, Ordering::Relaxed);
    let writer = churn.join().expect("churn thread");

    let failures: Vec<_> = results.iter().filter(|r| r["ok"] != true).collect();
    assert!(failures.is_empty(), "{} of {} connects failed: {:?}", failures.len(), results.len(), failures.first());
    let seen = replies(&results);
    assert!(seen.is_subset(&set(&["pod-1", "pod-2", "pod-3", "pod-4", "pod-5"])), "{seen:?}");
    assert!(seen.len() == 5, "both sets were in effect at some point: {seen:?}");
    assert!(flips.load(Ordering::Relaxed) > 100, "too few rewrites to mean anything: {}", flips.load(Ordering::Relaxed));
    // Nothing left behind: exactly one generation of slots, only live backends.
    let occ = writer.occupancy();
    assert_eq!(occ[1].1, 2, "slots in use: {occ:?}");
    assert_eq!(occ[2].1, 2, "backends in use: {occ:?}");
}

#[test]
fn a_full_map_leaves_the_service_as_it_was() {
    let mut net = PodNetwork::new();
    for i in 1..=5 {
        net.backend(&format!("pod-{i}"), &format!("10.244.3.{i}"), &[8080]);
    }
    let cg = Cgroup::new("tpt").expect("cgroup");
    let pins = PinDir::new("tpt").expect("pins");
    let caps = Capacities { slots: 6, ..Capacities::default() };
    socket_loader::install(cg.path(), pins.path(), caps).expect("install");
    let mut writer = MapWriter::open(pins.path()).expect("open maps");
    let fe = Frontend { ip: "10.96.0.31".parse().expect("literal"), port: 80, protocol: Protocol::Tcp };
    let two = [be("10.244.3.1"), be("10.244.3.2")];
    assert!(writer.apply(&upsert(fe, &two)).is_empty());
    // 2 slots in use; a 5-backend set needs 5 more beside them during the switch.
    let five: Vec<Backend> = (1..=5).map(|i| be(&format!("10.244.3.{i}"))).collect();
    let errors = writer.apply(&upsert(fe, &five));
    assert_eq!(errors.len(), 1);
    let msg = errors[0].to_string();
    assert!(matches!(errors[0].error, WriteError::Full { map: "SLOTS", .. }), "{msg}");
    assert!(msg.contains("--max-slots"), "the message names the flag: {msg}");
    // The datapath still uses the old set, completely.
    let results = probe(&net, &cg, &["--to", "10.96.0.31:80", "--count", "30"]);
    assert_eq!(replies(&results), set(&["pod-1", "pod-2"]));
    let other = Frontend { port: 81, ..fe };
    // Another service that fits is still programmed.
    assert!(writer.apply(&upsert(other, &two[..1])).is_empty());
    assert_eq!(replies(&probe(&net, &cg, &["--to", "10.96.0.31:81", "--count", "3"])), set(&["pod-1"]));
    // A restarted writer reads back exactly what is there.
    drop(writer);
    let again = MapWriter::open(pins.path()).expect("reopen");
    assert_eq!(again.state().len(), 2);
    assert_eq!(again.state()[&fe].len(), 2);
}
