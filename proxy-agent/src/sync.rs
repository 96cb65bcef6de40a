//! One pass of the data flow: model -> decisions -> desired state -> plan ->
//! maps. Shared by every way the agent learns about the cluster.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use crate::decision::{self, PortDecision};
use crate::decision_cache::{Changes, DecisionCache};
use crate::map_writer::{ApplyError, MapWriter};
use crate::model::{Cluster, Frontend, ObjectRef};
use crate::plan;

/// What one pass did.
#[derive(Debug, Default)]
pub struct SyncOutcome {
    pub upserts: usize,
    pub deletes: usize,
    /// Configuration problems found while deciding, each naming its Service.
    pub problems: Vec<String>,
    /// Frontends that could not be written (left as they were).
    pub failures: Vec<ApplyError>,
    /// Every decision of a full pass; empty for [`CachedSync`], whose
    /// decisions stay in its cache.
    pub decisions: Vec<PortDecision>,
    /// Services with at least one ClusterIP frontend in the maps, when the
    /// pass knows it without reading the whole state back.
    pub services_programmed: Option<usize>,
}

pub fn sync(writer: &mut MapWriter, cluster: &Cluster, node: &str) -> SyncOutcome {
    let decisions = decision::decide(cluster, node);
    let (desired, clashes) = decision::desired_state(&decisions);
    let plan = plan::diff(&writer.state(), &desired);
    let failures = writer.apply(&plan);
    let problems = decisions
        .iter()
        .flat_map(|d| d.problems.iter().map(move |p| format!("Service {}: {p}", d.service)))
        .chain(clashes)
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    SyncOutcome { upserts: plan.upserts.len(), deletes: plan.deletes.len(), problems, failures, decisions, services_programmed: None }
}

/// [`sync`] plus the external frontends (NodePort, LoadBalancer IPs,
/// externalIPs, issue #5): their socket entries join the ClusterIP state in
/// the same plan, and `external` writes the TC maps and health check ports.
/// Both come from the one `decision::decide` pass.
pub fn sync_with_external(
    writer: &mut MapWriter,
    external: &mut crate::nodeport::ExternalDatapath,
    cluster: &Cluster,
    node: &str,
) -> SyncOutcome {
    let decisions = decision::decide(cluster, node);
    let (mut desired, clashes) = decision::desired_state(&decisions);
    let ext = decision::external_state(&decisions, &external.node_addrs);
    for (fe, set) in &ext.socket {
        desired.entry(*fe).or_insert_with(|| set.clone());
    }
    let plan = plan::diff(&writer.state(), &desired);
    let mut failures = writer.apply(&plan);
    let (np, mut external_problems) = external.apply(&ext);
    failures.extend(np.failures);
    external_problems.extend(ext.problems.iter().cloned());
    let problems = decisions
        .iter()
        .flat_map(|d| d.problems.iter().map(move |p| format!("Service {}: {p}", d.service)))
        .chain(clashes)
        .chain(external_problems)
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    SyncOutcome {
        upserts: plan.upserts.len() + np.upserts,
        deletes: plan.deletes.len() + np.deletes,
        problems,
        failures,
        decisions,
        services_programmed: None,
    }
}

/// The passes of Kubernetes mode: the same data flow as
/// [`sync_with_external`], kept between syncs so that a pass costs in
/// proportion to what changed. Decisions come from the `DecisionCache`
/// (the same per-Service decision function); only the frontends whose
/// desired entry may have changed are compared with the maps and written,
/// except in a full pass (the first, and the periodic resync), which
/// compares everything, removes what nobody wants any more and retries
/// frontends that failed.
pub struct CachedSync {
    cache: DecisionCache,
    /// External frontends in the socket map (NodePorts from the node
    /// itself, external IPs) as last computed.
    external_socket: plan::State,
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
}

impl CachedSync {
    pub fn new(node: &str) -> CachedSync {
        CachedSync {
            cache: DecisionCache::new(node),
            external_socket: plan::State::new(),
            programmed: BTreeSet::new(),
            external_services: BTreeSet::new(),
            local_of: BTreeMap::new(),
            local_refs: BTreeMap::new(),
            retry: BTreeSet::new(),
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
        writer: &mut MapWriter,
        external: Option<&mut crate::nodeport::ExternalDatapath>,
        cluster: &Cluster,
        changes: &Changes,
        full: bool,
    ) -> SyncOutcome {
        let update = self.cache.update(cluster, changes);
        let mut touched = update.frontends;
        let retried = std::mem::take(&mut self.retry);
        touched.extend(retried.iter().copied());
        if changes.all {
            let all: Vec<ObjectRef> = self.cache.service_ids().chain(self.local_of.keys()).chain(self.external_services.iter()).cloned().collect();
            self.track_external(all);
        } else {
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
        for fe in ext_socket.keys().chain(self.external_socket.keys()) {
            if ext_socket.get(fe) != self.external_socket.get(fe) {
                touched.insert(*fe);
            }
        }
        self.external_socket = ext_socket;
        // ClusterIPs keep priority over external frontends.
        let want = |fe: &Frontend| self.cache.desired().get(fe).or_else(|| self.external_socket.get(fe));
        let plan = if full {
            plan::diff_layered(&writer.state(), self.cache.desired(), &self.external_socket)
        } else {
            let current: plan::State =
                touched.iter().filter_map(|fe| Some((*fe, writer.backends_of(fe)?.iter().copied().collect()))).collect();
            let desired: plan::State = touched.iter().filter_map(|fe| Some((*fe, want(fe)?.clone()))).collect();
            plan::diff(&current, &desired)
        };
        let mut failures = writer.apply(&plan);
        self.retry = failures.iter().map(|f| f.frontend).collect();

        let recheck: Vec<ObjectRef> =
            if full {
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
        SyncOutcome { upserts, deletes, problems, failures, decisions: Vec::new(), services_programmed: Some(self.programmed.len()) }
    }
}
