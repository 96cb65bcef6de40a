//! `cargo xtask fuzz`: the cargo-fuzz targets in `fuzz/` (libFuzzer, a
//! workspace of its own built with nightly), each for a while, and the
//! packet-path fuzz of the TC programs (`proxy-agent/tests/packet_fuzz.rs`)
//! for a longer run than `cargo test` gives it.
//!
//! libFuzzer adds what it finds to the first corpus directory it is given:
//! that is a working copy under `<target>/fuzz/corpus/`, with the small
//! seed corpus kept in the repository (`fuzz/corpus/<target>/`) read
//! beside it, so a run never grows the repository's. A crash leaves its
//! input under `<target>/fuzz/artifacts/<target>/` and fails the command,
//! which names the file and how to replay it; each one found so far is a
//! regression test in the module it broke.
//!
//! `cargo xtask test` runs every target for [`CI_SECONDS`] (`ci_step`),
//! with an unoptimised build, which compiles in half the time of an
//! optimised one and runs fast enough for a smoke run.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context, Result, bail};

use crate::libtest::Totals;
use crate::{setup, util};

/// The targets, as `fuzz/Cargo.toml` names them.
pub(crate) const TARGETS: [&str; 5] = ["manifest", "watch_body", "objects", "topology", "decision"];

/// How long `cargo xtask test` runs each target.
const CI_SECONDS: u64 = 10;

/// What `cargo xtask fuzz` was asked to do.
#[derive(Debug, PartialEq, Eq)]
struct Options {
    seconds: u64,
    targets: Vec<String>,
    /// Optimised build (the default here; CI uses `--dev`).
    release: bool,
    /// Packets for the packet-path fuzz; `None`: not run.
    packets: Option<u64>,
    packet_seed: Option<u64>,
}

fn parse(args: &[String]) -> Result<Options> {
    let mut o = Options { seconds: 60, targets: Vec::new(), release: true, packets: None, packet_seed: None };
    let mut it = args.iter();
    let number = |flag: &str, v: Option<&String>| -> Result<u64> {
        let v = v.with_context(|| format!("{flag} needs a value"))?;
        let v = v.strip_prefix("0x").map_or_else(|| v.parse(), |hex| u64::from_str_radix(hex, 16));
        v.with_context(|| format!("{flag} takes a number"))
    };
    while let Some(a) = it.next() {
        match a.as_str() {
            "--seconds" => o.seconds = number("--seconds", it.next())?,
            "--target" => o.targets.push(it.next().context("--target needs a name")?.clone()),
            "--dev" => o.release = false,
            "--packets" => o.packets = Some(number("--packets", it.next())?),
            "--packet-seed" => o.packet_seed = Some(number("--packet-seed", it.next())?),
            other => bail!("unknown argument {other:?} (see `cargo xtask fuzz --help`)"),
        }
    }
    for t in &o.targets {
        if t != "none" && !TARGETS.contains(&t.as_str()) {
            bail!("no fuzz target {t:?}; the targets are {}", TARGETS.join(", "));
        }
    }
    if o.targets.is_empty() {
        o.targets = TARGETS.iter().map(ToString::to_string).collect();
    }
    o.targets.retain(|t| t != "none");
    Ok(o)
}

pub(crate) fn run(args: &[String]) -> Result<()> {
    let o = parse(args)?;
    setup::ensure()?;
    let mut failed = Vec::new();
    if !o.targets.is_empty() {
        build(o.release)?;
        let results: Vec<Outcome> = o.targets.iter().map(|t| run_target(t, o.seconds, o.release)).collect::<Result<_>>()?;
        print_table(&results);
        failed.extend(results.iter().filter(|r| r.crash.is_some()).map(|r| r.target.clone()));
    }
    if let Some(n) = o.packets {
        if !util::is_root() {
            bail!("the packet fuzz loads the TC programs, so it needs root");
        }
        if !packet_fuzz(n, o.packet_seed)? {
            failed.push("packet fuzz".into());
        }
    }
    if !failed.is_empty() {
        bail!("fuzzing found problems in: {}", failed.join(", "));
    }
    Ok(())
}

/// `cargo xtask test`'s step: every target for [`CI_SECONDS`], each
/// counted as a test. Returns why it failed, if it did.
/// `compiled` is set to the time the build took.
pub(crate) fn ci_step(totals: &mut Totals, compiled: &mut std::time::Duration) -> Option<String> {
    let started = Instant::now();
    println!("\nfuzz: every cargo-fuzz target for {CI_SECONDS} s (`cargo xtask fuzz` runs them longer)");
    let built = build(false);
    *compiled = started.elapsed();
    if let Err(e) = built {
        println!("fuzz build failed: {e:#}");
        totals.failed += 1;
        return Some(format!("fuzz build: {e:#}"));
    }
    let mut results = Vec::new();
    for t in TARGETS {
        match run_target(t, CI_SECONDS, false) {
            Ok(r) => results.push(r),
            Err(e) => {
                println!("fuzz target {t} could not run: {e:#}");
                totals.failed += 1;
                return Some(format!("fuzz {t}: {e:#}"));
            }
        }
    }
    print_table(&results);
    println!("fuzz step took {:.0?}", started.elapsed());
    let crashed: Vec<&str> = results.iter().filter(|r| r.crash.is_some()).map(|r| r.target.as_str()).collect();
    totals.failed += crashed.len() as u64;
    totals.passed += (results.len() - crashed.len()) as u64;
    (!crashed.is_empty()).then(|| format!("fuzz targets crashed: {}", crashed.join(", ")))
}

