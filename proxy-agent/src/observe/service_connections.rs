//! `topoproxy_service_connections_total{namespace,service,port,tier}` and
//! `topoproxy_service_connections_blind_remote_total{namespace,service,port}`
//! (issue #34): the datapath's per-frontend counts by topology tier
//! (`SVC_CONN`, `NP_SVC_CONN`), summed over CPUs and over the frontends of
//! each Service port (ClusterIPs, NodePorts, LoadBalancer and external IPs,
//! both datapaths), read from the pinned maps at scrape time.
//!
//! Cardinality is bounded by `--service-metrics`:
//!
//! * `topology` (the default): the Service ports with a topology setting
//!   one by one, every other port summed into one series per tier with
//!   `namespace`, `service` and `port` empty, so 10k Services without
//!   topology add five series, not 50k;
//! * `all`: every Service port one by one;
//! * `none`: neither family.
//!
//! The counts are the maps' since the frontend was first written (they
//! survive agent restarts with the pins); a frontend that goes away takes
//! its counts with it, which Prometheus reads as a counter reset.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, OnceLock, PoisonError, RwLock};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use proxy_common::{SHARE_ONE, SvcConnValue, tier};

use crate::model::PortLabel;

/// `--service-metrics`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Mode {
    /// Services with a topology setting one by one, the rest summed.
    #[default]
    Topology,
    /// Every Service one by one (a series per Service port and tier).
    All,
    /// No per-Service counts.
    None,
}

impl Mode {
    /// Parses `topology`, `all` or `none`.
    pub fn parse(s: &str) -> Option<Mode> {
        match s {
            "topology" => Some(Mode::Topology),
            "all" => Some(Mode::All),
            "none" => Some(Mode::None),
            _ => None,
        }
    }

    fn code(self) -> u8 {
        self as u8
    }

    fn of(code: u8) -> Mode {
        match code {
            1 => Mode::All,
            2 => Mode::None,
            _ => Mode::Topology,
        }
    }
}

/// Which datapath's ids: the socket programs' (`SVC_CONN`) or the TC
/// programs' (`NP_SVC_CONN`).
pub const SOCKET: u8 = 0;
/// The TC programs' ids (`NP_SVC_CONN`).
pub const TC: u8 = 1;

/// The owner of every counted frontend, by (datapath, service id); the
/// map writers keep it as they hand out and take back ids.
pub type Owners = Arc<RwLock<HashMap<(u8, u32), Arc<PortLabel>>>>;

/// Reads one datapath's counts of the given service ids, summed over CPUs.
pub type ConnReader = Box<dyn Fn(u8, &[u32]) -> Result<Vec<(u32, SvcConnValue)>, String> + Send + Sync>;

/// One exported Service port: counts per tier and the blind-remote sum in
/// `SHARE_ONE`ths.
pub type Series = BTreeMap<(Arc<str>, Arc<str>, String), ([u64; tier::COUNT], u64)>;

/// The collector behind both families.
pub struct ServiceConnections {
    mode: AtomicU8,
    owners: Owners,
    read: OnceLock<ConnReader>,
}

impl std::fmt::Debug for ServiceConnections {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServiceConnections")
            .field("mode", &self.mode())
            .field("owners", &self.owners.read().map(|o| o.len()).unwrap_or_default())
            .field("exported", &self.read.get().is_some())
            .finish()
    }
}

impl Default for ServiceConnections {
    fn default() -> Self {
        ServiceConnections { mode: AtomicU8::new(Mode::Topology.code()), owners: Owners::default(), read: OnceLock::new() }
    }
}

impl ServiceConnections {
    /// The current `--service-metrics` mode.
    pub fn mode(&self) -> Mode {
        Mode::of(self.mode.load(Ordering::Relaxed))
    }

    /// Sets the mode (`--service-metrics`, at start).
    pub fn set_mode(&self, mode: Mode) {
        self.mode.store(mode.code(), Ordering::Relaxed);
    }

    /// The owner index the writers fill.
    pub fn owners(&self) -> Owners {
        self.owners.clone()
    }

    /// Exports the counts `read` returns from now on; only the first call
    /// counts.
    pub fn export(&self, read: ConnReader) {
        let _ = self.read.set(read);
    }

    /// The series of every owned frontend's counts under `mode`.
    fn collect(&self) -> Result<Series, String> {
        let mode = self.mode();
        let Some(read) = self.read.get() else { return Ok(Series::new()) };
        if mode == Mode::None {
            return Ok(Series::new());
        }
        let owners: Vec<((u8, u32), Arc<PortLabel>)> =
            self.owners.read().unwrap_or_else(PoisonError::into_inner).iter().map(|(k, v)| (*k, v.clone())).collect();
        let mut counted = Vec::with_capacity(owners.len());
        for datapath in [SOCKET, TC] {
            let ids: Vec<u32> = owners.iter().filter(|((d, _), _)| *d == datapath).map(|((_, id), _)| *id).collect();
            if ids.is_empty() {
                continue;
            }
            let by_id: HashMap<u32, &Arc<PortLabel>> =
                owners.iter().filter(|((d, _), _)| *d == datapath).map(|((_, id), l)| (*id, l)).collect();
            for (id, v) in read(datapath, &ids)? {
                if let Some(l) = by_id.get(&id) {
                    counted.push(((*l).clone(), v));
                }
            }
        }
        Ok(series(mode, counted.iter().map(|(l, v)| (&**l, v))))
    }
}

