//! `proxy-agent probe`: connect like an application and print, per attempt,
//! one JSON line with what the socket API reported. Used by the tests and the
//! demo, and handy on a node to see what a pod would see.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream, UdpSocket};
use std::os::fd::AsFd;
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use serde_json::json;

// Each bool is one command-line switch of its own.
#[allow(clippy::struct_excessive_bools)]
#[derive(Args)]
pub(crate) struct ProbeArgs {
    /// Address to reach, e.g. 10.96.0.10:80 or [fd00::10]:80.
    #[arg(long)]
    to: SocketAddr,
    /// Use UDP instead of TCP.
    #[arg(long)]
    udp: bool,
    /// With --udp: connect() the socket first instead of using sendto().
    #[arg(long)]
    connected: bool,
    /// Number of attempts, each on a new socket (with --stream: exchanges
    /// over the one socket).
    #[arg(long, default_value_t = 1)]
    count: u32,
    /// Pause between attempts (or exchanges), so that a long run is a
    /// steady stream rather than a busy loop.
    #[arg(long, default_value_t = 0)]
    interval_ms: u64,
    /// Keep one socket for the whole run, as a long-lived connection does:
    /// each of the --count exchanges sends --message and reads one reply
    /// (TCP: a line each way, so the backend must answer line by line; UDP:
    /// a datagram each way). A TCP stream stops at its first failure (the
    /// connection is broken); a UDP one goes on, since a lost datagram
    /// leaves the socket usable.
    #[arg(long, conflicts_with_all = ["per_socket", "also", "hold"])]
    stream: bool,
    /// With --stream: after a failure other than a timeout (the socket was
    /// aborted, reset or refused), open a new socket to --to and go on, as
    /// a client that reconnects does; the line of the first exchange on
    /// the new socket says `"reconnected": true`.
    #[arg(long, requires = "stream")]
    reconnect: bool,
    /// With --stream: a reply whose last word is `closing` (a backend
    /// shutting down gracefully, as `serve-hostname --drain-secs` does,
    /// like HTTP's `Connection: close`) ends the socket cleanly: its line
    /// says `"closing": true` and the next exchange opens a new socket
    /// (`"reconnected": true`).
    #[arg(long, requires = "stream")]
    graceful: bool,
    /// With --udp: datagrams per socket (all must reach the same backend).
    #[arg(long, default_value_t = 1)]
    per_socket: u32,
    /// With --udp and without --connected: after --to, the same socket
    /// also sends to each of these, in turn, per round (a socket that talks
    /// to several Services or pods).
    #[arg(long)]
    also: Vec<SocketAddr>,
    /// Payload sent to the backend.
    #[arg(long, default_value = "ping")]
    message: String,
    #[arg(long, default_value_t = 2000)]
    timeout_ms: u64,
    /// Bind each socket to this source address before connecting or
    /// sending (the port is the kernel's choice), as an application that
    /// picks its own address does.
    #[arg(long)]
    bind: Option<std::net::IpAddr>,
    /// With --udp: after the first datagram is sent, print the socket's
    /// cookie (`{"held":true,"cookie":N}`) and wait for a line on stdin
    /// before reading the reply, so a test can change the datapath (e.g.
    /// upgrade the agent) while a reply waits in the socket.
    #[arg(long, hide = true)]
    hold: bool,
}

pub(crate) fn probe(args: ProbeArgs) -> anyhow::Result<ExitCode> {
    let timeout = Duration::from_millis(args.timeout_ms.max(1));
    if args.stream {
        return stream(&args, timeout);
    }
    let mut failed = false;
    for i in 0..args.count {
        if i > 0 {
            pause(&args);
        }
        let line = if args.udp { udp_once(&args, timeout) } else { tcp_once(&args, timeout) };
        failed |= line.get("ok") != Some(&json!(true));
        print_line(&line)?;
    }
    Ok(if failed { ExitCode::from(1) } else { ExitCode::SUCCESS })
}

/// One JSON line, flushed at once: whoever reads the output follows the
/// attempts as they happen.
fn print_line(line: &serde_json::Value) -> std::io::Result<()> {
    let mut lock = std::io::stdout().lock();
    writeln!(lock, "{line}")?;
    lock.flush()
}

fn pause(args: &ProbeArgs) {
    if args.interval_ms > 0 {
        std::thread::sleep(Duration::from_millis(args.interval_ms));
    }
}

fn failure(stage: &str, e: &std::io::Error) -> serde_json::Value {
    json!({"ok": false, "stage": stage, "errno": e.raw_os_error(), "error": e.to_string()})
}

fn tcp_once(args: &ProbeArgs, timeout: Duration) -> serde_json::Value {
    let connected = match args.bind {
        Some(from) => connect_from(from, args.to, timeout),
        None => TcpStream::connect_timeout(&args.to, timeout),
    };
    let mut s = match connected {
        Ok(s) => s,
        Err(e) => return failure("connect", &e),
    };
    let peer = s.peer_addr().map(|p| p.to_string()).unwrap_or_default();
    let _ = s.set_read_timeout(Some(timeout));
    if let Err(e) = s.write_all(args.message.as_bytes()) {
        return failure("send", &e);
    }
    let _ = s.shutdown(Shutdown::Write);
    let mut reply = String::new();
    if let Err(e) = s.read_to_string(&mut reply) {
        return failure("recv", &e);
    }
    json!({"ok": true, "peer": peer, "reply": reply.trim()})
}