fn fuzz_dir() -> PathBuf {
    util::workspace_root().join("fuzz")
}

/// Where the fuzz builds, working corpora and crash inputs go: beside the
/// workspace's own build, so `cargo clean` and .gitignore cover them.
fn work_dir() -> PathBuf {
    util::target_dir().join("fuzz")
}

/// `cargo +nightly fuzz SUBCOMMAND` with the options every call shares.
/// No sanitizer: the code under test is safe Rust, and AddressSanitizer
/// would double the build time for nothing it could find there.
fn cargo_fuzz(sub: &str, release: bool) -> Command {
    let mut c = util::cmd("cargo");
    // The pinned nightly (setup::nightly_channel), as the eBPF build's.
    let toolchain = format!("+{}", crate::setup::nightly_channel().unwrap_or_else(|_| "nightly".to_string()));
    c.current_dir(fuzz_dir()).args([toolchain.as_str(), "fuzz", sub, "--sanitizer", "none"]);
    if !release {
        c.arg("--dev");
    }
    c.arg("--target-dir").arg(work_dir());
    // The outer cargo's toolchain must not pin the nightly one.
    c.env_remove("RUSTUP_TOOLCHAIN").env_remove("CARGO").env_remove("RUSTC").env_remove("CARGO_TARGET_DIR");
    c
}

fn build(release: bool) -> Result<()> {
    let started = Instant::now();
    println!("building the fuzz targets ({})", if release { "optimised" } else { "unoptimised" });
    util::run(&mut cargo_fuzz("build", release))?;
    println!("fuzz targets built in {:.0?}", started.elapsed());
    Ok(())
}

/// The fuzz target binary `cargo fuzz build` made, for the host triple
/// (`rustc -vV`), as cargo-fuzz builds it.
fn binary(target: &str, release: bool) -> Result<PathBuf> {
    let toolchain = format!("+{}", crate::setup::nightly_channel()?);
    let info =
        util::output(util::cmd("rustc").args([toolchain.as_str(), "-vV"])).with_context(|| format!("`rustc {toolchain} -vV` failed"))?;
    let host = info.lines().find_map(|l| l.strip_prefix("host: ")).context("`rustc -vV` names no host")?;
    let path = work_dir().join(host).join(if release { "release" } else { "debug" }).join(target);
    if !path.is_file() {
        bail!("{} is missing after the build", path.display());
    }
    Ok(path)
}

/// One target's run.
struct Outcome {
    target: String,
    runs: Option<u64>,
    corpus: usize,
    seconds: f64,
    /// The crash input, when it crashed.
    crash: Option<PathBuf>,
}

fn files_in(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir).map(|rd| rd.flatten().map(|e| e.path()).filter(|p| p.is_file()).collect()).unwrap_or_default()
}

fn run_target(target: &str, seconds: u64, release: bool) -> Result<Outcome> {
    let corpus = work_dir().join("corpus").join(target);
    let artifacts = work_dir().join("artifacts").join(target);
    for d in [&corpus, &artifacts] {
        std::fs::create_dir_all(d).with_context(|| format!("create {}", d.display()))?;
    }
    let before: Vec<PathBuf> = files_in(&artifacts);
    let seeds = fuzz_dir().join("corpus").join(target);
    // The binary `build` made, run directly: `cargo fuzz run` would
    // rebuild first whenever a source file changed since, and every target
    // of one run must fuzz the same code.
    let binary = binary(target, release)?;
    let mut c = util::cmd(&binary);
    c.arg(&corpus)
        .arg(&seeds)
        .arg(format!("-max_total_time={seconds}"))
        .arg(format!("-artifact_prefix={}/", artifacts.display()))
        // Manifests and list bodies are larger than libFuzzer's default
        // 4 KiB cap; a few seeds are.
        .arg("-max_len=16384")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    println!("fuzzing {target} for {seconds} s");
    let started = Instant::now();
    let out = c.output().with_context(|| format!("cannot run {}", util::describe(&c)))?;
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    // libFuzzer's own count and time ("Done 92889 runs in 21 second(s)"):
    // the wall time also holds `cargo fuzz`'s check of the build.
    let done = text.lines().find_map(|l| {
        let rest = l.strip_prefix("Done ")?;
        let (runs, rest) = rest.split_once(" runs in ")?;
        Some((runs.trim().parse::<u64>().ok()?, rest.split_whitespace().next()?.parse::<f64>().ok()?))
    });
    let runs = done.map(|(n, _)| n);
    let fuzz_seconds = done.map_or_else(|| started.elapsed().as_secs_f64(), |(_, s)| s);
    let crash = files_in(&artifacts).into_iter().find(|p| !before.contains(p));
    if let Some(input) = &crash {
        // libFuzzer's report: the panic message and the backtrace.
        let report: Vec<&str> = text.lines().filter(|l| !l.starts_with('#') && !l.starts_with("INFO:")).collect();
        println!("{}", report.join("\n"));
        println!(
            "fuzz target {target} crashed on {}; replay: {} {} (or cd fuzz && cargo +nightly fuzz run{} --sanitizer none {target} {})",
            input.display(),
            binary.display(),
            input.display(),
            if release { "" } else { " --dev" },
            input.display()
        );
    } else if !out.status.success() {
        println!("{text}");
        bail!("fuzz target {target} failed ({}) without leaving a crash input", out.status);
    }
    Ok(Outcome { target: target.to_string(), runs, corpus: files_in(&corpus).len(), seconds: fuzz_seconds, crash })
}

