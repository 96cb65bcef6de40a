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
use crate::decide::plan::{FrontendPolicy, Policies};
use crate::decide::topology::NodeContext;
use crate::model::store::Changes;
use crate::model::{Backend, Cluster, EndpointSlice, Family, Frontend, ObjectRef};
use crate::util::btree::repack_after;

/// What one update changed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Update {
    /// ClusterIP frontends whose desired entry may differ.
    pub frontends: BTreeSet<Frontend>,
    /// Services decided again, and the owners of `frontends`.
    pub services: BTreeSet<ObjectRef>,
}

impl Update {
    /// What `self` and then `later` changed.
    pub(crate) fn and(mut self, later: Update) -> Update {
        self.frontends.extend(later.frontends);
        self.services.extend(later.services);
        self
    }
}

/// A small set kept sorted, a single element inline. Nearly every set here
/// has one element (a Service's only slice, a frontend's only claimant),
/// for which a BTreeSet allocates a whole node of eleven (544 bytes for one
/// ObjectRef, 10 MiB of the agent's peak at 10k Services) and a Vec a heap
/// block (48 bytes with the allocator's header, 10 MiB at 100k Services);
/// inline it costs nothing more. More elements are a sorted Vec of exact
/// capacity. Iterates in ascending order, as a BTreeSet does, so the first
/// claimant in namespace/name order is `first()`.
#[derive(Clone, Debug)]
enum SortedVec<T> {
    One(T),
    Many(Vec<T>),
}

impl<T> Default for SortedVec<T> {
    fn default() -> Self {
        SortedVec::Many(Vec::new())
    }
}

impl<T: Ord> SortedVec<T> {
    fn insert(&mut self, v: T) {
        match self {
            SortedVec::Many(vec) if vec.is_empty() => *self = SortedVec::One(v),
            SortedVec::Many(vec) => {
                if let Err(i) = vec.binary_search(&v) {
                    vec.reserve_exact(1);
                    vec.insert(i, v);
                }
            }
            SortedVec::One(one) if *one == v => {}
            SortedVec::One(_) => {
                let SortedVec::One(one) = std::mem::take(self) else { unreachable!() };
                let mut vec = vec![one, v];
                vec.sort();
                *self = SortedVec::Many(vec);
            }
        }
    }

    fn remove(&mut self, v: &T) {
        match self {
            SortedVec::One(one) if one == v => *self = SortedVec::default(),
            SortedVec::One(_) => {}
            SortedVec::Many(vec) => {
                if let Ok(i) = vec.binary_search(v) {
                    vec.remove(i);
                    if vec.len() == 1 {
                        *self = SortedVec::One(vec.remove(0));
                    } else if vec.len() * 2 <= vec.capacity() {
                        vec.shrink_to_fit();
                    }
                }
            }
        }
    }

    fn as_slice(&self) -> &[T] {
        match self {
            SortedVec::One(one) => std::slice::from_ref(one),
            SortedVec::Many(vec) => vec,
        }
    }

    fn first(&self) -> Option<&T> {
        self.as_slice().first()
    }

    fn len(&self) -> usize {
        self.as_slice().len()
    }

    fn is_empty(&self) -> bool {
        self.as_slice().is_empty()
    }

    fn iter(&self) -> std::slice::Iter<'_, T> {
        self.as_slice().iter()
    }
}

/// Services decided together: on several threads when it is a full batch,
/// and the decisions a batch holds before they join the cache.
const DECIDE_BATCH: usize = 4096;

