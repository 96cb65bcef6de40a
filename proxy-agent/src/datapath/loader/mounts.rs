//! Finding the cgroup v2 hierarchy and making sure a BPF filesystem is
//! mounted where pins go.
//!
//! Nodes differ: systemd's unified layout mounts cgroup2 at /sys/fs/cgroup,
//! the hybrid layout at /sys/fs/cgroup/unified, container runtimes elsewhere.
//! /proc/self/mountinfo is the only reliable answer.

use std::ffi::CString;
use std::fs;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// `BPF_FS_MAGIC` from include/uapi/linux/magic.h.
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

/// The bpffs or the cgroup2 filesystem is not usable.
#[derive(Debug, thiserror::Error)]
pub enum MountError {
    /// No cgroup2 mount to attach the socket programs to.
    #[error("no cgroup2 filesystem is mounted (checked /proc/self/mountinfo); pass --cgroup")]
    NoCgroup2,
    /// `/proc/self/mountinfo` could not be read.
    #[error("cannot read /proc/self/mountinfo: {0}")]
    MountInfo(io::Error),
    /// A bpffs could not be mounted where the pin directory needs one.
    #[error("cannot mount bpffs at {path}: {source}")]
    MountBpffs {
        /// Where the mount was tried.
        path: PathBuf,
        /// Why mount(2) failed.
        source: io::Error,
    },
    /// A directory could not be made.
    #[error("cannot create {path}: {source}")]
    Create {
        /// The directory.
        path: PathBuf,
        /// Why mkdir failed.
        source: io::Error,
    },
    /// The pin directory is not on a bpffs, the only filesystem the kernel pins objects on
    /// (kernel/bpf/inode.c, `bpf_obj_do_pin`).
    #[error("{path} is not on a BPF filesystem (bpffs); pins there would not survive")]
    NotBpffs {
        /// The pin directory.
        path: PathBuf,
    },
    /// The pin directory belongs to another user, who could replace what the agent pins there.
    #[error(
        "refusing pin directory {path}: it is owned by uid {owner}, not by this agent's uid {ours}; another user could have placed or could replace maps and links there. Remove it (or chown it to uid {ours}) if it is yours"
    )]
    ForeignOwner {
        /// The pin directory.
        path: PathBuf,
        /// Its owner's uid.
        owner: u32,
        /// The agent's uid.
        ours: u32,
    },
    /// The pin directory's mode could not be set to 0700.
    #[error("cannot make pin directory {path} private (mode 0700): {source}")]
    Permissions {
        /// The pin directory.
        path: PathBuf,
        /// Why chmod failed.
        source: io::Error,
    },
}

/// The mount point of the first cgroup2 filesystem in `mountinfo` text.
pub fn cgroup2_root_from(mountinfo: &str) -> Option<PathBuf> {
    mountinfo.lines().find_map(|line| {
        // Fields: id parent major:minor root mountpoint options [optional...] - fstype source superopts
        let (left, right) = line.split_once(" - ")?;
        let fstype = right.split_whitespace().next()?;
        if fstype != "cgroup2" {
            return None;
        }
        let mountpoint = left.split_whitespace().nth(4)?;
        Some(PathBuf::from(unescape(mountpoint)))
    })
}

