//! `cargo xtask k8s`: the real Kubernetes control plane the real-API-server
//! tests (`proxy-agent/tests/real_apiserver.rs`, through
//! `proxy_test_support::real_cluster`) start: etcd, kube-apiserver,
//! kube-controller-manager, kubectl and kube-proxy, built from Go modules. With
//! `--node`, also what the one-node cluster of `cargo xtask e2e` adds
//! (issue #36): kubelet, kube-scheduler, agnhost, the e2e test binary,
//! containerd with its runc shim and ctr, and CoreDNS.
//!
//! The versions are pinned in Go modules of our own under `tools/`:
//! `tools/k8s` (the control plane; see its `tools.go` for how its replace
//! lines were made), `tools/k8s-node` (the node's Kubernetes parts and the
//! e2e package, at the same release, apart so that changing it does not
//! rebuild the control plane), `tools/containerd` and `tools/coredns`.
//! Each `go.sum` is committed, so a fresh clone builds without `go mod
//! tidy` and without changing either file (`-mod=readonly`). Each binary
//! goes to `target/k8s/<version>/`, `<version>` being k8s.io/kubernetes' in
//! tools/k8s/go.mod, built with `CGO_ENABLED=0 go build -trimpath` under
//! `nice -n 19` (the machine is shared) and the version stamped in as the
//! projects' own release builds do. A binary that exists and is newer
//! than its module's go.mod and go.sum (and, for the e2e binary, its test
//! source) is kept: a cold build of the control plane takes about 9
//! minutes on 2 cores (kube-apiserver alone about 4), a warm one seconds;
//! the node's parts are in the developer guide's e2e page. Go's build and
//! module caches stay where Go keeps them.
//!
//! This is the only step that needs Go; `cargo xtask setup` does not
//! install it. `cargo xtask test` runs this (without `--node`) before the
//! workspace's tests and hands the directory to them as `TOPOPROXY_K8S_BIN`.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Instant, SystemTime};

use anyhow::{Context, Result, bail};

use crate::util;

/// The environment variable the tests read the binaries' directory from.
pub(crate) const BIN_ENV: &str = "TOPOPROXY_K8S_BIN";

/// How a binary is built.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Build {
    /// `go build`, with Kubernetes' version stamps.
    Kubernetes,
    /// `go test -c` of a package of ours, with Kubernetes' version stamps.
    KubernetesTest,
    /// `go build`, with containerd's version stamp.
    Containerd,
    /// `go build`; the version is compiled in.
    Plain,
}

/// One binary: its name, the module directory under tools/, the module
/// whose version it reports, its main (or test) package, how it is built.
struct Tool {
    bin: &'static str,
    dir: &'static str,
    module: &'static str,
    package: &'static str,
    build: Build,
}

const fn tool(bin: &'static str, dir: &'static str, module: &'static str, package: &'static str, build: Build) -> Tool {
    Tool { bin, dir, module, package, build }
}

/// The control plane, from tools/k8s.
const CONTROL_PLANE: [Tool; 5] = [
    tool("etcd", "k8s", ETCD_MODULE, ETCD_MODULE, Build::Plain),
    tool("kube-apiserver", "k8s", KUBERNETES_MODULE, "k8s.io/kubernetes/cmd/kube-apiserver", Build::Kubernetes),
    tool("kube-controller-manager", "k8s", KUBERNETES_MODULE, "k8s.io/kubernetes/cmd/kube-controller-manager", Build::Kubernetes),
    tool("kubectl", "k8s", KUBERNETES_MODULE, "k8s.io/kubernetes/cmd/kubectl", Build::Kubernetes),
    // The oracle of the differential tests and the benchmarks' peer (#45):
    // real kube-proxy, run only inside network namespaces the tests create.
    tool("kube-proxy", "k8s", KUBERNETES_MODULE, "k8s.io/kubernetes/cmd/kube-proxy", Build::Kubernetes),
];

