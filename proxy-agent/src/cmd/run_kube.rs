//! `proxy-agent run` without `--manifests`: a node agent of a Kubernetes
//! cluster. Watches Services, EndpointSlices and Nodes, keeps the pinned
//! maps in sync, serves /healthz, /readyz and /metrics and posts Events
//! about Services it cannot program.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use kube::config::{KubeConfigOptions, Kubeconfig};
use proxy_agent::events::EventReporter;
use proxy_agent::health_server::{self, DEFAULT_STALE_AFTER, Health};
use proxy_agent::kube_source::{self, Signal};
use proxy_agent::kube_sync::{SyncConfig, SyncLoop};
use proxy_agent::loader;
use proxy_agent::map_writer::MapWriter;
use proxy_agent::metrics::Metrics;
use tokio::signal::unix::{SignalKind, signal};

use super::datapath_args::DatapathArgs;

/// kube-proxy serves /healthz on 10256; the agent replaces kube-proxy, so
/// it takes the same port and probes written for kube-proxy keep working.
pub const DEFAULT_METRICS_ADDRESS: &str = "0.0.0.0:10256";

#[derive(Args, Clone, Debug)]
pub struct KubeArgs {
    /// kubeconfig file to reach the API server (Kubernetes mode). Without
    /// it the in-cluster configuration is used (service account token and
    /// KUBERNETES_SERVICE_HOST/PORT, as in a DaemonSet pod).
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// Address for /healthz, /readyz and /metrics (HTTP). Kubernetes mode
    /// serves on 0.0.0.0:10256 unless told otherwise; manifests mode only
    /// when this is given. `off` disables the server; port 0 picks a free
    /// port (the address is logged).
    #[arg(long)]
    pub metrics_address: Option<String>,
    /// Minimum time between two syncs in Kubernetes mode; changes arriving
    /// meanwhile are applied together (like kube-proxy's --min-sync-period).
    /// A sync costs in proportion to what changed (decisions are kept
    /// between syncs), so the interval can be short: it bounds the time a
    /// change waits, not the work done.
    #[arg(long, default_value_t = 5)]
    pub min_sync_period_ms: u64,
    /// A full sync runs at least this often in Kubernetes mode, retrying
    /// frontends that did not fit into the maps (like kube-proxy's
    /// --sync-period).
    #[arg(long, default_value_t = 30)]
    pub sync_period_secs: u64,
}

/// The health/metrics address to serve on, if any.
pub fn metrics_address(flag: Option<&str>, default: Option<&str>) -> anyhow::Result<Option<SocketAddr>> {
    match flag.or(default) {
        None | Some("off") | Some("") => Ok(None),
        Some(a) => a.parse().map(Some).with_context(|| format!("--metrics-address {a:?} is not an IP:port")),
    }
}

/// Binds and starts the health/metrics server on the current runtime.
pub async fn start_health_server(addr: Option<SocketAddr>, health: Arc<Health>, metrics: Arc<Metrics>) -> anyhow::Result<()> {
    if let Some(addr) = addr {
        let (listener, bound) = health_server::bind(addr).await?;
        // Tests and operators read the bound address from this line when
        // port 0 was asked for.
        tracing::info!(metrics_address = %bound, "serving /healthz, /readyz and /metrics");
        tokio::spawn(health_server::serve(listener, health, metrics));
    }
    Ok(())
}

pub fn run(node: String, args: KubeArgs, datapath: DatapathArgs) -> anyhow::Result<ExitCode> {
    // glibc gives every thread that allocates its own malloc arena (up to
    // 8 per core), and memory freed in one arena is not reused by another:
    // the watcher tasks build objects on one worker, the sync loop frees
    // them on another. Two arenas keep the agent's footprint close to what
    // it holds (about 20 MiB less peak RSS at 10k Services, measured by
    // `cargo xtask bench`) at no measurable cost with two workers. One
    // arena saved 4 MiB more but listed and synced visibly slower (the
    // watchers and the sync loop then share one malloc lock).
    //
    // A fixed mmap threshold: glibc raises it to the size of every large
    // block freed (up to 32 MiB), after which list pages (about a megabyte
    // of JSON each, copied twice by kube's client), the relist buffers and
    // the full pass's plan come from the heap and leave it fragmented at
    // the peak. Fixed, blocks from 256 KiB up are mapped and unmapped
    // (mremap for growth), and only small objects share the heap.
    //
    // No fastbins (M_MXFAST 0): decoding a list page frees many small
    // objects into them, and every later allocation above the small-bin
    // range first merges them all back (malloc_consolidate), which profiled
    // at a tenth of the watchers' CPU while listing. Small blocks still get
    // glibc's per-thread cache; the cold sync measured about 3 % faster.
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only tunes the allocator; called before any other
    // thread exists.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 2);
        libc::mallopt(libc::M_MMAP_THRESHOLD, 256 * 1024);
        libc::mallopt(libc::M_MXFAST, 0);
    }
    // Two workers: the watchers keep reading the API server while a large
    // sync writes maps on the other.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the runtime")?;
    let result = rt.block_on(run_async(node, args, datapath));
    // Watcher tasks may sit in a backoff sleep or a long poll: do not wait.
    rt.shutdown_background();
    result
}

