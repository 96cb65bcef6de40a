//! `serve-hostname --lines --drain-secs` and `probe --stream --graceful`:
//! the backend and the long-lived clients of the e2e disruption run (issue
//! #36). A backend that gets SIGTERM goes on answering, says `closing` in
//! each answer and closes its TCP connections after it; a graceful client
//! takes that as the end of its socket and opens a new one, so no exchange
//! fails. Over loopback only: no datapath is involved.

use std::io::{BufRead, BufReader};
use std::net::{TcpListener, UdpSocket};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

fn agent() -> &'static str {
    env!("CARGO_BIN_EXE_proxy-agent")
}

/// A loopback port free for TCP and UDP alike.
fn free_port() -> u16 {
    loop {
        let tcp = TcpListener::bind("127.0.0.1:0").expect("bind tcp");
        let port = tcp.local_addr().expect("address").port();
        if UdpSocket::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

/// The backend, killed when dropped.
struct Backend(Child);

impl Drop for Backend {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn backend(port: u16) -> Backend {
    let mut child = Command::new(agent())
        .args(["serve-hostname", "--name", "pod-a", "--lines", "--drain-secs", "3", "--listen"])
        .arg(format!("127.0.0.1:{port}"))
        .stdout(Stdio::piped())
        .spawn()
        .expect("serve-hostname");
    let mut ready = String::new();
    BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut ready).expect("ready line");
    assert_eq!(ready.trim(), "ready");
    Backend(child)
}

fn lines(out: &[u8]) -> Vec<serde_json::Value> {
    String::from_utf8_lossy(out).lines().map(|l| serde_json::from_str(l).expect("a JSON line")).collect()
}

#[test]
fn a_draining_backend_ends_streams_cleanly_and_graceful_clients_reconnect() {
    for udp in [false, true] {
        let port = free_port();
        let server = backend(port);
        let mut probe = Command::new(agent());
        probe.args(["probe", "--stream", "--graceful", "--count", "16", "--interval-ms", "100", "--to"]).arg(format!("127.0.0.1:{port}"));
        if udp {
            probe.args(["--udp", "--connected"]);
        }
        let client = probe.stdout(Stdio::piped()).spawn().expect("probe");
        std::thread::sleep(Duration::from_millis(600));
        // SAFETY: kill(2) on our own child's pid.
        assert_eq!(unsafe { libc::kill(server.0.id() as i32, libc::SIGTERM) }, 0);
        let out = client.wait_with_output().expect("probe output");
        let lines = lines(&out.stdout);
        let what = if udp { "udp" } else { "tcp" };
        assert!(out.status.success(), "{what}: {lines:?}");
        assert_eq!(lines.len(), 16, "{what}: {lines:?}");
        assert!(lines.iter().all(|l| l["ok"] == true), "{what}: {lines:?}");
        let first_closing = lines.iter().position(|l| l["closing"] == true).expect("a closing answer after SIGTERM");
        assert!(first_closing > 0, "{what}: answers before SIGTERM are plain: {lines:?}");
        assert_eq!(lines[0]["reply"], "pod-a");
        for pair in lines[first_closing..].windows(2) {
            assert_eq!(pair[0]["closing"], true, "{what}: every answer while draining says so: {lines:?}");
            assert_eq!(pair[1]["reconnected"], true, "{what}: a new socket after each closing answer: {lines:?}");
        }
        drop(server);
    }
}

#[test]
fn a_line_backend_still_answers_a_one_shot_client() {
    let port = free_port();
    let _server = backend(port);
    let out = Command::new(agent()).args(["probe", "--count", "3", "--to"]).arg(format!("127.0.0.1:{port}")).output().expect("probe");
    let lines = lines(&out.stdout);
    assert!(out.status.success(), "{lines:?}");
    assert!(lines.iter().all(|l| l["reply"] == "pod-a"), "{lines:?}");
}
