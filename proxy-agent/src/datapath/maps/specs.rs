//! Every map the eBPF object pins, in one table: its name (from
//! proxy-common), the datapath whose programs use it, the kernel type and
//! key/value sizes a pinned copy must have, and the capacity flag that sizes
//! it. The loaders pin and size the maps from this table, `install` checks
//! adopted pins against it, `reset` removes what it lists, and the map
//! writer and `dump` name their maps and flags through it.

use std::mem::size_of;

use Datapath::{Socket, Tc};
use aya::maps::MapType;
use aya::maps::lpm_trie::Key;
use proxy_common as pc;
use proxy_common::{
    AddrKey, AffinityMatchKey, AffinityMatchValue, AffinityValue, BackendKey, BackendValue, CtKey, CtValue, MaglevKey, NodeNetns,
    NpAffinityKey, NpConfig, NpFlagsValue, ServiceKey, ServiceValue, SlotKey, SlotValue, SockAffinityKey, SockConfig, SockPeerValue,
    SockRecValue, SockRevNatKey, SockRevNatValue, SourceRangeKey, SvcConnValue, SvcTopoValue,
};

/// Which programs use a map.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Datapath {
    /// The cgroup socket programs (connect, sendmsg, recvmsg, getpeername).
    Socket,
    /// The TC programs for external traffic (NodePort, LoadBalancer IPs,
    /// externalIPs).
    Tc,
}

impl Datapath {
    /// How `dump` names the datapath (part of its JSON output).
    pub const fn label(self) -> &'static str {
        match self {
            Datapath::Socket => "socket",
            Datapath::Tc => "tc",
        }
    }
}

/// A capacity the agent sets: a field of [`Capacities`] and the flag that
/// sets it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Capacity {
    /// `--max-services`: frontends (and the per-frontend maps sized like them).
    Services,
    /// `--max-slots`: backend slots over every frontend and generation.
    Slots,
    /// `--max-backends`: distinct backend addresses.
    Backends,
    /// `--max-sock-revnat`: sockets remembered for reverse translation.
    SockRevNat,
    /// `--max-np-conntrack`: flows the TC datapath tracks.
    NpConntrack,
    /// `--max-affinity`: clients remembered for session affinity.
    Affinity,
}

impl Capacity {
    /// Every capacity (`map_migration::pinned_datapath_capacities` reports them in this order).
    pub const ALL: [Capacity; 6] =
        [Capacity::Services, Capacity::Slots, Capacity::Backends, Capacity::SockRevNat, Capacity::NpConntrack, Capacity::Affinity];

    /// The `proxy-agent run` flag, for messages that tell how to raise it.
    pub const fn flag(self) -> &'static str {
        match self {
            Capacity::Services => "--max-services",
            Capacity::Slots => "--max-slots",
            Capacity::Backends => "--max-backends",
            Capacity::SockRevNat => "--max-sock-revnat",
            Capacity::NpConntrack => "--max-np-conntrack",
            Capacity::Affinity => "--max-affinity",
        }
    }
}

/// Map capacities (`max_entries`). They apply when a map is created; a
/// pinned map of another capacity is migrated at start-up (see
/// `map_migration`). `sizing` picks the ones no flag sets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capacities {
    /// `SERVICES`, `NP_SERVICES` and the maps sized like them.
    pub services: u32,
    /// `SLOTS`, `NP_SLOTS` and the affinity match maps.
    pub slots: u32,
    /// `BACKENDS` and `NP_BACKENDS`.
    pub backends: u32,
    /// `SOCK_REVNAT` and `SOCK_REC`.
    pub sock_revnat: u32,
    /// `NP_CT`, the TC datapath's connection tracking (LRU).
    pub np_conntrack: u32,
    /// `AFFINITY` and `NP_AFFINITY`, the clients remembered for session
    /// affinity (LRU, each datapath its own).
    pub affinity: u32,
}

