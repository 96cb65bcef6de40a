//! Map keys and values shared by the eBPF programs and the agent.
//!
//! Every type here is `#[repr(C)]` with explicit padding so that the kernel
//! and userspace agree on the byte layout without relying on compiler
//! choices. There is no `bool`, enum or `Option`: the kernel sees raw bytes,
//! and every bit pattern of these structs must be a valid value. Fields that
//! hold network-order data say so with a `_be` suffix.
//!
//! The datapath's view of a Service is split over three hash maps, in the
//! style of Cilium's `lb4_services`/`lb4_backends` and Katran's reals:
//!
//! * [`SERVICES_MAP`]: frontend (address, port, protocol) to
//!   [`ServiceValue`], which names the service id, the number of backend
//!   slots and the *generation* those slots belong to.
//! * [`SLOTS_MAP`]: (service id, generation, slot index) to a backend id.
//! * [`BACKENDS_MAP`]: backend id to backend address and port.
//!
//! The agent writes a new backend set under a fresh generation and only then
//! replaces the service entry. A BPF hash map update replaces the element as
//! a whole (the kernel links a new element in and unlinks the old one under
//! RCU, `kernel/bpf/hashtab.c:htab_map_update_elem`), so a reader sees either
//! the old (count, generation) pair or the new one, never a mix.

#![no_std]

/// `AF_INET` as the kernel reports it in `bpf_sock_addr.user_family`.
pub const FAMILY_V4: u8 = 2;
/// `AF_INET6` as the kernel reports it in `bpf_sock_addr.user_family`.
pub const FAMILY_V6: u8 = 10;

/// `IPPROTO_TCP`.
pub const PROTO_TCP: u8 = 6;
/// `IPPROTO_UDP`.
pub const PROTO_UDP: u8 = 17;

/// Map names as they appear in the object file and under the pin directory.
pub const SERVICES_MAP: &str = "SERVICES";
pub const SLOTS_MAP: &str = "SLOTS";
pub const BACKENDS_MAP: &str = "BACKENDS";
pub const SOCK_REVNAT_MAP: &str = "SOCK_REVNAT";
pub const COUNTERS_MAP: &str = "COUNTERS";
pub const SOCK_PEER_MAP: &str = "SOCK_PEER";
pub const SOCK_CONFIG_MAP: &str = "SOCK_CONFIG";
/// The connect hook's per-socket record, keyed by socket cookie (u64 ->
/// [`SockRecValue`]), a preallocated hash.
pub const SOCK_REC_MAP: &str = "SOCK_REC";
/// ClientIP session affinity of the socket programs ([`SockAffinityKey`]
/// -> [`AffinityValue`]), LRU.
pub const AFFINITY_MAP: &str = "AFFINITY";
/// The backends an affinity entry may still name ([`AffinityMatchKey`] ->
/// [`AffinityMatchValue`]).
pub const AFFINITY_MATCH_MAP: &str = "AFFINITY_MATCH";
/// `loadBalancerSourceRanges` per frontend ([`SourceRangeKey`] -> u32), LPM
/// trie.
pub const SOURCE_RANGES_MAP: &str = "SOURCE_RANGES";
/// One-element array holding [`NodeNetns`].
pub const NODE_NETNS_MAP: &str = "NODE_NETNS";

/// Default capacities; the agent can override each at load time.
pub const DEFAULT_MAX_SERVICES: u32 = 65_536;
pub const DEFAULT_MAX_SLOTS: u32 = 1_048_576;
pub const DEFAULT_MAX_BACKENDS: u32 = 262_144;
pub const DEFAULT_MAX_SOCK_REVNAT: u32 = 262_144;
/// Clients remembered per datapath for ClusterIP session affinity (one
/// entry per client and affine frontend; the least recently used go first).
pub const DEFAULT_MAX_AFFINITY: u32 = 65_536;

/// A frontend: what a client dials. IPv4 addresses live in `ip_be[0]`, the
/// other three words are zero, so the key stays the same size for both
/// families and the family byte keeps them apart.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceKey {
    pub ip_be: [u32; 4],
    pub port_be: u16,
    /// `PROTO_TCP` or `PROTO_UDP`: the same port over TCP and UDP are
    /// different Services in Kubernetes, so the protocol is part of the key.
    pub proto: u8,
    /// `FAMILY_V4` or `FAMILY_V6`.
    pub family: u8,
}

/// What a frontend resolves to.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServiceValue {
    /// Stable id of this frontend; slots are keyed by it.
    pub service_id: u32,
    /// Number of slots `0..backend_count` written under `generation`. Zero
    /// means the Service exists but has no usable backend: connect() is
    /// refused.
    pub backend_count: u32,
    /// Generation of the slot set this entry points at.
    pub generation: u32,
    /// `SVC_FLAG_*` bits (the low [`SVC_AFFINITY_SCOPE_SHIFT`] bits): what
    /// the frontend needs besides its backends. An agent version without
    /// them wrote zero, which the programs read as "neither". The bits
    /// above hold the session-affinity scope (see
    /// [`ServiceValue::affinity_scope`]).
    pub flags: u32,
}

/// `ServiceValue.flags`: `sessionAffinity: ClientIP`. A client's choice is
/// kept in `AFFINITY`/`NP_AFFINITY` and honoured while `AFFINITY_MATCH`/
/// `NP_AFFINITY_MATCH` lists its backend under the frontend's current
/// generation (which also carries the timeout).
pub const SVC_FLAG_AFFINITY: u32 = 1;
/// `ServiceValue.flags`: `loadBalancerSourceRanges` apply: only clients
/// whose address matches an entry of `SOURCE_RANGES`/`NP_SOURCE_RANGES`
/// under the frontend's (service id, generation) get through. No entry at
/// all means no client does (the filter fails closed).
pub const SVC_FLAG_SOURCE_RANGES: u32 = 2;
/// `ServiceValue.flags`, socket programs only: with `SVC_FLAG_SOURCE_RANGES`,
/// the node's own processes (its network namespace, `NODE_NETNS`) may
/// connect although their socket has no source address yet: one of the
/// node's addresses lies inside a range (kube-proxy lets the node through
/// in that case too).
pub const SVC_FLAG_SOURCE_RANGES_NODE: u32 = 4;

/// `ServiceValue.flags` bits 5..8: the tier every connection to this
/// frontend counts in, plus one, when the Service's topology chose its
/// backends by one domain (a topology key, OpenYurt's node pool, hints,
/// trafficDistribution); 0: each backend's own [`BackendValue::tier`]
/// (no topology, or a fall-through to anywhere). See
/// [`ServiceValue::counted_tier`].
pub const SVC_TIER_SHIFT: u32 = 5;
/// The mask of those three bits.
pub const SVC_TIER_MASK: u32 = 7 << SVC_TIER_SHIFT;

