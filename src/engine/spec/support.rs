//! Whether the whole-model CUDA step runs a model, and why not: [`ModelSpec::fast_step_support`]
//! is the only place that decides it (the candle model asks it before handing its weights to
//! the step, the step asks its shape part again when it is built, the run header and
//! `cockpit check` print its [`Reason`]).

use super::ModelSpec;
use crate::config::{MixerKind, PosEncoding, QkNorm};

/// The head dims flash attention has kernels for; other head dims materialise the attention
/// probabilities (no dropout, no packed samples).
pub const FLASH_HEAD_DIMS: [usize; 3] = [64, 128, 256];

/// The head dim whose flash kernels take Gemma 2's attention soft-cap (Gemma 2's 2B and 9B,
/// Gemma 3's heads); soft-capped models of other head dims (Gemma 2 27B's 128) materialise
/// the attention, whose softmax caps the scores.
pub const FLASH_SOFTCAP_HEAD_DIM: usize = 256;

/// What the device and the built model say, for [`ModelSpec::fast_step_support`].
#[derive(Clone, Debug)]
pub struct StepFacts {
    /// The model lives on a CUDA device.
    pub cuda: bool,
    /// The compute dtype's name (`bf16`, `f16`, `f32`, …).
    pub dtype: &'static str,
    /// Why this GPU's kernel build cannot run the step in that dtype (None: it can).
    pub kernels: Option<String>,
    /// Flash attention's kernels for the model's head dim fit the GPU's shared memory a block.
    pub flash_fits: bool,
    /// Some weights are frozen and some train, other than LoRA's split (frozen base,
    /// trainable adapters).
    pub mixed_trainable: bool,
    /// The data's targets carry a loss mask (instruction/chat data: only the answers train).
    pub loss_mask: bool,
    /// The data's rows pack several samples that must not attend to one another.
    pub packed_samples: bool,
}

/// Why flash attention does not serve a model (the step then materialises the attention,
/// which covers less).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NoFlash {
    /// No kernels for this head dim.
    HeadDim,
    /// `kernels.attention = false`.
    Off,
    /// Its kernels for this head dim need more shared memory a block than the GPU has.
    SharedMemory,
    /// Attention soft-capping (Gemma 2) at a head dim other than
    /// [`FLASH_SOFTCAP_HEAD_DIM`]: the materialised softmax caps the scores, those flash
    /// kernels do not.
    SoftCap,
}

impl std::fmt::Display for NoFlash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("flash attention has head dims 64, 128 and 256")?;
        match self {
            NoFlash::HeadDim => Ok(()),
            NoFlash::Off => f.write_str("; kernels.attention = false"),
            NoFlash::SharedMemory => f.write_str(
                "; its kernels for this head dim need more shared memory a block than this GPU has",
            ),
            NoFlash::SoftCap => f.write_str(", attention soft-capping at 256"),
        }
    }
}

