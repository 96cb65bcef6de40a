//! Which backends left a frontend's set in a way that ends the connections
//! already made to them. Pure: the sync pass hands in the sets before and
//! after a write and how each departed backend's endpoint stands now; the
//! datapath terminates sockets (`datapath::sock_destroy`) and flushes
//! conntrack flows (`datapath::conntrack_gc::flush`) for what comes out.
//!
//! The rules follow Kubernetes' endpoint conditions
//! (discovery.k8s.io/v1 EndpointConditions) and kube-proxy:
//!
//! * An endpoint that is gone from its Service's EndpointSlices, or no
//!   longer `serving`, will not answer: connections to it end
//!   ([`Reason::Deleted`], [`Reason::NotServing`]). kube-proxy flushes the
//!   conntrack entries of such UDP endpoints (pkg/proxy/conntrack/cleanup.go,
//!   fed by `detectStaleConntrackEntries`: an endpoint removed, or gone from
//!   serving to not serving).
//! * A terminating endpoint that is still `serving` is draining
//!   gracefully: it keeps the connections it has (that is what graceful
//!   termination promises), it only gets no new ones while others serve.
//!   Its connections end once it stops serving or goes away
//!   ([`recheck_draining`]).
//! * A serving endpoint that this node's topology decision no longer picks
//!   while others remain in the set ([`Reason::Topology`]) still answers,
//!   but the Service says this node should use other endpoints now, and a
//!   socket-level load balancer would keep such a socket on it forever.
//! * A frontend left with no backend at all (no serving endpoint, or none
//!   this node may use) or removed outright keeps its established
//!   connections, as kube-proxy leaves established flows alone when a
//!   Service loses its last endpoint: there is nothing to reconnect to.

use std::collections::BTreeSet;
use std::fmt;

use crate::model::{Backend, EndpointSlice, Frontend, ObjectRef, Protocol, ServicePort};

/// How a backend's endpoint stands in its Service's EndpointSlices now.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum EndpointState {
    /// No endpoint of the Service has this address and port any more.
    Gone,
    /// Listed, but neither ready nor serving.
    NotServing,
    /// `terminating` and still `serving`: draining gracefully.
    TerminatingServing,
    /// Serving and not terminating.
    Serving,
    /// No Service claims the frontend: nothing says that the endpoint went
    /// away, so its connections stay.
    Unknown,
}

/// Why a departed backend's connections end.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Reason {
    Deleted,
    NotServing,
    Topology,
}

impl Reason {
    /// The metric label (`reason`).
    pub fn label(self) -> &'static str {
        match self {
            Reason::Deleted => "deleted",
            Reason::NotServing => "not_serving",
            Reason::Topology => "topology",
        }
    }

    /// Whether the backend is gone for good: deleted or not serving, as
    /// opposed to serving but no longer picked by this node's topology.
    pub fn gone_for_good(self) -> bool {
        matches!(self, Reason::Deleted | Reason::NotServing)
    }

    /// Whether the TC datapath's conntrack flows of `protocol` to such a
    /// backend are flushed. UDP always, as kube-proxy does: a UDP flow
    /// has no end, and would otherwise stay on the backend for as long as
    /// the client keeps sending. TCP only when the backend is gone for
    /// good, so that a retransmission picks a live backend instead of
    /// going into the void; a TCP flow to a backend that still serves is
    /// left to finish.
    pub fn flushes_flows(self, protocol: Protocol) -> bool {
        match protocol {
            Protocol::Udp => true,
            Protocol::Tcp => self.gone_for_good(),
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Reason::Deleted => "endpoint deleted",
            Reason::NotServing => "endpoint not serving",
            Reason::Topology => "no longer picked by this node's topology",
        })
    }
}

/// One backend whose connections through one frontend are to end.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Departure {
    pub frontend: Frontend,
    pub backend: Backend,
    /// The Service the frontend belongs to, for logs; `None` when no
    /// decision claims the frontend any more.
    pub service: Option<ObjectRef>,
    pub reason: Reason,
}

impl fmt::Display for Departure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.service {
            Some(s) => write!(f, "Service {s} {} backend {} ({})", self.frontend, self.backend, self.reason),
            None => write!(f, "{} backend {} ({})", self.frontend, self.backend, self.reason),
        }
    }
}

