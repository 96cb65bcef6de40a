//! The agent's container image, run the way the Helm chart's DaemonSet runs
//! it. Three simulated nodes (the demo's, from `examples/demo`) each get a
//! pod of the DaemonSet that Helm's engine renders from the chart: the
//! bpffs init container, then the agent container with the rendered
//! arguments, environment, mounts, capabilities and security settings, in
//! podman. The agents watch the stand-in API server, which serves the
//! demo's Nodes, Services and EndpointSlices. Clients on every node then
//! reach exactly the backends `explain` (run from the same image) decides
//! for that node, which is the demo's table; and replacing one node's pod,
//! as a rollout does, fails no connection.
//!
//! `cargo xtask test` builds the image (`cargo xtask image`) and then runs
//! this test with TOPOPROXY_IMAGE naming it; a plain `cargo test` leaves
//! it ignored. It needs root and podman with runc.
//!
//! What differs from a node of a real cluster, and why:
//! - host network: each node's "host" network namespace is one this test
//!   creates (`--network ns:`), linked by a veth only to a test namespace
//!   that holds the API server, so the machine's own interfaces are never
//!   touched; the chart's default `devices: auto` then finds that veth;
//! - the API server: the in-cluster configuration is always https, and
//!   the stand-in speaks plain HTTP, so each agent gets a kubeconfig
//!   through the chart's `extraArgs` and one extra read-only mount
//!   (Stand-in: it serves the demo's objects verbatim from inside the
//!   test's control namespace, which the containers reach; the real
//!   control plane of real_apiserver.rs listens on the host's loopback);
//! - `cgroup.hostRoot` is the node's own test cgroup, where its pods run,
//!   instead of the machine's cgroup2 root: three agents of one machine
//!   would otherwise all translate every process's connections;
//! - `bpf.root` is a test directory, bind-mounted on itself and made
//!   shared as systemd makes `/` on a real node (Bidirectional propagation
//!   needs a shared mount), so that the init container really mounts a
//!   bpffs there (node-1's) and finds it mounted (the others');
//!   `bpf.pinDir` is per node;
//! - seccomp: the chart sets no seccompProfile, and the kubelet runs such a
//!   container Unconfined (its default `seccompDefault: false`); podman's
//!   own default profile allows bpf(2) only with CAP_SYS_ADMIN, so the
//!   container gets `seccomp=unconfined` explicitly. Capabilities are the
//!   rendered ones (drop ALL; add BPF, NET_ADMIN, PERFMON), with
//!   no-new-privileges and a read-only root filesystem;
//! - images are never pulled (`--pull=never`), and the limits of open files
//!   and processes are set (see `ulimits`), since podman's defaults exceed
//!   the hard limits of some machines.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread::JoinHandle;
use std::time::Duration;

use proxy_agent::datapath::socket_loader;
use proxy_agent::source::manifest;
use proxy_test_support::apiserver::ApiServer;
use proxy_test_support::http::http_get;
use proxy_test_support::sandbox::{Cgroup, Guarded, Netns, command_in, in_netns};
use proxy_test_support::scenario::{Scenario, Tally, print_table, read_scenario, tally};
use proxy_test_support::wait::{eventually, eventually_within};
use serde_json::{Value, json};
use support::{TempDir, agent_bin, require_root};

/// Prefix of the containers, namespaces, cgroups and directories made here;
/// names continue `-PID-N`, so leftovers of a killed run are swept.
const PREFIX: &str = "tpimg";
/// Where the kubeconfig is mounted in the agent container.
const KUBECONFIG_IN_CONTAINER: &str = "/var/lib/topoproxy/kubeconfig";
/// The link between the nodes and the API server: TEST-NET-1 (RFC 5737).
const CONTROL_IP: &str = "192.0.2.1";
/// Requests per node and Service: with four backends, the chance that one
/// of them gets none of 60 uniform picks is below 1e-6.
const REQUESTS: u32 = 60;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("proxy-agent lives in the workspace").to_path_buf()
}

fn demo_manifests() -> PathBuf {
    workspace().join("examples/demo")
}

/// The node's address on the link to the API server.
fn node_ip(index: usize) -> String {
    format!("192.0.2.{}", 11 + index)
}

// ---------------------------------------------------------------------------
// podman
// ---------------------------------------------------------------------------

/// podman with the global flags `cargo xtask image` built the image with
/// (TOPOPROXY_PODMAN_ARGS), so that the same storage is used.
struct Podman {
    global: Vec<String>,
}

impl Podman {
    fn from_env() -> Podman {
        let global = std::env::var("TOPOPROXY_PODMAN_ARGS").unwrap_or_else(|_| "--runtime runc --storage-driver vfs".into());
        Podman { global: global.split_whitespace().map(str::to_string).collect() }
    }

