//! The eBPF object: the entry points of every program, each a thin wrapper
//! around a `try_` function of `programs/`, which fails open and counts by
//! reason. The program and map names are what the agent loads and pins by,
//! so they must not change.
//!
//! - `programs/`: the logic of each program family: `sock` (the cgroup
//!   `sock_addr` and `sock_release` hooks: ClusterIP at connect/sendmsg),
//!   `nodeport` (the TC programs: NodePort, LoadBalancer, externalIPs) with
//!   its `icmp` errors and `tc_fast` path, `xdp`, `sock_iter` (the socket
//!   iterators that abort departed backends' sockets) and `baseline` (the
//!   benchmark's step programs, entry points included).
//! - `maps`, `nodeport_maps`, `maglev_maps`: the map definitions, by
//!   datapath; `packet`, `sockaddr`, `kernel`: helpers the programs share.

#![no_std]
#![no_main]
// `sock_iter` emits its kfunc call as a raw instruction (aya 0.14 has no kfunc relocation).
#![feature(asm_experimental_arch)]

mod kernel;
mod maglev_maps;
mod maps;
mod nodeport_maps;
mod packet;
mod programs;
mod sockaddr;

use aya_ebpf::{
    macros::{cgroup_sock, cgroup_sock_addr, classifier, xdp},
    programs::{SockAddrContext, SockContext, TcContext, XdpContext},
};
use proxy_common::{FAMILY_V4, FAMILY_V6, PROTO_TCP, PROTO_UDP};

use programs::nodeport::{tc_verdict, try_nodeport};
use programs::sock::{ALLOW, Pick, try_forward, try_release, try_reverse, verdict};
use programs::sock_iter::{IterSockCtx, try_terminate};
use programs::xdp::{try_xdp, xdp_verdict};

// Socket load balancing (ClusterIP), `programs::sock`.

#[cgroup_sock_addr(connect4)]
pub fn connect4(ctx: SockAddrContext) -> i32 {
    verdict(try_forward::<FAMILY_V4, { kernel::FULL }>(&ctx, Pick::Random))
}

#[cgroup_sock_addr(connect6)]
pub fn connect6(ctx: SockAddrContext) -> i32 {
    verdict(try_forward::<FAMILY_V6, { kernel::FULL }>(&ctx, Pick::Random))
}

#[cgroup_sock_addr(sendmsg4)]
pub fn sendmsg4(ctx: SockAddrContext) -> i32 {
    verdict(try_forward::<FAMILY_V4, { kernel::FULL }>(&ctx, Pick::PerSocket))
}

#[cgroup_sock_addr(sendmsg6)]
pub fn sendmsg6(ctx: SockAddrContext) -> i32 {
    verdict(try_forward::<FAMILY_V6, { kernel::FULL }>(&ctx, Pick::PerSocket))
}

// The same four for kernels without `bpf_set_retval` or the coarse clock
// (see `kernel`); the agent attaches one set or the other under the same
// link names.
#[cgroup_sock_addr(connect4)]
pub fn connect4_compat(ctx: SockAddrContext) -> i32 {
    verdict(try_forward::<FAMILY_V4, { kernel::COMPAT }>(&ctx, Pick::Random))
}

#[cgroup_sock_addr(connect6)]
pub fn connect6_compat(ctx: SockAddrContext) -> i32 {
    verdict(try_forward::<FAMILY_V6, { kernel::COMPAT }>(&ctx, Pick::Random))
}

#[cgroup_sock_addr(sendmsg4)]
pub fn sendmsg4_compat(ctx: SockAddrContext) -> i32 {
    verdict(try_forward::<FAMILY_V4, { kernel::COMPAT }>(&ctx, Pick::PerSocket))
}

#[cgroup_sock_addr(sendmsg6)]
pub fn sendmsg6_compat(ctx: SockAddrContext) -> i32 {
    verdict(try_forward::<FAMILY_V6, { kernel::COMPAT }>(&ctx, Pick::PerSocket))
}

