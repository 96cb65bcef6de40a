//! Manifest mode's input end to end, through the agent binary and the
//! datapath: `kubectl get -o json` List files, files watched with inotify
//! (the agent here polls only every 10 minutes, so every change below is
//! seen through inotify), files written in place, half-written and
//! garbage files, deleted files, and no reading while nothing changes.

mod support;

use std::fs;
use std::io::Write;
use std::process::Stdio;

use proxy_test_support::sandbox::Guarded;
use proxy_test_support::wait::eventually;
use support::*;

/// The agent on `node`'s manifests, with a poll so slow that the tests see
/// only what inotify reports.
fn start_agent(node: &Node, poll_ms: u64) -> Guarded {
    let log = fs::OpenOptions::new().create(true).append(true).open(&node.log).expect("open log");
    let mut cmd = std::process::Command::new(agent_bin());
    cmd.args(["run", "--node", &node.name, "--manifests"])
        .arg(&node.manifests.0)
        .arg("--cgroup")
        .arg(node.cgroup.path())
        .arg("--bpffs")
        .arg(node.pins.path())
        .args(["--poll-interval-ms", &poll_ms.to_string()])
        // Host network namespace: no TC program on the host's interfaces.
        .args(["--devices", "none"])
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("dup log"))
        .stderr(log);
    Guarded::spawn(&mut cmd).expect("start agent")
}

const NO_POLL: u64 = 600_000;

/// A Service and its EndpointSlice as `kubectl get -o json` prints them
/// (unstructured: keys sorted, so `endpoints` comes before `kind`).
fn service_json(name: &str, ip: &str) -> String {
    format!(
        r#"{{"apiVersion":"v1","kind":"Service","metadata":{{"name":"{name}","namespace":"default","resourceVersion":"1","uid":"uid-{name}"}},"spec":{{"clusterIP":"{ip}","clusterIPs":["{ip}"],"ports":[{{"name":"http","port":80,"protocol":"TCP","targetPort":8080}}],"type":"ClusterIP"}},"status":{{"loadBalancer":{{}}}}}}"#
    )
}

