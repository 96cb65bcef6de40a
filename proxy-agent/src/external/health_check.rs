//! Health check node ports for Services with `externalTrafficPolicy: Local`,
//! answered as kube-proxy does (pkg/proxy/healthcheck/service_health.go):
//! `GET` on `spec.healthCheckNodePort` returns 200 with a JSON body naming
//! the Service, its number of local endpoints and whether the agent itself
//! is healthy (`serviceProxyHealthy`) when this node has at least one local
//! endpoint and the agent is healthy, and 503 with the same body otherwise.
//! External load balancers use it to send traffic only to nodes that can
//! serve it (the TC datapath drops Local-policy traffic on nodes without a
//! local endpoint). The agent is unhealthy when its sync loop is stuck (its
//! maps may be stale), as in kube-proxy, and also while this node is going
//! away (kube-proxy reports that only on `/healthz`; draining the node here
//! too moves Local-policy traffic off it before its pods are evicted).

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::{Arc, Mutex, OnceLock};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::decide::decision::HealthCheck;
use crate::model::ObjectRef;
use crate::observe::health_server::Health;

type Table = Arc<Mutex<BTreeMap<u16, (ObjectRef, usize)>>>;

/// The agent's own health, once the sync loop hands it over; until then the
/// agent counts as healthy (nothing has been synced to be stale).
type AgentHealth = Arc<OnceLock<Arc<Health>>>;

/// The set of health check servers, one listener per port.
#[derive(Default)]
pub(crate) struct HealthServers {
    table: Table,
    agent: AgentHealth,
    tasks: BTreeMap<u16, JoinHandle<()>>,
}

impl HealthServers {
    pub(crate) fn new() -> HealthServers {
        HealthServers::default()
    }

    /// Reports `health` in every answer from now on. Only the first call
    /// counts: an agent has one health state.
    pub(crate) fn report_agent_health(&self, health: Arc<Health>) {
        let _ = self.agent.set(health);
    }

    /// Starts listeners for new ports, stops those no longer wanted and
    /// updates the counts the others report. Must run inside a tokio runtime.
    /// Returns the ports that could not be bound, with the reason.
    pub(crate) fn update(&mut self, checks: &[HealthCheck]) -> Vec<(u16, String)> {
        let mut failed = Vec::new();
        {
            let mut t = self.table.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            t.clear();
            for c in checks {
                t.insert(c.port, (c.service.clone(), c.local_endpoints));
            }
        }
        let wanted: Vec<u16> = checks.iter().map(|c| c.port).collect();
        self.tasks.retain(|port, task| {
            let keep = wanted.contains(port);
            if !keep {
                task.abort();
            }
            keep
        });
        for port in wanted {
            if self.tasks.contains_key(&port) {
                continue;
            }
            match bind(port) {
                Ok(listener) => {
                    let (table, agent) = (self.table.clone(), self.agent.clone());
                    self.tasks.insert(port, tokio::spawn(accept_loop(listener, port, table, agent)));
                }
                Err(e) => failed.push((port, e.to_string())),
            }
        }
        failed
    }
}

impl Drop for HealthServers {
    fn drop(&mut self) {
        for t in self.tasks.values() {
            t.abort();
        }
    }
}

/// `[::]:port` accepts IPv4 too unless net.ipv6.bindv6only is set; fall
/// back to IPv4 only when IPv6 is unavailable.
fn bind(port: u16) -> std::io::Result<TcpListener> {
    let v6 = std::net::TcpListener::bind(SocketAddr::from((Ipv6Addr::UNSPECIFIED, port)))
        .or_else(|_| std::net::TcpListener::bind(SocketAddr::from((Ipv4Addr::UNSPECIFIED, port))))?;
    v6.set_nonblocking(true)?;
    TcpListener::from_std(v6)
}

