//! Decode attention (decode_attention.cuh): each row's one new query against the keys and
//! values of a batched generation cache, for src/engine/model/decode_batch.rs on CUDA — the
//! keys in chunks across blocks, then the chunks' softmaxes merged: two launches a layer
//! instead of the matmuls, mask, soft-cap and softmax of the candle ops, and no `[B, H, len]`
//! temporaries that grow with the context.

use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{kernel_name, WrapErr};
use candle_core::{DType, Result, Tensor};
use half::{bf16, f16};

use super::super::{DecodeAt, DecodeSpan};
use super::{
    cuda_of, device_of, err, i32_of, kernel_build, ptx_sm90, view, wrap, Elem, MODULE, MODULE_SM75,
    MODULE_SM90, PTX, PTX_SM75,
};

/// Threads a block (DA_THREADS in decode_attention.cuh).
const THREADS: u32 = 128;
/// Shared memory a block may take without opting in.
const SMEM: usize = 48 * 1024;

/// The keys a block takes (256, halved until `rep` heads' queries and scores fit 48 KB of
/// shared memory, not below 32), or None where even that does not fit.
fn chunk(rep: usize, hd: usize) -> Option<usize> {
    let mut c = 256;
    while rep * (hd + c) * 4 > SMEM {
        if c == 32 {
            return None;
        }
        c /= 2;
    }
    Some(c)
}

/// Whether [`decode_attention`] takes heads of `hd` dims, `n_head` of them over `n_kv_head`
/// key/value heads (a head dim of multiples of 8 up to 512, and shared memory for the group).
pub fn decode_attention_takes(n_head: usize, n_kv_head: usize, hd: usize) -> bool {
    n_kv_head > 0
        && n_head.is_multiple_of(n_kv_head)
        && hd.is_multiple_of(8)
        && (8..=512).contains(&hd)
        && chunk(n_head / n_kv_head, hd).is_some()
}

/// softmax(scale·q·Kᵀ (soft-capped) + mask)·V of each row's new query: `q` `[B, H, hd]`,
/// the cache's `keys` and `values` `[B, KVH, cap, hd]`, the additive padding `mask`
/// `[B, cap]` (0 or −inf), all contiguous in one dtype (f32, bf16, f16) → `[B, H, hd]`.
pub fn decode_attention(
    q: &Tensor,
    keys: &Tensor,
    values: &Tensor,
    mask: &Tensor,
    span: DecodeSpan,
) -> Result<Tensor> {
    by_dtype!(q.dtype(), decode_t(q, keys, values, mask, span, None))
}

/// [`decode_attention`] with the columns read from the device at run time (`at`): the launch
/// takes the same arguments at every step, as a step captured in a CUDA graph must.
pub fn decode_attention_at(
    q: &Tensor,
    keys: &Tensor,
    values: &Tensor,
    mask: &Tensor,
    at: DecodeAt,
) -> Result<Tensor> {
    let span = DecodeSpan {
        lo: 0,
        len: 0,
        scale: at.scale,
        softcap: at.softcap,
    };
    by_dtype!(
        q.dtype(),
        decode_t(
            q,
            keys,
            values,
            mask,
            span,
            Some((at.at, at.window.unwrap_or(0)))
        )
    )
}

