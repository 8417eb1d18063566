//! What the whole-model CUDA step is built from ([`StepWeights`]): the model's weights and its
//! [`ModelSpec`], handed over by `Model::step_weights` — the model depends on this module,
//! not the other way round.

use crate::engine::kernels::quantized::Quantized;
pub use crate::engine::spec::ModelSpec;
use candle_core::Var;
use std::sync::Arc;

/// The Mamba-2 scan's chunk length on the whole-model step. The chunk length changes only the
/// rounding of the state-space-duality scan (engine::model::ssd), not what it computes, so the
/// step takes the length its kernels are built for (mamba.cuh's MB_L) rather than
/// `mamba_chunk_size`.
pub const MAMBA_STEP_CHUNK: usize = 64;

/// A weight and its optional bias (norms) for the whole-model step.
pub type WeightBias = (Var, Option<Var>);

/// A linear layer's matrix for the whole-model step: a parameter, or a frozen LoRA base
/// matrix stored quantized (`lora.base_dtype = "nf4"`: NF4, or a GGUF file's blocks), which
/// the step dequantizes where it is used.
#[derive(Clone, Debug)]
pub enum StepMatrix {
    Var(Var),
    Quantized(Arc<Quantized>),
}

impl StepMatrix {
    /// Output features.
    pub fn rows(&self) -> candle_core::Result<usize> {
        Ok(self.dims()?.0)
    }

    /// `(out, in)` features.
    pub fn dims(&self) -> candle_core::Result<(usize, usize)> {
        match self {
            StepMatrix::Var(v) => v.as_tensor().dims2(),
            StepMatrix::Quantized(q) => Ok(q.dims()),
        }
    }
}

/// A linear layer's matrix and optional bias.
pub type LinearWB = (StepMatrix, Option<Var>);

/// A LoRA adapter for the whole-model step: `y += scale·(x·Aᵀ)·Bᵀ`.
#[derive(Clone, Debug)]
pub struct StepLora {
    pub a: Var,
    pub b: Var,
    pub scale: f64,
}

pub use crate::engine::spec::FLASH_HEAD_DIMS;

// The flash kernels' dynamic shared memory: flash_smem.h's defines (FA_FWD_D128_SMEM,
// FA_BWD_D128_SMEM, FA_FWD_D256_SMEM, FA_BWD_D256_SMEM, FA_WS_SMEM, FA_FWS_D128_SMEM), made
// Rust constants by build.rs.
include!(concat!(env!("OUT_DIR"), "/flash_smem.rs"));

/// The dynamic shared memory (bytes) flash.cu's forward and backward kernels for head dim `hd`
/// launch with (0 where the memory is static, at most 48 KB; `u32::MAX` for a head dim without
/// kernels).
pub fn flash_smem(hd: usize) -> (u32, u32) {
    match hd {
        64 => (0, 0),
        128 => (FA_FWD_D128_SMEM, FA_BWD_D128_SMEM),
        256 => (FA_FWD_D256_SMEM, FA_BWD_D256_SMEM),
        // (no kernels: nothing fits)
        _ => (u32::MAX, u32::MAX),
    }
}

/// Dynamic shared memory of the warp-specialized Hopper backward for head dims 64 and 128
/// (flash_sm90.cu's FA_WS_SMEM: K and V of 128 keys, two ring slots of a step's Q and dO, two
/// slots of the step's dS^T — twenty 64 x 64 bf16 tiles — two buffers of eight warps' 16 x 64
/// fp32 dQ staging, each ring slot's row statistics, and 1 KB to align them: 227 KB).
pub const FLASH_BWD_WS_SMEM: u32 = FA_WS_SMEM;

/// Dynamic shared memory of the warp-specialized Hopper forward at head dim 128 (flash_sm90.cu's
/// flash_fwd_ws: the two MMA warpgroups' Q, four ring stages of K and V, their barriers and 1 KB
/// to align them: 162 KB).
pub const FLASH_FWD_WS_SMEM: u32 = FA_FWS_D128_SMEM;

/// The projections a LoRA adapter can sit on, as indices of [`StepLayer::lora`] (a Mamba
/// layer's in_proj takes q's slot, its out_proj o's).
pub const LORA_TARGETS: [&str; 7] = ["q", "k", "v", "o", "gate", "up", "down"];

