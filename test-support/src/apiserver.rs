//! A stand-in for the Kubernetes API server, speaking the real list/watch
//! protocol over plain HTTP/1.1 so that the agent's unmodified kube-rs
//! watchers run against it.
//!
//! What it implements (as the API server does, simplified where noted):
//! - A chosen Kubernetes release ([`KubeVersion`]): the group versions it
//!   serves, the fields its objects keep, and the shape of some errors.
//!   `KubeVersion::V1_18` serves discovery.k8s.io/v1beta1 and
//!   events.k8s.io/v1beta1 only and keeps `spec.topologyKeys`;
//!   `KubeVersion::V1_21` serves v1 and v1beta1 of both; `KubeVersion::CURRENT`
//!   (the default) serves only v1 and drops `spec.topologyKeys`.
//! - Discovery: `/api`, `/api/v1`, `/apis`, `/apis/{group}`,
//!   `/apis/{group}/{version}` list what the release serves.
//! - Collections: core/v1 `services` and `nodes`, discovery.k8s.io
//!   `endpointslices` in every version the release serves (objects are kept
//!   in the v1 shape and converted per request, as the API server converts
//!   between versions: v1beta1's `topology` map carries the zone and, with
//!   no `nodeName`, the hostname), all-namespaces and namespaced paths.
//! - Lists: a global, monotonically increasing resourceVersion (like
//!   etcd's revision) in `metadata.resourceVersion`; `labelSelector`
//!   (`k`, `!k`, `k=v`, `k==v`, `k!=v`, `k in (..)`, `k notin (..)`);
//!   `fieldSelector` on `metadata.name`/`metadata.namespace`; `limit` and
//!   `continue` with consistent pages (each page is the state at the first
//!   page's version); a `continue` token older than the compaction point is
//!   410 Expired; `resourceVersion` + `resourceVersionMatch=Exact`.
//!   Items carry no `kind`/`apiVersion`, as in real list responses.
//! - Metadata-only: `Accept: application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1`
//!   for lists and `as=PartialObjectMetadata` for watches return
//!   `meta.k8s.io/v1` PartialObjectMetadata(List) objects.
//! - Watches (`watch=true`): a chunked stream of newline-terminated JSON
//!   WatchEvents (`ADDED`, `MODIFIED`, `DELETED`, `BOOKMARK`, `ERROR`),
//!   replaying every change after `resourceVersion`; no version (or "0")
//!   starts with synthetic ADDED events for the current state. Label
//!   selector transitions become ADDED/DELETED like the watch cache does.
//!   `allowWatchBookmarks=true` gets a BOOKMARK at the watcher's latest
//!   version every bookmark interval; `timeoutSeconds` ends the stream.
//!   A version older than the compaction point gets HTTP 200 and an ERROR
//!   event with a 410 Status ("too old resource version") and the stream
//!   ends; a version newer than the server's gets HTTP 504 "Too large
//!   resource version" (the watch cache's answer; with a
//!   `ResourceVersionTooLarge` cause from 1.19 on, the message alone
//!   before). `expire_watches` sends the 410 ERROR to every open watch
//!   (what a compaction does to watchers that fell behind). A watcher that
//!   cannot keep up is closed.
//! - Events: POST events.k8s.io (the versions the release serves) and
//!   core/v1 Events (validated for the fields events.k8s.io requires, and
//!   for an `apiVersion` that matches the path), PATCH accepted; kept for
//!   tests with the version they were posted to.
//! - Bytes accounting: the bytes of every list response body and every
//!   watch stream (events, bookmarks, errors), per collection, counted
//!   as hyper takes them ([`ApiServer::bytes_sent`]); uncompressed JSON,
//!   as kube-rs without its `gzip` feature asks for it.
//! - `/version`. Everything else is a 404: a Status from 1.24 on, the
//!   plain-text `404 page not found` of Go's mux before (what an older API
//!   server answers for a group version it does not serve).
//!
//! Not implemented: authentication, protobuf, streaming lists
//! (`sendInitialEvents`), writes other than Events through HTTP (the test
//! changes objects through methods), server-side apply.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::sync::{broadcast, mpsc, oneshot};

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Resource {
    Services,
    EndpointSlices,
    Nodes,
}

impl Resource {
    fn kind(self) -> &'static str {
        match self {
            Resource::Services => "Service",
            Resource::EndpointSlices => "EndpointSlice",
            Resource::Nodes => "Node",
        }
    }

    /// The version objects are kept in (requests for another version of
    /// the group are converted).
    fn api_version(self) -> &'static str {
        match self {
            Resource::Services | Resource::Nodes => "v1",
            Resource::EndpointSlices => "discovery.k8s.io/v1",
        }
    }

    fn group(self) -> &'static str {
        match self {
            Resource::Services | Resource::Nodes => "",
            Resource::EndpointSlices => DISCOVERY,
        }
    }

    fn plural(self) -> &'static str {
        match self {
            Resource::Services => "services",
            Resource::EndpointSlices => "endpointslices",
            Resource::Nodes => "nodes",
        }
    }

    fn namespaced(self) -> bool {
        self != Resource::Nodes
    }

    /// Its slot in [`BytesSent`].
    fn index(self) -> usize {
        match self {
            Resource::Services => 0,
            Resource::EndpointSlices => 1,
            Resource::Nodes => 2,
        }
    }

    fn of_plural(plural: &str) -> Option<Resource> {
        [Resource::Services, Resource::EndpointSlices, Resource::Nodes].into_iter().find(|r| r.plural() == plural)
    }

    fn of_kind(kind: &str) -> Option<Resource> {
        match kind {
            "Service" => Some(Resource::Services),
            "EndpointSlice" => Some(Resource::EndpointSlices),
            "Node" => Some(Resource::Nodes),
            _ => None,
        }
    }
}

/// The groups whose versions changed between the releases a server can
/// behave as.
const DISCOVERY: &str = "discovery.k8s.io";
const EVENTS: &str = "events.k8s.io";

/// The Kubernetes release a stand-in server behaves as (1.`minor`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KubeVersion {
    pub minor: u32,
}

impl KubeVersion {
    /// OpenYurt's walk-through's cluster: EndpointSlices and events.k8s.io
    /// in v1beta1 only, `spec.topologyKeys` (ServiceTopology enabled), no
    /// `internalTrafficPolicy` or `trafficDistribution`.
    pub const V1_18: KubeVersion = KubeVersion { minor: 18 };
    /// The last release with `spec.topologyKeys`, and the first that serves
    /// discovery.k8s.io/v1 (beside v1beta1).
    pub const V1_21: KubeVersion = KubeVersion { minor: 21 };
    /// Today's API: v1 only, no `spec.topologyKeys`.
    pub const CURRENT: KubeVersion = KubeVersion { minor: 33 };

