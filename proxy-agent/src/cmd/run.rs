//! `proxy-agent run`: install the datapath, adopt what is pinned, and keep
//! the maps in sync with the manifests.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use proxy_agent::map_writer::MapWriter;
use proxy_agent::{loader, manifest, objects, sync};
use tokio::signal::unix::{SignalKind, signal};

use super::datapath_args::DatapathArgs;

#[derive(Args)]
pub struct RunArgs {
    /// This node's name, as in Node objects and endpoints' nodeName.
    #[arg(long, env = "NODE_NAME")]
    node: String,
    /// Manifest files or directories (YAML or JSON, multi-document, List
    /// objects) holding Services, EndpointSlices and Nodes. Watched for
    /// changes; write them atomically (write elsewhere, then rename).
    #[arg(long, num_args = 1.., required = true)]
    manifests: Vec<PathBuf>,
    /// How often manifests are checked for changes.
    #[arg(long, default_value_t = 200)]
    poll_interval_ms: u64,
    #[command(flatten)]
    datapath: DatapathArgs,
}

pub fn run(args: RunArgs) -> anyhow::Result<ExitCode> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().context("starting the runtime")?;
    rt.block_on(run_async(args))
}

async fn run_async(args: RunArgs) -> anyhow::Result<ExitCode> {
    let cgroup = args.datapath.cgroup()?;
    let pin_dir = args.datapath.bpffs.clone();
    let caps = args.datapath.capacities()?;
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
        adopted_frontends = writer.state().len(),
        "datapath installed"
    );

    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let interval = Duration::from_millis(args.poll_interval_ms.max(10));
    let mut last = None;
    loop {
        let fp = manifest::fingerprint(&args.manifests);
        if last != Some(fp) {
            last = Some(fp);
            sync_once(&mut writer, &args.manifests, &args.node);
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

fn sync_once(writer: &mut MapWriter, paths: &[PathBuf], node: &str) {
    let (docs, read_errors) = manifest::load(paths);
    for e in &read_errors {
        tracing::warn!(location = %e.location, "manifest skipped: {}", e.reason);
    }
    let (cluster, object_errors) = objects::build_cluster(&docs);
    for e in &object_errors {
        tracing::warn!(kind = %e.kind, object = %e.object, "object skipped: {}", e.reason);
    }
    let outcome = sync::sync(writer, &cluster, node);
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
        frontends = writer.state().len(),
        upserts = outcome.upserts,
        deletes = outcome.deletes,
        failed = outcome.failures.len(),
        "synced"
    );
}
