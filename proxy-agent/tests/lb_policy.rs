//! What a LoadBalancer's owner asks of the proxy besides its backends:
//! `loadBalancerSourceRanges`, `ipMode`, and `sessionAffinity` for traffic
//! from outside, end to end.
//!
//! The TC test builds its own isolated namespaces, none linked to the
//! host's:
//!
//! ```text
//!   inside (10.0.1.1) -- n-in 10.0.1.2           n-out 10.0.2.2 -- outside (10.0.2.1)
//!                              node (agent, TC on n-in and n-out)
//!                              n-pod 10.244.1.1
//!                                 |
//!                              eth0 10.244.1.10, 10.244.1.11 (pods)
//! ```
//!
//! Both clients route the LoadBalancer IP to the node; the Service admits
//! 10.0.1.0/24 only. The socket-layer tests use the shared pod network of
//! `support` (one namespace, pods' addresses on its loopback, the agent on
//! the host with `--devices none`).

mod support;

use std::process::Stdio;

use proxy_agent::datapath::dump;
use proxy_test_support::sandbox::{Cgroup, Guarded, Netns, PinDir, command_in, spawn_backend};
use proxy_test_support::wait::eventually;
use serde_json::Value;
use support::*;

const LB_IP: &str = "198.51.100.7";

/// A LoadBalancer Service with NodePort 30080, the ingress IP `LB_IP`,
/// `extra` spec fields, and endpoints `eps` on node-a.
fn lb_service(extra: &str, eps: &[&str]) -> String {
    let endpoints: String = eps.iter().map(|ip| format!("- addresses: [\"{ip}\"]\n  nodeName: node-a\n")).collect();
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: web, namespace: default}}\nspec:\n  type: LoadBalancer\n  clusterIP: 10.96.0.10\n{extra}  ports:\n  - {{name: http, port: 80, protocol: TCP, targetPort: 8080, nodePort: 30080}}\nstatus:\n  loadBalancer:\n    ingress: [{{ip: {LB_IP}}}]\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: web-1\n  namespace: default\n  labels: {{kubernetes.io/service-name: web}}\naddressType: IPv4\nports:\n- {{name: http, port: 8080, protocol: TCP}}\nendpoints:\n{endpoints}"
    )
}

const POLICY: &str = "  sessionAffinity: ClientIP\n  loadBalancerSourceRanges: [10.0.1.0/24]\n";

/// The TC world of the module comment.
struct World {
    inside: Netns,
    outside: Netns,
    node: Netns,
    cgroup: Cgroup,
    pins: PinDir,
    manifests: TempDir,
    agent: Option<Guarded>,
    _backends: Vec<Guarded>,
}

impl World {
    fn new() -> World {
        require_root();
        let inside = Netns::new("tlb").expect("netns");
        let outside = Netns::new("tlb").expect("netns");
        let node = Netns::new("tlb").expect("netns");
        let pods = Netns::new("tlb").expect("netns");
        node.veth("n-in", &inside, "eth0").expect("veth");
        node.veth("n-out", &outside, "eth0").expect("veth");
        node.veth("n-pod", &pods, "eth0").expect("veth");
        for (ns, cidr, dev) in [
            (&inside, "10.0.1.1/24", "eth0"),
            (&outside, "10.0.2.1/24", "eth0"),
            (&node, "10.0.1.2/24", "n-in"),
            (&node, "10.0.2.2/24", "n-out"),
            (&node, "10.244.1.1/24", "n-pod"),
            (&pods, "10.244.1.10/24", "eth0"),
            (&pods, "10.244.1.11/24", "eth0"),
        ] {
            ns.ip(&["addr", "add", cidr, "dev", dev]).unwrap_or_else(|e| panic!("{cidr}: {e}"));
        }
        inside.ip(&["route", "add", &format!("{LB_IP}/32"), "via", "10.0.1.2"]).expect("route");
        outside.ip(&["route", "add", &format!("{LB_IP}/32"), "via", "10.0.2.2"]).expect("route");
        pods.ip(&["route", "add", "default", "via", "10.244.1.1"]).expect("route");
        node.sysctl("net.ipv4.ip_forward", "1").expect("forwarding");
        let backends = [("pod-1", "10.244.1.10:8080"), ("pod-2", "10.244.1.11:8080")]
            .iter()
            .map(|(name, at)| spawn_backend(&agent_bin(), &pods, name, &[(*at).to_string()]).expect("backend"))
            .collect();
        World {
            inside,
            outside,
            node,
            cgroup: Cgroup::new("tlb").expect("cgroup"),
            pins: PinDir::new("tlb").expect("pins"),
            manifests: TempDir::new("tlb-manifests"),
            agent: None,
            _backends: backends,
        }
    }

