//! BPF socket iterators that abort the sockets the socket load balancer
//! translated to a backend that has left its frontend (Linux >= 6.5: the
//! `bpf_sock_destroy` kfunc, callable from `iter/tcp` and `iter/udp`
//! programs only, net/core/filter.c).
//!
//! The agent fills `SOCK_TERMINATE` with the frontend-backend pairs of a
//! batch, then reads one iterator per network namespace: the kernel runs
//! the program once per TCP (or UDP) socket of the namespace the iterator
//! was created in. A socket is aborted when the connect hook's own record
//! (`SOCK_REC`, by its cookie, while it names the current peer; else in the
//! socket's storage, `SOCK_PEER`, for TCP; in `SOCK_REVNAT`, by its cookie
//! and current peer, otherwise) names a frontend whose pair
//! with its current peer is listed: a socket that dialled the pod's
//! address directly has no such record and is left alone, as is every
//! socket whose peer is not a departed backend. The same proof the
//! agent's netlink path uses.
//!
//! aya 0.14 cannot relocate a kfunc call, so the call is emitted as a raw
//! instruction with a placeholder BTF id that the agent patches before
//! loading (see `SOCK_DESTROY_KFUNC_INSN`). The `struct sock_common`
//! offsets read here are checked by the agent against the running
//! kernel's BTF first; the verifier checks every load against the same
//! BTF (`btf_struct_access`) and the loads of a tracing program cannot
//! fault (they become probe loads).

use core::ffi::c_void;

use aya_ebpf::{
    btf_maps::HashMap,
    helpers::{
        bpf_get_socket_cookie,
        generated::{bpf_sk_storage_get, bpf_skc_to_tcp_sock},
    },
    macros::btf_map,
};
use proxy_common::{
    FAMILY_V4, FAMILY_V6, MAX_SOCK_TERMINATE, PROTO_TCP, SKC_DADDR_OFF, SKC_DPORT_OFF, SKC_FAMILY_OFF, SKC_STATE_OFF, SKC_V6_DADDR_OFF,
    SOCK_DESTROY_KFUNC_INSN, SOCK_REC_COUNTED, SockPeerValue, SockRevNatKey, SockTerminateKey, SockTerminateValue,
};

use super::sock::add_to_record_count;
use crate::maps::{SOCK_PEER, SOCK_REC, SOCK_REVNAT};

#[btf_map(name = "SOCK_TERMINATE")]
pub static SOCK_TERMINATE: HashMap<SockTerminateKey, SockTerminateValue, { MAX_SOCK_TERMINATE as usize }> = HashMap::new();

const AF_INET: u16 = 2;
const AF_INET6: u16 = 10;
/// include/net/tcp_states.h. connect() puts a UDP socket in ESTABLISHED.
const TCP_ESTABLISHED: u8 = 1;
const TCP_SYN_SENT: u8 = 2;

/// `struct bpf_iter__tcp` / `struct bpf_iter__udp` up to the socket: the
/// iterator's metadata, then the socket (NULL once, at the end).
#[repr(C)]
pub struct IterSockCtx {
    meta: *mut c_void,
    sk: *mut c_void,
}

