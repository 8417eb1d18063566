//! How different the N samples of a prompt are: distinct-n (the share of their n-grams that
//! are unique) and the mean pairwise cosine distance between their embeddings (the model's
//! own final hidden states, mean-pooled over each sample's new tokens), every pair of every
//! prompt at once as one normalized matmul on the device.

use candle_core::{Result, Tensor, D};
use std::collections::HashSet;

/// The diversity of one prompt's samples (None where it is undefined: no n-grams, fewer
/// than two samples).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Diversity {
    pub distinct_1: Option<f64>,
    pub distinct_2: Option<f64>,
    pub distinct_3: Option<f64>,
    /// Mean over pairs of samples of 1 - cos(embedding_i, embedding_j).
    pub cosine_distance: Option<f64>,
}

/// Distinct n-grams over all n-grams of the samples (each sample's own n-grams: none span
/// two samples).
pub fn distinct_n(samples: &[&[u32]], n: usize) -> Option<f64> {
    let mut seen: HashSet<&[u32]> = HashSet::new();
    let mut total = 0usize;
    for s in samples {
        if n == 0 || s.len() < n {
            continue;
        }
        for g in s.windows(n) {
            seen.insert(g);
            total += 1;
        }
    }
    (total > 0).then(|| seen.len() as f64 / total as f64)
}

/// For embeddings `[P, N, D]` (P prompts, N samples each): each prompt's mean pairwise
/// cosine distance over its N·(N-1) ordered pairs (None when N < 2).
pub fn pairwise_cosine_distance(emb: &Tensor) -> Result<Vec<Option<f64>>> {
    let (p, n, _) = emb.dims3()?;
    if n < 2 {
        return Ok(vec![None; p]);
    }
    let emb = emb.to_dtype(candle_core::DType::F32)?;
    let norm = emb.sqr()?.sum_keepdim(D::Minus1)?.sqrt()?;
    let tiny = Tensor::new(&[[[1e-12f32]]], emb.device())?.broadcast_as(norm.shape())?;
    let unit = emb.broadcast_div(&norm.maximum(&tiny)?)?;
    // [P, N, N]: every pair's cosine similarity.
    let sim = unit.matmul(&unit.t()?.contiguous()?)?;
    let all = sim.sum((1, 2))?;
    let diagonal = unit.sqr()?.sum((1, 2))?;
    let pairs = (n * (n - 1)) as f64;
    let mean_sim: Vec<f32> = ((all - diagonal)? / pairs)?.to_vec1()?;
    Ok(mean_sim
        .into_iter()
        .map(|s| Some(1.0 - f64::from(s)))
        .collect())
}

/// One prompt's [`Diversity`] from its samples' ids and its cosine distance.
pub fn of_samples(samples: &[&[u32]], cosine_distance: Option<f64>) -> Diversity {
    Diversity {
        distinct_1: distinct_n(samples, 1),
        distinct_2: distinct_n(samples, 2),
        distinct_3: distinct_n(samples, 3),
        cosine_distance,
    }
}

/// The mean of each figure over prompts (over those where it is defined).
pub fn mean(all: &[Diversity]) -> Diversity {
    let avg = |f: &dyn Fn(&Diversity) -> Option<f64>| {
        let v: Vec<f64> = all.iter().filter_map(f).collect();
        (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
    };
    Diversity {
        distinct_1: avg(&|d| d.distinct_1),
        distinct_2: avg(&|d| d.distinct_2),
        distinct_3: avg(&|d| d.distinct_3),
        cosine_distance: avg(&|d| d.cosine_distance),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn distinct_n_counts_unique_n_grams_over_all_samples() {
        let a = [1u32, 2, 3, 1, 2];
        let b = [1u32, 2, 4];
        let s: [&[u32]; 2] = [&a, &b];
        // unigrams: 1 2 3 1 2 1 2 4 → {1,2,3,4} of 8
        assert_eq!(distinct_n(&s, 1), Some(4.0 / 8.0));
        // bigrams: 12 23 31 12 | 12 24 → {12,23,31,24} of 6
        assert_eq!(distinct_n(&s, 2), Some(4.0 / 6.0));
        assert_eq!(distinct_n(&[&[1u32][..]], 2), None);
    }

    #[test]
    fn cosine_distance_of_every_pair_at_once() {
        // Prompt 0: the same direction thrice (distance 0); prompt 1: x, y, -x.
        let e = Tensor::new(
            &[
                [[1f32, 0.0], [2.0, 0.0], [0.5, 0.0]],
                [[1.0, 0.0], [0.0, 3.0], [-1.0, 0.0]],
            ],
            &Device::Cpu,
        )
        .unwrap();
        let d = pairwise_cosine_distance(&e).unwrap();
        assert!(d[0].unwrap().abs() < 1e-6, "{d:?}");
        // pairs: (x,y) 1, (x,-x) 2, (y,-x) 1 → mean 4/3
        assert!((d[1].unwrap() - 4.0 / 3.0).abs() < 1e-6, "{d:?}");
        let one = Tensor::zeros((2, 1, 3), candle_core::DType::F32, &Device::Cpu).unwrap();
        assert_eq!(pairwise_cosine_distance(&one).unwrap(), vec![None, None]);
    }
}
