//! The socket load balancer end to end: a real agent programs real BPF
//! programs attached to a test cgroup; clients in that cgroup and in an
//! isolated namespace connect to ClusterIPs.

mod support;

use proxy_test_support::wait::eventually;
use support::*;

const WEB: &str = "10.96.0.10";
const WEB6: &str = "fd00:96::10";

fn web(endpoints: &[(&str, bool, &str)]) -> String {
    ServiceSpec {
        name: "web",
        cluster_ips: &[WEB, WEB6],
        // Same port number over TCP and UDP: two different Services as far
        // as the datapath is concerned.
        ports: &[("http", 80, "TCP", 8080), ("dns", 80, "UDP", 5353)],
        endpoints,
        extra_spec: "",
        annotations: "",
    }
    .yaml()
}

/// A second Service with one endpoint (pod-c's UDP 8080), so the backend
/// a socket reaches is known.
fn dns2() -> String {
    ServiceSpec {
        name: "dns2",
        cluster_ips: &["10.96.0.20"],
        ports: &[("dns", 53, "UDP", 8080)],
        endpoints: &[("10.244.0.3", true, "node-a")],
        extra_spec: "",
        annotations: "",
    }
    .yaml()
}

/// Three pods, each serving TCP 8080 (as pod-*) and UDP 5353 (as dns-*).
/// pod-* answer on UDP 8080 as well: if the protocol were not part of the
/// service key, UDP to port 80 would reach them.
fn setup() -> (PodNetwork, Node) {
    let mut net = PodNetwork::new();
    net.backend("pod-a", "10.244.0.1", &[8080]);
    net.backend("pod-b", "10.244.0.2", &[8080]);
    net.backend("pod-c", "10.244.0.3", &[8080]);
    net.backend("dns-a", "10.244.0.1", &[5353]);
    net.backend("dns-b", "10.244.0.2", &[5353]);
    net.backend("dns-c", "10.244.0.3", &[5353]);
    net.backend("pod-6a", "fd00:244::1", &[8080, 5353]);
    net.backend("pod-6b", "fd00:244::2", &[8080, 5353]);
    let mut node = Node::new("node-a");
    node.write_manifest(
        "web.yaml",
        &web(&[
            ("10.244.0.1", true, "node-a"),
            ("10.244.0.2", true, "node-a"),
            ("10.244.0.3", true, "node-a"),
            ("fd00:244::1", true, "node-a"),
            ("fd00:244::2", true, "node-a"),
        ]),
    );
    node.start_agent();
    (net, node)
}

/// The agent loads the program variant its kernel's helpers call for, and
/// `dump` says which, with every probed feature. Under `cargo xtask
/// vmtest` each kernel says what it must get
/// (`TOPOPROXY_EXPECT_SOCKET_PROGRAMS`); this machine's kernel has every
/// helper.
#[test]
fn the_kernel_probe_picks_the_programs_this_kernel_needs() {
    let (_net, node) = setup();
    let report: serde_json::Value = eventually("dump to read the agent's maps", || {
        let out = std::process::Command::new(agent_bin())
            .args(["dump", "--output", "json", "--bpffs"])
            .arg(node.pins.path())
            .output()
            .map_err(|e| e.to_string())?;
        serde_json::from_slice(&out.stdout).map_err(|e| format!("{e}; {}; stderr: {}", out.status, String::from_utf8_lossy(&out.stderr)))
    });
    let kernel = &report["kernel"];
    let want = std::env::var("TOPOPROXY_EXPECT_SOCKET_PROGRAMS").unwrap_or_else(|_| "full".to_string());
    assert_eq!(kernel["socketPrograms"], want.as_str(), "{kernel}");
    for name in ["set_retval", "coarse_clock", "netns_cookie", "sk_storage", "so_netns_cookie", "tcx", "bpf_link", "batch_ops"] {
        assert!(kernel["features"][name].is_boolean(), "{name} is reported: {kernel}");
    }
    // The variant follows the helpers, as the README's table says.
    let full = kernel["features"]["set_retval"] == true && kernel["features"]["coarse_clock"] == true;
    assert_eq!(want == "full", full, "{kernel}");
}

