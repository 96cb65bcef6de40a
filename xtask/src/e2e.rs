//! `cargo xtask e2e`: upstream Kubernetes' own `[sig-network] Services`
//! tests against the agent, on a real one-node cluster on this machine
//! (issue #36), with nothing from an image registry:
//!
//! 1. The binaries: the control plane of `cargo xtask k8s` and the node's
//!    parts of `cargo xtask k8s --node` (kubelet, kube-scheduler, agnhost,
//!    `e2e.test` with only sig-network linked in, containerd, CoreDNS).
//! 2. The images: the agent's (`cargo xtask image`), and agnhost, pause,
//!    busybox and CoreDNS (`e2e::images`).
//! 3. The node (`e2e::node`): etcd, kube-apiserver, kube-controller-manager
//!    with every default controller, kube-scheduler, containerd and kubelet
//!    in namespaces and a cgroup of their own; no kube-proxy.
//! 4. CoreDNS as the cluster DNS (`e2e/coredns.yaml`), and the agent as the
//!    cluster's proxy: the chart rendered by Helm's engine (the chart
//!    tests' environment) and applied.
//! 5. `e2e.test --provider=skeleton --ginkgo.focus=... --ginkgo.skip=...`
//!    in the node's network namespace and cgroup, with the skip list of
//!    `tools/k8s-node/e2e-skips.txt`; the JUnit report and the run's log
//!    in `target/e2e/`, the components' and pods' logs in
//!    `target/e2e/logs/`.
//!
//! 6. The disruption run (`e2e::disruption`): the connection-disruption
//!    suite's clients as pods during `kubectl rollout restart` of their
//!    backend Deployment; its table in `target/e2e/disruption/`.
//!
//! `cargo xtask test` runs the `[Conformance]` ones and the disruption run
//! after its image step ([`ci_step`]), against the image that step built.
//! Needs root.

mod disruption;
mod images;
mod node;
mod skips;

use std::fs;
use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use serde_json::json;

use crate::libtest::Totals;
use crate::{chart_env, image, k8s, setup, util};

/// The tests `cargo xtask e2e` runs by default.
const FOCUS: &str = r"\[sig-network\] Services";
/// `--conformance`: the Conformance ones among them.
const CONFORMANCE_FOCUS: &str = r"\[sig-network\] Services.*\[Conformance\]";
/// What the node needs from Debian: runc, the CNI plugins, mmdebstrap
/// for agnhost's root filesystem, podman for the agent's image, openssl
/// for the keys.
const PACKAGES: [&str; 5] = ["runc", "containernetworking-plugins", "mmdebstrap", "podman", "openssl"];
/// The release and namespace the chart is installed as.
const RELEASE: &str = "topoproxy";
const NAMESPACE: &str = "kube-system";

/// `cargo xtask e2e [--focus REGEX | --conformance | --disruption-only]`.
pub(crate) fn run(focus: Option<String>, conformance: bool, disruption_only: bool) -> Result<()> {
    if !util::is_root() {
        bail!("the e2e node (namespaces, cgroups, mounts, eBPF) needs root; run as root");
    }
    let started = Instant::now();
    setup::ensure()?;
    setup::ensure_debian_packages(&PACKAGES, false)?;
    warn_if_uncommitted();
    let agent = image::build()?;
    let focus = focus.unwrap_or_else(|| if conformance { CONFORMANCE_FOCUS } else { FOCUS }.to_string());
    let outcome = run_on_node(&agent, (!disruption_only).then_some(focus.as_str()))?;
    println!("e2e: done in {:.0?}", started.elapsed());
    if !outcome.ok() {
        bail!("e2e failed (JUnit report, logs and the disruption table in {})", util::target_dir().join("e2e").display());
    }
    Ok(())
}

