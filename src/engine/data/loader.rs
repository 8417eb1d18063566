//! The batch loader: a prefetch thread with a bounded queue, a deterministic order from the
//! seed, and a cursor a checkpoint can save and restore. The batch size can change at any
//! time: the loader restarts from the cursor of the last batch handed out.

use super::Tokens;
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
}

/// The order of sequence windows in an epoch: a permutation fixed by (seed, epoch).
#[derive(Clone, Debug)]
pub struct Order {
    tokens: Tokens,
    seq_len: usize,
    seed: u64,
    epoch: u64,
    perm: Vec<u32>,
}

impl Order {
    pub fn new(tokens: Tokens, seq_len: usize, seed: u64) -> Self {
        let mut o = Self {
            tokens,
            seq_len,
            seed,
            epoch: u64::MAX,
            perm: Vec::new(),
        };
        o.set_epoch(0);
        o
    }

    /// Non-overlapping windows of seq_len + 1 tokens (inputs plus the shifted targets).
    pub fn sequences_per_epoch(&self) -> usize {
        self.tokens.len().saturating_sub(1) / self.seq_len
    }

    fn set_epoch(&mut self, epoch: u64) {
        if self.epoch == epoch {
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
    pub fn batch_at(&mut self, mut cursor: Cursor, batch: usize) -> Batch {
        let t = self.seq_len;
        let mut inputs = Vec::with_capacity(batch * t);
        let mut targets = Vec::with_capacity(batch * t);
        let mut row = Vec::with_capacity(t + 1);
        let n = self.sequences_per_epoch().max(1) as u64;
        for _ in 0..batch {
            if cursor.index >= n {
                cursor = Cursor {
                    epoch: cursor.epoch + 1,
                    index: 0,
                };
            }
            self.set_epoch(cursor.epoch);
            let seq = self.perm.get(cursor.index as usize).copied().unwrap_or(0) as usize;
            row.clear();
            self.tokens.extend_into(seq * t, t + 1, &mut row);
            inputs.extend_from_slice(&row[..t]);
            targets.extend_from_slice(&row[1..]);
            cursor.index += 1;
        }
        Batch {
            inputs,
            targets,
            batch,
            seq_len: t,
            cursor,
        }
    }
}

impl Order {
    /// Rank `shard.0`'s rows of the global batch of `shard.1 × batch` sequences at `cursor`.
    pub fn shard_at(&mut self, cursor: Cursor, batch: usize, shard: (usize, usize)) -> Batch {
        let (rank, world) = shard;
        if world <= 1 {
            return self.batch_at(cursor, batch);
        }
        let mut b = self.batch_at(cursor, batch * world);
        let t = b.seq_len;
        let rows = crate::distributed::shard_rows(rank, batch);
        for v in [&mut b.inputs, &mut b.targets] {
            v.truncate(rows.end * t);
            v.drain(..rows.start * t);
        }
        b.batch = batch;
        b
    }
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
    rx: Receiver<Batch>,
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
                    cursor = b.cursor;
                    if tx.send(b).is_err() {
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

    /// The next batch and how long the caller waited for it.
    pub fn next_batch(&mut self) -> (Batch, Duration) {
        if self.worker.is_none() {
            self.start_worker();
        }
        let t0 = Instant::now();
        let b = match self.worker.as_ref().map(|w| w.rx.recv()) {
            Some(Ok(b)) => b,
            _ => {
                self.worker = None;
                self.order.shard_at(self.cursor, self.batch, self.shard)
            }
        };
        self.cursor = b.cursor;
        (b, t0.elapsed())
    }
}

impl Drop for Loader {
    fn drop(&mut self) {
        self.stop_worker();
    }
}

/// Fixed, ordered val batches (no shuffle): the first `n_batches` of the val split.
pub fn val_batches(tokens: &Tokens, seq_len: usize, batch: usize, n_batches: usize) -> Vec<Batch> {
    let mut order = Order {
        tokens: tokens.clone(),
        seq_len,
        seed: 0,
        epoch: 0,
        perm: Vec::new(),
    };
    let n = order.sequences_per_epoch();
    order.perm = (0..n as u32).collect();
    let per = batch.min(n).max(1);
    let count = n_batches.min(n / per).max(1);
    (0..count)
        .map(|i| {
            order.batch_at(
                Cursor {
                    epoch: 0,
                    index: (i * per) as u64,
                },
                per,
            )
        })
        .collect()
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
            let (x, _) = a.next_batch();
            let (y, _) = b.next_batch();
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
            seqs_one.extend(one.next_batch().0.inputs);
        }
        let mut two = Loader::new(order.clone(), 4, 3, Cursor::default());
        let mut seqs_two = Vec::new();
        for _ in 0..3 {
            seqs_two.extend(two.next_batch().0.inputs);
        }
        let saved = two.cursor();
        two.set_batch_size(8);
        seqs_two.extend(two.next_batch().0.inputs);
        assert_eq!(seqs_one, seqs_two);
        // Restoring a cursor in a fresh loader continues identically.
        let mut three = Loader::new(order, 4, 1, saved);
        let (b, _) = three.next_batch();
        assert_eq!(&b.inputs[..], &seqs_one[3 * 4 * 8..4 * 4 * 8]);
    }

    #[test]
    fn epochs_wrap_and_reshuffle() {
        let order = Order::new(toks(16 * 10 + 1), 16, 5);
        assert_eq!(order.sequences_per_epoch(), 10);
        let mut l = Loader::new(order, 5, 2, Cursor::default());
        let e0: Vec<u32> = (0..2).flat_map(|_| l.next_batch().0.inputs).collect();
        let e1: Vec<u32> = (0..2).flat_map(|_| l.next_batch().0.inputs).collect();
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
            let (w, _) = whole.next_batch();
            let parts: Vec<Batch> = ranks.iter_mut().map(|l| l.next_batch().0).collect();
            let joined: Vec<u32> = parts.iter().flat_map(|b| b.inputs.clone()).collect();
            assert_eq!(
                joined, w.inputs,
                "rank shards concatenate to the global batch"
            );
            assert!(parts.iter().all(|b| b.cursor == w.cursor && b.batch == 2));
        }
    }
}
