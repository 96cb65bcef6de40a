//! The tiers graded spill-over ([`super::spill`]) runs over, for each model
//! it applies to, and the outcome for a Service port. Pure.
//!
//! * Topology keys (`spec.topologyKeys`, `topoproxy.io/topology-keys`):
//!   one tier per key, in the keys' order, each the endpoints whose Node
//!   shares the key's label value with this node and that no earlier key
//!   took (the tiers are disjoint: a node-local endpoint belongs to the
//!   hostname tier, not again to the zone's). A key this node lacks gives
//!   no tier, as `FilterTopologyEndpoint` skips it; `*` is the endpoints
//!   no earlier key took. An endpoint no key matches is in no tier and
//!   never used.
//! * `trafficDistribution: PreferSameNode | PreferSameZone` (and its older
//!   name PreferClose) when the EndpointSlice hints decided: the endpoints
//!   hinted for this node (when the hints carry node hints), then those hinted for
//!   this node's zone, then every other endpoint, which kube-proxy's
//!   fallback would use too. The tiers are the control plane's hints, not
//!   derived from zone labels.
//!
//! Each address family is graded on its own: a dual-stack Service's IPv4
//! and IPv6 frontends reach only backends of their own family, and their
//! slices (one per address type) may be at different points of a rollout.

use super::hints::hinted_for;
use super::spill::{self, Factor, Health};
use super::spill_slots;
use super::{TOPOLOGY_KEY_ANY, View};
use crate::model::Family;

/// A tier: its name for `explain` and the metrics, and every endpoint the
/// slices list in it (indices into the view's endpoints), in any state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Tier {
    pub name: String,
    pub members: Vec<usize>,
}

/// One tier of one family as the rule graded it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TierShare {
    /// The tier (`topology.kubernetes.io/zone=zone-a`, `*`, `node n1`,
    /// `zone zone-a`, `other`).
    pub name: String,
    /// Its family, when the port has endpoints of both.
    pub family: Option<Family>,
    /// Ready endpoints.
    pub ready: usize,
    /// Endpoints the slices list in it.
    pub total: usize,
    /// Its share of new connections, in millionths.
    pub share_ppm: u32,
}

impl TierShare {
    /// Its health: ready endpoints over those listed (0 with none listed),
    /// as the rule graded it.
    pub fn health(&self) -> f64 {
        Health { ready: self.ready, total: self.total }.fraction()
    }
}

/// The outcome of graded spill-over for a Service port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Spill {
    pub factor: Factor,
    pub tiers: Vec<TierShare>,
    /// The endpoints (indices) to use with their slot counts; only the
    /// families whose connections spread over more than one tier have
    /// entries here (a family kept in one tier is programmed as without
    /// spill: one slot per backend).
    pub weights: Vec<(usize, u32)>,
    /// Every endpoint that takes new connections, of every family.
    pub selected: Vec<usize>,
    /// Whether some family spreads over more than one tier.
    pub spreads: bool,
}

/// The tiers of a topology key list.
pub(super) fn by_keys(view: &View<'_>, keys: &[String]) -> Vec<Tier> {
    let mut taken = vec![false; view.endpoints.len()];
    let mut out = Vec::new();
    for key in keys {
        let value = if key == TOPOLOGY_KEY_ANY {
            None
        } else {
            match view.node_label(key) {
                Some(v) => Some(v),
                None => continue,
            }
        };
        let members: Vec<usize> = view
            .endpoints
            .iter()
            .enumerate()
            .filter(|(i, e)| !taken[*i] && value.is_none_or(|v| view.endpoint_label(e, key) == Some(v)))
            .map(|(i, _)| i)
            .collect();
        for i in &members {
            taken[*i] = true;
        }
        let name = match value {
            None => TOPOLOGY_KEY_ANY.to_string(),
            Some(v) => format!("{key}={v}"),
        };
        out.push(Tier { name, members });
    }
    out
}

