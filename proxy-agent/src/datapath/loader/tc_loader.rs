//! Installing the TC programs for external traffic (NodePort, LoadBalancer,
//! externalIPs) on the node's devices.
//!
//! On Linux >= 6.6 the programs are attached with tcx links
//! (`BPF_LINK_CREATE` with `BPF_TCX_INGRESS`/`BPF_TCX_EGRESS`), pinned under
//! `<bpffs>/links/tc-<device>-<ingress|egress>`. A pinned link outlives the
//! agent, and a restarted agent swaps its new program into the existing link
//! with `BPF_LINK_UPDATE` (`SchedClassifier::attach_to_link`): the kernel
//! replaces the program atomically (`tcx_link_update` ->
//! `bpf_mprog_attach` with `BPF_F_REPLACE`), so no packet passes
//! untranslated during a restart and conntrack (pinned `NP_CT`) keeps every
//! established flow on its backend.
//!
//! On older kernels a clsact qdisc is added and the programs are attached as
//! direct-action cls_bpf filters over netlink. Such filters belong to the
//! qdisc, not to a file descriptor, so they also stay after the agent exits;
//! our filter has a fixed priority and handle, and a restart swaps its
//! program in place.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use aya::Ebpf;
use aya::programs::links::{FdLink, PinnedLink};
use aya::programs::tc::{self, SchedClassifierLink, TcAttachOptions};
use aya::programs::{LinkOrder, SchedClassifier, TcAttachType};

use crate::datapath::loader::kernel_features::{self, KernelFeatures};
use crate::datapath::loader::mounts;
use crate::datapath::loader::object::{self, EBPF_OBJECT};
use crate::datapath::loader::pins;
use crate::datapath::maps::port_bits;
use crate::util::error_chain::error_chain;

/// The TC program at the devices' ingress: DNAT of new flows to external frontends, and replies'
/// destinations back to the client.
pub const INGRESS_PROGRAM: &str = "np_ingress";
/// The TC program at the devices' egress: source rewrites (SNAT to a remote backend, the frontend
/// on replies), which IPv4 would drop at ingress (`fib_validate_source`).
pub const EGRESS_PROGRAM: &str = "np_egress";

// The devices holding a legacy cls_bpf filter of ours are recorded in
// `pins::tc_legacy`, one empty directory per filter (see `legacy_record`),
// so that a later run or `reset` can find and remove them.
/// Our cls_bpf filters' priority and handle on the clsact hooks: fixed, so
/// that a restarted agent replaces its own filter instead of adding one.
const LEGACY_PRIORITY: u16 = 0x4e50;
const LEGACY_HANDLE: u32 = 0x4e50;

/// How the TC programs are attached.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TcMode {
    /// tcx on Linux >= 6.6, clsact + netlink before.
    #[default]
    Auto,
    /// tcx links, failing where the kernel has none.
    Tcx,
    /// clsact + cls_bpf over netlink, also where tcx exists.
    Netlink,
}

