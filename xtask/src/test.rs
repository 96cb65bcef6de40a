//! `cargo xtask test`: every test of the workspace, the privileged datapath
//! tests included.
//!
//! The lint step (`lint.rs`: rustfmt on both workspaces, clippy with
//! `-D warnings`) runs first; when a check fails, no test runs and the error
//! names the failed checks. Then cargo test, whose own output is passed
//! through unchanged. Once its binaries are built, `vmtest` starts in a
//! thread beside it: the chosen datapath tests on Debian's 5.10, 6.1, 6.12
//! and newest kernels under qemu, reusing the debug binaries just built,
//! one guest while the host's tests run (they leave most of the cores
//! idle, waiting on agents and servers) and two from then on, beside the
//! fuzz and image steps; its report comes after the image step. Because a
//! workspace run ends with the (empty) doc-test
//! result of its last crate, a total over all test binaries and kernels is
//! printed last, as a plain `summary:` line.
//!
//! `--no-vm` (or `TOPOPROXY_NO_VMTEST=1`) leaves the VM run out, for a
//! quicker local loop, and so does selecting packages (`-p NAME`): the VM
//! runs its own fixed set of tests, not the selected ones. Selecting
//! packages leaves the lint step out too, since it checks the whole
//! workspace; `cargo xtask lint` and `cargo xtask vmtest` run each alone.
//! CI and the default run both. Otherwise the VM run is skipped (and its
//! tests counted as skipped) only when qemu cannot be installed or a kernel
//! cannot be downloaded.
//!
//! After the tests, the fuzz step (`fuzz.rs`) runs every cargo-fuzz
//! target for a few seconds; like the VM run it is left out with `-p`.
//!
//! Last, the image step (`image.rs`, also `cargo xtask image --test`)
//! builds the agent's container image and runs it as the chart's
//! DaemonSet; it is left out with `-p`, and skipped with its reason only
//! where podman cannot be installed or cannot run a container.
//!
//! Then the e2e step (`e2e.rs`, also `cargo xtask e2e --conformance`)
//! runs upstream's `[sig-network] Services ... [Conformance]` tests on a
//! one-node cluster with that image as the cluster's proxy, then the
//! disruption run (conn-disrupt clients as pods during a rollout restart
//! of their backends); its node's binaries build beside the tests from the
//! cargo test run on. Left out with `-p`.

use std::io::{BufRead, BufReader, Write};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::libtest::Totals;
use crate::{docs, e2e, fuzz, image, k8s, lint, setup, util, vmtest};

