//! Prometheus metrics of the agent, served on `/metrics` by
//! `health_server`. The agent's own metrics are `topoproxy_*`. What
//! kube-proxy also measures is exported a second time under kube-proxy's
//! name, type, labels and buckets (pkg/proxy/metrics), so that dashboards
//! and alerts written for kube-proxy keep working when this agent replaces
//! it: `kubeproxy_sync_proxy_rules_duration_seconds`,
//! `kubeproxy_sync_proxy_rules_last_timestamp_seconds`,
//! `kubeproxy_network_programming_duration_seconds`,
//! `kubeproxy_sync_proxy_rules_{endpoint,service}_changes_total`,
//! `kubeproxy_sync_proxy_rules_no_local_endpoints_total{traffic_policy}`,
//! `kubeproxy_proxy_healthz_total{code}` and
//! `kubeproxy_proxy_livez_total{code}`. The `topoproxy_*` counterparts stay
//! where they say more (labels by kind, finer buckets).
//!
//! Every metric is an atomic: the sync loop, the watchers and the HTTP
//! server share one `Metrics` through an `Arc` without locks of their own.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};

/// Label sets are small `(name, value)` lists; the names are fixed strings.
type Labels = Vec<(&'static str, String)>;

/// Reasons used with `topoproxy_errors_total{reason=...}`. Kept in one
/// place so dashboards and alerts can rely on them.
pub mod reason {
    /// A Service failed conversion (bad IP, port, protocol, type...).
    pub const INVALID_SERVICE: &str = "invalid_service";
    /// An EndpointSlice, or one of its endpoints or ports, was rejected.
    pub const INVALID_ENDPOINT_SLICE: &str = "invalid_endpoint_slice";
    /// A Node could not be converted (its name or labels).
    pub const INVALID_NODE: &str = "invalid_node";
    /// A Service's topology configuration (topologyKeys, annotations,
    /// trafficDistribution) is invalid and was ignored.
    pub const INVALID_TOPOLOGY: &str = "invalid_topology";
    /// A frontend did not fit into a map (raise the `--max-*` flag).
    pub const MAP_FULL: &str = "map_full";
    /// Any other failure to write a frontend.
    pub const MAP_WRITE: &str = "map_write";
    /// A list or watch against the API server failed (retried with backoff).
    pub const WATCH: &str = "watch";
    /// The API server expired our resourceVersion (410 Gone): a relist follows.
    pub const WATCH_EXPIRED: &str = "watch_expired";
    /// The API server's discovery document could not be read (retried
    /// with backoff; the watchers that need it wait).
    pub const API_DISCOVERY: &str = "api_discovery";
    /// A Kubernetes Event could not be posted.
    pub const EVENT_POST: &str = "event_post";
    /// A manifest file could not be read (manifests mode).
    pub const MANIFEST: &str = "manifest";
    /// A conntrack GC sweep of `NP_CT` failed (retried next interval).
    pub const CONNTRACK_GC: &str = "conntrack_gc";
    /// A map or link pin was removed from the pin directory under the
    /// running agent (put back, or failing to be: see the log).
    pub const PIN_REMOVED: &str = "pin_removed";
    /// Terminating the sockets of departed backends failed in a network
    /// namespace, or for one socket (the others still go).
    pub const SOCKET_TERMINATION: &str = "socket_termination";
    /// Flushing the `NP_CT` flows of departed backends failed.
    pub const CONNTRACK_FLUSH: &str = "conntrack_flush";
}

/// Reads the per-reason sums of one of the programs' per-CPU counter
/// arrays; given by the caller, which knows where the map is pinned.
pub type CounterReader = Box<dyn Fn() -> Result<Vec<u64>, String> + Send + Sync>;

/// The programs' own counters, by reason: `topoproxy_nodeport_packets_total`
/// (TC, `NP_COUNTERS`) and `topoproxy_socket_lb_calls_total` (the cgroup
/// socket hooks, `COUNTERS`). Read from the pinned map at scrape time and
/// summed over CPUs, rather than copied periodically, so the values are
/// current and the agent keeps no second copy that could drift (the maps
/// outlive agent restarts, and so do their counts). Reserved slots are
/// skipped. Until a reader is set, or when the map cannot be read (not
/// installed yet, removed by `reset`), the family is absent rather than
/// zero.
struct KernelCounters {
    family: &'static str,
    help: &'static str,
    names: &'static [&'static str],
    read: std::sync::OnceLock<CounterReader>,
}

impl KernelCounters {
    fn new(family: &'static str, help: &'static str, names: &'static [&'static str]) -> KernelCounters {
        KernelCounters { family, help, names, read: std::sync::OnceLock::new() }
    }
}

impl std::fmt::Debug for KernelCounters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KernelCounters")
            .field("family", &self.family)
            .field("help", &self.help)
            .field("names", &self.names)
            .field("exported", &self.read.get().is_some())
            .finish()
    }
}

impl Collector for KernelCounters {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(read) = self.read.get() else {
            return Ok(());
        };
        let sums = match read() {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(family = self.family, "counters not exported: {e}");
                return Ok(());
            }
        };
        let mut family = encoder.encode_descriptor(self.family, self.help, None, MetricType::Counter)?;
        for (i, value) in sums.iter().enumerate() {
            let Some(name) = self.names.get(i) else { continue };
            // `ended_*` are the agent's own terminations, written into the
            // array for `dump`: `topoproxy_sockets_terminated_total` has them.
            if name.starts_with("reserved") || name.starts_with("ended_") {
                continue;
            }
            let labels: Labels = vec![("reason", (*name).to_string())];
            ConstCounter::new(*value).encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }
}

