//! What a running agent exposes to other users of the node: its pinned
//! maps and links are out of reach of anyone but root, it refuses a pin
//! directory another user owns, and its health and metrics port serves
//! reads only. (The chart's RBAC, read-only apart from Events, is checked
//! by charts/tests with Helm's real template engine.)

mod support;

use std::fs;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use proxy_agent::datapath::pins as pin_layout;
use proxy_test_support::http::http_get;
use proxy_test_support::wait::eventually;
use support::{Node, ServiceSpec};

/// `nobody`: a user without any privilege.
const NOBODY: u32 = 65_534;

fn service() -> String {
    ServiceSpec {
        name: "web",
        cluster_ips: &["10.96.0.10"],
        ports: &[("http", 80, "TCP", 8080)],
        endpoints: &[("10.244.0.1", true, "n1")],
        extra_spec: "",
        annotations: "",
    }
    .yaml()
}

/// Every path under `dir`, `dir` included.
fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = vec![dir.to_path_buf()];
    if let Ok(rd) = fs::read_dir(dir) {
        for e in rd.flatten() {
            let p = e.path();
            if fs::symlink_metadata(&p).is_ok_and(|m| m.is_dir()) {
                out.extend(walk(&p));
            } else {
                out.push(p);
            }
        }
    }
    out
}

/// Runs `program args` as `nobody`; whether it succeeded.
fn as_nobody(program: &str, args: &[&Path]) -> bool {
    Command::new(program)
        .args(args)
        .uid(NOBODY)
        .gid(NOBODY)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap_or_else(|e| panic!("run {program} as nobody: {e}"))
        .success()
}

fn wait_ready(node: &Node) -> SocketAddr {
    let addr = node.healthz_address();
    eventually("the agent to be ready", || match http_get(addr, "/readyz") {
        Ok((200, _)) => Ok(()),
        other => Err(other),
    });
    addr
}

#[test]
fn pinned_maps_and_links_are_out_of_reach_of_other_users() {
    let mut node = Node::new("n1");
    node.write_manifest("web.yaml", &service());
    node.start_agent_with(&["--healthz-bind-address", "127.0.0.1:0", "--metrics-bind-address", "127.0.0.1:0"]);
    wait_ready(&node);
    let pins = node.pins.path().to_path_buf();
    let meta = fs::metadata(&pins).expect("pin directory");
    assert_eq!(meta.mode() & 0o7777, 0o700, "the pin directory is its owner's only");
    assert_eq!(meta.uid(), 0);
    let paths = walk(&pins);
    assert!(paths.iter().any(|p| p.ends_with(proxy_common::SERVICES_MAP)), "the maps are pinned: {paths:?}");
    assert!(paths.iter().any(|p| p.components().any(|c| c.as_os_str() == pin_layout::LINKS_DIR)), "the links are pinned: {paths:?}");
    for p in &paths {
        let m = fs::symlink_metadata(p).expect("stat");
        // Below the 0700 directory nothing is reachable anyway; pins also
        // carry no permission for others themselves.
        assert_eq!(m.mode() & 0o022, 0, "{} is writable by others: {:o}", p.display(), m.mode());
        if m.is_file() {
            assert_eq!(m.mode() & 0o077, 0, "{} is open to others: {:o}", p.display(), m.mode());
        }
    }
    // As another user: nothing can be listed, read or removed.
    let services = pin_layout::map(&pins, proxy_common::SERVICES_MAP);
    assert!(!as_nobody("ls", &[&pins]), "nobody may list the pin directory");
    assert!(!as_nobody("cat", &[&services]), "nobody may open a pinned map");
    assert!(!as_nobody("rm", &[&services]), "nobody may unpin a map");
    assert!(services.exists());

    // A restart keeps it private, also after someone (root) opened it up.
    fs::set_permissions(&pins, fs::Permissions::from_mode(0o755)).expect("chmod");
    node.stop_agent();
    node.start_agent();
    eventually("the restarted agent to make its pin directory private again", || {
        let mode = fs::metadata(&pins).map(|m| m.mode() & 0o7777);
        if matches!(mode, Ok(0o700)) { Ok(()) } else { Err(mode) }
    });
    assert!(node.agent_running());
}

