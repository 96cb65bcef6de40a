//! `proxy-agent run`: install the datapath, adopt what is pinned, and keep
//! the maps in sync with a source: the Kubernetes API server, or manifest
//! files (standalone mode). Everything after the source is the same
//! pipeline: one sync loop, one datapath install, one external datapath,
//! one health/metrics server, one conntrack GC, one node-address watcher.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use kube::config::{KubeConfigOptions, Kubeconfig};
use proxy_agent::datapath::dump::{np_counter_sums, np_fast_counter_sums, service_conn_sums, socket_counter_sums};
use proxy_agent::datapath::kernel_features::KernelFeatures;
use proxy_agent::datapath::map_writer::MapWriter;
use proxy_agent::datapath::maps::{Datapath, MapSizes};
use proxy_agent::datapath::pin_guard::{self, PinGuard};
use proxy_agent::datapath::sizing::{self, Needs};
use proxy_agent::datapath::sock_destroy::{self, Terminator};
use proxy_agent::datapath::sockets::sock_rec_sweep;
use proxy_agent::datapath::{conntrack_gc, socket_loader};
use proxy_agent::datapath::{map_migration, maps};
use proxy_agent::decide::departures::TcpTermination;
use proxy_agent::external::node_addresses;
use proxy_agent::external::nodeport::ExternalDatapath;
use proxy_agent::model::store::Kind;
use proxy_agent::observe::health_server::{self, DEFAULT_STALE_AFTER, Health, Routes};
use proxy_agent::observe::metrics::Metrics;
use proxy_agent::observe::service_connections::{self, Mode};
use proxy_agent::source::feed::{Signal, Stores};
use proxy_agent::source::{api_versions, kube_watch, manifest_watch};
use proxy_agent::sync::events::{self, EventReporter};
use proxy_agent::sync::sync_loop::{SyncConfig, SyncLoop};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};

use super::datapath_args::DatapathArgs;

/// kube-proxy's `--healthz-bind-address` default: the agent replaces
/// kube-proxy, so it takes the same port and the probes written for
/// kube-proxy (cloud load balancers' for `externalTrafficPolicy: Cluster`,
/// KEP-3836) keep working.
const DEFAULT_HEALTHZ_BIND_ADDRESS: &str = "0.0.0.0:10256";
/// kube-proxy's `--metrics-bind-address` default: loopback only, since the
/// metrics name Services and namespaces; a scraper needs it widened
/// (the chart does so when its metrics Service or ServiceMonitor is on).
const DEFAULT_METRICS_BIND_ADDRESS: &str = "127.0.0.1:10249";

