//! A real Kubernetes control plane on loopback: etcd, kube-apiserver and
//! kube-controller-manager at the release pinned in `tools/k8s/go.mod`,
//! built by `cargo xtask k8s` (which `cargo xtask test` runs first), and
//! driven with kubectl. It is what [`crate::apiserver`] stands in for: here
//! the EndpointSlices come from the real EndpointSlice controller watching
//! Pods, and watches, bookmarks, 410s and restarts are the API server's own.
//!
//! There is no kubelet and no scheduler. A Pod is created already bound to
//! a Node (`spec.nodeName`; the EndpointSlice controller skips Pods whose
//! Node does not exist, so create the Nodes first) with a container that
//! never runs, and the test writes its status (phase, IPs, readiness)
//! through the status subresource, as a kubelet would. Without a kubelet
//! nothing finishes a graceful deletion either: a deleted Pod stays
//! terminating until it is force-deleted.
//!
//! The API server writes an audit log of watch requests only
//! ([`RealCluster::audit_log`]: each one's URI and client), so a test can
//! see how a client watches (its resourceVersion, `allowWatchBookmarks`).
//!
//! Everything listens on 127.0.0.1 only, on ports picked free at start;
//! keys, certificates (made with the `openssl` CLI), kubeconfigs, etcd's
//! data and the components' logs live in one temporary directory. Dropping
//! the [`RealCluster`] kills the components' process groups and removes the
//! directory; when the thread is panicking (a failed test), the three logs
//! are first copied to `target/tmp/real-cluster/<name>-<pid>/` and that path
//! is printed. A run killed before it could clean up is swept by the next
//! one (its directory names the process id).
//!
//! The binaries are found in `$TOPOPROXY_K8S_BIN`, else in
//! `<workspace>/target/k8s/<version>/`.

use std::fs;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// The directory with etcd, kube-apiserver, kube-controller-manager and
/// kubectl (`cargo xtask test` sets it).
pub const BIN_ENV: &str = "TOPOPROXY_K8S_BIN";

/// The binaries a cluster needs.
pub const BINARIES: [&str; 4] = ["etcd", "kube-apiserver", "kube-controller-manager", "kubectl"];

/// The API server's `--service-cluster-ip-range`: ClusterIPs the tests
/// choose must be in it.
pub const SERVICE_CIDR: &str = "10.96.0.0/16";

/// The controllers kube-controller-manager runs: the two that write
/// EndpointSlices, and what namespaces and ServiceAccounts (Pods need their
/// namespace's `default` one) and the controllers' own credentials need.
pub const CONTROLLERS: &str = "endpointslice-controller,endpointslice-mirroring-controller,namespace-controller,\
                               serviceaccount-controller,serviceaccount-token-controller";

/// How long a component may take to become ready (a cold kube-apiserver
/// takes a few seconds; much more under a loaded machine).
const START_LIMIT: Duration = Duration::from_mins(2);

/// Temporary directories are `PREFIX-PID-N-NAME`.
const PREFIX: &str = "topoproxy-k8s";

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// The workspace root (test-support's parent).
fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}

fn other(msg: impl Into<String>) -> io::Error {
    io::Error::other(msg.into())
}

/// The k8s.io/kubernetes version pinned in `tools/k8s/go.mod` (`v1.37.2`).
pub fn pinned_version() -> io::Result<String> {
    let path = workspace_root().join("tools/k8s/go.mod");
    let text = fs::read_to_string(&path).map_err(|e| other(format!("reading {}: {e}", path.display())))?;
    text.lines()
        .find_map(|l| {
            let mut words = l.trim_start_matches("require").split_whitespace();
            (words.next() == Some("k8s.io/kubernetes")).then(|| words.next()).flatten().map(str::to_string)
        })
        .ok_or_else(|| other(format!("no k8s.io/kubernetes requirement in {}", path.display())))
}

/// Where the binaries are: `$TOPOPROXY_K8S_BIN`, else
/// `<workspace>/target/k8s/<version>/`; an error saying how to build them
/// when one is missing.
pub fn bin_dir() -> io::Result<PathBuf> {
    let dir = match std::env::var_os(BIN_ENV).filter(|d| !d.is_empty()) {
        Some(d) => PathBuf::from(d),
        None => workspace_root().join("target/k8s").join(pinned_version()?),
    };
    check_bin_dir(dir)
}

/// Prometheus Operator's ServiceMonitor CustomResourceDefinition, which
/// `cargo xtask k8s` keeps beside the binaries: the chart's `auto`
/// ServiceMonitor is rendered once a real API server serves it.
pub fn service_monitor_crd() -> io::Result<PathBuf> {
    let crd = bin_dir()?.join("monitoring.coreos.com_servicemonitors.yaml");
    if !crd.is_file() {
        return Err(other(format!("{} is missing: `cargo xtask k8s` fetches it from Prometheus Operator's Go module", crd.display())));
    }
    Ok(crd)
}

