//! Terminating the sockets the socket load balancer translated to a
//! backend that has left its frontend's set, and flushing the TC
//! datapath's conntrack flows to such backends.
//!
//! A socket is translated once, at connect() (TCP, connected UDP): nothing
//! translates it again, so after its backend is deleted it keeps talking
//! to an address nobody answers (a connected UDP socket forever, a TCP
//! connection until its own timeouts). Terminating it makes the
//! application see an error and reconnect through the Service, which now
//! translates to a backend that is there. Unconnected UDP needs nothing:
//! sendmsg() translates every datagram against the current maps.
//!
//! Only sockets we translated are touched. The proof is the record the
//! connect hook writes for every connect() it translates, naming the
//! frontend and the backend: a TCP socket's own storage (`SOCK_PEER`),
//! which sock_diag reports with the socket when asked; for UDP (whose
//! storage sock_diag does not report), and for what does not fit a TCP
//! socket's storage (a retried connect() to another backend), an entry in
//! `SOCK_REVNAT` keyed by the socket's cookie and that backend. A socket
//! whose record names its current peer was translated to it from that
//! frontend. A socket that dialled the pod's address directly has none,
//! and is left alone.
//!
//! Sockets live in every network namespace (pods, and the node's own for
//! host-network processes). One walk visits each namespace once per batch
//! of departures (`netns::in_each`), on a thread of its own.
//!
//! Mechanisms, by what the kernel offers ([`detect`]), in order of
//! preference:
//! * `iterators`: BPF socket iterators calling the `bpf_sock_destroy`
//!   kfunc (Linux >= 6.5), as Cilium does (`datapath::sock_iter`): the
//!   proof and the abort happen in the kernel, one pass over each
//!   namespace's sockets per protocol;
//! * `netlink`: a `SOCK_DIAG_BY_FAMILY` dump of the sockets connected to
//!   departed backends, then `SOCK_DESTROY` over NETLINK_SOCK_DIAG (Linux
//!   >= 4.5 with `CONFIG_INET_DIAG_DESTROY`) for each one proven ours;
//! * `none`: said once at start-up, in the log and in
//!   `topoproxy_socket_termination_mechanism`.

use std::collections::{BTreeMap, HashMap as StdHashMap};
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender};
use std::time::Instant;

use aya::maps::{HashMap, Map, MapData};
use proxy_common as pc;
use proxy_common::{SockPeerValue, SockRecValue, SockRevNatKey, SockRevNatValue, SockTerminateKey};

use crate::datapath::conntrack::conntrack_gc::{self, FlowEnds};
use crate::datapath::loader::kernel_features;
use crate::datapath::loader::pins;
use crate::datapath::maps::bpf_batch;
use crate::datapath::maps::keys::{backend_value, ip_of};
use crate::datapath::sockets::netns;
use crate::datapath::sockets::sock_diag::{self, DiagSock, DiagSocket};
use crate::datapath::sockets::sock_iter::SockIterators;
use crate::decide::departures::{Departure, Reason};
use crate::model::{Backend, Frontend, Protocol};
use crate::observe::metrics::{Metrics, reason};

/// How this kernel lets the agent terminate sockets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mechanism {
    /// BPF socket iterators calling `bpf_sock_destroy` (Linux 6.5): sockets found by their own
    /// cookie, in every namespace.
    Iterators,
    /// sock_diag `SOCK_DESTROY` over netlink, one namespace at a time (needs
    /// `CONFIG_INET_DIAG_DESTROY`).
    Netlink,
    /// Neither: sockets to departed backends are left to time out.
    None,
}

impl Mechanism {
    /// Every mechanism, for the metric's labels.
    pub const ALL: [Mechanism; 3] = [Mechanism::Iterators, Mechanism::Netlink, Mechanism::None];

    /// The metric label and log name.
    pub fn label(self) -> &'static str {
        match self {
            Mechanism::Iterators => "iterators",
            Mechanism::Netlink => "netlink",
            Mechanism::None => "none",
        }
    }
}

/// What start-up found: the mechanism, and why.
#[derive(Clone, Debug)]
pub struct Detection {
    /// The mechanism in use.
    pub mechanism: Mechanism,
    /// Why this one (what the others lacked), for the log.
    pub detail: String,
}

/// [`detect`]'s result: the mechanism, and the iterators when they are it.
#[derive(Debug)]
pub struct Detected {
    /// What was found.
    pub detection: Detection,
    /// The loaded iterators, when they are the mechanism.
    pub iterators: Option<SockIterators>,
}

