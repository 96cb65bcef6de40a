//! The loop from manifest text to map contents, with the maps in
//! memory: YAML -> deltas -> model -> decisions -> plan -> maps, as
//! `run` wires it, without root or a kernel.

use super::*;
use crate::model::{Backend, Frontend, Protocol};
use crate::source::manifest_watch::{Known, read_text, relist};
use crate::sync::pass::MemoryMaps;

struct Harness {
    sync: SyncLoop<MemoryMaps>,
    known: Known,
}

impl Harness {
    fn new(node: &str, capacity: Option<u32>) -> Harness {
        Self::waiting(node, capacity, Duration::from_secs(10))
    }

    /// With `node_label_wait` as `--node-label-wait-secs`.
    fn waiting(node: &str, capacity: Option<u32>, node_label_wait: Duration) -> Harness {
        let config = SyncConfig {
            node: node.into(),
            min_sync_interval: Duration::ZERO,
            sync_period: Duration::from_secs(30),
            terminate_tcp: TcpTermination::Gone,
            node_label_wait,
        };
        let maps = MemoryMaps { capacity, ..MemoryMaps::default() };
        let health = Arc::new(Health::new(Duration::from_mins(1)));
        Harness { sync: SyncLoop::new(config, maps, Stores::default(), Arc::new(Metrics::new()), health, None), known: Known::new() }
    }

    /// Hands the manifest over as the manifest source does, then runs a
    /// sync if every kind has been listed.
    fn read(&mut self, text: &str) -> SyncStats {
        let read = read_text(text);
        assert!(read.errors.is_empty(), "{:?}", read.errors);
        self.sync.stores.push_all(relist(&mut self.known, read.deltas));
        for kind in Kind::ALL {
            self.sync.handle(Signal::Listed { kind });
        }
        self.sync_if_listed()
    }

    fn sync_if_listed(&mut self) -> SyncStats {
        let before = self.sync.writer.programmed.clone();
        if self.sync.all_listed() {
            self.sync.sync_now();
        }
        SyncStats { changed: before != self.sync.writer.programmed }
    }

    fn backends(&self, ip: &str, port: u16) -> Option<Vec<String>> {
        let fe = Frontend { ip: ip.parse().ok()?, port, protocol: Protocol::Tcp };
        self.sync.writer.programmed.get(&fe).map(|b| b.iter().map(Backend::to_string).collect())
    }

    fn metrics(&self) -> String {
        self.sync.metrics.encode()
    }
}

struct SyncStats {
    changed: bool,
}

const NODES: &str = "
kind: Node
metadata: {name: a, labels: {topology.kubernetes.io/zone: z1}}
---
kind: Node
metadata: {name: b, labels: {topology.kubernetes.io/zone: z2}}
";

fn service(name: &str, ip: &str, extra: &str) -> String {
    format!(
        "---
kind: Service
metadata: {{name: {name}, namespace: shop{extra}}}
spec: {{clusterIP: {ip}, ports: [{{port: 80, targetPort: 8080}}]}}
"
    )
}

fn slice(service: &str, endpoints: &[(&str, &str)]) -> String {
    let eps: Vec<String> = endpoints.iter().map(|(ip, node)| format!("{{addresses: [{ip}], nodeName: {node}}}")).collect();
    format!(
        "---
kind: EndpointSlice
metadata: {{name: {service}-1, namespace: shop, labels: {{kubernetes.io/service-name: {service}}}}}
addressType: IPv4
ports: [{{port: 8080}}]
endpoints: [{}]
",
        eps.join(", ")
    )
}

