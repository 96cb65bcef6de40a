//! Socket-level load balancing for ClusterIP traffic.
//!
//! cgroup `sock_addr` hooks run when a process in the attached cgroup calls
//! connect() or sendmsg() with a destination, and when the kernel reports a
//! peer back through getpeername() or recvmsg(). Translating at that point
//! (as Cilium's `bpf_sock.c` does) means the packets themselves carry the
//! backend address, so no per-packet NAT and no conntrack are needed.
//!
//! A frontend may ask for more than a backend (`ServiceValue::flags`): with
//! `loadBalancerSourceRanges` a client outside them is refused, and with
//! session affinity a client keeps the backend its affinity entry names
//! while the frontend still uses it (see `proxy-common`'s
//! `AffinityMatchKey`).
//!
//! Every entry point (in `main.rs`) is a thin wrapper around a `try_`
//! function here. Errors of
//! our own (a context read that fails, a slot that vanished under us) are
//! counted and the socket is left exactly as the application asked: we never
//! break a connection that is not ours.

use core::ptr::{addr_of, read_volatile};

use aya_ebpf::{
    EbpfContext,
    bindings::{BPF_EXIST, BPF_NOEXIST},
    btf_maps::lpm_trie::Key,
    helpers::{bpf_get_netns_cookie, bpf_get_prandom_u32, bpf_get_socket_cookie, bpf_set_retval},
    programs::{SockAddrContext, SockContext},
};
use proxy_common::{
    AFFINITY_REFRESH_NS, AffinityMatchKey, AffinityValue, BackendKey, FAMILY_V4, MaglevKey, PROTO_TCP, PROTO_UDP, SOCK_REC_COUNTED,
    SOURCE_RANGE_FIXED_BITS, SVC_FLAG_AFFINITY, SVC_FLAG_SOURCE_RANGES, SVC_FLAG_SOURCE_RANGES_NODE, ServiceKey, ServiceValue,
    SockAffinityKey, SockPeerValue, SockRecValue, SockRevNatKey, SockRevNatValue, SourceRangeKey, affinity_expired, counter, sock_port_bit,
    sock_rec_count_slot, socket_hash,
};

use crate::kernel;
use crate::maglev_maps::SOCK_MAGLEV;
use crate::maps::{
    AFFINITY, AFFINITY_MATCH, BACKENDS, NODE_NETNS, SERVICES, SLOTS, SOCK_CONFIG, SOCK_PEER, SOCK_PORTS, SOCK_REC, SOCK_REC_COUNT,
    SOCK_REVNAT, SOURCE_RANGES, count, count_connection,
};
use crate::sockaddr::{Addr, bound_source, read_peer, write_peer};

/// sock_addr programs return 1 to let the call proceed.
pub(crate) const ALLOW: i32 = 1;
/// ... and 0 to fail it; the errno is -EPERM unless bpf_set_retval() chose
/// another (kernel >= 5.18, `__cgroup_bpf_run_filter_sock_addr`).
const REJECT: i32 = 0;
const ECONNREFUSED: i32 = 111;

/// How a backend is picked for this call.
#[derive(Clone, Copy)]
pub(crate) enum Pick {
    /// connect(): a fresh random choice per connection. For UDP, connect()
    /// happens once per socket, so the choice is stable for its lifetime.
    Random,
    /// sendmsg() on an unconnected UDP socket runs per datagram: hash the
    /// socket cookie so every datagram of one socket goes to one backend.
    PerSocket,
}

