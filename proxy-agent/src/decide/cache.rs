//! Decisions and the desired socket-datapath state kept between syncs, so
//! that a sync costs in proportion to what changed rather than to the size
//! of the cluster (at 10k Services, deciding everything again takes tens of
//! milliseconds; one Service takes microseconds).
//!
//! Each Service is decided by `decision::decide_service`, the same function
//! `decision::decide` (and so `explain` and manifests mode) uses, and a
//! frontend claimed by several Services goes to the first in
//! namespace/name order, as `decision::desired_state` decides it. The
//! result is therefore the same as a full recomputation; the tests below
//! check that after every step of a sequence of changes. Pure: no kube,
//! aya or tokio.

use std::collections::{BTreeMap, BTreeSet};

use crate::decide::decision::{self, PortDecision};
use crate::decide::plan::{Policies, State};
use crate::decide::topology::NodeContext;
use crate::model::store::Changes;
use crate::model::{Cluster, EndpointSlice, Family, Frontend, ObjectRef};

/// What one update changed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Update {
    /// ClusterIP frontends whose desired entry may differ.
    pub frontends: BTreeSet<Frontend>,
    /// Services decided again, and the owners of `frontends`.
    pub services: BTreeSet<ObjectRef>,
}

/// A small set kept as a sorted Vec of exact capacity. Nearly every set
/// here has one element (a Service's only slice, a frontend's only
/// claimant), for which a BTreeSet allocates a whole node of eleven: 544
/// bytes for one ObjectRef, 10 MiB of the agent's peak at 10k Services.
/// Iterates in ascending order, as a BTreeSet does, so the first claimant
/// in namespace/name order is `first()`.
#[derive(Clone, Debug)]
struct SortedVec<T>(Vec<T>);

impl<T> Default for SortedVec<T> {
    fn default() -> Self {
        SortedVec(Vec::new())
    }
}

impl<T: Ord> SortedVec<T> {
    fn insert(&mut self, v: T) {
        if let Err(i) = self.0.binary_search(&v) {
            self.0.reserve_exact(1);
            self.0.insert(i, v);
        }
    }

    fn remove(&mut self, v: &T) {
        if let Ok(i) = self.0.binary_search(v) {
            self.0.remove(i);
            if self.0.len() * 2 <= self.0.capacity() {
                self.0.shrink_to_fit();
            }
        }
    }

    fn first(&self) -> Option<&T> {
        self.0.first()
    }

    fn len(&self) -> usize {
        self.0.len()
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn iter(&self) -> std::slice::Iter<'_, T> {
        self.0.iter()
    }
}

#[derive(Default)]
pub(crate) struct DecisionCache {
    node: String,
    /// Decisions per Service, ports in spec order.
    decisions: BTreeMap<ObjectRef, Vec<PortDecision>>,
    /// Slices by owning Service (namespace + service-name label), and each
    /// slice's owner as last seen, so a relabelled slice leaves its old one.
    slices_of: BTreeMap<ObjectRef, SortedVec<ObjectRef>>,
    owner_of: BTreeMap<ObjectRef, ObjectRef>,
    /// Services claiming each ClusterIP frontend; the first one owns it.
    claims: BTreeMap<Frontend, SortedVec<ObjectRef>>,
    /// ClusterIP frontends with their backends: what `desired_state` gives.
    desired: State,
    /// Their policies, where not the default: what `desired_policies` gives.
    desired_policies: Policies,
    /// Frontends claimed by more than one Service.
    clashed: BTreeSet<Frontend>,
    /// Services with a decision that carries problems.
    with_problems: BTreeSet<ObjectRef>,
}

impl DecisionCache {
    pub(crate) fn new(node: &str) -> DecisionCache {
        DecisionCache { node: node.to_string(), ..DecisionCache::default() }
    }

