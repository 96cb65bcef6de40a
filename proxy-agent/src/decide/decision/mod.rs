//! The one decision path shared by `run` and `explain`: for every Service
//! port, which frontends exist and which backends this node sends them to.
//! Pure: it reads the model and calls the topology ranking.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use crate::decide::plan::{FrontendPolicy, Policies, SlotWeights, SourceRanges};
use crate::decide::topology::{self, NodeContext};
use crate::model::{Backend, Cidr, Cluster, Endpoint, EndpointSlice, Family, Frontend, ObjectRef, PortLabel, Service, ServicePort};

mod external;
pub use external::{ExternalState, HealthCheck, external_state, external_state_of, has_external};

/// The outcome for one Service port on this node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortDecision {
    /// The Service.
    pub service: ObjectRef,
    /// Its port.
    pub port: ServicePort,
    /// ClusterIP frontends, primary family first.
    pub frontends: Vec<Frontend>,
    /// Name of the model that decided (see `topology::Model`).
    pub model: &'static str,
    /// Why, in words. One shared copy of each text (`intern`): most
    /// Services are decided for the same reasons, and a copy each was 5 MiB
    /// at 100k Services.
    pub decision: std::sync::Arc<str>,
    /// Backends for cluster-policy traffic.
    pub cluster: Vec<Backend>,
    /// Backends for local-policy traffic.
    pub local: Vec<Backend>,
    /// Whether ClusterIP traffic uses `local` (internalTrafficPolicy: Local).
    pub internal_local: bool,
    /// Whether traffic from outside the node to the external frontends
    /// (NodePort, LoadBalancer IPs, externalIPs) uses `local`
    /// (externalTrafficPolicy: Local).
    pub external_local: bool,
    /// LoadBalancer ingress IPs and externalIPs, served on `port.port`.
    /// NodePort frontends (`port.node_port` on every node address) depend on
    /// the node's addresses and are expanded by [`external_state`].
    pub external_ips: Vec<std::net::IpAddr>,
    /// `spec.healthCheckNodePort`, served only with externalTrafficPolicy: Local.
    pub health_check_node_port: Option<u16>,
    /// `sessionAffinity: ClientIP`: the timeout in seconds. It applies to
    /// every frontend of the port, which share their clients' choices (see
    /// [`PortDecision::affinity_scope`]).
    pub affinity_timeout_s: Option<u32>,
    /// The LoadBalancer ingress IPs among `external_ips`: the frontends
    /// `source_ranges` apply to (never NodePorts or externalIPs, as in
    /// kube-proxy).
    pub load_balancer_ips: Vec<std::net::IpAddr>,
    /// `loadBalancerSourceRanges` that parsed; `None` without the field.
    pub source_ranges: Option<Vec<Cidr>>,
    /// Problems found in the Service's configuration, to be reported with
    /// its name.
    pub problems: Vec<String>,
    /// The Maglev table size of the external frontends, when the Service's
    /// annotation sets a valid one (`None`: the agent's default).
    pub maglev_size: Option<crate::decide::maglev::TableSize>,
    /// The `proxy_common::tier` every connection to `cluster` counts in,
    /// when the topology chose it by one domain; `None`: each backend's own
    /// (`topology::tier`).
    pub tier: Option<u8>,
    /// The share of the port's usable endpoints outside this node's zone,
    /// in `proxy_common::SHARE_ONE`ths: what the datapath adds per counted
    /// connection for `topoproxy_service_connections_blind_remote_total`.
    pub blind_remote_share: u32,
    /// Whether the Service has a topology setting (topologyKeys, either
    /// topology annotation, hints on its endpoints, trafficDistribution,
    /// internalTrafficPolicy Local): its connection counts are exported one
    /// by one under `--service-metrics topology`.
    pub has_topology: bool,
    /// Graded spill-over (issue #48): the slot count of each `cluster`
    /// backend, sorted by backend, when its connections spread over more
    /// than one tier; `None`: one slot per backend, as without spill.
    pub cluster_weights: Option<std::sync::Arc<[(Backend, u32)]>>,
    /// Graded spill-over: each tier's health and share, for `explain` and
    /// `topoproxy_service_tier_share`. `None` without the annotation (or
    /// when it does not apply).
    pub spill: Option<std::sync::Arc<SpillShares>>,
}

pub use crate::decide::topology::spill_tiers::TierShare;

/// How a Service port's new connections are shared between its topology
/// tiers (`topoproxy.io/topology-spill`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpillShares {
    /// The overprovisioning factor, as a decimal (`1.4`).
    pub factor: String,
    /// The tiers in order, each family's on their own for a dual-stack port.
    pub tiers: Vec<TierShare>,
}

impl PortDecision {
    /// The backends traffic from outside the node to an external frontend
    /// may use.
    pub fn external_backends(&self) -> &[Backend] {
        if self.external_local { &self.local } else { &self.cluster }
    }

    /// The external frontends of this port on a node with addresses
    /// `node_addrs`: NodePort on each address, then LoadBalancer/external IPs.
    pub fn external_frontends(&self, node_addrs: &[std::net::IpAddr]) -> Vec<Frontend> {
        let protocol = self.port.protocol;
        let mut out = Vec::new();
        if let Some(np) = self.port.node_port {
            out.extend(node_addrs.iter().map(|ip| Frontend { ip: *ip, port: np, protocol }));
        }
        out.extend(self.external_ips.iter().map(|ip| Frontend { ip: *ip, port: self.port.port, protocol }));
        out
    }

    /// The backends ClusterIP traffic from this node may use.
    pub fn internal_backends(&self) -> &[Backend] {
        if self.internal_local { &self.local } else { &self.cluster }
    }

