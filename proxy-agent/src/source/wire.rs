//! The shapes Services, EndpointSlices and Nodes are deserialized into, by
//! the watchers straight off the API server's response and by the manifest
//! reader from parsed YAML: only the fields conversion (`objects`) reads.
//!
//! Why not k8s-openapi's types: at 10k Services x 10 endpoints, a cold
//! list is 20k objects, and deserializing them was most of the agent's work
//! before its first sync (cold sync through the API server).
//! The typed structs allocate every field of every endpoint (targetRef's
//! five strings, deprecatedTopology, ...) and every field of
//! `metadata.managedFields`, which a real cluster fills on every object;
//! here unknown fields are skipped without allocating (serde's
//! `IgnoredAny`), an endpoint's address is parsed from the borrowed text,
//! and node, zone and hint names go straight to the shared copies
//! (`intern`) that the model keeps.
//!
//! Field names and optionality follow core/v1 Service and discovery/v1
//! EndpointSlice. A value of the wrong JSON type fails the whole object, as
//! it did with the typed structs; the API server validates these built-in
//! types, so from a watch that means a broken server, which the watcher
//! reports per kind and retries, and from a manifest it is that object's
//! "malformed" error.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;

use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::Deserialize;
use serde::de::{self, Deserializer, IgnoredAny, SeqAccess, Visitor};
use serde_json::Value;

use crate::util::intern::intern;

/// The metadata conversion reads; `managedFields`, `ownerReferences`,
/// `finalizers` and the rest are skipped.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct WireMeta {
    name: Option<String>,
    namespace: Option<String>,
    uid: Option<String>,
    resource_version: Option<String>,
    labels: Option<BTreeMap<String, String>>,
    annotations: Option<BTreeMap<String, String>>,
}

/// kube's `Resource` hands out an `ObjectMeta`, so the slim metadata is
/// moved into one (the fields not read stay empty).
pub(super) fn meta<'de, D: Deserializer<'de>>(d: D) -> Result<ObjectMeta, D::Error> {
    let m = Option::<WireMeta>::deserialize(d)?;
    Ok(m.map(|m| ObjectMeta {
        name: m.name,
        namespace: m.namespace,
        uid: m.uid,
        resource_version: m.resource_version,
        labels: m.labels,
        annotations: m.annotations,
        ..ObjectMeta::default()
    })
    .unwrap_or_default())
}

