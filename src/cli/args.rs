//! Command-line arguments (clap derive).

use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;

const EXAMPLES: &str = "\
Examples:
  cockpit train                              tiny model on the built-in corpus, live dashboard
  cockpit train configs/gpt2-small.toml --device cuda
  cockpit train cfg.toml --no-tui --set optim.lr=1e-3 --set scu.target=0.01
  cockpit train cfg.toml --resume latest     continue the newest run of this config
  cockpit train --test-run                   a few steps through every stage, exit 0 if all works
  cockpit --monitor-only                     watch the GPUs (any job) with the advisor
  cockpit monitor --once --json              one JSON snapshot of GPUs and host
  cockpit check                              what this machine has, and what cockpit would use
  cockpit bench configs/gpt2-small.toml      ms/step, tokens/s, MFU and peak memory of the step
  cockpit bench --soak 3000                  3000 steps: exit 1 if host or device memory grows
  cockpit bench cfg.toml --find-batch        the largest micro-batch that fits this device
  cockpit plot runs/tiny-20260101-120000     PNG/SVG plots of a run
  cockpit sweep --set-grid scu.target=0.01,0.02 --set-grid scu.enabled=false --seeds 3
  cockpit compare runs/sweep-tiny-20260101-120000   table + overlaid charts of its runs
  cockpit attach runs/tiny-20260101-120000   the dashboard on a headless run (q detaches)
  cockpit export runs/ft-20260101-120000 out/ft   a Hugging Face directory transformers loads
  cockpit generate out/ft --prompt 'Once upon'    continue a prompt (run dir, checkpoint or HF dir)
  cockpit chat runs/ft-20260101-120000       chat through the model's chat template (stdin lines)

Exit codes: 0 ok, 1 runtime failure, 2 usage or config error, 3 this rank ended because another
rank of its data-parallel job failed, 130 interrupted.";

#[derive(Parser, Debug)]
#[command(name = "cockpit", version, about = "A terminal training cockpit: train transformer LMs, steer them live, watch the GPU.", after_help = EXAMPLES)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Cmd>,
    /// Monitor the GPUs and advise, without training (same as `cockpit monitor`).
    #[arg(long)]
    pub monitor_only: bool,
    #[command(flatten)]
    pub monitor: MonitorArgs,
}

