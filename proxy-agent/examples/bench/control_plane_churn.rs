//! Network programming under churn (issue #31), against the real
//! kube-apiserver that already holds the Node rows' Nodes
//! (`control_plane_scale`): S Services x E endpoints, every endpoint's
//! readiness flipping at R changes per second.
//!
//! - Setup: S selector-less Services (ClusterIPs from 10.96.128.0) and one
//!   EndpointSlice each, not the EndpointSlice controller's (a
//!   `managed-by` of the bench's own), E ready endpoints spread over the
//!   Nodes; server-side applied, 16 requests at a time. Then the agent
//!   starts (`proxy-agent run`, its own cgroup and pins, `--devices none`)
//!   and the time to its first sync is kept.
//! - Churn: four threads, each owning a quarter of the slices, flip one
//!   endpoint's `ready` per change, as a JSON merge patch of the slice's
//!   endpoints that also sets `endpoints.kubernetes.io/last-change-trigger-time`
//!   to the moment the change is made (RFC 3339 with nanoseconds, as the
//!   EndpointSlice controller writes it). Services are visited in a
//!   stride, so consecutive changes hit different slices.
//! - Latency is the agent's own: `topoproxy_network_programming_duration_seconds{kind="EndpointSlice"}`,
//!   from that annotation to the moment the slice's maps are written, the
//!   SLI kube-proxy exports (`kubeproxy_network_programming_duration_seconds`)
//!   with finer buckets (1 ms doubling). The buckets' counts are read from
//!   `/metrics` at the start and the end of the window (plus 2 s for the
//!   last changes to land); percentiles interpolate linearly inside a
//!   bucket, and the maximum is the bound of the highest bucket reached.
//! - CPU % of the agent over the window (utime + stime), its RSS (VmRSS at
//!   the end) and peak RSS (VmHWM).
//!
//! One run: the setup takes minutes, and a window holds R x secs samples.

use std::fmt::Write as _;
use std::fs;
use std::net::Ipv4Addr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use proxy_test_support::sandbox::{Cgroup, PinDir};
use serde_json::{Value, json};

use crate::real_server::RealServer;
use crate::realistic_nodes;
use crate::report::Target;

const NAMESPACE: &str = "churn";
const TRIGGER: &str = "endpoints.kubernetes.io/last-change-trigger-time";
const SERIES: &str = "topoproxy_network_programming_duration_seconds_bucket";
const MIB: f64 = 1_048_576.0;
/// Threads making the changes.
const WRITERS: usize = 4;

#[derive(Clone, Debug)]
pub(crate) struct Options {
    pub services: usize,
    pub endpoints: usize,
    /// Readiness changes per second, all Services together.
    pub rate: f64,
    pub secs: u64,
    pub warmup_secs: u64,
}

impl Default for Options {
    fn default() -> Self {
        Options { services: 10_000, endpoints: 10, rate: 100.0, secs: 60, warmup_secs: 5 }
    }
}

/// Handles one `--cps-churn-*` flag; `false` if it is not one.
pub(crate) fn flag(o: &mut Options, name: &str, value: &str) -> Result<bool> {
    match name {
        "--cps-churn-services" => o.services = value.parse()?,
        "--cps-churn-endpoints" => o.endpoints = value.parse()?,
        "--cps-churn-rate" => o.rate = value.parse()?,
        "--cps-churn-secs" => o.secs = value.parse()?,
        _ => return Ok(false),
    }
    if o.services > 30_000 || o.endpoints == 0 || o.endpoints > 100 || o.rate <= 0.0 || o.secs == 0 {
        bail!(
            "--cps-churn-services at most 30000 (ClusterIPs from 10.96.128.0), --cps-churn-endpoints 1..=100, rate above 0, secs at least 1"
        );
    }
    Ok(true)
}

#[derive(Clone, Debug, Default)]
pub(crate) struct Results {
    opts: Option<Options>,
    nodes: usize,
    setup_s: f64,
    sync_s: f64,
    changes: u64,
    failed: u64,
    window_s: f64,
    /// (upper bound, count in the window), cumulative, ascending.
    buckets: Vec<(f64, u64)>,
    cpu_pct: f64,
    rss: u64,
    hwm: u64,
}

fn cluster_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 96, 128, 0)) + i as u32 + 1)
}

fn endpoint_ip(i: usize, j: usize, per: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 200, 0, 0)) + (i * per + j) as u32 + 1)
}

