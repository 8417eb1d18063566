//! The `cockpit` command line: parses arguments, loads the config, starts the engine and the
//! chosen front end, and maps outcomes to exit codes (0 ok, 1 failure, 2 usage, 3 another
//! rank failed, 130 interrupted).

pub mod args;
mod bench;
mod bench_rates;
mod chat;
mod check;
mod fit;
mod flag_sets;
mod frontends;
mod generate;
mod gguf;
mod hf;
mod launch;
mod max_steps;
mod rank;
mod restart;
mod run_dirs;
mod run_lock;
mod sweep;

use crate::config::{self, Config, ConfigError};
use crate::engine::events::FinishReason;
use crate::engine::{checkpoint, Engine, EngineOptions};
use crate::process::SignalFlags;
use anyhow::Context;
use args::{Cli, Cmd, MonitorArgs, TrainArgs};
use clap::Parser;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};

pub use crate::process::{EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK, EXIT_PEER_FAILED, EXIT_USAGE};

/// Parse the process arguments and run; returns the exit code.
pub fn main() -> i32 {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() { EXIT_USAGE } else { EXIT_OK };
        }
    };
    let result = match cli.command {
        Some(Cmd::Train(a)) => train(a),
        Some(Cmd::Monitor(m)) => monitor(m),
        Some(Cmd::Check) => check::run(),
        Some(Cmd::Bench {
            config,
            steps,
            warmup,
            set,
            device,
            json,
            profile,
            soak,
            find_batch,
            gpus,
        }) => bench::run(bench::BenchArgs {
            config: config.as_deref(),
            set: &set,
            steps: soak.unwrap_or(steps),
            warmup,
            device: device.as_deref(),
            json: json.as_deref(),
            profile,
            soak: soak.is_some(),
            find_batch,
            gpus: gpus.map_or(1, usize::from),
        }),
        Some(Cmd::Prepare { config, set }) => prepare(&config, &set),
        Some(Cmd::Plot { run_dir }) => plot(&run_dir),
        Some(Cmd::Sweep {
            config,
            set_grid,
            seeds,
            set,
            out,
            device,
            max_steps,
        }) => sweep::run(sweep::SweepArgs {
            config: config.as_deref(),
            set: &set,
            grid: &set_grid,
            seeds,
            out: out.as_deref(),
            device: device.as_deref(),
            max_steps,
        }),
        Some(Cmd::Compare {
            paths,
            out,
            no_tui,
            theme,
        }) => compare(&paths, out.as_deref(), no_tui, theme.as_deref()),
        Some(Cmd::Export {
            source,
            out,
            adapter,
            dtype,
            max_shard_size,
            format,
            quant,
        }) => match gguf::wants(&out, format.as_deref(), quant.as_deref()) {
            Ok(Some(q)) => gguf::export(&source, &out, adapter, dtype.as_deref(), q),
            Ok(None) => hf::export(&source, &out, adapter, dtype.as_deref(), &max_shard_size),
            Err(code) => Ok(code),
        },
        Some(Cmd::Generate {
            source,
            prompt,
            prompt_ids,
            max_tokens,
            sampling,
            device,
            ids,
            ignore_eos,
            chat,
            prompts,
            samples,
            batch_size,
            output,
            bench,
            bench_prompt,
        }) => {
            log_to_stderr();
            let sampling = sampling.sampling();
            let many = generate::Many {
                prompts,
                samples,
                batch_size,
                output,
                bench,
                bench_prompt,
            };
            let args = hf::GenerateArgs {
                source: &source,
                prompt,
                prompt_ids,
                max_tokens,
                sampling,
                device: device.as_deref(),
                ids,
                ignore_eos,
                chat,
            };
            if many.wanted() {
                generate::many(many, args)
            } else {
                hf::generate(args)
            }
        }
        Some(Cmd::Chat {
            source,
            system,
            max_tokens,
            sampling,
            device,
        }) => chat::chat(
            &source,
            system,
            max_tokens,
            sampling.sampling(),
            device.as_deref(),
        ),
        Some(Cmd::Merge { checkpoint, out }) => merge(&checkpoint, out.as_deref()),
        Some(Cmd::Attach {
            run_dir,
            no_tui,
            allow_stop,
            theme,
        }) => frontends::attach(&run_dir, no_tui, allow_stop, theme.as_deref()),
        None if cli.monitor_only => monitor(cli.monitor),
        None => {
            crate::errln!("cockpit: a command is needed: train, monitor (or --monitor-only), check, bench, prepare, plot, export, generate, chat. See cockpit --help.");
            Ok(EXIT_USAGE)
        }
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            crate::errln!("cockpit: error: {e:#}");
            EXIT_FAILURE
        }
    }
}

