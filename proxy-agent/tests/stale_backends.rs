//! No client stays on a backend that left: the agent terminates the
//! sockets the socket load balancer translated to it, and flushes the TC
//! datapath's conntrack flows to it.
//!
//! Pods are processes on loopback addresses of one isolated namespace (as
//! in socket_lb.rs); clients run there inside the node's cgroup, so their
//! connect()/sendmsg() go through the agent's programs. The agent runs in
//! the host's network namespace with `--devices none`, except where a test
//! says otherwise (the host-network client, NodePort). Each client is a
//! `proxy-agent probe --stream` process whose lines are stamped as they
//! arrive; the manifests are the only thing a test changes, and the
//! departed backend's process keeps running, so whatever breaks a client's
//! socket is the agent's doing.

mod support;

use std::net::SocketAddr;
use std::process::Stdio;
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use proxy_test_support::http::{http_get, metric};
use proxy_test_support::sandbox::{Guarded, Netns, command_in, echo_server, in_netns, spawn_backend};
use proxy_test_support::wait::eventually;
use serde_json::Value;
use support::*;

/// A Service of one port with one EndpointSlice; endpoints are
/// `(address, conditions)`, all on `node-1`. With `node_port`, a NodePort
/// Service.
fn service(
    name: &str,
    cluster_ip: &str,
    proto: &str,
    port: u16,
    target: u16,
    endpoints: &[(&str, &str)],
    node_port: Option<u16>,
) -> String {
    let eps: String =
        endpoints.iter().map(|(ip, cond)| format!("- {{addresses: [\"{ip}\"], nodeName: node-1, conditions: {{{cond}}}}}\n")).collect();
    let (kind, np) = match node_port {
        Some(p) => ("  type: NodePort\n", format!(", nodePort: {p}")),
        None => ("", String::new()),
    };
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: default}}\nspec:\n  clusterIP: {cluster_ip}\n{kind}  ports:\n  - {{name: p, port: {port}, protocol: {proto}, targetPort: {target}{np}}}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}-1, namespace: default, labels: {{kubernetes.io/service-name: {name}}}}}\naddressType: IPv4\nports:\n- {{name: p, port: {target}, protocol: {proto}}}\nendpoints:{}\n{eps}",
        if eps.is_empty() { " []" } else { "" }
    )
}

const READY: &str = "ready: true";
const DRAINING: &str = "ready: false, serving: true, terminating: true";
const GONE_FROM_SERVING: &str = "ready: false, serving: false, terminating: true";
const NOT_READY: &str = "ready: false";

/// The agent's /metrics, read in `netns` when the agent serves there.
fn scrape(node: &Node, netns: Option<&Netns>) -> String {
    let addr = node.metrics_address();
    let get = move || http_get(addr, "/metrics").map(|(_, body)| body);
    match netns {
        None => get(),
        Some(ns) => in_netns(ns, get).expect("scrape in netns"),
    }
    .expect("scrape /metrics")
}

fn assert_metric_at_least(text: &str, series: &str, min: f64) {
    let v = metric(text, series);
    assert!(v.is_some_and(|v| v >= min), "{series} is {v:?}, expected >= {min}\n{text}");
}

/// The backend (`a` or `b`) an echo client reached: the echo server that
/// saw a new client since the last call.
fn which_echo(servers: &[(&str, &Receiver<SocketAddr>)]) -> Option<String> {
    eventually("an echo server to see the new client", || {
        for (name, rx) in servers {
            if rx.try_recv().is_ok() {
                return Ok(Some((*name).to_string()));
            }
        }
        Err(())
    })
}

#[test]
fn a_connected_udp_client_moves_to_the_surviving_backend() {
    let mut net = PodNetwork::new();
    net.backend("dns-a", "10.244.1.1", &[53]);
    net.backend("dns-b", "10.244.1.2", &[53]);
    let mut node = Node::new("node-1");
    let both = [("10.244.1.1", READY), ("10.244.1.2", READY)];
    node.write_manifest("dns.yaml", &service("dns", "10.96.1.10", "UDP", 53, 53, &both, None));
    node.start_agent_with(&["--healthz-bind-address", "127.0.0.1:0", "--metrics-bind-address", "127.0.0.1:0"]);
    wait_for_backends(&node, &net, "10.96.1.10:53", &["--udp"], &["dns-a", "dns-b"]);
    // The worker names its mechanism beside the first sync, which can
    // trail the first programmed backends.
    let mechanism = format!("topoproxy_socket_termination_mechanism{{mechanism=\"{}\"}}", expected_mechanism());
    eventually(&mechanism, || {
        let got = metric(&scrape(&node, None), &mechanism);
        if got == Some(1.0) { Ok(()) } else { Err(got) }
    });

    // A DNS-like client: one connected socket, 1,000 queries, a 200 ms
    // timeout each, reconnecting through the Service when its socket fails.
    let args = [
        "--to",
        "10.96.1.10:53",
        "--udp",
        "--connected",
        "--stream",
        "--reconnect",
        "--count",
        "1000",
        "--interval-ms",
        "5",
        "--timeout-ms",
        "200",
    ];
    let client = Stream::start("the DNS client", pod_probe(&node, &net.netns, &args));
    let before = client.wait_answered(20);
    let (gone, stays) = if before == "dns-a" { ("10.244.1.1", "dns-b") } else { ("10.244.1.2", "dns-a") };
    let remaining: Vec<(&str, &str)> = both.iter().copied().filter(|(ip, _)| *ip != gone).collect();
    node.write_manifest("dns.yaml", &service("dns", "10.96.1.10", "UDP", 53, 53, &remaining, None));
    let t0 = Instant::now();
    let lines = client.finish();

    assert_eq!(lines.len(), 1000, "one line per query");
    let (at, failure) = lines
        .iter()
        .find(|(t, l)| *t >= t0 && l["ok"] != true)
        .map_or_else(|| panic!("the client's socket never failed after {before} was deleted"), |(t, l)| (*t - t0, l.clone()));
    assert!(udp_aborted(&failure), "the socket was aborted by the agent: {failure}");
    assert!(at <= within(), "the client's socket failed {at:?} after the deletion, later than {:?}", within());
    let failed_at = t0 + at;
    let after: Vec<&Value> = lines.iter().filter(|(t, _)| *t > failed_at).map(|(_, l)| l).collect();
    assert!(after.iter().any(|l| l["reconnected"] == true), "the client reconnected");
    let answered_after: Vec<&str> = after.iter().filter(|l| l["ok"] == true).filter_map(|l| l["reply"].as_str()).collect();
    assert!(answered_after.len() > 100, "the client went on being answered: {} answers", answered_after.len());
    assert!(answered_after.iter().all(|r| *r == stays), "after reconnecting only {stays} answers: {answered_after:?}");
    // A query is lost only while the socket points at the departed backend
    // or is being replaced: the abort itself, and any query that times out
    // (200 ms) between the manifest change and the abort, which the 1 s
    // window bounds to 5 (more in the emulated CPU's longer window).
    let bound = (within().as_millis() / 200) as usize;
    let lost: Vec<&Value> = lines.iter().filter(|(_, l)| l["ok"] != true).map(|(_, l)| l).collect();
    eprintln!("connected UDP: the socket failed {at:?} after the deletion; {} of 1000 queries lost", lost.len());
    assert!(lost.len() <= bound, "{} of 1000 queries lost, more than {bound}: {lost:?}", lost.len());

    let m = scrape(&node, None);
    assert_metric_at_least(&m, "topoproxy_sockets_terminated_total{protocol=\"udp\",reason=\"deleted\"}", 1.0);
    // A line per batch at info level, written once the walk is over.
    eventually("the batch's line in the log", || node.agent_log().contains("terminated the sockets").then_some(()).ok_or("no line yet"));
}

