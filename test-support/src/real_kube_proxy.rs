//! Real kube-proxy v1.37 (nftables mode) beside the agent, as the oracle
//! for endpoint selection (issue #45): N kube-proxy processes, one per
//! simulated node, against a [`RealCluster`]'s API server, each in a
//! network namespace made here, and what each one programmed read back
//! from its nftables table as per-Service-port endpoint sets, the shape
//! `proxy-agent explain --output json` prints.
//!
//! # Keeping the host untouched
//!
//! Each namespace has loopback and a veth pair (both ends inside) holding
//! the node's address, and no link to the host: nothing kube-proxy programs can see
//! a host packet. It reaches the API server (on the host's 127.0.0.1)
//! through a relay: a listening socket created inside the namespace
//! (sockets stay in the namespace they were made in) whose connections
//! this process accepts and copies to the API server from the host's
//! namespace, byte for byte. kube-proxy gets the flags that keep it off
//! host-global state: `--conntrack-max-per-core=0` (no `nf_conntrack_max`,
//! no `hashsize` module parameter: `pkg/proxy/conntrack/sysctls.go` skips
//! both), zero conntrack timeouts (each one "0 to leave as-is"),
//! `--iptables-localhost-nodeports=false` (no `route_localnet`), metrics
//! and healthz on the namespace's own address. [`KubeProxies::finish`]
//! compares the host's conntrack, forwarding and routing sysctls and its
//! whole netfilter ruleset with a snapshot taken before the first
//! kube-proxy started.
//!
//! # When a kube-proxy has synced
//!
//! kube-proxy syncs on every change (`--iptables-min-sync-period=0`, which
//! nftables mode reads too: `cmd/kube-proxy/app/options.go`), and stamps
//! `kubeproxy_sync_proxy_rules_last_timestamp_seconds` after each sync. Its
//! Service and EndpointSlice informers each deliver in order, so once a
//! sync programmed a sentinel Service port written after everything else
//! (its endpoint changed each time), every earlier object is programmed
//! too ([`KubeProxies::wait_synced`]).
//!
//! # What it chose
//!
//! Per Service port, kube-proxy's nftables proxier (`syncProxyRules` in
//! `pkg/proxy/nftables/proxier.go`) writes the Cluster-policy endpoints
//! into the chain `service-<hash>-<ns>/<svc>/<proto>/<port name>` and the
//! Local-policy ones into `local-…` (each only when used and not empty),
//! as one `dnat to` or a `numgen random mod N map` of address . port; the
//! `external-…` chain ends in a plain `goto` to the chain external traffic
//! uses, absent when it has no endpoints. [`Sets`] holds the three.
//!
//! Everything is removed on drop, also when a test fails: the processes,
//! the relays and the namespaces (and with them the kube-proxy tables).

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::real_cluster::{RealCluster, bin_dir};
use crate::relay::Relay;
use crate::sandbox::{Guarded, Netns, command_in, in_netns};

/// The kube-proxy binary, beside the control plane's (`cargo xtask k8s`).
pub fn kube_proxy_bin() -> io::Result<PathBuf> {
    let bin = bin_dir()?.join("kube-proxy");
    if bin.is_file() { Ok(bin) } else { Err(io::Error::other(format!("{} is missing: `cargo xtask k8s` builds it", bin.display()))) }
}

/// The port the relay listens on inside each namespace.
const RELAY_PORT: u16 = 6443;
/// kube-proxy's metrics port, on the node's address.
const METRICS_PORT: u16 = 10249;
/// The gauge kube-proxy sets after each IPv4 sync (unix seconds; one
/// series per family, and every generated object is IPv4).
const SYNC_GAUGE: &str = "kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family=\"IPv4\"}";
/// How long one kube-proxy may take to start or to sync.
const LIMIT: Duration = Duration::from_secs(90);

fn other(msg: impl Into<String>) -> io::Error {
    io::Error::other(msg.into())
}

