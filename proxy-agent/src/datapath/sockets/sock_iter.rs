//! The BPF socket iterators (`proxy-ebpf/src/programs/sock_iter.rs`): loading them
//! on a kernel with the `bpf_sock_destroy` kfunc, and running them once
//! per network namespace for a batch of frontend-backend pairs.
//!
//! aya 0.14 has no kfunc relocation (aya-obj 0.3 relocates calls to
//! BPF-to-BPF functions only: a call to an extern fails with "function
//! ... not found while relocating"), so the programs carry their
//! `bpf_sock_destroy` call as a raw `BPF_PSEUDO_KFUNC_CALL` instruction
//! with a placeholder id, and [`patch_kfunc_calls`] writes the running
//! kernel's BTF id of the kfunc over it before aya sees the object, as
//! libbpf resolves `__ksym` externs. The programs read fixed offsets of
//! `struct sock_common`; they are loaded only when the kernel's BTF has
//! them where the programs expect them.
//!
//! An iterator walks the sockets of the network namespace it was created
//! in (`bpf_iter_init_seq_net`: the creating thread's), so each namespace
//! gets its own iterator, created on the namespace walk's thread.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;
use std::sync::{Mutex, PoisonError};

use aya::Ebpf;
use aya::maps::HashMap;
use aya::programs::Iter;
use proxy_common as pc;
use proxy_common::{SockTerminateKey, SockTerminateValue};

use crate::datapath::loader::kernel_btf::{BtfError, KernelBtf};
use crate::datapath::loader::object::{self, EBPF_OBJECT};
use crate::datapath::sockets::netns::{self, Namespace};
use crate::util::error_chain::error_chain;

/// The programs, by the iterator target each attaches to.
const PROGRAMS: [(&str, &str); 2] = [("sock_terminate_tcp", "tcp"), ("sock_terminate_udp", "udp")];

/// The `struct sock_common` members the programs read, at the offsets
/// they read them.
const LAYOUT: [(&str, usize); 5] = [
    ("skc_daddr", pc::SKC_DADDR_OFF),
    ("skc_dport", pc::SKC_DPORT_OFF),
    ("skc_family", pc::SKC_FAMILY_OFF),
    ("skc_state", pc::SKC_STATE_OFF),
    ("skc_v6_daddr", pc::SKC_V6_DADDR_OFF),
];

/// Writes `btf_id` into every placeholder kfunc call of `object`; returns
/// the patched copy and how many calls it patched. The placeholder is an
/// 8-byte instruction with a 32-bit magic, which nothing else in the
/// object spells.
pub fn patch_kfunc_calls(object: &[u8], btf_id: u32) -> (Vec<u8>, usize) {
    let insn = pc::SOCK_DESTROY_KFUNC_INSN.to_le_bytes();
    let mut out = object.to_vec();
    let mut n = 0;
    // Instructions are 8-byte aligned within their section, and sections
    // within the file.
    for at in (0..out.len().saturating_sub(7)).step_by(8) {
        if out[at..at + 8] == insn {
            out[at + 4..at + 8].copy_from_slice(&btf_id.to_le_bytes());
            n += 1;
        }
    }
    (out, n)
}

