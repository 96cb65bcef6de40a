//! `BPF_MAP_UPDATE_BATCH`, `BPF_MAP_DELETE_BATCH` and
//! `BPF_MAP_LOOKUP_BATCH`: many map entries in one bpf(2) call. aya 0.14
//! has no wrapper for them, so this is the raw syscall. A cold sync of
//! 10,000 Services writes some 200,000 entries, and an agent restart reads
//! them back; one syscall per entry (two when iterating) costs more than
//! the hash map operations themselves.
//!
//! The kernel applies the elements in order and stops at the first one that
//! fails, reporting in `count` how many it applied before it
//! (kernel/bpf/syscall.c: generic_map_update_batch,
//! generic_map_delete_batch; hash maps use these since Linux 5.6). So a
//! failure leaves a clean prefix written, which callers rely on.

use std::borrow::Borrow;
use std::io;
use std::mem::size_of;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};

use aya::maps::{HashMap, IterableMap, MapData};

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

const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;
const BPF_MAP_DELETE_BATCH: libc::c_long = 27;

/// A batch call that stopped early: the first `applied` elements took
/// effect, the element at index `applied` failed with `source` (when
/// `applied` is less than the number passed) and the rest were not tried.
#[derive(Debug, thiserror::Error)]
#[error("{source} after {applied} elements")]
pub struct BatchError {
    pub applied: usize,
    pub source: io::Error,
}

/// The kernel takes `count` as a u32; larger inputs go in several calls.
const MAX_PER_CALL: usize = 1 << 20;

fn call(cmd: libc::c_long, attr: &mut BatchAttr) -> Result<(), io::Error> {
    // SAFETY: `attr` is a valid `bpf_attr` prefix for the batch commands
    // and the key/value buffers it points at outlive the call; the kernel
    // reads (update, delete) or writes (lookup) `count` elements of the
    // map's key and value size there, which the callers guarantee by
    // passing buffers of the map's key and value types (aya checked their
    // sizes against the map when it was opened).
    let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, std::ptr::from_mut::<BatchAttr>(attr), size_of::<BatchAttr>()) };
    if rc != 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
}

/// Writes `keys[i] -> values[i]` in order, with `BPF_ANY` (create or
/// replace) semantics. `K` and `V` must be the map's key and value types.
pub fn update<K: aya::Pod, V: aya::Pod>(map: BorrowedFd<'_>, keys: &[K], values: &[V]) -> Result<(), BatchError> {
    assert_eq!(keys.len(), values.len(), "one value per key");
    in_order(BPF_MAP_UPDATE_BATCH, map, keys.len(), |i| (keys[i..].as_ptr() as u64, values[i..].as_ptr() as u64), false)
}

/// Deletes `keys` in order. A key that is not in the map is skipped (the
/// kernel stops a delete batch at the first ENOENT; the call resumes after
/// it). Any other error stops at the key it names, as for [`update`].
pub fn delete<K: aya::Pod>(map: BorrowedFd<'_>, keys: &[K]) -> Result<(), BatchError> {
    in_order(BPF_MAP_DELETE_BATCH, map, keys.len(), |i| (keys[i..].as_ptr() as u64, 0), true)
}

/// Runs `cmd` over `len` elements in order, in calls of at most
/// [`MAX_PER_CALL`]; `from(i)` gives the key and value buffers from element
/// `i` on. With `skip_missing`, an element the kernel reports missing
/// (ENOENT) is stepped over and the rest go on.
fn in_order(
    cmd: libc::c_long,
    map: BorrowedFd<'_>,
    len: usize,
    from: impl Fn(usize) -> (u64, u64),
    skip_missing: bool,
) -> Result<(), BatchError> {
    let mut done = 0;
    while done < len {
        let n = (len - done).min(MAX_PER_CALL);
        let (keys, values) = from(done);
        let mut attr = BatchAttr { keys, values, count: n as u32, map_fd: map.as_raw_fd() as u32, ..Default::default() };
        let r = call(cmd, &mut attr);
        // On error the kernel still reports how many it applied.
        let applied = (attr.count as usize).min(n);
        match r {
            Ok(()) => done += n,
            Err(e) if skip_missing && e.kind() == io::ErrorKind::NotFound && applied < n => done += applied + 1,
            Err(source) => return Err(BatchError { applied: done + applied, source }),
        }
    }
    Ok(())
}

/// Entries asked for per lookup call at first; doubled when one hash
/// bucket holds more (ENOSPC).
const LOOKUP_PER_CALL: usize = 8192;

/// Every entry of a hash or array map, in the kernel's order. `K` and `V`
/// must be the map's key and value types. Entries changed during the read
/// may or may not be seen, as with key-by-key iteration; an error means the
/// kernel cannot batch this map (hash maps can since Linux 5.6), and the
/// caller iterates instead.
pub fn lookup_all<K: aya::Pod, V: aya::Pod>(map: BorrowedFd<'_>) -> io::Result<Vec<(K, V)>> {
    let mut per_call = LOOKUP_PER_CALL;
    // SAFETY: aya::Pod types are plain data for which all-zero bytes are a
    // valid value; the kernel overwrites the ones it reports.
    let zero_k: K = unsafe { std::mem::zeroed() };
    let zero_v: V = unsafe { std::mem::zeroed() };
    let mut keys = vec![zero_k; per_call];
    let mut values = vec![zero_v; per_call];
    // The resume position: a bucket index (u32) for hash maps, a key for
    // arrays (kernel/bpf/hashtab.c, kernel/bpf/syscall.c
    // generic_map_lookup_batch); opaque here, so sized for either.
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
            map_fd: map.as_raw_fd() as u32,
            ..Default::default()
        };
        let r = call(BPF_MAP_LOOKUP_BATCH, &mut attr);
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

/// Every entry of a hash map (plain or LRU): [`lookup_all`] where the
/// kernel can batch it, key-by-key iteration where it cannot. Entries that
/// cannot be read are left out, as iteration leaves them out.
pub fn read_all<T: Borrow<MapData>, K: aya::Pod, V: aya::Pod>(map: &HashMap<T, K, V>) -> Vec<(K, V)> {
    lookup_all(map.map().fd().as_fd()).unwrap_or_else(|_| map.iter().filter_map(Result::ok).collect())
}
