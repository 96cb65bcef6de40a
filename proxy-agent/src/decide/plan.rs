//! The difference between what the datapath holds and what the decisions
//! call for. Pure: the map writer applies the result.

use proxy_common::{SLOT_GROUPS, SlotGroup};
use std::collections::{BTreeMap, BTreeSet};

use crate::model::{Backend, Cidr, Frontend};

/// Each frontend's backend set: what the maps hold, or should hold.
pub type State = BTreeMap<Frontend, BTreeSet<Backend>>;

/// What a frontend needs besides its backends. The default (no affinity,
/// no source filter) is what most frontends have.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FrontendPolicy {
    /// `sessionAffinity: ClientIP`: the timeout in seconds.
    pub affinity_timeout_s: Option<u32>,
    /// With affinity: the id under which clients' choices are kept, one per
    /// Service port and family (see `decision::affinity_scope`), so that a
    /// client keeps its backend across the port's frontends as kube-proxy
    /// keeps it. 0 without affinity.
    pub affinity_scope: u32,
    /// `loadBalancerSourceRanges` (LoadBalancer ingress IPs only).
    pub source_ranges: Option<SourceRanges>,
    /// Graded spill-over between topology tiers (issue #48): how many
    /// slots each backend takes. `None`: one each.
    pub slot_weights: Option<SlotWeights>,
}

/// The slot count of each backend of a frontend, sorted by backend and
/// never all equal (equal counts are one slot each, [`SlotWeights::new`]).
/// The socket datapath picks a slot by hash modulo the slot count, so a
/// backend's chance of a new connection is its slots over the total;
/// the connect hit path does the same lookups as with one slot each.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlotWeights(std::sync::Arc<[(Backend, u32)]>);

impl SlotWeights {
    /// Weights from `(backend, slots)` pairs; `None` when they are empty
    /// or all the same (one slot each picks alike, and is what a frontend
    /// without weights is programmed with).
    pub fn new(mut w: Vec<(Backend, u32)>) -> Option<SlotWeights> {
        w.sort();
        w.dedup_by_key(|(b, _)| *b);
        let first = w.first()?.1;
        if w.iter().all(|(_, n)| *n == first) {
            return None;
        }
        Some(SlotWeights(w.into()))
    }

    /// The weights read back from a slot array listing each backend as
    /// many times as its weight (`None` when each is listed once, or all
    /// equally often).
    pub fn of_slots(slots: &[Backend]) -> Option<SlotWeights> {
        let mut counts: BTreeMap<Backend, u32> = BTreeMap::new();
        for b in slots {
            *counts.entry(*b).or_default() += 1;
        }
        SlotWeights::new(counts.into_iter().collect())
    }

    /// Each backend with its slot count.
    pub fn entries(&self) -> &[(Backend, u32)] {
        &self.0
    }

    /// The slot array of `backends` in groups of equal weight, for
    /// `ServiceValue::groups` (the datapath picks a group by its weight,
    /// then a slot of it alike): each backend once, the groups from the
    /// largest weight down, with each group's slot end and the weights
    /// summed up to it, the unused groups zero. A backend without a
    /// weight takes 1, one of weight 0 no slot. `None` with more distinct
    /// weights than `proxy_common::SLOT_GROUPS` or a sum past `u32`: then
    /// [`expand`](Self::expand).
    pub fn grouped(&self, backends: &[Backend]) -> Option<(Vec<Backend>, [SlotGroup; SLOT_GROUPS])> {
        let mut by_weight: BTreeMap<std::cmp::Reverse<u32>, Vec<Backend>> = BTreeMap::new();
        for b in backends {
            let w = self.weight_of(b);
            if w > 0 {
                by_weight.entry(std::cmp::Reverse(w)).or_default().push(*b);
            }
        }
        if by_weight.is_empty() || by_weight.len() > proxy_common::SLOT_GROUPS {
            return None;
        }
        let (mut slots, mut groups, mut total) = (Vec::new(), [SlotGroup::default(); SLOT_GROUPS], 0u32);
        for (g, (std::cmp::Reverse(w), members)) in groups.iter_mut().zip(by_weight) {
            total = total.checked_add(w.checked_mul(u32::try_from(members.len()).ok()?)?)?;
            slots.extend(members);
            *g = SlotGroup { slot_end: u32::try_from(slots.len()).ok()?, weight_end: total };
        }
        Some((slots, groups))
    }

