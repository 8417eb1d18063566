//! The whole forward: embedding, blocks, final norm, logits and losses.

use super::*;

impl Model {
    /// Logits `[B·T, vocab]` in the compute dtype for token ids `[B, T]` (u32).
    pub fn forward(&mut self, ids: &Tensor, train: bool) -> Result<Tensor> {
        let (x, head) = self.hidden(ids, train)?;
        self.head_logits(&x, &head)
    }

    /// The final hidden states `[B·T, n_embd]` and the output projection `[vocab, n_embd]`
    /// (both in the compute dtype).
    pub(super) fn hidden(&mut self, ids: &Tensor, train: bool) -> Result<(Tensor, Tensor)> {
        self.training = train;
        let (bsz, t) = ids.dims2()?;
        let wte = self.cast(&self.wte)?;
        let mut x = if self.fused(self.spec.kernels.linear, &wte) && ids.dtype() == DType::U32 {
            kernels::embedding(ids, &wte)?
        } else {
            wte.embedding(&ids.flatten_all()?)?
                .reshape((bsz, t, self.spec.n_embd))?
        };
        if self.spec.embedding_multiplier != 1.0 {
            x = (x * self.spec.embedding_multiplier)?;
        }
        if let Some(wpe) = &self.wpe {
            x = match self.packed_for((bsz, t)) {
                // Positions restart at each packed sample.
                Some(p) => {
                    (x + self.cast(wpe)?.index_select(&p.positions, 0)?.reshape((
                        bsz,
                        t,
                        self.spec.n_embd,
                    ))?)?
                }
                None => x.broadcast_add(&self.cast(wpe)?.narrow(0, 0, t)?)?,
            };
        }
        x = self.dropout(&x, train, dropout::site_embedding(), Layout::Rows)?;
        if let Ok(mut kept) = self.router_logits.lock() {
            kept.clear();
        }
        for (l, b) in self.blocks.iter().enumerate() {
            let h = self.block_input(&b.ln1, &x)?;
            let mixed = match &b.mixer {
                Mixer::Attention(_) => self.attention(l, b, &h, train)?,
                Mixer::Mamba(m) => self.mamba(m, &h)?,
            };
            let a = self.residual(self.block_output(&b.ln1, b.post_attn.as_ref(), mixed)?)?;
            x = (x + self.dropout(&a, train, dropout::site_attention_out(l), Layout::Rows)?)?;
            let h = self.block_input(&b.ln2, &x)?;
            let m = self.mlp(b, &h)?;
            let m = self.residual(self.block_output(&b.ln2, b.post_mlp.as_ref(), m)?)?;
            x = (x + self.dropout(&m, train, dropout::site_mlp_out(l), Layout::Rows)?)?;
        }
        let x = self.final_norm(&x)?.reshape((bsz * t, self.spec.n_embd))?;
        let head = match &self.lm_head {
            Some(w) => self.cast(w)?,
            None => wte,
        };
        Ok((x, head))
    }

    /// What a block's attention or MLP reads: the residual stream normed by `n` (pre-norm),
    /// or as it is (post-norm: OLMo 2).
    pub(super) fn block_input(&self, n: &NormLayer, x: &Tensor) -> Result<Tensor> {
        if self.spec.layout.post_norm {
            Ok(x.clone())
        } else {
            self.norm(n, x)
        }
    }

    /// What a block's attention or MLP adds to the residual stream: its output, normed by
    /// `post` (Gemma's sandwich) or by `n` in a post-norm block (OLMo 2).
    pub(super) fn block_output(
        &self,
        n: &NormLayer,
        post: Option<&NormLayer>,
        y: Tensor,
    ) -> Result<Tensor> {
        if let Some(p) = post {
            self.norm(p, &y)
        } else if self.spec.layout.post_norm {
            self.norm(n, &y)
        } else {
            Ok(y)
        }
    }

    /// Granite's residual multiplier on a block's attention or MLP output.
    pub(super) fn residual(&self, y: Tensor) -> Result<Tensor> {
        match self.spec.residual_multiplier {
            1.0 => Ok(y),
            m => y * m,
        }
    }

    /// The final norm, with Granite's logits scaling folded in (`(x/s)·Wᵀ = (x·Wᵀ)/s`).
    pub(super) fn final_norm(&self, x: &Tensor) -> Result<Tensor> {
        let x = self.norm(&self.ln_f, x)?;
        match self.spec.logits_scaling {
            1.0 => Ok(x),
            s => x * (1.0 / s),
        }
    }

