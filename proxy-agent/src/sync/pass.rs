//! One pass of the data flow: model -> decisions -> desired state -> plan ->
//! maps, kept between passes so that a pass costs in proportion to what
//! changed. The maps sit behind [`SocketMaps`]: the pinned maps
//! (`MapWriter`) in the agent, an in-memory set ([`MemoryMaps`]) in
//! `explain` and in the unit tests.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use crate::datapath::map_writer::{ApplyError, MapWriter, WriteError};
use crate::datapath::maps;
use crate::decide::cache::DecisionCache;
use crate::decide::decision::{self, PortDecision};
use crate::decide::departures::{self, Departure, Draining, EndpointState};
use crate::decide::plan::{self, FrontendPolicy, Plan, Policies};
use crate::external::nodeport::ExternalDatapath;
use crate::model::store::Changes;
use crate::model::{Backend, Cluster, EndpointSlice, Frontend, ObjectRef};

/// What a pass needs of the socket datapath's maps.
pub trait SocketMaps {
    /// What the maps hold, in the planner's terms.
    fn state(&self) -> plan::State;
    /// The backends programmed for `fe`, in slot order.
    fn backends_of(&self, fe: &Frontend) -> Option<&[Backend]>;
    /// The programmed frontends whose policy is not the default.
    fn policies(&self) -> Policies;
    /// The policy `fe` is programmed with.
    fn policy_of(&self, fe: &Frontend) -> Option<&FrontendPolicy>;
    /// Applies a plan; each frontend is written completely or not at all,
    /// and the ones that failed are returned.
    fn apply(&mut self, plan: &Plan) -> Vec<ApplyError>;
    /// Frontends programmed.
    fn frontends(&self) -> usize;
    /// Backends programmed, summed over all frontends.
    fn endpoints(&self) -> usize;
    /// (map, entries in use, capacity) per map, for metrics.
    fn occupancy(&self) -> Vec<(&'static str, u32, u32)>;
    /// The Maglev table size, tables linked in and their bytes, for
    /// metrics; `None` where there are no tables (maps held in memory).
    fn maglev_usage(&self) -> Option<(Option<crate::decide::maglev::TableSize>, u32, u64)> {
        None
    }
    /// Frontends without the Maglev table they ask for, because it did not
    /// fit the tables' share of the memory budget.
    fn maglev_refused(&self) -> usize {
        0
    }
}

impl SocketMaps for MapWriter {
    fn state(&self) -> plan::State {
        MapWriter::state(self)
    }
    fn backends_of(&self, fe: &Frontend) -> Option<&[Backend]> {
        MapWriter::backends_of(self, fe)
    }
    fn policies(&self) -> Policies {
        MapWriter::policies(self)
    }
    fn policy_of(&self, fe: &Frontend) -> Option<&FrontendPolicy> {
        MapWriter::policy_of(self, fe)
    }
    fn apply(&mut self, plan: &Plan) -> Vec<ApplyError> {
        MapWriter::apply(self, plan)
    }
    fn frontends(&self) -> usize {
        MapWriter::frontends(self)
    }
    fn endpoints(&self) -> usize {
        MapWriter::endpoints(self)
    }
    fn occupancy(&self) -> Vec<(&'static str, u32, u32)> {
        MapWriter::occupancy(self).to_vec()
    }
    fn maglev_usage(&self) -> Option<(Option<crate::decide::maglev::TableSize>, u32, u64)> {
        MapWriter::maglev_usage(self)
    }
    fn maglev_refused(&self) -> usize {
        MapWriter::maglev_refused(self)
    }
}

/// The socket maps held in memory: what `explain` shows the agent would
/// program, and what the sync loop's unit tests read back. `capacity`
/// bounds the frontends like `--max-services` bounds the real map.
#[derive(Debug, Default)]
pub struct MemoryMaps {
    pub programmed: BTreeMap<Frontend, Vec<Backend>>,
    /// The programmed frontends' policies, where not the default.
    pub policies: Policies,
    pub capacity: Option<u32>,
}

impl SocketMaps for MemoryMaps {
    fn state(&self) -> plan::State {
        self.programmed.iter().map(|(fe, b)| (*fe, b.iter().copied().collect())).collect()
    }
    fn backends_of(&self, fe: &Frontend) -> Option<&[Backend]> {
        self.programmed.get(fe).map(Vec::as_slice)
    }
    fn policies(&self) -> Policies {
        self.policies.clone()
    }
    fn policy_of(&self, fe: &Frontend) -> Option<&FrontendPolicy> {
        static DEFAULT: FrontendPolicy = FrontendPolicy { affinity_timeout_s: None, affinity_scope: 0, source_ranges: None };
        self.programmed.contains_key(fe).then(|| self.policies.get(fe).unwrap_or(&DEFAULT))
    }
    fn apply(&mut self, plan: &Plan) -> Vec<ApplyError> {
        for fe in &plan.deletes {
            self.programmed.remove(fe);
            self.policies.remove(fe);
        }
        let mut failures = Vec::new();
        for (fe, backends) in &plan.upserts {
            let used = u32::try_from(self.programmed.len()).unwrap_or(u32::MAX);
            match self.capacity {
                Some(max) if !self.programmed.contains_key(fe) && used >= max => failures.push(ApplyError {
                    frontend: *fe,
                    error: WriteError::Full { map: maps::SERVICES.name, used, max, needed: 1, flag: maps::SERVICES.flag() },
                }),
                _ => {
                    self.programmed.insert(*fe, backends.clone());
                    match plan.policies.get(fe) {
                        Some(p) => self.policies.insert(*fe, p.clone()),
                        None => self.policies.remove(fe),
                    };
                }
            }
        }
        failures
    }
    fn frontends(&self) -> usize {
        self.programmed.len()
    }
    fn endpoints(&self) -> usize {
        self.programmed.values().map(Vec::len).sum()
    }
    fn occupancy(&self) -> Vec<(&'static str, u32, u32)> {
        let used = u32::try_from(self.programmed.len()).unwrap_or(u32::MAX);
        vec![(proxy_common::SERVICES_MAP, used, self.capacity.unwrap_or(u32::MAX))]
    }
}

/// What one pass did.
#[derive(Debug, Default)]
pub struct SyncOutcome {
    pub upserts: usize,
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
    pub no_local_external: usize,
    /// Backends that left a socket-datapath frontend's set in a way that
    /// ends the connections made to them (`decide::departures`): the
    /// sockets translated to them are to be terminated. Only frontends
    /// that were written are listed.
    pub departures: Vec<Departure>,
    /// The same for the TC datapath's frontends: their conntrack flows are
    /// to be flushed.
    pub tc_departures: Vec<Departure>,
}

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
    local_of: BTreeMap<ObjectRef, Vec<IpAddr>>,
    local_refs: BTreeMap<IpAddr, usize>,
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
    /// Backends that left a frontend while draining (terminating, still
    /// serving), kept until their connections are to end too
    /// (`departures::recheck_draining`): of the socket datapath, and of the
    /// TC one.
    draining: BTreeSet<(Frontend, Backend)>,
    draining_tc: BTreeSet<(Frontend, Backend)>,
    /// Whether `draining` and `draining_tc` were seeded with what an
    /// earlier agent may have been watching (see [`Self::restart_draining`]):
    /// once, in the first pass that writes each datapath.
    seeded: bool,
    seeded_tc: bool,
}

