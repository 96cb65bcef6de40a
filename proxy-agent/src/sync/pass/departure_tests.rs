//! The departures a pass reports: which backends that left a frontend's
//! set have their connections ended, by protocol, and when (the
//! `decide::departures` rules as the pass drives them), with the maps in
//! memory.

use super::*;
use crate::decide::departures::{GONE_SETTLE, Reason};
use crate::model::Protocol;
use std::time::Duration;

/// A Service of `protocol` on node `a` with the given endpoints, each
/// `(address, conditions, node, slice)`; `annotations` for topology.
fn cluster(protocol: Protocol, endpoints: &[(&str, &str, &str, &str)], annotations: &str) -> Cluster {
    let proto = if protocol == Protocol::Tcp { "TCP" } else { "UDP" };
    let mut slices: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    slices.entry("dns-1").or_default();
    for (ip, cond, node, slice) in endpoints {
        slices.entry(slice).or_default().push(format!("{{addresses: [{ip}], nodeName: {node}, conditions: {{{cond}}}}}"));
    }
    let mut yaml = format!(
        "kind: Node\nmetadata: {{name: a, labels: {{topology.kubernetes.io/zone: z1}}}}\n---\nkind: Node\nmetadata: {{name: b, labels: {{topology.kubernetes.io/zone: z2}}}}\n---\napiVersion: v1\nkind: Service\nmetadata: {{name: dns, annotations: {{{annotations}}}}}\nspec: {{clusterIP: 10.96.0.10, ports: [{{port: 53, protocol: {proto}}}]}}\n"
    );
    for (name, eps) in slices {
        yaml.push_str(&format!(
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}, labels: {{kubernetes.io/service-name: dns}}}}\naddressType: IPv4\nports: [{{port: 53, protocol: {proto}}}]\nendpoints: [{}]\n",
            eps.join(", ")
        ));
    }
    let (c, e) = crate::source::manifest_watch::cluster_from_text(&yaml);
    assert!(e.is_empty(), "{e:?}");
    c
}

const READY: &str = "ready: true";
const DRAINING: &str = "ready: false, serving: true, terminating: true";
const NOT_READY: &str = "ready: false";
const GONE_FROM_SERVING: &str = "ready: false, serving: false, terminating: true";
/// The step that starts a new agent over the same maps.
const RESTART: &str = "the agent restarts while it drains";

/// Runs a step as the sync loop does: a pass at `now`, then the pass
/// the outcome asks for (`recheck_at`) if any, with no change.
fn run_step(pass: &mut CachedSync, maps: &mut MemoryMaps, cluster: &Cluster, now: Instant) -> Vec<Departure> {
    let all = Changes { all: true, ..Changes::default() };
    let outcome = pass.pass_at(maps, None, cluster, &all, false, now);
    assert!(outcome.tc_departures.is_empty(), "no TC datapath here");
    let mut out = outcome.departures;
    if let Some(at) = outcome.recheck_at {
        assert!(at > now && at <= now + GONE_SETTLE, "a recheck within the settle time");
        let again = pass.pass_at(maps, None, cluster, &Changes::default(), false, at);
        assert_eq!(again.recheck_at, None, "settled");
        out.extend(again.departures);
    }
    out
}

