//! What the socket programs remember about a translated socket, so that
//! getpeername()/recvmsg() can translate back and the agent can tell its
//! sockets apart when it terminates them.

// SOCK_REVNAT: BPF_MAP_TYPE_LRU_HASH, SockRevNatKey -> SockRevNatValue.
// Written by the connect/sendmsg programs for a socket's translations
// beyond its first (and by older builds for every one); read by
// getpeername/recvmsg, the socket iterators and the agent's sweep.
/// Reverse translations beyond a socket's first: [`SockRevNatKey`] -> [`SockRevNatValue`], LRU.
pub const SOCK_REVNAT_MAP: &str = "SOCK_REVNAT";
// SOCK_PEER: BPF_MAP_TYPE_SK_STORAGE, socket -> SockPeerValue. Written by
// connect/sendmsg on a socket's first translation; read by
// getpeername/recvmsg, the socket iterators, and the agent (sock_diag).
/// Socket storage of a translated socket: [`SockPeerValue`].
pub const SOCK_PEER_MAP: &str = "SOCK_PEER";
// SOCK_REC: BPF_MAP_TYPE_HASH (preallocated), socket cookie (u64) ->
// SockRecValue. Written by connect, deleted by the sock_release program;
// read by getpeername/recvmsg, the iterators and the agent.
/// The connect hook's per-socket record, keyed by socket cookie (u64 ->
/// [`SockRecValue`]), a preallocated hash.
pub const SOCK_REC_MAP: &str = "SOCK_REC";

/// Default capacity of `SOCK_REVNAT` and `SOCK_REC`: translated sockets at once.
pub const DEFAULT_MAX_SOCK_REVNAT: u32 = 262_144;

// SOCK_REC_COUNT: BPF_MAP_TYPE_ARRAY of u64, SOCK_REC_COUNT_SLOTS entries.
// Written by connect (+1 per record it creates) and sock_release (-1 per
// such record it deletes), both atomically; read by sock_release and
// getpeername/recvmsg before they look a cookie up in SOCK_REC; the agent
// raises the slots of records no program counted (see `SOCK_REC_UNCOUNTED`).
/// How many `SOCK_REC` records each slot of cookies holds (see [`sock_rec_count_slot`]).
pub const SOCK_REC_COUNT_MAP: &str = "SOCK_REC_COUNT";

/// Slots of `SOCK_REC_COUNT` (a power of two): 512 KiB of u64 counts (the
/// eBPF target has atomics of 64 bits only).
///
/// Why a count in front of the hash: `sock_release` runs for every socket
/// of the cgroup, and most never had a record. A `SOCK_REC` miss reads a
/// bucket the cookie's hash puts anywhere in the table (4 MiB of buckets at
/// the default capacity), which is a cache and TLB miss. The kernel hands
/// out cookies from a counter (`sock_gen_cookie`; per-CPU batches since
/// Linux 5.12, `include/linux/cookie.h`), so a fresh socket's cookie sits
/// next to the last ones in this array, on a line the CPU just used; a
/// count of 0 proves there is no record without touching the hash. More
/// live records than slots only make zero slots rarer: a non-zero slot
/// costs the lookup it saves otherwise, never a wrong answer.
pub const SOCK_REC_COUNT_SLOTS: u32 = 65_536;

/// `map_flags` of `SOCK_REC_COUNT`: `BPF_F_MMAPABLE` (1 << 10,
/// include/uapi/linux/bpf.h; Linux 5.5). The agent maps the array into its
/// memory (kernel/bpf/arraymap.c `array_map_mmap` maps the pages the
/// programs update) and changes a slot with an atomic read-modify-write,
/// as the programs do, where a `BPF_MAP_UPDATE_ELEM` of a value read
/// earlier could undo a concurrent connect's or release's update. Pins of
/// an older build keep a map without the flag; the agent then only raises
/// slots, as before.
pub const SOCK_REC_COUNT_FLAGS: u32 = 1 << 10;

/// What the agent adds to the slot of an uncounted record when it can
/// change slots atomically (see [`SOCK_REC_COUNT_FLAGS`]): above
/// [`SOCK_REC_UNCOUNTED`], so that the slot reads as covered, and a mark
/// of its own, so that the agent can take exactly this much back once
/// the slot holds no uncounted record. A slot that an older agent set to
/// [`SOCK_REC_UNCOUNTED`] with a plain write (which may have overwritten
/// increments) stays below it and is never lowered.
pub const SOCK_REC_UNCOUNTED_ADDED: u64 = 1 << 41;

/// The `SOCK_REC_COUNT` index of a cookie: its low bits.
#[inline(always)]
pub const fn sock_rec_count_slot(cookie: u64) -> u32 {
    (cookie & (SOCK_REC_COUNT_SLOTS as u64 - 1)) as u32
}

/// `SockRecValue::counted` of a record the connect program counted in
/// `SOCK_REC_COUNT`; the release program that deletes it takes the count
/// back. Any other value (0: a build without the count wrote it, or a
/// capacity migration copied it) was never counted.
pub const SOCK_REC_COUNTED: u8 = 1;

/// What the agent raises the slot of an uncounted record to (when it
/// adopts the pins of a build without `SOCK_REC_COUNT`, or after it copied
/// `SOCK_REC` into a resized map). No release subtracts for such a record,
/// and a release subtracts only what a connect added, at most one per
/// record of the slot (far fewer than 2^40: a billion records would take
/// over 100 GiB of kernel memory), so the slot never comes back to 0 and each such
/// record is still looked up and deleted at its release. A slot at or
/// above it is covered. On an array that cannot be mapped (an older
/// build's pins) the agent writes it with a plain map update that may
/// overwrite a concurrent increment, which is harmless for the same
/// reason; on a mapped one it adds [`SOCK_REC_UNCOUNTED_ADDED`] instead.
pub const SOCK_REC_UNCOUNTED: u64 = 1 << 40;

