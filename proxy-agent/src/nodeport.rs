//! The agent's side of external traffic at TC: which devices and node
//! addresses to serve, and writing `external_state` into the `NP_*` maps.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::CStr;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::Path;

use aya::maps::{Array, HashMap, Map, MapData, PerCpuArray};
use proxy_common as pc;
use proxy_common::{AddrKey, NpConfig, NpFlagsValue, ServiceKey};

use crate::decision::ExternalState;
use crate::map_writer::{ApplyError, MapWriter, WriteError, frontend_of, service_key};
use crate::model::Frontend;
use crate::plan;

/// One address of an interface.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IfAddr {
    pub device: String,
    pub ip: IpAddr,
}

/// Addresses usable as node addresses: not loopback, not IPv6 link-local
/// (a NodePort on fe80:: would need a zone), on interfaces that are up.
pub fn interface_addresses() -> io::Result<Vec<IfAddr>> {
    let mut out = Vec::new();
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list we free below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: a node of the list returned by getifaddrs.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null()
            || ifa.ifa_flags & libc::IFF_UP as u32 == 0
            || ifa.ifa_flags & libc::IFF_LOOPBACK as u32 != 0
        {
            continue;
        }
        // SAFETY: ifa_name is a NUL-terminated string owned by the list.
        let device = unsafe { CStr::from_ptr(ifa.ifa_name) }.to_string_lossy().into_owned();
        // SAFETY: the family says which sockaddr type this is.
        let ip = unsafe {
            match i32::from((*ifa.ifa_addr).sa_family) {
                libc::AF_INET => {
                    let sin = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                    IpAddr::V4(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)))
                }
                libc::AF_INET6 => {
                    let sin6 = &*(ifa.ifa_addr as *const libc::sockaddr_in6);
                    IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr))
                }
                _ => continue,
            }
        };
        if let IpAddr::V6(v6) = ip
            && (v6.segments()[0] & 0xffc0) == 0xfe80
        {
            continue;
        }
        out.push(IfAddr { device, ip });
    }
    // SAFETY: frees the list returned above.
    unsafe { libc::freeifaddrs(head) };
    Ok(out)
}

/// `--devices auto`: the interfaces that hold the node's addresses.
pub fn default_devices(addrs: &[IfAddr]) -> Vec<String> {
    addrs.iter().map(|a| a.device.clone()).collect::<BTreeSet<_>>().into_iter().collect()
}

/// The node addresses NodePorts are served on: those of `devices`.
pub fn node_addresses(addrs: &[IfAddr], devices: &[String]) -> Vec<IpAddr> {
    let set: BTreeSet<IpAddr> = addrs.iter().filter(|a| devices.contains(&a.device)).map(|a| a.ip).collect();
    set.into_iter().collect()
}

/// The SNAT source per family: the first address of the first device that
/// has one, unless given explicitly.
pub fn snat_addresses(
    addrs: &[IfAddr],
    devices: &[String],
    explicit: &[IpAddr],
) -> (Option<Ipv4Addr>, Option<Ipv6Addr>) {
    let mut v4 = explicit.iter().find_map(|ip| match ip {
        IpAddr::V4(a) => Some(*a),
        _ => None,
    });
    let mut v6 = explicit.iter().find_map(|ip| match ip {
        IpAddr::V6(a) => Some(*a),
        _ => None,
    });
    for d in devices {
        for a in addrs.iter().filter(|a| &a.device == d) {
            match a.ip {
                IpAddr::V4(x) if v4.is_none() => v4 = Some(x),
                IpAddr::V6(x) if v6.is_none() => v6 = Some(x),
                _ => {}
            }
        }
    }
    (v4, v6)
}

fn addr_key(ip: &IpAddr) -> AddrKey {
    // Same encoding as the service keys.
    let k = service_key(&Frontend { ip: *ip, port: 0, protocol: crate::model::Protocol::Tcp });
    AddrKey { ip_be: k.ip_be, family: k.family, _pad: [0; 3] }
}

