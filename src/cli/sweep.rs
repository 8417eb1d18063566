//! `cockpit sweep`: every combination of a grid of config values × seeds, one `cockpit train`
//! after another, each in its own run dir under one sweep dir; resumable.
//!
//! Each `--set-grid` is one family of runs: `KEY=V1,V2,...`, several keys joined by `+` form
//! their product (`scu.enabled=false+scu.lambda_init=0,0.1,1` is three runs). The sweep is
//! the union of the families (none: the config as it is), each run once per seed.
//!
//! TensorBoard (`tensorboard --logdir SWEEP_DIR`) finds each run's `tb/` as a run of its own,
//! its hyperparameters in the HParams table; with `monitor.mlflow` set, the sweep is one MLflow
//! experiment named for the sweep dir (unless `monitor.mlflow_experiment` names one), each run
//! a run in it.

use super::{config_error, timestamp, EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE};
use crate::config;
use crate::engine::events::{Event, FinishReason};
use anyhow::Context;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The plan file in a sweep dir.
pub const SWEEP_FILE: &str = "sweep.json";

pub struct SweepArgs<'a> {
    pub config: Option<&'a Path>,
    pub set: &'a [String],
    /// Empty: the config's `sweep.grid`.
    pub grid: &'a [String],
    /// None: the config's `sweep.seeds`.
    pub seeds: Option<u64>,
    pub out: Option<&'a Path>,
    pub device: Option<&'a str>,
    /// Steps of every run (`--max-steps`: as `train`'s, the warm-up shortened in proportion).
    pub max_steps: Option<u64>,
}

/// One run of the sweep.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SweepRun {
    /// Directory name under the sweep dir.
    pub name: String,
    /// The arm: what differs from the base config (empty: the base).
    pub arm: String,
    pub seed: u64,
    /// All `--set` overrides of this run (base ones first).
    pub overrides: Vec<String>,
}

/// sweep.json: what was asked, so that running the same command again resumes it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SweepPlan {
    pub config: Option<PathBuf>,
    pub runs: Vec<SweepRun>,
    /// The MLflow experiment of the sweep's runs (the sweep dir's name unless the config
    /// names one); None when the runs log no MLflow.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mlflow_experiment: Option<String>,
}

/// `s` as a TOML string (for a `--set KEY=VALUE`).
fn toml_string(s: &str) -> String {
    toml::Value::String(s.to_string()).to_string()
}

/// Split a value list at the commas outside brackets and quotes: `1,2` → [1, 2],
/// `["q","v"],["q"]` → [`["q","v"]`, `["q"]`].
fn split_values(s: &str) -> Vec<String> {
    let (mut out, mut cur, mut depth, mut quote) = (Vec::new(), String::new(), 0i32, None);
    for c in s.chars() {
        match (c, quote) {
            ('"' | '\'', None) => quote = Some(c),
            (q, Some(open)) if q == open => quote = None,
            ('[' | '{', None) => depth += 1,
            (']' | '}', None) => depth -= 1,
            (',', None) if depth == 0 => {
                out.push(std::mem::take(&mut cur));
                continue;
            }
            _ => {}
        }
        cur.push(c);
    }
    out.push(cur);
    out.into_iter().map(|v| v.trim().to_string()).collect()
}

/// The arms of one `--set-grid` family: each a list of `key=value`.
fn family(spec: &str) -> Result<Vec<Vec<String>>, String> {
    let mut arms: Vec<Vec<String>> = vec![Vec::new()];
    for axis in spec.split('+') {
        let (key, values) = axis.split_once('=').ok_or_else(|| {
            format!("--set-grid {spec}: expected KEY=V1,V2,... (no '=' in {axis:?})")
        })?;
        let key = key.trim();
        let values = split_values(values);
        if key.is_empty() || values.iter().any(|v| v.is_empty()) {
            return Err(format!(
                "--set-grid {spec}: expected KEY=V1,V2,... with no empty value"
            ));
        }
        arms = arms
            .into_iter()
            .flat_map(|arm| {
                values.iter().map(move |v| {
                    let mut a = arm.clone();
                    a.push(format!("{key}={v}"));
                    a
                })
            })
            .collect();
    }
    Ok(arms)
}

