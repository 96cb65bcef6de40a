//! `proxy-agent dump`: what the pinned maps hold, decoded (frontend ->
//! slots -> backends, for the socket maps and the TC `NP_*` maps, plus the
//! TC conntrack table), the datapaths' counters, and every inconsistency
//! found. Reads the maps read-only, so it is safe beside a running agent.
//!
//! Exit status: 0 when consistent, 2 when there are findings, 1 when the
//! maps cannot be read.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, ValueEnum};
use proxy_agent::DEFAULT_BPFFS;
use proxy_agent::datapath::dump::{self, AffinityView, BackendView, NodePortReport, Report, ServiceView, SlotView};
use proxy_agent::datapath::kernel_features::KernelFeatures;

#[derive(Clone, Copy, ValueEnum)]
enum Output {
    Table,
    Json,
}

#[derive(Args)]
pub(crate) struct DumpArgs {
    /// The pin directory the agent was run with.
    #[arg(long, default_value = DEFAULT_BPFFS)]
    bpffs: PathBuf,
    #[arg(long, value_enum, default_value_t = Output::Table)]
    output: Output,
}

/// Exit status when the maps were read but are inconsistent.
const INCONSISTENT: u8 = 2;

pub(crate) fn dump(args: DumpArgs) -> anyhow::Result<ExitCode> {
    let snap = dump::read(&args.bpffs).with_context(|| format!("reading the maps pinned in {}", args.bpffs.display()))?;
    let report = dump::report(&args.bpffs, &snap);
    // What this kernel offers, as the agent's start-up probe sees it: the
    // program variants it loads and every fallback.
    let kernel = KernelFeatures::get();
    let mut out = std::io::stdout().lock();
    match args.output {
        Output::Json => {
            let mut value = serde_json::to_value(&report)?;
            if let Some(o) = value.as_object_mut() {
                let features: serde_json::Map<String, serde_json::Value> =
                    kernel.features.iter().map(|f| (f.name.to_string(), serde_json::Value::Bool(f.present))).collect();
                o.insert(
                    "kernel".into(),
                    serde_json::json!({
                        "release": kernel.release,
                        "socketPrograms": kernel.socket_variant().label(),
                        "tcPrograms": kernel.tc_variant().label(),
                        "features": features,
                    }),
                );
            }
            writeln!(out, "{}", serde_json::to_string_pretty(&value)?)?;
        }
        Output::Table => {
            writeln!(out, "kernel: {}", kernel.summary())?;
            table(&mut out, &report)?;
        }
    }
    out.flush()?;
    Ok(if report.consistent { ExitCode::SUCCESS } else { ExitCode::from(INCONSISTENT) })
}

fn table(out: &mut impl Write, r: &Report) -> std::io::Result<()> {
    writeln!(out, "pins: {}", r.pin_dir)?;
    let usage: Vec<String> = r.maps.iter().map(|m| format!("{} {}/{}", m.name, m.entries, m.max_entries)).collect();
    writeln!(out, "maps: {}", usage.join("  "))?;
    writeln!(out)?;
    if r.services.is_empty() {
        writeln!(out, "no services")?;
    }
    for s in &r.services {
        let note = if s.backend_count == 0 { " (connections refused)" } else { "" };
        writeln!(
            out,
            "{}  id {} gen {}  {} backend{}{note}{}",
            s.frontend,
            s.service_id,
            s.generation,
            s.backend_count,
            if s.backend_count == 1 { "" } else { "s" },
            policy_note(s)
        )?;
        slot_lines(out, "  ", &s.slots)?;
    }
    writeln!(out)?;
    writeln!(out, "backends: {}", r.backends.len())?;
    backend_lines(out, "  ", &r.backends)?;
    affinity_lines(out, "", &r.affinity)?;
    socket_lines(out, &r.sockets)?;
    writeln!(out)?;
    let counters: Vec<String> = r.counters.iter().filter(|(k, _)| !k.starts_with("ended_")).map(|(k, v)| format!("{k}={v}")).collect();
    writeln!(out, "counters: {}", counters.join(" "))?;
    // The agent's terminations of sockets whose backend left, by the rule
    // that ended them (it adds them to COUNTERS for this view).
    let ended: Vec<String> = r.counters.iter().filter_map(|(k, v)| Some(format!("{}={v}", k.strip_prefix("ended_")?))).collect();
    if !ended.is_empty() {
        writeln!(out, "sockets ended by rule: {}", ended.join(" "))?;
    }
    if let Some(n) = r.socket_port_bits {
        writeln!(out, "port bitmap (SOCK_PORTS): {n} ports")?;
    }
    if let Some(np) = &r.nodeport {
        writeln!(out)?;
        nodeport_table(out, np)?;
    }
    writeln!(out)?;
    if r.findings.is_empty() {
        writeln!(out, "consistent: no findings")?;
    } else {
        writeln!(out, "findings: {}", r.findings.len())?;
        for f in &r.findings {
            let severity = match f.severity {
                dump::Severity::Error => "error",
                dump::Severity::Warning => "warning",
            };
            writeln!(out, "  {severity}: {}", f.message)?;
        }
    }
    Ok(())
}

