use super::*;
use crate::config::Config;
use crate::engine::optim::AdamW;

#[test]
fn whole_model_step_only_takes_gpt_style_bf16_cuda_models() {
    let c = Config::default();
    let dev = Device::Cpu;
    // The CPU never runs it, whatever the model.
    let m = Model::new(ModelSpec::from_config(&c, 32), DType::F32, &dev, 1).unwrap();
    assert!(m.step_weights().is_none());
    let m = Model::new(ModelSpec::from_config(&c, 32), DType::BF16, &dev, 1).unwrap();
    assert!(m.step_weights().is_none());
}

/// A GGUF base's kept blocks on the CPU (which reads no quantized matrix): the matrix stays
/// a dense parameter holding the blocks' values rounded to bf16, as the GPU's dequantization
/// gives them; the others go to NF4; a kept matrix of another shape is refused by name.
#[test]
fn kept_ggml_blocks_on_the_cpu_stay_dense_at_bf16() {
    use crate::engine::gguf::quant::{self, GgmlType};
    let mut c = Config::default();
    c.model.n_embd = 64;
    let dev = Device::Cpu;
    let shape = ModelSpec::from_config(&c, 32);
    let mut m = Model::new(shape.clone(), DType::F32, &dev, 3).unwrap();
    let name = "model.layers.0.self_attn.q_proj.weight";
    let w = m.params.iter().find(|p| p.name == name).unwrap();
    let v: Vec<f32> = w.var.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
    let bytes = quant::encode(&v, GgmlType::Q4_0);
    let want: Vec<f32> = quant::decode(&bytes, GgmlType::Q4_0)
        .iter()
        .map(|x| half::bf16::from_f32(*x).to_f32())
        .collect();
    // (the dense matrix holds the file's values, as a GGUF base's directory does)
    let exact = Tensor::from_vec(quant::decode(&bytes, GgmlType::Q4_0), (64, 64), &dev).unwrap();
    w.var.set(&exact).unwrap();
    let blocks = GgmlBlocks::new(2, 64, 64, bytes, &dev).unwrap();
    let kept: HashMap<String, GgmlBlocks> = [(name.to_string(), blocks.clone())].into();
    let r = m.quantize_base(&kept).unwrap();
    assert_eq!(r.formats.get("Q4_0"), Some(&1), "{:?}", r.formats);
    assert!(r.describe().contains("1 Q4_0"), "{}", r.describe());
    let w = m.params.iter().find(|p| p.name == name).unwrap();
    let got: Vec<f32> = w.var.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
    assert_eq!(got, want);
    let mut other = Model::new(shape, DType::F32, &dev, 3).unwrap();
    let wrong: HashMap<String, GgmlBlocks> =
        [("model.layers.0.mlp.up_proj.weight".to_string(), blocks)].into();
    let e = other.quantize_base(&wrong).unwrap_err().to_string();
    assert!(
        e.contains("model.layers.0.mlp.up_proj.weight") && e.contains("Q4_0"),
        "{e}"
    );
}