#[test]
fn a_pin_directory_owned_by_another_user_is_refused() {
    let mut node = Node::new("n1");
    node.write_manifest("web.yaml", &service());
    let pins = node.pins.path().to_path_buf();
    std::os::unix::fs::chown(&pins, Some(NOBODY), Some(NOBODY)).expect("chown the pin directory");
    node.start_agent();
    eventually("the agent to give up", || if node.agent_running() { Err(()) } else { Ok(()) });
    let log = node.agent_log();
    assert!(
        log.contains(&format!("refusing pin directory {}: it is owned by uid {NOBODY}", pins.display())),
        "no clear error in the log:\n{log}"
    );
    assert!(!pin_layout::map(&pins, proxy_common::SERVICES_MAP).exists(), "nothing was pinned there");
    // Nor a symlink another user put where the pin directory goes.
    let link = pins.with_file_name(format!("{}-link", pins.file_name().and_then(|n| n.to_str()).unwrap_or("tp")));
    std::os::unix::fs::symlink(&pins, &link).expect("symlink");
    std::os::unix::fs::lchown(&link, Some(NOBODY), Some(NOBODY)).expect("chown the symlink");
    let out = Command::new(support::agent_bin())
        .args(["run", "--node", "n1", "--devices", "none", "--manifests"])
        .arg(&node.manifests.0)
        .arg("--cgroup")
        .arg(node.cgroup.path())
        .arg("--bpffs")
        .arg(&link)
        .stdin(Stdio::null())
        .output()
        .expect("run the agent");
    let _ = fs::remove_file(&link);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the agent ran on a foreign symlink:\n{stderr}");
    assert!(stderr.contains(&format!("refusing pin directory {}: it is owned by uid {NOBODY}", link.display())), "{stderr}");
    // Given back to root, the same directory is taken.
    std::os::unix::fs::chown(&pins, Some(0), Some(0)).expect("chown back");
    node.start_agent_with(&["--healthz-bind-address", "127.0.0.1:0", "--metrics-bind-address", "127.0.0.1:0"]);
    wait_ready(&node);
    assert!(pin_layout::map(&pins, proxy_common::SERVICES_MAP).exists());
    assert_eq!(fs::metadata(&pins).expect("pin directory").mode() & 0o7777, 0o700);
}

/// One request with `method` (and a body) on a fresh connection: the
/// status code and the response head.
fn request(addr: SocketAddr, method: &str, path: &str) -> (u16, String) {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
    write!(s, "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{{}}").expect("request");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("response");
    let code = out.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (code, out.split("\r\n\r\n").next().unwrap_or_default().to_ascii_lowercase())
}

#[test]
fn the_health_and_metrics_ports_serve_no_write_operation() {
    let mut node = Node::new("n1");
    node.write_manifest("web.yaml", &service());
    node.start_agent_with(&["--healthz-bind-address", "127.0.0.1:0", "--metrics-bind-address", "127.0.0.1:0"]);
    let addr = wait_ready(&node);
    let metrics = node.metrics_address();
    for method in ["POST", "PUT", "DELETE", "PATCH"] {
        for path in ["/metrics", "/healthz", "/livez", "/readyz", "/"] {
            for a in [addr, metrics] {
                let (code, head) = request(a, method, path);
                assert_eq!(code, 405, "{method} {path} on {a}: {head}");
                assert!(head.contains("\r\nallow: get, head"), "{method} {path} on {a}: {head}");
            }
        }
    }
    // Apart, as kube-proxy serves them: the health port does not give
    // away the metrics (Service names, per-tier counts).
    assert_eq!(request(addr, "GET", "/metrics").0, 404);
    assert_eq!(request(metrics, "GET", "/metrics").0, 200);
    assert_eq!(request(metrics, "GET", "/healthz").0, 404);
    assert_eq!(request(addr, "GET", "/healthz").0, 200);
    assert_eq!(request(addr, "GET", "/readyz").0, 200, "still ready after the refused requests");
    assert!(node.agent_running());
}
