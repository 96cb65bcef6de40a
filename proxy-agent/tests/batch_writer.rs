//! The map writer's batch path (BPF_MAP_UPDATE_BATCH/DELETE_BATCH) on real
//! maps: what it leaves in the kernel matches the plan exactly (no stale
//! generation, no unreferenced backend), room is judged as writing one
//! frontend at a time would judge it, and a batch the kernel refuses falls
//! back to single writes that name the frontend that failed.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr};
use std::path::Path;

use aya::maps::{HashMap, Map, MapData};
use proxy_agent::datapath::keys::{backend_value, service_key};
use proxy_agent::datapath::map_writer::{MapWriter, WriteError};
use proxy_agent::datapath::maps::Capacities;
use proxy_agent::datapath::socket_loader;
use proxy_agent::decide::plan::{self, Plan, State};
use proxy_agent::model::{Backend, Frontend, Protocol};
use proxy_common::{BackendKey, BackendValue, ServiceKey, ServiceValue, SlotKey, SlotValue};
use proxy_test_support::sandbox::{Cgroup, PinDir};

fn fe(i: u32) -> Frontend {
    Frontend { ip: IpAddr::V4(Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 96, 0, 0)) + 1 + i)), port: 80, protocol: Protocol::Tcp }
}

fn be(i: u32) -> Backend {
    Backend { ip: IpAddr::V4(Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 244, 0, 0)) + 1 + i)), port: 8080 }
}

fn open<K: aya::Pod, V: aya::Pod>(pins: &Path, name: &str) -> HashMap<MapData, K, V> {
    HashMap::try_from(Map::HashMap(MapData::from_pin(pins.join(name)).expect("open pinned map"))).expect("hash map")
}

/// Entries per map, read from the kernel: (services, slots, backends).
fn counts(pins: &Path) -> (usize, usize, usize) {
    let s: HashMap<MapData, ServiceKey, ServiceValue> = open(pins, "SERVICES");
    let sl: HashMap<MapData, SlotKey, SlotValue> = open(pins, "SLOTS");
    let b: HashMap<MapData, BackendKey, BackendValue> = open(pins, "BACKENDS");
    (s.keys().count(), sl.keys().count(), b.keys().count())
}

struct Datapath {
    _cg: Cgroup,
    pins: PinDir,
}

fn datapath(caps: Capacities) -> Datapath {
    let cg = Cgroup::new("tpw").expect("cgroup");
    let pins = PinDir::new("tpw").expect("pins");
    socket_loader::install(cg.path(), pins.path(), caps).expect("install");
    Datapath { _cg: cg, pins }
}

/// Checks the maps hold exactly `want`, as a fresh writer reads them back.
fn assert_maps_hold(pins: &Path, want: &State) {
    let slots: usize = want.values().map(BTreeSet::len).sum();
    let backends: BTreeSet<&Backend> = want.values().flatten().collect();
    assert_eq!(counts(pins), (want.len(), slots, backends.len()), "entries per map (services, slots, backends)");
    let state = MapWriter::open(pins).expect("reopen").state();
    assert!(state == *want, "read back {} frontends, wanted {}", state.len(), want.len());
}

#[test]
fn chunks_write_exactly_the_plan_and_clean_up_after_updates() {
    let dp = datapath(Capacities::default());
    let mut w = MapWriter::open(dp.pins.path()).expect("open");
    // 7,000 frontends x 10 = 70,000 slots: more than one chunk. Backends
    // are shared between neighbours, so the reference counts matter.
    let mut want = State::new();
    for i in 0..7000 {
        want.insert(fe(i), (i..i + 10).map(be).collect());
    }
    let errors = w.apply(&plan::diff(&w.state(), &want));
    assert!(errors.is_empty(), "{:?}", errors.first());
    assert_eq!(w.occupancy()[1].1, 70_000);
    assert_maps_hold(dp.pins.path(), &want);

    // Rewrite every other frontend (some backends dropped for good, some
    // new, some moving between frontends), delete a range, add a few.
    for i in (0..7000).step_by(2) {
        want.insert(fe(i), (i + 5..i + 12).map(be).collect());
    }
    for i in 3000..3500 {
        want.remove(&fe(i));
    }
    for i in 7000..7100 {
        want.insert(fe(i), [be(100_000 + i)].into());
    }
    let errors = w.apply(&plan::diff(&w.state(), &want));
    assert!(errors.is_empty(), "{:?}", errors.first());
    assert_maps_hold(dp.pins.path(), &want);

    // Everything goes.
    let errors = w.apply(&plan::diff(&w.state(), &State::new()));
    assert!(errors.is_empty(), "{:?}", errors.first());
    assert_eq!(counts(dp.pins.path()), (0, 0, 0));
}

