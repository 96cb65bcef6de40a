//! The stand-in API server itself (`proxy_test_support::apiserver`): the
//! protocol details the agent tests rely on without observing them directly.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use proxy_test_support::apiserver::{ApiServer, selector_matches};
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