/// The compat programs, forced on this kernel: the same translation, and
/// the documented degradation (EPERM for a refused connect()).
#[test]
fn the_compat_programs_translate_and_refuse_with_eperm() {
    let mut net = PodNetwork::new();
    net.backend("pod-a", "10.244.0.1", &[8080]);
    let mut node = Node::new("node-a");
    node.agent_env.push(("TOPOPROXY_KERNEL_HIDE".into(), "set_retval,coarse_clock".into()));
    node.write_manifest("web.yaml", &web(&[("10.244.0.1", true, "node-a")]));
    let empty = ServiceSpec {
        name: "empty",
        cluster_ips: &["10.96.0.11"],
        ports: &[("http", 80, "TCP", 8080)],
        endpoints: &[],
        extra_spec: "",
        annotations: "",
    };
    node.write_manifest("empty.yaml", &empty.yaml());
    node.start_agent();
    eventually("the Service to answer through the compat programs", || {
        let r = node.probe(&net, &["--to", "10.96.0.10:80"]);
        if r[0]["ok"] == true { Ok(()) } else { Err(r) }
    });
    let r = node.probe(&net, &["--to", "10.96.0.11:80"]);
    assert_eq!(r[0]["errno"], libc::EPERM, "without bpf_set_retval a refusal is EPERM: {}", r[0]);
    let log = std::fs::read_to_string(&node.log).unwrap_or_default();
    assert!(log.contains("programs compat (socket) / compat (TC)"), "the start-up line names the variants: {log}");
}

/// Without a required feature the agent stops with one sentence naming
/// it, before it pins or attaches anything.
#[test]
fn a_kernel_without_a_required_feature_is_refused_before_anything_is_installed() {
    let cases = [
        (
            "sk_storage",
            "lacks the bpf_sk_storage_get helper for cgroup socket programs, which the datapath requires; nothing was installed",
        ),
        (
            "bpf_link",
            "lacks bpf_link attachment (BPF_LINK_CREATE, Linux 5.7) for cgroup socket programs, which the datapath requires; nothing was installed",
        ),
    ];
    for (hide, sentence) in cases {
        let mut node = Node::new("node-a");
        node.agent_env.push(("TOPOPROXY_KERNEL_HIDE".into(), hide.into()));
        node.write_manifest("web.yaml", &web(&[("10.244.0.1", true, "node-a")]));
        node.start_agent();
        let status = eventually("the agent to exit", || node.agent_exit_status().ok_or("still running"));
        assert!(!status.success(), "{hide}");
        let log = std::fs::read_to_string(&node.log).unwrap_or_default();
        assert!(log.contains(sentence), "{hide}: {log}");
        let pinned: Vec<_> = std::fs::read_dir(node.pins.path()).map(|d| d.flatten().map(|e| e.file_name()).collect()).unwrap_or_default();
        assert!(pinned.is_empty(), "{hide}: nothing pinned: {pinned:?}");
    }
}

/// Without batch map operations the agent writes, deletes and reads its
/// maps one entry per call, with the same result: Services answer, follow
/// endpoint changes, and a restarted agent adopts what is pinned.
#[test]
fn without_batch_operations_the_maps_are_written_one_entry_at_a_time() {
    let mut net = PodNetwork::new();
    net.backend("pod-a", "10.244.0.1", &[8080]);
    net.backend("pod-b", "10.244.0.2", &[8080]);
    let mut node = Node::new("node-a");
    node.agent_env.push(("TOPOPROXY_KERNEL_HIDE".into(), "batch_ops".into()));
    node.write_manifest("web.yaml", &web(&[("10.244.0.1", true, "node-a")]));
    node.start_agent();
    wait_for_backends(&node, &net, "10.96.0.10:80", &[], &["pod-a"]);
    let log = std::fs::read_to_string(&node.log).unwrap_or_default();
    assert!(
        log.contains("batch_ops (maps are written, deleted and read one entry per bpf(2) call)"),
        "the start-up line names the fallback: {log}"
    );
    // A change replaces the backend set: deletes and updates, one by one.
    node.write_manifest("web.yaml", &web(&[("10.244.0.2", true, "node-a")]));
    wait_for_backends(&node, &net, "10.96.0.10:80", &[], &["pod-b"]);
    // A restart reads the pinned maps back key by key.
    node.stop_agent();
    node.start_agent();
    wait_for_backends(&node, &net, "10.96.0.10:80", &[], &["pod-b"]);
}