/// The group of each of [`LORA_TARGETS`]: adapters that read the same input (q, k, v: the
/// normed block input; gate, up: the normed MLP input) form one group, whose A matrices the
/// step stacks into one matmul and whose input one LoRA-dropout mask covers.
pub const LORA_TARGET_GROUP: [usize; 7] = [0, 0, 0, 1, 2, 2, 3];

/// A block's attention weights for the whole-model step.
#[derive(Clone, Debug)]
pub struct StepAttention {
    pub q: LinearWB,
    pub k: LinearWB,
    pub v: LinearWB,
    pub o: LinearWB,
    /// QK-norm per head (Qwen3): the RMSNorm weights `[head_dim]` of q's heads and of k's.
    pub qk_norm: Option<(Var, Var)>,
}

/// A Mamba-2 mixer's weights (a Granite 4.0 hybrid's Mamba layer) for the whole-model step.
#[derive(Clone, Debug)]
pub struct StepMamba {
    /// in_proj `[z | x B C | dt, n_embd]` and out_proj `[n_embd, inner]`.
    pub in_proj: LinearWB,
    pub out_proj: LinearWB,
    /// The depthwise causal conv's weight `[conv channels, 1, d_conv]` and bias.
    pub conv_w: Var,
    pub conv_b: Option<Var>,
    /// Per head: dt's bias, log(−A) and the D skip.
    pub dt_bias: Var,
    pub a_log: Var,
    pub d: Var,
    /// The gated RMSNorm's weight `[inner]`.
    pub norm: Var,
}

/// A hybrid layer's routed experts (transformers' `block_sparse_moe`): the router `[E, C]`,
/// the experts' gate | up `[E, 2I, C]` and down `[E, C, I]`.
#[derive(Clone, Debug)]
pub struct StepMoe {
    pub router: Var,
    pub gate_up: Var,
    pub down: Var,
}

/// What a block mixes the sequence with.
#[derive(Clone, Debug)]
pub enum StepMixer {
    Attention(StepAttention),
    Mamba(StepMamba),
}

/// One transformer block's weights for the whole-model step.
#[derive(Clone, Debug)]
pub struct StepLayer {
    pub ln1: WeightBias,
    pub mixer: StepMixer,
    pub ln2: WeightBias,
    /// SwiGLU's gate projection (None: a GELU MLP, or a hybrid's shared MLP, whose `up` is
    /// gate | up in one matrix).
    pub gate: Option<LinearWB>,
    pub up: LinearWB,
    pub down: LinearWB,
    /// LoRA adapters on q k v o gate up down ([`LORA_TARGETS`]' order; a Mamba layer's
    /// in_proj and out_proj in q's and o's slots).
    pub lora: [Option<StepLora>; 7],
    /// Gemma's sandwich: the norms on the attention's and the MLP's outputs (weights
    /// `[n_embd]`), before each residual add.
    pub post: Option<(Var, Var)>,
    /// A hybrid's routed experts (None: the shared MLP alone).
    pub moe: Option<StepMoe>,
}

/// A model's weights and spec for the whole-model CUDA step (`Model::step_weights`): any
/// family a [`ModelSpec`] describes — LayerNorm or RMSNorm, GELU or SwiGLU, biases or none,
/// multi-head or grouped-query attention, learned positions or RoPE, tied or untied head. The
/// step takes every dimension and switch from `spec` and checks the weights against it.
#[derive(Clone, Debug)]
pub struct StepWeights {
    /// The model (dimensions, norms, positions, Granite's multipliers, dropout, the kernel
    /// switches, activation recompute).
    pub spec: ModelSpec,
    /// fp16 activations and operands (the fp16 build of the kernels; the gradients carry the
    /// loss scale) instead of bf16.
    pub half: bool,
    pub wte: Var,
    /// Learned positions, or None with RoPE.
    pub wpe: Option<Var>,
    /// Causal flash attention ([`ModelSpec::flash_attention`] on this GPU); otherwise the
    /// probabilities are materialised (multi-head attention only).
    pub flash: bool,
    /// Dropout on the LoRA adapters' input (`lora.dropout`), one mask per layer and
    /// [`LORA_TARGET_GROUP`] at the dropout module's `site_lora`.
    pub lora_dropout: f64,
    pub layers: Vec<StepLayer>,
    /// LoRA fine-tuning: every base weight is frozen (one bf16 copy, no gradient, no
    /// optimizer state); only the adapters train.
    pub frozen_base: bool,
    pub ln_f: WeightBias,
    /// The untied LM head, or None when it is `wte`.
    pub head: Option<Var>,
    /// Data-parallel ranks the flat gradient buffer is split over (ZeRO-1's reduce-scatter
    /// needs its length to be a multiple of them); 1 otherwise.
    pub shards: usize,
}

