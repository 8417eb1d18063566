//! Bounded histories for charts and sparklines: memory stays flat however long the run.

use std::collections::VecDeque;

/// A whole-run series of `(x, y)` points in bounded memory.
///
/// Points are stored at a stride of `stride` pushes. When the store reaches its capacity it
/// is thinned by halving: every other point is kept and the stride doubles, so the series
/// keeps an even spacing over the whole run. The first point is always kept, and the most
/// recent push is always the last point (held as an extra tail point when it falls between
/// strides), so a chart's ends are exact.
#[derive(Clone, Debug)]
pub struct ThinnedSeries {
    points: Vec<(f64, f64)>,
    capacity: usize,
    stride: u64,
    pushed: u64,
    tail_is_extra: bool,
}

impl ThinnedSeries {
    /// A series holding at most `capacity` points (rounded up to an even number ≥ 4) plus the
    /// latest point.
    pub fn new(capacity: usize) -> ThinnedSeries {
        let capacity = capacity.max(4).next_multiple_of(2);
        ThinnedSeries {
            points: Vec::with_capacity(capacity + 1),
            capacity,
            stride: 1,
            pushed: 0,
            tail_is_extra: false,
        }
    }

    /// Appends a point.
    pub fn push(&mut self, x: f64, y: f64) {
        if self.tail_is_extra {
            self.points.pop();
            self.tail_is_extra = false;
        }
        let index = self.pushed;
        self.pushed += 1;
        if index.is_multiple_of(self.stride) {
            if self.points.len() >= self.capacity {
                self.thin();
            }
            self.points.push((x, y));
        } else {
            self.points.push((x, y));
            self.tail_is_extra = true;
        }
    }

    /// Keeps every other stored point and doubles the stride.
    fn thin(&mut self) {
        let mut keep = 0;
        for i in (0..self.points.len()).step_by(2) {
            self.points[keep] = self.points[i];
            keep += 1;
        }
        self.points.truncate(keep);
        self.stride *= 2;
    }

    /// The stored points, oldest first.
    pub fn points(&self) -> &[(f64, f64)] {
        &self.points
    }

    /// Maximum number of points held (not counting the latest tail point).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Number of points pushed since creation.
    pub fn pushed(&self) -> u64 {
        self.pushed
    }

    /// Pushes per stored point at present.
    pub fn stride(&self) -> u64 {
        self.stride
    }

    /// Whether nothing has been pushed.
    pub fn is_empty(&self) -> bool {
        self.points.is_empty()
    }

    /// The latest point.
    pub fn last(&self) -> Option<(f64, f64)> {
        self.points.last().copied()
    }
}

/// The most recent `capacity` points at full resolution, as one contiguous slice.
#[derive(Clone, Debug)]
pub struct RecentSeries {
    points: Vec<(f64, f64)>,
    capacity: usize,
    /// Whether the oldest points have been dropped.
    truncated: bool,
}

impl RecentSeries {
    /// A window of the last `capacity` points (at least 1).
    pub fn new(capacity: usize) -> RecentSeries {
        let capacity = capacity.max(1);
        RecentSeries {
            points: Vec::with_capacity(2 * capacity),
            capacity,
            truncated: false,
        }
    }

    /// Appends a point, dropping old ones in amortised O(1).
    pub fn push(&mut self, x: f64, y: f64) {
        if self.points.len() >= 2 * self.capacity {
            self.points.drain(..self.capacity);
            self.truncated = true;
        }
        self.points.push((x, y));
    }

    /// The last `capacity` points, oldest first.
    pub fn points(&self) -> &[(f64, f64)] {
        let start = self.points.len().saturating_sub(self.capacity);
        &self.points[start..]
    }

    /// Whether every point since the start is still held.
    pub fn is_complete(&self) -> bool {
        !self.truncated && self.points.len() <= self.capacity
    }
}

/// A chart series: the whole run thinned, plus the recent points at full resolution.
#[derive(Clone, Debug)]
pub struct History {
    full: ThinnedSeries,
    recent: RecentSeries,
}

impl History {
    /// `capacity` points for the whole run, `recent` points at full resolution.
    pub fn new(capacity: usize, recent: usize) -> History {
        History {
            full: ThinnedSeries::new(capacity),
            recent: RecentSeries::new(recent),
        }
    }

    /// Appends a point. Non-finite values are skipped (they cannot be drawn).
    pub fn push(&mut self, x: f64, y: f64) {
        if x.is_finite() && y.is_finite() {
            self.full.push(x, y);
            self.recent.push(x, y);
        }
    }