/// What the e2e node adds (`--node`).
const NODE: [Tool; 8] = [
    tool("kubelet", "k8s-node", KUBERNETES_MODULE, "k8s.io/kubernetes/cmd/kubelet", Build::Kubernetes),
    tool("kube-scheduler", "k8s-node", KUBERNETES_MODULE, "k8s.io/kubernetes/cmd/kube-scheduler", Build::Kubernetes),
    tool("agnhost", "k8s-node", KUBERNETES_MODULE, "k8s.io/kubernetes/test/images/agnhost", Build::Kubernetes),
    // Our package of upstream's e2e suite with only [sig-network] linked in.
    tool("e2e.test", "k8s-node", KUBERNETES_MODULE, "./e2e", Build::KubernetesTest),
    tool("containerd", "containerd", CONTAINERD_MODULE, "github.com/containerd/containerd/v2/cmd/containerd", Build::Containerd),
    tool(
        "containerd-shim-runc-v2",
        "containerd",
        CONTAINERD_MODULE,
        "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2",
        Build::Containerd,
    ),
    tool("ctr", "containerd", CONTAINERD_MODULE, "github.com/containerd/containerd/v2/cmd/ctr", Build::Containerd),
    tool("coredns", "coredns", COREDNS_MODULE, COREDNS_MODULE, Build::Plain),
];
const KUBERNETES_MODULE: &str = "k8s.io/kubernetes";
const ETCD_MODULE: &str = "go.etcd.io/etcd/server/v3";
const CONTAINERD_MODULE: &str = "github.com/containerd/containerd/v2";
const COREDNS_MODULE: &str = "github.com/coredns/coredns";
/// containerd's snapshotters that need cgo (btrfs) or are not used here:
/// left out, as its static release builds do.
const CONTAINERD_TAGS: &str = "no_btrfs,no_devmapper,no_zfs";

/// Prometheus Operator's module, whose `example/prometheus-operator-crd/`
/// holds the CustomResourceDefinitions it installs. The chart test that
/// renders `metrics.serviceMonitor.enabled: auto` against the real API
/// server installs its ServiceMonitor CRD, so that the object the chart
/// renders is checked against the operator's own schema.
const PROMETHEUS_OPERATOR: (&str, &str) = ("github.com/prometheus-operator/prometheus-operator", "v0.85.0");
/// Where that CRD is kept, in the binaries' directory.
pub(crate) const SERVICE_MONITOR_CRD: &str = "monitoring.coreos.com_servicemonitors.yaml";

/// Where Go's official tarball installs itself, for a machine whose PATH
/// does not have it.
const GO_FALLBACK: &str = "/usr/local/go/bin/go";

/// `cargo xtask k8s [--node]`.
pub(crate) fn run(node: bool) -> Result<()> {
    let root = util::workspace_root();
    let dir = ensure_binaries(&root)?;
    if node {
        ensure_node_binaries(&root)?;
    }
    println!("k8s: binaries in {} (export {BIN_ENV}={})", dir.display(), dir.display());
    Ok(())
}

/// Builds the control plane's binaries that are missing or older than
/// tools/k8s/go.mod and go.sum into `<root>/target/k8s/<version>/` and
/// returns that directory.
pub(crate) fn ensure_binaries(root: &Path) -> Result<PathBuf> {
    let out = out_dir(root)?;
    build_missing(root, &out, &CONTROL_PLANE)?;
    let crd = out.join(SERVICE_MONITOR_CRD);
    if !crd.is_file() {
        let go_mod = read_go_mod(root, "k8s")?;
        fetch_service_monitor_crd(&go_binary(&go_mod)?, &out)?;
    }
    Ok(out)
}

