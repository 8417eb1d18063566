//! The batch loader: a prefetch thread with a bounded queue, a deterministic order from the
//! seed, and a cursor a checkpoint can save and restore. The batch size can change at any
//! time: the loader restarts from the cursor of the last batch handed out.
//!
//! Windows are either aligned (non-overlapping windows of `seq_len`, a permutation per epoch)
//! or random: window `i` of epoch `e` starts at a token drawn from `(seed, e, i)` alone, so the
//! stream is a pure function of the seed and the position in it (resume is exact, and data
//! parallel ranks, which take disjoint rows of the same global stream, see different windows).
//! Either way an epoch is `sequences_per_epoch` windows: about one pass over the tokens.

use super::packing::Rows;
use super::{DataError, Tokens};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Position in the deterministic stream of training sequences.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cursor {
    pub epoch: u64,
    /// Sequences of this epoch already handed out.
    pub index: u64,
}

/// One micro-batch of token ids, row-major `[batch, seq_len]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    pub inputs: Vec<u32>,
    pub targets: Vec<u32>,
    pub batch: usize,
    pub seq_len: usize,
    /// The cursor after this batch.
    pub cursor: Cursor,
    /// Packed instruction/chat rows: each slot's sample in its row (attention stays within
    /// a sample, positions restart at each); targets that do not train are
    /// [`super::packing::IGNORE`]. None: a token stream, every target trains.
    pub segments: Option<Vec<u32>>,
}

/// Where training windows start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Windows {
    /// Non-overlapping windows at multiples of `seq_len`, in a permutation per epoch.
    Aligned,
    /// Any token, drawn from (seed, epoch, index in the epoch).
    Random,
}

/// SplitMix64's finalizer: a bijective 64-bit mix.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The start of random window `index` of `epoch`, uniform in `[0, starts)` (a pure function of
/// its arguments; `starts` = tokens − seq_len, the positions a whole window fits after).
pub fn window_start(seed: u64, epoch: u64, index: u64, starts: u64) -> u64 {
    let h = mix(mix(mix(seed ^ 0x9E37_79B9_7F4A_7C15) ^ epoch) ^ index);
    ((h as u128 * starts as u128) >> 64) as u64
}

/// The order of sequence windows in an epoch: a permutation fixed by (seed, epoch), or
/// random starts.
#[derive(Clone, Debug)]
pub struct Order {
    tokens: Tokens,
    seq_len: usize,
    seed: u64,
    windows: Windows,
    epoch: u64,
    perm: Vec<u32>,
    /// Packed rows (instruction/chat data) in place of windows of the token stream.
    rows: Option<std::sync::Arc<Rows>>,
}

impl Order {
    /// Aligned windows.
    pub fn new(tokens: Tokens, seq_len: usize, seed: u64) -> Self {
        Self::with_windows(tokens, seq_len, seed, Windows::Aligned)
    }

    pub fn with_windows(tokens: Tokens, seq_len: usize, seed: u64, windows: Windows) -> Self {
        let mut o = Self {
            tokens,
            seq_len,
            seed,
            windows,
            epoch: u64::MAX,
            perm: Vec::new(),
            rows: None,
        };
        o.set_epoch(0);
        o
    }

    /// Packed rows, in a permutation per epoch fixed by the seed.
    pub fn with_rows(rows: std::sync::Arc<Rows>, seed: u64) -> Self {
        let mut o = Self {
            tokens: Tokens::from_vec(Vec::new()),
            seq_len: rows.seq_len,
            seed,
            windows: Windows::Aligned,
            epoch: u64::MAX,
            perm: Vec::new(),
            rows: Some(rows),
        };
        o.set_epoch(0);
        o
    }

    pub fn windows(&self) -> Windows {
        self.windows
    }

    /// Non-overlapping windows of seq_len + 1 tokens (inputs plus the shifted targets).
    pub fn sequences_per_epoch(&self) -> usize {
        match &self.rows {
            Some(r) => r.len(),
            None => self.tokens.len().saturating_sub(1) / self.seq_len,
        }
    }

