//! Granite 4.0 hybrids (`granitemoehybrid`) as llama.cpp's `granitehybrid`: a layer is Mamba-2
//! where its `attention.head_count_kv` entry is 0. The Mamba weights go out as llama.cpp's
//! converter writes them: `ssm_in`, `ssm_conv1d` (the conv's `[channels, 1, width]` as
//! `[channels, width]`), `ssm_dt.bias`, `ssm_a` = −exp(A_log) and `ssm_d` as `[heads, 1]`,
//! `ssm_norm` as `[groups, inner / groups]`, `ssm_out`; the shared MLP's gate|up as `ffn_gate`
//! and `ffn_up`, its output as `ffn_down` — or, beside routed experts, as the shared expert
//! `ffn_gate_shexp`, `ffn_up_shexp`, `ffn_down_shexp`, with the router as `ffn_gate_inp` and
//! the experts' stacked gate, up and down as `ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`
//! (`expert_count`, `expert_used_count`, `expert_feed_forward_length`,
//! `expert_shared_feed_forward_length`). RoPE on the attention layers is
//! `rope.scaling.finetuned` (false: NoPE, Granite 4.0's own).

use super::reader::{Gguf, Meta};
use super::writer::Value;
use crate::config::{MixerKind, ModelConfig};
use candle_core::Tensor;
use serde_json::{json, Map, Value as Json};

/// cockpit's Mamba tensor (after `model.layers.N.mamba.`) and llama.cpp's (after `blk.N.`).
const MAMBA_NAMES: &[(&str, &str)] = &[
    ("in_proj.weight", "ssm_in.weight"),
    ("conv1d.weight", "ssm_conv1d.weight"),
    ("conv1d.bias", "ssm_conv1d.bias"),
    ("dt_bias", "ssm_dt.bias"),
    ("A_log", "ssm_a"),
    ("D", "ssm_d"),
    ("norm.weight", "ssm_norm.weight"),
    ("out_proj.weight", "ssm_out.weight"),
];

/// Why llama.cpp's `granitehybrid` cannot hold `m`, if it cannot.
pub fn refusal(m: &ModelConfig) -> Option<String> {
    let h = m.hybrid.as_ref()?;
    if h.mamba_proj_bias {
        return Some(
            "mamba_proj_bias: llama.cpp's granitehybrid has no in_proj/out_proj biases".into(),
        );
    }
    if h.mamba_inner() != 2 * m.n_embd {
        return Some(format!(
            "a Mamba width of {} for hidden size {}: llama.cpp's granitehybrid takes an expansion of 2 only",
            h.mamba_inner(),
            m.n_embd
        ));
    }
    None
}

/// What llama.cpp computes otherwise than cockpit for `m`.
pub fn notes(m: &ModelConfig) -> Vec<String> {
    match &m.hybrid {
        Some(h) if h.dt_min > 0.0 || h.dt_max.is_some() => vec![format!(
            "the time step's limits [{}, {}] are not in the GGUF: llama.cpp clamps no time step",
            h.dt_min,
            h.dt_max.map_or("∞".to_string(), |x| x.to_string())
        )],
        _ => Vec::new(),
    }
}

/// The `granitehybrid.*` keys beside the common and Granite ones: the Mamba sizes, the layer
/// kinds (as per-layer kv heads, 0 for a Mamba layer) and whether attention rotates.
pub fn hyperparameters(m: &ModelConfig) -> Vec<(String, Value)> {
    let Some(h) = &m.hybrid else {
        return Vec::new();
    };
    let k = |s: &str| format!("granitehybrid.{s}");
    let u = |n: usize| Value::U32(n as u32);
    let kv: Vec<i32> = h
        .layers
        .iter()
        .map(|l| match l {
            MixerKind::Mamba => 0,
            MixerKind::Attention => m.kv_heads() as i32,
        })
        .collect();
    let mut out = vec![
        (k("attention.head_count_kv"), Value::I32s(kv)),
        (k("ssm.conv_kernel"), u(h.mamba_d_conv)),
        (k("ssm.inner_size"), u(h.mamba_inner())),
        (k("ssm.state_size"), u(h.mamba_d_state)),
        (k("ssm.time_step_rank"), u(h.mamba_n_heads)),
        (k("ssm.group_count"), u(h.mamba_n_groups)),
        (k("rope.scaling.finetuned"), Value::Bool(h.rope)),
    ];
    if h.experts > 0 {
        // (llama.cpp's granite MoE layout: feed_forward_length is the experts' width, the
        // shared MLP's is the shared expert's)
        out.extend([
            (k("feed_forward_length"), u(h.expert_hidden)),
            (k("expert_count"), u(h.experts)),
            (k("expert_used_count"), u(h.experts_top_k)),
            (k("expert_feed_forward_length"), u(h.expert_hidden)),
            (
                k("expert_shared_feed_forward_length"),
                u(crate::engine::spec::mlp_width(m.n_embd, m.mlp_ratio)),
            ),
        ]);
    }
    out
}

