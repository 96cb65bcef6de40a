//! Turning Kubernetes objects (as JSON) into the model, with the checks the
//! API server would have made on what the datapath relies on. An object that
//! fails is reported with its kind, name and the reason, and left out; the
//! rest of the cluster is built as usual.

use std::net::IpAddr;
use std::sync::Arc;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::Deserialize;
use serde_json::Value;

use crate::model::store::ObjectError;
use crate::model::{
    Cidr, Endpoint, EndpointExtra, EndpointSlice, Family, Node, NodeTopology, ObjectRef, Protocol, Service, ServicePort, ServiceType,
    SlicePort,
};
use crate::source::wire::{FirstAddress, WireNode, WireService, WireSlice};
use crate::source::wire_v1beta1::WireSliceV1beta1;
use crate::util::intern::intern;

/// Label that ties an EndpointSlice to its Service (discovery.k8s.io/v1).
pub(crate) const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// Services labelled with this belong to another proxy (kube-proxy honours
/// it too, pkg/proxy/config).
pub(crate) const SERVICE_PROXY_NAME_LABEL: &str = "service.kubernetes.io/service-proxy-name";
/// Marks a Service whose endpoints are consumed only through DNS.
pub(crate) const HEADLESS_LABEL: &str = "service.kubernetes.io/headless";
/// The taint the cluster autoscaler puts on a node it is about to remove
/// (kube-proxy's `ToBeDeletedTaint`, pkg/proxy/healthcheck).
pub(crate) const TO_BE_DELETED_TAINT: &str = "ToBeDeletedByClusterAutoscaler";

/// `sessionAffinityConfig.clientIP.timeoutSeconds` when unset, and the
/// largest the API server accepts (core/v1
/// `DefaultClientIPServiceAffinitySeconds`, `MaxClientIPServiceAffinitySeconds`).
pub(crate) const DEFAULT_AFFINITY_TIMEOUT_S: u32 = 10_800;
pub(crate) const MAX_AFFINITY_TIMEOUT_S: u32 = 86_400;

/// What happened to one object.
#[derive(Debug)]
pub(crate) enum Converted<T> {
    Ok(T),
    /// Deliberately not handled by this proxy (headless, ExternalName,
    /// another proxy's Service, FQDN slices); not an error.
    Ignored(&'static str),
}

/// Namespace and name of an object given as JSON; no (or an empty)
/// namespace means "default". The namespace is interned: a cluster has few,
/// and every object id names one.
pub(crate) fn object_ref(v: &Value) -> (Arc<str>, String) {
    let meta = v.get("metadata");
    let ns = meta.and_then(|m| m.get("namespace")).and_then(Value::as_str).filter(|n| !n.is_empty()).unwrap_or("default");
    let name = meta.and_then(|m| m.get("name")).and_then(Value::as_str).unwrap_or_default();
    (intern(ns), name.to_string())
}

/// [`object_ref`] for deserialized metadata.
pub(crate) fn meta_ref(m: &ObjectMeta) -> (Arc<str>, String) {
    let ns = m.namespace.as_deref().filter(|n| !n.is_empty()).unwrap_or("default");
    (intern(ns), m.name.clone().unwrap_or_default())
}

fn fail(kind: &str, ns: &str, name: &str, reason: impl Into<String>) -> ObjectError {
    let object = if name.is_empty() { String::new() } else { format!("{ns}/{name}") };
    ObjectError { kind: kind.into(), object, reason: reason.into() }
}

fn parse_ip(s: &str) -> Option<IpAddr> {
    s.trim().parse().ok()
}

fn port_u16(p: i32) -> Option<u16> {
    u16::try_from(p).ok().filter(|p| *p != 0)
}

fn protocol(p: Option<&str>) -> Result<Protocol, String> {
    match p.unwrap_or("TCP") {
        "TCP" => Ok(Protocol::Tcp),
        "UDP" => Ok(Protocol::Udp),
        other => Err(format!("protocol {other} is not supported (TCP and UDP are)")),
    }
}

/// What converting one object gives: the object (or why it is ignored)
/// with the problems of its parts, or why it was left out as a whole.
pub(crate) type Conversion<T> = Result<(Converted<T>, Vec<ObjectError>), ObjectError>;

/// Converts a Service. Headless, ExternalName and other proxies' Services
/// are `Ignored`. Problems confined to one port (a protocol the datapath
/// cannot translate) are returned beside the Service, whose other ports
/// keep working; problems with the Service as a whole are the `Err`.
pub(crate) fn service_from_json(v: &Value) -> Conversion<Service> {
    from_json("Service", v, service_from_wire)
}

/// An object given as JSON: its name checked, deserialized into its wire
/// shape `W`, converted by `convert` (as the watchers' objects are).
fn from_json<'v, W: Deserialize<'v>, T>(kind: &str, v: &'v Value, convert: fn(W) -> Conversion<T>) -> Conversion<T> {
    let (ns, name) = object_ref(v);
    if name.is_empty() {
        return Err(fail(kind, &ns, &name, "metadata.name is missing"));
    }
    // Deserialized from the borrowed value: a clone of the whole object
    // per Service cost more than the conversion at 10k Services.
    let wire = W::deserialize(v).map_err(|e| fail(kind, &ns, &name, format!("malformed: {e}")))?;
    convert(wire)
}

/// Why an object is not this proxy's to serve, if it is not: labelled for
/// another proxy, or headless. kube-proxy's informers apply the same
/// selector (`!service-proxy-name,!headless`) to Services and EndpointSlices
/// alike (cmd/kube-proxy/app/server.go: one informer factory), and so does
/// the watch here (`kube_watch::SERVICE_LABEL_SELECTOR`); manifests come
/// through this check only.
fn left_to_others(meta: &ObjectMeta) -> Option<&'static str> {
    let labels = meta.labels.as_ref()?;
    if labels.contains_key(SERVICE_PROXY_NAME_LABEL) {
        Some("served by another proxy")
    } else if labels.contains_key(HEADLESS_LABEL) {
        Some("headless")
    } else {
        None
    }
}

