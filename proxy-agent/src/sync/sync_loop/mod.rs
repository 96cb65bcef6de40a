//! The level-triggered sync loop, the one both sources feed.
//!
//! Events only mark the state dirty (the source queues the converted
//! objects in `source::feed`); a sync applies the queue to the model
//! and lets `sync::pass::CachedSync` decide again the Services that changed, diff
//! their frontends against the pinned maps and write the difference. A
//! burst of events therefore costs one pass, and a duplicated event changes
//! nothing. The first sync and the periodic one (--sync-period) compare the
//! whole state with the maps, so nothing can stay wrong for longer
//! (kube-proxy's design: pkg/proxy/runner BoundedFrequencyRunner, with
//! partial syncs between full ones as its nftables proxier does).
//!
//! Nothing is written before every kind has been listed once. Until then
//! the maps keep what the previous agent left (adopted from the pins), so a
//! restart or an unreachable API server never empties the datapath.
//!
//! The external datapath (TC maps, health check node ports) is written in
//! the same pass, and the node's addresses are resolved again when the
//! address watcher says they changed, or on a full pass.
//!
//! The loop also tells the health server whether this node is going away
//! (its Node being deleted or tainted for removal, kube-proxy's `SyncNode`),
//! whenever Nodes reach the model.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::mpsc::UnboundedReceiver;
use tokio::sync::mpsc::error::TryRecvError;

use crate::datapath::map_writer::WriteError;
use crate::datapath::sock_destroy::{Batch, Terminator};
use crate::decide::cache::DecisionCache;
use crate::decide::departures::TcpTermination;
use crate::decide::label_wait::Listed;
use crate::decide::topology::tier::EndpointTiers;
use crate::external::nodeport::ExternalDatapath;
use crate::model::OtherNodes;
use crate::model::store::{Changes, Kind, Model, ObjectProblem};
use crate::observe::health_server::Health;
use crate::observe::metrics::{Metrics, SyncFigures, reason};
use crate::source::feed::{Signal, Stores};
use crate::sync::events::{self, EventReporter, ServiceProblem};
use crate::sync::pass::{CachedSync, SocketMaps};

/// What the sync loop is told at start-up.
#[derive(Clone, Debug)]
pub struct SyncConfig {
    /// This node's name (its Node object's and its endpoints' `nodeName`).
    pub node: String,
    /// Minimum time between two syncs (kube-proxy's --min-sync-period):
    /// changes arriving meanwhile are applied together.
    pub min_sync_interval: Duration,
    /// A sync runs at least this often even without changes: it retries
    /// frontends that failed (e.g. a full map) and refreshes the metrics
    /// (kube-proxy's --sync-period).
    pub sync_period: Duration,
    /// What becomes of TCP connections to departed backends
    /// (`--terminate-tcp`, `decide::departures`).
    pub terminate_tcp: TcpTermination,
    /// How long a Service waits for labels of other Nodes not listed yet
    /// (`--node-label-wait-secs`, `decide::label_wait`).
    pub node_label_wait: Duration,
}

/// Applies what the sources queue to the maps, at most once per `min_sync_interval`, and reports it
/// (metrics, health, Events).
pub struct SyncLoop<W: SocketMaps> {
    config: SyncConfig,
    writer: W,
    stores: Stores,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    events: Option<EventReporter>,
    /// The TC datapath, when external traffic is handled, and whether the
    /// node's addresses changed since it last resolved them.
    external: Option<ExternalDatapath>,
    addresses_changed: Arc<AtomicBool>,
    /// Terminates the sockets (and flushes the TC flows) of backends that
    /// left their frontends, after the maps no longer hold them.
    terminator: Option<Terminator>,
    /// The cluster as converted from watch events, and the decisions kept
    /// between syncs.
    model: Model,
    cached: CachedSync,
    listed: BTreeSet<Kind>,
    /// Changes seen since the last sync, with their trigger times.
    pending: Vec<(Kind, SystemTime, bool)>,
    dirty: bool,
    last_sync: Option<Instant>,
    /// A pass owed at this moment even if nothing changes: the departure
    /// rules wait for a backend's absence from every slice to settle.
    recheck_at: Option<Instant>,
    /// What the model took in while kinds were still listing, after every
    /// Service was decided ahead of the first sync (`with_first_list`):
    /// that sync decides it again.
    listed_changes: Changes,
    /// Problems already logged, so a bad object is logged (and counted)
    /// when it appears, not on every sync.
    logged: BTreeSet<String>,
    /// Whether the last attempt of each kind failed, to log recoveries.
    failing: BTreeMap<Kind, bool>,
    /// Whether this node's Node object has been seen: once it has, its
    /// disappearance means the node was deleted.
    node_seen: bool,
    /// Where the labels of other Nodes that Services' topology needs are
    /// published for the source (`kube_watch`), which watches other Nodes
    /// metadata-only only while the set is not empty. `None` inside means
    /// not known yet (before Services and EndpointSlices are listed).
    node_labels: Option<tokio::sync::watch::Sender<Option<OtherNodes>>>,
}

