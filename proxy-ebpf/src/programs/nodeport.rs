//! Per-packet load balancing of traffic that enters the node from outside:
//! NodePort on the node's addresses, LoadBalancer ingress IPs and
//! externalIPs. Attached at TC ingress and egress of the node's devices
//! (tcx links on Linux >= 6.6, clsact otherwise).
//!
//! A new flow to a frontend in `NP_SERVICES` picks a backend from
//! `NP_SLOTS`/`NP_BACKENDS` and is DNAT'ed to it at ingress. Conntrack
//! entries in `NP_CT` (see `CT_DIR_*` in proxy-common) carry the flow on:
//!
//! * local backend (in `NP_LOCAL`): ingress DNAT keeps the client's source;
//!   the backend's reply is routed by this node and its source becomes the
//!   frontend again at egress of the device towards the client.
//! * remote backend: ingress DNAT, then at egress (after routing) SNAT to
//!   this node's address and a port of the SNAT range, so the reply comes
//!   back here. The reply's destination becomes the client at ingress (the
//!   stack then forwards it) and its source the frontend at egress. Source
//!   rewrites happen only at egress because IPv4 drops packets that arrive
//!   with a local source address (`fib_validate_source`, `accept_local`).
//!
//! tcx runs the programs of one hook in order, and an ingress program's
//! rewrite happens before `ip_rcv`, so the stack routes the translated
//! packet as if it had arrived that way. Anything that is not ours (and
//! every packet we translated) returns `TC_ACT_UNSPEC`: for tcx that is
//! `TCX_NEXT`, so programs attached after ours (another CNI's) still run,
//! and at the end of the chain the packet passes
//! (`include/uapi/linux/bpf.h`, `tcx_action_code`); for a clsact
//! direct-action filter it means "default action", which is pass.

use aya_ebpf::{
    bindings::{BPF_NOEXIST, TC_ACT_SHOT, TC_ACT_UNSPEC},
    programs::TcContext,
};
use proxy_common::{
    AFFINITY_REFRESH_NS, AddrKey, AffinityMatchKey, AffinityValue, BackendKey, BackendValue, CT_DIR_FORWARD, CT_DIR_REPLY,
    CT_DIR_REPLY_SNAT, CT_DIR_SNAT, CT_FLAG_CLOSING, CT_FLAG_REPLIED, CT_FLAG_SNAT, CT_REFRESH_S, CT_TIMEOUT_OTHER_S,
    CT_TIMEOUT_TCP_CLOSING_S, CT_TIMEOUT_TCP_S, CT_TIMEOUT_TCP_SYN_S, CtKey, CtValue, FAMILY_V4, MaglevKey, NP_FLAG_POLICY_LOCAL,
    NpAffinityKey, NpConfig, PROTO_TCP, SOURCE_RANGE_FIXED_BITS, SVC_FLAG_AFFINITY, SVC_FLAG_SOURCE_RANGES, ServiceKey, ServiceValue,
    SourceRangeKey, affinity_expired, ct_dir_from_client, ct_flags_after, flow_hash, maglev_hash, np_counter, np_fast_counter, np_port_bit,
    svc_conn_index,
};

use super::tc_fast;
use crate::kernel;
use crate::maglev_maps::NP_MAGLEV;
use crate::nodeport_maps::{
    NP_AFFINITY, NP_AFFINITY_MATCH, NP_BACKENDS, NP_CONFIG, NP_CT, NP_FLAGS, NP_LOCAL, NP_PORTS, NP_SCRATCH, NP_SERVICES, NP_SLOTS,
    NP_SOURCE_RANGES, NP_SVC_TOPO, NpScratch, np_count, np_count_flow,
};
use crate::packet::{Parsed, Pkt, TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN, addr_copy, parse, rewrite};

/// Let the packet continue (see the module comment).
const PASS: i32 = TC_ACT_UNSPEC;

/// How many SNAT ports a new flow tries before giving up. The ports of one
/// backend (address, port, protocol) are shared by every flow to it, and a
/// closed TCP flow holds its port for `CT_TIMEOUT_TCP_CLOSING_S`: with
/// candidates spread at random, a new flow fails with probability
/// occupancy^tries. At 8 tries, 2,000 requests a second to one backend
/// (about 2/3 of the default 4,536 ports held) failed 5 % of them in the
/// NodePort bench; at 32 the same occupancy fails about one in a million.
/// Cilium's SNAT (bpf/lib/nat.h, SNAT_COLLISION_RETRIES) tries up to 128
/// ports for the same reason. The verifier walks every iteration of this
/// bounded loop (5.3+), well within its one-million-instruction limit.
const SNAT_TRIES: u32 = 32;

/// `Err` carries a counter id: count it and let the packet through as it is
/// (fail open: a bug of ours must not black-hole unrelated traffic).
#[inline(always)]
pub(crate) fn tc_verdict(r: Result<i32, u32>) -> i32 {
    match r {
        Ok(v) => v,
        Err(reason) => {
            np_count(reason);
            PASS
        }
    }
}

