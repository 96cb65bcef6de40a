//! The map writer's part of the per-Service topology counts (issue #34):
//! what it writes besides a frontend's backends so that the programs count
//! each new connection by tier.
//!
//! * A backend's physical tier goes into `BackendValue::tier` when the
//!   backend is written, from the endpoint tier table the sync pass keeps
//!   ([`SharedTiers`]); a backend whose tier moves later (its endpoint
//!   moved, a Node's labels changed) is rewritten in place (one hash-map
//!   update of an unchanged address, which readers see whole).
//! * A frontend's chosen tier goes into its `ServiceValue` flags
//!   (`SVC_TIER_*`), with its other flags; a change rewrites the entry in
//!   place under the same generation.
//! * Its blind-remote share goes into `SVC_TOPO`/`NP_SVC_TOPO` at the
//!   frontend's index, before the frontend's entry is first written.
//! * A frontend that goes away has its counts (`SVC_CONN`) and share set to
//!   zero, so that the next frontend given its service id starts from zero.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, PoisonError, RwLock};

use aya::maps::{Array, Map, MapData, MapError, PerCpuArray, PerCpuValues};
use proxy_common as pc;
use proxy_common::{SvcConnValue, SvcTopoValue};

use crate::datapath::loader::pins;
use crate::datapath::maps::ServiceMaps;
use crate::datapath::maps::bpf_batch::{self, BatchError};
use crate::decide::decision::FrontendTopo;
use crate::decide::topology::tier::EndpointTiers;
use crate::model::{Backend, Frontend, PortLabel};
use crate::observe::service_connections::Owners;

/// The endpoint tier table, shared by the sync pass (which updates it) and
/// both datapaths' writers (which read it when they write a backend).
pub type SharedTiers = Arc<RwLock<EndpointTiers>>;

/// The `ServiceValue.flags` bits of a chosen tier.
pub fn tier_bits(tier: Option<u8>) -> u32 {
    tier.map_or(0, |t| ((u32::from(t) + 1) << pc::SVC_TIER_SHIFT) & pc::SVC_TIER_MASK)
}

/// One datapath's topology counting maps (`SVC_CONN`/`SVC_TOPO` or their `NP_` twins), with what
/// was written to them.
pub struct TopoMaps {
    conn: PerCpuArray<MapData, SvcConnValue>,
    topo: Array<MapData, SvcTopoValue>,
    /// What the sync pass asks per frontend: (tier bits, share, owner).
    want: HashMap<Frontend, (u32, u32, Arc<PortLabel>)>,
    /// Where the owners of the counted service ids are published for
    /// `/metrics`, and this datapath's code there.
    owners: Option<(u8, Owners)>,
    /// The share written per service id. An id not listed holds 0 (a new
    /// map is zero, and `forget` zeroes an id it takes back), unless it was
    /// programmed when the writer opened the maps (`adopted`): a cold start
    /// writes only the shares that are not 0.
    written: HashMap<u32, u32>,
    adopted: std::collections::HashSet<u32>,
    tiers: Option<SharedTiers>,
    /// The table version the backends were last checked against.
    tiers_seen: Option<u64>,
    /// The tiers other than `other` the backends carried when the writer
    /// opened the maps, by backend id, checked against the table once it
    /// is known (a backend not listed carried `other`, which is all of
    /// them in pins of a build before the counts).
    pub(crate) stored: Option<HashMap<u32, u8>>,
}

impl TopoMaps {
    /// Opens the counting maps of `maps`' datapath; `None` when they are
    /// not pinned (a datapath installed by a build without them, before the
    /// loader adds them): nothing is counted.
    pub fn open(pin_dir: &Path, maps: &ServiceMaps) -> Result<Option<TopoMaps>, MapError> {
        let (conn_path, topo_path) = (pins::map(pin_dir, maps.conn.name), pins::map(pin_dir, maps.topo.name));
        if !conn_path.exists() || !topo_path.exists() {
            return Ok(None);
        }
        let conn = PerCpuArray::try_from(Map::PerCpuArray(MapData::from_pin(conn_path)?))?;
        let topo = Array::try_from(Map::Array(MapData::from_pin(topo_path)?))?;
        Ok(Some(TopoMaps {
            conn,
            topo,
            want: HashMap::new(),
            owners: None,
            written: HashMap::new(),
            adopted: std::collections::HashSet::new(),
            tiers: None,
            tiers_seen: None,
            stored: None,
        }))
    }

    /// The slots of the counting arrays: service ids `1..=capacity` fit.
    pub fn capacity(&self) -> u32 {
        self.topo.len()
    }

    /// The physical tier of a backend, `other` before a table is set.
    pub fn backend_tier(&self, b: &Backend) -> u8 {
        self.tiers.as_ref().map_or(pc::tier::OTHER, |t| t.read().unwrap_or_else(PoisonError::into_inner).tier(&b.ip))
    }

    /// The tier bits `fe`'s service entry carries.
    pub fn tier_bits_of(&self, fe: &Frontend) -> u32 {
        self.want.get(fe).map_or(0, |w| w.0)
    }