/// The decisions of the Services in `ids`, in order (`None`: not in
/// `cluster`). Each Service is decided on its own (`decide_service` is
/// pure), so a batch of many is split between threads, as many as the
/// process may run on (at most four).
fn decide_all(
    cluster: &Cluster,
    slices_of: &BTreeMap<ObjectRef, SortedVec<ObjectRef>>,
    ctx: NodeContext<'_>,
    ids: &[&ObjectRef],
) -> Vec<Option<Vec<PortDecision>>> {
    let decide = |id: &ObjectRef| {
        let svc = cluster.services.get(id)?;
        let slices: Vec<&EndpointSlice> =
            slices_of.get(id).into_iter().flat_map(SortedVec::iter).filter_map(|s| cluster.slices.get(s)).collect();
        let mut out = Vec::with_capacity(svc.ports.len());
        decision::decide_service(svc, &slices, ctx, &mut out);
        Some(out)
    };
    let threads =
        if ids.len() >= DECIDE_BATCH / 2 { std::thread::available_parallelism().map_or(1, std::num::NonZero::get).min(4) } else { 1 };
    if threads < 2 {
        return ids.iter().map(|id| decide(id)).collect();
    }
    let per = ids.len().div_ceil(threads);
    std::thread::scope(|scope| {
        let decide = &decide;
        let others: Vec<_> =
            ids.chunks(per).skip(1).map(|part| scope.spawn(move || part.iter().map(|id| decide(id)).collect::<Vec<_>>())).collect();
        let mut out: Vec<Option<Vec<PortDecision>>> = Vec::with_capacity(ids.len());
        out.extend(ids[..per].iter().map(|id| decide(id)));
        for other in others {
            out.extend(other.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic)));
        }
        out
    })
}

/// The Service a slice belongs to (namespace and service-name label): the
/// Service's own copy of its id, when it exists, so that the names are one
/// copy however many maps hold them.
fn owner_id(cluster: &Cluster, s: &EndpointSlice) -> ObjectRef {
    let owner = ObjectRef::new(s.id.namespace.clone(), s.service_name.as_str());
    cluster.services.get_key_value(&owner).map_or(owner, |(k, _)| k.clone())
}

/// The ClusterIP frontends of a Service's decisions, sorted, each once.
fn frontends_of(decisions: &[PortDecision]) -> Vec<Frontend> {
    let mut fes: Vec<Frontend> = decisions.iter().flat_map(|d| d.frontends.iter().copied()).collect();
    fes.sort_unstable();
    fes.dedup();
    fes
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
    /// With the decisions, this is the desired state (`desired_state`):
    /// each frontend's backends are read from its owner's decision when
    /// asked for ([`Self::desired_of`], [`Self::desired_entries`]), not
    /// kept in a second copy (30 MiB at 100k Services x 10 endpoints).
    claims: BTreeMap<Frontend, SortedVec<ObjectRef>>,
    /// Their policies, where not the default: what `desired_policies` gives.
    desired_policies: Policies,
    /// Frontends claimed by more than one Service.
    clashed: BTreeSet<Frontend>,
    /// Services with a decision that carries problems.
    with_problems: BTreeSet<ObjectRef>,
    /// Services with a port whose tiers spill (`topoproxy.io/topology-spill`):
    /// the ones `topoproxy_service_tier_share` reports.
    with_spill: BTreeSet<ObjectRef>,
    /// What [`Self::prepare`] decided, until a pass takes it.
    prepared: Option<Update>,
}

impl DecisionCache {
    pub(crate) fn new(node: &str) -> DecisionCache {
        DecisionCache { node: node.to_string(), ..DecisionCache::default() }
    }

    /// The node this agent decides for.
    pub(crate) fn node(&self) -> &str {
        &self.node
    }

    /// Decides every Service of `cluster` ahead of the first pass (while
    /// the datapath installs, `sync_loop::apply_first_list`): that pass
    /// takes it ([`Self::take_prepared`]) with what changed since, instead
    /// of deciding everything then.
    pub(crate) fn prepare(&mut self, cluster: &Cluster) {
        let update = self.rebuild(cluster, &Changes { all: true, ..Changes::default() });
        self.prepared = Some(update);
    }

    /// Whether [`Self::prepare`] decided what no pass took yet.
    pub(crate) fn is_prepared(&self) -> bool {
        self.prepared.is_some()
    }

    /// What [`Self::prepare`] decided, once.
    pub(crate) fn take_prepared(&mut self) -> Option<Update> {
        self.prepared.take()
    }