/// The shared MLP's llama.cpp names (gate, up, down): the dense MLP's, or the shared expert's
/// beside routed experts.
fn shared_names(moe: bool) -> [&'static str; 3] {
    if moe {
        ["ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"]
    } else {
        ["ffn_gate", "ffn_up", "ffn_down"]
    }
}

fn te(n: &str) -> impl FnOnce(candle_core::Error) -> String + '_ {
    move |e| format!("{n}: {e}")
}

/// cockpit's Mamba and shared-MLP tensors under llama.cpp's names and layouts; the others
/// pass as they are (named by the common table).
pub fn out_tensors(
    tensors: Vec<(String, Tensor)>,
    m: &ModelConfig,
) -> Result<Vec<(String, Tensor)>, String> {
    let groups = m.hybrid.as_ref().map_or(1, |h| h.mamba_n_groups);
    let moe = m.hybrid.as_ref().is_some_and(|h| h.experts > 0);
    let [gate, up, down] = shared_names(moe);
    let mut out = Vec::with_capacity(tensors.len() + 2 * m.n_layer);
    for (n, t) in tensors {
        let Some((i, part)) = n
            .strip_prefix("model.layers.")
            .and_then(|r| r.split_once('.'))
        else {
            out.push((n, t));
            continue;
        };
        if let Some(rest) = part.strip_prefix("mamba.") {
            let Some((_, g)) = MAMBA_NAMES.iter().find(|(c, _)| *c == rest) else {
                return Err(format!("{n}: a tensor llama.cpp has no name for"));
            };
            let d = t.dims().to_vec();
            let t = match rest {
                "conv1d.weight" => t.reshape((d[0], d[d.len() - 1])),
                "A_log" => t
                    .exp()
                    .and_then(|x| x.neg())
                    .and_then(|x| x.reshape((d[0], 1))),
                "D" => t.reshape((d[0], 1)),
                "norm.weight" => t.reshape((groups, d[0] / groups.max(1))),
                _ => Ok(t),
            }
            .map_err(te(&n))?;
            out.push((format!("blk.{i}.{g}"), t));
        } else if part == "shared_mlp.input_linear.weight" {
            let half = t.dim(0).map_err(te(&n))? / 2;
            for (g, at) in [(gate, 0), (up, half)] {
                let p = t.narrow(0, at, half).map_err(te(&n))?;
                out.push((format!("blk.{i}.{g}.weight"), p));
            }
        } else if part == "shared_mlp.output_linear.weight" {
            out.push((format!("blk.{i}.{down}.weight"), t));
        } else if part == "block_sparse_moe.experts.gate_up_proj" {
            // [E, 2I, C]: each expert's gate rows, then its up rows
            let half = t.dim(1).map_err(te(&n))? / 2;
            for (g, at) in [("ffn_gate_exps", 0), ("ffn_up_exps", half)] {
                let p = t.narrow(1, at, half).and_then(|p| p.contiguous());
                out.push((format!("blk.{i}.{g}.weight"), p.map_err(te(&n))?));
            }
        } else if part == "block_sparse_moe.experts.down_proj" {
            out.push((format!("blk.{i}.ffn_down_exps.weight"), t));
        } else if part == "block_sparse_moe.router.weight" {
            out.push((format!("blk.{i}.ffn_gate_inp.weight"), t));
        } else {
            out.push((n, t));
        }
    }
    Ok(out)
}

