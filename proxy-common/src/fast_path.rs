//! The XDP next-hop cache and the TC fast path (`--tc-fast-path`).
//!
//! XDP keeps the result of `bpf_fib_lookup` for a forwarded flow for a
//! second, so that its steady state skips the route and neighbour lookup
//! (the largest single cost of its per-packet path, measured by
//! `cargo xtask bench --only xdp`). The TC fast path sends a translated
//! NodePort/LoadBalancer/externalIP packet to or from a remote backend to
//! its next hop from TC ingress (`bpf_fib_lookup`, then `bpf_redirect`),
//! without the stack's routing, netfilter and conntrack; its next hops
//! share `XDP_NEXTHOP` with the XDP program (same key: the packet as it
//! leaves, and its input device).

// XDP_NEXTHOP: BPF_MAP_TYPE_LRU_HASH, XdpNextHopKey -> XdpNextHopValue.
// Written and read by the XDP program and the TC fast path; not pinned,
// the agent never reads it.
/// LRU hash, [`XdpNextHopKey`] -> [`XdpNextHopValue`]. Private to the load
/// of the XDP program and the TC programs, which share it for the TC fast
/// path (not pinned, not in the agent's map table): it is a cache that
/// refills from `bpf_fib_lookup`, so a restarted agent's programs start
/// with an empty one and lose nothing.
pub const XDP_NEXTHOP_MAP: &str = "XDP_NEXTHOP";
/// Its capacity for the XDP program and the TC fast path: flows forwarded
/// at once that keep their next hop cached (about 100 bytes each in the
/// kernel). Loads of the object that run neither create it with one entry.
pub const XDP_NEXTHOP_ENTRIES: u32 = 65_536;
/// How long a cached next hop is used before `bpf_fib_lookup` is asked
/// again: a route or neighbour change reaches a flow's packets within this
/// many seconds (the neighbour's MAC, the output device, forwarding turned
/// off). Seconds of the coarse monotonic clock, as `CtValue.seen_s`.
pub const XDP_NEXTHOP_TTL_S: u32 = 1;

/// A forwarded flow's packet as it leaves the node (after DNAT and SNAT:
/// the SNAT address and port to the backend), and the device it came in on:
/// everything `bpf_fib_lookup` was asked besides the packet's length and
/// TOS/flow label, which one flow keeps.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct XdpNextHopKey {
    /// Source address as the packet leaves, network byte order (IPv4 in the first word).
    pub saddr_be: [u32; 4],
    /// Destination address as the packet leaves, network byte order.
    pub daddr_be: [u32; 4],
    /// Source port as the packet leaves, network byte order.
    pub sport_be: u16,
    /// Destination port as the packet leaves, network byte order.
    pub dport_be: u16,
    /// The device the packet came in on.
    pub ingress_ifindex: u32,
    /// `PROTO_TCP` or `PROTO_UDP`.
    pub proto: u8,
    /// `FAMILY_V4` or `FAMILY_V6`.
    pub family: u8,
    /// Padding, always zero.
    pub _pad: [u8; 2],
}

/// What `bpf_fib_lookup` answered for a flow: the output device and the
/// MAC addresses to write, when (`checked_s`), and the longest packet it
/// checked against the route's MTU (`max_len_host`, the lookup's
/// `tot_len`): a longer packet asks the helper again, which answers
/// "fragmentation needed" where the MTU is smaller.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct XdpNextHopValue {
    /// The output device.
    pub ifindex: u32,
    /// When the helper answered: seconds of the coarse monotonic clock.
    pub checked_s: u32,
    /// The next hop's MAC address.
    pub dmac: [u8; 6],
    /// The output device's MAC address.
    pub smac: [u8; 6],
    /// The longest packet (`tot_len`, host order) checked against the route's MTU.
    pub max_len_host: u16,
    /// Padding, always zero.
    pub _pad: u16,
}

/// Whether a cached next hop `v` may forward a packet of `len_host`
/// (`tot_len` as `bpf_fib_lookup` takes it) at `now_s`.
#[inline(always)]
pub fn xdp_nexthop_usable(v: &XdpNextHopValue, len_host: u16, now_s: u32) -> bool {
    now_s.wrapping_sub(v.checked_s) < XDP_NEXTHOP_TTL_S && len_host <= v.max_len_host
}