fn decode_t<T: Elem>(
    q: &Tensor,
    keys: &Tensor,
    values: &Tensor,
    mask: &Tensor,
    span: DecodeSpan,
    at: Option<(&Tensor, usize)>,
) -> Result<Tensor> {
    let (b, h, hd) = q.dims3()?;
    let (kb, kvh, cap, khd) = keys.dims4()?;
    if (kb, khd) != (b, hd) || values.dims() != keys.dims() || mask.dims() != [b, cap] {
        return Err(err(format!(
            "decode attention: q {:?}, keys {:?}, values {:?}, mask {:?} do not agree",
            q.dims(),
            keys.dims(),
            values.dims(),
            mask.dims()
        )));
    }
    if [keys, values, mask].iter().any(|t| t.dtype() != q.dtype()) {
        return Err(err(
            "decode attention: q, keys, values and mask in one dtype",
        ));
    }
    let host_span_bad = at.is_none() && (span.lo >= span.len || span.len > cap);
    if let Some((t, _)) = at {
        if t.dtype() != DType::U32 || t.dims() != [2] {
            return Err(err(format!(
                "decode attention: the step's columns as u32 [2], not {:?} {:?}",
                t.dtype(),
                t.dims()
            )));
        }
    }
    if !decode_attention_takes(h, kvh, hd) || host_span_bad {
        return Err(err(format!(
            "decode attention: {h} heads over {kvh} of {hd} dims, columns {}..{} of {cap}",
            span.lo, span.len
        )));
    }
    let rep = h / kvh;
    let chunk = chunk(rep, hd).ok_or_else(|| err("decode attention: no chunk fits"))?;
    // (Columns read at run time: chunks for the whole cache, those past its length empty.)
    let nsplit = match at {
        Some(_) => cap.div_ceil(chunk),
        None => (span.len - span.lo).div_ceil(chunk),
    };
    let dev = device_of(q)?;
    // SAFETY: every chunk's slot is written by the split kernel, every output by the merge.
    let part = unsafe { dev.alloc::<f32>(b * h * nsplit * (hd + 2))? };
    let y = unsafe { dev.alloc::<T>(b * h * hd)? };
    let split = load_kernel!(&dev, &kernel_name::<T>("decode_attn_split"))?;
    let merge = load_kernel!(&dev, &kernel_name::<T>("decode_attn_merge"))?;
    let (qs, ql) = q.storage_and_layout();
    let (ks, kl) = keys.storage_and_layout();
    let (vs, vl) = values.storage_and_layout();
    let (ms, ml) = mask.storage_and_layout();
    let at_store = at.map(|(t, _)| t.storage_and_layout());
    let at_view = match &at_store {
        Some((s, l)) => Some(view::<u32>(cuda_of(s)?, l)?),
        None => None,
    };
    let window_i = i32_of(at.map_or(0, |(_, w)| w), "window")?;
    // (A null pointer: the host's columns.)
    let null = 0u64;
    let (qv, kv, vv, mv) = (
        view::<T>(cuda_of(&qs)?, ql)?,
        view::<T>(cuda_of(&ks)?, kl)?,
        view::<T>(cuda_of(&vs)?, vl)?,
        view::<T>(cuda_of(&ms)?, ml)?,
    );
    let (h_i, kvh_i, cap_i, hd_i) = (
        i32_of(h, "heads")?,
        i32_of(kvh, "key/value heads")?,
        i32_of(cap, "cache columns")?,
        i32_of(hd, "head dim")?,
    );
    let (lo_i, len_i, chunk_i, nsplit_i) = (
        i32_of(span.lo, "lo")?,
        i32_of(span.len, "len")?,
        i32_of(chunk, "chunk")?,
        i32_of(nsplit, "chunks")?,
    );
    let cfg = LaunchConfig {
        grid_dim: ((b * kvh) as u32, nsplit as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: (rep * (hd + chunk) * 4) as u32,
    };
    // SAFETY: the arguments match decode_attn_split_<T>; q holds B·H·hd elements, keys and
    // values B·KVH·cap·hd, mask B·cap, part B·H·nsplit·(hd + 2) floats, `at` 2 u32 (or is
    // null); the shared memory is the kernel's rep·(hd + chunk) floats.
    unsafe {
        let mut b = split.builder();
        b.arg(&qv)
            .arg(&kv)
            .arg(&vv)
            .arg(&mv)
            .arg(&part)
            .arg(&h_i)
            .arg(&kvh_i)
            .arg(&cap_i)
            .arg(&hd_i)
            .arg(&lo_i)
            .arg(&len_i);
        match &at_view {
            Some(v) => b.arg(v),
            None => b.arg(&null),
        };
        b.arg(&window_i)
            .arg(&chunk_i)
            .arg(&span.scale)
            .arg(&span.softcap);
        b.launch(cfg)
    }
    .w()?;
    let cfg = LaunchConfig {
        grid_dim: ((b * h) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match decode_attn_merge_<T>; y holds B·H·hd elements.
    unsafe { launch!(merge, cfg, [&part, &y, &h_i, &hd_i, &nsplit_i]) }.w()?;
    drop((qs, ks, vs, ms, at_store));
    Ok(wrap(y, &dev, (b, h, hd)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_chunk_halves_until_the_group_fits() {
        assert_eq!(chunk(4, 64), Some(256));
        assert_eq!(chunk(8, 256), Some(256));
        assert_eq!(chunk(16, 256), Some(256));
        assert_eq!(chunk(32, 128), Some(256));
        assert_eq!(chunk(32, 256), Some(128));
        assert_eq!(chunk(64, 128), Some(64));
        assert_eq!(chunk(128, 128), None);
        assert!(decode_attention_takes(32, 8, 64));
        assert!(!decode_attention_takes(32, 8, 60));
        assert!(!decode_attention_takes(30, 8, 64));
    }
}