/// `ServiceValue.flags` above this many bits: the affinity scope id, 24
/// bits, 0 for none.
pub const SVC_AFFINITY_SCOPE_SHIFT: u32 = 8;
/// The largest affinity scope id `ServiceValue.flags` can carry.
pub const SVC_AFFINITY_SCOPE_MAX: u32 = u32::MAX >> SVC_AFFINITY_SCOPE_SHIFT;

impl ServiceValue {
    /// The key under which clients' affinity choices for this frontend are
    /// kept. kube-proxy keeps ClientIP affinity per Service port (its
    /// `recent` lists hang off the port's endpoint chains, shared by the
    /// ClusterIP, NodePort and LoadBalancer rules), so all frontends of one
    /// Service port and family carry the same scope id. A value written by
    /// an agent without scopes (0) keeps its choices per frontend, under
    /// the service id.
    #[inline(always)]
    pub fn affinity_scope(&self) -> u32 {
        match self.flags >> SVC_AFFINITY_SCOPE_SHIFT {
            0 => self.service_id,
            scope => scope,
        }
    }

    /// The [`tier`] a connection to this frontend through a backend of
    /// tier `backend_tier` counts in: the frontend's own tier when its
    /// flags carry one, else the backend's. Always below [`tier::COUNT`]
    /// (an unknown code counts as [`tier::OTHER`]), so it indexes
    /// [`SvcConnValue::tiers`] without a further check.
    #[inline(always)]
    pub fn counted_tier(&self, backend_tier: u8) -> usize {
        let t = match (self.flags & SVC_TIER_MASK) >> SVC_TIER_SHIFT {
            0 => u32::from(backend_tier),
            t => t - 1,
        };
        if t < tier::COUNT as u32 { t as usize } else { tier::OTHER as usize }
    }

    /// The slot of this service's current generation that `hash` selects.
    /// `backend_count` must be non-zero (see [`select_slot`]).
    #[inline(always)]
    pub fn slot_for(&self, hash: u32) -> SlotKey {
        SlotKey { service_id: self.service_id, generation: self.generation, slot: select_slot(hash, self.backend_count) }
    }
}

/// One slot of a service's backend set.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SlotKey {
    pub service_id: u32,
    pub generation: u32,
    pub slot: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SlotValue {
    pub backend_id: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BackendKey {
    pub backend_id: u32,
}

/// A backend address. Same address layout as [`ServiceKey`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BackendValue {
    pub ip_be: [u32; 4],
    pub port_be: u16,
    pub family: u8,
    /// Where the backend runs relative to this node (a [`tier`] code), for
    /// the per-Service connection counts. It was padding (0, [`tier::OTHER`])
    /// in builds before the counts; the agent rewrites it when it adopts
    /// such a map. Read in the same lookup as the address, so counting adds
    /// no lookup to the hit path.
    pub tier: u8,
}

/// Reverse translation for one socket: which frontend a socket meant when
/// the kernel now reports the backend as its peer (getpeername, recvmsg).
/// Keyed by the socket cookie (`bpf_get_socket_cookie`) so that two sockets
/// talking to the same backend through different frontends stay apart.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockRevNatKey {
    pub cookie: u64,
    pub ip_be: [u32; 4],
    pub port_be: u16,
    pub family: u8,
    /// Two fields, see [`NpAffinityKey::_pad0`]: `connect4` builds this key
    /// on every translated connect.
    pub _pad0: u8,
    pub _pad1: u32,
}

impl SockRevNatKey {
    #[inline(always)]
    pub fn new(cookie: u64, ip_be: [u32; 4], port_be: u16, family: u8) -> Self {
        Self { cookie, ip_be, port_be, family, _pad0: 0, _pad1: 0 }
    }
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockRevNatValue {
    pub ip_be: [u32; 4],
    pub port_be: u16,
    pub family: u8,
    pub _pad: u8,
}

/// Socket-local storage (`SOCK_PEER`, `BPF_MAP_TYPE_SK_STORAGE`) of a
/// translated socket, TCP or UDP: the first translation it went through.
/// The kernel keeps it on the socket itself (`sk->sk_bpf_storage`) and
/// frees it with the socket, so nothing needs to age out, and recvmsg() on
/// a UDP socket the datapath never translated (most UDP traffic in a pod)
/// answers "not ours" without a table lookup. A socket that later reaches
/// a different frontend or backend (unconnected UDP talking to several
/// Services, a retried TCP connect()) writes those further translations to
/// `SOCK_REVNAT` and sets `spilled`, so the reverse path and the socket
/// termination know to look there too. The agent reads a TCP socket's
/// value through sock_diag (`INET_DIAG_REQ_SK_BPF_STORAGES`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockPeerValue {
    pub backend_ip_be: [u32; 4],
    pub frontend_ip_be: [u32; 4],
    pub backend_port_be: u16,
    pub frontend_port_be: u16,
    /// 0 while unset (a fresh storage element is zeroed by the kernel).
    pub family: u8,
    /// 1 when `SOCK_REVNAT` also holds entries for this socket.
    pub spilled: u8,
    pub _pad: [u8; 2],
}

/// `SOCK_REC` value: what one translated connect() did, keyed by the
/// socket's cookie (`bpf_get_socket_cookie`, unique for the kernel's
/// lifetime, so a key is never reused by another socket). The connect
/// hooks write it (overwriting on a reconnect), getpeername/recvmsg read it
/// and translate only while the socket's peer is still `backend`, the
/// `cgroup/sock_release` program deletes it when the socket is freed, and
/// the agent reads it by cookie to prove a socket ours before it
/// terminates it. A preallocated hash rather than socket storage: its
/// insert takes an element from a per-CPU free list and a bucket lock, no
/// allocation (measured by `cargo xtask bench --only connect4`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockRecValue {
    pub backend_ip_be: [u32; 4],
    pub frontend_ip_be: [u32; 4],
    /// The frontend's `ServiceValue::service_id` at connect() time.
    pub service_id: u32,
    pub backend_port_be: u16,
    pub frontend_port_be: u16,
    /// `FAMILY_V4` or `FAMILY_V6`, of backend and frontend alike (a mapped
    /// IPv4 destination is recorded in IPv4 form).
    pub family: u8,
    /// `PROTO_TCP` or `PROTO_UDP`.
    pub proto: u8,
    pub _pad: [u8; 2],
}

/// The single element of `SOCK_CONFIG` (an array the agent writes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockConfig {
    /// Sockets translated by an agent version without `SOCK_PEER` have
    /// their reverse entry only in `SOCK_REVNAT`. The agent that first
    /// adopts such a datapath records here one above the largest cookie
    /// with a `SOCK_REVNAT` entry (cookies are not ordered across CPUs, so
    /// the next cookie the kernel hands out is no bound);
    /// a socket without `SOCK_PEER` storage and a cookie below this value
    /// may be such a socket, so the reverse path consults `SOCK_REVNAT` for
    /// it. 0: no such sockets.
    pub legacy_revnat_cookie_below: u64,
}