fn service(i: usize) -> Value {
    json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": format!("c{i}"), "namespace": NAMESPACE},
           "spec": {"clusterIP": cluster_ip(i).to_string(),
                    "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}]}})
}

fn endpoints(i: usize, per: usize, nodes: usize, not_ready: u128) -> Vec<Value> {
    (0..per)
        .map(|j| {
            let n = 1 + (i * per + j) % nodes;
            let ready = not_ready & (1 << j) == 0;
            json!({"addresses": [endpoint_ip(i, j, per).to_string()],
                   "conditions": {"ready": ready, "serving": ready, "terminating": false},
                   "nodeName": realistic_nodes::name(n), "zone": realistic_nodes::zone(n)})
        })
        .collect()
}

fn slice(i: usize, per: usize, nodes: usize) -> Value {
    json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
           "metadata": {"name": format!("c{i}-1"), "namespace": NAMESPACE,
                        "labels": {"kubernetes.io/service-name": format!("c{i}"), "endpointslice.kubernetes.io/managed-by": "bench.topoproxy.io"}},
           "addressType": "IPv4", "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
           "endpoints": endpoints(i, per, nodes, 0)})
}

/// The histogram's cumulative buckets for EndpointSlices, from `/metrics`.
fn buckets(metrics: &str) -> Vec<(f64, u64)> {
    let mut out: Vec<(f64, u64)> = metrics
        .lines()
        .filter(|l| l.starts_with(SERIES) && l.contains("kind=\"EndpointSlice\""))
        .filter_map(|l| {
            let le = l.split("le=\"").nth(1)?.split('"').next()?;
            let le = if le == "+Inf" { f64::INFINITY } else { le.parse().ok()? };
            let count = l.rsplit(' ').next()?.parse::<f64>().ok()? as u64;
            Some((le, count))
        })
        .collect();
    out.sort_by(|a, b| a.0.total_cmp(&b.0));
    out
}

/// The `p` quantile of cumulative buckets, interpolated inside its bucket.
fn quantile(b: &[(f64, u64)], p: f64) -> f64 {
    let Some(&(_, total)) = b.last() else { return f64::NAN };
    if total == 0 {
        return f64::NAN;
    }
    let rank = p * total as f64;
    let mut lower = (0.0, 0u64);
    for &(le, cum) in b {
        if cum as f64 >= rank {
            if le.is_infinite() {
                return lower.0;
            }
            let inside = (cum - lower.1) as f64;
            let frac = if inside > 0.0 { (rank - lower.1 as f64) / inside } else { 1.0 };
            return lower.0 + (le - lower.0) * frac.clamp(0.0, 1.0);
        }
        lower = (le, cum);
    }
    f64::NAN
}

/// The bound of the lowest bucket that holds every sample.
fn max_bound(b: &[(f64, u64)]) -> f64 {
    let total = b.last().map_or(0, |x| x.1);
    b.iter().find(|(_, c)| *c == total && total > 0).map_or(f64::NAN, |x| x.0)
}

