//! The programs' port bitmaps ([`Bitmap`]): `NP_PORTS` for the TC programs
//! and `SOCK_PORTS` for the socket programs (layouts: `NP_PORTS_MAP` and
//! `SOCK_PORTS_MAP` in proxy-common). A packet or a connect() whose port
//! has no bit passes before the programs do any hash lookup, so a bit must
//! be set whenever an entry the programs look up for that port exists.
//!
//! `SOCK_PORTS` holds the destination ports of the `SERVICES` keys:
//!
//! * [`fill_socket_from_services`], before the socket programs are
//!   attached (also over older pins without the bitmap): every port of the
//!   pinned `SERVICES`.
//! * [`PortBits::add`], by the socket map writer before it writes a
//!   frontend's service entry, and [`PortBits::keep_only`] after it deleted
//!   frontends, with the ports of the frontends it still holds.
//!
//! Who sets and clears the bits of `NP_PORTS`, and why that keeps every
//! entry covered:
//!
//! * [`fill_from_maps`], before the TC programs are attached (also on an
//!   upgrade over older pins that had no bitmap): every port the pinned
//!   `NP_SERVICES`, `NP_BACKENDS` and `NP_CT` use. Programs attached
//!   earlier (an older version, without the bitmap) may create conntrack
//!   entries meanwhile, but only for frontends and backends in those maps.
//! * [`PortBits::claim`], by the NodePort writer before it writes frontends
//!   and backends: the ports of what it is about to write and of what it
//!   holds. The claim is also what the GC must keep.
//! * [`PortBits::clear_unused`], by the conntrack GC after a sweep: a bit
//!   goes only when no claimed port, no frontend or backend in the maps and
//!   no `NP_CT` entry left after the sweep uses it. The programs create
//!   conntrack entries only for ports of frontends and backends in the maps
//!   (forward and SNAT legs, replies) or for ports the bitmap does not
//!   gate (SNAT ports, see `may_be_snat_reply`; port 0, always set), so an
//!   entry created after the GC read `NP_CT` uses a claimed port, unless
//!   the claim changed meanwhile: then the GC skips this round.
//!
//! Setting and clearing are read-modify-writes of whole words from user
//! space, so the writers, the GC and the start-up fills take one lock per
//! map in this process (one agent owns a pin directory); the programs only
//! read words, and a word changes in one `bpf_map_update_elem`.

use std::collections::HashMap as StdHashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, PoisonError};

use aya::maps::{Array, HashMap, Map, MapData, MapError};
use proxy_common as pc;
use proxy_common::{BackendKey, BackendValue, CtKey, CtValue, ServiceKey, ServiceValue};

use crate::datapath::loader::pins;
use crate::datapath::maps::bpf_batch::read_all;

/// Why a port bitmap could not be filled or written.
#[derive(Debug, thiserror::Error)]
pub enum PortBitsError {
    /// The bitmap's pin could not be opened.
    #[error("port bitmap: cannot open pinned map {path}: {source}")]
    Open {
        /// The pin.
        path: PathBuf,
        /// The error.
        source: MapError,
    },
    /// A map the ports are gathered from could not be read.
    #[error("port bitmap: reading {map}: {source}")]
    Read {
        /// The map.
        map: &'static str,
        /// The error.
        source: MapError,
    },
    /// A word of the bitmap could not be written.
    #[error("port bitmap: writing word {word} of {map}: {source}")]
    Write {
        /// The bitmap.
        map: &'static str,
        /// The word's index.
        word: u32,
        /// The error.
        source: MapError,
    },
}

/// Which programs' port bitmap.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bitmap {
    /// `NP_PORTS`: ingress and egress ports of the TC programs.
    Tc,
    /// `SOCK_PORTS`: destination ports of the socket programs' frontends,
    /// laid out as `NP_PORTS`' ingress half.
    Socket,
}

impl Bitmap {
    /// The bitmap's map name (its pin under the pin directory).
    pub const fn map_name(self) -> &'static str {
        match self {
            Bitmap::Tc => pc::NP_PORTS_MAP,
            Bitmap::Socket => pc::SOCK_PORTS_MAP,
        }
    }

    /// Words in the map.
    pub const fn words(self) -> usize {
        match self {
            Bitmap::Tc => pc::NP_PORTS_ENTRIES as usize,
            Bitmap::Socket => pc::SOCK_PORTS_ENTRIES as usize,
        }
    }
}

