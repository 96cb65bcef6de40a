//! The node's network namespaces, and running code inside each.
//!
//! Pods are network namespaces of their own, which the agent does not
//! create and is not told about. Every namespace with a process in it is
//! named by `/proc/PID/ns/net`; namespaces kept alive by a bind mount
//! (`ip netns add`, some CNI plugins) are under `/run/netns`. The same
//! namespace is reached through many of those paths (one per process): the
//! nsfs inode identifies it (namespaces(7)). Seeing other processes' paths
//! needs the host's PID namespace (`hostPID` for a DaemonSet).

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// One network namespace: an open handle, and its nsfs inode for logs.
#[derive(Debug)]
pub struct Namespace {
    /// Its nsfs inode.
    pub inode: u64,
    /// An open `/proc/<pid>/ns/net`, to setns(2) into.
    pub file: File,
}

/// Every network namespace found, each once, the caller's own first.
/// Paths that vanish while being read (a process that exits) are skipped.
pub fn all() -> Vec<Namespace> {
    all_under(Path::new("/proc"), Path::new("/run/netns"))
}

fn all_under(proc: &Path, bind_mounts: &Path) -> Vec<Namespace> {
    let mut paths: Vec<PathBuf> = vec![proc.join("self/ns/net")];
    if let Ok(rd) = std::fs::read_dir(proc) {
        for e in rd.flatten() {
            if e.file_name().to_str().is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit())) {
                paths.push(e.path().join("ns/net"));
            }
        }
    }
    if let Ok(rd) = std::fs::read_dir(bind_mounts) {
        paths.extend(rd.flatten().map(|e| e.path()));
    }
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::new();
    for p in paths {
        // stat() follows the magic link to the namespace itself: cheap
        // enough to dedupe before opening anything.
        let Ok(md) = std::fs::metadata(&p) else { continue };
        if !seen.insert((md.dev(), md.ino())) {
            continue;
        }
        if let Ok(file) = File::open(&p) {
            out.push(Namespace { inode: md.ino(), file });
        }
    }
    out
}

/// Runs `f` once per namespace of `namespaces`, in order, on one new OS
/// thread that enters each in turn (setns(2) with `CLONE_NEWNET` moves
/// only the calling thread), and returns what each call returned, or why
/// the namespace could not be entered. The thread ends with the batch, so
/// no thread of the caller (the async runtime's above all) ever changes
/// namespace.
pub fn in_each<T: Send>(namespaces: &[Namespace], f: impl Fn(&Namespace) -> T + Sync) -> Vec<(u64, io::Result<T>)> {
    std::thread::scope(|s| {
        let worker = std::thread::Builder::new().name("netns-walk".into()).spawn_scoped(s, || {
            namespaces
                .iter()
                .map(|ns| {
                    // SAFETY: setns on a namespace file we hold open; it
                    // changes this thread's network namespace only.
                    let entered = unsafe { libc::setns(ns.file.as_raw_fd(), libc::CLONE_NEWNET) };
                    let r = if entered == 0 { Ok(f(ns)) } else { Err(io::Error::last_os_error()) };
                    (ns.inode, r)
                })
                .collect::<Vec<_>>()
        });
        match worker {
            Ok(h) => h.join().unwrap_or_else(|_| vec![(0, Err(io::Error::other("the namespace walk panicked")))]),
            Err(e) => vec![(0, Err(e))],
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespaces_are_listed_once_each_own_first() {
        let own = std::fs::metadata("/proc/self/ns/net").expect("own netns").ino();
        let all = all();
        assert_eq!(all.first().map(|n| n.inode), Some(own));
        let mut inodes: Vec<u64> = all.iter().map(|n| n.inode).collect();
        inodes.sort_unstable();
        let n = inodes.len();
        inodes.dedup();
        assert_eq!(inodes.len(), n, "each namespace once");
    }

    #[test]
    fn a_missing_proc_leaves_nothing_to_walk() {
        assert!(all_under(Path::new("/nonexistent-proc"), Path::new("/nonexistent-run")).is_empty());
    }
}
