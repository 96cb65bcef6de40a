//! Deleting `SOCK_REC` records whose socket is gone.
//!
//! The `sock_release` program deletes a socket's record when the socket is
//! released, so while it is attached the map holds only live sockets. Two
//! ways leave records behind all the same:
//!
//! * sockets released while no release program ran: a datapath whose
//!   release link was missing (pins of a build that had connect links but
//!   lost or predated that one; the pin guard then reinstalls);
//! * a capacity migration that copies `SOCK_REC` (`map_migration`): a
//!   socket released between the first copy and the new release program's
//!   attach has its record deleted from the old map only, and the copy
//!   keeps it.
//!
//! Such a record names a cookie no socket will ever have again (cookies are
//! never reused), so it only takes a slot of the preallocated map. The
//! sweep deletes the records whose cookie is held by no live TCP or UDP
//! socket of any network namespace (sock_diag dumps every socket with its
//! cookie, `inet_diag_msg_common_fill`).
//!
//! Race-free by order: the records are read first, then the sockets. A
//! record read first belongs to a socket created before the dumps began;
//! if that socket is still alive its namespace's dump lists it, so it is
//! kept. Records written after the read are not candidates. When any
//! namespace cannot be read, nothing is deleted.
//!
//! It needs the host's PID namespace (`hostPID`, as the chart sets): in
//! another one, the pods' namespaces are not among `/proc/*/ns/net`, and
//! the sweep deletes nothing.
//!
//! The records it deletes take their counts in `SOCK_REC_COUNT` with them,
//! and a slot raised for records no program counted comes back down once
//! none is left in it (`sock_rec_count::settle`), so that the release and
//! reverse programs can again stop at a 0 there.
//!
//! What the walk cannot see: a socket whose network namespace is held by
//! no process and no bind mount (one created in a namespace its owner
//! left with setns(2)). Its record is deleted: its getpeername then shows
//! the backend, and the agent's termination no longer finds it.

use std::collections::HashSet;
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use aya::maps::{HashMap, Map, MapData, MapError};
use proxy_common as pc;
use proxy_common::SockRecValue;

use crate::datapath::loader::pins;
use crate::datapath::maps::bpf_batch;
use crate::datapath::sockets::netns;
use crate::datapath::sockets::sock_diag::DiagSocket;
use crate::datapath::sockets::sock_rec_count;
use crate::util::periodic::{self, Run};

/// What one sweep did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Swept {
    /// Records read before the walk.
    pub records: usize,
    /// Of those, deleted (no live socket has their cookie).
    pub deleted: usize,
    /// What was taken back from `SOCK_REC_COUNT`.
    pub counts: sock_rec_count::Settled,
}

/// Why a sweep of `SOCK_REC` did not run; nothing is deleted then.
#[derive(Debug, thiserror::Error)]
pub enum SweepError {
    /// The map could not be opened.
    #[error("cannot open SOCK_REC: {0}")]
    Open(MapError),
    /// The map could not be read.
    #[error("cannot read SOCK_REC: {0}")]
    Read(MapError),
    /// The sockets of a namespace could not be listed, so a record may be a live socket's.
    #[error("cannot list the sockets of network namespace {inode}: {reason}; no record was deleted")]
    Namespace {
        /// The namespace's nsfs inode.
        inode: u64,
        /// The error.
        reason: String,
    },
    /// The agent sees only its own PID namespace's processes and therefore not every network
    /// namespace.
    #[error(
        "the agent is not in the host's PID namespace (hostPID), so the pods' network namespaces are hidden from it and their sockets cannot be listed; no record was deleted"
    )]
    NotHostPid,
}

/// The inode of the initial PID namespace (`PROC_PID_INIT_INO`,
/// include/linux/proc_ns.h).
const PROC_PID_INIT_INO: u64 = 0xEFFF_FFFC;

/// The states of a socket that can hold a record: a TCP socket from its
/// connect() until it is released (SYN_SENT, ESTABLISHED, FIN_WAIT1/2,
/// CLOSE_WAIT, LAST_ACK, CLOSING; a closed one is in no table the dump
/// walks, and a time-wait or request socket is no full socket), a UDP
/// socket connected or not (ESTABLISHED, CLOSE: after `connect(AF_UNSPEC)`
/// it keeps its record until released). Listening and request sockets are
/// left out of the request: a listener never connected through us, and
/// on Linux 5.10 a dump asking for every state did not end (vmtest).
const TCP_STATES: u32 = (1 << 1) | (1 << 2) | (1 << 4) | (1 << 5) | (1 << 8) | (1 << 9) | (1 << 11);
const UDP_STATES: u32 = (1 << 1) | (1 << 7);

