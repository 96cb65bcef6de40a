//! kube-proxy-shaped rulesets for the same synthetic Services, so the
//! benchmark compares like with like.
//!
//! iptables: OUTPUT -> KUBE-SERVICES (one rule per Service, matched in
//! order) -> KUBE-SVC-* (statistic --mode random, probability 1/n, 1/(n-1),
//! ..., as pkg/proxy/iptables/proxier.go writes them) -> KUBE-SEP-* (DNAT).
//! nftables: a verdict map keyed by address . protocol . port, then a
//! per-Service chain with `numgen random mod n vmap`, as
//! pkg/proxy/nftables/proxier.go does.
//! Endpoint chains are shared between Services (every Service's endpoints
//! are the same ten listeners); the per-Service part, which is what grows
//! with the Service count, is complete.

use std::fmt::Write as _;
use std::net::Ipv4Addr;

pub(crate) const ENDPOINTS: usize = 10;

/// The i-th Service address in a range starting at `base`.
pub(crate) fn service_ip(base: Ipv4Addr, i: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(base) + 1 + i as u32)
}

pub(crate) fn endpoint_ip(j: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 244, 100, 1 + j as u8)
}

pub(crate) const ENDPOINT_PORT: u16 = 8080;

pub(crate) fn iptables_restore(base: Ipv4Addr, services: usize, proto: &str) -> String {
    let mut s = String::with_capacity(services * 1200);
    s.push_str("*nat\n:PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\n:KUBE-SERVICES - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n");
    for j in 0..ENDPOINTS {
        let _ = writeln!(s, ":KUBE-SEP-BENCH{j:02} - [0:0]");
    }
    for i in 0..services {
        let _ = writeln!(s, ":KUBE-SVC-{i:016X} - [0:0]");
    }
    s.push_str("-A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n");
    s.push_str("-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000\n");
    for j in 0..ENDPOINTS {
        let ep = endpoint_ip(j);
        let _ = writeln!(s, "-A KUBE-SEP-BENCH{j:02} -s {ep}/32 -m comment --comment \"bench/ep{j}\" -j KUBE-MARK-MASQ");
        let _ = writeln!(
            s,
            "-A KUBE-SEP-BENCH{j:02} -p {proto} -m comment --comment \"bench/ep{j}\" -m {proto} -j DNAT --to-destination {ep}:{ENDPOINT_PORT}"
        );
    }
    for i in 0..services {
        let ip = service_ip(base, i);
        let _ = writeln!(
            s,
            "-A KUBE-SERVICES -d {ip}/32 -p {proto} -m comment --comment \"bench/svc{i}:p cluster IP\" -m {proto} --dport 80 -j KUBE-SVC-{i:016X}"
        );
        for j in 0..ENDPOINTS {
            let left = ENDPOINTS - j;
            if left > 1 {
                let _ = writeln!(
                    s,
                    "-A KUBE-SVC-{i:016X} -m comment --comment \"bench/svc{i}:p -> ep{j}\" -m statistic --mode random --probability {:.11} -j KUBE-SEP-BENCH{j:02}",
                    1.0 / left as f64
                );
            } else {
                let _ = writeln!(s, "-A KUBE-SVC-{i:016X} -m comment --comment \"bench/svc{i}:p -> ep{j}\" -j KUBE-SEP-BENCH{j:02}");
            }
        }
    }
    s.push_str("COMMIT\n");
    s
}

pub(crate) fn nft_ruleset(base: Ipv4Addr, services: usize, proto: &str) -> String {
    let mut s = String::with_capacity(services * 200);
    s.push_str("table ip kube-proxy {\n");
    for j in 0..ENDPOINTS {
        let _ = writeln!(s, "  chain endpoint-{j} {{\n    meta l4proto {proto} dnat to {}:{ENDPOINT_PORT}\n  }}", endpoint_ip(j));
    }
    let vmap: Vec<String> = (0..ENDPOINTS).map(|j| format!("{j} : goto endpoint-{j}")).collect();
    let vmap = vmap.join(", ");
    for i in 0..services {
        let _ = writeln!(s, "  chain service-{i} {{\n    numgen random mod {ENDPOINTS} vmap {{ {vmap} }}\n  }}");
    }
    s.push_str("  map service-ips {\n    type ipv4_addr . inet_proto . inet_service : verdict\n    elements = {\n");
    for i in 0..services {
        let sep = if i + 1 == services { "" } else { "," };
        let _ = writeln!(s, "      {} . {proto} . 80 : goto service-{i}{sep}", service_ip(base, i));
    }
    s.push_str("    }\n  }\n");
    s.push_str("  chain services {\n    ip daddr . meta l4proto . th dport vmap @service-ips\n  }\n");
    s.push_str("  chain output {\n    type nat hook output priority -100; policy accept;\n    jump services\n  }\n}\n");
    s
}
