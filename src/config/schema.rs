//! The configuration schema: every section, key and default. `configs/tiny.toml` is this
//! file's defaults written out with comments.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The whole configuration. Unknown sections and keys are errors.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub run: RunConfig,
    pub model: ModelConfig,
    pub data: DataConfig,
    pub optim: OptimConfig,
    pub schedule: ScheduleConfig,
    pub precision: PrecisionConfig,
    pub kernels: KernelsConfig,
    pub scu: ScuConfig,
    pub lora: LoraConfig,
    pub checkpoint: CheckpointConfig,
    pub eval: EvalConfig,
    pub monitor: MonitorConfig,
    pub distributed: DistributedConfig,
    pub tui: TuiConfig,
    pub sweep: SweepConfig,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RunConfig {
    /// Run name; the run dir defaults to `runs/<name>-<timestamp>`.
    pub name: String,
    /// Seed for initialisation, data order and dropout.
    pub seed: u64,
    /// Optimizer steps to train.
    pub max_steps: u64,
    /// "auto" (CUDA when built in and present, else CPU), "cpu", "cuda" or "cuda:N".
    pub device: String,
    /// TUI theme: a name from themes/ (dark, light, high-contrast) or a path to a theme file.
    pub theme: String,
    /// Seconds between headless progress lines.
    pub log_every_secs: f64,
    /// Parent directory of run dirs.
    pub runs_root: String,
}

