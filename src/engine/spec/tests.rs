use super::*;
use crate::config::ModelConfig;

/// A CUDA GPU that runs the step in bf16, with flash attention's kernels fitting.
fn gpu() -> StepFacts {
    StepFacts {
        cuda: true,
        dtype: "bf16",
        kernels: None,
        flash_fits: true,
        mixed_trainable: false,
        loss_mask: false,
        packed_samples: false,
    }
}

fn spec(f: impl FnOnce(&mut Config)) -> ModelSpec {
    let mut c = Config::default();
    c.kernels.step = true;
    f(&mut c);
    ModelSpec::from_config(&c, 64)
}

fn llama(c: &mut Config) {
    c.model = ModelConfig {
        n_embd: 256,
        n_head: 4,
        ..ModelConfig::llama_family()
    };
}

#[test]
fn the_step_runs_gpt_and_llama_models_on_a_gpu() {
    assert_eq!(spec(|_| {}).fast_step_support(&gpu()), Ok(()));
    let l = spec(llama);
    assert_eq!(l.head_dim, 64);
    assert_eq!(l.fast_step_support(&gpu()), Ok(()));
    // Grouped-query attention and an explicit head dim, through flash attention.
    let gqa = spec(|c| {
        llama(c);
        c.model.n_kv_head = 2;
        c.model.head_dim = 128;
    });
    assert_eq!(gqa.fast_step_support(&gpu()), Ok(()));
    assert!(gqa.flash_attention(true));
    let f16 = StepFacts {
        dtype: "f16",
        ..gpu()
    };
    assert_eq!(l.fast_step_support(&f16), Ok(()));
}

#[test]
fn every_refusal_names_its_reason() {
    let base = spec(llama);
    let why = |s: &ModelSpec, f: &StepFacts| s.fast_step_support(f).unwrap_err();
    let off = spec(|c| {
        llama(c);
        c.kernels.step = false;
    });
    assert_eq!(why(&off, &gpu()), Reason::Off);
    assert_eq!(why(&off, &gpu()).to_string(), "kernels.step = false");
    let cpu = StepFacts {
        cuda: false,
        ..gpu()
    };
    assert_eq!(why(&base, &cpu), Reason::NotCuda);
    let f32 = StepFacts {
        dtype: "f32",
        ..gpu()
    };
    assert_eq!(why(&base, &f32), Reason::Precision("f32"));
    assert!(why(&base, &f32).to_string().contains("precision f32"));
    let t4 = StepFacts {
        kernels: Some("compute capability below 8.0".into()),
        ..gpu()
    };
    assert_eq!(why(&base, &t4).to_string(), "compute capability below 8.0");
    let mixed = StepFacts {
        mixed_trainable: true,
        ..gpu()
    };
    assert_eq!(why(&base, &mixed), Reason::MixedTrainable);
    // Instruction/chat data: ignored targets always; packed samples with flash attention and
    // RoPE only.
    let packed = StepFacts {
        packed_samples: true,
        loss_mask: true,
        ..gpu()
    };
    let masked = StepFacts {
        loss_mask: true,
        ..gpu()
    };
    assert!(base.fast_step_support(&masked).is_ok());
    assert!(base.fast_step_support(&packed).is_ok());
    let learned = spec(|c| {
        llama(c);
        c.model.pos = crate::config::PosEncoding::Learned;
    });
    assert_eq!(
        why(&learned, &packed),
        Reason::PackedSamples("learned positions")
    );
    let no_flash = StepFacts {
        flash_fits: false,
        ..packed
    };
    assert_eq!(
        why(&base, &no_flash),
        Reason::PackedSamples("materialised attention")
    );

    let narrow = spec(|c| {
        llama(c);
        c.model.n_embd = 260;
        c.model.n_head = 2;
    });
    assert!(matches!(
        why(&narrow, &gpu()),
        Reason::Widths { n_embd: 260, .. }
    ));
    let mlp = spec(|c| {
        llama(c);
        c.model.mlp_ratio = 2.01;
    });
    assert!(matches!(
        why(&mlp, &gpu()),
        Reason::Widths { hidden: 515, .. }
    ));
    assert!(why(&mlp, &gpu()).to_string().contains("multiples of 8"));
    let odd = spec(|c| {
        llama(c);
        c.model.head_dim = 33;
    });
    assert_eq!(why(&odd, &gpu()), Reason::OddHeadDim(33));
    let kv = spec(|c| {
        llama(c);
        c.model.n_kv_head = 3;
    });
    assert_eq!(
        why(&kv, &gpu()),
        Reason::KvHeads {
            n_kv_head: 3,
            n_head: 4
        }
    );
    // Grouped-query attention and heads whose widths do not add up to n_embd run in the
    // materialised attention too (head dim 32, 40; flash off); dropout needs flash attention:
    // the reason says why it is off.
    let gqa32 = spec(|c| {
        llama(c);
        c.model.n_head = 8;
        c.model.n_kv_head = 2;
    });
    assert_eq!(gqa32.head_dim, 32);
    assert_eq!(gqa32.fast_step_support(&gpu()), Ok(()));
    let gqa_off = spec(|c| {
        llama(c);
        c.model.n_kv_head = 2;
        c.kernels.attention = false;
    });
    assert_eq!(gqa_off.fast_step_support(&gpu()), Ok(()));
    let small_smem = StepFacts {
        flash_fits: false,
        ..gpu()
    };
    let gqa128 = spec(|c| {
        llama(c);
        c.model.n_head = 2;
        c.model.n_kv_head = 1;
    });
    assert_eq!(gqa128.fast_step_support(&small_smem), Ok(()));
    let wide = spec(|c| {
        llama(c);
        c.model.head_dim = 40;
    });
    assert_eq!(wide.fast_step_support(&gpu()), Ok(()));
    let drop_off = spec(|c| {
        llama(c);
        c.model.dropout = 0.1;
        c.kernels.attention = false;
    });
    assert!(why(&drop_off, &gpu())
        .to_string()
        .ends_with("; kernels.attention = false)"));
    let drop = spec(|c| {
        llama(c);
        c.model.n_head = 8;
        c.model.dropout = 0.1;
    });
    assert_eq!(
        why(&drop, &gpu()),
        Reason::DropoutNeedsFlash {
            head_dim: 32,
            why: NoFlash::HeadDim
        }
    );
    let granite = spec(|c| {
        c.model.pos = PosEncoding::Learned;
        c.model.embedding_multiplier = 12.0;
    });
    assert_eq!(why(&granite, &gpu()), Reason::EmbeddingMultiplier);
    let empty = spec(|c| c.model.n_layer = 0);
    assert_eq!(why(&empty, &gpu()), Reason::NoLayers);
}