/// The first list decided ahead (`apply_first_list`, while the
/// datapath installs) programs what deciding it in the first pass does,
/// with whatever changed in between: an edit, a deletion, a Node's
/// labels (which decide everything again).
#[test]
fn a_first_list_decided_ahead_programs_the_same() {
    let keys = ", annotations: {topoproxy.io/topology-keys: \"topology.kubernetes.io/zone,*\"}";
    let first = format!(
        "{NODES}{}{}{}{}{}",
        service("web", "10.96.0.10", ""),
        service("db", "10.96.0.20", keys),
        service("gone", "10.96.0.30", ""),
        slice("web", &[("10.244.1.1", "a"), ("10.244.2.1", "b")]),
        slice("db", &[("10.244.1.2", "a"), ("10.244.2.2", "b")]),
    );
    let edited = format!(
        "{NODES}{}{}{}{}",
        service("web", "10.96.0.10", ""),
        service("db", "10.96.0.20", keys),
        slice("web", &[("10.244.2.1", "b")]),
        slice("db", &[("10.244.1.2", "a"), ("10.244.2.2", "b")]),
    );
    let relabelled = edited.replace("zone: z1", "zone: z2");
    for (name, then) in [("nothing in between", first.as_str()), ("an edit in between", &edited), ("Node labels in between", &relabelled)] {
        // Deciding at the first pass what is there then.
        let mut plain = Harness::new("a", None);
        plain.read(then);
        // The first list decided ahead, the rest applied by the pass.
        let mut ahead = Harness::new("a", None);
        let read = read_text(&first);
        ahead.sync.stores.push_all(relist(&mut ahead.known, read.deltas));
        let listed = apply_first_list(&ahead.sync.stores, false, "a");
        let Harness { sync, known } = ahead;
        let mut ahead = Harness { sync: sync.with_first_list(listed), known };
        assert!(ahead.sync.cached.decided_ahead(), "{name}");
        ahead.read(then);
        assert!(!ahead.sync.cached.decided_ahead(), "{name}: the first pass took it");
        assert_eq!(ahead.sync.writer.programmed, plain.sync.writer.programmed, "{name}");
        assert_eq!(ahead.sync.writer.policies, plain.sync.writer.policies, "{name}");
        assert!(ahead.sync.health.is_ready(), "{name}");
        // And the passes after it follow edits alike.
        plain.read(&first);
        ahead.read(&first);
        assert_eq!(ahead.sync.writer.programmed, plain.sync.writer.programmed, "{name}: the next pass");
    }
}

#[test]
fn manifests_become_map_contents_and_follow_edits() {
    let mut h = Harness::new("a", None);
    let web = service("web", "10.96.0.10", "");
    let text = format!("{NODES}{web}{}", slice("web", &[("10.244.1.1", "a"), ("10.244.2.1", "b")]));
    assert!(h.read(&text).changed);
    assert_eq!(h.backends("10.96.0.10", 80), Some(vec!["10.244.1.1:8080".into(), "10.244.2.1:8080".into()]));
    assert!(h.sync.health.is_ready());

    // The same objects again: nothing to write.
    assert!(!h.read(&text).changed);

    // One endpoint gone: the frontend follows.
    let text = format!("{NODES}{web}{}", slice("web", &[("10.244.2.1", "b")]));
    assert!(h.read(&text).changed);
    assert_eq!(h.backends("10.96.0.10", 80), Some(vec!["10.244.2.1:8080".into()]));

    // The Service deleted from the files: its frontend is removed.
    h.read(NODES);
    assert_eq!(h.backends("10.96.0.10", 80), None);
    assert!(h.sync.writer.programmed.is_empty());
}

#[test]
fn topology_keys_rank_for_this_node() {
    let keys = ", annotations: {topoproxy.io/topology-keys: \"topology.kubernetes.io/zone,*\"}";
    let text = format!("{NODES}{}{}", service("db", "10.96.0.20", keys), slice("db", &[("10.244.1.1", "a"), ("10.244.2.1", "b")]));
    let mut on_b = Harness::new("b", None);
    on_b.read(&text);
    assert_eq!(on_b.backends("10.96.0.20", 80), Some(vec!["10.244.2.1:8080".into()]), "zone z2 first on node b");
    let mut on_a = Harness::new("a", None);
    on_a.read(&text);
    assert_eq!(on_a.backends("10.96.0.20", 80), Some(vec!["10.244.1.1:8080".into()]), "zone z1 first on node a");
}

