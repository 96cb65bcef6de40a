//! Structured inputs for the targets that need more than bytes: Kubernetes
//! objects as JSON (Services, EndpointSlices, Nodes) and whole clusters of
//! the agent's model, built from libFuzzer's bytes with `arbitrary`.
//!
//! Values come from small pools of the ones the agent distinguishes (the
//! well-known topology labels and annotations, policies, address forms,
//! port edge cases, names that collide), mixed with raw strings and values
//! of the wrong JSON type, so that the fuzzer spends its time on the
//! interplay between objects rather than on spelling field names.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;

use arbitrary::{Result, Unstructured};
use proxy_agent::model::{
    Cluster, Endpoint, EndpointExtra, EndpointSlice, Family, Node, ObjectRef, Protocol, Service, ServicePort, ServiceType, SlicePort,
};
use serde_json::{Map, Value, json};

const NAMES: [&str; 6] = ["web", "api", "db", "a", "b", ""];
const NAMESPACES: [&str; 4] = ["default", "shop", "", "kube-system"];
pub const NODES: [&str; 5] = ["n1", "n2", "n3", "node-a", ""];
const ZONES: [&str; 4] = ["z1", "z2", "zone-a", ""];
const POOLS: [&str; 3] = ["hangzhou", "shanghai", ""];
const IPV4: [&str; 12] = [
    "10.96.0.10",
    "10.96.0.11",
    "10.244.0.1",
    "10.244.0.2",
    "10.244.1.1",
    "192.0.2.1",
    "0.0.0.0",
    "255.255.255.255",
    " 10.244.0.3",
    "10.0.0.999",
    "None",
    "",
];
const IPV6: [&str; 8] = ["fd00:96::10", "fd00::1", "fd00::2", "::", "::ffff:10.0.0.1", "2001:db8::1", "fe80::1%eth0", "fd00::zz"];
const PORTS: [i64; 14] = [0, 1, 53, 80, 443, 8080, 30080, 32767, 65535, 65536, -1, 2_147_483_647, -2_147_483_648, 4_294_967_296];
const PROTOCOLS: [&str; 5] = ["TCP", "UDP", "SCTP", "tcp", ""];
const TYPES: [&str; 5] = ["ClusterIP", "NodePort", "LoadBalancer", "ExternalName", "Weird"];
const POLICIES: [&str; 5] = ["Cluster", "Local", "OnlyLocal", "local", ""];
const DISTRIBUTIONS: [&str; 5] = ["PreferClose", "PreferSameZone", "PreferSameNode", "Whatever", ""];
const AFFINITIES: [&str; 3] = ["None", "ClientIP", "Cookie"];
pub const LABEL_KEYS: [&str; 10] = [
    "kubernetes.io/hostname",
    "topology.kubernetes.io/zone",
    "topology.kubernetes.io/region",
    "failure-domain.beta.kubernetes.io/zone",
    "apps.openyurt.io/nodepool",
    "openyurt.io/nodepool",
    "kubernetes.io/zone",
    "*",
    "",
    "example.com/rack",
];
const ANNOTATIONS: [&str; 5] = [
    "topoproxy.io/topology-keys",
    "openyurt.io/topologyKeys",
    "service.kubernetes.io/topology-mode",
    "service.kubernetes.io/topology-aware-hints",
    "example.com/other",
];
const ANNOTATION_VALUES: [&str; 10] = [
    "kubernetes.io/hostname, topology.kubernetes.io/zone, *",
    "topology.kubernetes.io/zone,*",
    " , ,",
    "*,kubernetes.io/hostname",
    "openyurt.io/nodepool",
    "kubernetes.io/zone",
    "kubernetes.io/hostname",
    "Auto",
    "auto",
    "",
];

fn pick<T: Copy>(u: &mut Unstructured<'_>, pool: &[T]) -> Result<T> {
    u.choose(pool).copied()
}

