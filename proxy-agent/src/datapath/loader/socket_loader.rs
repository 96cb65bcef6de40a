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

use aya::Ebpf;
use aya::maps::{Array, MapInfo};
use aya::programs::links::{FdLink, PinnedLink};
use aya::programs::{CgroupAttachMode, CgroupSock, CgroupSockAddr};
use proxy_common as pc;

use crate::datapath::loader::kernel_features::{self, KernelFeatures};
use crate::datapath::loader::object::{self, EBPF_OBJECT};
use crate::datapath::loader::{mounts, pins, tc_loader};
use crate::datapath::maps::bpf_batch;
use crate::datapath::maps::{self, MapSizes};
use crate::datapath::maps::{map_migration, port_bits};
use crate::datapath::sockets::{sock_rec_count, sock_rec_sweep};
use crate::util::error_chain::error_chain;

/// Socket programs, by function name in the object.
pub const PROGRAMS: [&str; 8] = ["connect4", "connect6", "sendmsg4", "sendmsg6", "recvmsg4", "recvmsg6", "getpeername4", "getpeername6"];

/// The `cgroup/sock_release` program that deletes a socket's `SOCK_REC`
/// record; its link is pinned under this name beside the others.
pub const RELEASE_PROGRAM: &str = "sock_release";

/// The programs built in a full and a compat variant (`<name>_compat`):
/// the ones that refuse calls and read the clock.
const VARIANT_PROGRAMS: [&str; 4] = ["connect4", "connect6", "sendmsg4", "sendmsg6"];