#[test]
fn tcp_reaches_every_backend_and_getpeername_reports_the_cluster_ip() {
    let (net, node) = setup();
    wait_for_backends(&node, &net, "10.96.0.10:80", &[], &["pod-a", "pod-b", "pod-c"]);
    for r in node.probe(&net, &["--to", "10.96.0.10:80", "--count", "10"]) {
        assert_eq!(r["ok"], true, "{r}");
        assert_eq!(r["peer"], "10.96.0.10:80", "getpeername must show the ClusterIP: {r}");
    }
}

#[test]
fn udp_is_translated_both_ways_and_sticks_to_one_backend_per_socket() {
    let (net, node) = setup();
    // Unconnected sockets: sendmsg picks per socket, recvmsg reports the
    // ClusterIP as the source.
    wait_for_backends(&node, &net, "10.96.0.10:80", &["--udp", "--per-socket", "4"], &["dns-a", "dns-b", "dns-c"]);
    let results = node.probe(&net, &["--to", "10.96.0.10:80", "--udp", "--per-socket", "4", "--count", "20"]);
    for r in &results {
        assert_eq!(r["ok"], true, "{r}");
        assert_eq!(r["sameBackend"], true, "all datagrams of one socket go to one backend: {r}");
        for p in r["peers"].as_array().expect("peers") {
            assert_eq!(p, "10.96.0.10:80", "recvfrom must report the ClusterIP: {r}");
        }
    }
    // Connected sockets: the choice is made once, at connect().
    let results = node.probe(&net, &["--to", "10.96.0.10:80", "--udp", "--connected", "--per-socket", "3", "--count", "20"]);
    for r in &results {
        assert_eq!(r["ok"], true, "{r}");
        assert_eq!(r["sameBackend"], true, "{r}");
        assert_eq!(r["connectedPeer"], "10.96.0.10:80", "getpeername on a connected UDP socket: {r}");
    }
    // Only the UDP Service's backends answer (TCP's pods listen on the
    // same port). Each of them is reached too, but by probes repeated until
    // one sees all three: 20 random picks miss one of three backends about
    // once in a thousand runs (3 x (2/3)^20), seen once on 5.10.
    let got = replies(&results);
    assert!(got.is_subset(&set(&["dns-a", "dns-b", "dns-c"])), "UDP and TCP on port 80 are different Services: {got:?}");
    wait_for_backends(&node, &net, "10.96.0.10:80", &["--udp", "--connected", "--per-socket", "3"], &["dns-a", "dns-b", "dns-c"]);
}

#[test]
fn ipv6_tcp_and_udp() {
    let (net, node) = setup();
    wait_for_backends(&node, &net, "[fd00:96::10]:80", &[], &["pod-6a", "pod-6b"]);
    wait_for_backends(&node, &net, "[fd00:96::10]:80", &["--udp"], &["pod-6a", "pod-6b"]);
    for r in node.probe(&net, &["--to", "[fd00:96::10]:80", "--count", "5"]) {
        assert_eq!(r["peer"], "[fd00:96::10]:80", "{r}");
    }
    for r in node.probe(&net, &["--to", "[fd00:96::10]:80", "--udp", "--count", "5"]) {
        assert_eq!(r["peer"], "[fd00:96::10]:80", "{r}");
    }
}

#[test]
fn a_service_without_usable_backends_refuses_connections() {
    let mut net = PodNetwork::new();
    net.backend("pod-a", "10.244.0.1", &[8080]);
    let mut node = Node::new("node-a");
    node.write_manifest("web.yaml", &web(&[("10.244.0.1", false, "node-a")]));
    node.start_agent();
    // ECONNREFUSED, or EPERM on a kernel without bpf_set_retval (the
    // documented degradation, asserted rather than skipped).
    let refused = refused_errno();
    eventually("the refusal for a Service whose only endpoint is not ready", || {
        let r = node.probe(&net, &["--to", "10.96.0.10:80"]);
        if r[0]["errno"] == refused { Ok(()) } else { Err(r) }
    });
    // UDP too: sendmsg fails the same way.
    let r = node.probe(&net, &["--to", "10.96.0.10:80", "--udp"]);
    assert_eq!(r[0]["errno"], refused, "{}", r[0]);
    let r = node.probe(&net, &["--to", "[fd00:96::10]:80"]);
    assert_eq!(r[0]["errno"], refused, "{}", r[0]);
}

