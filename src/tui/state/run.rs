//! What the dashboard knows about the training run, updated from engine events.

use super::history::{Ema, History, Ring};
use crate::engine::events::{EvalStats, FinishReason, RunInfo, ScuStats, StepStats};

/// Weight of the past in the loss EMA (≈ a 50-step window).
const LOSS_EMA_BETA: f64 = 0.98;
/// Steps averaged for the ETA.
const ETA_WINDOW: usize = 50;

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
    /// Training loss, EMA-smoothed over the raw per-step values.
    pub train_loss_ema: History,
    /// Validation loss per evaluation.
    pub val_loss: History,
    /// Validation loss ± its standard error (the band around `val_loss`).
    pub val_lo: History,
    pub val_hi: History,
    /// S-ratio in percent.
    pub s_ratio: History,
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
            train_loss_ema: h(),
            val_loss: h(),
            val_lo: h(),
            val_hi: h(),
            s_ratio: h(),
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
    recent_window: usize,
    loss_ema: Ema,
    step_ms: Ring<f64>,
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
            recent_window: sizes.recent_window.max(1),
            loss_ema: Ema::new(LOSS_EMA_BETA),
            step_ms: Ring::new(ETA_WINDOW),
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
        let ema = self.loss_ema.update(s.loss);
        series.train_loss_ema.push(x, ema);
        series.lr.push(x, s.lr);
        series.grad_norm.push(x, s.grad_norm);
        if s.step_ms.is_finite() && s.step_ms > 0.0 {
            self.step_ms.push(s.step_ms);
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

    /// Seconds to `max_steps` at the recent mean step time.
    pub fn eta_s(&self) -> Option<f64> {
        if self.finished.is_some() || self.step_ms.is_empty() {
            return None;
        }
        let info = self.info.as_ref()?;
        let remaining = info.max_steps.saturating_sub(self.step()?);
        let mean_ms = self.step_ms.iter().sum::<f64>() / self.step_ms.len() as f64;
        Some(remaining as f64 * mean_ms / 1000.0)
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
            first.max(last - self.recent_window as f64)
        } else {
            first
        };
        Some((first, last))
    }

    /// Steps in the recent window.
    pub fn recent_window(&self) -> usize {
        self.recent_window
    }
}
