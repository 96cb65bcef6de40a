//! Installing the XDP program for NodePort and LoadBalancer ingress
//! (`xdp_nodeport`, proxy-ebpf/src/programs/xdp.rs) on the node's devices, in front
//! of the TC programs, which stay attached and handle everything XDP
//! passes on.
//!
//! Attached in native (driver) mode only: generic XDP runs after the skb is
//! built, where it saves nothing over TC. The attachment is a bpf_link
//! (`BPF_LINK_CREATE` with `BPF_XDP`, Linux 5.9), pinned under
//! `<bpffs>/links/xdp-<device>` like the TC links: it outlives the agent,
//! and a restarted agent swaps its new program into it with
//! `BPF_LINK_UPDATE` (`bpf_xdp_link_update` replaces the device's program
//! under RTNL, so every frame meets the old or the new program, never
//! none). Conntrack is the TC path's pinned `NP_CT`, so no map of its own
//! needs adopting: its one map, the next-hop cache `XDP_NEXTHOP` (see
//! proxy-common), belongs to each load and starts empty, as the new
//! program's lookups refill it within a packet per flow.
//!
//! `--xdp` is `off` by default: a frame XDP redirects (or sends back) into a
//! veth is dropped unless the veth's peer runs NAPI, i.e. has an XDP program
//! or GRO enabled (drivers/net/veth.c, `veth_xdp_xmit`), which the agent
//! cannot arrange for devices it does not own; and frames from a local veth
//! sender with checksum offload carry partial checksums (see xdp.rs).
//! `auto` attaches where the driver accepts native mode and otherwise stays
//! on TC; `native` makes a refusal an error.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use aya::Ebpf;
use aya::programs::links::{FdLink, PinnedLink};
use aya::programs::xdp::XdpLink;
use aya::programs::{Xdp, XdpMode as AttachMode};

use proxy_common as pc;

use crate::datapath::loader::kernel_features::KernelFeatures;
use crate::datapath::loader::object::{self, EBPF_OBJECT};
use crate::datapath::loader::pins;
use crate::util::error_chain::error_chain;

/// The XDP program: external traffic translated at the driver, before an skb exists.
pub const XDP_PROGRAM: &str = "xdp_nodeport";

/// `--xdp`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum XdpMode {
    /// No XDP program; a pinned one of an earlier run is detached.
    #[default]
    Off,
    /// Native XDP where the driver supports it, TC alone elsewhere.
    Auto,
    /// Native XDP on every device, or an error.
    Native,
}

impl XdpMode {
    /// Parses `off`, `auto` or `native`.
    pub fn parse(s: &str) -> Option<XdpMode> {
        match s {
            "off" => Some(XdpMode::Off),
            "auto" => Some(XdpMode::Auto),
            "native" => Some(XdpMode::Native),
            _ => None,
        }
    }
}

