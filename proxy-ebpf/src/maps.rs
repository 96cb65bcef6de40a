//! The maps the socket programs share with the agent. Names and layouts come
//! from `proxy-common`; the agent pins every map under its bpffs directory and
//! may change `max_entries` at load time.
//!
//! These are BTF-defined maps (`.maps` section, libbpf style) rather than
//! legacy `maps` ones: the map definition names its key and value types, the
//! loader passes their BTF ids to `BPF_MAP_CREATE`, and so
//! `bpftool map dump pinned <bpffs>/SERVICES` prints every field by name
//! instead of raw bytes. aya 0.14 honours `map_pin_path` and
//! `map_max_entries` for them exactly as for legacy maps, and adopts maps
//! pinned by an older agent (which only compares type and sizes).

use aya_ebpf::{
    bindings::BPF_F_NO_PREALLOC,
    btf_maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuArray, SkStorage},
    macros::btf_map,
};
use proxy_common::{
    AffinityMatchKey, AffinityMatchValue, AffinityValue, BackendKey, BackendValue, DEFAULT_MAX_AFFINITY, DEFAULT_MAX_BACKENDS,
    DEFAULT_MAX_SERVICES, DEFAULT_MAX_SLOTS, DEFAULT_MAX_SOCK_REVNAT, NodeNetns, SOCK_PORTS_ENTRIES, SOCK_REC_COUNT_FLAGS,
    SOCK_REC_COUNT_SLOTS, ServiceKey, ServiceValue, SlotKey, SlotValue, SockAffinityKey, SockConfig, SockPeerValue, SockRecValue,
    SockRevNatKey, SockRevNatValue, SourceRangeKey, SvcConnValue, SvcTopoValue, counter, svc_conn_index,
};

// The capacity is part of the type (a const generic the BTF records as an
// array length); the agent overrides it at load time.
//
// SERVICES is not preallocated: the kernel allocates an element per entry
// written (kernel/bpf/hashtab.c:alloc_htab_elem) instead of max_entries
// elements at creation, so its memory follows the frontends programmed
// (plus a 16-byte bucket per entry of capacity). Only the agent writes it,
// and rarely: an insert costs about 1.5 us instead of 0.3 us (measured with
// BPF_MAP_UPDATE_BATCH on Linux 6.18). SLOTS and BACKENDS, written by the
// hundred thousand at a cold start, stay preallocated (inserts measured 4x
// slower without) and are sized to the cluster instead.
#[btf_map(name = "SERVICES")]
pub static SERVICES: HashMap<ServiceKey, ServiceValue, { DEFAULT_MAX_SERVICES as usize }, { BPF_F_NO_PREALLOC as usize }> = HashMap::new();

#[btf_map(name = "SLOTS")]
pub static SLOTS: HashMap<SlotKey, SlotValue, { DEFAULT_MAX_SLOTS as usize }> = HashMap::new();

#[btf_map(name = "BACKENDS")]
pub static BACKENDS: HashMap<BackendKey, BackendValue, { DEFAULT_MAX_BACKENDS as usize }> = HashMap::new();

/// LRU: entries of closed sockets are never deleted explicitly (there is no
/// close hook in the sock_addr family), so old ones must age out.
#[btf_map(name = "SOCK_REVNAT")]
pub static SOCK_REVNAT: LruHashMap<SockRevNatKey, SockRevNatValue, { DEFAULT_MAX_SOCK_REVNAT as usize }> = LruHashMap::new();

/// The record of every translated connect(), keyed by socket cookie (see
/// `SockRecValue`). Preallocated (the default for a hash): an insert pops
/// an element from a per-CPU free list and takes one bucket lock, with no
/// allocation (kernel/bpf/hashtab.c: alloc_htab_elem with prealloc), and a
/// reconnect overwrites in place through the per-CPU spare element. The
/// `sock_release` program deletes a socket's record when the socket is
/// freed, so the map holds only live sockets and never needs to evict;
/// when it is full anyway the insert fails (E2BIG) and the hook records in
/// `SOCK_PEER` instead. Sized like `SOCK_REVNAT` by the agent.
#[btf_map(name = "SOCK_REC")]
pub static SOCK_REC: HashMap<u64, SockRecValue, { DEFAULT_MAX_SOCK_REVNAT as usize }> = HashMap::new();

/// How many `SOCK_REC` records each slot of cookies holds (see
/// `SOCK_REC_COUNT_SLOTS`): the release and reverse hooks read a cookie's
/// slot before they look it up in `SOCK_REC`, and stop at a 0. A fixed
/// 512 KiB array; the verifier inlines its lookups as address arithmetic.
/// Mappable (`SOCK_REC_COUNT_FLAGS`), so that the agent takes back the
/// counts of the records it deletes with an atomic subtraction.
#[btf_map(name = "SOCK_REC_COUNT")]
pub static SOCK_REC_COUNT: Array<u64, { SOCK_REC_COUNT_SLOTS as usize }, { SOCK_REC_COUNT_FLAGS as usize }> = Array::new();

/// Per-socket storage of the first translation (see `SockPeerValue`).
#[btf_map(name = "SOCK_PEER")]
pub static SOCK_PEER: SkStorage<SockPeerValue> = SkStorage::new();