    fn publish(&self, yaml: &str) {
        let tmp = self.manifests.0.join(".web.yaml.tmp");
        std::fs::write(&tmp, yaml).expect("write manifest");
        std::fs::rename(&tmp, self.manifests.0.join("web.yaml")).expect("rename manifest");
    }

    fn log(&self) -> std::path::PathBuf {
        self.manifests.0.join("agent.log.txt")
    }

    fn start_agent(&mut self) {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(self.log()).expect("log");
        let mut cmd = command_in(agent_bin(), Some(&self.node), None).expect("agent command");
        cmd.arg("run")
            .args(["--node", "node-a", "--manifests"])
            .arg(&self.manifests.0)
            .arg("--cgroup")
            .arg(self.cgroup.path())
            .arg("--bpffs")
            .arg(self.pins.path())
            .args(["--poll-interval-ms", "50", "--devices", "n-in,n-out"])
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("dup log"))
            .stderr(log);
        self.agent = Some(Guarded::spawn(&mut cmd).expect("start agent"));
    }

    /// `proxy-agent probe ARGS` in `ns`, in the node's cgroup when `cgroup`.
    fn probe(&self, ns: &Netns, cgroup: bool, args: &[&str]) -> Vec<Value> {
        let mut cmd = command_in(agent_bin(), Some(ns), cgroup.then_some(&self.cgroup)).expect("probe command");
        cmd.arg("probe").args(args).stdin(Stdio::null()).stderr(Stdio::inherit());
        let out = cmd.output().expect("run probe");
        String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).expect("probe output")).collect()
    }

    fn report(&self) -> dump::Report {
        dump::report(self.pins.path(), &dump::read(self.pins.path()).expect("read maps"))
    }
}

impl Drop for World {
    fn drop(&mut self) {
        if let Some(mut a) = self.agent.take() {
            let _ = a.0.kill();
            let _ = a.0.wait();
        }
        if std::thread::panicking() {
            eprintln!("--- agent log ---\n{}", std::fs::read_to_string(self.log()).unwrap_or_default());
        }
    }
}

/// The one backend that answered every attempt (all must have succeeded).
fn one_backend(what: &str, results: &[Value]) -> String {
    assert!(results.iter().all(|r| r["ok"] == true), "{what}: {:?}", results.iter().find(|r| r["ok"] != true));
    let got = replies(results);
    assert_eq!(got.len(), 1, "{what}: every connection must reach one backend, got {got:?}");
    got.into_iter().next().unwrap_or_default()
}

