//! config.json read key by key: every key is used by a family's reader, known not to change
//! the computation ([`is_bookkeeping`]), or refused with its value named.

use serde_json::{Map, Value};
use std::collections::HashSet;

/// Keys known not to change what the model computes: accepted and ignored. Besides these,
/// every key that starts with `_` (transformers' own metadata: `_name_or_path`,
/// `_attn_implementation_autoset`, …) and every token id (`…_token_id`: `unk_token_id`,
/// `mask_token_id`, …) is bookkeeping too ([`is_bookkeeping`]). A key that is neither read by
/// the family's reader nor here refuses the model: it may change the arithmetic.
pub(super) const BOOKKEEPING: &[&str] = &[
    // What the file is and how transformers loads it.
    "architectures",
    "model_type",
    "torch_dtype",
    "dtype",
    "transformers_version",
    "attn_implementation",
    // The classes transformers' `trust_remote_code` would load for these model types: cockpit
    // computes the model type's own implementation (what AutoModel loads without it).
    "auto_map",
    "use_cache",
    // Which KV cache class generation builds (Gemma's "hybrid"): the same attention.
    "cache_implementation",
    "initializer_range",
    "initializer_factor",
    "tokenizer_class",
    "prefix",
    "finetuning_task",
    "id2label",
    "label2id",
    "problem_type",
    "task_specific_params",
    "torchscript",
    "use_bfloat16",
    "tf_legacy_loss",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "loss_type",
    // Chunked feed-forward and tensor-parallel pretraining: the same arithmetic, split.
    "chunk_size_feed_forward",
    "pretraining_tp",
    // A causal LM decodes whatever these say (they matter to encoder-decoder wrappers only).
    "is_decoder",
    "tie_encoder_decoder",
    "cross_attention_hidden_size",
    // Generation defaults (generation_config.json's business, not the model's).
    "max_length",
    "min_length",
    "do_sample",
    "early_stopping",
    "num_beams",
    "num_beam_groups",
    "diversity_penalty",
    "temperature",
    "top_k",
    "top_p",
    "typical_p",
    "repetition_penalty",
    "length_penalty",
    "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size",
    "bad_words_ids",
    "num_return_sequences",
    "output_scores",
    "return_dict_in_generate",
    "remove_invalid_values",
    "exponential_decay_length_penalty",
    "suppress_tokens",
    "begin_suppress_tokens",
    // Dropout rates: training only (cockpit's model.dropout applies); no effect on the outputs.
    "attention_dropout",
    "attn_pdrop",
    "embd_pdrop",
    "resid_pdrop",
    "summary_first_dropout",
    "hidden_dropout",
    "embedding_dropout",
    // GPT-2's sequence-summary head (GPT2DoubleHeadsModel only).
    "summary_activation",
    "summary_proj_to_labels",
    "summary_type",
    "summary_use_proj",
    // Upcasting the attention to f32: numerics only (cockpit's CPU path is f32 throughout).
    "reorder_and_upcast_attn",
];

/// Whether `key` is one that does not change the computation ([`BOOKKEEPING`], `_…`
/// metadata, `…_token_id` token ids).
pub fn is_bookkeeping(key: &str) -> bool {
    BOOKKEEPING.contains(&key) || key.starts_with('_') || key.ends_with("_token_id")
}

/// config.json read key by key: every key is either used, known to be harmless, or an error.
pub(super) struct Keys<'a> {
    pub(super) map: &'a Map<String, Value>,
    pub(super) model_type: &'a str,
    pub(super) used: HashSet<&'a str>,
}

impl<'a> Keys<'a> {
    pub(super) fn get(&mut self, key: &'a str) -> Option<&'a Value> {
        self.used.insert(key);
        self.map.get(key).filter(|v| !v.is_null())
    }
    pub(super) fn usize(&mut self, key: &'a str, default: Option<usize>) -> Result<usize, String> {
        match self.get(key) {
            None => {
                default.ok_or_else(|| format!("{key}: missing (needed for {})", self.model_type))
            }
            Some(v) => v
                .as_u64()
                .map(|n| n as usize)
                .ok_or_else(|| format!("{key} = {v}: expected a non-negative integer")),
        }
    }
    pub(super) fn f64(&mut self, key: &'a str, default: f64) -> Result<f64, String> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .ok_or_else(|| format!("{key} = {v}: expected a number")),
        }
    }
    pub(super) fn bool(&mut self, key: &'a str, default: bool) -> Result<bool, String> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| format!("{key} = {v}: expected true or false")),
        }
    }
    pub(super) fn str(&mut self, key: &'a str, default: &str) -> Result<String, String> {
        match self.get(key) {
            None => Ok(default.to_string()),
            Some(v) => v
                .as_str()
                .map(str::to_string)
                .ok_or_else(|| format!("{key} = {v}: expected a string")),
        }
    }
    /// A key whose value must be the one cockpit computes.
    pub(super) fn require<T: PartialEq + std::fmt::Display>(
        &self,
        key: &str,
        value: T,
        supported: T,
        why: &str,
    ) -> Result<(), String> {
        if value == supported {
            Ok(())
        } else {
            Err(format!(
                "{key} = {value}: not supported for {} (supported: {supported}); {why}",
                self.model_type
            ))
        }
    }
    /// Every key left is unknown: it may change the arithmetic, so it is refused.
    pub(super) fn finish(&self) -> Result<(), String> {
        for (k, v) in self.map {
            if !self.used.contains(k.as_str()) && !is_bookkeeping(k) {
                return Err(format!(
                    "{k} = {v}: a key cockpit does not know for {}; it may change what the model computes, so the model is not loaded",
                    self.model_type
                ));
            }
        }
        Ok(())
    }
}

pub(super) fn token_ids(v: Option<&Value>, key: &str) -> Result<Vec<u32>, String> {
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Number(n)) => n
            .as_u64()
            .map(|n| vec![n as u32])
            .ok_or_else(|| format!("{key} = {n}: expected a token id")),
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| {
                x.as_u64()
                    .map(|n| n as u32)
                    .ok_or_else(|| format!("{key} = {x}: expected token ids"))
            })
            .collect(),
        Some(other) => Err(format!("{key} = {other}: expected a token id or a list")),
    }
}

/// Qwen2 and Qwen3: sliding windows off, so that every layer attends to the whole sequence.
pub(super) fn full_attention_only(k: &mut Keys) -> Result<(), String> {
    let sw = k.bool("use_sliding_window", false)?;
    k.require(
        "use_sliding_window",
        sw,
        false,
        "cockpit has no sliding-window attention for this model type",
    )?;
    // Without use_sliding_window transformers sets no window, whatever these say.
    k.get("sliding_window");
    k.get("max_window_layers");
    if let Some(types) = k.get("layer_types") {
        let all_full = types
            .as_array()
            .is_some_and(|a| a.iter().all(|t| t.as_str() == Some("full_attention")));
        if !all_full {
            return Err(format!(
                "layer_types = {types}: only \"full_attention\" layers are supported for {}",
                k.model_type
            ));
        }
    }
    Ok(())
}
