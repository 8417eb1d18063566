//! The whole-model CUDA step's inputs built from the candle model.

use super::*;

/// What `device` says for [`ModelSpec::fast_step_support`] about a model of `spec` in `dtype`
/// (`mixed_trainable`: frozen and trainable weights other than LoRA's).
pub fn step_facts(
    device: &Device,
    dtype: DType,
    spec: &ModelSpec,
    mixed_trainable: bool,
) -> StepFacts {
    StepFacts {
        cuda: device.is_cuda(),
        dtype: super::super::precision::dtype_name(dtype),
        kernels: kernels::step_support(device, dtype).err(),
        flash_fits: kernels::flash_fits(device, spec.head_dim),
        mixed_trainable,
        loss_mask: false,
        packed_samples: false,
    }
}

impl Model {
    /// The weights for the whole-model CUDA step, when this model is one it runs.
    pub fn step_weights(&self) -> Option<StepWeights> {
        self.step_plan().ok()
    }

    /// What this model's device and weights say for [`ModelSpec::fast_step_support`].
    pub fn step_facts(&self) -> StepFacts {
        let lora = self.params.iter().any(|p| p.kind.is_lora());
        let mixed = !self
            .params
            .iter()
            .all(|p| p.trainable == (!lora || p.kind.is_lora()));
        StepFacts {
            loss_mask: self.data_layout.0,
            packed_samples: self.data_layout.1,
            ..step_facts(&self.device, self.dtype, &self.spec, mixed)
        }
    }

    /// The weights for the whole-model CUDA step, or why this model takes the per-op path
    /// ([`ModelSpec::fast_step_support`] decides).
    pub fn step_plan(&self) -> std::result::Result<StepWeights, Reason> {
        let s = &self.spec;
        let facts = self.step_facts();
        s.fast_step_support(&facts)?;
        Ok(self.step_weights_unchecked(s.flash_attention(facts.flash_fits)))
    }

    /// The step's weights, whether or not the step runs this model (the CPU tests hold them
    /// to the spec).
    pub(super) fn step_weights_unchecked(&self, flash: bool) -> StepWeights {
        let s = &self.spec;
        let lora = self.params.iter().any(|p| p.kind.is_lora());
        let norm = |n: &NormLayer| (n.w.clone(), n.b.clone());
        let lin = |l: &Linear| {
            let m = match &l.w {
                Weight::Dense(v) => StepMatrix::Var(v.clone()),
                Weight::Quantized(q) => StepMatrix::Quantized(q.clone()),
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
            .map(|b| {
                let (mixer, first, o) = match &b.mixer {
                    Mixer::Attention(a) => (
                        StepMixer::Attention(StepAttention {
                            q: lin(&a.q),
                            k: lin(&a.k),
                            v: lin(&a.v),
                            o: lin(&a.o),
                            qk_norm: match (&a.q_norm, &a.k_norm) {
                                (Some(q), Some(k)) => Some((q.w.clone(), k.w.clone())),
                                _ => None,
                            },
                        }),
                        [Some(&a.q), Some(&a.k), Some(&a.v)],
                        &a.o,
                    ),
                    // (in_proj's adapter in q's slot, out_proj's in o's.)
                    Mixer::Mamba(m) => (
                        StepMixer::Mamba(StepMamba {
                            in_proj: lin(&m.in_proj),
                            out_proj: lin(&m.out_proj),
                            conv_w: m.conv_w.clone(),
                            conv_b: m.conv_b.clone(),
                            dt_bias: m.dt_bias.clone(),
                            a_log: m.a_log.clone(),
                            d: m.d.clone(),
                            norm: m.norm.clone(),
                        }),
                        [Some(&m.in_proj), None, None],
                        &m.out_proj,
                    ),
                };
                StepLayer {
                    ln1: norm(&b.ln1),
                    mixer,
                    ln2: norm(&b.ln2),
                    gate: b.gate.as_ref().map(lin),
                    up: lin(&b.up),
                    down: lin(&b.down),
                    lora: [
                        adapter(first[0]),
                        adapter(first[1]),
                        adapter(first[2]),
                        adapter(Some(o)),
                        adapter(b.gate.as_ref()),
                        adapter(Some(&b.up)),
                        adapter(Some(&b.down)),
                    ],
                    post: match (&b.post_attn, &b.post_mlp) {
                        (Some(pa), Some(pm)) => Some((pa.w.clone(), pm.w.clone())),
                        _ => None,
                    },
                    moe: b.moe.as_ref().map(|m| m.step()),
                }
            })
            .collect();
        StepWeights {
            spec: s.clone(),
            half: self.dtype == DType::F16,
            wte: self.wte.clone(),
            wpe: self.wpe.clone(),
            flash,
            lora_dropout: self
                .linears()
                .iter()
                .filter_map(|(_, l)| l.lora.as_ref().map(|a| a.p))
                .fold(0.0, f64::max),
            layers,
            frozen_base: lora,
            ln_f: norm(&self.ln_f),
            head: self.lm_head.clone(),
            shards: 1,
        }
    }
}
