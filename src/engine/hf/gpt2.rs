//! GPT-2: Conv1D weights stored `[in, out]` with q|k|v fused in `c_attn`, learned positions,
//! LayerNorm with biases, gelu_new, a tied head.

use super::config_keys::Keys;
use super::corrupt;
use crate::config::{Activation, Arch, ModelConfig, Norm, PosEncoding};
use crate::engine::checkpoint::CheckpointError;
use candle_core::Tensor;
use serde_json::{Map, Value};
use std::collections::HashMap;
use std::path::Path;

/// GPT2Config's keys into the model cockpit computes.
pub(super) fn parse(k: &mut Keys) -> Result<ModelConfig, String> {
    let act = k.str("activation_function", "gelu_new")?;
    if !matches!(act.as_str(), "gelu_new" | "gelu_pytorch_tanh") {
        return Err(format!(
            "activation_function = {act:?}: not supported for gpt2 (supported: gelu_new, gelu_pytorch_tanh: GELU with the tanh approximation)"
        ));
    }
    let n_embd = k.usize("n_embd", Some(768))?;
    let n_positions = k.usize("n_positions", Some(1024))?;
    // The old name of the context length; GPT2Model reads n_positions.
    k.get("n_ctx");
    let hidden = k.usize("n_inner", Some(4 * n_embd))?;
    Ok(ModelConfig {
        arch: Arch::Gpt,
        vocab_size: k.usize("vocab_size", Some(50257))?,
        n_layer: k.usize("n_layer", Some(12))?,
        n_head: k.usize("n_head", Some(12))?,
        n_kv_head: 0,
        n_embd,
        seq_len: n_positions,
        mlp_ratio: hidden as f64 / n_embd as f64,
        norm: Norm::LayerNorm,
        norm_eps: k.f64("layer_norm_epsilon", 1e-5)?,
        pos: PosEncoding::Learned,
        activation: Activation::Gelu,
        tie_embeddings: k.bool("tie_word_embeddings", true)?,
        bias: true,
        n_positions,
        attention_multiplier: if k.bool("scale_attn_weights", true)? {
            0.0
        } else {
            1.0
        },
        ..ModelConfig::default()
    })
}

/// The GPT2Config keys of `m`.
pub(super) fn config_json(m: &ModelConfig, hidden: usize, o: &mut Map<String, Value>) {
    let positions = m.n_positions.max(m.seq_len);
    o.insert(
        "architectures".into(),
        serde_json::json!(["GPT2LMHeadModel"]),
    );
    for (k, v) in [
        ("n_embd", serde_json::json!(m.n_embd)),
        ("n_layer", serde_json::json!(m.n_layer)),
        ("n_head", serde_json::json!(m.n_head)),
        ("n_positions", serde_json::json!(positions)),
        ("n_ctx", serde_json::json!(positions)),
        ("n_inner", serde_json::json!(hidden)),
        ("activation_function", serde_json::json!("gelu_new")),
        ("layer_norm_epsilon", serde_json::json!(m.norm_eps)),
        (
            "scale_attn_weights",
            serde_json::json!(m.attention_multiplier == 0.0),
        ),
        ("resid_pdrop", serde_json::json!(0.0)),
        ("embd_pdrop", serde_json::json!(0.0)),
        ("attn_pdrop", serde_json::json!(0.0)),
    ] {
        o.insert(k.into(), v);
    }
}

fn gpt2_prefix(name: &str) -> &str {
    name.strip_prefix("transformer.").unwrap_or(name)
}

