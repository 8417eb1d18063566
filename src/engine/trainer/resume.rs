//! Resuming: the shape hash a checkpoint must match, the config keys that may change, and
//! loading a checkpoint's state into the trainer.

use super::Trainer;
use crate::config::Config;
use crate::engine::model::ModelSpec;
use crate::engine::scu::ScuController;
use crate::engine::{checkpoint, EngineError};
use sha2::{Digest, Sha256};
use std::path::Path;

/// The hash of everything that fixes tensor shapes and the data stream.
pub fn shape_hash(c: &Config) -> String {
    let mut h = Sha256::new();
    // (Recompute changes what the step keeps, not the model: left out.)
    let model = crate::config::ModelConfig {
        recompute: crate::config::Recompute::None,
        ..c.model.clone()
    };
    h.update(serde_json::to_vec(&model).unwrap_or_default());
    h.update(
        serde_json::to_vec(&(
            &c.data.source,
            &c.data.train,
            &c.data.tokenizer,
            c.data.builtin_vocab,
            c.data.builtin_order,
        ))
        .unwrap_or_default(),
    );
    h.update(serde_json::to_vec(&(&c.lora.enabled, c.lora.r, &c.lora.targets)).unwrap_or_default());
    crate::util::hex(&h.finalize())[..16].to_string()
}

impl Trainer {
    /// Load a checkpoint into the trainer. `resume`: a user resume (check and report config
    /// changes, honour a changed micro-batch); otherwise a fault-recovery restore.
    pub(super) fn restore(&mut self, spec: &Path, resume: bool) -> Result<(), EngineError> {
        self.weights_copied = false;
        let dir = checkpoint::resolve(spec)?;
        let l = checkpoint::load(&dir, &self.device)?;
        let mismatch = |message: String| {
            EngineError::Checkpoint(checkpoint::CheckpointError::Mismatch {
                path: dir.display().to_string(),
                message,
            })
        };
        let now = serde_json::to_value(&self.cfg).unwrap_or_default();
        let changes = config_diff(&l.state.config, &now);
        // The data stream's keys, and the model's resume key (activation recompute, kernels,
        // dropout may change) against the checkpoint config's.
        let mut refused: Vec<String> = changes.iter().filter(|c| is_data_key(c)).cloned().collect();
        match serde_json::from_value::<Config>(l.state.config.clone()) {
            Ok(old) => {
                let vocab = match old.model.vocab_size {
                    0 => self.model.spec.vocab_size,
                    v => v,
                };
                let before = ModelSpec::from_config(&old, vocab).resume_key();
                refused.extend(self.model.spec.resume_key().differences(&before));
            }
            // (A config this version cannot read: the stored hash decides.)
            Err(_) if l.state.shape_hash != self.shape_hash => {
                refused.push("model or data".into());
            }
            Err(_) => {}
        }
        if !refused.is_empty() {
            let list = refused.join(", ");
            return Err(mismatch(format!(
                "cannot resume: shape-changing config keys differ from the checkpoint's ({}); resume with the original [model], [data] source and [lora] settings",
                list
            )));
        }
        if resume && l.state.step > self.cfg.run.max_steps {
            return Err(mismatch(format!(
                "the checkpoint is at step {}, past run.max_steps = {}: resume with a larger --max-steps (or run.max_steps)",
                l.state.step, self.cfg.run.max_steps
            )));
        }
        if resume && !changes.is_empty() {
            self.resume_notes = changes;
        }
        self.model.load_named(&l.model, false).map_err(mismatch)?;
        for slot in &mut self.opt.slots {
            let get = |suffix: &str| l.optim.get(&format!("{}.{suffix}", slot.name)).cloned();
            match (get("m"), get("v")) {
                (Some(m), Some(v))
                    if m.dims() == slot.var.dims() && v.dims() == slot.var.dims() =>
                {
                    slot.m = m;
                    slot.v = v;
                }
                _ => {
                    return Err(mismatch(format!(
                        "optimizer state for {} is missing or has another shape",
                        slot.name
                    )))
                }
            }
        }
        // ZeRO-1: this rank keeps its range of the moments just loaded (and every weight
        // is whole again).
        self.parallel.absorb(&mut self.opt)?;
        let s = l.state;
        self.opt.t = s.optim_t;
        self.step = s.step;
        self.tokens = s.tokens;
        self.elapsed_before = s.elapsed_s;
        self.scaler = s.scaler;
        // Keep the controller's state (λ, Ŝ, window, a setpoint changed live) but take gains
        // and limits from the (possibly edited) config — unless the checkpoint was written
        // by another law (a checkpoint from before `scu.law`): then its own gains go with it.
        let mut scu = s.scu;
        let fresh = ScuController::new(&self.cfg.scu).with_beta1(self.cfg.optim.beta1);
        if scu.law == fresh.law {
            scu.rate = fresh.rate;
            scu.plant.beta1 = fresh.plant.beta1;
            scu.kp = fresh.kp;
            scu.ki = fresh.ki;
            scu.deadband = fresh.deadband;
            scu.ema_alpha = fresh.ema_alpha;
            scu.leak = fresh.leak;
            scu.i_max = fresh.i_max;
            scu.lambda_min = fresh.lambda_min;
            scu.lambda_max = fresh.lambda_max;
            scu.enabled = fresh.enabled;
            if scu.enabled {
                scu.lambda = scu.lambda.clamp(scu.lambda_min, scu.lambda_max);
            }
        }
        self.scu = scu;
        self.best_val = s.best_val_loss;
        self.lr_scale = s.lr_scale;
        self.skipped_steps = s.skipped_steps;
        if resume {
            self.restores = s.restores;
            // A micro-batch changed live carries over unless the config now asks for another.
            let old_cfg_mb = s
                .config
                .pointer("/optim/micro_batch")
                .and_then(|v| v.as_u64());
            let old_cfg_accum = s.config.pointer("/optim/accum").and_then(|v| v.as_u64());
            self.accum = self.cfg.optim.accum;
            if old_cfg_mb.is_none_or(|mb| mb as usize == self.cfg.optim.micro_batch) {
                self.micro_batch = s.micro_batch;
                // (An out-of-memory split kept the step's sequences: it carries over too.)
                if old_cfg_accum.is_some_and(|a| a as usize == self.cfg.optim.accum) && s.accum > 0
                {
                    self.accum = s.accum;
                }
            }
        } else {
            self.micro_batch = s.micro_batch;
        }
        self.loader.seek(s.cursor);
        self.loader.set_batch_size(self.micro_batch);
        Ok(())
    }
}