/// Mostly `pool`, sometimes any short string.
fn text(u: &mut Unstructured<'_>, pool: &[&str]) -> Result<String> {
    if u.ratio(1, 8)? {
        let s: &str = u.arbitrary()?;
        Ok(s.chars().take(40).collect())
    } else {
        Ok(pick(u, pool)?.to_string())
    }
}

/// A value of some other JSON type, for fields whose type is wrong.
fn wrong(u: &mut Unstructured<'_>) -> Result<Value> {
    Ok(match u.int_in_range(0..=5)? {
        0 => Value::Null,
        1 => json!(u.arbitrary::<bool>()?),
        2 => json!(u.arbitrary::<i64>()?),
        3 => json!(u.arbitrary::<f64>().map(|f| if f.is_finite() { f } else { 0.5 })?),
        4 => json!([text(u, &NAMES)?]),
        _ => json!({"x": text(u, &NAMES)?}),
    })
}

/// `make()` most of the time, a wrongly typed value now and then.
fn field(u: &mut Unstructured<'_>, make: impl FnOnce(&mut Unstructured<'_>) -> Result<Value>) -> Result<Value> {
    if u.ratio(1, 24)? { wrong(u) } else { make(u) }
}

fn ip_text(u: &mut Unstructured<'_>) -> Result<String> {
    if u.arbitrary()? { text(u, &IPV4) } else { text(u, &IPV6) }
}

/// Sets `key` in `obj` when the fuzzer says so.
fn maybe(
    u: &mut Unstructured<'_>,
    obj: &mut Map<String, Value>,
    key: &str,
    make: impl FnOnce(&mut Unstructured<'_>) -> Result<Value>,
) -> Result<()> {
    if u.arbitrary()? {
        let v = field(u, make)?;
        obj.insert(key.to_string(), v);
    }
    Ok(())
}

fn string_map(u: &mut Unstructured<'_>, keys: &[&str], values: &[&str]) -> Result<Value> {
    let mut m = Map::new();
    for _ in 0..u.int_in_range(0..=4)? {
        m.insert(text(u, keys)?, field(u, |u| Ok(json!(text(u, values)?)))?);
    }
    Ok(Value::Object(m))
}

fn metadata(u: &mut Unstructured<'_>, namespaced: bool, labels: Value, annotations: Option<Value>) -> Result<Value> {
    let mut m = Map::new();
    maybe(u, &mut m, "name", |u| Ok(json!(text(u, &NAMES)?)))?;
    if namespaced {
        maybe(u, &mut m, "namespace", |u| Ok(json!(text(u, &NAMESPACES)?)))?;
    }
    maybe(u, &mut m, "uid", |u| Ok(json!(format!("uid-{}", u.arbitrary::<u8>()?))))?;
    m.insert("labels".into(), labels);
    if let Some(a) = annotations {
        m.insert("annotations".into(), a);
    }
    Ok(Value::Object(m))
}

/// How much of a Service's topology configuration is raw fuzzer text.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Topology {
    /// Key lists and annotation values from the pools, mostly valid.
    Pooled,
    /// Key lists and annotation values as arbitrary strings.
    Raw,
}

/// A topology key list or annotation value.
fn keys_text(u: &mut Unstructured<'_>, mode: Topology) -> Result<String> {
    if mode == Topology::Raw && u.arbitrary()? {
        let s: &str = u.arbitrary()?;
        return Ok(s.to_string());
    }
    if u.arbitrary()? {
        return text(u, &ANNOTATION_VALUES);
    }
    let n = u.int_in_range(0..=4)?;
    let keys: Vec<String> = (0..n).map(|_| text(u, &LABEL_KEYS)).collect::<Result<_>>()?;
    Ok(keys.join(if u.arbitrary()? { ", " } else { "," }))
}

