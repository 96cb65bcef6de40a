//! kube-proxy's state as it writes it, for the tests of the move from
//! kube-proxy to the agent: complete rulesets of its iptables mode (nat,
//! filter and mangle tables, the jumps from the built-in chains, kubelet's
//! chains beside them) and of its nftables mode (`table ip kube-proxy`), for
//! given Services, plus rules of other components that must survive a
//! clean-up. Loaded with the real `iptables-restore` / `nft` of either
//! backend into a namespace, never the host's.
//!
//! The shapes follow pkg/proxy/iptables/proxier.go and
//! pkg/proxy/nftables/proxier.go of Kubernetes 1.31+ (chain names, rule
//! order, comments, the masquerade mark 0x4000). Chain name hashes are made
//! here, not kube-proxy's sha256: only their form matters. The nftables
//! DNAT and dispatch rules carry `counter` statements (kube-proxy's do not)
//! so that a test can tell whether a packet ever reached them; iptables
//! counts every rule anyway.

use std::fmt::Write as _;
use std::io;
use std::process::{Command, Stdio};

use crate::sandbox::{Netns, command_in};

/// One Service port as kube-proxy sees it.
#[derive(Clone, Debug)]
pub struct ServicePort<'a> {
    pub namespace: &'a str,
    pub name: &'a str,
    pub port_name: &'a str,
    /// "tcp" or "udp".
    pub proto: &'a str,
    pub cluster_ip: &'a str,
    pub port: u16,
    pub node_port: Option<u16>,
    pub external_ips: &'a [&'a str],
    pub load_balancer_ips: &'a [&'a str],
    /// (address, port); empty: kube-proxy's REJECT rules instead.
    pub endpoints: &'a [(&'a str, u16)],
}

impl ServicePort<'_> {
    fn id(&self) -> String {
        format!("{}/{}:{}", self.namespace, self.name, self.port_name)
    }

    /// A 16-character base32 name part, as kube-proxy's chain hashes look.
    fn hash(&self, extra: &str) -> String {
        const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in format!("{}{}{extra}", self.id(), self.proto).bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
        (0..16).map(|i| ALPHABET[((h >> (i * 4)) & 31) as usize] as char).collect()
    }
}

/// The pod network kube-proxy's `--cluster-cidr` names (masquerade for
/// traffic from outside it).
pub const CLUSTER_CIDR: &str = "10.244.0.0/16";
/// The same for IPv6.
pub const CLUSTER_CIDR6: &str = "fd00:244::/48";

