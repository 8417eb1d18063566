//! Packed instruction rows on the GPU's per-op path (bf16, fused linear and cross-entropy
//! kernels) against the f32 CPU model run one sample at a time: the masked loss and the
//! gradients agree to bf16 precision; so do the whole-model step's on packed, masked rows. Needs `--features cuda` and a GPU; passes with a notice without one.
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Tensor};
use cockpit::config::{Config, ModelConfig};
use cockpit::engine::data::packing::IGNORE;
use cockpit::engine::model::{Masked, Model, ModelSpec};

fn spec() -> ModelSpec {
    let c = Config {
        model: ModelConfig {
            n_embd: 128,
            n_head: 2,
            n_kv_head: 1,
            n_layer: 2,
            seq_len: 64,
            ..ModelConfig::llama_family()
        },
        ..Config::default()
    };
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

#[test]
fn packed_rows_on_the_gpu_match_the_f32_samples_one_by_one() {
    let Ok(gpu) = Device::new_cuda(0) else {
        eprintln!("no CUDA device: skipped");
        return;
    };
    let cpu = Device::Cpu;
    // The same weights on both devices (the init is a function of the seed).
    let mut g = Model::new(spec(), DType::BF16, &gpu, 7).unwrap();
    let mut c = Model::new(spec(), DType::F32, &cpu, 7).unwrap();
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
    // and RoPE (this model: head dim 64).
    let plain = g.step_plan().err();
    g.set_data_layout(true, true);
    assert_eq!(g.step_plan().err(), plain);
}

/// Two rows of 160 slots packing five samples (prompts masked, padding after), across flash
/// attention's 64-key tiles: the whole-model step's loss, every gradient and its eval losses
/// against the f32 CPU model run one sample at a time. Unpacked rows (one sample and padding,
/// no segments) give the step the same as the sample alone.
#[test]
fn the_whole_step_trains_packed_masked_rows_as_the_samples_one_by_one() {
    let Ok(gpu) = Device::new_cuda(0) else {
        eprintln!("no CUDA device: skipped");
        return;
    };
    let cpu = Device::Cpu;
    let t = 160;
    let mut spec = spec();
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
    let layout: [&[(usize, usize)]; 2] = [&[(70, 5), (50, 10), (25, 0)], &[(100, 30), (60, 1)]];
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
    let mut worst = (0f32, String::new());
    for (pg, pc) in g.params.iter().zip(&c.params) {
        let a = step.grad_of(&pg.var).unwrap().unwrap();
        let a = a.to_dtype(DType::F32).unwrap().to_device(&cpu).unwrap();
        let b = ref_grads.get(pc.var.as_tensor()).unwrap();
        let num = (&a - b).unwrap().sqr().unwrap().sum_all().unwrap();
        let den = b.sqr().unwrap().sum_all().unwrap();
        let rel =
            (num.to_scalar::<f32>().unwrap() / den.to_scalar::<f32>().unwrap().max(1e-30)).sqrt();
        if rel > worst.0 || !rel.is_finite() {
            worst = (rel, pg.name.clone());
        }
    }
    eprintln!(
        "packed rows on the step: worst gradient rel err {:.2e} ({})",
        worst.0, worst.1
    );
    assert!(
        worst.0.is_finite() && worst.0 < 5e-2,
        "{}: {}",
        worst.1,
        worst.0
    );
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