/// Picks the mechanism: the BPF socket iterators when they load (the
/// maps pinned under `pin_dir` must exist), else netlink when
/// `SOCK_DESTROY` aborts sockets of the agent's own (loopback, its own
/// namespace) for TCP and UDP. `TOPOPROXY_KERNEL_HIDE=sock_destroy_kfunc`
/// passes over the iterators, so the netlink path can be tried on a kernel
/// that has both.
pub fn detect(pin_dir: &Path) -> Detected {
    let iterators = if kernel_features::hidden("sock_destroy_kfunc") { None } else { Some(SockIterators::load(pin_dir)) };
    let why_not_iterators = match iterators {
        None => "no BPF socket iterators: sock_destroy_kfunc hidden by TOPOPROXY_KERNEL_HIDE".to_string(),
        Some(Ok(it)) => {
            return Detected {
                detection: Detection {
                    mechanism: Mechanism::Iterators,
                    detail: "BPF socket iterators (iter/tcp, iter/udp) with the bpf_sock_destroy kfunc".to_string(),
                },
                iterators: Some(it),
            };
        }
        Some(Err(e)) => format!("no BPF socket iterators: {}", crate::util::error_chain::error_chain(&e)),
    };
    let tcp = sock_diag::probe_destroy(pc::PROTO_TCP);
    let udp = sock_diag::probe_destroy(pc::PROTO_UDP);
    let detection = match (tcp, udp) {
        (Ok(()), Ok(())) => {
            Detection { mechanism: Mechanism::Netlink, detail: format!("netlink SOCK_DESTROY works for TCP and UDP; {why_not_iterators}") }
        }
        (tcp, udp) => {
            let why = |r: io::Result<()>| match r {
                Ok(()) => "works".to_string(),
                Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => "kernel built without CONFIG_INET_DIAG_DESTROY".to_string(),
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                    "no inet_diag handler for the protocol (inet_diag, tcp_diag or udp_diag not loaded)".to_string()
                }
                Err(e) => e.to_string(),
            };
            Detection {
                mechanism: Mechanism::None,
                detail: format!("{why_not_iterators}; netlink SOCK_DESTROY: TCP: {}, UDP: {}", why(tcp), why(udp)),
            }
        }
    };
    Detected { detection, iterators: None }
}

/// One batch of departures, from one sync pass (or several queued ones).
#[derive(Clone, Debug, Default)]
pub struct Batch {
    /// Socket-datapath departures: their sockets are terminated.
    pub sockets: Vec<Departure>,
    /// TC-datapath departures: their `NP_CT` flows are flushed.
    pub conntrack: Vec<Departure>,
}

impl Batch {
    /// Whether there is nothing to end.
    pub fn is_empty(&self) -> bool {
        self.sockets.is_empty() && self.conntrack.is_empty()
    }
}

/// The worker that terminates and flushes, on a thread of its own.
#[derive(Debug)]
pub struct Terminator {
    tx: Sender<Batch>,
}

impl Terminator {
    /// Starts the worker for the maps pinned under `pin_dir`, with what
    /// [`detect`] found.
    pub fn start(pin_dir: PathBuf, detected: Detected, metrics: Arc<Metrics>) -> io::Result<Terminator> {
        let (tx, rx) = std::sync::mpsc::channel();
        let worker = Worker { pin_dir, mechanism: detected.detection.mechanism, iterators: detected.iterators, metrics, maps: None };
        std::thread::Builder::new().name("sock-destroy".into()).spawn(move || worker.run(&rx))?;
        Ok(Terminator { tx })
    }

    /// Hands a batch to the worker; never blocks. The maps must already
    /// hold the new sets: a socket terminated earlier could reconnect to
    /// the departed backend.
    pub fn submit(&self, batch: Batch) {
        if !batch.is_empty() && self.tx.send(batch).is_err() {
            tracing::warn!("the socket termination worker is gone; departed backends keep their sockets");
        }
    }
}