async fn client(args: &KubeArgs) -> anyhow::Result<kube::Client> {
    let config = match &args.kubeconfig {
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
    // promptly so that it relists (see kube_source::classify).
    let mut config = config;
    config.default_retry = false;
    kube::Client::try_from(config).context("creating the Kubernetes client")
}

/// Polls what `ExternalDatapath::refresh` resolves from (the interface
/// addresses, the indexes of their devices, which change when a device is
/// recreated, and the devices with a default route), and when it changes
/// raises `changed` and asks the sync loop for a pass. The pass re-resolves
/// only then, so the syncs that EndpointSlice churn triggers (up to hundreds
/// per second) do no interface I/O.
async fn watch_node_addresses(tx: tokio::sync::mpsc::UnboundedSender<Signal>, changed: Arc<AtomicBool>) {
    use proxy_agent::node_addresses::{POLL_INTERVAL, default_route_devices, ifindex, interface_addresses};
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

async fn run_async(node: String, args: KubeArgs, datapath: DatapathArgs) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(!node.is_empty(), "--node (or NODE_NAME) must name this node");
    let external_cfg = datapath.external()?;
    let client = client(&args).await?;
    let metrics = Arc::new(Metrics::new());
    let health = Arc::new(Health::new(DEFAULT_STALE_AFTER));
    health.waiting_for("the datapath to be installed");
    let addr = metrics_address(args.metrics_address.as_deref(), Some(DEFAULT_METRICS_ADDRESS))?;
    start_health_server(addr, health.clone(), metrics.clone()).await?;

    // The watchers start listing before the datapath is loaded: listing is
    // most of a cold start at scale, and the BPF load and attach below
    // (a few hundred milliseconds with large preallocated maps) need none
    // of it. What they list waits in the channel until the sync loop runs.
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let stores = kube_source::start(client.clone(), tx.clone());

    let cgroup = datapath.cgroup()?;
    let pin_dir = datapath.bpffs.clone();
    let caps = datapath.capacities()?;
    let warnings = loader::install(&cgroup, &pin_dir, caps)
        .with_context(|| format!("installing the datapath on cgroup {} with pins in {}", cgroup.display(), pin_dir.display()))?;
    for w in warnings {
        tracing::warn!("{w}");
    }
    let writer = MapWriter::open(&pin_dir).context("opening the pinned maps")?;
    tracing::info!(
        node = %node,
        cgroup = %cgroup.display(),
        bpffs = %pin_dir.display(),
        adopted_frontends = writer.frontends(),
        "datapath installed; the maps keep their state until the API server has been listed"
    );

    // External traffic (issue #5) as in manifests mode: TC programs on
    // --devices, NodePorts on the node's addresses, health check node ports.
    let (mut external, external_warnings) = proxy_agent::nodeport::ExternalDatapath::install(&pin_dir, &external_cfg)
        .context("installing the external-traffic datapath")?;
    for w in external_warnings {
        tracing::warn!("{w}");
    }
    tracing::info!(devices = ?external.devices, node_addresses = ?external.node_addrs, "external traffic datapath ready");

    // NP_COUNTERS in /metrics, and the conntrack GC of NP_CT (issue #5).
    metrics.export_nodeport_counters(&pin_dir);
    let _conntrack_gc = proxy_agent::conntrack_gc::spawn(pin_dir.clone(), datapath.conntrack.gc_config(), metrics.clone());
    // Node addresses are followed, not read once: a change asks the sync
    // loop for a pass, in which `refresh` re-resolves devices, NodePort
    // addresses and SNAT before the maps are written.
    let addresses_changed = Arc::new(AtomicBool::new(false));
    tokio::spawn(watch_node_addresses(tx, addresses_changed.clone()));
    let events = EventReporter::spawn(client, format!("{}-{node}", proxy_agent::events::REPORTING_CONTROLLER), metrics.clone());
    let config = SyncConfig {
        node,
        min_sync_interval: Duration::from_millis(args.min_sync_period_ms),
        sync_period: Duration::from_secs(args.sync_period_secs.max(1)),
    };
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let shutdown = async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    };
    SyncLoop::new(config, writer, stores, metrics, health, Some(events))
        .with_step(Box::new(move |writer, cached, cluster, changes, full| {
            // Full passes (the first, then every --sync-period-secs)
            // re-resolve as well, like they re-compare every map entry.
            if addresses_changed.swap(false, Ordering::AcqRel) || full {
                external.refresh();
            }
            cached.pass(writer, Some(&mut external), cluster, changes, full)
        }))
        .run(rx, shutdown)
        .await;
    // Nothing to tear down: pinned links and maps keep serving until the
    // next agent adopts them or `proxy-agent reset` removes them.
    tracing::info!("stopping; the pinned datapath keeps serving");
    Ok(ExitCode::SUCCESS)
}
