//! Flash attention's forward (flash.cu, flash_sm90.cu on Hopper: the whole-model step's
//! kernels) on candle tensors, for a batched generation's prefill
//! (src/engine/model/decode_batch.rs): each query's lowest key given per row — a left-padded
//! row's tokens skip its padding, a sliding layer's queries their window — and no
//! `[B, H, T, T]` scores.

use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{DType, Device, Result, Tensor};
use half::bf16;

use super::kernels::{Flash, Kern};
use crate::engine::kernels::cuda::{
    cuda_of, device_of, err, flash_fits, i32_of, kernel_build, load_function, view, wrap,
};
use crate::engine::spec::{FLASH_HEAD_DIMS, FLASH_SOFTCAP_HEAD_DIM};

/// Whether [`flash_rows`] takes heads of `hd` dims on `device` (a head dim flash.cu has, with
/// its shared memory on this GPU; a soft-cap only at the head dim whose kernels have one).
pub fn flash_rows_takes(device: &Device, hd: usize, softcap: f32) -> bool {
    match device {
        Device::Cuda(d) => {
            FLASH_HEAD_DIMS.contains(&hd)
                && flash_fits(d, hd)
                && (softcap <= 0.0 || hd == FLASH_SOFTCAP_HEAD_DIM)
        }
        _ => false,
    }
}

/// softmax(scale·q·Kᵀ (soft-capped where `softcap > 0`))·V of every query over the keys
/// `starts[b, t]..=t` of its row: `qkv` `[B, T, H + 2·KVH, D]` bf16 (q heads, k heads, v
/// heads; RoPE applied), `starts` `[B, T]` (u32, non-decreasing along T, each `<= t`) →
/// `[B, T, H, D]` bf16.
pub fn flash_rows(
    qkv: &Tensor,
    starts: &Tensor,
    n_head: usize,
    n_kv_head: usize,
    scale: f32,
    softcap: f32,
) -> Result<Tensor> {
    let (b, t, heads, d) = qkv.dims4()?;
    if qkv.dtype() != DType::BF16
        || starts.dtype() != DType::U32
        || starts.dims() != [b, t]
        || heads != n_head + 2 * n_kv_head
        || n_kv_head == 0
        || !n_head.is_multiple_of(n_kv_head)
        || !flash_rows_takes(qkv.device(), d, softcap)
    {
        return Err(err(format!(
            "flash rows: qkv {:?} {:?} of {n_head} + 2·{n_kv_head} heads, starts {:?} {:?}",
            qkv.dtype(),
            qkv.dims(),
            starts.dtype(),
            starts.dims()
        )));
    }
    let dev = device_of(qkv)?;
    let named = |name: &str, group: &'static str| -> Result<Kern> {
        Ok(Kern {
            f: load_function(&dev, name, false)?,
            name: group,
        })
    };
    let flash = Flash::load(&named, d, kernel_build(&dev) == "sm90")?;
    // SAFETY: the forward writes every element of o and lse.
    let o = unsafe { dev.alloc::<bf16>(b * t * n_head * d)? };
    let lse = unsafe { dev.alloc::<f32>(b * n_head * t)? };
    let qkv = qkv.contiguous()?;
    let starts = starts.contiguous()?;
    let (qs, ql) = qkv.storage_and_layout();
    let (ss, sl) = starts.storage_and_layout();
    let (qv, sv) = (
        view::<bf16>(cuda_of(&qs)?, ql)?,
        view::<u32>(cuda_of(&ss)?, sl)?,
    );
    let (b_i, t_i, h_i, kvh_i) = (
        i32_of(b, "rows")?,
        i32_of(t, "columns")?,
        i32_of(n_head, "heads")?,
        i32_of(n_kv_head, "key/value heads")?,
    );
    let cfg = LaunchConfig {
        grid_dim: ((b * n_head) as u32, t.div_ceil(flash.fwd_block.1) as u32, 1),
        block_dim: (flash.fwd_block.0, 1, 1),
        shared_mem_bytes: flash.fwd_smem,
    };
    // (No dropout: its seed and kept-flags are null.)
    let (null, zero, one) = (0u64, 0u32, 1f32);
    let stream = dev.cuda_stream();
    // SAFETY: the arguments match flash.cu's forward contract (qkv, o, lse, B, T, H, KVH,
    // scale, seed, site, thr, dscale, mbits, starts, cap): qkv holds B·T·(H + 2·KVH)·D bf16,
    // o B·T·H·D, lse B·H·T floats, starts B·T ints (u32 below 2³¹); the dynamic shared memory
    // is the kernel's own, allowed by `Flash::load`.
    unsafe {
        stream
            .launch_builder(&flash.fwd.f)
            .arg(&qv)
            .arg(&o)
            .arg(&lse)
            .arg(&b_i)
            .arg(&t_i)
            .arg(&h_i)
            .arg(&kvh_i)
            .arg(&scale)
            .arg(&null)
            .arg(&zero)
            .arg(&zero)
            .arg(&one)
            .arg(&null)
            .arg(&sv)
            .arg(&softcap)
            .launch(cfg)
    }
    .w()?;
    drop((qs, ss, lse));
    Ok(wrap(o, &dev, (b, t, n_head, d)))
}
