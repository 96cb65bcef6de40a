//! Graceful termination as applications see it, with real software from
//! Debian's packages: nginx (`nginx-light`) as the backends, curl and wrk
//! as the clients (`cargo xtask setup` installs them).
//!
//! The rules under test (`decide/departures.rs`): a TCP connection is ended
//! in one case only, when its endpoint is gone from every EndpointSlice of
//! its Service after it was seen terminating. It is left alone while its
//! endpoint drains or stops serving, when the node's topology no longer
//! picks it, when the endpoint vanishes without ever terminating, and when
//! the Service loses its last endpoint. Connected UDP sockets are still
//! ended when their endpoint is gone or not serving. An endpoint that moves
//! from one slice of its Service to another (two updates) has not departed:
//! nothing is ended. New connections avoid a draining or not-serving
//! endpoint from the first change on.
//!
//! Pods are addresses on the loopback of one isolated namespace (as in
//! stale_backends.rs), with no route out; clients run there inside the
//! node's cgroup, so their connect() goes through the agent's programs. The
//! agent runs in the host's namespace with `--devices none`. nginx paces
//! its downloads at 1 MiB/s, so a download is in flight across the changes
//! a test makes; a backend's process keeps running until the test quits it,
//! so whatever breaks a client is the agent's doing.

mod support;

use std::net::SocketAddr;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use proxy_test_support::sandbox::echo_server;
use proxy_test_support::wait::{eventually, wait_limit};
use proxy_test_support::workloads::{Download, DownloadResult, Nginx, Reply, Wrk, WrkReport, get_each, installed};
use support::*;

const MIB: u64 = 1 << 20;

/// How fast nginx sends `/file`: a download of N MiB takes N seconds, and
/// up to 8 times longer under `cargo xtask vmtest`'s emulated CPU, whose
/// steps are that much slower (a download must outlast them; curl gives
/// up after 120 s).
fn rate() -> u64 {
    let slower = (wait_limit().as_secs_f64() / 30.0).clamp(1.0, 8.0);
    (MIB as f64 / slower) as u64
}

/// Endpoint conditions as the EndpointSlice controller writes them.
const READY: &str = "ready: true";
/// Not ready and not terminating: a failing readiness probe (`serving`
/// follows `ready` when absent).
const NOT_READY: &str = "ready: false";
const DRAINING: &str = "ready: false, serving: true, terminating: true";
const GONE_FROM_SERVING: &str = "ready: false, serving: false, terminating: true";

/// One test at a time, whatever `--test-threads` says: wrk keeps both cores
/// of the development machine busy, and the other tests time downloads
/// and a 1 s window.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Says plainly what is missing instead of failing obscurely.
fn require_programs(programs: &[&str]) {
    require_root();
    for &p in programs {
        assert!(installed(p), "{p} is missing: `cargo xtask setup` (or apt-get install nginx-light curl wrk) installs it");
    }
}

/// An endpoint of a slice.
#[derive(Clone, Copy)]
struct Ep<'a> {
    ip: &'a str,
    cond: &'a str,
    node: &'a str,
    /// Empty: no `zone` field.
    zone: &'a str,
}

/// An endpoint on this node (`node-1`).
fn here<'a>(ip: &'a str, cond: &'a str) -> Ep<'a> {
    Ep { ip, cond, node: "node-1", zone: "" }
}

/// A Service port: (name, port, protocol, target port).
type Port<'a> = (&'a str, u16, &'a str, u16);

const HTTP: &[Port<'static>] = &[("http", 80, "TCP", 80)];

fn service(name: &str, cluster_ip: &str, ports: &[Port], annotations: &str) -> String {
    let ports: String =
        ports.iter().map(|(n, p, proto, t)| format!("  - {{name: {n}, port: {p}, protocol: {proto}, targetPort: {t}}}\n")).collect();
    format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: default\n  annotations: {{{annotations}}}\nspec:\n  clusterIP: {cluster_ip}\n  ports:\n{ports}"
    )
}