#[inline(always)]
pub(crate) fn try_release(ctx: &SockContext) {
    // SAFETY: `ctx.sock` is the `bpf_sock` context the kernel passed;
    // `protocol` is readable by this attach type as one 4-byte load the
    // verifier rewrites into a read of the socket (`bpf_sock_is_valid_access`).
    let proto = unsafe { read_volatile(addr_of!((*ctx.sock).protocol)) } as u8;
    if proto != PROTO_TCP && proto != PROTO_UDP {
        return;
    }
    // SAFETY: the sock variant of the helper (`bpf_get_socket_cookie_sock`,
    // ARG_PTR_TO_CTX) gets this program's own context.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    // Most sockets released here never had a record (listeners, DNS,
    // connections to anything but a frontend): their slot's count is 0,
    // read from a line of cookies this CPU just used, and the hash (whose
    // bucket for this cookie is a cache and TLB miss) is never touched.
    if !may_have_record(cookie) {
        return;
    }
    // SAFETY: a value of a preallocated element, valid for the run (RCU);
    // the one byte is read before the delete below, and no one else
    // writes this cookie's record (its socket is being released).
    let Some(counted) = SOCK_REC.get_ptr(cookie).map(|r| unsafe { (*r).counted }) else {
        return;
    };
    // Fails only if another release of the same cookie won the race,
    // which cannot happen (a socket is released once); nothing to count.
    // The count is taken back only for a record the connect program
    // counted, and only once the record is gone.
    if SOCK_REC.remove(cookie).is_ok() && counted == SOCK_REC_COUNTED {
        add_to_record_count(cookie, u64::MAX);
    }
}

/// Whether `SOCK_REC` may hold a record for `cookie`: its slot in
/// `SOCK_REC_COUNT` is not 0 (see `SOCK_REC_COUNT_SLOTS`). A slot that
/// cannot be read (impossible: every cookie's slot is an index of the
/// array) answers yes, so the hash decides.
#[inline(always)]
pub(crate) fn may_have_record(cookie: u64) -> bool {
    // SAFETY: an array element, never freed while the map exists, read as
    // one aligned u64 load; a concurrent atomic update leaves it either
    // value.
    SOCK_REC_COUNT.get_ptr(sock_rec_count_slot(cookie)).is_none_or(|c| unsafe { read_volatile(c) } != 0)
}

/// Adds `delta` (1, or u64::MAX for -1) to the count of `cookie`'s slot,
/// atomically: connects and releases of sockets whose cookies share the
/// slot run on every CPU at once.
#[inline(always)]
pub(crate) fn add_to_record_count(cookie: u64, delta: u64) {
    if let Some(c) = SOCK_REC_COUNT.get_ptr_mut(sock_rec_count_slot(cookie)) {
        // SAFETY: an aligned u64 of an array element, valid for the run;
        // every writer (these programs, and the agent through its mapping
        // of the array) updates it atomically; on an older pin that cannot
        // be mapped the agent's plain writes only raise it
        // (`SOCK_REC_UNCOUNTED`).
        unsafe { atomic_add(c, delta) };
    }
}

/// `*p += delta` as one atomic instruction. The eBPF target offers Rust
/// no atomic read-modify-write, so it is written out: `BPF_STX |
/// BPF_ATOMIC | BPF_DW` with `BPF_ADD` and no `BPF_FETCH` (the former
/// `BPF_XADD`), which every supported kernel has (Linux 5.10; the fetch
/// forms came in 5.12) and the verifier accepts on map values.
///
/// # Safety
/// `p` must point at an aligned u64 of a map value, valid for the run.
#[inline(always)]
pub(crate) unsafe fn atomic_add(p: *mut u64, delta: u64) {
    // SAFETY: as the caller vouches; the instruction writes only `*p`.
    unsafe {
        core::arch::asm!(
            "lock *(u64 *)({p} + 0) += {v}",
            p = in(reg) p,
            v = in(reg) delta,
            options(nostack),
        );
    }
}

/// Our own failures (the `Err` side carries a counter id) are counted and
/// fail open.
#[inline(always)]
pub(crate) fn verdict(result: Result<i32, u32>) -> i32 {
    match result {
        Ok(v) => v,
        Err(reason) => {
            count(reason);
            ALLOW
        }
    }
}

