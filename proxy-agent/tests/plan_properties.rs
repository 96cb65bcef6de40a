//! Properties of the plan (`decide::plan`) for random map states, and of
//! the order in which the map writer applies one:
//!
//! - applying a plan to the old state yields exactly the desired state,
//!   and a plan touches only what changed;
//! - in every state the datapath can observe while a plan is written, each
//!   service entry points at a complete slot set of backends that exist.
//!
//! The second is checked on a model of the three maps (frontend to service
//! entry, slots per generation, backends) written one element at a time in
//! the writer's order (datapath/maps/map_writer/): deletions first (service
//! entries, then their slots, then backends no frontend uses), then chunks
//! of upserts, each as new backends, new slots under a fresh generation,
//! the service entries (the switch), then the old generations' slots and
//! the backends left unused. The kernel applies a batch call element by
//! element, so every element is a state a program may see. The last test
//! writes random plans with the real writer into real maps and reads them
//! back (root).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use proptest::prelude::*;
use proxy_agent::datapath::dump;
use proxy_agent::datapath::map_writer::MapWriter;
use proxy_agent::datapath::maps::Capacities;
use proxy_agent::datapath::socket_loader;
use proxy_agent::decide::plan::{self, FrontendPolicy, Plan, Policies, State};
use proxy_agent::model::{Backend, Frontend, Protocol};
use proxy_test_support::sandbox::{Cgroup, PinDir};

// ---------------------------------------------------------------------------
// Strategies: small address pools, so that states overlap and backends are
// shared between frontends.
// ---------------------------------------------------------------------------

fn frontend() -> impl Strategy<Value = Frontend> {
    let ips: Vec<IpAddr> = ["10.96.0.1", "10.96.0.2", "10.96.0.3", "10.96.0.4", "fd00:96::1", "fd00:96::2"]
        .iter()
        .map(|s| s.parse().expect("literal"))
        .collect();
    (proptest::sample::select(ips), prop_oneof![Just(80u16), Just(443)], prop_oneof![Just(Protocol::Tcp), Just(Protocol::Udp)])
        .prop_map(|(ip, port, protocol)| Frontend { ip, port, protocol })
}

fn backend() -> impl Strategy<Value = Backend> {
    let ips: Vec<IpAddr> = ["10.244.0.1", "10.244.0.2", "10.244.0.3", "10.244.1.1", "10.244.1.2", "fd00::1", "fd00::2", "fd00::3"]
        .iter()
        .map(|s| s.parse().expect("literal"))
        .collect();
    (proptest::sample::select(ips), prop_oneof![Just(8080u16), Just(8081)]).prop_map(|(ip, port)| Backend { ip, port })
}

/// Frontends with backends of their own family, as `desired_state` gives
/// them.
fn state() -> impl Strategy<Value = State> {
    proptest::collection::btree_map(frontend(), proptest::collection::btree_set(backend(), 0..6), 0..10).prop_map(|mut s| {
        for (fe, set) in &mut s {
            set.retain(|b| b.ip.is_ipv4() == fe.ip.is_ipv4());
        }
        s
    })
}

/// Session affinity (the policy the writer turns into match entries) on
/// some of the state's frontends.
fn policies_for(s: &State) -> impl Strategy<Value = Policies> + use<> {
    let fes: Vec<Frontend> = s.keys().copied().collect();
    proptest::collection::vec(prop_oneof![Just(None), Just(Some(5u32)), Just(Some(10_800))], fes.len()).prop_map(move |timeouts| {
        fes.iter()
            .zip(timeouts)
            .filter_map(|(fe, t)| Some((*fe, FrontendPolicy { affinity_timeout_s: Some(t?), ..FrontendPolicy::default() })))
            .collect()
    })
}

fn state_with_policies() -> impl Strategy<Value = (State, Policies)> {
    state().prop_flat_map(|s| {
        let p = policies_for(&s);
        (Just(s), p)
    })
}

/// The plan applied to a plain state: deletions, then upserts in order.
fn apply(current: &State, plan: &Plan) -> State {
    let mut out = current.clone();
    for fe in &plan.deletes {
        out.remove(fe);
    }
    for (fe, backends) in &plan.upserts {
        out.insert(*fe, backends.iter().copied().collect());
    }
    out
}

