//! `BPF_PROG_TEST_RUN`: runs a loaded packet program on a frame in the
//! kernel without attaching it. The tests use it for the TC programs'
//! parsing and translation edge cases, and the benchmark for their cost per
//! packet. aya 0.14 has no wrapper for it, so this is the raw syscall.

use std::io;

/// The `test` member of `union bpf_attr` (include/uapi/linux/bpf.h).
#[repr(C)]
#[derive(Default)]
struct TestAttr {
    prog_fd: u32,
    retval: u32,
    data_size_in: u32,
    data_size_out: u32,
    data_in: u64,
    data_out: u64,
    repeat: u32,
    duration: u32,
    ctx_size_in: u32,
    ctx_size_out: u32,
    ctx_in: u64,
    ctx_out: u64,
    flags: u32,
    cpu: u32,
    batch_size: u32,
    _pad: u32,
}

const BPF_PROG_TEST_RUN: libc::c_long = 10;

/// What one test run returned.
#[derive(Clone, Copy, Debug)]
pub struct TestRun {
    /// The program's return value (a TC verdict for TC programs).
    pub retval: i32,
    /// Nanoseconds per run, as the kernel measured it over `repeat` runs.
    pub duration_ns: u32,
    /// Bytes of the frame after the run, written to the start of `out`.
    pub out_len: usize,
}

/// Runs `prog_fd` on `frame` `repeat` times (the kernel runs it on the same
/// buffer each time); the frame after the last run lands in `out`.
pub fn run(prog_fd: i32, frame: &[u8], out: &mut [u8], repeat: u32) -> io::Result<TestRun> {
    let mut attr = TestAttr {
        prog_fd: prog_fd as u32,
        data_size_in: frame.len() as u32,
        data_size_out: out.len() as u32,
        data_in: frame.as_ptr() as u64,
        data_out: out.as_mut_ptr() as u64,
        repeat,
        ..Default::default()
    };
    // SAFETY: `attr` and the buffers it points at outlive the call; the
    // kernel writes at most `data_size_out` bytes to `out`.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, BPF_PROG_TEST_RUN, &raw mut attr, std::mem::size_of::<TestAttr>()) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(TestRun { retval: attr.retval as i32, duration_ns: attr.duration, out_len: (attr.data_size_out as usize).min(out.len()) })
}

/// `BPF_F_TEST_XDP_LIVE_FRAMES` (include/uapi/linux/bpf.h, Linux 5.18+).
const BPF_F_TEST_XDP_LIVE_FRAMES: u32 = 1 << 1;

/// `struct xdp_md` as `ctx_in` of an XDP test run: only the ingress
/// device is set, the rest must be zero (net/bpf/test_run.c,
/// `xdp_convert_md_to_buff`).
#[repr(C)]
#[derive(Default)]
struct XdpMd {
    data: u32,
    data_end: u32,
    data_meta: u32,
    ingress_ifindex: u32,
    rx_queue_index: u32,
    egress_ifindex: u32,
}

/// Runs the XDP program `prog_fd` `repeat` times in live-frames mode: each
/// run gets a fresh copy of `frame` as if it had been received on device
/// `ifindex` (in the caller's network namespace), and what the program
/// returns is carried out for real: XDP_TX sends the frame out of
/// `ifindex`, XDP_REDIRECT to the redirect target (net/bpf/test_run.c,
/// `xdp_test_run_batch`). This is how a traffic generator feeds a path at
/// XDP speed without building an skb per packet. The kernel may stop early
/// on a pending signal; the caller times the call itself.
pub fn xdp_live_frames(prog_fd: i32, frame: &[u8], ifindex: u32, repeat: u32) -> io::Result<()> {
    let ctx = XdpMd { data_end: frame.len() as u32, ingress_ifindex: ifindex, ..Default::default() };
    let mut attr = TestAttr {
        prog_fd: prog_fd as u32,
        data_size_in: frame.len() as u32,
        data_in: frame.as_ptr() as u64,
        repeat,
        ctx_size_in: std::mem::size_of::<XdpMd>() as u32,
        ctx_in: (&raw const ctx) as u64,
        flags: BPF_F_TEST_XDP_LIVE_FRAMES,
        ..Default::default()
    };
    // SAFETY: `attr`, `frame` and `ctx` outlive the call; live-frames mode
    // writes nothing back to user memory (no data_out, no ctx_out).
    let rc = unsafe { libc::syscall(libc::SYS_bpf, BPF_PROG_TEST_RUN, &raw mut attr, std::mem::size_of::<TestAttr>()) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