impl Default for RunConfig {
    fn default() -> Self {
        Self {
            name: "tiny".into(),
            seed: 1337,
            max_steps: 600,
            device: "auto".into(),
            theme: "dark".into(),
            log_every_secs: 2.0,
            runs_root: "runs".into(),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Norm {
    LayerNorm,
    RmsNorm,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PosEncoding {
    Learned,
    Rope,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Activation {
    Gelu,
    SwiGlu,
    /// The gated MLP with a GELU (tanh) gate (Gemma's `gelu_pytorch_tanh`).
    GeGlu,
}

impl Activation {
    /// A gated MLP (gate, up and down projections): SwiGLU or GeGLU.
    pub fn gated(self) -> bool {
        matches!(self, Activation::SwiGlu | Activation::GeGlu)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    /// GPT-2 style: LayerNorm, learned positions, GELU MLP (each switchable).
    Gpt,
    /// Llama style: RMSNorm, RoPE, SwiGLU, grouped-query attention, no biases.
    Llama,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelConfig {
    pub arch: Arch,
    /// 0 = take it from the data (tokenizer or built-in corpus).
    pub vocab_size: usize,
    pub n_layer: usize,
    pub n_head: usize,
    /// Key/value heads for grouped-query attention; 0 = n_head.
    pub n_kv_head: usize,
    pub n_embd: usize,
    pub seq_len: usize,
    pub mlp_ratio: f64,
    pub norm: Norm,
    pub norm_eps: f64,
    pub pos: PosEncoding,
    pub rope_theta: f64,
    pub activation: Activation,
    pub tie_embeddings: bool,
    pub dropout: f64,
    pub bias: bool,
    /// Std of the normal init (GPT-2: 0.02; residual projections are scaled by 1/sqrt(2·n_layer)).
    pub init_std: f64,
    /// Width of one attention head; 0 = n_embd / n_head.
    #[serde(skip_serializing_if = "is_zero")]
    pub head_dim: usize,
    /// Biases on the q, k and v projections only (Qwen2); `bias` puts them everywhere.
    #[serde(skip_serializing_if = "is_false")]
    pub qkv_bias: bool,
    /// Rows of the learned position table (`pos = "learned"`); 0 = seq_len.
    #[serde(skip_serializing_if = "is_zero")]
    pub n_positions: usize,
    /// RoPE frequency scaling, as Hugging Face's `rope_scaling`.
    #[serde(skip_serializing_if = "RopeScaling::is_none")]
    pub rope_scaling: RopeScaling,
    /// Granite: token embeddings are multiplied by this.
    #[serde(skip_serializing_if = "is_one")]
    pub embedding_multiplier: f64,
    /// Granite: the attention score scale; 0 = 1/sqrt(head_dim).
    #[serde(skip_serializing_if = "is_zero_f64")]
    pub attention_multiplier: f64,
    /// Granite: each block's attention and MLP outputs are multiplied by this before the
    /// residual add.
    #[serde(skip_serializing_if = "is_one")]
    pub residual_multiplier: f64,
    /// Granite: the logits are divided by this.
    #[serde(skip_serializing_if = "is_one")]
    pub logits_scaling: f64,
    /// Activation recompute on the CUDA fast step: "none" keeps every layer's activations
    /// for the backward; "attention" keeps the MLP's and recomputes each block's attention
    /// half (norm, q/k/v, attention) in the backward; "full" keeps only each block's input
    /// and recomputes the whole block; "offload" recomputes as "full" and keeps the blocks'
    /// inputs in pinned host memory, copied out and back behind the compute. Same loss and
    /// gradients; less memory, more compute. (Not a shape: a run may resume with another
    /// setting.)
    #[serde(skip_serializing_if = "Recompute::is_none")]
    pub recompute: Recompute,
    /// What the family changes in the block: QK-norm, post-norm (`[model.layout]`; the
    /// Hugging Face import of Qwen3 and OLMo 2 sets it).
    #[serde(skip_serializing_if = "super::BlockLayout::is_plain")]
    pub layout: super::BlockLayout,
    /// A Granite 4.0 hybrid stack: Mamba-2 and attention layers, a shared MLP, routed experts
    /// (`[model.hybrid]`; the Hugging Face import of `granitemoehybrid` sets it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hybrid: Option<super::HybridConfig>,
    /// Full fine-tuning: start from these weights (a Hugging Face model directory or a
    /// cockpit run/checkpoint); the model's shape comes from them.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub init_from: String,
    /// Keys given explicitly that differ from `arch`'s family defaults (filled at load, shown
    /// in the run header; not a config key).
    #[serde(skip)]
    pub arch_notes: Vec<String>,
}

// The keys Hugging Face imports added are left out of the JSON at their defaults, so the
// shape hash of checkpoints written before them stays the same.
fn is_zero(v: &usize) -> bool {
    *v == 0
}
fn is_zero_f64(v: &f64) -> bool {
    *v == 0.0
}
fn is_one(v: &f64) -> bool {
    *v == 1.0
}
fn is_false(v: &bool) -> bool {
    !*v
}

/// `model.recompute`: which activations the fast step recomputes in the backward.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Recompute {
    #[default]
    None,
    Attention,
    Full,
    /// "full", with each block's input (the residual stream entering it) kept in pinned host
    /// memory: copied out on a copy stream while the next blocks run, and back one block
    /// ahead of the backward's need.
    Offload,
}

impl Recompute {
    pub fn is_none(&self) -> bool {
        *self == Recompute::None
    }

    /// The backward recomputes whole blocks from their inputs ("full", "offload").
    pub fn whole_block(&self) -> bool {
        matches!(self, Recompute::Full | Recompute::Offload)
    }
}

impl RopeScaling {
    pub fn is_none(&self) -> bool {
        *self == RopeScaling::None
    }
}

/// RoPE frequency scaling (Hugging Face's `rope_scaling` types that cockpit computes).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase", deny_unknown_fields)]
pub enum RopeScaling {
    #[default]
    None,
    /// Every frequency divided by `factor` (position interpolation).
    Linear { factor: f64 },
    /// Llama 3.1+: low frequencies divided by `factor`, high ones kept, a smooth ramp between.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: usize,
    },
    /// Phi-3's LongRoPE: each frequency divided by its `short_factor`, or by its `long_factor`
    /// when the sequence is longer than `original_max_position_embeddings`; cos and sin × the
    /// `attention_factor`.
    LongRope {
        short_factor: Vec<f64>,
        long_factor: Vec<f64>,
        original_max_position_embeddings: usize,
        attention_factor: f64,
    },
}

impl ModelConfig {
    /// The Llama family's defaults for the keys `arch = "llama"` decides: RMSNorm, RoPE,
    /// SwiGLU, no biases, an untied head.
    pub fn llama_family() -> Self {
        Self {
            arch: Arch::Llama,
            norm: Norm::RmsNorm,
            pos: PosEncoding::Rope,
            activation: Activation::SwiGlu,
            bias: false,
            tie_embeddings: false,
            ..Self::default()
        }
    }
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            arch: Arch::Gpt,
            vocab_size: 0,
            n_layer: 2,
            n_head: 4,
            n_kv_head: 0,
            n_embd: 64,
            seq_len: 64,
            mlp_ratio: 4.0,
            norm: Norm::LayerNorm,
            norm_eps: 1e-5,
            pos: PosEncoding::Rope,
            rope_theta: 10000.0,
            activation: Activation::Gelu,
            tie_embeddings: true,
            dropout: 0.0,
            bias: true,
            init_std: 0.02,
            head_dim: 0,
            qkv_bias: false,
            n_positions: 0,
            rope_scaling: RopeScaling::None,
            embedding_multiplier: 1.0,
            attention_multiplier: 0.0,
            residual_multiplier: 1.0,
            logits_scaling: 1.0,
            init_from: String::new(),
            arch_notes: Vec::new(),
            recompute: Recompute::None,
            layout: Default::default(),
            hybrid: None,
        }
    }
}

/// `data.sampling`: where training windows start.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Sampling {
    Auto,
    Random,
    Aligned,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DataConfig {
    /// "builtin" (the generated Markov corpus) or "files" (data.train).
    pub source: String,
    /// Text files: a path, a glob or a directory.
    pub train: String,
    /// Optional validation file(s); empty = split `val_fraction` off the train data.
    pub val: String,
    pub val_fraction: f64,
    /// "auto" (the base model's tokenizer when `model.init_from` or `lora.base` has one, else
    /// "byte"), "base" (the base's; an error without one), "byte" (256 symbols) or a path to a
    /// Hugging Face tokenizer.json.
    pub tokenizer: String,
    /// Batches prepared ahead by the loader thread.
    pub prefetch_depth: usize,
    /// Where training windows start: "random" (any token, from the seed and the position in
    /// the stream), "aligned" (non-overlapping windows of seq_len, reshuffled each epoch) or
    /// "auto" (random for files, aligned for the built-in corpus).
    pub sampling: Sampling,
    /// Put after each document (file, or JSONL record) when packing: "auto" (the tokenizer's
    /// EOS when it has one, else nothing), "eos" (an error without one), "none", or any other
    /// string: that text, tokenized.
    pub doc_separator: String,
    /// The records' shape: "auto" (from the first record of the first file: `messages`,
    /// `prompt` + `completion`, alpaca's `instruction` + `output`, or `text`), "text",
    /// "messages", "prompt_completion" or "alpaca". Plain text files are always text.
    pub format: String,
    /// A chat template: a `.jinja` file, a tokenizer_config.json, or the template itself;
    /// empty: the tokenizer's own (chat_template.jinja or tokenizer_config.json beside it).
    pub chat_template: String,
    /// Instruction/chat data: count every token in the loss, not only the answers.
    pub train_on_prompt: bool,
    /// Instruction/chat data: pack samples into rows (no sample sees another: attention and a
    /// hybrid's Mamba layers begin again at each); false: one sample a row, padded.
    pub packing: bool,
    /// Instruction/chat data: a sample longer than model.seq_len + 1 tokens is "split" into
    /// rows, "drop"ped, or an "error".
    pub long_samples: String,
    /// Built-in corpus: alphabet size.
    pub builtin_vocab: usize,
    /// Built-in corpus: Markov order (tokens of context that determine the next one).
    pub builtin_order: usize,
    /// Built-in corpus: possible successors per context.
    pub builtin_branching: usize,
    /// Built-in corpus: total tokens generated.
    pub builtin_tokens: usize,
    /// Built-in corpus: generator seed (independent of run.seed).
    pub builtin_seed: u64,
}

impl Default for DataConfig {
    fn default() -> Self {
        Self {
            source: "builtin".into(),
            train: String::new(),
            val: String::new(),
            val_fraction: 0.05,
            tokenizer: "auto".into(),
            prefetch_depth: 4,
            sampling: Sampling::Auto,
            doc_separator: "auto".into(),
            format: "auto".into(),
            chat_template: String::new(),
            train_on_prompt: false,
            packing: true,
            long_samples: "split".into(),
            builtin_vocab: 16,
            builtin_order: 2,
            builtin_branching: 4,
            builtin_tokens: 20_000_000,
            builtin_seed: 7,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OptimConfig {
    pub lr: f64,
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// Global gradient-norm clip; 0 = off.
    pub grad_clip: f64,
    /// Sequences per forward pass, or "auto" ([`MICRO_BATCH_AUTO`]): the largest that fits
    /// the device with a 10% margin, found by trying before the run starts.
    #[serde(with = "micro_batch_serde")]
    pub micro_batch: usize,
    /// Micro-batches per optimizer step.
    pub accum: usize,
    /// Apply weight decay to embeddings too (off by default, as for norms and biases).
    pub decay_embeddings: bool,
}

/// `optim.micro_batch = "auto"` as the config holds it until the front end has tried the
/// sizes that fit (a number of sequences is never 0).
pub const MICRO_BATCH_AUTO: usize = 0;

/// `optim.micro_batch`: a positive number of sequences or the string "auto".
mod micro_batch_serde {
    use super::MICRO_BATCH_AUTO;
    use serde::{de, Deserializer, Serializer};
    use std::fmt;

    pub fn serialize<S: Serializer>(v: &usize, s: S) -> Result<S::Ok, S::Error> {
        if *v == MICRO_BATCH_AUTO {
            s.serialize_str("auto")
        } else {
            s.serialize_u64(*v as u64)
        }
    }

    struct V;

    impl de::Visitor<'_> for V {
        type Value = usize;

        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a positive number of sequences or \"auto\"")
        }

        fn visit_u64<E: de::Error>(self, v: u64) -> Result<usize, E> {
            if v == 0 {
                return Err(E::custom(
                    "0 sequences: must be at least 1, or \"auto\" (the largest that fits)",
                ));
            }
            usize::try_from(v).map_err(|_| E::custom(format!("{v} sequences: too many")))
        }

        fn visit_i64<E: de::Error>(self, v: i64) -> Result<usize, E> {
            match u64::try_from(v) {
                Ok(u) => self.visit_u64(u),
                Err(_) => Err(E::custom(format!(
                    "{v} sequences: must be at least 1, or \"auto\""
                ))),
            }
        }

        fn visit_str<E: de::Error>(self, v: &str) -> Result<usize, E> {
            if v == "auto" {
                Ok(MICRO_BATCH_AUTO)
            } else {
                Err(E::custom(format!(
                    "{v:?}: expected a positive number of sequences or \"auto\""
                )))
            }
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<usize, D::Error> {
        d.deserialize_any(V)
    }
}

impl Default for OptimConfig {
    fn default() -> Self {
        Self {
            lr: 1e-2,
            weight_decay: 0.0,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            grad_clip: 1.0,
            micro_batch: 32,
            accum: 1,
            decay_embeddings: false,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ScheduleKind {
    Constant,
    Cosine,
    OneCycle,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScheduleConfig {
    pub kind: ScheduleKind,
    /// Linear warm-up steps (constant and cosine).
    pub warmup_steps: u64,
    /// Floor of the cosine decay and end of one-cycle.
    pub min_lr: f64,
    /// One-cycle: fraction of the steps spent rising.
    pub pct_start: f64,
    /// One-cycle: start at lr / div_factor.
    pub div_factor: f64,
}

impl Default for ScheduleConfig {
    fn default() -> Self {
        Self {
            kind: ScheduleKind::Cosine,
            warmup_steps: 50,
            min_lr: 1e-3,
            pct_start: 0.3,
            div_factor: 25.0,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    Auto,
    F32,
    Bf16,
    F16,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrecisionConfig {
    /// auto: bf16 on compute capability ≥ 8.0, fp16 on ≥ 7.0, else fp32; fp32 on CPU.
    pub dtype: DType,
    /// TF32 for fp32 matmuls where the GPU supports it.
    pub tf32: bool,
    /// fp16 dynamic loss scaling: initial scale.
    pub loss_scale_init: f64,
    /// fp16: grow the scale ×2 after this many clean steps.
    pub loss_scale_growth_interval: u64,
}

impl Default for PrecisionConfig {
    fn default() -> Self {
        Self {
            dtype: DType::Auto,
            tf32: true,
            loss_scale_init: 65536.0,
            loss_scale_growth_interval: 1000,
        }
    }
}

/// The fused CUDA kernels, each switchable (for ablations and tests). They run only on CUDA
/// in f32/bf16/f16; the CPU always takes the plain candle composition.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KernelsConfig {
    /// LayerNorm / RMSNorm forward and backward in one kernel each.
    pub norm: bool,
    /// Attention: scale + causal mask + softmax (and its backward) in one kernel; with
    /// `linear` too (and no RoPE/GQA/attention dropout), q·kᵀ → softmax → ·v as one graph node.
    pub attention: bool,
    /// Linear layers and the token embedding as one graph node each (2-D matmul + bias,
    /// hand-written backward; embedding gradient by an atomic scatter kernel).
    pub linear: bool,
    /// Softmax cross-entropy from the compute-dtype logits (no f32 copy of the logits).
    pub cross_entropy: bool,
    /// Bias add and bias + GELU after the matmuls; bias gradients by a column-sum kernel.
    /// In the whole-model step (`step`): the bias and GELU, and the GELU backward, fused
    /// into the matmuls as cuBLASLt epilogues (off: separate kernels).
    pub bias_gelu: bool,
    /// In the whole-model step: time cuBLASLt's top algorithms for each matmul shape once, at
    /// the first step, and keep the fastest (off: the heuristic's first pick).
    pub autotune: bool,
    /// In the whole-model step: capture each micro-batch's forward and backward as a CUDA
    /// graph and replay it with one launch (off: a few hundred launches per micro-batch).
    pub graphs: bool,
    /// In the whole-model step: the backward's weight gradients and bias sums on a second
    /// CUDA stream, alongside the chain of data gradients (off: one stream).
    pub overlap: bool,
    /// In the whole-model step with LoRA on a 16-bit base: q|k|v and gate|up each copied once
    /// with their adapters' B beside them (`[W | B]`), so that a projection and its adapters
    /// are one matmul forward (`[x | x·Aᵀ]·[W | B]ᵀ`) and one backward (`dy·[W | B]` gives
    /// the input's and the adapters' gradients at once). Off: the base read in place and the
    /// adapters' share through matmuls of their own (each a pass over the projection's
    /// output). The copy costs the base's q, k, v, gate and up weights once more in memory,
    /// and is made only where it takes at most a quarter of the device memory free then.
    pub lora_concat: bool,
    /// AdamW in place and the global gradient norm with one read-back.
    pub adamw: bool,
    /// The whole forward and backward as one hand-scheduled CUDA program over preallocated
    /// buffers (direct cuBLAS, no autograd graph, fp32 gradients accumulated in place), for
    /// GPT-2 and Llama style models in bf16 or fp16 (LayerNorm or RMSNorm, learned positions
    /// or RoPE, GELU or SwiGLU, grouped-query attention, LoRA including a 4-bit base, dropout).
    /// A model it cannot run takes the per-op kernels (the run says why).
    pub step: bool,
}

impl Default for KernelsConfig {
    fn default() -> Self {
        Self {
            norm: true,
            attention: true,
            linear: true,
            cross_entropy: true,
            bias_gelu: true,
            autotune: true,
            graphs: true,
            overlap: true,
            lora_concat: true,
            adamw: true,
            step: true,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ScuParams {
    /// LoRA adapters when fine-tuning, else all weights but norms, biases and embeddings.
    Auto,
    Lora,
    All,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScuConfig {
    /// PI control of λ on; off = S is still measured and λ stays at lambda_init.
    pub enabled: bool,
    /// Setpoint S* as a fraction (0.01 = 1%).
    pub target: f64,
    /// Control law: `adaptive` (measures the plant online — how fast the penalty shrinks
    /// ln Σw² per unit of λ and of learning rate, from the optimizer's second moments — and
    /// sets λ from that model), `log-pi` (velocity-form PI on ε = ln(Ŝ/S*): Δln λ = Kp·Δε +
    /// Ki·ε) or `reference` (the published law: λ ← λ·exp(Kp·e + I) with e = Ŝ − S* and a
    /// leaky integral I).
    pub law: ScuLaw,
    /// adaptive: the fraction of the log error ln(S*/S) the next control step is planned to
    /// close (0.7: see the README for the settle times it gives on the tiny model).
    pub rate: f64,
    /// Proportional gain; unset = the law's default (log-pi 3.0, reference 0.8).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kp: Option<f64>,
    /// Integral gain; unset = the law's default (log-pi 0.1, reference 0.15).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ki: Option<f64>,
    /// |Ŝ − S*| at or below which λ holds; unset = the law's default (log-pi 0, reference 0.002).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub deadband: Option<f64>,
    pub ema_alpha: f64,
    pub integral_leak: f64,
    pub integral_max: f64,
    pub lambda_init: f64,
    pub lambda_min: f64,
    pub lambda_max: f64,
    /// σ of the Gaussian weight prior.
    pub prior_sigma: f64,
    /// N in ParamBPT; 0 = the token count of the training split.
    pub tokens_per_epoch: u64,
    /// Control every this many optimizer steps.
    pub control_every: u64,
    pub params: ScuParams,
}

impl Default for ScuConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            target: 0.02,
            law: ScuLaw::Adaptive,
            rate: 0.7,
            kp: None,
            ki: None,
            deadband: None,
            ema_alpha: 0.1,
            integral_leak: 0.995,
            integral_max: 0.2,
            lambda_init: 1.0,
            lambda_min: 1e-4,
            lambda_max: 1000.0,
            prior_sigma: 0.01,
            tokens_per_epoch: 0,
            control_every: 5,
            params: ScuParams::Auto,
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ScuLaw {
    #[default]
    Adaptive,
    LogPi,
    Reference,
}

impl ScuConfig {
    /// (Kp, Ki, deadband) with the law's defaults filled in.
    pub fn gains(&self) -> (f64, f64, f64) {
        let (kp, ki, db) = match self.law {
            ScuLaw::LogPi | ScuLaw::Adaptive => (3.0, 0.1, 0.0),
            ScuLaw::Reference => (0.8, 0.15, 0.002),
        };
        (
            self.kp.unwrap_or(kp),
            self.ki.unwrap_or(ki),
            self.deadband.unwrap_or(db),
        )
    }
}

/// `lora.base = "random"`: a base of the `[model]` shape with random weights, drawn on the
/// device (for benchmarks; what it learns means nothing).
pub const RANDOM_BASE: &str = "random";

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoraConfig {
    pub enabled: bool,
    pub r: usize,
    pub alpha: f64,
    pub dropout: f64,
    /// Linear layers to adapt: q, k, v, o, up, down, gate.
    pub targets: Vec<String>,
    /// Base weights: a cockpit run/checkpoint or a Hugging Face model directory (see
    /// `model.init_from` for the model types), or [`RANDOM_BASE`] for a base of the
    /// `[model]` shape with random weights (benchmarks: no model files needed).
    pub base: String,
    /// How the frozen base's linear layers are stored: in the training dtype (bf16 on a GPU)
    /// or 4-bit (QLoRA; CUDA only): 4-bit NormalFloat, except that a GGUF base's matrices
    /// stored in 4–6-bit blocks (Q4_0, Q4_1, Q4_K, Q5_K, Q6_K) keep the file's own blocks.
    pub base_dtype: BaseDtype,
}

/// `lora.base_dtype`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BaseDtype {
    #[default]
    Bf16,
    Nf4,
}

impl Default for LoraConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            r: 8,
            alpha: 16.0,
            dropout: 0.0,
            targets: vec!["q".into(), "v".into()],
            base: String::new(),
            base_dtype: BaseDtype::Bf16,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CheckpointConfig {
    /// Save every N optimizer steps; 0 = off.
    pub every_steps: u64,
    /// Save every N minutes of wall time; 0 = off.
    pub every_minutes: f64,
    /// Keep the last K checkpoints (plus the best by val loss).
    pub keep_last: usize,
    pub keep_best: bool,
    /// Save when the run ends.
    pub at_end: bool,
    /// Non-finite steps in a row before the engine restores the last checkpoint.
    pub max_nonfinite_in_a_row: u32,
    /// Restores after which a run that keeps diverging fails.
    pub max_restores: u32,
    /// LR factor applied at each restore.
    pub restore_lr_factor: f64,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        Self {
            every_steps: 200,
            every_minutes: 0.0,
            keep_last: 3,
            keep_best: true,
            at_end: true,
            max_nonfinite_in_a_row: 5,
            max_restores: 3,
            restore_lr_factor: 0.5,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EvalConfig {
    /// Evaluate every N optimizer steps; 0 = only at the end.
    pub every: u64,
    /// Batches (of optim.micro_batch windows at fixed random offsets, the same at every eval)
    /// of the val split per evaluation; 0 = the whole split.
    pub batches: usize,
    pub at_end: bool,
    /// At each eval, continue a fixed prompt greedily by this many tokens (into
    /// metrics.jsonl and the dashboard); 0 = off.
    pub sample_tokens: usize,
    /// The prompt for `sample_tokens`; "" = the first tokens of the val split.
    pub sample_prompt: String,
    /// At each eval, this many sampled continuations (of `sample_tokens` tokens) of each of
    /// `sample_prompts`, decoded together on the live weights; their diversity (distinct-n,
    /// pairwise cosine distance) goes to metrics.jsonl. 0 = off.
    pub samples_per_prompt: usize,
    /// The prompts of `samples_per_prompt` (text; token ids "1 2 3" for the built-in
    /// corpus, which has no tokenizer).
    pub sample_prompts: Vec<String>,
}

impl Default for EvalConfig {
    fn default() -> Self {
        Self {
            every: 100,
            batches: 8,
            at_end: true,
            sample_tokens: 0,
            sample_prompt: String::new(),
            samples_per_prompt: 0,
            sample_prompts: Vec::new(),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MonitorConfig {
    /// Telemetry sampling interval in seconds.
    pub interval_secs: f64,
    /// Advisor sliding window in seconds.
    pub advisor_window_secs: f64,
    /// GPU telemetry during training.
    pub enabled: bool,
    /// TensorBoard event files in `RUN_DIR/tb/`.
    pub tensorboard: bool,
    /// An MLflow file store to log runs into (`mlflow ui --backend-store-uri DIR`); off when
    /// unset.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mlflow: Option<String>,
    /// The MLflow experiment the run goes into (unset: "Default"); `cockpit sweep` sets it
    /// to the sweep's name for its runs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mlflow_experiment: Option<String>,
}

impl Default for MonitorConfig {
    fn default() -> Self {
        Self {
            interval_secs: 1.0,
            advisor_window_secs: 30.0,
            enabled: true,
            tensorboard: true,
            mlflow: None,
            mlflow_experiment: None,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DistributedConfig {
    /// GPUs to train on (one worker process each); 1 = single process.
    pub gpus: usize,
    pub backend: String,
    pub master_addr: String,
    pub master_port: u16,
    pub timeout_secs: f64,
    /// NCCL with the whole-model step: sum gradient buckets over the ranks on a second
    /// communicator while the backward still runs, instead of one sum of all gradients after
    /// it. Off by default: measured on 2 and 4 GPUs, the sums beside the backward stretch it
    /// by about what they hide (the README's "Several GPUs").
    pub overlap: bool,
    /// With `overlap`: the least a gradient bucket holds, in MB of fp32 gradients (whole
    /// layers are joined until a bucket reaches it).
    pub bucket_mb: f64,
    /// ZeRO stage 1: each rank keeps the Adam moments of 1/world of the trainable weights;
    /// gradients are reduce-scattered and each rank updates its shard. On the whole-model
    /// step the ranks then all-gather the updated bf16 compute copies (the fp32 masters
    /// outside a rank's shard are gathered only before checkpoints, evaluation and the end);
    /// elsewhere the updated fp32 weights. Checkpoints keep the full weights and moments
    /// (rank 0 gathers them), so a resume may change the world size. Measured faster than
    /// unsharded on 2 and 4 GPUs (the README's "Several GPUs").
    pub shard_optimizer: bool,
    /// The type gradients are summed in across the ranks: "f32" (exact to fp32 rounding) or
    /// "bf16" (half the bytes on the wire: each rank's gradient rounded to bf16, summed in
    /// bf16 by NCCL, and widened back to the fp32 gradients the optimizer reads).
    pub reduce_dtype: String,
}

impl DistributedConfig {
    /// Whether the ranks sum their gradients in bf16 (`reduce_dtype = "bf16"`).
    pub fn bf16_sums(&self) -> bool {
        self.reduce_dtype == "bf16"
    }
}

impl Default for DistributedConfig {
    fn default() -> Self {
        Self {
            gpus: 1,
            backend: "auto".into(),
            master_addr: "127.0.0.1".into(),
            master_port: 29500,
            timeout_secs: 300.0,
            overlap: false,
            bucket_mb: 16.0,
            shard_optimizer: false,
            reduce_dtype: "f32".into(),
        }
    }
}

/// `cockpit sweep` without `--set-grid` / `--seeds` (training ignores this section).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SweepConfig {
    /// Families of runs, each `KEY=V1,V2,...`; keys joined by `+` form their product.
    pub grid: Vec<String>,
    /// Seeds per combination: run.seed, run.seed+1, ...
    pub seeds: u64,
}

impl Default for SweepConfig {
    fn default() -> Self {
        Self {
            grid: Vec::new(),
            seeds: 1,
        }
    }
}

/// Seeds per combination a sweep may ask for.
pub const MAX_SWEEP_SEEDS: u64 = 1000;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TuiConfig {
    pub fps: u32,
    /// SCU setpoint change per `]` / `[` press (fraction: 0.001 = 0.1 point).
    pub setpoint_step: f64,
    /// Action → key overrides, e.g. `quit = "x"`.
    pub keys: BTreeMap<String, String>,
}

impl Default for TuiConfig {
    fn default() -> Self {
        Self {
            fps: 10,
            setpoint_step: 0.001,
            keys: BTreeMap::new(),
        }
    }
}
