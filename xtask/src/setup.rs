//! `cargo xtask setup`: installs what the build and the tests need on a
//! fresh Debian 12 machine (root, no stdin). Every step checks first and
//! does nothing when its piece is present, so the whole run is a fast no-op
//! on a machine that has everything: no apt-get update, no network.
//! The last step, the chart tests' Python venv, lives in `chart_env.rs`.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use crate::util;

/// Debian packages: LLVM 22 and the libraries bpf-linker links against,
/// `ip` for the demo's namespaces, bpftool to inspect pinned maps,
/// iptables/nftables, which `cargo xtask bench` compares against and the
/// kube-proxy migration tests load kube-proxy's rules with, and ipset and
/// conntrack, which those tests (and the migration guide they run) use;
/// nginx-light, curl and wrk, the real backends and clients of the
/// graceful-drain tests (`proxy-agent/tests/graceful_drain.rs`).
const DEBIAN_PACKAGES: [&str; 13] = [
    "llvm-22-dev",
    "libpolly-22-dev",
    "libzstd-dev",
    "zlib1g-dev",
    "iproute2",
    "bpftool",
    "iptables",
    "nftables",
    "ipset",
    "conntrack",
    "nginx-light",
    "curl",
    "wrk",
];

/// bpf-linker release that builds against Debian's LLVM 22.
const BPF_LINKER_VERSION: &str = "0.13.0";
/// Any 0.13.x is accepted as present.
const BPF_LINKER_SERIES: &str = "0.13.";
const LLVM_PREFIX: &str = "/usr/lib/llvm-22";

/// `cargo xtask setup`.
pub(crate) fn run() -> Result<()> {
    ensure()
}

/// The checks every xtask command runs first; installs what is missing.
/// The compiler cache comes first and is turned on for every cargo xtask
/// starts from here on (`compiler_cache.rs`).
pub(crate) fn ensure() -> Result<()> {
    crate::compiler_cache::ensure();
    crate::compiler_cache::enable();
    // cargo-fuzz and mdBook are built from crates.io with the stable
    // toolchain and need nothing that the steps below install, so on a
    // fresh machine they build beside them: the nightly download and the
    // pip installs wait on the network, and each cargo install ends in a
    // crate or a link that keeps one core busy (a fresh machine's setup
    // took 362 s one after another, 5 minutes of it these installs). On a
    // machine that has them both are a version check.
    let tools = std::thread::spawn(|| cargo_fuzz().and_then(|()| mdbook()));
    let rest = ensure_toolchain_and_packages();
    let tools = tools.join().unwrap_or_else(|_| Err(anyhow::anyhow!("the cargo-fuzz/mdbook install thread panicked")));
    rest.and(tools)
}

/// What [`ensure`] installs besides cargo-fuzz and mdBook, in order: each
/// step needs the ones before it (bpf-linker links against Debian's LLVM).
fn ensure_toolchain_and_packages() -> Result<()> {
    nightly()?;
    rust_src()?;
    // The lint step's tools (`lint.rs`). The toolchain that runs xtask
    // (stable by default; rustup names it in RUSTUP_TOOLCHAIN, which a
    // bare `rustup component` honours) formats and lints the host
    // workspace; nightly formats proxy-ebpf, and its minimal profile leaves
    // rustfmt out.
    rust_components(None, &["rustfmt", "clippy"])?;
    rust_components(Some(&nightly_channel()?), &["rustfmt", "clippy"])?;
    debian_packages()?;
    bpf_linker()?;
    crate::chart_env::ensure()?;
    Ok(())
}

/// The pinned nightly (`proxy-ebpf/rust-toolchain.toml`'s channel, e.g.
/// `nightly-2026-05-20`): the eBPF build, its lint and the fuzz targets run
/// with it. A newer nightly has broken bpf-linker before.
pub(crate) fn nightly_channel() -> Result<String> {
    let path = util::workspace_root().join("proxy-ebpf/rust-toolchain.toml");
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    text.lines()
        .find_map(|l| l.trim().strip_prefix("channel")?.trim().strip_prefix('=')?.trim().strip_prefix('"')?.strip_suffix('"'))
        .map(str::to_string)
        .with_context(|| format!("{} names no channel", path.display()))
}