/// The series kube-proxy exports (pkg/proxy/metrics), for what the agent
/// measures too. No `ip_family` label: one sync programs both families
/// (kube-proxy 1.33 added the label because it runs one proxier per family).
struct KubeProxy {
    sync_duration: Histogram,
    last_sync: Gauge<f64, std::sync::atomic::AtomicU64>,
    network_programming: Histogram,
    endpoint_changes: Counter,
    service_changes: Counter,
    no_local_endpoints: Family<Labels, Gauge>,
    healthz: Family<Labels, Counter>,
    livez: Family<Labels, Counter>,
}

impl KubeProxy {
    fn register(registry: &mut Registry) -> KubeProxy {
        // SyncProxyRulesLatency: 1 ms .. ~16 s, doubling.
        let sync_duration = Histogram::new(exponential_buckets(0.001, 2.0, 15));
        registry.register_with_unit("sync_proxy_rules_duration", "SyncProxyRules latency in seconds", Unit::Seconds, sync_duration.clone());
        let last_sync = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        registry.register(
            "sync_proxy_rules_last_timestamp_seconds",
            "The last time proxy rules were successfully synced",
            last_sync.clone(),
        );
        let network_programming = Histogram::new(network_programming_buckets());
        registry.register_with_unit(
            "network_programming_duration",
            "In Cluster Network Programming Latency in seconds",
            Unit::Seconds,
            network_programming.clone(),
        );
        let endpoint_changes = Counter::default();
        registry.register("sync_proxy_rules_endpoint_changes", "Cumulative proxy rules Endpoint changes", endpoint_changes.clone());
        let service_changes = Counter::default();
        registry.register("sync_proxy_rules_service_changes", "Cumulative proxy rules Service changes", service_changes.clone());
        // A gauge despite its name, as in kube-proxy: recounted every sync.
        let no_local_endpoints = Family::<Labels, Gauge>::default();
        registry.register(
            "sync_proxy_rules_no_local_endpoints_total",
            "Number of services with a Local traffic policy and no endpoints",
            no_local_endpoints.clone(),
        );
        let healthz = Family::<Labels, Counter>::default();
        registry.register("proxy_healthz", "Cumulative proxy healthz HTTP status", healthz.clone());
        let livez = Family::<Labels, Counter>::default();
        registry.register("proxy_livez", "Cumulative proxy livez HTTP status", livez.clone());
        KubeProxy { sync_duration, last_sync, network_programming, endpoint_changes, service_changes, no_local_endpoints, healthz, livez }
    }
}

/// kube-proxy's NetworkProgrammingLatency buckets: 0, 0.25 s, 0.5 s, every
/// second to 59 s, every 5 s to 115 s, every 30 s to 5 min (component-base's
/// MergeBuckets starts the list with 0).
fn network_programming_buckets() -> Vec<f64> {
    let mut b = vec![0.0, 0.25, 0.5];
    b.extend((1..=59).map(f64::from));
    b.extend((0..12).map(|i| 60.0 + 5.0 * f64::from(i)));
    b.extend((0..7).map(|i| 120.0 + 30.0 * f64::from(i)));
    b
}

/// The agent's Prometheus registry (`topoproxy_*` and kube-proxy's `kubeproxy_*` names) and the handles it updates.
pub struct Metrics {
    registry: Registry,
    kube_proxy: KubeProxy,
    sync_duration: Histogram,
    network_programming: Family<Labels, Histogram, fn() -> Histogram>,
    syncs: Counter,
    last_sync: Gauge<f64, std::sync::atomic::AtomicU64>,
    services_programmed: Gauge,
    node_label_waiting: Gauge,
    node_label_wait_timeouts: Counter,
    frontends_programmed: Gauge,
    endpoints_programmed: Gauge,
    objects: Family<Labels, Gauge>,
    errors: Family<Labels, Counter>,
    map_entries: Family<Labels, Gauge>,
    map_capacity: Family<Labels, Gauge>,
    nodeport_ports: Family<Labels, Gauge>,
    tier_share: Family<Labels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    maglev_tables: Family<Labels, Gauge>,
    maglev_table_bytes: Family<Labels, Gauge>,
    maglev_tables_refused: Family<Labels, Gauge>,
    maglev_budget_bytes: Gauge,
    watch_events: Family<Labels, Counter>,
    events_posted: Counter,
    api_versions: Family<Labels, Gauge>,
    kernel_features: Family<Labels, Gauge>,
    xdp_devices: Family<Labels, Gauge>,
    conntrack_gc_runs: Counter,
    conntrack_gc_flows: Family<Labels, Counter>,
    conntrack_gc_entries: Family<Labels, Counter>,
    termination_mechanism: Family<Labels, Gauge>,
    sockets_terminated: Family<Labels, Counter>,
    termination_batches: Counter,
    termination_namespaces: Gauge,
    conntrack_flushed_flows: Family<Labels, Counter>,
    conntrack_flushed_entries: Family<Labels, Counter>,
    nodeport_counters: std::sync::Arc<KernelCounters>,
    tc_fast_counters: std::sync::Arc<KernelCounters>,
    socket_counters: std::sync::Arc<KernelCounters>,
    service_connections: std::sync::Arc<crate::observe::service_connections::ServiceConnections>,
}

