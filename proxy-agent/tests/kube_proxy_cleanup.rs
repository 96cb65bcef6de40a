//! `proxy-agent cleanup-kube-proxy` against the real tools and the real
//! kernel: kube-proxy-shaped rulesets (test-support's `kube_proxy`) and
//! rules of other components are loaded into a namespace of the test's own
//! with `iptables-restore` (legacy and nft backends, both families), `nft`
//! and `ipset`; the clean-up runs inside that namespace; only kube-proxy's
//! part may disappear. `--dry-run` changes nothing, and a second run finds
//! nothing to do.

mod support;

use std::collections::BTreeSet;
use std::process::Stdio;

use proxy_test_support::kube_proxy::{ServicePort, iptables_ruleset, nft_ruleset, other_iptables_rules, other_nft_ruleset, run_in};
use proxy_test_support::sandbox::{Netns, command_in};
use support::{agent_bin, require_root};

const WEB: ServicePort = ServicePort {
    namespace: "default",
    name: "web",
    port_name: "http",
    proto: "tcp",
    cluster_ip: "10.96.0.10",
    port: 80,
    node_port: Some(30080),
    external_ips: &["192.0.2.10"],
    load_balancer_ips: &["198.51.100.7"],
    endpoints: &[("10.244.1.10", 8080), ("10.244.2.10", 8080)],
};

const DNS: ServicePort = ServicePort {
    namespace: "kube-system",
    name: "kube-dns",
    port_name: "dns",
    proto: "udp",
    cluster_ip: "10.96.0.53",
    port: 53,
    node_port: None,
    external_ips: &[],
    load_balancer_ips: &[],
    endpoints: &[("10.244.1.11", 53)],
};

/// A Service without endpoints: kube-proxy's REJECT rules in filter.
const EMPTY: ServicePort = ServicePort {
    namespace: "default",
    name: "empty",
    port_name: "http",
    proto: "tcp",
    cluster_ip: "10.96.0.99",
    port: 80,
    node_port: Some(30099),
    external_ips: &[],
    load_balancer_ips: &[],
    endpoints: &[],
};

const WEB6: ServicePort = ServicePort {
    namespace: "default",
    name: "web",
    port_name: "http",
    proto: "tcp",
    cluster_ip: "fd00:96::10",
    port: 80,
    node_port: Some(30080),
    external_ips: &[],
    load_balancer_ips: &[],
    endpoints: &[("fd00:244:1::10", 8080)],
};

/// `proxy-agent cleanup-kube-proxy ARGS` inside `ns`: (success, stdout).
fn cleanup(ns: &Netns, args: &[&str]) -> (bool, String) {
    cleanup_with_path(ns, args, None)
}

fn cleanup_with_path(ns: &Netns, args: &[&str], path: Option<&str>) -> (bool, String) {
    let mut cmd = command_in(agent_bin(), Some(ns), None).expect("command");
    cmd.arg("cleanup-kube-proxy").args(args).stdin(Stdio::null()).stderr(Stdio::inherit());
    if let Some(p) = path {
        cmd.env("PATH", p);
    }
    let out = cmd.output().expect("run cleanup-kube-proxy");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    println!("--- cleanup-kube-proxy {args:?} ---\n{stdout}");
    (out.status.success(), stdout)
}

/// The summary's count after `label` ("removed", "would remove").
fn summary_count(out: &str, label: &str) -> usize {
    let line = out.lines().find(|l| l.starts_with("summary: ")).unwrap_or_else(|| panic!("no summary in {out}"));
    line.split(&format!("{label} "))
        .nth(1)
        .and_then(|r| r.split(',').next())
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("{line}"))
}

/// Every `:chain` and `-A` line of `iptables-save`, without the dump's
/// dated comments.
fn state(ns: &Netns, save: &str) -> BTreeSet<String> {
    run_in(ns, save, &[], None)
        .expect(save)
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| if l.starts_with(':') { l.split(" [").next().unwrap_or(l).to_string() } else { l.to_string() })
        .collect()
}

fn load(ns: &Netns, restore: &str, text: &str) {
    run_in(ns, restore, &["--noflush"], Some(text)).unwrap_or_else(|e| panic!("{restore}: {e}\n{text}"));
}