#[inline(always)]
pub(crate) fn try_nodeport<const KERNEL: u8>(ctx: &TcContext, ingress: bool) -> Result<i32, u32> {
    let p = match parse(ctx) {
        Parsed::L4(p) => p,
        Parsed::Icmp(i) => return Ok(super::icmp::handle(ctx, &i, ingress)),
        Parsed::Other(reason) => return Err(reason),
        Parsed::NotIp => return Ok(PASS),
    };

    // Most packets a device carries are not ours: array lookups tell,
    // before any hash lookup (see `port_bit`), which lookup below can
    // match: at ingress a reply to a SNAT port, or a forward entry or
    // frontend; at egress a reply entry, or the SNAT leg of a forward flow.
    let snat_reply = ingress && may_be_snat_reply(&p);
    let (egress_reply, egress_snat) = if ingress { (false, false) } else { (port_bit(p.sport_be, true), port_bit(p.dport_be, true)) };
    if !snat_reply && !egress_reply && !egress_snat && (!ingress || !port_bit(p.dport_be, false)) {
        return Err(np_counter::PASS_NOT_OURS);
    }

    // A reply of a tracked flow. One key on the stack, reused for each
    // lookup, and values used in place: the verifier allows 512 bytes of
    // stack for the whole call chain.
    let mut key = ct_key(&p, if ingress { CT_DIR_REPLY_SNAT } else { CT_DIR_REPLY });
    let reply = if snat_reply || egress_reply { NP_CT.get_ptr_mut(&key) } else { None };
    if let Some(v) = reply {
        // SAFETY: `v` is the non-null value pointer of an NP_CT element. The
        // program runs under rcu_read_lock, and the LRU map's elements are
        // preallocated and never freed while the map exists, so the memory
        // stays valid for the whole run. Other CPUs may use the entry
        // meanwhile (the flow's other packets, the agent's GC, an LRU
        // eviction that reuses the element for another flow); `touch` and
        // `mark_closing` only load and store aligned u32 fields, and every
        // bit pattern is a valid `CtValue`, so a race can lose an update or
        // put it on the wrong entry, never produce an invalid value.
        let v = unsafe { &mut *v };
        // A reply to our SNAT port (ingress) or a backend's reply towards
        // the client (egress): the flow, and the SNAT port, are in use.
        let now = touch::<KERNEL>(&p, v, key.dir);
        if ingress && tc_fast::enabled() {
            // A remote backend's reply (only `CT_DIR_REPLY_SNAT` entries
            // are looked up at ingress).
            return fast_reply(ctx, &p, v, &mut key, now);
        }
        return apply(ctx, &p, v);
    }
    if !ingress {
        // The forward leg of a flow to a remote backend, after routing. A
        // packet whose source is already a SNAT tuple (the TC fast path
        // translated it at ingress and redirected it here) has no such leg.
        if !egress_snat || is_snat_source(&p) {
            return Ok(PASS);
        }
        key.dir = CT_DIR_SNAT;
        if let Some(v) = NP_CT.get_ptr_mut(&key) {
            // SAFETY: an NP_CT value pointer, valid for the run; races as
            // for the reply entry above.
            let v = unsafe { &mut *v };
            touch::<KERNEL>(&p, v, CT_DIR_SNAT);
            return apply(ctx, &p, v);
        }
        return Ok(PASS);
    }

    // A packet of a tracked flow: keep its backend even if the slots
    // changed meanwhile (see `keeps_backend`).
    key.dir = CT_DIR_FORWARD;
    if let Some(v) = NP_CT.get_ptr_mut(&key) {
        // SAFETY: an NP_CT value pointer, valid for the run; races as for
        // the reply entry above.
        let v = unsafe { &mut *v };
        let now = now_s::<KERNEL>();
        if keeps_backend(p.proto, v, now) {
            touch_at(&p, v, CT_DIR_FORWARD, now);
            if tc_fast::enabled() {
                return fast_forward::<KERNEL>(ctx, &p, v, &mut key, now);
            }
            return apply(ctx, &p, v);
        }
        np_count(np_counter::STALE_BACKEND);
    }
    let r = new_flow::<KERNEL>(&p, &key);
    if r >= NEW_FLOW_ERR {
        return Err((r & 0xffff_ffff) as u32);
    }
    match r as i32 {
        // The packet is rewritten here rather than inside new_flow so that
        // the deepest call chain is main -> rewrite -> rewrite_addr or
        // main -> new_flow, never all four frames at once.
        TRANSLATE => {
            // The flow's first packet takes the fast path too, from the
            // entries `new_flow` just wrote (a refusal keeps none).
            if tc_fast::enabled()
                && let Some(v) = NP_CT.get_ptr_mut(&key)
            {
                // SAFETY: an NP_CT value pointer, valid for the run; races
                // as for the reply entry above.
                return fast_forward::<KERNEL>(ctx, &p, unsafe { &mut *v }, &mut key, now_s::<KERNEL>());
            }
            let Some(s) = NP_SCRATCH.get_ptr(0) else {
                return Err(np_counter::CT_UPDATE_FAILED);
            };
            // SAFETY: this CPU's slot of the per-CPU NP_SCRATCH element 0,
            // never freed while the map exists; `new_flow` filled `fwd` and
            // has returned, so no other reference to the slot is live, and
            // no other TC program runs on this CPU until this one returns
            // (bottom halves are disabled). `rewrite` only reads it.
            match rewrite(ctx, &p, unsafe { &(*s).fwd }) {
                0 => Ok(PASS),
                _ => {
                    np_count(np_counter::REWRITE_FAILED);
                    Ok(TC_ACT_SHOT)
                }
            }
        }
        verdict => Ok(verdict),
    }
}

/// Whether an ingress packet can be a reply to one of our SNAT ports: only
/// then can a `CT_DIR_REPLY_SNAT` entry match it. `new_flow` creates those
/// entries only with the configured SNAT address of the packet's family as
/// destination and a port of `snat_port_min..=snat_port_max`, so any other
/// packet would pay a conntrack hash lookup (jhash over the 40-byte key plus
/// a bucket walk, kernel/bpf/hashtab.c) that cannot hit. This runs first on
/// every TCP/UDP packet the device receives, and most of them (the node's
/// own traffic, NodePort requests: the default SNAT range lies above the
/// ephemeral and NodePort ranges) fail the port test alone. `NP_CONFIG` is a
/// one-element array, whose lookup the verifier inlines into a bounds check
/// and an address computation (`array_map_gen_lookup`).
///
/// A flow keeps its reply translation only while the configuration that
/// SNAT'ed it stands: the agent writes it at start from its flags and the
/// node's address, so a restart with another SNAT address or port range
/// cuts the replies of flows SNAT'ed before (the conntrack GC ages their
/// entries out).
#[inline(always)]
fn may_be_snat_reply(p: &Pkt) -> bool {
    // A missing element cannot happen (an array element always exists):
    // then the lookup is asked.
    NP_CONFIG.get(0).is_none_or(|cfg| snat_tuple(cfg, &p.daddr, p.dport_be, p.family))
}

/// Whether an egress packet's source is this node's SNAT address and a
/// port of its SNAT range, a tuple only `new_flow`'s SNAT hands out: the
/// packet is the forward leg of a flow already SNAT'ed (by the TC fast
/// path at ingress, before its redirect), and cannot match a `CT_DIR_SNAT`
/// entry, whose key is the client's tuple (a client does not send from
/// this node's address, and the node's own sockets do not take ports of
/// the SNAT range, see `--snat-port-range`). Without this test each such
/// packet paid a conntrack lookup that always missed: about 4 % of the
/// forwarding CPU in the XDP bench's fast-path flood (#33). A missing
/// `NP_CONFIG` element (impossible) answers no: the lookup is asked.
#[inline(always)]
fn is_snat_source(p: &Pkt) -> bool {
    NP_CONFIG.get(0).is_some_and(|cfg| snat_tuple(cfg, &p.saddr, p.sport_be, p.family))
}