/// The frontend a socket with cookie `cookie`, now talking to `peer`, was
/// translated from by the socket load balancer, if it was. The connect
/// hook's record says so: its `SOCK_REC` record (`rec`, by cookie) when it
/// names this peer; else the socket's own storage (`SOCK_PEER`, its value
/// as sock_diag reported it, `stored`) when it names this peer, else the
/// `SOCK_REVNAT` entry of that cookie and peer, which the storage's
/// `spilled` mark (or no storage at all) sends the search to. The entry
/// of an earlier peer of a reconnected socket does not match its current
/// one.
pub fn translated_frontend(
    protocol: Protocol,
    peer: &Backend,
    cookie: u64,
    rec: Option<SockRecValue>,
    stored: Option<&[u8]>,
    revnat: impl FnOnce(&SockRevNatKey) -> Option<SockRevNatValue>,
) -> Option<Frontend> {
    let b = backend_value(peer);
    let frontend =
        |ip_be: [u32; 4], port_be: u16, family: u8| Some(Frontend { ip: ip_of(ip_be, family)?, port: u16::from_be(port_be), protocol });
    if let Some(r) = rec
        && r.family == b.family
        && r.backend_ip_be == b.ip_be
        && r.backend_port_be == b.port_be
        && r.proto == proto_number(protocol)
    {
        return frontend(r.frontend_ip_be, r.frontend_port_be, r.family);
    }
    if let Some(v) = stored.and_then(peer_value) {
        if v.family == b.family && v.backend_ip_be == b.ip_be && v.backend_port_be == b.port_be {
            return frontend(v.frontend_ip_be, v.frontend_port_be, v.family);
        }
        if v.spilled == 0 {
            return None;
        }
    }
    let v = revnat(&SockRevNatKey::new(cookie, b.ip_be, b.port_be, b.family))?;
    frontend(v.ip_be, v.port_be, v.family)
}

/// A `SOCK_PEER` value from the bytes sock_diag reported; `None` when the
/// size is not the value's.
fn peer_value(bytes: &[u8]) -> Option<SockPeerValue> {
    if bytes.len() != std::mem::size_of::<SockPeerValue>() {
        return None;
    }
    // SAFETY: exactly `size_of::<SockPeerValue>()` readable bytes; the
    // value is plain integers (repr(C), explicit padding), so every bit
    // pattern is one; the read makes no alignment assumption.
    Some(unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<SockPeerValue>()) })
}

/// A dumped socket's peer as a backend: an IPv4 peer of an IPv6 socket
/// (`::ffff:a.b.c.d`) in IPv4 form, as the programs remember it.
fn peer_of(dst: SocketAddr) -> Backend {
    let ip = match dst.ip() {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 @ IpAddr::V4(_) => v4,
    };
    Backend { ip, port: dst.port() }
}

fn proto_number(p: Protocol) -> u8 {
    match p {
        Protocol::Tcp => pc::PROTO_TCP,
        Protocol::Udp => pc::PROTO_UDP,
    }
}

fn label(p: Protocol) -> &'static str {
    match p {
        Protocol::Tcp => "tcp",
        Protocol::Udp => "udp",
    }
}

/// The departures of a batch by (protocol, backend), and the dumps they
/// need: TCP and UDP per family, and for IPv4 backends the IPv6 sockets
/// too (an AF_INET6 socket reaches IPv4 as `::ffff:a.b.c.d`).
struct Targets {
    by_peer: StdHashMap<(Protocol, Backend), Vec<Departure>>,
    dumps: Vec<(u8, Protocol)>,
}

impl Targets {
    fn new(departures: &[Departure]) -> Targets {
        let mut by_peer: StdHashMap<(Protocol, Backend), Vec<Departure>> = StdHashMap::new();
        let mut dumps = Vec::new();
        for d in departures {
            let list = by_peer.entry((d.frontend.protocol, d.backend)).or_default();
            if !list.contains(d) {
                list.push(d.clone());
            }
            let families: &[i32] = if d.backend.ip.is_ipv4() { &[libc::AF_INET, libc::AF_INET6] } else { &[libc::AF_INET6] };
            for f in families {
                let dump = (*f as u8, d.frontend.protocol);
                if !dumps.contains(&dump) {
                    dumps.push(dump);
                }
            }
        }
        Targets { by_peer, dumps }
    }
}

/// The pinned maps that prove a socket ours.
struct ProofMaps {
    revnat: HashMap<MapData, SockRevNatKey, SockRevNatValue>,
    /// `SOCK_REC`; `None` in pins of an agent version without it.
    rec: Option<HashMap<MapData, u64, SockRecValue>>,
    /// `SOCK_REC` again, for deleting the record of a socket this walk
    /// aborted (the typed handle's `remove` wants it exclusively, and the
    /// walk shares these maps across namespaces).
    rec_delete: Option<MapData>,
    /// `SOCK_PEER`, whose values TCP dumps carry; `None` in pins of an
    /// agent version without it, whose sockets are all in `SOCK_REVNAT`.
    peer: Option<MapData>,
}

