//! What the running kernel offers the datapath, probed once at start-up.
//!
//! The agent asks the kernel, not its version: distribution kernels carry
//! backports both ways, so the same version number can mean different
//! helpers. Each helper is probed the way libbpf does it (aya's
//! `is_helper_supported`: load a two-instruction program that calls it and
//! read the verifier's answer), tcx by the presence of its code in the
//! kernel's BTF, cgroup bpf_links and batch map operations by asking for
//! one (`cgroup_link`, `kernel_batches`). From the answers the loaders pick a program variant (see
//! `proxy-ebpf/src/kernel.rs`): the full one, or the compat one for
//! kernels without `bpf_set_retval` or the coarse clock. Nothing branches
//! on the kernel at run time.
//!
//! The floor is Linux 5.10 with the helpers the programs cannot do
//! without; below it the agent stops before it pins or attaches anything,
//! with one sentence naming what is missing.
//!
//! `TOPOPROXY_KERNEL_HIDE=name,...` makes the probe report the named
//! features absent, so that the fallbacks (the compat programs, clsact)
//! can be tried, and tested, on a kernel that has everything.

use std::io;
use std::mem::size_of;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::OnceLock;

use aya::programs::ProgramType;
use aya::sys::{BpfHelper, is_helper_supported};
use aya::util::KernelVersion;

/// The oldest kernel the datapath is built and tested for.
pub const FLOOR: (u32, u32) = (5, 10);

/// One probed capability.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Feature {
    /// Short name, as `/metrics` (`topoproxy_kernel_feature{name}`) and
    /// `dump` show it.
    pub name: &'static str,
    /// Whether the running kernel has it (and [`HIDE_ENV`] does not hide it).
    pub present: bool,
    /// What the agent does without it: the fallback, or "required".
    pub without: &'static str,
}

/// What the kernel offers, in probe order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelFeatures {
    /// `uname -r`.
    pub release: String,
    /// Below [`FLOOR`] by the kernel's own version.
    pub below_floor: bool,
    /// Every feature probed, in a fixed order.
    pub features: Vec<Feature>,
}

/// Which build of the programs the loaders attach.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Variant {
    /// Every helper the programs can use.
    Full,
    /// `bpf_ktime_get_ns` for the clock, and (socket programs) the
    /// kernel's default `EPERM` for a refused connect().
    Compat,
}

impl Variant {
    /// The object's name of program `base` in this variant.
    pub fn program(self, base: &'static str) -> String {
        match self {
            Variant::Full => base.to_string(),
            Variant::Compat => format!("{base}_compat"),
        }
    }

    /// `full` or `compat`, for `/metrics` and `dump`.
    pub fn label(self) -> &'static str {
        match self {
            Variant::Full => "full",
            Variant::Compat => "compat",
        }
    }
}

/// `bpf_set_retval` in the socket programs (Linux 5.18): a refused connect() gets ECONNREFUSED.
pub const SET_RETVAL: &str = "set_retval";
/// `bpf_ktime_get_coarse_ns` (Linux 5.11): the cheaper clock for affinity and conntrack times.
pub const COARSE_CLOCK: &str = "coarse_clock";
/// `bpf_get_netns_cookie` in the socket programs: tells clients apart for session affinity.
pub const NETNS_COOKIE: &str = "netns_cookie";
/// `bpf_sk_storage_get` in the socket programs: UDP reverse translation state on the socket.
pub const SK_STORAGE: &str = "sk_storage";
/// The `SO_NETNS_COOKIE` socket option (Linux 5.14): the agent's own namespace's cookie.
pub const SO_NETNS_COOKIE: &str = "so_netns_cookie";
/// tcx links for TC programs (`BPF_TCX_INGRESS`/`EGRESS`, Linux 6.6).
pub const TCX: &str = "tcx";
/// bpf_link for cgroup programs (Linux 5.7): pinned links keep the socket programs attached across
/// restarts.
pub const BPF_LINK: &str = "bpf_link";
/// Batched map operations (`BPF_MAP_*_BATCH`, Linux 5.6).
pub const BATCH_OPS: &str = "batch_ops";

