//! Which backends that left a frontend's set lose the connections already
//! made to them, and when. Pure: the sync pass hands in how each departed
//! backend's endpoint stands now and the frontend's set as written; the
//! datapath terminates sockets (`datapath::sock_destroy`) and flushes
//! conntrack flows (`datapath::conntrack_gc::flush`) for what comes out.
//!
//! The rules differ by protocol, as kube-proxy's and Cilium's do:
//!
//! * **TCP** is ended in one case only: the endpoint is gone from every
//!   EndpointSlice of its Service after it was seen `terminating`
//!   ([`Reason::GoneAfterTerminating`], `--terminate-tcp=gone`). On API
//!   servers that report terminating endpoints (discovery.k8s.io/v1,
//!   1.22+) that means the pod is gone: its connections are dead anyway,
//!   and ending them turns a hang into a fast error. Everything else
//!   leaves established TCP alone, because kube-proxy does
//!   (pkg/proxy/conntrack/cleanup.go flushes UDP only; established TCP
//!   flows keep their DNAT until they end) and because an endpoint that
//!   fails readiness, terminating or only overloaded for a moment, is a
//!   live process with live connections: a download, a gRPC stream or a
//!   database session from it completes. So: not serving, no longer
//!   picked by this node's topology, gone without ever being seen
//!   terminating (a selector change, a v1beta1 API server, a pod deleted
//!   before the agent saw it) and a Service left without endpoints all
//!   keep their TCP connections. `--terminate-tcp=never` ends none.
//! * **UDP** has no end of its own: a connected socket (or a TC flow)
//!   would stay on its backend as long as the client sends. It is ended
//!   when the endpoint is gone ([`Reason::Deleted`]) or no longer serving
//!   ([`Reason::NotServing`]), as kube-proxy flushes conntrack for such
//!   UDP endpoints (`detectStaleConntrackEntries`) and Cilium destroys
//!   UDP sockets of deleted backends (`TerminateUDPConnectionsToBackend`);
//!   and when this node's topology no longer picks it while others remain
//!   ([`Reason::Topology`]), since a socket-level load balancer would
//!   otherwise keep it there forever. A terminating endpoint that still
//!   serves is draining gracefully and keeps its sockets until it stops
//!   serving or goes.
//! * **Either protocol**: a frontend left with no backend at all (no
//!   serving endpoint, or none this node may use) or removed outright
//!   ends nothing (there is nothing to reconnect to); a backend that
//!   comes back into its set is forgotten.
//!
//! "Gone" is decided over the merged view of all the Service's slices,
//! and only after it has held for [`GONE_SETTLE`]: the EndpointSlice
//! controller moves endpoints between slices as two updates (a slice that
//! loses it, one that gains it), and when the loss arrives first the
//! endpoint is briefly in no slice. Nothing ends for an address and port
//! that the Service still has in another slice.
//!
//! Each departed backend is watched ([`Watch`]) from the pass that takes
//! it out of a frontend's set until one of the rules ends it or it is
//! forgotten; [`step`] decides one watched backend in one pass.

use std::collections::BTreeSet;
use std::fmt;
use std::time::{Duration, Instant};

use crate::model::{Backend, EndpointSlice, Frontend, ObjectRef, Protocol, ServicePort};

/// How long an endpoint must be missing from every slice of its Service
/// before it counts as gone: longer than the gap between the two slice
/// updates of a move (API writes issued back to back by one reconcile of
/// the EndpointSlice controller, pkg/controller/endpointslice/reconciler.go
/// `finalize`), short enough that a pod deleted after terminating still
/// loses its connections within a second.
pub const GONE_SETTLE: Duration = Duration::from_millis(250);

/// How a backend's endpoint stands in its Service's EndpointSlices now.
/// Ordered from least to most available (`Unknown` apart), so that the
/// best of several listings of one address is the maximum.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum EndpointState {
    /// No endpoint of the Service has this address and port any more.
    Gone,
    /// Listed, `terminating`, and no longer serving: the pod is shutting
    /// down and has stopped passing readiness.
    TerminatingNotServing,
    /// Listed, neither ready nor serving, not terminating: failing
    /// readiness, a live process all the same.
    NotServing,
    /// `terminating` and still `serving`: draining gracefully.
    TerminatingServing,
    /// Serving and not terminating.
    Serving,
    /// No Service claims the frontend: nothing says that the endpoint went
    /// away, so its connections stay.
    Unknown,
}