/// `AFFINITY` key: the client, as the socket programs see it, and the
/// Service port. At connect() a socket has no source address yet (the kernel
/// picks it after the hook, `ip_route_connect`), so the client is its
/// network namespace: one pod is one namespace (`bpf_get_netns_cookie`),
/// and every process of the node's own namespace is one client, as all of
/// them reach a Service from the node's address.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SockAffinityKey {
    pub netns_cookie: u64,
    /// [`ServiceValue::affinity_scope`]: the Service port, not the frontend.
    pub scope_id: u32,
    pub _pad: u32,
}

/// The single element of `NODE_NETNS`, which the agent writes when it
/// installs the datapath.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeNetns {
    /// The cookie (`SO_NETNS_COOKIE`, `bpf_get_netns_cookie`) of the node's
    /// own network namespace: the agent's, which runs with the host's
    /// network. Sockets there are the node's processes, whose source
    /// address is one of the node's. 0 until written: no socket is then
    /// taken for the node's.
    pub netns_cookie: u64,
}

/// `NP_AFFINITY` key: the client's source address as the TC programs see
/// it (kube-proxy's ClientIP), and the Service port.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NpAffinityKey {
    pub client_be: [u32; 4],
    /// [`ServiceValue::affinity_scope`]: the Service port, not the frontend.
    pub scope_id: u32,
    pub family: u8,
    /// Two fields rather than `[u8; 3]`: a zeroed byte array becomes a
    /// `memset` call in the eBPF object (bpf-linker expands only `memcpy`
    /// inline), and each such call is a BPF subprogram frame that the
    /// verifier charges at least 32 bytes for against the 512-byte stack of
    /// the deepest call chain (kernel/bpf/verifier.c,
    /// `check_max_stack_depth`). Build keys with `new`.
    pub _pad0: u8,
    pub _pad1: u16,
}

impl NpAffinityKey {
    #[inline(always)]
    pub fn new(client_be: [u32; 4], scope_id: u32, family: u8) -> Self {
        Self { client_be, scope_id, family, _pad0: 0, _pad1: 0 }
    }
}

/// A client's backend for one Service port, and when a connection (or a UDP
/// flow) last used it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AffinityValue {
    /// `bpf_ktime_get_coarse_ns` (CLOCK_MONOTONIC) of the last use,
    /// refreshed at most every [`AFFINITY_REFRESH_NS`].
    pub last_used_ns: u64,
    pub backend_id: u32,
    pub _pad: u32,
}

/// `AFFINITY_MATCH` / `NP_AFFINITY_MATCH` key: backend `backend_id` is in
/// the slot set of generation `generation` of frontend `service_id` (the
/// same fields as [`SlotKey`], with the backend in place of the slot). The
/// agent writes these for every backend of an affine frontend's new
/// generation before switching the frontend to it, and deletes the old
/// generation's afterwards, so the set a program sees is always the one of
/// the generation it read: an affinity entry is honoured only while its
/// backend is one the frontend currently sends to (a removed, no longer
/// serving or no longer topology-eligible backend drops out at once).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AffinityMatchKey {
    pub service_id: u32,
    pub generation: u32,
    pub backend_id: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AffinityMatchValue {
    /// `sessionAffinityConfig.clientIP.timeoutSeconds`: an entry unused
    /// for longer is ignored (and replaced by the next choice).
    pub timeout_s: u32,
}

/// The programs rewrite an affinity entry's `last_used_ns` only when it is
/// at least this old, not on every connect() or datagram: a store takes the
/// entry's cache line exclusive (see `touch` in `proxy-ebpf/src/nodeport.rs`
/// for the same reasoning). Timeouts are whole seconds (at least 1), so an
/// entry may expire up to this much early.
pub const AFFINITY_REFRESH_NS: u64 = 100_000_000;

/// Whether an affinity entry last used at `last_used_ns` has expired at
/// `now_ns` under a timeout of `timeout_s` seconds (kube-proxy: the entry
/// lives `timeoutSeconds` after its last use). A clock that went backwards
/// (never for CLOCK_MONOTONIC) counts as fresh.
#[inline(always)]
pub fn affinity_expired(now_ns: u64, last_used_ns: u64, timeout_s: u32) -> bool {
    now_ns.saturating_sub(last_used_ns) > u64::from(timeout_s) * 1_000_000_000
}

/// The address part of a `SOURCE_RANGES` / `NP_SOURCE_RANGES` key (an LPM
/// trie key is this behind a `u32` prefix length in bits). The frontend's
/// service id and generation, and the family, always match in full
/// ([`SOURCE_RANGE_FIXED_BITS`]); the address matches the range's prefix.
/// The generation ties a frontend's ranges to its slot set, so a change of
/// ranges switches in the same hash map update as the backends (the agent
/// writes the new generation's ranges first and deletes the old ones after
/// the switch). Addresses in network byte order: the trie compares bytes
/// from the first, most significant, one.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SourceRangeKey {
    pub service_id: u32,
    pub generation: u32,
    pub family: u8,
    /// Two fields, see [`NpAffinityKey::_pad0`].
    pub _pad0: u8,
    pub _pad1: u16,
    pub addr_be: [u32; 4],
}

impl SourceRangeKey {
    #[inline(always)]
    pub fn new(service_id: u32, generation: u32, family: u8, addr_be: [u32; 4]) -> Self {
        Self { service_id, generation, family, _pad0: 0, _pad1: 0, addr_be }
    }
}

/// Bits of a [`SourceRangeKey`] before the address: service id,
/// generation, family and padding. A range `a.b.c.d/n` is stored with
/// prefix length `SOURCE_RANGE_FIXED_BITS + n`; a lookup passes
/// `SOURCE_RANGE_FIXED_BITS + 128`.
pub const SOURCE_RANGE_FIXED_BITS: u32 = 96;

/// Topology tiers: where a connection's backend runs relative to the node
/// that sent it, or the domain the Service's topology chose it by (issue
/// #34: how much of a Service's traffic stayed near). The order of the
/// checks is node, zone, region, pool; the first shared domain wins.
pub mod tier {
    /// None of the domains below is shared, or it is not known.
    pub const OTHER: u8 = 0;
    /// The same node.
    pub const NODE: u8 = 1;
    /// The same zone (`topology.kubernetes.io/zone`).
    pub const ZONE: u8 = 2;
    /// The same region (`topology.kubernetes.io/region`).
    pub const REGION: u8 = 3;
    /// The same OpenYurt node pool (`apps.openyurt.io/nodepool`).
    pub const POOL: u8 = 4;
    pub const COUNT: usize = 5;
    /// Names for display and metric labels, indexed by code.
    pub const NAMES: [&str; COUNT] = ["other", "node", "zone", "region", "pool"];
}