/// One line per slot of a frontend (socket and TC maps alike).
fn slot_lines(out: &mut impl Write, indent: &str, slots: &[SlotView]) -> std::io::Result<()> {
    for slot in slots {
        match (slot.backend_id, &slot.backend) {
            (Some(id), Some(addr)) => writeln!(out, "{indent}[{}] #{id} {addr}", slot.slot)?,
            (Some(id), None) => writeln!(out, "{indent}[{}] #{id} (no such backend)", slot.slot)?,
            (None, _) => writeln!(out, "{indent}[{}] (missing slot)", slot.slot)?,
        }
    }
    Ok(())
}

/// Translated sockets by the record their connect() took, one per line.
fn socket_lines(out: &mut impl Write, s: &proxy_agent::datapath::dump::SocketsView) -> std::io::Result<()> {
    writeln!(
        out,
        "sockets: {} recorded in SOCK_REC, {} connects recorded in socket storage (SOCK_REC full)",
        s.records.len(),
        s.socket_storage_fallbacks
    )?;
    // A busy node has thousands: the table shows the first few, JSON all.
    const SHOWN: usize = 20;
    for r in s.records.iter().take(SHOWN) {
        writeln!(out, "  cookie {}  {} {} -> {}  service {}  path {}", r.cookie, r.protocol, r.frontend, r.backend, r.service_id, r.path)?;
    }
    if s.records.len() > SHOWN {
        writeln!(out, "  ... {} more (--output json lists them all)", s.records.len() - SHOWN)?;
    }
    Ok(())
}

/// Session affinity and source ranges of a frontend, for its line.
fn policy_note(s: &ServiceView) -> String {
    let mut note = String::new();
    if let Some(t) = s.affinity_timeout_seconds {
        note.push_str(&format!("  affinity ClientIP {t}s"));
        if let Some(scope) = s.affinity_scope {
            note.push_str(&format!(" scope {scope}"));
        }
    }
    if let Some(r) = &s.source_ranges {
        let ranges = if r.is_empty() { "none (closed)".to_string() } else { r.join(",") };
        note.push_str(&format!("  source ranges {ranges}{}", if s.source_ranges_node { " +node" } else { "" }));
    }
    if !s.slot_groups.is_empty() {
        let groups: Vec<String> = s.slot_groups.iter().map(|g| format!("{}..{} weight {}", g.first_slot, g.slot_end, g.weight)).collect();
        note.push_str(&format!("  weighted slots {}", groups.join(", ")));
    }
    note
}

/// Clients' affinity entries listed one by one in the table; JSON lists
/// them all.
const AFFINITY_LISTED: usize = 200;

/// The clients' affinity entries, when there are any.
fn affinity_lines(out: &mut impl Write, indent: &str, entries: &[AffinityView]) -> std::io::Result<()> {
    if entries.is_empty() {
        return Ok(());
    }
    writeln!(out, "{indent}affinity: {} client{}", entries.len(), if entries.len() == 1 { "" } else { "s" })?;
    for a in entries.iter().take(AFFINITY_LISTED) {
        let backend = a.backend.as_deref().unwrap_or("(no such backend)");
        let idle = a.idle_ms.map_or_else(String::new, |ms| format!("  idle {}.{:03}s", ms / 1000, ms % 1000));
        let state = if a.honoured { "" } else { "  (not honoured: expired or backend no longer used)" };
        writeln!(out, "{indent}  scope {} ({})  {}  =>  #{} {backend}{idle}{state}", a.scope, a.frontend, a.client, a.backend_id)?;
    }
    if entries.len() > AFFINITY_LISTED {
        writeln!(out, "{indent}  ... {} more (--output json lists all)", entries.len() - AFFINITY_LISTED)?;
    }
    Ok(())
}