#[test]
fn a_base_in_nf4_computes_nearly_what_the_dense_base_does() {
    // (The reference arithmetic on the host; the CUDA kernels are held to it by
    // tests/gpu_kernels.rs.)
    let mut c = Config::default();
    c.model.n_embd = 64;
    let dev = Device::Cpu;
    let shape = ModelSpec::from_config(&c, 32);
    let mut dense = Model::new(shape.clone(), DType::F32, &dev, 3).unwrap();
    let mut q = Model::new(shape, DType::F32, &dev, 3).unwrap();
    let r = q.quantize_base(&Default::default()).unwrap();
    let (before, after) = (r.before, r.after);
    assert!(r.describe().starts_with("LoRA base linear layers in NF4: "));
    assert!(
        after * 7 < before && after * 8 > before,
        "{after} of {before} bytes"
    );
    let spec = LoraSpec {
        r: 4,
        alpha: 8.0,
        targets: vec!["q".into(), "v".into()],
        dropout: 0.0,
    };
    q.add_lora(&spec, 1).unwrap();
    // The quantized matrices are no parameters (not in checkpoints), yet counted.
    assert!(q.params.iter().all(|p| !p.name.ends_with("q_proj.weight")));
    assert_eq!(q.param_count().0, dense.param_count().0 + q.param_count().1);
    assert!(q.step_weights().is_none());
    let ids: Vec<u32> = (0..2 * 64).map(|i| (i * 5 % 32) as u32).collect();
    let tg: Vec<u32> = (0..2 * 64).map(|i| ((i * 5 + 3) % 32) as u32).collect();
    let x = Tensor::from_vec(ids, (2, 64), &dev).unwrap();
    let y = Tensor::from_vec(tg, (2, 64), &dev).unwrap();
    let l_dense = dense
        .loss(&x, &y, false)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    let l_q = q.loss(&x, &y, false).unwrap().to_scalar::<f32>().unwrap();
    assert!((l_q - l_dense).abs() < 0.02 * l_dense, "{l_q} vs {l_dense}");
    assert_ne!(l_q, l_dense);
    // The adapters train through the 4-bit base.
    let l = q.loss(&x, &y, true).unwrap();
    let grads = l.backward().unwrap();
    let a = q
        .params
        .iter()
        .find(|p| p.kind == ParamKind::LoraA)
        .unwrap();
    assert!(grads.get(a.var.as_tensor()).is_some());
    // Merged exports carry every base matrix, dequantized.
    let merged = q.merged_tensors().unwrap();
    let names: Vec<&str> = merged.iter().map(|(n, _)| n.as_str()).collect();
    assert!(names.contains(&"model.layers.0.self_attn.q_proj.weight"));
    assert!(names.contains(&"model.layers.0.mlp.down_proj.weight"));
    assert!(names.iter().all(|n| !n.contains("lora")));
}

#[test]
fn lora_dropout_masks_the_adapters_input_while_training_only() {
    let mut c = Config::default();
    c.model.n_embd = 64;
    let dev = Device::Cpu;
    let build = |p: f64| {
        let mut m = Model::new(ModelSpec::from_config(&c, 32), DType::F32, &dev, 3).unwrap();
        let spec = LoraSpec {
            r: 4,
            alpha: 8.0,
            targets: ["q", "k", "v", "o", "up", "down"]
                .map(String::from)
                .to_vec(),
            dropout: p,
        };
        m.add_lora(&spec, 1).unwrap();
        // B starts at zero (the adapters would change nothing): give it values.
        for p in m.params.iter().filter(|p| p.kind == ParamKind::LoraB) {
            let t = p.var.as_tensor();
            p.var
                .set(&(t.ones_like().unwrap() * 0.05).unwrap())
                .unwrap();
        }
        m.reseed_dropout(77);
        m
    };
    let (mut plain, mut dropped) = (build(0.0), build(0.3));
    let ids: Vec<u32> = (0..2 * 64).map(|i| (i * 5 % 32) as u32).collect();
    let tg: Vec<u32> = (0..2 * 64).map(|i| ((i * 5 + 3) % 32) as u32).collect();
    let x = Tensor::from_vec(ids, (2, 64), &dev).unwrap();
    let y = Tensor::from_vec(tg, (2, 64), &dev).unwrap();
    let loss =
        |m: &mut Model, train: bool| m.loss(&x, &y, train).unwrap().to_scalar::<f32>().unwrap();
    // Evaluation ignores it; training draws a mask, the same one for the same seed.
    assert_eq!(loss(&mut plain, false), loss(&mut dropped, false));
    let (a, b) = (loss(&mut dropped, true), loss(&mut dropped, true));
    assert_eq!(a, b);
    assert_ne!(a, loss(&mut plain, true));
    dropped.reseed_dropout(78);
    assert_ne!(a, loss(&mut dropped, true));
    // The sites: one per layer and group of adapters that share an input.
    let sites: std::collections::BTreeSet<u32> = dropped
        .blocks
        .iter()
        .flat_map(|b| {
            let a = b.attn().unwrap();
            [&a.q, &a.k, &a.v, &a.o, &b.up, &b.down]
        })
        .filter_map(|l| l.lora.as_ref().map(|a| a.site))
        .collect();
    assert_eq!(sites.len(), 4 * c.model.n_layer);
}

