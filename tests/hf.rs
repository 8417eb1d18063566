//! Hugging Face models in and out, checked against transformers: the fixtures under
//! tests/fixtures/hf/ (made by scripts/hf_fixtures.py) hold tiny trained models of every
//! supported model_type with transformers' per-token log-probabilities and greedy tokens.

use candle_core::{DType, Device, Tensor, D};
use cockpit::config::ModelConfig;
use cockpit::engine::base;
use cockpit::engine::model::Model;
use std::path::{Path, PathBuf};

mod common;
use common::HF_FIXTURES as FIXTURES;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(name)
}

struct Expected {
    ids: Vec<u32>,
    logprobs: Vec<f64>,
    loss: f64,
    prompt: Vec<u32>,
    greedy: Vec<u32>,
}

fn expected(dir: &Path) -> Expected {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let ids = |k: &str| -> Vec<u32> {
        v[k].as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    Expected {
        ids: ids("ids"),
        logprobs: v["logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect(),
        loss: v["loss"].as_f64().unwrap(),
        prompt: ids("prompt_ids"),
        greedy: ids("greedy"),
    }
}

/// The fixture's model (f32, CPU) with seq_len = the fixed sequence's length.
fn load(dir: &Path, seq_len: usize) -> Model {
    let b = base::load(dir).unwrap_or_else(|e| panic!("{e}"));
    let run = ModelConfig {
        seq_len,
        ..ModelConfig::default()
    };
    let m = base::resolve_model(&b.meta, &run, "model.init_from").unwrap();
    base::build(&b, &m, DType::F32, &Device::Cpu, "model.init_from")
        .unwrap_or_else(|e| panic!("{e}"))
}

/// Per-token log-probabilities of ids[1..] under the model.
fn logprobs(model: &mut Model, ids: &[u32]) -> Vec<f64> {
    let n = ids.len() - 1;
    let x = Tensor::from_vec(ids[..n].to_vec(), (1, n), &Device::Cpu).unwrap();
    let logits = model.forward(&x, false).unwrap();
    let lp = candle_nn::ops::log_softmax(&logits.to_dtype(DType::F32).unwrap(), D::Minus1).unwrap();
    let lp: Vec<Vec<f32>> = lp.to_vec2().unwrap();
    (0..n).map(|i| lp[i][ids[i + 1] as usize] as f64).collect()
}

#[test]
fn every_model_type_computes_what_transformers_computes() {
    for name in FIXTURES {
        let dir = fixture(name);
        let e = expected(&dir);
        let mut model = load(&dir, e.ids.len() - 1);
        let lp = logprobs(&mut model, &e.ids);
        let loss = -lp.iter().sum::<f64>() / lp.len() as f64;
        let worst = lp
            .iter()
            .zip(&e.logprobs)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        eprintln!(
            "{name}: loss {loss:.6} vs transformers {:.6}; worst token {worst:.2e}",
            e.loss
        );
        assert!(
            (loss - e.loss).abs() < 1e-4,
            "{name}: loss {loss} vs {}",
            e.loss
        );
        assert!(worst < 1e-3, "{name}: a token's log-prob is {worst} off");
    }
}

#[test]
fn greedy_decoding_with_the_kv_cache_matches_transformers() {
    use cockpit::engine::generate::{generate, Sampling};
    for name in FIXTURES {
        let dir = fixture(name);
        let e = expected(&dir);
        let model = load(&dir, e.ids.len() - 1);
        let mut streamed = Vec::new();
        let out = generate(
            &model,
            &e.prompt,
            e.greedy.len(),
            &Sampling::greedy(),
            &[],
            |t| streamed.push(t),
        )
        .unwrap();
        assert_eq!(
            out, e.greedy,
            "{name}: greedy tokens differ from transformers'"
        );
        assert_eq!(streamed, out);
    }
}

/// The attention-only fixtures the decode tests run (Gemma's with windows of 8: their 20
/// positions pass them).
#[rustfmt::skip]
const ATTENTION_DECODERS: [&str; 8] =
    ["llama3", "gpt2", "granite", "qwen3", "olmo2", "phi3", "gemma3_text", "gemma2"];

/// The cache gives the logits a full forward gives, position by position.
#[test]
fn cached_decoding_equals_the_full_forward() {
    // (20 positions: past Gemma's window of 8.)
    let hybrids = ["granite_hybrid", "granite_hybrid_moe"];
    for name in ATTENTION_DECODERS.into_iter().chain(hybrids) {
        let dir = fixture(name);
        let e = expected(&dir);
        let n = 20;
        let mut model = load(&dir, e.ids.len() - 1);
        let x = Tensor::from_vec(e.ids[..n].to_vec(), (1, n), &Device::Cpu).unwrap();
        let full: Vec<Vec<f32>> = model.forward(&x, false).unwrap().to_vec2().unwrap();
        let mut cache = model.kv_cache();
        // A block of 7, then one token at a time.
        let mut rows: Vec<Vec<f32>> = model
            .decode(&e.ids[..7], &mut cache)
            .unwrap()
            .to_vec2()
            .unwrap();
        for &t in &e.ids[7..n] {
            rows.extend(
                model
                    .decode(&[t], &mut cache)
                    .unwrap()
                    .to_vec2::<f32>()
                    .unwrap(),
            );
        }
        assert_eq!(cache.len(), n);
        let worst = full
            .iter()
            .flatten()
            .zip(rows.iter().flatten())
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(worst < 1e-4, "{name}: cached logits differ by {worst}");
    }
}

/// Greedy decoding through the single-sequence cache ([`Model::decode`]): `n` new tokens.
fn greedy_alone(model: &Model, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut cache = model.kv_cache();
    let mut logits = model.decode(prompt, &mut cache).unwrap();
    let mut out = Vec::new();
    while out.len() < n {
        let last = logits.narrow(0, logits.dim(0).unwrap() - 1, 1).unwrap();
        let t = last.argmax(D::Minus1).unwrap().to_vec1::<u32>().unwrap()[0];
        out.push(t);
        logits = model.decode(&[t], &mut cache).unwrap();
    }
    out
}

/// Logits of the last of `ids` under a full forward.
fn last_logits(model: &mut Model, ids: &[u32]) -> Vec<f32> {
    let x = Tensor::from_vec(ids.to_vec(), (1, ids.len()), &Device::Cpu).unwrap();
    let full: Vec<Vec<f32>> = model.forward(&x, false).unwrap().to_vec2().unwrap();
    full[ids.len() - 1].clone()
}

/// The model a row with `pad` columns of left padding decodes alone as it decodes in the
/// batch; None where that is the model itself. A LongRoPE model in a batch switches to the
/// long factors by the batch's columns (transformers' generation: `max(position_ids) + 1`
/// of the longest row, the padded width for dropping the cache), so such a row switches
/// `pad` tokens before it would alone: as a model whose original context is `pad` shorter
/// (its attention factor kept).
fn as_in_batch(name: &str, model: &Model, pad: usize) -> Option<Model> {
    let cockpit::config::RopeScaling::LongRope {
        original_max_position_embeddings: original,
        attention_factor,
        ..
    } = model.spec.rope_scaling
    else {
        return None;
    };
    if pad == 0 {
        return None;
    }
    let dir = variant(name, |c| {
        c["original_max_position_embeddings"] = (original - pad).into();
        c["rope_parameters"]["original_max_position_embeddings"] = (original - pad).into();
        c["rope_parameters"]["attention_factor"] = attention_factor.into();
    });
    Some(load(dir.path(), model.spec.seq_len))
}

/// Rows of different lengths decoded together (left-padded): each row's greedy tokens are
/// the tokens it gets alone through the single-sequence cache (a LongRoPE row with the
/// switch where the batch makes it: [`as_in_batch`]), and a prompt alone matches
/// transformers. (phi3_longrope's batch crosses its original context of 16 while it
/// decodes: 12 columns of prompts, 16 new tokens.)
#[test]
fn batched_greedy_equals_each_prompt_alone() {
    use cockpit::engine::generate::{generate_rows, Rows, Sampling};
    for name in FIXTURES {
        let dir = fixture(name);
        let e = expected(&dir);
        let model = load(&dir, e.ids.len() - 1);
        let p = &e.prompt;
        let prompts = vec![
            p.clone(),
            p[..p.len().min(3)].to_vec(),
            e.ids[..p.len() + 4].to_vec(),
            e.ids[5..6].to_vec(),
        ];
        let n = e.greedy.len();
        assert_eq!(
            greedy_alone(&model, p, n),
            e.greedy,
            "{name}: greedy tokens differ from transformers'"
        );
        let width = prompts.iter().map(Vec::len).max().unwrap();
        let alone: Vec<Vec<u32>> = prompts
            .iter()
            .map(|q| {
                let shifted = as_in_batch(name, &model, width - q.len());
                greedy_alone(shifted.as_ref().unwrap_or(&model), q, n)
            })
            .collect();
        let req = Rows {
            prompts: &prompts,
            max_new: n,
            sampling: &Sampling::greedy(),
            seed: 0,
            stop: &[],
            embed: true,
        };
        let mut steps = 0;
        let g = generate_rows(&model, &req, |_| steps += 1).unwrap();
        assert_eq!(steps, n, "{name}");
        for (i, (row, want)) in g.rows.iter().zip(&alone).enumerate() {
            assert_eq!(
                &row.ids, want,
                "{name}: row {i} in a batch differs from alone"
            );
        }
        let emb = g.embeddings.unwrap();
        assert_eq!(emb.dims(), &[4, model.spec.n_embd]);
        // A stop token ends its row alone (the token is the row's last).
        let stop = [alone[1][2]];
        let req = Rows { stop: &stop, ..req };
        let g = generate_rows(&model, &req, |_| {}).unwrap();
        let cut = alone[1].iter().position(|t| *t == stop[0]).unwrap() + 1;
        assert_eq!(g.rows[1].ids, alone[1][..cut], "{name}");
        assert_eq!(
            g.rows[1].stop,
            cockpit::engine::generate::StopReason::Eos,
            "{name}"
        );
    }
}

/// A prompt sampled N times is prefilled once and its cache rows copied to its samples: the
/// tokens (greedy, and seeded draws with top-k/top-p and a repetition penalty) are those of
/// a prefill per row.
#[test]
fn a_shared_prefill_gives_what_a_prefill_per_row_gives() {
    use cockpit::engine::generate::{generate_rows_with, BatchOptions, Rows, Sampling};
    // (phi3_longrope's 8 + 12 columns cross its original context of 16: the copied rows
    // keep the ids to decode again.)
    #[rustfmt::skip]
    let names = ["llama3", "gpt2", "qwen3", "gemma3_text", "granite_hybrid", "phi3_longrope"];
    for name in names {
        let dir = fixture(name);
        let e = expected(&dir);
        let model = load(&dir, e.ids.len() - 1);
        let p = e.prompt.clone();
        let q = e.ids[2..5].to_vec();
        let prompts = vec![p.clone(), p.clone(), q.clone(), p, q];
        let sampled = Sampling {
            temperature: 1.0,
            top_k: 20,
            top_p: 0.9,
            repetition_penalty: 1.3,
            seed: 5,
        };
        for sampling in [Sampling::greedy(), sampled] {
            let req = Rows {
                prompts: &prompts,
                max_new: 12,
                sampling: &sampling,
                seed: 11,
                stop: &[],
                embed: true,
            };
            let run = |share_prefill| {
                let opts = BatchOptions {
                    share_prefill,
                    time_sampling: true,
                };
                generate_rows_with(&model, &req, opts, |_| {}).unwrap()
            };
            let (shared, apart) = (run(true), run(false));
            for (r, (a, b)) in shared.rows.iter().zip(&apart.rows).enumerate() {
                assert_eq!(a.ids, b.ids, "{name}: row {r} ({sampling:?})");
            }
            let (a, b) = (shared.embeddings.unwrap(), apart.embeddings.unwrap());
            let worst = (a - b)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!(worst < 1e-4, "{name}: embeddings differ by {worst}");
        }
    }
}

/// The batched cache gives, for each row, the logits a full forward of that row alone gives
/// (of a LongRoPE row, on the model that switches where the batch does: [`as_in_batch`]).
/// phi3_longrope's columns (12 + 7) cross its original context of 16, where every row
/// switches at once: a padded row's logits then differ from the original model's.
#[test]
fn batched_decoding_equals_the_full_forward() {
    // (The hybrids: the left padding of a prefill changes no Mamba state.)
    let more = [
        "mistral",
        "granite_hybrid",
        "granite_hybrid_moe",
        "phi3_longrope",
    ];
    for name in ATTENTION_DECODERS.into_iter().chain(more) {
        let dir = fixture(name);
        let e = expected(&dir);
        let mut model = load(&dir, e.ids.len() - 1);
        let lens = [12usize, 7, 9];
        let steps = 8;
        let width = lens[0];
        let pads: Vec<usize> = lens.iter().map(|l| width - l).collect();
        let rows: Vec<Vec<u32>> = lens
            .iter()
            .enumerate()
            .map(|(r, &l)| e.ids[r..r + l + steps].to_vec())
            .collect();
        let mut flat = Vec::new();
        for (row, (&l, &pad)) in rows.iter().zip(lens.iter().zip(&pads)) {
            flat.extend(std::iter::repeat_n(row[0], pad));
            flat.extend_from_slice(&row[..l]);
        }
        let mut cache = model.batch_cache(&pads, width + steps).unwrap();
        let ids = Tensor::from_vec(flat, (3, width), &Device::Cpu).unwrap();
        let mut got: Vec<Vec<Vec<f32>>> = vec![model
            .decode_batch(&ids, &mut cache, true)
            .unwrap()
            .logits
            .unwrap()
            .to_vec2()
            .unwrap()];
        for s in 0..steps - 1 {
            let next: Vec<u32> = rows.iter().zip(&lens).map(|(r, &l)| r[l + s]).collect();
            let t = Tensor::from_vec(next, (3, 1), &Device::Cpu).unwrap();
            got.push(
                model
                    .decode_batch(&t, &mut cache, true)
                    .unwrap()
                    .logits
                    .unwrap()
                    .to_vec2()
                    .unwrap(),
            );
        }
        let diff = |a: &[f32], b: &[f32]| {
            a.iter()
                .zip(b)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max)
        };
        // (How far a shifted row's logits are from the original model's.)
        let mut switched = 0.0f32;
        for (r, (row, &l)) in rows.iter().zip(&lens).enumerate() {
            let mut shifted = as_in_batch(name, &model, pads[r]);
            for (s, step) in got.iter().enumerate() {
                let prefix = &row[..l + s];
                let want = last_logits(shifted.as_mut().unwrap_or(&mut model), prefix);
                let worst = diff(&want, &step[r]);
                assert!(
                    worst < 1e-4,
                    "{name}: row {r} step {s}: logits differ by {worst}"
                );
                if shifted.is_some() {
                    switched = switched.max(diff(&last_logits(&mut model, prefix), &step[r]));
                }
            }
        }
        if name == "phi3_longrope" {
            assert!(switched > 1e-3, "the batch's switch must show: {switched}");
        }
    }
}

/// A copy of a fixture with its config.json changed.
fn variant(name: &str, change: impl FnOnce(&mut serde_json::Value)) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, tmp.path().join(p.file_name().unwrap())).unwrap();
    }
    let cp = tmp.path().join("config.json");
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cp).unwrap()).unwrap();
    change(&mut c);
    std::fs::write(&cp, c.to_string()).unwrap();
    tmp
}

