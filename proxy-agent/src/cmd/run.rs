//! `proxy-agent run`: install the datapath, adopt what is pinned, and keep
//! the maps in sync with the manifests.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use proxy_agent::map_writer::MapWriter;
use proxy_agent::health_server::{DEFAULT_STALE_AFTER, Health};
use proxy_agent::metrics::{Metrics, reason};
use proxy_agent::{loader, manifest, objects, sync};
use tokio::signal::unix::{SignalKind, signal};

use super::datapath_args::DatapathArgs;
use super::run_kube::{self, KubeArgs};

#[derive(Args)]
pub struct RunArgs {
    /// This node's name, as in Node objects and endpoints' nodeName.
    #[arg(long, env = "NODE_NAME")]
    node: String,
    /// Manifest files or directories (YAML or JSON, multi-document, List
    /// objects) holding Services, EndpointSlices and Nodes. Watched for
    /// changes; write them atomically (write elsewhere, then rename).
    /// Without --manifests the agent watches the Kubernetes API server
    /// (in-cluster configuration, or --kubeconfig).
    #[arg(long, num_args = 1..)]
    manifests: Vec<PathBuf>,
    /// How often manifests are checked for changes.
    #[arg(long, default_value_t = 200)]
    poll_interval_ms: u64,
    #[command(flatten)]
    datapath: DatapathArgs,
    #[command(flatten)]
    kube: KubeArgs,
}

pub fn run(args: RunArgs) -> anyhow::Result<ExitCode> {
    if args.manifests.is_empty() {
        return run_kube::run(args.node, args.kube, args.datapath);
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().context("starting the runtime")?;
    rt.block_on(run_async(args))
}

async fn run_async(args: RunArgs) -> anyhow::Result<ExitCode> {
    let cgroup = args.datapath.cgroup()?;
    let pin_dir = args.datapath.bpffs.clone();
    let caps = args.datapath.capacities()?;
    let external_cfg = args.datapath.external()?;
    let warnings = loader::install(&cgroup, &pin_dir, caps)
        .with_context(|| format!("installing the datapath on cgroup {} with pins in {}", cgroup.display(), pin_dir.display()))?;
    for w in warnings {
        tracing::warn!("{w}");
    }
    let mut writer = MapWriter::open(&pin_dir).context("opening the pinned maps")?;
    tracing::info!(
        node = %args.node,
        cgroup = %cgroup.display(),
        bpffs = %pin_dir.display(),
        adopted_frontends = writer.frontends(),
        "datapath installed"
    );
    // External traffic (issue #5): TC programs on --devices, NodePorts on
    // the node's addresses, health check node ports.
    let (mut external, external_warnings) =
        proxy_agent::nodeport::ExternalDatapath::install(&pin_dir, &external_cfg)
            .context("installing the external-traffic datapath")?;
    for w in external_warnings {
        tracing::warn!("{w}");
    }
    tracing::info!(devices = ?external.devices, node_addresses = ?external.node_addrs, "external traffic datapath ready");

    // Health and metrics only when --metrics-address is given: several
    // standalone agents often share a host (tests, demos).
    let metrics = Arc::new(Metrics::new());
    let health = Arc::new(Health::new(DEFAULT_STALE_AFTER));
    let addr = run_kube::metrics_address(args.kube.metrics_address.as_deref(), None)?;
    run_kube::start_health_server(addr, health.clone(), metrics.clone()).await?;
    // NP_COUNTERS in /metrics, and the conntrack GC of NP_CT (issue #5).
    metrics.export_nodeport_counters(&pin_dir);
    let _conntrack_gc = proxy_agent::conntrack_gc::spawn(pin_dir.clone(), args.datapath.conntrack.gc_config(), metrics.clone());

    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let interval = Duration::from_millis(args.poll_interval_ms.max(10));
    let mut last = None;
    let mut addresses_checked = Instant::now();
    loop {
        // Node addresses are followed, not read once: a NodePort on an
        // address added later works without a restart.
        let mut addresses_changed = false;
        if addresses_checked.elapsed() >= proxy_agent::node_addresses::POLL_INTERVAL {
            addresses_checked = Instant::now();
            addresses_changed = external.refresh();
        }
        let fp = manifest::fingerprint(&args.manifests);
        if last != Some(fp) || addresses_changed {
            last = Some(fp);
            sync_once(&mut writer, &mut external, &args.manifests, &args.node, &metrics);
            health.synced();
        }
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = term.recv() => break,
            _ = int.recv() => break,
        }
    }
    // Nothing to tear down: pinned links and maps keep serving until the
    // next agent adopts them or `proxy-agent reset` removes them.
    tracing::info!("stopping; the pinned datapath keeps serving");
    Ok(ExitCode::SUCCESS)
}

fn sync_once(
    writer: &mut MapWriter,
    external: &mut proxy_agent::nodeport::ExternalDatapath,
    paths: &[PathBuf],
    node: &str,
    metrics: &Metrics,
) {
    let started = Instant::now();
    // Each document is converted as it is read and then dropped.
    let mut builder = objects::ClusterBuilder::default();
    let read_errors = manifest::for_each(paths, |doc| builder.add(&doc));
    metrics.errors_by(reason::MANIFEST, read_errors.len());
    for e in &read_errors {
        tracing::warn!(location = %e.location, "manifest skipped: {}", e.reason);
    }
    let (cluster, object_errors) = builder.finish();
    for e in &object_errors {
        tracing::warn!(kind = %e.kind, object = %e.object, "object skipped: {}", e.reason);
        metrics.error(match e.kind.as_str() {
            "Service" => reason::INVALID_SERVICE,
            "EndpointSlice" => reason::INVALID_ENDPOINT_SLICE,
            "Node" => reason::INVALID_NODE,
            _ => reason::MANIFEST,
        });
    }
    let outcome = sync::sync_with_external(writer, external, &cluster, node);
    metrics.record_sync(&outcome, writer, started.elapsed());
    metrics.errors_by(reason::INVALID_TOPOLOGY, outcome.decisions.iter().map(|d| d.problems.len()).sum());
    for p in &outcome.problems {
        tracing::warn!("{p}");
    }
    for f in &outcome.failures {
        tracing::error!(frontend = %f.frontend, "not programmed, left as it was: {}", f.error);
    }
    tracing::info!(
        services = cluster.services.len(),
        slices = cluster.slices.len(),
        nodes = cluster.nodes.len(),
        frontends = writer.frontends(),
        external_frontends = external.tc_frontends(),
        upserts = outcome.upserts,
        deletes = outcome.deletes,
        failed = outcome.failures.len(),
        took_ms = started.elapsed().as_millis() as u64,
        "synced"
    );
}