/// TCP is ended in one case only: the endpoint is gone from its Service
/// after it was seen terminating. Failing readiness and terminating while
/// still listed leave its connections alone; the removal that follows
/// aborts them at once, and connections to the other backend never notice.
#[test]
fn a_tcp_connection_is_aborted_only_once_its_backend_is_gone_after_terminating() {
    let net = PodNetwork::new();
    let _ = net.netns.add_loopback_addrs(&["10.244.2.1/32", "10.244.2.2/32"]);
    let a = echo_server(&net.netns, "10.244.2.1:80".parse().unwrap()).expect("echo a");
    let b = echo_server(&net.netns, "10.244.2.2:80".parse().unwrap()).expect("echo b");
    let mut node = Node::new("node-1");
    let web = |eps: &[(&str, &str)]| service("web", "10.96.2.10", "TCP", 80, 80, eps, None);
    node.write_manifest("web.yaml", &web(&[("10.244.2.1", READY), ("10.244.2.2", READY)]));
    node.start_agent();
    eventually("the Service to answer", || {
        node.probe(&net, &["--to", "10.96.2.10:80"]).first().map(|r| r["ok"] == true).filter(|ok| *ok).ok_or(())
    });
    while a.try_recv().is_ok() || b.try_recv().is_ok() {}

    // Long-lived connections, until both backends hold some.
    let args = ["--to", "10.96.2.10:80", "--stream", "--count", "1000000", "--interval-ms", "20", "--timeout-ms", "2000"];
    let mut clients: Vec<(String, Stream)> = Vec::new();
    while !(clients.iter().any(|(on, _)| on == "a") && clients.iter().any(|(on, _)| on == "b")) {
        assert!(clients.len() < 24, "24 connections and still not on both backends");
        let s = Stream::start(&format!("connection {}", clients.len()), pod_probe(&node, &net.netns, &args));
        s.wait_answered(1);
        let on = which_echo(&[("a", &a), ("b", &b)]).expect("backend");
        clients.push((on, s));
    }
    let t0 = Instant::now();
    // Not ready, then terminating and not serving: a live process, its
    // connections stay (kube-proxy leaves established TCP alone).
    for cond in [NOT_READY, GONE_FROM_SERVING] {
        node.write_manifest("web.yaml", &web(&[("10.244.2.1", cond), ("10.244.2.2", READY)]));
        std::thread::sleep(Duration::from_millis(1500));
        for (on, s) in &clients {
            assert_eq!(s.first_failure_since(t0), None, "{} on {on} stays while a is {cond}", s.name);
        }
    }
    // Gone after terminating: its pod is gone, the connections end at once.
    node.write_manifest("web.yaml", &web(&[("10.244.2.2", READY)]));
    let t1 = Instant::now();
    for (on, s) in clients.iter().filter(|(on, _)| on == "a") {
        let (at, failure) = eventually(&format!("{} on {on} to be aborted", s.name), || s.first_failure_since(t1).ok_or(()));
        let errno = failure["errno"].as_i64();
        assert!(errno == Some(ECONNABORTED) || errno == Some(ECONNRESET), "{}: aborted or reset, got {failure}", s.name);
        assert!(at <= within(), "{} failed {at:?} after the removal, later than {:?}", s.name, within());
    }
    std::thread::sleep(Duration::from_secs(2));
    for (on, s) in clients.iter().filter(|(on, _)| on == "b") {
        assert_eq!(s.first_failure_since(t0), None, "{} on {on} is untouched", s.name);
        let late = s.lines().iter().filter(|(t, l)| *t > t1 + Duration::from_millis(1500) && l["ok"] == true).count();
        assert!(late > 5, "{} still exchanges ({late} answers in the last half second)", s.name);
    }
    eventually("the rule to be logged", || {
        let log = node.agent_log();
        if log.contains("gone_after_terminating") || log.contains("tcp rule") { Ok(()) } else { Err("no rule in the log yet") }
    });
}