/// Aborts the context's socket if it is ours and its peer left; anything
/// else (a failed read, an unlisted socket) leaves it as it is.
#[inline(always)]
pub(crate) fn try_terminate(ctx: *mut IterSockCtx, proto: u8) -> Option<()> {
    // SAFETY: `ctx` is the iterator context the kernel passes; reading its
    // socket pointer is one 8-byte context load (`btf_ctx_access`).
    let sk = unsafe { (*ctx).sk };
    if sk.is_null() {
        return None;
    }
    let at = |off: usize| -> *const u8 { sk.cast::<u8>().wrapping_add(off) };
    // SAFETY: `sk` is the non-null socket the kernel hands the program
    // (`struct sock_common`, or a `struct udp_sock` that begins with it);
    // each read is a fixed-offset load of a field the agent checked
    // against the kernel's BTF, which the verifier checks again and turns
    // into a fault-free probe load.
    let (state, family, port_be) = unsafe {
        (
            core::ptr::read_volatile(at(SKC_STATE_OFF)),
            core::ptr::read_volatile(at(SKC_FAMILY_OFF).cast::<u16>()),
            core::ptr::read_volatile(at(SKC_DPORT_OFF).cast::<u16>()),
        )
    };
    let live = if proto == PROTO_TCP {
        // Listening and time-wait sockets have no backend to leave. A
        // socket in CLOSE_WAIT got its backend's FIN: it hangs on nothing
        // (its reads end in EOF), and aborting it would throw away what it
        // received and has not read yet (a response the backend finished
        // sending before its pod went away).
        state == TCP_ESTABLISHED || state == TCP_SYN_SENT
    } else {
        state == TCP_ESTABLISHED
    };
    if !live {
        return None;
    }
    let (ip_be, fam) = match family {
        // SAFETY: as above, a 4-byte field of sock_common.
        AF_INET => ([unsafe { core::ptr::read_volatile(at(SKC_DADDR_OFF).cast::<u32>()) }, 0, 0, 0], FAMILY_V4),
        AF_INET6 => {
            let p = at(SKC_V6_DADDR_OFF).cast::<u32>();
            // SAFETY: as above, the four words of `skc_v6_daddr`.
            let w = unsafe {
                [
                    core::ptr::read_volatile(p),
                    core::ptr::read_volatile(p.wrapping_add(1)),
                    core::ptr::read_volatile(p.wrapping_add(2)),
                    core::ptr::read_volatile(p.wrapping_add(3)),
                ]
            };
            // ::ffff:a.b.c.d is remembered, and listed, as IPv4.
            if w[0] == 0 && w[1] == 0 && w[2] == u32::from_ne_bytes([0, 0, 0xff, 0xff]) {
                ([w[3], 0, 0, 0], FAMILY_V4)
            } else {
                (w, FAMILY_V6)
            }
        }
        _ => return None,
    };
    // SAFETY: the tracing variant of the helper takes the socket pointer
    // the verifier typed (ARG_PTR_TO_BTF_ID_SOCK_COMMON) and reads nothing
    // of ours.
    let cookie = unsafe { bpf_get_socket_cookie(sk) };
    // SAFETY: a map value, valid for the run (RCU, preallocated), copied
    // out at once.
    let rec = unsafe { SOCK_REC.get(cookie) }.copied();
    let (frontend_ip_be, frontend_port_be) = match rec {
        Some(r) if r.family == fam && r.backend_ip_be == ip_be && r.backend_port_be == port_be && r.proto == proto => {
            (r.frontend_ip_be, r.frontend_port_be)
        }
        // No record for this peer: a socket recorded while SOCK_REC was
        // full, translated by an agent version without it, or not ours.
        _ => match stored_frontend(sk, proto, &ip_be, port_be, fam) {
            Stored::Frontend(ip, port) => (ip, port),
            Stored::NotThisPeer => return None,
            Stored::Unknown => {
                let rev = SockRevNatKey::new(cookie, ip_be, port_be, fam);
                // SAFETY: a map value, valid for the run (RCU), copied out at once.
                let v = unsafe { SOCK_REVNAT.get(&rev) }.copied()?;
                (v.ip_be, v.port_be)
            }
        },
    };
    let key = SockTerminateKey {
        frontend_ip_be,
        backend_ip_be: ip_be,
        frontend_port_be,
        backend_port_be: port_be,
        family: fam,
        proto,
        _pad: [0; 2],
    };
    let counts = SOCK_TERMINATE.get_ptr_mut(&key)?;
    // SAFETY: `sk` is the trusted socket of this iteration, which the
    // kfunc takes (KF_TRUSTED_ARGS); see `bpf_sock_destroy`.
    let rc = unsafe { bpf_sock_destroy(sk) };
    // SAFETY: `counts` points at a SOCK_TERMINATE value, valid for the
    // run. Nothing else writes it meanwhile: an iterator runs the program
    // for one socket at a time (a seq_file read), the agent reads one
    // iterator at a time and looks at the counts only after the walk.
    unsafe {
        if rc == 0 {
            (*counts).terminated += 1;
        } else {
            (*counts).failed += 1;
        }
    }
    if rc == 0 {
        // The aborted socket stays open until its owner closes it (the
        // release program then finds nothing), and it can never again
        // report this peer: its record goes now, so that an application
        // slow to close, or leaking, the socket holds no slot of the
        // preallocated map. A record the socket gets by connecting again
        // is written afresh by the connect hook. Its count goes with it
        // (see `try_release`), so that the slot can come back to 0.
        if SOCK_REC.remove(cookie).is_ok() && rec.is_some_and(|r| r.counted == SOCK_REC_COUNTED) {
            add_to_record_count(cookie, u64::MAX);
        }
    }
    Some(())
}

