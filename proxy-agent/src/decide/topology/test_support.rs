//! Builders and the table runner shared by the models' tests: every table
//! goes through [`rank`], so each case checks the model that decided, both
//! endpoint sets, the problems and the decision text together.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};

use super::{Model, NodeContext, rank};
use crate::model::{Endpoint, Node, ObjectRef, Service, ServiceType};

pub(super) fn svc() -> Service {
    Service {
        id: ObjectRef::new("default", "svc1"),
        service_type: ServiceType::ClusterIp,
        cluster_ips: vec![IpAddr::V4(Ipv4Addr::new(10, 96, 0, 10))],
        ports: Vec::new(),
        topology_keys: None,
        annotations: BTreeMap::new(),
        internal_policy_local: false,
        external_policy_local: false,
        traffic_distribution: None,
        external_ips: Vec::new(),
        load_balancer_ips: Vec::new(),
        health_check_node_port: None,
        session_affinity: None,
        load_balancer_source_ranges: None,
    }
}

pub(super) trait SvcExt {
    fn keys(self, keys: &[&str]) -> Self;
    fn ann(self, k: &str, v: &str) -> Self;
    fn td(self, v: &str) -> Self;
    fn itp_local(self) -> Self;
    fn etp_local(self) -> Self;
}

impl SvcExt for Service {
    fn keys(mut self, keys: &[&str]) -> Self {
        self.topology_keys = Some(keys.iter().map(std::string::ToString::to_string).collect());
        self
    }
    fn ann(mut self, k: &str, v: &str) -> Self {
        self.annotations.insert(k.to_string(), v.to_string());
        self
    }
    fn td(mut self, v: &str) -> Self {
        self.traffic_distribution = Some(v.to_string());
        self
    }
    fn itp_local(mut self) -> Self {
        self.internal_policy_local = true;
        self
    }
    fn etp_local(mut self) -> Self {
        self.external_policy_local = true;
        self.service_type = ServiceType::NodePort;
        self
    }
}

/// A ready endpoint 10.0.0.`n` on `node` (`""`: no nodeName).
pub(super) fn ep(n: u8, node: &str) -> Endpoint {
    Endpoint {
        address: IpAddr::V4(Ipv4Addr::new(10, 0, 0, n)),
        ready: true,
        serving: true,
        terminating: false,
        node_name: (!node.is_empty()).then(|| node.into()),
        zone: None,
        extra: None,
    }
}

pub(super) trait EpExt {
    fn unready(self) -> Self;
    /// Not ready, serving, terminating.
    fn term(self) -> Self;
    /// Not ready, not serving, terminating.
    fn gone(self) -> Self;
    fn zone(self, z: &str) -> Self;
    fn zh(self, zones: &[&str]) -> Self;
    fn nh(self, nodes: &[&str]) -> Self;
    /// Node labels the EndpointSlice reported (v1beta1 `topology`).
    fn topo(self, labels: &[(&str, &str)]) -> Self;
}

impl EpExt for Endpoint {
    fn unready(mut self) -> Self {
        self.ready = false;
        self.serving = false;
        self
    }
    fn term(mut self) -> Self {
        self.ready = false;
        self.serving = true;
        self.terminating = true;
        self
    }
    fn gone(mut self) -> Self {
        self.ready = false;
        self.serving = false;
        self.terminating = true;
        self
    }
    fn zone(mut self, z: &str) -> Self {
        self.zone = Some(z.into());
        self
    }
    fn zh(mut self, zones: &[&str]) -> Self {
        self.edit_extra(|x| x.hint_zones = Some(zones.iter().map(|z| (*z).into()).collect()));
        self
    }
    fn nh(mut self, nodes: &[&str]) -> Self {
        self.edit_extra(|x| x.hint_nodes = Some(nodes.iter().map(|z| (*z).into()).collect()));
        self
    }
    fn topo(mut self, labels: &[(&str, &str)]) -> Self {
        self.edit_extra(|x| x.topology = Some(std::sync::Arc::new(labels.iter().map(|(k, v)| ((*k).into(), (*v).into())).collect())));
        self
    }
}

pub(super) fn node(name: &str, labels: &[(&str, &str)]) -> Node {
    Node { name: name.to_string(), labels: labels.iter().map(|(k, v)| ((*k).into(), (*v).into())).collect(), leaving: None }
}

pub(super) const REGION: &str = "topology.kubernetes.io/region";

pub(super) struct Case {
    pub(super) name: &'static str,
    pub(super) svc: Service,
    pub(super) nodes: Vec<Node>,
    pub(super) this: &'static str,
    pub(super) eps: Vec<Endpoint>,
    pub(super) model: Model,
    pub(super) cluster: Vec<usize>,
    pub(super) local: Vec<usize>,
    /// How many problems are reported.
    pub(super) problems: usize,
    /// Substrings the decision must contain.
    pub(super) says: Vec<&'static str>,
}

impl Default for Case {
    fn default() -> Self {
        Case {
            name: "",
            svc: svc(),
            nodes: Vec::new(),
            this: "n1",
            eps: Vec::new(),
            model: Model::Cluster,
            cluster: Vec::new(),
            local: Vec::new(),
            problems: 0,
            says: Vec::new(),
        }
    }
}

pub(super) fn run(cases: Vec<Case>) {
    for c in cases {
        let nodes: BTreeMap<String, Node> = c.nodes.into_iter().map(|n| (n.name.clone(), n)).collect();
        let refs: Vec<&Endpoint> = c.eps.iter().collect();
        let r = rank(&c.svc, &refs, NodeContext { name: c.this, nodes: &nodes });
        assert_eq!(r.model, c.model, "{}: model ({})", c.name, r.decision);
        assert_eq!(r.cluster, c.cluster, "{}: cluster ({})", c.name, r.decision);
        assert_eq!(r.local, c.local, "{}: local ({})", c.name, r.decision);
        assert_eq!(r.problems.len(), c.problems, "{}: problems {:?}", c.name, r.problems);
        for s in &c.says {
            assert!(r.decision.contains(s), "{}: decision {:?} lacks {:?}", c.name, r.decision, s);
        }
    }
}