fn latency_histogram() -> Histogram {
    // 1 ms .. ~9 min, doubling: programming latency spans a quick local
    // update to an API server outage.
    Histogram::new(exponential_buckets(0.001, 2.0, 20))
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// One tier's share of a spilling Service port's new connections, in
/// millionths, for `topoproxy_service_tier_share`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TierShareSeries {
    /// The Service port.
    pub port: crate::model::PortLabel,
    /// `IPv4` or `IPv6` for a dual-stack port graded family by family;
    /// empty (the label absent) for a port of one family.
    pub family: &'static str,
    /// The tier's name as `explain` prints it.
    pub tier: String,
    /// Its share of new connections, in millionths.
    pub share_ppm: u32,
}

impl Metrics {
    /// Every metric registered, at zero.
    pub fn new() -> Metrics {
        let mut root = Registry::default();
        let registry = root.sub_registry_with_prefix("topoproxy");
        let sync_duration = Histogram::new(exponential_buckets(0.0005, 2.0, 16));
        registry.register_with_unit(
            "sync_duration",
            "Time one sync took: building the model, ranking, diffing and writing the maps",
            Unit::Seconds,
            sync_duration.clone(),
        );
        let network_programming: Family<Labels, Histogram, fn() -> Histogram> = Family::new_with_constructor(latency_histogram);
        registry.register_with_unit(
            "network_programming_duration",
            "Time from an object's change (EndpointSlice endpoints.kubernetes.io/last-change-trigger-time, else the moment the watch event arrived) to the maps being written, by object kind",
            Unit::Seconds,
            network_programming.clone(),
        );
        let syncs = Counter::default();
        registry.register("syncs", "Syncs run", syncs.clone());
        let last_sync = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        registry.register("last_sync_timestamp_seconds", "Unix time of the last completed sync", last_sync.clone());
        let services_programmed = Gauge::default();
        registry.register("services_programmed", "Services with at least one frontend in the maps", services_programmed.clone());
        let node_label_waiting = Gauge::default();
        registry.register(
            "node_label_waiting_services",
            "Services kept as programmed while the Node watch lists the labels of other Nodes their topology reads (--node-label-wait-secs)",
            node_label_waiting.clone(),
        );
        let node_label_wait_timeouts = Counter::default();
        registry.register(
            "node_label_wait_timeouts",
            "Services programmed without the labels of other Nodes their topology reads, after waiting --node-label-wait-secs for them",
            node_label_wait_timeouts.clone(),
        );
        let frontends_programmed = Gauge::default();
        registry.register("frontends_programmed", "Frontends (ClusterIP, port, protocol) in the maps", frontends_programmed.clone());
        let endpoints_programmed = Gauge::default();
        registry.register("endpoints_programmed", "Backends programmed, summed over all frontends", endpoints_programmed.clone());
        let objects = Family::<Labels, Gauge>::default();
        registry.register("objects", "Objects in the watch caches (Kubernetes mode), by kind", objects.clone());
        let errors = Family::<Labels, Counter>::default();
        registry.register("errors", "Errors by reason (bad objects, map writes, API server failures)", errors.clone());
        let map_entries = Family::<Labels, Gauge>::default();
        registry.register("map_entries", "Entries in use per BPF map", map_entries.clone());
        let map_capacity = Family::<Labels, Gauge>::default();
        registry.register("map_capacity", "Capacity (max_entries) per BPF map", map_capacity.clone());
        let nodeport_ports = Family::<Labels, Gauge>::default();
        registry.register(
            "nodeport_ports",
            "Ports with their bit set in the TC programs' port bitmap (NP_PORTS), by direction; other packets pass without a lookup",
            nodeport_ports.clone(),
        );
        let tier_share = Family::<Labels, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
        registry.register(
            "service_tier_share",
            "Share of a Service port's new connections each topology tier takes with topoproxy.io/topology-spill (0 to 1), by tier (and family on a dual-stack port)",
            tier_share.clone(),
        );
        let maglev_tables = Family::<Labels, Gauge>::default();
        registry.register("maglev_tables", "Maglev lookup tables linked in, by datapath", maglev_tables.clone());
        let maglev_table_bytes = Family::<Labels, Gauge>::default();
        registry.register(
            "maglev_table_bytes",
            "Kernel bytes of the Maglev lookup tables (8 per entry), by datapath",
            maglev_table_bytes.clone(),
        );
        let maglev_tables_refused = Family::<Labels, Gauge>::default();
        registry.register(
            "maglev_tables_refused",
            "Frontends without the Maglev table they ask for (their flows take the modulo pick) because it would exceed the tables' share of --map-memory-budget, by datapath",
            maglev_tables_refused.clone(),
        );
        let maglev_budget_bytes = Gauge::default();
        registry.register(
            "maglev_budget_bytes",
            "The Maglev tables' share of --map-memory-budget (both datapaths), bytes",
            maglev_budget_bytes.clone(),
        );
        let watch_events = Family::<Labels, Counter>::default();
        registry.register("watch_events", "Watch events received from the API server, by kind", watch_events.clone());
        let events_posted = Counter::default();
        registry.register("kubernetes_events_posted", "Kubernetes Events posted about bad objects", events_posted.clone());
        let api_versions = Family::<Labels, Gauge>::default();
        registry.register(
            "api_version",
            "The version of each API group whose version differs between Kubernetes releases that the agent negotiated with the API server (1 = in use)",
            api_versions.clone(),
        );
        let kernel_features = Family::<Labels, Gauge>::default();
        registry.register(
            "kernel_feature",
            "What the running kernel offers the datapath, probed at start-up (1 = present, 0 = the agent falls back; see the README's kernel table)",
            kernel_features.clone(),
        );
        let xdp_devices = Family::<Labels, Gauge>::default();
        registry.register(
            "xdp_device",
            "Each device of the external-traffic datapath: 1 = the XDP program runs in front of TC (native mode), 0 = TC alone",
            xdp_devices.clone(),
        );
        let conntrack_gc_runs = Counter::default();
        registry.register("conntrack_gc_runs", "Sweeps of the TC conntrack map NP_CT completed", conntrack_gc_runs.clone());
        let conntrack_gc_flows = Family::<Labels, Counter>::default();
        registry.register(
            "conntrack_gc_flows_deleted",
            "Flows deleted from NP_CT by the conntrack GC, by reason (expired: idle past its timeout; stale_backend: its backend left NP_BACKENDS)",
            conntrack_gc_flows.clone(),
        );
        let conntrack_gc_entries = Family::<Labels, Counter>::default();
        registry.register(
            "conntrack_gc_entries_deleted",
            "Entries deleted from NP_CT by the conntrack GC (two to four per flow), by reason",
            conntrack_gc_entries.clone(),
        );
        let termination_mechanism = Family::<Labels, Gauge>::default();
        registry.register(
            "socket_termination_mechanism",
            "How sockets translated to a backend that left are terminated on this kernel (1 = in use): iterators (BPF socket iterators with bpf_sock_destroy), netlink (SOCK_DESTROY) or none",
            termination_mechanism.clone(),
        );
        let sockets_terminated = Family::<Labels, Counter>::default();
        registry.register(
            "sockets_terminated",
            "Sockets the socket load balancer had translated to a backend that left its frontend's set, terminated, by protocol and the rule that ended them (reason: udp deleted, not_serving, topology; tcp gone_after_terminating)",
            sockets_terminated.clone(),
        );
        let termination_batches = Counter::default();
        registry.register(
            "socket_termination_batches",
            "Walks of every network namespace for sockets to terminate (one per batch of departed backends)",
            termination_batches.clone(),
        );
        let termination_namespaces = Gauge::default();
        registry.register(
            "socket_termination_namespaces",
            "Network namespaces the last termination walk visited",
            termination_namespaces.clone(),
        );
        let conntrack_flushed_flows = Family::<Labels, Counter>::default();
        registry.register(
            "conntrack_flushed_flows",
            "Flows deleted from NP_CT because their backend left the frontend's set, by protocol and the rule that ended them (reason: udp deleted, not_serving, topology; tcp gone_after_terminating)",
            conntrack_flushed_flows.clone(),
        );
        let conntrack_flushed_entries = Family::<Labels, Counter>::default();
        registry.register(
            "conntrack_flushed_entries",
            "Entries of those flows deleted from NP_CT (two to four per flow), by protocol and reason",
            conntrack_flushed_entries.clone(),
        );
        let nodeport_counters = std::sync::Arc::new(KernelCounters::new(
            "nodeport_packets",
            "Packets of external traffic (NodePort, LoadBalancer IPs, externalIPs) seen by the TC programs, by outcome (NP_COUNTERS, summed over CPUs)",
            &proxy_common::np_counter::NAMES,
        ));
        registry.register_collector(Box::new(nodeport_counters.clone()));
        let tc_fast_counters = std::sync::Arc::new(KernelCounters::new(
            "tc_fast_path_packets",
            "Translated external packets the TC fast path sent to a remote backend's or the client's next hop or into a local pod (tc_fast_*), or left to the stack, by reason (tc_stack_*) (NP_FAST_COUNTERS, summed over CPUs)",
            &proxy_common::np_fast_counter::NAMES,
        ));
        registry.register_collector(Box::new(tc_fast_counters.clone()));
        let socket_counters = std::sync::Arc::new(KernelCounters::new(
            "socket_lb_calls",
            "Calls of the cgroup socket hooks (connect, sendmsg, recvmsg, getpeername) by outcome (COUNTERS, summed over CPUs)",
            &proxy_common::counter::NAMES,
        ));
        registry.register_collector(Box::new(socket_counters.clone()));
        let service_connections = std::sync::Arc::new(crate::observe::service_connections::ServiceConnections::default());
        registry.register_collector(Box::new(service_connections.clone()));
        let kube_proxy = KubeProxy::register(root.sub_registry_with_prefix("kubeproxy"));
        Metrics {
            registry: root,
            kube_proxy,
            sync_duration,
            network_programming,
            syncs,
            last_sync,
            services_programmed,
            node_label_waiting,
            node_label_wait_timeouts,
            frontends_programmed,
            endpoints_programmed,
            objects,
            errors,
            map_entries,
            map_capacity,
            nodeport_ports,
            tier_share,
            maglev_tables,
            maglev_table_bytes,
            maglev_tables_refused,
            maglev_budget_bytes,
            watch_events,
            events_posted,
            api_versions,
            kernel_features,
            xdp_devices,
            conntrack_gc_runs,
            conntrack_gc_flows,
            conntrack_gc_entries,
            termination_mechanism,
            sockets_terminated,
            termination_batches,
            termination_namespaces,
            conntrack_flushed_flows,
            conntrack_flushed_entries,
            nodeport_counters,
            tc_fast_counters,
            socket_counters,
            service_connections,
        }
    }