// The family is a const parameter so that each program gets its own copy
// with fixed context offsets: the verifier rejects a store through a context
// pointer whose offset was computed at run time ("dereference of modified
// ctx ptr").
#[inline(always)]
pub(crate) fn try_forward<const FAMILY: u8, const KERNEL: u8>(ctx: &SockAddrContext, pick: Pick) -> Result<i32, u32> {
    let sa = ctx.sock_addr;
    // The port first: a call to a port no frontend uses is then decided
    // with one context load and one array lookup (the protocol lives on
    // the socket, a further dependent load).
    // SAFETY: `sa` is the `bpf_sock_addr` context the kernel passed to this
    // program: non-null and valid for the whole run. `user_port` is readable
    // by every sock_addr attach type as one aligned 4-byte load, which the
    // verifier rewrites into a read of the kernel's sockaddr
    // (`sock_addr_is_valid_access`); volatile so that it stays one 4-byte
    // load. It holds the network-order port in its first two bytes.
    // `addr_of!` never creates a reference to the context.
    let port_be = unsafe { read_volatile(addr_of!((*sa).user_port)) } as u16;
    if !port_may_be_frontend(port_be) {
        return Ok(ALLOW); // no frontend on this port: none of our business
    }
    // SAFETY: `sa` as above. `protocol` is readable by every sock_addr
    // attach type as one 4-byte load, which the verifier rewrites into a
    // read of the socket (`sock_addr_is_valid_access`,
    // `sock_addr_convert_ctx_access`).
    let proto = unsafe { (*sa).protocol } as u8;
    if proto != PROTO_TCP && proto != PROTO_UDP {
        return Ok(ALLOW);
    }
    let asked = read_peer::<FAMILY>(sa);
    // An IPv4 Service dialled through an AF_INET6 socket as ::ffff:a.b.c.d
    // is looked up, and remembered, as IPv4; only what the socket sees is
    // written in the mapped form.
    let mapped = asked.unmapped_v4();
    let dst = mapped.unwrap_or(asked);
    let key = ServiceKey { ip_be: dst.ip_be, port_be: dst.port_be, proto, family: dst.family };
    // SAFETY: the kernel runs the program under rcu_read_lock and never
    // frees a preallocated hash element while the map exists, so the
    // reference the lookup returns points at valid value memory for the
    // whole run. The value is copied out at once, before any other map
    // operation; should the agent replace the element and its memory be
    // reused meanwhile, the copy is stale or mixed but still a valid
    // `ServiceValue` (plain integers: every bit pattern is a value).
    let Some(svc) = (unsafe { SERVICES.get(&key) }).copied() else {
        return Ok(ALLOW); // not a frontend: none of our business
    };
    if svc.flags & SVC_FLAG_SOURCE_RANGES != 0 && !source_allowed::<FAMILY>(ctx, &svc, mapped.is_some()) {
        // kube-proxy drops such packets; at connect() the one clear answer
        // is a refusal, as for a Service without endpoints.
        return Ok(refuse::<KERNEL>(counter::REFUSED_SOURCE_RANGE));
    }
    if svc.backend_count == 0 {
        // Kubernetes promises "connection refused" for a Service with no
        // endpoint for this client (see `refuse` for older kernels).
        return Ok(refuse::<KERNEL>(counter::REFUSED_NO_BACKEND));
    }
    // A client with a fresh affinity entry keeps its backend; everyone
    // else gets the usual choice below, which is then remembered.
    let affinity = if svc.flags & SVC_FLAG_AFFINITY != 0 { Some(affinity_key(ctx, svc.affinity_scope())) } else { None };
    let sticky = affinity.as_ref().and_then(|k| affinity_lookup::<KERNEL>(k, &svc));

    // The cookie is fetched only where it is needed: the first call on a
    // socket assigns it (`__sock_gen_cookie`, a shared counter).
    let (cookie, hash) = match pick {
        // SAFETY: the helper takes no arguments and touches no memory of ours.
        Pick::Random => (0, unsafe { bpf_get_prandom_u32() }),
        Pick::PerSocket => {
            // SAFETY: `ctx.as_ptr()` is the context the kernel passed in,
            // which is what the sock_addr variant of the helper takes
            // (`bpf_get_socket_cookie_sock_addr`, ARG_PTR_TO_CTX); the
            // verifier rejects any other pointer.
            let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
            (cookie, socket_hash(cookie, svc.service_id))
        }
    };

    // The agent replaces a service's (count, generation) in one hash-map
    // update and only then deletes the previous generation's slots. A reader
    // that loaded the old entry just before may find its slot gone; looking
    // the service up once more then sees the new generation.
    let (backend, tier) = match sticky {
        Some(b) => b,
        None => {
            let per_socket = matches!(pick, Pick::PerSocket);
            let (id, b) = match lookup_backend(&svc, hash, per_socket) {
                Some(b) => b,
                None => {
                    // SAFETY: as for the first lookup: valid for the run,
                    // copied out at once.
                    let Some(fresh) = (unsafe { SERVICES.get(&key) }).copied() else {
                        return Ok(ALLOW); // deleted meanwhile: behave as for a non-service
                    };
                    if fresh.backend_count == 0 {
                        return Ok(refuse::<KERNEL>(counter::REFUSED_NO_BACKEND));
                    }
                    lookup_backend(&fresh, hash, per_socket).ok_or(counter::SLOT_MISS)?
                }
            };
            if let Some(k) = &affinity {
                affinity_remember::<KERNEL>(k, id);
            }
            b
        }
    };
    if backend.family != dst.family {
        return Err(counter::CTX_ERROR);
    }

    if matches!(pick, Pick::Random) {
        record(ctx, proto, svc.service_id, &backend, &dst);
        // Every translated connect() is a new connection (TCP) or a new
        // peer for the socket (connected UDP).
        count_connection(&svc, tier);
    } else if remember(ctx, proto, cookie, &backend, &dst, false) {
        // sendmsg() runs per datagram: only a socket's first datagram to
        // this frontend and backend is a new flow.
        count_connection(&svc, tier);
    }
    write_peer::<FAMILY>(sa, &if mapped.is_some() { backend.mapped_v6() } else { backend });
    count(counter::TRANSLATED);
    Ok(ALLOW)
}

