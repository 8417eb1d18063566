//! What a checkpoint's model must share with the run that resumes it ([`ResumeKey`]): every
//! part of the spec that fixes a weight's shape or the model's arithmetic. Left out: the
//! kernels, activation recompute (what the step keeps, not the model), dropout and the LoRA
//! scale and dropout (training settings), the init (the weights come from the checkpoint),
//! and the family's name.

use super::ModelSpec;

/// The parts of a [`ModelSpec`] a resume must keep, each under the config key that sets it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResumeKey(Vec<(&'static str, String)>);

impl ModelSpec {
    /// The key [`ResumeKey::differences`] compares between a checkpoint and a resume.
    pub fn resume_key(&self) -> ResumeKey {
        let lora = match &self.lora {
            Some(l) => format!("r {} on {:?}", l.r, l.targets),
            None => "off".into(),
        };
        ResumeKey(vec![
            ("model.vocab_size", self.vocab_size.to_string()),
            ("model.n_layer", self.n_layer.to_string()),
            ("model.n_head", self.n_head.to_string()),
            ("model.n_kv_head", self.n_kv_head.to_string()),
            ("model.n_embd", self.n_embd.to_string()),
            ("model.head_dim", self.head_dim.to_string()),
            ("model.seq_len", self.seq_len.to_string()),
            ("model.n_positions", self.n_positions.to_string()),
            ("model.mlp_ratio (MLP width)", self.hidden.to_string()),
            ("model.norm", format!("{:?}", self.norm)),
            ("model.norm_eps", self.norm_eps.to_string()),
            ("model.pos", format!("{:?}", self.pos)),
            ("model.rope_theta", self.rope_theta.to_string()),
            ("model.rope_scaling", format!("{:?}", self.rope_scaling)),
            ("model.activation", format!("{:?}", self.activation)),
            ("model.tie_embeddings", self.tie_embeddings.to_string()),
            ("model.bias", self.bias.to_string()),
            ("model.qkv_bias", self.qkv_bias.to_string()),
            (
                "model.embedding_multiplier",
                self.embedding_multiplier.to_string(),
            ),
            (
                "model.attention_multiplier",
                format!("{:?}", self.attention_multiplier),
            ),
            (
                "model.residual_multiplier",
                self.residual_multiplier.to_string(),
            ),
            ("model.logits_scaling", self.logits_scaling.to_string()),
            ("model.layout", format!("{:?}", self.layout)),
            ("model.hybrid", format!("{:?}", self.hybrid)),
            ("lora", lora),
        ])
    }
}

impl ResumeKey {
    /// `key before → now` for each part that differs from `before`'s (empty: a resume may go
    /// on).
    pub fn differences(&self, before: &ResumeKey) -> Vec<String> {
        self.0
            .iter()
            .zip(&before.0)
            .filter(|(now, old)| now.1 != old.1)
            .map(|(now, old)| format!("{} {} → {}", now.0, old.1, now.1))
            .collect()
    }
}