pub(crate) fn run(args: &[String]) -> Result<()> {
    if !util::is_root() {
        bail!(
            "the datapath tests load eBPF programs, attach them to cgroups and create network namespaces, \
             so they need root; run `cargo xtask test` as root"
        );
    }
    let mut steps = Steps::default();
    let started = Instant::now();
    setup::ensure()?;
    // The table's last line counts this run's compiler cache hits.
    crate::compiler_cache::zero_stats();
    steps.done("setup", started);
    let (no_vm, args) = take_no_vm(args);
    let no_vm = no_vm || std::env::var_os(NO_VM_ENV).is_some_and(|v| !v.is_empty() && v != "0");
    let args = &args[..];
    // `-p NAME` narrows the run; otherwise the whole workspace is tested.
    let cargo_args: Vec<&String> = args.iter().take_while(|a| *a != "--").collect();
    let selects = selects_packages(&cargo_args);
    // The real control plane of the real-API-server tests, built from
    // tools/k8s when missing (k8s.rs); the tests find it through the env.
    // Only proxy-agent's tests use it. It builds beside the lint and docs
    // steps: on a fresh machine its module downloads wait on the network
    // and each binary ends in a link on one core, while clippy ends in
    // proxy-agent alone on one core; on a warm machine it is a check.
    let k8s_build = (!selects || selects_package(&cargo_args, "proxy-agent")).then(|| {
        let root = util::workspace_root();
        let started = Instant::now();
        std::thread::spawn(move || (k8s::ensure_binaries(&root), started.elapsed()))
    });
    let k8s_bin = |k8s_build: Option<std::thread::JoinHandle<(Result<std::path::PathBuf>, Duration)>>| {
        k8s_build.map(|h| h.join().unwrap_or_else(|_| (Err(anyhow::anyhow!("the kubernetes build thread panicked")), Duration::ZERO)))
    };
    // The lint step checks the whole workspace, so a run narrowed with `-p`
    // leaves it out, like the VM run. Otherwise it comes before any test:
    // a tree that fails a check is not worth the minutes of the datapath and
    // VM runs, and `lint::check` names every check that failed.
    if selects {
        println!("lint not run: packages were selected with -p (`cargo xtask lint` runs it alone)");
    } else {
        let started = Instant::now();
        // A failed check waits for the Go build, so that none of its
        // processes outlives the run.
        let compiled = match lint::check() {
            Ok(compiled) => compiled,
            Err(e) => {
                k8s_bin(k8s_build);
                return Err(e.context("tests not run"));
            }
        };
        steps.done_compiled("lint (clippy compiles)", started, compiled);
        // The book (docs.rs): built, its links and commands and reference
        // pages checked. Seconds, and like lint a reason not to start the
        // long steps.
        let started = Instant::now();
        if let Err(e) = docs::check() {
            k8s_bin(k8s_build);
            return Err(e.context("tests not run"));
        }
        steps.done("docs (mdbook build, links, reference pages)", started);
    }
    let mut c = util::cargo();
    let waited = Instant::now();
    if let Some((built, took)) = k8s_bin(k8s_build) {
        let dir = built.context("tests not run")?;
        steps.done("kubernetes binaries (tools/k8s), the rest after docs", waited);
        steps.beside("kubernetes binaries (tools/k8s, beside lint and docs)", took);
        c.env(k8s::BIN_ENV, &dir);
    }
    // The e2e step's node (kubelet, containerd, CoreDNS, e2e.test; k8s.rs
    // `--node`) builds beside the host's tests, fuzz and image steps, at
    // the lowest priority (its Go builds run under nice 19): on a fresh
    // machine about ten minutes of CPU that those steps leave idle while
    // they wait on agents, servers and guests; on a warm one a check.
    let node_build = (!selects).then(|| {
        let root = util::workspace_root();
        let started = Instant::now();
        std::thread::spawn(move || (k8s::ensure_node_binaries(&root).map(drop), started.elapsed()))
    });
    util::print_disk("the tests");
    let started = Instant::now();
    c.arg("test");
    if !selects {
        c.arg("--workspace");
    }
    // The build alone first (`--no-run`, the same arguments before `--`),
    // so that the table can tell compiling from running; the run that
    // follows finds everything fresh. A build that fails is reported by
    // that run, which compiles nothing more.
    let build_started = Instant::now();
    let mut build = util::cargo();
    build.args(c.get_args()).args(&cargo_args).arg("--no-run");
    for (k, v) in c.get_envs() {
        match v {
            Some(v) => build.env(k, v),
            None => build.env_remove(k),
        };
    }
    eprintln!("building: {}", util::describe(&build));
    let _ = build.status();
    let test_build = build_started.elapsed();
    // The VM run starts now, in a thread beside the host's tests: its test
    // binaries are the debug ones just built, and the host's tests leave
    // most of the two cores idle while they wait on agents and servers.
    // One guest at a time until the image step ends, then two; its report
    // follows the image step. It runs even when a test fails, so that one
    // run shows every failure.
    let vm = if no_vm {
        println!("\nvmtest not run: --no-vm or {NO_VM_ENV} was given");
        None
    } else if selects {
        println!("\nvmtest not run: packages were selected with -p (`cargo xtask vmtest` runs it alone)");
        None
    } else {
        Some(BackgroundVm::start())
    };
    // Run every test binary even when an earlier one fails, so that one run
    // shows every failure.
    if !cargo_args.iter().any(|a| *a == "--no-fail-fast") {
        c.arg("--no-fail-fast");
    }
    c.args(args);
    eprintln!("running: {}", util::describe(&c));
    c.stdout(Stdio::piped());
    let mut child = c.spawn().with_context(|| format!("cannot run {}", util::describe(&c)))?;
    let mut totals = Totals::default();
    let stdout = child.stdout.take().context("no stdout")?;
    // stdout is locked per line, never across the loop: the VM thread
    // prints its "booting" lines and each guest's console (one write per
    // guest) to the same stdout, and a lock held here for the whole run
    // kept its first line, and so every guest, waiting until cargo test
    // ended (CI log of f96db84: no guest had booted when the fuzz step
    // began).
    for line in BufReader::new(stdout).lines() {
        let line = line?;
        totals.add(&line);
        let mut out = std::io::stdout().lock();
        writeln!(out, "{line}")?;
        out.flush()?;
    }
    let status = child.wait()?;
    steps.done_compiled("cargo test", started, test_build);
    // The second guest lane stays closed through the fuzz and image steps:
    // their builds keep both cores busy, and each guest under TCG takes
    // up to a core from them, while the guests' own work is the same
    // whenever it runs. It opens in `BackgroundVm::finish`, when the host
    // has nothing else to run.
    // The fuzz targets, briefly (fuzz.rs); they follow even when a test
    // failed, like the VM run.
    let fuzz_failed = if selects {
        println!("\nfuzz step not run: packages were selected with -p (`cargo xtask fuzz` runs it alone)");
        None
    } else {
        util::print_disk("the fuzz step");
        let started = Instant::now();
        let mut compiled = Duration::ZERO;
        let failed = fuzz::ci_step(&mut totals, &mut compiled);
        steps.done_compiled("fuzz targets", started, compiled);
        failed
    };
    // The container image, built and run as the chart's DaemonSet
    // (image.rs); like the VM run, it follows even when a test failed.
    let mut agent_image = None;
    let image_failed = if selects {
        println!("\nimage test not run: packages were selected with -p (`cargo xtask image --test` runs it alone)");
        None
    } else {
        util::print_disk("the image step");
        let started = Instant::now();
        let mut compiled = Duration::ZERO;
        let (failed, built) = image::test_step(&mut totals, &mut compiled);
        steps.done_compiled("container image", started, compiled);
        agent_image = built;
        failed
    };
    // Upstream's Services conformance tests on a one-node cluster with the
    // image just built as its proxy (e2e.rs), while one guest lane still
    // runs: the node's pods and the test's own waits leave a core to it.
    let e2e_failed = match node_build {
        None => None,
        Some(handle) => {
            let waited = Instant::now();
            let (node_built, took) =
                handle.join().unwrap_or_else(|_| (Err(anyhow::anyhow!("the node build thread panicked")), Duration::ZERO));
            steps.done("node binaries (tools/k8s-node and others), the rest after the image step", waited);
            steps.beside("node binaries (beside cargo test, fuzz and image)", took);
            match (node_built, &agent_image) {
                (Err(e), _) => {
                    println!("\ne2e not run: building the node failed: {e:#}");
                    totals.failed += 1;
                    Some(format!("e2e: building the node: {e:#}"))
                }
                (Ok(()), None) => {
                    println!("\ne2e not run: the image step built no image");
                    None
                }
                (Ok(()), Some(agent)) => {
                    let started = Instant::now();
                    let failed = e2e::ci_step(agent, &mut totals);
                    steps.done("e2e (Services conformance, disruption run)", started);
                    failed
                }
            }
        }
    };
    let mut vm_failed = None;
    if let Some(vm) = vm {
        let waited = Instant::now();
        let (outcome, took) = vm.finish();
        steps.done("vmtest, the rest after the image step", waited);
        steps.beside("vmtest (older kernels under qemu, from the cargo test run on)", took);
        match outcome {
            Ok(vmtest::Outcome::Skipped { reason, tests }) => {
                println!("\nvmtest skipped ({tests} tests counted as skipped): {reason}");
                totals.ignored += tests;
            }
            Ok(vmtest::Outcome::Ran(runs)) => {
                vmtest::print_report(&runs, &mut totals);
                if runs.iter().any(|r| !r.problems.is_empty() || r.totals.failed > 0) {
                    vm_failed = Some("tests failed on an older kernel".to_string());
                }
            }
            Err(e) => {
                println!("\nvmtest failed: {e:#}");
                totals.failed += 1;
                vm_failed = Some(format!("vmtest: {e:#}"));
            }
        }
    }
    steps.print();
    if let Some(line) = crate::compiler_cache::stats_line() {
        println!("{line}");
    }
    crate::compiler_cache::stop();
    if totals.binaries > 0 {
        totals.print_summary();
    }
    util::print_disk("the end");
    if !status.success() {
        bail!("tests failed ({status})");
    }
    if let Some(why) = fuzz_failed {
        bail!(why);
    }
    if let Some(why) = vm_failed {
        bail!(why);
    }
    if let Some(why) = image_failed {
        bail!(why);
    }
    if let Some(why) = e2e_failed {
        bail!(why);
    }
    Ok(())
}