/// Features named here (comma-separated) are reported absent.
pub const HIDE_ENV: &str = "TOPOPROXY_KERNEL_HIDE";

/// Whether [`HIDE_ENV`] names feature `name`: for probes made elsewhere
/// (the socket iterators' kfunc, `sock_destroy`) that honour it too.
pub fn hidden(name: &str) -> bool {
    std::env::var(HIDE_ENV).is_ok_and(|list| listed(&list, name))
}

/// Whether the comma-separated `list` names `name`.
fn listed(list: &str, name: &str) -> bool {
    list.split(',').any(|f| f.trim() == name)
}

impl KernelFeatures {
    /// The running kernel's answers, probed on the first call.
    pub fn get() -> &'static KernelFeatures {
        static PROBED: OnceLock<KernelFeatures> = OnceLock::new();
        PROBED.get_or_init(KernelFeatures::probe)
    }

    fn probe() -> KernelFeatures {
        let release = release();
        let below_floor = KernelVersion::current().is_ok_and(|v| v < KernelVersion::new(FLOOR.0 as u8, FLOOR.1 as u8, 0));
        let helper = |ty: ProgramType, h: BpfHelper| {
            // A probe that cannot run at all (no BPF) reads as "absent": the
            // real load then fails with the kernel's own words.
            is_helper_supported(ty, h).unwrap_or(false)
        };
        let sock = ProgramType::CgroupSockAddr;
        let features = vec![
            Feature {
                name: SET_RETVAL,
                present: helper(sock, BpfHelper::BPF_FUNC_set_retval),
                without: "a connect() to a Service without endpoints fails with EPERM instead of ECONNREFUSED",
            },
            Feature {
                name: COARSE_CLOCK,
                present: helper(sock, BpfHelper::BPF_FUNC_ktime_get_coarse_ns)
                    && helper(ProgramType::SchedClassifier, BpfHelper::BPF_FUNC_ktime_get_coarse_ns),
                without: "the programs read the clock with bpf_ktime_get_ns",
            },
            Feature {
                name: NETNS_COOKIE,
                present: helper(sock, BpfHelper::BPF_FUNC_get_netns_cookie),
                without: "required (session affinity and the node's own sockets are keyed by it)",
            },
            Feature {
                name: SK_STORAGE,
                present: helper(sock, BpfHelper::BPF_FUNC_sk_storage_get),
                without: "required (UDP reverse translation keeps its state on the socket)",
            },
            Feature {
                name: SO_NETNS_COOKIE,
                present: so_netns_cookie(),
                without: "the node's own processes are not told apart from pods: loadBalancerSourceRanges that include a node address do not admit them",
            },
            Feature { name: TCX, present: tcx(), without: "TC programs attach through clsact and cls_bpf (netlink)" },
            Feature {
                name: BPF_LINK,
                present: cgroup_link(),
                without: "required (the socket programs stay attached across restarts through pinned bpf_links)",
            },
            Feature { name: BATCH_OPS, present: kernel_batches(), without: "maps are written, deleted and read one entry per bpf(2) call" },
        ];
        let mut k = KernelFeatures { release, below_floor, features };
        if let Ok(hide) = std::env::var(HIDE_ENV) {
            k.hide(&hide);
        }
        k
    }

    /// Reports the features named in `list` (comma-separated) absent.
    fn hide(&mut self, list: &str) {
        for f in self.features.iter_mut().filter(|f| listed(list, f.name)) {
            f.present = false;
        }
    }

    /// Whether feature `name` (one of the constants above) is present.
    pub fn has(&self, name: &str) -> bool {
        self.features.iter().any(|f| f.name == name && f.present)
    }

    /// The socket programs' variant.
    pub fn socket_variant(&self) -> Variant {
        if self.has(SET_RETVAL) && self.has(COARSE_CLOCK) { Variant::Full } else { Variant::Compat }
    }

    /// The TC programs' variant.
    pub fn tc_variant(&self) -> Variant {
        if self.has(COARSE_CLOCK) { Variant::Full } else { Variant::Compat }
    }

    /// Why this kernel cannot run the datapath, in one sentence; `None`
    /// when it can.
    pub fn unsupported(&self) -> Option<String> {
        if self.below_floor {
            return Some(format!("Linux {} is older than {}.{}, the oldest kernel the datapath supports", self.release, FLOOR.0, FLOOR.1));
        }
        self.features.iter().find(|f| !f.present && f.without.starts_with("required")).map(|f| {
            format!("Linux {} lacks {} for cgroup socket programs, which the datapath requires", self.release, helper_name(f.name))
        })
    }

    /// One line for the start-up log: what was found and what falls back.
    pub fn summary(&self) -> String {
        let found: Vec<&str> = self.features.iter().filter(|f| f.present).map(|f| f.name).collect();
        let missing: Vec<String> = self.features.iter().filter(|f| !f.present).map(|f| format!("{} ({})", f.name, f.without)).collect();
        format!(
            "Linux {}: programs {} (socket) / {} (TC); found: {}; fallbacks: {}",
            self.release,
            self.socket_variant().label(),
            self.tc_variant().label(),
            if found.is_empty() { "none".to_string() } else { found.join(", ") },
            if missing.is_empty() { "none".to_string() } else { missing.join("; ") }
        )
    }
}