/// Reverse translation for one socket: which frontend a socket meant when
/// the kernel now reports the backend as its peer (getpeername, recvmsg).
/// Keyed by the socket cookie (`bpf_get_socket_cookie`) so that two sockets
/// talking to the same backend through different frontends stay apart.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockRevNatKey {
    /// The socket's cookie (`bpf_get_socket_cookie`).
    pub cookie: u64,
    /// The backend the socket was sent to, network byte order (IPv4 in the first word).
    pub ip_be: [u32; 4],
    /// The backend's port, network byte order.
    pub port_be: u16,
    /// `FAMILY_V4` or `FAMILY_V6`.
    pub family: u8,
    /// Two fields, see [`NpAffinityKey::_pad0`](crate::NpAffinityKey::_pad0): `connect4` builds this key
    /// on every translated connect.
    pub _pad0: u8,
    /// The rest of the padding (see `_pad0`).
    pub _pad1: u32,
}

impl SockRevNatKey {
    /// A key with its padding zeroed.
    #[inline(always)]
    pub fn new(cookie: u64, ip_be: [u32; 4], port_be: u16, family: u8) -> Self {
        Self { cookie, ip_be, port_be, family, _pad0: 0, _pad1: 0 }
    }
}

/// `SOCK_REVNAT` value: the frontend the socket dialled.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockRevNatValue {
    /// The frontend's address, network byte order (IPv4 in the first word).
    pub ip_be: [u32; 4],
    /// The frontend's port, network byte order.
    pub port_be: u16,
    /// `FAMILY_V4` or `FAMILY_V6`.
    pub family: u8,
    /// Padding, always zero.
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
    /// The backend, network byte order (IPv4 in the first word).
    pub backend_ip_be: [u32; 4],
    /// The frontend the socket dialled, network byte order.
    pub frontend_ip_be: [u32; 4],
    /// The backend's port, network byte order.
    pub backend_port_be: u16,
    /// The frontend's port, network byte order.
    pub frontend_port_be: u16,
    /// 0 while unset (a fresh storage element is zeroed by the kernel).
    pub family: u8,
    /// 1 when `SOCK_REVNAT` also holds entries for this socket.
    pub spilled: u8,
    /// Padding, always zero.
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
    /// The backend, network byte order (IPv4 in the first word).
    pub backend_ip_be: [u32; 4],
    /// The frontend the socket dialled, network byte order.
    pub frontend_ip_be: [u32; 4],
    /// The frontend's `ServiceValue::service_id` at connect() time.
    pub service_id: u32,
    /// The backend's port, network byte order.
    pub backend_port_be: u16,
    /// The frontend's port, network byte order.
    pub frontend_port_be: u16,
    /// `FAMILY_V4` or `FAMILY_V6`, of backend and frontend alike (a mapped
    /// IPv4 destination is recorded in IPv4 form).
    pub family: u8,
    /// `PROTO_TCP` or `PROTO_UDP`.
    pub proto: u8,
    /// [`SOCK_REC_COUNTED`] when the connect program that wrote the record
    /// counted it in `SOCK_REC_COUNT`; 0 otherwise (an older build's
    /// padding, or a copy made by a capacity migration).
    pub counted: u8,
    /// Padding, always zero.
    pub _pad: u8,
}

const _: () = {
    assert!(core::mem::size_of::<SockRevNatKey>() == 32);
    assert!(core::mem::size_of::<SockRevNatValue>() == 20);
    assert!(core::mem::size_of::<SockPeerValue>() == 40);
    assert!(core::mem::size_of::<SockRecValue>() == 44);
    assert!(core::mem::offset_of!(SockRecValue, counted) == SOCK_REC_COUNTED_OFFSET);
    assert!(SOCK_REC_COUNT_SLOTS.is_power_of_two());
};

/// Where `SockRecValue::counted` sits in the value's bytes (a capacity
/// migration clears it in the copies it makes).
pub const SOCK_REC_COUNTED_OFFSET: usize = 42;

#[cfg(feature = "user")]
mod pod {
    //! `aya::Pod` for the types above: each is `#[repr(C)]`, holds only
    //! integers and integer arrays (padding spelled out as `_pad` fields),
    //! and its fields add up to the size asserted above, so every byte is
    //! initialised and every bit pattern is a valid value (see the crate's
    //! `lib.rs`).

    use super::{SockPeerValue, SockRecValue, SockRevNatKey, SockRevNatValue};

    // SAFETY: repr(C) integers only; 16 + 16 + 4 + 2 + 2 + 1 + 1 + 1 + 1 (`_pad`) = 44 bytes, no padding.
    unsafe impl aya::Pod for SockRecValue {}
    // SAFETY: repr(C) integers only; 8 + 16 + 2 + 1 + 5 (`_pad`) = 32 bytes, no padding.
    unsafe impl aya::Pod for SockRevNatKey {}
    // SAFETY: repr(C) integers only; 16 + 2 + 1 + 1 (`_pad`) = 20 bytes, no padding.
    unsafe impl aya::Pod for SockRevNatValue {}
    // SAFETY: repr(C) integers only; 16 + 16 + 2 + 2 + 1 + 1 + 2 (`_pad`) = 40 bytes, no padding.
    unsafe impl aya::Pod for SockPeerValue {}
}
