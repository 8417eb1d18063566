//! Building the step for one model: its shape, flat buffers and kernels ([`ModelStep::new`]).

use candle_core::cuda_backend::WrapErr;
use candle_core::{DType, Device, Result, Tensor, Var};
use half::bf16;

use super::attention::rope_table;
use super::kernels::Kernels;
use super::mamba_bufs::{MambaDims, MambaIdx};
use super::moe_bufs::{MoeDims, MoeIdx};
use super::params::{ptrs_16, LayerIdx, Layout, LoraIdx, LORA_GROUPS};
use super::{align, ptr, tensor_ptr, ModelStep, ALIGN};
use crate::config::{Activation, Norm, QkNorm, Recompute};
use crate::engine::dropout;
use crate::engine::kernels::cuda::{err, with_f32_ptrs, with_ptrs};
use crate::engine::kernels::lt::Lt;
use crate::engine::kernels::quantized::Quantized;
use crate::engine::kernels::side::Side;
use crate::engine::kernels::spec::{StepMixer, StepWeights};
use crate::engine::spec::RopeKey;

impl ModelStep {
    pub fn new(w: &StepWeights) -> Result<Self> {
        let Device::Cuda(dev) = w.wte.as_tensor().device().clone() else {
            return Err(err("the whole-model step needs a CUDA device"));
        };
        let stream = dev.cuda_stream();
        let blas = dev.cublas_handle();
        // Every dimension from the spec, which also says whether the step runs the model
        // (the weights are checked against it).
        let s = &w.spec;
        let (vocab, c) = (s.vocab_size, s.n_embd);
        let flash = w.flash && crate::engine::kernels::spec::FLASH_HEAD_DIMS.contains(&s.head_dim);
        s.step_shape_support(flash)
            .map_err(|why| err(format!("whole-model step: {why}")))?;
        // (A hybrid's shared MLP is SwiGLU whatever `activation` says, gate | up one matrix.)
        let mamba = s.hybrid.as_ref().map(MambaDims::new);
        let moe = s.hybrid.as_ref().and_then(MoeDims::new);
        let (hidden, swiglu, t) = (s.hidden, s.gated_mlp() || mamba.is_some(), s.seq_len);
        let gate_apart = swiglu && mamba.is_none();
        let (n_head, n_kv_head, hd, att_c) = (s.n_head, s.n_kv_head, s.head_dim, s.q_width());
        w.check_shapes()
            .map_err(|why| err(format!("whole-model step: {why}")))?;
        let k = Kernels::load(&dev, &stream, c, w.half)?;
        // First the matrices whose gradient a weight-gradient matmul writes first in every
        // step (it overwrites: no zeroing), then everything whose gradient is summed from
        // zero (biases, norms, positions, an untied embedding): only that tail is cleared.
        // q|k|v (and a SwiGLU MLP's gate|up) are packed: one matrix, one matmul.
        // A frozen base (LoRA) goes to the frozen buffer instead; its adapters are the
        // trainable matrices.
        let mut lay = Layout {
            frozen: w.frozen_base,
            ..Layout::default()
        };
        let tied = w.head.is_none();
        let wte_first = tied.then(|| lay.push(&w.wte, true));
        let (h_out, kv_out) = (n_head * hd, n_kv_head * hd);
        let up_col = if gate_apart { hidden } else { 0 };
        let mut mats: Vec<([usize; 4], [Option<LoraIdx>; 7])> = Vec::new();
        for l in &w.layers {
            // (A Mamba layer: in_proj where q|k|v go, out_proj where o goes.)
            let (qkv, o) = match &l.mixer {
                StepMixer::Attention(at) => (
                    lay.pack_mats(&[&at.q.0, &at.k.0, &at.v.0]),
                    lay.push_mat(&at.o.0, true),
                ),
                StepMixer::Mamba(m) => (
                    lay.pack_mats(&[&m.in_proj.0]),
                    lay.push_mat(&m.out_proj.0, true),
                ),
            };
            let up = match &l.gate {
                Some(g) => lay.pack_mats(&[&g.0, &l.up.0]),
                None => lay.push_mat(&l.up.0, true),
            };
            let down = lay.push_mat(&l.down.0, true);
            let cols = [0, h_out, h_out + kv_out, 0, 0, up_col, 0];
            let mut lora = [None; 7];
            for group in LORA_GROUPS {
                lay.adapters(&l.lora, group, &cols, &mut lora)?;
            }
            mats.push(([qkv, o, up, down], lora));
        }
        let head = w.head.as_ref().map(|v| lay.push(v, true));
        // (Every trainable entry after the matrices starts aligned: the tail from here on.)
        let zero_from = align(lay.off);
        let wte = match wte_first {
            Some(i) => i,
            None => lay.push(&w.wte, true),
        };
        let wpe = w.wpe.as_ref().map(|v| lay.push(v, true));
        let mut layers = Vec::with_capacity(w.layers.len());
        for (l, ([qkv_w, o_w, up_w, down_w], lora)) in w.layers.iter().zip(mats) {
            if l.gate.is_some() != gate_apart {
                return Err(err("whole-model step: every layer needs the same MLP"));
            }
            let ln1_w = lay.push(&l.ln1.0, true);
            let ln1_b = lay.push_opt(&l.ln1.1);
            let (qkv_b, o_b) = match &l.mixer {
                StepMixer::Attention(at) => (
                    lay.pack_biases(&[&at.q, &at.k, &at.v], "q, k and v")?,
                    lay.push_opt(&at.o.1),
                ),
                StepMixer::Mamba(m) => (lay.push_opt(&m.in_proj.1), lay.push_opt(&m.out_proj.1)),
            };
            let ln2_w = lay.push(&l.ln2.0, true);
            let ln2_b = lay.push_opt(&l.ln2.1);
            // (A Mamba layer's own weights: in this zeroed tail, as its kernels add their
            // gradients into it.)
            let (qk_norm, mamba_idx) = match &l.mixer {
                StepMixer::Attention(at) => (
                    at.qk_norm
                        .as_ref()
                        .map(|(q, k)| (lay.push(q, true), lay.push(k, true))),
                    None,
                ),
                StepMixer::Mamba(m) => (
                    None,
                    Some(MambaIdx {
                        conv_w: lay.push(&m.conv_w, true),
                        conv_b: lay.push_opt(&m.conv_b),
                        dt_bias: lay.push(&m.dt_bias, true),
                        a_log: lay.push(&m.a_log, true),
                        d: lay.push(&m.d, true),
                        norm: lay.push(&m.norm, true),
                    }),
                ),
            };
            // (OLMo 2: the block's own two norms go on the outputs.)
            let post = match &l.post {
                Some((pa, pm)) => Some((lay.push(pa, true), lay.push(pm, true))),
                None if s.layout.post_norm => Some((ln1_w, ln2_w)),
                None => None,
            };
            // (Routed experts' gradients go here too: an expert no row picked in the step's
            // first micro-batch has no matmul to overwrite its gradient.)
            let moe_idx = l.moe.as_ref().map(|m| MoeIdx {
                router: lay.push(&m.router, true),
                gate_up: lay.push(&m.gate_up, true),
                down: lay.push(&m.down, true),
            });
            if moe_idx.is_some() != moe.is_some() {
                return Err(err("whole-model step: routed experts in some layers only"));
            }
            let up_b = match &l.gate {
                Some(g) => lay.pack_biases(&[g, &l.up], "gate and up")?,
                None => lay.push_opt(&l.up.1),
            };
            layers.push(LayerIdx {
                ln1_w,
                ln1_b,
                qkv_w,
                qkv_b,
                o_w,
                o_b,
                ln2_w,
                ln2_b,
                up_w,
                up_b,
                down_w,
                down_b: lay.push_opt(&l.down.1),
                lora,
                qk_norm,
                post,
                mamba: mamba_idx,
                moe: moe_idx,
            });
        }
        let lnf = (lay.push(&w.ln_f.0, true), lay.push_opt(&w.ln_f.1));
        // (A multiple of the ranks' aligned ranges, for a sharded optimizer's reduce-scatter.)
        let total = lay.off.max(1).div_ceil(ALIGN * w.shards.max(1)) * ALIGN * w.shards.max(1);
        let frozen_total = align(lay.frozen_off);
        let mut entries = lay.entries;
        // Frozen bf16 matrices are read where the model keeps them.
        let ext: Vec<usize> = (0..entries.len()).filter(|&i| entries[i].ext).collect();
        let ts: Vec<&Tensor> = ext
            .iter()
            .filter_map(|&i| entries[i].var.as_ref().map(Var::as_tensor))
            .collect();
        // (A frozen base is stored in the step's own 16-bit type: bf16, or fp16 for an fp16 step.)
        let ptrs = ptrs_16(&ts, w.half)?;
        for (&i, p) in ext.iter().zip(ptrs) {
            entries[i].ext_ptr = p;
        }
        // Quantized base matrices: their parts' addresses, and one bf16 scratch of the largest,
        // which each matmul through one of them dequantizes into first (on the main stream,
        // which alone reads base weights).
        let mut quant_len = 0;
        for e in entries.iter_mut() {
            let Some(q) = &e.quant else { continue };
            e.quant_ptrs = match &**q {
                Quantized::Nf4(q) => {
                    let codes = with_ptrs::<u8, _>(&[&q.codes, &q.absq], |p| Ok([p[0], p[1]]))?;
                    let gscale = with_f32_ptrs(&[&q.gscale], |p| Ok(p[0]))?;
                    [codes[0], codes[1], gscale]
                }
                Quantized::Ggml(g) => [with_ptrs::<u8, _>(&[&g.data], |p| Ok(p[0]))?, 0, 0],
            };
            quant_len = quant_len.max(e.n);
        }
        // SAFETY: written by the dequantization before each read.
        let quant_buf = unsafe { dev.alloc::<bf16>(quant_len.max(1))? };
        let quant_p = ptr(&quant_buf, &stream);
        // (Written by the cast kernel or the fused update before every read.)
        let wbf = Tensor::zeros(total, DType::BF16, &Device::Cuda(dev.clone()))?;
        let wbf_p = tensor_ptr::<bf16>(&wbf, &stream)?;
        // SAFETY: likewise (cast whenever the trainable copies are).
        let fbf = unsafe { dev.alloc::<bf16>(frozen_total.max(ALIGN))? };
        let fbf_p = ptr(&fbf, &stream);
        let grad = Tensor::zeros(total, DType::F32, &Device::Cuda(dev.clone()))?;
        let grad_p = tensor_ptr::<f32>(&grad, &stream)?;
        let by_id = entries
            .iter()
            .enumerate()
            .filter_map(|(i, e)| e.var.as_ref().map(|v| (v.as_tensor().id(), i)))
            .collect();
        // (A hybrid's attention may have no position encoding at all: NoPE.) The model's table
        // is LongRoPE's long one where T is past the original context, as for a forward of T.
        let global = RopeKey {
            local: false,
            long: s.rope_long(t),
        };
        let rope = match s.rope() {
            true => Some(
                stream
                    .clone_htod(&rope_table(&s.rope_freqs(global), t))
                    .w()?,
            ),
            false => None,
        };
        // Gemma 3's sliding layers rotate with their own θ.
        let local_rope: Vec<bool> = (0..s.n_layer).map(|l| s.layer_rope(l, t).local).collect();
        let rope_local = match (s.rope(), local_rope.contains(&true)) {
            (true, true) => {
                let f = s.rope_freqs(RopeKey {
                    local: true,
                    long: false,
                });
                Some(stream.clone_htod(&rope_table(&f, t)).w()?)
            }
            _ => None,
        };
        let sliding: Vec<bool> = (0..s.n_layer)
            .map(|l| s.layer_window(l).is_some())
            .collect();
        let mut lt = Lt::new(stream.clone(), s.kernels.autotune, w.half).ok();
        // The second stream needs its own cuBLASLt workspace; without either, one stream.
        // Recompute rewrites shared activation buffers that the side stream's weight
        // gradients would still be reading: one stream then.
        let overlap = s.kernels.overlap && s.recompute == Recompute::None;
        let side = match (overlap, lt.as_mut()) {
            (true, Some(lt)) => lt.enable_side().and_then(|()| Side::new(&stream)).ok(),
            _ => None,
        };
        let mut step = Self {
            half: w.half,
            dev,
            stream,
            blas,
            lt,
            epilogues: s.kernels.bias_gelu,
            // (Routed experts' matmuls take each layer's counts from the host: no graphs.)
            graphs: s.kernels.graphs && moe.is_none(),
            side,
            sums: None,
            sum_now: false,
            k,
            n_layer: layers.len(),
            c,
            n_head,
            n_kv_head,
            hd,
            att_c,
            mamba,
            moe,
            moe_host: Default::default(),
            moe_aux_coef: s.hybrid.as_ref().map_or(0.0, |h| h.router_aux_loss_coef),
            moe_g: std::cell::Cell::new(0.0),
            moe_grouped: std::cell::Cell::new(
                if cfg!(cublas_grouped)
                    && !std::env::var("COCKPIT_MOE_GROUPED").is_ok_and(|v| v == "0")
                {
                    0b11_1111
                } else {
                    0
                },
            ),
            qkv_out: (n_head + 2 * n_kv_head) * hd,
            rms: s.norm == Norm::RmsNorm,
            plus_one: s.layout.norm_plus_one,
            post_norm: s.layout.post_norm,
            qk_whole: s.layout.qk_norm == QkNorm::Whole,
            swiglu,
            geglu: s.activation == Activation::GeGlu && mamba.is_none(),
            rope,
            rope_local,
            local_rope,
            window: if sliding.contains(&true) {
                s.layout.window
            } else {
                0
            },
            sliding,
            flash,
            vocab,
            vpad: vocab.div_ceil(64) * 64,
            t,
            hidden,
            eps: s.norm_eps as f32,
            entries,
            by_id,
            wte,
            wpe,
            layers,
            lnf,
            head,
            wbf,
            wbf_p,
            _fbf: fbf,
            fbf_p,
            _quant_buf: quant_buf,
            quant_p,
            grad,
            grad_p,
            zero_from,
            arena: None,
            prof: None,
            cast_table: None,
            axpy_table: None,
            micro: 0,
            drop_thr: dropout::threshold(s.dropout.max(0.0)),
            recompute: s.recompute,
            head_chunk_rows: None,
            mlp_chunk_rows: None,
            drop_scale: dropout::keep_scale(dropout::threshold(s.dropout.max(0.0))),
            emb_mult: s.embedding_multiplier as f32,
            res_mult: s.residual_multiplier as f32,
            att_scale: s.attention_scale() as f32,
            logit_mult: (1.0 / s.logits_scaling) as f32,
            attn_cap: s.attn_softcap().unwrap_or(0.0) as f32,
            final_cap: s.final_softcap().unwrap_or(0.0) as f32,
            lora_thr: dropout::threshold(w.lora_dropout),
            lora_scale: dropout::keep_scale(dropout::threshold(w.lora_dropout)),
            lora_bd: Vec::new(),
            _lora_bd_buf: None,
            lora_bd_table: None,
            lora_cat: Vec::new(),
            lora_concat: s.kernels.lora_concat,
            lora_cat_table: None,
            drop_seed: 0,
            packed: false,
            rotary_dim: s.rotary_dim(),
        };
        step.plan_lora_blocks()?;
        Ok(step)
    }
}
