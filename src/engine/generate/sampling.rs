//! Choosing the next token of every row of a batch on the device: repetition penalty,
//! temperature, top-k, top-p, then a draw (or the first maximum: greedy), with no trip to
//! the host.
//!
//! top-k and top-p keep the values at or above a per-row threshold that a bisection finds
//! (counting, or summing the probabilities, of what is above it): elementwise ops and row
//! reductions only, no sort, so any device and vocabulary size runs them. The draw is the
//! exponential race (`argmax p / E`, E ~ Exp(1): the Gumbel-max trick), seeded.
//!
//! On CUDA the whole choice is one fused kernel launch a step for every row
//! (src/engine/kernels/cuda/sampling.cuh: radix selects instead of the bisections, one
//! uniform a row from a counter-based generator): the same tokens allowed, drawn from the
//! same distribution; this module's ops stay the CPU path and the reference its GPU test
//! (tests/gpu_sampling.rs) compares it with. `COCKPIT_SAMPLING=ops` keeps the ops on CUDA.

use super::Sampling;
use candle_core::{DType, Device, Result, Tensor, D};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Bisection steps of a threshold: the bracket shrinks 2^32-fold, below f32's resolution.
const SEARCH_STEPS: usize = 32;

/// Where the draws' uniforms come from: the host's seeded generator on the CPU (which candle
/// cannot seed), the device's seeded generator elsewhere.
enum Noise {
    Host(Box<StdRng>),
    Device,
}

/// The sampler of one batch.
pub struct Sampler {
    s: Sampling,
    device: Device,
    /// `[1, vocab]` (f32): 0, 1, 2, ...
    arange: Tensor,
    /// Constants made once on the device (a scalar operand is a copy from the host each
    /// time): `[B, vocab]` views of -inf, of `vocab` and of a tiny positive number, and
    /// `[B, 1]` columns of 0, k, top-p and vocab - 1.
    neg_inf: Tensor,
    past: Tensor,
    tiny: Tensor,
    zero: Tensor,
    k: Tensor,
    top_p: Tensor,
    last: Tensor,
    /// `[B, vocab]` (f32; u8 with the fused kernel): 1 where the row's prompt or output
    /// holds the token (only with a repetition penalty).
    presence: Option<Tensor>,
    noise: Noise,
    /// The fused CUDA kernel chooses ([`fused_on`]).
    fused: bool,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    seed: u64,
    /// Draws so far (the fused kernel's counter).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    step: u64,
}

/// Whether `device` draws with the fused kernel: a CUDA device (built with the `cuda`
/// feature), unless `COCKPIT_SAMPLING=ops` asks for the candle ops.
pub fn fused_on(device: &Device) -> bool {
    cfg!(feature = "cuda")
        && device.is_cuda()
        && std::env::var("COCKPIT_SAMPLING").as_deref() != Ok("ops")
}

/// The fused kernel's arguments for `s`, drawing from `seed` at `step`.
#[cfg(feature = "cuda")]
pub fn fused_args(s: &Sampling, seed: u64, step: u64) -> crate::engine::kernels::SampleArgs {
    let r = s.repetition_penalty;
    crate::engine::kernels::SampleArgs {
        greedy: s.temperature <= 0.0,
        // As candle's `x / t` (an affine by 1 / t in f32).
        inv_t: if s.temperature > 0.0 {
            (1.0 / s.temperature) as f32
        } else {
            1.0
        },
        pen_pos: (1.0 / r) as f32,
        pen_neg: r as f32,
        top_k: s.top_k,
        top_p: s.top_p as f32,
        seed,
        step,
    }
}