#[test]
fn nothing_is_written_before_every_kind_is_listed() {
    let mut h = Harness::new("a", None);
    let read = read_text(&format!("{NODES}{}{}", service("web", "10.96.0.10", ""), slice("web", &[("10.244.1.1", "a")])));
    h.sync.stores.push_all(relist(&mut h.known, read.deltas));
    h.sync.handle(Signal::Listed { kind: Kind::Service });
    h.sync.handle(Signal::Listed { kind: Kind::EndpointSlice });
    assert!(!h.sync_if_listed().changed, "Nodes are not listed yet");
    assert!(!h.sync.health.is_ready());
    h.sync.handle(Signal::Listed { kind: Kind::Node });
    assert!(h.sync_if_listed().changed);
    assert_eq!(h.backends("10.96.0.10", 80).map(|b| b.len()), Some(1));
}

#[test]
fn a_full_map_is_reported_and_retried_when_room_is_freed() {
    let mut h = Harness::new("a", Some(1));
    let (web, api) = (service("web", "10.96.0.10", ""), service("api", "10.96.0.11", ""));
    let slices = format!("{}{}", slice("web", &[("10.244.1.1", "a")]), slice("api", &[("10.244.1.2", "a")]));
    h.read(&format!("{NODES}{web}{api}{slices}"));
    // Frontends are written in address order: web's 10.96.0.10 took the
    // one entry, api's did not fit.
    assert_eq!(h.backends("10.96.0.10", 80).map(|b| b.len()), Some(1));
    assert_eq!(h.backends("10.96.0.11", 80), None);
    assert!(h.metrics().contains("topoproxy_errors_total{reason=\"map_full\"} 1"), "{}", h.metrics());
    // web deleted: api gets its room in the same pass.
    h.read(&format!("{NODES}{api}{slices}"));
    assert_eq!(h.backends("10.96.0.11", 80).map(|b| b.len()), Some(1));
    assert_eq!(h.backends("10.96.0.10", 80), None);
}

#[test]
fn this_node_leaving_is_told_to_health_and_nothing_is_decided_again() {
    let mut h = Harness::new("a", None);
    let web = format!("{}{}", service("web", "10.96.0.10", ""), slice("web", &[("10.244.1.1", "a")]));
    h.read(&format!("{NODES}{web}"));
    assert!(h.sync.health.proxy_healthy());
    let leaving = NODES.replace("metadata: {name: a,", "metadata: {name: a, deletionTimestamp: \"2024-05-01T10:00:00Z\",");
    assert!(!h.read(&format!("{leaving}{web}")).changed, "the maps do not depend on it");
    assert!(!h.sync.health.proxy_healthy(), "a Node with a deletionTimestamp is leaving");
    h.read(&format!("{NODES}{web}"));
    assert!(h.sync.health.proxy_healthy());
    let tainted = NODES.replace(
        "metadata: {name: a, labels: {topology.kubernetes.io/zone: z1}}",
        "metadata: {name: a, labels: {topology.kubernetes.io/zone: z1}}\nspec: {taints: [{key: ToBeDeletedByClusterAutoscaler, effect: NoSchedule}]}",
    );
    h.read(&format!("{tainted}{web}"));
    assert!(!h.sync.health.proxy_healthy(), "the autoscaler's taint marks it too");
    h.read(&format!("{NODES}{web}"));
    assert!(h.sync.health.proxy_healthy());
    // Another node leaving is not this node's business.
    h.read(&format!("{}{web}", NODES.replace("metadata: {name: b,", "metadata: {name: b, deletionTimestamp: \"2024-05-01T10:00:00Z\",")));
    assert!(h.sync.health.proxy_healthy());
    // This node's Node deleted.
    let only_b = "kind: Node\nmetadata: {name: b, labels: {topology.kubernetes.io/zone: z2}}\n";
    h.read(&format!("{only_b}{web}"));
    assert!(!h.sync.health.proxy_healthy(), "a Node that was seen and is gone was deleted");
}

