//! The agent's own picture of the cluster: Services, EndpointSlices and
//! Nodes reduced to the fields that routing decisions need.
//!
//! These types are plain data. They are built from Kubernetes objects by
//! `objects.rs` (manifests or the API server) and consumed by the pure
//! decision code (`topology.rs`, `decision.rs`, `plan.rs`), which therefore
//! never sees kube, aya or tokio types.

mod port_label;
pub mod store;

pub use port_label::PortLabel;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;

/// Transport protocol of a Service port. Kubernetes also has SCTP; the
/// socket datapath does not translate it, so such ports are reported and
/// skipped when objects are converted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Protocol {
    /// TCP.
    Tcp,
    /// UDP.
    Udp,
}

impl Protocol {
    /// The protocol as Kubernetes spells it (`TCP`, `UDP`), for logs, Events and metric labels.
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
    /// IPv4.
    V4,
    /// IPv6.
    V6,
}

impl Family {
    /// The family of an address.
    pub fn of(ip: &IpAddr) -> Family {
        match ip {
            IpAddr::V4(_) => Family::V4,
            IpAddr::V6(_) => Family::V6,
        }
    }

    /// `IPv4` or `IPv6`, as an EndpointSlice's `addressType` names it.
    pub fn as_str(self) -> &'static str {
        match self {
            Family::V4 => "IPv4",
            Family::V6 => "IPv6",
        }
    }
}

/// `namespace/name` of a namespaced object. Both are shared copies: the
/// model, the decision cache and the sync pass each key their maps by the
/// ids of every Service and slice (a dozen copies of each), and two heap
/// strings per copy were a fifth of the agent's memory at 100k Services.
/// A clone costs no allocation; sources intern the namespace.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ObjectRef {
    /// `metadata.namespace`.
    pub namespace: Arc<str>,
    /// `metadata.name`.
    pub name: Arc<str>,
}

/// Namespace, then name, as the derived order; a shared copy compares
/// equal without reading it (namespaces are interned, and the maps keyed
/// by ids mostly hold the model's own copies).
impl Ord for ObjectRef {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        fn cmp(a: &Arc<str>, b: &Arc<str>) -> std::cmp::Ordering {
            if Arc::ptr_eq(a, b) { std::cmp::Ordering::Equal } else { a.cmp(b) }
        }
        cmp(&self.namespace, &other.namespace).then_with(|| cmp(&self.name, &other.name))
    }
}

impl PartialOrd for ObjectRef {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl ObjectRef {
    /// An id from a namespace and a name.
    pub fn new(namespace: impl Into<Arc<str>>, name: impl Into<Arc<str>>) -> Self {
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
    /// `ClusterIP`: a virtual address for clients in the cluster (and any `spec.externalIPs`).
    ClusterIp,
    /// `NodePort`: also reachable on the node's addresses at `nodePort`.
    NodePort,
    /// `LoadBalancer`: a NodePort whose load balancer addresses are translated too.
    LoadBalancer,
}

/// One entry of a Service's `spec.ports`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServicePort {
    /// Port name; empty for a Service's single unnamed port. EndpointSlice
    /// ports are matched to Service ports by this name.
    pub name: String,
    /// `port`: the port the frontends listen on.
    pub port: u16,
    /// `protocol`.
    pub protocol: Protocol,
    /// `nodePort`, for NodePort and LoadBalancer Services (absent with `allocateLoadBalancerNodePorts: false`).
    pub node_port: Option<u16>,
}

/// A Service, reduced to what the datapath translates.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Service {
    /// Namespace and name.
    pub id: ObjectRef,
    /// `spec.type`.
    pub service_type: ServiceType,
    /// `spec.clusterIPs` (or `spec.clusterIP`), primary family first.
    pub cluster_ips: Vec<IpAddr>,
    /// `spec.ports` whose protocol the datapath translates.
    pub ports: Vec<ServicePort>,
    /// `spec.topologyKeys` exactly as the object carried it (the field
    /// existed from 1.17 to 1.21 and is gone from today's typed clients, so
    /// it is read from the raw object). `None` when absent.
    pub topology_keys: Option<Vec<String>>,
    /// `metadata.annotations`, for the topology models that read one (e.g. `service.kubernetes.io/topology-mode`).
    pub annotations: BTreeMap<String, String>,
    /// `spec.internalTrafficPolicy == Local`.
    pub internal_policy_local: bool,
    /// `spec.externalTrafficPolicy == Local` (spelled `Local`; older
    /// clusters also accepted `OnlyLocal`).
    pub external_policy_local: bool,
    /// `spec.trafficDistribution`, verbatim.
    pub traffic_distribution: Option<String>,
    /// `spec.externalIPs`.
    pub external_ips: Vec<IpAddr>,
    /// `status.loadBalancer.ingress[].ip`. An ingress IP with `ipMode:
    /// Proxy` is not among them: the cloud's load balancer proxies such
    /// traffic to the node itself, so the address must reach it
    /// untranslated (KEP-1860).
    pub load_balancer_ips: Vec<IpAddr>,
    /// `spec.healthCheckNodePort`: the port of kube-proxy's health check for `externalTrafficPolicy: Local`, served by the agent.
    pub health_check_node_port: Option<u16>,
    /// `spec.sessionAffinity: ClientIP`, with its timeout in seconds
    /// (`sessionAffinityConfig.clientIP.timeoutSeconds`, 10800 unless set).
    /// `None`: no affinity.
    pub session_affinity: Option<u32>,
    /// `spec.loadBalancerSourceRanges`, the entries that parse. `None` when
    /// the field is empty (no filter); an empty list when no entry parses,
    /// which lets no client in (the filter fails closed).
    pub load_balancer_source_ranges: Option<Vec<Cidr>>,
}

