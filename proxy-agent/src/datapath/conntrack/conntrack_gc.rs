//! Garbage collection of the TC datapath's connection tracking (`NP_CT`).
//!
//! The TC programs create entries for every external flow (two per flow to
//! a local backend, four to a remote one, see `CT_DIR_*` in proxy-common)
//! and keep their `seen_s` fresh while packets match them, but never delete
//! them: a BPF program cannot walk a map cheaply, and a packet that ends a
//! flow (FIN, RST) is not the last one (ACKs, retransmissions follow). The
//! agent sweeps the pinned map every few seconds instead and deletes every
//! entry of a flow that has been idle for longer than its timeout:
//!
//! * TCP: 6 h established, 10 s once closing (a RST, or a FIN from both
//!   sides: `CT_FLAG_CLOSING`, set by the programs), 60 s while the backend
//!   has never answered (`CT_FLAG_REPLIED` on none of the flow's entries);
//! * anything else (UDP): 60 s.
//!
//! These are Cilium's conntrack defaults, and `--conntrack-*-timeout-secs`
//! change them. UDP flows whose backend has left `NP_BACKENDS` are deleted
//! too: their next packet would pick a new backend anyway, within a second
//! of the removal (`keeps_backend` in proxy-ebpf/src/programs/nodeport.rs,
//! checked once a second per flow), and their reply entries would otherwise
//! linger. A backend stays in `NP_BACKENDS` while any frontend uses it, so
//! flows survive backend-set changes that keep their backend. A TCP flow
//! keeps its backend whatever the sets say, as netfilter's conntrack keeps
//! kube-proxy's DNAT: it ends by closing, idling out, or the flush of a
//! backend gone after terminating.
//!
//! Deciding ([`plan`], [`expired`]) is pure and table-tested; [`sweep`]
//! does the map I/O.
//!
//! Besides the periodic sweep, [`flush`] deletes at once the flows of
//! given frontend-backend pairs when a backend leaves a frontend's set
//! (`decide::departures`): a backend that another frontend still uses
//! stays in `NP_BACKENDS`, so without it such flows would keep going to a
//! deleted pod until they idle out (kube-proxy flushes UDP conntrack
//! entries of removed endpoints the same way, pkg/proxy/conntrack/cleanup.go).

use std::collections::HashMap as StdHashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use aya::maps::{HashMap, Map, MapData, MapError};
use proxy_common as pc;
use proxy_common::{BackendKey, BackendValue, CtKey, CtValue};

use crate::datapath::loader::pins;
use crate::datapath::maps::bpf_batch::{is_not_found, read_all};
use crate::datapath::maps::port_bits::{PortBits, PortSet};
use crate::observe::metrics::{GcFigures, Metrics};
use crate::util::periodic::{self, Run};

/// How long a flow may stay idle, by state (seconds).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timeouts {
    /// Established TCP.
    pub tcp_s: u32,
    /// Closing TCP: an RST, or a FIN from both sides (`CT_FLAG_CLOSING`).
    pub tcp_closing_s: u32,
    /// TCP that never got a packet from the backend (`CT_FLAG_REPLIED`).
    pub tcp_syn_s: u32,
    /// UDP and every other protocol.
    pub other_s: u32,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            tcp_s: pc::CT_TIMEOUT_TCP_S,
            tcp_closing_s: pc::CT_TIMEOUT_TCP_CLOSING_S,
            tcp_syn_s: pc::CT_TIMEOUT_TCP_SYN_S,
            other_s: pc::CT_TIMEOUT_OTHER_S,
        }
    }
}

impl Timeouts {
    /// The timeout of a flow of protocol `proto` in the state `flags`.
    pub fn limit(&self, proto: u8, flags: u32) -> u32 {
        if proto != pc::PROTO_TCP {
            self.other_s
        } else if flags & pc::CT_FLAG_CLOSING != 0 {
            self.tcp_closing_s
        } else if flags & pc::CT_FLAG_REPLIED == 0 {
            self.tcp_syn_s
        } else {
            self.tcp_s
        }
    }
}

/// Seconds since `seen_s`. A `seen_s` ahead of `now_s` (the entry was
/// refreshed after `now_s` was read) counts as zero, not as an age of
/// almost 2^32 seconds.
fn age(now_s: u32, seen_s: u32) -> u32 {
    let a = now_s.wrapping_sub(seen_s);
    if a > i32::MAX as u32 { 0 } else { a }
}