    /// Brings the decisions up to `cluster` and returns the ClusterIP
    /// frontends whose desired backends may have changed (added, removed
    /// or updated), and the Services decided again.
    pub(crate) fn update(&mut self, cluster: &Cluster, changes: &Changes) -> Update {
        if changes.all {
            return self.rebuild(cluster, changes);
        }
        let mut affected: BTreeSet<ObjectRef> = changes.services.clone();
        // New entries of the slice index, decisions and claims, to rebuild
        // the maps that grew by many (`repack_after`).
        let (mut new_slices, mut new_decisions, mut new_claims) = (0, 0, 0);
        for id in &changes.slices {
            match self.owner_of.remove(id) {
                Some(old) => {
                    if let Some(set) = self.slices_of.get_mut(&old) {
                        set.remove(id);
                        if set.is_empty() {
                            self.slices_of.remove(&old);
                        }
                    }
                    affected.insert(old);
                }
                None => new_slices += usize::from(cluster.slices.contains_key(id)),
            }
            if let Some(s) = cluster.slices.get(id) {
                affected.insert(self.index_slice(cluster, s));
            }
        }

        let node = self.node.clone();
        let ctx = NodeContext { name: &node, nodes: &cluster.nodes };
        let mut touched = BTreeSet::new();
        let ids: Vec<&ObjectRef> = affected.iter().collect();
        // Decided a batch at a time (on several threads when large), so
        // that only one batch of decisions waits beside the cache's.
        for batch in ids.chunks(DECIDE_BATCH) {
            for (&id, new) in batch.iter().zip(decide_all(cluster, &self.slices_of, ctx, batch)) {
                if new.iter().flatten().any(|d| !d.problems.is_empty()) {
                    self.with_problems.insert(id.clone());
                } else {
                    self.with_problems.remove(id);
                }
                if new.iter().flatten().any(|d| d.spill.is_some()) {
                    self.with_spill.insert(id.clone());
                } else {
                    self.with_spill.remove(id);
                }
                let new_fes = frontends_of(new.as_deref().unwrap_or_default());
                let old = match new {
                    Some(d) => {
                        let old = self.decisions.insert(id.clone(), d);
                        new_decisions += usize::from(old.is_none());
                        old
                    }
                    None => self.decisions.remove(id),
                };
                let old_fes = frontends_of(old.as_deref().unwrap_or_default());
                for fe in old_fes.iter().filter(|fe| new_fes.binary_search(fe).is_err()) {
                    if let Some(set) = self.claims.get_mut(fe) {
                        set.remove(id);
                        if set.is_empty() {
                            self.claims.remove(fe);
                        }
                    }
                }
                for fe in &new_fes {
                    new_claims += usize::from(!self.claims.contains_key(fe));
                    self.claims.entry(*fe).or_default().insert(id.clone());
                }
                touched.extend(old_fes);
                touched.extend(new_fes);
            }
        }
        drop(ids);
        for fe in &touched {
            if self.claims.get(fe).is_some_and(|c| c.len() > 1) {
                self.clashed.insert(*fe);
            } else {
                self.clashed.remove(fe);
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
        repack_after(&mut self.owner_of, new_slices);
        repack_after(&mut self.slices_of, new_slices);
        repack_after(&mut self.decisions, new_decisions);
        repack_after(&mut self.claims, new_claims);
        Update { frontends: touched, services: affected }
    }

    /// [`Self::update`] that decides every Service (`changes.all`: the
    /// first sync, a change of Node labels). Everything is built anew, in
    /// bulk: the decisions from every Service, and the claims, clashes and
    /// policies from the decisions, sorted by frontend, rather than updated
    /// one Service at a time (at 100k Services, each update searched and
    /// inserted into B-trees a dozen times). The result is what the
    /// incremental path gives for the same changes (tests below): the
    /// frontends touched are those claimed before or after, and the
    /// Services decided again are all of them.
    fn rebuild(&mut self, cluster: &Cluster, changes: &Changes) -> Update {
        // The slice index: each slice's owner in slice order (the order
        // of `cluster.slices`), and the slices grouped by owner.
        // Slices are named after their Service, so in slice order their
        // owners come nearly in order too: each is looked for a step ahead
        // of the last one found before a search of every Service.
        let mut services = cluster.services.keys().peekable();
        let owners: Vec<(ObjectRef, ObjectRef)> = cluster
            .slices
            .values()
            .map(|s| {
                let owner = ObjectRef::new(s.id.namespace.clone(), s.service_name.as_str());
                while services.next_if(|k| **k < owner).is_some() {}
                let shared = match services.peek() {
                    Some(k) if **k == owner => Some((*k).clone()),
                    _ => cluster.services.get_key_value(&owner).map(|(k, _)| k.clone()),
                };
                (s.id.clone(), shared.unwrap_or(owner))
            })
            .collect();
        let mut by_owner: Vec<(ObjectRef, ObjectRef)> = owners.iter().map(|(slice, owner)| (owner.clone(), slice.clone())).collect();
        self.owner_of = owners.into_iter().collect();
        // Stable: it finds the runs already in order (slices are named
        // after their Service) and merges them.
        by_owner.sort();
        let mut slices_of: Vec<(ObjectRef, SortedVec<ObjectRef>)> = Vec::new();
        for (owner, slice) in by_owner {
            match slices_of.last_mut() {
                Some((last, set)) if *last == owner => set.insert(slice),
                _ => slices_of.push((owner, SortedVec::One(slice))),
            }
        }
        self.slices_of = slices_of.into_iter().collect();
        // Collected at once (a bulk build, full nodes): inserted one by
        // one, in order, the set was twice its size.
        let affected: BTreeSet<ObjectRef> =
            changes.services.iter().chain(self.decisions.keys()).chain(cluster.services.keys()).cloned().collect();
        // The old decisions are not needed: the frontends they claimed
        // are the claims' keys.
        self.decisions = BTreeMap::new();
        let old_claims = std::mem::take(&mut self.claims);
        self.with_problems.clear();
        self.with_spill.clear();

        let node = self.node.clone();
        let ctx = NodeContext { name: &node, nodes: &cluster.nodes };
        let mut decided: Vec<(ObjectRef, Vec<PortDecision>)> = Vec::with_capacity(cluster.services.len());
        // Each Service's claim on each of its frontends, with the policy
        // of its first port on it (what it gets if it owns the frontend,
        // `decision_for`) when not the default.
        let mut claims: Vec<(Frontend, ObjectRef, Option<Box<FrontendPolicy>>)> = Vec::with_capacity(cluster.services.len());
        let ids: Vec<&ObjectRef> = affected.iter().collect();
        for batch in ids.chunks(DECIDE_BATCH) {
            for (&id, new) in batch.iter().zip(decide_all(cluster, &self.slices_of, ctx, batch)) {
                let Some(decisions) = new else { continue };
                if decisions.iter().any(|d| !d.problems.is_empty()) {
                    self.with_problems.insert(id.clone());
                }
                if decisions.iter().any(|d| d.spill.is_some()) {
                    self.with_spill.insert(id.clone());
                }
                let first = claims.len();
                for d in &decisions {
                    for fe in &d.frontends {
                        if claims[first..].iter().all(|(claimed, _, _)| claimed != fe) {
                            let policy = Some(d.frontend_policy(fe, &[], false)).filter(|p| !p.is_default()).map(Box::new);
                            claims.push((*fe, id.clone(), policy));
                        }
                    }
                }
                decided.push((id.clone(), decisions));
            }
        }
        drop(ids);
        // In `affected` order: sorted, so collected without a sort.
        self.decisions = decided.into_iter().collect();

        // Claimants of a frontend in namespace/name order: the first owns it.
        claims.sort_unstable_by(|a, b| a.0.cmp(&b.0).then_with(|| a.1.cmp(&b.1)));
        let mut by_frontend: Vec<(Frontend, SortedVec<ObjectRef>)> = Vec::with_capacity(claims.len());
        let mut policies: Vec<(Frontend, FrontendPolicy)> = Vec::new();
        let mut clashed: Vec<Frontend> = Vec::new();
        for (fe, id, policy) in claims {
            match by_frontend.last_mut() {
                Some((last, ids)) if *last == fe => {
                    if ids.len() == 1 {
                        clashed.push(fe);
                    }
                    ids.insert(id);
                }
                _ => {
                    if let Some(p) = policy {
                        policies.push((fe, *p));
                    }
                    by_frontend.push((fe, SortedVec::One(id)));
                }
            }
        }
        self.claims = by_frontend.into_iter().collect();
        self.desired_policies = policies.into_iter().collect();
        self.clashed = clashed.into_iter().collect();
        let touched = old_claims.into_keys().chain(self.claims.keys().copied()).collect();
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
        self.owned_frontends_of(service, self.decisions_of(service))
    }

    /// [`Self::owned_frontends`] of `service`, whose decisions are at hand.
    pub(crate) fn owned_frontends_of<'a>(
        &'a self,
        service: &'a ObjectRef,
        decisions: &'a [PortDecision],
    ) -> impl Iterator<Item = &'a Frontend> + 'a {
        decisions.iter().flat_map(|d| d.frontends.iter()).filter(move |fe| self.owner(fe) == Some(service))
    }

    fn index_slice(&mut self, cluster: &Cluster, s: &EndpointSlice) -> ObjectRef {
        let owner = owner_id(cluster, s);
        self.slices_of.entry(owner.clone()).or_default().insert(s.id.clone());
        self.owner_of.insert(s.id.clone(), owner.clone());
        owner
    }

    /// The decision `fe` takes its backends and policy from: its owner's
    /// (the first claiming Service), and within it the first port with
    /// that frontend (as `desired_state`).
    fn decision_for(&self, fe: &Frontend) -> Option<&PortDecision> {
        let owner = self.claims.get(fe)?.first()?;
        self.decisions.get(owner)?.iter().find(|d| d.frontends.contains(fe))
    }

    /// The backends of `fe` from [`Self::decision_for`], of its family,
    /// sorted and without duplicates (the order of a `BTreeSet`).
    fn backends_for(&self, fe: &Frontend) -> Option<Vec<Backend>> {
        let d = self.decision_for(fe)?;
        let fam = Family::of(&fe.ip);
        let mut v: Vec<Backend> = d.internal_backends().iter().filter(|b| Family::of(&b.ip) == fam).copied().collect();
        v.sort_unstable();
        v.dedup();
        Some(v)
    }

    /// The policy of `fe` from its owner (as [`Self::backends_for`]), when
    /// it is not the default.
    fn policy_for(&self, fe: &Frontend) -> Option<FrontendPolicy> {
        let d = self.decision_for(fe)?;
        Some(d.frontend_policy(fe, &[], false)).filter(|p| !p.is_default())
    }

    /// Whether `fe` is in the ClusterIP part of the desired socket state.
    pub(crate) fn is_desired(&self, fe: &Frontend) -> bool {
        self.decision_for(fe).is_some()
    }

    /// The backends the desired state gives `fe`, if it has it.
    pub(crate) fn desired_of(&self, fe: &Frontend) -> Option<std::collections::BTreeSet<Backend>> {
        Some(self.backends_for(fe)?.into_iter().collect())
    }

    /// The ClusterIP part of the desired socket state, frontends in order,
    /// each set made when it is reached (sorted, without duplicates), so
    /// that a full pass does not hold a copy of every set.
    pub(crate) fn desired_entries(&self) -> impl Iterator<Item = (Frontend, Vec<Backend>)> + '_ {
        self.claims.keys().filter_map(|fe| Some((*fe, self.backends_for(fe)?)))
    }

