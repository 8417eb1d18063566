//! A decoder-only transformer on candle `Var`s: GPT-2 style (LayerNorm, learned positions,
//! GELU) or Llama style (RMSNorm, RoPE, SwiGLU, grouped-query attention), each part
//! switchable, with optional LoRA adapters on chosen linear layers.
//!
//! Parameters are fp32 master weights; `forward` casts them to the compute dtype (bf16/fp16
//! on GPUs) so activations run in reduced precision while gradients land on the fp32 vars.
//! Tensor names follow the Hugging Face Llama layout (`model.layers.N.self_attn.q_proj.weight`),
//! so HF checkpoints load by name and adapters get PEFT-compatible names.

use crate::config::{Activation, Config, KernelsConfig, Norm, PosEncoding, Recompute, RopeScaling};
use crate::engine::dropout::{self, Layout};
use crate::engine::kernels;
use crate::engine::kernels::nf4::Nf4;
use candle_core::{DType, Device, Result, Tensor, Var, D};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

mod decode;
pub use decode::KvCache;

/// What role a parameter plays: decides weight decay, SCU regularization and freezing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParamKind {
    /// Linear weight matrices.
    Matrix,
    Embedding,
    Norm,
    Bias,
    LoraA,
    LoraB,
}

impl ParamKind {
    pub fn is_lora(self) -> bool {
        matches!(self, ParamKind::LoraA | ParamKind::LoraB)
    }
}

/// A named parameter.
#[derive(Clone, Debug)]
pub struct Param {
    pub name: String,
    pub var: Var,
    pub kind: ParamKind,
    pub trainable: bool,
}

/// The hyper-parameters that fix the model's shape.
#[derive(Clone, Debug, PartialEq)]
pub struct Shape {
    pub vocab_size: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub n_embd: usize,
    pub seq_len: usize,
    pub hidden: usize,
    pub norm: Norm,
    pub norm_eps: f64,
    pub pos: PosEncoding,
    pub rope_theta: f64,
    pub activation: Activation,
    pub tie_embeddings: bool,
    pub bias: bool,
    pub dropout: f64,
    pub init_std: f64,
    /// Which fused CUDA kernels the forward/backward uses (ignored on the CPU).
    pub kernels: KernelsConfig,
    /// Width of one head (n_head · head_dim may differ from n_embd).
    pub head_dim: usize,
    /// Biases on q, k and v even when `bias` is off (Qwen2).
    pub qkv_bias: bool,
    /// Rows of the learned position table (≥ seq_len; generation may use them all).
    pub n_positions: usize,
    /// RoPE frequency scaling; see [`rope_inv_freq`].
    pub rope_scaling: RopeScaling,
    /// Granite: token embeddings × this.
    pub embedding_multiplier: f64,
    /// Granite: the attention score scale in place of 1/sqrt(head_dim).
    pub attention_multiplier: Option<f64>,
    /// Granite: attention and MLP outputs × this before each residual add.
    pub residual_multiplier: f64,
    /// Granite: logits ÷ this.
    pub logits_scaling: f64,
    /// What the fast step recomputes in the backward (the per-op path keeps autograd's).
    pub recompute: Recompute,
}

impl Shape {
    pub fn from_config(c: &Config, vocab_size: usize) -> Self {
        let m = &c.model;
        Self {
            vocab_size,
            n_layer: m.n_layer,
            n_head: m.n_head,
            n_kv_head: c.kv_heads(),
            n_embd: m.n_embd,
            seq_len: m.seq_len,
            hidden: ((m.n_embd as f64 * m.mlp_ratio).round() as usize).max(1),
            norm: m.norm,
            norm_eps: m.norm_eps,
            pos: m.pos,
            rope_theta: m.rope_theta,
            activation: m.activation,
            tie_embeddings: m.tie_embeddings,
            bias: m.bias,
            dropout: m.dropout,
            init_std: m.init_std,
            kernels: c.kernels,
            head_dim: m.head_size(),
            qkv_bias: m.qkv_bias,
            n_positions: m.n_positions.max(m.seq_len),
            rope_scaling: m.rope_scaling,
            embedding_multiplier: m.embedding_multiplier,
            attention_multiplier: (m.attention_multiplier != 0.0).then_some(m.attention_multiplier),
            residual_multiplier: m.residual_multiplier,
            logits_scaling: m.logits_scaling,
            recompute: m.recompute,
        }
    }
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }
    /// The attention score scale: Granite's multiplier, else 1/sqrt(head_dim).
    pub fn attention_scale(&self) -> f64 {
        self.attention_multiplier
            .unwrap_or_else(|| 1.0 / (self.head_dim as f64).sqrt())
    }
    /// Whether the whole-model CUDA step computes this model's arithmetic: everything (q/k/v-
    /// only biases, a longer position table, RoPE scaling, Granite's multipliers, an explicit
    /// head_dim with flash attention) but an embedding multiplier with learned positions (the
    /// step's embedding adds the positions before it scales).
    pub fn step_computes(&self) -> bool {
        self.embedding_multiplier == 1.0 || self.pos == PosEncoding::Rope
    }
}

