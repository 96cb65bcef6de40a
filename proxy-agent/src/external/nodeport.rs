//! The agent's side of external traffic at TC: attaching the programs to
//! the devices `node_addresses` resolves (and following address changes),
//! and writing `external_state` into the `NP_*` maps.

use std::collections::{BTreeMap, BTreeSet};
use std::hash::Hash;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};

use aya::maps::{Array, HashMap, Map, MapData};
use aya::sys::SyscallError;
use proxy_common as pc;
use proxy_common::{AddrKey, NpConfig, NpFlagsValue, ServiceKey};

use crate::datapath::bpf_batch::read_all;
use crate::datapath::keys::{addr_key, frontend_of, service_key};
use crate::datapath::loader::pins;
use crate::datapath::map_writer::{ApplyError, MapWriter, WriteError};
use crate::datapath::maps::TC_SERVICE_MAPS;
use crate::datapath::port_bits::{PortBits, PortBitsError, PortSet};
use crate::decide::decision::ExternalState;
use crate::decide::{departures, plan};
use crate::external::node_addresses::{self, Devices, Resolved};
use crate::model::{Backend, Frontend};

fn open_map(pin_dir: &Path, name: &'static str) -> Result<MapData, WriteError> {
    MapData::from_pin(pins::map(pin_dir, name)).map_err(|source| WriteError::Open { map: name, source })
}

/// The TC datapath's maps, as the agent writes them.
pub struct NodePortWriter {
    writer: MapWriter,
    flags: HashMap<MapData, ServiceKey, NpFlagsValue>,
    local: HashMap<MapData, AddrKey, u32>,
    config: Array<MapData, NpConfig>,
    ports: PortBits,
}

/// What one pass over the TC maps did.
#[derive(Debug, Default)]
pub struct NodePortOutcome {
    /// Frontends written.
    pub upserts: usize,
    /// Frontends deleted.
    pub deletes: usize,
    /// Frontends whose write failed; the next pass tries them again.
    pub failures: Vec<ApplyError>,
    /// Per frontend written, the backends it lost that clients could
    /// leave for others (`departures::left`): their conntrack flows may
    /// have to go.
    pub left: Vec<(Frontend, Vec<Backend>)>,
}

impl NodePortWriter {
    /// Opens the TC datapath's pinned maps and reads back what they hold (the loaders must have
    /// pinned them).
    pub fn open(pin_dir: &Path) -> Result<NodePortWriter, WriteError> {
        let writer = MapWriter::open_maps(pin_dir, &TC_SERVICE_MAPS)?;
        let err = |map: &'static str| move |source| WriteError::Open { map, source };
        let flags = HashMap::try_from(Map::HashMap(open_map(pin_dir, pc::NP_FLAGS_MAP)?)).map_err(err(pc::NP_FLAGS_MAP))?;
        let local = HashMap::try_from(Map::HashMap(open_map(pin_dir, pc::NP_LOCAL_MAP)?)).map_err(err(pc::NP_LOCAL_MAP))?;
        let config = Array::try_from(Map::Array(open_map(pin_dir, pc::NP_CONFIG_MAP)?)).map_err(err(pc::NP_CONFIG_MAP))?;
        let ports = PortBits::open(pin_dir).map_err(err(pc::NP_PORTS_MAP))?;
        Ok(NodePortWriter { writer, flags, local, config, ports })
    }

    /// Frontends in the TC maps.
    pub fn frontends(&self) -> usize {
        self.writer.frontends()
    }

    /// The size of the Maglev tables written from now on (see
    /// [`MapWriter::set_maglev_size`]).
    pub fn set_maglev_size(&mut self, size: Option<crate::decide::maglev::TableSize>) {
        self.writer.set_maglev_size(size);
    }

    /// Charges the Maglev tables to `budget` (see
    /// [`MapWriter::set_maglev_budget`]).
    pub fn set_maglev_budget(&mut self, budget: std::sync::Arc<crate::datapath::maglev_budget::MaglevBudget>) {
        self.writer.set_maglev_budget(budget);
    }

    /// Frontends without the table they ask for, for want of budget.
    pub fn maglev_refused(&self) -> usize {
        self.writer.maglev_refused()
    }

    /// The Maglev table size, the tables linked in and their bytes.
    pub fn maglev_usage(&self) -> Option<(Option<crate::decide::maglev::TableSize>, u32, u64)> {
        self.writer.maglev_usage()
    }

