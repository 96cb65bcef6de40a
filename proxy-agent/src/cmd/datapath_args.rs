//! Flags that say where the datapath lives, shared by `run` and `reset`.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use proxy_agent::loader::Capacities;
use proxy_agent::{DEFAULT_BPFFS, mounts};
use proxy_common as pc;

#[derive(Args, Clone, Debug)]
pub struct DatapathArgs {
    /// cgroup v2 directory the socket programs attach to; every process in it
    /// and below is load balanced. Default: the cgroup2 root from
    /// /proc/self/mountinfo.
    #[arg(long)]
    pub cgroup: Option<PathBuf>,
    /// Directory on a BPF filesystem for pinned maps and links; bpffs is
    /// mounted on its parent when missing.
    #[arg(long, default_value = DEFAULT_BPFFS)]
    pub bpffs: PathBuf,
    /// Capacity of the SERVICES map (frontends). Applies when the map is created.
    #[arg(long, default_value_t = pc::DEFAULT_MAX_SERVICES)]
    pub max_services: u32,
    /// Capacity of the SLOTS map (sum of backends over all frontends).
    #[arg(long, default_value_t = pc::DEFAULT_MAX_SLOTS)]
    pub max_slots: u32,
    /// Capacity of the BACKENDS map (distinct backend addresses).
    #[arg(long, default_value_t = pc::DEFAULT_MAX_BACKENDS)]
    pub max_backends: u32,
    /// Capacity of the SOCK_REVNAT LRU map (sockets remembered for getpeername/recvmsg).
    #[arg(long, default_value_t = pc::DEFAULT_MAX_SOCK_REVNAT)]
    pub max_sock_revnat: u32,
}

impl DatapathArgs {
    pub fn cgroup(&self) -> anyhow::Result<PathBuf> {
        match &self.cgroup {
            Some(p) => Ok(p.clone()),
            None => mounts::cgroup2_root().context("finding the cgroup v2 root"),
        }
    }

    pub fn capacities(&self) -> anyhow::Result<Capacities> {
        for (flag, v) in [
            ("--max-services", self.max_services),
            ("--max-slots", self.max_slots),
            ("--max-backends", self.max_backends),
            ("--max-sock-revnat", self.max_sock_revnat),
        ] {
            anyhow::ensure!(v > 0, "{flag} must be at least 1");
        }
        Ok(Capacities {
            services: self.max_services,
            slots: self.max_slots,
            backends: self.max_backends,
            sock_revnat: self.max_sock_revnat,
        })
    }
}