/// core/v1 Service.
#[derive(Clone, Debug, Default, Deserialize)]
pub(crate) struct WireService {
    #[serde(default, deserialize_with = "meta")]
    pub metadata: ObjectMeta,
    pub spec: Option<WireServiceSpec>,
    pub status: Option<WireServiceStatus>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct WireServiceSpec {
    #[serde(rename = "type")]
    pub type_: Option<String>,
    #[serde(rename = "clusterIP")]
    pub cluster_ip: Option<String>,
    #[serde(rename = "clusterIPs")]
    pub cluster_ips: Option<Vec<String>>,
    pub ports: Option<Vec<WireServicePort>>,
    /// Kubernetes 1.17-1.21 only; kept raw so that a manifest with the
    /// wrong shape gets its own error rather than "malformed".
    pub topology_keys: Option<Value>,
    #[serde(rename = "externalIPs")]
    pub external_ips: Option<Vec<String>>,
    pub external_traffic_policy: Option<String>,
    pub internal_traffic_policy: Option<String>,
    pub traffic_distribution: Option<String>,
    pub health_check_node_port: Option<i32>,
    pub session_affinity: Option<String>,
    pub session_affinity_config: Option<WireSessionAffinityConfig>,
    pub load_balancer_source_ranges: Option<Vec<String>>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct WireSessionAffinityConfig {
    #[serde(rename = "clientIP")]
    pub client_ip: Option<WireClientIpConfig>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct WireClientIpConfig {
    pub timeout_seconds: Option<i64>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct WireServicePort {
    pub name: Option<String>,
    pub port: i32,
    pub protocol: Option<String>,
    pub node_port: Option<i32>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct WireServiceStatus {
    pub load_balancer: Option<WireLoadBalancer>,
}

#[derive(Clone, Debug, Default, Deserialize)]
pub(crate) struct WireLoadBalancer {
    pub ingress: Option<Vec<WireIngress>>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct WireIngress {
    pub ip: Option<String>,
    /// `VIP` (the default) or `Proxy` (KEP-1860, Kubernetes >= 1.29).
    pub ip_mode: Option<String>,
}

/// discovery/v1 EndpointSlice.
#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct WireSlice {
    #[serde(default, deserialize_with = "meta")]
    pub metadata: ObjectMeta,
    pub address_type: String,
    pub ports: Option<Vec<WireSlicePort>>,
    pub endpoints: Option<Vec<WireEndpoint>>,
}

#[derive(Clone, Debug, Deserialize)]
pub(crate) struct WireSlicePort {
    pub name: Option<String>,
    /// Absent means "all ports" (discovery/v1).
    pub port: Option<i32>,
    pub protocol: Option<String>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct WireEndpoint {
    pub addresses: FirstAddress,
    pub conditions: Option<WireConditions>,
    pub node_name: Option<Name>,
    pub zone: Option<Name>,
    pub hints: Option<WireHints>,
    /// The v1beta1 `topology` labels that have no field of their own in v1
    /// (API servers 1.21-1.24 serve them on slices written through
    /// v1beta1; `wire_v1beta1` fills it when converting).
    pub deprecated_topology: Option<BTreeMap<String, String>>,
}

#[derive(Clone, Copy, Debug, Default, Deserialize)]
pub(crate) struct WireConditions {
    pub ready: Option<bool>,
    pub serving: Option<bool>,
    pub terminating: Option<bool>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct WireHints {
    pub for_zones: Option<Vec<NamedRef>>,
    pub for_nodes: Option<Vec<NamedRef>>,
}

/// `{name: ...}`, as in `hints.forZones[]` and `hints.forNodes[]`.
#[derive(Clone, Debug, Deserialize)]
pub(crate) struct NamedRef {
    pub name: Name,
}

/// A node, zone or hint name, as the shared copy the model keeps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Name(pub Arc<str>);

impl<'de> Deserialize<'de> for Name {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Name, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Name;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            // serde_json passes borrowed text here when it has no escapes,
            // so a name that is already shared costs no allocation.
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Name, E> {
                Ok(Name(intern(s)))
            }
        }
        d.deserialize_str(V)
    }
}

/// The first of an endpoint's `addresses`: Kubernetes documents them as
/// fungible and every consumer uses the first, so the rest are skipped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum FirstAddress {
    Missing,
    Ip(IpAddr),
    /// Not an IP address; kept as written, for the error.
    Invalid(String),
}

impl<'de> Deserialize<'de> for FirstAddress {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<FirstAddress, D::Error> {
        struct Text(FirstAddress);
        impl<'de> Deserialize<'de> for Text {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Text, D::Error> {
                struct V;
                impl Visitor<'_> for V {
                    type Value = Text;
                    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                        f.write_str("an address")
                    }
                    fn visit_str<E: de::Error>(self, s: &str) -> Result<Text, E> {
                        Ok(Text(match s.trim().parse() {
                            Ok(ip) => FirstAddress::Ip(ip),
                            Err(_) => FirstAddress::Invalid(s.to_string()),
                        }))
                    }
                }
                d.deserialize_str(V)
            }
        }
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = FirstAddress;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a list of addresses")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<FirstAddress, A::Error> {
                let first = seq.next_element::<Text>()?.map_or(FirstAddress::Missing, |t| t.0);
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(first)
            }
        }
        d.deserialize_seq(V)
    }
}

