//! The rules: each turns the window into a [`Level`] and the recommendation it would show.
//!
//! Rules are pure functions of the window, the run (if any) and the options; the advisor
//! adds the hysteresis on top (see [`super::latch`]).

use crate::engine::events::RunInfo;

use super::options::{AdvisorOptions, Level};
use super::window::{competitors, throttle_reasons_in, GpuWindow, Window};
use super::{ids, Recommendation, Severity};

/// A rule's verdict at one evaluation.
pub(crate) struct Candidate {
    pub(crate) level: Level,
    pub(crate) rec: Recommendation,
}

/// What the rules look at.
pub(crate) struct Context<'a> {
    pub(crate) opts: &'a AdvisorOptions,
    pub(crate) window: &'a Window,
    pub(crate) run: Option<&'a RunInfo>,
}

impl Context<'_> {
    /// The GPU the attached training run uses, parsed from `RunInfo::device` ("cuda:1 (...)"
    /// → 1, a bare "cuda" → 0); `None` without a run or on a non-CUDA device.
    pub(crate) fn run_gpu(&self) -> Option<u32> {
        self.run.and_then(|run| cuda_index(&run.device))
    }
}

fn cuda_index(device: &str) -> Option<u32> {
    let rest = device.trim().strip_prefix("cuda")?;
    match rest.strip_prefix(':') {
        Some(index) => {
            let digits: String = index.chars().take_while(char::is_ascii_digit).collect();
            digits.parse().ok()
        }
        None => Some(0),
    }
}

/// Builds a [`Recommendation`].
struct Advice(Recommendation);

impl Advice {
    fn new(id: &str, severity: Severity, gpu: Option<u32>, message: String) -> Self {
        Self(Recommendation {
            id: id.to_string(),
            severity,
            gpu,
            message,
            evidence: Vec::new(),
            action: String::new(),
            key: None,
        })
    }

    fn evidence(mut self, name: &str, value: impl Into<String>) -> Self {
        self.0.evidence.push((name.to_string(), value.into()));
        self
    }

    fn evidence_opt(self, name: &str, value: Option<String>) -> Self {
        match value {
            Some(value) => self.evidence(name, value),
            None => self,
        }
    }

    fn action(mut self, action: impl Into<String>) -> Self {
        self.0.action = action.into();
        self
    }

    fn key(mut self, key: Option<&str>) -> Self {
        self.0.key = key.map(str::to_string);
        self
    }

    fn at(self, level: Level) -> Candidate {
        Candidate { level, rec: self.0 }
    }
}

fn pct(value: f64) -> String {
    format!("{value:.0}%")
}

fn share(fraction: f64) -> String {
    pct(fraction * 100.0)
}

fn gib(bytes: f64) -> String {
    format!("{:.1} GiB", bytes / f64::from(1u32 << 30))
}

fn window_evidence(window: &Window, samples: usize) -> String {
    let plural = if samples == 1 { "" } else { "s" };
    format!("{:.0} s, {samples} sample{plural}", window.span_s())
}