    fn cmd(&self) -> Command {
        let mut c = Command::new("podman");
        c.args(&self.global).stdin(Stdio::null());
        c
    }

    /// Runs podman; stdout on success, stdout and stderr as the error.
    fn run(&self, args: &[String]) -> Result<String, String> {
        let out = self.cmd().args(args).output().map_err(|e| format!("cannot run podman: {e}"))?;
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        if out.status.success() {
            Ok(stdout)
        } else {
            Err(format!("podman {} failed ({}): {stdout}{}", args.join(" "), out.status, String::from_utf8_lossy(&out.stderr)))
        }
    }

    fn image_id(&self, image: &str) -> Result<String, String> {
        self.run(&strings(&["image", "inspect", "--format", "{{.Id}}", image])).map(|s| s.trim().to_string())
    }

    /// Removes containers of earlier runs that were killed before cleaning up.
    fn sweep(&self) {
        let Ok(names) = self.run(&strings(&["ps", "--all", "--format", "{{.Names}}"])) else { return };
        for name in names.lines().filter(|n| stale(n)) {
            let _ = self.run(&strings(&["rm", "--force", "--time", "0", name]));
        }
    }
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(std::string::ToString::to_string).collect()
}

/// Whether a `PREFIX-PID-...` name belongs to a process that is gone.
fn stale(name: &str) -> bool {
    let Some(rest) = name.strip_prefix(PREFIX).and_then(|r| r.strip_prefix('-')) else { return false };
    let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else { return false };
    pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists()
}

fn unique(what: &str) -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    format!("{PREFIX}-{}-{}-{what}", std::process::id(), N.fetch_add(1, Ordering::Relaxed))
}

/// A container that is removed on drop (its log printed first when the
/// test is failing).
struct Container<'a> {
    podman: &'a Podman,
    name: String,
}

impl Container<'_> {
    fn logs(&self) -> String {
        let out = self.podman.cmd().args(["logs", &self.name]).output();
        out.map(|o| format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))).unwrap_or_default()
    }

    fn inspect(&self, format: &str) -> String {
        self.podman.run(&strings(&["inspect", "--format", format, &self.name])).unwrap_or_default().trim().to_string()
    }

    /// Each thread of the container's main process, with where the kernel
    /// has it waiting (`wchan`, and its kernel stack): for a failure report,
    /// so that an agent stuck in a system call shows which.
    fn threads(&self) -> String {
        let pid = self.inspect("{{.State.Pid}}");
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            return format!("(no process {pid:?})");
        };
        let mut out = String::new();
        for task in tasks.flatten() {
            let path = task.path();
            let read = |name: &str| std::fs::read_to_string(path.join(name)).unwrap_or_default();
            out.push_str(&format!("{} {} wchan={}\n{}", path.display(), read("comm").trim(), read("wchan").trim(), read("stack")));
        }
        out
    }
}

impl Drop for Container<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("--- log of container {} ---\n{}", self.name, self.logs());
            eprintln!("--- threads of container {} ---\n{}", self.name, self.threads());
        }
        let _ = self.podman.run(&strings(&["rm", "--force", "--time", "0", &self.name]));
    }
}

/// `--ulimit` options: podman asks runc for 1048576 open files and
/// processes by default, more than the hard limits of some machines allow.
/// Open files: this process's own limits. Processes: podman lowers its own
/// hard limit, so a small fixed value; root is exempt from RLIMIT_NPROC
/// anyway (kernel/fork.c, copy_process: INIT_USER).
fn ulimits() -> [String; 2] {
    [format!("--ulimit=nofile={}", own_limit("Max open files")), "--ulimit=nproc=1024:1024".to_string()]
}

/// `soft:hard` of a limit of this process, from /proc/self/limits.
fn own_limit(name: &str) -> String {
    let text = fs::read_to_string("/proc/self/limits").expect("read /proc/self/limits");
    let line = text.lines().find(|l| l.starts_with(name)).unwrap_or_else(|| panic!("{name} not in /proc/self/limits"));
    let fields: Vec<&str> = line[name.len()..].split_whitespace().collect();
    let num = |s: &str| if s == "unlimited" { "-1".to_string() } else { s.to_string() };
    format!("{}:{}", num(fields[0]), num(fields[1]))
}

// ---------------------------------------------------------------------------
// The chart, rendered by Helm's engine
// ---------------------------------------------------------------------------

/// `<target>/chart-venv`'s python, made by `cargo xtask setup` for the
/// chart tests (Helm's engine as a library).
fn venv_python() -> PathBuf {
    Path::new(env!("CARGO_BIN_EXE_proxy-agent"))
        .ancestors()
        .map(|dir| dir.join("chart-venv/bin/python"))
        .find(|p| p.exists())
        .expect("the chart test environment (<target>/chart-venv) is missing; run `cargo xtask setup`")
}