    /// The weights of a grouped slot array read back from the maps:
    /// `slots` as listed, `groups` the service entry's (see
    /// [`grouped`](Self::grouped)). `None` when a group's weight does not
    /// split evenly over its slots or the groups do not fit the slots (not
    /// what `grouped` writes: the frontend is written again).
    pub fn of_groups(slots: &[Backend], groups: &[SlotGroup]) -> Option<SlotWeights> {
        let (mut start, mut before) = (0u32, 0u32);
        let mut w = Vec::new();
        for &SlotGroup { slot_end: end, weight_end: sum } in groups.iter().take_while(|g| g.slot_end != 0) {
            let n = end.checked_sub(start).filter(|n| *n > 0)?;
            let group = sum.checked_sub(before)?;
            if group % n != 0 {
                return None;
            }
            for b in slots.get(start as usize..end as usize)? {
                w.push((*b, group / n));
            }
            (start, before) = (end, sum);
        }
        if start as usize != slots.len() {
            return None;
        }
        SlotWeights::new(w)
    }

    fn weight_of(&self, b: &Backend) -> u32 {
        match self.0.binary_search_by(|(x, _)| x.cmp(b)) {
            Ok(i) => self.0[i].1,
            Err(_) => 1,
        }
    }

    /// The slot array of `backends`: each listed as many times as its
    /// weight, in order. A backend without a weight takes one slot (never
    /// dropped), and one of weight 0 none.
    pub fn expand(&self, backends: &[Backend]) -> Vec<Backend> {
        let mut out = Vec::new();
        for b in backends {
            out.extend(std::iter::repeat_n(*b, self.weight_of(b) as usize));
        }
        out
    }
}

impl FrontendPolicy {
    /// Whether the frontend has no affinity and no source filter, so nothing but its backends is written.
    pub fn is_default(&self) -> bool {
        *self == FrontendPolicy::default()
    }
}

/// Who may reach a frontend with `loadBalancerSourceRanges`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SourceRanges {
    /// The ranges of the frontend's address family. Empty: nobody (the
    /// filter fails closed when no range of the Service parsed, or none is
    /// of this family).
    pub cidrs: Vec<Cidr>,
    /// One of the node's addresses lies inside a range, so the node's own
    /// processes may connect (the socket datapath, which cannot see their
    /// source address yet; kube-proxy lets the node through the same way).
    pub node: bool,
}

/// Frontends whose policy is not the default, with it.
pub type Policies = BTreeMap<Frontend, FrontendPolicy>;

/// What to change, per frontend. Each entry is applied atomically by the
/// writer; entries are independent of one another.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Frontends to create or whose backend set or policy changes, with the
    /// new set.
    pub upserts: Vec<(Frontend, Vec<Backend>)>,
    /// Frontends to remove.
    pub deletes: Vec<Frontend>,
    /// The policy of each upsert whose policy is not the default.
    pub policies: Policies,
}

impl Plan {
    /// Whether nothing changes.
    pub fn is_empty(&self) -> bool {
        self.upserts.is_empty() && self.deletes.is_empty()
    }

    /// The policy an upserted frontend is to be written with.
    pub fn policy_of(&self, fe: &Frontend) -> &FrontendPolicy {
        static DEFAULT: FrontendPolicy =
            FrontendPolicy { affinity_timeout_s: None, affinity_scope: 0, source_ranges: None, slot_weights: None };
        self.policies.get(fe).unwrap_or(&DEFAULT)
    }
}

/// Frontends that are equal on both sides produce nothing, so re-applying
/// the same desired state is a no-op. Every frontend gets the default
/// policy.
pub fn diff(current: &State, desired: &State) -> Plan {
    diff_with_policies(current, &Policies::new(), desired, &Policies::new())
}

