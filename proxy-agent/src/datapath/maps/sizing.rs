//! Map capacities that fit the cluster: sized from what the first model
//! will program, with headroom, within a kernel-memory budget. Pure (no
//! kernel access), so the rules are table-tested.
//!
//! Costs are per entry of capacity, measured with `bpftool map show`
//! (memlock) on Linux 6.18: a preallocated or LRU hash map charges
//! max_entries elements at creation (kernel/bpf/hashtab.c:
//! htab_map_mem_usage); a `BPF_F_NO_PREALLOC` one charges a 16-byte bucket
//! per entry of capacity (n_buckets is max_entries rounded up to a power of
//! two) plus one element per entry written. The budget is charged at the
//! worst case, every map full, so the pinned maps never exceed it whatever
//! the traffic; what they use at first is much less (only the LRU maps are
//! charged in full at creation).
//!
//! Maglev tables are arrays made on demand, one per distinct backend set,
//! outside any capacity: the budget reserves them a share before the maps
//! grow (what the first list asks for, plus half again, and at least
//! [`MAGLEV_FLOOR_BYTES`] for Services added later, within what the maps'
//! own needs leave), which the writers do not exceed (`maglev_budget`).

use crate::datapath::maps::{Capacities, Capacity};
use crate::decide::maglev::{self, TableSize};
use crate::model::ObjectRef;
use crate::model::Protocol;
use crate::model::store::{Delta, Object};

/// What the first model will program, counted from its objects.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Needs {
    /// Frontends (SERVICES entries).
    pub frontends: u64,
    /// Slots: each frontend's backends.
    pub slots: u64,
    /// Distinct backend addresses.
    pub backends: u64,
    /// Kernel memory of the Maglev tables asked for: one per Service port
    /// at TC (NodePort, LoadBalancer IPs, externalIPs), one more at the
    /// socket layer for UDP, of the annotated size or the default.
    pub maglev_bytes: u64,
}

/// NodePort frontends are one per node address, which is not known before
/// the external datapath resolves the devices: counted as this many.
const NODE_ADDRESSES_GUESS: u64 = 4;

impl Needs {
    /// Counts the deltas of an initial list (oldest first; the last delta of
    /// an object wins). An overestimate where the decision is not known yet
    /// (every endpoint counts, ready or not; every NodePort as
    /// `NODE_ADDRESSES_GUESS` frontends), which only adds headroom.
    /// `maglev_default` is `--maglev-table-size`: the tables of Services
    /// without the annotation.
    pub fn of(deltas: &[Delta], maglev_default: Option<TableSize>) -> Needs {
        // Hashed, not ordered: only sums come out (at 100k Services a
        // B-tree of the 200k ids was an eighth of a second of the start).
        let mut latest: foldhash::HashMap<(u8, &ObjectRef), Option<&Object>> = foldhash::HashMap::default();
        latest.reserve(deltas.len());
        for d in deltas {
            latest.insert((d.kind as u8, &d.id), d.object.as_ref().filter(|_| d.present));
        }
        // Endpoints per Service (namespace, service name), and backends as
        // endpoint x slice port.
        let mut endpoints: foldhash::HashMap<(&str, &str), u64> = foldhash::HashMap::default();
        let mut needs = Needs::default();
        for object in latest.values().flatten() {
            if let Object::Slice(s) = object {
                let n = s.endpoints.len() as u64;
                *endpoints.entry((&*s.id.namespace, s.service_name.as_str())).or_default() += n;
                needs.backends += n * (s.ports.len() as u64).max(1);
            }
        }
        for object in latest.values().flatten() {
            if let Object::Service(s) = object {
                let ips = (s.cluster_ips.len() + s.external_ips.len() + s.load_balancer_ips.len()) as u64;
                let eps = endpoints.get(&(&*s.id.namespace, &*s.id.name)).copied().unwrap_or(0);
                // An invalid annotation falls back to the default, as
                // `decide::decision` does.
                let table = maglev::annotated_size(&s.annotations).ok().flatten().or(maglev_default).map_or(0, TableSize::bytes);
                let external = !s.external_ips.is_empty() || !s.load_balancer_ips.is_empty();
                for p in &s.ports {
                    let frontends = ips + if p.node_port.is_some() { NODE_ADDRESSES_GUESS } else { 0 };
                    needs.frontends += frontends;
                    needs.slots += frontends * eps;
                    if external || p.node_port.is_some() {
                        needs.maglev_bytes += table;
                    }
                    if p.protocol == Protocol::Udp {
                        needs.maglev_bytes += table;
                    }
                }
            }
        }
        needs
    }
}