/// An address range, `addr/prefix_len`, with the host bits cleared.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Cidr {
    /// The first address of the range, host bits cleared.
    pub addr: IpAddr,
    /// The prefix length, at most 32 (IPv4) or 128 (IPv6).
    pub prefix_len: u8,
}

impl Cidr {
    /// Parses `10.0.0.0/8` or `fd00::/64` (surrounding whitespace allowed).
    /// Host bits are cleared, as Go's `net.ParseCIDR`, which Kubernetes
    /// validates the field with, does (`10.1.2.3/8` is `10.0.0.0/8`).
    pub fn parse(s: &str) -> Option<Cidr> {
        let (ip, len) = s.trim().split_once('/')?;
        let addr: IpAddr = ip.parse().ok()?;
        let prefix_len: u8 = len.parse().ok()?;
        let bits = match addr {
            IpAddr::V4(_) => 32,
            IpAddr::V6(_) => 128,
        };
        if prefix_len > bits {
            return None;
        }
        Some(Cidr { addr: Self::masked(addr, prefix_len), prefix_len })
    }

    /// Whether `ip` lies inside the range (never across families).
    pub fn contains(&self, ip: &IpAddr) -> bool {
        Family::of(ip) == Family::of(&self.addr) && Self::masked(*ip, self.prefix_len) == self.addr
    }

    fn masked(ip: IpAddr, prefix_len: u8) -> IpAddr {
        match ip {
            IpAddr::V4(v4) => {
                let mask = u32::MAX.checked_shl(32 - u32::from(prefix_len)).unwrap_or(0);
                IpAddr::V4((u32::from(v4) & mask).into())
            }
            IpAddr::V6(v6) => {
                let mask = u128::MAX.checked_shl(128 - u32::from(prefix_len)).unwrap_or(0);
                IpAddr::V6((u128::from(v6) & mask).into())
            }
        }
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix_len)
    }
}

