//! `/healthz`, `/readyz` and `/metrics` over plain HTTP/1.1.
//!
//! - `/healthz` answers like kube-proxy's health server (port 10256): 200
//!   unless a change has been waiting longer than the staleness limit
//!   without a sync, which means the sync loop is stuck. An API server
//!   outage does not make the agent unhealthy: the datapath keeps serving
//!   its last state, and restarting the agent would not help.
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

#[derive(Debug, thiserror::Error)]
#[error("cannot listen on {addr} for /healthz, /readyz and /metrics: {source}")]
pub struct BindError {
    pub addr: SocketAddr,
    pub source: std::io::Error,
}

struct State {
    ready: bool,
    waiting_for: String,
    last_sync: Option<SystemTime>,
    pending_since: Option<Instant>,
}

/// What the sync loop tells the health endpoints.
pub struct Health {
    state: Mutex<State>,
    stale_after: Duration,
}

impl Health {
    pub fn new(stale_after: Duration) -> Health {
        Health {
            state: Mutex::new(State { ready: false, waiting_for: "the first sync".into(), last_sync: None, pending_since: None }),
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

    pub fn is_ready(&self) -> bool {
        self.lock().ready
    }

    fn healthz(&self) -> (StatusCode, String) {
        let s = self.lock();
        let last =
            s.last_sync.and_then(|t| t.duration_since(UNIX_EPOCH).ok()).map_or("null".to_string(), |d| format!("{:.3}", d.as_secs_f64()));
        let pending = s.pending_since.map(|p| p.elapsed());
        let stuck = pending.is_some_and(|p| p > self.stale_after);
        let body = format!(
            "{{\"healthy\":{},\"lastSyncUnixSeconds\":{last},\"pendingSeconds\":{}}}\n",
            !stuck,
            pending.map_or("null".to_string(), |p| format!("{:.3}", p.as_secs_f64()))
        );
        (if stuck { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::OK }, body)
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

/// Binds the listener (so a bad address is reported before anything else
/// starts) and returns it with the address actually bound (port 0 picks one).
pub async fn bind(addr: SocketAddr) -> Result<(TcpListener, SocketAddr), BindError> {
    let l = TcpListener::bind(addr).await.map_err(|source| BindError { addr, source })?;
    let local = l.local_addr().map_err(|source| BindError { addr, source })?;
    Ok((l, local))
}

/// Serves until the task is dropped. Connection errors only end that
/// connection.
pub async fn serve(listener: TcpListener, health: Arc<Health>, metrics: Arc<Metrics>) {
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
                let resp = respond(&req, &health, &metrics);
                async move { Ok::<_, Infallible>(resp) }
            });
            let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), svc).await;
        });
    }
}

fn respond(req: &Request<Incoming>, health: &Health, metrics: &Metrics) -> Response<Full<Bytes>> {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return reply(StatusCode::METHOD_NOT_ALLOWED, "text/plain", "only GET\n".into());
    }
    match req.uri().path() {
        "/healthz" | "/livez" => {
            let (code, body) = health.healthz();
            reply(code, "application/json", body)
        }
        "/readyz" => {
            let (code, body) = health.readyz();
            reply(code, "text/plain; charset=utf-8", body)
        }
        "/metrics" => reply(StatusCode::OK, "application/openmetrics-text; version=1.0.0; charset=utf-8", metrics.encode()),
        _ => reply(StatusCode::NOT_FOUND, "text/plain", "not found; try /healthz, /readyz or /metrics\n".into()),
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
        h.synced();
        assert_eq!(h.healthz().0, StatusCode::OK);
        assert_eq!(h.readyz().0, StatusCode::OK);
    }
}