#[test]
fn the_resume_key_leaves_out_what_a_resume_may_change() {
    let base = spec(llama);
    for changed in [
        spec(|c| {
            llama(c);
            c.model.recompute = Recompute::Full;
        }),
        spec(|c| {
            llama(c);
            c.model.dropout = 0.1;
        }),
        spec(|c| {
            llama(c);
            c.kernels.graphs = false;
        }),
        spec(|c| {
            llama(c);
            c.model.init_std = 0.01;
        }),
    ] {
        assert_eq!(
            changed.resume_key().differences(&base.resume_key()),
            Vec::<String>::new()
        );
    }
    let deeper = spec(|c| {
        llama(c);
        c.model.n_layer = 3;
    });
    assert_eq!(
        deeper.resume_key().differences(&base.resume_key()),
        vec!["model.n_layer 2 → 3".to_string()]
    );
    let lora = spec(|c| {
        llama(c);
        c.lora.enabled = true;
    });
    assert_eq!(lora.resume_key().differences(&base.resume_key()).len(), 1);
}

#[test]
fn mlp_width_and_scu_coefficient() {
    assert_eq!(mlp_width(64, 4.0), 256);
    assert_eq!(mlp_width(64, 2.67), 171);
    assert_eq!(mlp_width(4, 0.01), 1);
    let s = spec(|c| c.scu.prior_sigma = 0.5);
    assert_eq!(s.scu_coefficient(1000.0), 1.0 / (2.0 * 0.25 * 1000.0));
}

