//! The fused sampling kernel (src/engine/kernels/cuda/sampling.cuh: one launch chooses the next
//! token of every row) against the candle-ops sampler it replaces on CUDA
//! (src/engine/generate/sampling.rs, run on the CPU as the reference), on random logits:
//!
//! 1. allowed sets: for every row, the tokens the kernel may draw (its floor) are the tokens
//!    the reference keeps, for top-k 0/1/40 × top-p 0.5/0.95/1 × repetition penalty 1/1.3,
//!    vocabularies of 128256 and 50, rows with ties (quantised logits, a constant row). Tokens
//!    at a float-rounding boundary (top-p's cumulative mass within 1e-4 of p, or a value within
//!    1e-5 of the k-th largest: the reference finds its thresholds by a 32-step bisection) may
//!    differ; they are counted and printed;
//! 2. greedy: the kernel's token is the first maximum of the penalised logits (and the
//!    reference's);
//! 3. draws: thousands of seeded draws of one row (the row repeated across a batch, several
//!    steps) fall only on allowed tokens and follow the renormalised probabilities: a
//!    chi-square over the tokens expected ≥ 5 times (the rest pooled) below df + 6·√(2·df) + 10;
//!    and the same seed and step give the same tokens.
//!
//! Needs `--features cuda` and a GPU (`cargo test --features cuda --test gpu_sampling --
//! --nocapture` prints what each check saw); without a CUDA device each test prints a notice and
//! passes.
#![cfg(feature = "cuda")]

use candle_core::{Device, Tensor};
use cockpit::engine::generate::sampling::{fused_args, Sampler};
use cockpit::engine::generate::Sampling;
use cockpit::engine::kernels::sample_rows;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn gpu() -> Option<Device> {
    match Device::new_cuda(0) {
        Ok(dev) => Some(dev),
        Err(e) => {
            eprintln!("no CUDA device ({e}): GPU sampling test skipped");
            None
        }
    }
}

fn normal(rng: &mut StdRng) -> f32 {
    let (u, v): (f64, f64) = (rng.random::<f64>().max(1e-300), rng.random());
    ((-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()) as f32
}

/// Rows of logits of `vocab` tokens: spread 1, 3 and 8; quantised to halves (ties); a few
/// large spikes over a flat floor; and a constant row.
fn logit_rows(vocab: usize, seed: u64) -> Vec<Vec<f32>> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut rows = Vec::new();
    for spread in [1.0f32, 3.0, 8.0] {
        rows.push((0..vocab).map(|_| normal(&mut rng) * spread).collect());
    }
    rows.push(
        (0..vocab)
            .map(|_| (normal(&mut rng) * 4.0).round() / 2.0)
            .collect(),
    );
    let mut spikes: Vec<f32> = (0..vocab).map(|_| normal(&mut rng) * 0.1).collect();
    for i in 0..5 {
        let at = rng.random_range(0..vocab);
        spikes[at] = 6.0 + i as f32;
    }
    rows.push(spikes);
    rows.push(vec![0.25; vocab]);
    rows
}

/// Each row's prompt (what the repetition penalty sees): 30 random tokens and the row's
/// most likely token.
fn prompts_of(rows: &[Vec<f32>], seed: u64) -> Vec<Vec<u32>> {
    let mut rng = StdRng::seed_from_u64(seed);
    rows.iter()
        .map(|r| {
            let mut p: Vec<u32> = (0..30)
                .map(|_| rng.random_range(0..r.len() as u32))
                .collect();
            p.push(first_max(r) as u32);
            p
        })
        .collect()
}

fn first_max(x: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best
}

/// The logit as both samplers see it: penalised where seen, then tempered (f32, as candle's
/// affine ops compute it).
fn value(x: f32, seen: bool, s: &Sampling) -> f32 {
    let r = s.repetition_penalty;
    let mut x = x;
    if seen && r != 1.0 {
        x = if x >= 0.0 {
            x * (1.0 / r) as f32
        } else {
            x * r as f32
        };
    }
    if s.temperature > 0.0 {
        x *= (1.0 / s.temperature) as f32;
    }
    x
}

struct Batch {
    logits: Vec<Vec<f32>>,
    seen: Vec<Vec<bool>>,
    cpu_logits: Tensor,
    cpu_prompts: Tensor,
    gpu_logits: Tensor,
    gpu_seen: Tensor,
}

fn batch(dev: &Device, logits: Vec<Vec<f32>>, prompts: &[Vec<u32>]) -> Batch {
    let (b, v) = (logits.len(), logits[0].len());
    let seen: Vec<Vec<bool>> = prompts
        .iter()
        .map(|p| {
            let mut s = vec![false; v];
            for &t in p {
                s[t as usize] = true;
            }
            s
        })
        .collect();
    let flat: Vec<f32> = logits.iter().flatten().copied().collect();
    let seen_flat: Vec<u8> = seen.iter().flatten().map(|&s| u8::from(s)).collect();
    let p = prompts[0].len();
    let pflat: Vec<u32> = prompts.iter().flatten().copied().collect();
    Batch {
        cpu_logits: Tensor::from_vec(flat.clone(), (b, v), &Device::Cpu).unwrap(),
        cpu_prompts: Tensor::from_vec(pflat, (b, p), &Device::Cpu).unwrap(),
        gpu_logits: Tensor::from_vec(flat, (b, v), dev).unwrap(),
        gpu_seen: Tensor::from_vec(seen_flat, (b, v), dev).unwrap(),
        logits,
        seen,
    }
}