fn service(u: &mut Unstructured<'_>, mode: Topology) -> Result<Value> {
    let labels = if u.ratio(1, 10)? {
        json!({"service.kubernetes.io/headless": "", "x": "y"})
    } else if u.ratio(1, 10)? {
        json!({"service.kubernetes.io/service-proxy-name": "other"})
    } else {
        json!({})
    };
    let mut annotations = Map::new();
    for _ in 0..u.int_in_range(0..=3)? {
        let key = text(u, &ANNOTATIONS)?;
        annotations.insert(key, json!(keys_text(u, mode)?));
    }
    let mut spec = Map::new();
    maybe(u, &mut spec, "type", |u| Ok(json!(text(u, &TYPES)?)))?;
    maybe(u, &mut spec, "clusterIP", |u| Ok(json!(ip_text(u)?)))?;
    maybe(u, &mut spec, "clusterIPs", |u| {
        let n = u.int_in_range(0..=3)?;
        Ok(json!((0..n).map(|_| ip_text(u)).collect::<Result<Vec<_>>>()?))
    })?;
    maybe(u, &mut spec, "ports", |u| {
        let n = u.int_in_range(0..=3)?;
        let mut ports = Vec::new();
        for _ in 0..n {
            let mut p = Map::new();
            maybe(u, &mut p, "name", |u| Ok(json!(text(u, &["http", "dns", ""])?)))?;
            p.insert("port".into(), field(u, |u| Ok(json!(pick(u, &PORTS)?)))?);
            maybe(u, &mut p, "protocol", |u| Ok(json!(text(u, &PROTOCOLS)?)))?;
            maybe(u, &mut p, "nodePort", |u| Ok(json!(pick(u, &PORTS)?)))?;
            maybe(u, &mut p, "targetPort", |u| Ok(json!(pick(u, &PORTS)?)))?;
            ports.push(Value::Object(p));
        }
        Ok(json!(ports))
    })?;
    maybe(u, &mut spec, "topologyKeys", |u| {
        let n = u.int_in_range(0..=17)?;
        let keys: Vec<Value> = (0..n).map(|_| field(u, |u| Ok(json!(keys_text(u, mode)?)))).collect::<Result<_>>()?;
        Ok(json!(keys))
    })?;
    maybe(u, &mut spec, "externalIPs", |u| Ok(json!([ip_text(u)?])))?;
    maybe(u, &mut spec, "externalTrafficPolicy", |u| Ok(json!(text(u, &POLICIES)?)))?;
    maybe(u, &mut spec, "internalTrafficPolicy", |u| Ok(json!(text(u, &POLICIES)?)))?;
    maybe(u, &mut spec, "trafficDistribution", |u| Ok(json!(text(u, &DISTRIBUTIONS)?)))?;
    maybe(u, &mut spec, "healthCheckNodePort", |u| Ok(json!(pick(u, &PORTS)?)))?;
    maybe(u, &mut spec, "sessionAffinity", |u| Ok(json!(text(u, &AFFINITIES)?)))?;
    maybe(u, &mut spec, "sessionAffinityConfig", |u| {
        Ok(json!({"clientIP": {"timeoutSeconds": pick(u, &[0i64, 1, 10_800, 86_400, 86_401, -5])?}}))
    })?;
    maybe(u, &mut spec, "loadBalancerSourceRanges", |u| {
        Ok(json!([text(u, &["10.0.0.0/8", "0.0.0.0/0", "fd00::/64", "10.0.0.1", "nonsense", " 192.0.2.0/24"])?]))
    })?;
    let mut obj = Map::new();
    obj.insert("apiVersion".into(), json!("v1"));
    obj.insert("kind".into(), json!("Service"));
    obj.insert("metadata".into(), metadata(u, true, labels, Some(Value::Object(annotations)))?);
    obj.insert("spec".into(), Value::Object(spec));
    maybe(u, &mut obj, "status", |u| {
        Ok(json!({"loadBalancer": {"ingress": [{"ip": ip_text(u)?, "ipMode": text(u, &["VIP", "Proxy", "Tunnel"])?}]}}))
    })?;
    Ok(Value::Object(obj))
}