impl<W: SocketMaps> SyncLoop<W> {
    /// A loop over the queue `stores`, writing through `writer`.
    pub fn new(
        config: SyncConfig,
        writer: W,
        stores: Stores,
        metrics: Arc<Metrics>,
        health: Arc<Health>,
        events: Option<EventReporter>,
    ) -> Self {
        health.waiting_for("Services, EndpointSlices and Nodes to be listed");
        let cached = CachedSync::new(&config.node).with_tcp_termination(config.terminate_tcp).with_label_wait(config.node_label_wait);
        SyncLoop {
            config,
            writer,
            stores,
            metrics,
            health,
            events,
            external: None,
            addresses_changed: Arc::new(AtomicBool::new(false)),
            terminator: None,
            model: Model::default(),
            cached,
            listed: BTreeSet::new(),
            pending: Vec::new(),
            dirty: false,
            last_sync: None,
            recheck_at: None,
            listed_changes: Changes::default(),
            logged: BTreeSet::new(),
            failing: BTreeMap::new(),
            node_seen: false,
            node_labels: None,
        }
    }

    /// Publishes on `tx` what the source must watch of other Nodes
    /// (`decide::topology::other_nodes_needed`): first once Services and
    /// EndpointSlices are listed, before the first sync, then after every
    /// pass that changes it.
    pub fn with_node_label_needs(mut self, tx: tokio::sync::watch::Sender<Option<OtherNodes>>) -> Self {
        self.node_labels = Some(tx);
        // Nothing of other Nodes is listed until the source says so
        // (`Signal::NodeLabelsListed`): a Service that needs their labels
        // waits for them (`decide::label_wait`).
        self.cached.set_listed(Listed::Only(OtherNodes { labels: BTreeSet::new(), names: Some(BTreeSet::new()) }));
        self
    }

    fn publish_node_labels(&self, needed: OtherNodes) {
        let Some(tx) = &self.node_labels else { return };
        tx.send_if_modified(|current| {
            if current.as_ref() == Some(&needed) {
                return false;
            }
            if needed.labels.is_empty() {
                tracing::info!("no Service's topology needs other Nodes' labels");
            } else {
                let keys: Vec<&str> = needed.labels.iter().map(String::as_str).collect();
                let nodes = needed
                    .names
                    .as_ref()
                    .map_or_else(|| "every Node".to_string(), |n| format!("{} Nodes hosting their endpoints", n.len()));
                tracing::info!(labels = %keys.join(","), nodes = %nodes, "Services' topology needs these labels of other Nodes");
            }
            *current = Some(needed);
            true
        });
    }

    /// Writes the external datapath in every pass too; `addresses_changed`
    /// is raised by whoever watches the node's addresses.
    pub fn with_external(mut self, external: ExternalDatapath, addresses_changed: Arc<AtomicBool>) -> Self {
        external.report_agent_health(self.health.clone());
        self.external = Some(external);
        self.addresses_changed = addresses_changed;
        self
    }

    /// Hands the backends that leave their frontends in each pass to
    /// `terminator`, once per pass.
    pub fn with_termination(mut self, terminator: Terminator) -> Self {
        self.terminator = Some(terminator);
        self
    }

