//! One Kubernetes node on this machine, inside namespaces of its own, for
//! upstream's e2e tests: etcd, kube-apiserver, kube-controller-manager,
//! kube-scheduler, containerd and kubelet, all in
//!
//! - a network namespace `tpe2e-PID` with loopback and one veth pair whose
//!   both ends stay inside it (`node0` carries the node's address,
//!   [`NODE_IP`]). Nothing links it to the host's namespace and it has no
//!   default route, so a ClusterIP that the agent fails to translate ends
//!   in "network unreachable" and never leaves the machine. The CNI bridge
//!   plugin puts the pods on `cni0` in this namespace.
//! - a mount namespace of its own, kept by a bind mount of its nsfs file:
//!   private towards the host, shared inside (kubelet's Bidirectional and
//!   HostToContainer volumes need a shared mount). Fresh tmpfs over `/run`
//!   and `/var/lib` there, because containerd, its CNI cache and kubelet's
//!   device-plugin socket write to fixed paths below them. Every mount that
//!   containerd and kubelet make (overlay snapshots, volumes, network
//!   namespaces of pods) lives in it and goes when it goes.
//! - a cgroup `topoproxy-e2e-PID` in every hierarchy. Kubelet's
//!   `cgroupRoot`: the pods' cgroups are below it, and runc puts the
//!   containers at the same path in the cgroup v2 hierarchy too (hybrid
//!   layout). The node's own processes are in its `node` child there. The
//!   agent attaches its socket programs to it, so every process of the
//!   node, and nothing else on the machine, gets its translations.
//!
//! Everything else (keys, configuration, containerd's and kubelet's state,
//! the logs) is in `/tmp/tpe2e-PID` (short: unix socket paths are limited
//! to 108 bytes). [`Node::drop`] kills every process of the cgroup, lets go
//! of the mount namespace, deletes the network namespace, removes the
//! cgroups and the directory; [`sweep`] does the same for a run that was
//! killed before it could.

use std::fs;
use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// The node's address, on `node0` inside the namespace.
pub(crate) const NODE_IP: &str = "10.250.0.2";
/// The node's name (kubelet's `--hostname-override`).
pub(crate) const NODE_NAME: &str = "tpe2e-node";
/// The API server's port on [`NODE_IP`].
pub(crate) const APISERVER_PORT: u16 = 6443;
/// `--service-cluster-ip-range`; the `kubernetes` Service is its first address.
const SERVICE_CIDR: &str = "10.96.0.0/16";
/// The cluster DNS Service's ClusterIP (kubelet's `clusterDNS`).
pub(crate) const DNS_IP: &str = "10.96.0.10";
/// The pods' subnet on `cni0` (host-local IPAM).
const POD_CIDR: &str = "10.244.0.0/24";
/// The sandbox ("pause") image, as `e2e.test --list-images` names it.
pub(crate) const PAUSE_IMAGE: &str = "registry.k8s.io/pause:3.10.2";
/// Debian's runc and CNI plugins.
const RUNC: &str = "/usr/sbin/runc";
const CNI_BIN: &str = "/usr/lib/cni";
/// How long a component may take to become ready on a loaded machine.
const START_LIMIT: Duration = Duration::from_mins(3);
/// Names of what a node creates: `tpe2e-PID` (directory, network
/// namespace) and `topoproxy-e2e-PID` (cgroup).
const PREFIX: &str = "tpe2e";
const CGROUP_PREFIX: &str = "topoproxy-e2e";

/// What a running node is made of; see the module documentation.
pub(crate) struct Node {
    /// The control plane and node binaries (`target/k8s/<version>/`).
    bin: PathBuf,
    /// `/tmp/tpe2e-PID`.
    pub(crate) dir: PathBuf,
    /// The network namespace's name.
    pub(crate) netns: String,
    /// The cgroup's name below each hierarchy's root.
    pub(crate) cgroup: String,
    /// The cgroup v2 mount.
    unified: PathBuf,
    procs: Vec<(String, Child)>,
    /// Where the logs are copied when the node goes.
    logs_to: PathBuf,
}