impl CachedSync {
    pub fn new(node: &str) -> CachedSync {
        CachedSync {
            cache: DecisionCache::new(node),
            external_socket: plan::State::new(),
            external_policies: Policies::new(),
            programmed: BTreeSet::new(),
            external_services: BTreeSet::new(),
            local_of: BTreeMap::new(),
            local_refs: BTreeMap::new(),
            retry: BTreeSet::new(),
            no_local_of: BTreeMap::new(),
            no_local: (0, 0),
            draining: BTreeSet::new(),
            draining_tc: BTreeSet::new(),
            seeded: false,
            seeded_tc: false,
        }
    }

    /// Recounts the ports without local endpoints of the Services in `ids`
    /// after they were decided again.
    fn track_no_local<'a>(&mut self, ids: impl IntoIterator<Item = &'a ObjectRef>) {
        for id in ids {
            let mut now = (0, 0);
            for d in self.cache.decisions_of(id) {
                let (internal, external) = d.no_local_endpoints();
                now.0 += usize::from(internal);
                now.1 += usize::from(external);
            }
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
            let mut local: Vec<IpAddr> = decisions.iter().flat_map(|d| d.local.iter().map(|b| b.ip)).collect();
            local.sort();
            local.dedup();
            for ip in self.local_of.remove(&id).unwrap_or_default() {
                if let Some(n) = self.local_refs.get_mut(&ip) {
                    *n -= 1;
                    if *n == 0 {
                        self.local_refs.remove(&ip);
                    }
                }
            }
            for ip in &local {
                *self.local_refs.entry(*ip).or_default() += 1;
            }
            if !local.is_empty() {
                self.local_of.insert(id, local);
            }
        }
    }

    pub fn pass(
        &mut self,
        writer: &mut impl SocketMaps,
        external: Option<&mut ExternalDatapath>,
        cluster: &Cluster,
        changes: &Changes,
        full: bool,
    ) -> SyncOutcome {
        let update = self.cache.update(cluster, changes);
        let mut touched = update.frontends;
        let retried = std::mem::take(&mut self.retry);
        touched.extend(retried.iter().copied());
        if changes.all {
            let all: Vec<ObjectRef> = self
                .cache
                .service_ids()
                .chain(self.local_of.keys())
                .chain(self.external_services.iter())
                .chain(self.no_local_of.keys())
                .cloned()
                .collect();
            self.track_no_local(&all);
            self.track_external(all);
        } else {
            self.track_no_local(&update.services);
            self.track_external(update.services.iter().cloned());
        }
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
        let want = |fe: &Frontend| self.cache.desired().get(fe).or_else(|| self.external_socket.get(fe));
        let want_policy = |fe: &Frontend| {
            if self.cache.desired().contains_key(fe) { self.cache.desired_policies().get(fe) } else { self.external_policies.get(fe) }
        };
        let plan = if full {
            let mut policies = self.cache.desired_policies().clone();
            for (fe, p) in &self.external_policies {
                if !self.cache.desired().contains_key(fe) {
                    policies.insert(*fe, p.clone());
                }
            }
            plan::diff_layered(&writer.state(), &writer.policies(), self.cache.desired(), &self.external_socket, &policies)
        } else {
            let current: plan::State =
                touched.iter().filter_map(|fe| Some((*fe, writer.backends_of(fe)?.iter().copied().collect()))).collect();
            let current_policies: Policies = touched.iter().filter_map(|fe| Some((*fe, writer.policy_of(fe)?.clone()))).collect();
            let desired: plan::State = touched.iter().filter_map(|fe| Some((*fe, want(fe)?.clone()))).collect();
            let desired_policies: Policies = touched.iter().filter_map(|fe| Some((*fe, want_policy(fe)?.clone()))).collect();
            plan::diff_with_policies(&current, &current_policies, &desired, &desired_policies)
        };
        // What each rewritten frontend loses, read before the write.
        let mut left: Vec<(Frontend, Vec<Backend>)> = plan
            .upserts
            .iter()
            .map(|(fe, new)| (*fe, departures::left(writer.backends_of(fe).unwrap_or_default(), Some(new))))
            .filter(|(_, l)| !l.is_empty())
            .collect();
        let mut failures = writer.apply(&plan);
        self.retry = failures.iter().map(|f| f.frontend).collect();
        left.retain(|(fe, _)| !self.retry.contains(fe));
        let node_addrs: Vec<IpAddr> = external.as_deref().map(|e| e.node_addrs.clone()).unwrap_or_default();
        let mut draining = std::mem::take(&mut self.draining);
        if !std::mem::replace(&mut self.seeded, true) {
            draining.extend(self.restart_draining(cluster, &node_addrs, |fe| writer.backends_of(fe).map(<[Backend]>::to_vec)));
        }
        let departures =
            self.departures_of(cluster, &node_addrs, left, &mut draining, |fe| writer.backends_of(fe).map(<[Backend]>::to_vec));
        self.draining = draining;
        let mut tc_departures = Vec::new();

        let recheck: Vec<ObjectRef> = if full {
            self.cache.service_ids().chain(self.programmed.iter()).cloned().collect()
        } else {
            let owners = retried.iter().filter_map(|fe| self.cache.owner(fe).cloned());
            update.services.into_iter().chain(owners).collect()
        };
        for id in recheck {
            if self.cache.owned_frontends(&id).any(|fe| writer.backends_of(fe).is_some()) {
                self.programmed.insert(id);
            } else {
                self.programmed.remove(&id);
            }
        }

        let (mut upserts, mut deletes) = (plan.upserts.len(), plan.deletes.len());
        let mut external_problems = Vec::new();
        if let (Some(e), Some(ext)) = (external, ext.as_ref()) {
            let (np, problems) = e.apply(ext);
            let mut draining = std::mem::take(&mut self.draining_tc);
            if !std::mem::replace(&mut self.seeded_tc, true) {
                draining.extend(self.restart_draining(cluster, &node_addrs, |fe| ext.tc.get(fe).map(|s| s.iter().copied().collect())));
            }
            tc_departures =
                self.departures_of(cluster, &node_addrs, np.left, &mut draining, |fe| ext.tc.get(fe).map(|s| s.iter().copied().collect()));
            self.draining_tc = draining;
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

    /// One datapath's departures in this pass: the backends in `left` that
    /// left the frontends written (see [`Self::classify_departures`]), and
    /// the draining ones of `draining` whose connections end now (see
    /// [`Self::recheck_draining`]); `draining` then holds the ones still
    /// draining, those that started in this pass included. `current` gives
    /// a frontend's set as written.
    fn departures_of(
        &self,
        cluster: &Cluster,
        node_addrs: &[IpAddr],
        left: Vec<(Frontend, Vec<Backend>)>,
        draining: &mut BTreeSet<(Frontend, Backend)>,
        current: impl Fn(&Frontend) -> Option<Vec<Backend>>,
    ) -> Vec<Departure> {
        let (mut out, started) = self.classify_departures(cluster, node_addrs, left);
        out.extend(self.recheck_draining(cluster, node_addrs, draining, current));
        draining.extend(started);
        out
    }

    /// [`departures::classify`] for backends that left the frontends
    /// written in this pass, against the endpoints of each frontend's
    /// Service as the model has them now; and the ones that left while
    /// draining, to be checked again in later passes.
    fn classify_departures(
        &self,
        cluster: &Cluster,
        node_addrs: &[IpAddr],
        left: Vec<(Frontend, Vec<Backend>)>,
    ) -> (Vec<Departure>, Vec<(Frontend, Backend)>) {
        let mut out = Vec::new();
        let mut draining = Vec::new();
        for (fe, backends) in left {
            let service = self.owner_of(&fe, node_addrs);
            out.extend(departures::classify(fe, &backends, |fe, b| {
                let state = match &service {
                    Some(s) => departures::endpoint_state(self.cache.slices_of(cluster, s), b, fe.protocol),
                    None => EndpointState::Unknown,
                };
                if state == EndpointState::TerminatingServing {
                    draining.push((*fe, *b));
                }
                (service.clone(), state)
            }));
        }
        (out, draining)
    }

    /// What an earlier agent may have been watching as draining when this
    /// one started: each draining endpoint of a decided Service port
    /// outside the set written for one of the port's frontends
    /// (`departures::draining_endpoints`). The sets written no longer hold
    /// a backend that left while draining, and nothing else remembers it
    /// across a restart; without this, its clients would stay on it after
    /// it stops serving. `current` gives a frontend's set as written.
    fn restart_draining(
        &self,
        cluster: &Cluster,
        node_addrs: &[IpAddr],
        current: impl Fn(&Frontend) -> Option<Vec<Backend>>,
    ) -> Vec<(Frontend, Backend)> {
        let ids: BTreeSet<&ObjectRef> = self.cache.service_ids().chain(self.external_services.iter()).collect();
        let mut out = Vec::new();
        for id in ids {
            let decisions = self.cache.decisions_of(id);
            let slices: Vec<&EndpointSlice> = self.cache.slices_of(cluster, id).collect();
            if slices.iter().all(|s| !s.endpoints.iter().any(|e| e.terminating && e.serving)) {
                continue;
            }
            for d in decisions {
                let owned = d.frontends.iter().filter(|fe| self.cache.owner(fe) == Some(id)).copied();
                for fe in owned.chain(d.external_frontends(node_addrs)) {
                    let draining = departures::draining_endpoints(&slices, &d.port, &fe);
                    if draining.is_empty() {
                        continue;
                    }
                    let Some(set) = current(&fe).filter(|s| !s.is_empty()) else { continue };
                    out.extend(draining.into_iter().filter(|b| !set.contains(b)).map(|b| (fe, b)));
                }
            }
        }
        out
    }

    /// The draining backends in `draining` whose connections end now
    /// (`departures::recheck_draining`), which leave the set with those
    /// forgotten; `current` gives a frontend's set as written.
    fn recheck_draining(
        &self,
        cluster: &Cluster,
        node_addrs: &[IpAddr],
        draining: &mut BTreeSet<(Frontend, Backend)>,
        current: impl Fn(&Frontend) -> Option<Vec<Backend>>,
    ) -> Vec<Departure> {
        let mut out = Vec::new();
        draining.retain(|(fe, b)| {
            let service = self.owner_of(fe, node_addrs);
            let state = service
                .as_ref()
                .map_or(EndpointState::Unknown, |s| departures::endpoint_state(self.cache.slices_of(cluster, s), b, fe.protocol));
            match departures::recheck_draining(b, state, current(fe).as_deref()) {
                Draining::Wait => true,
                Draining::Forget => false,
                Draining::End(reason) => {
                    out.push(Departure { frontend: *fe, backend: *b, service, reason });
                    false
                }
            }
        });
        out
    }
}

#[cfg(test)]
mod policy_tests {
    use super::*;
    use crate::model::Protocol;

    fn cluster(affinity: &str) -> Cluster {
        let yaml = format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: web}}\nspec: {{clusterIP: 10.96.0.10, ports: [{{port: 80}}]{affinity}}}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: web-1, labels: {{kubernetes.io/service-name: web}}}}\naddressType: IPv4\nports: [{{port: 8080}}]\nendpoints: [{{addresses: [10.244.0.1], nodeName: a}}, {{addresses: [10.244.0.2], nodeName: b}}]\n"
        );
        let (c, e) = crate::source::manifest_watch::cluster_from_text(&yaml);
        assert!(e.is_empty(), "{e:?}");
        c
    }

    /// The plan the pass hands the writer for affinity: a change of
    /// affinity alone rewrites the frontend (with its unchanged backends),
    /// and nothing else does.
    #[test]
    fn affinity_changes_rewrite_the_frontend_and_nothing_else_does() {
        let fe = Frontend { ip: "10.96.0.10".parse().unwrap(), port: 80, protocol: Protocol::Tcp };
        let web = Changes { services: [ObjectRef::new("default", "web")].into(), ..Changes::default() };
        let mut pass = CachedSync::new("a");
        let mut maps = MemoryMaps::default();
        // (step, affinity fields, full pass, writes, timeout programmed)
        let steps = [
            ("first sync", ", sessionAffinity: ClientIP, sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}", true, 1, Some(60)),
            ("unchanged", ", sessionAffinity: ClientIP, sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}", false, 0, Some(60)),
            (
                "unchanged, full pass",
                ", sessionAffinity: ClientIP, sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}",
                true,
                0,
                Some(60),
            ),
            ("shorter timeout", ", sessionAffinity: ClientIP, sessionAffinityConfig: {clientIP: {timeoutSeconds: 2}}", false, 1, Some(2)),
            ("affinity dropped", "", false, 1, None),
            ("no affinity, full pass", "", true, 0, None),
            ("affinity back, full pass", ", sessionAffinity: ClientIP", true, 1, Some(10_800)),
        ];
        for (i, (name, fields, full, writes, timeout)) in steps.into_iter().enumerate() {
            let changes = if i == 0 { Changes { all: true, ..Changes::default() } } else { web.clone() };
            let outcome = pass.pass(&mut maps, None, &cluster(fields), &changes, full);
            assert_eq!(outcome.upserts, writes, "{name}");
            assert_eq!(maps.policy_of(&fe).and_then(|p| p.affinity_timeout_s), timeout, "{name}");
            assert_eq!(maps.backends_of(&fe).map(<[Backend]>::len), Some(2), "{name}: the backends stay");
        }
    }
}