impl Default for Capacities {
    fn default() -> Self {
        Capacities {
            services: pc::DEFAULT_MAX_SERVICES,
            slots: pc::DEFAULT_MAX_SLOTS,
            backends: pc::DEFAULT_MAX_BACKENDS,
            sock_revnat: pc::DEFAULT_MAX_SOCK_REVNAT,
            np_conntrack: pc::DEFAULT_MAX_NP_CT,
            affinity: pc::DEFAULT_MAX_AFFINITY,
        }
    }
}

impl Capacities {
    /// The capacity `c` names.
    pub fn get(&self, c: Capacity) -> u32 {
        match c {
            Capacity::Services => self.services,
            Capacity::Slots => self.slots,
            Capacity::Backends => self.backends,
            Capacity::SockRevNat => self.sock_revnat,
            Capacity::NpConntrack => self.np_conntrack,
            Capacity::Affinity => self.affinity,
        }
    }
}

/// The capacities each datapath's maps are created with. Both follow the
/// same [`Capacities`], but for the TC datapath's maps when no TC program
/// runs (`--devices none`): nothing writes them then, so they keep the size
/// they are pinned with, or take their floor (`sizing::idle_tc`), rather
/// than cost the kernel memory and the creation time of full-size
/// preallocated maps (NP_SLOTS, NP_BACKENDS, NP_CT, NP_SVC_CONN: about
/// 230 MB and 0.2 s at 100k Services x 10 endpoints). A later start with
/// devices migrates them to the full size like any capacity change.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapSizes {
    /// The socket programs' maps.
    pub socket: Capacities,
    /// The TC programs' maps.
    pub tc: Capacities,
}

impl MapSizes {
    /// The capacity `spec` is created with; `None` for a map no capacity
    /// sizes.
    pub fn of(&self, spec: &MapSpec) -> Option<u32> {
        let caps = match spec.datapath {
            Socket => &self.socket,
            Tc => &self.tc,
        };
        spec.capacity.map(|c| caps.get(c))
    }
}

impl From<Capacities> for MapSizes {
    /// Both datapaths at `caps`.
    fn from(caps: Capacities) -> MapSizes {
        MapSizes { socket: caps, tc: caps }
    }
}

/// One pinned map, as this agent expects to find it.
#[derive(Debug)]
pub struct MapSpec {
    /// The name in the object file and of the pin under the pin directory.
    pub name: &'static str,
    /// Which programs use it.
    pub datapath: Datapath,
    /// The kernel map type a pinned copy must have.
    pub map_type: MapType,
    /// Key size in bytes.
    pub key_size: usize,
    /// Per element; per CPU for the per-CPU types.
    pub value_size: usize,
    /// What sizes the map; `None` keeps the object's `max_entries`.
    pub capacity: Option<Capacity>,
}

impl MapSpec {
    const fn new<K, V>(name: &'static str, datapath: Datapath, map_type: MapType, capacity: Option<Capacity>) -> MapSpec {
        MapSpec { name, datapath, map_type, key_size: size_of::<K>(), value_size: size_of::<V>(), capacity }
    }

    /// The flag that sizes the map; empty when none does.
    pub fn flag(&self) -> &'static str {
        self.capacity.map_or("", Capacity::flag)
    }
}

/// The socket datapath's frontends: (address, port, protocol) to service entry.
pub static SERVICES: MapSpec = MapSpec::new::<ServiceKey, ServiceValue>(pc::SERVICES_MAP, Socket, MapType::Hash, Some(Capacity::Services));
/// The socket datapath's backend slots per service id and generation.
pub static SLOTS: MapSpec = MapSpec::new::<SlotKey, SlotValue>(pc::SLOTS_MAP, Socket, MapType::Hash, Some(Capacity::Slots));
/// The socket datapath's backend addresses by id.
pub static BACKENDS: MapSpec = MapSpec::new::<BackendKey, BackendValue>(pc::BACKENDS_MAP, Socket, MapType::Hash, Some(Capacity::Backends));
/// A socket's reverse translations beyond its first (LRU): what getpeername/recvmsg rewrite back to
/// the frontend.
pub static SOCK_REVNAT: MapSpec =
    MapSpec::new::<SockRevNatKey, SockRevNatValue>(pc::SOCK_REVNAT_MAP, Socket, MapType::LruHash, Some(Capacity::SockRevNat));
