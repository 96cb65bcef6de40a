//! The difference between what the datapath holds and what the decisions
//! call for. Pure: the map writer applies the result.

use std::collections::{BTreeMap, BTreeSet};

use crate::model::{Backend, Frontend};

pub type State = BTreeMap<Frontend, BTreeSet<Backend>>;

/// What to change, per frontend. Each entry is applied atomically by the
/// writer; entries are independent of one another.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Frontends to create or whose backend set changes, with the new set.
    pub upserts: Vec<(Frontend, Vec<Backend>)>,
    /// Frontends to remove.
    pub deletes: Vec<Frontend>,
}

impl Plan {
    pub fn is_empty(&self) -> bool {
        self.upserts.is_empty() && self.deletes.is_empty()
    }
}

/// Frontends that are equal on both sides produce nothing, so re-applying
/// the same desired state is a no-op.
pub fn diff(current: &State, desired: &State) -> Plan {
    diff_entries(current, desired.iter(), |fe| desired.contains_key(fe))
}

/// [`diff`] against `primary` with the entries of `fallback` whose
/// frontend `primary` lacks, without building that union: a full pass at
/// 10k Services would otherwise copy every backend set once more at the
/// agent's memory peak.
pub fn diff_layered(current: &State, primary: &State, fallback: &State) -> Plan {
    let mut desired: BTreeMap<&Frontend, &BTreeSet<Backend>> = primary.iter().collect();
    for (fe, set) in fallback {
        desired.entry(fe).or_insert(set);
    }
    diff_entries(current, desired.iter().map(|(fe, set)| (*fe, *set)), |fe| desired.contains_key(fe))
}

fn diff_entries<'a>(
    current: &State,
    desired: impl Iterator<Item = (&'a Frontend, &'a BTreeSet<Backend>)>,
    wanted: impl Fn(&Frontend) -> bool,
) -> Plan {
    let mut plan = Plan::default();
    for (fe, want) in desired {
        if current.get(fe) != Some(want) {
            plan.upserts.push((*fe, want.iter().copied().collect()));
        }
    }
    for fe in current.keys() {
        if !wanted(fe) {
            plan.deletes.push(*fe);
        }
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Protocol;
    use std::net::IpAddr;

    fn fe(ip: &str, port: u16, protocol: Protocol) -> Frontend {
        Frontend { ip: ip.parse::<IpAddr>().unwrap(), port, protocol }
    }
    fn be(ip: &str, port: u16) -> Backend {
        Backend { ip: ip.parse::<IpAddr>().unwrap(), port }
    }
    fn state(entries: &[(Frontend, &[Backend])]) -> State {
        entries.iter().map(|(f, b)| (*f, b.iter().copied().collect())).collect()
    }

    #[test]
    fn table() {
        let a = fe("10.96.0.10", 80, Protocol::Tcp);
        let a_udp = fe("10.96.0.10", 80, Protocol::Udp);
        let b1 = be("10.244.0.1", 8080);
        let b2 = be("10.244.0.2", 8080);
        struct Case {
            name: &'static str,
            current: State,
            desired: State,
            upserts: Vec<(Frontend, Vec<Backend>)>,
            deletes: Vec<Frontend>,
        }
        let cases = vec![
            Case { name: "empty", current: state(&[]), desired: state(&[]), upserts: vec![], deletes: vec![] },
            Case {
                name: "create",
                current: state(&[]),
                desired: state(&[(a, &[b1, b2])]),
                upserts: vec![(a, vec![b1, b2])],
                deletes: vec![],
            },
            Case {
                name: "unchanged is a no-op",
                current: state(&[(a, &[b2, b1])]),
                desired: state(&[(a, &[b1, b2])]),
                upserts: vec![],
                deletes: vec![],
            },
            Case {
                name: "scale down to zero keeps the frontend",
                current: state(&[(a, &[b1])]),
                desired: state(&[(a, &[])]),
                upserts: vec![(a, vec![])],
                deletes: vec![],
            },
            Case {
                name: "protocol is part of the frontend",
                current: state(&[(a, &[b1])]),
                desired: state(&[(a, &[b1]), (a_udp, &[b2])]),
                upserts: vec![(a_udp, vec![b2])],
                deletes: vec![],
            },
            Case {
                name: "delete",
                current: state(&[(a, &[b1]), (a_udp, &[b2])]),
                desired: state(&[(a, &[b1])]),
                upserts: vec![],
                deletes: vec![a_udp],
            },
        ];
        for c in cases {
            let p = diff(&c.current, &c.desired);
            assert_eq!(p.upserts, c.upserts, "{}", c.name);
            assert_eq!(p.deletes, c.deletes, "{}", c.name);
        }
    }

    #[test]
    fn layered_is_the_diff_against_the_union_with_primary_first() {
        let a = fe("10.96.0.10", 80, Protocol::Tcp);
        let b = fe("10.96.0.11", 80, Protocol::Tcp);
        let c = fe("10.96.0.12", 80, Protocol::Tcp);
        let d = fe("10.96.0.13", 80, Protocol::Tcp);
        let b1 = be("10.244.0.1", 8080);
        let b2 = be("10.244.0.2", 8080);
        let current = state(&[(a, &[b1]), (b, &[b1]), (d, &[b2])]);
        let primary = state(&[(a, &[b1]), (c, &[b2])]);
        // `a` is in both: primary wins; `b` only in fallback.
        let fallback = state(&[(a, &[b2]), (b, &[b2])]);
        let mut union = fallback.clone();
        union.extend(primary.clone());
        let got = diff_layered(&current, &primary, &fallback);
        assert_eq!(got, diff(&current, &union));
        assert_eq!(got.upserts, vec![(b, vec![b2]), (c, vec![b2])]);
        assert_eq!(got.deletes, vec![d]);
    }
}