    /// The versions of `group` this release serves, preferred first
    /// (discovery.k8s.io/v1 came in 1.21, events.k8s.io/v1 in 1.19; both
    /// v1beta1s were removed in 1.25).
    fn versions(self, group: &str) -> Vec<&'static str> {
        let m = self.minor;
        let mut out = Vec::new();
        match group {
            "" => out.push("v1"),
            DISCOVERY => {
                if m >= 21 {
                    out.push("v1");
                }
                if (17..=24).contains(&m) {
                    out.push("v1beta1");
                }
            }
            EVENTS => {
                if m >= 19 {
                    out.push("v1");
                }
                if m <= 24 {
                    out.push("v1beta1");
                }
            }
            _ => {}
        }
        out
    }

    fn serves(self, group: &str, version: &str) -> bool {
        self.versions(group).contains(&version)
    }

    /// Drops the fields this release does not have from an object in the
    /// shape it is kept in (what the API server does to unknown fields on
    /// write, and to fields of disabled features).
    fn prune(self, res: Resource, obj: &mut Value) {
        let m = self.minor;
        match res {
            Resource::Services => {
                let Some(spec) = obj.get_mut("spec").and_then(Value::as_object_mut) else { return };
                // ServiceTopology: 1.17-1.21, removed in 1.22.
                if !(17..=21).contains(&m) {
                    spec.remove("topologyKeys");
                }
                // Beta (on by default) in 1.22 and 1.31.
                if m < 22 {
                    spec.remove("internalTrafficPolicy");
                }
                if m < 31 {
                    spec.remove("trafficDistribution");
                }
            }
            Resource::EndpointSlices => {
                for ep in obj.get_mut("endpoints").and_then(Value::as_array_mut).into_iter().flatten() {
                    let Some(ep) = ep.as_object_mut() else { continue };
                    // v1beta1 got nodeName in 1.20, hints in 1.21; the
                    // serving and terminating conditions are on by
                    // default from 1.22.
                    if m < 20 {
                        ep.remove("nodeName");
                    }
                    if m < 21 {
                        ep.remove("hints");
                    }
                    if m < 22
                        && let Some(c) = ep.get_mut("conditions").and_then(Value::as_object_mut)
                    {
                        c.remove("serving");
                        c.remove("terminating");
                    }
                }
            }
            Resource::Nodes => {}
        }
    }

    /// An unserved path: a Status from 1.24 on (the apiserver's
    /// notfoundhandler), the plain text of Go's `http.NotFound` before.
    fn not_found(self, path: &str) -> Response<Body> {
        if self.minor >= 24 {
            return error(404, "NotFound", &format!("the server could not find the requested resource ({path})"));
        }
        let mut r = Response::new(Full::new(Bytes::from_static(b"404 page not found\n")).boxed());
        *r.status_mut() = StatusCode::NOT_FOUND;
        r.headers_mut().insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static("text/plain; charset=utf-8"));
        r
    }
}

/// discovery.k8s.io/v1beta1 -> v1, as the API server converts
/// (pkg/apis/discovery/v1beta1/conversion.go): the zone leaves the
/// `topology` map for `zone`, the hostname leaves it when it equals
/// `nodeName`, the rest stays as `deprecatedTopology`.
fn slice_to_v1(mut obj: Value) -> Value {
    for ep in obj.get_mut("endpoints").and_then(Value::as_array_mut).into_iter().flatten() {
        let Some(ep) = ep.as_object_mut() else { continue };
        let Some(Value::Object(mut topology)) = ep.remove("topology") else { continue };
        if let Some(zone) = topology.remove(ZONE_LABEL) {
            ep.insert("zone".into(), zone);
        }
        if topology.get(HOSTNAME_LABEL).is_some_and(|h| Some(h) == ep.get("nodeName")) {
            topology.remove(HOSTNAME_LABEL);
        }
        if !topology.is_empty() {
            ep.insert("deprecatedTopology".into(), Value::Object(topology));
        }
    }
    obj
}

/// discovery.k8s.io/v1 -> v1beta1: `deprecatedTopology` and `zone` make up
/// the `topology` map again.
fn slice_to_v1beta1(mut obj: Value) -> Value {
    for ep in obj.get_mut("endpoints").and_then(Value::as_array_mut).into_iter().flatten() {
        let Some(ep) = ep.as_object_mut() else { continue };
        let mut topology = match ep.remove("deprecatedTopology") {
            Some(Value::Object(t)) => t,
            _ => serde_json::Map::new(),
        };
        if let Some(zone) = ep.remove("zone") {
            topology.insert(ZONE_LABEL.into(), zone);
        }
        if !topology.is_empty() {
            ep.insert("topology".into(), Value::Object(topology));
        }
    }
    obj
}

const ZONE_LABEL: &str = "topology.kubernetes.io/zone";
const HOSTNAME_LABEL: &str = "kubernetes.io/hostname";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ChangeType {
    Added,
    Modified,
    Deleted,
}

#[derive(Debug)]
struct Change {
    rv: u64,
    res: Resource,
    ty: ChangeType,
    /// The new state; for a deletion the last state with the deletion's
    /// resourceVersion.
    obj: Value,
    /// The state before (modifications and deletions).
    old: Option<Value>,
}

#[derive(Clone, Debug)]
enum Msg {
    Change(Arc<Change>),
    /// Tell every open watch its version expired (410) and close it.
    Expire,
}

type Key = (Resource, String, String);

/// Bytes of response bodies sent, per collection ([`Resource::index`]):
/// list bodies (whole, when the response is built) and watch streams (each
/// event, bookmark or error line as the connection takes it). Atomics, so
/// a bench can read them while watches stream, without the state's lock.
#[derive(Default)]
struct BytesSent {
    list: [AtomicU64; 3],
    watch: [AtomicU64; 3],
}

impl BytesSent {
    fn add_list(&self, res: Resource, n: usize) {
        self.list[res.index()].fetch_add(n as u64, Ordering::Relaxed);
    }

    fn add_watch(&self, res: Resource, n: usize) {
        self.watch[res.index()].fetch_add(n as u64, Ordering::Relaxed);
    }
}

struct State {
    rv: u64,
    /// Watches and continue tokens from versions below this get 410 Gone.
    compacted: u64,
    objects: BTreeMap<Key, Value>,
    /// Each current object as a list item (JSON without kind/apiVersion),
    /// rendered when it changes. The API server keeps objects decoded in
    /// its watch cache and serializes every list, but it runs on other
    /// machines: here it shares the agent's cores, and rendering 20k
    /// objects per cold sync took most of a core away from the agent being
    /// measured.
    items: BTreeMap<Key, String>,
    history: Vec<Arc<Change>>,
    tx: broadcast::Sender<Msg>,
    events: Vec<Value>,
    requests: Vec<String>,
    bookmark_interval: Duration,
    /// Whether `allowWatchBookmarks` is honoured (servers before 1.15, or
    /// with the feature off, ignore it).
    bookmarks_served: bool,
    /// Ends every watch after this long even if the client asked for more
    /// (the API server does so after --min-request-timeout, randomised).
    watch_cutoff: Option<Duration>,
    version: KubeVersion,
    /// Where it listens (the `/api` discovery document names it).
    addr: SocketAddr,
    bytes: Arc<BytesSent>,
}

static UID: AtomicU64 = AtomicU64::new(1);
/// BOOKMARK events sent, by all servers of this test process.
static BOOKMARKS: AtomicU64 = AtomicU64::new(0);