/// Builds what the e2e node needs besides the control plane (see the
/// module documentation) into the same directory, and returns it.
pub(crate) fn ensure_node_binaries(root: &Path) -> Result<PathBuf> {
    let out = out_dir(root)?;
    let (control_plane, node) = (read_go_mod(root, "k8s")?, read_go_mod(root, "k8s-node")?);
    let (a, b) = (required_version(&control_plane, KUBERNETES_MODULE), required_version(&node, KUBERNETES_MODULE));
    if a != b {
        bail!("tools/k8s requires {KUBERNETES_MODULE} {a:?} but tools/k8s-node {b:?}: the node must run the control plane's release");
    }
    build_missing(root, &out, &NODE)?;
    Ok(out)
}

fn read_go_mod(root: &Path, dir: &str) -> Result<String> {
    let path = root.join("tools").join(dir).join("go.mod");
    std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))
}

/// `<root>/target/k8s/<version>/`, created.
fn out_dir(root: &Path) -> Result<PathBuf> {
    let go_mod = read_go_mod(root, "k8s")?;
    let version = required_version(&go_mod, KUBERNETES_MODULE)
        .with_context(|| format!("no `{KUBERNETES_MODULE} vX.Y.Z` requirement in tools/k8s/go.mod"))?;
    let out = root.join("target/k8s").join(version);
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    Ok(out)
}

/// The newest modification time of `paths`.
fn newest(paths: &[PathBuf]) -> Result<SystemTime> {
    let times = paths
        .iter()
        .map(|p| std::fs::metadata(p).and_then(|m| m.modified()).with_context(|| format!("reading {}", p.display())))
        .collect::<Result<Vec<SystemTime>>>()?;
    Ok(times.into_iter().max().unwrap_or(SystemTime::UNIX_EPOCH))
}

/// Builds each tool of `tools` whose binary in `out` is missing or older
/// than its inputs; returns how many were built.
fn build_missing(root: &Path, out: &Path, tools: &[Tool]) -> Result<usize> {
    let mut built = 0;
    let mut downloaded: Vec<&str> = Vec::new();
    for t in tools {
        let module = root.join("tools").join(t.dir);
        let go_mod = read_go_mod(root, t.dir)?;
        let mut inputs = vec![module.join("go.mod"), module.join("go.sum")];
        if t.build == Build::KubernetesTest {
            let package = module.join(t.package.trim_start_matches("./"));
            for e in std::fs::read_dir(&package).with_context(|| format!("reading {}", package.display()))? {
                inputs.push(e?.path());
            }
        }
        let newest_input = newest(&inputs)?;
        let shown = required_version(&go_mod, t.module).unwrap_or_else(|| "?".into());
        let binary = out.join(t.bin);
        if std::fs::metadata(&binary).and_then(|m| m.modified()).is_ok_and(|b| b > newest_input) {
            println!("k8s: {} {shown} present", t.bin);
            continue;
        }
        let go = go_binary(&go_mod)?;
        if !downloaded.contains(&t.dir) {
            download_modules(&go, &module)?;
            downloaded.push(t.dir);
        }
        let ldflags = match t.build {
            Build::Kubernetes | Build::KubernetesTest => ldflags(&shown)?,
            Build::Containerd => format!("-s -w -X {CONTAINERD_MODULE}/version.Version={shown}"),
            Build::Plain => "-s -w".to_string(),
        };
        println!("k8s: building {} {shown} ({}; minutes on a cold Go build cache)", t.bin, t.package);
        let started = Instant::now();
        let partial = out.join(format!("{}.partial", t.bin));
        // Lowest priority: the machine is shared, and Go uses every core.
        let mut c = util::cmd("nice");
        c.current_dir(&module).env("CGO_ENABLED", "0").args(["-n", "19"]).arg(&go);
        if t.build == Build::KubernetesTest {
            // go test runs vet on the package first: not wanted for a build.
            c.args(["test", "-c", "-vet=off"]);
        } else {
            c.arg("build");
        }
        c.args(["-trimpath", "-mod=readonly", "-buildvcs=false", "-ldflags", &ldflags]);
        if t.build == Build::Containerd {
            c.args(["-tags", CONTAINERD_TAGS]);
        }
        c.arg("-o").arg(&partial).arg(t.package);
        util::run(&mut c).with_context(|| format!("building {} {shown} in {}", t.bin, module.display()))?;
        // Renamed into place only when complete: an interrupted build
        // leaves no binary that the next run would take for a good one.
        std::fs::rename(&partial, &binary).with_context(|| format!("moving {} into place", partial.display()))?;
        println!("k8s: built {} {shown} in {} s", t.bin, started.elapsed().as_secs());
        built += 1;
    }
    Ok(built)
}

