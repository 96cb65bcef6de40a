//! `cargo xtask`: the project's developer commands.
//!
//! - `setup`: install what is missing (nightly rust-src, rustfmt and
//!   clippy, Debian packages, bpf-linker). Idempotent, and a fast no-op
//!   when everything is present.
//! - `build-ebpf`: build the agent, which builds and embeds the eBPF object.
//! - `lint`: `cargo fmt --all --check`, `cargo +nightly fmt --check` in
//!   proxy-ebpf/ and `cargo clippy --workspace --all-targets -- -D warnings`;
//!   fails naming each check that failed.
//! - `test`: `lint`, then every test, including the privileged datapath
//!   tests (root) and `vmtest`.
//! - `docs`: the book in docs/ (mdBook): the pages generated from the
//!   agent written, the book built into target/book/ and checked (links,
//!   commands shown, reference pages against the code); `--check` writes
//!   nothing (`test` runs it after `lint`).
//! - `demo`: a simulated 3-node cluster on this machine.
//! - `bench`: the benchmark report, next to iptables and nftables.
//! - `fuzz`: the cargo-fuzz targets (`fuzz/`) for a while each, and with
//!   `--packets N` the packet-path fuzz of the TC programs.
//! - `vmtest`: chosen datapath tests on Debian's 6.1 and 6.12 kernels under qemu.
//! - `image`: the agent's container image from the Dockerfile, with podman
//!   and Debian packages (no image registry); `--test` also runs it as the
//!   chart's DaemonSet.
//! - `k8s`: etcd, kube-apiserver, kube-controller-manager and kubectl from
//!   the Go modules pinned in tools/k8s, for the real-API-server tests
//!   (`test` runs it first); with `--node`, also the e2e node's parts. The
//!   only commands that need Go are this one and `e2e`.
//! - `e2e`: upstream's `[sig-network] Services` e2e tests against the agent
//!   on a real one-node cluster (not part of `test`).
//!
//! Every command but `k8s` runs the `setup` checks first (which do not
//! install Go). xtask depends on nothing of the project's own, so it
//! builds before the eBPF toolchain exists.