/// The kernel's tokens and floors for `s` at `step`.
fn kernel(b: &Batch, s: &Sampling, step: u64) -> (Vec<u32>, Vec<f32>) {
    let seen = (s.repetition_penalty != 1.0).then_some(&b.gpu_seen);
    let (tok, floor) = sample_rows(&b.gpu_logits, seen, &fused_args(s, s.seed, step)).unwrap();
    (tok.to_vec1().unwrap(), floor.to_vec1().unwrap())
}

/// Whether token `j` of a row sits on a rounding boundary of `s`'s thresholds: its value
/// within 1e-5 (relative) of the k-th largest, or the exact mass of the tokens above it
/// (within top-k) within 1e-4 of top-p.
fn ambiguous(vals: &[f32], j: usize, s: &Sampling) -> bool {
    let mut sorted: Vec<f32> = vals.to_vec();
    sorted.sort_by(|a, b| b.total_cmp(a));
    let k = s.top_k;
    let kth = if k > 0 && k < vals.len() {
        sorted[k - 1]
    } else {
        f32::NEG_INFINITY
    };
    let near = |a: f32, b: f32| (a - b).abs() <= 1e-5 * a.abs().max(b.abs()).max(1e-30);
    if k > 0 && k < vals.len() && near(vals[j], kth) {
        return true;
    }
    if s.top_p >= 1.0 || vals[j] < kth {
        return false;
    }
    let m = sorted[0] as f64;
    let z: f64 = sorted
        .iter()
        .filter(|&&x| x >= kth)
        .map(|&x| (x as f64 - m).exp())
        .sum();
    let above: f64 = sorted
        .iter()
        .filter(|&&x| x > vals[j] && x >= kth)
        .map(|&x| (x as f64 - m).exp())
        .sum::<f64>()
        / z;
    (above - s.top_p).abs() <= 1e-4
}

fn cases() -> Vec<Sampling> {
    let mut out = Vec::new();
    for penalty in [1.0, 1.3] {
        out.push(Sampling {
            repetition_penalty: penalty,
            ..Sampling::greedy()
        });
        for top_k in [0, 1, 40] {
            for top_p in [0.5, 0.95, 1.0] {
                out.push(Sampling {
                    temperature: 0.8,
                    top_k,
                    top_p,
                    repetition_penalty: penalty,
                    seed: 7,
                });
            }
        }
    }
    out
}

#[test]
fn the_kernel_allows_the_tokens_the_reference_allows_and_greedy_is_the_first_maximum() {
    let Some(dev) = gpu() else { return };
    for vocab in [128_256, 50] {
        let rows = logit_rows(vocab, vocab as u64);
        let prompts = prompts_of(&rows, 3);
        let b = batch(&dev, rows, &prompts);
        for s in cases() {
            let reference = Sampler::new(&b.cpu_prompts, vocab, &s, 0).unwrap();
            let want: Vec<Vec<u8>> = reference.allowed(&b.cpu_logits).unwrap().to_vec2().unwrap();
            let (tok, floor) = kernel(&b, &s, 0);
            let (mut sizes, mut boundary) = (Vec::new(), 0);
            for (r, row) in b.logits.iter().enumerate() {
                let vals: Vec<f32> = row
                    .iter()
                    .zip(&b.seen[r])
                    .map(|(&x, &seen)| value(x, seen && s.repetition_penalty != 1.0, &s))
                    .collect();
                let got: Vec<bool> = vals.iter().map(|&x| x >= floor[r]).collect();
                let differ: Vec<usize> = (0..vocab)
                    .filter(|&j| got[j] != (want[r][j] != 0))
                    .collect();
                let (edge, wrong): (Vec<usize>, Vec<usize>) =
                    differ.iter().partition(|&&j| ambiguous(&vals, j, &s));
                assert!(
                    wrong.is_empty(),
                    "vocab {vocab}, {s:?}, row {r}: the kernel's allowed set differs from the \
                     reference at tokens {wrong:?} (and at rounding boundaries {edge:?}); \
                     kernel floor {}",
                    floor[r]
                );
                boundary += edge.len();
                sizes.push(got.iter().filter(|&&a| a).count());
                let t = tok[r] as usize;
                assert!(
                    got[t],
                    "vocab {vocab}, {s:?}, row {r}: drew {t}, not allowed"
                );
                if s.temperature <= 0.0 {
                    assert_eq!(t, first_max(&vals), "vocab {vocab}, {s:?}, row {r}: greedy");
                }
            }
            if s.temperature <= 0.0 {
                let mut cpu = Sampler::new(&b.cpu_prompts, vocab, &s, 0).unwrap();
                let want: Vec<u32> = cpu.sample(&b.cpu_logits).unwrap().to_vec1().unwrap();
                assert_eq!(
                    tok, want,
                    "vocab {vocab}, {s:?}: greedy differs from the reference"
                );
            }
            println!(
                "vocab {vocab:>6}, temperature {}, top-k {:>2}, top-p {:.2}, penalty {}: {} rows, \
                 allowed sets equal to the reference's (sizes {sizes:?}), {boundary} token(s) at \
                 a rounding boundary{}",
                s.temperature,
                s.top_k,
                s.top_p,
                s.repetition_penalty,
                b.logits.len(),
                if s.temperature <= 0.0 {
                    "; greedy = first maximum = reference"
                } else {
                    ""
                }
            );
        }
    }
}