#[derive(Args)]
pub(crate) struct RunArgs {
    /// This node's name, as in Node objects and endpoints' nodeName.
    #[arg(long, env = "NODE_NAME")]
    node: String,
    /// Manifest files or directories (YAML or JSON, multi-document, List
    /// objects) holding Services, EndpointSlices and Nodes. Watched for
    /// changes (inotify); a file is taken once it parses, and one that
    /// does not keeps its previous objects.
    /// Without --manifests the agent watches the Kubernetes API server
    /// (in-cluster configuration, or --kubeconfig).
    #[arg(long, num_args = 1..)]
    manifests: Vec<PathBuf>,
    /// How often manifests are checked for changes inotify did not report
    /// (a stat of each file; only changed files are read).
    #[arg(long, default_value_t = 30_000)]
    poll_interval_ms: u64,
    /// kubeconfig file to reach the API server (Kubernetes mode). Without
    /// it the in-cluster configuration is used (service account token and
    /// KUBERNETES_SERVICE_HOST/PORT, as in a DaemonSet pod).
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// IP:port for /healthz, /livez and /readyz (HTTP), as kube-proxy's
    /// flag of this name. Kubernetes mode serves on 0.0.0.0:10256 unless
    /// told otherwise; manifests mode only when this is given. `off` or an
    /// empty value disables it; port 0 picks a free port (the address is
    /// logged).
    #[arg(long)]
    healthz_bind_address: Option<String>,
    /// IP:port for /metrics (HTTP), as kube-proxy's flag of this name.
    /// Kubernetes mode serves on 127.0.0.1:10249 unless told otherwise
    /// (0.0.0.0:10249 or [::]:10249 for a scraper on another host);
    /// manifests mode only when this is given. `off` or an empty value
    /// disables it; port 0 picks a free port (the address is logged). The
    /// same address as --healthz-bind-address serves everything on one
    /// port.
    #[arg(long)]
    metrics_bind_address: Option<String>,
    /// Minimum time between two syncs; changes arriving meanwhile are
    /// applied together (like kube-proxy's --min-sync-period). A sync costs
    /// in proportion to what changed (decisions are kept between syncs), so
    /// the interval can be short: it bounds the time a change waits, not
    /// the work done.
    #[arg(long, default_value_t = 5)]
    min_sync_period_ms: u64,
    /// A full sync runs at least this often, retrying frontends that did
    /// not fit into the maps (like kube-proxy's --sync-period).
    #[arg(long, default_value_t = 30)]
    sync_period_secs: u64,
    /// Which TCP connections to a backend that left its Service the agent
    /// ends: `gone` ends them once the endpoint is gone from every
    /// EndpointSlice after it was seen terminating (its pod is gone, so
    /// they are dead anyway: ending them turns a hang into a fast error);
    /// `never` leaves every established TCP connection alone. Not serving,
    /// topology changes and a Service left without endpoints never end
    /// TCP. Connected UDP sockets are ended when their endpoint is gone or
    /// not serving whatever this says, as kube-proxy does.
    #[arg(long, value_enum, default_value_t = TerminateTcp::Gone)]
    terminate_tcp: TerminateTcp,
    /// Seconds a Service whose topology reads labels of other Nodes (a
    /// node pool, a region or custom key) waits for the Node watch to list
    /// them: it keeps what is programmed (or stays unprogrammed if new)
    /// rather than be programmed without them. Past it, the Service is
    /// programmed with what is known, with an Event, a metric and a log
    /// line naming the label. 0: never wait.
    #[arg(long, default_value_t = 10)]
    node_label_wait_secs: u64,
    /// Seconds between two sweeps of `SOCK_REC` that delete the records of
    /// sockets that no longer exist (every TCP and UDP socket of every
    /// network namespace is listed with sock_diag); 0 sweeps only at
    /// start. The `sock_release` program deletes a record when its socket
    /// closes; the sweep takes the rare record whose release it did not
    /// see (about one in a million sockets while other cgroups' programs
    /// were attached and detached, on Linux 6.18), which would otherwise
    /// hold a slot of the preallocated map for good.
    #[arg(long, default_value_t = 300)]
    sock_rec_sweep_interval_secs: u64,
    /// Which Service ports' connection counts by topology tier
    /// (`topoproxy_service_connections_total` and
    /// `..._blind_remote_total`) are exported one by one: `topology`, the
    /// Services with a topology setting (topologyKeys, the topology
    /// annotations, hints, trafficDistribution, internalTrafficPolicy
    /// Local), every other port summed into one series per tier with empty
    /// namespace, service and port labels; `all`, every port (a series per
    /// port and tier: mind the cardinality); `none`, neither family.
    #[arg(long, value_enum, default_value_t = ServiceMetrics::Topology)]
    service_metrics: ServiceMetrics,
    #[command(flatten)]
    datapath: DatapathArgs,
}

/// `--service-metrics` (`observe::service_connections::Mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum ServiceMetrics {
    Topology,
    All,
    None,
}

impl From<ServiceMetrics> for Mode {
    fn from(m: ServiceMetrics) -> Mode {
        match m {
            ServiceMetrics::Topology => Mode::Topology,
            ServiceMetrics::All => Mode::All,
            ServiceMetrics::None => Mode::None,
        }
    }
}

/// `--terminate-tcp` (`decide::departures::TcpTermination`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum TerminateTcp {
    Gone,
    Never,
}

impl From<TerminateTcp> for TcpTermination {
    fn from(t: TerminateTcp) -> TcpTermination {
        match t {
            TerminateTcp::Gone => TcpTermination::Gone,
            TerminateTcp::Never => TcpTermination::Never,
        }
    }
}