/// One EndpointSlice `slice` of Service `service`.
fn slice(service: &str, slice: &str, ports: &[Port], endpoints: &[Ep]) -> String {
    let ports: String = ports.iter().map(|(n, _, proto, t)| format!("- {{name: {n}, port: {t}, protocol: {proto}}}\n")).collect();
    let eps: String = endpoints
        .iter()
        .map(|e| {
            let zone = if e.zone.is_empty() { String::new() } else { format!(", zone: {}", e.zone) };
            format!("- {{addresses: [\"{}\"], nodeName: {}{zone}, conditions: {{{}}}}}\n", e.ip, e.node, e.cond)
        })
        .collect();
    format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {slice}\n  namespace: default\n  labels: {{kubernetes.io/service-name: {service}}}\naddressType: IPv4\nports:\n{ports}endpoints:{}\n{eps}",
        if eps.is_empty() { " []" } else { "" }
    )
}

/// An HTTP Service (port 80) with one slice.
fn web(name: &str, cluster_ip: &str, endpoints: &[Ep]) -> String {
    format!("{}---\n{}", service(name, cluster_ip, HTTP, ""), slice(name, &format!("{name}-1"), HTTP, endpoints))
}

/// Node `node-1` with its first manifests, (file, YAML), and its agent.
fn node_with(manifests: &[(&str, &str)]) -> Node {
    let mut node = Node::new("node-1");
    for (file, yaml) in manifests {
        node.write_manifest(file, yaml);
    }
    node.start_agent();
    node
}

/// nginx as pod `name` on `ip`:80, serving a `/file` of `file_bytes` at
/// [`rate`].
fn nginx(net: &PodNetwork, name: &str, ip: &str, file_bytes: u64) -> Nginx {
    net.netns.add_loopback_addrs(&[&format!("{ip}/32")]).expect("pod address");
    let listen = SocketAddr::new(ip.parse().expect("pod address"), 80);
    Nginx::start(&net.netns, name, listen, file_bytes, Some(rate())).expect("start nginx")
}

/// Which pods answered `n` new connections to `url` from a pod of `node`.
fn new_connections(node: &Node, net: &PodNetwork, url: &str, n: usize) -> Vec<Reply> {
    get_each(&net.netns, Some(&node.cgroup), url, n).expect("run curl")
}

fn only(replies: &[Reply], n: usize, want: &[&str]) -> bool {
    replies.len() == n && replies.iter().all(|r| r.http_code == 200 && want.contains(&r.backend.as_str()))
}

/// Waits until ten new connections in a row reach only pods of `want`;
/// returns how long that took.
fn wait_only(node: &Node, net: &PodNetwork, url: &str, want: &[&str]) -> Duration {
    let start = Instant::now();
    eventually(&format!("new connections to {url} to reach only {want:?}"), || {
        let r = new_connections(node, net, url, 10);
        if only(&r, 10, want) { Ok(()) } else { Err(r) }
    });
    start.elapsed()
}

fn assert_only(node: &Node, net: &PodNetwork, url: &str, want: &[&str], when: &str) {
    let r = new_connections(node, net, url, 10);
    assert!(only(&r, 10, want), "{when}: new connections reached {r:?}, expected only {want:?}");
}

/// Waits until a new connection to `url` reaches pod `name`.
fn wait_reached(node: &Node, net: &PodNetwork, url: &str, name: &str) {
    eventually(&format!("a new connection to {url} to reach {name}"), || {
        let r = new_connections(node, net, url, 10);
        if r.iter().any(|x| x.http_code == 200 && x.backend == name) { Ok(()) } else { Err(r) }
    });
}

/// A download from a pod of `node`, without a client-side rate limit: nginx
/// paces it, and a client that read slower than nginx sends would hold the
/// tail of the response in its socket after nginx is done.
fn download(node: &Node, net: &PodNetwork, cluster_ip: &str) -> Download {
    Download::start(&net.netns, Some(&node.cgroup), &format!("http://{cluster_ip}{}", Nginx::FILE_PATH), None).expect("start curl")
}

/// `d` is still downloading after `step`; otherwise fails with what curl
/// reported (cut: the step broke it; complete: the test is too slow to
/// have tested anything).
fn still_in_flight(mut d: Download, step: &str) -> Download {
    if d.running() {
        return d;
    }
    let r = d.finish(Duration::from_secs(1));
    panic!("the download ended {step}: {r:?}");
}

