//! discovery.k8s.io/v1beta1 EndpointSlices, the only version API servers
//! 1.17-1.20 serve (1.21-1.24 serve it beside v1; 1.25 removed it): their
//! wire shape, and their conversion into the v1 shape of `wire`, so that
//! one conversion (`objects::slice_from_wire`) builds the model from
//! either version.
//!
//! The conversion is the API server's own between the two versions
//! (pkg/apis/discovery/v1beta1/conversion.go,
//! `Convert_v1beta1_Endpoint_To_discovery_Endpoint`), plus the node name:
//! - `topology` held the labels the EndpointSlice controller copied from
//!   the endpoint's Node (`kubernetes.io/hostname`,
//!   `topology.kubernetes.io/zone`, `topology.kubernetes.io/region`).
//!   The zone becomes `zone` (from `failure-domain.beta.kubernetes.io/zone`
//!   when only that older label is there); the hostname is the node name
//!   when there is no `nodeName` (a field only from 1.20), as kube-proxy
//!   1.17-1.19 read it (`endpoint.Topology[v1.LabelHostname]`, compared with
//!   its own node name, pkg/proxy/endpointslicecache.go); what is left is
//!   v1's `deprecatedTopology`, which topology decisions read for
//!   endpoints whose Node the agent does not know.
//! - `conditions` had only `ready` before 1.20 (`serving` and
//!   `terminating` came with 1.20's EndpointSliceTerminatingCondition).
//!   They keep v1's defaults, which are how kube-proxy 1.17-1.20 read a
//!   v1beta1 endpoint: a missing `ready` is ready (`Ready == nil ||
//!   *Ready`); an endpoint not ready is then neither serving nor
//!   terminating, so it is never used, as kube-proxy dropped it.
//! - `hints` (1.21) have v1's shape.

use std::borrow::Cow;
use std::collections::BTreeMap;

use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::Deserialize;

use crate::source::wire::{FirstAddress, Name, WireConditions, WireEndpoint, WireHints, WireSlice, WireSlicePort, meta};
use crate::util::intern::intern;

/// The Node label the EndpointSlice controller copied as the endpoint's
/// node (`v1.LabelHostname`).
const LABEL_HOSTNAME: &str = "kubernetes.io/hostname";
/// The zone label (`v1.LabelTopologyZone`, 1.17 on).
const LABEL_ZONE: &str = "topology.kubernetes.io/zone";
/// The zone label before 1.17 (`v1.LabelFailureDomainBetaZone`), which
/// nodes of that era still carried.
const LABEL_ZONE_BETA: &str = "failure-domain.beta.kubernetes.io/zone";

/// discovery/v1beta1 EndpointSlice.
#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct WireSliceV1beta1 {
    #[serde(default, deserialize_with = "meta")]
    pub metadata: ObjectMeta,
    pub address_type: String,
    pub ports: Option<Vec<WireSlicePort>>,
    pub endpoints: Option<Vec<WireEndpointV1beta1>>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct WireEndpointV1beta1 {
    pub addresses: FirstAddress,
    pub conditions: Option<WireConditions>,
    pub topology: Option<BTreeMap<String, String>>,
    pub node_name: Option<Name>,
    pub hints: Option<WireHints>,
}

impl WireSliceV1beta1 {
    /// The same slice as discovery.k8s.io/v1 serves it.
    pub(crate) fn into_v1(self) -> WireSlice {
        WireSlice {
            metadata: self.metadata,
            address_type: self.address_type,
            ports: self.ports,
            endpoints: self.endpoints.map(|eps| eps.into_iter().map(WireEndpointV1beta1::into_v1).collect()),
        }
    }
}

impl WireEndpointV1beta1 {
    fn into_v1(self) -> WireEndpoint {
        let mut topology = self.topology.unwrap_or_default();
        let zone = topology.remove(LABEL_ZONE).or_else(|| topology.get(LABEL_ZONE_BETA).cloned()).filter(|z| !z.is_empty());
        let node_name = self.node_name.or_else(|| topology.get(LABEL_HOSTNAME).filter(|h| !h.is_empty()).map(|h| Name(intern(h))));
        // The API server drops the hostname from `deprecatedTopology` only
        // when it equals nodeName, so a hostname label that differs from
        // the node's name still matches as that label.
        if topology.get(LABEL_HOSTNAME).is_some_and(|h| node_name.as_ref().is_some_and(|n| *n.0 == **h)) {
            topology.remove(LABEL_HOSTNAME);
        }
        WireEndpoint {
            addresses: self.addresses,
            conditions: self.conditions,
            node_name,
            zone: zone.map(|z| Name(intern(&z))),
            hints: self.hints,
            deprecated_topology: (!topology.is_empty()).then_some(topology),
        }
    }
}

