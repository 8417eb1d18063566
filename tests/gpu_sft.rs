//! Packed instruction rows on the GPU's per-op path (bf16, fused linear and cross-entropy
//! kernels) against the f32 CPU model run one sample at a time: the masked loss and the
//! gradients agree to bf16 precision; so do the whole-model step's on packed, masked rows, for
//! a Llama-style model and for Granite 4.0 hybrids (Mamba-2 layers whose conv and scan begin
//! again at each sample). Needs `--features cuda` and a GPU; passes with a notice without one.
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Tensor};
use cockpit::config::{Config, HybridConfig, MixerKind, ModelConfig};
use cockpit::engine::data::packing::IGNORE;
use cockpit::engine::model::{Masked, Model, ModelSpec};

/// A Llama-style model of `n_layer` layers, 128 wide (two heads of 64, GQA 2/1), T 64.
fn config(n_layer: usize) -> Config {
    Config {
        model: ModelConfig {
            n_embd: 128,
            n_head: 2,
            n_kv_head: 1,
            n_layer,
            seq_len: 64,
            ..ModelConfig::llama_family()
        },
        ..Config::default()
    }
}

fn spec() -> ModelSpec {
    ModelSpec::from_config(&config(2), 96)
}

/// spec() with one head of 128 (on Hopper the step's warp-specialized flash forward, 128
/// queries a block: a row of 160 ends inside the second block's first warpgroup).
fn spec_d128() -> ModelSpec {
    let mut c = config(2);
    c.model.n_head = 1;
    c.model.n_kv_head = 1;
    ModelSpec::from_config(&c, 96)
}

/// A Granite 4.0 hybrid on spec()'s width: Mamba-2, NoPE attention, Mamba-2 layers, the
/// Mamba layers' heads × head width, state, groups and conv taps as given.
fn hybrid_spec(heads: usize, d_head: usize, state: usize, groups: usize, conv: usize) -> ModelSpec {
    let mut c = config(3);
    c.model.hybrid = Some(HybridConfig {
        layers: vec![MixerKind::Mamba, MixerKind::Attention, MixerKind::Mamba],
        rope: false,
        mamba_n_heads: heads,
        mamba_d_head: d_head,
        mamba_d_state: state,
        mamba_n_groups: groups,
        mamba_d_conv: conv,
        mamba_chunk_size: 64,
        mamba_conv_bias: true,
        ..HybridConfig::default()
    });
    ModelSpec::from_config(&c, 96)
}

/// Sample `k` of `n` tokens, its first `masked` targets not training.
fn sample(k: usize, n: usize, masked: usize) -> (Vec<u32>, Vec<u32>) {
    let x = (0..n).map(|i| ((i * 7 + k * 11 + 1) % 96) as u32).collect();
    let y = (0..n)
        .map(|i| {
            if i < masked {
                IGNORE
            } else {
                ((i * 3 + k * 5 + 2) % 96) as u32
            }
        })
        .collect();
    (x, y)
}

/// Three samples (the first slots of each masked) packed in one row of 64, padding after.
fn samples() -> Vec<(Vec<u32>, Vec<u32>)> {
    [(20, 5), (25, 10), (12, 0)]
        .iter()
        .enumerate()
        .map(|(k, &(n, masked))| sample(k, n, masked))
        .collect()
}

/// The per-op path (for a Llama-style model and a hybrid, whose Mamba layers keep the samples
/// apart with the masks of ssd::SampleResets on the GPU).
#[test]
fn packed_rows_on_the_gpu_match_the_f32_samples_one_by_one() {
    let Ok(gpu) = Device::new_cuda(0) else {
        eprintln!("no CUDA device: skipped");
        return;
    };
    for (name, spec) in [("llama", spec()), ("hybrid", hybrid_spec(4, 32, 16, 2, 4))] {
        eprintln!("== {name}");
        packed_rows_per_op(&gpu, spec);
    }
}