pub(crate) fn run(args: RunArgs) -> anyhow::Result<ExitCode> {
    tune_malloc();
    // Two workers: the source keeps reading while a large sync writes maps
    // on the other.
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().context("starting the runtime")?;
    let result = rt.block_on(run_async(args));
    // Watcher tasks may sit in a backoff sleep or a long poll: do not wait.
    rt.shutdown_background();
    result
}

/// glibc gives every thread that allocates its own malloc arena (up to 8
/// per core), and memory freed in one arena is not reused by another: the
/// source builds objects on one worker, the sync loop frees them on
/// another. Two arenas keep the agent's footprint close to what it holds
/// (about 20 MiB less peak RSS at 10k Services, measured by `cargo xtask
/// bench`) at no measurable cost with two workers. One arena saved 4 MiB
/// more but listed and synced visibly slower (the watchers and the sync
/// loop then share one malloc lock).
///
/// A fixed mmap threshold: glibc raises it to the size of every large block
/// freed (up to 32 MiB), after which list pages (about a megabyte of JSON
/// each, copied twice by kube's client), the relist buffers and the full
/// pass's plan come from the heap and leave it fragmented at the peak.
/// Fixed, blocks from 256 KiB up are mapped and unmapped (mremap for
/// growth), and only small objects share the heap.
///
/// No fastbins (M_MXFAST 0): decoding a list page frees many small objects
/// into them, and every later allocation above the small-bin range first
/// merges them all back (malloc_consolidate), which profiled at a tenth of
/// the watchers' CPU while listing. Small blocks still get glibc's
/// per-thread cache; the cold sync measured about 3 % faster.
fn tune_malloc() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only tunes the allocator; called before any other
    // thread exists.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 2);
        libc::mallopt(libc::M_MMAP_THRESHOLD, 256 * 1024);
        libc::mallopt(libc::M_MXFAST, 0);
    }
}

/// The address `--<name>` asks to serve on, if any.
fn bind_address(name: &str, flag: Option<&str>, default: Option<&str>) -> anyhow::Result<Option<SocketAddr>> {
    match flag.or(default) {
        None | Some("off" | "") => Ok(None),
        Some(a) => a.parse().map(Some).with_context(|| format!("--{name} {a:?} is not an IP:port")),
    }
}

/// The listeners to open: the health and metrics addresses, or one for
/// both when they are equal (port 0 excepted: each asks for its own free
/// port).
fn listeners(healthz: Option<SocketAddr>, metrics: Option<SocketAddr>) -> Vec<(SocketAddr, Routes)> {
    match (healthz, metrics) {
        (Some(h), Some(m)) if h == m && h.port() != 0 => vec![(h, Routes::ALL)],
        _ => healthz.map(|h| (h, Routes::HEALTH)).into_iter().chain(metrics.map(|m| (m, Routes::METRICS))).collect(),
    }
}

