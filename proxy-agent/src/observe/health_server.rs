//! `/healthz`, `/livez`, `/readyz` and `/metrics` over plain HTTP/1.1.
//!
//! Two listeners, as kube-proxy has (cmd/kube-proxy/app/server.go): the
//! health endpoints on `--healthz-bind-address` (0.0.0.0:10256, which load
//! balancers and kubelets must reach) and `/metrics` on
//! `--metrics-bind-address` (127.0.0.1:10249: the metrics name Services,
//! namespaces and per-tier counts, which not everyone who can reach a node
//! should read). Both flags naming one address share one listener.
//!
//! - `/healthz` answers like kube-proxy's health server on port 10256
//!   (pkg/proxy/healthcheck, KEP-3836): 200 unless the sync loop is stuck
//!   (a change has waited longer than the staleness limit without a sync)
//!   or this node is going away (its Node has a `deletionTimestamp` or the
//!   cluster autoscaler's `ToBeDeletedByClusterAutoscaler` taint). Cloud
//!   load balancers probe it for `externalTrafficPolicy: Cluster` Services,
//!   so a failing answer drains the node before it is removed. The body is
//!   kube-proxy's: `{"lastUpdated", "currentTime", "nodeEligible"}`. An API
//!   server outage does not make the agent unhealthy: the datapath keeps
//!   serving its last state, and restarting the agent would not help.
//! - `/livez`: the same staleness check without the node's state, for the
//!   kubelet's liveness probe: a node being drained is no reason to restart
//!   its proxy.
//! - `/readyz`: 200 once the first full sync has been applied (in
//!   Kubernetes mode: after every watched kind was listed), 503 with the
//!   reason before.
//! - `/metrics`: the Prometheus exposition from `metrics`.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use crate::observe::metrics::Metrics;

/// A change not synced within this long makes `/healthz` fail.
pub const DEFAULT_STALE_AFTER: Duration = Duration::from_mins(1);

/// What one listener answers: the health endpoints, `/metrics`, or both
/// (when `--healthz-bind-address` and `--metrics-bind-address` are equal).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Routes {
    /// `/healthz`, `/livez` and `/readyz`.
    pub health: bool,
    /// `/metrics`.
    pub metrics: bool,
}

impl Routes {
    /// The health endpoints only (`--healthz-bind-address`).
    pub const HEALTH: Routes = Routes { health: true, metrics: false };
    /// `/metrics` only (`--metrics-bind-address`).
    pub const METRICS: Routes = Routes { health: false, metrics: true };
    /// Both, on one address.
    pub const ALL: Routes = Routes { health: true, metrics: true };

    /// The paths served, for errors and logs.
    pub fn paths(self) -> &'static str {
        match (self.health, self.metrics) {
            (true, true) => "/healthz, /livez, /readyz and /metrics",
            (true, false) => "/healthz, /livez and /readyz",
            (false, true) => "/metrics",
            (false, false) => "nothing",
        }
    }
}

/// A health or metrics port could not be bound (`--healthz-bind-address`,
/// `--metrics-bind-address`).
#[derive(Debug, thiserror::Error)]
#[error("cannot listen on {addr} for {}: {source}", routes.paths())]
pub struct BindError {
    /// The address asked for.
    pub addr: SocketAddr,
    /// What it was to serve.
    pub routes: Routes,
    /// Why bind(2) failed.
    pub source: std::io::Error,
}

struct State {
    ready: bool,
    waiting_for: String,
    last_sync: Option<SystemTime>,
    pending_since: Option<Instant>,
    /// Why this node is going away, when it is (`/healthz`'s
    /// `nodeEligible: false`). A node is eligible until the sync loop says
    /// otherwise, as kube-proxy's health server starts.
    node_leaving: Option<String>,
}

/// What `/healthz` and `/livez` found, at `now`.
struct Probe {
    /// No change has waited past the staleness limit.
    fresh: bool,
    node_eligible: bool,
    last_sync: Option<SystemTime>,
    now: SystemTime,
}

/// What the sync loop tells the health endpoints.
pub struct Health {
    state: Mutex<State>,
    stale_after: Duration,
}

