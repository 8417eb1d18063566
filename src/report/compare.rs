//! Several runs side by side: a table (mean ± sd over the seeds of each configuration) and
//! overlaid charts of held-out bits/token, S and λ.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use super::chart::{color, render_all, ChartSpec, Fonts, Planned, Scale, Series, Style};
use super::font::font_status;
use super::load::{load_metrics, RunMetrics};
use super::{PlotSummary, ReportError, METRICS_FILE};

/// The config file every run dir holds.
const CONFIG_FILE: &str = "training_config.json";
/// Keys that tell seeds of one configuration apart (or do not change what is trained).
const NOT_CONFIG: [&str; 6] = [
    "run.seed",
    "run.name",
    "run.runs_root",
    "run.theme",
    "run.log_every_secs",
    "tui.",
];

/// One run.
#[derive(Clone, Debug)]
pub struct ComparedRun {
    pub dir: PathBuf,
    pub metrics: RunMetrics,
    /// Flattened config (dotted key → JSON value), from training_config.json.
    pub config: BTreeMap<String, String>,
    /// Its `run.seed` (as written), where its config has one.
    pub seed: Option<String>,
}

/// mean ± sd over a group's runs (sd 0 for one run; None where no run has the figure).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct Stat {
    pub mean: f64,
    pub sd: f64,
    pub n: usize,
}

impl Stat {
    fn of(values: impl IntoIterator<Item = f64>) -> Option<Stat> {
        let v: Vec<f64> = values.into_iter().filter(|x| x.is_finite()).collect();
        if v.is_empty() {
            return None;
        }
        let n = v.len();
        let mean = v.iter().sum::<f64>() / n as f64;
        let sd = if n > 1 {
            (v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64).sqrt()
        } else {
            0.0
        };
        Some(Stat { mean, sd, n })
    }
}

/// One configuration (its runs differ only by seed).
#[derive(Clone, Debug, serde::Serialize)]
pub struct Group {
    /// What sets it apart from the other groups (`scu.target=0.01`), or the run name.
    pub label: String,
    pub runs: Vec<PathBuf>,
    /// Distinct seeds among its runs (runs without a recorded seed count as distinct).
    pub seeds: usize,
    pub final_bpt: Option<Stat>,
    pub best_bpt: Option<Stat>,
    pub lambda_end: Option<Stat>,
    /// S over the last 10% of the control steps (a fraction).
    pub s_end: Option<Stat>,
    pub target_end: Option<f64>,
    pub tokens_per_sec: Option<Stat>,
}

/// Why a comparison could not be made.
#[derive(Debug, thiserror::Error)]
pub enum CompareError {
    /// A path given is neither a run dir nor a dir with run dirs in it (a usage error).
    #[error("{}: no runs here (no {METRICS_FILE} in it or in the directories under it)", .0.display())]
    NoRuns(PathBuf),
    #[error(transparent)]
    Report(#[from] ReportError),
}

/// The run dirs a path names: itself when it holds metrics.jsonl, else the run dirs under it
/// (two levels: a sweep dir, or a dir of sweeps), sorted.
pub fn find_runs(path: &Path) -> Result<Vec<PathBuf>, CompareError> {
    if path.join(METRICS_FILE).is_file() {
        return Ok(vec![path.to_path_buf()]);
    }
    let mut found = Vec::new();
    let subdirs = |p: &Path| -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = std::fs::read_dir(p)
            .map(|rd| {
                rd.filter_map(|e| e.ok().map(|e| e.path()))
                    .filter(|p| p.is_dir())
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    };
    for d in subdirs(path) {
        if d.join(METRICS_FILE).is_file() {
            found.push(d);
        } else {
            found.extend(
                subdirs(&d)
                    .into_iter()
                    .filter(|e| e.join(METRICS_FILE).is_file()),
            );
        }
    }
    if found.is_empty() {
        return Err(CompareError::NoRuns(path.to_path_buf()));
    }
    Ok(found)
}

fn flatten(prefix: &str, v: &serde_json::Value, out: &mut BTreeMap<String, String>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, v) in m {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                flatten(&key, v, out);
            }
        }
        other => {
            out.insert(prefix.to_string(), other.to_string());
        }
    }
}