/// Why the TC programs could not be installed.
#[derive(Debug, thiserror::Error)]
pub enum TcError {
    /// The object could not be loaded (a verifier rejection shows here).
    #[error("loading the eBPF object failed: {0}")]
    Object(#[from] aya::EbpfError),
    /// The object lacks a program this agent expects (a build mismatch).
    #[error("program {program} is missing from the eBPF object")]
    MissingProgram {
        /// The program.
        program: &'static str,
    },
    /// A program could not be loaded.
    #[error("program {program}: {source}")]
    Program {
        /// The program.
        program: &'static str,
        /// The error.
        source: aya::programs::ProgramError,
    },
    /// A program could not be attached to a device.
    #[error("device {device}: {what}: {reason}")]
    Attach {
        /// The device.
        device: String,
        /// The step that failed (tcx attach, netlink attach, ...).
        what: &'static str,
        /// The error.
        reason: String,
    },
    /// A file under the pin directory could not be made.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
    /// `NP_PORTS` could not be filled.
    #[error(transparent)]
    PortBits(#[from] port_bits::PortBitsError),
}

/// `--tc-fast-path`: whether the TC programs send translated packets of
/// flows to remote backends straight to their next hop, and a client's
/// packets to a local pod straight into its namespace (proxy-ebpf's
/// tc_fast.rs; the pods' veths are listed by `external::peer_devices`),
/// bypassing the stack's forwarding path.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TcFastPath {
    /// On where the kernel loads it (every kernel from the 5.10 floor has
    /// its helpers; a refusal is logged and the stack path used), for
    /// flows to remote backends, both ways: this node's stack sees none of
    /// their packets, and the node that hosts the pod forwards them
    /// through its own stack, which enforces the pod's policy. A local
    /// pod's packets go through this node's stack.
    #[default]
    Auto,
    /// `Auto`, and a client's packets to a pod on this node go straight
    /// into the pod's namespace (`bpf_redirect_peer`). Not the default:
    /// the pod's replies still go through the stack, whose conntrack then
    /// sees a reply (a SYN-ACK) of a flow it never saw start and calls it
    /// INVALID, which kube-proxy's own `KUBE-FORWARD ... --ctstate INVALID
    /// -j DROP` and many host firewalls drop (the kube-proxy migration
    /// test saw every NodePort connect to a local pod time out); and the
    /// client's packets skip the FORWARD chain and the egress hook of the
    /// pod's host-side veth, where Calico (iptables and eBPF modes) and
    /// kube-router enforce the pod's ingress NetworkPolicy.
    All,
    /// The stack forwards every translated packet, as before the fast path.
    Off,
}

impl TcFastPath {
    /// Parses `auto`, `all` or `off`.
    pub fn parse(s: &str) -> Option<TcFastPath> {
        match s {
            "auto" => Some(TcFastPath::Auto),
            "all" => Some(TcFastPath::All),
            "off" => Some(TcFastPath::Off),
            _ => None,
        }
    }