#[test]
fn tc_admits_only_the_source_ranges_to_the_load_balancer_ip_and_keeps_each_client_on_one_backend() {
    let mut w = World::new();
    w.publish(&lb_service(POLICY, &["10.244.1.10", "10.244.1.11"]));
    w.start_agent();
    let lb = format!("{LB_IP}:80");
    // Inside the ranges: served, every connection on one backend.
    eventually("the LoadBalancer IP to answer the client inside the ranges", || {
        let r = w.probe(&w.inside, false, &["--to", &lb, "--timeout-ms", "1000"]);
        if r[0]["ok"] == true { Ok(()) } else { Err(r) }
    });
    let first = one_backend("inside, LoadBalancer IP", &w.probe(&w.inside, false, &["--to", &lb, "--count", "30"]));
    for r in w.probe(&w.inside, false, &["--to", &lb, "--count", "3"]) {
        assert_eq!(r["peer"], lb.as_str(), "replies come from the LoadBalancer IP: {r}");
    }
    // Outside: dropped, as kube-proxy drops it (no answer at all).
    let dropped = w.report().nodeport.map_or(0, |n| n.counters["dropped_source_range"]);
    let r = w.probe(&w.outside, false, &["--to", &lb, "--count", "2", "--timeout-ms", "700"]);
    for x in &r {
        assert_eq!(x["error"], "connection timed out", "the client outside the ranges must get nothing: {x}");
    }
    let now = w.report().nodeport.map_or(0, |n| n.counters["dropped_source_range"]);
    assert!(now > dropped, "dropped and counted: {dropped} -> {now}");
    // NodePorts are not filtered; affinity holds there too, per client.
    let np = one_backend("outside, NodePort", &w.probe(&w.outside, false, &["--to", "10.0.2.2:30080", "--count", "30"]));
    eprintln!("inside sticks to {first}, outside (NodePort) to {np}");

    // The dump shows the TC side's policy: the LoadBalancer IP filtered,
    // with the LoadBalancer IP itself admitted since the node's 10.0.1.2
    // lies inside the range; both clients' affinity entries.
    let r = w.report();
    let np_report = r.nodeport.as_ref().expect("TC maps");
    let lb_view = np_report.services.iter().find(|s| s.frontend == format!("{lb}/TCP")).expect("LB frontend");
    assert_eq!(lb_view.source_ranges, Some(vec!["10.0.1.0/24".to_string(), format!("{LB_IP}/32")]));
    assert_eq!(lb_view.affinity_timeout_seconds, Some(10_800));
    let np_view = np_report.services.iter().find(|s| s.frontend == "10.0.2.2:30080/TCP").expect("NodePort frontend");
    assert_eq!(np_view.source_ranges, None);
    let clients: Vec<&str> = np_report.affinity.iter().map(|a| a.client.as_str()).collect();
    assert!(clients.contains(&"10.0.1.1") && clients.contains(&"10.0.2.1"), "{clients:?}");
    assert!(r.consistent, "{:?}", r.findings);
    let out = std::process::Command::new(agent_bin()).arg("dump").arg("--bpffs").arg(w.pins.path()).output().expect("dump");
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{table}");
    for want in [
        format!("{lb}/TCP  id "),
        "affinity ClientIP 10800s scope ".to_string(),
        format!("  source ranges 10.0.1.0/24,{LB_IP}/32"),
        "  affinity: 2 clients".to_string(),
        "10.0.1.1  =>  #".to_string(),
    ] {
        assert!(table.contains(&want), "dump's table lacks {want:?}:\n{table}");
    }

    // The node's own processes (its namespace, in the agent's cgroup) may
    // reach the LoadBalancer IP: one of its addresses is inside the range.
    let r = w.probe(&w.node, true, &["--to", &lb, "--count", "3"]);
    one_backend("from the node itself", &r);

    // The affine backend leaves: the client inside moves at once.
    let other = if first == "pod-1" { "10.244.1.11" } else { "10.244.1.10" };
    w.publish(&lb_service(POLICY, &[other]));
    eventually("the TC frontend to have one backend", || {
        let n =
            w.report().nodeport.and_then(|n| n.services.into_iter().find(|s| s.frontend == format!("{lb}/TCP"))).map(|s| s.backend_count);
        if n == Some(1) { Ok(()) } else { Err(n) }
    });
    let moved = one_backend("inside, after the removal", &w.probe(&w.inside, false, &["--to", &lb, "--count", "10"]));
    assert_ne!(moved, first);
}