/// One entry of an EndpointSlice's `ports`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlicePort {
    /// Empty when the Service port is unnamed.
    pub name: String,
    /// The port on the endpoints.
    pub port: u16,
    /// `protocol`.
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
    /// `conditions.ready` (defaults to true).
    pub ready: bool,
    /// `conditions.serving` (defaults to `ready`): still answering, also while terminating (KEP-1669).
    pub serving: bool,
    /// `conditions.terminating` (defaults to false).
    pub terminating: bool,
    /// Node names, zones and hints repeat across endpoints: each is one
    /// shared copy (`intern`).
    pub node_name: Option<Arc<str>>,
    /// `zone` (the node's `topology.kubernetes.io/zone` as the EndpointSlice controller copied it).
    pub zone: Option<Arc<str>>,
    /// Hints and reported node labels, which most endpoints do not carry:
    /// kept apart (`None` when the endpoint has none of them), so that an
    /// endpoint is 64 bytes instead of 96 (1M endpoints at 100k Services).
    /// Read through [`Endpoint::hint_zones`] and the like; set through
    /// [`Endpoint::edit_extra`].
    pub extra: Option<Box<EndpointExtra>>,
}

/// What few endpoints carry besides their address, conditions, node and
/// zone.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EndpointExtra {
    /// `hints.forZones[].name`; `None` when the endpoint carries no zone hint.
    pub hint_zones: Option<Box<[Arc<str>]>>,
    /// `hints.forNodes[].name`; `None` when the endpoint carries no node hint.
    pub hint_nodes: Option<Box<[Arc<str>]>>,
    /// Labels of the endpoint's node that its EndpointSlice reported beside
    /// `node_name` and `zone`: what is left of discovery.k8s.io/v1beta1's
    /// `topology` map (Kubernetes 1.17-1.24; the EndpointSlice controller
    /// copied the Node's hostname, zone and region labels into it) once
    /// those two are taken out, which v1 serves as `deprecatedTopology`.
    /// Topology decisions read it only for an endpoint whose Node the agent
    /// does not know. `None` for endpoints written through v1; shared by
    /// the endpoints of a slice that report the same labels.
    pub topology: Option<Arc<NodeTopology>>,
}

impl EndpointExtra {
    /// Boxed, unless it carries nothing.
    pub fn boxed(self) -> Option<Box<EndpointExtra>> {
        (self != EndpointExtra::default()).then(|| Box::new(self))
    }
}

impl Endpoint {
    /// `hints.forZones[].name`; `None` when the endpoint carries no zone hint.
    pub fn hint_zones(&self) -> Option<&[Arc<str>]> {
        self.extra.as_ref()?.hint_zones.as_deref()
    }

    /// `hints.forNodes[].name`; `None` when the endpoint carries no node hint.
    pub fn hint_nodes(&self) -> Option<&[Arc<str>]> {
        self.extra.as_ref()?.hint_nodes.as_deref()
    }

    /// The node labels its EndpointSlice reported ([`EndpointExtra::topology`]).
    pub fn topology(&self) -> Option<&Arc<NodeTopology>> {
        self.extra.as_ref()?.topology.as_ref()
    }

    /// Changes the extra fields; none left set is the same as none set.
    pub fn edit_extra(&mut self, f: impl FnOnce(&mut EndpointExtra)) {
        let mut extra = self.extra.take().map(|b| *b).unwrap_or_default();
        f(&mut extra);
        self.extra = extra.boxed();
    }
}

/// Well-known node label carrying the node's hostname (`v1.LabelHostname`).
pub const LABEL_HOSTNAME: &str = "kubernetes.io/hostname";
/// Well-known node label carrying the node's zone (`v1.LabelTopologyZone`).
pub const LABEL_ZONE: &str = "topology.kubernetes.io/zone";

/// Node labels as an EndpointSlice reports them (label key to value).
pub type NodeTopology = BTreeMap<Arc<str>, Arc<str>>;

/// What the source must watch of other Nodes for the Services' topology
/// (`decide::topology::other_nodes_needed`).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct OtherNodes {
    /// The labels read that EndpointSlices do not carry; empty: other
    /// Nodes are not watched at all.
    pub labels: BTreeSet<String>,
    /// The Nodes whose labels are read: those hosting an endpoint of a
    /// Service that needs labels. `None`: every Node (too many to name in
    /// one label selector, or names that cannot be selected by their
    /// hostname label).
    pub names: Option<BTreeSet<String>>,
}

impl OtherNodes {
    /// Whether any other Node must be watched.
    pub fn any(&self) -> bool {
        !self.labels.is_empty() && self.names.as_ref().is_none_or(|n| !n.is_empty())
    }
}

