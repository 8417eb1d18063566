//! The Shannon Control Unit: PI control of the regularization weight λ that holds the
//! S-ratio `S = ParamBPT / (DataBPT + ParamBPT)` at a setpoint.

use crate::config::{ScuConfig, ScuLaw};
use serde::{Deserialize, Serialize};

/// Controller state (saved in checkpoints).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ScuController {
    pub target: f64,
    /// Checkpoints from before `scu.law` existed were written by the reference law.
    #[serde(default = "legacy_law")]
    pub law: ScuLaw,
    pub kp: f64,
    pub ki: f64,
    pub deadband: f64,
    pub ema_alpha: f64,
    pub leak: f64,
    pub i_max: f64,
    pub lambda_min: f64,
    pub lambda_max: f64,
    pub enabled: bool,
    pub lambda: f64,
    pub integral: f64,
    /// EMA of S (None before the first measurement).
    pub s_hat: Option<f64>,
    /// λ after each of the last control steps (for convergence).
    pub recent_lambda: Vec<f64>,
    pub converged: bool,
    /// Cross-entropy of the steps since the last control step (sum, count): part of the
    /// state, so a run stopped between control steps resumes onto the same λ trajectory.
    #[serde(default)]
    pub window: (f64, u64),
    /// log-pi: ε = ln(Ŝ/S*) at the previous control step (None after a setpoint change).
    #[serde(default)]
    pub prev_eps: Option<f64>,
    /// adaptive: the fraction of ln(S*/S) the next control step is planned to close.
    #[serde(default = "default_rate")]
    pub rate: f64,
    /// adaptive: the plant model, measured online.
    #[serde(default)]
    pub plant: Plant,
}

fn default_rate() -> f64 {
    0.3
}

/// The adaptive law's model of the plant and what it measured.
///
/// With the penalty λ·coef·Σw² in the loss, Adam moves y = ln Σw² per optimizer step by
/// `lr·(a − κ·f·λ_m)`: a is the growth the data gradient drives (per unit of learning rate),
/// κ = 4·coef·Σ(w²/(√v̂+ε))/Σw² the penalty's authority (read from the optimizer's second
/// moments at each control step), f the gradient-clipping factor and λ_m the λ that Adam's
/// first moment carries (λ filtered by β1: the loop's delay). Everything scales with lr, so a
/// schedule phase change does not disturb the model; a batch-size change moves v̂ and so κ,
/// which is measured, not assumed. κ itself drifts (v̂ grows as the data gradients grow while
/// the model learns — fivefold over a few hundred steps on the tiny model): the window's
/// growth is measured with the κ of the whole window (the geometric mean of its ends) and the
/// next window is planned with κ carried one window ahead along its measured trend.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Plant {
    /// Adam's β1 (the filter between λ and the update).
    pub beta1: f64,
    /// λ as Adam's first moment carries it.
    pub lambda_m: Option<f64>,
    /// Since the last control step: Σ lr, Σ lr·f·λ_m, Σ lr·f, optimizer steps.
    pub lr_sum: f64,
    pub pen_sum: f64,
    pub lrf_sum: f64,
    pub steps: u64,
    /// The learning rate of the last step.
    pub last_lr: f64,
    /// y = ln ParamBPT at the last control step.
    pub y_prev: Option<f64>,
    /// a: growth of y per unit of lr without the penalty (smoothed).
    pub growth: Option<f64>,
    /// κ measured at the last control step.
    pub gain: f64,
    /// The trend of ln κ per control step (smoothed).
    #[serde(default)]
    pub gain_trend: f64,
    /// The equilibrium λ = a/(κ·f): the feedforward, where the penalty's shrink balances the
    /// data gradient's growth.
    pub lambda_eq: Option<f64>,
    /// DataBPT smoothed (Holt: level and trend per control step).
    pub data_level: Option<f64>,
    pub data_trend: Option<f64>,
}

/// What the engine measures for the adaptive law at a control step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PlantReading {
    /// DataBPT of the window.
    pub data_bpt: f64,
    /// ParamBPT of the weights as they are now (after the last update).
    pub param_bpt: f64,
    /// κ: how fast the penalty shrinks ln Σw² per unit of lr·λ (see [`Plant`]).
    pub gain: f64,
}