    /// Whether local pods get packets straight from TC (`NP_PEER_DEVS`
    /// filled); the programs deliver only to the devices listed there.
    pub fn local(self) -> bool {
        self == TcFastPath::All
    }
}

/// What [`install_external`] loaded: the object (the XDP program is loaded
/// from it, so that both share the next-hop cache), whether the fast path
/// is on, and notes for the log.
pub struct Installed {
    /// The loaded object.
    pub ebpf: Ebpf,
    /// Whether the fast path is on (`TC_FAST_PATH`).
    pub fast: bool,
    /// Notes for the log (devices detached, fast path limits).
    pub notes: Vec<String>,
}

/// [`install`] for the agent: the TC programs with the fast path as `fast`
/// says, from an object whose next-hop cache is sized when the fast path
/// or XDP (`xdp`) uses it. With `auto`, a kernel that refuses the fast
/// path's programs gets them without it (noted).
pub fn install_external(pin_dir: &Path, devices: &[String], mode: TcMode, fast: TcFastPath, xdp: bool) -> Result<Installed, TcError> {
    let want = fast != TcFastPath::Off;
    let mut notes = Vec::new();
    let (mut ebpf, fast) = match load_external(pin_dir, want, want || xdp) {
        Ok(e) => (e, want),
        Err(e) if want => {
            notes.push(format!(
                "the TC fast path is off: this kernel refused its programs ({}); translated NodePort traffic goes through the stack",
                error_chain(&e)
            ));
            (load_external(pin_dir, false, xdp)?, false)
        }
        Err(e) => return Err(e),
    };
    notes.extend(attach_loaded(pin_dir, &mut ebpf, devices, mode)?);
    Ok(Installed { ebpf, fast, notes })
}

/// Attaches (or upgrades in place) the ingress and egress programs on every
/// device in `devices`, and detaches them from pinned devices that are no
/// longer listed. The socket datapath (`socket_loader::install`) must have created
/// and pinned the maps first. The fast path is off (see [`install_external`]).
pub fn install(pin_dir: &Path, devices: &[String], mode: TcMode) -> Result<Vec<String>, TcError> {
    let mut ebpf = load_programs(pin_dir)?;
    attach_loaded(pin_dir, &mut ebpf, devices, mode)
}

fn attach_loaded(pin_dir: &Path, ebpf: &mut Ebpf, devices: &[String], mode: TcMode) -> Result<Vec<String>, TcError> {
    let mut warnings = Vec::new();
    // Before any program is attached or swapped in: the programs pass every
    // packet whose port has no bit in NP_PORTS, so the bitmap must cover
    // every frontend, backend and tracked flow first, also when it was just
    // created over the pins of an agent version without it.
    let (ingress_ports, egress_ports) = port_bits::fill_from_maps(pin_dir)?;
    tracing::debug!(ingress_ports, egress_ports, "NP_PORTS covers the pinned frontends, backends and flows");
    let links = pins::links(pin_dir);
    fs::create_dir_all(&links).map_err(|source| TcError::Io { path: links.clone(), source })?;
    // tcx (NET_XGRESS) arrived in Linux 6.6; probed, not read off the
    // version (see `KernelFeatures`).
    let tcx = match mode {
        TcMode::Auto => KernelFeatures::get().has(kernel_features::TCX),
        TcMode::Tcx => true,
        TcMode::Netlink => false,
    };
    let legacy = pins::tc_legacy(pin_dir);
    let netns = current_netns();

    for (program, attach_type, dir) in
        [(INGRESS_PROGRAM, TcAttachType::Ingress, "ingress"), (EGRESS_PROGRAM, TcAttachType::Egress, "egress")]
    {
        let prog = classifier(ebpf, program)?;
        for device in devices {
            let pin = pins::tc_link(pin_dir, device, dir);
            let err = |what: &'static str, reason: String| TcError::Attach { device: device.clone(), what, reason };
            if tcx {
                attach_tcx(prog, device, attach_type, &pin).map_err(|(what, reason)| err(what, reason))?;
            } else {
                // Legacy path: the filter lives in the qdisc and stays after
                // we exit. A restart replaces the program of our filter in
                // place (cls_bpf_change on an existing handle swaps the
                // program under RCU), so no packet goes untranslated.
                if let Err(e) = tc::qdisc_add_clsact(device)
                    && !matches!(&e, tc::TcError::IoError(io) if io.kind() == io::ErrorKind::AlreadyExists)
                {
                    warnings.push(format!("device {device}: adding clsact: {e}"));
                }
                let replaced = tc::SchedClassifierLink::attached(device, attach_type, LEGACY_PRIORITY, LEGACY_HANDLE.into(), None)
                    .ok()
                    .and_then(|old| prog.attach_to_link(old).ok());
                let id = if let Some(id) = replaced {
                    id
                } else {
                    let opts = tc::NlOptions { priority: LEGACY_PRIORITY, handle: LEGACY_HANDLE.into(), ..Default::default() };
                    prog.attach_with_options(device, attach_type, TcAttachOptions::Netlink(opts))
                        .map_err(|e| err("netlink attach", error_chain(&e)))?
                };
                let link = prog.take_link(id).map_err(|e| err("take link", error_chain(&e)))?;
                // Dropping the link would detach the filter.
                std::mem::forget(link);
                let mark = legacy.join(legacy_record(device, dir, netns));
                fs::create_dir_all(&mark).map_err(|source| TcError::Io { path: mark.clone(), source })?;
            }
        }
    }

    detach_unlisted(pin_dir, devices, tcx, &mut warnings);
    Ok(warnings)
}

/// Detaches the TC programs from every device this pin directory attached
/// them to (`--devices none`): our pinned tcx links, and our recorded
/// cls_bpf filters in this network namespace. Returns what was detached.
pub fn detach_all(pin_dir: &Path) -> Vec<String> {
    let mut notes = Vec::new();
    detach_unlisted(pin_dir, &[], true, &mut notes);
    notes
}

/// Detaches pinned links and recorded filters of devices not in `devices`
/// (all recorded filters when `tcx`: the programs then live in links).
fn detach_unlisted(pin_dir: &Path, devices: &[String], tcx: bool, warnings: &mut Vec<String>) {
    let links = pins::links(pin_dir);
    let legacy = pins::tc_legacy(pin_dir);
    let netns = current_netns();
    // Devices that were attached by an earlier run but are not listed now.
    if let Ok(rd) = fs::read_dir(&links) {
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(rest) = pins::tc_link_target(&name) else { continue };
            let listed = devices.iter().any(|d| rest == format!("{d}-ingress") || rest == format!("{d}-egress"));
            if !listed {
                if let Ok(link) = PinnedLink::from_pin(e.path()) {
                    let _ = link.unpin();
                } else {
                    let _ = fs::remove_file(e.path());
                }
                warnings.push(format!("detached the TC program from {rest} (no longer in --devices)"));
            }
        }
    }
    if let Ok(rd) = fs::read_dir(&legacy) {
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let listed =
                !tcx && devices.iter().any(|d| name == legacy_record(d, "ingress", netns) || name == legacy_record(d, "egress", netns));
            if !listed {
                if detach_legacy(&name) {
                    warnings.push(format!("detached the clsact filter from {name}"));
                }
                let _ = fs::remove_dir(e.path());
            }
        }
    }
}

