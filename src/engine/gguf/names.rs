//! cockpit's models as llama.cpp names them: the GGUF architecture of a Hugging Face
//! model_type, its `<arch>.*` hyperparameters, and its tensors under llama.cpp's names and
//! layout (q/k rows permuted for the architectures llama.cpp rotates pairwise; GPT-2's and
//! Phi-3's fused matrices; Gemma 3's norms as `1 + w`: [`super::phi3`], [`super::gemma3`]).

use super::writer::Value;
use crate::config::{ModelConfig, RopeScaling};
use crate::engine::hf::HfInfo;
use crate::engine::spec::{self, ModelSpec};
use candle_core::{Result, Tensor};
use std::collections::HashMap;

/// The GGUF architecture llama.cpp's converter writes for a Hugging Face model_type.
pub fn arch_of(model_type: &str) -> Option<&'static str> {
    match model_type {
        "llama" | "mistral" => Some("llama"),
        "qwen2" => Some("qwen2"),
        "qwen3" => Some("qwen3"),
        "olmo2" => Some("olmo2"),
        "gpt2" => Some("gpt2"),
        "granite" => Some("granite"),
        "phi3" => Some("phi3"),
        "gemma3_text" | "gemma3" => Some("gemma3"),
        "gemma2" => Some("gemma2"),
        "granitemoehybrid" => Some("granitehybrid"),
        _ => None,
    }
}

/// Whether llama.cpp rotates adjacent pairs for `arch` (so the converter permutes q/k rows
/// from Hugging Face's rotate-half layout); qwen2 and qwen3 rotate halves (NeoX) like
/// transformers.
pub fn permutes_qk(arch: &str) -> bool {
    matches!(arch, "llama" | "granite" | "granitehybrid")
}

fn key(arch: &str, k: &str) -> String {
    format!("{arch}.{k}")
}

/// The `<arch>.*` hyperparameters of `m` (with `vocab` tokens and `context` positions; `hf`:
/// what its Hugging Face base says beyond the model, e.g. Phi-3's window).
pub fn hyperparameters(
    arch: &str,
    m: &ModelConfig,
    vocab: usize,
    context: usize,
    hf: Option<&HfInfo>,
) -> Vec<(String, Value)> {
    let u = |n: usize| Value::U32(n as u32);
    let f = |x: f64| Value::F32(x as f32);
    let mut kv = vec![
        (key(arch, "vocab_size"), u(vocab)),
        (key(arch, "context_length"), u(context)),
        (key(arch, "embedding_length"), u(m.n_embd)),
        (key(arch, "block_count"), u(m.n_layer)),
        (
            key(arch, "feed_forward_length"),
            u(spec::mlp_width(m.n_embd, m.mlp_ratio)),
        ),
        (key(arch, "attention.head_count"), u(m.n_head)),
    ];
    if arch == "gpt2" {
        kv.push((key(arch, "attention.layer_norm_epsilon"), f(m.norm_eps)));
        return kv;
    }
    let hd = m.head_size();
    kv.extend([
        (key(arch, "attention.head_count_kv"), u(m.kv_heads())),
        (key(arch, "rope.freq_base"), f(m.rope_theta)),
        (key(arch, "attention.layer_norm_rms_epsilon"), f(m.norm_eps)),
        (
            key(arch, "rope.dimension_count"),
            u(super::phi3::rotated(m)),
        ),
    ]);
    // (llama.cpp's converter writes Gemma's head dim whatever it is)
    if hd * m.n_head != m.n_embd || arch == "gemma3" || arch == "gemma2" {
        kv.push((key(arch, "attention.key_length"), u(hd)));
        kv.push((key(arch, "attention.value_length"), u(hd)));
    }
    if let RopeScaling::Linear { factor } = m.rope_scaling {
        kv.push((key(arch, "rope.scaling.type"), Value::Str("linear".into())));
        kv.push((key(arch, "rope.scaling.factor"), f(factor)));
    }
    if arch == "granite" || arch == "granitehybrid" {
        let att = if m.attention_multiplier == 0.0 {
            1.0 / (hd as f64).sqrt()
        } else {
            m.attention_multiplier
        };
        kv.extend([
            (key(arch, "attention.scale"), f(att)),
            (key(arch, "embedding_scale"), f(m.embedding_multiplier)),
            (key(arch, "residual_scale"), f(m.residual_multiplier)),
            (key(arch, "logit_scale"), f(m.logits_scaling)),
        ]);
    }
    match arch {
        "phi3" => kv.extend(super::phi3::hyperparameters(m, hf)),
        "gemma3" | "gemma2" => kv.extend(super::gemma3::hyperparameters(arch, m, context)),
        "granitehybrid" => {
            // (its own keys in place of the common ones: one kv head count per layer, 0 for a
            // Mamba layer; with experts, the feed-forward length is theirs)
            let own = super::granite_hybrid::hyperparameters(m);
            kv.retain(|(k, _)| !own.iter().any(|(o, _)| o == k));
            kv.extend(own);
        }
        _ => {}
    }
    kv
}

