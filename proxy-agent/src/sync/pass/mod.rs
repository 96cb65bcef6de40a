//! One pass of the data flow: model -> decisions -> desired state -> plan ->
//! maps, kept between passes so that a pass costs in proportion to what
//! changed. The maps sit behind [`SocketMaps`]: the pinned maps
//! (`MapWriter`) in the agent, an in-memory set ([`MemoryMaps`]) in
//! `explain` and in the unit tests.
//!
//! The pass proper is here; `socket_maps` holds that trait and the
//! in-memory maps, and the unit tests sit beside it by subject
//! (`policy_tests`, `departure_tests`, `label_need_tests`).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::time::Instant;

use crate::datapath::map_writer::ApplyError;
use crate::datapath::service_topo::SharedTiers;
use crate::decide::cache::DecisionCache;
use crate::decide::decision::{self, PortDecision};
use crate::decide::departures::{self, Departure, EndpointState, Step, TcpTermination, Watch};
use crate::decide::label_wait::{self, Listed, Missing, Verdict};
use crate::decide::plan::{self, Policies};
use crate::decide::topology::tier::EndpointTiers;
use crate::external::nodeport::ExternalDatapath;
use crate::model::store::Changes;
use crate::model::{Backend, Cluster, EndpointSlice, Frontend, ObjectRef, OtherNodes};

mod socket_maps;

pub use socket_maps::{MemoryMaps, SocketMaps};

/// What one pass did.
#[derive(Debug, Default)]
pub struct SyncOutcome {
    /// Frontends written.
    pub upserts: usize,
    /// Frontends deleted.
    pub deletes: usize,
    /// Configuration problems found while deciding, each naming its Service
    /// (address clashes and the external datapath's included).
    pub problems: Vec<String>,
    /// Frontends that could not be written (left as they were).
    pub failures: Vec<ApplyError>,
    /// Services with at least one ClusterIP frontend in the maps.
    pub services_programmed: usize,
    /// Service ports with endpoints elsewhere and none on this node for
    /// their internal / external Local policy
    /// (`PortDecision::no_local_endpoints`), over every Service.
    pub no_local_internal: usize,
    /// The same for the external traffic policy.
    pub no_local_external: usize,
    /// Backends that left a socket-datapath frontend's set and whose
    /// connections end now by their protocol's rule
    /// (`decide::departures`): the sockets translated to them are to be
    /// terminated.
    pub departures: Vec<Departure>,
    /// The same for the TC datapath's frontends: their conntrack flows are
    /// to be flushed.
    pub tc_departures: Vec<Departure>,
    /// When a pass is owed even if nothing changes: a departed backend's
    /// endpoint is in no slice and the rules wait for that to settle
    /// (`departures::GONE_SETTLE`), or a Service held for other Nodes'
    /// labels reaches the wait's limit.
    pub recheck_at: Option<Instant>,
    /// Services that started waiting in this pass for labels of other
    /// Nodes not listed yet (`decide::label_wait`), kept as programmed.
    pub held: Vec<(ObjectRef, Missing)>,
    /// Services that waited past the limit in this pass and were decided
    /// with what is known.
    pub gave_up: Vec<(ObjectRef, Missing)>,
    /// Services that waited and were programmed in this pass, the labels
    /// they needed now listed, and how long they waited.
    pub released: Vec<(ObjectRef, std::time::Duration)>,
}

/// A Service waiting for labels of other Nodes (`decide::label_wait`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Waiting {
    /// Since when.
    pub since: Instant,
    /// What it lacks.
    pub missing: Missing,
    /// It waited past the limit and was decided with what is known.
    pub gave_up: bool,
}

/// A backend that left a frontend's set, watched until its protocol's
/// rule ends its connections or it is forgotten (`departures::step`).
#[derive(Clone, Debug)]
struct Watched {
    watch: Watch,
    /// The frontend's Service when the backend left: a pass looks at the
    /// entry again when that Service changed (or in a full pass).
    owner: Option<ObjectRef>,
}

type WatchSet = BTreeMap<(Frontend, Backend), Watched>;