/// A TCP connection to a backend removed without ever being seen
/// terminating (a selector change, an old API server) is left alone.
#[test]
fn a_tcp_connection_to_a_backend_removed_without_terminating_is_left_alone() {
    let net = PodNetwork::new();
    let _ = net.netns.add_loopback_addrs(&["10.244.12.1/32", "10.244.12.2/32"]);
    let a = echo_server(&net.netns, "10.244.12.1:80".parse().unwrap()).expect("echo a");
    let b = echo_server(&net.netns, "10.244.12.2:80".parse().unwrap()).expect("echo b");
    let mut node = Node::new("node-1");
    let web = |eps: &[(&str, &str)]| service("web", "10.96.12.10", "TCP", 80, 80, eps, None);
    node.write_manifest("web.yaml", &web(&[("10.244.12.1", READY), ("10.244.12.2", READY)]));
    node.start_agent();
    eventually("the Service to answer", || {
        node.probe(&net, &["--to", "10.96.12.10:80"]).first().map(|r| r["ok"] == true).filter(|ok| *ok).ok_or(())
    });
    while a.try_recv().is_ok() || b.try_recv().is_ok() {}
    let args = ["--to", "10.96.12.10:80", "--stream", "--count", "1000000", "--interval-ms", "20", "--timeout-ms", "2000"];
    let on_a = (0..24)
        .find_map(|i| {
            let s = Stream::start(&format!("connection {i}"), pod_probe(&node, &net.netns, &args));
            s.wait_answered(1);
            (which_echo(&[("a", &a), ("b", &b)]).as_deref() == Some("a")).then_some(s)
        })
        .expect("a connection on backend a");
    node.write_manifest("web.yaml", &web(&[("10.244.12.2", READY)]));
    let t0 = Instant::now();
    eventually("new connections to avoid the removed backend", || {
        while a.try_recv().is_ok() {}
        node.probe(&net, &["--to", "10.96.12.10:80", "--count", "10"]);
        if a.try_recv().is_err() { Ok(()) } else { Err("a new connection reached the removed backend") }
    });
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(on_a.first_failure_since(t0), None, "{} keeps its connection", on_a.name);
    let late = on_a.lines().iter().filter(|(t, l)| *t > t0 + Duration::from_millis(1500) && l["ok"] == true).count();
    assert!(late > 5, "{} still exchanges ({late} answers late)", on_a.name);
}

/// Topology: a same-zone endpoint appears for a Service ranked by zone.
/// A TCP connection to the remote-zone endpoint stays (it still serves); a
/// connected UDP socket on it is ended (the UDP topology rule), and new
/// connections of both go to the same-zone endpoint. The project's own
/// client and echo servers, so the kernels under `cargo xtask vmtest` run
/// it too.
#[test]
fn a_same_zone_endpoint_takes_new_connections_and_tcp_to_the_remote_one_stays() {
    let mut net = PodNetwork::new();
    net.backend("remote", "10.244.13.1", &[53]);
    net.backend("near", "10.244.13.2", &[53]);
    let remote = echo_server(&net.netns, "10.244.13.1:80".parse().unwrap()).expect("echo remote");
    let near = echo_server(&net.netns, "10.244.13.2:80".parse().unwrap()).expect("echo near");
    let mut node = Node::new("node-1");
    let manifests = |with_near: bool| {
        let mut eps = String::from("- {addresses: [\"10.244.13.1\"], nodeName: node-2, zone: z2, conditions: {ready: true}}\n");
        if with_near {
            eps.push_str("- {addresses: [\"10.244.13.2\"], nodeName: node-1, zone: z1, conditions: {ready: true}}\n");
        }
        let mut y = String::from(
            "kind: Node\napiVersion: v1\nmetadata: {name: node-1, labels: {topology.kubernetes.io/zone: z1}}\n---\nkind: Node\napiVersion: v1\nmetadata: {name: node-2, labels: {topology.kubernetes.io/zone: z2}}\n",
        );
        for (name, ip, proto, port) in [("web", "10.96.13.10", "TCP", 80u16), ("dns", "10.96.13.20", "UDP", 53)] {
            y.push_str(&format!(
                "---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: default, annotations: {{topoproxy.io/topology-keys: \"topology.kubernetes.io/zone, *\"}}}}\nspec:\n  clusterIP: {ip}\n  ports:\n  - {{name: p, port: {port}, protocol: {proto}}}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}-1, namespace: default, labels: {{kubernetes.io/service-name: {name}}}}}\naddressType: IPv4\nports:\n- {{name: p, port: {port}, protocol: {proto}}}\nendpoints:\n{eps}"
            ));
        }
        y
    };
    node.write_manifest("svc.yaml", &manifests(false));
    node.start_agent_with(&["--healthz-bind-address", "127.0.0.1:0", "--metrics-bind-address", "127.0.0.1:0"]);
    wait_for_backends(&node, &net, "10.96.13.20:53", &["--udp"], &["remote"]);
    eventually("the TCP Service to answer", || {
        node.probe(&net, &["--to", "10.96.13.10:80"]).first().map(|r| r["ok"] == true).filter(|ok| *ok).ok_or(())
    });
    while remote.try_recv().is_ok() || near.try_recv().is_ok() {}
    let tcp = Stream::start(
        "TCP on the remote-zone endpoint",
        pod_probe(
            &node,
            &net.netns,
            &["--to", "10.96.13.10:80", "--stream", "--count", "1000000", "--interval-ms", "20", "--timeout-ms", "2000"],
        ),
    );
    tcp.wait_answered(1);
    assert_eq!(which_echo(&[("remote", &remote), ("near", &near)]).as_deref(), Some("remote"));
    let udp = Stream::start(
        "connected UDP on the remote-zone endpoint",
        pod_probe(
            &node,
            &net.netns,
            &[
                "--to",
                "10.96.13.20:53",
                "--udp",
                "--connected",
                "--stream",
                "--count",
                "1000000",
                "--interval-ms",
                "10",
                "--timeout-ms",
                "500",
            ],
        ),
    );
    assert_eq!(udp.wait_answered(1), "remote");

    node.write_manifest("svc.yaml", &manifests(true));
    let t0 = Instant::now();
    let (at, failure) = eventually("the UDP socket to be ended by the topology rule", || udp.first_failure_since(t0).ok_or(()));
    assert!(udp_aborted(&failure) && at <= within(), "{failure} after {at:?}");
    eventually("new connections to go to the same-zone endpoint", || {
        while near.try_recv().is_ok() || remote.try_recv().is_ok() {}
        node.probe(&net, &["--to", "10.96.13.10:80", "--count", "5"]);
        let udp_replies = replies(&node.probe(&net, &["--to", "10.96.13.20:53", "--udp", "--count", "5"]));
        let tcp_remote = remote.try_recv().is_ok();
        if !tcp_remote && udp_replies == set(&["near"]) {
            Ok(())
        } else {
            Err(format!("remote reached: tcp {tcp_remote}, udp {udp_replies:?}"))
        }
    });
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(tcp.first_failure_since(t0), None, "the TCP connection to the remote-zone endpoint stays");
    let late = tcp.lines().iter().filter(|(t, l)| *t > t0 + Duration::from_millis(500) && l["ok"] == true).count();
    assert!(late > 5, "it still exchanges ({late} answers since the change)");
    assert_metric_at_least(&scrape(&node, None), "topoproxy_sockets_terminated_total{protocol=\"udp\",reason=\"topology\"}", 1.0);
}