/// Smoothing of the growth estimate a (per control step): a level, no trend (a trend on a
/// measurement this noisy swung λ with a period of ~20 control steps on the tiny model).
const GROWTH_ALPHA: f64 = 0.85;
/// Smoothing of the trend of ln κ (per control step).
const GAIN_TREND_ALPHA: f64 = 0.8;
/// The adaptive law moves λ by at most this factor per control step.
const MAX_STEP: f64 = 4.0;
/// Holt smoothing of DataBPT: level and trend. The target y* follows this level, so its lag is
/// S's error: with (0.2, 0.1) the level ran 4–5% behind DataBPT while the embedded default
/// learned fast and 5% below it once learning slowed (S off by as much for ~20 control steps);
/// with (0.5, 0.2) the lag stays within 1.5% and the window's sampling noise is still halved.
const DATA_ALPHA: f64 = 0.5;
const DATA_BETA: f64 = 0.2;
/// Near the target λ stays within this factor of the equilibrium a/(κ·f) (where one exists:
/// a > 0). The plant is linear only near it: a λ far above it makes the penalty's gradient
/// dominate Adam's v̂, which lowers κ (the authority the plan counted on) for hundreds of
/// steps, and the plan's answer — λ further up, then far down once the moment catches up — is
/// a limit cycle (λ 0.4–129, period ~7 control steps, S ±9% in the embedded default's LR tail
/// at S* = 0.5%).
const EQ_SPAN: f64 = 3.0;
/// Beyond this gap |ln ParamBPT − ln ParamBPT*| the span grows in proportion to it, on the
/// gap's side.
const EQ_GAP: f64 = 0.1;

fn legacy_law() -> ScuLaw {
    ScuLaw::Reference
}

/// What one control step saw and did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ControlOutcome {
    pub s: f64,
    pub s_hat: f64,
    pub error: f64,
    pub lambda: f64,
    pub integral: f64,
    /// True on the control step where convergence is first reached.
    pub newly_converged: bool,
}

const CONVERGENCE_WINDOW: usize = 100;

impl ScuController {
    pub fn new(c: &ScuConfig) -> Self {
        let (kp, ki, deadband) = c.gains();
        Self {
            target: c.target,
            law: c.law,
            kp,
            ki,
            deadband,
            ema_alpha: c.ema_alpha,
            leak: c.integral_leak,
            i_max: c.integral_max,
            lambda_min: c.lambda_min,
            lambda_max: c.lambda_max,
            enabled: c.enabled,
            lambda: c.lambda_init,
            integral: 0.0,
            s_hat: None,
            recent_lambda: Vec::new(),
            converged: false,
            window: (0.0, 0),
            prev_eps: None,
            rate: c.rate,
            plant: Plant::default(),
        }
    }

    /// Set Adam's β1 (the adaptive law models the first moment's lag).
    pub fn with_beta1(mut self, beta1: f64) -> Self {
        self.plant.beta1 = beta1;
        self
    }

    /// Record one optimizer step: its cross-entropy, learning rate and the factor its
    /// gradients were scaled by (clipping; 0 = the step was skipped).
    pub fn observe_step(&mut self, ce: f64, lr: f64, applied: f64) {
        self.observe(ce);
        if !(lr.is_finite() && applied.is_finite()) || applied <= 0.0 {
            return;
        }
        let p = &mut self.plant;
        let b = p.beta1.clamp(0.0, 0.9999);
        let m = match p.lambda_m {
            Some(m) => b * m + (1.0 - b) * self.lambda,
            None => self.lambda,
        };
        p.lambda_m = Some(m);
        p.lr_sum += lr;
        p.pen_sum += lr * applied * m;
        p.lrf_sum += lr * applied;
        p.steps += 1;
        p.last_lr = lr;
    }

    /// Record one step's cross-entropy for the next control step.
    pub fn observe(&mut self, ce: f64) {
        if !ce.is_finite() {
            return;
        }
        self.window.0 += ce;
        self.window.1 += 1;
    }

    /// Mean cross-entropy since the last call (None when no step was observed).
    pub fn take_window_mean(&mut self) -> Option<f64> {
        let (sum, n) = std::mem::take(&mut self.window);
        (n > 0).then(|| sum / n as f64)
    }

    /// S-ratio from the two bits-per-token terms.
    pub fn s_ratio(data_bpt: f64, param_bpt: f64) -> f64 {
        let d = data_bpt + param_bpt;
        if d > 0.0 {
            param_bpt / d
        } else {
            0.0
        }
    }

    /// One control step with the measured S. S above target ⇒ λ rises.
    pub fn update(&mut self, s: f64) -> ControlOutcome {
        self.update_with(s, None)
    }

    /// One control step with the measured S and, for the adaptive law, the plant reading
    /// (without one the adaptive law holds λ).
    pub fn update_with(&mut self, s: f64, reading: Option<PlantReading>) -> ControlOutcome {
        let s_hat = match self.s_hat {
            Some(prev) => self.ema_alpha * s + (1.0 - self.ema_alpha) * prev,
            None => s,
        };
        self.s_hat = Some(s_hat);
        let e = s_hat - self.target;
        if self.enabled {
            match self.law {
                ScuLaw::Reference => self.reference_step(e),
                ScuLaw::LogPi => self.log_pi_step(e, s_hat),
                ScuLaw::Adaptive => {
                    if let Some(r) = reading {
                        self.adaptive_step(&r);
                    }
                }
            }
        }
        self.recent_lambda.push(self.lambda);
        if self.recent_lambda.len() > CONVERGENCE_WINDOW {
            self.recent_lambda.remove(0);
        }
        let mut newly = false;
        if self.recent_lambda.len() == CONVERGENCE_WINDOW {
            let settled = self.settled(s, s_hat);
            newly = settled && !self.converged;
            self.converged = settled;
        }
        ControlOutcome {
            s,
            s_hat,
            error: e,
            lambda: self.lambda,
            integral: self.integral,
            newly_converged: newly,
        }
    }