/// kube-proxy's iptables mode for `ports` (of one family: `v6` for
/// ip6tables), as input for `iptables-restore --noflush`: it adds its
/// chains and jumps without touching other rules, as kube-proxy does.
pub fn iptables_ruleset(ports: &[ServicePort], v6: bool) -> String {
    let (host, cidr, reject, localnet) = if v6 {
        ("128", CLUSTER_CIDR6, "icmp6-port-unreachable", "::1/128")
    } else {
        ("32", CLUSTER_CIDR, "icmp-port-unreachable", "127.0.0.0/8")
    };
    let mut s = String::new();
    s.push_str("*mangle\n:KUBE-KUBELET-CANARY - [0:0]\n:KUBE-PROXY-CANARY - [0:0]\nCOMMIT\n");

    s.push_str("*filter\n");
    for c in [
        "KUBE-FIREWALL",
        "KUBE-KUBELET-CANARY",
        "KUBE-EXTERNAL-SERVICES",
        "KUBE-FORWARD",
        "KUBE-NODEPORTS",
        "KUBE-PROXY-CANARY",
        "KUBE-PROXY-FIREWALL",
        "KUBE-SERVICES",
    ] {
        let _ = writeln!(s, ":{c} - [0:0]");
    }
    for (chain, ct, comment, target) in [
        ("INPUT", true, "kubernetes load balancer firewall", "KUBE-PROXY-FIREWALL"),
        ("INPUT", false, "kubernetes health check service ports", "KUBE-NODEPORTS"),
        ("INPUT", true, "kubernetes externally-visible service portals", "KUBE-EXTERNAL-SERVICES"),
        ("FORWARD", true, "kubernetes load balancer firewall", "KUBE-PROXY-FIREWALL"),
        ("FORWARD", false, "kubernetes forwarding rules", "KUBE-FORWARD"),
        ("FORWARD", true, "kubernetes service portals", "KUBE-SERVICES"),
        ("FORWARD", true, "kubernetes externally-visible service portals", "KUBE-EXTERNAL-SERVICES"),
        ("OUTPUT", true, "kubernetes load balancer firewall", "KUBE-PROXY-FIREWALL"),
        ("OUTPUT", true, "kubernetes service portals", "KUBE-SERVICES"),
    ] {
        let ct = if ct { "-m conntrack --ctstate NEW " } else { "" };
        let _ = writeln!(s, "-A {chain} {ct}-m comment --comment \"{comment}\" -j {target}");
    }
    // kubelet's (pkg/kubelet/kubelet_network_linux.go).
    s.push_str("-A INPUT -j KUBE-FIREWALL\n-A OUTPUT -j KUBE-FIREWALL\n");
    let _ = writeln!(
        s,
        "-A KUBE-FIREWALL ! -s {localnet} -d {localnet} -m comment --comment \"block incoming localnet connections\" -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP"
    );
    s.push_str("-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP\n");
    s.push_str("-A KUBE-FORWARD -m comment --comment \"kubernetes forwarding rules\" -m mark --mark 0x4000/0x4000 -j ACCEPT\n");
    s.push_str(
        "-A KUBE-FORWARD -m comment --comment \"kubernetes forwarding conntrack rule\" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT\n",
    );
    for p in ports.iter().filter(|p| p.endpoints.is_empty()) {
        let (id, proto) = (p.id(), p.proto);
        let _ = writeln!(
            s,
            "-A KUBE-SERVICES -d {}/{host} -p {proto} -m comment --comment \"{id} has no endpoints\" -m {proto} --dport {} -j REJECT --reject-with {reject}",
            p.cluster_ip, p.port
        );
        if let Some(np) = p.node_port {
            let _ = writeln!(
                s,
                "-A KUBE-EXTERNAL-SERVICES -p {proto} -m comment --comment \"{id} has no endpoints\" -m addrtype --dst-type LOCAL -m {proto} --dport {np} -j REJECT --reject-with {reject}"
            );
        }
    }
    s.push_str("COMMIT\n");

    s.push_str("*nat\n");
    let mut chains = vec![
        "KUBE-KUBELET-CANARY".to_string(),
        "KUBE-MARK-MASQ".into(),
        "KUBE-NODEPORTS".into(),
        "KUBE-POSTROUTING".into(),
        "KUBE-PROXY-CANARY".into(),
        "KUBE-SERVICES".into(),
    ];
    for p in ports.iter().filter(|p| !p.endpoints.is_empty()) {
        chains.push(format!("KUBE-SVC-{}", p.hash("")));
        if p.node_port.is_some() || !p.external_ips.is_empty() || !p.load_balancer_ips.is_empty() {
            chains.push(format!("KUBE-EXT-{}", p.hash("")));
        }
        for (ip, port) in p.endpoints {
            chains.push(format!("KUBE-SEP-{}", p.hash(&format!("{ip}:{port}"))));
        }
    }
    for c in &chains {
        let _ = writeln!(s, ":{c} - [0:0]");
    }
    s.push_str("-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n");
    s.push_str("-A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n");
    s.push_str("-A POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING\n");
    s.push_str("-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000\n");
    s.push_str("-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN\n");
    s.push_str("-A KUBE-POSTROUTING -j MARK --set-xmark 0x4000/0x0\n");
    s.push_str("-A KUBE-POSTROUTING -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE --random-fully\n");
    for p in ports.iter().filter(|p| !p.endpoints.is_empty()) {
        let (id, proto, h) = (p.id(), p.proto, p.hash(""));
        let svc = format!("KUBE-SVC-{h}");
        let ext = format!("KUBE-EXT-{h}");
        let _ = writeln!(
            s,
            "-A KUBE-SERVICES -d {}/{host} -p {proto} -m comment --comment \"{id} cluster IP\" -m {proto} --dport {} -j {svc}",
            p.cluster_ip, p.port
        );
        for ip in p.external_ips {
            let _ = writeln!(
                s,
                "-A KUBE-SERVICES -d {ip}/{host} -p {proto} -m comment --comment \"{id} external IP\" -m {proto} --dport {} -j {ext}",
                p.port
            );
        }
        for ip in p.load_balancer_ips {
            let _ = writeln!(
                s,
                "-A KUBE-SERVICES -d {ip}/{host} -p {proto} -m comment --comment \"{id} loadbalancer IP\" -m {proto} --dport {} -j {ext}",
                p.port
            );
        }
        if let Some(np) = p.node_port {
            let _ = writeln!(s, "-A KUBE-NODEPORTS -p {proto} -m comment --comment \"{id}\" -m {proto} --dport {np} -j {ext}");
        }
        if p.node_port.is_some() || !p.external_ips.is_empty() || !p.load_balancer_ips.is_empty() {
            let _ = writeln!(s, "-A {ext} -m comment --comment \"masquerade traffic for {id} external destinations\" -j KUBE-MARK-MASQ");
            let _ = writeln!(s, "-A {ext} -j {svc}");
        }
        let _ = writeln!(
            s,
            "-A {svc} ! -s {cidr} -d {}/{host} -p {proto} -m comment --comment \"{id} cluster IP\" -m {proto} --dport {} -j KUBE-MARK-MASQ",
            p.cluster_ip, p.port
        );
        let n = p.endpoints.len();
        for (i, (ip, port)) in p.endpoints.iter().enumerate() {
            let sep = format!("KUBE-SEP-{}", p.hash(&format!("{ip}:{port}")));
            let stat =
                if i + 1 < n { format!(" -m statistic --mode random --probability {:.11}", 1.0 / (n - i) as f64) } else { String::new() };
            let _ = writeln!(s, "-A {svc} -m comment --comment \"{id} -> {ip}:{port}\"{stat} -j {sep}");
            let _ = writeln!(s, "-A {sep} -s {ip}/{host} -m comment --comment \"{id}\" -j KUBE-MARK-MASQ");
            let to = if v6 { format!("[{ip}]:{port}") } else { format!("{ip}:{port}") };
            let _ = writeln!(s, "-A {sep} -p {proto} -m comment --comment \"{id}\" -m {proto} -j DNAT --to-destination {to}");
        }
    }
    s.push_str("-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS\n");
    s.push_str("COMMIT\n");
    s
}