fn assert_whole(r: &DownloadResult, bytes: u64, from: &str) {
    assert!(
        r.exit == Some(0) && r.http_code == 200 && r.size_download == bytes && r.bytes_written == bytes && r.backend == from,
        "the download from {from} is whole ({bytes} bytes, HTTP 200, curl exit 0): {r:?}"
    );
}

/// Kubernetes' order for a pod that is deleted while a download from it
/// runs: terminating but serving, then no longer serving, then its nginx
/// quits gracefully (finishing the download), then the endpoint leaves the
/// slice. The download completes; new connections avoid the pod from the
/// first change on.
#[test]
fn a_download_completes_across_drain_not_serving_graceful_quit_and_removal() {
    let _serial = serial();
    // No wrk: `cargo xtask vmtest`'s guests carry nginx and curl only.
    require_programs(&["nginx", "curl"]);
    let net = PodNetwork::new();
    let size = 6 * MIB;
    let mut a = nginx(&net, "a", "10.244.40.1", size);
    let _b = nginx(&net, "b", "10.244.40.2", size);
    let (cip, url) = ("10.96.40.10", "http://10.96.40.10/name");
    let (a_ip, b_ip) = ("10.244.40.1", "10.244.40.2");
    let node = node_with(&[("web.yaml", &web("web", cip, &[here(a_ip, READY)]))]);
    let write = |eps: &[Ep]| node.write_manifest("web.yaml", &web("web", cip, eps));
    wait_only(&node, &net, url, &["a"]);

    // a is the only endpoint: the download is a's.
    let d = download(&node, &net, cip);
    std::thread::sleep(Duration::from_millis(500));
    // The replacement is ready first, as a rolling update does it.
    write(&[here(a_ip, READY), here(b_ip, READY)]);
    wait_reached(&node, &net, url, "b");

    write(&[here(a_ip, DRAINING), here(b_ip, READY)]);
    let took = wait_only(&node, &net, url, &["b"]);
    assert!(took <= within(), "new connections avoided the draining pod only {took:?} after the change");
    let d = still_in_flight(d, "when a started draining");

    write(&[here(a_ip, GONE_FROM_SERVING), here(b_ip, READY)]);
    // Longer than the agent takes to act on a change.
    std::thread::sleep(within() + Duration::from_millis(200));
    assert_only(&node, &net, url, &["b"], "a no longer serving");
    let d = still_in_flight(d, "when a stopped serving (terminating, not serving must not end TCP)");

    // nginx's graceful stop (`nginx -s quit`, what a preStop hook runs,
    // since nginx takes SIGTERM as a fast shutdown): the download goes on,
    // and nginx exits once it is sent.
    a.quit();
    std::thread::sleep(Duration::from_millis(300));
    assert!(a.running(), "nginx on a waits for the download in flight before exiting");
    let d = still_in_flight(d, "when nginx on a was told to quit");
    assert!(a.wait_exit(wait_limit()).expect("wait for nginx").is_some(), "nginx on a did not exit: {}", a.error_log());

    // The pod object goes once its containers exited: a leaves the slice.
    write(&[here(b_ip, READY)]);
    let r = d.finish(wait_limit()).expect("curl");
    assert_whole(&r, size, "a");
    std::thread::sleep(within());
    assert_only(&node, &net, url, &["b"], "a removed");
}

