//! Real software as pods: nginx (Debian's `nginx-light`) as a backend, curl
//! and wrk as clients, for the tests that check what an application sees
//! while its backends drain, quit and leave, rather than what a probe sees.
//! `cargo xtask setup` installs the three packages.
//!
//! Each program runs in a namespace the test made and, for a client of a
//! ClusterIP, in the node's cgroup, so the socket programs translate its
//! connect(). Nothing here adds addresses or routes: the test gives each pod
//! its address, and whatever these programs dial stays inside the namespace.

use std::fmt;
use std::fs;
use std::io::{self, Read};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use crate::sandbox::{Cgroup, Guarded, Netns, command_in, in_netns};

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A fresh directory below the temporary directory, `PREFIX-PID-N`, so
/// that parallel test binaries never share one; those of runs that were
/// killed before cleaning up (their process is gone) are removed first.
fn scratch_dir(prefix: &str) -> io::Result<PathBuf> {
    let tmp = std::env::temp_dir();
    if let Ok(rd) = fs::read_dir(&tmp) {
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let pid = name.strip_prefix(prefix).and_then(|r| r.strip_prefix('-')).and_then(|r| r.split('-').next()?.parse::<u32>().ok());
            if pid.is_some_and(|pid| pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists()) {
                let _ = fs::remove_dir_all(e.path());
            }
        }
    }
    let dir = tmp.join(format!("{prefix}-{}-{}", std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed)));
    fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// The processes whose parent is `pid` (nginx's workers).
fn children_of(pid: u32) -> Vec<i32> {
    let Ok(rd) = fs::read_dir("/proc") else { return Vec::new() };
    rd.flatten()
        .filter_map(|e| {
            let child: i32 = e.file_name().to_str()?.parse().ok()?;
            let stat = fs::read_to_string(e.path().join("stat")).ok()?;
            // "PID (COMM) STATE PPID ...", where COMM may hold anything.
            let ppid: u32 = stat.rsplit_once(')')?.1.split_whitespace().nth(1)?.parse().ok()?;
            (ppid == pid).then_some(child)
        })
        .collect()
}