/// The VM run in a thread of its own, beside the steps that follow the
/// test build (`vmtest::Ready::boot_all` with a lane count that this side
/// raises).
struct BackgroundVm {
    started: Instant,
    lanes: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    /// `Err` when preparing failed before any guest could start.
    run: Result<std::thread::JoinHandle<Result<vmtest::Outcome>>, anyhow::Error>,
}

impl BackgroundVm {
    /// Finds the binaries and fetches the kernels here (cargo and apt, with
    /// their own output), then boots in a thread, one guest at a time
    /// until [`BackgroundVm::open_all_lanes`]. Guests' consoles are printed
    /// per guest once it powers off, not into the host tests' output.
    fn start() -> Self {
        util::print_disk("vmtest");
        let started = Instant::now();
        let opts = vmtest::Options { live: false, ..vmtest::Options::default() };
        let lanes = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(1));
        let run = vmtest::prepare(&opts).map(|prepared| {
            let lanes = lanes.clone();
            std::thread::spawn(move || match prepared {
                vmtest::Prepared::Skipped(outcome) => Ok(outcome),
                vmtest::Prepared::Ready(ready) => ready.boot_all(&opts, &lanes).map(vmtest::Outcome::Ran),
            })
        });
        BackgroundVm { started, lanes, run }
    }

    /// Lets every guest lane run (the host's tests are over).
    fn open_all_lanes(&self) {
        self.lanes.store(usize::MAX, std::sync::atomic::Ordering::Relaxed);
    }

    /// Waits for the last guest; the outcome and the time since
    /// [`BackgroundVm::start`].
    fn finish(self) -> (Result<vmtest::Outcome>, Duration) {
        self.open_all_lanes();
        let outcome = match self.run {
            Ok(handle) => handle.join().unwrap_or_else(|_| Err(anyhow::anyhow!("the vmtest thread panicked"))),
            Err(e) => Err(e),
        };
        (outcome, self.started.elapsed())
    }
}

