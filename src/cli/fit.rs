//! The largest micro-batch that fits the device, by trying (`cockpit bench --find-batch`, and
//! `optim.micro_batch = "auto"` before a run starts): two steps at each size in a scratch run
//! dir, doubling until one runs out of memory, then bisecting.

use crate::config;
use crate::engine::events::Event;
use crate::engine::{Engine, EngineOptions};
use crate::util::DeviceSpec;
use anyhow::Context;
use std::path::PathBuf;

/// The largest micro-batch tried.
pub const LIMIT: usize = crate::engine::trainer::MAX_MICRO_BATCH;

/// Whether the search can run: memory limits the batch on a GPU, not on the CPU.
pub fn has_cuda(device: DeviceSpec) -> bool {
    !matches!(device, DeviceSpec::Cpu) && crate::engine::device::cuda_device_count() > 0
}

/// The micro-batch to train with when `good` is the largest that fits: 10% below it (room
/// for allocator fragmentation and the longer evaluation batches).
pub fn with_margin(good: usize) -> usize {
    ((good as f64 * 0.9).floor() as usize).max(1)
}

/// One `--find-batch` trial: whether two steps at micro-batch `mb` ran without running out of
/// memory (the engine would split the batch: its steps then report a smaller one), and the
/// peak memory and speed of the second.
pub struct Trial {
    pub fits: bool,
    pub memory: Option<u64>,
    pub tokens_per_sec: f64,
}

fn try_batch(cfg: &config::Config, device: DeviceSpec, mb: usize) -> anyhow::Result<Trial> {
    let mut cfg = cfg.clone();
    cfg.optim.micro_batch = mb;
    cfg.optim.accum = 1;
    cfg.run.max_steps = 2;
    let run_dir: PathBuf =
        std::env::temp_dir().join(format!("cockpit-find-batch-{}-{mb}", std::process::id()));
    std::fs::create_dir_all(&run_dir)
        .with_context(|| format!("creating the scratch run dir {}", run_dir.display()))?;
    let engine = Engine::spawn(EngineOptions::new(cfg, run_dir.clone(), device))?;
    let mut trial = Trial {
        fits: true,
        memory: None,
        tokens_per_sec: 0.0,
    };
    let failure = drain(&engine, |ev| {
        if let Event::Step(s) = ev {
            trial.fits &= s.micro_batch == mb;
            trial.memory = trial.memory.max(s.memory_bytes);
            trial.tokens_per_sec = s.tokens_per_sec;
        }
    });
    let joined = engine.thread.wait();
    let _ = std::fs::remove_dir_all(&run_dir);
    match (joined, failure) {
        (Err(e), _) if e.to_string().to_ascii_lowercase().contains("out of memory") => {
            trial.fits = false;
        }
        (Err(e), _) => return Err(e.into()),
        (Ok(_), Some(m)) if m.to_ascii_lowercase().contains("out of memory") => {
            trial.fits = false;
        }
        (Ok(_), Some(m)) => anyhow::bail!("micro-batch {mb}: the run did not complete: {m}"),
        (Ok(_), None) => {}
    }
    Ok(trial)
}

/// Hand `on` every event of a benchmark's engine until it finishes; the finish's message
/// when the run did not complete.
pub fn drain(engine: &Engine, mut on: impl FnMut(Event)) -> Option<String> {
    while let Some(ev) = engine.events.recv() {
        match ev {
            Event::Finished {
                reason, message, ..
            } => {
                return (reason != crate::engine::events::FinishReason::Completed)
                    .then_some(message);
            }
            ev => on(ev),
        }
    }
    None
}

