//! A relay from inside a network namespace to an address in the host's:
//! a listening socket created inside the namespace (a socket stays in the
//! namespace it was made in) whose connections this process accepts and
//! copies, byte for byte, to the address from the test's own namespace.
//! So a process in a namespace with no link to the host (kube-proxy, an
//! agent attaching TC to the namespace's devices) reaches the API server
//! on the host's 127.0.0.1, and nothing else does.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::sandbox::{Netns, in_netns};

/// Copies connections accepted on a listener made inside a namespace to
/// an address in the host's namespace, until dropped.
pub struct Relay {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Relay {
    /// Listens on `listen` inside `netns` and copies each connection to
    /// `to`, reached from this process's namespace.
    pub fn start(netns: &Netns, listen: SocketAddr, to: SocketAddr) -> io::Result<Relay> {
        let listener = in_netns(netns, move || TcpListener::bind(listen))??;
        listener.set_nonblocking(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            while !flag.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((inside, _)) => {
                        let _ = inside.set_nonblocking(false);
                        if let Ok(outside) = TcpStream::connect(to) {
                            pipe(inside, outside);
                        }
                    }
                    // Nothing to accept yet (non-blocking), or a failed
                    // accept: look again shortly.
                    Err(_) => std::thread::sleep(Duration::from_millis(20)),
                }
            }
        });
        Ok(Relay { stop, thread: Some(thread) })
    }
}

/// Two threads copying each direction; each shuts its write side down at
/// EOF, so both end when either peer closes.
fn pipe(a: TcpStream, b: TcpStream) {
    let copy = |mut from: TcpStream, mut to: TcpStream| {
        std::thread::spawn(move || {
            let mut buf = [0u8; 16 * 1024];
            loop {
                match from.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        if to.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                }
            }
            let _ = to.shutdown(Shutdown::Write);
            let _ = from.shutdown(Shutdown::Read);
        });
    };
    if let (Ok(a2), Ok(b2)) = (a.try_clone(), b.try_clone()) {
        copy(a, b2);
        copy(b, a2);
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