/// A directory-name-safe label of an arm.
fn slug(arm: &[String]) -> String {
    if arm.is_empty() {
        return "base".into();
    }
    let s: String = arm
        .join("_")
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' || c == '-' || c == '=' {
                c
            } else {
                '_'
            }
        })
        .collect();
    s.replace("scu.", "").replace('=', "-")
}

/// Build the plan and check every run's config (unknown keys and wrong types are found here,
/// before anything runs). Err: the message of a usage error.
pub fn plan(a: &SweepArgs) -> Result<SweepPlan, PlanError> {
    let mut base = a.set.to_vec();
    let mut flags = super::flag_sets::FlagSets::default();
    if let Some(d) = a.device {
        flags.push_str(&mut base, "--device", "run.device", d);
    }
    if let Some(n) = a.max_steps {
        // (as `train --max-steps`: every run gets the overrides, so a resumed sweep compares them)
        super::max_steps::push(a.config, a.set, &mut base, &mut flags, n)
            .map_err(|e| PlanError::Config(flags.blame(e)))?;
    }
    let base_cfg = config::load(a.config, &base).map_err(|e| PlanError::Config(flags.blame(e)))?;
    // --set-grid wins over the config's [sweep] table; errors name where the entry came from.
    let (grid, source) = if a.grid.is_empty() {
        (base_cfg.config.sweep.grid.clone(), "sweep.grid")
    } else {
        (a.grid.to_vec(), "--set-grid")
    };
    let mut arms: Vec<Vec<String>> = Vec::new();
    for spec in &grid {
        let fam = family(spec).map_err(|m| PlanError::Usage(m.replace("--set-grid", source)))?;
        for arm in fam {
            if !arms.contains(&arm) {
                arms.push(arm);
            }
        }
    }
    if arms.is_empty() {
        arms.push(Vec::new());
    }
    let seed0 = base_cfg.config.run.seed;
    let seeds = match a.seeds {
        Some(n) if n == 0 || n > config::MAX_SWEEP_SEEDS => {
            return Err(PlanError::Usage(format!(
                "--seeds {n}: must be in [1, {}]",
                config::MAX_SWEEP_SEEDS
            )))
        }
        Some(n) => n,
        None => base_cfg.config.sweep.seeds,
    };
    let mut runs = Vec::new();
    for arm in &arms {
        for k in 0..seeds {
            let seed = seed0 + k;
            let mut overrides = base.clone();
            overrides.extend(arm.iter().cloned());
            overrides.push(format!("run.seed={seed}"));
            if let Err(e) = config::load(a.config, &overrides) {
                // One line naming the grid entry, not the internal --set list.
                return Err(PlanError::Usage(format!(
                    "{source} {}: {}",
                    arm.join(" "),
                    one_line(&e)
                )));
            }
            runs.push(SweepRun {
                name: format!("{}-s{seed}", slug(arm)),
                arm: arm.join(" "),
                seed,
                overrides,
            });
        }
    }
    Ok(SweepPlan {
        config: a.config.map(Path::to_path_buf),
        runs,
        mlflow_experiment: None,
    })
}

/// A config error as one line: the keys, values and what is wrong, without the origin (the
/// caller names the grid entry).
fn one_line(e: &config::ConfigError) -> String {
    match e {
        config::ConfigError::Override { message, .. } => message.clone(),
        config::ConfigError::Invalid(issues) => issues
            .iter()
            .map(|i| match &i.value {
                Some(v) if !i.key.is_empty() => format!("{} = {v}: {}", i.key, i.message),
                _ if !i.key.is_empty() => format!("{}: {}", i.key, i.message),
                _ => i.message.clone(),
            })
            .collect::<Vec<_>>()
            .join("; "),
        other => other.to_string().lines().collect::<Vec<_>>().join(" "),
    }
}