/// A set of ports per direction, laid out as `NP_PORTS` is, or of
/// destination ports only, laid out as `SOCK_PORTS` is (its ingress
/// direction).
#[derive(Clone, PartialEq, Eq)]
pub struct PortSet {
    words: Vec<u64>,
}

impl Default for PortSet {
    fn default() -> Self {
        PortSet::empty(Bitmap::Tc)
    }
}

impl std::fmt::Debug for PortSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (i, e) = self.counts();
        write!(f, "PortSet {{ ingress: {i} ports, egress: {e} ports }}")
    }
}

impl PortSet {
    /// No port, laid out as `bitmap` is.
    pub fn empty(bitmap: Bitmap) -> PortSet {
        PortSet { words: vec![0; bitmap.words()] }
    }

    /// The ports every datapath needs: port 0 at egress, the source of the
    /// node's own refusal of a flow to a frontend without backends (the
    /// programs DNAT it to port 0 of the node, see `no_backend` in
    /// proxy-ebpf/src/programs/nodeport.rs, and translate the answer back).
    pub fn base() -> PortSet {
        let mut s = PortSet::default();
        s.insert(0, true);
        s
    }

    /// Adds a port (host byte order) for one direction.
    /// A set laid out as `SOCK_PORTS` has no egress words: an egress port
    /// is not added to it.
    pub fn insert(&mut self, port: u16, egress: bool) {
        let (word, mask) = pc::np_port_bit(port, egress);
        if let Some(w) = self.words.get_mut(word as usize) {
            *w |= mask;
        }
    }

    /// Whether the set holds a port (host byte order) for one direction.
    pub fn contains(&self, port: u16, egress: bool) -> bool {
        let (word, mask) = pc::np_port_bit(port, egress);
        self.words.get(word as usize).is_some_and(|w| w & mask != 0)
    }

    /// A socket frontend's destination port (host byte order), in a set
    /// laid out as `SOCK_PORTS` is.
    pub fn insert_socket(&mut self, port_host: u16) {
        let (word, mask) = pc::sock_port_bit(port_host);
        if let Some(w) = self.words.get_mut(word as usize) {
            *w |= mask;
        }
    }

    /// Whether the set, laid out as `SOCK_PORTS` is, holds a socket frontend's port.
    pub fn contains_socket(&self, port_host: u16) -> bool {
        let (word, mask) = pc::sock_port_bit(port_host);
        self.words.get(word as usize).is_some_and(|w| w & mask != 0)
    }

    /// A frontend's port: new flows and forward entries are looked up at
    /// ingress by it.
    pub fn insert_frontend(&mut self, port: u16) {
        self.insert(port, false);
    }

    /// A backend's port: its replies (source port) and the SNAT'ed forward
    /// legs to it (destination port) are looked up at egress by it.
    pub fn insert_backend(&mut self, port: u16) {
        self.insert(port, true);
    }

    /// The ports the programs look an `NP_CT` entry up by, in the direction
    /// they look it up (see `port_in_use` in proxy-ebpf/src/programs/nodeport.rs).
    /// SNAT reply entries are found through the SNAT range, not the bitmap.
    pub fn insert_conntrack(&mut self, k: &CtKey) {
        match k.dir {
            pc::CT_DIR_FORWARD => self.insert(u16::from_be(k.dport_be), false),
            pc::CT_DIR_REPLY => self.insert(u16::from_be(k.sport_be), true),
            pc::CT_DIR_SNAT => self.insert(u16::from_be(k.dport_be), true),
            _ => {}
        }
    }

    /// A set from `NP_PORTS`' words as read; `None` when there are not
    /// exactly `NP_PORTS_ENTRIES`.
    pub fn from_words(words: Vec<u64>) -> Option<PortSet> {
        (words.len() == pc::NP_PORTS_ENTRIES as usize).then_some(PortSet { words })
    }