/// `/apis/discovery.k8s.io/v1beta1/endpointslices` (k8s-openapi no longer
/// has the type).
impl kube::Resource for WireSliceV1beta1 {
    type DynamicType = ();
    type Scope = NamespaceResourceScope;
    fn kind((): &()) -> Cow<'_, str> {
        Cow::Borrowed("EndpointSlice")
    }
    fn group((): &()) -> Cow<'_, str> {
        Cow::Borrowed("discovery.k8s.io")
    }
    fn version((): &()) -> Cow<'_, str> {
        Cow::Borrowed("v1beta1")
    }
    fn plural((): &()) -> Cow<'_, str> {
        Cow::Borrowed("endpointslices")
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
    use kube::Resource;
    use serde_json::json;

    use super::*;

    fn convert(endpoints: serde_json::Value) -> Vec<WireEndpoint> {
        let v = json!({"metadata": {"name": "s", "namespace": "n"}, "addressType": "IPv4", "endpoints": endpoints});
        let beta = WireSliceV1beta1::deserialize(&v).expect("v1beta1 slice");
        beta.into_v1().endpoints.expect("endpoints")
    }

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| ((*k).to_string(), (*v).to_string())).collect()
    }

    #[test]
    fn urls_name_v1beta1() {
        assert_eq!(WireSliceV1beta1::url_path(&(), None), "/apis/discovery.k8s.io/v1beta1/endpointslices");
        assert_eq!(WireSliceV1beta1::url_path(&(), Some("ns")), "/apis/discovery.k8s.io/v1beta1/namespaces/ns/endpointslices");
    }

    #[test]
    fn topology_becomes_node_zone_and_deprecated_topology() {
        let eps = convert(json!([
            // 1.17-1.19: hostname, zone and region in the map, no nodeName.
            {"addresses": ["10.0.0.1"], "conditions": {"ready": true},
             "topology": {"kubernetes.io/hostname": "n1", "topology.kubernetes.io/zone": "z1", "topology.kubernetes.io/region": "r1"}},
            // 1.20: nodeName, and a hostname label that differs from it.
            {"addresses": ["10.0.0.2"], "nodeName": "n2.example", "topology": {"kubernetes.io/hostname": "n2"}},
            // Only the pre-1.17 zone label.
            {"addresses": ["10.0.0.3"], "topology": {"failure-domain.beta.kubernetes.io/zone": "z0", "kubernetes.io/hostname": "n3"}},
            // Nothing at all.
            {"addresses": ["10.0.0.4"], "conditions": {"ready": false}, "hints": {"forZones": [{"name": "z1"}]}},
        ]));
        let node = |i: usize| eps[i].node_name.as_ref().map(|n| n.0.to_string());
        let zone = |i: usize| eps[i].zone.as_ref().map(|z| z.0.to_string());
        assert_eq!((node(0), zone(0)), (Some("n1".into()), Some("z1".into())));
        assert_eq!(eps[0].deprecated_topology, Some(labels(&[("topology.kubernetes.io/region", "r1")])));
        assert_eq!(node(1).as_deref(), Some("n2.example"), "nodeName wins over the hostname label");
        assert_eq!(eps[1].deprecated_topology, Some(labels(&[("kubernetes.io/hostname", "n2")])), "a differing hostname is kept");
        assert_eq!((node(2), zone(2)), (Some("n3".into()), Some("z0".into())));
        assert_eq!(eps[2].deprecated_topology, Some(labels(&[("failure-domain.beta.kubernetes.io/zone", "z0")])));
        assert_eq!((node(3), zone(3), eps[3].deprecated_topology.as_ref()), (None, None, None));
        assert_eq!(eps[3].conditions.and_then(|c| c.ready), Some(false));
        assert!(eps[3].hints.as_ref().and_then(|h| h.for_zones.as_ref()).is_some_and(|z| z.len() == 1));
    }

    #[test]
    fn wrong_types_fail_the_slice() {
        let v = json!({"metadata": {"name": "s"}, "addressType": "IPv4", "endpoints": [{"addresses": ["10.0.0.1"], "topology": ["zone"]}]});
        assert!(WireSliceV1beta1::deserialize(&v).is_err());
    }
}