impl Sampler {
    /// A sampler for the rows of `prompts` (`[B, P]` u32, padding included: it must repeat
    /// a token of its row) drawing from `seed`.
    pub fn new(prompts: &Tensor, vocab: usize, s: &Sampling, seed: u64) -> Result<Self> {
        let device = prompts.device().clone();
        let rows = prompts.dim(0)?;
        let full = |v: f32, cols: usize| -> Result<Tensor> {
            Tensor::new(&[[v]], &device)?.broadcast_as((rows, cols))
        };
        let arange = Tensor::arange(0u32, vocab as u32, &device)?
            .to_dtype(DType::F32)?
            .reshape((1, vocab))?;
        let fused = fused_on(&device);
        let presence = if s.repetition_penalty != 1.0 {
            let (b, p) = prompts.dims2()?;
            let ones = Tensor::ones((b, p), DType::F32, &device)?;
            let counts =
                Tensor::zeros((b, vocab), DType::F32, &device)?.scatter_add(prompts, &ones, 1)?;
            let seen = counts.gt(0.0)?;
            Some(if fused {
                seen
            } else {
                seen.to_dtype(DType::F32)?
            })
        } else {
            None
        };
        let noise = if s.temperature <= 0.0 || fused {
            Noise::Device
        } else if device.is_cpu() {
            Noise::Host(Box::new(StdRng::seed_from_u64(seed)))
        } else {
            device.set_seed(seed)?;
            Noise::Device
        };
        Ok(Self {
            s: s.clone(),
            arange,
            neg_inf: full(f32::NEG_INFINITY, vocab)?,
            past: full(vocab as f32, vocab)?,
            tiny: full(1e-30, vocab)?,
            zero: full(0.0, 1)?,
            k: full(s.top_k as f32, 1)?,
            top_p: full(s.top_p as f32, 1)?,
            last: full(vocab.saturating_sub(1) as f32, 1)?,
            device,
            presence,
            noise,
            fused,
            seed,
            step: 0,
        })
    }

    /// The next token of each row (`[B]` u32) from its logits `[B, vocab]` (f32).
    pub fn sample(&mut self, logits: &Tensor) -> Result<Tensor> {
        if self.fused {
            return self.sample_fused(logits);
        }
        let x = self.filtered(logits)?;
        if self.s.temperature <= 0.0 {
            return self.argmax_first(&x);
        }
        let (b, v) = x.dims2()?;
        // Gumbel-max: argmax(x - ln E), E = -ln U ~ Exp(1).
        let u = match &mut self.noise {
            Noise::Host(rng) => {
                let u: Vec<f32> = (0..b * v).map(|_| rng.random::<f32>()).collect();
                Tensor::from_vec(u, (b, v), &self.device)?
            }
            Noise::Device => Tensor::rand(0f32, 1f32, (b, v), &self.device)?,
        };
        let e = u.log()?.neg()?.maximum(&self.tiny)?;
        self.argmax_first(&(x - e.log()?)?)
    }

    #[cfg(feature = "cuda")]
    fn sample_fused(&mut self, logits: &Tensor) -> Result<Tensor> {
        let x = logits.to_dtype(DType::F32)?.contiguous()?;
        let args = fused_args(&self.s, self.seed, self.step);
        self.step += 1;
        let (tok, _) = crate::engine::kernels::sample_rows(&x, self.presence.as_ref(), &args)?;
        Ok(tok)
    }

    #[cfg(not(feature = "cuda"))]
    fn sample_fused(&mut self, _: &Tensor) -> Result<Tensor> {
        candle_core::bail!("the fused sampling kernel needs the cuda feature")
    }

    /// The logits as the ops path draws from them: penalised; then (unless greedy) tempered,
    /// -inf outside top-k and top-p.
    fn filtered(&self, logits: &Tensor) -> Result<Tensor> {
        let mut x = logits.to_dtype(DType::F32)?;
        if let Some(seen) = &self.presence {
            let r = self.s.repetition_penalty;
            let positive = x.broadcast_ge(&self.zero)?;
            let penalized = positive.where_cond(&(&x / r)?, &(&x * r)?)?;
            let seen = seen.to_dtype(DType::F32)?;
            x = seen.broadcast_gt(&self.zero)?.where_cond(&penalized, &x)?;
        }
        if self.s.temperature <= 0.0 {
            return Ok(x);
        }
        x = (x / self.s.temperature)?;
        let v = x.dim(1)?;
        if self.s.top_k > 0 && self.s.top_k < v {
            let tau = kth_largest(&x, &self.k)?;
            x = x.broadcast_ge(&tau)?.where_cond(&x, &self.neg_inf)?;
        }
        if self.s.top_p < 1.0 {
            let p = candle_nn::ops::softmax_last_dim(&x)?;
            let tau = nucleus_floor(&p, &self.zero, &self.top_p)?;
            x = p.broadcast_ge(&tau)?.where_cond(&x, &self.neg_inf)?;
        }
        Ok(x)
    }