/// The identity kube's `Api` builds URLs from (`/api/v1/services`,
/// `/apis/discovery.k8s.io/v1/endpointslices`).
macro_rules! resource {
    ($ty:ty, $kind:literal, $group:literal, $version:literal, $plural:literal) => {
        impl kube::Resource for $ty {
            type DynamicType = ();
            type Scope = NamespaceResourceScope;
            fn kind(_: &()) -> Cow<'_, str> {
                Cow::Borrowed($kind)
            }
            fn group(_: &()) -> Cow<'_, str> {
                Cow::Borrowed($group)
            }
            fn version(_: &()) -> Cow<'_, str> {
                Cow::Borrowed($version)
            }
            fn plural(_: &()) -> Cow<'_, str> {
                Cow::Borrowed($plural)
            }
            fn meta(&self) -> &ObjectMeta {
                &self.metadata
            }
            fn meta_mut(&mut self) -> &mut ObjectMeta {
                &mut self.metadata
            }
        }
    };
}

resource!(WireService, "Service", "", "v1", "services");
resource!(WireSlice, "EndpointSlice", "discovery.k8s.io", "v1", "endpointslices");

/// What the agent reads of a Node's metadata: its labels (topology) and
/// whether it is being deleted (this node's health).
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct WireNodeMeta {
    name: Option<String>,
    resource_version: Option<String>,
    labels: Option<BTreeMap<String, String>>,
    deletion_timestamp: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
}

fn node_meta<'de, D: Deserializer<'de>>(d: D) -> Result<ObjectMeta, D::Error> {
    let m = Option::<WireNodeMeta>::deserialize(d)?;
    Ok(m.map(|m| ObjectMeta {
        name: m.name,
        resource_version: m.resource_version,
        labels: m.labels,
        deletion_timestamp: m.deletion_timestamp,
        ..ObjectMeta::default()
    })
    .unwrap_or_default())
}

/// core/v1 Node: the metadata above and the keys of `spec.taints`. Most of
/// a Node is `status` (conditions, addresses, images, heartbeats), which
/// changes every few seconds on a real node; it is skipped here without
/// being allocated, and the model changes only when labels, deletion or
/// taints do (metadata-only watches would save the bytes on the wire too,
/// but carry no taints, and the cluster autoscaler marks a node it is about
/// to remove with one).
#[derive(Clone, Debug, Default, Deserialize)]
pub(crate) struct WireNode {
    #[serde(default, deserialize_with = "node_meta")]
    pub metadata: ObjectMeta,
    pub spec: Option<WireNodeSpec>,
}

#[derive(Clone, Debug, Default, Deserialize)]
pub(crate) struct WireNodeSpec {
    pub taints: Option<Vec<WireTaint>>,
}

/// A taint's key; its value and effect do not matter to the agent.
#[derive(Clone, Debug, Deserialize)]
pub(crate) struct WireTaint {
    pub key: Option<String>,
}

