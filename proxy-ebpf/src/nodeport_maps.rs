//! Maps of the TC programs for external traffic (NodePort, LoadBalancer
//! ingress IPs, externalIPs). The agent pins all of them under its bpffs
//! directory, so connection tracking survives agent restarts and program
//! upgrades. Legacy `maps`-section definitions: the TC side does not need
//! field-level BTF, and keeping its maps in their own file keeps the two
//! datapaths' definitions apart.

use aya_ebpf::{
    bindings::BPF_F_NO_PREALLOC,
    macros::map,
    maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuArray, lpm_trie::Key},
};
use proxy_common::{
    AddrKey, AffinityMatchKey, AffinityMatchValue, AffinityValue, BackendKey, BackendValue, CtKey, CtValue, DEFAULT_MAX_AFFINITY,
    DEFAULT_MAX_BACKENDS, DEFAULT_MAX_NP_CT, DEFAULT_MAX_NP_LOCAL, DEFAULT_MAX_SERVICES, DEFAULT_MAX_SLOTS, NP_PEER_DEVS_ENTRIES,
    NP_PORTS_ENTRIES, NpAffinityKey, NpConfig, NpFlagsValue, ServiceKey, ServiceValue, SlotKey, SlotValue, SourceRangeKey, SvcConnValue,
    SvcTopoValue, np_counter, svc_conn_index,
};

// Frontend maps are not preallocated: the kernel allocates an element per
// entry written (kernel/bpf/hashtab.c:alloc_htab_elem) instead of
// max_entries elements at creation, so their memory follows the frontends
// programmed (plus a 16-byte bucket per entry of capacity). Only the agent
// writes them, and rarely: an insert costs about 1.5 us instead of 0.3 us
// (measured with BPF_MAP_UPDATE_BATCH on Linux 6.18). The slot and backend
// maps, written by the hundred thousand at a cold start, stay
// preallocated (inserts measured 4x slower without) and are sized to the
// cluster instead.
#[map(name = "NP_SERVICES")]
pub static NP_SERVICES: HashMap<ServiceKey, ServiceValue> = HashMap::with_max_entries(DEFAULT_MAX_SERVICES, BPF_F_NO_PREALLOC);

#[map(name = "NP_SLOTS")]
pub static NP_SLOTS: HashMap<SlotKey, SlotValue> = HashMap::with_max_entries(DEFAULT_MAX_SLOTS, 0);

#[map(name = "NP_BACKENDS")]
pub static NP_BACKENDS: HashMap<BackendKey, BackendValue> = HashMap::with_max_entries(DEFAULT_MAX_BACKENDS, 0);

#[map(name = "NP_FLAGS")]
pub static NP_FLAGS: HashMap<ServiceKey, NpFlagsValue> = HashMap::with_max_entries(DEFAULT_MAX_SERVICES, BPF_F_NO_PREALLOC);

#[map(name = "NP_LOCAL")]
pub static NP_LOCAL: HashMap<AddrKey, u32> = HashMap::with_max_entries(DEFAULT_MAX_NP_LOCAL, BPF_F_NO_PREALLOC);

/// The devices the TC fast path may hand a local backend's packet to with
/// `bpf_redirect_peer` (see `proxy_common::NP_PEER_DEVS_MAP`); written by
/// the agent as pods' veths come and go. Preallocated: looked up per
/// packet of a local flow, written rarely.
#[map(name = "NP_PEER_DEVS")]
pub static NP_PEER_DEVS: HashMap<u32, u32> = HashMap::with_max_entries(NP_PEER_DEVS_ENTRIES, 0);

/// LRU: the agent's conntrack GC deletes flows past their timeout, but a
/// burst of new flows between two sweeps (or while no agent runs) must not
/// fail inserts; an LRU map evicts the least recently used entry instead
/// when full (kernel/bpf/bpf_lru_list.c).
///
/// One LRU list for all CPUs (no `BPF_F_NO_COMMON_LRU`): per-CPU lists
/// measured no faster under the benchmark's BPF_PROG_TEST_RUN (an insert's
/// time goes to cache misses on the element and its bucket, not to the LRU
/// list lock), and they split `max_entries` evenly over all *possible* CPUs
/// (`bpf_percpu_lru_populate`), so on a machine with more possible than
/// online CPUs the flows would get only part of the table.
#[map(name = "NP_CT")]
pub static NP_CT: LruHashMap<CtKey, CtValue> = LruHashMap::with_max_entries(DEFAULT_MAX_NP_CT, 0);

/// Session affinity by client address (see `NpAffinityKey`); LRU, as the
/// socket datapath's `AFFINITY`.
#[map(name = "NP_AFFINITY")]
pub static NP_AFFINITY: LruHashMap<NpAffinityKey, AffinityValue> = LruHashMap::with_max_entries(DEFAULT_MAX_AFFINITY, 0);