#[derive(Subcommand, Debug)]
pub enum Cmd {
    /// Train a model (no CONFIG: the embedded default, a tiny GPT on a built-in corpus).
    Train(TrainArgs),
    /// Watch GPUs and the host with the advisor, without training.
    Monitor(MonitorArgs),
    /// Report what this machine has and what cockpit would use on it.
    Check,
    /// Time the training step: warm-up, then the median over the second half of the timed
    /// steps; tokens/s, the ms/step breakdown, MFU and peak memory (the same method as
    /// benches/torch_reference.py).
    Bench {
        /// Config file (omit for the embedded default).
        config: Option<PathBuf>,
        /// Timed steps (after the warm-up).
        #[arg(long, default_value_t = 50)]
        steps: u64,
        /// Warm-up steps (kernel compilation, allocator growth).
        #[arg(long, default_value_t = 10)]
        warmup: u64,
        #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
        set: Vec<String>,
        #[arg(long, value_name = "cpu|cuda[:N]")]
        device: Option<String>,
        /// Also write the figures as JSON.
        #[arg(long, value_name = "FILE")]
        json: Option<PathBuf>,
        /// Time every kernel of the whole-model CUDA step (CUDA events; slows the step a
        /// little) and print the GPU time per kernel group.
        #[arg(long)]
        profile: bool,
        /// Soak test: run STEPS steps after the warm-up and judge memory, not time — host
        /// RSS (and device memory on a GPU) must not grow past the warm-up; exit 1 if it does.
        #[arg(long, value_name = "STEPS", conflicts_with = "steps")]
        soak: Option<u64>,
        /// Find the largest micro-batch that fits, by trying (two steps each: doubling, then
        /// bisecting); prints it and one with a 10% margin to set as optim.micro_batch.
        #[arg(long, conflicts_with_all = ["soak", "profile"])]
        find_batch: bool,
        /// Data parallel on N GPUs of this machine (one worker each, as `train --gpus`):
        /// tokens/s of the whole job, and the communication time the step does not hide.
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..),
              conflicts_with_all = ["soak", "profile", "find_batch"])]
        gpus: Option<u16>,
    },
    /// Tokenize and pack a config's text data ahead of training.
    Prepare {
        /// Config file.
        config: PathBuf,
        #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
        set: Vec<String>,
    },
    /// Open the dashboard on a run started elsewhere (e.g. `train --no-tui` under nohup):
    /// history first, then live. `q` detaches; the run goes on.
    Attach {
        /// The run directory.
        run_dir: PathBuf,
        /// Progress lines instead of the dashboard.
        #[arg(long)]
        no_tui: bool,
        /// Let this viewer stop the run (off: quitting only detaches).
        #[arg(long)]
        allow_stop: bool,
        /// TUI theme.
        #[arg(long, value_name = "NAME|PATH")]
        theme: Option<String>,
    },
    /// Fold a LoRA run's adapters into its base weights (writes model.safetensors, HF names).
    Merge {
        /// A LoRA run dir, checkpoints dir or checkpoint.
        checkpoint: PathBuf,
        /// Output directory (default: <run>/merged).
        #[arg(long, value_name = "DIR")]
        out: Option<PathBuf>,
    },
    /// Write a Hugging Face model directory (config.json, safetensors, tokenizer files,
    /// generation_config.json) that transformers' AutoModelForCausalLM loads.
    Export {
        /// A run dir, checkpoints dir or checkpoint (or a Hugging Face directory).
        source: PathBuf,
        /// The directory to write (must not exist, or be empty).
        out: PathBuf,
        /// LoRA runs: the PEFT adapter alone (adapter_config.json + adapter_model.safetensors)
        /// instead of merged weights.
        #[arg(long)]
        adapter: bool,
        /// Weights dtype: f32, bf16 or f16 (default: the base model's, else f32).
        #[arg(long, value_name = "f32|bf16|f16")]
        dtype: Option<String>,
        /// Split the weights into shards of at most this size, with an index (e.g. 500MB, 5GB).
        #[arg(long, value_name = "SIZE", default_value = "5GB")]
        max_shard_size: String,
        /// hf (a Hugging Face directory) or gguf (one llama.cpp file); default: gguf when OUT
        /// ends in .gguf, else hf.
        #[arg(long, value_name = "hf|gguf")]
        format: Option<String>,
        /// GGUF tensor encoding: f32, f16, bf16, q8_0, q4_0 or q4_1 (default f16).
        #[arg(long, value_name = "TYPE")]
        quant: Option<String>,
    },
    /// Continue a prompt with a trained model (KV cache), streaming the text to stdout.
    Generate {
        /// A run dir, checkpoints dir, checkpoint, or Hugging Face model directory.
        source: PathBuf,
        /// The prompt text (encoded with the model's tokenizer, special tokens included).
        #[arg(long, value_name = "TEXT")]
        prompt: Option<String>,
        /// The prompt as token ids instead: 1,2,3.
        #[arg(long, value_name = "IDS", value_delimiter = ',')]
        prompt_ids: Vec<u32>,
        /// New tokens at most (generation also stops at the model's end-of-sequence token).
        #[arg(long, value_name = "N", default_value_t = 128)]
        max_tokens: usize,
        #[command(flatten)]
        sampling: SamplingArgs,
        #[arg(long, value_name = "cpu|cuda[:N]")]
        device: Option<String>,
        /// Print the new token ids (one line) instead of text.
        #[arg(long)]
        ids: bool,
        /// Do not stop at the end-of-sequence token.
        #[arg(long)]
        ignore_eos: bool,
        /// Send the prompt as a user turn through the model's chat template (with the
        /// assistant's generation prompt), as transformers' apply_chat_template does.
        #[arg(long)]
        chat: bool,
        /// Many prompts: one a line, or JSON Lines with a "prompt" (or "prompt_ids") field;
        /// writes JSON Lines (prompt, samples, token counts, stop reason, diversity).
        #[arg(long, value_name = "FILE")]
        prompts: Option<PathBuf>,
        /// Samples per prompt (their diversity is measured when there are 2 or more).
        #[arg(long, value_name = "N", default_value_t = 1)]
        samples: usize,
        /// Sequences decoded together (default: as many as half the GPU's free memory holds
        /// for the longest prompt and --max-tokens, at most 512; 64 on the CPU).
        #[arg(long, value_name = "B")]
        batch_size: Option<usize>,
        /// Where the JSON Lines go (default: stdout).
        #[arg(long, value_name = "FILE")]
        output: Option<PathBuf>,
        /// Benchmark: tokens/s of batches of these sizes (random prompts of --bench-prompt ids,
        /// --max-tokens new tokens each, no stop token), one JSON line per batch size.
        #[arg(long, value_name = "B1,B2,..", value_delimiter = ',')]
        bench: Vec<usize>,
        /// With --bench: the random prompts' length in tokens.
        #[arg(long, value_name = "N", default_value_t = 16)]
        bench_prompt: usize,
    },
    /// Chat with a model in the terminal: each line of stdin is a user turn; the whole
    /// conversation goes through the model's chat template and the reply streams to stdout.
    /// `/reset` forgets the conversation, `/exit` (or end of input) ends. Plain lines, so it
    /// also works piped.
    Chat {
        /// A run dir (LoRA runs: base + adapters), checkpoint, or Hugging Face model directory.
        source: PathBuf,
        /// A system turn at the start of the conversation.
        #[arg(long, value_name = "TEXT")]
        system: Option<String>,
        /// New tokens at most, per reply (a reply also ends at the end-of-turn token).
        #[arg(
            long,
            visible_alias = "max-new-tokens",
            value_name = "N",
            default_value_t = 256
        )]
        max_tokens: usize,
        #[command(flatten)]
        sampling: SamplingArgs,
        /// auto (the default: the first GPU where there is one), cpu, cuda or cuda:N.
        #[arg(long, value_name = "auto|cpu|cuda[:N]")]
        device: Option<String>,
    },
    /// Write PNG and SVG plots of a run (loss, S-ratio, λ, LR, tokens/s, GPU).
    Plot {
        /// The run directory.
        run_dir: PathBuf,
    },
    /// Train every combination of a grid of config values, each seed, one run after another
    /// (one per GPU at a time when several are visible), each in its own run dir under one
    /// sweep dir; the same command again resumes it.
    Sweep {
        /// Config file (omit for the embedded default).
        config: Option<PathBuf>,
        /// One family of runs: KEY=V1,V2,... ; keys joined by `+` make their product
        /// (`scu.enabled=false+scu.lambda_init=0,0.1,1`). Repeatable: the sweep is the union.
        #[arg(long = "set-grid", value_name = "KEY=V1,V2[+KEY=...]")]
        set_grid: Vec<String>,
        /// Seeds per configuration: run.seed, run.seed+1, ... (default: the config's
        /// sweep.seeds, 1)
        #[arg(long)]
        seeds: Option<u64>,
        /// Override a config key for every run (repeatable).
        #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
        set: Vec<String>,
        /// The sweep dir (default: runs/sweep-<name>-<timestamp>); an existing one resumes.
        #[arg(long, value_name = "DIR")]
        out: Option<PathBuf>,
        #[arg(long, value_name = "cpu|cuda[:N]")]
        device: Option<String>,
        /// Steps of every run, as `train --max-steps` (the warm-up shortened in proportion).
        #[arg(long, value_name = "N")]
        max_steps: Option<u64>,
    },
    /// Runs side by side: final/best held-out bits/token (mean ± sd over seeds), λ and S at
    /// the end, tokens/s; overlaid PNG/SVG charts of val bits/token, S and λ. On a terminal
    /// the same opens as a view (↑/↓ select an arm, tab or 1-3 switch the chart, q quits);
    /// the table is printed when it closes.
    Compare {
        /// Run dirs, or a sweep dir (or any dir with run dirs in it).
        #[arg(required = true)]
        paths: Vec<PathBuf>,
        /// Where compare.md, compare.json and the charts go (default: SWEEP_DIR/compare, or
        /// compare-<timestamp>).
        #[arg(long, value_name = "DIR")]
        out: Option<PathBuf>,
        /// Print the table without opening the view (implied when stdout is not a terminal);
        /// the files are written either way.
        #[arg(long)]
        no_tui: bool,
        /// TUI theme: dark, light, high-contrast, or a theme file.
        #[arg(long, value_name = "NAME|PATH")]
        theme: Option<String>,
    },
}