#[cfg(test)]
mod departure_tests {
    use super::*;
    use crate::decide::departures::Reason;
    use crate::model::Protocol;

    /// A UDP Service on node `a` with the given endpoints, each
    /// `(address, conditions, node)`; `annotations` for topology.
    fn cluster(endpoints: &[(&str, &str, &str)], annotations: &str) -> Cluster {
        let eps: Vec<String> =
            endpoints.iter().map(|(ip, cond, node)| format!("{{addresses: [{ip}], nodeName: {node}, conditions: {{{cond}}}}}")).collect();
        let yaml = format!(
            "kind: Node\nmetadata: {{name: a, labels: {{topology.kubernetes.io/zone: z1}}}}\n---\nkind: Node\nmetadata: {{name: b, labels: {{topology.kubernetes.io/zone: z2}}}}\n---\napiVersion: v1\nkind: Service\nmetadata: {{name: dns, annotations: {{{annotations}}}}}\nspec: {{clusterIP: 10.96.0.10, ports: [{{port: 53, protocol: UDP}}]}}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: dns-1, labels: {{kubernetes.io/service-name: dns}}}}\naddressType: IPv4\nports: [{{port: 53, protocol: UDP}}]\nendpoints: [{}]\n",
            eps.join(", ")
        );
        let (c, e) = crate::source::manifest_watch::cluster_from_text(&yaml);
        assert!(e.is_empty(), "{e:?}");
        c
    }

