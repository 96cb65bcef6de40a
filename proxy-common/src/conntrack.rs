//! The TC programs' connection tracking: one entry per leg of a
//! translated external flow.

// NP_CT: BPF_MAP_TYPE_LRU_HASH, CtKey -> CtValue. Written by the TC
// programs (new flows, refreshes, closing flags); read by the TC and XDP
// programs, and by the agent, whose conntrack GC deletes expired flows and
// the flows of departed backends.
/// Connection tracking ([`CtKey`] -> [`CtValue`]), LRU.
pub const NP_CT_MAP: &str = "NP_CT";

/// Default capacity of `NP_CT`: tracked entries (each flow takes two or four).
pub const DEFAULT_MAX_NP_CT: u32 = 262_144;

// `CtKey.dir`: which hook and which leg of a flow an entry is for. A flow
// to a remote backend is translated in two steps per direction, because
// IPv4 drops packets that arrive with one of the node's own addresses as
// source unless `accept_local` is set (`fib_validate_source`): so the source
// is rewritten to the node address only at egress, after routing, and a
// reply's destination is rewritten at ingress (so the stack forwards it to
// the client) while its source becomes the frontend again at egress.

/// Ingress, client -> frontend: DNAT to the backend.
pub const CT_DIR_FORWARD: u8 = 0;
/// Egress, backend -> client: the source becomes the frontend again.
pub const CT_DIR_REPLY: u8 = 1;
/// Egress, client -> remote backend (after DNAT): SNAT to the node address
/// and a port of the SNAT range.
pub const CT_DIR_SNAT: u8 = 2;
/// Ingress, remote backend -> SNAT address and port: the destination
/// becomes the client again.
pub const CT_DIR_REPLY_SNAT: u8 = 3;

/// A packet's 5-tuple as it is seen on the wire at the TC hook.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CtKey {
    /// Source address, network byte order (IPv4 in the first word).
    pub saddr_be: [u32; 4],
    /// Destination address, network byte order.
    pub daddr_be: [u32; 4],
    /// Source port, network byte order.
    pub sport_be: u16,
    /// Destination port, network byte order.
    pub dport_be: u16,
    /// `PROTO_TCP` or `PROTO_UDP`.
    pub proto: u8,
    /// `FAMILY_V4` or `FAMILY_V6`.
    pub family: u8,
    /// `CT_DIR_FORWARD` or `CT_DIR_REPLY`.
    pub dir: u8,
    /// Padding, always zero.
    pub _pad: u8,
}

/// `CtValue.flags`: the forward translation also rewrote the source (the
/// backend is on another node).
pub const CT_FLAG_SNAT: u32 = 1;
/// `CtValue.flags`: the TCP flow is closing: a RST from either side, or a
/// FIN from both. It then expires after `CT_TIMEOUT_TCP_CLOSING_S`.
pub const CT_FLAG_CLOSING: u32 = 2;
/// `CtValue.flags`: a TCP FIN was seen from the client. One FIN is only a
/// half-close (the other side may go on sending for as long as it likes,
/// RFC 9293 3.6), so it does not shorten the timeout on its own.
pub const CT_FLAG_FIN_CLIENT: u32 = 4;
/// `CtValue.flags`: a TCP FIN was seen from the backend.
pub const CT_FLAG_FIN_BACKEND: u32 = 8;
/// `CtValue.flags`: a packet from the backend matched this entry (set on
/// the reply legs, once). A TCP flow none of whose entries has it never got
/// an answer: a connection attempt to a backend that drops SYNs, or a scan.
/// Such a flow gets the short `CT_TIMEOUT_TCP_SYN_S` rather than the
/// established timeout, so unanswered SYNs cannot pin SNAT ports and
/// conntrack entries for 6 h.
pub const CT_FLAG_REPLIED: u32 = 16;

/// The TC programs write a tracked entry's `seen_s` only when the stored
/// value is at least this many seconds old, not on every packet (see
/// `proxy-ebpf/src/programs/nodeport.rs`, `touch`). Timeouts are therefore exact to
/// this much.
pub const CT_REFRESH_S: u32 = 1;