impl ProofMaps {
    fn open(pin_dir: &Path) -> Result<ProofMaps, aya::maps::MapError> {
        let data = MapData::from_pin(pins::map(pin_dir, pc::SOCK_REVNAT_MAP))?;
        let peer = MapData::from_pin(pins::map(pin_dir, pc::SOCK_PEER_MAP)).ok();
        let rec = MapData::from_pin(pins::map(pin_dir, pc::SOCK_REC_MAP)).ok().and_then(|d| HashMap::try_from(Map::HashMap(d)).ok());
        let rec_delete = MapData::from_pin(pins::map(pin_dir, pc::SOCK_REC_MAP)).ok();
        Ok(ProofMaps { revnat: HashMap::try_from(Map::LruHashMap(data))?, rec, rec_delete, peer })
    }
}

/// What the walk did in one namespace.
#[derive(Default)]
struct NsOutcome {
    /// (departure, socket) per socket terminated.
    terminated: Vec<(Departure, DiagSock)>,
    errors: Vec<String>,
}

struct Worker {
    pin_dir: PathBuf,
    mechanism: Mechanism,
    /// Loaded when the mechanism is `iterators`.
    iterators: Option<SockIterators>,
    metrics: Arc<Metrics>,
    maps: Option<ProofMaps>,
}

impl Worker {
    fn run(mut self, rx: &Receiver<Batch>) {
        while let Ok(mut batch) = rx.recv() {
            // Whatever queued up meanwhile goes into the same walk.
            while let Ok(more) = rx.try_recv() {
                batch.sockets.extend(more.sockets);
                batch.conntrack.extend(more.conntrack);
            }
            if !batch.conntrack.is_empty() {
                self.flush_conntrack(&batch.conntrack);
            }
            if !batch.sockets.is_empty() {
                self.terminate(&batch.sockets);
            }
        }
    }

    fn flush_conntrack(&self, departures: &[Departure]) {
        let started = Instant::now();
        let mut targets: StdHashMap<FlowEnds, (Protocol, Reason)> = StdHashMap::new();
        // Every departure is flushed: its protocol's rule already said that
        // its connections end (`decide::departures`).
        for d in departures {
            let (f, b) = (backend_value(&Backend { ip: d.frontend.ip, port: d.frontend.port }), backend_value(&d.backend));
            if f.family != b.family {
                continue;
            }
            let ends = FlowEnds {
                proto: proto_number(d.frontend.protocol),
                family: f.family,
                frontend_be: f.ip_be,
                frontend_port_be: f.port_be,
                backend_be: b.ip_be,
                backend_port_be: b.port_be,
            };
            targets.insert(ends, (d.frontend.protocol, d.reason));
        }
        if targets.is_empty() {
            return;
        }
        match conntrack_gc::flush(&self.pin_dir, |e| targets.get(e).copied()) {
            Ok(flushed) => {
                let (mut flows, mut entries) = (0, 0);
                for ((protocol, why), f) in &flushed {
                    self.metrics.conntrack_flushed(label(*protocol), why.label(), f.flows, f.entries);
                    flows += f.flows;
                    entries += f.entries;
                }
                tracing::info!(
                    flows,
                    entries,
                    took_ms = started.elapsed().as_millis() as u64,
                    departed = %summary(departures),
                    "flushed the NP_CT flows of backends that left their frontends"
                );
            }
            Err(e) => {
                self.metrics.error(reason::CONNTRACK_FLUSH);
                tracing::warn!(departed = %summary(departures), "flushing NP_CT for departed backends failed; the conntrack GC removes their flows later: {e}");
            }
        }
    }

    fn terminate(&mut self, departures: &[Departure]) {
        if self.mechanism == Mechanism::None {
            tracing::debug!(departed = %summary(departures), "sockets not terminated: no mechanism on this kernel (see the start-up log)");
            return;
        }
        let started = Instant::now();
        let namespaces = netns::all();
        let (terminated, errors) = match self.mechanism {
            Mechanism::Iterators => self.with_iterators(departures, &namespaces),
            _ => self.with_netlink(departures, &namespaces),
        };
        self.metrics.termination_batch(namespaces.len());
        let mut per_reason: BTreeMap<(Protocol, Reason), usize> = BTreeMap::new();
        for (d, n) in &terminated {
            *per_reason.entry((d.frontend.protocol, d.reason)).or_default() += n;
            tracing::debug!(
                service = %d.service.as_ref().map(ToString::to_string).unwrap_or_default(),
                frontend = %d.frontend,
                backend = %d.backend,
                reason = d.reason.label(),
                sockets = n,
                "sockets of a departed backend terminated"
            );
        }
        for ((protocol, why), n) in &per_reason {
            self.metrics.sockets_terminated(label(*protocol), why.label(), *n);
        }
        if let Err(e) = record_ended(&self.pin_dir, &per_reason) {
            tracing::debug!("the terminations are not counted in {}: {e}", pc::COUNTERS_MAP);
        }
        self.metrics.errors_by(reason::SOCKET_TERMINATION, errors.len());
        for e in errors.iter().take(5) {
            tracing::warn!("terminating sockets of departed backends: {e}");
        }
        let sockets: Vec<String> = terminated.iter().filter(|(_, n)| *n > 0).map(|(d, n)| format!("{d}: {n}")).collect();
        tracing::info!(
            mechanism = self.mechanism.label(),
            terminated = per_reason.values().sum::<usize>(),
            namespaces = namespaces.len(),
            errors = errors.len(),
            took_ms = started.elapsed().as_millis() as u64,
            departed = %summary(departures),
            sockets = %sockets.join("; "),
            "terminated the sockets translated to backends that left their frontends"
        );
    }