// ---------------------------------------------------------------------------
// The maps as the datapath sees them, written in the writer's order.
// ---------------------------------------------------------------------------

/// `SERVICES`, `SLOTS` and `BACKENDS` (any of the two datapaths' copies),
/// plus the writer's book-keeping, which is not observable.
#[derive(Default)]
struct Maps {
    services: BTreeMap<Frontend, (u32, u32, u32)>,
    slots: BTreeMap<(u32, u32, u32), u32>,
    backends: BTreeMap<u32, Backend>,
    /// Backend to (id, frontends using it).
    ids: BTreeMap<Backend, (u32, u32)>,
    /// Frontend to its slot list, as programmed.
    programmed: BTreeMap<Frontend, Vec<Backend>>,
    next_service_id: u32,
    next_backend_id: u32,
    /// Element writes so far.
    steps: usize,
}

/// One element write, as a batch call's element or a single update.
enum Op {
    PutBackend(u32, Backend),
    PutSlot((u32, u32, u32), u32),
    PutService(Frontend, (u32, u32, u32)),
    DelService(Frontend),
    DelSlot((u32, u32, u32)),
    DelBackend(u32),
}

impl Maps {
    fn from_state(s: &State) -> Maps {
        let mut m = Maps { next_service_id: 1, next_backend_id: 1, ..Maps::default() };
        let plan = plan::diff(&State::new(), s);
        m.write(&plan, usize::MAX);
        m
    }

    /// Applies one element write, then checks what a program reading the
    /// maps now would find.
    fn op(&mut self, op: Op) {
        match op {
            Op::PutBackend(id, b) => {
                self.backends.insert(id, b);
            }
            Op::PutSlot(k, id) => {
                self.slots.insert(k, id);
            }
            Op::PutService(fe, v) => {
                self.services.insert(fe, v);
            }
            Op::DelService(fe) => {
                self.services.remove(&fe);
            }
            Op::DelSlot(k) => {
                self.slots.remove(&k);
            }
            Op::DelBackend(id) => {
                self.backends.remove(&id);
            }
        }
        self.steps += 1;
        self.check_observable();
    }

    /// Every service entry's slots exist under its generation and name
    /// backends that exist.
    fn check_observable(&self) {
        for (fe, (sid, generation, count)) in &self.services {
            for slot in 0..*count {
                let id = self.slots.get(&(*sid, *generation, slot));
                let id = id.unwrap_or_else(|| panic!("step {}: {fe} (generation {generation}) misses slot {slot}", self.steps));
                assert!(self.backends.contains_key(id), "step {}: {fe} slot {slot} names missing backend {id}", self.steps);
            }
        }
    }

    /// What the maps hold, decoded as a program would.
    fn decoded(&self) -> State {
        self.services
            .iter()
            .map(|(fe, (sid, generation, count))| {
                let set = (0..*count).map(|slot| self.backends[&self.slots[&(*sid, *generation, slot)]]).collect();
                (*fe, set)
            })
            .collect()
    }

    /// Releases one reference of each backend of `old` (a generation no
    /// service entry points at any more); returns the backend ids left
    /// unused.
    fn release(&mut self, old: &[Backend]) -> Vec<u32> {
        let mut dead = Vec::new();
        for b in old {
            let e = self.ids.get_mut(b).expect("a programmed backend has an id");
            e.1 -= 1;
            if e.1 == 0 {
                dead.push(e.0);
                self.ids.remove(b);
            }
        }
        dead
    }