#[inline(always)]
fn snat_tuple(cfg: &NpConfig, addr: &[u32; 4], port_be: u16, family: u8) -> bool {
    let port = u16::from_be(port_be);
    if port < cfg.snat_port_min || port > cfg.snat_port_max {
        return false;
    }
    if family == FAMILY_V4 { addr[0] == cfg.snat_v4_be } else { *addr == cfg.snat_v6_be }
}

/// Whether `port_be` has its bit in `NP_PORTS`' ingress or egress half,
/// i.e. whether a lookup keyed by it can match. Every entry the programs
/// look up here names the port in the key:
///
/// * ingress, the destination port: forward entries (`CT_DIR_FORWARD`) and
///   frontends (`NP_SERVICES`) are keyed by the frontend's port. Replies to
///   SNAT ports (`CT_DIR_REPLY_SNAT`) are told by `may_be_snat_reply`.
/// * egress, the source port for reply entries (`CT_DIR_REPLY`, keyed by
///   the backend's port, 0 for the node's own refusal, see `no_backend`),
///   the destination port for the forward leg of a SNAT'ed flow
///   (`CT_DIR_SNAT`, keyed by the backend's port). The agent keeps one
///   egress set for both (every backend port, and 0), so each lookup is
///   asked only when its own port has a bit: a packet the TC fast path
///   already translated (its source port a SNAT port) skips the reply
///   lookup, a backend's reply to a client port no backend uses skips the
///   SNAT-leg one.
///
/// The agent sets a port's bit before it writes a frontend or backend that
/// uses it, and fills the map from the pinned maps before it attaches new
/// programs, so a clear bit means no such entry exists. Fails open: a
/// lookup that fails (impossible below `NP_PORTS_ENTRIES`) counts as set.
#[inline(always)]
fn port_bit(port_be: u16, egress: bool) -> bool {
    let (word, mask) = np_port_bit(u16::from_be(port_be), egress);
    // The agent updates a word as a whole (`bpf_map_update_elem` copies
    // it); a word read mid-update holds old or new bits, and the agent
    // only ever adds bits that are about to be needed or removes bits
    // that no entry needs, so either is right.
    NP_PORTS.get(word).is_none_or(|w| *w & mask != 0)
}

/// CLOCK_MONOTONIC seconds, the clock of the agent's conntrack GC
/// (conntrack_gc.rs; see `kernel::now_ns` for the coarse read, which never
/// runs ahead of it).
#[inline(always)]
fn now_s<const KERNEL: u8>() -> u32 {
    // CLOCK_MONOTONIC seconds fit u32 for 136 years of uptime.
    (kernel::now_ns::<KERNEL>() / 1_000_000_000) as u32
}

/// A packet matched the tracked entry `v` (of direction `dir`): keep the
/// entry fresh for the agent's conntrack GC and follow the end of TCP.
///
/// `seen_s` is written only when the stored value is `CT_REFRESH_S` or more
/// old, not per packet. A map write is a store into shared memory that
/// takes the cache line exclusive and invalidates every other CPU's copy:
/// a flow's packets can be handled on several CPUs (RPS/RFS steering,
/// ingress and egress hooks on different queues), and the LRU map's
/// elements sit next to each other in one preallocated pool
/// (kernel/bpf/hashtab.c, `prealloc_init`), so a line also holds parts of
/// unrelated flows' elements that other CPUs read. A store per packet
/// would bounce those lines between CPUs (true and false sharing), where
/// lookups alone keep them shared and clean. The kernel's LRU map avoids
/// the same cost for its own reference bit: `bpf_lru_node_set_ref` only
/// writes when the bit is clear (kernel/bpf/bpf_lru_list.h). Timeouts are
/// seconds to hours, so one second of slack costs nothing.
///
/// Returns the time it read, for the rest of the packet's path: the clock
/// is a helper call, read once per packet.
#[inline(always)]
fn touch<const KERNEL: u8>(p: &Pkt, v: &mut CtValue, dir: u8) -> u32 {
    let now = now_s::<KERNEL>();
    touch_at(p, v, dir, now);
    now
}

/// `touch` at `now`, a time the caller read.
#[inline(always)]
fn touch_at(p: &Pkt, v: &mut CtValue, dir: u8, now: u32) {
    if now.wrapping_sub(v.seen_s) >= CT_REFRESH_S {
        v.seen_s = now;
    }
    // The backend answered: the flow leaves the short unanswered-TCP
    // timeout. Written once per entry, for the same cache reason as above.
    if !ct_dir_from_client(dir) && v.flags & CT_FLAG_REPLIED == 0 {
        v.flags |= CT_FLAG_REPLIED;
    }
    if p.proto == PROTO_TCP && p.tcp_flags & (TCP_FIN | TCP_RST) != 0 {
        mark_closing(v, p.tcp_flags, dir, p.family);
    }
}

/// A FIN or RST went by (rare: at most a few per flow). Records it on this
/// entry and on the entry of the opposite direction, which this hook does
/// not see (e.g. a FIN from the client at ingress on the reply entry that
/// egress uses), so that both halves of the flow, and the SNAT reservation
/// the datapath checks before taking a port over, agree that it is closing.
/// The two entries of the same direction (forward and SNAT legs, or the two
/// reply legs) see the very same packet at ingress and egress and mark
/// themselves.
///
/// The flag updates are plain read-modify-writes, not atomics: two FIN/RST
/// segments racing on two CPUs can lose one update, which only ever leaves
/// the flow on the longer established timeout (kept too long, never cut
/// short); the next FIN/RST or retransmission sets it again.
#[inline(never)]
fn mark_closing(v: &mut CtValue, tcp_flags: u8, dir: u8, family: u8) {
    let from_client = ct_dir_from_client(dir);
    v.flags = ct_flags_after(v.flags, tcp_flags, from_client);
    let Some(s) = NP_SCRATCH.get_ptr_mut(0) else {
        return;
    };
    // SAFETY: this CPU's slot of NP_SCRATCH element 0, never freed while
    // the map exists. No other reference to it is live: `v` points into
    // NP_CT, the caller holds none, a run that matched an entry never
    // reaches `new_flow` or `no_backend`, and no other TC program runs on
    // this CPU until this one returns.
    let s = unsafe { &mut *s };
    s.peer = v.peer_key(PROTO_TCP, family, dir);
    if let Some(peer) = NP_CT.get_ptr_mut(&s.peer) {
        // SAFETY: an NP_CT value pointer, valid for the run (see
        // `try_nodeport`). Its key names the other direction, so it is
        // another entry than `v`'s; the update is a load and store of the
        // aligned u32 `flags` (races: see above and `try_nodeport`).
        let peer = unsafe { &mut *peer };
        peer.flags = ct_flags_after(peer.flags, tcp_flags, from_client);
    }
}