fn load_err(dir: &Path) -> String {
    match base::load(dir) {
        Ok(b) => {
            let run = ModelConfig {
                seq_len: 47,
                ..ModelConfig::default()
            };
            match base::resolve_model(&b.meta, &run, "model.init_from") {
                Err(e) => e,
                Ok(m) => match base::build(&b, &m, DType::F32, &Device::Cpu, "model.init_from") {
                    Err(e) => e.to_string(),
                    Ok(_) => panic!("{} loaded", dir.display()),
                },
            }
        }
        Err(e) => e.to_string(),
    }
}

fn loss_of(dir: &Path) -> f64 {
    let e = expected(&fixture("llama3"));
    let mut model = load(dir, e.ids.len() - 1);
    let lp = logprobs(&mut model, &e.ids);
    -lp.iter().sum::<f64>() / lp.len() as f64
}

/// transformers 4 wrote `rope_theta` + `rope_scaling`; 5 writes `rope_parameters`: the same
/// model either way. And the llama3 scaling is not a no-op on the fixture.
#[test]
fn rope_scaling_reads_both_config_layouts_and_matters() {
    let want = expected(&fixture("llama3")).loss;
    let v4 = variant("llama3", |c| {
        let mut p = c["rope_parameters"].take();
        let o = c.as_object_mut().unwrap();
        o.remove("rope_parameters");
        o.insert("rope_theta".into(), p["rope_theta"].take());
        p.as_object_mut().unwrap().remove("rope_theta");
        o.insert("rope_scaling".into(), p);
    });
    assert!((loss_of(v4.path()) - want).abs() < 1e-4);
    let unscaled = variant("llama3", |c| {
        c["rope_parameters"] = serde_json::json!({"rope_type": "default", "rope_theta": 500000.0});
    });
    let off = loss_of(unscaled.path());
    assert!(
        (off - want).abs() > 1e-2,
        "ignoring rope_scaling must show: {off} vs {want}"
    );
}