impl Node {
    /// Sets the namespaces and cgroups up and starts every component;
    /// returns once the node is Ready. Whatever was created is removed
    /// again when this fails (the `Node` is dropped).
    pub(crate) fn start(bin: &Path, logs_to: &Path) -> Result<Node> {
        sweep();
        let pid = std::process::id();
        let unified = cgroup2_mount().context("no cgroup2 mount in /proc/self/mountinfo")?;
        let mut node = Node {
            bin: bin.to_path_buf(),
            dir: PathBuf::from(format!("/tmp/{PREFIX}-{pid}")),
            netns: format!("{PREFIX}-{pid}"),
            cgroup: format!("{CGROUP_PREFIX}-{pid}"),
            unified,
            procs: Vec::new(),
            logs_to: logs_to.to_path_buf(),
        };
        let started = Instant::now();
        node.make_dirs()?;
        node.make_pki()?;
        node.make_netns()?;
        node.make_mount_ns()?;
        node.make_cgroups()?;
        node.start_control_plane()?;
        node.start_runtime_and_kubelet()?;
        node.wait("the node to be Ready", || {
            let out = node.kubectl(&["get", "node", NODE_NAME, "-o", "jsonpath={.status.conditions[?(@.type==\"Ready\")].status}"])?;
            if out.trim() == "True" { Ok(()) } else { bail!("Ready is {out:?}") }
        })?;
        println!(
            "e2e: node {NODE_NAME} Ready in {:.0?} (network namespace {}, cgroup {}, {})",
            started.elapsed(),
            node.netns,
            node.cgroup,
            node.dir.display()
        );
        Ok(node)
    }

    fn make_dirs(&self) -> Result<()> {
        for sub in ["pki", "logs", "etcd", "kubelet", "containerd", "cni/net.d", "cni/ipam", "bpf", "pod-logs", "ns"] {
            fs::create_dir_all(self.dir.join(sub)).with_context(|| format!("creating {}", self.dir.join(sub).display()))?;
        }
        Ok(())
    }

    /// The admin's kubeconfig (system:masters).
    pub(crate) fn kubeconfig(&self) -> PathBuf {
        self.dir.join("admin.kubeconfig")
    }

    /// The bpffs the agent pins to (mounted in the node's mount namespace).
    pub(crate) fn bpffs(&self) -> PathBuf {
        self.dir.join("bpf")
    }

    /// The cgroup v2 directory the agent attaches to.
    pub(crate) fn cgroup_v2(&self) -> PathBuf {
        self.unified.join(&self.cgroup)
    }