#[test]
fn room_is_judged_one_frontend_at_a_time() {
    let dp = datapath(Capacities { slots: 30, backends: 25, ..Capacities::default() });
    let mut w = MapWriter::open(dp.pins.path()).expect("open");
    let set = |from: u32| -> Vec<Backend> { (from..from + 10).map(be).collect() };
    // Three frontends of ten: 30 slots fit, the fourth does not, and the
    // error names the map and the flag; the others are written.
    let plan = Plan { upserts: (0..4).map(|i| (fe(i), set(0))).collect(), deletes: vec![], ..Plan::default() };
    let errors = w.apply(&plan);
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert_eq!(errors[0].frontend, fe(3));
    assert!(matches!(errors[0].error, WriteError::Full { map: "SLOTS", used: 30, max: 30, needed: 10, .. }), "{}", errors[0]);
    assert!(errors[0].to_string().contains("--max-slots"), "{}", errors[0]);
    assert_eq!(counts(dp.pins.path()), (3, 30, 10));

    // Free one frontend, then rewrite the other two: each rewrite needs
    // its new slots beside its old ones (10 + 10 + 10 = 30 at the peak),
    // which fits one at a time but not with both rewrites staged together.
    let plan = Plan { upserts: vec![(fe(1), set(5)), (fe(2), set(5))], deletes: vec![fe(0)], ..Plan::default() };
    let errors = w.apply(&plan);
    assert!(errors.is_empty(), "{errors:?}");
    let five: BTreeSet<Backend> = set(5).into_iter().collect();
    let want: State = [(fe(1), five.clone()), (fe(2), five.clone())].into();
    assert_maps_hold(dp.pins.path(), &want);

    // Backends: 10 in use, 25 room; a set of 20 new ones does not fit,
    // one of 15 does.
    let plan = Plan {
        upserts: vec![(fe(5), (100..120).map(be).collect()), (fe(6), (100..115).map(be).collect())],
        deletes: vec![fe(1)],
        ..Plan::default()
    };
    let errors = w.apply(&plan);
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert_eq!(errors[0].frontend, fe(5));
    assert!(matches!(errors[0].error, WriteError::Full { map: "BACKENDS", .. }), "{}", errors[0]);
    let mut want: State = [(fe(2), five)].into();
    want.insert(fe(6), (100..115).map(be).collect());
    assert_maps_hold(dp.pins.path(), &want);
}

#[test]
fn a_batch_the_kernel_refuses_falls_back_and_names_the_frontend() {
    let dp = datapath(Capacities { slots: 30, ..Capacities::default() });
    let mut w = MapWriter::open(dp.pins.path()).expect("open");
    // Someone else takes 10 slots behind this writer's back, so its own
    // count says 30 free while the kernel has 20: the batch of slots fails
    // with E2BIG part way.
    let mut slots: HashMap<MapData, SlotKey, SlotValue> = open(dp.pins.path(), "SLOTS");
    for slot in 0..10 {
        slots.insert(SlotKey { service_id: 9999, generation: 1, slot }, SlotValue { backend_id: 9999 }, 0).expect("insert");
    }
    let set: Vec<Backend> = (0..10).map(be).collect();
    let plan = Plan { upserts: (0..3).map(|i| (fe(i), set.clone())).collect(), deletes: vec![], ..Plan::default() };
    let errors = w.apply(&plan);
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert_eq!(errors[0].frontend, fe(2), "the frontend that did not fit is named");
    assert!(matches!(errors[0].error, WriteError::Syscall { map: "SLOTS", .. }), "{}", errors[0]);
    // The first two are complete, the third left nothing behind.
    let services: HashMap<MapData, ServiceKey, ServiceValue> = open(dp.pins.path(), "SERVICES");
    let got: BTreeMap<ServiceKey, ServiceValue> = services.iter().map(|r| r.expect("entry")).collect();
    assert_eq!(got.len(), 2);
    assert!(got.contains_key(&service_key(&fe(0))) && got.contains_key(&service_key(&fe(1))));
    assert_eq!(counts(dp.pins.path()), (2, 30, 10));
    assert_eq!(w.state().len(), 2);
}