/// [`service_from_json`] for a Service the watcher deserialized.
pub(crate) fn service_from_wire(svc: WireService) -> Conversion<Service> {
    const K: &str = "Service";
    let (ns, name) = meta_ref(&svc.metadata);
    if name.is_empty() {
        return Err(fail(K, &ns, &name, "metadata.name is missing"));
    }
    if let Some(why) = left_to_others(&svc.metadata) {
        return Ok((Converted::Ignored(why), Vec::new()));
    }
    let mut spec = svc.spec.unwrap_or_default();
    let service_type = match spec.type_.as_deref().unwrap_or("ClusterIP") {
        "ClusterIP" => ServiceType::ClusterIp,
        "NodePort" => ServiceType::NodePort,
        "LoadBalancer" => ServiceType::LoadBalancer,
        "ExternalName" => return Ok((Converted::Ignored("ExternalName"), Vec::new())),
        other => return Err(fail(K, &ns, &name, format!("spec.type {other} is unknown"))),
    };
    let mut ip_strings: Vec<String> = spec.cluster_ips.clone().unwrap_or_default();
    if ip_strings.is_empty()
        && let Some(ip) = spec.cluster_ip.clone()
    {
        ip_strings.push(ip);
    }
    if ip_strings.iter().any(|s| s == "None") {
        return Ok((Converted::Ignored("headless"), Vec::new()));
    }
    if ip_strings.is_empty() || ip_strings.iter().all(std::string::String::is_empty) {
        return Err(fail(K, &ns, &name, "has no spec.clusterIP (the API server allocates one; manifests must carry it)"));
    }
    let mut cluster_ips = Vec::new();
    for s in &ip_strings {
        let ip = parse_ip(s).ok_or_else(|| fail(K, &ns, &name, format!("spec.clusterIPs: {s:?} is not an IP address")))?;
        if !cluster_ips.contains(&ip) {
            cluster_ips.push(ip);
        }
    }
    let mut ports = Vec::new();
    let mut problems = Vec::new();
    for (i, p) in spec.ports.take().unwrap_or_default().into_iter().enumerate() {
        let port =
            port_u16(p.port).ok_or_else(|| fail(K, &ns, &name, format!("spec.ports[{i}].port {} is out of range 1-65535", p.port)))?;
        let protocol = match protocol(p.protocol.as_deref()) {
            Ok(p) => p,
            Err(r) => {
                problems.push(fail(K, &ns, &name, format!("spec.ports[{i}]: {r}; port skipped")));
                continue;
            }
        };
        let node_port = match p.node_port {
            None | Some(0) => None,
            Some(n) => Some(port_u16(n).ok_or_else(|| fail(K, &ns, &name, format!("spec.ports[{i}].nodePort {n} is out of range")))?),
        };
        ports.push(ServicePort { name: p.name.unwrap_or_default(), port, protocol, node_port });
    }
    // spec.topologyKeys left the API in 1.22 (and k8s-openapi's structs
    // with it); `wire` keeps it as raw JSON so its shape is checked here.
    let topology_keys = match spec.topology_keys.take() {
        None | Some(Value::Null) => None,
        Some(Value::Array(items)) => Some(
            items
                .into_iter()
                .map(|k| match k {
                    Value::String(k) => Some(k),
                    _ => None,
                })
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| fail(K, &ns, &name, "spec.topologyKeys must be a list of strings"))?,
        ),
        Some(_) => return Err(fail(K, &ns, &name, "spec.topologyKeys must be a list of strings")),
    };
    let ips = |list: &[String], field: &str| -> Result<Vec<IpAddr>, ObjectError> {
        list.iter().map(|s| parse_ip(s).ok_or_else(|| fail(K, &ns, &name, format!("{field}: {s:?} is not an IP address")))).collect()
    };
    let external_ips = ips(&spec.external_ips.clone().unwrap_or_default(), "spec.externalIPs")?;
    let mut lb: Vec<String> = Vec::new();
    for (i, ingress) in svc.status.and_then(|s| s.load_balancer).and_then(|lb| lb.ingress).unwrap_or_default().into_iter().enumerate() {
        let Some(ip) = ingress.ip else { continue };
        match ingress.ip_mode.as_deref() {
            // KEP-1860: the cloud's load balancer proxies this address to
            // the node, so traffic to it must reach the node as it is.
            Some("Proxy") => continue,
            None | Some("VIP") => {}
            Some(other) => problems.push(fail(
                K,
                &ns,
                &name,
                format!("status.loadBalancer.ingress[{i}].ipMode {other:?} is unknown (VIP and Proxy are); {ip} is treated as VIP"),
            )),
        }
        lb.push(ip);
    }
    let load_balancer_ips = ips(&lb, "status.loadBalancer.ingress[].ip")?;
    let session_affinity = match spec.session_affinity.as_deref() {
        None | Some("None") => None,
        Some("ClientIP") => {
            let timeout = spec.session_affinity_config.as_ref().and_then(|c| c.client_ip.as_ref()).and_then(|c| c.timeout_seconds);
            match timeout {
                None => Some(DEFAULT_AFFINITY_TIMEOUT_S),
                Some(t) => Some(u32::try_from(t).ok().filter(|t| (1..=MAX_AFFINITY_TIMEOUT_S).contains(t)).unwrap_or_else(|| {
                    problems.push(fail(
                        K,
                        &ns,
                        &name,
                        format!(
                            "spec.sessionAffinityConfig.clientIP.timeoutSeconds {t} is out of range 1-{MAX_AFFINITY_TIMEOUT_S}; the default {DEFAULT_AFFINITY_TIMEOUT_S} is used"
                        ),
                    ));
                    DEFAULT_AFFINITY_TIMEOUT_S
                })),
            }
        }
        Some(other) => {
            problems.push(fail(K, &ns, &name, format!("spec.sessionAffinity {other:?} is unknown (None and ClientIP are); None is used")));
            None
        }
    };
    let load_balancer_source_ranges = match spec.load_balancer_source_ranges.take().unwrap_or_default() {
        ranges if ranges.is_empty() => None,
        ranges => {
            let mut valid = Vec::with_capacity(ranges.len());
            for (i, r) in ranges.iter().enumerate() {
                match Cidr::parse(r) {
                    Some(c) => valid.push(c),
                    None => problems.push(fail(
                        K,
                        &ns,
                        &name,
                        format!(
                            "spec.loadBalancerSourceRanges[{i}] {r:?} is not a CIDR; ignored (the other ranges stay in force, and with none the LoadBalancer IPs admit no client)"
                        ),
                    )),
                }
            }
            Some(valid)
        }
    };
    let external_policy = spec.external_traffic_policy.as_deref().unwrap_or("Cluster");
    let service = Service {
        id: ObjectRef::new(ns.clone(), name.clone()),
        service_type,
        cluster_ips,
        ports,
        topology_keys,
        annotations: svc.metadata.annotations.unwrap_or_default(),
        internal_policy_local: spec.internal_traffic_policy.as_deref() == Some("Local"),
        // "OnlyLocal" is the pre-1.14 spelling the API server still maps to Local.
        external_policy_local: matches!(external_policy, "Local" | "OnlyLocal"),
        traffic_distribution: spec.traffic_distribution.clone(),
        external_ips,
        load_balancer_ips,
        health_check_node_port: spec.health_check_node_port.and_then(port_u16),
        session_affinity,
        load_balancer_source_ranges,
    };
    Ok((Converted::Ok(service), problems))
}

