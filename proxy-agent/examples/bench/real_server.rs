//! The control-plane benches' real kube-apiserver (issue #31: "measured
//! against the real kube-apiserver"): `proxy_test_support::real_cluster`
//! (etcd, kube-apiserver and kube-controller-manager on loopback, built by
//! `cargo xtask k8s`), driven through kube-rs's client as the kubelets and
//! controllers would drive it.
//!
//! - Nodes are created through the API, then report status as a kubelet
//!   does: a strategic-merge patch of `nodes/<name>/status` with the field
//!   manager `kubelet`, which changes the conditions' `lastHeartbeatTime`.
//!   The API server computes `managedFields` itself, so a metadata-only
//!   watch event is as large as this server makes it.
//! - The client under test reaches the API server through a byte-counting
//!   TCP relay ([`Relay`]) on another loopback port: it counts what the
//!   server sends to that client on every connection (TLS records,
//!   headers and chunk framing included). TLS hides which collection a
//!   connection watches, so the count covers all of them; with Services
//!   and EndpointSlices unchanged during a window, the rest is bookmarks.

use std::fs;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use proxy_test_support::real_cluster::RealCluster;
use serde_json::{Value, json};

/// Requests in flight while creating objects in bulk.
const CONCURRENCY: usize = 16;

pub(crate) struct RealServer {
    cluster: RealCluster,
    rt: tokio::runtime::Runtime,
    client: kube::Client,
    relay: Relay,
}