#[test]
fn parameter_count_by_hand() {
    // GPT-2 style, tied, biases, LayerNorm, RoPE (the default pos), vocab 64, 2 layers of 64.
    let s = spec(|_| {});
    let c = 64u64;
    let layer = 4 * (c * c + c) + 2 * (4 * c * c) + 4 * c + c + 2 * 2 * c;
    assert_eq!(s.param_count().base, 64 * c + 2 * layer + 2 * c);
    assert_eq!(s.param_count().adapters, 0);
    let lora = spec(|c| {
        c.lora.enabled = true;
        c.lora.r = 4;
        c.lora.targets = vec!["q".into(), "v".into()];
    });
    assert_eq!(lora.param_count().adapters, 2 * 2 * 4 * (64 + 64));
}

/// The fused step runs Qwen3's per-head QK-norm (head dims up to 256), Phi-3's partial rotary
/// and OLMo 2's blocks (QK-norm over the whole projections, post-norm); post-norm blocks with
/// biases it refuses (the per-op path trains them) and says why.
#[test]
fn the_step_runs_qwen3_and_olmo2_blocks_and_refuses_biased_post_norms_by_name() {
    use crate::config::{BlockLayout, QkNorm};
    let with = |layout: BlockLayout| {
        spec(|c| {
            llama(c);
            c.model.layout = layout;
        })
    };
    let qwen3 = with(BlockLayout {
        qk_norm: QkNorm::Head,
        post_norm: false,
        ..BlockLayout::PLAIN
    });
    assert_eq!(qwen3.fast_step_support(&gpu()), Ok(()));
    let olmo2 = with(BlockLayout {
        qk_norm: QkNorm::Whole,
        post_norm: true,
        ..BlockLayout::PLAIN
    });
    // OLMo 2's blocks run on the step (post-norm, QK-norm over the whole projections); with
    // biases their output norms would come before the bias: refused.
    assert_eq!(olmo2.fast_step_support(&gpu()), Ok(()));
    let mut biased = olmo2.clone();
    biased.bias = true;
    let why = biased.step_shape_support(true).unwrap_err();
    assert_eq!(why, Reason::PostNorm);
    assert!(why.to_string().contains("post-norm"), "{why}");
    let phi3 = with(BlockLayout {
        rotary_dim: 32,
        ..BlockLayout::default()
    });
    // Phi-3's partial rotary: the step turns the first rotary_dim dims (an even count).
    assert_eq!(phi3.fast_step_support(&gpu()), Ok(()));
    let odd = with(BlockLayout {
        rotary_dim: 33,
        ..BlockLayout::default()
    });
    assert_eq!(
        odd.fast_step_support(&gpu()),
        Err(Reason::PartialRotary {
            rotary_dim: 33,
            head_dim: 64
        })
    );
    assert_eq!(phi3.rope_inv_freq().len(), 16);
    // The q and k norms' weights are counted.
    let plain = spec(llama).param_count().base;
    assert_eq!(
        qwen3.param_count().base - plain,
        2 * 2 * 64,
        "two layers of [head_dim] q and k norms"
    );
    assert_eq!(olmo2.param_count().base - plain, 2 * 2 * 256);
}