const _: () = {
    assert!(core::mem::size_of::<XdpNextHopKey>() == 44);
    assert!(core::mem::size_of::<XdpNextHopValue>() == 24);
};

/// The `.rodata` global the TC programs read (u8, 1 = fast path on), set
/// by the loader for each load (`EbpfLoader::override_global`), so `off` is a
/// constant the verifier prunes.
pub const TC_FAST_PATH_GLOBAL: &str = "TC_FAST_PATH";

// NP_PEER_DEVS: BPF_MAP_TYPE_HASH, ifindex (u32) -> NP_PEER_DEV_* flags.
// Written by the agent (from the kernel's link list); read by the TC fast
// path.
/// Hash of interface index (u32, host order) to flags (u32,
/// `NP_PEER_DEV_*`): the devices of this namespace a local backend's
/// packet may be handed to with `bpf_redirect_peer`, veths whose peer lives
/// in another network namespace (a pod's). The agent writes it from the
/// kernel's link list (`IFLA_INFO_KIND` "veth" with `IFLA_LINK_NETNSID`).
/// `bpf_redirect_peer` drops a packet whose device has no peer or whose
/// peer is in the same namespace (`skb_do_redirect`, net/core/filter.c),
/// which the program cannot tell cheaply, hence the list.
pub const NP_PEER_DEVS_MAP: &str = "NP_PEER_DEVS";
/// Capacity of `NP_PEER_DEVS`: veths on one node, one per local pod
/// (kubelet's default is 110 pods, large nodes run a few hundred).
pub const NP_PEER_DEVS_ENTRIES: u32 = 4096;
/// `NP_PEER_DEVS` flag: a veth whose peer is in another namespace.
pub const NP_PEER_DEV_VETH: u32 = 1;

#[cfg(feature = "user")]
mod pod {
    //! `aya::Pod` for the types above: each is `#[repr(C)]`, holds only
    //! integers and integer arrays (padding spelled out as `_pad` fields),
    //! and its fields add up to the size asserted above, so every byte is
    //! initialised and every bit pattern is a valid value (see the crate's
    //! `lib.rs`).

    use super::{XdpNextHopKey, XdpNextHopValue};

    // SAFETY: repr(C) integers only; 16 + 16 + 2 + 2 + 4 + 1 + 1 + 2 (`_pad`) = 44 bytes, no padding.
    unsafe impl aya::Pod for XdpNextHopKey {}
    // SAFETY: repr(C) integers only; 4 + 4 + 6 + 6 + 2 + 2 (`_pad`) = 24 bytes, no padding.
    unsafe impl aya::Pod for XdpNextHopValue {}
}

#[cfg(test)]
mod tests {
    extern crate std;
    use crate::*;

    #[test]
    fn a_cached_next_hop_serves_packets_no_longer_than_checked_within_its_ttl() {
        let v = XdpNextHopValue { checked_s: 100, max_len_host: 1000, ..Default::default() };
        // (packet length, now, usable)
        let cases = [
            (1000, 100, true),
            (64, 100, true),
            (1001, 100, false),
            (1000, 100 + XDP_NEXTHOP_TTL_S - 1, true),
            (1000, 100 + XDP_NEXTHOP_TTL_S, false),
            (1000, 99, false), // a clock behind the entry (wrapped) is stale
        ];
        for (len, now, want) in cases {
            assert_eq!(xdp_nexthop_usable(&v, len, now), want, "len {len} at {now}");
        }
        // The seconds counter wraps: an entry checked at its last value is
        // judged by the distance across the wrap.
        let w = XdpNextHopValue { checked_s: u32::MAX, max_len_host: 100, ..Default::default() };
        assert!(xdp_nexthop_usable(&w, 100, u32::MAX.wrapping_add(XDP_NEXTHOP_TTL_S - 1)));
        assert!(!xdp_nexthop_usable(&w, 100, u32::MAX.wrapping_add(XDP_NEXTHOP_TTL_S)));
    }
}