fn nightly() -> Result<()> {
    let channel = nightly_channel()?;
    let list = util::output(util::cmd("rustup").args(["toolchain", "list"]))
        .context("`rustup toolchain list` failed; is rustup installed and ~/.cargo/bin on PATH?")?;
    if list.lines().any(|l| l.split_whitespace().next().is_some_and(|t| t == channel || t.starts_with(&format!("{channel}-")))) {
        println!("ok: {channel} toolchain present");
        return Ok(());
    }
    println!("installing: {channel} toolchain (rustup toolchain install {channel} --profile minimal -c rust-src)");
    util::run_fetching(|| {
        let mut c = util::cmd("rustup");
        c.args(["toolchain", "install", &channel, "--profile", "minimal", "-c", "rust-src", "--no-self-update"]);
        c
    })
}

fn nightly_sysroot() -> Option<PathBuf> {
    let channel = nightly_channel().ok()?;
    util::output(util::cmd("rustup").args(["run", &channel, "rustc", "--print", "sysroot"])).map(|s| PathBuf::from(s.trim()))
}

fn rust_src() -> Result<()> {
    let has_src = |root: &Path| root.join("lib/rustlib/src/rust/library/core").is_dir();
    if nightly_sysroot().is_some_and(|s| has_src(&s)) {
        println!("ok: rust-src for nightly present");
        return Ok(());
    }
    let channel = nightly_channel()?;
    println!("installing: rust-src for {channel} (rustup component add rust-src --toolchain {channel})");
    util::run_fetching(|| {
        let mut c = util::cmd("rustup");
        c.args(["component", "add", "rust-src", "--toolchain", &channel]);
        c
    })?;
    match nightly_sysroot() {
        Some(s) if has_src(&s) => Ok(()),
        _ => bail!("rust-src was installed but library/core is still missing from the nightly sysroot"),
    }
}

/// The programs each rustup component the lint step needs brings; a
/// component counts as installed when `rustup which` finds all of them.
const COMPONENT_PROGRAMS: [(&str, &[&str]); 2] = [("rustfmt", &["rustfmt", "cargo-fmt"]), ("clippy", &["cargo-clippy", "clippy-driver"])];

/// Adds the rustup `components` (of [`COMPONENT_PROGRAMS`]) missing from
/// `toolchain`, the active one when `None`.
fn rust_components(toolchain: Option<&str>, components: &[&str]) -> Result<()> {
    let which =
        toolchain.map(str::to_string).or_else(|| std::env::var("RUSTUP_TOOLCHAIN").ok()).unwrap_or_else(|| "the default toolchain".into());
    let rustup = |args: &[&str]| {
        let mut c = util::cmd("rustup");
        c.args(args);
        if let Some(t) = toolchain {
            c.args(["--toolchain", t]);
        }
        c
    };
    let present = |component: &&str| {
        COMPONENT_PROGRAMS
            .iter()
            .find(|(name, _)| name == component)
            .is_some_and(|(_, programs)| programs.iter().all(|p| util::output(&mut rustup(&["which", p])).is_some()))
    };
    let missing: Vec<&str> = components.iter().copied().filter(|c| !present(c)).collect();
    if missing.is_empty() {
        println!("ok: {} for {which} present", components.join(" and "));
        return Ok(());
    }
    let add = || {
        let mut c = rustup(&["component", "add"]);
        c.args(&missing);
        c
    };
    println!("installing: {} for {which} ({})", missing.join(" and "), util::describe(&add()));
    util::run_fetching(add)?;
    let still: Vec<&str> = missing.iter().copied().filter(|c| !present(c)).collect();
    if !still.is_empty() {
        bail!("`{}` finished but {} is still missing for {which}", util::describe(&add()), still.join(" and "));
    }
    Ok(())
}