    /// A CA, the API server's serving certificate (loopback, the node's
    /// address, the `kubernetes` Service's names and ClusterIP), client
    /// certificates for the admin, the controller manager, the scheduler
    /// and the kubelet (system:node:NAME in system:nodes, which the Node
    /// authorizer expects), the ServiceAccount signing keys, and a
    /// kubeconfig for each client.
    fn make_pki(&self) -> Result<()> {
        let pki = self.dir.join("pki");
        let openssl = |args: &[&str]| -> Result<()> {
            let out = Command::new("openssl").args(args).current_dir(&pki).stdin(Stdio::null()).output().context("cannot run openssl")?;
            if !out.status.success() {
                bail!("openssl {} failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
            }
            Ok(())
        };
        openssl(&[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
            "-days",
            "7",
            "-subj",
            "/CN=tpe2e-ca",
        ])?;
        let sign = |name: &str, subject: &str, ext: &str| -> Result<()> {
            let (key, csr, crt, extfile) = (format!("{name}.key"), format!("{name}.csr"), format!("{name}.crt"), format!("{name}.ext"));
            openssl(&["req", "-newkey", "rsa:2048", "-nodes", "-keyout", &key, "-out", &csr, "-subj", subject])?;
            fs::write(pki.join(&extfile), ext)?;
            openssl(&[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                "ca.crt",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-out",
                &crt,
                "-days",
                "7",
                "-extfile",
                &extfile,
            ])
        };
        sign(
            "apiserver",
            "/CN=kube-apiserver",
            &format!(
                "subjectAltName=IP:127.0.0.1,IP:{NODE_IP},IP:10.96.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,\
                 DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local\nextendedKeyUsage=serverAuth\n\
                 keyUsage=digitalSignature,keyEncipherment\n"
            ),
        )?;
        let client = "extendedKeyUsage=clientAuth\n";
        sign("admin", "/O=system:masters/CN=tpe2e-admin", client)?;
        sign("kcm", "/CN=system:kube-controller-manager", client)?;
        sign("scheduler", "/CN=system:kube-scheduler", client)?;
        sign("kubelet", &format!("/O=system:nodes/CN=system:node:{NODE_NAME}"), client)?;
        openssl(&["genrsa", "-out", "sa.key", "2048"])?;
        openssl(&["rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub"])?;
        for user in ["admin", "kcm", "scheduler", "kubelet"] {
            let text = format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: tpe2e\n  cluster:\n    server: https://{NODE_IP}:{APISERVER_PORT}\n    \
                 certificate-authority: {ca}\nusers:\n- name: {user}\n  user:\n    client-certificate: {crt}\n    client-key: {key}\n\
                 contexts:\n- name: {user}\n  context:\n    cluster: tpe2e\n    user: {user}\ncurrent-context: {user}\n",
                ca = pki.join("ca.crt").display(),
                crt = pki.join(format!("{user}.crt")).display(),
                key = pki.join(format!("{user}.key")).display(),
            );
            fs::write(self.dir.join(format!("{user}.kubeconfig")), text)?;
        }
        Ok(())
    }

    /// The network namespace: loopback, and `node0` (the node's address)
    /// with its veth peer, both inside; forwarding on (between pods and
    /// the node). No default route.
    fn make_netns(&self) -> Result<()> {
        let ns = self.netns.as_str();
        ip(&["netns", "add", ns])?;
        ip(&["-n", ns, "link", "set", "lo", "up"])?;
        // A veth pair rather than a dummy device: this kernel has no dummy
        // driver. Both ends stay in the namespace.
        ip(&["-n", ns, "link", "add", "node0", "type", "veth", "peer", "name", "node0-peer"])?;
        ip(&["-n", ns, "addr", "add", &format!("{NODE_IP}/24"), "dev", "node0"])?;
        ip(&["-n", ns, "link", "set", "node0-peer", "up"])?;
        ip(&["-n", ns, "link", "set", "node0", "up"])?;
        run(Command::new("nsenter").arg(format!("--net=/run/netns/{ns}")).args(["sysctl", "-qw", "net.ipv4.ip_forward=1"]))
    }

    /// The mount namespace (see the module documentation), kept by a bind
    /// mount of its nsfs file at `ns/mnt`, whose parent is made a private
    /// mount first (the kernel refuses to keep a mount namespace on a
    /// shared mount).
    fn make_mount_ns(&self) -> Result<()> {
        let ns = self.dir.join("ns");
        run(Command::new("mount").arg("--bind").arg(&ns).arg(&ns))?;
        run(Command::new("mount").arg("--make-private").arg(&ns))?;
        fs::File::create(ns.join("mnt"))?;
        let setup = format!(
            "mount --make-rshared / && mount -t tmpfs -o mode=755 tmpfs /run && mount -t tmpfs -o mode=755 tmpfs /var/lib \
             && mount -t bpf bpf {}",
            self.bpffs().display()
        );
        run(Command::new("unshare").arg(format!("--mount={}", ns.join("mnt").display())).args([
            "--propagation",
            "private",
            "--",
            "sh",
            "-c",
            &setup,
        ]))
    }