/// Waits up to `timeout` for `child` to exit by itself.
fn wait_for_exit(child: &mut Guarded, timeout: Duration) -> io::Result<Option<ExitStatus>> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.0.try_wait()? {
            return Ok(Some(status));
        }
        if Instant::now() > deadline {
            return Ok(None);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Everything left in a pipe of an exited child.
fn drain(pipe: Option<impl Read>) -> String {
    let mut text = String::new();
    if let Some(mut p) = pipe {
        let _ = p.read_to_string(&mut text);
    }
    text
}

/// One nginx (master and one worker) serving a pod's address: `/name`
/// answers the pod's name, `/file` a generated file of a chosen size, and
/// every response names the pod in an `X-Backend` header, so a client can
/// tell which backend served it. Stopped, with its workers, on drop.
pub struct Nginx {
    name: String,
    dir: PathBuf,
    master: Guarded,
    file_bytes: u64,
}

impl Nginx {
    /// The path of the pod's name (a few bytes, for request loads).
    pub const NAME_PATH: &'static str = "/name";
    /// The path of the generated file (for long downloads).
    pub const FILE_PATH: &'static str = "/file";

    /// Starts nginx for pod `name` on `listen` inside `netns` and returns
    /// once it accepts connections. `rate` (bytes per second) paces every
    /// response of `/file` at the server: on loopback the kernel's socket
    /// buffers would otherwise take megabytes at once, and nginx would be
    /// done with a response long before its client, so a graceful quit
    /// would have nothing in flight to wait for. A request of
    /// `/file?rate=N` is paced at N bytes per second instead (nginx's
    /// writable `$limit_rate`), for a download whose length a test sets
    /// once it knows how long its steps take.
    pub fn start(netns: &Netns, name: &str, listen: SocketAddr, file_bytes: u64, rate: Option<u64>) -> io::Result<Nginx> {
        let dir = scratch_dir("tpt-nginx")?;
        let www = dir.join("www");
        fs::create_dir_all(&www)?;
        // Not zeros, so nothing on the way could shrink it.
        let pattern: Vec<u8> = (0..=255u8).cycle().take(1 << 16).collect();
        let mut file = Vec::with_capacity(file_bytes as usize);
        while (file.len() as u64) < file_bytes {
            let left = (file_bytes - file.len() as u64).min(pattern.len() as u64) as usize;
            file.extend_from_slice(&pattern[..left]);
        }
        fs::write(www.join(&Self::FILE_PATH[1..]), file)?;
        let d = dir.display();
        let limit = rate.map_or(String::new(), |r| format!("limit_rate {r};"));
        // As root, nginx would switch its workers to `nobody` and write its
        // temporary files under /var/lib/nginx: keep both in the test's
        // hands. The small send buffer keeps what the kernel holds for a
        // paced response small too. `keepalive_requests` lifts the default
        // 1,000 requests per connection, so a keep-alive client keeps its
        // connections (and its backends) across a whole test.
        let conf = format!(
            "user root;
worker_processes 1;
daemon off;
pid {d}/nginx.pid;
error_log {d}/error.log notice;
events {{ worker_connections 1024; }}
http {{
  access_log off;
  client_body_temp_path {d}/body;
  proxy_temp_path {d}/proxy;
  fastcgi_temp_path {d}/fastcgi;
  uwsgi_temp_path {d}/uwsgi;
  scgi_temp_path {d}/scgi;
  default_type application/octet-stream;
  keepalive_requests 1000000;
  server {{
    listen {listen} sndbuf=65536;
    add_header X-Backend {name} always;
    location = {name_path} {{ default_type text/plain; return 200 \"{name}\\n\"; }}
    location = {file_path} {{ root {d}/www; {limit} if ($arg_rate) {{ set $limit_rate $arg_rate; }} }}
  }}
}}
",
            name_path = Self::NAME_PATH,
            file_path = Self::FILE_PATH,
        );
        let conf_path = dir.join("nginx.conf");
        fs::write(&conf_path, conf)?;
        let mut cmd = command_in("nginx", Some(netns), None)?;
        cmd.arg("-p").arg(&dir).arg("-e").arg(dir.join("error.log")).arg("-c").arg(&conf_path);
        cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
        // A test binary killed outright cannot stop nginx on drop: SIGTERM
        // (nginx's fast shutdown, which stops its workers too) then comes
        // from the kernel, once the thread that started nginx is gone. In
        // the test's process group, nginx also gets a terminal's Ctrl-C.
        // SAFETY: prctl(2) is async-signal-safe and touches only the child.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut nginx = Nginx { name: name.to_string(), dir, master: Guarded::spawn(&mut cmd)?, file_bytes };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let accepts = in_netns(netns, move || TcpStream::connect_timeout(&listen, Duration::from_millis(200)).is_ok())?;
            if accepts {
                return Ok(nginx);
            }
            if nginx.master.0.try_wait()?.is_some() || Instant::now() > deadline {
                return Err(io::Error::other(format!("nginx {name} did not start on {listen}: {}", nginx.error_log())));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The size of `/file`.
    pub fn file_bytes(&self) -> u64 {
        self.file_bytes
    }

    /// Graceful shutdown, `nginx -s quit`: SIGQUIT to the master. nginx
    /// closes its listening socket and idle keep-alive connections at once,
    /// finishes the responses in flight, then exits.
    pub fn quit(&self) {
        if let Ok(pid) = i32::try_from(self.master.0.id()) {
            // SAFETY: plain kill(2) on our own, not yet reaped, child.
            unsafe { libc::kill(pid, libc::SIGQUIT) };
        }
    }

    /// Waits up to `timeout` for nginx to exit; its status, or `None`
    /// while it still runs.
    pub fn wait_exit(&mut self, timeout: Duration) -> io::Result<Option<ExitStatus>> {
        wait_for_exit(&mut self.master, timeout)
    }

    pub fn running(&mut self) -> bool {
        matches!(self.master.0.try_wait(), Ok(None))
    }

    /// nginx's own log, for failure messages.
    pub fn error_log(&self) -> String {
        fs::read_to_string(self.dir.join("error.log")).unwrap_or_default()
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        // SIGTERM: fast shutdown; the master exits only once its workers
        // have. A SIGKILLed master would leave its workers running (and the
        // namespace alive), so SIGKILL is the last resort, for the workers
        // too, while they are still the stuck master's children.
        if let (Ok(None), Ok(master)) = (self.master.0.try_wait(), i32::try_from(self.master.0.id())) {
            // SAFETY: plain kill(2) on our own, not yet reaped, child.
            unsafe { libc::kill(master, libc::SIGTERM) };
            if matches!(wait_for_exit(&mut self.master, Duration::from_secs(5)), Ok(None)) {
                for w in children_of(self.master.0.id()) {
                    // SAFETY: plain kill(2) on what was a child of the
                    // stuck master a moment ago: one of its workers.
                    unsafe { libc::kill(w, libc::SIGKILL) };
                }
                let _ = self.master.0.kill();
            }
        }
        let _ = self.master.0.wait();
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// curl in `netns`, inside `cgroup` when given (a pod of that node).
fn curl(netns: &Netns, cgroup: Option<&Cgroup>) -> io::Result<std::process::Command> {
    let mut cmd = command_in("curl", Some(netns), cgroup)?;
    // -sS: no progress meter, but errors on stderr.
    cmd.args(["-sS", "--connect-timeout", "5"]).stdin(Stdio::null());
    Ok(cmd)
}

/// One download with curl, running in the background.
pub struct Download {
    curl: Guarded,
    dir: PathBuf,
}

/// What curl reported about a finished download.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DownloadResult {
    /// curl's exit code (0: the whole response arrived); `None` when a
    /// signal ended it.
    pub exit: Option<i32>,
    /// Bytes of body curl received (`%{size_download}`).
    pub size_download: u64,
    pub http_code: u16,
    /// The `X-Backend` header: which pod served it.
    pub backend: String,
    /// Bytes of the file curl wrote.
    pub bytes_written: u64,
    /// curl's error messages.
    pub stderr: String,
}

impl Download {
    /// Starts `curl URL` in `netns` (and `cgroup`), writing the body to a
    /// file of its own. `limit_rate` is curl's `--limit-rate` (e.g. `1M`).
    pub fn start(netns: &Netns, cgroup: Option<&Cgroup>, url: &str, limit_rate: Option<&str>) -> io::Result<Download> {
        let dir = scratch_dir("tpt-curl")?;
        let mut cmd = curl(netns, cgroup)?;
        // A download that hangs (its backend vanished) ends by itself.
        cmd.args(["--max-time", "120", "-o"]).arg(dir.join("body"));
        cmd.args(["-w", "%{size_download} %{http_code} %header{x-backend}"]);
        if let Some(rate) = limit_rate {
            cmd.args(["--limit-rate", rate]);
        }
        cmd.arg(url).stdout(Stdio::piped()).stderr(Stdio::piped());
        Ok(Download { curl: Guarded::spawn(&mut cmd)?, dir })
    }

    /// Whether curl is still downloading.
    pub fn running(&mut self) -> bool {
        matches!(self.curl.0.try_wait(), Ok(None))
    }

    /// Waits up to `timeout` for curl to exit; what it reported.
    pub fn finish(mut self, timeout: Duration) -> io::Result<DownloadResult> {
        let status =
            wait_for_exit(&mut self.curl, timeout)?.ok_or_else(|| io::Error::other(format!("curl still downloading after {timeout:?}")))?;
        let out = drain(self.curl.0.stdout.take());
        let stderr = drain(self.curl.0.stderr.take());
        let mut fields = out.split_whitespace();
        let size_download = fields.next().and_then(|s| s.parse().ok()).unwrap_or(0);
        let http_code = fields.next().and_then(|s| s.parse().ok()).unwrap_or(0);
        let backend = fields.next().unwrap_or_default().to_string();
        let bytes_written = fs::metadata(self.dir.join("body")).map_or(0, |m| m.len());
        Ok(DownloadResult { exit: status.code(), size_download, http_code, backend, bytes_written, stderr: stderr.trim().to_string() })
    }
}

impl Drop for Download {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// One response of [`get_each`]: the HTTP status (0 when the request
/// failed) and the `X-Backend` header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub http_code: u16,
    pub backend: String,
}

/// `count` GETs of `url` by one curl in `netns` (and `cgroup`), each on a
/// new connection (`Connection: close`), so each one's connect() picks a
/// backend: which backend answered each.
pub fn get_each(netns: &Netns, cgroup: Option<&Cgroup>, url: &str, count: usize) -> io::Result<Vec<Reply>> {
    let mut cmd = curl(netns, cgroup)?;
    cmd.args(["--max-time", "5", "-H", "Connection: close", "-w", "%{http_code} %header{x-backend}\\n"]);
    for _ in 0..count {
        cmd.args(["-o", "/dev/null", url]);
    }
    let out = cmd.stderr(Stdio::null()).output()?;
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            let mut f = l.split_whitespace();
            let http_code = f.next().and_then(|c| c.parse().ok()).unwrap_or(0);
            Reply { http_code, backend: f.next().unwrap_or_default().to_string() }
        })
        .collect())
}

/// wrk, the HTTP load generator, running in the background.
pub struct Wrk {
    wrk: Guarded,
    duration: Duration,
}

/// What wrk printed at the end of a run.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct WrkReport {
    /// Completed requests ("N requests in").
    pub requests: u64,
    /// "Socket errors: connect A, read B, write C, timeout D" (wrk prints
    /// the line only when one is not zero).
    pub connect_errors: u64,
    pub read_errors: u64,
    pub write_errors: u64,
    pub timeouts: u64,
    /// "Non-2xx or 3xx responses: N": status 400 and above.
    pub non_2xx_3xx: u64,
}

impl WrkReport {
    pub fn socket_errors(&self) -> u64 {
        self.connect_errors + self.read_errors + self.write_errors + self.timeouts
    }

    /// Reads wrk's summary; `None` without a "requests in" line (wrk did
    /// not run).
    pub fn parse(text: &str) -> Option<WrkReport> {
        let mut r = WrkReport::default();
        let mut seen = false;
        for line in text.lines().map(str::trim) {
            if line.contains(" requests in ") {
                r.requests = line.split_whitespace().next()?.parse().ok()?;
                seen = true;
            } else if let Some(rest) = line.strip_prefix("Socket errors:") {
                for part in rest.split(',') {
                    let mut kv = part.split_whitespace();
                    let (Some(k), Some(v)) = (kv.next(), kv.next().and_then(|v| v.parse().ok())) else { continue };
                    match k {
                        "connect" => r.connect_errors = v,
                        "read" => r.read_errors = v,
                        "write" => r.write_errors = v,
                        "timeout" => r.timeouts = v,
                        _ => {}
                    }
                }
            } else if let Some(rest) = line.strip_prefix("Non-2xx or 3xx responses:") {
                r.non_2xx_3xx = rest.trim().parse().ok()?;
            }
        }
        seen.then_some(r)
    }
}

impl fmt::Display for WrkReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} requests, socket errors: connect {}, read {}, write {}, timeout {}; non-2xx/3xx {}",
            self.requests, self.connect_errors, self.read_errors, self.write_errors, self.timeouts, self.non_2xx_3xx
        )
    }
}

