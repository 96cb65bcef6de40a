//! kube-proxy's nftables leftovers: the tables `ip kube-proxy` and `ip6
//! kube-proxy`, one per family, that nftables mode keeps all of its state
//! in (pkg/proxy/nftables/proxier.go, `kubeProxyTable`). Its cleanup deletes
//! both tables and nothing else; so does this.
//!
//! The tables iptables-nft makes (`ip nat`, `ip filter`, ...) are the
//! iptables backend's and are handled through `iptables-nft`
//! ([`super::iptables`]), never deleted here.

use super::ParseError;

/// One table of `nft -j list tables`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NftTable {
    /// `ip`, `ip6`, `inet`, ...
    pub family: String,
    /// The table's name.
    pub name: String,
}

impl std::fmt::Display for NftTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "table {} {}", self.family, self.name)
    }
}

/// The table name kube-proxy's nftables mode uses in each family.
pub const KUBE_PROXY_TABLE: &str = "kube-proxy";

/// Parses `nft -j list tables` (libnftables' JSON: a `nftables` array of
/// `metainfo` and `table` objects).
pub fn parse_tables(json: &str) -> Result<Vec<NftTable>, ParseError> {
    let doc: serde_json::Value = serde_json::from_str(json).map_err(|e| ParseError::new(0, format!("not JSON: {e}"), json))?;
    let items = doc.get("nftables").and_then(serde_json::Value::as_array).ok_or_else(|| ParseError::new(0, "no `nftables` array", json))?;
    let mut out = Vec::new();
    for item in items {
        let Some(t) = item.get("table") else { continue };
        match (t.get("family").and_then(serde_json::Value::as_str), t.get("name").and_then(serde_json::Value::as_str)) {
            (Some(family), Some(name)) => out.push(NftTable { family: family.to_string(), name: name.to_string() }),
            _ => return Err(ParseError::new(0, "a table without family or name", t.to_string())),
        }
    }
    Ok(out)
}

/// What happens to the tables found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// kube-proxy's `kube-proxy` tables, in the `ip` and `ip6` families.
    pub remove: Vec<NftTable>,
    /// Tables named like kube-proxy's in a family it never uses, and why
    /// they stay.
    pub kept: Vec<(NftTable, String)>,
}

/// Which tables are kube-proxy's nftables mode's: `kube-proxy` in the `ip` and `ip6` families, where it makes them.
pub fn plan(tables: &[NftTable]) -> Plan {
    let mut p = Plan::default();
    for t in tables.iter().filter(|t| t.name == KUBE_PROXY_TABLE) {
        if t.family == "ip" || t.family == "ip6" {
            p.remove.push(t.clone());
        } else {
            p.kept.push((t.clone(), format!("kube-proxy makes its tables in the ip and ip6 families only, not {}", t.family)));
        }
    }
    p
}

impl Plan {
    /// Input for `nft -f -`: one transaction, so both families go at once.
    pub fn script(&self) -> String {
        self.remove.iter().map(|t| format!("delete {t}\n")).collect()
    }
}

/// A NAT base chain of `nft -j list chains`: where netfilter's NAT is
/// hooked in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NatChain {
    /// The chain's family.
    pub family: String,
    /// The chain's table.
    pub table: String,
    /// Its hook (`prerouting`, `output`, ...).
    pub hook: String,
}

/// The NAT base chains of `nft -j list chains`.
pub fn parse_nat_chains(json: &str) -> Result<Vec<NatChain>, ParseError> {
    let doc: serde_json::Value = serde_json::from_str(json).map_err(|e| ParseError::new(0, format!("not JSON: {e}"), json))?;
    let items = doc.get("nftables").and_then(serde_json::Value::as_array).ok_or_else(|| ParseError::new(0, "no `nftables` array", json))?;
    let text = |c: &serde_json::Value, k: &str| c.get(k).and_then(serde_json::Value::as_str).map(str::to_string);
    Ok(items
        .iter()
        .filter_map(|i| i.get("chain"))
        .filter(|c| text(c, "type").as_deref() == Some("nat"))
        .filter_map(|c| Some(NatChain { family: text(c, "family")?, table: text(c, "table")?, hook: text(c, "hook")? }))
        .collect())
}