// recvmsg and getpeername programs must return 1: the kernel rejects any
// other value for these attach types (`bpf_prog_attach_check_attach_type` /
// verifier return range), so they only ever rewrite the reported address.
#[cgroup_sock_addr(recvmsg4)]
pub fn recvmsg4(ctx: SockAddrContext) -> i32 {
    verdict(try_reverse::<FAMILY_V4, false>(&ctx).map(|()| ALLOW))
}

#[cgroup_sock_addr(recvmsg6)]
pub fn recvmsg6(ctx: SockAddrContext) -> i32 {
    verdict(try_reverse::<FAMILY_V6, false>(&ctx).map(|()| ALLOW))
}

#[cgroup_sock_addr(getpeername4)]
pub fn getpeername4(ctx: SockAddrContext) -> i32 {
    verdict(try_reverse::<FAMILY_V4, true>(&ctx).map(|()| ALLOW))
}

#[cgroup_sock_addr(getpeername6)]
pub fn getpeername6(ctx: SockAddrContext) -> i32 {
    verdict(try_reverse::<FAMILY_V6, true>(&ctx).map(|()| ALLOW))
}

/// Runs when a TCP or UDP socket in the cgroup is released
/// (`inet_release` -> `BPF_CGROUP_RUN_PROG_INET_SOCK_RELEASE`, Linux >=
/// 5.9), whatever the way it goes: close(), the last reference of an
/// exiting process, after a shutdown() or an RST, after the agent aborted
/// it. Deletes its `SOCK_REC` record, so the map holds only live sockets.
/// The socket's cgroup is the one it was created in, as for the connect
/// hooks, so every socket that can have a record passes here. It runs for
/// every socket of the cgroup (listeners, DNS, sockets never translated),
/// so a miss costs one protocol load, the cookie and one lookup; the
/// delete, which takes the bucket lock, only happens on a hit. Keyed by
/// cookie alone, so a UDP socket whose peer was zeroed before its release
/// (connect(AF_UNSPEC), an abort: cilium/cilium#42649) is still found.
/// Returns 1: the kernel ignores the verdict of this attach type.
#[cgroup_sock(sock_release)]
pub fn sock_release(ctx: SockContext) -> i32 {
    try_release(&ctx);
    1
}

// External traffic at TC, `programs::nodeport`.

#[classifier]
pub fn np_ingress(ctx: TcContext) -> i32 {
    tc_verdict(try_nodeport::<{ kernel::FULL }>(&ctx, true))
}

#[classifier]
pub fn np_egress(ctx: TcContext) -> i32 {
    tc_verdict(try_nodeport::<{ kernel::FULL }>(&ctx, false))
}

// The same two for kernels without the coarse clock (see `kernel`).
#[classifier]
pub fn np_ingress_compat(ctx: TcContext) -> i32 {
    tc_verdict(try_nodeport::<{ kernel::COMPAT }>(&ctx, true))
}

#[classifier]
pub fn np_egress_compat(ctx: TcContext) -> i32 {
    tc_verdict(try_nodeport::<{ kernel::COMPAT }>(&ctx, false))
}

// The same at XDP for flows to remote backends, `programs::xdp`.

#[xdp]
pub fn xdp_nodeport(ctx: XdpContext) -> u32 {
    xdp_verdict(try_xdp::<{ kernel::FULL }>(&ctx))
}

/// For kernels without the coarse clock (see `kernel`).
#[xdp]
pub fn xdp_nodeport_compat(ctx: XdpContext) -> u32 {
    xdp_verdict(try_xdp::<{ kernel::COMPAT }>(&ctx))
}

// The socket iterators, `programs::sock_iter`: run by the agent, one per
// network namespace, to abort the sockets of departed backends.

#[unsafe(link_section = "iter/tcp")]
#[unsafe(no_mangle)]
pub fn sock_terminate_tcp(ctx: *mut IterSockCtx) -> i32 {
    try_terminate(ctx, PROTO_TCP);
    0
}

#[unsafe(link_section = "iter/udp")]
#[unsafe(no_mangle)]
pub fn sock_terminate_udp(ctx: *mut IterSockCtx) -> i32 {
    try_terminate(ctx, PROTO_UDP);
    0
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