/// Per-CPU array of [`SvcConnValue`], indexed by [`svc_conn_index`] of a
/// socket-datapath service id: new connections (connect) and new
/// unconnected-UDP flows (sendmsg) per frontend and tier.
pub const SVC_CONN_MAP: &str = "SVC_CONN";
/// Array of [`SvcTopoValue`], indexed as `SVC_CONN`: what the agent tells
/// the socket programs to add per counted connection.
pub const SVC_TOPO_MAP: &str = "SVC_TOPO";
/// The TC datapath's `SVC_CONN` (new NodePort/LoadBalancer/externalIP flows,
/// TC and XDP), indexed by its own service ids.
pub const NP_SVC_CONN_MAP: &str = "NP_SVC_CONN";
/// The TC datapath's `SVC_TOPO`.
pub const NP_SVC_TOPO_MAP: &str = "NP_SVC_TOPO";

/// Fixed-point one for [`SvcTopoValue::blind_remote_share_fp`] and
/// [`SvcConnValue::blind_remote_fp`]: a share of 1/3 is 21,845.
pub const SHARE_ONE: u32 = 1 << 16;

/// The `SVC_CONN`/`SVC_TOPO` index of a service id. The agent hands out
/// service ids from 1 to the services capacity, so index
/// `0..capacity` covers them; an older build's larger ids (and 0) fall
/// outside the arrays and are not counted (`counter::TOPO_UNCOUNTED`).
#[inline(always)]
pub fn svc_conn_index(service_id: u32) -> u32 {
    service_id.wrapping_sub(1)
}

/// One frontend's counts on one CPU.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SvcConnValue {
    /// New connections or flows per [`tier`] code.
    pub tiers: [u64; tier::COUNT],
    /// The sum of [`SvcTopoValue::blind_remote_share_fp`] over the counted
    /// connections: divided by [`SHARE_ONE`], how many of them a pick
    /// blind to topology would be expected to have sent out of this node's
    /// zone.
    pub blind_remote_fp: u64,
}

/// What the agent writes per frontend for the counting.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SvcTopoValue {
    /// The share of the Service port's serving endpoints outside this
    /// node's zone, in [`SHARE_ONE`]ths.
    pub blind_remote_share_fp: u32,
}

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

/// The slot a connection lands on: `hash` spread over `count` slots.
/// `count` must be non-zero (the datapath refuses zero-backend services
/// before selecting).
#[inline(always)]
pub fn select_slot(hash: u32, count: u32) -> u32 {
    if count == 0 { 0 } else { hash % count }
}

/// Hash for sendmsg() on unconnected UDP sockets: every datagram of one
/// socket must reach the same backend, so the hash depends only on the
/// socket cookie (`bpf_get_socket_cookie`) and the service. Mixing in the
/// service id keeps one socket that talks to several Services from landing
/// on the same slot index everywhere. The finaliser is MurmurHash3's fmix32
/// so that consecutive cookies spread evenly.
#[inline(always)]
pub fn socket_hash(cookie: u64, service_id: u32) -> u32 {
    fmix32((cookie as u32) ^ ((cookie >> 32) as u32) ^ service_id.wrapping_mul(0x9e37_79b9))
}

/// MurmurHash3's 32-bit finaliser: every input bit affects every output bit,
/// so nearby inputs (sequential cookies, neighbouring ports) spread evenly.
#[inline(always)]
pub fn fmix32(mut h: u32) -> u32 {
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^= h >> 16;
    h
}

// Layout is part of the kernel ABI between object and agent: pin it down.
const _: () = {
    assert!(core::mem::size_of::<ServiceKey>() == 20);
    assert!(core::mem::size_of::<ServiceValue>() == 16);
    assert!(core::mem::size_of::<SlotKey>() == 12);
    assert!(core::mem::size_of::<SlotValue>() == 4);
    assert!(core::mem::size_of::<BackendKey>() == 4);
    assert!(core::mem::size_of::<BackendValue>() == 20);
    assert!(core::mem::size_of::<SockRevNatKey>() == 32);
    assert!(core::mem::size_of::<SockRevNatValue>() == 20);
    assert!(core::mem::size_of::<SockPeerValue>() == 40);
    assert!(core::mem::size_of::<SockConfig>() == 8);
    assert!(core::mem::size_of::<SockRecValue>() == 44);
    assert!(core::mem::size_of::<NodeNetns>() == 8);
    assert!(core::mem::size_of::<SockAffinityKey>() == 16);
    assert!(core::mem::size_of::<NpAffinityKey>() == 24);
    assert!(core::mem::size_of::<AffinityValue>() == 16);
    assert!(core::mem::size_of::<AffinityMatchKey>() == 12);
    assert!(core::mem::size_of::<AffinityMatchValue>() == 4);
    assert!(core::mem::size_of::<SourceRangeKey>() == 28);
    assert!(core::mem::size_of::<SvcConnValue>() == 48);
    assert!(core::mem::size_of::<SvcTopoValue>() == 4);
    assert!(SVC_TIER_MASK < (1 << SVC_AFFINITY_SCOPE_SHIFT));
    assert!(tier::COUNT < 8);
    assert!(SOURCE_RANGE_FIXED_BITS as usize == 8 * core::mem::offset_of!(SourceRangeKey, addr_be));
};

#[cfg(feature = "user")]
mod pod {
    //! `aya::Pod` lets aya copy these types to and from the byte buffers of
    //! the map syscalls. That is sound for a type whose bytes are all
    //! initialised (no implicit padding) and for which every bit pattern is a
    //! valid value. Each type below is `#[repr(C)]` and holds only integers
    //! and integer arrays (padding is spelled out as `_pad` fields), and the
    //! sizes of its fields add up to the size asserted above, so the compiler
    //! inserted no padding of its own.

    use super::{
        AffinityMatchKey, AffinityMatchValue, AffinityValue, BackendKey, BackendValue, NodeNetns, NpAffinityKey, ServiceKey, ServiceValue,
        SlotKey, SlotValue, SockAffinityKey, SockConfig, SockPeerValue, SockRecValue, SockRevNatKey, SockRevNatValue, SourceRangeKey,
        SvcConnValue, SvcTopoValue,
    };

