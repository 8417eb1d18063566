//! The training loop on its own thread: `Command`s are applied only at optimizer-step
//! boundaries; `Event`s go out through a channel that never blocks, and every event is also
//! appended to `metrics.jsonl` in the run dir.

use super::checkpoint::{self, TrainState};
use super::data::loader::{mean_se, Batch, Cursor, EvalPlan, Loader, Order, Windows};
use super::data::{self, Dataset};
use super::events::{
    self, Command, EvalStats, Event, EventRx, EventTx, FinishReason, RankStat, RunInfo, ScuStats,
    StepStats,
};
use super::faults::Faults;
use super::model::{BaseStore, LoraSpec, Model, ParamKind, Shape};
use super::optim::{global_norm, lr_at, AdamW};
use super::precision::{self, LossScaler};
use super::scu::{PlantReading, ScuController};
use super::{device, EngineError};
use crate::config::{Config, ScuLaw, ScuParams};
use crate::distributed::Collective;
use crate::util::DeviceSpec;
use candle_core::{DType, Device, Tensor};
use sha2::{Digest, Sha256};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const LN2: f64 = std::f64::consts::LN_2;
/// Largest micro-batch the engine accepts from a command.
pub use crate::config::MAX_MICRO_BATCH;

/// What to run.
#[derive(Debug)]
pub struct EngineOptions {
    pub config: Config,
    pub run_dir: PathBuf,
    pub device: DeviceSpec,
    /// Resume from this checkpoint (a step dir, a checkpoints dir or a run dir).
    pub resume: Option<PathBuf>,
    /// Undelivered Step events the channel holds before dropping new ones.
    pub max_queued_steps: usize,
    /// Data parallelism: this rank after the rendezvous (None: a single process).
    /// `run_dir` is then the job's run dir (rank 0's); ranks other than 0 write their own
    /// metrics under `run_dir/ranks/rank-N/` and never write checkpoints.
    pub dist: Option<crate::distributed::Joined>,
    /// Set to the step number after every optimizer step, and to `u64::MAX` when the run
    /// ends: a watchdog can tell a run stuck (e.g. in a collective) from a slow one.
    pub progress: Option<std::sync::Arc<events::Progress>>,
    /// Time every kernel of the whole-model CUDA step with CUDA events and report the GPU
    /// time per kernel group in each step's `kernels` (`cockpit bench --profile`).
    pub profile_kernels: bool,
    /// Faults to inject, for tests (inert without the `fault-injection` feature).
    #[doc(hidden)]
    pub faults: Faults,
}

impl EngineOptions {
    /// A fresh run of `config` in `run_dir` on `device`: no resume, a deep event queue, no
    /// data parallelism, no fault injection. Set the other fields with `..` where needed.
    pub fn new(config: Config, run_dir: PathBuf, device: DeviceSpec) -> Self {
        Self {
            config,
            run_dir,
            device,
            resume: None,
            max_queued_steps: 1_000_000,
            dist: None,
            progress: None,
            profile_kernels: false,
            faults: Faults::default(),
        }
    }
}

/// How a run ended.
#[derive(Clone, Debug, PartialEq)]
pub struct RunSummary {
    pub reason: FinishReason,
    pub step: u64,
    pub last_loss: Option<f64>,
    pub last_val: Option<EvalStats>,
    pub last_checkpoint: Option<PathBuf>,
    pub entropy_floor_bpt: Option<f64>,
    pub final_lambda: f64,
    pub final_s: Option<f64>,
}

/// A running engine: send commands, receive events, then wait for the summary.
pub struct Engine {
    pub commands: Sender<Command>,
    pub events: EventRx,
    pub thread: EngineThread,
}

pub struct EngineThread(JoinHandle<Result<RunSummary, EngineError>>);

impl EngineThread {
    pub fn wait(self) -> Result<RunSummary, EngineError> {
        self.0.join().map_err(|_| EngineError::Panicked)?
    }
}

impl Engine {
    /// Set up (device, data, model, optimiser, resume) on the calling thread — so setup errors
    /// surface before any UI starts — then train on a new thread.
    pub fn spawn(opts: EngineOptions) -> Result<Engine, EngineError> {
        let trainer = Trainer::new(opts)?;
        let (cmd_tx, cmd_rx) = mpsc::channel();
        let (ev_tx, ev_rx) = events::channel(trainer.max_queued_steps);
        let handle = std::thread::Builder::new()
            .name("cockpit-engine".into())
            .spawn(move || {
                let panic_tx = ev_tx.clone();
                // A bug in the engine must not take the front end down with it: report it as
                // a failed run instead of unwinding into nowhere.
                match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    trainer.run(cmd_rx, ev_tx)
                })) {
                    Ok(r) => r,
                    Err(p) => {
                        let msg = p
                            .downcast_ref::<&str>()
                            .map(|s| s.to_string())
                            .or_else(|| p.downcast_ref::<String>().cloned())
                            .unwrap_or_else(|| "unknown panic".into());
                        panic_tx.send(Event::Finished {
                            step: 0,
                            reason: FinishReason::Failed,
                            message: format!("engine panicked: {msg}"),
                            elapsed_s: 0.0,
                        });
                        Err(EngineError::Panicked)
                    }
                }
            })
            .map_err(|e| EngineError::Io {
                path: "engine thread".into(),
                source: e,
            })?;
        Ok(Engine {
            commands: cmd_tx,
            events: ev_rx,
            thread: EngineThread(handle),
        })
    }
}

/// The hash of everything that fixes tensor shapes and the data stream.
pub fn shape_hash(c: &Config) -> String {
    let mut h = Sha256::new();
    // (Recompute changes what the step keeps, not the model: left out.)
    let model = crate::config::ModelConfig {
        recompute: crate::config::Recompute::None,
        ..c.model.clone()
    };
    h.update(serde_json::to_vec(&model).unwrap_or_default());
    h.update(
        serde_json::to_vec(&(
            &c.data.source,
            &c.data.train,
            &c.data.tokenizer,
            c.data.builtin_vocab,
            c.data.builtin_order,
        ))
        .unwrap_or_default(),
    );
    h.update(serde_json::to_vec(&(&c.lora.enabled, c.lora.r, &c.lora.targets)).unwrap_or_default());
    crate::util::hex(&h.finalize())[..16].to_string()
}

struct Trainer {
    cfg: Config,
    /// The job's run dir: checkpoints live here (written by rank 0 only).
    run_dir: PathBuf,
    /// Where this rank's own files go (metrics.jsonl, SCU files): the run dir on rank 0.
    out_dir: PathBuf,
    /// The process group, in a data-parallel run.
    dist: Option<Box<dyn Collective>>,
    /// Which launcher started the job and what was taken from it (for the run header).
    launcher: Option<String>,
    rank: usize,
    world: usize,
    /// Faults to inject (tests only).
    faults: Faults,
    profile_kernels: bool,
    progress: Option<std::sync::Arc<events::Progress>>,
    device: Device,
    dtype: DType,
    dtype_reason: String,
    dataset: Dataset,
    model: Model,
    opt: AdamW,
    /// Indices into `opt.slots` whose weights SCU regularizes.
    reg_slots: Vec<usize>,
    loader: Loader,
    val: EvalPlan,
    scu: ScuController,
    scaler: LossScaler,
    tokens_per_epoch: f64,
    step: u64,
    tokens: u64,
    micro_batch: usize,
    accum: usize,
    elapsed_before: f64,
    best_val: Option<f64>,
    lr_scale: f64,
    max_queued_steps: usize,
    shape_hash: String,
    summary: Summary,
    scu_rows: Vec<ScuStats>,
    skipped_steps: u64,
    restores: u32,
    /// Config changes found at resume, reported once the run starts.
    resume_notes: Vec<String>,
    /// Memory in use right after the last backward of the step (activations and gradients
    /// alive: the step's high-water mark, near enough).
    step_memory: Option<u64>,
    /// The whole-model CUDA step, for GPT-2 style bf16 models (`kernels.step`); built at
    /// the first step, None where the model does not fit it (the per-op path runs then).
    whole: Option<super::kernels::GptStep>,
    whole_checked: bool,
    /// Why a CUDA run takes the per-op path (said once, as a warning, after the first step).
    whole_why: Option<String>,
    /// `eval.sample_tokens`: the prompt's ids and the tokenizer that shows the text (None:
    /// the built-in corpus, shown as ids).
    sample: Option<(Vec<u32>, Option<data::Tok>)>,
    /// The last optimizer step wrote the updated weights into the whole-model step's bf16
    /// copies (its next `begin` need not cast them); anything else that sets the weights
    /// clears it.
    weights_copied: bool,
    /// ZeRO-1 (`distributed.shard_optimizer` with several ranks): this rank's share of the
    /// optimizer state, built at the first optimizer step (the flat layout is known then).
    shard: Option<super::zero::Shard>,
    /// ZeRO-1 with the whole-model step: the last update wrote only this rank's range of the
    /// fp32 master weights (and every rank's bf16 copies came by all-gather), so the masters
    /// outside that range are stale until [`Trainer::full_masters`] gathers them — which every
    /// reader of the fp32 weights (checkpoints, evaluation, samples, the end) calls first.
    masters_partial: bool,
    /// `distributed.reduce_dtype = "bf16"`: the bf16 buffer the ranks sum the flat gradient
    /// buffer in (allocated at the first sum).
    wire: Option<Tensor>,
    /// Rank 0's verdict, before this step, that a timed checkpoint is due (shared with the
    /// ranks through the step's host all-reduce, so all of them take it at the same step).
    time_due: bool,
}

#[derive(Default)]
struct Summary {
    last_loss: Option<f64>,
    last_val: Option<EvalStats>,
    last_checkpoint: Option<PathBuf>,
    last_s: Option<f64>,
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> EngineError + '_ {
    move |source| EngineError::Io {
        path: path.display().to_string(),
        source,
    }
}

