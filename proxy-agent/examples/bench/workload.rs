//! The measured work: TCP connect + 1-byte exchange + close, and UDP
//! send + receive, from a client thread inside the benchmark namespace.
//!
//! Listener and client threads enter the namespace with setns(2), which
//! switches only the calling thread's network namespace; the process as a
//! whole sits in the benchmark cgroup so its sockets meet the socket
//! programs exactly as a pod's would.

use std::fs::File;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Moves the calling thread into the network namespace at `ns_path`.
pub(crate) fn enter_netns(ns_path: &Path) -> io::Result<()> {
    let f = File::open(ns_path)?;
    // SAFETY: setns on a valid namespace fd; affects this thread only.
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Starts a thread that enters the namespace at `ns_path`, binds with
/// `bind` and then runs `serve` on what it bound. Returns once the bind has
/// succeeded (with the thread) or failed (with its error), so callers can
/// send traffic right away.
pub(crate) fn serve_in_netns<S: 'static>(
    ns_path: &Path,
    bind: impl FnOnce() -> io::Result<S> + Send + 'static,
    serve: impl FnOnce(S) + Send + 'static,
) -> io::Result<JoinHandle<()>> {
    let ns = ns_path.to_path_buf();
    let (tx, rx) = std::sync::mpsc::channel();
    let handle = std::thread::spawn(move || match enter_netns(&ns).and_then(|()| bind()) {
        Ok(bound) => {
            let _ = tx.send(Ok(()));
            serve(bound);
        }
        Err(e) => {
            let _ = tx.send(Err(e));
        }
    });
    rx.recv().map_err(io::Error::other)??;
    Ok(handle)
}

/// Echo servers (TCP and UDP, one byte back per request) on `addrs`, inside
/// the namespace. They stop when `stop` is set.
pub(crate) fn start_echo(ns_path: &Path, addrs: &[SocketAddr], stop: Arc<AtomicBool>) -> io::Result<Vec<JoinHandle<()>>> {
    let mut handles = Vec::new();
    for addr in addrs {
        let (addr, stop_tcp, stop_udp) = (*addr, stop.clone(), stop.clone());
        handles.push(serve_in_netns(
            ns_path,
            move || TcpListener::bind(addr),
            move |l| {
                // Blocking accept: polling would add its own latency to
                // every round. The thread ends with the process.
                while !stop_tcp.load(Ordering::Relaxed) {
                    if let Ok((mut c, _)) = l.accept() {
                        let mut b = [0u8; 1];
                        if c.read_exact(&mut b).is_ok() {
                            let _ = c.write_all(&b);
                        }
                    }
                }
            },
        )?);
        handles.push(serve_in_netns(
            ns_path,
            move || UdpSocket::bind(addr),
            move |s| {
                let _ = s.set_read_timeout(Some(Duration::from_millis(50)));
                let mut b = [0u8; 64];
                while !stop_udp.load(Ordering::Relaxed) {
                    if let Ok((n, from)) = s.recv_from(&mut b) {
                        let _ = s.send_to(&b[..n], from);
                    }
                }
            },
        )?);
    }
    Ok(handles)
}

/// One TCP round: connect, send a byte, read it back, close.
fn tcp_round(to: SocketAddr) -> io::Result<()> {
    let mut s = TcpStream::connect(to)?;
    s.set_nodelay(true)?;
    s.write_all(b"x")?;
    let mut b = [0u8; 1];
    s.read_exact(&mut b)?;
    Ok(())
}

/// One UDP round on a fresh unconnected socket: sendto, recvfrom.
fn udp_round(to: SocketAddr) -> io::Result<()> {
    let s = UdpSocket::bind("0.0.0.0:0")?;
    s.set_read_timeout(Some(Duration::from_secs(1)))?;
    s.send_to(b"x", to)?;
    let mut b = [0u8; 8];
    s.recv_from(&mut b)?;
    Ok(())
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Proto {
    Tcp,
    Udp,
}

/// Rounds `measure` runs before the measured ones, not timed.
pub(crate) const WARMUP: usize = 50;

/// Runs `rounds` rounds from a thread inside `ns_path` and returns each
/// round's latency in nanoseconds (failures are counted separately). Round
/// `i` dials `to[i % to.len()]`: a baseline that dials backends directly
/// spreads its rounds over the same listeners a Service would, so both meet
/// the same mix of warm and cold listener threads.
pub(crate) fn measure(ns_path: &Path, to: &[SocketAddr], proto: Proto, rounds: usize) -> io::Result<(Vec<u64>, usize)> {
    let ns = ns_path.to_path_buf();
    let to = to.to_vec();
    if to.is_empty() {
        return Err(io::Error::other("no address to measure"));
    }
    std::thread::spawn(move || -> io::Result<(Vec<u64>, usize)> {
        enter_netns(&ns)?;
        // Warm up caches, the route and the conntrack tables.
        for i in 0..WARMUP {
            let to = to[i % to.len()];
            let _ = if proto == Proto::Tcp { tcp_round(to) } else { udp_round(to) };
        }
        let mut lat = Vec::with_capacity(rounds);
        let mut failed = 0;
        for i in 0..rounds {
            let to = to[i % to.len()];
            let t = Instant::now();
            let r = if proto == Proto::Tcp { tcp_round(to) } else { udp_round(to) };
            match r {
                Ok(()) => lat.push(t.elapsed().as_nanos() as u64),
                Err(_) => failed += 1,
            }
        }
        Ok((lat, failed))
    })
    .join()
    .map_err(|_| io::Error::other("measuring thread panicked"))?
}