    /// The tier ClusterIP connections count in (see [`PortDecision::tier`]):
    /// the node's for internalTrafficPolicy Local, whose backends are all
    /// on this node.
    pub fn internal_tier(&self) -> Option<u8> {
        if self.internal_local { Some(proxy_common::tier::NODE) } else { self.tier }
    }

    /// The tier connections from outside to an external frontend count in.
    pub fn external_tier(&self) -> Option<u8> {
        if self.external_local { Some(proxy_common::tier::NODE) } else { self.tier }
    }

    /// What the datapath needs to count this port's connections through
    /// frontend counting in `tier`.
    fn topo(&self, tier: Option<u8>, label: &std::sync::Arc<PortLabel>) -> FrontendTopo {
        FrontendTopo { tier, blind_remote_share: self.blind_remote_share, port: label.clone() }
    }

    /// The label of this port's connection counts.
    pub fn port_label(&self) -> PortLabel {
        PortLabel {
            namespace: self.service.namespace.clone(),
            service: self.service.name.clone(),
            port: if self.port.name.is_empty() { self.port.port.to_string() } else { self.port.name.clone() },
            topology: self.has_topology,
        }
    }

    /// The counting of every frontend of this port on a node with
    /// addresses `node_addrs`: the socket datapath's (ClusterIPs, and the
    /// external frontends as the node's own processes reach them, which
    /// use the cluster-wide set) into `socket`, the TC datapath's (traffic
    /// from outside) into `tc`. A frontend another port claims gets the
    /// first claimant's, as the maps do (later entries win here; the
    /// writer keeps one per frontend).
    pub fn frontend_topology(
        &self,
        node_addrs: &[std::net::IpAddr],
        socket: &mut Vec<(Frontend, FrontendTopo)>,
        tc: &mut Vec<(Frontend, FrontendTopo)>,
    ) {
        let label = std::sync::Arc::new(self.port_label());
        let internal = self.topo(self.internal_tier(), &label);
        socket.extend(self.frontends.iter().map(|fe| (*fe, internal.clone())));
        if !has_external(self) {
            return;
        }
        let external = self.external_frontends(node_addrs);
        let from_node = self.topo(self.tier, &label);
        socket.extend(external.iter().map(|fe| (*fe, from_node.clone())));
        if let Some(np) = self.port.node_port {
            use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
            for ip in [IpAddr::V4(Ipv4Addr::LOCALHOST), IpAddr::V6(Ipv6Addr::LOCALHOST)] {
                socket.push((Frontend { ip, port: np, protocol: self.port.protocol }, from_node.clone()));
            }
        }
        let outside = self.topo(self.external_tier(), &label);
        tc.extend(external.into_iter().map(|fe| (fe, outside.clone())));
    }

    /// What frontend `fe` of this port needs besides its backends, on a
    /// node with addresses `node_addrs`, for the TC datapath (`at_tc`,
    /// traffic from outside) or the socket one (the node's pods and
    /// processes).
    ///
    /// Source ranges apply to LoadBalancer ingress IPs only, with the
    /// ranges of the frontend's family; a frontend whose Service has ranges
    /// but none of its family admits nobody (kube-proxy would leave that
    /// family unfiltered; a restricted LoadBalancer stays restricted here).
    /// When one of the node's addresses lies inside a range, kube-proxy
    /// lets the node reach the LoadBalancer IP, and packets that loop back
    /// with the IP itself as source: at TC the IP is added as a range of
    /// its own, on the socket datapath the node's processes are let through
    /// (`SourceRanges::node`).
    pub fn frontend_policy(&self, fe: &Frontend, node_addrs: &[std::net::IpAddr], at_tc: bool) -> FrontendPolicy {
        let source_ranges = self.source_ranges.as_ref().filter(|_| self.load_balancer_ips.contains(&fe.ip)).map(|all| {
            let family = Family::of(&fe.ip);
            let mut cidrs: Vec<Cidr> = all.iter().filter(|c| Family::of(&c.addr) == family).copied().collect();
            let node = node_addrs.iter().any(|a| cidrs.iter().any(|c| c.contains(a)));
            if at_tc && node {
                let prefix_len = if family == Family::V4 { 32 } else { 128 };
                cidrs.push(Cidr { addr: fe.ip, prefix_len });
            }
            cidrs.sort();
            cidrs.dedup();
            SourceRanges { cidrs, node: node && !at_tc }
        });
        let affinity_scope = if self.affinity_timeout_s.is_some() { self.affinity_scope(Family::of(&fe.ip)) } else { 0 };
        FrontendPolicy {
            affinity_timeout_s: self.affinity_timeout_s,
            affinity_scope,
            source_ranges,
            slot_weights: self.slot_weights(fe, at_tc),
        }
    }

    /// The slot counts of frontend `fe`'s backends when they are weighted
    /// (graded spill-over over `cluster`): the frontend's family only, and
    /// only for a frontend whose traffic uses `cluster` (ClusterIPs unless
    /// internalTrafficPolicy is Local; external frontends from outside
    /// unless externalTrafficPolicy is Local; from the node itself, always).
    fn slot_weights(&self, fe: &Frontend, at_tc: bool) -> Option<SlotWeights> {
        let weights = self.cluster_weights.as_ref()?;
        let uses_cluster = if self.frontends.contains(fe) {
            !self.internal_local
        } else if at_tc {
            !self.external_local
        } else {
            true
        };
        if !uses_cluster {
            return None;
        }
        let family = Family::of(&fe.ip);
        SlotWeights::new(weights.iter().copied().filter(|(b, _)| Family::of(&b.ip) == family).collect())
    }