impl Trainer {
    fn new(opts: EngineOptions) -> Result<Self, EngineError> {
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
        if let Some(note) = super::kernels::build_note(&device) {
            dtype_reason.push_str("; ");
            dtype_reason.push_str(&note);
        }
        // A base (model.init_from, lora.base) decides the model's shape and brings its
        // tokenizer and special tokens.
        let mut cfg = cfg;
        let base = match super::base::spec(&cfg) {
            Some((key, path)) => {
                let b = super::base::load(Path::new(path))?;
                cfg.model = super::base::resolve_model(&b.meta, &cfg.model, key)
                    .map_err(EngineError::Config)?;
                Some((key, b))
            }
            None => None,
        };
        let special = super::base::resolve_data(&mut cfg, base.as_ref().map(|(_, b)| &b.meta))?;
        if cfg.lora.enabled
            && cfg.lora.targets.iter().any(|t| t == "gate")
            && cfg.model.activation != crate::config::Activation::SwiGlu
        {
            return Err(EngineError::Config(
                "lora.targets: \"gate\" exists only in SwiGLU models; the base has a GELU MLP"
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
        if dataset.train.len() < 2 * min_tokens || dataset.val.len() < min_tokens {
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
            random_on_device: cfg.lora.enabled
                && cfg.lora.base == crate::config::RANDOM_BASE
                && device.is_cuda(),
        };
        check_fits(&cfg, &Shape::from_config(&cfg, vocab), &device, store.dtype)?;
        let mut model = Model::new_with(
            Shape::from_config(&cfg, vocab),
            dtype,
            &device,
            cfg.run.seed,
            store,
        )?;
        if let Some((key, b)) = &base {
            super::base::load_into(&model, b, key)?;
        }
        if cfg.lora.enabled && cfg.lora.base_dtype == crate::config::BaseDtype::Nf4 {
            if !device.is_cuda() {
                return Err(EngineError::Config(
                    "lora.base_dtype = \"nf4\": 4-bit bases run on CUDA only, and this run is on the CPU; use \"bf16\"".into(),
                ));
            }
            let (before, after) = model.quantize_base_nf4()?;
            dtype_reason.push_str(&format!(
                "; LoRA base linear layers in NF4: {:.2} GB instead of {:.2} GB",
                after as f64 / 1e9,
                before as f64 / 1e9
            ));
        }
        if cfg.lora.enabled {
            let spec = LoraSpec {
                r: cfg.lora.r,
                alpha: cfg.lora.alpha,
                targets: cfg.lora.targets.clone(),
                dropout: cfg.lora.dropout,
            };
            model.add_lora(&spec, cfg.run.seed)?;
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
        let order = Order::with_windows(
            dataset.train.clone(),
            cfg.model.seq_len,
            cfg.run.seed,
            windows,
        );
        let loader = Loader::new(
            order,
            o.micro_batch,
            cfg.data.prefetch_depth,
            Cursor::default(),
        )
        .with_shard(rank, world);
        let val = EvalPlan::new(
            &dataset.val,
            cfg.model.seq_len,
            o.micro_batch,
            cfg.eval.batches,
        );
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
            super::base::keep_hf_files(&b.meta, &opts.run_dir)?;
        }
        let sample = if cfg.eval.sample_tokens > 0 {
            let tok = if cfg.data.source == "files" {
                Some(data::Tok::open(&cfg.data.tokenizer)?)
            } else {
                None
            };
            let prompt = match (&tok, cfg.eval.sample_prompt.as_str()) {
                (Some(t), p) if !p.is_empty() => t.encode_prompt(p)?,
                _ => {
                    let n = (cfg.model.seq_len / 2).clamp(1, 16);
                    let mut v = Vec::with_capacity(n);
                    dataset.val.extend_into(0, n.min(dataset.val.len()), &mut v);
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
            Some((prompt, tok))
        } else {
            None
        };
        let mut t = Trainer {
            out_dir,
            dist,
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
            whole: None,
            whole_checked: false,
            whole_why: None,
            sample,
            weights_copied: false,
            shard: None,
            masters_partial: false,
            wire: None,
            time_due: false,
        };
        if let Some(spec) = opts.resume {
            t.restore(&spec, true)?;
        }
        // Every rank starts from rank 0's weights (the same seed makes them equal already;
        // this makes it a guarantee, whatever the seeds or files each rank saw).
        t.sync_weights()?;
        Ok(t)
    }

    /// Load a checkpoint into the trainer. `resume`: a user resume (check and report config
    /// changes, honour a changed micro-batch); otherwise a fault-recovery restore.
    fn restore(&mut self, spec: &Path, resume: bool) -> Result<(), EngineError> {
        self.weights_copied = false;
        // (Every weight comes from the checkpoint.)
        self.masters_partial = false;
        let dir = checkpoint::resolve(spec)?;
        let l = checkpoint::load(&dir, &self.device)?;
        let mismatch = |message: String| {
            EngineError::Checkpoint(checkpoint::CheckpointError::Mismatch {
                path: dir.display().to_string(),
                message,
            })
        };
        let now = serde_json::to_value(&self.cfg).unwrap_or_default();
        let changes = config_diff(&l.state.config, &now);
        let refused: Vec<&String> = changes.iter().filter(|c| is_shape_key(c)).collect();
        if !refused.is_empty() || l.state.shape_hash != self.shape_hash {
            let list = refused
                .iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join(", ");
            return Err(mismatch(format!(
                "cannot resume: shape-changing config keys differ from the checkpoint's ({}); resume with the original [model], [data] source and [lora] settings",
                if list.is_empty() { "model or data".to_string() } else { list }
            )));
        }
        if resume && !changes.is_empty() {
            self.resume_notes = changes;
        }
        self.model.load_named(&l.model, false).map_err(mismatch)?;
        for slot in &mut self.opt.slots {
            let get = |suffix: &str| l.optim.get(&format!("{}.{suffix}", slot.name)).cloned();
            match (get("m"), get("v")) {
                (Some(m), Some(v))
                    if m.dims() == slot.var.dims() && v.dims() == slot.var.dims() =>
                {
                    slot.m = m;
                    slot.v = v;
                }
                _ => {
                    return Err(mismatch(format!(
                        "optimizer state for {} is missing or has another shape",
                        slot.name
                    )))
                }
            }
        }
        // ZeRO-1: this rank keeps its range of the moments just loaded.
        if let Some(shard) = self.shard.as_mut() {
            shard.absorb(&mut self.opt)?;
        }
        let s = l.state;
        self.opt.t = s.optim_t;
        self.step = s.step;
        self.tokens = s.tokens;
        self.elapsed_before = s.elapsed_s;
        self.scaler = s.scaler;
        // Keep the controller's state (λ, Ŝ, window, a setpoint changed live) but take gains
        // and limits from the (possibly edited) config — unless the checkpoint was written
        // by another law (a checkpoint from before `scu.law`): then its own gains go with it.
        let mut scu = s.scu;
        let fresh = ScuController::new(&self.cfg.scu).with_beta1(self.cfg.optim.beta1);
        if scu.law == fresh.law {
            scu.rate = fresh.rate;
            scu.plant.beta1 = fresh.plant.beta1;
            scu.kp = fresh.kp;
            scu.ki = fresh.ki;
            scu.deadband = fresh.deadband;
            scu.ema_alpha = fresh.ema_alpha;
            scu.leak = fresh.leak;
            scu.i_max = fresh.i_max;
            scu.lambda_min = fresh.lambda_min;
            scu.lambda_max = fresh.lambda_max;
            scu.enabled = fresh.enabled;
            if scu.enabled {
                scu.lambda = scu.lambda.clamp(scu.lambda_min, scu.lambda_max);
            }
        }
        self.scu = scu;
        self.best_val = s.best_val_loss;
        self.lr_scale = s.lr_scale;
        self.skipped_steps = s.skipped_steps;
        if resume {
            self.restores = s.restores;
            // A micro-batch changed live carries over unless the config now asks for another.
            let old_cfg_mb = s
                .config
                .pointer("/optim/micro_batch")
                .and_then(|v| v.as_u64());
            let old_cfg_accum = s.config.pointer("/optim/accum").and_then(|v| v.as_u64());
            self.accum = self.cfg.optim.accum;
            if old_cfg_mb.is_none_or(|mb| mb as usize == self.cfg.optim.micro_batch) {
                self.micro_batch = s.micro_batch;
                // (An out-of-memory split kept the step's sequences: it carries over too.)
                if old_cfg_accum.is_some_and(|a| a as usize == self.cfg.optim.accum) && s.accum > 0
                {
                    self.accum = s.accum;
                }
            }
        } else {
            self.micro_batch = s.micro_batch;
        }
        self.loader.seek(s.cursor);
        self.loader.set_batch_size(self.micro_batch);
        Ok(())
    }

    fn state(&self, elapsed: f64) -> TrainState {
        TrainState {
            step: self.step,
            optim_t: self.opt.t,
            cursor: self.loader.cursor(),
            micro_batch: self.micro_batch,
            accum: self.accum,
            tokens: self.tokens,
            elapsed_s: elapsed,
            scaler: self.scaler.clone(),
            scu: self.scu.clone(),
            best_val_loss: self.best_val,
            lr_scale: self.lr_scale,
            shape_hash: self.shape_hash.clone(),
            seed: self.cfg.run.seed,
            skipped_steps: self.skipped_steps,
            restores: self.restores,
            config: serde_json::to_value(&self.cfg).unwrap_or_default(),
        }
    }

    fn save_checkpoint(
        &mut self,
        elapsed: f64,
        val_loss: Option<f64>,
        moments: Option<Vec<(String, Tensor)>>,
    ) -> Result<(PathBuf, u64, f64), EngineError> {
        let t0 = Instant::now();
        let optim: Vec<(String, Tensor)> = match moments {
            Some(m) => m,
            None => self
                .opt
                .slots
                .iter()
                .flat_map(|s| {
                    [
                        (format!("{}.m", s.name), s.m.clone()),
                        (format!("{}.v", s.name), s.v.clone()),
                    ]
                })
                .collect(),
        };
        let c = &self.cfg.checkpoint;
        let saved = checkpoint::save(
            &self.run_dir.join("checkpoints"),
            &self.state(elapsed),
            &self.model.named_tensors(),
            &optim,
            val_loss,
            c.keep_last,
            c.keep_best,
        )?;
        let (dir, bytes) = saved;
        if self.cfg.lora.enabled {
            // The adapter alone, PEFT layout, always the newest: RUN_DIR/adapter/.
            super::lora::save_adapter(&self.run_dir.join("adapter"), &self.model, &self.cfg.lora)?;
        }
        Ok((dir, bytes, t0.elapsed().as_secs_f64() * 1e3))
    }

    fn run_info(&self) -> RunInfo {
        let (total, trainable) = self.model.param_count();
        let s = &self.model.shape;
        let dev = device::describe(&self.device);
        let c = &self.cfg;
        // Data parallelism: tokens/s are the job's, so MFU is against every rank's peak.
        let peak_flops = device::peak_flops(&dev, self.dtype).map(|p| p * self.world as f64);
        let dev = match &self.dist {
            Some(d) => format!(
                "{dev} · rank {} of {} ({}), global batch {} sequences{}{}",
                self.rank,
                self.world,
                d.backend(),
                self.world * self.micro_batch * self.accum,
                if self.sharding() {
                    format!(
                        ", optimizer state sharded (ZeRO-1: {:.0} MB of Adam moments a rank)",
                        8.0 * trainable as f64 / self.world as f64 / 1e6
                    )
                } else {
                    String::new()
                },
                if self.cfg.distributed.bf16_sums() {
                    ", gradients summed in bf16"
                } else {
                    ""
                }
            ),
            None => dev,
        };
        let dev = match &self.launcher {
            Some(l) => format!("{dev}; {l}"),
            None => dev,
        };
        RunInfo {
            run_name: c.run.name.clone(),
            run_dir: self.run_dir.display().to_string(),
            peak_flops,
            device: dev,
            dtype: precision::dtype_name(self.dtype).into(),
            dtype_reason: self.dtype_reason.clone(),
            params_total: total,
            params_trainable: trainable,
            start_step: self.step,
            max_steps: c.run.max_steps,
            micro_batch: self.micro_batch,
            accum: self.accum,
            seq_len: s.seq_len,
            vocab_size: s.vocab_size,
            train_tokens: self.dataset.train.len() as u64,
            entropy_floor_bpt: self.dataset.entropy_floor_bpt,
            flops_per_token: self.model.flops_per_token(),
            scu_enabled: c.scu.enabled,
            scu_target: self.scu.target,
            summary: format!(
                "{} {}L {}H d{} T{} vocab {} | {} | {} windows, {} | AdamW lr {:.1e} {:?} | {}",
                family(&c.model, s),
                s.n_layer,
                s.n_head,
                s.n_embd,
                s.seq_len,
                s.vocab_size,
                self.dataset.description,
                match self.loader.windows() {
                    Windows::Random => "random",
                    Windows::Aligned => "aligned",
                },
                self.val.describe(),
                c.optim.lr,
                c.schedule.kind,
                if c.lora.enabled {
                    format!("LoRA r{} on {:?}", c.lora.r, c.lora.targets)
                } else {
                    "full fine-tune".into()
                }
            ),
        }
    }

    /// Σw² over the regularized weights, as a differentiable f32 scalar.
    fn reg_sumsq(&self) -> candle_core::Result<Option<Tensor>> {
        let mut acc: Option<Tensor> = None;
        for &i in &self.reg_slots {
            let s = super::kernels::sum_sq(self.opt.slots[i].var.as_tensor())?;
            acc = Some(match acc {
                Some(a) => (a + s)?,
                None => s,
            });
        }
        Ok(acc)
    }

    /// Each window's mean loss in one held-out batch: on the whole-model step when the run
    /// has one and the batch is a full micro-batch (its forward alone), else the candle
    /// model's.
    fn eval_windows(&mut self, b: &Batch) -> candle_core::Result<Vec<f64>> {
        self.check_whole()?;
        if let Some(whole) = self.whole.as_mut().filter(|_| b.batch == self.micro_batch) {
            let current = self.weights_copied || self.masters_partial;
            let losses = whole.eval_losses(&b.inputs, &b.targets, b.batch, current)?;
            // The bf16 copies are current now, until the next optimizer step.
            self.weights_copied = true;
            return Ok(losses);
        }
        let (x, y) = self.batch_tensors(b)?;
        let losses = self.model.token_losses(&x, &y)?;
        let rows = losses.reshape((b.batch, b.seq_len))?.mean(1)?;
        Ok(rows.to_vec1::<f32>()?.into_iter().map(f64::from).collect())
    }

    /// The mean loss of the eval's windows and its standard error (over windows).
    fn evaluate(&mut self) -> candle_core::Result<EvalStats> {
        let mut per_window = Vec::with_capacity(self.val.windows());
        let plan = self.val.clone();
        for b in plan.batches(self.micro_batch) {
            per_window.extend(self.eval_windows(&b)?);
        }
        let (val_loss, se) = mean_se(&per_window);
        Ok(EvalStats {
            step: self.step,
            val_loss,
            val_bpt: val_loss / LN2,
            val_ppl: val_loss.exp(),
            val_loss_se: se,
            val_bpt_se: se / LN2,
            val_tokens: plan.tokens_scored(),
        })
    }

    /// `eval.sample_tokens`: the model's greedy continuation of the fixed prompt, within the
    /// training context.
    fn sample_text(&self) -> candle_core::Result<Option<Event>> {
        let Some((prompt, tok)) = &self.sample else {
            return Ok(None);
        };
        let n = self
            .cfg
            .eval
            .sample_tokens
            .min(self.model.shape.seq_len - prompt.len());
        let ids = super::generate::generate(
            &self.model,
            prompt,
            n,
            &super::generate::Sampling::greedy(),
            &[],
            |_| {},
        )?;
        let show = |ids: &[u32]| match tok {
            Some(t) => t.decode(ids),
            None => ids
                .iter()
                .map(|t| t.to_string())
                .collect::<Vec<_>>()
                .join(" "),
        };
        Ok(Some(Event::Sample {
            step: self.step,
            prompt: show(prompt),
            text: show(&ids),
        }))
    }

    fn batch_tensors(&self, b: &Batch) -> candle_core::Result<(Tensor, Tensor)> {
        let shape = (b.batch, b.seq_len);
        Ok((
            Tensor::from_slice(&b.inputs, shape, &self.device)?,
            Tensor::from_slice(&b.targets, shape, &self.device)?,
        ))
    }

    /// Build the whole-model CUDA step once, where the model fits it.
    fn check_whole(&mut self) -> candle_core::Result<()> {
        if !self.whole_checked {
            self.whole_checked = true;
            match self.model.step_plan() {
                Ok(mut w) => {
                    if self.sharding() {
                        w.shards = self.world;
                    }
                    let mut step = super::kernels::GptStep::new(&w)?;
                    step.set_profiling(self.profile_kernels);
                    #[cfg(feature = "cuda")]
                    if let Some(d) = self.dist.as_mut() {
                        // (A collective: every rank builds its step at the same point.)
                        if d.world() > 1 && self.cfg.distributed.overlap {
                            let sum = d
                                .grad_sum()
                                .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
                            if let Some(sum) = sum {
                                let dc = &self.cfg.distributed;
                                step.set_grad_sum(sum, dc.bucket_mb, dc.bf16_sums())?;
                            }
                        }
                    }
                    self.whole = Some(step);
                }
                Err(why) if self.device.is_cuda() && self.cfg.kernels.step => {
                    self.whole_why = Some(why);
                }
                Err(_) => {}
            }
        }
        Ok(())
    }

    /// One optimizer step's forward/backward over `accum` micro-batches.
    /// Returns (mean CE, Σw² value, grads, data wait, compute time).
    fn forward_backward(
        &mut self,
        lambda: f64,
    ) -> candle_core::Result<(f64, f64, Vec<Tensor>, Duration, Duration)> {
        self.faults.oom_at(self.micro_batch)?;
        self.check_whole()?;
        if self.whole.is_some() {
            return self.forward_backward_whole(lambda);
        }
        let mut wait = Duration::ZERO;
        let t0 = Instant::now();
        let mut grads: Vec<Option<Tensor>> = vec![None; self.opt.slots.len()];
        let mut ce_sum = 0.0;
        let mut sumsq_val = 0.0;
        let scale = self.scaler.scale;
        let coef = 1.0 / (2.0 * self.cfg.scu.prior_sigma.powi(2) * self.tokens_per_epoch);
        let inject_nan = self.take_nan_fault();
        for a in 0..self.accum {
            // Dropout masks depend only on (seed, step, micro-batch): a resumed run draws the same.
            let seed = super::dropout::micro_seed(self.cfg.run.seed, self.step, a);
            self.model.reseed_dropout(seed);
            let (batch, w) = self.loader.next_batch();
            wait += w;
            let (x, y) = self.batch_tensors(&batch)?;
            let ce = self.model.loss(&x, &y, true)?;
            ce_sum += ce.to_scalar::<f32>()? as f64;
            let ce = if inject_nan { (ce * f64::NAN)? } else { ce };
            let mut loss = (ce / self.accum as f64)?;
            if a == 0 {
                if let Some(ss) = self.reg_sumsq()? {
                    sumsq_val = ss.to_scalar::<f32>()? as f64;
                    // λ·Σw²/(2σ²)/N: in the same per-token units as CE, and differentiable.
                    // At λ = 0 it adds nothing: keep it out of the graph (no backward pass).
                    if lambda != 0.0 {
                        loss = (loss + (ss * (lambda * coef))?)?;
                    }
                }
            }
            if scale != 1.0 {
                loss = (loss * scale)?;
            }
            let store = loss.backward()?;
            if a + 1 == self.accum {
                self.step_memory = device::memory_in_use(&self.device);
            }
            for (g, slot) in grads.iter_mut().zip(&self.opt.slots) {
                if let Some(new) = store.get(slot.var.as_tensor()) {
                    // A leaf's gradient keeps its op graph (and so every activation of this
                    // micro-batch) alive; the gradient itself is all the step needs.
                    let new = new.detach();
                    *g = Some(match g.take() {
                        Some(acc) => (acc + new)?,
                        None => new,
                    });
                }
            }
        }
        let grads = grads
            .into_iter()
            .zip(&self.opt.slots)
            .map(|(g, s)| match g {
                Some(g) if scale != 1.0 => g / scale,
                Some(g) => Ok(g),
                None => s.var.as_tensor().zeros_like(),
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        self.device.synchronize()?;
        let compute = t0.elapsed().saturating_sub(wait);
        Ok((ce_sum / self.accum as f64, sumsq_val, grads, wait, compute))
    }

    /// Whether a NaN is injected into this step (fault injection for tests), once.
    fn take_nan_fault(&mut self) -> bool {
        self.faults.take_nan(self.step + 1)
    }

    /// [`Self::forward_backward`] on the whole-model CUDA step: the micro-batches run as
    /// one hand-scheduled program each, gradients accumulate in its flat fp32 buffer, and
    /// the loss comes back in one read at the end.
    fn forward_backward_whole(
        &mut self,
        lambda: f64,
    ) -> candle_core::Result<(f64, f64, Vec<Tensor>, Duration, Duration)> {
        let mut wait = Duration::ZERO;
        let t0 = Instant::now();
        let inject_nan = self.take_nan_fault();
        let sharding = self.sharding();
        let control_due = self.control_due();
        let Some(whole) = self.whole.as_mut() else {
            return Err(candle_core::Error::Msg("no whole-model step".into()));
        };
        // (With partial masters the bf16 copies are the only whole weights: never cast over.)
        whole.begin(std::mem::take(&mut self.weights_copied) || self.masters_partial)?;
        let tokens = (self.micro_batch * self.model.shape.seq_len * self.accum) as f32;
        // fp16: the backward carries the loss scale from the loss gradient on (so small
        // gradients stay above fp16's underflow); the update divides it out.
        let scale = self.scaler.scale;
        let g = if inject_nan {
            f32::NAN
        } else {
            (scale / tokens as f64) as f32
        };
        // Data parallel with the sums inside the step: the last micro-batch's backward sums
        // the gradients over the ranks as it goes.
        let summed = whole.overlaps_grad_sums();
        for a in 0..self.accum {
            let (batch, w) = self.loader.next_batch();
            wait += w;
            // The same masks as the per-op path draws (a pure function of this seed).
            whole.set_dropout_seed(super::dropout::micro_seed(self.cfg.run.seed, self.step, a));
            whole.set_grad_sum_now(summed && a + 1 == self.accum);
            whole.micro(&batch.inputs, &batch.targets, batch.batch, g)?;
        }
        let mut sumsq_val = 0.0;
        // ZeRO-1: Σw² and the penalty's gradient come from each rank's own range after the
        // sum ([`Self::shard_reduce`]; the masters outside it may be stale).
        if !self.reg_slots.is_empty() && !sharding {
            let vars: Vec<&candle_core::Var> = self
                .reg_slots
                .iter()
                .map(|&i| &self.opt.slots[i].var)
                .collect();
            // (Σw² is read only by the controller, after this step when it is due: a pass over
            // the weights and a host read the other steps skip.)
            if control_due {
                let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
                sumsq_val = super::kernels::sumsq(&ts)?;
            }
            if lambda != 0.0 {
                // d/dw of λ·Σw²/(2σ²)/N = 2·λ·coef·w, added to the CE gradient in place
                // (to the ranks' sum already, when the step summed: world times, as the
                // optimizer divides the sum by the world).
                let coef = 1.0 / (2.0 * self.cfg.scu.prior_sigma.powi(2) * self.tokens_per_epoch);
                let copies = if summed { self.world as f64 } else { 1.0 };
                whole.add_scaled_weights(&vars, 2.0 * lambda * coef * copies * scale)?;
            }
        }
        let ce = whole.loss()?;
        self.step_memory = device::memory_in_use(&self.device);
        let grads = self
            .opt
            .slots
            .iter()
            .map(|s| match whole.grad_of(&s.var)? {
                Some(g) => Ok(g),
                None => s.var.as_tensor().zeros_like(),
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        let compute = t0.elapsed().saturating_sub(wait);
        Ok((ce, sumsq_val, grads, wait, compute))
    }

    fn run(mut self, commands: Receiver<Command>, tx: EventTx) -> Result<RunSummary, EngineError> {
        let metrics_path = self.out_dir.join("metrics.jsonl");
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&metrics_path)
            .map_err(io_err(&metrics_path))?;
        let mut out = Recorder {
            file: BufWriter::new(file),
            tx,
            failed: false,
        };
        let result = self.train(&commands, &mut out);
        if let Some(p) = &self.progress {
            p.step.store(u64::MAX, std::sync::atomic::Ordering::Relaxed);
        }
        if let Some(d) = &mut self.dist {
            match &result {
                Ok(_) => d.finish(),
                // Another rank's failure: it has told everyone already.
                Err(e) if e.is_peer_failure() => {}
                Err(e) => d.abort(&e.to_string()),
            }
        }
        let (reason, message) = match &result {
            Ok((r, m)) => (*r, m.clone()),
            Err(e) => (FinishReason::Failed, e.to_string()),
        };
        let elapsed = self.elapsed_before;
        if let Err(e) = self.write_scu_files() {
            out.emit(Event::Warning {
                step: self.step,
                message: format!("could not write SCU files: {e}"),
            });
        }
        out.emit(Event::Finished {
            step: self.step,
            reason,
            message: message.clone(),
            elapsed_s: elapsed,
        });
        out.flush();
        result?;
        Ok(RunSummary {
            reason,
            step: self.step,
            last_loss: self.summary.last_loss,
            last_val: self.summary.last_val.clone(),
            last_checkpoint: self.summary.last_checkpoint.clone(),
            entropy_floor_bpt: self.dataset.entropy_floor_bpt,
            final_lambda: self.scu.lambda,
            final_s: self.summary.last_s,
        })
    }
}

/// Writes every event to metrics.jsonl and forwards it to the channel (which never blocks).
struct Recorder {
    file: BufWriter<std::fs::File>,
    tx: EventTx,
    failed: bool,
}

impl Recorder {
    fn emit(&mut self, ev: Event) {
        if !self.failed {
            let ok = serde_json::to_writer(&mut self.file, &ev).is_ok()
                && self.file.write_all(b"\n").is_ok();
            // Flushed per event: `cockpit attach` backfills from this file while the run goes on.
            let ok = ok && self.file.flush().is_ok();
            if !ok {
                self.failed = true;
                let msg = "could not write metrics.jsonl; events still reach the front end";
                let _ = self.tx.send(Event::Warning {
                    step: ev.step(),
                    message: msg.into(),
                });
            }
        }
        let _ = self.tx.send(ev);
    }
    fn flush(&mut self) {
        let _ = self.file.flush();
    }
}

enum Flow {
    Continue,
    /// `interrupted`: the signal that asked for it (the run ends `Interrupted`).
    Stop {
        save: bool,
        interrupted: Option<String>,
    },
}

/// How a run that was told to stop ends: `Interrupted` by a signal, else `Stopped`.
fn stop_reason(interrupted: Option<String>, step: u64) -> (FinishReason, String) {
    match interrupted {
        Some(signal) => (
            FinishReason::Interrupted,
            format!("interrupted by {signal} at step {step}"),
        ),
        None => (
            FinishReason::Stopped,
            format!("stopped by command at step {step}"),
        ),
    }
}

/// Non-finite steps in a row after which the run fails.
const MAX_NONFINITE_IN_A_ROW: u32 = 20;

/// Gradients go to the all-reduce in buckets of at most this many elements (one flat f32
/// buffer each: a few large collectives instead of one per tensor, with bounded extra memory).
const BUCKET_ELEMS: usize = 1 << 25;

/// A step's loss, gradients and rank timings after data parallelism's reduction.
struct Reduced {
    ce: f64,
    grads: Vec<Tensor>,
    ranks: Vec<RankStat>,
    /// What the gradients still need multiplying by: 1/world where they hold the ranks' sum.
    grad_scale: f64,
    /// ZeRO-1: the flat buffer whose rank's range holds the summed gradients, and Σg² over
    /// all ranks' ranges (before `grad_scale`).
    sharded: Option<(Tensor, f64)>,
    /// ZeRO-1 on the whole-model step: Σw² of the regularized weights, summed over the ranks'
    /// ranges (the step left it to the shards; None: the step's own figure stands).
    reg_sumsq: Option<f64>,
    /// A timed checkpoint is due after this step (rank 0's clock, every rank's decision).
    time_due: bool,
}

/// The resolved model family for the run header: the arch, what it resolved to, and any
/// explicit key that overrode the family's default.
fn family(m: &crate::config::ModelConfig, s: &super::model::Shape) -> String {
    let kv = if s.n_kv_head == s.n_head {
        String::new()
    } else {
        format!(" GQA {}/{}", s.n_head, s.n_kv_head)
    };
    let mut out = format!(
        "{:?} ({:?} {:?} {:?}{}{}{})",
        m.arch,
        s.norm,
        s.pos,
        s.activation,
        if s.bias { " bias" } else { " no-bias" },
        if s.tie_embeddings { " tied" } else { " untied" },
        kv,
    )
    .to_lowercase();
    if !m.arch_notes.is_empty() {
        out.push_str(&format!(" [{}]", m.arch_notes.join(", ")));
    }
    out
}

/// The mean of every rank's gradients, summed in buckets of up to [`BUCKET_ELEMS`] values
/// (`bf16`: each bucket summed in bf16, as `distributed.reduce_dtype = "bf16"` asks).
fn all_reduce_mean(
    d: &mut dyn Collective,
    grads: &[Tensor],
    bf16: bool,
) -> Result<Vec<Tensor>, EngineError> {
    let scale = 1.0 / d.world() as f64;
    let mut out = Vec::with_capacity(grads.len());
    let mut i = 0;
    while i < grads.len() {
        let (mut j, mut n) = (i, 0);
        while j < grads.len() && (j == i || n + grads[j].elem_count() <= BUCKET_ELEMS) {
            n += grads[j].elem_count();
            j += 1;
        }
        let flat = grads[i..j]
            .iter()
            .map(|g| g.flatten_all())
            .collect::<candle_core::Result<Vec<_>>>()?;
        let sum = if bf16 {
            let wire = Tensor::cat(&flat, 0)?.to_dtype(DType::BF16)?;
            d.all_reduce_sum(wire)?.to_dtype(DType::F32)?
        } else {
            d.all_reduce_sum(Tensor::cat(&flat, 0)?)?
        };
        let mean = (sum * scale)?;
        let mut off = 0;
        for g in &grads[i..j] {
            let k = g.elem_count();
            out.push(mean.narrow(0, off, k)?.reshape(g.shape())?);
            off += k;
        }
        i = j;
    }
    Ok(out)
}

/// Refuse, before allocating anything, a model whose weights and optimizer state alone do not
/// fit the memory the device has free (a config error naming the keys that size the model).
fn check_fits(cfg: &Config, s: &Shape, device: &Device, store: DType) -> Result<(), EngineError> {
    if cfg.optim.micro_batch == crate::config::MICRO_BATCH_AUTO {
        return Err(EngineError::Config(
            "optim.micro_batch = \"auto\" reached the engine unresolved (the front end tries the sizes that fit before the run starts)".into(),
        ));
    }
    let Some(free) = device::memory_free(device) else {
        return Ok(());
    };
    let (c, hd) = (s.n_embd as f64, s.head_dim as f64);
    let mlp = if s.activation == crate::config::Activation::SwiGlu {
        3.0
    } else {
        2.0
    };
    let attn = c * hd * (2 * s.n_head + 2 * s.n_kv_head) as f64;
    let layer = attn + mlp * c * s.hidden as f64;
    let embed = s.vocab_size as f64 * c * if s.tie_embeddings { 1.0 } else { 2.0 };
    let pos = if s.pos == crate::config::PosEncoding::Learned {
        s.n_positions as f64 * c
    } else {
        0.0
    };
    let params = s.n_layer as f64 * layer + embed + pos;
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

fn is_oom(e: &candle_core::Error) -> bool {
    let s = e.to_string().to_ascii_lowercase();
    s.contains("out of memory") || s.contains("out_of_memory")
}

/// Whether a changed config key changes tensor shapes or the data stream.
fn is_shape_key(key: &str) -> bool {
    let k = key.split(' ').next().unwrap_or(key);
    k.starts_with("model.")
        || k.starts_with("lora.enabled")
        || k.starts_with("lora.r")
        || k.starts_with("lora.targets")
        || ["data.source", "data.train", "data.tokenizer", "data.val"].contains(&k)
        || k.starts_with("data.builtin_")
}

/// `key old → new` for every leaf that differs between two configs (as JSON).
fn config_diff(old: &serde_json::Value, new: &serde_json::Value) -> Vec<String> {
    fn walk(prefix: &str, a: &serde_json::Value, b: &serde_json::Value, out: &mut Vec<String>) {
        match (a, b) {
            (serde_json::Value::Object(x), serde_json::Value::Object(y)) => {
                let mut keys: Vec<&String> = x.keys().chain(y.keys()).collect();
                keys.sort();
                keys.dedup();
                for k in keys {
                    let p = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    let null = serde_json::Value::Null;
                    walk(
                        &p,
                        x.get(k).unwrap_or(&null),
                        y.get(k).unwrap_or(&null),
                        out,
                    );
                }
            }
            _ if a != b => out.push(format!("{prefix} {a} → {b}")),
            _ => {}
        }
    }
    let mut out = Vec::new();
    if old.is_null() {
        return out;
    }
    walk("", old, new, &mut out);
    out
}

impl Trainer {
    /// Repeated non-finite steps: restore the last checkpoint and lower the LR, or fail.
    fn recover(&mut self, out: &mut Recorder) -> Result<(), EngineError> {
        let root = self.run_dir.join("checkpoints");
        if self.restores >= self.cfg.checkpoint.max_restores {
            return Err(EngineError::NonFinite {
                step: self.step + 1,
                count: self.cfg.checkpoint.max_nonfinite_in_a_row,
            });
        }
        let Ok(dir) = checkpoint::resolve(&root) else {
            return Err(EngineError::Diverged {
                step: self.step + 1,
                message:
                    "no checkpoint to restore from; lower optim.lr or enable checkpoint.every_steps"
                        .into(),
            });
        };
        let (skipped, restores, from) = (self.skipped_steps, self.restores + 1, self.step);
        let lr_scale = self.lr_scale * self.cfg.checkpoint.restore_lr_factor;
        self.restore(&dir, false)?;
        self.skipped_steps = skipped;
        self.restores = restores;
        self.lr_scale = lr_scale;
        out.emit(Event::Warning {
            step: self.step,
            message: format!(
                "diverging at step {from}: restored {} (step {}), LR × {} (restore {}/{})",
                dir.display(),
                self.step,
                self.lr_scale,
                self.restores,
                self.cfg.checkpoint.max_restores
            ),
        });
        Ok(())
    }

    /// Data parallelism: every rank takes rank 0's weights.
    fn sync_weights(&mut self) -> Result<(), EngineError> {
        self.weights_copied = false;
        let Some(d) = self.dist.as_mut() else {
            return Ok(());
        };
        for p in &self.model.params {
            // (Collectives move f32; a frozen bf16 base goes through it and back, exactly.)
            let t = d.broadcast(&p.var.as_tensor().to_dtype(DType::F32)?)?;
            p.var.set(&t.to_dtype(p.var.dtype())?)?;
        }
        Ok(())
    }

    /// Data parallelism, at a step boundary: rank 0 hands out the commands its front end
    /// sent, and every rank applies the same ones in the same order (the other ranks' own
    /// front ends do not steer the job). `Some(save)` when they include a stop.
    fn shared_commands(
        &mut self,
        commands: &Receiver<Command>,
        prev_batch: &mut Option<usize>,
        start: Instant,
        out: &mut Recorder,
    ) -> Result<Option<(bool, Option<String>)>, EngineError> {
        let mine: Vec<Command> = commands.try_iter().collect();
        let mine = if self.rank == 0 { mine } else { Vec::new() };
        let bytes = serde_json::to_vec(&mine).map_err(|e| EngineError::Config(e.to_string()))?;
        self.set_waiting(true);
        let Some(d) = self.dist.as_mut() else {
            return Ok(None);
        };
        let got = d.broadcast_bytes(bytes);
        self.set_waiting(false);
        let got = got?;
        let cmds: Vec<Command> = serde_json::from_slice(&got).map_err(|e| {
            crate::distributed::CommError::Setup(format!("commands from rank 0: {e}"))
        })?;
        let mut paused = false;
        for cmd in cmds {
            if matches!(cmd, Command::Pause | Command::Resume) {
                out.emit(Event::CommandRejected {
                    step: self.step,
                    command: cmd,
                    reason: "pause is not available in a multi-process run (the other ranks would wait inside a collective); stop with a checkpoint and resume instead".into(),
                });
                continue;
            }
            if let Flow::Stop { save, interrupted } =
                self.apply(cmd, &mut paused, prev_batch, start, out)?
            {
                return Ok(Some((save, interrupted)));
            }
        }
        Ok(None)
    }

    /// Data parallelism, after the backward: the mean of the gradients and of the loss
    /// over the ranks (so every rank takes the same optimizer step and SCU sees the global
    /// loss), and every rank's timings. A single process passes its values through.
    fn reduce_step(
        &mut self,
        ce: f64,
        grads: Vec<Tensor>,
        wait: Duration,
        compute: Duration,
    ) -> Result<Reduced, EngineError> {
        let world = self.world;
        if self.dist.is_none() {
            return Ok(Reduced {
                ce,
                grads,
                ranks: Vec::new(),
                grad_scale: 1.0,
                sharded: None,
                reg_sumsq: None,
                time_due: self.time_due,
            });
        }
        self.set_waiting(true);
        let r = self.reduce_step_inner(ce, grads, wait, compute, world);
        self.set_waiting(false);
        r
    }

    fn set_waiting(&self, on: bool) {
        if let Some(p) = &self.progress {
            p.waiting.store(on, std::sync::atomic::Ordering::Relaxed);
        }
    }

    fn reduce_step_inner(
        &mut self,
        ce: f64,
        grads: Vec<Tensor>,
        wait: Duration,
        compute: Duration,
        world: usize,
    ) -> Result<Reduced, EngineError> {
        let step_memory = self.step_memory;
        let gauge = |g: Option<&std::sync::atomic::AtomicU32>| {
            g.map(|a| a.load(std::sync::atomic::Ordering::Relaxed))
                .filter(|&v| v != u32::MAX)
                .map_or(-1.0, f64::from)
        };
        let util = gauge(self.progress.as_deref().map(|p| &p.gpu_util_pct));
        let temp = gauge(self.progress.as_deref().map(|p| &p.gpu_temp_c));
        // ZeRO-1: the gradients are reduce-scattered first, so their Σg² rides on the host
        // all-reduce below.
        let sharded = if self.sharding() {
            Some(self.shard_reduce(&grads)?)
        } else {
            None
        };
        let Some(d) = self.dist.as_mut() else {
            return Ok(Reduced {
                ce,
                grads,
                ranks: Vec::new(),
                grad_scale: 1.0,
                sharded: None,
                reg_sumsq: None,
                time_due: self.time_due,
            });
        };
        // [Σ CE, then per rank: compute ms, data wait ms, memory bytes, GPU util %, GPU °C
        // (-1: unknown), then Σg² of the ranks' shards, rank 0's timed-checkpoint verdict
        // and Σw² of the shards' regularized weights]; each rank fills only its own slots,
        // so the sum gathers them.
        const PER: usize = 5;
        let mut host = vec![0.0; 4 + world * PER];
        host[0] = ce;
        host[1 + world * PER] = sharded.as_ref().map_or(0.0, |s| s.1);
        host[2 + world * PER] = f64::from(u8::from(self.rank == 0 && self.time_due));
        let reg_sumsq = sharded.as_ref().and_then(|s| s.2);
        host[3 + world * PER] = reg_sumsq.unwrap_or(0.0);
        let mine = 1 + self.rank * PER;
        host[mine] = compute.as_secs_f64() * 1e3;
        host[mine + 1] = wait.as_secs_f64() * 1e3;
        host[mine + 2] = step_memory.map_or(-1.0, |m| m as f64);
        host[mine + 3] = util;
        host[mine + 4] = temp;
        d.all_reduce_host(&mut host)?;
        let ranks = (0..world)
            .map(|r| {
                let b = 1 + r * PER;
                RankStat {
                    rank: r,
                    compute_ms: host[b],
                    data_wait_ms: host[b + 1],
                    memory_bytes: (host[b + 2] >= 0.0).then_some(host[b + 2] as u64),
                    gpu_util_pct: (host[b + 3] >= 0.0).then_some(host[b + 3]),
                    gpu_temp_c: (host[b + 4] >= 0.0).then_some(host[b + 4]),
                }
            })
            .collect();
        // The whole-model step's gradients are views of one flat buffer: summed in place in
        // one call, and the 1/world left to the optimizer's gradient scale (no copies).
        let time_due = host[2 + world * PER] > 0.5;
        if let Some((flat, _, _)) = sharded {
            self.device.synchronize()?;
            return Ok(Reduced {
                ce: host[0] / world as f64,
                grads,
                ranks,
                grad_scale: 1.0 / world as f64,
                sharded: Some((flat, host[1 + world * PER])),
                reg_sumsq: reg_sumsq.map(|_| host[3 + world * PER]),
                time_due,
            });
        }
        let bf16 = self.cfg.distributed.bf16_sums();
        let flat = self.whole.as_ref().and_then(|w| w.grad_buffer());
        let summed = self.whole.as_ref().is_some_and(|w| w.overlaps_grad_sums());
        let (grads, grad_scale) = match flat {
            // (The step summed them already, bucket by bucket during the backward.)
            Some(_) if summed => (grads, 1.0 / world as f64),
            Some(flat) => {
                let flat = flat.clone();
                self.sum_flat(&flat, None)?;
                (grads, 1.0 / world as f64)
            }
            None => (all_reduce_mean(d.as_mut(), &grads, bf16)?, 1.0),
        };
        // Wait for the all-reduce here (not in the optimizer), so a stuck peer is seen as one.
        self.device.synchronize()?;
        Ok(Reduced {
            ce: host[0] / world as f64,
            grads,
            ranks,
            grad_scale,
            sharded: None,
            reg_sumsq: None,
            time_due,
        })
    }

    /// ZeRO-1's optimizer step: this rank's range updated, then all-gathered. On the
    /// whole-model step the update writes its range's bf16 compute copies and those are
    /// gathered (half the bytes of the fp32 weights, and no cast or scatter after): the
    /// step computes with them, and the fp32 masters outside this rank's range wait for
    /// [`Self::full_masters`]. Otherwise the fp32 weights are gathered and every rank's
    /// weights set from them (the step's bf16 copies are cast again).
    fn sharded_update(
        &mut self,
        flat: &Tensor,
        lr: f64,
        grad_scale: f64,
    ) -> Result<(), EngineError> {
        let (Some(shard), Some(d)) = (self.shard.as_mut(), self.dist.as_mut()) else {
            return Err(EngineError::Config(
                "optimizer sharding without ranks".into(),
            ));
        };
        // (The update decides, from every weight, whether the step's copies take it.)
        let step = self.whole.as_ref().filter(|w| w.weight_buffer().is_some());
        if shard.update(&mut self.opt, flat, lr, grad_scale, step)? {
            if let Some(copies) = step.and_then(|w| w.weight_buffer()) {
                d.all_gather_in_place(copies)?;
                self.weights_copied = true;
                self.masters_partial = true;
                return Ok(());
            }
        }
        d.all_gather_in_place(flat)?;
        shard.scatter_weights(&self.opt, flat)?;
        self.weights_copied = false;
        self.masters_partial = false;
        Ok(())
    }

    /// ZeRO-1: every rank's fp32 master weights made whole again after updates that left
    /// them partial (each rank's range into the gradient buffer, free between steps, and
    /// an all-gather). A collective: every rank calls it at the same points (before a
    /// checkpoint, an evaluation, and at the end). Nothing to do otherwise.
    fn full_masters(&mut self) -> Result<(), EngineError> {
        if !self.masters_partial {
            return Ok(());
        }
        let (Some(shard), Some(d), Some(flat)) = (
            self.shard.as_ref(),
            self.dist.as_mut(),
            self.whole.as_ref().and_then(|w| w.grad_buffer()),
        ) else {
            return Err(EngineError::Config(
                "optimizer sharding: partial weights without ranks".into(),
            ));
        };
        shard.masters_into(&self.opt, flat)?;
        d.all_gather_in_place(flat)?;
        shard.scatter_weights(&self.opt, flat)?;
        self.masters_partial = false;
        Ok(())
    }

    /// ZeRO-1: every slot's full moments for a checkpoint (on rank 0; the others take part
    /// and drop them). The gradient buffer is free between steps and serves as scratch.
    fn gather_moments(&mut self) -> Result<Option<Vec<(String, Tensor)>>, EngineError> {
        let (Some(shard), Some(d)) = (self.shard.as_ref(), self.dist.as_mut()) else {
            return Ok(None);
        };
        let scratch = match self.whole.as_ref().and_then(|w| w.grad_buffer()) {
            Some(b) => b.clone(),
            None => Tensor::zeros(shard.total(), DType::F32, &self.device)?,
        };
        let m = shard.gather_moments(&self.opt, d.as_mut(), &scratch)?;
        Ok((self.rank == 0).then_some(m))
    }

    /// ZeRO-1 is on: several ranks and `distributed.shard_optimizer`.
    fn sharding(&self) -> bool {
        self.world > 1 && self.cfg.distributed.shard_optimizer
    }

    /// ZeRO-1, after the backward: the flat gradient buffer (the whole-model step's, or the
    /// gradients packed) reduce-scattered — unless the step summed it already, bucket by
    /// bucket — and Σg² over this rank's range. On the whole-model step also Σw² of this
    /// rank's range of the regularized weights, and the penalty's gradient added to that
    /// range (world times, as the update divides the sum by the world). The shard is built
    /// on the first call.
    fn shard_reduce(
        &mut self,
        grads: &[Tensor],
    ) -> Result<(Tensor, f64, Option<f64>), EngineError> {
        let buffer = self.whole.as_ref().and_then(|w| w.grad_buffer()).cloned();
        if self.shard.is_none() {
            let (places, total) = match &buffer {
                Some(buf) => {
                    let places = grads
                        .iter()
                        .map(|g| (g.layout().start_offset(), g.elem_count()))
                        .collect::<Vec<_>>();
                    // Every trainable weight must be a view of the buffer.
                    let inside = self.opt.slots.iter().all(|s| {
                        self.whole
                            .as_ref()
                            .is_some_and(|w| matches!(w.grad_of(&s.var), Ok(Some(_))))
                    });
                    if !inside {
                        return Err(EngineError::Config(
                            "distributed.shard_optimizer: a trainable weight is not in the step's gradient buffer".into(),
                        ));
                    }
                    (places, buf.elem_count())
                }
                None => {
                    let sizes: Vec<usize> = grads.iter().map(Tensor::elem_count).collect();
                    super::zero::packed_places(&sizes, self.world)
                }
            };
            let shard = super::zero::Shard::new(
                &mut self.opt,
                places,
                total,
                self.rank,
                self.world,
                &self.device,
            )?;
            self.shard = Some(shard);
        }
        let Some(shard) = self.shard.as_ref().filter(|_| self.dist.is_some()) else {
            return Err(EngineError::Config(
                "optimizer sharding without ranks".into(),
            ));
        };
        let flat = match buffer {
            Some(b) => b,
            None => shard.pack(grads)?,
        };
        let range = shard.range();
        if !self.whole.as_ref().is_some_and(|w| w.overlaps_grad_sums()) {
            self.sum_flat(&flat, Some(range))?;
        }
        let reg = self.shard_penalty()?;
        let sq = match self.shard.as_ref() {
            Some(s) => s.grad_sumsq(&flat)?,
            None => 0.0,
        };
        Ok((flat, sq, reg))
    }

    /// The whole-model step's SCU term under ZeRO-1, from this rank's range (exact there,
    /// whatever the rest holds): Σw² of its regularized pieces when the controller reads it
    /// after this step (None otherwise, and off the whole-model step, whose per-op path keeps
    /// the term in its loss), and λ's gradient 2·λ·coef·w added to its range of the summed
    /// gradients.
    fn shard_penalty(&mut self) -> Result<Option<f64>, EngineError> {
        let control_due = self.control_due();
        let (Some(shard), Some(whole)) = (self.shard.as_ref(), self.whole.as_mut()) else {
            return Ok(None);
        };
        if self.reg_slots.is_empty() {
            return Ok(Some(0.0));
        }
        let sumsq = match control_due {
            true => Some(shard.weight_sumsq(&self.opt, &self.reg_slots)?),
            false => None,
        };
        let lambda = self.scu.lambda;
        if lambda != 0.0 {
            let coef = 1.0 / (2.0 * self.cfg.scu.prior_sigma.powi(2) * self.tokens_per_epoch);
            let a = 2.0 * lambda * coef * self.world as f64 * self.scaler.scale;
            let pieces: Vec<(&candle_core::Var, usize, usize)> = shard
                .pieces_of(&self.reg_slots)
                .into_iter()
                .map(|(slot, at, n)| (&self.opt.slots[slot].var, at, n))
                .collect();
            whole.add_scaled_pieces(&pieces, a)?;
        }
        Ok(sumsq)
    }

    /// SCU's controller runs after this step (it reads the step's Σw² then).
    fn control_due(&self) -> bool {
        (self.step + 1).is_multiple_of(self.cfg.scu.control_every)
    }

    /// Sum the flat f32 gradient buffer over the ranks, in place: all of it, or (ZeRO-1, a
    /// reduce-scatter) only this rank's `part`. In bf16 the buffer is packed into
    /// [`Self::wire`], summed there, and the needed part widened back into `flat`.
    fn sum_flat(
        &mut self,
        flat: &Tensor,
        part: Option<std::ops::Range<usize>>,
    ) -> Result<(), EngineError> {
        let bf16 = self.cfg.distributed.bf16_sums();
        let Some(d) = self.dist.as_mut() else {
            return Ok(());
        };
        let sum = |d: &mut Box<dyn Collective>, t: &Tensor| match part {
            Some(_) => d.reduce_scatter_sum_in_place(t),
            None => d.all_reduce_sum_in_place(t),
        };
        if !bf16 {
            return Ok(sum(d, flat)?);
        }
        let n = flat.elem_count();
        let wire = match self.wire.take() {
            Some(w) if w.elem_count() == n => w,
            _ => Tensor::zeros(n, DType::BF16, flat.device())?,
        };
        super::kernels::convert_into(flat, &wire)?;
        let summed = sum(d, &wire);
        let back = summed.map_err(EngineError::from).and_then(|()| {
            let r = part.unwrap_or(0..n);
            let len = r.end - r.start;
            super::kernels::convert_into(
                &wire.narrow(0, r.start, len)?,
                &flat.narrow(0, r.start, len)?,
            )
            .map_err(EngineError::from)
        });
        self.wire = Some(wire);
        back
    }

    fn elapsed(&self, start: Instant) -> f64 {
        self.elapsed_before + start.elapsed().as_secs_f64()
    }

    fn checkpoint_event(&mut self, start: Instant, out: &mut Recorder) -> Result<(), EngineError> {
        // ZeRO-1: the weights and the moments are gathered from every rank first (collectives).
        self.full_masters()?;
        let moments = self.gather_moments()?;
        if self.rank != 0 {
            // Rank 0 writes the job's checkpoints; the ranks hold the same state.
            return Ok(());
        }
        let val = self
            .summary
            .last_val
            .as_ref()
            .filter(|v| v.step == self.step)
            .map(|v| v.val_loss);
        let (dir, bytes, ms) = self.save_checkpoint(self.elapsed(start), val, moments)?;
        out.emit(Event::CheckpointSaved {
            step: self.step,
            path: dir.display().to_string(),
            bytes,
            ms,
        });
        self.summary.last_checkpoint = Some(dir);
        Ok(())
    }

    fn apply(
        &mut self,
        cmd: Command,
        paused: &mut bool,
        prev_batch: &mut Option<usize>,
        start: Instant,
        out: &mut Recorder,
    ) -> Result<Flow, EngineError> {
        let step = self.step;
        let reject = |out: &mut Recorder, command: Command, reason: String| {
            out.emit(Event::CommandRejected {
                step,
                command,
                reason,
            });
            Ok(Flow::Continue)
        };
        match cmd {
            Command::SetBatchSize { micro_batch } => {
                if micro_batch == 0 || micro_batch > MAX_MICRO_BATCH {
                    return reject(
                        out,
                        cmd,
                        format!("micro-batch must be in [1, {MAX_MICRO_BATCH}]"),
                    );
                }
                if micro_batch == self.micro_batch {
                    return reject(out, cmd, format!("micro-batch is already {micro_batch}"));
                }
                let old = self.micro_batch;
                *prev_batch = (micro_batch > old).then_some(old);
                self.micro_batch = micro_batch;
                self.loader.set_batch_size(micro_batch);
                let eff = micro_batch * self.accum;
                let detail = format!(
                    "micro-batch {old} → {micro_batch}, accum {}, effective batch {eff} sequences ({} tokens/step)",
                    self.accum,
                    eff * self.model.shape.seq_len
                );
                out.emit(Event::CommandApplied {
                    step,
                    command: cmd,
                    detail,
                });
            }
            Command::SetScuSetpoint { target } => {
                if !(target > 0.0 && target < 1.0) {
                    return reject(
                        out,
                        cmd,
                        "the setpoint must be in (0, 1) — a fraction, 0.01 = 1%".into(),
                    );
                }
                let old = self.scu.target;
                self.scu.set_target(target);
                let detail = format!(
                    "S* {:.2}% → {:.2}% (bumpless: λ stays {:.4})",
                    old * 100.0,
                    target * 100.0,
                    self.scu.lambda
                );
                out.emit(Event::CommandApplied {
                    step,
                    command: cmd,
                    detail,
                });
            }
            Command::CheckpointNow => {
                self.checkpoint_event(start, out)?;
                out.emit(Event::CommandApplied {
                    step,
                    command: cmd,
                    detail: format!("checkpoint at step {step}"),
                });
            }
            Command::Pause => {
                if *paused {
                    return reject(out, cmd, "already paused".into());
                }
                *paused = true;
                out.emit(Event::CommandApplied {
                    step,
                    command: cmd,
                    detail: format!("paused at step {step}"),
                });
                out.emit(Event::Paused { step });
            }
            Command::Resume => {
                if !*paused {
                    return reject(out, cmd, "not paused".into());
                }
                *paused = false;
                out.emit(Event::CommandApplied {
                    step,
                    command: cmd,
                    detail: format!("resumed at step {step}"),
                });
                out.emit(Event::Resumed { step });
            }
            Command::Stop { save } => {
                out.emit(Event::CommandApplied {
                    step,
                    command: cmd,
                    detail: if save {
                        "saving, then stopping".into()
                    } else {
                        "stopping".into()
                    },
                });
                return Ok(Flow::Stop {
                    save,
                    interrupted: None,
                });
            }
            Command::Interrupt { signal } => {
                out.emit(Event::CommandApplied {
                    step,
                    command: Command::Interrupt {
                        signal: signal.clone(),
                    },
                    detail: format!("{signal}: saving, then stopping"),
                });
                return Ok(Flow::Stop {
                    save: true,
                    interrupted: Some(signal),
                });
            }
        }
        Ok(Flow::Continue)
    }

    fn write_json(&self, name: &str, value: &impl serde::Serialize) -> Result<(), EngineError> {
        let path = self.out_dir.join(name);
        let text =
            serde_json::to_vec_pretty(value).map_err(|e| EngineError::Config(e.to_string()))?;
        crate::util::atomic_write(&path, &text).map_err(io_err(&path))
    }

    fn write_scu_files(&self) -> Result<(), EngineError> {
        self.write_json("scu_metrics.json", &self.scu_rows)?;
        let history = serde_json::json!({
            "steps": self.scu_rows.iter().map(|r| r.step).collect::<Vec<_>>(),
            "s_ratio_history": self.scu_rows.iter().map(|r| r.s_ratio).collect::<Vec<_>>(),
            "lambda_history": self.scu_rows.iter().map(|r| r.lambda).collect::<Vec<_>>(),
            "target_history": self.scu_rows.iter().map(|r| r.target).collect::<Vec<_>>(),
        });
        self.write_json("scu_history.json", &history)
    }

    /// [`AdamW::penalty_stats`], with a sharded optimizer's second moments summed over the
    /// ranks (a collective then: every rank runs the controller at the same steps).
    fn penalty_stats(&mut self) -> Result<(f64, f64), EngineError> {
        let (Some(shard), Some(d)) = (self.shard.as_ref(), self.dist.as_mut()) else {
            return Ok(self.opt.penalty_stats(&self.reg_slots)?);
        };
        // (Both from the ranks' own ranges: the weights outside them may be stale.)
        let mut sums = [
            shard.weight_sumsq(&self.opt, &self.reg_slots)?,
            shard.penalty_weighted(&self.opt, &self.reg_slots)?,
        ];
        d.all_reduce_host(&mut sums)?;
        Ok((sums[0], sums[1]))
    }

    fn control(&mut self, ce_mean: f64, sumsq: f64, out: &mut Recorder) -> Result<(), EngineError> {
        let c = &self.cfg.scu.clone();
        let coef = 1.0 / (2.0 * c.prior_sigma.powi(2) * self.tokens_per_epoch);
        let data_bpt = ce_mean / LN2;
        let param_bpt = sumsq * coef / LN2;
        let s = ScuController::s_ratio(data_bpt, param_bpt);
        let lambda_used = self.scu.lambda;
        // The adaptive law's plant reading: the weights after this step's update, and the
        // penalty's authority over ln Σw² through Adam's second moments.
        let reading = if c.enabled && c.law == ScuLaw::Adaptive {
            let (now, weighted) = self.penalty_stats()?;
            (now > 0.0).then(|| PlantReading {
                data_bpt,
                param_bpt: now * coef / LN2,
                gain: 4.0 * coef * weighted / now,
            })
        } else {
            None
        };
        let o = self.scu.update_with(s, reading);
        let reg_loss = lambda_used * sumsq * coef;
        let row = ScuStats {
            step: self.step,
            ce_loss: ce_mean,
            reg_loss,
            total_loss: ce_mean + reg_loss,
            data_bpt,
            param_bpt,
            s_ratio: s,
            s_hat: o.s_hat,
            lambda: o.lambda,
            integral: o.integral,
            error: o.error,
            target: self.scu.target,
            control: c.enabled,
        };
        self.summary.last_s = Some(s);
        self.append_scu_csv(&row);
        self.scu_rows.push(row.clone());
        out.emit(Event::Scu(row));
        if o.newly_converged {
            out.emit(Event::ScuConverged {
                step: self.step,
                s_ratio: s,
                lambda: o.lambda,
                target: self.scu.target,
            });
        }
        if let Some(r) = reading {
            self.append_plant_csv(&r);
        }
        Ok(())
    }

    /// The adaptive law's plant measurements, one line per control step (scu_plant.csv).
    fn append_plant_csv(&self, r: &PlantReading) {
        let path = self.out_dir.join("scu_plant.csv");
        let new = !path.exists();
        let p = &self.scu.plant;
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
        {
            use std::io::Write;
            if new {
                let _ = writeln!(
                    f,
                    "step,param_bpt_now,gain,growth,lambda_eq,lambda_m,lambda,lr"
                );
            }
            let opt = |v: Option<f64>| v.map_or(String::new(), |v| v.to_string());
            let _ = writeln!(
                f,
                "{},{},{},{},{},{},{},{}",
                self.step,
                r.param_bpt,
                r.gain,
                opt(p.growth),
                opt(p.lambda_eq),
                opt(p.lambda_m),
                self.scu.lambda,
                p.last_lr
            );
        }
    }

    fn append_scu_csv(&self, r: &ScuStats) {
        let path = self.out_dir.join("scu.csv");
        let new = !path.exists();
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
        {
            if new {
                let _ = writeln!(f, "step,ce_loss,reg_loss,total_loss,data_bpt,param_bpt,s_ratio,s_hat,lambda,integral,error,target");
            }
            let _ = writeln!(
                f,
                "{},{},{},{},{},{},{},{},{},{},{},{}",
                r.step,
                r.ce_loss,
                r.reg_loss,
                r.total_loss,
                r.data_bpt,
                r.param_bpt,
                r.s_ratio,
                r.s_hat,
                r.lambda,
                r.integral,
                r.error,
                r.target
            );
        }
    }

    fn train(
        &mut self,
        commands: &Receiver<Command>,
        out: &mut Recorder,
    ) -> Result<(FinishReason, String), EngineError> {
        self.write_json("training_config.json", &self.cfg)?;
        self.write_json("scu_config.json", &self.cfg.scu)?;
        out.emit(Event::RunStarted(self.run_info()));
        let start = Instant::now();
        let mut last_ckpt = Instant::now();
        let mut paused = false;
        let mut prev_batch: Option<usize> = None;
        let mut nonfinite_in_a_row = 0u32;
        for message in self.dataset.warnings.clone() {
            out.emit(Event::Warning {
                step: self.step,
                message,
            });
        }
        for note in std::mem::take(&mut self.resume_notes) {
            out.emit(Event::Warning {
                step: self.step,
                message: format!("resumed with a changed config: {note}"),
            });
        }
        let max_steps = self.cfg.run.max_steps;
        let seq_len = self.model.shape.seq_len;
        while self.step < max_steps {
            // Commands: only here, at the optimizer-step boundary. In a data-parallel run
            // rank 0's commands are broadcast and every rank applies the same ones.
            if self.dist.is_some() {
                if let Some((save, interrupted)) =
                    self.shared_commands(commands, &mut prev_batch, start, out)?
                {
                    self.elapsed_before = self.elapsed(start);
                    if save {
                        self.checkpoint_event(start, out)?;
                    }
                    self.full_masters()?;
                    return Ok(stop_reason(interrupted, self.step));
                }
            }
            while self.dist.is_none() {
                let cmd = if paused {
                    match commands.recv_timeout(Duration::from_millis(100)) {
                        Ok(c) => c,
                        Err(RecvTimeoutError::Timeout) => continue,
                        Err(RecvTimeoutError::Disconnected) => {
                            return Ok((
                                FinishReason::Stopped,
                                "the controller went away while paused".into(),
                            ))
                        }
                    }
                } else {
                    match commands.try_recv() {
                        Ok(c) => c,
                        Err(TryRecvError::Empty | TryRecvError::Disconnected) => break,
                    }
                };
                if let Flow::Stop { save, interrupted } =
                    self.apply(cmd, &mut paused, &mut prev_batch, start, out)?
                {
                    self.elapsed_before = self.elapsed(start);
                    if save {
                        self.checkpoint_event(start, out)?;
                    }
                    self.full_masters()?;
                    return Ok(stop_reason(interrupted, self.step));
                }
            }

            let t_step = Instant::now();
            let step_cursor = self.loader.cursor();
            let every_min = self.cfg.checkpoint.every_minutes;
            self.time_due =
                every_min > 0.0 && last_ckpt.elapsed().as_secs_f64() >= every_min * 60.0;
            self.faults.hang_at(self.step + 1);
            self.faults.fail_at(self.step + 1)?;
            let (ce, sumsq, grads, wait, compute) = match self.forward_backward(self.scu.lambda) {
                Ok(v) => {
                    if let Some(why) = self.whole_why.take() {
                        out.emit(Event::Warning {
                            step: self.step,
                            message: format!(
                                "the per-op CUDA path runs (several times slower than the \
                                 whole-model step): {why}"
                            ),
                        });
                    }
                    v
                }
                Err(e) if is_oom(&e) && prev_batch.is_some() && self.dist.is_none() => {
                    let (failed, old) = (self.micro_batch, prev_batch.take().unwrap_or(1));
                    self.micro_batch = old;
                    self.loader.seek(step_cursor);
                    self.loader.set_batch_size(old);
                    out.emit(Event::Warning {
                        step: self.step,
                        message: format!("out of memory at micro-batch {failed}: back to {old}, step {} redone (nothing lost)", self.step + 1),
                    });
                    continue;
                }
                // Out of memory anywhere else: split the micro-batch and accumulate more, so
                // the optimizer step stays the same sequences; the step is redone.
                Err(e) if is_oom(&e) && self.dist.is_none() && self.micro_batch > 1 => {
                    let mb = self.micro_batch;
                    let k = (2..=mb).find(|k| mb.is_multiple_of(*k)).unwrap_or(mb);
                    self.micro_batch = mb / k;
                    self.accum *= k;
                    self.loader.seek(step_cursor);
                    self.loader.set_batch_size(self.micro_batch);
                    out.emit(Event::Warning {
                        step: self.step,
                        message: format!(
                            "out of memory at micro-batch {mb}: micro-batch {} × accumulation {} from now on (the same {} sequences a step), step {} redone",
                            self.micro_batch,
                            self.accum,
                            self.micro_batch * self.accum,
                            self.step + 1
                        ),
                    });
                    continue;
                }
                Err(e) => return Err(e.into()),
            };
            prev_batch = None;
            // Data parallelism: mean gradients and loss over the ranks, and every rank's timings.
            let t_comm = Instant::now();
            let Reduced {
                ce,
                grads,
                ranks,
                grad_scale,
                sharded,
                reg_sumsq,
                time_due,
            } = self.reduce_step(ce, grads, wait, compute)?;
            let sumsq = reg_sumsq.unwrap_or(sumsq);
            // The whole-model step's gradients still carry fp16's loss scale (the per-op path
            // divides it out itself): the update takes it out with the other factors.
            let grad_scale = match &self.whole {
                Some(_) => grad_scale / self.scaler.scale,
                None => grad_scale,
            };
            let comm = if ranks.is_empty() {
                0.0
            } else {
                t_comm.elapsed().as_secs_f64() * 1e3
            };
            let t_opt = Instant::now();
            let norm = match &sharded {
                Some((_, sq)) => sq.sqrt() * grad_scale,
                None => global_norm(&grads)? * grad_scale,
            };
            let finite = norm.is_finite() && ce.is_finite();
            let lr =
                lr_at(&self.cfg.schedule, self.cfg.optim.lr, self.step, max_steps) * self.lr_scale;
            let mut applied = 0.0;
            if self.scaler.update(finite) {
                nonfinite_in_a_row = 0;
                let clip = self.cfg.optim.grad_clip;
                // Clipping (and data parallelism's 1/world where the gradients hold the ranks'
                // sum, and fp16's 1/loss scale where they still carry it) is a gradient scale
                // the (fused) update applies itself. What the penalty's gradient meets is the
                // clipping alone: the other factors only undo how the gradients are held.
                let clipped = if clip > 0.0 && norm > clip {
                    clip / (norm + 1e-6)
                } else {
                    1.0
                };
                let f = grad_scale * clipped;
                applied = clipped;
                if let Some((flat, _)) = &sharded {
                    self.sharded_update(flat, lr, f)?;
                } else {
                    self.weights_copied =
                        self.opt
                            .step_with_copies(&grads, lr, f, self.whole.as_ref())?;
                }
            } else {
                nonfinite_in_a_row += 1;
                self.skipped_steps += 1;
                out.emit(Event::Warning {
                    step: self.step + 1,
                    message: format!(
                        "non-finite loss or gradients: step {} skipped ({} in a row, {} in all{})",
                        self.step + 1,
                        nonfinite_in_a_row,
                        self.skipped_steps,
                        if self.scaler.enabled {
                            format!(", loss scale now {}", self.scaler.scale)
                        } else {
                            String::new()
                        }
                    ),
                });
                // fp16 overflow is the scaler's business; a run that keeps producing NaN in
                // full precision is diverging: go back to the last checkpoint with a lower LR.
                if !self.scaler.enabled
                    && nonfinite_in_a_row >= self.cfg.checkpoint.max_nonfinite_in_a_row
                {
                    nonfinite_in_a_row = 0;
                    self.recover(out)?;
                    continue;
                }
                if nonfinite_in_a_row >= MAX_NONFINITE_IN_A_ROW {
                    return Err(EngineError::NonFinite {
                        step: self.step + 1,
                        count: nonfinite_in_a_row,
                    });
                }
            }
            self.device.synchronize()?;
            let optim = t_opt.elapsed();
            self.step += 1;
            if let Some(p) = &self.progress {
                p.step
                    .store(self.step, std::sync::atomic::Ordering::Relaxed);
            }
            let step_tokens = (self.micro_batch * self.accum * seq_len * self.world) as u64;
            self.tokens += step_tokens;
            let step_s = t_step.elapsed().as_secs_f64();
            let kernels = match &self.whole {
                Some(w) => w.take_profile()?,
                None => Vec::new(),
            };
            self.summary.last_loss = Some(ce);
            out.emit(Event::Step(StepStats {
                step: self.step,
                loss: ce,
                lr,
                grad_norm: norm,
                tokens_per_sec: step_tokens as f64 / step_s.max(1e-9),
                step_ms: step_s * 1e3,
                data_wait_ms: wait.as_secs_f64() * 1e3,
                compute_ms: compute.as_secs_f64() * 1e3,
                optim_ms: optim.as_secs_f64() * 1e3,
                micro_batch: self.micro_batch,
                accum: self.accum,
                tokens: self.tokens,
                epoch: self.tokens as f64 / self.dataset.train.len().max(1) as f64,
                elapsed_s: self.elapsed(start),
                memory_bytes: self.step_memory,
                host_rss_bytes: device::rss_bytes(),
                dropped_before: 0,
                comm_ms: comm,
                ranks,
                kernels,
            }));

            self.scu.observe_step(ce, lr, applied);
            if self.step.is_multiple_of(self.cfg.scu.control_every) {
                if let Some(mean_ce) = self.scu.take_window_mean() {
                    self.control(mean_ce, sumsq, out)?;
                }
            }
            let every = self.cfg.eval.every;
            let last = self.step == max_steps;
            let eval_due =
                (every > 0 && self.step.is_multiple_of(every)) || (last && self.cfg.eval.at_end);
            // Rank 0 evaluates (the held-out loss does not depend on the rank), with whole
            // weights (ZeRO-1's are gathered first: a collective, so on every rank).
            if eval_due {
                self.full_masters()?;
            }
            if eval_due && self.rank == 0 {
                let ev = self.evaluate()?;
                if self.best_val.is_none_or(|b| ev.val_loss < b) {
                    self.best_val = Some(ev.val_loss);
                }
                self.summary.last_val = Some(ev.clone());
                out.emit(Event::Eval(ev));
                if let Some(ev) = self.sample_text()? {
                    out.emit(ev);
                }
            }
            let c = &self.cfg.checkpoint;
            let due_steps = c.every_steps > 0 && self.step.is_multiple_of(c.every_steps);
            // (Rank 0's clock decides for every rank: a sharded optimizer's checkpoint is a
            // collective.)
            let due_time = time_due;
            if due_steps || due_time || (last && c.at_end) {
                self.checkpoint_event(start, out)?;
                last_ckpt = Instant::now();
            }
        }
        self.elapsed_before = self.elapsed(start);
        self.full_masters()?;
        Ok((
            FinishReason::Completed,
            format!("reached max_steps ({max_steps})"),
        ))
    }
}
