//! Graded spill-over between topology tiers (issue #48), opt-in per
//! Service with [`ANNOTATION_TOPOLOGY_SPILL`]. Pure: the rule and its
//! parse; [`super::spill_slots`] turns the shares into backend slots and
//! [`super::spill_tiers`] finds the tiers of each model.
//!
//! Without it a topology tier is all or nothing, as in kube-proxy: while the
//! nearest tier has one ready endpoint, every new connection from this node
//! goes there, and during a rolling update the tier's last pods take its
//! whole load (KEP-2004's review, kubernetes/enhancements#3642).
//!
//! # The rule
//!
//! The tiers come in the Service's order (its topology keys, or the hints'
//! node, zone, everything). A tier's *health* is its ready endpoints over
//! all the endpoints the slices list for it (ready, not ready,
//! terminating): a pod that is starting or leaving counts against its
//! tier. With the factor `f`, each tier's *capacity* is `min(1, health ×
//! f)`, and in order each tier takes `min(what is left, its capacity)` of
//! the new connections. A tier without a ready endpoint takes nothing.
//!
//! The model is Envoy's priority load (envoyproxy.io, "Priority levels",
//! intro/arch_overview/upstream/load_balancing/priority; the code is
//! `LoadBalancerBase::recalculatePerPriorityState` and `distributeLoad`,
//! source/extensions/load_balancing_policies/common/load_balancer_impl.cc,
//! formerly under source/common/upstream/): a priority level's health
//! score is its healthy percentage times the overprovisioning factor
//! (default 1.4), capped at 100, and each level takes up to its score of
//! what the levels before it left. Where ours differs:
//!
//! * **What no tier can take** (every tier's capacity together is below 1):
//!   Envoy normalises, every level's load is scaled by the total health so
//!   that the loads add up to 100 %, which moves traffic away from the
//!   nearest level. Here that rest stays where it was before any spill: in
//!   the first tier with a ready endpoint, which strict topology would
//!   have given everything. Spill only moves what a farther tier can
//!   absorb.
//! * **No panic mode.** Envoy spreads over every host, healthy or not, once
//!   total health falls below its panic threshold (50 %). A Kubernetes
//!   endpoint that is not ready is not sent traffic by anyone (kube-proxy,
//!   `CategorizeEndpoints`), so neither do we; the terminating fallback of
//!   the strict ranking (KEP-1669) applies unchanged when no tier has a
//!   ready endpoint.
//! * **Exact shares, not integer percents**: Envoy computes in integer
//!   percent; the shares here are exact and the datapath carries them to a
//!   thousandth of the connections ([`super::spill_slots`]).
//! * **Nothing outside the keys.** The tiers are the Service's own keys: an
//!   endpoint that matches none of them is never used (`*` only where the
//!   keys say `*`), as with the keys alone.
//!
//! A factor of 1.0 spills as soon as the first tier loses a pod; 1.4 keeps
//! a tier whole until fewer than 1/1.4 ≈ 71.4 % of its endpoints are
//! ready. A tier at full health keeps everything whatever the factor, so a
//! healthy Service is programmed exactly as without the annotation.

use std::fmt;

/// The Service annotation: the overprovisioning factor, a decimal in
/// [`Factor::MIN`]..=[`Factor::MAX`] (e.g. `"1.4"`). Absent: strict tiers.
pub(crate) const ANNOTATION_TOPOLOGY_SPILL: &str = "topoproxy.io/topology-spill";

/// An overprovisioning factor, in thousandths (1.4 is 1400).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct Factor(u32);

impl Factor {
    /// 1.0: a tier keeps exactly its healthy fraction.
    pub(crate) const MIN: Factor = Factor(1000);
    /// 100: a tier with one ready endpoint in a hundred keeps everything.
    pub(crate) const MAX: Factor = Factor(100_000);

    /// The factor as a number.
    pub(crate) fn get(self) -> f64 {
        f64::from(self.0) / 1000.0
    }