/// Whether a frontend in `SERVICES` may use this destination port: its bit
/// in `SOCK_PORTS` (one array lookup, no hashing) is set. The agent sets a
/// port's bit before it writes the port's first frontend and clears it
/// only after the last one is deleted, so a clear bit is a sure miss. A
/// lookup that fails (impossible: every u16 port indexes one of the
/// `SOCK_PORTS_ENTRIES` words) counts as set, so the `SERVICES` lookup
/// decides.
#[inline(always)]
fn port_may_be_frontend(port_be: u16) -> bool {
    let (word, mask) = sock_port_bit(u16::from_be(port_be));
    SOCK_PORTS.get(word).is_none_or(|w| *w & mask != 0)
}

/// Fails the call with `ECONNREFUSED` (Kubernetes promises "connection
/// refused" for a Service without endpoints), counting `reason`. The
/// `COMPAT` variant has no `bpf_set_retval` (Linux 5.18), so there the
/// call fails with the kernel's default `EPERM`.
#[inline(always)]
fn refuse<const KERNEL: u8>(reason: u32) -> i32 {
    count(reason);
    if KERNEL == kernel::FULL {
        // SAFETY: the helper takes a plain integer and touches no memory
        // of ours; only the FULL variant calls it, which the agent loads
        // where the kernel has it.
        unsafe { bpf_set_retval(-ECONNREFUSED) };
    }
    REJECT
}

/// The backend `hash` selects: its id, address and topology tier. A per-socket pick
/// (unconnected UDP) takes it from the frontend's Maglev table when its
/// generation has one, so that a backend leaving moves only the sockets
/// that used it; otherwise (random picks, no table, a table not linked
/// in) from the slot `hash` selects.
#[inline(always)]
fn lookup_backend(svc: &ServiceValue, hash: u32, per_socket: bool) -> Option<(u32, (Addr, u8))> {
    let id = match if per_socket { maglev_backend_id(svc, hash) } else { None } {
        Some(id) => id,
        None => slot_backend_id(svc, hash)?,
    };
    Some((id, backend_addr(id)?))
}

/// The backend id entry `hash % M` of the frontend generation's Maglev
/// table names, or `None` without a table.
#[inline(always)]
fn maglev_backend_id(svc: &ServiceValue, hash: u32) -> Option<u32> {
    let m = svc.maglev_size();
    if m == 0 {
        return None;
    }
    let key = MaglevKey { service_id: svc.service_id, generation: svc.generation };
    // SAFETY: the outer lookup returns the inner array the agent linked in
    // under this generation, which the kernel keeps alive for the run
    // (an unlinked inner map is freed only after an RCU grace period);
    // array elements are plain u32 memory, never freed while their map
    // exists, and the id is copied out at once. The agent fills a table
    // before linking it in; an index past an array's size is a miss.
    let id = unsafe { SOCK_MAGLEV.get_value(&key, &(hash % m)) }.copied();
    if id.is_none() {
        count(counter::MAGLEV_MISS);
    }
    id
}