fn helper_name(feature: &str) -> &'static str {
    match feature {
        NETNS_COOKIE => "the bpf_get_netns_cookie helper",
        SK_STORAGE => "the bpf_sk_storage_get helper",
        BPF_LINK => "bpf_link attachment (BPF_LINK_CREATE, Linux 5.7)",
        _ => "a required feature",
    }
}

fn release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease").map_or_else(|_| "(unknown)".to_string(), |s| s.trim().to_string())
}

/// `SO_NETNS_COOKIE` (Linux 5.14), which tells the agent the cookie of its
/// own network namespace.
fn so_netns_cookie() -> bool {
    netns_cookie().is_ok()
}

/// The cookie of the calling thread's network namespace, as
/// `bpf_get_netns_cookie` reports it for a socket there (`SO_NETNS_COOKIE`,
/// Linux >= 5.14, net/core/sock.c).
pub fn netns_cookie() -> io::Result<u64> {
    // SAFETY: socket(2) returns a new descriptor that we own, or -1.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is open and owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut cookie: u64 = 0;
    let mut len = size_of::<u64>() as libc::socklen_t;
    // SAFETY: SO_NETNS_COOKIE writes a u64 into the buffer we pass with its size.
    let rc = unsafe { libc::getsockopt(fd.as_raw_fd(), libc::SOL_SOCKET, libc::SO_NETNS_COOKIE, (&raw mut cookie).cast(), &raw mut len) };
    if rc == 0 { Ok(cookie) } else { Err(io::Error::last_os_error()) }
}

/// tcx (Linux 6.6, `kernel/bpf/tcx.c`): the kernel's BTF names `struct
/// tcx_entry` exactly when the code is built in. BTF keeps every type name
/// NUL-terminated in its string section, so finding the name is enough.
fn tcx() -> bool {
    std::fs::read("/sys/kernel/btf/vmlinux").is_ok_and(|btf| btf.windows(11).any(|w| w == b"\0tcx_entry\0"))
}

/// `bpf(2)` commands and constants of the probes (include/uapi/linux/bpf.h).
const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_LINK_CREATE: libc::c_long = 28;
const BPF_PROG_TYPE_CGROUP_SOCK_ADDR: u32 = 18;
const BPF_CGROUP_INET4_CONNECT: u32 = 10;

/// The `BPF_PROG_LOAD` member of `union bpf_attr`, up to
/// `expected_attach_type`; the kernel zero-extends a shorter attr.
#[repr(C)]
#[derive(Default)]
struct ProgLoadAttr {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
    prog_ifindex: u32,
    expected_attach_type: u32,
}

/// The `link_create` member of `union bpf_attr`, without the per-type
/// tail a cgroup link does not use.
#[repr(C)]
struct LinkCreateAttr {
    prog_fd: u32,
    target_fd: u32,
    attach_type: u32,
    flags: u32,
}

