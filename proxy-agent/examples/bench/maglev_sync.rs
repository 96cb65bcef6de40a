//! What Maglev tables cost a sync of the TC maps (`--only maglev-sync`):
//! the NodePort writer programs N frontends, each with its own set of 10
//! backends, into a fresh unattached TC datapath, once with tables at the
//! default size and once without; then every frontend loses one backend
//! (a new generation each: a new table linked in, the old one unlinked).
//!
//! Each link or unlink of a table is an update of the `NP_MAGLEV` hash of
//! maps, and the kernel makes every such update from user space wait for
//! an RCU grace period before it returns (kernel/bpf/syscall.c,
//! `maybe_wait_bpf_programs`): that wait, not the table's computation or
//! its fill, is what a sync with tables pays, and how many of those waits
//! overlap is what this measures. Variants interleave within each repeat,
//! their order alternating; medians with min–max over repeats.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::net::Ipv4Addr;
use std::time::Instant;

use anyhow::{Result, bail};
use proxy_agent::datapath::tc_loader;
use proxy_agent::decide::decision::ExternalState;
use proxy_agent::decide::maglev::TableSize;
use proxy_agent::external::nodeport::NodePortWriter;
use proxy_agent::model::{Backend, Frontend, Protocol};
use proxy_test_support::sandbox::PinDir;
use serde_json::json;

use crate::report::{Section, Target, spread};

/// Frontends per sync: a NodePort cluster of modest size.
const FRONTENDS: u16 = 200;
const BACKENDS_EACH: u8 = 10;

/// Frontend `i` on its own NodePort, with backends `10.(i/250).(i%250).1..=n`
/// minus `without`.
fn population(without: Option<u8>) -> ExternalState {
    let tc = (0..FRONTENDS)
        .map(|i| {
            let fe = Frontend { ip: Ipv4Addr::new(10, 0, 1, 2).into(), port: 30_000 + i, protocol: Protocol::Tcp };
            let set: BTreeSet<Backend> = (1..=BACKENDS_EACH)
                .filter(|b| Some(*b) != without)
                .map(|b| Backend { ip: Ipv4Addr::new(10, (i / 250) as u8 + 100, (i % 250) as u8, b).into(), port: 8080 })
                .collect();
            (fe, set)
        })
        .collect();
    ExternalState { tc, ..Default::default() }
}

/// Seconds for the first sync and for the one after every frontend lost a
/// backend, on a fresh datapath, with tables or without.
fn one(tables: bool) -> Result<(f64, f64)> {
    let pins = PinDir::new("tpbm")?;
    let _ebpf = tc_loader::load_unattached(pins.path())?;
    let mut w = NodePortWriter::open(pins.path())?;
    w.set_maglev_size(tables.then_some(TableSize::Default));
    w.set_config(Some(Ipv4Addr::new(10, 0, 3, 1)), None, (61_000, 65_535))?;
    let full = population(None);
    let t = Instant::now();
    let o = w.sync(&full);
    let first = t.elapsed().as_secs_f64();
    if let Some(e) = o.failures.first() {
        bail!("first sync: {e}");
    }
    let fewer = population(Some(BACKENDS_EACH));
    let t = Instant::now();
    let o = w.sync(&fewer);
    let change = t.elapsed().as_secs_f64();
    if let Some(e) = o.failures.first() {
        bail!("second sync: {e}");
    }
    if tables {
        match w.maglev_usage() {
            Some((_, n, _)) if n == u32::from(FRONTENDS) => {}
            other => bail!("expected {FRONTENDS} tables after the change, found {other:?}"),
        }
    }
    Ok((first, change))
}

pub(crate) fn run(repeats: usize) -> Result<Section> {
    let (mut with_first, mut with_change, mut without_first, mut without_change) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for rep in 0..repeats.max(1) {
        println!("maglev sync, repeat {}/{}", rep + 1, repeats.max(1));
        let order = if rep % 2 == 0 { [true, false] } else { [false, true] };
        for tables in order {
            let (first, change) = one(tables)?;
            if tables {
                with_first.push(first);
                with_change.push(change);
            } else {
                without_first.push(first);
                without_change.push(change);
            }
        }
    }
    let ms = |v: &[f64]| {
        let s = spread(v);
        format!("{:.0} ms ({:.0}–{:.0})", s.median * 1e3, s.min * 1e3, s.max * 1e3)
    };
    let (wf, wc, of, oc) = (spread(&with_first), spread(&with_change), spread(&without_first), spread(&without_change));
    let per_table_ms = (wf.median - of.median) * 1e3 / f64::from(FRONTENDS);
    let mut md = String::new();
    let _ = writeln!(md, "## Maglev tables in a TC sync\n");
    let _ = writeln!(
        md,
        "The NodePort writer syncs {FRONTENDS} frontends of {BACKENDS_EACH} backends each (every frontend its own backend set, so its own table) into a fresh unattached TC datapath, then syncs again after every frontend lost one backend (each gets a new generation: a new table linked in, the old one unlinked). Each link and unlink waits for an RCU grace period in the kernel (`maybe_wait_bpf_programs`); the writer makes them from up to 32 threads at once, so the waits overlap. {} repeats, variants interleaved; median (min–max).\n",
        repeats.max(1)
    );
    let _ = writeln!(md, "| sync | with tables (16381 entries) | without | added per table |");
    let _ = writeln!(md, "|---|---|---|---|");
    let _ = writeln!(md, "| first, {FRONTENDS} frontends | {} | {} | {per_table_ms:.2} ms |", ms(&with_first), ms(&without_first));
    let _ = writeln!(
        md,
        "| every frontend loses a backend | {} | {} | {:.2} ms |",
        ms(&with_change),
        ms(&without_change),
        (wc.median - oc.median) * 1e3 / f64::from(FRONTENDS)
    );
    let json = json!({
        "frontends": FRONTENDS,
        "first_s": {"with_tables": wf.json(), "without": of.json()},
        "change_s": {"with_tables": wc.json(), "without": oc.json()},
    });
    // A figure to report, not a goal of the issue's: no target row.
    let targets: Vec<Target> = Vec::new();
    Ok(Section { key: "maglev_sync", markdown: md, json, svgs: Vec::new(), targets })
}