/// Whether an iptables-save line is kube-proxy's: a jump carrying one of
/// its comments into a KUBE- chain, a declaration or a rule of one of its
/// chains (kubelet's KUBE-FIREWALL and KUBE-KUBELET-CANARY are not).
fn is_kube_proxys(line: &str) -> bool {
    let kubelet = ["KUBE-FIREWALL", "KUBE-KUBELET-CANARY"];
    let chain = line.trim_start_matches(':').trim_start_matches("-A ").split_whitespace().next().unwrap_or_default();
    if chain.starts_with("KUBE-") {
        return !kubelet.contains(&chain);
    }
    line.contains("--comment \"kubernetes") && line.contains("-j KUBE-")
}

#[test]
fn only_kube_proxys_iptables_rules_go_from_both_backends_and_families() {
    require_root();
    let ns = Netns::new("tkc").expect("netns");
    let loads = [
        ("iptables-legacy-save", "iptables-legacy-restore", iptables_ruleset(&[WEB, DNS, EMPTY], false), other_iptables_rules(false)),
        ("iptables-nft-save", "iptables-nft-restore", iptables_ruleset(&[WEB, DNS, EMPTY], false), other_iptables_rules(false)),
        ("ip6tables-legacy-save", "ip6tables-legacy-restore", iptables_ruleset(&[WEB6], true), other_iptables_rules(true)),
        ("ip6tables-nft-save", "ip6tables-nft-restore", iptables_ruleset(&[WEB6], true), other_iptables_rules(true)),
    ];
    for (_, restore, kube, other) in &loads {
        load(&ns, restore, other);
        load(&ns, restore, kube);
    }
    let before: Vec<BTreeSet<String>> = loads.iter().map(|(save, ..)| state(&ns, save)).collect();
    for (b, (save, ..)) in before.iter().zip(&loads) {
        assert!(b.iter().any(|l| l.contains("KUBE-SVC-")), "{save}: ruleset not loaded: {b:#?}");
    }

    // --dry-run: everything is listed, nothing changes.
    let (ok, out) = cleanup(&ns, &["--dry-run"]);
    assert!(ok, "{out}");
    assert!(out.contains("iptables-legacy nat: would remove chain KUBE-SERVICES"), "{out}");
    assert!(
        out.contains(
            "ip6tables-nft filter: would remove rule -A FORWARD -m comment --comment \"kubernetes forwarding rules\" -j KUBE-FORWARD"
        ),
        "{out}"
    );
    assert!(out.contains("iptables-nft filter: left alone chain KUBE-FIREWALL: kubelet's chain"), "{out}");
    let planned = summary_count(&out, "would remove");
    assert!(planned > 40, "{out}");
    for (b, (save, ..)) in before.iter().zip(&loads) {
        assert_eq!(&state(&ns, save), b, "{save}: --dry-run changed something");
    }

    // The clean-up: exactly kube-proxy's lines disappear, in every backend
    // and family.
    let (ok, out) = cleanup(&ns, &[]);
    assert!(ok, "{out}");
    assert_eq!(summary_count(&out, "removed"), planned, "{out}");
    for (b, (save, ..)) in before.iter().zip(&loads) {
        let after = state(&ns, save);
        let want: BTreeSet<String> = b.iter().filter(|l| !is_kube_proxys(l)).cloned().collect();
        assert_eq!(after, want, "{save}: removed {:#?}", b.difference(&after).collect::<Vec<_>>());
        assert!(after.iter().any(|l| l.contains("CNI-MASQ")) && after.iter().any(|l| l.contains(":KUBE-FIREWALL")), "{save}: {after:#?}");
        assert!(after.iter().any(|l| l.contains("not from kube-proxy")), "{save}: a look-alike rule went: {after:#?}");
    }

    // Again: nothing left to do, nothing changes.
    let after: Vec<BTreeSet<String>> = loads.iter().map(|(save, ..)| state(&ns, save)).collect();
    let (ok, out) = cleanup(&ns, &[]);
    assert!(ok, "{out}");
    assert_eq!(summary_count(&out, "removed"), 0, "{out}");
    for (a, (save, ..)) in after.iter().zip(&loads) {
        assert_eq!(&state(&ns, save), a, "{save}: a second run changed something");
    }
}