#[test]
fn traffic_that_is_not_for_a_service_is_untouched() {
    let (net, node) = setup();
    wait_for_backends(&node, &net, "10.96.0.10:80", &[], &["pod-a", "pod-b", "pod-c"]);
    // A direct connection to a pod keeps its address.
    let r = node.probe(&net, &["--to", "10.244.0.2:8080"]);
    assert_eq!(r[0]["reply"], "pod-b", "{}", r[0]);
    assert_eq!(r[0]["peer"], "10.244.0.2:8080", "{}", r[0]);
    // Another port of the ClusterIP, and an address that is no Service, are
    // not ours: they fail as they would without us (no route).
    for to in ["10.96.0.10:81", "10.96.0.11:80", "[fd00:96::11]:80"] {
        let r = node.probe(&net, &["--to", to]);
        assert_eq!(r[0]["errno"], 101, "{to}: {}", r[0]);
    }
    // A process outside the node's cgroup is not load balanced at all.
    let outside = support::Node::new("elsewhere");
    let r = outside.probe(&net, &["--to", "10.96.0.10:80"]);
    assert_eq!(r[0]["errno"], 101, "{}", r[0]);
}

#[test]
fn one_udp_socket_talking_to_two_services_and_a_pod_sees_each_true_source() {
    let (net, node) = setup();
    // A second Service with one endpoint, so its backend is known. It must
    // not share a backend address and port with the first: replies carry
    // only the backend's address, so a socket that reached one backend
    // through two frontends cannot tell them apart (neither can any
    // socket-level load balancer).
    node.write_manifest("dns2.yaml", &dns2());
    wait_for_backends(&node, &net, "10.96.0.20:53", &["--udp"], &["pod-c"]);
    // The socket's first translation lives in its own storage, the second
    // Service's in SOCK_REVNAT (the socket is then marked as spilled), and
    // a pod it reaches directly must keep its own address even though the
    // socket has translations.
    let results = node.probe(
        &net,
        &["--to", "10.96.0.10:80", "--also", "10.96.0.20:53", "--also", "10.244.0.1:8080", "--udp", "--per-socket", "3", "--count", "10"],
    );
    for r in &results {
        assert_eq!(r["ok"], true, "{r}");
        assert_eq!(r["sameBackend"], true, "{r}");
        let peers: Vec<&str> = r["peers"].as_array().expect("peers").iter().map(|p| p.as_str().unwrap_or("")).collect();
        assert_eq!(peers, ["10.96.0.10:80", "10.96.0.20:53", "10.244.0.1:8080"].repeat(3), "{r}");
        let replies: Vec<&str> = r["replies"].as_array().expect("replies").iter().map(|p| p.as_str().unwrap_or("")).collect();
        assert_eq!(replies[1], "pod-c", "{r}");
        assert_eq!(replies[2], "pod-a", "{r}");
    }
}

#[test]
fn an_ipv4_service_dialled_as_an_ipv4_mapped_address_from_an_ipv6_socket() {
    // Dual-stack runtimes (Java by default) open AF_INET6 sockets and reach
    // IPv4 peers as ::ffff:a.b.c.d; the kernel then runs the *6 hooks.
    let (net, node) = setup();
    let mapped = "[::ffff:10.96.0.10]:80";
    wait_for_backends(&node, &net, mapped, &[], &["pod-a", "pod-b", "pod-c"]);
    for r in node.probe(&net, &["--to", mapped, "--count", "5"]) {
        assert_eq!(r["ok"], true, "{r}");
        assert_eq!(r["peer"], mapped, "getpeername shows the mapped ClusterIP: {r}");
    }
    wait_for_backends(&node, &net, mapped, &["--udp"], &["dns-a", "dns-b", "dns-c"]);
    for r in node.probe(&net, &["--to", mapped, "--udp", "--per-socket", "3", "--count", "5"]) {
        assert_eq!(r["ok"], true, "{r}");
        assert_eq!(r["sameBackend"], true, "{r}");
        for p in r["peers"].as_array().expect("peers") {
            assert_eq!(p, mapped, "recvfrom shows the mapped ClusterIP: {r}");
        }
    }
    for r in node.probe(&net, &["--to", mapped, "--udp", "--connected", "--count", "5"]) {
        assert_eq!(r["ok"], true, "{r}");
        assert_eq!(r["connectedPeer"], mapped, "{r}");
        assert_eq!(r["peer"], mapped, "{r}");
    }
    // A mapped address that is no Service stays untouched (and unroutable).
    let r = node.probe(&net, &["--to", "[::ffff:10.96.0.11]:80"]);
    assert_eq!(r[0]["errno"], 101, "{}", r[0]);
}