/// The image is built from the work tree: say so when what goes into it
/// has uncommitted changes, so a result is not taken for HEAD's.
fn warn_if_uncommitted() {
    let out = std::process::Command::new("git")
        .current_dir(util::workspace_root())
        .args(["status", "--porcelain", "--", "proxy-agent", "proxy-ebpf", "proxy-common", "charts"])
        .output();
    if let Ok(out) = out {
        let changed: Vec<String> = String::from_utf8_lossy(&out.stdout).lines().map(|l| l.get(3..).unwrap_or(l).to_string()).collect();
        if !changed.is_empty() {
            println!("e2e: note: the agent's image is built from the work tree, which has uncommitted changes: {}", changed.join(", "));
        }
    }
}

/// `cargo xtask test`'s e2e step (issue #36): the `[Conformance]` tests
/// of `[sig-network] Services` that fit one node, against `agent`, the
/// image step's build. The tests that ran are added to `totals`. Returns
/// why the step failed, `None` when it passed.
pub(crate) fn ci_step(agent: &image::Built, totals: &mut Totals) -> Option<String> {
    println!(
        "
e2e: upstream's [sig-network] Services [Conformance] tests on a one-node cluster, then the disruption run (`cargo xtask e2e --conformance`)"
    );
    let outcome = setup::ensure_debian_packages(&PACKAGES, false).and_then(|()| run_on_node(agent, Some(CONFORMANCE_FOCUS)));
    match outcome {
        Ok(o) => {
            // Only what ran counts: e2e.test reports every test it links
            // that the focus leaves out as skipped (about a thousand). The
            // disruption run counts as one test.
            totals.passed += o.passed + u64::from(o.disruption_ok);
            totals.failed += o.failed + u64::from(!o.disruption_ok);
            (!o.ok()).then(|| {
                format!(
                    "e2e: {} of the Conformance tests failed{} (JUnit report, logs and the disruption table in target/e2e/)",
                    o.failed,
                    if o.disruption_ok { "" } else { ", the disruption run failed" }
                )
            })
        }
        Err(e) => {
            println!("e2e failed: {e:#}");
            totals.failed += 1;
            Some(format!("e2e: {e:#}"))
        }
    }
}

/// What one `e2e.test` run and the disruption run reported.
struct Outcome {
    passed: u64,
    failed: u64,
    /// e2e.test itself exited with success (or did not run).
    exited_ok: bool,
    /// Nothing in the disruption run failed.
    disruption_ok: bool,
}

impl Outcome {
    fn ok(&self) -> bool {
        self.exited_ok && self.failed == 0 && self.disruption_ok
    }
}

/// Builds what the node needs, starts it with `agent` as its proxy, runs
/// the tests `focus` names (less the skip list), then the disruption run.
/// The node is removed before this returns, whatever happened.
fn run_on_node(agent: &image::Built, focus: Option<&str>) -> Result<Outcome> {
    let started = Instant::now();
    chart_env::ensure()?;
    let root = util::workspace_root();
    let bin = k8s::ensure_binaries(&root)?;
    k8s::ensure_node_binaries(&root)?;
    let skip_file = root.join("tools/k8s-node/e2e-skips.txt");
    let skips = skips::parse(&fs::read_to_string(&skip_file).with_context(|| format!("reading {}", skip_file.display()))?)?;
    let out = util::target_dir().join("e2e");
    fs::create_dir_all(&out)?;
    let test_images = images::build(&out.join("images"), &bin, node::PAUSE_IMAGE)?;
    println!("e2e: binaries and images ready after {:.0?}", started.elapsed());

    let node = node::Node::start(&bin, &out.join("logs"))?;
    node.import_images(&test_images)?;
    node.import_images(&agent.archive)?;
    install_coredns(&node)?;
    install_agent(&node, &agent.local_name)?;
    node.wait("CoreDNS and the agent to be ready", || {
        node.kubectl(&["-n", NAMESPACE, "rollout", "status", "deployment/coredns", "--timeout=2s"])?;
        node.kubectl(&["-n", NAMESPACE, "rollout", "status", &format!("daemonset/{RELEASE}"), "--timeout=2s"]).map(drop)
    })?;
    println!("e2e: CoreDNS and the agent ready after {:.0?}", started.elapsed());
    let mut outcome = match focus {
        Some(focus) => run_tests(&node, &bin, &out, focus, &skips::ginkgo_skip(&skips))?,
        None => Outcome { passed: 0, failed: 0, exited_ok: true, disruption_ok: true },
    };
    outcome.disruption_ok = run_disruption(&node, &agent.local_name, &out.join("disruption"));
    Ok(outcome)
}

