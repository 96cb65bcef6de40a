//! Throwaway network namespaces, cgroups and processes for the privileged
//! tests, the demo and the benchmarks.
//!
//! Every namespace made here is isolated: it has no link to the host's
//! namespace, so a ClusterIP that is not translated ends in "network
//! unreachable" and never leaves the machine. Every object removes itself on
//! drop, also when a test panics; names carry the creating process id so
//! that leftovers of a killed run are swept by the next one.

use std::ffi::CString;
use std::fs;
use std::io;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use proxy_agent::datapath::{mounts, socket_loader};

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A unique name `PREFIX-PID-N`; short, since interface and namespace names
/// are limited.
fn unique(prefix: &str) -> String {
    format!("{prefix}-{}-{}", std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed))
}

/// Whether a `PREFIX-PID-N` name belongs to a process that is gone.
fn stale(name: &str, prefix: &str) -> bool {
    let Some(rest) = name.strip_prefix(prefix).and_then(|r| r.strip_prefix('-')) else { return false };
    let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else { return false };
    pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists()
}

fn run(cmd: &mut Command) -> io::Result<()> {
    let out = cmd.stdin(Stdio::null()).output()?;
    if out.status.success() {
        Ok(())
    } else {
        Err(io::Error::other(format!("{cmd:?} failed: {}", String::from_utf8_lossy(&out.stderr).trim())))
    }
}

/// A network namespace with only loopback, brought up.
#[derive(Debug)]
pub struct Netns {
    name: String,
}

