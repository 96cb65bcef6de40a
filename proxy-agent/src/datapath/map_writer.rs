//! Writing plans into the pinned maps in an order the datapath never sees
//! half done.
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
//! Frontends are written in chunks, each step of a chunk in one batch
//! syscall (`bpf_batch`): every new backend and slot of the chunk, then
//! every service entry, then the old generations. Each frontend still goes
//! through (1)..(5) in that order. Room is checked per frontend against what
//! the maps physically hold (old generations of the chunk included), and a
//! frontend that does not fit beside the chunk is retried after writing it,
//! so a frontend is reported full exactly when writing frontends one at a
//! time would have reported it. When a batch call fails, the frontends whose
//! service entry it did not write go through the one-at-a-time path, which
//! names the frontend, map and reason of the failure.
//!
//! Service and backend ids are read back from the maps when the writer is
//! opened, so they stay stable across agent restarts.

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;

use aya::maps::{HashMap, Map, MapData, MapError, MapInfo};
use foldhash::{HashMap as FastHashMap, HashSet as FastHashSet};
use proxy_common as pc;
use proxy_common::{BackendKey, BackendValue, ServiceKey, ServiceValue, SlotKey, SlotValue};

use crate::datapath::bpf_batch;
use crate::datapath::socket_loader::capacity_flag;
use crate::decide::plan::{Plan, State};
use crate::model::{Backend, Frontend, Protocol};

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
    /// The same maps' descriptors, for the batch calls.
    fds: MapFds,
    max_services: u32,
    max_slots: u32,
    max_backends: u32,
    programmed: BTreeMap<Frontend, Programmed>,
    /// Backend address to (id, number of frontends using it).
    backend_ids: FastHashMap<Backend, (u32, u32)>,
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

struct MapFds {
    services: OwnedFd,
    slots: OwnedFd,
    backends: OwnedFd,
}

type Opened<K, V> = (HashMap<MapData, K, V>, OwnedFd, u32);

fn open_hash<K: aya::Pod, V: aya::Pod>(pin_dir: &Path, name: &'static str) -> Result<Opened<K, V>, WriteError> {
    let err = |source| WriteError::Open { map: name, source };
    let path = pin_dir.join(name);
    let max = MapInfo::from_pin(&path).map_err(err)?.max_entries();
    let data = MapData::from_pin(&path).map_err(err)?;
    let fd = data
        .fd()
        .as_fd()
        .try_clone_to_owned()
        .map_err(|e| err(MapError::SyscallError(aya::sys::SyscallError { call: "dup", io_error: e })))?;
    // try_from checks the key and value sizes against the map's, which the
    // batch calls rely on too.
    Ok((HashMap::try_from(Map::HashMap(data)).map_err(err)?, fd, max))
}