/// Deletes the records of `SOCK_REC` (pinned under `pin_dir`) whose
/// socket no longer exists. A datapath without the map has nothing to do.
pub fn sweep(pin_dir: &Path) -> Result<Swept, SweepError> {
    let path = pins::map(pin_dir, pc::SOCK_REC_MAP);
    if !path.exists() {
        return Ok(Swept::default());
    }
    let data = MapData::from_pin(&path).map_err(SweepError::Open)?;
    let map: HashMap<MapData, u64, SockRecValue> = HashMap::try_from(Map::HashMap(data)).map_err(SweepError::Open)?;
    let records: Vec<(u64, SockRecValue)> = bpf_batch::read_all(&map).map_err(SweepError::Read)?;
    if records.is_empty() {
        // Nothing to delete, but slots raised for records since released
        // can come down.
        return Ok(Swept { counts: settle(pin_dir, &[], &[]), ..Swept::default() });
    }
    // Without the host's PID namespace the walk sees only the namespaces
    // of the agent's own processes, and every pod socket would look gone.
    let in_host_pid = std::fs::metadata("/proc/self/ns/pid").is_ok_and(|m| m.ino() == PROC_PID_INIT_INO);
    if !in_host_pid {
        return Err(SweepError::NotHostPid);
    }
    let namespaces = netns::all();
    tracing::debug!(records = records.len(), namespaces = namespaces.len(), "SOCK_REC sweep: listing every namespace's sockets");
    let live = live_cookies(&namespaces)?;
    tracing::debug!(live = live.len(), "SOCK_REC sweep: sockets listed");
    let delete = MapData::from_pin(&path).map_err(SweepError::Open)?;
    let (mut deleted, mut kept) = (Vec::new(), Vec::new());
    for (cookie, rec) in &records {
        if live.contains(cookie) {
            kept.push((*cookie, *rec));
            continue;
        }
        // ENOENT: released meanwhile, the release program got there first
        // (and took its count back).
        if bpf_batch::delete_elem(delete.fd().as_fd(), cookie).is_ok() {
            deleted.push((*cookie, *rec));
        }
    }
    let counts = settle(pin_dir, &deleted, &kept);
    Ok(Swept { records: records.len(), deleted: deleted.len(), counts })
}

/// `sock_rec_count::settle`; a failure leaves slots raised (lookups,
/// never a wrong answer) and is logged.
fn settle(pin_dir: &Path, deleted: &[(u64, SockRecValue)], kept: &[(u64, SockRecValue)]) -> sock_rec_count::Settled {
    sock_rec_count::settle(pin_dir, deleted, kept).unwrap_or_else(|e| {
        tracing::warn!("SOCK_REC sweep: the counts of deleted records stay in SOCK_REC_COUNT: {e}");
        sock_rec_count::Settled::default()
    })
}

/// Sweeps every `interval` (the first one interval after start, which
/// swept once already; see `socket_loader`), on a blocking thread. A zero
/// interval spawns nothing. A failed sweep deletes nothing and is warned
/// about once per streak; the next one tries again.
pub fn spawn(pin_dir: std::path::PathBuf, interval: std::time::Duration) -> Option<tokio::task::JoinHandle<()>> {
    if interval.is_zero() {
        return None;
    }
    Some(periodic::every(
        interval,
        move || sweep(&pin_dir),
        |run| match run {
            Run::Done(s) if s.deleted > 0 || s.counts.lowered > 0 => {
                tracing::info!(
                    records = s.records,
                    deleted = s.deleted,
                    counts_taken_back = s.counts.taken_back,
                    slots_lowered = s.counts.lowered,
                    "SOCK_REC: records of closed sockets deleted (releases the program did not see)"
                );
            }
            Run::Done(_) => {}
            Run::Failed { error, first } => {
                if first {
                    tracing::warn!("SOCK_REC sweep: {error}");
                }
            }
            Run::Panicked(e) => tracing::warn!("SOCK_REC sweep: the sweep thread failed: {e}"),
        },
    ))
}

/// The cookies of every TCP and UDP socket, IPv4 and IPv6, of `namespaces`.
fn live_cookies(namespaces: &[netns::Namespace]) -> Result<HashSet<u64>, SweepError> {
    let per_ns = netns::in_each(namespaces, |_| -> std::io::Result<Vec<u64>> {
        let mut diag = DiagSocket::open()?;
        let mut out = Vec::new();
        for family in [libc::AF_INET as u8, libc::AF_INET6 as u8] {
            for (protocol, states) in [(libc::IPPROTO_TCP as u8, TCP_STATES), (libc::IPPROTO_UDP as u8, UDP_STATES)] {
                let socks = diag.dump(family, protocol, states)?;
                tracing::debug!(family, protocol, sockets = socks.len(), "SOCK_REC sweep: dumped");
                out.extend(socks.into_iter().map(|s| s.cookie));
            }
        }
        Ok(out)
    });
    let mut live = HashSet::new();
    for (inode, r) in per_ns {
        match r {
            Ok(Ok(cookies)) => live.extend(cookies),
            Ok(Err(e)) | Err(e) => return Err(SweepError::Namespace { inode, reason: e.to_string() }),
        }
    }
    Ok(live)
}