    fn set_epoch(&mut self, epoch: u64) {
        if self.epoch == epoch || self.windows == Windows::Random {
            return;
        }
        self.epoch = epoch;
        self.perm = (0..self.sequences_per_epoch() as u32).collect();
        let mut rng = StdRng::seed_from_u64(
            self.seed
                .wrapping_mul(0x2545_F491_4F6C_DD1D)
                .wrapping_add(epoch),
        );
        self.perm.shuffle(&mut rng);
    }

    /// The batch of `batch` sequences starting at `cursor`.
    pub fn batch_at(&mut self, mut cursor: Cursor, batch: usize) -> Result<Batch, DataError> {
        let t = self.seq_len;
        let mut inputs = Vec::with_capacity(batch * t);
        let mut targets = Vec::with_capacity(batch * t);
        let mut row = Vec::with_capacity(t + 1);
        let n = self.sequences_per_epoch().max(1) as u64;
        let mut segments = self.rows.as_ref().map(|_| Vec::with_capacity(batch * t));
        for _ in 0..batch {
            if cursor.index >= n {
                cursor = Cursor {
                    epoch: cursor.epoch + 1,
                    index: 0,
                };
            }
            if let (Some(rows), Some(seg)) = (self.rows.clone(), segments.as_mut()) {
                self.set_epoch(cursor.epoch);
                let r = self.perm.get(cursor.index as usize).copied().unwrap_or(0) as usize;
                inputs.extend_from_slice(&rows.inputs[r * t..(r + 1) * t]);
                targets.extend_from_slice(&rows.targets[r * t..(r + 1) * t]);
                seg.extend_from_slice(&rows.segments[r * t..(r + 1) * t]);
                cursor.index += 1;
                continue;
            }
            let start = match self.windows {
                Windows::Aligned => {
                    self.set_epoch(cursor.epoch);
                    self.perm.get(cursor.index as usize).copied().unwrap_or(0) as usize * t
                }
                Windows::Random => window_start(
                    self.seed,
                    cursor.epoch,
                    cursor.index,
                    self.tokens.len().saturating_sub(t) as u64,
                ) as usize,
            };
            row.clear();
            self.tokens.extend_into(start, t + 1, &mut row)?;
            full_window(&row, t)?;
            inputs.extend_from_slice(&row[..t]);
            targets.extend_from_slice(&row[1..]);
            cursor.index += 1;
        }
        Ok(Batch {
            inputs,
            targets,
            batch,
            seq_len: t,
            cursor,
            segments,
        })
    }
}

impl Order {
    /// Rank `shard.0`'s rows of the global batch of `shard.1 × batch` sequences at `cursor`.
    pub fn shard_at(
        &mut self,
        cursor: Cursor,
        batch: usize,
        shard: (usize, usize),
    ) -> Result<Batch, DataError> {
        let (rank, world) = shard;
        if world <= 1 {
            return self.batch_at(cursor, batch);
        }
        let mut b = self.batch_at(cursor, batch * world)?;
        let t = b.seq_len;
        let rows = crate::distributed::shard_rows(rank, batch);
        for v in [&mut b.inputs, &mut b.targets]
            .into_iter()
            .chain(b.segments.as_mut())
        {
            v.truncate(rows.end * t);
            v.drain(..rows.start * t);
        }
        b.batch = batch;
        Ok(b)
    }
}

/// A window of `t + 1` tokens, or (a split shorter than a window) an error saying so.
fn full_window(row: &[u32], t: usize) -> Result<(), DataError> {
    if row.len() == t + 1 {
        return Ok(());
    }
    Err(DataError::TooSmall(format!(
        "a window of model.seq_len + 1 = {} tokens does not fit the split ({} read)",
        t + 1,
        row.len()
    )))
}

/// The prefetching loader.
pub struct Loader {
    order: Order,
    depth: usize,
    batch: usize,
    /// Cursor after the last batch handed out by [`Loader::next`].
    cursor: Cursor,
    worker: Option<Worker>,
    /// (rank, world): this rank's rows of each global batch of `world × batch` sequences.
    shard: (usize, usize),
}

