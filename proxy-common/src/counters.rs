//! Reason counters: the programs count what they did and why instead of
//! logging per packet.

// COUNTERS: BPF_MAP_TYPE_PERCPU_ARRAY, counter::* -> u64. Written by the
// socket programs (and, for the `ENDED_*` entries, the agent's termination
// worker); read by the agent (metrics, dump).
/// Per-CPU array of `u64`, indexed by [`counter`]: the socket programs' reason counts.
pub const COUNTERS_MAP: &str = "COUNTERS";

/// Indexes into the per-CPU `COUNTERS` array. The programs count by reason
/// instead of logging per packet.
pub mod counter {
    /// A connect/sendmsg to a frontend was translated to a backend.
    pub const TRANSLATED: u32 = 0;
    /// A frontend with zero backends refused a connect/sendmsg.
    pub const REFUSED_NO_BACKEND: u32 = 1;
    /// A slot or backend lookup missed twice in a row (the agent rewrote the
    /// service twice during one program run); the socket was left untouched.
    pub const SLOT_MISS: u32 = 2;
    /// The reverse-translation entry could not be stored.
    pub const REVNAT_UPDATE_FAILED: u32 = 3;
    /// getpeername/recvmsg reported a backend and was translated back.
    pub const REVERSED: u32 = 4;
    /// A context field could not be read (unexpected kernel behaviour).
    pub const CTX_ERROR: u32 = 5;
    /// Socket-local storage could not be allocated (memory pressure); the
    /// translation went to `SOCK_REVNAT` instead.
    pub const PEER_STORAGE_FAILED: u32 = 6;
    /// A connect/sendmsg to a LoadBalancer IP with `loadBalancerSourceRanges`
    /// from a client outside them was refused (`ECONNREFUSED`).
    pub const REFUSED_SOURCE_RANGE: u32 = 7;
    /// A client's affinity entry chose the backend.
    pub const AFFINITY_HIT: u32 = 8;
    /// A client's affinity entry had expired or named a backend the
    /// frontend no longer uses; a new backend was chosen (and remembered).
    pub const AFFINITY_STALE: u32 = 9;
    /// An affinity entry could not be stored; the connection still went to
    /// the backend chosen.
    pub const AFFINITY_UPDATE_FAILED: u32 = 10;
    /// A UDP frontend generation announced a Maglev table that is not
    /// linked in `SOCK_MAGLEV`: the socket took the modulo slot pick.
    pub const MAGLEV_MISS: u32 = 11;
    // Written by the agent, never by the programs: sockets the agent
    // terminated because their backend left, by the rule that ended them
    // (`decide::departures`), so that `dump` shows them beside the
    // programs' counts. Added to the first CPU's value; the agent's
    // termination worker is their only writer.
    /// Connected UDP sockets whose endpoint was gone from its Service.
    pub const ENDED_UDP_DELETED: u32 = 12;
    /// Connected UDP sockets whose endpoint stopped serving.
    pub const ENDED_UDP_NOT_SERVING: u32 = 13;
    /// Connected UDP sockets whose endpoint this node's topology no longer
    /// picked.
    pub const ENDED_UDP_TOPOLOGY: u32 = 14;
    /// TCP sockets whose endpoint was gone after it was seen terminating.
    pub const ENDED_TCP_GONE_AFTER_TERMINATING: u32 = 15;
    /// A translated connect() found `SOCK_REC` full (or its bucket busy):
    /// the connection still went to its backend, and its record went to
    /// socket storage (`SOCK_PEER`) instead.
    pub const SOCK_RECORD_FULL: u32 = 16;
    /// A translated connection or new UDP flow whose frontend's service id
    /// has no `SVC_CONN` slot (given out by an older build, before ids
    /// were bounded by the capacity): translated, not counted by tier.
    pub const TOPO_UNCOUNTED: u32 = 17;
    /// The size of the array. A datapath pinned by an agent version with
    /// fewer counters gets a new array of this size at the upgrade, its
    /// counts carried over (proxy-agent `map_migration::plan`).
    pub const COUNT: u32 = 18;

    /// Names for display, indexed by counter id.
    pub const NAMES: [&str; COUNT as usize] = [
        "translated",
        "refused_no_backend",
        "slot_miss",
        "revnat_update_failed",
        "reversed",
        "ctx_error",
        "peer_storage_failed",
        "refused_source_range",
        "affinity_hit",
        "affinity_stale",
        "affinity_update_failed",
        "maglev_miss",
        "ended_udp_deleted",
        "ended_udp_not_serving",
        "ended_udp_topology",
        "ended_tcp_gone_after_terminating",
        "sock_record_full",
        "topo_uncounted",
    ];
}