#[test]
fn memorizes_a_fixed_batch() {
    let mut c = Config::default();
    c.model.n_embd = 64;
    let dev = Device::Cpu;
    let mut m = Model::new(ModelSpec::from_config(&c, 32), DType::F32, &dev, 1).unwrap();
    let slots = m
        .params
        .iter()
        .map(|p| (p.name.clone(), p.var.clone(), false))
        .collect();
    let mut opt = AdamW::new(slots, 0.9, 0.95, 1e-8, 0.0).unwrap();
    let ids: Vec<u32> = (0..4 * 64).map(|i| (i * 7 % 32) as u32).collect();
    let tg: Vec<u32> = (0..4 * 64).map(|i| ((i * 7 + 7) % 32) as u32).collect();
    let x = Tensor::from_vec(ids, (4, 64), &dev).unwrap();
    let y = Tensor::from_vec(tg, (4, 64), &dev).unwrap();
    let mut first = 0.0;
    let mut last = 0.0;
    for i in 0..60 {
        let loss = m.loss(&x, &y, true).unwrap();
        let v = loss.to_scalar::<f32>().unwrap();
        if i == 0 {
            first = v;
        }
        last = v;
        let store = loss.backward().unwrap();
        let grads: Vec<Tensor> = opt
            .slots
            .iter()
            .map(|s| store.get(s.var.as_tensor()).unwrap().clone())
            .collect();
        opt.step(&grads, 3e-3).unwrap();
    }
    eprintln!("first {first} last {last}");
    assert!(last < 0.1 * first, "first {first} last {last}");
}

/// The families both executors are built for: GPT-2 style, Llama style, grouped-query
/// attention, an explicit head dim (Mistral-Nemo-like), q/k/v biases (Qwen2), learned
/// positions with an untied head.
fn families() -> Vec<(&'static str, Config)> {
    let gpt2 = Config::default();
    let llama = Config {
        model: crate::config::ModelConfig::llama_family(),
        ..Config::default()
    };
    let mut gqa = llama.clone();
    gqa.model.n_kv_head = 2;
    let mut head_dim = gqa.clone();
    head_dim.model.head_dim = 32;
    let mut qwen = llama.clone();
    qwen.model.qkv_bias = true;
    let mut learned = Config::default();
    learned.model.pos = PosEncoding::Learned;
    learned.model.tie_embeddings = false;
    learned.model.n_positions = 96;
    vec![
        ("gpt2", gpt2),
        ("llama", llama),
        ("gqa", gqa),
        ("head_dim", head_dim),
        ("qwen2", qwen),
        ("learned", learned),
    ]
}

#[test]
fn both_executors_are_built_from_one_spec() {
    for (name, c) in families() {
        let spec = ModelSpec::from_config(&c, 48);
        let mut m = Model::new(spec.clone(), DType::F32, &Device::Cpu, 1).unwrap();
        // The step's weights hold the spec and have its shapes.
        let w = m.step_weights_unchecked(false);
        assert_eq!(w.spec, spec, "{name}");
        w.check_shapes().unwrap_or_else(|e| panic!("{name}: {e}"));
        // The spec counts what the candle model allocates.
        assert_eq!(spec.param_count().total(), m.param_count().0, "{name}");
        // A spec the weights do not match is refused.
        let mut wrong = w.clone();
        wrong.spec.hidden += 8;
        assert!(wrong.check_shapes().is_err(), "{name}");
        let mut wrong = w.clone();
        wrong.spec.n_kv_head = 1;
        assert!(wrong.check_shapes().is_err(), "{name}");
        // With LoRA: the adapters too.
        let lora = LoraSpec {
            r: 4,
            alpha: 8.0,
            targets: ["q", "k", "v", "o", "gate", "up", "down"]
                .map(String::from)
                .to_vec(),
            dropout: 0.0,
        };
        m.add_lora(&lora, 2).unwrap();
        let with = ModelSpec {
            lora: Some(lora),
            ..spec.clone()
        };
        let count = with.param_count();
        assert_eq!((count.total(), count.adapters), m.param_count(), "{name}");
        m.step_weights_unchecked(false)
            .check_shapes()
            .unwrap_or_else(|e| panic!("{name} with LoRA: {e}"));
    }
}