fn now_rfc3339() -> String {
    let secs = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_secs();
    // Civil-from-days (Howard Hinnant), enough for creationTimestamp.
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

impl State {
    fn key_of(obj: &Value) -> Option<Key> {
        let res = Resource::of_kind(obj.get("kind")?.as_str()?)?;
        let meta = obj.get("metadata")?;
        let name = meta.get("name")?.as_str()?.to_string();
        let ns =
            if res.namespaced() { meta.get("namespace").and_then(Value::as_str).unwrap_or("default").to_string() } else { String::new() };
        Some((res, ns, name))
    }

    fn record(&mut self, res: Resource, ty: ChangeType, obj: Value, old: Option<Value>) {
        let c = Arc::new(Change { rv: self.rv, res, ty, obj, old });
        self.history.push(c.clone());
        // No receiver is fine: nobody is watching.
        let _ = self.tx.send(Msg::Change(c));
    }

    fn apply(&mut self, obj: Value) -> u64 {
        let key = Self::key_of(&obj).unwrap_or_else(|| panic!("test object without kind/name: {obj}"));
        // Kept in one version: an object written in another is converted,
        // and what this release does not have is dropped.
        let written = obj.get("apiVersion").and_then(Value::as_str).unwrap_or(key.0.api_version()).to_string();
        let (group, version) = written.rsplit_once('/').unwrap_or(("", written.as_str()));
        assert!(
            group == key.0.group() && self.version.serves(group, version),
            "test object {}/{} in {written}, which Kubernetes 1.{} does not serve",
            key.1,
            key.2,
            self.version.minor
        );
        let mut obj = if key.0 == Resource::EndpointSlices && version == "v1beta1" { slice_to_v1(obj) } else { obj };
        self.version.prune(key.0, &mut obj);
        self.rv += 1;
        let old = self.objects.get(&key).cloned();
        let meta = obj
            .as_object_mut()
            .and_then(|o| Some(o.entry("metadata").or_insert_with(|| json!({})).as_object_mut()?.clone()))
            .unwrap_or_default();
        let mut meta = meta;
        if key.0.namespaced() {
            meta.insert("namespace".into(), json!(key.1));
        }
        meta.insert("resourceVersion".into(), json!(self.rv.to_string()));
        let uid = old
            .as_ref()
            .and_then(|o| o["metadata"]["uid"].as_str().map(str::to_string))
            .unwrap_or_else(|| format!("00000000-0000-4000-8000-{:012x}", UID.fetch_add(1, Ordering::Relaxed)));
        meta.insert("uid".into(), json!(uid));
        let created =
            old.as_ref().and_then(|o| o["metadata"]["creationTimestamp"].as_str().map(str::to_string)).unwrap_or_else(now_rfc3339);
        meta.insert("creationTimestamp".into(), json!(created));
        obj["metadata"] = Value::Object(meta);
        obj["apiVersion"] = json!(key.0.api_version());
        self.items.insert(key.clone(), untyped_json(&obj));
        self.objects.insert(key.clone(), obj.clone());
        let ty = if old.is_some() { ChangeType::Modified } else { ChangeType::Added };
        self.record(key.0, ty, obj, old);
        self.rv
    }

    fn delete(&mut self, key: &Key) -> bool {
        let Some(old) = self.objects.remove(key) else { return false };
        self.items.remove(key);
        self.rv += 1;
        let mut last = old.clone();
        last["metadata"]["resourceVersion"] = json!(self.rv.to_string());
        self.record(key.0, ChangeType::Deleted, last, Some(old));
        true
    }

    /// The objects of `res` as they were at version `rv`.
    fn state_at(&self, res: Resource, rv: u64) -> BTreeMap<Key, Value> {
        if rv >= self.rv {
            return self.objects.iter().filter(|(k, _)| k.0 == res).map(|(k, v)| (k.clone(), v.clone())).collect();
        }
        let mut out = BTreeMap::new();
        for c in self.history.iter().take_while(|c| c.rv <= rv).filter(|c| c.res == res) {
            if let Some(k) = Self::key_of(&c.obj) {
                match c.ty {
                    ChangeType::Deleted => {
                        out.remove(&k);
                    }
                    _ => {
                        out.insert(k, c.obj.clone());
                    }
                }
            }
        }
        out
    }
}

/// One stand-in API server on 127.0.0.1.
pub struct ApiServer {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    bytes: Arc<BytesSent>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl ApiServer {
    /// A new server on a free port whose history starts after `first_rv`.
    pub fn start(first_rv: u64) -> ApiServer {
        Self::start_on("127.0.0.1:0".parse().expect("literal address"), first_rv, Vec::new())
    }

    /// A server on `addr` (retried while the port is still held by a
    /// stopped predecessor) with a fresh history: `objects` are created at
    /// versions `first_rv + 1 ..`.
    pub fn start_on(addr: SocketAddr, first_rv: u64, objects: Vec<Value>) -> ApiServer {
        Self::start_as(KubeVersion::CURRENT, addr, first_rv, objects)
    }

    /// [`Self::start_on`] for a server that behaves as Kubernetes `version`.
    /// `objects` may be in any version of their group that it serves.
    pub fn start_as(version: KubeVersion, addr: SocketAddr, first_rv: u64, objects: Vec<Value>) -> ApiServer {
        let (tx, _) = broadcast::channel(1 << 16);
        let bytes = Arc::new(BytesSent::default());
        let mut st = State {
            rv: first_rv,
            compacted: first_rv,
            objects: BTreeMap::new(),
            items: BTreeMap::new(),
            history: Vec::new(),
            tx,
            events: Vec::new(),
            requests: Vec::new(),
            bookmark_interval: Duration::from_secs(1),
            bookmarks_served: true,
            watch_cutoff: None,
            version,
            addr,
            bytes: bytes.clone(),
        };
        for o in objects {
            st.apply(o);
        }
        let state = Arc::new(Mutex::new(st));
        let (stop_tx, stop_rx) = oneshot::channel();
        let (bound_tx, bound_rx) = std::sync::mpsc::channel();
        let st = state.clone();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("test runtime");
            rt.block_on(async move {
                let deadline = Instant::now() + Duration::from_secs(10);
                let listener = loop {
                    match tokio::net::TcpListener::bind(addr).await {
                        Ok(l) => break l,
                        Err(e) if Instant::now() > deadline => panic!("test API server cannot bind {addr}: {e}"),
                        Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
                    }
                };
                let _ = bound_tx.send(listener.local_addr().expect("local addr"));
                let accept = async {
                    loop {
                        let Ok((stream, _)) = listener.accept().await else { continue };
                        // As the API server (Go sets TCP_NODELAY on every
                        // connection): each watch event goes out at once
                        // instead of waiting for the client's delayed ACK.
                        let _ = stream.set_nodelay(true);
                        let st = st.clone();
                        tokio::spawn(async move {
                            let svc = hyper::service::service_fn(move |req| {
                                let st = st.clone();
                                async move { Ok::<_, Infallible>(handle(st, req).await) }
                            });
                            let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), svc).await;
                        });
                    }
                };
                tokio::select! {
                    _ = accept => {}
                    _ = stop_rx => {}
                }
            });
            // Dropping the runtime cancels every connection task: all
            // streams close at once, like a killed API server.
            rt.shutdown_background();
        });
        let addr = bound_rx.recv_timeout(Duration::from_secs(15)).expect("test API server did not start");
        state.lock().unwrap_or_else(std::sync::PoisonError::into_inner).addr = addr;
        ApiServer { addr, state, bytes, stop: Some(stop_tx), thread: Some(thread) }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// A kubeconfig for this server (http, no credentials).
    pub fn write_kubeconfig(&self, path: &Path) {
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: http://{}\ncontexts:\n- name: test\n  context:\n    cluster: test\n    user: test\nusers:\n- name: test\n  user: {{}}\ncurrent-context: test\n",
            self.addr
        );
        std::fs::write(path, text).expect("write kubeconfig");
    }

    pub fn set_bookmark_interval(&self, d: Duration) {
        self.lock().bookmark_interval = d;
    }

    /// Ignores `allowWatchBookmarks` from now on, as a server without the
    /// feature does: watchers resume from the last object they saw.
    pub fn set_bookmarks_served(&self, served: bool) {
        self.lock().bookmarks_served = served;
    }

    /// Ends watches after `d`; clients resume from their last version.
    pub fn set_watch_cutoff(&self, d: Duration) {
        self.lock().watch_cutoff = Some(d);
    }

    /// Creates or replaces an object (by kind, namespace and name).
    pub fn apply(&self, obj: Value) -> u64 {
        self.lock().apply(obj)
    }

    /// Many objects, each its own change, under one lock (a burst).
    pub fn apply_all(&self, objs: Vec<Value>) {
        let mut st = self.lock();
        for o in objs {
            st.apply(o);
        }
    }

    pub fn delete(&self, kind: &str, namespace: &str, name: &str) -> bool {
        let res = Resource::of_kind(kind).unwrap_or_else(|| panic!("unknown kind {kind}"));
        let ns = if res.namespaced() { namespace.to_string() } else { String::new() };
        self.lock().delete(&(res, ns, name.to_string()))
    }

    /// Deletes every object of `kind`, one change each.
    pub fn delete_all(&self, kind: &str) {
        let res = Resource::of_kind(kind).unwrap_or_else(|| panic!("unknown kind {kind}"));
        let mut st = self.lock();
        let keys: Vec<Key> = st.objects.keys().filter(|k| k.0 == res).cloned().collect();
        for k in keys {
            st.delete(&k);
        }
    }

    /// The current objects (with kind), each in the newest version of its
    /// group this server serves, e.g. to restart with a new history.
    pub fn objects(&self) -> Vec<Value> {
        let s = self.lock();
        s.objects
            .iter()
            .map(|((res, _, _), o)| {
                let version = group_version(res.group(), s.version.versions(res.group()).first().copied().unwrap_or("v1"));
                present(Shape { res: *res, version, meta_only: false }, o, true)
            })
            .collect()
    }

    pub fn resource_version(&self) -> u64 {
        self.lock().rv
    }

    /// Compacts the history up to now and sends every open watch an ERROR
    /// event with a 410 Status, as the API server does to watchers whose
    /// version fell out of its window. They must relist.
    pub fn expire_watches(&self) {
        let mut st = self.lock();
        // Every change so far is compacted away: a watch can start from the
        // current version only.
        st.compacted = st.rv;
        let _ = st.tx.send(Msg::Expire);
    }

    /// BOOKMARK events sent so far (all servers of this process).
    pub fn bookmarks_sent() -> u64 {
        BOOKMARKS.load(Ordering::Relaxed)
    }

    /// Bytes of response bodies sent so far for `resource` (`"nodes"`,
    /// `"services"`, `"endpointslices"`; every version and shape, full or
    /// metadata-only), lists and watches together. Counted since the start
    /// or the last [`Self::reset_bytes_sent`]; a watch's bytes count as the
    /// connection takes them. Panics on another name.
    pub fn bytes_sent(&self, resource: &str) -> u64 {
        self.list_bytes_sent(resource) + self.watch_bytes_sent(resource)
    }

    /// [`Self::bytes_sent`] of list responses only (every page).
    pub fn list_bytes_sent(&self, resource: &str) -> u64 {
        self.bytes.list[Self::resource_named(resource).index()].load(Ordering::Relaxed)
    }

    /// [`Self::bytes_sent`] of watch streams only: events (including a
    /// watch's synthetic ADDED events), bookmarks and ERROR events.
    pub fn watch_bytes_sent(&self, resource: &str) -> u64 {
        self.bytes.watch[Self::resource_named(resource).index()].load(Ordering::Relaxed)
    }

    /// Sets every byte count to zero.
    pub fn reset_bytes_sent(&self) {
        for c in self.bytes.list.iter().chain(&self.bytes.watch) {
            c.store(0, Ordering::Relaxed);
        }
    }

    fn resource_named(plural: &str) -> Resource {
        Resource::of_plural(plural).unwrap_or_else(|| panic!("no collection {plural:?} (nodes, services, endpointslices)"))
    }

    /// Open watch streams.
    pub fn open_watches(&self) -> usize {
        self.lock().tx.receiver_count()
    }

    /// Events POSTed so far.
    pub fn events(&self) -> Vec<Value> {
        self.lock().events.clone()
    }

    /// "METHOD path?query [accept]" of every request so far.
    pub fn requests(&self) -> Vec<String> {
        self.lock().requests.clone()
    }

    /// Stops listening and drops every connection.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

