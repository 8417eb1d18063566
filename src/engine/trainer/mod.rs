//! The training loop on its own thread: `Command`s are applied only at optimizer-step
//! boundaries; `Event`s go out through a channel that never blocks, and every event is also
//! appended to `metrics.jsonl` in the run dir.
//!
//! [`Trainer`] (here) holds the run's state; each file adds the methods of one responsibility:
//! - `handle`: what to run ([`EngineOptions`]), the engine thread ([`Engine::spawn`]), how the
//!   run ended ([`RunSummary`]);
//! - `setup`: device, precision, base model, data, model, optimizer and loader, before step 1;
//! - `resume`: the shape hash, the config keys a resume may change, loading a checkpoint;
//! - `checkpoints`: the training state and writing a checkpoint;
//! - `run_info`: the run header;
//! - `eval`: held-out evaluation and the sample text;
//! - `executor`: which executor runs a step; `per_op` (candle autograd) and `whole_step` (the
//!   whole-model CUDA step) are the two;
//! - `parallel`: data parallelism as one strategy (single process, DDP, ZeRO-1);
//!   `data_parallel`: what the trainer lends it at each point of a step;
//! - `commands`: commands applied at step boundaries;
//! - `scu_control`: the SCU controller's reading and its files;
//! - `recorder`: metrics.jsonl and the run dir's JSON files;
//! - `non_finite` and `out_of_memory`: a step that went wrong, and what the run does then;
//! - `run_loop`: the loop, which calls the above.

mod checkpoints;
mod commands;
mod data_parallel;
mod eval;
mod executor;
mod handle;
mod non_finite;
mod out_of_memory;
mod parallel;
mod per_op;
mod recorder;
mod resume;
mod run_info;
mod run_loop;
mod scu_control;
mod setup;
mod whole_step;

pub use handle::{Engine, EngineOptions, EngineThread, RunSummary};
pub use resume::shape_hash;

use super::data::loader::{EvalPlan, Loader};
use super::data::{self, Dataset};
use super::events::{self, EvalStats, ScuStats};
use super::faults::Faults;
use super::model::Model;
use super::optim::AdamW;
use super::precision::LossScaler;
use super::scu::ScuController;
use super::EngineError;
use crate::config::Config;
use candle_core::{DType, Device};
use std::path::{Path, PathBuf};

const LN2: f64 = std::f64::consts::LN_2;
/// Largest micro-batch the engine accepts from a command.
pub use crate::config::MAX_MICRO_BATCH;

struct Trainer {
    cfg: Config,
    /// The job's run dir: checkpoints live here (written by rank 0 only).
    run_dir: PathBuf,
    /// Where this rank's own files go (metrics.jsonl, SCU files): the run dir on rank 0.
    out_dir: PathBuf,
    /// How the ranks share a step: one process, DDP or ZeRO-1 (with the process group).
    parallel: Box<dyn parallel::DataParallel>,
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
    whole_step: Option<super::kernels::ModelStep>,
    whole_step_tried: bool,
    /// Why a CUDA run takes the per-op path (said once, as a warning, after the first step).
    per_op_reason: Option<String>,
    /// A token cache that failed mid-step (its error goes out as itself, exit code 2, not as
    /// the tensor error the step's signature carries).
    data_fault: Option<data::DataError>,
    /// `eval.sample_tokens`: the prompt's ids, the tokenizer that shows the text (None: the
    /// built-in corpus, shown as ids) and the tokens that end a reply.
    sample: Option<(Vec<u32>, Option<data::Tok>, Vec<u32>)>,
    /// `eval.samples_per_prompt`: the ids of `eval.sample_prompts` and the tokenizer.
    sample_set: Option<eval::SampleSet>,
    /// The last optimizer step wrote the updated weights into the whole-model step's bf16
    /// copies (its next `begin` need not cast them); anything else that sets the weights
    /// clears it.
    weights_copied: bool,
    /// Instruction/chat data: (targets that train, targets) in the micro-batches since the
    /// last step record (`trained_share` in metrics.jsonl).
    trained_slots: (u64, u64),
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