/// One bpf(2) call that returns a new descriptor.
///
/// # Safety
///
/// `attr` must be the attr layout of `cmd`, and every pointer in it valid
/// for the kernel to read for the duration of the call.
unsafe fn bpf_fd<A>(cmd: libc::c_long, attr: &A) -> io::Result<OwnedFd> {
    // SAFETY: as the caller promised; the kernel reads `size_of::<A>()`
    // bytes of `attr`.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, std::ptr::from_ref(attr), size_of::<A>()) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: on success these commands return a new descriptor that only
    // we hold.
    Ok(unsafe { OwnedFd::from_raw_fd(rc as i32) })
}

/// bpf_link for cgroup programs (`BPF_LINK_CREATE`, Linux 5.7), probed
/// the way libbpf probes perf links: asked to link a loaded cgroup/connect4
/// program to a descriptor that does not exist, a kernel that knows links
/// for this attach type looks the cgroup up and fails with EBADF
/// (kernel/bpf/syscall.c: link_create -> cgroup_bpf_link_attach ->
/// cgroup_get_from_fd); one that does not fails with EINVAL. Nothing is
/// attached either way.
fn cgroup_link() -> bool {
    // r0 = 1 (allow); exit.
    let insns: [u64; 2] = [0x0000_0001_0000_00b7, 0x0000_0000_0000_0095];
    let license = c"GPL";
    let load = ProgLoadAttr {
        prog_type: BPF_PROG_TYPE_CGROUP_SOCK_ADDR,
        insn_cnt: insns.len() as u32,
        insns: insns.as_ptr() as u64,
        license: license.as_ptr() as u64,
        expected_attach_type: BPF_CGROUP_INET4_CONNECT,
        ..Default::default()
    };
    // SAFETY: `load` is a BPF_PROG_LOAD attr whose instruction and license
    // pointers name live buffers of the sizes it states.
    let Ok(prog) = (unsafe { bpf_fd(BPF_PROG_LOAD, &load) }) else { return false };
    let link = LinkCreateAttr { prog_fd: prog.as_raw_fd() as u32, target_fd: u32::MAX, attach_type: BPF_CGROUP_INET4_CONNECT, flags: 0 };
    // SAFETY: `link` is a BPF_LINK_CREATE attr without pointers.
    match unsafe { bpf_fd(BPF_LINK_CREATE, &link) } {
        Ok(_attached_to_nothing) => true,
        Err(e) => e.raw_os_error() == Some(libc::EBADF),
    }
}

