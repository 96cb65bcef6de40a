//! kube-proxy's IPVS-mode leftovers besides its iptables chains: virtual
//! servers, the `kube-ipvs0` dummy device its service addresses are bound
//! to, and its ipsets (pkg/proxy/ipvs/proxier.go `cleanupLeftovers`).
//!
//! kube-proxy's cleanup flushes every virtual server of the node. Here only
//! the ones kube-proxy makes are recognised: those on an address bound to
//! `kube-ipvs0` (ClusterIPs, externalIPs and load balancer IPs: IPVS mode
//! binds each of them there so that the node accepts the packets) and the
//! NodePort ones, on another address of the node with a port in the
//! cluster's NodePort range. Anything else (a fwmark service, a virtual
//! server on a foreign address) belongs to someone else and stays.
//!
//! `kube-ipvs0` is removed only when it is a dummy device, the kind
//! kube-proxy creates (`EnsureDummyDevice`; its `DeleteDummyDevice` refuses
//! a device of another kind the same way). ipsets are recognised by the
//! names kube-proxy gives them (`ipsetInfo`, IPv6 sets with `KUBE-6-`) and
//! are destroyed after the iptables rules that match on them are gone, since
//! the kernel refuses to destroy a set in use.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::ops::RangeInclusive;

use super::ParseError;

/// The dummy device IPVS mode binds service addresses to.
pub const DUMMY_DEVICE: &str = "kube-ipvs0";

/// The NodePort range a cluster has unless kube-apiserver's
/// `--service-node-port-range` says otherwise.
pub const DEFAULT_NODE_PORT_RANGE: RangeInclusive<u16> = 30000..=32767;

/// One virtual server of `ipvsadm-save -n`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VirtualServer {
    /// What `ipvsadm` names it by: `-t 10.96.0.1:443`, `-u [fd00::a]:53`,
    /// `--sctp-service ...`, `-f 7`.
    pub spec: String,
    /// Address and port; `None` for a fwmark service.
    pub addr: Option<(IpAddr, u16)>,
}

/// Parses `ipvsadm-save -n`: `-A` lines are virtual servers, `-a` lines
/// their real servers (which go with them).
pub fn parse_ipvsadm_save(text: &str) -> Result<Vec<VirtualServer>, ParseError> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            [] | ["-a", ..] => {}
            ["-A", "-f", mark, ..] => out.push(VirtualServer { spec: format!("-f {mark}"), addr: None }),
            ["-A", flag @ ("-t" | "-u" | "--sctp-service"), addr, ..] => {
                let parsed: std::net::SocketAddr = addr.parse().map_err(|e| ParseError::new(i + 1, format!("bad address: {e}"), line))?;
                out.push(VirtualServer { spec: format!("{flag} {addr}"), addr: Some((parsed.ip(), parsed.port())) });
            }
            _ => return Err(ParseError::new(i + 1, "not an ipvsadm-save line", line)),
        }
    }
    Ok(out)
}

/// Addresses of `ip -d -j addr show`: (device, device kind, address).
/// `kind` is empty for a device without one (a physical NIC).
pub fn parse_addresses(json: &str) -> Result<Vec<(String, String, Option<IpAddr>)>, ParseError> {
    let links: Vec<serde_json::Value> =
        serde_json::from_str(json).map_err(|e| ParseError::new(0, format!("not a JSON array: {e}"), json))?;
    let mut out = Vec::new();
    for l in &links {
        let Some(name) = l.get("ifname").and_then(serde_json::Value::as_str) else {
            return Err(ParseError::new(0, "a link without ifname", l.to_string()));
        };
        let kind = l.pointer("/linkinfo/info_kind").and_then(serde_json::Value::as_str).unwrap_or_default();
        let addrs: Vec<IpAddr> = l
            .get("addr_info")
            .and_then(serde_json::Value::as_array)
            .map(|a| a.iter().filter_map(|x| x.get("local")?.as_str()?.parse().ok()).collect())
            .unwrap_or_default();
        if addrs.is_empty() {
            out.push((name.to_string(), kind.to_string(), None));
        }
        out.extend(addrs.into_iter().map(|a| (name.to_string(), kind.to_string(), Some(a))));
    }
    Ok(out)
}

/// What happens to `kube-ipvs0`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Device {
    /// No such device: nothing to do.
    Absent,
    /// A dummy device of that name, which kube-proxy made: deleted.
    Remove,
    /// A device of that name of another kind, kept, and why.
    Keep(String),
}

/// The verdict on `kube-ipvs0` from the node's addresses.
pub fn dummy_device(addrs: &[(String, String, Option<IpAddr>)]) -> Device {
    match addrs.iter().find(|(n, _, _)| n == DUMMY_DEVICE) {
        None => Device::Absent,
        Some((_, kind, _)) if kind == "dummy" => Device::Remove,
        Some((_, kind, _)) => Device::Keep(format!(
            "it is a {} device, and kube-proxy only ever creates a dummy one under this name",
            if kind.is_empty() { "physical" } else { kind }
        )),
    }
}