    /// `topoproxy_service_connections_total` and
    /// `topoproxy_service_connections_blind_remote_total` (issue #34): the
    /// mode (`--service-metrics`), the owners the map writers publish, and
    /// the reader of the pinned counts.
    pub fn service_connections(&self) -> &crate::observe::service_connections::ServiceConnections {
        &self.service_connections
    }

    /// Exports the TC programs' `NP_COUNTERS`, as `read` returns them, from
    /// now on (`topoproxy_nodeport_packets_total`). Only the first call
    /// counts: an agent has one pin directory.
    pub fn export_nodeport_counters(&self, read: CounterReader) {
        let _ = self.nodeport_counters.read.set(read);
    }

    /// Exports the TC fast path's `NP_FAST_COUNTERS` from now on
    /// (`topoproxy_tc_fast_path_packets_total`). Only the first call counts.
    pub fn export_tc_fast_counters(&self, read: CounterReader) {
        let _ = self.tc_fast_counters.read.set(read);
    }

    /// Exports the socket hooks' `COUNTERS`, as `read` returns them, from
    /// now on (`topoproxy_socket_lb_calls_total`). Only the first call
    /// counts.
    pub fn export_socket_counters(&self, read: CounterReader) {
        let _ = self.socket_counters.read.set(read);
    }