/// The tiers of a `trafficDistribution` whose hints decided: this node's
/// hint first when the hints carry node hints (`by_node`, kube-proxy's
/// PreferSameNode category in pkg/proxy/topology.go), then this zone's, then
/// the rest. The hints decide, not the field, as for kube-proxy.
pub(super) fn by_hints(view: &View<'_>, by_node: bool) -> Vec<Tier> {
    let mut taken = vec![false; view.endpoints.len()];
    let mut out = Vec::new();
    let mut take = |name: String, f: &dyn Fn(&crate::model::Endpoint) -> bool, out: &mut Vec<Tier>| {
        let members: Vec<usize> = view.endpoints.iter().enumerate().filter(|(i, e)| !taken[*i] && f(e)).map(|(i, _)| i).collect();
        for i in &members {
            taken[*i] = true;
        }
        out.push(Tier { name, members });
    };
    if by_node {
        take(format!("node {}", view.node_name), &|e| hinted_for(e.hint_nodes(), view.node_name), &mut out);
    }
    if let Some(z) = view.zone() {
        take(format!("zone {z}"), &|e| hinted_for(e.hint_zones(), z), &mut out);
    }
    take("other".to_string(), &|_| true, &mut out);
    out
}

/// Grades `tiers` with `factor`, family by family. `Ok(None)` when no tier
/// has a ready endpoint (the strict ranking's terminating fallback then
/// applies); `Err` when the slots would be too many
/// ([`spill_slots::MAX_SPILL_SLOTS`]).
pub(super) fn grade(view: &View<'_>, tiers: &[Tier], factor: Factor) -> Result<Option<Spill>, String> {
    let fam = |i: usize| view.endpoints.get(i).map(|e| Family::of(&e.address));
    let families: Vec<Family> =
        [Family::V4, Family::V6].into_iter().filter(|f| tiers.iter().any(|t| t.members.iter().any(|i| fam(*i) == Some(*f)))).collect();
    let dual = families.len() > 1;
    let mut out = Spill { factor, tiers: Vec::new(), weights: Vec::new(), selected: Vec::new(), spreads: false };
    let mut any_ready = false;
    for f in families {
        let of_family: Vec<(String, Vec<usize>, Vec<usize>)> = tiers
            .iter()
            .map(|t| {
                let members: Vec<usize> = t.members.iter().copied().filter(|i| fam(*i) == Some(f)).collect();
                let ready: Vec<usize> = members.iter().copied().filter(|i| view.endpoints.get(*i).is_some_and(|e| e.ready)).collect();
                (t.name.clone(), members, ready)
            })
            .collect();
        let health: Vec<Health> = of_family.iter().map(|(_, m, r)| Health { ready: r.len(), total: m.len() }).collect();
        let shares = spill::shares(&health, factor);
        let slot_input: Vec<(f64, Vec<usize>)> = shares.iter().zip(&of_family).map(|(s, (_, _, r))| (*s, r.clone())).collect();
        let slots = spill_slots::slots(&slot_input)?;
        any_ready |= health.iter().any(|h| h.ready > 0);
        let tiers_used = shares.iter().zip(&of_family).filter(|(s, (_, _, r))| **s > 0.0 && !r.is_empty()).count();
        for ((name, _, _), (h, s)) in of_family.iter().zip(health.iter().zip(&shares)) {
            out.tiers.push(TierShare {
                name: name.clone(),
                family: dual.then_some(f),
                ready: h.ready,
                total: h.total,
                share_ppm: (s * 1_000_000.0).round() as u32,
            });
        }
        out.selected.extend(slots.iter().map(|(i, _)| *i));
        if tiers_used > 1 {
            out.spreads = true;
            out.weights.extend(slots);
        }
    }
    if !any_ready {
        return Ok(None);
    }
    out.selected.sort_unstable();
    out.weights.sort_unstable();
    Ok(Some(out))
}

impl Spill {
    /// The shares for the decision text: `spill 1.4: zone=a 2/4 ready 70%, * 4/4 ready 30%`.
    pub(super) fn describe(&self) -> String {
        let tiers: Vec<String> = self
            .tiers
            .iter()
            .map(|t| {
                let fam = t.family.map_or(String::new(), |f| format!("{} ", f.as_str()));
                format!("{fam}{} {}/{} ready {}", t.name, t.ready, t.total, percent(t.share_ppm))
            })
            .collect();
        format!("spill {}: {}", self.factor, tiers.join(", "))
    }
}

