//! Hold, don't guess (issue #47): whether a Service whose topology reads
//! labels of other Nodes can be decided with what the agent has listed.
//!
//! The agent watches other Nodes only for the labels some Service needs,
//! and only the Nodes hosting those Services' endpoints
//! (`topology::other_nodes_needed`). A Service that needs a label or a
//! Node the watch has not listed yet (a new node-pool Service that came
//! by watch, a key list changed to a new label, an endpoint on a new
//! Node) would rank its endpoints as if their Nodes had no such label:
//! for OpenYurt's node pools or a region key, that falls through to
//! another pool or to `*`, and connections cross the link the topology
//! exists to avoid until the relist lands. So such a Service keeps what
//! is programmed (or stays unprogrammed if new) until the listing covers
//! what it needs, then is programmed once, from complete labels.
//!
//! The wait is bounded (`--node-label-wait-secs`): a Node watch that
//! cannot list (RBAC, an API server that fails the request) would
//! otherwise keep a Service's endpoints from ever being programmed. Past
//! the limit the Service is decided with what is known, and the caller
//! says so loudly (an Event, a metric, a log line naming the label).
//!
//! Pure: the caller says what is needed, what the source listed and how
//! long the Service has waited.

use std::collections::BTreeSet;
use std::time::Duration;

use crate::decide::decision::ExternalState;
use crate::decide::plan::FrontendPolicy;
use crate::model::{Backend, Frontend, OtherNodes};

/// What the source has listed of other Nodes, completely.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Listed {
    /// Every label of every Node (manifests carry whole Nodes; `explain`).
    Everything,
    /// The labels and Nodes of the last complete listing of the other-Node
    /// watch (`OtherNodes::labels` empty: nothing listed, or not watched).
    Only(OtherNodes),
}

/// What a Service needs that has not been listed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Missing {
    /// Labels the watch did not list at all.
    pub labels: BTreeSet<String>,
    /// Nodes hosting its endpoints that the watch did not select.
    pub nodes: BTreeSet<String>,
}

impl std::fmt::Display for Missing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let join = |s: &BTreeSet<String>| s.iter().map(String::as_str).collect::<Vec<_>>().join(", ");
        match (self.labels.is_empty(), self.nodes.is_empty()) {
            (false, true) => write!(f, "other Nodes' label {} not listed yet", join(&self.labels)),
            (true, false) => write!(f, "Nodes {} not listed yet", join(&self.nodes)),
            _ => write!(f, "other Nodes' label {} not listed yet (Nodes {})", join(&self.labels), join(&self.nodes)),
        }
    }
}

/// What a Service that needs `labels` of the Nodes `nodes` (its
/// endpoints', `topology::endpoint_nodes`) lacks in `listed`, on node
/// `own` (whose own Node is watched whole, apart); `None`: nothing. A
/// ranking reads labels of its endpoints' Nodes only: with no endpoint on
/// another Node (none yet, or all on this one) nothing is missing, and a
/// Service without endpoints never waits.
pub fn missing(labels: &BTreeSet<String>, nodes: &BTreeSet<String>, own: &str, listed: &Listed) -> Option<Missing> {
    let Listed::Only(listed) = listed else { return None };
    let others: BTreeSet<&String> = nodes.iter().filter(|n| n.as_str() != own).collect();
    if labels.is_empty() || others.is_empty() {
        return None;
    }
    let m = Missing {
        labels: labels.difference(&listed.labels).cloned().collect(),
        nodes: match &listed.names {
            None => BTreeSet::new(),
            Some(names) => others.into_iter().filter(|n| !names.contains(*n)).cloned().collect(),
        },
    };
    (!m.labels.is_empty() || !m.nodes.is_empty()).then_some(m)
}

/// What to do with a Service missing something, after `waited`, with the
/// limit `limit`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Keep what is programmed; decide again when the listing lands.
    Hold,
    /// Waited too long: decide with what is known, and say so.
    GiveUp,
}

/// [`Verdict`] after `waited` of at most `limit` (zero: never hold, the
/// agent's behaviour before issue #47).
pub fn verdict(waited: Duration, limit: Duration) -> Verdict {
    if waited < limit { Verdict::Hold } else { Verdict::GiveUp }
}