impl EndpointState {
    /// Whether the endpoint is marked `terminating` (discovery.k8s.io/v1
    /// EndpointConditions): its pod has a deletion timestamp.
    pub fn is_terminating(self) -> bool {
        matches!(self, EndpointState::TerminatingNotServing | EndpointState::TerminatingServing)
    }
}

/// What `--terminate-tcp` asks of TCP connections to departed backends.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TcpTermination {
    /// Ended once the endpoint is gone after it was seen terminating.
    #[default]
    Gone,
    /// Never ended by the agent.
    Never,
}

impl TcpTermination {
    /// The flag's value and the log's name.
    pub fn label(self) -> &'static str {
        match self {
            TcpTermination::Gone => "gone",
            TcpTermination::Never => "never",
        }
    }
}

/// Which rule ended a departed backend's connections.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Reason {
    /// UDP: the endpoint is gone from every slice of its Service.
    Deleted,
    /// UDP: the endpoint no longer serves (terminating or not).
    NotServing,
    /// UDP: the endpoint serves, but this node's topology no longer picks
    /// it while others remain.
    Topology,
    /// TCP: the endpoint is gone from every slice of its Service after it
    /// was seen terminating (`--terminate-tcp=gone`).
    GoneAfterTerminating,
}

impl Reason {
    /// Every reason, for parsing a label and for going through them all.
    pub const ALL: [Reason; 4] = [Reason::Deleted, Reason::NotServing, Reason::Topology, Reason::GoneAfterTerminating];

    /// The metric label (`reason`) and the log's and `dump`'s rule name.
    pub fn label(self) -> &'static str {
        match self {
            Reason::Deleted => "deleted",
            Reason::NotServing => "not_serving",
            Reason::Topology => "topology",
            Reason::GoneAfterTerminating => "gone_after_terminating",
        }
    }

    /// The reason of a label, for what `dump` reads back.
    pub fn from_label(label: &str) -> Option<Reason> {
        Reason::ALL.into_iter().find(|r| r.label() == label)
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Reason::Deleted => "udp rule: endpoint deleted",
            Reason::NotServing => "udp rule: endpoint not serving",
            Reason::Topology => "udp rule: no longer picked by this node's topology",
            Reason::GoneAfterTerminating => "tcp rule: endpoint gone after it was seen terminating",
        })
    }
}

/// One backend whose connections through one frontend are to end.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Departure {
    /// The frontend the connections went to.
    pub frontend: Frontend,
    /// The backend they were sent to.
    pub backend: Backend,
    /// The Service the frontend belongs to, for logs; `None` when no
    /// decision claims the frontend any more.
    pub service: Option<ObjectRef>,
    /// Why they end now.
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
/// empty gives nothing: a Service that loses its last endpoint keeps its
/// connections, as kube-proxy leaves established flows alone then.
pub fn left(old: &[Backend], new: Option<&[Backend]>) -> Vec<Backend> {
    let Some(new) = new.filter(|n| !n.is_empty()) else { return Vec::new() };
    let new: BTreeSet<&Backend> = new.iter().collect();
    let mut out: Vec<Backend> = old.iter().filter(|b| !new.contains(b)).copied().collect();
    out.sort();
    out.dedup();
    out
}

/// What is remembered of a backend that left a frontend's set.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Watch {
    /// Its endpoint was seen `terminating` since it left (or, after an
    /// agent restart, when the new agent first looked).
    pub seen_terminating: bool,
    /// The pass that first found it in no slice of its Service, while it
    /// has stayed so ([`GONE_SETTLE`]).
    pub gone_since: Option<Instant>,
}