/// Kernel memory per entry of capacity when full, in bytes, summed over
/// the maps a capacity sizes (both datapaths). Measured memlock per
/// max_entries; see the module comment.
pub const fn bytes_per_entry(c: Capacity) -> u64 {
    match c {
        // SERVICES, NP_SERVICES (104 each), NP_FLAGS (96); the source-range
        // tries hold entries only for LoadBalancer frontends with ranges.
        Capacity::Services => 104 + 104 + 96,
        // SLOTS, NP_SLOTS (88 each); AFFINITY_MATCH and NP_AFFINITY_MATCH
        // (buckets only: entries only for affine frontends).
        Capacity::Slots => 88 + 88 + 16 + 16,
        // BACKENDS, NP_BACKENDS.
        Capacity::Backends => 96 + 96,
        // SOCK_REVNAT (LRU, 120) and SOCK_REC (preallocated hash, 8-byte
        // key, 44-byte value: 120, measured the same way on 6.18).
        Capacity::SockRevNat => 120 + 120,
        Capacity::NpConntrack => 152,
        // AFFINITY (96), NP_AFFINITY (104).
        Capacity::Affinity => 96 + 104,
    }
}

/// The smallest capacity the agent sizes a map to, and the largest it
/// grows one to from the budget alone (today's fixed defaults, which
/// explicit flags and the first model's needs may exceed).
const fn bounds(c: Capacity) -> (u32, u32) {
    match c {
        Capacity::Services => (1024, 65_536),
        Capacity::Slots => (16_384, 1_048_576),
        Capacity::Backends => (8192, 262_144),
        Capacity::SockRevNat => (16_384, 262_144),
        Capacity::NpConntrack => (16_384, 262_144),
        Capacity::Affinity => (4096, 65_536),
    }
}

/// Default `--map-memory-budget`, MiB.
pub const DEFAULT_BUDGET_MIB: u64 = 64;

/// The least the budget reserves for Maglev tables: 16 tables of the
/// default size, for Services annotated after the start (the reserve is
/// fixed until the next restart).
pub const MAGLEV_FLOOR_BYTES: u64 = 16 * TableSize::Default.bytes();

/// The order in which spare budget doubles capacities: connection
/// tracking first (a full LRU evicts live flows), then the socket reverse
/// translations, then room for more Services before a restart.
const GROWTH_ORDER: [Capacity; 6] =
    [Capacity::NpConntrack, Capacity::SockRevNat, Capacity::Services, Capacity::Slots, Capacity::Backends, Capacity::Affinity];

/// What [`size`] chose.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sizing {
    /// The capacities chosen.
    pub caps: Capacities,
    /// Kernel memory of the sized maps when full, bytes, the Maglev
    /// tables' share included.
    pub worst_case_bytes: u64,
    /// The Maglev tables' share of the budget, bytes.
    pub maglev_bytes: u64,
    /// The explicit capacities and the first model's needs alone exceed
    /// the budget (they win; the agent warns).
    pub over_budget: bool,
}

/// Kernel memory per entry of the services capacity that the topology
/// counting arrays take on a machine with `cpus` possible CPUs (issue #34):
/// `SVC_CONN` and `NP_SVC_CONN` hold a 48-byte `SvcConnValue` per CPU per
/// entry (kernel/bpf/arraymap.c allocates a per-CPU array's values for
/// every possible CPU), `SVC_TOPO` and `NP_SVC_TOPO` an element rounded up
/// to 8 bytes.
pub const fn counting_bytes_per_service(cpus: u32) -> u64 {
    2 * (48 * cpus as u64 + 8)
}

