//! The dump's tests: the consistency rules over plain map entries, no kernel.

use std::path::Path;

use proxy_common as pc;
use proxy_common::{
    AddrKey, AffinityMatchKey, AffinityMatchValue, AffinityValue, BackendKey, BackendValue, CtKey, CtValue, NpConfig, NpFlagsValue,
    ServiceKey, ServiceValue, SlotKey, SlotValue,
};

use crate::datapath::maps::SOCKET_SERVICE_MAPS;
use crate::datapath::maps::keys::{backend_value, service_key};
use crate::datapath::maps::port_bits::PortSet;
use crate::model::{Backend, Frontend, Protocol};

use super::counters::named_counters;
use super::findings::{DATAPATH_SOCKET, DATAPATH_TC, Finding, FindingKind, Severity};
use super::nodeport::{PortBitsView, check_nodeport};
use super::policies::check_policies;
use super::read::{NpSnapshot, PolicySnapshot, Snapshot};
use super::report;
use super::services::{Analysis, MISSING_SLOTS_LISTED, SlotView, check};

fn fe(s: &str, port: u16) -> ServiceKey {
    service_key(&Frontend { ip: s.parse().expect("literal"), port, protocol: Protocol::Tcp })
}
fn svc(id: u32, count: u32, generation: u32) -> ServiceValue {
    ServiceValue { service_id: id, backend_count: count, generation, flags: 0, ..Default::default() }
}
fn slot(id: u32, generation: u32, slot: u32, backend: u32) -> (SlotKey, SlotValue) {
    (SlotKey { service_id: id, generation, slot }, SlotValue { backend_id: backend })
}
fn be(id: u32, ip: &str) -> (BackendKey, BackendValue) {
    (BackendKey { backend_id: id }, backend_value(&Backend { ip: ip.parse().expect("literal"), port: 8080 }))
}
fn kinds(a: &Analysis) -> Vec<FindingKind> {
    a.findings.iter().map(|f| f.kind).collect()
}

type Entries = (Vec<(ServiceKey, ServiceValue)>, Vec<(SlotKey, SlotValue)>, Vec<(BackendKey, BackendValue)>);

/// Two frontends sharing one backend, as the writer leaves them.
fn healthy() -> Entries {
    (
        vec![(fe("10.96.0.10", 80), svc(1, 2, 3)), (fe("10.96.0.11", 53), svc(2, 1, 1))],
        vec![slot(1, 3, 0, 10), slot(1, 3, 1, 11), slot(2, 1, 0, 11)],
        vec![be(10, "10.244.1.2"), be(11, "10.244.1.3")],
    )
}

#[test]
fn a_consistent_state_has_no_findings() {
    let (s, sl, b) = healthy();
    let a = check(&s, &sl, &b);
    assert_eq!(a.findings, vec![]);
    assert_eq!(a.services.len(), 2);
    assert_eq!(a.services[0].frontend, "10.96.0.10:80/TCP");
    assert_eq!(
        a.services[0].slots,
        vec![
            SlotView { slot: 0, backend_id: Some(10), backend: Some("10.244.1.2:8080".into()) },
            SlotView { slot: 1, backend_id: Some(11), backend: Some("10.244.1.3:8080".into()) },
        ]
    );
    assert_eq!(a.backends.iter().map(|b| (b.backend_id, b.slots)).collect::<Vec<_>>(), vec![(10, 1), (11, 2)]);
    // A service with no backends is consistent too (connections refused).
    let a = check(&[(fe("10.96.0.12", 80), svc(3, 0, 1))], &[], &[]);
    assert_eq!(a.findings, vec![]);
    assert!(a.services[0].slots.is_empty());
}

#[test]
fn a_slot_naming_a_missing_backend_is_an_error() {
    let (s, sl, mut b) = healthy();
    b.retain(|(k, _)| k.backend_id != 10);
    let a = check(&s, &sl, &b);
    assert_eq!(kinds(&a), vec![FindingKind::MissingBackend]);
    let f = &a.findings[0];
    assert_eq!((f.severity, f.service_id, f.generation, f.slot, f.backend_id), (Severity::Error, Some(1), Some(3), Some(0), Some(10)));
    assert!(f.message.contains("10.96.0.10:80/TCP"), "{}", f.message);
    assert_eq!(a.services[0].slots[0].backend, None);
}