/// Whether llama.cpp keeps a `granitehybrid` tensor in f32 (the conv, A, D and the gated norm).
pub fn keeps_f32(name: &str) -> bool {
    ["ssm_conv1d", "ssm_a", "ssm_d", "ssm_norm"]
        .iter()
        .any(|p| name.split('.').nth(2) == Some(p))
}

/// A `granitehybrid` file's Mamba tensor (or ffn_gate/ffn_up/ffn_down) under cockpit's names,
/// its layout undone; None for the tensors the common table names.
pub fn in_tensor(name: &str, v: &Tensor) -> Option<Result<(String, Tensor), String>> {
    let rest = name.strip_prefix("blk.")?;
    let (i, part) = rest.split_once('.')?;
    if let Some((c, _)) = MAMBA_NAMES.iter().find(|(_, g)| *g == part) {
        let d = v.dims().to_vec();
        let t = match *c {
            "conv1d.weight" => v.reshape((d[0], 1, d.iter().skip(1).product::<usize>())),
            // A = −exp(A_log)
            "A_log" => v.neg().and_then(|x| x.log()).and_then(|x| x.flatten_all()),
            "D" | "norm.weight" => v.flatten_all(),
            _ => Ok(v.clone()),
        };
        let t = t.map_err(|e| format!("{name}: {e}"));
        return Some(t.map(|t| (format!("model.layers.{i}.mamba.{c}"), t)));
    }
    let to = match part {
        // (gates and ups are joined by the caller, which holds both: [`is_joined`])
        "ffn_down.weight" | "ffn_down_shexp.weight" => "shared_mlp.output_linear.weight",
        "ffn_down_exps.weight" => "block_sparse_moe.experts.down_proj",
        "ffn_gate_inp.weight" => "block_sparse_moe.router.weight",
        _ => return None,
    };
    Some(Ok((format!("model.layers.{i}.{to}"), v.clone())))
}

/// The tensors [`join_gate_up`] joins: the shared MLP's (or shared expert's) gate and up, the
/// experts' gates and ups.
pub fn is_joined(name: &str) -> bool {
    [
        "ffn_gate",
        "ffn_up",
        "ffn_gate_shexp",
        "ffn_up_shexp",
        "ffn_gate_exps",
        "ffn_up_exps",
    ]
    .iter()
    .any(|p| name.ends_with(&format!(".{p}.weight")))
}

/// The shared MLP's gate and up (llama.cpp's `ffn_gate`, `ffn_up`; the shared expert's
/// `ffn_gate_shexp`, `ffn_up_shexp` beside routed experts) joined as cockpit's
/// `shared_mlp.input_linear` in every layer of `named`, and the experts' `ffn_gate_exps` and
/// `ffn_up_exps` as `block_sparse_moe.experts.gate_up_proj` (`[E, 2I, C]`) where present.
pub fn join_gate_up(named: &mut Vec<(String, Tensor)>, n_layer: usize) -> Result<(), String> {
    fn take(named: &mut Vec<(String, Tensor)>, i: usize, p: &str) -> Option<Tensor> {
        let n = format!("blk.{i}.{p}.weight");
        let at = named.iter().position(|(k, _)| *k == n)?;
        Some(named.remove(at).1)
    }
    for i in 0..n_layer {
        let missing = |p: &str| format!("blk.{i}.{p}.weight: missing");
        let moe = take(named, i, "ffn_gate_exps");
        let [gate, up, _] = shared_names(moe.is_some());
        let g = take(named, i, gate).ok_or_else(|| missing(gate))?;
        let u = take(named, i, up).ok_or_else(|| missing(up))?;
        let t = Tensor::cat(&[g, u], 0).map_err(|e| format!("layer {i} ffn: {e}"))?;
        named.push((
            format!("model.layers.{i}.shared_mlp.input_linear.weight"),
            t,
        ));
        if let Some(g) = moe {
            let u = take(named, i, "ffn_up_exps").ok_or_else(|| missing("ffn_up_exps"))?;
            let t = Tensor::cat(&[g, u], 1).map_err(|e| format!("layer {i} experts: {e}"))?;
            named.push((
                format!("model.layers.{i}.block_sparse_moe.experts.gate_up_proj"),
                t,
            ));
        }
    }
    Ok(())
}

