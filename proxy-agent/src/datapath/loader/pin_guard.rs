//! Pins removed under a running agent are put back.
//!
//! A BPF map lives while anything refers to it: a pin, an open descriptor
//! or a loaded program that uses it (kernel/bpf/syscall.c, `bpf_map_put`;
//! a pin is one such reference, kernel/bpf/inode.c). Removing a map's pin
//! therefore changes nothing for the programs, which go on reading the same
//! map, nor for the map writers, which hold descriptors. It breaks what
//! finds the maps by name: the next agent would adopt nothing and start
//! from empty maps (Services unreachable until its first sync), and `dump`,
//! the counters in /metrics and the conntrack GC open the pins. A link pin
//! is the only reference to a cgroup link (the agent keeps none open), so
//! removing one detaches its program at once.
//!
//! The guard holds a descriptor of every map in [`maps::MAPS`] from
//! start-up on and looks at the pin directory every [`CHECK_INTERVAL`]. A
//! missing map pin is pinned again from that descriptor, so the pin names
//! the very map the programs use, with every entry it holds: nothing is
//! written and no sync is needed. When a socket program's link pin is
//! missing, the socket programs are installed again
//! (`socket_loader::install`), which adopts those maps and pins new links.
//! Each removed pin is logged and counted
//! (`topoproxy_errors_total{reason="pin_removed"}`).
//!
//! The TC programs' tcx link pins are not put back: their devices are the
//! external datapath's to decide, and it attaches again only when they
//! change (or at the next start).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use aya::maps::{MapData, MapError};

use crate::datapath::loader::{mounts, pins, socket_loader};
use crate::datapath::maps::{self, MapSizes};
use crate::observe::metrics::{Metrics, reason};
use crate::util::error_chain::error_chain;

/// How often the pin directory is looked at: a few dozen `stat` calls.
pub const CHECK_INTERVAL: Duration = Duration::from_secs(1);

/// A pin could not be put back.
#[derive(Debug, thiserror::Error)]
pub enum GuardError {
    /// A pinned map could not be opened at start-up.
    #[error("cannot open pinned map {path}: {source}")]
    Open {
        /// The pin.
        path: PathBuf,
        /// Why it could not be opened.
        source: MapError,
    },
    /// A removed map pin could not be pinned again.
    #[error("pinned map {map} was removed from {dir} and cannot be pinned again: {reason}")]
    Pin {
        /// The map.
        map: &'static str,
        /// The pin directory.
        dir: PathBuf,
        /// Why pinning failed.
        reason: String,
    },
    /// The pin directory is gone and could not be made again.
    #[error("the pin directory was removed and cannot be made again: {0}")]
    Mount(#[from] mounts::MountError),
    /// The socket programs' links were gone and installing them again failed.
    #[error("the socket programs' link pins were removed (the programs are detached) and installing them again failed: {0}")]
    Install(Box<socket_loader::LoadError>),
}

/// What one check put back.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Restored {
    /// Maps pinned again.
    pub maps: Vec<&'static str>,
    /// Whether the socket programs were installed again (a link pin was
    /// missing), with the installer's warnings.
    pub links: Option<Vec<String>>,
}

impl Restored {
    /// Pins that were found missing.
    pub fn count(&self) -> usize {
        self.maps.len() + usize::from(self.links.is_some())
    }
}

/// Holds every pinned map open and puts back pins removed under the running agent (see the module's
/// documentation).
pub struct PinGuard {
    pin_dir: PathBuf,
    cgroup: PathBuf,
    caps: MapSizes,
    maps: Vec<(&'static str, MapData)>,
}

impl PinGuard {
    /// Opens every pinned map of `pin_dir`; `socket_loader::install` must
    /// have pinned them. `cgroup` and `caps` are what the socket programs
    /// are installed with again when their links go.
    pub fn open(pin_dir: &Path, cgroup: &Path, caps: impl Into<MapSizes>) -> Result<PinGuard, GuardError> {
        let caps = caps.into();
        let mut held = Vec::with_capacity(maps::MAPS.len());
        for m in maps::MAPS {
            let path = pins::map(pin_dir, m.name);
            let data = MapData::from_pin(&path).map_err(|source| GuardError::Open { path, source })?;
            held.push((m.name, data));
        }
        Ok(PinGuard { pin_dir: pin_dir.to_path_buf(), cgroup: cgroup.to_path_buf(), caps, maps: held })
    }

    /// Puts back what is missing from the pin directory.
    pub fn check(&self) -> Result<Restored, GuardError> {
        let mut restored = Restored::default();
        if !self.pin_dir.is_dir() {
            mounts::ensure_pin_dir(&self.pin_dir)?;
        }
        for (name, map) in &self.maps {
            let path = pins::map(&self.pin_dir, name);
            if path.exists() {
                continue;
            }
            if let Err(e) = map.pin(&path) {
                // Somebody else pinned something there meanwhile: leave it.
                if path.exists() {
                    continue;
                }
                return Err(GuardError::Pin { map: name, dir: self.pin_dir.clone(), reason: error_chain(&e) });
            }
            restored.maps.push(name);
        }
        if socket_loader::PROGRAMS.iter().chain([&socket_loader::RELEASE_PROGRAM]).any(|p| !pins::socket_link(&self.pin_dir, p).exists()) {
            let warnings = socket_loader::install(&self.cgroup, &self.pin_dir, self.caps).map_err(|e| GuardError::Install(Box::new(e)))?;
            restored.links = Some(warnings);
        }
        Ok(restored)
    }
}

/// Runs [`PinGuard::check`] every [`CHECK_INTERVAL`] on the current tokio
/// runtime (the check itself on the blocking pool) until the runtime stops.
pub fn spawn(guard: PinGuard, metrics: Arc<Metrics>) -> tokio::task::JoinHandle<()> {
    let guard = Arc::new(guard);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(CHECK_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut failing = false;
        loop {
            tick.tick().await;
            let g = guard.clone();
            match tokio::task::spawn_blocking(move || g.check()).await {
                Ok(Ok(restored)) => {
                    failing = false;
                    report(&guard.pin_dir, &restored, &metrics);
                }
                Ok(Err(e)) => {
                    // Once per failure streak, not every second.
                    if !failing {
                        metrics.error(reason::PIN_REMOVED);
                        tracing::error!("{e}; retrying every {CHECK_INTERVAL:?}");
                    }
                    failing = true;
                }
                Err(e) => tracing::warn!(error = %e, "pin directory check failed"),
            }
        }
    })
}

fn report(pin_dir: &Path, restored: &Restored, metrics: &Metrics) {
    metrics.errors_by(reason::PIN_REMOVED, restored.count());
    for map in &restored.maps {
        tracing::warn!(
            map,
            pin_dir = %pin_dir.display(),
            "pinned map was removed under the running agent; pinned it again (the same map: the programs kept using it, no entry was lost)"
        );
    }
    if let Some(warnings) = &restored.links {
        tracing::warn!(
            pin_dir = %pin_dir.display(),
            "the socket programs' link pins were removed, which detached the programs; installed them again on the pinned maps"
        );
        for w in warnings {
            tracing::warn!("{w}");
        }
    }
}
