//! How many weights a [`ModelSpec`] has, before any of them exists (the memory check, the
//! run header): equal to what the candle model allocates (`Model::param_count`; a test holds
//! them together).

use super::ModelSpec;
use crate::config::{Norm, PosEncoding};

/// A model's weights: the base's and the LoRA adapters'.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParamCount {
    pub base: u64,
    pub adapters: u64,
}

impl ParamCount {
    pub fn total(&self) -> u64 {
        self.base + self.adapters
    }
}

impl ModelSpec {
    /// The weights of each linear layer of one block: `(short name, out, in, bias)` in the
    /// order [`crate::engine::kernels::spec::LORA_TARGETS`] names them (gate only in a gated
    /// MLP).
    pub fn block_linears(&self) -> Vec<(&'static str, usize, usize, bool)> {
        let (c, qw, kvw, h) = (self.n_embd, self.q_width(), self.kv_width(), self.hidden);
        let qkv_bias = self.bias || self.qkv_bias;
        let mut v = vec![
            ("q", qw, c, qkv_bias),
            ("k", kvw, c, qkv_bias),
            ("v", kvw, c, qkv_bias),
            ("o", c, qw, self.bias),
        ];
        if self.gated_mlp() {
            v.push(("gate", h, c, self.bias));
        }
        v.push(("up", h, c, self.bias));
        v.push(("down", c, h, self.bias));
        v
    }

    /// The linear layers of layer `l` as [`Self::block_linears`] gives them; in a hybrid
    /// stack the layer's own: a Mamba layer's in_proj (`z | x B C | dt`) and out_proj, or an
    /// attention layer's q, k, v, o without biases, then the shared MLP's gate | up as one
    /// "up" (`shared_mlp.input_linear`) and its "down".
    pub fn layer_linears(&self, l: usize) -> Vec<(&'static str, usize, usize, bool)> {
        let Some(h) = &self.hybrid else {
            return self.block_linears();
        };
        let (c, hid) = (self.n_embd, self.hidden);
        let mut v = if h.is_mamba(l) {
            let bias = h.mamba_proj_bias;
            vec![
                ("in_proj", h.in_proj_width(), c, bias),
                ("out_proj", c, h.mamba_inner(), bias),
            ]
        } else {
            let (qw, kvw) = (self.q_width(), self.kv_width());
            vec![
                ("q", qw, c, false),
                ("k", kvw, c, false),
                ("v", kvw, c, false),
                ("o", c, qw, false),
            ]
        };
        v.extend([("up", 2 * hid, c, false), ("down", c, hid, false)]);
        v
    }

    /// Weights of one norm layer: a scale, and a shift where LayerNorm has biases.
    fn norm_params(&self) -> u64 {
        let c = self.n_embd as u64;
        if self.norm == Norm::LayerNorm && self.bias {
            2 * c
        } else {
            c
        }
    }

    /// Every weight the model has: embeddings, positions, blocks, final norm, an untied
    /// head, and the LoRA adapters on their targets.
    pub fn param_count(&self) -> ParamCount {
        let c = self.n_embd as u64;
        let vocab = self.vocab_size as u64;
        let mut base = vocab * c;
        if !self.tie_embeddings {
            base += vocab * c;
        }
        if self.pos == PosEncoding::Learned {
            base += self.n_positions as u64 * c;
        }
        if let Some(h) = &self.hybrid {
            let (layers, adapters) = self.hybrid_layers(h);
            base += layers + self.norm_params();
            return ParamCount { base, adapters };
        }
        // Gemma's sandwich: a norm on each input and each output of attention and MLP.
        let norms = if self.layout.sandwich_norm { 4 } else { 2 };
        let mut layer = norms * self.norm_params();
        if let Some((q, k)) = self.qk_norm_widths() {
            layer += (q + k) as u64;
        }
        let mut adapters = 0u64;
        for (name, out, inp, bias) in self.block_linears() {
            layer += (out * inp) as u64 + if bias { out as u64 } else { 0 };
            if let Some(l) = &self.lora {
                if l.targets.iter().any(|t| t == name) {
                    adapters += (l.r * (out + inp)) as u64;
                }
            }
        }
        base += self.n_layer as u64 * layer + self.norm_params();
        ParamCount {
            base,
            adapters: self.n_layer as u64 * adapters,
        }
    }

    /// The weights of a hybrid stack's layers and of their adapters.
    fn hybrid_layers(&self, h: &crate::config::HybridConfig) -> (u64, u64) {
        let c = self.n_embd;
        let (mut base, mut adapters) = (0u64, 0u64);
        let targeted = |t: &str| {
            self.lora
                .as_ref()
                .filter(|l| l.targets.iter().any(|x| x == t))
        };
        for l in 0..self.n_layer {
            base += 2 * c as u64;
            if h.is_mamba(l) {
                let (inner, conv) = (h.mamba_inner(), h.conv_dim());
                base += (conv * h.mamba_d_conv) as u64;
                base += if h.mamba_conv_bias { conv as u64 } else { 0 };
                base += (3 * h.mamba_n_heads + inner) as u64;
            }
            if h.experts > 0 {
                base += (h.experts * c * (1 + 3 * h.expert_hidden)) as u64;
            }
            for (name, out, inp, bias) in self.layer_linears(l) {
                base += (out * inp) as u64 + if bias { out as u64 } else { 0 };
                if let Some(lo) = targeted(name) {
                    adapters += (lo.r * (out + inp)) as u64;
                }
            }
        }
        (base, adapters)
    }
}
