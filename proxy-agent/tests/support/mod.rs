//! Shared pieces of the privileged tests: a simulated node (cgroup, pin
//! directory, agent process) on an isolated "cluster network" namespace
//! whose pod addresses live on loopback. These need the agent binary
//! (`CARGO_BIN_EXE_proxy-agent`, set only for this package's tests); what
//! does not is in proxy-test-support.
#![allow(dead_code)] // each test binary uses a different subset

use std::collections::BTreeSet;
use std::fs;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use proxy_test_support::sandbox::{Cgroup, Guarded, Netns, PinDir, command_in, spawn_backend};
use proxy_test_support::wait::{eventually, wait_limit};
use serde_json::Value;

pub(crate) fn agent_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_proxy-agent"))
}

/// These tests need root; say so plainly instead of failing obscurely.
pub(crate) fn require_root() {
    // SAFETY: geteuid has no preconditions.
    assert_eq!(unsafe { libc::geteuid() }, 0, "the datapath tests need root (CAP_BPF, CAP_NET_ADMIN, CAP_SYS_ADMIN)");
}

/// A temporary directory removed on drop.
pub(crate) struct TempDir(pub PathBuf);

impl TempDir {
    pub(crate) fn new(prefix: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!("{prefix}-{}-{}", std::process::id(), unique_suffix()));
        fs::create_dir_all(&p).expect("create temp dir");
        TempDir(p)
    }
}

fn unique_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// The namespace where pods (backends and clients) live.
pub(crate) struct PodNetwork {
    pub netns: Netns,
    backends: Vec<Guarded>,
}

impl PodNetwork {
    pub(crate) fn new() -> PodNetwork {
        require_root();
        PodNetwork { netns: Netns::new("tpt").expect("create netns"), backends: Vec::new() }
    }

    /// A serve-hostname backend named `name` on `ip` with the given ports
    /// (TCP and UDP each).
    pub(crate) fn backend(&mut self, name: &str, ip: &str, ports: &[u16]) {
        let cidr = if ip.contains(':') { format!("{ip}/128") } else { format!("{ip}/32") };
        // The address may already exist when several backends share an IP.
        let _ = self.netns.add_loopback_addrs(&[&cidr]);
        let listen: Vec<String> =
            ports.iter().map(|p| if ip.contains(':') { format!("[{ip}]:{p}") } else { format!("{ip}:{p}") }).collect();
        self.backends.push(spawn_backend(&agent_bin(), &self.netns, name, &listen).expect("start backend"));
    }
}

/// One simulated node: its pods' cgroup, its pin directory and its agent.
pub(crate) struct Node {
    pub name: String,
    pub cgroup: Cgroup,
    pub pins: PinDir,
    pub manifests: TempDir,
    agent: Option<Guarded>,
    pub log: PathBuf,
    /// Environment of the agents this node starts (e.g. the kernel probe's
    /// `TOPOPROXY_KERNEL_HIDE`).
    pub agent_env: Vec<(String, String)>,
}

impl Node {
    pub(crate) fn new(name: &str) -> Node {
        require_root();
        let manifests = TempDir::new("tpt-manifests");
        let log = manifests.0.join("agent.log.txt");
        Node {
            name: name.to_string(),
            cgroup: Cgroup::new("tpt").expect("create cgroup"),
            pins: PinDir::new("tpt").expect("create pin dir"),
            manifests,
            agent: None,
            log,
            agent_env: Vec::new(),
        }
    }

    /// Writes `file` atomically (write aside, then rename), as the agent
    /// expects of anyone editing its manifests.
    pub(crate) fn write_manifest(&self, file: &str, yaml: &str) {
        let tmp = self.manifests.0.join(format!(".{file}.tmp"));
        fs::write(&tmp, yaml).expect("write manifest");
        fs::rename(&tmp, self.manifests.0.join(file)).expect("rename manifest");
    }

    pub(crate) fn start_agent(&mut self) {
        self.start_agent_with(&[]);
    }

    /// The agent's exit status once it has exited by itself.
    pub(crate) fn agent_exit_status(&mut self) -> Option<std::process::ExitStatus> {
        self.agent.as_mut().and_then(|a| a.0.try_wait().ok().flatten())
    }