    /// Parses the annotation's value: digits, optionally a point and up to
    /// three more digits, surrounding whitespace ignored.
    pub(crate) fn parse(raw: &str) -> Result<Factor, String> {
        let v = raw.trim();
        let (int, frac) = v.split_once('.').unwrap_or((v, ""));
        let digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
        if int.is_empty() || !digits(int) || !digits(frac) || (v.contains('.') && frac.is_empty()) {
            return Err(format!("{raw:?} is not a decimal number such as \"1.4\""));
        }
        if frac.len() > 3 {
            return Err(format!("{raw:?} has more than three decimals"));
        }
        let int: u32 = int.parse().map_err(|_| format!("{raw:?} is out of range: must be from 1.0 to 100"))?;
        let frac: u32 = format!("{frac:0<3}").parse().unwrap_or(0);
        let milli = int.checked_mul(1000).and_then(|m| m.checked_add(frac));
        match milli {
            Some(m) if (Factor::MIN.0..=Factor::MAX.0).contains(&m) => Ok(Factor(m)),
            _ => Err(format!("{raw:?} is out of range: must be from 1.0 to 100")),
        }
    }
}

impl fmt::Display for Factor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (int, frac) = (self.0 / 1000, self.0 % 1000);
        if frac == 0 {
            return write!(f, "{int}.0");
        }
        let s = format!("{frac:03}");
        write!(f, "{int}.{}", s.trim_end_matches('0'))
    }
}

/// The Service's spill factor: `Ok(None)` without the annotation, `Err`
/// with the reason when its value is not a valid factor (the caller reports
/// it and keeps the tiers strict).
pub(crate) fn annotated(annotations: &std::collections::BTreeMap<String, String>) -> Result<Option<Factor>, String> {
    annotations.get(ANNOTATION_TOPOLOGY_SPILL).map(|v| Factor::parse(v)).transpose()
}

/// One tier as the rule sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Health {
    /// Its ready endpoints.
    pub ready: usize,
    /// All its endpoints the slices list (ready, not ready, terminating).
    pub total: usize,
}

impl Health {
    /// Ready over listed; 0 for a tier the slices list nothing in.
    pub(crate) fn fraction(self) -> f64 {
        if self.total == 0 { 0.0 } else { self.ready.min(self.total) as f64 / self.total as f64 }
    }
}