#[test]
fn sockets_that_dialled_a_pod_directly_are_never_touched() {
    let mut net = PodNetwork::new();
    net.backend("pod-a", "10.244.3.1", &[53]);
    net.backend("pod-b", "10.244.3.2", &[53]);
    let echo = echo_server(&net.netns, "10.244.3.1:80".parse().unwrap()).expect("echo on pod-a");
    let mut node = Node::new("node-1");
    let both = [("10.244.3.1", READY), ("10.244.3.2", READY)];
    node.write_manifest("svc.yaml", &service("dns", "10.96.3.10", "UDP", 53, 53, &both, None));
    node.start_agent();
    wait_for_backends(&node, &net, "10.96.3.10:53", &["--udp"], &["pod-a", "pod-b"]);

    // Direct to pod-a's address, from the same cgroup as every pod: one
    // connected UDP socket and one TCP connection.
    let direct_udp = Stream::start(
        "direct UDP",
        pod_probe(
            &node,
            &net.netns,
            &[
                "--to",
                "10.244.3.1:53",
                "--udp",
                "--connected",
                "--stream",
                "--count",
                "1000000",
                "--interval-ms",
                "20",
                "--timeout-ms",
                "1000",
            ],
        ),
    );
    let direct_tcp = Stream::start(
        "direct TCP",
        pod_probe(
            &node,
            &net.netns,
            &["--to", "10.244.3.1:80", "--stream", "--count", "1000000", "--interval-ms", "20", "--timeout-ms", "2000"],
        ),
    );
    direct_udp.wait_answered(3);
    direct_tcp.wait_answered(3);
    let _ = echo.try_recv();
    // And a client through the Service on pod-a, so the walk certainly runs.
    let via_service = loop {
        let s = Stream::start(
            "via the Service",
            pod_probe(
                &node,
                &net.netns,
                &[
                    "--to",
                    "10.96.3.10:53",
                    "--udp",
                    "--connected",
                    "--stream",
                    "--count",
                    "1000000",
                    "--interval-ms",
                    "20",
                    "--timeout-ms",
                    "1000",
                ],
            ),
        );
        if s.wait_answered(1) == "pod-a" {
            break s;
        }
    };
    node.write_manifest("svc.yaml", &service("dns", "10.96.3.10", "UDP", 53, 53, &both[1..], None));
    let t0 = Instant::now();
    let (at, failure) = eventually("the Service client to be aborted", || via_service.first_failure_since(t0).ok_or(()));
    assert!(udp_aborted(&failure), "{failure}");
    assert!(at <= within(), "{at:?}");
    std::thread::sleep(Duration::from_secs(1));
    for s in [&direct_udp, &direct_tcp] {
        assert_eq!(s.first_failure_since(t0), None, "{} is never touched", s.name);
        let late = s.lines().iter().filter(|(t, l)| *t > t0 + Duration::from_millis(500) && l["ok"] == true).count();
        assert!(late > 5, "{} still answered ({late})", s.name);
        assert!(s.replies().iter().all(|r| r == "pod-a" || r == "echo ping"), "{}: {:?}", s.name, s.replies());
    }
}

#[test]
fn a_client_in_the_host_network_namespace_is_handled_too() {
    // The node's own namespace: the agent and a host-network client share
    // it, as a hostNetwork pod shares the node's. Backends on its loopback.
    let host = Netns::new("tsb").expect("node netns");
    host.add_loopback_addrs(&["10.244.4.1/32", "10.244.4.2/32"]).expect("addresses");
    let _a = spawn_backend(&agent_bin(), &host, "host-a", &["10.244.4.1:53".into()]).expect("backend a");
    let _b = spawn_backend(&agent_bin(), &host, "host-b", &["10.244.4.2:53".into()]).expect("backend b");
    let node = Node::new("node-1");
    let both = [("10.244.4.1", READY), ("10.244.4.2", READY)];
    node.write_manifest("dns.yaml", &service("dns", "10.96.4.10", "UDP", 53, 53, &both, None));
    let _agent = start_agent_in(&node, &host, &["--healthz-bind-address", "127.0.0.1:0", "--metrics-bind-address", "127.0.0.1:0"]);
    let probe = |args: &[&str]| pod_probe(&node, &host, args);
    eventually("the Service to answer from the node's namespace", || {
        let out = probe(&["--to", "10.96.4.10:53", "--udp", "--count", "20", "--timeout-ms", "500"]).output().expect("probe");
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        if text.contains("host-a") && text.contains("host-b") { Ok(()) } else { Err(text) }
    });
    let client = Stream::start(
        "host-network client",
        probe(&[
            "--to",
            "10.96.4.10:53",
            "--udp",
            "--connected",
            "--stream",
            "--reconnect",
            "--count",
            "1000000",
            "--interval-ms",
            "10",
            "--timeout-ms",
            "500",
        ]),
    );
    let before = client.wait_answered(5);
    let (gone, stays) = if before == "host-a" { ("10.244.4.1", "host-b") } else { ("10.244.4.2", "host-a") };
    let remaining: Vec<(&str, &str)> = both.iter().copied().filter(|(ip, _)| *ip != gone).collect();
    node.write_manifest("dns.yaml", &service("dns", "10.96.4.10", "UDP", 53, 53, &remaining, None));
    let t0 = Instant::now();
    let (at, failure) = eventually("the host-network client to be aborted", || client.first_failure_since(t0).ok_or(()));
    assert!(udp_aborted(&failure), "{failure}");
    assert!(at <= within(), "{at:?}");
    let after = eventually("the host-network client to be answered again", || {
        let after: Vec<String> = client
            .lines()
            .iter()
            .filter(|(t, l)| *t > t0 + at && l["ok"] == true)
            .filter_map(|(_, l)| l["reply"].as_str().map(str::to_string))
            .collect();
        if after.len() >= 5 { Ok(after) } else { Err(after) }
    });
    assert!(after.iter().all(|r| r == stays), "after reconnecting only {stays} answers: {after:?}");
    assert_metric_at_least(&scrape(&node, Some(&host)), "topoproxy_sockets_terminated_total{protocol=\"udp\",reason=\"deleted\"}", 1.0);
}