/// The disruption run; prints its table and whatever failed.
fn run_disruption(node: &node::Node, image: &str, out: &Path) -> bool {
    println!("e2e: the disruption run: conn-disrupt clients as pods during `kubectl rollout restart` of their backends");
    let started = Instant::now();
    match disruption::run(node, image, out) {
        Ok(report) => {
            println!("{}", report.table);
            for p in &report.problems {
                println!("  FAILED: {p}");
            }
            println!(
                "e2e: disruption run {} in {:.0?}: {} exchanges, {} problems (clients' logs in {})",
                if report.problems.is_empty() { "passed" } else { "FAILED" },
                started.elapsed(),
                report.exchanges,
                report.problems.len(),
                out.display()
            );
            report.problems.is_empty()
        }
        Err(e) => {
            println!("e2e: the disruption run failed: {e:#}");
            false
        }
    }
}

/// CoreDNS in kube-system behind the `kube-dns` Service at the cluster
/// DNS address kubelet hands to pods.
fn install_coredns(node: &node::Node) -> Result<()> {
    let manifest = include_str!("e2e/coredns.yaml").replace("@IMAGE@", images::COREDNS).replace("@DNS_IP@", node::DNS_IP);
    node.kubectl_stdin(&["apply", "-f", "-"], Some(&manifest)).map(drop).context("installing CoreDNS")
}

