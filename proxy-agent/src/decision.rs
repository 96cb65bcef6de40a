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
/// backends of its own family.
pub fn desired_state(decisions: &[PortDecision]) -> BTreeMap<Frontend, BTreeSet<Backend>> {
    let mut out = BTreeMap::new();
    for d in decisions {
        for fe in &d.frontends {
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
    out
}