/// The passes of the sync loop. Decisions come from the `DecisionCache`
/// (the per-Service decision function `decision::decide` uses); only the frontends whose
/// desired entry may have changed are compared with the maps and written,
/// except in a full pass (the first, and the periodic resync), which
/// compares everything, removes what nobody wants any more and retries
/// frontends that failed.
pub struct CachedSync {
    cache: DecisionCache,
    /// External frontends in the socket map (NodePorts from the node
    /// itself, external IPs) as last computed, and their policies.
    external_socket: plan::State,
    external_policies: Policies,
    /// Services with at least one ClusterIP frontend in the maps.
    programmed: BTreeSet<ObjectRef>,
    /// Services with external frontends or a health check node port: the
    /// only ones `decision::external_state_of` needs to look at.
    external_services: BTreeSet<ObjectRef>,
    /// Local endpoint addresses per Service, and how many Services use each
    /// (`ExternalState::local_endpoints` without visiting every decision).
    /// Kept only while the external datapath reads them (`tracking_local`):
    /// 40 MiB at 100k Services whose endpoints are partly on this node.
    local_of: BTreeMap<ObjectRef, Vec<IpAddr>>,
    local_refs: BTreeMap<IpAddr, usize>,
    tracking_local: bool,
    /// Frontends whose last write failed (a full map): compared again on
    /// the next pass, whatever it was triggered by, so that room freed by
    /// a deleted Service is used at once rather than at the next full pass.
    retry: BTreeSet<Frontend>,
    /// Per Service with any, its ports without local endpoints for the
    /// internal and external Local policy, and the sums over all Services:
    /// kept up to date with the decisions, so a pass does not visit every
    /// decision to count them.
    no_local_of: BTreeMap<ObjectRef, (usize, usize)>,
    no_local: (usize, usize),
    /// Backends that left a frontend's set and may still lose their
    /// connections (`departures::step`): of the socket datapath, and of the
    /// TC one.
    watched: WatchSet,
    watched_tc: WatchSet,
    /// Whether `watched` and `watched_tc` were seeded with what an earlier
    /// agent may have been watching (see [`Self::restart_watch`]): once, in
    /// the first pass that writes each datapath.
    seeded: bool,
    seeded_tc: bool,
    /// `--terminate-tcp`.
    tcp: TcpTermination,
    /// Per Service whose topology reads labels of other Nodes that its
    /// slices do not carry, those labels
    /// (`decide::topology::other_node_labels`): the source watches other
    /// Nodes, metadata only, just while this is not empty.
    /// with the Nodes its endpoints run on (`endpoint_nodes`).
    label_needs: BTreeMap<ObjectRef, (BTreeSet<String>, BTreeSet<String>)>,
    /// What the source has listed of other Nodes (`decide::label_wait`):
    /// everything unless told otherwise (manifests, `explain`).
    listed: Listed,
    /// How long a Service waits for labels not listed yet
    /// (`--node-label-wait-secs`).
    label_wait: std::time::Duration,
    /// The Services waiting for labels, held or given up.
    waiting: BTreeMap<ObjectRef, Waiting>,
    /// The physical tier of every endpoint address, which the writers put
    /// with each backend (issue #34).
    tiers: SharedTiers,
}

impl CachedSync {
    /// A sync for node `node` that has decided nothing yet.
    pub fn new(node: &str) -> CachedSync {
        CachedSync {
            cache: DecisionCache::new(node),
            external_socket: plan::State::new(),
            external_policies: Policies::new(),
            programmed: BTreeSet::new(),
            external_services: BTreeSet::new(),
            local_of: BTreeMap::new(),
            local_refs: BTreeMap::new(),
            tracking_local: false,
            retry: BTreeSet::new(),
            no_local_of: BTreeMap::new(),
            no_local: (0, 0),
            watched: WatchSet::new(),
            watched_tc: WatchSet::new(),
            seeded: false,
            seeded_tc: false,
            tcp: TcpTermination::default(),
            label_needs: BTreeMap::new(),
            listed: Listed::Everything,
            label_wait: DEFAULT_LABEL_WAIT,
            waiting: BTreeMap::new(),
            tiers: std::sync::Arc::new(std::sync::RwLock::new(EndpointTiers::new(node))),
        }
    }

    /// Takes `cache`, which decided every Service for this node ahead of
    /// the first pass (`DecisionCache::prepare`), and `tiers`, which
    /// followed the same cluster (`EndpointTiers::update`).
    pub(crate) fn use_decided(&mut self, cache: DecisionCache, tiers: EndpointTiers) {
        debug_assert_eq!(cache.node(), self.cache.node());
        self.cache = cache;
        *self.tiers.write().unwrap_or_else(std::sync::PoisonError::into_inner) = tiers;
    }

    /// Whether every Service was decided ahead of the next pass.
    pub(crate) fn decided_ahead(&self) -> bool {
        self.cache.is_prepared()
    }

    /// What the source must watch of other Nodes for the Services'
    /// topology (`decide::topology::other_nodes_needed`).
    pub fn other_nodes_needed(&self, cluster: &Cluster) -> OtherNodes {
        let own = self.cache.node();
        crate::decide::topology::other_nodes_needed(self.label_needs.values().map(|(l, n)| (l, n)), cluster.nodes.get(own), own)
    }

