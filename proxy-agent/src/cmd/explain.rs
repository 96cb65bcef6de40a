//! `proxy-agent explain`: the decisions `run` would program, in words.
//! The manifests go through the same conversion, model and sync pass as
//! `run`'s (against in-memory maps), so the decisions and the warnings,
//! address clashes included, are the ones `run` would act on. Other Nodes
//! are scoped as `run`'s Node watch lists them (`sync::explain_input`):
//! labels the manifests carry and the watch would not are left out, with a
//! note.
//!
//! With `--live`, it also reads a running agent's pinned counting maps
//! (read-only, like `dump`) and shows next to each decision the
//! connections its frontends counted by topology tier since they were
//! first written (issue #34).

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use std::collections::BTreeMap;

use anyhow::Context;
use clap::{Args, ValueEnum};
use proxy_agent::DEFAULT_BPFFS;
use proxy_agent::datapath::{dump, maps};
use proxy_agent::decide::decision::{PortDecision, TierShare};
use proxy_agent::model::store::{Changes, Model};
use proxy_agent::model::{Backend, Frontend};
use proxy_agent::source::manifest_watch;
use proxy_agent::sync::explain_input;
use proxy_agent::sync::pass::{CachedSync, MemoryMaps};
use proxy_common::{SHARE_ONE, SvcConnValue, tier};
use serde_json::json;

#[derive(Clone, Copy, ValueEnum)]
enum Output {
    Table,
    Json,
}

#[derive(Args)]
pub(crate) struct ExplainArgs {
    /// The node whose point of view is explained.
    #[arg(long, env = "NODE_NAME")]
    node: String,
    /// Manifest files or directories with Nodes, Services and EndpointSlices.
    #[arg(long, num_args = 1.., required = true)]
    manifests: Vec<PathBuf>,
    #[arg(long, value_enum, default_value_t = Output::Table)]
    output: Output,
    /// Also show the connections each decision's frontends counted by
    /// topology tier, read from a running agent's pinned maps (`--bpffs`).
    #[arg(long)]
    live: bool,
    /// The pin directory of the agent `--live` reads.
    #[arg(long, default_value = DEFAULT_BPFFS)]
    bpffs: PathBuf,
}

/// The counted connections per frontend of both datapaths, and the
/// backends the socket datapath has programmed per ClusterIP frontend.
struct Live {
    socket: BTreeMap<Frontend, SvcConnValue>,
    tc: BTreeMap<Frontend, SvcConnValue>,
    programmed: BTreeMap<String, Vec<String>>,
}

impl Live {
    fn read(pin_dir: &std::path::Path) -> anyhow::Result<Live> {
        let ctx = || format!("reading the counting maps pinned in {}", pin_dir.display());
        let snap = dump::read(pin_dir).with_context(|| format!("reading the maps pinned in {}", pin_dir.display()))?;
        let programmed = dump::report(pin_dir, &snap)
            .services
            .into_iter()
            .map(|v| {
                let mut set: Vec<String> = v.slots.into_iter().filter_map(|s| s.backend).collect();
                set.sort();
                set.dedup();
                (v.frontend, set)
            })
            .collect();
        Ok(Live {
            socket: dump::frontend_conn_counts(pin_dir, &maps::SERVICES, &maps::SVC_CONN).with_context(ctx)?,
            tc: dump::frontend_conn_counts(pin_dir, &maps::NP_SERVICES, &maps::NP_SVC_CONN).with_context(ctx)?,
            programmed,
        })
    }

    /// What the running agent has programmed for `d`'s first ClusterIP
    /// frontend, when it differs from `d`'s decision (empty: no backend,
    /// or not programmed at all); `None` when they agree or `d` has no
    /// ClusterIP.
    fn differs(&self, d: &PortDecision) -> Option<&[String]> {
        let fe = d.frontends.first()?;
        let mut want: Vec<String> = d.internal_backends().iter().map(ToString::to_string).collect();
        want.sort();
        want.dedup();
        let programmed = self.programmed.get(&fe.to_string()).map_or(&[][..], Vec::as_slice);
        (programmed != want.as_slice()).then_some(programmed)
    }

