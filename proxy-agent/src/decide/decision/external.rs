//! What the external frontends (NodePort, LoadBalancer IPs, externalIPs)
//! need from the per-port decisions: their backend sets for both
//! datapaths, policies, Maglev sizes and health check node ports.

use std::collections::{BTreeMap, BTreeSet};

use super::PortDecision;
use crate::decide::plan::Policies;
use crate::model::{Backend, Family, Frontend, ObjectRef};

/// A health check node port to serve (externalTrafficPolicy: Local).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthCheck {
    /// The `healthCheckNodePort` to listen on.
    pub port: u16,
    /// The Service it reports on.
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
    /// The policies of the `socket` and `tc` frontends that have one
    /// (session affinity, source ranges).
    pub socket_policies: Policies,
    /// The same for the `tc` frontends.
    pub tc_policies: Policies,
    /// The Maglev table sizes of `tc` frontends whose Service's annotation
    /// sets one (the others get the agent's default).
    pub maglev_sizes: BTreeMap<Frontend, crate::decide::maglev::TableSize>,
    /// TC frontends with externalTrafficPolicy: Local (dropped, not
    /// rejected, without a local endpoint).
    pub policy_local: BTreeSet<Frontend>,
    /// Endpoint addresses on this node: traffic to them needs no SNAT.
    pub local_endpoints: BTreeSet<std::net::IpAddr>,
    /// The health check node ports of externalTrafficPolicy: Local Services, which cloud load balancers probe to find the nodes with a local endpoint.
    pub health_checks: Vec<HealthCheck>,
    /// External frontends left out, for the log: one claimed by two Services keeps the first.
    pub problems: Vec<String>,
}

/// What the external frontends call for, from every port's decision: ClusterIP frontends keep the socket map's entries when an external address clashes with one.
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
            if !out.socket.contains_key(fe) {
                out.socket.insert(*fe, of_family(&d.cluster, fe));
                let p = d.frontend_policy(fe, node_addrs, false);
                if !p.is_default() {
                    out.socket_policies.insert(*fe, p);
                }
            }
        }
        for fe in &external {
            if out.tc.contains_key(fe) {
                continue; // already reported above
            }
            out.tc.insert(*fe, of_family(d.external_backends(), fe));
            let p = d.frontend_policy(fe, node_addrs, true);
            if !p.is_default() {
                out.tc_policies.insert(*fe, p);
            }
            if d.external_local {
                out.policy_local.insert(*fe);
            }
            if let Some(size) = d.maglev_size {
                out.maglev_sizes.insert(*fe, size);
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
    use super::super::decide;
    use super::super::tests::cluster;
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
