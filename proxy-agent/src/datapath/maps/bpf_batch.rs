//! Whole-map I/O on hash maps: `BPF_MAP_UPDATE_BATCH`,
//! `BPF_MAP_DELETE_BATCH` and `BPF_MAP_LOOKUP_BATCH` (many entries in one
//! bpf(2) call), and [`read_all`], the one way the agent reads a hash map
//! whole. aya 0.14 has no wrapper for the batch commands, so this is the raw
//! syscall. A cold sync of 10,000 Services writes some 200,000 entries, and
//! an agent restart reads them back; one syscall per entry (two when
//! iterating) costs more than the hash map operations themselves.
//!
//! The kernel applies the elements in order and stops at the first one that
//! fails, reporting in `count` how many it applied before it
//! (kernel/bpf/syscall.c: generic_map_update_batch,
//! generic_map_delete_batch; hash maps use these since Linux 5.6). So a
//! failure leaves a clean prefix written, which callers rely on.
//!
//! The kernel reads and writes `count` keys and values of the sizes *it*
//! knows for the map. Every call therefore takes a typed aya handle and
//! first asks the kernel (`BPF_OBJ_GET_INFO_BY_FD`) that the map is a plain
//! or LRU hash map whose key and value sizes are those of `K` and `V`: aya
//! checks the sizes against the map's definition in the object it was
//! loaded from, which for a map reused from a pin need not be the kernel's,
//! and per-CPU maps would take one value per possible CPU.
//!
//! A kernel without the batch commands (before 5.6, or built without them)
//! gets the same semantics one element per call: the kernel probe
//! (`batch_ops` in `kernel_features`) decides once, so no write
//! tries a batch first and falls back on every call.

use std::borrow::{Borrow, BorrowMut};
use std::hash::Hash;
use std::io;
use std::marker::PhantomData;
use std::mem::size_of;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};

use aya::Pod;
use aya::maps::{Array, HashMap, IterableMap, MapData, MapError, MapType};

use crate::datapath::loader::kernel_features::{self, KernelFeatures};

/// The `batch` member of `union bpf_attr` (include/uapi/linux/bpf.h).
#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    /// In: elements passed; out: elements applied.
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

pub(crate) const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
pub(crate) const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
pub(crate) const BPF_MAP_DELETE_ELEM: libc::c_long = 3;
pub(crate) const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;
const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;
const BPF_MAP_DELETE_BATCH: libc::c_long = 27;

/// A batch call that stopped early: the first `applied` elements took
/// effect, the element at index `applied` failed with `source` (when
/// `applied` is less than the number passed) and the rest were not tried.
#[derive(Debug, thiserror::Error)]
#[error("{source} after {applied} elements")]
pub struct BatchError {
    /// How many elements the kernel applied before the error (`count` of the batch attribute).
    pub applied: usize,
    /// The error of the call that stopped.
    pub source: io::Error,
}

/// The kernel takes `count` as a u32; larger inputs go in several calls.
const MAX_PER_CALL: usize = 1 << 20;

/// A map descriptor the kernel confirmed to be a plain or LRU hash map
/// (or, from [`checked_array`], a plain array) with keys of exactly
/// `size_of::<K>()` and values of exactly `size_of::<V>()` bytes. Only
/// [`checked`] and [`checked_array`] make one.
struct Checked<'a, K, V> {
    fd: BorrowedFd<'a>,
    _kv: PhantomData<(K, V)>,
}

fn checked<T: Borrow<MapData>, K: Pod, V: Pod>(map: &HashMap<T, K, V>) -> io::Result<Checked<'_, K, V>> {
    let data = map.map();
    let info = data.info().map_err(io::Error::other)?;
    let map_type = info.map_type().map_err(io::Error::other)?;
    let (key_size, value_size) = (info.key_size() as usize, info.value_size() as usize);
    if !matches!(map_type, MapType::Hash | MapType::LruHash) || key_size != size_of::<K>() || value_size != size_of::<V>() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "map is a {map_type:?} with {key_size}/{value_size}-byte keys/values, not a hash map of {}/{}-byte ones",
                size_of::<K>(),
                size_of::<V>()
            ),
        ));
    }
    Ok(Checked { fd: data.fd().as_fd(), _kv: PhantomData })
}

/// [`checked`] for a plain array map, whose keys are `u32` indices.
fn checked_array<T: Borrow<MapData>, V: Pod>(map: &Array<T, V>) -> io::Result<Checked<'_, u32, V>> {
    let data = map.map();
    let info = data.info().map_err(io::Error::other)?;
    let map_type = info.map_type().map_err(io::Error::other)?;
    let (key_size, value_size) = (info.key_size() as usize, info.value_size() as usize);
    if !matches!(map_type, MapType::Array) || key_size != size_of::<u32>() || value_size != size_of::<V>() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("map is a {map_type:?} with {key_size}/{value_size}-byte keys/values, not an array of {}-byte values", size_of::<V>()),
        ));
    }
    Ok(Checked { fd: data.fd().as_fd(), _kv: PhantomData })
}