struct Worker {
    rx: Receiver<Result<Batch, DataError>>,
    stop: Arc<AtomicBool>,
    handle: JoinHandle<()>,
}

impl Loader {
    pub fn new(order: Order, batch: usize, depth: usize, cursor: Cursor) -> Self {
        Self {
            order,
            depth: depth.max(1),
            batch: batch.max(1),
            cursor,
            worker: None,
            shard: (0, 1),
        }
    }

    /// Data parallelism: every rank walks the same global stream of `world × batch`
    /// sequences per micro-batch and keeps rows `[rank·batch, (rank+1)·batch)` — no overlap
    /// between ranks, and the cursor (global) means the same at any world size.
    pub fn with_shard(mut self, rank: usize, world: usize) -> Self {
        self.stop_worker();
        self.shard = (rank.min(world.max(1) - 1), world.max(1));
        self
    }

    pub fn cursor(&self) -> Cursor {
        self.cursor
    }

    pub fn sequences_per_epoch(&self) -> usize {
        self.order.sequences_per_epoch()
    }

    pub fn windows(&self) -> Windows {
        self.order.windows()
    }

    /// Change the micro-batch size; the next batch starts where the last one handed out ended.
    pub fn set_batch_size(&mut self, batch: usize) {
        if batch != self.batch {
            self.stop_worker();
            self.batch = batch.max(1);
        }
    }

    /// Move to a saved cursor (resume).
    pub fn seek(&mut self, cursor: Cursor) {
        self.stop_worker();
        self.cursor = cursor;
    }

    fn start_worker(&mut self) {
        let (tx, rx) = sync_channel(self.depth);
        let stop = Arc::new(AtomicBool::new(false));
        let mut order = self.order.clone();
        let (batch, mut cursor, stop2, shard) = (self.batch, self.cursor, stop.clone(), self.shard);
        let handle = std::thread::Builder::new()
            .name("cockpit-loader".into())
            .spawn(move || {
                while !stop2.load(Ordering::Relaxed) {
                    let b = order.shard_at(cursor, batch, shard);
                    let failed = b.is_err();
                    if let Ok(b) = &b {
                        cursor = b.cursor;
                    }
                    if tx.send(b).is_err() || failed {
                        break;
                    }
                }
            });
        match handle {
            Ok(handle) => self.worker = Some(Worker { rx, stop, handle }),
            Err(_) => self.worker = None, // fall back to synchronous batches
        }
    }

    fn stop_worker(&mut self) {
        if let Some(w) = self.worker.take() {
            w.stop.store(true, Ordering::Relaxed);
            drop(w.rx); // unblocks a pending send
            let _ = w.handle.join();
        }
    }

    /// The next batch and how long the caller waited for it; a token shard that cannot be
    /// read (changed on disk since it was opened) is an error naming it.
    pub fn next_batch(&mut self) -> Result<(Batch, Duration), DataError> {
        if self.worker.is_none() {
            self.start_worker();
        }
        let t0 = Instant::now();
        let b = match self.worker.as_ref().map(|w| w.rx.recv()) {
            Some(Ok(Ok(b))) => b,
            Some(Ok(Err(e))) => {
                self.stop_worker();
                return Err(e);
            }
            _ => {
                self.worker = None;
                self.order.shard_at(self.cursor, self.batch, self.shard)?
            }
        };
        self.cursor = b.cursor;
        Ok((b, t0.elapsed()))
    }
}

impl Drop for Loader {
    fn drop(&mut self) {
        self.stop_worker();
    }
}

/// The eval's seed: fixed (not run.seed), so every eval of every run of a val split scores the
/// same windows and their losses compare.
pub const EVAL_SEED: u64 = 0x00C0_C4E7_E5A1;