    /// Writes `plan` in the writer's order, `chunk` frontends at a time.
    fn write(&mut self, plan: &Plan, chunk: usize) {
        // Deletions: the service entries, then their slots, then the
        // backends nobody uses.
        let mut gone = Vec::new();
        for fe in &plan.deletes {
            if let (Some(v), Some(list)) = (self.services.get(fe).copied(), self.programmed.remove(fe)) {
                gone.push((v, list));
            }
        }
        for fe in &plan.deletes {
            if self.services.contains_key(fe) {
                self.op(Op::DelService(*fe));
            }
        }
        let mut dead_slots = Vec::new();
        let mut dead_backends = Vec::new();
        for ((sid, generation, count), list) in &gone {
            dead_slots.extend((0..*count).map(|slot| (*sid, *generation, slot)));
            dead_backends.extend(self.release(list));
        }
        for k in dead_slots {
            self.op(Op::DelSlot(k));
        }
        for id in dead_backends {
            self.op(Op::DelBackend(id));
        }

        for part in plan.upserts.chunks(chunk.max(1)) {
            let mut new_backends: Vec<(u32, Backend)> = Vec::new();
            let mut slots = Vec::new();
            let mut entries = Vec::new();
            let mut olds = Vec::new();
            for (fe, list) in part {
                let old = self.services.get(fe).copied();
                let (sid, generation) = if let Some((sid, generation, _)) = old {
                    (sid, generation + 1)
                } else {
                    self.next_service_id += 1;
                    (self.next_service_id - 1, 1)
                };
                for (slot, b) in list.iter().enumerate() {
                    let known = self.ids.get(b).map(|e| e.0).or_else(|| new_backends.iter().find(|(_, nb)| nb == b).map(|(id, _)| *id));
                    let id = if let Some(id) = known {
                        id
                    } else {
                        self.next_backend_id += 1;
                        new_backends.push((self.next_backend_id - 1, *b));
                        self.next_backend_id - 1
                    };
                    slots.push(((sid, generation, slot as u32), id));
                }
                entries.push((*fe, (sid, generation, list.len() as u32)));
                olds.push((old, self.programmed.insert(*fe, list.clone())));
            }
            // (1) backends, (2) slots of the new generations, (3) the switch.
            for (id, b) in &new_backends {
                self.ids.insert(*b, (*id, 0));
                self.op(Op::PutBackend(*id, *b));
            }
            for (k, id) in slots {
                self.op(Op::PutSlot(k, id));
            }
            for (fe, v) in &entries {
                self.op(Op::PutService(*fe, *v));
            }
            // References on every new set before any old one is dropped.
            for (_, list) in part {
                for b in list {
                    self.ids.get_mut(b).expect("id assigned above").1 += 1;
                }
            }
            // (4) the old generations' slots, (5) backends left unused.
            let mut dead_slots = Vec::new();
            let mut dead_backends = Vec::new();
            for (old, list) in olds {
                if let (Some((sid, generation, count)), Some(list)) = (old, list) {
                    dead_slots.extend((0..count).map(|slot| (sid, generation, slot)));
                    dead_backends.extend(self.release(&list));
                }
            }
            for k in dead_slots {
                self.op(Op::DelSlot(k));
            }
            for id in dead_backends {
                self.op(Op::DelBackend(id));
            }
        }
    }