    /// Runs until `shutdown` completes or the watchers are gone.
    pub async fn run(mut self, mut signals: UnboundedReceiver<Signal>, shutdown: impl Future<Output = ()>) {
        tokio::pin!(shutdown);
        loop {
            let due = self.next_sync_at();
            tokio::select! {
                () = &mut shutdown => return,
                s = signals.recv() => match s {
                    Some(s) => self.handle(s),
                    None => return,
                },
                () = sleep_until(due), if due.is_some() => {
                    // A departure recheck that is due is a pass of changes
                    // (none, or what queued meanwhile), not a full one.
                    if self.recheck_at.is_some_and(|at| at <= Instant::now()) {
                        self.recheck_at = None;
                        self.dirty = true;
                    }
                    // Take everything that queued up meanwhile into this
                    // sync: that is the coalescing.
                    loop {
                        match signals.try_recv() {
                            Ok(s) => self.handle(s),
                            Err(TryRecvError::Empty) => break,
                            Err(TryRecvError::Disconnected) => return,
                        }
                    }
                    if self.all_listed() {
                        self.sync_now();
                    }
                }
            }
        }
    }

    fn all_listed(&self) -> bool {
        Kind::ALL.iter().all(|k| self.listed.contains(k))
    }

    fn next_sync_at(&self) -> Option<Instant> {
        if !self.all_listed() {
            return None;
        }
        Some(match self.last_sync {
            None => Instant::now(),
            Some(last) if self.dirty => last + self.config.min_sync_interval,
            Some(last) => {
                let periodic = last + self.config.sync_period;
                self.recheck_at.map_or(periodic, |at| at.min(periodic))
            }
        })
    }

    fn handle(&mut self, s: Signal) {
        match s {
            Signal::Changed { kind, trigger, stamped } => {
                self.metrics.watch_event(kind.as_str());
                self.recovered(kind);
                self.pending.push((kind, trigger, stamped));
                self.dirty = true;
                self.mark_pending();
            }
            Signal::Listed { kind } => {
                self.recovered(kind);
                if self.listed.insert(kind) {
                    tracing::info!(kind = kind.as_str(), objects = self.stores.len(kind), "listed");
                    let missing: Vec<&str> = Kind::ALL.iter().filter(|k| !self.listed.contains(k)).map(|k| k.as_str()).collect();
                    if !missing.is_empty() {
                        self.health.waiting_for(format!("{} to be listed", missing.join(", ")));
                    }
                } else {
                    tracing::info!(kind = kind.as_str(), objects = self.stores.len(kind), "relisted");
                }
                // Before the first sync, a listed kind goes into the model
                // while the others are still listing, instead of on the
                // first sync's critical path (the cold sync). The
                // changes it reports are not needed, as the first sync
                // decides every Service, unless that was done ahead
                // (`with_first_list`): then they wait for it.
                if !self.all_listed() && !self.health.is_ready() {
                    let changes = self.apply_queued();
                    if self.cached.decided_ahead() {
                        self.listed_changes.absorb(changes);
                    }
                    // The source holds the Nodes' listing back until it
                    // knows whether other Nodes are needed, and lists
                    // them first if they are: the first sync then decides
                    // with every label it needs.
                    // (Only when someone follows it: manifests hold whole
                    // Nodes, and this walks every Service.)
                    if self.node_labels.is_some() && self.listed.contains(&Kind::Service) && self.listed.contains(&Kind::EndpointSlice) {
                        self.publish_node_labels(crate::decide::topology::node_labels_needed(&self.model.cluster, &self.config.node));
                    }
                }
                self.dirty = true;
                self.mark_pending();
            }
            Signal::NodeLabelsListed { listed } => {
                tracing::debug!(labels = ?listed.labels, nodes = ?listed.names.as_ref().map(BTreeSet::len), "other Nodes listed");
                self.cached.set_listed(Listed::Only(listed));
                self.dirty = true;
                self.mark_pending();
            }
            Signal::Resync { reason } => {
                tracing::info!(reason, "sync requested");
                self.dirty = true;
                self.mark_pending();
            }
            Signal::Failed { kind, expired, message } => {
                if expired {
                    // Normal after compaction or an API server restart: the
                    // maps stay as they are while the relist runs.
                    self.metrics.error(reason::WATCH_EXPIRED);
                    tracing::info!(kind = kind.as_str(), "watch expired, relisting without touching the maps: {message}");
                } else {
                    self.metrics.error(reason::WATCH);
                    let first = !self.failing.insert(kind, true).unwrap_or(false);
                    if first {
                        tracing::warn!(
                            kind = kind.as_str(),
                            "API server list/watch failed; keeping the datapath as it is and retrying with backoff: {message}"
                        );
                    } else {
                        tracing::debug!(kind = kind.as_str(), "API server list/watch still failing: {message}");
                    }
                }
            }
        }
    }

