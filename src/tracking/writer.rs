//! The logging thread: events and telemetry in, TensorBoard and MLflow records out.

use super::mlflow::{MlflowRun, RunStatus};
use super::proto::{self, HParam, SessionStatus};
use super::tensorboard::{now_secs, EventFile};
use super::{scalars, Msg, TrackingOptions};
use crate::engine::events::{Event, FinishReason, RunInfo};
use std::io;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

/// Files are flushed at least this often (and at every checkpoint and at the end), so a
/// killed run's logs lag by at most this much.
const FLUSH_EVERY: Duration = Duration::from_secs(5);

struct Sinks {
    tb: Option<EventFile>,
    ml: Option<MlflowRun>,
    run: Option<RunInfo>,
    /// The last step seen: telemetry samples are logged at it.
    step: u64,
    opts: TrackingOptions,
}

/// Run a sink's write; on the first failure warn once and turn the sink off.
fn guard<T>(sink: &mut Option<T>, what: &str, f: impl FnOnce(&mut T) -> io::Result<()>) {
    if let Some(s) = sink.as_mut() {
        if let Err(e) = f(s) {
            tracing::warn!("{what}: {e}; no more {what} logs for this run");
            crate::errln!("cockpit: warning: {what}: {e}; training goes on without it");
            *sink = None;
        }
    }
}

fn md_escape(s: &str) -> String {
    s.replace('|', "\\|")
}

fn header_markdown(r: &RunInfo) -> String {
    let rows = [
        ("run", r.run_name.clone()),
        ("run dir", r.run_dir.clone()),
        ("device", r.device.clone()),
        ("dtype", format!("{} ({})", r.dtype, r.dtype_reason)),
        (
            "parameters",
            format!("{} ({} trainable)", r.params_total, r.params_trainable),
        ),
        ("steps", format!("{} -> {}", r.start_step, r.max_steps)),
        (
            "batch",
            format!(
                "{} x {} accum x {} tokens",
                r.micro_batch, r.accum, r.seq_len
            ),
        ),
        ("vocab", r.vocab_size.to_string()),
        ("summary", r.summary.clone()),
    ];
    let mut s = String::from("| | |\n|---|---|\n");
    for (k, v) in rows {
        s.push_str(&format!("| {k} | {} |\n", md_escape(&v)));
    }
    s
}

fn code_block(text: &str) -> String {
    // Markdown: an indented block keeps the TOML as it is
    text.lines().map(|l| format!("    {l}\n")).collect()
}