/// The network namespace this thread is in: the nsfs inode of
/// /proc/thread-self/ns/net (stable while the namespace exists; two
/// namespaces never share one at the same time).
fn current_netns() -> u64 {
    use std::os::unix::fs::MetadataExt;
    fs::metadata("/proc/thread-self/ns/net").map_or(0, |m| m.ino())
}

/// A `tc-legacy` record's name: the device, the hook and the network
/// namespace the filter lives in. Device names are per namespace, so a
/// record is acted on only in the namespace that made it: an agent, a
/// `reset` or a test's cleanup running elsewhere (e.g. in the host's
/// namespace, for a pin directory whose agent ran in a test namespace)
/// must never detach a filter from a same-named device of its own
/// namespace.
fn legacy_record(device: &str, hook: &str, netns: u64) -> String {
    format!("{device}-{hook}@netns{netns}")
}

/// Removes our cls_bpf filter named by a `tc-legacy` record (best effort:
/// the device may be gone). Only in the namespace that made the record
/// (see `legacy_record`); records of other namespaces, and records without
/// a namespace, are never acted on. Returns whether it detached a filter.
fn detach_legacy(entry: &str) -> bool {
    use aya::programs::links::Link;
    let Some((device_hook, ns)) = entry.rsplit_once("@netns") else { return false };
    if ns.parse::<u64>().ok() != Some(current_netns()) {
        return false;
    }
    let Some((device, hook)) = device_hook.rsplit_once('-') else { return false };
    let t = if hook == "ingress" { TcAttachType::Ingress } else { TcAttachType::Egress };
    match tc::SchedClassifierLink::attached(device, t, LEGACY_PRIORITY, LEGACY_HANDLE.into(), None) {
        Ok(link) => link.detach().is_ok(),
        Err(_) => false,
    }
}

/// Removes what only this module keeps under the pin directory: the legacy
/// filter records, detaching the filters when run in the namespace that
/// attached them (never touching a device of another namespace). Part of
/// `socket_loader::reset`, which removes the tcx link pins (in the links
/// directory) and the maps itself.
pub fn reset(pin_dir: &Path) -> Result<(), (PathBuf, io::Error)> {
    let legacy = pins::tc_legacy(pin_dir);
    if let Ok(rd) = fs::read_dir(&legacy) {
        for e in rd.flatten() {
            detach_legacy(&e.file_name().to_string_lossy());
            fs::remove_dir(e.path()).map_err(|err| (e.path(), err))?;
        }
        fs::remove_dir(&legacy).map_err(|e| (legacy.clone(), e))?;
    }
    Ok(())
}

