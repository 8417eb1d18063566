//! The engine's typed vocabulary: [`Command`]s in, [`Event`]s out.
//!
//! Every front end (TUI, headless, attach, report) consumes the same [`Event`] stream.
//! The channel never blocks the engine: `Step` events are dropped (and counted) when the
//! consumer falls behind; every other event is always delivered, in order.

use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

/// serde_json writes NaN and ±inf as `null`; read `null` back as NaN so a run whose loss went
/// non-finite still has a readable metrics.jsonl.
pub fn nan_f64<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// A request to change the run, applied by the engine at the next optimizer-step boundary.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "command", rename_all = "snake_case")]
pub enum Command {
    /// New micro-batch size (sequences per forward pass).
    SetBatchSize {
        micro_batch: usize,
    },
    /// New SCU setpoint S* (a fraction, e.g. 0.01 for 1%).
    SetScuSetpoint {
        target: f64,
    },
    CheckpointNow,
    Pause,
    Resume,
    /// Stop the run; `save` writes a checkpoint first.
    Stop {
        save: bool,
    },
    /// A signal (e.g. "SIGINT"): write a checkpoint, then stop; the run ends `Interrupted`.
    Interrupt {
        signal: String,
    },
}

impl Command {
    /// Short human label, for logs and the event panel.
    pub fn label(&self) -> String {
        match self {
            Command::SetBatchSize { micro_batch } => format!("batch size -> {micro_batch}"),
            Command::SetScuSetpoint { target } => format!("SCU setpoint -> {:.2}%", target * 100.0),
            Command::CheckpointNow => "checkpoint now".into(),
            Command::Pause => "pause".into(),
            Command::Resume => "resume".into(),
            Command::Stop { save: true } => "save and stop".into(),
            Command::Stop { save: false } => "stop".into(),
            Command::Interrupt { signal } => format!("save and stop ({signal})"),
        }
    }
}

/// Static facts about a run, sent once at start.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunInfo {
    pub run_name: String,
    pub run_dir: String,
    /// e.g. "cpu" or "cuda:0 (NVIDIA H100 80GB HBM3)"
    pub device: String,
    /// "f32", "bf16", "f16"
    pub dtype: String,
    /// Why this dtype was chosen.
    pub dtype_reason: String,
    pub params_total: u64,
    pub params_trainable: u64,
    pub start_step: u64,
    pub max_steps: u64,
    pub micro_batch: usize,
    pub accum: usize,
    pub seq_len: usize,
    pub vocab_size: usize,
    /// Training tokens in one epoch (the train split).
    pub train_tokens: u64,
    /// Entropy floor of the data in bits per token, when known (the built-in corpus).
    pub entropy_floor_bpt: Option<f64>,
    /// Model FLOPs per token for one optimizer step (fwd+bwd, 6N + attention), for MFU.
    #[serde(deserialize_with = "nan_f64")]
    pub flops_per_token: f64,
    /// Peak dense FLOP/s of the device in the chosen dtype, when known.
    pub peak_flops: Option<f64>,
    /// Attention's forward FLOPs per attention layer over one sequence of `seq_len` (causal,
    /// through sliding windows; the backward is 2.5x), for the attention TFLOP/s `cockpit bench
    /// --profile` reports. None without attention layers.
    #[serde(default)]
    pub attention_flops_fwd: Option<f64>,
    /// The Mamba chunk kernels' FLOPs per launch over one sequence of `seq_len` (a hybrid on the
    /// CUDA step), for the chunk products' TFLOP/s `cockpit bench --profile` reports.
    #[serde(default)]
    pub mamba_flops: Option<crate::engine::spec::MambaFlops>,
    pub scu_enabled: bool,
    #[serde(deserialize_with = "nan_f64")]
    pub scu_target: f64,
    /// One-line summary of the model and optimiser configuration.
    pub summary: String,
}