fn open_map(pin_dir: &Path, name: &'static str) -> Result<MapData, WriteError> {
    MapData::from_pin(pin_dir.join(name)).map_err(|source| WriteError::Open { map: name, source })
}

/// The TC datapath's maps, as the agent writes them.
pub struct NodePortWriter {
    writer: MapWriter,
    flags: HashMap<MapData, ServiceKey, NpFlagsValue>,
    local: HashMap<MapData, AddrKey, u32>,
    config: Array<MapData, NpConfig>,
}

/// What one pass over the TC maps did.
#[derive(Debug, Default)]
pub struct NodePortOutcome {
    pub upserts: usize,
    pub deletes: usize,
    pub failures: Vec<ApplyError>,
}

impl NodePortWriter {
    pub fn open(pin_dir: &Path) -> Result<NodePortWriter, WriteError> {
        let writer = MapWriter::open_maps(pin_dir, [pc::NP_SERVICES_MAP, pc::NP_SLOTS_MAP, pc::NP_BACKENDS_MAP])?;
        let err = |map: &'static str| move |source| WriteError::Open { map, source };
        let flags =
            HashMap::try_from(Map::HashMap(open_map(pin_dir, pc::NP_FLAGS_MAP)?)).map_err(err(pc::NP_FLAGS_MAP))?;
        let local =
            HashMap::try_from(Map::HashMap(open_map(pin_dir, pc::NP_LOCAL_MAP)?)).map_err(err(pc::NP_LOCAL_MAP))?;
        let config =
            Array::try_from(Map::Array(open_map(pin_dir, pc::NP_CONFIG_MAP)?)).map_err(err(pc::NP_CONFIG_MAP))?;
        Ok(NodePortWriter { writer, flags, local, config })
    }

    pub fn frontends(&self) -> usize {
        self.writer.state().len()
    }

    pub fn set_config(
        &mut self,
        snat_v4: Option<Ipv4Addr>,
        snat_v6: Option<Ipv6Addr>,
        ports: (u16, u16),
    ) -> Result<(), WriteError> {
        let v4 = snat_v4.map(|a| u32::from_ne_bytes(a.octets())).unwrap_or(0);
        let v6 = snat_v6.map(|a| addr_key(&IpAddr::V6(a)).ip_be).unwrap_or([0; 4]);
        let cfg = NpConfig {
            snat_v4_be: v4,
            _pad0: 0,
            snat_v6_be: v6,
            snat_port_min: ports.0,
            snat_port_max: ports.1,
            _pad1: 0,
        };
        self.config.set(0, cfg, 0).map_err(|source| WriteError::Syscall { map: pc::NP_CONFIG_MAP, source })
    }

    /// Brings the TC maps to `ext`. Order: local endpoint marks and policy
    /// flags that are added go in before the services that need them;
    /// those that are removed go after.
    pub fn sync(&mut self, ext: &ExternalState) -> NodePortOutcome {
        let want_local: BTreeSet<AddrKey> = ext.local_endpoints.iter().map(addr_key).collect();
        let have_local: BTreeSet<AddrKey> = self.local.keys().filter_map(Result::ok).collect();
        for k in want_local.difference(&have_local) {
            if let Err(e) = self.local.insert(k, 1, 0) {
                tracing::warn!(error = %e, "marking a local endpoint failed");
            }
        }
        let want_flags: BTreeMap<ServiceKey, NpFlagsValue> = ext
            .policy_local
            .iter()
            .map(|fe| (service_key(fe), NpFlagsValue { flags: pc::NP_FLAG_POLICY_LOCAL }))
            .collect();
        let have_flags: BTreeSet<ServiceKey> = self.flags.keys().filter_map(Result::ok).collect();
        for (k, v) in &want_flags {
            if let Err(e) = self.flags.insert(k, v, 0) {
                tracing::warn!(frontend = ?frontend_of(k), error = %e, "writing policy flags failed");
            }
        }
        let plan = plan::diff(&self.writer.state(), &ext.tc);
        let failures = self.writer.apply(&plan);
        for k in have_flags.iter().filter(|k| !want_flags.contains_key(k)) {
            let _ = self.flags.remove(k);
        }
        for k in have_local.difference(&want_local) {
            let _ = self.local.remove(k);
        }
        NodePortOutcome { upserts: plan.upserts.len(), deletes: plan.deletes.len(), failures }
    }
}