    /// Convergence over the last CONVERGENCE_WINDOW control steps. Reference: λ moved < 1e-3
    /// and |S − S*|/S* < 5%. log-pi keeps tracking a plant that drifts as the model learns,
    /// so λ never stops outright: it counts as settled when λ drifted < 20% over the window
    /// and |Ŝ − S*|/S* < 5%.
    fn settled(&self, s: f64, s_hat: f64) -> bool {
        let (lo, hi) = self
            .recent_lambda
            .iter()
            .fold((f64::MAX, f64::MIN), |(a, b), &x| (a.min(x), b.max(x)));
        match self.law {
            ScuLaw::Reference => hi - lo < 1e-3 && ((s - self.target) / self.target).abs() < 0.05,
            ScuLaw::LogPi | ScuLaw::Adaptive => {
                (hi / lo).ln() < 0.2 && ((s_hat - self.target) / self.target).abs() < 0.05
            }
        }
    }

    /// The reference law: λ ← λ·exp(Kp·e + I) with a leaky, clamped integral.
    fn reference_step(&mut self, e: f64) {
        self.integral *= self.leak;
        if e.abs() > self.deadband {
            let at_max = self.lambda >= self.lambda_max && e > 0.0;
            let at_min = self.lambda <= self.lambda_min && e < 0.0;
            if !(at_max || at_min) {
                self.integral = (self.integral + self.ki * e).clamp(-self.i_max, self.i_max);
            }
            self.lambda = (self.lambda * (self.kp * e + self.integral).exp())
                .clamp(self.lambda_min, self.lambda_max);
        }
    }

    /// Velocity-form PI on the log error ε = ln(Ŝ/S*): Δln λ = Kp·(ε − ε₋₁) + Ki·ε.
    /// ln λ is the controller's only integrator, so a plant that itself lags (weights
    /// shrink over hundreds of steps) sees one integrator, not two; the clamps cannot wind
    /// up because there is no separate integral state. `integral` reports Σ Ki·ε.
    fn log_pi_step(&mut self, e: f64, s_hat: f64) {
        let eps = (s_hat.max(1e-12) / self.target).ln();
        let prev = self.prev_eps.replace(eps);
        if e.abs() <= self.deadband {
            return;
        }
        let du = self.kp * prev.map_or(0.0, |p| eps - p) + self.ki * eps;
        self.integral += self.ki * eps;
        self.lambda = (self.lambda * du.exp()).clamp(self.lambda_min, self.lambda_max);
    }