/// Whether a tracked entry is older than its timeout.
#[inline(always)]
fn expired(v: &CtValue, now: u32, proto: u8) -> bool {
    let limit = if proto != PROTO_TCP {
        CT_TIMEOUT_OTHER_S
    } else if v.flags & CT_FLAG_CLOSING != 0 {
        CT_TIMEOUT_TCP_CLOSING_S
    } else if v.flags & CT_FLAG_REPLIED == 0 {
        CT_TIMEOUT_TCP_SYN_S
    } else {
        CT_TIMEOUT_TCP_S
    };
    now.wrapping_sub(v.seen_s) > limit
}

/// Whether the SNAT reservation at `s.key` (a `CT_DIR_REPLY_SNAT` key) is
/// free to take over: its entry, refreshed by the backend's replies, and the
/// SNAT entry of the same flow, refreshed by the client's packets, are both
/// past their timeout. The second check keeps a one-way flow (a UDP stream
/// the backend never answers) from losing its port while it is still
/// sending. A SNAT entry that now names another port belongs to a later
/// flow of the same client tuple and says nothing about this port.
#[inline(always)]
fn reservation_expired(s: &mut NpScratch, now: u32, proto: u8, family: u8) -> bool {
    // SAFETY: NP_CT values stay valid memory for the run (RCU, preallocated
    // LRU elements). Both references here are only read, and only inside
    // this function, which updates no map entry, so no insert of ours can
    // evict and reuse them; one on another CPU leaves integers that are
    // stale, never invalid.
    let Some(old) = (unsafe { NP_CT.get(&s.key) }) else {
        // Deleted meanwhile (GC, LRU): free.
        return true;
    };
    if !expired(old, now, proto) {
        return false;
    }
    s.peer = old.peer_key(proto, family, CT_DIR_REPLY_SNAT);
    // SAFETY: as above.
    match unsafe { NP_CT.get(&s.peer) } {
        Some(fwd) if fwd.sport_be == s.key.dport_be && fwd.saddr_be == s.key.daddr_be => expired(fwd, now, proto),
        _ => true,
    }
}

/// `new_flow`'s answer for "translate with the scratch area's `fwd`"; no TC
/// verdict has this value.
pub(crate) const TRANSLATE: i32 = 0x7fff_0000;

/// A new flow (or one whose backend went away): look the frontend up, pick
/// a backend (`new_flow_pick`), reserve the reply tuple, remember the flow
/// (`new_flow_commit`), translate.
///
/// Two calls, not inlined, and their keys and values live in the per-CPU
/// `NP_SCRATCH` area rather than on the stack: the verifier allows 512
/// bytes of stack for the deepest call chain, each frame rounded up to 32
/// (`check_max_stack_depth`), and the conntrack key/value pairs alone would
/// take a third of it. As one function, its spills put the chain from the
/// entry program through it at the limit; as two siblings each is a third
/// smaller. The extra call is paid once per new flow, not per packet.
/// `fwd_key` is the caller's forward key.
///
/// Returns a plain integer, the verdict or `NEW_FLOW_ERR | reason`, not a
/// `Result`: an aggregate comes back through a hidden pointer into the
/// caller's frame, and LLVM may leave that pointer in r0 at exit, which the
/// verifier rejects ("cannot return stack pointer to the caller",
/// kernel/bpf/verifier.c, `prepare_func_exit`). Whether it does depends on
/// the generated code around it, so an unrelated edit can bring it on.
#[inline(always)]
pub(crate) fn new_flow<const KERNEL: u8>(p: &Pkt, fwd_key: &CtKey) -> i64 {
    let r = new_flow_pick::<KERNEL>(p);
    if r != i64::from(PICKED) {
        return r;
    }
    new_flow_commit::<KERNEL>(p, fwd_key)
}

/// `new_flow`'s error answers carry this bit above every verdict (verdicts
/// are i32, `TRANSLATE` included).
pub(crate) const NEW_FLOW_ERR: i64 = 1 << 40;

/// `new_flow_pick`'s answer for "backend chosen, `NP_SCRATCH` holds the
/// flow's `fwd`, `rev` and `hash`"; no TC verdict has this value.
const PICKED: i32 = 0x7fff_0001;

#[inline(never)]
fn new_flow_pick<const KERNEL: u8>(p: &Pkt) -> i64 {
    match pick_backend::<KERNEL>(p) {
        Ok(verdict) => i64::from(verdict),
        Err(reason) => NEW_FLOW_ERR | i64::from(reason),
    }
}

#[inline(never)]
fn new_flow_commit<const KERNEL: u8>(p: &Pkt, fwd_key: &CtKey) -> i64 {
    match commit_flow::<KERNEL>(p, fwd_key) {
        Ok(verdict) => i64::from(verdict),
        Err(reason) => NEW_FLOW_ERR | i64::from(reason),
    }
}