impl kube::Resource for WireNode {
    type DynamicType = ();
    type Scope = k8s_openapi::ClusterResourceScope;
    fn kind((): &()) -> Cow<'_, str> {
        Cow::Borrowed("Node")
    }
    fn group((): &()) -> Cow<'_, str> {
        Cow::Borrowed("")
    }
    fn version((): &()) -> Cow<'_, str> {
        Cow::Borrowed("v1")
    }
    fn plural((): &()) -> Cow<'_, str> {
        Cow::Borrowed("nodes")
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::Resource;
    use serde_json::json;

    #[test]
    fn urls_match_the_typed_resources() {
        use k8s_openapi::api::core::v1::Service;
        use k8s_openapi::api::discovery::v1::EndpointSlice;
        assert_eq!(WireService::url_path(&(), Some("ns")), Service::url_path(&(), Some("ns")));
        assert_eq!(WireSlice::url_path(&(), None), EndpointSlice::url_path(&(), None));
        assert_eq!(WireSlice::api_version(&()), "discovery.k8s.io/v1");
    }

    #[test]
    fn endpoints_keep_the_first_address_and_shared_names() {
        let v = json!({
            "metadata": {"name": "s", "namespace": "n", "resourceVersion": "3",
                         "managedFields": [{"manager": "kube-controller-manager", "fieldsV1": {"f:endpoints": {}}}]},
            "addressType": "IPv4",
            "endpoints": [
                {"addresses": [" 10.0.0.1", "10.0.0.2"], "nodeName": "node-a", "zone": "z1",
                 "targetRef": {"kind": "Pod", "name": "p", "uid": "u"}, "hints": {"forZones": [{"name": "z1"}]}},
                {"addresses": ["nope"], "conditions": {"ready": false}},
                {"addresses": []}
            ]
        });
        let s = WireSlice::deserialize(&v).expect("slice");
        assert_eq!(s.metadata.resource_version.as_deref(), Some("3"));
        assert!(s.metadata.managed_fields.is_none());
        let eps = s.endpoints.expect("endpoints");
        assert_eq!(eps[0].addresses, FirstAddress::Ip("10.0.0.1".parse().expect("ip")));
        assert_eq!(eps[1].addresses, FirstAddress::Invalid("nope".into()));
        assert_eq!(eps[2].addresses, FirstAddress::Missing);
        let zone = eps[0].zone.as_ref().expect("zone");
        let hint = &eps[0].hints.as_ref().and_then(|h| h.for_zones.as_ref()).expect("hints")[0].name;
        assert!(Arc::ptr_eq(&zone.0, &hint.0), "one shared copy per name");
        assert_eq!(eps[1].conditions.and_then(|c| c.ready), Some(false));
    }

    #[test]
    fn nodes_keep_labels_deletion_and_taint_keys_only() {
        use k8s_openapi::api::core::v1::Node;
        assert_eq!(WireNode::url_path(&(), None), Node::url_path(&(), None));
        let v = json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": "n1", "resourceVersion": "9", "labels": {"topology.kubernetes.io/zone": "z1"},
                         "deletionTimestamp": "2024-05-01T10:00:00Z", "annotations": {"a": "b"},
                         "managedFields": [{"manager": "kubelet"}]},
            "spec": {"podCIDR": "10.244.1.0/24",
                     "taints": [{"key": "ToBeDeletedByClusterAutoscaler", "value": "1714557600", "effect": "NoSchedule"}, {"effect": "NoExecute"}]},
            "status": {"conditions": [{"type": "Ready", "status": "True", "lastHeartbeatTime": "2024-05-01T10:00:00Z"}],
                       "images": [{"names": ["registry/x:1"], "sizeBytes": 1}]}
        });
        let n = WireNode::deserialize(&v).expect("node");
        assert_eq!(n.metadata.name.as_deref(), Some("n1"));
        assert_eq!(n.metadata.resource_version.as_deref(), Some("9"));
        assert!(n.metadata.deletion_timestamp.is_some());
        assert!(n.metadata.annotations.is_none() && n.metadata.managed_fields.is_none());
        let taints = n.spec.and_then(|s| s.taints).expect("taints");
        assert_eq!(taints.iter().map(|t| t.key.as_deref()).collect::<Vec<_>>(), [Some("ToBeDeletedByClusterAutoscaler"), None]);
        let bare = WireNode::deserialize(&json!({"metadata": {"name": "n2"}})).expect("bare node");
        assert!(bare.spec.is_none() && bare.metadata.deletion_timestamp.is_none());
    }

    #[test]
    fn wrong_types_are_errors_and_nulls_are_absent() {
        let bad = json!({"metadata": {"name": "s"}, "spec": {"ports": [{"port": "http"}]}});
        assert!(WireService::deserialize(&bad).is_err());
        let nulls = json!({"metadata": null, "spec": {"topologyKeys": null, "ports": null}, "status": null});
        let s = WireService::deserialize(&nulls).expect("nulls");
        assert!(s.metadata.name.is_none());
        assert!(s.spec.is_some_and(|s| s.topology_keys.is_none() && s.ports.is_none()));
    }
}
