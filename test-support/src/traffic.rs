//! Steady traffic that a test keeps running while it breaks things, and
//! the tally of what went wrong.
//!
//! Each flow is one `proxy-agent probe` process (started where the test
//! says: a namespace, and the node's cgroup for traffic to ClusterIPs)
//! printing one JSON line per attempt or exchange: long-lived TCP
//! connections (`--stream`, one line round trip to a line-echo backend per
//! exchange), a stream of new TCP connections, and UDP over long-lived
//! sockets or a new socket per attempt, connected or not. Every line is
//! checked as it arrives:
//!
//! - a failed connect, a connection broken while established, a datagram
//!   without a reply;
//! - a reply from outside the expected backends, or from another address
//!   than the one dialled (a translation not reversed): misrouted;
//! - a long-lived UDP socket whose replies come from a second backend:
//!   misrouted (every datagram of a socket or flow must reach one backend).
//!
//! A broken long-lived connection is replaced by a new one, so the flow
//! keeps running. The counts only grow; [`Traffic::snapshot`] takes them, and
//! [`Snapshot::since`] gives the attempts and failures of the time between
//! two snapshots (one fault of a test).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::sandbox::{Guarded, command_at};

/// What a flow does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    /// One TCP connection, a line each way every interval.
    TcpLongLived,
    /// A new TCP connection per attempt.
    TcpNew,
    /// One connected UDP socket, a datagram each way every interval.
    UdpConnectedLongLived,
    /// One unconnected UDP socket (sendto/recvfrom).
    UdpUnconnectedLongLived,
    /// A new connected UDP socket per attempt.
    UdpConnectedNew,
    /// A new unconnected UDP socket per attempt.
    UdpUnconnectedNew,
}

impl Kind {
    fn long_lived(self) -> bool {
        matches!(self, Kind::TcpLongLived | Kind::UdpConnectedLongLived | Kind::UdpUnconnectedLongLived)
    }

    fn udp(self) -> bool {
        !matches!(self, Kind::TcpLongLived | Kind::TcpNew)
    }

    pub fn label(self) -> &'static str {
        match self {
            Kind::TcpLongLived => "TCP long-lived",
            Kind::TcpNew => "TCP new connections",
            Kind::UdpConnectedLongLived => "UDP connected, long-lived socket",
            Kind::UdpUnconnectedLongLived => "UDP unconnected, long-lived socket",
            Kind::UdpConnectedNew => "UDP connected, new sockets",
            Kind::UdpUnconnectedNew => "UDP unconnected, new sockets",
        }
    }
}

/// One flow: what it dials, from where, and what a good reply is.
#[derive(Clone, Debug)]
pub struct Flow {
    /// How the table names it, e.g. `ClusterIP`.
    pub path: String,
    pub kind: Kind,
    pub to: SocketAddr,
    /// The namespace the probe runs in (`Netns::path`).
    pub netns: PathBuf,
    /// The cgroup it runs in (`Cgroup::path`): the node's, for traffic the
    /// socket programs translate.
    pub cgroup: Option<PathBuf>,
    /// The replies a good exchange may carry: backend names, or what a
    /// line-echo backend answers (`echo ping`).
    pub replies: BTreeSet<String>,
    /// Time between attempts or exchanges.
    pub interval: Duration,
    /// How long a connect or a reply may take before it counts as failed.
    pub timeout: Duration,
}

impl Flow {
    fn args(&self) -> Vec<String> {
        let mut a = vec![
            "probe".to_string(),
            "--to".into(),
            self.to.to_string(),
            "--count".into(),
            u32::MAX.to_string(),
            "--interval-ms".into(),
            self.interval.as_millis().to_string(),
            "--timeout-ms".into(),
            self.timeout.as_millis().to_string(),
        ];
        if self.kind.udp() {
            a.push("--udp".into());
        }
        if matches!(self.kind, Kind::UdpConnectedLongLived | Kind::UdpConnectedNew) {
            a.push("--connected".into());
        }
        if self.kind.long_lived() {
            a.push("--stream".into());
        }
        a
    }

    fn name(&self) -> String {
        format!("{} {} to {}", self.path, self.kind.label(), self.to)
    }
}

/// One thing that went wrong.
#[derive(Clone, Debug)]
pub struct Failure {
    pub at: Instant,
    pub flow: String,
    pub what: String,
}

#[derive(Default)]
struct Counts {
    attempts: u64,
    failures: u64,
}

