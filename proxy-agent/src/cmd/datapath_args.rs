//! Flags that say where the datapath lives, shared by `run` and `reset`.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use proxy_agent::DEFAULT_BPFFS;
use proxy_agent::datapath::maps::Capacity;
use proxy_agent::datapath::mounts;
use proxy_agent::datapath::sizing::{self, Needs, Sizing};
use proxy_agent::external::node_addresses::Devices;

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
    /// Capacity of the SERVICES map (frontends). Applies when the map is
    /// created; without it the agent sizes the map (see
    /// --map-memory-budget).
    #[arg(long)]
    pub max_services: Option<u32>,
    /// Capacity of the SLOTS map (sum of backends over all frontends).
    #[arg(long)]
    pub max_slots: Option<u32>,
    /// Capacity of the BACKENDS map (distinct backend addresses).
    #[arg(long)]
    pub max_backends: Option<u32>,
    /// Capacity of the SOCK_REVNAT LRU map (sockets remembered for getpeername/recvmsg).
    #[arg(long)]
    pub max_sock_revnat: Option<u32>,
    /// Capacity of the NP_CT LRU map (connection tracking of external
    /// traffic at TC; four entries per flow to a remote backend, two to a
    /// local one).
    #[arg(long)]
    pub max_np_conntrack: Option<u32>,
    /// Capacity of each datapath's session affinity LRU map (AFFINITY,
    /// NP_AFFINITY): clients remembered per `sessionAffinity: ClientIP`
    /// frontend, the least recently used forgotten first.
    #[arg(long)]
    pub max_affinity: Option<u32>,
    /// Kernel memory, in MiB, the pinned maps may use when full. Capacities
    /// not set by a --max-* flag are sized from the Services and endpoints
    /// of the first full list (plus half again), then grown within this
    /// budget; what the first list needs is always given, even beyond it.
    /// Maglev tables get a share set aside first: the tables the first
    /// list asks for plus half again, at least 2 MiB, and whatever the
    /// maps leave.
    #[arg(long, default_value_t = sizing::DEFAULT_BUDGET_MIB)]
    pub map_memory_budget: u64,
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
    /// XDP in front of the TC programs on the same devices, for NodePort
    /// and LoadBalancer flows to remote backends: `off`, `auto` (native XDP
    /// where the driver supports it, TC alone elsewhere) or `native` (an
    /// error where unsupported). Off by default: XDP forwards into a veth
    /// only when the veth's peer has an XDP program or GRO on (see
    /// docs/external-traffic.md).
    #[arg(long, default_value = "off", value_parser = ["off", "auto", "native"])]
    pub xdp: String,
    /// The TC fast path for NodePort/LoadBalancer/externalIP flows: `auto`
    /// (default) sends a translated packet of a flow to a remote backend,
    /// and the backend's reply, from TC ingress straight to its next hop
    /// (`bpf_fib_lookup` + `bpf_redirect`), so those packets bypass this
    /// node's FORWARD and POSTROUTING chains, conntrack and a host
    /// firewall's rules; `all` also sends a client's packets to a pod on
    /// this node straight into its namespace (`bpf_redirect_peer`), where
    /// nothing drops the pod's replies as conntrack-INVALID and no
    /// NetworkPolicy is enforced in FORWARD or at the pod's veth; `off`
    /// hands every translated packet to the stack (see the guide's
    /// external traffic page).
    #[arg(long, default_value = "auto", value_parser = ["auto", "all", "off"])]
    pub tc_fast_path: String,
    /// Maglev consistent hashing for NodePort/LoadBalancer flows and
    /// unconnected UDP: the entries of every such frontend's table, a
    /// prime, 16381 (the default; fine up to ~160 backends) or 65521 (for
    /// Services with hundreds of backends), or `off` (the random slot pick,
    /// unless a Service's `topoproxy.io/maglev-table-size` annotation asks
    /// for a table). Each distinct backend set's table takes 128
    /// KiB (512 KiB) of kernel memory (an array keeps 8 bytes per 4-byte
    /// entry), charged to a share of `--map-memory-budget`: a table beyond
    /// it is not made, and its frontend keeps the slot pick until room is
    /// freed (logged once, `topoproxy_maglev_tables_refused`).
    #[arg(long, default_value = "16381", value_parser = parse_maglev_size)]
    pub maglev_table_size: ::std::option::Option<proxy_agent::decide::maglev::TableSize>,
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
        Ok(proxy_agent::external::nodeport::ExternalConfig {
            devices,
            node_ips: self.node_ip.clone(),
            snat_ports: (lo, hi),
            tc_mode,
            xdp: proxy_agent::datapath::xdp_loader::XdpMode::parse(&self.xdp).unwrap_or_default(),
            tc_fast: proxy_agent::datapath::tc_loader::TcFastPath::parse(&self.tc_fast_path).unwrap_or_default(),
            maglev_size: self.maglev_table_size,
            maglev_budget: None,
        })
    }

    pub(crate) fn cgroup(&self) -> anyhow::Result<PathBuf> {
        match &self.cgroup {
            Some(p) => Ok(p.clone()),
            None => mounts::cgroup2_root().context("finding the cgroup v2 root"),
        }
    }

    /// The capacities given by --max-* flags, in [`Capacity::ALL`] order.
    pub(crate) fn explicit_capacities(&self) -> anyhow::Result<[Option<u32>; 6]> {
        let explicit =
            [self.max_services, self.max_slots, self.max_backends, self.max_sock_revnat, self.max_np_conntrack, self.max_affinity];
        for (c, v) in Capacity::ALL.iter().zip(explicit) {
            anyhow::ensure!(v != Some(0), "{} must be at least 1", c.flag());
        }
        Ok(explicit)
    }

    /// Whether every capacity is set by a flag (nothing to size).
    pub(crate) fn all_capacities_explicit(&self) -> bool {
        self.explicit_capacities().is_ok_and(|e| e.iter().all(Option::is_some))
    }

    /// The capacities for maps created now: the flags, the rest sized from
    /// `needs` within --map-memory-budget.
    pub(crate) fn capacities(&self, needs: Option<Needs>) -> anyhow::Result<Sizing> {
        let explicit = self.explicit_capacities()?;
        anyhow::ensure!(self.map_memory_budget > 0, "--map-memory-budget must be at least 1 (MiB)");
        // The topology counting arrays are per CPU (sizing::counting_bytes_per_service).
        let cpus = aya::util::nr_cpus().map_or(1, |n| u32::try_from(n).unwrap_or(u32::MAX));
        Ok(sizing::size_on(needs, &explicit, self.map_memory_budget.saturating_mul(1 << 20), cpus))
    }
}

/// `--maglev-table-size`: `off` or one of the offered primes.
fn parse_maglev_size(s: &str) -> Result<Option<proxy_agent::decide::maglev::TableSize>, String> {
    if s == "off" { Ok(None) } else { s.parse().map(Some).map_err(|e: proxy_agent::decide::maglev::TableSizeError| e.to_string()) }
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
    fn maglev_tables_default_to_16381_and_off_turns_them_off() {
        use proxy_agent::decide::maglev::TableSize;
        assert_eq!(parse(&[]).unwrap().maglev_table_size, Some(TableSize::Default));
        assert_eq!(parse(&["--maglev-table-size", "off"]).unwrap().maglev_table_size, None);
        assert_eq!(parse(&["--maglev-table-size", "16381"]).unwrap().maglev_table_size, Some(TableSize::Default));
        assert_eq!(parse(&["--maglev-table-size", "65521"]).unwrap().maglev_table_size, Some(TableSize::Large));
        let Err(e) = parse(&["--maglev-table-size", "1000"]) else { panic!("1000 accepted") };
        assert!(e.contains("invalid Maglev table size \"1000\": must be 16381 or 65521"), "{e}");
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
