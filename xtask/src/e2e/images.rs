//! The container images the e2e node runs, built here without an image
//! registry, under the names `e2e.test --list-images` prints:
//!
//! - agnhost (`registry.k8s.io/e2e-test-images/agnhost:2.66.1`): the
//!   agnhost binary of tools/k8s-node on a Debian root filesystem with
//!   what upstream's agnhost Dockerfile installs from Alpine (dig, curl,
//!   nc, ip and ss, iperf, bash, socat, util-linux; and wget, which Alpine's
//!   busybox brings and the tests use), made with mmdebstrap;
//!   `/agnhost-2` and `/uploads` as in that Dockerfile. Entrypoint
//!   `/agnhost`, command `pause`.
//! - pause (`registry.k8s.io/pause:3.10.2`, the sandbox image): the same
//!   layer, running `agnhost pause`, which does what the pause binary does.
//! - busybox (`registry.k8s.io/e2e-test-images/busybox:1.37.0-2`): the
//!   same layer with `sh` as its command; the tests that use it run shell
//!   commands only.
//! - CoreDNS (`registry.k8s.io/coredns/coredns:v1.15.0`): the binary of
//!   tools/coredns alone.
//!
//! One OCI image layout, written as a tar archive for `ctr images import`
//! (the `io.containerd.image.name` annotation names each image). Layers
//! are uncompressed: they never leave this machine. Rebuilt when an input
//! is newer than the archive.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};
use serde_json::json;

pub(crate) const AGNHOST: &str = "registry.k8s.io/e2e-test-images/agnhost:2.66.1";
pub(crate) const BUSYBOX: &str = "registry.k8s.io/e2e-test-images/busybox:1.37.0-2";
pub(crate) const COREDNS: &str = "registry.k8s.io/coredns/coredns:v1.15.0";
/// Debian's names for what agnhost's Dockerfile adds to Alpine, and wget,
/// which Alpine's busybox has and the tests call (`wget -q -O - -T 1`).
const AGNHOST_PACKAGES: [&str; 10] =
    ["bind9-dnsutils", "curl", "netcat-openbsd", "iproute2", "iperf", "bash", "util-linux", "socat", "ca-certificates", "wget"];
