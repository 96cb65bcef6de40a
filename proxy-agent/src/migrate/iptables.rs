//! kube-proxy's iptables leftovers, read from `iptables-save` and removed
//! with `iptables-restore --noflush`, for either backend (legacy, nf_tables)
//! and either family: what `kube-proxy --cleanup` removes.
//!
//! kube-proxy (iptables mode: pkg/proxy/iptables/proxier.go
//! `iptablesJumpChains` and cleanup.go; IPVS mode: pkg/proxy/ipvs/proxier.go
//! `iptablesJumpChain` and `iptablesCleanupChains`) hooks its chains into
//! the built-in ones with rules of one shape, `[-m conntrack --ctstate NEW]
//! -m comment --comment "<fixed text>" -j KUBE-...`, and cleans up by
//! deleting exactly those jumps, then flushing and deleting its chains by
//! name: fixed names per table plus the per-Service chains (`KUBE-SVC-`,
//! `KUBE-SVL-`, `KUBE-EXT-`, `KUBE-FW-`, `KUBE-SEP-` and the older
//! `KUBE-XLB-`) of the nat table. The same here, with one more safeguard:
//! a chain that a rule cleanup does not recognise still jumps to (another
//! component's rule, say) is kept with everything it references, since
//! deleting it would fail or change what that rule does.
//!
//! Kubelet's chains are left alone, as kube-proxy's cleanup leaves them:
//! `KUBE-FIREWALL` (filter, jumped to from INPUT and OUTPUT without a
//! comment) and `KUBE-KUBELET-CANARY` belong to
//! pkg/kubelet/kubelet_network_linux.go, and so does the `KUBE-MARK-DROP`
//! of older kubelets. kube-proxy recreates copies of kubelet's chains at
//! start but "does not delete them in CleanupLeftovers" (its comment on
//! `iptablesKubeletJumpChains`).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use super::ParseError;

/// One table of an `iptables-save` dump.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Table {
    /// `nat`, `filter`, `mangle`, ...
    pub name: String,
    /// In the order of the dump.
    pub chains: Vec<Chain>,
}

/// One chain of a table, with its rules.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chain {
    /// `KUBE-SERVICES`, `PREROUTING`, ...
    pub name: String,
    /// A built-in chain (it has a policy): PREROUTING, INPUT, ...
    pub builtin: bool,
    /// In the order of the dump.
    pub rules: Vec<Rule>,
}

/// One `-A` line of a chain.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    /// The rule as `iptables-save` printed it, `-A CHAIN ...` included;
    /// `-D CHAIN ...` with the same words deletes it.
    pub text: String,
    /// The words after `-A CHAIN`, quotes removed.
    pub args: Vec<String>,
}

impl Rule {
    /// The chain a rule jumps (`-j`) or goes (`-g`) to, when it names one
    /// that is not a built-in target such as ACCEPT or DNAT. Every word is
    /// checked, so a rule that names a chain anywhere counts.
    fn chain_targets<'a>(&'a self, chains: &'a BTreeSet<&str>) -> impl Iterator<Item = &'a str> + 'a {
        self.args.windows(2).filter(|w| w[0] == "-j" || w[0] == "-g" || w[0] == "--jump" || w[0] == "--goto").filter_map(move |w| {
            let t = w[1].as_str();
            chains.contains(t).then_some(t)
        })
    }

    /// The ipsets a rule matches on (`-m set --match-set NAME ...`).
    fn sets(&self) -> impl Iterator<Item = &str> {
        self.args.windows(2).filter(|w| w[0] == "--match-set").map(|w| w[1].as_str())
    }
}