/// Why the XDP program could not be installed.
#[derive(Debug, thiserror::Error)]
pub enum XdpError {
    /// The object could not be loaded (a verifier rejection shows here).
    #[error("loading the eBPF object failed: {0}")]
    Object(#[from] aya::EbpfError),
    /// The object lacks the XDP program (a build mismatch).
    #[error("program {XDP_PROGRAM} is missing from the eBPF object")]
    MissingProgram,
    /// The program could not be loaded.
    #[error("program {XDP_PROGRAM}: {0}")]
    Program(aya::programs::ProgramError),
    /// A device refused native XDP (`--xdp native`; `auto` leaves it to TC).
    #[error("device {device}: native XDP: {reason}")]
    Attach {
        /// The device.
        device: String,
        /// The error.
        reason: String,
    },
    /// A file under the pin directory could not be made or read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
}

/// Attaches (or upgrades in place) the XDP program on `devices` as `mode`
/// says, and detaches it from devices no longer listed (all of them for
/// `off`). Returns notes for the log: devices left on TC, detachments. The
/// TC programs must be installed first (`tc_loader::install`): XDP passes
/// everything it does not handle to them.
pub fn install(pin_dir: &Path, devices: &[String], mode: XdpMode) -> Result<Vec<String>, XdpError> {
    let mut notes = Vec::new();
    if mode == XdpMode::Off {
        detach_unlisted(pin_dir, &[], &mut notes);
        return Ok(notes);
    }
    let mut ebpf = match load_program(pin_dir) {
        Ok(e) => e,
        // `auto` never keeps the agent from running on TC alone, also when
        // this kernel refuses the program itself.
        Err(e) if mode == XdpMode::Auto => {
            detach_unlisted(pin_dir, &[], &mut notes);
            notes.push(format!("the XDP program cannot be loaded ({}); every device stays on TC alone", error_chain(&e)));
            return Ok(notes);
        }
        Err(e) => return Err(e),
    };
    attach_loaded(&mut ebpf, pin_dir, devices, mode, notes)
}

/// [`install`] with the program loaded from `ebpf`, the object the TC
/// programs were loaded from (`tc_loader::install_external`), so that the
/// XDP program and the TC fast path share one next-hop cache.
pub fn install_shared(ebpf: &mut Ebpf, pin_dir: &Path, devices: &[String], mode: XdpMode) -> Result<Vec<String>, XdpError> {
    let mut notes = Vec::new();
    if mode == XdpMode::Off {
        detach_unlisted(pin_dir, &[], &mut notes);
        return Ok(notes);
    }
    match program(ebpf).and_then(|p| p.load().map_err(XdpError::Program)) {
        Ok(()) => {}
        Err(e) if mode == XdpMode::Auto => {
            detach_unlisted(pin_dir, &[], &mut notes);
            notes.push(format!("the XDP program cannot be loaded ({}); every device stays on TC alone", error_chain(&e)));
            return Ok(notes);
        }
        Err(e) => return Err(e),
    }
    attach_loaded(ebpf, pin_dir, devices, mode, notes)
}

fn attach_loaded(
    ebpf: &mut Ebpf,
    pin_dir: &Path,
    devices: &[String],
    mode: XdpMode,
    mut notes: Vec<String>,
) -> Result<Vec<String>, XdpError> {
    let prog = program(ebpf)?;
    let links = pins::links(pin_dir);
    fs::create_dir_all(&links).map_err(|source| XdpError::Io { path: links.clone(), source })?;
    let mut on = Vec::new();
    for device in devices {
        let pin = pins::xdp_link(pin_dir, device);
        match attach(prog, device, &pin) {
            Ok(()) => on.push(device.clone()),
            Err(reason) if mode == XdpMode::Auto => {
                tracing::info!(device = %device, %reason, "native XDP not available; the device stays on TC alone");
                notes.push(format!("device {device}: native XDP not available ({reason}); TC alone"));
            }
            Err(reason) => return Err(XdpError::Attach { device: device.clone(), reason }),
        }
    }
    detach_unlisted(pin_dir, &on, &mut notes);
    Ok(notes)
}

/// Detaches the XDP program from every device this pin directory attached
/// it to. Returns what was detached.
pub fn detach_all(pin_dir: &Path) -> Vec<String> {
    let mut notes = Vec::new();
    detach_unlisted(pin_dir, &[], &mut notes);
    notes
}

/// The devices the XDP program is attached to through this pin directory
/// (a pinned link each), for `dump` and `/metrics`.
pub fn attached_devices(pin_dir: &Path) -> Vec<String> {
    let mut out: Vec<String> = fs::read_dir(pins::links(pin_dir))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| pins::xdp_link_device(&e.file_name().to_string_lossy()).map(str::to_string))
        .collect();
    out.sort();
    out
}

/// The XDP program's cached next hops (`XDP_NEXTHOP`), for `dump`. The
/// cache belongs to the program's load and has no pin of its own, so it is
/// found through the program: a pinned XDP link of this pin directory
/// names it (every device runs the same program), and the program names
/// its maps. Empty when XDP is off.
pub fn next_hops(pin_dir: &Path) -> Result<Vec<(pc::XdpNextHopKey, pc::XdpNextHopValue)>, XdpError> {
    let Some(device) = attached_devices(pin_dir).into_iter().next() else { return Ok(Vec::new()) };
    let pin = pins::xdp_link(pin_dir, &device);
    let not_found = |what: String| XdpError::Io { path: pin.clone(), source: io::Error::new(io::ErrorKind::NotFound, what) };
    let link: FdLink = PinnedLink::from_pin(&pin).map_err(|e| not_found(error_chain(&e)))?.into();
    let prog_id = link.info().map_err(|e| not_found(error_chain(&e)))?.program_id();
    let prog = aya::programs::loaded_programs()
        .flatten()
        .find(|p| p.id() == prog_id)
        .ok_or_else(|| not_found(format!("program {prog_id} of the link is gone")))?;
    let map_ids = prog.map_ids().map_err(XdpError::Program)?.unwrap_or_default();
    for id in map_ids {
        let Ok(info) = aya::maps::MapInfo::from_id(id) else { continue };
        if info.name_as_str() != Some(pc::XDP_NEXTHOP_MAP) {
            continue;
        }
        let data = aya::maps::MapData::from_id(id).map_err(|e| not_found(error_chain(&e)))?;
        let map: aya::maps::HashMap<_, pc::XdpNextHopKey, pc::XdpNextHopValue> =
            aya::maps::HashMap::try_from(aya::maps::Map::LruHashMap(data)).map_err(|e| not_found(error_chain(&e)))?;
        return Ok(map.iter().flatten().collect());
    }
    Err(not_found(format!("program {prog_id} has no map {}", pc::XDP_NEXTHOP_MAP)))
}