/// Millionths as a percentage with up to one decimal.
pub(crate) fn percent(ppm: u32) -> String {
    let tenths = (ppm + 500) / 1000;
    if tenths.is_multiple_of(10) { format!("{}%", tenths / 10) } else { format!("{}.{}%", tenths / 10, tenths % 10) }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::net::{IpAddr, Ipv6Addr};

    use super::super::spill::ANNOTATION_TOPOLOGY_SPILL;
    use super::super::test_support::{EpExt, SvcExt, ep, node, svc};
    use super::super::{LABEL_HOSTNAME, LABEL_ZONE, Model, NodeContext, Ranking, rank};
    use super::*;
    use crate::model::{Endpoint, Node, Service};

    const KEYS: &str = "topoproxy.io/topology-keys";
    const REGION: &str = "topology.kubernetes.io/region";

    /// n1 and n2 in zone za, n3 in zone zb, all in region r1; n4 in region r2.
    fn nodes() -> BTreeMap<String, Node> {
        [("n1", "za", "r1"), ("n2", "za", "r1"), ("n3", "zb", "r1"), ("n4", "zc", "r2")]
            .iter()
            .map(|(n, z, r)| node(n, &[(LABEL_HOSTNAME, n), (LABEL_ZONE, z), (REGION, r)]))
            .map(|n| (n.name.clone(), n))
            .collect()
    }

    fn ranked(s: &Service, eps: &[Endpoint]) -> Ranking {
        let nodes = nodes();
        let refs: Vec<&Endpoint> = eps.iter().collect();
        rank(s, &refs, NodeContext { name: "n1", nodes: &nodes })
    }

    /// Each tier's (name, ready, total, share in percent).
    fn shares_of(r: &Ranking) -> Vec<(String, usize, usize, f64)> {
        r.spill
            .as_ref()
            .map_or(Vec::new(), |s| s.tiers.iter().map(|t| (t.name.clone(), t.ready, t.total, f64::from(t.share_ppm) / 10_000.0)).collect())
    }

    fn v6(mut e: Endpoint) -> Endpoint {
        if let IpAddr::V4(a) = e.address {
            e.address = IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, u16::from(a.octets()[3])));
        }
        e
    }

    /// Four endpoints in za (n1, n2), then four in zb (n3).
    fn zoned(ready_in_za: usize) -> Vec<Endpoint> {
        let mut v: Vec<Endpoint> = (0..4u8)
            .map(|i| {
                let e = ep(i + 1, if i % 2 == 0 { "n1" } else { "n2" }).zone("za");
                if usize::from(i) < ready_in_za { e } else { e.unready() }
            })
            .collect();
        v.extend((0..4u8).map(|i| ep(i + 11, "n3").zone("zb")));
        v
    }

    fn zone_then_any(factor: &str) -> Service {
        svc().ann(KEYS, "topology.kubernetes.io/zone, *").ann(ANNOTATION_TOPOLOGY_SPILL, factor)
    }

    #[test]
    fn the_keys_tiers_share_new_connections_by_health() {
        let za = "topology.kubernetes.io/zone=za";
        // (name, Service, endpoints, want shares, want cluster)
        type Row = (&'static str, Service, Vec<Endpoint>, Vec<(&'static str, usize, usize, f64)>, Vec<usize>);
        let cases: Vec<Row> = vec![
            ("full health: all in the zone", zone_then_any("1.4"), zoned(4), vec![(za, 4, 4, 100.0), ("*", 4, 4, 0.0)], vec![0, 1, 2, 3]),
            (
                "rolling update, 3 of 4 ready, factor 1.4: still whole",
                zone_then_any("1.4"),
                zoned(3),
                vec![(za, 3, 4, 100.0), ("*", 4, 4, 0.0)],
                vec![0, 1, 2],
            ),
            (
                "rolling update, 3 of 4 ready, factor 1.0",
                zone_then_any("1.0"),
                zoned(3),
                vec![(za, 3, 4, 75.0), ("*", 4, 4, 25.0)],
                vec![0, 1, 2, 4, 5, 6, 7],
            ),
            (
                "rolling update, 2 of 4 ready, factor 1.4",
                zone_then_any("1.4"),
                zoned(2),
                vec![(za, 2, 4, 70.0), ("*", 4, 4, 30.0)],
                vec![0, 1, 4, 5, 6, 7],
            ),
            ("the zone empty: all to `*`", zone_then_any("1.4"), zoned(0), vec![(za, 0, 4, 0.0), ("*", 4, 4, 100.0)], vec![4, 5, 6, 7]),
            (
                "no `*`: what the zone cannot take stays in it",
                svc().keys(&[LABEL_ZONE]).ann(ANNOTATION_TOPOLOGY_SPILL, "1.4"),
                zoned(1),
                vec![(za, 1, 4, 100.0)],
                vec![0],
            ),
            (
                "three tiers: node, zone, region; never outside the region",
                svc().keys(&[LABEL_HOSTNAME, LABEL_ZONE, REGION]).ann(ANNOTATION_TOPOLOGY_SPILL, "1.4"),
                vec![
                    ep(1, "n1").zone("za"),
                    ep(2, "n1").zone("za").unready(),
                    ep(3, "n1").zone("za").term(),
                    ep(4, "n2").zone("za"),
                    ep(5, "n2").zone("za").unready(),
                    ep(6, "n3").zone("zb"),
                    ep(7, "n4").zone("zc"),
                ],
                vec![("kubernetes.io/hostname=n1", 1, 3, 46.6667), (za, 1, 2, 53.3333), ("topology.kubernetes.io/region=r1", 1, 1, 0.0)],
                vec![0, 3],
            ),
        ];
        for (name, s, eps, want, cluster) in cases {
            let r = ranked(&s, &eps);
            assert_eq!(r.model, Model::TopologyKeys, "{name}");
            assert!(r.problems.is_empty(), "{name}: {:?}", r.problems);
            let got = shares_of(&r);
            assert_eq!(got.len(), want.len(), "{name}: {got:?}");
            for (g, w) in got.iter().zip(&want) {
                assert_eq!((g.0.as_str(), g.1, g.2), (w.0, w.1, w.2), "{name}");
                assert!((g.3 - w.3).abs() < 0.001, "{name}: {got:?}");
            }
            assert_eq!(r.cluster, cluster, "{name}: {}", r.decision);
            assert!(r.decision.contains("spill "), "{name}: {}", r.decision);
        }
    }

    #[test]
    fn the_slots_carry_the_shares_and_a_kept_tier_is_unweighted() {
        let r = ranked(&zone_then_any("1.4"), &zoned(2));
        let s = r.spill.as_ref().unwrap();
        assert!(s.spreads);
        assert_eq!(r.tier, None, "spread: each backend counts in its own tier");
        // 70 % over 2 ready, 30 % over 4.
        assert_eq!(s.weights, vec![(0, 350), (1, 350), (4, 75), (5, 75), (6, 75), (7, 75)]);
        let r = ranked(&zone_then_any("1.4"), &zoned(4));
        let s = r.spill.as_ref().unwrap();
        assert!(!s.spreads && s.weights.is_empty(), "one tier: one slot each, as without spill");
        assert_eq!(r.tier, Some(proxy_common::tier::ZONE));
    }

    #[test]
    fn without_the_annotation_or_with_a_bad_one_the_tiers_stay_strict() {
        let strict = ranked(&svc().ann(KEYS, "topology.kubernetes.io/zone, *"), &zoned(1));
        assert_eq!(strict.cluster, vec![0]);
        assert!(strict.spill.is_none());
        for bad in ["0.5", "lots", "101"] {
            let r = ranked(&zone_then_any(bad), &zoned(1));
            assert!(r.spill.is_none(), "{bad}");
            assert_eq!(r.cluster, strict.cluster, "{bad}");
            assert_eq!(r.problems.len(), 1, "{bad}");
            assert!(r.problems[0].starts_with("annotation topoproxy.io/topology-spill: "), "{:?}", r.problems);
            assert!(r.problems[0].ends_with("; the tiers stay strict"), "{:?}", r.problems);
        }
        // OpenYurt stays strict, and says so.
        let yurt = svc().ann("openyurt.io/topologyKeys", "kubernetes.io/hostname").ann(ANNOTATION_TOPOLOGY_SPILL, "1.4");
        let r = ranked(&yurt, &[ep(1, "n1").unready(), ep(2, "n1"), ep(3, "n3")]);
        assert_eq!((r.model, r.cluster.clone(), r.spill.is_none()), (Model::OpenYurt, vec![1], true));
        assert!(r.problems[0].contains("stays strict"), "{:?}", r.problems);
        assert!(!r.problems[0].contains("topologyKeys"), "the key list is fine: {:?}", r.problems);
        // No tiers to grade: a note, no problem.
        let r = ranked(&svc().ann(ANNOTATION_TOPOLOGY_SPILL, "1.4"), &zoned(2));
        assert!(r.problems.is_empty() && r.spill.is_none());
        assert!(r.decision.contains("spill not applied"), "{}", r.decision);
        // No ready endpoint anywhere: the strict terminating fallback.
        let r = ranked(&zone_then_any("1.4"), &[ep(1, "n1").zone("za").term(), ep(2, "n3").zone("zb").term()]);
        assert!(r.spill.is_none());
        assert_eq!(r.cluster, vec![0]);
    }

    #[test]
    fn dual_stack_families_are_graded_apart() {
        // IPv4: 2 of 4 ready in the zone; IPv6: all 4.
        let mut eps = zoned(2);
        eps.extend(zoned(4).into_iter().map(v6));
        let r = ranked(&zone_then_any("1.4"), &eps);
        let s = r.spill.as_ref().unwrap();
        let of = |f: Family| -> Vec<u32> { s.tiers.iter().filter(|t| t.family == Some(f)).map(|t| t.share_ppm).collect() };
        assert_eq!(of(Family::V4), vec![700_000, 300_000]);
        assert_eq!(of(Family::V6), vec![1_000_000, 0]);
        // Only the IPv4 family is weighted; IPv6 keeps one slot each.
        assert!(s.weights.iter().all(|(i, _)| *i < 8), "{:?}", s.weights);
        assert_eq!(r.cluster, vec![0, 1, 4, 5, 6, 7, 8, 9, 10, 11]);
        assert!(r.decision.contains("IPv6 topology.kubernetes.io/zone=za 4/4 ready 100%"), "{}", r.decision);
    }

    #[test]
    fn traffic_distribution_tiers_are_the_hints() {
        let nodes = nodes();
        // PreferSameNode: node hints for n1 on two endpoints (one not ready),
        // zone hints for za; an unhinted endpoint of zb is "other".
        let eps = vec![
            ep(1, "n1").zone("za").nh(&["n1"]).zh(&["za"]),
            ep(2, "n1").zone("za").nh(&["n1"]).zh(&["za"]).unready(),
            ep(3, "n2").zone("za").nh(&["n2"]).zh(&["za"]),
            ep(4, "n3").zone("zb").nh(&["n3"]).zh(&["zb"]),
        ];
        let refs: Vec<&Endpoint> = eps.iter().collect();
        let s = svc().td("PreferSameNode").ann(ANNOTATION_TOPOLOGY_SPILL, "1.0");
        let r = rank(&s, &refs, NodeContext { name: "n1", nodes: &nodes });
        assert_eq!(r.model, Model::HintsNode, "{}", r.decision);
        let got: Vec<(String, u32)> = r.spill.as_ref().unwrap().tiers.iter().map(|t| (t.name.clone(), t.share_ppm)).collect();
        assert_eq!(got, vec![("node n1".to_string(), 500_000), ("zone za".to_string(), 500_000), ("other".to_string(), 0)]);
        assert_eq!(r.cluster, vec![0, 2]);
        // PreferSameZone: zone then other.
        let s = svc().td("PreferSameZone").ann(ANNOTATION_TOPOLOGY_SPILL, "1.4");
        let eps: Vec<Endpoint> = eps
            .into_iter()
            .map(|mut e| {
                e.edit_extra(|x| x.hint_nodes = None);
                e
            })
            .collect();
        let refs: Vec<&Endpoint> = eps.iter().collect();
        let r = rank(&s, &refs, NodeContext { name: "n1", nodes: &nodes });
        assert_eq!(r.model, Model::HintsZone, "{}", r.decision);
        let got: Vec<(String, usize, usize)> = r.spill.as_ref().unwrap().tiers.iter().map(|t| (t.name.clone(), t.ready, t.total)).collect();
        assert_eq!(got, vec![("zone za".to_string(), 2, 3), ("other".to_string(), 1, 1)]);
        assert_eq!(r.spill.as_ref().unwrap().tiers[0].share_ppm, 933_333);
    }
}