async fn client(kubeconfig: Option<&PathBuf>) -> anyhow::Result<kube::Client> {
    let mut config = match kubeconfig {
        Some(path) => {
            let kc = Kubeconfig::read_from(path).with_context(|| format!("reading kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
                .await
                .with_context(|| format!("loading kubeconfig {}", path.display()))?
        }
        None => kube::Config::incluster().context(
            "no in-cluster configuration (KUBERNETES_SERVICE_HOST and the service account token); pass --kubeconfig, or --manifests for standalone mode",
        )?,
    };
    // kube's client-level retry re-sends 429/503/504 answers up to 15 times
    // with backoff of its own, for minutes. The watchers already back off
    // (kube-runtime's default_backoff) and the Event poster retries; more
    // importantly a 504 "Too large resource version" must reach the watcher
    // promptly so that it relists (see kube_watch::classify).
    config.default_retry = false;
    kube::Client::try_from(config).context("creating the Kubernetes client")
}

/// Polls what `ExternalDatapath::refresh` resolves from (the interface
/// addresses, the indexes of their devices, which change when a device is
/// recreated, and the devices with a default route), and when it changes
/// raises `changed` and asks the sync loop for a pass. The pass re-resolves
/// only then, so the syncs that EndpointSlice churn triggers (up to hundreds
/// per second) do no interface I/O.
async fn watch_node_addresses(tx: UnboundedSender<Signal>, changed: Arc<AtomicBool>) {
    use node_addresses::{POLL_INTERVAL, default_route_devices, ifindex, interface_addresses};
    let read = || {
        let addrs = interface_addresses().ok()?;
        Some((addrs.into_iter().map(|a| (ifindex(&a.device), a)).collect::<Vec<_>>(), default_route_devices()))
    };
    let mut last = read();
    loop {
        tokio::time::sleep(POLL_INTERVAL).await;
        let now = read();
        if now.is_some() && now != last {
            last = now;
            changed.store(true, Ordering::Release);
            if tx.send(Signal::Resync { reason: "node addresses changed" }).is_err() {
                return;
            }
        }
    }
}

/// How long start-up waits for the source's first full list before it
/// sizes the maps from what has arrived so far. A pinned datapath keeps
/// serving meanwhile; a fresh node has none yet either way.
const INITIAL_LIST_WAIT: Duration = Duration::from_secs(30);

/// Waits (at most `wait`) until the source has listed every kind, and
/// counts what the queued initial state will program (Maglev tables of
/// `maglev_default` size where no annotation says otherwise). The signals read
/// meanwhile are handed on, in order, through the returned receiver, so
/// the sync loop sees them as if nothing had looked.
async fn initial_needs(
    mut rx: UnboundedReceiver<Signal>,
    stores: &Stores,
    health: &Health,
    wait: Duration,
    maglev_default: Option<proxy_agent::decide::maglev::TableSize>,
) -> (UnboundedReceiver<Signal>, Option<Needs>) {
    let deadline = tokio::time::Instant::now() + wait;
    let mut seen = Vec::new();
    // Nodes size nothing, and the Kubernetes source announces their
    // listing only once the sync loop has said which labels of other Nodes
    // it needs (`kube_watch::watch_nodes`): waiting for them here would
    // wait for the timeout.
    let mut listed = [false; Kind::ALL.len()];
    listed[Kind::Node as usize] = true;
    while !listed.iter().all(|l| *l) {
        // /readyz says what the start-up waits for, as the sync loop does
        // after it.
        if listed[Kind::Service as usize] || listed[Kind::EndpointSlice as usize] {
            let missing: Vec<&str> = Kind::ALL.iter().filter(|k| !listed[**k as usize]).map(|k| k.as_str()).collect();
            health.waiting_for(format!("{} to be listed", missing.join(", ")));
        } else {
            health.waiting_for("Services, EndpointSlices and Nodes to be listed");
        }
        match tokio::time::timeout_at(deadline, rx.recv()).await {
            Ok(Some(signal)) => {
                if let Signal::Listed { kind } = &signal {
                    listed[*kind as usize] = true;
                }
                seen.push(signal);
            }
            Ok(None) | Err(_) => break,
        }
    }
    health.waiting_for("the datapath to be installed");
    let complete = listed.iter().all(|l| *l);
    if !complete {
        tracing::warn!(waited = ?wait, "the source has not listed everything yet; sizing the maps from what arrived");
    }
    let needs = stores.with_queued(|deltas| Needs::of(deltas, maglev_default));
    let (tx, forwarded) = tokio::sync::mpsc::unbounded_channel();
    for signal in seen {
        let _ = tx.send(signal);
    }
    tokio::spawn(async move {
        while let Some(signal) = rx.recv().await {
            if tx.send(signal).is_err() {
                return;
            }
        }
    });
    (forwarded, Some(needs))
}

async fn run_async(args: RunArgs) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(!args.node.is_empty(), "--node (or NODE_NAME) must name this node");
    let standalone = !args.manifests.is_empty();
    let mut external_cfg = args.datapath.external()?;
    let metrics = Arc::new(Metrics::new());
    let health = Arc::new(Health::new(DEFAULT_STALE_AFTER));
    health.waiting_for("the datapath to be installed");
    // Standalone agents often share a host (tests, demos): they serve
    // health and metrics only when asked to.
    let (healthz_default, metrics_default) =
        if standalone { (None, None) } else { (Some(DEFAULT_HEALTHZ_BIND_ADDRESS), Some(DEFAULT_METRICS_BIND_ADDRESS)) };
    let healthz_addr = bind_address("healthz-bind-address", args.healthz_bind_address.as_deref(), healthz_default)?;
    let metrics_addr = bind_address("metrics-bind-address", args.metrics_bind_address.as_deref(), metrics_default)?;
    // Both are bound before anything starts, so that a taken port is
    // reported at once.
    let mut bound = Vec::new();
    for (addr, routes) in listeners(healthz_addr, metrics_addr) {
        let (listener, local) = health_server::bind(addr, routes).await?;
        bound.push((listener, local, routes));
    }
    for (listener, local, routes) in bound {
        // Tests and operators read the bound addresses from these fields
        // when port 0 was asked for.
        let (h, m) = (routes.health.then_some(local), routes.metrics.then_some(local));
        tracing::info!(
            healthz_bind_address = h.map(tracing::field::display),
            metrics_bind_address = m.map(tracing::field::display),
            "serving {}",
            routes.paths()
        );
        tokio::spawn(health_server::serve(listener, routes, health.clone(), metrics.clone()));
    }

    // The source starts before the datapath is loaded: the maps are sized
    // from its first full list (unless every --max-* flag is given), and
    // what it reads waits in the queue until the sync loop runs.
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    // Which labels of other Nodes the Services' topology needs: the sync
    // loop publishes, the Node watch follows (Kubernetes mode only;
    // manifests hold whole Nodes).
    let (node_labels_tx, node_labels_rx) = tokio::sync::watch::channel(None);
    let (stores, events): (Stores, Option<EventReporter>) = if standalone {
        let interval = Duration::from_millis(args.poll_interval_ms.max(10));
        (manifest_watch::start(args.manifests.clone(), interval, metrics.clone(), tx.clone()), None)
    } else {
        let client = client(args.kubeconfig.as_ref()).await?;
        // EndpointSlices and Events changed version between 1.17 and
        // today: both wait for what the API server serves.
        let versions = api_versions::negotiate(client.clone(), metrics.clone());
        let stores = kube_watch::start(client.clone(), versions.clone(), tx.clone(), &args.node, node_labels_rx);
        let instance = format!("{}-{}", events::REPORTING_CONTROLLER, args.node);
        (stores, Some(EventReporter::spawn(client, instance, metrics.clone(), versions)))
    };

    let cgroup = args.datapath.cgroup()?;
    let pin_dir = args.datapath.bpffs.clone();
    // Maps created now are sized from the first full list (see
    // `sizing`): wait for it, bounded, unless every capacity is given.
    let (rx, needs) = if args.datapath.all_capacities_explicit() {
        (rx, None)
    } else {
        initial_needs(rx, &stores, &health, INITIAL_LIST_WAIT, args.datapath.maglev_table_size).await
    };
    // The first list goes into the model, and every Service is decided,
    // while the datapath installs, on the other core: after it, they were
    // on the cold start's path.
    let first_list = tokio::task::spawn_blocking({
        let (stores, keep_uids, node) = (stores.clone(), events.is_some(), args.node.clone());
        move || proxy_agent::sync::sync_loop::apply_first_list(&stores, keep_uids, &node)
    });
    let sizing = args.datapath.capacities(needs)?;
    let explicit = args.datapath.explicit_capacities()?;
    let pinned = |datapath| map_migration::pinned_datapath_capacities(&args.datapath.bpffs, datapath);
    let socket = sizing::keep_pinned(&sizing.caps, needs, &explicit, &pinned(Datapath::Socket));
    // With `--devices none` no TC program runs and nothing writes the TC
    // maps: they stay as pinned, or small (see `MapSizes`).
    let tc_idle = !external_cfg.devices.enabled();
    let tc = if tc_idle {
        sizing::idle_tc(&explicit, &pinned(Datapath::Tc))
    } else {
        sizing::keep_pinned(&sizing.caps, needs, &explicit, &pinned(Datapath::Tc))
    };
    let caps = MapSizes { socket, tc };
    tracing::info!(
        ?needs,
        services = socket.services,
        slots = socket.slots,
        backends = socket.backends,
        sock_revnat = socket.sock_revnat,
        np_conntrack = tc.np_conntrack,
        affinity = socket.affinity,
        tc_idle,
        maglev_tables_mib = sizing.maglev_bytes >> 20,
        worst_case_mib = sizing.worst_case_bytes >> 20,
        "map capacities"
    );
    metrics.set_maglev_budget(sizing.maglev_bytes);
    // One share for both datapaths' tables.
    let maglev_budget = std::sync::Arc::new(proxy_agent::datapath::maglev_budget::MaglevBudget::new(sizing.maglev_bytes));
    if sizing.over_budget {
        tracing::warn!(
            budget_mib = args.datapath.map_memory_budget,
            worst_case_mib = sizing.worst_case_bytes >> 20,
            "the capacities the cluster needs (or the --max-* flags) exceed --map-memory-budget; they are used anyway"
        );
    }
    // What the kernel offers decides which program variants load; said once
    // here and kept in /metrics (the loaders refuse a kernel below the
    // floor before they pin anything).
    let kernel = KernelFeatures::get();
    tracing::info!("kernel features: {}", kernel.summary());
    metrics.set_kernel_features(&kernel.features.iter().map(|f| (f.name, f.present)).collect::<Vec<_>>());
    let warnings = socket_loader::install(&cgroup, &pin_dir, caps)
        .with_context(|| format!("installing the datapath on cgroup {} with pins in {}", cgroup.display(), pin_dir.display()))?;
    for w in warnings {
        tracing::warn!("{w}");
    }
    let mut writer = MapWriter::open(&pin_dir).context("opening the pinned maps")?;
    // Issue #34: the writers publish who owns each counted frontend.
    metrics.service_connections().set_mode(args.service_metrics.into());
    writer.set_counter_owners(metrics.service_connections().owners());
    writer.set_maglev_size(args.datapath.maglev_table_size);
    writer.set_maglev_budget(maglev_budget.clone());
    external_cfg.maglev_budget = Some(maglev_budget);
    tracing::info!(
        node = %args.node,
        cgroup = %cgroup.display(),
        bpffs = %pin_dir.display(),
        adopted_frontends = writer.frontends(),
        "datapath installed; the maps keep their state until the source has been read"
    );

    // External traffic: TC programs on --devices, NodePorts on the node's
    // addresses, health check node ports.
    let (mut external, external_warnings) =
        ExternalDatapath::install(&pin_dir, &external_cfg).context("installing the external-traffic datapath")?;
    if let Some(w) = external.service_writer() {
        w.set_counter_owners(metrics.service_connections().owners());
    }
    for w in external_warnings {
        tracing::warn!("{w}");
    }
    tracing::info!(devices = ?external.devices, node_addresses = ?external.node_addrs, tc_fast_path = external.tc_fast_on(), "external traffic datapath ready");
    metrics.set_xdp_devices(&external.devices, &external.xdp_devices());

    // Sockets translated to a backend that leaves are terminated (and TC
    // flows to it flushed) by a worker thread; which mechanism this kernel
    // offers is said once, here.
    let detected = sock_destroy::detect(&pin_dir);
    sock_destroy::report(&detected.detection, &metrics);
    let terminator = Terminator::start(pin_dir.clone(), detected, metrics.clone()).context("starting the socket termination worker")?;
    tracing::info!(
        terminate_tcp = TcpTermination::from(args.terminate_tcp).label(),
        "connections to departed backends: UDP ends when its endpoint is gone or not serving; TCP only when gone after terminating (--terminate-tcp=gone) or never"
    );

    // NP_COUNTERS and COUNTERS in /metrics, and the conntrack GC of NP_CT.
    let counters_dir = pin_dir.clone();
    metrics.export_nodeport_counters(Box::new(move || np_counter_sums(&counters_dir).map_err(|e| e.to_string())));
    let counters_dir = pin_dir.clone();
    metrics.export_tc_fast_counters(Box::new(move || np_fast_counter_sums(&counters_dir).map_err(|e| e.to_string())));
    let counters_dir = pin_dir.clone();
    metrics.export_socket_counters(Box::new(move || socket_counter_sums(&counters_dir).map_err(|e| e.to_string())));
    let counters_dir = pin_dir.clone();
    metrics.service_connections().export(Box::new(move |datapath, ids| {
        let spec = if datapath == service_connections::TC { &maps::NP_SVC_CONN } else { &maps::SVC_CONN };
        service_conn_sums(&counters_dir, spec, ids).map_err(|e| e.to_string())
    }));
    let _conntrack_gc = conntrack_gc::spawn(pin_dir.clone(), args.datapath.conntrack.gc_config(), metrics.clone());
    let _sock_rec_sweep = sock_rec_sweep::spawn(pin_dir.clone(), Duration::from_secs(args.sock_rec_sweep_interval_secs));
    // Pins removed under us are put back (the maps themselves live on in
    // the programs; see pin_guard).
    let _pin_guard = match PinGuard::open(&pin_dir, &cgroup, caps) {
        Ok(guard) => Some(pin_guard::spawn(guard, metrics.clone())),
        Err(e) => {
            tracing::warn!("pins removed under the agent will not be put back: {e}");
            None
        }
    };
    // Node addresses are followed, not read once: a change asks the sync
    // loop for a pass, in which `refresh` re-resolves devices, NodePort
    // addresses and SNAT before the maps are written.
    let addresses_changed = Arc::new(AtomicBool::new(false));
    tokio::spawn(watch_node_addresses(tx, addresses_changed.clone()));

    let config = SyncConfig {
        node: args.node,
        min_sync_interval: Duration::from_millis(args.min_sync_period_ms),
        sync_period: Duration::from_secs(args.sync_period_secs.max(1)),
        terminate_tcp: args.terminate_tcp.into(),
        node_label_wait: Duration::from_secs(args.node_label_wait_secs),
    };
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let shutdown = async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    };
    let first_list = first_list.await.context("applying the first list")?;
    let mut sync = SyncLoop::new(config, writer, stores, metrics, health, events).with_first_list(first_list);
    if !standalone {
        sync = sync.with_node_label_needs(node_labels_tx);
    }
    sync.with_external(external, addresses_changed).with_termination(terminator).run(rx, shutdown).await;
    // Nothing to tear down: pinned links and maps keep serving until the
    // next agent adopts them or `proxy-agent reset` removes them.
    tracing::info!("stopping; the pinned datapath keeps serving");
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn health_and_metrics_listen_apart_unless_given_one_address() {
        let a = |s: &str| s.parse::<SocketAddr>().expect("address");
        let (h, m) = (
            bind_address("healthz-bind-address", None, Some(DEFAULT_HEALTHZ_BIND_ADDRESS)),
            bind_address("metrics-bind-address", None, Some(DEFAULT_METRICS_BIND_ADDRESS)),
        );
        let (h, m) = (h.expect("default"), m.expect("default"));
        assert_eq!(
            listeners(h, m),
            vec![(a("0.0.0.0:10256"), Routes::HEALTH), (a("127.0.0.1:10249"), Routes::METRICS)],
            "kube-proxy's defaults"
        );
        assert_eq!(listeners(Some(a("0.0.0.0:9000")), Some(a("0.0.0.0:9000"))), vec![(a("0.0.0.0:9000"), Routes::ALL)]);
        assert_eq!(listeners(Some(a("127.0.0.1:0")), Some(a("127.0.0.1:0"))).len(), 2, "port 0 twice: two free ports");
        assert_eq!(listeners(None, Some(a("[::1]:10249"))), vec![(a("[::1]:10249"), Routes::METRICS)]);
        for off in ["off", ""] {
            assert_eq!(bind_address("metrics-bind-address", Some(off), Some(DEFAULT_METRICS_BIND_ADDRESS)).expect("off"), None);
        }
        let e = bind_address("metrics-bind-address", Some("127.0.0.1"), None).expect_err("no port");
        assert!(format!("{e:#}").contains("--metrics-bind-address \"127.0.0.1\""), "{e:#}");
    }
}
