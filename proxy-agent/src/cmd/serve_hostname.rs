//! `proxy-agent serve-hostname`: a backend that answers with its name over
//! TCP and UDP, like Kubernetes' serve_hostname test image. The tests and the
//! demo run it inside their pod namespaces; the e2e disruption run runs it as
//! a Deployment's pods (`--lines --drain-secs`).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context;
use clap::Args;

#[derive(Args)]
pub(crate) struct ServeArgs {
    /// The name to answer with.
    #[arg(long)]
    name: String,
    /// Addresses to listen on, TCP and UDP each.
    #[arg(long, num_args = 1.., required = true)]
    listen: Vec<SocketAddr>,
    /// Listen on TCP only.
    #[arg(long)]
    tcp_only: bool,
    /// Listen on UDP only.
    #[arg(long)]
    udp_only: bool,
    /// TCP: answer every line the client sends with the name and a
    /// newline, on the one connection, until the client closes it (a
    /// long-lived connection, as `probe --stream` keeps). A client that
    /// half-closes after one message gets one answer, as without it.
    #[arg(long)]
    lines: bool,
    /// On SIGTERM, shut down gracefully, as a pod's process should: for
    /// this many seconds go on serving, but end every answer with
    /// ` closing` and, over TCP, close the connection after it (what HTTP's
    /// `Connection: close` tells a client), then exit. Without it SIGTERM
    /// ends the process at once.
    #[arg(long)]
    drain_secs: Option<u64>,
}

/// Set by the SIGTERM handler: from then on, answers say `closing`.
static DRAINING: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigterm(_: libc::c_int) {
    // Only an atomic store: the one kind of work a signal handler may do.
    DRAINING.store(true, Ordering::SeqCst);
}

pub(crate) fn serve(args: ServeArgs) -> anyhow::Result<ExitCode> {
    if args.drain_secs.is_some() {
        // SAFETY: installs a handler that only stores to an atomic, which
        // is async-signal-safe; no other code of this process handles
        // SIGTERM.
        let previous = unsafe { libc::signal(libc::SIGTERM, on_sigterm as *const () as libc::sighandler_t) };
        if previous == libc::SIG_ERR {
            anyhow::bail!("cannot handle SIGTERM: {}", std::io::Error::last_os_error());
        }
    }
    let mut threads = Vec::new();
    for addr in &args.listen {
        if !args.udp_only {
            let l = TcpListener::bind(addr).with_context(|| format!("binding tcp {addr}"))?;
            let (name, lines) = (args.name.clone(), args.lines);
            threads.push(std::thread::spawn(move || tcp_loop(l, &name, lines)));
        }
        if !args.tcp_only {
            let s = UdpSocket::bind(addr).with_context(|| format!("binding udp {addr}"))?;
            let name = args.name.clone();
            threads.push(std::thread::spawn(move || udp_loop(s, &name)));
        }
    }
    // Tell whoever started us that every socket is bound.
    println!("ready");
    if let Some(secs) = args.drain_secs {
        while !DRAINING.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(50));
        }
        // A log line for `kubectl logs`; nobody may be reading stdout any
        // more, and a failed write must not end the drain early.
        let _ = writeln!(std::io::stdout(), "SIGTERM: answering with `closing` for {secs} s, then exiting");
        std::thread::sleep(Duration::from_secs(secs));
        let _ = writeln!(std::io::stdout(), "drained; exiting");
        return Ok(ExitCode::SUCCESS);
    }
    for t in threads {
        let _ = t.join();
    }
    Ok(ExitCode::SUCCESS)
}

/// The answer to one message: the name, and ` closing` once draining.
fn answer(name: &str) -> (String, bool) {
    if DRAINING.load(Ordering::SeqCst) { (format!("{name} closing"), true) } else { (name.to_string(), false) }
}

fn tcp_loop(l: TcpListener, name: &str, lines: bool) {
    for conn in l.incoming() {
        let Ok(c) = conn else { continue };
        let name = name.to_string();
        std::thread::spawn(move || if lines { tcp_lines(c, &name) } else { tcp_once(c, &name) });
    }
}

fn tcp_once(mut c: TcpStream, name: &str) {
    let _ = c.set_read_timeout(Some(Duration::from_millis(500)));
    let mut buf = [0u8; 512];
    // Read what the client sends (until it half-closes or pauses), then
    // answer and close.
    let _ = c.read(&mut buf);
    let _ = c.write_all(answer(name).0.as_bytes());
}

/// One answer per line until the client closes (or, draining, until the
/// first answer, after which this side closes: the client has read a
/// whole answer that tells it so, and no request of its is left unread).
fn tcp_lines(c: TcpStream, name: &str) {
    let Ok(read_half) = c.try_clone() else { return };
    let mut reader = BufReader::new(read_half);
    let mut writer = c;
    let mut line = String::new();
    loop {
        line.clear();
        match reader.read_line(&mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let (text, closing) = answer(name);
        if writer.write_all(format!("{text}\n").as_bytes()).is_err() {
            return;
        }
        if closing {
            // Half-close, then read until the client closes too: closing
            // with unread bytes would send a reset, which can overtake the
            // answer (RFC 1122 4.2.2.13).
            let _ = writer.shutdown(Shutdown::Write);
            let _ = writer.set_read_timeout(Some(Duration::from_secs(5)));
            let mut sink = [0u8; 512];
            while matches!(reader.read(&mut sink), Ok(n) if n > 0) {}
            return;
        }
    }
}

fn udp_loop(s: UdpSocket, name: &str) {
    let mut buf = [0u8; 1500];
    loop {
        if let Ok((_, from)) = s.recv_from(&mut buf) {
            let _ = s.send_to(answer(name).0.as_bytes(), from);
        }
    }
}
