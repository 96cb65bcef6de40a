//! `cargo xtask image`: the node agent's container image, built from the
//! repository's Dockerfile without any image registry, and the image step
//! of `cargo xtask test`.
//!
//! 1. The agent: `cargo build --release --target x86_64-unknown-linux-gnu`
//!    with `-C target-feature=+crt-static`, stripped: the same build as the
//!    Dockerfile's agent-build stage, so the runtime needs no libc.
//! 2. The runtime's Debian packages (busybox-static, ca-certificates):
//!    `mmdebstrap --variant=extract`, cached as a tarball under
//!    `target/image/` (rebuilt after a week, or when the list changes) and
//!    imported as a throwaway image for the Dockerfile's `PACKAGES`.
//! 3. `podman build` of the Dockerfile with `AGENT_SOURCE=context`, tagged
//!    as the chart's default image (values.yaml `image.repository`,
//!    Chart.yaml `appVersion`, which must be the agent's version).
//! 4. An OCI archive `target/image/proxy-agent-VERSION.oci.tar`, and the
//!    image's size against the goal.
//!
//! podman runs with [`PODMAN_GLOBAL`]: runc, because crun refuses hybrid
//! cgroup layouts ("cgroups in hybrid mode not supported"), and the vfs
//! storage driver, which works on any filesystem. Nothing is ever pulled.
//!
//! The image step of `cargo xtask test` builds the image and runs
//! `proxy-agent/tests/image.rs` (ignored in the plain `cargo test` run) with
//! TOPOPROXY_IMAGE naming it. It is skipped, with the reason, only when
//! podman cannot be installed or cannot run a container here.

use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, Result, bail};

use crate::libtest::Totals;
use crate::{setup, util};

/// podman's global flags for every call, also handed to the image test
/// (TOPOPROXY_PODMAN_ARGS) so that it finds the image in the same storage.
pub(crate) const PODMAN_GLOBAL: [&str; 4] = ["--runtime", "runc", "--storage-driver", "vfs"];
/// The container engine, its runtime and the root filesystem builder.
const ENGINE_PACKAGES: [&str; 3] = ["podman", "runc", "mmdebstrap"];
/// What the runtime takes from Debian: `sh`, `stat` and `mount` for the
/// chart's init container (busybox), and the CA bundle kube's rustls client
/// loads when a kubeconfig names no CA of its own.
const RUNTIME_PACKAGES: [&str; 2] = ["busybox-static", "ca-certificates"];
const SUITE: &str = "bookworm";
/// The suites the packages come from, security updates included.
const MIRRORS: [&str; 3] = [
    "deb http://deb.debian.org/debian bookworm main",
    "deb http://deb.debian.org/debian bookworm-updates main",
    "deb http://deb.debian.org/debian-security bookworm-security main",
];
/// The cached packages are extracted again after this long, for updates.
const PACKAGES_MAX_AGE: Duration = Duration::from_hours(7 * 24);
/// The throwaway image of the extracted packages (the Dockerfile's PACKAGES).
const PACKAGES_IMAGE: &str = "localhost/topoproxy/packages:bookworm";
const TARGET: &str = "x86_64-unknown-linux-gnu";
/// The size goal, uncompressed, as `podman images` counts it: the static
/// agent (about 18 MB), busybox (2 MB) and the CA bundle (0.2 MB), with
/// room for the agent to grow.
const SIZE_GOAL_BYTES: u64 = 25_000_000;
/// The image test in proxy-agent/tests.
const IMAGE_TEST: &str = "image";

/// What `build` made.
pub(crate) struct Built {
    /// The name in podman's local storage, e.g.
    /// `localhost/topoproxy/proxy-agent:0.1.0`.
    pub local_name: String,
    /// The chart's default image reference, e.g. `topoproxy/proxy-agent:0.1.0`.
    pub reference: String,
    pub archive: PathBuf,
    pub size: u64,
    /// How long the agent's static release build took.
    pub agent_build: Duration,
}

/// `cargo xtask image [--test]`.
pub(crate) fn run(test: bool) -> Result<()> {
    require_root()?;
    setup::ensure()?;
    setup::ensure_debian_packages(&ENGINE_PACKAGES, false)?;
    let built = build()?;
    if test {
        let mut totals = Totals::default();
        let passed = run_test(&built, &mut totals)?;
        totals.print_summary();
        if !passed {
            bail!("the image test failed");
        }
    }
    Ok(())
}