pub(crate) fn run(o: &Options, rs: &RealServer, agent: &Path, flags: &[String], nodes: usize, scratch: &Path) -> Result<Results> {
    super::step(&format!("control plane churn: creating {} Services x {} endpoints in the real API server", o.services, o.endpoints));
    rs.create_namespace(NAMESPACE)?;
    let t0 = Instant::now();
    let mut objects: Vec<Value> = (0..o.services).map(service).collect();
    objects.extend((0..o.services).map(|i| slice(i, o.endpoints, nodes)));
    rs.apply_all(objects)?;
    let mut r = Results { opts: Some(o.clone()), nodes, setup_s: t0.elapsed().as_secs_f64(), ..Results::default() };
    eprintln!("[bench]   created in {:.1} s", r.setup_s);

    let kubeconfig = scratch.join("churn-kubeconfig");
    rs.write_kubeconfig(&kubeconfig)?;
    let cg = Cgroup::new("tpc")?;
    let pins = PinDir::new("tpc")?;
    let log = scratch.join("churn-agent.log");
    super::step("control plane churn: starting the agent");
    let (mut child, sync_s) = crate::control_plane_scale::spawn_agent(agent, flags, &kubeconfig, &log, &cg, &pins)?;
    r.sync_s = sync_s;
    let pid = child.0.id();
    eprintln!("[bench]   first sync {sync_s:.2} s");

    super::step(&format!("control plane churn: {} readiness changes per second for {} s", o.rate, o.secs));
    let stop = AtomicBool::new(false);
    let made = AtomicU64::new(0);
    let failed = AtomicU64::new(0);
    let stride = stride_for(o.services);
    std::thread::scope(|scope| -> Result<()> {
        for w in 0..WRITERS {
            let (stop, made, failed) = (&stop, &made, &failed);
            scope.spawn(move || {
                // This writer's slices: those whose index is w modulo WRITERS.
                let mine: Vec<usize> = (0..o.services).map(|k| (k * stride) % o.services).filter(|i| i % WRITERS == w).collect();
                if mine.is_empty() {
                    return;
                }
                let mut not_ready = vec![0u128; mine.len()];
                let rate = o.rate / WRITERS as f64;
                let offset = Duration::from_secs_f64(w as f64 / o.rate);
                crate::control_plane_scale::paced(rate, offset, stop, |k| {
                    let k = k as usize;
                    let slot = k % mine.len();
                    let i = mine[slot];
                    not_ready[slot] ^= 1 << ((k / mine.len()) % o.endpoints);
                    let stamp = k8s_openapi::jiff::Timestamp::now().to_string();
                    let patch = json!({"metadata": {"annotations": {TRIGGER: stamp}},
                                       "endpoints": endpoints(i, o.endpoints, nodes, not_ready[slot])});
                    if rs.patch_slice(NAMESPACE, &format!("c{i}-1"), &patch).is_err() {
                        failed.fetch_add(1, Ordering::Relaxed);
                    }
                    made.fetch_add(1, Ordering::Relaxed);
                });
            });
        }
        std::thread::sleep(Duration::from_secs(o.warmup_secs));
        let before = buckets(&crate::control_plane_scale::agent_metrics(&log)?);
        let (t0, c0, k0) = (Instant::now(), crate::control_plane_scale::cpu_seconds(&pid.to_string()), made.load(Ordering::Relaxed));
        std::thread::sleep(Duration::from_secs(o.secs));
        let (c1, k1) = (crate::control_plane_scale::cpu_seconds(&pid.to_string()), made.load(Ordering::Relaxed));
        r.window_s = t0.elapsed().as_secs_f64();
        stop.store(true, Ordering::Relaxed);
        // The last changes land (their latency is in the histogram).
        std::thread::sleep(Duration::from_secs(2));
        let after = buckets(&crate::control_plane_scale::agent_metrics(&log)?);
        r.buckets = after.iter().map(|&(le, c)| (le, c.saturating_sub(before.iter().find(|b| b.0 == le).map_or(0, |b| b.1)))).collect();
        r.cpu_pct = 100.0 * (c1 - c0) / r.window_s;
        r.changes = k1 - k0;
        Ok(())
    })?;
    r.failed = failed.load(Ordering::Relaxed);
    r.rss = crate::control_plane_scale::vm_rss(pid);
    r.hwm = crate::control_plane::vm_hwm(pid);
    if child.0.try_wait()?.is_some() {
        bail!("the agent exited during the churn: {}", fs::read_to_string(&log).unwrap_or_default());
    }
    child.terminate(Duration::from_secs(10))?;
    eprintln!(
        "[bench]   {} changes ({} failed) in {:.1} s; latency p50 {:.3} s, p99 {:.3} s, max <= {} s; CPU {:.1} %, RSS {:.1} MiB (peak {:.1})",
        r.changes,
        r.failed,
        r.window_s,
        quantile(&r.buckets, 0.5),
        quantile(&r.buckets, 0.99),
        max_bound(&r.buckets),
        r.cpu_pct,
        r.rss as f64 / MIB,
        r.hwm as f64 / MIB
    );
    Ok(r)
}

/// A step through the Services that visits each once per round and puts
/// consecutive changes on distant slices (coprime with the count).
fn stride_for(n: usize) -> usize {
    let gcd = |mut a: usize, mut b: usize| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    (n / 3 + 1..n.max(2)).find(|s| gcd(*s, n) == 1).unwrap_or(1)
}

impl Results {
    fn total(&self) -> u64 {
        self.buckets.last().map_or(0, |b| b.1)
    }