/// The connect hooks' per-socket record, keyed by cookie (see
/// `SockRecValue`). Preallocated, so it costs its capacity's memory from
/// creation; `--max-sock-revnat` sizes it with `SOCK_REVNAT` (both count
/// sockets remembered for the reverse path), and `sizing` charges both.
pub static SOCK_REC: MapSpec = MapSpec::new::<u64, SockRecValue>(pc::SOCK_REC_MAP, Socket, MapType::Hash, Some(Capacity::SockRevNat));
/// How many `SOCK_REC` records each slot of cookies holds
/// (`proxy_common::SOCK_REC_COUNT_SLOTS`): 512 KiB, fixed size. Not
/// resized with `SOCK_REC`, so a migration of that map keeps it.
pub static SOCK_REC_COUNT: MapSpec = MapSpec::new::<u32, u64>(pc::SOCK_REC_COUNT_MAP, Socket, MapType::Array, None);
/// The socket programs' per-CPU counters by reason (`proxy_common::counter`).
pub static COUNTERS: MapSpec = MapSpec::new::<u32, u64>(pc::COUNTERS_MAP, Socket, MapType::PerCpuArray, None);
/// Socket-local storage: its elements live on the sockets, so the pinned
/// map must survive restarts for sockets opened before one to keep their
/// reverse translation. The kernel requires max_entries 0 for it, and its
/// key is a socket descriptor (an int).
pub static SOCK_PEER: MapSpec = MapSpec::new::<i32, SockPeerValue>(pc::SOCK_PEER_MAP, Socket, MapType::SkStorage, None);
/// The socket programs' settings (one element).
pub static SOCK_CONFIG: MapSpec = MapSpec::new::<u32, SockConfig>(pc::SOCK_CONFIG_MAP, Socket, MapType::Array, None);
/// The agent's own network namespace cookie (one element): the node's own sockets for source-range
/// checks.
pub static NODE_NETNS: MapSpec = MapSpec::new::<u32, NodeNetns>(pc::NODE_NETNS_MAP, Socket, MapType::Array, None);
/// The socket datapath's session affinity entries: the backend each client took (LRU).
pub static AFFINITY: MapSpec =
    MapSpec::new::<SockAffinityKey, AffinityValue>(pc::AFFINITY_MAP, Socket, MapType::LruHash, Some(Capacity::Affinity));
/// Not preallocated (entries only for affine frontends); bounded like the
/// slots it mirrors.
pub static AFFINITY_MATCH: MapSpec =
    MapSpec::new::<AffinityMatchKey, AffinityMatchValue>(pc::AFFINITY_MATCH_MAP, Socket, MapType::Hash, Some(Capacity::Slots));
/// LPM trie (never preallocated): a few ranges per LoadBalancer frontend at
/// most, bounded like the frontends.
pub static SOURCE_RANGES: MapSpec =
    MapSpec::new::<Key<SourceRangeKey>, u32>(pc::SOURCE_RANGES_MAP, Socket, MapType::LpmTrie, Some(Capacity::Services));

// The TC datapath's copies of the service maps follow the socket ones'
// capacities. NP_SLOTS and NP_BACKENDS are preallocated, so unused
// capacity costs memory (see `sizing`); the frontend maps are not.
/// The TC datapath's frontends: NodePorts, LoadBalancer and external IPs.
pub static NP_SERVICES: MapSpec =
    MapSpec::new::<ServiceKey, ServiceValue>(pc::NP_SERVICES_MAP, Tc, MapType::Hash, Some(Capacity::Services));
/// The TC datapath's backend slots.
pub static NP_SLOTS: MapSpec = MapSpec::new::<SlotKey, SlotValue>(pc::NP_SLOTS_MAP, Tc, MapType::Hash, Some(Capacity::Slots));
/// The TC datapath's backend addresses.
pub static NP_BACKENDS: MapSpec =
    MapSpec::new::<BackendKey, BackendValue>(pc::NP_BACKENDS_MAP, Tc, MapType::Hash, Some(Capacity::Backends));