/// How long a SNAT port stays reserved without replies, by state (seconds).
/// The values follow Cilium's conntrack defaults: established TCP 6 h,
/// closing TCP 10 s, unanswered TCP 60 s, everything else 60 s.
pub const CT_TIMEOUT_TCP_S: u32 = 21_600;
/// A closing TCP flow (`CT_FLAG_CLOSING`).
pub const CT_TIMEOUT_TCP_CLOSING_S: u32 = 10;
/// TCP that never saw a packet from the backend (Cilium's SYN timeout).
pub const CT_TIMEOUT_TCP_SYN_S: u32 = 60;
/// UDP.
pub const CT_TIMEOUT_OTHER_S: u32 = 60;

/// What a tracked packet becomes: every matching packet gets exactly this
/// source and destination. Forward entries also carry the backend id so a
/// flow can check its backend still exists.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CtValue {
    /// The source address the packet gets, network byte order.
    pub saddr_be: [u32; 4],
    /// The destination address the packet gets, network byte order.
    pub daddr_be: [u32; 4],
    /// The source port the packet gets, network byte order.
    pub sport_be: u16,
    /// The destination port the packet gets, network byte order.
    pub dport_be: u16,
    /// `CT_FLAG_*` bits.
    pub flags: u32,
    /// `NP_BACKENDS` id the flow was sent to (forward entries only).
    pub backend_id: u32,
    /// Seconds of `bpf_ktime_get_ns` (CLOCK_MONOTONIC) when a packet last
    /// matched this entry, refreshed at most every `CT_REFRESH_S`. A flow
    /// whose entries are all older than its timeout is deleted by the
    /// agent's conntrack GC, and a SNAT port whose reservation is that old
    /// may be taken over by a new flow.
    pub seen_s: u32,
}

/// TCP header flag bits (`tcphdr` byte 13).
pub const TCP_FLAG_FIN: u8 = 0x01;
/// RST.
pub const TCP_FLAG_RST: u8 = 0x04;

/// A tracked entry's flags after a TCP segment with `tcp_flags` went by,
/// sent by the client (`from_client`) or by the backend. A RST ends the
/// flow at once (RFC 9293 3.5.3: the receiver drops the connection); a FIN
/// only once both sides have sent one, since a half-closed connection may
/// carry data the other way for as long as it likes.
#[inline(always)]
pub fn ct_flags_after(flags: u32, tcp_flags: u8, from_client: bool) -> u32 {
    let mut f = flags;
    if tcp_flags & TCP_FLAG_RST != 0 {
        f |= CT_FLAG_CLOSING;
    }
    if tcp_flags & TCP_FLAG_FIN != 0 {
        f |= if from_client { CT_FLAG_FIN_CLIENT } else { CT_FLAG_FIN_BACKEND };
    }
    if f & (CT_FLAG_FIN_CLIENT | CT_FLAG_FIN_BACKEND) == CT_FLAG_FIN_CLIENT | CT_FLAG_FIN_BACKEND {
        f |= CT_FLAG_CLOSING;
    }
    f
}

/// Whether packets matching an entry of direction `dir` come from the
/// client (forward legs) or from the backend (reply legs).
#[inline(always)]
pub fn ct_dir_from_client(dir: u8) -> bool {
    dir == CT_DIR_FORWARD || dir == CT_DIR_SNAT
}

/// The direction of the entry that holds the other half of a flow: the
/// forward leg's reply and back, the SNAT leg's SNAT reply and back.
#[inline(always)]
pub fn ct_peer_dir(dir: u8) -> u8 {
    match dir {
        CT_DIR_FORWARD => CT_DIR_REPLY,
        CT_DIR_REPLY => CT_DIR_FORWARD,
        CT_DIR_SNAT => CT_DIR_REPLY_SNAT,
        _ => CT_DIR_SNAT,
    }
}

impl CtValue {
    /// The key of the entry for the opposite direction of this entry's flow
    /// (`ct_peer_dir(dir)`). Every entry's value is the packet as it leaves
    /// the translation, so the peer's key is that tuple reversed: forward
    /// (client -> backend) gives the reply key backend -> client, SNAT
    /// (node:port -> backend) gives backend -> node:port, and the reply
    /// entries' values (frontend -> client, backend -> client) give the
    /// forward and SNAT keys back.
    #[inline(always)]
    pub fn peer_key(&self, proto: u8, family: u8, dir: u8) -> CtKey {
        CtKey {
            saddr_be: self.daddr_be,
            daddr_be: self.saddr_be,
            sport_be: self.dport_be,
            dport_be: self.sport_be,
            proto,
            family,
            dir: ct_peer_dir(dir),
            _pad: 0,
        }
    }
}

