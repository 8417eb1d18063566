//! SCU control: the controller's reading of the step (data and parameter bits per token), λ's
//! update, and the SCU files (scu.csv, scu_plant.csv, scu_metrics.json, scu_history.json).

use super::recorder::Recorder;
use super::{Trainer, LN2};
use crate::config::ScuLaw;
use crate::engine::events::{Event, ScuStats};
use crate::engine::scu::{PlantReading, ScuController};
use crate::engine::EngineError;
use std::io::Write;

impl Trainer {
    /// The SCU penalty's coefficient 1/(2σ²N) (σ: `scu.prior_sigma`, N: the tokens of an
    /// epoch): λ·Σw²·coef is the penalty in the same per-token units (nats) as the CE loss,
    /// and Σw²·coef/ln 2 the parameters' bits per token.
    pub(super) fn penalty_coef(&self) -> f64 {
        self.model.spec.scu_coefficient(self.tokens_per_epoch)
    }

    /// SCU's controller runs after this step (it reads the step's Σw² then).
    pub(super) fn control_due(&self) -> bool {
        (self.step + 1).is_multiple_of(self.cfg.scu.control_every)
    }

    pub(super) fn write_scu_files(&self) -> Result<(), EngineError> {
        self.write_json("scu_metrics.json", &self.scu_rows)?;
        let history = serde_json::json!({
            "steps": self.scu_rows.iter().map(|r| r.step).collect::<Vec<_>>(),
            "s_ratio_history": self.scu_rows.iter().map(|r| r.s_ratio).collect::<Vec<_>>(),
            "lambda_history": self.scu_rows.iter().map(|r| r.lambda).collect::<Vec<_>>(),
            "target_history": self.scu_rows.iter().map(|r| r.target).collect::<Vec<_>>(),
        });
        self.write_json("scu_history.json", &history)
    }

    /// [`AdamW::penalty_stats`](crate::engine::optim::AdamW::penalty_stats), with a sharded
    /// optimizer's second moments summed over the ranks (a collective then: every rank runs the
    /// controller at the same steps).
    pub(super) fn penalty_stats(&mut self) -> Result<(f64, f64), EngineError> {
        self.parallel.penalty_stats(&self.opt, &self.reg_slots)
    }

    pub(super) fn control(
        &mut self,
        ce_mean: f64,
        sumsq: f64,
        out: &mut Recorder,
    ) -> Result<(), EngineError> {
        let c = &self.cfg.scu.clone();
        let coef = self.penalty_coef();
        let data_bpt = ce_mean / LN2;
        let param_bpt = sumsq * coef / LN2;
        let s = ScuController::s_ratio(data_bpt, param_bpt);
        let lambda_used = self.scu.lambda;
        // The adaptive law's plant reading: the weights after this step's update, and the
        // penalty's authority over ln Σw² through Adam's second moments.
        let reading = if c.enabled && c.law == ScuLaw::Adaptive {
            let (now, weighted) = self.penalty_stats()?;
            (now > 0.0).then(|| PlantReading {
                data_bpt,
                param_bpt: now * coef / LN2,
                gain: 4.0 * coef * weighted / now,
            })
        } else {
            None
        };
        let o = self.scu.update_with(s, reading);
        let reg_loss = lambda_used * sumsq * coef;
        let row = ScuStats {
            step: self.step,
            ce_loss: ce_mean,
            reg_loss,
            total_loss: ce_mean + reg_loss,
            data_bpt,
            param_bpt,
            s_ratio: s,
            s_hat: o.s_hat,
            lambda: o.lambda,
            integral: o.integral,
            error: o.error,
            target: self.scu.target,
            control: c.enabled,
        };
        self.summary.last_s = Some(s);
        self.append_scu_csv(&row);
        self.scu_rows.push(row.clone());
        out.emit(Event::Scu(row));
        if o.newly_converged {
            out.emit(Event::ScuConverged {
                step: self.step,
                s_ratio: s,
                lambda: o.lambda,
                target: self.scu.target,
            });
        }
        if let Some(r) = reading {
            self.append_plant_csv(&r);
        }
        Ok(())
    }

    /// The adaptive law's plant measurements, one line per control step (scu_plant.csv).
    pub(super) fn append_plant_csv(&self, r: &PlantReading) {
        let path = self.out_dir.join("scu_plant.csv");
        let new = !path.exists();
        let p = &self.scu.plant;
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
        {
            use std::io::Write;
            if new {
                let _ = writeln!(
                    f,
                    "step,param_bpt_now,gain,growth,lambda_eq,lambda_m,lambda,lr"
                );
            }
            let opt = |v: Option<f64>| v.map_or(String::new(), |v| v.to_string());
            let _ = writeln!(
                f,
                "{},{},{},{},{},{},{},{}",
                self.step,
                r.param_bpt,
                r.gain,
                opt(p.growth),
                opt(p.lambda_eq),
                opt(p.lambda_m),
                self.scu.lambda,
                p.last_lr
            );
        }
    }

    pub(super) fn append_scu_csv(&self, r: &ScuStats) {
        let path = self.out_dir.join("scu.csv");
        let new = !path.exists();
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
        {
            if new {
                let _ = writeln!(f, "step,ce_loss,reg_loss,total_loss,data_bpt,param_bpt,s_ratio,s_hat,lambda,integral,error,target");
            }
            let _ = writeln!(
                f,
                "{},{},{},{},{},{},{},{},{},{},{},{}",
                r.step,
                r.ce_loss,
                r.reg_loss,
                r.total_loss,
                r.data_bpt,
                r.param_bpt,
                r.s_ratio,
                r.s_hat,
                r.lambda,
                r.integral,
                r.error,
                r.target
            );
        }
    }
}