/// One optimizer step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepStats {
    pub step: u64,
    /// Mean cross-entropy (nats/token) over the step's micro-batches.
    #[serde(deserialize_with = "nan_f64")]
    pub loss: f64,
    #[serde(deserialize_with = "nan_f64")]
    pub lr: f64,
    #[serde(deserialize_with = "nan_f64")]
    pub grad_norm: f64,
    #[serde(deserialize_with = "nan_f64")]
    pub tokens_per_sec: f64,
    #[serde(deserialize_with = "nan_f64")]
    pub step_ms: f64,
    #[serde(deserialize_with = "nan_f64")]
    pub data_wait_ms: f64,
    #[serde(deserialize_with = "nan_f64")]
    pub compute_ms: f64,
    #[serde(deserialize_with = "nan_f64")]
    pub optim_ms: f64,
    pub micro_batch: usize,
    pub accum: usize,
    /// Tokens seen so far.
    pub tokens: u64,
    /// Fractional epochs over the train split.
    #[serde(deserialize_with = "nan_f64")]
    pub epoch: f64,
    #[serde(deserialize_with = "nan_f64")]
    pub elapsed_s: f64,
    /// Device memory in use by the engine in bytes, when known (the process's RSS on the CPU).
    pub memory_bytes: Option<u64>,
    /// The process's resident host memory in bytes, when known (on every device: a CUDA run
    /// can leak host memory while its device memory stays flat).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_rss_bytes: Option<u64>,
    /// Step events dropped since the last delivered one (slow consumer).
    #[serde(default)]
    pub dropped_before: u64,
    /// Data parallelism: time in the gradient and loss all-reduce (with the wait for the
    /// slowest rank), part of `step_ms`; 0 for a single process.
    #[serde(default)]
    pub comm_ms: f64,
    /// Data parallelism: every rank's share of the step (empty for a single process).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ranks: Vec<RankStat>,
    /// GPU time of the step by kernel group (the whole-model CUDA step with kernel profiling
    /// on, as `cockpit bench --profile`); empty otherwise.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub kernels: Vec<KernelTime>,
    /// Instruction/chat data: the share of the step's target slots that trained (the
    /// answers; padding and prompts do not).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trained_share: Option<f64>,
}

/// GPU time of one group of kernels in a step (CUDA events around each launch).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KernelTime {
    pub name: String,
    pub ms: f64,
    pub launches: u32,
}

/// How far a run has got, for a watchdog on another thread: a run that stops stepping is
/// stuck, and `waiting` says whether it waits in a collective (for a peer) or is stuck itself.
#[derive(Debug, Default)]
pub struct Progress {
    /// The last finished optimizer step; `u64::MAX` once the run has ended.
    pub step: std::sync::atomic::AtomicU64,
    /// Inside a collective (waiting for the other ranks).
    pub waiting: std::sync::atomic::AtomicBool,
    /// This rank's GPU as last sampled by the front end (NVML): utilization % and
    /// temperature °C, `u32::MAX` when unknown. They travel to rank 0 with the step.
    pub gpu_util_pct: std::sync::atomic::AtomicU32,
    pub gpu_temp_c: std::sync::atomic::AtomicU32,
}

impl Progress {
    pub fn new() -> Self {
        Self {
            gpu_util_pct: u32::MAX.into(),
            gpu_temp_c: u32::MAX.into(),
            ..Self::default()
        }
    }
}