/// One element the agent writes (see `SockConfig`).
#[btf_map(name = "SOCK_CONFIG")]
pub static SOCK_CONFIG: Array<SockConfig, 1> = Array::new();

/// Session affinity: each client's backend per affine frontend. LRU:
/// clients come and go without telling anyone, so the entries of those that
/// left must age out; the agent deletes a frontend's entries when it drops
/// affinity or goes away.
#[btf_map(name = "AFFINITY")]
pub static AFFINITY: LruHashMap<SockAffinityKey, AffinityValue, { DEFAULT_MAX_AFFINITY as usize }> = LruHashMap::new();

/// The backends of each affine frontend's current generation (see
/// `AffinityMatchKey`). Not preallocated: it holds entries only for affine
/// frontends, while its capacity follows `SLOTS`, which bounds it.
#[btf_map(name = "AFFINITY_MATCH")]
pub static AFFINITY_MATCH: HashMap<AffinityMatchKey, AffinityMatchValue, { DEFAULT_MAX_SLOTS as usize }, { BPF_F_NO_PREALLOC as usize }> =
    HashMap::new();

/// `loadBalancerSourceRanges` per frontend and generation (see
/// `SourceRangeKey`). LPM tries are never preallocated (the kernel requires
/// `BPF_F_NO_PREALLOC`, the type's default).
#[btf_map(name = "SOURCE_RANGES")]
pub static SOURCE_RANGES: LpmTrie<SourceRangeKey, u32, { DEFAULT_MAX_SERVICES as usize }> = LpmTrie::new();

/// One element the agent writes: the node's own network namespace.
#[btf_map(name = "NODE_NETNS")]
pub static NODE_NETNS: Array<NodeNetns, 1> = Array::new();

/// One bit per destination port (host byte order) used by a frontend in
/// `SERVICES` (see `SOCK_PORTS_MAP`): checked before the `SERVICES` lookup,
/// so a call to any other port costs one array lookup. The agent sets a
/// port's bit before it writes the first frontend on it.
#[btf_map(name = "SOCK_PORTS")]
pub static SOCK_PORTS: Array<u64, { SOCK_PORTS_ENTRIES as usize }> = Array::new();

/// New connections and unconnected-UDP flows per frontend and topology
/// tier (see `SvcConnValue`), indexed by `svc_conn_index(service_id)`.
/// Per-CPU: the connect hit path adds to its own CPU's copy without an
/// atomic or a shared cache line. The agent sizes it like `SERVICES` and
/// hands out service ids that fit.
#[btf_map(name = "SVC_CONN")]
pub static SVC_CONN: PerCpuArray<SvcConnValue, { DEFAULT_MAX_SERVICES as usize }> = PerCpuArray::new();

/// The agent's per-frontend figure added with each count (see
/// `SvcTopoValue`), indexed as `SVC_CONN`.
#[btf_map(name = "SVC_TOPO")]
pub static SVC_TOPO: Array<SvcTopoValue, { DEFAULT_MAX_SERVICES as usize }> = Array::new();

/// Counts one new connection (or unconnected-UDP flow) to frontend `svc`
/// through a backend of topology tier `backend_tier` (`BackendValue::tier`),
/// in the frontend's `SVC_CONN` slot: two array lookups (which the
/// verifier inlines as address arithmetic for array maps), two adds. A
/// frontend without a slot (a service id an older build gave out) is
/// counted by reason instead. As `count`, an increment may be lost to a
/// preempting program on the same CPU, never corrupted.
#[inline(always)]
pub fn count_connection(svc: &ServiceValue, backend_tier: u8) {
    let index = svc_conn_index(svc.service_id);
    let Some(slot) = SVC_CONN.get_ptr_mut(index) else {
        count(counter::TOPO_UNCOUNTED);
        return;
    };
    let share = SVC_TOPO.get(index).map_or(0, |t| t.blind_remote_share_fp);
    // SAFETY: the lookup bounds-checked `index` and returned this CPU's
    // copy of an array element, never freed while the map exists; plain
    // integers, valid for any bits.
    let slot = unsafe { &mut *slot };
    if let Some(n) = slot.tiers.get_mut(svc.counted_tier(backend_tier)) {
        *n += 1;
    }
    slot.blind_remote_fp += u64::from(share);
}

#[btf_map(name = "COUNTERS")]
pub static COUNTERS: PerCpuArray<u64, { counter::COUNT as usize }> = PerCpuArray::new();

/// Bumps one reason counter. Per-CPU, so no atomics are needed: only
/// programs on this CPU write this slot. sock_addr programs run with just
/// migration disabled, so on a preemptible kernel two of them can
/// interleave on one CPU and an increment can be lost (never corrupted).
#[inline(always)]
pub fn count(reason: u32) {
    if let Some(p) = COUNTERS.get_ptr_mut(reason) {
        // SAFETY: the lookup bounds-checked `reason` (None past
        // `counter::COUNT`) and returned this CPU's slot of an array
        // element; array elements are never freed while the map exists, and
        // the map outlives every run of a program that uses it. A u64 is a
        // valid value for any bits.
        unsafe { *p += 1 };
    }
}