fn packed_rows_per_op(gpu: &Device, spec: ModelSpec) {
    let gpu = gpu.clone();
    let cpu = Device::Cpu;
    // The same weights on both devices (the init is a function of the seed).
    let mut g = Model::new(spec.clone(), DType::BF16, &gpu, 7).unwrap();
    let mut c = Model::new(spec, DType::F32, &cpu, 7).unwrap();
    let (mut x, mut y, mut seg) = (Vec::new(), Vec::new(), Vec::new());
    for (s, (a, b)) in samples().into_iter().enumerate() {
        seg.extend(std::iter::repeat_n(s as u32, a.len()));
        x.extend(a);
        y.extend(b);
    }
    while x.len() < 64 {
        x.push(0);
        y.push(IGNORE);
        seg.push(3);
    }
    let m = Masked::new(&y, IGNORE, (1, 64), &gpu).unwrap();
    g.set_segments(Some(&seg), 1).unwrap();
    let xt = Tensor::from_vec(x, (1, 64), &gpu).unwrap();
    let packed = g.masked_loss(&xt, &m, true).unwrap();
    let grads = packed.backward().unwrap();
    let packed = packed.to_scalar::<f32>().unwrap();
    let (mut sum, mut count) = (None::<Tensor>, 0);
    for (a, b) in samples() {
        let n = a.len();
        let m = Masked::new(&b, IGNORE, (1, n), &cpu).unwrap();
        count += m.count;
        let xt = Tensor::from_vec(a, (1, n), &cpu).unwrap();
        let l = (c.masked_loss(&xt, &m, true).unwrap() * m.count as f64).unwrap();
        sum = Some(match sum {
            Some(s) => (s + l).unwrap(),
            None => l,
        });
    }
    let single = (sum.unwrap() / count as f64).unwrap();
    let ref_grads = single.backward().unwrap();
    let single = single.to_scalar::<f32>().unwrap();
    assert!(
        ((packed - single) / single).abs() < 2e-2,
        "bf16 packed {packed} vs f32 one by one {single}"
    );
    for (pg, pc) in g.params.iter().zip(&c.params) {
        let a = grads
            .get(pg.var.as_tensor())
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap();
        let a = a.to_device(&cpu).unwrap();
        let b = ref_grads.get(pc.var.as_tensor()).unwrap();
        let num = (&a - b)
            .unwrap()
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        let den = b
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        let rel = (num / den.max(1e-30)).sqrt();
        assert!(rel < 5e-2, "{}: relative gradient error {rel}", pg.name);
    }
    // The whole-model step takes masked rows, and packed ones where it has flash attention
    // (these models: head dim 64) and RoPE or none, Mamba layers too.
    let plain = g.step_plan().err();
    g.set_data_layout(true, true);
    assert_eq!(g.step_plan().err(), plain);
}

/// Two rows of 160 slots packing six samples (prompts masked, padding after) across flash
/// attention's 64-key tiles and the Mamba scan's chunks of 64 (samples starting within a chunk, one
/// at a chunk's first position, one of two tokens, shorter than the conv's window): the whole-model
/// step's loss, every gradient (each no less exact than the step's on the same samples unpacked,
/// one a row) and its eval losses against the f32 CPU model run one sample at a time, for a
/// Llama-style model (heads of 64; one head of 128) and three hybrids that take the Mamba kernels'
/// different paths (state 16 in two groups with the shared-memory conv; Granite-H's heads of 64 and
/// state 128; state 192 with a conv of 3 taps: the general conv and the chunk states' separate
/// backward). Unpacked rows (one sample and padding, no segments) give the step the same as the
/// sample alone.
#[test]
fn the_whole_step_trains_packed_masked_rows_as_the_samples_one_by_one() {
    let Ok(gpu) = Device::new_cuda(0) else {
        eprintln!("no CUDA device: skipped");
        return;
    };
    for (name, spec) in [
        ("llama", spec()),
        ("llama: one head of 128", spec_d128()),
        (
            "hybrid: 4 heads of 32, state 16, 2 groups",
            hybrid_spec(4, 32, 16, 2, 4),
        ),
        (
            "hybrid: 8 heads of 64, state 128",
            hybrid_spec(8, 64, 128, 1, 4),
        ),
        (
            "hybrid: 4 heads of 32, state 192, conv 3",
            hybrid_spec(4, 32, 192, 1, 3),
        ),
    ] {
        eprintln!("== {name}");
        packed_rows_on_the_step(&gpu, spec);
    }
}