/// kube-proxy's nftables mode for the IPv4 `ports`, as input for `nft -f`.
pub fn nft_ruleset(ports: &[ServicePort]) -> String {
    let mut s = String::from("table ip kube-proxy {\n  comment \"rules for kube-proxy\"\n");
    s.push_str("  chain nat-prerouting {\n    type nat hook prerouting priority dstnat; policy accept;\n    jump services\n  }\n");
    s.push_str("  chain nat-output {\n    type nat hook output priority -100; policy accept;\n    jump services\n  }\n");
    s.push_str("  chain nat-postrouting {\n    type nat hook postrouting priority srcnat; policy accept;\n    jump masquerading\n  }\n");
    s.push_str("  chain mark-for-masquerade {\n    meta mark set meta mark | 0x00004000\n  }\n");
    s.push_str("  chain masquerading {\n    meta mark & 0x00004000 == 0x00000000 return\n    meta mark set meta mark ^ 0x00004000\n    masquerade fully-random\n  }\n");
    let mut service_ips = Vec::new();
    let mut node_ports = Vec::new();
    for p in ports.iter().filter(|p| !p.endpoints.is_empty()) {
        let (proto, h) = (p.proto, p.hash(""));
        let base = format!("{h}-{}-{}-{proto}-{}", p.namespace, p.name, p.port_name);
        let svc = format!("service-{base}");
        let ext = format!("external-{base}");
        service_ips.push(format!("{} . {proto} . {} : goto {svc}", p.cluster_ip, p.port));
        for ip in p.external_ips.iter().chain(p.load_balancer_ips) {
            service_ips.push(format!("{ip} . {proto} . {} : goto {ext}", p.port));
        }
        if let Some(np) = p.node_port {
            node_ports.push(format!("{proto} . {np} : goto {ext}"));
        }
        let mut vmap = Vec::new();
        for (i, (ip, port)) in p.endpoints.iter().enumerate() {
            let ep = format!("endpoint-{}-{}-{}-{proto}-{}__{ip}-{port}", p.hash(ip), p.namespace, p.name, p.port_name);
            let _ = writeln!(
                s,
                "  chain {ep} {{\n    ip saddr {ip} jump mark-for-masquerade\n    meta l4proto {proto} counter dnat to {ip}:{port}\n  }}"
            );
            vmap.push(format!("{i} : goto {ep}"));
        }
        let _ = writeln!(
            s,
            "  chain {svc} {{\n    ip daddr {} {proto} dport {} ip saddr != {CLUSTER_CIDR} jump mark-for-masquerade\n    numgen random mod {} vmap {{ {} }}\n  }}",
            p.cluster_ip,
            p.port,
            vmap.len(),
            vmap.join(", ")
        );
        let _ = writeln!(s, "  chain {ext} {{\n    jump mark-for-masquerade\n    goto {svc}\n  }}");
    }
    s.push_str("  map service-ips {\n    type ipv4_addr . inet_proto . inet_service : verdict\n");
    if !service_ips.is_empty() {
        let _ = writeln!(s, "    elements = {{ {} }}", service_ips.join(", "));
    }
    s.push_str("  }\n  map service-nodeports {\n    type inet_proto . inet_service : verdict\n");
    if !node_ports.is_empty() {
        let _ = writeln!(s, "    elements = {{ {} }}", node_ports.join(", "));
    }
    s.push_str("  }\n");
    s.push_str(
        "  chain services {\n    ip daddr . meta l4proto . th dport vmap @service-ips\n    fib daddr type local ip daddr != 127.0.0.0/8 counter meta l4proto . th dport vmap @service-nodeports\n  }\n",
    );
    s.push_str("}\ntable ip6 kube-proxy {\n  comment \"rules for kube-proxy\"\n}\n");
    s
}