/// The version of `module` that go.mod requires (`v1.37.2` for
/// k8s.io/kubernetes).
fn required_version(go_mod: &str, module: &str) -> Option<String> {
    go_mod.lines().find_map(|l| {
        let mut words = l.trim_start_matches("require").split_whitespace();
        (words.next() == Some(module)).then(|| words.next()).flatten().filter(|v| v.starts_with('v')).map(str::to_string)
    })
}

/// The `go` directive of go.mod (`1.26.0`).
fn go_directive(go_mod: &str) -> Option<&str> {
    go_mod.lines().find_map(|l| l.strip_prefix("go ")).map(str::trim)
}

/// `-s -w` and the version stamps Kubernetes' release builds set
/// (hack/lib/version.sh): what `kubectl version` and the API server's
/// /version report. etcd has its version compiled in.
fn ldflags(version: &str) -> Result<String> {
    let numbers = version.strip_prefix('v').unwrap_or(version);
    let mut parts = numbers.split('.');
    let (Some(major), Some(minor)) = (parts.next(), parts.next()) else { bail!("cannot read major and minor of {version}") };
    let mut flags = String::from("-s -w");
    for package in ["k8s.io/component-base/version", "k8s.io/client-go/pkg/version"] {
        for (var, value) in [("gitVersion", version), ("gitMajor", major), ("gitMinor", minor), ("gitTreeState", "clean")] {
            flags.push_str(&format!(" -X {package}.{var}={value}"));
        }
    }
    Ok(flags)
}

/// `go` from PATH, else from [`GO_FALLBACK`]; fails saying that Go is
/// missing, or too old for go.mod's `go` directive.
fn go_binary(go_mod: &str) -> Result<PathBuf> {
    let need = go_directive(go_mod).unwrap_or("0");
    let found = ["go", GO_FALLBACK].into_iter().find_map(|go| {
        let v = util::output(util::cmd(go).args(["env", "GOVERSION"]))?;
        Some((PathBuf::from(go), v.trim().to_string()))
    });
    let Some((go, have)) = found else {
        bail!(
            "Go is not installed (no `go` on PATH, nor {GO_FALLBACK}); building etcd, kube-apiserver, \
             kube-controller-manager and kubectl for the real-API-server tests needs Go {need} or newer \
             (https://go.dev/dl/), and only this step needs it"
        );
    };
    if version_numbers(have.trim_start_matches("go")) < version_numbers(need) {
        bail!("{} is {have}, older than the Go {need} that tools/k8s/go.mod needs; install Go {need} or newer", go.display());
    }
    Ok(go)
}

/// `1.26.8` -> [1, 26, 8], for comparing; stops at the first part that is
/// not a number (`1.27rc1` -> [1]).
fn version_numbers(v: &str) -> Vec<u64> {
    v.split('.').map_while(|p| p.parse().ok()).collect()
}