/// A Service port as both sides name it: namespace, Service, protocol
/// (upper case, as the API), port name (empty when unnamed).
pub type PortKey = (String, String, String, String);

/// The endpoints (`ip:port`, `[ip6]:port`) one node sends each kind of
/// traffic of a Service port to: Cluster policy, Local policy, and what
/// traffic from outside (NodePort, LoadBalancer, external IPs) reaches.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Sets {
    pub cluster: BTreeSet<String>,
    pub local: BTreeSet<String>,
    pub external: BTreeSet<String>,
}

/// Host-global state kube-proxy could write and must not.
const HOST_SYSCTLS: &[&str] = &[
    "/proc/sys/net/netfilter/nf_conntrack_max",
    "/proc/sys/net/netfilter/nf_conntrack_tcp_timeout_established",
    "/proc/sys/net/netfilter/nf_conntrack_tcp_timeout_close_wait",
    "/proc/sys/net/netfilter/nf_conntrack_tcp_be_liberal",
    "/proc/sys/net/netfilter/nf_conntrack_udp_timeout",
    "/proc/sys/net/netfilter/nf_conntrack_udp_timeout_stream",
    "/proc/sys/net/nf_conntrack_max",
    "/sys/module/nf_conntrack/parameters/hashsize",
    "/proc/sys/net/ipv4/ip_forward",
    "/proc/sys/net/ipv4/conf/all/route_localnet",
    "/proc/sys/net/ipv4/conf/all/forwarding",
    "/proc/sys/net/ipv6/conf/all/forwarding",
    "/proc/sys/net/bridge/bridge-nf-call-iptables",
    "/proc/sys/net/bridge/bridge-nf-call-ip6tables",
    "/proc/sys/net/ipv4/vs/conntrack",
];

/// The host's sysctls above (read from this thread, which is in the host's
/// namespace: /proc/sys/net is the reader's namespace's) and its whole
/// netfilter ruleset (`nft --stateless list ruleset`, which shows
/// iptables-nft's tables too; stateless, so that the packet counters of
/// the host's own rules, which count whatever else the host does, are not
/// taken for a change).
#[derive(Debug, PartialEq, Eq)]
struct HostSnapshot {
    sysctls: BTreeMap<&'static str, Option<String>>,
    ruleset: String,
}

impl HostSnapshot {
    fn take() -> io::Result<HostSnapshot> {
        let sysctls = HOST_SYSCTLS.iter().map(|p| (*p, fs::read_to_string(p).ok().map(|v| v.trim().to_string()))).collect();
        let out = Command::new("nft").args(["--stateless", "list", "ruleset"]).stdin(Stdio::null()).output()?;
        if !out.status.success() {
            return Err(other(format!("nft list ruleset failed: {}", String::from_utf8_lossy(&out.stderr).trim())));
        }
        Ok(HostSnapshot { sysctls, ruleset: String::from_utf8_lossy(&out.stdout).into_owned() })
    }

    fn differences(&self, after: &HostSnapshot) -> Vec<String> {
        let mut out: Vec<String> = self
            .sysctls
            .iter()
            .filter(|(k, v)| after.sysctls.get(*k) != Some(v))
            .map(|(k, v)| format!("{k}: {v:?} -> {:?}", after.sysctls.get(k).cloned().flatten()))
            .collect();
        if self.ruleset != after.ruleset {
            out.push(format!("the host's netfilter ruleset changed:\nbefore:\n{}\nafter:\n{}", self.ruleset, after.ruleset));
        }
        out
    }
}

/// One simulated node: its namespace, relay and kube-proxy.
struct ProxyNode {
    name: String,
    addr: Ipv4Addr,
    log: PathBuf,
    // Dropped in this order: the process, the relay, then the namespace.
    proc: Option<Guarded>,
    _relay: Relay,
    netns: Netns,
}