impl Health {
    /// Not ready until the first sync; `/healthz` and `/livez` fail when a change waits longer than `stale_after` for a sync.
    pub fn new(stale_after: Duration) -> Health {
        Health {
            state: Mutex::new(State {
                ready: false,
                waiting_for: "the first sync".into(),
                last_sync: None,
                pending_since: None,
                node_leaving: None,
            }),
            stale_after,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding this lock cannot leave the plain fields
        // inconsistent, so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Sets what `/readyz` reports it is waiting for (before the first sync).
    pub fn waiting_for(&self, what: impl Into<String>) {
        self.lock().waiting_for = what.into();
    }

    /// A change arrived that a sync has yet to apply.
    pub fn pending(&self) {
        let mut s = self.lock();
        if s.pending_since.is_none() {
            s.pending_since = Some(Instant::now());
        }
    }

    /// A sync completed: every change seen so far is applied.
    pub fn synced(&self) {
        let mut s = self.lock();
        s.ready = true;
        s.last_sync = Some(SystemTime::now());
        s.pending_since = None;
    }

    /// Whether a sync has completed (`/readyz`).
    pub fn is_ready(&self) -> bool {
        self.lock().ready
    }

    /// Records whether this node is going away (`Some(why)`) or not. Returns
    /// whether that changed, so the caller logs only transitions.
    pub fn set_node_leaving(&self, why: Option<&str>) -> bool {
        let mut s = self.lock();
        if s.node_leaving.as_deref() == why {
            return false;
        }
        s.node_leaving = why.map(str::to_string);
        true
    }

    /// Whether the agent can be trusted to serve this node: not stuck, and
    /// the node not going away. Health check node ports report it
    /// (`serviceProxyHealthy`) and fail while it is false.
    pub fn proxy_healthy(&self) -> bool {
        let p = self.probe();
        p.fresh && p.node_eligible
    }

    fn probe(&self) -> Probe {
        let s = self.lock();
        let fresh = s.pending_since.is_none_or(|p| p.elapsed() <= self.stale_after);
        Probe { fresh, node_eligible: s.node_leaving.is_none(), last_sync: s.last_sync, now: SystemTime::now() }
    }

    /// `/healthz`: staleness and the node's eligibility.
    fn healthz(&self) -> (StatusCode, String) {
        let p = self.probe();
        let healthy = p.fresh && p.node_eligible;
        let body = format!(
            "{{\"lastUpdated\": \"{}\", \"currentTime\": \"{}\", \"nodeEligible\": {}}}\n",
            last_updated(&p, healthy),
            go_time(p.now),
            p.node_eligible
        );
        (if healthy { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE }, body)
    }

    /// `/livez`: staleness only.
    fn livez(&self) -> (StatusCode, String) {
        let p = self.probe();
        let body = format!("{{\"lastUpdated\": \"{}\", \"currentTime\": \"{}\"}}\n", last_updated(&p, p.fresh), go_time(p.now));
        (if p.fresh { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE }, body)
    }

    fn readyz(&self) -> (StatusCode, String) {
        let s = self.lock();
        if s.ready {
            (StatusCode::OK, "ok\n".into())
        } else {
            (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: waiting for {}\n", s.waiting_for))
        }
    }
}

/// `lastUpdated` as kube-proxy reports it: the current time while healthy
/// (older kube-proxies reported every sync there, even one that changed
/// nothing, and load balancers compare it with `currentTime`), else the
/// last completed sync.
fn last_updated(p: &Probe, healthy: bool) -> String {
    if healthy { go_time(p.now) } else { p.last_sync.map_or_else(|| GO_ZERO_TIME.to_string(), go_time) }
}

/// Go's zero `time.Time` in JSON: what kube-proxy reports as `lastUpdated`
/// before its first sync.
const GO_ZERO_TIME: &str = "0001-01-01T00:00:00Z";

/// A time as Go's `time.Time` marshals to JSON: RFC 3339 in UTC, with the
/// fraction of a second up to nanoseconds and no trailing zeros.
fn go_time(t: SystemTime) -> String {
    let (secs, nanos) = match t.duration_since(UNIX_EPOCH) {
        Ok(d) => (d.as_secs(), d.subsec_nanos()),
        Err(_) => return GO_ZERO_TIME.to_string(),
    };
    // Days since 1970-01-01 to a civil date (Howard Hinnant's days_from_civil
    // inverse, for the proleptic Gregorian calendar).
    let days = secs / 86_400;
    let rem = secs % 86_400;
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    let mut out = format!("{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}", rem / 3600, rem % 3600 / 60, rem % 60);
    if nanos > 0 {
        let frac = format!("{nanos:09}");
        out.push('.');
        out.push_str(frac.trim_end_matches('0'));
    }
    out.push('Z');
    out
}

/// Binds the listener (so a bad address is reported before anything else
/// starts) and returns it with the address actually bound (port 0 picks one).
pub async fn bind(addr: SocketAddr, routes: Routes) -> Result<(TcpListener, SocketAddr), BindError> {
    let l = TcpListener::bind(addr).await.map_err(|source| BindError { addr, routes, source })?;
    let local = l.local_addr().map_err(|source| BindError { addr, routes, source })?;
    Ok((l, local))
}

/// Serves `routes` until the task is dropped. Connection errors only end
/// that connection.
pub async fn serve(listener: TcpListener, routes: Routes, health: Arc<Health>, metrics: Arc<Metrics>) {
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                // EMFILE and the like: back off briefly instead of spinning.
                tracing::warn!(error = %e, "health server accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let health = health.clone();
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req| {
                let resp = respond(&req, routes, &health, &metrics);
                async move { Ok::<_, Infallible>(resp) }
            });
            let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), svc).await;
        });
    }
}