const RENDER: &str = r#"
import json, sys
import helm_python as helm
import yaml
chart_dir, release, namespace = sys.argv[1:4]
out = []
for values in json.load(sys.stdin):
    with helm.Chart.load(chart_dir) as chart:
        manifests = chart.render(values=values, name=release, namespace=namespace, is_install=True)
    docs = [d for path, text in sorted(manifests.items()) if not path.endswith("NOTES.txt") for d in yaml.safe_load_all(text) if d]
    out.append([d for d in docs if d.get("kind") == "DaemonSet"])
json.dump(out, sys.stdout)
"#;

/// The chart's DaemonSet for each set of values, as `helm template` renders it.
fn render_daemonsets(values: &[Value]) -> Vec<Value> {
    let mut child = Command::new(venv_python())
        .args(["-c", RENDER])
        .arg(workspace().join("charts/topoproxy"))
        .args(["topoproxy", "kube-system"])
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run the chart-venv python");
    child.stdin.take().expect("stdin").write_all(values_json(values).as_bytes()).expect("write values");
    let out = child.wait_with_output().expect("render the chart");
    assert!(out.status.success(), "rendering the chart failed: {}", String::from_utf8_lossy(&out.stderr));
    let rendered: Vec<Vec<Value>> = serde_json::from_slice(&out.stdout).expect("rendered JSON");
    rendered
        .into_iter()
        .map(|mut daemonsets| {
            assert_eq!(daemonsets.len(), 1, "the chart renders one DaemonSet");
            daemonsets.remove(0)
        })
        .collect()
}

fn values_json(values: &[Value]) -> String {
    serde_json::to_string(values).expect("values serialize")
}

fn str_of<'a>(v: &'a Value, pointer: &str) -> &'a str {
    v.pointer(pointer).and_then(Value::as_str).unwrap_or_else(|| panic!("{pointer} missing in {v}"))
}

/// One container of the pod template, translated into `podman run`
/// arguments the way the kubelet would run it (see the module comment for
/// what is overridden).
fn run_args(pod: &Value, container: &Value, node: &str, netns: &Netns, extra_volumes: &[String]) -> Vec<String> {
    let mut args = strings(&["--pull=never", "--log-driver=k8s-file", "--read-only-tmpfs=false"]);
    args.extend(ulimits());
    assert_eq!(pod["hostNetwork"], true, "the DaemonSet runs in the host's network namespace");
    args.push(format!("--network=ns:{}", netns.path().display()));

    // Environment: plain values, and the downward API's spec.nodeName.
    let mut env: Vec<(String, String)> = Vec::new();
    for e in container["env"].as_array().into_iter().flatten() {
        let name = str_of(e, "/name").to_string();
        let value = match (e.get("value"), e.pointer("/valueFrom/fieldRef/fieldPath")) {
            (Some(v), _) => v.as_str().map_or_else(|| v.to_string(), str::to_string),
            (None, Some(Value::String(path))) if path == "spec.nodeName" => node.to_string(),
            _ => panic!("environment variable {e} is not supported by this test's kubelet"),
        };
        args.push(format!("--env={name}={value}"));
        env.push((name, value));
    }

    // hostPath volumes at their mount points, with their propagation.
    let volumes: BTreeMap<&str, &Value> =
        pod["volumes"].as_array().into_iter().flatten().map(|v| (str_of(v, "/name"), &v["hostPath"])).collect();
    for m in container["volumeMounts"].as_array().into_iter().flatten() {
        let host_path = volumes.get(str_of(m, "/name")).unwrap_or_else(|| panic!("volume of {m} is not a hostPath"));
        let source = str_of(host_path, "/path");
        match host_path.get("type").and_then(Value::as_str) {
            Some("DirectoryOrCreate") => fs::create_dir_all(source).expect("create hostPath directory"),
            Some("Directory") => assert!(Path::new(source).is_dir(), "hostPath {source} is not a directory"),
            other => panic!("hostPath type {other:?} is not supported by this test's kubelet"),
        }
        let mut options = Vec::new();
        if m["readOnly"] == true {
            options.push("ro");
        }
        options.push(match m.get("mountPropagation").and_then(Value::as_str) {
            Some("Bidirectional") => "rshared",
            Some("HostToContainer") => "rslave",
            _ => "rprivate",
        });
        args.push(format!("--volume={source}:{}:{}", str_of(m, "/mountPath"), options.join(",")));
    }
    args.extend(extra_volumes.iter().map(|v| format!("--volume={v}")));

    // Security context.
    let sc = &container["securityContext"];
    if sc["privileged"] == true {
        args.push("--privileged".into());
    } else {
        for c in sc.pointer("/capabilities/drop").and_then(Value::as_array).into_iter().flatten() {
            args.push(format!("--cap-drop={}", c.as_str().expect("capability name")));
        }
        for c in sc.pointer("/capabilities/add").and_then(Value::as_array).into_iter().flatten() {
            args.push(format!("--cap-add=CAP_{}", c.as_str().expect("capability name")));
        }
    }
    if sc["allowPrivilegeEscalation"] == false {
        args.push("--security-opt=no-new-privileges".into());
    }
    let seccomp = sc.pointer("/seccompProfile/type").or_else(|| pod.pointer("/securityContext/seccompProfile/type"));
    match seccomp.and_then(Value::as_str) {
        // The kubelet's default for a container without a profile.
        None | Some("Unconfined") => args.push("--security-opt=seccomp=unconfined".into()),
        Some("RuntimeDefault") => {}
        Some(other) => panic!("seccompProfile {other} is not supported by this test's kubelet"),
    }
    if sc["readOnlyRootFilesystem"] == true {
        args.push("--read-only".into());
    }
    if let Some(uid) = sc.get("runAsUser").and_then(Value::as_u64) {
        args.push(format!("--user={uid}"));
    }

    // command replaces the image's entrypoint, args its cmd; $(VAR) refers
    // to the container's environment.
    let expand = |s: &str| env.iter().fold(s.to_string(), |s, (k, v)| s.replace(&format!("$({k})"), v));
    if let Some(command) = container.get("command") {
        args.push(format!("--entrypoint={command}"));
    }
    args.push(str_of(container, "/image").to_string());
    args.extend(container["args"].as_array().into_iter().flatten().map(|a| expand(a.as_str().expect("string argument"))));
    args
}