/// What one pass does about a watched backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Keep watching.
    Watch {
        /// What to remember.
        watch: Watch,
        /// A pass is owed at that moment even if nothing changes (a gone
        /// endpoint settling).
        recheck_at: Option<Instant>,
    },
    /// Its connections end now, for this reason; it is not watched any more.
    End(Reason),
    /// Nothing more to do: back in the set, its frontend is gone, no
    /// Service claims it, or no rule of its protocol can end it any more.
    Forget,
}

/// One watched `backend` of a frontend of `protocol` in the pass at `now`:
/// its endpoint is now in `state`, the frontend's set as written is
/// `current` (`None`: the frontend is gone), and `watch` is what earlier
/// passes remembered.
pub fn step(
    protocol: Protocol,
    tcp: TcpTermination,
    backend: &Backend,
    watch: Watch,
    state: EndpointState,
    current: Option<&[Backend]>,
    now: Instant,
) -> Step {
    let Some(current) = current else { return Step::Forget };
    if current.contains(backend) || state == EndpointState::Unknown {
        return Step::Forget;
    }
    if protocol == Protocol::Tcp && tcp == TcpTermination::Never {
        return Step::Forget;
    }
    let mut watch = Watch { seen_terminating: watch.seen_terminating || state.is_terminating(), gone_since: watch.gone_since };
    if state == EndpointState::Gone {
        let since = *watch.gone_since.get_or_insert(now);
        let settled_at = since + GONE_SETTLE;
        if now < settled_at {
            return Step::Watch { watch, recheck_at: Some(settled_at) };
        }
    } else {
        watch.gone_since = None;
    }
    let reason = match (protocol, state) {
        (Protocol::Tcp, EndpointState::Gone) if watch.seen_terminating => Reason::GoneAfterTerminating,
        // Gone without ever being seen terminating: not necessarily dead
        // (a selector change, an old API server), so left alone.
        (Protocol::Tcp, EndpointState::Gone) => return Step::Forget,
        (Protocol::Tcp, _) => return Step::Watch { watch, recheck_at: None },
        (Protocol::Udp, EndpointState::Gone) => Reason::Deleted,
        (Protocol::Udp, EndpointState::NotServing | EndpointState::TerminatingNotServing) => Reason::NotServing,
        (Protocol::Udp, EndpointState::TerminatingServing) => return Step::Watch { watch, recheck_at: None },
        (Protocol::Udp, EndpointState::Serving) => Reason::Topology,
        (Protocol::Udp, EndpointState::Unknown) => return Step::Forget,
    };
    // Nothing to reconnect to yet: the connections stay until a backend
    // is back (kube-proxy leaves established flows alone when a Service
    // loses its last endpoint).
    if current.is_empty() { Step::Watch { watch, recheck_at: None } } else { Step::End(reason) }
}

/// The endpoints of one Service port (`port`: its name and protocol, as
/// EndpointSlice ports are matched to it) of the family of `frontend`, as
/// backends with their target ports, that an agent which starts again
/// must watch as if they had left the frontend's set: it has forgotten
/// which did (the written sets no longer hold them). For UDP the draining
/// ones (terminating, still serving; the others ended when they stopped
/// serving); for TCP every terminating one (the TCP rule ends them once
/// they are gone). One that never was in the set costs only the
/// watching: no socket was sent to it through that frontend.
pub fn restart_watch(slices: &[&EndpointSlice], port: &ServicePort, frontend: &Frontend) -> Vec<Backend> {
    let mut out = Vec::new();
    for slice in slices {
        for p in slice.ports.iter().filter(|p| p.name == port.name && p.protocol == port.protocol) {
            for e in slice.endpoints.iter().filter(|e| e.terminating && e.address.is_ipv4() == frontend.ip.is_ipv4()) {
                out.push(Backend { ip: e.address, port: p.port });
            }
        }
    }
    out.sort();
    out.dedup();
    // A duplicate in another slice that still serves wins.
    out.retain(|b| match endpoint_state(slices.iter().copied(), b, port.protocol) {
        EndpointState::TerminatingServing => true,
        EndpointState::TerminatingNotServing => port.protocol == Protocol::Tcp,
        _ => false,
    });
    out
}