    /// The adaptive law. From the window just ended it measures the growth a = (Δy +
    /// κ·Σ lr·f·λ_m)/Σ lr (a disturbance observer: whatever the data gradient did), then
    /// plans the next window: λ such that lr·(a − κ·f·λ) moves y by `rate`·(y* − y), where
    /// y* = ln(S*/(1 − S*)·DataBPT). At y = y* that λ is the equilibrium a/(κ·f): the
    /// feedforward. No integral state (a is re-measured each step), so nothing winds up at
    /// the clamps; λ moves by at most ×4 per control step.
    fn adaptive_step(&mut self, r: &PlantReading) {
        let p = &mut self.plant;
        let (lr_sum, pen_sum, lrf_sum, steps) = (p.lr_sum, p.pen_sum, p.lrf_sum, p.steps);
        (p.lr_sum, p.pen_sum, p.lrf_sum, p.steps) = (0.0, 0.0, 0.0, 0);
        if !(r.param_bpt > 0.0 && r.param_bpt.is_finite() && r.data_bpt > 0.0) {
            return;
        }
        let y = r.param_bpt.ln();
        let gain_ok = r.gain.is_finite() && r.gain > 0.0;
        // κ over the window just ended: it moved from p.gain to r.gain (geometric mean of the
        // two; the trend of ln κ is what the next window's plan carries forward).
        let k_window = if gain_ok && p.gain > 0.0 && p.gain.is_finite() {
            let t = (r.gain / p.gain).ln();
            p.gain_trend += GAIN_TREND_ALPHA * (t - p.gain_trend);
            (p.gain * r.gain).sqrt()
        } else {
            r.gain
        };
        if let (Some(yp), true) = (p.y_prev, lr_sum > 0.0 && gain_ok) {
            let a = (y - yp + k_window * pen_sum) / lr_sum;
            if a.is_finite() {
                p.growth = Some(match p.growth {
                    Some(level) => level + GROWTH_ALPHA * (a - level),
                    None => a,
                });
            }
        }
        p.y_prev = Some(y);
        if gain_ok {
            p.gain = r.gain;
        }
        // DataBPT carries the window's sampling noise (±1–2% here) and drifts down as the
        // model learns: Holt's level + trend follows the drift without the noise.
        let d = match (p.data_level, p.data_trend) {
            (Some(level), Some(trend)) => {
                let pred = level + trend;
                let level = pred + DATA_ALPHA * (r.data_bpt - pred);
                p.data_trend = Some(trend + DATA_BETA * (level - pred));
                level
            }
            _ => {
                p.data_trend = Some(0.0);
                r.data_bpt
            }
        };
        p.data_level = Some(d);
        let (Some(a), true) = (p.growth, gain_ok && steps > 0 && p.last_lr > 0.0) else {
            return;
        };
        let f = if lr_sum > 0.0 && lrf_sum > 0.0 {
            lrf_sum / lr_sum
        } else {
            1.0
        };
        let y_star = (self.target / (1.0 - self.target) * d).ln();
        let span = steps as f64 * p.last_lr;
        // The target moves with DataBPT (down while the model learns): follow its trend, and
        // close `rate` of the gap on top.
        let drift = match p.data_trend {
            Some(t) if d > 0.0 && (d + t) > 0.0 => ((d + t) / d).ln(),
            _ => 0.0,
        };
        let want = self.rate * (y_star - y) + drift;
        // κ over the next window: one control step on along its trend.
        let gain = r.gain * p.gain_trend.clamp(-1.0, 1.0).exp();
        p.lambda_eq = Some(a / (r.gain * f));
        self.integral = a / (r.gain * f);
        // λ_plan is the λ Adam's first moment should carry over the next two windows; the
        // moment follows λ with β1 per step, so set λ beyond it (the predictor for the
        // loop's delay): λ = λ_m + (λ_plan − λ_m)·n/(n − Σ_{j=1..n} β1^j), n = 2 windows.
        let plan = (a - want / span) / (gain * f);
        let lam = match p.lambda_m {
            Some(m) if p.beta1 > 0.0 && p.beta1 < 1.0 => {
                let n = 2.0 * steps as f64;
                let b = p.beta1;
                let w = b * (1.0 - b.powf(n)) / (1.0 - b);
                m + (plan - m) * n / (n - w)
            }
            _ => plan,
        };
        if !lam.is_finite() {
            return;
        }
        // The slew limit spans the current λ and the equilibrium: the feedforward may jump
        // (from λ_min after a growth phase, say), the error term only by ×MAX_STEP beyond it.
        let eq = (a / (r.gain * f)).max(self.lambda_min);
        let (lo, hi) = (self.lambda.min(eq), self.lambda.max(eq));
        let mut lam = lam.clamp(lo / MAX_STEP, hi * MAX_STEP);
        if a > 0.0 {
            // Far from the target the plan needs λ far from the equilibrium (LoRA adapters
            // that start at 3.5 S*: λ ×100 above it): the span widens with the gap, on the
            // side the gap asks for (y above y*: λ may rise further; below: fall further).
            let widen = |gap: f64| EQ_SPAN * (gap / EQ_GAP).max(1.0);
            let (down, up) = (widen(y_star - y), widen(y - y_star));
            lam = lam.clamp(eq / down, eq * up);
        }
        self.lambda = lam.clamp(self.lambda_min, self.lambda_max);
    }