    /// Netlink: a dump per namespace, protocol and family, and a
    /// `SOCK_DESTROY` per socket proven ours. Returns the sockets
    /// terminated per departure, and what failed.
    fn with_netlink(&mut self, departures: &[Departure], namespaces: &[netns::Namespace]) -> (Vec<(Departure, usize)>, Vec<String>) {
        if self.maps.is_none() {
            match ProofMaps::open(&self.pin_dir) {
                Ok(m) => self.maps = Some(m),
                Err(e) => return (Vec::new(), vec![format!("opening the pinned map {}: {e}", pc::SOCK_REVNAT_MAP)]),
            }
        }
        let Some(maps) = self.maps.as_ref() else { return (Vec::new(), Vec::new()) };
        let targets = Targets::new(departures);
        let results = netns::in_each(namespaces, |ns| sweep_namespace(ns.inode, &targets, maps));
        let mut counts: BTreeMap<Departure, usize> = BTreeMap::new();
        let mut errors = Vec::new();
        for (inode, r) in results {
            match r {
                Ok(out) => {
                    for (d, _) in out.terminated {
                        *counts.entry(d).or_default() += 1;
                    }
                    errors.extend(out.errors.into_iter().map(|e| format!("netns {inode}: {e}")));
                }
                // A namespace whose last process exited meanwhile cannot be
                // entered any more, and has no sockets left either.
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
                Err(e) => errors.push(format!("netns {inode}: entering: {e}")),
            }
        }
        (counts.into_iter().collect(), errors)
    }

    /// Iterators: the pairs into `SOCK_TERMINATE`, one TCP and one UDP
    /// iterator per namespace, the programs' counts back.
    fn with_iterators(&mut self, departures: &[Departure], namespaces: &[netns::Namespace]) -> (Vec<(Departure, usize)>, Vec<String>) {
        let Some(iterators) = self.iterators.as_mut() else { return (Vec::new(), vec!["the iterators are not loaded".to_string()]) };
        let mut by_key: StdHashMap<SockTerminateKey, Departure> = StdHashMap::new();
        for d in departures {
            if let Some(k) = terminate_key(d) {
                by_key.entry(k).or_insert_with(|| d.clone());
            }
        }
        let keys: Vec<SockTerminateKey> = by_key.keys().copied().collect();
        let mut out = Vec::new();
        let mut errors = Vec::new();
        for chunk in keys.chunks(pc::MAX_SOCK_TERMINATE as usize) {
            let walk = iterators.walk(chunk, namespaces);
            for (k, v) in walk.counts {
                if let Some(d) = by_key.get(&k) {
                    out.push((d.clone(), v.terminated as usize));
                }
                if v.failed > 0 {
                    errors.push(format!(
                        "bpf_sock_destroy refused {} socket(s) of {}",
                        v.failed,
                        by_key.get(&k).map(ToString::to_string).unwrap_or_default()
                    ));
                }
            }
            errors.extend(walk.errors);
        }
        (out, errors)
    }
}

/// The iterators' key of a departure; `None` across families (which no
/// frontend has).
fn terminate_key(d: &Departure) -> Option<SockTerminateKey> {
    let (f, b) = (backend_value(&Backend { ip: d.frontend.ip, port: d.frontend.port }), backend_value(&d.backend));
    (f.family == b.family).then_some(SockTerminateKey {
        frontend_ip_be: f.ip_be,
        backend_ip_be: b.ip_be,
        frontend_port_be: f.port_be,
        backend_port_be: b.port_be,
        family: b.family,
        proto: proto_number(d.frontend.protocol),
        _pad: [0; 2],
    })
}

