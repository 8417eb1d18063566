//! A decoder-only transformer on candle `Var`s: GPT-2 style (LayerNorm, learned positions,
//! GELU) or Llama style (RMSNorm, RoPE, SwiGLU, grouped-query attention), each part
//! switchable, with optional LoRA adapters on chosen linear layers.
//!
//! Parameters are fp32 master weights; `forward` casts them to the compute dtype (bf16/fp16
//! on GPUs) so activations run in reduced precision while gradients land on the fp32 vars.
//! Tensor names follow the Hugging Face Llama layout (`model.layers.N.self_attn.q_proj.weight`),
//! so HF checkpoints load by name and adapters get PEFT-compatible names.

use crate::config::{Activation, Norm, PosEncoding, QkNorm};
use crate::engine::dropout::{self, Layout};
use crate::engine::kernels;
use crate::engine::kernels::ggml::GgmlBlocks;
use crate::engine::kernels::nf4::Nf4;
use crate::engine::kernels::quantized::Quantized;
use candle_core::{DType, Device, Result, Tensor, Var, D};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;

mod attention;
mod cache;
mod decode;
mod decode_batch;
mod decode_graph;
mod forward;
mod graph_buffers;
mod init;
mod linear;
mod lora;
mod mamba;
mod mamba_decode;
mod mlp;
mod moe;
mod norm;
mod rope;
mod segments;
mod ssd;
mod step_plan;
pub use segments::{positions, Masked};
pub use step_plan::step_facts;
#[cfg(test)]
mod segments_tests;
#[cfg(test)]
mod tests;

use crate::engine::spec::RopeKey;
pub use crate::engine::spec::{LoraSpec, ModelSpec, Reason, StepFacts};
use attention::causal_mask;
pub use cache::{BatchCache, LayerState};
pub use decode::KvCache;
pub use decode_batch::StepOut;
use init::Init;
pub use init::{BaseInit, BaseStore};
use linear::{Linear, Lora, Weight};
pub use lora::BaseQuantization;
use norm::NormLayer;
pub use rope::rope_inv_freq;
use rope::{rope_tables, rotate_half};

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

/// A block's attention weights.
#[derive(Clone, Debug)]
struct Attn {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    /// QK-norm scales (Qwen3, OLMo 2).
    q_norm: Option<NormLayer>,
    k_norm: Option<NormLayer>,
}

/// What a block mixes the sequence with: attention, or (a Granite 4.0 hybrid's Mamba layers)
/// a Mamba-2 state-space mixer.
#[derive(Clone, Debug)]
enum Mixer {
    Attention(Box<Attn>),
    Mamba(Box<mamba::Mamba>),
}

#[derive(Clone, Debug)]
struct Block {
    /// Pre-norm: the attention's input norm; post-norm (OLMo 2): its output's.
    ln1: NormLayer,
    mixer: Mixer,
    /// Pre-norm: the MLP's input norm; post-norm (OLMo 2): its output's.
    ln2: NormLayer,
    /// Gemma's sandwich: the norms on the attention and MLP outputs (`ln1`, `ln2` stay on
    /// their inputs).
    post_attn: Option<NormLayer>,
    post_mlp: Option<NormLayer>,
    /// The MLP's input projection (a hybrid's shared MLP: gate | up in one,
    /// `shared_mlp.input_linear`).
    up: Linear,
    gate: Option<Linear>,
    down: Linear,
    /// A hybrid's routed experts beside the shared MLP.
    moe: Option<moe::Moe>,
}

impl Block {
    /// The attention weights (an error for a Mamba layer).
    fn attn(&self) -> Result<&Attn> {
        match &self.mixer {
            Mixer::Attention(a) => Ok(a),
            Mixer::Mamba(_) => candle_core::bail!("a Mamba layer has no attention"),
        }
    }
}

/// The transformer.
pub struct Model {
    pub spec: ModelSpec,
    pub params: Vec<Param>,
    wte: Var,
    wpe: Option<Var>,
    blocks: Vec<Block>,
    ln_f: NormLayer,
    lm_head: Option<Var>,
    dtype: DType,
    device: Device,
    /// The `[seq_len, seq_len]` causal mask, and the sliding layers' (causal within the
    /// window), built at their first use ([`Model::causal_mask_of`]).
    mask: std::sync::OnceLock<Tensor>,
    window_mask: std::sync::OnceLock<Tensor>,
    rope: Option<(Tensor, Tensor)>,
    /// The other RoPE tables layers read (Gemma 3's local θ, LongRoPE's long factors).
    rope_more: Vec<(RopeKey, (Tensor, Tensor))>,
    /// The seed of the dropout masks ([`dropout`]: a mask is a function of the seed, the site
    /// and the element, drawn on the model's device).
    dropout_seed: u64,
    /// Whether the forward in progress trains (set by [`Self::hidden`]; LoRA dropout).
    training: bool,
    /// Sample boundaries of packed rows for the next forwards ([`Self::set_segments`]).
    packed: Option<segments::Packed>,
    /// The data's rows carry loss masks / packed samples (the whole-model step takes
    /// neither: [`ModelSpec::fast_step_support`]).
    data_layout: (bool, bool),
    /// The routers' logits of the training forward in progress (experts' load-balancing loss).
    router_logits: std::sync::Mutex<Vec<Tensor>>,
}