/// Gemma's block (sandwich and 1 + w norms, GeGLU), sliding windows and Gemma 2's soft-caps run
/// in the fused step (the attention's soft-cap in flash attention at head dim 256, else in
/// materialised attention), as does LongRoPE;
/// output norms with biases are refused by name; sliding windows run in flash and in
/// materialised attention; the spec says which layers slide and which RoPE table each reads.
#[test]
fn the_step_takes_gemma_blocks_soft_caps_and_longrope() {
    use crate::config::{Activation, BlockLayout, LayerKind, RopeScaling};
    let gemma = |change: &dyn Fn(&mut BlockLayout), act: Activation| {
        spec(|c| {
            llama(c);
            c.model.activation = act;
            change(&mut c.model.layout);
        })
    };
    let sliding = |l: &mut BlockLayout| {
        l.layer_types = vec![LayerKind::Sliding, LayerKind::Full];
        l.window = 4;
        l.local_rope_theta = 10.0;
    };
    let mut biased = gemma(&|l| l.sandwich_norm = true, Activation::SwiGlu);
    biased.bias = true;
    let mut unflashed = gemma(&sliding, Activation::SwiGlu);
    unflashed.kernels.attention = false;
    for (s, want) in [
        (biased, Err(Reason::SandwichNorm)),
        (
            gemma(&|l| l.sandwich_norm = true, Activation::SwiGlu),
            Ok(()),
        ),
        (
            gemma(&|l| l.norm_plus_one = true, Activation::SwiGlu),
            Ok(()),
        ),
        (gemma(&|_| {}, Activation::GeGlu), Ok(())),
        (gemma(&sliding, Activation::SwiGlu), Ok(())),
        (unflashed, Ok(())),
        (
            gemma(&|l| l.attn_softcap = 50.0, Activation::SwiGlu),
            Ok(()),
        ),
        (
            gemma(&|l| l.final_softcap = 30.0, Activation::SwiGlu),
            Ok(()),
        ),
    ] {
        assert_eq!(s.fast_step_support(&gpu()), want);
    }
    // Gemma 2's attention soft-cap is in the head-dim-256 flash kernels (Gemma 2 2B and 9B);
    // at other head dims it is in the materialised softmax.
    let capped = gemma(&|l| l.attn_softcap = 50.0, Activation::SwiGlu);
    assert!(!capped.flash_attention(true));
    let mut capped256 = capped.clone();
    capped256.head_dim = 256;
    assert!(capped256.flash_attention(true));
    assert!(!capped256.flash_attention(false));
    assert!(gemma(&|l| l.final_softcap = 30.0, Activation::SwiGlu).flash_attention(true));
    let s = gemma(&sliding, Activation::SwiGlu);
    assert_eq!((s.layer_window(0), s.layer_window(1)), (Some(4), None));
    assert!(s.layer_rope(0, 8).local && !s.layer_rope(1, 8).local);
    assert_eq!(s.rope_keys().len(), 2);
    // Four norms a block (sandwich) are counted.
    let plain = spec(llama).param_count().base;
    let sandwich = gemma(&|l| l.sandwich_norm = true, Activation::SwiGlu);
    assert_eq!(sandwich.param_count().base - plain, 2 * 2 * 256);
    let longrope = spec(|c| {
        llama(c);
        c.model.rope_scaling = RopeScaling::LongRope {
            short_factor: vec![1.0; 32],
            long_factor: vec![2.0; 32],
            original_max_position_embeddings: 16,
            attention_factor: 1.5,
        };
    });
    // LongRoPE runs on the step (its table is the one a forward of T reads), but not on packed
    // samples past the original context (the factors follow each batch's longest sample).
    assert!(longrope.seq_len > 16);
    assert_eq!(longrope.fast_step_support(&gpu()), Ok(()));
    let packed = StepFacts {
        packed_samples: true,
        ..gpu()
    };
    assert_eq!(
        longrope.fast_step_support(&packed),
        Err(Reason::PackedSamples("LongRoPE past its original context"))
    );
    // Short factors up to the original context, long ones past it; cos/sin × the factor.
    assert!(!longrope.rope_long(16) && longrope.rope_long(17));
    let short = longrope.rope_freqs(longrope.layer_rope(0, 16));
    let long = longrope.rope_freqs(longrope.layer_rope(0, 17));
    assert_eq!(short.inv_freq[1] / long.inv_freq[1], 2.0);
    assert_eq!((short.scale, long.scale), (1.5, 1.5));
}

/// A llama of 3 layers as a dense hybrid: Mamba (8 heads × 64, state 128), attention, Mamba.
fn hybrid(c: &mut Config) {
    use crate::config::{HybridConfig, MixerKind};
    llama(c);
    c.model.n_layer = 3;
    c.model.hybrid = Some(HybridConfig {
        layers: vec![MixerKind::Mamba, MixerKind::Attention, MixerKind::Mamba],
        mamba_n_heads: 8,
        mamba_d_head: 64,
        mamba_d_state: 128,
        ..HybridConfig::default()
    });
}