/// A TCP connection from address `from` (bound before connect(), port 0),
/// giving up after `timeout`.
fn connect_from(from: std::net::IpAddr, to: SocketAddr, timeout: Duration) -> std::io::Result<TcpStream> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let family = if to.is_ipv4() { libc::AF_INET } else { libc::AF_INET6 };
    // SAFETY: socket(2) returns a new descriptor that we own, or -1.
    let fd = unsafe { libc::socket(family, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is open and owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let check = |rc: libc::c_int| if rc == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) };
    let (addr, len) = sockaddr(SocketAddr::new(from, 0));
    // SAFETY: `addr` holds a sockaddr of `len` bytes of the socket's family.
    check(unsafe { libc::bind(fd.as_raw_fd(), (&raw const addr).cast(), len) })?;
    // A blocking connect() gives up after SO_SNDTIMEO (`inet_stream_connect`
    // waits `sock_sndtimeo`).
    let tv = libc::timeval { tv_sec: timeout.as_secs().try_into().unwrap_or(libc::time_t::MAX), tv_usec: timeout.subsec_micros().into() };
    let tv_len = std::mem::size_of::<libc::timeval>() as libc::socklen_t;
    // SAFETY: SO_SNDTIMEO reads a timeval of the size passed.
    check(unsafe { libc::setsockopt(fd.as_raw_fd(), libc::SOL_SOCKET, libc::SO_SNDTIMEO, (&raw const tv).cast(), tv_len) })?;
    let (addr, len) = sockaddr(to);
    // SAFETY: as for bind.
    check(unsafe { libc::connect(fd.as_raw_fd(), (&raw const addr).cast(), len) })?;
    Ok(TcpStream::from(fd))
}

