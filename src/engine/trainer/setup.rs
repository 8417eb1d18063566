//! Setting a run up: device and precision, base model, data, model, optimizer, data loader,
//! evaluation plan and output dirs, before the first step.

use super::handle::EngineOptions;
use super::resume::shape_hash;
use super::{io_err, Summary, Trainer};
use crate::config::{Config, ScuParams};
use crate::engine::data::loader::{Cursor, EvalPlan, Loader, Order, Windows};
use crate::engine::model::{BaseInit, BaseStore, Model, ModelSpec, ParamKind};
use crate::engine::optim::AdamW;
use crate::engine::precision::{self, LossScaler};
use crate::engine::scu::ScuController;
use crate::engine::{data, device, EngineError};
use candle_core::{DType, Device};
use std::path::Path;

impl Trainer {
    pub(super) fn new(opts: EngineOptions) -> Result<Self, EngineError> {
        let cfg = opts.config;
        let device = device::open(opts.device)?;
        let cc = device::compute_capability(&device);
        let (dtype, mut dtype_reason) =
            precision::choose(cfg.precision.dtype, cc).map_err(EngineError::Config)?;
        // TF32 tensor cores for fp32 matmuls (Ampere and later), when allowed.
        let tf32 = cfg.precision.tf32 && cc.is_some_and(|(major, _)| major >= 8);
        candle_core::cuda::set_gemm_reduced_precision_f32(tf32);
        if tf32 {
            dtype_reason.push_str("; TF32 for fp32 matmuls");
        }
        if let Some(note) = crate::engine::kernels::build_note(&device) {
            dtype_reason.push_str("; ");
            dtype_reason.push_str(&note);
        }
        // A base (model.init_from, lora.base) decides the model's shape and brings its
        // tokenizer and special tokens.
        let mut cfg = cfg;
        let base = match crate::engine::base::spec(&cfg) {
            Some((key, path)) => {
                let b = crate::engine::base::load(Path::new(path))?;
                cfg.model = crate::engine::base::resolve_model(&b.meta, &cfg.model, key)
                    .map_err(EngineError::Config)?;
                Some((key, b))
            }
            None => None,
        };
        let special =
            crate::engine::base::resolve_data(&mut cfg, base.as_ref().map(|(_, b)| &b.meta))?;
        if cfg.lora.enabled
            && cfg.lora.targets.iter().any(|t| t == "gate")
            && !cfg.model.activation.gated()
        {
            return Err(EngineError::Config(
                "lora.targets: \"gate\" exists only in gated (SwiGLU/GeGLU) models; the base has a GELU MLP"
                    .into(),
            ));
        }
        let dataset = data::load_with(&cfg, special)?;
        if let Some((_, b)) = &base {
            if cfg.model.vocab_size == 0 {
                // An older cockpit base took its vocabulary from its data: its embedding says.
                if let Some(t) = b.tensors.get("model.embed_tokens.weight") {
                    cfg.model.vocab_size = t.dim(0)?;
                }
            }
        }
        let vocab = if cfg.model.vocab_size == 0 {
            dataset.vocab_size
        } else {
            cfg.model.vocab_size
        };
        if vocab < dataset.vocab_size {
            return Err(EngineError::Config(match &base {
                Some((key, _)) => format!(
                    "data.tokenizer = {:?}: {} token ids, but the base's embedding ({key}) has {vocab} rows; use the base's tokenizer (data.tokenizer = \"base\")",
                    cfg.data.tokenizer, dataset.vocab_size
                ),
                None => format!(
                    "model.vocab_size = {vocab}: the data uses {} token ids; set 0 to take it from the data",
                    dataset.vocab_size
                ),
            }));
        }
        let min_tokens = cfg.model.seq_len + 1;
        if dataset.rows.is_none()
            && (dataset.train.len() < 2 * min_tokens || dataset.val.len() < min_tokens)
        {
            return Err(EngineError::Config(data::too_small(
                &cfg,
                dataset.train.len(),
                dataset.val.len(),
            )));
        }
        // LoRA on a GPU in bf16 (fp16) keeps the frozen base in bf16 (fp16) only (the fast
        // step computes with it as is); a random base is drawn on the device.
        let store = BaseStore {
            dtype: if cfg.lora.enabled
                && matches!(dtype, DType::BF16 | DType::F16)
                && device.is_cuda()
            {
                dtype
            } else {
                DType::F32
            },
            init: if base.is_some() {
                BaseInit::Loaded
            } else if cfg.lora.enabled
                && cfg.lora.base == crate::config::RANDOM_BASE
                && device.is_cuda()
            {
                BaseInit::DeviceRandom
            } else {
                BaseInit::HostSeeded
            },
        };
        let spec = ModelSpec::from_config(&cfg, vocab);
        check_lora_rank(&spec)?;
        check_fits(&cfg, &spec, &device, store.dtype)?;
        let mut model = Model::new_with(spec.clone(), dtype, &device, cfg.run.seed, store)?;
        if let Some((key, b)) = &base {
            crate::engine::base::load_into(&model, b, key)?;
        }
        if cfg.lora.enabled && cfg.lora.base_dtype == crate::config::BaseDtype::Nf4 {
            if !device.is_cuda() {
                return Err(EngineError::Config(
                    "lora.base_dtype = \"nf4\": 4-bit bases run on CUDA only, and this run is on the CPU; use \"bf16\"".into(),
                ));
            }
            // (the LoRA base's own blocks where it is a 4-bit GGUF file)
            let kept = match crate::engine::base::spec(&cfg) {
                Some(("lora.base", path)) => crate::engine::base::kept_blocks(Path::new(path))?,
                _ => Default::default(),
            };
            let q = model.quantize_base(&kept)?;
            dtype_reason.push_str(&format!("; {}", q.describe()));
        }
        if let Some(lora) = &spec.lora {
            model.add_lora(lora, cfg.run.seed)?;
        }
        if dataset.rows.is_some() {
            model.set_data_layout(true, cfg.data.packing);
        }
        // The run header says which executor runs the model on a GPU, and why not the step.
        if device.is_cuda() && cfg.kernels.step {
            match spec.fast_step_support(&model.step_facts()) {
                Ok(()) => dtype_reason.push_str("; whole-model CUDA step"),
                Err(why) => dtype_reason.push_str(&format!("; per-op path: {why}")),
            }
        }
        let lora = cfg.lora.enabled;
        let regularized = |kind: ParamKind| match (cfg.scu.params, lora) {
            (ScuParams::Lora, _) | (ScuParams::Auto, true) => kind.is_lora(),
            (ScuParams::All, _) | (ScuParams::Auto, false) => {
                matches!(kind, ParamKind::Matrix | ParamKind::Embedding) || kind.is_lora()
            }
        };
        let trainable: Vec<_> = model.params.iter().filter(|p| p.trainable).collect();
        let reg_slots = trainable
            .iter()
            .enumerate()
            .filter(|(_, p)| regularized(p.kind))
            .map(|(i, _)| i)
            .collect();
        let slots = trainable
            .iter()
            .map(|p| {
                let decay = match p.kind {
                    ParamKind::Matrix | ParamKind::LoraA | ParamKind::LoraB => true,
                    ParamKind::Embedding => cfg.optim.decay_embeddings,
                    ParamKind::Norm | ParamKind::Bias => false,
                };
                (p.name.clone(), p.var.clone(), decay)
            })
            .collect();
        let o = &cfg.optim;
        let mut opt = AdamW::new(slots, o.beta1, o.beta2, o.eps, o.weight_decay)?;
        opt.fused = cfg.kernels.adamw;
        let launcher = opts.dist.as_ref().and_then(|j| j.launcher.clone());
        let dist = match opts.dist {
            Some(j) => Some(j.connect(&device)?),
            None => None,
        };
        let (rank, world) = dist.as_ref().map_or((0, 1), |d| (d.rank(), d.world()));
        if world > 1 && cfg.distributed.shard_optimizer {
            // ZeRO-1: the moments live in a shard (built at the first step), not here.
            opt.release_moments()?;
        }
        let windows = match cfg.data.sampling {
            crate::config::Sampling::Random => Windows::Random,
            crate::config::Sampling::Aligned => Windows::Aligned,
            crate::config::Sampling::Auto if cfg.data.source == "files" => Windows::Random,
            crate::config::Sampling::Auto => Windows::Aligned,
        };
        let order = match &dataset.rows {
            Some(r) => Order::with_rows(r.train.clone(), cfg.run.seed),
            None => Order::with_windows(
                dataset.train.clone(),
                cfg.model.seq_len,
                cfg.run.seed,
                windows,
            ),
        };
        let loader = Loader::new(
            order,
            o.micro_batch,
            cfg.data.prefetch_depth,
            Cursor::default(),
        )
        .with_shard(rank, world);
        let val = match &dataset.rows {
            Some(r) => EvalPlan::with_rows(r.val.clone(), o.micro_batch, cfg.eval.batches),
            None => EvalPlan::new(
                &dataset.val,
                cfg.model.seq_len,
                o.micro_batch,
                cfg.eval.batches,
            ),
        };
        let tokens_per_epoch = if cfg.scu.tokens_per_epoch > 0 {
            cfg.scu.tokens_per_epoch as f64
        } else {
            dataset.train.len() as f64
        };
        let scaler = LossScaler::new(
            dtype == DType::F16,
            cfg.precision.loss_scale_init,
            cfg.precision.loss_scale_growth_interval,
        );
        std::fs::create_dir_all(&opts.run_dir).map_err(io_err(&opts.run_dir))?;
        let out_dir = if rank == 0 {
            opts.run_dir.clone()
        } else {
            opts.run_dir.join("ranks").join(format!("rank-{rank}"))
        };
        std::fs::create_dir_all(&out_dir).map_err(io_err(&out_dir))?;
        if let (Some((_, b)), 0) = (&base, rank) {
            crate::engine::base::keep_hf_files(&b.meta, &opts.run_dir)?;
            // A chat template given in data.chat_template goes with the model (export).
            if !cfg.data.chat_template.is_empty() && b.meta.hf_dir.is_some() {
                if let Ok(Some(t)) =
                    data::template::ChatTemplate::find(&cfg.data.chat_template, &cfg.data.tokenizer)
                {
                    let path = opts
                        .run_dir
                        .join(crate::engine::base::HF_BASE_DIR)
                        .join("chat_template.jinja");
                    std::fs::write(&path, &t.text).map_err(io_err(&path))?;
                }
            }
        }
        // Instruction/chat data: an eval sample's prompt is a user turn through the chat
        // template, and its reply stops at the template's end of turn.
        let template = match &dataset.rows {
            Some(_) => {
                data::template::ChatTemplate::find(&cfg.data.chat_template, &cfg.data.tokenizer)
                    .map_err(data::DataError::Template)?
            }
            None => None,
        };
        let sample = if cfg.eval.sample_tokens > 0 {
            let tok = if cfg.data.source == "files" {
                Some(data::Tok::open(&cfg.data.tokenizer)?)
            } else {
                None
            };
            let prompt = match (&tok, cfg.eval.sample_prompt.as_str()) {
                (Some(t), p) if !p.is_empty() && template.is_some() => {
                    let turn = [serde_json::json!({"role": "user", "content": p})];
                    let text = template
                        .as_ref()
                        .map(|tm| tm.render(&turn, true))
                        .transpose()
                        .map_err(|e| {
                            EngineError::Config(format!(
                                "eval.sample_prompt: the chat template fails to render: {e}"
                            ))
                        })?
                        .unwrap_or_default();
                    t.encode_offsets(&text, "eval.sample_prompt")?.0
                }
                (Some(t), p) if !p.is_empty() => t.encode_prompt(p)?,
                _ => {
                    let n = (cfg.model.seq_len / 2).clamp(1, 16);
                    let mut v = Vec::with_capacity(n);
                    dataset.val.extend_into(0, n, &mut v)?;
                    v
                }
            };
            if prompt.is_empty() || prompt.len() >= cfg.model.seq_len {
                return Err(EngineError::Config(format!(
                    "eval.sample_prompt: {} tokens; it must have 1 to model.seq_len - 1 ({})",
                    prompt.len(),
                    cfg.model.seq_len - 1
                )));
            }
            let stop = super::eval::stop_ids(tok.as_ref(), template.as_ref());
            Some((prompt, tok, stop))
        } else {
            None
        };
        let sample_set = super::eval::sample_set(&cfg, vocab, template.as_ref())?;
        let mut t = Trainer {
            out_dir,
            parallel: super::parallel::strategy(
                dist,
                cfg.distributed.shard_optimizer,
                cfg.distributed.bf16_sums(),
            ),
            launcher,
            rank,
            world,
            faults: opts.faults,
            profile_kernels: opts.profile_kernels,
            progress: opts.progress,
            scu: ScuController::new(&cfg.scu).with_beta1(cfg.optim.beta1),
            micro_batch: o.micro_batch,
            accum: o.accum,
            shape_hash: shape_hash(&cfg),
            cfg,
            run_dir: opts.run_dir,
            device,
            dtype,
            dtype_reason,
            dataset,
            model,
            opt,
            reg_slots,
            loader,
            val,
            scaler,
            tokens_per_epoch,
            step: 0,
            tokens: 0,
            elapsed_before: 0.0,
            best_val: None,
            lr_scale: 1.0,
            max_queued_steps: opts.max_queued_steps,
            summary: Summary::default(),
            scu_rows: Vec::new(),
            skipped_steps: 0,
            restores: 0,
            resume_notes: Vec::new(),
            step_memory: None,
            whole_step: None,
            whole_step_tried: false,
            per_op_reason: None,
            data_fault: None,
            sample,
            sample_set,
            weights_copied: false,
            time_due: false,
            trained_slots: (0, 0),
        };
        if let Some(spec) = opts.resume {
            t.restore(&spec, true)?;
        }
        // Every rank starts from rank 0's weights (the same seed makes them equal already;
        // this makes it a guarantee, whatever the seeds or files each rank saw).
        t.sync_weights()?;
        Ok(t)
    }
}