/// The TC datapath's per-frontend flags (externalTrafficPolicy: Local, ...).
pub static NP_FLAGS: MapSpec = MapSpec::new::<ServiceKey, NpFlagsValue>(pc::NP_FLAGS_MAP, Tc, MapType::Hash, Some(Capacity::Services));
/// Endpoint addresses on this node: their flows need no SNAT.
pub static NP_LOCAL: MapSpec = MapSpec::new::<AddrKey, u32>(pc::NP_LOCAL_MAP, Tc, MapType::Hash, None);
/// Devices a local backend's packet may be handed to with
/// `bpf_redirect_peer` (`external::peer_devices` writes it); fixed size.
pub static NP_PEER_DEVS: MapSpec = MapSpec::new::<u32, u32>(pc::NP_PEER_DEVS_MAP, Tc, MapType::Hash, None);
/// The TC datapath's connection tracking (LRU): carries every flow to its backend and back.
pub static NP_CT: MapSpec = MapSpec::new::<CtKey, CtValue>(pc::NP_CT_MAP, Tc, MapType::LruHash, Some(Capacity::NpConntrack));
/// The TC programs' settings: SNAT addresses and port range (one element).
pub static NP_CONFIG: MapSpec = MapSpec::new::<u32, NpConfig>(pc::NP_CONFIG_MAP, Tc, MapType::Array, None);
/// The TC programs' per-CPU counters by reason (`proxy_common::np_counter`).
pub static NP_COUNTERS: MapSpec = MapSpec::new::<u32, u64>(pc::NP_COUNTERS_MAP, Tc, MapType::PerCpuArray, None);
/// The TC fast path's counters (`proxy_common::np_fast_counter`): an own
/// array, so that `NP_COUNTERS` keeps the size older agents pinned.
pub static NP_FAST_COUNTERS: MapSpec = MapSpec::new::<u32, u64>(pc::NP_FAST_COUNTERS_MAP, Tc, MapType::PerCpuArray, None);
/// The TC datapath's session affinity entries (LRU), keyed by client address.
pub static NP_AFFINITY: MapSpec =
    MapSpec::new::<NpAffinityKey, AffinityValue>(pc::NP_AFFINITY_MAP, Tc, MapType::LruHash, Some(Capacity::Affinity));
/// The TC datapath's affine frontends' backends, as `AFFINITY_MATCH`.
pub static NP_AFFINITY_MATCH: MapSpec =
    MapSpec::new::<AffinityMatchKey, AffinityMatchValue>(pc::NP_AFFINITY_MATCH_MAP, Tc, MapType::Hash, Some(Capacity::Slots));
/// The TC datapath's `loadBalancerSourceRanges`, as `SOURCE_RANGES`.
pub static NP_SOURCE_RANGES: MapSpec =
    MapSpec::new::<Key<SourceRangeKey>, u32>(pc::NP_SOURCE_RANGES_MAP, Tc, MapType::LpmTrie, Some(Capacity::Services));
/// Maglev tables: (service id, generation) to an inner array of backend
/// ids (the value is the inner map's fd on update, its id on lookup). Only
/// the outer map is pinned; the inner arrays live as long as it links them,
/// so a restarted agent finds every frontend's table through it.
pub static NP_MAGLEV: MapSpec = MapSpec::new::<MaglevKey, u32>(pc::NP_MAGLEV_MAP, Tc, MapType::HashOfMaps, Some(Capacity::Services));
/// The socket datapath's Maglev tables (UDP frontends), as `NP_MAGLEV`.
pub static SOCK_MAGLEV: MapSpec =
    MapSpec::new::<MaglevKey, u32>(pc::SOCK_MAGLEV_MAP, Socket, MapType::HashOfMaps, Some(Capacity::Services));