/// A small Granite-4.0-H-like config (width 64, two heads, Mamba layers of four heads × 16 with
/// state 8) whose layers are `hybrid.layers`, the rest of `hybrid` as given.
fn tiny_hybrid(hybrid: crate::config::HybridConfig) -> Config {
    let mut c = Config {
        model: crate::config::ModelConfig::llama_family(),
        ..Config::default()
    };
    c.model.n_layer = hybrid.layers.len();
    c.model.n_embd = 64;
    c.model.n_head = 2;
    c.model.hybrid = Some(crate::config::HybridConfig {
        mamba_n_heads: 4,
        mamba_d_head: 16,
        mamba_d_state: 8,
        ..hybrid
    });
    c
}

/// A dense Granite 4.0 hybrid hands every layer to the step: its Mamba layers with in_proj,
/// out_proj and their own weights, its attention layers, the shared MLP's gate | up as one "up";
/// LoRA's in_proj and out_proj adapters in q's and o's slots. The weights have the spec's
/// shapes; a spec they do not match is refused by name.
#[test]
fn a_hybrid_hands_its_mamba_layers_to_the_step() {
    use crate::config::{HybridConfig, MixerKind};
    let c = tiny_hybrid(HybridConfig {
        layers: vec![MixerKind::Mamba, MixerKind::Attention, MixerKind::Mamba],
        mamba_n_groups: 2,
        mamba_proj_bias: true,
        ..HybridConfig::default()
    });
    let spec = ModelSpec::from_config(&c, 40);
    let mut m = Model::new(spec.clone(), DType::F32, &Device::Cpu, 1).unwrap();
    let w = m.step_weights_unchecked(false);
    w.check_shapes().unwrap_or_else(|e| panic!("{e}"));
    let kinds: Vec<bool> = w
        .layers
        .iter()
        .map(|l| matches!(l.mixer, StepMixer::Mamba(_)))
        .collect();
    assert_eq!(kinds, [true, false, true]);
    assert!(w.layers.iter().all(|l| l.gate.is_none()));
    let mut wrong = w.clone();
    if let Some(h) = wrong.spec.hybrid.as_mut() {
        h.mamba_d_state = 16;
    }
    let e = wrong.check_shapes().unwrap_err();
    assert!(e.contains("layer 0's in_proj"), "{e}");
    let mut wrong = w.clone();
    if let Some(h) = wrong.spec.hybrid.as_mut() {
        h.mamba_d_conv = 3;
    }
    let e = wrong.check_shapes().unwrap_err();
    assert!(e.contains("layer 0's conv1d weight"), "{e}");
    let mut wrong = w.clone();
    if let Some(h) = wrong.spec.hybrid.as_mut() {
        h.layers = vec![MixerKind::Attention; 3];
    }
    let e = wrong.check_shapes().unwrap_err();
    assert!(e.contains("layer 0's projections"), "{e}");
    let lora = LoraSpec {
        r: 4,
        alpha: 8.0,
        targets: ["q", "v", "o", "in_proj", "out_proj", "up", "down"]
            .map(String::from)
            .to_vec(),
        dropout: 0.1,
    };
    m.add_lora(&lora, 2).unwrap();
    let w = m.step_weights_unchecked(false);
    w.check_shapes()
        .unwrap_or_else(|e| panic!("with LoRA: {e}"));
    assert!(w.frozen_base);
    assert_eq!(w.lora_dropout, 0.1);
    let slots = |l: &StepLayer| l.lora.iter().map(Option::is_some).collect::<Vec<_>>();
    let (f, t) = (false, true);
    assert_eq!(slots(&w.layers[0]), [t, f, f, t, f, t, t]);
    assert_eq!(slots(&w.layers[1]), [t, f, t, t, f, t, t]);
    let in_proj = w.layers[0].lora[0]
        .as_ref()
        .map(|a| a.b.as_tensor().dims().to_vec());
    assert_eq!(
        in_proj,
        Some(vec![spec.hybrid.as_ref().unwrap().in_proj_width(), 4])
    );
}