    /// A set from a bitmap's words as read; `None` when there are not
    /// exactly as many as the map has.
    pub fn from_words_of(bitmap: Bitmap, words: Vec<u64>) -> Option<PortSet> {
        (words.len() == bitmap.words()).then_some(PortSet { words })
    }

    /// Whether every port of `other` is in this set too.
    pub fn covers(&self, other: &PortSet) -> bool {
        self.words.iter().zip(&other.words).all(|(a, b)| b & !a == 0)
    }

    /// Adds every port of `other`.
    pub fn union_with(&mut self, other: &PortSet) {
        for (a, b) in self.words.iter_mut().zip(&other.words) {
            *a |= b;
        }
    }

    /// Ports set (ingress, egress); a set laid out as `SOCK_PORTS` has
    /// ingress ports only.
    pub fn counts(&self) -> (usize, usize) {
        let half = (pc::NP_PORT_WORDS as usize).min(self.words.len());
        let ones = |w: &[u64]| w.iter().map(|x| x.count_ones() as usize).sum();
        (ones(&self.words[..half]), ones(&self.words[half..]))
    }
}

/// What the lock of one port bitmap guards.
#[derive(Default)]
struct Claims {
    /// The NodePort writer's last claim (`NP_PORTS` only); `None` until
    /// its first, and then
    /// the GC clears nothing (an agent that just started has not yet said
    /// what it keeps).
    ports: Option<PortSet>,
    /// Changes whenever the claimed set does.
    generation: u64,
    /// The map's words as last read or written under this lock (every
    /// write of this process takes it), so that a claim that adds nothing
    /// costs no syscall.
    known: Option<PortSet>,
}

type Shared = Arc<Mutex<Claims>>;

/// One lock per port bitmap in this process, by the map's kernel id
/// (every handle on the map shares it, whatever path opened it).
static REGISTRY: LazyLock<Mutex<StdHashMap<u32, Shared>>> = LazyLock::new(|| Mutex::new(StdHashMap::new()));

fn lock(s: &Shared) -> MutexGuard<'_, Claims> {
    // A panic while holding it can leave `known` behind the map (each word
    // write is one syscall, never torn): forget it and carry on.
    s.lock().unwrap_or_else(|poisoned| {
        let mut c = poisoned.into_inner();
        c.known = None;
        c
    })
}

/// One pinned port bitmap of one pin directory.
pub struct PortBits {
    pin_dir: PathBuf,
    bitmap: Bitmap,
    map: Array<MapData, u64>,
    shared: Shared,
}

impl PortBits {
    /// The pinned `NP_PORTS`.
    pub fn open(pin_dir: &Path) -> Result<PortBits, MapError> {
        Self::open_bitmap(pin_dir, Bitmap::Tc)
    }

    /// Opens one of the bitmaps pinned under `pin_dir`.
    pub fn open_bitmap(pin_dir: &Path, bitmap: Bitmap) -> Result<PortBits, MapError> {
        let data = MapData::from_pin(pins::map(pin_dir, bitmap.map_name()))?;
        let id = data.info()?.id();
        let map = Array::try_from(Map::Array(data))?;
        let shared = REGISTRY.lock().unwrap_or_else(PoisonError::into_inner).entry(id).or_default().clone();
        Ok(PortBits { pin_dir: pin_dir.to_path_buf(), bitmap, map, shared })
    }

    /// The map's words, from the kernel.
    fn read_map(&self) -> Result<PortSet, PortBitsError> {
        let mut s = PortSet::empty(self.bitmap);
        let map = self.bitmap.map_name();
        for (i, w) in s.words.iter_mut().enumerate() {
            *w = self.map.get(&(i as u32), 0).map_err(|source| PortBitsError::Read { map, source })?;
        }
        Ok(s)
    }