/// RoPE inverse frequencies (radians per position), one per pair of a head's dimensions:
/// `θ^(-2i/head_dim)`, then Hugging Face's `rope_scaling` (linear, llama3). The one place the
/// frequencies are computed: the candle model, generation and the CUDA step use it.
pub fn rope_inv_freq(shape: &Shape) -> Vec<f64> {
    let hd = shape.head_dim;
    let base: Vec<f64> = (0..hd / 2)
        .map(|i| 1.0 / shape.rope_theta.powf((2 * i) as f64 / hd as f64))
        .collect();
    match shape.rope_scaling {
        RopeScaling::None => base,
        RopeScaling::Linear { factor } => base.iter().map(|f| f / factor).collect(),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => {
            let old = original_max_position_embeddings as f64;
            let low_wavelen = old / low_freq_factor;
            let high_wavelen = old / high_freq_factor;
            base.iter()
                .map(|&f| {
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / factor
                    } else {
                        let smooth = (old / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect()
        }
    }
}

/// A LoRA adapter: `x·Aᵀ·Bᵀ·(alpha/r)`, B starts at zero so training starts from the base.
#[derive(Clone, Debug)]
struct Lora {
    a: Var,
    b: Var,
    scale: f64,
    /// Dropout on the adapter's input (`lora.dropout`; PEFT's `lora_dropout`) and its mask
    /// site: one mask per layer and group of adapters that share their input
    /// ([`dropout::site_lora`]), as the whole-model step draws it.
    p: f64,
    site: u32,
}

#[derive(Clone, Debug)]
struct Linear {
    w: Weight,
    b: Option<Var>,
    lora: Option<Lora>,
}

/// A linear layer's matrix: a parameter, or (a frozen LoRA base with
/// `lora.base_dtype = "nf4"`) a 4-bit copy that is dequantized where it is used.
#[derive(Clone, Debug)]
enum Weight {
    Dense(Var),
    Nf4(std::sync::Arc<Nf4>),
}

impl Weight {
    /// `(out, in)`.
    fn dims2(&self) -> Result<(usize, usize)> {
        match self {
            Weight::Dense(v) => v.as_tensor().dims2(),
            Weight::Nf4(q) => Ok((q.out, q.inp)),
        }
    }
}

#[derive(Clone, Debug)]
struct NormLayer {
    w: Var,
    b: Option<Var>,
}

#[derive(Clone, Debug)]
struct Block {
    ln1: NormLayer,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    ln2: NormLayer,
    up: Linear,
    gate: Option<Linear>,
    down: Linear,
}

/// The transformer.
pub struct Model {
    pub shape: Shape,
    pub params: Vec<Param>,
    wte: Var,
    wpe: Option<Var>,
    blocks: Vec<Block>,
    ln_f: NormLayer,
    lm_head: Option<Var>,
    dtype: DType,
    device: Device,
    mask: Tensor,
    rope: Option<(Tensor, Tensor)>,
    /// The seed of the dropout masks ([`dropout`]: a mask is a function of the seed, the site
    /// and the element, drawn on the model's device).
    dropout_seed: u64,
    /// Whether the forward in progress trains (set by [`Self::hidden`]; LoRA dropout).
    training: bool,
}

struct Init<'a> {
    rng: StdRng,
    device: &'a Device,
    params: Vec<Param>,
    store: BaseStore,
}

/// How [`Model::new_with`] stores and initialises the weights it creates.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BaseStore {
    /// The weights' storage dtype: F32 masters for training, or BF16 for a base that stays
    /// frozen (LoRA on a GPU: half the memory, no fp32 copy).
    pub dtype: DType,
    /// Draw the random init on the model's device (fast; for a base whose values do not
    /// matter, e.g. a benchmark's `lora.base = "random"`) instead of the host's seeded
    /// generator (deterministic on every device).
    pub random_on_device: bool,
}

impl Default for BaseStore {
    fn default() -> Self {
        Self {
            dtype: DType::F32,
            random_on_device: false,
        }
    }
}

impl Init<'_> {
    fn normal(
        &mut self,
        name: String,
        shape: (usize, usize),
        std: f64,
        kind: ParamKind,
    ) -> Result<Var> {
        let t = if self.store.random_on_device {
            Tensor::randn(0f32, std as f32, shape, self.device)?
        } else {
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
        };
        let var = Var::from_tensor(&t.to_dtype(self.store.dtype)?)?;
        self.params.push(Param {
            name,
            var: var.clone(),
            kind,
            trainable: true,
        });
        Ok(var)
    }
    fn constant(&mut self, name: String, len: usize, value: f32, kind: ParamKind) -> Result<Var> {
        let var =
            Var::from_tensor(&Tensor::full(value, len, self.device)?.to_dtype(self.store.dtype)?)?;
        self.params.push(Param {
            name,
            var: var.clone(),
            kind,
            trainable: true,
        });
        Ok(var)
    }
    fn zeros2(&mut self, name: String, shape: (usize, usize), kind: ParamKind) -> Result<Var> {
        let var = Var::from_tensor(&Tensor::zeros(shape, DType::F32, self.device)?)?;
        self.params.push(Param {
            name,
            var: var.clone(),
            kind,
            trainable: true,
        });
        Ok(var)
    }
    fn linear(
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
    fn norm(&mut self, name: &str, dim: usize, norm: Norm, bias: bool) -> Result<NormLayer> {
        let w = self.constant(format!("{name}.weight"), dim, 1.0, ParamKind::Norm)?;
        let b = if norm == Norm::LayerNorm && bias {
            Some(self.constant(format!("{name}.bias"), dim, 0.0, ParamKind::Norm)?)
        } else {
            None
        };
        Ok(NormLayer { w, b })
    }
}

// The step's input types live with the step (kernels); the model builds them.
pub use crate::engine::kernels::spec::{
    LinearWB, StepLayer, StepLora, StepMatrix, StepWeights, WeightBias, LORA_TARGETS,
    LORA_TARGET_GROUP,
};

/// LoRA settings for [`Model::add_lora`].
#[derive(Clone, Debug)]
pub struct LoraSpec {
    pub r: usize,
    pub alpha: f64,
    /// Short names: q k v o up down gate.
    pub targets: Vec<String>,
    /// Dropout probability on the adapters' input while training.
    pub dropout: f64,
}

impl Model {
    /// A freshly initialised model (GPT-2 init: N(0, init_std), residual projections scaled by
    /// 1/sqrt(2·n_layer), zero biases, unit norms), deterministic from `seed` on any device.
    pub fn new(shape: Shape, dtype: DType, device: &Device, seed: u64) -> Result<Self> {
        Self::new_with(shape, dtype, device, seed, BaseStore::default())
    }

    /// [`Self::new`] with the weights stored and initialised as `store` says.
    pub fn new_with(
        shape: Shape,
        dtype: DType,
        device: &Device,
        seed: u64,
        store: BaseStore,
    ) -> Result<Self> {
        let s = &shape;
        let mut init = Init {
            rng: StdRng::seed_from_u64(seed),
            device,
            params: Vec::new(),
            store,
        };
        let std = s.init_std;
        let resid_std = std / (2.0 * s.n_layer as f64).sqrt();
        let wte = init.normal(
            "model.embed_tokens.weight".into(),
            (s.vocab_size, s.n_embd),
            std,
            ParamKind::Embedding,
        )?;
        let wpe = match s.pos {
            PosEncoding::Learned => Some(init.normal(
                "model.embed_positions.weight".into(),
                (s.n_positions, s.n_embd),
                std / 2.0,
                ParamKind::Embedding,
            )?),
            PosEncoding::Rope => None,
        };
        let hd = s.head_dim();
        let mut blocks = Vec::with_capacity(s.n_layer);
        for i in 0..s.n_layer {
            let p = format!("model.layers.{i}");
            let ln1 = init.norm(&format!("{p}.input_layernorm"), s.n_embd, s.norm, s.bias)?;
            let q = init.linear(
                &format!("{p}.self_attn.q_proj"),
                s.n_head * hd,
                s.n_embd,
                std,
                s.bias || s.qkv_bias,
            )?;
            let k = init.linear(
                &format!("{p}.self_attn.k_proj"),
                s.n_kv_head * hd,
                s.n_embd,
                std,
                s.bias || s.qkv_bias,
            )?;
            let v = init.linear(
                &format!("{p}.self_attn.v_proj"),
                s.n_kv_head * hd,
                s.n_embd,
                std,
                s.bias || s.qkv_bias,
            )?;
            let o = init.linear(
                &format!("{p}.self_attn.o_proj"),
                s.n_embd,
                s.n_head * hd,
                resid_std,
                s.bias,
            )?;
            let ln2 = init.norm(
                &format!("{p}.post_attention_layernorm"),
                s.n_embd,
                s.norm,
                s.bias,
            )?;
            let gate = match s.activation {
                Activation::SwiGlu => Some(init.linear(
                    &format!("{p}.mlp.gate_proj"),
                    s.hidden,
                    s.n_embd,
                    std,
                    s.bias,
                )?),
                Activation::Gelu => None,
            };
            let up = init.linear(&format!("{p}.mlp.up_proj"), s.hidden, s.n_embd, std, s.bias)?;
            let down = init.linear(
                &format!("{p}.mlp.down_proj"),
                s.n_embd,
                s.hidden,
                resid_std,
                s.bias,
            )?;
            blocks.push(Block {
                ln1,
                q,
                k,
                v,
                o,
                ln2,
                up,
                gate,
                down,
            });
        }
        let ln_f = init.norm("model.norm", s.n_embd, s.norm, s.bias)?;
        let lm_head = if s.tie_embeddings {
            None
        } else {
            Some(init.normal(
                "lm_head.weight".into(),
                (s.vocab_size, s.n_embd),
                std,
                ParamKind::Matrix,
            )?)
        };
        let t = s.seq_len;
        let mask: Vec<f32> = (0..t * t)
            .map(|i| {
                if i % t > i / t {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        let mask = Tensor::from_vec(mask, (t, t), device)?.to_dtype(dtype)?;
        let rope = match s.pos {
            PosEncoding::Rope => Some(rope_tables(&rope_inv_freq(s), 0, t, dtype, device)?),
            PosEncoding::Learned => None,
        };
        Ok(Self {
            params: init.params,
            wte,
            wpe,
            blocks,
            ln_f,
            lm_head,
            dtype,
            device: device.clone(),
            mask,
            rope,
            dropout_seed: seed ^ 0xD5A0_9B1E,
            training: false,
            shape,
        })
    }

    /// Add LoRA adapters (rank r) on the target layers and freeze everything else.
    pub fn add_lora(&mut self, spec: &LoraSpec, seed: u64) -> Result<()> {
        let mut init = Init {
            rng: StdRng::seed_from_u64(seed ^ 0x10CA),
            device: &self.device,
            params: Vec::new(),
            // Adapters are trained: fp32 masters, drawn as on every device.
            store: BaseStore::default(),
        };
        let scale = spec.alpha / spec.r as f64;
        for (i, b) in self.blocks.iter_mut().enumerate() {
            let mut targets: Vec<(&str, &str, &mut Linear)> = vec![
                ("q", "self_attn.q_proj", &mut b.q),
                ("k", "self_attn.k_proj", &mut b.k),
                ("v", "self_attn.v_proj", &mut b.v),
                ("o", "self_attn.o_proj", &mut b.o),
                ("up", "mlp.up_proj", &mut b.up),
                ("down", "mlp.down_proj", &mut b.down),
            ];
            if let Some(g) = b.gate.as_mut() {
                targets.push(("gate", "mlp.gate_proj", g));
            }
            for (short, path, lin) in targets {
                if !spec.targets.iter().any(|t| t == short) {
                    continue;
                }
                let (out, inp) = lin.w.dims2()?;
                let name = format!("model.layers.{i}.{path}");
                // Kaiming-uniform-like A (scaled normal here), zero B: the adapter starts as a no-op.
                let a = init.normal(
                    format!("{name}.lora_A.weight"),
                    (spec.r, inp),
                    1.0 / (inp as f64).sqrt(),
                    ParamKind::LoraA,
                )?;
                let bb = init.zeros2(
                    format!("{name}.lora_B.weight"),
                    (out, spec.r),
                    ParamKind::LoraB,
                )?;
                let target = LORA_TARGETS.iter().position(|t| *t == short).unwrap_or(0);
                lin.lora = Some(Lora {
                    a,
                    b: bb,
                    scale,
                    p: spec.dropout.max(0.0),
                    site: dropout::site_lora(i, LORA_TARGET_GROUP[target]),
                });
            }
        }
        for p in &mut self.params {
            p.trainable = false;
        }
        self.params.extend(init.params);
        Ok(())
    }

    fn linears(&self) -> Vec<(String, &Linear)> {
        let mut v = Vec::new();
        for (i, b) in self.blocks.iter().enumerate() {
            let p = format!("model.layers.{i}");
            v.push((format!("{p}.self_attn.q_proj"), &b.q));
            v.push((format!("{p}.self_attn.k_proj"), &b.k));
            v.push((format!("{p}.self_attn.v_proj"), &b.v));
            v.push((format!("{p}.self_attn.o_proj"), &b.o));
            if let Some(g) = &b.gate {
                v.push((format!("{p}.mlp.gate_proj"), g));
            }
            v.push((format!("{p}.mlp.up_proj"), &b.up));
            v.push((format!("{p}.mlp.down_proj"), &b.down));
        }
        v
    }

    /// Adapter weights with PEFT names (`base_model.model.<layer>.lora_A.weight`).
    pub fn adapter_tensors(&self) -> Vec<(String, Tensor)> {
        self.params
            .iter()
            .filter(|p| p.kind.is_lora())
            .map(|p| {
                (
                    format!("base_model.model.{}", p.name),
                    p.var.as_tensor().clone(),
                )
            })
            .collect()
    }

    /// Base weights with every adapter folded in: `W + (alpha/r)·B·A`; no LoRA tensors. A
    /// 4-bit base comes out dequantized (f32), after the other weights.
    pub fn merged_tensors(&self) -> Result<Vec<(String, Tensor)>> {
        let mut merged: std::collections::HashMap<String, Tensor> =
            std::collections::HashMap::new();
        let mut nf4 = Vec::new();
        for (name, lin) in self.linears() {
            let name = format!("{name}.weight");
            let quantized = matches!(lin.w, Weight::Nf4(_));
            if lin.lora.is_none() && !quantized {
                continue;
            }
            let mut w = self.weight_as(&lin.w, DType::F32)?;
            if let Some(l) = &lin.lora {
                let delta = (l.b.as_tensor().matmul(l.a.as_tensor())? * l.scale)?;
                w = (w + delta)?;
            }
            if quantized {
                nf4.push((name, w));
            } else {
                merged.insert(name, w);
            }
        }
        let mut out: Vec<(String, Tensor)> = self
            .params
            .iter()
            .filter(|p| !p.kind.is_lora())
            .map(|p| {
                (
                    p.name.clone(),
                    merged
                        .remove(&p.name)
                        .unwrap_or_else(|| p.var.as_tensor().clone()),
                )
            })
            .collect();
        out.extend(nf4);
        Ok(out)
    }

    /// Store the frozen base's linear layers in NF4 (`lora.base_dtype = "nf4"`; before
    /// [`Self::add_lora`]): each matrix is quantized where it lives and its parameter dropped
    /// (embeddings, norms and biases stay as they are). Returns the bytes the matrices took
    /// before and take now.
    pub fn quantize_base_nf4(&mut self) -> Result<(u64, u64)> {
        let (mut before, mut after) = (0u64, 0u64);
        let mut dropped = std::collections::HashSet::new();
        for (i, b) in self.blocks.iter_mut().enumerate() {
            let p = format!("model.layers.{i}");
            let mut lins: Vec<(String, &mut Linear)> = vec![
                (format!("{p}.self_attn.q_proj"), &mut b.q),
                (format!("{p}.self_attn.k_proj"), &mut b.k),
                (format!("{p}.self_attn.v_proj"), &mut b.v),
                (format!("{p}.self_attn.o_proj"), &mut b.o),
                (format!("{p}.mlp.up_proj"), &mut b.up),
                (format!("{p}.mlp.down_proj"), &mut b.down),
            ];
            if let Some(g) = b.gate.as_mut() {
                lins.push((format!("{p}.mlp.gate_proj"), g));
            }
            for (name, lin) in lins {
                let Weight::Dense(v) = &lin.w else { continue };
                let t = v.as_tensor();
                before += (t.elem_count() * t.dtype().size_in_bytes()) as u64;
                let q = Nf4::quantize(t)?;
                after += q.bytes() as u64;
                lin.w = Weight::Nf4(std::sync::Arc::new(q));
                dropped.insert(format!("{name}.weight"));
            }
        }
        self.params.retain(|p| !dropped.contains(&p.name));
        Ok((before, after))
    }

    /// Re-seed dropout (the trainer does it per micro-batch, with
    /// [`dropout::micro_seed`], so resumed runs — and the whole-model step — draw the same
    /// masks).
    pub fn reseed_dropout(&mut self, seed: u64) {
        self.dropout_seed = seed;
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn param_count(&self) -> (u64, u64) {
        let count = |f: &dyn Fn(&Param) -> bool| {
            self.params
                .iter()
                .filter(|p| f(p))
                .map(|p| p.var.as_tensor().elem_count() as u64)
                .sum::<u64>()
        };
        (count(&|_| true) + self.nf4_elems(), count(&|p| p.trainable))
    }

    /// Weights stored in NF4 (not parameters: [`Self::quantize_base_nf4`]).
    fn nf4_elems(&self) -> u64 {
        self.linears()
            .iter()
            .filter_map(|(_, l)| match &l.w {
                Weight::Nf4(q) => Some((q.out * q.inp) as u64),
                Weight::Dense(_) => None,
            })
            .sum()
    }

    /// Training FLOPs per token (forward + backward): 6·N over the matmul weights plus
    /// 12·L·D·T for attention scores and values.
    pub fn flops_per_token(&self) -> f64 {
        let s = &self.shape;
        let matmul: u64 = self
            .params
            .iter()
            .filter(|p| {
                matches!(
                    p.kind,
                    ParamKind::Matrix | ParamKind::LoraA | ParamKind::LoraB
                )
            })
            .map(|p| p.var.as_tensor().elem_count() as u64)
            .sum::<u64>()
            + self.nf4_elems();
        let head = if s.tie_embeddings {
            (s.vocab_size * s.n_embd) as f64
        } else {
            0.0
        };
        6.0 * (matmul as f64 + head) + 12.0 * (s.n_layer * s.n_embd * s.seq_len) as f64
    }

    fn cast(&self, v: &Var) -> Result<Tensor> {
        if self.dtype == DType::F32 {
            Ok(v.as_tensor().clone())
        } else {
            v.as_tensor().to_dtype(self.dtype)
        }
    }

    /// A linear layer's matrix in the compute dtype (a 4-bit one dequantized).
    fn weight(&self, w: &Weight) -> Result<Tensor> {
        self.weight_as(w, self.dtype)
    }

    fn weight_as(&self, w: &Weight, dtype: DType) -> Result<Tensor> {
        match w {
            Weight::Dense(v) => v.as_tensor().to_dtype(dtype),
            Weight::Nf4(q) => q.dequantize(dtype),
        }
    }

    /// Whether a fused kernel switch applies to this tensor (CUDA, a float compute dtype).
    fn fused(&self, on: bool, t: &Tensor) -> bool {
        on && kernels::usable(t)
    }

    /// `x·Wᵀ` (+ the LoRA delta) as one 2-D matmul over `[rows, in]`, without the bias.
    /// The 2-D form keeps the weight gradient a single `[in, rows]·[rows, out]` matmul
    /// (a batched `broadcast_matmul` would build a per-batch gradient and sum it).
    fn linear_nobias(&self, l: &Linear, x2: &Tensor) -> Result<Tensor> {
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
    fn rows(x: &Tensor, out: usize) -> Result<(Tensor, Vec<usize>)> {
        let dims = x.dims();
        let inp = dims.last().copied().unwrap_or(1);
        let mut out_dims = dims[..dims.len().saturating_sub(1)].to_vec();
        out_dims.push(out);
        Ok((x.reshape((x.elem_count() / inp.max(1), inp))?, out_dims))
    }

    fn linear(&self, l: &Linear, x: &Tensor) -> Result<Tensor> {
        if l.lora.is_none() && self.fused(self.shape.kernels.linear, x) {
            let b = l.b.as_ref().map(|b| self.cast(b)).transpose()?;
            return kernels::linear(x, &self.weight(&l.w)?, b.as_ref());
        }
        let (x2, out_dims) = Self::rows(x, l.w.dims2()?.0)?;
        let mut y = self.linear_nobias(l, &x2)?;
        if let Some(b) = &l.b {
            let b = self.cast(b)?;
            y = if self.fused(self.shape.kernels.bias_gelu, &y) {
                kernels::bias_add(&y, &b)?
            } else {
                y.broadcast_add(&b)?
            };
        }
        y.reshape(out_dims)
    }

    /// `gelu(linear(x))`, bias and GELU in one kernel on CUDA.
    fn linear_gelu(&self, l: &Linear, x: &Tensor) -> Result<Tensor> {
        match &l.b {
            Some(b) if self.fused(self.shape.kernels.bias_gelu, x) => {
                let y = if l.lora.is_none() && self.fused(self.shape.kernels.linear, x) {
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

    fn norm(&self, n: &NormLayer, x: &Tensor) -> Result<Tensor> {
        let w = self.cast(&n.w)?;
        let eps = self.shape.norm_eps as f32;
        let fused = self.fused(self.shape.kernels.norm, x);
        match (&self.shape.norm, &n.b) {
            (Norm::LayerNorm, Some(b)) if fused => {
                kernels::layer_norm(x, &w, &self.cast(b)?, self.shape.norm_eps)
            }
            (Norm::LayerNorm, None) if fused => {
                kernels::layer_norm(x, &w, &w.zeros_like()?, self.shape.norm_eps)
            }
            (Norm::RmsNorm, _) if fused => kernels::rms_norm(x, &w, self.shape.norm_eps),
            (Norm::LayerNorm, Some(b)) => {
                candle_nn::ops::layer_norm_slow(x, &w, &self.cast(b)?, eps)
            }
            (Norm::LayerNorm, None) => {
                let zeros = w.zeros_like()?;
                candle_nn::ops::layer_norm_slow(x, &w, &zeros, eps)
            }
            (Norm::RmsNorm, _) => candle_nn::ops::rms_norm_slow(x, &w, eps),
        }
    }

    /// Dropout of `x` (viewed as `[rows, last dim]`) at `site` ([`dropout`]'s sites and
    /// layouts): the mask is drawn where `x` lives — by a kernel on a GPU.
    fn dropout(&self, x: &Tensor, train: bool, site: u32, layout: Layout) -> Result<Tensor> {
        self.dropout_p(x, self.shape.dropout, train, site, layout)
    }

    /// [`Self::dropout`] with drop probability `p`.
    fn dropout_p(
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

    fn apply_rope(&self, x: &Tensor) -> Result<Tensor> {
        // x: [B, H, T, hd]; rotate the two halves of each head (the Llama/NeoX layout).
        let Some((cos, sin)) = &self.rope else {
            return Ok(x.clone());
        };
        let t = x.dim(2)?;
        rotate_half(x, &cos.narrow(0, 0, t)?, &sin.narrow(0, 0, t)?)
    }

    fn attention(&self, l: usize, b: &Block, x: &Tensor, train: bool) -> Result<Tensor> {
        let s = &self.shape;
        let (bsz, t, _) = x.dims3()?;
        let (h, kvh, hd) = (s.n_head, s.n_kv_head, s.head_dim());
        let region = self.fused(s.kernels.attention && s.kernels.linear, x)
            && self.rope.is_none()
            && kvh == h
            && (!train || s.dropout <= 0.0)
            && [&b.q, &b.k, &b.v].iter().all(|l| l.lora.is_none());
        if region {
            // q | k | v as one matmul over concatenated weights, then the attention core as
            // one graph node (kernels::causal_attention_qkv).
            let w = Tensor::cat(
                &[
                    self.weight(&b.q.w)?,
                    self.weight(&b.k.w)?,
                    self.weight(&b.v.w)?,
                ],
                0,
            )?;
            let bias = match (&b.q.b, &b.k.b, &b.v.b) {
                (Some(bq), Some(bk), Some(bv)) => Some(Tensor::cat(
                    &[self.cast(bq)?, self.cast(bk)?, self.cast(bv)?],
                    0,
                )?),
                _ => None,
            };
            let qkv = kernels::linear(x, &w, bias.as_ref())?;
            let y = kernels::causal_attention_qkv(&qkv, h, s.attention_scale())?;
            return self.linear(&b.o, &y);
        }
        let q = self
            .linear(&b.q, x)?
            .reshape((bsz, t, h, hd))?
            .transpose(1, 2)?
            .contiguous()?;
        let k = self
            .linear(&b.k, x)?
            .reshape((bsz, t, kvh, hd))?
            .transpose(1, 2)?
            .contiguous()?;
        let v = self
            .linear(&b.v, x)?
            .reshape((bsz, t, kvh, hd))?
            .transpose(1, 2)?
            .contiguous()?;
        let q = self.apply_rope(&q)?;
        let k = self.apply_rope(&k)?;
        let (k, v) = if kvh < h {
            let rep = h / kvh;
            let expand = |z: Tensor| -> Result<Tensor> {
                z.unsqueeze(2)?
                    .expand((bsz, kvh, rep, t, hd))?
                    .reshape((bsz, h, t, hd))
            };
            (expand(k)?, expand(v)?)
        } else {
            (k, v)
        };
        let scale = s.attention_scale();
        let att = q.matmul(&k.t()?)?;
        let att = if self.fused(s.kernels.attention, &att) {
            kernels::causal_softmax(&att, scale)?
        } else {
            let mask = self.mask.narrow(0, 0, t)?.narrow(1, 0, t)?;
            let att = (att * scale)?.broadcast_add(&mask)?;
            candle_nn::ops::softmax(&att, D::Minus1)?
        };
        let att = self.dropout(&att, train, dropout::site_attention(l), Layout::Attention)?;
        let y = att.matmul(&v)?.transpose(1, 2)?.reshape((bsz, t, h * hd))?;
        self.linear(&b.o, &y)
    }

    fn mlp(&self, b: &Block, x: &Tensor) -> Result<Tensor> {
        let hidden = match &b.gate {
            Some(g) => (candle_nn::ops::silu(&self.linear(g, x)?)? * self.linear(&b.up, x)?)?,
            None => self.linear_gelu(&b.up, x)?,
        };
        self.linear(&b.down, &hidden)
    }

    /// Logits `[B·T, vocab]` in the compute dtype for token ids `[B, T]` (u32).
    pub fn forward(&mut self, ids: &Tensor, train: bool) -> Result<Tensor> {
        let (x, head) = self.hidden(ids, train)?;
        if self.fused(self.shape.kernels.linear, &x) {
            return kernels::linear(&x, &head, None);
        }
        x.matmul(&head.t()?)
    }

    /// The final hidden states `[B·T, n_embd]` and the output projection `[vocab, n_embd]`
    /// (both in the compute dtype).
    fn hidden(&mut self, ids: &Tensor, train: bool) -> Result<(Tensor, Tensor)> {
        self.training = train;
        let (bsz, t) = ids.dims2()?;
        let wte = self.cast(&self.wte)?;
        let mut x = if self.fused(self.shape.kernels.linear, &wte) && ids.dtype() == DType::U32 {
            kernels::embedding(ids, &wte)?
        } else {
            wte.embedding(&ids.flatten_all()?)?
                .reshape((bsz, t, self.shape.n_embd))?
        };
        if self.shape.embedding_multiplier != 1.0 {
            x = (x * self.shape.embedding_multiplier)?;
        }
        if let Some(wpe) = &self.wpe {
            let pos = self.cast(wpe)?.narrow(0, 0, t)?;
            x = x.broadcast_add(&pos)?;
        }
        x = self.dropout(&x, train, dropout::site_embedding(), Layout::Rows)?;
        for (l, b) in self.blocks.iter().enumerate() {
            let h = self.norm(&b.ln1, &x)?;
            let a = self.residual(self.attention(l, b, &h, train)?)?;
            x = (x + self.dropout(&a, train, dropout::site_attention_out(l), Layout::Rows)?)?;
            let h = self.norm(&b.ln2, &x)?;
            let m = self.residual(self.mlp(b, &h)?)?;
            x = (x + self.dropout(&m, train, dropout::site_mlp_out(l), Layout::Rows)?)?;
        }
        let x = self.final_norm(&x)?.reshape((bsz * t, self.shape.n_embd))?;
        let head = match &self.lm_head {
            Some(w) => self.cast(w)?,
            None => wte,
        };
        Ok((x, head))
    }

    /// Granite's residual multiplier on a block's attention or MLP output.
    fn residual(&self, y: Tensor) -> Result<Tensor> {
        match self.shape.residual_multiplier {
            1.0 => Ok(y),
            m => y * m,
        }
    }

    /// The final norm, with Granite's logits scaling folded in (`(x/s)·Wᵀ = (x·Wᵀ)/s`).
    fn final_norm(&self, x: &Tensor) -> Result<Tensor> {
        let x = self.norm(&self.ln_f, x)?;
        match self.shape.logits_scaling {
            1.0 => Ok(x),
            s => x * (1.0 / s),
        }
    }

    /// Mean cross-entropy in nats (f32 scalar tensor) of the next-token predictions.
    pub fn loss(&mut self, ids: &Tensor, targets: &Tensor, train: bool) -> Result<Tensor> {
        if targets.dtype() == DType::U32
            && self.shape.kernels.linear
            && self.shape.kernels.cross_entropy
            && kernels::usable(self.wte.as_tensor())
            && self.dtype != DType::F64
        {
            // Head matmul and CE as one node: the logits never enter the graph.
            let (x, head) = self.hidden(ids, train)?;
            return kernels::lm_head_cross_entropy(&x, &head, targets)?.mean_all();
        }
        let logits = self.forward(ids, train)?;
        if self.fused(self.shape.kernels.cross_entropy, &logits) && targets.dtype() == DType::U32 {
            return kernels::cross_entropy_rows(&logits, targets)?.mean_all();
        }
        let logits = logits.to_dtype(DType::F32)?;
        candle_nn::loss::cross_entropy(&logits, &targets.flatten_all()?)
    }

    /// Cross-entropy in nats (f32 `[B·T]`) of each next-token prediction, without dropout
    /// (the eval's per-window losses).
    pub fn token_losses(&mut self, ids: &Tensor, targets: &Tensor) -> Result<Tensor> {
        if targets.dtype() == DType::U32
            && self.shape.kernels.linear
            && self.shape.kernels.cross_entropy
            && kernels::usable(self.wte.as_tensor())
            && self.dtype != DType::F64
        {
            let (x, head) = self.hidden(ids, false)?;
            return kernels::lm_head_cross_entropy(&x, &head, targets)?
                .detach()
                .to_dtype(DType::F32);
        }
        let logits = self.forward(ids, false)?;
        if self.fused(self.shape.kernels.cross_entropy, &logits) && targets.dtype() == DType::U32 {
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

    /// The weights for the whole-model CUDA step, when this model is one it runs.
    pub fn step_weights(&self) -> Option<StepWeights> {
        self.step_plan().ok()
    }

    /// The weights for the whole-model CUDA step, or why this model takes the per-op path:
    /// the step needs bf16 or f16 on a CUDA GPU of compute capability 8.0+ (7.5: f16 only),
    /// widths multiples of 8 (16-byte accesses), an even head dim, everything trainable or
    /// (LoRA) exactly the adapters; grouped-query attention and dropout need flash attention
    /// (head dim 64 or 128).
    pub fn step_plan(&self) -> std::result::Result<StepWeights, String> {
        let s = &self.shape;
        let hd = s.head_dim();
        let has_flash = kernels::spec::FLASH_HEAD_DIMS.contains(&hd);
        let fits = kernels::flash_fits(&self.device, hd);
        let flash = s.kernels.attention && has_flash && fits;
        // Why flash attention does not serve this head dim (the step then materialises the
        // attention, which covers less).
        let no_flash = if !s.kernels.attention {
            "; kernels.attention = false"
        } else if has_flash && !fits {
            "; its kernels for this head dim need more shared memory a block than this GPU has"
        } else {
            ""
        };
        let lora = self.params.iter().any(|p| p.kind.is_lora());
        let why = if !s.kernels.step {
            Some("kernels.step = false".to_string())
        } else if !self.device.is_cuda() {
            Some("not on a CUDA device".into())
        } else if self.dtype != DType::BF16 && self.dtype != DType::F16 {
            Some(format!(
                "precision {} (the step runs bf16 or f16)",
                super::precision::dtype_name(self.dtype)
            ))
        } else if let Err(why) = kernels::step_support(&self.device, self.dtype) {
            Some(why)
        } else if !s.n_embd.is_multiple_of(8) || !s.hidden.is_multiple_of(8) {
            Some(format!(
                "n_embd {} and the MLP width {} must be multiples of 8",
                s.n_embd, s.hidden
            ))
        } else if !hd.is_multiple_of(2) {
            Some(format!("odd head dim {hd}"))
        } else if s.n_kv_head == 0 || !s.n_head.is_multiple_of(s.n_kv_head) {
            Some(format!(
                "{} key/value heads do not divide {} heads",
                s.n_kv_head, s.n_head
            ))
        } else if !flash && s.n_kv_head != s.n_head {
            Some(format!(
                "grouped-query attention at head dim {hd} (flash attention has head dims 64 \
                 and 128{no_flash})"
            ))
        } else if !flash && hd * s.n_head != s.n_embd {
            Some(format!(
                "{} heads of {hd} ≠ n_embd {} at head dim {hd} (flash attention has head dims \
                 64 and 128{no_flash})",
                s.n_head, s.n_embd,
            ))
        } else if !flash && s.dropout > 0.0 {
            Some(format!(
                "dropout at head dim {hd} (flash attention has head dims 64 and 128{no_flash})"
            ))
        } else if !s.step_computes() {
            Some("an embedding multiplier with learned positions (per-op only)".into())
        } else if !self
            .params
            .iter()
            .all(|p| p.trainable == (!lora || p.kind.is_lora()))
        {
            Some("a mix of frozen and trainable weights other than LoRA's".into())
        } else {
            None
        };
        if let Some(why) = why {
            return Err(why);
        }
        let norm = |n: &NormLayer| (n.w.clone(), n.b.clone());
        let lin = |l: &Linear| {
            let m = match &l.w {
                Weight::Dense(v) => StepMatrix::Var(v.clone()),
                Weight::Nf4(q) => StepMatrix::Nf4(q.clone()),
            };
            (m, l.b.clone())
        };
        let adapter = |l: Option<&Linear>| {
            l.and_then(|l| l.lora.as_ref()).map(|a| StepLora {
                a: a.a.clone(),
                b: a.b.clone(),
                scale: a.scale,
            })
        };
        let layers = self
            .blocks
            .iter()
            .map(|b| StepLayer {
                ln1: norm(&b.ln1),
                q: lin(&b.q),
                k: lin(&b.k),
                v: lin(&b.v),
                o: lin(&b.o),
                ln2: norm(&b.ln2),
                gate: b.gate.as_ref().map(lin),
                up: lin(&b.up),
                down: lin(&b.down),
                lora: [
                    adapter(Some(&b.q)),
                    adapter(Some(&b.k)),
                    adapter(Some(&b.v)),
                    adapter(Some(&b.o)),
                    adapter(b.gate.as_ref()),
                    adapter(Some(&b.up)),
                    adapter(Some(&b.down)),
                ],
            })
            .collect();
        Ok(StepWeights {
            half: self.dtype == DType::F16,
            wte: self.wte.clone(),
            wpe: self.wpe.clone(),
            rope_inv_freq: (s.pos == PosEncoding::Rope).then(|| rope_inv_freq(s)),
            n_head: s.n_head,
            n_kv_head: s.n_kv_head,
            seq_len: s.seq_len,
            rms: s.norm == Norm::RmsNorm,
            flash,
            epilogues: s.kernels.bias_gelu,
            autotune: s.kernels.autotune,
            graphs: s.kernels.graphs,
            overlap: s.kernels.overlap,
            lora_concat: s.kernels.lora_concat,
            dropout: s.dropout.max(0.0),
            embedding_multiplier: s.embedding_multiplier,
            residual_multiplier: s.residual_multiplier,
            logits_scaling: s.logits_scaling,
            attention_scale: s.attention_scale(),
            lora_dropout: self
                .blocks
                .iter()
                .flat_map(|b| {
                    [&b.q, &b.k, &b.v, &b.o, &b.up, &b.down]
                        .into_iter()
                        .chain(&b.gate)
                })
                .filter_map(|l| l.lora.as_ref().map(|a| a.p))
                .fold(0.0, f64::max),
            layers,
            frozen_base: lora,
            recompute: s.recompute,
            ln_f: norm(&self.ln_f),
            head: self.lm_head.clone(),
            shards: 1,
            eps: s.norm_eps,
        })
    }

    /// All weights by name (for checkpoints).
    pub fn named_tensors(&self) -> Vec<(String, Tensor)> {
        self.params
            .iter()
            .map(|p| (p.name.clone(), p.var.as_tensor().clone()))
            .collect()
    }

    /// Overwrite weights from named tensors; every parameter must be present with its shape.
    pub fn load_named(
        &self,
        tensors: &std::collections::HashMap<String, Tensor>,
        skip_missing_lora: bool,
    ) -> std::result::Result<(), String> {
        for p in &self.params {
            match tensors.get(&p.name) {
                Some(t) => {
                    if t.dims() != p.var.as_tensor().dims() {
                        return Err(format!(
                            "{}: shape {:?} in the file, the model has {:?}",
                            p.name,
                            t.dims(),
                            p.var.as_tensor().dims()
                        ));
                    }
                    let t = t
                        .to_dtype(p.var.dtype())
                        .and_then(|t| t.to_device(&self.device))
                        .map_err(|e| e.to_string())?;
                    p.var.set(&t).map_err(|e| e.to_string())?;
                }
                None if skip_missing_lora && p.kind.is_lora() => {}
                None => return Err(format!("{}: missing", p.name)),
            }
        }
        Ok(())
    }
}

/// RoPE on `[B, H, T, hd]` with cos/sin `[T, hd]`: rotate the two halves of each head (the
/// Llama/NeoX layout).
fn rotate_half(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let hd = x.dim(D::Minus1)?;
    let x1 = x.narrow(D::Minus1, 0, hd / 2)?;
    let x2 = x.narrow(D::Minus1, hd / 2, hd / 2)?;
    let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    x.broadcast_mul(cos)? + rotated.broadcast_mul(sin)?
}

/// cos and sin `[t, head_dim]` of positions `start..start + t` (each frequency twice: the
/// two halves of a head rotate together).
fn rope_tables(
    inv_freq: &[f64],
    start: usize,
    t: usize,
    dtype: DType,
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    let hd = 2 * inv_freq.len();
    let mut cos = Vec::with_capacity(t * hd);
    let mut sin = Vec::with_capacity(t * hd);
    for pos in start..start + t {
        for j in 0..hd {
            let a = pos as f64 * inv_freq[j % inv_freq.len()];
            cos.push(a.cos() as f32);
            sin.push(a.sin() as f32);
        }
    }
    Ok((
        Tensor::from_vec(cos, (t, hd), device)?.to_dtype(dtype)?,
        Tensor::from_vec(sin, (t, hd), device)?.to_dtype(dtype)?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::optim::AdamW;

    #[test]
    fn whole_model_step_only_takes_gpt_style_bf16_cuda_models() {
        let c = Config::default();
        let dev = Device::Cpu;
        // The CPU never runs it, whatever the model.
        let m = Model::new(Shape::from_config(&c, 32), DType::F32, &dev, 1).unwrap();
        assert!(m.step_weights().is_none());
        let m = Model::new(Shape::from_config(&c, 32), DType::BF16, &dev, 1).unwrap();
        assert!(m.step_weights().is_none());
    }

    #[test]
    fn a_base_in_nf4_computes_nearly_what_the_dense_base_does() {
        // (The reference arithmetic on the host; the CUDA kernels are held to it by
        // tests/gpu_kernels.rs.)
        let mut c = Config::default();
        c.model.n_embd = 64;
        let dev = Device::Cpu;
        let shape = Shape::from_config(&c, 32);
        let mut dense = Model::new(shape.clone(), DType::F32, &dev, 3).unwrap();
        let mut q = Model::new(shape, DType::F32, &dev, 3).unwrap();
        let (before, after) = q.quantize_base_nf4().unwrap();
        assert!(
            after * 7 < before && after * 8 > before,
            "{after} of {before} bytes"
        );
        let spec = LoraSpec {
            r: 4,
            alpha: 8.0,
            targets: vec!["q".into(), "v".into()],
            dropout: 0.0,
        };
        q.add_lora(&spec, 1).unwrap();
        // The quantized matrices are no parameters (not in checkpoints), yet counted.
        assert!(q.params.iter().all(|p| !p.name.ends_with("q_proj.weight")));
        assert_eq!(q.param_count().0, dense.param_count().0 + q.param_count().1);
        assert!(q.step_weights().is_none());
        let ids: Vec<u32> = (0..2 * 64).map(|i| (i * 5 % 32) as u32).collect();
        let tg: Vec<u32> = (0..2 * 64).map(|i| ((i * 5 + 3) % 32) as u32).collect();
        let x = Tensor::from_vec(ids, (2, 64), &dev).unwrap();
        let y = Tensor::from_vec(tg, (2, 64), &dev).unwrap();
        let l_dense = dense
            .loss(&x, &y, false)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        let l_q = q.loss(&x, &y, false).unwrap().to_scalar::<f32>().unwrap();
        assert!((l_q - l_dense).abs() < 0.02 * l_dense, "{l_q} vs {l_dense}");
        assert_ne!(l_q, l_dense);
        // The adapters train through the 4-bit base.
        let l = q.loss(&x, &y, true).unwrap();
        let grads = l.backward().unwrap();
        let a = q
            .params
            .iter()
            .find(|p| p.kind == ParamKind::LoraA)
            .unwrap();
        assert!(grads.get(a.var.as_tensor()).is_some());
        // Merged exports carry every base matrix, dequantized.
        let merged = q.merged_tensors().unwrap();
        let names: Vec<&str> = merged.iter().map(|(n, _)| n.as_str()).collect();
        assert!(names.contains(&"model.layers.0.self_attn.q_proj.weight"));
        assert!(names.contains(&"model.layers.0.mlp.down_proj.weight"));
        assert!(names.iter().all(|n| !n.contains("lora")));
    }

    #[test]
    fn lora_dropout_masks_the_adapters_input_while_training_only() {
        let mut c = Config::default();
        c.model.n_embd = 64;
        let dev = Device::Cpu;
        let build = |p: f64| {
            let mut m = Model::new(Shape::from_config(&c, 32), DType::F32, &dev, 3).unwrap();
            let spec = LoraSpec {
                r: 4,
                alpha: 8.0,
                targets: ["q", "k", "v", "o", "up", "down"]
                    .map(String::from)
                    .to_vec(),
                dropout: p,
            };
            m.add_lora(&spec, 1).unwrap();
            // B starts at zero (the adapters would change nothing): give it values.
            for p in m.params.iter().filter(|p| p.kind == ParamKind::LoraB) {
                let t = p.var.as_tensor();
                p.var
                    .set(&(t.ones_like().unwrap() * 0.05).unwrap())
                    .unwrap();
            }
            m.reseed_dropout(77);
            m
        };
        let (mut plain, mut dropped) = (build(0.0), build(0.3));
        let ids: Vec<u32> = (0..2 * 64).map(|i| (i * 5 % 32) as u32).collect();
        let tg: Vec<u32> = (0..2 * 64).map(|i| ((i * 5 + 3) % 32) as u32).collect();
        let x = Tensor::from_vec(ids, (2, 64), &dev).unwrap();
        let y = Tensor::from_vec(tg, (2, 64), &dev).unwrap();
        let loss =
            |m: &mut Model, train: bool| m.loss(&x, &y, train).unwrap().to_scalar::<f32>().unwrap();
        // Evaluation ignores it; training draws a mask, the same one for the same seed.
        assert_eq!(loss(&mut plain, false), loss(&mut dropped, false));
        let (a, b) = (loss(&mut dropped, true), loss(&mut dropped, true));
        assert_eq!(a, b);
        assert_ne!(a, loss(&mut plain, true));
        dropped.reseed_dropout(78);
        assert_ne!(a, loss(&mut dropped, true));
        // The sites: one per layer and group of adapters that share an input.
        let sites: std::collections::BTreeSet<u32> = dropped
            .blocks
            .iter()
            .flat_map(|b| [&b.q, &b.k, &b.v, &b.o, &b.up, &b.down])
            .filter_map(|l| l.lora.as_ref().map(|a| a.site))
            .collect();
        assert_eq!(sites.len(), 4 * c.model.n_layer);
    }

    #[test]
    fn memorizes_a_fixed_batch() {
        let mut c = Config::default();
        c.model.n_embd = 64;
        let dev = Device::Cpu;
        let mut m = Model::new(Shape::from_config(&c, 32), DType::F32, &dev, 1).unwrap();
        let slots = m
            .params
            .iter()
            .map(|p| (p.name.clone(), p.var.clone(), false))
            .collect();
        let mut opt = AdamW::new(slots, 0.9, 0.95, 1e-8, 0.0).unwrap();
        let ids: Vec<u32> = (0..4 * 64).map(|i| (i * 7 % 32) as u32).collect();
        let tg: Vec<u32> = (0..4 * 64).map(|i| ((i * 7 + 7) % 32) as u32).collect();
        let x = Tensor::from_vec(ids, (4, 64), &dev).unwrap();
        let y = Tensor::from_vec(tg, (4, 64), &dev).unwrap();
        let mut first = 0.0;
        let mut last = 0.0;
        for i in 0..60 {
            let loss = m.loss(&x, &y, true).unwrap();
            let v = loss.to_scalar::<f32>().unwrap();
            if i == 0 {
                first = v;
            }
            last = v;
            let store = loss.backward().unwrap();
            let grads: Vec<Tensor> = opt
                .slots
                .iter()
                .map(|s| store.get(s.var.as_tensor()).unwrap().clone())
                .collect();
            opt.step(&grads, 3e-3).unwrap();
        }
        eprintln!("first {first} last {last}");
        assert!(last < 0.1 * first, "first {first} last {last}");
    }
}