impl Wrk {
    /// Starts `wrk -t1 -cCONNECTIONS -dDURATION --timeout 2s [-H HEADER]...
    /// URL` in `netns` (and `cgroup`).
    pub fn start(
        netns: &Netns,
        cgroup: Option<&Cgroup>,
        url: &str,
        connections: u32,
        duration: Duration,
        headers: &[&str],
    ) -> io::Result<Wrk> {
        let mut cmd = command_in("wrk", Some(netns), cgroup)?;
        cmd.args(["-t1", &format!("-c{connections}"), &format!("-d{}s", duration.as_secs().max(1)), "--timeout", "2s"]);
        for h in headers {
            cmd.args(["-H", h]);
        }
        cmd.arg(url).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        Ok(Wrk { wrk: Guarded::spawn(&mut cmd)?, duration })
    }

    pub fn running(&mut self) -> bool {
        matches!(self.wrk.0.try_wait(), Ok(None))
    }

    /// Ends the run now: wrk stops its connections on SIGINT and prints
    /// the same report as at the end of its duration. For a load that must
    /// last as long as something else takes: start it with a generous
    /// duration, stop it when that is done.
    pub fn stop(mut self) -> io::Result<(WrkReport, String)> {
        let pid = libc::pid_t::try_from(self.wrk.0.id()).map_err(io::Error::other)?;
        // SAFETY: kill(2) on our own child, which has not been waited for.
        if unsafe { libc::kill(pid, libc::SIGINT) } != 0 {
            return Err(io::Error::last_os_error());
        }
        self.duration = Duration::ZERO;
        self.finish()
    }

