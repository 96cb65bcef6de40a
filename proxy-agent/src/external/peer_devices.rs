//! The devices the TC fast path may deliver a local backend's packets to
//! with `bpf_redirect_peer` (`NP_PEER_DEVS`, proxy-ebpf's tc_fast.rs): the
//! veths of this namespace whose peer lives in another network namespace,
//! which is how CNI plugins connect a pod (bridge, ptp, Calico, Cilium's
//! veth mode). The helper drops the packet on any other device (no peer,
//! or the peer in this namespace: `skb_do_redirect`, net/core/filter.c),
//! and the program cannot tell a device's kind from its index, so the agent
//! lists them.
//!
//! Read from the kernel's link list with one `RTM_GETLINK` dump: a veth
//! reports `IFLA_INFO_KIND` "veth" inside `IFLA_LINKINFO`, and a device
//! whose link (the veth's peer) is in another namespace reports that
//! namespace's id as `IFLA_LINK_NETNSID` (`rtnl_fill_link_netnsid`,
//! net/core/rtnetlink.c). The dump runs on every sync pass, so a pod's
//! veth, created by the CNI before the pod can be ready, is listed by the
//! time its endpoint reaches the maps. A device index is not reused until
//! the kernel's counter wraps (it hands indexes out cyclically), so an
//! entry left for a deleted veth until the next pass cannot name another
//! device.

use std::collections::BTreeSet;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;

use aya::maps::{HashMap, Map, MapData};
use proxy_common as pc;

use crate::datapath::loader::pins;
use crate::datapath::map_writer::WriteError;

/// `RTM_GETLINK`, `RTM_NEWLINK` (include/uapi/linux/rtnetlink.h).
const RTM_NEWLINK: u16 = 16;
const RTM_GETLINK: u16 = 18;
/// `NLMSG_ERROR`, `NLMSG_DONE` (include/uapi/linux/netlink.h).
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
/// `IFLA_LINKINFO`, `IFLA_LINK_NETNSID` (include/uapi/linux/if_link.h)
/// and `IFLA_INFO_KIND` inside the former.
const IFLA_LINKINFO: u16 = 18;
const IFLA_LINK_NETNSID: u16 = 37;
const IFLA_INFO_KIND: u16 = 1;
/// `NLA_F_NESTED | NLA_F_NET_BYTEORDER`: flag bits of an attribute type.
const NLA_TYPE_MASK: u16 = 0x3fff;
const NLMSG_HDRLEN: usize = 16;
/// `struct ifinfomsg`.
const IFINFOMSG_LEN: usize = 16;

/// One device of the dump, as far as `NP_PEER_DEVS` cares.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Link {
    /// The device's index.
    pub ifindex: u32,
    /// `IFLA_INFO_KIND`, empty for a device without one (a NIC).
    pub kind: String,
    /// `IFLA_LINK_NETNSID` present: the device's link is in another
    /// namespace.
    pub link_netns: bool,
}

impl Link {
    /// Whether `bpf_redirect_peer` into this device delivers.
    pub fn is_peer_veth(&self) -> bool {
        self.kind == "veth" && self.link_netns
    }
}

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

/// The attributes `(type, payload)` in `b`, a run of `struct rtattr`s each
/// padded to 4 bytes; stops at the first malformed one.
fn attrs(b: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    let mut at = 0;
    std::iter::from_fn(move || {
        let len = usize::from(u16_at(b, at)?);
        let ty = u16_at(b, at + 2)?;
        let payload = b.get(at + 4..at + len)?;
        at += len.max(4).next_multiple_of(4);
        Some((ty & NLA_TYPE_MASK, payload))
    })
}