fn load_run(dir: &Path) -> Result<ComparedRun, ReportError> {
    let metrics = load_metrics(&dir.join(METRICS_FILE))?;
    let mut config = BTreeMap::new();
    if let Ok(text) = std::fs::read_to_string(dir.join(CONFIG_FILE)) {
        if let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) {
            flatten("", &v, &mut config);
        }
    }
    let seed = config.get("run.seed").cloned();
    config.retain(|k, _| !NOT_CONFIG.iter().any(|n| k == n || k.starts_with(n)));
    Ok(ComparedRun {
        dir: dir.to_path_buf(),
        metrics,
        config,
        seed,
    })
}

/// Load the runs of `paths`, group them by configuration and compute the table.
pub fn compare(paths: &[PathBuf]) -> Result<(Vec<Group>, Vec<Vec<ComparedRun>>), CompareError> {
    let mut dirs = Vec::new();
    for p in paths {
        for d in find_runs(p)? {
            if !dirs.contains(&d) {
                dirs.push(d);
            }
        }
    }
    let runs: Vec<ComparedRun> = dirs.iter().map(|d| load_run(d)).collect::<Result<_, _>>()?;
    // Group by the configuration without the seed, in first-seen order.
    let mut groups: Vec<Vec<ComparedRun>> = Vec::new();
    for r in runs {
        match groups.iter_mut().find(|g| g[0].config == r.config) {
            Some(g) => g.push(r),
            None => groups.push(vec![r]),
        }
    }
    // Label each group by the keys whose values differ between groups.
    let keys: BTreeSet<&String> = groups.iter().flat_map(|g| g[0].config.keys()).collect();
    let varying: Vec<&String> = keys
        .into_iter()
        .filter(|k| {
            let first = groups[0][0].config.get(*k);
            groups.iter().any(|g| g[0].config.get(*k) != first)
        })
        .collect();
    let table = groups
        .iter()
        .map(|g| {
            let arms: Vec<Option<String>> = g.iter().map(|r| sweep_arm(&r.dir)).collect();
            let label = if let Some(Some(arm)) = arms
                .first()
                .filter(|_| arms.windows(2).all(|w| w[0] == w[1]))
            {
                if arm.is_empty() {
                    "base config".to_string()
                } else {
                    arm.clone()
                }
            } else if varying.is_empty() {
                g[0].metrics
                    .info
                    .as_ref()
                    .map(|i| i.run_name.clone())
                    .unwrap_or_else(|| g[0].dir.display().to_string())
            } else {
                varying
                    .iter()
                    .map(|k| {
                        let v = g[0].config.get(*k).map_or("-", |v| v.as_str());
                        format!("{}={}", k.trim_start_matches("scu."), v.trim_matches('"'))
                    })
                    .collect::<Vec<_>>()
                    .join(" ")
            };
            group_stats(label, g)
        })
        .collect();
    Ok((table, groups))
}

/// The arm a sweep gave this run (from the sweep.json beside it), if it is a sweep's run.
fn sweep_arm(dir: &Path) -> Option<String> {
    let name = dir.file_name()?.to_string_lossy().into_owned();
    let text = std::fs::read_to_string(dir.parent()?.join("sweep.json")).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    v.get("runs")?
        .as_array()?
        .iter()
        .find(|r| r.get("name").and_then(|n| n.as_str()) == Some(name.as_str()))?
        .get("arm")?
        .as_str()
        .map(str::to_string)
}