/// Parses the output of `iptables-save` (every table, without counters).
pub fn parse_save(text: &str) -> Result<Vec<Table>, ParseError> {
    let mut tables: Vec<Table> = Vec::new();
    let mut open = false;
    for (i, raw) in text.lines().enumerate() {
        let n = i + 1;
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if let Some(name) = line.strip_prefix('*') {
            if open {
                return Err(ParseError::new(n, "table started before the previous one's COMMIT", line));
            }
            tables.push(Table { name: name.to_string(), chains: Vec::new() });
            open = true;
            continue;
        }
        let Some(table) = tables.last_mut().filter(|_| open) else {
            return Err(ParseError::new(n, "outside of a table", line));
        };
        if line == "COMMIT" {
            open = false;
        } else if let Some(decl) = line.strip_prefix(':') {
            // `:NAME POLICY [packets:bytes]`; user chains have policy `-`.
            let mut words = decl.split_whitespace();
            let (Some(name), Some(policy)) = (words.next(), words.next()) else {
                return Err(ParseError::new(n, "chain declaration without a policy", line));
            };
            table.chains.push(Chain { name: name.to_string(), builtin: policy != "-", rules: Vec::new() });
        } else if line.starts_with("-A ") || line.starts_with('[') {
            let words = split_words(line).map_err(|reason| ParseError::new(n, reason, line))?;
            // With counters (`iptables-save -c`) a rule starts with them.
            let words: Vec<String> = if words.first().is_some_and(|w| w.starts_with('[')) { words[1..].to_vec() } else { words };
            let text = line[line.find("-A ").unwrap_or(0)..].to_string();
            let [flag, chain, args @ ..] = words.as_slice() else {
                return Err(ParseError::new(n, "rule without a chain", line));
            };
            if flag != "-A" {
                return Err(ParseError::new(n, "not an -A rule", line));
            }
            let Some(c) = table.chains.iter_mut().find(|c| c.name == *chain) else {
                return Err(ParseError::new(n, "rule of an undeclared chain", line));
            };
            c.rules.push(Rule { text, args: args.to_vec() });
        } else {
            return Err(ParseError::new(n, "unknown line", line));
        }
    }
    if open {
        return Err(ParseError::new(0, "the last table has no COMMIT", ""));
    }
    Ok(tables)
}

/// Splits a rule into words as iptables-restore does: whitespace separates,
/// double quotes group, a backslash escapes the next character inside
/// quotes (`iptables-save` quotes comments that way).
fn split_words(line: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut in_word = false;
    let mut quoted = false;
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '"' => {
                quoted = !quoted;
                in_word = true;
            }
            '\\' if quoted => match chars.next() {
                Some(e) => cur.push(e),
                None => return Err("a backslash ends the line".into()),
            },
            c if c.is_whitespace() && !quoted => {
                if in_word {
                    out.push(std::mem::take(&mut cur));
                    in_word = false;
                }
            }
            c => {
                cur.push(c);
                in_word = true;
            }
        }
    }
    if quoted {
        return Err("unterminated quote".into());
    }
    if in_word {
        out.push(cur);
    }
    Ok(out)
}

/// kube-proxy's chains with fixed names, per table: iptables mode
/// (cleanup.go's lists) and IPVS mode (`iptablesCleanupChains`).
const FIXED_CHAINS: [(&str, &[&str]); 3] = [
    (
        "nat",
        &[
            "KUBE-SERVICES",
            "KUBE-NODEPORTS",
            "KUBE-POSTROUTING",
            "KUBE-MARK-MASQ",
            "KUBE-PROXY-CANARY",
            "KUBE-NODE-PORT",
            "KUBE-LOAD-BALANCER",
        ],
    ),
    (
        "filter",
        &[
            "KUBE-SERVICES",
            "KUBE-EXTERNAL-SERVICES",
            "KUBE-FORWARD",
            "KUBE-NODEPORTS",
            "KUBE-PROXY-FIREWALL",
            "KUBE-PROXY-CANARY",
            "KUBE-NODE-PORT",
            "KUBE-SOURCE-RANGES-FIREWALL",
            "KUBE-IPVS-FILTER",
            "KUBE-IPVS-OUT-FILTER",
        ],
    ),
    ("mangle", &["KUBE-PROXY-CANARY"]),
];

/// Prefixes of kube-proxy's per-Service and per-endpoint chains, nat table
/// only (`isServiceChainName`; `KUBE-XLB-` is from before 1.24).
const SERVICE_CHAIN_PREFIXES: [&str; 6] = ["KUBE-SVC-", "KUBE-SVL-", "KUBE-EXT-", "KUBE-FW-", "KUBE-SEP-", "KUBE-XLB-"];