/// `dir` when it holds every binary of [`BINARIES`].
fn check_bin_dir(dir: PathBuf) -> io::Result<PathBuf> {
    let missing: Vec<&str> = BINARIES.iter().copied().filter(|b| !dir.join(b).is_file()).collect();
    if !missing.is_empty() {
        return Err(other(format!(
            "{} missing from {}: the real-API-server tests run the Kubernetes control plane pinned in tools/k8s/go.mod; \
             build it with `cargo xtask k8s` (needs Go; `cargo xtask test` does it first), or point {BIN_ENV} at a \
             directory holding {}",
            missing.join(", "),
            dir.display(),
            BINARIES.join(", ")
        )));
    }
    Ok(dir)
}

/// One running component: its process (the leader of its own process
/// group) and its log.
struct Proc {
    child: Child,
    log: PathBuf,
    name: &'static str,
}

impl Proc {
    fn signal(&self, sig: libc::c_int) {
        if let Ok(pid) = i32::try_from(self.child.id()) {
            // SAFETY: kill(2) on the process group our child leads.
            unsafe { libc::kill(-pid, sig) };
        }
    }

    /// SIGTERM to the group, SIGKILL after `grace`; reaped either way.
    fn stop(mut self, grace: Duration) {
        if !grace.is_zero() {
            self.signal(libc::SIGTERM);
            let deadline = Instant::now() + grace;
            while Instant::now() < deadline && matches!(self.child.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        self.signal(libc::SIGKILL);
        let _ = self.child.wait();
    }

    /// `Err` with the end of the log when the process has exited.
    fn check_running(&mut self) -> io::Result<()> {
        match self.child.try_wait()? {
            None => Ok(()),
            Some(status) => Err(other(format!("{} exited ({status}); the end of its log:\n{}", self.name, log_tail(&self.log, 30)))),
        }
    }
}

fn log_tail(log: &Path, lines: usize) -> String {
    let text = fs::read_to_string(log).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// kubectl with a kubeconfig, its cache inside the cluster's directory.
struct Kubectl {
    bin: PathBuf,
    kubeconfig: PathBuf,
    cache: PathBuf,
}

impl Kubectl {
    fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new(&self.bin);
        c.arg(format!("--kubeconfig={}", self.kubeconfig.display())).arg(format!("--cache-dir={}", self.cache.display())).args(args);
        c
    }

    /// Runs kubectl with `stdin`; its stdout, or an error with its stderr.
    fn run(&self, args: &[&str], stdin: Option<&str>) -> io::Result<String> {
        let mut c = self.command(args);
        c.stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() }).stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = c.spawn().map_err(|e| other(format!("cannot run {}: {e}", self.bin.display())))?;
        if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
            pipe.write_all(text.as_bytes())?;
        }
        let out = child.wait_with_output()?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(other(format!("kubectl {} failed ({}): {}", args.join(" "), out.status, String::from_utf8_lossy(&out.stderr).trim())))
        }
    }
}

/// Loopback ports, picked free at start and kept for the cluster's life
/// (the API server comes back on the same one after a restart).
#[derive(Clone, Copy, Debug)]
struct Ports {
    etcd_client: u16,
    etcd_peer: u16,
    apiserver: u16,
    kcm: u16,
}

impl Ports {
    /// Four free ports below the kernel's ephemeral range, when it leaves
    /// room: the kernel never hands those out by itself (to an outgoing
    /// connection, or a `bind` to port 0, such as another test's server),
    /// so a port stays free between this check and the component's bind,
    /// and across an API server restart. Ports handed to other clusters
    /// of this process are not reused.
    fn pick() -> io::Result<Ports> {
        static HANDED_OUT: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
        let mut handed_out = HANDED_OUT.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let ephemeral_low = fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            .ok()
            .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
            .unwrap_or(32768);
        let mut ports = Vec::new();
        if ephemeral_low > 11000 {
            let (low, span) = (10000u32, u32::from(ephemeral_low) - 10000);
            // A start that differs between processes and runs.
            let seed =
                std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos()) ^ std::process::id();
            for i in 0..span {
                let port = (low + (seed.wrapping_add(i.wrapping_mul(7919))) % span) as u16;
                if !handed_out.contains(&port) && !ports.contains(&port) && TcpListener::bind(("127.0.0.1", port)).is_ok() {
                    ports.push(port);
                    if ports.len() == 4 {
                        break;
                    }
                }
            }
        }
        if ports.len() < 4 {
            // The kernel's choice, all bound at once so that they differ.
            let listeners = (0..4).map(|_| TcpListener::bind("127.0.0.1:0")).collect::<io::Result<Vec<_>>>()?;
            ports = listeners.iter().map(|l| l.local_addr().map(|a| a.port())).collect::<io::Result<Vec<u16>>>()?;
        }
        handed_out.extend_from_slice(&ports);
        Ok(Ports { etcd_client: ports[0], etcd_peer: ports[1], apiserver: ports[2], kcm: ports[3] })
    }
}