// ---------------------------------------------------------------------------
// The simulated machine
// ---------------------------------------------------------------------------

/// The nodes' bpffs root: a directory bind-mounted on itself and made
/// shared. On drop every pin directory below it is reset (links detached,
/// maps removed) and the mounts (the init container's bpffs, the bind
/// mount) are taken down.
struct BpfRoot {
    path: PathBuf,
}

impl BpfRoot {
    fn new() -> BpfRoot {
        Self::sweep();
        let path = PathBuf::from("/run").join(unique("bpf"));
        fs::create_dir_all(&path).expect("create the bpf root");
        let root = BpfRoot { path };
        sh(Command::new("mount").arg("--bind").arg(&root.path).arg(&root.path));
        sh(Command::new("mount").arg("--make-shared").arg(&root.path));
        root
    }

    fn sweep() {
        let Ok(rd) = fs::read_dir("/run") else { return };
        for e in rd.flatten() {
            if stale(&e.file_name().to_string_lossy()) {
                drop(BpfRoot { path: e.path() });
            }
        }
    }

    fn is_mount_point(&self) -> bool {
        let target = self.path.to_string_lossy();
        fs::read_to_string("/proc/self/mountinfo").is_ok_and(|m| m.lines().any(|l| l.split_whitespace().nth(4) == Some(&*target)))
    }
}

impl Drop for BpfRoot {
    fn drop(&mut self) {
        if let Ok(rd) = fs::read_dir(&self.path) {
            for e in rd.flatten() {
                let _ = socket_loader::reset(&e.path());
            }
        }
        for _ in 0..4 {
            if !self.is_mount_point() {
                break;
            }
            let _ = Command::new("umount").arg("--lazy").arg(&self.path).status();
        }
        let _ = fs::remove_dir_all(&self.path);
    }
}

/// Removes the scratch directories (kubeconfigs) of earlier runs that were
/// killed; the sandbox sweeps their namespaces and cgroups the same way.
fn sweep_temp_dirs() {
    let Ok(rd) = fs::read_dir(std::env::temp_dir()) else { return };
    for e in rd.flatten() {
        if stale(&e.file_name().to_string_lossy()) {
            let _ = fs::remove_dir_all(e.path());
        }
    }
}

fn sh(cmd: &mut Command) {
    let out = cmd.stdin(Stdio::null()).output().unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(out.status.success(), "{cmd:?} failed: {}", String::from_utf8_lossy(&out.stderr));
}

/// A backend pod (`proxy-agent serve-hostname`) in its node's cgroup and
/// the pod network namespace; returns once its sockets are bound.
fn spawn_pod(pods: &Netns, cgroup: &Cgroup, name: &str, listen: &[String]) -> Guarded {
    let mut cmd = command_in(agent_bin(), Some(pods), Some(cgroup)).expect("pod command");
    cmd.arg("serve-hostname").args(["--name", name, "--listen"]).args(listen);
    cmd.env("LOG_LEVEL", "warn").stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::inherit());
    let mut g = Guarded::spawn(&mut cmd).expect("start pod");
    let out = g.0.stdout.take().expect("pod stdout");
    let mut line = String::new();
    BufReader::new(out).read_line(&mut line).expect("read pod stdout");
    assert_eq!(line.trim(), "ready", "pod {name} did not start on {listen:?}");
    g
}