// ---- HTTP ----

type Body = BoxBody<Bytes, Infallible>;

fn full(code: StatusCode, v: &Value) -> Response<Body> {
    let mut r = Response::new(Full::new(Bytes::from(v.to_string())).boxed());
    *r.status_mut() = code;
    r.headers_mut().insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static("application/json"));
    r
}

fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message, "reason": reason, "code": code})
}

fn error(code: u16, reason: &str, message: &str) -> Response<Body> {
    full(StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR), &status(code, reason, message))
}

fn decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => match u8::from_str_radix(std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("zz"), 16) {
                Ok(b) => {
                    out.push(b);
                    i += 2;
                }
                Err(_) => out.push(b'%'),
            },
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn query(q: Option<&str>) -> BTreeMap<String, String> {
    q.unwrap_or_default()
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('=') {
            Some((k, v)) => (decode(k), decode(v)),
            None => (decode(p), String::new()),
        })
        .collect()
}

enum Route {
    /// A collection in a group version (`"v1"`, `"discovery.k8s.io/v1beta1"`).
    Collection(Resource, &'static str, Option<String>),
    /// Events of a namespace, in a group version.
    Events(&'static str, String),
    Event(String, String),
    Version,
    /// A discovery document.
    Discovery(Value),
}

/// `group/version` of a served version, or `version` for the core group.
fn group_version(group: &str, version: &'static str) -> &'static str {
    match (group, version) {
        (DISCOVERY, "v1") => "discovery.k8s.io/v1",
        (DISCOVERY, _) => "discovery.k8s.io/v1beta1",
        (EVENTS, "v1") => "events.k8s.io/v1",
        (EVENTS, _) => "events.k8s.io/v1beta1",
        (_, v) => v,
    }
}

/// The served version named by a path segment, if `group` has it.
fn served(kv: KubeVersion, group: &str, version: &str) -> Option<&'static str> {
    kv.versions(group).into_iter().find(|v| *v == version)
}

fn route(kv: KubeVersion, addr: SocketAddr, path: &str) -> Option<Route> {
    let seg: Vec<&str> = path.trim_matches('/').split('/').collect();
    use Resource::{EndpointSlices, Nodes, Services};
    Some(match seg.as_slice() {
        ["version"] => Route::Version,
        ["api"] => Route::Discovery(json!({
            "kind": "APIVersions", "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": addr.to_string()}],
        })),
        ["apis"] => {
            let groups: Vec<Value> = [DISCOVERY, EVENTS].iter().filter_map(|g| api_group(kv, g)).collect();
            Route::Discovery(json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}))
        }
        ["apis", group] => Route::Discovery(api_group(kv, group)?),
        ["api", "v1"] => Route::Discovery(resource_list("v1", &[(Services, "Service"), (Nodes, "Node")], true)),
        ["apis", group, version] => {
            let v = served(kv, group, version)?;
            let resources: &[(Resource, &str)] = if *group == DISCOVERY { &[(EndpointSlices, "EndpointSlice")] } else { &[] };
            Route::Discovery(resource_list(group_version(group, v), resources, *group == EVENTS))
        }
        ["api", "v1", "services"] => Route::Collection(Services, "v1", None),
        ["api", "v1", "namespaces", ns, "services"] => Route::Collection(Services, "v1", Some(ns.to_string())),
        ["api", "v1", "nodes"] => Route::Collection(Nodes, "v1", None),
        ["apis", DISCOVERY, version, "endpointslices"] => {
            Route::Collection(EndpointSlices, group_version(DISCOVERY, served(kv, DISCOVERY, version)?), None)
        }
        ["apis", DISCOVERY, version, "namespaces", ns, "endpointslices"] => {
            Route::Collection(EndpointSlices, group_version(DISCOVERY, served(kv, DISCOVERY, version)?), Some(ns.to_string()))
        }
        ["apis", EVENTS, version, "namespaces", ns, "events"] => {
            Route::Events(group_version(EVENTS, served(kv, EVENTS, version)?), ns.to_string())
        }
        ["api", "v1", "namespaces", ns, "events"] => Route::Events("v1", ns.to_string()),
        ["apis", EVENTS, version, "namespaces", ns, "events", name] => {
            served(kv, EVENTS, version)?;
            Route::Event(ns.to_string(), name.to_string())
        }
        ["api", "v1", "namespaces", ns, "events", name] => Route::Event(ns.to_string(), name.to_string()),
        _ => return None,
    })
}