#[test]
fn a_terminating_backend_that_still_serves_keeps_its_connections() {
    draining_backend(false);
}

/// An agent that starts while a backend drains has not seen it leave its
/// set: it still ends that backend's TCP connections once it is gone.
#[test]
fn a_backend_draining_across_an_agent_restart_loses_its_connections_once_gone() {
    draining_backend(true);
}

/// Two connections on backend `a`, which then drains (its connections
/// stay), stops serving (they still stay: TCP) and is removed (they are
/// aborted: gone after terminating); with `restart`, the agent restarts
/// while `a` drains.
fn draining_backend(restart: bool) {
    let net = PodNetwork::new();
    let _ = net.netns.add_loopback_addrs(&["10.244.5.1/32", "10.244.5.2/32"]);
    let a = echo_server(&net.netns, "10.244.5.1:80".parse().unwrap()).expect("echo a");
    let b = echo_server(&net.netns, "10.244.5.2:80".parse().unwrap()).expect("echo b");
    let mut node = Node::new("node-1");
    let web = |a_cond: &str| service("web", "10.96.5.10", "TCP", 80, 80, &[("10.244.5.1", a_cond), ("10.244.5.2", READY)], None);
    node.write_manifest("web.yaml", &web(READY));
    node.start_agent();
    eventually("the Service to answer", || {
        node.probe(&net, &["--to", "10.96.5.10:80"]).first().map(|r| r["ok"] == true).filter(|ok| *ok).ok_or(())
    });
    while a.try_recv().is_ok() || b.try_recv().is_ok() {}
    let args = ["--to", "10.96.5.10:80", "--stream", "--count", "1000000", "--interval-ms", "20", "--timeout-ms", "2000"];
    let mut on_a = Vec::new();
    for i in 0..24 {
        let s = Stream::start(&format!("connection {i}"), pod_probe(&node, &net.netns, &args));
        s.wait_answered(1);
        if which_echo(&[("a", &a), ("b", &b)]).as_deref() == Some("a") {
            on_a.push(s);
            if on_a.len() == 2 {
                break;
            }
        }
    }
    assert!(!on_a.is_empty(), "no connection reached backend a");

    // Terminating but serving: out of the set for new connections (b is
    // ready), its connections stay.
    node.write_manifest("web.yaml", &web(DRAINING));
    let t0 = Instant::now();
    eventually("new connections to avoid the draining backend", || {
        while a.try_recv().is_ok() {}
        node.probe(&net, &["--to", "10.96.5.10:80", "--count", "10"]);
        if a.try_recv().is_err() { Ok(()) } else { Err("a new connection reached the draining backend") }
    });
    std::thread::sleep(Duration::from_secs(1));
    for s in &on_a {
        assert_eq!(s.first_failure_since(t0), None, "{} on the draining backend keeps its connection", s.name);
    }
    if restart {
        node.stop_agent();
        node.start_agent();
        eventually("the new agent's first sync", || {
            if node.agent_log().matches("first sync applied").count() >= 2 { Ok(()) } else { Err(()) }
        });
        std::thread::sleep(Duration::from_secs(1));
        for s in &on_a {
            assert_eq!(s.first_failure_since(t0), None, "{} keeps its connection across the restart", s.name);
        }
    }

    // No longer serving: TCP stays (a live process finishing its work).
    node.write_manifest("web.yaml", &web(GONE_FROM_SERVING));
    std::thread::sleep(Duration::from_millis(1500));
    for s in &on_a {
        assert_eq!(s.first_failure_since(t0), None, "{} stays while the endpoint is terminating and not serving", s.name);
    }
    // Gone after terminating: now they go.
    node.write_manifest("web.yaml", &service("web", "10.96.5.10", "TCP", 80, 80, &[("10.244.5.2", READY)], None));
    let t1 = Instant::now();
    for s in &on_a {
        let (at, failure) = eventually(&format!("{} to be aborted", s.name), || s.first_failure_since(t1).ok_or(()));
        let errno = failure["errno"].as_i64();
        assert!(errno == Some(ECONNABORTED) || errno == Some(ECONNRESET), "{}: {failure}", s.name);
        assert!(at <= within(), "{} failed {at:?} after the endpoint was removed", s.name);
    }
    // The walk logs its summary after the last namespace, so a socket can
    // see its abort before the line is written.
    eventually("the rule to be logged", || {
        let log = node.agent_log();
        if log.contains("gone_after_terminating") || log.contains("tcp rule") { Ok(()) } else { Err("no rule in the log yet") }
    });
}