    /// Brings the decisions up to `cluster` and returns the ClusterIP
    /// frontends whose desired backends may have changed (added, removed
    /// or updated), and the Services decided again.
    pub(crate) fn update(&mut self, cluster: &Cluster, changes: &Changes) -> Update {
        let mut affected: BTreeSet<ObjectRef> = changes.services.clone();
        if changes.all {
            self.slices_of.clear();
            self.owner_of.clear();
            for s in cluster.slices.values() {
                self.index_slice(s);
            }
            affected.extend(self.decisions.keys().cloned());
            affected.extend(cluster.services.keys().cloned());
        } else {
            for id in &changes.slices {
                if let Some(old) = self.owner_of.remove(id) {
                    if let Some(set) = self.slices_of.get_mut(&old) {
                        set.remove(id);
                        if set.is_empty() {
                            self.slices_of.remove(&old);
                        }
                    }
                    affected.insert(old);
                }
                if let Some(s) = cluster.slices.get(id) {
                    affected.insert(self.index_slice(s));
                }
            }
        }

        let node = self.node.clone();
        let ctx = NodeContext { name: &node, nodes: &cluster.nodes };
        let mut touched = BTreeSet::new();
        for id in &affected {
            let new = match cluster.services.get(id) {
                Some(svc) => {
                    let slices: Vec<&EndpointSlice> =
                        self.slices_of.get(id).into_iter().flat_map(SortedVec::iter).filter_map(|s| cluster.slices.get(s)).collect();
                    let mut out = Vec::with_capacity(svc.ports.len());
                    decision::decide_service(svc, &slices, ctx, &mut out);
                    Some(out)
                }
                None => None,
            };
            if new.iter().flatten().any(|d| !d.problems.is_empty()) {
                self.with_problems.insert(id.clone());
            } else {
                self.with_problems.remove(id);
            }
            let old = match new {
                Some(d) => self.decisions.insert(id.clone(), d),
                None => self.decisions.remove(id),
            };
            let old_fes: BTreeSet<Frontend> = old.iter().flatten().flat_map(|d| d.frontends.iter().copied()).collect();
            let new_fes: BTreeSet<Frontend> =
                self.decisions.get(id).into_iter().flatten().flat_map(|d| d.frontends.iter().copied()).collect();
            for fe in old_fes.difference(&new_fes) {
                if let Some(set) = self.claims.get_mut(fe) {
                    set.remove(id);
                    if set.is_empty() {
                        self.claims.remove(fe);
                    }
                }
            }
            for fe in &new_fes {
                self.claims.entry(*fe).or_default().insert(id.clone());
            }
            touched.extend(old_fes);
            touched.extend(new_fes);
        }
        for fe in &touched {
            if self.claims.get(fe).is_some_and(|c| c.len() > 1) {
                self.clashed.insert(*fe);
            } else {
                self.clashed.remove(fe);
            }
            match self.backends_for(fe) {
                Some(set) => {
                    self.desired.insert(*fe, set);
                }
                None => {
                    self.desired.remove(fe);
                }
            }
            match self.policy_for(fe) {
                Some(p) => {
                    self.desired_policies.insert(*fe, p);
                }
                None => {
                    self.desired_policies.remove(fe);
                }
            }
        }
        // A frontend's owner may be a Service that did not change (it
        // claimed the frontend second and now owns it).
        for fe in &touched {
            if let Some(owner) = self.owner(fe) {
                affected.insert(owner.clone());
            }
        }
        Update { frontends: touched, services: affected }
    }

    /// The Service that owns a ClusterIP frontend.
    pub(crate) fn owner(&self, fe: &Frontend) -> Option<&ObjectRef> {
        self.claims.get(fe)?.first()
    }

