//! What the map writer keeps beside a frontend's backends, on real maps:
//! session affinity's match entries and source ranges follow each
//! generation (the new one's written before the switch, the old one's gone
//! after it), the clients' affinity entries go when a frontend drops
//! affinity or goes away, and a restarted agent reads every policy back, so
//! an unchanged cluster rewrites nothing.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr};
use std::path::Path;

use aya::maps::lpm_trie::LpmTrie;
use aya::maps::{HashMap, Map, MapData};
use proxy_agent::datapath::keys::service_key;
use proxy_agent::datapath::map_writer::MapWriter;
use proxy_agent::datapath::maps::Capacities;
use proxy_agent::datapath::{dump, socket_loader};
use proxy_agent::decide::plan::{self, FrontendPolicy, Plan, Policies, SourceRanges, State};
use proxy_agent::model::{Backend, Cidr, Frontend, Protocol};
use proxy_common as pc;
use proxy_common::{AffinityMatchKey, AffinityMatchValue, AffinityValue, ServiceKey, ServiceValue, SockAffinityKey, SourceRangeKey};
use proxy_test_support::sandbox::{Cgroup, PinDir};

fn fe(i: u8) -> Frontend {
    Frontend { ip: IpAddr::V4(Ipv4Addr::new(198, 51, 100, i)), port: 80, protocol: Protocol::Tcp }
}

fn be(i: u8) -> Backend {
    Backend { ip: IpAddr::V4(Ipv4Addr::new(10, 244, 0, i)), port: 8080 }
}

struct Datapath {
    _cg: Cgroup,
    pins: PinDir,
}

fn datapath(caps: Capacities) -> Datapath {
    let cg = Cgroup::new("tpp").expect("cgroup");
    let pins = PinDir::new("tpp").expect("pins");
    socket_loader::install(cg.path(), pins.path(), caps).expect("install");
    Datapath { _cg: cg, pins }
}

fn affine(timeout_s: u32) -> FrontendPolicy {
    FrontendPolicy { affinity_timeout_s: Some(timeout_s), affinity_scope: 77, source_ranges: None, slot_weights: None }
}

fn filtered(cidrs: &[&str], node: bool) -> FrontendPolicy {
    let cidrs = cidrs.iter().map(|c| Cidr::parse(c).expect("literal")).collect();
    FrontendPolicy { affinity_timeout_s: None, affinity_scope: 0, source_ranges: Some(SourceRanges { cidrs, node }), slot_weights: None }
}

/// Brings the writer to `want` with `policies`, as a sync pass would.
fn sync(w: &mut MapWriter, want: &State, policies: &Policies) -> Plan {
    let plan = plan::diff_with_policies(&w.state(), &w.policies(), want, policies);
    let errors = w.apply(&plan);
    assert!(errors.is_empty(), "{errors:?}");
    plan
}

fn service(pins: &Path, f: &Frontend) -> ServiceValue {
    let m: HashMap<MapData, ServiceKey, ServiceValue> =
        HashMap::try_from(Map::HashMap(MapData::from_pin(pins.join(pc::SERVICES_MAP)).expect("open"))).expect("hash");
    m.get(&service_key(f), 0).expect("service entry")
}

/// AFFINITY_MATCH, read from the kernel: (service id, generation, backend
/// id, timeout).
fn matches(pins: &Path) -> BTreeSet<(u32, u32, u32, u32)> {
    let m: HashMap<MapData, AffinityMatchKey, AffinityMatchValue> =
        HashMap::try_from(Map::HashMap(MapData::from_pin(pins.join(pc::AFFINITY_MATCH_MAP)).expect("open"))).expect("hash");
    m.iter().map(|e| e.expect("entry")).map(|(k, v)| (k.service_id, k.generation, k.backend_id, v.timeout_s)).collect()
}

/// SOURCE_RANGES, read from the kernel: (service id, generation, range).
fn ranges(pins: &Path) -> BTreeSet<(u32, u32, String)> {
    let t: LpmTrie<MapData, SourceRangeKey, u32> =
        LpmTrie::try_from(Map::LpmTrie(MapData::from_pin(pins.join(pc::SOURCE_RANGES_MAP)).expect("open"))).expect("trie");
    t.keys()
        .map(|k| k.expect("key"))
        .map(|k| {
            let cidr = proxy_agent::datapath::keys::cidr_of(&k).expect("decodable").to_string();
            (k.data().service_id, k.data().generation, cidr)
        })
        .collect()
}