// NP_COUNTERS: BPF_MAP_TYPE_PERCPU_ARRAY, np_counter::* -> u64. Written by
// the TC and XDP programs; read by the agent.
/// Per-CPU array of `u64`, indexed by [`np_counter`]: the TC and XDP programs' reason counts.
pub const NP_COUNTERS_MAP: &str = "NP_COUNTERS";

/// Indexes into the per-CPU `NP_COUNTERS` array.
pub mod np_counter {
    /// A new external flow was translated to a backend.
    pub const NEW_FLOW: u32 = 0;
    /// A packet of a tracked flow was translated (either direction).
    pub const TRACKED: u32 = 1;
    /// A tracked flow's backend was gone; the flow picked a new one.
    pub const STALE_BACKEND: u32 = 2;
    /// A frontend without a usable backend: the packet was rejected.
    pub const REJECTED_NO_BACKEND: u32 = 3;
    /// externalTrafficPolicy Local without a local endpoint: dropped.
    pub const DROPPED_NO_LOCAL: u32 = 4;
    /// Not parseable as ours (truncated, more IPv6 extension headers than
    /// the programs skip, an IPv6 routing header with segments left, unknown
    /// protocol): passed untouched.
    pub const PASS_UNPARSED: u32 = 5;
    /// An IPv4 or IPv6 fragment: passed untouched (a later fragment has no
    /// L4 header to translate).
    pub const PASS_FRAGMENT: u32 = 6;
    /// No free SNAT port, or no SNAT address configured: passed untouched.
    pub const SNAT_FAILED: u32 = 7;
    /// A conntrack entry could not be stored.
    pub const CT_UPDATE_FAILED: u32 = 8;
    /// A slot or backend lookup missed twice.
    pub const SLOT_MISS: u32 = 9;
    /// A packet rewrite helper failed (the packet is dropped: it may be half
    /// rewritten).
    pub const REWRITE_FAILED: u32 = 10;
    /// An ICMP error about a tracked flow was translated back.
    pub const ICMP_TRANSLATED: u32 = 11;
    /// A new flow to a LoadBalancer IP from a source outside its
    /// `loadBalancerSourceRanges`: dropped (kube-proxy drops it too).
    pub const DROPPED_SOURCE_RANGE: u32 = 12;
    /// A client's affinity entry chose the backend of a new flow.
    pub const AFFINITY_HIT: u32 = 13;
    /// A client's affinity entry had expired or named a backend the
    /// frontend no longer uses; a new backend was chosen.
    pub const AFFINITY_STALE: u32 = 14;
    /// An affinity entry could not be stored (the flow was translated).
    pub const AFFINITY_UPDATE_FAILED: u32 = 15;
    /// A TCP segment to a frontend that opens no connection (no SYN, or a
    /// SYN-ACK) and belongs to no tracked flow: passed untouched, so that a
    /// connection translated before the programs were attached (by
    /// kube-proxy, in netfilter's conntrack) goes on as it was.
    pub const PASS_UNTRACKED_TCP: u32 = 16;
    /// A TCP or UDP packet whose port has no bit in `NP_PORTS` (no frontend,
    /// backend or tracked flow uses it): passed untouched before any hash
    /// lookup.
    pub const PASS_NOT_OURS: u32 = 17;
    /// A frontend generation announced a Maglev table that is not linked
    /// in `NP_MAGLEV`: the new flow took the modulo slot pick instead.
    pub const MAGLEV_MISS: u32 = 18;
    /// A new flow whose frontend's service id has no `NP_SVC_CONN` slot
    /// (see `counter::TOPO_UNCOUNTED`): translated, not counted by tier.
    pub const TOPO_UNCOUNTED: u32 = 19;
    // Counters of the XDP program (xdp.rs), from the top of the array.
    /// A packet of a flow to a remote backend was translated and forwarded
    /// by XDP (`XDP_TX`/`XDP_REDIRECT`), before any skb existed.
    pub const XDP_FORWARDED: u32 = 21;
    /// XDP translated nothing because the route to the backend was not
    /// usable from XDP (`bpf_fib_lookup` did not return success, e.g. the
    /// neighbour is unresolved), or the TTL/hop limit was 1 or less (the
    /// stack sends the time exceeded error): passed unchanged to the TC
    /// program.
    pub const XDP_PASS_NO_ROUTE: u32 = 22;
    /// A packet of a NodePort/LoadBalancer flow that XDP leaves to the TC
    /// program (local backend, TCP FIN/RST, IP options, a stale backend):
    /// passed unchanged.
    pub const XDP_PASS_TO_TC: u32 = 23;
    /// Room for counters to come: the pinned map keeps its size across
    /// upgrades (`reservedN` entries are not exported).
    pub const COUNT: u32 = 24;

