//! Writing plans into the pinned maps, one frontend at a time, in an order
//! the datapath never sees half done.
//!
//! For an update the writer (1) adds any new backends, (2) writes the new
//! slot set under a fresh generation, (3) replaces the service entry, which
//! switches readers to the new generation in one hash-map update, and only
//! then (4) deletes the old generation's slots and (5) backends no Service
//! uses any more. A reader that loaded the old entry just before (3) and
//! misses a slot deleted in (4) looks the service up again (see
//! `proxy-ebpf`), so it never sees a hole, a mix of two sets, or a count
//! larger than the slots written.
//!
//! Service and backend ids are read back from the maps when the writer is
//! opened, so they stay stable across agent restarts.

use std::collections::{BTreeMap, BTreeSet, HashMap as StdHashMap};
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::Path;

use aya::maps::{HashMap, Map, MapData, MapError, MapInfo};
use proxy_common as pc;
use proxy_common::{BackendKey, BackendValue, ServiceKey, ServiceValue, SlotKey, SlotValue};

use crate::loader::capacity_flag;
use crate::model::{Backend, Frontend, Protocol};
use crate::plan::{Plan, State};

#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error("cannot open pinned map {map}: {source}")]
    Open { map: &'static str, source: MapError },
    #[error("map {map} is full ({used} of {max} entries in use, {needed} more needed); raise {flag}")]
    Full { map: &'static str, used: u32, max: u32, needed: u32, flag: &'static str },
    #[error("writing map {map} failed: {source}")]
    Syscall { map: &'static str, source: MapError },
    #[error("no free {what} id")]
    NoId { what: &'static str },
}

/// A frontend that could not be written; it was left exactly as it was.
#[derive(Debug, thiserror::Error)]
#[error("{frontend}: {error}")]
pub struct ApplyError {
    pub frontend: Frontend,
    pub error: WriteError,
}

#[derive(Clone, Debug)]
struct Programmed {
    value: ServiceValue,
    backends: Vec<Backend>,
}

pub struct MapWriter {
    /// Names of the (services, slots, backends) maps this writer owns: the
    /// socket datapath's, or the TC datapath's `NP_*` maps.
    names: [&'static str; 3],
    services: HashMap<MapData, ServiceKey, ServiceValue>,
    slots: HashMap<MapData, SlotKey, SlotValue>,
    backends: HashMap<MapData, BackendKey, BackendValue>,
    max_services: u32,
    max_slots: u32,
    max_backends: u32,
    programmed: BTreeMap<Frontend, Programmed>,
    /// Backend address to (id, number of frontends using it).
    backend_ids: StdHashMap<Backend, (u32, u32)>,
    /// Slots in use across all frontends (current generations only).
    slots_used: u32,
    service_id_set: BTreeSet<u32>,
    backend_id_set: BTreeSet<u32>,
    next_service_id: u32,
    next_backend_id: u32,
}

/// Encodes a frontend as the datapath's key.
pub fn service_key(fe: &Frontend) -> ServiceKey {
    let (ip_be, family) = ip_words(&fe.ip);
    ServiceKey {
        ip_be,
        port_be: fe.port.to_be(),
        proto: match fe.protocol {
            Protocol::Tcp => pc::PROTO_TCP,
            Protocol::Udp => pc::PROTO_UDP,
        },
        family,
    }
}

/// Decodes a datapath key; `None` for a key this agent would never write.
pub fn frontend_of(key: &ServiceKey) -> Option<Frontend> {
    let protocol = match key.proto {
        pc::PROTO_TCP => Protocol::Tcp,
        pc::PROTO_UDP => Protocol::Udp,
        _ => return None,
    };
    Some(Frontend { ip: ip_of(key.ip_be, key.family)?, port: u16::from_be(key.port_be), protocol })
}

pub fn backend_value(b: &Backend) -> BackendValue {
    let (ip_be, family) = ip_words(&b.ip);
    BackendValue { ip_be, port_be: b.port.to_be(), family, _pad: 0 }
}

pub fn backend_of(v: &BackendValue) -> Option<Backend> {
    Some(Backend { ip: ip_of(v.ip_be, v.family)?, port: u16::from_be(v.port_be) })
}

/// The maps hold addresses as the kernel does: network byte order in
/// 32-bit words, IPv4 in the first word.
fn ip_words(ip: &IpAddr) -> ([u32; 4], u8) {
    match ip {
        IpAddr::V4(v4) => ([u32::from_ne_bytes(v4.octets()), 0, 0, 0], pc::FAMILY_V4),
        IpAddr::V6(v6) => {
            let o = v6.octets();
            let w = |i: usize| u32::from_ne_bytes([o[i], o[i + 1], o[i + 2], o[i + 3]]);
            ([w(0), w(4), w(8), w(12)], pc::FAMILY_V6)
        }
    }
}

fn ip_of(words: [u32; 4], family: u8) -> Option<IpAddr> {
    match family {
        pc::FAMILY_V4 => Some(IpAddr::V4(Ipv4Addr::from(words[0].to_ne_bytes()))),
        pc::FAMILY_V6 => {
            let mut o = [0u8; 16];
            for (i, w) in words.iter().enumerate() {
                o[i * 4..i * 4 + 4].copy_from_slice(&w.to_ne_bytes());
            }
            Some(IpAddr::V6(Ipv6Addr::from(o)))
        }
        _ => None,
    }
}

fn open_hash<K: aya::Pod, V: aya::Pod>(pin_dir: &Path, name: &'static str) -> Result<(HashMap<MapData, K, V>, u32), WriteError> {
    let err = |source| WriteError::Open { map: name, source };
    let path = pin_dir.join(name);
    let max = MapInfo::from_pin(&path).map_err(err)?.max_entries();
    let data = MapData::from_pin(&path).map_err(err)?;
    Ok((HashMap::try_from(Map::HashMap(data)).map_err(err)?, max))
}

fn is_not_found(e: &MapError) -> bool {
    matches!(e, MapError::KeyNotFound)
        || matches!(e, MapError::SyscallError(s) if s.io_error.kind() == io::ErrorKind::NotFound)
}

impl MapWriter {
    /// Opens the pinned maps and reads back what they hold. Slots and
    /// backends that no current service references (left by an agent that
    /// died mid-update) are removed.
    pub fn open(pin_dir: &Path) -> Result<MapWriter, WriteError> {
        Self::open_maps(pin_dir, [pc::SERVICES_MAP, pc::SLOTS_MAP, pc::BACKENDS_MAP])
    }

    /// Like [`MapWriter::open`] for another set of maps with the same
    /// layouts, named (services, slots, backends).
    pub fn open_maps(pin_dir: &Path, names: [&'static str; 3]) -> Result<MapWriter, WriteError> {
        let (services, max_services) = open_hash(pin_dir, names[0])?;
        let (slots, max_slots) = open_hash(pin_dir, names[1])?;
        let (backends, max_backends) = open_hash(pin_dir, names[2])?;
        let mut w = MapWriter {
            names,
            services,
            slots,
            backends,
            max_services,
            max_slots,
            max_backends,
            programmed: BTreeMap::new(),
            backend_ids: StdHashMap::new(),
            slots_used: 0,
            service_id_set: BTreeSet::new(),
            backend_id_set: BTreeSet::new(),
            next_service_id: 1,
            next_backend_id: 1,
        };
        w.read_back();
        Ok(w)
    }

    fn read_back(&mut self) {
        let backend_table: BTreeMap<u32, BackendValue> =
            self.backends.iter().filter_map(Result::ok).map(|(k, v)| (k.backend_id, v)).collect();
        let entries: Vec<(ServiceKey, ServiceValue)> = self.services.iter().filter_map(Result::ok).collect();
        let mut live_slots = BTreeSet::new();
        let mut max_sid = 0;
        for (key, value) in entries {
            max_sid = max_sid.max(value.service_id);
            let Some(fe) = frontend_of(&key) else { continue };
            let mut list = Vec::new();
            for slot in 0..value.backend_count {
                let sk = SlotKey { service_id: value.service_id, generation: value.generation, slot };
                live_slots.insert(sk);
                if let Ok(s) = self.slots.get(&sk, 0)
                    && let Some(b) = backend_table.get(&s.backend_id).and_then(backend_of)
                {
                    list.push(b);
                    self.backend_ids.entry(b).or_insert((s.backend_id, 0)).1 += 1;
                }
                // A missing slot or backend shows up as a shorter list, so
                // the next plan rewrites this frontend completely.
            }
            self.slots_used += value.backend_count;
            self.service_id_set.insert(value.service_id);
            self.programmed.insert(fe, Programmed { value, backends: list });
        }
        // Orphans: slots of old generations, backends nobody references.
        let stale_slots: Vec<SlotKey> =
            self.slots.keys().filter_map(Result::ok).filter(|k| !live_slots.contains(k)).collect();
        for k in stale_slots {
            let _ = self.slots.remove(&k);
        }
        self.backend_id_set = self.backend_ids.values().map(|(id, _)| *id).collect();
        for id in backend_table.keys() {
            if !self.backend_id_set.contains(id) {
                let _ = self.backends.remove(&BackendKey { backend_id: *id });
            }
        }
        self.next_service_id = max_sid.wrapping_add(1).max(1);
        self.next_backend_id = backend_table.keys().max().copied().unwrap_or(0).wrapping_add(1).max(1);
    }

    /// What the maps hold, in the planner's terms.
    pub fn state(&self) -> State {
        self.programmed
            .iter()
            .map(|(fe, p)| (*fe, p.backends.iter().copied().collect()))
            .collect()
    }

    /// Applies a plan. Each frontend is written completely or not at all;
    /// the ones that failed are returned and the rest is applied.
    pub fn apply(&mut self, plan: &Plan) -> Vec<ApplyError> {
        let mut errors = Vec::new();
        // Deletes first: they free room for the upserts.
        for fe in &plan.deletes {
            self.delete(fe);
        }
        for (fe, backends) in &plan.upserts {
            if let Err(error) = self.upsert(fe, backends) {
                errors.push(ApplyError { frontend: *fe, error });
            }
        }
        errors
    }

    fn alloc_id(next: &mut u32, used: impl Fn(u32) -> bool, what: &'static str) -> Result<u32, WriteError> {
        // Ids only need to be unique; scanning from a moving hint keeps
        // allocation O(1) in the common case and still reuses freed ids after
        // the counter wraps.
        for _ in 0..1_000_000 {
            let id = *next;
            *next = next.wrapping_add(1).max(1);
            if id != 0 && !used(id) {
                return Ok(id);
            }
        }
        Err(WriteError::NoId { what })
    }

    fn upsert(&mut self, fe: &Frontend, backends: &[Backend]) -> Result<(), WriteError> {
        let key = service_key(fe);
        let old = self.programmed.get(fe).cloned();
        let n = u32::try_from(backends.len()).unwrap_or(u32::MAX);

        // Check room first so a full map is reported plainly and nothing is
        // touched. The old generation's slots stay until the switch, so the
        // new ones must fit beside them.
        if old.is_none() && self.programmed.len() as u32 >= self.max_services {
            let used = self.programmed.len() as u32;
            return Err(full(self.names[0], used, self.max_services, 1));
        }
        if self.slots_used.saturating_add(n) > self.max_slots {
            return Err(full(self.names[1], self.slots_used, self.max_slots, n));
        }
        let new_backends: Vec<Backend> = backends.iter().filter(|b| !self.backend_ids.contains_key(b)).copied().collect();
        let used_backends = self.backend_ids.len() as u32;
        if used_backends.saturating_add(new_backends.len() as u32) > self.max_backends {
            return Err(full(self.names[2], used_backends, self.max_backends, new_backends.len() as u32));
        }

        // (1) new backends
        let mut created: Vec<(Backend, u32)> = Vec::new();
        for b in &new_backends {
            let set = &self.backend_id_set;
            let id = match Self::alloc_id(&mut self.next_backend_id, |id| set.contains(&id), "backend") {
                Ok(id) => id,
                Err(e) => {
                    self.undo_backends(&created);
                    return Err(e);
                }
            };
            if let Err(source) = self.backends.insert(BackendKey { backend_id: id }, backend_value(b), 0) {
                self.undo_backends(&created);
                return Err(WriteError::Syscall { map: self.names[2], source });
            }
            self.backend_id_set.insert(id);
            created.push((*b, id));
        }
        let id_of = |b: &Backend| -> u32 {
            self.backend_ids
                .get(b)
                .map(|(id, _)| *id)
                .or_else(|| created.iter().find(|(c, _)| c == b).map(|(_, id)| *id))
                .unwrap_or(0)
        };
        let ids: Vec<u32> = backends.iter().map(id_of).collect();

        // (2) slots under a fresh generation
        let service_id = match &old {
            Some(p) => p.value.service_id,
            None => {
                let set = &self.service_id_set;
                match Self::alloc_id(&mut self.next_service_id, |id| set.contains(&id), "service") {
                    Ok(id) => id,
                    Err(e) => {
                        self.undo_backends(&created);
                        return Err(e);
                    }
                }
            }
        };
        let generation = old.as_ref().map_or(1, |p| p.value.generation.wrapping_add(1));
        let mut written = 0;
        for (slot, backend_id) in ids.iter().enumerate() {
            let sk = SlotKey { service_id, generation, slot: slot as u32 };
            if let Err(source) = self.slots.insert(sk, SlotValue { backend_id: *backend_id }, 0) {
                self.undo_slots(service_id, generation, written);
                self.undo_backends(&created);
                return Err(WriteError::Syscall { map: self.names[1], source });
            }
            written += 1;
        }

        // (3) the switch
        let value = ServiceValue { service_id, backend_count: n, generation, flags: 0 };
        if let Err(source) = self.services.insert(key, value, 0) {
            self.undo_slots(service_id, generation, written);
            self.undo_backends(&created);
            return Err(WriteError::Syscall { map: self.names[0], source });
        }

        // Book-keeping: take references on the new set before dropping the
        // old one, so shared backends are never deleted.
        for (b, id) in &created {
            self.backend_ids.insert(*b, (*id, 0));
        }
        for b in backends {
            if let Some(e) = self.backend_ids.get_mut(b) {
                e.1 += 1;
            }
        }
        self.slots_used = self.slots_used.saturating_add(n);
        self.service_id_set.insert(service_id);
        self.programmed.insert(*fe, Programmed { value, backends: backends.to_vec() });

        // (4) and (5)
        if let Some(old) = old {
            self.release(&old);
        }
        Ok(())
    }

    fn delete(&mut self, fe: &Frontend) {
        let Some(old) = self.programmed.remove(fe) else { return };
        self.service_id_set.remove(&old.value.service_id);
        if let Err(e) = self.services.remove(&service_key(fe))
            && !is_not_found(&e)
        {
            tracing::warn!(frontend = %fe, error = %e, "removing service entry failed");
        }
        self.release(&old);
    }

    /// Drops an old generation: its slots, then backends nobody uses.
    fn release(&mut self, old: &Programmed) {
        self.undo_slots(old.value.service_id, old.value.generation, old.value.backend_count);
        self.slots_used = self.slots_used.saturating_sub(old.value.backend_count);
        for b in &old.backends {
            let gone = match self.backend_ids.get_mut(b) {
                Some(e) => {
                    e.1 = e.1.saturating_sub(1);
                    (e.1 == 0).then_some(e.0)
                }
                None => None,
            };
            if let Some(id) = gone {
                self.backend_ids.remove(b);
                self.backend_id_set.remove(&id);
                let _ = self.backends.remove(&BackendKey { backend_id: id });
            }
        }
    }

    fn undo_slots(&mut self, service_id: u32, generation: u32, count: u32) {
        for slot in 0..count {
            let _ = self.slots.remove(&SlotKey { service_id, generation, slot });
        }
    }

    fn undo_backends(&mut self, created: &[(Backend, u32)]) {
        for (_, id) in created {
            self.backend_id_set.remove(id);
            let _ = self.backends.remove(&BackendKey { backend_id: *id });
        }
    }

    /// Entries in use per map, for metrics and `dump`.
    /// The backends programmed for `fe`, in slot order (without copying
    /// the whole state as [`MapWriter::state`] does).
    pub fn backends_of(&self, fe: &Frontend) -> Option<&[Backend]> {
        self.programmed.get(fe).map(|p| p.backends.as_slice())
    }

    /// Frontends programmed.
    pub fn frontends(&self) -> usize {
        self.programmed.len()
    }

    /// Backends programmed, summed over all frontends (the slots in use).
    pub fn endpoints(&self) -> usize {
        self.slots_used as usize
    }

    pub fn occupancy(&self) -> [(&'static str, u32, u32); 3] {
        [
            (pc::SERVICES_MAP, self.programmed.len() as u32, self.max_services),
            (pc::SLOTS_MAP, self.slots_used, self.max_slots),
            (pc::BACKENDS_MAP, self.backend_ids.len() as u32, self.max_backends),
        ]
    }
}

fn full(map: &'static str, used: u32, max: u32, needed: u32) -> WriteError {
    WriteError::Full { map, used, max, needed, flag: capacity_flag(map) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip_in_network_order() {
        let fe = Frontend { ip: "10.96.0.10".parse().unwrap(), port: 80, protocol: Protocol::Udp };
        let k = service_key(&fe);
        // 10.96.0.10 in memory is 0a 60 00 0a; port 80 is 00 50.
        assert_eq!(k.ip_be[0].to_ne_bytes(), [10, 96, 0, 10]);
        assert_eq!(k.port_be.to_ne_bytes(), [0, 80]);
        assert_eq!(k.proto, pc::PROTO_UDP);
        assert_eq!(k.family, pc::FAMILY_V4);
        assert_eq!(frontend_of(&k), Some(fe));
        let fe6 = Frontend { ip: "fd00:96::a".parse().unwrap(), port: 443, protocol: Protocol::Tcp };
        let k6 = service_key(&fe6);
        assert_eq!(k6.ip_be[0].to_ne_bytes(), [0xfd, 0, 0, 0x96]);
        assert_eq!(frontend_of(&k6), Some(fe6));
        let b = Backend { ip: "fd00::1".parse().unwrap(), port: 8080 };
        assert_eq!(backend_of(&backend_value(&b)), Some(b));
        assert_eq!(frontend_of(&ServiceKey { proto: 1, ..k }), None);
    }
}