fn clients(pins: &Path) -> HashMap<MapData, SockAffinityKey, AffinityValue> {
    HashMap::try_from(Map::LruHashMap(MapData::from_pin(pins.join(pc::AFFINITY_MAP)).expect("open"))).expect("lru")
}

/// The backend ids of `f`'s current generation, from the writer's view.
fn ids(pins: &Path, f: &Frontend) -> BTreeSet<u32> {
    let snap = dump::read(pins).expect("dump");
    let r = dump::report(pins, &snap);
    let v = r.services.iter().find(|v| v.frontend == f.to_string()).expect("frontend in dump");
    v.slots.iter().filter_map(|s| s.backend_id).collect()
}

#[test]
fn affinity_match_entries_follow_each_generation_and_clients_go_with_affinity() {
    let dp = datapath(Capacities::default());
    let pins = dp.pins.path();
    let mut w = MapWriter::open(pins).expect("open");
    let (a, other) = (fe(1), fe(2));
    let mut want: State = [(a, [be(1), be(2), be(3)].into()), (other, [be(3)].into())].into();
    let mut policies: Policies = [(a, affine(60))].into();
    sync(&mut w, &want, &policies);
    let v = service(pins, &a);
    assert_eq!(v.flags, pc::SVC_FLAG_AFFINITY | (77 << pc::SVC_AFFINITY_SCOPE_SHIFT));
    assert_eq!(v.affinity_scope(), 77, "the scope rides in the flags' upper bits");
    assert_eq!(service(pins, &other).flags, 0, "a frontend without affinity has no flag");
    let want_matches = |v: &ServiceValue, timeout: u32| -> BTreeSet<(u32, u32, u32, u32)> {
        ids(pins, &a).into_iter().map(|id| (v.service_id, v.generation, id, timeout)).collect()
    };
    assert_eq!(matches(pins), want_matches(&v, 60), "one entry per backend of the current generation");

    // A backend leaves, one arrives: the new generation lists exactly the
    // new set, the old generation's entries are gone.
    want.insert(a, [be(2), be(3), be(4)].into());
    sync(&mut w, &want, &policies);
    let v2 = service(pins, &a);
    assert_eq!(v2.generation, v.generation + 1);
    assert_eq!(matches(pins), want_matches(&v2, 60));

    // Clients, as the programs record them.
    let mut c = clients(pins);
    for netns_cookie in [7, 8] {
        let backend_id = *ids(pins, &a).iter().next().expect("a backend");
        c.insert(SockAffinityKey { netns_cookie, scope_id: 77, _pad: 0 }, AffinityValue { last_used_ns: 1, backend_id, _pad: 0 }, 0)
            .expect("client entry");
    }
    // One of another Service port's scope: never touched.
    c.insert(SockAffinityKey { netns_cookie: 7, scope_id: 78, _pad: 0 }, AffinityValue::default(), 0).expect("client entry");

    // A shorter timeout: a new generation with the new timeout; the
    // clients keep their entries.
    policies.insert(a, affine(2));
    let plan = sync(&mut w, &want, &policies);
    assert_eq!(plan.upserts.len(), 1, "only the frontend whose policy changed");
    let v3 = service(pins, &a);
    assert_eq!(matches(pins), want_matches(&v3, 2));
    assert_eq!(clients(pins).keys().count(), 3);

    // A restarted agent reads the policy back: nothing to rewrite.
    drop(w);
    let mut w = MapWriter::open(pins).expect("reopen");
    assert_eq!(w.policies(), policies);
    assert!(sync(&mut w, &want, &policies).is_empty(), "an unchanged cluster rewrites nothing after a restart");

    // Affinity dropped: no flag, no match entries, and the frontend's
    // clients are gone; the other frontend's entry stays.
    policies.clear();
    sync(&mut w, &want, &policies);
    assert_eq!(service(pins, &a).flags, 0);
    assert!(matches(pins).is_empty());
    let left: Vec<u32> = clients(pins).keys().map(|k| k.expect("key").scope_id).collect();
    assert_eq!(left, [78]);

    // Affinity back, clients again, then the frontend goes: its clients go
    // with it.
    policies.insert(a, affine(10_800));
    sync(&mut w, &want, &policies);
    clients(pins).insert(SockAffinityKey { netns_cookie: 9, scope_id: 77, _pad: 0 }, AffinityValue::default(), 0).expect("client");
    let scoped = || clients(pins).keys().filter(|k| k.as_ref().expect("key").scope_id == 77).count();
    // A second frontend of the same Service port (its LoadBalancer IP,
    // say) shares the scope: while one of them is affine the clients stay.
    let lb = fe(3);
    want.insert(lb, [be(2)].into());
    policies.insert(lb, affine(10_800));
    sync(&mut w, &want, &policies);
    assert_eq!(service(pins, &lb).affinity_scope(), 77);
    want.remove(&a);
    policies.remove(&a);
    sync(&mut w, &want, &policies);
    assert_eq!(scoped(), 1, "the scope's other frontend keeps its clients");
    want.remove(&lb);
    policies.clear();
    sync(&mut w, &want, &policies);
    assert!(matches(pins).is_empty());
    assert_eq!(scoped(), 0, "the clients go with the scope's last frontend");
    let r = dump::report(pins, &dump::read(pins).expect("dump"));
    assert!(r.consistent, "{:?}", r.findings);
}