/// One node: its "host" network namespace, its pods' cgroup, its rendered
/// DaemonSet and, while it runs, its pod's agent container.
struct NodeRuntime<'a> {
    name: String,
    ip: String,
    daemonset: Value,
    agent: Option<Container<'a>>,
    cgroup: Cgroup,
    netns: Netns,
}

impl NodeRuntime<'_> {
    /// The address and path of the agent container's probe `which`
    /// (`readinessProbe`, `livenessProbe`): the node address (host network)
    /// and the named container port.
    fn probe_target(&self, which: &str) -> (SocketAddr, String) {
        let c = &self.daemonset["spec"]["template"]["spec"]["containers"][0];
        let get = &c[which]["httpGet"];
        let port = match &get["port"] {
            Value::Number(n) => n.as_u64().expect("port number"),
            Value::String(name) => c["ports"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|p| p["name"] == name.as_str())
                .and_then(|p| p["containerPort"].as_u64())
                .unwrap_or_else(|| panic!("no container port {name}")),
            other => panic!("probe port {other}"),
        };
        let addr = SocketAddr::new(self.ip.parse().expect("node ip"), u16::try_from(port).expect("port"));
        (addr, str_of(get, "/path").to_string())
    }
}

/// The simulated cluster. Fields drop in declaration order, which is the
/// teardown order: containers, then pins and mounts, pods, cgroups and
/// namespaces, the API server last.
struct Cluster<'a> {
    nodes: Vec<NodeRuntime<'a>>,
    bpf: BpfRoot,
    backends: Vec<Guarded>,
    pods: Netns,
    api: ApiServer,
    control: Netns,
    dir: TempDir,
    podman: &'a Podman,
    image: String,
}