/// The frontend's verdict, or its backend for this flow: on `PICKED`,
/// `NP_SCRATCH` holds the flow's `fwd` and `rev` translations and the flow
/// hash for `commit_flow`.
#[inline(always)]
fn pick_backend<const KERNEL: u8>(p: &Pkt) -> Result<i32, u32> {
    let skey = ServiceKey { ip_be: p.daddr, port_be: p.dport_be, proto: p.proto, family: p.family };
    // SAFETY: map values stay valid memory for the run (rcu_read_lock, and
    // preallocated hash elements are never freed while the map exists).
    // The programs never update NP_SERVICES; if the agent replaces the
    // entry while `svc` is read, the fields are stale or mixed integers,
    // still a valid `ServiceValue`.
    let Some(svc) = (unsafe { NP_SERVICES.get(&skey) }) else {
        return Ok(PASS); // not a frontend
    };
    if svc.flags & SVC_FLAG_SOURCE_RANGES != 0 && !source_allowed(p, svc) {
        // A LoadBalancer IP restricted by loadBalancerSourceRanges, and the
        // client is outside them: dropped, as kube-proxy's firewall chain
        // does (a refusal would tell a scanner the address is in use).
        // Checked before the untracked-TCP pass below: kube-proxy's firewall
        // chain drops by source whatever the segment's flags, so a non-SYN
        // segment from outside the ranges must not reach the stack either.
        np_count(np_counter::DROPPED_SOURCE_RANGE);
        return Ok(TC_ACT_SHOT);
    }
    if p.proto == PROTO_TCP && p.tcp_flags & (TCP_SYN | TCP_ACK) != TCP_SYN {
        // A segment that opens no connection, of a flow NP_CT does not
        // track: the connection began before these programs were attached
        // (kube-proxy translated it, and netfilter's conntrack keeps its NAT
        // binding until it ends: nf_nat applies a connection's binding to
        // each of its packets), or its entry is gone. A backend picked now
        // never saw the handshake and could only answer with a RST; left to
        // the stack, a connection netfilter knows goes on as before.
        return Err(np_counter::PASS_UNTRACKED_TCP);
    }
    if svc.backend_count == 0 {
        return no_backend::<KERNEL>(p, &skey);
    }
    // Read only now: a packet that is not for a frontend (most of what the
    // device sees) has no use for the time.
    let now_ns = kernel::now_ns::<KERNEL>();
    let now = (now_ns / 1_000_000_000) as u32;
    let affine = svc.flags & SVC_FLAG_AFFINITY != 0;
    let sticky = if affine { affinity_lookup(p, svc, now_ns) } else { None };
    let hash = flow_hash(&p.saddr, p.sport_be, p.proto) ^ svc.service_id.wrapping_mul(0x9e37_79b9);
    let (backend_id, b) = match sticky {
        Some(b) => b,
        None => {
            let picked = match pick(svc, p, hash) {
                Some(b) => b,
                None => {
                    // Rewritten by the agent under us: look once more (see
                    // the socket programs for the generation protocol).
                    // SAFETY: as for the first lookup.
                    let Some(fresh) = (unsafe { NP_SERVICES.get(&skey) }) else {
                        return Ok(PASS);
                    };
                    if fresh.backend_count == 0 {
                        return no_backend::<KERNEL>(p, &skey);
                    }
                    pick(fresh, p, hash).ok_or(np_counter::SLOT_MISS)?
                }
            };
            if affine {
                affinity_remember(p, svc.affinity_scope(), picked.0, now_ns);
            }
            picked
        }
    };
    if b.family != p.family {
        return Err(np_counter::PASS_UNPARSED);
    }
    let Some(s) = NP_SCRATCH.get_ptr_mut(0) else {
        return Err(np_counter::CT_UPDATE_FAILED);
    };
    // SAFETY: this CPU's slot of NP_SCRATCH element 0, never freed while
    // the map exists. No other reference to it is live: the caller holds
    // none, `no_backend` has not run (it returns before this point), the
    // source-range and affinity helpers' references ended with them, and no
    // other TC program runs on this CPU until this one returns (bottom
    // halves are disabled).
    let s = unsafe { &mut *s };
    // Ingress: DNAT only; the client's address is kept here in every case.
    s.fwd = CtValue { saddr_be: p.saddr, daddr_be: b.ip_be, sport_be: p.sport_be, dport_be: b.port_be, flags: 0, backend_id, seen_s: now };
    // Egress, backend -> client: the reply's source becomes the frontend.
    s.rev = CtValue { saddr_be: p.daddr, daddr_be: p.saddr, sport_be: p.dport_be, dport_be: p.sport_be, flags: 0, backend_id, seen_s: now };
    s.hash = hash;
    s.service_id = svc.service_id;
    s.tier = svc.counted_tier(b.tier) as u32;
    // Read here, with the frontend: the count itself comes only once the
    // flow is tracked (`commit_flow`).
    s.share_fp = NP_SVC_TOPO.get(svc_conn_index(svc.service_id)).map_or(0, |t| t.blind_remote_share_fp);
    Ok(PICKED)
}

/// Reserves the reply tuple (a SNAT port for a remote backend) and writes
/// the flow's `NP_CT` entries, from what `pick_backend` left in
/// `NP_SCRATCH`: the backend's address, port and id and the time are in
/// `fwd`.
#[inline(always)]
fn commit_flow<const KERNEL: u8>(p: &Pkt, fwd_key: &CtKey) -> Result<i32, u32> {
    let Some(s) = NP_SCRATCH.get_ptr_mut(0) else {
        return Err(np_counter::CT_UPDATE_FAILED);
    };
    // SAFETY: this CPU's slot of NP_SCRATCH element 0, never freed while
    // the map exists. No other reference to it is live: `pick_backend`'s
    // ended when it returned, and no other TC or XDP program runs on this
    // CPU until this one returns (bottom halves are disabled).
    // `reservation_expired` reborrows it from here.
    let s = unsafe { &mut *s };
    let b_ip_be = addr_copy(&s.fwd.daddr_be);
    let b_port_be = s.fwd.dport_be;
    let backend_id = s.fwd.backend_id;
    let now = s.fwd.seen_s;
    let hash = s.hash;
    s.key = CtKey {
        saddr_be: b_ip_be,
        daddr_be: p.saddr,
        sport_be: b_port_be,
        dport_be: p.sport_be,
        proto: p.proto,
        family: p.family,
        dir: CT_DIR_REPLY,
        _pad: 0,
    };
    // SAFETY: only whether the entry exists is used; the reference is never
    // read.
    let local = unsafe { NP_LOCAL.get(&AddrKey::new(b_ip_be, p.family)) }.is_some();
    if !local {
        // Remote backend. First reserve a SNAT port: the reply will arrive
        // as backend -> (node address, port) and must get the client back
        // as destination.
        let Some(cfg) = NP_CONFIG.get(0) else {
            return Err(np_counter::SNAT_FAILED);
        };
        s.key.dir = CT_DIR_REPLY_SNAT;
        if p.family == FAMILY_V4 {
            s.key.daddr_be = [cfg.snat_v4_be, 0, 0, 0];
        } else {
            s.key.daddr_be = addr_copy(&cfg.snat_v6_be);
        }
        if s.key.daddr_be == [0u32; 4] || cfg.snat_port_max < cfg.snat_port_min {
            return Err(np_counter::SNAT_FAILED);
        }
        s.val = CtValue {
            saddr_be: b_ip_be,
            daddr_be: p.saddr,
            sport_be: b_port_be,
            dport_be: p.sport_be,
            flags: CT_FLAG_SNAT,
            backend_id,
            seen_s: now,
        };
        let span = u32::from(cfg.snat_port_max - cfg.snat_port_min) + 1;
        let mut chosen = 0u16;
        let mut i = 0u32;
        while i < SNAT_TRIES {
            // Successive candidates spread over the range.
            let port = u32::from(cfg.snat_port_min) + (hash.wrapping_add(i.wrapping_mul(0x9e37_79b1)) % span);
            s.key.dport_be = (port as u16).to_be();
            // BPF_NOEXIST makes the insert the port reservation: two CPUs
            // racing for one port cannot both win.
            if NP_CT.insert(&s.key, &s.val, BPF_NOEXIST as u64).is_ok() {
                chosen = s.key.dport_be;
                break;
            }
            // Taken. The agent's conntrack GC deletes flows past their
            // timeout, but it runs only every few seconds (and not at all
            // while no agent runs), so take over a holder whose flow has
            // been silent for longer than its timeout in both directions.
            if reservation_expired(s, now, p.proto, p.family) && NP_CT.insert(&s.key, &s.val, 0).is_ok() {
                chosen = s.key.dport_be;
                break;
            }
            i += 1;
        }
        if chosen == 0 {
            return Err(np_counter::SNAT_FAILED);
        }
        // Egress, client -> backend: the source becomes (node, port).
        s.val = CtValue {
            saddr_be: s.key.daddr_be,
            daddr_be: b_ip_be,
            sport_be: chosen,
            dport_be: b_port_be,
            flags: CT_FLAG_SNAT,
            backend_id,
            seen_s: now,
        };
        s.key = CtKey {
            saddr_be: p.saddr,
            daddr_be: b_ip_be,
            sport_be: p.sport_be,
            dport_be: b_port_be,
            proto: p.proto,
            family: p.family,
            dir: CT_DIR_SNAT,
            _pad: 0,
        };
        if NP_CT.insert(&s.key, &s.val, 0).is_err() {
            return Err(np_counter::CT_UPDATE_FAILED);
        }
        s.fwd.flags = CT_FLAG_SNAT;
        // Back to the backend -> client reply key for the common insert.
        s.key = CtKey {
            saddr_be: b_ip_be,
            daddr_be: p.saddr,
            sport_be: b_port_be,
            dport_be: p.sport_be,
            proto: p.proto,
            family: p.family,
            dir: CT_DIR_REPLY,
            _pad: 0,
        };
    }
    // Local backends deliver directly with the client's address
    // (externalTrafficPolicy Local requires it; for Cluster it saves a
    // translation); the reply is reversed at egress.
    if NP_CT.insert(&s.key, &s.rev, 0).is_err() {
        return Err(np_counter::CT_UPDATE_FAILED);
    }
    if NP_CT.insert(fwd_key, &s.fwd, 0).is_err() {
        return Err(np_counter::CT_UPDATE_FAILED);
    }
    np_count(np_counter::NEW_FLOW);
    np_count_flow(s);
    Ok(TRANSLATE)
}