#[test]
fn an_unconnected_udp_socket_never_reaches_a_removed_backend_after_the_update() {
    let mut net = PodNetwork::new();
    net.backend("dns-a", "10.244.6.1", &[53]);
    net.backend("dns-b", "10.244.6.2", &[53]);
    let mut node = Node::new("node-1");
    let both = [("10.244.6.1", READY), ("10.244.6.2", READY)];
    node.write_manifest("dns.yaml", &service("dns", "10.96.6.10", "UDP", 53, 53, &both, None));
    node.start_agent();
    wait_for_backends(&node, &net, "10.96.6.10:53", &["--udp"], &["dns-a", "dns-b"]);
    // sendto() per datagram on one socket: every datagram is translated.
    let client = Stream::start(
        "unconnected client",
        pod_probe(
            &node,
            &net.netns,
            &["--to", "10.96.6.10:53", "--udp", "--stream", "--count", "1000000", "--interval-ms", "5", "--timeout-ms", "500"],
        ),
    );
    let before = client.wait_answered(10);
    let (gone, stays) = if before == "dns-a" { ("10.244.6.1", "dns-b") } else { ("10.244.6.2", "dns-a") };
    let remaining: Vec<(&str, &str)> = both.iter().copied().filter(|(ip, _)| *ip != gone).collect();
    node.write_manifest("dns.yaml", &service("dns", "10.96.6.10", "UDP", 53, 53, &remaining, None));
    let t0 = Instant::now();
    // The first answer from the other backend marks the map update: from
    // then on the departed one never answers again.
    let moved = eventually("the socket's datagrams to reach the other backend", || {
        client.lines().into_iter().find(|(t, l)| *t >= t0 && l["reply"] == stays).map(|(t, _)| t).ok_or(())
    });
    assert!(moved - t0 <= within(), "followed the new set {:?} after the change", moved - t0);
    std::thread::sleep(Duration::from_millis(500));
    let after: Vec<(Instant, Value)> = client.lines().into_iter().filter(|(t, _)| *t > moved).collect();
    assert!(after.len() > 20, "the client kept sending");
    assert!(after.iter().all(|(_, l)| l["ok"] == true && l["reply"] == stays), "{after:?}");
    // New sockets too.
    let fresh = node.probe(&net, &["--to", "10.96.6.10:53", "--udp", "--count", "50", "--timeout-ms", "500"]);
    assert_eq!(replies(&fresh), set(&[stays]), "{fresh:?}");
    assert!(!node.agent_log().contains("socket terminated"), "nothing to terminate for unconnected sockets");
}

/// The netlink fallback, chosen on a kernel that also has the iterators
/// (the agent passes over them when told the kfunc is missing): a
/// connected UDP socket and a TCP connection to the departed backend are
/// aborted, a TCP connection to the other one stays.
#[test]
fn the_netlink_fallback_terminates_udp_and_tcp_sockets_too() {
    let mut net = PodNetwork::new();
    net.backend("nl-a", "10.244.8.1", &[53]);
    net.backend("nl-b", "10.244.8.2", &[53]);
    let a = echo_server(&net.netns, "10.244.8.1:80".parse().unwrap()).expect("echo a");
    let b = echo_server(&net.netns, "10.244.8.2:80".parse().unwrap()).expect("echo b");
    let node = Node::new("node-1");
    let both = [("10.244.8.1", READY), ("10.244.8.2", READY)];
    let write = |eps: &[(&str, &str)]| {
        node.write_manifest(
            "svc.yaml",
            &format!(
                "{}---\n{}",
                service("dns", "10.96.8.10", "UDP", 53, 53, eps, None),
                service("web", "10.96.8.20", "TCP", 80, 80, eps, None)
            ),
        );
    };
    write(&both);
    let _agent = start_agent_with_env(
        &node,
        None,
        &["--healthz-bind-address", "127.0.0.1:0", "--metrics-bind-address", "127.0.0.1:0"],
        &[("TOPOPROXY_KERNEL_HIDE", "sock_destroy_kfunc")],
    );
    wait_for_backends(&node, &net, "10.96.8.10:53", &["--udp"], &["nl-a", "nl-b"]);
    // Named beside the first sync, which can trail the first backends.
    let m = eventually("the netlink mechanism to be named", || {
        let m = scrape(&node, None);
        if metric(&m, "topoproxy_socket_termination_mechanism{mechanism=\"netlink\"}") == Some(1.0) { Ok(m) } else { Err(m) }
    });
    assert_eq!(metric(&m, "topoproxy_socket_termination_mechanism{mechanism=\"iterators\"}"), Some(0.0), "{m}");

    // A UDP client on nl-a, and TCP connections until both backends hold one.
    let udp = loop {
        let s = Stream::start(
            "UDP on nl-a",
            pod_probe(
                &node,
                &net.netns,
                &[
                    "--to",
                    "10.96.8.10:53",
                    "--udp",
                    "--connected",
                    "--stream",
                    "--count",
                    "1000000",
                    "--interval-ms",
                    "10",
                    "--timeout-ms",
                    "500",
                ],
            ),
        );
        if s.wait_answered(1) == "nl-a" {
            break s;
        }
    };
    while a.try_recv().is_ok() || b.try_recv().is_ok() {}
    let args = ["--to", "10.96.8.20:80", "--stream", "--count", "1000000", "--interval-ms", "20", "--timeout-ms", "2000"];
    let mut tcp: Vec<(String, Stream)> = Vec::new();
    while !(tcp.iter().any(|(on, _)| on == "a") && tcp.iter().any(|(on, _)| on == "b")) {
        assert!(tcp.len() < 24, "24 connections and still not on both backends");
        let s = Stream::start(&format!("connection {}", tcp.len()), pod_probe(&node, &net.netns, &args));
        s.wait_answered(1);
        tcp.push((which_echo(&[("a", &a), ("b", &b)]).expect("backend"), s));
    }
    // Terminating and no longer serving: the UDP client goes, TCP stays.
    write(&[("10.244.8.1", GONE_FROM_SERVING), ("10.244.8.2", READY)]);
    let t0 = Instant::now();
    let (at, failure) = eventually("the UDP client to be aborted", || udp.first_failure_since(t0).ok_or(()));
    assert!(udp_aborted(&failure) && at <= within(), "{failure} after {at:?}");
    std::thread::sleep(Duration::from_secs(1));
    for (on, s) in &tcp {
        assert_eq!(s.first_failure_since(t0), None, "{} on {on} stays while its backend is only not serving", s.name);
    }
    // Gone after terminating: TCP to it goes too.
    write(&both[1..]);
    let t0 = Instant::now();
    for (on, s) in &tcp {
        if on == "a" {
            let (at, failure) = eventually(&format!("{} to be aborted", s.name), || s.first_failure_since(t0).ok_or(()));
            let errno = failure["errno"].as_i64();
            assert!((errno == Some(ECONNABORTED) || errno == Some(ECONNRESET)) && at <= within(), "{}: {failure} after {at:?}", s.name);
        }
    }
    std::thread::sleep(Duration::from_secs(1));
    for (on, s) in tcp.iter().filter(|(on, _)| on == "b") {
        assert_eq!(s.first_failure_since(t0), None, "{} on {on} is untouched", s.name);
    }
    let m = scrape(&node, None);
    assert_metric_at_least(&m, "topoproxy_sockets_terminated_total{protocol=\"udp\",reason=\"not_serving\"}", 1.0);
    assert_metric_at_least(&m, "topoproxy_sockets_terminated_total{protocol=\"tcp\",reason=\"gone_after_terminating\"}", 1.0);
}

