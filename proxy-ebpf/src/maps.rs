//! The maps the socket programs share with the agent. Names and layouts come
//! from `proxy-common`; the agent pins every map under its bpffs directory and
//! may change `max_entries` at load time.

use aya_ebpf::{
    macros::map,
    maps::{HashMap, LruHashMap, PerCpuArray},
};
use proxy_common::{
    BackendKey, BackendValue, DEFAULT_MAX_BACKENDS, DEFAULT_MAX_SERVICES, DEFAULT_MAX_SLOTS,
    DEFAULT_MAX_SOCK_REVNAT, ServiceKey, ServiceValue, SlotKey, SlotValue, SockRevNatKey,
    SockRevNatValue, counter,
};

#[map(name = "SERVICES")]
pub static SERVICES: HashMap<ServiceKey, ServiceValue> =
    HashMap::with_max_entries(DEFAULT_MAX_SERVICES, 0);

#[map(name = "SLOTS")]
pub static SLOTS: HashMap<SlotKey, SlotValue> = HashMap::with_max_entries(DEFAULT_MAX_SLOTS, 0);

#[map(name = "BACKENDS")]
pub static BACKENDS: HashMap<BackendKey, BackendValue> =
    HashMap::with_max_entries(DEFAULT_MAX_BACKENDS, 0);

/// LRU: entries of closed sockets are never deleted explicitly (there is no
/// close hook in the sock_addr family), so old ones must age out.
#[map(name = "SOCK_REVNAT")]
pub static SOCK_REVNAT: LruHashMap<SockRevNatKey, SockRevNatValue> =
    LruHashMap::with_max_entries(DEFAULT_MAX_SOCK_REVNAT, 0);

#[map(name = "COUNTERS")]
pub static COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(counter::COUNT, 0);

/// Bumps one reason counter. Per-CPU, so no atomics are needed.
#[inline(always)]
pub fn count(reason: u32) {
    if let Some(p) = COUNTERS.get_ptr_mut(reason) {
        // SAFETY: the pointer is to this CPU's slot of a live array element.
        unsafe { *p += 1 };
    }
}
