//! The fused CUDA kernels against the plain candle composition they replace: forward values
//! and gradients, in f32 and bf16. Needs `--features cuda` and a GPU; each test prints a
//! notice and passes when no CUDA device opens.
//!
//! Errors are reported as max|fused − plain| / max|plain| over the tensor; tolerances:
//! f32 1e-4 (2e-4 for the end-to-end model), bf16 3e-2 (one bf16 ulp is 2⁻⁸ ≈ 3.9e-3; both
//! sides round intermediate bf16 values differently).
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Tensor, Var, D};
use cockpit::config::Config;
use cockpit::engine::model::{Model, ModelSpec};
use cockpit::engine::optim::{global_norm, AdamW};
use cockpit::engine::{dropout, kernels};

/// The GPU, held by one test at a time. The tests share one CUDA device (and candle's stream
/// on it): a test capturing a CUDA graph must not see another test's launches on that stream,
/// so `cargo test` with its default parallel threads runs them one after another.
struct Gpu {
    dev: Device,
    _turn: std::sync::MutexGuard<'static, ()>,
}

impl std::ops::Deref for Gpu {
    type Target = Device;
    fn deref(&self) -> &Device {
        &self.dev
    }
}

fn gpu() -> Option<Gpu> {
    static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    // A test that failed while holding the GPU leaves nothing behind that the next one needs.
    let turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    match Device::new_cuda(0) {
        Ok(dev) => Some(Gpu { dev, _turn: turn }),
        Err(e) => {
            eprintln!("no CUDA device ({e}): GPU kernel test skipped");
            None
        }
    }
}

/// The 16-bit types the whole-model step runs in on this GPU: bf16 and fp16 from compute
/// capability 8.0, fp16 alone on compute_75 kernels (`COCKPIT_KERNELS=sm75` forces those on a
/// newer GPU, so this whole file can test the T4 build).
fn step_dtypes(dev: &Device) -> Vec<DType> {
    [DType::BF16, DType::F16]
        .into_iter()
        .filter(|&dt| kernels::step_support(dev, dt).is_ok())
        .collect()
}

/// The first of [`step_dtypes`]: bf16 where it runs, else fp16.
fn step_dtype(dev: &Device) -> DType {
    step_dtypes(dev)[0]
}

fn tol(dt: DType) -> f32 {
    match dt {
        DType::F32 => 1e-4,
        _ => 3e-2,
    }
}

/// max|a − b| (in f32)
fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    let a = a.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
    let b = b.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
    assert_eq!(a.dims(), b.dims());
    (&a - &b)
        .unwrap()
        .abs()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar()
        .unwrap()
}

/// max|a − b| / max|b|
fn rel_err(a: &Tensor, b: &Tensor) -> f32 {
    let m: f32 = b
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .abs()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar()
        .unwrap();
    max_abs_diff(a, b) / m.max(1e-20)
}

fn check(what: &str, dt: DType, fused: &Tensor, plain: &Tensor) {
    let e = rel_err(fused, plain);
    eprintln!("{what} [{dt:?}]: rel err {e:.3e} (tol {:.0e})", tol(dt));
    assert!(
        e.is_finite() && e <= tol(dt),
        "{what} [{dt:?}]: rel err {e:.3e} > {:.0e}",
        tol(dt)
    );
}

fn var(dev: &Device, dims: &[usize], dt: DType, std: f64, mean: f64) -> Var {
    let t = (Tensor::randn(0f32, 1f32, dims, dev).unwrap() * std).unwrap() + mean;
    Var::from_tensor(&t.unwrap().to_dtype(dt).unwrap()).unwrap()
}

/// A random projection of the output, so every output element carries its own gradient.
fn probe(y: &Tensor) -> (Tensor, Tensor) {
    let r = Tensor::randn(0f32, 1f32, y.dims(), y.device())
        .unwrap()
        .to_dtype(y.dtype())
        .unwrap();
    let l = (y.to_dtype(DType::F32).unwrap() * r.to_dtype(DType::F32).unwrap())
        .unwrap()
        .sum_all()
        .unwrap();
    (l, r)
}

fn loss_with(y: &Tensor, r: &Tensor) -> Tensor {
    (y.to_dtype(DType::F32).unwrap() * r.to_dtype(DType::F32).unwrap())
        .unwrap()
        .sum_all()
        .unwrap()
}