    // SAFETY: repr(C), six u64 = 48 bytes, no padding.
    unsafe impl aya::Pod for SvcConnValue {}
    // SAFETY: repr(C), one u32, no padding.
    unsafe impl aya::Pod for SvcTopoValue {}
    // SAFETY: repr(C) integers only; 16 + 16 + 4 + 2 + 2 + 1 + 1 + 2 (`_pad`) = 44 bytes, no padding.
    unsafe impl aya::Pod for SockRecValue {}
    // SAFETY: repr(C) integers only; 16 + 2 + 1 + 1 = 20 bytes, no padding.
    unsafe impl aya::Pod for ServiceKey {}
    // SAFETY: repr(C), four u32 = 16 bytes, no padding.
    unsafe impl aya::Pod for ServiceValue {}
    // SAFETY: repr(C), three u32 = 12 bytes, no padding.
    unsafe impl aya::Pod for SlotKey {}
    // SAFETY: repr(C), one u32, no padding.
    unsafe impl aya::Pod for SlotValue {}
    // SAFETY: repr(C), one u32, no padding.
    unsafe impl aya::Pod for BackendKey {}
    // SAFETY: repr(C) integers only; 16 + 2 + 1 + 1 (`tier`) = 20 bytes, no padding.
    unsafe impl aya::Pod for BackendValue {}
    // SAFETY: repr(C) integers only; 8 + 16 + 2 + 1 + 5 (`_pad`) = 32 bytes, no padding.
    unsafe impl aya::Pod for SockRevNatKey {}
    // SAFETY: repr(C) integers only; 16 + 2 + 1 + 1 (`_pad`) = 20 bytes, no padding.
    unsafe impl aya::Pod for SockRevNatValue {}
    // SAFETY: repr(C) integers only; 16 + 16 + 2 + 2 + 1 + 1 + 2 (`_pad`) = 40 bytes, no padding.
    unsafe impl aya::Pod for SockPeerValue {}
    // SAFETY: repr(C), one u64, no padding.
    unsafe impl aya::Pod for SockConfig {}
    // SAFETY: repr(C), one u64, no padding.
    unsafe impl aya::Pod for NodeNetns {}
    // SAFETY: repr(C) integers only; 8 + 4 + 4 (`_pad`) = 16 bytes, no padding.
    unsafe impl aya::Pod for SockAffinityKey {}
    // SAFETY: repr(C) integers only; 16 + 4 + 1 + 3 (`_pad`) = 24 bytes, no padding.
    unsafe impl aya::Pod for NpAffinityKey {}
    // SAFETY: repr(C) integers only; 8 + 4 + 4 (`_pad`) = 16 bytes, no padding.
    unsafe impl aya::Pod for AffinityValue {}
    // SAFETY: repr(C), three u32 = 12 bytes, no padding.
    unsafe impl aya::Pod for AffinityMatchKey {}
    // SAFETY: repr(C), one u32, no padding.
    unsafe impl aya::Pod for AffinityMatchValue {}
    // SAFETY: repr(C) integers only; 4 + 4 + 1 + 3 (`_pad`) + 16 = 28 bytes, no padding.
    unsafe impl aya::Pod for SourceRangeKey {}
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;

    #[test]
    fn the_counted_tier_is_the_frontends_when_set_else_the_backends() {
        let v = |t: u32| ServiceValue {
            flags: (t << SVC_TIER_SHIFT) | SVC_FLAG_AFFINITY | (9 << SVC_AFFINITY_SCOPE_SHIFT),
            ..Default::default()
        };
        // (frontend's field, backend's tier, counted)
        let cases = [
            (0, tier::NODE, tier::NODE),
            (0, tier::POOL, tier::POOL),
            (0, 200, tier::OTHER), // an unknown code
            (1 + u32::from(tier::ZONE), tier::NODE, tier::ZONE),
            (1 + u32::from(tier::POOL), tier::OTHER, tier::POOL),
            (7, tier::NODE, tier::OTHER), // 6 is past the last tier
        ];
        for (field, backend, want) in cases {
            assert_eq!(v(field).counted_tier(backend), usize::from(want), "{field} {backend}");
            assert_eq!(v(field).affinity_scope(), 9, "the tier bits leave the scope alone");
        }
        assert_eq!(svc_conn_index(1), 0);
        assert_eq!(svc_conn_index(0), u32::MAX, "id 0 is never counted");
    }

    #[test]
    fn slots_stay_in_range() {
        for count in [1u32, 2, 3, 7, 1000] {
            for hash in [0u32, 1, 2, 12345, u32::MAX - 1, u32::MAX] {
                assert!(select_slot(hash, count) < count);
            }
        }
        assert_eq!(select_slot(5, 0), 0, "zero count never divides by zero");
    }

    #[test]
    fn socket_hash_is_stable_and_spreads_consecutive_cookies() {
        assert_eq!(socket_hash(42, 7), socket_hash(42, 7));
        // Cookies are handed out sequentially by the kernel; they must not
        // all land on a few slots.
        let count = 3u32;
        let mut hits = [0u32; 3];
        for cookie in 1000u64..4000 {
            hits[select_slot(socket_hash(cookie, 1), count) as usize] += 1;
        }
        for h in hits {
            assert!((800..1200).contains(&h), "{hits:?}");
        }
        // Different services see the same socket differently.
        let differs = (0u64..100).filter(|c| select_slot(socket_hash(*c, 1), 8) != select_slot(socket_hash(*c, 2), 8)).count();
        assert!(differs > 50, "{differs}");
    }

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

    #[test]
    fn key_field_offsets() {
        use core::mem::offset_of;
        assert_eq!(offset_of!(ServiceKey, port_be), 16);
        assert_eq!(offset_of!(ServiceKey, proto), 18);
        assert_eq!(offset_of!(ServiceKey, family), 19);
        assert_eq!(offset_of!(SockRevNatKey, ip_be), 8);
        assert_eq!(offset_of!(SockRevNatKey, family), 26);
        assert_eq!(offset_of!(BackendValue, port_be), 16);
        assert_eq!(offset_of!(SourceRangeKey, addr_be), 12);
        assert_eq!(offset_of!(AffinityValue, backend_id), 8);
    }

    #[test]
    fn affinity_expires_after_its_timeout_without_use() {
        let s = 1_000_000_000u64;
        // (now, last used, timeout) -> expired
        let cases = [
            (10 * s, 10 * s, 1, false),
            (11 * s, 10 * s, 1, false),
            (11 * s + 1, 10 * s, 1, true),
            (10 * s + 10_800 * s, 10 * s, 10_800, false),
            (10 * s + 10_800 * s + 1, 10 * s, 10_800, true),
            // A clock that reads earlier than the entry: fresh, not 584 years old.
            (5 * s, 10 * s, 1, false),
            (u64::MAX, 0, 86_400, true),
        ];
        for (now, last, timeout, want) in cases {
            assert_eq!(affinity_expired(now, last, timeout), want, "{now} {last} {timeout}");
        }
        assert!(AFFINITY_REFRESH_NS < s, "refreshes finer than the shortest timeout");
    }

    #[test]
    fn counter_names_fill_their_arrays() {
        assert_eq!(counter::NAMES[counter::REFUSED_SOURCE_RANGE as usize], "refused_source_range");
        assert_eq!(counter::NAMES[counter::AFFINITY_UPDATE_FAILED as usize], "affinity_update_failed");
        assert_eq!(np_counter::NAMES[np_counter::DROPPED_SOURCE_RANGE as usize], "dropped_source_range");
        assert_eq!(np_counter::NAMES[np_counter::AFFINITY_UPDATE_FAILED as usize], "affinity_update_failed");
        assert_eq!(np_counter::NAMES[np_counter::PASS_NOT_OURS as usize], "pass_not_ours");
    }
}