#[test]
fn a_count_larger_than_the_slots_written_is_an_error() {
    let (mut s, mut sl, b) = healthy();
    s[0].1.backend_count = 4; // slots 2 and 3 do not exist
    sl.retain(|(k, _)| !(k.service_id == 1 && k.slot == 0)); // nor does 0 any more
    let a = check(&s, &sl, &b);
    let missing: Vec<Option<u32>> = a.findings.iter().filter(|f| f.kind == FindingKind::MissingSlot).map(|f| f.slot).collect();
    assert_eq!(missing, vec![Some(0), Some(2), Some(3)]);
    assert_eq!(
        a.services[0].slots.iter().map(|v| (v.slot, v.backend_id)).collect::<Vec<_>>(),
        vec![(0, None), (1, Some(11)), (2, None), (3, None)]
    );
    // Backend 10 lost its only slot.
    assert!(kinds(&a).contains(&FindingKind::UnreferencedBackend));
}

#[test]
fn a_huge_corrupt_count_is_summarised() {
    let a = check(&[(fe("10.96.0.10", 80), svc(1, u32::MAX, 1))], &[slot(1, 1, 5, 10)], &[be(10, "10.244.1.2")]);
    let missing: Vec<&Finding> = a.findings.iter().filter(|f| f.kind == FindingKind::MissingSlot).collect();
    assert_eq!(missing.len(), MISSING_SLOTS_LISTED + 1);
    let last = missing.iter().find(|f| f.slot.is_none()).expect("summary finding");
    // u32::MAX slots, one present, 16 listed.
    assert!(last.message.contains(&format!("{} more", u32::MAX as usize - 1 - MISSING_SLOTS_LISTED)), "{}", last.message);
}

#[test]
fn stale_generations_and_strays_are_orphans() {
    let (s, mut sl, b) = healthy();
    sl.push(slot(1, 2, 0, 10)); // the previous generation, left by a killed agent
    sl.push(slot(1, 2, 1, 10));
    sl.push(slot(2, 1, 7, 11)); // beyond the count
    sl.push(slot(9, 1, 0, 10)); // no such service
    let a = check(&s, &sl, &b);
    let orphans: Vec<(Option<u32>, Option<u32>, &str)> = a
        .findings
        .iter()
        .filter(|f| f.kind == FindingKind::OrphanSlots)
        .map(|f| (f.service_id, f.generation, f.message.as_str()))
        .collect();
    assert_eq!(orphans.len(), 3, "{orphans:?}");
    assert!(orphans[0].2.starts_with("2 slot(s) of service id 1 generation 2") && orphans[0].2.contains("at generation 3"));
    assert!(orphans[1].2.contains("beyond the service's backend count"));
    assert!(orphans[2].2.contains("no service entry has this id"));
    assert!(a.findings.iter().all(|f| f.severity == Severity::Warning));
    // Orphan slots do not count as references.
    assert_eq!(a.backends.iter().map(|b| b.slots).collect::<Vec<_>>(), vec![1, 2]);
}

#[test]
fn unreferenced_backends_are_warnings() {
    let (s, sl, mut b) = healthy();
    b.push(be(12, "10.244.9.9"));
    let a = check(&s, &sl, &b);
    assert_eq!(kinds(&a), vec![FindingKind::UnreferencedBackend]);
    assert_eq!(a.findings[0].backend_id, Some(12));
    assert_eq!(a.findings[0].severity, Severity::Warning);
}

