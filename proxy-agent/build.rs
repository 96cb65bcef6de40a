//! Builds the `proxy-ebpf` object and leaves it in OUT_DIR for
//! `include_bytes_aligned!`, so the agent binary is all a node needs.
//!
//! The eBPF crate needs nightly (`-Z build-std=core`) and bpf-linker; `cargo
//! xtask setup` installs both. The nested cargo uses its own target
//! directory (`target/ebpf`), since cargo holds a lock on ours while this
//! script runs. Set PROXY_EBPF_OBJECT to embed a prebuilt object instead
//! (container builds do).

use std::env;
use std::path::PathBuf;
use std::process::Command;

fn main() {
    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let dest = out_dir.join("proxy-ebpf");
    println!("cargo:rerun-if-env-changed=PROXY_EBPF_OBJECT");
    if let Some(prebuilt) = env::var_os("PROXY_EBPF_OBJECT") {
        println!("cargo:rerun-if-changed={}", PathBuf::from(&prebuilt).display());
        std::fs::copy(&prebuilt, &dest).expect("copy PROXY_EBPF_OBJECT");
        return;
    }
    let workspace = manifest_dir.parent().expect("proxy-agent lives in the workspace").to_path_buf();
    let ebpf_dir = workspace.join("proxy-ebpf");
    for p in [
        "proxy-ebpf/src",
        "proxy-ebpf/Cargo.toml",
        "proxy-ebpf/Cargo.lock",
        "proxy-ebpf/rust-toolchain.toml",
        "proxy-common/src",
        "proxy-common/Cargo.toml",
    ] {
        println!("cargo:rerun-if-changed={}", workspace.join(p).display());
    }
    let target_dir = env::var_os("CARGO_TARGET_DIR").map_or_else(|| workspace.join("target"), PathBuf::from).join("ebpf");

    // The pinned nightly of proxy-ebpf/rust-toolchain.toml.
    let toolchain = std::fs::read_to_string(ebpf_dir.join("rust-toolchain.toml")).expect("read proxy-ebpf/rust-toolchain.toml");
    let channel = toolchain
        .lines()
        .find_map(|l| l.trim().strip_prefix("channel")?.trim().strip_prefix('=')?.trim().strip_prefix('"')?.strip_suffix('"'))
        .expect("proxy-ebpf/rust-toolchain.toml names a channel");
    let mut cmd = Command::new("rustup");
    cmd.args(["run", channel, "cargo", "build", "--release", "-Z", "build-std=core", "--target", "bpfel-unknown-none"])
        .arg("--manifest-path")
        .arg(ebpf_dir.join("Cargo.toml"))
        .arg("--target-dir")
        .arg(&target_dir)
        // BTF in the object lets bpftool print map fields by name.
        .env("CARGO_ENCODED_RUSTFLAGS", "-Cdebuginfo=2\x1f-Clink-arg=--btf");
    // The outer build's toolchain must not leak into the nightly one.
    for key in ["RUSTC", "RUSTC_WORKSPACE_WRAPPER", "RUSTC_WRAPPER", "RUSTUP_TOOLCHAIN", "CARGO_TARGET_DIR", "RUSTFLAGS"] {
        cmd.env_remove(key);
    }
    let status = cmd.status().unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}. Run `cargo xtask setup` first"));
    assert!(
        status.success(),
        "building the eBPF object failed ({status}). Run `cargo xtask setup` to install {channel} with rust-src, and bpf-linker"
    );
    let built = target_dir.join("bpfel-unknown-none/release/proxy-ebpf");
    std::fs::copy(&built, &dest).unwrap_or_else(|e| panic!("copy {}: {e}", built.display()));
}