/// One rank's part of a data-parallel step, gathered to every rank with the loss.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RankStat {
    pub rank: usize,
    /// Forward/backward time of the step on this rank.
    #[serde(deserialize_with = "nan_f64")]
    pub compute_ms: f64,
    #[serde(deserialize_with = "nan_f64")]
    pub data_wait_ms: f64,
    /// Device memory in use on this rank, when known.
    pub memory_bytes: Option<u64>,
    /// This rank's GPU utilization (NVML, sampled about once a second), when known.
    #[serde(default)]
    pub gpu_util_pct: Option<f64>,
    /// This rank's GPU temperature, when known.
    #[serde(default)]
    pub gpu_temp_c: Option<f64>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EvalStats {
    pub step: u64,
    #[serde(deserialize_with = "nan_f64")]
    pub val_loss: f64,
    #[serde(deserialize_with = "nan_f64")]
    pub val_bpt: f64,
    #[serde(deserialize_with = "nan_f64")]
    pub val_ppl: f64,
    /// Standard error of `val_loss` over the eval's windows (NaN when unknown: one window, or
    /// a run from before it was recorded).
    #[serde(default = "nan", deserialize_with = "nan_f64")]
    pub val_loss_se: f64,
    /// The same in bits/token.
    #[serde(default = "nan", deserialize_with = "nan_f64")]
    pub val_bpt_se: f64,
    /// Val tokens the eval scored (0 when unknown).
    #[serde(default)]
    pub val_tokens: u64,
}

fn nan() -> f64 {
    f64::NAN
}

/// One SCU control step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ScuStats {
    pub step: u64,
    #[serde(deserialize_with = "nan_f64")]
    pub ce_loss: f64,
    #[serde(deserialize_with = "nan_f64")]
    pub reg_loss: f64,
    #[serde(deserialize_with = "nan_f64")]
    pub total_loss: f64,
    #[serde(deserialize_with = "nan_f64")]
    pub data_bpt: f64,
    #[serde(deserialize_with = "nan_f64")]
    pub param_bpt: f64,
    #[serde(deserialize_with = "nan_f64")]
    pub s_ratio: f64,
    #[serde(deserialize_with = "nan_f64")]
    pub s_hat: f64,
    #[serde(deserialize_with = "nan_f64")]
    pub lambda: f64,
    #[serde(deserialize_with = "nan_f64")]
    pub integral: f64,
    #[serde(deserialize_with = "nan_f64")]
    pub error: f64,
    #[serde(deserialize_with = "nan_f64")]
    pub target: f64,
    /// Whether control is on (off: S is measured, λ stays at lambda_init).
    pub control: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// Reached max_steps.
    Completed,
    /// A Stop command.
    Stopped,
    /// A signal (SIGINT/SIGTERM).
    Interrupted,
    /// A runtime failure; see the preceding Warning/Error.
    Failed,
}

/// Everything the engine tells the world.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    RunStarted(RunInfo),
    Step(StepStats),
    Eval(EvalStats),
    Scu(ScuStats),
    ScuConverged {
        step: u64,
        #[serde(deserialize_with = "nan_f64")]
        s_ratio: f64,
        #[serde(deserialize_with = "nan_f64")]
        lambda: f64,
        #[serde(deserialize_with = "nan_f64")]
        target: f64,
    },
    CheckpointSaved {
        step: u64,
        path: String,
        bytes: u64,
        ms: f64,
    },
    CommandApplied {
        step: u64,
        command: Command,
        detail: String,
    },
    CommandRejected {
        step: u64,
        command: Command,
        reason: String,
    },
    Paused {
        step: u64,
    },
    Resumed {
        step: u64,
    },
    Warning {
        step: u64,
        message: String,
    },
    /// A greedy continuation of a fixed prompt at an eval (`eval.sample_tokens`).
    Sample {
        step: u64,
        prompt: String,
        text: String,
    },
    /// Sampled continuations of `eval.sample_prompts` at an eval (`eval.samples_per_prompt`
    /// each, decoded together) and their diversity: means over the prompts.
    SampleDiversity {
        step: u64,
        prompts: usize,
        samples_per_prompt: usize,
        new_tokens: usize,
        tokens_per_s: f64,
        distinct_1: Option<f64>,
        distinct_2: Option<f64>,
        distinct_3: Option<f64>,
        cosine_distance: Option<f64>,
        /// The first prompt's first sample.
        example: String,
    },
    Finished {
        step: u64,
        reason: FinishReason,
        message: String,
        #[serde(deserialize_with = "nan_f64")]
        elapsed_s: f64,
    },
}

