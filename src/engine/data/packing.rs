//! Samples into training rows of `model.seq_len` slots: best-fit packing (or one sample a
//! row, padded), with a segment id per slot so that attention never crosses from one sample
//! into another and positions restart at each sample.
//!
//! A sample of n tokens takes n − 1 slots: inputs `ids[..n-1]`, targets `ids[1..]` (a target
//! that does not train is [`IGNORE`]), exactly what the sample alone would be trained on.
//! Padding slots have input 0, target [`IGNORE`] and a segment of their own.

use super::chat::Encoded;
use super::DataError;
use std::collections::BTreeSet;

/// The target of a slot that does not count in the loss.
pub use crate::engine::kernels::rows::IGNORE;

/// `data.long_samples`: what becomes of a sample longer than a row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LongSamples {
    /// Cut into rows of seq_len slots (each piece keeps its targets).
    Split,
    Drop,
    Error,
}

impl LongSamples {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "split" => Some(Self::Split),
            "drop" => Some(Self::Drop),
            "error" => Some(Self::Error),
            _ => None,
        }
    }
}

/// Packed rows, row-major `[rows, seq_len]`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Rows {
    pub seq_len: usize,
    pub inputs: Vec<u32>,
    pub targets: Vec<u32>,
    /// Each slot's sample within its row (0, 1, …; padding gets one more).
    pub segments: Vec<u32>,
}

impl Rows {
    pub fn len(&self) -> usize {
        self.inputs.len() / self.seq_len.max(1)
    }
    pub fn is_empty(&self) -> bool {
        self.inputs.is_empty()
    }
}

/// What packing did, for the run header.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PackStats {
    pub samples: usize,
    /// Samples longer than a row that were split, or dropped.
    pub split: usize,
    pub dropped: usize,
    /// Samples (or pieces) with no target that trains, left out.
    pub untrained: usize,
    /// Slots holding a sample's token (the rest is padding).
    pub used: u64,
    /// Slots whose target trains.
    pub trained: u64,
    pub rows: usize,
}

impl PackStats {
    /// Share of the real tokens that train.
    pub fn trained_share(&self) -> f64 {
        self.trained as f64 / self.used.max(1) as f64
    }
}

/// A sample's slots: (inputs, targets).
type Item = (Vec<u32>, Vec<u32>);

/// Pack `samples` (each with the place it came from, for errors) into rows of `seq_len`.
pub fn pack(
    samples: &[(Encoded, String)],
    seq_len: usize,
    packing: bool,
    long: LongSamples,
) -> Result<(Rows, PackStats), DataError> {
    let t = seq_len.max(1);
    let mut stats = PackStats {
        samples: samples.len(),
        ..PackStats::default()
    };
    let mut items: Vec<Item> = Vec::with_capacity(samples.len());
    for (e, at) in samples {
        let n = e.ids.len();
        if n < 2 || e.trained() == 0 {
            stats.untrained += 1;
            continue;
        }
        let inputs = e.ids[..n - 1].to_vec();
        let targets: Vec<u32> = (1..n)
            .map(|j| if e.trains[j] { e.ids[j] } else { IGNORE })
            .collect();
        if inputs.len() <= t {
            items.push((inputs, targets));
            continue;
        }
        match long {
            LongSamples::Error => {
                return Err(DataError::Input {
                    path: at.clone(),
                    message: format!(
                        "a sample of {n} tokens is longer than model.seq_len + 1 = {} (data.long_samples = \"error\"; \"split\" or \"drop\" take it)",
                        t + 1
                    ),
                })
            }
            LongSamples::Drop => stats.dropped += 1,
            LongSamples::Split => {
                stats.split += 1;
                for (i, x) in inputs.chunks(t).zip(targets.chunks(t)) {
                    if x.iter().all(|&y| y == IGNORE) {
                        stats.untrained += 1;
                    } else {
                        items.push((i.to_vec(), x.to_vec()));
                    }
                }
            }
        }
    }
    let bins = if packing {
        best_fit(&items, t)
    } else {
        (0..items.len()).map(|i| vec![i]).collect()
    };
    let mut rows = Rows {
        seq_len: t,
        inputs: Vec::with_capacity(bins.len() * t),
        targets: Vec::with_capacity(bins.len() * t),
        segments: Vec::with_capacity(bins.len() * t),
    };
    for bin in &bins {
        let mut used = 0;
        for (s, &i) in bin.iter().enumerate() {
            let (x, y) = &items[i];
            rows.inputs.extend_from_slice(x);
            rows.targets.extend_from_slice(y);
            rows.segments.extend(std::iter::repeat_n(s as u32, x.len()));
            stats.trained += y.iter().filter(|&&v| v != IGNORE).count() as u64;
            used += x.len();
        }
        stats.used += used as u64;
        rows.inputs.extend(std::iter::repeat_n(0, t - used));
        rows.targets.extend(std::iter::repeat_n(IGNORE, t - used));
        rows.segments
            .extend(std::iter::repeat_n(bin.len() as u32, t - used));
    }
    stats.rows = bins.len();
    Ok((rows, stats))
}