/// Double the micro-batch until it no longer fits, then bisect; `report` hears every trial.
/// The largest that fits and whether it is [`LIMIT`] (nothing larger tried), or None when
/// even one sequence does not fit.
pub fn largest(
    cfg: &config::Config,
    device: DeviceSpec,
    mut report: impl FnMut(usize, &Trial),
) -> anyhow::Result<Option<(usize, bool)>> {
    let mut run = |mb: usize| -> anyhow::Result<bool> {
        let t = try_batch(cfg, device, mb)?;
        report(mb, &t);
        Ok(t.fits)
    };
    let (mut good, mut bad) = (0usize, None::<usize>);
    let mut mb = 1;
    while mb <= LIMIT {
        if run(mb)? {
            good = mb;
            mb *= 2;
        } else {
            bad = Some(mb);
            break;
        }
    }
    if good == 0 {
        return Ok(None);
    }
    if let Some(mut hi) = bad {
        while hi - good > 1 {
            let mid = good + (hi - good) / 2;
            if run(mid)? {
                good = mid;
            } else {
                hi = mid;
            }
        }
    }
    Ok(Some((good, bad.is_none())))
}

/// One trial as a line.
pub fn describe(mb: usize, t: &Trial) -> String {
    if t.fits {
        let mem = t.memory.map_or("?".to_string(), |b| {
            format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
        });
        format!(
            "micro-batch {mb:>5}: fits, {mem} in use, {:.0} tokens/s",
            t.tokens_per_sec
        )
    } else {
        format!("micro-batch {mb:>5}: out of memory")
    }
}

/// Resolve `optim.micro_batch = "auto"` before a run starts: a resumed run keeps the
/// micro-batch its checkpoint trained with; a new one searches ([`largest`], trials on
/// stderr) and takes [`with_margin`] of the largest that fits. Errors are one line on
/// stderr and the exit code.
pub fn resolve_auto(
    cfg: &mut config::Config,
    device: DeviceSpec,
    resume: Option<&std::path::Path>,
    several_processes: bool,
) -> Result<(), i32> {
    use crate::process::{EXIT_FAILURE, EXIT_USAGE};
    if cfg.optim.micro_batch != config::MICRO_BATCH_AUTO {
        return Ok(());
    }
    if several_processes {
        crate::errln!("cockpit: optim.micro_batch = \"auto\": one process per GPU must train the same micro-batch; set a number (`cockpit bench CONFIG --find-batch` finds it on one GPU)");
        return Err(EXIT_USAGE);
    }
    if let Some(r) = resume {
        let kept = crate::engine::checkpoint::resolve(r)
            .and_then(|dir| crate::engine::checkpoint::read_state(&dir))
            .map(|s| {
                s.config
                    .pointer("/optim/micro_batch")
                    .and_then(|v| v.as_u64())
                    .map_or(s.micro_batch, |v| v as usize)
            });
        return match kept {
            Ok(mb) => {
                crate::errln!(
                    "cockpit: optim.micro_batch = \"auto\": {mb}, as the checkpoint trained"
                );
                cfg.optim.micro_batch = mb;
                Ok(())
            }
            Err(e) => {
                crate::errln!("cockpit: --resume: {e}");
                Err(EXIT_USAGE)
            }
        };
    }
    if !has_cuda(device) {
        crate::errln!("cockpit: optim.micro_batch = \"auto\": finds the largest micro-batch that fits a GPU's memory; on the CPU set a number");
        return Err(EXIT_USAGE);
    }
    crate::errln!(
        "cockpit: optim.micro_batch = \"auto\": trying micro-batches on this GPU (two steps each)"
    );
    match largest(cfg, device, |mb, t| crate::errln!("  {}", describe(mb, t))) {
        Ok(Some((good, _))) => {
            let mb = with_margin(good);
            crate::errln!(
                "cockpit: optim.micro_batch = {mb} (the largest that fits, {good}, less 10%)"
            );
            cfg.optim.micro_batch = mb;
            Ok(())
        }
        Ok(None) => {
            crate::errln!("cockpit: optim.micro_batch = \"auto\": one sequence does not fit this device (shorter model.seq_len, model.recompute = \"full\" or \"offload\", or LoRA)");
            Err(EXIT_FAILURE)
        }
        Err(e) => {
            crate::errln!("cockpit: optim.micro_batch = \"auto\": {e:#}");
            Err(EXIT_FAILURE)
        }
    }
}