/// Whether a changed config key changes the data stream (the model's keys are the spec's
/// [`ModelSpec::resume_key`]).
fn is_data_key(key: &str) -> bool {
    let k = key.split(' ').next().unwrap_or(key);
    ["data.source", "data.train", "data.tokenizer", "data.val"].contains(&k)
        || k.starts_with("data.builtin_")
}

/// `key old → new` for every leaf that differs between two configs (as JSON).
fn config_diff(old: &serde_json::Value, new: &serde_json::Value) -> Vec<String> {
    fn walk(prefix: &str, a: &serde_json::Value, b: &serde_json::Value, out: &mut Vec<String>) {
        match (a, b) {
            (serde_json::Value::Object(x), serde_json::Value::Object(y)) => {
                let mut keys: Vec<&String> = x.keys().chain(y.keys()).collect();
                keys.sort();
                keys.dedup();
                for k in keys {
                    let p = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    let null = serde_json::Value::Null;
                    walk(
                        &p,
                        x.get(k).unwrap_or(&null),
                        y.get(k).unwrap_or(&null),
                        out,
                    );
                }
            }
            _ if a != b => out.push(format!("{prefix} {a} → {b}")),
            _ => {}
        }
    }
    let mut out = Vec::new();
    if old.is_null() {
        return out;
    }
    walk("", old, new, &mut out);
    out
}
