//! What the dashboard knows about the training run, updated from engine events.

use super::eta::Eta;
use super::history::{Ema, History, Ring};
use crate::engine::events::{
    Command, EvalStats, Event, FinishReason, RunInfo, ScuStats, StepStats,
};
use std::collections::VecDeque;

/// The loss smoothing levels the smoothing key cycles through: the weight of the past in a
/// debiased EMA (0: the raw loss).
pub const SMOOTHING_LEVELS: [f64; 4] = [0.0, 0.6, 0.9, 0.98];
/// Events marked on the loss chart, at most.
const MARKS_CAPACITY: usize = 256;
/// Throughput samples kept for the sparkline.
const THROUGHPUT_LEN: usize = 240;
/// The recent-window view shows this share of the run (within the recent history).
const RECENT_SHARE: f64 = 0.2;
/// ... and at least this many steps.
const RECENT_MIN_STEPS: f64 = 10.0;

/// Something that happened to the run, marked on the loss chart at its step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MarkKind {
    /// The micro-batch size changed.
    Batch,
    /// The SCU setpoint changed.
    Setpoint,
    /// The run was paused.
    Pause,
    /// The engine restored a checkpoint (divergence recovery, or a resumed run).
    Restore,
    /// A checkpoint was written.
    Checkpoint,
}

impl MarkKind {
    /// Every kind, in legend order.
    pub const ALL: [MarkKind; 5] = [
        MarkKind::Batch,
        MarkKind::Setpoint,
        MarkKind::Pause,
        MarkKind::Restore,
        MarkKind::Checkpoint,
    ];

    /// The glyph on the chart's x axis.
    pub fn glyph(self) -> char {
        match self {
            MarkKind::Batch => 'b',
            MarkKind::Setpoint => 's',
            MarkKind::Pause => 'p',
            MarkKind::Restore => 'r',
            MarkKind::Checkpoint => 'c',
        }
    }

    /// What it marks, for the legend.
    pub fn name(self) -> &'static str {
        match self {
            MarkKind::Batch => "batch",
            MarkKind::Setpoint => "S*",
            MarkKind::Pause => "pause",
            MarkKind::Restore => "restore",
            MarkKind::Checkpoint => "checkpoint",
        }
    }

    /// The mark an event makes, if any. The engine reports a divergence recovery as a
    /// warning that says it "restored" a checkpoint.
    pub fn of(event: &Event) -> Option<(u64, MarkKind)> {
        Some(match event {
            Event::RunStarted(info) if info.start_step > 0 => (info.start_step, MarkKind::Restore),
            Event::CommandApplied { step, command, .. } => match command {
                Command::SetBatchSize { .. } => (*step, MarkKind::Batch),
                Command::SetScuSetpoint { .. } => (*step, MarkKind::Setpoint),
                _ => return None,
            },
            Event::Paused { step } => (*step, MarkKind::Pause),
            Event::CheckpointSaved { step, .. } => (*step, MarkKind::Checkpoint),
            Event::Warning { step, message } if message.contains("restored ") => {
                (*step, MarkKind::Restore)
            }
            _ => return None,
        })
    }
}

/// Sizes of the chart histories.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HistorySizes {
    /// Points kept per series for the whole run (thinned by halving beyond this).
    pub capacity: usize,
    /// Steps shown in the recent-window view, at full resolution.
    pub recent_window: usize,
}

impl Default for HistorySizes {
    fn default() -> Self {
        HistorySizes {
            capacity: 2048,
            recent_window: 500,
        }
    }
}

/// Every chart series, by step.
#[derive(Clone, Debug)]
pub struct ChartSeries {
    /// Training loss per step.
    pub train_loss: History,
    /// Training loss, smoothed by a debiased EMA at each level of [`SMOOTHING_LEVELS`] after
    /// the first (index 0 here is level 1).
    pub train_loss_smooth: Vec<History>,
    /// Validation loss per evaluation.
    pub val_loss: History,
    /// Validation loss ± its standard error (the band around `val_loss`).
    pub val_lo: History,
    pub val_hi: History,
    /// S-ratio in percent.
    pub s_ratio: History,
    /// The smoothed Ŝ the controller acts on, in percent.
    pub s_hat: History,
    /// Setpoint S* in percent.
    pub setpoint: History,
    /// log10 λ.
    pub lambda_log10: History,
    /// Learning rate.
    pub lr: History,
    /// Gradient norm.
    pub grad_norm: History,
}