/// The `COUNTERS` index that counts sockets of `protocol` ended by
/// `reason`, for `dump`.
pub fn ended_counter(protocol: Protocol, reason: Reason) -> u32 {
    match (protocol, reason) {
        (Protocol::Tcp, _) => pc::counter::ENDED_TCP_GONE_AFTER_TERMINATING,
        (Protocol::Udp, Reason::NotServing) => pc::counter::ENDED_UDP_NOT_SERVING,
        (Protocol::Udp, Reason::Topology) => pc::counter::ENDED_UDP_TOPOLOGY,
        (Protocol::Udp, Reason::Deleted | Reason::GoneAfterTerminating) => pc::counter::ENDED_UDP_DELETED,
    }
}

/// Adds the sockets terminated by each rule to the pinned `COUNTERS`
/// (the first CPU's value of the `ended_*` entries, which no program
/// writes), so that `dump` shows which rule ended how many. An array
/// pinned by a version with 8 counters has no such entries: nothing is
/// written then.
fn record_ended(pin_dir: &Path, per_reason: &BTreeMap<(Protocol, Reason), usize>) -> Result<(), String> {
    use aya::maps::{PerCpuArray, PerCpuValues};
    if per_reason.values().all(|n| *n == 0) {
        return Ok(());
    }
    let data = MapData::from_pin(pins::map(pin_dir, pc::COUNTERS_MAP)).map_err(|e| e.to_string())?;
    let mut counters = PerCpuArray::<MapData, u64>::try_from(Map::PerCpuArray(data)).map_err(|e| e.to_string())?;
    for ((protocol, reason), n) in per_reason {
        let index = ended_counter(*protocol, *reason);
        if index >= counters.len() {
            continue;
        }
        let mut values: Vec<u64> = counters.get(&index, 0).map_err(|e| e.to_string())?.iter().copied().collect();
        if let Some(first) = values.first_mut() {
            *first = first.wrapping_add(*n as u64);
        }
        let values = PerCpuValues::try_from(values).map_err(|e| e.to_string())?;
        counters.set(index, values, 0).map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// The departures of a batch in one log field: at most ten, then a count.
fn summary(departures: &[Departure]) -> String {
    let mut out: Vec<String> = departures.iter().take(10).map(ToString::to_string).collect();
    if departures.len() > 10 {
        out.push(format!("and {} more", departures.len() - 10));
    }
    out.join("; ")
}

/// Dumps the sockets of the current thread's namespace that talk to a
/// departed backend and terminates those we translated from its frontend.
fn sweep_namespace(inode: u64, targets: &Targets, maps: &ProofMaps) -> NsOutcome {
    let mut out = NsOutcome::default();
    let mut diag = match DiagSocket::open() {
        Ok(d) => d,
        Err(e) => {
            out.errors.push(format!("opening a sock_diag socket: {e}"));
            return out;
        }
    };
    for &(family, protocol) in &targets.dumps {
        let states = match protocol {
            // SYN_SENT too: a connect() still waiting on a deleted pod
            // is better retried elsewhere at once. Not CLOSE_WAIT: the
            // backend's FIN arrived, nothing hangs, and an abort would
            // throw away what the socket received and has not read yet
            // (as in the iterators, proxy-ebpf/src/programs/sock_iter.rs).
            Protocol::Tcp => sock_diag::state_bit(sock_diag::TCP_ESTABLISHED) | sock_diag::state_bit(sock_diag::TCP_SYN_SENT),
            // connect() puts a UDP socket in TCP_ESTABLISHED; unconnected
            // sockets are re-translated per datagram and need nothing.
            Protocol::Udp => sock_diag::state_bit(sock_diag::TCP_ESTABLISHED),
        };
        // TCP sockets keep their translation in SOCK_PEER; sock_diag
        // reports socket storage for TCP only (see `DiagSock::storage`).
        let storage = if protocol == Protocol::Tcp { maps.peer.as_ref().map(|m| m.fd().as_fd()) } else { None };
        let socks = match diag.dump_with_storage(family, proto_number(protocol), states, storage) {
            Ok(s) => s,
            Err(e) => {
                out.errors.push(format!("listing {} sockets (family {family}): {e}", label(protocol)));
                continue;
            }
        };
        for s in socks {
            let peer = peer_of(s.dst);
            let Some(candidates) = targets.by_peer.get(&(protocol, peer)) else { continue };
            let rec = maps.rec.as_ref().and_then(|m| m.get(&s.cookie, 0).ok());
            let fe = translated_frontend(protocol, &peer, s.cookie, rec, s.storage.as_deref(), |k| maps.revnat.get(k, 0).ok());
            let Some(d) = fe.and_then(|fe| candidates.iter().find(|d| d.frontend == fe)) else {
                tracing::debug!(
                    netns = inode,
                    cookie = s.cookie,
                    local = %s.src,
                    peer = %s.dst,
                    translated_from = ?fe,
                    "socket to a departed backend left alone: not translated by us from a frontend it left"
                );
                continue;
            };
            match diag.destroy(&s) {
                Ok(()) => {
                    tracing::debug!(
                        netns = inode,
                        cookie = s.cookie,
                        local = %s.src,
                        service = %d.service.as_ref().map(ToString::to_string).unwrap_or_default(),
                        frontend = %d.frontend,
                        backend = %d.backend,
                        reason = d.reason.label(),
                        "socket terminated"
                    );
                    // As the iterator program does after its abort
                    // (proxy-ebpf/src/programs/sock_iter.rs): the socket stays open
                    // until its owner closes it, and its record is of no
                    // further use. Its count in SOCK_REC_COUNT stays
                    // (user space has no atomic add to take it back with):
                    // the slot only answers "look up" for good, the
                    // harmless side (see `sock_rec_count`). This is the
                    // fallback for kernels without `bpf_sock_destroy`.
                    if let Some(m) = maps.rec_delete.as_ref() {
                        let _ = bpf_batch::delete_elem(m.fd().as_fd(), &s.cookie);
                    }
                    out.terminated.push((d.clone(), s));
                }
                // Closed since the dump: nothing left to do.
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
                Err(e) => {
                    out.errors.push(format!("terminating {} socket {} -> {} (cookie {}): {e}", label(protocol), s.src, s.dst, s.cookie));
                }
            }
        }
    }
    out
}

/// Sets the start-up result in the log and the metric.
pub fn report(d: &Detection, metrics: &Metrics) {
    let known: Vec<&str> = Mechanism::ALL.iter().map(|m| m.label()).collect();
    metrics.set_termination_mechanism(d.mechanism.label(), &known);
    if d.mechanism == Mechanism::None {
        tracing::warn!(
            mechanism = d.mechanism.label(),
            "sockets translated to a backend that leaves are NOT terminated on this kernel; clients keep them until they fail on their own ({})",
            d.detail
        );
    } else {
        tracing::info!(mechanism = d.mechanism.label(), "sockets translated to a backend that leaves are terminated ({})", d.detail);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn be(s: &str) -> Backend {
        let a: SocketAddr = s.parse().unwrap();
        Backend { ip: a.ip(), port: a.port() }
    }

    #[test]
    fn only_sockets_we_translated_to_their_current_peer_have_a_frontend() {
        let dns = Frontend { ip: "10.96.0.10".parse().unwrap(), port: 53, protocol: Protocol::Udp };
        let pod = be("10.244.0.1:53");
        // SOCK_REVNAT: cookie 7 was sent to the pod from the frontend.
        let revnat = |k: &SockRevNatKey| {
            let (b, f) = (backend_value(&pod), backend_value(&be("10.96.0.10:53")));
            (k.cookie == 7 && k.ip_be == b.ip_be && k.port_be == b.port_be && k.family == b.family).then_some(SockRevNatValue {
                ip_be: f.ip_be,
                port_be: f.port_be,
                family: f.family,
                _pad: 0,
            })
        };
        // (name, protocol, cookie, current peer, expected)
        let cases = [
            ("UDP translated to its peer", Protocol::Udp, 7, pod, Some(dns)),
            ("TCP translated to its peer", Protocol::Tcp, 7, pod, Some(Frontend { protocol: Protocol::Tcp, ..dns })),
            ("another socket that dialled the pod directly", Protocol::Udp, 8, pod, None),
            ("the same socket, reconnected to another address", Protocol::Udp, 7, be("10.244.0.2:53"), None),
            ("the same address, another port", Protocol::Udp, 7, be("10.244.0.1:54"), None),
        ];
        for (name, protocol, cookie, peer, want) in cases {
            assert_eq!(translated_frontend(protocol, &peer, cookie, None, None, revnat), want, "{name}");
        }
    }

    #[test]
    fn a_tcp_socket_is_proven_ours_by_its_own_storage_first() {
        let web = Frontend { ip: "10.96.0.20".parse().unwrap(), port: 80, protocol: Protocol::Tcp };
        let pod = be("10.244.0.1:8080");
        let stored = |backend: &Backend, spilled: u8| {
            let (b, f) = (backend_value(backend), backend_value(&be("10.96.0.20:80")));
            let v = SockPeerValue {
                backend_ip_be: b.ip_be,
                frontend_ip_be: f.ip_be,
                backend_port_be: b.port_be,
                frontend_port_be: f.port_be,
                family: b.family,
                spilled,
                _pad: [0; 2],
            };
            // SAFETY: a plain-integer repr(C) value viewed as its bytes.
            unsafe { std::slice::from_raw_parts((&raw const v).cast::<u8>(), std::mem::size_of::<SockPeerValue>()) }.to_vec()
        };
        // SOCK_REVNAT: cookie 7 also went to the pod from the frontend
        // (a spilled translation).
        let revnat = |k: &SockRevNatKey| {
            let (b, f) = (backend_value(&pod), backend_value(&be("10.96.0.20:80")));
            (k.cookie == 7 && k.ip_be == b.ip_be && k.port_be == b.port_be).then_some(SockRevNatValue {
                ip_be: f.ip_be,
                port_be: f.port_be,
                family: f.family,
                _pad: 0,
            })
        };
        let other = be("10.244.0.2:8080");
        // (name, cookie, storage, expected)
        type Case<'a> = (&'a str, u64, Option<Vec<u8>>, Option<Frontend>);
        let cases: [Case<'_>; 6] = [
            ("storage names the current peer", 8, Some(stored(&pod, 0)), Some(web)),
            ("storage names another peer, not spilled", 7, Some(stored(&other, 0)), None),
            ("storage names another peer, spilled: SOCK_REVNAT decides", 7, Some(stored(&other, 1)), Some(web)),
            ("spilled, and nothing in SOCK_REVNAT", 8, Some(stored(&other, 1)), None),
            ("no storage (an older agent's socket): SOCK_REVNAT decides", 7, None, Some(web)),
            ("a value of the wrong size is no proof either way", 7, Some(vec![0; 3]), Some(web)),
        ];
        for (name, cookie, storage, want) in cases {
            assert_eq!(translated_frontend(Protocol::Tcp, &pod, cookie, None, storage.as_deref(), revnat), want, "{name}");
        }
    }

    #[test]
    fn a_sock_rec_record_proves_a_socket_ours_only_for_its_peer_and_protocol() {
        let web = Frontend { ip: "10.96.0.10".parse().unwrap(), port: 80, protocol: Protocol::Tcp };
        let (pod, other) = (be("10.244.0.1:8080"), be("10.244.0.2:8080"));
        let rec = |b: &Backend, proto: u8| {
            let v = backend_value(b);
            Some(SockRecValue {
                backend_ip_be: v.ip_be,
                frontend_ip_be: [u32::from_ne_bytes([10, 96, 0, 10]), 0, 0, 0],
                service_id: 3,
                backend_port_be: v.port_be,
                frontend_port_be: 80u16.to_be(),
                family: v.family,
                proto,
                counted: pc::SOCK_REC_COUNTED,
                _pad: 0,
            })
        };
        let none = |_: &SockRevNatKey| None;
        assert_eq!(translated_frontend(Protocol::Tcp, &pod, 7, rec(&pod, pc::PROTO_TCP), None, none), Some(web));
        // Reconnected elsewhere: the record names an earlier peer.
        assert_eq!(translated_frontend(Protocol::Tcp, &pod, 7, rec(&other, pc::PROTO_TCP), None, none), None);
        assert_eq!(translated_frontend(Protocol::Tcp, &pod, 7, rec(&pod, pc::PROTO_UDP), None, none), None);
    }

    #[test]
    fn mapped_peers_decode_as_the_programs_remember_them() {
        assert_eq!(peer_of("[::ffff:10.244.0.1]:53".parse().unwrap()), be("10.244.0.1:53"));
        assert_eq!(peer_of("[fd00::1]:53".parse().unwrap()), be("[fd00::1]:53"));
    }

    #[test]
    fn targets_dump_what_their_backends_need() {
        let d = |fe: &str, proto: Protocol, b: &str| Departure {
            frontend: {
                let a: SocketAddr = fe.parse().unwrap();
                Frontend { ip: a.ip(), port: a.port(), protocol: proto }
            },
            backend: be(b),
            service: None,
            reason: Reason::Deleted,
        };
        let t = Targets::new(&[
            d("10.96.0.10:53", Protocol::Udp, "10.244.0.1:53"),
            d("10.96.0.10:53", Protocol::Udp, "10.244.0.1:53"),
            d("[fd00::10]:80", Protocol::Tcp, "[fd00::1]:80"),
        ]);
        let (v4, v6) = (libc::AF_INET as u8, libc::AF_INET6 as u8);
        assert_eq!(t.dumps, vec![(v4, Protocol::Udp), (v6, Protocol::Udp), (v6, Protocol::Tcp)]);
        assert_eq!(t.by_peer.get(&(Protocol::Udp, be("10.244.0.1:53"))).map(Vec::len), Some(1));
        assert!(!t.by_peer.contains_key(&(Protocol::Tcp, be("10.244.0.1:53"))), "the protocol is part of the target");
    }
}