#[test]
fn source_ranges_follow_each_generation_and_are_read_back() {
    let dp = datapath(Capacities::default());
    let pins = dp.pins.path();
    let mut w = MapWriter::open(pins).expect("open");
    let a = fe(1);
    let want: State = [(a, [be(1)].into())].into();
    let mut policies: Policies = [(a, filtered(&["10.0.0.0/8", "192.0.2.0/24"], true))].into();
    sync(&mut w, &want, &policies);
    let v = service(pins, &a);
    assert_eq!(v.flags, pc::SVC_FLAG_SOURCE_RANGES | pc::SVC_FLAG_SOURCE_RANGES_NODE);
    let at = |v: &ServiceValue, c: &[&str]| -> BTreeSet<(u32, u32, String)> {
        c.iter().map(|c| (v.service_id, v.generation, (*c).to_string())).collect()
    };
    assert_eq!(ranges(pins), at(&v, &["10.0.0.0/8", "192.0.2.0/24"]));
    let r = dump::report(pins, &dump::read(pins).expect("dump"));
    let view = r.services.iter().find(|s| s.frontend == a.to_string()).expect("in dump");
    assert_eq!((view.source_ranges.clone(), view.source_ranges_node), (Some(vec!["10.0.0.0/8".into(), "192.0.2.0/24".into()]), true));

    // Narrowed: the new generation holds only the new ranges.
    policies.insert(a, filtered(&["192.0.2.0/25"], false));
    sync(&mut w, &want, &policies);
    let v2 = service(pins, &a);
    assert_eq!(v2.flags, pc::SVC_FLAG_SOURCE_RANGES);
    assert_eq!(ranges(pins), at(&v2, &["192.0.2.0/25"]));

    // No valid range: the filter stays on with nothing in it.
    policies.insert(a, filtered(&[], false));
    sync(&mut w, &want, &policies);
    assert_eq!(service(pins, &a).flags, pc::SVC_FLAG_SOURCE_RANGES);
    assert!(ranges(pins).is_empty());

    drop(w);
    let mut w = MapWriter::open(pins).expect("reopen");
    assert_eq!(w.policies(), policies, "read back after a restart");
    assert!(sync(&mut w, &want, &policies).is_empty());

    policies.clear();
    sync(&mut w, &want, &policies);
    assert_eq!(service(pins, &a).flags, 0);
    let r = dump::report(pins, &dump::read(pins).expect("dump"));
    assert!(r.consistent, "{:?}", r.findings);
}