/// Best-fit decreasing: the longest item first, each into the open row with the least room
/// that still holds it (a new row when none does). Deterministic.
fn best_fit(items: &[Item], t: usize) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..items.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(items[i].0.len()));
    let mut bins: Vec<Vec<usize>> = Vec::new();
    // (room left, bin)
    let mut open: BTreeSet<(usize, usize)> = BTreeSet::new();
    for i in order {
        let len = items[i].0.len();
        let b = match open.range((len, 0)..).next().copied() {
            Some(key) => {
                open.remove(&key);
                let room = key.0 - len;
                if room > 0 {
                    open.insert((room, key.1));
                }
                key.1
            }
            None => {
                bins.push(Vec::new());
                let b = bins.len() - 1;
                if t > len {
                    open.insert((t - len, b));
                }
                b
            }
        };
        bins[b].push(i);
    }
    bins
}

impl PackStats {
    /// For the run header: `… 1234 samples → 310 rows (97.5% full), 41.2% of tokens train, 3
    /// split, 0 dropped`.
    pub fn describe(&self, seq_len: usize, packing: bool) -> String {
        let slots = (self.rows * seq_len).max(1) as f64;
        let mut s = format!(
            "{} samples → {} rows of {seq_len} ({}, {:.1}% full), {:.1}% of tokens train",
            self.samples,
            self.rows,
            if packing {
                "packed best-fit, no sample sees another"
            } else {
                "one sample a row, padded"
            },
            100.0 * self.used as f64 / slots,
            100.0 * self.trained_share()
        );
        for (n, what) in [
            (self.split, "split (longer than a row)"),
            (self.dropped, "dropped (longer than a row)"),
            (self.untrained, "left out (nothing to train on)"),
        ] {
            if n > 0 {
                s.push_str(&format!(", {n} {what}"));
            }
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(n: usize, first_trained: usize) -> (Encoded, String) {
        (
            Encoded {
                ids: (1..=n as u32).collect(),
                trains: (0..n).map(|i| i >= first_trained).collect(),
            },
            format!("f:{n}"),
        )
    }

    #[test]
    fn best_fit_packs_without_mixing_and_keeps_every_target() {
        let samples: Vec<_> = [9, 5, 4, 3, 7, 2, 6]
            .iter()
            .map(|&n| sample(n, 1))
            .collect();
        let (rows, st) = pack(&samples, 8, true, LongSamples::Split).unwrap();
        // 8+4+3+2+6+1+5 = 29 slots → 4 rows of 8 at best.
        assert_eq!(st.rows, 4);
        assert_eq!(st.used, 29);
        assert_eq!(st.trained, 29);
        for r in 0..rows.len() {
            let seg = &rows.segments[r * 8..(r + 1) * 8];
            let x = &rows.inputs[r * 8..(r + 1) * 8];
            for j in 0..8 {
                // Positions restart: a sample's first slot holds its token 1.
                if j == 0 || seg[j] != seg[j - 1] {
                    assert!(x[j] == 1 || rows.targets[r * 8 + j] == IGNORE, "{x:?}");
                }
            }
            assert!(seg.windows(2).all(|w| w[0] <= w[1]));
        }
        // Padded: one a row.
        let (rows, st) = pack(&samples, 8, false, LongSamples::Split).unwrap();
        assert_eq!((rows.len(), st.rows), (7, 7));
    }

    #[test]
    fn long_samples_split_drop_or_fail() {
        let s = vec![sample(20, 10), sample(3, 1)];
        let (rows, st) = pack(&s, 8, true, LongSamples::Split).unwrap();
        // 19 slots: pieces of 8, 8, 3; the first piece (targets 2..=9) has none trained.
        assert_eq!((st.split, st.untrained), (1, 1));
        assert_eq!(st.trained, 10 + 2);
        assert_eq!(rows.len(), 2);
        let (_, st) = pack(&s, 8, true, LongSamples::Drop).unwrap();
        assert_eq!((st.dropped, st.rows), (1, 1));
        let e = pack(&s, 8, true, LongSamples::Error)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("f:20: a sample of 20 tokens is longer"),
            "{e}"
        );
    }
}
