//! `cockpit sweep`: every combination of a grid of config values × seeds, one `cockpit train`
//! after another, each in its own run dir under one sweep dir; resumable.
//!
//! Each `--set-grid` is one family of runs: `KEY=V1,V2,...`, several keys joined by `+` form
//! their product (`scu.enabled=false+scu.lambda_init=0,0.1,1` is three runs). The sweep is
//! the union of the families (none: the config as it is), each run once per seed.

use super::{config_error, timestamp, EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE};
use crate::config;
use crate::engine::events::{Event, FinishReason};
use anyhow::Context;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
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
    if let Some(d) = a.device {
        base.push(format!("run.device={d:?}"));
    }
    let base_cfg = config::load(a.config, &base).map_err(PlanError::Config)?;
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

pub fn run(a: SweepArgs) -> anyhow::Result<i32> {
    let plan = match plan(&a) {
        Ok(p) => p,
        Err(PlanError::Usage(m)) => {
            eprintln!("cockpit: sweep: {m}");
            return Ok(EXIT_USAGE);
        }
        Err(PlanError::Config(e)) => return Ok(config_error(&e)),
    };
    let base = config::load(a.config, a.set).map_err(|e| anyhow::anyhow!("{e}"))?;
    let dir = match a.out {
        Some(d) => d.to_path_buf(),
        None => PathBuf::from(&base.config.run.runs_root).join(format!(
            "sweep-{}-{}",
            base.config.run.name,
            timestamp()
        )),
    };
    let plan_path = dir.join(SWEEP_FILE);
    if let Ok(text) = std::fs::read_to_string(&plan_path) {
        match serde_json::from_str::<SweepPlan>(&text) {
            Ok(old) if old.runs == plan.runs => {}
            _ => {
                eprintln!(
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
    let max_steps = base.config.run.max_steps;
    eprintln!(
        "sweep: {total} run(s) into {} (resume: the same command again)",
        dir.display()
    );
    let started = Instant::now();
    let mut failed = Vec::new();
    let mut ran = 0usize;
    for (i, r) in plan.runs.iter().enumerate() {
        let run_dir = dir.join(&r.name);
        let state = run_state(&run_dir);
        if state == RunState::Done {
            eprintln!("sweep {}/{total}: {} — done before, skipped", i + 1, r.name);
            continue;
        }
        if state == RunState::Fresh && run_dir.exists() {
            // Started but with nothing to resume from: start over.
            std::fs::remove_dir_all(&run_dir)
                .with_context(|| format!("clearing {}", run_dir.display()))?;
        }
        let log = dir.join("logs").join(format!("{}.log", r.name));
        let log_file =
            std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let mut cmd = Command::new(&exe);
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
        cmd.stdin(Stdio::null())
            .stdout(log_file.try_clone()?)
            .stderr(log_file);
        let mut child = cmd.spawn().context("starting cockpit train")?;
        let t0 = Instant::now();
        let mut last_line = Instant::now();
        let status = loop {
            if let Some(s) = child.try_wait()? {
                break s;
            }
            std::thread::sleep(Duration::from_millis(200));
            if last_line.elapsed() >= Duration::from_secs(5) {
                last_line = Instant::now();
                let step = last_step(&run_dir).unwrap_or(0);
                let frac = (i as f64 + step as f64 / max_steps.max(1) as f64) / total as f64;
                let eta = if ran > 0 || step > 0 {
                    let spent = started.elapsed().as_secs_f64();
                    let done = ran as f64 + step as f64 / max_steps.max(1) as f64;
                    let left = (total - i) as f64 - step as f64 / max_steps.max(1) as f64;
                    format!(", ETA {:.0}s", spent / done.max(1e-9) * left)
                } else {
                    String::new()
                };
                eprintln!(
                    "sweep {}/{total} {:>3.0}%: {} step {step}/{max_steps} ({:.0}s){eta}",
                    i + 1,
                    frac * 100.0,
                    r.name,
                    t0.elapsed().as_secs_f64()
                );
            }
        };
        ran += 1;
        match status.code() {
            Some(0) => eprintln!(
                "sweep {}/{total}: {} finished in {:.0}s",
                i + 1,
                r.name,
                t0.elapsed().as_secs_f64()
            ),
            Some(EXIT_INTERRUPTED) | None => {
                eprintln!(
                    "sweep: interrupted during {}; run the same command again to resume",
                    r.name
                );
                return Ok(EXIT_INTERRUPTED);
            }
            Some(code) => {
                eprintln!(
                    "sweep {}/{total}: {} failed (exit {code}); see {}",
                    i + 1,
                    r.name,
                    log.display()
                );
                failed.push(r.name.clone());
            }
        }
    }
    eprintln!(
        "sweep: {} of {total} run(s) done in {}; compare them with `cockpit compare {}`",
        total - failed.len(),
        dir.display(),
        dir.display()
    );
    if failed.is_empty() {
        Ok(EXIT_OK)
    } else {
        eprintln!("sweep: failed: {}", failed.join(", "));
        Ok(EXIT_FAILURE)
    }
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
}