/// Each step's endpoints and the departures the passes report, for a
/// UDP and for a TCP Service: UDP ends on gone, not serving and
/// topology; TCP only once gone after terminating.
#[test]
fn a_pass_reports_the_backends_whose_connections_end_by_protocol() {
    use Reason::{Deleted, GoneAfterTerminating as Gone, NotServing, Topology};
    let zone_first = "topoproxy.io/topology-keys: \"topology.kubernetes.io/zone, *\"";
    // (step, endpoints (address, conditions, node), annotations, UDP departures, TCP departures)
    type Step<'a> = (&'a str, Vec<(&'a str, &'a str, &'a str)>, &'a str, Vec<(&'a str, Reason)>, Vec<(&'a str, Reason)>);
    let steps: Vec<Step> = vec![
        ("first sync", vec![("10.244.0.1", READY, "a"), ("10.244.0.2", READY, "b"), ("10.244.0.3", READY, "b")], "", vec![], vec![]),
        (
            "one deleted, never seen terminating",
            vec![("10.244.0.1", READY, "a"), ("10.244.0.3", READY, "b")],
            "",
            vec![("10.244.0.2", Deleted)],
            vec![],
        ),
        ("one draining keeps its connections", vec![("10.244.0.1", READY, "a"), ("10.244.0.3", DRAINING, "b")], "", vec![], vec![]),
        ("still draining", vec![("10.244.0.1", READY, "a"), ("10.244.0.3", DRAINING, "b")], "", vec![], vec![]),
        (
            "the drained one stops serving: UDP goes",
            vec![("10.244.0.1", READY, "a"), ("10.244.0.3", GONE_FROM_SERVING, "b")],
            "",
            vec![("10.244.0.3", NotServing)],
            vec![],
        ),
        ("then it goes away: TCP goes", vec![("10.244.0.1", READY, "a")], "", vec![], vec![("10.244.0.3", Gone)]),
        ("a new one", vec![("10.244.0.1", READY, "a"), ("10.244.0.6", READY, "b")], "", vec![], vec![]),
        ("it drains", vec![("10.244.0.1", READY, "a"), ("10.244.0.6", DRAINING, "b")], "", vec![], vec![]),
        ("and is deleted while draining", vec![("10.244.0.1", READY, "a")], "", vec![("10.244.0.6", Deleted)], vec![("10.244.0.6", Gone)]),
        ("a new one", vec![("10.244.0.1", READY, "a"), ("10.244.0.4", READY, "b")], "", vec![], vec![]),
        (
            "one fails readiness: TCP stays",
            vec![("10.244.0.1", READY, "a"), ("10.244.0.4", NOT_READY, "b")],
            "",
            vec![("10.244.0.4", NotServing)],
            vec![],
        ),
        ("back", vec![("10.244.0.1", READY, "a"), ("10.244.0.4", READY, "b")], "", vec![], vec![]),
        (
            "topology: this zone first, the other zone's endpoint leaves; TCP stays",
            vec![("10.244.0.1", READY, "a"), ("10.244.0.4", READY, "b")],
            zone_first,
            vec![("10.244.0.4", Topology)],
            vec![],
        ),
        ("topology off again", vec![("10.244.0.1", READY, "a"), ("10.244.0.4", READY, "b")], "", vec![], vec![]),
        ("the last serving endpoint goes: nothing to reconnect to", vec![("10.244.0.4", NOT_READY, "b")], "", vec![], vec![]),
        ("served again", vec![("10.244.0.5", READY, "b")], "", vec![], vec![]),
        (
            "two new ones replace it",
            vec![("10.244.0.1", READY, "a"), ("10.244.0.7", READY, "b")],
            "",
            vec![("10.244.0.5", Deleted)],
            vec![],
        ),
        ("it drains", vec![("10.244.0.1", READY, "a"), ("10.244.0.7", DRAINING, "b")], "", vec![], vec![]),
        (RESTART, vec![("10.244.0.1", READY, "a"), ("10.244.0.7", DRAINING, "b")], "", vec![], vec![]),
        (
            "it stops serving: the new agent ends its UDP sockets",
            vec![("10.244.0.1", READY, "a"), ("10.244.0.7", GONE_FROM_SERVING, "b")],
            "",
            vec![("10.244.0.7", NotServing)],
            vec![],
        ),
        (
            "it goes, another comes: the new agent ends its TCP",
            vec![("10.244.0.1", READY, "a"), ("10.244.0.8", READY, "b")],
            "",
            vec![],
            vec![("10.244.0.7", Gone)],
        ),
        ("it drains", vec![("10.244.0.1", READY, "a"), ("10.244.0.8", DRAINING, "b")], "", vec![], vec![]),
        (RESTART, vec![("10.244.0.1", READY, "a"), ("10.244.0.8", DRAINING, "b")], "", vec![], vec![]),
        (
            "it is deleted: the new agent ends both",
            vec![("10.244.0.1", READY, "a")],
            "",
            vec![("10.244.0.8", Deleted)],
            vec![("10.244.0.8", Gone)],
        ),
    ];
    for (protocol, tcp) in
        [(Protocol::Udp, TcpTermination::Gone), (Protocol::Tcp, TcpTermination::Gone), (Protocol::Tcp, TcpTermination::Never)]
    {
        let fe = Frontend { ip: "10.96.0.10".parse().unwrap(), port: 53, protocol };
        let mut pass = CachedSync::new("a").with_tcp_termination(tcp);
        let mut maps = MemoryMaps::default();
        let mut now = Instant::now();
        for (name, endpoints, annotations, udp_want, tcp_want) in &steps {
            if *name == RESTART {
                // What it remembered is gone; the pinned maps stay.
                pass = CachedSync::new("a").with_tcp_termination(tcp);
            }
            let endpoints: Vec<(&str, &str, &str, &str)> = endpoints.iter().map(|(ip, c, n)| (*ip, *c, *n, "dns-1")).collect();
            now += Duration::from_secs(1);
            let got = run_step(&mut pass, &mut maps, &cluster(protocol, &endpoints, annotations), now);
            let got: Vec<(String, Reason)> = got.iter().map(|d| (d.backend.ip.to_string(), d.reason)).collect();
            let want = match (protocol, tcp) {
                (Protocol::Udp, _) => udp_want.clone(),
                (Protocol::Tcp, TcpTermination::Gone) => tcp_want.clone(),
                (Protocol::Tcp, TcpTermination::Never) => vec![],
            };
            let want: Vec<(String, Reason)> = want.into_iter().map(|(ip, r)| (ip.to_string(), r)).collect();
            assert_eq!(got, want, "{protocol} --terminate-tcp={}: {name}", tcp.label());
            assert!(maps.backends_of(&fe).is_some(), "{name}");
        }
    }
}