/// Why the socket datapath could not be installed (or reset).
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The pin directory or the cgroup is not usable.
    #[error(transparent)]
    Mount(#[from] mounts::MountError),
    /// A map pinned under the map's name has another type or key/value size: an incompatible agent
    /// version made it.
    #[error(
        "pinned map {path} does not match this agent ({what}); it was made by an incompatible version. Run `proxy-agent reset` with the same --bpffs to remove it (traffic to Services stops until the agent programs the maps again)"
    )]
    IncompatiblePin {
        /// The pin.
        path: PathBuf,
        /// What differs.
        what: String,
    },
    /// A pinned map's info could not be read.
    #[error("cannot inspect pinned map {path}: {source}")]
    Inspect {
        /// The pin.
        path: PathBuf,
        /// The error.
        source: aya::maps::MapError,
    },
    /// The object could not be loaded (a verifier rejection shows here).
    #[error("loading the eBPF object failed: {0}")]
    Object(#[from] aya::EbpfError),
    /// The object lacks a program this agent expects (a build mismatch).
    #[error("program {program} is missing from the eBPF object")]
    MissingProgram {
        /// The program.
        program: &'static str,
    },
    /// A program could not be loaded or attached.
    #[error("program {program}: {source}. See the README's kernel requirements")]
    Program {
        /// The program.
        program: &'static str,
        /// The error.
        source: aya::programs::ProgramError,
    },
    /// The kernel is below the floor or lacks a required feature ([`KernelFeatures::unsupported`]).
    #[error("{0}; nothing was installed")]
    Kernel(String),
    /// The program's attachment is not a bpf_link, which is what keeps it attached after the agent
    /// exits.
    #[error("program {program}: cannot use a bpf_link ({source}); Linux >= 5.7 is required for pinned cgroup links")]
    Link {
        /// The program.
        program: &'static str,
        /// The error.
        source: aya::programs::links::LinkError,
    },
    /// A link could not be pinned or moved over the old one.
    #[error("program {program}: cannot pin its link at {path}: {reason}")]
    Pin {
        /// The program.
        program: &'static str,
        /// The link's pin.
        path: PathBuf,
        /// The error.
        reason: String,
    },
    /// The object lacks a map this agent expects (a build mismatch).
    #[error("map {map} is missing from the eBPF object")]
    MissingMap {
        /// The map.
        map: &'static str,
    },
    /// `SOCK_CONFIG` could not be written for the sockets an older version translated.
    #[error("cannot record the sockets an older agent version translated (SOCK_CONFIG): {0}")]
    LegacyConfig(io::Error),
    /// `NODE_NETNS` could not be written.
    #[error("cannot record the node's network namespace (NODE_NETNS): {0}")]
    NodeNetns(io::Error),
    /// The cgroup to attach to could not be opened (`--cgroup`).
    #[error("cannot open cgroup {path}: {source}")]
    Cgroup {
        /// The cgroup.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
    /// A pin could not be removed (reset, or a staged pin left over).
    #[error("cannot remove {path}: {source}")]
    Remove {
        /// The pin.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
    /// A map's capacity could not be changed.
    #[error(transparent)]
    Migration(#[from] map_migration::MigrationError),
    /// `SOCK_PORTS` could not be filled.
    #[error(transparent)]
    PortBits(#[from] port_bits::PortBitsError),
}

/// Installs (or adopts and upgrades) the datapath. Returns warnings that do
/// not stop the agent, e.g. a pinned map whose capacity differs from the one
/// requested.
pub fn install(cgroup: &Path, pin_dir: &Path, caps: impl Into<MapSizes>) -> Result<Vec<String>, LoadError> {
    let caps: MapSizes = caps.into();
    // Before anything is pinned or attached: a kernel below the floor gets
    // one sentence, never half a datapath.
    let kernel = KernelFeatures::get();
    if let Some(why) = kernel.unsupported() {
        return Err(LoadError::Kernel(why));
    }
    let variant = kernel.socket_variant();
    mounts::ensure_pin_dir(pin_dir)?;
    let mut warnings = check_pinned_maps(pin_dir)?;
    // A datapath pinned by an agent version without SOCK_PEER has reverse
    // entries only in SOCK_REVNAT (see `SockConfig`).
    let legacy_revnat = pins::map(pin_dir, pc::SOCK_REVNAT_MAP).exists() && !pins::map(pin_dir, pc::SOCK_PEER_MAP).exists();

    // Maps whose capacity changes are created anew beside their pins and
    // filled from the old ones before any new program runs (see
    // `map_migration`).
    let (migrations, kept) = map_migration::plan(pin_dir, &caps);
    warnings.extend(kept);
    for m in &migrations {
        // Left over by an agent killed mid-migration: never adopted.
        remove(&pins::staged_map(pin_dir, m.spec.name))?;
    }
    let staged: Vec<&str> = migrations.iter().map(|m| m.spec.name).collect();
    // Every map of both datapaths, so that the TC loader (tc_loader.rs)
    // finds them pinned and both share a single copy.
    let mut ebpf = object::load_staged(EBPF_OBJECT, pin_dir, Some(&caps), &staged)?;
    let mut copied = Vec::new();
    for m in &migrations {
        copied.push(map_migration::copy(pin_dir, m, false)?);
    }
    // Before any program is attached or swapped in: the programs pass a
    // call whose port has no bit in SOCK_PORTS, so the bitmap must cover
    // every frontend the pinned SERVICES holds, also when it was just
    // created over the pins of an agent version without it. (A migrated
    // SERVICES is a copy of the pinned one, which the old programs still
    // use: same keys.)
    let ports = port_bits::fill_socket_from_services(pin_dir)?;
    tracing::debug!(ports, "SOCK_PORTS covers the pinned frontends");
    // Likewise SOCK_REC_COUNT must cover every record the pins hold before
    // the new release program runs, also when it was just created beside
    // the SOCK_REC of a build without it (see `sock_rec_count`).
    cover_uncounted(pin_dir, &mut warnings);

    let cg = fs::File::open(cgroup).map_err(|source| LoadError::Cgroup { path: cgroup.into(), source })?;
    let links = pins::links(pin_dir);
    fs::create_dir_all(&links).map_err(|source| mounts::MountError::Create { path: links.clone(), source })?;

    // The release program first: every socket that gets a SOCK_REC record
    // from the connect programs attached below is then released through
    // it, so no record outlives its socket. (During an upgrade the old and
    // the new release programs both run; a delete of a missing record is
    // a miss.)
    {
        let program = RELEASE_PROGRAM;
        let prog: &mut CgroupSock = ebpf
            .program_mut(program)
            .ok_or(LoadError::MissingProgram { program })?
            .try_into()
            .map_err(|source| LoadError::Program { program, source })?;
        prog.load().map_err(|source| LoadError::Program { program, source })?;
        let id = prog.attach(&cg, CgroupAttachMode::default()).map_err(|source| LoadError::Program { program, source })?;
        let link = prog.take_link(id).map_err(|source| LoadError::Program { program, source })?;
        let link: FdLink = link.try_into().map_err(|source| LoadError::Link { program, source })?;
        pin_link(link, pin_dir, program)?;
        tracing::debug!("release program attached");
    }
    for program in PROGRAMS {
        // The forward programs come in variants (see `KernelFeatures`); the
        // link keeps the base name, so an upgrade that changes the variant
        // still replaces the old link in place.
        let name = if VARIANT_PROGRAMS.contains(&program) { variant.program(program) } else { program.to_string() };
        let prog: &mut CgroupSockAddr = ebpf
            .program_mut(&name)
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
        pin_link(link, pin_dir, program)?;
    }
    // The old socket programs are detached: what they wrote into the LRU
    // maps since the first copy is added, then the new maps take the
    // pins. The TC programs move to them when tc_loader installs next.
    for (m, n) in migrations.iter().zip(&mut copied) {
        // The programs write the LRU maps, SOCK_REC and the counters too.
        if matches!(m.spec.map_type, aya::maps::MapType::LruHash | aya::maps::MapType::PerCpuArray) || m.spec.name == pc::SOCK_REC_MAP {
            *n += map_migration::copy(pin_dir, m, true)?;
        }
        map_migration::commit(pin_dir, m)?;
        warnings.push(m.describe(*n));
    }
    // Which sockets are the node's own processes: those of the agent's
    // network namespace (it runs with the host's network). Written at every
    // start, so a datapath adopted from another namespace follows.
    // Without SO_NETNS_COOKIE (Linux < 5.14) the entry stays 0, which the
    // programs read as "no socket is the node's" (see `NodeNetns`).
    if kernel.has(kernel_features::SO_NETNS_COOKIE) {
        let cookie = kernel_features::netns_cookie().map_err(LoadError::NodeNetns)?;
        let map = ebpf.map_mut(pc::NODE_NETNS_MAP).ok_or(LoadError::MissingMap { map: pc::NODE_NETNS_MAP })?;
        let mut node: Array<_, pc::NodeNetns> = Array::try_from(map).map_err(|e| LoadError::NodeNetns(io::Error::other(e)))?;
        node.set(0, pc::NodeNetns { netns_cookie: cookie }, 0).map_err(|e| LoadError::NodeNetns(io::Error::other(e)))?;
    } else {
        warnings.push(
            "the kernel has no SO_NETNS_COOKIE (Linux < 5.14): the node's own processes are not admitted to LoadBalancer IPs by loadBalancerSourceRanges"
                .to_string(),
        );
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
    // Again, now that the old programs are detached: the records they
    // wrote meanwhile, and the migrated copies, which the pins now hold.
    cover_uncounted(pin_dir, &mut warnings);
    tracing::debug!("socket programs attached; sweeping SOCK_REC");
    // The release program runs now, and the migrated maps hold their pins:
    // records of sockets released before either are deleted (see
    // `sock_rec_sweep`). A failed sweep only leaves slots taken.
    match sock_rec_sweep::sweep(pin_dir) {
        Ok(s) if s.deleted > 0 || s.counts.lowered > 0 => tracing::info!(
            records = s.records,
            deleted = s.deleted,
            counts_taken_back = s.counts.taken_back,
            slots_lowered = s.counts.lowered,
            "SOCK_REC: records of closed sockets deleted, their counts taken back"
        ),
        Ok(_) => {}
        Err(e) => warnings.push(format!("sweeping SOCK_REC: {e}")),
    }
    Ok(warnings)
}

/// `sock_rec_count::cover_uncounted`, logged; a failure is a warning: the
/// records it could not cover are found by the sweep once their socket
/// is gone.
fn cover_uncounted(pin_dir: &Path, warnings: &mut Vec<String>) {
    match sock_rec_count::cover_uncounted(pin_dir) {
        Ok(0) => {}
        Ok(n) => tracing::info!(slots = n, "SOCK_REC_COUNT: slots of records no program counted raised"),
        Err(e) => warnings.push(format!("covering SOCK_REC's records in SOCK_REC_COUNT: {e}")),
    }
}

/// Pins `link` at [`pins::socket_link`], replacing an older agent's link
/// of that name, which detaches it.
fn pin_link(link: FdLink, pin_dir: &Path, program: &'static str) -> Result<(), LoadError> {
    let final_path = pins::socket_link(pin_dir, program);
    let staging = pins::staged_socket_link(pin_dir, program);
    let _ = fs::remove_file(&staging); // left over by an agent killed mid-install
    let pin_err = |reason: String| LoadError::Pin { program, path: final_path.clone(), reason };
    let pinned = link.pin(&staging).map_err(|e| pin_err(error_chain(&e)))?;
    // rename(2) replaces the old pin atomically; bpffs implements it
    // with simple_rename.
    fs::rename(&staging, &final_path).map_err(|e| pin_err(e.to_string()))?;
    drop(pinned); // the pin keeps the link attached
    Ok(())
}

/// One above every cookie of a socket an older agent version translated:
/// above the largest cookie with a `SOCK_REVNAT` entry (those sockets are
/// the ones whose replies need it).
///
/// "The cookie the next socket gets" is no such bound: kernels that hand
/// out socket cookies in per-CPU batches of 4096 (`gen_cookie_next`,
/// include/linux/cookie.h; Debian's 6.12 does) give a fresh socket on one
/// CPU a cookie below those already given on another. A fresh socket's
/// cookie is taken into account as well, so that on kernels with one global
/// counter an entry whose write raced with the detach is still covered. A bound
/// that is too high only makes a few new UDP sockets look in SOCK_REVNAT
/// for an entry that is not there.
fn legacy_cookie_bound(ebpf: &Ebpf) -> io::Result<u64> {
    let map = ebpf.map(pc::SOCK_REVNAT_MAP).ok_or_else(|| io::Error::other("SOCK_REVNAT is missing from the object"))?;
    let revnat: aya::maps::HashMap<_, pc::SockRevNatKey, pc::SockRevNatValue> =
        aya::maps::HashMap::try_from(map).map_err(io::Error::other)?;
    let largest = bpf_batch::read_all(&revnat).map_err(io::Error::other)?.iter().map(|(k, _)| k.cookie).max();
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

/// Checks every map pinned under `pin_dir` against the [`maps::MAPS`]
/// table (capacities that differ are migrated, see `map_migration`).
fn check_pinned_maps(pin_dir: &Path) -> Result<Vec<String>, LoadError> {
    let mut warnings = Vec::new();
    for m in maps::MAPS {
        let path = pins::map(pin_dir, m.name);
        if !path.exists() {
            continue;
        }
        let info = MapInfo::from_pin(&path).map_err(|source| LoadError::Inspect { path: path.clone(), source })?;
        let incompatible = |what: String| LoadError::IncompatiblePin { path: path.clone(), what };
        let ty = info.map_type().map_err(|source| LoadError::Inspect { path: path.clone(), source })?;
        if ty != m.map_type {
            return Err(incompatible(format!("type {ty:?}, expected {:?}", m.map_type)));
        }
        // An earlier build's smaller values of a map this one extends are
        // migrated (`map_migration::GROWN_VALUES`).
        let value_ok = info.value_size() as usize == m.value_size || map_migration::value_grew(m.name, info.value_size() as usize);
        if info.key_size() as usize != m.key_size || !value_ok {
            return Err(incompatible(format!(
                "key/value size {}/{}, expected {}/{}",
                info.key_size(),
                info.value_size(),
                m.key_size,
                m.value_size
            )));
        }
        // The counter arrays grow as reasons are added. The socket hooks'
        // is migrated to the new size (`map_migration::plan`); the TC
        // programs' keeps the size it was pinned with, and their lookups
        // past its end find nothing, so those reasons go uncounted.
        let counters = match m.name {
            pc::NP_COUNTERS_MAP => Some(pc::np_counter::COUNT),
            _ => None,
        };
        if let Some(n) = counters
            && info.max_entries() < n
        {
            warnings.push(format!(
                "map {} was created with {} counters, this agent has {n}; the others are not counted until `proxy-agent reset`",
                m.name,
                info.max_entries()
            ));
        }
    }
    Ok(warnings)
}

/// Removes everything either loader created under `pin_dir`: links first
/// (which detaches the programs), then the TC programs' cls_bpf filters
/// (`tc_loader::reset`), then every map of the [`maps::MAPS`] table.
/// Missing pieces are fine, so reset is idempotent.
pub fn reset(pin_dir: &Path) -> Result<(), LoadError> {
    let links = pins::links(pin_dir);
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
    tc_loader::reset(pin_dir).map_err(|(path, source)| LoadError::Remove { path, source })?;
    for m in maps::MAPS {
        remove(&pins::map(pin_dir, m.name))?;
        remove(&pins::staged_map(pin_dir, m.name))?;
    }
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