/// Kubelet's chains (pkg/kubelet/kubelet_network_linux.go), in any table.
const KUBELET_CHAINS: [&str; 3] = ["KUBE-FIREWALL", "KUBE-KUBELET-CANARY", "KUBE-MARK-DROP"];

/// The comment and target of every jump kube-proxy puts into a built-in
/// chain (iptables mode, then IPVS mode).
const JUMPS: [(&str, &str); 10] = [
    ("kubernetes service portals", "KUBE-SERVICES"),
    ("kubernetes externally-visible service portals", "KUBE-EXTERNAL-SERVICES"),
    ("kubernetes health check service ports", "KUBE-NODEPORTS"),
    ("kubernetes forwarding rules", "KUBE-FORWARD"),
    ("kubernetes load balancer firewall", "KUBE-PROXY-FIREWALL"),
    ("kubernetes postrouting rules", "KUBE-POSTROUTING"),
    ("kubernetes health check rules", "KUBE-NODE-PORT"),
    ("kube-proxy firewall rules", "KUBE-PROXY-FIREWALL"),
    ("kubernetes ipvs access filter", "KUBE-IPVS-FILTER"),
    ("kubernetes ipvs access filter", "KUBE-IPVS-OUT-FILTER"),
];

/// Whether `chain` of `table` is one kube-proxy creates.
pub fn is_kube_proxy_chain(table: &str, chain: &str) -> bool {
    FIXED_CHAINS.iter().any(|(t, names)| *t == table && names.contains(&chain))
        || (table == "nat" && SERVICE_CHAIN_PREFIXES.iter().any(|p| chain.starts_with(p)))
}

/// Whether `rule`, in built-in chain of the same table, is one of
/// kube-proxy's jumps into its own chains: `-m comment --comment TEXT -j
/// TARGET` with a known (TEXT, TARGET), optionally with `-m conntrack
/// --ctstate NEW`, and nothing else.
fn is_kube_proxy_jump(table: &str, rule: &Rule) -> bool {
    let mut args: Vec<&str> = rule.args.iter().map(String::as_str).collect();
    let ct = ["-m", "conntrack", "--ctstate", "NEW"];
    if let Some(i) = args.windows(ct.len()).position(|w| w == ct) {
        args.drain(i..i + ct.len());
    }
    match args.as_slice() {
        ["-m", "comment", "--comment", text, "-j", target] => JUMPS.contains(&(*text, *target)) && is_kube_proxy_chain(table, target),
        _ => false,
    }
}

/// What happens to one table.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TablePlan {
    /// The table's name.
    pub table: String,
    /// kube-proxy's jumps out of built-in chains, as `-A ...` lines.
    pub delete_rules: Vec<String>,
    /// kube-proxy's chains, with how many rules each has; flushed, then
    /// deleted.
    pub remove_chains: Vec<(String, usize)>,
    /// `KUBE-*` chains left as they are, and why.
    pub kept: Vec<(String, String)>,
}

impl TablePlan {
    /// Whether nothing in this table is kube-proxy's.
    pub fn is_empty(&self) -> bool {
        self.delete_rules.is_empty() && self.remove_chains.is_empty()
    }

    /// Input for `iptables-restore --noflush`: the table's changes commit
    /// together (one libiptc commit for legacy, one nf_tables transaction
    /// for the nft backend), so the datapath never sees a jump into a
    /// deleted chain or half of a Service's chains. `:CHAIN - [0:0]` flushes
    /// an existing chain under --noflush; flushing every chain first drops
    /// their references to each other, so the deletions that follow succeed
    /// in any order.
    pub fn restore_script(&self) -> String {
        let mut s = format!("*{}\n", self.table);
        for (c, _) in &self.remove_chains {
            let _ = writeln!(s, ":{c} - [0:0]");
        }
        for r in &self.delete_rules {
            let _ = writeln!(s, "-D{}", r.strip_prefix("-A").unwrap_or(r));
        }
        for (c, _) in &self.remove_chains {
            let _ = writeln!(s, "-X {c}");
        }
        s.push_str("COMMIT\n");
        s
    }
}