    pub(crate) fn start_agent_with(&mut self, extra: &[&str]) {
        let log = fs::OpenOptions::new().create(true).append(true).open(&self.log).expect("open log");
        let mut cmd = std::process::Command::new(agent_bin());
        cmd.arg("run")
            .arg("--node")
            .arg(&self.name)
            .arg("--manifests")
            .arg(&self.manifests.0)
            .arg("--cgroup")
            .arg(self.cgroup.path())
            .arg("--bpffs")
            .arg(self.pins.path())
            .arg("--poll-interval-ms")
            .arg("50")
            // The agent runs in the host's network namespace here: without
            // `none` it would attach TC programs to the host's interfaces.
            .args(["--devices", "none"])
            .args(extra)
            .envs(self.agent_env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("dup log"))
            .stderr(log);
        self.agent = Some(Guarded::spawn(&mut cmd).expect("start agent"));
    }

    /// SIGTERM, as a DaemonSet rollout would.
    pub(crate) fn stop_agent(&mut self) {
        if let Some(mut a) = self.agent.take() {
            a.terminate(Duration::from_secs(10)).expect("stop agent");
        }
    }

    /// SIGKILL: the agent gets no chance to do anything.
    pub(crate) fn kill_agent(&mut self) {
        if let Some(mut a) = self.agent.take() {
            let _ = a.0.kill();
            let _ = a.0.wait();
        }
    }

    pub(crate) fn agent_log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Runs `proxy-agent probe ARGS` as a pod of this node and returns one
    /// JSON value per attempt.
    pub(crate) fn probe(&self, net: &PodNetwork, args: &[&str]) -> Vec<Value> {
        let mut cmd = command_in(agent_bin(), Some(&net.netns), Some(&self.cgroup)).expect("probe command");
        cmd.arg("probe").args(args).stdin(Stdio::null()).stderr(Stdio::inherit());
        let out = cmd.output().expect("run probe");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("probe printed {l:?}: {e}")))
            .collect()
    }

    /// Starts a long probe in the background.
    pub(crate) fn probe_background(&self, net: &PodNetwork, args: &[&str]) -> Guarded {
        let mut cmd = command_in(agent_bin(), Some(&net.netns), Some(&self.cgroup)).expect("probe command");
        cmd.arg("probe").args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::inherit());
        Guarded::spawn(&mut cmd).expect("start probe")
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.kill_agent();
        if std::thread::panicking() {
            eprintln!("--- agent log of {} ---\n{}", self.name, self.agent_log());
        }
    }
}

/// The set of backend names that answered successful probes.
pub(crate) fn replies(results: &[Value]) -> BTreeSet<String> {
    results.iter().filter(|r| r["ok"] == true).filter_map(|r| r["reply"].as_str().map(str::to_string)).collect()
}

pub(crate) fn set(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(std::string::ToString::to_string).collect()
}

/// Probes until the set of answering backends is exactly `want`.
pub(crate) fn wait_for_backends(node: &Node, net: &PodNetwork, to: &str, extra: &[&str], want: &[&str]) {
    let want = set(want);
    eventually(&format!("{to} {extra:?} from {} to reach exactly {want:?}", node.name), || {
        let mut args = vec!["--to", to, "--count", "30", "--timeout-ms", "1000"];
        args.extend_from_slice(extra);
        let r = node.probe(net, &args);
        let got = replies(&r);
        if got == want && r.iter().all(|x| x["ok"] == true) { Ok(()) } else { Err((got, r.into_iter().find(|x| x["ok"] != true))) }
    });
}

/// A ClusterIP Service with one EndpointSlice per family, as YAML.
pub(crate) struct ServiceSpec<'a> {
    pub name: &'a str,
    pub cluster_ips: &'a [&'a str],
    /// (port name, port, protocol, target port)
    pub ports: &'a [(&'a str, u16, &'a str, u16)],
    /// (address, ready, nodeName)
    pub endpoints: &'a [(&'a str, bool, &'a str)],
    pub extra_spec: &'a str,
    pub annotations: &'a str,
}