impl Sinks {
    fn open(opts: TrackingOptions) -> Self {
        let mut tb = None;
        if let Some(dir) = &opts.tensorboard {
            match EventFile::create(dir) {
                Ok(f) => tb = Some(f),
                Err(e) => crate::errln!(
                    "cockpit: warning: tensorboard: cannot write {}: {e}; training goes on without it",
                    dir.display()
                ),
            }
        }
        let mut ml = None;
        if let Some(root) = &opts.mlflow {
            let name = opts
                .run_dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| "cockpit".into());
            match MlflowRun::create(root, &name, opts.mlflow_experiment.as_deref()) {
                Ok(r) => ml = Some(r),
                Err(e) => crate::errln!(
                    "cockpit: warning: mlflow: cannot write {}: {e}; training goes on without it",
                    root.display()
                ),
            }
        }
        Self {
            tb,
            ml,
            run: None,
            step: 0,
            opts,
        }
    }

    fn scalars(&mut self, step: u64, wall: f64, values: &[(String, f64)]) {
        if values.is_empty() {
            return;
        }
        guard(&mut self.tb, "tensorboard", |tb| {
            let msgs = values
                .iter()
                .map(|(k, v)| proto::scalar(k, *v as f32))
                .collect();
            tb.summary(wall, step, msgs)
        });
        let ts = (wall * 1000.0) as u64;
        guard(&mut self.ml, "mlflow", |ml| {
            values
                .iter()
                .try_for_each(|(k, v)| ml.metric(k, *v, step, ts))
        });
    }

    fn flush(&mut self) {
        guard(&mut self.tb, "tensorboard", |tb| tb.flush());
        guard(&mut self.ml, "mlflow", |ml| ml.flush());
    }

    fn started(&mut self, r: &RunInfo) {
        let wall = now_secs();
        let step = r.start_step;
        let header = header_markdown(r);
        let config = code_block(&self.opts.config_toml);
        let mut hp = self.opts.hparams.clone();
        hp.extend([
            (
                "run.dtype_resolved".to_string(),
                HParam::Text(r.dtype.clone()),
            ),
            (
                "model.params_total".to_string(),
                HParam::Number(r.params_total as f64),
            ),
            (
                "model.params_trainable".to_string(),
                HParam::Number(r.params_trainable as f64),
            ),
        ]);
        // one session group per run (a resumed run's files are one row in the HParams table;
        // a sweep's runs are rows of their own)
        let group = r.run_dir.clone();
        guard(&mut self.tb, "tensorboard", |tb| {
            tb.summary(
                wall,
                step,
                vec![
                    proto::text("run/header", &header),
                    proto::text("run/config", &config),
                    proto::session_start(&hp, &group, wall),
                ],
            )?;
            tb.flush()
        });
        let config_toml = self.opts.config_toml.clone();
        let run_dir = self.opts.run_dir.clone();
        guard(&mut self.ml, "mlflow", |ml| {
            for (k, v) in &hp {
                let text = match v {
                    HParam::Number(x) => x.to_string(),
                    HParam::Text(s) => s.clone(),
                    HParam::Bool(b) => b.to_string(),
                };
                ml.param(k, &text)?;
            }
            ml.tag("cockpit.run_dir", &run_dir.display().to_string())?;
            ml.tag("cockpit.device", &r.device)?;
            ml.tag("mlflow.note.content", &header)?;
            std::fs::write(ml.artifacts().join("config.toml"), &config_toml)
        });
    }

    fn finished(&mut self, step: u64, reason: FinishReason, message: &str) {
        let wall = now_secs();
        let status = if reason == FinishReason::Failed {
            SessionStatus::Failure
        } else {
            SessionStatus::Success
        };
        let text = format!("{reason:?} at step {step}: {}", md_escape(message));
        guard(&mut self.tb, "tensorboard", |tb| {
            tb.summary(
                wall,
                step,
                vec![
                    proto::text("run/finished", &text),
                    proto::session_end(status, wall),
                ],
            )?;
            tb.flush()
        });
        let run_dir = self.opts.run_dir.clone();
        guard(&mut self.ml, "mlflow", |ml| {
            for f in ["metrics.jsonl", "events.log", "telemetry.jsonl"] {
                ml.artifact(&run_dir.join(f))?;
            }
            ml.tag("cockpit.finish", &format!("{reason:?}: {message}"))?;
            ml.finish(match reason {
                FinishReason::Completed | FinishReason::Stopped => RunStatus::Finished,
                FinishReason::Interrupted => RunStatus::Killed,
                FinishReason::Failed => RunStatus::Failed,
            })
        });
    }

    fn event(&mut self, ev: &Event) {
        let step = ev.step();
        // steps never go back within one file (TensorBoard would drop what came after)
        self.step = self.step.max(step);
        let values = scalars::of_event(ev, self.run.as_ref());
        self.scalars(step, now_secs(), &values);
        match ev {
            Event::RunStarted(r) => {
                self.run = Some(r.clone());
                self.started(r);
            }
            Event::CheckpointSaved { path, .. } => {
                let step = ev.step();
                guard(&mut self.ml, "mlflow", |ml| {
                    ml.tag("cockpit.checkpoint.latest", path)?;
                    ml.checkpoint(step, path)
                });
                self.flush();
            }
            Event::Finished {
                step,
                reason,
                message,
                ..
            } => self.finished(*step, *reason, message),
            _ => {}
        }
    }

    fn closed(&mut self) {
        self.flush();
        if self.ml.is_some() && self.run.is_some() {
            // no Finished event: the engine went away
            guard(&mut self.ml, "mlflow", |ml| ml.finish(RunStatus::Failed));
        }
    }
}

/// The thread's body: write until the engine's event stream ends; the MLflow run's artifacts
/// dir, where it still writes one.
pub(super) fn run(rx: Receiver<Msg>, opts: TrackingOptions) -> Option<std::path::PathBuf> {
    let mut sinks = Sinks::open(opts);
    let mut finished = false;
    let mut last_flush = Instant::now();
    loop {
        match rx.recv_timeout(FLUSH_EVERY) {
            Ok(Msg::Event(ev)) => {
                finished |= matches!(ev, Event::Finished { .. });
                sinks.event(&ev);
            }
            Ok(Msg::Update(u)) => {
                if !finished {
                    let wall = u.snapshot.timestamp_ms as f64 / 1000.0;
                    let values = scalars::of_update(&u);
                    let step = sinks.step;
                    sinks.scalars(step, wall, &values);
                }
            }
            Ok(Msg::Closed) | Err(RecvTimeoutError::Disconnected) => {
                if !finished {
                    sinks.closed();
                } else {
                    sinks.flush();
                }
                return sinks.ml.as_ref().map(MlflowRun::artifacts);
            }
            Err(RecvTimeoutError::Timeout) => {}
        }
        if last_flush.elapsed() >= FLUSH_EVERY {
            sinks.flush();
            last_flush = Instant::now();
        }
    }
}
