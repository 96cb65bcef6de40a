//! Reference programs for `cargo xtask bench`, never used by the agent.
//!
//! They live in the same object so that the benchmark compares our programs
//! with programs built by the same toolchain and loaded the same way. The
//! agent loads programs only by name (`loader::PROGRAMS`,
//! `tc_loader::{INGRESS,EGRESS}_PROGRAM`); aya leaves every other program of
//! the object unloaded, so these cost nothing in the kernel unless the
//! benchmark asks for them.
//!
//! * `bench_empty_connect4`: a cgroup/connect4 program that lets every call
//!   through. The kernel's run-time statistics (`bpf_stats_enabled`) of our
//!   `connect4` are compared with its figure under the same connect() load.
//! * `bench_minimal_tc`: the least a TC program that looks at the same
//!   traffic must do: the parse of Ethernet + IPv4/IPv6 + TCP/UDP ports that
//!   `np_ingress` does, with exactly its bounds checks (it calls the same
//!   `packet::parse`), then pass. The NodePort target is "at most 2x this".
//! * `bench_empty_tc`: returns at once. Under BPF_PROG_TEST_RUN with one run
//!   per call, its figure is the harness' own overhead (timer reads, bh
//!   disable), which the benchmark subtracts from the other two.

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_UNSPEC},
    macros::{cgroup_sock_addr, classifier},
    programs::{SockAddrContext, TcContext},
};

use crate::packet::{Parsed, parse};

#[cgroup_sock_addr(connect4)]
pub fn bench_empty_connect4(_ctx: SockAddrContext) -> i32 {
    1 // allow the connect() unchanged
}

#[classifier]
pub fn bench_minimal_tc(ctx: TcContext) -> i32 {
    try_minimal_tc(&ctx)
}

#[inline(always)]
fn try_minimal_tc(ctx: &TcContext) -> i32 {
    // The verdict depends on every parsed field, so that the compiler
    // keeps the whole parse: the common case reads the packet directly
    // (no helper calls it could not drop), and a result nobody uses would
    // let it drop those reads. Both verdicts let the packet pass.
    let mix = match parse(ctx) {
        Parsed::L4(p) => {
            p.saddr.iter().chain(p.daddr.iter()).fold(0u32, |a, w| a ^ w)
                ^ (u32::from(p.sport_be) << 16 | u32::from(p.dport_be))
                ^ u32::from(p.tcp_flags)
                ^ u32::from(p.proto) << 8
                ^ (p.l4 as u32) << 24
        }
        Parsed::Icmp(i) => i.saddr[0] ^ i.daddr[0],
        Parsed::Other(reason) => reason,
        Parsed::NotIp => 1,
    };
    if mix == 0x5a5a_5a5a { TC_ACT_UNSPEC } else { TC_ACT_OK }
}

#[classifier]
pub fn bench_empty_tc(_ctx: TcContext) -> i32 {
    TC_ACT_OK
}