    /// The counts of every frontend of `d`: its ClusterIPs, and its
    /// NodePort (on any node address, loopback included) and external IPs
    /// in both datapaths.
    fn of(&self, d: &PortDecision) -> SvcConnValue {
        let protocol = d.port.protocol;
        let external: Vec<Frontend> = d.external_frontends(&[]);
        let mine = |fe: &Frontend| {
            d.frontends.contains(fe) || external.contains(fe) || (fe.protocol == protocol && Some(fe.port) == d.port.node_port)
        };
        let values: Vec<SvcConnValue> = self.socket.iter().chain(&self.tc).filter(|(fe, _)| mine(fe)).map(|(_, v)| *v).collect();
        dump::sum_conn(values.iter())
    }
}

/// Why a running agent may hold a set other than the decision: a Service
/// whose topology reads labels of other Nodes keeps its last programmed
/// set (or none) while its Node watch lists them (`decide::label_wait`).
fn live_wait_label(programmed: &[String], needs: Option<&std::collections::BTreeSet<String>>) -> String {
    let set = join(programmed.iter().cloned());
    match needs {
        Some(labels) => format!(
            "{set}: the agent holds its last decision while its Node watch lists {} of other Nodes (up to --node-label-wait-secs; \
             topoproxy_node_label_waiting_services), or its cluster differs from these manifests",
            join(labels.iter().cloned())
        ),
        None => format!("{set}: the agent's cluster differs from these manifests (or it has not synced them yet)"),
    }
}

/// The tier every connection of the port counts in, for the reader.
fn counted_label(d: &PortDecision) -> String {
    match d.internal_tier() {
        Some(t) => format!("{} (the domain its topology chose)", tier::NAMES[usize::from(t)]),
        None => "each backend's own tier (no topology chose one)".into(),
    }
}

fn counts_label(v: &SvcConnValue) -> String {
    let tiers: Vec<String> = tier::NAMES.iter().zip(v.tiers).map(|(n, c)| format!("{n} {c}")).collect();
    format!("{}; blind remote {:.2}", tiers.join(", "), v.blind_remote_fp as f64 / f64::from(SHARE_ONE))
}

fn counts_json(v: &SvcConnValue) -> serde_json::Value {
    let mut o: serde_json::Map<String, serde_json::Value> =
        tier::NAMES.iter().zip(v.tiers).map(|(n, c)| ((*n).to_string(), json!(c))).collect();
    o.insert("blindRemote".into(), json!(v.blind_remote_fp as f64 / f64::from(SHARE_ONE)));
    serde_json::Value::Object(o)
}