/// GPT-2's names and Conv1D layout (`[in, out]`, q|k|v fused) to cockpit's (Llama names,
/// `[out, in]`).
pub(super) fn from_gpt2(
    tensors: HashMap<String, Tensor>,
    m: &ModelConfig,
    dir: &Path,
) -> Result<HashMap<String, Tensor>, CheckpointError> {
    let err = |name: &str, msg: String| corrupt(dir, format!("{name}: {msg}"));
    fn te<'a>(dir: &'a Path, name: &'a str) -> impl Fn(candle_core::Error) -> CheckpointError + 'a {
        move |e| corrupt(dir, format!("{name}: {e}"))
    }
    let mut out = HashMap::new();
    let mut lm_head = None;
    for (name, t) in tensors {
        let short = gpt2_prefix(&name);
        let parts: Vec<&str> = short.split('.').collect();
        let layer = |rest: &str| format!("model.layers.{}.{rest}", parts[1]);
        let conv = |t: &Tensor| t.t().and_then(|t| t.contiguous()).map_err(te(dir, &name));
        match parts.as_slice() {
            ["wte", "weight"] => {
                out.insert("model.embed_tokens.weight".to_string(), t);
            }
            ["wpe", "weight"] => {
                out.insert("model.embed_positions.weight".to_string(), t);
            }
            ["ln_f", w] => {
                out.insert(format!("model.norm.{w}"), t);
            }
            ["h", _, "ln_1", w] => {
                out.insert(layer(&format!("input_layernorm.{w}")), t);
            }
            ["h", _, "ln_2", w] => {
                out.insert(layer(&format!("post_attention_layernorm.{w}")), t);
            }
            ["h", _, "attn", "c_attn", w] => {
                let t = if *w == "weight" { conv(&t)? } else { t };
                let n = t.dim(0).map_err(te(dir, &name))?;
                if n != 3 * m.n_embd {
                    return Err(err(
                        &name,
                        format!("{n} q|k|v rows, expected 3·{}", m.n_embd),
                    ));
                }
                for (i, p) in ["q_proj", "k_proj", "v_proj"].iter().enumerate() {
                    let part = t
                        .narrow(0, i * m.n_embd, m.n_embd)
                        .map_err(te(dir, &name))?;
                    out.insert(
                        layer(&format!("self_attn.{p}.{w}")),
                        part.contiguous().map_err(te(dir, &name))?,
                    );
                }
            }
            ["h", _, "attn", "c_proj", w] => {
                let t = if *w == "weight" { conv(&t)? } else { t };
                out.insert(layer(&format!("self_attn.o_proj.{w}")), t);
            }
            ["h", _, "mlp", "c_fc", w] => {
                let t = if *w == "weight" { conv(&t)? } else { t };
                out.insert(layer(&format!("mlp.up_proj.{w}")), t);
            }
            ["h", _, "mlp", "c_proj", w] => {
                let t = if *w == "weight" { conv(&t)? } else { t };
                out.insert(layer(&format!("mlp.down_proj.{w}")), t);
            }
            // The causal-mask buffers of older checkpoints: what cockpit computes anyway.
            ["h", _, "attn", "bias" | "masked_bias"] => {}
            _ if name == "lm_head.weight" => lm_head = Some(t),
            _ => {
                return Err(err(
                    &name,
                    "not a tensor of a GPT2LMHeadModel; refusing to drop it".into(),
                ))
            }
        }
    }
    if let Some(h) = lm_head {
        out.insert("lm_head.weight".to_string(), h);
    }
    Ok(out)
}

/// cockpit's tensors (Llama names, `[out, in]`) under GPT-2's names and Conv1D layout.
pub(super) fn to_hf_names(
    tensors: Vec<(String, Tensor)>,
    n_layer: usize,
) -> candle_core::Result<Vec<(String, Tensor)>> {
    let mut by_name: HashMap<String, Tensor> = tensors.into_iter().collect();
    let mut take = |n: &str| {
        by_name
            .remove(n)
            .ok_or_else(|| candle_core::Error::Msg(format!("{n}: missing")))
    };
    let conv = |t: Tensor| t.t()?.contiguous();
    let mut out = vec![
        (
            "transformer.wte.weight".into(),
            take("model.embed_tokens.weight")?,
        ),
        (
            "transformer.wpe.weight".into(),
            take("model.embed_positions.weight")?,
        ),
        ("transformer.ln_f.weight".into(), take("model.norm.weight")?),
        ("transformer.ln_f.bias".into(), take("model.norm.bias")?),
    ];
    for i in 0..n_layer {
        let p = format!("model.layers.{i}");
        let h = format!("transformer.h.{i}");
        for (from, to) in [
            ("input_layernorm", "ln_1"),
            ("post_attention_layernorm", "ln_2"),
        ] {
            for w in ["weight", "bias"] {
                out.push((format!("{h}.{to}.{w}"), take(&format!("{p}.{from}.{w}"))?));
            }
        }
        let qkv = |w: &str, take: &mut dyn FnMut(&str) -> candle_core::Result<Tensor>| {
            let parts = ["q_proj", "k_proj", "v_proj"]
                .iter()
                .map(|n| take(&format!("{p}.self_attn.{n}.{w}")))
                .collect::<candle_core::Result<Vec<_>>>()?;
            Tensor::cat(&parts, 0)
        };
        out.push((
            format!("{h}.attn.c_attn.weight"),
            conv(qkv("weight", &mut take)?)?,
        ));
        out.push((format!("{h}.attn.c_attn.bias"), qkv("bias", &mut take)?));
        for (from, to) in [
            ("self_attn.o_proj", "attn.c_proj"),
            ("mlp.up_proj", "mlp.c_fc"),
            ("mlp.down_proj", "mlp.c_proj"),
        ] {
            out.push((
                format!("{h}.{to}.weight"),
                conv(take(&format!("{p}.{from}.weight"))?)?,
            ));
            out.push((format!("{h}.{to}.bias"), take(&format!("{p}.{from}.bias"))?));
        }
    }
    if let Ok(head) = take("lm_head.weight") {
        out.push(("lm_head.weight".into(), head));
    }
    Ok(out)
}