    /// The whole run, thinned.
    pub fn full(&self) -> &[(f64, f64)] {
        self.full.points()
    }

    /// The points with `x >= x_min`, at the best resolution held.
    pub fn since(&self, x_min: f64) -> &[(f64, f64)] {
        let recent = self.recent.points();
        let source = match recent.first() {
            Some(&(first, _)) if first <= x_min || self.recent.is_complete() => recent,
            _ => self.full.points(),
        };
        let start = source.partition_point(|&(x, _)| x < x_min);
        &source[start..]
    }

    /// The latest point.
    pub fn last(&self) -> Option<(f64, f64)> {
        self.full.last()
    }

    /// The first point.
    pub fn first(&self) -> Option<(f64, f64)> {
        self.full.points().first().copied()
    }

    /// The whole-run store, for inspection.
    pub fn thinned(&self) -> &ThinnedSeries {
        &self.full
    }
}

/// A fixed-size ring of the latest values, for sparklines.
#[derive(Clone, Debug)]
pub struct Ring<T> {
    values: VecDeque<T>,
    capacity: usize,
}

impl<T: Copy> Ring<T> {
    /// A ring of at most `capacity` values (at least 1).
    pub fn new(capacity: usize) -> Ring<T> {
        let capacity = capacity.max(1);
        Ring {
            values: VecDeque::with_capacity(capacity),
            capacity,
        }
    }

    /// Appends a value, dropping the oldest when full.
    pub fn push(&mut self, value: T) {
        if self.values.len() == self.capacity {
            self.values.pop_front();
        }
        self.values.push_back(value);
    }

    /// The last `n` values, oldest first.
    pub fn last_n(&self, n: usize) -> impl Iterator<Item = T> + '_ {
        self.values
            .iter()
            .skip(self.values.len().saturating_sub(n))
            .copied()
    }

    /// Every value, oldest first.
    pub fn iter(&self) -> impl Iterator<Item = T> + '_ {
        self.values.iter().copied()
    }

    /// Number of values held.
    pub fn len(&self) -> usize {
        self.values.len()
    }

    /// Whether the ring is empty.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// The latest value.
    pub fn last(&self) -> Option<T> {
        self.values.back().copied()
    }
}

/// An exponential moving average with bias correction (so early values are not pulled
/// toward zero).
#[derive(Clone, Debug)]
pub struct Ema {
    beta: f64,
    value: f64,
    weight: f64,
}

impl Ema {
    /// `beta` in `[0, 1)`: the weight of the past (0.98 ≈ a 50-step window).
    pub fn new(beta: f64) -> Ema {
        Ema {
            beta: beta.clamp(0.0, 0.999_999),
            value: 0.0,
            weight: 0.0,
        }
    }

    /// Adds a value and returns the smoothed estimate. Non-finite values are ignored.
    pub fn update(&mut self, x: f64) -> f64 {
        if x.is_finite() {
            self.value = self.beta * self.value + (1.0 - self.beta) * x;
            self.weight = self.beta * self.weight + (1.0 - self.beta);
        }
        self.get().unwrap_or(x)
    }

    /// The current estimate, once a value has been seen.
    pub fn get(&self) -> Option<f64> {
        (self.weight > 0.0).then(|| self.value / self.weight)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thinning_keeps_even_spacing() {
        let mut s = ThinnedSeries::new(8);
        for i in 0..100 {
            s.push(i as f64, 0.0);
        }
        let xs: Vec<f64> = s.points().iter().map(|p| p.0).collect();
        assert!(xs.len() <= 9);
        assert_eq!(xs[0], 0.0);
        assert_eq!(*xs.last().unwrap(), 99.0);
        let stride = s.stride() as f64;
        for w in xs[..xs.len() - 1].windows(2) {
            assert_eq!(w[1] - w[0], stride);
        }
    }

    #[test]
    fn recent_window_prefers_full_resolution() {
        let mut h = History::new(8, 10);
        for i in 0..100 {
            h.push(i as f64, i as f64);
        }
        let xs: Vec<f64> = h.since(95.0).iter().map(|p| p.0).collect();
        assert_eq!(xs, vec![95.0, 96.0, 97.0, 98.0, 99.0]);
        // older than the recent window: falls back to the thinned store
        assert!(h.since(10.0).len() <= 9);
    }

    #[test]
    fn ema_is_bias_corrected() {
        let mut e = Ema::new(0.9);
        assert!((e.update(5.0) - 5.0).abs() < 1e-12);
        assert!((e.update(5.0) - 5.0).abs() < 1e-12);
    }
}
