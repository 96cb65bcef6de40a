//! The stand-in API server itself (`proxy_test_support::apiserver`): the
//! protocol details the agent tests rely on without observing them directly.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use proxy_test_support::apiserver::{ApiServer, KubeVersion, selector_matches};
use serde_json::{Value, json};

/// One HTTP/1.0 request; returns the status code and the body read
/// until the server closes or `wait` passes (watches stay open).
fn raw(addr: SocketAddr, path: &str, accept: &str, wait: Duration) -> (u16, String) {
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
    let code = text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (code, text.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default())
}

#[test]
fn apiserver_protocol() {
    let api = ApiServer::start(100);
    for n in ["a", "b", "c"] {
        api.apply(json!({"kind": "Node", "apiVersion": "v1", "metadata": {"name": n, "labels": {"l": n}}, "status": {"big": true}}));
    }
    let a = api.addr();
    let short = Duration::from_millis(300);
    let (code, body) = raw(a, "/api/v1/nodes?limit=2", "application/json", short);
    assert_eq!(code, 200, "{body}");
    let page: Value = serde_json::from_str(&body).expect("list JSON");
    assert_eq!(page["kind"], "NodeList");
    assert_eq!(page["metadata"]["resourceVersion"], "103");
    assert_eq!(page["items"].as_array().map(Vec::len), Some(2));
    assert!(page["items"][0].get("kind").is_none(), "list items carry no kind");
    let token = page["metadata"]["continue"].as_str().expect("continue").to_string();
    api.apply(json!({"kind": "Node", "metadata": {"name": "d"}}));
    let (_, body) = raw(a, &format!("/api/v1/nodes?limit=2&continue={token}"), "application/json", short);
    let rest: Value = serde_json::from_str(&body).expect("page 2");
    assert_eq!(rest["items"].as_array().map(Vec::len), Some(1), "page 2 is consistent with page 1's version: {rest}");

    let meta = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1";
    let (_, body) = raw(a, "/api/v1/nodes?labelSelector=l%20in%20%28a%2Cb%29", meta, short);
    let list: Value = serde_json::from_str(&body).expect("metadata list");
    assert_eq!(list["kind"], "PartialObjectMetadataList");
    assert_eq!(list["items"].as_array().map(Vec::len), Some(2));
    assert!(list["items"][0].get("status").is_none() && list["items"][0]["kind"] == "PartialObjectMetadata");

    // Watch from a version: the changes after it, then bookmarks.
    api.set_bookmark_interval(Duration::from_millis(50));
    let (code, body) = raw(a, "/api/v1/nodes?watch=true&allowWatchBookmarks=true&resourceVersion=102", "application/json", short);
    assert_eq!(code, 200);
    let types: Vec<String> = body
        .lines()
        .filter(|l| l.starts_with('{'))
        .filter_map(|l| serde_json::from_str::<Value>(l).ok()?["type"].as_str().map(str::to_string))
        .collect();
    assert_eq!(&types[..2], ["ADDED", "ADDED"], "{body}");
    assert!(types[2..].iter().all(|t| t == "BOOKMARK") && types.len() > 2, "{body}");

    // Too new: 504; compacted: 200 with an ERROR 410 event; an expired
    // continue token: 410.
    let (code, body) = raw(a, "/api/v1/nodes?watch=true&resourceVersion=999", "application/json", short);
    assert_eq!(code, 504, "{body}");
    assert!(body.contains("Too large resource version"));
    api.expire_watches();
    let (code, body) = raw(a, "/api/v1/nodes?watch=true&resourceVersion=101", "application/json", short);
    assert_eq!(code, 200);
    let ev: Value = serde_json::from_str(body.lines().find(|l| l.starts_with('{')).unwrap_or("{}")).expect("event");
    assert_eq!((ev["type"].as_str(), ev["object"]["code"].as_u64()), (Some("ERROR"), Some(410)), "{body}");
    let (code, _) = raw(a, &format!("/api/v1/nodes?limit=2&continue={token}"), "application/json", short);
    assert_eq!(code, 410);
}

#[test]
fn apiserver_selectors() {
    let obj = json!({"metadata": {"labels": {"a": "1", "service.kubernetes.io/headless": ""}}});
    let t = |s: &str| selector_matches(s, &obj).expect("parses");
    assert!(t("a") && t("a=1") && t("a==1") && t("b!=2") && t("a in (1,2)") && t("b notin (1)") && t("!b"));
    assert!(!t("!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless"));
    assert!(!t("a notin (1)") && !t("a!=1") && !t("b"));
}

