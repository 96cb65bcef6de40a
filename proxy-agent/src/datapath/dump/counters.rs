//! The programs' reason counters (`COUNTERS`, `NP_COUNTERS`,
//! `NP_FAST_COUNTERS`) and the topology counts (`SVC_CONN`, `NP_SVC_CONN`),
//! summed over CPUs and named.

use std::collections::BTreeMap;
use std::path::Path;

use aya::maps::{MapData, PerCpuArray};
use proxy_common as pc;
use proxy_common::{ServiceKey, ServiceValue, SvcConnValue};

use crate::datapath::loader::pins;
use crate::datapath::maps::{self, MapSpec};

use super::read::{DumpError, counter_sums, hash_entries, open};

/// The topology counts (issue #34) of service ids `ids` of one datapath
/// (`SVC_CONN` or `NP_SVC_CONN`, by `spec`), summed over CPUs; ids without
/// a slot (an older build's) are left out. Read-only; used by `/metrics`
/// and `explain --live`.
pub fn service_conn_sums(pin_dir: &Path, spec: &'static MapSpec, ids: &[u32]) -> Result<Vec<(u32, SvcConnValue)>, DumpError> {
    let (map, max) = open(pin_dir, spec)?;
    let arr = PerCpuArray::<MapData, SvcConnValue>::try_from(map)
        .map_err(|error| DumpError::Kind { path: pins::map(pin_dir, spec.name), error })?;
    let mut out = Vec::with_capacity(ids.len());
    for &id in ids {
        let index = pc::svc_conn_index(id);
        if index >= max {
            continue;
        }
        let per_cpu = arr.get(&index, 0).map_err(|error| DumpError::Read { map: spec.name, error })?;
        out.push((id, sum_conn(per_cpu.iter())));
    }
    Ok(out)
}

/// Per-CPU topology counts added up.
pub fn sum_conn<'a>(values: impl Iterator<Item = &'a SvcConnValue>) -> SvcConnValue {
    values.fold(SvcConnValue::default(), |mut a, v| {
        for (x, y) in a.tiers.iter_mut().zip(v.tiers) {
            *x = x.wrapping_add(y);
        }
        a.blind_remote_fp = a.blind_remote_fp.wrapping_add(v.blind_remote_fp);
        a
    })
}

/// The topology counts of every frontend of one datapath (`services` the
/// frontend map, `conn` its counting array), by frontend; nothing when the
/// counting array is not pinned (a datapath of an older build).
pub fn frontend_conn_counts(
    pin_dir: &Path,
    services: &'static MapSpec,
    conn: &'static MapSpec,
) -> Result<BTreeMap<crate::model::Frontend, SvcConnValue>, DumpError> {
    if !pins::map(pin_dir, conn.name).exists() {
        return Ok(BTreeMap::new());
    }
    let entries: Vec<(ServiceKey, ServiceValue)> = hash_entries(pin_dir, services, &mut Vec::new())?;
    let ids: Vec<u32> = entries.iter().map(|(_, v)| v.service_id).collect();
    let counts: BTreeMap<u32, SvcConnValue> = service_conn_sums(pin_dir, conn, &ids)?.into_iter().collect();
    Ok(entries.iter().filter_map(|(k, v)| Some((crate::datapath::maps::keys::frontend_of(k)?, *counts.get(&v.service_id)?))).collect())
}

/// The TC programs' `NP_COUNTERS` summed over CPUs, indexed by counter id
/// (`proxy_common::np_counter::NAMES`). Read-only; used by `/metrics`.
pub fn np_counter_sums(pin_dir: &Path) -> Result<Vec<u64>, DumpError> {
    counter_sums(pin_dir, &maps::NP_COUNTERS, &mut Vec::new())
}

/// The socket hooks' `COUNTERS` summed over CPUs, indexed by counter id
/// (`proxy_common::counter::NAMES`). Read-only; used by `/metrics`.
pub fn socket_counter_sums(pin_dir: &Path) -> Result<Vec<u64>, DumpError> {
    counter_sums(pin_dir, &maps::COUNTERS, &mut Vec::new())
}

/// The TC fast path's `NP_FAST_COUNTERS` summed over CPUs, indexed by
/// counter id (`proxy_common::np_fast_counter::NAMES`). Used by `/metrics`.
pub fn np_fast_counter_sums(pin_dir: &Path) -> Result<Vec<u64>, DumpError> {
    counter_sums(pin_dir, &maps::NP_FAST_COUNTERS, &mut Vec::new())
}

/// [`np_fast_counter_sums`] by name.
pub fn np_fast_counters(pin_dir: &Path) -> Result<BTreeMap<&'static str, u64>, DumpError> {
    Ok(pc::np_fast_counter::NAMES.iter().copied().zip(np_fast_counter_sums(pin_dir)?).collect())
}

/// [`np_counter_sums`] by name, for the counters this agent knows.
pub fn np_counters(pin_dir: &Path) -> Result<BTreeMap<&'static str, u64>, DumpError> {
    Ok(pc::np_counter::NAMES.iter().copied().zip(np_counter_sums(pin_dir)?).collect())
}

/// Counter values by name (`proxy_common::counter::NAMES`).
pub fn named_counters(sums: &[u64]) -> BTreeMap<String, u64> {
    named(sums, &pc::counter::NAMES)
}

/// `NP_COUNTERS` values by name (`proxy_common::np_counter::NAMES`).
pub fn named_np_counters(sums: &[u64]) -> BTreeMap<String, u64> {
    named(sums, &pc::np_counter::NAMES)
}

pub(super) fn named(sums: &[u64], names: &[&str]) -> BTreeMap<String, u64> {
    sums.iter().enumerate().map(|(i, v)| (names.get(i).map_or_else(|| format!("counter{i}"), |n| (*n).to_string()), *v)).collect()
}