/// etcd, kube-apiserver and kube-controller-manager on 127.0.0.1; see the
/// module documentation.
pub struct RealCluster {
    name: String,
    bin: PathBuf,
    dir: PathBuf,
    ports: Ports,
    kubectl: Kubectl,
    etcd: Option<Proc>,
    apiserver: Option<Proc>,
    kcm: Option<Proc>,
    /// Arguments kube-controller-manager gets besides the harness's own.
    kcm_extra: Vec<String>,
}

/// A Pod for [`RealCluster::create_pods`]: bound to `node`, with status
/// Running, `ip` and Ready `ready`.
#[derive(Clone, Debug)]
pub struct PodSpec<'a> {
    pub name: &'a str,
    pub node: &'a str,
    pub ip: &'a str,
    pub labels: &'a [(&'a str, &'a str)],
    pub ready: bool,
}

impl RealCluster {
    /// Starts etcd, kube-apiserver (waits for /readyz) and
    /// kube-controller-manager (waits for the `default` ServiceAccount).
    /// `name` names the temporary directory and the saved logs.
    pub fn start(name: &str) -> io::Result<RealCluster> {
        Self::start_with(name, &[])
    }

    /// [`start`](Self::start) with more kube-controller-manager arguments,
    /// e.g. `--endpointslice-updates-batch-period=2s`, which makes the
    /// EndpointSlice controller gather the Pod changes of that period into
    /// one sync.
    pub fn start_with(name: &str, controller_args: &[&str]) -> io::Result<RealCluster> {
        let bin = bin_dir()?;
        sweep();
        let dir = std::env::temp_dir().join(format!("{PREFIX}-{}-{}-{name}", std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed)));
        for sub in ["pki", "logs", "kubectl-cache"] {
            fs::create_dir_all(dir.join(sub))?;
        }
        let kubectl = Kubectl { bin: bin.join("kubectl"), kubeconfig: dir.join("admin.kubeconfig"), cache: dir.join("kubectl-cache") };
        let mut cluster = RealCluster {
            name: name.to_string(),
            bin,
            dir,
            ports: Ports::pick()?,
            kubectl,
            etcd: None,
            apiserver: None,
            kcm: None,
            kcm_extra: controller_args.iter().map(|a| (*a).to_string()).collect(),
        };
        match cluster.boot() {
            Ok(()) => Ok(cluster),
            Err(e) => {
                let logs = cluster.save_logs();
                Err(io::Error::new(e.kind(), format!("starting the real cluster {name}: {e} (logs copied to {})", logs.display())))
            }
        }
    }

    fn boot(&mut self) -> io::Result<()> {
        let started = Instant::now();
        self.make_pki()?;
        for (user, file) in [("admin", "admin.kubeconfig"), ("kcm", "kcm.kubeconfig")] {
            let pki = self.dir.join("pki");
            let creds = format!(
                "    client-certificate: {}\n    client-key: {}\n",
                pki.join(format!("{user}.crt")).display(),
                pki.join(format!("{user}.key")).display()
            );
            fs::write(self.dir.join(file), self.kubeconfig_text(user, &creds))?;
        }
        self.start_etcd()?;
        self.start_apiserver()?;
        self.start_kcm()?;
        eprintln!(
            "real cluster {}: up in {:.1} s: kube-apiserver {}, etcd {}, admin kubeconfig {}",
            self.name,
            started.elapsed().as_secs_f64(),
            self.apiserver_url(),
            self.etcd_url(),
            self.admin_kubeconfig().display()
        );
        Ok(())
    }

    /// A CA; the API server's serving certificate for 127.0.0.1 and
    /// localhost (and the in-cluster names); client certificates for the
    /// admin (O=system:masters) and kube-controller-manager; the
    /// ServiceAccount token signing key pair.
    fn make_pki(&self) -> io::Result<()> {
        let pki = self.dir.join("pki");
        // Arguments separated by spaces (none of them has one).
        let openssl = |args: &str| -> io::Result<()> {
            let out = Command::new("openssl")
                .args(args.split_whitespace())
                .current_dir(&pki)
                .stdin(Stdio::null())
                .output()
                .map_err(|e| other(format!("cannot run openssl (the real cluster makes its certificates with it): {e}")))?;
            if out.status.success() {
                Ok(())
            } else {
                Err(other(format!("openssl {args} failed: {}", String::from_utf8_lossy(&out.stderr).trim())))
            }
        };
        openssl("req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 30 -subj /CN=topoproxy-test-ca")?;
        let sign = |name: &str, subject: &str, ext: &str| -> io::Result<()> {
            openssl(&format!("req -newkey rsa:2048 -nodes -keyout {name}.key -out {name}.csr -subj {subject}"))?;
            fs::write(pki.join(format!("{name}.ext")), ext)?;
            openssl(&format!(
                "x509 -req -in {name}.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out {name}.crt -days 30 -extfile {name}.ext"
            ))
        };
        sign(
            "apiserver",
            "/CN=kube-apiserver",
            "subjectAltName=IP:127.0.0.1,DNS:localhost,IP:10.96.0.1,DNS:kubernetes,DNS:kubernetes.default,\
             DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local\n\
             extendedKeyUsage=serverAuth\nkeyUsage=digitalSignature,keyEncipherment\n",
        )?;
        sign("admin", "/O=system:masters/CN=topoproxy-test-admin", "extendedKeyUsage=clientAuth\n")?;
        sign("kcm", "/CN=system:kube-controller-manager", "extendedKeyUsage=clientAuth\n")?;
        openssl("genrsa -out sa.key 2048")?;
        openssl("rsa -in sa.key -pubout -out sa.pub")
    }

    /// A kubeconfig for the API server with `credentials` (the `user:`
    /// fields, indented).
    fn kubeconfig_text(&self, user: &str, credentials: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: real-cluster\n  cluster:\n    server: {}\n    certificate-authority: {}\n\
             users:\n- name: {user}\n  user:\n{credentials}contexts:\n- name: {user}\n  context:\n    cluster: real-cluster\n    user: {user}\n\
             current-context: {user}\n",
            self.apiserver_url(),
            self.dir.join("pki/ca.crt").display()
        )
    }

    /// Starts `bin` with `args` in a process group of its own, appending
    /// to its log; the pid is noted for the sweep of a killed run.
    fn spawn(&self, name: &'static str, args: &[String]) -> io::Result<Proc> {
        let log = self.dir.join("logs").join(format!("{name}.log"));
        let file = fs::OpenOptions::new().create(true).append(true).open(&log)?;
        let child = Command::new(self.bin.join(name))
            .args(args)
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file)
            .process_group(0)
            .spawn()
            .map_err(|e| other(format!("cannot start {}: {e}", self.bin.join(name).display())))?;
        let mut pids = fs::OpenOptions::new().create(true).append(true).open(self.dir.join("pids"))?;
        writeln!(pids, "{}", child.id())?;
        Ok(Proc { child, log, name })
    }

    fn start_etcd(&mut self) -> io::Result<()> {
        let Ports { etcd_client: c, etcd_peer: p, .. } = self.ports;
        let data = self.dir.join("etcd-data");
        let args = [
            "--name=real-cluster".to_string(),
            format!("--data-dir={}", data.display()),
            format!("--listen-client-urls=http://127.0.0.1:{c}"),
            format!("--advertise-client-urls=http://127.0.0.1:{c}"),
            format!("--listen-peer-urls=http://127.0.0.1:{p}"),
            format!("--initial-advertise-peer-urls=http://127.0.0.1:{p}"),
            format!("--initial-cluster=real-cluster=http://127.0.0.1:{p}"),
            "--initial-cluster-state=new".to_string(),
            // Throwaway data: no fsync per write, which a loaded CI disk
            // would make slow.
            "--unsafe-no-fsync=true".to_string(),
            "--log-level=warn".to_string(),
        ];
        let mut etcd = self.spawn("etcd", &args)?;
        let addr = SocketAddr::from(([127, 0, 0, 1], c));
        let result = wait_until("etcd's /health", &mut etcd, || match crate::http::http_get(addr, "/health") {
            Ok((200, body)) if body.contains("true") => Ok(()),
            other => Err(format!("{other:?}")),
        });
        self.etcd = Some(etcd);
        result
    }

    /// Starts kube-apiserver on its port and waits for /readyz.
    pub fn start_apiserver(&mut self) -> io::Result<()> {
        if self.apiserver.is_some() {
            return Err(other("kube-apiserver is already running"));
        }
        let pki = self.dir.join("pki");
        let f = |name: &str| pki.join(name).display().to_string();
        let policy = self.dir.join("audit-policy.yaml");
        fs::write(&policy, AUDIT_POLICY)?;
        let args = [
            "--bind-address=127.0.0.1".to_string(),
            "--advertise-address=127.0.0.1".to_string(),
            format!("--secure-port={}", self.ports.apiserver),
            format!("--etcd-servers={}", self.etcd_url()),
            format!("--tls-cert-file={}", f("apiserver.crt")),
            format!("--tls-private-key-file={}", f("apiserver.key")),
            format!("--client-ca-file={}", f("ca.crt")),
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local".to_string(),
            format!("--service-account-key-file={}", f("sa.pub")),
            format!("--service-account-signing-key-file={}", f("sa.key")),
            "--authorization-mode=Node,RBAC".to_string(),
            // The default reconciler would publish the advertise address
            // (127.0.0.1) as the `kubernetes` Service's endpoint, which the
            // API server refuses for loopback.
            "--endpoint-reconciler-type=none".to_string(),
            format!("--service-cluster-ip-range={SERVICE_CIDR}"),
            format!("--cert-dir={}", self.dir.join("apiserver-certs").display()),
            // On SIGTERM, end the open watches (clients see them close, as
            // in a rolling upgrade) instead of waiting for them to time out:
            // by default the HTTP/2 server keeps them for its 60 s
            // shutdown timeout.
            "--shutdown-watch-termination-grace-period=5s".to_string(),
            // Every watch request (its URI, its user) in logs/audit.log:
            // what the tests read to see how clients watch.
            format!("--audit-policy-file={}", policy.display()),
            format!("--audit-log-path={}", self.dir.join("logs/audit.log").display()),
        ];
        let mut apiserver = self.spawn("kube-apiserver", &args)?;
        let kubectl = &self.kubectl;
        let result = wait_until("kube-apiserver's /readyz", &mut apiserver, || kubectl.run(&["get", "--raw", "/readyz"], None));
        self.apiserver = Some(apiserver);
        result
    }

    /// Stops kube-apiserver as a rolling upgrade does: SIGTERM, open
    /// watches ended within 5 s, SIGKILL after 30 s.
    /// [`start_apiserver`](Self::start_apiserver) brings it back on the
    /// same port.
    pub fn stop_apiserver(&mut self) {
        if let Some(p) = self.apiserver.take() {
            p.stop(Duration::from_secs(30));
        }
    }

    /// Stops kube-apiserver and starts it again on the same port; returns
    /// once it is ready. Watches end; clients resume from their versions.
    pub fn restart_apiserver(&mut self) -> io::Result<()> {
        self.stop_apiserver();
        let log = self.dir.join("logs/kube-apiserver.log");
        if let Ok(mut f) = fs::OpenOptions::new().append(true).open(log) {
            let _ = writeln!(f, "---- restarted by the test ----");
        }
        self.start_apiserver()
    }

    /// Freezes kube-controller-manager (SIGSTOP to its process group)
    /// until the guard drops (SIGCONT). The watch events of what is
    /// written meanwhile queue in its sockets and reach its informers
    /// together when it goes on, so changes made back to back land in one
    /// controller sync however slow the machine is: the EndpointSlice
    /// controller's batch timer (`--endpointslice-updates-batch-period`)
    /// starts at the first of them. Its leader lease (15 s) outlives a
    /// short pause.
    pub fn pause_controllers(&self) -> ControllersPaused<'_> {
        if let Some(p) = &self.kcm {
            p.signal(libc::SIGSTOP);
        }
        ControllersPaused { cluster: self }
    }

    fn start_kcm(&mut self) -> io::Result<()> {
        let pki = self.dir.join("pki");
        let args = [
            format!("--kubeconfig={}", self.dir.join("kcm.kubeconfig").display()),
            "--bind-address=127.0.0.1".to_string(),
            format!("--secure-port={}", self.ports.kcm),
            format!("--cert-dir={}", self.dir.join("kcm-certs").display()),
            format!("--controllers={CONTROLLERS}"),
            format!("--service-account-private-key-file={}", pki.join("sa.key").display()),
            format!("--root-ca-file={}", pki.join("ca.crt").display()),
            "--use-service-account-credentials=true".to_string(),
            "--leader-elect=false".to_string(),
        ];
        let args: Vec<String> = args.into_iter().chain(self.kcm_extra.iter().cloned()).collect();
        let mut kcm = self.spawn("kube-controller-manager", &args)?;
        let kubectl = &self.kubectl;
        let result = wait_until("the default ServiceAccount", &mut kcm, || {
            kubectl.run(&["-n", "default", "get", "serviceaccount", "default", "-o", "name"], None)
        });
        self.kcm = Some(kcm);
        result
    }

    /// The admin's kubeconfig (client certificate in system:masters).
    pub fn admin_kubeconfig(&self) -> &Path {
        &self.kubectl.kubeconfig
    }

    /// `https://127.0.0.1:PORT`.
    pub fn apiserver_url(&self) -> String {
        format!("https://127.0.0.1:{}", self.ports.apiserver)
    }

    /// etcd's client URL, `http://127.0.0.1:PORT`.
    pub fn etcd_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.ports.etcd_client)
    }

    /// kubectl as the admin: its stdout, or an error with its stderr.
    pub fn kubectl(&self, args: &[&str]) -> io::Result<String> {
        self.kubectl.run(args, None)
    }

    /// `kubectl apply -f -` of YAML or JSON (several documents allowed).
    pub fn apply(&self, yaml: &str) -> io::Result<String> {
        self.kubectl.run(&["apply", "-f", "-"], Some(yaml))
    }

    /// A Node with `labels` and `kubernetes.io/hostname: NAME` (as a
    /// kubelet registers it; no status).
    pub fn create_node(&self, name: &str, labels: &[(&str, &str)]) -> io::Result<()> {
        let mut l = serde_json::Map::new();
        l.insert("kubernetes.io/hostname".into(), name.into());
        for (k, v) in labels {
            l.insert((*k).into(), (*v).into());
        }
        self.apply(&json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": l}}).to_string()).map(drop)
    }

    /// A namespace, once its `default` ServiceAccount exists (Pods cannot
    /// be created before).
    pub fn create_namespace(&self, ns: &str) -> io::Result<()> {
        self.apply(&json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}).to_string())?;
        let deadline = Instant::now() + START_LIMIT;
        loop {
            match self.kubectl(&["-n", ns, "get", "serviceaccount", "default", "-o", "name"]) {
                Ok(_) => return Ok(()),
                Err(e) if Instant::now() > deadline => return Err(e),
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    }

    /// A Pod bound to `node` (its container, image "pause", never runs),
    /// then its status as a kubelet would write it: Running, `pod_ip`,
    /// Ready and ContainersReady `ready`.
    pub fn create_pod(&self, ns: &str, name: &str, node: &str, pod_ip: &str, labels: &[(&str, &str)], ready: bool) -> io::Result<()> {
        let labels: serde_json::Map<String, Value> = labels.iter().map(|(k, v)| ((*k).to_string(), Value::from(*v))).collect();
        let pod = json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "labels": labels},
            "spec": {"nodeName": node, "containers": [{"name": "app", "image": "pause"}]},
        });
        self.apply(&pod.to_string())?;
        let status = json!({"status": {
            "phase": "Running",
            "podIP": pod_ip,
            "podIPs": [{"ip": pod_ip}],
            "conditions": pod_conditions(ready),
        }});
        self.patch_pod_status(ns, name, &status)
    }

    /// Sets a Pod's Ready and ContainersReady conditions.
    pub fn set_ready(&self, ns: &str, name: &str, ready: bool) -> io::Result<()> {
        self.patch_pod_status(ns, name, &json!({"status": {"conditions": pod_conditions(ready)}}))
    }

    fn patch_pod_status(&self, ns: &str, name: &str, patch: &Value) -> io::Result<()> {
        self.kubectl(&["-n", ns, "patch", "pod", name, "--subresource=status", "--type=merge", "-p", &patch.to_string()]).map(drop)
    }

    /// Deletes a Pod gracefully and returns at once: with no kubelet to
    /// finish the deletion, it stays terminating (its endpoints
    /// `terminating: true`) until [`force_delete_pod`](Self::force_delete_pod).
    /// kubectl turns a grace period of 0 into 1 without `--force`.
    pub fn delete_pod(&self, ns: &str, name: &str, grace_secs: u32) -> io::Result<()> {
        self.kubectl(&["-n", ns, "delete", "pod", name, &format!("--grace-period={grace_secs}"), "--wait=false"]).map(drop)
    }

    /// Removes a Pod at once, terminating or not (what a kubelet's final
    /// delete, or `--force`, does).
    pub fn force_delete_pod(&self, ns: &str, name: &str) -> io::Result<()> {
        self.kubectl(&["-n", ns, "delete", "pod", name, "--grace-period=0", "--force", "--wait=false"]).map(drop)
    }

    /// Creates many Pods with two kubectl runs (the objects, then their
    /// statuses, both by server-side apply of one List), as
    /// [`create_pod`](Self::create_pod) does for one.
    pub fn create_pods(&self, ns: &str, pods: &[PodSpec<'_>]) -> io::Result<()> {
        let list = |items: Vec<Value>| json!({"apiVersion": "v1", "kind": "List", "items": items}).to_string();
        let objects = pods
            .iter()
            .map(|p| {
                let labels: serde_json::Map<String, Value> = p.labels.iter().map(|(k, v)| ((*k).to_string(), Value::from(*v))).collect();
                json!({
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": p.name, "namespace": ns, "labels": labels},
                    "spec": {"nodeName": p.node, "containers": [{"name": "app", "image": "pause"}]},
                })
            })
            .collect();
        self.kubectl.run(&["apply", "--server-side", "--field-manager=topoproxy-test", "-f", "-"], Some(&list(objects)))?;
        let statuses = pods
            .iter()
            .map(|p| {
                json!({
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": p.name, "namespace": ns},
                    "status": {"phase": "Running", "podIP": p.ip, "podIPs": [{"ip": p.ip}], "conditions": pod_conditions(p.ready)},
                })
            })
            .collect();
        self.kubectl
            .run(
                &[
                    "apply",
                    "--server-side",
                    "--force-conflicts",
                    "--subresource=status",
                    "--field-manager=topoproxy-test-kubelet",
                    "-f",
                    "-",
                ],
                Some(&list(statuses)),
            )
            .map(drop)
    }

    /// Removes Pods at once with one kubectl run, as
    /// [`force_delete_pod`](Self::force_delete_pod) does for one.
    pub fn force_delete_pods(&self, ns: &str, names: &[&str]) -> io::Result<()> {
        let mut args = vec!["-n", ns, "delete", "pod"];
        args.extend_from_slice(names);
        args.extend_from_slice(&["--grace-period=0", "--force", "--wait=false"]);
        self.kubectl(&args).map(drop)
    }

    /// kubectl as the admin, not started: for a command that runs in the
    /// background (`get --watch`). The caller sets its standard streams.
    pub fn kubectl_command(&self, args: &[&str]) -> Command {
        self.kubectl.command(args)
    }

    /// The API server's audit log so far: one JSON line per watch request
    /// (stages ResponseStarted and ResponseComplete), with its
    /// `requestURI` and `user`. Kept across restarts.
    pub fn audit_log(&self) -> String {
        fs::read_to_string(self.dir.join("logs/audit.log")).unwrap_or_default()
    }

    /// The EndpointSlices of Service `service` (a List; `items`).
    pub fn endpoint_slices(&self, ns: &str, service: &str) -> io::Result<Value> {
        let out =
            self.kubectl(&["-n", ns, "get", "endpointslices", "-l", &format!("kubernetes.io/service-name={service}"), "-o", "json"])?;
        serde_json::from_str(&out).map_err(|e| other(format!("kubectl printed no JSON ({e}): {out}")))
    }

    /// Compacts etcd to its current revision (physically) and returns that
    /// revision: from then on etcd refuses reads and watches at older
    /// revisions ("required revision has been compacted"), which the API
    /// server answers with 410 Gone when a request reaches etcd. Its watch
    /// cache still serves watches from versions it holds (with v1.37.2, a
    /// watch from just before the compaction stays open); after
    /// [`restart_apiserver`](Self::restart_apiserver) the cache starts at
    /// the current revision and such a watch gets a 410 ERROR event ("too
    /// old resource version"). Uses etcd's gRPC gateway (JSON over HTTP on
    /// the client port).
    pub fn compact_etcd(&self) -> io::Result<u64> {
        let addr = SocketAddr::from(([127, 0, 0, 1], self.ports.etcd_client));
        // A range over one key, only for the header's revision.
        let range = http_post_json(addr, "/v3/kv/range", &json!({"key": "AA==", "limit": "1"}))?;
        let revision = range["header"]["revision"]
            .as_str()
            .and_then(|r| r.parse::<u64>().ok())
            .ok_or_else(|| other(format!("etcd's range answer has no header.revision: {range}")))?;
        http_post_json(addr, "/v3/kv/compaction", &json!({"revision": revision.to_string(), "physical": true}))?;
        Ok(revision)
    }

    /// Writes to `path` a kubeconfig that authenticates as ServiceAccount
    /// `ns/sa` (created when missing) with a token from `kubectl create
    /// token` (valid for 2 hours). What the ServiceAccount may do is up to
    /// the RBAC objects the test applies.
    pub fn service_account_kubeconfig(&self, ns: &str, sa: &str, path: &Path) -> io::Result<()> {
        self.apply(&json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": sa, "namespace": ns}}).to_string())?;
        let token = self.kubectl(&["-n", ns, "create", "token", sa, "--duration=2h"])?;
        let token = token.trim();
        if token.is_empty() {
            return Err(other(format!("kubectl create token {sa} printed nothing")));
        }
        fs::write(path, self.kubeconfig_text(&format!("{ns}-{sa}"), &format!("    token: {token}\n")))
    }

    /// Copies the components' logs to `target/tmp/real-cluster/NAME-PID/`
    /// and returns that directory.
    fn save_logs(&self) -> PathBuf {
        let dest = workspace_root().join("target/tmp/real-cluster").join(format!("{}-{}", self.name, std::process::id()));
        let _ = fs::create_dir_all(&dest);
        if let Ok(rd) = fs::read_dir(self.dir.join("logs")) {
            for e in rd.flatten() {
                let _ = fs::copy(e.path(), dest.join(e.file_name()));
            }
        }
        dest
    }
}

impl Drop for RealCluster {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let logs = self.save_logs();
            eprintln!("real cluster {}: logs of etcd, kube-apiserver and kube-controller-manager in {}", self.name, logs.display());
        }
        // Nothing of the cluster outlives it, so no grace.
        for p in [self.kcm.take(), self.apiserver.take(), self.etcd.take()].into_iter().flatten() {
            p.stop(Duration::ZERO);
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// kube-controller-manager frozen by
/// [`RealCluster::pause_controllers`]; it goes on when this drops.
pub struct ControllersPaused<'a> {
    cluster: &'a RealCluster,
}

impl Drop for ControllersPaused<'_> {
    fn drop(&mut self) {
        if let Some(p) = &self.cluster.kcm {
            p.signal(libc::SIGCONT);
        }
    }
}