    pub(crate) fn targets(&self) -> Vec<Target> {
        let Some(o) = &self.opts else { return Vec::new() };
        let p99 = quantile(&self.buckets, 0.99);
        let rss = self.rss.max(self.hwm) as f64 / MIB;
        vec![
            Target {
                name: format!(
                    "network programming latency p99, {} readiness changes/s over {} Services x {} (real kube-apiserver)",
                    o.rate, o.services, o.endpoints
                ),
                goal: "<= 1 s".into(),
                measured: format!("{p99:.3} s"),
                met: p99.is_finite().then_some(p99 <= 1.0),
            },
            Target {
                name: format!(
                    "agent peak RSS at {} Nodes plus {} Services x {} (real kube-apiserver, under churn)",
                    self.nodes, o.services, o.endpoints
                ),
                goal: "<= 100 MiB".into(),
                measured: format!("{rss:.1} MiB"),
                met: (rss > 0.0).then_some(rss <= 100.0),
            },
        ]
    }

    pub(crate) fn markdown(&self) -> String {
        let Some(o) = &self.opts else { return String::new() };
        let mut md = String::from("\n## Control plane churn: network programming latency\n\n");
        let _ = writeln!(
            md,
            "In the same real cluster, holding the {} Nodes above: {} Services x {} endpoints (selector-less, one EndpointSlice each, endpoints spread over the Nodes), created in {:.0} s; the agent's first sync took {:.2} s. Then {} threads flip one endpoint's readiness per change at {} changes/s in total, each a JSON merge patch of the slice that also sets `{TRIGGER}` to the moment of the change. Latency is the agent's `topoproxy_network_programming_duration_seconds{{kind=\"EndpointSlice\"}}` (from that annotation to the slice's maps written; 1 ms doubling buckets, interpolated; the maximum is a bucket bound) over a {:.0} s window after {} s of warm-up. One run.\n",
            self.nodes, o.services, o.endpoints, self.setup_s, self.sync_s, WRITERS, o.rate, self.window_s, o.warmup_secs
        );
        let _ = writeln!(
            md,
            "| changes in the window (achieved/s) | failed | programmed | latency p50 | p99 | max | agent CPU % | RSS MiB (VmRSS) | peak RSS MiB (VmHWM) |\n|---|---|---|---|---|---|---|---|---|\n| {} ({:.1}) | {} | {} | {:.3} s | {:.3} s | <= {} s | {:.1} | {:.1} | {:.1} |\n",
            self.changes,
            self.changes as f64 / self.window_s.max(1e-9),
            self.failed,
            self.total(),
            quantile(&self.buckets, 0.5),
            quantile(&self.buckets, 0.99),
            max_bound(&self.buckets),
            self.cpu_pct,
            self.rss as f64 / MIB,
            self.hwm as f64 / MIB
        );
        md
    }

    pub(crate) fn json(&self) -> Value {
        let Some(o) = &self.opts else { return Value::Null };
        json!({
            "services": o.services, "endpoints_per_service": o.endpoints, "changes_per_second": o.rate,
            "nodes": self.nodes, "setup_seconds": self.setup_s, "first_sync_seconds": self.sync_s,
            "changes": self.changes, "failed": self.failed, "window_seconds": self.window_s, "programmed": self.total(),
            "latency_seconds": {"p50": quantile(&self.buckets, 0.5), "p99": quantile(&self.buckets, 0.99), "max_bucket_bound": max_bound(&self.buckets)},
            "buckets": self.buckets.iter().filter(|b| b.0.is_finite()).map(|b| json!([b.0, b.1])).collect::<Vec<_>>(),
            "cpu_percent": self.cpu_pct, "rss_bytes": self.rss, "peak_rss_bytes": self.hwm,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_interpolate_inside_a_bucket() {
        let b = [(0.001, 0), (0.002, 50), (0.004, 100), (f64::INFINITY, 100)];
        assert!((quantile(&b, 0.5) - 0.002).abs() < 1e-12);
        assert!((quantile(&b, 0.25) - 0.0015).abs() < 1e-12);
        assert!((quantile(&b, 0.99) - 0.00396).abs() < 1e-9);
        assert_eq!(max_bound(&b), 0.004);
        assert!(quantile(&[], 0.5).is_nan());
    }

    #[test]
    fn the_stride_visits_every_service() {
        for n in [1, 2, 3, 10, 10_000] {
            let s = stride_for(n);
            let seen: std::collections::BTreeSet<usize> = (0..n).map(|k| (k * s) % n).collect();
            assert_eq!(seen.len(), n, "{n}");
        }
    }
}
