//! Weight initialisation: where and how [`Model::new_with`] creates each parameter.

use super::*;

pub(super) struct Init<'a> {
    pub(super) rng: StdRng,
    pub(super) device: &'a Device,
    pub(super) params: Vec<Param>,
    pub(super) store: BaseStore,
}

/// How [`Model::new_with`] stores and initialises the weights it creates.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BaseStore {
    /// The weights' storage dtype: F32 masters for training, or BF16 for a base that stays
    /// frozen (LoRA on a GPU: half the memory, no fp32 copy).
    pub dtype: DType,
    /// Where the matrices' initial values come from.
    pub init: BaseInit,
}

/// How [`Model::new_with`] fills the matrices it creates.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BaseInit {
    /// The host's seeded generator: the same values on every device (training from scratch).
    #[default]
    HostSeeded,
    /// The device's generator (fast; for a base whose values do not matter, e.g. a
    /// benchmark's `lora.base = "random"`).
    DeviceRandom,
    /// Zeros: every weight is about to be loaded from a file (a base, a checkpoint), so no
    /// random draw is spent on it (minutes of host time for a billion weights).
    Loaded,
}

impl Default for BaseStore {
    fn default() -> Self {
        Self {
            dtype: DType::F32,
            init: BaseInit::HostSeeded,
        }
    }
}

impl Init<'_> {
    pub(super) fn normal(
        &mut self,
        name: String,
        shape: (usize, usize),
        std: f64,
        kind: ParamKind,
    ) -> Result<Var> {
        let t = self.draw(shape, std)?;
        self.keep(name, &t.to_dtype(self.store.dtype)?, kind)
    }

    /// `t` (any shape) as a parameter named `name`, stored in the base's dtype.
    pub(super) fn tensor(&mut self, name: String, t: &Tensor, kind: ParamKind) -> Result<Var> {
        self.keep(name, &t.to_dtype(self.store.dtype)?, kind)
    }

    /// A `shape` tensor of N(0, std) draws as the store says (zeros for a loaded base).
    pub(super) fn draw(&mut self, shape: (usize, usize), std: f64) -> Result<Tensor> {
        let t = match self.store.init {
            BaseInit::Loaded => Tensor::zeros(shape, self.store.dtype, self.device)?,
            BaseInit::DeviceRandom => Tensor::randn(0f32, std as f32, shape, self.device)?,
            BaseInit::HostSeeded => {
                let n = shape.0 * shape.1;
                let mut v = Vec::with_capacity(n);
                while v.len() < n {
                    // Box–Muller: two independent standard normals per pair of uniforms.
                    let u1: f64 = 1.0 - self.rng.random::<f64>();
                    let u2: f64 = self.rng.random();
                    let r = (-2.0 * u1.ln()).sqrt();
                    v.push((r * (std::f64::consts::TAU * u2).cos() * std) as f32);
                    v.push((r * (std::f64::consts::TAU * u2).sin() * std) as f32);
                }
                v.truncate(n);
                Tensor::from_vec(v, shape, self.device)?
            }
        };
        Ok(t)
    }

    /// `t` as a trainable parameter named `name`.
    fn keep(&mut self, name: String, t: &Tensor, kind: ParamKind) -> Result<Var> {
        let var = Var::from_tensor(t)?;
        self.params.push(Param {
            name,
            var: var.clone(),
            kind,
            trainable: true,
        });
        Ok(var)
    }
    pub(super) fn constant(
        &mut self,
        name: String,
        len: usize,
        value: f32,
        kind: ParamKind,
    ) -> Result<Var> {
        let t = Tensor::full(value, len, self.device)?.to_dtype(self.store.dtype)?;
        self.keep(name, &t, kind)
    }
    pub(super) fn zeros2(
        &mut self,
        name: String,
        shape: (usize, usize),
        kind: ParamKind,
    ) -> Result<Var> {
        let t = Tensor::zeros(shape, DType::F32, self.device)?;
        self.keep(name, &t, kind)
    }
    pub(super) fn linear(
        &mut self,
        name: &str,
        out: usize,
        inp: usize,
        std: f64,
        bias: bool,
    ) -> Result<Linear> {
        let w = self.normal(format!("{name}.weight"), (out, inp), std, ParamKind::Matrix)?;
        let b = if bias {
            Some(self.constant(format!("{name}.bias"), out, 0.0, ParamKind::Bias)?)
        } else {
            None
        };
        Ok(Linear {
            w: Weight::Dense(w),
            b,
            lora: None,
        })
    }
    /// A norm layer whose scale starts at `scale` (1; 0 where it scales by 1 + w: Gemma).
    pub(super) fn norm(
        &mut self,
        name: &str,
        dim: usize,
        (norm, scale): (Norm, f32),
        bias: bool,
    ) -> Result<NormLayer> {
        let w = self.constant(format!("{name}.weight"), dim, scale, ParamKind::Norm)?;
        let b = if norm == Norm::LayerNorm && bias {
            Some(self.constant(format!("{name}.bias"), dim, 0.0, ParamKind::Norm)?)
        } else {
            None
        };
        Ok(NormLayer { w, b })
    }
}