/// A `granitehybrid` file's config.json keys beyond the Llama and Granite ones in `c`, as
/// `granitemoehybrid`.
pub fn config(g: &Gguf, c: &mut Map<String, Json>, n_layer: usize) -> Result<(), String> {
    let get = |s: &str| g.get(&format!("granitehybrid.{s}"));
    let num = |s: &str| {
        get(s)
            .and_then(Meta::as_usize)
            .ok_or_else(|| format!("granitehybrid.{s}: missing"))
    };
    let kv: Vec<usize> = match get("attention.head_count_kv") {
        Some(Meta::Array(a)) if a.len() == n_layer => a.iter().map(|x| x.as_usize().unwrap_or(0)).collect(),
        Some(v) => match v.as_usize() {
            Some(n) => vec![n; n_layer],
            None => {
                return Err(format!(
                "granitehybrid.attention.head_count_kv = {v:?}: expected a count or one per layer ({n_layer})"
            ))
            }
        },
        None => return Err("granitehybrid.attention.head_count_kv: missing".into()),
    };
    let types: Vec<&str> = kv
        .iter()
        .map(|&n| if n == 0 { "mamba" } else { "attention" })
        .collect();
    let heads = num("ssm.time_step_rank")?;
    let inner = num("ssm.inner_size")?;
    let n_embd = c.get("hidden_size").and_then(Json::as_u64).unwrap_or(0) as usize;
    if heads == 0 || n_embd == 0 || !inner.is_multiple_of(heads) || !inner.is_multiple_of(n_embd) {
        return Err(format!(
            "granitehybrid.ssm.inner_size = {inner}: not a whole number of {heads} heads and of the hidden size {n_embd}"
        ));
    }
    let rope = get("rope.scaling.finetuned")
        .map(|m| *m == Meta::Bool(true))
        .unwrap_or(true);
    let n_kv = kv.iter().copied().max().unwrap_or(0);
    if n_kv > 0 {
        c.insert("num_key_value_heads".into(), json!(n_kv));
    }
    // feed_forward_length: the shared MLP's width, or with routed experts theirs (the shared
    // expert's in expert_shared_feed_forward_length), as llama.cpp's converter writes them
    let ff = c.remove("intermediate_size").unwrap_or(Json::Null);
    let experts = get("expert_count").and_then(Meta::as_usize).unwrap_or(0);
    let shared = if experts > 0 {
        let width = get("expert_feed_forward_length")
            .and_then(Meta::as_usize)
            .map_or(ff, |n| json!(n));
        c.insert(
            "num_experts_per_tok".into(),
            json!(num("expert_used_count")?),
        );
        c.insert("intermediate_size".into(), width);
        c.insert("output_router_logits".into(), json!(false));
        json!(num("expert_shared_feed_forward_length")?)
    } else {
        ff
    };
    let has_conv_bias = g
        .tensors
        .iter()
        .any(|t| t.name.ends_with(".ssm_conv1d.bias"));
    for (key, v) in [
        ("layer_types", json!(types)),
        ("mamba_n_heads", json!(heads)),
        ("mamba_d_head", json!(inner / heads)),
        ("mamba_expand", json!(inner / n_embd)),
        ("mamba_d_state", json!(num("ssm.state_size")?)),
        ("mamba_n_groups", json!(num("ssm.group_count")?)),
        ("mamba_d_conv", json!(num("ssm.conv_kernel")?)),
        ("mamba_conv_bias", json!(has_conv_bias)),
        ("mamba_proj_bias", json!(false)),
        ("shared_intermediate_size", shared),
        ("num_local_experts", json!(experts)),
        (
            "position_embedding_type",
            json!(if rope { "rope" } else { "nope" }),
        ),
    ] {
        c.insert(key.into(), v);
    }
    Ok(())
}