fn endpoint(u: &mut Unstructured<'_>, v1beta1: bool) -> Result<Value> {
    let mut e = Map::new();
    e.insert(
        "addresses".into(),
        field(u, |u| {
            let n = u.int_in_range(0..=2)?;
            Ok(json!((0..n).map(|_| ip_text(u)).collect::<Result<Vec<_>>>()?))
        })?,
    );
    maybe(u, &mut e, "conditions", |u| {
        let mut c = Map::new();
        for k in ["ready", "serving", "terminating"] {
            maybe(u, &mut c, k, |u| Ok(json!(u.arbitrary::<bool>()?)))?;
        }
        Ok(Value::Object(c))
    })?;
    maybe(u, &mut e, "nodeName", |u| Ok(json!(text(u, &NODES)?)))?;
    if v1beta1 {
        maybe(u, &mut e, "topology", |u| string_map(u, &LABEL_KEYS, &[NODES[0], NODES[1], ZONES[0], ZONES[1], "r1"]))?;
    } else {
        maybe(u, &mut e, "zone", |u| Ok(json!(text(u, &ZONES)?)))?;
        maybe(u, &mut e, "deprecatedTopology", |u| string_map(u, &LABEL_KEYS, &[NODES[0], ZONES[0], POOLS[0], "r1"]))?;
    }
    maybe(u, &mut e, "hints", |u| {
        let mut h = Map::new();
        maybe(u, &mut h, "forZones", |u| Ok(json!([{"name": text(u, &ZONES)?}])))?;
        maybe(u, &mut h, "forNodes", |u| Ok(json!([{"name": text(u, &NODES)?}])))?;
        Ok(Value::Object(h))
    })?;
    Ok(Value::Object(e))
}

fn slice(u: &mut Unstructured<'_>) -> Result<Value> {
    let v1beta1 = u.ratio(1, 4)?;
    let labels = if u.ratio(1, 10)? { json!({}) } else { json!({"kubernetes.io/service-name": text(u, &NAMES)?}) };
    let mut obj = Map::new();
    obj.insert("apiVersion".into(), json!(if v1beta1 { "discovery.k8s.io/v1beta1" } else { "discovery.k8s.io/v1" }));
    obj.insert("kind".into(), json!("EndpointSlice"));
    obj.insert("metadata".into(), metadata(u, true, labels, None)?);
    obj.insert("addressType".into(), field(u, |u| Ok(json!(text(u, &["IPv4", "IPv6", "FQDN", "ipv4"])?)))?);
    maybe(u, &mut obj, "ports", |u| {
        let n = u.int_in_range(0..=2)?;
        let mut ports = Vec::new();
        for _ in 0..n {
            let mut p = Map::new();
            maybe(u, &mut p, "name", |u| Ok(json!(text(u, &["http", "dns", ""])?)))?;
            maybe(u, &mut p, "port", |u| Ok(json!(pick(u, &PORTS)?)))?;
            maybe(u, &mut p, "protocol", |u| Ok(json!(text(u, &PROTOCOLS)?)))?;
            ports.push(Value::Object(p));
        }
        Ok(json!(ports))
    })?;
    maybe(u, &mut obj, "endpoints", |u| {
        let n = u.int_in_range(0..=5)?;
        Ok(json!((0..n).map(|_| endpoint(u, v1beta1)).collect::<Result<Vec<_>>>()?))
    })?;
    Ok(Value::Object(obj))
}

fn node(u: &mut Unstructured<'_>) -> Result<Value> {
    let labels = string_map(u, &LABEL_KEYS, &[NODES[0], NODES[1], ZONES[0], ZONES[1], POOLS[0], POOLS[1], "r1"])?;
    let mut obj = Map::new();
    obj.insert("apiVersion".into(), json!("v1"));
    obj.insert("kind".into(), json!("Node"));
    let mut meta = metadata(u, false, labels, None)?;
    if u.ratio(1, 8)?
        && let Some(m) = meta.as_object_mut()
    {
        m.insert("deletionTimestamp".into(), json!(text(u, &["2024-05-01T10:00:00Z", "yesterday"])?));
    }
    obj.insert("metadata".into(), meta);
    maybe(u, &mut obj, "spec", |u| {
        Ok(
            json!({"taints": [{"key": text(u, &["ToBeDeletedByClusterAutoscaler", "node.kubernetes.io/unschedulable"])?, "effect": "NoSchedule"}]}),
        )
    })?;
    Ok(Value::Object(obj))
}