#[test]
fn what_cockpit_does_not_compute_is_refused_by_name() {
    type Change = Box<dyn FnOnce(&mut serde_json::Value)>;
    let cases: Vec<(&str, Change, &str)> = vec![
        ("llama2", Box::new(|c| c["model_type"] = "falcon".into()), "model_type = \"falcon\": not supported (supported: llama, mistral, qwen2, qwen3, olmo2, phi3, gpt2, granite, gemma3_text, gemma3, gemma2, granitemoehybrid)"),
        ("granite_hybrid", Box::new(|c| c["layer_types"][1] = "sliding_attention".into()), "layer_types[1] = \"sliding_attention\": not supported for granitemoehybrid"),
        ("granite_hybrid", Box::new(|c| c["position_embedding_type"] = "alibi".into()), "position_embedding_type = \"alibi\": not supported for granitemoehybrid"),
        ("granite_hybrid", Box::new(|c| c["mamba_d_conv"] = 2.into()), "model.layers.0.mamba.conv1d.weight: shape [192, 1, 4], the config makes [192, 1, 2]"),
        ("llama2", Box::new(|c| c["rope_parameters"] = serde_json::json!({"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4})), "rope_type = \"yarn\""),
        ("llama2", Box::new(|c| c["hidden_act"] = "gelu".into()), "hidden_act = gelu"),
        ("llama2", Box::new(|c| c["attention_bias"] = true.into()), "attention_bias = true with mlp_bias = false"),
        ("llama2", Box::new(|c| c["some_new_switch"] = 3.into()), "some_new_switch = 3: a key cockpit does not know"),
        ("llama2", Box::new(|c| c["quantization_config"] = serde_json::json!({"quant_method": "gptq"})), "quantized"),
        ("mistral", Box::new(|c| c["sliding_window"] = 16.into()), "sliding_window = 16"),
        ("qwen2", Box::new(|c| c["use_sliding_window"] = true.into()), "use_sliding_window = true"),
        ("gpt2", Box::new(|c| c["activation_function"] = "relu".into()), "activation_function = \"relu\""),
        ("gpt2", Box::new(|c| c["scale_attn_by_inverse_layer_idx"] = true.into()), "scale_attn_by_inverse_layer_idx = true"),
        ("granite", Box::new(|c| c["hidden_size"] = 32.into()), "shape [298, 64] in the file, the model has [298, 32]"),
        ("qwen3", Box::new(|c| c["attention_bias"] = true.into()), "attention_bias = true: not supported for qwen3"),
        ("qwen3", Box::new(|c| c["use_sliding_window"] = true.into()), "use_sliding_window = true: not supported for qwen3"),
        ("qwen3", Box::new(|c| c["layer_types"] = serde_json::json!(["full_attention", "sliding_attention"])), "layer_types = [\"full_attention\",\"sliding_attention\"]: only \"full_attention\" layers are supported for qwen3"),
        ("llama2", Box::new(|c| c["rope_parameters"] = serde_json::json!({"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0, 1.0], "long_factor": [2.0, 2.0]})), "rope_parameters.rope_type = \"longrope\": not supported for llama"),
        ("phi3_longrope", Box::new(|c| c["rope_parameters"]["long_factor"] = serde_json::json!([1.0, 2.0])), "rope_parameters.long_factor: 2 factors, the model rotates 8 pairs"),
        ("phi3_longrope", Box::new(|c| c["rope_parameters"]["short_factor"] = serde_json::json!("x")), "rope_parameters.short_factor = \"x\": expected a list of positive numbers"),
        ("phi3_longrope", Box::new(|c| c["original_max_position_embeddings"] = 32.into()), "rope_parameters.original_max_position_embeddings = 16: transformers' phi3 reads the top-level original_max_position_embeddings (32)"),
        ("phi3", Box::new(|c| c["rope_parameters"]["rope_type"] = "dynamic".into()), "rope_parameters.rope_type = \"dynamic\": not supported (supported: default, linear, llama3, longrope)"),
        ("gemma3_text", Box::new(|c| c["layer_types"][1] = "chunked_attention".into()), "\"chunked_attention\" is not a layer type cockpit computes"),
        ("gemma3_text", Box::new(|c| c["layer_types"] = serde_json::json!(["full_attention"])), "1 entries for 4 layers"),
        ("gemma3_text", Box::new(|c| c["use_bidirectional_attention"] = true.into()), "use_bidirectional_attention = true: not supported for gemma3_text"),
        ("gemma3_text", Box::new(|c| c["attn_logit_softcapping"] = 50.0.into()), "attn_logit_softcapping = 50: not supported for gemma3_text (transformers' Gemma 3 does not apply it"),
        ("gemma3_text", Box::new(|c| c["hidden_activation"] = "gelu".into()), "hidden_activation = gelu: not supported for gemma3_text"),
        ("gemma3_text", Box::new(|c| c["rope_parameters"]["sliding_attention"] = serde_json::json!({"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4})), "rope_parameters.sliding_attention = {"),
        ("gemma3_text", Box::new(|c| c["rope_parameters"]["chunked_attention"] = serde_json::json!({})), "rope_parameters.chunked_attention = {}"),
        ("gemma3_text", Box::new(|c| c["sliding_window"] = serde_json::Value::Null), "sliding_window = null with \"sliding_attention\" layers"),
        ("gemma3_text", Box::new(|c| c["some_new_switch"] = 3.into()), "some_new_switch = 3: a key cockpit does not know for gemma3_text"),
        ("gemma2", Box::new(|c| c["attn_logit_softcapping"] = "big".into()), "attn_logit_softcapping = \"big\": expected a positive number or null"),
        ("gemma2", Box::new(|c| c["query_pre_attn_scalar"] = (-1.0).into()), "query_pre_attn_scalar = -1: must be a positive number"),
        ("gemma3", Box::new(|c| c["text_config"]["hidden_activation"] = "relu".into()), "text_config.hidden_activation = relu: not supported for gemma3_text"),
        ("gemma3", Box::new(|c| c["text_config"]["frobnicate"] = true.into()), "text_config.frobnicate = true: a key cockpit does not know"),
        ("phi3", Box::new(|c| c["rope_parameters"]["partial_rotary_factor"] = 0.1.into()), "partial_rotary_factor = 0.1: RoPE needs an even number of dims"),
        ("llama3", Box::new(|c| c["partial_rotary_factor"] = 0.5.into()), "partial_rotary_factor = 0.5: not supported for llama"),
        ("olmo2", Box::new(|c| c["attention_bias"] = true.into()), "attention_bias = true: not supported for olmo2"),
        ("olmo2", Box::new(|c| c["hidden_act"] = "gelu".into()), "hidden_act = gelu: not supported for olmo2"),
    ];
    for (name, change, want) in cases {
        let dir = variant(name, change);
        let err = load_err(dir.path());
        assert!(err.contains(want), "{name}: {err:?} should say {want:?}");
        assert!(!err.contains('\n'), "one line: {err}");
    }
}

#[test]
fn broken_weight_files_are_refused_by_name() {
    // A shard the index names is missing.
    let dir = variant("llama2", |_| {});
    std::fs::remove_file(dir.path().join("model-00002-of-00004.safetensors")).unwrap();
    let err = load_err(dir.path());
    assert!(
        err.contains("model-00002-of-00004.safetensors") && err.contains("missing"),
        "{err}"
    );
    // A truncated file.
    let dir = variant("gpt2", |_| {});
    let p = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() / 2]).unwrap();
    let err = load_err(dir.path());
    assert!(
        err.contains("model.safetensors") && err.contains("not a readable safetensors file"),
        "{err}"
    );
    // No config.json at all.
    std::fs::remove_file(dir.path().join("config.json")).unwrap();
    let err = load_err(dir.path());
    assert!(err.contains("config.json: missing"), "{err}");
    // A tensor the model would not use, a missing tensor, an integer tensor.
    let mut t: std::collections::HashMap<String, Tensor> =
        candle_core::safetensors::load(fixture("granite").join("model.safetensors"), &Device::Cpu)
            .unwrap();
    let dir = variant("granite", |_| {});
    let p = dir.path().join("model.safetensors");
    let mut extra = t.clone();
    extra.insert(
        "model.layers.0.self_attn.q_norm.weight".into(),
        Tensor::ones(64, DType::F32, &Device::Cpu).unwrap(),
    );
    candle_core::safetensors::save(&extra, &p).unwrap();
    let err = load_err(dir.path());
    assert!(
        err.contains("model.layers.0.self_attn.q_norm.weight: a tensor the model would not use"),
        "{err}"
    );
    t.remove("model.norm.weight");
    candle_core::safetensors::save(&t, &p).unwrap();
    assert!(load_err(dir.path()).contains("model.norm.weight: missing"));
    t.insert(
        "model.norm.weight".into(),
        Tensor::zeros(64, DType::I64, &Device::Cpu).unwrap(),
    );
    candle_core::safetensors::save(&t, &p).unwrap();
    let err = load_err(dir.path());
    assert!(
        err.contains("model.norm.weight: dtype I64 is not supported"),
        "{err}"
    );
}

/// One spec whichever way the model is described: a cockpit `[model]` and the Hugging Face
/// config.json cockpit writes for it give the same `ModelSpec`.
#[test]
fn a_config_and_its_hugging_face_config_give_one_spec() {
    use cockpit::config::{BlockLayout, LayerKind, PosEncoding, QkNorm};
    use cockpit::engine::hf;
    use cockpit::engine::spec::ModelSpec;
    let gpt2 = ModelConfig {
        pos: PosEncoding::Learned,
        ..ModelConfig::default()
    };
    let llama = ModelConfig::llama_family();
    let gqa = ModelConfig {
        n_kv_head: 2,
        ..ModelConfig::llama_family()
    };
    let head_dim = ModelConfig {
        head_dim: 32,
        ..gqa.clone()
    };
    let qwen2 = ModelConfig {
        qkv_bias: true,
        ..ModelConfig::llama_family()
    };
    let qwen3 = ModelConfig {
        head_dim: 32,
        n_kv_head: 2,
        layout: BlockLayout {
            qk_norm: QkNorm::Head,
            post_norm: false,
            ..BlockLayout::PLAIN
        },
        ..ModelConfig::llama_family()
    };
    let olmo2 = ModelConfig {
        layout: BlockLayout {
            qk_norm: QkNorm::Whole,
            post_norm: true,
            ..BlockLayout::PLAIN
        },
        ..ModelConfig::llama_family()
    };
    let gemma = |layout: BlockLayout| ModelConfig {
        head_dim: 32,
        n_kv_head: 2,
        activation: cockpit::config::Activation::GeGlu,
        embedding_multiplier: 8.0,
        attention_multiplier: 24f64.powf(-0.5),
        tie_embeddings: true,
        layout: BlockLayout {
            sandwich_norm: true,
            norm_plus_one: true,
            layer_types: vec![LayerKind::Sliding, LayerKind::Full],
            window: 8,
            ..layout
        },
        ..ModelConfig::llama_family()
    };
    let gemma3 = gemma(BlockLayout {
        qk_norm: QkNorm::Head,
        local_rope_theta: 10_000.0,
        final_softcap: 30.0,
        ..BlockLayout::PLAIN
    });
    let gemma2 = gemma(BlockLayout {
        attn_softcap: 50.0,
        final_softcap: 30.0,
        ..BlockLayout::PLAIN
    });
    let longrope = ModelConfig {
        rope_scaling: cockpit::config::RopeScaling::LongRope {
            short_factor: vec![1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0],
            long_factor: vec![2.0; 8],
            original_max_position_embeddings: 16,
            attention_factor: 1.25,
        },
        ..ModelConfig::llama_family()
    };
    let phi3 = ModelConfig {
        n_kv_head: 2,
        layout: BlockLayout {
            rotary_dim: 8,
            ..BlockLayout::default()
        },
        ..ModelConfig::llama_family()
    };
    for (model_type, m) in [
        ("gemma3_text", gemma3),
        ("gemma2", gemma2),
        ("phi3", longrope),
        ("phi3", phi3),
        ("qwen3", qwen3),
        ("olmo2", olmo2),
        ("gpt2", gpt2),
        ("llama", llama),
        ("llama", gqa),
        ("mistral", head_dim),
        ("qwen2", qwen2),
    ] {
        assert_eq!(
            hf::model_type_for(&m, Some(model_type)).as_deref(),
            Ok(model_type)
        );
        let json = hf::config_json(&m, model_type, 96, None, DType::F32);
        let from_hf = hf::spec(&json).unwrap_or_else(|e| panic!("{model_type}: {e}"));
        let mut from_config = ModelSpec::from_model(&m, 96);
        // (The notes say which keys a Hugging Face model_type set: not the model.)
        from_config.arch_notes = from_hf.arch_notes.clone();
        assert_eq!(from_hf, from_config, "{model_type}: {json}");
    }
}

/// A model no Hugging Face family computes is refused with the `[model]` keys that decide it,
/// spelled as a config spells them (no Rust debug output).
#[test]
fn a_model_no_family_computes_is_refused_naming_its_keys() {
    use cockpit::config::{BlockLayout, QkNorm};
    use cockpit::engine::hf;
    // The embedded default's block: LayerNorm, RoPE, GELU, biases.
    let tiny = cockpit::config::Config::default().model;
    let err = hf::model_type_for(&tiny, None).unwrap_err();
    assert!(
        err.contains(
            r#"(model.norm = "layernorm", model.pos = "rope", model.activation = "gelu", model.bias = true)"#
        ),
        "{err}"
    );
    let gemma_like = ModelConfig {
        layout: BlockLayout {
            qk_norm: QkNorm::Head,
            post_norm: true,
            attn_softcap: 50.0,
            ..BlockLayout::PLAIN
        },
        ..ModelConfig::llama_family()
    };
    let err = hf::model_type_for(&gemma_like, None).unwrap_err();
    for key in [
        r#"model.layout.qk_norm = "head""#,
        "model.layout.post_norm = true",
        "model.layout.attn_softcap = 50",
    ] {
        assert!(err.contains(key), "{key} in {err}");
    }
    assert!(!err.contains("BlockLayout {"), "{err}");
}

/// Keys that do not change the computation (metadata, token ids, loading hints) are accepted
/// and ignored: the model computes what it computed without them. Any other unknown key still
/// refuses the model, naming the file, the key and its value.
#[test]
fn bookkeeping_keys_are_accepted_and_other_unknown_keys_refused() {
    let want = expected(&fixture("llama3")).loss;
    let real = variant("llama3", |c| {
        let o = c.as_object_mut().unwrap();
        for (k, v) in [
            (
                "_name_or_path",
                serde_json::json!("meta-llama/Llama-3.2-1B"),
            ),
            ("_attn_implementation_autoset", true.into()),
            ("unk_token_id", 0.into()),
            ("mask_token_id", serde_json::Value::Null),
            ("transformers_version", "4.45.0".into()),
            ("torch_dtype", "bfloat16".into()),
            ("use_cache", false.into()),
            ("initializer_range", 0.5.into()),
            (
                "auto_map",
                serde_json::json!({"AutoConfig": "configuration.Config"}),
            ),
            ("attention_dropout", 0.1.into()),
        ] {
            o.insert(k.into(), v);
        }
    });
    assert!((loss_of(real.path()) - want).abs() < 1e-4);
    for (key, value) in [
        ("some_new_switch", serde_json::json!(3)),
        (
            "layer_types",
            serde_json::json!(["full_attention", "full_attention"]),
        ),
        ("attn_logit_softcapping", serde_json::json!(50.0)),
    ] {
        let dir = variant("llama3", |c| c[key] = value.clone());
        let err = load_err(dir.path());
        assert!(
            err.contains("config.json")
                && err.contains(&format!("{key} = {value}: a key cockpit does not know")),
            "{key}: {err}"
        );
    }
}

/// LoRA on every projection of the QK-norm families (Gemma 3's too): adapters on q, k, v, o, gate, up and
/// down of every layer, everything else (the q/k norms included) frozen and left as loaded;
/// each adapter's B gets a gradient.
#[test]
fn lora_covers_every_projection_of_qwen3_olmo2_and_gemma() {
    use cockpit::engine::model::LoraSpec;
    let targets = ["q", "k", "v", "o", "gate", "up", "down"];
    for name in ["qwen3", "olmo2", "gemma3_text"] {
        let e = expected(&fixture(name));
        let mut model = load(&fixture(name), e.ids.len() - 1);
        let before: std::collections::HashMap<String, Vec<f32>> = model
            .named_tensors()
            .into_iter()
            .map(|(n, t)| (n, t.flatten_all().unwrap().to_vec1().unwrap()))
            .collect();
        let spec = LoraSpec {
            r: 4,
            alpha: 8.0,
            targets: targets.iter().map(|t| t.to_string()).collect(),
            dropout: 0.0,
        };
        model.add_lora(&spec, 3).unwrap();
        let adapters: Vec<_> = model.params.iter().filter(|p| p.kind.is_lora()).collect();
        let layers = model.spec.n_layer;
        assert_eq!(adapters.len(), layers * targets.len() * 2, "{name}");
        assert!(model.params.iter().all(|p| p.trainable == p.kind.is_lora()));
        let norms = model
            .params
            .iter()
            .filter(|p| p.name.contains("q_norm") || p.name.contains("k_norm"))
            .count();
        assert_eq!(norms, 2 * layers, "{name}: q and k norms of every layer");
        let n = e.ids.len() - 1;
        let x = Tensor::from_vec(e.ids[..n].to_vec(), (1, n), &Device::Cpu).unwrap();
        let y = Tensor::from_vec(e.ids[1..].to_vec(), (1, n), &Device::Cpu).unwrap();
        let loss = model.loss(&x, &y, true).unwrap();
        let l = loss.to_scalar::<f32>().unwrap() as f64;
        assert!((l - e.loss).abs() < 1e-4, "{name}: {l} vs {}", e.loss);
        let grads = loss.backward().unwrap();
        for p in model.params.iter().filter(|p| p.name.contains("lora_B")) {
            let g = grads.get(p.var.as_tensor()).expect("a gradient");
            let size = g
                .abs()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!(size > 0.0, "{name}: {} has no gradient", p.name);
        }
        for p in model.params.iter().filter(|p| !p.kind.is_lora()) {
            assert!(grads.get(p.var.as_tensor()).is_none() || !p.trainable);
            let now: Vec<f32> = p.var.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
            assert_eq!(now, before[&p.name], "{name}: {} changed", p.name);
        }
    }
}

/// LongRoPE switches with the length of the forward, as transformers 5 does: within the
/// original context (16) the short factors give transformers' log-probabilities of a short
/// forward, past it the long ones those of the whole sequence (the fixture's loss); the two
/// differ. Cached decoding that crosses the original context recomputes the sequence with the
/// long factors: its last rows are the full forward's.
#[test]
fn longrope_switches_factors_with_the_sequence_length_as_transformers_does() {
    let dir = fixture("phi3_longrope");
    let e = expected(&dir);
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let short: Vec<f64> = v["short_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    let mut model = load(&dir, e.ids.len() - 1);
    let lp = logprobs(&mut model, &e.ids[..short.len() + 1]);
    let worst = lp
        .iter()
        .zip(&short)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    assert!(worst < 1e-4, "short factors: a token is {worst} off");
    let long = &e.logprobs[..short.len()];
    let apart = short
        .iter()
        .zip(long)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    assert!(apart > 1e-3, "short and long factors must differ: {apart}");
    // Decode 10, then one at a time past 16: the rows after the switch are the full forward's.
    let n = 24;
    let x = Tensor::from_vec(e.ids[..n].to_vec(), (1, n), &Device::Cpu).unwrap();
    let full: Vec<Vec<f32>> = model.forward(&x, false).unwrap().to_vec2().unwrap();
    let mut cache = model.kv_cache();
    model.decode(&e.ids[..10], &mut cache).unwrap();
    let mut rows = Vec::new();
    for &t in &e.ids[10..n] {
        rows.push(
            model
                .decode(&[t], &mut cache)
                .unwrap()
                .to_vec2::<f32>()
                .unwrap()
                .remove(0),
        );
    }
    assert_eq!(cache.len(), n);
    let last = rows.last().unwrap();
    let worst = full[n - 1]
        .iter()
        .zip(last)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(worst < 1e-4, "the last row differs by {worst}");
}

/// Gemma's sliding window, the local layers' θ and Gemma 2's soft-caps each change the
/// fixture's loss (the sequence is longer than the window): none is a no-op that exactness
/// would not notice.
#[test]
fn gemma_windows_local_theta_and_soft_caps_matter() {
    type Change = Box<dyn FnOnce(&mut serde_json::Value)>;
    let cases: Vec<(&str, Change)> = vec![
        (
            "gemma3_text",
            Box::new(|c| c["sliding_window"] = 4096.into()),
        ),
        (
            "gemma3_text",
            Box::new(|c| c["rope_parameters"]["sliding_attention"]["rope_theta"] = 1e6.into()),
        ),
        (
            "gemma3_text",
            Box::new(|c| c["query_pre_attn_scalar"] = 32.into()),
        ),
        (
            "gemma2",
            Box::new(|c| c["attn_logit_softcapping"] = serde_json::Value::Null),
        ),
        (
            "gemma2",
            Box::new(|c| c["final_logit_softcapping"] = serde_json::Value::Null),
        ),
    ];
    for (name, change) in cases {
        let want = expected(&fixture(name)).loss;
        assert!((loss_of(&fixture(name)) - want).abs() < 1e-4, "{name}");
        let dir = variant(name, change);
        let got = loss_of(dir.path());
        assert!((got - want).abs() > 1e-3, "{name}: {got} vs {want}");
    }
}

/// Real Gemma configs as published (gemma-3-1b-it, gemma-3-4b-it's multimodal wrapper with a
/// sparse text_config, gemma-2-2b with both hidden_act and hidden_activation) are accepted,
/// their absent keys taking transformers' defaults.
#[test]
fn real_gemma_configs_are_accepted_with_transformers_defaults() {
    use cockpit::engine::hf;
    let g3_1b = serde_json::json!({
        "architectures": ["Gemma3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
        "attn_logit_softcapping": null, "bos_token_id": 2, "cache_implementation": "hybrid",
        "eos_token_id": [1, 106], "final_logit_softcapping": null, "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "initializer_range": 0.02,
        "intermediate_size": 6912, "max_position_embeddings": 32768, "model_type": "gemma3_text",
        "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
        "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
        "rope_local_base_freq": 10000, "rope_scaling": null, "rope_theta": 1000000,
        "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16",
        "transformers_version": "4.50.0.dev0", "use_cache": true, "vocab_size": 262144
    });
    let s = hf::spec(&g3_1b).unwrap();
    assert_eq!(
        (s.n_layer, s.head_dim, s.n_kv_head, s.hidden),
        (26, 256, 1, 6912)
    );
    assert_eq!(s.attention_scale(), 1.0 / 16.0);
    assert_eq!(s.embedding_multiplier, 1152f64.sqrt());
    let full: Vec<usize> = (0..26).filter(|&l| s.layer_window(l).is_none()).collect();
    assert_eq!(full, [5, 11, 17, 23]);
    assert_eq!(s.layer_window(0), Some(512));
    assert!(s.layer_rope(0, 10).local && !s.layer_rope(5, 10).local);
    assert_eq!((s.attn_softcap(), s.final_softcap()), (None, None));
    let g3_4b = serde_json::json!({
        "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
        "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
        "initializer_range": 0.02, "mm_tokens_per_image": 256, "model_type": "gemma3",
        "text_config": {
            "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
            "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024
        },
        "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
        "vision_config": {"hidden_size": 1152, "model_type": "siglip_vision_model"}
    });
    let s = hf::spec(&g3_4b).unwrap();
    assert_eq!(
        (s.n_layer, s.n_head, s.n_kv_head, s.head_dim),
        (34, 8, 4, 256)
    );
    assert_eq!(s.vocab_size, 262_208);
    assert_eq!(
        s.rope_scaling,
        cockpit::config::RopeScaling::Linear { factor: 8.0 }
    );
    assert!(
        s.arch_notes.iter().any(|n| n.contains("vision_config")),
        "{:?}",
        s.arch_notes
    );
    let g2_2b = serde_json::json!({
        "architectures": ["Gemma2ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
        "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid",
        "eos_token_id": [1, 107], "final_logit_softcapping": 30.0, "head_dim": 256,
        "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 2304, "initializer_range": 0.02, "intermediate_size": 9216,
        "max_position_embeddings": 8192, "model_type": "gemma2", "num_attention_heads": 8,
        "num_hidden_layers": 26, "num_key_value_heads": 4, "pad_token_id": 0,
        "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
        "sliding_window": 4096, "torch_dtype": "float32", "transformers_version": "4.42.4",
        "use_cache": true, "vocab_size": 256000
    });
    let s = hf::spec(&g2_2b).unwrap();
    assert_eq!(
        (s.attn_softcap(), s.final_softcap()),
        (Some(50.0), Some(30.0))
    );
    assert_eq!((s.layer_window(0), s.layer_window(1)), (Some(4096), None));
    assert!(!s.layer_rope(0, 10).local);
}
