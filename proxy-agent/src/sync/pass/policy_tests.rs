//! The pass's policy handling: which changes of a Service's session
//! affinity make it rewrite a frontend, with the maps in memory.

use super::*;
use crate::model::Protocol;

fn cluster(affinity: &str) -> Cluster {
    let yaml = format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: web}}\nspec: {{clusterIP: 10.96.0.10, ports: [{{port: 80}}]{affinity}}}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: web-1, labels: {{kubernetes.io/service-name: web}}}}\naddressType: IPv4\nports: [{{port: 8080}}]\nendpoints: [{{addresses: [10.244.0.1], nodeName: a}}, {{addresses: [10.244.0.2], nodeName: b}}]\n"
    );
    let (c, e) = crate::source::manifest_watch::cluster_from_text(&yaml);
    assert!(e.is_empty(), "{e:?}");
    c
}

/// The plan the pass hands the writer for affinity: a change of
/// affinity alone rewrites the frontend (with its unchanged backends),
/// and nothing else does.
#[test]
fn affinity_changes_rewrite_the_frontend_and_nothing_else_does() {
    let fe = Frontend { ip: "10.96.0.10".parse().unwrap(), port: 80, protocol: Protocol::Tcp };
    let web = Changes { services: [ObjectRef::new("default", "web")].into(), ..Changes::default() };
    let mut pass = CachedSync::new("a");
    let mut maps = MemoryMaps::default();
    // (step, affinity fields, full pass, writes, timeout programmed)
    let steps = [
        ("first sync", ", sessionAffinity: ClientIP, sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}", true, 1, Some(60)),
        ("unchanged", ", sessionAffinity: ClientIP, sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}", false, 0, Some(60)),
        ("unchanged, full pass", ", sessionAffinity: ClientIP, sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}", true, 0, Some(60)),
        ("shorter timeout", ", sessionAffinity: ClientIP, sessionAffinityConfig: {clientIP: {timeoutSeconds: 2}}", false, 1, Some(2)),
        ("affinity dropped", "", false, 1, None),
        ("no affinity, full pass", "", true, 0, None),
        ("affinity back, full pass", ", sessionAffinity: ClientIP", true, 1, Some(10_800)),
    ];
    for (i, (name, fields, full, writes, timeout)) in steps.into_iter().enumerate() {
        let changes = if i == 0 { Changes { all: true, ..Changes::default() } } else { web.clone() };
        let outcome = pass.pass(&mut maps, None, &cluster(fields), &changes, full);
        assert_eq!(outcome.upserts, writes, "{name}");
        assert_eq!(maps.policy_of(&fe).and_then(|p| p.affinity_timeout_s), timeout, "{name}");
        assert_eq!(maps.backends_of(&fe).map(<[Backend]>::len), Some(2), "{name}: the backends stay");
    }
}