    /// `CGROUP` below every hierarchy's root: the v1 controllers' (kubelet
    /// checks that its cgroupRoot exists in each, and cpuset needs its
    /// CPUs and memory nodes before a task may join) and v2's, with its
    /// `node` child for the node's own processes.
    fn make_cgroups(&self) -> Result<()> {
        for root in cgroup_roots() {
            let dir = root.join(&self.cgroup);
            fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            for file in ["cpuset.cpus", "cpuset.mems"] {
                if let Ok(parent) = fs::read_to_string(root.join(file)) {
                    fs::write(dir.join(file), parent.trim()).with_context(|| format!("writing {}", dir.join(file).display()))?;
                }
            }
        }
        fs::create_dir_all(self.cgroup_v2().join("node"))?;
        Ok(())
    }

    /// A command that runs `program` in the node: in the `node` cgroup
    /// (joined before entering the namespaces: see PLATFORM.md on `ip netns
    /// exec` and /sys), the network namespace and, when `mount_ns`, the
    /// mount namespace, with the binaries' directory first on PATH.
    pub(crate) fn command(&self, program: &Path, mount_ns: bool) -> Command {
        let mut c = Command::new("sh");
        let mnt = if mount_ns { format!(" --mount={}", self.dir.join("ns/mnt").display()) } else { String::new() };
        c.arg("-c")
            .arg(format!(
                "echo $$ > {}/cgroup.procs && exec nsenter --net=/run/netns/{}{mnt} -- \"$@\"",
                self.cgroup_v2().join("node").display(),
                self.netns
            ))
            .arg("sh")
            .arg(program)
            .env("PATH", format!("{}:/usr/sbin:/usr/bin:/sbin:/bin", self.bin.display()))
            .stdin(Stdio::null());
        c
    }

    /// Starts a component in the node, its output in `logs/NAME.log`.
    fn spawn(&mut self, name: &str, args: &[String]) -> Result<()> {
        let log = self.dir.join("logs").join(format!("{name}.log"));
        let file = fs::File::create(&log)?;
        let mut c = self.command(&self.bin.join(name), true);
        c.args(args).stdout(file.try_clone()?).stderr(file).process_group(0);
        let child = c.spawn().with_context(|| format!("cannot start {name}"))?;
        self.procs.push((name.to_string(), child));
        Ok(())
    }

    /// kubectl as the admin, from inside the network namespace.
    pub(crate) fn kubectl(&self, args: &[&str]) -> Result<String> {
        self.kubectl_stdin(args, None)
    }