/// The share of new connections each tier takes, in the tiers' order
/// (see the module documentation). The shares add up to 1 when some tier
/// has a ready endpoint, else they are all 0.
pub(crate) fn shares(tiers: &[Health], factor: Factor) -> Vec<f64> {
    let mut out = vec![0.0; tiers.len()];
    let mut left = 1.0f64;
    for (share, t) in out.iter_mut().zip(tiers) {
        if t.ready == 0 {
            continue;
        }
        let capacity = (t.fraction() * factor.get()).min(1.0);
        *share = capacity.min(left);
        left -= *share;
        if left <= 0.0 {
            left = 0.0;
            break;
        }
    }
    // What no tier could take stays in the first tier with a ready
    // endpoint (Envoy would normalise it over every level instead).
    if left > 0.0
        && let Some(first) = tiers.iter().position(|t| t.ready > 0)
    {
        out[first] += left;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(ready: usize, total: usize) -> Health {
        Health { ready, total }
    }

    #[test]
    fn factors_parse_as_decimals_from_one_to_a_hundred() {
        let ok = [("1.4", 1400), ("1", 1000), ("1.0", 1000), (" 2.25 ", 2250), ("100", 100_000), ("100.000", 100_000), ("07.5", 7500)];
        for (raw, milli) in ok {
            assert_eq!(Factor::parse(raw), Ok(Factor(milli)), "{raw}");
        }
        let bad = ["", "abc", "0.99", "0", "100.001", "1e2", "-1.4", "1.", ".5", "1.2345", "1,4", "99999999999999"];
        for raw in bad {
            assert!(Factor::parse(raw).is_err(), "{raw}");
        }
        assert_eq!(Factor::parse("0.5").unwrap_err(), "\"0.5\" is out of range: must be from 1.0 to 100");
        assert_eq!(Factor(1400).to_string(), "1.4");
        assert_eq!(Factor(1000).to_string(), "1.0");
        assert_eq!(Factor(2250).to_string(), "2.25");
        let ann = |v: Option<&str>| -> std::collections::BTreeMap<String, String> {
            v.map(|v| (ANNOTATION_TOPOLOGY_SPILL.to_string(), v.to_string())).into_iter().collect()
        };
        assert_eq!(annotated(&ann(None)), Ok(None));
        assert_eq!(annotated(&ann(Some("1.4"))), Ok(Some(Factor(1400))));
        assert!(annotated(&ann(Some("lots"))).is_err());
    }

    /// The rule's table: (name, tiers, factor, want shares).
    #[test]
    fn shares_follow_the_priority_load_rule() {
        let f14 = Factor(1400);
        let f1 = Factor::MIN;
        let cases: Vec<(&str, Vec<Health>, Factor, Vec<f64>)> = vec![
            ("full health keeps everything near", vec![h(4, 4), h(4, 4)], f14, vec![1.0, 0.0]),
            ("full health, factor 1.0", vec![h(4, 4), h(4, 4)], f1, vec![1.0, 0.0]),
            ("3 of 4 ready: 1.4 still whole", vec![h(3, 4), h(4, 4)], f14, vec![1.0, 0.0]),
            ("3 of 4 ready, factor 1.0: a quarter spills", vec![h(3, 4), h(4, 4)], f1, vec![0.75, 0.25]),
            ("rolling update, half ready, 1.4", vec![h(2, 4), h(4, 4)], f14, vec![0.7, 0.3]),
            ("rolling update, one of four ready, 1.4", vec![h(1, 4), h(4, 4)], f14, vec![0.35, 0.65]),
            ("rolling update, surge pods listed not ready", vec![h(4, 6), h(4, 4)], f1, vec![4.0 / 6.0, 2.0 / 6.0]),
            ("first tier empty keeps nothing", vec![h(0, 4), h(4, 4)], f14, vec![0.0, 1.0]),
            ("first tier lists nothing", vec![h(0, 0), h(3, 3)], f14, vec![0.0, 1.0]),
            ("three tiers, the second half ready", vec![h(1, 4), h(2, 4), h(6, 6)], f14, vec![0.35, 0.65, 0.0]),
            ("three tiers, the second too small", vec![h(1, 4), h(1, 4), h(6, 6)], f14, vec![0.35, 0.35, 0.3]),
            ("three tiers, factor 1.0", vec![h(1, 4), h(1, 4), h(6, 6)], f1, vec![0.25, 0.25, 0.5]),
            ("what the last tier cannot take stays in the first (no `*`)", vec![h(1, 4), h(1, 4)], f14, vec![1.0 - 0.35, 0.35]),
            ("the rest stays in the first tier with a ready endpoint", vec![h(0, 2), h(1, 4), h(1, 10)], f1, vec![0.0, 0.9, 0.1]),
            ("`*` last takes the rest", vec![h(1, 2), h(5, 5)], f14, vec![0.7, 0.3]),
            ("no tier ready: nothing", vec![h(0, 2), h(0, 3)], f14, vec![0.0, 0.0]),
            ("no tiers", vec![], f14, vec![]),
            ("factor 100: one ready in a hundred is whole", vec![h(1, 100), h(5, 5)], Factor::MAX, vec![1.0, 0.0]),
        ];
        for (name, tiers, factor, want) in cases {
            let got = shares(&tiers, factor);
            assert_eq!(got.len(), want.len(), "{name}");
            for (g, w) in got.iter().zip(&want) {
                assert!((g - w).abs() < 1e-9, "{name}: got {got:?}, want {want:?}");
            }
            let sum: f64 = got.iter().sum();
            let any = tiers.iter().any(|t| t.ready > 0);
            assert!((sum - if any { 1.0 } else { 0.0 }).abs() < 1e-9, "{name}: shares add up to {sum}");
        }
    }
}