fn respond(req: &Request<Incoming>, routes: Routes, health: &Health, metrics: &Metrics) -> Response<Full<Bytes>> {
    // Nothing here changes state: every other method (POST, PUT, DELETE,
    // PATCH, ...) gets 405 with the methods that are allowed, which RFC 9110
    // (15.5.6) requires in the answer, whatever the path.
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut r = reply(StatusCode::METHOD_NOT_ALLOWED, "text/plain", "only GET and HEAD\n".into());
        r.headers_mut().insert(hyper::header::ALLOW, hyper::header::HeaderValue::from_static("GET, HEAD"));
        return r;
    }
    match req.uri().path() {
        "/healthz" if routes.health => {
            let (code, body) = health.healthz();
            metrics.proxy_healthz(code.as_u16());
            reply(code, "application/json", body)
        }
        "/livez" if routes.health => {
            let (code, body) = health.livez();
            metrics.proxy_livez(code.as_u16());
            reply(code, "application/json", body)
        }
        "/readyz" if routes.health => {
            let (code, body) = health.readyz();
            reply(code, "text/plain; charset=utf-8", body)
        }
        "/metrics" if routes.metrics => {
            reply(StatusCode::OK, "application/openmetrics-text; version=1.0.0; charset=utf-8", metrics.encode())
        }
        _ => reply(StatusCode::NOT_FOUND, "text/plain", format!("not found; this address serves {}\n", routes.paths())),
    }
}