#[derive(Debug)]
pub enum PlanError {
    Usage(String),
    Config(config::ConfigError),
}

/// How a run dir stands: finished (completed), has a checkpoint to resume from, or neither.
#[derive(Debug, PartialEq)]
enum RunState {
    Done,
    Resumable,
    Fresh,
}

fn run_state(dir: &Path) -> RunState {
    let metrics = dir.join(crate::report::METRICS_FILE);
    if let Ok(m) = crate::report::load_metrics(&metrics) {
        let done = m.events.iter().any(|e| {
            matches!(
                e,
                Event::Finished {
                    reason: FinishReason::Completed,
                    ..
                }
            )
        });
        if done {
            return RunState::Done;
        }
    }
    if crate::engine::checkpoint::resolve(dir).is_ok() {
        RunState::Resumable
    } else {
        RunState::Fresh
    }
}

/// The step of the last step event in a metrics file (for the progress line).
fn last_step(dir: &Path) -> Option<u64> {
    let m = crate::report::load_metrics(&dir.join(crate::report::METRICS_FILE)).ok()?;
    m.steps.last().map(|s| s.step)
}

/// The device slots a sweep runs its arms on, one arm per slot at a time: one slot per GPU
/// (the child's `CUDA_VISIBLE_DEVICES`) when `run.device` leaves the GPU open (`auto`, `cuda`)
/// and several are visible; else one slot with the environment as it is (the CPU, one GPU, a
/// GPU named by `cuda:N`, or runs of several GPUs each). `visible` is this process's
/// `CUDA_VISIBLE_DEVICES`, `count` the CUDA devices it sees.
pub fn device_slots(
    device: &str,
    gpus_per_run: usize,
    visible: Option<&str>,
    count: usize,
) -> Vec<Option<String>> {
    let open = matches!(device, "auto" | "cuda" | "gpu");
    if !open || gpus_per_run > 1 || count < 2 {
        return vec![None];
    }
    // The children see the devices this process sees: pin them by the same names.
    let ids: Vec<String> = match visible.map(str::trim) {
        Some(v) if !v.is_empty() => v
            .split(',')
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .take(count)
            .collect(),
        _ => (0..count).map(|i| i.to_string()).collect(),
    };
    if ids.len() < 2 {
        return vec![None];
    }
    ids.into_iter().map(Some).collect()
}

/// The runs to start now: the next pending runs, in plan order, onto the free slots (lowest
/// first). `pending`: plan indices; `busy[s]`: slot s runs one. Returns (run, slot) pairs.
pub fn assign(pending: &[usize], busy: &[bool]) -> Vec<(usize, usize)> {
    busy.iter()
        .enumerate()
        .filter(|(_, b)| !**b)
        .map(|(s, _)| s)
        .zip(pending.iter().copied())
        .map(|(s, r)| (r, s))
        .collect()
}

/// A run in progress: its plan index, process, start time and log file.
struct Running {
    idx: usize,
    child: Child,
    t0: Instant,
    log: PathBuf,
}

/// The sweep as a whole for the progress line: `done` runs finished (this time or before),
/// `running` (name, slot label, step) of those in progress.
fn progress_line(
    total: usize,
    done: usize,
    running: &[(String, Option<String>, u64)],
    max_steps: u64,
    eta_s: Option<f64>,
) -> String {
    let m = max_steps.max(1) as f64;
    let partial: f64 = running.iter().map(|r| (r.2 as f64 / m).min(1.0)).sum();
    let frac = (done as f64 + partial) / total.max(1) as f64;
    let eta = eta_s.map_or(String::new(), |s| format!(", ETA {s:.0}s"));
    let each: Vec<String> = running
        .iter()
        .map(|(name, slot, step)| match slot {
            Some(g) => format!("{name} step {step}/{max_steps} [GPU {g}]"),
            None => format!("{name} step {step}/{max_steps}"),
        })
        .collect();
    format!(
        "sweep {:>3.0}%: {done}/{total} done, {} running{eta}: {}",
        frac * 100.0,
        running.len(),
        each.join("; ")
    )
}