/// A dense Granite 4.0 hybrid (Mamba layers beside attention, no routed experts) runs on the
/// step, packed samples too; routed experts and Mamba sizes past the kernels' are refused by
/// name; its attention layers take every model's checks.
#[test]
fn the_step_runs_dense_hybrids_and_refuses_what_its_mamba_kernels_do_not_cover() {
    use crate::config::{HybridConfig, MixerKind};
    let with = |f: fn(&mut HybridConfig)| {
        spec(|c| {
            hybrid(c);
            if let Some(h) = c.model.hybrid.as_mut() {
                f(h);
            }
        })
    };
    let why = |s: &ModelSpec, f: &StepFacts| s.fast_step_support(f).unwrap_err();
    let dense = spec(hybrid);
    assert_eq!(dense.fast_step_support(&gpu()), Ok(()));
    let masked = StepFacts {
        loss_mask: true,
        ..gpu()
    };
    assert_eq!(dense.fast_step_support(&masked), Ok(()));
    // Attention alone in a hybrid stack, and NoPE attention.
    assert_eq!(
        with(|h| h.layers = vec![MixerKind::Attention; 3]).fast_step_support(&gpu()),
        Ok(())
    );
    let experts = with(|h| {
        h.experts = 4;
        h.experts_top_k = 2;
        h.expert_hidden = 64;
    });
    // Routed experts run on the step, within its router's limits (the key and value named).
    assert_eq!(experts.fast_step_support(&gpu()), Ok(()));
    for (h, key, value) in [
        (with(|h| h.experts = 300), "model.hybrid.experts", 300),
        (
            with(|h| {
                h.experts = 32;
                h.experts_top_k = 17
            }),
            "model.hybrid.experts_top_k",
            17,
        ),
        (
            with(|h| {
                h.experts = 4;
                h.experts_top_k = 2;
                h.expert_hidden = 60
            }),
            "model.hybrid.expert_hidden",
            60,
        ),
    ] {
        let w = why(&h, &gpu());
        assert!(
            matches!(w, Reason::Experts { key: k, value: v, .. } if k == key && v == value),
            "{w}"
        );
        assert!(w.to_string().contains(&format!("{key} = {value}")), "{w}");
    }
    for (h, key, value) in [
        (
            with(|h| h.mamba_d_head = 12),
            "model.hybrid.mamba_d_head",
            12,
        ),
        (
            with(|h| h.mamba_d_head = 256),
            "model.hybrid.mamba_d_head",
            256,
        ),
        (
            with(|h| h.mamba_d_state = 20),
            "model.hybrid.mamba_d_state",
            20,
        ),
        (
            with(|h| h.mamba_d_state = 512),
            "model.hybrid.mamba_d_state",
            512,
        ),
        (with(|h| h.mamba_d_conv = 9), "model.hybrid.mamba_d_conv", 9),
    ] {
        let w = why(&h, &gpu());
        assert!(
            matches!(w, Reason::Mamba { key: k, value: v, .. } if k == key && v == value),
            "{key} = {value}: {w}"
        );
        assert!(w.to_string().contains(&format!("{key} = {value}")), "{w}");
    }
    // Widths and heads of the attention layers: as any model's.
    let narrow = spec(|c| {
        hybrid(c);
        c.model.n_embd = 260;
        c.model.n_head = 2;
    });
    assert!(matches!(
        why(&narrow, &gpu()),
        Reason::Widths { n_embd: 260, .. }
    ));
    let kv = spec(|c| {
        hybrid(c);
        c.model.n_kv_head = 3;
    });
    assert!(matches!(why(&kv, &gpu()), Reason::KvHeads { .. }));
    // Packed samples through Mamba layers: the step's conv and scan begin again at each
    // sample, as the per-op model does (segments_tests; gpu_sft holds the two equal).
    let packed = StepFacts {
        packed_samples: true,
        ..gpu()
    };
    assert_eq!(dense.fast_step_support(&packed), Ok(()));
}

/// The shipped Granite-4.0-H-1B LoRA config runs on the step on a CUDA GPU.
#[test]
fn the_granite_h_config_runs_on_the_step() {
    let set = [
        "lora.base=\"random\"".to_string(),
        "data.source=\"builtin\"".to_string(),
    ];
    let path = std::path::Path::new("configs/lora-granite-h-1b.toml");
    let c = crate::config::load(Some(path), &set)
        .unwrap_or_else(|e| panic!("{e}"))
        .config;
    let s = ModelSpec::from_config(&c, c.model.vocab_size);
    assert!(s.hybrid.is_some());
    assert_eq!(s.fast_step_support(&gpu()), Ok(()));
}