    /// Writes `NP_CONFIG`: the SNAT source per family (`None`: such flows pass untranslated and are
    /// counted) and the SNAT port range.
    pub fn set_config(&mut self, snat_v4: Option<Ipv4Addr>, snat_v6: Option<Ipv6Addr>, ports: (u16, u16)) -> Result<(), WriteError> {
        let v4 = snat_v4.map_or(0, |a| u32::from_ne_bytes(a.octets()));
        let v6 = snat_v6.map_or([0; 4], |a| addr_key(&IpAddr::V6(a)).ip_be);
        let cfg = NpConfig { snat_v4_be: v4, _pad0: 0, snat_v6_be: v6, snat_port_min: ports.0, snat_port_max: ports.1, _pad1: 0 };
        self.config.set(0, cfg, 0).map_err(|source| WriteError::Syscall { map: pc::NP_CONFIG_MAP, source })
    }

    /// Brings the TC maps to `ext`. Order: local endpoint marks and policy
    /// flags that are added go in before the services that need them;
    /// those that are removed go after.
    pub fn sync(&mut self, ext: &ExternalState) -> NodePortOutcome {
        let want_local: BTreeSet<AddrKey> = ext.local_endpoints.iter().map(addr_key).collect();
        let have_local = keys_of(&self.local, pc::NP_LOCAL_MAP);
        for k in want_local.difference(&have_local) {
            if let Err(e) = self.local.insert(k, 1, 0) {
                tracing::warn!(error = %e, "marking a local endpoint failed");
            }
        }
        let want_flags: BTreeMap<ServiceKey, NpFlagsValue> =
            ext.policy_local.iter().map(|fe| (service_key(fe), NpFlagsValue { flags: pc::NP_FLAG_POLICY_LOCAL })).collect();
        let have_flags = keys_of(&self.flags, pc::NP_FLAGS_MAP);
        for (k, v) in &want_flags {
            if let Err(e) = self.flags.insert(k, v, 0) {
                tracing::warn!(frontend = ?frontend_of(k), error = %e, "writing policy flags failed");
            }
        }
        self.writer.set_maglev_sizes(&ext.maglev_sizes);
        let state = self.writer.state();
        let plan = plan::diff_with_policies(&state, &self.writer.policies(), &ext.tc, &ext.tc_policies);
        // The programs pass packets whose port has no bit in NP_PORTS, so
        // the ports of what is about to be written get theirs first; those
        // of what the maps hold stay claimed until it is gone.
        let mut claim = ports_of(state.iter().map(|(fe, set)| (fe, set.iter())));
        claim.union_with(&ports_of(plan.upserts.iter().map(|(fe, set)| (fe, set.iter()))));
        if let Err(e) = self.ports.claim(claim) {
            // Nothing is written: a frontend without its port's bit would
            // see its packets pass untranslated. The next pass retries.
            tracing::warn!(error = %e, "setting the ports of the TC frontends failed; the TC maps stay as they are");
            let failures = plan.upserts.iter().map(|(fe, _)| ApplyError { frontend: *fe, error: ports_failed(&e) }).collect();
            return NodePortOutcome { upserts: 0, deletes: 0, failures, left: Vec::new() };
        }
        let mut left: Vec<(Frontend, Vec<Backend>)> = plan
            .upserts
            .iter()
            .map(|(fe, new)| (*fe, departures::left(self.writer.backends_of(fe).unwrap_or_default(), Some(new))))
            .filter(|(_, l)| !l.is_empty())
            .collect();
        let failures = self.writer.apply(&plan);
        left.retain(|(fe, _)| !failures.iter().any(|f| f.frontend == *fe));
        for k in have_flags.iter().filter(|k| !want_flags.contains_key(k)) {
            let _ = self.flags.remove(k);
        }
        for k in have_local.difference(&want_local) {
            let _ = self.local.remove(k);
        }
        // What the maps hold now (the GC also reads the maps themselves,
        // so entries left by a failed write stay covered).
        if let Err(e) = self.ports.claim(ports_of(ext.tc.iter().map(|(fe, set)| (fe, set.iter())))) {
            tracing::warn!(error = %e, "updating the claimed TC ports failed; unused port bits stay set until the next pass");
        }
        NodePortOutcome { upserts: plan.upserts.len(), deletes: plan.deletes.len(), failures, left }
    }
}

/// A frontend's share of a failed claim (one `WriteError` each: they own
/// their source).
fn ports_failed(e: &PortBitsError) -> WriteError {
    let io_error = std::io::Error::other(e.to_string());
    WriteError::Syscall { map: pc::NP_PORTS_MAP, source: SyscallError { call: "bpf_map_update_elem", io_error }.into() }
}