impl RealServer {
    pub(crate) fn start(name: &str) -> Result<RealServer> {
        let cluster = RealCluster::start(name).context("starting the real control plane (cargo xtask k8s builds it)")?;
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
        let kubeconfig = cluster.admin_kubeconfig().to_path_buf();
        let client = rt.block_on(async {
            let kc = kube::config::Kubeconfig::read_from(&kubeconfig)?;
            let config = kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default()).await?;
            anyhow::Ok(kube::Client::try_from(config)?)
        })?;
        let upstream: SocketAddr =
            cluster.apiserver_url().trim_start_matches("https://").parse().context("the API server's URL is not https://IP:PORT")?;
        let relay = Relay::start(upstream)?;
        Ok(RealServer { cluster, rt, client, relay })
    }

    /// The admin kubeconfig, pointed at the counting relay (the serving
    /// certificate names 127.0.0.1, whatever the port).
    pub(crate) fn write_kubeconfig(&self, path: &Path) -> Result<()> {
        let text = fs::read_to_string(self.cluster.admin_kubeconfig())?;
        let url = self.cluster.apiserver_url();
        if !text.contains(&url) {
            bail!("the admin kubeconfig does not name {url}");
        }
        fs::write(path, text.replace(&url, &format!("https://{}", self.relay.addr)))?;
        Ok(())
    }

    /// Bytes the server sent through the relay so far.
    pub(crate) fn bytes_to_clients(&self) -> u64 {
        self.relay.to_client.load(Ordering::Relaxed)
    }

    /// Creates `nodes` (their managedFields, resourceVersion and uid left
    /// to the server) with the kubelet's field manager, then reports each
    /// one's status once, so that every Node carries a status entry in its
    /// managedFields as a running kubelet's does.
    pub(crate) fn create_nodes(&self, nodes: &[Value]) -> Result<()> {
        let api: Api<Node> = Api::all(self.client.clone());
        let pp = PostParams { field_manager: Some("kubelet".into()), ..PostParams::default() };
        self.rt.block_on(async {
            let mut results = futures::stream::iter(nodes.iter().map(|n| {
                let (api, pp) = (api.clone(), pp.clone());
                async move {
                    let mut n = n.clone();
                    if let Some(m) = n["metadata"].as_object_mut() {
                        for f in ["managedFields", "resourceVersion", "uid", "creationTimestamp"] {
                            m.remove(f);
                        }
                    }
                    let node: Node = serde_json::from_value(n)?;
                    let name = node.metadata.name.clone().unwrap_or_default();
                    let status = node.status.clone();
                    api.create(&pp, &node).await.with_context(|| format!("creating Node {name}"))?;
                    // A create keeps the status it is given; the status
                    // subresource's own entry comes with the first report.
                    let patch = json!({"status": status});
                    api.patch_status(
                        &name,
                        &PatchParams { field_manager: Some("kubelet".into()), ..PatchParams::default() },
                        &Patch::Strategic(patch),
                    )
                    .await
                    .with_context(|| format!("reporting Node {name}'s first status"))?;
                    anyhow::Ok(())
                }
            }))
            .buffer_unordered(CONCURRENCY);
            while let Some(r) = results.next().await {
                r?;
            }
            anyhow::Ok(())
        })
    }

    /// One kubelet status report: the heartbeats of its four conditions.
    pub(crate) fn report_status(&self, node: &str, now: &str) -> Result<()> {
        let api: Api<Node> = Api::all(self.client.clone());
        let conditions: Vec<Value> = ["MemoryPressure", "DiskPressure", "PIDPressure", "Ready"]
            .iter()
            .map(|t| json!({"type": t, "lastHeartbeatTime": now}))
            .collect();
        let pp = PatchParams { field_manager: Some("kubelet".into()), ..PatchParams::default() };
        self.rt.block_on(api.patch_status(node, &pp, &Patch::Strategic(json!({"status": {"conditions": conditions}}))))?;
        Ok(())
    }

    /// A Node as the server holds it.
    pub(crate) fn node(&self, name: &str) -> Result<Value> {
        let api: Api<Node> = Api::all(self.client.clone());
        Ok(serde_json::to_value(self.rt.block_on(api.get(name))?)?)
    }

    pub(crate) fn create_namespace(&self, ns: &str) -> Result<()> {
        let api: Api<Namespace> = Api::all(self.client.clone());
        let obj: Namespace = serde_json::from_value(json!({"metadata": {"name": ns}}))?;
        match self.rt.block_on(api.create(&PostParams::default(), &obj)) {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Server-side applies Services and EndpointSlices (`kind` decides),
    /// `CONCURRENCY` at a time.
    pub(crate) fn apply_all(&self, objects: Vec<Value>) -> Result<()> {
        let client = self.client.clone();
        self.rt.block_on(async move {
            let mut results = futures::stream::iter(objects.into_iter().map(|o| apply(client.clone(), o))).buffer_unordered(CONCURRENCY);
            while let Some(r) = results.next().await {
                r?;
            }
            anyhow::Ok(())
        })
    }

    /// A JSON merge patch of one EndpointSlice (cheaper for the server
    /// than an apply, so the churn rate is the bench's, not the server's).
    pub(crate) fn patch_slice(&self, ns: &str, name: &str, patch: &Value) -> Result<()> {
        let api: Api<EndpointSlice> = Api::namespaced(self.client.clone(), ns);
        self.rt.block_on(api.patch(name, &PatchParams::default(), &Patch::Merge(patch)))?;
        Ok(())
    }

    pub(crate) fn delete_service(&self, ns: &str, name: &str) -> Result<()> {
        let api: Api<Service> = Api::namespaced(self.client.clone(), ns);
        match self.rt.block_on(api.delete(name, &DeleteParams::default())) {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    pub(crate) fn delete_slice(&self, ns: &str, name: &str) -> Result<()> {
        let api: Api<EndpointSlice> = Api::namespaced(self.client.clone(), ns);
        match self.rt.block_on(api.delete(name, &DeleteParams::default())) {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// The version the cluster runs (the pinned one it was built from).
    pub(crate) fn version() -> String {
        proxy_test_support::real_cluster::pinned_version().unwrap_or_else(|_| "?".into())
    }
}

async fn apply(client: kube::Client, o: Value) -> Result<()> {
    let ns = o["metadata"]["namespace"].as_str().unwrap_or("default").to_string();
    let name = o["metadata"]["name"].as_str().unwrap_or_default().to_string();
    let pp = PatchParams::apply("bench.topoproxy.io").force();
    match o["kind"].as_str() {
        Some("Service") => {
            Api::<Service>::namespaced(client, &ns)
                .patch(&name, &pp, &Patch::Apply(&o))
                .await
                .with_context(|| format!("Service {ns}/{name}"))?;
        }
        Some("EndpointSlice") => {
            Api::<EndpointSlice>::namespaced(client, &ns)
                .patch(&name, &pp, &Patch::Apply(&o))
                .await
                .with_context(|| format!("EndpointSlice {ns}/{name}"))?;
        }
        other => bail!("cannot apply a {other:?}"),
    }
    Ok(())
}

/// A TCP relay on loopback to the API server that counts the bytes the
/// server sends back, on every connection it relays.
struct Relay {
    addr: SocketAddr,
    to_client: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
}

impl Relay {
    fn start(upstream: SocketAddr) -> Result<Relay> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let to_client = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (count, halt) = (to_client.clone(), stop.clone());
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if halt.load(Ordering::Relaxed) {
                    return;
                }
                let Ok(client) = conn else { continue };
                let Ok(server) = TcpStream::connect(upstream) else {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                };
                let _ = (client.set_nodelay(true), server.set_nodelay(true));
                let (Ok(c2), Ok(s2)) = (client.try_clone(), server.try_clone()) else { continue };
                std::thread::spawn(move || pump(client, server, None));
                let count = count.clone();
                std::thread::spawn(move || pump(s2, c2, Some(&count)));
            }
        });
        Ok(Relay { addr, to_client, stop })
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wake the accept loop so that it sees the flag.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
    }
}

/// Copies `from` to `to` until either side closes, counting into `count`.
fn pump(mut from: TcpStream, mut to: TcpStream, count: Option<&AtomicU64>) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
        if let Some(c) = count {
            c.fetch_add(n as u64, Ordering::Relaxed);
        }
    }
    let _ = to.shutdown(Shutdown::Write);
    let _ = from.shutdown(Shutdown::Read);
}