/// Issues one batch command.
///
/// # Safety
///
/// `attr.map_fd` must be a map whose key and value sizes are `key_size` and
/// `value_size` bytes, no per-CPU type, and `attr.keys` (and `attr.values`,
/// unless the command is a delete) must point at buffers of at least
/// `attr.count` such keys (values) that are valid for the kernel to read
/// (update, delete) or write (lookup) for the duration of the call; so must
/// `attr.in_batch` and `attr.out_batch` when non-zero, with room for the
/// map's batch position.
unsafe fn call(cmd: libc::c_long, attr: &mut BatchAttr) -> Result<(), io::Error> {
    // SAFETY: `attr` is a valid `bpf_attr` prefix for the batch commands of
    // the size passed, and the buffers it names are as the caller promised.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, std::ptr::from_mut::<BatchAttr>(attr), size_of::<BatchAttr>()) };
    if rc != 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
}

/// Writes `keys[i] -> values[i]` in order, with `BPF_ANY` (create or
/// replace) semantics.
pub fn update<T: BorrowMut<MapData>, K: Pod, V: Pod>(map: &mut HashMap<T, K, V>, keys: &[K], values: &[V]) -> Result<(), BatchError> {
    assert_eq!(keys.len(), values.len(), "one value per key");
    let map = checked(map).map_err(|source| BatchError { applied: 0, source })?;
    in_order(BPF_MAP_UPDATE_BATCH, map, keys, Some(values), false)
}

/// Writes `values[i]` at `indices[i]` of an array map, in order, in one
/// call where the kernel takes batches (array maps have taken
/// `BPF_MAP_UPDATE_BATCH` since the hash maps did, kernel/bpf/arraymap.c:
/// `generic_map_update_batch`). Same prefix semantics as [`update`].
pub fn update_array<T: BorrowMut<MapData>, V: Pod>(map: &mut Array<T, V>, indices: &[u32], values: &[V]) -> Result<(), BatchError> {
    assert_eq!(indices.len(), values.len(), "one value per index");
    let map = checked_array(map).map_err(|source| BatchError { applied: 0, source })?;
    in_order(BPF_MAP_UPDATE_BATCH, map, indices, Some(values), false)
}

/// Deletes `keys` in order. A key that is not in the map is skipped (the
/// kernel stops a delete batch at the first ENOENT; the call resumes after
/// it). Any other error stops at the key it names, as for [`update`].
pub fn delete<T: BorrowMut<MapData>, K: Pod, V: Pod>(map: &mut HashMap<T, K, V>, keys: &[K]) -> Result<(), BatchError> {
    let map = checked(map).map_err(|source| BatchError { applied: 0, source })?;
    in_order(BPF_MAP_DELETE_BATCH, map, keys, None, true)
}

/// Runs `cmd` over `keys` (and `values`, of the same length) in order, in
/// calls of at most [`MAX_PER_CALL`] elements. With `skip_missing`, an
/// element the kernel reports missing (ENOENT) is stepped over and the rest
/// go on.
fn in_order<K: Pod, V: Pod>(
    cmd: libc::c_long,
    map: Checked<'_, K, V>,
    keys: &[K],
    values: Option<&[V]>,
    skip_missing: bool,
) -> Result<(), BatchError> {
    if !KernelFeatures::get().has(kernel_features::BATCH_OPS) {
        return one_by_one(cmd, &map, keys, values, skip_missing);
    }
    let len = keys.len();
    let mut done = 0;
    let mut pauses = ENOMEM_PAUSES.iter();
    while done < len {
        let n = (len - done).min(MAX_PER_CALL);
        let mut attr = BatchAttr {
            keys: keys[done..].as_ptr() as u64,
            values: values.map_or(0, |v| v[done..].as_ptr() as u64),
            count: n as u32,
            map_fd: map.fd.as_raw_fd() as u32,
            ..Default::default()
        };
        // SAFETY: `map` was checked to be a map (hash or array) of `K` keys and `V`
        // values; `keys[done..]` (and `values[done..]`, as long as `keys`)
        // hold at least `n` of them and outlive the call, which only reads
        // them. Deletes pass no values and the kernel reads none.
        let r = unsafe { call(cmd, &mut attr) };
        // On error the kernel still reports how many it applied.
        let applied = (attr.count as usize).min(n);
        match r {
            Ok(()) => done += n,
            Err(e) if skip_missing && e.kind() == io::ErrorKind::NotFound && applied < n => done += applied + 1,
            Err(e)
                if cmd == BPF_MAP_UPDATE_BATCH
                    && e.raw_os_error() == Some(libc::ENOMEM)
                    && let Some(pause) = pauses.next() =>
            {
                done += applied;
                std::thread::sleep(*pause);
            }
            Err(source) => return Err(BatchError { applied: done + applied, source }),
        }
    }
    Ok(())
}