#[test]
fn a_chain_another_rule_still_jumps_to_stays_with_everything_it_uses() {
    require_root();
    let ns = Netns::new("tkc").expect("netns");
    load(&ns, "iptables-nft-restore", &iptables_ruleset(&[WEB], false));
    // Someone else's rule into kube-proxy's chain: deleting KUBE-SERVICES
    // would fail, flushing it would change what that rule does.
    load(&ns, "iptables-nft-restore", "*nat\n-A OUTPUT -d 10.0.0.0/8 -j KUBE-SERVICES\nCOMMIT\n");
    let (ok, out) = cleanup(&ns, &[]);
    assert!(ok, "{out}");
    assert!(out.contains("iptables-nft nat: left alone chain KUBE-SERVICES: a rule cleanup does not recognise jumps to it: -A OUTPUT -d 10.0.0.0/8 -j KUBE-SERVICES"), "{out}");
    assert!(out.contains("iptables-nft nat: removed chain KUBE-POSTROUTING"), "{out}");
    let after = state(&ns, "iptables-nft-save");
    for kept in [":KUBE-SERVICES", ":KUBE-NODEPORTS", ":KUBE-MARK-MASQ", "-A OUTPUT -d 10.0.0.0/8 -j KUBE-SERVICES"] {
        assert!(after.iter().any(|l| l.starts_with(kept)), "{kept} is gone: {after:#?}");
    }
    assert!(after.iter().any(|l| l.starts_with(":KUBE-SVC-")) && after.iter().any(|l| l.starts_with(":KUBE-SEP-")), "{after:#?}");
    assert!(!after.iter().any(|l| l.starts_with(":KUBE-POSTROUTING") || l.contains("kubernetes service portals")), "{after:#?}");
    // The chain the user's rule uses still works as before: its rules stand.
    assert!(after.iter().any(|l| l.contains("-j DNAT --to-destination 10.244.1.10:8080")), "{after:#?}");
}

#[test]
fn only_the_kube_proxy_nftables_tables_go() {
    require_root();
    let ns = Netns::new("tkc").expect("netns");
    run_in(&ns, "nft", &["-f", "-"], Some(&nft_ruleset(&[WEB, DNS]))).expect("kube-proxy's tables");
    run_in(&ns, "nft", &["-f", "-"], Some(&other_nft_ruleset())).expect("another table");
    // Same name, a family kube-proxy never uses: not its.
    run_in(&ns, "nft", &["add", "table", "inet", "kube-proxy"], None).expect("inet kube-proxy");
    load(&ns, "iptables-nft-restore", &other_iptables_rules(false));
    let tables = || run_in(&ns, "nft", &["list", "tables"], None).expect("nft list tables");
    let before = tables();
    assert!(before.contains("table ip kube-proxy") && before.contains("table ip6 kube-proxy"), "{before}");

    let (ok, out) = cleanup(&ns, &["--dry-run"]);
    assert!(ok, "{out}");
    assert!(
        out.contains("nftables: would remove table ip kube-proxy") && out.contains("nftables: would remove table ip6 kube-proxy"),
        "{out}"
    );
    assert!(out.contains("nftables: left alone table inet kube-proxy"), "{out}");
    assert_eq!(tables(), before);

    // As the chart's init step runs it: the node's tools, from its root
    // filesystem (here the test's own root), each chrooted there.
    let (ok, out) = cleanup(&ns, &["--host-root", "/"]);
    assert!(ok, "{out}");
    assert!(out.contains("nftables: removed table ip kube-proxy") && out.contains("nftables: removed table ip6 kube-proxy"), "{out}");
    let after = tables();
    let want: Vec<&str> = before.lines().filter(|l| *l != "table ip kube-proxy" && *l != "table ip6 kube-proxy").collect();
    assert_eq!(after.lines().collect::<Vec<_>>(), want, "{after}");
    assert!(after.contains("table inet host-firewall") && after.contains("table ip nat"), "{after}");

    let (ok, out) = cleanup(&ns, &[]);
    assert!(ok, "{out}");
    assert_eq!(summary_count(&out, "removed"), 0, "{out}");
    assert_eq!(tables(), after);
}