/// Connections per frontend and topology tier (issue #34), indexed by
/// service id less one: per-CPU, sized like `SERVICES` (the writers hand
/// out ids up to that capacity). A capacity change carries the counts over
/// (`map_migration`).
pub static SVC_CONN: MapSpec = MapSpec::new::<u32, SvcConnValue>(pc::SVC_CONN_MAP, Socket, MapType::PerCpuArray, Some(Capacity::Services));
/// The blind-remote share the socket programs add per counted connection,
/// written by the agent per frontend.
pub static SVC_TOPO: MapSpec = MapSpec::new::<u32, SvcTopoValue>(pc::SVC_TOPO_MAP, Socket, MapType::Array, Some(Capacity::Services));
/// The TC datapath's `SVC_CONN` and `SVC_TOPO`, by its own service ids.
pub static NP_SVC_CONN: MapSpec =
    MapSpec::new::<u32, SvcConnValue>(pc::NP_SVC_CONN_MAP, Tc, MapType::PerCpuArray, Some(Capacity::Services));
/// The TC datapath's `SVC_TOPO`.
pub static NP_SVC_TOPO: MapSpec = MapSpec::new::<u32, SvcTopoValue>(pc::NP_SVC_TOPO_MAP, Tc, MapType::Array, Some(Capacity::Services));

/// The TC programs' port bitmap (see `port_bits`): 16 KiB, fixed size.
pub static NP_PORTS: MapSpec = MapSpec::new::<u32, u64>(pc::NP_PORTS_MAP, Tc, MapType::Array, None);
/// The socket programs' port bitmap (see `port_bits`): 8 KiB, fixed size.
pub static SOCK_PORTS: MapSpec = MapSpec::new::<u32, u64>(pc::SOCK_PORTS_MAP, Socket, MapType::Array, None);

/// Every pinned map. Maps of the object that are not listed (per-CPU
/// scratch space) are private to each load.
pub static MAPS: [&MapSpec; 34] = [
    &SERVICES,
    &SLOTS,
    &BACKENDS,
    &SOCK_REVNAT,
    &SOCK_REC,
    &SOCK_REC_COUNT,
    &COUNTERS,
    &SOCK_PEER,
    &SOCK_CONFIG,
    &NODE_NETNS,
    &AFFINITY,
    &AFFINITY_MATCH,
    &SOURCE_RANGES,
    &NP_SERVICES,
    &NP_SLOTS,
    &NP_BACKENDS,
    &NP_FLAGS,
    &NP_LOCAL,
    &NP_PEER_DEVS,
    &NP_CT,
    &NP_CONFIG,
    &NP_COUNTERS,
    &NP_FAST_COUNTERS,
    &NP_AFFINITY,
    &NP_AFFINITY_MATCH,
    &NP_SOURCE_RANGES,
    &NP_MAGLEV,
    &SOCK_MAGLEV,
    &NP_PORTS,
    &SOCK_PORTS,
    &SVC_CONN,
    &SVC_TOPO,
    &NP_SVC_CONN,
    &NP_SVC_TOPO,
];

/// The maps that hold one datapath's services: frontend to service entry,
/// slots of each generation, backend addresses, and what a frontend needs
/// besides its backends (session affinity, source ranges). Both datapaths
/// lay them out alike, so one map writer and one consistency check serve
/// both.
#[derive(Debug)]
pub struct ServiceMaps {
    /// Frontend to service entry.
    pub services: &'static MapSpec,
    /// Slots of each generation.
    pub slots: &'static MapSpec,
    /// Backend addresses.
    pub backends: &'static MapSpec,
    /// The clients' affinity entries (the programs write them; the agent
    /// deletes those of frontends that drop affinity or go away).
    pub affinity: &'static MapSpec,
    /// The backends of each affine frontend's generation, with its timeout.
    pub affinity_match: &'static MapSpec,
    /// `loadBalancerSourceRanges` per frontend.
    pub source_ranges: &'static MapSpec,
    /// The per-frontend topology counts and the agent's share per
    /// frontend (`SvcConnValue`, `SvcTopoValue`).
    pub conn: &'static MapSpec,
    /// The agent's blind-remote share per frontend (`SvcTopoValue`).
    pub topo: &'static MapSpec,
}

impl ServiceMaps {
    /// The datapath whose maps these are.
    pub fn datapath(&self) -> Datapath {
        self.services.datapath
    }
}