#[test]
fn draws_follow_the_renormalised_probabilities_and_the_seed() {
    let Some(dev) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(11);
    for vocab in [128_256usize, 50] {
        // One row, spread 2 (plus a spike so that top-p 0.5 keeps a handful), repeated over
        // the batch: each launch draws `copies` samples, each step more.
        let mut row: Vec<f32> = (0..vocab).map(|_| normal(&mut rng) * 2.0).collect();
        row[vocab / 3] = row[first_max(&row)] + 0.5;
        let copies = if vocab > 1000 { 2048 } else { 4096 };
        let steps = 8;
        let prompt: Vec<u32> = (0..20).map(|i| (i * 7 % vocab) as u32).collect();
        let b = batch(&dev, vec![row.clone(); copies], &vec![prompt; copies]);
        for (top_k, top_p, penalty) in [
            (0, 1.0, 1.0),
            (0, 0.95, 1.0),
            (0, 0.5, 1.3),
            (40, 1.0, 1.3),
            (40, 0.95, 1.0),
        ] {
            let s = Sampling {
                temperature: 0.8,
                top_k,
                top_p,
                repetition_penalty: penalty,
                seed: 21,
            };
            let reference = Sampler::new(&b.cpu_prompts.narrow(0, 0, 1).unwrap(), vocab, &s, 0)
                .unwrap()
                .allowed(&b.cpu_logits.narrow(0, 0, 1).unwrap())
                .unwrap()
                .to_vec2::<u8>()
                .unwrap()
                .remove(0);
            let vals: Vec<f64> = row
                .iter()
                .zip(&b.seen[0])
                .map(|(&x, &seen)| value(x, seen && penalty != 1.0, &s) as f64)
                .collect();
            let m = vals.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let weight: Vec<f64> = vals
                .iter()
                .zip(&reference)
                .map(|(&x, &a)| if a != 0 { (x - m).exp() } else { 0.0 })
                .collect();
            let z: f64 = weight.iter().sum();
            let mut counts = vec![0u64; vocab];
            let mut first = None;
            for step in 0..steps {
                let (tok, _) = kernel(&b, &s, step);
                first.get_or_insert_with(|| tok.clone());
                for t in tok {
                    counts[t as usize] += 1;
                }
            }
            let n = (copies as u64 * steps) as f64;
            let outside: u64 = (0..vocab)
                .filter(|&j| reference[j] == 0)
                .map(|j| counts[j])
                .sum();
            assert_eq!(
                outside, 0,
                "vocab {vocab}, {s:?}: {outside} draws fell outside the allowed set"
            );
            // Chi-square over the tokens expected ≥ 5 times; the rest pooled.
            let (mut chi2, mut bins, mut pooled_e, mut pooled_o) = (0.0, 0usize, 0.0, 0.0);
            for (w, &c) in weight.iter().zip(&counts) {
                let e = n * w / z;
                let o = c as f64;
                if e >= 5.0 {
                    chi2 += (o - e).powi(2) / e;
                    bins += 1;
                } else {
                    pooled_e += e;
                    pooled_o += o;
                }
            }
            if pooled_e >= 5.0 {
                chi2 += (pooled_o - pooled_e).powi(2) / pooled_e;
                bins += 1;
            }
            let df = bins.saturating_sub(1).max(1) as f64;
            let bound = df + 6.0 * (2.0 * df).sqrt() + 10.0;
            assert!(
                chi2 < bound,
                "vocab {vocab}, {s:?}: chi-square {chi2:.1} on {df} degrees of freedom (bound {bound:.1})"
            );
            // The same seed and step draw the same tokens; another step, others.
            let (again, _) = kernel(&b, &s, 0);
            assert_eq!(
                Some(&again),
                first.as_ref(),
                "vocab {vocab}, {s:?}: not reproducible"
            );
            let (next, _) = kernel(&b, &s, 1);
            assert_ne!(
                Some(&next),
                first.as_ref(),
                "vocab {vocab}, {s:?}: steps draw alike"
            );
            let kept = reference.iter().filter(|&&a| a != 0).count();
            println!(
                "vocab {vocab:>6}, top-k {top_k:>2}, top-p {top_p:.2}, penalty {penalty}: {n} draws \
                 over {kept} allowed tokens, none outside; chi-square {chi2:.1} on {df} df (bound \
                 {bound:.1}); same seed and step, same tokens; another step, others"
            );
        }
    }
}
