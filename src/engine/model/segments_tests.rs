//! Packed rows against the samples run one by one: the same loss, gradients and logits.

use super::*;
use crate::config::{Config, ModelConfig};
use crate::engine::data::packing::IGNORE;

/// A small model of each family: GPT-2 style (learned positions), Llama style (RoPE, GQA) and
/// Granite-4.0-H style hybrids (Mamba-2 layers beside NoPE attention), their scan in chunks of
/// 4 (samples start inside chunks, at their edges and span several) and of 16 (one chunk a
/// row), two groups of B and C.
fn models() -> Vec<Model> {
    let mut gpt = Config::default();
    gpt.model.n_embd = 32;
    gpt.model.seq_len = 16;
    let llama = Config {
        model: ModelConfig {
            n_embd: 32,
            n_head: 4,
            n_kv_head: 2,
            n_layer: 2,
            seq_len: 16,
            ..ModelConfig::llama_family()
        },
        ..Config::default()
    };
    let hybrid = |chunk: usize| {
        use crate::config::{HybridConfig, MixerKind};
        let mut c = llama.clone();
        c.model.n_layer = 3;
        c.model.hybrid = Some(HybridConfig {
            layers: vec![MixerKind::Mamba, MixerKind::Attention, MixerKind::Mamba],
            mamba_n_heads: 4,
            mamba_d_head: 8,
            mamba_d_state: 8,
            mamba_n_groups: 2,
            mamba_chunk_size: chunk,
            ..HybridConfig::default()
        });
        c
    };
    [gpt, llama.clone(), hybrid(4), hybrid(16)]
        .iter()
        .map(|c| Model::new(ModelSpec::from_config(c, 40), DType::F32, &Device::Cpu, 5).unwrap())
        .collect()
}

/// Samples (inputs, targets with IGNORE) of lengths 5, 7 and 3: the first slots of each
/// masked (a prompt), packed in one row of 16 with one slot of padding.
fn samples() -> Vec<(Vec<u32>, Vec<u32>)> {
    [(5, 2), (7, 3), (3, 0)]
        .iter()
        .enumerate()
        .map(|(k, &(n, masked))| {
            let x: Vec<u32> = (0..n).map(|i| ((i * 7 + k * 11 + 1) % 40) as u32).collect();
            let y: Vec<u32> = (0..n)
                .map(|i| {
                    if i < masked {
                        IGNORE
                    } else {
                        ((i * 3 + k * 5 + 2) % 40) as u32
                    }
                })
                .collect();
            (x, y)
        })
        .collect()
}

fn packed_row() -> (Vec<u32>, Vec<u32>, Vec<u32>) {
    let (mut x, mut y, mut seg) = (Vec::new(), Vec::new(), Vec::new());
    for (s, (a, b)) in samples().into_iter().enumerate() {
        seg.extend(std::iter::repeat_n(s as u32, a.len()));
        x.extend(a);
        y.extend(b);
    }
    while x.len() < 16 {
        x.push(0);
        y.push(IGNORE);
        seg.push(3);
    }
    (x, y, seg)
}

fn grads_of(m: &Model, loss: &Tensor) -> Vec<Tensor> {
    let g = loss.backward().unwrap();
    m.params
        .iter()
        .map(|p| g.get(p.var.as_tensor()).unwrap().clone())
        .collect()
}

