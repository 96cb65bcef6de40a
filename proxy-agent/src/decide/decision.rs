//! The one decision path shared by `run` and `explain`: for every Service
//! port, which frontends exist and which backends this node sends them to.
//! Pure: it reads the model and calls the topology ranking.

use std::collections::{BTreeMap, BTreeSet};

use crate::decide::topology::{self, NodeContext};
use crate::model::{Backend, Cluster, Endpoint, EndpointSlice, Family, Frontend, ObjectRef, Service, ServicePort};

/// The outcome for one Service port on this node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortDecision {
    pub service: ObjectRef,
    pub port: ServicePort,
    /// ClusterIP frontends, primary family first.
    pub frontends: Vec<Frontend>,
    /// Name of the model that decided (see `topology::Model`).
    pub model: &'static str,
    /// Why, in words.
    pub decision: String,
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
    /// Problems found in the Service's configuration, to be reported with
    /// its name.
    pub problems: Vec<String>,
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
}

/// Decides every Service port of the cluster for node `node`.
pub fn decide(cluster: &Cluster, node: &str) -> Vec<PortDecision> {
    let ctx = NodeContext { name: node, nodes: &cluster.nodes };
    // Slices grouped by owning Service once, so deciding stays linear in the
    // number of objects (a scan per Service is quadratic at 10k Services).
    let mut slices_by_service: BTreeMap<(&str, &str), Vec<&EndpointSlice>> = BTreeMap::new();
    for slice in cluster.slices.values() {
        slices_by_service.entry((slice.id.namespace.as_str(), slice.service_name.as_str())).or_default().push(slice);
    }
    let no_slices = Vec::new();
    let mut out = Vec::new();
    for svc in cluster.services.values() {
        let slices = slices_by_service.get(&(svc.id.namespace.as_str(), svc.id.name.as_str())).unwrap_or(&no_slices);
        decide_service(svc, slices, ctx, &mut out);
    }
    out
}

/// Decides every port of one Service from its slices (those labelled with
/// its name in its namespace), appending to `out`. `decide` and the
/// incremental `decision_cache` both go through here, so a Service is
/// decided the same way whichever path asks.
pub fn decide_service(svc: &Service, slices: &[&EndpointSlice], ctx: NodeContext<'_>, out: &mut Vec<PortDecision>) {
    for port in &svc.ports {
        // Endpoints of this port: slice ports are matched to Service
        // ports by name and protocol (discovery.k8s.io/v1 EndpointPort).
        let mut seen = BTreeSet::new();
        let mut endpoints: Vec<&Endpoint> = Vec::new();
        let mut ports: Vec<u16> = Vec::new();
        for slice in slices {
            let Some(sp) = slice.ports.iter().find(|p| p.name == port.name && p.protocol == port.protocol) else {
                continue;
            };
            for ep in &slice.endpoints {
                // During slice rebalancing an endpoint may briefly appear in
                // two slices; keep the first.
                if seen.insert((ep.address, sp.port)) {
                    endpoints.push(ep);
                    ports.push(sp.port);
                }
            }
        }
        let ranking = topology::rank(svc, &endpoints, ctx);
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
            decision: ranking.decision,
            cluster: to_backends(&ranking.cluster),
            local: to_backends(&ranking.local),
            internal_local: svc.internal_policy_local,
            external_local: svc.external_policy_local,
            external_ips: svc.external_ips.iter().chain(&svc.load_balancer_ips).copied().collect(),
            health_check_node_port: svc.health_check_node_port,
            problems: ranking.problems,
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

/// A health check node port to serve (externalTrafficPolicy: Local).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthCheck {
    pub port: u16,
    pub service: ObjectRef,
    /// Usable endpoints of the Service on this node (distinct addresses of
    /// one family, the largest count over its ports and families).
    pub local_endpoints: usize,
}

/// What the external frontends (NodePort, LoadBalancer IPs, externalIPs)
/// call for on a node with addresses `node_addrs`. Derived from the same
/// decisions as the ClusterIP state, so `run` and `explain` agree.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExternalState {
    /// Extra entries for the socket datapath: node-originated connections to
    /// the external frontends and to NodePorts on loopback. Traffic from the
    /// node itself uses the cluster-wide set whatever externalTrafficPolicy
    /// says (kube-proxy does the same for node-local clients).
    pub socket: BTreeMap<Frontend, BTreeSet<Backend>>,
    /// Entries for the TC datapath (traffic arriving from outside).
    pub tc: BTreeMap<Frontend, BTreeSet<Backend>>,
    /// TC frontends with externalTrafficPolicy: Local (dropped, not
    /// rejected, without a local endpoint).
    pub policy_local: BTreeSet<Frontend>,
    /// Endpoint addresses on this node: traffic to them needs no SNAT.
    pub local_endpoints: BTreeSet<std::net::IpAddr>,
    pub health_checks: Vec<HealthCheck>,
    pub problems: Vec<String>,
}