/// Whether an entry (or a flow's merged entry) of protocol `proto` last
/// seen at `v.seen_s` is past its timeout at `now_s`. Both are seconds of
/// CLOCK_MONOTONIC (see [`monotonic_now_s`]). Same rule as the datapath's
/// SNAT port takeover: strictly older than the timeout.
pub fn expired(proto: u8, v: &CtValue, now_s: u32, t: &Timeouts) -> bool {
    age(now_s, v.seen_s) > t.limit(proto, v.flags)
}

/// The flow an entry belongs to, named by its reply key (backend -> client,
/// `CT_DIR_REPLY`), which every kind of entry can compute from its own key
/// and value. Entries of unknown direction are flows of their own.
pub fn flow_of(k: &CtKey, v: &CtValue) -> CtKey {
    let reply = |saddr_be, daddr_be, sport_be, dport_be| CtKey {
        saddr_be,
        daddr_be,
        sport_be,
        dport_be,
        proto: k.proto,
        family: k.family,
        dir: pc::CT_DIR_REPLY,
        _pad: 0,
    };
    match k.dir {
        pc::CT_DIR_REPLY => *k,
        // client -> frontend, value client -> backend.
        pc::CT_DIR_FORWARD => reply(v.daddr_be, k.saddr_be, v.dport_be, k.sport_be),
        // client -> backend.
        pc::CT_DIR_SNAT => reply(k.daddr_be, k.saddr_be, k.dport_be, k.sport_be),
        // backend -> node:port, value backend -> client.
        pc::CT_DIR_REPLY_SNAT => reply(v.saddr_be, v.daddr_be, v.sport_be, v.dport_be),
        _ => *k,
    }
}

/// Why the GC deletes a flow (the metric's `reason` label).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Reason {
    /// Idle for longer than its timeout.
    Expired,
    /// Its backend is no longer in `NP_BACKENDS`.
    StaleBackend,
}

impl Reason {
    /// The label (`/metrics`, logs).
    pub fn label(self) -> &'static str {
        match self {
            Reason::Expired => "expired",
            Reason::StaleBackend => "stale_backend",
        }
    }
}

/// One flow to delete: every entry of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Doomed {
    /// Why.
    pub reason: Reason,
    /// Every `NP_CT` entry of the flow (forward, reply and SNAT directions).
    pub keys: Vec<CtKey>,
}

/// Which flows to delete. Entries are grouped by [`flow_of`]; a flow is as
/// fresh as its freshest entry (the client's and the backend's packets
/// refresh different entries) and closing when any entry says so. A flow
/// with forward entries is stale when none of them names a backend that
/// `backend_alive` still finds. Forward entries are listed first, so a
/// packet racing the deletion finds no forward entry and starts a new
/// flow, rather than a forward entry whose reply entries are gone.
pub fn plan(entries: &[(CtKey, CtValue)], now_s: u32, t: &Timeouts, mut backend_alive: impl FnMut(&CtValue) -> bool) -> Vec<Doomed> {
    struct Flow {
        keys: Vec<CtKey>,
        proto: u8,
        flags: u32,
        min_age: u32,
        forwards: Vec<CtValue>,
    }
    let mut flows: StdHashMap<CtKey, Flow> = StdHashMap::new();
    for (k, v) in entries {
        let f = flows.entry(flow_of(k, v)).or_insert(Flow {
            keys: Vec::new(),
            proto: k.proto,
            flags: 0,
            min_age: u32::MAX,
            forwards: Vec::new(),
        });
        f.keys.push(*k);
        f.flags |= v.flags;
        f.min_age = f.min_age.min(age(now_s, v.seen_s));
        if k.dir == pc::CT_DIR_FORWARD {
            f.forwards.push(*v);
        }
    }
    let mut out = Vec::new();
    for (_, mut f) in flows {
        // The merged entry: freshest seen_s, every flag.
        let merged = CtValue { flags: f.flags, seen_s: now_s.wrapping_sub(f.min_age), ..Default::default() };
        let reason = if expired(f.proto, &merged, now_s, t) {
            Reason::Expired
        } else if f.proto != pc::PROTO_TCP && !f.forwards.is_empty() && !f.forwards.iter().any(&mut backend_alive) {
            Reason::StaleBackend
        } else {
            continue;
        };
        f.keys.sort_by_key(|k| (!pc::ct_dir_from_client(k.dir), k.dir));
        out.push(Doomed { reason, keys: f.keys });
    }
    out.sort_by(|a, b| (a.reason, &a.keys[0].saddr_be, a.keys[0].sport_be).cmp(&(b.reason, &b.keys[0].saddr_be, b.keys[0].sport_be)));
    out
}

