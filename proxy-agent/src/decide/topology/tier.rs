//! Topology tiers (issue #34): how near this node each programmed backend
//! is, so that the datapath counts every Service's connections by tier and
//! an operator sees how much traffic topology kept near. Pure, like the
//! rest of `topology`.
//!
//! Two answers, both as `proxy_common::tier` codes:
//!
//! * [`physical`]: where an endpoint runs relative to this node, the first
//!   domain they share in the order node, zone, region, OpenYurt node pool
//!   (else `other`). It goes with the backend's address
//!   (`BackendValue::tier`), which every frontend shares.
//! * [`chosen`]: the domain a Service's topology chose its backends by,
//!   when it chose them by one: a topology key (`kubernetes.io/hostname`
//!   node, `topology.kubernetes.io/zone` zone, `.../region` region,
//!   `apps.openyurt.io/nodepool` pool), OpenYurt's node or node pool, node
//!   or zone hints, a Local traffic policy's node. Every connection of such a frontend counts in that
//!   tier (`ServiceValue` flags): a pool-keyed Service's backend that
//!   happens to run on this node was chosen for its pool. Without topology,
//!   or when it fell through to `*`, each backend's physical tier counts.
//!
//! An endpoint's zone comes from its EndpointSlice; its region and pool
//! from its Node's labels, which the agent knows for this node always and
//! for other Nodes only while some Service's topology reads them
//! (`other_node_labels`), or from a v1beta1 slice's `topology` map. A
//! domain that is not known counts as not shared.

use std::collections::HashMap;
use std::net::IpAddr;

use proxy_common::{SHARE_ONE, tier};

use super::openyurt::{LABEL_OPENYURT_NODEPOOL, YurtTopology};
use super::{Constraint, LABEL_HOSTNAME, LABEL_ZONE, Model, TOPOLOGY_KEY_ANY, View, usable};
use crate::model::{Cluster, Endpoint, EndpointSlice};

/// The node label carrying the region (`v1.LabelTopologyRegion`).
pub(crate) const LABEL_REGION: &str = "topology.kubernetes.io/region";

/// Whether `ep` shares the domain of tier `t` with this node.
fn shares(view: &View<'_>, ep: &Endpoint, t: u8) -> bool {
    let same = |key: &str| view.node_label(key).filter(|v| !v.is_empty()).is_some_and(|mine| view.endpoint_label(ep, key) == Some(mine));
    match t {
        tier::NODE => view.is_local(ep),
        tier::ZONE => view.zone().is_some_and(|z| view.endpoint_zone(ep) == Some(z)),
        tier::REGION => same(LABEL_REGION),
        tier::POOL => same(LABEL_OPENYURT_NODEPOOL),
        _ => false,
    }
}

/// The narrowest domain `ep` shares with this node: node, zone, region,
/// node pool, in that order; else `other`.
pub(super) fn physical(view: &View<'_>, ep: &Endpoint) -> u8 {
    [tier::NODE, tier::ZONE, tier::REGION, tier::POOL].into_iter().find(|t| shares(view, ep, *t)).unwrap_or(tier::OTHER)
}

/// The tier of a topology key, for the keys that name one of the domains.
fn tier_of_key(key: &str) -> Option<u8> {
    match key {
        LABEL_HOSTNAME => Some(tier::NODE),
        LABEL_ZONE => Some(tier::ZONE),
        LABEL_REGION => Some(tier::REGION),
        LABEL_OPENYURT_NODEPOOL => Some(tier::POOL),
        _ => None,
    }
}

/// The domain the Service's topology chose `selected` (indices into the
/// view's endpoints) by, when it chose by one; `None`: each backend counts
/// in its [`physical`] tier. The first domain of the Service's own list
/// that every selected endpoint shares with this node is the one that
/// matched (a ranking takes the first key with any match, so an earlier
/// key shares with none of them); `*`, or a label that is no domain,
/// ends the search.
pub(super) fn chosen(view: &View<'_>, model: Model, constraint: Option<&Constraint>, selected: &[usize]) -> Option<u8> {
    if selected.is_empty() {
        return None;
    }
    let all_share = |t: u8| selected.iter().filter_map(|&i| view.endpoints.get(i)).all(|e| shares(view, e, t));
    match (model, constraint) {
        (Model::HintsNode, _) => Some(tier::NODE),
        (Model::HintsZone, _) => Some(tier::ZONE),
        (Model::TopologyKeys, Some(Constraint::Keys { keys, .. })) => {
            for key in keys {
                if key == TOPOLOGY_KEY_ANY {
                    return None;
                }
                let t = tier_of_key(key)?;
                if all_share(t) {
                    return Some(t);
                }
            }
            None
        }
        (Model::OpenYurt, Some(Constraint::OpenYurt(yurt))) => {
            yurt_tier(yurt, view.node_label(LABEL_OPENYURT_NODEPOOL).is_some_and(|p| !p.is_empty()), all_share)
        }
        _ => None,
    }
}