/// [`diff`] where a frontend whose policy differs is rewritten too, also
/// when its backends are the same.
pub fn diff_with_policies(current: &State, current_policies: &Policies, desired: &State, desired_policies: &Policies) -> Plan {
    diff_entries(current, current_policies, desired.iter(), desired_policies, |fe| desired.contains_key(fe))
}

/// [`diff_with_policies`] against `primary` with the entries of `fallback`
/// whose frontend `primary` lacks, without building that union: a full
/// pass at 10k Services would otherwise copy every backend set once more at
/// the agent's memory peak. `desired_policies` covers both.
pub fn diff_layered(current: &State, current_policies: &Policies, primary: &State, fallback: &State, desired_policies: &Policies) -> Plan {
    let mut desired: BTreeMap<&Frontend, &BTreeSet<Backend>> = primary.iter().collect();
    for (fe, set) in fallback {
        desired.entry(fe).or_insert(set);
    }
    diff_entries(current, current_policies, desired.iter().map(|(fe, set)| (*fe, *set)), desired_policies, |fe| desired.contains_key(fe))
}

/// [`diff_layered`] with every side given one frontend at a time, in
/// frontend order, instead of held as a State: at 100k Services a full
/// pass would otherwise hold a copy of every programmed set (`current`)
/// and of every desired one (`primary`) beside the maps' own. `current`
/// gives each set in any order (as the maps hold it); each `primary` set
/// is sorted and without duplicates (as a `BTreeSet` iterates), and moves
/// into the plan as it is when it differs.
pub fn diff_layered_streams<'c>(
    current: impl Iterator<Item = (Frontend, &'c [Backend])>,
    current_policies: &Policies,
    primary: impl Iterator<Item = (Frontend, Vec<Backend>)>,
    fallback: &State,
    desired_policies: &Policies,
) -> Plan {
    let mut plan = Plan::default();
    let mut current = current.peekable();
    let mut primary = primary.peekable();
    let mut fallback = fallback.iter().peekable();
    loop {
        // The desired state is the union in frontend order, primary first
        // on the same frontend.
        let desired = match (primary.peek(), fallback.peek()) {
            (Some((p, _)), Some((f, _))) if p > *f => fallback.next().map(|(fe, set)| (*fe, Want::Set(set))),
            (Some(_), _) => {
                let next = primary.next().map(|(fe, list)| (fe, Want::Sorted(list)));
                if let (Some((fe, _)), Some((f, _))) = (&next, fallback.peek())
                    && fe == *f
                {
                    fallback.next();
                }
                next
            }
            (None, _) => fallback.next().map(|(fe, set)| (*fe, Want::Set(set))),
        };
        // Programmed frontends before it are no longer wanted.
        while let Some((fe, _)) = current.next_if(|(fe, _)| desired.as_ref().is_none_or(|(d, _)| fe < d)) {
            plan.deletes.push(fe);
        }
        let Some((fe, want)) = desired else { break };
        let have = current.next_if(|(c, _)| *c == fe).map(|(_, set)| set);
        let same = have.is_some_and(|have| same_set(have, &want.as_sorted()));
        upsert_if_changed(&mut plan, current_policies, desired_policies, &fe, same, || want.into_vec());
    }
    // Held while the plan is written, at the agent's memory peak.
    plan.upserts.shrink_to_fit();
    plan
}

/// A desired set in [`diff_layered_streams`].
enum Want<'a> {
    Sorted(Vec<Backend>),
    Set(&'a BTreeSet<Backend>),
}

impl Want<'_> {
    /// Its backends, sorted and without duplicates.
    fn as_sorted(&self) -> std::borrow::Cow<'_, [Backend]> {
        match self {
            Want::Sorted(v) => std::borrow::Cow::Borrowed(v.as_slice()),
            Want::Set(s) => std::borrow::Cow::Owned(s.iter().copied().collect()),
        }
    }

    fn into_vec(self) -> Vec<Backend> {
        match self {
            Want::Sorted(v) => v,
            Want::Set(s) => s.iter().copied().collect(),
        }
    }
}

/// Whether `have` (in any order, maybe with duplicates) is the set `want`
/// (sorted, without duplicates).
fn same_set(have: &[Backend], want: &[Backend]) -> bool {
    if have.windows(2).all(|w| w[0] < w[1]) {
        return have == want;
    }
    let mut have = have.to_vec();
    have.sort_unstable();
    have.dedup();
    have == want
}