fn process_list(processes: &[&crate::telemetry::GpuProcess]) -> String {
    processes
        .iter()
        .map(|p| {
            let mem = p
                .gpu_memory_bytes
                .map(|b| format!(", {}", gib(b as f64)))
                .unwrap_or_default();
            format!("{}{mem}", p.label())
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// The rules judged per GPU, except `well_utilized` (see [`well_utilized`]).
pub(crate) fn gpu_rules(ctx: &Context<'_>, index: u32, out: &mut Vec<Candidate>) {
    let w = ctx.window.gpu(index);
    let Some(latest) = w.latest() else {
        return;
    };
    let attached = ctx.run_gpu() == Some(index);
    if attached {
        out.extend(fp32_on_tensor_cores(ctx, index, &w));
    }
    if w.len() < ctx.opts.min_window_samples {
        return;
    }
    let opts = ctx.opts;
    let span = window_evidence(ctx.window, w.len());

    if !attached {
        let idle = w.idle_frac(opts.idle_util_pct);
        out.push(
            Advice::new(
                ids::IDLE,
                Severity::Info,
                Some(index),
                format!("GPU {index} is idle: no process and ~0% utilization"),
            )
            .evidence("idle_samples", share(idle))
            .evidence_opt("util_gpu_avg", w.util_avg().map(pct))
            .evidence("window", span.clone())
            .action("Nothing runs here: start a job on it, or leave it free for others.")
            .at(opts.idle.above(idle)),
        );
    }

    let workload = attached || w.busy_frac(ctx.opts.idle_util_pct) >= 0.5;
    let mem_frac = w.mem_frac_avg();
    let mem_evidence = mem_frac.map(|f| {
        format!(
            "{} of {} ({})",
            gib(f * latest.mem_total_bytes as f64),
            gib(latest.mem_total_bytes as f64),
            share(f)
        )
    });

    if workload {
        if let Some(util) = w.util_avg() {
            low_utilization(ctx, index, &w, util, attached, mem_frac, &span, out);
        }
        if let Some(frac) = mem_frac {
            let (key, action) = if attached {
                (
                    Some("+"),
                    "Raise the batch size (press +): the memory is there, and a larger batch \
                     usually means higher throughput.",
                )
            } else {
                (None, "The job on this GPU could run a larger batch size.")
            };
            out.push(
                Advice::new(
                    ids::MEM_LOW,
                    Severity::Info,
                    Some(index),
                    format!("GPU {index} uses only {} of its memory", share(frac)),
                )
                .evidence_opt("mem_used_avg", mem_evidence.clone())
                .evidence("window", span.clone())
                .action(action)
                .key(key)
                .at(opts.mem_low.below(frac)),
            );
        }
    }

    if let Some(frac) = mem_frac {
        let (key, action) = if attached {
            (
                Some("-"),
                "Lower the batch size (press -), or keep the effective batch with more gradient \
                 accumulation (optim.accum) and a smaller optim.micro_batch; activation \
                 recomputation also trades compute for memory.",
            )
        } else {
            (
                None,
                "The job is close to running out of memory: lower its batch size, accumulate \
                 gradients over smaller micro-batches, or recompute activations.",
            )
        };
        out.push(
            Advice::new(
                ids::MEM_HIGH,
                Severity::Warn,
                Some(index),
                format!("GPU {index} memory is nearly full ({})", share(frac)),
            )
            .evidence_opt("mem_used_avg", mem_evidence)
            .evidence("window", span.clone())
            .action(action)
            .key(key)
            .at(opts.mem_high.above(frac)),
        );
    }

    throttling(ctx, index, &w, &span, out);
    contention(ctx, index, &w, &span, out);
}

/// Low utilization, split by what the step timings say: data-bound, launch-bound, or (with
/// no step timings to go on) plainly under-used.
#[allow(clippy::too_many_arguments)]
fn low_utilization(
    ctx: &Context<'_>,
    index: u32,
    w: &GpuWindow<'_>,
    util: f64,
    attached: bool,
    mem_frac: Option<f64>,
    span: &str,
    out: &mut Vec<Candidate>,
) {
    let opts = ctx.opts;
    let low = opts.util_low.below(util);
    let steps = ctx.window.step_count();
    let data_wait = ctx.window.data_wait_share();
    let sm_activity = w.sm_activity_avg().map(pct);

    match data_wait.filter(|_| attached && steps >= opts.min_window_steps) {
        Some(dw) => {
            let step_ms = ctx.window.mean_step_ms().map(|ms| format!("{ms:.0} ms"));
            out.push(
                Advice::new(
                    ids::DATA_BOUND,
                    Severity::Warn,
                    Some(index),
                    format!(
                        "GPU {index} waits on the input pipeline: {} of step time is data wait",
                        share(dw)
                    ),
                )
                .evidence("util_gpu_avg", pct(util))
                .evidence_opt("sm_activity_avg", sm_activity.clone())
                .evidence("data_wait_share", share(dw))
                .evidence_opt("step_ms_avg", step_ms.clone())
                .evidence("window", format!("{span}, {steps} steps"))
                .action(
                    "Raise data.prefetch_depth in the config, and pre-tokenize the corpus once \
                     with `cockpit prepare` so that no tokenization happens during training.",
                )
                .at(low.and(opts.data_wait.above(dw))),
            );
            let room = mem_frac.is_none_or(|f| f < opts.mem_high.clear);
            let (key, action) = if room {
                (
                    Some("+"),
                    "Raise the batch size (press +) so that each kernel launch does more work; \
                     if the batch cannot grow, longer sequences or a wider model use the GPU \
                     better.",
                )
            } else {
                (
                    None,
                    "Memory is nearly full, so the batch cannot grow: use longer sequences or \
                     a wider model with fewer layers, so that each kernel launch does more work.",
                )
            };
            out.push(
                Advice::new(
                    ids::LAUNCH_BOUND,
                    Severity::Warn,
                    Some(index),
                    format!(
                        "GPU {index} is under-used though data is ready: the batch is too small \
                         or kernel launches are host-bound"
                    ),
                )
                .evidence("util_gpu_avg", pct(util))
                .evidence_opt("sm_activity_avg", sm_activity)
                .evidence("data_wait_share", share(dw))
                .evidence_opt("step_ms_avg", step_ms)
                .evidence("window", format!("{span}, {steps} steps"))
                .action(action)
                .key(key)
                .at(low.and(opts.data_wait.mirrored().below(dw))),
            );
        }
        None => {
            let procs = w.latest().map(|s| s.processes.iter().collect::<Vec<_>>());
            let why = if attached {
                "no step timings yet"
            } else {
                "monitoring only: no step timings"
            };
            out.push(
                Advice::new(
                    ids::UNDERUTILIZED,
                    Severity::Warn,
                    Some(index),
                    format!(
                        "GPU {index} is under-used: {} average utilization with a job on it",
                        pct(util)
                    ),
                )
                .evidence("util_gpu_avg", pct(util))
                .evidence_opt("sm_activity_avg", sm_activity)
                .evidence_opt(
                    "processes",
                    procs.filter(|p| !p.is_empty()).map(|p| process_list(&p)),
                )
                .evidence("data_wait_share", why)
                .evidence("window", span.to_string())
                .action(
                    "Look at what feeds the job: data loading and CPU preprocessing, host-side \
                     synchronisation, or a batch too small for this GPU. A cockpit training \
                     run reports step timings that tell these apart.",
                )
                .at(low),
            );
        }
    }
}

/// fp32 training on a GPU with tensor cores (compute capability ≥ 7.0).
fn fp32_on_tensor_cores(ctx: &Context<'_>, index: u32, w: &GpuWindow<'_>) -> Option<Candidate> {
    let run = ctx.run?;
    let latest = w.latest()?;
    let (major, minor) = latest.compute_capability?;
    let dtype = run.dtype.to_ascii_lowercase();
    let fp32 = matches!(dtype.as_str(), "f32" | "fp32" | "float32");
    let suggested = if major >= 8 { "bf16" } else { "f16" };
    Some(
        Advice::new(
            ids::FP32_ON_TENSOR_CORES,
            Severity::Warn,
            Some(index),
            format!(
                "Training in fp32 on a tensor-core GPU ({}, compute capability {major}.{minor})",
                latest.name
            ),
        )
        .evidence("dtype", run.dtype.clone())
        .evidence("compute_capability", format!("{major}.{minor}"))
        .evidence("dtype_reason", run.dtype_reason.clone())
        .action(format!(
            "Set precision.dtype = \"{suggested}\" (or \"auto\") in the config: tensor cores \
             run {suggested} many times faster than fp32, in half the memory."
        ))
        .at(Level::when(fp32 && major >= 7)),
    )
}

/// Thermal and power throttling.
fn throttling(
    ctx: &Context<'_>,
    index: u32,
    w: &GpuWindow<'_>,
    span: &str,
    out: &mut Vec<Candidate>,
) {
    let opts = ctx.opts;
    let reasons = |thermal: bool| -> String {
        let mut seen: Vec<&str> = Vec::new();
        if let Some(latest) = w.latest() {
            seen = throttle_reasons_in(latest, thermal);
        }
        if seen.is_empty() {
            "none right now".to_string()
        } else {
            seen.join(", ")
        }
    };
    let clocks = w
        .sm_clock_avg()
        .map(|mhz| match w.latest().and_then(|s| s.sm_clock_max_mhz) {
            Some(max) => format!("{mhz:.0} of {max} MHz"),
            None => format!("{mhz:.0} MHz"),
        });

    let thermal = w.thermal_frac();
    out.push(
        Advice::new(
            ids::THERMAL_THROTTLE,
            Severity::Warn,
            Some(index),
            format!("GPU {index} is throttling for heat"),
        )
        .evidence("throttled_samples", share(thermal))
        .evidence("reasons", reasons(true))
        .evidence_opt("temperature_max", w.temperature_max().map(|t| format!("{t}°C")))
        .evidence_opt("sm_clock_avg", clocks.clone())
        .evidence("window", span.to_string())
        .action("Check cooling (airflow, fans, room temperature): the clocks are cut to protect the chip.")
        .at(opts.throttle.above(thermal)),
    );

    let power = w.power_frac();
    let limit = w.latest().and_then(|s| s.power_limit_w);
    let draw = w.power_avg().map(|avg| match limit {
        Some(limit) => format!("{avg:.0} of {limit:.0} W"),
        None => format!("{avg:.0} W"),
    });
    out.push(
        Advice::new(
            ids::POWER_THROTTLE,
            Severity::Info,
            Some(index),
            format!("GPU {index} is held at its power limit"),
        )
        .evidence("throttled_samples", share(power))
        .evidence("reasons", reasons(false))
        .evidence_opt("power_avg", draw)
        .evidence_opt("sm_clock_avg", clocks)
        .evidence("window", span.to_string())
        .action(
            "Expected under heavy load. Where the board allows, raise the power limit \
             (nvidia-smi -pl); otherwise the clocks stay where they are.",
        )
        .at(opts.throttle.above(power)),
    );
}

/// Other processes on the GPU.
fn contention(
    ctx: &Context<'_>,
    index: u32,
    w: &GpuWindow<'_>,
    span: &str,
    out: &mut Vec<Candidate>,
) {
    let opts = ctx.opts;
    let frac = w.contention_frac(opts.own_pid);
    let others = w
        .latest()
        .map(|s| competitors(s, opts.own_pid))
        .filter(|c| !c.is_empty())
        .map(|c| process_list(&c));
    out.push(
        Advice::new(
            ids::GPU_CONTENTION,
            Severity::Warn,
            Some(index),
            format!("Several processes compete for GPU {index}"),
        )
        .evidence("shared_samples", share(frac))
        .evidence_opt("processes", others)
        .evidence("window", span.to_string())
        .action(
            "Move one job to another GPU (CUDA_VISIBLE_DEVICES) or stop it: sharing a GPU \
             slows both down and makes their timings noisy.",
        )
        .at(opts.contention.above(frac)),
    );
}

/// "All good" for a GPU with work on it. `blocked` is true while any warning stands for it;
/// the rule then clears.
pub(crate) fn well_utilized(ctx: &Context<'_>, index: u32, blocked: bool) -> Option<Candidate> {
    let w = ctx.window.gpu(index);
    if w.len() < ctx.opts.min_window_samples {
        return None;
    }
    let attached = ctx.run_gpu() == Some(index);
    let workload = attached || w.busy_frac(ctx.opts.idle_util_pct) >= 0.5;
    let util = w.util_avg()?;
    let level = if blocked || !workload {
        Level::Clear
    } else {
        ctx.opts.util_good.above(util)
    };
    Some(
        Advice::new(
            ids::WELL_UTILIZED,
            Severity::Info,
            Some(index),
            format!("GPU {index} is well utilized"),
        )
        .evidence("util_gpu_avg", pct(util))
        .evidence_opt("sm_activity_avg", w.sm_activity_avg().map(pct))
        .evidence_opt("mem_used_avg", w.mem_frac_avg().map(share))
        .evidence("window", window_evidence(ctx.window, w.len()))
        .action("Nothing to change.")
        .at(level),
    )
}

/// Rules about the whole job rather than one GPU: a data-bound run where no GPU can be seen
/// (CPU training, or no NVML).
pub(crate) fn job_rules(ctx: &Context<'_>, out: &mut Vec<Candidate>) {
    out.extend(straggler(ctx));
    out.extend(memory_climb(ctx));
    out.extend(lambda_clamped(ctx));
    out.extend(loss_stuck(ctx));
    out.extend(loss_diverging(ctx));
    let opts = ctx.opts;
    let Some(latest) = ctx.window.latest() else {
        return;
    };
    let gpu_visible = ctx
        .run_gpu()
        .is_some_and(|i| latest.gpus.iter().any(|g| g.index == i));
    if ctx.run.is_none() || gpu_visible || ctx.window.step_count() < opts.min_window_steps {
        return;
    }
    let Some(dw) = ctx.window.data_wait_share() else {
        return;
    };
    out.push(
        Advice::new(
            ids::DATA_BOUND,
            Severity::Warn,
            None,
            format!(
                "The run waits on the input pipeline: {} of step time is data wait",
                share(dw)
            ),
        )
        .evidence("data_wait_share", share(dw))
        .evidence_opt(
            "step_ms_avg",
            ctx.window.mean_step_ms().map(|ms| format!("{ms:.0} ms")),
        )
        .evidence("window", format!("{} steps", ctx.window.step_count()))
        .action(
            "Raise data.prefetch_depth in the config, and pre-tokenize the corpus once with \
             `cockpit prepare` so that no tokenization happens during training.",
        )
        .at(opts.data_wait.above(dw)),
    );
}

/// SCU's λ pinned at a clamp for many control steps in a row, with Ŝ on the side that
/// pushes it there: above S* at λ_max (more regularisation cannot bring S down further),
/// below S* at λ_min. The setpoint is out of the controller's reach. The clamp is seen in the
/// control steps themselves: a controller off its clamps moves λ whenever Ŝ is off S* by more
/// than its dead band.
fn lambda_clamped(ctx: &Context<'_>) -> Option<Candidate> {
    let control = ctx.window.control();
    let last = *control.back()?;
    if !last.control || last.lambda.is_nan() || last.lambda <= 0.0 || last.error == 0.0 {
        return None;
    }
    let same = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b.abs();
    let pinned: Vec<_> = control
        .iter()
        .rev()
        .take_while(|c| {
            c.control
                && same(c.lambda, last.lambda)
                && c.error.signum() == last.error.signum()
                && c.error.abs() > 0.05 * c.target.abs()
        })
        .collect();
    let first = pinned.last()?;
    let steps = last.step.saturating_sub(first.step);
    let high = last.error > 0.0;
    let (clamp, cause, action, key) = if high {
        (
            "λ_max",
            "S* is out of reach: even the strongest regularisation allowed leaves Ŝ above it",
            "Raise scu.lambda_max in the config, or raise the setpoint S*",
            "]",
        )
    } else {
        (
            "λ_min",
            "S* is out of reach: even the weakest regularisation allowed leaves Ŝ below it",
            "Lower scu.lambda_min in the config, or lower the setpoint S*",
            "[",
        )
    };
    let s_hat = last.error + last.target;
    Some(
        Advice::new(
            ids::LAMBDA_CLAMPED,
            Severity::Warn,
            None,
            format!(
                "λ at {clamp} ({}) for {steps} steps: {cause}",
                lambda_text(last.lambda)
            ),
        )
        .evidence("lambda", lambda_text(last.lambda))
        .evidence("control_steps_pinned", pinned.len().to_string())
        .evidence("s_hat", format!("{:.2}%", s_hat * 100.0))
        .evidence("setpoint", format!("{:.2}%", last.target * 100.0))
        .action(action)
        .key(Some(key))
        .at(Level::when(pinned.len() >= ctx.opts.lambda_clamped_steps)),
    )
}

/// λ in about three significant digits: `0.0300`, `3.00e-5`, `12.0`.
fn lambda_text(v: f64) -> String {
    if (1e-3..1e4).contains(&v.abs()) {
        let decimals = (2 - v.abs().log10().floor() as i32).max(0) as usize;
        format!("{v:.decimals$}")
    } else {
        format!("{v:.2e}")
    }
}

/// The mean of some values (None for none).
fn mean_of(values: impl Iterator<Item = f64>) -> Option<f64> {
    let (sum, n) = values.fold((0.0, 0usize), |(s, n), v| (s + v, n + 1));
    (n > 0).then(|| sum / n as f64)
}

/// A run from step 0 whose loss, `loss_stuck_steps` in, has not come down from where it
/// started. (A resumed run starts where it left off: it is not judged.)
fn loss_stuck(ctx: &Context<'_>) -> Option<Candidate> {
    let run = ctx.run?;
    if run.start_step > 0 {
        return None;
    }
    let losses: Vec<(u64, f64)> = ctx
        .window
        .losses()
        .iter()
        .copied()
        .filter(|(_, l)| l.is_finite())
        .collect();
    let (first_step, _) = *losses.first()?;
    let (last_step, _) = *losses.last()?;
    let steps = last_step.saturating_sub(first_step);
    if steps < ctx.opts.loss_stuck_steps || first_step > 1 + run.start_step {
        return None;
    }
    let head = mean_of(losses.iter().take(10).map(|p| p.1))?;
    let tail_n = (losses.len() / 10).max(10);
    let tail = mean_of(losses.iter().rev().take(tail_n).map(|p| p.1))?;
    if head.abs() < 1e-12 {
        return None;
    }
    let drop = (head - tail) / head.abs();
    Some(
        Advice::new(
            ids::LOSS_STUCK,
            Severity::Warn,
            None,
            format!(
                "The loss has not come down in {steps} steps: {tail:.3} now, {head:.3} at the start"
            ),
        )
        .evidence("loss_start", format!("{head:.3}"))
        .evidence(
            "loss_now",
            format!("{tail:.3} (mean of the last {tail_n} steps)"),
        )
        .evidence("drop", share(drop.max(0.0)))
        .action(
            "Check the learning rate (too low learns nothing, too high cannot settle) and its \
             warm-up, and that the data is what the model should learn.",
        )
        .at(ctx.opts.loss_stuck.below(drop)),
    )
}

/// The smoothed loss climbing well above the best it reached in the window, or a loss that
/// is no longer finite.
fn loss_diverging(ctx: &Context<'_>) -> Option<Candidate> {
    let losses = ctx.window.losses();
    let opts = ctx.opts;
    let action = "Lower optim.lr (or lengthen the warm-up) and keep gradient clipping on; \
                  resume from a checkpoint from before the climb with --resume.";
    let recent_bad = losses
        .iter()
        .rev()
        .take(5)
        .filter(|(_, l)| !l.is_finite())
        .count();
    if losses.len() >= 5 && recent_bad == 5 {
        let (step, _) = *losses.back()?;
        return Some(
            Advice::new(
                ids::LOSS_DIVERGING,
                Severity::Critical,
                None,
                format!("The loss is not finite (NaN or ∞) at step {step} and the steps before"),
            )
            .evidence("non_finite_steps", "5 in a row".to_string())
            .action(action)
            .at(Level::Fire),
        );
    }
    // a debiased EMA of the finite losses; the best after it has settled a little
    let (mut value, mut weight) = (0.0, 0.0);
    let mut best: Option<(u64, f64)> = None;
    let mut now = None;
    for (i, &(step, loss)) in losses.iter().filter(|(_, l)| l.is_finite()).enumerate() {
        value = 0.9 * value + 0.1 * loss;
        weight = 0.9 * weight + 0.1;
        let smoothed = value / weight;
        now = Some(smoothed);
        if i >= 20 && best.is_none_or(|(_, b)| smoothed < b) {
            best = Some((step, smoothed));
        }
    }
    let (best_step, best) = best?;
    let now = now?;
    if losses.len() < 50 || best.abs() < 1e-12 {
        return None;
    }
    let rise = (now - best) / best.abs();
    let level = if now - best < opts.loss_diverging_nats {
        Level::Clear
    } else {
        opts.loss_diverging.above(rise)
    };
    Some(
        Advice::new(
            ids::LOSS_DIVERGING,
            Severity::Critical,
            None,
            format!(
                "The loss is diverging: {now:.3} (smoothed), up {} from its best {best:.3} at step {best_step}",
                share(rise)
            ),
        )
        .evidence("loss_smoothed", format!("{now:.3}"))
        .evidence("best", format!("{best:.3} at step {best_step}"))
        .evidence("rise", share(rise.max(0.0)))
        .action(action)
        .at(level),
    )
}

/// Data parallelism: every rank waits at the gradient all-reduce for the slowest, so one
/// slow rank (a throttled or shared GPU, a slow data path) slows the whole job.
fn straggler(ctx: &Context<'_>) -> Option<Candidate> {
    let opts = ctx.opts;
    if ctx.window.step_count() < opts.min_window_steps {
        return None;
    }
    let means = ctx.window.rank_compute_means();
    let (slow, worst) = means.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1))?;
    // The slowest against the median of the others (with two ranks: the other one).
    let mut others: Vec<f64> = means
        .iter()
        .enumerate()
        .filter(|(r, _)| *r != slow)
        .map(|(_, m)| *m)
        .collect();
    others.sort_by(f64::total_cmp);
    let median = *others.get(others.len().saturating_sub(1) / 2)?;
    if median <= 0.0 {
        return None;
    }
    let ratio = worst / median;
    let lost = 1.0 - median / worst;
    Some(
        Advice::new(
            ids::STRAGGLER,
            Severity::Warn,
            None,
            format!(
                "Rank {slow} is a straggler: its steps take {ratio:.2}× the other ranks' (median), and every rank waits for it at each all-reduce"
            ),
        )
        .evidence("slowest_rank", format!("rank {slow}: {worst:.1} ms compute"))
        .evidence("other_ranks_median", format!("{median:.1} ms compute"))
        .evidence_opt(
            "slowest_rank_gpu",
            ctx.window.last_rank(slow).and_then(|r| {
                let util = r.gpu_util_pct.map(|u| format!("util {u:.0}%"));
                let temp = r.gpu_temp_c.map(|t| format!("{t:.0} °C"));
                let parts: Vec<String> = util.into_iter().chain(temp).collect();
                (!parts.is_empty()).then(|| parts.join(", "))
            }),
        )
        .evidence(
            "per_rank_ms",
            means
                .iter()
                .enumerate()
                .map(|(r, m)| format!("{r}: {m:.1}"))
                .collect::<Vec<_>>()
                .join(", "),
        )
        .evidence("job_time_lost", share(lost))
        .evidence("window", format!("{} steps", ctx.window.step_count()))
        .action(format!(
            "Look at rank {slow}'s GPU in the GPU panel (throttling, another process on it, a \
             slower model or PCIe link) and its log; exclude that GPU with CUDA_VISIBLE_DEVICES \
             if it stays slow."
        ))
        .at(opts.straggler.above(ratio)),
    )
}

/// Host RSS or the run's device memory climbing step after step past the warm-up: a leak,
/// with the steps left until memory is full (from the latest snapshot's free memory).
/// Critical when memory runs out before the run reaches `max_steps`.
fn memory_climb(ctx: &Context<'_>) -> Vec<Candidate> {
    let opts = ctx.opts;
    let Some(run) = ctx.run else {
        return Vec::new();
    };
    let on_gpu = ctx.run_gpu();
    let latest = ctx.window.latest();
    let mem = ctx.window.memory();
    // On the CPU `memory_bytes` is the process's RSS: the host series when nothing else is.
    let host: Vec<(u64, u64)> = mem
        .iter()
        .filter_map(|m| {
            let rss = m.host.or(if on_gpu.is_none() { m.device } else { None });
            rss.map(|b| (m.step, b))
        })
        .collect();
    let device: Vec<(u64, u64)> = match on_gpu {
        Some(_) => mem
            .iter()
            .filter_map(|m| m.device.map(|b| (m.step, b)))
            .collect(),
        None => Vec::new(),
    };
    let host_free = latest
        .map(|s| &s.host)
        .filter(|h| h.ram_total_bytes > 0)
        .map(|h| h.ram_total_bytes.saturating_sub(h.ram_used_bytes));
    let device_free = on_gpu.and_then(|i| {
        let g = latest?.gpus.iter().find(|g| g.index == i)?;
        (g.mem_total_bytes > 0).then(|| g.mem_total_bytes.saturating_sub(g.mem_used_bytes))
    });
    let mut out = Vec::new();
    for (series, free, what, gpu) in [
        (host, host_free, "Host memory (RSS)", None),
        (device, device_free, "GPU memory", on_gpu),
    ] {
        let Some(c) = super::trend::judge(
            &series,
            run.start_step,
            opts.memory_climb_steps,
            opts.memory_climb_bytes,
            opts.memory_climb_frac,
        ) else {
            continue;
        };
        let steps_left = free
            .filter(|_| c.per_step > 0.0)
            .map(|f| (f as f64 / c.per_step).floor() as u64);
        let run_left = run.max_steps.saturating_sub(c.to.0);
        let severity = if steps_left.is_some_and(|n| n < run_left) {
            Severity::Critical
        } else {
            Severity::Warn
        };
        let mb = |b: f64| format!("{:.1} MiB", b / f64::from(1u32 << 20));
        let until = match steps_left {
            Some(n) => format!(": ~{} steps until the machine is full", n),
            None => String::new(),
        };
        let verdict = if severity == Severity::Critical {
            format!(" (the run has {run_left} steps to go)")
        } else {
            String::new()
        };
        out.push(
            Advice::new(
                ids::MEMORY_CLIMB,
                severity,
                gpu,
                format!("{what} grows {}/step{until}{verdict}", mb(c.per_step)),
            )
            .evidence(
                "memory",
                format!(
                    "{} at step {} → {} at step {}",
                    gib(c.from.1 as f64),
                    c.from.0,
                    gib(c.to.1 as f64),
                    c.to.0
                ),
            )
            .evidence_opt("free", free.map(|f| gib(f as f64)))
            .evidence("window", format!("{} steps", series.len()))
            .action(
                "Memory should stay flat after the first steps: this is a leak. Save a \
                 checkpoint and resume from it before memory runs out, and report it with the \
                 run's metrics.jsonl (memory_bytes, host_rss_bytes).",
            )
            .at(opts.memory_climb.above(c.ratio)),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::cuda_index;

    #[test]
    fn parses_the_run_device() {
        assert_eq!(cuda_index("cuda:1 (NVIDIA H100 80GB HBM3)"), Some(1));
        assert_eq!(cuda_index("cuda"), Some(0));
        assert_eq!(cuda_index("cpu"), None);
    }
}