    /// Names for display and metrics, indexed by counter id.
    pub const NAMES: [&str; COUNT as usize] = [
        "new_flow",
        "tracked",
        "stale_backend",
        "rejected_no_backend",
        "dropped_no_local",
        "pass_unparsed",
        "pass_fragment",
        "snat_failed",
        "ct_update_failed",
        "slot_miss",
        "rewrite_failed",
        "icmp_translated",
        "dropped_source_range",
        "affinity_hit",
        "affinity_stale",
        "affinity_update_failed",
        "pass_untracked_tcp",
        "pass_not_ours",
        "maglev_miss",
        "topo_uncounted",
        "reserved20",
        "xdp_forwarded",
        "xdp_pass_no_route",
        "xdp_pass_to_tc",
    ];
}

// NP_FAST_COUNTERS: BPF_MAP_TYPE_PERCPU_ARRAY, np_fast_counter::* -> u64.
// Written by the TC programs' fast path; read by the agent.
/// Per-CPU array of `np_fast_counter::COUNT` u64: what the TC fast path
/// forwarded, and why it left a translated packet to the stack.
pub const NP_FAST_COUNTERS_MAP: &str = "NP_FAST_COUNTERS";

/// Indexes into `NP_FAST_COUNTERS`.
pub mod np_fast_counter {
    /// A client's packet, after DNAT and SNAT, redirected to the remote
    /// backend's next hop.
    pub const FORWARDED: u32 = 0;
    /// A remote backend's reply, translated back, redirected towards the
    /// client's next hop.
    pub const REPLY_FORWARDED: u32 = 1;
    /// To the stack: the backend is this node itself (a host-network
    /// endpoint: `bpf_fib_lookup` answers `BPF_FIB_LKUP_RET_NOT_FWDED` for
    /// a local route), which only the stack delivers.
    pub const STACK_LOCAL_BACKEND: u32 = 2;
    /// To the stack: the packet is longer than the route's MTU
    /// (`BPF_FIB_LKUP_RET_FRAG_NEEDED`): the stack fragments it or answers
    /// with fragmentation needed / packet too big.
    pub const STACK_MTU: u32 = 3;
    /// To the stack: `bpf_fib_lookup` gave no usable answer (no route, an
    /// unresolved neighbour, forwarding off on the input device, a device
    /// down); the stack resolves the neighbour, later packets go fast.
    pub const STACK_NO_ROUTE: u32 = 4;
    /// To the stack: TTL or hop limit 1 or less (the stack answers with
    /// time exceeded).
    pub const STACK_TTL: u32 = 5;
    /// To the stack: the flow's other leg (`CT_DIR_SNAT` or
    /// `CT_DIR_REPLY`) was missing, e.g. evicted.
    pub const STACK_NO_ENTRY: u32 = 6;
    /// To the stack: IPv4 with options or IPv6 with extension headers,
    /// which a router must process (`ip_forward_options`, hop-by-hop
    /// options in `ip6_forward`).
    pub const STACK_IP_OPTIONS: u32 = 7;
    /// A client's packet to a backend on this node, DNAT'ed, delivered
    /// with `bpf_redirect_peer` into the backend's namespace (the route's
    /// device is a veth in `NP_PEER_DEVS`).
    pub const LOCAL_FORWARDED: u32 = 8;
    /// To the stack: the backend is on this node, but the route to it
    /// leaves through a device not in `NP_PEER_DEVS` (a bridge, a veth
    /// whose peer is in this namespace, a device the agent has not listed
    /// yet), where `bpf_redirect_peer` would drop the packet.
    pub const STACK_LOCAL_NOT_PEER: u32 = 9;
    /// The size of the array.
    pub const COUNT: u32 = 10;
    /// Names for display and metrics, indexed by counter id.
    pub const NAMES: [&str; COUNT as usize] = [
        "tc_fast_forwarded",
        "tc_fast_reply_forwarded",
        "tc_stack_local_backend",
        "tc_stack_mtu",
        "tc_stack_no_route",
        "tc_stack_ttl",
        "tc_stack_no_entry",
        "tc_stack_ip_options",
        "tc_fast_local_forwarded",
        "tc_stack_local_not_peer",
    ];
}

#[cfg(test)]
mod tests {
    extern crate std;
    use crate::*;

    #[test]
    fn counter_names_fill_their_arrays() {
        assert_eq!(counter::NAMES[counter::REFUSED_SOURCE_RANGE as usize], "refused_source_range");
        assert_eq!(counter::NAMES[counter::AFFINITY_UPDATE_FAILED as usize], "affinity_update_failed");
        assert_eq!(np_counter::NAMES[np_counter::DROPPED_SOURCE_RANGE as usize], "dropped_source_range");
        assert_eq!(np_counter::NAMES[np_counter::AFFINITY_UPDATE_FAILED as usize], "affinity_update_failed");
        assert_eq!(np_counter::NAMES[np_counter::PASS_NOT_OURS as usize], "pass_not_ours");
    }
}