/// The backends of `old` that are not in `new`, when `new` is not empty:
/// what a write of a frontend from `old` to `new` takes away from clients
/// who could go elsewhere. `new` of `None` (the frontend is removed) or
/// empty gives nothing.
pub fn left(old: &[Backend], new: Option<&[Backend]>) -> Vec<Backend> {
    let Some(new) = new.filter(|n| !n.is_empty()) else { return Vec::new() };
    let new: BTreeSet<&Backend> = new.iter().collect();
    let mut out: Vec<Backend> = old.iter().filter(|b| !new.contains(b)).copied().collect();
    out.sort();
    out.dedup();
    out
}

/// Classifies the backends that [`left`] a frontend: those whose
/// connections are to end, with why. `state` says how each backend's
/// endpoint stands in the frontend's Service now, with the Service.
pub fn classify(
    frontend: Frontend,
    left: &[Backend],
    mut state: impl FnMut(&Frontend, &Backend) -> (Option<ObjectRef>, EndpointState),
) -> Vec<Departure> {
    let mut out = Vec::new();
    for b in left {
        let (service, st) = state(&frontend, b);
        let reason = match st {
            EndpointState::Gone => Reason::Deleted,
            EndpointState::NotServing => Reason::NotServing,
            EndpointState::TerminatingServing | EndpointState::Unknown => continue,
            EndpointState::Serving => Reason::Topology,
        };
        out.push(Departure { frontend, backend: *b, service, reason });
    }
    out
}

/// What to do about a backend that left a frontend while draining, seen
/// again in a later pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Draining {
    /// Still draining (or nothing to reconnect to yet): keep waiting.
    Wait,
    /// Its connections end now.
    End(Reason),
    /// Nothing more to do: it is back in the set, its frontend is gone, or
    /// no Service claims it.
    Forget,
}

/// A backend that left a frontend while draining, with its endpoint now in
/// `state`, the frontend's set now `current` (`None`: the frontend is
/// gone). The same rules as for a departure: a frontend without backends
/// keeps its connections.
pub fn recheck_draining(backend: &Backend, state: EndpointState, current: Option<&[Backend]>) -> Draining {
    let Some(current) = current else { return Draining::Forget };
    if current.contains(backend) {
        return Draining::Forget;
    }
    let reason = match state {
        EndpointState::TerminatingServing => return Draining::Wait,
        EndpointState::Unknown => return Draining::Forget,
        EndpointState::Gone => Reason::Deleted,
        EndpointState::NotServing => Reason::NotServing,
        EndpointState::Serving => Reason::Topology,
    };
    if current.is_empty() { Draining::Wait } else { Draining::End(reason) }
}

/// The endpoints of one Service port (`port`: its name and protocol, as
/// EndpointSlice ports are matched to it) that are draining (terminating,
/// still serving, see [`endpoint_state`]) and of the family of `frontend`,
/// as backends with their target ports.
///
/// An agent that starts again has forgotten which backends left a
/// frontend while draining: the written sets no longer hold them. Each of
/// these outside a frontend's set is watched as if it had left while
/// draining. One that never was in the set costs only the watching: no
/// socket was sent to it through that frontend, so ending its connections
/// later finds none.
pub fn draining_endpoints(slices: &[&EndpointSlice], port: &ServicePort, frontend: &Frontend) -> Vec<Backend> {
    let mut out = Vec::new();
    for slice in slices {
        for p in slice.ports.iter().filter(|p| p.name == port.name && p.protocol == port.protocol) {
            for e in slice.endpoints.iter().filter(|e| e.serving && e.terminating && e.address.is_ipv4() == frontend.ip.is_ipv4()) {
                out.push(Backend { ip: e.address, port: p.port });
            }
        }
    }
    out.sort();
    out.dedup();
    // A duplicate in another slice that still serves wins.
    out.retain(|b| endpoint_state(slices.iter().copied(), b, port.protocol) == EndpointState::TerminatingServing);
    out
}