/// One HTTP/1.0 POST of a JSON body; returns the status code and the body.
fn post(addr: SocketAddr, path: &str, body: &Value) -> (u16, String) {
    use std::io::{Read, Write};
    let body = body.to_string();
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
    write!(s, "POST {path} HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).expect("send");
    let mut text = String::new();
    let _ = s.read_to_string(&mut text);
    let code = text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (code, text.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default())
}

fn json_of(body: &str) -> Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"))
}

/// What each release serves, and the shape of its answers for what it
/// does not.
#[test]
fn apiserver_releases_serve_their_versions() {
    let short = Duration::from_millis(300);
    let at = |kv: KubeVersion| ApiServer::start_as(kv, "127.0.0.1:0".parse().expect("address"), 1, Vec::new());
    let versions = |doc: &Value, group: &str| -> Vec<String> {
        doc["groups"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|g| g["name"] == group)
            .flat_map(|g| g["versions"].as_array().into_iter().flatten().filter_map(|v| v["version"].as_str().map(str::to_string)))
            .collect()
    };
    for (kv, slices, events) in [
        (KubeVersion::V1_18, vec!["v1beta1"], vec!["v1beta1"]),
        (KubeVersion::V1_21, vec!["v1", "v1beta1"], vec!["v1", "v1beta1"]),
        (KubeVersion::CURRENT, vec!["v1"], vec!["v1"]),
    ] {
        let api = at(kv);
        let a = api.addr();
        let (code, body) = raw(a, "/apis", "application/json", short);
        assert_eq!(code, 200, "{body}");
        let doc = json_of(&body);
        assert_eq!(doc["kind"], "APIGroupList");
        assert_eq!(versions(&doc, "discovery.k8s.io"), slices, "1.{}", kv.minor);
        assert_eq!(versions(&doc, "events.k8s.io"), events, "1.{}", kv.minor);
        let (_, body) = raw(a, "/apis/discovery.k8s.io", "application/json", short);
        assert_eq!(json_of(&body)["preferredVersion"]["version"], slices[0]);
        let (_, body) = raw(a, &format!("/apis/discovery.k8s.io/{}", slices[0]), "application/json", short);
        assert_eq!(json_of(&body)["resources"][0]["name"], "endpointslices");
        let (_, body) = raw(a, "/version", "application/json", short);
        assert_eq!(json_of(&body)["minor"], kv.minor.to_string());
        for v in &slices {
            let (code, body) = raw(a, &format!("/apis/discovery.k8s.io/{v}/endpointslices"), "application/json", short);
            assert_eq!((code, json_of(&body)["apiVersion"].as_str()), (200, Some(format!("discovery.k8s.io/{v}").as_str())));
        }
    }

    // Not served: plain text before 1.24, a Status after.
    let old = at(KubeVersion::V1_18);
    let (code, body) = raw(old.addr(), "/apis/discovery.k8s.io/v1/endpointslices", "application/json", short);
    assert_eq!((code, body.trim()), (404, "404 page not found"));
    let (code, _) = raw(old.addr(), "/apis/events.k8s.io/v1", "application/json", short);
    assert_eq!(code, 404);
    let new = at(KubeVersion::CURRENT);
    let (code, body) = raw(new.addr(), "/apis/discovery.k8s.io/v1beta1/endpointslices", "application/json", short);
    assert_eq!((code, json_of(&body)["reason"].as_str()), (404, Some("NotFound")));

    // Too large resource version: 1.18 says it in the message only.
    let (code, body) = raw(old.addr(), "/api/v1/nodes?watch=true&resourceVersion=999", "application/json", short);
    assert_eq!(code, 504);
    let status = json_of(&body);
    assert!(
        status["message"].as_str().is_some_and(|m| m.contains("Too large resource version")) && status["details"].get("causes").is_none()
    );
    let (_, body) = raw(new.addr(), "/api/v1/nodes?watch=true&resourceVersion=999", "application/json", short);
    assert_eq!(json_of(&body)["details"]["causes"][0]["reason"], "ResourceVersionTooLarge");

    // Events in the path's version, and only there.
    let event = |api_version: &str| {
        json!({"apiVersion": api_version, "kind": "Event", "metadata": {"name": "e1"}, "eventTime": "2024-05-01T10:00:00.000000Z",
               "reportingController": "t", "reportingInstance": "t-1", "action": "Skipped", "reason": "R", "type": "Warning"})
    };
    let (code, body) = post(old.addr(), "/apis/events.k8s.io/v1beta1/namespaces/default/events", &event("events.k8s.io/v1beta1"));
    assert_eq!(code, 201, "{body}");
    let (code, body) = post(old.addr(), "/apis/events.k8s.io/v1beta1/namespaces/default/events", &event("events.k8s.io/v1"));
    assert_eq!(code, 400, "the data's version must be the path's: {body}");
    let (code, _) = post(old.addr(), "/apis/events.k8s.io/v1/namespaces/default/events", &event("events.k8s.io/v1"));
    assert_eq!(code, 404);
    assert_eq!(old.events().iter().map(|e| e["apiVersion"].clone()).collect::<Vec<_>>(), [json!("events.k8s.io/v1beta1")]);
}

