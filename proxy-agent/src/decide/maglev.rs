//! Maglev lookup tables (Eisenbud et al., "Maglev: A Fast and Reliable
//! Software Network Load Balancer", NSDI 2016, section 3.4): a table of a
//! prime size M whose entries name backends, filled so that each backend
//! gets a share of the entries proportional to its weight, and so that a
//! change of the backend set moves only about the changed backends' share.
//!
//! A packet's flow hash modulo M picks the entry, so a flow keeps its
//! backend when any other backend comes or goes (the modulo pick moves
//! almost every flow when the count changes). The table depends only on
//! the backends' identities and weights, never on the order they are
//! listed in or on anything local to the node, so two agents with the same
//! backend set compute the same table: a flow whose packets reach another
//! node (ECMP rehash, node failover, conntrack entry evicted) lands on the
//! same backend without any shared state.
//!
//! Pure: no kube, aya or tokio.

use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

use crate::model::Backend;

/// The Service annotation that selects a frontend's table size.
pub const TABLE_SIZE_ANNOTATION: &str = "topoproxy.io/maglev-table-size";

/// Bytes of kernel memory per table entry (see [`TableSize::bytes`]).
pub const KERNEL_BYTES_PER_ENTRY: u64 = 8;

/// A Maglev table size: a prime, so that every skip in `1..M` is coprime
/// with M and each backend's permutation visits every entry (paper, 3.4).
/// Only two sizes are offered: M should be well above 100 × the number of
/// backends for the shares to stay within about 1 % of each other, and a
/// fixed pair keeps the datapath's table maps of uniform entry size.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum TableSize {
    /// 16,381 entries: 128 KiB of kernel memory per table; fine up to ~160 backends.
    #[default]
    Default,
    /// 65,521 entries: 512 KiB per table, for Services with hundreds of
    /// backends.
    Large,
}

impl TableSize {
    /// Both sizes, smallest first.
    pub const ALL: [TableSize; 2] = [TableSize::Default, TableSize::Large];

    /// M, the number of entries.
    pub const fn entries(self) -> u32 {
        match self {
            TableSize::Default => proxy_common::MAGLEV_SIZE_DEFAULT,
            TableSize::Large => proxy_common::MAGLEV_SIZE_LARGE,
        }
    }

    /// Kernel memory of one table's values: a BPF array lays its values
    /// out every `round_up(value_size, 8)` bytes (kernel/bpf/arraymap.c,
    /// `array_map_alloc`), so each 4-byte backend id takes 8.
    pub const fn bytes(self) -> u64 {
        self.entries() as u64 * KERNEL_BYTES_PER_ENTRY
    }
}

impl fmt::Display for TableSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.entries())
    }
}

/// A table size that is not one of the offered primes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid Maglev table size {value:?}: must be {} or {}", proxy_common::MAGLEV_SIZE_DEFAULT, proxy_common::MAGLEV_SIZE_LARGE)]
pub struct TableSizeError {
    /// The value given.
    pub value: String,
}

impl FromStr for TableSize {
    type Err = TableSizeError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || TableSizeError { value: s.to_owned() };
        let n: u32 = s.trim().parse().map_err(|_| bad())?;
        TableSize::ALL.into_iter().find(|t| t.entries() == n).ok_or_else(bad)
    }
}

/// The table size a Service's [`TABLE_SIZE_ANNOTATION`] asks for;
/// `Ok(None)` without the annotation (the agent's default applies).
pub fn annotated_size(annotations: &BTreeMap<String, String>) -> Result<Option<TableSize>, TableSizeError> {
    annotations.get(TABLE_SIZE_ANNOTATION).map(|v| v.parse()).transpose()
}

/// A backend and its weight: the entries it takes per round of the fill.
/// Weight 0 leaves the backend out of the table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Weighted {
    /// The backend.
    pub backend: Backend,
    /// Its weight (entries per round).
    pub weight: u32,
}

