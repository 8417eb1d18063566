//! RoPE's frequencies: the one place they are computed (the candle model, generation and the
//! CUDA step use them).

use super::ModelSpec;
use crate::config::RopeScaling;

/// Which RoPE table a layer reads ([`ModelSpec::layer_rope`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RopeKey {
    /// A sliding layer's own θ (`layout.local_rope_theta`, no scaling).
    pub local: bool,
    /// LongRoPE's long factors (the sequence is past the original context).
    pub long: bool,
}

/// The frequencies of one table and the factor on its cos and sin.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeFreqs {
    /// Radians per position, one per pair of rotated dims.
    pub inv_freq: Vec<f64>,
    /// cos and sin × this (LongRoPE's attention factor; 1 otherwise).
    pub scale: f64,
}

impl ModelSpec {
    /// The dims of each head RoPE rotates: all of them, or Phi-3's partial rotary's first ones.
    pub fn rotary_dim(&self) -> usize {
        match self.layout.rotary_dim {
            0 => self.head_dim,
            r => r,
        }
    }

    /// RoPE inverse frequencies (radians per position) of the model's table, one per pair of a
    /// head's rotated dimensions: `θ^(-2i/rotary_dim)`, then Hugging Face's `rope_scaling`
    /// (linear, llama3; longrope's short factors). The one place the frequencies are
    /// computed: the candle model, generation and the CUDA step use it.
    pub fn rope_inv_freq(&self) -> Vec<f64> {
        self.rope_freqs(RopeKey::default()).inv_freq
    }

    /// Whether a forward over `len` positions reads LongRoPE's long factors: transformers 5
    /// switches on the length of the forward (`max(position_ids) + 1 >
    /// original_max_position_embeddings`), for every position of it; its generation recomputes
    /// the cache when the sequence crosses that length, and so does cockpit's.
    pub fn rope_long(&self, len: usize) -> bool {
        match &self.rope_scaling {
            RopeScaling::LongRope {
                original_max_position_embeddings,
                ..
            } => len > *original_max_position_embeddings,
            _ => false,
        }
    }

    /// The frequencies and cos/sin factor of one table ([`RopeKey`]).
    pub fn rope_freqs(&self, key: RopeKey) -> RopeFreqs {
        let hd = self.rotary_dim();
        let theta = if key.local {
            self.layout.local_rope_theta
        } else {
            self.rope_theta
        };
        let base: Vec<f64> = (0..hd / 2)
            .map(|i| 1.0 / theta.powf((2 * i) as f64 / hd as f64))
            .collect();
        let plain = |inv_freq| RopeFreqs {
            inv_freq,
            scale: 1.0,
        };
        if key.local {
            return plain(base);
        }
        match &self.rope_scaling {
            RopeScaling::None => plain(base),
            RopeScaling::Linear { factor } => plain(base.iter().map(|f| f / factor).collect()),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                let old = *original_max_position_embeddings as f64;
                let low_wavelen = old / low_freq_factor;
                let high_wavelen = old / high_freq_factor;
                plain(
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
                        .collect(),
                )
            }
            RopeScaling::LongRope {
                short_factor,
                long_factor,
                attention_factor,
                ..
            } => {
                let ext = if key.long { long_factor } else { short_factor };
                RopeFreqs {
                    inv_freq: base.iter().zip(ext).map(|(f, e)| f / e).collect(),
                    scale: *attention_factor,
                }
            }
        }
    }
}