pub fn external_state<'a, I>(decisions: I, node_addrs: &[std::net::IpAddr]) -> ExternalState
where
    I: IntoIterator<Item = &'a PortDecision> + Clone,
{
    let mut cluster_ips: BTreeMap<Frontend, &ObjectRef> = BTreeMap::new();
    // ClusterIPs keep priority in the socket map.
    for d in decisions.clone() {
        for fe in &d.frontends {
            cluster_ips.entry(*fe).or_insert(&d.service);
        }
    }
    let mut out = external_state_of(decisions.clone(), |fe| cluster_ips.get(fe).copied(), node_addrs);
    for d in decisions {
        out.local_endpoints.extend(d.local.iter().map(|b| b.ip));
    }
    out
}

/// Whether a decision contributes anything to [`external_state`] besides
/// its local endpoints: external frontends or a health check node port.
pub fn has_external(d: &PortDecision) -> bool {
    d.port.node_port.is_some() || !d.external_ips.is_empty() || (d.external_local && d.health_check_node_port.is_some())
}

/// [`external_state`] computed from the decisions that [`has_external`]
/// (decisions without are skipped, as they contribute nothing), given the
/// owner of each ClusterIP frontend. `local_endpoints` is left empty: it
/// comes from every decision, which the caller may keep track of itself.
pub fn external_state_of<'a>(
    decisions: impl IntoIterator<Item = &'a PortDecision>,
    cluster_ip_owner: impl Fn(&Frontend) -> Option<&'a ObjectRef>,
    node_addrs: &[std::net::IpAddr],
) -> ExternalState {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
    let mut out = ExternalState::default();
    // External frontends claimed so far (ClusterIPs come first).
    let mut owner: BTreeMap<Frontend, &ObjectRef> = BTreeMap::new();
    let loopback = [IpAddr::V4(Ipv4Addr::LOCALHOST), IpAddr::V6(Ipv6Addr::LOCALHOST)];
    let mut health: BTreeMap<u16, HealthCheck> = BTreeMap::new();
    for d in decisions.into_iter().filter(|d| has_external(d)) {
        let of_family = |set: &[Backend], fe: &Frontend| -> BTreeSet<Backend> {
            set.iter().filter(|b| Family::of(&b.ip) == Family::of(&fe.ip)).copied().collect()
        };
        let external = d.external_frontends(node_addrs);
        let mut socket_fes = external.clone();
        if let Some(np) = d.port.node_port {
            socket_fes.extend(loopback.iter().map(|ip| Frontend { ip: *ip, port: np, protocol: d.port.protocol }));
        }
        for fe in &socket_fes {
            match cluster_ip_owner(fe).or_else(|| owner.get(fe).copied()) {
                Some(first) if first != &d.service => {
                    out.problems.push(format!("Service {}: frontend {fe} is already used by Service {first}; ignored", d.service));
                    continue;
                }
                Some(_) if d.frontends.contains(fe) => continue,
                _ => {}
            }
            owner.insert(*fe, &d.service);
            out.socket.entry(*fe).or_insert_with(|| of_family(&d.cluster, fe));
        }
        for fe in &external {
            if out.tc.contains_key(fe) {
                continue; // already reported above
            }
            out.tc.insert(*fe, of_family(d.external_backends(), fe));
            if d.external_local {
                out.policy_local.insert(*fe);
            }
        }
        if d.external_local
            && let Some(port) = d.health_check_node_port
        {
            // kube-proxy runs one proxier per IP family, each counting its
            // own family's endpoints; a dual-stack pod is one endpoint.
            let per_family = |fam: Family| d.local.iter().filter(|b| Family::of(&b.ip) == fam).map(|b| b.ip).collect::<BTreeSet<_>>().len();
            let n = per_family(Family::V4).max(per_family(Family::V6));
            let e = health.entry(port).or_insert(HealthCheck { port, service: d.service.clone(), local_endpoints: 0 });
            if e.service == d.service {
                e.local_endpoints = e.local_endpoints.max(n);
            }
        }
    }
    out.health_checks = health.into_values().collect();
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

    #[test]
    fn a_frontend_claimed_twice_is_reported() {
        let yaml = "apiVersion: v1\nkind: Service\nmetadata: {name: a}\nspec: {clusterIP: 10.96.0.1, ports: [{port: 80}]}\n---\napiVersion: v1\nkind: Service\nmetadata: {name: b}\nspec: {clusterIP: 10.96.0.1, ports: [{port: 80}]}\n";
        let (state, clashes) = desired_state(&decide(&cluster(yaml), "n"));
        assert_eq!(state.len(), 1);
        assert_eq!(clashes, ["Service default/b: frontend 10.96.0.1:80/TCP is already used by Service default/a; ignored"]);
    }
}

