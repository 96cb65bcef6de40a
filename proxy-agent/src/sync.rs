//! One pass of the data flow: model -> decisions -> desired state -> plan ->
//! maps. Shared by every way the agent learns about the cluster.

use crate::decision::{self, PortDecision};
use crate::map_writer::{ApplyError, MapWriter};
use crate::model::Cluster;
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
    pub decisions: Vec<PortDecision>,
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
    SyncOutcome { upserts: plan.upserts.len(), deletes: plan.deletes.len(), problems, failures, decisions }
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
    }
}
