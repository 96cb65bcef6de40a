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
//! What the walk cannot see: a socket whose network namespace is held by
//! no process and no bind mount (one created in a namespace its owner
//! left with setns(2)). Its record is deleted: its getpeername then shows
//! the backend, and the agent's termination no longer finds it.

use std::collections::HashSet;
use std::os::fd::AsFd;
use std::path::Path;

use aya::maps::{HashMap, Map, MapData, MapError};
use proxy_common as pc;
use proxy_common::SockRecValue;

use crate::datapath::sock_diag::DiagSocket;
use crate::datapath::{bpf_batch, netns};

/// What one sweep did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Swept {
    /// Records read before the walk.
    pub records: usize,
    /// Of those, deleted (no live socket has their cookie).
    pub deleted: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum SweepError {
    #[error("cannot open SOCK_REC: {0}")]
    Open(MapError),
    #[error("cannot read SOCK_REC: {0}")]
    Read(MapError),
    #[error("cannot list the sockets of network namespace {inode}: {reason}; no record was deleted")]
    Namespace { inode: u64, reason: String },
}

/// Every TCP state bit (1..=12) and UDP's two: all sockets.
const ALL_STATES: u32 = u32::MAX;

/// Deletes the records of `SOCK_REC` (pinned under `pin_dir`) whose
/// socket no longer exists. A datapath without the map has nothing to do.
pub fn sweep(pin_dir: &Path) -> Result<Swept, SweepError> {
    let path = pin_dir.join(pc::SOCK_REC_MAP);
    if !path.exists() {
        return Ok(Swept::default());
    }
    let data = MapData::from_pin(&path).map_err(SweepError::Open)?;
    let map: HashMap<MapData, u64, SockRecValue> = HashMap::try_from(Map::HashMap(data)).map_err(SweepError::Open)?;
    let records: Vec<u64> = bpf_batch::read_all(&map).map_err(SweepError::Read)?.into_iter().map(|(k, _)| k).collect();
    if records.is_empty() {
        return Ok(Swept::default());
    }
    let live = live_cookies(&netns::all())?;
    let delete = MapData::from_pin(&path).map_err(SweepError::Open)?;
    let mut deleted = 0;
    for cookie in &records {
        if live.contains(cookie) {
            continue;
        }
        // ENOENT: released meanwhile, the release program got there first.
        if bpf_batch::delete_elem(delete.fd().as_fd(), cookie).is_ok() {
            deleted += 1;
        }
    }
    Ok(Swept { records: records.len(), deleted })
}

/// The cookies of every TCP and UDP socket, IPv4 and IPv6, of `namespaces`.
fn live_cookies(namespaces: &[netns::Namespace]) -> Result<HashSet<u64>, SweepError> {
    let per_ns = netns::in_each(namespaces, |_| -> std::io::Result<Vec<u64>> {
        let mut diag = DiagSocket::open()?;
        let mut out = Vec::new();
        for family in [libc::AF_INET as u8, libc::AF_INET6 as u8] {
            for protocol in [libc::IPPROTO_TCP as u8, libc::IPPROTO_UDP as u8] {
                out.extend(diag.dump(family, protocol, ALL_STATES)?.into_iter().map(|s| s.cookie));
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