#[test]
fn unknown_encodings_duplicates_and_family_mismatches_are_errors() {
    let (mut s, sl, mut b) = healthy();
    let mut odd = fe("10.96.0.99", 80);
    odd.proto = 1; // ICMP: never written by the agent
    s.push((odd, svc(3, 0, 1)));
    b[0].1.family = 7;
    let a = check(&s, &sl, &b);
    assert!(kinds(&a).contains(&FindingKind::UnknownServiceKey));
    assert!(kinds(&a).contains(&FindingKind::UnknownBackendEncoding));
    assert_eq!(a.services.last().map(|v| v.frontend.contains("proto=1")), Some(true));

    let (mut s, sl, b) = healthy();
    s[1].1.service_id = 1; // two frontends on one slot set
    s[1].1.generation = 3;
    s[1].1.backend_count = 2;
    let a = check(&s, &sl, &b);
    assert!(kinds(&a).contains(&FindingKind::DuplicateServiceId), "{:?}", a.findings);

    let (s, sl, mut b) = healthy();
    b[1] = (BackendKey { backend_id: 11 }, backend_value(&Backend { ip: "fd00::3".parse().expect("literal"), port: 8080 }));
    let a = check(&s, &sl, &b);
    assert_eq!(kinds(&a), vec![FindingKind::FamilyMismatch, FindingKind::FamilyMismatch]);
}

#[test]
fn findings_list_errors_first() {
    let (s, mut sl, mut b) = healthy();
    b.push(be(12, "10.244.9.9")); // warning
    sl.retain(|(k, _)| k.service_id != 2); // error: missing slot
    let a = check(&s, &sl, &b);
    assert_eq!(a.findings.first().map(|f| f.severity), Some(Severity::Error));
    assert_eq!(a.findings.last().map(|f| f.severity), Some(Severity::Warning));
}

fn ct(dir: u8, s: (&str, u16), d: (&str, u16), to: ((&str, u16), (&str, u16)), backend_id: u32) -> (CtKey, CtValue) {
    let a = |ip: &str, port: u16| backend_value(&Backend { ip: ip.parse().expect("literal"), port });
    let (ks, kd, vs, vd) = (a(s.0, s.1), a(d.0, d.1), a(to.0.0, to.0.1), a(to.1.0, to.1.1));
    (
        CtKey {
            saddr_be: ks.ip_be,
            daddr_be: kd.ip_be,
            sport_be: ks.port_be,
            dport_be: kd.port_be,
            proto: pc::PROTO_TCP,
            family: ks.family,
            dir,
            _pad: 0,
        },
        CtValue {
            saddr_be: vs.ip_be,
            daddr_be: vd.ip_be,
            sport_be: vs.port_be,
            dport_be: vd.port_be,
            flags: pc::CT_FLAG_CLOSING,
            backend_id,
            seen_s: 90,
        },
    )
}

fn healthy_np() -> NpSnapshot {
    let (services, slots, backends) = healthy();
    let local = fe("10.96.0.10", 80);
    NpSnapshot {
        services,
        slots,
        backends,
        flags: vec![(local, NpFlagsValue { flags: pc::NP_FLAG_POLICY_LOCAL })],
        local: vec![(AddrKey::new(be(10, "10.244.1.2").1.ip_be, pc::FAMILY_V4), 1)],
        conntrack: vec![
            ct(pc::CT_DIR_FORWARD, ("10.0.0.1", 40000), ("10.96.0.10", 80), (("10.0.0.1", 40000), ("10.244.1.2", 8080)), 10),
            ct(pc::CT_DIR_REPLY, ("10.244.1.2", 8080), ("10.0.0.1", 40000), (("10.96.0.10", 80), ("10.0.0.1", 40000)), 10),
        ],
        fast_counters: Vec::new(),
        peer_devices: Vec::new(),
        config: Some(NpConfig {
            snat_v4_be: u32::from_ne_bytes([10, 0, 3, 1]),
            snat_port_min: 61000,
            snat_port_max: 65535,
            ..Default::default()
        }),
        counters: vec![3, 7],
        now_s: Some(100),
        policy: PolicySnapshot::default(),
        maglev_table_bytes: 0,
        ports: Some({
            let mut p = PortSet::base();
            p.insert_frontend(80);
            p.insert_frontend(53);
            p.insert_backend(8080);
            p
        }),
    }
}