fn reply(code: StatusCode, content_type: &'static str, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = code;
    r.headers_mut().insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static(content_type));
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readiness_and_staleness() {
        let h = Health::new(Duration::from_millis(0));
        assert_eq!(h.readyz().0, StatusCode::SERVICE_UNAVAILABLE);
        h.waiting_for("Services to be listed");
        assert!(h.readyz().1.contains("Services to be listed"));
        assert_eq!(h.healthz().0, StatusCode::OK, "nothing pending is healthy");
        h.pending();
        std::thread::sleep(Duration::from_millis(2));
        assert_eq!(h.healthz().0, StatusCode::SERVICE_UNAVAILABLE, "a change stuck past the limit");
        assert_eq!(h.livez().0, StatusCode::SERVICE_UNAVAILABLE, "/livez reports staleness too");
        assert!(!h.proxy_healthy());
        h.synced();
        assert_eq!(h.healthz().0, StatusCode::OK);
        assert_eq!(h.livez().0, StatusCode::OK);
        assert_eq!(h.readyz().0, StatusCode::OK);
    }

    fn json(body: &str) -> serde_json::Value {
        serde_json::from_str(body).unwrap_or_else(|e| panic!("{body:?}: {e}"))
    }

    #[test]
    fn a_leaving_node_fails_healthz_but_not_livez() {
        let h = Health::new(Duration::from_mins(1));
        h.synced();
        let (code, body) = h.healthz();
        let v = json(&body);
        assert_eq!(code, StatusCode::OK);
        assert_eq!(v["nodeEligible"], true);
        assert_eq!(v["lastUpdated"], v["currentTime"], "healthy: lastUpdated is now, as kube-proxy reports it");

        assert!(h.set_node_leaving(Some("its Node has a deletionTimestamp")));
        assert!(!h.set_node_leaving(Some("its Node has a deletionTimestamp")), "no change, no transition");
        let (code, body) = h.healthz();
        let v = json(&body);
        assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(v["nodeEligible"], false);
        assert_ne!(v["lastUpdated"], GO_ZERO_TIME, "the last sync");
        assert!(!h.proxy_healthy(), "health check node ports fail too");
        let (code, body) = h.livez();
        assert_eq!(code, StatusCode::OK, "a node being drained is no reason to restart its proxy");
        let v = json(&body);
        assert!(v.get("nodeEligible").is_none() && v["currentTime"].is_string(), "{v}");

        assert!(h.set_node_leaving(None));
        assert_eq!(h.healthz().0, StatusCode::OK);
        assert!(h.proxy_healthy());
    }

    #[test]
    fn never_synced_and_stuck_reports_go_zero_time() {
        let h = Health::new(Duration::ZERO);
        h.pending();
        std::thread::sleep(Duration::from_millis(2));
        let v = json(&h.livez().1);
        assert_eq!(v["lastUpdated"], GO_ZERO_TIME);
    }

    /// Through a real listener: the endpoints serve no write operation,
    /// and a refused request changes nothing a later GET sees.
    #[tokio::test]
    async fn only_get_and_head_are_served() {
        let health = Arc::new(Health::new(Duration::from_mins(1)));
        health.synced();
        let metrics = Arc::new(Metrics::new());
        let (listener, addr) = bind(loopback(), Routes::ALL).await.expect("bind loopback");
        let task = tokio::spawn(serve(listener, Routes::ALL, health, metrics));
        let request = |method: &'static str, path: &'static str| request(addr, method, path);
        let before = request("GET", "/metrics").await;
        for method in ["POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE"] {
            for path in ["/metrics", "/healthz", "/livez", "/readyz", "/", "/nope"] {
                let r = request(method, path).await;
                assert!(r.starts_with("HTTP/1.1 405 "), "{method} {path}: {r}");
                assert!(r.to_ascii_lowercase().contains("\r\nallow: get, head\r\n"), "{method} {path}: {r}");
            }
        }
        assert!(request("HEAD", "/healthz").await.starts_with("HTTP/1.1 200 "));
        let after = request("GET", "/metrics").await;
        assert!(before.starts_with("HTTP/1.1 200 ") && after.starts_with("HTTP/1.1 200 "));
        let series =
            |r: &str| r.lines().filter(|l| l.starts_with("topoproxy_") && !l.contains("healthz")).map(str::to_string).collect::<Vec<_>>();
        assert_eq!(series(&before), series(&after), "refused requests changed the metrics");
        task.abort();
    }

    fn loopback() -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], 0))
    }

    async fn request(addr: SocketAddr, method: &str, path: &str) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let req = format!("{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 4\r\n\r\nbody");
        s.write_all(req.as_bytes()).await.expect("request");
        let mut out = String::new();
        s.read_to_string(&mut out).await.expect("response");
        out
    }

    /// Split as kube-proxy is: the health listener does not give away the
    /// metrics (Service names, per-tier counts), the metrics listener
    /// answers nothing a probe would mistake for health.
    #[tokio::test]
    async fn health_and_metrics_listeners_serve_only_their_paths() {
        let health = Arc::new(Health::new(Duration::from_mins(1)));
        health.synced();
        let metrics = Arc::new(Metrics::new());
        let (hl, haddr) = bind(loopback(), Routes::HEALTH).await.expect("bind loopback");
        let (ml, maddr) = bind(loopback(), Routes::METRICS).await.expect("bind loopback");
        let tasks = [
            tokio::spawn(serve(hl, Routes::HEALTH, health.clone(), metrics.clone())),
            tokio::spawn(serve(ml, Routes::METRICS, health, metrics)),
        ];
        for path in ["/healthz", "/livez", "/readyz"] {
            assert!(request(haddr, "GET", path).await.starts_with("HTTP/1.1 200 "), "{path} on the health address");
            let r = request(maddr, "GET", path).await;
            assert!(r.starts_with("HTTP/1.1 404 ") && r.contains("serves /metrics"), "{path} on the metrics address: {r}");
        }
        let r = request(haddr, "GET", "/metrics").await;
        assert!(r.starts_with("HTTP/1.1 404 ") && !r.contains("topoproxy_"), "/metrics on the health address: {r}");
        let r = request(maddr, "GET", "/metrics").await;
        assert!(r.starts_with("HTTP/1.1 200 ") && r.contains("kubeproxy_proxy_healthz_total"), "{r}");
        for t in tasks {
            t.abort();
        }
    }

    #[test]
    fn times_are_formatted_like_go_json() {
        let t = |secs: u64, nanos: u32| go_time(UNIX_EPOCH + Duration::new(secs, nanos));
        assert_eq!(t(0, 0), "1970-01-01T00:00:00Z");
        assert_eq!(t(1_714_557_600, 0), "2024-05-01T10:00:00Z");
        assert_eq!(t(1_714_557_600, 120_000_000), "2024-05-01T10:00:00.12Z");
        assert_eq!(t(951_782_400 + 86_399, 1), "2000-02-29T23:59:59.000000001Z", "a leap day");
        assert_eq!(t(4_102_444_800, 0), "2100-01-01T00:00:00Z");
    }
}