/// `helm install` of `charts/topoproxy` with Helm's own engine (the chart
/// tests' helm-python environment, in the node's network namespace to
/// reach its API server): the image just built (never pulled), the node's
/// cgroup v2 directory and bpffs, the API server's address (there is no
/// kube-proxy to reach its ClusterIP before the agent runs), `node0` as
/// the device. The release is recorded as Helm records one (a Secret).
fn install_agent(node: &node::Node, local_name: &str) -> Result<()> {
    let (repository, tag) = local_name.rsplit_once(':').with_context(|| format!("{local_name} has no tag"))?;
    let values = json!({
        "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
        "cgroup": {"hostRoot": node.cgroup_v2()},
        "bpf": {"root": node.bpffs()},
        "kubernetes": {"apiServerHost": node::NODE_IP, "apiServerPort": node::APISERVER_PORT.to_string()},
        "devices": ["node0"],
        "resources": {"requests": {"cpu": "10m", "memory": "64Mi"}},
    });
    let home = util::target_dir().join("e2e/helm-home");
    fs::create_dir_all(&home)?;
    let mut c = node.command(&chart_env::venv_dir().join("bin/python"), false);
    c.arg("-c")
        .arg(INSTALL)
        .arg(util::workspace_root().join("charts/topoproxy"))
        .args([RELEASE, NAMESPACE])
        .arg(node.kubeconfig())
        .arg(values.to_string())
        .env("PYTHONDONTWRITEBYTECODE", "1")
        // Helm's caches go under target/, not the user's home.
        .env("HOME", &home)
        .env("XDG_CACHE_HOME", home.join("cache"));
    let out = c.output().context("running helm install (helm-python)")?;
    if !out.status.success() {
        bail!("helm install of the chart failed: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    println!("e2e: helm install {RELEASE} charts/topoproxy -n {NAMESPACE}: {}", String::from_utf8_lossy(&out.stdout).trim());
    Ok(())
}

/// `helm install` through helm-python (Helm's Go library): the release
/// stored as a Secret in the namespace, as the helm CLI does.
const INSTALL: &str = r#"
import json, pathlib, sys
import helm_python as helm
chart_dir, release, namespace, kubeconfig, values = sys.argv[1:6]
config = helm.Config(kubeconfig_path=kubeconfig, namespace=namespace)
with helm.Chart.load(pathlib.Path(chart_dir)) as chart:
    installed = config.install(chart, release, values=json.loads(values), namespace=namespace)
print(f"release {installed.get('name', release)} installed")
"#;

/// Runs e2e.test in the node; its log in `out/e2e.log`, its JUnit report
/// in `out/junit_01.xml`. Prints the results and returns their counts.
fn run_tests(node: &node::Node, bin: &Path, out: &Path, focus: &str, skip: &str) -> Result<Outcome> {
    let _ = fs::remove_file(out.join("junit_01.xml"));
    let log = out.join("e2e.log");
    let file = fs::File::create(&log)?;
    let mut c = node.command(&bin.join("e2e.test"), false);
    c.arg("--provider=skeleton")
        .arg(format!("--kubeconfig={}", node.kubeconfig().display()))
        .arg(format!("--ginkgo.focus={focus}"))
        .arg(format!("--ginkgo.skip={skip}"))
        .arg(format!("--report-dir={}", out.display()))
        .args(["--ginkgo.no-color", "--ginkgo.timeout=3h"])
        .current_dir(out)
        .stdout(file.try_clone()?)
        .stderr(file);
    println!("e2e: running e2e.test --ginkgo.focus='{focus}' (the skip list: tools/k8s-node/e2e-skips.txt); follow {}", log.display());
    let started = Instant::now();
    let status = c.status().context("cannot run e2e.test")?;
    let junit = fs::read_to_string(out.join("junit_01.xml"))
        .with_context(|| format!("e2e.test ({status}) wrote no JUnit report; see {}", log.display()))?;
    let results = junit_results(&junit);
    for (name, result) in &results {
        if *result != "skipped" {
            println!("  {result:7} {name}");
        }
    }
    let count = |r: &str| results.iter().filter(|(_, x)| *x == r).count() as u64;
    println!(
        "e2e: {} passed, {} failed, {} skipped in {:.0?} (JUnit: {})",
        count("passed"),
        count("failed"),
        count("skipped"),
        started.elapsed(),
        out.join("junit_01.xml").display()
    );
    Ok(Outcome { passed: count("passed"), failed: count("failed"), exited_ok: status.success(), disruption_ok: true })
}

/// (name, passed|failed|skipped) of each `<testcase>` of a JUnit report,
/// the suite's own set-up and tear-down nodes left out.
fn junit_results(xml: &str) -> Vec<(String, &'static str)> {
    let mut results = Vec::new();
    for case in xml.split("<testcase ").skip(1) {
        let body = case.split("</testcase>").next().unwrap_or(case);
        let Some(name) = body.split("name=\"").nth(1).and_then(|r| r.split('"').next()) else { continue };
        let name = name.replace("&#34;", "\"").replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">").replace("&#39;", "'");
        if name.starts_with("[Synchronized") || name.starts_with("[ReportAfterSuite]") || name.starts_with("[ReportBeforeSuite]") {
            continue;
        }
        let result = if body.contains("<failure") || body.contains("<error") {
            "failed"
        } else if body.contains("<skipped") {
            "skipped"
        } else {
            "passed"
        };
        results.push((name, result));
    }
    results
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn junit_cases_are_counted_by_outcome() {
        let xml = r#"<testsuite><testcase name="[SynchronizedBeforeSuite]" status="passed"></testcase>
<testcase name="[sig-network] Services should a &#34;b&#34;" status="passed"><system-err>x</system-err></testcase>
<testcase name="[sig-network] Services should c" status="failed"><failure message="m">f</failure></testcase>
<testcase name="[sig-network] Services should d" status="skipped"><skipped message="s"></skipped></testcase></testsuite>"#;
        let r = junit_results(xml);
        assert_eq!(
            r,
            vec![
                ("[sig-network] Services should a \"b\"".to_string(), "passed"),
                ("[sig-network] Services should c".to_string(), "failed"),
                ("[sig-network] Services should d".to_string(), "skipped"),
            ]
        );
    }
}