/// mountinfo escapes space, tab, newline and backslash as three octal
/// digits (\040 ...), see fs/proc_namespace.c:show_mountinfo.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 4 <= b.len() {
            let digits = &b[i + 1..i + 4];
            if digits.iter().all(|c| (b'0'..=b'7').contains(c)) {
                let v = digits.iter().fold(0u32, |acc, c| acc * 8 + u32::from(c - b'0'));
                if let Ok(byte) = u8::try_from(v) {
                    out.push(byte);
                    i += 4;
                    continue;
                }
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Where the cgroup2 filesystem is mounted (`/sys/fs/cgroup` or, on hybrid hosts,
/// `/sys/fs/cgroup/unified`), from `/proc/self/mountinfo`.
pub fn cgroup2_root() -> Result<PathBuf, MountError> {
    let text = fs::read_to_string("/proc/self/mountinfo").map_err(MountError::MountInfo)?;
    cgroup2_root_from(&text).ok_or(MountError::NoCgroup2)
}

fn statfs_type(path: &Path) -> io::Result<i64> {
    let c = CString::new(path.as_os_str().as_bytes()).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    // SAFETY: `struct statfs` is plain integers, for which all-zero bytes
    // are a valid value.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `st` a `struct statfs` we
    // own; statfs(2) writes only into it.
    if unsafe { libc::statfs(c.as_ptr(), &raw mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st.f_type as i64)
}

/// Whether `path` lies on a bpffs (statfs(2) `f_type` is `BPF_FS_MAGIC`).
pub fn is_bpffs(path: &Path) -> bool {
    statfs_type(path).is_ok_and(|t| t == BPF_FS_MAGIC)
}

/// Makes `pin_dir` exist on a bpffs. When the nearest existing ancestor is
/// `/sys/fs/bpf` (or any directory) without a bpffs, a bpffs is mounted on
/// the pin directory's parent, as kubelet-less hosts and fresh VMs lack one.
pub fn ensure_pin_dir(pin_dir: &Path) -> Result<(), MountError> {
    let parent = pin_dir.parent().unwrap_or(Path::new("/"));
    if !parent.exists() {
        fs::create_dir_all(parent).map_err(|source| MountError::Create { path: parent.into(), source })?;
    }
    if !is_bpffs(parent) && !is_bpffs(pin_dir) {
        mount_bpffs(parent)?;
    }
    if !pin_dir.exists() {
        fs::create_dir_all(pin_dir).map_err(|source| MountError::Create { path: pin_dir.into(), source })?;
    }
    if !is_bpffs(pin_dir) {
        return Err(MountError::NotBpffs { path: pin_dir.into() });
    }
    make_private(pin_dir)
}

/// Refuses a pin directory another user owns, and makes ours reachable by
/// its owner only.
///
/// A bpffs mounts world-writable with the sticky bit (mode 1777 unless
/// `mode=` says otherwise, kernel/bpf/inode.c `bpf_fill_super`), so any
/// user may create the pin directory before the agent does, or a symlink
/// in its place (checked without following it); the owner of the directory
/// can then rename, replace or remove the agent's pins (the sticky bit
/// protects entries only from users who own neither them nor the
/// directory). The pins themselves get mode 0600 less the umask
/// (`bpf_obj_pin_user`), but a directory made with the default umask is
/// 0755 and lets every user list what the datapath holds; 0700 keeps the
/// pins and the links below out of reach of anyone but root.
fn make_private(pin_dir: &Path) -> Result<(), MountError> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let meta = fs::symlink_metadata(pin_dir).map_err(|source| MountError::Create { path: pin_dir.into(), source })?;
    // SAFETY: geteuid has no preconditions.
    let ours = unsafe { libc::geteuid() };
    if meta.uid() != ours {
        return Err(MountError::ForeignOwner { path: pin_dir.into(), owner: meta.uid(), ours });
    }
    if meta.mode() & 0o7777 != 0o700 {
        fs::set_permissions(pin_dir, fs::Permissions::from_mode(0o700))
            .map_err(|source| MountError::Permissions { path: pin_dir.into(), source })?;
    }
    Ok(())
}

fn mount_bpffs(at: &Path) -> Result<(), MountError> {
    let err = |source| MountError::MountBpffs { path: at.into(), source };
    let target = CString::new(at.as_os_str().as_bytes()).map_err(|e| err(io::Error::new(io::ErrorKind::InvalidInput, e)))?;
    let fstype = c"bpf";
    // SAFETY: all pointers are valid NUL-terminated strings for the call.
    let rc = unsafe { libc::mount(fstype.as_ptr(), target.as_ptr(), fstype.as_ptr(), 0, std::ptr::null()) };
    if rc != 0 {
        return Err(err(io::Error::last_os_error()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_cgroup2_in_hybrid_and_unified_layouts() {
        let hybrid = "25 30 0:22 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755\n\
                      26 25 0:23 / /sys/fs/cgroup/unified rw,nosuid shared:9 - cgroup2 cgroup2 rw\n";
        assert_eq!(cgroup2_root_from(hybrid), Some(PathBuf::from("/sys/fs/cgroup/unified")));
        let unified = "31 24 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate\n";
        assert_eq!(cgroup2_root_from(unified), Some(PathBuf::from("/sys/fs/cgroup")));
        assert_eq!(cgroup2_root_from("1 0 0:1 / / rw - ext4 /dev/vda rw\n"), None);
        let escaped = "26 25 0:23 / /mnt/my\\040cg rw - cgroup2 cgroup2 rw\n";
        assert_eq!(cgroup2_root_from(escaped), Some(PathBuf::from("/mnt/my cg")));
    }
}