/// Objects keep what their release has, and EndpointSlices are converted
/// between versions as the API server converts them.
#[test]
fn apiserver_objects_follow_their_release() {
    let short = Duration::from_millis(300);
    let svc = json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": "default"},
                     "spec": {"clusterIP": "10.96.0.10", "topologyKeys": ["*"], "trafficDistribution": "PreferClose", "internalTrafficPolicy": "Local"}});
    let beta_slice = json!({
        "apiVersion": "discovery.k8s.io/v1beta1", "kind": "EndpointSlice",
        "metadata": {"name": "web-1", "namespace": "default", "labels": {"kubernetes.io/service-name": "web"}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": ["10.244.0.1"], "conditions": {"ready": true, "serving": true},
                       "topology": {"kubernetes.io/hostname": "n1", "topology.kubernetes.io/zone": "z1", "topology.kubernetes.io/region": "r1"}}],
    });
    let spec_of = |api: &ApiServer| -> Value {
        let (_, body) = raw(api.addr(), "/api/v1/services", "application/json", short);
        json_of(&body)["items"][0]["spec"].clone()
    };

    let old = ApiServer::start_as(KubeVersion::V1_18, "127.0.0.1:0".parse().expect("address"), 1, vec![svc.clone(), beta_slice.clone()]);
    let spec = spec_of(&old);
    assert!(
        spec.get("topologyKeys").is_some() && spec.get("trafficDistribution").is_none() && spec.get("internalTrafficPolicy").is_none(),
        "{spec}"
    );
    let (_, body) = raw(old.addr(), "/apis/discovery.k8s.io/v1beta1/endpointslices", "application/json", short);
    let ep = json_of(&body)["items"][0]["endpoints"][0].clone();
    assert_eq!(ep["topology"], beta_slice["endpoints"][0]["topology"], "round trip: {ep}");
    assert_eq!(ep["conditions"], json!({"ready": true}), "1.18 has no serving condition: {ep}");
    assert!(ep.get("nodeName").is_none() && ep.get("zone").is_none(), "{ep}");

    let both = ApiServer::start_as(KubeVersion::V1_21, "127.0.0.1:0".parse().expect("address"), 1, vec![svc.clone(), beta_slice]);
    let (_, body) = raw(both.addr(), "/apis/discovery.k8s.io/v1/endpointslices", "application/json", short);
    let ep = json_of(&body)["items"][0]["endpoints"][0].clone();
    assert_eq!(ep["zone"], "z1", "{ep}");
    assert_eq!(ep["deprecatedTopology"], json!({"kubernetes.io/hostname": "n1", "topology.kubernetes.io/region": "r1"}), "{ep}");
    // Watches convert too.
    let (_, body) = raw(both.addr(), "/apis/discovery.k8s.io/v1beta1/endpointslices?watch=true", "application/json", short);
    let added = json_of(body.lines().find(|l| l.starts_with('{')).unwrap_or("{}"));
    assert_eq!(added["object"]["apiVersion"], "discovery.k8s.io/v1beta1");
    assert_eq!(added["object"]["endpoints"][0]["topology"]["topology.kubernetes.io/zone"], "z1");

    let new = ApiServer::start_as(KubeVersion::CURRENT, "127.0.0.1:0".parse().expect("address"), 1, vec![svc]);
    let spec = spec_of(&new);
    assert!(spec.get("topologyKeys").is_none() && spec["trafficDistribution"] == "PreferClose", "{spec}");

    // Without bookmarks, a watch carries only changes.
    old.set_bookmark_interval(Duration::from_millis(50));
    old.set_bookmarks_served(false);
    let (_, body) = raw(old.addr(), "/api/v1/services?watch=true&allowWatchBookmarks=true&resourceVersion=1", "application/json", short);
    assert!(body.contains("\"ADDED\"") && !body.contains("BOOKMARK"), "{body}");
}
