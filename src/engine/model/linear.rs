//! Linear layers (a dense or quantized matrix, an optional bias, an optional LoRA adapter) and the
//! candle model's casts and dropout.

use super::*;

/// A LoRA adapter: `x·Aᵀ·Bᵀ·(alpha/r)`, B starts at zero so training starts from the base.
#[derive(Clone, Debug)]
pub(super) struct Lora {
    pub(super) a: Var,
    pub(super) b: Var,
    pub(super) scale: f64,
    /// Dropout on the adapter's input (`lora.dropout`; PEFT's `lora_dropout`) and its mask
    /// site: one mask per layer and group of adapters that share their input
    /// ([`dropout::site_lora`]), as the whole-model step draws it.
    pub(super) p: f64,
    pub(super) site: u32,
}

#[derive(Clone, Debug)]
pub(super) struct Linear {
    pub(super) w: Weight,
    pub(super) b: Option<Var>,
    pub(super) lora: Option<Lora>,
}

/// A linear layer's matrix: a parameter, or (a frozen LoRA base with
/// `lora.base_dtype = "nf4"`) a quantized copy (NF4, or a GGUF file's blocks) that is
/// dequantized where it is used.
#[derive(Clone, Debug)]
pub(super) enum Weight {
    Dense(Var),
    Quantized(std::sync::Arc<Quantized>),
}

impl Weight {
    /// `(out, in)`.
    pub(super) fn dims2(&self) -> Result<(usize, usize)> {
        match self {
            Weight::Dense(v) => v.as_tensor().dims2(),
            Weight::Quantized(q) => Ok(q.dims()),
        }
    }
}

impl Model {
    pub(super) fn cast(&self, v: &Var) -> Result<Tensor> {
        if self.dtype == DType::F32 {
            Ok(v.as_tensor().clone())
        } else {
            v.as_tensor().to_dtype(self.dtype)
        }
    }

    /// A linear layer's matrix in the compute dtype (a 4-bit one dequantized).
    pub(super) fn weight(&self, w: &Weight) -> Result<Tensor> {
        self.weight_as(w, self.dtype)
    }

    pub(super) fn weight_as(&self, w: &Weight, dtype: DType) -> Result<Tensor> {
        match w {
            Weight::Dense(v) => v.as_tensor().to_dtype(dtype),
            Weight::Quantized(q) => q.dequantize(dtype),
        }
    }

    /// Whether a fused kernel switch applies to this tensor (CUDA, a float compute dtype).
    pub(super) fn fused(&self, on: bool, t: &Tensor) -> bool {
        on && kernels::usable(t)
    }

    /// `x·Wᵀ` (+ the LoRA delta) as one 2-D matmul over `[rows, in]`, without the bias.
    /// The 2-D form keeps the weight gradient a single `[in, rows]·[rows, out]` matmul
    /// (a batched `broadcast_matmul` would build a per-batch gradient and sum it).
    pub(super) fn linear_nobias(&self, l: &Linear, x2: &Tensor) -> Result<Tensor> {
        let w = self.weight(&l.w)?;
        let mut y = x2.matmul(&w.t()?)?;
        if let Some(lora) = &l.lora {
            let a = self.cast(&lora.a)?;
            let b = self.cast(&lora.b)?;
            let xd = self.dropout_p(x2, lora.p, self.training, lora.site, Layout::Rows)?;
            let delta = xd.matmul(&a.t()?)?.matmul(&b.t()?)?;
            y = (y + (delta * lora.scale)?)?;
        }
        Ok(y)
    }

    /// Flatten the leading dims: `[.., in]` → `[rows, in]`, and the output dims to restore.
    pub(super) fn rows(x: &Tensor, out: usize) -> Result<(Tensor, Vec<usize>)> {
        let dims = x.dims();
        let inp = dims.last().copied().unwrap_or(1);
        let mut out_dims = dims[..dims.len().saturating_sub(1)].to_vec();
        out_dims.push(out);
        Ok((x.reshape((x.elem_count() / inp.max(1), inp))?, out_dims))
    }

    pub(super) fn linear(&self, l: &Linear, x: &Tensor) -> Result<Tensor> {
        if l.lora.is_none() && self.fused(self.spec.kernels.linear, x) {
            let b = l.b.as_ref().map(|b| self.cast(b)).transpose()?;
            return kernels::linear(x, &self.weight(&l.w)?, b.as_ref());
        }
        let (x2, out_dims) = Self::rows(x, l.w.dims2()?.0)?;
        let mut y = self.linear_nobias(l, &x2)?;
        if let Some(b) = &l.b {
            let b = self.cast(b)?;
            y = if self.fused(self.spec.kernels.bias_gelu, &y) {
                kernels::bias_add(&y, &b)?
            } else {
                y.broadcast_add(&b)?
            };
        }
        y.reshape(out_dims)
    }

    /// `gelu(linear(x))`, bias and GELU in one kernel on CUDA.
    pub(super) fn linear_gelu(&self, l: &Linear, x: &Tensor) -> Result<Tensor> {
        match &l.b {
            Some(b) if self.fused(self.spec.kernels.bias_gelu, x) => {
                let y = if l.lora.is_none() && self.fused(self.spec.kernels.linear, x) {
                    kernels::linear(x, &self.weight(&l.w)?, None)?
                } else {
                    let (x2, out_dims) = Self::rows(x, l.w.dims2()?.0)?;
                    self.linear_nobias(l, &x2)?.reshape(out_dims)?
                };
                kernels::bias_gelu(&y, &self.cast(b)?)
            }
            _ => self.linear(l, x)?.gelu(),
        }
    }

    /// Dropout of `x` (viewed as `[rows, last dim]`) at `site` ([`dropout`]'s sites and
    /// layouts): the mask is drawn where `x` lives — by a kernel on a GPU.
    pub(super) fn dropout(
        &self,
        x: &Tensor,
        train: bool,
        site: u32,
        layout: Layout,
    ) -> Result<Tensor> {
        self.dropout_p(x, self.spec.dropout, train, site, layout)
    }

    /// [`Self::dropout`] with drop probability `p`.
    pub(super) fn dropout_p(
        &self,
        x: &Tensor,
        p: f64,
        train: bool,
        site: u32,
        layout: Layout,
    ) -> Result<Tensor> {
        if !train || p <= 0.0 {
            return Ok(x.clone());
        }
        let cols = x.dims().last().copied().unwrap_or(1).max(1);
        let rows = x.elem_count() / cols;
        let seed = self.dropout_seed;
        let mask = if self.device.is_cuda() {
            kernels::dropout_mask(&self.device, (rows, cols), seed, site, p, layout)?
        } else {
            let m = dropout::mask(rows, cols, seed, site, p, layout);
            Tensor::from_vec(m, (rows, cols), &self.device)?
        };
        x * mask.reshape(x.shape())?.to_dtype(x.dtype())?
    }
}