/// How the endpoint `backend` (address and target port, for `protocol`)
/// stands in a Service's EndpointSlices (`slices`). Several slices may
/// list the same address (a slice being replaced): the most available
/// state wins, so a duplicate never ends a connection to an endpoint that
/// still serves.
pub fn endpoint_state<'a>(slices: impl IntoIterator<Item = &'a EndpointSlice>, backend: &Backend, protocol: Protocol) -> EndpointState {
    let mut best = EndpointState::Gone;
    for slice in slices {
        if !slice.ports.iter().any(|p| p.port == backend.port && p.protocol == protocol) {
            continue;
        }
        for e in slice.endpoints.iter().filter(|e| e.address == backend.ip) {
            let st = if !e.serving {
                EndpointState::NotServing
            } else if e.terminating {
                EndpointState::TerminatingServing
            } else {
                EndpointState::Serving
            };
            best = best.max(st);
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    fn be(s: &str) -> Backend {
        let a: std::net::SocketAddr = s.parse().unwrap();
        Backend { ip: a.ip(), port: a.port() }
    }

    fn fe() -> Frontend {
        Frontend { ip: "10.96.0.10".parse().unwrap(), port: 53, protocol: Protocol::Udp }
    }

    #[test]
    fn left_is_what_a_non_empty_new_set_lacks() {
        let (a, b, c) = (be("10.244.0.1:53"), be("10.244.0.2:53"), be("10.244.0.3:53"));
        // (name, old, new, left)
        type Case = (&'static str, Vec<Backend>, Option<Vec<Backend>>, Vec<Backend>);
        let cases: Vec<Case> = vec![
            ("one of two removed", vec![a, b], Some(vec![b]), vec![a]),
            ("replaced", vec![a], Some(vec![c]), vec![a]),
            ("unchanged", vec![a, b], Some(vec![b, a]), vec![]),
            ("grown", vec![a], Some(vec![a, b]), vec![]),
            ("the last one removed: nothing to reconnect to", vec![a], Some(vec![]), vec![]),
            ("frontend removed", vec![a, b], None, vec![]),
            ("new frontend", vec![], Some(vec![a]), vec![]),
            ("duplicates in the old set count once", vec![a, a, b], Some(vec![b]), vec![a]),
        ];
        for (name, old, new, want) in cases {
            assert_eq!(left(&old, new.as_deref()), want, "{name}");
        }
    }

    #[test]
    fn a_draining_backend_goes_when_it_stops_serving() {
        let (b, other) = (be("10.244.0.1:53"), be("10.244.0.2:53"));
        // (name, state now, the frontend's set now, what happens)
        let cases: Vec<(&str, EndpointState, Option<Vec<Backend>>, Draining)> = vec![
            ("still draining", EndpointState::TerminatingServing, Some(vec![other]), Draining::Wait),
            ("stopped serving", EndpointState::NotServing, Some(vec![other]), Draining::End(Reason::NotServing)),
            ("deleted", EndpointState::Gone, Some(vec![other]), Draining::End(Reason::Deleted)),
            ("serving again but not picked", EndpointState::Serving, Some(vec![other]), Draining::End(Reason::Topology)),
            ("back in the set", EndpointState::Serving, Some(vec![b, other]), Draining::Forget),
            ("deleted with nothing else to go to", EndpointState::Gone, Some(vec![]), Draining::Wait),
            ("the frontend is gone", EndpointState::Gone, None, Draining::Forget),
            ("no Service claims it", EndpointState::Unknown, Some(vec![other]), Draining::Forget),
        ];
        for (name, state, current, want) in cases {
            assert_eq!(recheck_draining(&b, state, current.as_deref()), want, "{name}");
        }
    }

    #[test]
    fn departures_by_endpoint_state() {
        let svc = ObjectRef::new("default", "dns");
        let b = be("10.244.0.1:53");
        // (state, expected reason: None = keeps its connections)
        let cases = [
            (EndpointState::Gone, Some(Reason::Deleted)),
            (EndpointState::NotServing, Some(Reason::NotServing)),
            (EndpointState::TerminatingServing, None),
            (EndpointState::Serving, Some(Reason::Topology)),
            (EndpointState::Unknown, None),
        ];
        for (st, want) in cases {
            let got = classify(fe(), &[b], |_, _| (Some(svc.clone()), st));
            assert_eq!(got.first().map(|d| d.reason), want, "{st:?}");
            assert!(got.iter().all(|d| d.frontend == fe() && d.backend == b && d.service.as_ref() == Some(&svc)));
        }
        // (reason, UDP flows flushed, TCP flows flushed)
        let flows = [(Reason::Deleted, true, true), (Reason::NotServing, true, true), (Reason::Topology, true, false)];
        for (reason, udp, tcp) in flows {
            assert_eq!(reason.flushes_flows(Protocol::Udp), udp, "{reason:?}");
            assert_eq!(reason.flushes_flows(Protocol::Tcp), tcp, "{reason:?}");
            assert_eq!(reason.gone_for_good(), tcp, "{reason:?}");
        }
    }

    fn cluster(endpoints: &str) -> crate::model::Cluster {
        let yaml = format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: dns}}\nspec: {{clusterIP: 10.96.0.10, ports: [{{port: 53, protocol: UDP}}]}}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: dns-1, labels: {{kubernetes.io/service-name: dns}}}}\naddressType: IPv4\nports: [{{port: 53, protocol: UDP}}]\nendpoints: [{endpoints}]\n"
        );
        let (c, e) = crate::source::manifest_watch::cluster_from_text(&yaml);
        assert!(e.is_empty(), "{e:?}");
        c
    }

    #[test]
    fn draining_endpoints_are_the_ports_terminating_serving_endpoints_of_the_frontends_family() {
        let svc = ObjectRef::new("default", "dns");
        let port = |name: &str, protocol| ServicePort { name: name.into(), port: 53, protocol, node_port: None };
        let v6 = Frontend { ip: "fd00::10".parse().unwrap(), port: 53, protocol: Protocol::Udp };
        const DRAINING: &str = "conditions: {ready: false, serving: true, terminating: true}";
        // (endpoints, Service port, frontend, draining backends)
        let cases = [
            (format!("{{addresses: [10.244.0.1], {DRAINING}}}"), port("", Protocol::Udp), fe(), vec!["10.244.0.1:53"]),
            (
                format!("{{addresses: [10.244.0.2], {DRAINING}}}, {{addresses: [10.244.0.1], {DRAINING}}}, {{addresses: [10.244.0.3]}}"),
                port("", Protocol::Udp),
                fe(),
                vec!["10.244.0.1:53", "10.244.0.2:53"],
            ),
            ("{addresses: [10.244.0.1]}".to_string(), port("", Protocol::Udp), fe(), vec![]),
            (
                "{addresses: [10.244.0.1], conditions: {ready: false, serving: false, terminating: true}}".to_string(),
                port("", Protocol::Udp),
                fe(),
                vec![],
            ),
            // The slice's port is the unnamed UDP one.
            (format!("{{addresses: [10.244.0.1], {DRAINING}}}"), port("dns", Protocol::Udp), fe(), vec![]),
            (format!("{{addresses: [10.244.0.1], {DRAINING}}}"), port("", Protocol::Tcp), fe(), vec![]),
            // An IPv4 endpoint never served an IPv6 frontend.
            (format!("{{addresses: [10.244.0.1], {DRAINING}}}"), port("", Protocol::Udp), v6, vec![]),
            // Listed again as serving (a slice being replaced): not draining.
            (format!("{{addresses: [10.244.0.1], {DRAINING}}}, {{addresses: [10.244.0.1]}}"), port("", Protocol::Udp), fe(), vec![]),
        ];
        for (endpoints, port, frontend, want) in cases {
            let c = cluster(&endpoints);
            let slices: Vec<&EndpointSlice> = c.slices_of(&svc).collect();
            let want: Vec<Backend> = want.into_iter().map(be).collect();
            assert_eq!(draining_endpoints(&slices, &port, &frontend), want, "{endpoints} {port:?} {frontend}");
        }
    }

    #[test]
    fn endpoint_state_reads_the_conditions_of_the_services_slices() {
        let svc = ObjectRef::new("default", "dns");
        let b = be("10.244.0.1:53");
        // (endpoints, protocol, state)
        let cases = [
            ("{addresses: [10.244.0.1]}", Protocol::Udp, EndpointState::Serving),
            ("{addresses: [10.244.0.1], conditions: {ready: false}}", Protocol::Udp, EndpointState::NotServing),
            (
                "{addresses: [10.244.0.1], conditions: {ready: false, serving: true, terminating: true}}",
                Protocol::Udp,
                EndpointState::TerminatingServing,
            ),
            (
                "{addresses: [10.244.0.1], conditions: {ready: false, serving: false, terminating: true}}",
                Protocol::Udp,
                EndpointState::NotServing,
            ),
            ("{addresses: [10.244.0.2]}", Protocol::Udp, EndpointState::Gone),
            // The port is the slice's for UDP only.
            ("{addresses: [10.244.0.1]}", Protocol::Tcp, EndpointState::Gone),
            // Listed twice (a slice being replaced): the better state wins.
            ("{addresses: [10.244.0.1], conditions: {ready: false}}, {addresses: [10.244.0.1]}", Protocol::Udp, EndpointState::Serving),
        ];
        for (endpoints, proto, want) in cases {
            let c = cluster(endpoints);
            assert_eq!(endpoint_state(c.slices_of(&svc), &b, proto), want, "{endpoints} {proto}");
        }
        let c = cluster("{addresses: [10.244.0.1]}");
        assert_eq!(
            endpoint_state(c.slices_of(&ObjectRef::new("default", "other")), &b, Protocol::Udp),
            EndpointState::Gone,
            "another Service's slices say nothing"
        );
    }
}
