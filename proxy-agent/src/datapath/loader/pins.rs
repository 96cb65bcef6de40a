//! The pin directory's layout, in one place: every path the agent pins
//! under it, or looks for there, is made here.
//!
//! ```text
//! <pin dir>/                   (--bpffs, default /sys/fs/bpf/topoproxy)
//!   SERVICES, SLOTS, ...       every map by its object name (proxy-common's *_MAP)
//!   SERVICES-next, ...         a map being resized (map_migration), renamed over its pin
//!   links/
//!     connect4, ..., sock_release     the socket programs' cgroup links
//!     connect4-next, ...              a link being replaced, renamed over its pin
//!     tc-<device>-ingress|egress      the TC programs' tcx links
//!     xdp-<device>                    the XDP program's links
//!   tc-legacy/
//!     <device>-<hook>@netns<inode>    a cls_bpf filter of ours (an empty directory)
//! ```
//!
//! This layout is what an upgraded agent adopts: a map found at its name is
//! reused with every entry (aya's `EbpfLoader::map_pin_path`), and a link
//! found at its name is replaced in place. Renaming anything here strands
//! the pins of the version before, so a change needs a migration.
//!
//! bpffs refuses names with a dot (kernel/bpf/inode.c, `bpf_lookup`), hence
//! the `-next` suffix for staged pins.

use std::path::{Path, PathBuf};

/// The pin directory when `--bpffs` is not given: `topoproxy` on the
/// bpffs that systemd and most distributions mount at `/sys/fs/bpf`.
pub const DEFAULT_PIN_DIR: &str = "/sys/fs/bpf/topoproxy";

/// Sub-directory of the pin directory that holds the program links.
pub const LINKS_DIR: &str = "links";

/// Sub-directory of the pin directory that records our legacy cls_bpf
/// filters (bpffs holds no regular files, so each record is a directory).
pub const TC_LEGACY_DIR: &str = "tc-legacy";

/// Suffix of a staged pin: a map or link made beside the one it replaces.
const STAGED_SUFFIX: &str = "-next";

/// Prefix of the TC programs' link pins in [`LINKS_DIR`].
const TC_LINK_PREFIX: &str = "tc-";

/// Prefix of the XDP program's link pins in [`LINKS_DIR`].
const XDP_LINK_PREFIX: &str = "xdp-";

/// The pin of the map named `name` (its name in the object).
pub fn map(pin_dir: &Path, name: &str) -> PathBuf {
    pin_dir.join(name)
}

/// Where a map is created when its capacity changes, before it is renamed
/// over [`map`] (see `map_migration`).
pub fn staged_map(pin_dir: &Path, name: &str) -> PathBuf {
    pin_dir.join(format!("{name}{STAGED_SUFFIX}"))
}

/// Whether a name in the pin directory is a staged pin ([`staged_map`]).
pub fn is_staged(file_name: &str) -> bool {
    file_name.ends_with(STAGED_SUFFIX)
}

/// The directory of the program links.
pub fn links(pin_dir: &Path) -> PathBuf {
    pin_dir.join(LINKS_DIR)
}

/// The pin of a socket program's cgroup link, by the program's base name
/// (`connect4`, `sock_release`; the variant is not part of it, so that an
/// upgrade that changes the variant replaces the link in place).
pub fn socket_link(pin_dir: &Path, program: &str) -> PathBuf {
    links(pin_dir).join(program)
}

/// Where a socket program's new link is pinned before it is renamed over
/// [`socket_link`], which detaches the old one.
pub fn staged_socket_link(pin_dir: &Path, program: &str) -> PathBuf {
    links(pin_dir).join(format!("{program}{STAGED_SUFFIX}"))
}

/// The pin of a TC program's tcx link on `device`, `hook` being `ingress`
/// or `egress`.
pub fn tc_link(pin_dir: &Path, device: &str, hook: &str) -> PathBuf {
    links(pin_dir).join(format!("{TC_LINK_PREFIX}{device}-{hook}"))
}

/// The `<device>-<hook>` of a name in the links directory that is a TC
/// link pin ([`tc_link`]).
pub fn tc_link_target(file_name: &str) -> Option<&str> {
    file_name.strip_prefix(TC_LINK_PREFIX)
}

/// The pin of the XDP program's link on `device`.
pub fn xdp_link(pin_dir: &Path, device: &str) -> PathBuf {
    links(pin_dir).join(format!("{XDP_LINK_PREFIX}{device}"))
}

/// The device of a name in the links directory that is an XDP link pin
/// ([`xdp_link`]).
pub fn xdp_link_device(file_name: &str) -> Option<&str> {
    file_name.strip_prefix(XDP_LINK_PREFIX)
}

/// The directory of the legacy cls_bpf filter records.
pub fn tc_legacy(pin_dir: &Path) -> PathBuf {
    pin_dir.join(TC_LEGACY_DIR)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The layout that agents before this module pinned: an upgrade must
    /// find its pins at exactly these paths.
    #[test]
    fn the_layout_stays_what_earlier_versions_pinned() {
        let d = Path::new(DEFAULT_PIN_DIR);
        assert_eq!(map(d, "SERVICES"), Path::new("/sys/fs/bpf/topoproxy/SERVICES"));
        assert_eq!(staged_map(d, "SERVICES"), Path::new("/sys/fs/bpf/topoproxy/SERVICES-next"));
        assert_eq!(socket_link(d, "connect4"), Path::new("/sys/fs/bpf/topoproxy/links/connect4"));
        assert_eq!(staged_socket_link(d, "connect4"), Path::new("/sys/fs/bpf/topoproxy/links/connect4-next"));
        assert_eq!(tc_link(d, "eth0", "ingress"), Path::new("/sys/fs/bpf/topoproxy/links/tc-eth0-ingress"));
        assert_eq!(xdp_link(d, "eth0"), Path::new("/sys/fs/bpf/topoproxy/links/xdp-eth0"));
        assert_eq!(tc_legacy(d), Path::new("/sys/fs/bpf/topoproxy/tc-legacy"));
        assert_eq!(tc_link_target("tc-eth0-egress"), Some("eth0-egress"));
        assert_eq!(xdp_link_device("xdp-eth0"), Some("eth0"));
        assert_eq!(xdp_link_device("connect4"), None);
        assert!(is_staged("SERVICES-next") && !is_staged("SERVICES"));
    }
}