/// What the TC maps hold for one frontend: its backends and its policy
/// (`None`: the default one).
pub type Programmed = (BTreeSet<Backend>, Option<FrontendPolicy>);

/// `ext` with each held frontend's TC entry (traffic from outside:
/// NodePorts, external and LoadBalancer IPs) kept as the TC maps hold it,
/// as the socket maps keep a held Service's frontends: `programmed` says
/// what they hold, and a frontend they do not hold yet (a new Service)
/// stays unwritten, with no policy-local flag. A held Service's Maglev
/// size and health check port come from its spec, not from other Nodes'
/// labels, and follow the decision.
pub fn hold_tc(mut ext: ExternalState, hold: &BTreeSet<Frontend>, programmed: impl Fn(&Frontend) -> Option<Programmed>) -> ExternalState {
    for fe in hold {
        let Some((backends, policy)) = programmed(fe) else {
            ext.tc.remove(fe);
            ext.tc_policies.remove(fe);
            ext.policy_local.remove(fe);
            continue;
        };
        ext.tc.insert(*fe, backends);
        match policy {
            Some(p) => ext.tc_policies.insert(*fe, p),
            None => ext.tc_policies.remove(fe),
        };
    }
    ext
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(v: &[&str]) -> BTreeSet<String> {
        v.iter().map(|s| (*s).to_string()).collect()
    }

    const POOL: &str = "apps.openyurt.io/nodepool";
    const REGION: &str = "topology.kubernetes.io/region";

    /// (name, labels needed, endpoint Nodes, listed, missing labels and Nodes).
    #[test]
    fn what_is_missing() {
        let only = |labels: &[&str], names: Option<&[&str]>| Listed::Only(OtherNodes { labels: set(labels), names: names.map(set) });
        type Case<'a> = (&'a str, &'a [&'a str], &'a [&'a str], Listed, Option<(&'a [&'a str], &'a [&'a str])>);
        let cases: Vec<Case<'_>> = vec![
            ("manifests: everything listed", &[POOL], &["a"], Listed::Everything, None),
            ("needs nothing", &[], &["a"], only(&[], Some(&[])), None),
            ("nothing listed yet", &[POOL], &["a", "b"], only(&[], Some(&[])), Some((&[POOL], &["a", "b"]))),
            ("listed, the same Nodes", &[POOL], &["a", "b"], only(&[POOL, "kubernetes.io/hostname"], Some(&["a", "b"])), None),
            ("listed, every Node", &[POOL], &["a", "b"], only(&[POOL], None), None),
            ("a label changed to a new one", &[REGION], &["a"], only(&[POOL], Some(&["a"])), Some((&[REGION], &[]))),
            ("an endpoint on a new Node", &[POOL], &["a", "c"], only(&[POOL], Some(&["a"])), Some((&[], &["c"]))),
            ("this node is watched apart", &[POOL], &["me", "a"], only(&[POOL], Some(&["a"])), None),
            ("this node is watched apart, a label missing", &[POOL], &["me", "a"], only(&[], Some(&[])), Some((&[POOL], &["a"]))),
            ("no endpoint yet: nothing to read", &[POOL], &[], only(&[], Some(&[])), None),
            ("endpoints on this node only", &[POOL], &["me"], only(&[], Some(&[])), None),
            ("two labels, one listed", &[POOL, REGION], &["a"], only(&[POOL], Some(&["a"])), Some((&[REGION], &[]))),
        ];
        for (name, labels, nodes, listed, want) in cases {
            let got = missing(&set(labels), &set(nodes), "me", &listed);
            let want = want.map(|(l, n)| Missing { labels: set(l), nodes: set(n) });
            assert_eq!(got, want, "{name}");
        }
    }

    #[test]
    fn hold_until_the_limit_then_give_up() {
        let s = Duration::from_secs;
        for (waited, limit, want) in [
            (s(0), s(10), Verdict::Hold),
            (s(9), s(10), Verdict::Hold),
            (s(10), s(10), Verdict::GiveUp),
            (s(11), s(10), Verdict::GiveUp),
            (s(0), s(0), Verdict::GiveUp),
        ] {
            assert_eq!(verdict(waited, limit), want, "{waited:?} of {limit:?}");
        }
    }

    #[test]
    fn missing_reads_well() {
        let m = Missing { labels: set(&[POOL]), nodes: BTreeSet::new() };
        assert_eq!(m.to_string(), "other Nodes' label apps.openyurt.io/nodepool not listed yet");
        let m = Missing { labels: BTreeSet::new(), nodes: set(&["a", "b"]) };
        assert_eq!(m.to_string(), "Nodes a, b not listed yet");
    }

    /// (name, decided TC entries, programmed TC entries, held frontends,
    /// the entries written).
    #[test]
    fn held_tc_frontends_keep_what_is_programmed() {
        use std::collections::BTreeMap;
        use std::net::{IpAddr, Ipv4Addr};

        use crate::model::Protocol;
        let fe = |port: u16| Frontend { ip: IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1)), port, protocol: Protocol::Tcp };
        let b = |last: u8| Backend { ip: IpAddr::V4(Ipv4Addr::new(10, 244, 0, last)), port: 9376 };
        let state = |entries: &[(u16, &[u8])]| -> BTreeMap<Frontend, BTreeSet<Backend>> {
            entries.iter().map(|(p, bs)| (fe(*p), bs.iter().map(|l| b(*l)).collect())).collect()
        };
        type Case<'a> = (&'a str, &'a [(u16, &'a [u8])], &'a [(u16, &'a [u8])], &'a [u16], &'a [(u16, &'a [u8])]);
        let cases: Vec<Case<'_>> = vec![
            ("nothing held: the decision", &[(30001, &[1, 2])], &[(30001, &[1])], &[], &[(30001, &[1, 2])]),
            ("held: as programmed, not the guess", &[(30001, &[1, 2])], &[(30001, &[1])], &[30001], &[(30001, &[1])]),
            ("held and new: unwritten", &[(30001, &[1, 2]), (30002, &[3])], &[(30002, &[3])], &[30001], &[(30002, &[3])]),
            ("held, gone from the decision: kept", &[], &[(30001, &[1])], &[30001], &[(30001, &[1])]),
            ("a held ClusterIP has no TC entry", &[(30001, &[1])], &[(30001, &[1])], &[80], &[(30001, &[1])]),
        ];
        for (name, decided, programmed, hold, want) in cases {
            let mut ext = ExternalState { tc: state(decided), ..Default::default() };
            ext.policy_local = ext.tc.keys().copied().collect();
            let programmed = state(programmed);
            let hold: BTreeSet<Frontend> = hold.iter().map(|p| fe(*p)).collect();
            let got = hold_tc(ext, &hold, |f| programmed.get(f).map(|s| (s.clone(), None)));
            assert_eq!(got.tc, state(want), "{name}");
            let unwritten: Vec<&Frontend> = hold.iter().filter(|f| !got.tc.contains_key(f)).collect();
            assert!(unwritten.iter().all(|f| !got.policy_local.contains(f)), "{name}: an unwritten frontend has no flag");
        }
        // A held frontend's policy is the programmed one, the default one
        // included.
        let p = FrontendPolicy { affinity_timeout_s: Some(10800), ..Default::default() };
        let mut ext = ExternalState { tc: state(&[(30001, &[1, 2])]), ..Default::default() };
        ext.tc_policies.insert(fe(30001), p.clone());
        let held: BTreeSet<Frontend> = [fe(30001)].into();
        let got = hold_tc(ext.clone(), &held, |_| Some((state(&[(30001, &[1])])[&fe(30001)].clone(), None)));
        assert!(got.tc_policies.is_empty(), "{:?}", got.tc_policies);
        let got = hold_tc(ExternalState { tc_policies: BTreeMap::default(), ..ext }, &held, |_| Some((BTreeSet::new(), Some(p.clone()))));
        assert_eq!(got.tc_policies.get(&fe(30001)), Some(&p));
    }
}