    /// kubectl with `stdin`; its stdout, or an error with its stderr.
    pub(crate) fn kubectl_stdin(&self, args: &[&str], stdin: Option<&str>) -> Result<String> {
        let mut c = Command::new("nsenter");
        c.arg(format!("--net=/run/netns/{}", self.netns))
            .arg(self.bin.join("kubectl"))
            .arg(format!("--kubeconfig={}", self.kubeconfig().display()))
            .args(args)
            .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = c.spawn().context("cannot run kubectl")?;
        if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
            pipe.write_all(text.as_bytes())?;
        }
        let out = child.wait_with_output()?;
        if !out.status.success() {
            bail!("kubectl {} failed ({}): {}", args.join(" "), out.status, String::from_utf8_lossy(&out.stderr).trim());
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Polls `check` until it succeeds; fails after [`START_LIMIT`], or
    /// as soon as a component has exited, with the end of its log.
    pub(crate) fn wait(&self, what: &str, mut check: impl FnMut() -> Result<()>) -> Result<()> {
        let deadline = Instant::now() + START_LIMIT;
        loop {
            let last = match check() {
                Ok(()) => return Ok(()),
                Err(e) => format!("{e:#}"),
            };
            self.check_running()?;
            if Instant::now() > deadline {
                bail!("waiting for {what}: not after {} s (last: {last})", START_LIMIT.as_secs());
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    /// An error naming the first component that has exited, with the end
    /// of its log.
    pub(crate) fn check_running(&self) -> Result<()> {
        for (name, child) in &self.procs {
            // Child::try_wait needs &mut; /proc tells whether it is gone
            // (a zombie until reaped in Drop).
            let state = fs::read_to_string(format!("/proc/{}/stat", child.id())).unwrap_or_default();
            let zombie = state.rsplit(')').next().is_some_and(|r| r.trim_start().starts_with('Z'));
            if state.is_empty() || zombie {
                let log = fs::read_to_string(self.dir.join("logs").join(format!("{name}.log"))).unwrap_or_default();
                let lines: Vec<&str> = log.lines().collect();
                bail!("{name} exited; the end of its log:\n{}", lines[lines.len().saturating_sub(20)..].join("\n"));
            }
        }
        Ok(())
    }

    fn start_control_plane(&mut self) -> Result<()> {
        let dir = self.dir.clone();
        let d = |p: &str| dir.join(p).display().to_string();
        let etcd = [
            "--name=tpe2e".to_string(),
            format!("--data-dir={}", d("etcd")),
            "--listen-client-urls=http://127.0.0.1:2379".into(),
            "--advertise-client-urls=http://127.0.0.1:2379".into(),
            "--listen-peer-urls=http://127.0.0.1:2380".into(),
            "--initial-advertise-peer-urls=http://127.0.0.1:2380".into(),
            "--initial-cluster=tpe2e=http://127.0.0.1:2380".into(),
            // Throwaway data: no fsync per write.
            "--unsafe-no-fsync=true".into(),
            "--log-level=warn".into(),
        ];
        self.spawn("etcd", &etcd)?;
        let apiserver = [
            "--bind-address=0.0.0.0".to_string(),
            format!("--advertise-address={NODE_IP}"),
            format!("--secure-port={APISERVER_PORT}"),
            "--etcd-servers=http://127.0.0.1:2379".into(),
            format!("--tls-cert-file={}", d("pki/apiserver.crt")),
            format!("--tls-private-key-file={}", d("pki/apiserver.key")),
            format!("--client-ca-file={}", d("pki/ca.crt")),
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local".into(),
            format!("--service-account-key-file={}", d("pki/sa.pub")),
            format!("--service-account-signing-key-file={}", d("pki/sa.key")),
            "--authorization-mode=Node,RBAC".into(),
            format!("--service-cluster-ip-range={SERVICE_CIDR}"),
            format!("--cert-dir={}", d("apiserver-certs")),
            // The agent runs privileged, with the host's network.
            "--allow-privileged=true".into(),
            // exec, logs and port-forward reach the kubelet at its
            // InternalIP: the node's name resolves nowhere here.
            "--kubelet-preferred-address-types=InternalIP".into(),
            format!("--kubelet-client-certificate={}", d("pki/admin.crt")),
            format!("--kubelet-client-key={}", d("pki/admin.key")),
        ];
        self.spawn("kube-apiserver", &apiserver)?;
        self.wait("kube-apiserver's /readyz", || self.kubectl(&["get", "--raw", "/readyz"]).map(drop))?;
        let kcm = [
            format!("--kubeconfig={}", d("kcm.kubeconfig")),
            "--bind-address=127.0.0.1".to_string(),
            format!("--cert-dir={}", d("kcm-certs")),
            // Every default controller.
            "--controllers=*".into(),
            format!("--service-account-private-key-file={}", d("pki/sa.key")),
            format!("--root-ca-file={}", d("pki/ca.crt")),
            "--use-service-account-credentials=true".into(),
            "--leader-elect=false".into(),
            format!("--service-cluster-ip-range={SERVICE_CIDR}"),
        ];
        self.spawn("kube-controller-manager", &kcm)?;
        let scheduler =
            [format!("--kubeconfig={}", d("scheduler.kubeconfig")), "--bind-address=127.0.0.1".to_string(), "--leader-elect=false".into()];
        self.spawn("kube-scheduler", &scheduler)?;
        self.wait("the default ServiceAccount", || {
            self.kubectl(&["-n", "default", "get", "serviceaccount", "default", "-o", "name"]).map(drop)
        })
    }

    fn start_runtime_and_kubelet(&mut self) -> Result<()> {
        let dir = self.dir.display().to_string();
        let socket = format!("{dir}/containerd.sock");
        fs::write(self.dir.join("containerd.toml"), containerd_config(&dir, &socket))?;
        fs::write(self.dir.join("cni/net.d/10-tpe2e.conflist"), cni_config(&dir))?;
        self.spawn("containerd", &["--config".into(), format!("{dir}/containerd.toml")])?;
        let sock = PathBuf::from(&socket);
        self.wait("containerd's socket", || if sock.exists() { Ok(()) } else { bail!("no {socket}") })?;
        // Pods get the cluster DNS and nothing of the host's resolver.
        fs::write(self.dir.join("resolv.conf"), "")?;
        fs::write(self.dir.join("kubelet.yaml"), kubelet_config(&dir, &socket, &self.cgroup))?;
        let kubelet = [
            format!("--config={dir}/kubelet.yaml"),
            format!("--kubeconfig={dir}/kubelet.kubeconfig"),
            format!("--root-dir={dir}/kubelet"),
            format!("--cert-dir={dir}/kubelet-pki"),
            format!("--node-ip={NODE_IP}"),
            format!("--hostname-override={NODE_NAME}"),
        ];
        self.spawn("kubelet", &kubelet)
    }

    /// `ctr -n k8s.io images import` of an OCI archive, unpacked for the
    /// CRI's snapshotter.
    pub(crate) fn import_images(&self, archive: &Path) -> Result<()> {
        let mut c = self.command(&self.bin.join("ctr"), true);
        c.arg(format!("--address={}/containerd.sock", self.dir.display()))
            .args(["-n", "k8s.io", "images", "import", "--snapshotter", "overlayfs"])
            .arg(archive)
            .stdout(Stdio::null());
        run(&mut c).with_context(|| format!("importing {}", archive.display()))
    }

    /// Copies the components' logs and the pods' to `logs_to`.
    fn save_logs(&self) {
        let _ = fs::remove_dir_all(&self.logs_to);
        let _ = fs::create_dir_all(&self.logs_to);
        let _ = Command::new("cp").arg("-r").arg(self.dir.join("logs")).arg(self.dir.join("pod-logs")).arg(&self.logs_to).status();
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.save_logs();
        for (_, child) in &mut self.procs {
            // The process group our child leads.
            kill(&format!("-{}", child.id()));
            let _ = child.wait();
        }
        teardown(&self.dir, &self.netns, &self.cgroup, &self.unified);
        println!("e2e: node removed (logs in {})", self.logs_to.display());
    }
}

/// SIGKILL to a process (or, `-PGID`, a process group) with kill(1):
/// xtask has no libc binding.
fn kill(target: &str) {
    let _ = Command::new("kill").args(["-KILL", "--", target]).stdout(Stdio::null()).stderr(Stdio::null()).status();
}

/// Removes a node's processes, namespaces, cgroups and directory, in
/// that order; each step whatever the others did.
fn teardown(dir: &Path, netns: &str, cgroup: &str, unified: &Path) {
    // Every process left in the cgroup (shims, containers), until none
    // is: a process may fork while being killed.
    for _ in 0..50 {
        let pids = cgroup_pids(&unified.join(cgroup));
        if pids.is_empty() {
            break;
        }
        for pid in pids {
            // A process of the node's own cgroup.
            kill(&pid.to_string());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    // The mount namespace goes with its last process and this mount.
    let ns = dir.join("ns");
    let _ = Command::new("umount").arg(ns.join("mnt")).stderr(Stdio::null()).status();
    let _ = Command::new("umount").arg(&ns).stderr(Stdio::null()).status();
    let _ = Command::new("ip").args(["netns", "del", netns]).stderr(Stdio::null()).status();
    for root in cgroup_roots() {
        remove_cgroup_tree(&root.join(cgroup));
    }
    // Only once nothing is mounted below it.
    if !fs::read_to_string("/proc/self/mountinfo").unwrap_or_default().contains(&format!(" {}/", dir.display())) {
        let _ = fs::remove_dir_all(dir);
    }
}

/// The pids in a cgroup v2 tree.
fn cgroup_pids(dir: &Path) -> Vec<i32> {
    let mut pids: Vec<i32> =
        fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default().lines().filter_map(|l| l.trim().parse().ok()).collect();
    if let Ok(rd) = fs::read_dir(dir) {
        for e in rd.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                pids.extend(cgroup_pids(&e.path()));
            }
        }
    }
    pids
}

/// rmdir of a cgroup and its children, deepest first.
fn remove_cgroup_tree(dir: &Path) {
    if let Ok(rd) = fs::read_dir(dir) {
        for e in rd.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                remove_cgroup_tree(&e.path());
            }
        }
    }
    let _ = fs::remove_dir(dir);
}

/// The cgroup2 mount point, from /proc/self/mountinfo.
fn cgroup2_mount() -> Option<PathBuf> {
    mounts_of("cgroup2").into_iter().next()
}

/// Every cgroup hierarchy's root directory: v2's and each v1 controller's.
fn cgroup_roots() -> Vec<PathBuf> {
    let mut roots = mounts_of("cgroup2");
    roots.extend(mounts_of("cgroup"));
    roots
}

/// Mount points of filesystems of type `fstype` (the field after " - ").
fn mounts_of(fstype: &str) -> Vec<PathBuf> {
    fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            let point = left.split_whitespace().nth(4)?;
            (right.split_whitespace().next()? == fstype).then(|| PathBuf::from(point))
        })
        .collect()
}