fn causal_mask(t: usize, dt: DType, dev: &Device) -> Tensor {
    let m: Vec<f32> = (0..t * t)
        .map(|i| {
            if i % t > i / t {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    Tensor::from_vec(m, (t, t), dev)
        .unwrap()
        .to_dtype(dt)
        .unwrap()
}

#[test]
fn causal_softmax_matches_masked_softmax() {
    let Some(dev) = gpu() else { return };
    for dt in [DType::F32, DType::BF16] {
        for t in [1usize, 33, 128] {
            let x = var(&dev, &[2, 3, t, t], dt, 2.0, 0.0);
            let scale = 0.125;
            let fused = kernels::causal_softmax(x.as_tensor(), scale).unwrap();
            let plain = candle_nn::ops::softmax(
                &(x.as_tensor() * scale)
                    .unwrap()
                    .broadcast_add(&causal_mask(t, dt, &dev))
                    .unwrap(),
                D::Minus1,
            )
            .unwrap();
            check(&format!("causal softmax T{t} fwd"), dt, &fused, &plain);
            let (lp, r) = probe(&plain);
            let gp = lp.backward().unwrap();
            let gf = loss_with(&fused, &r).backward().unwrap();
            check(
                &format!("causal softmax T{t} dx"),
                dt,
                gf.get(x.as_tensor()).unwrap(),
                gp.get(x.as_tensor()).unwrap(),
            );
        }
    }
}

#[test]
fn layer_norm_and_rms_norm_match_the_composition() {
    let Some(dev) = gpu() else { return };
    for dt in [DType::F32, DType::BF16] {
        for d in [96usize, 768] {
            let x = var(&dev, &[3, 37, d], dt, 2.0, 0.5);
            let w = var(&dev, &[d], dt, 0.2, 1.0);
            let b = var(&dev, &[d], dt, 0.2, 0.0);
            let eps = 1e-5;
            let fused =
                kernels::layer_norm(x.as_tensor(), w.as_tensor(), b.as_tensor(), eps).unwrap();
            let plain = candle_nn::ops::layer_norm_slow(
                x.as_tensor(),
                w.as_tensor(),
                b.as_tensor(),
                eps as f32,
            )
            .unwrap();
            check(&format!("layernorm D{d} fwd"), dt, &fused, &plain);
            let (lp, r) = probe(&plain);
            let gp = lp.backward().unwrap();
            let gf = loss_with(&fused, &r).backward().unwrap();
            for (name, v) in [("dx", &x), ("dw", &w), ("db", &b)] {
                check(
                    &format!("layernorm D{d} {name}"),
                    dt,
                    gf.get(v.as_tensor()).unwrap(),
                    gp.get(v.as_tensor()).unwrap(),
                );
            }
            let fused = kernels::rms_norm(x.as_tensor(), w.as_tensor(), eps).unwrap();
            let plain =
                candle_nn::ops::rms_norm_slow(x.as_tensor(), w.as_tensor(), eps as f32).unwrap();
            check(&format!("rmsnorm D{d} fwd"), dt, &fused, &plain);
            let (lp, r) = probe(&plain);
            let gp = lp.backward().unwrap();
            let gf = loss_with(&fused, &r).backward().unwrap();
            for (name, v) in [("dx", &x), ("dw", &w)] {
                check(
                    &format!("rmsnorm D{d} {name}"),
                    dt,
                    gf.get(v.as_tensor()).unwrap(),
                    gp.get(v.as_tensor()).unwrap(),
                );
            }
        }
    }
}

#[test]
fn cross_entropy_matches_f32_log_softmax() {
    let Some(dev) = gpu() else { return };
    for dt in [DType::F32, DType::BF16] {
        let (n, v) = (70usize, 50257usize);
        let x = var(&dev, &[n, v], dt, 3.0, 0.0);
        let t: Vec<u32> = (0..n as u32).map(|i| (i * 7919 + 13) % v as u32).collect();
        let t = Tensor::from_vec(t, n, &dev).unwrap();
        let fused = kernels::cross_entropy_rows(x.as_tensor(), &t)
            .unwrap()
            .mean_all()
            .unwrap();
        let plain =
            candle_nn::loss::cross_entropy(&x.as_tensor().to_dtype(DType::F32).unwrap(), &t)
                .unwrap();
        // The loss is an f32 reduction on both sides: hold it to f32 accuracy.
        check("cross-entropy loss", DType::F32, &fused, &plain);
        let gf = fused.backward().unwrap();
        let gp = plain.backward().unwrap();
        check(
            "cross-entropy dlogits",
            dt,
            gf.get(x.as_tensor()).unwrap(),
            gp.get(x.as_tensor()).unwrap(),
        );
        assert_eq!(gf.get(x.as_tensor()).unwrap().dtype(), dt);
    }
}

#[test]
fn bias_add_and_bias_gelu_match_the_composition() {
    let Some(dev) = gpu() else { return };
    for dt in [DType::F32, DType::BF16] {
        let x = var(&dev, &[4, 50, 96], dt, 1.5, 0.0);
        let b = var(&dev, &[96], dt, 0.5, 0.0);
        let fused = kernels::bias_gelu(x.as_tensor(), b.as_tensor()).unwrap();
        let plain = x
            .as_tensor()
            .broadcast_add(b.as_tensor())
            .unwrap()
            .gelu()
            .unwrap();
        check("bias+gelu fwd", dt, &fused, &plain);
        let (lp, r) = probe(&plain);
        let gp = lp.backward().unwrap();
        let gf = loss_with(&fused, &r).backward().unwrap();
        for (name, v) in [("dx", &x), ("db", &b)] {
            check(
                &format!("bias+gelu {name}"),
                dt,
                gf.get(v.as_tensor()).unwrap(),
                gp.get(v.as_tensor()).unwrap(),
            );
        }
        let fused = kernels::bias_add(x.as_tensor(), b.as_tensor()).unwrap();
        let plain = x.as_tensor().broadcast_add(b.as_tensor()).unwrap();
        check("bias add fwd", dt, &fused, &plain);
        let (lp, r) = probe(&plain);
        let gp = lp.backward().unwrap();
        let gf = loss_with(&fused, &r).backward().unwrap();
        for (name, v) in [("dx", &x), ("db", &b)] {
            check(
                &format!("bias add {name}"),
                dt,
                gf.get(v.as_tensor()).unwrap(),
                gp.get(v.as_tensor()).unwrap(),
            );
        }
    }
}

#[test]
fn fused_adamw_and_grad_norm_match_the_plain_optimizer() {
    let Some(dev) = gpu() else { return };
    // Several chunks of the multi-tensor kernels, lengths that are not multiples of 4.
    let shapes: [&[usize]; 4] = [&[300, 70], &[1000], &[3], &[20_001]];
    let make = |fused: bool| {
        let slots: Vec<(String, Var, bool)> = shapes
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let t = Tensor::arange(0u32, s.iter().product::<usize>() as u32, &dev)
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap()
                    .affine(0.001, -0.2)
                    .unwrap()
                    .sin()
                    .unwrap()
                    .reshape(*s)
                    .unwrap();
                (format!("p{i}"), Var::from_tensor(&t).unwrap(), i != 1)
            })
            .collect();
        let mut o = AdamW::new(slots, 0.9, 0.95, 1e-8, 0.1).unwrap();
        o.fused = fused;
        o
    };
    let (mut a, mut b) = (make(true), make(false));
    for step in 0..3 {
        let grads: Vec<Tensor> = shapes
            .iter()
            .map(|s| {
                Tensor::randn(0f32, 1f32, *s, &dev)
                    .unwrap()
                    .affine(1.0, step as f64 * 0.1)
                    .unwrap()
            })
            .collect();
        let fused_norm = global_norm(&grads).unwrap();
        let plain_norm: f64 = grads
            .iter()
            .map(|g| {
                g.sqr()
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap() as f64
            })
            .sum::<f64>()
            .sqrt();
        let e = (fused_norm - plain_norm).abs() / plain_norm;
        eprintln!("grad norm step {step}: rel err {e:.3e}");
        assert!(e < 1e-5, "grad norm {fused_norm} vs {plain_norm}");
        // Clipping folded into the update (grad scale 0.7) on both sides.
        a.step_scaled(&grads, 1e-2, 0.7).unwrap();
        b.step_scaled(&grads, 1e-2, 0.7).unwrap();
    }
    for (sa, sb) in a.slots.iter().zip(&b.slots) {
        check(
            &format!("adamw {} weights after 3 steps", sa.name),
            DType::F32,
            sa.var.as_tensor(),
            sb.var.as_tensor(),
        );
        check(&format!("adamw {} m", sa.name), DType::F32, &sa.m, &sb.m);
        check(&format!("adamw {} v", sa.name), DType::F32, &sa.v, &sb.v);
    }
}

/// The whole model, all kernels on vs all off: loss and every parameter gradient.
#[test]
fn model_with_fused_kernels_matches_the_plain_model() {
    let Some(dev) = gpu() else { return };
    for (arch, dt) in [
        ("gpt", DType::F32),
        ("gpt", DType::BF16),
        ("llama", DType::F32),
        ("llama", DType::BF16),
    ] {
        let mut c = Config::default();
        c.model.n_embd = 64;
        c.model.n_head = 4;
        c.model.n_layer = 2;
        c.model.seq_len = 48;
        if arch == "llama" {
            c.model.norm = cockpit::config::Norm::RmsNorm;
            c.model.pos = cockpit::config::PosEncoding::Rope;
            c.model.activation = cockpit::config::Activation::SwiGlu;
            c.model.bias = false;
            c.model.tie_embeddings = false;
        } else {
            c.model.bias = true;
        }
        c.model.dropout = 0.0;
        let vocab = 97;
        let run = |on: bool| {
            let mut c = c.clone();
            c.kernels.norm = on;
            c.kernels.attention = on;
            c.kernels.linear = on;
            c.kernels.cross_entropy = on;
            c.kernels.bias_gelu = on;
            let mut m = Model::new(ModelSpec::from_config(&c, vocab), dt, &dev, 5).unwrap();
            let ids: Vec<u32> = (0..3 * 48).map(|i| (i * 31 + 7) % vocab as u32).collect();
            let tg: Vec<u32> = (0..3 * 48).map(|i| (i * 17 + 3) % vocab as u32).collect();
            let x = Tensor::from_vec(ids, (3, 48), &dev).unwrap();
            let y = Tensor::from_vec(tg, (3, 48), &dev).unwrap();
            let loss = m.loss(&x, &y, true).unwrap();
            let store = loss.backward().unwrap();
            let grads: Vec<(String, Tensor)> = m
                .params
                .iter()
                .map(|p| {
                    (
                        p.name.clone(),
                        store.get(p.var.as_tensor()).unwrap().clone(),
                    )
                })
                .collect();
            (loss, grads)
        };
        let (lf, gf) = run(true);
        let (lp, gp) = run(false);
        let t = if dt == DType::F32 { 2e-4 } else { 3e-2 };
        let e = rel_err(&lf, &lp);
        eprintln!("model {arch} [{dt:?}] loss rel err {e:.3e}");
        assert!(e <= t, "model {arch} [{dt:?}] loss rel err {e:.3e}");
        let mut worst = (0f32, String::new());
        for ((name, a), (_, b)) in gf.iter().zip(&gp) {
            let e = rel_err(a, b);
            if e > worst.0 || !e.is_finite() {
                worst = (e, name.clone());
            }
        }
        // bf16 gradients of whole layers accumulate many rounding differences: WHOLE_GRAD_TOL.
        let tg = if dt == DType::F32 {
            2e-4
        } else {
            WHOLE_GRAD_TOL
        };
        eprintln!(
            "model {arch} [{dt:?}] worst grad rel err {:.3e} ({})",
            worst.0, worst.1
        );
        assert!(
            worst.0.is_finite() && worst.0 <= tg,
            "model {arch} [{dt:?}] grad {} rel err {:.3e}",
            worst.1,
            worst.0
        );
    }
}

#[test]
fn fused_linear_region_matches_matmul_plus_bias() {
    let Some(dev) = gpu() else { return };
    for dt in [DType::F32, DType::BF16] {
        let x = var(&dev, &[3, 40, 96], dt, 1.0, 0.0);
        let w = var(&dev, &[80, 96], dt, 0.1, 0.0);
        let b = var(&dev, &[80], dt, 0.1, 0.0);
        let fused = kernels::linear(x.as_tensor(), w.as_tensor(), Some(b.as_tensor())).unwrap();
        let plain = x
            .as_tensor()
            .broadcast_matmul(&w.as_tensor().t().unwrap())
            .unwrap()
            .broadcast_add(b.as_tensor())
            .unwrap();
        check("linear fwd", dt, &fused, &plain);
        let (lp, r) = probe(&plain);
        let gp = lp.backward().unwrap();
        let gf = loss_with(&fused, &r).backward().unwrap();
        for (name, v) in [("dx", &x), ("dw", &w), ("db", &b)] {
            check(
                &format!("linear {name}"),
                dt,
                gf.get(v.as_tensor()).unwrap(),
                gp.get(v.as_tensor()).unwrap(),
            );
        }
        let fused = kernels::linear(x.as_tensor(), w.as_tensor(), None).unwrap();
        let plain = x
            .as_tensor()
            .broadcast_matmul(&w.as_tensor().t().unwrap())
            .unwrap();
        check("linear (no bias) fwd", dt, &fused, &plain);
    }
}

#[test]
fn fused_attention_region_matches_the_composition() {
    let Some(dev) = gpu() else { return };
    let (b, t, h, hd) = (2usize, 33usize, 4usize, 16usize);
    let c = h * hd;
    for dt in [DType::F32, DType::BF16] {
        let qkv = var(&dev, &[b, t, 3 * c], dt, 1.0, 0.0);
        let scale = 1.0 / (hd as f64).sqrt();
        let fused = kernels::causal_attention_qkv(qkv.as_tensor(), h, scale).unwrap();
        let split = |i: usize| {
            qkv.as_tensor()
                .narrow(2, i * c, c)
                .unwrap()
                .reshape((b, t, h, hd))
                .unwrap()
                .transpose(1, 2)
                .unwrap()
                .contiguous()
                .unwrap()
        };
        let (q, k, v) = (split(0), split(1), split(2));
        let att = (q.matmul(&k.t().unwrap()).unwrap() * scale)
            .unwrap()
            .broadcast_add(&causal_mask(t, dt, &dev))
            .unwrap();
        let p = candle_nn::ops::softmax(&att, D::Minus1).unwrap();
        let plain = p
            .matmul(&v)
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .reshape((b, t, c))
            .unwrap();
        check("attention fwd", dt, &fused, &plain);
        let (lp, r) = probe(&plain);
        let gp = lp.backward().unwrap();
        let gf = loss_with(&fused, &r).backward().unwrap();
        check(
            "attention dqkv",
            dt,
            gf.get(qkv.as_tensor()).unwrap(),
            gp.get(qkv.as_tensor()).unwrap(),
        );
    }
}

/// The multi-tensor copy (ZeRO-1's gathered weights into the parameters and back): every pair
/// copied exactly, views at an offset included, nothing outside them touched.
#[test]
fn multi_tensor_copy_copies_every_pair_exactly() {
    let Some(dev) = gpu() else { return };
    let flat = Tensor::randn(0f32, 1.0, 10_000, &dev).unwrap();
    let a = Tensor::zeros((30, 7), DType::F32, &dev).unwrap();
    let b = Tensor::zeros(5000, DType::F32, &dev).unwrap();
    let (src_a, src_b) = (
        flat.narrow(0, 13, 210).unwrap(),
        flat.narrow(0, 4000, 5000).unwrap(),
    );
    let src_a2 = src_a.reshape((30, 7)).unwrap();
    kernels::copy_multi(&[(&src_a2, &a), (&src_b, &b)]).unwrap();
    let same = |x: &Tensor, y: &Tensor| {
        x.flatten_all().unwrap().to_vec1::<f32>().unwrap()
            == y.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    };
    assert!(same(&a, &src_a2) && same(&b, &src_b));
    // Back into the buffer at an offset, beside values that must stay.
    let before = flat.to_vec1::<f32>().unwrap();
    let ones = Tensor::ones(100, DType::F32, &dev).unwrap();
    let dst = flat.narrow(0, 500, 100).unwrap();
    kernels::copy_multi(&[(&ones, &dst)]).unwrap();
    let after = flat.to_vec1::<f32>().unwrap();
    for (i, (x, y)) in before.iter().zip(&after).enumerate() {
        let want = if (500..600).contains(&i) { 1.0 } else { *x };
        assert_eq!(*y, want, "element {i}");
    }
}

/// bf16 gradient sums (`distributed.reduce_dtype = "bf16"`): packing f32 into bf16 rounds as
/// candle's cast does (to nearest even) and unpacking widens exactly, on aligned buffers (four
/// values a thread) and on views at odd offsets and lengths (one a thread); nothing outside
/// the view is touched.
#[test]
fn bf16_gradient_packing_rounds_like_a_cast_and_widens_exactly() {
    let Some(dev) = gpu() else { return };
    let flat = (Tensor::randn(0f32, 1.0, 100_003, &dev).unwrap() * 1e-3).unwrap();
    let wire = Tensor::zeros(100_003, DType::BF16, &dev).unwrap();
    for (off, len) in [(0, 100_000), (0, 100_003), (13, 50_001), (3, 7)] {
        let (src, dst) = (
            flat.narrow(0, off, len).unwrap(),
            wire.narrow(0, off, len).unwrap(),
        );
        kernels::convert_into(&src, &dst).unwrap();
        let want = src
            .to_dtype(DType::BF16)
            .unwrap()
            .to_vec1::<half::bf16>()
            .unwrap();
        assert_eq!(
            dst.to_vec1::<half::bf16>().unwrap(),
            want,
            "pack at {off}+{len}"
        );
        let back = Tensor::zeros(100_003, DType::F32, &dev).unwrap();
        kernels::convert_into(&dst, &back.narrow(0, off, len).unwrap()).unwrap();
        let got = back.to_vec1::<f32>().unwrap();
        for (i, x) in got.iter().enumerate() {
            let w = if (off..off + len).contains(&i) {
                want[i - off].to_f32()
            } else {
                0.0
            };
            assert_eq!(*x, w, "unpack at {off}+{len}: element {i}");
        }
    }
}

#[test]
fn fused_sum_of_squares_matches_sqr_sum() {
    let Some(dev) = gpu() else { return };
    let w = var(&dev, &[1000, 37], DType::F32, 1.0, 0.3);
    let fused = kernels::sum_sq(w.as_tensor()).unwrap();
    let plain = w.as_tensor().sqr().unwrap().sum_all().unwrap();
    check("sum of squares", DType::F32, &fused, &plain);
    let gf = (fused * 0.5).unwrap().backward().unwrap();
    let gp = (plain * 0.5).unwrap().backward().unwrap();
    check(
        "sum of squares grad",
        DType::F32,
        gf.get(w.as_tensor()).unwrap(),
        gp.get(w.as_tensor()).unwrap(),
    );
}

#[test]
fn fused_embedding_matches_index_select() {
    let Some(dev) = gpu() else { return };
    for dt in [DType::F32, DType::BF16] {
        let w = var(&dev, &[500, 64], dt, 1.0, 0.0);
        // Repeated ids: their gradient rows must accumulate.
        let ids: Vec<u32> = (0..2 * 77).map(|i| (i * i * 7 + 3) % 500).collect();
        let ids = Tensor::from_vec(ids, (2, 77), &dev).unwrap();
        let fused = kernels::embedding(&ids, w.as_tensor()).unwrap();
        let plain = w
            .as_tensor()
            .embedding(&ids.flatten_all().unwrap())
            .unwrap()
            .reshape((2, 77, 64))
            .unwrap();
        check("embedding fwd", dt, &fused, &plain);
        let (lp, r) = probe(&plain);
        let gp = lp.backward().unwrap();
        let gf = loss_with(&fused, &r).backward().unwrap();
        check(
            "embedding dw",
            dt,
            gf.get(w.as_tensor()).unwrap(),
            gp.get(w.as_tensor()).unwrap(),
        );
    }
}

#[test]
fn fused_lm_head_cross_entropy_matches_matmul_then_ce() {
    let Some(dev) = gpu() else { return };
    for dt in [DType::F32, DType::BF16] {
        let (n, d, v) = (96usize, 64usize, 5000usize);
        let x = var(&dev, &[n, d], dt, 1.0, 0.0);
        let head = var(&dev, &[v, d], dt, 0.3, 0.0);
        let t: Vec<u32> = (0..n as u32).map(|i| (i * 613 + 5) % v as u32).collect();
        let t = Tensor::from_vec(t, n, &dev).unwrap();
        let fused = kernels::lm_head_cross_entropy(x.as_tensor(), head.as_tensor(), &t)
            .unwrap()
            .mean_all()
            .unwrap();
        let logits = x
            .as_tensor()
            .matmul(&head.as_tensor().t().unwrap())
            .unwrap();
        let plain =
            candle_nn::loss::cross_entropy(&logits.to_dtype(DType::F32).unwrap(), &t).unwrap();
        check("lm-head CE loss", dt, &fused, &plain);
        let gf = fused.backward().unwrap();
        let gp = plain.backward().unwrap();
        for (name, w) in [("dx", &x), ("dhead", &head)] {
            check(
                &format!("lm-head CE {name}"),
                dt,
                gf.get(w.as_tensor()).unwrap(),
                gp.get(w.as_tensor()).unwrap(),
            );
        }
    }
}

/// A dense Granite 4.0 hybrid (granite-4.0-h's block on a small scale): 4 layers of which 3
/// Mamba-2 (4 heads × 32, state 16, 2 groups, conv 4 with its bias, no projection biases) and
/// one attention layer without position encoding (NoPE, GQA 2/1, head dim 64 over n_embd 128),
/// the shared SwiGLU MLP, RMSNorm, Granite's multipliers, T 200 (not a multiple of the scan's
/// chunks of 64).
fn granite_hybrid(c: &mut Config) {
    use cockpit::config::{HybridConfig, MixerKind::Attention, MixerKind::Mamba};
    c.model.norm = cockpit::config::Norm::RmsNorm;
    c.model.activation = cockpit::config::Activation::SwiGlu;
    c.model.pos = cockpit::config::PosEncoding::Rope;
    c.model.bias = false;
    c.model.mlp_ratio = 2.75;
    c.model.n_layer = 4;
    c.model.n_embd = 128;
    c.model.n_head = 2;
    c.model.n_kv_head = 1;
    c.model.seq_len = 200;
    c.model.embedding_multiplier = 12.0;
    // (1/8 rather than Granite 4.0's 1/head_dim: at this init, scores scaled by 1/64 leave the
    // attention uniform and q's and k's gradients at rounding level, which fp16 cannot check.)
    c.model.attention_multiplier = 0.125;
    c.model.residual_multiplier = 0.22;
    c.model.logits_scaling = 8.0;
    c.model.hybrid = Some(HybridConfig {
        layers: vec![Mamba, Attention, Mamba, Mamba],
        rope: false,
        mamba_n_heads: 4,
        mamba_d_head: 32,
        mamba_d_state: 16,
        mamba_n_groups: 2,
        mamba_d_conv: 4,
        mamba_chunk_size: 64,
        mamba_conv_bias: true,
        mamba_proj_bias: false,
        ..HybridConfig::default()
    });
}

/// [`granite_hybrid`] with routed experts in every layer: 8 experts of width 64, two a token,
/// the load-balancing loss × 0.01 in the training loss ([`separate_routes`] sets the weights).
fn granite_hybrid_moe(c: &mut Config) {
    granite_hybrid(c);
    if let Some(h) = c.model.hybrid.as_mut() {
        h.experts = 8;
        h.experts_top_k = 2;
        h.expert_hidden = 64;
        h.router_aux_loss_coef = 0.01;
    }
}

/// Routes that 16-bit rounding cannot flip, for a model with routed experts (nothing
/// otherwise): embedding columns 0 and 1 carry ±0.1 by the token id's parity and its second
/// bit, column 2 carries 0.1 (the residual stream keeps them: the normed input's x₀, x₁ ≈ ±3.4,
/// x₂ ≈ 3.4), and router row e reads them with weights ±0.3 by e's bits 2 and 1 and −0.6 —
/// so a token's two experts score about 0 and the rest −2 or −4, while the random columns vary
/// the logits by about 0.2 (the pair's weights still differ per token). A flipped route would
/// move one token's whole contribution between two experts' gradients: the step and the f32
/// model must take the same ones. (The chosen logits near 0: the step rounds the logits to 16
/// bits as the 16-bit models do, which near 0 moves them by far less than the random part.)
fn separate_routes(m: &Model) {
    if !m.params.iter().any(|p| p.name.ends_with("router.weight")) {
        return;
    }
    for p in &m.params {
        let t = p.var.as_tensor();
        let dims = t.dims().to_vec();
        let embed = p.name == "model.embed_tokens.weight";
        if !(embed || p.name.ends_with("router.weight")) {
            continue;
        }
        let mut v: Vec<f32> = t
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let cols = dims[1];
        for (r, row) in v.chunks_mut(cols).enumerate() {
            let sign = |bit: usize| if r >> bit & 1 == 0 { 1f32 } else { -1.0 };
            if embed {
                (row[0], row[1], row[2]) = (0.1 * sign(0), 0.1 * sign(1), 0.1);
            } else {
                (row[0], row[1], row[2]) = (0.3 * sign(2), 0.3 * sign(1), -0.6);
            }
        }
        let new = Tensor::from_vec(v, dims, t.device())
            .unwrap()
            .to_dtype(t.dtype())
            .unwrap();
        p.var.set(&new).unwrap();
    }
}

/// `n` token ids and next-token targets below `vocab`, varied by `k` (the step tests' batches).
fn batch_ids(n: usize, vocab: usize, k: u32) -> (Vec<u32>, Vec<u32>) {
    let ids = (0..n as u32).map(|i| (i * 31 + 7 * k) % vocab as u32);
    let tg = (0..n as u32).map(|i| (i * 17 + 3 + k) % vocab as u32);
    (ids.collect(), tg.collect())
}

/// A model family for the whole-model step test: what it sets on the default config.
struct Family {
    name: &'static str,
    vocab: usize,
    set: fn(&mut Config),
}

/// The model families of the whole-model step tests: every switch the step takes.
fn step_families() -> Vec<Family> {
    // (COCKPIT_FAMILY=text: only the families whose name contains it.)
    let only = std::env::var("COCKPIT_FAMILY").unwrap_or_default();
    let mut all = every_step_family();
    all.retain(|f| f.name.contains(&only));
    all
}

/// [`step_families`], unfiltered.
fn every_step_family() -> Vec<Family> {
    use cockpit::config::{
        Activation::SwiGlu,
        LayerKind::{Full, Sliding},
        Norm::RmsNorm,
        PosEncoding::{Learned, Rope},
    };
    fn llama(c: &mut Config) {
        c.model.norm = RmsNorm;
        c.model.activation = SwiGlu;
        c.model.pos = Rope;
        c.model.bias = false;
        c.model.mlp_ratio = 2.75;
    }
    fn granite(c: &mut Config) {
        llama(c);
        c.model.n_embd = 256;
        c.model.n_head = 4;
        c.model.n_kv_head = 2;
        c.model.embedding_multiplier = 12.0;
        c.model.attention_multiplier = 0.0078125;
        c.model.residual_multiplier = 0.22;
        c.model.logits_scaling = 8.0;
    }
    // Gemma 3's block: every norm scales by 1 + w, sandwich norms on the attention and MLP
    // outputs, a GeGLU MLP, QK-norm, the embedding × √C, query_pre_attn_scalar's score scale,
    // a sliding layer with its own RoPE θ beside a full one.
    fn gemma3(c: &mut Config) {
        llama(c);
        c.model.activation = cockpit::config::Activation::GeGlu;
        c.model.seq_len = 200;
        c.model.rope_theta = 1_000_000.0;
        c.model.embedding_multiplier = (c.model.n_embd as f64).sqrt();
        c.model.attention_multiplier = 0.0625;
        let l = &mut c.model.layout;
        l.qk_norm = cockpit::config::QkNorm::Head;
        l.sandwich_norm = true;
        l.norm_plus_one = true;
        l.layer_types = vec![Sliding, Full];
        l.window = 70;
        l.local_rope_theta = 10_000.0;
    }
    // Gemma 2's: Gemma 3's block without QK-norm or a local θ, 4 heads sharing 2 key/value
    // heads, soft-caps small enough to bend these tiny models' scores (1) and logits (2).
    fn gemma2(c: &mut Config) {
        gemma3(c);
        c.model.n_head = 4;
        c.model.n_kv_head = 2;
        let l = &mut c.model.layout;
        l.qk_norm = cockpit::config::QkNorm::None;
        l.local_rope_theta = 0.0;
        l.attn_softcap = 1.0;
        l.final_softcap = 2.0;
    }
    // Head dim 32 materialises the attention probabilities; head dims 64, 128 and 256 take
    // flash attention. T = 80 is not a multiple of flash attention's 64-row tiles.
    // Width 640 takes the LayerNorm kernels' three-chunk rows with half-empty last chunks.
    // A vocabulary of 60001 takes the cross-entropy kernel that reads each row twice (rows
    // up to 53248 wide stay in registers).
    vec![
        Family {
            name: "gpt: tied, learned positions, 4 heads (materialised)",
            vocab: 97,
            set: |c| {
                c.model.pos = Learned;
                c.model.n_head = 4;
            },
        },
        Family {
            name: "gpt: untied, RoPE, flash",
            vocab: 97,
            set: |c| c.model.tie_embeddings = false,
        },
        Family {
            name: "gpt: tied, learned, flash, T 90 (not a multiple of 16)",
            vocab: 97,
            set: |c| {
                c.model.pos = Learned;
                c.model.seq_len = 90;
            },
        },
        Family {
            name: "gpt: width 640, 10 heads",
            vocab: 97,
            set: |c| {
                c.model.pos = Learned;
                c.model.n_embd = 640;
                c.model.n_head = 10;
            },
        },
        Family {
            name: "gpt: untied, vocab 60001",
            vocab: 60001,
            set: |c| {
                c.model.pos = Learned;
                c.model.tie_embeddings = false;
            },
        },
        Family {
            name: "gpt without biases (LayerNorm and GELU without bias)",
            vocab: 97,
            set: |c| c.model.bias = false,
        },
        Family {
            name: "gpt without biases, materialised attention",
            vocab: 97,
            set: |c| {
                c.model.bias = false;
                c.model.n_head = 4;
            },
        },
        Family {
            name: "llama: RMSNorm, SwiGLU, RoPE, no bias, GQA 4/2, untied",
            vocab: 97,
            set: |c| {
                llama(c);
                c.model.n_embd = 256;
                c.model.n_head = 4;
                c.model.n_kv_head = 2;
                c.model.tie_embeddings = false;
            },
        },
        Family {
            name: "llama: GQA 4/1 (multi-query), tied, θ 5e5",
            vocab: 97,
            set: |c| {
                llama(c);
                c.model.n_embd = 256;
                c.model.n_head = 4;
                c.model.n_kv_head = 1;
                c.model.rope_theta = 5e5;
            },
        },
        Family {
            name: "llama: multi-head, width 640, materialised (head dim 32)",
            vocab: 97,
            set: |c| {
                llama(c);
                c.model.n_embd = 640;
                c.model.n_head = 20;
            },
        },
        Family {
            name: "gpt without biases, dropout 0.2 (embedding, attention, block outputs)",
            vocab: 97,
            set: |c| {
                c.model.bias = false;
                c.model.dropout = 0.2;
            },
        },
        Family {
            name: "gpt with biases, dropout 0.1, learned positions, untied",
            vocab: 97,
            set: |c| {
                c.model.pos = Learned;
                c.model.tie_embeddings = false;
                c.model.dropout = 0.1;
            },
        },
        Family {
            name: "llama: GQA 4/2, dropout 0.2",
            vocab: 97,
            set: |c| {
                llama(c);
                c.model.n_embd = 256;
                c.model.n_head = 4;
                c.model.n_kv_head = 2;
                c.model.dropout = 0.2;
            },
        },
        Family {
            name: "qwen2-like: q/k/v biases only, GQA 4/2, llama3 RoPE scaling",
            vocab: 97,
            set: |c| {
                llama(c);
                c.model.n_embd = 256;
                c.model.n_head = 4;
                c.model.n_kv_head = 2;
                c.model.qkv_bias = true;
                c.model.rope_scaling = cockpit::config::RopeScaling::Llama3 {
                    factor: 8.0,
                    low_freq_factor: 1.0,
                    high_freq_factor: 4.0,
                    original_max_position_embeddings: 32,
                };
            },
        },
        Family {
            name: "granite-like: embedding/attention/residual multipliers, logits scaling, GQA 4/2",
            vocab: 97,
            set: granite,
        },
        Family {
            name: "qwen3: QK-norm per head, GQA 4/2, head dim 64",
            vocab: 97,
            set: |c| {
                llama(c);
                c.model.n_embd = 256;
                c.model.n_head = 4;
                c.model.n_kv_head = 2;
                c.model.layout.qk_norm = cockpit::config::QkNorm::Head;
            },
        },
        Family {
            name: "gemma3: sandwich + 1+w norms, GeGLU, QK-norm, √C embedding, scale 256^-½, \
                   sliding layer (window 70, own θ) + full, head dim 64, GQA 4/1, T 200, dropout 0.1",
            vocab: 97,
            set: |c| {
                c.model.n_embd = 256;
                gemma3(c);
                c.model.n_head = 4;
                c.model.n_kv_head = 1;
                c.model.dropout = 0.1;
            },
        },
        Family {
            name: "gemma3: head dim 128, 3 layers (sliding, sliding, full; window 100), T 200, \
                   recompute full",
            vocab: 97,
            set: |c| {
                gemma3(c);
                c.model.n_layer = 3;
                c.model.n_head = 2;
                c.model.n_kv_head = 1;
                c.model.head_dim = 128;
                c.model.layout.layer_types = vec![Sliding, Sliding, Full];
                c.model.layout.window = 100;
                c.model.recompute = cockpit::config::Recompute::Full;
            },
        },
        Family {
            name: "gemma3-1b-like: head dim 256 (flash), 4 heads × 256 over n_embd 384, GQA \
                   4/1, sliding layer (window 70) + full, T 200",
            vocab: 97,
            set: |c| {
                c.model.n_embd = 384;
                gemma3(c);
                c.model.n_head = 4;
                c.model.n_kv_head = 1;
                c.model.head_dim = 256;
            },
        },
        Family {
            name: "gemma2: attention soft-cap 1 (materialised attention) and final soft-cap 2 \
                   (caps this small bend these scores and logits), sandwich + 1+w norms, GeGLU, \
                   sliding layer (window 70) + full, head dim 64, GQA 4/2, T 200",
            vocab: 97,
            set: |c| {
                c.model.n_embd = 256;
                gemma2(c);
            },
        },
        Family {
            name: "gemma2-2b-like: head dim 256 (flash with the soft-cap), 4 heads over n_embd \
                   384, GQA 4/2, soft-caps 1 and 2, sliding (window 70) + full, T 200, \
                   recompute full",
            vocab: 97,
            set: |c| {
                c.model.n_embd = 384;
                gemma2(c);
                c.model.head_dim = 256;
                c.model.recompute = cockpit::config::Recompute::Full;
            },
        },
        Family {
            name: "gemma2-2b-like, dropout 0.1: head dim 256 (flash with the soft-cap and \
                   dropout), MHA 2 heads over n_embd 256, soft-caps 1 and 2, sliding + full",
            vocab: 97,
            set: |c| {
                c.model.n_embd = 256;
                gemma2(c);
                c.model.n_head = 2;
                c.model.n_kv_head = 2;
                c.model.head_dim = 256;
                c.model.dropout = 0.1;
            },
        },
        Family {
            name: "gemma2-2b-like, materialised: head dim 256 with kernels.attention = false \
                   (the soft-capped softmax), GQA 4/2, soft-caps 1 and 2, sliding + full",
            vocab: 97,
            set: |c| {
                c.model.n_embd = 384;
                gemma2(c);
                c.model.head_dim = 256;
                c.kernels.attention = false;
            },
        },
        Family {
            name: "olmo2: post-norm blocks, QK-norm over the whole projections, GQA 4/2, \
                   head dim 64, dropout 0.1",
            vocab: 97,
            set: |c| {
                llama(c);
                c.model.n_embd = 256;
                c.model.n_head = 4;
                c.model.n_kv_head = 2;
                c.model.dropout = 0.1;
                c.model.layout.post_norm = true;
                c.model.layout.qk_norm = cockpit::config::QkNorm::Whole;
            },
        },
        Family {
            name: "olmo2: post-norm, whole QK-norm, head dim 128 over n_embd 128, MHA, recompute \
                   attention",
            vocab: 97,
            set: |c| {
                llama(c);
                c.model.n_head = 1;
                c.model.n_kv_head = 1;
                c.model.head_dim = 128;
                c.model.layout.post_norm = true;
                c.model.layout.qk_norm = cockpit::config::QkNorm::Whole;
                c.model.recompute = cockpit::config::Recompute::Attention;
            },
        },
        Family {
            name: "phi3-like: partial rotary (48 of 64 dims), GQA 4/2, LongRoPE past its \
                   original context (long factors, cos/sin × 1.19)",
            vocab: 97,
            set: |c| {
                llama(c);
                c.model.n_embd = 256;
                c.model.n_head = 4;
                c.model.n_kv_head = 2;
                c.model.layout.rotary_dim = 48;
                c.model.rope_scaling = cockpit::config::RopeScaling::LongRope {
                    short_factor: vec![1.0; 24],
                    long_factor: (0..24).map(|i| 1.0 + 0.25 * i as f64).collect(),
                    original_max_position_embeddings: c.model.seq_len / 2,
                    attention_factor: 1.19,
                };
            },
        },
        Family {
            name: "qwen3: QK-norm per head, head dim 128 over n_embd 128, GQA 2/1, dropout 0.1",
            vocab: 97,
            set: |c| {
                llama(c);
                c.model.n_head = 2;
                c.model.n_kv_head = 1;
                c.model.head_dim = 128;
                c.model.dropout = 0.1;
                c.model.layout.qk_norm = cockpit::config::QkNorm::Head;
            },
        },
        Family {
            name: "explicit head_dim: 4 heads × 64 over n_embd 192, GQA 4/2, dropout 0.1",
            vocab: 97,
            set: |c| {
                llama(c);
                c.model.n_embd = 192;
                c.model.n_head = 4;
                c.model.n_kv_head = 2;
                c.model.head_dim = 64;
                c.model.dropout = 0.1;
            },
        },
        Family {
            name: "explicit head_dim: 2 heads × 128 over n_embd 320 (narrower), multi-head",
            vocab: 97,
            set: |c| {
                llama(c);
                c.model.n_embd = 320;
                c.model.n_head = 2;
                c.model.head_dim = 128;
            },
        },
        Family {
            name: "granite-like with dropout 0.1 (masks and multipliers at one site)",
            vocab: 97,
            set: |c| {
                granite(c);
                c.model.dropout = 0.1;
            },
        },
        Family {
            name: "llama: GQA 4/2, dropout 0.2, recompute full",
            vocab: 97,
            set: |c| {
                llama(c);
                c.model.n_embd = 256;
                c.model.n_head = 4;
                c.model.n_kv_head = 2;
                c.model.dropout = 0.2;
                c.model.recompute = cockpit::config::Recompute::Full;
            },
        },
        Family {
            name: "gpt: 4 heads (materialised), biases, recompute attention",
            vocab: 97,
            set: |c| {
                c.model.pos = Learned;
                c.model.n_head = 4;
                c.model.recompute = cockpit::config::Recompute::Attention;
            },
        },
        Family {
            name: "llama: width 2048, 32 heads / 8 KV (the wide-row norm kernels)",
            vocab: 97,
            set: |c| {
                llama(c);
                c.model.n_embd = 2048;
                c.model.n_head = 32;
                c.model.n_kv_head = 8;
                c.model.mlp_ratio = 1.0;
            },
        },
        Family {
            name: "gpt: width 1344 (a part-empty wide row), 21 heads, dropout 0.1",
            vocab: 97,
            set: |c| {
                c.model.n_embd = 1344;
                c.model.n_head = 21;
                c.model.dropout = 0.1;
            },
        },
        Family {
            name: "llama: head dim 128 (flash), GQA 4/2, untied, T 90",
            vocab: 97,
            set: |c| {
                llama(c);
                c.model.n_embd = 512;
                c.model.n_head = 4;
                c.model.n_kv_head = 2;
                c.model.tie_embeddings = false;
                c.model.seq_len = 90;
            },
        },
        Family {
            name: "llama: head dim 64, 4 heads, dropout 0.1, T 150 (a 128-key block of one query tile)",
            vocab: 97,
            set: |c| {
                llama(c);
                c.model.n_embd = 256;
                c.model.n_head = 4;
                c.model.n_kv_head = 4;
                c.model.dropout = 0.1;
                c.model.seq_len = 150;
            },
        },
        Family {
            name: "llama: head dim 64, GQA 4/2, T 700 (up to six 128-query steps a key block)",
            vocab: 97,
            set: |c| {
                llama(c);
                c.model.n_embd = 256;
                c.model.n_head = 4;
                c.model.n_kv_head = 2;
                c.model.n_layer = 1;
                c.model.seq_len = 700;
            },
        },
        Family {
            name: "llama: head dim 64, 2 heads, dropout 0.1, T 530 (five steps, the loop for dropout)",
            vocab: 97,
            set: |c| {
                llama(c);
                c.model.n_layer = 1;
                c.model.dropout = 0.1;
                c.model.seq_len = 530;
            },
        },
        Family {
            name: "mistral-like: head dim 128, GQA 4/1, dropout 0.2, T 200 (four query tiles)",
            vocab: 97,
            set: |c| {
                llama(c);
                c.model.n_embd = 512;
                c.model.n_head = 4;
                c.model.n_kv_head = 1;
                c.model.dropout = 0.2;
                c.model.seq_len = 200;
            },
        },
        Family {
            name: "gpt: head dim 128, multi-head, biases, learned positions, recompute full",
            vocab: 97,
            set: |c| {
                c.model.pos = Learned;
                c.model.n_embd = 256;
                c.model.n_head = 2;
                c.model.recompute = cockpit::config::Recompute::Full;
            },
        },
        Family {
            name: "llama with biases and LayerNorm + SwiGLU",
            vocab: 97,
            set: |c| {
                llama(c);
                c.model.norm = cockpit::config::Norm::LayerNorm;
                c.model.bias = true;
                c.model.n_kv_head = 1;
            },
        },
        Family {
            name: "granite-4.0-h-like hybrid: 3 Mamba-2 layers (4 heads × 32, state 16, 2 groups, \
                   conv 4) + a NoPE attention layer, shared SwiGLU MLP, Granite multipliers, T 200",
            vocab: 97,
            set: granite_hybrid,
        },
        Family {
            name: "granite-4.0-h-like hybrid: Mamba-2 heads of 64, state 128, one group, T 130, \
                   recompute attention, the reference's scan in one chunk of 256",
            vocab: 97,
            set: |c| {
                granite_hybrid(c);
                c.model.seq_len = 130;
                c.model.recompute = cockpit::config::Recompute::Attention;
                if let Some(h) = c.model.hybrid.as_mut() {
                    h.mamba_n_heads = 2;
                    h.mamba_d_head = 64;
                    h.mamba_d_state = 128;
                    h.mamba_n_groups = 1;
                    h.mamba_chunk_size = 256;
                }
            },
        },
        Family {
            name: "granite-4.0-h-like hybrid: state 192 (past what the scan's backward takes the \
                   chunk states' share through x for: their own backward), 8 heads of 64 in one \
                   group (the gated norm's 16-byte rows, 64 threads), T 130",
            vocab: 97,
            set: |c| {
                granite_hybrid(c);
                c.model.seq_len = 130;
                if let Some(h) = c.model.hybrid.as_mut() {
                    h.mamba_n_heads = 8;
                    h.mamba_d_head = 64;
                    h.mamba_d_state = 192;
                    h.mamba_n_groups = 1;
                }
            },
        },
        Family {
            name: "granite-4.0-h-like hybrid: 72 Mamba-2 heads of 32 in one group (the gated \
                   norm's backward at two 16-byte pieces a thread, as at Granite-4.0-H-1B's 3072; \
                   the conv through shared memory: in_proj's 4712 columns whole 16-byte pieces), \
                   T 130",
            vocab: 97,
            set: |c| {
                granite_hybrid(c);
                c.model.seq_len = 130;
                if let Some(h) = c.model.hybrid.as_mut() {
                    h.mamba_n_heads = 72;
                    h.mamba_n_groups = 1;
                }
            },
        },
        Family {
            name: "granite-4.0-h-like hybrid with routed experts in every layer (8 of width 64, \
                   two a token, the load-balancing loss × 0.01), T 200",
            vocab: 97,
            set: granite_hybrid_moe,
        },
        Family {
            name: "granite-4.0-h-like hybrid: 4 Mamba-2 heads of 32 in one group (a block of the \
                   backward takes all four), state 32, conv 6 (the conv's 8-tap window), T 200",
            vocab: 97,
            set: |c| {
                granite_hybrid(c);
                if let Some(h) = c.model.hybrid.as_mut() {
                    h.mamba_d_state = 32;
                    h.mamba_n_groups = 1;
                    h.mamba_d_conv = 6;
                }
            },
        },
    ]
}

/// One family's case: the f32 model and the step on a 16-bit model of the same weights.
struct WholeCase {
    name: &'static str,
    m32: Model,
    m16: Model,
    step: kernels::ModelStep,
    batches: [(Vec<u32>, Vec<u32>); 2],
    b: usize,
    t: usize,
    loss: f64,
}

/// The bound on a 16-bit gradient's error against the f32 model (max|Δ| / max|ref|) where whole
/// layers or models accumulate rounding differences.
const WHOLE_GRAD_TOL: f32 = 6e-2;

/// The per-op model's own gradients in its 16-bit type over the step tests' two micro-batches
/// (their mean loss × `loss_scale`, as the step's).
fn perop_grads(
    m: &mut Model,
    batches: &[(Vec<u32>, Vec<u32>); 2],
    seeds: &[u64; 2],
    b: usize,
    loss_scale: f32,
) -> candle_core::backprop::GradStore {
    let dev = m.params[0].var.device().clone();
    let mut total: Option<Tensor> = None;
    for ((ids, tg), &seed) in batches.iter().zip(seeds) {
        let t = ids.len() / b;
        let x = Tensor::from_vec(ids.clone(), (b, t), &dev).unwrap();
        let y = Tensor::from_vec(tg.clone(), (b, t), &dev).unwrap();
        m.reseed_dropout(seed);
        let l = m.loss(&x, &y, true).unwrap().to_dtype(DType::F32).unwrap();
        let l = (l * (0.5 * loss_scale as f64)).unwrap();
        total = Some(match total {
            Some(a) => (a + l).unwrap(),
            None => l,
        });
    }
    total.unwrap().backward().unwrap()
}

/// Builds `fam` on the step in `dt` (bf16 or f16) and checks its loss and every gradient
/// against the f32 candle model over two accumulated micro-batches. `loss_scale` multiplies
/// the step's loss gradient (fp16's loss scaling) and is divided out of its gradients.
fn whole_vs_f32(dev: &Device, fam: &Family, dt: DType, loss_scale: f32) -> WholeCase {
    use cockpit::config::PosEncoding::Rope;
    let mut c = Config::default();
    c.model.pos = Rope;
    c.model.n_embd = 128;
    c.model.n_head = 2;
    c.model.n_layer = 2;
    c.model.seq_len = 80;
    c.model.bias = true;
    c.model.dropout = 0.0;
    c.model.tie_embeddings = true;
    (fam.set)(&mut c);
    let (name, vocab) = (fam.name, fam.vocab);
    let (b, t) = (3usize, c.model.seq_len);
    let batches = [batch_ids(b * t, vocab, 1), batch_ids(b * t, vocab, 2)];
    // Reference: the f32 model, mean loss of the two micro-batches.
    let mut m32 = Model::new(ModelSpec::from_config(&c, vocab), DType::F32, dev, 5).unwrap();
    separate_routes(&m32);
    let mut loss_ref = 0.0;
    let mut total: Option<Tensor> = None;
    // Dropout masks from each micro-batch's seed: the same in both executors.
    let seeds = [dropout::micro_seed(11, 3, 0), dropout::micro_seed(11, 3, 1)];
    for ((ids, tg), &seed) in batches.iter().zip(&seeds) {
        let x = Tensor::from_vec(ids.clone(), (b, t), dev).unwrap();
        let y = Tensor::from_vec(tg.clone(), (b, t), dev).unwrap();
        m32.reseed_dropout(seed);
        let l = (m32.loss(&x, &y, true).unwrap() * 0.5).unwrap();
        loss_ref += l.to_scalar::<f32>().unwrap() as f64;
        total = Some(match total {
            Some(a) => (a + l).unwrap(),
            None => l,
        });
    }
    let store = total.unwrap().backward().unwrap();
    // The whole-model step on a 16-bit model with the same initial weights.
    let mut m16 = Model::new(ModelSpec::from_config(&c, vocab), dt, dev, 5).unwrap();
    separate_routes(&m16);
    let w = m16
        .step_plan()
        .unwrap_or_else(|why| panic!("{name}: a {dt:?} model fits the step: {why}"));
    let mut step = kernels::ModelStep::new(&w).unwrap();
    if c.model.recompute.whole_block() {
        // The recomputed MLP in chunks of 64 rows (the last one partial where T = 200).
        step.set_mlp_chunk_rows(Some(64));
    }
    if vocab > 1000 {
        // The LM head in chunks of 64 rows (the last one partial): 240 rows, 4 chunks.
        step.set_head_chunk_rows(Some(64));
    }
    let experts = m16.params.iter().any(|p| p.name.ends_with("router.weight"));
    let amax = |t: &Tensor| -> f32 {
        let t = t.flatten_all().unwrap().abs().unwrap();
        t.max(0).unwrap().to_scalar().unwrap()
    };
    let mut perop16 = None;
    let mut loss = 0.0;
    // Routed experts: their products as grouped cuBLAS calls (the default), then one call an
    // expert: both against the reference.
    for grouped in if experts {
        vec![true, false]
    } else {
        vec![true]
    } {
        step.set_moe_grouped(grouped);
        let how = if grouped {
            ""
        } else {
            ", one matmul an expert"
        };
        step.begin(false).unwrap();
        for ((ids, tg), &seed) in batches.iter().zip(&seeds) {
            step.set_dropout_seed(seed);
            step.micro(ids, tg, b, loss_scale / (2 * b * t) as f32)
                .unwrap();
        }
        loss = step.loss().unwrap();
        let e = ((loss - loss_ref) / loss_ref).abs();
        eprintln!(
            "whole step {dt:?} ({name}{how}): loss {loss:.5} vs f32 {loss_ref:.5}, rel {e:.2e}"
        );
        assert!(e < 1e-2, "{name}: loss {loss} vs {loss_ref}");
        let mut errs = Vec::new();
        for (i, (p32, p16)) in m32.params.iter().zip(&m16.params).enumerate() {
            let g_ref = store.get(p32.var.as_tensor()).unwrap();
            let g = step
                .grad_of(&p16.var)
                .unwrap()
                .unwrap_or_else(|| panic!("{name}: {} has no gradient", p16.name));
            let g = (g / loss_scale as f64).unwrap();
            let scale = amax(g_ref);
            if scale < 1e-6 {
                // The key bias's gradient is zero in exact arithmetic (softmax ignores a
                // per-row constant): only check that it stays at rounding level.
                let got = amax(&g);
                eprintln!(
                    "{}: reference ~0 ({scale:.1e}), step max {got:.1e}",
                    p32.name
                );
                assert!(got < 1e-4, "{}: {got}", p32.name);
                continue;
            }
            let e = rel_err(&g, g_ref);
            if e > 2e-2 || !e.is_finite() {
                eprintln!("  {}: rel err {e:.3e} (max |ref| {scale:.2e})", p32.name);
            }
            errs.push((i, e));
        }
        // A gradient far smaller than its neighbours' carries their 16-bit rounding at its own
        // scale: past the bound, the per-op model in the same type (the executor the step
        // replaces) sets that tensor's rounding level, and the step may not exceed it.
        if errs.iter().any(|&(_, e)| e > WHOLE_GRAD_TOL) && perop16.is_none() {
            perop16 = Some(perop_grads(&mut m16, &batches, &seeds, b, loss_scale));
        }
        let mut worst = (0f32, String::new());
        for (i, e) in errs {
            let p32 = &m32.params[i];
            if e > WHOLE_GRAD_TOL && e.is_finite() {
                let own16 = perop16.as_ref().unwrap();
                let g16 = (own16.get(m16.params[i].var.as_tensor()).unwrap() / loss_scale as f64)
                    .unwrap();
                let own = rel_err(&g16, store.get(p32.var.as_tensor()).unwrap());
                eprintln!(
                    "    {}: the per-op model in {dt:?} is {own:.3e} from f32, the step {e:.3e}",
                    p32.name
                );
                if e <= own {
                    continue;
                }
            }
            if e > worst.0 || !e.is_finite() {
                worst = (e, p32.name.clone());
            }
        }
        eprintln!(
            "whole step {dt:?} ({name}{how}): worst grad rel err {:.3e} ({})",
            worst.0, worst.1
        );
        assert!(
            worst.0.is_finite() && worst.0 <= WHOLE_GRAD_TOL,
            "{name}{how}: grad {} rel err {:.3e}",
            worst.1,
            worst.0
        );
    }
    WholeCase {
        name,
        m32,
        m16,
        step,
        batches,
        b,
        t,
        loss,
    }
}

/// Evaluation on the step (its forward alone, dropout off) against the f32 model's eval loss
/// of the same weights.
fn eval_matches(dev: &Device, w: &mut WholeCase) {
    let (b, t, name) = (w.b, w.t, w.name);
    w.step.begin(false).unwrap();
    let (ids, tg) = &w.batches[0];
    let rows = kernels::Rows {
        inputs: ids,
        targets: tg,
        segments: None,
        b,
    };
    let per_seq = w.step.eval_losses(&rows, false).unwrap();
    assert_eq!(per_seq.len(), b);
    let ev = per_seq.iter().sum::<f64>() / b as f64;
    let x = Tensor::from_vec(ids.clone(), (b, t), dev).unwrap();
    let y = Tensor::from_vec(tg.clone(), (b, t), dev).unwrap();
    let ev_ref = w
        .m32
        .loss(&x, &y, false)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap() as f64;
    let e = ((ev - ev_ref) / ev_ref).abs();
    eprintln!("eval on the step ({name}): {ev:.5} vs f32 {ev_ref:.5}, rel {e:.2e}");
    assert!(e < 1e-2, "{name}: eval loss {ev} vs {ev_ref}");
}

/// The whole-model step (one hand-scheduled CUDA program, bf16) against the f32 candle model:
/// loss and every gradient, for every family switch the step takes — LayerNorm and RMSNorm,
/// GELU and SwiGLU, biases or none, multi-head and grouped-query attention, tied and untied
/// heads, learned positions and RoPE — a vocabulary that needs padding, and two accumulated
/// micro-batches against the mean of their losses.
#[test]
fn whole_model_step_matches_the_f32_model() {
    let Some(dev) = gpu() else { return };
    if !step_dtypes(&dev).contains(&DType::BF16) {
        eprintln!("no bf16 step on this GPU's kernels: the fp16 test covers the families");
        return;
    }
    for (case, fam) in step_families().iter().enumerate() {
        let mut w = whole_vs_f32(&dev, fam, DType::BF16, 1.0);
        if case == 0 {
            let (b, t, loss) = (w.b, w.t, w.loss);
            let (m16, step, batches) = (&w.m16, &mut w.step, &w.batches);
            // The fused AdamW writes the updated weights into the step's bf16 copies: a step
            // that skips its cast must compute exactly what a step that casts computes.
            let slots = m16
                .params
                .iter()
                .map(|p| (p.name.clone(), p.var.clone(), true))
                .collect();
            let mut opt = AdamW::new(slots, 0.9, 0.95, 1e-8, 0.1).unwrap();
            let grads: Vec<Tensor> = m16
                .params
                .iter()
                .map(|p| step.grad_of(&p.var).unwrap().unwrap().copy().unwrap())
                .collect();
            let copied = opt.step_with_copies(&grads, 1e-2, 1.0, Some(step)).unwrap();
            assert!(copied, "every weight of the step gets its bf16 copy");
            let mut run = |cast_skipped: bool| {
                step.begin(cast_skipped).unwrap();
                let (ids, tg) = &batches[0];
                step.micro(ids, tg, b, 1.0 / (b * t) as f32).unwrap();
                let g = step.grad_of(&m16.params[0].var).unwrap().unwrap();
                (step.loss().unwrap(), g.copy().unwrap())
            };
            let (l_copy, g_copy) = run(true);
            let (l_cast, g_cast) = run(false);
            eprintln!("after one AdamW step: loss {l_copy:.6} (copies) vs {l_cast:.6} (cast)");
            assert_eq!(l_copy, l_cast, "the AdamW bf16 copies differ from a cast");
            // (The embedding gradient is summed by atomics: equal up to summation order.)
            let e = rel_err(&g_copy, &g_cast);
            assert!(
                e < 1e-5,
                "embedding gradient after the copies: rel err {e:.2e}"
            );
            assert!(
                (l_copy - loss).abs() > 1e-6,
                "the update changed the weights"
            );
        } else {
            eval_matches(&dev, &mut w);
        }
    }
}

/// The fp16 build of the step (`precision.dtype = "f16"`): every family against the f32
/// model with a loss scale of 1024 carried through the backward and divided out of the
/// gradients, and the eval forward. fp16 keeps 10 mantissa bits to bf16's 7: the bf16
/// tolerances hold. The fused AdamW's copies are bf16, so an fp16 step casts its own.
#[test]
fn whole_model_step_in_fp16_matches_the_f32_model() {
    let Some(dev) = gpu() else { return };
    for fam in step_families() {
        let mut w = whole_vs_f32(&dev, &fam, DType::F16, 1024.0);
        eval_matches(&dev, &mut w);
        assert!(w.step.weight_copy(&w.m16.params[0].var).is_none());
    }
}

/// A pseudo-random value in [-0.5, 0.5) for element `i` (a multiplicative hash): test matrices
/// with no structure a quantizer could lean on.
fn hashed(i: usize) -> f32 {
    ((i * 2_654_435_761usize) % 10_007) as f32 / 10_007.0 - 0.5
}

/// A tensor's values on the host, flattened, in f32.
fn host_f32(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// A GGUF base's blocks for the layer matrices of `m`, as a file would keep them: a k-quant
/// where the rows are whole 256-weight blocks (Q4_K, Q5_K, Q6_K in turn), else Q4_0 or Q4_1,
/// quantized from the model's own values by the GGUF writer's encoders.
fn kept_blocks(
    m: &Model,
) -> std::collections::HashMap<String, cockpit::engine::kernels::ggml::GgmlBlocks> {
    use cockpit::engine::gguf::quant::{self, GgmlType};
    let mut kept = std::collections::HashMap::new();
    let (mut wide, mut narrow) = (0, 0);
    for p in &m.params {
        let t = p.var.as_tensor();
        let (true, Ok((out, inp))) = (
            p.name.starts_with("model.layers.") && p.name.ends_with("proj.weight"),
            t.dims2(),
        ) else {
            continue;
        };
        let ty = if inp % 256 == 0 {
            wide += 1;
            [GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K][wide % 3]
        } else {
            narrow += 1;
            [GgmlType::Q4_0, GgmlType::Q4_1][narrow % 2]
        };
        let v = host_f32(t);
        let b = cockpit::engine::kernels::ggml::GgmlBlocks::new(
            ty as u32,
            out,
            inp,
            quant::encode(&v, ty),
            &candle_core::Device::Cpu,
        )
        .unwrap();
        kept.insert(p.name.clone(), b);
    }
    kept
}

/// ggml's blocks dequantized on the GPU (cuda/ggml.cuh) are the host decoder's values
/// (src/engine/gguf/quant.rs, kquant.rs) rounded to bf16, to the bit, in every kept format.
#[test]
fn ggml_blocks_dequantize_as_the_host_decoder_does() {
    let Some(dev) = gpu() else { return };
    use cockpit::engine::gguf::quant::{self, GgmlType};
    use cockpit::engine::kernels::ggml::GgmlBlocks;
    // 40 rows of 512: two k-quant super-blocks, sixteen 32-weight blocks a row; a row 100×
    // larger, an all-zero row, an all-positive one (the minima of Q4_1/Q4_K/Q5_K above zero).
    let (out, inp) = (40usize, 512usize);
    let vals: Vec<f32> = (0..out * inp)
        .map(|i| {
            let x = hashed(i);
            match i / inp {
                3 => x * 100.0,
                7 => 0.0,
                11 => x + 0.75,
                _ => x * 0.02,
            }
        })
        .collect();
    for ty in [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
    ] {
        let bytes = quant::encode(&vals, ty);
        let want = quant::decode(&bytes, ty);
        let b = GgmlBlocks::new(ty as u32, out, inp, bytes, &dev).unwrap();
        assert_eq!(b.name(), ty.name());
        let got = host_f32(&b.dequantize(DType::F32).unwrap());
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let w16 = half::bf16::from_f32(*w).to_f32();
            assert!(
                g.to_bits() == w16.to_bits(),
                "{ty:?} element {i} (row {}): {g} vs the host's {w} ({w16} in bf16)",
                i / inp
            );
        }
        eprintln!("{ty:?}: {} weights equal to the bit", got.len());
    }
}

/// The NF4 kernels (quantize at load, dequantize before a matmul) compute exactly what the
/// host reference in src/engine/nf4.rs computes.
#[test]
fn nf4_kernels_match_the_host_reference() {
    let Some(dev) = gpu() else { return };
    use cockpit::engine::kernels::nf4::{self, Nf4};
    // 320 rows of 192: 960 blocks, so the last of 4 groups of 256 blocks is partial.
    let (out, inp) = (320usize, 192usize);
    let vals: Vec<f32> = (0..out * inp)
        .map(|i| {
            let x = hashed(i);
            // a few rows 100× larger, one block all zero
            let row = i / inp;
            if (64..128).contains(&i) {
                0.0
            } else if row % 97 == 3 {
                x
            } else {
                x * 0.01
            }
        })
        .collect();
    let w = Tensor::from_vec(vals, (out, inp), &dev)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let host = host_f32(&w);
    let (codes, absq, gscale) = nf4::quantize_host(&host);
    let q = Nf4::quantize(&w).unwrap();
    assert_eq!(q.codes.to_vec1::<u8>().unwrap(), codes, "codes");
    assert_eq!(q.absq.to_vec1::<u8>().unwrap(), absq, "block maxima");
    assert_eq!(q.gscale.to_vec1::<f32>().unwrap(), gscale, "group scales");
    let back = host_f32(&q.dequantize(DType::F32).unwrap());
    let want = nf4::dequantize_host(&codes, &absq, &gscale);
    for (i, (a, b)) in back.iter().zip(&want).enumerate() {
        // the kernel rounds to bf16
        assert!(
            (a - b).abs() <= b.abs() * 4e-3 + 1e-12,
            "element {i}: {a} vs {b}"
        );
    }
    assert!(back[64..128].iter().all(|&x| x == 0.0));
}

/// The whole-model step with LoRA (a frozen bf16 or fp16 base, trainable adapters) against the
/// f32 candle model with the same adapters: loss and every adapter's gradient. B starts at
/// zero in a fresh adapter (which would hide A's gradient), so both models get the same
/// random B.
#[test]
fn whole_model_step_with_lora_matches_the_f32_model() {
    let Some(dev) = gpu() else { return };
    use cockpit::config::{Activation::SwiGlu, Norm::RmsNorm};
    use cockpit::engine::model::LoraSpec;
    let all: Vec<String> = ["q", "k", "v", "o", "gate", "up", "down"]
        .map(String::from)
        .to_vec();
    fn gqa(c: &mut Config) {
        c.model.norm = RmsNorm;
        c.model.activation = SwiGlu;
        c.model.bias = false;
        c.model.n_embd = 256;
        c.model.n_head = 4;
        c.model.n_kv_head = 2;
        c.model.mlp_ratio = 2.75;
    }
    // (name, shape, targets, how the frozen base is stored)
    #[derive(Clone, Copy, PartialEq)]
    enum Stored {
        Dense,
        Nf4,
        /// A GGUF file's blocks, kept ([`kept_blocks`]), NF4 where they do not fit
        Ggml,
    }
    type Case = (&'static str, fn(&mut Config), Vec<String>, Stored);
    let cases: [Case; 15] = [
        (
            "llama GQA 4/2, adapters on every projection",
            gqa,
            all.clone(),
            Stored::Dense,
        ),
        (
            "gpt with biases, adapters on q, v, up, down (GELU)",
            |c| c.model.tie_embeddings = false,
            ["q", "v", "up", "down"].map(String::from).to_vec(),
            Stored::Dense,
        ),
        (
            "llama, dropout 0.1, adapters on q and v",
            |c| {
                c.model.norm = RmsNorm;
                c.model.activation = SwiGlu;
                c.model.bias = false;
                c.model.dropout = 0.1;
            },
            ["q", "v"].map(String::from).to_vec(),
            Stored::Dense,
        ),
        (
            "llama head dim 128, GQA 4/1, adapters on k, v and gate (groups without their first)",
            |c| {
                c.model.norm = RmsNorm;
                c.model.activation = SwiGlu;
                c.model.bias = false;
                c.model.n_embd = 512;
                c.model.n_head = 4;
                c.model.n_kv_head = 1;
                c.model.mlp_ratio = 2.0;
            },
            ["k", "v", "gate"].map(String::from).to_vec(),
            Stored::Dense,
        ),
        (
            "llama GQA 4/2, NF4 base (QLoRA), adapters on every projection",
            gqa,
            all.clone(),
            Stored::Nf4,
        ),
        (
            "llama GQA 4/2, LoRA dropout 0.25 on every projection's input, dropout 0.1, \
             recompute full with the MLP in chunks of 64 rows (a chunk draws its rows' masks)",
            |c| {
                gqa(c);
                c.model.dropout = 0.1;
                c.lora.dropout = 0.25;
                c.model.recompute = cockpit::config::Recompute::Full;
            },
            all.clone(),
            Stored::Dense,
        ),
        (
            "llama GQA 4/2, NF4 base (QLoRA), adapters on every projection, recompute full with \
             the MLP in chunks of 64 rows (each chunk's matmuls dequantize their base matrices)",
            |c| {
                gqa(c);
                c.model.recompute = cockpit::config::Recompute::Full;
            },
            all.clone(),
            Stored::Nf4,
        ),
        (
            "llama GQA 4/2, a GGUF base's blocks kept (Q4_K, Q5_K, Q6_K; Q4_0, Q4_1 where rows \
             are no whole 256), adapters on every projection",
            gqa,
            all.clone(),
            Stored::Ggml,
        ),
        (
            "explicit head_dim 4×64 over n_embd 192, adapters on every projection (o reads 256)",
            |c| {
                gqa(c);
                c.model.n_embd = 192;
                c.model.head_dim = 64;
            },
            all.clone(),
            Stored::Dense,
        ),
        (
            "llama GQA 4/2, adapters on every projection, each beside its base (no [W | B])",
            |c| {
                gqa(c);
                c.kernels.lora_concat = false;
            },
            all.clone(),
            Stored::Dense,
        ),
        (
            "llama GQA 4/2, LoRA dropout 0.25 on every projection's input, dropout 0.1",
            |c| {
                gqa(c);
                c.model.dropout = 0.1;
                c.lora.dropout = 0.25;
            },
            all.clone(),
            Stored::Dense,
        ),
        (
            "gemma3-like (sandwich + 1+w norms, GeGLU, QK-norm, a sliding layer of window 50), \
             adapters on every projection",
            |c| {
                use cockpit::config::{Activation::GeGlu, LayerKind, QkNorm};
                gqa(c);
                c.model.activation = GeGlu;
                c.model.embedding_multiplier = 16.0;
                let l = &mut c.model.layout;
                l.qk_norm = QkNorm::Head;
                l.sandwich_norm = true;
                l.norm_plus_one = true;
                l.layer_types = vec![LayerKind::Full, LayerKind::Sliding];
                l.window = 50;
                l.local_rope_theta = 10_000.0;
            },
            all.clone(),
            Stored::Dense,
        ),
        (
            "granite-4.0-h-like hybrid (3 Mamba-2 layers, a NoPE attention layer), adapters on \
             in_proj, out_proj, q, k, v, o and the shared MLP's up (gate | up) and down",
            |c| {
                granite_hybrid(c);
                c.model.seq_len = 80;
            },
            ["in_proj", "out_proj", "q", "k", "v", "o", "up", "down"]
                .map(String::from)
                .to_vec(),
            Stored::Dense,
        ),
        (
            "granite-4.0-h-like hybrid, 72 Mamba-2 heads of 32 in one group (the conv's and the \
             gated norm's backward with their weights frozen: the shared-memory conv, two 16-byte \
             pieces a thread), adapters on in_proj and out_proj",
            |c| {
                granite_hybrid(c);
                c.model.seq_len = 80;
                if let Some(h) = c.model.hybrid.as_mut() {
                    h.mamba_n_heads = 72;
                    h.mamba_n_groups = 1;
                }
            },
            ["in_proj", "out_proj"].map(String::from).to_vec(),
            Stored::Dense,
        ),
        (
            "granite-4.0-h-like hybrid with routed experts (frozen, as the router), adapters on \
             in_proj, out_proj, q, k, v, o and the shared MLP's up and down",
            |c| {
                granite_hybrid_moe(c);
                c.model.seq_len = 80;
            },
            ["in_proj", "out_proj", "q", "k", "v", "o", "up", "down"]
                .map(String::from)
                .to_vec(),
            Stored::Dense,
        ),
    ];
    // Each case in bf16 and in fp16 (the fp16 step with a loss scale of 256, divided out);
    // COCKPIT_FAMILY=text: only the cases whose name contains it.
    let only = std::env::var("COCKPIT_FAMILY").unwrap_or_default();
    let runs = cases
        .iter()
        .filter(|case| case.0.contains(&only))
        .flat_map(|case| step_dtypes(&dev).into_iter().map(move |dt| (case, dt)));
    for ((name, set, targets, stored), dt16) in runs {
        let (name, stored) = (*name, *stored);
        let targets = targets.clone();
        let mut c = Config::default();
        c.model.n_embd = 128;
        c.model.n_head = 2;
        c.model.n_layer = 2;
        c.model.seq_len = 80;
        set(&mut c);
        let (b, t, vocab) = (3usize, 80usize, 97usize);
        let spec = LoraSpec {
            r: 8,
            alpha: 16.0,
            targets,
            dropout: c.lora.dropout,
        };
        // The 16-bit model stores its frozen base in its own dtype, as a LoRA run on the GPU
        // does.
        let build = |dt: DType| {
            let store = cockpit::engine::model::BaseStore {
                dtype: if dt == DType::F32 { DType::F32 } else { dt },
                init: cockpit::engine::model::BaseInit::HostSeeded,
            };
            let shape = ModelSpec::from_config(&c, vocab);
            let mut m = Model::new_with(shape, dt, &dev, 5, store).unwrap();
            separate_routes(&m);
            if stored != Stored::Dense {
                // Both models quantize the same bf16 values: the same 4-bit base. (The f32
                // model's weights go through the 16-bit model's storage type first: f32 → fp16
                // → bf16 rounds twice and may land one bf16 step away from f32 → bf16.)
                if dt == DType::F32 {
                    for p in &m.params {
                        let t = p.var.as_tensor();
                        let r = t.to_dtype(dt16).unwrap().to_dtype(DType::F32).unwrap();
                        p.var.set(&r).unwrap();
                    }
                }
                let kept = if stored == Stored::Ggml {
                    kept_blocks(&m)
                } else {
                    Default::default()
                };
                let q = m.quantize_base(&kept).unwrap();
                if stored == Stored::Ggml {
                    let d = q.describe();
                    assert!(
                        ["Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q4_1"]
                            .iter()
                            .all(|f| d.contains(f)),
                        "{d}"
                    );
                }
            }
            m.add_lora(&spec, 5).unwrap();
            for (k, p) in m.params.iter().enumerate() {
                if p.name.ends_with("lora_B.weight") {
                    let dims = p.var.as_tensor().dims().to_vec();
                    let n: usize = dims.iter().product();
                    let vals: Vec<f32> = (0..n)
                        .map(|i| (((i * 7919 + k * 104729) % 1000) as f32 / 1000.0 - 0.5) * 0.05)
                        .collect();
                    p.var
                        .set(&Tensor::from_vec(vals, dims, &dev).unwrap())
                        .unwrap();
                }
            }
            m
        };
        let mut m32 = build(DType::F32);
        let m16 = build(dt16);
        let scale = if dt16 == DType::F16 { 256.0 } else { 1.0 };
        let ids: Vec<u32> = (0..(b * t) as u32)
            .map(|i| (i * 31 + 7) % vocab as u32)
            .collect();
        let tg: Vec<u32> = (0..(b * t) as u32)
            .map(|i| (i * 17 + 3) % vocab as u32)
            .collect();
        let seed = dropout::micro_seed(3, 1, 0);
        m32.reseed_dropout(seed);
        let x = Tensor::from_vec(ids.clone(), (b, t), &dev).unwrap();
        let y = Tensor::from_vec(tg.clone(), (b, t), &dev).unwrap();
        let l = m32.loss(&x, &y, true).unwrap();
        let loss_ref = l.to_scalar::<f32>().unwrap() as f64;
        let store = l.backward().unwrap();
        let w = m16
            .step_weights()
            .unwrap_or_else(|| panic!("{name}: a LoRA {dt16:?} model fits the step"));
        assert!(w.frozen_base);
        let mut step = kernels::ModelStep::new(&w).unwrap();
        if c.model.recompute.whole_block() {
            step.set_mlp_chunk_rows(Some(64)); // (240 rows: 64, 64, 64, 48)
        }
        step.begin(false).unwrap();
        step.set_dropout_seed(seed);
        step.micro(&ids, &tg, b, scale / (b * t) as f32).unwrap();
        let loss = step.loss().unwrap();
        let e = ((loss - loss_ref) / loss_ref).abs();
        eprintln!("LoRA step {dt16:?} ({name}): loss {loss:.5} vs f32 {loss_ref:.5}, rel {e:.2e}");
        assert!(e < 1e-2, "{name}: loss {loss} vs {loss_ref}");
        let mut worst = (0f32, String::new());
        let mut adapters = 0;
        for (p32, p16) in m32.params.iter().zip(&m16.params) {
            let g = step.grad_of(&p16.var).unwrap();
            if !p16.trainable {
                assert!(g.is_none(), "{name}: frozen {} has a gradient", p16.name);
                continue;
            }
            adapters += 1;
            let g = g.unwrap_or_else(|| panic!("{name}: {} has no gradient", p16.name));
            let g = (g / scale as f64).unwrap();
            let e = rel_err(&g, store.get(p32.var.as_tensor()).unwrap());
            if e > worst.0 || !e.is_finite() {
                worst = (e, p32.name.clone());
            }
        }
        eprintln!(
            "LoRA step {dt16:?} ({name}): {adapters} adapter tensors, worst grad rel err {:.3e} ({})",
            worst.0, worst.1
        );
        assert!(adapters > 0);
        assert!(
            worst.0.is_finite() && worst.0 <= WHOLE_GRAD_TOL,
            "{name}: grad {} rel err {:.3e}",
            worst.1,
            worst.0
        );
    }
}

#[test]
fn dropout_masks_drawn_on_the_gpu_equal_the_hosts() {
    let Some(dev) = gpu() else { return };
    use dropout::Layout;
    for layout in [Layout::Rows, Layout::Attention] {
        for (rows, cols, p) in [(37, 200, 0.2), (5, 1000, 0.5), (3, 64, 0.05)] {
            let got = kernels::dropout_mask(&dev, (rows, cols), 99, 7, p, layout)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            let want = dropout::mask(rows, cols, 99, 7, p, layout);
            assert_eq!(got, want, "{layout:?} {rows}x{cols} p {p}");
        }
    }
}

#[test]
fn graph_replay_and_the_side_stream_match_eager_launches_on_one_stream() {
    let Some(dev) = gpu() else { return };
    for p in [0.0, 0.1] {
        graph_replay_matches_eager(&dev, p);
    }
}

/// [`graph_replay_and_the_side_stream_match_eager_launches_on_one_stream`] at dropout `p`.
fn graph_replay_matches_eager(dev: &Device, p: f64) {
    let mut c = Config::default();
    c.model.n_embd = 128;
    c.model.n_head = 2;
    c.model.n_layer = 2;
    c.model.seq_len = 64;
    c.model.bias = true;
    c.model.dropout = p;
    let vocab = 101;
    let t = 64usize;
    let batch = |b: usize, k: u32| {
        let ids: Vec<u32> = (0..(b * t) as u32)
            .map(|i| (i * 29 + 5 * k) % vocab as u32)
            .collect();
        let tg: Vec<u32> = (0..(b * t) as u32)
            .map(|i| (i * 13 + 1 + k) % vocab as u32)
            .collect();
        (ids, tg)
    };
    let run = |graphs: bool, overlap: bool| {
        let mut c = c.clone();
        c.kernels.graphs = graphs;
        c.kernels.overlap = overlap;
        // Each step times its own matmul candidates: under other tests' load two steps may
        // pick different (equally right) algorithms, whose sums differ in the last bit.
        c.kernels.autotune = false;
        let m = Model::new(ModelSpec::from_config(&c, vocab), step_dtype(dev), dev, 9).unwrap();
        let w = m.step_weights().unwrap();
        let mut step = kernels::ModelStep::new(&w).unwrap();
        let mut out = Vec::new();
        // Three steps of two micro-batches at B = 3 (first and later micro-batches are two
        // programs: eager at step 1, captured at step 2, replayed at step 3), one at B = 2 (a
        // new arena), and two more at B = 3 (captured again over the new buffers).
        for (i, b) in [3, 3, 3, 2, 3, 3].into_iter().enumerate() {
            step.begin(false).unwrap();
            for k in 0..2 {
                // (new masks every micro-batch: a replayed graph reads its seed from the device)
                step.set_dropout_seed(dropout::micro_seed(5, i as u64, k as usize));
                let (ids, tg) = batch(b, k);
                step.micro(&ids, &tg, b, 1.0 / (2 * b * t) as f32).unwrap();
            }
            let grads: Vec<Tensor> = m
                .params
                .iter()
                .map(|p| step.grad_of(&p.var).unwrap().unwrap().copy().unwrap())
                .collect();
            out.push((step.loss().unwrap(), grads));
        }
        (out, step.graphs_captured())
    };
    let m_names: Vec<String> =
        Model::new(ModelSpec::from_config(&c, vocab), step_dtype(dev), dev, 9)
            .unwrap()
            .params
            .iter()
            .map(|p| p.name.clone())
            .collect();
    let (eager, none) = run(false, false);
    let (graphed, captured) = run(true, true);
    // The weight gradients on a second stream, captured (above) and eager.
    let (side, _) = run(false, true);
    assert_eq!(none, 0, "graphs off captures nothing");
    assert_eq!(
        captured, 2,
        "the last arena holds a graph for first and one for later micro-batches"
    );
    for (what, other) in [("graphs + side stream", &graphed), ("side stream", &side)] {
        for (i, ((le, ge), (lg, gg))) in eager.iter().zip(other).enumerate() {
            eprintln!("{what}, dropout {p}, step {i}: loss {lg:.6} vs one eager stream {le:.6}");
            assert_eq!(le, lg, "{what}, step {i}: the loss differs");
            for (j, (a, b)) in ge.iter().zip(gg).enumerate() {
                // Atomics (embedding, column sums, dQ) sum in any order: equal up to rounding
                // — relative to the gradient's size, or absolute for one that is zero in exact
                // arithmetic (the key bias's: what is left of it is summation noise).
                let amax = |t: &Tensor| -> f32 {
                    let t = t.flatten_all().unwrap().abs().unwrap();
                    t.max(0).unwrap().to_scalar().unwrap()
                };
                let d = amax(&(b - a).unwrap());
                assert!(
                    d <= 1e-5 * amax(a) + 1e-7,
                    "{what}, dropout {p}, step {i}: gradient {j} ({}) differs by {d:.2e} (max {:.2e})",
                    m_names[j],
                    amax(a)
                );
            }
        }
    }
}

/// `model.recompute`: "attention", "full" and "offload" give the loss and gradients of "none"
/// (the same kernels on the same inputs; only summation orders of atomics may differ), with
/// LoRA adapters and dropout, two micro-batches accumulated, and the optimizer step run twice
/// (the second time from the micro-batches' captured CUDA graphs: offload's copies are memcpy
/// nodes of them). Five blocks: offload keeps three blocks' inputs on the host. And a hybrid
/// with routed experts, fully trained (its experts' kept slots, or one slot the recompute
/// refills with the same routing; such a model runs without graphs: its experts' row counts
/// come from the host). "full" and "offload" again with the recomputed MLP in chunks of rows
/// (the adapters then on q, v, gate, up and down: the concatenated gate|up group's `[x | u]`
/// rows and the down adapters' `u` cut at the chunks' rows).
#[test]
fn recompute_matches_keeping_the_activations() {
    let Some(dev) = gpu() else { return };
    use cockpit::config::Recompute;
    use cockpit::engine::model::LoraSpec;
    let (b, t, vocab) = (2usize, 128usize, 97usize);
    let run = |recompute: Recompute,
               lora: bool,
               experts: bool,
               mlp_rows: Option<usize>|
     -> (f64, Vec<Tensor>) {
        let mut c = Config::default();
        c.model.norm = cockpit::config::Norm::RmsNorm;
        c.model.activation = cockpit::config::Activation::SwiGlu;
        c.model.pos = cockpit::config::PosEncoding::Rope;
        c.model.bias = false;
        c.model.mlp_ratio = 2.75;
        c.model.n_embd = 256;
        c.model.n_head = 4;
        c.model.n_kv_head = 2;
        c.model.n_layer = 5;
        c.model.seq_len = t;
        c.model.dropout = 0.1;
        c.model.recompute = recompute;
        // Timed algorithm choice may pick other matmul algorithms run to run (other
        // rounding): the heuristic's first choice keeps the runs comparable bit for bit.
        c.kernels.autotune = false;
        if experts {
            granite_hybrid_moe(&mut c);
            c.model.seq_len = t;
        }
        let store = cockpit::engine::model::BaseStore {
            dtype: if lora { step_dtype(&dev) } else { DType::F32 },
            init: cockpit::engine::model::BaseInit::HostSeeded,
        };
        let shape = ModelSpec::from_config(&c, vocab);
        let mut m = Model::new_with(shape, step_dtype(&dev), &dev, 9, store).unwrap();
        separate_routes(&m);
        if lora {
            let spec = LoraSpec {
                r: 8,
                alpha: 16.0,
                targets: ["q", "v", "gate", "up", "down"].map(String::from).to_vec(),
                dropout: 0.0,
            };
            m.add_lora(&spec, 9).unwrap();
            // (The same B in every run: a fresh adapter's zero B would hide A's gradient.)
            for (k, p) in m.params.iter().enumerate() {
                if p.name.ends_with("lora_B.weight") {
                    let dims = p.var.as_tensor().dims().to_vec();
                    let n: usize = dims.iter().product();
                    let vals: Vec<f32> = (0..n)
                        .map(|i| (((i * 7919 + k * 104729) % 1000) as f32 / 1000.0 - 0.5) * 0.05)
                        .collect();
                    p.var
                        .set(&Tensor::from_vec(vals, dims, &dev).unwrap())
                        .unwrap();
                }
            }
        }
        let w = m.step_weights().expect("fits the step");
        let mut step = kernels::ModelStep::new(&w).unwrap();
        step.set_mlp_chunk_rows(mlp_rows);
        // (Twice the same step: eager, then captured and replayed.)
        for _ in 0..2 {
            step.begin(false).unwrap();
            for k in 0..2u32 {
                let (ids, tg) = batch_ids(b * t, vocab, k);
                step.set_dropout_seed(dropout::micro_seed(4, 1, k as usize));
                step.micro(&ids, &tg, b, 1.0 / (2 * b * t) as f32).unwrap();
            }
        }
        let graphs = if experts { 0 } else { 2 };
        assert_eq!(
            step.graphs_captured(),
            graphs,
            "{recompute:?}: both micro-batch graphs (none with experts)"
        );
        let grads = m
            .params
            .iter()
            .filter_map(|p| step.grad_of(&p.var).unwrap())
            .map(|g| g.copy().unwrap())
            .collect();
        (step.loss().unwrap(), grads)
    };
    for (lora, experts) in [(false, false), (true, false), (false, true)] {
        let (l0, g0) = run(Recompute::None, lora, experts, None);
        for r in [Recompute::Attention, Recompute::Full, Recompute::Offload] {
            let (l, g) = run(r, lora, experts, None);
            eprintln!("recompute {r:?} (LoRA {lora}, experts {experts}): loss {l:.7} vs {l0:.7}");
            // (The experts' balancing loss sums router probabilities by float atomics.)
            if experts {
                assert!(((l - l0) / l0).abs() < 1e-6, "{r:?}: loss {l} vs {l0}");
            } else {
                assert_eq!(l, l0, "{r:?}: the forward is the same arithmetic");
            }
            assert_eq!(g.len(), g0.len());
            for (a, b) in g.iter().zip(&g0) {
                let e = rel_err(a, b);
                assert!(e < 1e-5, "{r:?} (LoRA {lora}): grad rel err {e:.2e}");
            }
        }
        if experts {
            continue; // (routed experts keep the MLP whole)
        }
        // The recomputed MLP in chunks of 96 rows (96, 96, 64 of the 256): the matmuls run on
        // other row counts (cuBLAS may pick other algorithms: other roundings), so close, not
        // equal — a chunk's rows or gradient misplaced would be off by its whole share.
        for r in [Recompute::Full, Recompute::Offload] {
            let (l, g) = run(r, lora, experts, Some(96));
            eprintln!("recompute {r:?} in MLP chunks (LoRA {lora}): loss {l:.7} vs {l0:.7}");
            assert!(
                ((l - l0) / l0).abs() < 1e-4,
                "{r:?} chunked: loss {l} vs {l0}"
            );
            assert_eq!(g.len(), g0.len());
            for (a, b) in g.iter().zip(&g0) {
                let e = rel_err(a, b);
                assert!(
                    e < 1e-2,
                    "{r:?} chunked (LoRA {lora}): grad rel err {e:.2e}"
                );
            }
        }
    }
}

/// The decode-attention kernel (one new query a row against a generation cache, keys in
/// chunks across blocks, then merged) against the candle composition in f32 over the same
/// values: grouped-query heads, head dims 64, 80, 128 and 256, rows with left padding, a
/// sliding window's start, Gemma 2's soft-cap, lengths of one column, within one chunk and
/// across several; f32 and bf16.
#[test]
fn decode_attention_matches_the_composition() {
    let Some(dev) = gpu() else { return };
    let cap = 700;
    // (heads, key/value heads, head dim, soft-cap)
    for (h, kvh, hd, softcap) in [
        (8, 2, 64, 0.0f32),
        (4, 1, 256, 0.0),
        (6, 6, 80, 2.0),
        (32, 8, 128, 0.0),
        (4, 2, 256, 1.5),
    ] {
        for dt in [DType::F32, DType::BF16] {
            let b = 3;
            let rnd = |dims: &[usize]| {
                Tensor::randn(0f32, 1f32, dims, &dev)
                    .unwrap()
                    .to_dtype(dt)
                    .unwrap()
            };
            let q = rnd(&[b, h, hd]);
            let k = rnd(&[b, kvh, cap, hd]);
            let v = rnd(&[b, kvh, cap, hd]);
            // rows padded on the left by 0, 5 and 37 columns
            let pads = [0usize, 5, 37];
            let mask: Vec<f32> = pads
                .iter()
                .flat_map(|&p| (0..cap).map(move |c| if c < p { f32::NEG_INFINITY } else { 0.0 }))
                .collect();
            let mask = Tensor::from_vec(mask, (b, cap), &dev)
                .unwrap()
                .to_dtype(dt)
                .unwrap();
            let scale = 1.0 / (hd as f32).sqrt();
            for (lo, len) in [(0, 38), (0, 200), (0, 700), (450, 700), (100, 613)] {
                let span = kernels::DecodeSpan {
                    lo,
                    len,
                    scale,
                    softcap,
                };
                let got = kernels::decode_attention(&q, &k, &v, &mask, span)
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap();
                // The composition in f32 over the same (rounded) values.
                let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
                let seen = len - lo;
                let keys = f(&k).narrow(2, lo, seen).unwrap();
                let values = f(&v).narrow(2, lo, seen).unwrap();
                let qq = (f(&q) * scale as f64)
                    .unwrap()
                    .reshape((b, kvh, h / kvh, hd))
                    .unwrap();
                let mut att = qq.matmul(&keys.t().unwrap()).unwrap();
                if softcap > 0.0 {
                    att =
                        ((att / softcap as f64).unwrap().tanh().unwrap() * softcap as f64).unwrap();
                }
                let m = f(&mask)
                    .narrow(1, lo, seen)
                    .unwrap()
                    .reshape((b, 1, 1, seen))
                    .unwrap();
                let att =
                    candle_nn::ops::softmax_last_dim(&att.broadcast_add(&m).unwrap()).unwrap();
                let want = att.matmul(&values).unwrap().reshape((b, h, hd)).unwrap();
                let worst = max_abs_diff(&got, &want);
                let tol = if dt == DType::F32 { 1e-4 } else { 1e-2 };
                assert!(
                    worst <= tol,
                    "{h}/{kvh} heads of {hd}, cap {softcap}, {dt:?}, columns {lo}..{len}: max \
                     abs err {worst:.3e} > {tol:.0e}"
                );
            }
        }
    }
}

/// A hybrid's Mamba-2 layer for one new position per row (`kernels::mamba_decode`: conv
/// window, SiLU, dt's softplus and limits, the state's decay and input, its read-out, the D
/// skip and the gated norm) against the candle composition in f32 over the same values: one
/// group and several, head widths that are not a multiple of a block's rows, conv of 2 to 4
/// taps with and without bias, dt limits; f32 and bf16.
#[test]
fn mamba_decode_matches_the_composition() {
    let Some(dev) = gpu() else { return };
    // (heads, head width, state, groups, conv taps, conv bias, dt limits)
    type Shape = (usize, usize, usize, usize, usize, bool, Option<(f32, f32)>);
    let shapes: [Shape; 4] = [
        (8, 64, 128, 1, 4, true, None),
        (6, 20, 64, 2, 3, false, Some((0.01, 0.5))),
        (4, 32, 16, 4, 2, true, Some((0.0, 0.2))),
        (48, 64, 128, 1, 4, true, None),
    ];
    let mut failed = Vec::new();
    for (h, p, s, g, k, with_bias, dt_limits) in shapes {
        for dt in [DType::F32, DType::BF16] {
            let b = 3;
            let (inner, conv) = (h * p, h * p + 2 * g * s);
            let w = inner + conv + h;
            let rnd = |dims: &[usize], std: f32, dt: DType| {
                Tensor::randn(0f32, std, dims, &dev)
                    .unwrap()
                    .to_dtype(dt)
                    .unwrap()
            };
            let proj = rnd(&[b, w], 1.0, dt);
            let hist = rnd(&[b, k - 1, conv], 1.0, dt);
            let conv_w = rnd(&[conv, k], 0.5, dt);
            let conv_b = with_bias.then(|| rnd(&[conv], 0.3, dt));
            let dt_bias = rnd(&[h], 1.0, DType::F32);
            let a_log = rnd(&[h], 0.5, DType::F32);
            let dskip = rnd(&[h], 1.0, DType::F32);
            let norm_w = (rnd(&[inner], 0.1, DType::F32) + 1.0).unwrap();
            let state = rnd(&[b, h, p, s], 1.0, DType::F32);
            let d = kernels::MambaDecode {
                heads: h,
                head_dim: p,
                state: s,
                groups: g,
                conv_k: k,
                dt_limits,
                eps: 1e-5,
            };
            assert!(kernels::mamba_decode_takes(&d));
            let (out, hist_out, state_out) = kernels::mamba_decode(
                &proj,
                &hist,
                &conv_w,
                conv_b.as_ref(),
                &dt_bias,
                &a_log,
                &dskip,
                &norm_w,
                &state,
                &d,
            )
            .unwrap();
            // The composition in f32 over the same (rounded) values.
            let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
            let silu = |t: &Tensor| candle_nn::ops::silu(t).unwrap();
            let proj32 = f(&proj);
            let z = proj32.narrow(1, 0, inner).unwrap();
            let xbc_new = proj32.narrow(1, inner, conv).unwrap();
            let full = Tensor::cat(&[&f(&hist), &xbc_new.unsqueeze(1).unwrap()], 1).unwrap();
            let mut pre = full
                .broadcast_mul(&f(&conv_w).t().unwrap().unsqueeze(0).unwrap())
                .unwrap()
                .sum(1)
                .unwrap();
            if let Some(cb) = &conv_b {
                pre = pre.broadcast_add(&f(cb)).unwrap();
            }
            let xbc = silu(&pre);
            let x = xbc.narrow(1, 0, inner).unwrap().reshape((b, h, p)).unwrap();
            let spread = |off: usize| {
                xbc.narrow(1, off, g * s)
                    .unwrap()
                    .reshape((b, g, 1, s))
                    .unwrap()
                    .broadcast_as((b, g, h / g, s))
                    .unwrap()
                    .reshape((b, h, s))
                    .unwrap()
            };
            let (bm, cm) = (spread(inner), spread(inner + g * s));
            let raw = proj32
                .narrow(1, inner + conv, h)
                .unwrap()
                .broadcast_add(&dt_bias)
                .unwrap();
            // softplus
            let mut dts = (raw.relu().unwrap()
                + (raw.abs().unwrap().neg().unwrap().exp().unwrap() + 1.0)
                    .unwrap()
                    .log()
                    .unwrap())
            .unwrap();
            if let Some((lo, hi)) = dt_limits {
                dts = dts.clamp(lo, hi).unwrap();
            }
            let decay = dts
                .broadcast_mul(&a_log.exp().unwrap().neg().unwrap())
                .unwrap()
                .exp()
                .unwrap();
            let input = x
                .broadcast_mul(&dts.unsqueeze(2).unwrap())
                .unwrap()
                .unsqueeze(3)
                .unwrap()
                .broadcast_mul(&bm.unsqueeze(2).unwrap())
                .unwrap();
            let want_state = (state
                .broadcast_mul(&decay.reshape((b, h, 1, 1)).unwrap())
                .unwrap()
                + input)
                .unwrap();
            let y = want_state
                .matmul(&cm.unsqueeze(3).unwrap())
                .unwrap()
                .squeeze(3)
                .unwrap();
            let y = (y + x.broadcast_mul(&dskip.reshape((1, h, 1)).unwrap()).unwrap()).unwrap();
            let gated = (y.reshape((b, inner)).unwrap() * silu(&z))
                .unwrap()
                .reshape((b, g, inner / g))
                .unwrap();
            let rs = ((gated.sqr().unwrap().mean_keepdim(2).unwrap() + 1e-5)
                .unwrap()
                .sqrt()
                .unwrap())
            .recip()
            .unwrap();
            let want = gated
                .broadcast_mul(&rs)
                .unwrap()
                .reshape((b, inner))
                .unwrap()
                .broadcast_mul(&norm_w)
                .unwrap();
            let want_hist = full.narrow(1, 1, k - 1).unwrap();
            let what = format!("{h} heads × {p}, state {s}, {g} groups, conv {k}, {dt:?}");
            let (e_out, e_state, e_hist) = (
                max_abs_diff(&out, &want),
                max_abs_diff(&state_out, &want_state),
                max_abs_diff(&hist_out, &want_hist),
            );
            // (The output against its own scale: the norm leaves heavy tails — a product of
            // y and silu(z) — where one bf16 rounding is several hundredths.)
            let scale = want
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            let rel_out = e_out / scale.max(1.0);
            let tol_out = if dt == DType::F32 { 1e-5 } else { 1e-2 };
            eprintln!(
                "{what}: output {e_out:.2e} (of {scale:.1}), state {e_state:.2e}, conv window \
                 {e_hist:.1e}"
            );
            if rel_out > tol_out || e_state > 1e-4 || e_hist != 0.0 {
                failed.push(what);
            }
        }
    }
    assert!(failed.is_empty(), "off the composition: {failed:?}");
}

/// The families of `every_step_family` whose names start with `picked`, all of them.
fn picked_families(picked: &[&str]) -> Vec<Family> {
    let families: Vec<Family> = every_step_family()
        .into_iter()
        .filter(|f| picked.iter().any(|p| f.name.starts_with(p)))
        .collect();
    assert_eq!(families.len(), picked.len(), "a picked family is gone");
    families
}

/// Three rows of `lens[r] + steps` ids (its prompt, then the tokens each step feeds), the
/// prompts left-padded to the longest: the rows, their pads, and the prompts `[3, width]`.
fn left_padded(
    lens: [usize; 3],
    steps: usize,
    vocab: usize,
    dev: &Device,
) -> (Vec<Vec<u32>>, Vec<usize>, Tensor) {
    let width = lens.iter().copied().max().unwrap_or(0);
    let pads: Vec<usize> = lens.iter().map(|l| width - l).collect();
    let rows: Vec<Vec<u32>> = (0..3)
        .map(|r| batch_ids(lens[r] + steps, vocab, r as u32 + 1).0)
        .collect();
    let mut flat = Vec::new();
    for (row, (&l, &pad)) in rows.iter().zip(lens.iter().zip(&pads)) {
        flat.extend(std::iter::repeat_n(row[0], pad));
        flat.extend_from_slice(&row[..l]);
    }
    let prompts = Tensor::from_vec(flat, (3, width), dev).unwrap();
    (rows, pads, prompts)
}

/// The logits of the prefill of `prompts` into `cache`, then of `steps` steps feeding each
/// row's next ids (`rows[r][lens[r] + s]`).
fn decode_logits(
    m: &Model,
    cache: &mut cockpit::engine::model::BatchCache,
    prompts: &Tensor,
    (rows, lens): (&[Vec<u32>], &[usize]),
    steps: usize,
) -> Vec<Vec<Vec<f32>>> {
    let dev = prompts.device();
    let mut logits = |ids: &Tensor| {
        m.decode_batch(ids, cache, true)
            .unwrap()
            .logits
            .unwrap()
            .to_vec2::<f32>()
            .unwrap()
    };
    let mut got = vec![logits(prompts)];
    for s in 0..steps {
        let next: Vec<u32> = rows.iter().zip(lens).map(|(r, &l)| r[l + s]).collect();
        got.push(logits(
            &Tensor::from_vec(next, (rows.len(), 1), dev).unwrap(),
        ));
    }
    got
}

/// A batch's prefill with flash attention's forward (`kernels::flash_rows`: each query's
/// lowest key per row, left padding skipped, a sliding layer's window) gives the logits the
/// candle ops' prefill gives, and the steps after it too (bf16: within 5e-2 of the logits'
/// scale), on a llama (head dim 64), gemma3 (128, windows of 8), gemma2 (256 with the
/// soft-cap), phi3 (partial rotary, crossing its LongRoPE context in the prefill) and the
/// granite hybrid (its attention layer).
#[test]
fn flash_prefill_equals_the_ops_prefill() {
    let Some(dev) = gpu() else { return };
    let picked = [
        "llama: RMSNorm, SwiGLU, RoPE, no bias, GQA 4/2",
        "gemma3: head dim 128, 3 layers",
        "gemma2-2b-like: head dim 256 (flash with the soft-cap)",
        "phi3-like",
        "granite-4.0-h-like hybrid: 3 Mamba-2 layers",
    ];
    let mut failed = Vec::new();
    for f in picked_families(&picked) {
        let mut c = Config::default();
        c.model.seq_len = 32;
        (f.set)(&mut c);
        c.model.layout.window = c.model.layout.window.min(8);
        let spec = ModelSpec::from_config(&c, f.vocab);
        let cap = spec.attn_softcap().unwrap_or(0.0) as f32;
        assert!(
            kernels::flash_rows_takes(&dev, spec.head_dim(), cap),
            "{}: flash attention does not take head dim {}",
            f.name,
            spec.head_dim()
        );
        let m = Model::new(spec, DType::BF16, &dev, 5).unwrap();
        let lens = [20usize, 13, 17];
        let (rows, pads, prompts) = left_padded(lens, 2, f.vocab, &dev);
        let run = |flash: bool| -> Vec<Vec<Vec<f32>>> {
            let mut cache = m.batch_cache(&pads, lens[0] + 3).unwrap();
            cache.set_flash_prefill(flash);
            decode_logits(&m, &mut cache, &prompts, (&rows, &lens), 2)
        };
        let (flash, ops) = (run(true), run(false));
        let scale = ops
            .iter()
            .flatten()
            .flatten()
            .fold(0f32, |a, &b| a.max(b.abs()));
        let worst = flash
            .iter()
            .flatten()
            .flatten()
            .zip(ops.iter().flatten().flatten())
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        eprintln!(
            "{}: flash prefill off the ops by {worst:.3e} (of {scale:.2})",
            f.name
        );
        let finite = flash.iter().flatten().flatten().all(|v| v.is_finite());
        if !finite || worst > 5e-2 * scale.max(1.0) {
            failed.push(f.name);
        }
    }
    assert!(failed.is_empty(), "flash prefill off the ops: {failed:?}");
}

/// Flash attention's forward (`kernels::flash_rows`) against a host softmax of the same bf16
/// inputs where a row's scores rise steeply along its keys (head 0: 0.5 a key in log2 units, so
/// its running max moves up on every 64-key tile by more than the 2^8 the forward lets its
/// exponentials grow before it rescales O) or fall (head 1: the max stays at a row's first key),
/// the second batch row in windows of 100 keys; head dims 64, 128 and 256 (where the GPU has
/// them), T = 300 (a partial last tile). bf16: within 2e-2 of the outputs' scale.
#[test]
fn flash_forward_holds_rising_and_falling_scores() {
    let Some(dev) = gpu() else { return };
    let (b, t, h) = (2usize, 300usize, 2usize);
    let heads = h + 2; // q heads, one k head, one v head
    let mut failed = Vec::new();
    for d in [64usize, 128, 256] {
        if !kernels::flash_rows_takes(&dev, d, 0.0) {
            eprintln!("head dim {d}: no flash attention on this GPU, skipped");
            continue;
        }
        let scale = 1.0 / (d as f32).sqrt();
        let slope = 0.5 / (scale * std::f32::consts::LOG2_E);
        let x: Vec<f32> = (0..b * t * heads * d)
            .map(|i| {
                let (c, hh, ti) = (i % d, (i / d) % heads, (i / (d * heads)) % t);
                match (hh, c) {
                    (0, 0) => 1.0,
                    (1, 0) => -1.0,
                    (2, 0) => slope * ti as f32,
                    _ => 0.5 * hashed(i),
                }
            })
            .collect();
        let qkv = Tensor::from_vec(x, (b, t, heads, d), &dev)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let starts: Vec<u32> = (0..b * t)
            .map(|i| {
                if i / t == 1 {
                    (i % t).saturating_sub(99) as u32
                } else {
                    0
                }
            })
            .collect();
        let starts_t = Tensor::from_vec(starts.clone(), (b, t), &dev).unwrap();
        let got = host_f32(&kernels::flash_rows(&qkv, &starts_t, h, 1, scale, 0.0).unwrap());
        let xr = host_f32(&qkv);
        let at = |bi: usize, ti: usize, hh: usize| &xr[((bi * t + ti) * heads + hh) * d..][..d];
        let (mut worst, mut big) = (0f32, 0f32);
        for bi in 0..b {
            for ti in 0..t {
                let keys = starts[bi * t + ti] as usize..=ti;
                for hh in 0..h {
                    let q = at(bi, ti, hh);
                    let s: Vec<f32> = keys
                        .clone()
                        .map(|j| {
                            scale * q.iter().zip(at(bi, j, 2)).map(|(a, k)| a * k).sum::<f32>()
                        })
                        .collect();
                    let m = s.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                    let p: Vec<f32> = s.iter().map(|v| (v - m).exp()).collect();
                    let l: f32 = p.iter().sum();
                    for c in 0..d {
                        let want = keys
                            .clone()
                            .zip(&p)
                            .map(|(j, pj)| pj * at(bi, j, 3)[c])
                            .sum::<f32>()
                            / l;
                        let g = got[((bi * t + ti) * h + hh) * d + c];
                        worst = worst.max((g - want).abs());
                        big = big.max(want.abs());
                    }
                }
            }
        }
        eprintln!("head dim {d}: flash forward off the host softmax by {worst:.3e} (|out| up to {big:.2})");
        if worst.is_nan() || worst > 2e-2 * big.max(0.1) {
            failed.push(d);
        }
    }
    assert!(
        failed.is_empty(),
        "flash forward off the host softmax at head dims {failed:?}"
    );
}

/// Batched decoding on the GPU (attention through `kernels::decode_attention`, q and k through
/// candle's fused RoPE or the rotate-half ops, Mamba layers through `kernels::mamba_decode`)
/// gives each row the logits a forward of that row's tokens so far gives, f32: left-padded
/// prompts, then steps, on a llama (full rotary), qwen3 (QK-norm), gemma3 (sliding windows of 8,
/// local θ), a granite hybrid, and phi3's partial rotary with LongRoPE crossing its original
/// context mid-decode (equal prompts there: a padded row switches factors with the batch);
/// the ordinary steps, then the steps replayed from a CUDA graph.
#[test]
fn batched_decoding_on_the_gpu_equals_the_forward() {
    let Some(dev) = gpu() else { return };
    let picked = [
        "llama: RMSNorm, SwiGLU, RoPE, no bias, GQA 4/2",
        "qwen3: QK-norm per head, GQA 4/2",
        "gemma3: head dim 128, 3 layers",
        "phi3-like",
        "granite-4.0-h-like hybrid: 3 Mamba-2 layers",
    ];
    // First the ordinary steps; then the steps replayed from a CUDA graph (the first step
    // after the prompt runs without one, the second is captured; phi3-like's LongRoPE crossing
    // at the first step drops the graph and makes a new one).
    for graphed in [false, true] {
        decode_families_equal_the_forward(&dev, &picked, graphed);
    }
}

fn decode_families_equal_the_forward(dev: &Device, picked: &[&str], graphed: bool) {
    for f in picked_families(picked) {
        let mut c = Config::default();
        // (phi3-like's original context is half of this: 12 columns, crossed at the first step)
        c.model.seq_len = 24;
        (f.set)(&mut c);
        c.model.layout.window = c.model.layout.window.min(8);
        let long_rope = f.name.starts_with("phi3");
        let mut m = Model::new(ModelSpec::from_config(&c, f.vocab), DType::F32, dev, 5).unwrap();
        let (lens, steps) = if long_rope {
            ([12usize, 12, 12], 6)
        } else {
            ([12, 7, 9], 6)
        };
        let (rows, pads, prompts) = left_padded(lens, steps - 1, f.vocab, dev);
        let mut cache = m.batch_cache(&pads, lens[0] + steps).unwrap();
        if !graphed {
            cache.no_graph();
        }
        let got = decode_logits(&m, &mut cache, &prompts, (&rows, &lens), steps - 1);
        assert_eq!(
            cache.graphed(),
            graphed,
            "{}: steps replayed from a CUDA graph ({:?})",
            f.name,
            cache.graph_error()
        );
        for (r, (row, &l)) in rows.iter().zip(&lens).enumerate() {
            for (s, step) in got.iter().enumerate() {
                // (the forward of the row's tokens so far: LongRoPE picks its factors by them)
                let n = l + s;
                let x = Tensor::from_vec(row[..n].to_vec(), (1, n), dev).unwrap();
                let full: Vec<Vec<f32>> = m.forward(&x, false).unwrap().to_vec2().unwrap();
                let worst = full[n - 1]
                    .iter()
                    .zip(&step[r])
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0f32, f32::max);
                assert!(
                    worst < 1e-4,
                    "{}: row {r} step {s}: logits differ by {worst:.3e}",
                    f.name
                );
            }
        }
    }
}