    /// Writes the words of `want` that differ from the map (`c.known`,
    /// read first when unknown); returns how many it wrote.
    fn write(&mut self, c: &mut Claims, want: impl Fn(usize, u64) -> u64) -> Result<usize, PortBitsError> {
        let mut have = match c.known.take() {
            Some(k) => k,
            None => self.read_map()?,
        };
        let mut written = 0;
        let mut result = Ok(());
        for (i, old) in have.words.iter_mut().enumerate() {
            let new = want(i, *old);
            if new != *old {
                let word = i as u32;
                if let Err(source) = self.map.set(word, new, 0) {
                    result = Err(PortBitsError::Write { map: self.bitmap.map_name(), word, source });
                    break;
                }
                *old = new;
                written += 1;
            }
        }
        c.known = Some(have);
        result.map(|()| written)
    }

    /// The NodePort writer's claim: every port of what it holds and of what
    /// it is about to write (plus [`PortSet::base`]). Sets their bits before
    /// it returns; the GC keeps them until the next claim.
    pub fn claim(&mut self, mut ports: PortSet) -> Result<(), PortBitsError> {
        ports.union_with(&PortSet::base());
        let shared = self.shared.clone();
        let mut c = lock(&shared);
        self.write(&mut c, |i, old| old | ports.words[i])?;
        if c.ports.as_ref() != Some(&ports) {
            c.generation += 1;
            c.ports = Some(ports);
        }
        Ok(())
    }

    /// Sets the bits of `ports` (laid out as this map is) before it
    /// returns; returns how many words it wrote (none when every bit was
    /// set already as far as this process knows, without a syscall).
    pub fn add(&mut self, ports: &PortSet) -> Result<usize, PortBitsError> {
        let shared = self.shared.clone();
        let mut c = lock(&shared);
        self.write(&mut c, |i, old| old | ports.words.get(i).copied().unwrap_or(0))
    }

    /// Clears every bit not in `keep` (laid out as this map is); returns
    /// how many ports it cleared. For a map whose only writer holds every
    /// entry the programs look up (`SOCK_PORTS` and the socket map writer).
    pub fn keep_only(&mut self, keep: &PortSet) -> Result<usize, PortBitsError> {
        let shared = self.shared.clone();
        let mut c = lock(&shared);
        let before = match c.known.take() {
            Some(k) => k,
            None => self.read_map()?,
        };
        let cleared = before.words.iter().zip(&keep.words).map(|(h, k)| (h & !k).count_ones() as usize).sum();
        c.known = Some(before);
        self.write(&mut c, |i, old| old & keep.words.get(i).copied().unwrap_or(0))?;
        Ok(cleared)
    }

    /// Ports set (ingress, egress) as this process last read or wrote the
    /// map; `None` before it did.
    pub fn known_counts(&self) -> Option<(usize, usize)> {
        lock(&self.shared).known.as_ref().map(PortSet::counts)
    }

    /// The claim's generation, read before the GC reads `NP_CT`.
    pub fn generation(&self) -> u64 {
        lock(&self.shared).generation
    }

    /// Clears the bits no claimed port, no frontend or backend in the pinned
    /// maps and no port of `conntrack` (the `NP_CT` entries a sweep left)
    /// uses. Nothing happens before the writer's first claim or when the
    /// claim changed since `generation`. Returns the ports cleared, or
    /// `None` when it skipped.
    pub fn clear_unused(&mut self, generation: u64, conntrack: &PortSet) -> Result<Option<usize>, PortBitsError> {
        let shared = self.shared.clone();
        let mut c = lock(&shared);
        let Some(claimed) = c.ports.as_ref() else { return Ok(None) };
        if c.generation != generation {
            return Ok(None);
        }
        let mut used = in_maps(&self.pin_dir)?;
        used.union_with(claimed);
        used.union_with(conntrack);
        used.union_with(&PortSet::base());
        // Read afresh: the GC is the one place that corrects a cache gone
        // wrong (another process writing the map).
        c.known = None;
        let before = self.read_map()?;
        c.known = Some(before.clone());
        self.write(&mut c, |i, old| old & used.words[i])?;
        Ok(Some(before.words.iter().zip(&used.words).map(|(h, u)| (h & !u).count_ones() as usize).sum()))
    }
}