/// Llama 3's RoPE scaling as llama.cpp takes it: a `rope_freqs` tensor of per-frequency
/// divisors (None for other scalings).
pub fn rope_freqs(spec: &ModelSpec) -> Option<Vec<f32>> {
    if !matches!(spec.rope_scaling, RopeScaling::Llama3 { .. }) {
        return None;
    }
    let scaled = spec.rope_inv_freq();
    let plain = ModelSpec {
        rope_scaling: RopeScaling::None,
        ..spec.clone()
    }
    .rope_inv_freq();
    Some(
        plain
            .iter()
            .zip(&scaled)
            .map(|(p, s)| (p / s) as f32)
            .collect(),
    )
}

/// Hugging Face's rotate-half row order of a q/k projection (`heads` heads) to llama.cpp's
/// adjacent pairs: rows `[h, 2, d/2]` become `[h, d/2, 2]`.
pub fn permute_rows(t: &Tensor, heads: usize) -> Result<Tensor> {
    let shape = t.dims().to_vec();
    let hd = shape[0] / heads;
    let mut split = vec![heads, 2, hd / 2];
    split.extend_from_slice(&shape[1..]);
    t.reshape(split)?
        .transpose(1, 2)?
        .contiguous()?
        .reshape(shape)
}

/// The inverse of [`permute_rows`] (GGUF in).
pub fn unpermute_rows(t: &Tensor, heads: usize) -> Result<Tensor> {
    let shape = t.dims().to_vec();
    let hd = shape[0] / heads;
    let mut split = vec![heads, hd / 2, 2];
    split.extend_from_slice(&shape[1..]);
    t.reshape(split)?
        .transpose(1, 2)?
        .contiguous()?
        .reshape(shape)
}

/// A layer tensor's llama.cpp name: cockpit's `model.layers.N.<part>.<w>` → `blk.N.<name>.<w>`.
const LAYER_NAMES: &[(&str, &str)] = &[
    ("input_layernorm", "attn_norm"),
    ("post_attention_layernorm", "ffn_norm"),
    ("self_attn.q_proj", "attn_q"),
    ("self_attn.k_proj", "attn_k"),
    ("self_attn.v_proj", "attn_v"),
    ("self_attn.o_proj", "attn_output"),
    ("self_attn.q_norm", "attn_q_norm"),
    ("self_attn.k_norm", "attn_k_norm"),
    ("mlp.gate_proj", "ffn_gate"),
    ("mlp.up_proj", "ffn_up"),
    ("mlp.down_proj", "ffn_down"),
];

/// OLMo 2's block norms (on the attention and MLP outputs), which llama.cpp names apart.
const OLMO2_NAMES: &[(&str, &str)] = &[
    ("post_attention_layernorm", "post_attention_norm"),
    ("post_feedforward_layernorm", "post_ffw_norm"),
];

/// The layer names of `arch`: its own first, then the Llama ones.
fn layer_names(arch: &str) -> impl Iterator<Item = &'static (&'static str, &'static str)> {
    let own: &[(&str, &str)] = match arch {
        "olmo2" => OLMO2_NAMES,
        "gemma3" | "gemma2" => super::gemma3::NAMES,
        _ => &[],
    };
    own.iter().chain(LAYER_NAMES)
}

const TOP_NAMES: &[(&str, &str)] = &[
    ("model.embed_tokens", "token_embd"),
    ("model.embed_positions", "position_embd"),
    ("model.norm", "output_norm"),
    ("lm_head", "output"),
];

/// cockpit's name of a llama.cpp tensor name of `arch` (GGUF in), or None.
pub fn cockpit_name(gguf: &str, arch: &str) -> Option<String> {
    let (stem, w) = gguf.rsplit_once('.')?;
    if let Some((c, _)) = TOP_NAMES.iter().find(|(_, g)| *g == stem) {
        return Some(format!("{c}.{w}"));
    }
    let rest = stem.strip_prefix("blk.")?;
    let (i, part) = rest.split_once('.')?;
    let i: usize = i.parse().ok()?;
    let (c, _) = layer_names(arch).find(|(_, g)| *g == part)?;
    Some(format!("model.layers.{i}.{c}.{w}"))
}