#[test]
fn ipvs_mode_leftovers_without_ipvs_in_the_kernel() {
    require_root();
    let ns = Netns::new("tkc").expect("netns");
    // IPVS mode's chains and jumps (pkg/proxy/ipvs/proxier.go), without the
    // `-m set` matches, which this kernel lacks (no xt_set).
    let ipvs_mode = "*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-POSTROUTING - [0:0]\n:KUBE-NODE-PORT - [0:0]\n:KUBE-LOAD-BALANCER - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n\
        -A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
        -A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
        -A POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING\n\
        -A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000\n-A KUBE-SERVICES -m addrtype --dst-type LOCAL -j KUBE-NODE-PORT\nCOMMIT\n\
        *filter\n:KUBE-FORWARD - [0:0]\n:KUBE-NODE-PORT - [0:0]\n:KUBE-PROXY-FIREWALL - [0:0]\n:KUBE-SOURCE-RANGES-FIREWALL - [0:0]\n:KUBE-IPVS-FILTER - [0:0]\n:KUBE-IPVS-OUT-FILTER - [0:0]\n\
        -A FORWARD -m comment --comment \"kubernetes forwarding rules\" -j KUBE-FORWARD\n\
        -A INPUT -m comment --comment \"kubernetes health check rules\" -j KUBE-NODE-PORT\n\
        -A INPUT -m comment --comment \"kube-proxy firewall rules\" -j KUBE-PROXY-FIREWALL\n\
        -A FORWARD -m comment --comment \"kube-proxy firewall rules\" -j KUBE-PROXY-FIREWALL\n\
        -A INPUT -m comment --comment \"kubernetes ipvs access filter\" -j KUBE-IPVS-FILTER\n\
        -A OUTPUT -m comment --comment \"kubernetes ipvs access filter\" -j KUBE-IPVS-OUT-FILTER\n\
        -A KUBE-PROXY-FIREWALL -j KUBE-SOURCE-RANGES-FIREWALL\nCOMMIT\n";
    load(&ns, "iptables-nft-restore", ipvs_mode);
    for (name, ty) in [
        ("KUBE-CLUSTER-IP", "hash:ip,port"),
        ("KUBE-LOOP-BACK", "hash:ip,port,ip"),
        ("KUBE-NODE-PORT-TCP", "bitmap:port range 0-65535"),
        ("KUBE-HEALTH-CHECK-NODE-PORT", "bitmap:port range 0-65535"),
        ("KUBE-6-CLUSTER-IP", "hash:ip,port family inet6"),
        ("KUBE-ROUTER-PODS", "hash:ip"),
        ("my-set", "hash:net"),
    ] {
        let mut args = vec!["create", name];
        args.extend(ty.split_whitespace());
        run_in(&ns, "ipset", &args, None).unwrap_or_else(|e| panic!("ipset {args:?}: {e}"));
    }
    // The kernel here has no dummy devices; a bridge under the name shows
    // that only kube-proxy's kind of device would be deleted.
    ns.ip(&["link", "add", "kube-ipvs0", "type", "bridge"]).expect("bridge");
    let sets = || {
        let mut v: Vec<String> = run_in(&ns, "ipset", &["list", "-n"], None).expect("ipset list").lines().map(str::to_string).collect();
        v.sort();
        v
    };

    let (ok, out) = cleanup(&ns, &[]);
    assert!(ok, "{out}");
    assert!(out.contains("IPVS: not in this kernel (no /proc/net/ip_vs)"), "{out}");
    assert!(out.contains("kube-ipvs0: left alone the device: it is a bridge device"), "{out}");
    for set in ["KUBE-CLUSTER-IP", "KUBE-LOOP-BACK", "KUBE-NODE-PORT-TCP", "KUBE-HEALTH-CHECK-NODE-PORT", "KUBE-6-CLUSTER-IP"] {
        assert!(out.contains(&format!("ipset: removed set {set}")), "{set}: {out}");
    }
    assert!(out.contains("ipset: left alone set KUBE-ROUTER-PODS: not a set kube-proxy creates"), "{out}");
    assert_eq!(sets(), ["KUBE-ROUTER-PODS", "my-set"]);
    let after = state(&ns, "iptables-nft-save");
    assert!(!after.iter().any(|l| l.contains("KUBE-")), "{after:#?}");
    assert!(ns.ip(&["link", "show", "kube-ipvs0"]).is_ok(), "the bridge named kube-ipvs0 must stay");

    let (ok, out) = cleanup(&ns, &[]);
    assert!(ok, "{out}");
    assert_eq!(summary_count(&out, "removed"), 0, "{out}");
}

#[test]
fn without_the_tools_every_part_says_so_and_nothing_fails() {
    require_root();
    let ns = Netns::new("tkc").expect("netns");
    let (ok, out) = cleanup_with_path(&ns, &[], Some("/nonexistent"));
    assert!(ok, "{out}");
    for tool in ["iptables-legacy-save", "ip6tables-nft-save", "nft", "ipset", "ip"] {
        assert!(out.contains(&format!("no {tool} in PATH")), "{tool}: {out}");
    }
    assert_eq!(summary_count(&out, "removed"), 0, "{out}");
}