#[test]
fn the_tc_maps_are_decoded() {
    let (r, findings) = check_nodeport(&healthy_np());
    assert_eq!(findings, vec![]);
    assert_eq!(r.services[0].frontend, "10.96.0.10:80/TCP");
    assert_eq!(r.services[0].external_traffic_policy, Some("Local"));
    assert_eq!(r.services[1].external_traffic_policy, Some("Cluster"));
    assert_eq!(r.local_endpoints, vec!["10.244.1.2"]);
    assert_eq!(r.config.as_ref().and_then(|c| c.snat_v4.clone()), Some("10.0.3.1".into()));
    assert_eq!(r.counters["new_flow"], 3);
    assert_eq!(r.counters["tracked"], 7);
    let fwd = &r.conntrack[0];
    assert_eq!(
        (fwd.direction.as_str(), fwd.protocol.as_str(), fwd.tuple.as_str(), fwd.translated.as_str()),
        ("forward", "TCP", "10.0.0.1:40000 -> 10.96.0.10:80", "10.0.0.1:40000 -> 10.244.1.2:8080")
    );
    assert_eq!((fwd.flags.clone(), fwd.age_seconds), (vec!["closing"], Some(10)));
    assert_eq!(r.conntrack[1].direction, "reply");
    assert_eq!(r.port_bits, Some(PortBitsView { ingress_ports: 2, egress_ports: 2 }));
}

#[test]
fn tc_inconsistencies_are_found() {
    // (name, corruption, expected kind)
    type Corrupt = fn(&mut NpSnapshot);
    let cases: [(&str, Corrupt, FindingKind); 8] = [
        ("slot naming a missing backend", |np| np.backends.retain(|(k, _)| k.backend_id != 10), FindingKind::MissingBackend),
        ("flags without a frontend", |np| np.services.retain(|(k, _)| *k != fe("10.96.0.10", 80)), FindingKind::OrphanFlags),
        ("flow to a removed backend", |np| np.conntrack[0].1.backend_id = 12, FindingKind::StaleFlow),
        ("flow to a backend id now at another address", |np| np.conntrack[0].1.dport_be = 9u16.to_be(), FindingKind::StaleFlow),
        ("unknown direction", |np| np.conntrack[1].0.dir = 9, FindingKind::UnknownConntrackEntry),
        ("a frontend's port without its bit", |np| np.ports = Some(PortSet::base()), FindingKind::MissingPortBit),
        (
            "a flow's port without its bit",
            |np| {
                let mut p = PortSet::base();
                p.insert_frontend(80);
                p.insert_frontend(53);
                p.insert_backend(8080);
                np.ports = Some(p);
                np.conntrack[0].0.dport_be = 81u16.to_be();
            },
            FindingKind::MissingPortBit,
        ),
        (
            "empty SNAT port range",
            |np| {
                if let Some(c) = np.config.as_mut() {
                    c.snat_port_min = 65000;
                    c.snat_port_max = 64000;
                }
            },
            FindingKind::BadSnatConfig,
        ),
    ];
    for (name, corrupt, kind) in cases {
        let mut np = healthy_np();
        corrupt(&mut np);
        let (_, findings) = check_nodeport(&np);
        assert!(findings.iter().any(|f| f.kind == kind && f.datapath == DATAPATH_TC), "{name}: {findings:?}");
        if kind == FindingKind::MissingBackend {
            assert!(findings.iter().any(|f| f.message.contains("not in NP_BACKENDS")), "{name}: {findings:?}");
        }
    }
    // No TC datapath configured: an all-zero NP_CONFIG is fine.
    let mut np = healthy_np();
    np.config = Some(NpConfig::default());
    assert_eq!(check_nodeport(&np).1, vec![]);
}

#[test]
fn reports_merge_both_datapaths_findings_errors_first() {
    let (services, slots, backends) = healthy();
    let mut np = healthy_np();
    np.conntrack[0].1.backend_id = 12; // warning
    let mut snap = Snapshot { services, slots, backends, nodeport: Some(np), ..Snapshot::default() };
    snap.backends.retain(|(k, _)| k.backend_id != 10); // socket error
    let r = report(Path::new("/x"), &snap);
    assert!(!r.consistent);
    assert_eq!((r.findings[0].datapath, r.findings[0].severity), (DATAPATH_SOCKET, Severity::Error));
    assert_eq!(r.findings.last().map(|f| (f.datapath, f.kind)), Some((DATAPATH_TC, FindingKind::StaleFlow)));
    assert!(r.nodeport.is_some());
}