/// Kernel memory of the fixed-size maps larger than a page, bytes: no
/// capacity sizes them, so the budget is charged for them before any
/// capacity grows. `SOCK_REC_COUNT` holds a u64 per slot (512 KiB), the
/// port bitmaps `NP_PORTS` and `SOCK_PORTS` a u64 per word (24 KiB); an
/// array's memlock is its elements rounded up to 8 bytes
/// (kernel/bpf/arraymap.c: array_map_mem_usage). The one-element and
/// per-reason maps are left out (a few pages in all).
pub const FIXED_BYTES: u64 = 8 * (proxy_common::SOCK_REC_COUNT_SLOTS as u64)
    + 8 * (proxy_common::NP_PORTS_ENTRIES as u64)
    + 8 * (proxy_common::SOCK_PORTS_ENTRIES as u64);

/// [`bytes_per_entry`] with the counting arrays of `cpus` CPUs.
const fn bytes_per_entry_on(c: Capacity, cpus: u32) -> u64 {
    match c {
        Capacity::Services => bytes_per_entry(c) + counting_bytes_per_service(cpus),
        _ => bytes_per_entry(c),
    }
}

/// The worst-case kernel memory of `caps`, bytes, on one CPU (see
/// [`worst_case_bytes_on`]).
pub fn worst_case_bytes(caps: &Capacities) -> u64 {
    worst_case_bytes_on(caps, 1)
}

/// The worst-case kernel memory of `caps` on a machine with `cpus`
/// possible CPUs, bytes, the fixed-size maps ([`FIXED_BYTES`]) included.
pub fn worst_case_bytes_on(caps: &Capacities, cpus: u32) -> u64 {
    FIXED_BYTES + Capacity::ALL.iter().map(|&c| u64::from(caps.get(c)) * bytes_per_entry_on(c, cpus)).sum::<u64>()
}

/// Sizes every capacity not given explicitly: the service maps to the
/// first model's needs plus half again (a frontend's old and new slot
/// generations coexist while it is rewritten, and the cluster grows
/// between restarts), at least their floor; then the spare budget doubles
/// capacities in `GROWTH_ORDER` up to their ceilings. The Maglev
/// tables' share is set aside before the maps grow: their needs plus half
/// again (a rewritten frontend's old and new tables coexist), at least
/// [`MAGLEV_FLOOR_BYTES`], at most what the maps' own needs leave of the
/// budget; what the grown maps leave is added.
pub fn size(needs: Option<Needs>, explicit: &[Option<u32>; 6], budget_bytes: u64) -> Sizing {
    size_on(needs, explicit, budget_bytes, 1)
}

/// [`size`] on a machine with `cpus` possible CPUs: the per-CPU topology
/// counting arrays grow with them ([`counting_bytes_per_service`]).
pub fn size_on(needs: Option<Needs>, explicit: &[Option<u32>; 6], budget_bytes: u64, cpus: u32) -> Sizing {
    let worst_case_bytes = |caps: &Capacities| worst_case_bytes_on(caps, cpus);
    let bytes_per_entry = |c: Capacity| bytes_per_entry_on(c, cpus);
    let needs = needs.unwrap_or_default();
    let mut caps = Capacities::default();
    let mut free = [false; 6];
    for (i, &c) in Capacity::ALL.iter().enumerate() {
        let (floor, _) = bounds(c);
        let needed = match c {
            Capacity::Services => needs.frontends,
            Capacity::Slots => needs.slots,
            Capacity::Backends => needs.backends,
            _ => 0,
        };
        let value = explicit[i].unwrap_or_else(|| {
            free[i] = true;
            let with_headroom = needed.saturating_add(needed / 2);
            u32::try_from(with_headroom).unwrap_or(u32::MAX).max(floor)
        });
        set(&mut caps, c, value);
    }
    let over_budget = worst_case_bytes(&caps) > budget_bytes;
    // Tables are an optimisation (a frontend without one takes the slot
    // pick), so unlike the maps they never take the budget past its end.
    let left = budget_bytes.saturating_sub(worst_case_bytes(&caps));
    let maglev_reserve = needs.maglev_bytes.saturating_add(needs.maglev_bytes / 2).max(MAGLEV_FLOOR_BYTES).min(left);
    let maps_budget = budget_bytes.saturating_sub(maglev_reserve);
    loop {
        let mut grew = false;
        for c in GROWTH_ORDER {
            let i = Capacity::ALL.iter().position(|&x| x == c).unwrap_or(0);
            let (_, ceiling) = bounds(c);
            let now = caps.get(c);
            if !free[i] || now >= ceiling {
                continue;
            }
            let next = now.saturating_mul(2).min(ceiling);
            let extra = u64::from(next - now) * bytes_per_entry(c);
            if worst_case_bytes(&caps) + extra <= maps_budget {
                set(&mut caps, c, next);
                grew = true;
            }
        }
        if !grew {
            break;
        }
    }
    // What the maps leave (they may stop short of it, at their ceilings or
    // set by flags) goes to the tables too.
    let maglev_bytes = maglev_reserve.max(budget_bytes.saturating_sub(worst_case_bytes(&caps)));
    Sizing { caps, worst_case_bytes: worst_case_bytes(&caps) + maglev_bytes, maglev_bytes, over_budget }
}

