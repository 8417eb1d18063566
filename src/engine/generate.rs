//! Text generation: a KV-cached decode loop over the model, greedy or sampled (temperature,
//! top-k, top-p), calling back with each token as it comes.

use super::model::Model;
use candle_core::Result;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// How the next token is chosen.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampling {
    /// 0 = greedy (the most likely token); otherwise logits ÷ temperature.
    pub temperature: f64,
    /// Keep the k most likely tokens; 0 = all.
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches p; 1 = all.
    pub top_p: f64,
    pub seed: u64,
}

impl Sampling {
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

/// The first index of the largest value (as torch.argmax).
fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// Pick a token from one row of logits.
pub fn pick(logits: &[f32], s: &Sampling, rng: &mut StdRng) -> u32 {
    if s.temperature <= 0.0 || logits.len() < 2 {
        return argmax(logits);
    }
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    if s.top_k > 0 {
        order.truncate(s.top_k);
    }
    let top = logits[order[0]] as f64;
    let mut probs: Vec<f64> = order
        .iter()
        .map(|&i| ((logits[i] as f64 - top) / s.temperature).exp())
        .collect();
    let total: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= total);
    if s.top_p < 1.0 {
        let mut cum = 0.0;
        let keep = probs
            .iter()
            .position(|p| {
                cum += p;
                cum >= s.top_p
            })
            .map_or(probs.len(), |i| i + 1);
        probs.truncate(keep);
        order.truncate(keep);
    }
    let total: f64 = probs.iter().sum();
    let mut u = rng.random::<f64>() * total;
    for (p, &i) in probs.iter().zip(&order) {
        u -= p;
        if u <= 0.0 {
            return i as u32;
        }
    }
    order[order.len() - 1] as u32
}

/// Continue `prompt` by up to `max_new` tokens, stopping after a token of `stop`; `on_token`
/// sees each new token as it is chosen. Returns the new tokens.
pub fn generate(
    model: &Model,
    prompt: &[u32],
    max_new: usize,
    sampling: &Sampling,
    stop: &[u32],
    mut on_token: impl FnMut(u32),
) -> Result<Vec<u32>> {
    if prompt.is_empty() {
        candle_core::bail!("the prompt has no tokens");
    }
    let mut rng = StdRng::seed_from_u64(sampling.seed);
    let mut cache = model.kv_cache();
    let mut logits = model.decode(prompt, &mut cache)?;
    let mut out = Vec::with_capacity(max_new);
    while out.len() < max_new {
        let rows = logits.dim(0)?;
        let last: Vec<f32> = logits.get(rows - 1)?.to_vec1()?;
        let tok = pick(&last, sampling, &mut rng);
        out.push(tok);
        on_token(tok);
        if stop.contains(&tok) || out.len() == max_new {
            break;
        }
        logits = model.decode(&[tok], &mut cache)?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_first_maximum_and_sampling_respects_top_k() {
        let mut rng = StdRng::seed_from_u64(1);
        assert_eq!(
            pick(&[0.1, 3.0, 3.0, -1.0], &Sampling::greedy(), &mut rng),
            1
        );
        let s = Sampling {
            temperature: 1.0,
            top_k: 2,
            top_p: 1.0,
            seed: 0,
        };
        for _ in 0..200 {
            let t = pick(&[0.0, 2.0, 1.9, 1.8], &s, &mut rng);
            assert!(t == 1 || t == 2, "top-k 2 drew {t}");
        }
        let nucleus = Sampling {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.5,
            seed: 0,
        };
        for _ in 0..200 {
            assert_eq!(pick(&[0.0, 5.0, 1.0, 1.0], &nucleus, &mut rng), 1);
        }
    }
}