pub fn run(a: SweepArgs) -> anyhow::Result<i32> {
    let plan = match plan(&a) {
        Ok(p) => p,
        Err(PlanError::Usage(m)) => {
            crate::errln!("cockpit: sweep: {m}");
            return Ok(EXIT_USAGE);
        }
        Err(PlanError::Config(e)) => return Ok(config_error(&e)),
    };
    let mut base_set = a.set.to_vec();
    if let Some(d) = a.device {
        base_set.push(format!("run.device={d:?}"));
    }
    let base = config::load(a.config, &base_set).map_err(|e| anyhow::anyhow!("{e}"))?;
    let dir = match a.out {
        Some(d) => d.to_path_buf(),
        None => PathBuf::from(&base.config.run.runs_root).join(format!(
            "sweep-{}-{}",
            base.config.run.name,
            timestamp()
        )),
    };
    let mut plan = plan;
    let m = &base.config.monitor;
    if m.mlflow.as_deref().is_some_and(|d| !d.is_empty()) {
        plan.mlflow_experiment = Some(m.mlflow_experiment.clone().unwrap_or_else(|| {
            dir.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| "sweep".into())
        }));
    }
    let plan_path = dir.join(SWEEP_FILE);
    if let Ok(text) = std::fs::read_to_string(&plan_path) {
        match serde_json::from_str::<SweepPlan>(&text) {
            Ok(old) if old.runs == plan.runs => {}
            _ => {
                crate::errln!(
                    "cockpit: sweep: {} holds another sweep (its {SWEEP_FILE} differs from this grid); choose another --out",
                    dir.display()
                );
                return Ok(EXIT_USAGE);
            }
        }
    }
    std::fs::create_dir_all(dir.join("logs"))
        .with_context(|| format!("creating the sweep dir {}", dir.display()))?;
    std::fs::write(&plan_path, serde_json::to_vec_pretty(&plan)?)
        .with_context(|| format!("writing {}", plan_path.display()))?;
    let exe = std::env::current_exe().context("finding the cockpit executable")?;
    let total = plan.runs.len();
    // (--max-steps is every run's: the base config loaded here does not carry it.)
    let max_steps = a.max_steps.unwrap_or(base.config.run.max_steps);
    let slots = {
        let device = base.config.run.device.as_str();
        // Counting GPUs starts the CUDA driver: only where a GPU may be used.
        let count = if matches!(device, "auto" | "cuda" | "gpu") {
            crate::engine::device::cuda_device_count()
        } else {
            0
        };
        let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
        device_slots(
            device,
            base.config.distributed.gpus,
            visible.as_deref(),
            count,
        )
    };
    let on = if slots.len() > 1 {
        format!(", one per GPU on {} GPUs", slots.len())
    } else {
        String::new()
    };
    crate::errln!(
        "sweep: {total} run(s) into {}{on} (resume: the same command again)",
        dir.display()
    );
    // Finished runs are skipped; the rest wait in plan order.
    let mut pending = Vec::new();
    let mut done = 0usize;
    for (i, r) in plan.runs.iter().enumerate() {
        if run_state(&dir.join(&r.name)) == RunState::Done {
            crate::errln!("sweep {}/{total}: {} — done before, skipped", i + 1, r.name);
            done += 1;
        } else {
            pending.push(i);
        }
    }
    let started = Instant::now();
    let mut running: Vec<Option<Running>> = slots.iter().map(|_| None).collect();
    let mut failed = Vec::new();
    let mut ran = 0usize;
    let mut interrupted: Option<String> = None;
    let mut last_line = Instant::now();
    loop {
        if interrupted.is_none() {
            let busy: Vec<bool> = running.iter().map(Option::is_some).collect();
            let starts = assign(&pending, &busy);
            pending.drain(..starts.len());
            for (idx, s) in starts {
                let child = start(&exe, &plan, idx, &dir, slots[s].as_deref())?;
                if let Some(g) = &slots[s] {
                    let name = &plan.runs[idx].name;
                    crate::errln!("sweep {}/{total}: {name} started on GPU {g}", idx + 1);
                }
                running[s] = Some(child);
            }
        }
        if running.iter().all(Option::is_none) {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
        for slot in running.iter_mut() {
            let Some(run) = slot else { continue };
            let Some(status) = run.child.try_wait()? else {
                continue;
            };
            let (i, name) = (run.idx, &plan.runs[run.idx].name);
            let secs = run.t0.elapsed().as_secs_f64();
            ran += 1;
            match status.code() {
                Some(0) => {
                    done += 1;
                    crate::errln!("sweep {}/{total}: {name} finished in {secs:.0}s", i + 1);
                }
                Some(EXIT_INTERRUPTED) | None => {
                    // Stop starting runs; those running finish (or stop) on their own.
                    interrupted.get_or_insert_with(|| name.clone());
                }
                Some(code) => {
                    crate::errln!(
                        "sweep {}/{total}: {name} failed (exit {code}); see {}",
                        i + 1,
                        run.log.display()
                    );
                    failed.push(name.clone());
                }
            }
            *slot = None;
        }
        if last_line.elapsed() >= Duration::from_secs(5) {
            last_line = Instant::now();
            let now: Vec<(String, Option<String>, u64)> = running
                .iter()
                .zip(&slots)
                .filter_map(|(r, g)| {
                    let r = r.as_ref()?;
                    let name = &plan.runs[r.idx].name;
                    let step = last_step(&dir.join(name)).unwrap_or(0);
                    Some((name.clone(), g.clone(), step))
                })
                .collect();
            let m = max_steps.max(1) as f64;
            let partial: f64 = now.iter().map(|r| (r.2 as f64 / m).min(1.0)).sum();
            let work = ran as f64 + partial;
            let left = (total - done) as f64 - partial;
            let eta = (work > 0.0).then(|| started.elapsed().as_secs_f64() / work * left);
            if !now.is_empty() {
                crate::errln!("{}", progress_line(total, done, &now, max_steps, eta));
            }
        }
    }
    if let Some(name) = interrupted {
        crate::errln!("sweep: interrupted during {name}; run the same command again to resume");
        return Ok(EXIT_INTERRUPTED);
    }
    crate::errln!(
        "sweep: {} of {total} run(s) done in {}; compare them with `cockpit compare {}`",
        total - failed.len(),
        dir.display(),
        dir.display()
    );
    if failed.is_empty() {
        Ok(EXIT_OK)
    } else {
        crate::errln!("sweep: failed: {}", failed.join(", "));
        Ok(EXIT_FAILURE)
    }
}