    /// The labels of other Nodes that Service `id`'s topology needs beyond
    /// what its slices carry, if any (`explain` shows them).
    pub fn node_labels_of(&self, id: &ObjectRef) -> Option<&BTreeSet<String>> {
        self.label_needs.get(id).map(|(l, _)| l)
    }

    /// The labels of other Nodes that some Service's topology needs.
    pub fn node_labels_needed(&self) -> BTreeSet<String> {
        self.label_needs.values().flat_map(|(l, _)| l).cloned().collect()
    }

    /// Follows what the Services in `ids` need of other Nodes' labels after
    /// they were decided again.
    fn track_label_needs<'a>(&mut self, cluster: &Cluster, ids: impl IntoIterator<Item = &'a ObjectRef>) {
        for id in ids {
            match cluster.services.get(id).and_then(|svc| label_needs(&self.cache, cluster, id, svc)) {
                Some(needs) => self.label_needs.insert(id.clone(), needs),
                None => self.label_needs.remove(id),
            };
        }
    }

    /// Sets how long a Service waits for labels of other Nodes not listed
    /// yet before it is decided with what is known (`decide::label_wait`).
    pub fn with_label_wait(mut self, wait: std::time::Duration) -> Self {
        self.label_wait = wait;
        self
    }

    /// Says what the source has listed of other Nodes; a pass follows.
    pub fn set_listed(&mut self, listed: Listed) {
        self.listed = listed;
    }

    /// The Services waiting for labels of other Nodes (held, or decided
    /// with what is known after the limit).
    pub fn waiting(&self) -> &BTreeMap<ObjectRef, Waiting> {
        &self.waiting
    }

    /// Sets what becomes of TCP connections to departed backends
    /// (`--terminate-tcp`).
    pub fn with_tcp_termination(mut self, tcp: TcpTermination) -> Self {
        self.tcp = tcp;
        self
    }

    /// Departed backends being watched, of the socket and the TC datapath.
    pub fn watched(&self) -> (usize, usize) {
        (self.watched.len(), self.watched_tc.len())
    }

    /// Recounts the ports without local endpoints of the Services in `ids`
    /// after they were decided again.
    fn track_no_local<'a>(&mut self, ids: impl IntoIterator<Item = &'a ObjectRef>) {
        for id in ids {
            let now = no_local_count(self.cache.decisions_of(id));
            let before = if now == (0, 0) { self.no_local_of.remove(id) } else { self.no_local_of.insert(id.clone(), now) };
            let before = before.unwrap_or_default();
            self.no_local = (self.no_local.0 + now.0 - before.0, self.no_local.1 + now.1 - before.1);
        }
    }

    /// The cached decisions (for problems and Events).
    pub fn decisions(&self) -> impl Iterator<Item = &PortDecision> + Clone {
        self.cache.decisions()
    }

    /// The cached decisions that carry problems.
    pub fn decisions_with_problems(&self) -> impl Iterator<Item = &PortDecision> {
        self.cache.decisions_with_problems()
    }

    /// The cached decisions whose tiers spill (`topoproxy_service_tier_share`).
    pub fn decisions_with_spill(&self) -> impl Iterator<Item = &PortDecision> {
        self.cache.decisions_with_spill()
    }

    /// Follows the external side of the Services in `ids` after they were
    /// decided again.
    fn track_external(&mut self, ids: impl IntoIterator<Item = ObjectRef>) {
        for id in ids {
            let decisions = self.cache.decisions_of(&id);
            if decisions.iter().any(decision::has_external) {
                self.external_services.insert(id.clone());
            } else {
                self.external_services.remove(&id);
            }
            if self.tracking_local {
                self.track_local(id);
            }
        }
    }

    /// [`Self::track_external`] of every Service, after a full update: the
    /// sets are built anew from the decisions, in order, rather than looked
    /// up and updated one Service at a time.
    fn rebuild_external(&mut self) {
        self.external_services = self
            .cache
            .decisions_by_service()
            .filter(|(_, decisions)| decisions.iter().any(decision::has_external))
            .map(|(id, _)| id.clone())
            .collect();
        if self.tracking_local {
            self.local_of.clear();
            self.local_refs.clear();
            for (id, decisions) in self.cache.decisions_by_service() {
                add_local(&mut self.local_of, &mut self.local_refs, id, decisions);
            }
        }
    }

    /// [`Self::track_no_local`] of every Service, after a full update.
    fn rebuild_no_local(&mut self) {
        self.no_local_of = self
            .cache
            .decisions_by_service()
            .filter_map(|(id, decisions)| {
                let now = no_local_count(decisions);
                (now != (0, 0)).then(|| (id.clone(), now))
            })
            .collect();
        self.no_local = self.no_local_of.values().fold((0, 0), |sum, n| (sum.0 + n.0, sum.1 + n.1));
    }

    /// [`Self::track_label_needs`] of every Service, after a full update.
    fn rebuild_label_needs(&mut self, cluster: &Cluster) {
        let cache = &self.cache;
        self.label_needs =
            cluster.services.iter().filter_map(|(id, svc)| Some((id.clone(), label_needs(cache, cluster, id, svc)?))).collect();
    }

    /// Starts or stops following the local endpoints of every Service, as
    /// the external datapath starts or stops reading them.
    fn follow_local_endpoints(&mut self, wanted: bool) {
        if wanted == self.tracking_local {
            return;
        }
        self.tracking_local = wanted;
        self.local_of.clear();
        self.local_refs.clear();
        if wanted {
            let ids: Vec<ObjectRef> = self.cache.service_ids().cloned().collect();
            for id in ids {
                self.track_local(id);
            }
        }
    }

    /// Recounts the local endpoint addresses of the Service `id`.
    fn track_local(&mut self, id: ObjectRef) {
        for ip in self.local_of.remove(&id).unwrap_or_default() {
            if let Some(n) = self.local_refs.get_mut(&ip) {
                *n -= 1;
                if *n == 0 {
                    self.local_refs.remove(&ip);
                }
            }
        }
        add_local(&mut self.local_of, &mut self.local_refs, &id, self.cache.decisions_of(&id));
    }

    /// Brings the maps to what `cluster` calls for: the Services and slices in `changes` are
    /// decided again (all of them when `full`), and the difference is written.
    pub fn pass(
        &mut self,
        writer: &mut impl SocketMaps,
        external: Option<&mut ExternalDatapath>,
        cluster: &Cluster,
        changes: &Changes,
        full: bool,
    ) -> SyncOutcome {
        self.pass_at(writer, external, cluster, changes, full, Instant::now())
    }

    /// [`Self::pass`] at the moment `now` (the clock the departure rules
    /// read).
    pub fn pass_at(
        &mut self,
        writer: &mut impl SocketMaps,
        mut external: Option<&mut ExternalDatapath>,
        cluster: &Cluster,
        changes: &Changes,
        full: bool,
        now: Instant,
    ) -> SyncOutcome {
        // Every Service decided ahead (`use_decided`): this pass takes
        // that, with what changed since, as a pass that decided everything.
        let prepared = self.cache.take_prepared();
        let update = self.cache.update(cluster, changes);
        let tier_changes = changes;
        let decided_all;
        let (update, changes) = match prepared {
            Some(ahead) => {
                decided_all = Changes { all: true, ..Changes::default() };
                (ahead.and(update), &decided_all)
            }
            None => (update, changes),
        };
        let (mut touched, mut services) = (update.frontends, update.services);
        let retried = std::mem::take(&mut self.retry);
        touched.extend(retried.iter().copied());
        // Only the external side feeds this pass's plan; the counts of
        // ports without local endpoints and the labels of other Nodes are
        // followed once the maps are written (below).
        if changes.all {
            self.rebuild_external();
        } else {
            self.track_external(services.iter().cloned());
        }
        self.follow_local_endpoints(external.as_deref().is_some_and(ExternalDatapath::uses_local_endpoints));
        // What each Service needs of other Nodes, and which of them wait
        // for it: their frontends are kept as they are (below).
        if changes.all {
            self.rebuild_label_needs(cluster);
        } else {
            self.track_label_needs(cluster, &services);
        }
        let node_addrs_now: Vec<IpAddr> = external.as_deref().map(|e| e.node_addrs.clone()).unwrap_or_default();
        let wait = self.follow_label_waits(now, &node_addrs_now);
        touched.extend(wait.release.iter().copied());
        // The endpoint tiers follow what changed since they were followed
        // last (ahead, with the decisions, or in the last pass).
        self.tiers.write().unwrap_or_else(std::sync::PoisonError::into_inner).update(cluster, tier_changes.all, &tier_changes.slices);
        self.count_topology(writer, external.as_deref_mut(), changes, &services, full);
        let ext = external.as_deref().map(|e| {
            let cache = &self.cache;
            let decisions = self.external_services.iter().flat_map(|id| cache.decisions_of(id));
            let mut ext = decision::external_state_of(decisions, |fe| cache.owner(fe), &e.node_addrs);
            // Only the TC maps use them; at 10k Services collecting them
            // every pass would cost more than the rest of the pass.
            if e.uses_local_endpoints() {
                ext.local_endpoints = self.local_refs.keys().copied().collect();
            }
            ext
        });
        let ext_socket = ext.as_ref().map(|e| e.socket.clone()).unwrap_or_default();
        let ext_policies = ext.as_ref().map(|e| e.socket_policies.clone()).unwrap_or_default();
        for fe in ext_socket.keys().chain(self.external_socket.keys()) {
            if ext_socket.get(fe) != self.external_socket.get(fe) || ext_policies.get(fe) != self.external_policies.get(fe) {
                touched.insert(*fe);
            }
        }
        self.external_socket = ext_socket;
        self.external_policies = ext_policies;
        // ClusterIPs keep priority over external frontends, with their
        // policies.
        let want = |fe: &Frontend| self.cache.desired_of(fe).or_else(|| self.external_socket.get(fe).cloned());
        let want_policy = |fe: &Frontend| {
            if self.cache.is_desired(fe) { self.cache.desired_policies().get(fe) } else { self.external_policies.get(fe) }
        };
        let plan = if full {
            let mut policies = self.cache.desired_policies().clone();
            for (fe, p) in &self.external_policies {
                if !self.cache.is_desired(fe) {
                    policies.insert(*fe, p.clone());
                }
            }
            plan::diff_layered_streams(
                writer.state_entries(),
                &writer.policies(),
                self.cache.desired_entries(),
                &self.external_socket,
                &policies,
            )
        } else {
            let current: plan::State =
                touched.iter().filter_map(|fe| Some((*fe, writer.backends_of(fe)?.iter().copied().collect()))).collect();
            let current_policies: Policies = touched.iter().filter_map(|fe| Some((*fe, writer.policy_of(fe)?.clone()))).collect();
            let desired: plan::State = touched.iter().filter_map(|fe| Some((*fe, want(fe)?))).collect();
            let desired_policies: Policies = touched.iter().filter_map(|fe| Some((*fe, want_policy(fe)?.clone()))).collect();
            plan::diff_with_policies(&current, &current_policies, &desired, &desired_policies)
        };
        // A held Service's frontends keep what is programmed: written
        // neither with the decision made without the labels it needs, nor
        // removed (issue #47).
        let mut plan = plan;
        if !wait.hold.is_empty() {
            plan.upserts.retain(|(fe, _)| !wait.hold.contains(fe));
            plan.deletes.retain(|fe| !wait.hold.contains(fe));
            plan.policies.retain(|fe, _| !wait.hold.contains(fe));
        }
        // What each rewritten frontend loses, read before the write.
        let mut left: Vec<(Frontend, Vec<Backend>)> = plan
            .upserts
            .iter()
            .map(|(fe, new)| (*fe, departures::left(writer.backends_of(fe).unwrap_or_default(), Some(new))))
            .filter(|(_, l)| !l.is_empty())
            .collect();
        // Which watched backends a pass looks at again: all in a full pass,
        // else those whose Service changed (their endpoint's state) or
        // whose frontend was written (their set).
        let everything = full || changes.all;
        // What a pass that looks at everything needs no more (100k entries
        // each at a cold start, beside the maps being written): the
        // frontends it compared are in the plan, and it looks at every
        // watched backend and, when it decided every Service, rebuilds
        // what it keeps per Service.
        drop(touched);
        if full && changes.all {
            services = BTreeSet::new();
        }
        let written: BTreeSet<Frontend> =
            if everything { BTreeSet::new() } else { plan.upserts.iter().map(|(fe, _)| *fe).chain(plan.deletes.iter().copied()).collect() };
        let (mut upserts, mut deletes) = (plan.upserts.len(), plan.deletes.len());
        let mut failures = writer.apply_owned(plan);
        self.retry = failures.iter().map(|f| f.frontend).collect();
        left.retain(|(fe, _)| !self.retry.contains(fe));
        let node_addrs: Vec<IpAddr> = external.as_deref().map(|e| e.node_addrs.clone()).unwrap_or_default();
        let scope = Scope { everything, services: &services, frontends: &written, now };
        let mut watched = std::mem::take(&mut self.watched);
        if !std::mem::replace(&mut self.seeded, true) {
            self.restart_watch(&mut watched, cluster, &node_addrs, |fe| writer.backends_of(fe).map(<[Backend]>::to_vec));
        }
        let (departures, mut recheck_at) =
            self.departures_of(cluster, &node_addrs, left, &mut watched, &scope, |fe| writer.backends_of(fe).map(<[Backend]>::to_vec));
        self.watched = watched;
        let mut tc_departures = Vec::new();

        if full {
            // Every decided Service: the set is built anew, in order.
            let cache = &self.cache;
            self.programmed = cache
                .decisions_by_service()
                .filter(|(id, decisions)| cache.owned_frontends_of(id, decisions).any(|fe| writer.backends_of(fe).is_some()))
                .map(|(id, _)| id.clone())
                .collect();
        } else {
            let owners = retried.iter().filter_map(|fe| self.cache.owner(fe).cloned());
            let recheck: Vec<ObjectRef> = services.iter().cloned().chain(owners).collect();
            for id in recheck {
                if self.cache.owned_frontends(&id).any(|fe| writer.backends_of(fe).is_some()) {
                    self.programmed.insert(id);
                } else {
                    self.programmed.remove(&id);
                }
            }
        }
        if changes.all {
            self.rebuild_no_local();
        } else {
            self.track_no_local(&services);
        }

        let mut external_problems = Vec::new();
        if let (Some(e), Some(ext)) = (external, ext) {
            // A held Service's TC entries keep what is programmed too.
            let ext = label_wait::hold_tc(ext, &wait.hold, |fe| e.tc_programmed(fe));
            let (np, problems) = e.apply(&ext);
            let mut watched = std::mem::take(&mut self.watched_tc);
            let tc_set = |fe: &Frontend| ext.tc.get(fe).map(|s| s.iter().copied().collect());
            if !std::mem::replace(&mut self.seeded_tc, true) {
                self.restart_watch(&mut watched, cluster, &node_addrs, tc_set);
            }
            // The TC sets are written whole each pass: every frontend that
            // lost a backend counts as written.
            let tc_written: BTreeSet<Frontend> = written.iter().copied().chain(np.left.iter().map(|(fe, _)| *fe)).collect();
            let tc_scope = Scope { frontends: &tc_written, ..scope };
            let (out, at) = self.departures_of(cluster, &node_addrs, np.left, &mut watched, &tc_scope, tc_set);
            tc_departures = out;
            recheck_at = earliest(recheck_at, at);
            self.watched_tc = watched;
            failures.extend(np.failures);
            upserts += np.upserts;
            deletes += np.deletes;
            external_problems.extend(problems);
            external_problems.extend(ext.problems.iter().cloned());
        }
        let problems = self
            .cache
            .decisions_with_problems()
            .flat_map(|d| d.problems.iter().map(move |p| format!("Service {}: {p}", d.service)))
            .chain(self.cache.clashes())
            .chain(external_problems)
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        SyncOutcome {
            upserts,
            deletes,
            problems,
            failures,
            services_programmed: self.programmed.len(),
            no_local_internal: self.no_local.0,
            no_local_external: self.no_local.1,
            departures,
            tc_departures,
            recheck_at: earliest(recheck_at, wait.recheck_at),
            held: wait.held,
            gave_up: wait.gave_up,
            released: wait.released,
        }
    }

    /// Which Services wait for labels of other Nodes at `now`
    /// (`decide::label_wait`), from what each needs and what the source
    /// listed: the frontends to keep as programmed, those to compare again
    /// (a wait that ended), and what to report.
    fn follow_label_waits(&mut self, now: Instant, node_addrs: &[IpAddr]) -> LabelWaits {
        let own = self.cache.node().to_string();
        let mut out = LabelWaits::default();
        let mut before = std::mem::take(&mut self.waiting);
        for (id, (labels, nodes)) in &self.label_needs {
            let Some(missing) = label_wait::missing(labels, nodes, &own, &self.listed) else { continue };
            let was = before.remove(id);
            let since = was.as_ref().map_or(now, |w| w.since);
            let gave_up = match label_wait::verdict(now.saturating_duration_since(since), self.label_wait) {
                Verdict::Hold => {
                    if was.is_none() {
                        out.held.push((id.clone(), missing.clone()));
                    }
                    out.recheck_at = earliest(out.recheck_at, Some(since + self.label_wait));
                    for d in self.cache.decisions_of(id) {
                        out.hold.extend(d.frontends.iter().filter(|fe| self.cache.owner(fe) == Some(id)).copied());
                        out.hold.extend(d.external_frontends(node_addrs));
                    }
                    false
                }
                Verdict::GiveUp => {
                    if !was.as_ref().is_some_and(|w| w.gave_up) {
                        out.gave_up.push((id.clone(), missing.clone()));
                        out.release_service(self.cache.decisions_of(id), node_addrs);
                    }
                    true
                }
            };
            self.waiting.insert(id.clone(), Waiting { since, missing, gave_up });
        }
        // No longer missing anything (or gone): compared again, now from
        // the labels listed.
        for (id, w) in before {
            if !w.gave_up && self.label_needs.contains_key(&id) {
                out.released.push((id.clone(), now.saturating_duration_since(w.since)));
            }
            out.release_service(self.cache.decisions_of(&id), node_addrs);
        }
        out
    }

    /// Issue #34: follows the endpoints' tiers and hands both datapaths'
    /// writers how the frontends of the re-decided Services (all in a full
    /// pass) count their connections, before the plan is written.
    fn count_topology(
        &self,
        writer: &mut impl SocketMaps,
        external: Option<&mut ExternalDatapath>,
        changes: &Changes,
        services: &BTreeSet<ObjectRef>,
        full: bool,
    ) {
        let node_addrs = external.as_deref().map(|e| e.node_addrs.clone()).unwrap_or_default();
        let (mut socket, mut tc) = (Vec::new(), Vec::new());
        // Every Service's decisions in one walk, or the re-decided ones'.
        let mut count = |decisions: &[PortDecision]| {
            for d in decisions {
                d.frontend_topology(&node_addrs, &mut socket, &mut tc);
            }
        };
        if full || changes.all {
            for (_, decisions) in self.cache.decisions_by_service() {
                count(decisions);
            }
        } else {
            for id in services {
                count(self.cache.decisions_of(id));
            }
        }
        writer.set_tiers(&self.tiers);
        writer.set_topology(&socket);
        if let Some(w) = external.and_then(ExternalDatapath::service_writer) {
            w.set_tiers(&self.tiers);
            w.set_topology(&tc);
        }
    }

    /// The Service a programmed frontend belongs to: the owner of a
    /// ClusterIP, else the Service whose external frontends (NodePorts on
    /// `node_addrs`, external and LoadBalancer IPs) include it.
    fn owner_of(&self, fe: &Frontend, node_addrs: &[IpAddr]) -> Option<ObjectRef> {
        if let Some(owner) = self.cache.owner(fe) {
            return Some(owner.clone());
        }
        let claims = |d: &PortDecision| {
            d.port.protocol == fe.protocol
                && (d.frontends.contains(fe)
                    || d.external_frontends(node_addrs).contains(fe)
                    || (d.port.port == fe.port && d.load_balancer_ips.contains(&fe.ip)))
        };
        self.external_services.iter().find(|id| self.cache.decisions_of(id).iter().any(claims)).cloned()
    }

    /// One datapath's departures in this pass (`departures::step` for each
    /// watched backend in `scope`, after the backends in `left`, which left
    /// the frontends written, joined them), and when a pass is owed next.
    /// `current` gives a frontend's set as written.
    fn departures_of(
        &self,
        cluster: &Cluster,
        node_addrs: &[IpAddr],
        left: Vec<(Frontend, Vec<Backend>)>,
        watched: &mut WatchSet,
        scope: &Scope,
        current: impl Fn(&Frontend) -> Option<Vec<Backend>>,
    ) -> (Vec<Departure>, Option<Instant>) {
        for (fe, backends) in left {
            let owner = self.owner_of(&fe, node_addrs);
            for b in backends {
                // Left just now: what an earlier stay outside the set saw
                // no longer counts.
                watched.insert((fe, b), Watched { watch: Watch::default(), owner: owner.clone() });
            }
        }
        let mut out = Vec::new();
        let mut recheck_at = None;
        let mut sets: BTreeMap<Frontend, Option<Vec<Backend>>> = BTreeMap::new();
        watched.retain(|(fe, b), w| {
            let looked_at = scope.everything
                || w.watch.gone_since.is_some()
                || scope.frontends.contains(fe)
                || w.owner.as_ref().is_none_or(|o| scope.services.contains(o));
            if !looked_at {
                return true;
            }
            let service = self.owner_of(fe, node_addrs);
            let state = service
                .as_ref()
                .map_or(EndpointState::Unknown, |s| departures::endpoint_state(self.cache.slices_of(cluster, s), b, fe.protocol));
            let set = sets.entry(*fe).or_insert_with(|| current(fe));
            match departures::step(fe.protocol, self.tcp, b, w.watch, state, set.as_deref(), scope.now) {
                Step::Watch { watch, recheck_at: at } => {
                    w.watch = watch;
                    if service.is_some() {
                        w.owner = service;
                    }
                    recheck_at = earliest(recheck_at, at);
                    true
                }
                Step::Forget => false,
                Step::End(reason) => {
                    out.push(Departure { frontend: *fe, backend: *b, service, reason });
                    false
                }
            }
        });
        (out, recheck_at)
    }

    /// What an earlier agent may have been watching when this one started
    /// (`departures::restart_watch`: draining endpoints, and for TCP every
    /// terminating one) outside the set written for one of a decided
    /// Service port's frontends, into `watched` as seen terminating. The
    /// sets written no longer hold a backend that left, and nothing else
    /// remembers it across a restart; without this, its clients would stay
    /// on it after it stops serving (UDP) or is gone (TCP). `current` gives
    /// a frontend's set as written.
    fn restart_watch(
        &self,
        watched: &mut WatchSet,
        cluster: &Cluster,
        node_addrs: &[IpAddr],
        current: impl Fn(&Frontend) -> Option<Vec<Backend>>,
    ) {
        // Every Service with external frontends is among the decided ones.
        for (id, decisions) in self.cache.decisions_by_service() {
            let slices: Vec<&EndpointSlice> = self.cache.slices_of(cluster, id).collect();
            if slices.iter().all(|s| !s.endpoints.iter().any(|e| e.terminating)) {
                continue;
            }
            for d in decisions {
                let owned = d.frontends.iter().filter(|fe| self.cache.owner(fe) == Some(id)).copied();
                for fe in owned.chain(d.external_frontends(node_addrs)) {
                    let terminating = departures::restart_watch(&slices, &d.port, &fe);
                    if terminating.is_empty() {
                        continue;
                    }
                    let Some(set) = current(&fe).filter(|s| !s.is_empty()) else { continue };
                    for b in terminating.into_iter().filter(|b| !set.contains(b)) {
                        let watch = Watch { seen_terminating: true, gone_since: None };
                        watched.entry((fe, b)).or_insert(Watched { watch, owner: Some(id.clone()) });
                    }
                }
            }
        }
    }
}