fn group_stats(label: String, runs: &[ComparedRun]) -> Group {
    let bpt = |r: &ComparedRun| {
        r.metrics
            .evals
            .iter()
            .map(|e| e.val_bpt)
            .collect::<Vec<_>>()
    };
    let s_end = |r: &ComparedRun| {
        let s = &r.metrics.scu;
        let k = (s.len() / 10).max(1).min(s.len());
        let tail = &s[s.len() - k..];
        (!tail.is_empty()).then(|| tail.iter().map(|x| x.s_ratio).sum::<f64>() / tail.len() as f64)
    };
    let mut seen = BTreeSet::new();
    let seeds = runs
        .iter()
        .filter(|r| r.seed.as_ref().is_none_or(|s| seen.insert(s.clone())))
        .count();
    Group {
        label,
        runs: runs.iter().map(|r| r.dir.clone()).collect(),
        seeds,
        final_bpt: Stat::of(runs.iter().filter_map(|r| bpt(r).last().copied())),
        best_bpt: Stat::of(
            runs.iter()
                .filter_map(|r| bpt(r).into_iter().reduce(f64::min)),
        ),
        lambda_end: Stat::of(
            runs.iter()
                .filter_map(|r| r.metrics.scu.last().map(|s| s.lambda)),
        ),
        s_end: Stat::of(runs.iter().filter_map(s_end)),
        target_end: runs
            .first()
            .and_then(|r| r.metrics.scu.last().map(|s| s.target)),
        tokens_per_sec: Stat::of(runs.iter().filter_map(|r| {
            r.metrics
                .steps
                .last()
                .filter(|s| s.elapsed_s > 0.0)
                .map(|s| s.tokens as f64 / s.elapsed_s)
        })),
    }
}

fn fmt_stat(s: Option<Stat>, digits: usize, scale: f64) -> String {
    match s {
        Some(s) if s.n > 1 => format!("{:.d$} ± {:.d$}", s.mean * scale, s.sd * scale, d = digits),
        Some(s) => format!("{:.d$}", s.mean * scale, d = digits),
        None => "–".into(),
    }
}

/// The table's column headers, in order (Markdown and the terminal view).
pub const TABLE_HEADERS: [&str; 7] = [
    "run",
    "seeds",
    "final val bits/token",
    "best val bits/token",
    "λ at end",
    "S at end (%)",
    "tokens/s",
];

/// A group's table cells, in the order of [`TABLE_HEADERS`] ("–" where no run has the
/// figure).
pub fn table_cells(g: &Group) -> [String; 7] {
    let lam = match g.lambda_end {
        Some(s) if s.mean != 0.0 && (s.mean.abs() < 0.01 || s.mean.abs() >= 1000.0) => {
            if s.n > 1 {
                format!("{:.2e} ± {:.1e}", s.mean, s.sd)
            } else {
                format!("{:.2e}", s.mean)
            }
        }
        other => fmt_stat(other, 3, 1.0),
    };
    [
        g.label.clone(),
        // (Runs of one seed repeated: a spread of 0 that says nothing about seeds.)
        if g.seeds == g.runs.len() {
            g.seeds.to_string()
        } else {
            format!("{} ({} runs)", g.seeds, g.runs.len())
        },
        fmt_stat(g.final_bpt, 4, 1.0),
        fmt_stat(g.best_bpt, 4, 1.0),
        lam,
        fmt_stat(g.s_end, 2, 100.0),
        fmt_stat(g.tokens_per_sec, 0, 1.0),
    ]
}

/// The table as Markdown.
pub fn table_markdown(groups: &[Group]) -> String {
    let mut out = format!(
        "| {} |\n|{}\n",
        TABLE_HEADERS.join(" | "),
        "---|".repeat(TABLE_HEADERS.len())
    );
    for g in groups {
        out.push_str(&format!("| {} |\n", table_cells(g).join(" | ")));
    }
    out
}

