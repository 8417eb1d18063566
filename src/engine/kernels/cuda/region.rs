//! Fused regions: blocks computed outside the autograd graph and attached to it as one node
//! (linear layers, attention, embedding, LM head with its loss).

use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::cuda_backend::{kernel_name, WrapErr};
use candle_core::{
    CpuStorage, CudaStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor,
};
use half::{bf16, f16};

use super::bias::{bias_add, col_sum};
use super::cross_entropy::{ce_bwd_t, cross_entropy_rows};
use super::softmax::{causal_softmax, softmax_bwd_t};
use super::{
    cpu_only, cuda_of, device_of, err, flat_cfg, i32_of, kernel_build, ptx_sm90, view, wrap, Elem,
    MODULE, MODULE_SM75, MODULE_SM90, PTX, PTX_SM75,
};

// Fused regions: a block computed outside the autograd graph (on detached tensors, with the
// kernels above and cuBLAS matmuls), attached to the graph as ONE node with a hand-written
// backward. candle's backprop materialises a zero tensor and an add for every graph edge, and
// every reshape/transpose is an edge: collapsing a linear layer or the attention core into one
// node removes most of those full-size adds and copies.

type RegionBwd = dyn Fn(&[Tensor], &Tensor) -> Result<Vec<Option<Tensor>>> + Send + Sync;

struct Region {
    name: &'static str,
    y: Tensor,
    bwd: Box<RegionBwd>,
}

fn copy_t<T: Elem>(y: &Tensor) -> Result<(CudaStorage, Shape)> {
    let dev = device_of(y)?;
    let (ys, yl) = y.storage_and_layout();
    let src = view::<T>(cuda_of(&ys)?, yl)?;
    // SAFETY: fully overwritten by the copy below.
    let mut out = unsafe { dev.alloc::<T>(y.elem_count())? };
    dev.memcpy_dtod(&src, &mut out)?;
    drop(ys);
    Ok((
        CudaStorage::wrap_cuda_slice(out, dev.clone()),
        y.shape().clone(),
    ))
}

impl Region {
    fn out(&self) -> Result<(CudaStorage, Shape)> {
        by_dtype!(self.y.dtype(), copy_t(&self.y))
    }
    fn grads(&self, args: &[&Tensor], grad: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let args: Vec<Tensor> = args.iter().map(|a| a.detach()).collect();
        let g = (self.bwd)(&args, &grad.contiguous()?)?;
        if g.len() != args.len() {
            return Err(err(format!(
                "{}: backward returned the wrong arity",
                self.name
            )));
        }
        Ok(g)
    }
}

impl CustomOp1 for Region {
    fn name(&self) -> &'static str {
        self.name
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        cpu_only(self.name)
    }
    fn cuda_fwd(&self, _: &CudaStorage, _: &Layout) -> Result<(CudaStorage, Shape)> {
        self.out()
    }
    fn bwd(&self, a: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let mut g = self.grads(&[a], grad)?;
        Ok(g.remove(0))
    }
}

impl CustomOp2 for Region {
    fn name(&self) -> &'static str {
        self.name
    }
    cpu_only_fwd!(2);
    fn cuda_fwd(
        &self,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        self.out()
    }
    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let mut g = self.grads(&[a, b], grad)?.into_iter();
        Ok((g.next().flatten(), g.next().flatten()))
    }
}

impl CustomOp3 for Region {
    fn name(&self) -> &'static str {
        self.name
    }
    cpu_only_fwd!(3);
    fn cuda_fwd(
        &self,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        self.out()
    }
    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        c: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let mut g = self.grads(&[a, b, c], grad)?.into_iter();
        Ok((g.next().flatten(), g.next().flatten(), g.next().flatten()))
    }
}

/// Attach `y` (computed from detached `args`) to the graph as one node over `args`.
fn attach(name: &'static str, args: &[&Tensor], y: Tensor, bwd: Box<RegionBwd>) -> Result<Tensor> {
    let y = y.contiguous()?;
    let r = Region { name, y, bwd };
    match args {
        [a] => a.apply_op1(r),
        [a, b] => a.apply_op2(b, r),
        [a, b, c] => a.apply_op3(b, c, r),
        _ => Err(err("fused region: 1 to 3 inputs")),
    }
}

