//! The agent's own picture of the cluster: Services, EndpointSlices and
//! Nodes reduced to the fields that routing decisions need.
//!
//! These types are plain data. They are built from Kubernetes objects by
//! `objects.rs` (manifests or the API server) and consumed by the pure
//! decision code (`topology.rs`, `decision.rs`, `plan.rs`), which therefore
//! never sees kube, aya or tokio types.

pub mod store;

use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;

/// Transport protocol of a Service port. Kubernetes also has SCTP; the
/// socket datapath does not translate it, so such ports are reported and
/// skipped when objects are converted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Protocol {
    Tcp,
    Udp,
}

impl Protocol {
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// IP family of an address or of an EndpointSlice (`addressType`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    pub fn of(ip: &IpAddr) -> Family {
        match ip {
            IpAddr::V4(_) => Family::V4,
            IpAddr::V6(_) => Family::V6,
        }
    }
}

/// `namespace/name` of a namespaced object.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectRef {
    pub namespace: String,
    pub name: String,
}

impl ObjectRef {
    pub fn new(namespace: impl Into<String>, name: impl Into<String>) -> Self {
        ObjectRef { namespace: namespace.into(), name: name.into() }
    }
}

impl fmt::Display for ObjectRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// `spec.type` of a Service. Headless and ExternalName Services never reach
/// the model (they have nothing to translate).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ServiceType {
    ClusterIp,
    NodePort,
    LoadBalancer,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServicePort {
    /// Port name; empty for a Service's single unnamed port. EndpointSlice
    /// ports are matched to Service ports by this name.
    pub name: String,
    pub port: u16,
    pub protocol: Protocol,
    pub node_port: Option<u16>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Service {
    pub id: ObjectRef,
    pub service_type: ServiceType,
    /// `spec.clusterIPs` (or `spec.clusterIP`), primary family first.
    pub cluster_ips: Vec<IpAddr>,
    pub ports: Vec<ServicePort>,
    /// `spec.topologyKeys` exactly as the object carried it (the field
    /// existed from 1.17 to 1.21 and is gone from today's typed clients, so
    /// it is read from the raw object). `None` when absent.
    pub topology_keys: Option<Vec<String>>,
    pub annotations: BTreeMap<String, String>,
    /// `spec.internalTrafficPolicy == Local`.
    pub internal_policy_local: bool,
    /// `spec.externalTrafficPolicy == Local` (spelled `Local`; older
    /// clusters also accepted `OnlyLocal`).
    pub external_policy_local: bool,
    /// `spec.trafficDistribution`, verbatim.
    pub traffic_distribution: Option<String>,
    /// `spec.externalIPs` and `status.loadBalancer.ingress[].ip`.
    pub external_ips: Vec<IpAddr>,
    pub load_balancer_ips: Vec<IpAddr>,
    pub health_check_node_port: Option<u16>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlicePort {
    /// Empty when the Service port is unnamed.
    pub name: String,
    pub port: u16,
    pub protocol: Protocol,
}

/// One endpoint of an EndpointSlice, with the API's defaults applied:
/// a missing `ready` means ready, a missing `serving` means the value of
/// `ready`, a missing `terminating` means not terminating
/// (discovery.k8s.io/v1 EndpointConditions).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    /// Kubernetes allows several addresses but consumers use only the
    /// first (the API documents them as fungible); the model keeps the first.
    pub address: IpAddr,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    /// Node names, zones and hints repeat across endpoints: each is one
    /// shared copy (`intern`), which with the boxed slices keeps an
    /// endpoint at 88 bytes (100k endpoints at 10k Services).
    pub node_name: Option<Arc<str>>,
    pub zone: Option<Arc<str>>,
    /// `hints.forZones[].name`; `None` when the endpoint carries no zone hint.
    pub hint_zones: Option<Box<[Arc<str>]>>,
    /// `hints.forNodes[].name`; `None` when the endpoint carries no node hint.
    pub hint_nodes: Option<Box<[Arc<str>]>>,
}

const _: () = assert!(std::mem::size_of::<Endpoint>() <= 88);

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointSlice {
    pub id: ObjectRef,
    /// The owning Service's name from the `kubernetes.io/service-name` label.
    pub service_name: String,
    pub family: Family,
    pub ports: Vec<SlicePort>,
    pub endpoints: Vec<Endpoint>,
}

#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Node {
    pub name: String,
    pub labels: BTreeMap<String, String>,
}

/// Everything one agent knows, keyed for deterministic iteration.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Cluster {
    pub services: BTreeMap<ObjectRef, Service>,
    pub slices: BTreeMap<ObjectRef, EndpointSlice>,
    pub nodes: BTreeMap<String, Node>,
}

impl Cluster {
    /// The slices that belong to a Service (same namespace, service-name label).
    pub fn slices_of<'a>(&'a self, svc: &'a ObjectRef) -> impl Iterator<Item = &'a EndpointSlice> + 'a {
        self.slices.values().filter(move |s| s.id.namespace == svc.namespace && s.service_name == svc.name)
    }
}

/// What a client dials: one (address, port, protocol) of a Service.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Frontend {
    pub ip: IpAddr,
    pub port: u16,
    pub protocol: Protocol,
}

impl fmt::Display for Frontend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", std::net::SocketAddr::new(self.ip, self.port), self.protocol)
    }
}

/// Where a connection is sent: an endpoint address and the slice's port.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Backend {
    pub ip: IpAddr,
    pub port: u16,
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", std::net::SocketAddr::new(self.ip, self.port))
    }
}
