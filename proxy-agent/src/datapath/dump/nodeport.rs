//! The TC datapath's own maps (`NP_FLAGS`, `NP_LOCAL`, `NP_CT`,
//! `NP_CONFIG`, `NP_PORTS`) and the XDP next hops, decoded and checked.

use std::collections::{BTreeMap, BTreeSet};

use proxy_common as pc;
use proxy_common::{BackendValue, ServiceKey};
use serde::Serialize;

use crate::datapath::maps::TC_SERVICE_MAPS;
use crate::datapath::maps::keys::{backend_of, frontend_of, ip_of};
use crate::datapath::maps::port_bits::PortSet;

use super::counters::{named, named_np_counters};
use super::findings::{DATAPATH_TC, Finding, FindingKind, sort_findings};
use super::policies::{AffinityView, check_policies};
use super::read::NpSnapshot;
use super::services::{BackendView, ServiceView, check_maps, raw_key};

/// One `NP_CT` entry, decoded.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct CtView {
    /// `forward` (ingress, client -> frontend), `reply` (egress, backend ->
    /// client), `snat` (egress, client -> remote backend), `reply-snat`
    /// (ingress, remote backend -> node:SNAT port); `dir N` if unknown.
    pub direction: String,
    /// `TCP`, `UDP`, or `proto N`.
    pub protocol: String,
    /// The packet as it is matched: `source -> destination`.
    pub tuple: String,
    /// What the packet becomes.
    pub translated: String,
    /// The backend the flow was sent to (an `NP_BACKENDS` id).
    pub backend_id: u32,
    /// `snat`, `closing`, `fin-client`, `fin-backend`.
    pub flags: Vec<&'static str>,
    /// CLOCK_MONOTONIC seconds of the last matching packet.
    pub seen_s: u32,
    /// Seconds since then, when the clock could be read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub age_seconds: Option<u32>,
}

/// `NP_CONFIG`, decoded.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct NpConfigView {
    /// The IPv4 SNAT source; `None`: flows to remote IPv4 backends pass untranslated.
    pub snat_v4: Option<String>,
    /// The IPv6 SNAT source, as `snat_v4`.
    pub snat_v6: Option<String>,
    /// The first SNAT source port.
    pub snat_port_min: u16,
    /// The last SNAT source port.
    pub snat_port_max: u16,
}

/// The TC datapath's maps, decoded (`nodeport` in `dump --output json`).
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct NodePortReport {
    /// `NP_CONFIG`; `None` when it cannot be read.
    pub config: Option<NpConfigView>,
    /// NP_SERVICES with their slots (NP_SLOTS) and policy (NP_FLAGS).
    pub services: Vec<ServiceView>,
    /// NP_BACKENDS, with how many live slots name each.
    pub backends: Vec<BackendView>,
    /// NP_LOCAL: endpoint addresses on this node (never SNAT'ed).
    pub local_endpoints: Vec<String>,
    /// NP_CT, one line per entry.
    pub conntrack: Vec<CtView>,
    /// NP_COUNTERS by name, summed over CPUs.
    pub counters: BTreeMap<String, u64>,
    /// NP_AFFINITY: each client's backend per affine frontend.
    pub affinity: Vec<AffinityView>,
    /// NP_PORTS: ports whose packets the programs look at; `None` when
    /// the map is not pinned.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub port_bits: Option<PortBitsView>,
    /// Devices with the XDP program in front of TC (native mode, a pinned
    /// link each); every other device of the datapath runs TC alone.
    pub xdp_devices: Vec<String>,
    /// XDP_NEXTHOP: the next hop the XDP program caches for each flow it
    /// forwards (empty when XDP is off).
    pub xdp_next_hops: Vec<NextHopView>,
    /// NP_FAST_COUNTERS by name: what the TC fast path sent to the next
    /// hop (`tc_fast_*`) and why it left translated packets to the stack
    /// (`tc_stack_*`). Fragments and ICMP errors never reach it: they are
    /// `pass_fragment` and `icmp_translated` in `counters`.
    pub fast_path: BTreeMap<String, u64>,
    /// NP_PEER_DEVS: the interface indexes of this namespace's veths whose
    /// peer is in another namespace (a pod's), where the fast path
    /// delivers local backends' packets with `bpf_redirect_peer`.
    pub peer_devices: Vec<u32>,
}