    /// The ClusterIP part of the desired socket state, whole.
    #[cfg(test)]
    pub(crate) fn desired(&self) -> crate::decide::plan::State {
        self.desired_entries().map(|(fe, set)| (fe, set.into_iter().collect())).collect()
    }

    /// The policies of the ClusterIP frontends in the desired state that
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

    /// The decisions whose tiers spill, in the order of [`Self::decisions`].
    pub(crate) fn decisions_with_spill(&self) -> impl Iterator<Item = &PortDecision> {
        self.with_spill.iter().filter_map(|id| self.decisions.get(id)).flatten().filter(|d| d.spill.is_some())
    }

    /// The decisions of one Service.
    pub(crate) fn decisions_of(&self, id: &ObjectRef) -> &[PortDecision] {
        self.decisions.get(id).map_or(&[], Vec::as_slice)
    }

    /// Every decided Service.
    pub(crate) fn service_ids(&self) -> impl Iterator<Item = &ObjectRef> {
        self.decisions.keys()
    }

    /// Every decided Service with its decisions, in namespace/name order.
    pub(crate) fn decisions_by_service(&self) -> impl Iterator<Item = (&ObjectRef, &[PortDecision])> {
        self.decisions.iter().map(|(id, d)| (id, d.as_slice()))
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
        // Beside it, a cache that decides everything at every step (the
        // bulk `rebuild`) from the state the last step left.
        let mut rebuilt = DecisionCache::new("a");
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
            let before = cache.desired();
            let before_policies = cache.desired_policies().clone();
            let touched = cache.update(&c, &changes).frontends;
            let full = decision::decide(&c, "a");
            let (want, clashes) = decision::desired_state(&full);
            assert_eq!(cache.desired(), want, "step {name}");
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
            let with_spill: Vec<&PortDecision> = full.iter().filter(|d| d.spill.is_some()).collect();
            assert_eq!(cache.decisions_with_spill().collect::<Vec<_>>(), with_spill, "step {name}");
            // Every frontend whose entry differs is among the touched ones.
            for fe in want.keys().chain(before.keys()) {
                if want.get(fe) != before.get(fe) {
                    assert!(touched.contains(fe), "step {name}: {fe} changed but was not reported");
                }
            }
            let rebuilt_before = rebuilt.desired();
            let all = Changes { all: true, ..changes.clone() };
            let update = rebuilt.update(&c, &all);
            assert_same(&rebuilt, &cache, name);
            let claimed: BTreeSet<Frontend> = rebuilt_before.keys().chain(want.keys()).copied().collect();
            assert_eq!(update.frontends, claimed, "step {name}: a full update touches every frontend claimed before or now");
            let every: BTreeSet<ObjectRef> =
                changes.services.iter().chain(prev.services.keys()).chain(c.services.keys()).cloned().collect();
            assert_eq!(update.services, every, "step {name}");
            prev = c;
        }
    }

    /// Two caches hold the same state, index and bookkeeping included.
    fn assert_same(a: &DecisionCache, b: &DecisionCache, step: &str) {
        let claims = |c: &DecisionCache| c.claims.iter().map(|(fe, ids)| (*fe, ids.as_slice().to_vec())).collect::<Vec<_>>();
        let slices = |c: &DecisionCache| c.slices_of.iter().map(|(id, s)| (id.clone(), s.as_slice().to_vec())).collect::<Vec<_>>();
        assert_eq!(a.decisions, b.decisions, "step {step}: decisions");
        assert_eq!(claims(a), claims(b), "step {step}: claims");
        assert_eq!(a.desired_policies, b.desired_policies, "step {step}: policies");
        assert_eq!(a.clashed, b.clashed, "step {step}: clashes");
        assert_eq!(a.with_problems, b.with_problems, "step {step}: problems");
        assert_eq!(a.with_spill, b.with_spill, "step {step}: spill");
        assert_eq!(slices(a), slices(b), "step {step}: slice index");
        assert_eq!(a.owner_of, b.owner_of, "step {step}: slice owners");
    }

    #[test]
    fn sorted_vecs_stay_sorted_and_keep_one_element_inline() {
        let mut v = SortedVec::default();
        assert!(v.is_empty() && v.first().is_none());
        v.insert(5);
        v.insert(5);
        assert!(matches!(v, SortedVec::One(5)));
        v.insert(3);
        v.insert(9);
        assert_eq!(v.iter().copied().collect::<Vec<_>>(), [3, 5, 9]);
        assert_eq!((v.first(), v.len()), (Some(&3), 3));
        v.remove(&3);
        v.remove(&4);
        v.remove(&9);
        assert!(matches!(v, SortedVec::One(5)), "{v:?}");
        v.remove(&5);
        assert!(v.is_empty());
    }

    #[test]
    fn node_label_changes_need_a_full_update() {
        let yaml = format!(
            "{NODES}{}{}",
            svc("web", "10.96.0.1", ", topologyKeys: [topology.kubernetes.io/zone]"),
            slice("web-1", "web", &[("10.244.0.1", "a"), ("10.244.0.2", "b")])
        );
        let mut cache = DecisionCache::new("a");
        cache.update(&cluster(&yaml), &Changes { all: true, ..Changes::default() });
        let moved = yaml.replace("topology.kubernetes.io/zone: z-b", "topology.kubernetes.io/zone: z-a");
        let c = cluster(&moved);
        cache.update(&c, &Changes { all: true, ..Changes::default() });
        assert_eq!(cache.desired(), decision::desired_state(&decision::decide(&c, "a")).0);
        assert!(!Changes { all: true, ..Changes::default() }.is_empty());
        assert!(Changes::default().is_empty());
    }
}