/// Copies [`SERVICE_MONITOR_CRD`] out of Prometheus Operator's module
/// (`go mod download`, about 4 MB, into Go's module cache) into `out`.
/// Run outside tools/k8s, so that its go.mod and go.sum stay as committed.
fn fetch_service_monitor_crd(go: &Path, out: &Path) -> Result<()> {
    let (module, version) = PROMETHEUS_OPERATOR;
    let mut c = util::cmd(go);
    c.current_dir(out).env("GO111MODULE", "on").args(["mod", "download", "-json", &format!("{module}@{version}")]);
    let listing = util::output(&mut c).with_context(|| format!("the Go module proxy failed: `go mod download {module}@{version}`"))?;
    let info: serde_json::Value = serde_json::from_str(&listing).with_context(|| format!("reading `go mod download -json`: {listing}"))?;
    let dir = info["Dir"].as_str().with_context(|| format!("`go mod download -json` names no Dir: {listing}"))?;
    let from = Path::new(dir).join("example/prometheus-operator-crd").join(SERVICE_MONITOR_CRD);
    std::fs::copy(&from, out.join(SERVICE_MONITOR_CRD)).with_context(|| format!("copying {}", from.display()))?;
    println!("k8s: ServiceMonitor CRD of Prometheus Operator {version} in {}", out.display());
    Ok(())
}

/// `go mod download`: fetches every module go.mod lists (a no-op when the
/// module cache has them), so that a proxy that cannot be reached is told
/// apart from a failing build.
fn download_modules(go: &Path, module: &Path) -> Result<()> {
    let mut c = util::cmd(go);
    c.current_dir(module).args(["mod", "download"]).stdout(Stdio::null()).stderr(Stdio::piped());
    let out = c.output().with_context(|| format!("cannot run {}", util::describe(&c)))?;
    if !out.status.success() {
        let proxy = util::output(util::cmd(go).args(["env", "GOPROXY"])).unwrap_or_default();
        bail!(
            "the Go module proxy failed: `go mod download` in {} could not fetch the modules of go.mod (GOPROXY={}): {}",
            module.display(),
            proxy.trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const GO_MOD: &str = "module topoproxy.test/tools/k8s\n\ngo 1.26.0\n\nrequire (\n\tgo.etcd.io/etcd/server/v3 v3.7.0\n\tk8s.io/kubernetes v1.37.2\n)\n\nreplace (\n\tk8s.io/api => k8s.io/api v0.37.2\n)\n";

    #[test]
    fn the_version_and_go_directive_are_read_from_go_mod() {
        assert_eq!(required_version(GO_MOD, KUBERNETES_MODULE).as_deref(), Some("v1.37.2"));
        assert_eq!(required_version(GO_MOD, ETCD_MODULE).as_deref(), Some("v3.7.0"));
        assert_eq!(required_version("require k8s.io/kubernetes v1.36.0\n", KUBERNETES_MODULE).as_deref(), Some("v1.36.0"));
        assert_eq!(required_version("replace k8s.io/api => k8s.io/api v0.37.2\n", "k8s.io/api"), None);
        assert_eq!(go_directive(GO_MOD), Some("1.26.0"));
    }

    #[test]
    fn the_repository_pins_a_version() {
        let go_mod = std::fs::read_to_string(util::workspace_root().join("tools/k8s/go.mod")).unwrap();
        assert!(required_version(&go_mod, KUBERNETES_MODULE).is_some_and(|v| v.starts_with("v1.")), "{go_mod}");
    }

    #[test]
    fn the_version_is_stamped_like_a_release_build() {
        let f = ldflags("v1.37.2").unwrap();
        assert!(f.starts_with("-s -w "), "{f}");
        assert!(f.contains(" -X k8s.io/component-base/version.gitVersion=v1.37.2"), "{f}");
        assert!(f.contains(" -X k8s.io/client-go/pkg/version.gitMinor=37"), "{f}");
        assert!(f.contains(" -X k8s.io/component-base/version.gitMajor=1"), "{f}");
    }

    #[test]
    fn go_versions_compare_by_number() {
        assert!(version_numbers("1.26.8") >= version_numbers("1.26.0"));
        assert!(version_numbers("1.3") < version_numbers("1.26.0"));
        assert!(version_numbers("1.27") > version_numbers("1.26.0"));
    }
}