/// A readiness probe that fails for a while: the pod goes not ready
/// (not terminating) and comes back, while a download from it runs. New
/// connections avoid it meanwhile; the download completes.
#[test]
fn a_download_survives_its_backend_flapping_not_ready_and_back() {
    let _serial = serial();
    // No wrk: `cargo xtask vmtest`'s guests carry nginx and curl only.
    require_programs(&["nginx", "curl"]);
    let net = PodNetwork::new();
    let size = 5 * MIB;
    let _a = nginx(&net, "a", "10.244.41.1", size);
    let _b = nginx(&net, "b", "10.244.41.2", size);
    let (cip, url) = ("10.96.41.10", "http://10.96.41.10/name");
    let (a_ip, b_ip) = ("10.244.41.1", "10.244.41.2");
    let node = node_with(&[("web.yaml", &web("web", cip, &[here(a_ip, READY)]))]);
    let write = |eps: &[Ep]| node.write_manifest("web.yaml", &web("web", cip, eps));
    wait_only(&node, &net, url, &["a"]);

    let d = download(&node, &net, cip);
    std::thread::sleep(Duration::from_millis(500));
    // b serves too, so a's leaving the set is not the Service losing its
    // last endpoint (which ends nothing in any case).
    write(&[here(a_ip, READY), here(b_ip, READY)]);
    wait_reached(&node, &net, url, "b");

    write(&[here(a_ip, NOT_READY), here(b_ip, READY)]);
    let took = wait_only(&node, &net, url, &["b"]);
    assert!(took <= within(), "new connections avoided the unready pod only {took:?} after the change");
    std::thread::sleep(within());
    let d = still_in_flight(d, "when a went not ready (not serving, not terminating, must not end TCP)");

    write(&[here(a_ip, READY), here(b_ip, READY)]);
    wait_reached(&node, &net, url, "a");
    let d = still_in_flight(d, "when a was ready again");
    let r = d.finish(wait_limit()).expect("curl");
    assert_whole(&r, size, "a");
}

/// Nodes in two zones; this agent's node is node-1, in zone-a.
const NODES: &str = "apiVersion: v1\nkind: Node\nmetadata:\n  name: node-1\n  labels: {kubernetes.io/hostname: node-1, topology.kubernetes.io/zone: zone-a, topology.kubernetes.io/region: region-1}\n---\napiVersion: v1\nkind: Node\nmetadata:\n  name: node-2\n  labels: {kubernetes.io/hostname: node-2, topology.kubernetes.io/zone: zone-b, topology.kubernetes.io/region: region-1}\n";

/// Topology keys "same zone, else anywhere": the only endpoint is in
/// another zone, and a download from it runs when an endpoint appears in
/// this node's zone. From then on the topology picks only the near one for
/// new connections; the download from the far one completes.
#[test]
fn a_download_from_a_remote_zone_survives_a_same_zone_endpoint_appearing() {
    let _serial = serial();
    // No wrk: `cargo xtask vmtest`'s guests carry nginx and curl only.
    require_programs(&["nginx", "curl"]);
    let net = PodNetwork::new();
    let size = 4 * MIB;
    let _far = nginx(&net, "far", "10.244.42.2", size);
    let _near = nginx(&net, "near", "10.244.42.1", size);
    let (cip, url) = ("10.96.42.10", "http://10.96.42.10/name");
    let far = Ep { ip: "10.244.42.2", cond: READY, node: "node-2", zone: "zone-b" };
    let near = Ep { ip: "10.244.42.1", cond: READY, node: "node-1", zone: "zone-a" };
    let web = |eps: &[Ep]| {
        format!(
            "{}---\n{}",
            service("web", cip, HTTP, "topoproxy.io/topology-keys: \"topology.kubernetes.io/zone, *\""),
            slice("web", "web-1", HTTP, eps)
        )
    };
    let node = node_with(&[("nodes.yaml", NODES), ("web.yaml", &web(&[far]))]);
    let write = |eps: &[Ep]| node.write_manifest("web.yaml", &web(eps));
    // Nothing in zone-a: "*" falls back to the far endpoint.
    wait_only(&node, &net, url, &["far"]);

    let d = download(&node, &net, cip);
    std::thread::sleep(Duration::from_millis(500));
    write(&[far, near]);
    let took = wait_only(&node, &net, url, &["near"]);
    assert!(took <= within(), "new connections went to the same-zone endpoint only {took:?} after it appeared");
    std::thread::sleep(within());
    let d = still_in_flight(d, "when the topology stopped picking its backend (must not end TCP)");
    let r = d.finish(wait_limit()).expect("curl");
    assert_whole(&r, size, "far");
    assert_only(&node, &net, url, &["near"], "after the download");
}