/// Print a config error and return the usage exit code.
fn config_error(e: &ConfigError) -> i32 {
    crate::errln!("cockpit: config error:\n{e}");
    EXIT_USAGE
}

fn timestamp() -> String {
    chrono::Local::now().format("%Y%m%d-%H%M%S").to_string()
}

/// Where a checkpoint dir's run lives: `<run>/checkpoints/step-N` → `<run>`.
use crate::engine::locate::run_dir_of as run_dir_of_checkpoint;

/// The engine's log to stderr at `warn` (`COCKPIT_LOG` to change it), for the commands that
/// have no dashboard and no run dir (bench, generate): e.g. what the matmul tuning chose, or
/// why a generation's decode steps run without a CUDA graph.
pub(crate) fn log_to_stderr() {
    /// stderr, whose failures (a closed terminal, a full disk) are dropped: tracing's own
    /// fallback would print them to stderr, which panics there.
    struct Stderr;
    impl std::io::Write for Stderr {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            let _ = std::io::stderr().write_all(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let filter = tracing_subscriber::EnvFilter::try_from_env("COCKPIT_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_writer(|| Stderr)
        .with_env_filter(filter)
        .try_init();
}

fn init_logging(run_dir: &Path) {
    let Ok(file) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(run_dir.join("cockpit.log"))
    else {
        return;
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env("COCKPIT_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_writer(std::sync::Mutex::new(file))
        .with_ansi(false)
        .with_env_filter(filter)
        .try_init();
}

/// What a run left behind, printed after every end (the dashboard is gone by then).
fn print_summary(
    run_dir: &Path,
    ended: &str,
    summary: Option<&crate::engine::RunSummary>,
    max_steps: u64,
    plots: &str,
    config: Option<&Path>,
    flags: &[String],
) {
    let row = |k: &str, v: String| crate::errln!("  {k:<12} {v}");
    crate::errln!("cockpit: run ended: {ended}");
    row("run dir", run_dir.display().to_string());
    if let Some(s) = summary {
        row("steps", format!("{} of {max_steps}", s.step));
        let train = s.last_loss.map_or("-".into(), |l| format!("{l:.4}"));
        let val = s.last_val.as_ref().map_or("-".into(), |v| {
            format!("{:.4} (step {})", v.val_loss, v.step)
        });
        row("loss", format!("train {train} | val {val}"));
    }
    let root = run_dir.join("checkpoints");
    match checkpoint::best(&root) {
        Some((dir, v)) => row("best ckpt", format!("{} (val {v:.4})", dir.display())),
        None => row("best ckpt", "- (no checkpoint with a val loss)".into()),
    }
    let latest = checkpoint::resolve(&root).ok();
    match &latest {
        Some(dir) => row("last ckpt", dir.display().to_string()),
        None => row("last ckpt", "- (none written)".into()),
    }
    row("plots", plots.to_string());
    if latest.is_some() && summary.is_none_or(|s| s.step < max_steps) {
        row(
            "resume with",
            format!(
                "cockpit train {}{}--resume {}",
                config.map_or(String::new(), |c| format!(
                    "{} ",
                    shell_word(&c.display().to_string())
                )),
                flags
                    .iter()
                    .map(|f| format!("{} ", shell_word(f)))
                    .collect::<String>(),
                shell_word(&run_dir.display().to_string())
            ),
        );
    }
}

/// `s` as one shell word: as is when it is plain, else single-quoted.
fn shell_word(s: &str) -> String {
    let plain = !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "._=/:-+,@".contains(c));
    if plain {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// The flags a resume must repeat to run the same config: `--set` and `--max-steps`.
fn resume_flags(a: &TrainArgs) -> Vec<String> {
    let mut v = Vec::new();
    for s in &a.set {
        v.push("--set".to_string());
        v.push(s.clone());
    }
    if let Some(n) = a.max_steps {
        v.push("--max-steps".to_string());
        v.push(n.to_string());
    }
    v
}

/// Settings `--test-run` forces: a few steps that pass through every stage.
fn apply_test_run(c: &mut Config) {
    c.run.max_steps = c.run.max_steps.min(4);
    c.schedule.warmup_steps = c.schedule.warmup_steps.min(c.run.max_steps);
    c.eval.every = 2;
    c.eval.batches = 2;
    c.checkpoint.every_steps = 2;
    c.checkpoint.at_end = true;
    c.scu.control_every = 1;
}

pub(crate) fn train(a: TrainArgs) -> anyhow::Result<i32> {
    let mut overrides = a.set.clone();
    let mut flags = flag_sets::FlagSets::default();
    if let Some(t) = &a.theme {
        flags.push_str(&mut overrides, "--theme", "run.theme", t);
    }
    if let Some(d) = &a.device {
        flags.push_str(&mut overrides, "--device", "run.device", d);
    }
    if let Some(n) = a.max_steps {
        let pushed = max_steps::push(a.config.as_deref(), &a.set, &mut overrides, &mut flags, n);
        if let Err(e) = pushed {
            return Ok(config_error(&flags.blame(e)));
        }
    }
    let loaded = match config::load(a.config.as_deref(), &overrides) {
        Ok(l) => l,
        Err(e) => return Ok(config_error(&flags.blame(e))),
    };
    let mut cfg = loaded.config;
    // Data parallelism: started as one rank of a job (torchrun-style environment, or our
    // own launcher), or asked to launch one (`--gpus N` / distributed.gpus).
    let plan = match rank::plan(&a, &mut cfg, &loaded.origin) {
        Ok(p) => p,
        Err(code) => return Ok(code),
    };
    let device = plan.device;
    if let Err((key, e)) = frontends::validate_tui(&cfg) {
        let origin = flags.origin_of(&overrides, key, &loaded.origin);
        crate::errln!("cockpit: config error:\n{origin}: {e}");
        return Ok(EXIT_USAGE);
    }
    if a.test_run {
        apply_test_run(&mut cfg);
    }
    let runs_root = PathBuf::from(&cfg.run.runs_root);
    let resume = match (a.resume.as_deref(), &a.run_dir) {
        (None, _) => None,
        // With --run-dir, `latest` is that run's latest checkpoint.
        (Some("latest"), Some(dir)) => match checkpoint::resolve(dir) {
            Ok(_) => Some(dir.clone()),
            Err(e) => {
                crate::errln!(
                    "cockpit: --resume latest --run-dir {}: no checkpoint to resume from ({e})",
                    dir.display()
                );
                return Ok(EXIT_USAGE);
            }
        },
        (Some("latest"), None) => match run_dirs::latest_run(&runs_root, &cfg.run.name) {
            Some(dir) => Some(dir),
            None => {
                crate::errln!(
                    "cockpit: --resume latest: no run of {:?} with a checkpoint under {} (name a run with --run-dir DIR, or a checkpoint with --resume PATH)",
                    cfg.run.name,
                    runs_root.display()
                );
                return Ok(EXIT_USAGE);
            }
        },
        (Some(p), _) => Some(PathBuf::from(p)),
    };
    let run_dir = match (&a.run_dir, &resume) {
        (Some(d), _) => d.clone(),
        (None, Some(r)) => match checkpoint::resolve(r) {
            Ok(step_dir) => run_dir_of_checkpoint(&step_dir).unwrap_or_else(|| r.clone()),
            Err(e) => {
                crate::errln!("cockpit: --resume: {e}");
                return Ok(EXIT_USAGE);
            }
        },
        (None, None) => {
            let tag = if a.test_run { "-test" } else { "" };
            let stamped = runs_root.join(format!("{}{tag}-{}", cfg.run.name, timestamp()));
            restart::default_run_dir(&runs_root, &format!("{}{tag}", cfg.run.name))
                .unwrap_or(stamped)
        }
    };
    let several = plan.launching || plan.topology.is_some();
    if let Err(code) = fit::resolve_auto(&mut cfg, device, resume.as_deref(), several) {
        return Ok(code);
    }
    // (a rank checks its own dir below, under the lock: rank 0 may be writing here already)
    if plan.topology.is_none() {
        if let Err(e) = run_lock::probe(&run_dir) {
            crate::errln!("cockpit: {e}");
            return Ok(EXIT_USAGE);
        }
    }
    if plan.topology.is_none() && resume.is_none() && !a.fresh && run_lock::holds_records(&run_dir)
    {
        crate::errln!(
            "cockpit: {} holds another run's records: resume it with --resume, or start over with --fresh (which archives them under {}/)",
            run_dir.display(),
            run_dir.join(run_lock::ARCHIVE_DIR).display()
        );
        return Ok(EXIT_USAGE);
    }
    if plan.launching {
        std::fs::create_dir_all(&run_dir)
            .with_context(|| format!("creating the run dir {}", run_dir.display()))?;
        return launch::run(&a, &cfg, (plan.gpus, plan.backend), run_dir);
    }
    // A rank meets the others first; every rank takes rank 0's run dir.
    let meeting = rank::Meeting {
        launch: plan.launch.as_ref(),
        backend: plan.backend,
        run_dir: &run_dir,
        explicit_resume: a.resume.is_some(),
    };
    // A worker of `--gpus N` leaves when its launcher is gone (killed with SIGKILL).
    launch::watch_launcher();
    let (run_dir, joined) = match plan.topology {
        Some(t) => match rank::join(t, meeting, &cfg) {
            Ok((dir, j)) => (dir, Some(j)),
            Err(code) => return Ok(code),
        },
        None => (run_dir, None),
    };
    // A launcher's restart resumes from the run's latest checkpoint: rank 0 chose it for
    // every rank; a single process looks for itself.
    let resume = match &joined {
        Some(j) => j.handshake.resume.as_ref().map(PathBuf::from).or(resume),
        None if a.resume.is_none() => restart::single_process_resume(&run_dir).or(resume),
        None => resume,
    };
    let rank = joined.as_ref().map_or(0, |j| j.topology.rank);
    let distributed = joined.is_some();
    let progress = std::sync::Arc::new(crate::engine::events::Progress::new());
    // Rank 0 owns the run dir; the other ranks keep their files in RUN_DIR/ranks/rank-N.
    let own_dir = if rank == 0 {
        run_dir.clone()
    } else {
        run_dir.join("ranks").join(format!("rank-{rank}"))
    };
    let fresh_dir = !own_dir.exists();
    std::fs::create_dir_all(&own_dir)
        .with_context(|| format!("creating the run dir {}", own_dir.display()))?;
    // One writer per run dir, for the run's life (the OS releases it however we end).
    let _run_lock = match run_lock::lock(&own_dir) {
        Ok(l) => l,
        Err(e) => {
            crate::errln!("cockpit: {e}");
            return Ok(EXIT_USAGE);
        }
    };
    if resume.is_none() && run_lock::holds_records(&own_dir) {
        if !a.fresh {
            crate::errln!(
                "cockpit: {} holds another run's records: resume it with --resume, or start over with --fresh",
                own_dir.display()
            );
            return Ok(EXIT_USAGE);
        }
        let to = run_lock::archive_records(&own_dir)
            .with_context(|| format!("archiving the records in {}", own_dir.display()))?;
        crate::errln!(
            "cockpit: --fresh: the earlier run's records moved to {}",
            to.display()
        );
    }
    // what a killed run left half-written (we hold the lock: no one else is saving)
    checkpoint::remove_leftovers(&own_dir.join("checkpoints"));
    init_logging(&own_dir);
    tracing::info!(run_dir = %run_dir.display(), rank, "starting");
    let engine = match Engine::spawn(EngineOptions {
        config: cfg.clone(),
        run_dir: run_dir.clone(),
        device,
        resume,
        max_queued_steps: 256,
        progress: distributed.then(|| progress.clone()),
        dist: joined,
        profile_kernels: false,
        faults: crate::engine::faults::Faults::from_env(rank),
    }) {
        Ok(e) => e,
        Err(e) => {
            crate::errln!("cockpit: {e}");
            if fresh_dir && e.is_usage() {
                remove_unused_run_dir(&own_dir);
            }
            return Ok(if e.is_usage() {
                EXIT_USAGE
            } else {
                EXIT_FAILURE
            });
        }
    };
    if distributed {
        rank::watch_this_rank(rank, &device, progress, cfg.distributed.timeout_secs);
    }
    let use_tui = !a.no_tui && rank == 0 && std::io::stdout().is_terminal();
    let flags = SignalFlags::default();
    if !use_tui {
        // The dashboard handles signals itself (and restores the terminal).
        crate::process::register(&flags)?;
    }
    let Engine {
        commands,
        events,
        thread,
    } = engine;
    let frontend =
        frontends::run_frontend(use_tui, rank == 0, events, commands, &cfg, &own_dir, &flags);
    let summary = thread.wait();
    let (interrupted, attach, tracking) = match frontend {
        Ok(f) => (f.outcome.interrupted, f.attach, f.tracking),
        Err(e) => {
            crate::errln!("cockpit: the front end failed: {e:#}");
            (false, None, None)
        }
    };
    if let Some(guard) = attach {
        guard.wait();
    }
    // the engine has ended: the TensorBoard/MLflow writer finishes its files
    let mlflow_artifacts = tracking.and_then(|guard| guard.wait());
    // Plots and the summary after every end: finished, stopped, interrupted or failed.
    let plots = (rank == 0).then(|| frontends::after_run(&run_dir));
    if let Some(a) = &mlflow_artifacts {
        crate::tracking::log_plots(a, &run_dir);
    }
    let ended = match &summary {
        Ok(s) => match s.reason {
            FinishReason::Completed => "completed".to_string(),
            FinishReason::Stopped => format!("stopped at step {}", s.step),
            FinishReason::Interrupted => format!("interrupted at step {}", s.step),
            FinishReason::Failed => format!("failed at step {}", s.step),
        },
        Err(e) => format!("failed: {e}"),
    };
    if let Some(plots) = &plots {
        print_summary(
            &run_dir,
            &ended,
            summary.as_ref().ok(),
            cfg.run.max_steps,
            plots,
            a.config.as_deref(),
            &resume_flags(&a),
        );
    }
    let summary = match summary {
        Ok(s) => s,
        Err(e) => {
            if plots.is_none() {
                crate::errln!("cockpit: training failed: {e}");
            }
            return Ok(if e.is_usage() {
                EXIT_USAGE
            } else if e.is_peer_failure() {
                EXIT_PEER_FAILED
            } else {
                EXIT_FAILURE
            });
        }
    };
    if a.test_run {
        let ckpt = checkpoint::resolve(&run_dir)
            .and_then(|d| checkpoint::load(&d, &candle_core::Device::Cpu).map(|_| d));
        return Ok(match ckpt {
            Ok(d) if summary.reason == FinishReason::Completed => {
                crate::errln!(
                    "test run ok: data, forward/backward, eval, SCU and checkpoint ({} reloaded and verified) all worked",
                    d.display()
                );
                EXIT_OK
            }
            Ok(_) => {
                crate::errln!("test run stopped early: {:?}", summary.reason);
                EXIT_FAILURE
            }
            Err(e) => {
                crate::errln!("test run failed at the checkpoint stage: {e}");
                EXIT_FAILURE
            }
        });
    }
    Ok(match (interrupted, summary.reason) {
        (true, _) | (_, FinishReason::Interrupted) => EXIT_INTERRUPTED,
        (_, FinishReason::Failed) => EXIT_FAILURE,
        _ => EXIT_OK,
    })
}

/// A run dir this call made for a run that never started (bad input): remove it, so a
/// refused run leaves nothing behind. Only when it holds nothing but the log.
fn remove_unused_run_dir(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let names: Vec<_> = entries
        .filter_map(|e| e.ok())
        .map(|e| e.file_name())
        .collect();
    // What a run that was refused at set-up leaves: its log and the run dir's lock file
    // (the lock itself is released when the refused run's lock is dropped or the process ends).
    if names
        .iter()
        .all(|n| n == "cockpit.log" || n == run_lock::LOCK_FILE)
    {
        let _ = std::fs::remove_dir_all(dir);
    }
}

fn prepare(config_path: &Path, set: &[String]) -> anyhow::Result<i32> {
    let loaded = match config::load(Some(config_path), set) {
        Ok(l) => l,
        Err(e) => return Ok(config_error(&e)),
    };
    if loaded.config.data.source != "files" {
        crate::errln!("{}: data.source = {:?}: nothing to prepare (the built-in corpus is generated at start)", loaded.origin, loaded.config.data.source);
        return Ok(EXIT_OK);
    }
    // The same tokenizer and BOS/EOS as training: a base model brings them.
    let mut cfg = loaded.config;
    let meta = match crate::engine::base::spec(&cfg) {
        Some((_, path)) => match crate::engine::base::meta(Path::new(path)) {
            Ok(m) => Some(m),
            Err(e) => {
                crate::errln!("cockpit: prepare: {e}");
                return Ok(EXIT_USAGE);
            }
        },
        None => None,
    };
    let special = match crate::engine::base::resolve_data(&mut cfg, meta.as_ref()) {
        Ok(s) => s,
        Err(e) => {
            crate::errln!("cockpit: prepare: {e}");
            return Ok(EXIT_USAGE);
        }
    };
    // Instruction/chat records are tokenized in memory at each start: prepare checks them.
    match crate::engine::data::sft::format_of(&cfg).and_then(|f| {
        f.map(|f| crate::engine::data::sft::load(&cfg, special, f))
            .transpose()
    }) {
        Ok(Some(d)) => {
            crate::errln!("checked: {}", d.description);
            return Ok(EXIT_OK);
        }
        Ok(None) => {}
        Err(e) => {
            crate::errln!("cockpit: prepare: {e}");
            return Ok(EXIT_USAGE);
        }
    }
    let mut bar = ProgressBar::new();
    let result = crate::engine::data::prepare_with_progress(&cfg, special, &mut |p| bar.show(p));
    bar.finish();
    match result {
        Ok(p) => {
            for w in p.notes.iter().chain(&p.manifest.warnings) {
                crate::errln!("warning: {w}");
            }
            crate::errln!(
                "{} {}",
                if p.cached {
                    "already prepared:"
                } else {
                    "prepared:"
                },
                p.describe()
            );
            Ok(EXIT_OK)
        }
        Err(e) => {
            crate::errln!("cockpit: prepare: {e}");
            Ok(EXIT_USAGE)
        }
    }
}

/// `cockpit prepare`'s progress on stderr: a bar redrawn in place on a terminal, else a line
/// every 10%.
struct ProgressBar {
    start: std::time::Instant,
    tty: bool,
    drawn: Option<std::time::Instant>,
    next_pct: u64,
}

impl ProgressBar {
    fn new() -> Self {
        use std::io::IsTerminal;
        Self {
            start: std::time::Instant::now(),
            tty: std::io::stderr().is_terminal(),
            drawn: None,
            next_pct: 10,
        }
    }

    fn show(&mut self, p: &crate::engine::data::PrepareProgress) {
        let frac = p.bytes_done as f64 / p.bytes_total.max(1) as f64;
        let secs = self.start.elapsed().as_secs_f64();
        let rate = p.bytes_done as f64 / secs.max(1e-9);
        let eta = (p.bytes_total.saturating_sub(p.bytes_done)) as f64 / rate.max(1.0);
        let text = format!(
            "{:5.1}% {:.0}/{:.0} MB · {:.1} MB/s · {} tokens · ETA {}",
            frac * 100.0,
            p.bytes_done as f64 / 1e6,
            p.bytes_total as f64 / 1e6,
            rate / 1e6,
            crate::util::human_count(p.tokens as f64),
            crate::util::human_duration(eta)
        );
        if self.tty {
            if self
                .drawn
                .is_some_and(|t| t.elapsed().as_millis() < 100 && frac < 1.0)
            {
                return;
            }
            const W: usize = 24;
            let full = ((frac * W as f64) as usize).min(W);
            crate::err!(
                "\rprepare [{}{}] {text}\x1b[K",
                "█".repeat(full),
                "·".repeat(W - full)
            );
            self.drawn = Some(std::time::Instant::now());
        } else {
            let pct = (frac * 100.0) as u64;
            if pct >= self.next_pct {
                crate::errln!("prepare: {text}");
                self.next_pct = (pct / 10 + 1) * 10;
            }
        }
    }

    fn finish(&mut self) {
        if self.tty && self.drawn.is_some() {
            crate::errln!();
        }
    }
}

fn merge(spec: &Path, out: Option<&Path>) -> anyhow::Result<i32> {
    let dev = candle_core::Device::Cpu;
    let (model, lora) = match crate::engine::source::open(spec, candle_core::DType::F32, &dev, 1) {
        Ok(s) => (s.model, s.run.is_some_and(|c| c.lora.enabled)),
        Err(e) => {
            crate::errln!("cockpit: merge: {e}");
            return Ok(EXIT_USAGE);
        }
    };
    if !lora {
        crate::errln!("cockpit: merge: {} is not a LoRA run (lora.enabled = false): its weights are already whole", spec.display());
        return Ok(EXIT_USAGE);
    }
    let out = match out {
        Some(o) => o.to_path_buf(),
        None => {
            let step_dir = checkpoint::resolve(spec)?;
            run_dir_of_checkpoint(&step_dir)
                .unwrap_or(step_dir)
                .join("merged")
        }
    };
    let path = crate::engine::lora::write_merged(&out, &model)?;
    crate::errln!(
        "merged {} adapter tensors into {}",
        model.adapter_tensors().len(),
        path.display()
    );
    Ok(EXIT_OK)
}

fn plot(run_dir: &Path) -> anyhow::Result<i32> {
    if !run_dir.join("metrics.jsonl").is_file() {
        crate::errln!(
            "cockpit: plot: {} has no metrics.jsonl (not a run dir?)",
            run_dir.display()
        );
        return Ok(EXIT_USAGE);
    }
    frontends::plot_run(run_dir)
}

/// `cockpit compare`: the table on stdout (and compare.md, compare.json), overlaid charts;
/// on a terminal (without `--no-tui`), the same in a view first.
fn compare(
    paths: &[PathBuf],
    out: Option<&Path>,
    no_tui: bool,
    theme: Option<&str>,
) -> anyhow::Result<i32> {
    use crate::report::compare::{self as cmp, CompareError};
    let (groups, runs) = match cmp::compare(paths) {
        Ok(v) => v,
        Err(CompareError::NoRuns(p)) => {
            crate::errln!(
                "cockpit: compare: {}: no runs here (no metrics.jsonl in it or in the directories under it)",
                p.display()
            );
            return Ok(EXIT_USAGE);
        }
        Err(e) => return Err(e.into()),
    };
    let tui = if !no_tui && std::io::stdout().is_terminal() {
        match theme.map_or_else(|| Ok(crate::tui::Theme::default()), crate::tui::Theme::load) {
            Ok(theme) => Some(crate::tui::TuiOptions {
                theme,
                ..crate::tui::TuiOptions::default()
            }),
            Err(e) => {
                crate::errln!("cockpit: compare: theme: {e}");
                return Ok(EXIT_USAGE);
            }
        }
    } else {
        None
    };
    let out_dir = match out {
        Some(d) => d.to_path_buf(),
        None if paths.len() == 1 && !paths[0].join(crate::report::METRICS_FILE).is_file() => {
            paths[0].join("compare")
        }
        None => PathBuf::from(format!("compare-{}", timestamp())),
    };
    let table = cmp::table_markdown(&groups);
    if tui.is_none() {
        crate::out!("{table}");
    }
    std::fs::create_dir_all(&out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    std::fs::write(out_dir.join("compare.md"), &table)
        .with_context(|| format!("writing {}", out_dir.join("compare.md").display()))?;
    std::fs::write(
        out_dir.join("compare.json"),
        serde_json::to_vec_pretty(&groups)?,
    )
    .with_context(|| format!("writing {}", out_dir.join("compare.json").display()))?;
    let labels: Vec<String> = groups.iter().map(|g| g.label.clone()).collect();
    let summary = cmp::plot_compare(&labels, &runs, &out_dir)?;
    if let Some(opts) = tui {
        let source = paths
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(" ");
        let mut state = crate::tui::state::CompareState::new(&groups, &runs, source)
            .with_out_dir(out_dir.display().to_string());
        let exit = crate::tui::run_compare(&mut state, &opts)?;
        // the table stays in the scrollback once the view is gone
        crate::out!("{table}");
        crate::errln!("{summary}");
        return Ok(match exit {
            crate::tui::TuiExit::Interrupted => EXIT_INTERRUPTED,
            _ => EXIT_OK,
        });
    }
    crate::errln!("{summary}");
    Ok(EXIT_OK)
}

fn monitor(m: MonitorArgs) -> anyhow::Result<i32> {
    frontends::monitor(m)
}

#[cfg(test)]
mod resume_hint_tests {
    use super::*;

    #[test]
    fn the_resume_hint_repeats_the_set_flags_as_shell_words() {
        let a = TrainArgs {
            set: vec!["optim.lr=0.001".into(), "run.name=\"a b\"".into()],
            max_steps: Some(50),
            ..Default::default()
        };
        let words: Vec<String> = resume_flags(&a).iter().map(|f| shell_word(f)).collect();
        assert_eq!(
            words.join(" "),
            r#"--set optim.lr=0.001 --set 'run.name="a b"' --max-steps 50"#
        );
        assert_eq!(shell_word("it's"), r"'it'\''s'");
    }
}