/// The value of one series in an exposition.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

#[test]
fn kube_proxy_metrics_count_changes_and_ports_without_local_endpoints() {
    let mut h = Harness::new("a", None);
    let local = |name: &str, ip: &str, policy: &str, node: &str| {
        format!(
            "---
kind: Service
metadata: {{name: {name}, namespace: shop}}
spec: {{type: NodePort, clusterIP: {ip}, {policy}: Local, ports: [{{port: 80, nodePort: 3{}}}]}}
{}",
            &ip[ip.len() - 4..].replace('.', ""),
            slice(name, &[("10.244.2.1", node)])
        )
    };
    let text = format!(
        "{NODES}{}{}{}{}",
        local("itp-remote", "10.96.0.51", "internalTrafficPolicy", "b"),
        local("itp-local", "10.96.0.52", "internalTrafficPolicy", "a"),
        local("etp-remote", "10.96.0.53", "externalTrafficPolicy", "b"),
        local("etp-remote2", "10.96.0.54", "externalTrafficPolicy", "b"),
    );
    h.read(&text);
    let m = h.metrics();
    let value = |series: &str| sample(&m, series);
    assert_eq!(value("kubeproxy_sync_proxy_rules_no_local_endpoints_total{traffic_policy=\"internal\"}"), Some(1.0), "{m}");
    assert_eq!(value("kubeproxy_sync_proxy_rules_no_local_endpoints_total{traffic_policy=\"external\"}"), Some(2.0), "{m}");
    assert_eq!(value("kubeproxy_sync_proxy_rules_service_changes_total"), Some(4.0), "{m}");
    assert_eq!(value("kubeproxy_sync_proxy_rules_endpoint_changes_total"), Some(4.0), "{m}");
    assert_eq!(value("kubeproxy_sync_proxy_rules_duration_seconds_count"), Some(1.0), "{m}");
    // One Service's endpoint moves here, another Service goes: the counts follow.
    let text = format!(
        "{NODES}{}{}{}",
        local("itp-remote", "10.96.0.51", "internalTrafficPolicy", "b"),
        local("itp-local", "10.96.0.52", "internalTrafficPolicy", "a"),
        local("etp-remote", "10.96.0.53", "externalTrafficPolicy", "a"),
    );
    h.read(&text);
    let m = h.metrics();
    let value = |series: &str| sample(&m, series);
    assert_eq!(value("kubeproxy_sync_proxy_rules_no_local_endpoints_total{traffic_policy=\"internal\"}"), Some(1.0), "{m}");
    assert_eq!(value("kubeproxy_sync_proxy_rules_no_local_endpoints_total{traffic_policy=\"external\"}"), Some(0.0), "{m}");
    assert_eq!(value("kubeproxy_sync_proxy_rules_service_changes_total"), Some(5.0), "one Service deleted: {m}");
    assert_eq!(value("kubeproxy_sync_proxy_rules_endpoint_changes_total"), Some(6.0), "one slice changed, one deleted: {m}");
}

#[test]
fn a_clash_is_warned_and_the_first_service_keeps_the_address() {
    let mut h = Harness::new("a", None);
    let text = format!(
        "{NODES}{}{}{}{}",
        service("one", "10.96.0.30", ""),
        service("two", "10.96.0.30", ""),
        slice("one", &[("10.244.1.1", "a")]),
        slice("two", &[("10.244.1.2", "a")])
    );
    h.read(&text);
    assert_eq!(h.backends("10.96.0.30", 80), Some(vec!["10.244.1.1:8080".into()]));
    assert!(h.sync.logged.iter().any(|l| l.contains("10.96.0.30")), "{:?}", h.sync.logged);
}