#[inline(always)]
fn ct_key(p: &Pkt, dir: u8) -> CtKey {
    CtKey {
        saddr_be: p.saddr,
        daddr_be: p.daddr,
        sport_be: p.sport_be,
        dport_be: p.dport_be,
        proto: p.proto,
        family: p.family,
        dir,
        _pad: 0,
    }
}

/// The fast path for a client's packet of a tracked flow whose forward
/// entry is `fwd` (`key` is its key, reused for the SNAT leg's): for a
/// remote backend, DNAT and SNAT at once to the `CT_DIR_SNAT` entry's
/// tuple, and out to the next hop (tc_fast.rs). A local backend (no SNAT:
/// the client's address is kept) gets the DNAT'ed packet in its own
/// namespace with `bpf_redirect_peer` where its route's device allows it;
/// otherwise (the host network, a bridge) the stack delivers it, as
/// without the fast path.
#[inline(always)]
fn fast_forward<const KERNEL: u8>(ctx: &TcContext, p: &Pkt, fwd: &CtValue, key: &mut CtKey, now: u32) -> Result<i32, u32> {
    if fwd.flags & CT_FLAG_SNAT == 0 {
        return fast_send(ctx, p, fwd, fwd, np_fast_counter::LOCAL_FORWARDED, true, now);
    }
    key.daddr_be = addr_copy(&fwd.daddr_be);
    key.dport_be = fwd.dport_be;
    key.dir = CT_DIR_SNAT;
    let Some(snat) = NP_CT.get_ptr_mut(key) else {
        tc_fast::count(np_fast_counter::STACK_NO_ENTRY);
        return apply(ctx, p, fwd);
    };
    // SAFETY: an NP_CT value pointer, valid for the run; races as in
    // `try_nodeport`.
    let snat = unsafe { &mut *snat };
    // What `np_egress` would have done with the packet after routing.
    touch_at(p, snat, CT_DIR_SNAT, now);
    fast_send(ctx, p, snat, fwd, np_fast_counter::FORWARDED, false, now)
}

/// The fast path for a remote backend's reply to our SNAT port, whose
/// `CT_DIR_REPLY_SNAT` entry is `rs` (it names the backend -> client
/// tuple): the destination and the source are turned back at once, to the
/// `CT_DIR_REPLY` entry's frontend -> client tuple, and the packet goes to
/// the client's next hop.
#[inline(always)]
fn fast_reply(ctx: &TcContext, p: &Pkt, rs: &CtValue, key: &mut CtKey, now: u32) -> Result<i32, u32> {
    key.saddr_be = addr_copy(&rs.saddr_be);
    key.daddr_be = addr_copy(&rs.daddr_be);
    key.sport_be = rs.sport_be;
    key.dport_be = rs.dport_be;
    key.dir = CT_DIR_REPLY;
    let Some(rev) = NP_CT.get_ptr_mut(key) else {
        tc_fast::count(np_fast_counter::STACK_NO_ENTRY);
        return apply(ctx, p, rs);
    };
    // SAFETY: an NP_CT value pointer, valid for the run; races as in
    // `try_nodeport`.
    let rev = unsafe { &mut *rev };
    // What `np_egress` would have done with the reply after routing.
    touch_at(p, rev, CT_DIR_REPLY, now);
    fast_send(ctx, p, rev, rs, np_fast_counter::REPLY_FORWARDED, false, now)
}

/// Rewrites `p` to `to` and redirects it to the next hop `tc_fast::route`
/// finds; when there is none usable, translates it to `stack` instead (the
/// first leg, as without the fast path) and passes it to the stack. With
/// `peer` (a local backend) it goes to the route's veth's peer, in the
/// backend's namespace.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn fast_send(ctx: &TcContext, p: &Pkt, to: &CtValue, stack: &CtValue, counter: u32, peer: bool, now: u32) -> Result<i32, u32> {
    let rc = tc_fast::route(ctx, p, to, now, peer);
    if rc == tc_fast::TO_STACK {
        return apply(ctx, p, stack);
    }
    // A failed store in `route`, or below, may leave the packet half
    // written: dropped, as `apply` does.
    if rc < 0 || (rc & tc_fast::TRANSLATED == 0 && rewrite(ctx, p, to) != 0) {
        np_count(np_counter::REWRITE_FAILED);
        return Ok(TC_ACT_SHOT);
    }
    // Translated, as `apply` counts it, and sent by the fast path.
    np_count(np_counter::TRACKED);
    tc_fast::count(counter);
    let ifindex = (rc & 0xffff_ffff) as u32;
    Ok(if peer { tc_fast::redirect_peer(ifindex) } else { tc_fast::redirect(ifindex) })
}

