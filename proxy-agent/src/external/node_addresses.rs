//! The node's addresses and devices as external traffic sees them: which
//! interfaces get the TC programs (`--devices`), which addresses NodePorts
//! are served on, and which address flows to remote backends are SNAT'ed
//! to. Read from the kernel with getifaddrs(3); everything after the read
//! is pure, so the agent can recompute it whenever the addresses change
//! (DHCP renewals, an address added to a node, a NIC hot-plugged) without a
//! restart.

use std::collections::BTreeSet;
use std::ffi::{CStr, CString};
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::Duration;

/// How often the agent re-reads the interface addresses. getifaddrs is one
/// netlink dump (microseconds on a node with a handful of interfaces), so a
/// short period costs nothing and an address change takes effect within
/// seconds.
pub const POLL_INTERVAL: Duration = Duration::from_secs(2);

/// Longest interface name the kernel accepts (IFNAMSIZ - 1, include/uapi/linux/if.h).
const MAX_IFNAME: usize = 15;

/// `--devices`: where the TC programs go.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Devices {
    /// Every interface that holds a node address (loopback excluded), as
    /// they come and go. The default.
    #[default]
    Auto,
    /// No TC program at all: NodePorts work only from the node itself,
    /// through the socket programs. For agents that share a network
    /// namespace with interfaces they must not touch (tests, demos, a
    /// laptop).
    None,
    /// Exactly these interfaces.
    List(Vec<String>),
}

/// A `--devices` value that cannot be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DevicesError {
    /// Nothing was given.
    #[error("no device named; give interface names (eth0,eth1), `auto` or `none`")]
    Empty,
    /// `auto` or `none` among interface names.
    #[error("`{word}` cannot be combined with interface names ({names}); give either `{word}` alone or a list of interfaces")]
    Mixed {
        /// `auto` or `none`.
        word: &'static str,
        /// The interface names given with it.
        names: String,
    },
    /// A name the kernel would refuse for an interface.
    #[error("{name:?} is not an interface name (at most 15 bytes, no '/', whitespace or ':')")]
    BadName {
        /// The name given.
        name: String,
    },
}

impl Devices {
    /// Parses the flag's value: `auto`, `none` or a comma-separated list of
    /// interface names. Empty items (a trailing comma) are ignored and
    /// duplicates dropped.
    pub fn parse(value: &str) -> Result<Devices, DevicesError> {
        let mut names: Vec<String> = Vec::new();
        for item in value.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            if !names.iter().any(|n| n == item) {
                names.push(item.to_string());
            }
        }
        for word in ["auto", "none"] {
            if names.iter().any(|n| n == word) {
                if names.len() == 1 {
                    return Ok(if word == "auto" { Devices::Auto } else { Devices::None });
                }
                let others: Vec<&str> = names.iter().map(String::as_str).filter(|n| *n != word).collect();
                return Err(DevicesError::Mixed { word, names: others.join(",") });
            }
        }
        if names.is_empty() {
            return Err(DevicesError::Empty);
        }
        // The kernel's dev_valid_name(): what cannot be an interface name
        // would only fail later, at attach time, with a less clear error.
        if let Some(bad) = names
            .iter()
            .find(|n| n.len() > MAX_IFNAME || *n == "." || *n == ".." || n.chars().any(|c| c == '/' || c == ':' || c.is_whitespace()))
        {
            return Err(DevicesError::BadName { name: bad.clone() });
        }
        Ok(Devices::List(names))
    }

    /// Whether the TC datapath is on.
    pub fn enabled(&self) -> bool {
        !matches!(self, Devices::None)
    }
}

/// One address of an interface.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct IfAddr {
    /// The interface.
    pub device: String,
    /// The address.
    pub ip: IpAddr,
}

/// Addresses usable as node addresses: not loopback, not IPv6 link-local
/// (a NodePort on fe80:: would need a zone), on interfaces that are up.
/// Sorted, so two reads compare equal when nothing changed.
pub fn interface_addresses() -> io::Result<Vec<IfAddr>> {
    let mut out = Vec::new();
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list we free below.
    if unsafe { libc::getifaddrs(&raw mut head) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: a node of the list returned by getifaddrs.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_flags & libc::IFF_UP as u32 == 0 || ifa.ifa_flags & libc::IFF_LOOPBACK as u32 != 0 {
            continue;
        }
        // SAFETY: ifa_name is a NUL-terminated string owned by the list.
        let device = unsafe { CStr::from_ptr(ifa.ifa_name) }.to_string_lossy().into_owned();
        // SAFETY: ifa_addr is non-null (checked above) and points to a
        // sockaddr of the family it names, owned by the list until
        // freeifaddrs (getifaddrs(3)). Read unaligned: the sockaddr header
        // promises only 2-byte alignment.
        let ip = unsafe {
            match i32::from((*ifa.ifa_addr).sa_family) {
                libc::AF_INET => {
                    let sin = std::ptr::read_unaligned(ifa.ifa_addr.cast::<libc::sockaddr_in>());
                    IpAddr::V4(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)))
                }
                libc::AF_INET6 => {
                    let sin6 = std::ptr::read_unaligned(ifa.ifa_addr.cast::<libc::sockaddr_in6>());
                    IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr))
                }
                _ => continue,
            }
        };
        if let IpAddr::V6(v6) = ip
            && (v6.segments()[0] & 0xffc0) == 0xfe80
        {
            continue;
        }
        out.push(IfAddr { device, ip });
    }
    // SAFETY: frees the list returned above.
    unsafe { libc::freeifaddrs(head) };
    out.sort();
    out.dedup();
    Ok(out)
}