/// The ports frontends (at ingress) and their backends (at egress) use.
fn ports_of<'a, B: Iterator<Item = &'a Backend>>(frontends: impl Iterator<Item = (&'a Frontend, B)>) -> PortSet {
    let mut s = PortSet::default();
    for (fe, backends) in frontends {
        s.insert_frontend(fe.port);
        for b in backends {
            s.insert_backend(b.port);
        }
    }
    s
}

/// The keys in one of the small maps `sync` keeps in step with the desired
/// state. A map that cannot be read counts as empty: every wanted entry is
/// written again (an idempotent update) and removals wait for the next
/// pass.
fn keys_of<K: aya::Pod + Ord + Hash, V: aya::Pod>(map: &HashMap<MapData, K, V>, name: &'static str) -> BTreeSet<K> {
    match read_all(map) {
        Ok(entries) => entries.into_iter().map(|(k, _)| k).collect(),
        Err(e) => {
            tracing::warn!(map = name, error = %e, "reading the map failed; writing every wanted entry");
            BTreeSet::new()
        }
    }
}

/// `--devices`, `--node-ip`, `--snat-port-range` and `--tc-mode` resolved.
#[derive(Clone, Debug, Default)]
pub struct ExternalConfig {
    /// Where the TC programs go; `Devices::None` turns the TC datapath off
    /// (NodePorts still work from the node itself).
    pub devices: Devices,
    /// `--node-ip`: fixed SNAT addresses (one per family), also served.
    pub node_ips: Vec<IpAddr>,
    /// `--snat-port-range`: the SNAT source ports, inclusive.
    pub snat_ports: (u16, u16),
    /// `--tc-mode`: tcx links or legacy cls_bpf filters.
    pub tc_mode: crate::datapath::tc_loader::TcMode,
    /// `--xdp`: the XDP program in front of the TC programs.
    pub xdp: crate::datapath::xdp_loader::XdpMode,
    /// `--tc-fast-path`: translated packets of flows to remote backends
    /// leave from TC ingress to their next hop, and those to local pods go
    /// into the pod's namespace, without the stack.
    pub tc_fast: crate::datapath::tc_loader::TcFastPath,
    /// `--maglev-table-size`: the size of the frontends' Maglev tables
    /// unless their Service's annotation says otherwise.
    pub maglev_size: Option<crate::decide::maglev::TableSize>,
    /// The Maglev tables' share of `--map-memory-budget`, shared with the
    /// socket datapath's writer; `None`: not capped.
    pub maglev_budget: Option<std::sync::Arc<crate::datapath::maglev_budget::MaglevBudget>>,
}

/// Everything the agent runs for external traffic: the node addresses
/// NodePorts are served on, the TC programs and maps (unless `--devices
/// none`) and the health check servers. The addresses are not fixed at
/// start: [`ExternalDatapath::refresh`] follows them.
pub struct ExternalDatapath {
    /// Addresses NodePorts are served on, as last resolved.
    pub node_addrs: Vec<IpAddr>,
    /// Devices that should carry the TC programs, as last resolved.
    pub devices: Vec<String>,
    cfg: ExternalConfig,
    pin_dir: PathBuf,
    resolved: Resolved,
    /// Devices the TC programs are attached to, with the interface index
    /// they had then (a device recreated under the same name needs a new
    /// attachment).
    attached: Vec<(String, u32)>,
    /// A set of devices whose attachment failed; not retried until the
    /// devices or their indexes change (loading the programs again every
    /// poll would only repeat the error).
    failed_attach: Option<Vec<(String, u32)>>,
    tc: Option<NodePortWriter>,
    /// `NP_PEER_DEVS`, listed again on every pass (with the TC programs).
    peers: Option<crate::external::peer_devices::PeerDevices>,
    health: crate::external::health_check::HealthServers,
    /// Whether the attached TC programs run the fast path.
    tc_fast_on: bool,
}

/// Attaches the TC programs (fast path as `cfg` says) and the XDP program
/// from the same object, so that both share the next-hop cache. Returns
/// whether the fast path is on, and notes for the log.
fn install_programs(pin_dir: &Path, devices: &[String], cfg: &ExternalConfig) -> anyhow::Result<(bool, Vec<String>)> {
    use anyhow::Context;
    let xdp = cfg.xdp != crate::datapath::xdp_loader::XdpMode::Off;
    let mut installed = crate::datapath::tc_loader::install_external(pin_dir, devices, cfg.tc_mode, cfg.tc_fast, xdp)
        .context("attaching the TC programs")?;
    let mut notes = std::mem::take(&mut installed.notes);
    match crate::datapath::xdp_loader::install_shared(&mut installed.ebpf, pin_dir, devices, cfg.xdp) {
        Ok(n) => notes.extend(n),
        Err(e) if xdp => {
            return Err(anyhow::Error::new(e).context("attaching the XDP program"));
        }
        Err(e) => notes.push(format!("detaching the XDP program: {}", crate::util::error_chain::error_chain(&e))),
    }
    Ok((installed.fast, notes))
}

fn with_ifindex(devices: &[String]) -> Vec<(String, u32)> {
    devices.iter().map(|d| (d.clone(), node_addresses::ifindex(d))).collect()
}

impl ExternalDatapath {
    /// The TC writer's Maglev table size, tables and bytes (see
    /// [`NodePortWriter::maglev_usage`]); `None` without TC programs.
    pub fn maglev_usage(&self) -> Option<(Option<crate::decide::maglev::TableSize>, u32, u64)> {
        self.tc.as_ref().and_then(NodePortWriter::maglev_usage)
    }

    /// TC frontends without the table they ask for, for want of budget.
    pub fn maglev_refused(&self) -> usize {
        self.tc.as_ref().map_or(0, NodePortWriter::maglev_refused)
    }

    /// Whether the TC programs run the fast path (`--tc-fast-path auto` on
    /// a kernel that loaded it, with devices attached).
    pub fn tc_fast_on(&self) -> bool {
        self.tc_fast_on
    }

    /// The TC datapath's service map writer, for the topology counting
    /// (issue #34: tiers, shares, counter labels); `None` without TC
    /// programs.
    pub fn service_writer(&mut self) -> Option<&mut MapWriter> {
        self.tc.as_mut().map(|t| &mut t.writer)
    }

    /// Attaches the TC programs (unless `--devices none`) and opens the
    /// maps. `socket_loader::install` must have run on `pin_dir` first.
    pub fn install(pin_dir: &Path, cfg: &ExternalConfig) -> anyhow::Result<(ExternalDatapath, Vec<String>)> {
        use anyhow::Context;
        let addrs = node_addresses::interface_addresses().context("listing interface addresses")?;
        let resolved = node_addresses::resolve(&addrs, &cfg.devices, &cfg.node_ips, &node_addresses::default_route_devices());
        let mut warnings = Vec::new();
        let mut attached = Vec::new();
        let mut tc_fast_on = false;
        let mut peers = None;
        let tc = if cfg.devices.enabled() {
            if resolved.devices.is_empty() {
                // Possible with `auto` on a node whose network is not up
                // yet: start anyway, `refresh` attaches once an address
                // appears.
                warnings.push(
                    "--devices auto found no interface with an address yet; the TC programs are attached when one appears".to_string(),
                );
            }
            // The peer devices first, so that the programs find local
            // pods' veths from their first packet (the socket loader has
            // pinned the map).
            let mut p = crate::external::peer_devices::PeerDevices::open(pin_dir).context("opening NP_PEER_DEVS")?;
            if cfg.tc_fast.local() {
                p.sync();
                peers = Some(p);
            } else {
                // `auto` or `off`: no device listed, so no local pod gets
                // packets from TC (an earlier run's list is emptied).
                p.clear();
            }
            let (fast, notes) = install_programs(pin_dir, &resolved.devices, cfg)?;
            tc_fast_on = fast;
            warnings.extend(notes);
            attached = with_ifindex(&resolved.devices);
            let mut w = NodePortWriter::open(pin_dir).context("opening the TC maps")?;
            w.set_config(resolved.snat_v4, resolved.snat_v6, cfg.snat_ports).context("writing the TC configuration")?;
            w.set_maglev_size(cfg.maglev_size);
            if let Some(b) = &cfg.maglev_budget {
                w.set_maglev_budget(b.clone());
            }
            Some(w)
        } else {
            // `none`: take down what an earlier agent with devices attached
            // through this pin directory, so that `none` really means no
            // TC program (only our own pinned links and recorded filters
            // are touched).
            warnings.extend(crate::datapath::xdp_loader::detach_all(pin_dir));
            warnings.extend(crate::datapath::tc_loader::detach_all(pin_dir));
            None
        };
        Ok((
            ExternalDatapath {
                node_addrs: resolved.node_addrs.clone(),
                devices: resolved.devices.clone(),
                cfg: cfg.clone(),
                pin_dir: pin_dir.to_path_buf(),
                resolved,
                attached,
                failed_attach: None,
                tc,
                peers,
                health: crate::external::health_check::HealthServers::new(),
                tc_fast_on,
            },
            warnings,
        ))
    }

    /// Re-reads the interface addresses and follows what changed: with
    /// `--devices auto` the TC programs are attached to devices that gained
    /// an address and detached from those that lost all (a listed device
    /// that was recreated is attached again), and the SNAT addresses move
    /// unless `--node-ip` fixed them. Returns whether the NodePort addresses
    /// (or the devices) changed: the caller then syncs, so that frontends on
    /// a new address appear and those on a removed one go.
    pub fn refresh(&mut self) -> bool {
        let addrs = match node_addresses::interface_addresses() {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(error = %e, "listing interface addresses failed; keeping the last known ones");
                return false;
            }
        };
        let new = node_addresses::resolve(&addrs, &self.cfg.devices, &self.cfg.node_ips, &node_addresses::default_route_devices());
        let mut changed = false;
        if self.cfg.devices.enabled() {
            let want = with_ifindex(&new.devices);
            if want != self.attached && self.failed_attach.as_ref() != Some(&want) {
                match install_programs(&self.pin_dir, &new.devices, &self.cfg) {
                    Ok((fast, notes)) => {
                        for n in notes {
                            tracing::info!("{n}");
                        }
                        tracing::info!(devices = ?new.devices, tc_fast_path = fast, "TC programs attached to the devices now holding node addresses");
                        self.tc_fast_on = fast;
                        self.attached = want;
                        self.failed_attach = None;
                        changed = true;
                    }
                    Err(e) => {
                        tracing::warn!(devices = ?new.devices, error = format!("{e:#}"), "attaching the TC programs failed; retrying when the devices change");
                        self.failed_attach = Some(want);
                    }
                }
            }
            if (new.snat_v4, new.snat_v6) != (self.resolved.snat_v4, self.resolved.snat_v6)
                && let Some(w) = &mut self.tc
            {
                match w.set_config(new.snat_v4, new.snat_v6, self.cfg.snat_ports) {
                    Ok(()) => tracing::info!(v4 = ?new.snat_v4, v6 = ?new.snat_v6, "SNAT addresses changed"),
                    Err(e) => {
                        tracing::warn!(error = %e, "writing the new SNAT addresses failed; retrying");
                        return changed;
                    }
                }
            }
        }
        if new.node_addrs != self.resolved.node_addrs {
            let added: Vec<&IpAddr> = new.node_addrs.iter().filter(|a| !self.resolved.node_addrs.contains(a)).collect();
            let removed: Vec<&IpAddr> = self.resolved.node_addrs.iter().filter(|a| !new.node_addrs.contains(a)).collect();
            tracing::info!(?added, ?removed, "node addresses changed; NodePorts follow");
            changed = true;
        }
        self.node_addrs = new.node_addrs.clone();
        self.devices = new.devices.clone();
        self.resolved = new;
        changed
    }

    /// The devices the XDP program is attached to (its pinned links).
    pub fn xdp_devices(&self) -> Vec<String> {
        crate::datapath::xdp_loader::attached_devices(&self.pin_dir)
    }

    /// Makes the health check node ports report the agent's own health
    /// (`serviceProxyHealthy`), read on every request.
    pub fn report_agent_health(&self, health: std::sync::Arc<crate::observe::health_server::Health>) {
        self.health.report_agent_health(health);
    }

    /// Whether `apply` reads `ExternalState::local_endpoints` (only the TC
    /// maps need them), so a caller may skip collecting them.
    pub fn uses_local_endpoints(&self) -> bool {
        self.tc.is_some()
    }

    /// Number of TC frontends programmed.
    pub fn tc_frontends(&self) -> usize {
        self.tc.as_ref().map_or(0, NodePortWriter::frontends)
    }

    /// What the TC maps hold for `fe` (its backends and policy), `None`
    /// when they hold nothing for it or the TC datapath is off: what a
    /// held Service keeps (`decide::label_wait::hold_tc`).
    pub fn tc_programmed(&self, fe: &crate::model::Frontend) -> Option<crate::decide::label_wait::Programmed> {
        let w = &self.tc.as_ref()?.writer;
        Some((w.backends_of(fe)?.iter().copied().collect(), w.policy_of(fe).cloned()))
    }

    /// Writes the TC maps and (re)configures the health check ports. Must
    /// run inside a tokio runtime (the health servers are tasks).
    pub fn apply(&mut self, ext: &ExternalState) -> (NodePortOutcome, Vec<String>) {
        let mut problems = Vec::new();
        // Before the backends: a pod's veth exists before its endpoint
        // can be ready.
        if let Some(p) = &mut self.peers {
            p.sync();
        }
        let outcome = match &mut self.tc {
            Some(w) => w.sync(ext),
            None => NodePortOutcome::default(),
        };
        for (port, reason) in self.health.update(&ext.health_checks) {
            problems.push(format!("health check node port {port} cannot be served: {reason}"));
        }
        (outcome, problems)
    }
}