/// The plan for one dump, plus the ipsets that rules staying behind still
/// match on (an ipset in use cannot be destroyed).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// One per table of the dump, in its order.
    pub tables: Vec<TablePlan>,
    /// The ipsets that rules staying behind match on (`-m set --match-set`); `ipvs::is_kube_proxy_ipset` names are destroyed only when not among them.
    pub sets_in_use: BTreeSet<String>,
}

impl Plan {
    /// Whether no table has anything of kube-proxy's.
    pub fn is_empty(&self) -> bool {
        self.tables.iter().all(TablePlan::is_empty)
    }
}

/// Decides, per table, which rules and chains are kube-proxy's and can go.
pub fn plan(tables: &[Table]) -> Plan {
    let mut out = Plan::default();
    for t in tables {
        let candidates: BTreeSet<&str> =
            t.chains.iter().filter(|c| !c.builtin && is_kube_proxy_chain(&t.name, &c.name)).map(|c| c.name.as_str()).collect();
        let by_name: BTreeMap<&str, &Chain> = t.chains.iter().map(|c| (c.name.as_str(), c)).collect();

        // A candidate referenced from a chain that stays, by a rule that is
        // not one of kube-proxy's jumps, stays too (with its reason).
        let mut kept: BTreeMap<&str, String> = BTreeMap::new();
        let mut jumps: Vec<&Rule> = Vec::new();
        for c in &t.chains {
            if candidates.contains(c.name.as_str()) {
                continue;
            }
            for r in &c.rules {
                let targets: Vec<&str> = r.chain_targets(&candidates).collect();
                if targets.is_empty() {
                    continue;
                }
                if c.builtin && is_kube_proxy_jump(&t.name, r) {
                    jumps.push(r);
                    continue;
                }
                for target in targets {
                    kept.entry(target).or_insert_with(|| format!("a rule cleanup does not recognise jumps to it: {}", r.text));
                }
            }
        }
        // What a kept chain jumps to must stay as well.
        let mut work: Vec<&str> = kept.keys().copied().collect();
        while let Some(name) = work.pop() {
            let Some(c) = by_name.get(name) else { continue };
            for r in &c.rules {
                for target in r.chain_targets(&candidates) {
                    if !kept.contains_key(target) {
                        kept.insert(target, format!("kept chain {name} jumps to it"));
                        work.push(target);
                    }
                }
            }
        }

        let mut tp = TablePlan { table: t.name.clone(), ..TablePlan::default() };
        tp.delete_rules = jumps.iter().map(|r| r.text.clone()).collect();
        for c in &t.chains {
            let name = c.name.as_str();
            if candidates.contains(name) && !kept.contains_key(name) {
                tp.remove_chains.push((c.name.clone(), c.rules.len()));
                continue;
            }
            for r in &c.rules {
                if !jumps.iter().any(|j| std::ptr::eq(*j, r)) {
                    out.sets_in_use.extend(r.sets().map(str::to_string));
                }
            }
            if c.builtin || !name.starts_with("KUBE-") {
                continue;
            }
            let reason = if let Some(r) = kept.get(name) {
                r.clone()
            } else if KUBELET_CHAINS.contains(&name) {
                "kubelet's chain; kube-proxy --cleanup leaves it too".to_string()
            } else {
                format!("not a chain kube-proxy creates in the {} table", t.name)
            };
            tp.kept.push((c.name.clone(), reason));
        }
        out.tables.push(tp);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A dump as iptables-nft-save 1.8.9 prints it for kube-proxy 1.31 in
    /// iptables mode with one ClusterIP/NodePort Service, next to kubelet's
    /// chains and rules of other components.
    const KUBE_PROXY: &str = r#"# Generated by iptables-nft-save v1.8.9 (nf_tables) on Tue Nov 24 04:49:58 2026
*mangle
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:KUBE-KUBELET-CANARY - [0:0]
:KUBE-PROXY-CANARY - [0:0]
COMMIT
*filter
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:KUBE-EXTERNAL-SERVICES - [0:0]
:KUBE-FIREWALL - [0:0]
:KUBE-FORWARD - [0:0]
:KUBE-KUBELET-CANARY - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-PROXY-CANARY - [0:0]
:KUBE-PROXY-FIREWALL - [0:0]
:KUBE-SERVICES - [0:0]
:USER-FW - [0:0]
-A INPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" -j KUBE-PROXY-FIREWALL
-A INPUT -m comment --comment "kubernetes health check service ports" -j KUBE-NODEPORTS
-A INPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes externally-visible service portals" -j KUBE-EXTERNAL-SERVICES
-A INPUT -j KUBE-FIREWALL
-A INPUT -p tcp -m tcp --dport 22 -j ACCEPT
-A FORWARD -m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" -j KUBE-PROXY-FIREWALL
-A FORWARD -m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD
-A FORWARD -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A FORWARD -m conntrack --ctstate NEW -m comment --comment "kubernetes externally-visible service portals" -j KUBE-EXTERNAL-SERVICES
-A FORWARD -j USER-FW
-A OUTPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" -j KUBE-PROXY-FIREWALL
-A OUTPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A OUTPUT -j KUBE-FIREWALL
-A KUBE-FIREWALL ! -s 127.0.0.0/8 -d 127.0.0.0/8 -m comment --comment "block incoming localnet connections" -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP
-A KUBE-FORWARD -m conntrack --ctstate INVALID -m nfacct --nfacct-name  ct_state_invalid_dropped_pkts -j DROP
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" -m mark --mark 0x4000/0x4000 -j ACCEPT
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding conntrack rule" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
-A USER-FW -s 192.0.2.0/24 -j DROP
COMMIT
*nat
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:KUBE-EXT-HVFWP5L3CSXD4ZHE - [0:0]
:KUBE-KUBELET-CANARY - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-PROXY-CANARY - [0:0]
:KUBE-SEP-IUT3UHDQ34QVHUVE - [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-SVC-HVFWP5L3CSXD4ZHE - [0:0]
:CNI-MASQ - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING
-A POSTROUTING -s 10.244.0.0/16 ! -d 10.244.0.0/16 -j CNI-MASQ
-A CNI-MASQ -j MASQUERADE
-A KUBE-EXT-HVFWP5L3CSXD4ZHE -m comment --comment "masquerade traffic for default/web:http external destinations" -j KUBE-MARK-MASQ
-A KUBE-EXT-HVFWP5L3CSXD4ZHE -j KUBE-SVC-HVFWP5L3CSXD4ZHE
-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000
-A KUBE-NODEPORTS -p tcp -m comment --comment "default/web:http" -m tcp --dport 30080 -j KUBE-EXT-HVFWP5L3CSXD4ZHE
-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
-A KUBE-POSTROUTING -j MARK --set-xmark 0x4000/0x0
-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE --random-fully
-A KUBE-SEP-IUT3UHDQ34QVHUVE -s 10.244.1.10/32 -m comment --comment "default/web:http" -j KUBE-MARK-MASQ
-A KUBE-SEP-IUT3UHDQ34QVHUVE -p tcp -m comment --comment "default/web:http" -m tcp -j DNAT --to-destination 10.244.1.10:8080
-A KUBE-SERVICES -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http cluster IP" -m tcp --dport 80 -j KUBE-SVC-HVFWP5L3CSXD4ZHE
-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS
-A KUBE-SVC-HVFWP5L3CSXD4ZHE ! -s 10.244.0.0/16 -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http cluster IP" -m tcp --dport 80 -j KUBE-MARK-MASQ
-A KUBE-SVC-HVFWP5L3CSXD4ZHE -m comment --comment "default/web:http -> 10.244.1.10:8080" -j KUBE-SEP-IUT3UHDQ34QVHUVE
COMMIT
# Completed on Tue Nov 24 04:49:58 2026
"#;

    fn table<'a>(p: &'a Plan, name: &str) -> &'a TablePlan {
        p.tables.iter().find(|t| t.table == name).unwrap_or_else(|| panic!("no table {name}"))
    }

    fn names(v: &[(String, usize)]) -> Vec<&str> {
        v.iter().map(|(n, _)| n.as_str()).collect()
    }

    #[test]
    fn words_follow_iptables_restore_quoting() {
        for (line, want) in [
            ("-A X -j Y", vec!["-A", "X", "-j", "Y"]),
            (r#"-A X -m comment --comment "a b" -j Y"#, vec!["-A", "X", "-m", "comment", "--comment", "a b", "-j", "Y"]),
            (r#"-A X --comment "say \"hi\" \\ ok""#, vec!["-A", "X", "--comment", r#"say "hi" \ ok"#]),
            (r#"-A X --comment """#, vec!["-A", "X", "--comment", ""]),
            ("  -A   X  ", vec!["-A", "X"]),
        ] {
            assert_eq!(split_words(line).expect(line), want, "{line}");
        }
        for bad in [r#"-A X "open"#, r#"-A X "a\"#] {
            assert!(split_words(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn kube_proxy_chains_by_table() {
        for (table, chain, want) in [
            ("nat", "KUBE-SERVICES", true),
            ("nat", "KUBE-SVC-HVFWP5L3CSXD4ZHE", true),
            ("nat", "KUBE-SVL-ABC", true),
            ("nat", "KUBE-SEP-ABC", true),
            ("nat", "KUBE-EXT-ABC", true),
            ("nat", "KUBE-FW-ABC", true),
            ("nat", "KUBE-XLB-ABC", true),
            ("nat", "KUBE-MARK-MASQ", true),
            ("nat", "KUBE-LOAD-BALANCER", true),
            ("nat", "KUBE-MARK-DROP", false),
            ("nat", "KUBE-KUBELET-CANARY", false),
            ("filter", "KUBE-FIREWALL", false),
            ("filter", "KUBE-SVC-ABC", false),
            ("filter", "KUBE-PROXY-FIREWALL", true),
            ("filter", "KUBE-IPVS-OUT-FILTER", true),
            ("mangle", "KUBE-PROXY-CANARY", true),
            ("mangle", "KUBE-SERVICES", false),
            ("raw", "KUBE-PROXY-CANARY", false),
            ("nat", "KUBE-ROUTER-SERVICES", false),
        ] {
            assert_eq!(is_kube_proxy_chain(table, chain), want, "{table}/{chain}");
        }
    }

    #[test]
    fn kube_proxy_jumps_are_recognised_by_their_exact_shape() {
        let rule = |s: &str| {
            let words = split_words(s).expect(s);
            Rule { text: s.to_string(), args: words[2..].to_vec() }
        };
        for (table, text, want) in [
            ("nat", r#"-A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES"#, true),
            ("filter", r#"-A OUTPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES"#, true),
            ("filter", r#"-A INPUT -m comment --comment "kubernetes service portals" -m conntrack --ctstate NEW -j KUBE-SERVICES"#, true),
            ("nat", r#"-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING"#, true),
            ("filter", r#"-A INPUT -m comment --comment "kubernetes health check rules" -j KUBE-NODE-PORT"#, true),
            // Another comment, another target, extra matches: not ours.
            ("nat", r#"-A OUTPUT -m comment --comment "my portals" -j KUBE-SERVICES"#, false),
            ("nat", r#"-A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-NODEPORTS"#, false),
            ("nat", r#"-A OUTPUT -d 10.0.0.0/8 -m comment --comment "kubernetes service portals" -j KUBE-SERVICES"#, false),
            (
                "nat",
                r#"-A OUTPUT -m conntrack --ctstate NEW,RELATED -m comment --comment "kubernetes service portals" -j KUBE-SERVICES"#,
                false,
            ),
            ("nat", r#"-A OUTPUT -m comment --comment "kubernetes service portals" -g KUBE-SERVICES"#, false),
            ("filter", "-A INPUT -j KUBE-FIREWALL", false),
            // The right text pointing at a chain of another table's list.
            ("mangle", r#"-A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES"#, false),
        ] {
            assert_eq!(is_kube_proxy_jump(table, &rule(text)), want, "{table}: {text}");
        }
    }

    #[test]
    fn a_kube_proxy_dump_loses_exactly_kube_proxys_rules_and_chains() {
        let tables = parse_save(KUBE_PROXY).expect("parse");
        assert_eq!(tables.iter().map(|t| t.name.as_str()).collect::<Vec<_>>(), ["mangle", "filter", "nat"]);
        let p = plan(&tables);

        let mangle = table(&p, "mangle");
        assert_eq!(names(&mangle.remove_chains), ["KUBE-PROXY-CANARY"]);
        assert!(mangle.delete_rules.is_empty());
        assert_eq!(mangle.kept.iter().map(|(c, _)| c.as_str()).collect::<Vec<_>>(), ["KUBE-KUBELET-CANARY"]);

        let filter = table(&p, "filter");
        assert_eq!(
            names(&filter.remove_chains),
            ["KUBE-EXTERNAL-SERVICES", "KUBE-FORWARD", "KUBE-NODEPORTS", "KUBE-PROXY-CANARY", "KUBE-PROXY-FIREWALL", "KUBE-SERVICES"]
        );
        assert_eq!(filter.delete_rules.len(), 9, "{:#?}", filter.delete_rules);
        assert!(filter.delete_rules.iter().all(|r| r.contains("kubernetes")), "{:#?}", filter.delete_rules);
        let kept: Vec<&str> = filter.kept.iter().map(|(c, _)| c.as_str()).collect();
        assert_eq!(kept, ["KUBE-FIREWALL", "KUBE-KUBELET-CANARY"]);
        assert!(filter.kept[0].1.contains("kubelet"), "{:?}", filter.kept[0]);

        let nat = table(&p, "nat");
        assert_eq!(
            names(&nat.remove_chains),
            [
                "KUBE-EXT-HVFWP5L3CSXD4ZHE",
                "KUBE-MARK-MASQ",
                "KUBE-NODEPORTS",
                "KUBE-POSTROUTING",
                "KUBE-PROXY-CANARY",
                "KUBE-SEP-IUT3UHDQ34QVHUVE",
                "KUBE-SERVICES",
                "KUBE-SVC-HVFWP5L3CSXD4ZHE"
            ]
        );
        assert_eq!(nat.remove_chains.iter().find(|(c, _)| c == "KUBE-POSTROUTING").map(|(_, n)| *n), Some(3));
        assert_eq!(nat.delete_rules.len(), 3);
        assert!(p.sets_in_use.is_empty());
    }

    #[test]
    fn the_restore_script_flushes_then_unhooks_then_deletes() {
        let p = plan(&parse_save(KUBE_PROXY).expect("parse"));
        let script = table(&p, "nat").restore_script();
        let lines: Vec<&str> = script.lines().collect();
        assert_eq!(lines[0], "*nat");
        assert_eq!(lines[1], ":KUBE-EXT-HVFWP5L3CSXD4ZHE - [0:0]");
        assert_eq!(lines[9], r#"-D PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES"#);
        assert_eq!(lines[12], "-X KUBE-EXT-HVFWP5L3CSXD4ZHE");
        assert_eq!(lines.last(), Some(&"COMMIT"));
        assert_eq!(lines.len(), 1 + 8 + 3 + 8 + 1);
    }

    #[test]
    fn chains_other_rules_still_use_are_kept_with_what_they_reference() {
        for (name, dump, removed, kept) in [
            (
                "a user rule jumps to KUBE-SERVICES",
                "*nat\n:OUTPUT ACCEPT [0:0]\n:KUBE-SERVICES - [0:0]\n:KUBE-SVC-A - [0:0]\n:KUBE-SEP-A - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n\
                 -A OUTPUT -d 10.0.0.0/8 -j KUBE-SERVICES\n-A KUBE-SERVICES -j KUBE-SVC-A\n-A KUBE-SVC-A -j KUBE-SEP-A\n\
                 -A KUBE-SEP-A -j KUBE-MARK-MASQ\nCOMMIT\n",
                vec![],
                vec!["KUBE-MARK-MASQ", "KUBE-SEP-A", "KUBE-SERVICES", "KUBE-SVC-A"],
            ),
            (
                "another component marks for masquerade through KUBE-MARK-MASQ",
                "*nat\n:POSTROUTING ACCEPT [0:0]\n:CNI-X - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n:KUBE-SVC-A - [0:0]\n\
                 -A CNI-X -j KUBE-MARK-MASQ\n-A KUBE-SVC-A -j KUBE-MARK-MASQ\nCOMMIT\n",
                vec!["KUBE-SVC-A"],
                vec!["KUBE-MARK-MASQ"],
            ),
            (
                "a goto from a built-in chain",
                "*nat\n:PREROUTING ACCEPT [0:0]\n:KUBE-SERVICES - [0:0]\n-A PREROUTING -g KUBE-SERVICES\nCOMMIT\n",
                vec![],
                vec!["KUBE-SERVICES"],
            ),
            (
                "kubelet's chain jumping to kube-proxy's keeps it",
                "*nat\n:KUBE-MARK-DROP - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n-A KUBE-MARK-DROP -j KUBE-MARK-MASQ\nCOMMIT\n",
                vec![],
                vec!["KUBE-MARK-DROP", "KUBE-MARK-MASQ"],
            ),
            (
                "kube-proxy chains only reference each other",
                "*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-SVC-A - [0:0]\n-A KUBE-SERVICES -j KUBE-SVC-A\n-A KUBE-SVC-A -j KUBE-SERVICES\nCOMMIT\n",
                vec!["KUBE-SERVICES", "KUBE-SVC-A"],
                vec![],
            ),
        ] {
            let p = plan(&parse_save(dump).expect(name));
            let t = &p.tables[0];
            assert_eq!(names(&t.remove_chains), removed, "{name}");
            let mut got: Vec<&str> = t.kept.iter().map(|(c, _)| c.as_str()).collect();
            got.sort_unstable();
            assert_eq!(got, kept, "{name}: {:#?}", t.kept);
            assert!(t.delete_rules.is_empty(), "{name}");
        }
    }

    #[test]
    fn ipsets_matched_by_rules_that_stay_are_in_use() {
        let dump = "*filter\n:INPUT ACCEPT [0:0]\n:KUBE-NODE-PORT - [0:0]\n:USER - [0:0]\n\
                    -A INPUT -m comment --comment \"kubernetes health check rules\" -j KUBE-NODE-PORT\n\
                    -A KUBE-NODE-PORT -m set --match-set KUBE-HEALTH-CHECK-NODE-PORT dst -j ACCEPT\n\
                    -A USER -m set --match-set KUBE-CLUSTER-IP dst,dst -j ACCEPT\nCOMMIT\n";
        let p = plan(&parse_save(dump).expect("parse"));
        assert_eq!(p.sets_in_use.iter().map(String::as_str).collect::<Vec<_>>(), ["KUBE-CLUSTER-IP"]);
        assert_eq!(names(&p.tables[0].remove_chains), ["KUBE-NODE-PORT"]);
        assert_eq!(p.tables[0].delete_rules.len(), 1);
    }

    #[test]
    fn nothing_of_kube_proxys_means_an_empty_plan() {
        for dump in ["", "*filter\n:INPUT ACCEPT [0:0]\n-A INPUT -p tcp -j ACCEPT\nCOMMIT\n", "# Warning: iptables-legacy tables present\n"]
        {
            let p = plan(&parse_save(dump).expect(dump));
            assert!(p.is_empty(), "{dump}: {p:#?}");
        }
    }

    #[test]
    fn counters_are_accepted_and_dumps_that_make_no_sense_are_errors() {
        let with_counters = "*nat\n:OUTPUT ACCEPT [1:60]\n:KUBE-SERVICES - [0:0]\n\
                             [3:180] -A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\nCOMMIT\n";
        let t = parse_save(with_counters).expect("counters");
        assert_eq!(t[0].chains[0].rules[0].args[0], "-m");
        assert!(t[0].chains[0].rules[0].text.starts_with("-A OUTPUT"));
        for (bad, line) in [
            ("-A OUTPUT -j X\n", 1),
            ("*nat\n:OUTPUT ACCEPT [0:0]\n", 0),
            ("*nat\n-A NOPE -j X\nCOMMIT\n", 2),
            ("*nat\n:OUTPUT\nCOMMIT\n", 2),
            ("*nat\n*filter\n", 2),
            ("*nat\n:OUTPUT ACCEPT [0:0]\n-A OUTPUT --comment \"x\nCOMMIT\n", 3),
            ("*nat\nbogus\nCOMMIT\n", 2),
        ] {
            let e = parse_save(bad).expect_err(bad);
            assert_eq!(e.line, line, "{bad}: {e}");
        }
    }
}