/// The APIGroup discovery document of `group`, if the release serves it.
fn api_group(kv: KubeVersion, group: &str) -> Option<Value> {
    let versions: Vec<Value> =
        kv.versions(group).into_iter().map(|v| json!({"groupVersion": group_version(group, v), "version": v})).collect();
    let preferred = versions.first()?.clone();
    Some(json!({"kind": "APIGroup", "apiVersion": "v1", "name": group, "versions": versions, "preferredVersion": preferred}))
}

/// The APIResourceList of a group version: its collections, and Events
/// when `events`.
fn resource_list(group_version: &str, resources: &[(Resource, &str)], events: bool) -> Value {
    let verbs = json!(["get", "list", "watch"]);
    let mut list: Vec<Value> = resources
        .iter()
        .map(|(r, kind)| {
            json!({"name": r.plural(), "singularName": kind.to_lowercase(), "namespaced": r.namespaced(), "kind": kind, "verbs": verbs})
        })
        .collect();
    if events {
        list.push(json!({"name": "events", "singularName": "event", "namespaced": true, "kind": "Event", "verbs": ["create", "get", "list", "patch", "watch"]}));
    }
    json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": group_version, "resources": list})
}

async fn handle(st: Arc<Mutex<State>>, req: Request<Incoming>) -> Response<Body> {
    let accept = req.headers().get(hyper::header::ACCEPT).and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    let path = req.uri().path().to_string();
    let q = query(req.uri().query());
    let method = req.method().clone();
    let (kv, addr) = {
        let mut s = lock(&st);
        s.requests.push(format!("{method} {} [{accept}]", req.uri()));
        (s.version, s.addr)
    };
    let Some(r) = route(kv, addr, &path) else {
        return kv.not_found(&path);
    };
    match (method, r) {
        (Method::GET, Route::Version) => full(
            StatusCode::OK,
            &json!({"major": "1", "minor": kv.minor.to_string(), "gitVersion": format!("v1.{}.0-topoproxy-test", kv.minor)}),
        ),
        (Method::GET, Route::Discovery(doc)) => full(StatusCode::OK, &doc),
        (Method::GET, Route::Collection(res, version, ns)) => {
            let meta_only = accept.contains("as=PartialObjectMetadata");
            let selector = match q.get("labelSelector").map(|s| parse_selector(s)).transpose() {
                Ok(s) => s.unwrap_or_default(),
                Err(e) => return error(400, "BadRequest", &format!("unable to parse requirement: {e}")),
            };
            let fields = match q.get("fieldSelector").map(|s| parse_fields(s)).transpose() {
                Ok(f) => f.unwrap_or_default(),
                Err(e) => return error(400, "BadRequest", &e),
            };
            let filter = Filter { ns, selector, fields };
            let shape = Shape { res, version, meta_only };
            if q.get("watch").is_some_and(|w| w == "true" || w == "1") {
                watch(st, shape, filter, &q)
            } else {
                list(&st, shape, &filter, &q)
            }
        }
        (Method::POST, Route::Events(api_version, ns)) => {
            let body = match req.into_body().collect().await {
                Ok(b) => b.to_bytes(),
                Err(_) => return error(400, "BadRequest", "unreadable body"),
            };
            let mut ev: Value = match serde_json::from_slice(&body) {
                Ok(v) => v,
                Err(e) => return error(400, "BadRequest", &format!("invalid JSON: {e}")),
            };
            // The API server decodes the body as the path's version.
            if let Some(written) = ev.get("apiVersion").and_then(Value::as_str).filter(|v| *v != api_version) {
                return error(
                    400,
                    "BadRequest",
                    &format!("the API version in the data ({written}) does not match the expected API version ({api_version})"),
                );
            }
            if let Err(msg) = validate_event(&ev, api_version != "v1") {
                return error(422, "Invalid", &format!("Event is invalid: {msg}"));
            }
            ev["apiVersion"] = json!(api_version);
            let mut s = lock(&st);
            s.rv += 1;
            ev["metadata"]["namespace"] = json!(ns);
            ev["metadata"]["resourceVersion"] = json!(s.rv.to_string());
            ev["metadata"]["uid"] = json!(format!("ev-{}", UID.fetch_add(1, Ordering::Relaxed)));
            s.events.push(ev.clone());
            full(StatusCode::CREATED, &ev)
        }
        (Method::PATCH, Route::Event(ns, name)) => {
            let s = lock(&st);
            match s.events.iter().find(|e| e["metadata"]["name"] == name.as_str() && e["metadata"]["namespace"] == ns.as_str()) {
                Some(e) => full(StatusCode::OK, e),
                None => error(404, "NotFound", &format!("events \"{name}\" not found")),
            }
        }
        _ => error(405, "MethodNotAllowed", "the server does not allow this method on the requested resource"),
    }
}