#[test]
fn a_udp_reply_read_after_an_upgrade_from_an_agent_without_socket_storage_shows_the_service() {
    use std::io::{BufRead, BufReader, Write};
    use std::process::Stdio;

    use aya::maps::{Array, HashMap, Map, MapData};
    use proxy_agent::datapath::keys::backend_value;
    use proxy_agent::model::Backend;
    use proxy_common::{SOCK_CONFIG_MAP, SOCK_PEER_MAP, SOCK_REVNAT_MAP, SockConfig, SockRevNatKey, SockRevNatValue};
    use proxy_test_support::sandbox::{Guarded, command_in};

    let (net, mut node) = setup();
    // One endpoint, so the backend the socket reaches is known.
    node.write_manifest("dns2.yaml", &dns2());
    wait_for_backends(&node, &net, "10.96.0.20:53", &["--udp"], &["pod-c"]);

    // A pod sends a query; the reply waits in its socket until it reads.
    let mut cmd = command_in(agent_bin(), Some(&net.netns), Some(&node.cgroup)).expect("probe command");
    cmd.arg("probe").args(["--to", "10.96.0.20:53", "--udp", "--hold", "--timeout-ms", "20000"]);
    cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::inherit());
    let mut probe = Guarded::spawn(&mut cmd).expect("start probe");
    let mut stdin = probe.0.stdin.take().expect("probe stdin");
    let mut lines = BufReader::new(probe.0.stdout.take().expect("probe stdout")).lines();
    let held: serde_json::Value = serde_json::from_str(&lines.next().expect("held line").expect("read")).expect("json");
    let cookie = held["cookie"].as_u64().unwrap_or_else(|| panic!("no cookie: {held}"));

    // What an agent from before SOCK_PEER leaves behind: the socket's
    // reverse entry in SOCK_REVNAT only, and no SOCK_PEER or SOCK_CONFIG.
    let backend = backend_value(&Backend { ip: "10.244.0.3".parse().expect("ip"), port: 8080 });
    let service = backend_value(&Backend { ip: "10.96.0.20".parse().expect("ip"), port: 53 });
    let revnat = MapData::from_pin(node.pins.path().join(SOCK_REVNAT_MAP)).expect("open SOCK_REVNAT");
    let mut revnat: HashMap<_, SockRevNatKey, SockRevNatValue> = HashMap::try_from(Map::LruHashMap(revnat)).expect("SOCK_REVNAT");
    let key = SockRevNatKey::new(cookie, backend.ip_be, backend.port_be, backend.family);
    let value = SockRevNatValue { ip_be: service.ip_be, port_be: service.port_be, family: service.family, _pad: 0 };
    revnat.insert(key, value, 0).expect("write SOCK_REVNAT");
    drop(revnat);
    node.stop_agent();
    for map in [SOCK_PEER_MAP, SOCK_CONFIG_MAP] {
        std::fs::remove_file(node.pins.path().join(map)).expect("remove pin");
    }

    // The upgrade: the new agent finds no SOCK_PEER, so it records which
    // sockets may have their reverse entry only in SOCK_REVNAT.
    node.start_agent();
    let below = eventually("SOCK_CONFIG written by the upgraded agent", || {
        let data = MapData::from_pin(node.pins.path().join(SOCK_CONFIG_MAP)).map_err(|e| e.to_string())?;
        let config: Array<_, SockConfig> = Array::try_from(Map::Array(data)).map_err(|e| e.to_string())?;
        let below = config.get(&0, 0).map_err(|e| e.to_string())?.legacy_revnat_cookie_below;
        if below == 0 { Err("not yet".to_string()) } else { Ok(below) }
    });
    assert!(cookie < below, "the held socket ({cookie}) predates the upgrade ({below})");

    writeln!(stdin, "go").expect("release probe");
    let r: serde_json::Value = serde_json::from_str(&lines.next().expect("result line").expect("read")).expect("json");
    assert_eq!(r["ok"], true, "{r}");
    assert_eq!(r["reply"], "pod-c", "{r}");
    assert_eq!(r["peer"], "10.96.0.20:53", "recvfrom shows the Service, as before the upgrade: {r}");
    drop(probe);
}