/// `x·Wᵀ (+ b)` over the last dim of `x` `[.., in]` with `W` `[out, in]`, as one graph node:
/// forward one 2-D cuBLAS matmul and the bias kernel; backward `dx = dy·W`, `dW = dyᵀ·x` and
/// `db` by the column-sum kernel. Nothing reshaped or transposed enters the graph.
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let (out, inp) = w.dims2()?;
    let x_dims = x.dims().to_vec();
    let rows = x.elem_count() / inp.max(1);
    let mut y_dims = x_dims.clone();
    if let Some(l) = y_dims.last_mut() {
        *l = out;
    }
    let x2 = x.detach().reshape((rows, inp))?;
    let wd = w.detach();
    let mut y = x2.matmul(&wd.t()?)?;
    if let Some(b) = b {
        y = bias_add(&y, &b.detach())?;
    }
    let y = y.reshape(y_dims)?;
    let has_bias = b.is_some();
    let bwd: Box<RegionBwd> = Box::new(move |args, dy| {
        let (x, w) = (&args[0], &args[1]);
        let dy2 = dy.reshape((rows, out))?;
        let dx = dy2.matmul(w)?.reshape(x.dims())?;
        let dw = dy2.t()?.matmul(&x.reshape((rows, inp))?)?;
        let mut g = vec![Some(dx), Some(dw)];
        if has_bias {
            g.push(Some(col_sum(&dy2)?.to_dtype(args[2].dtype())?));
        }
        Ok(g)
    });
    match b {
        Some(b) => attach("cockpit-linear", &[x, w, b], y, bwd),
        None => attach("cockpit-linear", &[x, w], y, bwd),
    }
}

fn split_heads_t<T: Elem>(
    qkv: &Tensor,
    (b, t, h, hd): (usize, usize, usize, usize),
) -> Result<(Tensor, Tensor, Tensor)> {
    let dev = device_of(qkv)?;
    let n = b * t * h * hd;
    let (qs, ql) = qkv.storage_and_layout();
    let src = view::<T>(cuda_of(&qs)?, ql)?;
    // SAFETY: every element of q, k, v is written by the kernel.
    let (q, k, v) = unsafe { (dev.alloc::<T>(n)?, dev.alloc::<T>(n)?, dev.alloc::<T>(n)?) };
    let f = load_kernel!(&dev, &kernel_name::<T>("qkv_split"))?;
    let dims = [
        i32_of(b, "B")?,
        i32_of(t, "T")?,
        i32_of(h, "H")?,
        i32_of(hd, "hd")?,
    ];
    // SAFETY: argument list matches the kernel; qkv holds 3·n elements.
    unsafe { launch!(f, flat_cfg(3 * n), [&src, &q, &k, &v], &dims) }.w()?;
    drop(qs);
    let shape = (b, h, t, hd);
    Ok((
        wrap(q, &dev, shape),
        wrap(k, &dev, shape),
        wrap(v, &dev, shape),
    ))
}

/// Parts `[B, H, T, hd]` → one `[B, T, parts·H·hd]` buffer (part i at columns i·H·hd..).
fn merge_heads_t<T: Elem>(
    parts: &[&Tensor],
    (b, t, h, hd): (usize, usize, usize, usize),
) -> Result<Tensor> {
    let first = parts.first().ok_or_else(|| err("merge_heads: no parts"))?;
    let dev = device_of(first)?;
    let c = h * hd;
    let ld = parts.len() * c;
    // SAFETY: every element is written by one of the launches below.
    let dst = unsafe { dev.alloc::<T>(b * t * ld)? };
    let f = load_kernel!(&dev, &kernel_name::<T>("heads_merge"))?;
    for (i, p) in parts.iter().enumerate() {
        let p = p.contiguous()?;
        if p.dims() != [b, h, t, hd] {
            return Err(err("merge_heads: part shape"));
        }
        let (ps, pl) = p.storage_and_layout();
        let src = view::<T>(cuda_of(&ps)?, pl)?;
        let args = [
            i32_of(b, "B")?,
            i32_of(t, "T")?,
            i32_of(h, "H")?,
            i32_of(hd, "hd")?,
            i32_of(ld, "ld")?,
            i32_of(i * c, "offset")?,
        ];
        // SAFETY: argument list matches the kernel; dst holds B·T·ld elements.
        unsafe { launch!(f, flat_cfg(b * t * c), [&src, &dst], &args) }.w()?;
    }
    Ok(wrap(dst, &dev, (b, t, ld)))
}

fn embedding_bwd_t<T: Elem>(ids: &Tensor, dy: &Tensor, vocab: usize) -> Result<Tensor> {
    let dev = device_of(dy)?;
    let d = *dy
        .dims()
        .last()
        .ok_or_else(|| err("embedding: scalar grad"))?;
    let n = dy.elem_count() / d.max(1);
    let (is, il) = ids.storage_and_layout();
    let (ds, dl) = dy.storage_and_layout();
    let iv = view::<u32>(cuda_of(&is)?, il)?;
    let dv = view::<T>(cuda_of(&ds)?, dl)?;
    let dw = dev.alloc_zeros::<f32>(vocab * d)?;
    let f = load_kernel!(&dev, &kernel_name::<T>("embedding_bwd"))?;
    let args = [
        i32_of(n, "rows")?,
        i32_of(d, "dim")?,
        i32_of(vocab, "vocab")?,
    ];
    // SAFETY: argument list matches the kernel; dw is a zeroed [vocab, d] f32 accumulator.
    unsafe { launch!(f, flat_cfg(n * d), [&iv, &dv, &dw], &args) }.w()?;
    drop((is, ds));
    Ok(wrap(dw, &dev, (vocab, d)))
}