    /// Tells /healthz that a change waits for a sync. Only once every kind
    /// is listed: before that nothing can be synced, which /readyz reports,
    /// and an API server that is slow to answer is no reason to restart
    /// the agent.
    fn mark_pending(&self) {
        if self.all_listed() {
            self.health.pending();
        }
    }

    /// Applies what the sources queued to the model, counts the Services
    /// and EndpointSlices that changed (kube-proxy's change counters; a
    /// manifest relist or a duplicated event that changes nothing counts
    /// nothing) and follows this node's Node.
    fn apply_queued(&mut self) -> Changes {
        let changes = apply_drained(&mut self.model, &self.stores, self.events.is_some());
        self.metrics.object_changes(changes.services.len(), changes.slices.len());
        self.follow_this_node();
        changes
    }

    /// Starts from the model `first` made, as if the loop had applied it.
    pub fn with_first_list(mut self, first: FirstList) -> Self {
        self.model = first.model;
        if let Some((decided, tiers)) = first.decided.filter(|(d, _)| d.node() == self.config.node) {
            self.cached.use_decided(decided, tiers);
        }
        self.metrics.object_changes(first.services, first.slices);
        self.follow_this_node();
        self
    }

    /// Tells the health server whether this node is going away. A Node not
    /// seen yet (not listed yet, or manifests without it) leaves the node
    /// eligible, as kube-proxy's health server starts; one that was seen and
    /// is gone was deleted.
    fn follow_this_node(&mut self) {
        let leaving = match self.model.cluster.nodes.get(&self.config.node) {
            Some(n) => {
                self.node_seen = true;
                n.leaving
            }
            None if self.node_seen => Some("its Node was deleted"),
            None => None,
        };
        if !self.health.set_node_leaving(leaving) {
            return;
        }
        if let Some(why) = leaving {
            tracing::info!(
                node = %self.config.node,
                "this node is going away ({why}): /healthz and the health check node ports fail so that load balancers drain it"
            );
        } else {
            tracing::info!(node = %self.config.node, "this node is no longer going away: /healthz passes again");
        }
    }

    fn recovered(&mut self, kind: Kind) {
        if self.failing.insert(kind, false) == Some(true) {
            tracing::info!(kind = kind.as_str(), "API server reachable again");
        }
    }