/// The EndpointSlice controller moves an endpoint between slices as two
/// updates, in either order: nothing ends, for either protocol, even
/// when the loss arrives first and a pass runs between the two.
#[test]
fn an_endpoint_moving_between_slices_ends_nothing() {
    let a = ("10.244.0.1", READY, "a", "dns-1");
    let moving = |slice| ("10.244.0.2", READY, "b", slice);
    // (name, steps of endpoints, each a pass 100 ms after the last)
    type Endpoints<'a> = Vec<(&'a str, &'a str, &'a str, &'a str)>;
    let orders: [(&str, Vec<Endpoints>); 2] = [
        ("loss first", vec![vec![a, moving("dns-1")], vec![a], vec![a, moving("dns-2")]]),
        ("gain first", vec![vec![a, moving("dns-1")], vec![a, moving("dns-1"), moving("dns-2")], vec![a, moving("dns-2")]]),
    ];
    for protocol in [Protocol::Udp, Protocol::Tcp] {
        for (name, steps) in &orders {
            let mut pass = CachedSync::new("a");
            let mut maps = MemoryMaps::default();
            let all = Changes { all: true, ..Changes::default() };
            let t0 = Instant::now();
            let mut recheck = None;
            for (i, eps) in steps.iter().enumerate() {
                let at = t0 + Duration::from_millis(100) * u32::try_from(i).unwrap();
                let outcome = pass.pass_at(&mut maps, None, &cluster(protocol, eps, ""), &all, false, at);
                assert!(outcome.departures.is_empty(), "{protocol} {name}, pass {i}: {:?}", outcome.departures);
                recheck = recheck.or(outcome.recheck_at);
            }
            // The pass the loss asked for, after the gain: nothing.
            if let Some(at) = recheck {
                let outcome = pass.pass_at(&mut maps, None, &cluster(protocol, &steps[2], ""), &Changes::default(), false, at);
                assert!(outcome.departures.is_empty(), "{protocol} {name}, recheck: {:?}", outcome.departures);
            }
            assert_eq!(pass.watched(), (0, 0), "{protocol} {name}: nothing left to watch");
        }
    }
}