#[test]
fn affinity_and_source_ranges_are_decoded_and_checked() {
    let (mut s, sl, b) = healthy();
    // 10.96.0.10:80 (id 1, generation 3, backends #10 and #11) is
    // affine; 10.96.0.11:53 (id 2) filtered, with the node allowed.
    s[0].1.flags = pc::SVC_FLAG_AFFINITY;
    s[1].1.flags = pc::SVC_FLAG_SOURCE_RANGES | pc::SVC_FLAG_SOURCE_RANGES_NODE;
    let m = |sid, generation, backend_id, timeout_s| {
        (AffinityMatchKey { service_id: sid, generation, backend_id }, AffinityMatchValue { timeout_s })
    };
    let range = |sid, generation, text: &str| {
        let k = crate::datapath::maps::keys::source_range_key(sid, generation, &crate::model::Cidr::parse(text).expect("literal"));
        (k.prefix_len(), k.data())
    };
    let s_ns = 1_000_000_000u64;
    let entry = |backend_id, last_used_ns| AffinityValue { last_used_ns, backend_id, _pad: 0 };
    let p = PolicySnapshot {
        matches: vec![m(1, 3, 10, 2), m(1, 3, 11, 2), m(1, 2, 10, 2)],
        ranges: vec![range(2, 1, "10.0.0.0/8"), range(2, 1, "192.0.2.0/24")],
        clients: vec![
            (1, "netns 7".into(), entry(10, 99 * s_ns)),
            (1, "netns 8".into(), entry(11, 90 * s_ns)),
            (1, "netns 9".into(), entry(12, 99 * s_ns)),
        ],
        now_ns: Some(100 * s_ns),
    };
    let mut views = check(&s, &sl, &b).services;
    let (clients, findings) = check_policies(&SOCKET_SERVICE_MAPS, &s, &b, &p, &mut views);
    assert_eq!(views[0].affinity_timeout_seconds, Some(2));
    assert_eq!(views[1].source_ranges, Some(vec!["10.0.0.0/8".to_string(), "192.0.2.0/24".to_string()]));
    assert!(views[1].source_ranges_node && views[0].source_ranges.is_none());
    // Fresh and listed; expired; a backend the frontend does not use.
    let honoured: Vec<(&str, bool)> = clients.iter().map(|c| (c.client.as_str(), c.honoured)).collect();
    assert_eq!(honoured, [("netns 7", true), ("netns 8", false), ("netns 9", false)]);
    assert_eq!(
        (clients[0].frontend.as_str(), clients[0].backend.as_deref(), clients[0].idle_ms),
        ("10.96.0.10:80/TCP", Some("10.244.1.2:8080"), Some(1000))
    );
    // The previous generation's match entry is left over.
    assert_eq!(findings.iter().map(|f| (f.kind, f.generation)).collect::<Vec<_>>(), [(FindingKind::OrphanPolicyEntries, Some(2))]);

    // A backend without its match entry loses its clients' affinity.
    let p = PolicySnapshot { matches: vec![m(1, 3, 10, 2)], ..p };
    let mut views = check(&s, &sl, &b).services;
    let (_, findings) = check_policies(&SOCKET_SERVICE_MAPS, &s, &b, &p, &mut views);
    let missing: Vec<(FindingKind, Severity, Option<u32>)> = findings.iter().map(|f| (f.kind, f.severity, f.backend_id)).collect();
    assert_eq!(missing, [(FindingKind::MissingAffinityMatch, Severity::Error, Some(11))]);
}

#[test]
fn counters_are_named() {
    let named = named_counters(&[5, 0, 1, 0, 2, 0, 0, 0]);
    assert_eq!(named["translated"], 5);
    assert_eq!(named["slot_miss"], 1);
    assert_eq!(named["reversed"], 2);
    assert_eq!(named.len(), 8);
    assert_eq!(named_counters(&[0; 16])["affinity_hit"], 0);
}