/// What a flow connects, read from one of its entries: the frontend the
/// client addressed and the backend it was sent to (addresses and ports
/// in network byte order, as `CtKey`/`CtValue` keep them).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FlowEnds {
    /// `IPPROTO_TCP` or `IPPROTO_UDP`.
    pub proto: u8,
    /// `FAMILY_V4` or `FAMILY_V6`.
    pub family: u8,
    /// The frontend's address.
    pub frontend_be: [u32; 4],
    /// The frontend's port.
    pub frontend_port_be: u16,
    /// The backend's address.
    pub backend_be: [u32; 4],
    /// The backend's port.
    pub backend_port_be: u16,
}

/// The ends of the flow `k` belongs to, from the entries that hold both:
/// the forward entry (client -> frontend, translated to client ->
/// backend) and the reply entry (backend -> client, translated to
/// frontend -> client). The SNAT legs name the node's address instead.
pub fn ends_of(k: &CtKey, v: &CtValue) -> Option<FlowEnds> {
    let ends = |frontend_be, frontend_port_be, backend_be, backend_port_be| FlowEnds {
        proto: k.proto,
        family: k.family,
        frontend_be,
        frontend_port_be,
        backend_be,
        backend_port_be,
    };
    match k.dir {
        pc::CT_DIR_FORWARD => Some(ends(k.daddr_be, k.dport_be, v.daddr_be, v.dport_be)),
        pc::CT_DIR_REPLY => Some(ends(v.saddr_be, v.sport_be, k.saddr_be, k.sport_be)),
        _ => None,
    }
}

/// Which flows to flush: those with an entry whose [`ends_of`] `target`
/// labels, with every entry of the flow (forward legs first, as [`plan`]
/// orders them). A flow matched through several entries is listed once,
/// under the first label found.
pub fn plan_flush<L: Copy>(entries: &[(CtKey, CtValue)], mut target: impl FnMut(&FlowEnds) -> Option<L>) -> Vec<(L, Vec<CtKey>)> {
    let mut flows: StdHashMap<CtKey, (Option<L>, Vec<CtKey>)> = StdHashMap::new();
    for (k, v) in entries {
        let f = flows.entry(flow_of(k, v)).or_insert((None, Vec::new()));
        f.1.push(*k);
        if f.0.is_none() {
            f.0 = ends_of(k, v).and_then(|e| target(&e));
        }
    }
    let mut out: Vec<(L, Vec<CtKey>)> = flows
        .into_values()
        .filter_map(|(label, mut keys)| {
            keys.sort_by_key(|k| (!pc::ct_dir_from_client(k.dir), k.dir, k.saddr_be, k.sport_be));
            Some((label?, keys))
        })
        .collect();
    out.sort_by_key(|(_, keys)| (keys[0].saddr_be, keys[0].sport_be, keys[0].dir));
    out
}

/// What one [`flush`] deleted under one label.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Flushed {
    /// Flows deleted.
    pub flows: usize,
    /// `NP_CT` entries deleted (a flow has two or more).
    pub entries: usize,
}

/// Deletes from the `NP_CT` pinned under `pin_dir` every flow
/// [`plan_flush`] picks with `target`, and returns the counts per label.
/// Blocking; run it off the async threads.
pub fn flush<L: Copy + Eq + std::hash::Hash>(
    pin_dir: &Path,
    target: impl FnMut(&FlowEnds) -> Option<L>,
) -> Result<StdHashMap<L, Flushed>, GcError> {
    let (mut ct, _) = open_hash::<CtKey, CtValue>(pin_dir, pc::NP_CT_MAP)?;
    let entries = read_all(&ct).map_err(|source| GcError::Read { map: pc::NP_CT_MAP, source })?;
    let mut out: StdHashMap<L, Flushed> = StdHashMap::new();
    for (label, keys) in plan_flush(&entries, target) {
        let mut deleted = 0;
        for k in &keys {
            match ct.remove(k) {
                Ok(()) => deleted += 1,
                Err(e) if is_not_found(&e) => {}
                Err(source) => return Err(GcError::Delete { map: pc::NP_CT_MAP, source }),
            }
        }
        let f = out.entry(label).or_default();
        f.flows += 1;
        f.entries += deleted;
    }
    Ok(out)
}