/// Start one run of the sweep (resuming it where it has a checkpoint), its output into
/// `logs/<name>.log`, pinned to `gpu` when given.
fn start(
    exe: &Path,
    plan: &SweepPlan,
    idx: usize,
    dir: &Path,
    gpu: Option<&str>,
) -> anyhow::Result<Running> {
    let r = &plan.runs[idx];
    let run_dir = dir.join(&r.name);
    let state = run_state(&run_dir);
    if state == RunState::Fresh && run_dir.exists() {
        // Started but with nothing to resume from: start over.
        std::fs::remove_dir_all(&run_dir)
            .with_context(|| format!("clearing {}", run_dir.display()))?;
    }
    let log = dir.join("logs").join(format!("{}.log", r.name));
    let log_file =
        std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
    let mut cmd = Command::new(exe);
    cmd.arg("train");
    if let Some(c) = &plan.config {
        cmd.arg(c);
    }
    cmd.arg("--no-tui").arg("--run-dir").arg(&run_dir);
    for o in &r.overrides {
        cmd.arg("--set").arg(o);
    }
    if state == RunState::Resumable {
        cmd.arg("--resume").arg("latest");
    }
    if let Some(e) = &plan.mlflow_experiment {
        // (after the run's own overrides, so a sweep resumed later logs into the same one)
        cmd.arg("--set")
            .arg(format!("monitor.mlflow_experiment={}", toml_string(e)));
    }
    if let Some(g) = gpu {
        cmd.env("CUDA_VISIBLE_DEVICES", g);
    }
    cmd.stdin(Stdio::null())
        .stdout(log_file.try_clone()?)
        .stderr(log_file);
    let child = cmd.spawn().context("starting cockpit train")?;
    Ok(Running {
        idx,
        child,
        t0: Instant::now(),
        log,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_split_outside_brackets() {
        assert_eq!(split_values("1,2, 3"), vec!["1", "2", "3"]);
        assert_eq!(
            split_values(r#"["q","v"],["q"]"#),
            vec![r#"["q","v"]"#, r#"["q"]"#]
        );
    }

    #[test]
    fn a_family_is_the_product_of_its_axes() {
        let f = family("scu.enabled=false+scu.lambda_init=0,0.1").unwrap();
        assert_eq!(
            f,
            vec![
                vec!["scu.enabled=false", "scu.lambda_init=0"],
                vec!["scu.enabled=false", "scu.lambda_init=0.1"]
            ]
        );
        assert!(family("scu.target").is_err());
        assert!(family("scu.target=0.1,").is_err());
    }

    #[test]
    fn plan_is_the_union_of_families_times_seeds() {
        let grid = vec![
            "scu.target=0.01,0.02".to_string(),
            "scu.enabled=false".to_string(),
        ];
        let p = plan(&SweepArgs {
            config: None,
            set: &[],
            grid: &grid,
            seeds: Some(2),
            out: None,
            device: None,
            max_steps: None,
        })
        .unwrap();
        assert_eq!(p.runs.len(), 6);
        assert_eq!(p.runs[0].name, "target-0.01-s1337");
        assert_eq!(p.runs[5].name, "enabled-false-s1338");
        let bad = vec!["scu.nope=1".to_string()];
        let e = plan(&SweepArgs {
            config: None,
            set: &[],
            grid: &bad,
            seeds: Some(1),
            out: None,
            device: None,
            max_steps: None,
        });
        match e {
            Err(PlanError::Usage(m)) => assert!(m.contains("scu.nope"), "{m}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn plan_from_the_sweep_table_and_flags_win() {
        let dir = std::env::temp_dir().join(format!("cockpit-sweep-plan-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cfg = dir.join("c.toml");
        std::fs::write(
            &cfg,
            "[sweep]\ngrid = [\"scu.target=0.01,0.02\", \"scu.enabled=false\"]\nseeds = 2\n",
        )
        .unwrap();
        let args = |grid: &'static [String], seeds| SweepArgs {
            config: Some(cfg.as_path()),
            set: &[],
            grid,
            seeds,
            out: None,
            device: None,
            max_steps: None,
        };
        let p = plan(&args(&[], None)).unwrap();
        assert_eq!(p.runs.len(), 6, "3 arms × 2 seeds from [sweep]");
        let p = plan(&args(&[], Some(1))).unwrap();
        assert_eq!(p.runs.len(), 3, "--seeds wins");
        static GRID: std::sync::LazyLock<Vec<String>> =
            std::sync::LazyLock::new(|| vec!["scu.target=0.05".to_string()]);
        let p = plan(&args(&GRID, None)).unwrap();
        assert_eq!(p.runs.len(), 2, "--set-grid wins, seeds from [sweep]");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn one_slot_per_visible_gpu_when_the_device_is_open() {
        assert_eq!(
            device_slots("auto", 1, None, 3),
            vec![Some("0".into()), Some("1".into()), Some("2".into())]
        );
        assert_eq!(
            device_slots("cuda", 1, Some("2, 5"), 2),
            vec![Some("2".to_string()), Some("5".to_string())]
        );
        assert_eq!(
            device_slots("auto", 1, Some("GPU-a,GPU-b,GPU-c"), 2),
            vec![Some("GPU-a".to_string()), Some("GPU-b".to_string())],
            "no more slots than devices the driver counts"
        );
        // Sequential as before: the CPU, one GPU, a GPU named, several GPUs per run.
        for (device, gpus, count) in [
            ("cpu", 1, 4),
            ("auto", 1, 0),
            ("auto", 1, 1),
            ("cuda", 1, 1),
            ("cuda:1", 1, 4),
            ("auto", 2, 4),
        ] {
            assert_eq!(
                device_slots(device, gpus, None, count),
                vec![None],
                "{device} gpus {gpus} count {count}"
            );
        }
        assert_eq!(device_slots("auto", 1, Some("3"), 4), vec![None]);
    }

    #[test]
    fn pending_runs_fill_the_free_slots_in_plan_order() {
        assert_eq!(
            assign(&[3, 4, 5], &[false, true, false]),
            vec![(3, 0), (4, 2)]
        );
        assert_eq!(assign(&[3], &[false, false]), vec![(3, 0)]);
        assert!(assign(&[3, 4], &[true, true]).is_empty());
        assert!(assign(&[], &[false]).is_empty());
        // One slot: strictly one after another.
        assert_eq!(assign(&[0, 1, 2], &[false]), vec![(0, 0)]);
    }

    /// Seven runs on three slots whose runs take different times: every run starts once, no
    /// slot holds two at a time, and a slot takes the next pending run as soon as it is free.
    #[test]
    fn a_simulated_sweep_runs_everything_once_on_its_slots() {
        let length = [3u32, 1, 4, 1, 5, 2, 2];
        let mut pending: Vec<usize> = (0..length.len()).collect();
        let mut slots: Vec<Option<(usize, u32)>> = vec![None; 3];
        let (mut started, mut t) = (Vec::new(), 0u32);
        while !pending.is_empty() || slots.iter().any(Option::is_some) {
            let busy: Vec<bool> = slots.iter().map(Option::is_some).collect();
            let starts = assign(&pending, &busy);
            pending.drain(..starts.len());
            for (r, s) in starts {
                assert!(slots[s].is_none(), "slot {s} double-booked");
                slots[s] = Some((r, t + length[r]));
                started.push((r, s, t));
            }
            t += 1;
            for s in slots.iter_mut() {
                if s.is_some_and(|(_, end)| end <= t) {
                    *s = None;
                }
            }
        }
        let order: Vec<usize> = started.iter().map(|x| x.0).collect();
        assert_eq!(order, vec![0, 1, 2, 3, 4, 5, 6], "plan order");
        assert_eq!(
            started,
            vec![
                (0, 0, 0),
                (1, 1, 0),
                (2, 2, 0),
                (3, 1, 1),
                (4, 1, 2),
                (5, 0, 3),
                (6, 2, 4)
            ]
        );
        assert_eq!(t, 7, "three slots: 7 time units, not the 18 of one");
    }

    #[test]
    fn the_progress_line_covers_the_whole_sweep() {
        let now = vec![
            ("a-s1".to_string(), Some("0".to_string()), 60),
            ("b-s1".to_string(), Some("1".to_string()), 150),
        ];
        let line = progress_line(4, 1, &now, 100, Some(12.0));
        assert!(
            line.starts_with("sweep  65%: 1/4 done, 2 running, ETA 12s: "),
            "{line}"
        );
        assert!(
            line.contains("a-s1 step 60/100 [GPU 0]; b-s1 step 150/100 [GPU 1]"),
            "{line}"
        );
        let one = progress_line(2, 0, &[("a-s1".into(), None, 10)], 100, None);
        assert_eq!(one, "sweep   5%: 0/2 done, 1 running: a-s1 step 10/100");
    }
}