#[inline(always)]
fn apply(ctx: &TcContext, p: &Pkt, v: &CtValue) -> Result<i32, u32> {
    match rewrite(ctx, p, v) {
        0 => {
            np_count(np_counter::TRACKED);
            Ok(PASS)
        }
        // A failed helper may have left the packet half rewritten (one
        // checksum updated, the field not): drop it rather than deliver a
        // corrupt packet; TCP retransmits.
        _ => {
            np_count(np_counter::REWRITE_FAILED);
            Ok(TC_ACT_SHOT)
        }
    }
}

/// Whether a new flow's source lies inside the `loadBalancerSourceRanges`
/// of its frontend (`svc`, which has `SVC_FLAG_SOURCE_RANGES`): one lookup
/// in the frontend's ranges of its current generation. The agent adds the
/// LoadBalancer IP itself as a source when one of the node's addresses is
/// inside a range (kube-proxy's rule for a VIP the node answers for: such
/// requests loop back with the VIP as source).
#[inline(always)]
fn source_allowed(p: &Pkt, svc: &ServiceValue) -> bool {
    let Some(s) = NP_SCRATCH.get_ptr_mut(0) else {
        // Cannot happen (element 0 of a per-CPU array always exists); the
        // filter fails closed.
        return false;
    };
    // SAFETY: this CPU's slot of NP_SCRATCH element 0, never freed while
    // the map exists. No other reference to it is live: `new_flow_inner`
    // takes its own only after this returns, and no other TC program runs
    // on this CPU until this one returns (bottom halves are disabled).
    let s = unsafe { &mut *s };
    s.range.prefix_len = SOURCE_RANGE_FIXED_BITS + 128;
    s.range.data = SourceRangeKey::new(svc.service_id, svc.generation, p.family, p.saddr);
    NP_SOURCE_RANGES.get(&s.range).is_some()
}

/// The backend this client's affinity entry names for `svc`, when the
/// entry is fresh and its backend still one the frontend uses (listed in
/// `NP_AFFINITY_MATCH` under `svc`'s generation). Refreshes the entry on a
/// hit.
#[inline(always)]
fn affinity_lookup(p: &Pkt, svc: &ServiceValue, now_ns: u64) -> Option<(u32, &'static BackendValue)> {
    let s = NP_SCRATCH.get_ptr_mut(0)?;
    // SAFETY: this CPU's slot of NP_SCRATCH element 0 (see
    // `source_allowed`); the reference ends with this function.
    let s = unsafe { &mut *s };
    s.affinity = NpAffinityKey::new(p.saddr, svc.affinity_scope(), p.family);
    let entry = NP_AFFINITY.get_ptr_mut(&s.affinity)?;
    // SAFETY: the value pointer of an NP_AFFINITY element, valid for the
    // run (RCU, preallocated LRU elements never freed while the map
    // exists), read once; a concurrent refresh or an eviction that reuses
    // the element leaves stale or mixed integers, still a valid value.
    let found = unsafe { *entry };
    let mkey = AffinityMatchKey { service_id: svc.service_id, generation: svc.generation, backend_id: found.backend_id };
    // SAFETY: a map value, valid for the run, read at once.
    let fresh = unsafe { NP_AFFINITY_MATCH.get(&mkey) }.is_some_and(|m| !affinity_expired(now_ns, found.last_used_ns, m.timeout_s));
    // SAFETY: as in `pick`: valid for the run, used only within it.
    let Some(b) = (if fresh { unsafe { NP_BACKENDS.get(&BackendKey { backend_id: found.backend_id }) } } else { None }) else {
        np_count(np_counter::AFFINITY_STALE);
        return None;
    };
    if now_ns.saturating_sub(found.last_used_ns) >= AFFINITY_REFRESH_NS {
        // SAFETY: as above; an aligned u64 store into the element.
        unsafe { (*entry).last_used_ns = now_ns };
    }
    np_count(np_counter::AFFINITY_HIT);
    Some((found.backend_id, b))
}

/// Records that this client now uses `backend_id` for the Service port of
/// affinity scope `scope_id`.
#[inline(always)]
fn affinity_remember(p: &Pkt, scope_id: u32, backend_id: u32, now_ns: u64) {
    let Some(s) = NP_SCRATCH.get_ptr_mut(0) else {
        np_count(np_counter::AFFINITY_UPDATE_FAILED);
        return;
    };
    // SAFETY: this CPU's slot of NP_SCRATCH element 0 (see
    // `source_allowed`); the reference ends with this function.
    let s = unsafe { &mut *s };
    s.affinity = NpAffinityKey::new(p.saddr, scope_id, p.family);
    s.affinity_val = AffinityValue { last_used_ns: now_ns, backend_id, _pad: 0 };
    if NP_AFFINITY.insert(&s.affinity, &s.affinity_val, 0).is_err() {
        np_count(np_counter::AFFINITY_UPDATE_FAILED);
    }
}

/// Whether a tracked flow's next packet still goes to the backend its
/// entry names. TCP always: an established connection keeps its backend
/// as netfilter's conntrack keeps a DNAT (kube-proxy), whether the backend
/// stopped serving, left this node's topology or was removed; the agent
/// deletes the flow only once its endpoint is gone after terminating
/// (`decide::departures`), and the GC once it closes or idles out. Other
/// protocols while the backend still exists (the agent removes a backend
/// from NP_BACKENDS once no frontend uses it): a UDP flow has no end, so
/// it moves to a live backend.
///
/// The backend is looked up when the flow's `seen_s` is due for its
/// refresh (`CT_REFRESH_S` old, see `touch`), not per packet: at most once
/// a second per flow, at the packet that refreshes it. A refresh is only
/// written after this check passed (and `new_flow` writes `seen_s` after
/// its pick), so a fresh `seen_s` means the backend existed less than
/// `CT_REFRESH_S` ago. A UDP flow therefore goes on to a removed backend
/// for at most `CT_REFRESH_S` (1 s) after the agent removed it, where the
/// check per packet moved it at once; the agent deletes the flows of a
/// deleted endpoint itself (`conntrack_gc::flush`), and the conntrack GC those
/// of a backend gone from NP_BACKENDS. The lookup per packet was one hash
/// lookup of the fast path's five on a UDP flow's packet (#33).
#[inline(always)]
pub(crate) fn keeps_backend(proto: u8, v: &CtValue, now: u32) -> bool {
    proto == PROTO_TCP || now.wrapping_sub(v.seen_s) < CT_REFRESH_S || backend_alive(v)
}