impl StepWeights {
    /// Whether every weight has the shape `spec` gives it (the step sizes its buffers and
    /// kernels from the spec alone): Err names the first that does not.
    pub fn check_shapes(&self) -> Result<(), String> {
        let s = &self.spec;
        let c = s.n_embd;
        let bad = |what: &str, has: String, want: String| {
            Err(format!("{what} is {has}, the model spec says {want}"))
        };
        let dims = |m: &StepMatrix| m.dims().map_err(|e| e.to_string());
        let var2 = |v: &Var| v.as_tensor().dims2().map_err(|e| e.to_string());
        let var1 = |v: &Var| v.as_tensor().dims1().map_err(|e| e.to_string());
        if var2(&self.wte)? != (s.vocab_size, c) {
            return bad(
                "the embedding",
                format!("{:?}", var2(&self.wte)?),
                format!("{:?}", (s.vocab_size, c)),
            );
        }
        let learned = s.pos == crate::config::PosEncoding::Learned;
        match &self.wpe {
            Some(p) if learned && var2(p)? == (s.n_positions, c) => {}
            None if !learned => {}
            other => {
                let has = match other {
                    Some(p) => format!("{:?}", var2(p)?),
                    None => "absent".into(),
                };
                return bad(
                    "the position table",
                    has,
                    format!("{:?}", learned.then_some((s.n_positions, c))),
                );
            }
        }
        if self.head.is_some() == s.tie_embeddings {
            return bad(
                "the LM head",
                format!("untied: {}", self.head.is_some()),
                format!("tied: {}", s.tie_embeddings),
            );
        }
        if let Some(h) = &self.head {
            if var2(h)? != (s.vocab_size, c) {
                return bad(
                    "the LM head",
                    format!("{:?}", var2(h)?),
                    format!("{:?}", (s.vocab_size, c)),
                );
            }
        }
        if self.layers.len() != s.n_layer {
            return bad(
                "the layer count",
                self.layers.len().to_string(),
                s.n_layer.to_string(),
            );
        }
        for (i, l) in self.layers.iter().enumerate() {
            for (n, w) in [&l.ln1, &l.ln2].into_iter().enumerate() {
                if var1(&w.0)? != c {
                    return bad(
                        &format!("layer {i}'s norm {}", n + 1),
                        var1(&w.0)?.to_string(),
                        c.to_string(),
                    );
                }
            }
            if let Some((pa, pm)) = &l.post {
                for (what, w) in [("attention output", pa), ("MLP output", pm)] {
                    if var1(w)? != c {
                        let what = format!("layer {i}'s {what} norm");
                        return bad(&what, var1(w)?.to_string(), c.to_string());
                    }
                }
            }
            let mut mats: Vec<(&str, &LinearWB)> = match &l.mixer {
                StepMixer::Attention(a) => {
                    if let (Some((qn, kn)), Some((wq, wk))) = (&a.qk_norm, s.qk_norm_widths()) {
                        if (var1(qn)?, var1(kn)?) != (wq, wk) {
                            return bad(
                                &format!("layer {i}'s q and k norms"),
                                format!("{}, {}", var1(qn)?, var1(kn)?),
                                format!("{wq}, {wk}"),
                            );
                        }
                    }
                    vec![("q", &a.q), ("k", &a.k), ("v", &a.v), ("o", &a.o)]
                }
                StepMixer::Mamba(m) => vec![("in_proj", &m.in_proj), ("out_proj", &m.out_proj)],
            };
            mats.extend(l.gate.as_ref().map(|g| ("gate", g)));
            mats.extend([("up", &l.up), ("down", &l.down)]);
            let linears = s.layer_linears(i);
            let names = |v: Vec<&str>| format!("[{}]", v.join(", "));
            let (has, want) = (
                names(mats.iter().map(|m| m.0).collect()),
                names(linears.iter().map(|m| m.0).collect()),
            );
            // (The spec's order: LORA_TARGETS', the mixer's first.)
            if has != want {
                return bad(&format!("layer {i}'s projections"), has, want);
            }
            for ((name, m), (_, out, inp, bias)) in mats.into_iter().zip(&linears) {
                let what = match name.ends_with("_proj") {
                    true => format!("layer {i}'s {name}"),
                    false => format!("layer {i}'s {name} projection"),
                };
                if dims(&m.0)? != (*out, *inp) {
                    return bad(
                        &what,
                        format!("{:?}", dims(&m.0)?),
                        format!("{:?}", (out, inp)),
                    );
                }
                if m.1.is_some() != *bias {
                    return bad(
                        &format!("{what}'s bias"),
                        format!("present: {}", m.1.is_some()),
                        format!("present: {bias}"),
                    );
                }
            }
            if let StepMixer::Mamba(m) = &l.mixer {
                self.check_mamba(i, m)?;
            }
            self.check_moe(i, l.moe.as_ref())?;
        }
        if var1(&self.ln_f.0)? != c {
            return bad(
                "the final norm",
                var1(&self.ln_f.0)?.to_string(),
                c.to_string(),
            );
        }
        Ok(())
    }