// The step's input types live with the step (kernels); the model builds them.
pub use crate::engine::kernels::spec::{
    LinearWB, StepAttention, StepLayer, StepLora, StepMamba, StepMatrix, StepMixer, StepWeights,
    WeightBias, LORA_TARGETS, LORA_TARGET_GROUP,
};

impl Model {
    /// A freshly initialised model (GPT-2 init: N(0, init_std), residual projections scaled by
    /// 1/sqrt(2·n_layer), zero biases, unit norms), deterministic from `seed` on any device.
    pub fn new(spec: ModelSpec, dtype: DType, device: &Device, seed: u64) -> Result<Self> {
        Self::new_with(spec, dtype, device, seed, BaseStore::default())
    }

    /// [`Self::new`] with the weights stored and initialised as `store` says.
    pub fn new_with(
        spec: ModelSpec,
        dtype: DType,
        device: &Device,
        seed: u64,
        store: BaseStore,
    ) -> Result<Self> {
        let s = &spec;
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
        // Gemma's norms scale by 1 + w: their weights start at 0.
        let norm = (s.norm, if s.layout.norm_plus_one { 0.0 } else { 1.0 });
        let mut blocks = Vec::with_capacity(s.n_layer);
        for i in 0..s.n_layer {
            let p = format!("model.layers.{i}");
            // Hugging Face's names: OLMo 2's post-norms are post_attention_layernorm and
            // post_feedforward_layernorm; the Llama block's pre-norms input_layernorm and
            // post_attention_layernorm.
            // post_attention_layernorm. Gemma's sandwich: input_layernorm and
            // pre_feedforward_layernorm on the inputs, post_attention_layernorm and
            // post_feedforward_layernorm on the outputs.
            let (ln1_name, ln2_name) = if s.layout.post_norm {
                ("post_attention_layernorm", "post_feedforward_layernorm")
            } else if s.layout.sandwich_norm {
                ("input_layernorm", "pre_feedforward_layernorm")
            } else {
                ("input_layernorm", "post_attention_layernorm")
            };
            let ln1 = init.norm(&format!("{p}.{ln1_name}"), s.n_embd, norm, s.bias)?;
            if let Some(h) = &s.hybrid {
                blocks.push(Self::hybrid_block(&mut init, &p, s, h, i, ln1)?);
                continue;
            }
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
            let qk = (Norm::RmsNorm, norm.1);
            let (q_norm, k_norm) = match s.qk_norm_widths() {
                Some((qw, kw)) => (
                    Some(init.norm(&format!("{p}.self_attn.q_norm"), qw, qk, false)?),
                    Some(init.norm(&format!("{p}.self_attn.k_norm"), kw, qk, false)?),
                ),
                None => (None, None),
            };
            let ln2 = init.norm(&format!("{p}.{ln2_name}"), s.n_embd, norm, s.bias)?;
            let (post_attn, post_mlp) = if s.layout.sandwich_norm {
                (
                    Some(init.norm(
                        &format!("{p}.post_attention_layernorm"),
                        s.n_embd,
                        norm,
                        s.bias,
                    )?),
                    Some(init.norm(
                        &format!("{p}.post_feedforward_layernorm"),
                        s.n_embd,
                        norm,
                        s.bias,
                    )?),
                )
            } else {
                (None, None)
            };
            let gate = match s.activation {
                Activation::SwiGlu | Activation::GeGlu => Some(init.linear(
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
                mixer: Mixer::Attention(Box::new(Attn {
                    q,
                    k,
                    v,
                    o,
                    q_norm,
                    k_norm,
                })),
                ln2,
                post_attn,
                post_mlp,
                up,
                gate,
                down,
                moe: None,
            });
        }
        let ln_f = init.norm("model.norm", s.n_embd, norm, s.bias)?;
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
        let (mask, window_mask) = (std::sync::OnceLock::new(), std::sync::OnceLock::new());
        let table = |key| rope_tables(&s.rope_freqs(key), 0, t, dtype, device);
        // (A hybrid's attention may have no position encoding: NoPE.)
        let (rope, rope_more) = match s.rope() {
            true => (
                Some(table(RopeKey::default())?),
                s.rope_keys()
                    .into_iter()
                    .skip(1)
                    .map(|k| Ok((k, table(k)?)))
                    .collect::<Result<Vec<_>>>()?,
            ),
            false => (None, Vec::new()),
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
            window_mask,
            rope,
            rope_more,
            dropout_seed: seed ^ 0xD5A0_9B1E,
            training: false,
            packed: None,
            data_layout: (false, false),
            router_logits: std::sync::Mutex::new(Vec::new()),
            spec,
        })
    }