    /// The affinity scope of this port's frontends of `family`: kube-proxy
    /// keeps a ClientIP choice per Service port (its `recent` lists hang off
    /// the port's endpoint chains, which the ClusterIP, NodePort and
    /// LoadBalancer rules share), so a pod that reaches the port through
    /// its ClusterIP and its LoadBalancer IP keeps one backend. The family
    /// is part of it because a choice names a backend address of one
    /// family.
    ///
    /// A hash of the port's identity, not a counter: it is the same after a
    /// restart, on every node and for every agent version, with nothing to
    /// store. It fills the 24 bits `ServiceValue.flags` has room for; two
    /// ports whose hashes collide share their clients' entries, which costs
    /// only stickiness for a client of both (every program checks that the
    /// remembered backend is one the frontend it serves uses). With a
    /// thousand affine ports in a cluster that happens with a chance of
    /// about 3 %.
    pub fn affinity_scope(&self, family: Family) -> u32 {
        // FNV-1a: fixed, documented constants, so the value never depends
        // on a std hasher's seed or version.
        let mut h: u32 = 0x811c_9dc5;
        let fields: [&[u8]; 5] = [
            self.service.namespace.as_bytes(),
            self.service.name.as_bytes(),
            self.port.name.as_bytes(),
            self.port.protocol.as_str().as_bytes(),
            if family == Family::V4 { b"4" } else { b"6" },
        ];
        for field in fields {
            for b in field.iter().chain(std::iter::once(&0u8)) {
                h = (h ^ u32::from(*b)).wrapping_mul(0x0100_0193);
            }
        }
        let folded = (h >> 24) ^ (h & proxy_common::SVC_AFFINITY_SCOPE_MAX);
        folded.max(1)
    }

    /// Whether traffic can reach this port from outside the node's pods
    /// and processes: a NodePort, LoadBalancer ingress IPs or externalIPs
    /// (kube-proxy's `ExternallyAccessible`, pkg/proxy/serviceport.go).
    pub fn externally_accessible(&self) -> bool {
        self.port.node_port.is_some() || !self.external_ips.is_empty()
    }

    /// Whether some traffic of this port uses `cluster`: ClusterIP traffic
    /// unless internalTrafficPolicy is Local, and external traffic in any
    /// case (from the node itself it always does; kube-proxy's
    /// `UsesClusterEndpoints`).
    pub fn uses_cluster_endpoints(&self) -> bool {
        !self.internal_local || self.externally_accessible()
    }

    /// Whether some traffic of this port uses `local`: ClusterIP traffic
    /// with internalTrafficPolicy Local, or traffic from outside with
    /// externalTrafficPolicy Local when the port is reachable from outside
    /// (kube-proxy's `UsesLocalEndpoints`).
    pub fn uses_local_endpoints(&self) -> bool {
        self.internal_local || (self.external_local && self.externally_accessible())
    }

    /// Whether this port has usable endpoints somewhere but, for its
    /// (internal, external) Local policy, none on this node: the traffic of
    /// that policy is dropped here. kube-proxy counts these in
    /// `sync_proxy_rules_no_local_endpoints_total{traffic_policy}` and does
    /// not count a port without any endpoint (that one is rejected).
    pub fn no_local_endpoints(&self) -> (bool, bool) {
        if !self.local.is_empty() || self.cluster.is_empty() {
            return (false, false);
        }
        (self.internal_local, self.external_local && self.externally_accessible())
    }
}

/// How the datapath counts one frontend's connections (issue #34).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FrontendTopo {
    /// The tier every connection counts in, or `None`: its backend's.
    pub tier: Option<u8>,
    /// Added per counted connection, in `proxy_common::SHARE_ONE`ths.
    pub blind_remote_share: u32,
    /// The Service port the counts are reported under (`/metrics`).
    pub port: std::sync::Arc<PortLabel>,
}

/// Decides every Service port of the cluster for node `node`.
pub fn decide(cluster: &Cluster, node: &str) -> Vec<PortDecision> {
    let ctx = NodeContext { name: node, nodes: &cluster.nodes };
    // Slices grouped by owning Service once, so deciding stays linear in the
    // number of objects (a scan per Service is quadratic at 10k Services).
    let mut slices_by_service: BTreeMap<(&str, &str), Vec<&EndpointSlice>> = BTreeMap::new();
    for slice in cluster.slices.values() {
        slices_by_service.entry((&*slice.id.namespace, slice.service_name.as_str())).or_default().push(slice);
    }
    let no_slices = Vec::new();
    let mut out = Vec::new();
    for svc in cluster.services.values() {
        let slices = slices_by_service.get(&(&*svc.id.namespace, &*svc.id.name)).unwrap_or(&no_slices);
        decide_service(svc, slices, ctx, &mut out);
    }
    out
}