/// What the API server audits: watch requests only, without their
/// bodies.
const AUDIT_POLICY: &str = "apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
- level: Metadata
  verbs: [watch]
- level: None
";

/// The conditions a kubelet reports for a running Pod.
fn pod_conditions(ready: bool) -> Value {
    let s = if ready { "True" } else { "False" };
    json!([
        {"type": "PodScheduled", "status": "True"},
        {"type": "Initialized", "status": "True"},
        {"type": "ContainersReady", "status": s},
        {"type": "Ready", "status": s},
    ])
}

/// Polls `check` until it succeeds, failing early when `proc` exits and
/// after [`START_LIMIT`].
fn wait_until<T, E: std::fmt::Display>(what: &str, proc: &mut Proc, mut check: impl FnMut() -> Result<T, E>) -> io::Result<()> {
    let deadline = Instant::now() + START_LIMIT;
    loop {
        let last = match check() {
            Ok(_) => return Ok(()),
            Err(e) => e.to_string(),
        };
        proc.check_running().map_err(|e| other(format!("waiting for {what}: {e}")))?;
        if Instant::now() > deadline {
            return Err(other(format!(
                "{what} not ready after {} s (last: {last}); the end of {}'s log:\n{}",
                START_LIMIT.as_secs(),
                proc.name,
                log_tail(&proc.log, 30)
            )));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// POSTs JSON over HTTP/1.0 (the server closes after answering) and
/// returns the JSON answer of a 200.
fn http_post_json(addr: SocketAddr, path: &str, body: &Value) -> io::Result<Value> {
    let body = body.to_string();
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(s, "POST {path} HTTP/1.0\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len())?;
    let mut answer = String::new();
    s.read_to_string(&mut answer)?;
    let status = answer.split_whitespace().nth(1).unwrap_or_default();
    let text = answer.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    if status != "200" {
        return Err(other(format!("POST {path} to etcd: HTTP {status}: {text}")));
    }
    serde_json::from_str(text).map_err(|e| other(format!("POST {path} to etcd: not JSON ({e}): {text}")))
}

/// Removes what runs of killed test processes left: the process groups
/// they started (when still running one of that directory's components)
/// and their directories.
fn sweep() {
    let Ok(rd) = fs::read_dir(std::env::temp_dir()) else { return };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name.strip_prefix(PREFIX).and_then(|r| r.strip_prefix('-')).and_then(|r| r.split('-').next()?.parse::<u32>().ok())
        else {
            continue;
        };
        if pid == std::process::id() || Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        let dir = e.path();
        let marker = dir.display().to_string();
        for leader in fs::read_to_string(dir.join("pids")).unwrap_or_default().lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
            let cmdline = fs::read(format!("/proc/{leader}/cmdline")).unwrap_or_default();
            if String::from_utf8_lossy(&cmdline).contains(&marker) {
                // SAFETY: kill(2) on a process group this module started
                // (its leader's arguments name the stale directory).
                unsafe { libc::kill(-leader, libc::SIGKILL) };
            }
        }
        let _ = fs::remove_dir_all(&dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pinned_version_is_read_from_go_mod() {
        assert!(pinned_version().unwrap().starts_with("v1."));
    }

    #[test]
    fn a_missing_binary_directory_says_how_to_build_it() {
        let e = check_bin_dir(PathBuf::from("/nonexistent/k8s-bin")).unwrap_err().to_string();
        assert!(e.contains("cargo xtask k8s") && e.contains("kube-apiserver"), "{e}");
    }

    #[test]
    fn pod_conditions_follow_readiness() {
        for (ready, s) in [(true, "True"), (false, "False")] {
            let c = pod_conditions(ready);
            let by_type = |t: &str| c.as_array().unwrap().iter().find(|x| x["type"] == t).unwrap()["status"].clone();
            assert_eq!(by_type("Ready"), s);
            assert_eq!(by_type("ContainersReady"), s);
            assert_eq!(by_type("PodScheduled"), "True");
        }
    }
}