fn open_hash<K: aya::Pod, V: aya::Pod>(pin_dir: &Path, name: &str, lru: bool) -> Result<HashMap<MapData, K, V>, PortBitsError> {
    // A map being migrated (`map_migration`) is read from its staged copy,
    // which holds the same entries in this build's layout (the pinned one
    // may have an earlier build's smaller values).
    let staged = pins::staged_map(pin_dir, name);
    let path = if staged.exists() { staged } else { pins::map(pin_dir, name) };
    let err = |source| PortBitsError::Open { path: path.clone(), source };
    let data = MapData::from_pin(&path).map_err(err)?;
    let map = if lru { Map::LruHashMap(data) } else { Map::HashMap(data) };
    HashMap::try_from(map).map_err(err)
}

/// The ports of the frontends in `NP_SERVICES` and the backends in
/// `NP_BACKENDS` pinned under `pin_dir`.
fn in_maps(pin_dir: &Path) -> Result<PortSet, PortBitsError> {
    let mut s = PortSet::default();
    let services = open_hash::<ServiceKey, ServiceValue>(pin_dir, pc::NP_SERVICES_MAP, false)?;
    for (k, _) in read_all(&services).map_err(|source| PortBitsError::Read { map: pc::NP_SERVICES_MAP, source })? {
        s.insert_frontend(u16::from_be(k.port_be));
    }
    let backends = open_hash::<BackendKey, BackendValue>(pin_dir, pc::NP_BACKENDS_MAP, false)?;
    for (_, v) in read_all(&backends).map_err(|source| PortBitsError::Read { map: pc::NP_BACKENDS_MAP, source })? {
        s.insert_backend(u16::from_be(v.port_be));
    }
    Ok(s)
}

fn open_bits(pin_dir: &Path, bitmap: Bitmap) -> Result<PortBits, PortBitsError> {
    PortBits::open_bitmap(pin_dir, bitmap).map_err(|source| PortBitsError::Open { path: pins::map(pin_dir, bitmap.map_name()), source })
}

/// Sets the bit of every port the pinned TC maps use: frontends, backends
/// and conntrack entries (see the module comment). Runs before the TC
/// programs are attached, so that new programs find every flow of the old
/// ones covered. Returns the ports set (ingress, egress).
pub fn fill_from_maps(pin_dir: &Path) -> Result<(usize, usize), PortBitsError> {
    let mut bits = open_bits(pin_dir, Bitmap::Tc)?;
    let mut want = in_maps(pin_dir)?;
    want.union_with(&PortSet::base());
    let ct = open_hash::<CtKey, CtValue>(pin_dir, pc::NP_CT_MAP, true)?;
    for (k, _) in read_all(&ct).map_err(|source| PortBitsError::Read { map: pc::NP_CT_MAP, source })? {
        want.insert_conntrack(&k);
    }
    let shared = bits.shared.clone();
    let mut c = lock(&shared);
    // From the kernel: the map may have been created just now, or written
    // by an earlier agent.
    c.known = None;
    bits.write(&mut c, |i, old| old | want.words[i])?;
    Ok(c.known.as_ref().map_or((0, 0), PortSet::counts))
}

/// Ports set in the `NP_PORTS` pinned under `pin_dir` (ingress, egress).
pub fn counts(pin_dir: &Path) -> Result<(usize, usize), PortBitsError> {
    Ok(open_bits(pin_dir, Bitmap::Tc)?.read_map()?.counts())
}

/// The destination ports of the frontends in the `SERVICES` pinned under
/// `pin_dir`, laid out as `SOCK_PORTS` is.
pub fn socket_ports_in_services(pin_dir: &Path) -> Result<PortSet, PortBitsError> {
    let services = open_hash::<ServiceKey, ServiceValue>(pin_dir, pc::SERVICES_MAP, false)?;
    let mut s = PortSet::empty(Bitmap::Socket);
    for (k, _) in read_all(&services).map_err(|source| PortBitsError::Read { map: pc::SERVICES_MAP, source })? {
        s.insert_socket(u16::from_be(k.port_be));
    }
    Ok(s)
}

