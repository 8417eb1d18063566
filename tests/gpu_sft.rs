//! Packed instruction rows on the GPU's per-op path (bf16, fused linear and cross-entropy
//! kernels) against the f32 CPU model run one sample at a time: the masked loss and the
//! gradients agree to bf16 precision; the whole-model step declines packed/masked data with
//! its reason. Needs `--features cuda` and a GPU; passes with a notice without one.
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Tensor};
use cockpit::config::{Config, ModelConfig};
use cockpit::engine::data::packing::IGNORE;
use cockpit::engine::model::{Masked, Model, ModelSpec, Reason};

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

/// Three samples (the first slots of each masked) packed in one row of 64, padding after.
fn samples() -> Vec<(Vec<u32>, Vec<u32>)> {
    [(20, 5), (25, 10), (12, 0)]
        .iter()
        .enumerate()
        .map(|(k, &(n, masked))| {
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
        })
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
    // The whole-model step does not take packed or masked rows yet, and says so.
    let plain = g.step_plan().err();
    g.set_data_layout(true, true);
    let why = g.step_plan().err();
    match plain {
        None => assert_eq!(why, Some(Reason::PackedSamples)),
        Some(_) => assert_eq!(why, plain, "another reason comes first"),
    }
    g.set_data_layout(true, false);
    if plain.is_none() {
        assert_eq!(g.step_plan().err(), Some(Reason::LossMask));
    }
}