/// Decides every port of one Service from its slices (those labelled with
/// its name in its namespace), appending to `out`. `decide` and the
/// incremental `decision_cache` both go through here, so a Service is
/// decided the same way whichever path asks.
pub fn decide_service(svc: &Service, slices: &[&EndpointSlice], ctx: NodeContext<'_>, out: &mut Vec<PortDecision>) {
    // An invalid size is reported and the default used: the Service keeps
    // working with a table of the agent's size.
    let (maglev_size, maglev_problem) = match crate::decide::maglev::annotated_size(&svc.annotations) {
        Ok(size) => (size, None),
        Err(e) => (
            None,
            Some(format!("annotation {}: {e}; the agent's --maglev-table-size applies", crate::decide::maglev::TABLE_SIZE_ANNOTATION)),
        ),
    };
    for port in &svc.ports {
        // Endpoints of this port: slice ports are matched to Service
        // ports by name and protocol (discovery.k8s.io/v1 EndpointPort).
        let mut seen: BTreeMap<(IpAddr, u16), usize> = BTreeMap::new();
        let mut endpoints: Vec<&Endpoint> = Vec::new();
        let mut ports: Vec<u16> = Vec::new();
        for slice in slices {
            let Some(sp) = slice.ports.iter().find(|p| p.name == port.name && p.protocol == port.protocol) else {
                continue;
            };
            for ep in &slice.endpoints {
                // One address in two slices (a slice rebalanced, or a pod
                // IP reused while the old pod terminates): kube-proxy
                // keeps one, a terminating copy never over one that is
                // not (pkg/proxy/endpointslicecache.go `addEndpoints`);
                // between two of a kind it is whichever its map yields,
                // here the first.
                match seen.get(&(ep.address, sp.port)) {
                    None => {
                        seen.insert((ep.address, sp.port), endpoints.len());
                        endpoints.push(ep);
                        ports.push(sp.port);
                    }
                    Some(&i) => {
                        if let Some(kept) = endpoints.get_mut(i)
                            && kept.terminating
                            && !ep.terminating
                        {
                            *kept = ep;
                        }
                    }
                }
            }
        }
        let ranking = topology::rank(svc, &endpoints, ctx);
        let has_topology = svc.topology_keys.is_some()
            || svc.annotations.keys().any(|k| topology::TOPOLOGY_ANNOTATIONS.contains(&k.as_str()))
            || svc.traffic_distribution.is_some()
            || svc.internal_policy_local
            || endpoints.iter().any(|e| e.hint_zones().is_some() || e.hint_nodes().is_some());
        let to_backends = |idx: &[usize]| -> Vec<Backend> {
            let mut v: Vec<Backend> =
                idx.iter().filter_map(|&i| Some(Backend { ip: endpoints.get(i)?.address, port: *ports.get(i)? })).collect();
            v.sort();
            // Kept for as long as the decision: no growth slack.
            v.shrink_to_fit();
            v
        };
        out.push(PortDecision {
            service: svc.id.clone(),
            port: port.clone(),
            frontends: svc.cluster_ips.iter().map(|ip| Frontend { ip: *ip, port: port.port, protocol: port.protocol }).collect(),
            model: ranking.model.as_str(),
            decision: crate::util::intern::intern(&ranking.decision),
            cluster: to_backends(&ranking.cluster),
            local: to_backends(&ranking.local),
            internal_local: svc.internal_policy_local,
            external_local: svc.external_policy_local,
            external_ips: svc.external_ips.iter().chain(&svc.load_balancer_ips).copied().collect(),
            health_check_node_port: svc.health_check_node_port,
            affinity_timeout_s: svc.session_affinity,
            load_balancer_ips: svc.load_balancer_ips.clone(),
            source_ranges: svc.load_balancer_source_ranges.clone(),
            problems: ranking.problems.into_iter().chain(maglev_problem.clone()).collect(),
            maglev_size,
            tier: ranking.tier,
            blind_remote_share: ranking.blind_remote_share,
            has_topology: has_topology || ranking.spill.is_some(),
            cluster_weights: ranking.spill.as_ref().filter(|s| !s.weights.is_empty()).map(|s| {
                let mut w: Vec<(Backend, u32)> = s
                    .weights
                    .iter()
                    .filter_map(|&(i, n)| Some((Backend { ip: endpoints.get(i)?.address, port: *ports.get(i)? }, n)))
                    .collect();
                w.sort();
                w.into()
            }),
            spill: ranking.spill.map(|s| std::sync::Arc::new(SpillShares { factor: s.factor.to_string(), tiers: s.tiers })),
        });
    }
}

/// The datapath state these decisions call for: each frontend with the
/// backends of its own family. When two Service ports claim the same
/// frontend (a manifest mistake the API server would have refused), the
/// first in namespace/name order keeps it and the clash is reported.
pub fn desired_state(decisions: &[PortDecision]) -> (BTreeMap<Frontend, BTreeSet<Backend>>, Vec<String>) {
    let mut out = BTreeMap::new();
    let mut owner: BTreeMap<Frontend, &ObjectRef> = BTreeMap::new();
    let mut clashes = Vec::new();
    for d in decisions {
        for fe in &d.frontends {
            if let Some(first) = owner.get(fe) {
                if *first != &d.service {
                    clashes.push(format!("Service {}: frontend {fe} is already used by Service {first}; ignored", d.service));
                }
                continue;
            }
            owner.insert(*fe, &d.service);
            let fam = Family::of(&fe.ip);
            let set: BTreeSet<Backend> = d.internal_backends().iter().filter(|b| Family::of(&b.ip) == fam).copied().collect();
            out.insert(*fe, set);
        }
    }
    (out, clashes)
}