/// N real kube-proxies; see the module documentation.
pub struct KubeProxies {
    nodes: Vec<ProxyNode>,
    dir: PathBuf,
    host_before: HostSnapshot,
    finished: bool,
}

impl KubeProxies {
    /// Starts one kube-proxy per `(node name, node address)`. The Nodes
    /// must exist with `status.addresses` holding the address (kube-proxy
    /// waits for them to learn its node IPs). Returns once every one has
    /// synced once.
    pub fn start(cluster: &RealCluster, nodes: &[(String, Ipv4Addr)]) -> io::Result<KubeProxies> {
        let bin = kube_proxy_bin()?;
        let host_before = HostSnapshot::take()?;
        let dir = std::env::temp_dir().join(format!("topoproxy-kube-proxy-{}-{}", std::process::id(), nodes.len()));
        fs::create_dir_all(&dir)?;
        let admin = fs::read_to_string(cluster.admin_kubeconfig())?;
        let api: SocketAddr = cluster
            .apiserver_url()
            .trim_start_matches("https://")
            .parse()
            .map_err(|e| other(format!("API server address {}: {e}", cluster.apiserver_url())))?;
        let kubeconfig = dir.join("kube-proxy.kubeconfig");
        fs::write(&kubeconfig, admin.replace(&cluster.apiserver_url(), &format!("https://127.0.0.1:{RELAY_PORT}")))?;
        let mut out = KubeProxies { nodes: Vec::new(), dir, host_before, finished: false };
        for (name, addr) in nodes {
            let netns = Netns::new("tpkp")?;
            // A veth pair with both ends in the namespace (the kernel here
            // has no dummy driver): an interface for the node's address.
            netns.ip(&["link", "add", "eth0", "type", "veth", "peer", "name", "eth0-peer"])?;
            netns.ip(&["addr", "add", &format!("{addr}/32"), "dev", "eth0"])?;
            netns.ip(&["link", "set", "eth0-peer", "up"])?;
            netns.ip(&["link", "set", "eth0", "up"])?;
            let relay = Relay::start(&netns, SocketAddr::from(([127, 0, 0, 1], RELAY_PORT)), api)?;
            let log = out.dir.join(format!("{name}.log"));
            let file = fs::File::create(&log)?;
            let mut cmd = command_in(&bin, Some(&netns), None)?;
            cmd.arg(format!("--kubeconfig={}", kubeconfig.display()))
                .arg("--proxy-mode=nftables")
                .arg(format!("--hostname-override={name}"))
                // Host-global conntrack state left as it is (see the
                // module documentation).
                .args(["--conntrack-max-per-core=0", "--conntrack-tcp-timeout-established=0s"])
                .args(["--conntrack-tcp-timeout-close-wait=0s", "--conntrack-udp-timeout=0s", "--conntrack-udp-timeout-stream=0s"])
                .arg("--iptables-localhost-nodeports=false")
                .arg("--iptables-min-sync-period=0s")
                .arg(format!("--metrics-bind-address={addr}:{METRICS_PORT}"))
                .arg(format!("--healthz-bind-address={addr}:10256"))
                .arg("--v=2")
                .stdin(Stdio::null())
                .stdout(file.try_clone()?)
                .stderr(file);
            let proc = Guarded::spawn(&mut cmd).map_err(|e| other(format!("cannot start {}: {e}", bin.display())))?;
            out.nodes.push(ProxyNode { name: name.clone(), addr: *addr, log, proc: Some(proc), _relay: relay, netns });
        }
        for i in 0..out.nodes.len() {
            out.wait(i, "its first sync", |p, i| Ok(p.last_sync(i)?.is_some()))?;
        }
        Ok(out)
    }

    /// The node names, in the order given to [`start`](Self::start).
    pub fn node_names(&self) -> Vec<String> {
        self.nodes.iter().map(|n| n.name.clone()).collect()
    }