/// Refuse, before allocating anything, a model whose weights and optimizer state alone do not
/// fit the memory the device has free (a config error naming the keys that size the model).
fn check_fits(
    cfg: &Config,
    s: &ModelSpec,
    device: &Device,
    store: DType,
) -> Result<(), EngineError> {
    if cfg.optim.micro_batch == crate::config::MICRO_BATCH_AUTO {
        return Err(EngineError::Config(
            "optim.micro_batch = \"auto\" reached the engine unresolved (the front end tries the sizes that fit before the run starts)".into(),
        ));
    }
    let Some(free) = device::memory_free(device) else {
        return Ok(());
    };
    let params = s.param_count().base as f64;
    // Full training: fp32 master, gradient and two moments; LoRA: the frozen base as stored.
    let per_param = if cfg.lora.enabled {
        store.size_in_bytes() as f64
    } else {
        16.0
    };
    // The per-op path also holds a micro-batch's logits in f32 a few times over (the CUDA
    // fast step keeps one chunk: not counted there).
    let logits = if device.is_cuda() {
        0.0
    } else {
        12.0 * (cfg.optim.micro_batch * s.seq_len) as f64 * s.vocab_size as f64
    };
    let need = params * per_param + logits;
    if need <= free as f64 {
        return Ok(());
    }
    let m = &cfg.model;
    let gb = |b: f64| b / 1e9;
    Err(EngineError::Config(format!(
        "model.n_layer = {}, model.n_embd = {}, model.mlp_ratio = {}, model.vocab_size = {}, optim.micro_batch = {}: {:.2e} parameters, whose weights{} need ~{:.1} GB; this {} has {:.1} GB free",
        m.n_layer,
        m.n_embd,
        m.mlp_ratio,
        s.vocab_size,
        cfg.optim.micro_batch,
        params,
        if cfg.lora.enabled { "" } else { " and optimizer state (and the logits)" },
        gb(need),
        if device.is_cuda() { "GPU" } else { "machine" },
        gb(free as f64)
    )))
}

/// `lora.r` is at most the smallest width of an adapted layer (a larger rank adds nothing but
/// memory: B·A cannot have a rank above min(in, out)).
fn check_lora_rank(spec: &ModelSpec) -> Result<(), EngineError> {
    let Some(lora) = &spec.lora else {
        return Ok(());
    };
    let (d, q, kv, h) = (
        spec.n_embd,
        spec.n_head * spec.head_dim,
        spec.n_kv_head * spec.head_dim,
        spec.hidden,
    );
    let widths = |t: &str| match t {
        "q" | "o" => Some(d.min(q)),
        "k" | "v" => Some(d.min(kv)),
        "up" | "gate" | "down" => Some(d.min(h)),
        _ => None,
    };
    let Some((target, max)) = lora
        .targets
        .iter()
        .filter_map(|t| widths(t).map(|w| (t, w)))
        .min_by_key(|(_, w)| *w)
    else {
        return Ok(());
    };
    if lora.r > max {
        return Err(EngineError::Config(format!(
            "lora.r = {}: larger than the adapted layers allow (at most {max}, the smallest width of lora.targets' \"{target}\" in this model: n_embd {d}, attention {q}, key/value {kv}, MLP {h})",
            lora.r
        )));
    }
    Ok(())
}