fn lock(st: &Arc<Mutex<State>>) -> MutexGuard<'_, State> {
    st.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The fields events.k8s.io/v1 validation requires of a new Event
/// (pkg/apis/core/validation: ValidateEventCreate for v1).
fn validate_event(ev: &Value, events_v1: bool) -> Result<(), String> {
    let s = |p: &str| ev.pointer(p).and_then(Value::as_str).unwrap_or_default().to_string();
    if s("/metadata/name").is_empty() {
        return Err("metadata.name: Required value".into());
    }
    if !events_v1 {
        return Ok(());
    }
    for (p, f) in [
        ("/eventTime", "eventTime"),
        ("/reportingController", "reportingController"),
        ("/reportingInstance", "reportingInstance"),
        ("/action", "action"),
        ("/reason", "reason"),
    ] {
        if s(p).is_empty() {
            return Err(format!("{f}: Required value"));
        }
    }
    if !matches!(s("/type").as_str(), "Normal" | "Warning") {
        return Err("type: Unsupported value".into());
    }
    if s("/note").len() > 1024 {
        return Err("note: Too long: may not be more than 1024 bytes".into());
    }
    if s("/reportingInstance").len() > 128 || s("/action").len() > 128 || s("/reason").len() > 128 {
        return Err("reportingInstance, action and reason may not be more than 128 characters".into());
    }
    Ok(())
}

// ---- selectors ----

#[derive(Clone, Debug)]
enum Req {
    Exists(String),
    NotExists(String),
    Eq(String, String),
    Ne(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
}

fn split_top(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut depth = 0;
    let mut cur = String::new();
    for c in s.chars() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                out.push(std::mem::take(&mut cur));
                continue;
            }
            _ => {}
        }
        cur.push(c);
    }
    out.push(cur);
    out.into_iter().map(|p| p.trim().to_string()).filter(|p| !p.is_empty()).collect()
}

fn parse_selector(s: &str) -> Result<Vec<Req>, String> {
    let mut out = Vec::new();
    for part in split_top(s) {
        let set = |rest: &str| -> Result<Vec<String>, String> {
            let inner = rest.trim().strip_prefix('(').and_then(|r| r.strip_suffix(')')).ok_or(format!("{part:?}: expected (values)"))?;
            Ok(inner.split(',').map(|v| v.trim().to_string()).filter(|v| !v.is_empty()).collect())
        };
        let req = if let Some(k) = part.strip_prefix('!') {
            Req::NotExists(k.trim().to_string())
        } else if let Some((k, v)) = part.split_once("!=") {
            Req::Ne(k.trim().into(), v.trim().into())
        } else if let Some((k, v)) = part.split_once("==") {
            Req::Eq(k.trim().into(), v.trim().into())
        } else if let Some((k, v)) = part.split_once('=') {
            Req::Eq(k.trim().into(), v.trim().into())
        } else if let Some((k, rest)) = part.split_once(" notin ") {
            Req::NotIn(k.trim().into(), set(rest)?)
        } else if let Some((k, rest)) = part.split_once(" in ") {
            Req::In(k.trim().into(), set(rest)?)
        } else if part.chars().all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c)) {
            Req::Exists(part.clone())
        } else {
            return Err(format!("{part:?}"));
        };
        out.push(req);
    }
    Ok(out)
}

/// Whether `obj`'s labels match a label selector (for the server's own tests).
pub fn selector_matches(selector: &str, obj: &Value) -> Result<bool, String> {
    Ok(label_matches(&parse_selector(selector)?, obj))
}

fn label_matches(reqs: &[Req], obj: &Value) -> bool {
    let labels = obj.get("metadata").and_then(|m| m.get("labels"));
    let get = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
    reqs.iter().all(|r| match r {
        Req::Exists(k) => get(k).is_some(),
        Req::NotExists(k) => get(k).is_none(),
        Req::Eq(k, v) => get(k) == Some(v.as_str()),
        Req::Ne(k, v) => get(k) != Some(v.as_str()),
        Req::In(k, vs) => get(k).is_some_and(|x| vs.iter().any(|v| v == x)),
        Req::NotIn(k, vs) => get(k).is_none_or(|x| !vs.iter().any(|v| v == x)),
    })
}

/// (field, value, equal?) for metadata.name / metadata.namespace.
fn parse_fields(s: &str) -> Result<Vec<(String, String, bool)>, String> {
    let mut out = Vec::new();
    for part in split_top(s) {
        let (k, v, eq) = if let Some((k, v)) = part.split_once("!=") {
            (k, v, false)
        } else if let Some((k, v)) = part.split_once("==").or_else(|| part.split_once('=')) {
            (k, v, true)
        } else {
            return Err(format!("invalid field selector {part:?}"));
        };
        if !matches!(k.trim(), "metadata.name" | "metadata.namespace") {
            return Err(format!("field label not supported: {k}"));
        }
        out.push((k.trim().to_string(), v.trim().to_string(), eq));
    }
    Ok(out)
}

struct Filter {
    ns: Option<String>,
    selector: Vec<Req>,
    fields: Vec<(String, String, bool)>,
}

impl Filter {
    fn matches(&self, obj: &Value) -> bool {
        // Plain lookups, no allocation: a list of 10k objects checks each
        // one per page.
        let meta = |f: &str| obj.get("metadata").and_then(|m| m.get(f)).and_then(Value::as_str).unwrap_or_default();
        if let Some(ns) = &self.ns
            && meta("namespace") != ns.as_str()
        {
            return false;
        }
        let fields_ok = self.fields.iter().all(|(k, v, eq)| {
            let got = meta(k.trim_start_matches("metadata."));
            (got == v.as_str()) == *eq
        });
        fields_ok && label_matches(&self.selector, obj)
    }
}

/// What a request asks objects to look like: the collection, the group
/// version, and whether metadata-only.
#[derive(Clone, Copy)]
struct Shape {
    res: Resource,
    /// `"v1"`, `"discovery.k8s.io/v1beta1"`, ...
    version: &'static str,
    meta_only: bool,
}

impl Shape {
    /// Objects are kept in this shape (and list items rendered in it).
    fn is_stored(self) -> bool {
        !self.meta_only && self.version == self.res.api_version()
    }

    fn list_kind(self) -> (String, &'static str) {
        if self.meta_only {
            ("PartialObjectMetadataList".to_string(), "meta.k8s.io/v1")
        } else {
            (format!("{}List", self.res.kind()), self.version)
        }
    }

    fn kind(self) -> (&'static str, &'static str) {
        if self.meta_only { ("PartialObjectMetadata", "meta.k8s.io/v1") } else { (self.res.kind(), self.version) }
    }
}