/// Three nginx pods replaced one by one the way a Deployment's rolling
/// update does it, under wrk's load on the ClusterIP: the new pod starts
/// and is ready in the slice, the old one drains, stops serving, quits
/// gracefully and leaves the slice. Returns wrk's report.
fn rolling_replacement(variant: &str, subnet: u8, keep_alive: bool) -> WrkReport {
    require_programs(&["nginx", "curl", "wrk"]);
    let net = PodNetwork::new();
    let ip = |host: u8| format!("10.244.{subnet}.{host}");
    let cip = format!("10.96.{subnet}.10");
    let url = format!("http://{cip}{}", Nginx::NAME_PATH);
    let mut old: Vec<Nginx> = (1..=3).map(|i| nginx(&net, &format!("old-{i}"), &ip(i), MIB)).collect();
    let mut new: Vec<Nginx> = Vec::new();
    // The slice's endpoints: (address, conditions).
    let mut eps: Vec<(String, &str)> = (1..=3).map(|i| (ip(i), READY)).collect();
    let yaml = |eps: &[(String, &str)]| {
        let eps: Vec<Ep> = eps.iter().map(|(a, c)| here(a, c)).collect();
        web("web", &cip, &eps)
    };
    let node = node_with(&[("web.yaml", &yaml(&eps))]);
    let write = |node: &Node, eps: &[(String, &str)]| node.write_manifest("web.yaml", &yaml(eps));
    for i in 1..=3 {
        wait_reached(&node, &net, &url, &format!("old-{i}"));
    }

    let headers: &[&str] = if keep_alive { &[] } else { &["Connection: close"] };
    // wrk runs until the update is done (stopped below), however long a
    // loaded machine takes over it: a fixed 16 s run once ended first
    // while the CI's VM guest ran beside the tests.
    let mut wrk = Wrk::start(&net.netns, Some(&node.cgroup), &url, 8, Duration::from_mins(5), headers).expect("start wrk");
    std::thread::sleep(Duration::from_millis(1500));
    // Longer than the agent takes to apply a change (tens of ms here).
    let settle = Duration::from_millis(500);
    for i in 1..=3u8 {
        new.push(nginx(&net, &format!("new-{i}"), &ip(10 + i), MIB));
        eps.push((ip(10 + i), READY));
        write(&node, &eps);
        wait_reached(&node, &net, &url, &format!("new-{i}"));

        let at = eps.iter().position(|(a, _)| *a == ip(i)).expect("old pod in the slice");
        eps[at].1 = DRAINING;
        write(&node, &eps);
        std::thread::sleep(settle);
        eps[at].1 = GONE_FROM_SERVING;
        write(&node, &eps);
        std::thread::sleep(settle);
        let pod = &mut old[usize::from(i - 1)];
        pod.quit();
        assert!(pod.wait_exit(wait_limit()).expect("wait for nginx").is_some(), "nginx {} did not quit: {}", pod.name(), pod.error_log());
        eps.remove(at);
        write(&node, &eps);
        std::thread::sleep(settle);
    }
    assert!(wrk.running(), "wrk ended before the rolling update did: the update must run under load");
    assert_only(&node, &net, &url, &["new-1", "new-2", "new-3"], "after the rolling update");
    let (report, text) = wrk.stop().expect("wrk");
    eprintln!("rolling replacement of 3 nginx pods under wrk -t1 -c8, {variant}: {report}");
    assert!(report.requests > 0, "wrk made no request:\n{text}");
    assert_eq!(report.non_2xx_3xx, 0, "every response is a 200:\n{text}");
    report
}

/// A new connection per request: every connect() picks from the
/// current set, so no request may fail at all.
#[test]
fn rolling_replacement_under_wrk_with_a_connection_per_request_has_no_errors() {
    let _serial = serial();
    let report = rolling_replacement("a new connection per request (Connection: close)", 43, false);
    assert_eq!(report.socket_errors(), 0, "no socket error: {report}");
}

/// Keep-alive: wrk's connections stay on the old pods until nginx's
/// graceful quit closes them (idle ones at once, busy ones after their
/// response); a request written as the connection closes fails as a read
/// or write error, which wrk then replaces with a new connection. Those
/// are reported, not failed; a wrong status is a failure.
#[test]
fn rolling_replacement_under_wrk_with_keep_alive_reports_its_errors() {
    let _serial = serial();
    rolling_replacement("keep-alive", 45, true);
}