/// `run`'s loop against an API server whose Node watch has listed no
/// other Node yet (`with_node_label_needs`): a region-keyed Service (v1
/// slices carry no region) is held unprogrammed, counted as waiting, and
/// programmed once the watch says it listed the region of the Node its
/// endpoint runs on (`Signal::NodeLabelsListed`). With no wait allowed it
/// is programmed at once and the timeout is counted.
#[test]
fn a_service_waits_for_other_nodes_labels_then_is_programmed_once() {
    const REGION: &str = "topology.kubernetes.io/region";
    let nodes = "
kind: Node
metadata: {name: a, labels: {kubernetes.io/hostname: a, topology.kubernetes.io/region: r1}}
---
kind: Node
metadata: {name: b, labels: {kubernetes.io/hostname: b, topology.kubernetes.io/region: r2}}
---
kind: Node
metadata: {name: c, labels: {kubernetes.io/hostname: c, topology.kubernetes.io/region: r1}}
";
    let keys = ", annotations: {topoproxy.io/topology-keys: \"topology.kubernetes.io/region, *\"}";
    let text = format!("{nodes}{}{}", service("geo", "10.96.0.30", keys), slice("geo", &[("10.244.2.1", "b"), ("10.244.3.1", "c")]));
    let listed = OtherNodes {
        labels: [REGION, "kubernetes.io/hostname", "topology.kubernetes.io/zone"].iter().map(|s| (*s).to_string()).collect(),
        names: Some(["b", "c"].iter().map(|s| (*s).to_string()).collect()),
    };

    let mut h = Harness::waiting("a", None, Duration::from_secs(10));
    let (tx, _rx) = tokio::sync::watch::channel(None);
    h.sync = h.sync.with_node_label_needs(tx);
    h.read(&text);
    assert_eq!(h.backends("10.96.0.30", 80), None, "held: not programmed with a guess");
    assert_eq!(sample(&h.metrics(), "topoproxy_node_label_waiting_services"), Some(1.0));
    assert_eq!(h.sync.cached.waiting().len(), 1);
    h.sync.handle(Signal::NodeLabelsListed { listed: listed.clone() });
    h.sync_if_listed();
    assert_eq!(h.backends("10.96.0.30", 80), Some(vec!["10.244.3.1:8080".into()]), "region r1: c's endpoint");
    assert_eq!(sample(&h.metrics(), "topoproxy_node_label_waiting_services"), Some(0.0));
    assert_eq!(sample(&h.metrics(), "topoproxy_node_label_wait_timeouts_total"), Some(0.0));

    let mut h = Harness::waiting("a", None, Duration::ZERO);
    let (tx, _rx) = tokio::sync::watch::channel(None);
    h.sync = h.sync.with_node_label_needs(tx);
    h.read(&text);
    assert!(h.backends("10.96.0.30", 80).is_some(), "no wait: programmed with what is known");
    assert_eq!(sample(&h.metrics(), "topoproxy_node_label_wait_timeouts_total"), Some(1.0));
    assert_eq!(sample(&h.metrics(), "topoproxy_node_label_waiting_services"), Some(0.0));
    let w = h.sync.cached.waiting().values().next().cloned();
    assert!(w.as_ref().is_some_and(|w| w.gave_up && w.missing.labels.contains(REGION)), "{w:?}");
    let note = label_wait_note(&w.map(|w| w.missing).unwrap_or_default(), Duration::ZERO);
    assert!(note.contains("label topology.kubernetes.io/region not listed yet"), "{note}");
    // Listed later: no longer waiting, and counted once.
    h.sync.handle(Signal::NodeLabelsListed { listed });
    h.sync_if_listed();
    assert!(h.sync.cached.waiting().is_empty());
    assert_eq!(h.backends("10.96.0.30", 80), Some(vec!["10.244.3.1:8080".into()]));
    assert_eq!(sample(&h.metrics(), "topoproxy_node_label_wait_timeouts_total"), Some(1.0));
}