const _: () = {
    assert!(core::mem::size_of::<CtKey>() == 40);
    assert!(core::mem::size_of::<CtValue>() == 48);
};

#[cfg(feature = "user")]
mod pod {
    //! `aya::Pod` for the types above: each is `#[repr(C)]`, holds only
    //! integers and integer arrays (padding spelled out as `_pad` fields),
    //! and its fields add up to the size asserted above, so every byte is
    //! initialised and every bit pattern is a valid value (see the crate's
    //! `lib.rs`).

    use super::{CtKey, CtValue};

    // SAFETY: repr(C) integers only; 16 + 16 + 2 + 2 + 1 + 1 + 1 + 1 (`_pad`) = 40 bytes, no padding.
    unsafe impl aya::Pod for CtKey {}
    // SAFETY: repr(C) integers only; 16 + 16 + 2 + 2 + 4 + 4 + 4 = 48 bytes, no padding.
    unsafe impl aya::Pod for CtValue {}
}

#[cfg(test)]
mod tests {
    extern crate std;
    use crate::*;

    #[test]
    fn tcp_flags_drive_the_closing_state() {
        // (flags before, tcp flags, from client) -> flags after
        let cases = [
            (0, 0x10 /* ACK */, true, 0),
            (0, 0x02 /* SYN */, false, 0),
            (0, 0x11 /* FIN|ACK */, true, CT_FLAG_FIN_CLIENT),
            (0, 0x11, false, CT_FLAG_FIN_BACKEND),
            (CT_FLAG_FIN_CLIENT, 0x11, true, CT_FLAG_FIN_CLIENT),
            (CT_FLAG_FIN_CLIENT, 0x11, false, CT_FLAG_FIN_CLIENT | CT_FLAG_FIN_BACKEND | CT_FLAG_CLOSING),
            (CT_FLAG_FIN_BACKEND, 0x01, true, CT_FLAG_FIN_CLIENT | CT_FLAG_FIN_BACKEND | CT_FLAG_CLOSING),
            (0, 0x04 /* RST */, true, CT_FLAG_CLOSING),
            (0, 0x14, false, CT_FLAG_CLOSING),
            (CT_FLAG_SNAT, 0x04, false, CT_FLAG_SNAT | CT_FLAG_CLOSING),
            (CT_FLAG_SNAT | CT_FLAG_CLOSING, 0x10, true, CT_FLAG_SNAT | CT_FLAG_CLOSING),
        ];
        for (before, tcp, client, after) in cases {
            assert_eq!(ct_flags_after(before, tcp, client), after, "{before:#x} {tcp:#x} {client}");
        }
        assert!(ct_dir_from_client(CT_DIR_FORWARD) && ct_dir_from_client(CT_DIR_SNAT));
        assert!(!ct_dir_from_client(CT_DIR_REPLY) && !ct_dir_from_client(CT_DIR_REPLY_SNAT));
    }

    #[test]
    fn peer_keys_name_the_other_direction_of_the_flow() {
        let (c, f, b, n) = ([1, 0, 0, 0], [2, 0, 0, 0], [3, 0, 0, 0], [4, 0, 0, 0]);
        let key = |s, d, sp, dp, dir| CtKey {
            saddr_be: s,
            daddr_be: d,
            sport_be: sp,
            dport_be: dp,
            proto: PROTO_TCP,
            family: FAMILY_V4,
            dir,
            _pad: 0,
        };
        let val = |s, d, sp, dp| CtValue { saddr_be: s, daddr_be: d, sport_be: sp, dport_be: dp, ..Default::default() };
        // The four entries of a flow client:10 -> frontend:20, DNAT'ed to
        // backend:30 and SNAT'ed to node:40, as nodeport.rs writes them.
        let forward = (key(c, f, 10, 20, CT_DIR_FORWARD), val(c, b, 10, 30));
        let reply = (key(b, c, 30, 10, CT_DIR_REPLY), val(f, c, 20, 10));
        let snat = (key(c, b, 10, 30, CT_DIR_SNAT), val(n, b, 40, 30));
        let reply_snat = (key(b, n, 30, 40, CT_DIR_REPLY_SNAT), val(b, c, 30, 10));
        for ((k, v), peer) in [(forward, reply.0), (reply, forward.0), (snat, reply_snat.0), (reply_snat, snat.0)] {
            assert_eq!(v.peer_key(k.proto, k.family, k.dir), peer);
        }
    }
}