/// Tears down what runs killed before their own teardown left: each
/// `/tmp/tpe2e-PID`, network namespace `tpe2e-PID` and cgroup
/// `topoproxy-e2e-PID` whose process is gone.
pub(crate) fn sweep() {
    let dead = |name: &str, prefix: &str| -> Option<u32> {
        let pid: u32 = name.strip_prefix(prefix)?.strip_prefix('-')?.parse().ok()?;
        (pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists()).then_some(pid)
    };
    let mut pids: Vec<u32> = Vec::new();
    for (dir, prefix) in [("/tmp", PREFIX), ("/run/netns", PREFIX)] {
        if let Ok(rd) = fs::read_dir(dir) {
            pids.extend(rd.flatten().filter_map(|e| dead(&e.file_name().to_string_lossy(), prefix)));
        }
    }
    for root in cgroup_roots() {
        if let Ok(rd) = fs::read_dir(root) {
            pids.extend(rd.flatten().filter_map(|e| dead(&e.file_name().to_string_lossy(), CGROUP_PREFIX)));
        }
    }
    pids.sort_unstable();
    pids.dedup();
    let Some(unified) = cgroup2_mount() else { return };
    for pid in pids {
        println!("e2e: removing what run {pid} left");
        teardown(Path::new(&format!("/tmp/{PREFIX}-{pid}")), &format!("{PREFIX}-{pid}"), &format!("{CGROUP_PREFIX}-{pid}"), &unified);
    }
}