fn require_root() -> Result<()> {
    if !util::is_root() {
        bail!("podman's root storage, mmdebstrap and the image test (namespaces, cgroups, eBPF) need root; run as root");
    }
    Ok(())
}

/// Why no container can run here: the image step is skipped, not failed.
#[derive(Debug)]
struct EngineUnavailable(String);

impl std::fmt::Display for EngineUnavailable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for EngineUnavailable {}

fn podman() -> std::process::Command {
    let mut c = util::cmd("podman");
    c.args(PODMAN_GLOBAL);
    c
}

/// Runs podman and returns its stdout; the error carries its stderr.
fn podman_output(args: &[&str]) -> Result<String> {
    let mut c = podman();
    c.args(args);
    let out = c.output().with_context(|| format!("cannot run {}", util::describe(&c)))?;
    if !out.status.success() {
        bail!("{} failed ({}): {}", util::describe(&c), out.status, String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn image_id(name: &str) -> Option<String> {
    podman_output(&["image", "inspect", "--format", "{{.Id}}", name]).ok()
}

/// Builds the image (see the module comment) and prints where it is and
/// how large.
pub(crate) fn build() -> Result<Built> {
    let reference = chart_image()?;
    let local_name = local_name(&reference);
    let dir = util::target_dir().join("image");
    fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;

    let started = Instant::now();
    println!("image [1/4] the agent, statically linked: cargo build --release --target {TARGET} (RUSTFLAGS=-C target-feature=+crt-static)");
    let binary = build_agent()?;
    let agent_build = started.elapsed();
    let binary_size = fs::metadata(&binary)?.len();
    println!("      {} ({}, {:.0?})", binary.display(), mb(binary_size), started.elapsed());

    let step = Instant::now();
    let tarball = debian_tarball(&dir, "packages", "extract", &RUNTIME_PACKAGES, false)?;
    println!("image [2/4] Debian packages {} from {SUITE}: {} ({:.0?})", RUNTIME_PACKAGES.join(", "), tarball.display(), step.elapsed());
    podman_output(&["import", "--quiet", &tarball.to_string_lossy(), PACKAGES_IMAGE]).context("importing the Debian packages")?;
    let result = engine_runs().and_then(|()| build_image(&dir, &binary, &reference, &local_name));
    // The packages image is only an input of the build.
    let _ = podman_output(&["rmi", PACKAGES_IMAGE]);
    let size = result?;

    let step = Instant::now();
    let version = reference.rsplit_once(':').map_or("latest", |(_, v)| v);
    let archive = dir.join(format!("proxy-agent-{version}.oci.tar"));
    let partial = dir.join(format!("proxy-agent-{version}.oci.tar.partial"));
    let _ = fs::remove_file(&partial);
    podman_output(&["save", "--quiet", "--format", "oci-archive", "--output", &partial.to_string_lossy(), &local_name])
        .context("writing the OCI archive")?;
    fs::rename(&partial, &archive)?;
    let archive_size = fs::metadata(&archive)?.len();
    println!("image [4/4] OCI archive {} ({}, {:.0?})", archive.display(), mb(archive_size), step.elapsed());

    let verdict = if size <= SIZE_GOAL_BYTES { "met" } else { "NOT met" };
    println!(
        "image {local_name}: {} uncompressed (goal {}: {verdict}); agent {}; built in {:.0?}",
        mb(size),
        mb(SIZE_GOAL_BYTES),
        mb(binary_size),
        started.elapsed()
    );
    println!("      run it: podman {} run --rm {local_name} --version", PODMAN_GLOBAL.join(" "));
    Ok(Built { local_name, reference, archive, size, agent_build })
}

fn mb(bytes: u64) -> String {
    format!("{:.1} MB", bytes as f64 / 1e6)
}

fn build_agent() -> Result<PathBuf> {
    let mut c = util::cargo();
    c.args(["build", "--release", "--locked", "--quiet", "-p", "proxy-agent", "--bin", "proxy-agent", "--target", TARGET])
        // Stripped through --config, not CARGO_PROFILE_RELEASE_STRIP: the
        // variable reached the nested release build of the eBPF object in
        // proxy-agent's build.rs and changed that build's profile, so the
        // object (with `core` through build-std) was built a second time
        // here after the tests' build had made it (about 20 s on 2 cores),
        // and a third time by the next test build after this one.
        .args(["--config", "profile.release.strip=\"symbols\""])
        // An explicit --target keeps these flags away from build scripts and
        // proc macros, which stay dynamically linked host programs.
        .env("RUSTFLAGS", "-C target-feature=+crt-static");
    util::run(&mut c)?;
    let binary = util::target_dir().join(TARGET).join("release/proxy-agent");
    let bytes = fs::read(&binary).with_context(|| format!("reading {}", binary.display()))?;
    if !is_static(&bytes) {
        bail!("{} asks for a dynamic loader (PT_INTERP); the image has no libc", binary.display());
    }
    Ok(binary)
}

/// Whether an ELF64 executable needs no program interpreter (no
/// `PT_INTERP` program header): a static or static-pie binary.
fn is_static(elf: &[u8]) -> bool {
    const PT_INTERP: u32 = 3;
    let u16_at = |o: usize| elf.get(o..o + 2).map(|b| u16::from_le_bytes([b[0], b[1]]));
    let u32_at = |o: usize| elf.get(o..o + 4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
    let u64_at = |o: usize| elf.get(o..o + 8).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes);
    // ELF magic, 64-bit, little endian.
    if elf.get(..6) != Some(&[0x7f, b'E', b'L', b'F', 2, 1]) {
        return false;
    }
    let (Some(phoff), Some(entsize), Some(count)) = (u64_at(0x20), u16_at(0x36), u16_at(0x38)) else { return false };
    let Ok(phoff) = usize::try_from(phoff) else { return false };
    (0..usize::from(count)).all(|i| u32_at(phoff + i * usize::from(entsize)).is_some_and(|t| t != PT_INTERP))
}

/// Debian `packages` from [`SUITE`] as the tarball `dir/<name>-<SUITE>.tar`,
/// made by mmdebstrap with `variant` (`extract`: the packages' files only;
/// `minbase`: a root filesystem) when missing, older than
/// [`PACKAGES_MAX_AGE`], or made from another list or other mirrors. Its
/// fetches are tried again after a failure (`util::run_fetching`); `nice`
/// runs it at the lowest CPU priority. Shared by the agent's image and the
/// e2e test images.
pub(crate) fn debian_tarball(dir: &Path, name: &str, variant: &str, packages: &[&str], nice: bool) -> Result<PathBuf> {
    let tarball = dir.join(format!("{name}-{SUITE}.tar"));
    let stamp = dir.join(format!("{name}-{SUITE}.stamp"));
    let wanted = format!("{}\n{}\n", packages.join(","), MIRRORS.join("\n"));
    let fresh = fs::metadata(&tarball)
        .and_then(|m| m.modified())
        .is_ok_and(|t| SystemTime::now().duration_since(t).is_ok_and(|age| age < PACKAGES_MAX_AGE));
    if fresh && fs::read_to_string(&stamp).is_ok_and(|s| s == wanted) {
        return Ok(tarball);
    }
    println!("{name}: from Debian {SUITE} (mmdebstrap --variant={variant}: {})", packages.join(", "));
    // mmdebstrap picks the output format from the file name: keep `.tar`.
    let partial = dir.join(format!("{name}-{SUITE}.partial.tar"));
    util::run_fetching(|| {
        let _ = fs::remove_file(&partial);
        let mut c = if nice {
            let mut c = util::cmd("nice");
            c.args(["-n", "19", "mmdebstrap"]);
            c
        } else {
            util::cmd("mmdebstrap")
        };
        c.args(["--quiet", &format!("--variant={variant}")])
            .arg(format!("--include={}", packages.join(",")))
            .arg(SUITE)
            .arg(&partial)
            .args(MIRRORS);
        c
    })
    .with_context(|| format!("making {name} from Debian's packages {}", packages.join(", ")))?;
    fs::rename(&partial, &tarball)?;
    fs::write(&stamp, wanted)?;
    Ok(tarball)
}

/// Whether podman can run a container here at all: busybox from the
/// packages image, with nothing else involved.
fn engine_runs() -> Result<()> {
    let mut args = vec!["run", "--rm", "--pull=never", "--network=none"];
    let limits = ulimits();
    args.extend(limits.iter().map(String::as_str));
    args.extend([PACKAGES_IMAGE, "/bin/busybox", "true"]);
    podman_output(&args).map(drop).map_err(|e| EngineUnavailable(format!("podman cannot run a container here: {e:#}")).into())
}

/// `--ulimit` options a container can start with here: podman asks runc
/// for 1048576 open files and processes by default, more than the hard
/// limits of some machines allow ("error setting rlimits"). Open files:
/// our own limits. Processes: podman lowers its own hard limit (to 32768
/// here), so a fixed small value; root is exempt from RLIMIT_NPROC anyway
/// (kernel/fork.c, copy_process: INIT_USER).
fn ulimits() -> Vec<String> {
    let text = fs::read_to_string("/proc/self/limits").unwrap_or_default();
    let name = "Max open files";
    let nofile = text.lines().find(|l| l.starts_with(name)).and_then(|line| {
        let mut f = line[name.len()..].split_whitespace().map(|v| if v == "unlimited" { "-1" } else { v });
        Some(format!("{}:{}", f.next()?, f.next()?))
    });
    vec![format!("--ulimit=nofile={}", nofile.as_deref().unwrap_or("1024:1024")), "--ulimit=nproc=1024:1024".to_string()]
}

/// `podman build` of the Dockerfile with the binary as its context; the
/// image the tag named before is removed when nothing else uses it.
/// Returns the image's size.
fn build_image(dir: &Path, binary: &Path, reference: &str, local_name: &str) -> Result<u64> {
    let step = Instant::now();
    let context = dir.join("context");
    let _ = fs::remove_dir_all(&context);
    fs::create_dir_all(&context)?;
    fs::copy(binary, context.join("proxy-agent"))?;
    let before = image_id(local_name);
    let dockerfile = util::workspace_root().join("Dockerfile");
    let mut c = podman();
    // --layers=false: no intermediate images are kept, so repeated builds
    // leave nothing behind in the storage.
    c.args(["build", "--quiet", "--layers=false", "--pull=never", "--file"])
        .arg(&dockerfile)
        .args(["--build-arg", "AGENT_SOURCE=context", "--build-arg", "AGENT_BINARY=proxy-agent"])
        .args(["--build-arg", &format!("PACKAGES={PACKAGES_IMAGE}")])
        .args(["--tag", reference])
        .arg(&context)
        .stdout(Stdio::null());
    println!("image [3/4] {}", util::describe(&c));
    util::run(&mut c)?;
    let _ = fs::remove_dir_all(&context);
    let after = image_id(local_name).with_context(|| format!("podman build succeeded but {local_name} is not in the storage"))?;
    if let Some(old) = before.filter(|old| *old != after)
        && let Err(e) = podman_output(&["rmi", &old])
    {
        println!("      note: the previous image {old} stays: {e:#}");
    }
    let size: u64 = podman_output(&["image", "inspect", "--format", "{{.Size}}", local_name])?
        .parse()
        .context("podman image inspect printed no size")?;
    println!("      {local_name} ({:.0?})", step.elapsed());
    Ok(size)
}

/// The chart's default image: values.yaml `image.repository` with its
/// `image.tag`, or Chart.yaml's `appVersion` when the tag is empty (the
/// chart's topoproxy.imageTag). The appVersion must be the agent's version.
fn chart_image() -> Result<String> {
    let root = util::workspace_root();
    let read = |p: &str| fs::read_to_string(root.join(p)).with_context(|| format!("reading {p}"));
    let values = read("charts/topoproxy/values.yaml")?;
    let chart = read("charts/topoproxy/Chart.yaml")?;
    let cargo = read("Cargo.toml")?;
    let repository = yaml_field(&values, Some("image"), "repository").context("values.yaml has no image.repository")?;
    let tag = yaml_field(&values, Some("image"), "tag").unwrap_or_default();
    let app_version = yaml_field(&chart, None, "appVersion").context("Chart.yaml has no appVersion")?;
    let version = workspace_version(&cargo).context("Cargo.toml has no [workspace.package] version")?;
    if app_version != version {
        bail!(
            "Chart.yaml's appVersion {app_version} is not the agent's version {version} (Cargo.toml); the chart would name another image"
        );
    }
    let tag = if tag.is_empty() { app_version } else { tag };
    Ok(format!("{repository}:{tag}"))
}

/// A scalar of a YAML document written the way the chart's files are:
/// `key: value` at the top level, or two-space indented below `parent:`.
/// Quotes and trailing comments are dropped.
fn yaml_field(text: &str, parent: Option<&str>, key: &str) -> Option<String> {
    let mut inside = parent.is_none();
    for line in text.lines() {
        let top_level = !line.starts_with(' ') && !line.trim().is_empty() && !line.starts_with('#');
        if let Some(p) = parent
            && top_level
        {
            inside = line.trim_end() == format!("{p}:");
            continue;
        }
        let indent = if parent.is_some() { "  " } else { "" };
        let Some(rest) = line.strip_prefix(indent).and_then(|l| l.strip_prefix(key)).and_then(|l| l.strip_prefix(':')) else { continue };
        if !inside || rest.chars().next().is_some_and(|c| !c.is_whitespace()) {
            continue;
        }
        let value = rest.split(" #").next().unwrap_or_default().trim();
        return Some(value.trim_matches('"').trim_matches('\'').to_string());
    }
    None
}

/// `version = "..."` of `[workspace.package]`.
fn workspace_version(cargo_toml: &str) -> Option<String> {
    let section = cargo_toml.split("\n[workspace.package]").nth(1)?;
    let section = section.split("\n[").next()?;
    let line = section.lines().find(|l| l.trim_start().starts_with("version"))?;
    Some(line.split_once('=')?.1.trim().trim_matches('"').to_string())
}

/// How podman names an image reference in its local storage: a name
/// without a registry host is `localhost/NAME`.
fn local_name(reference: &str) -> String {
    let first = reference.split('/').next().unwrap_or_default();
    let has_host = reference.contains('/') && (first.contains('.') || first.contains(':') || first == "localhost");
    if has_host { reference.to_string() } else { format!("localhost/{reference}") }
}

/// The image step of `cargo xtask test`: builds the image and runs the
/// image test, adding its results to `totals`. Returns why it failed, or
/// `None` when it passed or was skipped (the reason printed), and the
/// image when one was built (the e2e step runs it as the cluster's proxy).
/// `compiled` is set to the time the agent's build took.
pub(crate) fn test_step(totals: &mut Totals, compiled: &mut Duration) -> (Option<String>, Option<Built>) {
    let started = Instant::now();
    println!("\nimage: the agent's container image, built and run as the chart's DaemonSet (`cargo xtask image --test`)");
    let skip = |reason: String| {
        println!("image test skipped: {reason}");
        (None, None)
    };
    if let Err(e) = setup::ensure_debian_packages(&ENGINE_PACKAGES, false) {
        return skip(format!("the container engine cannot be installed: {e:#}"));
    }
    let built = match build() {
        Ok(b) => {
            *compiled = b.agent_build;
            b
        }
        Err(e) if e.downcast_ref::<EngineUnavailable>().is_some() => return skip(format!("{e:#}")),
        Err(e) => {
            println!("image build failed: {e:#}");
            totals.failed += 1;
            return (Some(format!("image: {e:#}")), None);
        }
    };
    let result = run_test(&built, totals);
    println!("image step took {:.0?}", started.elapsed());
    let failed = match result {
        Ok(true) => None,
        Ok(false) => Some("the image test failed".into()),
        Err(e) => {
            println!("image test failed: {e:#}");
            totals.failed += 1;
            Some(format!("image test: {e:#}"))
        }
    };
    (failed, Some(built))
}

/// Runs proxy-agent's image test against `built`; adds its results to
/// `totals` (where the plain `cargo test` run counted it as ignored).
/// Returns whether it passed.
fn run_test(built: &Built, totals: &mut Totals) -> Result<bool> {
    let mut c = util::cargo();
    // --workspace, as the main run: the same features, so nothing is rebuilt.
    c.args(["test", "--workspace", "--test", IMAGE_TEST, "--", "--ignored", "--nocapture"])
        .env("TOPOPROXY_IMAGE", &built.local_name)
        .env("TOPOPROXY_PODMAN_ARGS", PODMAN_GLOBAL.join(" "))
        .stdout(Stdio::piped());
    eprintln!("running: {}", util::describe(&c));
    let mut child = c.spawn().with_context(|| format!("cannot run {}", util::describe(&c)))?;
    let stdout = child.stdout.take().context("no stdout")?;
    let mut own = Totals::default();
    let mut out = std::io::stdout().lock();
    for line in BufReader::new(stdout).lines() {
        let line = line?;
        own.add(&line);
        writeln!(out, "{line}")?;
        out.flush()?;
    }
    drop(out);
    let status = child.wait()?;
    if own.binaries == 0 {
        bail!("{} ran no test binary ({status})", util::describe(&c));
    }
    let ran = own.passed + own.failed;
    totals.passed += own.passed;
    totals.failed += own.failed;
    totals.ignored = totals.ignored.saturating_sub(ran);
    println!(
        "image test: {} passed, {} failed, against {} (the chart's {}; {} uncompressed; archive {})",
        own.passed,
        own.failed,
        built.local_name,
        built.reference,
        mb(built.size),
        built.archive.display()
    );
    Ok(status.success() && own.failed == 0 && own.passed > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_chart_names_the_image_this_command_tags() {
        let reference = chart_image().expect("the chart's image");
        let version = workspace_version(&fs::read_to_string(util::workspace_root().join("Cargo.toml")).expect("Cargo.toml"));
        assert_eq!(reference, format!("topoproxy/proxy-agent:{}", version.expect("version")));
        assert_eq!(local_name(&reference), format!("localhost/{reference}"));
    }

    #[test]
    fn yaml_fields_are_read_at_their_level_only() {
        let text = "# image: not this\nname: x\nimage:\n  repository: example/agent # where\n  tag: \"\"\n  pullPolicy: IfNotPresent\nother:\n  repository: nope\nappVersion: \"1.2.3\"\n";
        assert_eq!(yaml_field(text, Some("image"), "repository").as_deref(), Some("example/agent"));
        assert_eq!(yaml_field(text, Some("image"), "tag").as_deref(), Some(""));
        assert_eq!(yaml_field(text, Some("other"), "repository").as_deref(), Some("nope"));
        assert_eq!(yaml_field(text, None, "appVersion").as_deref(), Some("1.2.3"));
        assert_eq!(yaml_field(text, Some("image"), "repo"), None);
    }

    #[test]
    fn workspace_version_comes_from_workspace_package() {
        let toml = "[workspace]\nmembers = []\n\n[workspace.package]\nedition = \"2024\"\nversion = \"0.3.1\"\n\n[workspace.dependencies]\nversion = \"9\"\n";
        assert_eq!(workspace_version(toml).as_deref(), Some("0.3.1"));
    }

    #[test]
    fn local_names_get_localhost_only_without_a_registry() {
        assert_eq!(local_name("topoproxy/proxy-agent:0.1.0"), "localhost/topoproxy/proxy-agent:0.1.0");
        assert_eq!(local_name("registry.example/tp/agent:1"), "registry.example/tp/agent:1");
        assert_eq!(local_name("localhost:5000/agent:1"), "localhost:5000/agent:1");
        assert_eq!(local_name("localhost/agent:1"), "localhost/agent:1");
    }

    #[test]
    fn a_dynamically_linked_program_is_not_static() {
        // xtask itself is an ordinary (dynamically linked) host program.
        let me = fs::read(std::env::current_exe().expect("current exe")).expect("read own binary");
        assert!(!is_static(&me));
        // A minimal ELF64 header with one PT_LOAD program header and no
        // PT_INTERP.
        let mut elf = vec![0u8; 64 + 56];
        elf[..6].copy_from_slice(&[0x7f, b'E', b'L', b'F', 2, 1]);
        elf[0x20..0x28].copy_from_slice(&64u64.to_le_bytes());
        elf[0x36..0x38].copy_from_slice(&56u16.to_le_bytes());
        elf[0x38..0x3a].copy_from_slice(&1u16.to_le_bytes());
        elf[64..68].copy_from_slice(&1u32.to_le_bytes());
        assert!(is_static(&elf));
        elf[64..68].copy_from_slice(&3u32.to_le_bytes());
        assert!(!is_static(&elf));
        assert!(!is_static(b"#!/bin/sh\n"));
    }
}