mod bench;
mod build_ebpf;
mod chart_env;
mod compiler_cache;
mod demo;
mod docs;
mod e2e;
mod fuzz;
mod image;
mod k8s;
mod libtest;
mod lint;
mod setup;
mod test;
mod util;
mod vmtest;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "cargo xtask", bin_name = "cargo xtask", about = "Developer commands for the topology-aware eBPF load balancer")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Install what is missing: nightly + rust-src, rustfmt and clippy,
    /// Debian packages (LLVM 22, iproute2, bpftool) and bpf-linker 0.13
    /// built against LLVM 22.
    Setup,
    /// Build the agent and the eBPF object it embeds; print the object's path.
    BuildEbpf,
    /// Check formatting (`cargo fmt --all --check`; `cargo +nightly fmt
    /// --check` in proxy-ebpf/) and run clippy on the workspace with
    /// `-D warnings`; `test` runs this first.
    Lint,
    /// Run the lint step, then every test (`cargo test --workspace`, then
    /// `vmtest` on Debian's 6.1 and 6.12 kernels under qemu); needs root for
    /// the datapath tests. `--no-vm` (or TOPOPROXY_NO_VMTEST=1) leaves the VM
    /// run out; `-p NAME` leaves out both the lint step and the VM run.
    /// Other arguments go to `cargo test`.
    Test {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Write the book's pages generated from the agent (each subcommand's
    /// usage, the outputs marked as checked), then build the book in docs/
    /// into target/book/ with mdBook and check it: links and anchors, the
    /// commands it shows, the maps and Helm values pages against the code.
    /// `--check` only builds and checks (what `test` runs after `lint`);
    /// `--dashboard` first redraws the guide's picture of the Grafana
    /// dashboard from a run of the demo's nodes (root).
    Docs {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Start a simulated 3-node cluster on this machine, send requests to
    /// ClusterIPs from every node, print which backends answered, tear down.
    /// Needs root. Arguments after `--` go to the demo (try `-- --help`).
    Demo {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Benchmark the datapath and control plane next to kube-proxy-shaped
    /// iptables and nftables rules; writes results/bench/report.md, SVG plots
    /// and report.json. Needs root. Arguments after `--` go to the benchmark
    /// (`--sizes 1000,10000,100000 --repeats 5 --rounds 2000 --rules-max 10000`).
    Bench {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Run every cargo-fuzz target in fuzz/ (manifests, watch bodies,
    /// object conversion, topology keys and annotations, the decision's
    /// properties) for a while each, with the seeds of fuzz/corpus; fails on
    /// a crash and names its input. `--seconds N` per target (default 60),
    /// `--target NAME` (repeatable; `none` for none), `--dev` for an
    /// unoptimised build, `--packets N [--packet-seed S]` also runs the
    /// packet-path fuzz of the TC programs with N packets (root).
    Fuzz {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Boot Debian's 5.10 (the floor: compat programs), 6.1 (no tcx: clsact
    /// fallback), 6.12 and newest (unstable) kernels under qemu (TCG) and
    /// run chosen datapath tests inside; reports per kernel. Reuses `cargo
    /// test`'s debug binaries. Arguments after `--`: `--kernel
    /// 5.10|6.1|6.12|sid` (repeatable), `--timeout-secs N`, `--only FILTER`,
    /// `--guests N|--concurrent|--sequential`.
    Vmtest {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Build the agent's container image from the Dockerfile without an
    /// image registry: a static agent, Debian's busybox-static and CA
    /// certificates (mmdebstrap), podman with runc and vfs storage. Tags it
    /// as the chart's default image, writes target/image/*.oci.tar and
    /// prints its size. Needs root.
    Image {
        /// Then run it as the chart's DaemonSet (the image test that
        /// `cargo xtask test` runs).
        #[arg(long)]
        test: bool,
    },
    /// Build etcd, kube-apiserver, kube-controller-manager and kubectl at
    /// the versions pinned in tools/k8s/go.mod into target/k8s/<version>/
    /// (Go and its module proxy needed; about 9 minutes cold, skipped for
    /// binaries newer than go.mod and go.sum). The real-API-server tests
    /// run them; `test` does this first.
    K8s {
        /// Also build what `e2e`'s one-node cluster adds: kubelet,
        /// kube-scheduler, agnhost, the e2e test binary (tools/k8s-node),
        /// containerd, its runc shim and ctr (tools/containerd) and CoreDNS
        /// (tools/coredns).
        #[arg(long)]
        node: bool,
    },
    /// Upstream Kubernetes' `[sig-network] Services` e2e tests against the
    /// agent on a real one-node cluster on this machine (kubelet,
    /// containerd, CoreDNS, the agent from the chart, no kube-proxy), in
    /// namespaces of its own; the skip list is tools/k8s-node/e2e-skips.txt,
    /// the JUnit report goes to target/e2e/. Then the disruption run:
    /// conn-disrupt clients as pods during `kubectl rollout restart` of
    /// their backends. Needs root. `test` runs it with --conformance.
    E2e {
        /// Another Ginkgo focus (a regular expression over the tests' names).
        #[arg(long)]
        focus: Option<String>,
        /// Only the `[Conformance]` ones among the Services tests.
        #[arg(long, conflicts_with = "focus")]
        conformance: bool,
        /// Only the disruption run (conn-disrupt clients as pods during a
        /// `kubectl rollout restart` of their backends), no e2e.test.
        #[arg(long, conflicts_with_all = ["focus", "conformance"])]
        disruption_only: bool,
    },
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Setup => setup::run(),
        Command::BuildEbpf => build_ebpf::run(),
        Command::Lint => lint::run(),
        Command::Test { args } => test::run(&args),
        Command::Docs { args } => docs::run(&args),
        Command::Demo { args } => demo::run(&args),
        Command::Bench { args } => bench::run(&args),
        Command::Fuzz { args } => fuzz::run(&args),
        Command::Vmtest { args } => vmtest::run(&args),
        Command::Image { test } => image::run(test),
        Command::K8s { node } => k8s::run(node),
        Command::E2e { focus, conformance, disruption_only } => e2e::run(focus, conformance, disruption_only),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
