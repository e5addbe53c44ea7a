//! Order statistics of latency samples.

/// Summary of a set of values (milliseconds in reports).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Percentiles {
    /// Number of values.
    pub count: usize,
    /// Arithmetic mean.
    pub mean: f64,
    /// Smallest value.
    pub min: f64,
    /// Median (nearest rank).
    pub p50: f64,
    /// 90th percentile (nearest rank).
    pub p90: f64,
    /// 95th percentile (nearest rank).
    pub p95: f64,
    /// 99th percentile (nearest rank).
    pub p99: f64,
    /// Largest value.
    pub max: f64,
}

impl Percentiles {
    /// The summary of `values` (NaNs are ignored); `None` when there is none, so that a mode
    /// without successful requests shows `null` rather than a fake zero latency.
    pub fn of(values: impl IntoIterator<Item = f64>) -> Option<Self> {
        let mut v: Vec<f64> = values.into_iter().filter(|x| !x.is_nan()).collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        let n = v.len();
        Some(Self {
            count: n,
            mean: v.iter().sum::<f64>() / n as f64,
            min: v[0],
            p50: nearest_rank(&v, 0.50),
            p90: nearest_rank(&v, 0.90),
            p95: nearest_rank(&v, 0.95),
            p99: nearest_rank(&v, 0.99),
            max: v[n - 1],
        })
    }
}

/// The nearest-rank percentile `q` of sorted, non-empty `v`: the smallest value with at
/// least `q·n` values at or below it.
pub fn nearest_rank(v: &[f64], q: f64) -> f64 {
    let n = v.len();
    let rank = (q * n as f64).ceil() as usize;
    v[rank.clamp(1, n) - 1]
}

/// The median of `values` (`None` when empty).
pub fn median(values: impl IntoIterator<Item = f64>) -> Option<f64> {
    Percentiles::of(values).map(|p| p.p50)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn percentiles_use_nearest_rank() {
        let p = Percentiles::of((1..=100).map(f64::from)).unwrap();
        assert_eq!((p.p50, p.p90, p.p95, p.p99), (50.0, 90.0, 95.0, 99.0));
        assert_eq!((p.min, p.max, p.count), (1.0, 100.0, 100));
        assert!((p.mean - 50.5).abs() < 1e-12);
        let p = Percentiles::of([3.0, 1.0, 2.0]).unwrap();
        assert_eq!((p.p50, p.p99), (2.0, 3.0));
    }

    #[test]
    fn no_values_give_no_summary() {
        assert_eq!(Percentiles::of(Vec::new()), None);
        assert_eq!(Percentiles::of([f64::NAN]), None);
    }

    proptest! {
        #[test]
        fn percentiles_are_ordered_and_within_the_range(v in proptest::collection::vec(-1e9f64..1e9, 1..300)) {
            let p = Percentiles::of(v.iter().copied()).unwrap();
            prop_assert!(p.min <= p.p50 && p.p50 <= p.p90 && p.p90 <= p.p95 && p.p95 <= p.p99 && p.p99 <= p.max);
            prop_assert!(v.contains(&p.p50) && v.contains(&p.p99));
            prop_assert!(p.mean >= p.min - 1e-6 && p.mean <= p.max + 1e-6);
        }
    }
}