/// Whether the kernel takes `BPF_MAP_UPDATE_BATCH` on a hash map (Linux
/// 5.6, kernel/bpf/syscall.c: bpf_map_do_batch): one element written into a
/// fresh two-entry map. Older kernels answer EINVAL for the unknown
/// command, and a map type without batch code EOPNOTSUPP.
fn kernel_batches() -> bool {
    const BPF_MAP_CREATE: libc::c_long = 0;
    const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;
    /// The `BPF_MAP_CREATE` member of `union bpf_attr`, up to `map_flags`.
    #[repr(C)]
    struct CreateAttr {
        map_type: u32,
        key_size: u32,
        value_size: u32,
        max_entries: u32,
        map_flags: u32,
    }
    /// The `batch` member of `union bpf_attr`.
    #[repr(C)]
    struct BatchAttr {
        in_batch: u64,
        out_batch: u64,
        keys: u64,
        values: u64,
        count: u32,
        map_fd: u32,
        elem_flags: u64,
        flags: u64,
    }
    let create = CreateAttr { map_type: 1 /* BPF_MAP_TYPE_HASH */, key_size: 4, value_size: 4, max_entries: 2, map_flags: 0 };
    // SAFETY: a BPF_MAP_CREATE attr without pointers.
    let Ok(map) = (unsafe { bpf_fd(BPF_MAP_CREATE, &create) }) else { return false };
    let (key, value) = (7u32, 9u32);
    let mut attr = BatchAttr {
        in_batch: 0,
        out_batch: 0,
        keys: std::ptr::from_ref(&key) as u64,
        values: std::ptr::from_ref(&value) as u64,
        count: 1,
        map_fd: map.as_raw_fd() as u32,
        elem_flags: 0,
        flags: 0,
    };
    // SAFETY: the map has 4-byte keys and values, and `keys`/`values` point
    // at one of each, alive across the call; the kernel writes back only
    // `count` inside `attr`.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, BPF_MAP_UPDATE_BATCH, std::ptr::from_mut(&mut attr), size_of::<BatchAttr>()) };
    rc == 0 && attr.count == 1
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(present: &[&'static str]) -> KernelFeatures {
        let all = [SET_RETVAL, COARSE_CLOCK, NETNS_COOKIE, SK_STORAGE, SO_NETNS_COOKIE, TCX, BPF_LINK, BATCH_OPS];
        let features = all
            .iter()
            .map(|name| Feature {
                name,
                present: present.contains(name),
                without: if [NETNS_COOKIE, SK_STORAGE, BPF_LINK].contains(name) { "required (x)" } else { "fallback" },
            })
            .collect();
        KernelFeatures { release: "test".into(), below_floor: false, features }
    }

    /// (kernel, features present, socket variant, TC variant, refused)
    #[test]
    fn variants_follow_the_helpers() {
        let all = [SET_RETVAL, COARSE_CLOCK, NETNS_COOKIE, SK_STORAGE, SO_NETNS_COOKIE, TCX, BPF_LINK, BATCH_OPS];
        let cases: [(&str, &[&'static str], Variant, Variant, bool); 7] = [
            ("6.6+", &all, Variant::Full, Variant::Full, false),
            (
                "5.18",
                &[SET_RETVAL, COARSE_CLOCK, NETNS_COOKIE, SK_STORAGE, SO_NETNS_COOKIE, BPF_LINK, BATCH_OPS],
                Variant::Full,
                Variant::Full,
                false,
            ),
            (
                "5.15",
                &[COARSE_CLOCK, NETNS_COOKIE, SK_STORAGE, SO_NETNS_COOKIE, BPF_LINK, BATCH_OPS],
                Variant::Compat,
                Variant::Full,
                false,
            ),
            ("5.10", &[NETNS_COOKIE, SK_STORAGE, BPF_LINK, BATCH_OPS], Variant::Compat, Variant::Compat, false),
            ("no batches", &[NETNS_COOKIE, SK_STORAGE, BPF_LINK], Variant::Compat, Variant::Compat, false),
            ("no sk storage", &[NETNS_COOKIE, BPF_LINK], Variant::Compat, Variant::Compat, true),
            ("no links", &[NETNS_COOKIE, SK_STORAGE], Variant::Compat, Variant::Compat, true),
        ];
        for (kernel, present, socket, tc, refused) in cases {
            let k = with(present);
            assert_eq!((k.socket_variant(), k.tc_variant()), (socket, tc), "{kernel}");
            assert_eq!(k.unsupported().is_some(), refused, "{kernel}: {:?}", k.unsupported());
        }
        let k = with(&[NETNS_COOKIE, BPF_LINK]);
        assert_eq!(
            k.unsupported().as_deref(),
            Some("Linux test lacks the bpf_sk_storage_get helper for cgroup socket programs, which the datapath requires")
        );
        let old = KernelFeatures { below_floor: true, ..with(&all) };
        assert!(old.unsupported().is_some_and(|s| s.contains("older than 5.10")));
        let mut hidden = with(&all);
        hidden.hide("set_retval, tcx,unknown");
        assert_eq!((hidden.socket_variant(), hidden.has(TCX), hidden.has(COARSE_CLOCK)), (Variant::Compat, false, true));
        assert_eq!(Variant::Compat.program("connect4"), "connect4_compat");
        assert_eq!(Variant::Full.program("np_ingress"), "np_ingress");
    }

    /// The machine the tests run on has every feature (Linux 6.18).
    #[test]
    fn this_kernel_gets_the_full_programs() {
        let k = KernelFeatures::get();
        assert_eq!(k.unsupported(), None, "{}", k.summary());
        assert!(k.summary().contains("programs "), "{}", k.summary());
        assert!(k.has(BPF_LINK) && k.has(BATCH_OPS), "{}", k.summary());
    }
}