/// How the endpoint `backend` (address and target port, for `protocol`)
/// stands in a Service's EndpointSlices (`slices`). Several slices may
/// list the same address (a slice being replaced, an endpoint moving):
/// the most available state wins, so a duplicate never ends a connection
/// to an endpoint that still serves.
pub fn endpoint_state<'a>(slices: impl IntoIterator<Item = &'a EndpointSlice>, backend: &Backend, protocol: Protocol) -> EndpointState {
    let mut best = EndpointState::Gone;
    for slice in slices {
        if !slice.ports.iter().any(|p| p.port == backend.port && p.protocol == protocol) {
            continue;
        }
        for e in slice.endpoints.iter().filter(|e| e.address == backend.ip) {
            let st = match (e.serving, e.terminating) {
                (false, true) => EndpointState::TerminatingNotServing,
                (false, false) => EndpointState::NotServing,
                (true, true) => EndpointState::TerminatingServing,
                (true, false) => EndpointState::Serving,
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

    /// The rules, one pass each: (name, protocol, --terminate-tcp, what
    /// was remembered, state now, the set now, what happens).
    #[test]
    fn each_protocol_ends_connections_by_its_own_rule() {
        use EndpointState as S;
        use Protocol::{Tcp, Udp};
        use TcpTermination::{Gone, Never};
        let b = be("10.244.0.1:80");
        let other = vec![be("10.244.0.2:80")];
        let earlier = Instant::now();
        let t0 = earlier + GONE_SETTLE;
        let settled = Watch { seen_terminating: false, gone_since: Some(earlier) };
        let settled_terminating = Watch { seen_terminating: true, ..settled };
        let terminating = Watch { seen_terminating: true, gone_since: None };
        let fresh = Watch::default();
        let watch = |w: Watch, recheck_at: Option<Instant>| Step::Watch { watch: w, recheck_at };
        type Case<'a> = (&'a str, Protocol, TcpTermination, Watch, EndpointState, Option<Vec<Backend>>, Step);
        let cases: Vec<Case> = vec![
            // TCP: only gone after terminating ends it.
            ("tcp not serving: a live process", Tcp, Gone, fresh, S::NotServing, Some(other.clone()), watch(fresh, None)),
            (
                "tcp terminating, not serving: remembered",
                Tcp,
                Gone,
                fresh,
                S::TerminatingNotServing,
                Some(other.clone()),
                watch(terminating, None),
            ),
            ("tcp draining: remembered", Tcp, Gone, fresh, S::TerminatingServing, Some(other.clone()), watch(terminating, None)),
            ("tcp topology: still serving", Tcp, Gone, fresh, S::Serving, Some(other.clone()), watch(fresh, None)),
            (
                "tcp gone: settles first",
                Tcp,
                Gone,
                terminating,
                S::Gone,
                Some(other.clone()),
                watch(Watch { seen_terminating: true, gone_since: Some(t0) }, Some(t0 + GONE_SETTLE)),
            ),
            (
                "tcp gone after terminating, settled",
                Tcp,
                Gone,
                settled_terminating,
                S::Gone,
                Some(other.clone()),
                Step::End(Reason::GoneAfterTerminating),
            ),
            ("tcp gone, never seen terminating", Tcp, Gone, settled, S::Gone, Some(other.clone()), Step::Forget),
            (
                "tcp gone after terminating, nothing to reconnect to",
                Tcp,
                Gone,
                settled_terminating,
                S::Gone,
                Some(vec![]),
                watch(settled_terminating, None),
            ),
            ("tcp --terminate-tcp=never", Tcp, Never, settled_terminating, S::Gone, Some(other.clone()), Step::Forget),
            (
                "tcp back in another slice: settling starts over",
                Tcp,
                Gone,
                settled_terminating,
                S::Serving,
                Some(other.clone()),
                watch(terminating, None),
            ),
            // UDP: as before, gone settling first.
            ("udp not serving", Udp, Gone, fresh, S::NotServing, Some(other.clone()), Step::End(Reason::NotServing)),
            (
                "udp terminating, not serving",
                Udp,
                Gone,
                fresh,
                S::TerminatingNotServing,
                Some(other.clone()),
                Step::End(Reason::NotServing),
            ),
            ("udp draining", Udp, Gone, fresh, S::TerminatingServing, Some(other.clone()), watch(terminating, None)),
            ("udp topology", Udp, Gone, fresh, S::Serving, Some(other.clone()), Step::End(Reason::Topology)),
            (
                "udp gone: settles first",
                Udp,
                Gone,
                fresh,
                S::Gone,
                Some(other.clone()),
                watch(Watch { seen_terminating: false, gone_since: Some(t0) }, Some(t0 + GONE_SETTLE)),
            ),
            ("udp gone, settled", Udp, Gone, settled, S::Gone, Some(other.clone()), Step::End(Reason::Deleted)),
            ("udp ignores --terminate-tcp", Udp, Never, settled, S::Gone, Some(other.clone()), Step::End(Reason::Deleted)),
            ("udp not serving, nothing to reconnect to", Udp, Gone, fresh, S::NotServing, Some(vec![]), watch(fresh, None)),
            // Either protocol.
            ("back in the set", Udp, Gone, fresh, S::Serving, Some(vec![b]), Step::Forget),
            ("back in the set, tcp", Tcp, Gone, terminating, S::TerminatingServing, Some(vec![b]), Step::Forget),
            ("the frontend is gone", Udp, Gone, settled, S::Gone, None, Step::Forget),
            ("no Service claims it", Tcp, Gone, terminating, S::Unknown, Some(other.clone()), Step::Forget),
        ];
        for (name, protocol, tcp, w, state, current, want) in cases {
            assert_eq!(step(protocol, tcp, &b, w, state, current.as_deref(), t0), want, "{name}");
        }
    }

    /// An endpoint in no slice for less than [`GONE_SETTLE`] (a move
    /// between slices whose loss arrived first) ends nothing; held past
    /// it, the protocol's rule applies.
    #[test]
    fn gone_is_decided_only_after_it_settles() {
        let b = be("10.244.0.1:53");
        let other = [be("10.244.0.2:53")];
        let t0 = Instant::now();
        let mut w = Watch::default();
        // (offset, state, what happens)
        let passes = [
            (Duration::ZERO, EndpointState::Gone, None),
            (Duration::from_millis(100), EndpointState::Gone, None),
            // The move's second update: listed again.
            (Duration::from_millis(150), EndpointState::Serving, None),
            (Duration::from_millis(300), EndpointState::Gone, None),
            (Duration::from_millis(299) + GONE_SETTLE, EndpointState::Gone, None),
            (Duration::from_millis(300) + GONE_SETTLE, EndpointState::Gone, Some(Reason::Deleted)),
        ];
        for (i, (offset, state, want)) in passes.into_iter().enumerate() {
            // UDP: "Serving" outside the set would be the topology rule; the
            // move's target slice lists it, so it is back in the set.
            let current: Vec<Backend> = if state == EndpointState::Serving { vec![b, other[0]] } else { other.to_vec() };
            match step(Protocol::Udp, TcpTermination::Gone, &b, w, state, Some(&current), t0 + offset) {
                Step::End(r) => assert_eq!(Some(r), want, "pass {i}"),
                Step::Watch { watch, recheck_at } => {
                    assert_eq!(want, None, "pass {i}");
                    assert_eq!(recheck_at, watch.gone_since.map(|s| s + GONE_SETTLE), "pass {i}");
                    w = watch;
                }
                Step::Forget => {
                    assert_eq!(want, None, "pass {i}");
                    w = Watch::default();
                }
            }
        }
    }

    #[test]
    fn reasons_have_labels_and_name_their_rule() {
        for r in Reason::ALL {
            assert_eq!(Reason::from_label(r.label()), Some(r));
            let rule = if r == Reason::GoneAfterTerminating { "tcp rule" } else { "udp rule" };
            assert!(r.to_string().starts_with(rule), "{r}");
        }
        assert_eq!(Reason::from_label("nope"), None);
    }

    fn cluster(endpoints: &str) -> crate::model::Cluster {
        let yaml = format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: dns}}\nspec: {{clusterIP: 10.96.0.10, ports: [{{port: 53, protocol: UDP}}, {{name: t, port: 53, protocol: TCP}}]}}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: dns-1, labels: {{kubernetes.io/service-name: dns}}}}\naddressType: IPv4\nports: [{{port: 53, protocol: UDP}}, {{name: t, port: 53, protocol: TCP}}]\nendpoints: [{endpoints}]\n"
        );
        let (c, e) = crate::source::manifest_watch::cluster_from_text(&yaml);
        assert!(e.is_empty(), "{e:?}");
        c
    }

    #[test]
    fn a_restarted_agent_watches_draining_endpoints_and_for_tcp_every_terminating_one() {
        let svc = ObjectRef::new("default", "dns");
        let port = |name: &str, protocol| ServicePort { name: name.into(), port: 53, protocol, node_port: None };
        let v6 = Frontend { ip: "fd00::10".parse().unwrap(), port: 53, protocol: Protocol::Udp };
        const DRAINING: &str = "conditions: {ready: false, serving: true, terminating: true}";
        const STOPPED: &str = "conditions: {ready: false, serving: false, terminating: true}";
        // (endpoints, Service port, frontend, backends watched)
        let cases = [
            (format!("{{addresses: [10.244.0.1], {DRAINING}}}"), port("", Protocol::Udp), fe(), vec!["10.244.0.1:53"]),
            (
                format!("{{addresses: [10.244.0.2], {DRAINING}}}, {{addresses: [10.244.0.1], {DRAINING}}}, {{addresses: [10.244.0.3]}}"),
                port("", Protocol::Udp),
                fe(),
                vec!["10.244.0.1:53", "10.244.0.2:53"],
            ),
            ("{addresses: [10.244.0.1]}".to_string(), port("", Protocol::Udp), fe(), vec![]),
            // UDP: a terminating endpoint that stopped serving was ended then.
            (format!("{{addresses: [10.244.0.1], {STOPPED}}}"), port("", Protocol::Udp), fe(), vec![]),
            // TCP: every terminating one, so that it ends once gone.
            (format!("{{addresses: [10.244.0.1], {STOPPED}}}"), port("t", Protocol::Tcp), fe(), vec!["10.244.0.1:53"]),
            (format!("{{addresses: [10.244.0.1], {DRAINING}}}"), port("t", Protocol::Tcp), fe(), vec!["10.244.0.1:53"]),
            ("{addresses: [10.244.0.1], conditions: {ready: false}}".to_string(), port("t", Protocol::Tcp), fe(), vec![]),
            // The slice's UDP port is the unnamed one.
            (format!("{{addresses: [10.244.0.1], {DRAINING}}}"), port("dns", Protocol::Udp), fe(), vec![]),
            // An IPv4 endpoint never served an IPv6 frontend.
            (format!("{{addresses: [10.244.0.1], {DRAINING}}}"), port("", Protocol::Udp), v6, vec![]),
            // Listed again as serving (a slice being replaced): not draining.
            (format!("{{addresses: [10.244.0.1], {DRAINING}}}, {{addresses: [10.244.0.1]}}"), port("", Protocol::Udp), fe(), vec![]),
        ];
        for (endpoints, port, frontend, want) in cases {
            let c = cluster(&endpoints);
            let slices: Vec<&EndpointSlice> = c.slices_of(&svc).collect();
            let want: Vec<Backend> = want.into_iter().map(be).collect();
            assert_eq!(restart_watch(&slices, &port, &frontend), want, "{endpoints} {port:?} {frontend}");
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
                EndpointState::TerminatingNotServing,
            ),
            ("{addresses: [10.244.0.2]}", Protocol::Udp, EndpointState::Gone),
            ("{addresses: [10.244.0.1]}", Protocol::Tcp, EndpointState::Serving),
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
        assert!(EndpointState::TerminatingNotServing.is_terminating() && !EndpointState::NotServing.is_terminating());
    }
}