fn slice_json(name: &str, endpoints: &[&str]) -> String {
    let eps: Vec<String> = endpoints
        .iter()
        .map(|a| format!(r#"{{"addresses":["{a}"],"conditions":{{"ready":true,"serving":true,"terminating":false}},"nodeName":"node-a"}}"#))
        .collect();
    format!(
        r#"{{"addressType":"IPv4","apiVersion":"discovery.k8s.io/v1","endpoints":[{}],"kind":"EndpointSlice","metadata":{{"labels":{{"kubernetes.io/service-name":"{name}"}},"name":"{name}-abcde","namespace":"default"}},"ports":[{{"name":"http","port":8080,"protocol":"TCP"}}]}}"#,
        eps.join(",")
    )
}

/// A `List` the way kubectl writes it: four-space indents, `items` first.
fn list(items: &[String]) -> String {
    format!(
        "{{\n    \"apiVersion\": \"v1\",\n    \"items\": [\n        {}\n    ],\n    \"kind\": \"List\",\n    \"metadata\": {{\n        \"resourceVersion\": \"\"\n    }}\n}}\n",
        items.join(",\n        ")
    )
}

fn pods(net: &mut PodNetwork, n: usize) {
    for i in 1..=n {
        net.backend(&format!("pod-{i}"), &format!("10.244.1.{i}"), &[8080]);
    }
}

/// Overwrites `file` in place (truncate, write), as `kubectl get -o json >
/// file` does; the file stays open (the writer is returned) until dropped.
fn write_in_place(node: &Node, file: &str, text: &str) -> fs::File {
    let mut f = fs::OpenOptions::new().write(true).truncate(true).create(true).open(node.manifests.0.join(file)).expect("open in place");
    f.write_all(text.as_bytes()).expect("write in place");
    f.flush().expect("flush");
    f
}

fn unreachable(node: &Node, net: &PodNetwork, to: &str) {
    eventually(&format!("{to} to be no Service any more"), || {
        let r = node.probe(net, &["--to", to]);
        if r[0]["errno"] == 101 { Ok(()) } else { Err(r) }
    });
}

#[test]
fn kubectl_json_lists_are_served_and_followed_through_inotify() {
    let mut net = PodNetwork::new();
    pods(&mut net, 3);
    let node = Node::new("node-a");
    // 300 Services in one List, their slices in another, as `kubectl get
    // services -A -o json > services.json` (and endpointslices) leave them.
    let n = 300;
    let names: Vec<String> = (0..n).map(|i| format!("s{i}")).collect();
    let ip = |i: usize| format!("10.96.{}.{}", 1 + i / 200, 1 + i % 200);
    let services: Vec<String> = (0..n).map(|i| service_json(&names[i], &ip(i))).collect();
    let slices: Vec<String> = (0..n).map(|i| slice_json(&names[i], &["10.244.1.1", "10.244.1.2"])).collect();
    fs::write(node.manifests.0.join("services.json"), list(&services)).expect("write");
    fs::write(node.manifests.0.join("endpointslices.json"), list(&slices)).expect("write");
    let _agent = start_agent(&node, NO_POLL);
    let last = format!("{}:80", ip(n - 1));
    wait_for_backends(&node, &net, &last, &[], &["pod-1", "pod-2"]);
    wait_for_backends(&node, &net, &format!("{}:80", ip(0)), &[], &["pod-1", "pod-2"]);

    // The slices file rewritten in place (as a shell redirect does): the
    // new endpoints are picked up once the writer closes it.
    let mut slices = slices;
    slices[n - 1] = slice_json(&names[n - 1], &["10.244.1.3"]);
    drop(write_in_place(&node, "endpointslices.json", &list(&slices)));
    wait_for_backends(&node, &net, &last, &[], &["pod-3"]);

    // A Service removed from the List is removed from the datapath.
    let mut services = services;
    services.pop();
    drop(write_in_place(&node, "services.json", &list(&services)));
    unreachable(&node, &net, &last);
    wait_for_backends(&node, &net, &format!("{}:80", ip(0)), &[], &["pod-1", "pod-2"]);
}

#[test]
fn half_written_and_garbage_files_keep_their_objects_until_they_parse() {
    let mut net = PodNetwork::new();
    pods(&mut net, 2);
    let node = Node::new("node-a");
    let to = "10.96.0.20:80";
    let web = |ep: &str| list(&[service_json("web", "10.96.0.20"), slice_json("web", &[ep])]);
    let other = ServiceSpec {
        name: "other",
        cluster_ips: &["10.96.0.21"],
        ports: &[("http", 80, "TCP", 8080)],
        endpoints: &[("10.244.1.1", true, "node-a")],
        extra_spec: "",
        annotations: "",
    };
    fs::write(node.manifests.0.join("web.json"), web("10.244.1.1")).expect("write");
    fs::write(node.manifests.0.join("other.yaml"), other.yaml()).expect("write");
    let _agent = start_agent(&node, NO_POLL);
    wait_for_backends(&node, &net, to, &[], &["pod-1"]);

    // Half of the new content, written in place and closed: it does not
    // parse, so web keeps its old endpoint, and the agent says why.
    let new = web("10.244.1.2");
    drop(write_in_place(&node, "web.json", &new[..new.len() / 2]));
    eventually("a warning about the half-written file", || {
        let log = node.agent_log();
        let warned = log
            .lines()
            .any(|l| l.contains("WARN") && l.contains("web.json") && l.contains("not valid JSON") && l.contains("keeping the 2 objects"));
        if warned { Ok(()) } else { Err(log) }
    });
    wait_for_backends(&node, &net, to, &[], &["pod-1"]);

    // The writer finishes (in place): the new endpoint is taken.
    drop(write_in_place(&node, "web.json", &new));
    wait_for_backends(&node, &net, to, &[], &["pod-2"]);

    // Half written and still open: held while the writer may go on, then
    // read, found unparsable and kept as it was.
    let writer = write_in_place(&node, "web.json", &web("10.244.1.1")[..100]);
    eventually("a second warning about web.json", || {
        let log = node.agent_log();
        let n = log.lines().filter(|l| l.contains("WARN") && l.contains("web.json") && l.contains("keeping the 2 objects")).count();
        if n >= 2 { Ok(()) } else { Err(n) }
    });
    wait_for_backends(&node, &net, to, &[], &["pod-2"]);
    drop(writer);

    // Garbage over both files (YAML too): everything keeps working.
    drop(write_in_place(&node, "web.json", "\u{0}\u{1} garbage {{{"));
    drop(write_in_place(&node, "other.yaml", "kind: [this is not yaml\n"));
    eventually("warnings about the garbage", || {
        let log = node.agent_log();
        let other = log.lines().any(|l| l.contains("WARN") && l.contains("other.yaml") && l.contains("not valid YAML"));
        if other { Ok(()) } else { Err(log) }
    });
    wait_for_backends(&node, &net, to, &[], &["pod-2"]);
    wait_for_backends(&node, &net, "10.96.0.21:80", &[], &["pod-1"]);

    // Restored: taken again.
    drop(write_in_place(&node, "web.json", &web("10.244.1.1")));
    wait_for_backends(&node, &net, to, &[], &["pod-1"]);

    // Deleted: its objects go; the other file's stay.
    fs::remove_file(node.manifests.0.join("web.json")).expect("rm");
    unreachable(&node, &net, to);
    wait_for_backends(&node, &net, "10.96.0.21:80", &[], &["pod-1"]);
}

#[test]
fn unchanged_files_are_not_read_again() {
    let mut net = PodNetwork::new();
    pods(&mut net, 1);
    let node = Node::new("node-a");
    // About 2 MB of Services: reading it once more would show.
    let services: Vec<String> = (0..6000).map(|i| service_json(&format!("s{i}"), &format!("10.97.{}.{}", i / 250, 1 + i % 250))).collect();
    let text = list(&services);
    let size = text.len() as u64;
    fs::write(node.manifests.0.join("services.json"), text).expect("write");
    fs::write(node.manifests.0.join("web.json"), list(&[service_json("web", "10.96.0.20"), slice_json("web", &["10.244.1.1"])]))
        .expect("write");
    // A fast poll: it must look at the files without reading them.
    let agent = start_agent(&node, 50);
    wait_for_backends(&node, &net, "10.96.0.20:80", &[], &["pod-1"]);
    // The start-up's own reads end first: the socket termination worker
    // finds its mechanism (the kernel's BTF, megabytes) beside the first
    // sync, and says which once it has.
    proxy_test_support::wait::eventually("the agent to name its socket termination mechanism", || {
        let log = node.agent_log();
        if log.contains("sockets translated to a backend that leaves are") { Ok(()) } else { Err(()) }
    });
    let pid = agent.0.id();
    let rchar = || -> u64 {
        fs::read_to_string(format!("/proc/{pid}/io"))
            .expect("agent io")
            .lines()
            .find_map(|l| l.strip_prefix("rchar:").and_then(|v| v.trim().parse().ok()))
            .expect("rchar")
    };
    let before = rchar();
    std::thread::sleep(std::time::Duration::from_secs(2));
    let idle = rchar() - before;
    assert!(idle < size / 4, "the agent read {idle} bytes in 2 s while no file changed (services.json is {size} bytes)");

    // One file changes: only that one is read.
    let before = rchar();
    fs::write(
        node.manifests.0.join("web.json"),
        list(&[service_json("web", "10.96.0.20"), slice_json("web", &["10.244.1.1", "10.244.1.1"])]),
    )
    .expect("rewrite");
    eventually("web.json read again", || {
        let read = rchar() - before;
        if read > 0 { Ok(()) } else { Err(read) }
    });
    std::thread::sleep(std::time::Duration::from_millis(500));
    let read = rchar() - before;
    assert!(read < size / 4, "a change of web.json made the agent read {read} bytes (services.json is {size} bytes)");
}