/// CLOCK_MONOTONIC in seconds: the clock of `bpf_ktime_get_ns`
/// (`ktime_get_mono_fast_ns`, include/uapi/linux/bpf.h: "time elapsed
/// since system boot, in nanoseconds. Does not include time the system was
/// suspended"), which the programs store in `seen_s`. Neither wall-clock
/// time (it jumps) nor CLOCK_BOOTTIME (it counts suspend, so every flow
/// would look older after a resume) would compare correctly; std's
/// `Instant` uses this clock but does not expose its value.
pub fn monotonic_now_s() -> std::io::Result<u32> {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec into `ts`.
    if unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &raw mut ts) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // Truncated like the programs' `ns / 1e9 as u32`.
    Ok(ts.tv_sec as u32)
}

/// Why a sweep or flush failed; the next sweep tries again.
#[derive(Debug, thiserror::Error)]
pub enum GcError {
    /// `NP_CT` or another map could not be opened.
    #[error("conntrack GC: cannot open pinned map {path}: {source}")]
    Open {
        /// The pin.
        path: PathBuf,
        /// The error.
        source: MapError,
    },
    /// A map could not be read.
    #[error("conntrack GC: reading {map}: {source}")]
    Read {
        /// The map.
        map: &'static str,
        /// The error.
        source: MapError,
    },
    /// An entry could not be deleted.
    #[error("conntrack GC: deleting from {map}: {source}")]
    Delete {
        /// The map.
        map: &'static str,
        /// The error.
        source: MapError,
    },
    /// The clock the programs stamp entries with could not be read.
    #[error("conntrack GC: reading CLOCK_MONOTONIC: {0}")]
    Clock(std::io::Error),
}

/// What one sweep found and did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SweepStats {
    /// Entries in `NP_CT` when the sweep read it.
    pub entries: usize,
    /// `NP_CT`'s capacity.
    pub capacity: u32,
    /// Flows idle past their timeout.
    pub expired_flows: usize,
    /// UDP flows whose backend is gone from `NP_BACKENDS`.
    pub stale_flows: usize,
    /// Entries deleted, by reason.
    pub deleted_expired: usize,
    /// Entries deleted as stale.
    pub deleted_stale: usize,
    /// Flows left alone because a packet refreshed them during the sweep.
    pub revived_flows: usize,
    /// Ports whose `NP_PORTS` bit the sweep cleared (no frontend, backend
    /// or flow left uses them); `None` when it left the bitmap alone (no
    /// claim from the NodePort writer yet, or a claim that changed during
    /// the sweep, see `port_bits`).
    pub ports_cleared: Option<usize>,
    /// Why the bitmap step failed; the conntrack work above is done.
    pub ports_error: Option<String>,
    /// Ports set in `NP_PORTS` (ingress, egress) after the sweep, when
    /// known.
    pub ports_set: Option<(usize, usize)>,
}

fn open_hash<K: aya::Pod, V: aya::Pod>(pin_dir: &Path, name: &str) -> Result<(HashMap<MapData, K, V>, u32), GcError> {
    let path = pins::map(pin_dir, name);
    let open_err = |source| GcError::Open { path: path.clone(), source };
    let data = MapData::from_pin(&path).map_err(open_err)?;
    let capacity = data.info().map_err(open_err)?.max_entries();
    let map = Map::from_map_data(data).map_err(open_err)?;
    Ok((HashMap::try_from(map).map_err(open_err)?, capacity))
}