/// The NAT hooks (`ip prerouting`, ...) that only the tables of `plan` hook
/// into: netfilter keeps applying a connection's NAT binding only while
/// some NAT chain is registered at the hook (nf_nat_register_fn counts the
/// users per hook), so connections kube-proxy translated lose their
/// translation there when the tables go. iptables' nat table (either
/// backend) hooks into all four: `legacy_nat` names the families whose
/// legacy nat table exists (/proc/net/ip_tables_names), and iptables-nft's
/// chains are among `chains`.
pub fn nat_hooks_lost(plan: &Plan, chains: &[NatChain], legacy_nat: &[&str]) -> Vec<String> {
    let removed = |c: &NatChain| plan.remove.iter().any(|t| t.family == c.family && t.name == c.table);
    let mut lost: Vec<String> = Vec::new();
    for c in chains.iter().filter(|c| removed(c)) {
        let kept = legacy_nat.contains(&c.family.as_str())
            || chains.iter().any(|o| !removed(o) && o.hook == c.hook && (o.family == c.family || o.family == "inet"));
        let name = format!("{} {}", c.family, c.hook);
        if !kept && !lost.contains(&name) {
            lost.push(name);
        }
    }
    lost
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `nft -j list tables` (nft 1.0.6) on a node with kube-proxy's
    /// nftables mode, iptables-nft's nat table and a firewall of its own.
    const LISTED: &str = r#"{"nftables": [{"metainfo": {"version": "1.0.6", "release_name": "Lester Gooch #5", "json_schema_version": 1}}, {"table": {"family": "ip", "name": "kube-proxy", "handle": 1}}, {"table": {"family": "ip6", "name": "kube-proxy", "handle": 2}}, {"table": {"family": "inet", "name": "filter", "handle": 3}}, {"table": {"family": "ip", "name": "nat", "handle": 4}}, {"table": {"family": "inet", "name": "kube-proxy", "handle": 5}}]}"#;

    #[test]
    fn only_kube_proxys_ip_and_ip6_tables_go() {
        let tables = parse_tables(LISTED).expect("parse");
        assert_eq!(tables.len(), 5);
        let p = plan(&tables);
        assert_eq!(p.remove.iter().map(ToString::to_string).collect::<Vec<_>>(), ["table ip kube-proxy", "table ip6 kube-proxy"]);
        assert_eq!(p.kept.len(), 1);
        assert_eq!(p.kept[0].0.to_string(), "table inet kube-proxy");
        assert_eq!(p.script(), "delete table ip kube-proxy\ndelete table ip6 kube-proxy\n");
    }

    #[test]
    fn nat_hooks_only_kube_proxy_uses_are_named() {
        let chains = |json: &str| parse_nat_chains(json).expect(json);
        let kube_proxy = r#"{"family": "ip", "table": "kube-proxy", "name": "nat-prerouting", "type": "nat", "hook": "prerouting", "prio": -100}, {"family": "ip", "table": "kube-proxy", "name": "nat-postrouting", "type": "nat", "hook": "postrouting", "prio": 100}, {"family": "ip", "table": "kube-proxy", "name": "services", "handle": 3}"#;
        let plan = plan(&[NftTable { family: "ip".into(), name: KUBE_PROXY_TABLE.into() }]);
        for (others, legacy, lost) in [
            ("", vec![], vec!["ip prerouting", "ip postrouting"]),
            // iptables-nft's nat table hooks both in.
            (
                r#", {"family": "ip", "table": "nat", "name": "PREROUTING", "type": "nat", "hook": "prerouting"}, {"family": "ip", "table": "nat", "name": "POSTROUTING", "type": "nat", "hook": "postrouting"}"#,
                vec![],
                vec![],
            ),
            // A CNI's masquerading only: DNAT at prerouting goes.
            (
                r#", {"family": "inet", "table": "cni", "name": "masq", "type": "nat", "hook": "postrouting"}"#,
                vec![],
                vec!["ip prerouting"],
            ),
            // A filter chain is no NAT user; an ip6 one serves another family.
            (
                r#", {"family": "ip", "table": "fw", "name": "in", "type": "filter", "hook": "prerouting"}, {"family": "ip6", "table": "n", "name": "p", "type": "nat", "hook": "prerouting"}"#,
                vec![],
                vec!["ip prerouting", "ip postrouting"],
            ),
            ("", vec!["ip"], vec![]),
        ] {
            let c = chains(&format!(
                r#"{{"nftables": [{{"metainfo": {{}}}}, {{"chain": {}}}]}}"#,
                format!("{kube_proxy}{others}").replace("}, {", "}}, {\"chain\": {")
            ));
            assert_eq!(nat_hooks_lost(&plan, &c, &legacy), lost, "{others} {legacy:?}");
        }
        assert!(parse_nat_chains("nope").is_err());
    }

    #[test]
    fn listings_without_kube_proxy_and_broken_ones() {
        for (json, tables) in [
            (r#"{"nftables": [{"metainfo": {"version": "1.0.6"}}]}"#, 0),
            (r#"{"nftables": [{"metainfo": {}}, {"table": {"family": "ip", "name": "filter", "handle": 1}}]}"#, 1),
        ] {
            let t = parse_tables(json).expect(json);
            assert_eq!(t.len(), tables, "{json}");
            assert_eq!(plan(&t), Plan::default(), "{json}");
        }
        for bad in ["", "[]", r#"{"nftables": {}}"#, r#"{"nftables": [{"table": {"family": "ip"}}]}"#] {
            assert!(parse_tables(bad).is_err(), "{bad}");
        }
    }
}