impl ServiceSpec<'_> {
    pub(crate) fn yaml(&self) -> String {
        let ips = self.cluster_ips.iter().map(|i| format!("\"{i}\"")).collect::<Vec<_>>().join(", ");
        let ports = self
            .ports
            .iter()
            .map(|(n, p, proto, t)| format!("  - {{name: \"{n}\", port: {p}, protocol: {proto}, targetPort: {t}}}\n"))
            .collect::<String>();
        let mut out = format!(
            "apiVersion: v1\nkind: Service\nmetadata:\n  name: {}\n  namespace: default\n  annotations: {{{}}}\nspec:\n  clusterIP: \"{}\"\n  clusterIPs: [{ips}]\n{}  ports:\n{ports}",
            self.name, self.annotations, self.cluster_ips[0], self.extra_spec
        );
        for (fam, v6) in [("IPv4", false), ("IPv6", true)] {
            let eps: Vec<_> = self.endpoints.iter().filter(|(a, _, _)| a.contains(':') == v6).collect();
            let slice_ports = self
                .ports
                .iter()
                .map(|(n, _, proto, t)| format!("- {{name: \"{n}\", port: {t}, protocol: {proto}}}\n"))
                .collect::<String>();
            let endpoints = eps
                .iter()
                .map(|(a, ready, node)| format!("- addresses: [\"{a}\"]\n  conditions: {{ready: {ready}}}\n  nodeName: {node}\n"))
                .collect::<String>();
            out.push_str(&format!(
                "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {}-{}\n  namespace: default\n  labels: {{kubernetes.io/service-name: {}}}\naddressType: {fam}\nports:\n{slice_ports}endpoints:{}\n{endpoints}",
                self.name,
                fam.to_lowercase(),
                self.name,
                if endpoints.is_empty() { " []" } else { "" }
            ));
        }
        out
    }
}

pub(crate) fn path_exists(p: &Path) -> bool {
    p.exists()
}

/// Kubernetes mode: the agent watches an API server through `kubeconfig`
/// and serves /healthz, /livez and /readyz on one free loopback port and
/// /metrics on another.
impl Node {
    pub(crate) fn start_kube_agent(&mut self, kubeconfig: &Path, extra: &[&str]) {
        // Host network namespace: never TC on the host's interfaces.
        self.start_kube_agent_in(None, kubeconfig, "none", extra);
    }

    /// [`start_kube_agent`](Self::start_kube_agent) inside `netns` (the
    /// host's with `None`) with `--devices devices`: a node namespace's
    /// agent reaches the API server through a relay
    /// (`proxy_test_support::relay`) that `kubeconfig` names.
    pub(crate) fn start_kube_agent_in(&mut self, netns: Option<&Netns>, kubeconfig: &Path, devices: &str, extra: &[&str]) {
        let log = fs::OpenOptions::new().create(true).append(true).open(&self.log).expect("open log");
        let mut cmd = command_in(agent_bin(), netns, None).expect("agent command");
        cmd.arg("run")
            .arg("--node")
            .arg(&self.name)
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .arg("--cgroup")
            .arg(self.cgroup.path())
            .arg("--bpffs")
            .arg(self.pins.path())
            .args(["--healthz-bind-address", "127.0.0.1:0", "--metrics-bind-address", "127.0.0.1:0"])
            .args(["--devices", devices])
            .args(extra)
            .envs(self.agent_env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("dup log"))
            .stderr(log);
        self.agent = Some(Guarded::spawn(&mut cmd).expect("start agent"));
    }

    /// Whether the agent process is still running.
    pub(crate) fn agent_running(&mut self) -> bool {
        self.agent.as_mut().is_some_and(|a| matches!(a.0.try_wait(), Ok(None)))
    }

    /// The `/metrics` address the current agent logged (the last one in
    /// the log, so a restarted agent's).
    pub(crate) fn metrics_address(&self) -> std::net::SocketAddr {
        self.logged_address("metrics_bind_address=")
    }

    /// The `/healthz`, `/livez` and `/readyz` address the current agent
    /// logged (the last one in the log, so a restarted agent's).
    pub(crate) fn healthz_address(&self) -> std::net::SocketAddr {
        self.logged_address("healthz_bind_address=")
    }

    fn logged_address(&self, key: &str) -> std::net::SocketAddr {
        eventually(&format!("the agent to log its {key}"), || {
            let log = self.agent_log();
            log.rmatch_indices(key).next().and_then(|(i, _)| log[i + key.len()..].split_whitespace().next()?.parse().ok()).ok_or(())
        })
    }
}

/// A client connecting in a loop in the background; `finish` stops it and
/// returns (successful connects, failure lines).
pub(crate) struct Client {
    probe: Guarded,
    reader: JoinHandle<(u64, Vec<String>)>,
}

impl Client {
    pub(crate) fn start(node: &Node, net: &PodNetwork, to: &str) -> Client {
        let mut probe = node.probe_background(net, &["--to", to, "--count", "1000000", "--timeout-ms", "2000"]);
        let stdout = probe.0.stdout.take().expect("client stdout");
        let reader = std::thread::spawn(move || {
            let mut ok = 0u64;
            let mut failures = Vec::new();
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if line.contains("\"ok\":true") {
                    ok += 1;
                } else {
                    failures.push(line);
                }
            }
            (ok, failures)
        });
        Client { probe, reader }
    }

    pub(crate) fn finish(mut self) -> (u64, Vec<String>) {
        self.probe.terminate(Duration::from_secs(5)).expect("stop client");
        self.reader.join().expect("client reader")
    }
}