// ---------------------------------------------------------------------------
// External traffic at TC: NodePort, LoadBalancer ingress IPs and externalIPs,
// translated per packet on the node's devices.
//
// The TC programs keep their own service/slot/backend maps (same layouts as
// the socket ones) because the same frontend can need a different backend
// set depending on where the client is: traffic from outside a node follows
// `externalTrafficPolicy` (Local: only this node's endpoints), while traffic
// from the node itself to the same address uses the cluster-wide set, as
// kube-proxy does for node-originated traffic.
// ---------------------------------------------------------------------------

pub const NP_SERVICES_MAP: &str = "NP_SERVICES";
pub const NP_SLOTS_MAP: &str = "NP_SLOTS";
pub const NP_BACKENDS_MAP: &str = "NP_BACKENDS";
/// Per-frontend policy flags ([`NpFlagsValue`]), keyed by [`ServiceKey`].
pub const NP_FLAGS_MAP: &str = "NP_FLAGS";
/// Addresses of endpoints that live on this node ([`AddrKey`] -> u32).
pub const NP_LOCAL_MAP: &str = "NP_LOCAL";
/// Connection tracking ([`CtKey`] -> [`CtValue`]), LRU.
pub const NP_CT_MAP: &str = "NP_CT";
/// One-element array holding [`NpConfig`].
pub const NP_CONFIG_MAP: &str = "NP_CONFIG";
pub const NP_COUNTERS_MAP: &str = "NP_COUNTERS";
/// The TC programs' session affinity ([`NpAffinityKey`] -> [`AffinityValue`]), LRU.
pub const NP_AFFINITY_MAP: &str = "NP_AFFINITY";
/// As [`AFFINITY_MATCH_MAP`], for `NP_SERVICES`' frontends.
pub const NP_AFFINITY_MATCH_MAP: &str = "NP_AFFINITY_MATCH";
/// As [`SOURCE_RANGES_MAP`], for `NP_SERVICES`' frontends.
pub const NP_SOURCE_RANGES_MAP: &str = "NP_SOURCE_RANGES";

pub const DEFAULT_MAX_NP_CT: u32 = 262_144;
pub const DEFAULT_MAX_NP_LOCAL: u32 = 65_536;

/// `NpFlagsValue.flags`: the frontend follows `externalTrafficPolicy:
/// Local`. With no local endpoint its packets are dropped (kube-proxy drops
/// them too) instead of rejected.
pub const NP_FLAG_POLICY_LOCAL: u32 = 1;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NpFlagsValue {
    pub flags: u32,
}

/// An address on its own (same layout rules as [`ServiceKey`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AddrKey {
    pub ip_be: [u32; 4],
    pub family: u8,
    /// Two fields, see [`NpAffinityKey::_pad0`].
    pub _pad0: u8,
    pub _pad1: u16,
}

impl AddrKey {
    #[inline(always)]
    pub fn new(ip_be: [u32; 4], family: u8) -> Self {
        Self { ip_be, family, _pad0: 0, _pad1: 0 }
    }
}

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
    pub saddr_be: [u32; 4],
    pub daddr_be: [u32; 4],
    pub sport_be: u16,
    pub dport_be: u16,
    pub proto: u8,
    pub family: u8,
    /// `CT_DIR_FORWARD` or `CT_DIR_REPLY`.
    pub dir: u8,
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
/// `proxy-ebpf/src/nodeport.rs`, `touch`). Timeouts are therefore exact to
/// this much.
pub const CT_REFRESH_S: u32 = 1;

/// How long a SNAT port stays reserved without replies, by state (seconds).
/// The values follow Cilium's conntrack defaults: established TCP 6 h,
/// closing TCP 10 s, unanswered TCP 60 s, everything else 60 s.
pub const CT_TIMEOUT_TCP_S: u32 = 21_600;
pub const CT_TIMEOUT_TCP_CLOSING_S: u32 = 10;
/// TCP that never saw a packet from the backend (Cilium's SYN timeout).
pub const CT_TIMEOUT_TCP_SYN_S: u32 = 60;
pub const CT_TIMEOUT_OTHER_S: u32 = 60;

/// What a tracked packet becomes: every matching packet gets exactly this
/// source and destination. Forward entries also carry the backend id so a
/// flow can check its backend still exists.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CtValue {
    pub saddr_be: [u32; 4],
    pub daddr_be: [u32; 4],
    pub sport_be: u16,
    pub dport_be: u16,
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

/// Node-wide settings written by the agent.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NpConfig {
    /// Source address for flows sent to another node's backend, so that the
    /// reply comes back through this node. Zero: such flows are passed
    /// untranslated (and counted).
    pub snat_v4_be: u32,
    pub _pad0: u32,
    pub snat_v6_be: [u32; 4],
    /// SNAT source ports are taken from `snat_port_min..=snat_port_max`
    /// (host order); the default range lies above Linux's ephemeral range
    /// (net.ipv4.ip_local_port_range 32768-60999) so that it never collides
    /// with the node's own connections.
    pub snat_port_min: u16,
    pub snat_port_max: u16,
    pub _pad1: u32,
}

pub const DEFAULT_SNAT_PORT_MIN: u16 = 61_000;
pub const DEFAULT_SNAT_PORT_MAX: u16 = 65_535;

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

/// Hash of a flow's 5-tuple (fmix32 finaliser, as [`socket_hash`]). Every
/// packet of a flow hashes alike, so a flow whose conntrack entry was lost
/// lands on the same slot again while the backend set is unchanged.
#[inline(always)]
pub fn flow_hash(saddr: &[u32; 4], sport_be: u16, proto: u8) -> u32 {
    let h = saddr[0] ^ saddr[1].rotate_left(7) ^ saddr[2].rotate_left(13) ^ saddr[3].rotate_left(19);
    fmix32(h ^ ((u32::from(sport_be) << 16) | u32::from(proto)))
}

const _: () = {
    assert!(core::mem::size_of::<NpFlagsValue>() == 4);
    assert!(core::mem::size_of::<AddrKey>() == 20);
    assert!(core::mem::size_of::<CtKey>() == 40);
    assert!(core::mem::size_of::<CtValue>() == 48);
    assert!(core::mem::size_of::<NpConfig>() == 32);
};

#[cfg(feature = "user")]
mod np_pod {
    //! As for `pod`: repr(C), integer fields only, no implicit padding.

    use super::{AddrKey, CtKey, CtValue, NpConfig, NpFlagsValue};

    // SAFETY: repr(C), one u32, no padding.
    unsafe impl aya::Pod for NpFlagsValue {}
    // SAFETY: repr(C) integers only; 16 + 1 + 3 (`_pad`) = 20 bytes, no padding.
    unsafe impl aya::Pod for AddrKey {}
    // SAFETY: repr(C) integers only; 16 + 16 + 2 + 2 + 1 + 1 + 1 + 1 (`_pad`) = 40 bytes, no padding.
    unsafe impl aya::Pod for CtKey {}
    // SAFETY: repr(C) integers only; 16 + 16 + 2 + 2 + 4 + 4 + 4 = 48 bytes, no padding.
    unsafe impl aya::Pod for CtValue {}
    // SAFETY: repr(C) integers only; 4 + 4 (`_pad0`) + 16 + 2 + 2 + 4 (`_pad1`) = 32 bytes, no padding.
    unsafe impl aya::Pod for NpConfig {}
}