/// The termination mechanism the agent must pick here: what `cargo xtask
/// vmtest` says for its kernel, else iterators wherever the kernel has the
/// `bpf_sock_destroy` kfunc, netlink otherwise.
fn expected_mechanism() -> String {
    if let Ok(m) = std::env::var("TOPOPROXY_EXPECT_SOCKET_TERMINATION") {
        return m;
    }
    let kfunc = std::fs::read("/sys/kernel/btf/vmlinux").is_ok_and(|b| b.windows(18).any(|w| w == b"\0bpf_sock_destroy\0"));
    if kfunc { "iterators" } else { "netlink" }.to_string()
}

/// Starts `proxy-agent run` for `node` inside `netns` (its own namespace:
/// the node's host network), logging to the node's log.
fn start_agent_in(node: &Node, netns: &Netns, extra: &[&str]) -> Guarded {
    start_agent_with_env(node, Some(netns), extra, &[])
}

/// [`start_agent_in`], in the test's own namespace when `netns` is
/// `None`, with `env` set for the agent.
fn start_agent_with_env(node: &Node, netns: Option<&Netns>, extra: &[&str], env: &[(&str, &str)]) -> Guarded {
    let log = std::fs::OpenOptions::new().create(true).append(true).open(&node.log).expect("open log");
    let mut cmd = command_in(agent_bin(), netns, None).expect("agent command");
    cmd.envs(env.iter().copied());
    cmd.arg("run")
        .args(["--node", &node.name])
        .arg("--manifests")
        .arg(&node.manifests.0)
        .arg("--cgroup")
        .arg(node.cgroup.path())
        .arg("--bpffs")
        .arg(node.pins.path())
        .args(["--poll-interval-ms", "50"])
        // No TC program on the namespace's devices unless a test names them.
        .args(if extra.contains(&"--devices") { &[][..] } else { &["--devices", "none"][..] })
        .args(extra)
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("dup log"))
        .stderr(log);
    Guarded::spawn(&mut cmd).expect("start agent")
}

/// NodePort UDP from outside: a client namespace, the node's namespace
/// (agent, TC programs on its client-facing device) and a pod namespace
/// behind a veth with both backends:
///
/// ```text
///   client 10.0.7.1 -- c-n | n-c 10.0.7.2  node  n-pod 10.244.7.1 | eth0 pod 10.244.7.10, .11
/// ```
///
/// A second NodePort Service keeps the departed backend in use, so its
/// flows move only because the agent flushes them (the datapath drops a
/// flow by itself only once no frontend uses its backend).
#[test]
fn nodeport_udp_flows_move_to_the_surviving_backend() {
    require_root();
    let client = Netns::new("tsb").expect("client netns");
    let host = Netns::new("tsb").expect("node netns");
    let pod = Netns::new("tsb").expect("pod netns");
    host.veth("n-c", &client, "c-n").expect("veth client");
    host.veth("n-pod", &pod, "eth0").expect("veth pod");
    client.ip(&["addr", "add", "10.0.7.1/24", "dev", "c-n"]).expect("addr");
    host.ip(&["addr", "add", "10.0.7.2/24", "dev", "n-c"]).expect("addr");
    host.ip(&["addr", "add", "10.244.7.1/24", "dev", "n-pod"]).expect("addr");
    pod.ip(&["addr", "add", "10.244.7.10/24", "dev", "eth0"]).expect("addr");
    pod.ip(&["addr", "add", "10.244.7.11/24", "dev", "eth0"]).expect("addr");
    pod.ip(&["route", "add", "default", "via", "10.244.7.1"]).expect("route");
    host.sysctl("net.ipv4.ip_forward", "1").expect("forwarding");
    let _a = spawn_backend(&agent_bin(), &pod, "np-a", &["10.244.7.10:5353".into()]).expect("backend a");
    let _b = spawn_backend(&agent_bin(), &pod, "np-b", &["10.244.7.11:5353".into()]).expect("backend b");
    let node = Node::new("node-1");
    let np = |name: &str, ip: &str, node_port: u16, eps: &[(&str, &str)]| service(name, ip, "UDP", 53, 5353, eps, Some(node_port));
    let both = [("10.244.7.10", READY), ("10.244.7.11", READY)];
    let keep = np("keep", "10.96.7.11", 30054, &both[..1]);
    node.write_manifest("np.yaml", &format!("{}---\n{keep}", np("dns", "10.96.7.10", 30053, &both)));
    let _agent = start_agent_in(
        &node,
        &host,
        &["--devices", "n-c", "--healthz-bind-address", "127.0.0.1:0", "--metrics-bind-address", "127.0.0.1:0"],
    );
    let probe = |args: &[&str]| {
        let mut cmd = command_in(agent_bin(), Some(&client), None).expect("probe");
        cmd.arg("probe").args(args);
        cmd
    };
    eventually("the NodePort to answer from both backends", || {
        let out = probe(&["--to", "10.0.7.2:30053", "--udp", "--count", "24", "--timeout-ms", "500"]).output().expect("probe");
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        if text.contains("np-a") && text.contains("np-b") { Ok(()) } else { Err(text) }
    });
    // One socket, one flow: every datagram from the same source port.
    let flow = Stream::start(
        "external UDP flow",
        probe(&["--to", "10.0.7.2:30053", "--udp", "--stream", "--count", "1000000", "--interval-ms", "10", "--timeout-ms", "300"]),
    );
    let before = flow.wait_answered(10);
    let stays = if before == "np-a" { "np-b" } else { "np-a" };
    let remaining: Vec<(&str, &str)> =
        both.iter().copied().filter(|(ip, _)| *ip != if before == "np-a" { "10.244.7.10" } else { "10.244.7.11" }).collect();
    node.write_manifest("np.yaml", &format!("{}---\n{keep}", np("dns", "10.96.7.10", 30053, &remaining)));
    let t0 = Instant::now();
    let moved = eventually("the flow's next datagrams to reach the surviving backend", || {
        flow.lines().into_iter().find(|(t, l)| *t >= t0 && l["reply"] == stays).map(|(t, _)| t).ok_or(())
    });
    assert!(moved - t0 <= within(), "the flow moved {:?} after the deletion", moved - t0);
    std::thread::sleep(Duration::from_millis(500));
    let after: Vec<Value> = flow.lines().into_iter().filter(|(t, _)| *t > moved).map(|(_, l)| l).collect();
    assert!(after.iter().filter(|l| l["ok"] == true).all(|l| l["reply"] == stays), "{after:?}");
    let m = scrape(&node, Some(&host));
    assert_metric_at_least(&m, "topoproxy_conntrack_flushed_flows_total{protocol=\"udp\",reason=\"deleted\"}", 1.0);
}