    /// The tokens the ops path may choose from `logits` `[B, vocab]`: `[B, vocab]` u8, 1 where
    /// allowed (greedy: the maxima; sampling: the tokens left by top-k and top-p). The
    /// reference the fused kernel is tested against.
    pub fn allowed(&self, logits: &Tensor) -> Result<Tensor> {
        let x = self.filtered(logits)?;
        if self.s.temperature <= 0.0 {
            return x.broadcast_eq(&x.max_keepdim(D::Minus1)?);
        }
        x.gt(&self.neg_inf)
    }

    /// Note the tokens just chosen (`[B]` u32) for the repetition penalty.
    pub fn observe(&mut self, tokens: &Tensor) -> Result<()> {
        #[cfg(feature = "cuda")]
        if self.fused {
            if let Some(seen) = &self.presence {
                crate::engine::kernels::sample_observe(seen, &tokens.contiguous()?)?;
            }
            return Ok(());
        }
        if let Some(seen) = &self.presence {
            let t = tokens.to_dtype(DType::F32)?.unsqueeze(1)?;
            let hit = self.arange.broadcast_eq(&t)?.to_dtype(DType::F32)?;
            self.presence = Some(seen.maximum(&hit)?);
        }
        Ok(())
    }

    /// The first index of each row's maximum (`[B]` u32), as torch.argmax.
    fn argmax_first(&self, x: &Tensor) -> Result<Tensor> {
        let (b, v) = x.dims2()?;
        let top = x.max_keepdim(D::Minus1)?;
        let idx = x
            .broadcast_eq(&top)?
            .where_cond(&self.arange.broadcast_as((b, v))?, &self.past)?
            .min_keepdim(D::Minus1)?;
        // A row of NaN has no maximum: the last token rather than an index past the table.
        idx.minimum(&self.last)?.squeeze(1)?.to_dtype(DType::U32)
    }
}

/// `[B, 1]`: for each row of `x` `[B, V]`, a value that `k` (`[B, 1]`; or, on ties, a few more) of its
/// entries reach.
fn kth_largest(x: &Tensor, k: &Tensor) -> Result<Tensor> {
    let mut lo = x.min_keepdim(D::Minus1)?;
    let mut hi = x.max_keepdim(D::Minus1)?;
    for _ in 0..SEARCH_STEPS {
        let mid = ((&lo + &hi)? * 0.5)?;
        let count = x
            .broadcast_ge(&mid)?
            .to_dtype(DType::F32)?
            .sum_keepdim(D::Minus1)?;
        let enough = count.ge(k)?;
        lo = enough.where_cond(&mid, &lo)?;
        hi = enough.where_cond(&hi, &mid)?;
    }
    Ok(lo)
}