/// Mean over a group's runs at each x where any run has a value.
fn mean_curve(runs: &[ComparedRun], f: impl Fn(&RunMetrics) -> Vec<(f64, f64)>) -> Vec<(f64, f64)> {
    let mut at: BTreeMap<u64, (f64, usize)> = BTreeMap::new();
    for r in runs {
        for (x, y) in f(&r.metrics) {
            if y.is_finite() {
                let e = at.entry(x as u64).or_insert((0.0, 0));
                e.0 += y;
                e.1 += 1;
            }
        }
    }
    at.into_iter()
        .map(|(x, (s, n))| (x as f64, s / n as f64))
        .collect()
}

/// A group's curves over steps, each the mean over its runs at each step where any run has
/// a value: what the overlaid charts (files and terminal view) draw.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Curves {
    /// Held-out bits/token at each evaluation.
    pub val_bpt: Vec<(f64, f64)>,
    /// S in percent.
    pub s_pct: Vec<(f64, f64)>,
    /// The setpoint S* in percent, where the controller is on (none for fixed λ).
    pub target_pct: Vec<(f64, f64)>,
    /// λ.
    pub lambda: Vec<(f64, f64)>,
}

impl Curves {
    /// The curves of one group's runs.
    pub fn of(runs: &[ComparedRun]) -> Curves {
        let pct = |v: Vec<(f64, f64)>| v.into_iter().map(|(x, y)| (x, y * 100.0)).collect();
        Curves {
            val_bpt: mean_curve(runs, |m| {
                m.evals.iter().map(|e| (e.step as f64, e.val_bpt)).collect()
            }),
            s_pct: mean_curve(runs, |m| pct(m.s_ratio())),
            target_pct: mean_curve(runs, |m| {
                m.scu
                    .iter()
                    .filter(|s| s.control)
                    .map(|s| (s.step as f64, s.target * 100.0))
                    .collect()
            }),
            lambda: mean_curve(runs, |m| m.lambda()),
        }
    }
}

/// Overlaid charts (PNG + SVG) into `out_dir`: held-out bits/token, S and λ, one line per
/// group (the mean over its seeds).
pub fn plot_compare(
    labels: &[String],
    groups: &[Vec<ComparedRun>],
    out_dir: &Path,
) -> Result<PlotSummary, ReportError> {
    let seeds = |g: &[ComparedRun]| {
        if g.len() > 1 {
            format!(" (mean of {})", g.len())
        } else {
            String::new()
        }
    };
    let mut val = ChartSpec::new(
        "compare_val_bpt",
        "Held-out bits/token",
        "step",
        "val bits/token",
    );
    let mut s = ChartSpec::new("compare_s_ratio", "SCU S-ratio", "step", "S (%)");
    let mut lam = ChartSpec::new("compare_lambda", "SCU λ", "step", "λ (log scale)");
    lam.y_scale = Scale::Log;
    for (i, (label, g)) in labels.iter().zip(groups).enumerate() {
        let name = format!("{label}{}", seeds(g));
        let c = Curves::of(g);
        if !c.val_bpt.is_empty() {
            val.series.push(Series::new(
                name.clone(),
                color(i),
                Style::Markers,
                c.val_bpt,
            ));
        }
        if !c.s_pct.is_empty() {
            s.series
                .push(Series::new(name.clone(), color(i), Style::Line, c.s_pct));
        }
        if c.lambda.iter().any(|(_, y)| *y > 0.0) {
            lam.series
                .push(Series::new(name, color(i), Style::Line, c.lambda));
        }
    }
    let plan = |spec: ChartSpec, why: &str| -> Planned {
        if spec.series.is_empty() {
            Err((spec.name, why.to_string()))
        } else {
            Ok(spec)
        }
    };
    let planned = vec![
        plan(val, "no evaluations in these runs"),
        plan(s, "no SCU events"),
        plan(lam, "no positive λ"),
    ];
    let mut summary = PlotSummary::default();
    let status = font_status();
    render_all(planned, out_dir, Fonts::from_status(status), &mut summary)?;
    if let (Some(notice), false) = (status.notice(), summary.written.is_empty()) {
        summary.notices.push(notice.to_string());
    }
    Ok(summary)
}