    const READY: &str = "ready: true";
    const DRAINING: &str = "ready: false, serving: true, terminating: true";
    const NOT_READY: &str = "ready: false";
    const GONE_FROM_SERVING: &str = "ready: false, serving: false, terminating: true";
    /// The step that starts a new agent over the same maps.
    const RESTART: &str = "the agent restarts while it drains";

    /// Each step's sets and the departures the pass reports, in order:
    /// one pass over the in-memory maps per step.
    #[test]
    fn a_pass_reports_the_backends_whose_connections_end() {
        let zone_first = "topoproxy.io/topology-keys: \"topology.kubernetes.io/zone, *\"";
        // (step, endpoints, annotations, departures as (backend, reason))
        type Step<'a> = (&'a str, Vec<(&'a str, &'a str, &'a str)>, &'a str, Vec<(&'a str, Reason)>);
        let steps: Vec<Step> = vec![
            ("first sync", vec![("10.244.0.1", READY, "a"), ("10.244.0.2", READY, "b"), ("10.244.0.3", READY, "b")], "", vec![]),
            ("one deleted", vec![("10.244.0.1", READY, "a"), ("10.244.0.3", READY, "b")], "", vec![("10.244.0.2", Reason::Deleted)]),
            ("one draining keeps its sockets", vec![("10.244.0.1", READY, "a"), ("10.244.0.3", DRAINING, "b")], "", vec![]),
            ("still draining", vec![("10.244.0.1", READY, "a"), ("10.244.0.3", DRAINING, "b")], "", vec![]),
            (
                "the drained one stops serving: now its sockets go",
                vec![("10.244.0.1", READY, "a"), ("10.244.0.3", GONE_FROM_SERVING, "b")],
                "",
                vec![("10.244.0.3", Reason::NotServing)],
            ),
            ("then it goes away: already done", vec![("10.244.0.1", READY, "a")], "", vec![]),
            ("a new one", vec![("10.244.0.1", READY, "a"), ("10.244.0.6", READY, "b")], "", vec![]),
            ("it drains", vec![("10.244.0.1", READY, "a"), ("10.244.0.6", DRAINING, "b")], "", vec![]),
            ("and is deleted while draining", vec![("10.244.0.1", READY, "a")], "", vec![("10.244.0.6", Reason::Deleted)]),
            ("a new one", vec![("10.244.0.1", READY, "a"), ("10.244.0.4", READY, "b")], "", vec![]),
            (
                "one fails readiness",
                vec![("10.244.0.1", READY, "a"), ("10.244.0.4", NOT_READY, "b")],
                "",
                vec![("10.244.0.4", Reason::NotServing)],
            ),
            ("back", vec![("10.244.0.1", READY, "a"), ("10.244.0.4", READY, "b")], "", vec![]),
            (
                "topology: this zone first, the other zone's endpoint leaves",
                vec![("10.244.0.1", READY, "a"), ("10.244.0.4", READY, "b")],
                zone_first,
                vec![("10.244.0.4", Reason::Topology)],
            ),
            ("topology off again", vec![("10.244.0.1", READY, "a"), ("10.244.0.4", READY, "b")], "", vec![]),
            ("the last serving endpoint goes: nothing to reconnect to", vec![("10.244.0.4", NOT_READY, "b")], "", vec![]),
            ("served again", vec![("10.244.0.5", READY, "b")], "", vec![]),
            (
                "two new ones replace it",
                vec![("10.244.0.1", READY, "a"), ("10.244.0.7", READY, "b")],
                "",
                vec![("10.244.0.5", Reason::Deleted)],
            ),
            ("it drains", vec![("10.244.0.1", READY, "a"), ("10.244.0.7", DRAINING, "b")], "", vec![]),
            (RESTART, vec![("10.244.0.1", READY, "a"), ("10.244.0.7", DRAINING, "b")], "", vec![]),
            (
                "it stops serving: the new agent ends its sockets",
                vec![("10.244.0.1", READY, "a"), ("10.244.0.7", GONE_FROM_SERVING, "b")],
                "",
                vec![("10.244.0.7", Reason::NotServing)],
            ),
            ("and another", vec![("10.244.0.1", READY, "a"), ("10.244.0.8", READY, "b")], "", vec![]),
            ("it drains", vec![("10.244.0.1", READY, "a"), ("10.244.0.8", DRAINING, "b")], "", vec![]),
            (RESTART, vec![("10.244.0.1", READY, "a"), ("10.244.0.8", DRAINING, "b")], "", vec![]),
            ("it is deleted: the new agent ends its sockets", vec![("10.244.0.1", READY, "a")], "", vec![("10.244.0.8", Reason::Deleted)]),
        ];
        let fe = Frontend { ip: "10.96.0.10".parse().unwrap(), port: 53, protocol: Protocol::Udp };
        let mut pass = CachedSync::new("a");
        let mut maps = MemoryMaps::default();
        let all = Changes { all: true, ..Changes::default() };
        for (name, endpoints, annotations, want) in steps {
            if name == RESTART {
                // What it remembered is gone; the pinned maps stay.
                pass = CachedSync::new("a");
            }
            let outcome = pass.pass(&mut maps, None, &cluster(&endpoints, annotations), &all, false);
            let got: Vec<(String, Reason)> = outcome.departures.iter().map(|d| (d.backend.ip.to_string(), d.reason)).collect();
            let want: Vec<(String, Reason)> = want.into_iter().map(|(ip, r)| (ip.to_string(), r)).collect();
            assert_eq!(got, want, "{name}");
            for d in &outcome.departures {
                assert_eq!((d.frontend, d.backend.port), (fe, 53), "{name}");
                assert_eq!(d.service, Some(ObjectRef::new("default", "dns")), "{name}");
            }
            assert!(outcome.tc_departures.is_empty(), "{name}: no TC datapath here");
        }
    }
}