/// One pass over the `NP_CT` pinned under `pin_dir`: reads every entry,
/// decides with [`plan`] and deletes. Blocking (a few batch calls to read,
/// a few syscalls per flow deleted); run it off the async threads.
pub fn sweep(pin_dir: &Path, t: &Timeouts) -> Result<SweepStats, GcError> {
    let (mut ct, capacity) = open_hash::<CtKey, CtValue>(pin_dir, pc::NP_CT_MAP)?;
    let (backends, _) = open_hash::<BackendKey, BackendValue>(pin_dir, pc::NP_BACKENDS_MAP)?;
    // The port bitmap's claim generation, before NP_CT is read: flows the
    // programs create after the read use claimed ports as long as the claim
    // stays the same (see `port_bits`).
    let mut bits = PortBits::open(pin_dir);
    let generation = bits.as_ref().ok().map(PortBits::generation);
    // Bounded however busy the map is (see `read_all`).
    let entries = read_all(&ct).map_err(|source| GcError::Read { map: pc::NP_CT_MAP, source })?;
    // Read the clock after the read: entries refreshed during it then look
    // fresh rather than from the future (which `age` also tolerates).
    let now = monotonic_now_s().map_err(GcError::Clock)?;
    let table: StdHashMap<CtKey, CtValue> = entries.iter().copied().collect();
    // Backends are looked up now, not from a snapshot taken before the
    // read, so that a flow created during the read to a backend added
    // during it is not judged stale. Same test as the datapath's.
    let alive = |v: &CtValue| match backends.get(&BackendKey { backend_id: v.backend_id }, 0) {
        Ok(b) => b.ip_be == v.daddr_be && b.port_be == v.dport_be,
        Err(_) => false,
    };
    let doomed = plan(&entries, now, t, alive);
    let mut stats = SweepStats { entries: table.len(), capacity, ..Default::default() };
    let mut gone: std::collections::HashSet<CtKey> = std::collections::HashSet::new();
    for d in doomed {
        // A packet may have refreshed the flow since it was read: look
        // again right before deleting (what is left is a window of a few
        // syscalls, in which a packet of a flow idle for its whole timeout
        // would have to arrive).
        let refreshed = d.keys.iter().any(|k| match ct.get(k, 0) {
            Ok(now_v) => table.get(k).is_none_or(|was| now_v.seen_s != was.seen_s),
            Err(_) => false,
        });
        if refreshed && d.reason == Reason::Expired {
            stats.revived_flows += 1;
            continue;
        }
        let mut deleted = 0;
        for k in &d.keys {
            match ct.remove(k) {
                Ok(()) => deleted += 1,
                Err(e) if is_not_found(&e) => {}
                Err(source) => return Err(GcError::Delete { map: pc::NP_CT_MAP, source }),
            }
            gone.insert(*k);
        }
        match d.reason {
            Reason::Expired => {
                stats.expired_flows += 1;
                stats.deleted_expired += deleted;
            }
            Reason::StaleBackend => {
                stats.stale_flows += 1;
                stats.deleted_stale += deleted;
            }
        }
    }
    // Ports only the deleted flows used lose their bit.
    let mut left = PortSet::default();
    for (k, _) in entries.iter().filter(|(k, _)| !gone.contains(k)) {
        left.insert_conntrack(k);
    }
    match (&mut bits, generation) {
        (Ok(b), Some(g)) => {
            match b.clear_unused(g, &left) {
                Ok(cleared) => stats.ports_cleared = cleared,
                Err(e) => stats.ports_error = Some(e.to_string()),
            }
            stats.ports_set = b.known_counts();
        }
        (Err(e), _) => stats.ports_error = Some(format!("port bitmap: cannot open pinned map {}: {e}", pc::NP_PORTS_MAP)),
        (Ok(_), None) => {}
    }
    Ok(stats)
}

/// `--conntrack-*` flags resolved.
#[derive(Clone, Copy, Debug)]
pub struct GcConfig {
    /// Time between sweeps; zero turns them off (entries then leave by LRU eviction alone).
    pub interval: Duration,
    /// The idle timeouts.
    pub timeouts: Timeouts,
}