impl<'a> Cluster<'a> {
    fn node(&self, name: &str) -> &NodeRuntime<'a> {
        self.nodes.iter().find(|n| n.name == name).unwrap_or_else(|| panic!("no node {name}"))
    }

    /// Runs the pod of `node` as the kubelet would: each init container to
    /// completion (returning their output), then the agent container.
    fn start_pod(&mut self, index: usize) -> Vec<String> {
        let node = &self.nodes[index];
        let pod = &node.daemonset["spec"]["template"]["spec"];
        let kubeconfig = format!("{}:{KUBECONFIG_IN_CONTAINER}:ro", self.dir.0.join("kubeconfig").display());
        let mut init_output = Vec::new();
        for init in pod["initContainers"].as_array().into_iter().flatten() {
            let name = unique(&format!("{}-{}", node.name, str_of(init, "/name")));
            let mut args = strings(&["run", "--rm", "--name", &name]);
            args.extend(run_args(pod, init, &node.name, &node.netns, &[]));
            let out = self.podman.run(&args).unwrap_or_else(|e| panic!("init container of {}: {e}", node.name));
            init_output.push(out);
        }
        let containers = pod["containers"].as_array().expect("containers");
        assert_eq!(containers.len(), 1, "one agent container per pod");
        let name = unique(&format!("{}-agent", node.name));
        let mut args = strings(&["run", "--detach", "--name", &name]);
        args.extend(run_args(pod, &containers[0], &node.name, &node.netns, &[kubeconfig]));
        let container = Container { podman: self.podman, name };
        self.podman.run(&args).unwrap_or_else(|e| panic!("agent container of {}: {e}", node.name));
        self.nodes[index].agent = Some(container);
        init_output
    }

    /// Stops the agent container as the kubelet ends a pod (SIGTERM, then
    /// the grace period) and removes it; returns its exit code.
    fn stop_pod(&mut self, index: usize) -> String {
        let node = &mut self.nodes[index];
        let grace = node.daemonset.pointer("/spec/template/spec/terminationGracePeriodSeconds").and_then(Value::as_u64).unwrap_or(30);
        let agent = node.agent.take().expect("a running agent");
        self.podman.run(&strings(&["stop", "--time", &grace.to_string(), &agent.name])).expect("stop the agent container");
        agent.inspect("{{.State.ExitCode}}")
    }

    /// An HTTP GET from the API server's namespace, where the kubelet's
    /// probes would come from.
    fn http_get_from_control(&self, addr: SocketAddr, path: &str) -> Result<(u16, String), String> {
        let path = path.to_string();
        in_netns(&self.control, move || http_get(addr, &path)).map_err(|e| e.to_string())?
    }

    /// Waits until the node's agent container passes its readiness probe.
    /// A kubelet sets no deadline on readiness (nor does a DaemonSet's
    /// rollout), and `/livez` passes while the agent installs, so nothing
    /// would restart it: this asserts that the agent gets ready, not how
    /// fast. Under CI load (TCG guests beside) a restarted agent's program
    /// loads were seen to take over 70 s (the main thread in the verifier,
    /// bpf_check), so the bound is generous: 5 minutes.
    fn wait_ready(&self, node: &NodeRuntime) {
        let (addr, path) = node.probe_target("readinessProbe");
        eventually_within(Duration::from_mins(5), &format!("the agent of {} to be ready ({addr}{path})", node.name), || {
            if let Some(agent) = &node.agent {
                let status = agent.inspect("{{.State.Status}}");
                // Its log follows, from the container's drop.
                assert_eq!(status, "running", "the agent container of {} is {status}", node.name);
            }
            match self.http_get_from_control(addr, &path) {
                Ok((200, _)) => Ok(()),
                other => Err(other),
            }
        });
    }

    /// `proxy-agent probe` as a client pod of `node`: one JSON value per
    /// attempt.
    fn probe(&self, node: &str, to: SocketAddr, count: u32) -> Vec<Value> {
        let mut cmd = command_in(agent_bin(), Some(&self.pods), Some(&self.node(node).cgroup)).expect("probe command");
        cmd.arg("probe").arg("--to").arg(to.to_string()).args(["--count", &count.to_string(), "--timeout-ms", "2000"]);
        cmd.args(["--message", &format!("GET / from {node}")]).env("LOG_LEVEL", "warn").stdin(Stdio::null()).stderr(Stdio::inherit());
        let out = cmd.output().expect("run probe");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("probe printed {l:?}: {e}")))
            .collect()
    }

    /// The backends (pod names) `explain`, run from the image, decides for
    /// each Service port as seen from `node`.
    fn explain(&self, node: &str, scenario: &Scenario) -> BTreeMap<String, BTreeSet<String>> {
        let manifests = format!("{}:/manifests:ro", demo_manifests().display());
        let mut args = strings(&["run", "--rm", "--pull=never", "--network=none", "--volume", &manifests]);
        args.extend(ulimits());
        args.push(self.image.clone());
        args.extend(strings(&["explain", "--node", node, "--manifests", "/manifests", "--output", "json"]));
        let out = self.podman.run(&args).unwrap_or_else(|e| panic!("explain in the image: {e}"));
        let doc: Value = serde_json::from_str(&out).expect("explain JSON");
        let pod_of: BTreeMap<IpAddr, &str> = scenario.pods.iter().map(|p| (p.ip, p.name.as_str())).collect();
        let mut want = BTreeMap::new();
        for s in doc["services"].as_array().expect("services") {
            let endpoints = if s["clusterEndpoints"].is_array() { &s["clusterEndpoints"] } else { &s["localEndpoints"] };
            let names = endpoints
                .as_array()
                .into_iter()
                .flatten()
                .map(|e| {
                    let addr: SocketAddr = e.as_str().and_then(|e| e.parse().ok()).unwrap_or_else(|| panic!("endpoint {e}"));
                    pod_of.get(&addr.ip()).map_or_else(|| addr.to_string(), |n| (*n).to_string())
                })
                .collect();
            want.insert(str_of(s, "/name").to_string(), names);
        }
        want
    }
}

/// A client of one node connecting to one ClusterIP on new sockets in a
/// loop; `finish` stops it and returns (successes, failure lines, backends
/// that answered).
struct Client {
    probe: Guarded,
    reader: JoinHandle<(u64, Vec<String>, BTreeSet<String>)>,
}

impl Client {
    fn start(cluster: &Cluster, node: &str, to: SocketAddr) -> Client {
        let mut cmd = command_in(agent_bin(), Some(&cluster.pods), Some(&cluster.node(node).cgroup)).expect("client command");
        cmd.arg("probe").arg("--to").arg(to.to_string()).args(["--count", "1000000", "--timeout-ms", "2000"]);
        cmd.env("LOG_LEVEL", "warn").stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::inherit());
        let mut probe = Guarded::spawn(&mut cmd).expect("start client");
        let stdout = probe.0.stdout.take().expect("client stdout");
        let reader = std::thread::spawn(move || {
            let (mut ok, mut failures, mut backends) = (0u64, Vec::new(), BTreeSet::new());
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                match serde_json::from_str::<Value>(&line) {
                    Ok(v) if v["ok"] == true => {
                        ok += 1;
                        backends.insert(v["reply"].as_str().unwrap_or("?").to_string());
                    }
                    _ => failures.push(line),
                }
            }
            (ok, failures, backends)
        });
        Client { probe, reader }
    }

    fn finish(mut self) -> (u64, Vec<String>, BTreeSet<String>) {
        self.probe.terminate(Duration::from_secs(5)).expect("stop client");
        self.reader.join().expect("client reader")
    }
}