    /// The EndpointSlices of `service` in `cluster`, through the index
    /// kept here rather than a scan of every slice.
    pub(crate) fn slices_of<'a>(&'a self, cluster: &'a Cluster, service: &ObjectRef) -> impl Iterator<Item = &'a EndpointSlice> + 'a {
        self.slices_of.get(service).into_iter().flat_map(SortedVec::iter).filter_map(|s| cluster.slices.get(s))
    }

    /// The ClusterIP frontends `service` owns.
    pub(crate) fn owned_frontends<'a>(&'a self, service: &'a ObjectRef) -> impl Iterator<Item = &'a Frontend> + 'a {
        self.decisions.get(service).into_iter().flatten().flat_map(|d| d.frontends.iter()).filter(move |fe| self.owner(fe) == Some(service))
    }

    fn index_slice(&mut self, s: &EndpointSlice) -> ObjectRef {
        let owner = ObjectRef::new(s.id.namespace.clone(), s.service_name.clone());
        self.slices_of.entry(owner.clone()).or_default().insert(s.id.clone());
        self.owner_of.insert(s.id.clone(), owner.clone());
        owner
    }

    /// The backends of `fe` from its owner: the first claiming Service, and
    /// within it the first port with that frontend (as `desired_state`).
    fn backends_for(&self, fe: &Frontend) -> Option<std::collections::BTreeSet<crate::model::Backend>> {
        let owner = self.claims.get(fe)?.first()?;
        let d = self.decisions.get(owner)?.iter().find(|d| d.frontends.contains(fe))?;
        let fam = Family::of(&fe.ip);
        Some(d.internal_backends().iter().filter(|b| Family::of(&b.ip) == fam).copied().collect())
    }

    /// The policy of `fe` from its owner (as [`Self::backends_for`]), when
    /// it is not the default.
    fn policy_for(&self, fe: &Frontend) -> Option<crate::decide::plan::FrontendPolicy> {
        let owner = self.claims.get(fe)?.first()?;
        let d = self.decisions.get(owner)?.iter().find(|d| d.frontends.contains(fe))?;
        Some(d.frontend_policy(fe, &[], false)).filter(|p| !p.is_default())
    }

    /// The ClusterIP part of the desired socket state.
    pub(crate) fn desired(&self) -> &State {
        &self.desired
    }

    /// The policies of the ClusterIP frontends in [`Self::desired`] that
    /// have one.
    pub(crate) fn desired_policies(&self) -> &Policies {
        &self.desired_policies
    }

    /// Every decision, Services in namespace/name order, ports in spec
    /// order (the order `decision::decide` returns them in).
    pub(crate) fn decisions(&self) -> impl Iterator<Item = &PortDecision> + Clone {
        self.decisions.values().flatten()
    }

    /// Frontends claimed by more than one Service, reported like
    /// `decision::desired_state` reports them.
    pub(crate) fn clashes(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (fe, set) in self.clashed.iter().filter_map(|fe| Some((fe, self.claims.get(fe)?))) {
            let mut it = set.iter();
            let Some(first) = it.next() else { continue };
            for other in it {
                out.push(format!("Service {other}: frontend {fe} is already used by Service {first}; ignored"));
            }
        }
        out
    }

    /// The decisions that carry problems, in the order of [`Self::decisions`].
    pub(crate) fn decisions_with_problems(&self) -> impl Iterator<Item = &PortDecision> {
        self.with_problems.iter().filter_map(|id| self.decisions.get(id)).flatten().filter(|d| !d.problems.is_empty())
    }

    /// The decisions of one Service.
    pub(crate) fn decisions_of(&self, id: &ObjectRef) -> &[PortDecision] {
        self.decisions.get(id).map_or(&[], Vec::as_slice)
    }

    /// Every decided Service.
    pub(crate) fn service_ids(&self) -> impl Iterator<Item = &ObjectRef> {
        self.decisions.keys()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cluster(yaml: &str) -> Cluster {
        let (c, e) = crate::source::manifest_watch::cluster_from_text(yaml);
        assert!(e.iter().all(|e| !e.contains("cannot") && !e.contains("parse")), "{e:?}");
        c
    }

    fn svc(name: &str, ip: &str, extra: &str) -> String {
        format!(
            "---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}}}\nspec: {{clusterIP: {ip}, ports: [{{name: http, port: 80}}, {{name: dns, port: 53, protocol: UDP}}]{extra}}}\n"
        )
    }

    fn slice(name: &str, owner: &str, eps: &[(&str, &str)]) -> String {
        let eps: String = eps.iter().map(|(ip, node)| format!("- addresses: [{ip}]\n  nodeName: {node}\n  zone: z-{node}\n")).collect();
        format!(
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}, labels: {{kubernetes.io/service-name: {owner}}}}}\naddressType: IPv4\nports: [{{name: http, port: 8080}}, {{name: dns, port: 5353, protocol: UDP}}]\nendpoints:\n{eps}"
        )
    }

    const NODES: &str = "---\napiVersion: v1\nkind: Node\nmetadata: {name: a, labels: {topology.kubernetes.io/zone: z-a}}\n---\napiVersion: v1\nkind: Node\nmetadata: {name: b, labels: {topology.kubernetes.io/zone: z-b}}\n";

    /// Applies each step's manifests through the cache, telling it only
    /// what differs from the previous step, and compares with a full
    /// recomputation every time.
    #[test]
    fn incremental_updates_match_a_full_recomputation() {
        let local = ", internalTrafficPolicy: Local";
        let steps: Vec<(&str, String)> = vec![
            (
                "start",
                format!(
                    "{NODES}{}{}{}",
                    svc("web", "10.96.0.1", ""),
                    svc("api", "10.96.0.2", ""),
                    slice("web-1", "web", &[("10.244.0.1", "a"), ("10.244.0.2", "b")])
                ),
            ),
            (
                "a slice for api",
                format!(
                    "{NODES}{}{}{}{}",
                    svc("web", "10.96.0.1", ""),
                    svc("api", "10.96.0.2", ""),
                    slice("web-1", "web", &[("10.244.0.1", "a"), ("10.244.0.2", "b")]),
                    slice("api-1", "api", &[("10.244.1.1", "a")])
                ),
            ),
            (
                "an endpoint changes",
                format!(
                    "{NODES}{}{}{}{}",
                    svc("web", "10.96.0.1", ""),
                    svc("api", "10.96.0.2", ""),
                    slice("web-1", "web", &[("10.244.0.1", "a"), ("10.244.0.3", "b")]),
                    slice("api-1", "api", &[("10.244.1.1", "a")])
                ),
            ),
            (
                "a slice moves to another Service",
                format!(
                    "{NODES}{}{}{}{}",
                    svc("web", "10.96.0.1", ""),
                    svc("api", "10.96.0.2", ""),
                    slice("web-1", "api", &[("10.244.0.1", "a"), ("10.244.0.3", "b")]),
                    slice("api-1", "api", &[("10.244.1.1", "a")])
                ),
            ),
            (
                "a policy change",
                format!(
                    "{NODES}{}{}{}{}",
                    svc("web", "10.96.0.1", ""),
                    svc("api", "10.96.0.2", local),
                    slice("web-1", "api", &[("10.244.0.1", "a"), ("10.244.0.3", "b")]),
                    slice("api-1", "api", &[("10.244.1.1", "a")])
                ),
            ),
            (
                "session affinity",
                format!(
                    "{NODES}{}{}{}{}",
                    svc("web", "10.96.0.1", ", sessionAffinity: ClientIP"),
                    svc("api", "10.96.0.2", local),
                    slice("web-1", "api", &[("10.244.0.1", "a"), ("10.244.0.3", "b")]),
                    slice("api-1", "api", &[("10.244.1.1", "a")])
                ),
            ),
            (
                "a clash: zzz takes api's address",
                format!(
                    "{NODES}{}{}{}{}{}",
                    svc("web", "10.96.0.1", ""),
                    svc("api", "10.96.0.2", local),
                    svc("zzz", "10.96.0.2", ""),
                    slice("web-1", "api", &[("10.244.0.1", "a")]),
                    slice("api-1", "api", &[("10.244.1.1", "a")])
                ),
            ),
            (
                "the first claimant leaves",
                format!(
                    "{NODES}{}{}{}",
                    svc("web", "10.96.0.1", ""),
                    svc("zzz", "10.96.0.2", ""),
                    slice("api-1", "api", &[("10.244.1.1", "a")])
                ),
            ),
            (
                "a ClusterIP changes",
                format!(
                    "{NODES}{}{}{}",
                    svc("web", "10.96.0.9", ""),
                    svc("zzz", "10.96.0.2", ""),
                    slice("api-1", "api", &[("10.244.1.1", "a")])
                ),
            ),
            ("everything goes", NODES.to_string()),
        ];
        let mut cache = DecisionCache::new("a");
        let mut prev = Cluster::default();
        for (i, (name, yaml)) in steps.iter().enumerate() {
            let c = cluster(yaml);
            let changes = Changes {
                all: i == 0,
                services: c
                    .services
                    .keys()
                    .chain(prev.services.keys())
                    .filter(|k| c.services.get(*k) != prev.services.get(*k))
                    .cloned()
                    .collect(),
                slices: c.slices.keys().chain(prev.slices.keys()).filter(|k| c.slices.get(*k) != prev.slices.get(*k)).cloned().collect(),
            };
            let before = cache.desired().clone();
            let before_policies = cache.desired_policies().clone();
            let touched = cache.update(&c, &changes).frontends;
            let full = decision::decide(&c, "a");
            let (want, clashes) = decision::desired_state(&full);
            assert_eq!(cache.desired(), &want, "step {name}");
            let want_policies = decision::desired_policies(&full);
            assert_eq!(cache.desired_policies(), &want_policies, "step {name}");
            for fe in want_policies.keys().chain(before_policies.keys()) {
                if want_policies.get(fe) != before_policies.get(fe) {
                    assert!(touched.contains(fe), "step {name}: {fe}'s policy changed but it was not reported");
                }
            }
            assert_eq!(cache.decisions().cloned().collect::<Vec<_>>(), full, "step {name}");
            let mut got_clashes = cache.clashes();
            got_clashes.sort();
            let mut clashes = clashes;
            clashes.sort();
            assert_eq!(got_clashes, clashes, "step {name}");
            let with_problems: Vec<&PortDecision> = full.iter().filter(|d| !d.problems.is_empty()).collect();
            assert_eq!(cache.decisions_with_problems().collect::<Vec<_>>(), with_problems, "step {name}");
            // Every frontend whose entry differs is among the touched ones.
            for fe in want.keys().chain(before.keys()) {
                if want.get(fe) != before.get(fe) {
                    assert!(touched.contains(fe), "step {name}: {fe} changed but was not reported");
                }
            }
            prev = c;
        }
    }

    #[test]
    fn node_label_changes_need_a_full_update() {
        let yaml = format!(
            "{NODES}{}{}",
            svc("web", "10.96.0.1", ", trafficDistribution: PreferClose"),
            slice("web-1", "web", &[("10.244.0.1", "a"), ("10.244.0.2", "b")])
        );
        let mut cache = DecisionCache::new("a");
        cache.update(&cluster(&yaml), &Changes { all: true, ..Changes::default() });
        let moved = yaml.replace("topology.kubernetes.io/zone: z-b", "topology.kubernetes.io/zone: z-a");
        let c = cluster(&moved);
        cache.update(&c, &Changes { all: true, ..Changes::default() });
        assert_eq!(cache.desired(), &decision::desired_state(&decision::decide(&c, "a")).0);
        assert!(!Changes { all: true, ..Changes::default() }.is_empty());
        assert!(Changes::default().is_empty());
    }
}