fn yurt_tier(yurt: &YurtTopology, in_pool: bool, all_share: impl Fn(u8) -> bool) -> Option<u8> {
    let (node, pool) = yurt.domains();
    if node && all_share(tier::NODE) {
        return Some(tier::NODE);
    }
    if pool {
        // A node in no pool falls back to node topology (`rank_openyurt`);
        // in a pool, the pool chose even the endpoints on this node.
        let t = if in_pool { tier::POOL } else { tier::NODE };
        return all_share(t).then_some(t);
    }
    None
}

/// The share of a Service port's serving endpoints that lie outside this
/// node's zone, in `SHARE_ONE`ths: what a pick blind to topology (every
/// usable endpoint, kube-proxy's rule without topology) would send out of
/// the zone per connection. An endpoint on this node, or in this node's
/// zone, is inside; one whose zone is not known, or any endpoint when this
/// node has no zone, is outside. No usable endpoint: 0.
pub(super) fn blind_remote_share(view: &View<'_>) -> u32 {
    let u = usable(view.all(), |_| true);
    let outside = u
        .indices
        .iter()
        .filter_map(|&i| view.endpoints.get(i))
        .filter(|e| !view.is_local(e) && view.zone().is_none_or(|z| view.endpoint_zone(e) != Some(z)))
        .count();
    share_fp(outside, u.indices.len())
}

/// `part / whole` in `SHARE_ONE`ths, rounded to the nearest; 0 of nothing.
pub(crate) fn share_fp(part: usize, whole: usize) -> u32 {
    if whole == 0 {
        return 0;
    }
    let one = u64::from(SHARE_ONE);
    let v = (part.min(whole) as u64 * one + whole as u64 / 2) / whole as u64;
    v.min(one) as u32
}

/// The physical tier of every endpoint address this node may send to,
/// kept between syncs: the backend maps carry it with each address
/// (`BackendValue::tier`). Only tiers other than `other` are stored (most
/// endpoints of a large cluster are in no domain this node shares).
#[derive(Debug, Default)]
pub struct EndpointTiers {
    node: String,
    of: HashMap<IpAddr, u8>,
    /// Bumped whenever the tier of an address already in the table (or
    /// removed from it) changed; the writers then look at their backends
    /// again.
    version: u64,
    changed: Vec<IpAddr>,
}

impl EndpointTiers {
    pub fn new(node: &str) -> EndpointTiers {
        EndpointTiers { node: node.to_string(), ..EndpointTiers::default() }
    }

    /// The tier of a backend at `ip`.
    pub fn tier(&self, ip: &IpAddr) -> u8 {
        self.of.get(ip).copied().unwrap_or(tier::OTHER)
    }

    /// Changes on every update that moved an address already known.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// The addresses whose tier the last version change moved.
    pub fn changed(&self) -> &[IpAddr] {
        &self.changed
    }

