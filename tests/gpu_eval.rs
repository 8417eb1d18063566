//! The eval's per-token losses on CUDA (fused head + cross-entropy, fused CE and the plain
//! path) against the model's mean loss. Needs `--features cuda` and a GPU; passes with a
//! notice when no CUDA device opens.
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Tensor};
use cockpit::config::Config;
use cockpit::engine::model::{Model, ModelSpec};

#[test]
fn token_losses_average_to_the_loss() {
    let dev = match Device::new_cuda(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("no CUDA device ({e}): skipped");
            return;
        }
    };
    let vocab = 97;
    for dt in [DType::F32, DType::BF16] {
        for fused in [true, false] {
            let mut c = Config::default();
            c.model.n_embd = 64;
            c.model.n_head = 4;
            c.model.n_layer = 2;
            c.model.seq_len = 48;
            c.model.dropout = 0.0;
            c.kernels.linear = fused;
            c.kernels.cross_entropy = fused;
            let mut m = Model::new(ModelSpec::from_config(&c, vocab), dt, &dev, 5).unwrap();
            let ids: Vec<u32> = (0..3 * 48).map(|i| (i * 31 + 7) % vocab as u32).collect();
            let tg: Vec<u32> = (0..3 * 48).map(|i| (i * 17 + 3) % vocab as u32).collect();
            let x = Tensor::from_vec(ids, (3, 48), &dev).unwrap();
            let y = Tensor::from_vec(tg, (3, 48), &dev).unwrap();
            let mean: f32 = m.loss(&x, &y, false).unwrap().to_scalar().unwrap();
            let rows = m.token_losses(&x, &y).unwrap();
            assert_eq!(rows.dims(), &[3 * 48]);
            assert_eq!(rows.dtype(), DType::F32);
            let per: f32 = rows.mean_all().unwrap().to_scalar().unwrap();
            eprintln!("{dt:?} fused={fused}: loss {mean} vs mean of token losses {per}");
            assert!(
                (per - mean).abs() <= 1e-4 * mean.abs().max(1.0),
                "{per} vs {mean}"
            );
        }
    }
}