    /// Waits for the run to end; its report and wrk's whole output.
    pub fn finish(mut self) -> io::Result<(WrkReport, String)> {
        let timeout = self.duration + Duration::from_secs(15);
        let status =
            wait_for_exit(&mut self.wrk, timeout)?.ok_or_else(|| io::Error::other(format!("wrk still running after {timeout:?}")))?;
        let text = drain(self.wrk.0.stdout.take()) + &drain(self.wrk.0.stderr.take());
        match WrkReport::parse(&text) {
            Some(r) if status.success() => Ok((r, text)),
            _ => Err(io::Error::other(format!("wrk failed ({status}): {text}"))),
        }
    }
}

/// Whether `program` is on PATH, for a test's plain "install it" message.
pub fn installed(program: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|paths| std::env::split_paths(&paths).any(|d| is_executable(&d.join(program))))
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

#[cfg(test)]
mod tests {
    use super::WrkReport;

    #[test]
    fn parses_wrk_with_and_without_errors() {
        let clean = "Running 15s test @ http://10.96.43.10/name
  1 threads and 8 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency   177.33us  287.81us   4.37ms   97.23%
    Req/Sec    15.09k     2.01k   16.76k    80.95%
  31527 requests in 2.10s, 4.75MB read
Requests/sec:  15014.49
Transfer/sec:      2.26MB
";
        assert_eq!(WrkReport::parse(clean), Some(WrkReport { requests: 31527, ..WrkReport::default() }));
        let broken = "  1200 requests in 15.01s, 1.00MB read
  Socket errors: connect 1, read 7, write 2, timeout 3
  Non-2xx or 3xx responses: 5
Requests/sec:     79.95
";
        let r = WrkReport::parse(broken).expect("report");
        assert_eq!(r, WrkReport { requests: 1200, connect_errors: 1, read_errors: 7, write_errors: 2, timeouts: 3, non_2xx_3xx: 5 });
        assert_eq!(r.socket_errors(), 13);
        assert_eq!(WrkReport::parse("unable to connect to 10.96.43.10:80 Connection refused"), None);
    }
}