    /// Records one conntrack GC sweep: deletions by reason, and `NP_CT`'s
    /// occupancy in `topoproxy_map_entries`/`topoproxy_map_capacity` (the
    /// sweep walks the map anyway, so the gauge costs nothing extra).
    pub fn record_conntrack_gc(&self, s: &GcFigures<'_>) {
        self.conntrack_gc_runs.inc();
        for (reason, flows, entries) in s.deleted {
            let labels = vec![("reason", (*reason).to_string())];
            // get_or_create also for zero, so the series exist from the first sweep.
            self.conntrack_gc_flows.get_or_create(&labels).inc_by(*flows as u64);
            self.conntrack_gc_entries.get_or_create(&labels).inc_by(*entries as u64);
        }
        let map = vec![("map", proxy_common::NP_CT_MAP.to_string())];
        self.map_entries.get_or_create(&map).set(s.entries as i64);
        self.map_capacity.get_or_create(&map).set(i64::from(s.capacity));
    }

    /// Records the ports set in `NP_PORTS` as the conntrack GC left it.
    pub fn record_port_bits(&self, ingress: usize, egress: usize) {
        for (direction, n) in [("ingress", ingress), ("egress", egress)] {
            self.nodeport_ports.get_or_create(&vec![("direction", direction.to_string())]).set(n as i64);
        }
    }

    /// Records which termination mechanism is in use (`iterators`,
    /// `netlink` or `none`), with every known one exported so the
    /// unused ones read 0.
    pub fn set_termination_mechanism(&self, in_use: &str, known: &[&str]) {
        for m in known {
            self.termination_mechanism.get_or_create(&vec![("mechanism", (*m).to_string())]).set(i64::from(*m == in_use));
        }
    }

    /// Counts `n` sockets of `protocol` terminated for `reason`.
    pub fn sockets_terminated(&self, protocol: &str, reason: &str, n: usize) {
        let labels = vec![("protocol", protocol.to_string()), ("reason", reason.to_string())];
        self.sockets_terminated.get_or_create(&labels).inc_by(n as u64);
    }

    /// Records one walk of the node's network namespaces.
    pub fn termination_batch(&self, namespaces: usize) {
        self.termination_batches.inc();
        self.termination_namespaces.set(namespaces as i64);
    }

    /// Counts `flows` flows (`entries` entries) of `protocol` flushed from
    /// `NP_CT` for `reason`.
    pub fn conntrack_flushed(&self, protocol: &str, reason: &str, flows: usize, entries: usize) {
        let labels = vec![("protocol", protocol.to_string()), ("reason", reason.to_string())];
        self.conntrack_flushed_flows.get_or_create(&labels).inc_by(flows as u64);
        self.conntrack_flushed_entries.get_or_create(&labels).inc_by(entries as u64);
    }