/// The links of one `recv` of an `RTM_GETLINK` dump, and whether the dump
/// ended in it (`NLMSG_DONE`). An `NLMSG_ERROR` is the kernel's refusal.
pub fn parse_links(buf: &[u8], out: &mut Vec<Link>) -> io::Result<bool> {
    let mut at = 0;
    while at + NLMSG_HDRLEN <= buf.len() {
        let bad = || io::Error::new(io::ErrorKind::InvalidData, "malformed netlink message");
        let len = u32_at(buf, at).ok_or_else(bad)? as usize;
        let ty = u16_at(buf, at + 4).ok_or_else(bad)?;
        if len < NLMSG_HDRLEN {
            return Err(bad());
        }
        let msg = buf.get(at + NLMSG_HDRLEN..at + len).ok_or_else(bad)?;
        match ty {
            NLMSG_DONE => return Ok(true),
            NLMSG_ERROR => {
                let errno = u32_at(msg, 0).ok_or_else(bad)? as i32;
                return Err(io::Error::from_raw_os_error(-errno));
            }
            RTM_NEWLINK => {
                let ifindex = u32_at(msg, 4).ok_or_else(bad)?;
                let mut link = Link { ifindex, kind: String::new(), link_netns: false };
                for (t, payload) in attrs(msg.get(IFINFOMSG_LEN..).unwrap_or_default()) {
                    match t {
                        IFLA_LINK_NETNSID => link.link_netns = true,
                        IFLA_LINKINFO => {
                            if let Some((_, kind)) = attrs(payload).find(|(t, _)| *t == IFLA_INFO_KIND) {
                                let kind = kind.split(|c| *c == 0).next().unwrap_or_default();
                                link.kind = String::from_utf8_lossy(kind).into_owned();
                            }
                        }
                        _ => {}
                    }
                }
                out.push(link);
            }
            _ => {}
        }
        at += len.next_multiple_of(4);
    }
    Ok(false)
}