/// One line per backend with the number of slots that use it.
fn backend_lines(out: &mut impl Write, indent: &str, backends: &[BackendView]) -> std::io::Result<()> {
    for b in backends {
        let addr = b.address.as_deref().unwrap_or("(undecodable)");
        writeln!(out, "{indent}#{} {addr}  used by {} slot{}", b.backend_id, b.slots, if b.slots == 1 { "" } else { "s" })?;
    }
    Ok(())
}

/// Conntrack entries listed one by one in the table; JSON lists them all.
const CONNTRACK_LISTED: usize = 200;

fn nodeport_table(out: &mut impl Write, np: &NodePortReport) -> std::io::Result<()> {
    writeln!(out, "external traffic (TC, NP_* maps):")?;
    match &np.config {
        Some(c) => writeln!(
            out,
            "  SNAT: {} / {}  ports {}-{}",
            c.snat_v4.as_deref().unwrap_or("(no IPv4)"),
            c.snat_v6.as_deref().unwrap_or("(no IPv6)"),
            c.snat_port_min,
            c.snat_port_max
        )?,
        None => writeln!(out, "  SNAT: (no configuration)")?,
    }
    if np.services.is_empty() {
        writeln!(out, "  no frontends")?;
    }
    for s in &np.services {
        let note =
            if s.backend_count == 0 { if s.external_traffic_policy == Some("Local") { " (dropped)" } else { " (rejected)" } } else { "" };
        writeln!(
            out,
            "  {}  id {} gen {}  {} backend{}  policy {}{note}{}",
            s.frontend,
            s.service_id,
            s.generation,
            s.backend_count,
            if s.backend_count == 1 { "" } else { "s" },
            s.external_traffic_policy.unwrap_or("Cluster"),
            policy_note(s),
        )?;
        slot_lines(out, "    ", &s.slots)?;
    }
    writeln!(out, "  backends: {}", np.backends.len())?;
    backend_lines(out, "    ", &np.backends)?;
    writeln!(out, "  local endpoints: {}", if np.local_endpoints.is_empty() { "none".to_string() } else { np.local_endpoints.join(" ") })?;
    if let Some(p) = &np.port_bits {
        writeln!(out, "  port bitmap (NP_PORTS): {} ingress, {} egress ports", p.ingress_ports, p.egress_ports)?;
    }
    affinity_lines(out, "  ", &np.affinity)?;
    writeln!(
        out,
        "  xdp: {}",
        if np.xdp_devices.is_empty() { "off (TC alone)".to_string() } else { format!("native on {}", np.xdp_devices.join(" ")) }
    )?;
    if !np.xdp_devices.is_empty() {
        writeln!(out, "  xdp next hops cached: {}", np.xdp_next_hops.len())?;
        for h in np.xdp_next_hops.iter().take(CONNTRACK_LISTED) {
            writeln!(
                out,
                "    {}  in #{}  =>  out #{} to {} from {}  (checked at {}s for {} bytes)",
                h.flow, h.ingress_ifindex, h.ifindex, h.dmac, h.smac, h.checked_s, h.max_len
            )?;
        }
    }
    writeln!(out, "  conntrack: {} entries", np.conntrack.len())?;
    for c in np.conntrack.iter().take(CONNTRACK_LISTED) {
        let age = c.age_seconds.map_or_else(String::new, |a| format!("  {a}s ago"));
        let flags = if c.flags.is_empty() { String::new() } else { format!("  [{}]", c.flags.join(",")) };
        let backend = if c.backend_id == 0 { String::new() } else { format!("  #{}", c.backend_id) };
        writeln!(out, "    {:<10} {} {}  =>  {}{backend}{flags}{age}", c.direction, c.protocol, c.tuple, c.translated)?;
    }
    if np.conntrack.len() > CONNTRACK_LISTED {
        writeln!(out, "    ... {} more (--output json lists all)", np.conntrack.len() - CONNTRACK_LISTED)?;
    }
    let counters: Vec<String> = np.counters.iter().filter(|(k, _)| !k.starts_with("reserved")).map(|(k, v)| format!("{k}={v}")).collect();
    writeln!(out, "  counters: {}", counters.join(" "))?;
    if !np.fast_path.is_empty() {
        let fast: Vec<String> = np.fast_path.iter().filter(|(k, _)| !k.starts_with("reserved")).map(|(k, v)| format!("{k}={v}")).collect();
        writeln!(out, "  tc fast path: {}", fast.join(" "))?;
        let peers: Vec<String> = np.peer_devices.iter().map(u32::to_string).collect();
        writeln!(out, "  tc fast path peer devices (ifindex): {}", if peers.is_empty() { "none".to_string() } else { peers.join(" ") })?;
    }
    Ok(())
}