/// The backend id in the slot `hash` selects.
#[inline(always)]
pub(crate) fn slot_backend_id(svc: &ServiceValue, hash: u32) -> Option<u32> {
    // SAFETY: map values stay valid memory for the program run (RCU,
    // preallocated elements), and the id is read right away, before the
    // next map operation; a concurrently recycled element yields a valid if
    // stale integer.
    Some(unsafe { SLOTS.get(&svc.slot_for(hash)) }?.backend_id)
}

/// A backend's address and its topology tier (`BackendValue::tier`), from
/// one `BACKENDS` lookup.
#[inline(always)]
pub(crate) fn backend_addr(id: u32) -> Option<(Addr, u8)> {
    // SAFETY: as in `lookup_backend`; the fields are copied into `Addr` at
    // once.
    let b = unsafe { BACKENDS.get(&BackendKey { backend_id: id }) }?;
    Some((Addr { ip_be: b.ip_be, port_be: b.port_be, family: b.family }, b.tier))
}

/// Whether the client of this call may reach a frontend with
/// `loadBalancerSourceRanges`.
///
/// A socket bound to an address (`bind()` before `connect()`) is judged by
/// that address, as kube-proxy judges a packet by its source. An unbound
/// socket has no source address yet at this hook; the kernel picks it
/// afterwards. In the node's own network namespace (`NODE_NETNS`) it will
/// be one of the node's addresses, which the agent checked against the
/// ranges (`SVC_FLAG_SOURCE_RANGES_NODE`). In a pod's namespace it is the pod's
/// address, which this hook cannot see: such a connection is refused, so
/// that a restricted LoadBalancer is never opened to pods outside its
/// ranges (pods inside them reach it by binding their own address first).
#[inline(always)]
fn source_allowed<const FAMILY: u8>(ctx: &SockAddrContext, svc: &ServiceValue, mapped: bool) -> bool {
    let bound = bound_source::<FAMILY>(ctx.sock_addr);
    // An IPv4 frontend dialled from an AF_INET6 socket: a bound source is
    // the mapped form of an IPv4 address (anything else cannot reach IPv4).
    let src = if mapped { bound.unmapped_v4().unwrap_or(Addr { ip_be: [0; 4], port_be: 0, family: FAMILY_V4 }) } else { bound };
    if src.ip_be == [0; 4] {
        if svc.flags & SVC_FLAG_SOURCE_RANGES_NODE == 0 {
            return false;
        }
        let node = NODE_NETNS.get(0).map_or(0, |n| n.netns_cookie);
        // SAFETY: the helper gets this program's own context (the sock_addr
        // variant, `bpf_get_netns_cookie_sock_addr`, Linux >= 5.8) and
        // touches no memory of ours.
        let own = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
        return node != 0 && own == node;
    }
    let key = Key::new(SOURCE_RANGE_FIXED_BITS + 128, SourceRangeKey::new(svc.service_id, svc.generation, src.family, src.ip_be));
    SOURCE_RANGES.get(&key).is_some()
}

/// The backend this client's affinity entry names for `svc`, when the
/// entry is fresh and its backend is still one the frontend uses (listed in
/// `AFFINITY_MATCH` under the generation `svc` was read at). Refreshes the
/// entry's time on a hit.
#[inline(always)]
fn affinity_lookup<const KERNEL: u8>(key: &SockAffinityKey, svc: &ServiceValue) -> Option<(Addr, u8)> {
    let entry = AFFINITY.get_ptr_mut(key)?;
    // SAFETY: `entry` is the value pointer of an AFFINITY element, valid
    // for the run (RCU; LRU elements are preallocated and never freed while
    // the map exists). It is read once here; another CPU may refresh or
    // evict and reuse the element meanwhile, which leaves stale or mixed
    // integers, every one a valid `AffinityValue`.
    let found = unsafe { *entry };
    let now = kernel::now_ns::<KERNEL>();
    let mkey = AffinityMatchKey { service_id: svc.service_id, generation: svc.generation, backend_id: found.backend_id };
    // SAFETY: a map value, valid for the run, read at once.
    let fresh = unsafe { AFFINITY_MATCH.get(&mkey) }.is_some_and(|m| !affinity_expired(now, found.last_used_ns, m.timeout_s));
    let Some(addr) = (if fresh { backend_addr(found.backend_id) } else { None }) else {
        count(counter::AFFINITY_STALE);
        return None;
    };
    if now.saturating_sub(found.last_used_ns) >= AFFINITY_REFRESH_NS {
        // SAFETY: as above; an aligned u64 store into the element, which a
        // concurrent refresh of the same client may overwrite (either time
        // is right to within a refresh period).
        unsafe { (*entry).last_used_ns = now };
    }
    count(counter::AFFINITY_HIT);
    Some(addr)
}