    /// Bumpless setpoint change: λ and the integral stay where they are; only future errors change.
    pub fn set_target(&mut self, target: f64) {
        self.target = target;
        self.prev_eps = None;
        self.converged = false;
        self.recent_lambda.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctl() -> ScuController {
        law_ctl(ScuLaw::Reference)
    }

    fn law_ctl(law: ScuLaw) -> ScuController {
        let mut c = ScuController::new(&ScuConfig {
            law,
            ..ScuConfig::default()
        });
        c.target = 0.01;
        c.ema_alpha = 1.0; // no smoothing: each test drives S directly
        c
    }

    #[test]
    fn sign_above_target_raises_lambda_below_lowers() {
        let mut c = ctl();
        c.update(0.05);
        assert!(c.lambda > 1.0);
        let mut c = ctl();
        c.update(0.001);
        assert!(c.lambda < 1.0);
    }

    #[test]
    fn deadband_holds_lambda_and_leaks_integral() {
        let mut c = ctl();
        c.integral = 0.1;
        let out = c.update(0.0105);
        assert_eq!(out.lambda, 1.0);
        assert!((c.integral - 0.1 * 0.995).abs() < 1e-12);
    }

    #[test]
    fn anti_windup_at_both_clamps() {
        let mut c = ctl();
        c.lambda = c.lambda_max;
        c.integral = 0.05;
        c.update(0.5);
        assert_eq!(c.lambda, c.lambda_max);
        assert!(
            (c.integral - 0.05 * 0.995).abs() < 1e-12,
            "integral must not grow at λ_max"
        );
        let mut c = ctl();
        c.lambda = c.lambda_min;
        c.integral = -0.05;
        c.update(0.0);
        assert_eq!(c.lambda, c.lambda_min);
        assert!(
            (c.integral + 0.05 * 0.995).abs() < 1e-12,
            "integral must not grow at λ_min"
        );
    }

    #[test]
    fn integral_and_lambda_are_clamped() {
        let mut c = ctl();
        for _ in 0..1000 {
            c.update(0.9);
        }
        assert!(c.integral <= c.i_max + 1e-12);
        assert_eq!(c.lambda, c.lambda_max);
        for _ in 0..10_000 {
            c.update(0.0);
        }
        assert!(c.integral >= -c.i_max - 1e-12);
        assert_eq!(c.lambda, c.lambda_min);
    }

    #[test]
    fn setpoint_change_is_bumpless() {
        let mut c = ctl();
        c.update(0.02);
        let (l, i) = (c.lambda, c.integral);
        c.set_target(0.03);
        assert_eq!((c.lambda, c.integral), (l, i));
    }

    #[test]
    fn disabled_measures_but_holds_lambda() {
        let mut c = ctl();
        c.enabled = false;
        let o = c.update(0.5);
        assert_eq!(o.lambda, 1.0);
        assert!(o.error > 0.0);
    }

    #[test]
    fn converges_on_a_plant_and_reports_it_once() {
        // A toy plant in the controller's design range: S = 4% / (1 + λ), S* = 1% needs λ = 3.
        // (The deadband is tightened so the 5% convergence test can be met.)
        let mut c = ScuController::new(&ScuConfig {
            target: 0.01,
            law: ScuLaw::Reference,
            deadband: Some(0.0002),
            ..ScuConfig::default()
        });
        let mut events = 0;
        for _ in 0..3000 {
            let s = 0.04 / (1.0 + c.lambda);
            if c.update(s).newly_converged {
                events += 1;
            }
        }
        let s = 0.04 / (1.0 + c.lambda);
        assert!((s - 0.01).abs() / 0.01 < 0.05, "S = {s}, λ = {}", c.lambda);
        assert!(c.converged);
        assert_eq!(events, 1);
    }

    /// A plant like training: S follows S_eq(λ) = 8%/λ with a lag of 50 control steps
    /// (weights take hundreds of optimizer steps to shrink or grow), and drifts as the
    /// model learns. Returns the largest |S − S*|/S* over the last half.
    fn lagged_plant(c: &mut ScuController, steps: usize) -> f64 {
        let mut s: f64 = 0.01;
        let mut worst: f64 = 0.0;
        for k in 0..steps {
            let drift = 1.0 + 0.5 * (k as f64 / steps as f64);
            let eq = 0.08 * drift / c.lambda;
            s = (s.ln() + (eq.ln() - s.ln()) / 50.0).exp();
            c.update(s);
            if k >= steps / 2 {
                worst = worst.max((s - c.target).abs() / c.target);
            }
        }
        worst
    }

    /// Why log-pi is the default: on the same lagging plant the reference law's two
    /// integrators (the multiplicative update and I) swing λ between its clamps.
    #[test]
    fn reference_law_limit_cycles_on_a_lagging_plant() {
        let mut c = ctl();
        c.target = 0.02;
        c.ema_alpha = 0.1;
        c.deadband = 0.0;
        let worst = lagged_plant(&mut c, 2000);
        assert!(worst > 0.5, "reference: worst deviation {worst}");
    }

    #[test]
    fn log_pi_settles_on_a_lagging_plant() {
        let mut c = law_ctl(ScuLaw::LogPi);
        c.target = 0.02;
        c.ema_alpha = 0.1;
        let worst = lagged_plant(&mut c, 2000);
        assert!(
            worst < 0.02,
            "log-pi: worst deviation {worst}, λ = {}",
            c.lambda
        );
        assert!(c.converged);
    }

    #[test]
    fn old_checkpoints_keep_the_reference_law() {
        let mut v = serde_json::to_value(ctl()).unwrap();
        let m = v.as_object_mut().unwrap();
        m.remove("law");
        m.remove("window");
        m.remove("prev_eps");
        let c: ScuController = serde_json::from_value(v).unwrap();
        assert_eq!(c.law, ScuLaw::Reference);
        assert_eq!(c.window, (0.0, 0));
    }

    #[test]
    fn log_pi_sign_clamps_and_no_windup() {
        let mut c = law_ctl(ScuLaw::LogPi);
        c.update(0.05);
        assert!(c.lambda > 1.0, "S above target raises λ");
        let mut c = law_ctl(ScuLaw::LogPi);
        c.update(0.001);
        assert!(c.lambda < 1.0, "S below target lowers λ");
        // Long saturation at λ_max, then the error flips: λ leaves the clamp at once.
        let mut c = law_ctl(ScuLaw::LogPi);
        for _ in 0..1000 {
            c.update(0.9);
        }
        assert_eq!(c.lambda, c.lambda_max);
        c.update(0.001);
        assert!(c.lambda < c.lambda_max, "no wind-up: λ = {}", c.lambda);
    }

    #[test]
    fn log_pi_setpoint_change_is_bumpless_and_deadband_holds() {
        let mut c = law_ctl(ScuLaw::LogPi);
        c.update(0.012);
        c.update(0.012);
        let l = c.lambda;
        c.set_target(0.02);
        assert_eq!(c.lambda, l);
        // The first step after the change carries only the integral term, no Kp·Δε kick.
        c.update(0.012);
        let expected = l * (c.ki * (0.012f64 / 0.02).ln()).exp();
        assert!(
            (c.lambda - expected).abs() < 1e-12,
            "{} vs {expected}",
            c.lambda
        );
        let mut c = law_ctl(ScuLaw::LogPi);
        c.deadband = 0.001;
        c.update(0.0105);
        assert_eq!(c.lambda, 1.0);
    }

    /// A synthetic plant of the adaptive law's own form: per optimizer step y = ln ParamBPT
    /// moves by lr·(a − κ·f·λ_m), λ_m the λ Adam's first moment carries (β1 = 0.9). Runs
    /// `ctl` control steps of 5 optimizer steps each and returns S at each.
    struct Toy {
        y: f64,
        m: Option<f64>,
        data: f64,
        kappa: f64,
        clip: f64,
        lr: f64,
        /// κ is multiplied by this after each control step (v̂ growing as the model learns).
        kappa_drift: f64,
    }

    impl Toy {
        fn new() -> Self {
            // S starts at 0.03%, far below every setpoint; the equilibrium λ is a/(κ·f) = 2.
            Toy {
                y: 0.001f64.ln(),
                m: None,
                data: 3.0,
                kappa: 10.0,
                clip: 1.0,
                lr: 0.01,
                kappa_drift: 1.0,
            }
        }

        fn s(&self) -> f64 {
            ScuController::s_ratio(self.data, self.y.exp())
        }

        fn run(&mut self, c: &mut ScuController, growth: f64, ctl: usize) -> Vec<f64> {
            let mut out = Vec::with_capacity(ctl);
            for _ in 0..ctl {
                for _ in 0..5 {
                    let m = match self.m {
                        Some(m) => 0.9 * m + 0.1 * c.lambda,
                        None => c.lambda,
                    };
                    self.m = Some(m);
                    c.observe_step(self.data * std::f64::consts::LN_2, self.lr, self.clip);
                    self.y += self.lr * (growth - self.kappa * self.clip * m);
                }
                let reading = PlantReading {
                    data_bpt: self.data,
                    param_bpt: self.y.exp(),
                    gain: self.kappa,
                };
                c.update_with(self.s(), Some(reading));
                out.push(self.s());
                self.kappa *= self.kappa_drift;
            }
            out
        }
    }

    fn adaptive(target: f64) -> ScuController {
        let mut c = ScuController::new(&ScuConfig {
            target,
            ..ScuConfig::default()
        })
        .with_beta1(0.9);
        assert_eq!(c.law, ScuLaw::Adaptive, "the adaptive law is the default");
        c.ema_alpha = 1.0;
        c
    }

    /// The first control step after which |S − S*|/S* stays within `band`.
    fn settle(s: &[f64], target: f64, band: f64) -> usize {
        let mut k = s.len();
        while k > 0 && ((s[k - 1] - target) / target).abs() <= band {
            k -= 1;
        }
        k
    }

    #[test]
    fn adaptive_measures_the_plant_growth_and_equilibrium() {
        let mut c = adaptive(0.02);
        let mut toy = Toy::new();
        toy.run(&mut c, 20.0, 60);
        let a = c.plant.growth.unwrap();
        assert!((a - 20.0).abs() < 0.2, "growth a = {a}, plant 20");
        assert_eq!(c.plant.gain, 10.0);
        let eq = c.plant.lambda_eq.unwrap();
        assert!((eq - 2.0).abs() < 0.05, "λ_eq = {eq}, plant 2");
        assert!(
            (c.lambda - 2.0).abs() < 0.05,
            "λ = {} at equilibrium",
            c.lambda
        );
        // Gradient clipping halves the penalty's authority: the measured equilibrium doubles.
        let mut c = adaptive(0.02);
        let mut toy = Toy {
            clip: 0.5,
            ..Toy::new()
        };
        toy.run(&mut c, 20.0, 60);
        let eq = c.plant.lambda_eq.unwrap();
        assert!((eq - 4.0).abs() < 0.1, "λ_eq with f = 0.5: {eq}");
    }

    #[test]
    fn adaptive_settles_fast_at_every_setpoint_without_overshooting_far() {
        for target in [0.005, 0.01, 0.02, 0.05] {
            let mut c = adaptive(target);
            let mut toy = Toy::new();
            let s = toy.run(&mut c, 20.0, 100);
            let k = settle(&s, target, 0.05);
            let over = s.iter().map(|&x| (x - target) / target).fold(0.0, f64::max);
            assert!(k <= 25, "S* {target}: settled after {k} control steps");
            assert!(over < 0.3, "S* {target}: overshoot {over:.3}");
            let end = (s[s.len() - 1] - target).abs() / target;
            assert!(end < 0.005, "S* {target}: {end} off at the end");
        }
    }

    /// Adapters that start far above the target (the 1B-shaped LoRA starts at 3.5 S*): λ must
    /// go far above the equilibrium to pull S down, and the span around the equilibrium widens
    /// with the gap to let it; near the target λ is back within ×3 of the equilibrium.
    #[test]
    fn adaptive_from_far_above_goes_beyond_the_equilibrium_then_settles() {
        for start in [3.5, 7.0] {
            let target = 0.01;
            let mut c = adaptive(target);
            let mut toy = Toy::new();
            toy.y = (start * target / (1.0 - start * target) * toy.data).ln();
            let mut peak: f64 = 0.0;
            let mut s = Vec::new();
            for _ in 0..100 {
                s.extend(toy.run(&mut c, 20.0, 1));
                peak = peak.max(c.lambda);
            }
            let k = settle(&s, target, 0.05);
            assert!(k <= 30, "from {start} S*: settled after {k} control steps");
            // (The equilibrium is a/(κ·f) = 2.)
            assert!(
                peak > 6.0,
                "from {start} S*: λ peaked at {peak} (≤ ×3 the equilibrium)"
            );
            assert!((c.lambda - 2.0).abs() < 0.1, "λ ends at {}", c.lambda);
        }
    }

    #[test]
    fn adaptive_rejects_a_step_in_the_growth() {
        // The model starts learning faster: the data gradient's growth doubles. The growth
        // observer measures it and λ follows to the new equilibrium.
        let mut c = adaptive(0.02);
        let mut toy = Toy::new();
        toy.run(&mut c, 20.0, 60);
        let s = toy.run(&mut c, 40.0, 60);
        let k = settle(&s, 0.02, 0.05);
        assert!(k <= 15, "settled {k} control steps after the growth step");
        assert!(
            (c.lambda - 4.0).abs() < 0.1,
            "λ = {}, new equilibrium 4",
            c.lambda
        );
    }

    /// The penalty's authority κ falls 5% per control step for 40 control steps (sevenfold
    /// over all of them): the law measures the drift and plans with κ one window on, so S
    /// stays within ±5% of S* once the trend is measured.
    #[test]
    fn adaptive_follows_a_drifting_authority() {
        let mut c = adaptive(0.02);
        let mut toy = Toy::new();
        toy.run(&mut c, 20.0, 60);
        toy.kappa_drift = 0.95;
        let s = toy.run(&mut c, 20.0, 40);
        let off = |s: &[f64]| {
            s.iter()
                .map(|&x| ((x - 0.02) / 0.02).abs())
                .fold(0.0, f64::max)
        };
        // The drift's first windows, before its trend is measured, then within ±5%.
        assert!(
            off(&s) < 0.1,
            "S {:.3} off S* as κ starts to drift",
            off(&s)
        );
        assert!(
            off(&s[5..]) < 0.05,
            "S {:.3} off S* while κ drifts",
            off(&s[5..])
        );
        let t = c.plant.gain_trend;
        assert!((t - 0.95f64.ln()).abs() < 0.01, "ln κ trend {t}");
        let eq = c.plant.lambda_eq.unwrap_or(0.0);
        let want = 20.0 / toy.kappa;
        assert!((eq / want - 1.0).abs() < 0.1, "λ_eq {eq}, plant {want}");
    }

    #[test]
    fn adaptive_setpoint_change_is_bumpless_then_settles() {
        let mut c = adaptive(0.02);
        let mut toy = Toy::new();
        toy.run(&mut c, 20.0, 60);
        let (lambda, plant) = (c.lambda, c.plant.clone());
        c.set_target(0.01);
        assert_eq!(c.lambda, lambda, "λ holds through the change");
        assert_eq!(c.plant, plant, "the plant model holds through the change");
        let s = toy.run(&mut c, 20.0, 60);
        // The first step after the change plans only `rate` of the log error: λ moves by
        // at most ×4 (the slew limit), not to a clamp.
        assert!(c.lambda < c.lambda_max);
        let k = settle(&s, 0.01, 0.05);
        assert!(k <= 20, "settled {k} control steps after the setpoint step");
        assert!((s[s.len() - 1] - 0.01).abs() / 0.01 < 0.005);
    }

    #[test]
    fn adaptive_slew_limit_and_clamps_without_windup() {
        // The first control step measures nothing yet (no growth): λ holds.
        let mut c = adaptive(0.02);
        let mut toy = Toy::new();
        toy.run(&mut c, 20.0, 1);
        assert_eq!(c.lambda, 1.0);
        // Each later step moves λ by at most ×MAX_STEP beyond the span of λ and λ_eq.
        let mut prev = c.lambda;
        for _ in 0..40 {
            toy.run(&mut c, 20.0, 1);
            let eq = c.plant.lambda_eq.unwrap().max(c.lambda_min);
            let (lo, hi) = (prev.min(eq), prev.max(eq));
            assert!(
                c.lambda >= lo / MAX_STEP - 1e-12 && c.lambda <= hi * MAX_STEP + 1e-12,
                "λ {prev} → {} with λ_eq {eq}",
                c.lambda
            );
            prev = c.lambda;
        }
        // An equilibrium far above λ_max: λ sits at the clamp ...
        let mut c = adaptive(0.02);
        c.lambda_max = 3.0;
        let mut toy = Toy::new();
        let s = toy.run(&mut c, 35.0, 40);
        assert_eq!(c.lambda, 3.0);
        assert!(s[s.len() - 1] > 0.02, "S runs away above S* at the clamp");
        // ... and once the growth falls, λ leaves the clamp as S comes back to S*: nothing
        // wound up while it was saturated, so S does not fall to where λ_min would hold it.
        // (It undershoots to 0.43·S* at the default rate 0.7, which closes 70% of the wide gap
        // the clamp left in one window; 0.83·S* at rate 0.5. A cap on the planned move per
        // window removed that undershoot but slowed the start-up settle on real training at
        // S* = 0.5% from 48 to 69–78 control steps, so there is none.)
        let s = toy.run(&mut c, 5.0, 80);
        let low = s.iter().fold(f64::MAX, |a, &b| a.min(b));
        assert!(low > 0.02 * 0.4, "S undershoots to {low} after the clamp");
        assert!(settle(&s, 0.02, 0.05) <= 40, "{:?}", &s[..40]);
        assert!((c.lambda - 0.5).abs() < 0.01, "λ = {}", c.lambda);
        // The same at λ_min (the data gradient alone holds S below S*): λ leaves the clamp as
        // soon as the growth rises.
        let mut c = adaptive(0.02);
        c.lambda_min = 0.5;
        let mut toy = Toy::new();
        toy.run(&mut c, 2.0, 80);
        assert_eq!(c.lambda, 0.5);
        let s = toy.run(&mut c, 20.0, 80);
        let high = s.iter().fold(0.0, |a: f64, &b| a.max(b));
        assert!(high < 0.02 * 1.2, "S overshoots to {high} after the clamp");
        assert!((c.lambda - 2.0).abs() < 0.05, "λ = {}", c.lambda);
    }

    #[test]
    fn adaptive_holds_without_a_reading_or_when_disabled() {
        let mut c = adaptive(0.02);
        let mut toy = Toy::new();
        toy.run(&mut c, 20.0, 10);
        let l = c.lambda;
        c.update(0.5);
        assert_eq!(c.lambda, l, "no plant reading: λ holds");
        let mut c = adaptive(0.02);
        c.enabled = false;
        toy = Toy::new();
        toy.run(&mut c, 20.0, 10);
        assert_eq!(c.lambda, 1.0, "control off: λ stays at lambda_init");
        // Non-finite or non-positive readings are ignored.
        let mut c = adaptive(0.02);
        let mut toy = Toy::new();
        toy.run(&mut c, 20.0, 10);
        let (l, p) = (c.lambda, c.plant.y_prev);
        for bad in [f64::NAN, 0.0, -1.0, f64::INFINITY] {
            c.update_with(
                0.02,
                Some(PlantReading {
                    data_bpt: 3.0,
                    param_bpt: bad,
                    gain: 10.0,
                }),
            );
        }
        assert_eq!((c.lambda, c.plant.y_prev), (l, p));
    }

    /// The published law is still selectable and computes what it did: λ ← λ·exp(Kp·e + I)
    /// with its own defaults (Kp 0.8, Ki 0.15, deadband 0.002), and it ignores a plant reading.
    #[test]
    fn reference_law_is_selectable_and_unchanged() {
        let cfg = ScuConfig {
            law: ScuLaw::Reference,
            ..ScuConfig::default()
        };
        assert_eq!(cfg.gains(), (0.8, 0.15, 0.002));
        let mut c = ScuController::new(&cfg);
        c.target = 0.01;
        c.ema_alpha = 1.0;
        let reading = PlantReading {
            data_bpt: 3.0,
            param_bpt: 0.1,
            gain: 10.0,
        };
        let o = c.update_with(0.05, Some(reading));
        let e: f64 = 0.05 - 0.01;
        let i = 0.15 * e;
        assert!((o.integral - i).abs() < 1e-15);
        assert!((o.lambda - (0.8 * e + i).exp()).abs() < 1e-12);
        let o = c.update_with(0.03, Some(reading));
        let i2 = (i * 0.995 + 0.15 * 0.02).min(0.2);
        let l2 = (0.8 * e + i).exp() * (0.8 * 0.02 + i2).exp();
        assert!((o.integral - i2).abs() < 1e-15 && (o.lambda - l2).abs() < 1e-12);
        assert_eq!(
            c.plant,
            Plant::default(),
            "the reference law keeps no plant model"
        );
        // A config naming it selects it.
        let loaded = crate::config::load(None, &["scu.law=\"reference\"".to_string()])
            .map(|l| l.config.scu.law);
        assert_eq!(loaded.ok(), Some(ScuLaw::Reference));
    }
}