// ---------------------------------------------------------------------------
// Socket termination: the BPF socket iterators (`iter/tcp`, `iter/udp`)
// that abort the sockets translated to a backend that left its frontend.
// ---------------------------------------------------------------------------

/// The frontend-backend pairs whose sockets the iterators abort, written by
/// the agent for one walk of the node's namespaces and emptied after it.
/// Not pinned: it holds nothing between walks.
pub const SOCK_TERMINATE_MAP: &str = "SOCK_TERMINATE";
/// Pairs per walk; a batch with more is split into several walks.
pub const MAX_SOCK_TERMINATE: u32 = 4_096;

/// One pair: a socket of protocol `proto` whose `SOCK_REVNAT` entry says it
/// was translated from the frontend to the backend, and whose peer is that
/// backend now, is aborted. IPv4 in the first word, as in [`ServiceKey`];
/// an IPv4 peer of an IPv6 socket (`::ffff:a.b.c.d`) is matched in IPv4
/// form, as the connect hook remembers it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SockTerminateKey {
    pub frontend_ip_be: [u32; 4],
    pub backend_ip_be: [u32; 4],
    pub frontend_port_be: u16,
    pub backend_port_be: u16,
    pub family: u8,
    pub proto: u8,
    pub _pad: [u8; 2],
}

/// What the iterators did for one pair (the agent reads it back for its
/// metrics and logs; the programs never log per socket).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockTerminateValue {
    /// Sockets aborted.
    pub terminated: u64,
    /// `bpf_sock_destroy` refused (the socket is left as it is).
    pub failed: u64,
}

/// Offsets in `struct sock_common` (include/net/sock.h) of what the
/// iterators read: the peer address and port, the family and the state.
/// The layout has been the same since Linux 3.13 on 64-bit kernels built
/// with network namespaces; the agent checks these against the running
/// kernel's BTF before it loads the iterators, and uses netlink otherwise.
pub const SKC_DADDR_OFF: usize = 0;
pub const SKC_DPORT_OFF: usize = 12;
pub const SKC_FAMILY_OFF: usize = 16;
pub const SKC_STATE_OFF: usize = 18;
pub const SKC_V6_DADDR_OFF: usize = 56;

/// The `imm` of the iterators' `bpf_sock_destroy` call as compiled: aya
/// 0.14 has no kfunc relocation, so the program carries this placeholder
/// in a `BPF_PSEUDO_KFUNC_CALL` instruction and the agent writes the
/// kfunc's BTF id of the running kernel over it before loading (what
/// libbpf does for `__ksym` externs).
pub const SOCK_DESTROY_KFUNC_PLACEHOLDER: u32 = 0x7f5d_0d35;
/// That instruction as 8 little-endian bytes: `call` (0x85) with src_reg
/// `BPF_PSEUDO_KFUNC_CALL` (2), off 0 (vmlinux BTF), imm the placeholder.
pub const SOCK_DESTROY_KFUNC_INSN: u64 = 0x2085 | ((SOCK_DESTROY_KFUNC_PLACEHOLDER as u64) << 32);

const _: () = {
    assert!(core::mem::size_of::<SockTerminateKey>() == 40);
    assert!(core::mem::size_of::<SockTerminateValue>() == 16);
};

#[cfg(feature = "user")]
mod terminate_pod {
    //! As for `pod`: repr(C), integer fields only, no implicit padding.

    use super::{SockTerminateKey, SockTerminateValue};

    // SAFETY: repr(C) integers only; 16 + 16 + 2 + 2 + 1 + 1 + 2 (`_pad`) = 40 bytes, no padding.
    unsafe impl aya::Pod for SockTerminateKey {}
    // SAFETY: repr(C), two u64, no padding.
    unsafe impl aya::Pod for SockTerminateValue {}
}

// ---------------------------------------------------------------------------
// Maglev consistent hashing (Eisenbud et al., NSDI 2016) for the TC
// datapath: a frontend's new flows pick their backend from a lookup table of
// a prime size M instead of `hash % backend_count`, so a backend that comes
// or goes moves only about its own share of flows, and every node with the
// same backend set picks the same backend for a flow.
// ---------------------------------------------------------------------------

/// Hash of maps, [`MaglevKey`] -> an array of M `u32` backend ids (the
/// frontend's table). Tables exist only for frontends that have one, so a
/// frontend without (zero backends, socket datapath) costs nothing.
pub const NP_MAGLEV_MAP: &str = "NP_MAGLEV";
/// The socket datapath's tables, laid out as `NP_MAGLEV`: the per-socket
/// pick of unconnected UDP (sendmsg) takes its backend from the UDP
/// frontend's table, so a backend that leaves moves only its own sockets.
pub const SOCK_MAGLEV_MAP: &str = "SOCK_MAGLEV";
/// The default table size: a prime (every skip of a backend's permutation
/// is then coprime with M), 64 KiB of ids per table.
pub const MAGLEV_SIZE_DEFAULT: u32 = 16_381;
/// The large table size, for Services with hundreds of backends (the
/// shares stay within about 1 % of each other while M is above 100 times
/// the backend count).
pub const MAGLEV_SIZE_LARGE: u32 = 65_521;
/// Keys the outer map holds: one per frontend with backends (frontends
/// with the same backends link one array), plus the old generations of the
/// frontends being rewritten. The agent sizes it like `SERVICES`; neither
/// the outer map (not preallocated) nor the arrays cost anything before
/// they are used. A table that finds no room is not written: its frontend
/// takes the modulo pick.
pub const DEFAULT_MAX_MAGLEV: u32 = DEFAULT_MAX_SERVICES;

/// `ServiceValue.flags`: the frontend's generation has a Maglev table in
/// `NP_MAGLEV` under (service id, generation); new flows pick from it.
/// Without it (a datapath written by an agent without tables) they take the
/// modulo slot pick.
pub const SVC_FLAG_MAGLEV: u32 = 8;
/// `ServiceValue.flags`, with [`SVC_FLAG_MAGLEV`]: the table has
/// [`MAGLEV_SIZE_LARGE`] entries; without it, [`MAGLEV_SIZE_DEFAULT`].
pub const SVC_FLAG_MAGLEV_LARGE: u32 = 16;

/// `NP_MAGLEV` key: the table of one generation of one frontend, written
/// before the frontend's service entry switches to that generation and
/// removed after it switched away (as the slots are).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MaglevKey {
    pub service_id: u32,
    pub generation: u32,
}