    fn sync_now(&mut self) {
        let started = Instant::now();
        let first = !self.health.is_ready();
        let mut changes = std::mem::take(&mut self.listed_changes);
        changes.absorb(self.apply_queued());
        // The first pass decides everything (unless that was done ahead,
        // `with_first_list`: then it takes what changed since); a pass
        // without pending changes is the periodic resync (--sync-period),
        // which compares the whole state with the maps and retries
        // frontends that failed.
        changes.all |= first && !self.cached.decided_ahead();
        let full = first || !self.dirty;
        if let Some(external) = &mut self.external {
            // Full passes (the first, then every sync period) re-resolve
            // as well, like they re-compare every map entry.
            // A change of devices (`--devices auto`) attaches or detaches
            // the programs, so `topoproxy_xdp_device` follows.
            if (self.addresses_changed.swap(false, Ordering::AcqRel) || full) && external.refresh() {
                self.metrics.set_xdp_devices(&external.devices, &external.xdp_devices());
            }
        }
        let mut outcome = self.cached.pass(&mut self.writer, self.external.as_mut(), &self.model.cluster, &changes, full);
        let took = started.elapsed();
        // Network programming latency, as kube-proxy measures it
        // (pkg/proxy/metrics NetworkProgrammingLatency): from the
        // EndpointSlice controller's trigger time of each change the pass
        // took to the moment its maps are written, which is now; changes
        // without that stamp (deletions, manifests) are not counted.
        for (kind, trigger, stamped) in self.pending.drain(..) {
            self.metrics.programmed(kind.as_str(), trigger);
            if kind == Kind::EndpointSlice && stamped {
                self.metrics.endpoints_programmed(trigger);
            }
        }
        if self.node_labels.is_some() {
            self.publish_node_labels(self.cached.other_nodes_needed(&self.model.cluster));
        }
        self.report_label_waits(&outcome);
        if let Some(t) = &self.terminator {
            t.submit(Batch { sockets: std::mem::take(&mut outcome.departures), conntrack: std::mem::take(&mut outcome.tc_departures) });
        }

        // Bad objects and configuration problems: log and count each when it
        // first appears; the Event reporter posts each once.
        let mut current_logs = BTreeSet::new();
        let mut problems: Vec<ServiceProblem> = Vec::new();
        for p in self.model.problems() {
            let line = p.error.to_string();
            if !self.logged.contains(&line) {
                tracing::warn!(kind = %p.error.kind, object = %p.error.object, "object skipped: {}", p.error.reason);
                self.metrics.error(object_reason(p));
            }
            current_logs.insert(line);
            if let Some(svc) = &p.service
                && let Some(uid) = self.model.service_uids.get(svc)
            {
                problems.push(ServiceProblem {
                    service: svc.clone(),
                    uid: Some(uid.clone()),
                    reason: match p.kind {
                        Kind::EndpointSlice => events::REASON_INVALID_ENDPOINT_SLICE,
                        _ => events::REASON_INVALID_SERVICE,
                    },
                    message: match p.kind {
                        Kind::EndpointSlice => format!("EndpointSlice {}: {}", p.error.object, p.error.reason),
                        _ => p.error.reason.clone(),
                    },
                });
            }
        }
        // A Service that waited past `--node-label-wait-secs` for labels of
        // other Nodes: an Event while it still lacks them.
        for (id, w) in self.cached.waiting().iter().filter(|(_, w)| w.gave_up) {
            problems.push(ServiceProblem {
                service: id.clone(),
                uid: self.model.service_uids.get(id).cloned(),
                reason: events::REASON_NODE_LABELS_NOT_LISTED,
                message: label_wait_note(&w.missing, self.config.node_label_wait),
            });
        }
        for d in self.cached.decisions_with_problems() {
            for problem in &d.problems {
                let line = format!("Service {}: {problem}", d.service);
                if !self.logged.contains(&line) && !current_logs.contains(&line) {
                    tracing::warn!(service = %d.service, "{problem}");
                    self.metrics.error(reason::INVALID_TOPOLOGY);
                }
                current_logs.insert(line);
                problems.push(ServiceProblem {
                    service: d.service.clone(),
                    uid: self.model.service_uids.get(&d.service).cloned(),
                    reason: events::topology_reason(problem),
                    message: problem.clone(),
                });
            }
        }
        // Problems of the pass itself that no decision carries (e.g. address
        // clashes, external datapath): logged when they appear.
        for problem in &outcome.problems {
            if !current_logs.contains(problem) {
                if !self.logged.contains(problem) {
                    tracing::warn!("{problem}");
                }
                current_logs.insert(problem.clone());
            }
        }
        self.logged = current_logs;
        problems.sort();
        problems.dedup();
        if let Some(e) = &self.events {
            e.publish(problems);
        }

        for f in &outcome.failures {
            tracing::error!(frontend = %f.frontend, "not programmed, left as it was: {}", f.error);
        }
        let occupancy = self.writer.occupancy();
        let map_full = outcome.failures.iter().filter(|f| matches!(f.error, WriteError::Full { .. })).count();
        self.metrics.record_sync(&SyncFigures {
            took,
            frontends: self.writer.frontends(),
            endpoints: self.writer.endpoints(),
            services: outcome.services_programmed,
            occupancy: &occupancy,
            map_full,
            write_failed: outcome.failures.len() - map_full,
            no_local_internal: outcome.no_local_internal,
            no_local_external: outcome.no_local_external,
        });
        let maglev = [
            (crate::datapath::maps::Datapath::Socket, self.writer.maglev_usage(), self.writer.maglev_refused()),
            (
                crate::datapath::maps::Datapath::Tc,
                self.external.as_ref().and_then(ExternalDatapath::maglev_usage),
                self.external.as_ref().map_or(0, ExternalDatapath::maglev_refused),
            ),
        ];
        for (datapath, usage, refused) in maglev {
            if let Some((_, tables, bytes)) = usage {
                self.metrics.set_maglev_tables(datapath.label(), tables, bytes, refused);
            }
        }
        for kind in Kind::ALL {
            self.metrics.set_objects(kind.as_str(), self.stores.len(kind));
        }
        self.metrics.set_tier_shares(self.cached.decisions_with_spill().flat_map(|d| {
            let port = d.port_label();
            d.spill.iter().flat_map(|s| s.tiers.iter()).map(move |t| crate::observe::metrics::TierShareSeries {
                port: port.clone(),
                // One family only: the label stays empty (absent).
                family: t.family.map_or("", crate::model::Family::as_str),
                tier: t.name.clone(),
                share_ppm: t.share_ppm,
            })
        }));
        self.health.synced();
        self.dirty = false;
        self.last_sync = Some(Instant::now());
        self.recheck_at = outcome.recheck_at;
        let changed = outcome.upserts + outcome.deletes > 0;
        if first || changed || !outcome.failures.is_empty() {
            tracing::info!(
                services = self.model.cluster.services.len(),
                slices = self.model.cluster.slices.len(),
                nodes = self.model.cluster.nodes.len(),
                frontends = self.writer.frontends(),
                external_frontends = self.external.as_ref().map_or(0, ExternalDatapath::tc_frontends),
                upserts = outcome.upserts,
                deletes = outcome.deletes,
                failed = outcome.failures.len(),
                took_ms = took.as_millis() as u64,
                "synced"
            );
        }
        if first {
            tracing::info!("first sync applied; ready");
        }
    }
}