impl ChartSeries {
    fn new(sizes: HistorySizes) -> ChartSeries {
        let h = || History::new(sizes.capacity, sizes.recent_window);
        ChartSeries {
            train_loss: h(),
            train_loss_smooth: SMOOTHING_LEVELS[1..].iter().map(|_| h()).collect(),
            val_loss: h(),
            val_lo: h(),
            val_hi: h(),
            s_ratio: h(),
            s_hat: h(),
            setpoint: h(),
            lambda_log10: h(),
            lr: h(),
            grad_norm: h(),
        }
    }
}

/// How the run ended.
#[derive(Clone, Debug, PartialEq)]
pub struct Finished {
    /// Last step.
    pub step: u64,
    /// Why the run ended.
    pub reason: FinishReason,
    /// The engine's explanation.
    pub message: String,
    /// Wall time of the whole run.
    pub elapsed_s: f64,
}

/// The run as seen through its events.
#[derive(Clone, Debug)]
pub struct RunState {
    /// Static facts, once `RunStarted` arrived.
    pub info: Option<RunInfo>,
    /// The latest step.
    pub last_step: Option<StepStats>,
    /// The latest evaluation.
    pub last_eval: Option<EvalStats>,
    /// The latest SCU control step.
    pub last_scu: Option<ScuStats>,
    /// Micro-batch size in effect.
    pub micro_batch: Option<usize>,
    /// SCU setpoint in effect (a fraction).
    pub setpoint: Option<f64>,
    /// Whether the engine reported a pause (and no resume since).
    pub paused: bool,
    /// How the run ended, once it has.
    pub finished: Option<Finished>,
    /// Whether the SCU reported convergence.
    pub converged: bool,
    /// Step events the engine dropped because the dashboard fell behind.
    pub dropped_steps: u64,
    /// Chart histories.
    pub series: ChartSeries,
    /// Events marked on the loss chart, oldest first.
    pub marks: VecDeque<(u64, MarkKind)>,
    /// Tokens per second of recent steps, for the throughput sparkline.
    pub throughput: Ring<u64>,
    /// When the current pause began, on the dashboard's clock (seconds).
    pub paused_since: Option<f64>,
    recent_window: usize,
    loss_ema: Vec<Ema>,
    eta: Eta,
}

impl RunState {
    /// An empty state, before any event.
    pub fn new(sizes: HistorySizes) -> RunState {
        RunState {
            info: None,
            last_step: None,
            last_eval: None,
            last_scu: None,
            micro_batch: None,
            setpoint: None,
            paused: false,
            finished: None,
            converged: false,
            dropped_steps: 0,
            series: ChartSeries::new(sizes),
            marks: VecDeque::new(),
            throughput: Ring::new(THROUGHPUT_LEN),
            paused_since: None,
            recent_window: sizes.recent_window.max(1),
            loss_ema: SMOOTHING_LEVELS[1..].iter().map(|b| Ema::new(*b)).collect(),
            eta: Eta::default(),
        }
    }

    /// Takes note of an event for the ETA and the chart marks (before it is applied).
    pub fn note(&mut self, event: &Event) {
        self.eta.observe(event);
        if let Some(mark) = MarkKind::of(event) {
            if self.marks.len() == MARKS_CAPACITY {
                self.marks.pop_front();
            }
            self.marks.push_back(mark);
        }
    }

    /// Records `RunStarted`.
    pub fn on_started(&mut self, info: &RunInfo) {
        self.micro_batch = Some(info.micro_batch);
        self.setpoint = Some(info.scu_target);
        self.info = Some(info.clone());
    }

    /// Records one optimizer step.
    pub fn on_step(&mut self, s: &StepStats) {
        let x = s.step as f64;
        let series = &mut self.series;
        series.train_loss.push(x, s.loss);
        for (ema, history) in self.loss_ema.iter_mut().zip(&mut series.train_loss_smooth) {
            if s.loss.is_finite() {
                history.push(x, ema.update(s.loss));
            }
        }
        series.lr.push(x, s.lr);
        series.grad_norm.push(x, s.grad_norm);
        if s.tokens_per_sec.is_finite() && s.tokens_per_sec >= 0.0 {
            self.throughput.push(s.tokens_per_sec.round() as u64);
        }
        self.micro_batch = Some(s.micro_batch);
        self.dropped_steps += s.dropped_before;
        self.last_step = Some(s.clone());
    }