#[inline(always)]
pub(crate) fn backend_alive(v: &CtValue) -> bool {
    // SAFETY: the value is valid memory for the run (RCU, preallocated hash
    // elements) and read at once; a concurrent replacement by the agent
    // leaves stale integers, never an invalid `BackendValue`.
    match unsafe { NP_BACKENDS.get(&BackendKey { backend_id: v.backend_id }) } {
        Some(b) => b.ip_be == v.daddr_be && b.port_be == v.dport_be,
        None => false,
    }
}

/// The backend of a new flow: its id and its entry, looked up once here
/// (the caller needs both). The frontend's Maglev table picks it when the
/// generation has one; otherwise (a datapath written by an agent without
/// tables, or a table not linked in) the slot `hash` selects, so a missing
/// table never breaks the flow.
#[inline(always)]
fn pick(svc: &ServiceValue, p: &Pkt, hash: u32) -> Option<(u32, &'static BackendValue)> {
    let id = match maglev_entry(svc, p) {
        Some(id) => id,
        // SAFETY: valid memory for the run (RCU, preallocated hash
        // elements), read at once.
        None => unsafe { NP_SLOTS.get(&svc.slot_for(hash)) }?.backend_id,
    };
    // The backend must exist too (a slot may briefly point at a backend
    // that an interrupted agent never wrote).
    // SAFETY: a map value stays valid memory for this program run (RCU,
    // preallocated hash elements), and the caller uses the reference only
    // within the run, despite its `'static` type. The programs never update
    // NP_BACKENDS, so only the agent can change it meanwhile, leaving stale
    // integers, never an invalid `BackendValue`.
    let b = unsafe { NP_BACKENDS.get(&BackendKey { backend_id: id }) }?;
    Some((id, b))
}

/// The backend id the frontend generation's Maglev table names for this
/// flow (see `proxy_common::maglev_hash`), or `None` without a table.
#[inline(always)]
fn maglev_entry(svc: &ServiceValue, p: &Pkt) -> Option<u32> {
    let m = svc.maglev_size();
    if m == 0 {
        return None;
    }
    let hash = maglev_hash(&p.saddr, p.sport_be, p.dport_be, p.proto, svc.flags & SVC_FLAG_AFFINITY != 0);
    let key = MaglevKey { service_id: svc.service_id, generation: svc.generation };
    // SAFETY: the outer lookup returns the inner array the agent linked in
    // under this generation; the kernel keeps it alive for the run (inner
    // maps are freed after an RCU grace period once unlinked), and an array
    // element is plain u32 memory that is never freed while its map exists.
    // The programs never write the tables, and the agent fills a table
    // before linking it in, so the value is a complete id. An index past an
    // array's size (not possible with the agent's tables) is a miss.
    let id = unsafe { NP_MAGLEV.get_value(&key, &(hash % m)) }.copied();
    if id.is_none() {
        np_count(np_counter::MAGLEV_MISS);
    }
    id
}

/// A frontend without a usable backend.
///
/// * `externalTrafficPolicy: Local` without a local endpoint: drop, as
///   kube-proxy does ("has no local endpoints" filter rule); the load
///   balancer's health check (served by the agent) steers clients away.
/// * Otherwise the flow must be rejected, not black-holed. The packet is
///   DNAT'ed to port 0 of this node's address: no socket can listen on
///   port 0, so the node's stack answers with a TCP RST
///   (`tcp_v4_send_reset`/`tcp_v6_send_reset`) or an ICMP port unreachable
///   (`__udp4_lib_rcv`/`__udp6_lib_rcv`), with correct checksums and
///   sequence numbers and under the stack's ICMP rate limits. A reply
///   conntrack entry turns that answer's source back into the frontend at
///   egress (for ICMP through the quoted header, see icmp.rs), so the client
///   sees the rejection from the address it used, also for LoadBalancer and
///   external IPs that are not assigned to the node. No forward entry is
///   kept: the next packet looks at the Service again.
#[inline(always)]
fn no_backend<const KERNEL: u8>(p: &Pkt, skey: &ServiceKey) -> Result<i32, u32> {
    let now = now_s::<KERNEL>();
    // SAFETY: valid memory for the run (RCU, preallocated hash elements);
    // `flags` is copied out at once.
    let flags = unsafe { NP_FLAGS.get(skey) }.map(|f| f.flags).unwrap_or(0);
    if flags & NP_FLAG_POLICY_LOCAL != 0 {
        np_count(np_counter::DROPPED_NO_LOCAL);
        return Ok(TC_ACT_SHOT);
    }
    let Some(cfg) = NP_CONFIG.get(0) else {
        return Err(np_counter::SNAT_FAILED);
    };
    let local = if p.family == FAMILY_V4 { [cfg.snat_v4_be, 0, 0, 0] } else { cfg.snat_v6_be };
    if local == [0u32; 4] {
        // No node address known: drop (and count) rather than forward a
        // packet for a VIP that may loop.
        np_count(np_counter::SNAT_FAILED);
        return Ok(TC_ACT_SHOT);
    }
    let Some(s) = NP_SCRATCH.get_ptr_mut(0) else {
        return Err(np_counter::CT_UPDATE_FAILED);
    };
    // SAFETY: this CPU's slot of NP_SCRATCH element 0, never freed while
    // the map exists. No other reference to it is live: `new_flow_inner`
    // calls this before it takes its own, and no other TC program runs on
    // this CPU until this one returns.
    let s = unsafe { &mut *s };
    s.fwd = CtValue { saddr_be: p.saddr, daddr_be: local, sport_be: p.sport_be, dport_be: 0, flags: 0, backend_id: 0, seen_s: now };
    s.rev =
        CtValue { saddr_be: p.daddr, daddr_be: p.saddr, sport_be: p.dport_be, dport_be: p.sport_be, flags: 0, backend_id: 0, seen_s: now };
    s.key = CtKey {
        saddr_be: local,
        daddr_be: p.saddr,
        sport_be: 0,
        dport_be: p.sport_be,
        proto: p.proto,
        family: p.family,
        dir: CT_DIR_REPLY,
        _pad: 0,
    };
    if NP_CT.insert(&s.key, &s.rev, 0).is_err() {
        return Err(np_counter::CT_UPDATE_FAILED);
    }
    np_count(np_counter::REJECTED_NO_BACKEND);
    Ok(TRANSLATE)
}