/// `[B, 1]`: for each row of probabilities `p` `[B, V]`, the largest floor whose entries at
/// or above it hold at least `top_p` of the mass (the nucleus: the fewest most likely
/// tokens that reach `top_p`).
fn nucleus_floor(p: &Tensor, zero: &Tensor, top_p: &Tensor) -> Result<Tensor> {
    let mut lo = zero.clone();
    let mut hi = p.max_keepdim(D::Minus1)?;
    for _ in 0..SEARCH_STEPS {
        let mid = ((&lo + &hi)? * 0.5)?;
        let above = p.broadcast_ge(&mid)?.to_dtype(DType::F32)?;
        let mass = (p * above)?.sum_keepdim(D::Minus1)?;
        let enough = mass.ge(top_p)?;
        lo = enough.where_cond(&mid, &lo)?;
        hi = enough.where_cond(&hi, &mid)?;
    }
    Ok(lo)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampler(s: Sampling, rows: usize) -> Sampler {
        let prompts = Tensor::zeros((rows, 1), DType::U32, &Device::Cpu).unwrap();
        Sampler::new(&prompts, 4, &s, 7).unwrap()
    }

    fn draw(sm: &mut Sampler, logits: &[f32]) -> u32 {
        let x = Tensor::from_vec(logits.to_vec(), (1, logits.len()), &Device::Cpu).unwrap();
        sm.sample(&x).unwrap().to_vec1::<u32>().unwrap()[0]
    }

    #[test]
    fn greedy_takes_the_first_maximum_and_sampling_respects_top_k_and_top_p() {
        let mut g = sampler(Sampling::greedy(), 1);
        assert_eq!(draw(&mut g, &[0.1, 3.0, 3.0, -1.0]), 1);
        let mut k = sampler(
            Sampling {
                temperature: 1.0,
                top_k: 2,
                ..Sampling::greedy()
            },
            1,
        );
        let mut seen = [0; 4];
        for _ in 0..300 {
            seen[draw(&mut k, &[0.0, 2.0, 1.9, 1.8]) as usize] += 1;
        }
        assert_eq!(seen[0] + seen[3], 0, "top-k 2 drew {seen:?}");
        assert!(seen[1] > 50 && seen[2] > 50, "{seen:?}");
        let mut nucleus = sampler(
            Sampling {
                temperature: 1.0,
                top_p: 0.5,
                ..Sampling::greedy()
            },
            1,
        );
        for _ in 0..200 {
            assert_eq!(draw(&mut nucleus, &[0.0, 5.0, 1.0, 1.0]), 1);
        }
    }

    #[test]
    fn draws_follow_the_distribution_and_the_seed() {
        let s = Sampling {
            temperature: 1.0,
            ..Sampling::greedy()
        };
        let p = [0.1f32, 0.2, 0.3, 0.4];
        let logits: Vec<f32> = p.iter().map(|v| v.ln()).collect();
        let mut sm = sampler(s.clone(), 1);
        let mut seen = [0f64; 4];
        let n = 4000;
        for _ in 0..n {
            seen[draw(&mut sm, &logits) as usize] += 1.0;
        }
        for (i, want) in p.iter().enumerate() {
            let got = seen[i] / n as f64;
            assert!(
                (got - *want as f64).abs() < 0.03,
                "token {i}: {got} vs {want}"
            );
        }
        let run = |seed| {
            let prompts = Tensor::zeros((1, 1), DType::U32, &Device::Cpu).unwrap();
            let mut sm = Sampler::new(&prompts, 4, &s, seed).unwrap();
            (0..20).map(|_| draw(&mut sm, &logits)).collect::<Vec<_>>()
        };
        assert_eq!(run(3), run(3));
        assert_ne!(run(3), run(4));
    }

    #[test]
    fn the_allowed_tokens_are_the_maxima_or_what_top_k_and_top_p_leave() {
        let logits = Tensor::new(&[[0.0f32, 2.0, 2.0, 1.0]], &Device::Cpu).unwrap();
        let allowed = |s: Sampling| -> Vec<u8> {
            sampler(s, 1).allowed(&logits).unwrap().to_vec2().unwrap()[0].clone()
        };
        assert_eq!(allowed(Sampling::greedy()), [0, 1, 1, 0]);
        let t1 = Sampling {
            temperature: 1.0,
            ..Sampling::greedy()
        };
        assert_eq!(allowed(t1.clone()), [1, 1, 1, 1]);
        // top-k 1 keeps both maxima (a tie); top-k 3 the three largest.
        let k = |top_k| Sampling {
            top_k,
            ..t1.clone()
        };
        assert_eq!(allowed(k(1)), [0, 1, 1, 0]);
        assert_eq!(allowed(k(3)), [0, 1, 1, 1]);
        // p = (0.054, 0.399, 0.399, 0.147): 0.5 needs both maxima (tied), 0.8 the third too.
        let p = |top_p| Sampling {
            top_p,
            ..t1.clone()
        };
        assert_eq!(allowed(p(0.5)), [0, 1, 1, 0]);
        assert_eq!(allowed(p(0.8)), [0, 1, 1, 1]);
    }

    #[test]
    fn the_repetition_penalty_pushes_seen_tokens_down() {
        let s = Sampling {
            repetition_penalty: 4.0,
            ..Sampling::greedy()
        };
        // The prompt holds token 1: its logit 2.0 becomes 0.5, below token 2's 1.0.
        let prompts = Tensor::new(&[[1u32, 1]], &Device::Cpu).unwrap();
        let mut sm = Sampler::new(&prompts, 4, &s, 0).unwrap();
        assert_eq!(draw(&mut sm, &[0.0, 2.0, 1.0, -3.0]), 2);
        // Token 2 chosen: now penalised as well (1.0 → 0.25), and token 0 (0.6) wins over 0.5.
        sm.observe(&Tensor::new(&[2u32], &Device::Cpu).unwrap())
            .unwrap();
        assert_eq!(draw(&mut sm, &[0.6, 2.0, 1.0, -3.0]), 0);
    }
}