/// A hybrid with routed experts hands every layer's router and experts to the step (the
/// candle model's tensors, shared: the step reads and trains the same ones); weights a spec
/// does not describe are refused by name.
#[test]
fn a_hybrid_hands_its_experts_to_the_step() {
    use crate::config::{HybridConfig, MixerKind};
    let c = tiny_hybrid(HybridConfig {
        layers: vec![MixerKind::Mamba, MixerKind::Attention],
        experts: 4,
        experts_top_k: 2,
        expert_hidden: 24,
        ..HybridConfig::default()
    });
    let spec = ModelSpec::from_config(&c, 40);
    let m = Model::new(spec.clone(), DType::F32, &Device::Cpu, 1).unwrap();
    let w = m.step_weights_unchecked(false);
    w.check_shapes().unwrap_or_else(|e| panic!("{e}"));
    for l in &w.layers {
        let e = l.moe.as_ref().expect("every layer's experts");
        assert_eq!(e.router.as_tensor().dims(), [4, 64]);
        assert_eq!(e.gate_up.as_tensor().dims(), [4, 48, 64]);
        assert_eq!(e.down.as_tensor().dims(), [4, 64, 24]);
    }
    let named = |p: &str| {
        m.params
            .iter()
            .find(|q| q.name == p)
            .map(|q| q.var.as_tensor().id())
    };
    assert_eq!(
        named("model.layers.1.block_sparse_moe.experts.down_proj"),
        w.layers[1].moe.as_ref().map(|e| e.down.as_tensor().id())
    );
    let mut wrong = w.clone();
    if let Some(h) = wrong.spec.hybrid.as_mut() {
        h.expert_hidden = 32;
    }
    let e = wrong.check_shapes().unwrap_err();
    assert!(e.contains("layer 0's experts' gate_up_proj"), "{e}");
    let mut wrong = w.clone();
    wrong.layers[1].moe = None;
    let e = wrong.check_shapes().unwrap_err();
    assert!(e.contains("layer 1 has routed experts: false"), "{e}");
}

#[test]
fn the_cpu_model_says_why_the_step_does_not_run_it() {
    let mut c = Config::default();
    c.kernels.step = true;
    let m = Model::new(ModelSpec::from_config(&c, 32), DType::BF16, &Device::Cpu, 1).unwrap();
    assert_eq!(m.step_plan().unwrap_err(), Reason::NotCuda);
}

/// QK-norm, post-norm and partial rotary: the spec counts what the candle model allocates,
/// under Hugging Face's names, and the model runs.
#[test]
fn family_layouts_allocate_what_the_spec_counts() {
    use crate::config::{Activation, BlockLayout, LayerKind, QkNorm};
    for (name, layout, norms) in [
        (
            "qwen3",
            BlockLayout {
                qk_norm: QkNorm::Head,
                ..BlockLayout::default()
            },
            [
                "input_layernorm",
                "post_attention_layernorm",
                "self_attn.q_norm",
            ],
        ),
        (
            "olmo2",
            BlockLayout {
                qk_norm: QkNorm::Whole,
                post_norm: true,
                ..BlockLayout::PLAIN
            },
            [
                "post_attention_layernorm",
                "post_feedforward_layernorm",
                "self_attn.k_norm",
            ],
        ),
        (
            "phi3",
            BlockLayout {
                rotary_dim: 8,
                ..BlockLayout::default()
            },
            ["input_layernorm", "post_attention_layernorm", "mlp.up_proj"],
        ),
        (
            "gemma3",
            BlockLayout {
                qk_norm: QkNorm::Head,
                sandwich_norm: true,
                norm_plus_one: true,
                layer_types: vec![LayerKind::Sliding, LayerKind::Full],
                window: 2,
                local_rope_theta: 100.0,
                attn_softcap: 20.0,
                final_softcap: 10.0,
                ..BlockLayout::PLAIN
            },
            [
                "pre_feedforward_layernorm",
                "post_feedforward_layernorm",
                "post_attention_layernorm",
            ],
        ),
    ] {
        let mut c = Config {
            model: crate::config::ModelConfig::llama_family(),
            ..Config::default()
        };
        c.model.n_kv_head = 2;
        if layout.sandwich_norm {
            c.model.activation = Activation::GeGlu;
        }
        c.model.layout = layout;
        let spec = ModelSpec::from_config(&c, 48);
        let mut m = Model::new(spec.clone(), DType::F32, &Device::Cpu, 1).unwrap();
        assert_eq!(spec.param_count().total(), m.param_count().0, "{name}");
        for n in norms {
            let full = format!("model.layers.1.{n}.weight");
            assert!(m.params.iter().any(|p| p.name == full), "{name}: {full}");
        }
        let ids = Tensor::from_vec(vec![1u32, 2, 3, 4], (1, 4), &Device::Cpu).unwrap();
        let loss = m
            .loss(&ids, &ids, false)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(loss.is_finite(), "{name}");
    }
}