/// The policies of the ClusterIP frontends these decisions call for, with
/// the owner [`desired_state`] gives each frontend (only the frontends
/// whose policy is not the default).
pub fn desired_policies(decisions: &[PortDecision]) -> Policies {
    let mut out = Policies::new();
    let mut owned = std::collections::BTreeSet::new();
    for d in decisions {
        for fe in &d.frontends {
            if !owned.insert(*fe) {
                continue;
            }
            let p = d.frontend_policy(fe, &[], false);
            if !p.is_default() {
                out.insert(*fe, p);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The model of a manifest that must convert without problems.
    pub(super) fn cluster(yaml: &str) -> Cluster {
        let (c, e) = crate::source::manifest_watch::cluster_from_text(yaml);
        assert!(e.is_empty(), "{e:?}");
        c
    }

    const TWO_PORTS: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: web}
spec:
  clusterIPs: [10.96.0.10, "fd00::10"]
  ports: [{name: http, port: 80}, {name: metrics, port: 9090}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-v4, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080}, {name: metrics, port: 9100}]
endpoints:
- addresses: [10.244.0.1]
  nodeName: a
- addresses: [10.244.0.2]
  nodeName: b
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-v4-dup, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080}]
endpoints:
- addresses: [10.244.0.2]
  nodeName: b
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-v6, labels: {kubernetes.io/service-name: web}}
addressType: IPv6
ports: [{name: http, port: 8080}]
endpoints:
- addresses: ["fd00::1"]
  nodeName: a
"#;

    #[test]
    fn ports_match_slices_by_name_and_families_stay_apart() {
        let c = cluster(TWO_PORTS);
        let d = decide(&c, "a");
        assert_eq!(d.len(), 2);
        let http = &d[0];
        assert_eq!(http.port.name, "http");
        assert_eq!(http.frontends.len(), 2);
        // 10.244.0.2 is in two slices; it counts once.
        assert_eq!(http.cluster.len(), 3);
        assert_eq!(http.local.iter().map(ToString::to_string).collect::<Vec<_>>(), ["10.244.0.1:8080", "[fd00::1]:8080"]);
        let metrics = &d[1];
        assert_eq!(metrics.cluster.iter().map(|b| b.port).collect::<Vec<_>>(), [9100, 9100]);
        let (state, clashes) = desired_state(&d);
        assert!(clashes.is_empty());
        let v6 = Frontend { ip: "fd00::10".parse().unwrap(), port: 80, protocol: crate::model::Protocol::Tcp };
        assert_eq!(state[&v6].len(), 1, "IPv6 frontends get IPv6 backends only");
        let v6_metrics = Frontend { port: 9090, ..v6 };
        assert!(state[&v6_metrics].is_empty(), "no IPv6 endpoint serves metrics: refused, not mixed families");
    }

    /// One address in two slices: a copy that is not terminating wins
    /// over a terminating one, whichever slice comes first, as in
    /// kube-proxy's `addEndpoints`. (first slice's conditions, second's,
    /// the cluster set, the local set on node a.)
    #[test]
    fn a_duplicate_address_keeps_the_copy_that_is_not_terminating() {
        let term = "{ready: false, serving: true, terminating: true}";
        let ready = "{ready: true}";
        let unready = "{ready: false, serving: false}";
        let cases: [(&str, &str, &[&str], &[&str]); 5] = [
            (term, ready, &["10.244.0.1:8080"], &["10.244.0.1:8080"]),
            (ready, term, &["10.244.0.1:8080"], &["10.244.0.1:8080"]),
            (term, unready, &[], &[]),
            (unready, term, &[], &[]),
            (term, term, &["10.244.0.1:8080"], &["10.244.0.1:8080"]),
        ];
        for (first, second, cluster_want, local_want) in cases {
            let slice = |name: &str, cond: &str| {
                format!(
                    "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}, labels: {{kubernetes.io/service-name: web}}}}\n\
                     addressType: IPv4\nports: [{{name: http, port: 8080}}]\nendpoints:\n- addresses: [10.244.0.1]\n  nodeName: a\n  conditions: {cond}\n"
                )
            };
            let yaml = format!(
                "apiVersion: v1\nkind: Service\nmetadata: {{name: web}}\nspec: {{clusterIP: 10.96.0.10, internalTrafficPolicy: Local, type: NodePort, ports: [{{name: http, port: 80, nodePort: 30080}}]}}\n{}{}",
                slice("web-1", first),
                slice("web-2", second)
            );
            let d = decide(&cluster(&yaml), "a");
            let names = |v: &[Backend]| v.iter().map(ToString::to_string).collect::<Vec<_>>();
            assert_eq!(names(&d[0].cluster), cluster_want, "{first} then {second}");
            assert_eq!(names(&d[0].local), local_want, "{first} then {second}");
        }
    }

    #[test]
    fn a_frontend_claimed_twice_is_reported() {
        let yaml = "apiVersion: v1\nkind: Service\nmetadata: {name: a}\nspec: {clusterIP: 10.96.0.1, ports: [{port: 80}]}\n---\napiVersion: v1\nkind: Service\nmetadata: {name: b}\nspec: {clusterIP: 10.96.0.1, ports: [{port: 80}]}\n";
        let (state, clashes) = desired_state(&decide(&cluster(yaml), "n"));
        assert_eq!(state.len(), 1);
        assert_eq!(clashes, ["Service default/b: frontend 10.96.0.1:80/TCP is already used by Service default/a; ignored"]);
    }
}

#[cfg(test)]
mod policy_tests {
    use super::tests::cluster;
    use super::*;

    /// One Service port on node `a`, with an endpoint on `endpoint_node`.
    fn port(itp: &str, etp: &str, service_type: &str, node_port: &str, external_ips: &str, endpoint_node: &str) -> PortDecision {
        let yaml = format!(
            r"
apiVersion: v1
kind: Service
metadata: {{name: web}}
spec:
  type: {service_type}
  clusterIP: 10.96.0.10
  internalTrafficPolicy: {itp}
  externalTrafficPolicy: {etp}
  externalIPs: [{external_ips}]
  ports: [{{port: 80{node_port}}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: web-1, labels: {{kubernetes.io/service-name: web}}}}
addressType: IPv4
ports: [{{port: 8080}}]
endpoints: [{{addresses: [10.244.0.1], nodeName: {endpoint_node}}}]
"
        );
        let mut d = decide(&cluster(&yaml), "a");
        assert_eq!(d.len(), 1);
        d.remove(0)
    }