/// A handful of Services, EndpointSlices and Nodes as JSON, in an order
/// the fuzzer chooses (later objects of the same name replace earlier ones).
pub fn objects(u: &mut Unstructured<'_>, mode: Topology) -> Result<Vec<Value>> {
    let mut out = Vec::new();
    for _ in 0..u.int_in_range(1..=12)? {
        out.push(match u.int_in_range(0..=2)? {
            0 => service(u, mode)?,
            1 => slice(u)?,
            _ => node(u)?,
        });
    }
    Ok(out)
}

// ---------------------------------------------------------------------------
// Clusters of the model, for the decision's properties.
// ---------------------------------------------------------------------------

fn ip(u: &mut Unstructured<'_>, family: Family) -> IpAddr {
    // A few addresses per family, so that endpoints collide across slices.
    let n = u.int_in_range(1..=6u8).unwrap_or(1);
    match family {
        Family::V4 => IpAddr::from([10, 244, 0, n]),
        Family::V6 => IpAddr::from([0xfd00, 0, 0, 0, 0, 0, 0, u16::from(n)]),
    }
}

fn shared(u: &mut Unstructured<'_>, pool: &[&str]) -> Result<Option<Arc<str>>> {
    Ok(if u.ratio(1, 5)? { None } else { Some(Arc::from(pick(u, pool)?)) })
}

fn labels(u: &mut Unstructured<'_>) -> Result<BTreeMap<String, String>> {
    let mut m = BTreeMap::new();
    for _ in 0..u.int_in_range(0..=4)? {
        m.insert(
            pick(u, &LABEL_KEYS)?.to_string(),
            pick(u, &[NODES[0], NODES[1], ZONES[0], ZONES[1], POOLS[0], POOLS[1], ""])?.to_string(),
        );
    }
    Ok(m)
}

const PORT_NAMES: [&str; 3] = ["", "http", "dns"];

fn model_service(u: &mut Unstructured<'_>, name: &str) -> Result<Service> {
    let families: Vec<Family> = match u.int_in_range(0..=2)? {
        0 => vec![Family::V4],
        1 => vec![Family::V6],
        _ => vec![Family::V4, Family::V6],
    };
    let mut ports = Vec::new();
    for i in 0..u.int_in_range(1..=3u16)? {
        ports.push(ServicePort {
            name: pick(u, &PORT_NAMES)?.to_string(),
            port: 80 + i,
            protocol: if u.arbitrary()? { Protocol::Tcp } else { Protocol::Udp },
            node_port: u.arbitrary::<bool>()?.then_some(30_000 + i),
        });
    }
    let mut annotations = BTreeMap::new();
    for _ in 0..u.int_in_range(0..=2)? {
        annotations.insert(pick(u, &ANNOTATIONS)?.to_string(), keys_text(u, Topology::Pooled)?);
    }
    let topology_keys = if u.ratio(1, 3)? {
        Some((0..u.int_in_range(0..=4)?).map(|_| pick(u, &LABEL_KEYS).map(str::to_string)).collect::<Result<Vec<_>>>()?)
    } else {
        None
    };
    let n = u.int_in_range(1..=200u8)?;
    let cluster_ips = families
        .iter()
        .map(|f| match f {
            Family::V4 => IpAddr::from([10, 96, 0, n]),
            Family::V6 => IpAddr::from([0xfd00, 0x96, 0, 0, 0, 0, 0, u16::from(n)]),
        })
        .collect();
    Ok(Service {
        id: ObjectRef::new("default", name),
        service_type: pick(u, &[ServiceType::ClusterIp, ServiceType::NodePort, ServiceType::LoadBalancer])?,
        cluster_ips,
        ports,
        topology_keys,
        annotations,
        internal_policy_local: u.arbitrary()?,
        external_policy_local: u.arbitrary()?,
        traffic_distribution: if u.arbitrary()? { Some(pick(u, &DISTRIBUTIONS)?.to_string()) } else { None },
        external_ips: if u.ratio(1, 4)? { vec![IpAddr::from([192, 0, 2, 10])] } else { Vec::new() },
        load_balancer_ips: if u.ratio(1, 4)? { vec![IpAddr::from([198, 51, 100, n])] } else { Vec::new() },
        health_check_node_port: u.arbitrary::<bool>()?.then_some(32_000),
        session_affinity: u.arbitrary::<bool>()?.then_some(10_800),
        load_balancer_source_ranges: None,
    })
}