/// Sweeps `pin_dir`'s `NP_CT` every `cfg.interval` on the current tokio
/// runtime (the sweep itself on the blocking pool) and records each pass in
/// `metrics`. A zero interval disables it. The task runs until the runtime
/// stops.
pub fn spawn(pin_dir: PathBuf, cfg: GcConfig, metrics: Arc<Metrics>) -> Option<tokio::task::JoinHandle<()>> {
    if cfg.interval.is_zero() {
        tracing::info!("conntrack GC disabled (--conntrack-gc-interval-secs 0); NP_CT entries age out by LRU eviction only");
        return None;
    }
    // The first sweep waits one interval, so that start-up (install, first
    // sync) goes first.
    let mut ports_failing = false;
    let timeouts = cfg.timeouts;
    Some(periodic::every(
        cfg.interval,
        move || sweep(&pin_dir, &timeouts),
        move |run| match run {
            Run::Done(stats) => {
                if let Some(e) = &stats.ports_error {
                    // Unused bits only cost unrelated packets a lookup: worth a
                    // warning (once per streak), not a failed sweep.
                    metrics.error(crate::observe::metrics::reason::CONNTRACK_GC);
                    if !ports_failing {
                        tracing::warn!("conntrack GC: {e}; unused NP_PORTS bits stay set");
                    }
                }
                ports_failing = stats.ports_error.is_some();
                if let Some((ingress, egress)) = stats.ports_set {
                    metrics.record_port_bits(ingress, egress);
                }
                if let Some(n) = stats.ports_cleared.filter(|n| *n > 0) {
                    tracing::debug!(ports = n, "conntrack GC cleared the NP_PORTS bits of ports no longer in use");
                }
                let deleted = [
                    (Reason::Expired.label(), stats.expired_flows, stats.deleted_expired),
                    (Reason::StaleBackend.label(), stats.stale_flows, stats.deleted_stale),
                ];
                metrics.record_conntrack_gc(&GcFigures { entries: stats.entries, capacity: stats.capacity, deleted: &deleted });
                if stats.expired_flows + stats.stale_flows > 0 {
                    tracing::debug!(
                        entries = stats.entries,
                        expired_flows = stats.expired_flows,
                        stale_flows = stats.stale_flows,
                        deleted = stats.deleted_expired + stats.deleted_stale,
                        "conntrack GC"
                    );
                }
            }
            Run::Failed { error, first } => {
                metrics.error(crate::observe::metrics::reason::CONNTRACK_GC);
                // Once per failure streak, not every interval.
                if first {
                    tracing::warn!("{error}");
                }
            }
            Run::Panicked(e) => tracing::warn!(error = %e, "conntrack GC task failed"),
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proxy_common::{CT_DIR_FORWARD, CT_DIR_REPLY, CT_DIR_REPLY_SNAT, CT_DIR_SNAT, PROTO_TCP, PROTO_UDP};

    const T: Timeouts = Timeouts { tcp_s: 21_600, tcp_closing_s: 10, tcp_syn_s: 60, other_s: 60 };

    fn v(seen_s: u32, flags: u32) -> CtValue {
        CtValue { seen_s, flags, ..Default::default() }
    }

    #[test]
    fn expiry_by_protocol_state_and_age() {
        let closing = pc::CT_FLAG_CLOSING;
        let half = pc::CT_FLAG_FIN_CLIENT | pc::CT_FLAG_REPLIED;
        let est = pc::CT_FLAG_REPLIED;
        // (proto, seen_s, flags, now_s, expired)
        let cases = [
            (PROTO_TCP, 1000, est, 1000, false),
            (PROTO_TCP, 1000, est, 1000 + 21_600, false),
            (PROTO_TCP, 1000, est, 1000 + 21_601, true),
            // Never answered: the SYN timeout.
            (PROTO_TCP, 1000, 0, 1000 + 60, false),
            (PROTO_TCP, 1000, 0, 1000 + 61, true),
            (PROTO_TCP, 1000, pc::CT_FLAG_SNAT, 1000 + 61, true),
            (PROTO_TCP, 1000, half, 1000 + 11, false), // a half-close keeps the long timeout
            (PROTO_TCP, 1000, half | pc::CT_FLAG_FIN_BACKEND | closing, 1000 + 11, true),
            (PROTO_TCP, 1000, closing, 1010, false),
            (PROTO_TCP, 1000, closing, 1011, true),
            (PROTO_TCP, 1000, closing | pc::CT_FLAG_SNAT, 1011, true),
            (PROTO_UDP, 1000, 0, 1060, false),
            (PROTO_UDP, 1000, 0, 1061, true),
            (PROTO_UDP, 1000, closing, 1011, false), // closing means nothing for UDP
            // Refreshed after the sweep read the clock: fresh, not ancient.
            (PROTO_UDP, 1005, 0, 1000, false),
            // Across the u32 wrap of seconds.
            (PROTO_UDP, u32::MAX - 5, 0, 10, false),
            (PROTO_UDP, u32::MAX - 100, 0, 10, true),
        ];
        for (proto, seen, flags, now, want) in cases {
            assert_eq!(expired(proto, &v(seen, flags), now, &T), want, "proto {proto} seen {seen} flags {flags:#x} now {now}");
        }
        let short = Timeouts { tcp_s: 30, tcp_closing_s: 1, tcp_syn_s: 2, other_s: 5 };
        assert!(expired(PROTO_TCP, &v(0, est), 31, &short));
        assert!(expired(PROTO_TCP, &v(0, 0), 3, &short));
        assert!(!expired(PROTO_UDP, &v(0, 0), 5, &short));
    }

    fn key(s: u32, d: u32, sp: u16, dp: u16, proto: u8, dir: u8) -> CtKey {
        CtKey { saddr_be: [s, 0, 0, 0], daddr_be: [d, 0, 0, 0], sport_be: sp, dport_be: dp, proto, family: pc::FAMILY_V4, dir, _pad: 0 }
    }
    fn val(s: u32, d: u32, sp: u16, dp: u16, backend_id: u32, seen_s: u32, flags: u32) -> CtValue {
        CtValue { saddr_be: [s, 0, 0, 0], daddr_be: [d, 0, 0, 0], sport_be: sp, dport_be: dp, flags, backend_id, seen_s }
    }

    /// The four entries of a flow client 1:10 -> frontend 2:20 to backend
    /// 3:30 (id 7) SNAT'ed to node 4:40, seen at `seen` by the client legs
    /// and `reply_seen` by the reply legs.
    fn remote_flow(client_port: u16, proto: u8, seen: u32, reply_seen: u32, flags: u32) -> Vec<(CtKey, CtValue)> {
        let (c, f, b, n) = (1, 2, 3, 4);
        let snat_port = 40 + client_port;
        vec![
            (key(c, f, client_port, 20, proto, CT_DIR_FORWARD), val(c, b, client_port, 30, 7, seen, flags | pc::CT_FLAG_SNAT)),
            (key(c, b, client_port, 30, proto, CT_DIR_SNAT), val(n, b, snat_port, 30, 7, seen, flags | pc::CT_FLAG_SNAT)),
            (key(b, n, 30, snat_port, proto, CT_DIR_REPLY_SNAT), val(b, c, 30, client_port, 7, reply_seen, flags | pc::CT_FLAG_SNAT)),
            (key(b, c, 30, client_port, proto, CT_DIR_REPLY), val(f, c, 20, client_port, 7, reply_seen, flags)),
        ]
    }

    #[test]
    fn flush_picks_the_flows_of_a_frontend_backend_pair_whole() {
        // remote_flow: client 1 -> frontend 2:20 -> backend 3:30 (node 4).
        let to_3 = |e: &FlowEnds| {
            (e.frontend_be[0] == 2 && e.frontend_port_be == 20 && e.backend_be[0] == 3 && e.backend_port_be == 30).then_some(e.proto)
        };
        // (name, entries, flows picked, entries picked)
        let local_flow = |port: u16, backend: u32| {
            vec![
                (key(1, 2, port, 20, PROTO_UDP, CT_DIR_FORWARD), val(1, backend, port, 30, 9, 0, 0)),
                (key(backend, 1, 30, port, PROTO_UDP, CT_DIR_REPLY), val(2, 1, 20, port, 9, 0, 0)),
            ]
        };
        type Case = (&'static str, Vec<(CtKey, CtValue)>, usize, usize);
        let cases: Vec<Case> = vec![
            ("a remote flow: all four entries", remote_flow(10, PROTO_UDP, 0, 0, 0), 1, 4),
            ("a local flow: both entries", local_flow(11, 3), 1, 2),
            ("a flow to another backend stays", local_flow(12, 5), 0, 0),
            ("reply entries alone (forward legs evicted) still match", remote_flow(13, PROTO_TCP, 0, 0, 0).split_off(2), 1, 2),
            ("SNAT legs alone name no frontend", remote_flow(14, PROTO_UDP, 0, 0, 0)[1..3].to_vec(), 0, 0),
        ];
        for (name, entries, flows, n) in cases {
            let got = plan_flush(&entries, to_3);
            assert_eq!(got.len(), flows, "{name}: {got:?}");
            assert_eq!(got.iter().map(|(_, k)| k.len()).sum::<usize>(), n, "{name}");
            for (proto, keys) in &got {
                assert_eq!(*proto, entries[0].0.proto, "{name}: labelled by the target");
                let first_reply = keys.iter().position(|k| !pc::ct_dir_from_client(k.dir)).unwrap_or(keys.len());
                assert!(keys[first_reply..].iter().all(|k| !pc::ct_dir_from_client(k.dir)), "{name}: forward legs first");
            }
        }
        let mut all = remote_flow(20, PROTO_UDP, 0, 0, 0);
        all.extend(local_flow(21, 5));
        all.extend(remote_flow(22, PROTO_TCP, 0, 0, 0));
        assert_eq!(plan_flush(&all, to_3).len(), 2, "each flow judged on its own");
    }

    #[test]
    fn every_entry_of_a_flow_maps_to_its_reply_key() {
        let flow = remote_flow(10, PROTO_TCP, 0, 0, 0);
        let id = flow[3].0;
        for (k, v) in &flow {
            assert_eq!(flow_of(k, v), id, "dir {}", k.dir);
        }
        // The reply to a rejected flow (node:0 -> client) stands alone.
        let reject = key(4, 1, 0, 11, PROTO_TCP, CT_DIR_REPLY);
        assert_eq!(flow_of(&reject, &val(2, 1, 20, 11, 0, 0, 0)), reject);
    }

    #[test]
    fn sweep_plan_deletes_whole_idle_flows_and_keeps_live_ones() {
        let now = 100_000;
        let alive = |v: &CtValue| v.backend_id == 7;
        // (name, entries, expected: None = kept, Some(reason))
        type Case = (&'static str, Vec<(CtKey, CtValue)>, Option<Reason>);
        let cases: Vec<Case> = vec![
            ("established TCP, quiet for an hour", remote_flow(10, PROTO_TCP, now - 3600, now - 3600, pc::CT_FLAG_REPLIED), None),
            ("TCP idle past 6 h", remote_flow(11, PROTO_TCP, now - 21_601, now - 21_601, pc::CT_FLAG_REPLIED), Some(Reason::Expired)),
            ("unanswered SYN, 30 s ago", remote_flow(20, PROTO_TCP, now - 30, now - 30, 0), None),
            ("unanswered SYN, 61 s ago", remote_flow(21, PROTO_TCP, now - 61, now - 61, 0), Some(Reason::Expired)),
            (
                "answered once, on one reply leg only",
                {
                    let mut f = remote_flow(22, PROTO_TCP, now - 61, now - 61, 0);
                    f[3].1.flags |= pc::CT_FLAG_REPLIED;
                    f
                },
                None,
            ),
            // Only the client talks: the reply legs are old, the forward legs fresh.
            ("one-way UDP stream", remote_flow(12, PROTO_UDP, now - 1, now - 500, 0), None),
            ("idle UDP", remote_flow(13, PROTO_UDP, now - 61, now - 70, 0), Some(Reason::Expired)),
            ("closed TCP, 11 s ago", remote_flow(14, PROTO_TCP, now - 11, now - 11, pc::CT_FLAG_CLOSING), Some(Reason::Expired)),
            ("closed TCP, 5 s ago", remote_flow(15, PROTO_TCP, now - 5, now - 5, pc::CT_FLAG_CLOSING), None),
            (
                "closing seen on one entry only",
                {
                    let mut f = remote_flow(16, PROTO_TCP, now - 30, now - 30, 0);
                    f[2].1.flags |= pc::CT_FLAG_CLOSING;
                    f
                },
                Some(Reason::Expired),
            ),
            (
                "UDP backend gone",
                remote_flow(17, PROTO_UDP, now, now, 0)
                    .into_iter()
                    .map(|(k, mut v)| {
                        v.backend_id = 8;
                        (k, v)
                    })
                    .collect(),
                Some(Reason::StaleBackend),
            ),
            (
                "TCP backend gone: the connection keeps it, as conntrack keeps a DNAT",
                remote_flow(20, PROTO_TCP, now, now, 0)
                    .into_iter()
                    .map(|(k, mut v)| {
                        v.backend_id = 8;
                        (k, v)
                    })
                    .collect(),
                None,
            ),
            (
                "reply entries left without forward entries (LRU) still expire",
                remote_flow(18, PROTO_UDP, now - 100, now - 100, 0).split_off(2),
                Some(Reason::Expired),
            ),
            (
                "reply entries without forward entries are never stale",
                remote_flow(19, PROTO_UDP, now, now, 0)
                    .split_off(2)
                    .into_iter()
                    .map(|(k, mut v)| {
                        v.backend_id = 8;
                        (k, v)
                    })
                    .collect(),
                None,
            ),
        ];
        for (name, entries, want) in cases {
            let got = plan(&entries, now, &T, alive);
            match want {
                None => assert!(got.is_empty(), "{name}: {got:?}"),
                Some(reason) => {
                    assert_eq!(got.len(), 1, "{name}: {got:?}");
                    assert_eq!(got[0].reason, reason, "{name}");
                    assert_eq!(got[0].keys.len(), entries.len(), "{name}: every entry of the flow");
                    let client_legs = got[0].keys.iter().take_while(|k| pc::ct_dir_from_client(k.dir)).count();
                    let all_client_legs = entries.iter().filter(|(k, _)| pc::ct_dir_from_client(k.dir)).count();
                    assert_eq!(client_legs, all_client_legs, "{name}: forward legs first");
                }
            }
        }
        // All together: each flow is judged on its own.
        let mut all = Vec::new();
        let live = remote_flow(50, PROTO_TCP, now, now, 0);
        all.extend(live.clone());
        all.extend(remote_flow(51, PROTO_UDP, now - 61, now - 61, 0));
        all.extend(remote_flow(52, PROTO_TCP, now - 20, now - 20, pc::CT_FLAG_CLOSING));
        let got = plan(&all, now, &T, alive);
        assert_eq!(got.iter().map(|d| d.keys.len()).sum::<usize>(), 8);
        assert!(got.iter().all(|d| d.keys.iter().all(|k| !live.iter().any(|(l, _)| l == k))), "{got:?}");
    }
}