/// Converts an EndpointSlice. Problems confined to one endpoint or port are
/// returned beside the slice (that part is left out); problems with the
/// slice as a whole are the `Err`.
pub(crate) fn slice_from_json(v: &Value) -> Conversion<EndpointSlice> {
    // What `kubectl get endpointslices -o yaml` gives on 1.17-1.20.
    if v.get("apiVersion").and_then(Value::as_str) == Some("discovery.k8s.io/v1beta1") {
        return from_json("EndpointSlice", v, |s: WireSliceV1beta1| slice_from_wire(s.into_v1()));
    }
    from_json("EndpointSlice", v, slice_from_wire)
}

/// [`slice_from_json`] for a slice the watcher deserialized.
pub(crate) fn slice_from_wire(slice: WireSlice) -> Conversion<EndpointSlice> {
    const K: &str = "EndpointSlice";
    let (ns, name) = meta_ref(&slice.metadata);
    if name.is_empty() {
        return Err(fail(K, &ns, &name, "metadata.name is missing"));
    }
    // A slice carrying either label is not ours to serve even when its
    // Service is (upstream e2e, "should implement
    // service.kubernetes.io/headless", labels a slice only).
    if let Some(why) = left_to_others(&slice.metadata) {
        return Ok((Converted::Ignored(why), Vec::new()));
    }
    let service_name = slice
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(SERVICE_NAME_LABEL))
        // No Service has an empty name (the API server requires one), so an
        // empty label names none either.
        .filter(|n| !n.is_empty())
        .cloned()
        .ok_or_else(|| fail(K, &ns, &name, format!("has no {SERVICE_NAME_LABEL} label, so it belongs to no Service")))?;
    let family = match slice.address_type.as_str() {
        "IPv4" => Family::V4,
        "IPv6" => Family::V6,
        "FQDN" => return Ok((Converted::Ignored("FQDN addresses"), Vec::new())),
        other => return Err(fail(K, &ns, &name, format!("addressType {other} is unknown"))),
    };
    let mut problems = Vec::new();
    let mut ports = Vec::new();
    for (i, p) in slice.ports.unwrap_or_default().into_iter().enumerate() {
        // A port without a number means "all ports"; the socket datapath
        // cannot express that, and kube-proxy skips such ports too.
        let Some(num) = p.port else { continue };
        let Some(port) = port_u16(num) else {
            problems.push(fail(K, &ns, &name, format!("ports[{i}].port {num} is out of range 1-65535; port skipped")));
            continue;
        };
        match protocol(p.protocol.as_deref()) {
            Ok(protocol) => ports.push(SlicePort { name: p.name.unwrap_or_default(), port, protocol }),
            Err(r) => problems.push(fail(K, &ns, &name, format!("ports[{i}]: {r}; port skipped"))),
        }
    }
    let eps = slice.endpoints.unwrap_or_default();
    // The topologies of this slice's endpoints so far: endpoints on one
    // node report the same labels and share one copy.
    let mut topologies: Vec<Arc<NodeTopology>> = Vec::new();
    // Exact capacity: the model keeps these for as long as the slice exists
    // (at 10k slices, doubling growth would hold a third more than needed).
    let mut endpoints = Vec::with_capacity(eps.len());
    for (i, ep) in eps.into_iter().enumerate() {
        let address = match ep.addresses {
            FirstAddress::Ip(ip) => ip,
            FirstAddress::Missing => {
                problems.push(fail(K, &ns, &name, format!("endpoints[{i}] has no address; endpoint skipped")));
                continue;
            }
            FirstAddress::Invalid(first) => {
                problems.push(fail(K, &ns, &name, format!("endpoints[{i}] address {first:?} is not an IP address; endpoint skipped")));
                continue;
            }
        };
        if Family::of(&address) != family {
            problems.push(fail(
                K,
                &ns,
                &name,
                format!("endpoints[{i}] address {address} does not match addressType {}; endpoint skipped", slice.address_type),
            ));
            continue;
        }
        let cond = ep.conditions.unwrap_or_default();
        // discovery.k8s.io/v1: nil ready means ready; nil serving means the
        // same as ready; nil terminating means not terminating.
        let ready = cond.ready.unwrap_or(true);
        let hints = ep.hints.unwrap_or_default();
        endpoints.push(Endpoint {
            address,
            ready,
            serving: cond.serving.unwrap_or(ready),
            terminating: cond.terminating.unwrap_or(false),
            node_name: ep.node_name.map(|n| n.0),
            zone: ep.zone.map(|z| z.0),
            extra: EndpointExtra {
                hint_zones: hints.for_zones.map(|z| z.into_iter().map(|z| z.name.0).collect()),
                hint_nodes: hints.for_nodes.map(|n| n.into_iter().map(|n| n.name.0).collect()),
                topology: ep.deprecated_topology.map(|labels| shared_topology(&mut topologies, &labels)),
            }
            .boxed(),
        });
    }
    Ok((Converted::Ok(EndpointSlice { id: ObjectRef::new(ns, name), service_name, family, ports, endpoints }), problems))
}