/// How an object is shown: metadata-only, or typed with or without
/// kind/apiVersion (list items carry none), in the asked-for version.
fn present(shape: Shape, obj: &Value, with_type: bool) -> Value {
    if shape.meta_only {
        let mut o = json!({"metadata": obj.get("metadata").cloned().unwrap_or(json!({}))});
        if with_type {
            o["kind"] = json!("PartialObjectMetadata");
            o["apiVersion"] = json!("meta.k8s.io/v1");
        }
        return o;
    }
    let mut o = if shape.res == Resource::EndpointSlices && shape.version.ends_with("v1beta1") {
        slice_to_v1beta1(obj.clone())
    } else {
        obj.clone()
    };
    if let Some(m) = o.as_object_mut() {
        if with_type {
            m.insert("kind".into(), json!(shape.res.kind()));
            m.insert("apiVersion".into(), json!(shape.version));
        } else {
            m.remove("kind");
            m.remove("apiVersion");
        }
    }
    o
}

fn list(st: &Arc<Mutex<State>>, shape: Shape, filter: &Filter, q: &BTreeMap<String, String>) -> Response<Body> {
    let s = lock(st);
    let res = shape.res;
    let (at, offset) = if let Some(c) = q.get("continue").filter(|c| !c.is_empty()) {
        let parsed = c.split_once(':').and_then(|(a, b)| Some((a.parse::<u64>().ok()?, b.parse::<usize>().ok()?)));
        let Some((rv, off)) = parsed else { return error(400, "BadRequest", "invalid continue token") };
        if rv < s.compacted {
            return error(
                410,
                "Expired",
                "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter.",
            );
        }
        (rv, off)
    } else {
        let want = q.get("resourceVersion").and_then(|v| v.parse::<u64>().ok()).filter(|v| *v > 0);
        match (want, q.get("resourceVersionMatch").map(String::as_str)) {
            (Some(rv), Some("Exact")) if rv < s.compacted => {
                return error(410, "Expired", &format!("too old resource version: {rv} ({})", s.compacted));
            }
            (Some(rv), Some("Exact")) => (rv, 0),
            (Some(rv), _) if rv > s.rv => {
                return too_large(s.version, rv, s.rv);
            }
            _ => (s.rv, 0),
        }
    };
    // At the current version the objects are read in place: copying every
    // object of the kind for each page would make a paged list of N objects
    // cost O(N^2 / page) (the API server serves lists from its watch cache).
    let historic;
    let all: Vec<(&Key, &Value)> = if at >= s.rv {
        s.objects.iter().filter(|(k, _)| k.0 == res).filter(|(_, o)| filter.matches(o)).collect()
    } else {
        historic = s.state_at(res, at);
        historic.iter().filter(|(_, o)| filter.matches(o)).collect()
    };
    let limit = q.get("limit").and_then(|l| l.parse::<usize>().ok()).filter(|l| *l > 0).unwrap_or(usize::MAX);
    let page: Vec<(&Key, &Value)> = all.iter().skip(offset).take(limit).copied().collect();
    let next = offset.saturating_add(page.len());
    let mut metadata = json!({"resourceVersion": at.to_string()});
    if next < all.len() {
        metadata["continue"] = json!(format!("{at}:{next}"));
        metadata["remainingItemCount"] = json!(all.len() - next);
    }
    let (kind, api_version) = shape.list_kind();
    // Written item by item without copying the objects (list items carry
    // no kind/apiVersion, as in real list responses).
    let mut body = format!("{{\"kind\":{},\"apiVersion\":{},\"metadata\":{},\"items\":[", json!(kind), json!(api_version), metadata);
    for (i, (k, o)) in page.iter().enumerate() {
        if i > 0 {
            body.push(',');
        }
        match s.items.get(*k).filter(|_| shape.is_stored() && at >= s.rv) {
            Some(item) => body.push_str(item),
            None if shape.meta_only => body.push_str(&present(shape, o, true).to_string()),
            None => body.push_str(&untyped_json(&present(shape, o, false))),
        }
    }
    body.push_str("]}");
    s.bytes.add_list(res, body.len());
    let mut r = Response::new(Full::new(Bytes::from(body)).boxed());
    r.headers_mut().insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static("application/json"));
    r
}

/// An object as JSON without `kind` and `apiVersion`, without cloning it.
fn untyped_json(obj: &Value) -> String {
    struct Untyped<'a>(&'a serde_json::Map<String, Value>);
    impl serde::Serialize for Untyped<'_> {
        fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            use serde::ser::SerializeMap;
            let mut m = s.serialize_map(None)?;
            for (k, v) in self.0.iter().filter(|(k, _)| k.as_str() != "kind" && k.as_str() != "apiVersion") {
                m.serialize_entry(k, v)?;
            }
            m.end()
        }
    }
    match obj.as_object() {
        Some(map) => serde_json::to_string(&Untyped(map)).unwrap_or_default(),
        None => obj.to_string(),
    }
}

