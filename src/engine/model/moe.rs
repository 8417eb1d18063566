//! Routed experts of a Granite 4.0 hybrid layer (transformers' `GraniteMoeHybridMoE`): a
//! linear router picks each token's top-k experts, whose SwiGLU outputs are summed with the
//! softmax of the chosen logits as weights; and the load-balancing loss transformers adds to
//! the training loss (× `router_aux_loss_coef`). Weights under transformers' names:
//! `block_sparse_moe.router.weight [E, C]`, `block_sparse_moe.experts.gate_up_proj [E, 2I, C]`
//! (gate rows, then up), `block_sparse_moe.experts.down_proj [E, C, I]`.

use super::*;
use crate::config::HybridConfig;

/// One layer's experts.
#[derive(Clone, Debug)]
pub(super) struct Moe {
    router: Var,
    gate_up: Var,
    down: Var,
}

impl Moe {
    pub(super) fn new(init: &mut Init, p: &str, s: &ModelSpec, h: &HybridConfig) -> Result<Self> {
        let (e, c, i) = (h.experts, s.n_embd, h.expert_hidden);
        let m = format!("{p}.block_sparse_moe");
        let std = s.init_std;
        let router = init.normal(format!("{m}.router.weight"), (e, c), std, ParamKind::Matrix)?;
        let w = init.draw((e * 2 * i, c), std)?;
        let gate_up = init.tensor(
            format!("{m}.experts.gate_up_proj"),
            &w.reshape((e, 2 * i, c))?,
            ParamKind::Matrix,
        )?;
        let w = init.draw((e * c, i), std / (2.0 * s.n_layer as f64).sqrt())?;
        let down = init.tensor(
            format!("{m}.experts.down_proj"),
            &w.reshape((e, c, i))?,
            ParamKind::Matrix,
        )?;
        Ok(Self {
            router,
            gate_up,
            down,
        })
    }

    /// The whole-model step's view of these weights.
    pub(super) fn step(&self) -> crate::engine::kernels::spec::StepMoe {
        crate::engine::kernels::spec::StepMoe {
            router: self.router.clone(),
            gate_up: self.gate_up.clone(),
            down: self.down.clone(),
        }
    }
}

/// Each row's top `k` columns (largest first).
fn top_k(rows: &[Vec<f32>], k: usize) -> Vec<Vec<usize>> {
    rows.iter()
        .map(|r| {
            let mut idx: Vec<usize> = (0..r.len()).collect();
            idx.sort_by(|&a, &b| r[b].total_cmp(&r[a]).then(a.cmp(&b)));
            idx.truncate(k);
            idx
        })
        .collect()
}

impl Model {
    /// The experts' output `[.., C]` for the normed input `x [.., C]`; the router logits are
    /// kept for [`Self::router_aux_loss`] while training.
    pub(super) fn moe(&self, m: &Moe, x: &Tensor) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        let c = dims[dims.len() - 1];
        let n = x.elem_count() / c;
        let xr = x.reshape((n, c))?;
        let logits = xr
            .matmul(&self.cast(&m.router)?.t()?)?
            .to_dtype(DType::F32)?;
        let (e, k) = match &self.spec.hybrid {
            Some(h) => (h.experts, h.experts_top_k),
            None => candle_core::bail!("experts outside a hybrid model"),
        };
        let chosen = top_k(&logits.to_vec2::<f32>()?, k);
        if self.training {
            if let Ok(mut kept) = self.router_logits.lock() {
                kept.push(logits.clone());
            }
        }
        // Softmax over the chosen logits: the others masked to −∞ (weight 0, gradient 0).
        let mut mask = vec![f32::NEG_INFINITY; n * e];
        let mut tokens: Vec<Vec<u32>> = vec![Vec::new(); e];
        for (row, picks) in chosen.iter().enumerate() {
            for &j in picks {
                mask[row * e + j] = 0.0;
                tokens[j].push(row as u32);
            }
        }
        let mask = Tensor::from_vec(mask, (n, e), x.device())?;
        let weights =
            candle_nn::ops::softmax(&(logits + mask)?, D::Minus1)?.to_dtype(self.dtype)?;
        let (gate_up, down) = (self.cast(&m.gate_up)?, self.cast(&m.down)?);
        let inner = down.dim(2)?;
        // Each expert's weighted outputs, then one index_add of them all in expert order (the
        // order of the adds, so the same sums, bit for bit): a running `out` per expert kept E
        // copies of [n, C] for the backward — 0.4 GB a layer for 64 experts at width 1536 and
        // 2048 rows in bf16.
        let (mut rows_all, mut outs) = (Vec::new(), Vec::new());
        for (j, rows) in tokens.into_iter().enumerate() {
            if rows.is_empty() {
                continue;
            }
            let idx = Tensor::from_vec(rows.clone(), rows.len(), x.device())?;
            let xe = xr.index_select(&idx, 0)?;
            let gu = xe.matmul(&gate_up.get(j)?.t()?)?;
            let hmid =
                (candle_nn::ops::silu(&gu.narrow(1, 0, inner)?)? * gu.narrow(1, inner, inner)?)?;
            let ye = hmid.matmul(&down.get(j)?.t()?)?;
            let we = weights.index_select(&idx, 0)?.narrow(1, j, 1)?;
            outs.push(ye.broadcast_mul(&we)?);
            rows_all.extend(rows);
        }
        let out = Tensor::zeros((n, c), self.dtype, x.device())?;
        if outs.is_empty() {
            return out.reshape(dims);
        }
        let pairs = rows_all.len();
        let idx = Tensor::from_vec(rows_all, pairs, x.device())?;
        out.index_add(&idx, &Tensor::cat(&outs, 0)?, 0)?
            .reshape(dims)
    }

    /// The load-balancing loss of the router logits kept since the last forward began, as
    /// transformers computes it: E · Σₑ (share of the top-k picks that went to e) · (mean
    /// router probability of e), over every layer's tokens together. None without experts or
    /// kept logits.
    pub(super) fn router_aux_loss(&self) -> Result<Option<Tensor>> {
        let Some(h) = self.spec.hybrid.as_ref().filter(|h| h.experts > 0) else {
            return Ok(None);
        };
        let kept: Vec<Tensor> = match self.router_logits.lock() {
            Ok(k) => k.clone(),
            Err(_) => return Ok(None),
        };
        if kept.is_empty() {
            return Ok(None);
        }
        let e = h.experts;
        let mut counts = vec![0f32; e];
        let mut prob_sum: Option<Tensor> = None;
        let mut rows = 0usize;
        for logits in &kept {
            let p = candle_nn::ops::softmax(logits, D::Minus1)?;
            for picks in top_k(&p.to_vec2::<f32>()?, h.experts_top_k) {
                for j in picks {
                    counts[j] += 1.0;
                }
            }
            rows += logits.dim(0)?;
            let s = p.sum(0)?;
            prob_sum = Some(match prob_sum {
                Some(acc) => (acc + s)?,
                None => s,
            });
        }
        let Some(prob_sum) = prob_sum else {
            return Ok(None);
        };
        let counts = Tensor::from_vec(counts, e, prob_sum.device())?;
        let r = rows as f64;
        Ok(Some(
            ((prob_sum * counts)?.sum_all()? * (e as f64 / (r * r)))?,
        ))
    }
}