/// The Event note and log line of a Service that waited past the limit.
fn label_wait_note(missing: &crate::decide::label_wait::Missing, limit: Duration) -> String {
    format!(
        "topology programmed without labels it reads: {missing} after {}s (--node-label-wait-secs); endpoints on those Nodes \
         rank as if they had no such label until the Node watch lists them",
        limit.as_secs()
    )
}

impl<W: SocketMaps> SyncLoop<W> {
    /// Logs and counts the Services that started or stopped waiting for
    /// labels of other Nodes in this pass, and those that waited too long.
    fn report_label_waits(&self, outcome: &crate::sync::pass::SyncOutcome) {
        for (id, missing) in &outcome.held {
            tracing::info!(service = %id, "holding the Service as programmed: its topology reads {missing}");
        }
        for (id, waited) in &outcome.released {
            tracing::info!(service = %id, waited_ms = waited.as_millis() as u64, "the labels it waited for are listed: programmed");
        }
        for (id, missing) in &outcome.gave_up {
            tracing::warn!(service = %id, "{}", label_wait_note(missing, self.config.node_label_wait));
            self.metrics.node_label_wait_timeout();
        }
        let held = self.cached.waiting().values().filter(|w| !w.gave_up).count();
        self.metrics.set_node_label_waiting(held);
    }
}

/// What the source queued before the loop runs (the first list), applied
/// to a model of its own: `run` has it made while the datapath installs,
/// on the other core, rather than by the loop's first step after it.
pub struct FirstList {
    model: Model,
    /// Services and EndpointSlices it changed, for the change counters.
    services: usize,
    slices: usize,
    /// Every Service decided for `node` (`DecisionCache::prepare`), and the
    /// endpoints' tiers: the first pass takes them rather than working
    /// them out after the install.
    decided: Option<(DecisionCache, EndpointTiers)>,
}

/// Applies what `stores` holds to an empty model, and decides every
/// Service for `node`. `keep_uids` as for the loop: whether Events are
/// posted.
pub fn apply_first_list(stores: &Stores, keep_uids: bool, node: &str) -> FirstList {
    let mut model = Model::default();
    let changes = apply_drained(&mut model, stores, keep_uids);
    let mut decided = DecisionCache::new(node);
    decided.prepare(&model.cluster);
    let mut tiers = EndpointTiers::new(node);
    tiers.update(&model.cluster, true, std::iter::empty());
    FirstList { model, services: changes.services.len(), slices: changes.slices.len(), decided: Some((decided, tiers)) }
}

/// Applies the deltas queued in `stores` to `model`.
fn apply_drained(model: &mut Model, stores: &Stores, keep_uids: bool) -> Changes {
    let mut deltas = stores.drain();
    if !keep_uids {
        // Services' uids serve only Events (manifest mode posts none):
        // not kept, 10 MiB at 100k Services.
        for d in &mut deltas {
            d.uid = None;
        }
    }
    model.apply(deltas)
}

fn object_reason(p: &ObjectProblem) -> &'static str {
    match p.kind {
        Kind::Service => reason::INVALID_SERVICE,
        Kind::EndpointSlice => reason::INVALID_ENDPOINT_SLICE,
        Kind::Node => reason::INVALID_NODE,
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(t) => tokio::time::sleep_until(t.into()).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests;