/// A cold write of many frontends, each with backends of its own: each
/// chunk writes its backends and its slots side by side (two threads).
/// When the backends' batch fails part way, nothing of the chunk is
/// switched, the slots written beside it go, and the frontends are
/// written one at a time, the ones that do not fit named.
#[test]
fn backends_and_slots_written_side_by_side_fail_together() {
    let own = |i: u32| -> BTreeSet<Backend> { (i * 10..i * 10 + 10).map(be).collect() };
    // 5,000 frontends x 10 backends of their own: 50,000 of each, two
    // chunks of them written side by side.
    let dp = datapath(Capacities::default());
    let mut w = MapWriter::open(dp.pins.path()).expect("open");
    let want: State = (0..5000).map(|i| (fe(i), own(i))).collect();
    let errors = w.apply(&plan::diff(&w.state(), &want));
    assert!(errors.is_empty(), "{:?}", errors.first());
    assert_maps_hold(dp.pins.path(), &want);

    // Room for 6,000 backends, 2,000 of them taken behind the writer's
    // back: a chunk of 500 frontends (5,000 backends, 5,000 slots) fails
    // in its backends' batch after 4,000.
    let dp = datapath(Capacities { backends: 6000, ..Capacities::default() });
    let mut w = MapWriter::open(dp.pins.path()).expect("open");
    let mut taken: HashMap<MapData, BackendKey, BackendValue> = open(dp.pins.path(), "BACKENDS");
    for id in 0..2000 {
        taken.insert(BackendKey { backend_id: 900_000 + id }, backend_value(&be(1_000_000 + id)), 0).expect("insert");
    }
    let want: State = (0..500).map(|i| (fe(i), own(i))).collect();
    let errors = w.apply(&plan::diff(&w.state(), &want));
    let failed: Vec<Frontend> = errors.iter().map(|e| e.frontend).collect();
    assert_eq!(failed, (400..500).map(fe).collect::<Vec<_>>(), "written one at a time, the first 400 fit");
    assert!(errors.iter().all(|e| matches!(e.error, WriteError::Syscall { map: "BACKENDS", .. })), "{}", errors[0]);
    // The first 400 complete; nothing else of the chunk left behind (the
    // foreign 2,000 backends stay).
    assert_eq!(counts(dp.pins.path()), (400, 4000, 6000));
    assert_eq!(w.state().len(), 400);
}

#[test]
fn deleting_a_frontend_whose_slots_are_partly_gone_removes_the_rest() {
    let dp = datapath(Capacities::default());
    let mut w = MapWriter::open(dp.pins.path()).expect("open");
    let set: Vec<Backend> = (0..5).map(be).collect();
    assert!(w.apply(&Plan { upserts: vec![(fe(0), set.clone()), (fe(1), set)], deletes: vec![], ..Plan::default() }).is_empty());
    // A slot in the middle of fe(0)'s disappears: the delete batch meets
    // ENOENT there and must go on with the keys after it.
    let mut slots: HashMap<MapData, SlotKey, SlotValue> = open(dp.pins.path(), "SLOTS");
    let services: HashMap<MapData, ServiceKey, ServiceValue> = open(dp.pins.path(), "SERVICES");
    let v = services.get(&service_key(&fe(0)), 0).expect("service entry");
    slots.remove(&SlotKey { service_id: v.service_id, generation: v.generation, slot: 2 }).expect("remove slot");
    assert!(w.apply(&Plan { upserts: vec![], deletes: vec![fe(0), fe(1)], ..Plan::default() }).is_empty());
    assert_eq!(counts(dp.pins.path()), (0, 0, 0));
}

#[test]
fn a_restarted_writer_reads_everything_back_in_batches_and_drops_leftovers() {
    let dp = datapath(Capacities::default());
    let mut w = MapWriter::open(dp.pins.path()).expect("open");
    // 2,000 x 10 slots: several lookup calls per map.
    let want: State = (0..2000).map(|i| (fe(i), (i..i + 10).map(be).collect())).collect();
    assert!(w.apply(&plan::diff(&w.state(), &want)).is_empty());
    drop(w);

    // Batched reads return what key-by-key iteration returns.
    let mut slots: HashMap<MapData, SlotKey, SlotValue> = open(dp.pins.path(), "SLOTS");
    let mut batched: Vec<(SlotKey, SlotValue)> = proxy_agent::datapath::bpf_batch::lookup_all(&slots).expect("lookup batch");
    let mut iterated: Vec<(SlotKey, SlotValue)> = slots.iter().map(|r| r.expect("entry")).collect();
    batched.sort_by_key(|(k, _)| *k);
    iterated.sort_by_key(|(k, _)| *k);
    assert_eq!(batched.len(), 20_000);
    assert!(batched == iterated, "batched and iterated reads differ");

    // What an agent killed in the middle of an update leaves: slots of a
    // generation no service entry points at, and a backend no slot uses.
    let services: HashMap<MapData, ServiceKey, ServiceValue> = open(dp.pins.path(), "SERVICES");
    let first = services.get(&service_key(&fe(0)), 0).expect("fe(0)");
    for slot in 0..3 {
        slots
            .insert(SlotKey { service_id: first.service_id, generation: first.generation + 1, slot }, SlotValue { backend_id: 1 }, 0)
            .expect("stale slot");
    }
    let mut backends: HashMap<MapData, BackendKey, BackendValue> = open(dp.pins.path(), "BACKENDS");
    let orphan = backends.get(&BackendKey { backend_id: 1 }, 0).expect("backend 1");
    backends.insert(BackendKey { backend_id: 999_999 }, orphan, 0).expect("orphan backend");

    let w = MapWriter::open(dp.pins.path()).expect("reopen");
    assert!(w.state() == want, "read back {} frontends", w.state().len());
    let backends_used: BTreeSet<&Backend> = want.values().flatten().collect();
    assert_eq!(counts(dp.pins.path()), (2000, 20_000, backends_used.len()), "leftovers removed");
}