    /// Mean cross-entropy in nats (f32 scalar tensor) of the next-token predictions; while
    /// training a model with routed experts, plus their load-balancing loss ×
    /// `router_aux_loss_coef` (as transformers' training loss).
    pub fn loss(&mut self, ids: &Tensor, targets: &Tensor, train: bool) -> Result<Tensor> {
        let ce = self.ce_loss(ids, targets, train)?;
        self.with_router_aux(ce, train)
    }

    /// `loss` plus the experts' load-balancing loss × its coefficient, while training.
    pub(super) fn with_router_aux(&self, loss: Tensor, train: bool) -> Result<Tensor> {
        let coef = self
            .spec
            .hybrid
            .as_ref()
            .map_or(0.0, |h| h.router_aux_loss_coef);
        match self.router_aux_loss()? {
            Some(aux) if train && coef > 0.0 => {
                let dt = loss.dtype();
                loss + (aux * coef)?.to_dtype(dt)?
            }
            _ => Ok(loss),
        }
    }

    /// The load-balancing loss of the experts' routers over the last training forward (None
    /// without routed experts).
    pub fn router_aux(&self) -> Result<Option<Tensor>> {
        self.router_aux_loss()
    }

    /// Whether the loss takes the head matmul and the cross-entropy as one kernel (the logits
    /// never exist): CUDA, the kernels on, no final soft-cap (Gemma 2's caps the logits).
    pub(super) fn fused_head_loss(&self) -> bool {
        self.spec.kernels.linear
            && self.spec.kernels.cross_entropy
            && kernels::usable(self.wte.as_tensor())
            && self.dtype != DType::F64
            && self.spec.final_softcap().is_none()
    }

    /// Logits `[rows, vocab]` of final hidden states `x` `[rows, n_embd]` and the output
    /// projection, with Gemma 2's final soft-cap (`cap·tanh(logits/cap)`).
    pub(super) fn head_logits(&self, x: &Tensor, head: &Tensor) -> Result<Tensor> {
        let logits = if self.fused(self.spec.kernels.linear, x) {
            kernels::linear(x, head, None)?
        } else {
            x.matmul(&head.t()?)?
        };
        match self.spec.final_softcap() {
            Some(cap) => (logits / cap)?.tanh()? * cap,
            None => Ok(logits),
        }
    }

    /// Mean cross-entropy in nats (f32 scalar tensor) of the next-token predictions.
    fn ce_loss(&mut self, ids: &Tensor, targets: &Tensor, train: bool) -> Result<Tensor> {
        if targets.dtype() == DType::U32 && self.fused_head_loss() {
            // Head matmul and CE as one node: the logits never enter the graph.
            let (x, head) = self.hidden(ids, train)?;
            return kernels::lm_head_cross_entropy(&x, &head, targets)?.mean_all();
        }
        let logits = self.forward(ids, train)?;
        if self.fused(self.spec.kernels.cross_entropy, &logits) && targets.dtype() == DType::U32 {
            return kernels::cross_entropy_rows(&logits, targets)?.mean_all();
        }
        let logits = logits.to_dtype(DType::F32)?;
        candle_nn::loss::cross_entropy(&logits, &targets.flatten_all()?)
    }

    /// Cross-entropy in nats (f32 `[B·T]`) of each next-token prediction, without dropout
    /// (the eval's per-window losses).
    pub fn token_losses(&mut self, ids: &Tensor, targets: &Tensor) -> Result<Tensor> {
        if targets.dtype() == DType::U32 && self.fused_head_loss() {
            let (x, head) = self.hidden(ids, false)?;
            return kernels::lm_head_cross_entropy(&x, &head, targets)?
                .detach()
                .to_dtype(DType::F32);
        }
        let logits = self.forward(ids, false)?;
        if self.fused(self.spec.kernels.cross_entropy, &logits) && targets.dtype() == DType::U32 {
            return kernels::cross_entropy_rows(&logits, targets)?
                .detach()
                .to_dtype(DType::F32);
        }
        let logp = candle_nn::ops::log_softmax(&logits.to_dtype(DType::F32)?, D::Minus1)?;
        let t = targets.flatten_all()?.unsqueeze(1)?;
        logp.gather(&t, 1)?
            .squeeze(1)?
            .neg()?
            .detach()
            .to_dtype(DType::F32)
    }
}
