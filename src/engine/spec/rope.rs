//! RoPE's frequencies: the one place they are computed (the candle model, generation and the
//! CUDA step use them).

use super::ModelSpec;
use crate::config::RopeScaling;

impl ModelSpec {
    /// The dims of each head RoPE rotates: all of them, or Phi-3's partial rotary's first ones.
    pub fn rotary_dim(&self) -> usize {
        match self.layout.rotary_dim {
            0 => self.head_dim,
            r => r,
        }
    }

    /// RoPE inverse frequencies (radians per position), one per pair of a head's dimensions:
    /// `θ^(-2i/head_dim)`, then Hugging Face's `rope_scaling` (linear, llama3). The one place the
    /// frequencies are computed: the candle model, generation and the CUDA step use it.
    pub fn rope_inv_freq(&self) -> Vec<f64> {
        let hd = self.rotary_dim();
        let base: Vec<f64> = (0..hd / 2)
            .map(|i| 1.0 / self.rope_theta.powf((2 * i) as f64 / hd as f64))
            .collect();
        match self.rope_scaling {
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
}