    /// A Granite 4.0 hybrid layer: attention or Mamba-2, the shared MLP
    /// (`shared_mlp.input_linear` = gate | up, `shared_mlp.output_linear`), routed experts.
    fn hybrid_block(
        init: &mut Init,
        p: &str,
        s: &ModelSpec,
        h: &crate::config::HybridConfig,
        i: usize,
        ln1: NormLayer,
    ) -> Result<Block> {
        let (std, c, hd) = (s.init_std, s.n_embd, s.head_dim());
        let resid_std = std / (2.0 * s.n_layer as f64).sqrt();
        let mixer = if h.is_mamba(i) {
            Mixer::Mamba(Box::new(mamba::Mamba::new(init, p, s, h)?))
        } else {
            let a = format!("{p}.self_attn");
            Mixer::Attention(Box::new(Attn {
                q: init.linear(&format!("{a}.q_proj"), s.n_head * hd, c, std, false)?,
                k: init.linear(&format!("{a}.k_proj"), s.n_kv_head * hd, c, std, false)?,
                v: init.linear(&format!("{a}.v_proj"), s.n_kv_head * hd, c, std, false)?,
                o: init.linear(&format!("{a}.o_proj"), c, s.n_head * hd, resid_std, false)?,
                q_norm: None,
                k_norm: None,
            }))
        };
        let ln2 = init.norm(
            &format!("{p}.post_attention_layernorm"),
            c,
            (s.norm, 1.0),
            false,
        )?;
        let m = format!("{p}.shared_mlp");
        let up = init.linear(&format!("{m}.input_linear"), 2 * s.hidden, c, std, false)?;
        let down = init.linear(&format!("{m}.output_linear"), c, s.hidden, resid_std, false)?;
        let moe = match h.experts {
            0 => None,
            _ => Some(moe::Moe::new(init, p, s, h)?),
        };
        Ok(Block {
            ln1,
            mixer,
            ln2,
            post_attn: None,
            post_mlp: None,
            up,
            gate: None,
            down,
            moe,
        })
    }

    /// Re-seed dropout (the trainer does it per micro-batch, with
    /// [`dropout::micro_seed`], so resumed runs — and the whole-model step — draw the same
    /// masks).
    pub fn reseed_dropout(&mut self, seed: u64) {
        self.dropout_seed = seed;
    }

    /// Say that the data's targets carry a loss mask and whether rows pack several samples
    /// (the whole-model CUDA step takes packed rows only with flash attention and RoPE:
    /// [`Reason::PackedSamples`]).
    pub fn set_data_layout(&mut self, masked: bool, packed: bool) {
        self.data_layout = (masked, packed);
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
        (
            count(&|_| true) + self.quantized_elems(),
            count(&|p| p.trainable),
        )
    }

    /// Weights stored quantized (not parameters: [`Self::quantize_base`]).
    fn quantized_elems(&self) -> u64 {
        self.linears()
            .iter()
            .filter_map(|(_, l)| match &l.w {
                Weight::Quantized(q) => Some((q.dims().0 * q.dims().1) as u64),
                Weight::Dense(_) => None,
            })
            .sum()
    }

    /// Training FLOPs per token (forward + backward): 6·N over the matmul weights a token
    /// goes through (of routed experts, its top-k of them: their weights × k/E) plus 12·D·T per
    /// attention layer for attention scores and values (PaLM's and nanoGPT's count, D the
    /// heads' width n_head·head_dim, T the keys a query may see: a sliding layer's window where
    /// it is shorter than the sequence).
    pub fn flops_per_token(&self) -> f64 {
        let s = &self.spec;
        let routed = s
            .hybrid
            .as_ref()
            .filter(|h| h.experts > 0)
            .map_or(1.0, |h| h.experts_top_k as f64 / h.experts as f64);
        let matmul: f64 = self
            .params
            .iter()
            .filter(|p| {
                matches!(
                    p.kind,
                    ParamKind::Matrix | ParamKind::LoraA | ParamKind::LoraB
                )
            })
            .map(|p| {
                let n = p.var.as_tensor().elem_count() as f64;
                if p.name.contains(".experts.") {
                    n * routed
                } else {
                    n
                }
            })
            .sum::<f64>()
            + self.quantized_elems() as f64;
        let head = if s.tie_embeddings {
            (s.vocab_size * s.n_embd) as f64
        } else {
            0.0
        };
        // (Attention layers only: a hybrid's Mamba layers have no T² term.)
        let keys: usize = self
            .blocks
            .iter()
            .enumerate()
            .filter(|(_, b)| matches!(b.mixer, Mixer::Attention(_)))
            .map(|(l, _)| s.layer_window(l).map_or(s.seq_len, |w| w.min(s.seq_len)))
            .sum();
        6.0 * (matmul + head) + 12.0 * (s.n_head * s.head_dim * keys) as f64
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