/// The interface index of `device` in this network namespace, 0 when there
/// is no such device. A device that is deleted and created again under the
/// same name gets a new index, and its TC programs are gone with the old
/// one: comparing indexes tells the agent to attach again.
pub fn ifindex(device: &str) -> u32 {
    match CString::new(device) {
        // SAFETY: a NUL-terminated name; if_nametoindex only reads it.
        Ok(name) => unsafe { libc::if_nametoindex(name.as_ptr()) },
        Err(_) => 0,
    }
}

/// Devices that carry a default route in this network namespace, IPv4 or
/// IPv6. Read from /proc/net/route and /proc/net/ipv6_route, which show the
/// reading process's network namespace (proc(5)); an unreadable file counts
/// as no default route, which only loses the SNAT preference.
pub fn default_route_devices() -> Vec<String> {
    let read = |path: &str| std::fs::read_to_string(path).unwrap_or_default();
    let mut out: BTreeSet<String> = ipv4_default_route_devices(&read("/proc/net/route")).into_iter().collect();
    out.extend(ipv6_default_route_devices(&read("/proc/net/ipv6_route")));
    out.into_iter().collect()
}

/// `/proc/net/route`: a header line, then `Iface Destination Gateway Flags
/// RefCnt Use Metric Mask ...` with hex fields (net/ipv4/fib_trie.c,
/// fib_route_seq_show). A default route has destination and mask 0 and the
/// RTF_UP flag.
fn ipv4_default_route_devices(text: &str) -> Vec<String> {
    const RTF_UP: u32 = 0x1;
    text.lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let flags = u32::from_str_radix(f.get(3)?, 16).ok()?;
            (f.get(1)? == &"00000000" && f.get(7)? == &"00000000" && flags & RTF_UP != 0).then(|| f[0].to_string())
        })
        .collect()
}

/// `/proc/net/ipv6_route`: no header; `dest plen src splen nexthop metric
/// refcnt use flags device` (net/ipv6/route.c, ipv6_route_native_seq_show).
/// The kernel keeps unreachable `::/0` entries on `lo`, which are not a way
/// out and are skipped.
fn ipv6_default_route_devices(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let dev = *f.get(9)?;
            (f.first()?.bytes().all(|b| b == b'0') && f.get(1)? == &"00" && dev != "lo").then(|| dev.to_string())
        })
        .collect()
}

/// What external traffic uses, computed from the interface addresses.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Resolved {
    /// Interfaces that get the TC programs (sorted for `auto`, as given
    /// for a list, empty for `none`).
    pub devices: Vec<String>,
    /// Addresses NodePorts are served on.
    pub node_addrs: Vec<IpAddr>,
    /// SNAT source per family for flows to backends on other nodes.
    pub snat_v4: Option<Ipv4Addr>,
    /// The IPv6 SNAT source.
    pub snat_v6: Option<Ipv6Addr>,
}