/// Attention's forward FLOPs (for `cockpit bench --profile`'s TFLOP/s): causal pairs, through
/// each layer's sliding window, the mean over the attention layers, counted against a direct
/// sum over queries.
#[test]
fn attention_flops_count_the_causal_pairs_through_each_window() {
    use crate::config::LayerKind;
    let pairs = |t: usize, w: Option<usize>| -> f64 {
        (0..t)
            .map(|i| w.map_or(i + 1, |w| (i + 1).min(w)) as f64)
            .sum()
    };
    let full = spec(llama);
    let d = 256.0; // n_head · head_dim
    assert_eq!(
        full.attention_flops_fwd(64),
        Some(4.0 * d * pairs(64, None))
    );
    let sliding = spec(|c| {
        llama(c);
        c.model.layout.layer_types = vec![LayerKind::Sliding, LayerKind::Full];
        c.model.layout.window = 5;
    });
    let want = 4.0 * d * (pairs(64, Some(5)) + pairs(64, None)) / 2.0;
    assert_eq!(sliding.attention_flops_fwd(64), Some(want));
    // A window past the sequence is the full causal count.
    assert_eq!(
        sliding.attention_flops_fwd(3),
        Some(4.0 * d * pairs(3, None))
    );
    assert_eq!(full.attention_flops_fwd(0), None);
}

/// The Mamba chunk kernels' FLOPs (for `cockpit bench --profile`'s TFLOP/s): each product of
/// the chunked scan once per chunk and head (C·Bᵀ per group), a last partial chunk counted
/// whole; none without Mamba layers.
#[test]
fn mamba_flops_count_each_chunk_product() {
    use crate::config::{HybridConfig, MixerKind};
    let s = spec(|c| {
        llama(c);
        c.model.n_layer = 2;
        c.model.hybrid = Some(HybridConfig {
            layers: vec![MixerKind::Mamba, MixerKind::Attention],
            mamba_n_heads: 6,
            mamba_n_groups: 2,
            mamba_d_head: 32,
            mamba_d_state: 16,
            ..HybridConfig::default()
        });
    });
    let f = s.mamba_flops(130, 64).expect("a Mamba layer");
    // 3 chunks of 64 (the last one partial), 6 heads, 2 groups; P 32, S 16.
    let (heads, groups) = (3.0 * 6.0, 3.0 * 2.0);
    assert_eq!(
        f.scan,
        heads * 2.0 * (64.0 * 64.0 * 32.0 + 64.0 * 16.0 * 32.0)
    );
    assert_eq!(f.chunk_state, heads * 2.0 * 64.0 * 32.0 * 16.0);
    assert_eq!(f.cb, groups * 2.0 * 64.0 * 64.0 * 16.0);
    assert_eq!(
        f.scan_bwd,
        heads * 2.0 * (2.0 * 64.0 * 64.0 * 48.0 + 64.0 * 32.0 * 16.0)
    );
    assert_eq!(f.walk_bwd, f.chunk_state);
    assert_eq!(f.chunk_state_bwd, 2.0 * f.chunk_state);
    assert_eq!(f.times(2.0).scan, 2.0 * f.scan);
    assert!(spec(llama).mamba_flops(130, 64).is_none());
}

/// A batched generation's row grows by every attention layer's keys and values per column
/// (and its mask, position and RoPE entries), by its prompt's activations per prompt token,
/// and a Mamba layer adds a fixed state instead of columns.
#[test]
fn a_decoding_row_s_bytes_follow_its_cache_and_prompt() {
    let l = spec(llama);
    let (hd, kv) = (l.head_dim() as u64, l.n_kv_head as u64);
    let per_column = l.n_layer as u64 * 2 * kv * hd * 2 + (2 + 4 + 2 * hd * 2);
    assert_eq!(
        l.decode_bytes_per_row(16, 101, 2) - l.decode_bytes_per_row(16, 100, 2),
        per_column
    );
    assert!(l.decode_bytes_per_row(17, 100, 2) > l.decode_bytes_per_row(16, 100, 2));
    assert!(l.decode_bytes_per_row(16, 100, 4) > l.decode_bytes_per_row(16, 100, 2));
    let hybrid = spec(hybrid);
    let one_layer = 2 * kv * hd * 2 + (2 + 4 + 2 * hd * 2);
    assert_eq!(
        hybrid.decode_bytes_per_row(16, 101, 2) - hybrid.decode_bytes_per_row(16, 100, 2),
        one_layer
    );
    // Two Mamba layers' f32 states (8 heads × 64 × 128), twice each, at least.
    assert!(hybrid.decode_bytes_per_row(16, 100, 2) > 2 * 2 * 8 * 64 * 128 * 4);
}