/// NodePort TCP from outside (the topology of
/// `nodeport_udp_flows_move_to_the_surviving_backend`, echo servers on the
/// pod addresses): a long-lived connection keeps its backend while that
/// backend fails readiness and while it is terminating and not serving,
/// although it then leaves `NP_BACKENDS` (no frontend uses it), as
/// netfilter's conntrack keeps kube-proxy's DNAT; once the endpoint is gone
/// after terminating, its flow is flushed and the connection fails fast.
#[test]
fn nodeport_tcp_flows_keep_their_backend_until_it_is_gone_after_terminating() {
    require_root();
    let client = Netns::new("tsb").expect("client netns");
    let host = Netns::new("tsb").expect("node netns");
    let pod = Netns::new("tsb").expect("pod netns");
    host.veth("n-c", &client, "c-n").expect("veth client");
    host.veth("n-pod", &pod, "eth0").expect("veth pod");
    client.ip(&["addr", "add", "10.0.9.1/24", "dev", "c-n"]).expect("addr");
    host.ip(&["addr", "add", "10.0.9.2/24", "dev", "n-c"]).expect("addr");
    host.ip(&["addr", "add", "10.244.9.1/24", "dev", "n-pod"]).expect("addr");
    pod.ip(&["addr", "add", "10.244.9.10/24", "dev", "eth0"]).expect("addr");
    pod.ip(&["addr", "add", "10.244.9.11/24", "dev", "eth0"]).expect("addr");
    pod.ip(&["route", "add", "default", "via", "10.244.9.1"]).expect("route");
    host.sysctl("net.ipv4.ip_forward", "1").expect("forwarding");
    let a = echo_server(&pod, "10.244.9.10:80".parse().unwrap()).expect("echo a");
    let b = echo_server(&pod, "10.244.9.11:80".parse().unwrap()).expect("echo b");
    let node = Node::new("node-1");
    let web = |eps: &[(&str, &str)]| service("web", "10.96.9.10", "TCP", 80, 80, eps, Some(30080));
    node.write_manifest("np.yaml", &web(&[("10.244.9.10", READY), ("10.244.9.11", READY)]));
    let _agent = start_agent_in(
        &node,
        &host,
        &["--devices", "n-c", "--healthz-bind-address", "127.0.0.1:0", "--metrics-bind-address", "127.0.0.1:0"],
    );
    let probe = |args: &[&str]| {
        let mut cmd = command_in(agent_bin(), Some(&client), None).expect("probe");
        cmd.arg("probe").args(args);
        cmd
    };
    eventually("the NodePort to answer", || {
        let out = probe(&["--to", "10.0.9.2:30080", "--timeout-ms", "500"]).output().expect("probe");
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        if text.contains("\"ok\":true") { Ok(()) } else { Err(text) }
    });
    while a.try_recv().is_ok() || b.try_recv().is_ok() {}
    let conn = Stream::start(
        "external TCP connection",
        probe(&["--to", "10.0.9.2:30080", "--stream", "--count", "1000000", "--interval-ms", "20", "--timeout-ms", "2000"]),
    );
    conn.wait_answered(1);
    let on = which_echo(&[("a", &a), ("b", &b)]).expect("backend");
    let (mine, other) = if on == "a" { ("10.244.9.10", "10.244.9.11") } else { ("10.244.9.11", "10.244.9.10") };
    let t0 = Instant::now();
    for cond in [NOT_READY, GONE_FROM_SERVING] {
        node.write_manifest("np.yaml", &web(&[(mine, cond), (other, READY)]));
        std::thread::sleep(Duration::from_millis(1500));
        assert_eq!(conn.first_failure_since(t0), None, "the connection stays while its backend is {cond}");
    }
    let answered = conn.lines().iter().filter(|(t, l)| *t > t0 + Duration::from_millis(2500) && l["ok"] == true).count();
    assert!(answered > 5, "it still exchanges with its backend ({answered} answers)");
    node.write_manifest("np.yaml", &web(&[(other, READY)]));
    let t1 = Instant::now();
    let (at, failure) = eventually("the connection to fail once its backend is gone", || conn.first_failure_since(t1).ok_or(()));
    assert!(at <= within() + Duration::from_secs(2), "{failure} after {at:?}");
    let m = scrape(&node, Some(&host));
    assert_metric_at_least(&m, "topoproxy_conntrack_flushed_flows_total{protocol=\"tcp\",reason=\"gone_after_terminating\"}", 1.0);
}