fn is_not_found(e: &MapError) -> bool {
    matches!(e, MapError::KeyNotFound) || matches!(e, MapError::SyscallError(s) if s.io_error.kind() == io::ErrorKind::NotFound)
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
        let (services, services_fd, max_services) = open_hash(pin_dir, names[0])?;
        let (slots, slots_fd, max_slots) = open_hash(pin_dir, names[1])?;
        let (backends, backends_fd, max_backends) = open_hash(pin_dir, names[2])?;
        let mut w = MapWriter {
            names,
            services,
            slots,
            backends,
            fds: MapFds { services: services_fd, slots: slots_fd, backends: backends_fd },
            max_services,
            max_slots,
            max_backends,
            programmed: BTreeMap::new(),
            backend_ids: FastHashMap::default(),
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
        // In a few batch calls rather than two syscalls per entry: at 10k
        // Services x 10 endpoints, reading back one entry at a time took a
        // restarted agent longer than a cold start (issue #7). Iteration
        // stays as the fallback for a kernel that cannot batch.
        let backend_table: BTreeMap<u32, BackendValue> =
            bpf_batch::read_all(&self.backends).into_iter().map(|(k, v)| (k.backend_id, v)).collect();
        let entries: Vec<(ServiceKey, ServiceValue)> = bpf_batch::read_all(&self.services);
        let slot_table: FastHashMap<SlotKey, SlotValue> = bpf_batch::read_all(&self.slots).into_iter().collect();
        let mut live_slots = FastHashSet::default();
        let mut max_sid = 0;
        for (key, value) in entries {
            max_sid = max_sid.max(value.service_id);
            let Some(fe) = frontend_of(&key) else { continue };
            let mut list = Vec::new();
            for slot in 0..value.backend_count {
                let sk = SlotKey { service_id: value.service_id, generation: value.generation, slot };
                live_slots.insert(sk);
                if let Some(s) = slot_table.get(&sk)
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
        // What cannot be deleted now is left for the next agent to find.
        let stale_slots: Vec<SlotKey> = slot_table.keys().filter(|k| !live_slots.contains(*k)).copied().collect();
        let _ = delete_keys(&mut self.slots, self.fds.slots.as_fd(), &stale_slots);
        self.backend_id_set = self.backend_ids.values().map(|(id, _)| *id).collect();
        let orphans: Vec<BackendKey> =
            backend_table.keys().filter(|id| !self.backend_id_set.contains(*id)).map(|id| BackendKey { backend_id: *id }).collect();
        let _ = delete_keys(&mut self.backends, self.fds.backends.as_fd(), &orphans);
        self.next_service_id = max_sid.wrapping_add(1).max(1);
        self.next_backend_id = backend_table.keys().max().copied().unwrap_or(0).wrapping_add(1).max(1);
    }

    /// What the maps hold, in the planner's terms.
    pub fn state(&self) -> State {
        self.programmed.iter().map(|(fe, p)| (*fe, p.backends.iter().copied().collect())).collect()
    }

    /// Applies a plan. Each frontend is written completely or not at all;
    /// the ones that failed are returned and the rest is applied.
    pub fn apply(&mut self, plan: &Plan) -> Vec<ApplyError> {
        let mut errors = Vec::new();
        // Deletes first: they free room for the upserts.
        self.delete_all(&plan.deletes);
        let mut chunk = Chunk::default();
        let mut i = 0;
        while i < plan.upserts.len() {
            let (fe, backends) = &plan.upserts[i];
            // A frontend listed twice is written twice, in order.
            if chunk.frontends.contains(fe) {
                self.flush(&mut chunk, &mut errors);
            }
            match self.stage(&mut chunk, fe, backends) {
                Ok(()) => i += 1,
                // Full only beside the chunk's own entries (old generations
                // not yet deleted): write the chunk, then try again.
                Err(WriteError::Full { .. }) if !chunk.staged.is_empty() => self.flush(&mut chunk, &mut errors),
                Err(error) => {
                    errors.push(ApplyError { frontend: *fe, error });
                    i += 1;
                }
            }
            if chunk.slot_keys.len() >= CHUNK_SLOTS || chunk.staged.len() >= CHUNK_FRONTENDS {
                self.flush(&mut chunk, &mut errors);
            }
        }
        self.flush(&mut chunk, &mut errors);
        errors
    }

    /// Reserves ids and room for one frontend in `chunk` and queues its
    /// entries. Nothing is written and nothing changes but the id sets, so
    /// an error leaves the writer as it was.
    fn stage(&mut self, chunk: &mut Chunk, fe: &Frontend, backends: &[Backend]) -> Result<(), WriteError> {
        let old = self.programmed.get(fe);
        let n = u32::try_from(backends.len()).unwrap_or(u32::MAX);

        // Room as the maps will hold it while the chunk is written: the
        // entries of the chunk's earlier frontends are in, their old
        // generations not yet out. With an empty chunk this is exactly the
        // one-at-a-time check.
        if old.is_none() {
            let used = self.programmed.len() as u32 + chunk.new_services;
            if used >= self.max_services {
                return Err(full(self.names[0], used, self.max_services, 1));
            }
        }
        let used_slots = self.slots_used.saturating_add(chunk.slot_keys.len() as u32);
        if used_slots.saturating_add(n) > self.max_slots {
            return Err(full(self.names[1], used_slots, self.max_slots, n));
        }
        let new_backends =
            backends.iter().filter(|b| !self.backend_ids.contains_key(b) && !chunk.created_ids.contains_key(b)).count() as u32;
        let used_backends = (self.backend_ids.len() + chunk.created.len()) as u32;
        if used_backends.saturating_add(new_backends) > self.max_backends {
            return Err(full(self.names[2], used_backends, self.max_backends, new_backends));
        }

        let service_id = if let Some(p) = old {
            p.value.service_id
        } else {
            let set = &self.service_id_set;
            Self::alloc_id(&mut self.next_service_id, |id| set.contains(&id), "service")?
        };
        let generation = old.map_or(1, |p| p.value.generation.wrapping_add(1));
        let created_before = chunk.created.len();
        let mut ids = Vec::with_capacity(backends.len());
        for b in backends {
            let id = if let Some(id) = self.backend_ids.get(b).map(|(id, _)| *id).or_else(|| chunk.created_ids.get(b).copied()) {
                id
            } else {
                let set = &self.backend_id_set;
                match Self::alloc_id(&mut self.next_backend_id, |id| set.contains(&id), "backend") {
                    Ok(id) => {
                        self.backend_id_set.insert(id);
                        chunk.created.push((*b, id));
                        chunk.created_ids.insert(*b, id);
                        id
                    }
                    Err(e) => {
                        for (b, id) in chunk.created.drain(created_before..) {
                            chunk.created_ids.remove(&b);
                            self.backend_id_set.remove(&id);
                        }
                        return Err(e);
                    }
                }
            };
            ids.push(id);
        }
        if old.is_none() {
            self.service_id_set.insert(service_id);
            chunk.new_services += 1;
        }
        for (slot, backend_id) in ids.into_iter().enumerate() {
            chunk.slot_keys.push(SlotKey { service_id, generation, slot: slot as u32 });
            chunk.slot_values.push(SlotValue { backend_id });
        }
        chunk.service_keys.push(service_key(fe));
        chunk.service_values.push(ServiceValue { service_id, backend_count: n, generation, flags: 0 });
        chunk.staged.push(Staged { frontend: *fe, backends: backends.to_vec(), old: old.cloned() });
        chunk.frontends.insert(*fe);
        Ok(())
    }

    /// Writes a staged chunk: new backends, new slots, the switch, then the
    /// old generations. Empties `chunk`.
    fn flush(&mut self, chunk: &mut Chunk, errors: &mut Vec<ApplyError>) {
        let c = std::mem::take(chunk);
        if c.staged.is_empty() {
            return;
        }
        let backend_keys: Vec<BackendKey> = c.created.iter().map(|(_, id)| BackendKey { backend_id: *id }).collect();
        let backend_values: Vec<BackendValue> = c.created.iter().map(|(b, _)| backend_value(b)).collect();
        // (1) and (2) for the whole chunk, then (3): how many frontends
        // had their service entry written. The kernel applies a batch in
        // order and stops at the first failure, so those are a prefix.
        let switched = match bpf_batch::update(self.fds.backends.as_fd(), &backend_keys, &backend_values)
            .map_err(|e| (self.names[2], e))
            .and_then(|()| bpf_batch::update(self.fds.slots.as_fd(), &c.slot_keys, &c.slot_values).map_err(|e| (self.names[1], e)))
        {
            Err((map, e)) => {
                tracing::debug!(map, error = %e, "batch update failed; writing the chunk one frontend at a time");
                0
            }
            Ok(()) => match bpf_batch::update(self.fds.services.as_fd(), &c.service_keys, &c.service_values) {
                Ok(()) => c.staged.len(),
                Err(e) => {
                    tracing::debug!(map = self.names[0], error = %e, "batch update failed; writing the rest of the chunk one frontend at a time");
                    e.applied.min(c.staged.len())
                }
            },
        };

        // Book-keeping for the frontends that switched: references on all
        // the new sets before any old one is dropped, so backends shared
        // with an old generation are never deleted.
        for (b, id) in &c.created {
            self.backend_ids.insert(*b, (*id, 0));
        }
        for st in &c.staged[..switched] {
            for b in &st.backends {
                if let Some(e) = self.backend_ids.get_mut(b) {
                    e.1 += 1;
                }
            }
        }
        let mut dead = Dead::default();
        let mut retry = Vec::new();
        for (i, (st, value)) in c.staged.into_iter().zip(c.service_values).enumerate() {
            if i < switched {
                self.slots_used = self.slots_used.saturating_add(value.backend_count);
                self.programmed.insert(st.frontend, Programmed { value, backends: st.backends });
                if let Some(old) = &st.old {
                    self.drop_generation(old, &mut dead);
                }
            } else {
                // Not switched: its new slots go (some may be written), its
                // service id is free again unless the frontend had one
                // before, and it is written on its own below.
                dead.slots.extend((0..value.backend_count).map(|slot| SlotKey {
                    service_id: value.service_id,
                    generation: value.generation,
                    slot,
                }));
                if st.old.is_none() {
                    self.service_id_set.remove(&value.service_id);
                }
                retry.push((st.frontend, st.backends));
            }
        }
        // Backends created for frontends that did not switch.
        for (b, id) in &c.created {
            if self.backend_ids.get(b).is_some_and(|e| e.1 == 0) {
                self.backend_ids.remove(b);
                self.backend_id_set.remove(id);
                dead.backends.push(BackendKey { backend_id: *id });
            }
        }
        // (4) and (5). Before the retries: their ids may be reused.
        self.delete_dead(&dead);

        for (fe, backends) in retry {
            if let Err(error) = self.upsert(&fe, &backends) {
                errors.push(ApplyError { frontend: fe, error });
            }
        }
    }

    /// Removes frontends: their service entries, then their slots, then
    /// backends nobody uses any more.
    fn delete_all(&mut self, frontends: &[Frontend]) {
        let mut keys = Vec::new();
        let mut olds = Vec::new();
        for fe in frontends {
            if let Some(old) = self.programmed.remove(fe) {
                self.service_id_set.remove(&old.value.service_id);
                keys.push(service_key(fe));
                olds.push((fe, old));
            }
        }
        for (i, e) in delete_keys(&mut self.services, self.fds.services.as_fd(), &keys) {
            tracing::warn!(frontend = %olds[i].0, error = %e, "removing service entry failed");
        }
        let mut dead = Dead::default();
        for (_, old) in &olds {
            self.drop_generation(old, &mut dead);
        }
        self.delete_dead(&dead);
    }

    /// Drops the references of an old generation that is no longer in use
    /// and queues what it leaves behind for deletion.
    fn drop_generation(&mut self, old: &Programmed, dead: &mut Dead) {
        let (service_id, generation) = (old.value.service_id, old.value.generation);
        dead.slots.extend((0..old.value.backend_count).map(|slot| SlotKey { service_id, generation, slot }));
        self.slots_used = self.slots_used.saturating_sub(old.value.backend_count);
        dead.backends.extend(self.unref_backends(old).into_iter().map(|backend_id| BackendKey { backend_id }));
    }

    /// Drops one reference from each backend of `old`; returns the ids of
    /// those nobody uses any more (forgotten here, still in the map).
    fn unref_backends(&mut self, old: &Programmed) -> Vec<u32> {
        let mut gone = Vec::new();
        for b in &old.backends {
            let last = match self.backend_ids.get_mut(b) {
                Some(e) => {
                    e.1 = e.1.saturating_sub(1);
                    (e.1 == 0).then_some(e.0)
                }
                None => None,
            };
            if let Some(id) = last {
                self.backend_ids.remove(b);
                self.backend_id_set.remove(&id);
                gone.push(id);
            }
        }
        gone
    }

    /// Slots first: a slot never names a backend that is gone.
    fn delete_dead(&mut self, dead: &Dead) {
        for (_, e) in delete_keys(&mut self.slots, self.fds.slots.as_fd(), &dead.slots) {
            tracing::debug!(map = self.names[1], error = %e, "removing a stale slot failed");
        }
        for (_, e) in delete_keys(&mut self.backends, self.fds.backends.as_fd(), &dead.backends) {
            tracing::debug!(map = self.names[2], error = %e, "removing an unused backend failed");
        }
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
            self.backend_ids.get(b).map(|(id, _)| *id).or_else(|| created.iter().find(|(c, _)| c == b).map(|(_, id)| *id)).unwrap_or(0)
        };
        let ids: Vec<u32> = backends.iter().map(id_of).collect();

        // (2) slots under a fresh generation
        let service_id = if let Some(p) = &old {
            p.value.service_id
        } else {
            let set = &self.service_id_set;
            match Self::alloc_id(&mut self.next_service_id, |id| set.contains(&id), "service") {
                Ok(id) => id,
                Err(e) => {
                    self.undo_backends(&created);
                    return Err(e);
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

    /// Drops an old generation: its slots, then backends nobody uses.
    fn release(&mut self, old: &Programmed) {
        self.undo_slots(old.value.service_id, old.value.generation, old.value.backend_count);
        self.slots_used = self.slots_used.saturating_sub(old.value.backend_count);
        for backend_id in self.unref_backends(old) {
            let _ = self.backends.remove(&BackendKey { backend_id });
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

/// Frontends whose entries are staged, not yet written.
#[derive(Default)]
struct Chunk {
    staged: Vec<Staged>,
    frontends: FastHashSet<Frontend>,
    service_keys: Vec<ServiceKey>,
    service_values: Vec<ServiceValue>,
    slot_keys: Vec<SlotKey>,
    slot_values: Vec<SlotValue>,
    /// Backends the chunk adds, with the ids reserved for them.
    created: Vec<(Backend, u32)>,
    created_ids: FastHashMap<Backend, u32>,
    /// Frontends of the chunk that are not in the maps yet.
    new_services: u32,
}

struct Staged {
    frontend: Frontend,
    backends: Vec<Backend>,
    old: Option<Programmed>,
}

/// Entries to delete once nothing refers to them.
#[derive(Default)]
struct Dead {
    slots: Vec<SlotKey>,
    backends: Vec<BackendKey>,
}

/// Bounds on a chunk: they keep the staging buffers small and, for a
/// plan that rewrites existing frontends, the old generations the maps
/// must hold beside the new ones at a time. A cold sync of 10,000
/// frontends x 10 backends takes two chunks.
const CHUNK_SLOTS: usize = 65_536;
const CHUNK_FRONTENDS: usize = 16_384;

/// Deletes `keys` from a map, in one batch call where the kernel takes it
/// and one at a time from where it did not. A key that is already gone is
/// fine. Returns the keys that could not be deleted, by index.
fn delete_keys<K: aya::Pod, V: aya::Pod>(
    map: &mut HashMap<MapData, K, V>,
    fd: std::os::fd::BorrowedFd<'_>,
    keys: &[K],
) -> Vec<(usize, MapError)> {
    let from = match bpf_batch::delete(fd, keys) {
        Ok(()) => return Vec::new(),
        Err(e) => e.applied.min(keys.len()),
    };
    keys[from..]
        .iter()
        .enumerate()
        .filter_map(|(i, k)| match map.remove(k) {
            Err(e) if !is_not_found(&e) => Some((from + i, e)),
            _ => None,
        })
        .collect()
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