#[test]
#[ignore = "runs the agent's container image: `cargo xtask test` builds it (`cargo xtask image`) and runs this"]
fn the_chart_daemonset_from_the_image_serves_the_demo_topology_and_survives_a_rollout() {
    require_root();
    let image = std::env::var("TOPOPROXY_IMAGE").expect("TOPOPROXY_IMAGE names the image to test (`cargo xtask image` prints it)");
    let podman = Podman::from_env();
    podman.sweep();
    let scenario = read_scenario(&demo_manifests()).expect("the demo manifests");

    // The cluster network (pods on loopback, no route out) and the API
    // server's namespace with a bridge the nodes hang on.
    let pods = Netns::new(PREFIX).expect("create the pod namespace");
    let control = Netns::new(PREFIX).expect("create the control-plane namespace");
    control.ip(&["link", "add", "br0", "type", "bridge"]).expect("bridge");
    control.ip(&["link", "set", "br0", "up"]).expect("bridge up");
    control.ip(&["addr", "add", &format!("{CONTROL_IP}/24"), "dev", "br0"]).expect("bridge address");
    let objects: Vec<Value> = manifest::load(&[demo_manifests()]).0.into_iter().map(|d| d.value).collect();
    let api =
        in_netns(&control, move || ApiServer::start_on(SocketAddr::new(CONTROL_IP.parse().expect("literal address"), 0), 100, objects))
            .expect("start the API server in its namespace");
    sweep_temp_dirs();
    let dir = TempDir::new(PREFIX);
    api.write_kubeconfig(&dir.0.join("kubeconfig"));
    let bpf = BpfRoot::new();

    // One DaemonSet rendering per node: the values differ only where the
    // test keeps the nodes apart on one machine (see the module comment).
    let mut nodes_ns = Vec::new();
    let mut cgroups = Vec::new();
    let mut values = Vec::new();
    for (i, n) in scenario.nodes.iter().enumerate() {
        let ns = Netns::new(PREFIX).expect("create the node's namespace");
        let peer = format!("n{i}");
        ns.veth("eth0", &control, &peer).expect("node link");
        control.ip(&["link", "set", &peer, "master", "br0"]).expect("enslave the node link");
        ns.ip(&["addr", "add", &format!("{}/24", node_ip(i)), "dev", "eth0"]).expect("node address");
        let cgroup = Cgroup::new(PREFIX).expect("create the node's cgroup");
        values.push(json!({
            "cgroup": {"hostRoot": cgroup.path()},
            "bpf": {"root": bpf.path, "pinDir": n.name},
            "extraArgs": [format!("--kubeconfig={KUBECONFIG_IN_CONTAINER}")],
        }));
        nodes_ns.push(ns);
        cgroups.push(cgroup);
    }
    let daemonsets = render_daemonsets(&values);
    let nodes: Vec<NodeRuntime> = scenario
        .nodes
        .iter()
        .zip(daemonsets)
        .zip(nodes_ns.into_iter().zip(cgroups))
        .enumerate()
        .map(|(i, ((n, daemonset), (netns, cgroup)))| NodeRuntime {
            name: n.name.clone(),
            ip: node_ip(i),
            daemonset,
            agent: None,
            cgroup,
            netns,
        })
        .collect();
    let mut cluster = Cluster { nodes, bpf, backends: Vec::new(), pods, api, control, dir, podman: &podman, image: image.clone() };

    // The chart's default image is the one `cargo xtask image` tagged.
    let chart_image = str_of(&cluster.nodes[0].daemonset, "/spec/template/spec/containers/0/image").to_string();
    assert_eq!(
        podman.image_id(&chart_image).unwrap_or_else(|e| panic!("the chart's image {chart_image} is not in local storage: {e}")),
        podman.image_id(&image).expect("the tested image"),
        "the chart's default image {chart_image} is not the image under test {image}"
    );

    // Backend pods, in their nodes' cgroups.
    let addrs: Vec<String> = scenario.pods.iter().map(|p| format!("{}/{}", p.ip, if p.ip.is_ipv4() { 32 } else { 128 })).collect();
    cluster.pods.add_loopback_addrs(&addrs.iter().map(String::as_str).collect::<Vec<_>>()).expect("pod addresses");
    for p in &scenario.pods {
        let listen: Vec<String> = p.ports.iter().map(|port| SocketAddr::new(p.ip, *port).to_string()).collect();
        let backend = spawn_pod(&cluster.pods, &cluster.node(&p.node).cgroup, &p.name, &listen);
        cluster.backends.push(backend);
    }

    // The pods of the DaemonSet, one node after the other as the kubelets
    // would start them: node-1's init container mounts the bpffs, the
    // others find it.
    for i in 0..cluster.nodes.len() {
        let init = cluster.start_pod(i);
        let root = cluster.bpf.path.display().to_string();
        let want = if i == 0 { format!("mounted bpffs at {root}") } else { format!("bpffs already mounted at {root}") };
        assert_eq!(init.iter().map(|s| s.trim()).collect::<Vec<_>>(), [want.as_str()], "init container of {}", cluster.nodes[i].name);
    }
    // The init container's mount reached the host (Bidirectional).
    let fs_type = Command::new("stat").args(["-f", "-c", "%T"]).arg(&cluster.bpf.path).output().expect("stat");
    assert_eq!(String::from_utf8_lossy(&fs_type.stdout).trim(), "bpf_fs", "no bpffs at {} on the host", cluster.bpf.path.display());
    for node in &cluster.nodes {
        cluster.wait_ready(node);
        let agent = node.agent.as_ref().expect("agent");
        // Only the chart's capabilities, and no privileges.
        let rendered: BTreeSet<String> =
            node.daemonset["spec"]["template"]["spec"]["containers"][0]["securityContext"]["capabilities"]["add"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|c| format!("CAP_{}", c.as_str().unwrap_or_default()))
                .collect();
        let effective: BTreeSet<String> =
            agent.inspect("{{range .EffectiveCaps}}{{.}} {{end}}").split_whitespace().map(str::to_string).collect();
        assert_eq!(effective, rendered, "the agent container of {} runs with other capabilities than the chart's", node.name);
        assert_eq!(agent.inspect("{{.HostConfig.Privileged}}"), "false");
        // Kubernetes mode, through the stand-in API server.
        let watched = cluster.api.requests().iter().any(|r| r.contains("endpointslices") && r.contains("watch=true"));
        assert!(watched, "no agent watches EndpointSlices on the API server");
        let (addr, path) = node.probe_target("livenessProbe");
        assert!(matches!(cluster.http_get_from_control(addr, &path), Ok((200, _))), "liveness probe {addr}{path} of {}", node.name);
    }

    // Traffic through the ClusterIPs: from every node, exactly the backends
    // explain decides.
    let mut results: Vec<(String, Vec<Tally>)> = Vec::new();
    for n in &scenario.nodes {
        let want = cluster.explain(&n.name, &scenario);
        let mut row = Vec::new();
        for svc in &scenario.services {
            let expected = want.get(&svc.name).unwrap_or_else(|| panic!("explain knows no {}", svc.name));
            let t = eventually(&format!("{} from {} to reach exactly {expected:?}", svc.name, n.name), || {
                let t = tally(&cluster.probe(&n.name, svc.frontend, REQUESTS));
                if t.keys().collect::<BTreeSet<_>>() == expected.iter().collect() { Ok(t) } else { Err(t) }
            });
            row.push(t);
        }
        results.push((n.label(), row));
    }
    println!();
    print_table(&scenario.services, &results);
    println!();

    // A rollout of node-2's pod while its clients keep connecting to every
    // ClusterIP: the old agent stops, the new pod's init container and
    // agent start, and the pinned datapath serves all along.
    let index = 1;
    let node = cluster.nodes[index].name.clone();
    let clients: Vec<(String, Client)> =
        scenario.services.iter().map(|s| (s.name.clone(), Client::start(&cluster, &node, s.frontend))).collect();
    std::thread::sleep(Duration::from_millis(500));
    let exit = cluster.stop_pod(index);
    assert_eq!(exit, "0", "the agent of {node} did not exit cleanly on SIGTERM");
    std::thread::sleep(Duration::from_millis(500));
    let init = cluster.start_pod(index);
    assert_eq!(init.iter().map(|s| s.trim()).collect::<Vec<_>>(), [format!("bpffs already mounted at {}", cluster.bpf.path.display())]);
    cluster.wait_ready(&cluster.nodes[index]);
    let log = cluster.nodes[index].agent.as_ref().expect("agent").logs();
    let frontends = scenario.services.len();
    assert!(log.contains(&format!("adopted_frontends={frontends}")), "the new agent of {node} did not adopt the pinned maps:\n{log}");
    std::thread::sleep(Duration::from_millis(500));
    let want = cluster.explain(&node, &scenario);
    for (svc, client) in clients {
        let (ok, failures, backends) = client.finish();
        println!("rollout of {node}: {svc}: {ok} connections, {} failed, backends {backends:?}", failures.len());
        assert!(ok > 20, "{svc} from {node}: the client made only {ok} connections");
        assert!(failures.is_empty(), "{svc} from {node}: {} connections failed during the rollout, e.g. {:?}", failures.len(), failures[0]);
        assert!(backends.is_subset(&want[&svc]), "{svc} from {node} reached {backends:?}, not only {:?}", want[&svc]);
    }
}