const _: () = assert!(std::mem::size_of::<Endpoint>() <= 64);

/// An EndpointSlice of a Service, reduced to what routing needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointSlice {
    /// Namespace and name.
    pub id: ObjectRef,
    /// The owning Service's name from the `kubernetes.io/service-name` label.
    pub service_name: String,
    /// `addressType`: IPv4 or IPv6 (FQDN slices are skipped).
    pub family: Family,
    /// `ports`.
    pub ports: Vec<SlicePort>,
    /// `endpoints`.
    pub endpoints: Vec<Endpoint>,
}

/// A Node: its name and labels, and whether it is going away.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Node {
    /// `metadata.name`.
    pub name: String,
    /// Its labels, each key and value one shared copy (`intern`). This
    /// node's Node has every label; other Nodes, watched metadata-only and
    /// only while a Service's topology needs them, only the labels in use
    /// (`decide::topology::other_node_labels`, plus hostname and zone).
    pub labels: NodeTopology,
    /// Why the node is going away, when it is: `metadata.deletionTimestamp`
    /// is set, or the cluster autoscaler tainted it
    /// `ToBeDeletedByClusterAutoscaler` before removing it (kube-proxy's
    /// `SyncNode`, KEP-3836). Only this node's own health reads it; no
    /// routing decision does.
    pub leaving: Option<&'static str>,
}

/// Everything one agent knows, keyed for deterministic iteration.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Cluster {
    /// Services by namespace and name.
    pub services: BTreeMap<ObjectRef, Service>,
    /// EndpointSlices by namespace and name.
    pub slices: BTreeMap<ObjectRef, EndpointSlice>,
    /// Nodes by name: this node, and others while a Service's topology needs their labels.
    pub nodes: BTreeMap<String, Node>,
}

impl Cluster {
    /// The slices that belong to a Service (same namespace, service-name label).
    pub fn slices_of<'a>(&'a self, svc: &'a ObjectRef) -> impl Iterator<Item = &'a EndpointSlice> + 'a {
        self.slices.values().filter(move |s| s.id.namespace == svc.namespace && *s.service_name == *svc.name)
    }
}

/// What a client dials: one (address, port, protocol) of a Service.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Frontend {
    /// The address (a ClusterIP, external IP, load balancer IP or node address).
    pub ip: IpAddr,
    /// The port.
    pub port: u16,
    /// The protocol.
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
    /// The endpoint's address.
    pub ip: IpAddr,
    /// The slice's port for the Service port.
    pub port: u16,
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", std::net::SocketAddr::new(self.ip, self.port))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cidrs_parse_like_kubernetes_and_match_their_family_only() {
        // (text, parsed, an address inside, an address outside)
        let cases = [
            ("10.0.0.0/8", Some("10.0.0.0/8"), "10.255.1.2", "11.0.0.1"),
            (" 10.1.2.3/8 ", Some("10.0.0.0/8"), "10.0.0.1", "192.0.2.1"),
            ("192.0.2.7/32", Some("192.0.2.7/32"), "192.0.2.7", "192.0.2.8"),
            ("0.0.0.0/0", Some("0.0.0.0/0"), "203.0.113.9", "::1"),
            ("fd00::1/64", Some("fd00::/64"), "fd00::ffff", "fd01::1"),
            ("::/0", Some("::/0"), "2001:db8::1", "10.0.0.1"),
        ];
        for (text, want, inside, outside) in cases {
            let c = Cidr::parse(text).unwrap_or_else(|| panic!("{text} did not parse"));
            assert_eq!(Some(c.to_string().as_str()), want, "{text}");
            assert!(c.contains(&inside.parse().unwrap()), "{text} contains {inside}");
            assert!(!c.contains(&outside.parse().unwrap()), "{text} does not contain {outside}");
        }
        for bad in ["10.0.0.0", "10.0.0.0/33", "fd00::/129", "10.0.0/8", "x/8", "10.0.0.0/-1", "10.0.0.0/8/8", ""] {
            assert_eq!(Cidr::parse(bad), None, "{bad}");
        }
    }
}