/// A filled table: entry `i` is an index into `backends`, the input set
/// sorted by identity (address, then port) with zero weights dropped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Table {
    /// The backends the entries index, sorted, without zero weights.
    pub backends: Vec<Backend>,
    /// M entries, each an index into `backends`.
    pub entries: Vec<u32>,
}

impl Table {
    /// The backend entry `i` names.
    pub fn backend_at(&self, i: usize) -> Option<Backend> {
        self.entries.get(i).and_then(|&b| self.backends.get(b as usize)).copied()
    }
}

/// The table for equally weighted `backends` (every Kubernetes endpoint
/// counts the same; topology has already chosen the set).
pub fn table(backends: &[Backend], size: TableSize) -> Table {
    let weighted: Vec<Weighted> = backends.iter().map(|&backend| Weighted { backend, weight: 1 }).collect();
    weighted_table(&weighted, size)
}

/// Fills a table of `size` entries from `backends`. Each backend walks its
/// own permutation of the entries, `offset, offset + skip, ...` modulo M,
/// both derived from a hash of its address and port; round by round, each
/// backend claims the next `weight` entries of its permutation that are
/// still free, until the table is full. An empty (or all-zero-weight) set
/// gives an empty table.
///
/// The same backend listed twice counts once, with the larger weight.
pub fn weighted_table(backends: &[Weighted], size: TableSize) -> Table {
    let mut set: Vec<Weighted> = backends.iter().copied().filter(|w| w.weight > 0).collect();
    // Identity order, so that the listing order never matters; the larger
    // weight of a duplicate comes last and survives the dedup.
    set.sort();
    set.dedup_by(|later, earlier| {
        if later.backend == earlier.backend {
            earlier.weight = later.weight;
            true
        } else {
            false
        }
    });
    let m = size.entries();
    if set.is_empty() {
        return Table { backends: Vec::new(), entries: Vec::new() };
    }
    // Weights only matter relative to each other; dividing by their gcd
    // keeps the rounds short, so no backend runs far ahead of the others'
    // permutations (which would cost the minimal-disruption property).
    let g = set.iter().fold(0, |g, w| gcd(g, w.weight));
    let turns: Vec<u32> = set.iter().map(|w| w.weight / g).collect();
    let mut cursor: Vec<(u32, u32)> = set
        .iter()
        .map(|w| {
            let id = identity(&w.backend);
            let offset = (hash64(&id, OFFSET_SEED) % u64::from(m)) as u32;
            let skip = (hash64(&id, SKIP_SEED) % u64::from(m - 1)) as u32 + 1;
            (offset, skip)
        })
        .collect();
    const FREE: u32 = u32::MAX;
    let mut entries = vec![FREE; m as usize];
    let mut filled = 0u32;
    'fill: loop {
        for (i, (pos, skip)) in cursor.iter_mut().enumerate() {
            for _ in 0..turns[i] {
                // M is prime and 0 < skip < M, so the walk visits every
                // entry within M steps: a free one is always found while
                // the table is not full.
                while entries[*pos as usize] != FREE {
                    *pos = next(*pos, *skip, m);
                }
                entries[*pos as usize] = i as u32;
                *pos = next(*pos, *skip, m);
                filled += 1;
                if filled == m {
                    break 'fill;
                }
            }
        }
    }
    Table { backends: set.into_iter().map(|w| w.backend).collect(), entries }
}

fn next(pos: u32, skip: u32, m: u32) -> u32 {
    // pos, skip < m <= 65521: the sum fits in u32.
    let n = pos + skip;
    if n >= m { n - m } else { n }
}

fn gcd(a: u32, b: u32) -> u32 {
    if b == 0 { a } else { gcd(b, a % b) }
}

const OFFSET_SEED: u64 = 0x6d61_676c_6576_6f66; // "maglevof"
const SKIP_SEED: u64 = 0x6d61_676c_6576_736b; // "maglevsk"