pub(crate) fn installed(package: &str) -> bool {
    util::output(util::cmd("dpkg-query").args(["-W", "-f=${db:Status-Status}", package])).is_some_and(|s| s.trim() == "installed")
}

fn debian_packages() -> Result<()> {
    ensure_debian_packages(&DEBIAN_PACKAGES, false)
}

/// Installs the Debian packages of `packages` that are missing (apt-get
/// update, then apt-get install -y); a no-op without network when all are
/// present. `no_recommends` keeps large optional dependencies out (qemu's).
pub(crate) fn ensure_debian_packages(packages: &[&str], no_recommends: bool) -> Result<()> {
    if util::output(util::cmd("dpkg-query").arg("--version")).is_none() {
        println!("skip: dpkg-query not found (not Debian?); install by hand: {}", packages.join(" "));
        return Ok(());
    }
    let missing: Vec<&str> = packages.iter().copied().filter(|p| !installed(p)).collect();
    if missing.is_empty() {
        println!("ok: Debian packages present ({})", packages.join(" "));
        return Ok(());
    }
    if !util::is_root() {
        bail!("Debian packages missing: {}; run `cargo xtask setup` as root to install them", missing.join(" "));
    }
    println!("installing: Debian packages {} (apt-get update; apt-get install -y)", missing.join(" "));
    let apt = || {
        let mut c = util::cmd("apt-get");
        c.env("DEBIAN_FRONTEND", "noninteractive");
        c
    };
    util::run_fetching(|| {
        let mut c = apt();
        c.arg("update");
        c
    })?;
    util::run_fetching(|| {
        let mut install = apt();
        install.args(["install", "-y"]);
        if no_recommends {
            install.arg("--no-install-recommends");
        }
        install.args(&missing);
        install
    })?;
    let still: Vec<&str> = missing.iter().copied().filter(|p| !installed(p)).collect();
    if !still.is_empty() {
        bail!("apt-get install finished but these packages are still missing: {}", still.join(" "));
    }
    Ok(())
}

/// cargo-fuzz release the fuzz targets (`fuzz/`) are run with.
const CARGO_FUZZ_VERSION: &str = "0.13.2";

/// cargo-fuzz, for `cargo xtask fuzz` and the fuzz step of `cargo xtask
/// test` (it drives libFuzzer builds with nightly).
fn cargo_fuzz() -> Result<()> {
    let bin = util::cargo_home().join("bin/cargo-fuzz");
    // "cargo-fuzz 0.13.2"
    let version = util::output(util::cmd(&bin).arg("--version")).and_then(|o| o.split_whitespace().nth(1).map(str::to_string));
    if let Some(v) = version {
        println!("ok: cargo-fuzz {v} present");
        return Ok(());
    }
    println!("installing: cargo-fuzz {CARGO_FUZZ_VERSION} (cargo install cargo-fuzz --locked; about two minutes)");
    let mut c = util::cmd("cargo");
    c.args(["install", "cargo-fuzz", "--version", CARGO_FUZZ_VERSION, "--locked"])
        // Our own build's settings must not leak into the install.
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("RUSTFLAGS")
        .env_remove("RUSTUP_TOOLCHAIN");
    util::run(&mut c)?;
    if util::output(util::cmd(&bin).arg("--version")).is_none() {
        bail!("cargo-fuzz was installed but `{} --version` fails", bin.display());
    }
    Ok(())
}

/// mdBook release the book (`docs/`) is built with: `cargo xtask docs`
/// and the docs step of `cargo xtask test` (`docs.rs`). Pinned: a newer
/// release may render heading ids, and so the anchors the link check
/// resolves, differently.
pub(crate) const MDBOOK_VERSION: &str = "0.5.4";