/// The capacities to use given the pinned maps' (`pinned`, in
/// [`Capacity::ALL`] order): an explicit flag always wins (a difference is
/// migrated); a sized capacity keeps the pinned one when that holds what
/// the first model needs and is within a factor of two of the sized one,
/// so that a restart into a slightly different cluster does not copy every
/// map, while one at its idle size (`idle_tc`) grows back.
pub fn keep_pinned(sized: &Capacities, needs: Option<Needs>, explicit: &[Option<u32>; 6], pinned: &[Option<u32>; 6]) -> Capacities {
    let needs = needs.unwrap_or_default();
    let mut caps = *sized;
    for (i, &c) in Capacity::ALL.iter().enumerate() {
        let needed = match c {
            Capacity::Services => needs.frontends,
            Capacity::Slots => needs.slots,
            Capacity::Backends => needs.backends,
            _ => 0,
        };
        if let (None, Some(p)) = (explicit[i], pinned[i])
            && u64::from(p) >= needed.saturating_add(needed / 4)
            && 2 * u64::from(p) >= u64::from(sized.get(c))
            && u64::from(p) <= 2 * u64::from(sized.get(c))
        {
            set(&mut caps, c, p);
        }
    }
    caps
}

/// The TC datapath's capacities while no TC program runs (`--devices
/// none`): nothing writes its maps, so each keeps the size it is pinned
/// with (`pinned`, the TC maps' own, in [`Capacity::ALL`] order: no copy
/// now, nor when devices come back at that size) or takes its floor. An
/// explicit flag still wins, as everywhere.
pub fn idle_tc(explicit: &[Option<u32>; 6], pinned: &[Option<u32>; 6]) -> Capacities {
    let mut caps = Capacities::default();
    for (i, &c) in Capacity::ALL.iter().enumerate() {
        set(&mut caps, c, explicit[i].or(pinned[i]).unwrap_or(bounds(c).0));
    }
    caps
}