/// One shared copy of a reported node topology per distinct label set.
fn shared_topology(seen: &mut Vec<Arc<NodeTopology>>, labels: &std::collections::BTreeMap<String, String>) -> Arc<NodeTopology> {
    let same =
        |t: &&Arc<NodeTopology>| t.len() == labels.len() && t.iter().zip(labels).all(|((k, v), (k2, v2))| **k == **k2 && **v == **v2);
    if let Some(t) = seen.iter().find(same) {
        return t.clone();
    }
    let t: Arc<NodeTopology> = Arc::new(labels.iter().map(|(k, v)| (intern(k), intern(v))).collect());
    seen.push(t.clone());
    t
}

/// Converts a Node given as JSON (a manifest) through the wire shape the
/// watcher uses, so both read the same fields.
pub(crate) fn node_from_json(v: &Value) -> Result<Node, ObjectError> {
    let (_, name) = object_ref(v);
    if name.is_empty() {
        return Err(fail("Node", "", "", "metadata.name is missing"));
    }
    let wire =
        WireNode::deserialize(v).map_err(|e| ObjectError { kind: "Node".into(), object: name, reason: format!("malformed: {e}") })?;
    node_from_wire(wire)
}

/// The error of a Node without a name.
pub(crate) fn node_without_name() -> ObjectError {
    fail("Node", "", "", "metadata.name is missing")
}