/// A long-lived TCP connection through the Service (a line each way every
/// 20 ms).
fn tcp_stream(node: &Node, net: &PodNetwork, name: &str, to: &str) -> Stream {
    Stream::start(
        name,
        pod_probe(node, &net.netns, &["--to", to, "--stream", "--count", "1000000", "--interval-ms", "20", "--timeout-ms", "2000"]),
    )
}

/// The one case that ends TCP: a pod that terminated (drained, then
/// stopped serving) and is then gone from the slice. Its connections stay
/// through draining and not serving, and are aborted within 1 s of the
/// removal; the backend's process keeps running, so the abort is the
/// agent's.
#[test]
fn a_connection_to_a_pod_removed_after_terminating_is_aborted_within_a_second() {
    let _serial = serial();
    require_root();
    let net = PodNetwork::new();
    let (a_ip, b_ip) = ("10.244.44.1", "10.244.44.2");
    net.netns.add_loopback_addrs(&["10.244.44.1/32", "10.244.44.2/32"]).expect("pod addresses");
    let _a = echo_server(&net.netns, "10.244.44.1:80".parse().unwrap()).expect("echo a");
    let _b = echo_server(&net.netns, "10.244.44.2:80".parse().unwrap()).expect("echo b");
    let node = node_with(&[("echo.yaml", &web("echo", "10.96.44.10", &[here(a_ip, READY)]))]);
    let write = |eps: &[Ep]| node.write_manifest("echo.yaml", &web("echo", "10.96.44.10", eps));
    eventually("the Service to answer", || {
        node.probe(&net, &["--to", "10.96.44.10:80"]).first().map(|r| r["ok"] == true).filter(|ok| *ok).ok_or(())
    });
    // a is the only endpoint: both connections are a's.
    let conns: Vec<Stream> = (0..2).map(|i| tcp_stream(&node, &net, &format!("connection {i} on a"), "10.96.44.10:80")).collect();
    for c in &conns {
        c.wait_answered(3);
    }
    write(&[here(a_ip, READY), here(b_ip, READY)]);

    for (cond, step) in [(DRAINING, "draining"), (GONE_FROM_SERVING, "terminating and no longer serving")] {
        write(&[here(a_ip, cond), here(b_ip, READY)]);
        let t = Instant::now();
        std::thread::sleep(within() + Duration::from_millis(500));
        for c in &conns {
            assert_eq!(c.first_failure_since(t), None, "{} stays while a is {step}", c.name);
        }
    }

    write(&[here(b_ip, READY)]);
    let t0 = Instant::now();
    for c in &conns {
        let (at, failure) = eventually(&format!("{} to be aborted", c.name), || c.first_failure_since(t0).ok_or(()));
        let errno = failure["errno"].as_i64();
        assert!(errno == Some(ECONNABORTED) || errno == Some(ECONNRESET), "{}: aborted or reset, got {failure}", c.name);
        assert!(at <= within(), "{} failed {at:?} after a left the slice, later than {:?}", c.name, within());
    }
}