    #[test]
    fn which_endpoint_sets_a_port_uses() {
        // (iTP, eTP, type, nodePort, externalIPs) -> (uses cluster, uses local)
        let cases = [
            ("Cluster", "Cluster", "ClusterIP", "", "", (true, false)),
            ("Local", "Cluster", "ClusterIP", "", "", (false, true)),
            // eTP Local means nothing without a way in from outside.
            ("Cluster", "Local", "ClusterIP", "", "", (true, false)),
            ("Local", "Local", "ClusterIP", "", "", (false, true)),
            // Reachable from outside: the node's own connections to the
            // external frontends use the cluster-wide set.
            ("Local", "Cluster", "NodePort", ", nodePort: 30080", "", (true, true)),
            ("Cluster", "Local", "NodePort", ", nodePort: 30080", "", (true, true)),
            ("Cluster", "Cluster", "NodePort", ", nodePort: 30080", "", (true, false)),
            ("Cluster", "Local", "ClusterIP", "", "192.0.2.10", (true, true)),
            ("Local", "Local", "LoadBalancer", ", nodePort: 30080", "", (true, true)),
        ];
        for (itp, etp, ty, np, ext, want) in cases {
            let d = port(itp, etp, ty, np, ext, "a");
            assert_eq!((d.uses_cluster_endpoints(), d.uses_local_endpoints()), want, "iTP {itp}, eTP {etp}, {ty}{np} {ext}");
        }
    }

    #[test]
    fn ports_without_local_endpoints_are_counted_per_policy() {
        // (iTP, eTP, type, nodePort, externalIPs, endpoint's node) -> (internal, external)
        let cases = [
            ("Local", "Cluster", "ClusterIP", "", "", "b", (true, false)),
            ("Local", "Cluster", "ClusterIP", "", "", "a", (false, false)),
            ("Cluster", "Local", "NodePort", ", nodePort: 30080", "", "b", (false, true)),
            ("Cluster", "Local", "ClusterIP", "", "", "b", (false, false)),
            ("Local", "Local", "NodePort", ", nodePort: 30080", "", "b", (true, true)),
            ("Cluster", "Cluster", "NodePort", ", nodePort: 30080", "", "b", (false, false)),
        ];
        for (itp, etp, ty, np, ext, on, want) in cases {
            let d = port(itp, etp, ty, np, ext, on);
            assert_eq!(d.no_local_endpoints(), want, "iTP {itp}, eTP {etp}, {ty}{np} {ext}, endpoint on {on}");
        }
        // No endpoint anywhere: rejected, not counted.
        let mut d = port("Local", "Local", "NodePort", ", nodePort: 30080", "", "b");
        d.cluster.clear();
        assert_eq!(d.no_local_endpoints(), (false, false));
    }
}

#[cfg(test)]
mod frontend_policy_tests {
    use super::tests::cluster;
    use super::*;
    use crate::model::Protocol;
    use std::net::IpAddr;