/// [`node_from_json`] for a Node the watcher deserialized.
pub(crate) fn node_from_wire(node: WireNode) -> Result<Node, ObjectError> {
    let name = node.metadata.name.unwrap_or_default();
    if name.is_empty() {
        return Err(fail("Node", "", "", "metadata.name is missing"));
    }
    let tainted = node.spec.and_then(|s| s.taints).unwrap_or_default().iter().any(|t| t.key.as_deref() == Some(TO_BE_DELETED_TAINT));
    let leaving = if node.metadata.deletion_timestamp.is_some() {
        Some("its Node has a deletionTimestamp")
    } else if tainted {
        Some("its Node is tainted ToBeDeletedByClusterAutoscaler")
    } else {
        None
    };
    let labels = node.metadata.labels.unwrap_or_default().iter().map(|(k, v)| (intern(k), intern(v))).collect();
    Ok(Node { name, labels, leaving })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Cluster;

    fn cluster(yaml: &str) -> (Cluster, Vec<String>) {
        crate::source::manifest_watch::cluster_from_text(yaml)
    }

    const GOOD: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec:
  clusterIP: 10.96.0.10
  clusterIPs: [10.96.0.10, "fd00:96::10"]
  topologyKeys: ["kubernetes.io/hostname", "*"]
  ports:
  - {name: http, port: 80, targetPort: 8080}
  - {name: dns, port: 53, protocol: UDP}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-abc
  namespace: shop
  labels: {kubernetes.io/service-name: web}
addressType: IPv4
ports: [{name: http, port: 8080}]
endpoints:
- addresses: [10.244.0.1]
  nodeName: n1
  zone: z1
  hints: {forZones: [{name: z1}]}
- addresses: [10.244.0.2]
  conditions: {ready: false, serving: true, terminating: true}
---
apiVersion: v1
kind: Node
metadata: {name: n1, labels: {topology.kubernetes.io/zone: z1}}
"#;

    #[test]
    fn converts_services_slices_nodes() {
        let (c, e) = cluster(GOOD);
        assert!(e.is_empty(), "{e:?}");
        let svc = &c.services[&ObjectRef::new("shop", "web")];
        assert_eq!(svc.cluster_ips.len(), 2);
        assert_eq!(svc.ports[1].protocol, Protocol::Udp);
        assert_eq!(svc.topology_keys.as_deref(), Some(&["kubernetes.io/hostname".to_string(), "*".to_string()][..]));
        let slice = &c.slices[&ObjectRef::new("shop", "web-abc")];
        assert_eq!(slice.service_name, "web");
        assert!(slice.endpoints[0].ready && !slice.endpoints[0].terminating);
        assert_eq!(slice.endpoints[0].hint_zones(), Some(&[std::sync::Arc::from("z1")][..]));
        assert!(!slice.endpoints[1].ready && slice.endpoints[1].serving && slice.endpoints[1].terminating);
        assert_eq!(&*c.nodes["n1"].labels["topology.kubernetes.io/zone"], "z1");
    }

    #[test]
    fn ignores_headless_externalname_and_other_proxies() {
        let (c, e) = cluster(
            r"
apiVersion: v1
kind: Service
metadata: {name: h}
spec: {clusterIP: None, ports: [{port: 80}]}
---
apiVersion: v1
kind: Service
metadata: {name: x}
spec: {type: ExternalName, externalName: example.org}
---
apiVersion: v1
kind: Service
metadata: {name: o, labels: {service.kubernetes.io/service-proxy-name: other}}
spec: {clusterIP: 10.96.0.1, ports: [{port: 80}]}
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: d}
",
        );
        assert!(e.is_empty(), "{e:?}");
        assert!(c.services.is_empty());
    }

    #[test]
    fn ignores_slices_labelled_headless_or_for_other_proxies() {
        let (c, e) = cluster(
            r"
apiVersion: v1
kind: Service
metadata: {name: web}
spec: {clusterIP: 10.96.0.1, ports: [{port: 80}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-a, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
endpoints: [{addresses: [10.244.0.1]}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-h, labels: {kubernetes.io/service-name: web, service.kubernetes.io/headless: ''}}
addressType: IPv4
endpoints: [{addresses: [10.244.0.2]}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-o, labels: {kubernetes.io/service-name: web, service.kubernetes.io/service-proxy-name: other}}
addressType: IPv4
endpoints: [{addresses: [10.244.0.3]}]
",
        );
        assert!(e.is_empty(), "{e:?}");
        assert_eq!(c.slices.keys().map(|r| &*r.name).collect::<Vec<_>>(), ["web-a"]);
    }

    #[test]
    fn bad_objects_are_named_and_skipped() {
        let (c, e) = cluster(
            r#"
apiVersion: v1
kind: Service
metadata: {name: badip}
spec: {clusterIP: 10.96.0.999, ports: [{port: 80}]}
---
apiVersion: v1
kind: Service
metadata: {name: badport}
spec: {clusterIP: 10.96.0.2, ports: [{port: 70000}]}
---
apiVersion: v1
kind: Service
metadata: {name: sctp}
spec: {clusterIP: 10.96.0.3, ports: [{name: a, port: 80, protocol: SCTP}, {name: b, port: 81}]}
---
apiVersion: v1
kind: Service
metadata: {name: ok}
spec: {clusterIP: 10.96.0.4, ports: [{port: 80}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: orphan}
addressType: IPv4
endpoints: []
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: partial, labels: {kubernetes.io/service-name: ok}}
addressType: IPv4
ports: [{port: 8080}]
endpoints:
- addresses: [not-an-ip]
- addresses: ["fd00::1"]
- addresses: [10.244.0.9]
"#,
        );
        assert_eq!(c.services.len(), 2, "{e:?}");
        let sctp = &c.services[&ObjectRef::new("default", "sctp")];
        assert_eq!(sctp.ports.len(), 1, "the TCP port of a Service with an SCTP port keeps working");
        assert_eq!(c.slices[&ObjectRef::new("default", "partial")].endpoints.len(), 1);
        let want = [
            "Service default/badip: spec.clusterIPs: \"10.96.0.999\" is not an IP address",
            "Service default/badport: spec.ports[0].port 70000 is out of range 1-65535",
            "Service default/sctp: spec.ports[0]: protocol SCTP is not supported (TCP and UDP are); port skipped",
            "EndpointSlice default/orphan: has no kubernetes.io/service-name label, so it belongs to no Service",
            "EndpointSlice default/partial: endpoints[0] address \"not-an-ip\" is not an IP address; endpoint skipped",
            "EndpointSlice default/partial: endpoints[1] address fd00::1 does not match addressType IPv4; endpoint skipped",
        ];
        assert_eq!(e, want);
    }

    /// Found by the `objects` fuzz target: a slice labelled with an empty
    /// Service name was taken as the slice of a Service named "".
    #[test]
    fn an_empty_service_name_label_names_no_service() {
        let (c, e) = cluster(
            "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: s, labels: {kubernetes.io/service-name: \"\"}}\naddressType: IPv4\nendpoints: []\n",
        );
        assert!(c.slices.is_empty());
        assert_eq!(e, ["EndpointSlice default/s: has no kubernetes.io/service-name label, so it belongs to no Service"]);
        let d = crate::source::delta::delta_from_value(
            crate::model::store::Kind::EndpointSlice,
            &serde_json::json!({"metadata": {"name": "s", "labels": {"kubernetes.io/service-name": ""}}, "addressType": "IPv4"}),
        );
        assert_eq!(d.problems[0].service, None, "reported on no Service");
    }

    #[test]
    fn leaving_nodes_are_recognised() {
        let (c, e) = cluster(
            r#"
kind: Node
metadata: {name: deleted, deletionTimestamp: "2024-05-01T10:00:00Z"}
---
kind: Node
metadata: {name: tainted}
spec: {taints: [{key: node.kubernetes.io/unschedulable, effect: NoSchedule}, {key: ToBeDeletedByClusterAutoscaler, value: "1714557600", effect: NoSchedule}]}
---
kind: Node
metadata: {name: cordoned, labels: {topology.kubernetes.io/zone: z1}}
spec: {unschedulable: true, taints: [{key: node.kubernetes.io/unschedulable, effect: NoSchedule}]}
"#,
        );
        assert!(e.is_empty(), "{e:?}");
        assert_eq!(c.nodes["deleted"].leaving, Some("its Node has a deletionTimestamp"));
        assert_eq!(c.nodes["tainted"].leaving, Some("its Node is tainted ToBeDeletedByClusterAutoscaler"));
        assert_eq!(c.nodes["cordoned"].leaving, None, "a cordoned node still serves");
        assert_eq!(&*c.nodes["cordoned"].labels["topology.kubernetes.io/zone"], "z1");
        let (_, e) = cluster("kind: Node\nmetadata: {name: bad, labels: [x]}\n");
        assert!(e.len() == 1 && e[0].starts_with("Node bad: malformed:"), "{e:?}");
    }

    #[test]
    fn v1beta1_slices_convert_into_the_same_model() {
        // As a 1.18 API server serves it: topology map, no nodeName, ready only.
        let (c, e) = cluster(
            r"
apiVersion: discovery.k8s.io/v1beta1
kind: EndpointSlice
metadata: {name: web-1, namespace: shop, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080}]
endpoints:
- addresses: [10.244.0.1]
  topology: {kubernetes.io/hostname: n1, topology.kubernetes.io/zone: z1, topology.kubernetes.io/region: r1}
- addresses: [10.244.0.2]
  conditions: {ready: false}
  topology: {kubernetes.io/hostname: n1, topology.kubernetes.io/zone: z1, topology.kubernetes.io/region: r1}
- addresses: [10.244.0.3]
  conditions: {ready: true}
  topology: {kubernetes.io/hostname: n2, failure-domain.beta.kubernetes.io/zone: z2}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-2, namespace: shop, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080}]
endpoints:
- addresses: [10.244.0.1]
  nodeName: n1
  zone: z1
",
        );
        assert!(e.is_empty(), "{e:?}");
        let beta = &c.slices[&ObjectRef::new("shop", "web-1")];
        let v1 = &c.slices[&ObjectRef::new("shop", "web-2")];
        let (a, b, d) = (&beta.endpoints[0], &beta.endpoints[1], &beta.endpoints[2]);
        assert_eq!((a.node_name.as_deref(), a.zone.as_deref()), (Some("n1"), Some("z1")));
        assert!(a.ready && a.serving && !a.terminating, "no conditions: ready, as kube-proxy 1.17-1.20 read it");
        assert!(!b.ready && !b.serving && !b.terminating, "not ready: never used");
        let topology = a.topology().expect("region is kept");
        assert_eq!(topology.iter().map(|(k, v)| (&**k, &**v)).collect::<Vec<_>>(), [("topology.kubernetes.io/region", "r1")]);
        assert!(a.topology().zip(b.topology()).is_some_and(|(x, y)| Arc::ptr_eq(x, y)), "one copy per slice");
        assert_eq!((d.node_name.as_deref(), d.zone.as_deref()), (Some("n2"), Some("z2")));
        // Apart from what only v1beta1 reports, the same endpoint as v1's.
        let mut same = a.clone();
        same.edit_extra(|x| x.topology = None);
        assert_eq!(same, v1.endpoints[0]);
        assert_eq!(beta.ports, v1.ports);
    }

    #[test]
    fn malformed_typed_fields_are_reported() {
        let (_, e) = cluster("apiVersion: v1\nkind: Service\nmetadata: {name: m}\nspec: {ports: [{port: eighty}]}\n");
        assert_eq!(e.len(), 1);
        assert!(e[0].starts_with("Service default/m: malformed:"), "{e:?}");
    }
}