/// The virtual servers to delete, and the others with why they stay.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// kube-proxy's virtual servers: on an address of `kube-ipvs0`, or on a node address at a port in the NodePort range.
    pub remove: Vec<VirtualServer>,
    /// The others, and why they stay.
    pub kept: Vec<(VirtualServer, String)>,
}

impl Plan {
    /// Input for `ipvsadm -R` (one ipvsadm command per line); deleting a
    /// virtual server deletes its real servers.
    pub fn script(&self) -> String {
        self.remove.iter().map(|v| format!("-D {}\n", v.spec)).collect()
    }
}

/// Which virtual servers are kube-proxy's, from the node's addresses (`(device, kind, address)`) and the NodePort range: only those it can have made go.
pub fn plan_virtual_servers(
    servers: &[VirtualServer],
    addrs: &[(String, String, Option<IpAddr>)],
    node_ports: &RangeInclusive<u16>,
) -> Plan {
    let on_dummy: BTreeSet<IpAddr> =
        addrs.iter().filter(|(n, k, _)| n == DUMMY_DEVICE && k == "dummy").filter_map(|(_, _, a)| *a).collect();
    let node: BTreeSet<IpAddr> = addrs.iter().filter(|(n, _, _)| n != DUMMY_DEVICE).filter_map(|(_, _, a)| *a).collect();
    let mut p = Plan::default();
    for v in servers {
        let verdict = match v.addr {
            None => Err("a fwmark service; kube-proxy makes none".to_string()),
            Some((ip, _)) if on_dummy.contains(&ip) => Ok(()),
            Some((ip, port)) if node.contains(&ip) && node_ports.contains(&port) => Ok(()),
            Some((ip, port)) if node.contains(&ip) => {
                Err(format!("port {port} is outside the NodePort range {}-{}", node_ports.start(), node_ports.end()))
            }
            Some((ip, _)) => Err(format!("{ip} is neither bound to {DUMMY_DEVICE} nor an address of this node")),
        };
        match verdict {
            Ok(()) => p.remove.push(v.clone()),
            Err(why) => p.kept.push((v.clone(), why)),
        }
    }
    p
}

/// Names of the ipsets kube-proxy's IPVS mode creates, without the `KUBE-`
/// (IPv4) or `KUBE-6-` (IPv6) prefix, current and older releases'.
const IPSET_NAMES: [&str; 23] = [
    "LOOP-BACK",
    "CLUSTER-IP",
    "EXTERNAL-IP",
    "EXTERNAL-IP-LOCAL",
    "LOAD-BALANCER",
    "LOAD-BALANCER-FW",
    "LOAD-BALANCER-LOCAL",
    "LOAD-BALANCER-SOURCE-IP",
    "LOAD-BALANCER-SOURCE-CIDR",
    "LOAD-BALANCER-MASQ",
    "NODE-PORT-TCP",
    "NODE-PORT-LOCAL-TCP",
    "NODE-PORT-UDP",
    "NODE-PORT-LOCAL-UDP",
    "NODE-PORT-SCTP",
    "NODE-PORT-LOCAL-SCTP",
    "NODE-PORT-SCTP-HASH",
    "NODE-PORT-LOCAL-SCTP-HASH",
    "HEALTH-CHECK-NODE-PORT",
    "IPVS-IPS",
    "MASQ-ALL",
    "CLUSTER-CIDR",
    "SERVICE-ACCESS",
];

/// Whether an ipset has a name kube-proxy's IPVS mode gives its sets (`KUBE-` or `KUBE-6-` and one of its set names).
pub fn is_kube_proxy_ipset(name: &str) -> bool {
    let rest = name.strip_prefix("KUBE-6-").or_else(|| name.strip_prefix("KUBE-"));
    rest.is_some_and(|r| IPSET_NAMES.contains(&r))
}

