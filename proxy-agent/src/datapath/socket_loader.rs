//! Installing the socket programs: maps pinned under the pin directory,
//! programs attached to the cgroup through pinned bpf_links, and adoption of
//! whatever an earlier agent pinned there.
//!
//! Restart without a gap works like this: maps are pinned by name, so a new
//! agent's programs use the very same maps (aya reuses a pinned map at
//! `map_pin_path` instead of creating one). The new programs are attached
//! *before* the old links go away; for a short while both run, which is
//! harmless because the second program sees an already translated backend
//! address, finds no frontend and passes. The new link is pinned beside the
//! old one and renamed over it; the rename drops the last reference to the
//! old link, which detaches it (kernel/bpf/inode.c: links live while pinned
//! or open).

use std::fs;
use std::io;
use std::mem::size_of;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use aya::maps::{Array, MapInfo, MapType};
use aya::programs::links::{FdLink, PinnedLink};
use aya::programs::{CgroupAttachMode, CgroupSockAddr};
use aya::{Ebpf, EbpfLoader};
use proxy_common as pc;

use crate::datapath::mounts;
use crate::util::error_chain::error_chain;

/// The eBPF object, built by build.rs from the `proxy-ebpf` crate.
pub(crate) static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/proxy-ebpf"));

/// Socket programs, by function name in the object.
pub const PROGRAMS: [&str; 8] = ["connect4", "connect6", "sendmsg4", "sendmsg6", "recvmsg4", "recvmsg6", "getpeername4", "getpeername6"];

/// Sub-directory of the pin directory that holds the program links.
pub const LINKS_DIR: &str = "links";

/// Map capacities (`max_entries`). They apply when a map is created; a map
/// adopted from a pin keeps the size it was created with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capacities {
    pub services: u32,
    pub slots: u32,
    pub backends: u32,
    pub sock_revnat: u32,
    /// `NP_CT`, the TC datapath's connection tracking (LRU).
    pub np_conntrack: u32,
}

impl Default for Capacities {
    fn default() -> Self {
        Capacities {
            services: pc::DEFAULT_MAX_SERVICES,
            slots: pc::DEFAULT_MAX_SLOTS,
            backends: pc::DEFAULT_MAX_BACKENDS,
            sock_revnat: pc::DEFAULT_MAX_SOCK_REVNAT,
            np_conntrack: pc::DEFAULT_MAX_NP_CT,
        }
    }
}

/// What each pinned map must look like for this agent to adopt it.
struct MapSpec {
    name: &'static str,
    map_type: MapType,
    key_size: usize,
    value_size: usize,
    flag: &'static str,
}

const MAPS: [MapSpec; 7] = [
    MapSpec {
        name: pc::SERVICES_MAP,
        map_type: MapType::Hash,
        key_size: size_of::<pc::ServiceKey>(),
        value_size: size_of::<pc::ServiceValue>(),
        flag: "--max-services",
    },
    MapSpec {
        name: pc::SLOTS_MAP,
        map_type: MapType::Hash,
        key_size: size_of::<pc::SlotKey>(),
        value_size: size_of::<pc::SlotValue>(),
        flag: "--max-slots",
    },
    MapSpec {
        name: pc::BACKENDS_MAP,
        map_type: MapType::Hash,
        key_size: size_of::<pc::BackendKey>(),
        value_size: size_of::<pc::BackendValue>(),
        flag: "--max-backends",
    },
    MapSpec {
        name: pc::SOCK_REVNAT_MAP,
        map_type: MapType::LruHash,
        key_size: size_of::<pc::SockRevNatKey>(),
        value_size: size_of::<pc::SockRevNatValue>(),
        flag: "--max-sock-revnat",
    },
    MapSpec { name: pc::COUNTERS_MAP, map_type: MapType::PerCpuArray, key_size: 4, value_size: 8, flag: "" },
    // Socket-local storage: its elements live on the sockets, so the pinned
    // map must survive restarts for sockets opened before one to keep their
    // reverse translation. The kernel requires max_entries 0 for it.
    MapSpec { name: pc::SOCK_PEER_MAP, map_type: MapType::SkStorage, key_size: 4, value_size: size_of::<pc::SockPeerValue>(), flag: "" },
    MapSpec { name: pc::SOCK_CONFIG_MAP, map_type: MapType::Array, key_size: 4, value_size: size_of::<pc::SockConfig>(), flag: "" },
];