/// Ports without local endpoints for the internal and the external Local
/// policy among a Service's `decisions`.
fn no_local_count(decisions: &[PortDecision]) -> (usize, usize) {
    let mut now = (0, 0);
    for d in decisions {
        let (internal, external) = d.no_local_endpoints();
        now.0 += usize::from(internal);
        now.1 += usize::from(external);
    }
    now
}

/// Counts the local endpoint addresses of Service `id` (its `decisions`),
/// which has none counted.
fn add_local(
    local_of: &mut BTreeMap<ObjectRef, Vec<IpAddr>>,
    local_refs: &mut BTreeMap<IpAddr, usize>,
    id: &ObjectRef,
    decisions: &[PortDecision],
) {
    let mut local: Vec<IpAddr> = decisions.iter().flat_map(|d| d.local.iter().map(|b| b.ip)).collect();
    local.sort();
    local.dedup();
    for ip in &local {
        *local_refs.entry(*ip).or_default() += 1;
    }
    if !local.is_empty() {
        local_of.insert(id.clone(), local);
    }
}

/// The labels of other Nodes that Service `id`'s topology needs and its
/// slices do not carry, with the Nodes its endpoints run on; `None` when
/// it needs none.
fn label_needs(
    cache: &DecisionCache,
    cluster: &Cluster,
    id: &ObjectRef,
    svc: &crate::model::Service,
) -> Option<(BTreeSet<String>, BTreeSet<String>)> {
    let endpoints: Vec<&crate::model::Endpoint> = cache.slices_of(cluster, id).flat_map(|s| s.endpoints.iter()).collect();
    let labels = crate::decide::topology::other_node_labels(svc, &endpoints);
    if labels.is_empty() {
        return None;
    }
    let nodes = crate::decide::topology::endpoint_nodes(&endpoints);
    Some((labels, nodes))
}