/// Records that the client of `key` now uses backend `backend_id`.
#[inline(always)]
fn affinity_remember<const KERNEL: u8>(key: &SockAffinityKey, backend_id: u32) {
    let now = kernel::now_ns::<KERNEL>();
    if AFFINITY.insert(key, &AffinityValue { last_used_ns: now, backend_id, _pad: 0 }, 0).is_err() {
        count(counter::AFFINITY_UPDATE_FAILED);
    }
}

/// The client is the caller's network namespace, the scope the Service
/// port (see `SockAffinityKey`).
#[inline(always)]
fn affinity_key(ctx: &SockAddrContext, scope_id: u32) -> SockAffinityKey {
    // SAFETY: the helper gets this program's own context, as its sock_addr
    // variant requires, and touches no memory of ours.
    let netns_cookie = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    SockAffinityKey { netns_cookie, scope_id, _pad: 0 }
}

/// Records a translated connect() in `SOCK_REC` under the socket's
/// cookie, replacing the record of an earlier connect() of the same
/// socket, so the record always names the last translation. A new record
/// is counted in its cookie's `SOCK_REC_COUNT` slot (after the insert: the
/// reverse hooks of this socket, which read the slot first, run under the
/// socket lock this connect() holds, and its release comes after it); a
/// replaced one keeps the `counted` mark, and with it the count, of the
/// record it replaces. When the insert fails (the map full: E2BIG from the
/// preallocated free list; or its bucket busy) the connection is
/// translated all the same and its record goes to socket storage
/// (`remember`), counted as `SOCK_RECORD_FULL`: getpeername and
/// termination then find it there.
#[inline(always)]
fn record(ctx: &SockAddrContext, proto: u8, service_id: u32, backend: &Addr, frontend: &Addr) {
    // SAFETY: the helper gets this program's own context, as it requires.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    let mut rec = SockRecValue {
        backend_ip_be: backend.ip_be,
        frontend_ip_be: frontend.ip_be,
        service_id,
        backend_port_be: backend.port_be,
        frontend_port_be: frontend.port_be,
        family: backend.family,
        proto,
        counted: SOCK_REC_COUNTED,
        _pad: 0,
    };
    // BPF_NOEXIST tells a new record (counted here) from a reconnect's.
    if SOCK_REC.insert(cookie, rec, u64::from(BPF_NOEXIST)).is_ok() {
        add_to_record_count(cookie, 1);
        return;
    }
    // SAFETY: a value of a preallocated element, valid for the run; one
    // byte copied out at once. Only connect() writes a socket's record,
    // under the socket lock, so it is not replaced meanwhile.
    if let Some(old) = SOCK_REC.get_ptr(cookie).map(|r| unsafe { (*r).counted }) {
        rec.counted = old;
        if SOCK_REC.insert(cookie, rec, u64::from(BPF_EXIST)).is_ok() {
            return;
        }
    }
    count(counter::SOCK_RECORD_FULL);
    remember(ctx, proto, cookie, backend, frontend, true);
}