impl Netns {
    pub fn new(prefix: &str) -> io::Result<Netns> {
        Self::sweep(prefix);
        let name = unique(prefix);
        run(Command::new("ip").args(["netns", "add", &name]))?;
        let ns = Netns { name };
        ns.ip(&["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// Removes namespaces of earlier runs that were killed before cleaning up.
    fn sweep(prefix: &str) {
        if let Ok(rd) = fs::read_dir("/run/netns") {
            for e in rd.flatten() {
                let n = e.file_name().to_string_lossy().into_owned();
                if stale(&n, prefix) {
                    let _ = run(Command::new("ip").args(["netns", "del", &n]));
                }
            }
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn path(&self) -> PathBuf {
        PathBuf::from("/run/netns").join(&self.name)
    }

    /// Runs `ip -n NAME ARGS...`.
    pub fn ip(&self, args: &[&str]) -> io::Result<()> {
        run(Command::new("ip").arg("-n").arg(&self.name).args(args))
    }

    /// Adds addresses to loopback, e.g. `10.244.1.5/32` or `fd00::5/128`.
    /// Loopback addresses are reachable from every process in the namespace
    /// and from nowhere else.
    pub fn add_loopback_addrs(&self, cidrs: &[&str]) -> io::Result<()> {
        for c in cidrs {
            let mut args = vec!["addr", "add", c, "dev", "lo"];
            if c.contains(':') {
                args.push("nodad");
            }
            self.ip(&args)?;
        }
        Ok(())
    }
}

impl Netns {
    /// A veth pair between this namespace (`name`) and `peer` (`peer_name`),
    /// both ends created directly inside their namespaces (never in the
    /// host's) and brought up. Deleting either namespace deletes the pair.
    pub fn veth(&self, name: &str, peer: &Netns, peer_name: &str) -> io::Result<()> {
        run(Command::new("ip")
            .args(["link", "add", name, "netns", &self.name, "type", "veth", "peer", "name", peer_name, "netns", &peer.name]))?;
        self.ip(&["link", "set", name, "up"])?;
        peer.ip(&["link", "set", peer_name, "up"])
    }

    /// Sets a sysctl inside the namespace (e.g. `net.ipv4.ip_forward=1`).
    /// /proc/sys/net is per network namespace, so a thread that entered the
    /// namespace writes the namespace's own copy.
    pub fn sysctl(&self, key: &str, value: &str) -> io::Result<()> {
        let path = format!("/proc/sys/{}", key.replace('.', "/"));
        let value = value.to_string();
        in_netns(self, move || fs::write(&path, value))?
    }
}

/// Runs `f` on a fresh thread that has joined `netns` (setns(2) changes
/// only the calling thread's namespace), so sockets `f` creates belong to
/// that namespace. Tests use it for in-process clients and servers.
pub fn in_netns<T: Send + 'static>(netns: &Netns, f: impl FnOnce() -> T + Send + 'static) -> io::Result<T> {
    let file = fs::File::open(netns.path())?;
    std::thread::spawn(move || -> io::Result<T> {
        // SAFETY: setns on an open namespace file; affects this thread only.
        if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(f())
    })
    .join()
    .map_err(|_| io::Error::other("thread in netns panicked"))?
}

/// Like [`in_netns`] but returns the thread's handle instead of waiting.
pub fn spawn_in_netns<T: Send + 'static>(
    netns: &Netns,
    f: impl FnOnce() -> T + Send + 'static,
) -> io::Result<std::thread::JoinHandle<io::Result<T>>> {
    let file = fs::File::open(netns.path())?;
    Ok(std::thread::spawn(move || -> io::Result<T> {
        // SAFETY: as in `in_netns`.
        if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(f())
    }))
}

/// A TCP server on `addr` inside `netns` that answers every line with
/// `echo LINE` on long-lived connections, and reports each client's address
/// (as the server sees it: translated or not) on the returned channel.
/// Returns once the socket listens.
pub fn echo_server(netns: &Netns, addr: SocketAddr) -> io::Result<std::sync::mpsc::Receiver<SocketAddr>> {
    use std::io::{BufRead, BufReader, Write};
    let (tx, rx) = std::sync::mpsc::channel();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    spawn_in_netns(netns, move || {
        let l = match std::net::TcpListener::bind(addr) {
            Ok(l) => l,
            Err(e) => return ready_tx.send(Err(e)).ok(),
        };
        ready_tx.send(Ok(())).ok()?;
        for c in l.incoming() {
            let Ok(c) = c else { continue };
            if let Ok(peer) = c.peer_addr() {
                let _ = tx.send(peer);
            }
            std::thread::spawn(move || {
                let Ok(read) = c.try_clone() else { return };
                let mut r = BufReader::new(read);
                let mut w = c;
                let mut line = String::new();
                while r.read_line(&mut line).is_ok_and(|n| n > 0) {
                    if w.write_all(format!("echo {line}").as_bytes()).is_err() {
                        break;
                    }
                    line.clear();
                }
            });
        }
        Some(())
    })?;
    ready_rx.recv_timeout(Duration::from_secs(5)).map_err(|_| io::Error::other("echo server did not start"))??;
    Ok(rx)
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = run(Command::new("ip").args(["netns", "del", &self.name]));
    }
}

/// A cgroup v2 directory below the cgroup2 root.
#[derive(Debug)]
pub struct Cgroup {
    path: PathBuf,
}

impl Cgroup {
    pub fn new(prefix: &str) -> io::Result<Cgroup> {
        let root = mounts::cgroup2_root().map_err(io::Error::other)?;
        if let Ok(rd) = fs::read_dir(&root) {
            for e in rd.flatten() {
                if stale(&e.file_name().to_string_lossy(), prefix) {
                    let _ = Cgroup { path: e.path() }.remove();
                }
            }
        }
        let path = root.join(unique(prefix));
        fs::create_dir(&path)?;
        Ok(Cgroup { path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn remove(&self) -> io::Result<()> {
        // A cgroup can only be removed once it is empty: kill what is left
        // (cgroup.kill exists since 5.14; fall back to signalling each pid).
        if fs::write(self.path.join("cgroup.kill"), "1").is_err()
            && let Ok(pids) = fs::read_to_string(self.path.join("cgroup.procs"))
        {
            for pid in pids.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
                // SAFETY: plain kill(2).
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            match fs::remove_dir(&self.path) {
                Ok(()) => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
                Err(e) if Instant::now() > deadline => return Err(e),
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        let _ = self.remove();
    }
}

/// A command that starts inside `cgroup` (when given) and network namespace
/// `netns` (when given). The cgroup is joined before the namespace switch
/// because `ip netns exec` style remounts would hide /sys/fs/cgroup; setns()
/// keeps the filesystem view.
pub fn command_in(program: impl AsRef<std::ffi::OsStr>, netns: Option<&Netns>, cgroup: Option<&Cgroup>) -> io::Result<Command> {
    command_at(program, netns.map(Netns::path).as_deref(), cgroup.map(Cgroup::path))
}

/// [`command_in`] by path: the namespace's file (`/run/netns/NAME`) and
/// the cgroup's directory, for threads that outlive the borrow of a
/// [`Netns`] or [`Cgroup`].
pub fn command_at(program: impl AsRef<std::ffi::OsStr>, netns: Option<&Path>, cgroup: Option<&Path>) -> io::Result<Command> {
    let mut cmd = Command::new(program);
    let ns_file = match netns {
        Some(ns) => Some(fs::File::open(ns)?),
        None => None,
    };
    let procs = match cgroup {
        Some(cg) => Some(CString::new(cg.join("cgroup.procs").as_os_str().as_bytes()).map_err(io::Error::other)?),
        None => None,
    };
    // SAFETY: the closure only makes async-signal-safe system calls
    // (open, write, close, setns) on data prepared before fork.
    unsafe {
        cmd.pre_exec(move || {
            if let Some(p) = &procs {
                let fd = libc::open(p.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd < 0 {
                    return Err(io::Error::last_os_error());
                }
                // Writing "0" moves the writing process itself.
                let rc = libc::write(fd, b"0".as_ptr().cast(), 1);
                libc::close(fd);
                if rc != 1 {
                    return Err(io::Error::last_os_error());
                }
            }
            if let Some(f) = &ns_file
                && libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) != 0
            {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    Ok(cmd)
}

/// A child process that is killed and reaped on drop.
#[derive(Debug)]
pub struct Guarded(pub Child);

impl Guarded {
    pub fn spawn(cmd: &mut Command) -> io::Result<Guarded> {
        Ok(Guarded(cmd.spawn()?))
    }

    /// Sends SIGTERM and waits up to `timeout` for the exit; SIGKILL after.
    pub fn terminate(&mut self, timeout: Duration) -> io::Result<()> {
        if let Ok(pid) = i32::try_from(self.0.id()) {
            // SAFETY: plain kill(2) on our own child.
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if self.0.try_wait()?.is_some() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        self.0.kill()?;
        self.0.wait().map(|_| ())
    }
}

impl Drop for Guarded {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A pin directory that is reset (links detached, maps removed) on drop.
#[derive(Debug)]
pub struct PinDir {
    path: PathBuf,
}

impl PinDir {
    /// A fresh directory below `/sys/fs/bpf` (bpffs is mounted when missing).
    pub fn new(prefix: &str) -> io::Result<PinDir> {
        let base = PathBuf::from("/sys/fs/bpf");
        if let Ok(rd) = fs::read_dir(&base) {
            for e in rd.flatten() {
                if stale(&e.file_name().to_string_lossy(), prefix) {
                    let _ = socket_loader::reset(&e.path());
                }
            }
        }
        let path = base.join(unique(prefix));
        mounts::ensure_pin_dir(&path).map_err(io::Error::other)?;
        Ok(PinDir { path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for PinDir {
    fn drop(&mut self) {
        let _ = socket_loader::reset(&self.path);
    }
}

/// Runs `program serve-hostname` as a backend named `name` on `listen`
/// inside `netns`, and waits until its sockets are bound.
pub fn spawn_backend(agent: &Path, netns: &Netns, name: &str, listen: &[String]) -> io::Result<Guarded> {
    use std::io::BufRead;
    let mut cmd = command_in(agent, Some(netns), None)?;
    cmd.arg("serve-hostname").arg("--name").arg(name).arg("--listen").args(listen);
    cmd.stdout(Stdio::piped()).stderr(Stdio::inherit()).stdin(Stdio::null());
    let mut g = Guarded::spawn(&mut cmd)?;
    let out = g.0.stdout.take().ok_or_else(|| io::Error::other("no stdout"))?;
    let mut line = String::new();
    io::BufReader::new(out).read_line(&mut line)?;
    if line.trim() != "ready" {
        return Err(io::Error::other(format!("backend {name} did not start on {listen:?}")));
    }
    Ok(g)
}