async fn accept_loop(listener: TcpListener, port: u16, table: Table, agent: AgentHealth) {
    loop {
        let Ok((mut conn, _)) = listener.accept().await else { continue };
        let (table, agent) = (table.clone(), agent.clone());
        tokio::spawn(async move {
            // Read the request head (we answer every path and method alike,
            // as kube-proxy does); give up on slow or oversized requests.
            let mut buf = vec![0u8; 4096];
            let mut n = 0;
            let read = async {
                while n < buf.len() {
                    match conn.read(&mut buf[n..]).await {
                        Ok(0) | Err(_) => break,
                        Ok(m) => n += m,
                    }
                    if buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
                        break;
                    }
                }
            };
            let _ = tokio::time::timeout(std::time::Duration::from_secs(5), read).await;
            let entry = table.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get(&port).cloned();
            let healthy = agent.get().is_none_or(|h| h.proxy_healthy());
            let _ = conn.write_all(response(entry.as_ref(), healthy).as_bytes()).await;
            let _ = conn.shutdown().await;
        });
    }
}

/// The full HTTP response for one request: 200 when the Service has local
/// endpoints and the agent is healthy.
pub(crate) fn response(entry: Option<&(ObjectRef, usize)>, agent_healthy: bool) -> String {
    let (svc, count) = match entry {
        Some((s, c)) => (s.clone(), *c),
        None => (ObjectRef::new("", ""), 0),
    };
    let body = serde_json::json!({
        "service": {"namespace": &*svc.namespace, "name": &*svc.name},
        "localEndpoints": count,
        "serviceProxyHealthy": agent_healthy,
    })
    .to_string();
    let status = if count > 0 && agent_healthy { "200 OK" } else { "503 Service Unavailable" };
    format!(
        "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nX-Content-Type-Options: nosniff\r\nX-Load-Balancing-Endpoint-Weight: {count}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_like_kube_proxy() {
        let r = response(Some(&(ObjectRef::new("default", "web"), 2)), true);
        assert!(r.starts_with("HTTP/1.1 200 OK\r\n"), "{r}");
        assert!(r.ends_with(r#"{"localEndpoints":2,"service":{"name":"web","namespace":"default"},"serviceProxyHealthy":true}"#), "{r}");
        let r = response(Some(&(ObjectRef::new("default", "web"), 0)), true);
        assert!(r.starts_with("HTTP/1.1 503 Service Unavailable\r\n"), "{r}");
    }

    #[test]
    fn an_unhealthy_agent_fails_every_health_check_port() {
        let r = response(Some(&(ObjectRef::new("default", "web"), 2)), false);
        assert!(r.starts_with("HTTP/1.1 503 Service Unavailable\r\n"), "{r}");
        assert!(r.ends_with(r#"{"localEndpoints":2,"service":{"name":"web","namespace":"default"},"serviceProxyHealthy":false}"#), "{r}");
    }

    /// Through a real listener: the answer follows the agent's health as
    /// the sync loop reports it, request by request.
    #[tokio::test]
    async fn served_answers_follow_the_agent_health() {
        let health = Arc::new(Health::new(std::time::Duration::from_mins(1)));
        let servers = HealthServers::new();
        servers.report_agent_health(health.clone());
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.expect("bind loopback");
        let port = listener.local_addr().expect("local address").port();
        servers.table.lock().expect("table").insert(port, (ObjectRef::new("default", "web"), 1));
        let task = tokio::spawn(accept_loop(listener, port, servers.table.clone(), servers.agent.clone()));
        let get = || async move {
            let mut s = tokio::net::TcpStream::connect((Ipv4Addr::LOCALHOST, port)).await.expect("connect");
            s.write_all(b"GET / HTTP/1.1\r\nHost: lb\r\n\r\n").await.expect("request");
            let mut out = String::new();
            s.read_to_string(&mut out).await.expect("response");
            out
        };
        assert!(get().await.starts_with("HTTP/1.1 200 OK"));
        health.set_node_leaving(Some("its Node has a deletionTimestamp"));
        let r = get().await;
        assert!(r.starts_with("HTTP/1.1 503") && r.contains(r#""serviceProxyHealthy":false"#), "{r}");
        health.set_node_leaving(None);
        assert!(get().await.starts_with("HTTP/1.1 200 OK"));
        task.abort();
    }
}