/// How long each step of the run took, printed as a table at the end:
/// the step's time, and of it the time its cargo builds took (`compile`)
/// and the rest (`run`: tests, guests, fuzzing, podman), where the step
/// builds anything. A step run beside the others (the VM run) is shown
/// with its own time but left out of the total, which is then the run's
/// wall time.
#[derive(Default)]
struct Steps(Vec<Step>);

struct Step {
    name: &'static str,
    took: Duration,
    compiled: Option<Duration>,
    beside: bool,
}

impl Steps {
    fn done(&mut self, name: &'static str, started: Instant) {
        self.0.push(Step { name, took: started.elapsed(), compiled: None, beside: false });
    }

    fn done_compiled(&mut self, name: &'static str, started: Instant, compiled: Duration) {
        let took = started.elapsed();
        self.0.push(Step { name, took, compiled: Some(compiled.min(took)), beside: false });
    }

    fn beside(&mut self, name: &'static str, took: Duration) {
        self.0.push(Step { name, took, compiled: None, beside: true });
    }

    fn print(&self) {
        print!("{}", self.table());
    }

    fn table(&self) -> String {
        let label = |s: &Step| if s.beside { format!("({})", s.name) } else { s.name.to_string() };
        let width = self.0.iter().map(|s| label(s).len()).max().unwrap_or(0).max("total".len());
        let secs = |d: Option<Duration>| d.map_or_else(String::new, |d| format!("{:.1} s", d.as_secs_f64()));
        let mut out = format!("\nstep times:\n  {:<width$}  {:>9}  {:>9}  {:>9}\n", "step", "total", "compile", "run");
        for s in &self.0 {
            let run = s.compiled.map(|c| s.took.saturating_sub(c));
            let row = format!("  {:<width$}  {:>9}  {:>9}  {:>9}", label(s), secs(Some(s.took)), secs(s.compiled), secs(run));
            out.push_str(row.trim_end());
            out.push('\n');
        }
        let total: Duration = self.0.iter().filter(|s| !s.beside).map(|s| s.took).sum();
        let compiled: Duration = self.0.iter().filter_map(|s| s.compiled).sum();
        out.push_str(&format!("  {:<width$}  {:>9}  {:>9}\n", "total", secs(Some(total)), secs(Some(compiled))));
        if self.0.iter().any(|s| s.beside) {
            out.push_str("  (a step in brackets ran beside the others; the total leaves it out)\n");
        }
        out
    }
}