    /// Follows the model: every slice again when `all` (the first sync, a
    /// Node's labels changed), else the slices in `slices`. An address in
    /// no slice any more keeps its entry until the next full update (it
    /// costs a few bytes, and a backend is only written for an address in
    /// some slice).
    pub fn update<'a>(&mut self, cluster: &Cluster, all: bool, slices: impl IntoIterator<Item = &'a crate::model::ObjectRef>) {
        let ctx = super::NodeContext { name: &self.node, nodes: &cluster.nodes };
        let mut changed = Vec::new();
        let tier_of = |s: &EndpointSlice, out: &mut dyn FnMut(IpAddr, u8)| {
            let eps: Vec<&Endpoint> = s.endpoints.iter().collect();
            let view = View::new(&eps, ctx);
            for e in &eps {
                out(e.address, physical(&view, e));
            }
        };
        if all {
            let mut fresh = HashMap::with_capacity(self.of.len());
            for s in cluster.slices.values() {
                tier_of(s, &mut |ip, t| {
                    if t != tier::OTHER {
                        fresh.insert(ip, t);
                    }
                });
            }
            for (ip, t) in &self.of {
                if fresh.get(ip) != Some(t) {
                    changed.push(*ip);
                }
            }
            changed.extend(fresh.keys().filter(|ip| !self.of.contains_key(*ip)).copied());
            self.of = fresh;
        } else {
            let of = &mut self.of;
            for id in slices {
                let Some(s) = cluster.slices.get(id) else { continue };
                tier_of(s, &mut |ip, t| {
                    let before = if t == tier::OTHER { of.remove(&ip) } else { of.insert(ip, t) };
                    if before.unwrap_or(tier::OTHER) != t {
                        changed.push(ip);
                    }
                });
            }
        }
        if !changed.is_empty() {
            self.version += 1;
            self.changed = changed;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::super::test_support::{EpExt, SvcExt, ep, node, svc};
    use super::super::{NodeContext, rank};
    use super::*;
    use crate::model::Node;

    const POOL: &str = LABEL_OPENYURT_NODEPOOL;

    /// The demo's three nodes: node-1 zone-a pool hangzhou, node-2 zone-b
    /// pool hangzhou, node-3 zone-b pool shanghai, all in region-1; and
    /// node-4 in another region and no pool.
    fn nodes() -> BTreeMap<String, Node> {
        [
            node("node-1", &[(LABEL_HOSTNAME, "node-1"), (LABEL_ZONE, "zone-a"), (LABEL_REGION, "region-1"), (POOL, "hangzhou")]),
            node("node-2", &[(LABEL_HOSTNAME, "node-2"), (LABEL_ZONE, "zone-b"), (LABEL_REGION, "region-1"), (POOL, "hangzhou")]),
            node("node-3", &[(LABEL_HOSTNAME, "node-3"), (LABEL_ZONE, "zone-b"), (LABEL_REGION, "region-1"), (POOL, "shanghai")]),
            node("node-4", &[(LABEL_HOSTNAME, "node-4"), (LABEL_ZONE, "zone-c"), (LABEL_REGION, "region-2")]),
        ]
        .into_iter()
        .map(|n| (n.name.clone(), n))
        .collect()
    }

    fn eps() -> Vec<Endpoint> {
        vec![
            ep(0, "node-1").zone("zone-a"),
            ep(1, "node-2").zone("zone-b"),
            ep(2, "node-3").zone("zone-b"),
            ep(3, "node-4").zone("zone-c"),
            ep(4, "node-9"), // a Node nobody knows, no zone
        ]
    }

    #[test]
    fn physical_tiers_are_the_first_shared_domain() {
        let nodes = nodes();
        let eps = eps();
        let refs: Vec<&Endpoint> = eps.iter().collect();
        use tier::{NODE, OTHER, POOL as P, REGION, ZONE};
        // (this node, tiers of endpoints 0..5)
        let cases = [
            ("node-1", [NODE, REGION, REGION, OTHER, OTHER]),
            ("node-2", [REGION, NODE, ZONE, OTHER, OTHER]),
            ("node-3", [REGION, ZONE, NODE, OTHER, OTHER]),
            ("node-4", [OTHER, OTHER, OTHER, NODE, OTHER]),
            // A node the agent does not know has no labels: only its own
            // endpoints are near.
            ("node-9", [OTHER, OTHER, OTHER, OTHER, NODE]),
        ];
        for (me, want) in cases {
            let view = View::new(&refs, NodeContext { name: me, nodes: &nodes });
            let got: Vec<u8> = refs.iter().map(|e| physical(&view, e)).collect();
            assert_eq!(got, want, "from {me}");
        }
        // Pools count when the regions say nothing: drop the region labels.
        let mut no_region = nodes.clone();
        for n in no_region.values_mut() {
            n.labels.remove(LABEL_REGION);
        }
        let view = View::new(&refs, NodeContext { name: "node-1", nodes: &no_region });
        assert_eq!(physical(&view, refs[1]), tier::POOL, "node-2 shares node-1's pool");
        assert_eq!(physical(&view, refs[2]), tier::OTHER);
        let _ = P;
    }

    /// The tier every connection of a frontend counts in: (name, Service,
    /// this node, want). Endpoints as in [`eps`] (all ready).
    #[test]
    fn the_chosen_tier_is_the_domain_the_topology_matched() {
        const YURT: &str = "openyurt.io/topologyKeys";
        const KEYS: &str = "topoproxy.io/topology-keys";
        let nodes = nodes();
        let eps = eps();
        let refs: Vec<&Endpoint> = eps.iter().collect();
        let cases: Vec<(&str, crate::model::Service, &str, Option<u8>)> = vec![
            ("no topology: each backend's own", svc(), "node-1", None),
            (
                "OpenYurt pool, from node-1 (its own endpoint is chosen for the pool)",
                svc().ann(YURT, "openyurt.io/nodepool"),
                "node-1",
                Some(tier::POOL),
            ),
            (
                "OpenYurt pool, from node-3 (alone in its pool, on this node: still the pool's)",
                svc().ann(YURT, "openyurt.io/nodepool"),
                "node-3",
                Some(tier::POOL),
            ),
            ("OpenYurt pool, from node-4 (in no pool: node topology)", svc().ann(YURT, "openyurt.io/nodepool"), "node-4", Some(tier::NODE)),
            ("OpenYurt node", svc().ann(YURT, "kubernetes.io/hostname"), "node-2", Some(tier::NODE)),
            ("zone then anywhere, from node-2", svc().ann(KEYS, "topology.kubernetes.io/zone, *"), "node-2", Some(tier::ZONE)),
            (
                "zone then anywhere, from node-4 (alone in zone-c)",
                svc().ann(KEYS, "topology.kubernetes.io/zone, *"),
                "node-4",
                Some(tier::ZONE),
            ),
            (
                "zone then anywhere, from node-9 (no zone): fell through to *",
                svc().ann(KEYS, "topology.kubernetes.io/zone, *"),
                "node-9",
                None,
            ),
            ("hostname, zone, region", svc().keys(&[LABEL_HOSTNAME, LABEL_ZONE, LABEL_REGION]), "node-1", Some(tier::NODE)),
            ("region only", svc().keys(&[LABEL_REGION]), "node-1", Some(tier::REGION)),
            ("a custom label is no domain", svc().ann(KEYS, "example.com/rack, *"), "node-1", None),
            ("trafficDistribution PreferClose, no hints: not filtered", svc().td("PreferClose"), "node-2", None),
        ];
        for (name, s, me, want) in cases {
            let r = rank(&s, &refs, NodeContext { name: me, nodes: &nodes });
            assert_eq!(r.tier, want, "{name}: {}", r.decision);
        }
    }

    #[test]
    fn blind_remote_shares_are_fixed_point_fractions() {
        // (part, whole, want)
        let cases = [(0, 0, 0), (0, 4, 0), (1, 4, SHARE_ONE / 4), (4, 4, SHARE_ONE), (1, 3, 21_845), (2, 3, 43_691), (5, 4, SHARE_ONE)];
        for (part, whole, want) in cases {
            assert_eq!(share_fp(part, whole), want, "{part}/{whole}");
        }
        let nodes = nodes();
        let eps = eps();
        let refs: Vec<&Endpoint> = eps.iter().collect();
        // (this node, endpoints outside its zone of 5)
        for (me, outside) in [("node-1", 4), ("node-2", 3), ("node-9", 4)] {
            let r = rank(&svc(), &refs, NodeContext { name: me, nodes: &nodes });
            assert_eq!(r.blind_remote_share, share_fp(outside, 5), "{me}");
        }
        // Only usable endpoints count: the unready ones in other zones do not.
        let some_unready = [ep(0, "node-1").zone("zone-a"), ep(1, "node-2").zone("zone-b").unready()];
        let refs: Vec<&Endpoint> = some_unready.iter().collect();
        let r = rank(&svc(), &refs, NodeContext { name: "node-1", nodes: &nodes });
        assert_eq!(r.blind_remote_share, 0);
    }

    #[test]
    fn the_endpoint_table_follows_slices_and_reports_moved_addresses() {
        let yaml = |node_of_b: &str| {
            format!(
                "apiVersion: v1\nkind: Node\nmetadata: {{name: node-1, labels: {{topology.kubernetes.io/zone: zone-a}}}}\n---\n\
                 apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: s, labels: {{kubernetes.io/service-name: web}}}}\n\
                 addressType: IPv4\nports: [{{port: 80}}]\nendpoints:\n\
                 - addresses: [10.0.0.1]\n  nodeName: node-1\n\
                 - addresses: [10.0.0.2]\n  nodeName: {node_of_b}\n  zone: zone-a\n\
                 - addresses: [10.0.0.3]\n  nodeName: node-3\n  zone: zone-b\n"
            )
        };
        let ip = |s: &str| -> IpAddr { s.parse().unwrap() };
        let (c, e) = crate::source::manifest_watch::cluster_from_text(&yaml("node-2"));
        assert!(e.is_empty(), "{e:?}");
        let mut t = EndpointTiers::new("node-1");
        t.update(&c, true, []);
        assert_eq!([t.tier(&ip("10.0.0.1")), t.tier(&ip("10.0.0.2")), t.tier(&ip("10.0.0.3"))], [tier::NODE, tier::ZONE, tier::OTHER]);
        let v = t.version();
        // The same slice again: nothing moved.
        let slices: Vec<crate::model::ObjectRef> = c.slices.keys().cloned().collect();
        t.update(&c, false, &slices);
        assert_eq!(t.version(), v);
        // 10.0.0.2 moves onto this node.
        let (c, _) = crate::source::manifest_watch::cluster_from_text(&yaml("node-1"));
        t.update(&c, false, &slices);
        assert_eq!(t.version(), v + 1);
        assert_eq!(t.changed(), &[ip("10.0.0.2")]);
        assert_eq!(t.tier(&ip("10.0.0.2")), tier::NODE);
        // A full update with nothing moved changes nothing.
        t.update(&c, true, []);
        assert_eq!(t.version(), v + 1);
    }
}
