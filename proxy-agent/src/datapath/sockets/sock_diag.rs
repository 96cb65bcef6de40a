//! NETLINK_SOCK_DIAG: listing a network namespace's TCP and UDP sockets
//! (`SOCK_DIAG_BY_FAMILY` dumps, include/uapi/linux/inet_diag.h) and
//! aborting one socket (`SOCK_DESTROY`, Linux >= 4.5 with
//! `CONFIG_INET_DIAG_DESTROY`). The kernel aborts a TCP socket with a RST
//! and `ECONNABORTED` (`tcp_abort`), a UDP socket by disconnecting it and
//! reporting `ECONNABORTED` to its next call (`udp_abort`).
//!
//! A netlink socket belongs to the network namespace of the thread that
//! creates it, and sees only that namespace's sockets: open a
//! [`DiagSocket`] after entering the namespace.

use std::io;
use std::mem::size_of;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::time::Duration;

const NETLINK_SOCK_DIAG: libc::c_int = 4;
const SOCK_DIAG_BY_FAMILY: u16 = 20;
const SOCK_DESTROY: u16 = 21;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_DUMP: u16 = 0x300;
/// `INET_DIAG_NOCOOKIE`: match the socket by its addresses alone.
pub const NO_COOKIE: u64 = u64::MAX;

const NLMSGHDR_LEN: usize = 16;
/// `struct inet_diag_sockid`.
const SOCKID_LEN: usize = 48;
/// `struct inet_diag_req_v2`.
const REQ_LEN: usize = 8 + SOCKID_LEN;
/// `struct inet_diag_msg`.
const MSG_LEN: usize = 4 + SOCKID_LEN + 20;
/// Netlink attribute header (`struct nlattr`), and the flag bits of its
/// type.
const NLA_HDRLEN: usize = 4;
const NLA_F_NESTED: u16 = 0x8000;
const NLA_TYPE_MASK: u16 = 0x3fff;
/// Request attribute: socket storage maps whose values the dump should
/// carry (include/uapi/linux/inet_diag.h, Linux >= 5.4), holding
/// `SK_DIAG_BPF_STORAGE_REQ_MAP_FD` attributes (sock_diag.h).
const INET_DIAG_REQ_SK_BPF_STORAGES: u16 = 2;
const SK_DIAG_BPF_STORAGE_REQ_MAP_FD: u16 = 1;
/// Answer attributes: `INET_DIAG_SK_BPF_STORAGES` holds one
/// `SK_DIAG_BPF_STORAGE` per map, each a map id and the value.
const INET_DIAG_SK_BPF_STORAGES: u16 = 20;
const SK_DIAG_BPF_STORAGE: u16 = 1;
const SK_DIAG_BPF_STORAGE_MAP_VALUE: u16 = 3;

/// TCP states (include/net/tcp_states.h) as bits of `idiag_states`.
pub const TCP_ESTABLISHED: u32 = 1;
/// `TCP_SYN_SENT`: a connect() in progress.
pub const TCP_SYN_SENT: u32 = 2;

/// The `idiag_states` bit of TCP state `state`.
pub fn state_bit(state: u32) -> u32 {
    1 << state
}

/// One socket of a dump.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiagSock {
    /// `AF_INET` or `AF_INET6` (the socket's own family: an IPv6 socket
    /// talking to an IPv4 peer shows `::ffff:a.b.c.d`).
    pub family: u8,
    /// `IPPROTO_TCP` or `IPPROTO_UDP`.
    pub protocol: u8,
    /// The TCP state (`TCP_ESTABLISHED`, ...), 7 (`TCP_CLOSE`) for unconnected UDP.
    pub state: u8,
    /// The local address.
    pub src: SocketAddr,
    /// The peer's address.
    pub dst: SocketAddr,
    /// The socket cookie (`sock_gen_cookie`, the value
    /// `bpf_get_socket_cookie` returns).
    pub cookie: u64,
    /// The socket's value in the socket storage map the dump asked for
    /// ([`DiagSocket::dump_with_storage`]); `None` when it has none. The
    /// kernel reports socket storage for full sockets only
    /// (`inet_sk_diag_fill`; not for UDP, whose dump has no connection
    /// sock).
    pub storage: Option<Vec<u8>>,
    /// `struct inet_diag_sockid` as the kernel sent it: a destroy request
    /// hands it back unchanged (bound device and cookie included).
    id: [u8; SOCKID_LEN],
}