/// A backend's identity as bytes: the address in IPv6 form (IPv4 mapped,
/// so one address has one identity) and the port, big-endian.
fn identity(b: &Backend) -> [u8; 18] {
    let v6 = match b.ip {
        IpAddr::V4(a) => a.to_ipv6_mapped(),
        IpAddr::V6(a) => a,
    };
    let mut out = [0u8; 18];
    out[..16].copy_from_slice(&v6.octets());
    out[16..].copy_from_slice(&b.port.to_be_bytes());
    out
}

/// A hash fixed by this file, not by the standard library (whose
/// `DefaultHasher` may change between Rust releases): agents of different
/// versions on different nodes must compute the same tables. FNV-1a over
/// the bytes, then MurmurHash3's 64-bit finaliser so that every input bit
/// reaches every output bit.
fn hash64(bytes: &[u8], seed: u64) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325 ^ seed;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn be(i: u32) -> Backend {
        Backend { ip: IpAddr::from([10, 244, (i >> 8) as u8, i as u8]), port: 8080 }
    }

    /// A fixed flow sample: hashes as the datapath would see them.
    fn flows(n: u32) -> impl Iterator<Item = u32> {
        (0..n).map(|i| proxy_common::fmix32(i.wrapping_mul(0x9e37_79b9) ^ 0x5bd1_e995))
    }

    fn pick(t: &Table, hash: u32) -> Backend {
        t.backend_at((hash % t.entries.len() as u32) as usize).unwrap()
    }

    #[test]
    fn table_size_parses_only_the_offered_primes() {
        // (input, expected)
        let cases: [(&str, Option<TableSize>); 8] = [
            ("16381", Some(TableSize::Default)),
            ("65521", Some(TableSize::Large)),
            (" 65521 ", Some(TableSize::Large)),
            ("16384", None),
            ("65537", None),
            ("0", None),
            ("-1", None),
            ("big", None),
        ];
        for (input, want) in cases {
            assert_eq!(input.parse::<TableSize>().ok(), want, "{input:?}");
        }
        let err = "7".parse::<TableSize>().unwrap_err();
        assert_eq!(err.to_string(), "invalid Maglev table size \"7\": must be 16381 or 65521");
    }

    #[test]
    fn sizes_are_prime() {
        for t in TableSize::ALL {
            let m = t.entries();
            assert!((2..=m.isqrt()).all(|d| m % d != 0), "{m}");
        }
    }

    #[test]
    fn shapes() {
        struct Case {
            name: &'static str,
            backends: Vec<Weighted>,
            size: TableSize,
            /// Expected share of each listed backend, in per mille.
            shares: Vec<(Backend, u32)>,
        }
        let w = |i, weight| Weighted { backend: be(i), weight };
        let cases = vec![
            Case { name: "empty", backends: vec![], size: TableSize::Default, shares: vec![] },
            Case { name: "all weights zero", backends: vec![w(1, 0), w(2, 0)], size: TableSize::Default, shares: vec![] },
            Case { name: "one backend takes all", backends: vec![w(1, 1)], size: TableSize::Default, shares: vec![(be(1), 1000)] },
            Case {
                name: "equal weights",
                backends: (0..4).map(|i| w(i, 1)).collect(),
                size: TableSize::Default,
                shares: (0..4).map(|i| (be(i), 250)).collect(),
            },
            Case {
                name: "weights 1:3",
                backends: vec![w(1, 1), w(2, 3)],
                size: TableSize::Default,
                shares: vec![(be(1), 250), (be(2), 750)],
            },
            Case {
                name: "weights scale by their gcd",
                backends: vec![w(1, 100), w(2, 200), w(3, 100)],
                size: TableSize::Large,
                shares: vec![(be(1), 250), (be(2), 500), (be(3), 250)],
            },
            Case {
                name: "zero weight is left out",
                backends: vec![w(1, 1), w(2, 0), w(3, 1)],
                size: TableSize::Default,
                shares: vec![(be(1), 500), (be(3), 500)],
            },
            Case {
                name: "a duplicate counts once, with the larger weight",
                backends: vec![w(1, 1), w(2, 1), w(2, 3)],
                size: TableSize::Default,
                shares: vec![(be(1), 250), (be(2), 750)],
            },
        ];
        for c in cases {
            let t = weighted_table(&c.backends, c.size);
            if c.shares.is_empty() {
                assert!(t.entries.is_empty() && t.backends.is_empty(), "{}", c.name);
                continue;
            }
            assert_eq!(t.entries.len(), c.size.entries() as usize, "{}", c.name);
            let mut count: BTreeMap<Backend, u32> = BTreeMap::new();
            for i in 0..t.entries.len() {
                *count.entry(t.backend_at(i).unwrap()).or_default() += 1;
            }
            assert_eq!(count.len(), c.shares.len(), "{}: {count:?}", c.name);
            for (b, per_mille) in c.shares {
                let got = u64::from(count[&b]) * 1000 / u64::from(c.size.entries());
                // Maglev's fill gives each backend its share within about
                // one round of entries.
                assert!(got.abs_diff(u64::from(per_mille)) <= 2, "{}: {b} has {got}‰, want {per_mille}‰", c.name);
            }
        }
    }

    #[test]
    fn same_input_in_any_order_gives_the_same_table() {
        let forward: Vec<Backend> = (0..10).map(be).collect();
        let mut shuffled = forward.clone();
        shuffled.reverse();
        shuffled.swap(2, 7);
        let mixed: Vec<Backend> =
            vec![be(1), Backend { ip: "fd00::1".parse().unwrap(), port: 80 }, be(2), Backend { ip: "fd00::2".parse().unwrap(), port: 80 }];
        let mut mixed_rev = mixed.clone();
        mixed_rev.reverse();
        for size in TableSize::ALL {
            assert_eq!(table(&forward, size), table(&shuffled, size), "{size}");
            assert_eq!(table(&mixed, size), table(&mixed_rev, size), "{size}");
        }
        // Pinned: a change of the hash or the fill would make agents of two
        // versions disagree during a rolling upgrade.
        let t = table(&forward, TableSize::Default);
        let head: Vec<u32> = t.entries[..8].to_vec();
        assert_eq!(head, PINNED_HEAD, "the table's first entries changed: the hash or the fill is no longer the same");
    }

    const PINNED_HEAD: [u32; 8] = [2, 3, 3, 3, 7, 7, 0, 5];

    #[test]
    fn removing_one_of_ten_moves_about_a_tenth() {
        for size in TableSize::ALL {
            let all: Vec<Backend> = (0..10).map(be).collect();
            let before = table(&all, size);
            for gone in [0, 4, 9] {
                let rest: Vec<Backend> = all.iter().copied().filter(|b| *b != be(gone)).collect();
                let after = table(&rest, size);
                let sample = 100_000;
                let (mut moved, mut moved_elsewhere) = (0u32, 0u32);
                for h in flows(sample) {
                    let (a, b) = (pick(&before, h), pick(&after, h));
                    if a != b {
                        moved += 1;
                        if a != be(gone) {
                            moved_elsewhere += 1;
                        }
                    }
                }
                // At most 1/10 + 2 % of the flows change backend ...
                assert!(moved <= sample / 10 + sample / 50, "{size}: removing {gone} moved {moved} of {sample}");
                // ... and nearly all that do had the removed backend.
                assert!(moved_elsewhere <= sample / 50, "{size}: {moved_elsewhere} flows of remaining backends moved");
            }
        }
    }

    #[test]
    fn adding_one_to_nine_moves_about_a_tenth() {
        let nine: Vec<Backend> = (0..9).map(be).collect();
        let ten: Vec<Backend> = (0..10).map(be).collect();
        let (before, after) = (table(&nine, TableSize::Default), table(&ten, TableSize::Default));
        let sample = 100_000;
        let moved = flows(sample).filter(|&h| pick(&before, h) != pick(&after, h)).count() as u32;
        assert!(moved <= sample / 10 + sample / 50, "adding one moved {moved} of {sample}");
    }
}