fn set(caps: &mut Capacities, c: Capacity, value: u32) {
    match c {
        Capacity::Services => caps.services = value,
        Capacity::Slots => caps.slots = value,
        Capacity::Backends => caps.backends = value,
        Capacity::SockRevNat => caps.sock_revnat = value,
        Capacity::NpConntrack => caps.np_conntrack = value,
        Capacity::Affinity => caps.affinity = value,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;
    const NONE: [Option<u32>; 6] = [None; 6];

    fn needs(frontends: u64, slots: u64, backends: u64) -> Needs {
        Needs { frontends, slots, backends, maglev_bytes: 0 }
    }

    #[test]
    fn needs_count_frontends_slots_and_backends_of_the_initial_list() {
        let dir = std::env::temp_dir().join(format!("tp-sizing-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let slice = |name: &str, owner: &str, ips: &[&str]| {
            let eps: String = ips.iter().map(|ip| format!("- addresses: [{ip}]\n")).collect();
            format!(
                "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}, labels: {{kubernetes.io/service-name: {owner}}}}}\naddressType: IPv4\nports: [{{name: a, port: 8080}}, {{name: b, port: 8081}}]\nendpoints:\n{eps}"
            )
        };
        let yaml = [
            "---\napiVersion: v1\nkind: Service\nmetadata: {name: web}\nspec: {clusterIP: 10.96.0.1, ports: [{name: a, port: 80}, {name: b, port: 81}]}\n".to_string(),
            "---\napiVersion: v1\nkind: Service\nmetadata: {name: np}\nspec: {type: NodePort, clusterIP: 10.96.0.2, externalIPs: [192.0.2.1], ports: [{name: a, port: 80, nodePort: 30080}]}\n".to_string(),
            slice("web-1", "web", &["10.0.0.1", "10.0.0.2", "10.0.0.3"]),
            slice("np-1", "np", &["10.0.1.1", "10.0.1.2"]),
            "---\napiVersion: v1\nkind: Service\nmetadata: {name: dns, annotations: {topoproxy.io/maglev-table-size: \"65521\"}}\nspec: {clusterIP: 10.96.0.3, ports: [{name: a, port: 53, protocol: UDP}, {name: b, port: 53, protocol: TCP}]}\n".to_string(),
        ]
        .concat();
        std::fs::write(dir.join("m.yaml"), yaml).unwrap();
        let read = crate::source::manifest_watch::read(std::slice::from_ref(&dir));
        let _ = std::fs::remove_dir_all(&dir);
        let deltas: Vec<Delta> = read.deltas.into_values().collect();
        // web: 2 ports x 1 IP, 3 endpoints each. np: 1 port x (cluster IP,
        // external IP, 4 guessed node addresses), 2 endpoints each. dns: 2
        // ports x 1 IP, no endpoints. Backends: endpoints x slice ports.
        // Maglev tables: dns's UDP port at the socket layer, at its
        // annotated size; np's port at TC when tables are on by default.
        let (default, large) = (TableSize::Default.bytes(), TableSize::Large.bytes());
        let counted = Needs { frontends: 2 + 6 + 2, slots: 2 * 3 + 6 * 2, backends: 3 * 2 + 2 * 2, maglev_bytes: large };
        assert_eq!(Needs::of(&deltas, None), counted);
        assert_eq!(Needs::of(&deltas, Some(TableSize::Default)), Needs { maglev_bytes: large + default, ..counted });
        assert_eq!(Needs::of(&[], Some(TableSize::Large)), Needs::default());
    }

    #[test]
    fn pinned_capacities_are_kept_unless_too_small_too_large_or_overridden() {
        let sized = Capacities { services: 1000, slots: 10_000, backends: 5000, sock_revnat: 100, np_conntrack: 100, affinity: 100 };
        let needs = needs(600, 6000, 3000);
        // (explicit, pinned, expected), per capacity in Capacity::ALL order.
        let explicit = [None, None, None, Some(7), None, None];
        let pinned = [Some(1500), Some(7000), Some(20_000), Some(100), Some(150), None];
        let caps = keep_pinned(&sized, Some(needs), &explicit, &pinned);
        // Services: big enough, within 2x: kept. Slots: 7000 < 6000 * 1.25:
        // grown. Backends: more than twice the sized: shrunk. The explicit
        // one is the caller's, untouched here. LRU within 2x: kept.
        assert_eq!(caps, Capacities { services: 1500, slots: 10_000, backends: 5000, sock_revnat: 100, np_conntrack: 150, affinity: 100 });
    }

    #[test]
    fn idle_tc_maps_keep_their_pins_or_take_their_floors_and_grow_back() {
        let pinned = [Some(150_000), None, Some(9000), None, Some(16_384), None];
        let idle = idle_tc(&NONE, &pinned);
        assert_eq!(
            idle,
            Capacities { services: 150_000, slots: 16_384, backends: 9000, sock_revnat: 16_384, np_conntrack: 16_384, affinity: 4096 }
        );
        let flagged = idle_tc(&[None, None, Some(5000), None, None, Some(7)], &pinned);
        assert_eq!((flagged.backends, flagged.affinity), (5000, 7), "explicit flags win");
        // Devices back: a TC map left at its floor is less than half the
        // sized capacity, so it is not kept (it is migrated to the size).
        let sized = Capacities { np_conntrack: 262_144, ..Capacities::default() };
        let caps = keep_pinned(&sized, None, &NONE, &[None, None, None, None, Some(16_384), None]);
        assert_eq!(caps.np_conntrack, 262_144);
    }

    #[test]
    fn sizes_follow_needs_budget_and_flags() {
        struct Case {
            what: &'static str,
            needs: Option<Needs>,
            explicit: [Option<u32>; 6],
            budget_mib: u64,
            check: fn(&Sizing),
        }
        let cases = [
            Case {
                what: "a small cluster at the default budget stays within it and under today's defaults",
                needs: Some(needs(3, 6, 6)),
                explicit: NONE,
                budget_mib: DEFAULT_BUDGET_MIB,
                check: |s| {
                    assert!(!s.over_budget);
                    assert!(s.worst_case_bytes <= DEFAULT_BUDGET_MIB * MIB);
                    assert!(s.caps.np_conntrack >= 65_536 && s.caps.sock_revnat >= 65_536, "{s:?}");
                    for c in Capacity::ALL {
                        assert!(s.caps.get(c) <= bounds(c).1, "{c:?}");
                    }
                },
            },
            Case {
                what: "no model (the source did not answer in time): floors, grown by the budget",
                needs: None,
                explicit: NONE,
                budget_mib: 1,
                check: |s| {
                    for c in Capacity::ALL {
                        assert_eq!(s.caps.get(c), bounds(c).0, "{c:?}");
                    }
                    assert!(s.over_budget, "the floors alone cost more than 1 MiB");
                },
            },
            Case {
                what: "100k Services x 10 endpoints fit, whatever the budget",
                needs: Some(needs(100_000, 1_000_000, 1_000_000)),
                explicit: NONE,
                budget_mib: DEFAULT_BUDGET_MIB,
                check: |s| {
                    assert!(s.caps.services >= 150_000 && s.caps.slots >= 1_500_000 && s.caps.backends >= 1_500_000, "{s:?}");
                    assert!(s.over_budget);
                    assert_eq!(s.caps.np_conntrack, bounds(Capacity::NpConntrack).0);
                },
            },
            Case {
                what: "explicit flags win and are never grown",
                needs: Some(needs(100_000, 1_000_000, 1_000_000)),
                explicit: [Some(10), Some(20), Some(30), Some(40), Some(50), Some(60)],
                budget_mib: 4096,
                check: |s| {
                    let got: Vec<u32> = Capacity::ALL.iter().map(|&c| s.caps.get(c)).collect();
                    assert_eq!(got, [10, 20, 30, 40, 50, 60]);
                },
            },
            Case {
                what: "a large budget grows every capacity to today's defaults and no further; the tables get the rest",
                needs: Some(needs(3, 6, 6)),
                explicit: NONE,
                budget_mib: 4096,
                check: |s| {
                    assert_eq!(s.caps, Capacities::default());
                    assert_eq!(s.worst_case_bytes, 4096 * MIB);
                    assert_eq!(s.maglev_bytes, 4096 * MIB - worst_case_bytes(&s.caps));
                },
            },
            Case {
                what: "no tables asked for: the tables' floor is set aside before the maps grow",
                needs: Some(needs(3, 6, 6)),
                explicit: NONE,
                budget_mib: DEFAULT_BUDGET_MIB,
                check: |s| {
                    assert!(s.maglev_bytes >= MAGLEV_FLOOR_BYTES, "{s:?}");
                    assert_eq!(s.worst_case_bytes, worst_case_bytes(&s.caps) + s.maglev_bytes);
                    assert!(s.worst_case_bytes <= DEFAULT_BUDGET_MIB * MIB);
                },
            },
            Case {
                what: "the tables asked for, plus half again, are set aside before the maps grow",
                needs: Some(Needs { maglev_bytes: 100 * TableSize::Default.bytes(), ..needs(300, 600, 600) }),
                explicit: NONE,
                budget_mib: DEFAULT_BUDGET_MIB,
                check: |s| {
                    assert!(!s.over_budget);
                    assert!(s.maglev_bytes >= 150 * TableSize::Default.bytes(), "{s:?}");
                    assert!(s.worst_case_bytes <= DEFAULT_BUDGET_MIB * MIB);
                    let without = size(Some(needs(300, 600, 600)), &NONE, DEFAULT_BUDGET_MIB * MIB);
                    assert!(worst_case_bytes(&s.caps) < worst_case_bytes(&without.caps), "the maps grew less: {s:?} vs {without:?}");
                },
            },
            Case {
                what: "tables beyond the budget get what the maps' needs leave, and no more (they are an optimisation)",
                needs: Some(Needs { maglev_bytes: 1000 * TableSize::Default.bytes(), ..needs(3, 6, 6) }),
                explicit: NONE,
                budget_mib: DEFAULT_BUDGET_MIB,
                check: |s| {
                    assert!(!s.over_budget);
                    assert_eq!(s.worst_case_bytes, DEFAULT_BUDGET_MIB * MIB);
                    for c in Capacity::ALL {
                        assert_eq!(s.caps.get(c), bounds(c).0, "{c:?}: no budget left to grow");
                    }
                    assert_eq!(s.maglev_bytes, DEFAULT_BUDGET_MIB * MIB - worst_case_bytes(&s.caps));
                },
            },
            Case {
                what: "maps that need more than the budget leave the tables nothing",
                needs: Some(Needs { maglev_bytes: 10 * TableSize::Default.bytes(), ..needs(100_000, 1_000_000, 1_000_000) }),
                explicit: NONE,
                budget_mib: DEFAULT_BUDGET_MIB,
                check: |s| {
                    assert!(s.over_budget);
                    assert_eq!(s.maglev_bytes, 0);
                },
            },
            Case {
                what: "capacities set by flags leave the rest of the budget to the tables",
                needs: None,
                explicit: [Some(1024), Some(16_384), Some(8192), Some(16_384), Some(16_384), Some(4096)],
                budget_mib: DEFAULT_BUDGET_MIB,
                check: |s| {
                    assert!(!s.over_budget);
                    assert_eq!(s.maglev_bytes, DEFAULT_BUDGET_MIB * MIB - worst_case_bytes(&s.caps));
                },
            },
        ];
        for case in cases {
            let s = size(case.needs, &case.explicit, case.budget_mib * MIB);
            eprintln!("{}: {s:?}", case.what);
            (case.check)(&s);
        }
    }

    /// The fixed-size maps (`SOCK_REC_COUNT`, the port bitmaps) are
    /// charged before any capacity: a budget that holds the floors' maps
    /// but not them beside is over.
    #[test]
    fn fixed_size_maps_are_charged() {
        assert_eq!(FIXED_BYTES, 512 * 1024 + 24 * 1024);
        let floors = size(None, &NONE, 0).caps;
        let maps: u64 = Capacity::ALL.iter().map(|&c| u64::from(floors.get(c)) * bytes_per_entry_on(c, 1)).sum();
        assert_eq!(worst_case_bytes(&floors), maps + FIXED_BYTES);
        assert!(size(None, &NONE, maps + FIXED_BYTES - 1).over_budget);
        let fits = size(None, &NONE, maps + FIXED_BYTES);
        assert!(!fits.over_budget, "{fits:?}");
        assert_eq!(fits.caps, floors);
    }

    /// The per-CPU topology counting arrays are charged per CPU: on a
    /// 64-CPU machine the same budget holds fewer Services slots, and the
    /// worst case stays within it.
    #[test]
    fn counting_arrays_are_charged_per_cpu() {
        let small = needs(300, 600, 600);
        let one = size_on(Some(small), &NONE, DEFAULT_BUDGET_MIB * MIB, 1);
        let many = size_on(Some(small), &NONE, DEFAULT_BUDGET_MIB * MIB, 64);
        assert!(many.caps.services < one.caps.services, "{one:?} vs {many:?}");
        assert!(many.worst_case_bytes <= DEFAULT_BUDGET_MIB * MIB, "{many:?}");
        assert_eq!(size(Some(small), &NONE, DEFAULT_BUDGET_MIB * MIB), one);
        assert_eq!(counting_bytes_per_service(2), 2 * (96 + 8));
    }
}