/// What a socket's own storage (`SOCK_PEER`) says about its current peer.
enum Stored {
    /// Translated to this peer from this frontend (address, port).
    Frontend([u32; 4], u16),
    /// Translated, but never to this peer, and nothing in `SOCK_REVNAT`.
    NotThisPeer,
    /// No storage to go by (UDP, whose connect() the hook also records in
    /// `SOCK_REVNAT`; a socket translated before storage held TCP; a
    /// request or time-wait socket), or it says to look in `SOCK_REVNAT`.
    Unknown,
}

/// The connect hook records a TCP socket's translation in the socket's
/// storage rather than in `SOCK_REVNAT` (main.rs, `remember`). Socket
/// storage is readable from iterator programs
/// (`bpf_sk_storage_tracing_allowed`: BPF_TRACE_ITER) given a full socket:
/// `bpf_skc_to_tcp_sock` turns the iterator's `sock_common` into one, or
/// null for request and time-wait sockets, which have no storage.
#[inline(always)]
fn stored_frontend(sk: *mut c_void, proto: u8, ip_be: &[u32; 4], port_be: u16, family: u8) -> Stored {
    if proto != PROTO_TCP {
        return Stored::Unknown;
    }
    // SAFETY: the helper takes the socket pointer the verifier typed and
    // returns it as a `tcp_sock` or null; it reads nothing of ours.
    let tp = unsafe { bpf_skc_to_tcp_sock(sk) };
    if tp.is_null() {
        return Stored::Unknown;
    }
    let map = core::ptr::from_ref(&SOCK_PEER).cast_mut().cast::<c_void>();
    // SAFETY: a lookup without creating (no value, no flags) of this
    // socket's element in SOCK_PEER, whose definition `map` points at;
    // null or the element, valid for the run (freed after an RCU grace
    // period, and the program runs under RCU).
    let p = unsafe { bpf_sk_storage_get(map, tp.cast(), core::ptr::null_mut(), 0) }.cast::<SockPeerValue>();
    if p.is_null() {
        return Stored::Unknown;
    }
    // SAFETY: non-null, this socket's element (above); copied out at once.
    // Its only concurrent write is the one-byte `spilled` store.
    let v = unsafe { core::ptr::read_volatile(p) };
    if v.family == family && v.backend_ip_be == *ip_be && v.backend_port_be == port_be {
        Stored::Frontend(v.frontend_ip_be, v.frontend_port_be)
    } else if v.spilled == 0 {
        Stored::NotThisPeer
    } else {
        Stored::Unknown
    }
}

/// `int bpf_sock_destroy(struct sock_common *sk)`: aborts `sk` with
/// ECONNABORTED (`tcp_abort`, `udp_abort`). 0 on success.
///
/// # Safety
///
/// `sk` must be the trusted socket pointer of an `iter/tcp` or `iter/udp`
/// program; the verifier rejects anything else.
#[inline(always)]
unsafe fn bpf_sock_destroy(sk: *mut c_void) -> i64 {
    let rc: i64;
    // SAFETY: one call instruction (a kfunc call: the arguments in r1..r5,
    // the result in r0, r1..r5 clobbered, as for every BPF call), which
    // touches no memory of ours; the caller vouches for `sk`.
    unsafe {
        core::arch::asm!(
            ".quad {insn}",
            insn = const SOCK_DESTROY_KFUNC_INSN,
            inout("r1") sk => _,
            lateout("r0") rc,
            lateout("r2") _,
            lateout("r3") _,
            lateout("r4") _,
            lateout("r5") _,
        );
    }
    rc
}
