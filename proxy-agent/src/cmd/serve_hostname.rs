//! `proxy-agent serve-hostname`: a backend that answers with its name over
//! TCP and UDP, like Kubernetes' serve_hostname test image. The tests and the
//! demo run it inside their pod namespaces.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, UdpSocket};
use std::process::ExitCode;
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
}

pub(crate) fn serve(args: ServeArgs) -> anyhow::Result<ExitCode> {
    let mut threads = Vec::new();
    for addr in &args.listen {
        if !args.udp_only {
            let l = TcpListener::bind(addr).with_context(|| format!("binding tcp {addr}"))?;
            let name = args.name.clone();
            threads.push(std::thread::spawn(move || tcp_loop(l, &name)));
        }
        if !args.tcp_only {
            let s = UdpSocket::bind(addr).with_context(|| format!("binding udp {addr}"))?;
            let name = args.name.clone();
            threads.push(std::thread::spawn(move || udp_loop(s, &name)));
        }
    }
    // Tell whoever started us that every socket is bound.
    println!("ready");
    for t in threads {
        let _ = t.join();
    }
    Ok(ExitCode::SUCCESS)
}

fn tcp_loop(l: TcpListener, name: &str) {
    for conn in l.incoming() {
        let Ok(mut c) = conn else { continue };
        let name = name.to_string();
        std::thread::spawn(move || {
            let _ = c.set_read_timeout(Some(Duration::from_millis(500)));
            let mut buf = [0u8; 512];
            // Read what the client sends (until it half-closes or pauses),
            // then answer and close.
            let _ = c.read(&mut buf);
            let _ = c.write_all(name.as_bytes());
        });
    }
}

fn udp_loop(s: UdpSocket, name: &str) {
    let mut buf = [0u8; 1500];
    loop {
        if let Ok((_, from)) = s.recv_from(&mut buf) {
            let _ = s.send_to(name.as_bytes(), from);
        }
    }
}