/// Graded spill-over (issue #48) on real maps: a weighted frontend's slot
/// array lists each backend as often as its weight (the count the socket
/// programs pick among), with one affinity match entry per backend; a
/// share change rewrites it under a new generation; a restarted writer
/// reads the weights back from the slots, so an unchanged cluster rewrites
/// nothing; and the weights going away leaves one slot per backend.
#[test]
fn weighted_slots_carry_the_spill_shares_and_are_read_back() {
    let dp = datapath(Capacities::default());
    let pins = dp.pins.path();
    let mut w = MapWriter::open(pins).expect("open");
    let a = fe(1);
    let want: State = [(a, [be(1), be(2), be(3)].into())].into();
    let weighted = |w1: u32, w2: u32, w3: u32| FrontendPolicy {
        affinity_timeout_s: Some(60),
        affinity_scope: 77,
        source_ranges: None,
        slot_weights: plan::SlotWeights::new(vec![(be(1), w1), (be(2), w2), (be(3), w3)]),
    };
    let slots_of = |pins: &Path| -> Vec<Option<u32>> {
        let snap = dump::read(pins).expect("dump");
        let r = dump::report(pins, &snap);
        let v = r.services.iter().find(|v| v.frontend == a.to_string()).expect("frontend in dump");
        v.slots.iter().map(|s| s.backend_id).collect()
    };
    let count = |slots: &[Option<u32>]| -> std::collections::BTreeMap<u32, usize> {
        let mut m = std::collections::BTreeMap::new();
        for id in slots.iter().flatten() {
            *m.entry(*id).or_insert(0) += 1;
        }
        m
    };
    let group = |slot_end: u32, weight_end: u32| pc::SlotGroup { slot_end, weight_end };
    sync(&mut w, &want, &[(a, weighted(350, 350, 300))].into());
    let v = service(pins, &a);
    assert_eq!(v.backend_count, 3, "one slot per backend, in weighted groups");
    assert_eq!(v.groups, [group(2, 700), group(3, 1000), group(0, 0), group(0, 0)], "350 twice, then 300");
    let slots = slots_of(pins);
    let mut counts: Vec<usize> = count(&slots).into_values().collect();
    counts.sort_unstable();
    assert_eq!(counts, vec![1, 1, 1]);
    let report = dump::report(pins, &dump::read(pins).expect("dump"));
    let view = report.services.iter().find(|v| v.frontend == a.to_string()).expect("frontend in dump");
    let groups: Vec<(u32, u32, u32)> = view.slot_groups.iter().map(|g| (g.first_slot, g.slot_end, g.weight)).collect();
    assert_eq!(groups, vec![(0, 2, 700), (2, 3, 300)], "dump shows the groups");
    assert_eq!(matches(pins).len(), 3, "one match entry per backend");
    assert_eq!(w.endpoints(), 3);

    // The shares change: a new generation with the new groups, the old
    // generation's slots and matches gone.
    sync(&mut w, &want, &[(a, weighted(100, 100, 800))].into());
    let v2 = service(pins, &a);
    assert_eq!((v2.backend_count, v2.generation), (3, v.generation + 1));
    assert_eq!(v2.groups, [group(1, 800), group(3, 1000), group(0, 0), group(0, 0)], "800, then 100 twice");
    assert_eq!(matches(pins).iter().filter(|m| m.1 == v.generation).count(), 0, "the old generation's matches are gone");
    assert_eq!(matches(pins).len(), 3);

    // More distinct weights than the groups hold: each backend in as many
    // slots as its weight, no groups.
    let b = fe(2);
    let five: Vec<Backend> = (1..=5).map(be).collect();
    let spread =
        FrontendPolicy { slot_weights: plan::SlotWeights::new(five.iter().zip(1..).map(|(x, n)| (*x, n)).collect()), ..affine(60) };
    let want: State = [(a, [be(1), be(2), be(3)].into()), (b, five.iter().copied().collect())].into();
    sync(&mut w, &want, &[(a, weighted(100, 100, 800)), (b, spread.clone())].into());
    let vb = service(pins, &b);
    assert_eq!((vb.backend_count, vb.groups), (15, [group(0, 0); pc::SLOT_GROUPS]), "1 + 2 + 3 + 4 + 5 slots");

    // A restarted writer reads the weights back, from the groups and from
    // the repeated slots: nothing to rewrite.
    drop(w);
    let mut w = MapWriter::open(pins).expect("reopen");
    let policies: Policies = [(a, weighted(100, 100, 800)), (b, spread)].into();
    assert_eq!(w.policies(), policies, "weights and affinity read back from the slots");
    let plan = plan::diff_with_policies(&w.state(), &w.policies(), &want, &policies);
    assert!(plan.is_empty(), "{plan:?}");
    let want: State = [(a, [be(1), be(2), be(3)].into())].into();

    // No more spread (the nearest tier is healthy again): one slot each.
    sync(&mut w, &want, &[(a, affine(60))].into());
    assert_eq!(service(pins, &a).backend_count, 3);
    assert_eq!(w.endpoints(), 3);
}