/// Sums per-frontend counts into the exported series: a Service port one
/// by one when `mode` exports it so, else into the series with empty
/// labels.
pub fn series<'a>(mode: Mode, counts: impl IntoIterator<Item = (&'a PortLabel, &'a SvcConnValue)>) -> Series {
    let empty: Arc<str> = Arc::from("");
    let mut out = Series::new();
    if mode == Mode::None {
        return out;
    }
    for (label, v) in counts {
        let key = if mode == Mode::All || label.topology {
            (label.namespace.clone(), label.service.clone(), label.port.clone())
        } else {
            (empty.clone(), empty.clone(), String::new())
        };
        let e = out.entry(key).or_default();
        for (sum, n) in e.0.iter_mut().zip(v.tiers) {
            *sum += n;
        }
        e.1 += v.blind_remote_fp;
    }
    out
}

impl Collector for ServiceConnections {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let series = match self.collect() {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!("service connection counts not exported: {e}");
                return Ok(());
            }
        };
        if series.is_empty() {
            return Ok(());
        }
        type Labels = Vec<(&'static str, String)>;
        let labels = |(ns, svc, port): &(Arc<str>, Arc<str>, String)| -> Labels {
            vec![("namespace", ns.to_string()), ("service", svc.to_string()), ("port", port.clone())]
        };
        let mut family = encoder.encode_descriptor(
            "service_connections",
            "New connections (connect: TCP and connected UDP) and flows (unconnected UDP, external traffic at TC/XDP) per Service port, by the topology tier of their backend relative to this node: node, zone, region, pool (OpenYurt node pool), other. Under --service-metrics topology the Services without a topology setting are summed into namespace=\"\", service=\"\", port=\"\"",
            None,
            MetricType::Counter,
        )?;
        for (key, (tiers, _)) in &series {
            for (t, n) in tiers.iter().enumerate() {
                let mut l = labels(key);
                l.push(("tier", tier::NAMES[t].to_string()));
                ConstCounter::new(*n).encode(family.encode_family(&l)?)?;
            }
        }
        let mut family = encoder.encode_descriptor(
            "service_connections_blind_remote",
            "Of those connections, how many a pick blind to topology would be expected to have sent outside this node's zone: per connection, the share of the Service port's usable endpoints outside the zone",
            None,
            MetricType::Counter,
        )?;
        for (key, (_, blind)) in &series {
            ConstCounter::new(*blind as f64 / f64::from(SHARE_ONE)).encode(family.encode_family(&labels(key))?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn label(i: usize, topology: bool) -> PortLabel {
        PortLabel { namespace: Arc::from("default"), service: Arc::from(format!("svc-{i}")), port: "http".into(), topology }
    }

    #[test]
    fn services_without_topology_add_one_series_per_tier() {
        // 10k Services without topology, 3 with, each with a ClusterIP and
        // a NodePort frontend counting.
        let labels: Vec<PortLabel> = (0..10_003).map(|i| label(i, i >= 10_000)).collect();
        let value = SvcConnValue { tiers: [1, 2, 0, 0, 3], blind_remote_fp: u64::from(SHARE_ONE / 2) };
        let counts: Vec<(&PortLabel, &SvcConnValue)> = labels.iter().flat_map(|l| [(l, &value), (l, &value)]).collect();

        let topo = series(Mode::Topology, counts.iter().copied());
        assert_eq!(topo.len(), 1 + 3, "one summed port and the three with topology");
        let rest = &topo[&(Arc::from(""), Arc::from(""), String::new())];
        assert_eq!(rest.0, [20_000, 40_000, 0, 0, 60_000]);
        assert_eq!(rest.1, 20_000 * u64::from(SHARE_ONE / 2));
        assert_eq!(topo[&(Arc::from("default"), Arc::from("svc-10001"), "http".to_string())].0, [2, 4, 0, 0, 6]);

        assert_eq!(series(Mode::All, counts.iter().copied()).len(), 10_003);
        assert!(series(Mode::None, counts.iter().copied()).is_empty());
    }

    #[test]
    fn the_exposition_has_five_tiers_per_port_and_the_blind_share_as_a_fraction() {
        let c = ServiceConnections::default();
        c.owners().write().unwrap().insert((SOCKET, 7), Arc::new(label(1, true)));
        c.owners().write().unwrap().insert((TC, 7), Arc::new(label(1, true)));
        c.owners().write().unwrap().insert((SOCKET, 8), Arc::new(label(2, false)));
        c.export(Box::new(|datapath, ids| {
            Ok(ids
                .iter()
                .map(|id| {
                    (*id, SvcConnValue { tiers: [0, u64::from(datapath) + 1, 0, 0, 0], blind_remote_fp: u64::from(SHARE_ONE) * 3 / 4 })
                })
                .collect())
        }));
        let mut registry = prometheus_client::registry::Registry::default();
        let c = Arc::new(c);
        registry.sub_registry_with_prefix("topoproxy").register_collector(Box::new(ArcCollector(c.clone())));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(
            text.contains("topoproxy_service_connections_total{namespace=\"default\",service=\"svc-1\",port=\"http\",tier=\"node\"} 3"),
            "{text}"
        );
        assert!(text.contains("topoproxy_service_connections_total{namespace=\"\",service=\"\",port=\"\",tier=\"node\"} 1"), "{text}");
        assert!(
            text.contains("topoproxy_service_connections_blind_remote_total{namespace=\"default\",service=\"svc-1\",port=\"http\"} 1.5"),
            "{text}"
        );
        assert_eq!(text.matches("topoproxy_service_connections_total{").count(), 2 * tier::COUNT);
        c.set_mode(Mode::None);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(!text.contains("service_connections"), "{text}");
    }

    #[derive(Debug)]
    struct ArcCollector(Arc<ServiceConnections>);

    impl Collector for ArcCollector {
        fn encode(&self, encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
            self.0.encode(encoder)
        }
    }
}