    /// The text exposition (OpenMetrics, which Prometheus scrapes as is).
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }

    /// Counts one error of `reason` (`topoproxy_errors_total{reason}`; see [`reason`]).
    pub fn error(&self, reason: &str) {
        self.errors.get_or_create(&vec![("reason", reason.to_string())]).inc();
    }

    /// Counts `n` errors of `reason` at once.
    pub fn errors_by(&self, reason: &str, n: usize) {
        if n > 0 {
            self.errors.get_or_create(&vec![("reason", reason.to_string())]).inc_by(n as u64);
        }
    }

    /// Services held for labels of other Nodes now
    /// (`topoproxy_node_label_waiting_services`).
    pub fn set_node_label_waiting(&self, n: usize) {
        self.node_label_waiting.set(n as i64);
    }

    /// Counts one Service that waited past `--node-label-wait-secs`
    /// (`topoproxy_node_label_wait_timeouts_total`).
    pub fn node_label_wait_timeout(&self) {
        self.node_label_wait_timeouts.inc();
    }

    /// Counts one watch event of `kind` (Service, EndpointSlice, Node).
    pub fn watch_event(&self, kind: &str) {
        self.watch_events.get_or_create(&vec![("kind", kind.to_string())]).inc();
    }

    /// Counts one Kubernetes Event posted.
    pub fn event_posted(&self) {
        self.events_posted.inc();
    }

    /// Records the API versions in use, as (group, version) pairs; the
    /// series of an earlier negotiation go away.
    pub fn set_api_versions(&self, in_use: &[(&str, &str)]) {
        self.api_versions.clear();
        for (group, version) in in_use {
            self.api_versions.get_or_create(&vec![("group", (*group).to_string()), ("version", (*version).to_string())]).set(1);
        }
    }

    /// Records the kernel's probed features, as (name, present) pairs.
    pub fn set_kernel_features(&self, features: &[(&str, bool)]) {
        for (name, present) in features {
            self.kernel_features.get_or_create(&vec![("name", (*name).to_string())]).set(i64::from(*present));
        }
    }

    /// The XDP mode of each datapath device: `xdp` lists those with the
    /// XDP program attached.
    pub fn set_xdp_devices(&self, devices: &[String], xdp: &[String]) {
        self.xdp_devices.clear();
        for d in devices.iter().chain(xdp.iter().filter(|d| !devices.contains(d))) {
            self.xdp_devices.get_or_create(&vec![("device", d.clone())]).set(i64::from(xdp.contains(d)));
        }
    }

    /// Sets how many objects of `kind` the store holds.
    pub fn set_objects(&self, kind: &str, n: usize) {
        self.objects.get_or_create(&vec![("kind", kind.to_string())]).set(n as i64);
    }

    /// Records the time from `trigger` until now for a change of `kind`.
    /// A trigger in the future (clock skew between the API server's node
    /// and ours) counts as zero rather than being dropped.
    pub fn programmed(&self, kind: &str, trigger: SystemTime) {
        let secs = SystemTime::now().duration_since(trigger).unwrap_or_default().as_secs_f64();
        self.network_programming.get_or_create(&vec![("kind", kind.to_string())]).observe(secs);
    }

    /// Records the time from `trigger` until now for a change of an
    /// EndpointSlice, as kube-proxy's `network_programming_duration_seconds`
    /// does (it is defined on endpoint changes: sig-scalability's network
    /// programming latency SLI).
    pub fn endpoints_programmed(&self, trigger: SystemTime) {
        let secs = SystemTime::now().duration_since(trigger).unwrap_or_default().as_secs_f64();
        self.kube_proxy.network_programming.observe(secs);
    }

    /// Counts Services and EndpointSlices that changed (added, updated,
    /// deleted), as kube-proxy's change trackers count their events.
    pub fn object_changes(&self, services: usize, endpoint_slices: usize) {
        self.kube_proxy.service_changes.inc_by(services as u64);
        self.kube_proxy.endpoint_changes.inc_by(endpoint_slices as u64);
    }

    /// Counts one answer of `/healthz`.
    pub fn proxy_healthz(&self, code: u16) {
        self.kube_proxy.healthz.get_or_create(&vec![("code", code.to_string())]).inc();
    }

    /// Counts one answer of `/livez`.
    pub fn proxy_livez(&self, code: u16) {
        self.kube_proxy.livez.get_or_create(&vec![("code", code.to_string())]).inc();
    }

    /// The Maglev tables of one datapath (`socket`, `tc`): how many are
    /// linked in, the bytes of backend ids they hold, and the frontends
    /// the budget left without one.
    pub fn set_maglev_tables(&self, datapath: &str, tables: u32, bytes: u64, refused: usize) {
        let labels = vec![("datapath", datapath.to_string())];
        self.maglev_tables.get_or_create(&labels).set(i64::from(tables));
        self.maglev_table_bytes.get_or_create(&labels).set(i64::try_from(bytes).unwrap_or(i64::MAX));
        self.maglev_tables_refused.get_or_create(&labels).set(i64::try_from(refused).unwrap_or(i64::MAX));
    }

    /// `topoproxy_service_tier_share`: each tier's share of new
    /// connections of every Service port whose tiers spill (issue #48),
    /// one [`TierShareSeries`] per port, family and tier, made by the sync loop
    /// from the decisions (this module reads no decision: it sits below
    /// `decide/`). The series of ports that no longer spill go away.
    pub fn set_tier_shares(&self, shares: impl IntoIterator<Item = TierShareSeries>) {
        self.tier_share.clear();
        for t in shares {
            let labels = vec![
                ("namespace", t.port.namespace.to_string()),
                ("service", t.port.service.to_string()),
                ("port", t.port.port),
                ("family", t.family.to_string()),
                ("tier", t.tier),
            ];
            self.tier_share.get_or_create(&labels).set(f64::from(t.share_ppm) / 1_000_000.0);
        }
    }

    /// The Maglev tables' share of the memory budget, set at start-up.
    pub fn set_maglev_budget(&self, bytes: u64) {
        self.maglev_budget_bytes.set(i64::try_from(bytes).unwrap_or(i64::MAX));
    }

    /// Records one completed sync: its duration, what the maps now hold and
    /// the map failures it returned.
    pub fn record_sync(&self, s: &SyncFigures<'_>) {
        self.sync_duration.observe(s.took.as_secs_f64());
        self.kube_proxy.sync_duration.observe(s.took.as_secs_f64());
        self.syncs.inc();
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_secs_f64();
        self.last_sync.set(now);
        self.kube_proxy.last_sync.set(now);
        for (policy, n) in [("internal", s.no_local_internal), ("external", s.no_local_external)] {
            self.kube_proxy.no_local_endpoints.get_or_create(&vec![("traffic_policy", policy.to_string())]).set(n as i64);
        }
        self.frontends_programmed.set(s.frontends as i64);
        self.endpoints_programmed.set(s.endpoints as i64);
        self.services_programmed.set(s.services as i64);
        for (map, used, max) in s.occupancy {
            self.map_entries.get_or_create(&vec![("map", (*map).to_string())]).set(i64::from(*used));
            self.map_capacity.get_or_create(&vec![("map", (*map).to_string())]).set(i64::from(*max));
        }
        self.errors_by(reason::MAP_FULL, s.map_full);
        self.errors_by(reason::MAP_WRITE, s.write_failed);
    }
}