/// The socket programs' service maps.
pub static SOCKET_SERVICE_MAPS: ServiceMaps = ServiceMaps {
    services: &SERVICES,
    slots: &SLOTS,
    backends: &BACKENDS,
    affinity: &AFFINITY,
    affinity_match: &AFFINITY_MATCH,
    source_ranges: &SOURCE_RANGES,
    conn: &SVC_CONN,
    topo: &SVC_TOPO,
};
/// The TC programs' service maps.
pub static TC_SERVICE_MAPS: ServiceMaps = ServiceMaps {
    services: &NP_SERVICES,
    slots: &NP_SLOTS,
    backends: &NP_BACKENDS,
    affinity: &NP_AFFINITY,
    affinity_match: &NP_AFFINITY_MATCH,
    source_ranges: &NP_SOURCE_RANGES,
    conn: &NP_SVC_CONN,
    topo: &NP_SVC_TOPO,
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_map_is_listed_once_under_its_own_name() {
        let mut names: Vec<&str> = MAPS.iter().map(|m| m.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), MAPS.len());
        for name in [
            pc::SERVICES_MAP,
            pc::SLOTS_MAP,
            pc::BACKENDS_MAP,
            pc::SOCK_REVNAT_MAP,
            pc::COUNTERS_MAP,
            pc::SOCK_PEER_MAP,
            pc::SOCK_CONFIG_MAP,
            pc::NP_SERVICES_MAP,
            pc::NP_SLOTS_MAP,
            pc::NP_BACKENDS_MAP,
            pc::NP_FLAGS_MAP,
            pc::NP_LOCAL_MAP,
            pc::NP_PEER_DEVS_MAP,
            pc::NP_CT_MAP,
            pc::NP_CONFIG_MAP,
            pc::NP_COUNTERS_MAP,
            pc::NP_FAST_COUNTERS_MAP,
            pc::NODE_NETNS_MAP,
            pc::AFFINITY_MAP,
            pc::AFFINITY_MATCH_MAP,
            pc::SOURCE_RANGES_MAP,
            pc::NP_AFFINITY_MAP,
            pc::NP_AFFINITY_MATCH_MAP,
            pc::NP_SOURCE_RANGES_MAP,
            pc::NP_MAGLEV_MAP,
            pc::SOCK_MAGLEV_MAP,
            pc::NP_PORTS_MAP,
            pc::SOCK_PORTS_MAP,
            pc::SVC_CONN_MAP,
            pc::SVC_TOPO_MAP,
            pc::NP_SVC_CONN_MAP,
            pc::NP_SVC_TOPO_MAP,
        ] {
            assert!(names.contains(&name), "{name} is not in MAPS");
        }
    }

    #[test]
    fn both_service_map_sets_have_one_layout_and_a_flag_each() {
        for set in [&SOCKET_SERVICE_MAPS, &TC_SERVICE_MAPS] {
            // The affinity maps key clients differently (network namespace
            // at the socket layer, source address at TC).
            assert_eq!((set.affinity.map_type, set.affinity.value_size, set.affinity.flag()), (MapType::LruHash, 16, "--max-affinity"));
            for (m, reference) in [
                (set.services, &SERVICES),
                (set.slots, &SLOTS),
                (set.backends, &BACKENDS),
                (set.affinity_match, &AFFINITY_MATCH),
                (set.source_ranges, &SOURCE_RANGES),
                (set.conn, &SVC_CONN),
                (set.topo, &SVC_TOPO),
            ] {
                assert_eq!(
                    (m.map_type, m.key_size, m.value_size),
                    (reference.map_type, reference.key_size, reference.value_size),
                    "{}",
                    m.name
                );
                assert_eq!(m.datapath, set.datapath(), "{}", m.name);
                assert_eq!(m.flag(), reference.flag(), "{}", m.name);
            }
        }
        assert_eq!(SLOTS.flag(), "--max-slots");
        assert_eq!(COUNTERS.flag(), "");
        assert_eq!(NP_AFFINITY.flag(), "--max-affinity");
    }
}