fn rel(a: &Tensor, b: &Tensor) -> f32 {
    let d = (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    let s = b
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    d / s.max(1e-12)
}

#[test]
fn packed_loss_and_every_gradient_equal_the_samples_run_one_by_one() {
    let dev = Device::Cpu;
    for mut m in models() {
        let (x, y, seg) = packed_row();
        let mk = Masked::new(&y, IGNORE, (1, 16), &dev).unwrap();
        m.set_segments(Some(&seg), 1).unwrap();
        let xt = Tensor::from_vec(x, (1, 16), &dev).unwrap();
        let packed = m.masked_loss(&xt, &mk, true).unwrap();
        m.set_segments(None, 1).unwrap();
        let packed_grads = grads_of(&m, &packed);
        // One by one, unpadded: Σ over samples of their masked CE sums, over all trained.
        let mut sum: Option<Tensor> = None;
        let mut count = 0;
        for (a, b) in samples() {
            let n = a.len();
            let mk = Masked::new(&b, IGNORE, (1, n), &dev).unwrap();
            count += mk.count;
            let xt = Tensor::from_vec(a, (1, n), &dev).unwrap();
            let l = (m.masked_loss(&xt, &mk, true).unwrap() * mk.count as f64).unwrap();
            sum = Some(match sum {
                Some(s) => (s + l).unwrap(),
                None => l,
            });
        }
        let single = (sum.unwrap() / count as f64).unwrap();
        let (p, s) = (
            packed.to_scalar::<f32>().unwrap(),
            single.to_scalar::<f32>().unwrap(),
        );
        assert!(((p - s) / s).abs() <= 1e-5, "{:?}: {p} vs {s}", m.spec.pos);
        for ((g, h), par) in packed_grads
            .iter()
            .zip(grads_of(&m, &single))
            .zip(&m.params)
        {
            let r = rel(g, &h);
            assert!(r <= 1e-5, "{:?} {}: rel {r}", m.spec.pos, par.name);
        }
    }
}

#[test]
fn a_samples_logits_do_not_change_with_another_packed_beside_it() {
    let dev = Device::Cpu;
    for mut m in models() {
        let (a, _) = &samples()[1];
        let alone = m
            .forward(
                &Tensor::from_vec(a.clone(), (1, a.len()), &dev).unwrap(),
                false,
            )
            .unwrap();
        // After another sample of 5 slots, in a row of 16.
        let mut x: Vec<u32> = (0..5).map(|i| (i * 13 % 40) as u32).collect();
        x.extend(a);
        let mut seg = vec![0u32; 5];
        seg.extend(std::iter::repeat_n(1, a.len()));
        while x.len() < 16 {
            x.push(9);
            seg.push(2);
        }
        m.set_segments(Some(&seg), 1).unwrap();
        let both = m
            .forward(&Tensor::from_vec(x, (1, 16), &dev).unwrap(), false)
            .unwrap();
        m.set_segments(None, 1).unwrap();
        let mine = both.narrow(0, 5, a.len()).unwrap();
        assert!(rel(&mine, &alone) <= 1e-5, "{:?}", m.spec.pos);
    }
}

#[test]
fn the_masked_loss_is_the_mean_over_the_targets_that_train() {
    let dev = Device::Cpu;
    let mut m = models().remove(1);
    let (x, y, _) = packed_row();
    let xt = Tensor::from_vec(x, (1, 16), &dev).unwrap();
    let logits = m.forward(&xt, false).unwrap().to_vec2::<f32>().unwrap();
    // By hand: −log softmax at each trained target, averaged over those.
    let (mut sum, mut n) = (0.0f64, 0);
    for (row, &t) in logits.iter().zip(&y) {
        if t == IGNORE {
            continue;
        }
        let mx = row.iter().cloned().fold(f32::MIN, f32::max) as f64;
        let lse = mx + row.iter().map(|&v| (v as f64 - mx).exp()).sum::<f64>().ln();
        sum += lse - row[t as usize] as f64;
        n += 1;
    }
    let mk = Masked::new(&y, IGNORE, (1, 16), &dev).unwrap();
    assert_eq!(mk.count, n);
    let got = m
        .masked_loss(&xt, &mk, false)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap() as f64;
    assert!(
        (got - sum / n as f64).abs() < 1e-5,
        "{got} vs {}",
        sum / n as f64
    );
    assert_eq!(positions(&[0, 0, 0, 1, 1, 2], 6), vec![0, 1, 2, 0, 1, 0]);
}