/// One sweep of the conntrack GC, as [`Metrics::record_conntrack_gc`]
/// records it.
#[derive(Clone, Copy, Debug, Default)]
pub struct GcFigures<'a> {
    /// Entries in `NP_CT` when the sweep read it, and its capacity.
    pub entries: usize,
    /// `NP_CT`'s capacity.
    pub capacity: u32,
    /// (reason, flows deleted, entries deleted) per reason.
    pub deleted: &'a [(&'static str, usize, usize)],
}

/// One sync, as [`Metrics::record_sync`] records it.
#[derive(Clone, Copy, Debug, Default)]
pub struct SyncFigures<'a> {
    /// How long the sync took.
    pub took: Duration,
    /// Frontends, backends (slots) and Services with a frontend in the maps.
    pub frontends: usize,
    /// Endpoints (backend slots) written.
    pub endpoints: usize,
    /// Services with a frontend in the maps.
    pub services: usize,
    /// (map, entries in use, capacity).
    pub occupancy: &'a [(&'static str, u32, u32)],
    /// Frontends not written because a map was full, or for another reason.
    pub map_full: usize,
    /// Frontends whose write failed for another reason than a full map.
    pub write_failed: usize,
    /// Service ports with endpoints somewhere whose internal (external)
    /// traffic policy is Local and that have none on this node: kube-proxy's
    /// `sync_proxy_rules_no_local_endpoints_total{traffic_policy}`.
    pub no_local_internal: usize,
    /// The same for the external traffic policy.
    pub no_local_external: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tier_shares_are_gauges_per_spilling_port_and_tier() {
        let port = crate::model::PortLabel { namespace: "shop".into(), service: "web".into(), port: "http".to_string(), topology: true };
        let share = |tier: &str, share_ppm: u32| TierShareSeries { port: port.clone(), family: "", tier: tier.to_string(), share_ppm };
        let m = Metrics::new();
        m.set_tier_shares([share("topology.kubernetes.io/zone=za", 700_000), share("*", 300_000)]);
        let text = m.encode();
        assert!(text.contains("# TYPE topoproxy_service_tier_share gauge"), "{text}");
        let series = |tier: &str, v: &str| {
            format!("topoproxy_service_tier_share{{namespace=\"shop\",service=\"web\",port=\"http\",family=\"\",tier=\"{tier}\"}} {v}")
        };
        assert!(text.contains(&series("topology.kubernetes.io/zone=za", "0.7")), "{text}");
        assert!(text.contains(&series("*", "0.3")), "{text}");
        // A port that stops spilling loses its series.
        m.set_tier_shares(std::iter::empty());
        assert!(!m.encode().contains("topoproxy_service_tier_share{"));
    }

    #[test]
    fn exposition_names_and_labels() {
        let m = Metrics::new();
        m.error(reason::INVALID_SERVICE);
        m.error(reason::INVALID_SERVICE);
        m.set_objects("Service", 3);
        m.programmed("EndpointSlice", SystemTime::now());
        let text = m.encode();
        assert!(text.contains("topoproxy_errors_total{reason=\"invalid_service\"} 2"), "{text}");
        assert!(text.contains("topoproxy_objects{kind=\"Service\"} 3"), "{text}");
        assert!(text.contains("topoproxy_network_programming_duration_seconds_count{kind=\"EndpointSlice\"} 1"), "{text}");
        assert!(text.contains("# TYPE topoproxy_sync_duration_seconds histogram"), "{text}");
        assert!(text.trim_end().ends_with("# EOF"));
    }

    #[test]
    fn kube_proxy_names_types_and_buckets() {
        let m = Metrics::new();
        m.record_sync(&SyncFigures { took: Duration::from_millis(3), no_local_internal: 2, ..SyncFigures::default() });
        m.object_changes(1, 4);
        m.object_changes(0, 1);
        m.endpoints_programmed(SystemTime::now() - Duration::from_secs(2));
        m.proxy_healthz(200);
        m.proxy_healthz(503);
        m.proxy_healthz(200);
        m.proxy_livez(200);
        let text = m.encode();
        for want in [
            "# TYPE kubeproxy_sync_proxy_rules_duration_seconds histogram",
            "kubeproxy_sync_proxy_rules_duration_seconds_count 1",
            "kubeproxy_sync_proxy_rules_duration_seconds_bucket{le=\"0.004\"} 1",
            "kubeproxy_sync_proxy_rules_duration_seconds_bucket{le=\"0.002\"} 0",
            "kubeproxy_sync_proxy_rules_duration_seconds_bucket{le=\"16.384\"} 1",
            "# TYPE kubeproxy_sync_proxy_rules_last_timestamp_seconds gauge",
            "# TYPE kubeproxy_network_programming_duration_seconds histogram",
            "kubeproxy_network_programming_duration_seconds_bucket{le=\"0.0\"} 0",
            "kubeproxy_network_programming_duration_seconds_bucket{le=\"2.0\"} 0",
            "kubeproxy_network_programming_duration_seconds_bucket{le=\"3.0\"} 1",
            "kubeproxy_network_programming_duration_seconds_bucket{le=\"300.0\"} 1",
            "kubeproxy_sync_proxy_rules_service_changes_total 1",
            "kubeproxy_sync_proxy_rules_endpoint_changes_total 5",
            "# TYPE kubeproxy_sync_proxy_rules_no_local_endpoints_total gauge",
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total{traffic_policy=\"internal\"} 2",
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total{traffic_policy=\"external\"} 0",
            "kubeproxy_proxy_healthz_total{code=\"200\"} 2",
            "kubeproxy_proxy_healthz_total{code=\"503\"} 1",
            "kubeproxy_proxy_livez_total{code=\"200\"} 1",
            // Ours stay.
            "topoproxy_sync_duration_seconds_count 1",
        ] {
            assert!(text.lines().any(|l| l == want || l.starts_with(&format!("{want} "))), "{want} missing from\n{text}");
        }
        let last = text.lines().find_map(|l| l.strip_prefix("kubeproxy_sync_proxy_rules_last_timestamp_seconds "));
        assert!(last.and_then(|v| v.parse::<f64>().ok()).is_some_and(|v| v > 1.7e9), "{text}");
        // 0, 0.25, 0.5, 1..59, 60..115, 120..300, +Inf
        assert_eq!(
            text.lines().filter(|l| l.starts_with("kubeproxy_network_programming_duration_seconds_bucket")).count(),
            3 + 59 + 12 + 7 + 1
        );
        assert!(text.trim_end().ends_with("# EOF"));
    }

    #[test]
    fn kernel_features_are_gauges_by_name() {
        let m = Metrics::new();
        m.set_kernel_features(&[("set_retval", true), ("tcx", false)]);
        let text = m.encode();
        assert!(text.contains("topoproxy_kernel_feature{name=\"set_retval\"} 1"), "{text}");
        assert!(text.contains("topoproxy_kernel_feature{name=\"tcx\"} 0"), "{text}");
    }

    #[test]
    fn xdp_mode_is_a_gauge_per_device() {
        let m = Metrics::new();
        m.set_xdp_devices(&["eth0".into(), "eth1".into()], &["eth0".into()]);
        let text = m.encode();
        assert!(text.contains("topoproxy_xdp_device{device=\"eth0\"} 1"), "{text}");
        assert!(text.contains("topoproxy_xdp_device{device=\"eth1\"} 0"), "{text}");
    }

    #[test]
    fn api_versions_replace_earlier_ones() {
        let m = Metrics::new();
        m.set_api_versions(&[("discovery.k8s.io", "v1beta1"), ("events.k8s.io", "v1beta1")]);
        m.set_api_versions(&[("discovery.k8s.io", "v1"), ("events.k8s.io", "v1")]);
        let text = m.encode();
        assert!(text.contains("topoproxy_api_version{group=\"discovery.k8s.io\",version=\"v1\"} 1"), "{text}");
        assert!(text.contains("topoproxy_api_version{group=\"events.k8s.io\",version=\"v1\"} 1"), "{text}");
        assert!(!text.contains("v1beta1"), "{text}");
    }

    #[test]
    fn conntrack_gc_sweeps_are_counted_by_reason() {
        let m = Metrics::new();
        let stats = GcFigures { entries: 10, capacity: 100, deleted: &[("expired", 2, 6), ("stale_backend", 0, 0)] };
        m.record_conntrack_gc(&stats);
        m.record_conntrack_gc(&stats);
        let text = m.encode();
        assert!(text.contains("topoproxy_conntrack_gc_runs_total 2"), "{text}");
        assert!(text.contains("topoproxy_conntrack_gc_flows_deleted_total{reason=\"expired\"} 4"), "{text}");
        assert!(text.contains("topoproxy_conntrack_gc_entries_deleted_total{reason=\"expired\"} 12"), "{text}");
        assert!(text.contains("topoproxy_conntrack_gc_entries_deleted_total{reason=\"stale_backend\"} 0"), "{text}");
        assert!(text.contains("topoproxy_map_entries{map=\"NP_CT\"} 10"), "{text}");
        assert!(text.contains("topoproxy_map_capacity{map=\"NP_CT\"} 100"), "{text}");
        // No pin directory: no NodePort counters, and the exposition is intact.
        assert!(!text.contains("nodeport_packets"), "{text}");
        m.export_nodeport_counters(Box::new(|| Err("not pinned".to_string())));
        let text = m.encode();
        assert!(!text.contains("nodeport_packets") && text.trim_end().ends_with("# EOF"), "{text}");
        m.export_socket_counters(Box::new(|| Ok(vec![5, 0, 0, 0, 0, 0, 0, 0, 2])));
        let text = m.encode();
        assert!(text.contains("topoproxy_socket_lb_calls_total{reason=\"translated\"} 5"), "{text}");
        assert!(text.contains("topoproxy_socket_lb_calls_total{reason=\"affinity_hit\"} 2"), "{text}");
    }
}