/// The backends of each affine frontend's current generation (see
/// `AffinityMatchKey`); entries only for affine frontends, so not
/// preallocated.
#[map(name = "NP_AFFINITY_MATCH")]
pub static NP_AFFINITY_MATCH: HashMap<AffinityMatchKey, AffinityMatchValue> =
    HashMap::with_max_entries(DEFAULT_MAX_SLOTS, BPF_F_NO_PREALLOC);

/// `loadBalancerSourceRanges` per frontend and generation (see
/// `SourceRangeKey`); the kernel requires LPM tries unpreallocated, which
/// `LpmTrie` always asks for.
#[map(name = "NP_SOURCE_RANGES")]
pub static NP_SOURCE_RANGES: LpmTrie<SourceRangeKey, u32> = LpmTrie::with_max_entries(DEFAULT_MAX_SERVICES, 0);

#[map(name = "NP_CONFIG")]
pub static NP_CONFIG: Array<NpConfig> = Array::with_max_entries(1, 0);

#[map(name = "NP_COUNTERS")]
pub static NP_COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(np_counter::COUNT, 0);

/// The ports the programs may have to translate, one bit each (layout: see
/// `NP_PORTS_MAP` in proxy-common). Checked before any hash lookup: an
/// array lookup is inlined by the verifier into a bounds check and an
/// address computation (`array_map_gen_lookup`, kernel/bpf/arraymap.c), so
/// a packet that is not ours costs no hashing. The agent sets a bit before
/// it writes an entry that uses the port and clears it only once no
/// frontend, backend or `NP_CT` entry does.
#[map(name = "NP_PORTS")]
pub static NP_PORTS: Array<u64> = Array::with_max_entries(NP_PORTS_ENTRIES, 0);

/// Per-CPU scratch space for the new-flow path (see `nodeport::new_flow`).
/// Not pinned: it holds nothing between program runs.
#[repr(C)]
pub struct NpScratch {
    pub key: CtKey,
    pub fwd: CtValue,
    pub rev: CtValue,
    pub val: CtValue,
    /// The other direction's key, for FIN/RST marking and SNAT takeover.
    pub peer: CtKey,
    /// The source-range lookup of a new flow to a filtered frontend.
    pub range: Key<SourceRangeKey>,
    /// The client's affinity entry for an affine frontend, as looked up and
    /// as written back.
    pub affinity: NpAffinityKey,
    pub affinity_val: AffinityValue,
    /// The new flow's hash, from the backend pick to the SNAT port choice.
    pub hash: u32,
    /// The new flow's frontend and the tier it counts in
    /// (`ServiceValue::counted_tier`), from the backend pick to the count
    /// once the flow is tracked.
    pub service_id: u32,
    pub tier: u32,
    pub share_fp: u32,
}

/// The TC datapath's per-frontend topology counts and the agent's figure
/// added with each (see `proxy_common::SvcConnValue`), indexed by
/// `svc_conn_index` of an `NP_SERVICES` service id.
#[map(name = "NP_SVC_CONN")]
pub static NP_SVC_CONN: PerCpuArray<SvcConnValue> = PerCpuArray::with_max_entries(DEFAULT_MAX_SERVICES, 0);

#[map(name = "NP_SVC_TOPO")]
pub static NP_SVC_TOPO: Array<SvcTopoValue> = Array::with_max_entries(DEFAULT_MAX_SERVICES, 0);

/// Counts one new flow of the frontend `pick_backend` left in `s`, in its
/// tier (see `maps::count_connection` for the socket programs' twin).
#[inline(always)]
pub fn np_count_flow(s: &NpScratch) {
    let Some(slot) = NP_SVC_CONN.get_ptr_mut(svc_conn_index(s.service_id)) else {
        np_count(np_counter::TOPO_UNCOUNTED);
        return;
    };
    // SAFETY: this CPU's copy of a bounds-checked array element, never
    // freed while the map exists; no other reference to it is live (TC and
    // XDP programs run with bottom halves disabled, one per CPU at a time).
    let slot = unsafe { &mut *slot };
    if let Some(n) = slot.tiers.get_mut(s.tier as usize) {
        *n += 1;
    }
    slot.blind_remote_fp += u64::from(s.share_fp);
}

#[map(name = "NP_SCRATCH")]
pub static NP_SCRATCH: PerCpuArray<NpScratch> = PerCpuArray::with_max_entries(1, 0);

/// Bumps one reason counter of this CPU. TC programs run with bottom
/// halves disabled, so no other TC program runs on this CPU until this one
/// returns, and the increment needs no atomics.
#[inline(always)]
pub fn np_count(reason: u32) {
    if let Some(p) = NP_COUNTERS.get_ptr_mut(reason) {
        // SAFETY: the lookup bounds-checked `reason` (None past
        // `np_counter::COUNT`) and returned this CPU's slot of an array
        // element, which is never freed while the map exists; no other
        // reference to the slot is live (see above).
        unsafe { *p += 1 };
    }
}