fn gguf_name(name: &str, arch: &str) -> Option<String> {
    let (stem, w) = name.rsplit_once('.')?;
    if let Some((_, g)) = TOP_NAMES.iter().find(|(c, _)| *c == stem) {
        return Some(format!("{g}.{w}"));
    }
    let rest = stem.strip_prefix("model.layers.")?;
    let (i, part) = rest.split_once('.')?;
    let (_, g) = layer_names(arch).find(|(c, _)| *c == part)?;
    Some(format!("blk.{i}.{g}.{w}"))
}

/// cockpit's tensors (Llama names, `[out, in]`) under llama.cpp's names and layout for `arch`,
/// in llama.cpp's order (embeddings, then layer by layer, then the final norm and head).
pub fn to_gguf(
    tensors: Vec<(String, Tensor)>,
    arch: &str,
    m: &ModelConfig,
) -> std::result::Result<Vec<(String, Tensor)>, String> {
    fn te(n: &str) -> impl FnOnce(candle_core::Error) -> String + '_ {
        move |e| format!("{n}: {e}")
    }
    let tensors = match arch {
        "granitehybrid" => super::granite_hybrid::out_tensors(tensors, m)?,
        _ => tensors,
    };
    let mut by_name: HashMap<String, Tensor> = HashMap::new();
    for (n, t) in tensors {
        // (a name already llama.cpp's: a family's own tensor, named by its module)
        let g = match n.starts_with("blk.") {
            true => Some(n.clone()),
            false => gguf_name(&n, arch),
        };
        let Some(g) = g else {
            return Err(format!("{n}: a tensor llama.cpp has no name for"));
        };
        let t = if permutes_qk(arch) && n.contains(".self_attn.q_proj.") {
            permute_rows(&t, m.n_head).map_err(te(&n))?
        } else if permutes_qk(arch) && n.contains(".self_attn.k_proj.") {
            permute_rows(&t, m.kv_heads()).map_err(te(&n))?
        } else {
            t
        };
        by_name.insert(g, t);
    }
    match arch {
        "gpt2" => {
            for i in 0..m.n_layer {
                for w in ["weight", "bias"] {
                    super::fuse::fuse(
                        &mut by_name,
                        i,
                        &["attn_q", "attn_k", "attn_v"],
                        "attn_qkv",
                        w,
                    )?;
                }
            }
        }
        "phi3" => super::phi3::fuse_layers(&mut by_name, m.n_layer)?,
        "gemma3" | "gemma2" => super::gemma3::shift_norms_in(&mut by_name, 1.0)?,
        _ => {}
    }
    let rank = |n: &str| -> (usize, usize, String) {
        if n.starts_with("token_embd") || n.starts_with("position_embd") {
            (0, 0, n.to_string())
        } else if let Some(rest) = n.strip_prefix("blk.") {
            let (i, part) = rest.split_once('.').unwrap_or((rest, ""));
            (1, i.parse().unwrap_or(0), part.to_string())
        } else {
            (2, 0, n.to_string())
        }
    };
    let mut out: Vec<(String, Tensor)> = by_name.into_iter().collect();
    out.sort_by_key(|(n, _)| rank(n));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn the_permutation_pairs_the_halves_and_undoes() {
        // one head of 4 rows (dims 0,1 | 2,3): llama.cpp wants 0,2,1,3
        let t = Tensor::arange(0f32, 8.0, &Device::Cpu)
            .unwrap()
            .reshape((4, 2))
            .unwrap();
        let p = permute_rows(&t, 1).unwrap();
        let rows: Vec<Vec<f32>> = p.to_vec2().unwrap();
        assert_eq!(rows[1], vec![4.0, 5.0]);
        assert_eq!(rows[2], vec![2.0, 3.0]);
        let back: Vec<Vec<f32>> = unpermute_rows(&p, 1).unwrap().to_vec2().unwrap();
        assert_eq!(back, t.to_vec2::<f32>().unwrap());
    }

    #[test]
    fn names_map_both_ways() {
        for n in [
            "model.embed_tokens.weight",
            "model.layers.3.self_attn.k_proj.bias",
            "model.layers.0.mlp.down_proj.weight",
            "lm_head.weight",
        ] {
            let g = gguf_name(n, "llama").unwrap();
            assert_eq!(cockpit_name(&g, "llama").as_deref(), Some(n), "{g}");
        }
        assert_eq!(
            gguf_name("model.layers.1.post_attention_layernorm.weight", "llama").as_deref(),
            Some("blk.1.ffn_norm.weight")
        );
    }
}
