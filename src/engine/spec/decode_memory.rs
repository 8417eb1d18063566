//! What one row of a batched generation holds on the device: what `cockpit generate` sizes
//! its batches by when `--batch-size` is not given.

use super::ModelSpec;

impl ModelSpec {
    /// Bytes one row of a batch takes on the device while it decodes `capacity` columns after
    /// a prompt of `prompt` tokens, in a compute dtype of `elem` bytes:
    /// - its cache: every attention layer's keys and values for `capacity` columns; a Mamba
    ///   layer's conv window and f32 scan state, counted twice (a CUDA graph's step writes
    ///   copies of its own);
    /// - its columns' padding mask, positions and RoPE tables;
    /// - the prefill's per-token activations over its prompt (the residual stream and norms,
    ///   q|k|v and the attention output, the MLP's gate|up and product, a Mamba layer's
    ///   in_proj output), one layer's worth at a time;
    /// - a step's logits and the sampler's buffers over the vocabulary (f32).
    ///
    /// An estimate with room to spare: a batch's size is chosen from it, and nothing else
    /// depends on it.
    pub fn decode_bytes_per_row(&self, prompt: usize, capacity: usize, elem: usize) -> u64 {
        let (prompt, cap, e) = (prompt as u64, capacity as u64, elem as u64);
        let hd = self.head_dim() as u64;
        let kv = 2 * self.n_kv_head as u64 * hd * cap * e;
        let qkv = (self.n_head + 2 * self.n_kv_head) as u64 * hd + self.n_head as u64 * hd;
        let mlp = match self.hybrid.as_ref().filter(|h| h.experts > 0) {
            Some(h) => (3 * self.hidden as u64)
                .max(3 * (h.experts_top_k * h.expert_hidden) as u64 + h.experts as u64),
            None => 3 * self.hidden as u64,
        };
        let mut cache = 0u64;
        let mut mixer = qkv;
        for l in 0..self.n_layer {
            match &self.hybrid {
                Some(h) if h.is_mamba(l) => {
                    let window = (h.mamba_d_conv.saturating_sub(1) * h.conv_dim()) as u64 * e;
                    let state = (h.mamba_inner() * h.mamba_d_state) as u64 * 4;
                    cache += 2 * (window + state);
                    mixer = mixer.max((h.in_proj_width() + h.mamba_inner()) as u64);
                }
                _ => cache += kv,
            }
        }
        let columns = cap * (e + 4 + 2 * hd * e);
        let activations = prompt * (6 * self.n_embd as u64 + mixer + mlp) * e;
        let logits = 4 * self.vocab_size as u64 * 4;
        cache + columns + activations + logits
    }
}