/// A default policy listed in a map is the same as none listed.
fn listed_policy<'p>(m: &'p Policies, fe: &Frontend) -> Option<&'p FrontendPolicy> {
    m.get(fe).filter(|p| !p.is_default())
}

/// Adds `fe` to the plan's upserts, with `want()`, unless its backends
/// are the `same` as the current ones and so is its policy.
fn upsert_if_changed(
    plan: &mut Plan,
    current_policies: &Policies,
    desired_policies: &Policies,
    fe: &Frontend,
    same: bool,
    want: impl FnOnce() -> Vec<Backend>,
) {
    let want_policy = listed_policy(desired_policies, fe);
    if !same || listed_policy(current_policies, fe) != want_policy {
        plan.upserts.push((*fe, want()));
        if let Some(p) = want_policy {
            plan.policies.insert(*fe, p.clone());
        }
    }
}

fn diff_entries<'a>(
    current: &State,
    current_policies: &Policies,
    desired: impl Iterator<Item = (&'a Frontend, &'a BTreeSet<Backend>)>,
    desired_policies: &Policies,
    wanted: impl Fn(&Frontend) -> bool,
) -> Plan {
    let mut plan = Plan::default();
    for (fe, want) in desired {
        upsert_if_changed(&mut plan, current_policies, desired_policies, fe, current.get(fe) == Some(want), || {
            want.iter().copied().collect()
        });
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
        let current = state(&[(a, &[b1, b2]), (b, &[b1]), (d, &[b2])]);
        let primary = state(&[(a, &[b1, b2]), (c, &[b2])]);
        // `a` is in both: primary wins; `b` only in fallback.
        let fallback = state(&[(a, &[b2]), (b, &[b2])]);
        let mut union = fallback.clone();
        union.extend(primary.clone());
        let none = Policies::new();
        let got = diff_layered(&current, &none, &primary, &fallback, &none);
        assert_eq!(got, diff(&current, &union));
        let lists =
            |s: &State| -> Vec<(Frontend, Vec<Backend>)> { s.iter().map(|(fe, set)| (*fe, set.iter().copied().collect())).collect() };
        let have = lists(&current);
        let streams = |have: &[(Frontend, Vec<Backend>)]| {
            diff_layered_streams(have.iter().map(|(fe, l)| (*fe, l.as_slice())), &none, lists(&primary).into_iter(), &fallback, &none)
        };
        assert_eq!(streams(&have), got);
        // The maps may hold a set in any order, with duplicates.
        let shuffled: Vec<(Frontend, Vec<Backend>)> =
            have.iter().map(|(fe, l)| (*fe, l.iter().rev().chain(l).copied().collect())).collect();
        assert_eq!(streams(&shuffled), got);
        assert_eq!(got.upserts, vec![(b, vec![b2]), (c, vec![b2])]);
        assert_eq!(got.deletes, vec![d]);
    }

    #[test]
    fn slot_weights_expand_and_read_back() {
        let (b1, b2, b3) = (be("10.244.0.1", 80), be("10.244.0.2", 80), be("10.244.0.3", 80));
        assert_eq!(SlotWeights::new(vec![]), None);
        assert_eq!(SlotWeights::new(vec![(b1, 5), (b2, 5)]), None, "equal weights are one slot each");
        let w = SlotWeights::new(vec![(b2, 1), (b1, 3)]).unwrap();
        assert_eq!(w.entries(), &[(b1, 3), (b2, 1)]);
        let slots = w.expand(&[b1, b2, b3]);
        assert_eq!(slots, vec![b1, b1, b1, b2, b3], "a backend without a weight keeps one slot");
        assert_eq!(SlotWeights::of_slots(&w.expand(&[b1, b2])), Some(w.clone()));
        assert_eq!(SlotWeights::of_slots(&[b1, b2, b3]), None);
        assert_eq!(SlotWeights::of_slots(&[b2, b1, b2, b1]), None);
        // Grouped: each backend once, the heaviest group first, and read
        // back to the same weights.
        let g = |slot_end: u32, weight_end: u32| SlotGroup { slot_end, weight_end };
        let (slots, groups) = w.grouped(&[b1, b2, b3]).expect("two weights fit the groups");
        assert_eq!((slots.clone(), groups), (vec![b1, b2, b3], [g(1, 3), g(3, 5), g(0, 0), g(0, 0)]));
        let of = |bs: &[Backend]| SlotWeights::new(bs.iter().map(|b| (*b, w.weight_of(b))).collect());
        assert_eq!(SlotWeights::of_groups(&slots, &groups), of(&[b1, b2, b3]));
        assert_eq!(SlotWeights::of_groups(&slots, &[g(1, 3), g(3, 4)]), None, "a weight of 1 does not split over 2 slots");
        assert_eq!(SlotWeights::of_groups(&slots, &[g(1, 3)]), None, "the groups must cover the slots");
        // More distinct weights than the groups hold: expanded instead.
        let many: Vec<Backend> = (1..=5).map(|i| be(&format!("10.244.1.{i}"), 80)).collect();
        let five = SlotWeights::new(many.iter().zip(1..).map(|(b, n)| (*b, n)).collect()).unwrap();
        assert_eq!(five.grouped(&many), None);
        assert_eq!(five.grouped(&many[..4]).map(|(_, groups)| groups), Some([g(1, 4), g(2, 7), g(3, 9), g(4, 10)]));
    }

    #[test]
    fn a_policy_change_rewrites_the_frontend_with_its_backends() {
        let a = fe("10.96.0.10", 80, Protocol::Tcp);
        let b1 = be("10.244.0.1", 8080);
        let sticky = FrontendPolicy { affinity_timeout_s: Some(10_800), affinity_scope: 1, ..Default::default() };
        let shorter = FrontendPolicy { affinity_timeout_s: Some(2), affinity_scope: 1, ..Default::default() };
        let closed = FrontendPolicy { source_ranges: Some(SourceRanges::default()), ..Default::default() };
        let b2 = be("10.244.0.2", 8080);
        let weighted = FrontendPolicy { slot_weights: SlotWeights::new(vec![(b1, 3), (b2, 1)]), ..Default::default() };
        let reweighted = FrontendPolicy { slot_weights: SlotWeights::new(vec![(b1, 1), (b2, 3)]), ..Default::default() };
        let pol = |p: Option<&FrontendPolicy>| -> Policies { p.map(|p| (a, p.clone())).into_iter().collect() };
        let st = state(&[(a, &[b1])]);
        // (name, current policy, desired policy, rewritten)
        let cases = [
            ("none to none", None, None, false),
            ("affinity on", None, Some(&sticky), true),
            ("affinity unchanged", Some(&sticky), Some(&sticky), false),
            ("timeout changes", Some(&sticky), Some(&shorter), true),
            ("affinity off", Some(&sticky), None, true),
            ("source filter on, fails closed", None, Some(&closed), true),
            ("a listed default is no policy", None, Some(&FrontendPolicy::default()), false),
            ("spill weights on", None, Some(&weighted), true),
            ("spill weights unchanged", Some(&weighted), Some(&weighted), false),
            ("spill shares change", Some(&weighted), Some(&reweighted), true),
            ("spill weights off", Some(&weighted), None, true),
        ];
        for (name, cur, want, rewritten) in cases {
            let plan = diff_with_policies(&st, &pol(cur), &st, &pol(want));
            assert_eq!(plan.upserts == vec![(a, vec![b1])], rewritten, "{name}");
            assert!(plan.deletes.is_empty(), "{name}");
            let written = if rewritten { want.filter(|p| !p.is_default()).cloned().unwrap_or_default() } else { FrontendPolicy::default() };
            assert_eq!(plan.policy_of(&a), &written, "{name}");
        }
        // A backend change carries the unchanged policy along.
        let plan = diff_with_policies(&st, &pol(Some(&sticky)), &state(&[(a, &[])]), &pol(Some(&sticky)));
        assert_eq!(plan.upserts, vec![(a, vec![])]);
        assert_eq!(plan.policy_of(&a), &sticky);
    }
}