fn ip(args: &[&str]) -> Result<()> {
    run(Command::new("ip").args(args))
}

fn run(c: &mut Command) -> Result<()> {
    let out = c.stdin(Stdio::null()).output().with_context(|| format!("cannot run {}", c.get_program().display()))?;
    if !out.status.success() {
        bail!("{c:?} failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

/// containerd 2's configuration (version 3): state and sockets in the
/// node's directory; Debian's runc with cgroupfs (`SystemdCgroup =
/// false`: no systemd here); `restrict_oom_score_adj`, because without
/// CAP_SYS_RESOURCE (this machine) runc may not lower a container's
/// oom_score_adj below its own, and kubelet asks -998 for every sandbox
/// (runc's nsexec then fails with "failed to update
/// /proc/self/oom_score_adj: Permission denied"); CNI from Debian.
fn containerd_config(dir: &str, socket: &str) -> String {
    format!(
        r#"version = 3
root = "{dir}/containerd/root"
state = "{dir}/containerd/state"
[grpc]
  address = "{socket}"
[ttrpc]
  address = "{socket}.ttrpc"
[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "{PAUSE_IMAGE}"
[plugins.'io.containerd.cri.v1.runtime']
  restrict_oom_score_adj = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        SystemdCgroup = false
        BinaryName = "{RUNC}"
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["{CNI_BIN}"]
    conf_dir = "{dir}/cni/net.d"
"#
    )
}

/// Debian's CNI plugins: a bridge (`cni0`, the pods' gateway, hairpin for
/// a pod that reaches itself through a Service), host-local addresses,
/// portmap for hostPort, loopback. No masquerade: nothing leaves the
/// namespace.
fn cni_config(dir: &str) -> String {
    format!(
        r#"{{"cniVersion": "1.0.0", "name": "tpe2e", "plugins": [
  {{"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
    "ipam": {{"type": "host-local", "ranges": [[{{"subnet": "{POD_CIDR}"}}]], "routes": [{{"dst": "0.0.0.0/0"}}],
              "dataDir": "{dir}/cni/ipam"}}}},
  {{"type": "portmap", "capabilities": {{"portMappings": true}}}},
  {{"type": "loopback"}}
]}}
"#
    )
}

/// kubelet's configuration; see the developer guide's e2e page for why
/// each setting.
fn kubelet_config(dir: &str, socket: &str, cgroup: &str) -> String {
    format!(
        r"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cgroupDriver: cgroupfs
cgroupRoot: /{cgroup}
failCgroupV1: false
failSwapOn: false
containerRuntimeEndpoint: unix://{socket}
address: {NODE_IP}
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
authentication:
  anonymous: {{enabled: false}}
  webhook: {{enabled: true}}
  x509: {{clientCAFile: {dir}/pki/ca.crt}}
authorization: {{mode: Webhook}}
clusterDNS: [{DNS_IP}]
clusterDomain: cluster.local
resolvConf: {dir}/resolv.conf
podLogsDir: {dir}/pod-logs
evictionHard: {{memory.available: 100Mi, nodefs.available: 1%, imagefs.available: 1%, nodefs.inodesFree: 1%}}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_lines_are_read_by_fstype() {
        // This machine and every Linux has some cgroup hierarchy mounted.
        assert!(!cgroup_roots().is_empty());
    }

    #[test]
    fn the_configurations_name_the_node_directory() {
        let c = containerd_config("/tmp/tpe2e-1", "/tmp/tpe2e-1/containerd.sock");
        assert!(c.contains("SystemdCgroup = false") && c.contains("restrict_oom_score_adj = true") && c.contains(PAUSE_IMAGE), "{c}");
        let k = kubelet_config("/tmp/tpe2e-1", "/tmp/tpe2e-1/containerd.sock", "topoproxy-e2e-1");
        assert!(k.contains("failCgroupV1: false") && k.contains("cgroupRoot: /topoproxy-e2e-1"), "{k}");
        let n: serde_json::Value = serde_json::from_str(&cni_config("/tmp/tpe2e-1")).expect("CNI config is JSON");
        assert_eq!(n["plugins"][0]["type"], "bridge");
    }
}