/// Records that this socket reaches `frontend` at `backend`, for the
/// reverse path: unconnected UDP (sendmsg), and connect() when `SOCK_REC`
/// is full (see `record`). Returns whether this is a translation the socket
/// had not made before (a new flow, for `count_connection`): its storage
/// was created now, or it differed and had not spilled yet (a socket that
/// alternates between several frontends counts its second one once; its
/// further ones, which `SOCK_REVNAT` keeps, are not told apart from
/// repeats without another lookup per datagram).
///
/// In the socket's own storage (`SOCK_PEER`), TCP and UDP alike. The
/// element is created with its final contents in one step
/// (`bpf_sk_storage_get` with `BPF_SK_STORAGE_GET_F_CREATE` and an initial
/// value inserts with BPF_NOEXIST, `net/core/bpf_sk_storage.c`), so a
/// concurrent reader never sees it half-written, and the kernel frees it
/// with the socket, so nothing has to age out. For UDP this also makes
/// recvmsg(), which runs for every datagram any UDP socket in the cgroup
/// receives, answer "not ours" for a socket we never translated without a
/// table lookup. For TCP it is the cheaper record: an element allocated
/// with the socket costs less on connect() than an insert into the
/// `SOCK_REVNAT` LRU, whose free-list refill and eviction take a global
/// lock (measured by `cargo xtask bench --only connect4`).
///
/// Later, different translations of the same socket (unconnected UDP
/// talking to several Services, a TCP socket whose connect() is retried
/// and picks another backend) go to `SOCK_REVNAT` and mark the storage
/// `spilled`; so does a translation whose storage could not be created.
///
/// A UDP connect() (`connect`) is recorded in `SOCK_REVNAT` as well: the
/// agent finds the sockets to terminate when their backend leaves by
/// their cookie and peer, and socket storage cannot be read from user
/// space for UDP sockets (sock_diag reports it for TCP only:
/// `inet_sk_diag_fill` stops before it without a connection sock).
#[inline(always)]
fn remember(ctx: &SockAddrContext, proto: u8, cookie: u64, backend: &Addr, frontend: &Addr, connect: bool) -> bool {
    let family = backend.family;
    let mut first = SockPeerValue {
        backend_ip_be: backend.ip_be,
        frontend_ip_be: frontend.ip_be,
        backend_port_be: backend.port_be,
        frontend_port_be: frontend.port_be,
        family,
        spilled: 0,
        _pad: [0; 2],
    };
    // The lookup alone first: on every datagram after a socket's first it
    // finds the element, as the creating call would, and tells a new
    // translation from a repeated one.
    // SAFETY: aya reads the socket from `ctx.sock_addr->sk`, which the
    // kernel sets for every sock_addr program to the full socket the
    // call is made on (the verifier types it PTR_TO_SOCKET, non-null);
    // the helper only looks up.
    let mut peer = unsafe { SOCK_PEER.get_ptr_mut(ctx) };
    let mut new = false;
    if peer.is_null() {
        new = true;
        // SAFETY: as above. The helper copies `first`, a value of the
        // map's value type on our stack, into a new element and returns
        // this socket's element or null.
        peer = unsafe { SOCK_PEER.get_or_insert_ptr_mut(ctx, Some(&mut first)) };
    }
    if peer.is_null() {
        // Either another thread created the element between the
        // helper's lookup and its insert (the insert then fails with
        // EEXIST), or memory is short.
        // SAFETY: as above, without creating anything.
        peer = unsafe { SOCK_PEER.get_ptr_mut(ctx) };
    }
    if peer.is_null() {
        count(counter::PEER_STORAGE_FAILED);
    } else {
        // SAFETY: `peer` is non-null and points at this socket's storage
        // element, which the kernel frees (with the socket, or on an
        // explicit delete) only after an RCU grace period, while this
        // program runs under rcu_read_lock. Other hooks of the same
        // socket may read the element concurrently; the only write is
        // the one-byte store to `spilled` below (a reader sees 0 or 1),
        // and every other field is written only when the element is
        // created.
        let p = unsafe { &mut *peer };
        if p.family == family
            && p.backend_ip_be == backend.ip_be
            && p.backend_port_be == backend.port_be
            && p.frontend_ip_be == frontend.ip_be
            && p.frontend_port_be == frontend.port_be
        {
            if proto == PROTO_TCP || !connect {
                return new;
            }
        } else {
            new = p.spilled == 0;
            p.spilled = 1;
        }
    }
    // Cookies start at 1 (`__sock_gen_cookie`), so 0 means "not fetched yet".
    // SAFETY: the helper gets this program's own context, as it requires.
    let cookie = if cookie == 0 { unsafe { bpf_get_socket_cookie(ctx.as_ptr()) } } else { cookie };
    let rev_key = SockRevNatKey::new(cookie, backend.ip_be, backend.port_be, family);
    let rev_val = SockRevNatValue { ip_be: frontend.ip_be, port_be: frontend.port_be, family, _pad: 0 };
    if SOCK_REVNAT.insert(&rev_key, &rev_val, 0).is_err() {
        // The LRU map evicts rather than fills, so this is unexpected; the
        // connection still works, only getpeername/recvmsg show the backend.
        count(counter::REVNAT_UPDATE_FAILED);
    }
    new
}