/// Rules of other components (a host firewall, a CNI's masquerading, a
/// user table) for `iptables-restore --noflush` of either family; a
/// clean-up must leave every one of them.
pub fn other_iptables_rules(v6: bool) -> String {
    let (net, pods) = if v6 { ("2001:db8::/32", CLUSTER_CIDR6) } else { ("192.0.2.0/24", CLUSTER_CIDR) };
    format!(
        "*filter\n:HOST-FW - [0:0]\n-A INPUT -j HOST-FW\n-A HOST-FW -s {net} -p tcp -m tcp --dport 22 -j ACCEPT\n\
         -A FORWARD -m comment --comment \"kubernetes-like, not from kube-proxy\" -j ACCEPT\nCOMMIT\n\
         *nat\n:CNI-MASQ - [0:0]\n-A POSTROUTING -s {net} -j CNI-MASQ\n-A CNI-MASQ ! -d {pods} -j MASQUERADE\nCOMMIT\n\
         *mangle\n:MY-MARKS - [0:0]\n-A PREROUTING -j MY-MARKS\n-A MY-MARKS -p udp -m udp --dport 4789 -j MARK --set-xmark 0x1/0x1\nCOMMIT\n"
    )
}

/// A table of another component for `nft -f`.
pub fn other_nft_ruleset() -> String {
    "table inet host-firewall {\n  chain input {\n    type filter hook input priority filter; policy accept;\n    tcp dport 22 accept\n  }\n}\n".to_string()
}

/// Runs `program ARGS` inside `ns` with `input` on stdin; its stdout, or
/// an error with its stderr.
pub fn run_in(ns: &Netns, program: &str, args: &[&str], input: Option<&str>) -> io::Result<String> {
    use std::io::Write;
    let mut cmd: Command = command_in(program, Some(ns), None)?;
    cmd.args(args).stdin(if input.is_some() { Stdio::piped() } else { Stdio::null() }).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn()?;
    if let (Some(text), Some(mut stdin)) = (input, child.stdin.take()) {
        stdin.write_all(text.as_bytes())?;
    }
    let out = child.wait_with_output()?;
    if !out.status.success() {
        return Err(io::Error::other(format!(
            "{program} {args:?} in {}: {}: {}",
            ns.name(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Packet counters of the rules in `save` (`iptables-save -c` output)
/// whose text contains `needle`, with the rule text.
pub fn iptables_counters(save: &str, needle: &str) -> Vec<(u64, String)> {
    save.lines()
        .filter(|l| l.starts_with('[') && l.contains(needle))
        .filter_map(|l| {
            let (counters, rule) = l.split_once("] ")?;
            let packets = counters.trim_start_matches('[').split(':').next()?.parse().ok()?;
            Some((packets, rule.to_string()))
        })
        .collect()
}

/// Packet counts of the `counter` statements in `ruleset` (`nft list
/// ruleset` output) on lines containing `needle`, with the line.
pub fn nft_counters(ruleset: &str, needle: &str) -> Vec<(u64, String)> {
    ruleset
        .lines()
        .filter(|l| l.contains(needle) && l.contains("counter packets "))
        .filter_map(|l| {
            let n = l.split("counter packets ").nth(1)?.split_whitespace().next()?.parse().ok()?;
            Some((n, l.trim().to_string()))
        })
        .collect()
}

/// The entries of the namespace's netfilter conntrack table that carry a
/// NAT binding (the reply tuple is not the original one reversed), as
/// `/proc/net/nf_conntrack` lines.
pub fn nat_conntrack_entries(ns: &Netns) -> io::Result<Vec<String>> {
    let text = match run_in(ns, "cat", &["/proc/net/nf_conntrack"], None) {
        Ok(t) => t,
        // No conntrack user in the namespace yet: no table, no entries.
        Err(e) if e.to_string().contains("No such file") => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    Ok(text
        .lines()
        .filter(|l| {
            let get = |key: &str| l.split_whitespace().filter_map(|w| w.strip_prefix(key)).collect::<Vec<_>>();
            let (src, dst, sport, dport) = (get("src="), get("dst="), get("sport="), get("dport="));
            src.len() == 2
                && dst.len() == 2
                && (src[1] != dst[0]
                    || dst[1] != src[0]
                    || (sport.len() == 2 && dport.len() == 2 && (sport[1] != dport[0] || dport[1] != sport[0])))
        })
        .map(str::to_string)
        .collect())
}