/// Resolves `--devices` and `--node-ip` against the current addresses.
///
/// * devices: `auto` = every interface holding an address; a list as given.
/// * node addresses: those of the devices; with `none`, every address of
///   the namespace (NodePorts then still work from the node itself on each
///   of them); plus `--node-ip`.
/// * SNAT: `--node-ip` per family, else the first address of the first
///   device that has one of that family, trying the devices that carry a
///   default route (`default_route_devices`) first. Without that
///   preference a CNI bridge such as `cni0` (which holds the pod gateway
///   address and sorts before `eth0`) would become the source of every
///   flow to another node's backend.
pub fn resolve(addrs: &[IfAddr], devices: &Devices, node_ips: &[IpAddr], default_route_devices: &[String]) -> Resolved {
    let devices: Vec<String> = match devices {
        Devices::Auto => addrs.iter().map(|a| a.device.clone()).collect::<BTreeSet<_>>().into_iter().collect(),
        Devices::None => Vec::new(),
        Devices::List(l) => l.clone(),
    };
    let mut node_addrs: Vec<IpAddr> = addrs
        .iter()
        .filter(|a| devices.is_empty() || devices.contains(&a.device))
        .map(|a| a.ip)
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    for ip in node_ips {
        if !node_addrs.contains(ip) {
            node_addrs.push(*ip);
        }
    }
    let mut snat_v4 = node_ips.iter().find_map(|ip| match ip {
        IpAddr::V4(a) => Some(*a),
        IpAddr::V6(_) => None,
    });
    let mut snat_v6 = node_ips.iter().find_map(|ip| match ip {
        IpAddr::V6(a) => Some(*a),
        IpAddr::V4(_) => None,
    });
    let by_preference =
        devices.iter().filter(|d| default_route_devices.contains(d)).chain(devices.iter().filter(|d| !default_route_devices.contains(d)));
    for d in by_preference {
        for a in addrs.iter().filter(|a| &a.device == d) {
            match a.ip {
                IpAddr::V4(x) if snat_v4.is_none() => snat_v4 = Some(x),
                IpAddr::V6(x) if snat_v6.is_none() => snat_v6 = Some(x),
                _ => {}
            }
        }
    }
    Resolved { devices, node_addrs, snat_v4, snat_v6 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_flag_values() {
        let list = |l: &[&str]| Devices::List(l.iter().map(std::string::ToString::to_string).collect());
        let cases: &[(&str, Result<Devices, DevicesError>)] = &[
            ("auto", Ok(Devices::Auto)),
            (" auto ", Ok(Devices::Auto)),
            ("auto,", Ok(Devices::Auto)),
            ("none", Ok(Devices::None)),
            ("eth0", Ok(list(&["eth0"]))),
            ("eth0,bond0", Ok(list(&["eth0", "bond0"]))),
            ("eth0, eth0,,bond0", Ok(list(&["eth0", "bond0"]))),
            ("", Err(DevicesError::Empty)),
            (",", Err(DevicesError::Empty)),
            ("eth0,none", Err(DevicesError::Mixed { word: "none", names: "eth0".into() })),
            ("none,eth0,eth1", Err(DevicesError::Mixed { word: "none", names: "eth0,eth1".into() })),
            ("auto,eth0", Err(DevicesError::Mixed { word: "auto", names: "eth0".into() })),
            ("eth0/1", Err(DevicesError::BadName { name: "eth0/1".into() })),
            ("a-very-long-name0", Err(DevicesError::BadName { name: "a-very-long-name0".into() })),
            ("eth0:1", Err(DevicesError::BadName { name: "eth0:1".into() })),
        ];
        for (value, want) in cases {
            assert_eq!(&Devices::parse(value), want, "--devices {value:?}");
        }
        assert_eq!(Devices::default(), Devices::Auto);
        assert!(!Devices::None.enabled() && Devices::Auto.enabled());
    }

    #[test]
    fn the_none_error_says_what_to_do() {
        let e = Devices::parse("eth0,none").unwrap_err().to_string();
        assert!(e.contains("`none` cannot be combined with interface names (eth0)"), "{e}");
    }

    fn a(device: &str, ip: &str) -> IfAddr {
        IfAddr { device: device.into(), ip: ip.parse().expect("literal") }
    }

    fn ips(l: &[&str]) -> Vec<IpAddr> {
        l.iter().map(|s| s.parse().expect("literal")).collect()
    }

    #[test]
    fn resolving_devices_node_addresses_and_snat() {
        let addrs = [a("eth1", "10.0.2.5"), a("eth0", "10.0.1.5"), a("eth0", "fd00::5"), a("cni0", "10.244.0.1")];
        struct Case {
            what: &'static str,
            devices: Devices,
            node_ips: Vec<IpAddr>,
            default_routes: Vec<String>,
            want: Resolved,
        }
        let cases = [
            Case {
                what: "auto: every device with an address, sorted; SNAT from the first",
                devices: Devices::Auto,
                node_ips: vec![],
                default_routes: vec![],
                want: Resolved {
                    devices: vec!["cni0".into(), "eth0".into(), "eth1".into()],
                    node_addrs: ips(&["10.0.1.5", "10.0.2.5", "10.244.0.1", "fd00::5"]),
                    snat_v4: Some("10.244.0.1".parse().unwrap()),
                    snat_v6: Some("fd00::5".parse().unwrap()),
                },
            },
            Case {
                what: "auto: SNAT prefers the device with the default route over a CNI bridge",
                devices: Devices::Auto,
                node_ips: vec![],
                default_routes: vec!["eth1".into()],
                want: Resolved {
                    devices: vec!["cni0".into(), "eth0".into(), "eth1".into()],
                    node_addrs: ips(&["10.0.1.5", "10.0.2.5", "10.244.0.1", "fd00::5"]),
                    snat_v4: Some("10.0.2.5".parse().unwrap()),
                    snat_v6: Some("fd00::5".parse().unwrap()),
                },
            },
            Case {
                what: "a list keeps its order; only its addresses",
                devices: Devices::List(vec!["eth1".into(), "eth0".into()]),
                node_ips: vec![],
                default_routes: vec![],
                want: Resolved {
                    devices: vec!["eth1".into(), "eth0".into()],
                    node_addrs: ips(&["10.0.1.5", "10.0.2.5", "fd00::5"]),
                    snat_v4: Some("10.0.2.5".parse().unwrap()),
                    snat_v6: Some("fd00::5".parse().unwrap()),
                },
            },
            Case {
                what: "--node-ip wins for SNAT and is served",
                devices: Devices::List(vec!["eth0".into()]),
                node_ips: ips(&["192.0.2.1"]),
                default_routes: vec![],
                want: Resolved {
                    devices: vec!["eth0".into()],
                    node_addrs: ips(&["10.0.1.5", "fd00::5", "192.0.2.1"]),
                    snat_v4: Some("192.0.2.1".parse().unwrap()),
                    snat_v6: Some("fd00::5".parse().unwrap()),
                },
            },
            Case {
                what: "none: no device; every address is served (from the node itself); no SNAT",
                devices: Devices::None,
                node_ips: vec![],
                default_routes: vec![],
                want: Resolved {
                    devices: vec![],
                    node_addrs: ips(&["10.0.1.5", "10.0.2.5", "10.244.0.1", "fd00::5"]),
                    snat_v4: None,
                    snat_v6: None,
                },
            },
            Case {
                what: "a listed device without addresses: nothing to serve on it",
                devices: Devices::List(vec!["eth9".into()]),
                node_ips: vec![],
                default_routes: vec![],
                want: Resolved { devices: vec!["eth9".into()], node_addrs: vec![], snat_v4: None, snat_v6: None },
            },
        ];
        for c in cases {
            assert_eq!(resolve(&addrs, &c.devices, &c.node_ips, &c.default_routes), c.want, "{}", c.what);
        }
    }

    #[test]
    fn an_added_address_changes_node_addresses_and_a_removed_one_snat() {
        let before = [a("eth0", "10.0.1.5")];
        let after = [a("eth0", "10.0.1.5"), a("eth0", "10.0.1.6")];
        let r1 = resolve(&before, &Devices::Auto, &[], &[]);
        let r2 = resolve(&after, &Devices::Auto, &[], &[]);
        assert_eq!(r2.node_addrs, ips(&["10.0.1.5", "10.0.1.6"]));
        assert_eq!(r1.snat_v4, r2.snat_v4);
        let r3 = resolve(&[a("eth0", "10.0.1.6")], &Devices::Auto, &[], &[]);
        assert_eq!(r3.snat_v4, Some("10.0.1.6".parse().unwrap()));
        // With --node-ip the SNAT address never moves.
        let fixed = ips(&["10.0.1.5"]);
        assert_eq!(resolve(&[a("eth0", "10.0.1.6")], &Devices::Auto, &fixed, &[]).snat_v4, Some("10.0.1.5".parse().unwrap()));
    }

    #[test]
    fn default_routes_from_proc() {
        let v4 = "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n\
                  eth0\t00000000\t0101000A\t0003\t0\t0\t0\t00000000\t0\t0\t0\n\
                  eth0\t0001000A\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n\
                  cni0\t0000F40A\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0\n\
                  eth9\t00000000\t0101000A\t0002\t0\t0\t0\t00000000\t0\t0\t0\n\
                  bad\n";
        assert_eq!(ipv4_default_route_devices(v4), vec!["eth0".to_string()], "up default route only; route flags 0x2 alone is not up");
        let z = "00000000000000000000000000000000";
        let v6 = format!(
            "{z} 00 {z} 00 fe800000000000000000000000000001 00000400 00000001 00000000 00000003     eth1\n\
             fd000000000000000000000000000000 40 {z} 00 {z} 00000100 00000001 00000000 00000001     eth0\n\
             {z} 00 {z} 00 {z} ffffffff 00000001 00000000 00200200       lo\n\
             short line\n"
        );
        assert_eq!(ipv6_default_route_devices(&v6), vec!["eth1".to_string()], "lo's unreachable ::/0 is not a way out");
        assert!(ipv4_default_route_devices("").is_empty() && ipv6_default_route_devices("").is_empty());
    }
}
