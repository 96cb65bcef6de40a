//! Nodes as a kubelet keeps them: what `kubectl get node -o json
//! --show-managed-fields` prints for a worker of a cloud cluster, about
//! 10 KB of JSON each, so that a watch of Nodes costs what it costs in a
//! real cluster.
//!
//! - labels: hostname, zone and region (current and `failure-domain.beta`),
//!   instance type, os and arch (current and `beta`), a node pool
//!   (`openyurt.io/nodepool`);
//! - annotations the kubelet, the node controller and a CNI (Calico) write;
//! - `metadata.managedFields` as the kubelet (labels and annotations;
//!   status), the kube-controller-manager (podCIDR, ttl) and the CNI (its
//!   annotation; its condition) leave them;
//! - `status`: the kubelet's four conditions and a CNI's
//!   `NetworkUnavailable`, each with `lastHeartbeatTime`; 30 images (a
//!   digest and a tag each, with their sizes); `nodeInfo`; capacity and
//!   allocatable; addresses; the kubelet endpoint.
//!
//! A status report ([`report_status`]) is what a kubelet's status update
//! changes: the `lastHeartbeatTime` of its four conditions and the time of
//! its status entry in managedFields (the API server gives it a new
//! resourceVersion).

use serde_json::{Value, json};

/// Regions the Nodes spread over, zones per region, node pools.
const REGIONS: usize = 3;
const ZONES: usize = 3;
const POOLS: usize = 10;
/// The labels the kubelet's managedFields entry owns (all but the pool).
const KUBELET_LABELS: [&str; 11] = [
    "beta.kubernetes.io/arch",
    "beta.kubernetes.io/instance-type",
    "beta.kubernetes.io/os",
    "failure-domain.beta.kubernetes.io/region",
    "failure-domain.beta.kubernetes.io/zone",
    "kubernetes.io/arch",
    "kubernetes.io/hostname",
    "kubernetes.io/os",
    "node.kubernetes.io/instance-type",
    "topology.kubernetes.io/region",
    "topology.kubernetes.io/zone",
];
/// The kubelet's conditions; `NetworkUnavailable` is the CNI's.
const KUBELET_CONDITIONS: [(&str, &str, &str, &str); 4] = [
    ("MemoryPressure", "False", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
    ("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
    ("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
    ("Ready", "True", "KubeletReady", "kubelet is posting ready status"),
];
/// Images a worker typically holds: the system DaemonSets' and the
/// workloads'. (repository, tag, size in bytes)
const IMAGES: [(&str, &str, u64); 30] = [
    ("docker.io/calico/node", "v3.28.0", 99_186_344),
    ("registry.k8s.io/pause", "3.9", 298_689),
    ("registry.k8s.io/kube-proxy", "v1.30.2", 28_109_410),
    ("registry.k8s.io/coredns/coredns", "v1.11.1", 18_309_840),
    ("docker.io/calico/cni", "v3.28.0", 9_146_470),
    ("docker.io/calico/typha", "v3.28.0", 8_960_912),
    ("docker.io/calico/csi", "v3.28.0", 99_631_284),
    ("quay.io/prometheus/node-exporter", "v1.8.1", 11_623_004),
    ("cr.fluentbit.io/fluent/fluent-bit", "3.0.7", 34_114_821),
    ("docker.io/datadog/agent", "7.54.1", 289_775_014),
    ("registry.k8s.io/ingress-nginx/controller", "v1.10.1", 105_371_908),
    ("quay.io/jetstack/cert-manager-controller", "v1.15.1", 12_440_118),
    ("docker.io/istio/proxyv2", "1.22.2", 96_840_622),
    ("docker.io/library/nginx", "1.27.0-alpine", 20_520_412),
    ("docker.io/library/redis", "7.2.5-alpine", 17_223_040),
    ("docker.io/bitnami/postgresql", "16.3.0", 102_155_713),
    ("ghcr.io/acme/payments-api", "2024.06.27", 143_909_332),
    ("ghcr.io/acme/payments-worker", "2024.06.27", 139_117_204),
    ("ghcr.io/acme/search", "2024.06.25", 211_406_875),
    ("ghcr.io/acme/indexer", "2024.06.25", 198_342_512),
    ("ghcr.io/acme/frontend", "2024.06.28", 58_201_377),
    ("ghcr.io/acme/bff", "2024.06.28", 77_809_123),
    ("ghcr.io/acme/auth", "2024.06.20", 66_610_904),
    ("ghcr.io/acme/feature-flags", "2024.05.30", 41_022_817),
    ("ghcr.io/acme/batch-runner", "2024.06.11", 254_119_086),
    ("ghcr.io/acme/mailer", "2024.06.03", 45_871_003),
    ("ghcr.io/acme/reports", "2024.06.14", 132_004_557),
    ("docker.io/confluentinc/cp-kafka-connect", "7.6.1", 488_553_201),
    ("docker.io/grafana/promtail", "3.0.0", 73_334_098),
    ("docker.io/otel/opentelemetry-collector", "0.103.0", 61_220_761),
];

/// A Node's name: `node-1` .. `node-N`.
pub(crate) fn name(i: usize) -> String {
    format!("node-{i}")
}

/// Its region (`region-1` .. `region-3`).
pub(crate) fn region(i: usize) -> String {
    format!("region-{}", i % REGIONS + 1)
}

/// Its zone (`region-1a` .. `region-3c`).
pub(crate) fn zone(i: usize) -> String {
    format!("{}{}", region(i), ["a", "b", "c"][(i / REGIONS) % ZONES])
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// `len` hex digits derived from `seed`.
fn hex(seed: u64, len: usize) -> String {
    let mut s = String::with_capacity(len + 16);
    let mut k = 0;
    while s.len() < len {
        s.push_str(&format!("{:016x}", splitmix(seed.wrapping_mul(31).wrapping_add(k))));
        k += 1;
    }
    s.truncate(len);
    s
}

fn uuid(seed: u64) -> String {
    let h = hex(seed, 32);
    format!("{}-{}-{}-{}-{}", &h[..8], &h[8..12], &h[12..16], &h[16..20], &h[20..])
}

/// Node `i` (1-based; [`name`]) created at `created`, whose last status
/// report was at `heartbeat` (RFC 3339, seconds).
pub(crate) fn node(i: usize, created: &str, heartbeat: &str) -> Value {
    let name = name(i);
    let (region, zone) = (region(i), zone(i));
    let ip = format!("10.{}.{}.{}", 16 + i / 65_536, (i / 256) % 256, i % 256);
    let pod_cidr = format!("100.{}.{}.0/24", 64 + (i / 256) % 64, i % 256);
    let instance = format!("i-0{}", hex(i as u64, 16));
    let pool = format!("pool-{}", i % POOLS + 1);
    let mut labels = serde_json::Map::new();
    for key in KUBELET_LABELS {
        let v = match key {
            "beta.kubernetes.io/arch" | "kubernetes.io/arch" => "amd64".to_string(),
            "beta.kubernetes.io/os" | "kubernetes.io/os" => "linux".to_string(),
            "beta.kubernetes.io/instance-type" | "node.kubernetes.io/instance-type" => "m6i.2xlarge".to_string(),
            "failure-domain.beta.kubernetes.io/region" | "topology.kubernetes.io/region" => region.clone(),
            "kubernetes.io/hostname" => name.clone(),
            _ => zone.clone(),
        };
        labels.insert(key.into(), json!(v));
    }
    labels.insert("openyurt.io/nodepool".into(), json!(pool));
    let label_fields: serde_json::Map<String, Value> =
        std::iter::once((".".to_string(), json!({}))).chain(KUBELET_LABELS.iter().map(|k| (format!("f:{k}"), json!({})))).collect();
    let condition_fields = |owner_kubelet: bool| -> Value {
        let mut m = serde_json::Map::new();
        let types: Vec<&str> = if owner_kubelet { KUBELET_CONDITIONS.iter().map(|c| c.0).collect() } else { vec!["NetworkUnavailable"] };
        for t in types {
            m.insert(
                format!("k:{{\"type\":\"{t}\"}}"),
                json!({".": {}, "f:lastHeartbeatTime": {}, "f:lastTransitionTime": {}, "f:message": {}, "f:reason": {}, "f:status": {}, "f:type": {}}),
            );
        }
        if owner_kubelet {
            m.insert(".".into(), json!({}));
        }
        Value::Object(m)
    };
    let resources = json!({".": {}, "f:cpu": {}, "f:ephemeral-storage": {}, "f:hugepages-1Gi": {}, "f:hugepages-2Mi": {}, "f:memory": {}, "f:pods": {}});
    let managed = json!([
        {"apiVersion": "v1", "fieldsType": "FieldsV1", "manager": "kubelet", "operation": "Update", "time": created,
         "fieldsV1": {"f:metadata": {
             "f:annotations": {".": {}, "f:alpha.kubernetes.io/provided-node-ip": {}, "f:volumes.kubernetes.io/controller-managed-attach-detach": {}},
             "f:labels": label_fields},
             "f:spec": {"f:providerID": {}}}},
        {"apiVersion": "v1", "fieldsType": "FieldsV1", "manager": "kube-controller-manager", "operation": "Update", "time": created,
         "fieldsV1": {"f:metadata": {"f:annotations": {"f:node.alpha.kubernetes.io/ttl": {}}},
             "f:spec": {"f:podCIDR": {}, "f:podCIDRs": {".": {}, format!("v:\"{pod_cidr}\""): {}}}}},
        {"apiVersion": "v1", "fieldsType": "FieldsV1", "manager": "calico-node", "operation": "Update", "time": created,
         "fieldsV1": {"f:metadata": {"f:annotations": {"f:projectcalico.org/IPv4Address": {}}}}},
        {"apiVersion": "v1", "fieldsType": "FieldsV1", "manager": "calico-node", "operation": "Update", "subresource": "status", "time": created,
         "fieldsV1": {"f:status": {"f:conditions": condition_fields(false)}}},
        {"apiVersion": "v1", "fieldsType": "FieldsV1", "manager": "kubelet", "operation": "Update", "subresource": "status", "time": heartbeat,
         "fieldsV1": {"f:status": {
             "f:addresses": {".": {}, "k:{\"type\":\"Hostname\"}": {".": {}, "f:address": {}, "f:type": {}}, "k:{\"type\":\"InternalDNS\"}": {".": {}, "f:address": {}, "f:type": {}}, "k:{\"type\":\"InternalIP\"}": {".": {}, "f:address": {}, "f:type": {}}},
             "f:allocatable": resources, "f:capacity": resources,
             "f:conditions": condition_fields(true),
             "f:daemonEndpoints": {"f:kubeletEndpoint": {"f:Port": {}}},
             "f:images": {},
             "f:nodeInfo": {"f:architecture": {}, "f:bootID": {}, "f:containerRuntimeVersion": {}, "f:kernelVersion": {}, "f:kubeProxyVersion": {}, "f:kubeletVersion": {}, "f:machineID": {}, "f:operatingSystem": {}, "f:osImage": {}, "f:systemUUID": {}}}}},
    ]);
    let mut conditions: Vec<Value> = vec![json!({
        "lastHeartbeatTime": created, "lastTransitionTime": created, "message": "Calico is running on this node",
        "reason": "CalicoIsUp", "status": "False", "type": "NetworkUnavailable"})];
    conditions.extend(KUBELET_CONDITIONS.iter().map(|(t, status, reason, message)| {
        json!({"lastHeartbeatTime": heartbeat, "lastTransitionTime": created, "message": message, "reason": reason, "status": status, "type": t})
    }));
    let images: Vec<Value> = IMAGES
        .iter()
        .enumerate()
        .map(|(k, (repo, tag, size))| json!({"names": [format!("{repo}@sha256:{}", hex(1000 + k as u64, 64)), format!("{repo}:{tag}")], "sizeBytes": size}))
        .collect();
    json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": labels,
            "annotations": {
                "alpha.kubernetes.io/provided-node-ip": ip,
                "projectcalico.org/IPv4Address": format!("{ip}/16"),
                "node.alpha.kubernetes.io/ttl": "0",
                "volumes.kubernetes.io/controller-managed-attach-detach": "true",
            },
            "managedFields": managed,
        },
        "spec": {"podCIDR": pod_cidr, "podCIDRs": [pod_cidr], "providerID": format!("aws:///{zone}/{instance}")},
        "status": {
            "addresses": [
                {"address": ip, "type": "InternalIP"},
                {"address": format!("ip-{}.{region}.compute.internal", ip.replace('.', "-")), "type": "InternalDNS"},
                {"address": name, "type": "Hostname"},
            ],
            "allocatable": {"cpu": "7910m", "ephemeral-storage": "95491281146", "hugepages-1Gi": "0", "hugepages-2Mi": "0", "memory": "31482524Ki", "pods": "58"},
            "capacity": {"cpu": "8", "ephemeral-storage": "104845292Ki", "hugepages-1Gi": "0", "hugepages-2Mi": "0", "memory": "32408732Ki", "pods": "58"},
            "conditions": conditions,
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "images": images,
            "nodeInfo": {
                "architecture": "amd64",
                "bootID": uuid(2 * i as u64),
                "containerRuntimeVersion": "containerd://1.7.11",
                "kernelVersion": "5.10.219-208.866.amzn2.x86_64",
                "kubeProxyVersion": "v1.30.2-eks-1552ad0",
                "kubeletVersion": "v1.30.2-eks-1552ad0",
                "machineID": hex(3 * i as u64, 32),
                "operatingSystem": "linux",
                "osImage": "Amazon Linux 2",
                "systemUUID": format!("ec2{}", &uuid(5 * i as u64)[3..]),
            },
        },
    })
}

/// A kubelet's status report on `node` at `now`: its conditions'
/// `lastHeartbeatTime` and its status entry's time in managedFields.
pub(crate) fn report_status(node: &mut Value, now: &str) {
    if let Some(conditions) = node.pointer_mut("/status/conditions").and_then(Value::as_array_mut) {
        for c in conditions.iter_mut().filter(|c| KUBELET_CONDITIONS.iter().any(|k| c["type"] == k.0)) {
            c["lastHeartbeatTime"] = json!(now);
        }
    }
    if let Some(entries) = node.pointer_mut("/metadata/managedFields").and_then(Value::as_array_mut) {
        for e in entries.iter_mut().filter(|e| e["manager"] == "kubelet" && e["subresource"] == "status") {
            e["time"] = json!(now);
        }
    }
}

/// Now, as the API server writes times (RFC 3339, whole seconds, UTC).
pub(crate) fn now_rfc3339() -> String {
    let now = k8s_openapi::jiff::Timestamp::now();
    k8s_openapi::jiff::Timestamp::from_second(now.as_second()).map_or_else(|_| now.to_string(), |t| t.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_is_9_to_12_kb_and_a_report_changes_only_heartbeats() {
        let t0 = "2024-06-28T10:00:00Z";
        let mut n = node(4321, "2024-06-01T08:00:00Z", t0);
        let size = n.to_string().len();
        assert!((9_000..=12_000).contains(&size), "{size} bytes");
        let before = n.to_string();
        report_status(&mut n, "2024-06-28T10:00:40Z");
        let after = n.to_string();
        assert_eq!(before.len(), after.len());
        assert_eq!(before.matches(t0).count(), 5, "four conditions and the kubelet's status entry");
        assert_eq!(after.matches("2024-06-28T10:00:40Z").count(), 5);
    }
}
