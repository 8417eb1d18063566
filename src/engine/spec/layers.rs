//! Per-layer attention and Gemma's block: which layers attend through a sliding window, which
//! RoPE frequencies each layer reads, the soft-caps. Read by the candle model (forward and
//! decode) and by [`ModelSpec::step_shape_support`], which refuses what the CUDA step lacks.

use super::rope::RopeKey;
use super::ModelSpec;

impl ModelSpec {
    /// Layer `l`'s attention window in positions, the query's own included (None: every
    /// earlier position).
    pub fn layer_window(&self, l: usize) -> Option<usize> {
        self.layout.window_of(l)
    }

    /// Which RoPE frequencies layer `l` reads in a forward over `len` positions: a sliding
    /// layer's own θ (Gemma 3's `rope_local_base_freq`) or the model's; the model's longrope
    /// long factors when `len` is past the original context.
    pub fn layer_rope(&self, l: usize, len: usize) -> RopeKey {
        let local = self.layout.local_rope_theta > 0.0 && self.layer_window(l).is_some();
        RopeKey {
            local,
            long: !local && self.rope_long(len),
        }
    }

    /// Every RoPE table a forward may read (the model's, then the local and long ones it
    /// has).
    pub fn rope_keys(&self) -> Vec<RopeKey> {
        let mut keys = vec![RopeKey::default()];
        for l in 0..self.n_layer {
            for len in [1, usize::MAX] {
                let k = self.layer_rope(l, len);
                if !keys.contains(&k) {
                    keys.push(k);
                }
            }
        }
        keys
    }

    /// Attention's forward FLOPs over one sequence of `len` positions, per attention layer (the
    /// mean over them; a hybrid's Mamba layers have none), as flash attention counts them: two
    /// products of 2·head_dim multiply-adds per head and (query, visible key) pair — causal,
    /// and through each layer's sliding window. The backward's five products are 2.5x this.
    /// None without attention layers.
    pub fn attention_flops_fwd(&self, len: usize) -> Option<f64> {
        let layers: Vec<usize> = (0..self.n_layer)
            .filter(|&l| {
                self.hybrid
                    .as_ref()
                    .is_none_or(|h| h.layers.get(l) != Some(&crate::config::MixerKind::Mamba))
            })
            .collect();
        if layers.is_empty() || len == 0 {
            return None;
        }
        let pairs = |w: Option<usize>| -> f64 {
            let t = len as f64;
            match w {
                // Σ_i min(i + 1, w): the first w queries see i + 1 keys, the rest w.
                Some(w) if w < len => {
                    let w = w as f64;
                    w * (w + 1.0) / 2.0 + (t - w) * w
                }
                _ => t * (t + 1.0) / 2.0,
            }
        };
        let total: f64 = layers.iter().map(|&l| pairs(self.layer_window(l))).sum();
        Some(4.0 * (self.n_head * self.head_dim) as f64 * total / layers.len() as f64)
    }

    /// Gemma 2's attention soft-cap (scores → cap·tanh(scores/cap)).
    pub fn attn_softcap(&self) -> Option<f64> {
        (self.layout.attn_softcap > 0.0).then_some(self.layout.attn_softcap)
    }

    /// Gemma 2's final soft-cap (logits → cap·tanh(logits/cap)).
    pub fn final_softcap(&self) -> Option<f64> {
        (self.layout.final_softcap > 0.0).then_some(self.layout.final_softcap)
    }

    /// The run header's words for Gemma's block and the sliding layers.
    pub(super) fn layers_family(&self) -> String {
        let l = &self.layout;
        let mut out = String::new();
        if l.sandwich_norm {
            out.push_str(" sandwich-norm");
        }
        if l.norm_plus_one {
            out.push_str(" norm(1+w)");
        }
        if l.has_sliding() {
            let n = (0..self.n_layer)
                .filter(|&i| self.layer_window(i).is_some())
                .count();
            out.push_str(&format!(" sliding {n}/{} w{}", self.n_layer, l.window));
            if l.local_rope_theta > 0.0 {
                out.push_str(&format!(" θlocal {}", l.local_rope_theta));
            }
        }
        if let Some(c) = self.attn_softcap() {
            out.push_str(&format!(" attn-cap {c}"));
        }
        if let Some(c) = self.final_softcap() {
            out.push_str(&format!(" logit-cap {c}"));
        }
        out
    }
}