const PATH_ENV: &str = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Builds (or reuses) the archive in `dir` from the binaries in `bin`;
/// returns its path.
pub(crate) fn build(dir: &Path, bin: &Path, pause: &str) -> Result<PathBuf> {
    fs::create_dir_all(dir)?;
    let rootfs = rootfs(dir)?;
    let archive = dir.join("test-images.oci.tar");
    let inputs = [rootfs.clone(), bin.join("agnhost"), bin.join("coredns")];
    let newest = inputs.iter().filter_map(|p| fs::metadata(p).and_then(|m| m.modified()).ok()).max();
    let built = fs::metadata(&archive).and_then(|m| m.modified()).ok();
    if built.is_some_and(|b| newest.is_some_and(|n| b > n)) {
        println!("e2e: test images present ({})", archive.display());
        return Ok(archive);
    }
    let layout = dir.join("layout");
    let _ = fs::remove_dir_all(&layout);
    fs::create_dir_all(layout.join("blobs/sha256"))?;
    let work = dir.join("work");
    let _ = fs::remove_dir_all(&work);
    fs::create_dir_all(work.join("agnhost/uploads"))?;
    fs::create_dir_all(work.join("coredns"))?;

    // agnhost's layer: the root filesystem and the binary.
    let agnhost_layer = work.join("agnhost.tar");
    fs::copy(&rootfs, &agnhost_layer)?;
    fs::copy(bin.join("agnhost"), work.join("agnhost/agnhost"))?;
    std::os::unix::fs::symlink("agnhost", work.join("agnhost/agnhost-2"))?;
    tar(tar_cmd().arg("--append").arg("-f").arg(&agnhost_layer).arg("-C").arg(work.join("agnhost")).args([
        "./agnhost",
        "./agnhost-2",
        "./uploads",
    ]))?;
    let agnhost = blob(&layout, &agnhost_layer)?;

    let coredns_layer = work.join("coredns.tar");
    fs::copy(bin.join("coredns"), work.join("coredns/coredns"))?;
    tar(tar_cmd().arg("-cf").arg(&coredns_layer).arg("-C").arg(work.join("coredns")).arg("./coredns"))?;
    let coredns = blob(&layout, &coredns_layer)?;

    let images = [
        image(&layout, AGNHOST, &agnhost, &json!(["/agnhost"]), &json!(["pause"]))?,
        image(&layout, pause, &agnhost, &json!(["/agnhost", "pause"]), &json!(null))?,
        image(&layout, BUSYBOX, &agnhost, &json!(null), &json!(["sh"]))?,
        image(&layout, COREDNS, &coredns, &json!(["/coredns"]), &json!(null))?,
    ];
    let index = json!({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": images});
    fs::write(layout.join("index.json"), serde_json::to_vec(&index)?)?;
    fs::write(layout.join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#)?;
    let partial = dir.join("test-images.oci.tar.partial");
    tar(tar_cmd().arg("-cf").arg(&partial).arg("-C").arg(&layout).arg("."))?;
    fs::rename(&partial, &archive)?;
    let _ = fs::remove_dir_all(&layout);
    let _ = fs::remove_dir_all(&work);
    println!("e2e: test images in {} ({:.0} MB)", archive.display(), fs::metadata(&archive)?.len() as f64 / 1e6);
    Ok(archive)
}

/// A content-addressed blob: its digest (hex) and size.
struct Blob {
    digest: String,
    size: u64,
}

/// Moves `file` into the layout's blobs under its sha256.
fn blob(layout: &Path, file: &Path) -> Result<Blob> {
    let out = Command::new("sha256sum").arg(file).stdin(Stdio::null()).output().context("cannot run sha256sum")?;
    let text = String::from_utf8_lossy(&out.stdout);
    let digest =
        text.split_whitespace().next().filter(|d| d.len() == 64).with_context(|| format!("sha256sum printed {text:?}"))?.to_string();
    let size = fs::metadata(file)?.len();
    fs::rename(file, layout.join("blobs/sha256").join(&digest))?;
    Ok(Blob { digest, size })
}

/// Writes a JSON document as a blob.
fn json_blob(layout: &Path, value: &serde_json::Value) -> Result<Blob> {
    let tmp = layout.join("blob.json");
    fs::write(&tmp, serde_json::to_vec(value)?)?;
    blob(layout, &tmp)
}

/// An image of one layer: its config and manifest blobs; returns the
/// index entry that names it.
fn image(layout: &Path, name: &str, layer: &Blob, entrypoint: &serde_json::Value, cmd: &serde_json::Value) -> Result<serde_json::Value> {
    let config = json!({
        "architecture": "amd64",
        "os": "linux",
        "config": {"Env": [PATH_ENV], "Entrypoint": entrypoint, "Cmd": cmd, "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [format!("sha256:{}", layer.digest)]},
    });
    let config = json_blob(layout, &config)?;
    let manifest = json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": format!("sha256:{}", config.digest), "size": config.size},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": format!("sha256:{}", layer.digest), "size": layer.size}],
    });
    let manifest = json_blob(layout, &manifest)?;
    let tag = name.rsplit_once(':').map_or("latest", |(_, t)| t);
    Ok(json!({
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "digest": format!("sha256:{}", manifest.digest),
        "size": manifest.size,
        "annotations": {"io.containerd.image.name": name, "org.opencontainers.image.ref.name": tag},
    }))
}

/// agnhost's Debian root filesystem, made with mmdebstrap (about a minute,
/// at the lowest priority) when missing, older than a week or made from
/// another package list (`image::debian_tarball`).
fn rootfs(dir: &Path) -> Result<PathBuf> {
    crate::image::debian_tarball(dir, "agnhost-rootfs", "minbase", &AGNHOST_PACKAGES, true)
}

/// tar, with what it adds owned by root inside the image, whoever built it.
fn tar_cmd() -> Command {
    let mut c = Command::new("tar");
    c.args(["--owner=0", "--group=0"]).stdin(Stdio::null());
    c
}

fn tar(c: &mut Command) -> Result<()> {
    let out = c.output().context("cannot run tar")?;
    if !out.status.success() {
        bail!("{c:?} failed: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}
