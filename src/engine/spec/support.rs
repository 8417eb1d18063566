//! Whether the whole-model CUDA step runs a model, and why not: [`ModelSpec::fast_step_support`]
//! is the only place that decides it (the candle model asks it before handing its weights to
//! the step, the step asks its shape part again when it is built, the run header and
//! `cockpit check` print its [`Reason`]).

use super::ModelSpec;
use crate::config::{PosEncoding, QkNorm};

/// The head dims flash attention has kernels for; other head dims materialise the attention
/// probabilities (multi-head attention without dropout only).
pub const FLASH_HEAD_DIMS: [usize; 2] = [64, 128];

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
}

impl std::fmt::Display for NoFlash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("flash attention has head dims 64 and 128")?;
        match self {
            NoFlash::HeadDim => Ok(()),
            NoFlash::Off => f.write_str("; kernels.attention = false"),
            NoFlash::SharedMemory => f.write_str(
                "; its kernels for this head dim need more shared memory a block than this GPU has",
            ),
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
    #[error("grouped-query attention at head dim {head_dim} ({why})")]
    GroupedQueryNeedsFlash { head_dim: usize, why: NoFlash },
    #[error("{n_head} heads of {head_dim} ≠ n_embd {n_embd} at head dim {head_dim} ({why})")]
    HeadWidthNeedsFlash {
        n_head: usize,
        head_dim: usize,
        n_embd: usize,
        why: NoFlash,
    },
    #[error("dropout at head dim {head_dim} ({why})")]
    DropoutNeedsFlash { head_dim: usize, why: NoFlash },
    #[error("an embedding multiplier with learned positions (per-op only)")]
    EmbeddingMultiplier,
    #[error("a mix of frozen and trainable weights other than LoRA's")]
    MixedTrainable,
    #[error("RMSNorm on q and k ({0}: Qwen3/OLMo 2 QK-norm; the step has no kernel for it yet)")]
    QkNorm(&'static str),
    #[error("RoPE on {rotary_dim} of {head_dim} dims of each head (Phi-3 partial rotary; the step rotates whole heads)")]
    PartialRotary { rotary_dim: usize, head_dim: usize },
    #[error("norms after the attention and MLP outputs (OLMo 2 post-norm; the step's blocks are pre-norm)")]
    PostNorm,
    #[error("packed samples (data.packing): the step's flash attention has no per-sample boundaries yet")]
    PackedSamples,
    #[error("a Granite 4.0 hybrid (Mamba-2 layers, routed experts): the step has no kernels for them yet")]
    Hybrid,
    #[error("loss on the answers only (instruction/chat data): the step's cross-entropy takes no ignored targets yet")]
    LossMask,
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
        if facts.packed_samples {
            return Err(Reason::PackedSamples);
        }
        if facts.loss_mask {
            return Err(Reason::LossMask);
        }
        Ok(())
    }

    /// The shape part of [`Self::fast_step_support`], given whether flash attention serves
    /// the model ([`Self::flash_attention`]): widths multiples of 8 (16-byte accesses), an
    /// even head dim, key/value heads that divide the heads; grouped-query attention, heads
    /// whose widths do not add up to n_embd and dropout need flash attention; an embedding
    /// multiplier needs RoPE (the step's embedding adds learned positions before it scales);
    /// QK-norm, post-norm blocks and partial rotary have no kernels in the step yet.
    pub fn step_shape_support(&self, flash: bool) -> Result<(), Reason> {
        let hd = self.head_dim;
        // (Why not, where flash attention is off: the first of its conditions that fails,
        // else the GPU's shared memory.)
        let no_flash = if flash { None } else { self.no_flash(false) };
        if self.n_layer == 0 {
            return Err(Reason::NoLayers);
        }
        if self.hybrid.is_some() {
            return Err(Reason::Hybrid);
        }
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
            if self.n_kv_head != self.n_head {
                return Err(Reason::GroupedQueryNeedsFlash { head_dim: hd, why });
            }
            if self.q_width() != self.n_embd {
                return Err(Reason::HeadWidthNeedsFlash {
                    n_head: self.n_head,
                    head_dim: hd,
                    n_embd: self.n_embd,
                    why,
                });
            }
            if self.dropout > 0.0 {
                return Err(Reason::DropoutNeedsFlash { head_dim: hd, why });
            }
        }
        if self.embedding_multiplier != 1.0 && self.pos != PosEncoding::Rope {
            return Err(Reason::EmbeddingMultiplier);
        }
        match self.layout.qk_norm {
            QkNorm::None => {}
            QkNorm::Head => return Err(Reason::QkNorm("per head")),
            QkNorm::Whole => return Err(Reason::QkNorm("over the whole projection")),
        }
        if self.layout.post_norm {
            return Err(Reason::PostNorm);
        }
        if self.rotary_dim() != hd {
            return Err(Reason::PartialRotary {
                rotary_dim: self.rotary_dim(),
                head_dim: hd,
            });
        }
        Ok(())
    }
}