/// getpeername() (`GETPEERNAME`) or recvmsg(): reports the frontend instead
/// of the backend the socket was sent to.
#[inline(always)]
pub(crate) fn try_reverse<const FAMILY: u8, const GETPEERNAME: bool>(ctx: &SockAddrContext) -> Result<(), u32> {
    let sa = ctx.sock_addr;
    let reported = read_peer::<FAMILY>(sa);
    // An IPv4 peer of an AF_INET6 socket shows as ::ffff:a.b.c.d; its
    // translation was remembered in IPv4 form (see `try_forward`).
    let mapped = reported.unmapped_v4();
    let peer = mapped.unwrap_or(reported);
    let family = peer.family;
    let report = |frontend: Addr| {
        write_peer::<FAMILY>(sa, &if mapped.is_some() { frontend.mapped_v6() } else { frontend });
        count(counter::REVERSED);
    };
    // The connect() record first: it names the socket's last translated
    // connect(), and counts only while the socket's peer is still that
    // backend (a socket reconnected elsewhere, or disconnected with
    // AF_UNSPEC, reports its peer as it is).
    // SAFETY: the helper gets this program's own context.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    // The count first (see `try_release`): a socket never translated
    // (every datagram of every untranslated UDP socket comes here) skips
    // the hash.
    if may_have_record(cookie)
        // SAFETY: valid value memory for the run (RCU, preallocated
        // elements are not freed while the map exists), copied out at
        // once; an element deleted and reused meanwhile gives a stale but
        // valid record, which the peer comparison below then rejects or
        // accepts as any record.
        && let Some(r) = (unsafe { SOCK_REC.get(cookie) }).copied()
        && r.family == family
        && r.backend_ip_be == peer.ip_be
        && r.backend_port_be == peer.port_be
    {
        report(Addr { ip_be: r.frontend_ip_be, port_be: r.frontend_port_be, family });
        return Ok(());
    }
    // SAFETY: aya reads the socket from the context the kernel passed in
    // (`sk` is always set for sock_addr programs); the helper only looks up,
    // returning this socket's element or null.
    let stored = unsafe { SOCK_PEER.get_ptr_mut(ctx) };
    if stored.is_null() {
        // recvmsg: a UDP socket with no record above and no storage was
        // never translated, unless an agent version without SOCK_PEER
        // translated it (see `SockConfig`). Every datagram of every UDP
        // socket in the cgroup passes here, so that case stops at once.
        // getpeername: an older agent's TCP entry in SOCK_REVNAT.
        if !GETPEERNAME {
            let below = SOCK_CONFIG.get(0).map_or(0, |c| c.legacy_revnat_cookie_below);
            if below == 0 {
                return Ok(());
            }
            if cookie >= below {
                return Ok(());
            }
        }
    } else {
        // SAFETY: non-null, this socket's element, valid for the run (see
        // `remember`); it is only read here, and the only concurrent write
        // to it is the one-byte `spilled` store.
        let p = unsafe { &*stored };
        if p.family == family && p.backend_ip_be == peer.ip_be && p.backend_port_be == peer.port_be {
            report(Addr { ip_be: p.frontend_ip_be, port_be: p.frontend_port_be, family });
            return Ok(());
        }
        if p.spilled == 0 {
            return Ok(()); // a peer this socket never reached through a frontend
        }
    }
    let key = SockRevNatKey::new(cookie, peer.ip_be, peer.port_be, family);
    // SAFETY: valid value memory for the run (RCU, preallocated LRU
    // elements), copied out at once; an element evicted and reused meanwhile
    // gives a stale but valid `SockRevNatValue`.
    let Some(orig) = (unsafe { SOCK_REVNAT.get(&key) }).copied() else {
        return Ok(()); // this socket never went through a frontend
    };
    report(Addr { ip_be: orig.ip_be, port_be: orig.port_be, family: orig.family });
    Ok(())
}