#[cfg(test)]
mod external_tests {
    use super::tests::cluster;
    use super::*;
    use crate::model::Protocol;
    use std::net::IpAddr;

    fn svc(policy: &str) -> String {
        format!(
            r"
apiVersion: v1
kind: Service
metadata: {{name: web}}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.10
  externalIPs: [192.0.2.10]
  externalTrafficPolicy: {policy}
  healthCheckNodePort: 32000
  ports: [{{name: http, port: 80, nodePort: 30080}}]
status:
  loadBalancer: {{ingress: [{{ip: 198.51.100.7}}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: web-1, labels: {{kubernetes.io/service-name: web}}}}
addressType: IPv4
ports: [{{name: http, port: 8080}}]
endpoints:
- addresses: [10.244.0.1]
  nodeName: a
- addresses: [10.244.0.2]
  nodeName: b
"
        )
    }

    fn fe(ip: &str, port: u16) -> Frontend {
        Frontend { ip: ip.parse().unwrap(), port, protocol: Protocol::Tcp }
    }
    fn ips(set: &BTreeSet<Backend>) -> Vec<String> {
        set.iter().map(|b| b.ip.to_string()).collect()
    }

    #[test]
    fn cluster_policy_serves_node_ports_lb_and_external_ips_with_the_cluster_set() {
        let d = decide(&cluster(&svc("Cluster")), "a");
        let node: Vec<IpAddr> = vec!["10.0.0.1".parse().unwrap()];
        let ext = external_state(&d, &node);
        let tc: Vec<Frontend> = ext.tc.keys().copied().collect();
        assert_eq!(tc, [fe("10.0.0.1", 30080), fe("192.0.2.10", 80), fe("198.51.100.7", 80)]);
        for set in ext.tc.values() {
            assert_eq!(ips(set), ["10.244.0.1", "10.244.0.2"]);
        }
        assert!(ext.policy_local.is_empty());
        assert!(ext.health_checks.is_empty(), "health checks only for Local");
        // From the node itself: node address, loopback, external IPs.
        assert!(ext.socket.contains_key(&fe("127.0.0.1", 30080)));
        assert!(ext.socket[&fe("::1", 30080)].is_empty(), "no IPv6 endpoint: refused, not mixed families");
        assert_eq!(ips(&ext.socket[&fe("10.0.0.1", 30080)]), ["10.244.0.1", "10.244.0.2"]);
        assert!(!ext.socket.contains_key(&fe("10.96.0.10", 80)), "ClusterIPs stay with desired_state");
        assert_eq!(ext.local_endpoints.iter().map(ToString::to_string).collect::<Vec<_>>(), ["10.244.0.1"]);
    }

    #[test]
    fn local_policy_uses_local_endpoints_from_outside_and_the_cluster_set_from_the_node() {
        let node: Vec<IpAddr> = vec!["10.0.0.1".parse().unwrap()];
        let ext = external_state(&decide(&cluster(&svc("Local")), "a"), &node);
        assert_eq!(ips(&ext.tc[&fe("10.0.0.1", 30080)]), ["10.244.0.1"]);
        assert!(ext.policy_local.contains(&fe("198.51.100.7", 80)));
        assert_eq!(ips(&ext.socket[&fe("127.0.0.1", 30080)]), ["10.244.0.1", "10.244.0.2"]);
        assert_eq!(ext.health_checks.len(), 1);
        assert_eq!((ext.health_checks[0].port, ext.health_checks[0].local_endpoints), (32000, 1));
        // On a node without endpoints: empty set (dropped), health 0.
        let ext = external_state(&decide(&cluster(&svc("Local")), "c"), &node);
        assert!(ext.tc[&fe("10.0.0.1", 30080)].is_empty());
        assert_eq!(ext.health_checks[0].local_endpoints, 0);
    }
}