/// Where `cargo install` puts mdBook.
pub(crate) fn mdbook_bin() -> PathBuf {
    util::cargo_home().join("bin/mdbook")
}

/// mdBook at [`MDBOOK_VERSION`], from crates.io; another version present
/// is replaced. Without the `serve` and `watch` features (a web server and
/// a file watcher the build never uses), which halves the install.
fn mdbook() -> Result<()> {
    let bin = mdbook_bin();
    // "mdbook v0.5.4"
    let version = || {
        util::output(util::cmd(&bin).arg("--version"))
            .and_then(|o| o.split_whitespace().nth(1).map(|v| v.trim_start_matches('v').to_string()))
    };
    let found = version();
    if found.as_deref() == Some(MDBOOK_VERSION) {
        println!("ok: mdbook {MDBOOK_VERSION} present");
        return Ok(());
    }
    match &found {
        Some(v) => println!("installing: mdbook {MDBOOK_VERSION} (found {v}; cargo install mdbook --locked; about two minutes)"),
        None => println!("installing: mdbook {MDBOOK_VERSION} (cargo install mdbook --locked; about two minutes)"),
    }
    let mut c = util::cmd("cargo");
    c.args(["install", "mdbook", "--version", MDBOOK_VERSION, "--locked", "--force"])
        .args(["--no-default-features", "--features", "search"])
        // Our own build's settings must not leak into the install.
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("RUSTFLAGS")
        .env_remove("RUSTUP_TOOLCHAIN");
    util::run(&mut c)?;
    match version() {
        Some(v) if v == MDBOOK_VERSION => Ok(()),
        other => bail!("mdbook was installed but `{} --version` reports {other:?}", bin.display()),
    }
}

fn bpf_linker_version(bin: &Path) -> Option<String> {
    let out = util::output(util::cmd(bin).arg("--version"))?;
    // "bpf-linker 0.13.0"
    out.split_whitespace().nth(1).map(str::to_string)
}

fn bpf_linker() -> Result<()> {
    let bin = util::cargo_home().join("bin/bpf-linker");
    let found = bpf_linker_version(&bin);
    if let Some(v) = &found
        && v.starts_with(BPF_LINKER_SERIES)
    {
        println!("ok: bpf-linker {v} present");
        return Ok(());
    }
    match &found {
        Some(v) => println!("installing: bpf-linker {BPF_LINKER_VERSION} against LLVM 22 (found {v}; about a minute)"),
        None => println!("installing: bpf-linker {BPF_LINKER_VERSION} against LLVM 22 (about a minute)"),
    }
    if !Path::new(LLVM_PREFIX).join("bin/llvm-config").exists() {
        bail!("{LLVM_PREFIX}/bin/llvm-config is missing; bpf-linker needs llvm-22-dev");
    }
    // Without LLVM_PREFIX the build finds Debian's default LLVM 14 and fails
    // to link -lLLVM.
    let llvm_bin = PathBuf::from(LLVM_PREFIX).join("bin");
    let mut path = vec![llvm_bin];
    path.extend(std::env::split_paths(&util::path_with_cargo_bin()));
    let mut c = util::cmd("cargo");
    c.args(["install", "bpf-linker", "--version", BPF_LINKER_VERSION, "--locked", "--force"])
        .args(["--no-default-features", "--features", "llvm-22"])
        .env("LLVM_PREFIX", LLVM_PREFIX)
        .env("PATH", std::env::join_paths(path)?)
        // Our own build's settings must not leak into the install.
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("RUSTFLAGS")
        .env_remove("RUSTUP_TOOLCHAIN");
    util::run(&mut c)?;
    match bpf_linker_version(&bin) {
        Some(v) if v.starts_with(BPF_LINKER_SERIES) => {
            println!("ok: bpf-linker {v} installed");
            Ok(())
        }
        other => bail!("bpf-linker was installed but `{} --version` reports {other:?}", bin.display()),
    }
}