/// Sets the bit of every destination port of the pinned `SERVICES` in
/// `SOCK_PORTS`. Runs before the socket programs are attached, so that new
/// programs find every frontend the old ones (or an agent version without
/// the bitmap) translated. Returns the ports set.
pub fn fill_socket_from_services(pin_dir: &Path) -> Result<usize, PortBitsError> {
    let mut bits = open_bits(pin_dir, Bitmap::Socket)?;
    let want = socket_ports_in_services(pin_dir)?;
    // From the kernel: the map may have been created just now, or written
    // by an earlier agent.
    lock(&bits.shared).known = None;
    bits.add(&want)?;
    Ok(bits.known_counts().map_or(0, |(n, _)| n))
}

/// Ports set in the `SOCK_PORTS` pinned under `pin_dir`.
pub fn socket_count(pin_dir: &Path) -> Result<usize, PortBitsError> {
    Ok(open_bits(pin_dir, Bitmap::Socket)?.read_map()?.counts().0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ct(dir: u8, sport: u16, dport: u16) -> CtKey {
        CtKey { sport_be: sport.to_be(), dport_be: dport.to_be(), dir, proto: pc::PROTO_TCP, family: pc::FAMILY_V4, ..Default::default() }
    }

    #[test]
    fn conntrack_entries_claim_the_port_their_lookup_uses() {
        // (entry direction, sport, dport, port expected, egress)
        let cases = [
            (pc::CT_DIR_FORWARD, 40000, 30080, Some((30080, false))),
            (pc::CT_DIR_REPLY, 8080, 40000, Some((8080, true))),
            (pc::CT_DIR_SNAT, 40000, 8080, Some((8080, true))),
            // Found through the SNAT range, not the bitmap.
            (pc::CT_DIR_REPLY_SNAT, 8080, 61000, None),
            (99, 1, 2, None),
        ];
        for (dir, sport, dport, want) in cases {
            let mut s = PortSet::default();
            s.insert_conntrack(&ct(dir, sport, dport));
            match want {
                Some((port, egress)) => {
                    assert!(s.contains(port, egress), "dir {dir}");
                    assert_eq!(s.counts(), if egress { (0, 1) } else { (1, 0) }, "dir {dir}: that port only");
                }
                None => assert_eq!(s.counts(), (0, 0), "dir {dir}"),
            }
        }
    }

    #[test]
    fn directions_and_word_edges_stay_apart() {
        let mut s = PortSet::base();
        for p in [1, 63, 64, 65535] {
            s.insert_frontend(p);
        }
        s.insert_backend(63);
        assert!(s.contains(0, true) && !s.contains(0, false), "port 0 at egress only");
        assert!(s.contains(63, false) && s.contains(63, true));
        assert!(s.contains(65535, false) && !s.contains(65535, true));
        assert!(!s.contains(62, false) && !s.contains(2, false));
        assert_eq!(s.counts(), (4, 2));
        let mut t = PortSet::default();
        t.insert_backend(443);
        t.union_with(&s);
        assert_eq!(t.counts(), (4, 3));
        assert_eq!(pc::np_port_bit(65535, true), (2047, 1 << 63));
        assert_eq!(pc::np_port_bit(64, false), (1, 1));
    }

    #[test]
    fn a_socket_set_has_one_bit_per_destination_port_and_no_egress_half() {
        let mut s = PortSet::empty(Bitmap::Socket);
        // (port, word, mask) in host byte order.
        let cases = [(0u16, 0u32, 1u64), (63, 0, 1 << 63), (80, 1, 1 << 16), (65535, 1023, 1 << 63)];
        for (port, word, mask) in cases {
            assert_eq!(pc::sock_port_bit(port), (word, mask), "port {port}");
            s.insert_socket(port);
            assert!(s.contains_socket(port), "port {port}");
        }
        assert!(!s.contains_socket(81) && !s.contains_socket(8080));
        // An egress port has nowhere to go in this layout.
        s.insert(443, true);
        assert!(!s.contains(443, true));
        assert_eq!(s.counts(), (4, 0));
        assert_eq!(PortSet::from_words_of(Bitmap::Socket, vec![0; pc::SOCK_PORTS_ENTRIES as usize]), Some(PortSet::empty(Bitmap::Socket)));
        assert_eq!(PortSet::from_words_of(Bitmap::Socket, vec![0; pc::NP_PORTS_ENTRIES as usize]), None);
    }
}