/// How `generate` and `chat` choose the next token.
#[derive(Args, Debug, Clone)]
pub struct SamplingArgs {
    /// 0 = greedy (always the most likely token).
    #[arg(long, value_name = "T", default_value_t = 0.8)]
    pub temperature: f64,
    /// Sample from the K most likely tokens; 0 = all.
    #[arg(long, value_name = "K", default_value_t = 40)]
    pub top_k: usize,
    /// Sample from the smallest set of tokens with probability ≥ P; 1 = all.
    #[arg(long, value_name = "P", default_value_t = 0.95)]
    pub top_p: f64,
    /// Logits of tokens already in the sequence ÷ R (× R when negative); 1 = off.
    #[arg(long, value_name = "R", default_value_t = 1.0)]
    pub repetition_penalty: f64,
    #[arg(long, value_name = "S", default_value_t = 0)]
    pub seed: u64,
}

impl SamplingArgs {
    pub fn sampling(&self) -> crate::engine::generate::Sampling {
        crate::engine::generate::Sampling {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            repetition_penalty: self.repetition_penalty,
            seed: self.seed,
        }
    }
}

#[derive(Args, Debug, Clone, Default)]
pub struct TrainArgs {
    /// Config file (TOML). Omit for the embedded default (configs/tiny.toml).
    pub config: Option<PathBuf>,
    /// Headless: progress lines on stderr (implied when stdout is not a terminal).
    #[arg(long)]
    pub no_tui: bool,
    /// Override run.max_steps.
    #[arg(long, value_name = "N")]
    pub max_steps: Option<u64>,
    /// Run directory (default: runs/<name>-<timestamp>).
    #[arg(long, value_name = "DIR")]
    pub run_dir: Option<PathBuf>,
    /// Override a config key, typed and validated like the file (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub set: Vec<String>,
    /// Resume: `latest` (newest run of this config's name) or a run/checkpoint path.
    #[arg(long, value_name = "latest|PATH", num_args = 0..=1, default_missing_value = "latest")]
    pub resume: Option<String>,
    /// Start over in a --run-dir that holds an earlier run's records: they move to
    /// RUN_DIR/archive/<timestamp>/ (nothing is deleted).
    #[arg(long, conflicts_with = "resume")]
    pub fresh: bool,
    /// A few steps through every stage (data, forward/backward, eval, checkpoint, SCU); exit 0 when the pipeline works.
    #[arg(long)]
    pub test_run: bool,
    /// TUI theme: dark, light, high-contrast, or a theme file.
    #[arg(long, value_name = "NAME|PATH")]
    pub theme: Option<String>,
    /// cpu, cuda or cuda:N (default: run.device, "auto").
    #[arg(long, value_name = "cpu|cuda[:N]")]
    pub device: Option<String>,
    /// Data-parallel on N GPUs of this machine: one worker process each (default:
    /// distributed.gpus). Across machines, start one `cockpit train` per GPU with RANK,
    /// WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set (torchrun, srun, mpirun).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..))]
    pub gpus: Option<u16>,
}