/// The val windows an eval scores: `n_batches × batch` windows at random starts drawn from
/// [`EVAL_SEED`] (the same at every eval), or the whole split in non-overlapping windows when
/// `n_batches` is 0 or asks for at least as many windows as the split holds.
#[derive(Clone, Debug)]
pub struct EvalPlan {
    tokens: Tokens,
    seq_len: usize,
    starts: Vec<usize>,
    /// Every token of the split (but a tail shorter than a window) is scored once.
    pub whole: bool,
    /// Packed rows (instruction/chat data): `starts` are row indices.
    rows: Option<std::sync::Arc<Rows>>,
}

impl EvalPlan {
    pub fn new(tokens: &Tokens, seq_len: usize, batch: usize, n_batches: usize) -> Self {
        let n = tokens.len();
        let all = n.saturating_sub(1) / seq_len.max(1);
        let want = n_batches.saturating_mul(batch.max(1));
        let whole = n_batches == 0 || want >= all;
        let starts = if whole {
            (0..all).map(|i| i * seq_len).collect()
        } else {
            let starts = n.saturating_sub(seq_len) as u64;
            (0..want as u64)
                .map(|i| window_start(EVAL_SEED, 0, i, starts) as usize)
                .collect()
        };
        Self {
            tokens: tokens.clone(),
            seq_len,
            starts,
            whole,
            rows: None,
        }
    }

    /// Packed val rows: the first `n_batches × batch` rows, or all of them.
    pub fn with_rows(rows: std::sync::Arc<Rows>, batch: usize, n_batches: usize) -> Self {
        let all = rows.len();
        let want = n_batches.saturating_mul(batch.max(1));
        let whole = n_batches == 0 || want >= all;
        Self {
            tokens: Tokens::from_vec(rows.inputs.clone()),
            seq_len: rows.seq_len,
            starts: (0..if whole { all } else { want }).collect(),
            whole,
            rows: Some(rows),
        }
    }

    /// Windows scored per eval.
    pub fn windows(&self) -> usize {
        self.starts.len()
    }

    /// Tokens scored per eval.
    pub fn tokens_scored(&self) -> u64 {
        match &self.rows {
            // The targets that train.
            Some(r) => self
                .starts
                .iter()
                .map(|&s| {
                    r.targets[s * self.seq_len..(s + 1) * self.seq_len]
                        .iter()
                        .filter(|&&y| y != super::packing::IGNORE)
                        .count() as u64
                })
                .sum(),
            None => (self.starts.len() * self.seq_len) as u64,
        }
    }

    /// The windows in batches of (at most) `batch`.
    pub fn batches(&self, batch: usize) -> impl Iterator<Item = Result<Batch, DataError>> + '_ {
        let t = self.seq_len;
        self.starts.chunks(batch.max(1)).map(move |starts| {
            let mut inputs = Vec::with_capacity(starts.len() * t);
            let mut targets = Vec::with_capacity(starts.len() * t);
            let mut row = Vec::with_capacity(t + 1);
            let mut segments = self
                .rows
                .as_ref()
                .map(|_| Vec::with_capacity(starts.len() * t));
            for &s in starts {
                if let (Some(rows), Some(seg)) = (&self.rows, segments.as_mut()) {
                    inputs.extend_from_slice(&rows.inputs[s * t..(s + 1) * t]);
                    targets.extend_from_slice(&rows.targets[s * t..(s + 1) * t]);
                    seg.extend_from_slice(&rows.segments[s * t..(s + 1) * t]);
                    continue;
                }
                row.clear();
                self.tokens.extend_into(s, t + 1, &mut row)?;
                full_window(&row, t)?;
                inputs.extend_from_slice(&row[..t]);
                targets.extend_from_slice(&row[1..]);
            }
            Ok(Batch {
                inputs,
                targets,
                batch: starts.len(),
                seq_len: t,
                cursor: Cursor::default(),
                segments,
            })
        })
    }

    /// For the run header: what an eval covers.
    pub fn describe(&self) -> String {
        let how = if self.whole {
            "the whole split"
        } else {
            "fixed random windows"
        };
        if self.rows.is_some() {
            return format!(
                "eval {} rows × {}: {} answer tokens ({})",
                self.windows(),
                self.seq_len,
                self.tokens_scored(),
                if self.whole {
                    "every val row"
                } else {
                    "the first val rows"
                }
            );
        }
        format!(
            "eval {} windows × {} = {} of {} val tokens ({how})",
            self.windows(),
            self.seq_len,
            self.tokens_scored(),
            self.tokens.len()
        )
    }
}