fn model_slice(u: &mut Unstructured<'_>, i: usize, service_name: &str) -> Result<EndpointSlice> {
    let family = if u.arbitrary()? { Family::V4 } else { Family::V6 };
    let mut ports = Vec::new();
    for _ in 0..u.int_in_range(0..=3)? {
        ports.push(SlicePort {
            name: pick(u, &PORT_NAMES)?.to_string(),
            port: pick(u, &[8080u16, 8081, 53])?,
            protocol: if u.arbitrary()? { Protocol::Tcp } else { Protocol::Udp },
        });
    }
    let mut endpoints = Vec::new();
    for _ in 0..u.int_in_range(0..=6)? {
        let ready: bool = u.arbitrary()?;
        let zones = u.ratio(1, 3)?.then(|| vec![Arc::from(pick(u, &ZONES).unwrap_or("z1"))].into_boxed_slice());
        let nodes = u.ratio(1, 4)?.then(|| vec![Arc::from(pick(u, &NODES).unwrap_or("n1"))].into_boxed_slice());
        let topology = if u.ratio(1, 4)? {
            let l = labels(u)?;
            Some(Arc::new(l.into_iter().map(|(k, v)| (Arc::from(k.as_str()), Arc::from(v.as_str()))).collect()))
        } else {
            None
        };
        endpoints.push(Endpoint {
            address: ip(u, family),
            ready,
            serving: if u.ratio(1, 4)? { !ready } else { ready },
            terminating: u.ratio(1, 4)?,
            node_name: shared(u, &NODES)?,
            zone: shared(u, &ZONES)?,
            extra: EndpointExtra { hint_zones: zones, hint_nodes: nodes, topology }.boxed(),
        });
    }
    Ok(EndpointSlice {
        id: ObjectRef::new("default", format!("{service_name}-{i}")),
        service_name: service_name.to_string(),
        family,
        ports,
        endpoints,
    })
}

/// A cluster: up to three Services with slices (some shared by name, some
/// orphaned) and Nodes with topology labels.
pub fn cluster(u: &mut Unstructured<'_>) -> Result<Cluster> {
    let mut c = Cluster::default();
    for name in ["web", "api", "db"].iter().take(u.int_in_range(1..=3)?) {
        let svc = model_service(u, name)?;
        c.services.insert(svc.id.clone(), svc);
    }
    for i in 0..u.int_in_range(0..=5)? {
        let owner = pick(u, &["web", "api", "db", "orphan"])?;
        let s = model_slice(u, i, owner)?;
        c.slices.insert(s.id.clone(), s);
    }
    for name in NODES.iter().take(u.int_in_range(0..=NODES.len())?) {
        // The model's Node labels are shared strings (`intern`).
        let labels = labels(u)?.into_iter().map(|(k, v)| (k.into(), v.into())).collect();
        c.nodes.insert((*name).to_string(), Node { name: (*name).to_string(), labels, leaving: None });
    }
    Ok(c)
}
