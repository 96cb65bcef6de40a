//! The one decision path shared by `run` and `explain`: for every Service
//! port, which frontends exist and which backends this node sends them to.
//! Pure: it reads the model and calls the topology ranking.

use std::collections::{BTreeMap, BTreeSet};

use crate::model::{Backend, Cluster, Endpoint, Family, Frontend, ObjectRef, ServicePort};
use crate::topology::{self, NodeContext};

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
    /// Problems found in the Service's configuration, to be reported with
    /// its name.
    pub problems: Vec<String>,
}

impl PortDecision {
    /// The backends ClusterIP traffic from this node may use.
    pub fn internal_backends(&self) -> &[Backend] {
        if self.internal_local { &self.local } else { &self.cluster }
    }
}

/// Decides every Service port of the cluster for node `node`.
pub fn decide(cluster: &Cluster, node: &str) -> Vec<PortDecision> {
    let ctx = NodeContext { name: node, nodes: &cluster.nodes };
    let mut out = Vec::new();
    for svc in cluster.services.values() {
        for port in &svc.ports {
            // Endpoints of this port: slice ports are matched to Service
            // ports by name and protocol (discovery.k8s.io/v1 EndpointPort).
            let mut seen = BTreeSet::new();
            let mut endpoints: Vec<&Endpoint> = Vec::new();
            let mut ports: Vec<u16> = Vec::new();
            for slice in cluster.slices_of(&svc.id) {
                let Some(sp) = slice
                    .ports
                    .iter()
                    .find(|p| p.name == port.name && p.protocol == port.protocol)
                else {
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
                let mut v: Vec<Backend> = idx
                    .iter()
                    .filter_map(|&i| Some(Backend { ip: endpoints.get(i)?.address, port: *ports.get(i)? }))
                    .collect();
                v.sort();
                v
            };
            out.push(PortDecision {
                service: svc.id.clone(),
                port: port.clone(),
                frontends: svc
                    .cluster_ips
                    .iter()
                    .map(|ip| Frontend { ip: *ip, port: port.port, protocol: port.protocol })
                    .collect(),
                model: ranking.model.as_str(),
                decision: ranking.decision,
                cluster: to_backends(&ranking.cluster),
                local: to_backends(&ranking.local),
                internal_local: svc.internal_policy_local,
                problems: ranking.problems,
            });
        }
    }
    out
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
            let set: BTreeSet<Backend> = d
                .internal_backends()
                .iter()
                .filter(|b| Family::of(&b.ip) == fam)
                .copied()
                .collect();
            out.insert(*fe, set);
        }
    }
    (out, clashes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::parse_into;
    use crate::objects::build_cluster;

    fn cluster(yaml: &str) -> Cluster {
        let mut docs = Vec::new();
        let mut errs = Vec::new();
        parse_into("t.yaml", yaml, &mut docs, &mut errs);
        assert!(errs.is_empty(), "{errs:?}");
        let (c, e) = build_cluster(&docs);
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