#[cfg(test)]
mod service_policy_tests {
    use crate::model::{Cidr, ObjectRef, Service};

    fn convert(spec: &str, status: &str) -> (Option<Service>, Vec<String>) {
        let yaml = format!("apiVersion: v1\nkind: Service\nmetadata: {{name: lb}}\nspec: {spec}\nstatus: {status}\n");
        let (mut c, e) = crate::source::manifest_watch::cluster_from_text(&yaml);
        (c.services.remove(&ObjectRef::new("default", "lb")), e)
    }

    const LB: &str = "type: LoadBalancer, clusterIP: 10.96.0.10, ports: [{port: 80, nodePort: 30080}]";

    #[test]
    fn session_affinity_and_its_timeout() {
        // (spec fields, affinity, problem)
        let cases = [
            ("", None, None),
            (", sessionAffinity: None", None, None),
            (", sessionAffinity: ClientIP", Some(10_800), None),
            (", sessionAffinity: ClientIP, sessionAffinityConfig: {clientIP: {timeoutSeconds: 2}}", Some(2), None),
            (", sessionAffinity: ClientIP, sessionAffinityConfig: {clientIP: {timeoutSeconds: 86400}}", Some(86_400), None),
            (", sessionAffinity: ClientIP, sessionAffinityConfig: {clientIP: {}}", Some(10_800), None),
            // The API server would have refused these; the default stands in.
            (
                ", sessionAffinity: ClientIP, sessionAffinityConfig: {clientIP: {timeoutSeconds: 86401}}",
                Some(10_800),
                Some(
                    "Service default/lb: spec.sessionAffinityConfig.clientIP.timeoutSeconds 86401 is out of range 1-86400; the default 10800 is used",
                ),
            ),
            (
                ", sessionAffinity: ClientIP, sessionAffinityConfig: {clientIP: {timeoutSeconds: 0}}",
                Some(10_800),
                Some(
                    "Service default/lb: spec.sessionAffinityConfig.clientIP.timeoutSeconds 0 is out of range 1-86400; the default 10800 is used",
                ),
            ),
            (
                ", sessionAffinity: Cookie",
                None,
                Some("Service default/lb: spec.sessionAffinity \"Cookie\" is unknown (None and ClientIP are); None is used"),
            ),
            // A timeout without ClientIP means nothing.
            (", sessionAffinityConfig: {clientIP: {timeoutSeconds: 5}}", None, None),
        ];
        for (fields, affinity, problem) in cases {
            let (svc, e) = convert(&format!("{{{LB}{fields}}}"), "{}");
            let svc = svc.unwrap_or_else(|| panic!("{fields}: not converted: {e:?}"));
            assert_eq!(svc.session_affinity, affinity, "{fields}");
            assert_eq!(e.first().map(String::as_str), problem, "{fields}");
            assert!(e.len() <= 1, "{fields}: {e:?}");
        }
    }