#[derive(Args, Debug, Clone, Default)]
pub struct MonitorArgs {
    /// Status lines instead of the dashboard (implied when stdout is not a terminal).
    #[arg(long)]
    pub no_tui: bool,
    /// One sample, then exit.
    #[arg(long)]
    pub once: bool,
    /// JSON output (with --once: one snapshot with `gpus`, `host` and `advice`).
    #[arg(long)]
    pub json: bool,
    /// Seconds between samples.
    #[arg(long, value_name = "SECS")]
    pub interval: Option<f64>,
    /// Stop after this many seconds.
    #[arg(long, value_name = "SECS")]
    pub duration: Option<f64>,
    /// Record samples to a JSONL trace.
    #[arg(long, value_name = "FILE.jsonl")]
    pub record: Option<PathBuf>,
    /// Drive the monitor from a recorded trace instead of live sampling.
    #[arg(long, value_name = "FILE.jsonl")]
    pub replay: Option<PathBuf>,
    /// Replay speed: 1 = real time, 10 = ten times faster, 0 = as fast as possible.
    #[arg(long, value_name = "X", default_value_t = 1.0)]
    pub replay_speed: f64,
    /// Where monitor_summary.json and plots go (default: runs/monitor-<timestamp>).
    #[arg(long, value_name = "DIR")]
    pub out_dir: Option<PathBuf>,
    /// TUI theme.
    #[arg(long, value_name = "NAME|PATH")]
    pub theme: Option<String>,
}