/// The pauses before an update is tried again after ENOMEM, from the
/// element the kernel stopped at. A map without preallocation
/// (`BPF_F_NO_PREALLOC`: SERVICES and the other hashes sized by Services)
/// takes each new element from a per-CPU cache that an irq_work refills
/// with GFP_NOWAIT pages (kernel/bpf/memalloc.c); under memory pressure a
/// refill can fail for a moment and the update gets ENOMEM although the
/// map has room (seen in CI on a loaded 2-core VM, batch_writer.rs). A
/// failure that outlasts these pauses is reported as before.
const ENOMEM_PAUSES: [std::time::Duration; 3] =
    [std::time::Duration::from_millis(1), std::time::Duration::from_millis(10), std::time::Duration::from_millis(100)];

/// [`in_order`] without the batch commands: the element commands, with the
/// same prefix semantics (stop at the first failure, report how many took
/// effect).
fn one_by_one<K: Pod, V: Pod>(
    cmd: libc::c_long,
    map: &Checked<'_, K, V>,
    keys: &[K],
    values: Option<&[V]>,
    skip_missing: bool,
) -> Result<(), BatchError> {
    let elem_cmd = if cmd == BPF_MAP_UPDATE_BATCH { BPF_MAP_UPDATE_ELEM } else { BPF_MAP_DELETE_ELEM };
    let mut pauses = ENOMEM_PAUSES.iter();
    for (i, key) in keys.iter().enumerate() {
        let value = values.map_or(std::ptr::null_mut(), |v| std::ptr::from_ref(&v[i]).cast_mut().cast::<u8>());
        loop {
            // SAFETY: `map` was checked to be a map (hash or array) of `K` keys and `V`
            // values; `key` and `value` point at one of each (no value for a
            // delete), alive across the call, which only reads them.
            match unsafe { elem(elem_cmd, map.fd.as_fd(), std::ptr::from_ref(key).cast::<u8>(), value, 0) } {
                Ok(()) => break,
                Err(source) if skip_missing && source.kind() == io::ErrorKind::NotFound => break,
                Err(source) if elem_cmd == BPF_MAP_UPDATE_ELEM && source.raw_os_error() == Some(libc::ENOMEM) => match pauses.next() {
                    Some(pause) => std::thread::sleep(*pause),
                    None => return Err(BatchError { applied: i, source }),
                },
                Err(source) => return Err(BatchError { applied: i, source }),
            }
        }
    }
    Ok(())
}

/// The element member of `union bpf_attr` (`BPF_MAP_*_ELEM`,
/// `BPF_MAP_GET_NEXT_KEY`, where `value` is the next key).
#[repr(C)]
struct ElemAttr {
    map_fd: u32,
    pad: u32,
    key: u64,
    value: u64,
    flags: u64,
}

/// One element command (`BPF_MAP_LOOKUP_ELEM`, `_UPDATE_ELEM`,
/// `_DELETE_ELEM`, `BPF_MAP_GET_NEXT_KEY`) on the map `fd`, as a raw
/// syscall: it needs no `&mut` map, so several threads may call it on one
/// map at once (`maglev_tables`), and it works on maps aya has no type for
/// (`map_migration`).
///
/// # Safety
/// `key` points at a key of the map's key size and `value` (null for a
/// delete) at a buffer of its value size (its key size for
/// `BPF_MAP_GET_NEXT_KEY`), both alive across the call; the kernel reads
/// the key and writes at most one value or key into `value`.
pub(crate) unsafe fn elem(cmd: libc::c_long, fd: BorrowedFd<'_>, key: *const u8, value: *mut u8, flags: u64) -> io::Result<()> {
    let mut attr = ElemAttr { map_fd: fd.as_raw_fd() as u32, pad: 0, key: key as u64, value: value as u64, flags };
    // SAFETY: the caller vouches for the buffers (see above); `attr` is a
    // complete element member of `union bpf_attr`.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, std::ptr::from_mut(&mut attr), size_of::<ElemAttr>()) };
    if rc == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
}

/// Deletes `key` from the map behind `fd` (`BPF_MAP_DELETE_ELEM`); the
/// caller knows the map's key type to be `K`.
pub(crate) fn delete_elem<K: Pod>(fd: BorrowedFd<'_>, key: &K) -> io::Result<()> {
    // SAFETY: `key` is a live `K`, the map's key type; a delete reads the
    // key only and takes no value.
    unsafe { elem(BPF_MAP_DELETE_ELEM, fd, std::ptr::from_ref(key).cast(), std::ptr::null_mut(), 0) }
}