/// Why the socket iterators could not be loaded (the agent then falls back to netlink).
#[derive(Debug, thiserror::Error)]
pub enum IterError {
    /// The kernel's BTF could not be read.
    #[error(transparent)]
    Btf(#[from] BtfError),
    /// The kernel has no `bpf_sock_destroy` kfunc.
    #[error("no bpf_sock_destroy kfunc in this kernel (Linux < 6.5)")]
    NoKfunc,
    /// The kernel's BTF lacks `struct sock_common`.
    #[error("no struct sock_common in the kernel's BTF")]
    NoSockCommon,
    /// A field of `struct sock_common` is not where the iterators read it.
    #[error("struct sock_common has {field} at {found:?}, the iterators read it at {expected}")]
    Layout {
        /// The field.
        field: &'static str,
        /// Its offset in the kernel's BTF, `None` when missing.
        found: Option<usize>,
        /// The offset the programs read.
        expected: usize,
    },
    /// The object does not hold the number of kfunc calls expected (a build mismatch).
    #[error("the eBPF object has {found} bpf_sock_destroy calls to patch, expected {expected}")]
    Patch {
        /// Calls found.
        found: usize,
        /// Calls expected.
        expected: usize,
    },
    /// The object could not be loaded.
    #[error("loading the eBPF object")]
    Object(#[source] aya::EbpfError),
    /// aya could not read the kernel's BTF.
    #[error("reading the kernel's BTF for aya")]
    KernelBtf(#[source] aya::BtfError),
    /// The object lacks an iterator program.
    #[error("no program {0} in the eBPF object")]
    NoProgram(&'static str),
    /// A program could not be loaded.
    #[error("{name}")]
    Program {
        /// The program.
        name: &'static str,
        /// The error.
        #[source]
        source: aya::programs::ProgramError,
    },
    /// An iterator could not be created.
    #[error("{name}: creating the iterator")]
    Link {
        /// The program.
        name: &'static str,
        /// The error.
        #[source]
        source: aya::programs::links::LinkError,
    },
    /// An iterator could not be read.
    #[error("{name}: reading the iterator")]
    Read {
        /// The program.
        name: &'static str,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The object lacks `SOCK_TERMINATE`.
    #[error("no {} map in the eBPF object", pc::SOCK_TERMINATE_MAP)]
    NoMap,
    /// `SOCK_TERMINATE` could not be opened.
    #[error("{}", pc::SOCK_TERMINATE_MAP)]
    Map(#[source] aya::maps::MapError),
}

/// The loaded iterators, with their own load of the object: the pinned
/// maps shared with every other program (`SOCK_REVNAT` among them), and
/// `SOCK_TERMINATE`, which only they and this agent use.
pub struct SockIterators {
    ebpf: Ebpf,
}

impl std::fmt::Debug for SockIterators {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SockIterators")
    }
}

/// What one walk found.
#[derive(Debug, Default)]
pub struct Walk {
    /// Namespaces visited.
    pub namespaces: usize,
    /// Per pair, what the programs counted.
    pub counts: BTreeMap<SockTerminateKey, SockTerminateValue>,
    /// Namespaces (or steps) that failed, with why.
    pub errors: Vec<String>,
}

impl SockIterators {
    /// Loads the iterators for the maps pinned under `pin_dir`, or says
    /// why this kernel cannot have them.
    pub fn load(pin_dir: &Path) -> Result<SockIterators, IterError> {
        let btf = KernelBtf::from_sys_fs()?;
        let kfunc = btf.func_id("bpf_sock_destroy").ok_or(IterError::NoKfunc)?;
        let layout = btf.member_offsets("sock_common").ok_or(IterError::NoSockCommon)?;
        for (field, expected) in LAYOUT {
            if layout.get(field) != Some(&expected) {
                return Err(IterError::Layout { field, found: layout.get(field).copied(), expected });
            }
        }
        let (patched, found) = patch_kfunc_calls(EBPF_OBJECT, kfunc);
        if found < PROGRAMS.len() {
            return Err(IterError::Patch { found, expected: PROGRAMS.len() });
        }
        let mut ebpf = object::load(&patched, pin_dir, None).map_err(IterError::Object)?;
        let kernel = aya::Btf::from_sys_fs().map_err(IterError::KernelBtf)?;
        for (name, target) in PROGRAMS {
            program(&mut ebpf, name)?.load(target, &kernel).map_err(|source| IterError::Program { name, source })?;
        }
        Ok(SockIterators { ebpf })
    }

    /// Aborts, in every namespace of `namespaces`, the sockets of the
    /// `pairs` (at most `MAX_SOCK_TERMINATE` per call), and returns what
    /// the programs counted per pair.
    pub fn walk(&mut self, pairs: &[SockTerminateKey], namespaces: &[Namespace]) -> Walk {
        let mut walk = Walk { namespaces: namespaces.len(), ..Walk::default() };
        let protos: Vec<u8> = [pc::PROTO_TCP, pc::PROTO_UDP].into_iter().filter(|p| pairs.iter().any(|k| k.proto == *p)).collect();
        if let Err(e) = self.fill(pairs) {
            walk.errors.push(error_chain(&e));
            return walk;
        }
        let ebpf = Mutex::new(&mut self.ebpf);
        let results = netns::in_each(namespaces, |_| {
            let mut ebpf = ebpf.lock().unwrap_or_else(PoisonError::into_inner);
            let mut errors = Vec::new();
            for proto in &protos {
                let name = if *proto == pc::PROTO_TCP { PROGRAMS[0].0 } else { PROGRAMS[1].0 };
                if let Err(e) = run_once(&mut ebpf, name) {
                    errors.push(error_chain(&e));
                }
            }
            errors
        });
        for (inode, r) in results {
            match r {
                Ok(errors) => walk.errors.extend(errors.into_iter().map(|e| format!("netns {inode}: {e}"))),
                // A namespace whose last process exited meanwhile.
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
                Err(e) => walk.errors.push(format!("netns {inode}: entering: {e}")),
            }
        }
        match self.drain() {
            Ok(counts) => walk.counts = counts,
            Err(e) => walk.errors.push(error_chain(&e)),
        }
        walk
    }

    fn map(&mut self) -> Result<HashMap<&mut aya::maps::MapData, SockTerminateKey, SockTerminateValue>, IterError> {
        let map = self.ebpf.map_mut(pc::SOCK_TERMINATE_MAP).ok_or(IterError::NoMap)?;
        HashMap::try_from(map).map_err(IterError::Map)
    }

    fn fill(&mut self, pairs: &[SockTerminateKey]) -> Result<(), IterError> {
        let mut map = self.map()?;
        for k in pairs.iter().take(pc::MAX_SOCK_TERMINATE as usize) {
            map.insert(k, SockTerminateValue::default(), 0).map_err(IterError::Map)?;
        }
        Ok(())
    }

    /// Reads the counts back and empties the map for the next walk.
    fn drain(&mut self) -> Result<BTreeMap<SockTerminateKey, SockTerminateValue>, IterError> {
        let mut map = self.map()?;
        let keys: Vec<SockTerminateKey> = map.keys().filter_map(Result::ok).collect();
        let mut out = BTreeMap::new();
        for k in keys {
            if let Ok(v) = map.get(&k, 0) {
                out.insert(k, v);
            }
            let _ = map.remove(&k);
        }
        Ok(out)
    }
}

fn program<'a>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut Iter, IterError> {
    ebpf.program_mut(name).ok_or(IterError::NoProgram(name))?.try_into().map_err(|source| IterError::Program { name, source })
}

/// Creates one iterator of program `name` in the calling thread's
/// namespace and reads it to the end: the kernel runs the program once per
/// socket of the namespace meanwhile.
fn run_once(ebpf: &mut Ebpf, name: &'static str) -> Result<(), IterError> {
    let prog = program(ebpf, name)?;
    let id = prog.attach().map_err(|source| IterError::Program { name, source })?;
    let link = prog.take_link(id).map_err(|source| IterError::Program { name, source })?;
    let mut file = link.into_file().map_err(|source| IterError::Link { name, source })?;
    let mut sink = Vec::new();
    file.read_to_end(&mut sink).map_err(|source| IterError::Read { name, source })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_placeholder_call_gets_the_id_and_nothing_else_changes() {
        let insn = pc::SOCK_DESTROY_KFUNC_INSN.to_le_bytes();
        let other = [0x85u8, 0, 0, 0, 1, 0, 0, 0];
        let mut object = Vec::new();
        for chunk in [&other, &insn, &other, &insn] {
            object.extend_from_slice(chunk);
        }
        // The same bytes off the instruction grid are not an instruction.
        object.extend_from_slice(&[0, 0, 0, 0]);
        object.extend_from_slice(&insn);
        object.extend_from_slice(&[0, 0, 0, 0]);
        let (patched, n) = patch_kfunc_calls(&object, 65_741);
        assert_eq!(n, 2);
        let mut want = insn;
        want[4..].copy_from_slice(&65_741u32.to_le_bytes());
        assert_eq!(&patched[8..16], &want);
        assert_eq!(&patched[24..32], &want);
        assert_eq!(&patched[..8], &other);
        assert_eq!(&patched[32..], &object[32..], "misaligned bytes stay");
        assert_eq!(want[1], 0x20, "src_reg BPF_PSEUDO_KFUNC_CALL");
    }

    #[test]
    fn the_embedded_object_carries_one_placeholder_per_program() {
        let (_, n) = patch_kfunc_calls(EBPF_OBJECT, 1);
        assert_eq!(n, PROGRAMS.len());
    }
}
