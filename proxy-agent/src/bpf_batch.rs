//! `BPF_MAP_UPDATE_BATCH` and `BPF_MAP_DELETE_BATCH`: many map entries in
//! one bpf(2) call. aya 0.14 has no wrapper for them, so this is the raw
//! syscall. A cold sync of 10,000 Services writes some 200,000 entries;
//! one syscall per entry costs more than the hash map updates themselves.
//!
//! The kernel applies the elements in order and stops at the first one that
//! fails, reporting in `count` how many it applied before it
//! (kernel/bpf/syscall.c: generic_map_update_batch,
//! generic_map_delete_batch; hash maps use these since Linux 5.6). So a
//! failure leaves a clean prefix written, which callers rely on.

use std::io;
use std::mem::size_of;
use std::os::fd::{AsRawFd, BorrowedFd};

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
    // reads `count` elements of the map's key and value size from them,
    // which the callers guarantee by passing slices of the map's key and
    // value types (aya checked their sizes against the map when it was
    // opened).
    let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr as *mut BatchAttr, size_of::<BatchAttr>()) };
    if rc != 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
}

/// Writes `keys[i] -> values[i]` in order, with `BPF_ANY` (create or
/// replace) semantics. `K` and `V` must be the map's key and value types.
pub fn update<K: aya::Pod, V: aya::Pod>(map: BorrowedFd<'_>, keys: &[K], values: &[V]) -> Result<(), BatchError> {
    assert_eq!(keys.len(), values.len(), "one value per key");
    let mut done = 0;
    while done < keys.len() {
        let n = (keys.len() - done).min(MAX_PER_CALL);
        let mut attr = BatchAttr {
            keys: keys[done..].as_ptr() as u64,
            values: values[done..].as_ptr() as u64,
            count: n as u32,
            map_fd: map.as_raw_fd() as u32,
            ..Default::default()
        };
        let r = call(BPF_MAP_UPDATE_BATCH, &mut attr);
        // On error the kernel still reports how many it applied.
        let applied = (attr.count as usize).min(n);
        match r {
            Ok(()) => done += n,
            Err(source) => return Err(BatchError { applied: done + applied, source }),
        }
    }
    Ok(())
}

/// Deletes `keys` in order. A key that is not in the map is skipped (the
/// kernel stops a delete batch at the first ENOENT; the call resumes after
/// it). Any other error stops at the key it names, as for [`update`].
pub fn delete<K: aya::Pod>(map: BorrowedFd<'_>, keys: &[K]) -> Result<(), BatchError> {
    let mut done = 0;
    while done < keys.len() {
        let n = (keys.len() - done).min(MAX_PER_CALL);
        let mut attr = BatchAttr {
            keys: keys[done..].as_ptr() as u64,
            count: n as u32,
            map_fd: map.as_raw_fd() as u32,
            ..Default::default()
        };
        let r = call(BPF_MAP_DELETE_BATCH, &mut attr);
        let applied = (attr.count as usize).min(n);
        match r {
            Ok(()) => done += n,
            // Skip the missing key and go on with the rest.
            Err(e) if e.kind() == io::ErrorKind::NotFound && applied < n => done += applied + 1,
            Err(source) => return Err(BatchError { applied: done + applied, source }),
        }
    }
    Ok(())
}