/// `a` as the kernel takes it.
fn sockaddr(a: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: all-zero bytes are a valid sockaddr_storage.
    let mut out: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match a {
        SocketAddr::V4(v4) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: v4.port().to_be(),
                sin_addr: libc::in_addr { s_addr: u32::from_ne_bytes(v4.ip().octets()) },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in.
            unsafe { std::ptr::write((&raw mut out).cast(), sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(v6) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: v6.port().to_be(),
                sin6_flowinfo: 0,
                sin6_addr: libc::in6_addr { s6_addr: v6.ip().octets() },
                sin6_scope_id: 0,
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in6.
            unsafe { std::ptr::write((&raw mut out).cast(), sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (out, len as libc::socklen_t)
}

fn udp_once(args: &ProbeArgs, timeout: Duration) -> serde_json::Value {
    let any: std::net::IpAddr =
        if args.to.is_ipv4() { std::net::Ipv4Addr::UNSPECIFIED.into() } else { std::net::Ipv6Addr::UNSPECIFIED.into() };
    let bind = SocketAddr::new(args.bind.unwrap_or(any), 0);
    let s = match UdpSocket::bind(bind) {
        Ok(s) => s,
        Err(e) => return failure("bind", &e),
    };
    let _ = s.set_read_timeout(Some(timeout));
    if args.connected
        && let Err(e) = s.connect(args.to)
    {
        return failure("connect", &e);
    }
    let mut replies = Vec::new();
    let mut peers = Vec::new();
    let mut buf = [0u8; 1500];
    let targets: Vec<SocketAddr> =
        if args.connected { vec![args.to] } else { std::iter::once(args.to).chain(args.also.iter().copied()).collect() };
    for _ in 0..args.per_socket.max(1) {
        for to in &targets {
            let sent = if args.connected { s.send(args.message.as_bytes()) } else { s.send_to(args.message.as_bytes(), to) };
            if let Err(e) = sent {
                return failure("send", &e);
            }
            if args.hold && replies.is_empty() {
                hold(&s);
            }
            match s.recv_from(&mut buf) {
                Ok((n, from)) => {
                    replies.push(String::from_utf8_lossy(&buf[..n]).trim().to_string());
                    peers.push(from.to_string());
                }
                Err(e) => return failure("recv", &e),
            }
        }
    }
    let connected_peer = if args.connected { s.peer_addr().map(|p| p.to_string()).ok() } else { None };
    // Per target: every datagram to one address reached one backend.
    let n = targets.len();
    let same = (0..n).all(|t| replies.iter().skip(t).step_by(n).collect::<Vec<_>>().windows(2).all(|w| w[0] == w[1]));
    json!({
        "ok": true,
        "peer": peers.first().cloned().unwrap_or_default(),
        "reply": replies.first().cloned().unwrap_or_default(),
        "peers": peers,
        "replies": replies,
        "sameBackend": same,
        "connectedPeer": connected_peer,
    })
}

/// `--stream`: one socket, `--count` exchanges, one line each (with its
/// sequence number `seq`).
fn stream(args: &ProbeArgs, timeout: Duration) -> anyhow::Result<ExitCode> {
    let mut failed = false;
    let opened = if args.udp { udp_stream(args, timeout) } else { tcp_stream(args, timeout) };
    let mut exchange = match opened {
        Ok(f) => f,
        Err(line) => {
            print_line(&line)?;
            return Ok(ExitCode::from(1));
        }
    };
    let mut reconnected = false;
    for seq in 0..args.count {
        if seq > 0 {
            pause(args);
        }
        let mut line = exchange();
        line["seq"] = json!(seq);
        if std::mem::take(&mut reconnected) {
            line["reconnected"] = json!(true);
        }
        let ok = line.get("ok") == Some(&json!(true));
        let closing = ok && args.graceful && line["reply"].as_str().is_some_and(|r| r.split_whitespace().last() == Some("closing"));
        if closing {
            line["closing"] = json!(true);
        }
        failed |= !ok;
        print_line(&line)?;
        let timed_out = matches!(line["errno"].as_i64(), Some(e) if e == i64::from(libc::EAGAIN));
        if closing || (!ok && args.reconnect && !timed_out) {
            match if args.udp { udp_stream(args, timeout) } else { tcp_stream(args, timeout) } {
                Ok(f) => {
                    exchange = f;
                    reconnected = true;
                }
                Err(line) => {
                    print_line(&line)?;
                    failed = true;
                    break;
                }
            }
        } else if !ok && !args.udp {
            break;
        }
    }
    Ok(if failed { ExitCode::from(1) } else { ExitCode::SUCCESS })
}

/// One exchange over a stream's socket: its JSON line without `seq`.
type Exchange = Box<dyn FnMut() -> serde_json::Value>;

/// A connected TCP socket that sends `--message` as a line and reads one
/// line back per exchange.
fn tcp_stream(args: &ProbeArgs, timeout: Duration) -> Result<Exchange, serde_json::Value> {
    use std::io::BufRead;
    let connected = match args.bind {
        Some(from) => connect_from(from, args.to, timeout),
        None => TcpStream::connect_timeout(&args.to, timeout),
    };
    let mut s = connected.map_err(|e| failure("connect", &e))?;
    let _ = s.set_read_timeout(Some(timeout));
    let _ = s.set_write_timeout(Some(timeout));
    let peer = s.peer_addr().map(|p| p.to_string()).unwrap_or_default();
    let mut reader = std::io::BufReader::new(s.try_clone().map_err(|e| failure("connect", &e))?);
    let message = format!("{}\n", args.message.trim_end_matches('\n'));
    Ok(Box::new(move || {
        if let Err(e) = s.write_all(message.as_bytes()) {
            return failure("send", &e);
        }
        let mut reply = String::new();
        match reader.read_line(&mut reply) {
            Ok(0) => json!({"ok": false, "stage": "recv", "errno": null, "error": "connection closed by the peer"}),
            Ok(_) => json!({"ok": true, "peer": peer, "reply": reply.trim()}),
            Err(e) => failure("recv", &e),
        }
    }))
}

/// A UDP socket (connected with --connected) that sends `--message` and
/// reads one datagram per exchange. A reply that arrives after its
/// exchange timed out is discarded before the next send, so it is never
/// taken for the next exchange's.
fn udp_stream(args: &ProbeArgs, timeout: Duration) -> Result<Exchange, serde_json::Value> {
    let any: std::net::IpAddr =
        if args.to.is_ipv4() { std::net::Ipv4Addr::UNSPECIFIED.into() } else { std::net::Ipv6Addr::UNSPECIFIED.into() };
    let s = UdpSocket::bind(SocketAddr::new(args.bind.unwrap_or(any), 0)).map_err(|e| failure("bind", &e))?;
    let _ = s.set_read_timeout(Some(timeout));
    if args.connected {
        s.connect(args.to).map_err(|e| failure("connect", &e))?;
    }
    let (to, connected, message) = (args.to, args.connected, args.message.clone());
    let mut buf = [0u8; 1500];
    Ok(Box::new(move || {
        if s.set_nonblocking(true).is_ok() {
            while s.recv_from(&mut buf).is_ok() {}
            let _ = s.set_nonblocking(false);
        }
        let sent = if connected { s.send(message.as_bytes()) } else { s.send_to(message.as_bytes(), to) };
        if let Err(e) = sent {
            return failure("send", &e);
        }
        match s.recv_from(&mut buf) {
            Ok((n, from)) => json!({"ok": true, "peer": from.to_string(), "reply": String::from_utf8_lossy(&buf[..n]).trim()}),
            Err(e) => failure("recv", &e),
        }
    }))
}

/// See `--hold`. The reverse translation runs when the application reads
/// (cgroup/recvmsg hooks run in recvmsg(), not on arrival), so a reply
/// read after the wait meets whatever datapath is installed by then.
fn hold(s: &UdpSocket) {
    let cookie = proxy_agent::datapath::socket_loader::socket_cookie(s.as_fd()).ok();
    let out = std::io::stdout();
    let mut lock = out.lock();
    let _ = writeln!(lock, "{}", json!({"held": true, "cookie": cookie}));
    let _ = lock.flush();
    drop(lock);
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
}