/// Names of the socket programs' maps (every one is pinned).
pub fn socket_map_names() -> impl Iterator<Item = &'static str> {
    MAPS.iter().map(|m| m.name)
}

/// The `--max-*` flag that sizes a map, for error messages.
pub fn capacity_flag(map: &str) -> &'static str {
    MAPS.iter().find(|m| m.name == map).map_or("", |m| m.flag)
}

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(transparent)]
    Mount(#[from] mounts::MountError),
    #[error(
        "pinned map {path} does not match this agent ({what}); it was made by an incompatible version. Run `proxy-agent reset` with the same --bpffs to remove it (traffic to Services stops until the agent programs the maps again)"
    )]
    IncompatiblePin { path: PathBuf, what: String },
    #[error("cannot inspect pinned map {path}: {source}")]
    Inspect { path: PathBuf, source: aya::maps::MapError },
    #[error("loading the eBPF object failed: {0}")]
    Object(#[from] aya::EbpfError),
    #[error("program {program} is missing from the eBPF object")]
    MissingProgram { program: &'static str },
    #[error(
        "program {program}: {source}. cgroup socket programs need Linux >= 5.18 (bpf_set_retval) and bpf_link support; see the README's requirements"
    )]
    Program { program: &'static str, source: aya::programs::ProgramError },
    #[error("program {program}: cannot use a bpf_link ({source}); Linux >= 5.7 is required for pinned cgroup links")]
    Link { program: &'static str, source: aya::programs::links::LinkError },
    #[error("program {program}: cannot pin its link at {path}: {reason}")]
    Pin { program: &'static str, path: PathBuf, reason: String },
    #[error("map {map} is missing from the eBPF object")]
    MissingMap { map: &'static str },
    #[error("cannot record the sockets an older agent version translated (SOCK_CONFIG): {0}")]
    LegacyConfig(io::Error),
    #[error("cannot open cgroup {path}: {source}")]
    Cgroup { path: PathBuf, source: io::Error },
    #[error("cannot remove {path}: {source}")]
    Remove { path: PathBuf, source: io::Error },
}

/// Installs (or adopts and upgrades) the datapath. Returns warnings that do
/// not stop the agent, e.g. a pinned map whose capacity differs from the one
/// requested.
pub fn install(cgroup: &Path, pin_dir: &Path, caps: Capacities) -> Result<Vec<String>, LoadError> {
    mounts::ensure_pin_dir(pin_dir)?;
    let warnings = check_pinned_maps(pin_dir, caps)?;
    // A datapath pinned by an agent version without SOCK_PEER has reverse
    // entries only in SOCK_REVNAT (see `SockConfig`).
    let legacy_revnat = pin_dir.join(pc::SOCK_REVNAT_MAP).exists() && !pin_dir.join(pc::SOCK_PEER_MAP).exists();

    let pins: Vec<(&str, PathBuf)> = MAPS.iter().map(|m| (m.name, pin_dir.join(m.name))).collect();
    let mut loader = EbpfLoader::new();
    for (name, path) in &pins {
        loader.map_pin_path(name, path.as_path());
    }
    // The TC programs' maps live in the same object; pin them too so that the
    // TC loader (tc_loader.rs) and this one share a single copy.
    let np_pins = crate::datapath::tc_loader::np_map_pins(pin_dir);
    for (name, path) in &np_pins {
        loader.map_pin_path(name, path.as_path());
    }
    loader
        .map_max_entries(pc::SERVICES_MAP, caps.services)
        .map_max_entries(pc::SLOTS_MAP, caps.slots)
        .map_max_entries(pc::BACKENDS_MAP, caps.backends)
        .map_max_entries(pc::SOCK_REVNAT_MAP, caps.sock_revnat)
        // The TC datapath's copies follow the same limits (hash maps are
        // preallocated, so unused capacity costs memory).
        .map_max_entries(pc::NP_SERVICES_MAP, caps.services)
        .map_max_entries(pc::NP_FLAGS_MAP, caps.services)
        .map_max_entries(pc::NP_SLOTS_MAP, caps.slots)
        .map_max_entries(pc::NP_BACKENDS_MAP, caps.backends)
        .map_max_entries(pc::NP_CT_MAP, caps.np_conntrack);
    let mut ebpf: Ebpf = loader.load(EBPF_OBJECT)?;

    let cg = fs::File::open(cgroup).map_err(|source| LoadError::Cgroup { path: cgroup.into(), source })?;
    let links = pin_dir.join(LINKS_DIR);
    fs::create_dir_all(&links).map_err(|source| mounts::MountError::Create { path: links.clone(), source })?;

    for program in PROGRAMS {
        let prog: &mut CgroupSockAddr = ebpf
            .program_mut(program)
            .ok_or(LoadError::MissingProgram { program })?
            .try_into()
            .map_err(|source| LoadError::Program { program, source })?;
        prog.load().map_err(|source| LoadError::Program { program, source })?;
        // The old and the new program must be attached at the same time
        // during an upgrade. bpf_link attachments always coexist like
        // BPF_F_ALLOW_MULTI ones, and BPF_LINK_CREATE rejects any flag
        // (kernel/bpf/cgroup.c:cgroup_bpf_link_attach), hence the default mode.
        let id = prog.attach(&cg, CgroupAttachMode::default()).map_err(|source| LoadError::Program { program, source })?;
        let link = prog.take_link(id).map_err(|source| LoadError::Program { program, source })?;
        let link: FdLink = link.try_into().map_err(|source| LoadError::Link { program, source })?;
        let final_path = links.join(program);
        // bpffs refuses names with a dot (kernel/bpf/inode.c:bpf_lookup).
        let staging = links.join(format!("{program}-next"));
        let _ = fs::remove_file(&staging); // left over by an agent killed mid-install
        let pin_err = |reason: String| LoadError::Pin { program, path: final_path.clone(), reason };
        let pinned = link.pin(&staging).map_err(|e| pin_err(error_chain(&e)))?;
        // rename(2) replaces the old pin atomically; bpffs implements it
        // with simple_rename.
        fs::rename(&staging, &final_path).map_err(|e| pin_err(e.to_string()))?;
        drop(pinned); // the pin keeps the link attached
    }
    if legacy_revnat {
        // The old programs are detached now (their pins were replaced), so
        // the sockets they translated are the ones with entries in
        // SOCK_REVNAT, and no more appear.
        let below = legacy_cookie_bound(&ebpf).map_err(LoadError::LegacyConfig)?;
        let map = ebpf.map_mut(pc::SOCK_CONFIG_MAP).ok_or(LoadError::MissingMap { map: pc::SOCK_CONFIG_MAP })?;
        let mut config: Array<_, pc::SockConfig> = Array::try_from(map).map_err(|e| LoadError::LegacyConfig(io::Error::other(e)))?;
        config.set(0, pc::SockConfig { legacy_revnat_cookie_below: below }, 0).map_err(|e| LoadError::LegacyConfig(io::Error::other(e)))?;
    }
    Ok(warnings)
}

/// One above every cookie of a socket an older agent version translated:
/// above the largest cookie with a `SOCK_REVNAT` entry (those sockets are
/// the ones whose replies need it).
///
/// "The cookie the next socket gets" is no such bound: kernels that hand
/// out socket cookies in per-CPU batches of 4096 (`gen_cookie_next`,
/// include/linux/cookie.h; Debian's 6.12 does, found by the upgrade test
/// under vmtest) give a fresh socket on one CPU a cookie below those
/// already given on another. A fresh socket's cookie is
/// taken into account as well, so that on kernels with one global counter
/// an entry whose write raced with the detach is still covered. A bound
/// that is too high only makes a few new UDP sockets look in SOCK_REVNAT
/// for an entry that is not there.
fn legacy_cookie_bound(ebpf: &Ebpf) -> io::Result<u64> {
    let map = ebpf.map(pc::SOCK_REVNAT_MAP).ok_or_else(|| io::Error::other("SOCK_REVNAT is missing from the object"))?;
    let revnat: aya::maps::HashMap<_, pc::SockRevNatKey, pc::SockRevNatValue> =
        aya::maps::HashMap::try_from(map).map_err(io::Error::other)?;
    let largest = crate::datapath::bpf_batch::read_all(&revnat).iter().map(|(k, _)| k.cookie).max();
    Ok(largest.unwrap_or(0).max(next_socket_cookie()?) + 1)
}

/// The cookie of a fresh socket.
fn next_socket_cookie() -> io::Result<u64> {
    // SAFETY: socket(2) returns a new descriptor that we own, or -1.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is open and owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    socket_cookie(fd.as_fd())
}

/// A socket's cookie, as `bpf_get_socket_cookie` sees it (SO_COOKIE hands
/// out the same one, `net/core/sock.c`).
pub fn socket_cookie(socket: BorrowedFd<'_>) -> io::Result<u64> {
    let mut cookie: u64 = 0;
    let mut len = size_of::<u64>() as libc::socklen_t;
    // SAFETY: SO_COOKIE writes a u64 into the buffer we pass with its size.
    let rc = unsafe { libc::getsockopt(socket.as_raw_fd(), libc::SOL_SOCKET, libc::SO_COOKIE, (&raw mut cookie).cast(), &raw mut len) };
    if rc == 0 { Ok(cookie) } else { Err(io::Error::last_os_error()) }
}

fn check_pinned_maps(pin_dir: &Path, caps: Capacities) -> Result<Vec<String>, LoadError> {
    let mut warnings = Vec::new();
    for m in &MAPS {
        let path = pin_dir.join(m.name);
        if !path.exists() {
            continue;
        }
        let info = MapInfo::from_pin(&path).map_err(|source| LoadError::Inspect { path: path.clone(), source })?;
        let incompatible = |what: String| LoadError::IncompatiblePin { path: path.clone(), what };
        let ty = info.map_type().map_err(|source| LoadError::Inspect { path: path.clone(), source })?;
        if ty != m.map_type {
            return Err(incompatible(format!("type {ty:?}, expected {:?}", m.map_type)));
        }
        if info.key_size() as usize != m.key_size || info.value_size() as usize != m.value_size {
            return Err(incompatible(format!(
                "key/value size {}/{}, expected {}/{}",
                info.key_size(),
                info.value_size(),
                m.key_size,
                m.value_size
            )));
        }
        let wanted = match m.name {
            pc::SERVICES_MAP => caps.services,
            pc::SLOTS_MAP => caps.slots,
            pc::BACKENDS_MAP => caps.backends,
            pc::SOCK_REVNAT_MAP => caps.sock_revnat,
            _ => info.max_entries(),
        };
        if wanted != info.max_entries() {
            warnings.push(format!(
                "map {} was created with {} entries and is kept at that size to keep traffic flowing; {} {} takes effect after `proxy-agent reset`",
                m.name,
                info.max_entries(),
                m.flag,
                wanted
            ));
        }
    }
    Ok(warnings)
}

/// Removes everything `install` created under `pin_dir`: links first (which
/// detaches the programs), then maps. Missing pieces are fine, so reset is
/// idempotent.
pub fn reset(pin_dir: &Path) -> Result<(), LoadError> {
    let links = pin_dir.join(LINKS_DIR);
    if let Ok(rd) = fs::read_dir(&links) {
        for entry in rd.flatten() {
            let path = entry.path();
            match PinnedLink::from_pin(&path) {
                // Unpinning drops the last reference: the link detaches.
                Ok(link) => {
                    link.unpin().map_err(|source| LoadError::Remove { path: path.clone(), source })?;
                }
                Err(_) => remove(&path)?,
            }
        }
        remove_dir(&links)?;
    }
    for m in &MAPS {
        remove(&pin_dir.join(m.name))?;
    }
    crate::datapath::tc_loader::reset(pin_dir).map_err(|(path, source)| LoadError::Remove { path, source })?;
    remove_dir(pin_dir)
}

fn remove(path: &Path) -> Result<(), LoadError> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(LoadError::Remove { path: path.into(), source: e }),
        _ => Ok(()),
    }
}

fn remove_dir(path: &Path) -> Result<(), LoadError> {
    match fs::remove_dir(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(LoadError::Remove { path: path.into(), source: e }),
        _ => Ok(()),
    }
}
