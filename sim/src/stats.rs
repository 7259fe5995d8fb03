//! Small statistics helpers for reports: percentiles over collected samples.

/// Collected samples of one quantity (milliseconds, usually).
#[derive(Clone, Debug, Default)]
pub struct Samples {
    values: Vec<f64>,
    sorted: bool,
}

impl Samples {
    pub fn new() -> Self {
        Self::default()
    }

    /// All the samples of `parts`, in one collection.
    pub fn merged(parts: &[Samples]) -> Samples {
        Samples {
            values: parts
                .iter()
                .flat_map(|p| p.values.iter().copied())
                .collect(),
            sorted: false,
        }
    }

    pub fn push(&mut self, v: f64) {
        self.values.push(v);
        self.sorted = false;
    }

    pub fn len(&self) -> usize {
        self.values.len()
    }

    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// The `q` quantile (`q` in `[0, 1]`) by nearest rank; 0 when empty.
    pub fn quantile(&mut self, q: f64) -> f64 {
        if self.values.is_empty() {
            return 0.0;
        }
        if !self.sorted {
            self.values.sort_by(f64::total_cmp);
            self.sorted = true;
        }
        let rank = (q.clamp(0.0, 1.0) * self.values.len() as f64).ceil() as usize;
        self.values[rank.saturating_sub(1).min(self.values.len() - 1)]
    }

    pub fn mean(&self) -> f64 {
        if self.values.is_empty() {
            return 0.0;
        }
        self.values.iter().sum::<f64>() / self.values.len() as f64
    }
}

/// A distribution's CDF as reports plot it: its values at the quantiles 0, 0.01, …, 1,
/// read from `quantile` (a function of q in `[0, 1]`).
pub fn cdf(mut quantile: impl FnMut(f64) -> f64) -> Vec<f64> {
    (0..=100).map(|q| quantile(f64::from(q) / 100.0)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_quantiles() {
        let mut s = Samples::new();
        assert_eq!(s.quantile(0.5), 0.0);
        for v in [5.0, 1.0, 4.0, 2.0, 3.0] {
            s.push(v);
        }
        let cases = [
            (0.0, 1.0),
            (0.2, 1.0),
            (0.5, 3.0),
            (0.9, 5.0),
            (0.99, 5.0),
            (1.0, 5.0),
        ];
        for (q, want) in cases {
            assert_eq!(s.quantile(q), want, "q={q}");
        }
        assert_eq!(s.mean(), 3.0);
    }
}