/// Entries asked for per lookup call at first; doubled when one hash
/// bucket holds more (ENOSPC).
const LOOKUP_PER_CALL: usize = 8192;

/// Every entry of a hash map in `BPF_MAP_LOOKUP_BATCH` calls, in the
/// kernel's order. The kernel reads bucket by bucket (kernel/bpf/hashtab.c:
/// __htab_map_lookup_and_delete_batch), so each key comes once and the read
/// ends however busy the map is; entries changed during the read may or may
/// not be seen. An error means the kernel cannot batch this map (hash maps
/// can since Linux 5.6): [`read_all`] then walks it key by key.
pub fn lookup_all<T: Borrow<MapData>, K: Pod, V: Pod>(map: &HashMap<T, K, V>) -> io::Result<Vec<(K, V)>> {
    if !KernelFeatures::get().has(kernel_features::BATCH_OPS) {
        return Err(io::Error::from(io::ErrorKind::Unsupported));
    }
    let map = checked(map)?;
    let mut per_call = LOOKUP_PER_CALL;
    // SAFETY: aya::Pod types are plain data for which every bit pattern,
    // all-zero included, is a valid value; the kernel overwrites the ones
    // it reports.
    let zero_k: K = unsafe { std::mem::zeroed() };
    // SAFETY: as for `zero_k`.
    let zero_v: V = unsafe { std::mem::zeroed() };
    let mut keys = vec![zero_k; per_call];
    let mut values = vec![zero_v; per_call];
    // The resume position: a bucket index (u32) for hash maps
    // (kernel/bpf/hashtab.c); opaque here, and sized as generously as the
    // kernel's generic batch code (a key) would need.
    let token_len = size_of::<K>().max(size_of::<u64>()).div_ceil(8);
    let mut token_in = vec![0u64; token_len];
    let mut token_out = vec![0u64; token_len];
    let mut first = true;
    let mut out = Vec::new();
    loop {
        let mut attr = BatchAttr {
            in_batch: if first { 0 } else { token_in.as_mut_ptr() as u64 },
            out_batch: token_out.as_mut_ptr() as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: per_call as u32,
            map_fd: map.fd.as_raw_fd() as u32,
            ..Default::default()
        };
        // SAFETY: `map` was checked to be a hash map of `K` keys and `V`
        // values; `keys` and `values` hold `per_call` of each and the batch
        // tokens at least a key's size (more than the bucket index a hash
        // map keeps there), all owned here and alive across the call.
        let r = unsafe { call(BPF_MAP_LOOKUP_BATCH, &mut attr) };
        let got = (attr.count as usize).min(per_call);
        out.extend(keys[..got].iter().copied().zip(values[..got].iter().copied()));
        match r {
            Ok(()) => {
                std::mem::swap(&mut token_in, &mut token_out);
                first = false;
            }
            // The end of the map; the last call may still have returned some.
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(out),
            // One hash bucket holds more entries than we asked for: ask
            // again from the same position with room for more.
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) && got == 0 && per_call < MAX_PER_CALL => {
                per_call *= 2;
                keys.resize(per_call, zero_k);
                values.resize(per_call, zero_v);
            }
            Err(e) => return Err(e),
        }
    }
}

/// Every entry of a hash map (plain or LRU), each key once: [`lookup_all`]
/// where the kernel can batch the map, a key-by-key walk where it cannot.
/// An entry deleted between the walk's key and its lookup is left out; any
/// other error is returned.
///
/// The walk is bounded, so that a busy map (a live agent writing, an LRU
/// map evicting) cannot keep it going forever: when the key the walk stands
/// on is deleted, `BPF_MAP_GET_NEXT_KEY` starts over from the first key
/// (kernel/bpf/hashtab.c: htab_map_get_next_key). It stops after twice the
/// map's capacity and keeps the last value read for a key seen twice.
pub fn read_all<T: Borrow<MapData>, K: Pod + Eq + Hash, V: Pod>(map: &HashMap<T, K, V>) -> Result<Vec<(K, V)>, MapError> {
    if let Ok(all) = lookup_all(map) {
        return Ok(all);
    }
    let capacity = map.map().info()?.max_entries();
    let bound = (capacity as usize).saturating_mul(2).saturating_add(16);
    let mut seen: std::collections::HashMap<K, V> = std::collections::HashMap::new();
    for item in map.iter().take(bound) {
        match item {
            Ok((k, v)) => {
                seen.insert(k, v);
            }
            Err(e) if is_not_found(&e) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(seen.into_iter().collect())
}

/// Whether a map operation failed because the key is not (or no longer)
/// in the map.
pub fn is_not_found(e: &MapError) -> bool {
    matches!(e, MapError::KeyNotFound) || matches!(e, MapError::SyscallError(s) if s.io_error.raw_os_error() == Some(libc::ENOENT))
}