    /// The end of node `i`'s kube-proxy log, for failure messages.
    pub fn log_tail(&self, i: usize) -> String {
        let text = fs::read_to_string(&self.nodes[i].log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    fn check_running(&mut self, i: usize) -> io::Result<()> {
        let node = &mut self.nodes[i];
        if let Some(p) = node.proc.as_mut()
            && let Some(status) = p.0.try_wait()?
        {
            let name = node.name.clone();
            return Err(other(format!("kube-proxy of {name} exited ({status}):\n{}", self.log_tail(i))));
        }
        Ok(())
    }

    fn wait(&mut self, i: usize, what: &str, mut done: impl FnMut(&Self, usize) -> io::Result<bool>) -> io::Result<()> {
        let deadline = Instant::now() + LIMIT;
        let mut last = String::new();
        while Instant::now() < deadline {
            self.check_running(i)?;
            match done(self, i) {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => last = e.to_string(),
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Err(other(format!("kube-proxy of {}: no {what} within {LIMIT:?} ({last}):\n{}", self.nodes[i].name, self.log_tail(i))))
    }

    /// Node `i`'s sync gauge, scraped from inside its namespace; `None`
    /// before its first sync.
    fn last_sync(&self, i: usize) -> io::Result<Option<f64>> {
        let addr = SocketAddr::new(IpAddr::V4(self.nodes[i].addr), METRICS_PORT);
        let (code, body) = in_netns(&self.nodes[i].netns, move || crate::http::http_get(addr, "/metrics"))?.map_err(other)?;
        if code != 200 {
            return Err(other(format!("metrics answered {code}")));
        }
        Ok(crate::http::metric(&body, SYNC_GAUGE).filter(|t| *t > 0.0))
    }

    /// Waits until every kube-proxy has synced since its mark
    /// ([`sync_marks`](Self::sync_marks)) and programmed `sentinel` with
    /// the Cluster set `want[i]` (node `i`'s); see the module
    /// documentation.
    pub fn wait_synced(&mut self, marks: &[f64], sentinel: &PortKey, want: &[BTreeSet<String>]) -> io::Result<()> {
        for (i, (mark, want)) in marks.iter().zip(want).enumerate() {
            self.wait(i, "sync with the sentinel programmed", |p, i| {
                if !p.last_sync(i)?.is_some_and(|t| t > *mark) {
                    return Ok(false);
                }
                let sets = p.sets(i)?;
                Ok(sets.get(sentinel).is_some_and(|s| &s.cluster == want))
            })?;
        }
        Ok(())
    }

    /// Every kube-proxy's sync gauge now.
    pub fn sync_marks(&self) -> io::Result<Vec<f64>> {
        (0..self.nodes.len()).map(|i| Ok(self.last_sync(i)?.unwrap_or(0.0))).collect()
    }

    /// What node `i`'s kube-proxy programmed, per Service port (both
    /// families' tables joined).
    pub fn sets(&self, i: usize) -> io::Result<BTreeMap<PortKey, Sets>> {
        let mut out = BTreeMap::new();
        for family in ["ip", "ip6"] {
            let mut cmd = command_in("nft", Some(&self.nodes[i].netns), None)?;
            let res = cmd.args(["-j", "list", "table", family, "kube-proxy"]).stdin(Stdio::null()).output()?;
            if !res.status.success() {
                // No table of that family (kube-proxy runs single-stack
                // when the namespace cannot do IPv6).
                continue;
            }
            let doc: Value = serde_json::from_slice(&res.stdout).map_err(|e| other(format!("nft -j output: {e}")))?;
            read_table(&doc, &mut out)?;
        }
        Ok(out)
    }

    /// Stops everything and checks that the host did not change.
    pub fn finish(mut self) -> io::Result<()> {
        self.finished = true;
        self.stop();
        let after = HostSnapshot::take()?;
        let diff = self.host_before.differences(&after);
        if diff.is_empty() { Ok(()) } else { Err(other(format!("kube-proxy changed the host: {}", diff.join("; ")))) }
    }

    fn stop(&mut self) {
        for n in &mut self.nodes {
            if let Some(mut p) = n.proc.take() {
                let _ = p.terminate(Duration::from_secs(5));
            }
        }
        self.nodes.clear();
        let _ = fs::remove_dir_all(&self.dir);
    }
}

impl Drop for KubeProxies {
    fn drop(&mut self) {
        if !self.finished {
            self.stop();
        }
    }
}

/// The chain prefixes `syncProxyRules` names per Service port.
const CLUSTER_PREFIX: &str = "service-";
const LOCAL_PREFIX: &str = "local-";
const EXTERNAL_PREFIX: &str = "external-";

/// `<prefix><8-character hash>-<ns>/<svc>/<proto>/<port name>` to the
/// port's key (`servicePortChainNameBase`).
fn chain_key(chain: &str, prefix: &str) -> Option<PortKey> {
    let base = chain.strip_prefix(prefix)?;
    let rest = base.get(9..).filter(|_| base.as_bytes().get(8) == Some(&b'-'))?;
    let mut parts = rest.splitn(4, '/');
    let (ns, svc, proto, port) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    Some((ns.to_string(), svc.to_string(), proto.to_uppercase(), port.to_string()))
}

/// Each rule's chain and expressions, by chain.
fn rules(doc: &Value) -> BTreeMap<String, Vec<&Vec<Value>>> {
    let mut out: BTreeMap<String, Vec<&Vec<Value>>> = BTreeMap::new();
    for item in doc["nftables"].as_array().into_iter().flatten() {
        if let (Some(chain), Some(expr)) = (item["rule"]["chain"].as_str(), item["rule"]["expr"].as_array()) {
            out.entry(chain.to_string()).or_default().push(expr);
        }
    }
    out
}

/// The `address:port` endpoints a chain's `dnat` statements name: one
/// `dnat to A:P`, or `dnat … to numgen random mod N map { i : A . P, … }`.
fn dnat_targets(exprs: &[&Vec<Value>], out: &mut BTreeSet<String>) -> io::Result<()> {
    for rule in exprs {
        for e in *rule {
            let Some(d) = e.get("dnat") else { continue };
            if let (Some(addr), Some(port)) = (d["addr"].as_str(), d["port"].as_u64()) {
                out.insert(endpoint(addr, port)?);
                continue;
            }
            let elems = d["addr"]["map"]["data"]["set"].as_array().ok_or_else(|| other(format!("unexpected dnat {d}")))?;
            for el in elems {
                let pair = el[1]["concat"].as_array().ok_or_else(|| other(format!("unexpected dnat map element {el}")))?;
                match (pair.first().and_then(Value::as_str), pair.get(1).and_then(Value::as_u64)) {
                    (Some(a), Some(p)) => out.insert(endpoint(a, p)?),
                    _ => return Err(other(format!("unexpected dnat map element {el}"))),
                };
            }
        }
    }
    Ok(())
}

fn endpoint(addr: &str, port: u64) -> io::Result<String> {
    let ip: IpAddr = addr.parse().map_err(|e| other(format!("dnat address {addr}: {e}")))?;
    let port = u16::try_from(port).map_err(|e| other(format!("dnat port {port}: {e}")))?;
    Ok(SocketAddr::new(ip, port).to_string())
}

/// One family's `kube-proxy` table into per-port sets.
fn read_table(doc: &Value, out: &mut BTreeMap<PortKey, Sets>) -> io::Result<()> {
    let rules = rules(doc);
    let targets = |chain: &str| -> io::Result<BTreeSet<String>> {
        let mut set = BTreeSet::new();
        dnat_targets(rules.get(chain).map(Vec::as_slice).unwrap_or_default(), &mut set)?;
        Ok(set)
    };
    for (chain, exprs) in &rules {
        if let Some(key) = chain_key(chain, CLUSTER_PREFIX) {
            out.entry(key).or_default().cluster.extend(targets(chain)?);
        } else if let Some(key) = chain_key(chain, LOCAL_PREFIX) {
            out.entry(key).or_default().local.extend(targets(chain)?);
        } else if let Some(key) = chain_key(chain, EXTERNAL_PREFIX) {
            // The fall-through to the policy chain is the rule that is
            // only a `goto` (the short-circuit rules match first).
            let policy = exprs.iter().filter(|r| r.len() == 1).find_map(|r| r[0]["goto"]["target"].as_str().map(str::to_string));
            let set = match policy {
                Some(p) => targets(&p)?,
                None => BTreeSet::new(),
            };
            out.entry(key).or_default().external.extend(set);
        }
    }
    Ok(())
}

/// `proxy-agent explain --output json`'s document to the same sets: the
/// Cluster and Local sets (null, unused, is empty, as kube-proxy writes no
/// chain for an unused set) and, for a port external traffic can reach
/// (a nodePort or external frontends), its external endpoints.
pub fn explain_sets(doc: &Value) -> io::Result<BTreeMap<PortKey, Sets>> {
    let mut out: BTreeMap<PortKey, Sets> = BTreeMap::new();
    let strings = |v: &Value| -> BTreeSet<String> {
        v.as_array().into_iter().flatten().filter_map(Value::as_str).map(|s| canonical(s).unwrap_or_else(|| s.to_string())).collect()
    };
    for s in doc["services"].as_array().ok_or_else(|| other("explain JSON without services"))? {
        let key = (
            s["namespace"].as_str().unwrap_or_default().to_string(),
            s["name"].as_str().unwrap_or_default().to_string(),
            s["port"]["protocol"].as_str().unwrap_or_default().to_uppercase(),
            s["port"]["name"].as_str().unwrap_or_default().to_string(),
        );
        let external = !s["nodePort"].is_null() || s["externalFrontends"].as_array().is_some_and(|a| !a.is_empty());
        let e = out.entry(key).or_default();
        e.cluster.extend(strings(&s["clusterEndpoints"]));
        e.local.extend(strings(&s["localEndpoints"]));
        if external {
            e.external.extend(strings(&s["externalEndpoints"]));
        }
    }
    Ok(out)
}

fn canonical(s: &str) -> Option<String> {
    s.parse::<SocketAddr>().ok().map(|a| a.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_names_give_the_port() {
        assert_eq!(
            chain_key("service-ULMVA6XW-ns1/svc1/tcp/p80", CLUSTER_PREFIX),
            Some(("ns1".into(), "svc1".into(), "TCP".into(), "p80".into()))
        );
        assert_eq!(
            chain_key("local-ULMVA6XW-ns1/svc1/udp/", LOCAL_PREFIX),
            Some(("ns1".into(), "svc1".into(), "UDP".into(), String::new()))
        );
        assert_eq!(chain_key("services", CLUSTER_PREFIX), None);
        assert_eq!(chain_key("service-endpoints-check", CLUSTER_PREFIX), None);
    }

    #[test]
    fn dnat_statements_give_the_endpoints() {
        let single: Vec<Value> = serde_json::from_str(r#"[{"dnat":{"addr":"10.0.0.1","port":80}}]"#).unwrap();
        let map: Vec<Value> = serde_json::from_str(
            r#"[{"dnat":{"family":"ip6","addr":{"map":{"key":{"numgen":{"mode":"random","mod":2,"offset":0}},
                 "data":{"set":[[0,{"concat":["fd00::1",80]}],[1,{"concat":["fd00::2",81]}]]}}}}}]"#,
        )
        .unwrap();
        let mut out = BTreeSet::new();
        dnat_targets(&[&single, &map], &mut out).unwrap();
        assert_eq!(out, ["10.0.0.1:80", "[fd00::1]:80", "[fd00::2]:81"].iter().map(ToString::to_string).collect());
    }
}