/// ipsets to destroy and those that stay: not kube-proxy's names, or still
/// matched by an iptables rule that stays (`in_use`).
pub fn plan_ipsets(names: &[String], in_use: &BTreeSet<String>) -> (Vec<String>, Vec<(String, String)>) {
    let mut remove = Vec::new();
    let mut kept = Vec::new();
    for n in names.iter().filter(|n| n.starts_with("KUBE-")) {
        if !is_kube_proxy_ipset(n) {
            kept.push((n.clone(), "not a set kube-proxy creates".to_string()));
        } else if in_use.contains(n) {
            kept.push((n.clone(), "an iptables rule that stays still matches on it".to_string()));
        } else {
            remove.push(n.clone());
        }
    }
    (remove, kept)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `ip -d -j addr show` of an IPVS-mode node (trimmed to the fields
    /// read): a NIC, the dummy with two service addresses, loopback.
    const ADDRS: &str = r#"[
      {"ifindex":1,"ifname":"lo","linkinfo":null,"addr_info":[{"family":"inet","local":"127.0.0.1","prefixlen":8}]},
      {"ifindex":2,"ifname":"eth0","addr_info":[{"family":"inet","local":"192.168.1.5","prefixlen":24},{"family":"inet6","local":"fe80::1","prefixlen":64}]},
      {"ifindex":3,"ifname":"kube-ipvs0","linkinfo":{"info_kind":"dummy"},"addr_info":[{"family":"inet","local":"10.96.0.1","prefixlen":32},{"family":"inet","local":"10.96.0.10","prefixlen":32}]},
      {"ifindex":4,"ifname":"cni0","linkinfo":{"info_kind":"bridge"},"addr_info":[]}
    ]"#;

    const SAVED: &str = "-A -t 10.96.0.1:443 -s rr\n-a -t 10.96.0.1:443 -r 192.168.1.5:6443 -m -w 1\n\
                         -A -u 10.96.0.10:53 -s rr\n-A -t 192.168.1.5:30080 -s rr\n-A -t 192.168.1.5:8080 -s rr\n\
                         -A -t 203.0.113.9:80 -s wlc\n-A -f 7 -s rr\n-A --sctp-service [fd00::5]:9000 -s rr\n";

    #[test]
    fn addresses_and_the_dummy_device() {
        let a = parse_addresses(ADDRS).expect("parse");
        assert_eq!(a.len(), 6, "{a:?}");
        assert!(a.contains(&("cni0".into(), "bridge".into(), None)));
        assert_eq!(dummy_device(&a), Device::Remove);
        let without: Vec<_> = a.iter().filter(|(n, _, _)| n != DUMMY_DEVICE).cloned().collect();
        assert_eq!(dummy_device(&without), Device::Absent);
        for kind in ["bridge", ""] {
            let other: Vec<_> =
                a.iter().map(|(n, k, x)| (n.clone(), if n == DUMMY_DEVICE { kind.to_string() } else { k.clone() }, *x)).collect();
            assert!(matches!(dummy_device(&other), Device::Keep(ref why) if why.contains("dummy")), "{kind}");
        }
        for bad in ["", "{}", r#"[{"ifindex":1}]"#] {
            assert!(parse_addresses(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn virtual_servers_of_kube_proxy_are_those_on_kube_ipvs0_and_node_ports() {
        let servers = parse_ipvsadm_save(SAVED).expect("parse");
        assert_eq!(servers.len(), 7);
        let a = parse_addresses(ADDRS).expect("addrs");
        let p = plan_virtual_servers(&servers, &a, &DEFAULT_NODE_PORT_RANGE);
        assert_eq!(
            p.remove.iter().map(|v| v.spec.as_str()).collect::<Vec<_>>(),
            ["-t 10.96.0.1:443", "-u 10.96.0.10:53", "-t 192.168.1.5:30080"]
        );
        let kept: Vec<(&str, &str)> = p.kept.iter().map(|(v, why)| (v.spec.as_str(), why.as_str())).collect();
        assert_eq!(kept.len(), 4);
        assert!(kept[0].0 == "-t 192.168.1.5:8080" && kept[0].1.contains("outside the NodePort range"), "{kept:?}");
        assert!(kept[1].1.contains("neither bound"), "{kept:?}");
        assert!(kept[2].1.contains("fwmark"), "{kept:?}");
        assert_eq!(p.script(), "-D -t 10.96.0.1:443\n-D -u 10.96.0.10:53\n-D -t 192.168.1.5:30080\n");
        // A kube-ipvs0 that is no dummy binds nothing of kube-proxy's.
        let bridge: Vec<_> =
            a.iter().map(|(n, k, x)| (n.clone(), if n == DUMMY_DEVICE { "bridge".into() } else { k.clone() }, *x)).collect();
        let p = plan_virtual_servers(&servers, &bridge, &DEFAULT_NODE_PORT_RANGE);
        assert_eq!(p.remove.iter().map(|v| v.spec.as_str()).collect::<Vec<_>>(), ["-t 192.168.1.5:30080"]);
        for bad in ["-A -t nowhere -s rr", "-X", "-A -t 10.0.0.1 -s rr"] {
            assert!(parse_ipvsadm_save(bad).is_err(), "{bad}");
        }
        assert!(parse_ipvsadm_save("").expect("empty").is_empty());
    }

    #[test]
    fn ipsets_by_name_unless_in_use() {
        for (name, want) in [
            ("KUBE-CLUSTER-IP", true),
            ("KUBE-6-CLUSTER-IP", true),
            ("KUBE-NODE-PORT-LOCAL-SCTP-HASH", true),
            ("KUBE-HEALTH-CHECK-NODE-PORT", true),
            ("KUBE-IPVS-IPS", true),
            ("KUBE-ROUTER-X", false),
            ("cali40all-ipam-pools", false),
            ("KUBE-", false),
            ("KUBE-6-", false),
        ] {
            assert_eq!(is_kube_proxy_ipset(name), want, "{name}");
        }
        let names: Vec<String> = ["KUBE-CLUSTER-IP", "KUBE-LOOP-BACK", "KUBE-DST-ABC", "my-set"].iter().map(ToString::to_string).collect();
        let in_use: BTreeSet<String> = ["KUBE-LOOP-BACK".to_string()].into();
        let (remove, kept) = plan_ipsets(&names, &in_use);
        assert_eq!(remove, ["KUBE-CLUSTER-IP"]);
        assert_eq!(kept.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(), ["KUBE-LOOP-BACK", "KUBE-DST-ABC"]);
    }
}