pub(crate) fn explain(args: ExplainArgs) -> anyhow::Result<ExitCode> {
    let read = manifest_watch::read(&args.manifests);
    // Other Nodes as `run`'s Node watch would list them, not as the
    // manifests carry them (issue #47): the same decisions, and notes for
    // what was left out.
    let scoped = explain_input::scope_manifest_deltas(read.deltas.into_values(), &args.node);
    let mut model = Model::default();
    model.apply(scoped.deltas);
    let mut pass = CachedSync::new(&args.node);
    let mut maps = MemoryMaps::default();
    let outcome = pass.pass(&mut maps, None, &model.cluster, &Changes { all: true, ..Changes::default() }, true);
    let decisions: Vec<&PortDecision> = pass.decisions().collect();
    let live = if args.live { Some(Live::read(&args.bpffs)?) } else { None };
    let mut warnings: Vec<String> = read.errors.iter().map(ToString::to_string).collect();
    warnings.extend(model.problems().map(|p| p.error.to_string()));
    warnings.extend(outcome.problems);
    warnings.extend(outcome.failures.iter().map(|f| format!("not programmed: {f}")));
    warnings.dedup();
    let mut out = std::io::stdout().lock();
    match args.output {
        Output::Json => {
            let doc = json!({
                "node": args.node,
                "services": decisions.iter().map(|d| {
                    let mut v = to_json(d);
                    if let Some(o) = v.as_object_mut() {
                        o.insert("otherNodeLabels".into(), json!(pass.node_labels_of(&d.service)));
                        if let Some(live) = &live {
                            o.insert("connections".into(), counts_json(&live.of(d)));
                            // The programmed set when it is not the decision's
                            // (null: it is): the agent may be holding it.
                            let differs = live.differs(d).map(|p| {
                                json!({"programmed": p, "why": live_wait_label(p, pass.node_labels_of(&d.service))})
                            });
                            o.insert("liveDiffers".into(), json!(differs));
                        }
                    }
                    v
                }).collect::<Vec<_>>(),
                "warnings": warnings,
                "notes": scoped.notes,
            });
            writeln!(out, "{}", serde_json::to_string_pretty(&doc)?)?;
        }
        Output::Table => {
            writeln!(out, "node {}", args.node)?;
            for d in decisions {
                writeln!(out, "\n{} port {}", d.service, port_label(d))?;
                writeln!(out, "  frontends: {}", join(d.frontends.iter().map(|f| sockaddr(f.ip, f.port))))?;
                if d.port.node_port.is_some() || !d.external_ips.is_empty() {
                    let mut ext: Vec<String> = d.port.node_port.map(|p| format!("nodePort {p}")).into_iter().collect();
                    ext.extend(d.external_frontends(&[]).iter().map(|f| sockaddr(f.ip, f.port)));
                    let policy = if d.external_local { "Local" } else { "Cluster" };
                    writeln!(out, "  external:  {} (externalTrafficPolicy {policy})", ext.join(", "))?;
                }
                writeln!(out, "  model:     {}", d.model)?;
                writeln!(out, "  decision:  {}", d.decision)?;
                writeln!(out, "  cluster:   {}", used(d.uses_cluster_endpoints(), &d.cluster))?;
                writeln!(out, "  local:     {}", used(d.uses_local_endpoints(), &d.local))?;
                writeln!(out, "  affinity:  {}", affinity_label(d))?;
                writeln!(out, "  counts in: {}", counted_label(d))?;
                if let Some(labels) = pass.node_labels_of(&d.service) {
                    writeln!(
                        out,
                        "  reads:     other Nodes' {} (run waits for its Node watch to list them before programming)",
                        join(labels.iter().cloned())
                    )?;
                }
                if let Some(spill) = &d.spill {
                    writeln!(out, "  spill:     factor {}", spill.factor)?;
                    for t in &spill.tiers {
                        writeln!(out, "    {}", tier_share_label(t))?;
                    }
                }
                if let Some(live) = &live {
                    writeln!(out, "  counted:   {}", counts_label(&live.of(d)))?;
                    if let Some(programmed) = live.differs(d) {
                        writeln!(out, "  live:      {}", live_wait_label(programmed, pass.node_labels_of(&d.service)))?;
                    }
                }
                if let Some(ranges) = &d.source_ranges {
                    writeln!(out, "  sources:   {} ({})", ranges_label(ranges), filtered_label(d))?;
                }
            }
            for w in &warnings {
                writeln!(out, "\nwarning: {w}")?;
            }
            for n in &scoped.notes {
                writeln!(out, "\nnote: {n}")?;
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// One tier of a spilling port for the table: its health, the factor's
/// capacity and its share of new connections.
fn tier_share_label(t: &TierShare) -> String {
    let family = t.family.map_or(String::new(), |f| format!("{} ", f.as_str()));
    format!(
        "{family}{}: {}/{} ready (health {:.1}%), share {:.1}%",
        t.name,
        t.ready,
        t.total,
        100.0 * t.health(),
        f64::from(t.share_ppm) / 10_000.0
    )
}

/// The spill shares for JSON: null without `topoproxy.io/topology-spill`.
fn spill_json(d: &PortDecision) -> serde_json::Value {
    let Some(spill) = &d.spill else { return serde_json::Value::Null };
    json!({
        "factor": spill.factor,
        "tiers": spill.tiers.iter().map(|t| json!({
            "tier": t.name,
            "family": t.family.map(proxy_agent::model::Family::as_str),
            "ready": t.ready,
            "total": t.total,
            "health": t.health(),
            "share": f64::from(t.share_ppm) / 1_000_000.0,
        })).collect::<Vec<_>>(),
    })
}

fn sockaddr(ip: std::net::IpAddr, port: u16) -> String {
    std::net::SocketAddr::new(ip, port).to_string()
}

fn join(items: impl Iterator<Item = String>) -> String {
    let v: Vec<String> = items.collect();
    if v.is_empty() { "(none)".into() } else { v.join(", ") }
}

/// An endpoint set for the table: "(not used)" when no traffic of the port
/// uses it.
fn used(is_used: bool, set: &[Backend]) -> String {
    if is_used { join(set.iter().map(ToString::to_string)) } else { "(not used)".into() }
}

/// An endpoint set for JSON: null when no traffic of the port uses it.
fn used_json(is_used: bool, set: &[Backend]) -> Option<Vec<String>> {
    is_used.then(|| set.iter().map(ToString::to_string).collect())
}

/// `sessionAffinity` for the table: `None`, or `ClientIP` with its timeout.
fn affinity_label(d: &PortDecision) -> String {
    match d.affinity_timeout_s {
        Some(t) => format!("ClientIP, timeout {t}s (every frontend; clients kept per frontend)"),
        None => "None".into(),
    }
}

/// `loadBalancerSourceRanges` for the table; none valid means nobody from
/// outside gets in.
fn ranges_label(ranges: &[proxy_agent::model::Cidr]) -> String {
    if ranges.is_empty() { "no valid range: closed to every client".into() } else { join(ranges.iter().map(ToString::to_string)) }
}

/// Which frontends the source ranges filter.
fn filtered_label(d: &PortDecision) -> String {
    let filtered: Vec<String> = d.load_balancer_ips.iter().map(|ip| sockaddr(*ip, d.port.port)).collect();
    if filtered.is_empty() { "no LoadBalancer IP to filter".into() } else { format!("filters {}", filtered.join(", ")) }
}

fn port_label(d: &PortDecision) -> String {
    if d.port.name.is_empty() {
        format!("{}/{}", d.port.port, d.port.protocol)
    } else {
        format!("{} ({}/{})", d.port.name, d.port.port, d.port.protocol)
    }
}

/// The documented, stable JSON shape (README, "explain").
fn to_json(d: &PortDecision) -> serde_json::Value {
    json!({
        "namespace": &*d.service.namespace,
        "name": &*d.service.name,
        "port": {"name": d.port.name, "port": d.port.port, "protocol": d.port.protocol.as_str()},
        "frontends": d.frontends.iter().map(|f| sockaddr(f.ip, f.port)).collect::<Vec<_>>(),
        // External traffic. NodePorts are served on every node
        // address, which explain does not know: they are listed by port.
        "nodePort": d.port.node_port,
        "externalFrontends": d.external_frontends(&[]).iter().map(|f| sockaddr(f.ip, f.port)).collect::<Vec<_>>(),
        "externalTrafficPolicy": if d.external_local { "Local" } else { "Cluster" },
        "externalEndpoints": d.external_backends().iter().map(ToString::to_string).collect::<Vec<_>>(),
        "healthCheckNodePort": if d.external_local { d.health_check_node_port } else { None },
        "model": d.model,
        "decision": &*d.decision,
        // As kube-proxy's CategorizeEndpoints: null when no traffic of the
        // port uses the set (pkg/proxy/topology.go).
        "clusterEndpoints": used_json(d.uses_cluster_endpoints(), &d.cluster),
        "localEndpoints": used_json(d.uses_local_endpoints(), &d.local),
        "sessionAffinity": if d.affinity_timeout_s.is_some() { "ClientIP" } else { "None" },
        "sessionAffinityTimeoutSeconds": d.affinity_timeout_s,
        // null: no filter; []: no range parsed, nobody from outside gets in.
        "loadBalancerSourceRanges": d.source_ranges.as_ref().map(|r| r.iter().map(ToString::to_string).collect::<Vec<_>>()),
        "sourceRangeFrontends": d.source_ranges.as_ref().map(|_| d.load_balancer_ips.iter().map(|ip| sockaddr(*ip, d.port.port)).collect::<Vec<_>>()),
        // Issue #34: the tier every ClusterIP connection counts in (null:
        // each backend's own), and the blind-remote share per connection.
        "countedTier": d.internal_tier().map(|t| tier::NAMES[usize::from(t)]),
        "blindRemoteShare": f64::from(d.blind_remote_share) / f64::from(SHARE_ONE),
        // Issue #48: each tier's health and share of new connections with
        // topoproxy.io/topology-spill (null without).
        "spill": spill_json(d),
    })
}