/// Token embedding `w[ids]` (ids u32, any shape) as one graph node; the backward scatters
/// the gradient rows with f32 atomics (no index_add over the vocabulary).
pub fn embedding(ids: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (vocab, d) = w.dims2()?;
    let ids = ids.contiguous()?;
    let mut dims = ids.dims().to_vec();
    dims.push(d);
    let y = w.detach().embedding(&ids.flatten_all()?)?.reshape(dims)?;
    let bwd: Box<RegionBwd> = Box::new(move |args, dy| {
        let dw = by_dtype!(dy.dtype(), embedding_bwd_t(&args[0], dy, vocab))?;
        Ok(vec![None, Some(dw.to_dtype(args[1].dtype())?)])
    });
    attach("cockpit-embedding", &[&ids, w], y, bwd)
}

/// Causal self-attention core on packed projections `qkv` `[B, T, 3·H·hd]` (q | k | v) →
/// `[B, T, H·hd]`, as one graph node: scores by a batched cuBLAS matmul, the fused causal
/// softmax kernel, probabilities·v; the backward reuses the saved probabilities
/// (`dS = softmax_bwd(P, dY·Vᵀ)`, `dQ = dS·K`, `dK = dSᵀ·Q`, `dV = Pᵀ·dY`).
pub fn causal_attention_qkv(qkv: &Tensor, n_head: usize, scale: f64) -> Result<Tensor> {
    let (b, t, c3) = qkv.dims3()?;
    let c = c3 / 3;
    if c * 3 != c3 || n_head == 0 || c % n_head != 0 {
        return Err(err("fused attention: qkv width must be 3·H·hd"));
    }
    let hd = c / n_head;
    let dims = (b, t, n_head, hd);
    let x = qkv.detach().contiguous()?;
    let (q, k, v) = by_dtype!(x.dtype(), split_heads_t(&x, dims))?;
    let p = causal_softmax(&q.matmul(&k.t()?)?, scale)?;
    let y = by_dtype!(x.dtype(), merge_heads_t(&[&p.matmul(&v)?], dims))?;
    let scale = scale as f32;
    let bwd: Box<RegionBwd> = Box::new(move |_args, dy| {
        let dyh = dy
            .reshape((b, t, n_head, hd))?
            .transpose(1, 2)?
            .contiguous()?;
        let dt = dy.dtype();
        let dp = dyh.matmul(&v.t()?)?;
        let dv = p.t()?.matmul(&dyh)?;
        let ds = by_dtype!(p.dtype(), softmax_bwd_t(&p, &dp, scale))?;
        let dq = ds.matmul(&k)?;
        let dk = ds.t()?.matmul(&q)?;
        let dqkv = by_dtype!(dt, merge_heads_t(&[&dq, &dk, &dv], dims))?;
        Ok(vec![Some(dqkv)])
    });
    attach("cockpit-attention", &[qkv], y, bwd)
}

/// Per-row cross-entropy (f32 `[N]`) of the logits `x·headᵀ` (`x` `[N, D]`, `head` `[V, D]`)
/// against u32 targets, as ONE graph node: the `[N, V]` logits live only inside it (no
/// gradient accumulation or copy of the logits in the graph); backward: the CE kernel writes
/// dlogits in the compute dtype, then `dx = dlogits·head`, `dhead = dlogitsᵀ·x`.
pub fn lm_head_cross_entropy(x: &Tensor, head: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let t = targets.flatten_all()?.contiguous()?;
    let logits = x.detach().matmul(&head.detach().t()?)?;
    let loss = cross_entropy_rows(&logits, &t)?;
    let saved_loss = loss.clone();
    let bwd: Box<RegionBwd> = Box::new(move |args, dy| {
        let (x, head, t) = (&args[0], &args[1], &args[2]);
        let g = dy.to_dtype(DType::F32)?.contiguous()?;
        let dl = by_dtype!(logits.dtype(), ce_bwd_t(&logits, t, &saved_loss, &g))?;
        let dx = dl.matmul(head)?;
        let dhead = dl.t()?.matmul(x)?;
        Ok(vec![Some(dx), Some(dhead), None])
    });
    attach("cockpit-lm-head-ce", &[x, head, &t], loss, bwd)
}