/// One flow's cached next hop (`XDP_NEXTHOP`).
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct NextHopView {
    /// `TCP`/`UDP` and the packet as it leaves: `SNAT source -> backend`.
    pub flow: String,
    /// The device the flow arrives on.
    pub ingress_ifindex: u32,
    /// The device the flow's packets leave by, and the MACs written.
    pub ifindex: u32,
    /// The destination MAC written (the next hop's).
    pub dmac: String,
    /// The source MAC written (the leaving device's).
    pub smac: String,
    /// The longest packet (IP length) checked against the route's MTU.
    pub max_len: u16,
    /// CLOCK_MONOTONIC seconds of the route lookup; reused while younger
    /// than `XDP_NEXTHOP_TTL_S`.
    pub checked_s: u32,
}

/// The view of cached next hops, ordered by flow.
pub fn next_hop_views(entries: &[(pc::XdpNextHopKey, pc::XdpNextHopValue)]) -> Vec<NextHopView> {
    let mac = |m: &[u8; 6]| m.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":");
    let mut out: Vec<NextHopView> = entries
        .iter()
        .map(|(k, v)| {
            let protocol = protocol_name(k.proto);
            NextHopView {
                flow: format!(
                    "{protocol} {} -> {}",
                    endpoint(k.saddr_be, k.sport_be, k.family),
                    endpoint(k.daddr_be, k.dport_be, k.family)
                ),
                ingress_ifindex: k.ingress_ifindex,
                ifindex: v.ifindex,
                dmac: mac(&v.dmac),
                smac: mac(&v.smac),
                max_len: v.max_len_host,
                checked_s: v.checked_s,
            }
        })
        .collect();
    out.sort_by(|a, b| (&a.flow, a.ingress_ifindex).cmp(&(&b.flow, b.ingress_ifindex)));
    out
}

/// How many ports `NP_PORTS` marks.
#[derive(Clone, Copy, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct PortBitsView {
    /// Ports marked for ingress (frontends' destination ports).
    pub ingress_ports: usize,
    /// Ports marked for egress (backends' ports).
    pub egress_ports: usize,
}

/// `TCP`, `UDP`, or `proto N`, as conntrack and next-hop entries show it.
pub(super) fn protocol_name(proto: u8) -> String {
    match proto {
        pc::PROTO_TCP => "TCP".to_string(),
        pc::PROTO_UDP => "UDP".to_string(),
        p => format!("proto {p}"),
    }
}

pub(super) fn endpoint(ip_be: [u32; 4], port_be: u16, family: u8) -> String {
    match backend_of(&BackendValue { ip_be, port_be, family, tier: 0 }) {
        Some(b) => b.to_string(),
        None => format!("family {family} {ip_be:08x?}:{}", u16::from_be(port_be)),
    }
}

fn ct_flag_names(flags: u32) -> Vec<&'static str> {
    [
        (pc::CT_FLAG_SNAT, "snat"),
        (pc::CT_FLAG_CLOSING, "closing"),
        (pc::CT_FLAG_FIN_CLIENT, "fin-client"),
        (pc::CT_FLAG_FIN_BACKEND, "fin-backend"),
    ]
    .into_iter()
    .filter(|(bit, _)| flags & bit != 0)
    .map(|(_, n)| n)
    .collect()
}