fn detach_unlisted(pin_dir: &Path, keep: &[String], notes: &mut Vec<String>) {
    let Ok(rd) = fs::read_dir(pins::links(pin_dir)) else { return };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(device) = pins::xdp_link_device(&name) else { continue };
        if keep.iter().any(|d| d == device) {
            continue;
        }
        // Unpinning drops the last reference to the link (the agent holds
        // no fd), which detaches the program (`bpf_xdp_link_release`); the
        // TC programs carry every flow on from NP_CT.
        if let Ok(link) = PinnedLink::from_pin(e.path()) {
            let _ = link.unpin();
        } else {
            let _ = fs::remove_file(e.path());
        }
        notes.push(format!("detached the XDP program from {device}"));
    }
}

/// Attaches in native mode through a pinned link, or swaps the program of
/// the pinned link in place. The error is the reason, for the caller to
/// log or return.
fn attach(prog: &mut Xdp, device: &str, pin: &Path) -> Result<(), String> {
    if let Ok(old) = PinnedLink::from_pin(pin) {
        let fd: FdLink = old.into();
        match XdpLink::try_from(fd) {
            Ok(link) => match prog.attach_to_link(link) {
                Ok(id) => {
                    // The pin keeps the link; our handle only closes its fd.
                    let link = prog.take_link(id).map_err(|e| error_chain(&e))?;
                    let fd: FdLink = link.try_into().map_err(|e| error_chain(&e))?;
                    drop(fd);
                    return Ok(());
                }
                Err(e) => {
                    // The device was recreated: the old link is defunct.
                    tracing::warn!(device, error = %error_chain(&e), "cannot update the pinned XDP link; attaching anew");
                }
            },
            Err(e) => tracing::warn!(device, error = %error_chain(&e), "pinned XDP link is not an XDP link; attaching anew"),
        }
        let _ = fs::remove_file(pin);
    }
    let id = prog.attach(device, AttachMode::Driver).map_err(|e| error_chain(&e))?;
    let link = prog.take_link(id).map_err(|e| error_chain(&e))?;
    // A netlink attachment (kernels without XDP links) has no fd to pin and
    // would go with our process: refuse it rather than leave the device
    // with a program nobody can replace atomically.
    let fd: FdLink = link.try_into().map_err(|e| format!("no bpf_link for XDP on this kernel: {}", error_chain(&e)))?;
    fd.pin(pin).map_err(|e| error_chain(&e))?;
    Ok(())
}

/// Loads the XDP program (its kernel variant) with every map at its pin
/// under `pin_dir`, not attached. Also for BPF_PROG_TEST_RUN in the
/// benchmark.
pub fn load_unattached(pin_dir: &Path) -> Result<Ebpf, XdpError> {
    load_program(pin_dir)
}

fn load_program(pin_dir: &Path) -> Result<Ebpf, XdpError> {
    let mut ebpf = object::load_xdp(EBPF_OBJECT, pin_dir)?;
    program(&mut ebpf)?.load().map_err(XdpError::Program)?;
    Ok(ebpf)
}

/// The object's name of the XDP program in the variant this kernel loads.
pub fn loaded_name() -> String {
    KernelFeatures::get().tc_variant().program(XDP_PROGRAM)
}

fn program(ebpf: &mut Ebpf) -> Result<&mut Xdp, XdpError> {
    ebpf.program_mut(&loaded_name()).ok_or(XdpError::MissingProgram)?.try_into().map_err(XdpError::Program)
}

#[cfg(test)]
mod tests {
    use super::XdpMode;

    #[test]
    fn modes_parse() {
        for (s, m) in [("off", Some(XdpMode::Off)), ("auto", Some(XdpMode::Auto)), ("native", Some(XdpMode::Native)), ("on", None)] {
            assert_eq!(XdpMode::parse(s), m, "{s}");
        }
        assert_eq!(XdpMode::default(), XdpMode::Off);
    }
}