    /// Records an evaluation.
    pub fn on_eval(&mut self, e: &EvalStats) {
        self.series.val_loss.push(e.step as f64, e.val_loss);
        if e.val_loss_se.is_finite() {
            let x = e.step as f64;
            self.series.val_lo.push(x, e.val_loss - e.val_loss_se);
            self.series.val_hi.push(x, e.val_loss + e.val_loss_se);
        }
        self.last_eval = Some(e.clone());
    }

    /// Records an SCU control step.
    pub fn on_scu(&mut self, s: &ScuStats) {
        let x = s.step as f64;
        self.series.s_ratio.push(x, s.s_ratio * 100.0);
        self.series.s_hat.push(x, s.s_hat * 100.0);
        self.series.setpoint.push(x, s.target * 100.0);
        if s.lambda > 0.0 {
            self.series.lambda_log10.push(x, s.lambda.log10());
        }
        self.setpoint = Some(s.target);
        self.last_scu = Some(s.clone());
    }

    /// The latest step number seen.
    pub fn step(&self) -> Option<u64> {
        self.last_step
            .as_ref()
            .map(|s| s.step)
            .or(self.info.as_ref().map(|i| i.start_step))
    }

    /// Wall time of the run so far, from the engine's clock.
    pub fn elapsed_s(&self) -> Option<f64> {
        self.finished
            .as_ref()
            .map(|f| f.elapsed_s)
            .or(self.last_step.as_ref().map(|s| s.elapsed_s))
    }

    /// Fraction of `max_steps` done.
    pub fn progress(&self) -> Option<f64> {
        let info = self.info.as_ref()?;
        if info.max_steps == 0 {
            return None;
        }
        Some((self.step()? as f64 / info.max_steps as f64).clamp(0.0, 1.0))
    }

    /// Seconds to `max_steps` (see [`Eta`]: the same formula as the headless progress line).
    pub fn eta_s(&self) -> Option<f64> {
        if self.finished.is_some() {
            return None;
        }
        let info = self.info.as_ref()?;
        self.eta.eta_s(self.step()?, info.max_steps)
    }

    /// The smoothed training loss at a level of [`SMOOTHING_LEVELS`] (0: the raw loss).
    pub fn train_loss_at(&self, level: usize) -> &History {
        match level.checked_sub(1) {
            Some(i) => self
                .series
                .train_loss_smooth
                .get(i)
                .unwrap_or(&self.series.train_loss),
            None => &self.series.train_loss,
        }
    }

    /// Model FLOPs utilisation: tokens/s × FLOPs/token ÷ peak FLOP/s, when the peak is known.
    pub fn mfu(&self) -> Option<f64> {
        let info = self.info.as_ref()?;
        let peak = info.peak_flops.filter(|p| *p > 0.0)?;
        let step = self.last_step.as_ref()?;
        Some(step.tokens_per_sec * info.flops_per_token / peak)
    }

    /// The x range of the charts: the whole run, or the recent window.
    pub fn x_range(&self, recent: bool) -> Option<(f64, f64)> {
        let s = &self.series;
        let last = [&s.train_loss, &s.val_loss, &s.s_ratio]
            .iter()
            .filter_map(|h| h.last())
            .map(|p| p.0)
            .fold(f64::NEG_INFINITY, f64::max);
        let first = [&s.train_loss, &s.val_loss, &s.s_ratio]
            .iter()
            .filter_map(|h| h.first())
            .map(|p| p.0)
            .fold(f64::INFINITY, f64::min);
        if !last.is_finite() || !first.is_finite() {
            return None;
        }
        let first = if recent {
            first.max(last - self.recent_steps(last - first) as f64)
        } else {
            first
        };
        Some((first, last))
    }

    /// Steps the recent-window view shows for a run that has covered `span` steps: the last
    /// fifth of it, at least ten steps and at most the recent history
    /// ([`HistorySizes::recent_window`]).
    pub fn recent_steps(&self, span: f64) -> u64 {
        (span * RECENT_SHARE)
            .ceil()
            .max(RECENT_MIN_STEPS)
            .min(self.recent_window as f64) as u64
    }

    /// Steps shown by the recent-window view now.
    pub fn recent_window(&self) -> u64 {
        match self.x_range(false) {
            Some((first, last)) => self.recent_steps(last - first),
            None => self.recent_window as u64,
        }
    }
}