fn attach_tcx(prog: &mut SchedClassifier, device: &str, attach_type: TcAttachType, pin: &Path) -> Result<(), (&'static str, String)> {
    // Upgrade in place when a link is pinned and still attached.
    if let Ok(old) = PinnedLink::from_pin(pin) {
        let fd: FdLink = old.into();
        match SchedClassifierLink::try_from(fd) {
            Ok(link) => match prog.attach_to_link(link) {
                Ok(id) => {
                    let link = prog.take_link(id).map_err(|e| ("take link", error_chain(&e)))?;
                    // The pin still refers to this link; keep it pinned by
                    // forgetting our handle (dropping would only close the fd,
                    // but be explicit that the pin owns it).
                    let fd: FdLink = link.try_into().map_err(|e| ("link fd", error_chain(&e)))?;
                    drop(fd);
                    return Ok(());
                }
                Err(e) => {
                    // The device may have been recreated: the old link is
                    // defunct. Fall through to a fresh attach.
                    tracing::warn!(device, error = %error_chain(&e), "cannot update the pinned TC link; attaching anew");
                }
            },
            Err(e) => {
                tracing::warn!(device, error = %error_chain(&e), "pinned TC link is not a tcx link; attaching anew");
            }
        }
        let _ = fs::remove_file(pin);
    }
    let id = prog
        .attach_with_options(device, attach_type, TcAttachOptions::TcxOrder(LinkOrder::default()))
        .map_err(|e| ("tcx attach", error_chain(&e)))?;
    let link = prog.take_link(id).map_err(|e| ("take link", error_chain(&e)))?;
    let fd: FdLink = link.try_into().map_err(|e| ("link fd", error_chain(&e)))?;
    fd.pin(pin).map_err(|e| ("pin link", error_chain(&e)))?;
    Ok(())
}

/// Loads the TC programs into the kernel without attaching them, with every
/// map pinned under `pin_dir` (created there when missing). For running the
/// programs alone with `BPF_PROG_TEST_RUN`; the returned object keeps them
/// loaded.
pub fn load_unattached(pin_dir: &Path) -> Result<Ebpf, TcError> {
    mounts::ensure_pin_dir(pin_dir).map_err(|e| TcError::Io { path: pin_dir.into(), source: io::Error::other(e) })?;
    load_programs(pin_dir)
}

/// The eBPF object with every map at its pin under `pin_dir` and both TC
/// programs loaded (verified), not attached.
fn load_programs(pin_dir: &Path) -> Result<Ebpf, TcError> {
    let ebpf = object::load(EBPF_OBJECT, pin_dir, None)?;
    load_classifiers(ebpf)
}

/// [`load_programs`] with the fast path as `fast` and the next-hop cache
/// sized when `nexthops` (see `object::load_external`).
fn load_external(pin_dir: &Path, fast: bool, nexthops: bool) -> Result<Ebpf, TcError> {
    load_classifiers(object::load_external(EBPF_OBJECT, pin_dir, fast, nexthops)?)
}

fn load_classifiers(mut ebpf: Ebpf) -> Result<Ebpf, TcError> {
    for program in [INGRESS_PROGRAM, EGRESS_PROGRAM] {
        classifier(&mut ebpf, program)?.load().map_err(|source| TcError::Program { program, source })?;
    }
    Ok(ebpf)
}

/// The object's name of TC program `program` ([`INGRESS_PROGRAM`] or
/// [`EGRESS_PROGRAM`]) in the variant this kernel loads (see
/// `KernelFeatures`).
pub fn loaded_name(program: &'static str) -> String {
    KernelFeatures::get().tc_variant().program(program)
}

/// The loaded variant of TC program `program`.
fn classifier<'a>(ebpf: &'a mut Ebpf, program: &'static str) -> Result<&'a mut SchedClassifier, TcError> {
    let name = loaded_name(program);
    ebpf.program_mut(&name).ok_or(TcError::MissingProgram { program })?.try_into().map_err(|source| TcError::Program { program, source })
}