/// Mean and standard error of the mean (sample standard deviation / √n; NaN below 2 values).
pub fn mean_se(xs: &[f64]) -> (f64, f64) {
    let n = xs.len() as f64;
    if xs.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    let mean = xs.iter().sum::<f64>() / n;
    if xs.len() < 2 {
        return (mean, f64::NAN);
    }
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (mean, (var / n).sqrt())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toks(n: usize) -> Tokens {
        Tokens::from_vec((0..n as u32).collect())
    }

    #[test]
    fn deterministic_order_and_targets_shifted() {
        let mut a = Loader::new(Order::new(toks(10_000), 16, 3), 4, 2, Cursor::default());
        let mut b = Loader::new(Order::new(toks(10_000), 16, 3), 4, 2, Cursor::default());
        for _ in 0..20 {
            let (x, _) = a.next_batch().unwrap();
            let (y, _) = b.next_batch().unwrap();
            assert_eq!(x, y);
            for r in 0..4 {
                assert_eq!(x.inputs[r * 16 + 1], x.targets[r * 16]);
            }
        }
    }

    #[test]
    fn cursor_restore_and_rebatching_continue_the_same_stream() {
        let order = Order::new(toks(5_000), 8, 11);
        // 3 batches of 4 then 1 batch of 8 == the same 20 sequences as batches of 4 all along.
        let mut one = Loader::new(order.clone(), 4, 3, Cursor::default());
        let mut seqs_one = Vec::new();
        for _ in 0..5 {
            seqs_one.extend(one.next_batch().unwrap().0.inputs);
        }
        let mut two = Loader::new(order.clone(), 4, 3, Cursor::default());
        let mut seqs_two = Vec::new();
        for _ in 0..3 {
            seqs_two.extend(two.next_batch().unwrap().0.inputs);
        }
        let saved = two.cursor();
        two.set_batch_size(8);
        seqs_two.extend(two.next_batch().unwrap().0.inputs);
        assert_eq!(seqs_one, seqs_two);
        // Restoring a cursor in a fresh loader continues identically.
        let mut three = Loader::new(order, 4, 1, saved);
        let (b, _) = three.next_batch().unwrap();
        assert_eq!(&b.inputs[..], &seqs_one[3 * 4 * 8..4 * 4 * 8]);
    }

    #[test]
    fn epochs_wrap_and_reshuffle() {
        let order = Order::new(toks(16 * 10 + 1), 16, 5);
        assert_eq!(order.sequences_per_epoch(), 10);
        let mut l = Loader::new(order, 5, 2, Cursor::default());
        let e0: Vec<u32> = (0..2)
            .flat_map(|_| l.next_batch().unwrap().0.inputs)
            .collect();
        let e1: Vec<u32> = (0..2)
            .flat_map(|_| l.next_batch().unwrap().0.inputs)
            .collect();
        assert_eq!(
            l.cursor(),
            Cursor {
                epoch: 1,
                index: 10
            }
        );
        let mut a: Vec<u32> = e0.chunks(16).map(|c| c[0]).collect();
        let mut b: Vec<u32> = e1.chunks(16).map(|c| c[0]).collect();
        assert_ne!(a, b, "a new epoch reshuffles");
        a.sort();
        b.sort();
        assert_eq!(a, b, "each epoch visits every sequence once");
    }

    #[test]
    fn shards_split_the_global_batch_without_overlap() {
        let order = Order::new(toks(10_000), 16, 5);
        let mut whole = Loader::new(order.clone(), 6, 2, Cursor::default());
        let mut ranks: Vec<Loader> = (0..3)
            .map(|r| Loader::new(order.clone(), 2, 2, Cursor::default()).with_shard(r, 3))
            .collect();
        for _ in 0..5 {
            let (w, _) = whole.next_batch().unwrap();
            let parts: Vec<Batch> = ranks
                .iter_mut()
                .map(|l| l.next_batch().unwrap().0)
                .collect();
            let joined: Vec<u32> = parts.iter().flat_map(|b| b.inputs.clone()).collect();
            assert_eq!(
                joined, w.inputs,
                "rank shards concatenate to the global batch"
            );
            assert!(parts.iter().all(|b| b.cursor == w.cursor && b.batch == 2));
        }
    }

    fn starts(b: &Batch) -> Vec<u32> {
        b.inputs.chunks(b.seq_len).map(|c| c[0]).collect()
    }

    #[test]
    fn random_windows_are_reproducible_and_cover_every_offset_class() {
        let (n, t) = (10_000, 16);
        let order = || Order::with_windows(toks(n), t, 3, Windows::Random);
        let mut a = Loader::new(order(), 8, 2, Cursor::default());
        let mut b = Loader::new(order(), 8, 2, Cursor::default());
        let mut other = Loader::new(
            Order::with_windows(toks(n), t, 4, Windows::Random),
            8,
            2,
            Cursor::default(),
        );
        let mut classes = [0usize; 16];
        let mut all = Vec::new();
        for _ in 0..100 {
            let (x, _) = a.next_batch().unwrap();
            assert_eq!(
                x,
                b.next_batch().unwrap().0,
                "the same seed gives the same stream"
            );
            assert_ne!(
                starts(&x),
                starts(&other.next_batch().unwrap().0),
                "seeds differ"
            );
            for r in 0..8 {
                // Contiguous tokens: the targets are the inputs shifted by one.
                assert_eq!(x.inputs[r * t + 1], x.targets[r * t]);
                assert_eq!(x.targets[r * t + t - 1], x.inputs[r * t] + t as u32);
            }
            for s in starts(&x) {
                assert!((s as usize) + t < n, "a whole window fits");
                classes[s as usize % t] += 1;
                all.push(s);
            }
        }
        // 800 windows over 16 classes: each class ~50 times.
        assert!(classes.iter().all(|&c| c > 20), "{classes:?}");
        all.sort();
        all.dedup();
        assert!(all.len() > 750, "starts are spread: {} distinct", all.len());
        // An epoch is counted in windows (≈ one pass over the tokens).
        assert_eq!(a.sequences_per_epoch(), (n - 1) / t);
        assert_eq!(
            a.cursor(),
            Cursor {
                epoch: 1,
                index: 800 - 624
            }
        );
    }

    #[test]
    fn random_windows_resume_rebatch_and_shard_like_aligned_ones() {
        let order = Order::with_windows(toks(5_000), 8, 11, Windows::Random);
        let mut one = Loader::new(order.clone(), 4, 3, Cursor::default());
        let all: Vec<u32> = (0..6)
            .flat_map(|_| one.next_batch().unwrap().0.inputs)
            .collect();
        let mut two = Loader::new(order.clone(), 4, 3, Cursor::default());
        let mut seen: Vec<u32> = (0..2)
            .flat_map(|_| two.next_batch().unwrap().0.inputs)
            .collect();
        // Resume from a saved cursor at another batch size: the same stream.
        let mut three = Loader::new(order.clone(), 8, 1, two.cursor());
        seen.extend((0..2).flat_map(|_| three.next_batch().unwrap().0.inputs));
        assert_eq!(seen, all);
        // Two ranks at B = 2 take disjoint rows of the stream one process at B = 4 reads.
        let mut ranks: Vec<Loader> = (0..2)
            .map(|r| Loader::new(order.clone(), 2, 2, Cursor::default()).with_shard(r, 2))
            .collect();
        let mut joined = Vec::new();
        for _ in 0..6 {
            for l in &mut ranks {
                joined.extend(l.next_batch().unwrap().0.inputs);
            }
        }
        assert_eq!(joined, all);
    }

    #[test]
    fn eval_plan_is_fixed_or_the_whole_split() {
        let val = toks(4_001);
        let a = EvalPlan::new(&val, 16, 4, 3);
        let b = EvalPlan::new(&val, 16, 4, 3);
        assert!(!a.whole);
        assert_eq!((a.windows(), a.tokens_scored()), (12, 12 * 16));
        let sa: Vec<Batch> = a.batches(4).map(Result::unwrap).collect();
        assert_eq!(
            sa,
            b.batches(4).map(Result::unwrap).collect::<Vec<_>>(),
            "the same windows each time"
        );
        assert_eq!(sa.len(), 3);
        // Another batch size: the same windows.
        let flat: Vec<u32> = a.batches(5).flat_map(|b| b.unwrap().inputs).collect();
        assert_eq!(
            flat,
            sa.iter().flat_map(|b| b.inputs.clone()).collect::<Vec<_>>()
        );
        assert!(starts(&sa[0]).iter().any(|s| s % 16 != 0), "random starts");
        // 0, or more windows than the split holds: every window of the split once.
        for n in [0, 100] {
            let w = EvalPlan::new(&val, 16, 4, n);
            assert!(w.whole);
            assert_eq!(w.windows(), 250);
            let s: Vec<u32> = w.batches(7).flat_map(|b| starts(&b.unwrap())).collect();
            assert_eq!(s, (0..250).map(|i| i * 16).collect::<Vec<u32>>());
            assert!(w.describe().contains("4000 of 4001 val tokens"));
        }
    }

    /// An i.i.d. source with P(1) = p and a model that knows p: the per-token loss has mean H
    /// (the entropy) and variance p(1-p)·ln²((1-p)/p). The eval's se must match
    /// σ/√(windows·T), and mean ± 1.96·se must cover H about 95% of the time.
    #[test]
    fn eval_standard_error_is_right_on_a_source_of_known_entropy() {
        let p: f64 = 0.2;
        let h = -p * p.ln() - (1.0 - p) * (1.0 - p).ln();
        let sigma = (p * (1.0 - p)).sqrt() * ((1.0 - p) / p).ln();
        let (t, batch, n_batches) = (32, 16, 8);
        let want_se = sigma / ((batch * n_batches * t) as f64).sqrt();
        let (mut covered, trials) = (0, 200);
        let mut ratios = Vec::new();
        for trial in 0..trials {
            let mut rng = StdRng::seed_from_u64(trial);
            let v: Vec<u32> = (0..60_000)
                .map(|_| u32::from(rand::Rng::random::<f64>(&mut rng) < p))
                .collect();
            let plan = EvalPlan::new(&Tokens::from_vec(v), t, batch, n_batches);
            let per_window: Vec<f64> = plan
                .batches(batch)
                .map(Result::unwrap)
                .flat_map(|b| {
                    b.targets
                        .chunks(t)
                        .map(|w| {
                            let nll = |y: &u32| if *y == 1 { -p.ln() } else { -(1.0 - p).ln() };
                            w.iter().map(nll).sum::<f64>() / t as f64
                        })
                        .collect::<Vec<_>>()
                })
                .collect();
            assert_eq!(per_window.len(), batch * n_batches);
            let (mean, se) = mean_se(&per_window);
            ratios.push(se / want_se);
            if (mean - h).abs() < 1.96 * se {
                covered += 1;
            }
        }
        let mean_ratio = ratios.iter().sum::<f64>() / ratios.len() as f64;
        assert!(
            (0.93..1.07).contains(&mean_ratio),
            "se / σ/√N = {mean_ratio}"
        );
        let coverage = covered as f64 / trials as f64;
        assert!((0.89..=0.99).contains(&coverage), "coverage {coverage}");
    }

    #[test]
    fn mean_se_edges() {
        assert!(mean_se(&[]).0.is_nan());
        let (m, se) = mean_se(&[2.0]);
        assert!(m == 2.0 && se.is_nan());
        let (m, se) = mean_se(&[1.0, 3.0]);
        assert!(m == 2.0 && (se - 1.0).abs() < 1e-12);
    }
}