#[test]
fn pods_outside_the_source_ranges_are_refused_and_ip_mode_proxy_addresses_are_left_alone() {
    let mut net = PodNetwork::new();
    net.backend("pod-a", "10.244.0.1", &[8080]);
    net.backend("pod-b", "10.244.0.2", &[8080]);
    // Two client addresses of the pod network: one inside the ranges, one
    // outside.
    net.netns.add_loopback_addrs(&["10.244.0.50/32", "10.244.7.50/32"]).expect("client addresses");
    let mut node = Node::new("node-a");
    let mut yaml = lb_service("  loadBalancerSourceRanges: [10.244.0.0/24, not-a-cidr]\n", &["10.244.0.1", "10.244.0.2"]);
    // A second Service whose ingress IPs the cloud proxies (ipMode Proxy)
    // but for one.
    yaml.push_str(
        "---\napiVersion: v1\nkind: Service\nmetadata: {name: proxied, namespace: default}\nspec:\n  type: LoadBalancer\n  clusterIP: 10.96.0.11\n  ports: [{port: 80, targetPort: 8080, nodePort: 30081}]\nstatus:\n  loadBalancer:\n    ingress: [{ip: 198.51.100.8, ipMode: Proxy}, {ip: 198.51.100.9, ipMode: VIP}]\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: proxied-1, namespace: default, labels: {kubernetes.io/service-name: proxied}}\naddressType: IPv4\nports: [{port: 8080}]\nendpoints: [{addresses: [10.244.0.1], nodeName: node-a}]\n",
    );
    node.write_manifest("lb.yaml", &yaml);
    node.start_agent();
    let lb = format!("{LB_IP}:80");
    eventually("a pod inside the ranges to reach the LoadBalancer IP", || {
        let r = node.probe(&net, &["--to", &lb, "--bind", "10.244.0.50", "--timeout-ms", "1000"]);
        if r[0]["ok"] == true { Ok(()) } else { Err(r) }
    });
    for r in node.probe(&net, &["--to", &lb, "--bind", "10.244.0.50", "--count", "5"]) {
        assert_eq!(r["ok"], true, "{r}");
    }
    // Outside the ranges: refused at connect().
    for r in node.probe(&net, &["--to", &lb, "--bind", "10.244.7.50", "--count", "3"]) {
        assert_eq!(r["errno"], refused_errno(), "refused for a pod outside the ranges: {r}");
    }
    // A pod that lets the kernel pick its address: the hook cannot tell
    // which it will be, so a restricted LoadBalancer refuses it.
    let r = node.probe(&net, &["--to", &lb]);
    assert_eq!(r[0]["errno"], 111, "{}", r[0]);
    // The same Service's ClusterIP and NodePort are not filtered.
    for to in ["10.96.0.10:80", "127.0.0.1:30080"] {
        let r = node.probe(&net, &["--to", to, "--bind", "10.244.7.50"]);
        assert_eq!(r[0]["ok"], true, "{to}: {}", r[0]);
    }
    let r = dump::report(node.pins.path(), &dump::read(node.pins.path()).expect("read maps"));
    assert!(r.counters["refused_source_range"] >= 4, "{:?}", r.counters);
    let view = r.services.iter().find(|s| s.frontend == format!("{lb}/TCP")).expect("LB frontend");
    assert_eq!(view.source_ranges, Some(vec!["10.244.0.0/24".to_string()]), "the malformed range is left out");
    let log = node.agent_log();
    assert!(log.contains("spec.loadBalancerSourceRanges[1]") && log.contains("not-a-cidr"), "the bad range is reported: {log}");

    // ipMode VIP is translated; ipMode Proxy is left alone (no route here:
    // network unreachable, as without any proxy).
    let r = node.probe(&net, &["--to", "198.51.100.9:80"]);
    assert_eq!(r[0]["reply"], "pod-a", "{}", r[0]);
    let r = node.probe(&net, &["--to", "198.51.100.8:80"]);
    assert_eq!(r[0]["errno"], 101, "{}", r[0]);
    let r = dump::report(node.pins.path(), &dump::read(node.pins.path()).expect("read maps"));
    assert!(!r.services.iter().any(|s| s.frontend.starts_with("198.51.100.8:")), "an ipMode Proxy address is never programmed");
}

#[test]
fn explain_shows_affinity_and_source_ranges() {
    let dir = TempDir::new("tlb-explain");
    std::fs::write(
        dir.0.join("web.yaml"),
        lb_service("  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}\n  loadBalancerSourceRanges: [10.0.0.0/8]\n", &["10.244.1.10"]),
    )
    .expect("write");
    let run = |output: &str| {
        let out = std::process::Command::new(agent_bin())
            .args(["explain", "--node", "node-a", "--output", output, "--manifests"])
            .arg(&dir.0)
            .output()
            .expect("explain");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let doc: Value = serde_json::from_str(&run("json")).expect("json");
    let svc = &doc["services"][0];
    assert_eq!(svc["sessionAffinity"], "ClientIP");
    assert_eq!(svc["sessionAffinityTimeoutSeconds"], 60);
    assert_eq!(svc["loadBalancerSourceRanges"], serde_json::json!(["10.0.0.0/8"]));
    assert_eq!(svc["sourceRangeFrontends"], serde_json::json!([format!("{LB_IP}:80")]));
    let table = run("table");
    assert!(table.contains("affinity:  ClientIP, timeout 60s"), "{table}");
    assert!(table.contains(&format!("sources:   10.0.0.0/8 (filters {LB_IP}:80)")), "{table}");
    // Without either: the defaults, and null for the ranges.
    std::fs::write(dir.0.join("web.yaml"), lb_service("", &["10.244.1.10"])).expect("write");
    let doc: Value = serde_json::from_str(&run("json")).expect("json");
    let svc = &doc["services"][0];
    assert_eq!((svc["sessionAffinity"].as_str(), svc["sessionAffinityTimeoutSeconds"].is_null()), (Some("None"), true));
    assert!(svc["loadBalancerSourceRanges"].is_null());
}