const MOVING_PORTS: &[Port<'static>] = &[("dns", 53, "UDP", 53), ("echo", 80, "TCP", 80)];

/// Endpoint `a` moves from slice 1 of its Service to slice 2, as two
/// manifest updates 100 ms apart (the agent polls every 50 ms, so it sees
/// the state in between), with `a` in `cond` (READY or DRAINING). A
/// connected UDP socket and a TCP connection on `a` keep going: `a` never
/// left the Service.
fn slice_move(subnet: u8, remove_first: bool, cond: &str) {
    let mut net = PodNetwork::new();
    let (a_ip, b_ip) = (format!("10.244.{subnet}.1"), format!("10.244.{subnet}.2"));
    net.backend("pod-a", &a_ip, &[53]);
    net.backend("pod-b", &b_ip, &[53]);
    let _echo_a = echo_server(&net.netns, SocketAddr::new(a_ip.parse().unwrap(), 80)).expect("echo a");
    let _echo_b = echo_server(&net.netns, SocketAddr::new(b_ip.parse().unwrap(), 80)).expect("echo b");
    let cip = format!("10.96.{subnet}.10");
    let (udp_to, tcp_to) = (format!("{cip}:53"), format!("{cip}:80"));
    let slice_yaml = |n: u8, eps: &[Ep]| slice("moving", &format!("moving-{n}"), MOVING_PORTS, eps);
    let node = node_with(&[
        ("service.yaml", &service("moving", &cip, MOVING_PORTS, "")),
        ("slice-1.yaml", &slice_yaml(1, &[here(&a_ip, READY)])),
        ("slice-2.yaml", &slice_yaml(2, &[])),
    ]);
    let write_slice = |n: u8, eps: &[Ep]| node.write_manifest(&format!("slice-{n}.yaml"), &slice_yaml(n, eps));
    wait_for_backends(&node, &net, &udp_to, &["--udp"], &["pod-a"]);

    // a is the only endpoint: both streams are a's.
    let udp = Stream::start(
        "connected UDP on a",
        pod_probe(
            &node,
            &net.netns,
            &["--to", &udp_to, "--udp", "--connected", "--stream", "--count", "1000000", "--interval-ms", "20", "--timeout-ms", "1000"],
        ),
    );
    let tcp = tcp_stream(&node, &net, "TCP on a", &tcp_to);
    assert_eq!(udp.wait_answered(3), "pod-a");
    tcp.wait_answered(3);
    // b serves from slice 2, so a's leaving would be a departure with a
    // backend left (for the last one nothing is ended in any case).
    write_slice(2, &[here(&b_ip, READY)]);
    wait_for_backends(&node, &net, &udp_to, &["--udp"], &["pod-a", "pod-b"]);
    if cond != READY {
        write_slice(1, &[here(&a_ip, cond)]);
        let t = Instant::now();
        wait_for_backends(&node, &net, &udp_to, &["--udp"], &["pod-b"]);
        std::thread::sleep(within());
        for s in [&udp, &tcp] {
            assert_eq!(s.first_failure_since(t), None, "{} stays while a is {cond}", s.name);
        }
    }

    let t0 = Instant::now();
    let gap = Duration::from_millis(100);
    if remove_first {
        write_slice(1, &[]);
        std::thread::sleep(gap);
        write_slice(2, &[here(&b_ip, READY), here(&a_ip, cond)]);
    } else {
        write_slice(2, &[here(&b_ip, READY), here(&a_ip, cond)]);
        std::thread::sleep(gap);
        write_slice(1, &[]);
    }
    std::thread::sleep(within() + Duration::from_secs(1));
    let order = if remove_first { "removed from slice 1, then added to slice 2" } else { "added to slice 2, then removed from slice 1" };
    for (s, reply) in [(&udp, "pod-a"), (&tcp, "echo ping")] {
        assert_eq!(s.first_failure_since(t0), None, "{} keeps going when a ({cond}) is {order}", s.name);
        let late = s.replies_since(t0 + within());
        assert!(late.len() > 10, "{} still exchanges: {} answers in the last second", s.name, late.len());
        assert!(s.replies_since(t0).iter().all(|r| r == reply), "{} stays on a: {:?}", s.name, s.replies_since(t0));
    }
    let want: &[&str] = if cond == READY { &["pod-a", "pod-b"] } else { &["pod-b"] };
    wait_for_backends(&node, &net, &udp_to, &["--udp"], want);
}

#[test]
fn an_endpoint_moved_between_slices_removed_first_ends_no_socket() {
    let _serial = serial();
    slice_move(46, true, READY);
}

#[test]
fn an_endpoint_moved_between_slices_added_first_ends_no_socket() {
    let _serial = serial();
    slice_move(47, false, READY);
}

/// The move of a terminating endpoint: were it taken for gone in between,
/// its TCP connections would be ended too (gone after terminating).
#[test]
fn a_draining_endpoint_moved_between_slices_ends_no_socket() {
    let _serial = serial();
    slice_move(48, true, DRAINING);
}
