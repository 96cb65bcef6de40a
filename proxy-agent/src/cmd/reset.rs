//! `proxy-agent reset`: undo `run`.

use std::process::ExitCode;

use anyhow::Context;
use clap::Args;
use proxy_agent::datapath::socket_loader;

use super::datapath_args::DatapathArgs;

#[derive(Args)]
pub(crate) struct ResetArgs {
    #[command(flatten)]
    datapath: DatapathArgs,
}

pub(crate) fn reset(args: ResetArgs) -> anyhow::Result<ExitCode> {
    // The links are pinned, so the pin directory alone identifies what to
    // detach; --cgroup is accepted for symmetry with `run`.
    let dir = &args.datapath.bpffs;
    socket_loader::reset(dir).with_context(|| format!("resetting {}", dir.display()))?;
    tracing::info!(bpffs = %dir.display(), "removed programs, links and maps");
    Ok(ExitCode::SUCCESS)
}