pub(crate) fn assert_no_failures(what: &str, (ok, failures): (u64, Vec<String>)) {
    assert!(ok > 20, "{what}: the client made only {ok} connects");
    assert!(
        failures.is_empty(),
        "{what}: {} of {} connects failed, e.g. {:?}",
        failures.len(),
        ok + failures.len() as u64,
        failures.first()
    );
}

/// The errno a refused connect() or sendmsg() gets from the socket
/// programs on this kernel: ECONNREFUSED where `bpf_set_retval` exists
/// (Linux 5.18), the kernel's default EPERM where the compat programs run
/// (see the README's kernel table).
pub(crate) fn refused_errno() -> i64 {
    use proxy_agent::datapath::kernel_features::{KernelFeatures, SET_RETVAL};
    if KernelFeatures::get().has(SET_RETVAL) { i64::from(libc::ECONNREFUSED) } else { i64::from(libc::EPERM) }
}

/// A probe process whose JSON lines are collected, each with the moment it
/// was read.
pub(crate) struct Stream {
    pub(crate) name: String,
    probe: Guarded,
    lines: Arc<Mutex<Vec<(Instant, Value)>>>,
    reader: Option<JoinHandle<()>>,
}

impl Stream {
    pub(crate) fn start(name: &str, mut cmd: Command) -> Stream {
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::inherit());
        let mut probe = Guarded::spawn(&mut cmd).expect("start probe");
        let stdout = probe.0.stdout.take().expect("probe stdout");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let sink = lines.clone();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let v: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("probe printed {line:?}: {e}"));
                sink.lock().unwrap_or_else(PoisonError::into_inner).push((Instant::now(), v));
            }
        });
        Stream { name: name.to_string(), probe, lines, reader: Some(reader) }
    }

    pub(crate) fn lines(&self) -> Vec<(Instant, Value)> {
        self.lines.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// The replies so far (successful exchanges' `reply`).
    pub(crate) fn replies(&self) -> Vec<String> {
        self.lines().iter().filter(|(_, l)| l["ok"] == true).filter_map(|(_, l)| l["reply"].as_str().map(str::to_string)).collect()
    }

    /// The same stream under another name (for messages).
    pub(crate) fn named(mut self, name: &str) -> Stream {
        self.name = name.to_string();
        self
    }

    /// The first failed exchange at or after `since`, and when it was read.
    pub(crate) fn first_failure_at(&self, since: Instant) -> Option<(Instant, Value)> {
        self.lines().into_iter().find(|(t, l)| *t >= since && l["ok"] != true)
    }

    /// Waits for the first exchange; its reply, or `None` when it failed.
    pub(crate) fn first(&self) -> Option<String> {
        eventually(&format!("{} to make its first exchange", self.name), || {
            self.lines().first().map(|(_, l)| l["reply"].as_str().filter(|_| l["ok"] == true).map(str::to_string)).ok_or(())
        })
    }

    /// (successful exchanges, failed ones).
    pub(crate) fn counts(&self) -> (usize, Vec<Value>) {
        let lines = self.lines();
        let failed: Vec<Value> = lines.iter().filter(|(_, l)| l["ok"] != true).map(|(_, l)| l.clone()).collect();
        (lines.len() - failed.len(), failed)
    }

    /// The replies of successful exchanges read after `since`.
    pub(crate) fn replies_since(&self, since: Instant) -> Vec<String> {
        self.lines()
            .into_iter()
            .filter(|(t, l)| *t >= since && l["ok"] == true)
            .filter_map(|(_, l)| l["reply"].as_str().map(str::to_string))
            .collect()
    }

    /// Waits until `n` exchanges succeeded; returns the first reply.
    pub(crate) fn wait_answered(&self, n: usize) -> String {
        eventually(&format!("{} to get {n} answers", self.name), || {
            let r = self.replies();
            if r.len() >= n { Ok(r[0].clone()) } else { Err(self.lines().into_iter().map(|(_, l)| l).rev().take(3).collect::<Vec<_>>()) }
        })
    }

    /// The first failed exchange at or after `since`, when there is one.
    pub(crate) fn first_failure_since(&self, since: Instant) -> Option<(Duration, Value)> {
        self.lines().into_iter().find(|(t, l)| *t >= since && l["ok"] != true).map(|(t, l)| (t - since, l))
    }

    /// Waits for the probe to exit by itself; returns every line.
    pub(crate) fn finish(mut self) -> Vec<(Instant, Value)> {
        let deadline = Instant::now() + wait_limit() * 2;
        while self.probe.0.try_wait().ok().flatten().is_none() {
            assert!(
                Instant::now() < deadline,
                "{} did not finish; last lines {:?}",
                self.name,
                self.lines().iter().rev().take(3).collect::<Vec<_>>()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
        self.lines()
    }
}

/// The window the departure rules get to end a socket after the change
/// that calls for it: 1 s, grown with the tests' wait limit under `cargo
/// xtask vmtest`, whose CPU is emulated one to two orders of magnitude
/// slower (`TOPOPROXY_TEST_WAIT_SECS`, 30 s on a real CPU).
pub(crate) fn within() -> Duration {
    Duration::from_secs(1).mul_f64((wait_limit().as_secs_f64() / 30.0).max(1.0))
}

pub(crate) const ECONNABORTED: i64 = libc::ECONNABORTED as i64;
pub(crate) const ECONNRESET: i64 = libc::ECONNRESET as i64;

/// Whether a connected UDP socket's failure is the agent's abort: the
/// kernel's `udp_abort` reports ECONNABORTED to the next receive and
/// disconnects the socket, so a send that comes first fails with
/// EDESTADDRREQ (`udp_sendmsg` on a socket without a peer). Nothing else
/// in these tests disconnects a socket.
pub(crate) fn udp_aborted(failure: &Value) -> bool {
    matches!(failure["errno"].as_i64(), Some(e) if e == ECONNABORTED || e == i64::from(libc::EDESTADDRREQ))
}

/// `proxy-agent probe ARGS` as a pod of `node` (its cgroup) in `net`.
pub(crate) fn pod_probe(node: &Node, net: &Netns, args: &[&str]) -> Command {
    let mut cmd = command_in(agent_bin(), Some(net), Some(&node.cgroup)).expect("probe command");
    cmd.arg("probe").args(args);
    cmd
}

/// `BPF_MAP_CREATE` of a map of `map_type` (a `BPF_MAP_TYPE_*` number)
/// with the given sizes, capacity and flags, pinned at `path`
/// (`BPF_OBJ_PIN`): a map as an older build made it, for the upgrade
/// tests. Returns its descriptor; the pin keeps the map after it closes.
pub(crate) fn pin_new_map(
    path: &Path,
    map_type: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    map_flags: u32,
) -> std::os::fd::OwnedFd {
    use std::os::fd::FromRawFd;
    // Kernels before 5.11 charge map memory to RLIMIT_MEMLOCK (the agent
    // raises it for itself the same way); later ones ignore it.
    let unlimited = libc::rlimit { rlim_cur: libc::RLIM_INFINITY, rlim_max: libc::RLIM_INFINITY };
    // SAFETY: setrlimit reads one rlimit; failing leaves the limit as it was.
    let _ = unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &raw const unlimited) };
    #[repr(C)]
    struct CreateAttr {
        map_type: u32,
        key_size: u32,
        value_size: u32,
        max_entries: u32,
        map_flags: u32,
    }
    #[repr(C)]
    struct PinAttr {
        pathname: u64,
        bpf_fd: u32,
        file_flags: u32,
    }
    let attr = CreateAttr { map_type, key_size, value_size, max_entries, map_flags };
    // SAFETY: the first members of `union bpf_attr` for BPF_MAP_CREATE (0),
    // read by the kernel during the call.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, 0, std::ptr::from_ref(&attr), size_of::<CreateAttr>()) };
    assert!(fd >= 0, "BPF_MAP_CREATE: {}", std::io::Error::last_os_error());
    // SAFETY: the kernel returned a new descriptor that nobody else owns.
    let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) };
    let c_path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).expect("path");
    let pin = PinAttr { pathname: c_path.as_ptr() as u64, bpf_fd: std::os::fd::AsRawFd::as_raw_fd(&fd) as u32, file_flags: 0 };
    // SAFETY: BPF_OBJ_PIN (6) with a NUL-terminated path alive across the call.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, 6, std::ptr::from_ref(&pin), size_of::<PinAttr>()) };
    assert_eq!(rc, 0, "BPF_OBJ_PIN: {}", std::io::Error::last_os_error());
    fd
}
