//! The spill shares ([`super::spill`]) as backend slots. Pure.
//!
//! The socket datapath picks a slot of a frontend's slot array by hash
//! modulo the slot count (`proxy_common::select_slot`), so a backend's
//! chance is its slots over the total: weighting means listing a backend
//! in more slots, and the connect hit path does exactly the lookups it did
//! before (no new map, no new lookup). The slot count is [`SLOTS_PER_SHARE`]
//! per frontend, so a tier's share is carried to a thousandth; each tier's
//! slots are split evenly over its ready endpoints (a tier with more ready
//! endpoints than slots scales every tier's slots up by the same whole
//! factor, so no ready endpoint of a tier that takes traffic goes
//! without one).

/// The slots of one frontend's slot array at scale 1: a tier's share is
/// rounded to a thousandth of the connections.
pub(crate) const SLOTS_PER_SHARE: u32 = 1000;
/// The most slots a spilling frontend may take (64 × [`SLOTS_PER_SHARE`]):
/// beyond it the Service keeps strict tiers and the reason is reported.
pub(crate) const MAX_SPILL_SLOTS: u32 = 64 * SLOTS_PER_SHARE;

/// Slot counts for `tiers` (each its share and its ready endpoints'
/// indices): every endpoint index with its slot count, in the tiers'
/// order. Endpoints of a tier whose rounded share is 0 are left out.
/// `Err` when more than [`MAX_SPILL_SLOTS`] would be needed.
pub(crate) fn slots(tiers: &[(f64, Vec<usize>)]) -> Result<Vec<(usize, u32)>, String> {
    let per_tier = apportion(tiers.iter().map(|(s, ready)| if ready.is_empty() { 0.0 } else { *s }), SLOTS_PER_SHARE);
    // The smallest whole scale that gives each ready endpoint of a tier
    // with slots at least one.
    let scale = tiers
        .iter()
        .zip(&per_tier)
        .filter(|(_, n)| **n > 0)
        .map(|((_, ready), n)| (ready.len() as u32).div_ceil(*n))
        .max()
        .unwrap_or(1)
        .max(1);
    let total = u64::from(SLOTS_PER_SHARE) * u64::from(scale);
    if total > u64::from(MAX_SPILL_SLOTS) {
        return Err(format!(
            "spill needs {total} backend slots for this frontend (a tier with many ready endpoints takes a small share), \
             more than the {MAX_SPILL_SLOTS} allowed"
        ));
    }
    let mut out = Vec::new();
    for ((_, ready), n) in tiers.iter().zip(&per_tier) {
        if *n == 0 || ready.is_empty() {
            continue;
        }
        let n = n * scale;
        let k = ready.len() as u32;
        // Even split; the first `n % k` endpoints take one more.
        for (j, i) in ready.iter().enumerate() {
            out.push((*i, n / k + u32::from((j as u32) < n % k)));
        }
    }
    Ok(out)
}

/// Largest-remainder rounding of `shares` (adding up to 1, or all 0) to
/// whole parts of `total`.
fn apportion(shares: impl Iterator<Item = f64>, total: u32) -> Vec<u32> {
    let exact: Vec<f64> = shares.map(|s| s.max(0.0) * f64::from(total)).collect();
    let mut parts: Vec<u32> = exact.iter().map(|e| e.floor() as u32).collect();
    if exact.iter().all(|e| *e == 0.0) {
        return parts;
    }
    let given: u32 = parts.iter().sum();
    let mut order: Vec<usize> = (0..exact.len()).collect();
    // Largest remainder first; the nearer tier first among equals.
    order.sort_by(|a, b| (exact[*b] - exact[*b].floor()).total_cmp(&(exact[*a] - exact[*a].floor())).then(a.cmp(b)));
    for i in order.into_iter().take(total.saturating_sub(given) as usize) {
        parts[i] += 1;
    }
    parts
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (name, tiers, want (index, slots)).
    #[test]
    fn shares_become_slot_counts() {
        type Row = (&'static str, Vec<(f64, Vec<usize>)>, Vec<(usize, u32)>);
        let cases: Vec<Row> = vec![
            ("one tier takes all", vec![(1.0, vec![0, 1]), (0.0, vec![2])], vec![(0, 500), (1, 500)]),
            (
                "70/30 over 2 and 4",
                vec![(0.7, vec![0, 1]), (0.3, vec![2, 3, 4, 5])],
                vec![(0, 350), (1, 350), (2, 75), (3, 75), (4, 75), (5, 75)],
            ),
            (
                "uneven split: the first take one more",
                vec![(0.35, vec![0, 1, 2]), (0.65, vec![3])],
                vec![(0, 117), (1, 117), (2, 116), (3, 650)],
            ),
            (
                "thirds round to 1000",
                vec![(1.0 / 3.0, vec![0]), (1.0 / 3.0, vec![1]), (1.0 / 3.0, vec![2])],
                vec![(0, 334), (1, 333), (2, 333)],
            ),
            ("a tier below a thousandth gets nothing", vec![(0.9996, vec![0]), (0.0004, vec![1])], vec![(0, 1000)]),
            (
                "more ready endpoints than slots: scaled",
                vec![(0.998, vec![0]), (0.002, vec![1, 2, 3])],
                vec![(0, 1996), (1, 2), (2, 1), (3, 1)],
            ),
            ("nothing ready", vec![(0.0, vec![]), (0.0, vec![])], vec![]),
        ];
        for (name, tiers, want) in cases {
            let got = slots(&tiers).unwrap();
            assert_eq!(got, want, "{name}");
        }
        let many: Vec<usize> = (0..100).collect();
        let err = slots(&[(0.999, vec![1000]), (0.001, many)]).unwrap_err();
        assert!(err.contains("100000 backend slots"), "{err}");
    }

    #[test]
    fn the_tiers_slots_carry_the_share_to_a_thousandth() {
        for (a, b) in [(0.35, 0.65), (0.123_4, 0.876_6), (0.5, 0.5), (0.999, 0.001)] {
            let got = slots(&[(a, vec![0, 1, 2]), (b, vec![3, 4])]).unwrap();
            let total: u32 = got.iter().map(|(_, n)| n).sum();
            let first: u32 = got.iter().filter(|(i, _)| *i < 3).map(|(_, n)| n).sum();
            assert!((f64::from(first) / f64::from(total) - a).abs() <= 0.0005 + 1e-9, "{a}: {got:?}");
        }
    }
}