/// Attention's share of the FLOPs per token (MFU's numerator) counts the heads' width and the
/// keys each layer's queries may see: a sliding layer's window where it is shorter than the
/// sequence, so a long-context Gemma-style run does not report more than the GPU can do.
#[test]
fn flops_per_token_count_sliding_windows_and_the_heads_width() {
    use crate::config::LayerKind::{Full, Sliding};
    let mut c = Config {
        model: crate::config::ModelConfig::llama_family(),
        ..Config::default()
    };
    c.model.n_layer = 2;
    c.model.seq_len = 64;
    let flops = |c: &Config| {
        Model::new(ModelSpec::from_config(c, 32), DType::F32, &Device::Cpu, 1)
            .unwrap()
            .flops_per_token()
    };
    let full = flops(&c);
    let mut sliding = c.clone();
    sliding.model.layout.layer_types = vec![Sliding, Full];
    sliding.model.layout.window = 16;
    let d = (c.model.n_head * (c.model.n_embd / c.model.n_head)) as f64;
    assert!((full - flops(&sliding) - 12.0 * d * (64.0 - 16.0)).abs() < 1e-6 * full);
    // A window as long as the sequence changes nothing.
    sliding.model.layout.window = 64;
    assert_eq!(flops(&sliding), full);
    // Heads twice as wide as n_embd count twice (q, k, v and o twice as wide: 6·N grows by
    // their extra weights, four n_embd² a layer).
    let mut wide = c.clone();
    wide.model.head_dim = 2 * (c.model.n_embd / c.model.n_head);
    let m = Model::new(
        ModelSpec::from_config(&wide, 32),
        DType::F32,
        &Device::Cpu,
        1,
    )
    .unwrap();
    let extra_weights = 6.0 * (2 * 4 * c.model.n_embd * c.model.n_embd) as f64;
    assert!(
        (m.flops_per_token() - full - extra_weights - 2.0 * 12.0 * d * 64.0).abs() < 1e-6 * full
    );
}

/// Routed experts count by what a token goes through: its top-k experts' weights, not all E
/// (a 64-expert, top-6 model reported an MFU of 158% counting every expert).
#[test]
fn flops_per_token_count_a_tokens_experts_alone() {
    use crate::config::{HybridConfig, MixerKind};
    let flops = |experts: usize| {
        let c = tiny_hybrid(HybridConfig {
            layers: vec![MixerKind::Mamba, MixerKind::Mamba],
            experts,
            experts_top_k: 2,
            expert_hidden: 24,
            ..HybridConfig::default()
        });
        Model::new(ModelSpec::from_config(&c, 40), DType::F32, &Device::Cpu, 1)
            .unwrap()
            .flops_per_token()
    };
    // Per layer: the router (E·C, every token) and two experts' gate|up and down (2·3·I·C).
    let (c, i) = (64.0, 24.0);
    let per_layer = |e: f64| 6.0 * (e * c + 2.0 * 3.0 * i * c);
    let (f8, f16) = (flops(8), flops(16));
    assert!(((f16 - f8) - 2.0 * (per_layer(16.0) - per_layer(8.0))).abs() < 1e-6 * f8);
}