/// Every device of this network namespace, from one `RTM_GETLINK` dump.
pub fn links() -> io::Result<Vec<Link>> {
    // SAFETY: a plain socket call; the fd is owned below.
    let fd = unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, libc::NETLINK_ROUTE) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh fd of ours.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    // nlmsghdr + ifinfomsg (AF_UNSPEC: every device).
    let mut req = [0u8; NLMSG_HDRLEN + IFINFOMSG_LEN];
    req[0..4].copy_from_slice(&((NLMSG_HDRLEN + IFINFOMSG_LEN) as u32).to_ne_bytes());
    req[4..6].copy_from_slice(&RTM_GETLINK.to_ne_bytes());
    req[6..8].copy_from_slice(&((libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16).to_ne_bytes());
    req[8..12].copy_from_slice(&1u32.to_ne_bytes());
    // SAFETY: an all-zero sockaddr_nl is the kernel's address.
    let mut to: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    to.nl_family = libc::AF_NETLINK as libc::sa_family_t;
    // SAFETY: the buffer and address are ours, with their sizes.
    let sent = unsafe {
        libc::sendto(
            sock.as_raw_fd(),
            req.as_ptr().cast(),
            req.len(),
            0,
            (&raw const to).cast(),
            size_of::<libc::sockaddr_nl>() as libc::socklen_t,
        )
    };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut out = Vec::new();
    // The kernel fills each dump message up to the reader's buffer or a
    // page-sized skb (netlink_dump); 32 KiB holds any of them.
    let mut buf = vec![0u8; 32 * 1024];
    loop {
        // SAFETY: reads into our buffer, at most its length.
        let n = unsafe { libc::recv(sock.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 || parse_links(&buf[..n as usize], &mut out)? {
            return Ok(out);
        }
    }
}

/// The agent's copy of `NP_PEER_DEVS`: the pinned map and what was last
/// written to it.
pub struct PeerDevices {
    map: HashMap<MapData, u32, u32>,
    written: BTreeSet<u32>,
    /// The last error logged, so that a failing dump warns once, not per
    /// pass.
    last_error: Option<String>,
}

impl PeerDevices {
    /// Opens the pinned map; starts from what it holds (a restarted agent
    /// keeps the entries until its first pass has listed the devices).
    pub fn open(pin_dir: &Path) -> Result<PeerDevices, WriteError> {
        let name = pc::NP_PEER_DEVS_MAP;
        let data = MapData::from_pin(pins::map(pin_dir, name)).map_err(|source| WriteError::Open { map: name, source })?;
        let map: HashMap<MapData, u32, u32> =
            HashMap::try_from(Map::HashMap(data)).map_err(|source| WriteError::Open { map: name, source })?;
        let written = map.keys().filter_map(Result::ok).collect();
        Ok(PeerDevices { map, written, last_error: None })
    }

    /// Lists the devices and brings the map in line: new peer veths are
    /// added before gone ones are removed. Returns how many entries changed.
    pub fn sync(&mut self) -> usize {
        let want: BTreeSet<u32> = match links() {
            Ok(l) => l.iter().filter(|l| l.is_peer_veth()).map(|l| l.ifindex).collect(),
            Err(e) => {
                self.warn(format!("listing the devices for NP_PEER_DEVS failed: {e}; local backends' packets keep their last list"));
                return 0;
            }
        };
        let mut changed = 0;
        for &i in want.difference(&self.written) {
            match self.map.insert(i, pc::NP_PEER_DEV_VETH, 0) {
                Ok(()) => changed += 1,
                // Full (more veths than NP_PEER_DEVS_ENTRIES): the device's
                // local backends go through the stack.
                Err(e) => {
                    self.warn(format!("NP_PEER_DEVS: adding device {i} failed: {e}; its local backends are served through the stack"));
                    return changed;
                }
            }
        }
        for &i in self.written.difference(&want) {
            // A device already gone may be gone from the map too.
            let _ = self.map.remove(&i);
            changed += 1;
        }
        self.written = want;
        self.last_error = None;
        changed
    }

    /// Empties the map: every local backend's packets go through the
    /// stack (`--tc-fast-path auto` or `off`).
    pub fn clear(&mut self) {
        for i in std::mem::take(&mut self.written) {
            let _ = self.map.remove(&i);
        }
    }

    fn warn(&mut self, msg: String) {
        if self.last_error.as_ref() != Some(&msg) {
            tracing::warn!("{msg}");
            self.last_error = Some(msg);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attr(ty: u16, payload: &[u8]) -> Vec<u8> {
        let mut a = Vec::new();
        a.extend_from_slice(&((4 + payload.len()) as u16).to_ne_bytes());
        a.extend_from_slice(&ty.to_ne_bytes());
        a.extend_from_slice(payload);
        while a.len() % 4 != 0 {
            a.push(0);
        }
        a
    }

    fn msg(ty: u16, body: &[u8]) -> Vec<u8> {
        let mut m = Vec::new();
        m.extend_from_slice(&((NLMSG_HDRLEN + body.len()) as u32).to_ne_bytes());
        m.extend_from_slice(&ty.to_ne_bytes());
        m.extend_from_slice(&[0; 10]);
        m.extend_from_slice(body);
        m
    }

    fn link(ifindex: u32, kind: Option<&str>, netnsid: bool) -> Vec<u8> {
        let mut body = vec![0u8; IFINFOMSG_LEN];
        body[4..8].copy_from_slice(&ifindex.to_ne_bytes());
        body.extend(attr(3, b"dev0\0"));
        if let Some(k) = kind {
            let mut kind = k.as_bytes().to_vec();
            kind.push(0);
            // NLA_F_NESTED set, as the kernel sends it.
            body.extend(attr(IFLA_LINKINFO | 0x8000, &attr(IFLA_INFO_KIND, &kind)));
        }
        if netnsid {
            body.extend(attr(IFLA_LINK_NETNSID, &0i32.to_ne_bytes()));
        }
        msg(RTM_NEWLINK, &body)
    }

    #[test]
    fn only_veths_with_their_peer_in_another_namespace_take_redirect_peer() {
        let mut buf = Vec::new();
        buf.extend(link(1, None, false)); // lo
        buf.extend(link(2, Some("veth"), true)); // a pod's veth
        buf.extend(link(3, Some("veth"), false)); // both ends here
        buf.extend(link(4, Some("bridge"), false));
        buf.extend(link(5, Some("vxlan"), true)); // a link netns, not a veth
        let mut out = Vec::new();
        assert!(!parse_links(&buf, &mut out).expect("parse"), "no NLMSG_DONE yet");
        let peers: Vec<u32> = out.iter().filter(|l| l.is_peer_veth()).map(|l| l.ifindex).collect();
        assert_eq!(peers, [2]);
        assert_eq!(out.len(), 5);
        assert!(parse_links(&msg(NLMSG_DONE, &[0; 4]), &mut out).expect("done"));
    }

    #[test]
    fn a_refused_dump_is_an_error_and_a_truncated_message_is_malformed() {
        let mut out = Vec::new();
        let e = parse_links(&msg(NLMSG_ERROR, &(-libc::EPERM).to_ne_bytes()), &mut out).expect_err("refused");
        assert_eq!(e.raw_os_error(), Some(libc::EPERM));
        let mut cut = link(2, Some("veth"), true);
        cut.truncate(cut.len() - 4);
        let claimed = (cut.len() + 4) as u32;
        cut[0..4].copy_from_slice(&claimed.to_ne_bytes());
        assert!(parse_links(&cut, &mut out).is_err());
    }

    #[test]
    fn this_namespace_lists_its_devices() {
        // Loopback exists in every namespace and is no veth.
        let l = links().expect("RTM_GETLINK dump");
        assert!(l.iter().any(|l| l.ifindex == 1 && !l.is_peer_veth()), "{l:?}");
    }
}