    /// A dual-stack LoadBalancer Service with affinity and source ranges.
    fn lb(ranges: &str) -> Vec<PortDecision> {
        let yaml = format!(
            r"
apiVersion: v1
kind: Service
metadata: {{name: web}}
spec:
  type: LoadBalancer
  clusterIPs: [10.96.0.10, 'fd00::10']
  externalIPs: [192.0.2.10]
  sessionAffinity: ClientIP
  sessionAffinityConfig: {{clientIP: {{timeoutSeconds: 60}}}}
  loadBalancerSourceRanges: [{ranges}]
  ports: [{{name: http, port: 80, nodePort: 30080}}]
status:
  loadBalancer: {{ingress: [{{ip: 198.51.100.7}}, {{ip: '2001:db8::7'}}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: web-1, labels: {{kubernetes.io/service-name: web}}}}
addressType: IPv4
ports: [{{name: http, port: 8080}}]
endpoints: [{{addresses: [10.244.0.1], nodeName: a}}]
"
        );
        decide(&cluster(&yaml), "a")
    }

    fn fe(ip: &str, port: u16) -> Frontend {
        Frontend { ip: ip.parse().unwrap(), port, protocol: Protocol::Tcp }
    }
    fn cidrs(p: &FrontendPolicy) -> Vec<String> {
        p.source_ranges.as_ref().map(|r| r.cidrs.iter().map(ToString::to_string).collect()).unwrap_or_default()
    }

    #[test]
    fn affinity_reaches_every_frontend_and_ranges_only_the_load_balancer_ips() {
        let d = lb("10.0.0.0/8, 203.0.113.0/24");
        let node: Vec<IpAddr> = vec!["192.168.1.5".parse().unwrap()];
        let ext = external_state(&d, &node);
        // Every frontend is affine with the Service's timeout.
        let clusterip = desired_policies(&d);
        assert_eq!(clusterip.len(), 2, "both ClusterIPs: {clusterip:?}");
        for p in clusterip.values().chain(ext.socket_policies.values()).chain(ext.tc_policies.values()) {
            assert_eq!(p.affinity_timeout_s, Some(60), "{p:?}");
        }
        assert!(clusterip.values().all(|p| p.source_ranges.is_none()), "ClusterIPs are never filtered");
        for (fe, filtered) in [(fe("198.51.100.7", 80), true), (fe("192.0.2.10", 80), false), (fe("192.168.1.5", 30080), false)] {
            for (datapath, policies) in [("socket", &ext.socket_policies), ("tc", &ext.tc_policies)] {
                let p = &policies[&fe];
                assert_eq!(p.source_ranges.is_some(), filtered, "{datapath} {fe}: only LoadBalancer IPs are filtered");
            }
        }
        let lb4 = fe("198.51.100.7", 80);
        assert_eq!(cidrs(&ext.tc_policies[&lb4]), ["10.0.0.0/8", "203.0.113.0/24"]);
        assert_eq!(ext.socket_policies[&lb4].source_ranges.as_ref().map(|r| r.node), Some(false), "the node is outside the ranges");
        // The IPv6 ingress IP: no IPv6 range, so it admits nobody.
        let lb6 = fe("2001:db8::7", 80);
        assert_eq!(ext.tc_policies[&lb6].source_ranges, Some(SourceRanges::default()));
    }

    /// One scope per Service port and family, shared by all its frontends
    /// on both datapaths, and different for every other port.
    #[test]
    fn affinity_is_scoped_per_service_port_and_family() {
        let d = lb("10.0.0.0/8");
        let node: Vec<IpAddr> = vec!["192.168.1.5".parse().unwrap()];
        let ext = external_state(&d, &node);
        let all: Vec<(Frontend, u32)> = desired_policies(&d)
            .iter()
            .chain(&ext.socket_policies)
            .chain(&ext.tc_policies)
            .map(|(fe, p)| (*fe, p.affinity_scope))
            .collect();
        let of = |v4: bool| -> BTreeSet<u32> { all.iter().filter(|(fe, _)| fe.ip.is_ipv4() == v4).map(|(_, s)| *s).collect() };
        let (v4, v6) = (of(true), of(false));
        assert_eq!(v4.len(), 1, "every IPv4 frontend of the port shares one scope: {all:?}");
        assert_eq!(v6.len(), 1, "and every IPv6 one: {all:?}");
        assert_ne!(v4, v6, "a choice names a backend of one family");
        assert!(v4.iter().chain(&v6).all(|s| (1..=proxy_common::SVC_AFFINITY_SCOPE_MAX).contains(s)), "fits the flags, never 0");
        // (what changes, Service name, port name, protocol): each is another
        // scope; the same identity is the same scope, here and after a
        // restart (a hash, nothing stored).
        let port = |name: &str, svc: &str, protocol: Protocol| {
            let mut p = d[0].clone();
            p.service.name = svc.into();
            p.port.name = name.into();
            p.port.protocol = protocol;
            p.affinity_scope(Family::V4)
        };
        let base = port("http", "web", Protocol::Tcp);
        assert_eq!(Some(&base), v4.iter().next());
        for (what, other) in [
            ("port name", port("https", "web", Protocol::Tcp)),
            ("Service", port("http", "api", Protocol::Tcp)),
            ("protocol", port("http", "web", Protocol::Udp)),
        ] {
            assert_ne!(other, base, "another {what} is another scope");
        }
        // Without affinity no frontend carries a scope.
        let mut plain = d[0].clone();
        plain.affinity_timeout_s = None;
        assert_eq!(plain.frontend_policy(&fe("10.96.0.10", 80), &node, false).affinity_scope, 0);
    }

    #[test]
    fn a_node_inside_the_ranges_may_reach_its_load_balancer_ip() {
        let d = lb("192.168.0.0/16");
        let node: Vec<IpAddr> = vec!["192.168.1.5".parse().unwrap()];
        let ext = external_state(&d, &node);
        let lb4 = fe("198.51.100.7", 80);
        // TC: the LoadBalancer IP itself joins the sources (kube-proxy's
        // rule for requests that loop back with the VIP as source).
        assert_eq!(cidrs(&ext.tc_policies[&lb4]), ["192.168.0.0/16", "198.51.100.7/32"]);
        assert!(!ext.tc_policies[&lb4].source_ranges.as_ref().is_some_and(|r| r.node));
        // Socket datapath: the node's own processes.
        let socket = ext.socket_policies[&lb4].source_ranges.clone().expect("filtered");
        assert!(socket.node);
        assert_eq!(socket.cidrs.len(), 1);
        // Not when the node's address is elsewhere.
        let ext = external_state(&d, &["10.1.1.1".parse().unwrap()]);
        assert_eq!(ext.socket_policies[&lb4].source_ranges.as_ref().map(|r| r.node), Some(false));
    }

    #[test]
    fn services_without_affinity_or_ranges_have_no_policy() {
        let yaml = "apiVersion: v1\nkind: Service\nmetadata: {name: a}\nspec: {type: LoadBalancer, clusterIP: 10.96.0.1, ports: [{port: 80, nodePort: 30001}]}\nstatus: {loadBalancer: {ingress: [{ip: 198.51.100.1}]}}\n";
        let d = decide(&cluster(yaml), "n");
        let ext = external_state(&d, &["10.0.0.1".parse().unwrap()]);
        assert!(desired_policies(&d).is_empty());
        assert!(ext.socket_policies.is_empty() && ext.tc_policies.is_empty());
    }

    #[test]
    fn the_maglev_annotation_sizes_the_external_frontends_and_a_bad_value_is_reported() {
        use crate::decide::maglev::TableSize;
        // (annotation value, size of the external frontends, problem)
        let cases: [(Option<&str>, Option<TableSize>, Option<&str>); 5] = [
            (None, None, None),
            (Some("65521"), Some(TableSize::Large), None),
            (Some("16381"), Some(TableSize::Default), None),
            (
                Some("65536"),
                None,
                Some(
                    "annotation topoproxy.io/maglev-table-size: invalid Maglev table size \"65536\": must be 16381 or 65521; the agent's --maglev-table-size applies",
                ),
            ),
            (Some("large"), None, Some("invalid Maglev table size \"large\"")),
        ];
        for (value, size, problem) in cases {
            let ann = value.map_or(String::new(), |v| format!("annotations: {{topoproxy.io/maglev-table-size: \"{v}\"}}, "));
            let yaml = format!(
                "apiVersion: v1\nkind: Service\nmetadata: {{name: a, {ann}}}\nspec: {{type: LoadBalancer, clusterIP: 10.96.0.1, ports: [{{port: 80, nodePort: 30001}}]}}\nstatus: {{loadBalancer: {{ingress: [{{ip: 198.51.100.1}}]}}}}\n"
            );
            let d = decide(&cluster(&yaml), "n");
            assert_eq!(d[0].maglev_size, size, "{value:?}");
            match problem {
                Some(p) => assert!(d[0].problems.iter().any(|x| x.contains(p)), "{value:?}: {:?}", d[0].problems),
                None => assert!(d[0].problems.is_empty(), "{value:?}: {:?}", d[0].problems),
            }
            let ext = external_state(&d, &["10.0.0.1".parse().unwrap()]);
            let want: BTreeMap<Frontend, TableSize> = size.map(|s| ext.tc.keys().map(|fe| (*fe, s)).collect()).unwrap_or_default();
            assert_eq!(ext.maglev_sizes, want, "{value:?}: NodePort and LoadBalancer frontends alike");
            assert_eq!(ext.tc.len(), 2, "{value:?}: the frontends are served whatever the annotation says");
        }
    }

    /// How each frontend of a port counts its connections (issue #34):
    /// (Service spec, want: ClusterIP tier, socket-side external tier, TC
    /// tier, has a topology setting).
    #[test]
    fn each_frontend_counts_in_the_tier_its_traffic_policy_and_topology_give() {
        use proxy_common::tier;
        let yaml = |spec: &str, ann: &str| {
            format!(
                "apiVersion: v1\nkind: Node\nmetadata: {{name: a, labels: {{topology.kubernetes.io/zone: z1}}}}\n---\n\
                 apiVersion: v1\nkind: Service\nmetadata: {{name: web, annotations: {{{ann}}}}}\n\
                 spec:\n  type: NodePort\n  clusterIP: 10.96.0.10\n{spec}  ports: [{{name: http, port: 80, nodePort: 30080}}]\n---\n\
                 apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: web-1, labels: {{kubernetes.io/service-name: web}}}}\n\
                 addressType: IPv4\nports: [{{name: http, port: 8080}}]\nendpoints:\n\
                 - addresses: [10.244.0.1]\n  nodeName: a\n  zone: z1\n\
                 - addresses: [10.244.0.2]\n  nodeName: b\n  zone: z1\n\
                 - addresses: [10.244.0.3]\n  nodeName: c\n  zone: z2\n"
            )
        };
        let zone_keys = "topoproxy.io/topology-keys: \"topology.kubernetes.io/zone, *\"";
        let (node, zone) = (Some(tier::NODE), Some(tier::ZONE));
        /// ClusterIP, socket-side external and TC tiers, has topology.
        type Want = (Option<u8>, Option<u8>, Option<u8>, bool);
        let cases: Vec<(&str, String, Want)> = vec![
            ("no topology: each backend's own", yaml("", ""), (None, None, None, false)),
            ("zone keys", yaml("", zone_keys), (zone, zone, zone, true)),
            (
                "internalTrafficPolicy Local: ClusterIPs on this node",
                yaml("  internalTrafficPolicy: Local\n", ""),
                (node, None, None, true),
            ),
            // Topology keys are invalid beside externalTrafficPolicy Local
            // (the API server refused them): ignored, each backend's own.
            (
                "externalTrafficPolicy Local: traffic from outside",
                yaml("  externalTrafficPolicy: Local\n", zone_keys),
                (None, None, node, true),
            ),
        ];
        let addrs = ["192.0.2.1".parse().expect("address")];
        for (name, y, (clusterip, from_node, tc_want, topology)) in cases {
            let d = decide(&cluster(&y), "a");
            assert_eq!(d.len(), 1, "{name}");
            let (mut socket, mut tc) = (Vec::new(), Vec::new());
            d[0].frontend_topology(&addrs, &mut socket, &mut tc);
            let tier_of = |list: &[(Frontend, FrontendTopo)], ip: &str, port: u16| {
                list.iter().find(|(fe, _)| fe.ip.to_string() == ip && fe.port == port).map(|(_, t)| t.tier)
            };
            assert_eq!(tier_of(&socket, "10.96.0.10", 80), Some(clusterip), "{name}: ClusterIP");
            assert_eq!(tier_of(&socket, "192.0.2.1", 30080), Some(from_node), "{name}: NodePort from the node");
            assert_eq!(tier_of(&socket, "127.0.0.1", 30080), Some(from_node), "{name}: NodePort on loopback");
            assert_eq!(tier_of(&tc, "192.0.2.1", 30080), Some(tc_want), "{name}: NodePort from outside");
            assert_eq!(d[0].has_topology, topology, "{name}");
            // One endpoint of three outside zone z1.
            assert!(socket.iter().chain(&tc).all(|(_, t)| t.blind_remote_share == crate::decide::topology::tier::share_fp(1, 3)), "{name}");
            assert!(socket.iter().all(|(_, t)| t.port.service.as_ref() == "web" && t.port.port == "http"), "{name}");
        }
    }
}