/// Why the whole-model CUDA step does not run a model (the per-op path runs it instead).
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum Reason {
    #[error("kernels.step = false")]
    Off,
    #[error("not on a CUDA device")]
    NotCuda,
    #[error("precision {0} (the step runs bf16 or f16)")]
    Precision(&'static str),
    #[error("{0}")]
    Kernels(String),
    #[error("the model has no layers")]
    NoLayers,
    #[error("n_embd {n_embd} and the MLP width {hidden} must be multiples of 8")]
    Widths { n_embd: usize, hidden: usize },
    #[error("odd head dim {0}")]
    OddHeadDim(usize),
    #[error("{n_kv_head} key/value heads do not divide {n_head} heads")]
    KvHeads { n_kv_head: usize, n_head: usize },
    #[error("dropout at head dim {head_dim} ({why})")]
    DropoutNeedsFlash { head_dim: usize, why: NoFlash },
    #[error("an embedding multiplier with learned positions (per-op only)")]
    EmbeddingMultiplier,
    #[error("a mix of frozen and trainable weights other than LoRA's")]
    MixedTrainable,
    #[error(
        "RMSNorm on q and k ({0}: the step has QK-norm per head of up to 256 dims, as Qwen3's, and over whole projections of up to 8192, as OLMo 2's)"
    )]
    QkNorm(&'static str),
    #[error("RoPE on an odd {rotary_dim} of {head_dim} dims of each head (the step turns pairs of dims)")]
    PartialRotary { rotary_dim: usize, head_dim: usize },
    #[error("norms after the attention and MLP outputs with biases (OLMo 2's post-norm: the step adds a projection's bias after its output norm)")]
    PostNorm,
    #[error("norms on the outputs of attention and MLP with biases (the step adds a projection's bias after the output's norm)")]
    SandwichNorm,
    #[error("packed samples (data.packing) with {0} (the step keeps packed samples apart in flash attention with RoPE)")]
    PackedSamples(&'static str),
    #[error("{key} = {value}: the step's routed experts take {takes}")]
    Experts {
        key: &'static str,
        value: usize,
        takes: &'static str,
    },
    #[error("{key} = {value}: the step's Mamba kernels take {takes}")]
    Mamba {
        key: &'static str,
        value: usize,
        takes: &'static str,
    },
}

impl ModelSpec {
    /// Whether the step's flash attention serves this model on a GPU where its kernels for
    /// this head dim fit (`flash_fits`) or do not.
    pub fn flash_attention(&self, flash_fits: bool) -> bool {
        self.no_flash(flash_fits).is_none()
    }

    fn no_flash(&self, flash_fits: bool) -> Option<NoFlash> {
        if !self.kernels.attention {
            Some(NoFlash::Off)
        } else if !FLASH_HEAD_DIMS.contains(&self.head_dim) {
            Some(NoFlash::HeadDim)
        } else if !flash_fits {
            Some(NoFlash::SharedMemory)
        } else if self.attn_softcap().is_some() && self.head_dim != FLASH_SOFTCAP_HEAD_DIM {
            Some(NoFlash::SoftCap)
        } else {
            None
        }
    }

    /// Whether the whole-model CUDA step runs this model, and why not. The step needs
    /// `kernels.step`, bf16 or f16 on a CUDA GPU whose kernels run it, then what
    /// [`Self::step_shape_support`] asks, and every weight trainable or (LoRA) exactly the
    /// adapters.
    pub fn fast_step_support(&self, facts: &StepFacts) -> Result<(), Reason> {
        if !self.kernels.step {
            return Err(Reason::Off);
        }
        if !facts.cuda {
            return Err(Reason::NotCuda);
        }
        if !matches!(facts.dtype, "bf16" | "f16") {
            return Err(Reason::Precision(facts.dtype));
        }
        if let Some(why) = &facts.kernels {
            return Err(Reason::Kernels(why.clone()));
        }
        self.step_shape_support(self.flash_attention(facts.flash_fits))?;
        if facts.mixed_trainable {
            return Err(Reason::MixedTrainable);
        }
        // (A loss mask needs nothing more: the step's cross-entropy skips ignored targets.)
        if facts.packed_samples {
            if !self.flash_attention(facts.flash_fits) {
                return Err(Reason::PackedSamples("materialised attention"));
            }
            if self.pos != PosEncoding::Rope {
                return Err(Reason::PackedSamples("learned positions"));
            }
            if self.rope_long(self.seq_len) {
                // (the factors follow each batch's longest sample; the step has T's table)
                return Err(Reason::PackedSamples("LongRoPE past its original context"));
            }
        }
        Ok(())
    }

    /// The shape part of [`Self::fast_step_support`], given whether flash attention serves
    /// the model ([`Self::flash_attention`]): widths multiples of 8 (16-byte accesses), an
    /// even head dim, key/value heads that divide the heads; dropout needs flash attention; an embedding
    /// multiplier needs RoPE (the step's embedding adds learned positions before it scales);
    /// QK-norm per head and over the whole projection, partial rotary, LongRoPE's tables,
    /// Gemma's sandwich and 1 + w norms, GeGLU, sliding windows, Gemma 2's soft-caps and OLMo
    /// 2's post-norm blocks have kernels (output norms with biases do not); a Granite
    /// 4.0 hybrid's Mamba layers within the sizes of their kernels, no routed experts yet.
    pub fn step_shape_support(&self, flash: bool) -> Result<(), Reason> {
        let hd = self.head_dim;
        // (Why not, where flash attention is off: the first of its conditions that fails,
        // else the GPU's shared memory.)
        let no_flash = if flash { None } else { self.no_flash(false) };
        if self.n_layer == 0 {
            return Err(Reason::NoLayers);
        }
        self.hybrid_support()?;
        if !self.n_embd.is_multiple_of(8) || !self.hidden.is_multiple_of(8) {
            return Err(Reason::Widths {
                n_embd: self.n_embd,
                hidden: self.hidden,
            });
        }
        if !hd.is_multiple_of(2) {
            return Err(Reason::OddHeadDim(hd));
        }
        if self.n_kv_head == 0 || !self.n_head.is_multiple_of(self.n_kv_head) {
            return Err(Reason::KvHeads {
                n_kv_head: self.n_kv_head,
                n_head: self.n_head,
            });
        }
        if let Some(why) = no_flash {
            if self.dropout > 0.0 {
                return Err(Reason::DropoutNeedsFlash { head_dim: hd, why });
            }
        }
        if self.embedding_multiplier != 1.0 && self.pos != PosEncoding::Rope {
            return Err(Reason::EmbeddingMultiplier);
        }
        match self.layout.qk_norm {
            QkNorm::None => {}
            QkNorm::Head if self.head_dim <= 256 => {}
            QkNorm::Head => return Err(Reason::QkNorm("per head over more than 256 dims")),
            QkNorm::Whole if self.q_width().max(self.kv_width()) <= 8192 => {}
            QkNorm::Whole => return Err(Reason::QkNorm("over a projection wider than 8192")),
        }
        if self.layout.post_norm && (self.bias || self.qkv_bias) {
            return Err(Reason::PostNorm);
        }
        if !self.rotary_dim().is_multiple_of(2) {
            return Err(Reason::PartialRotary {
                rotary_dim: self.rotary_dim(),
                head_dim: hd,
            });
        }
        self.gemma_support()
    }

    /// Whether the model has Mamba layers (a hybrid's).
    fn mamba_layers(&self) -> bool {
        self.hybrid
            .as_ref()
            .is_some_and(|h| h.layers.contains(&MixerKind::Mamba))
    }

    /// A Granite 4.0 hybrid's part: its Mamba layers within what the step's kernels take
    /// (head widths multiples of 8 up to 128 — so the inner width is one of 8 too — states
    /// multiples of 8 up to 256, convs up to 8 wide), its routed experts within what the
    /// step's router takes (up to 256 experts, 16 a token, widths multiples of 8). Its
    /// attention layers take the checks every model's do.
    fn hybrid_support(&self) -> Result<(), Reason> {
        let Some(h) = &self.hybrid else {
            return Ok(());
        };
        if h.experts > 0 {
            for (key, value, ok, takes) in [
                (
                    "model.hybrid.experts",
                    h.experts,
                    h.experts <= 256,
                    "up to 256 experts",
                ),
                (
                    "model.hybrid.experts_top_k",
                    h.experts_top_k,
                    h.experts_top_k <= 16,
                    "up to 16 experts a token",
                ),
                (
                    "model.hybrid.expert_hidden",
                    h.expert_hidden,
                    h.expert_hidden.is_multiple_of(8),
                    "widths that are multiples of 8",
                ),
            ] {
                if !ok {
                    return Err(Reason::Experts { key, value, takes });
                }
            }
        }
        if !self.mamba_layers() {
            return Ok(());
        }
        let eighths = |v: usize, max: usize| v.is_multiple_of(8) && v <= max;
        for (key, value, ok, takes) in [
            (
                "model.hybrid.mamba_d_head",
                h.mamba_d_head,
                eighths(h.mamba_d_head, 128),
                "multiples of 8 up to 128",
            ),
            (
                "model.hybrid.mamba_d_state",
                h.mamba_d_state,
                eighths(h.mamba_d_state, 256),
                "multiples of 8 up to 256",
            ),
            (
                "model.hybrid.mamba_d_conv",
                h.mamba_d_conv,
                h.mamba_d_conv <= 8,
                "up to 8",
            ),
            // (the gated norm's backward sums its weight's gradient in 48 KB of shared memory)
            (
                "model.hybrid.mamba_n_heads",
                h.mamba_n_heads,
                h.mamba_inner() <= 12288,
                "heads × mamba_d_head up to 12288",
            ),
        ] {
            if !ok {
                return Err(Reason::Mamba { key, value, takes });
            }
        }
        Ok(())
    }

    /// Gemma's block (sandwich norms, 1 + w norms, GeGLU), sliding layers and Gemma 2's
    /// soft-caps are in the step (the attention's in the head-dim-256 flash kernels or in
    /// materialised attention, [`NoFlash::SoftCap`]; the final one in the cross-entropy
    /// kernels).
    fn gemma_support(&self) -> Result<(), Reason> {
        if self.layout.sandwich_norm && (self.bias || self.qkv_bias) {
            return Err(Reason::SandwichNorm);
        }
        Ok(())
    }
}