    /// Sets the endpoint tier table; returns the addresses whose backends
    /// must be checked again (`None`: all of them, the first time), or
    /// nothing when the table did not move.
    pub fn set_tiers(&mut self, tiers: &SharedTiers) -> Option<Option<Vec<std::net::IpAddr>>> {
        let same = self.tiers.as_ref().is_some_and(|t| Arc::ptr_eq(t, tiers));
        if !same {
            self.tiers = Some(tiers.clone());
        }
        let t = tiers.read().unwrap_or_else(PoisonError::into_inner);
        let version = t.version();
        match self.tiers_seen.replace(version) {
            Some(seen) if same && seen == version => None,
            Some(_) if same => Some(Some(t.changed().to_vec())),
            _ => Some(None),
        }
    }

    /// Records what the sync pass asks of `frontends`; returns those whose
    /// tier bits or share changed (the writer rewrites what is programmed).
    pub fn set_topology(&mut self, frontends: &[(Frontend, FrontendTopo)]) -> Vec<Frontend> {
        let mut changed = Vec::new();
        for (fe, t) in frontends {
            let w = (tier_bits(t.tier), t.blind_remote_share, t.port.clone());
            if self.want.insert(*fe, w.clone()) != Some(w) {
                changed.push(*fe);
            }
        }
        changed
    }

    /// Publishes the owner of each counted service id in `owners` from now
    /// on, under datapath code `datapath`.
    pub fn set_owners(&mut self, datapath: u8, owners: Owners) {
        self.owners = Some((datapath, owners));
    }

    fn publish(&self, service_id: u32, owner: Option<Arc<PortLabel>>) {
        let Some((datapath, owners)) = &self.owners else { return };
        let mut o = owners.write().unwrap_or_else(PoisonError::into_inner);
        match owner {
            Some(l) => {
                o.insert((*datapath, service_id), l);
            }
            None => {
                o.remove(&(*datapath, service_id));
            }
        }
    }

    /// Writes `fe`'s share at `service_id`'s index when it is not there.
    pub fn write_share(&mut self, fe: &Frontend, service_id: u32) -> Result<(), BatchError> {
        self.write_shares([(fe, service_id)])
    }

    /// [`Self::write_share`] of many frontends (frontend, its service id),
    /// the shares that are not there in one batch call: a cold start at
    /// 100k Services writes a share for every frontend with endpoints
    /// outside this node's zone, which one bpf(2) call each made 100k
    /// calls. On a failure the shares before the one that failed are
    /// written, and the others are tried again at the next write.
    pub fn write_shares<'a>(&mut self, frontends: impl IntoIterator<Item = (&'a Frontend, u32)>) -> Result<(), BatchError> {
        let (mut indices, mut values, mut ids) = (Vec::new(), Vec::new(), Vec::new());
        let capacity = self.capacity();
        for (fe, service_id) in frontends {
            let share = self.want.get(fe).map_or(0, |w| w.1);
            self.publish(service_id, self.want.get(fe).map(|w| w.2.clone()));
            let held = self.written.get(&service_id).copied().or_else(|| (!self.adopted.contains(&service_id)).then_some(0));
            if held == Some(share) {
                continue;
            }
            let index = pc::svc_conn_index(service_id);
            if index >= capacity {
                continue; // an older build's id: not counted
            }
            indices.push(index);
            values.push(SvcTopoValue { blind_remote_share_fp: share });
            ids.push((service_id, share));
        }
        if indices.is_empty() {
            return Ok(());
        }
        let result = bpf_batch::update_array(&mut self.topo, &indices, &values);
        let applied = result.as_ref().map_or_else(|e| e.applied, |()| ids.len());
        self.written.extend(ids.into_iter().take(applied));
        result
    }

    /// The service ids programmed when the maps were opened, whose shares
    /// are not known.
    pub fn adopt(&mut self, ids: impl IntoIterator<Item = u32>) {
        self.adopted.extend(ids);
    }

    /// `fe` went away: its counts and share start from zero for the next
    /// frontend given `service_id`.
    pub fn forget(&mut self, fe: &Frontend, service_id: u32) {
        self.want.remove(fe);
        self.written.remove(&service_id);
        self.adopted.remove(&service_id);
        self.publish(service_id, None);
        let index = pc::svc_conn_index(service_id);
        if index >= self.capacity() {
            return;
        }
        let _ = self.topo.set(index, SvcTopoValue::default(), 0);
        if let Ok(cpus) = aya::util::nr_cpus()
            && let Ok(zero) = PerCpuValues::try_from(vec![SvcConnValue::default(); cpus])
            && let Err(e) = self.conn.set(index, zero, 0)
        {
            tracing::debug!(error = %e, service_id, "zeroing a frontend's connection counts failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tier_bits_fill_the_three_flag_bits_and_read_back() {
        for t in [pc::tier::OTHER, pc::tier::NODE, pc::tier::POOL] {
            let v = pc::ServiceValue { flags: tier_bits(Some(t)) | pc::SVC_FLAG_MAGLEV, ..Default::default() };
            assert_eq!(v.counted_tier(pc::tier::ZONE), usize::from(t));
            assert_eq!(v.flags & !pc::SVC_TIER_MASK, pc::SVC_FLAG_MAGLEV);
        }
        assert_eq!(tier_bits(None), 0);
    }
}