/// Whether cargo's arguments select `package` (in any of the spellings
/// [`selects_packages`] knows).
fn selects_package(cargo_args: &[&String], package: &str) -> bool {
    cargo_args.iter().enumerate().any(|(i, a)| {
        let named = a.strip_prefix("--package=").or_else(|| a.strip_prefix("-p").filter(|p| !p.is_empty()));
        named == Some(package) || ((*a == "-p" || *a == "--package") && cargo_args.get(i + 1).is_some_and(|n| *n == package))
    })
}

/// Whether cargo's arguments select packages (`-p NAME`, `-pNAME`,
/// `--package NAME`, `--package=NAME`).
fn selects_packages(cargo_args: &[&String]) -> bool {
    cargo_args.iter().any(|a| *a == "-p" || a.starts_with("--package") || (a.starts_with("-p") && a.len() > 2))
}

/// The developer opt-out of the VM run, as an environment variable.
const NO_VM_ENV: &str = "TOPOPROXY_NO_VMTEST";

/// Removes xtask's own `--no-vm` from the arguments before `--` (those
/// after it belong to the test binaries); says whether it was there.
fn take_no_vm(args: &[String]) -> (bool, Vec<String>) {
    let mut found = false;
    let mut rest = Vec::with_capacity(args.len());
    let mut after_dashes = false;
    for a in args {
        if a == "--" {
            after_dashes = true;
        }
        if !after_dashes && a == "--no-vm" {
            found = true;
        } else {
            rest.push(a.clone());
        }
    }
    (found, rest)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn package_selection_is_recognised_in_every_spelling() {
        let sel = |s: &[&str]| {
            let v: Vec<String> = s.iter().map(std::string::ToString::to_string).collect();
            selects_packages(&v.iter().collect::<Vec<_>>())
        };
        assert!(sel(&["-p", "xtask"]));
        assert!(sel(&["-pxtask"]));
        assert!(sel(&["--package", "xtask"]));
        assert!(sel(&["--package=xtask"]));
        assert!(!sel(&["--release", "some_test"]));
        assert!(!sel(&[]));
        let one = |s: &[&str]| {
            let v: Vec<String> = s.iter().map(std::string::ToString::to_string).collect();
            selects_package(&v.iter().collect::<Vec<_>>(), "proxy-agent")
        };
        assert!(one(&["-p", "proxy-agent"]) && one(&["-pproxy-agent"]) && one(&["--package=proxy-agent"]));
        assert!(one(&["-p", "xtask", "--package", "proxy-agent"]));
        assert!(!one(&["-p", "xtask"]) && !one(&["-p", "proxy-agent-x"]) && !one(&[]));
    }

    #[test]
    fn the_step_table_splits_compiling_from_running() {
        let mut steps = Steps::default();
        steps.0.push(Step { name: "setup", took: Duration::from_secs(8), compiled: None, beside: false });
        let cargo = Step { name: "cargo test", took: Duration::from_secs(400), compiled: Some(Duration::from_secs(150)), beside: false };
        steps.0.push(cargo);
        let table = steps.table();
        assert!(table.contains("\n  setup           8.0 s\n"), "{table}");
        assert!(table.contains("\n  cargo test    400.0 s    150.0 s    250.0 s\n"), "{table}");
        assert!(table.contains("\n  total         408.0 s    150.0 s\n"), "{table}");
        // A step beside the others is shown, not added to the total.
        steps.beside("vm", Duration::from_secs(500));
        let table = steps.table();
        assert!(table.contains("\n  (vm)          500.0 s\n"), "{table}");
        assert!(table.contains("\n  total         408.0 s    150.0 s\n"), "{table}");
    }

    #[test]
    fn no_vm_is_taken_out_only_before_the_test_binaries_arguments() {
        let v = |s: &[&str]| s.iter().map(std::string::ToString::to_string).collect::<Vec<_>>();
        assert_eq!(take_no_vm(&v(&["--no-vm", "-p", "xtask"])), (true, v(&["-p", "xtask"])));
        assert_eq!(take_no_vm(&v(&["-p", "xtask", "--", "--no-vm"])), (false, v(&["-p", "xtask", "--", "--no-vm"])));
        assert_eq!(take_no_vm(&[]), (false, vec![]));
    }
}