/// A NETLINK_SOCK_DIAG socket of the calling thread's network namespace.
#[derive(Debug)]
pub struct DiagSocket {
    fd: OwnedFd,
    seq: u32,
}

fn check(rc: libc::c_int) -> io::Result<()> {
    if rc < 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
}

impl DiagSocket {
    /// Opens a sock_diag socket in the calling thread's network namespace.
    pub fn open() -> io::Result<DiagSocket> {
        // SAFETY: socket(2) returns a new descriptor or -1.
        let fd = unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, NETLINK_SOCK_DIAG) };
        check(fd)?;
        // SAFETY: `fd` is a fresh descriptor nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // A dump of a namespace with many sockets must not stall the
        // caller forever should the kernel stop answering.
        let tv = libc::timeval { tv_sec: 5, tv_usec: 0 };
        // SAFETY: SO_RCVTIMEO reads one timeval of the size passed.
        check(unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&raw const tv).cast(),
                size_of::<libc::timeval>() as libc::socklen_t,
            )
        })?;
        Ok(DiagSocket { fd, seq: 0 })
    }

    fn send(&mut self, msg_type: u16, flags: u16, body: &[u8]) -> io::Result<u32> {
        self.seq = self.seq.wrapping_add(1);
        let mut msg = Vec::with_capacity(NLMSGHDR_LEN + body.len());
        msg.extend_from_slice(&((NLMSGHDR_LEN + body.len()) as u32).to_ne_bytes());
        msg.extend_from_slice(&msg_type.to_ne_bytes());
        msg.extend_from_slice(&flags.to_ne_bytes());
        msg.extend_from_slice(&self.seq.to_ne_bytes());
        msg.extend_from_slice(&0u32.to_ne_bytes());
        msg.extend_from_slice(body);
        // SAFETY: an all-zero sockaddr_nl is valid; pid 0 is the kernel.
        let mut to: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        to.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        // SAFETY: `msg` and `to` are valid for the lengths passed.
        let n = unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                msg.as_ptr().cast(),
                msg.len(),
                0,
                (&raw const to).cast(),
                size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(self.seq)
    }

    /// Reads answers to request `seq`, handing each message's type and
    /// payload to `each`, until `each` says the exchange is over.
    fn receive(&self, seq: u32, mut each: impl FnMut(u16, &[u8]) -> io::Result<bool>) -> io::Result<()> {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            // SAFETY: `buf` is writable for its length.
            let n = unsafe { libc::recv(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            let mut rest = &buf[..n as usize];
            while rest.len() >= NLMSGHDR_LEN {
                let len = u32_at(rest, 0) as usize;
                if len < NLMSGHDR_LEN || len > rest.len() {
                    return Err(io::Error::new(io::ErrorKind::InvalidData, "truncated netlink message"));
                }
                let msg_type = u16::from_ne_bytes([rest[4], rest[5]]);
                let msg_seq = u32_at(rest, 8);
                let payload = &rest[NLMSGHDR_LEN..len];
                rest = &rest[align4(len).min(rest.len())..];
                if msg_seq != seq {
                    continue; // an answer to an earlier request that gave up
                }
                if each(msg_type, payload)? {
                    return Ok(());
                }
            }
        }
    }

    /// Every `protocol` socket of `family` in one of `states` (a mask of
    /// [`state_bit`]s).
    pub fn dump(&mut self, family: u8, protocol: u8, states: u32) -> io::Result<Vec<DiagSock>> {
        self.dump_with_storage(family, protocol, states, None)
    }

    /// [`DiagSocket::dump`], each socket with its value in the socket
    /// storage map `storage_map` (a `BPF_MAP_TYPE_SK_STORAGE` descriptor),
    /// where it has one.
    pub fn dump_with_storage(
        &mut self,
        family: u8,
        protocol: u8,
        states: u32,
        storage_map: Option<BorrowedFd<'_>>,
    ) -> io::Result<Vec<DiagSock>> {
        let mut body = request(family, protocol, states, &[0; SOCKID_LEN]);
        if let Some(fd) = storage_map {
            let fd = u32::try_from(fd.as_raw_fd()).map_err(io::Error::other)?;
            body.extend(nla(INET_DIAG_REQ_SK_BPF_STORAGES | NLA_F_NESTED, &nla(SK_DIAG_BPF_STORAGE_REQ_MAP_FD, &fd.to_ne_bytes())));
        }
        let seq = self.send(SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, &body)?;
        let mut out = Vec::new();
        self.receive(seq, |msg_type, payload| match msg_type {
            NLMSG_DONE => Ok(true),
            NLMSG_ERROR => match error_of(payload) {
                0 => Ok(true),
                errno => Err(io::Error::from_raw_os_error(errno)),
            },
            SOCK_DIAG_BY_FAMILY => {
                if let Some(s) = parse_msg(protocol, payload) {
                    out.push(s);
                }
                Ok(false)
            }
            _ => Ok(false),
        })?;
        Ok(out)
    }

    /// Aborts `s` (matched by its addresses, bound device and cookie: a
    /// socket closed meanwhile and its addresses reused by another is
    /// left alone).
    pub fn destroy(&mut self, s: &DiagSock) -> io::Result<()> {
        self.destroy_id(s.family, s.protocol, &s.id)
    }

    fn destroy_id(&mut self, family: u8, protocol: u8, id: &[u8; SOCKID_LEN]) -> io::Result<()> {
        let body = request(family, protocol, 0, id);
        let seq = self.send(SOCK_DESTROY, NLM_F_REQUEST | NLM_F_ACK, &body)?;
        let mut result = Ok(());
        self.receive(seq, |msg_type, payload| {
            if msg_type == NLMSG_ERROR {
                let errno = error_of(payload);
                if errno != 0 {
                    result = Err(io::Error::from_raw_os_error(errno));
                }
                return Ok(true);
            }
            Ok(msg_type == NLMSG_DONE)
        })?;
        result
    }

    /// Aborts the socket of `protocol` from `src` to `dst` whatever its
    /// cookie (start-up probes of the agent's own sockets).
    pub fn destroy_by_addrs(&mut self, protocol: u8, src: SocketAddr, dst: SocketAddr) -> io::Result<()> {
        let family = if src.is_ipv4() { libc::AF_INET } else { libc::AF_INET6 } as u8;
        self.destroy_id(family, protocol, &sockid(src, dst, 0, NO_COOKIE))
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_ne_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn align4(n: usize) -> usize {
    (n + 3) & !3
}

/// The errno of an `NLMSG_ERROR` payload (positive; 0 for an ACK).
fn error_of(payload: &[u8]) -> i32 {
    if payload.len() < 4 {
        return libc::EPROTO;
    }
    -i32::from_ne_bytes([payload[0], payload[1], payload[2], payload[3]])
}

/// `struct inet_diag_req_v2`.
fn request(family: u8, protocol: u8, states: u32, id: &[u8; SOCKID_LEN]) -> Vec<u8> {
    let mut b = Vec::with_capacity(REQ_LEN);
    b.extend_from_slice(&[family, protocol, 0, 0]);
    b.extend_from_slice(&states.to_ne_bytes());
    b.extend_from_slice(id);
    b
}

/// `struct inet_diag_sockid`: ports and addresses in network byte order,
/// the cookie as two host-order words, low first (`sock_diag_save_cookie`).
fn sockid(src: SocketAddr, dst: SocketAddr, ifindex: u32, cookie: u64) -> [u8; SOCKID_LEN] {
    let mut id = [0u8; SOCKID_LEN];
    id[0..2].copy_from_slice(&src.port().to_be_bytes());
    id[2..4].copy_from_slice(&dst.port().to_be_bytes());
    id[4..20].copy_from_slice(&addr_bytes(src.ip()));
    id[20..36].copy_from_slice(&addr_bytes(dst.ip()));
    id[36..40].copy_from_slice(&ifindex.to_ne_bytes());
    id[40..44].copy_from_slice(&(cookie as u32).to_ne_bytes());
    id[44..48].copy_from_slice(&((cookie >> 32) as u32).to_ne_bytes());
    id
}

fn addr_bytes(ip: IpAddr) -> [u8; 16] {
    let mut out = [0u8; 16];
    match ip {
        IpAddr::V4(v4) => out[..4].copy_from_slice(&v4.octets()),
        IpAddr::V6(v6) => out = v6.octets(),
    }
    out
}

fn addr_of(family: u8, bytes: &[u8], port: u16) -> Option<SocketAddr> {
    let ip = match i32::from(family) {
        libc::AF_INET => IpAddr::V4(Ipv4Addr::new(bytes[0], bytes[1], bytes[2], bytes[3])),
        libc::AF_INET6 => IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(bytes).ok()?)),
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

/// One `struct inet_diag_msg` (its attributes are not asked for). `None`
/// for a message too short or of an unknown family.
fn parse_msg(protocol: u8, p: &[u8]) -> Option<DiagSock> {
    if p.len() < MSG_LEN {
        return None;
    }
    let (family, state) = (p[0], p[1]);
    let id: [u8; SOCKID_LEN] = p[4..4 + SOCKID_LEN].try_into().ok()?;
    let sport = u16::from_be_bytes([id[0], id[1]]);
    let dport = u16::from_be_bytes([id[2], id[3]]);
    let src = addr_of(family, &id[4..20], sport)?;
    let dst = addr_of(family, &id[20..36], dport)?;
    let cookie = u64::from(u32_at(&id, 40)) | (u64::from(u32_at(&id, 44)) << 32);
    let storage = attrs(&p[align4(MSG_LEN).min(p.len())..])
        .filter(|(t, _)| *t == INET_DIAG_SK_BPF_STORAGES)
        .flat_map(|(_, v)| attrs(v))
        .filter(|(t, _)| *t == SK_DIAG_BPF_STORAGE)
        .flat_map(|(_, v)| attrs(v))
        .find(|(t, _)| *t == SK_DIAG_BPF_STORAGE_MAP_VALUE)
        .map(|(_, v)| v.to_vec());
    Some(DiagSock { family, protocol, state, src, dst, cookie, storage, id })
}

/// One netlink attribute of type `t` (flag bits included), padded to 4
/// bytes as the next one must start.
fn nla(t: u16, payload: &[u8]) -> Vec<u8> {
    let mut b = ((NLA_HDRLEN + payload.len()) as u16).to_ne_bytes().to_vec();
    b.extend_from_slice(&t.to_ne_bytes());
    b.extend_from_slice(payload);
    b.resize(align4(b.len()), 0);
    b
}

/// The netlink attributes in `b` as (type without flag bits, payload);
/// stops at the first malformed one.
fn attrs(mut b: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    std::iter::from_fn(move || {
        if b.len() < NLA_HDRLEN {
            return None;
        }
        let len = usize::from(u16::from_ne_bytes([b[0], b[1]]));
        if len < NLA_HDRLEN || len > b.len() {
            return None;
        }
        let t = u16::from_ne_bytes([b[2], b[3]]) & NLA_TYPE_MASK;
        let payload = &b[NLA_HDRLEN..len];
        b = &b[align4(len).min(b.len())..];
        Some((t, payload))
    })
}

/// Probes whether this kernel aborts sockets through `SOCK_DESTROY`, for
/// `protocol`, with a connected socket of the agent's own on loopback.
/// `Ok` when the probe socket was aborted; the error says why not
/// (`EOPNOTSUPP`: no `CONFIG_INET_DIAG_DESTROY`; `ENOENT`: no inet_diag
/// handler for the protocol, e.g. the `tcp_diag`/`udp_diag` module missing).
pub fn probe_destroy(protocol: u8) -> io::Result<()> {
    use std::net::{TcpListener, TcpStream, UdpSocket};
    let mut diag = DiagSocket::open()?;
    let localhost = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
    if i32::from(protocol) == libc::IPPROTO_TCP {
        let listener = TcpListener::bind(localhost)?;
        let client = TcpStream::connect_timeout(&listener.local_addr()?, Duration::from_secs(2))?;
        diag.destroy_by_addrs(protocol, client.local_addr()?, client.peer_addr()?)?;
        aborted(client.take_error()?.as_ref())
    } else {
        let s = UdpSocket::bind(localhost)?;
        // Nothing needs to listen: connect() only fixes the peer.
        s.connect(SocketAddr::from((Ipv4Addr::LOCALHOST, 9)))?;
        diag.destroy_by_addrs(protocol, s.local_addr()?, s.peer_addr()?)?;
        aborted(s.take_error()?.as_ref())
    }
}

fn aborted(err: Option<&io::Error>) -> io::Result<()> {
    match err.and_then(io::Error::raw_os_error) {
        Some(libc::ECONNABORTED) => Ok(()),
        other => Err(io::Error::other(format!("SOCK_DESTROY was accepted but the socket reports {other:?}, not ECONNABORTED"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `struct inet_diag_msg` in state 1 (ESTABLISHED), no attributes.
    fn diag_msg(family: i32, src: SocketAddr, dst: SocketAddr, ifindex: u32, cookie: u64) -> Vec<u8> {
        let mut msg = vec![family as u8, 1, 0, 0];
        msg.extend_from_slice(&sockid(src, dst, ifindex, cookie));
        msg.extend_from_slice(&[0; 20]);
        msg
    }

    #[test]
    fn a_dump_answer_decodes_addresses_and_cookie() {
        let src: SocketAddr = "10.244.0.9:40000".parse().unwrap();
        let dst: SocketAddr = "10.244.0.1:53".parse().unwrap();
        let msg = diag_msg(libc::AF_INET, src, dst, 3, 0x1_0000_0002);
        let s = parse_msg(libc::IPPROTO_UDP as u8, &msg).expect("parsed");
        assert_eq!((s.src, s.dst, s.cookie, s.state), (src, dst, 0x1_0000_0002, 1));
        assert_eq!(u32_at(&s.id, 36), 3, "the bound device goes back unchanged");
        assert!(parse_msg(6, &msg[..MSG_LEN - 1]).is_none());
    }

    #[test]
    fn a_socket_storage_value_is_found_in_its_nested_attributes() {
        let src: SocketAddr = "10.244.0.9:40000".parse().unwrap();
        let dst: SocketAddr = "10.244.0.1:80".parse().unwrap();
        let head = diag_msg(libc::AF_INET, src, dst, 0, 9);
        let value = [7u8; 10];
        let storage =
            [nla(SK_DIAG_BPF_STORAGE_MAP_ID_FOR_TESTS, &42u32.to_ne_bytes()), nla(SK_DIAG_BPF_STORAGE_MAP_VALUE, &value)].concat();
        type Case<'a> = (&'a str, Vec<u8>, Option<Vec<u8>>);
        let cases: [Case<'_>; 4] = [
            ("no attributes", Vec::new(), None),
            ("another attribute only", nla(15, &1u32.to_ne_bytes()), None),
            (
                "after another attribute, flagged nested",
                [
                    nla(15, &1u32.to_ne_bytes()),
                    nla(INET_DIAG_SK_BPF_STORAGES | NLA_F_NESTED, &nla(SK_DIAG_BPF_STORAGE | NLA_F_NESTED, &storage)),
                ]
                .concat(),
                Some(value.to_vec()),
            ),
            ("a truncated attribute", nla(INET_DIAG_SK_BPF_STORAGES, &nla(SK_DIAG_BPF_STORAGE, &storage))[..12].to_vec(), None),
        ];
        for (name, tail, want) in cases {
            let msg = [head.clone(), tail].concat();
            let s = parse_msg(libc::IPPROTO_TCP as u8, &msg).expect(name);
            assert_eq!(s.storage, want, "{name}");
            assert_eq!((s.src, s.dst, s.cookie), (src, dst, 9), "{name}");
        }
    }

    /// `SK_DIAG_BPF_STORAGE_MAP_ID` (sock_diag.h): not read, only skipped.
    const SK_DIAG_BPF_STORAGE_MAP_ID_FOR_TESTS: u16 = 2;

    #[test]
    fn ipv6_and_mapped_addresses_decode_as_the_socket_sees_them() {
        let src: SocketAddr = "[fd00::9]:40000".parse().unwrap();
        let dst: SocketAddr = "[::ffff:10.244.0.1]:53".parse().unwrap();
        let msg = diag_msg(libc::AF_INET6, src, dst, 0, 5);
        let s = parse_msg(libc::IPPROTO_TCP as u8, &msg).expect("parsed");
        assert_eq!((s.src, s.dst, s.cookie), (src, dst, 5));
    }
}