fn print_table(results: &[Outcome]) {
    println!("\n{:<12} {:>10} {:>8} {:>8}  result", "target", "runs", "runs/s", "corpus");
    for r in results {
        let runs = r.runs.map_or_else(|| "?".into(), |n| n.to_string());
        let rate = r.runs.map_or_else(|| "?".into(), |n| format!("{:.0}", n as f64 / r.seconds.max(0.001)));
        let result = r.crash.as_ref().map_or_else(|| "ok".to_string(), |p| format!("CRASH {}", p.display()));
        println!("{:<12} {:>10} {:>8} {:>8}  {result}", r.target, runs, rate, r.corpus);
    }
}

/// The packet-path fuzz with `packets` packets: proxy-agent's
/// `packet_fuzz` test, which reads its count and seed from the environment.
fn packet_fuzz(packets: u64, seed: Option<u64>) -> Result<bool> {
    let mut c = util::cargo();
    c.args(["test", "-p", "proxy-agent", "--test", "packet_fuzz", "--", "--nocapture"])
        .env("TOPOPROXY_PACKET_FUZZ_COUNT", packets.to_string());
    if let Some(s) = seed {
        c.env("TOPOPROXY_PACKET_FUZZ_SEED", s.to_string());
    }
    println!("packet fuzz: {packets} packets through the TC programs ({})", util::describe(&c));
    Ok(c.status().with_context(|| format!("cannot run {}", util::describe(&c)))?.success())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &[&str]) -> Vec<String> {
        s.iter().map(ToString::to_string).collect()
    }

    #[test]
    fn arguments() {
        let all: Vec<String> = TARGETS.iter().map(ToString::to_string).collect();
        let o = parse(&[]).expect("defaults");
        assert_eq!(o, Options { seconds: 60, targets: all.clone(), release: true, packets: None, packet_seed: None });
        let o = parse(&args(&["--seconds", "5", "--target", "manifest", "--dev", "--packets", "100000", "--packet-seed", "0x10"]))
            .expect("all flags");
        assert_eq!(
            o,
            Options { seconds: 5, targets: vec!["manifest".into()], release: false, packets: Some(100_000), packet_seed: Some(16) }
        );
        assert!(parse(&args(&["--target", "none", "--packets", "5"])).expect("packets only").targets.is_empty());
        assert!(parse(&args(&["--target", "nope"])).is_err());
        assert!(parse(&args(&["--seconds"])).is_err());
        assert!(parse(&args(&["--seconds", "x"])).is_err());
    }

    #[test]
    fn every_target_is_declared_and_has_seeds() {
        let manifest = std::fs::read_to_string(fuzz_dir().join("Cargo.toml")).expect("fuzz/Cargo.toml");
        for t in TARGETS {
            assert!(manifest.contains(&format!("name = \"{t}\"")), "{t} is not a [[bin]] of fuzz/Cargo.toml");
            assert!(fuzz_dir().join("fuzz_targets").join(format!("{t}.rs")).is_file(), "fuzz_targets/{t}.rs");
            assert!(!files_in(&fuzz_dir().join("corpus").join(t)).is_empty(), "fuzz/corpus/{t} has no seed");
        }
        // The corpora stay small.
        let bytes: u64 = TARGETS
            .iter()
            .flat_map(|t| files_in(&fuzz_dir().join("corpus").join(t)))
            .map(|p| std::fs::metadata(p).map_or(0, |m| m.len()))
            .sum();
        assert!(bytes < 256 * 1024, "the seed corpora hold {bytes} bytes");
    }
}