    /// Whether layer `i` has routed experts exactly where the spec's `model.hybrid` says
    /// (every layer, with `experts` > 0), of its shapes: Err names the first that does not.
    fn check_moe(&self, i: usize, m: Option<&StepMoe>) -> Result<(), String> {
        let h = self.spec.hybrid.as_ref().filter(|h| h.experts > 0);
        let (h, m) = match (h, m) {
            (None, None) => return Ok(()),
            (Some(h), Some(m)) => (h, m),
            (h, m) => {
                return Err(format!(
                    "layer {i} has routed experts: {}, the model spec says {}",
                    m.is_some(),
                    h.is_some()
                ))
            }
        };
        let (e, c, f) = (h.experts, self.spec.n_embd, h.expert_hidden);
        for (what, v, want) in [
            ("router", &m.router, vec![e, c]),
            ("experts' gate_up_proj", &m.gate_up, vec![e, 2 * f, c]),
            ("experts' down_proj", &m.down, vec![e, c, f]),
        ] {
            if v.as_tensor().dims() != want.as_slice() {
                return Err(format!(
                    "layer {i}'s {what} is {:?}, the model spec says {want:?}",
                    v.as_tensor().dims()
                ));
            }
        }
        Ok(())
    }

    /// Whether layer `i`'s Mamba mixer's own weights (beyond in_proj and out_proj) have the
    /// shapes the spec's `model.hybrid` gives them: Err names the first that does not.
    fn check_mamba(&self, i: usize, m: &StepMamba) -> Result<(), String> {
        let Some(h) = &self.spec.hybrid else {
            return Err(format!(
                "layer {i} is a Mamba layer, the model spec has no model.hybrid"
            ));
        };
        let (conv, nh) = (h.conv_dim(), h.mamba_n_heads);
        let dims = |v: &Var| v.as_tensor().dims().to_vec();
        let conv_b = m.conv_b.as_ref().map(dims);
        for (what, has, want) in [
            (
                "conv1d weight",
                Some(dims(&m.conv_w)),
                Some(vec![conv, 1, h.mamba_d_conv]),
            ),
            ("conv1d bias", conv_b, h.mamba_conv_bias.then(|| vec![conv])),
            ("dt_bias", Some(dims(&m.dt_bias)), Some(vec![nh])),
            ("A_log", Some(dims(&m.a_log)), Some(vec![nh])),
            ("D", Some(dims(&m.d)), Some(vec![nh])),
            (
                "gated norm",
                Some(dims(&m.norm)),
                Some(vec![h.mamba_inner()]),
            ),
        ] {
            if has != want {
                return Err(format!(
                    "layer {i}'s {what} is {has:?}, the model spec says {want:?}"
                ));
            }
        }
        Ok(())
    }
}