/// Decodes the `NP_*` maps and applies the consistency rules: those of the
/// socket maps to NP_SERVICES/NP_SLOTS/NP_BACKENDS, plus policy flags
/// without a frontend, conntrack entries naming a backend that is gone or
/// holding what the programs never write, and an empty SNAT port range.
pub fn check_nodeport(np: &NpSnapshot) -> (NodePortReport, Vec<Finding>) {
    let a = check_maps(&TC_SERVICE_MAPS, &np.services, &np.slots, &np.backends);
    let mut findings = a.findings;
    let mut views = a.services;
    let (affinity, policy_findings) = check_policies(&TC_SERVICE_MAPS, &np.services, &np.backends, &np.policy, &mut views);
    findings.extend(policy_findings);
    let tc = |kind, message| Finding { datapath: DATAPATH_TC, ..Finding::new(kind, message) };

    let flags: BTreeMap<ServiceKey, u32> = np.flags.iter().map(|(k, v)| (*k, v.flags)).collect();
    let services: BTreeSet<ServiceKey> = np.services.iter().map(|(k, _)| *k).collect();
    let keys_by_name: BTreeMap<String, ServiceKey> =
        np.services.iter().map(|(k, _)| (frontend_of(k).map_or_else(|| raw_key(k), |f| f.to_string()), *k)).collect();
    for v in &mut views {
        let local = keys_by_name.get(&v.frontend).and_then(|k| flags.get(k)).is_some_and(|f| f & pc::NP_FLAG_POLICY_LOCAL != 0);
        v.external_traffic_policy = Some(if local { "Local" } else { "Cluster" });
    }
    for k in flags.keys().filter(|k| !services.contains(k)) {
        let name = frontend_of(k).map_or_else(|| raw_key(k), |f| f.to_string());
        findings.push(tc(
            FindingKind::OrphanFlags,
            format!("{}: policy flags for {name}, which is not in {}", pc::NP_FLAGS_MAP, pc::NP_SERVICES_MAP),
        ));
    }

    let backends: BTreeMap<u32, &BackendValue> = np.backends.iter().map(|(k, v)| (k.backend_id, v)).collect();
    let mut conntrack = Vec::with_capacity(np.conntrack.len());
    for (k, v) in &np.conntrack {
        let direction = match k.dir {
            pc::CT_DIR_FORWARD => "forward".to_string(),
            pc::CT_DIR_REPLY => "reply".to_string(),
            pc::CT_DIR_SNAT => "snat".to_string(),
            pc::CT_DIR_REPLY_SNAT => "reply-snat".to_string(),
            d => format!("dir {d}"),
        };
        let protocol = protocol_name(k.proto);
        let tuple = format!("{} -> {}", endpoint(k.saddr_be, k.sport_be, k.family), endpoint(k.daddr_be, k.dport_be, k.family));
        let translated = format!("{} -> {}", endpoint(v.saddr_be, v.sport_be, k.family), endpoint(v.daddr_be, v.dport_be, k.family));
        let known = k.dir <= pc::CT_DIR_REPLY_SNAT
            && (k.proto == pc::PROTO_TCP || k.proto == pc::PROTO_UDP)
            && (k.family == pc::FAMILY_V4 || k.family == pc::FAMILY_V6);
        if !known {
            findings.push(tc(
                FindingKind::UnknownConntrackEntry,
                format!("{}: entry {direction} {protocol} family {} {tuple} is nothing the TC programs write", pc::NP_CT_MAP, k.family),
            ));
        } else if k.dir == pc::CT_DIR_FORWARD {
            // The datapath's own test (backend_alive in nodeport.rs).
            let alive = backends.get(&v.backend_id).is_some_and(|b| b.ip_be == v.daddr_be && b.port_be == v.dport_be);
            if !alive {
                findings.push(
                    tc(
                        FindingKind::StaleFlow,
                        format!(
                            "{}: flow {protocol} {tuple} names backend #{} ({}), which is not in {}; its next packet picks another backend and the conntrack GC removes it",
                            pc::NP_CT_MAP,
                            v.backend_id,
                            endpoint(v.daddr_be, v.dport_be, k.family),
                            pc::NP_BACKENDS_MAP
                        ),
                    )
                    .backend(v.backend_id),
                );
            }
        }
        if known && let Some(ports) = &np.ports {
            let mut needs = PortSet::default();
            needs.insert_conntrack(k);
            if !ports.covers(&needs) {
                findings.push(tc(
                    FindingKind::MissingPortBit,
                    format!(
                        "{}: flow {direction} {protocol} {tuple} uses a port without its bit; its packets pass untranslated",
                        pc::NP_PORTS_MAP
                    ),
                ));
            }
        }
        conntrack.push(CtView {
            direction,
            protocol,
            tuple,
            translated,
            backend_id: v.backend_id,
            flags: ct_flag_names(v.flags),
            seen_s: v.seen_s,
            age_seconds: np.now_s.map(|now| now.saturating_sub(v.seen_s)),
        });
    }

    let config = np.config.map(|c| {
        let v4 = (c.snat_v4_be != 0).then(|| std::net::Ipv4Addr::from(c.snat_v4_be.to_ne_bytes()).to_string());
        let v6 = (c.snat_v6_be != [0; 4]).then(|| ip_of(c.snat_v6_be, pc::FAMILY_V6)).flatten().map(|ip| ip.to_string());
        // An all-zero config is "no TC datapath configured", not an error.
        if (v4.is_some() || v6.is_some()) && (c.snat_port_min == 0 || c.snat_port_min > c.snat_port_max) {
            findings.push(tc(
                FindingKind::BadSnatConfig,
                format!(
                    "{}: SNAT port range {}-{} is empty; flows to backends on other nodes pass untranslated",
                    pc::NP_CONFIG_MAP,
                    c.snat_port_min,
                    c.snat_port_max
                ),
            ));
        }
        NpConfigView { snat_v4: v4, snat_v6: v6, snat_port_min: c.snat_port_min, snat_port_max: c.snat_port_max }
    });
    let mut local_endpoints: Vec<String> = np
        .local
        .iter()
        .map(|(k, _)| match ip_of(k.ip_be, k.family) {
            Some(ip) => ip.to_string(),
            None => format!("family {} {:08x?}", k.family, k.ip_be),
        })
        .collect();
    local_endpoints.sort();
    if let Some(ports) = &np.ports {
        for (k, _) in &np.services {
            if !ports.contains(u16::from_be(k.port_be), false) {
                let name = frontend_of(k).map_or_else(|| raw_key(k), |f| f.to_string());
                findings.push(tc(
                    FindingKind::MissingPortBit,
                    format!("{}: frontend {name} has no bit for its port; its packets pass untranslated", pc::NP_PORTS_MAP),
                ));
            }
        }
        for (k, v) in &np.backends {
            if !ports.contains(u16::from_be(v.port_be), true) {
                findings.push(
                    tc(
                        FindingKind::MissingPortBit,
                        format!(
                            "{}: backend #{} ({}) has no egress bit for its port; its replies pass untranslated",
                            pc::NP_PORTS_MAP,
                            k.backend_id,
                            endpoint(v.ip_be, v.port_be, v.family)
                        ),
                    )
                    .backend(k.backend_id),
                );
            }
        }
    }
    sort_findings(&mut findings);
    let port_bits = np.ports.as_ref().map(|p| {
        let (ingress_ports, egress_ports) = p.counts();
        PortBitsView { ingress_ports, egress_ports }
    });
    let report = NodePortReport {
        config,
        services: views,
        backends: a.backends,
        local_endpoints,
        conntrack,
        counters: named_np_counters(&np.counters),
        affinity,
        port_bits,
        xdp_devices: Vec::new(),
        xdp_next_hops: Vec::new(),
        fast_path: named(&np.fast_counters, &pc::np_fast_counter::NAMES),
        peer_devices: np.peer_devices.clone(),
    };
    (report, findings)
}