/// The TC programs' counters summed over CPUs, by name (for tests and
/// debugging).
pub fn counters(pin_dir: &Path) -> io::Result<BTreeMap<&'static str, u64>> {
    let data = MapData::from_pin(pin_dir.join(pc::NP_COUNTERS_MAP)).map_err(io::Error::other)?;
    let arr: PerCpuArray<MapData, u64> = PerCpuArray::try_from(Map::PerCpuArray(data)).map_err(io::Error::other)?;
    let mut out = BTreeMap::new();
    for (i, name) in pc::np_counter::NAMES.iter().enumerate() {
        let v = arr.get(&(i as u32), 0).map_err(io::Error::other)?;
        out.insert(*name, v.iter().sum());
    }
    Ok(out)
}

/// Everything the agent runs for external traffic: the node addresses
/// NodePorts are served on, the TC maps (when `--devices` attached the TC
/// programs) and the health check servers.
pub struct ExternalDatapath {
    pub node_addrs: Vec<IpAddr>,
    pub devices: Vec<String>,
    tc: Option<NodePortWriter>,
    health: crate::healthcheck_server::HealthServers,
}

/// `--devices`, `--node-ip`, `--snat-port-range` resolved.
#[derive(Clone, Debug, Default)]
pub struct ExternalConfig {
    /// `None`: no TC datapath (NodePorts still work from the node itself).
    /// `Some(empty)`: auto-detect.
    pub devices: Option<Vec<String>>,
    pub node_ips: Vec<IpAddr>,
    pub snat_ports: (u16, u16),
    pub tc_mode: crate::tc_loader::TcMode,
}

impl ExternalDatapath {
    /// Attaches the TC programs (when devices are configured) and opens the
    /// maps. `loader::install` must have run on `pin_dir` first.
    pub fn install(pin_dir: &Path, cfg: &ExternalConfig) -> anyhow::Result<(ExternalDatapath, Vec<String>)> {
        use anyhow::Context;
        let addrs = interface_addresses().context("listing interface addresses")?;
        let mut warnings = Vec::new();
        let (devices, tc) = match &cfg.devices {
            None => (Vec::new(), None),
            Some(list) => {
                let devices = if list.is_empty() { default_devices(&addrs) } else { list.clone() };
                anyhow::ensure!(!devices.is_empty(), "--devices auto found no interface with an address");
                warnings.extend(
                    crate::tc_loader::install(pin_dir, &devices, cfg.tc_mode).context("attaching the TC programs")?,
                );
                let mut w = NodePortWriter::open(pin_dir).context("opening the TC maps")?;
                let (v4, v6) = snat_addresses(&addrs, &devices, &cfg.node_ips);
                w.set_config(v4, v6, cfg.snat_ports).context("writing the TC configuration")?;
                (devices, Some(w))
            }
        };
        let mut node_addrs: Vec<IpAddr> = if devices.is_empty() {
            addrs.iter().map(|a| a.ip).collect::<BTreeSet<_>>().into_iter().collect()
        } else {
            node_addresses(&addrs, &devices)
        };
        for ip in &cfg.node_ips {
            if !node_addrs.contains(ip) {
                node_addrs.push(*ip);
            }
        }
        Ok((
            ExternalDatapath { node_addrs, devices, tc, health: crate::healthcheck_server::HealthServers::new() },
            warnings,
        ))
    }

    /// Number of TC frontends programmed.
    pub fn tc_frontends(&self) -> usize {
        self.tc.as_ref().map_or(0, NodePortWriter::frontends)
    }

    /// Writes the TC maps and (re)configures the health check ports. Must
    /// run inside a tokio runtime (the health servers are tasks).
    pub fn apply(&mut self, ext: &ExternalState) -> (NodePortOutcome, Vec<String>) {
        let mut problems = Vec::new();
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