fn packed_rows_on_the_step(gpu: &Device, mut spec: ModelSpec) {
    let gpu = gpu.clone();
    let cpu = Device::Cpu;
    let t = 160;
    spec.seq_len = t;
    let mut c = Model::new(spec.clone(), DType::F32, &cpu, 7).unwrap();
    let mut g = Model::new(spec, DType::BF16, &gpu, 7).unwrap();
    g.set_data_layout(true, true);
    let w = match g.step_plan() {
        Ok(w) => w,
        Err(why) => {
            eprintln!("the step does not run here ({why}): skipped");
            return;
        }
    };
    let mut step = cockpit::engine::kernels::ModelStep::new(&w).unwrap();
    // (length, masked prompt) of each sample, row by row.
    let layout: [&[(usize, usize)]; 2] =
        [&[(70, 5), (50, 10), (25, 0)], &[(64, 30), (2, 0), (70, 1)]];
    let (mut x, mut y, mut seg, mut samples) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut k = 0;
    for row in layout {
        let start = x.len();
        for &(n, masked) in row {
            let (a, b) = sample(k, n, masked);
            seg.extend(std::iter::repeat_n(k as u32, n));
            x.extend(&a);
            y.extend(&b);
            samples.push((start / t, a, b));
            k += 1;
        }
        while x.len() < start + t {
            x.push(0);
            y.push(IGNORE);
            seg.push(100 + k as u32);
        }
    }
    // Reference: Σ over samples of their masked CE sums over all trained targets; per row too.
    let (mut sum, mut count, mut row_sums) = (None::<Tensor>, 0, [(0.0f64, 0usize); 2]);
    for (row, a, b) in &samples {
        let n = a.len();
        let m = Masked::new(b, IGNORE, (1, n), &cpu).unwrap();
        count += m.count;
        let xt = Tensor::from_vec(a.clone(), (1, n), &cpu).unwrap();
        let l = (c.masked_loss(&xt, &m, true).unwrap() * m.count as f64).unwrap();
        row_sums[*row].0 += l.to_scalar::<f32>().unwrap() as f64;
        row_sums[*row].1 += m.count;
        sum = Some(match sum {
            Some(s) => (s + l).unwrap(),
            None => l,
        });
    }
    let single = (sum.unwrap() / count as f64).unwrap();
    let ref_grads = single.backward().unwrap();
    let single = single.to_scalar::<f32>().unwrap() as f64;
    let rows = cockpit::engine::kernels::Rows {
        inputs: &x,
        targets: &y,
        segments: Some(&seg),
        b: 2,
    };
    step.begin(false).unwrap();
    step.micro_rows(&rows, 1.0 / count as f32).unwrap();
    let loss = step.loss().unwrap();
    let e = ((loss - single) / single).abs();
    eprintln!(
        "packed rows on the step: loss {loss:.5} vs f32 one by one {single:.5} (rel {e:.1e})"
    );
    assert!(e < 1e-2, "step {loss} vs {single}");
    // Each gradient's error against the f32 samples one by one (relative, L2).
    let errors = |step: &cockpit::engine::kernels::ModelStep| -> Vec<(String, f32)> {
        g.params
            .iter()
            .zip(&c.params)
            .map(|(pg, pc)| {
                let a = step.grad_of(&pg.var).unwrap().unwrap();
                let a = a.to_dtype(DType::F32).unwrap().to_device(&cpu).unwrap();
                let b = ref_grads.get(pc.var.as_tensor()).unwrap();
                let num = (&a - b).unwrap().sqr().unwrap().sum_all().unwrap();
                let den = b.sqr().unwrap().sum_all().unwrap();
                let num = num.to_scalar::<f32>().unwrap();
                let den = den.to_scalar::<f32>().unwrap().max(1e-30);
                (pg.name.clone(), (num / den).sqrt())
            })
            .collect()
    };
    let packed = errors(&step);
    // The same samples unpacked (one a row, padded, no segments) on the same step: packing
    // may not make a gradient less exact than the step is on the samples alone.
    let (mut xu, mut yu) = (Vec::new(), Vec::new());
    for (_, a, b) in &samples {
        xu.extend(a);
        yu.extend(b);
        xu.resize(xu.len().next_multiple_of(t), 0);
        yu.resize(xu.len(), IGNORE);
    }
    step.begin(false).unwrap();
    let unpacked_rows = cockpit::engine::kernels::Rows {
        inputs: &xu,
        targets: &yu,
        segments: None,
        b: samples.len(),
    };
    step.micro_rows(&unpacked_rows, 1.0 / count as f32).unwrap();
    let lu = step.loss().unwrap();
    eprintln!("the samples unpacked on the step: loss {lu:.5}");
    let unpacked = errors(&step);
    let mut rank: Vec<_> = packed.iter().zip(&unpacked).collect();
    rank.sort_by(|a, b| b.0 .1.total_cmp(&a.0 .1));
    for ((name, pe), (_, ue)) in rank.iter().take(6) {
        eprintln!("  {name}: gradient rel err packed {pe:.2e}, unpacked {ue:.2e}");
    }
    for ((name, pe), (_, ue)) in &rank {
        assert!(
            pe.is_finite() && *pe <= (2.0 * ue).max(5e-2),
            "{name}: packed rows' gradient rel err {pe} (the samples unpacked: {ue})"
        );
    }
    // Evaluation: each row's mean over its trained targets.
    let ev = step.eval_losses(&rows, false).unwrap();
    assert_eq!(ev.len(), 2);
    for (r, (s, n)) in row_sums.iter().enumerate() {
        let want = s / *n as f64;
        assert!(
            ((ev[r] - want) / want).abs() < 1e-2,
            "row {r}: eval {} vs {want}",
            ev[r]
        );
    }
    // One unpacked row (a sample, then padding that trains nothing) without segments: the
    // step's loss is the sample's alone.
    let (_, a, b) = &samples[3];
    let (mut x1, mut y1) = (a.clone(), b.clone());
    x1.resize(t, 0);
    y1.resize(t, IGNORE);
    let m = Masked::new(b, IGNORE, (1, a.len()), &cpu).unwrap();
    let xt = Tensor::from_vec(a.clone(), (1, a.len()), &cpu).unwrap();
    let want = c
        .masked_loss(&xt, &m, false)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap() as f64;
    step.begin(false).unwrap();
    let one = cockpit::engine::kernels::Rows {
        inputs: &x1,
        targets: &y1,
        segments: None,
        b: 1,
    };
    step.micro_rows(&one, 1.0 / m.count as f32).unwrap();
    let got = step.loss().unwrap();
    assert!(
        ((got - want) / want).abs() < 1e-2,
        "unpacked row {got} vs {want}"
    );
}