#[derive(Default)]
struct Shared {
    /// By flow index.
    counts: Vec<Counts>,
    failures: Vec<Failure>,
    stop: bool,
    /// The running probe of each flow (pid), killed on stop.
    pids: Vec<i32>,
}

/// Flows running in the background.
pub struct Traffic {
    flows: Vec<Flow>,
    shared: Arc<Mutex<Shared>>,
    threads: Vec<JoinHandle<()>>,
}

fn lock(s: &Mutex<Shared>) -> std::sync::MutexGuard<'_, Shared> {
    s.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Traffic {
    /// Starts every flow, each a `probe` of `agent` (the proxy-agent
    /// binary), restarted when it ends.
    pub fn start(agent: &Path, flows: Vec<Flow>) -> Traffic {
        let shared = Arc::new(Mutex::new(Shared {
            counts: flows.iter().map(|_| Counts::default()).collect(),
            pids: vec![0; flows.len()],
            ..Shared::default()
        }));
        let threads = flows
            .iter()
            .enumerate()
            .map(|(i, f)| {
                let (f, shared, agent) = (f.clone(), shared.clone(), agent.to_path_buf());
                std::thread::spawn(move || supervise(&agent, i, &f, &shared))
            })
            .collect();
        Traffic { flows, shared, threads }
    }

    pub fn snapshot(&self) -> Snapshot {
        let s = lock(&self.shared);
        Snapshot {
            at: Instant::now(),
            counts: s.counts.iter().map(|c| (c.attempts, c.failures)).collect(),
            failures: s.failures.len(),
            names: self.flows.iter().map(Flow::name).collect(),
            all_failures: s.failures.clone(),
        }
    }

    /// Stops every probe and returns the final snapshot.
    pub fn stop(mut self) -> Snapshot {
        self.halt();
        self.snapshot()
    }

    fn halt(&mut self) {
        {
            let mut s = lock(&self.shared);
            s.stop = true;
            for &pid in &s.pids {
                if pid > 0 {
                    // SAFETY: plain kill(2) on a child that has not been
                    // reaped yet (its supervisor clears the pid first).
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
            }
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for Traffic {
    fn drop(&mut self) {
        self.halt();
    }
}

/// Runs flow `i` until stopped: starts its probe, checks every line, and
/// starts it again when it ends (a broken connection ends a TCP stream).
fn supervise(agent: &Path, i: usize, flow: &Flow, shared: &Mutex<Shared>) {
    let name = flow.name();
    loop {
        let mut child = {
            let mut s = lock(shared);
            if s.stop {
                return;
            }
            let spawned = command_at(agent, Some(&flow.netns), flow.cgroup.as_deref()).and_then(|mut cmd| {
                cmd.args(flow.args()).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::inherit());
                Guarded::spawn(&mut cmd)
            });
            match spawned {
                Ok(c) => {
                    s.pids[i] = i32::try_from(c.0.id()).unwrap_or(0);
                    c
                }
                Err(e) => {
                    s.counts[i].failures += 1;
                    s.failures.push(Failure { at: Instant::now(), flow: name.clone(), what: format!("cannot start the probe: {e}") });
                    drop(s);
                    std::thread::sleep(Duration::from_millis(500));
                    continue;
                }
            }
        };
        let Some(stdout) = child.0.stdout.take() else { return };
        // The backend a long-lived UDP socket reached first.
        let mut first_backend: Option<String> = None;
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            let verdict = check(flow, &line, &mut first_backend);
            let mut s = lock(shared);
            if s.stop {
                break;
            }
            s.counts[i].attempts += 1;
            if let Err(what) = verdict {
                s.counts[i].failures += 1;
                s.failures.push(Failure { at: Instant::now(), flow: name.clone(), what });
            }
        }
        lock(shared).pids[i] = 0;
        drop(child);
        if lock(shared).stop {
            return;
        }
        // A broken long-lived connection: open the next one after a breath.
        std::thread::sleep(flow.interval);
    }
}

/// Whether one probe line is a good attempt; the reason when it is not.
fn check(flow: &Flow, line: &str, first_backend: &mut Option<String>) -> Result<(), String> {
    let v: Value = serde_json::from_str(line).map_err(|e| format!("probe printed {line:?}: {e}"))?;
    if v["ok"] != true {
        let stage = v["stage"].as_str().unwrap_or("?");
        let error = v["error"].as_str().unwrap_or("?");
        let what = match (flow.kind, stage) {
            (_, "connect" | "bind") => "failed connect",
            (Kind::TcpLongLived, _) => "broken established connection",
            (Kind::TcpNew, _) => "connection failed after connect",
            (_, "send") => "datagram not sent",
            _ => "datagram lost (no reply)",
        };
        return Err(format!("{what}: {stage}: {error}"));
    }
    let reply = v["reply"].as_str().unwrap_or_default();
    let peer = v["peer"].as_str().unwrap_or_default();
    if !flow.replies.contains(reply) {
        return Err(format!("misrouted: reply {reply:?}, expected one of {:?}", flow.replies));
    }
    if peer != flow.to.to_string() {
        return Err(format!("misrouted: the reply came from {peer}, not from {} (translation not reversed)", flow.to));
    }
    if flow.kind.long_lived() && flow.kind.udp() {
        match first_backend {
            None => *first_backend = Some(reply.to_string()),
            Some(first) if first != reply => {
                return Err(format!("misrouted: the socket's datagrams reached {first} and now {reply}"));
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// The counts at one moment.
#[derive(Clone, Debug)]
pub struct Snapshot {
    pub at: Instant,
    /// (attempts, failures) per flow.
    counts: Vec<(u64, u64)>,
    failures: usize,
    names: Vec<String>,
    all_failures: Vec<Failure>,
}

impl Snapshot {
    /// What happened between `earlier` and this snapshot.
    pub fn since(&self, earlier: &Snapshot) -> Window {
        let mut by_flow = BTreeMap::new();
        let (mut attempts, mut failures) = (0, 0);
        for ((name, now), before) in self.names.iter().zip(&self.counts).zip(&earlier.counts) {
            let d = (now.0 - before.0, now.1 - before.1);
            attempts += d.0;
            failures += d.1;
            by_flow.insert(name.clone(), d);
        }
        Window {
            took: self.at.saturating_duration_since(earlier.at),
            attempts,
            failures,
            by_flow,
            failed: self.all_failures.get(earlier.failures..self.failures).unwrap_or_default().to_vec(),
        }
    }
}

/// Attempts and failures between two snapshots.
#[derive(Clone, Debug, Default)]
pub struct Window {
    pub took: Duration,
    /// Connects, exchanges over long-lived connections, and datagram round
    /// trips.
    pub attempts: u64,
    pub failures: u64,
    /// (attempts, failures) per flow.
    pub by_flow: BTreeMap<String, (u64, u64)>,
    pub failed: Vec<Failure>,
}

impl Window {
    /// Up to `n` failures, one per line, with their time from `origin`.
    pub fn examples(&self, origin: Instant, n: usize) -> String {
        let mut out = String::new();
        for f in self.failed.iter().take(n) {
            let _ = writeln!(out, "  +{:.1}s {}: {}", f.at.saturating_duration_since(origin).as_secs_f64(), f.flow, f.what);
        }
        if self.failed.len() > n {
            let _ = writeln!(out, "  ... {} more", self.failed.len() - n);
        }
        out
    }

    /// Flows without a single attempt in the window (stuck or not running).
    pub fn idle_flows(&self) -> Vec<&str> {
        self.by_flow.iter().filter(|(_, (a, _))| *a == 0).map(|(n, _)| n.as_str()).collect()
    }
}

/// One row of a disruption table: a fault, what the traffic saw while it
/// lasted, and a note (what the fault did, what the agent reported).
#[derive(Clone, Debug)]
pub struct Row {
    pub fault: String,
    pub window: Window,
    pub note: String,
}

/// The rows as a Markdown table: fault, attempts, failures, duration, note.
pub fn table(rows: &[Row]) -> String {
    let mut out = String::from("| fault | attempts | failures | seconds | note |\n| --- | ---: | ---: | ---: | --- |\n");
    for r in rows {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {:.1} | {} |",
            r.fault,
            r.window.attempts,
            r.window.failures,
            r.window.took.as_secs_f64(),
            r.note.replace('|', "/")
        );
    }
    let attempts: u64 = rows.iter().map(|r| r.window.attempts).sum();
    let failures: u64 = rows.iter().map(|r| r.window.failures).sum();
    let secs: f64 = rows.iter().map(|r| r.window.took.as_secs_f64()).sum();
    let _ = writeln!(out, "| **total** | {attempts} | {failures} | {secs:.1} | |");
    out
}