fn too_large(kv: KubeVersion, rv: u64, current: u64) -> Response<Body> {
    let mut v = status(504, "Timeout", &format!("Too large resource version: {rv}, current: {current}"));
    // The cause came with 1.19's NewTooLargeResourceVersionError; before,
    // only the message told this timeout from others.
    v["details"] = if kv.minor >= 19 {
        json!({"causes": [{"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}], "retryAfterSeconds": 1})
    } else {
        json!({"retryAfterSeconds": 1})
    };
    let mut r = full(StatusCode::GATEWAY_TIMEOUT, &v);
    // The API server turns details.retryAfterSeconds into this header.
    r.headers_mut().insert(hyper::header::RETRY_AFTER, hyper::header::HeaderValue::from_static("1"));
    r
}

fn line(ty: &str, obj: Value) -> Bytes {
    let mut s = json!({"type": ty, "object": obj}).to_string();
    s.push('\n');
    Bytes::from(s)
}

/// The watch event a change becomes for a watcher with `filter`, if any
/// (the watch cache's rules for objects entering or leaving a selector).
fn event_for(c: &Change, filter: &Filter, shape: Shape) -> Option<Bytes> {
    let new_ok = filter.matches(&c.obj);
    let old_ok = c.old.as_ref().is_some_and(|o| filter.matches(o));
    let show = |o: &Value| present(shape, o, true);
    match c.ty {
        ChangeType::Added if new_ok => Some(line("ADDED", show(&c.obj))),
        ChangeType::Modified if new_ok && old_ok => Some(line("MODIFIED", show(&c.obj))),
        ChangeType::Modified if new_ok => Some(line("ADDED", show(&c.obj))),
        ChangeType::Modified if old_ok => {
            let mut gone = c.old.clone().unwrap_or_default();
            gone["metadata"]["resourceVersion"] = json!(c.rv.to_string());
            Some(line("DELETED", show(&gone)))
        }
        ChangeType::Deleted if old_ok => Some(line("DELETED", show(&c.obj))),
        _ => None,
    }
}

fn expired_line(rv: &str, oldest: u64) -> Bytes {
    line("ERROR", status(410, "Expired", &format!("too old resource version: {rv} ({oldest})")))
}

fn watch(st: Arc<Mutex<State>>, shape: Shape, filter: Filter, q: &BTreeMap<String, String>) -> Response<Body> {
    let res = shape.res;
    let mut bookmarks = q.get("allowWatchBookmarks").is_some_and(|v| v == "true");
    let mut timeout = Duration::from_secs(q.get("timeoutSeconds").and_then(|t| t.parse().ok()).unwrap_or(1800));
    let rv_param = q.get("resourceVersion").cloned().unwrap_or_default();
    let (out_tx, mut out_rx) = mpsc::channel::<Bytes>(1024);
    let (mut rx, first, mut last, interval, counter) = {
        let s = lock(&st);
        let mut first: Vec<Bytes> = Vec::new();
        match rv_param.as_str() {
            "" | "0" => {
                // "Get state and start at most recent": synthetic ADDED events.
                for o in s.objects.iter().filter(|(k, _)| k.0 == res).map(|(_, o)| o).filter(|o| filter.matches(o)) {
                    first.push(line("ADDED", present(shape, o, true)));
                }
            }
            v => {
                let Ok(n) = v.parse::<u64>() else {
                    return error(400, "BadRequest", &format!("invalid resource version {v:?}"));
                };
                if n < s.compacted {
                    first.push(expired_line(v, s.compacted));
                    let counter = s.bytes.clone();
                    let body = futures::stream::iter(first.into_iter().map(move |b| {
                        counter.add_watch(res, b.len());
                        Ok::<_, Infallible>(Frame::data(b))
                    }));
                    return stream_response(StreamBody::new(body).boxed());
                }
                if n > s.rv {
                    return too_large(s.version, n, s.rv);
                }
                for c in s.history.iter().filter(|c| c.rv > n && c.res == res) {
                    first.extend(event_for(c, &filter, shape));
                }
            }
        }
        if let Some(c) = s.watch_cutoff {
            timeout = timeout.min(c);
        }
        bookmarks &= s.bookmarks_served;
        (s.tx.subscribe(), first, s.rv, s.bookmark_interval, s.bytes.clone())
    };
    tokio::spawn(async move {
        for b in first {
            if out_tx.send(b).await.is_err() {
                return;
            }
        }
        let end = tokio::time::Instant::now() + timeout;
        let mut tick = tokio::time::interval(interval);
        tick.tick().await;
        loop {
            let msg = tokio::select! {
                m = rx.recv() => m,
                _ = tick.tick(), if bookmarks => {
                    // Take what is queued first so the bookmark never claims
                    // a version whose changes this watcher has not seen.
                    loop {
                        match rx.try_recv() {
                            Ok(Msg::Change(c)) => {
                                last = last.max(c.rv);
                                if c.res == res && let Some(b) = event_for(&c, &filter, shape) && out_tx.send(b).await.is_err() {
                                    return;
                                }
                            }
                            Ok(Msg::Expire) => {
                                let _ = out_tx.send(expired_line(&last.to_string(), last + 1)).await;
                                return;
                            }
                            Err(broadcast::error::TryRecvError::Empty) => break,
                            Err(_) => return,
                        }
                    }
                    let (kind, api_version) = shape.kind();
                    let bm = json!({"kind": kind, "apiVersion": api_version, "metadata": {"resourceVersion": last.to_string()}});
                    if out_tx.send(line("BOOKMARK", bm)).await.is_err() {
                        return;
                    }
                    BOOKMARKS.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                () = tokio::time::sleep_until(end) => return,
                () = out_tx.closed() => return,
            };
            match msg {
                Ok(Msg::Change(c)) => {
                    last = last.max(c.rv);
                    if c.res == res
                        && let Some(b) = event_for(&c, &filter, shape)
                        && out_tx.send(b).await.is_err()
                    {
                        return;
                    }
                }
                Ok(Msg::Expire) => {
                    let _ = out_tx.send(expired_line(&last.to_string(), last + 1)).await;
                    return;
                }
                // Lagged: this watcher cannot keep up; the API server
                // closes such watches and the client resumes from its
                // last version.
                Err(_) => return,
            }
        }
    });
    let body = futures::stream::poll_fn(move |cx| {
        out_rx.poll_recv(cx).map(|o| {
            o.map(|b| {
                counter.add_watch(res, b.len());
                Ok::<_, Infallible>(Frame::data(b))
            })
        })
    });
    stream_response(StreamBody::new(body).boxed())
}

fn stream_response(body: Body) -> Response<Body> {
    let mut r = Response::new(body);
    r.headers_mut().insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static("application/json"));
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One HTTP/1.0 request (no chunked framing: the body is the bytes
    /// after the headers); the body read until the server closes or `wait`.
    fn get(addr: SocketAddr, path: &str, accept: &str, wait: Duration) -> String {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(addr).expect("connect");
        s.set_read_timeout(Some(wait)).expect("timeout");
        write!(s, "GET {path} HTTP/1.0\r\nAccept: {accept}\r\n\r\n").expect("send");
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        let end = Instant::now() + wait;
        while let Ok(n) = s.read(&mut chunk) {
            if n == 0 || Instant::now() > end {
                break;
            }
            buf.extend_from_slice(&chunk[..n]);
        }
        let text = String::from_utf8_lossy(&buf).into_owned();
        text.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default()
    }

    #[test]
    fn bytes_sent_counts_list_and_watch_bodies_per_collection() {
        let node = |n: &str, beat: &str| json!({"kind": "Node", "apiVersion": "v1", "metadata": {"name": n}, "status": {"beat": beat}});
        let api = ApiServer::start_on("127.0.0.1:0".parse().expect("addr"), 10, vec![node("a", "0"), node("b", "0")]);
        api.set_bookmark_interval(Duration::from_hours(1));
        let a = api.addr();
        let short = Duration::from_millis(300);
        let body = get(a, "/api/v1/nodes", "application/json", short);
        assert!(body.starts_with("{\"kind\":\"NodeList\""), "{body}");
        assert_eq!(api.list_bytes_sent("nodes"), body.len() as u64);
        assert_eq!((api.watch_bytes_sent("nodes"), api.bytes_sent("services"), api.bytes_sent("endpointslices")), (0, 0, 0));
        let meta = get(
            a,
            "/api/v1/nodes?fieldSelector=metadata.name%3Da",
            "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1",
            short,
        );
        assert_eq!(api.list_bytes_sent("nodes"), (body.len() + meta.len()) as u64);

        api.reset_bytes_sent();
        assert_eq!(api.bytes_sent("nodes"), 0);
        // A watch from the list's version: the changes to "a" only.
        let watcher = std::thread::spawn(move || {
            get(
                a,
                "/api/v1/nodes?watch=true&resourceVersion=12&fieldSelector=metadata.name%3Da",
                "application/json",
                Duration::from_millis(600),
            )
        });
        std::thread::sleep(Duration::from_millis(150));
        api.apply(node("a", "1"));
        api.apply(node("b", "1"));
        let streamed = watcher.join().expect("watcher");
        assert_eq!(streamed.lines().count(), 1, "{streamed}");
        assert_eq!(api.watch_bytes_sent("nodes"), streamed.len() as u64);
        assert_eq!(api.list_bytes_sent("nodes"), 0);
    }
}