impl ServiceValue {
    /// M of this frontend's Maglev table, or 0 when it has none.
    #[inline(always)]
    pub fn maglev_size(&self) -> u32 {
        if self.flags & SVC_FLAG_MAGLEV == 0 {
            0
        } else if self.flags & SVC_FLAG_MAGLEV_LARGE != 0 {
            MAGLEV_SIZE_LARGE
        } else {
            MAGLEV_SIZE_DEFAULT
        }
    }
}

/// The hash that picks a new flow's table entry. It leaves out the
/// destination address, which for a NodePort is the receiving node's own:
/// what is left (client address and port, frontend port, protocol) is the
/// same on every node a flow's packets may reach, so two nodes with the
/// same table pick the same backend. With session affinity only the
/// client's address counts (kube-proxy's ClientIP), so all of a client's
/// flows agree too.
#[inline(always)]
pub fn maglev_hash(saddr: &[u32; 4], sport_be: u16, dport_be: u16, proto: u8, client_only: bool) -> u32 {
    let a = saddr[0] ^ saddr[1].rotate_left(7) ^ saddr[2].rotate_left(13) ^ saddr[3].rotate_left(19);
    if client_only {
        return fmix32(a);
    }
    fmix32(fmix32(a) ^ ((u32::from(sport_be) << 16) | u32::from(dport_be)) ^ (u32::from(proto) << 8))
}

const _: () = {
    assert!(core::mem::size_of::<MaglevKey>() == 8);
    assert!(SVC_FLAG_MAGLEV_LARGE < (1 << SVC_AFFINITY_SCOPE_SHIFT));
};

#[cfg(feature = "user")]
mod maglev_pod {
    //! As for `pod`: repr(C), integer fields only, no implicit padding.

    use super::MaglevKey;

    // SAFETY: repr(C), two u32 = 8 bytes, no padding.
    unsafe impl aya::Pod for MaglevKey {}
}

// ---------------------------------------------------------------------------
// TC port bitmap: which ports the TC programs may have to translate, so that
// a packet that is not ours passes after an array lookup instead of the
// conntrack and frontend hash lookups.
// ---------------------------------------------------------------------------

/// Array of `u64` words, one bit per port: bit `port % 64` of word
/// `port / 64`, the port in host byte order, for ingress (destination
/// ports: frontends, and the frontends of tracked flows) in words
/// `0..NP_PORT_WORDS`, and for egress (source or destination ports:
/// backends of frontends and of tracked flows) in words
/// `NP_PORTS_EGRESS_BASE..`. A set bit only means "look further".
pub const NP_PORTS_MAP: &str = "NP_PORTS";
/// Words per direction: 65536 ports / 64 bits.
pub const NP_PORT_WORDS: u32 = 1024;
/// Index of the first egress word.
pub const NP_PORTS_EGRESS_BASE: u32 = NP_PORT_WORDS;
/// Entries of `NP_PORTS`: both directions, 16 KiB.
pub const NP_PORTS_ENTRIES: u32 = 2 * NP_PORT_WORDS;

/// The `NP_PORTS` word index and bit mask of a port in host byte order,
/// `egress` selecting the direction.
#[inline(always)]
pub fn np_port_bit(port: u16, egress: bool) -> (u32, u64) {
    let base = if egress { NP_PORTS_EGRESS_BASE } else { 0 };
    (base + u32::from(port >> 6), 1u64 << (port & 63))
}

// ---------------------------------------------------------------------------
// Socket port bitmap: which destination ports have a frontend in `SERVICES`,
// so that a connect() or sendmsg() that is not ours returns after an array
// lookup instead of a hash lookup that misses.
// ---------------------------------------------------------------------------

/// Array of `u64` words, one bit per destination port of a `SERVICES` key
/// (any frontend the socket programs translate): bit `port % 64` of word
/// `port / 64`, the port in host byte order. The layout of `NP_PORTS`'
/// ingress half. A set bit only means "look further".
pub const SOCK_PORTS_MAP: &str = "SOCK_PORTS";
/// Entries of `SOCK_PORTS`: 65536 ports / 64 bits, 8 KiB.
pub const SOCK_PORTS_ENTRIES: u32 = NP_PORT_WORDS;

/// The `SOCK_PORTS` word index and bit mask of a port in host byte order.
#[inline(always)]
pub fn sock_port_bit(port_host: u16) -> (u32, u64) {
    np_port_bit(port_host, false)
}

// ---------------------------------------------------------------------------
// XDP next-hop cache: the result of `bpf_fib_lookup` for a forwarded flow,
// kept for a second, so that the XDP program's steady state skips the route
// and neighbour lookup (the largest single cost of its per-packet path,
// measured by `cargo xtask bench --only xdp`).
// ---------------------------------------------------------------------------

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
    pub saddr_be: [u32; 4],
    pub daddr_be: [u32; 4],
    pub sport_be: u16,
    pub dport_be: u16,
    pub ingress_ifindex: u32,
    pub proto: u8,
    pub family: u8,
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
    pub ifindex: u32,
    pub checked_s: u32,
    pub dmac: [u8; 6],
    pub smac: [u8; 6],
    pub max_len_host: u16,
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

// ---------------------------------------------------------------------------
// TC fast path (`--tc-fast-path`): a translated NodePort/LoadBalancer/
// externalIP packet to or from a remote backend is sent to its next hop from
// TC ingress (`bpf_fib_lookup`, then `bpf_redirect`), without the stack's
// routing, netfilter and conntrack. Its next hops share `XDP_NEXTHOP` with
// the XDP program (same key: the packet as it leaves, and its input device).
// ---------------------------------------------------------------------------

/// Per-CPU array of `np_fast_counter::COUNT` u64: what the TC fast path
/// forwarded, and why it left a translated packet to the stack.
pub const NP_FAST_COUNTERS_MAP: &str = "NP_FAST_COUNTERS";
/// The `.rodata` global the TC programs read (u8, 1 = fast path on), set
/// by the loader for each load (`EbpfLoader::override_global`), so `off` is a
/// constant the verifier prunes.
pub const TC_FAST_PATH_GLOBAL: &str = "TC_FAST_PATH";

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
    pub const COUNT: u32 = 10;
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

#[cfg(feature = "user")]
mod nexthop_pod {
    //! As for `pod`: repr(C), integer fields only, no implicit padding.

    use super::{XdpNextHopKey, XdpNextHopValue};

    // SAFETY: repr(C) integers only; 16 + 16 + 2 + 2 + 4 + 1 + 1 + 2 (`_pad`) = 44 bytes, no padding.
    unsafe impl aya::Pod for XdpNextHopKey {}
    // SAFETY: repr(C) integers only; 4 + 4 + 6 + 6 + 2 + 2 (`_pad`) = 24 bytes, no padding.
    unsafe impl aya::Pod for XdpNextHopValue {}
}

#[cfg(test)]
mod nexthop_tests {
    use super::*;

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