impl Event {
    pub fn step(&self) -> u64 {
        match self {
            Event::RunStarted(r) => r.start_step,
            Event::Step(s) => s.step,
            Event::Eval(e) => e.step,
            Event::Scu(s) => s.step,
            Event::ScuConverged { step, .. }
            | Event::CheckpointSaved { step, .. }
            | Event::CommandApplied { step, .. }
            | Event::CommandRejected { step, .. }
            | Event::Paused { step }
            | Event::Resumed { step }
            | Event::Warning { step, .. }
            | Event::Sample { step, .. }
            | Event::SampleDiversity { step, .. }
            | Event::Finished { step, .. } => *step,
        }
    }
}

/// Sending half of the event channel, owned by the engine. Never blocks.
#[derive(Clone)]
pub struct EventTx {
    tx: mpsc::Sender<Event>,
    queued_steps: Arc<AtomicUsize>,
    dropped: Arc<AtomicUsize>,
    max_queued_steps: usize,
    dropped_since_last: Arc<AtomicUsize>,
}

/// Receiving half of the event channel.
pub struct EventRx {
    rx: mpsc::Receiver<Event>,
    queued_steps: Arc<AtomicUsize>,
    dropped: Arc<AtomicUsize>,
}

/// An event channel that holds at most `max_queued_steps` undelivered `Step` events.
pub fn channel(max_queued_steps: usize) -> (EventTx, EventRx) {
    let (tx, rx) = mpsc::channel();
    let queued_steps = Arc::new(AtomicUsize::new(0));
    let dropped = Arc::new(AtomicUsize::new(0));
    (
        EventTx {
            tx,
            queued_steps: queued_steps.clone(),
            dropped: dropped.clone(),
            max_queued_steps: max_queued_steps.max(1),
            dropped_since_last: Arc::new(AtomicUsize::new(0)),
        },
        EventRx {
            rx,
            queued_steps,
            dropped,
        },
    )
}

impl EventTx {
    /// Send an event. A `Step` event is dropped (and counted) when the consumer already has
    /// `max_queued_steps` of them waiting. Returns false when the receiver is gone.
    pub fn send(&self, mut ev: Event) -> bool {
        if let Event::Step(s) = &mut ev {
            if self.queued_steps.load(Ordering::Acquire) >= self.max_queued_steps {
                self.dropped.fetch_add(1, Ordering::Relaxed);
                self.dropped_since_last.fetch_add(1, Ordering::Relaxed);
                return true;
            }
            s.dropped_before += self.dropped_since_last.swap(0, Ordering::Relaxed) as u64;
            self.queued_steps.fetch_add(1, Ordering::AcqRel);
        }
        self.tx.send(ev).is_ok()
    }

    /// Step events dropped so far because the consumer was slow.
    pub fn dropped(&self) -> usize {
        self.dropped.load(Ordering::Relaxed)
    }
}

impl EventRx {
    fn seen(&self, ev: &Event) {
        if matches!(ev, Event::Step(_)) {
            self.queued_steps.fetch_sub(1, Ordering::AcqRel);
        }
    }
    pub fn recv(&self) -> Option<Event> {
        let ev = self.rx.recv().ok()?;
        self.seen(&ev);
        Some(ev)
    }
    pub fn recv_timeout(&self, d: Duration) -> Result<Event, mpsc::RecvTimeoutError> {
        let ev = self.rx.recv_timeout(d)?;
        self.seen(&ev);
        Ok(ev)
    }
    pub fn try_recv(&self) -> Result<Event, mpsc::TryRecvError> {
        let ev = self.rx.try_recv()?;
        self.seen(&ev);
        Ok(ev)
    }
    /// Everything queued right now, without waiting.
    pub fn drain(&self) -> Vec<Event> {
        let mut out = Vec::new();
        while let Ok(ev) = self.try_recv() {
            out.push(ev);
        }
        out
    }
    pub fn dropped(&self) -> usize {
        self.dropped.load(Ordering::Relaxed)
    }
}