/// The default of `--node-label-wait-secs`.
pub const DEFAULT_LABEL_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// What [`CachedSync::follow_label_waits`] found.
#[derive(Default)]
struct LabelWaits {
    /// Frontends of held Services: kept as programmed.
    hold: BTreeSet<Frontend>,
    /// Frontends of Services whose wait ended: compared again.
    release: BTreeSet<Frontend>,
    held: Vec<(ObjectRef, Missing)>,
    gave_up: Vec<(ObjectRef, Missing)>,
    released: Vec<(ObjectRef, std::time::Duration)>,
    recheck_at: Option<Instant>,
}

impl LabelWaits {
    fn release_service(&mut self, decisions: &[PortDecision], node_addrs: &[IpAddr]) {
        for d in decisions {
            self.release.extend(d.frontends.iter().copied());
            self.release.extend(d.external_frontends(node_addrs));
        }
    }
}

/// Which watched backends a pass steps ([`CachedSync::departures_of`]),
/// and its clock.
#[derive(Clone, Copy)]
struct Scope<'a> {
    /// A full pass (or one that decided every Service): all of them.
    everything: bool,
    /// The Services decided again in this pass.
    services: &'a BTreeSet<ObjectRef>,
    /// The frontends written in this pass.
    frontends: &'a BTreeSet<Frontend>,
    now: Instant,
}

fn earliest(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

#[cfg(test)]
mod departure_tests;
#[cfg(test)]
mod explain_run_tests;
#[cfg(test)]
mod label_need_tests;
#[cfg(test)]
mod policy_tests;