    /// Nothing left behind: every slot belongs to a current generation and
    /// every backend is used, once per address.
    fn check_clean(&self) {
        let live: BTreeSet<(u32, u32, u32)> =
            self.services.values().flat_map(|(sid, generation, count)| (0..*count).map(move |slot| (*sid, *generation, slot))).collect();
        let slots: BTreeSet<(u32, u32, u32)> = self.slots.keys().copied().collect();
        assert_eq!(slots, live, "slots of old generations are left");
        let used: BTreeSet<u32> = self.slots.values().copied().collect();
        let backends: BTreeSet<u32> = self.backends.keys().copied().collect();
        assert_eq!(backends, used, "unused backends are left");
        let addresses: BTreeSet<Backend> = self.backends.values().copied().collect();
        assert_eq!(addresses.len(), self.backends.len(), "a backend address has two ids");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn applying_the_plan_yields_exactly_the_desired_state(current in state(), desired in state()) {
        let p = plan::diff(&current, &desired);
        prop_assert_eq!(apply(&current, &p), desired.clone());
        // Only what changed: each upsert differs from what is there, each
        // delete is there and unwanted, and no frontend is both.
        for (fe, backends) in &p.upserts {
            let want: BTreeSet<Backend> = backends.iter().copied().collect();
            prop_assert!(current.get(fe) != Some(&want), "{} rewritten unchanged", fe);
            prop_assert_eq!(desired.get(fe), Some(&want));
        }
        for fe in &p.deletes {
            prop_assert!(current.contains_key(fe) && !desired.contains_key(fe));
            prop_assert!(!p.upserts.iter().any(|(u, _)| u == fe));
        }
        prop_assert!(plan::diff(&desired, &desired).is_empty(), "the desired state again is a no-op");
    }

    #[test]
    fn policies_travel_with_their_frontends((current, current_policies) in state_with_policies(), (desired, desired_policies) in state_with_policies()) {
        let p = plan::diff_with_policies(&current, &current_policies, &desired, &desired_policies);
        prop_assert_eq!(apply(&current, &p), desired.clone());
        for (fe, _) in &p.upserts {
            let want = desired_policies.get(fe).cloned().unwrap_or_default();
            prop_assert_eq!(p.policy_of(fe), &want);
        }
        // A frontend left alone already has its backends and its policy.
        for (fe, set) in &desired {
            if !p.upserts.iter().any(|(u, _)| u == fe) {
                prop_assert_eq!(current.get(fe), Some(set));
                prop_assert_eq!(current_policies.get(fe), desired_policies.get(fe));
            }
        }
    }

    #[test]
    fn a_layered_plan_is_the_plan_against_the_union(current in state(), primary in state(), fallback in state()) {
        let mut union = fallback.clone();
        union.extend(primary.clone());
        let none = Policies::new();
        prop_assert_eq!(plan::diff_layered(&current, &none, &primary, &fallback, &none), plan::diff(&current, &union));
        // The same one frontend at a time, the current sets in any order.
        let have: Vec<(Frontend, Vec<Backend>)> = current.iter().map(|(fe, set)| (*fe, set.iter().rev().copied().collect())).collect();
        let streamed = plan::diff_layered_streams(
            have.iter().map(|(fe, list)| (*fe, list.as_slice())),
            &none,
            primary.iter().map(|(fe, set)| (*fe, set.iter().copied().collect())),
            &fallback,
            &none,
        );
        prop_assert_eq!(streamed, plan::diff(&current, &union));
    }

    #[test]
    fn no_observable_state_points_at_a_missing_backend(
        states in proptest::collection::vec(state(), 1..5),
        chunk in 1usize..6,
    ) {
        let mut maps = Maps::from_state(&State::new());
        let mut current = State::new();
        for desired in states {
            let p = plan::diff(&current, &desired);
            maps.write(&p, chunk);
            prop_assert_eq!(maps.decoded(), desired.clone());
            maps.check_clean();
            current = desired;
        }
    }
}

/// The real writer on real maps: after every plan, the maps hold exactly
/// the desired state (read back by a fresh writer), and `dump`'s
/// consistency rules find nothing wrong. Needs root.
#[test]
fn the_real_writer_leaves_exactly_the_desired_state() {
    // SAFETY: geteuid has no preconditions.
    assert_eq!(unsafe { libc::geteuid() }, 0, "loading maps needs root (CAP_BPF)");
    let cg = Cgroup::new("tpprop").expect("cgroup");
    let pins = PinDir::new("tpprop").expect("pins");
    socket_loader::install(cg.path(), pins.path(), Capacities::default()).expect("install the socket datapath");
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig { cases: 48, ..ProptestConfig::default() });
    let result = runner.run(&proptest::collection::vec(state_with_policies(), 1..4), |steps| {
        let mut writer = MapWriter::open(pins.path()).expect("open maps");
        for (desired, policies) in steps {
            let p = plan::diff_with_policies(&writer.state(), &writer.policies(), &desired, &policies);
            let errors = writer.apply(&p);
            prop_assert!(errors.is_empty(), "{:?}", errors);
            let again = MapWriter::open(pins.path()).expect("reopen maps");
            prop_assert_eq!(again.state(), desired.clone());
            // The timeout is stored only in the match entries, one per
            // backend: a frontend without backends has none to read back
            // (the writer then rewrites it once after a restart).
            let timeouts = |p: &Policies| -> Vec<(Frontend, Option<u32>)> {
                p.iter()
                    .filter(|(fe, _)| desired.get(fe).is_some_and(|b| !b.is_empty()))
                    .map(|(fe, p)| (*fe, p.affinity_timeout_s))
                    .collect()
            };
            prop_assert_eq!(timeouts(&again.policies()), timeouts(&policies));
            let snap = dump::read(pins.path()).expect("dump");
            let analysis = dump::check(&snap.services, &snap.slots, &snap.backends);
            prop_assert!(analysis.findings.is_empty(), "{:?}", analysis.findings);
        }
        Ok(())
    });
    // Whatever a case left is the next case's start: cases begin from
    // arbitrary programmed states, as a restarted agent does.
    if let Err(e) = result {
        panic!("{e}");
    }
}