    #[test]
    fn bad_source_ranges_are_reported_and_the_rest_stay_in_force() {
        let cidr = |s: &str| Cidr::parse(s).expect("literal");
        let (svc, e) = convert(&format!("{{{LB}, loadBalancerSourceRanges: [10.0.0.0/8, nonsense, \" 192.0.2.0/24\", 10.0.0.1]}}"), "{}");
        let svc = svc.expect("converted");
        assert_eq!(svc.load_balancer_source_ranges, Some(vec![cidr("10.0.0.0/8"), cidr("192.0.2.0/24")]));
        assert_eq!(
            e,
            [
                "Service default/lb: spec.loadBalancerSourceRanges[1] \"nonsense\" is not a CIDR; ignored (the other ranges stay in force, and with none the LoadBalancer IPs admit no client)",
                "Service default/lb: spec.loadBalancerSourceRanges[3] \"10.0.0.1\" is not a CIDR; ignored (the other ranges stay in force, and with none the LoadBalancer IPs admit no client)",
            ]
        );
        // None valid: the filter stays, with nothing in it (fails closed).
        let (svc, e) = convert(&format!("{{{LB}, loadBalancerSourceRanges: [bad]}}"), "{}");
        assert_eq!(svc.expect("converted").load_balancer_source_ranges, Some(vec![]));
        assert_eq!(e.len(), 1);
        // Absent or empty: no filter.
        for fields in ["", ", loadBalancerSourceRanges: []"] {
            let (svc, e) = convert(&format!("{{{LB}{fields}}}"), "{}");
            assert_eq!(svc.expect("converted").load_balancer_source_ranges, None, "{fields}");
            assert!(e.is_empty(), "{e:?}");
        }
    }

    #[test]
    fn ip_mode_proxy_addresses_are_left_alone() {
        let status = "{loadBalancer: {ingress: [{ip: 198.51.100.1}, {ip: 198.51.100.2, ipMode: VIP}, {ip: 198.51.100.3, ipMode: Proxy}, {hostname: lb.example.org}, {ip: 198.51.100.4, ipMode: Tunnel}]}}";
        let (svc, e) = convert(&format!("{{{LB}}}"), status);
        let ips: Vec<String> = svc.expect("converted").load_balancer_ips.iter().map(ToString::to_string).collect();
        assert_eq!(ips, ["198.51.100.1", "198.51.100.2", "198.51.100.4"]);
        assert_eq!(
            e,
            [
                "Service default/lb: status.loadBalancer.ingress[4].ipMode \"Tunnel\" is unknown (VIP and Proxy are); 198.51.100.4 is treated as VIP"
            ]
        );
    }
}
