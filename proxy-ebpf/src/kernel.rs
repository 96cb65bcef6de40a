//! Program variants by what the running kernel offers.
//!
//! Every entry point that needs a helper newer than the supported floor
//! (Linux 5.10) is compiled twice, with the const parameter `KERNEL`: the
//! agent probes the kernel's helpers at start-up and loads one variant or
//! the other, so no program branches on the kernel at run time and the
//! verifier never sees a helper call its kernel does not know (an unknown
//! helper id fails the whole load, `check_helper_call`).

use aya_ebpf::helpers::{bpf_ktime_get_coarse_ns, bpf_ktime_get_ns};

/// Every helper the programs can use: `bpf_set_retval` (Linux 5.18) and
/// `bpf_ktime_get_coarse_ns` (5.11).
pub const FULL: u8 = 0;
/// For kernels without those two: the clock is read with
/// `bpf_ktime_get_ns`, and a refused connect() fails with the kernel's
/// default `EPERM` instead of `ECONNREFUSED`.
pub const COMPAT: u8 = 1;

/// CLOCK_MONOTONIC in nanoseconds. The coarse read returns the
/// timekeeper's base as of the last tick (kernel/time/timekeeping.c), where
/// `bpf_ktime_get_ns` also reads the clocksource (a TSC read, or a paravirt
/// clock under a hypervisor) on every call; a tick (at most 10 ms) behind
/// is nothing against second-granular timestamps and timeouts of seconds
/// to hours, and both are the clock the agent reads. `KERNEL` is a
/// constant, so each variant keeps one of the two calls.
#[inline(always)]
pub fn now_ns<const KERNEL: u8>() -> u64 {
    if KERNEL == FULL {
        // SAFETY: the helper takes no arguments and touches no memory of
        // ours (any program type, Linux >= 5.11).
        unsafe { bpf_ktime_get_coarse_ns() }
    } else {
        // SAFETY: as above (any program type, every supported kernel).
        unsafe { bpf_ktime_get_ns() }
    }
}
