//! Flags that say where the datapath lives, shared by `run` and `reset`.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use proxy_agent::DEFAULT_BPFFS;
use proxy_agent::datapath::maps::{Capacities, Capacity};
use proxy_agent::datapath::mounts;
use proxy_agent::external::node_addresses::Devices;
use proxy_common as pc;

#[derive(Args, Clone, Debug)]
pub(crate) struct DatapathArgs {
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
    /// Capacity of the NP_CT LRU map (connection tracking of external
    /// traffic at TC; four entries per flow to a remote backend, two to a
    /// local one).
    #[arg(long, default_value_t = pc::DEFAULT_MAX_NP_CT)]
    pub max_np_conntrack: u32,
    /// Capacity of each datapath's session affinity LRU map (AFFINITY,
    /// NP_AFFINITY): clients remembered per `sessionAffinity: ClientIP`
    /// frontend, the least recently used forgotten first.
    #[arg(long, default_value_t = pc::DEFAULT_MAX_AFFINITY)]
    pub max_affinity: u32,
    /// Node interfaces that get the TC programs for traffic from outside
    /// (NodePort, LoadBalancer IPs, externalIPs): `auto` (the interfaces
    /// that hold the node's addresses, followed as addresses come and go),
    /// a list such as `eth0,eth1`, or `none` for no TC program at all
    /// (NodePorts then work only from the node itself, through the socket
    /// programs). Agents sharing a network namespace with interfaces they
    /// must not touch (tests, demos) pass `none`.
    #[arg(long, default_value = "auto", value_parser = parse_devices)]
    pub devices: Devices,
    /// Node address to SNAT to for backends on other nodes (one per family),
    /// also served as a NodePort address. Default: the first address of the
    /// first device (devices with a default route first), re-resolved when
    /// the node's addresses change.
    #[arg(long, value_delimiter = ',')]
    pub node_ip: Vec<std::net::IpAddr>,
    /// Source ports for SNAT, `MIN-MAX`; keep it outside
    /// net.ipv4.ip_local_port_range so it never collides with the node's own
    /// connections.
    #[arg(long, default_value = "61000-65535")]
    pub snat_port_range: String,
    /// How the TC programs attach: `auto` (tcx on Linux >= 6.6, clsact
    /// before), `tcx` or `netlink` (clsact + cls_bpf).
    #[arg(long, default_value = "auto", value_parser = ["auto", "tcx", "netlink"])]
    pub tc_mode: String,
    #[command(flatten)]
    pub conntrack: super::conntrack_args::ConntrackArgs,
}

/// `--devices` through `Devices::parse`, so that clap rejects a bad value
/// (e.g. `none` next to interface names) before anything is installed.
fn parse_devices(value: &str) -> Result<Devices, String> {
    Devices::parse(value).map_err(|e| e.to_string())
}

impl DatapathArgs {
    /// The external-traffic settings (`--devices`, `--node-ip`,
    /// `--snat-port-range`).
    pub(crate) fn external(&self) -> anyhow::Result<proxy_agent::external::nodeport::ExternalConfig> {
        let (lo, hi) = self
            .snat_port_range
            .split_once('-')
            .and_then(|(a, b)| Some((a.trim().parse::<u16>().ok()?, b.trim().parse::<u16>().ok()?)))
            .filter(|(a, b)| a <= b && *a > 0)
            .with_context(|| format!("--snat-port-range {:?}: expected MIN-MAX", self.snat_port_range))?;
        let devices = self.devices.clone();
        let tc_mode = match self.tc_mode.as_str() {
            "tcx" => proxy_agent::datapath::tc_loader::TcMode::Tcx,
            "netlink" => proxy_agent::datapath::tc_loader::TcMode::Netlink,
            _ => proxy_agent::datapath::tc_loader::TcMode::Auto,
        };
        Ok(proxy_agent::external::nodeport::ExternalConfig { devices, node_ips: self.node_ip.clone(), snat_ports: (lo, hi), tc_mode })
    }

    pub(crate) fn cgroup(&self) -> anyhow::Result<PathBuf> {
        match &self.cgroup {
            Some(p) => Ok(p.clone()),
            None => mounts::cgroup2_root().context("finding the cgroup v2 root"),
        }
    }

    pub(crate) fn capacities(&self) -> anyhow::Result<Capacities> {
        let caps = Capacities {
            services: self.max_services,
            slots: self.max_slots,
            backends: self.max_backends,
            sock_revnat: self.max_sock_revnat,
            np_conntrack: self.max_np_conntrack,
            affinity: self.max_affinity,
        };
        for c in Capacity::ALL {
            anyhow::ensure!(caps.get(c) > 0, "{} must be at least 1", c.flag());
        }
        Ok(caps)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        datapath: DatapathArgs,
    }

    fn parse(args: &[&str]) -> Result<DatapathArgs, String> {
        Cli::try_parse_from(std::iter::once("proxy-agent").chain(args.iter().copied())).map(|c| c.datapath).map_err(|e| e.to_string())
    }

    #[test]
    fn devices_default_to_auto_and_none_turns_tc_off() {
        assert_eq!(parse(&[]).unwrap().external().unwrap().devices, Devices::Auto);
        assert_eq!(parse(&["--devices", "auto"]).unwrap().devices, Devices::Auto);
        assert_eq!(parse(&["--devices", "none"]).unwrap().devices, Devices::None);
        assert_eq!(parse(&["--devices=none"]).unwrap().external().unwrap().devices, Devices::None);
        assert_eq!(parse(&["--devices", "eth0,bond0"]).unwrap().devices, Devices::List(vec!["eth0".into(), "bond0".into()]));
    }

    #[test]
    fn none_or_auto_mixed_with_names_is_rejected_with_a_clear_error() {
        for (value, word) in [("eth0,none", "none"), ("none,eth0", "none"), ("auto,eth0", "auto")] {
            let e = parse(&["--devices", value]).err().unwrap_or_else(|| panic!("--devices {value} accepted"));
            assert!(e.contains("--devices") && e.contains(&format!("`{word}` cannot be combined")), "{value}: {e}");
        }
        let e = parse(&["--devices", ""]).expect_err("empty --devices accepted");
        assert!(e.contains("no device named"), "{e}");
    }
}
