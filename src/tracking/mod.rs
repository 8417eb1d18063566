//! Results where users already look: TensorBoard event files (`RUN_DIR/tb/`, on unless
//! `monitor.tensorboard = false`) and an MLflow file store (`monitor.mlflow = "DIR"`), written
//! from the front end's copy of the event stream and the telemetry on a thread of their own.
//! The engine never waits for them; a logger that fails warns once and the run goes on.

pub mod mlflow;
pub mod proto;
pub mod scalars;
pub mod tensorboard;
pub mod tfrecord;
mod writer;

use crate::advisor::MonitorUpdate;
use crate::config::Config;
use crate::engine::events::{self, Event, EventRx};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Receiver};
use std::thread::JoinHandle;

pub use proto::HParam;

/// What to write and where.
#[derive(Clone, Debug)]
pub struct TrackingOptions {
    /// The run dir (its name is the run's name in MLflow; its files become artifacts).
    pub run_dir: PathBuf,
    /// Where TensorBoard event files go (None: no TensorBoard).
    pub tensorboard: Option<PathBuf>,
    /// The MLflow file store (None: no MLflow).
    pub mlflow: Option<PathBuf>,
    /// The MLflow experiment (None: "Default"; a sweep's runs: the sweep's).
    pub mlflow_experiment: Option<String>,
    /// The resolved config as TOML (a text summary, an MLflow artifact).
    pub config_toml: String,
    /// Hyperparameters: the config's scalar keys, flattened as `section.key`.
    pub hparams: Vec<(String, HParam)>,
}

impl TrackingOptions {
    /// From the config; None when nothing is to be written.
    pub fn from_config(cfg: &Config, run_dir: &Path) -> Option<Self> {
        let tensorboard = cfg.monitor.tensorboard.then(|| run_dir.join("tb"));
        let mlflow = cfg
            .monitor
            .mlflow
            .as_deref()
            .filter(|s| !s.is_empty())
            .map(PathBuf::from);
        if tensorboard.is_none() && mlflow.is_none() {
            return None;
        }
        Some(Self {
            run_dir: run_dir.to_path_buf(),
            tensorboard,
            mlflow,
            mlflow_experiment: cfg.monitor.mlflow_experiment.clone(),
            config_toml: toml::to_string(cfg).unwrap_or_default(),
            hparams: hparams_of(cfg),
        })
    }
}

/// The config's scalar leaves as hyperparameters (`optim.lr`, `model.d_model`, ...); lists and
/// empty values are left out.
pub fn hparams_of(cfg: &Config) -> Vec<(String, HParam)> {
    fn walk(prefix: &str, v: &serde_json::Value, out: &mut Vec<(String, HParam)>) {
        use serde_json::Value;
        match v {
            Value::Object(m) => {
                for (k, x) in m {
                    let key = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    walk(&key, x, out);
                }
            }
            Value::Number(n) => {
                if let Some(x) = n.as_f64() {
                    out.push((prefix.to_string(), HParam::Number(x)));
                }
            }
            Value::String(s) if !s.is_empty() => {
                out.push((prefix.to_string(), HParam::Text(s.clone())))
            }
            Value::Bool(b) => out.push((prefix.to_string(), HParam::Bool(*b))),
            _ => {}
        }
    }
    let mut out = Vec::new();
    if let Ok(v) = serde_json::to_value(cfg) {
        walk("", &v, &mut out);
    }
    out
}

/// Messages to the writer thread.
pub(crate) enum Msg {
    Event(Event),
    Update(MonitorUpdate),
    /// The engine's event stream ended: finish and stop.
    Closed,
}

/// The writer thread; wait for it after the engine has ended so the files are complete.
pub struct TrackingGuard {
    handle: Option<JoinHandle<Option<PathBuf>>>,
}

impl TrackingGuard {
    /// Wait until everything is written (the engine's event stream must have ended); the
    /// MLflow run's artifacts dir, where the run has one (for [`log_plots`]).
    pub fn wait(mut self) -> Option<PathBuf> {
        self.handle.take().and_then(|h| h.join().ok().flatten())
    }
}

/// The run's plots (drawn after the engine has ended) as artifacts of its MLflow run at
/// `artifacts`; a failure warns and is otherwise ignored.
pub fn log_plots(artifacts: &Path, run_dir: &Path) {
    let plots = run_dir.join(crate::report::PLOTS_DIR);
    if let Err(e) = mlflow::log_plots(artifacts, &plots) {
        crate::errln!(
            "cockpit: warning: mlflow: copying the plots into {}: {e}",
            artifacts.display()
        );
    }
}

/// Put the loggers on the front end's streams: the returned receivers deliver the same
/// events and telemetry, and a thread writes the logs. Nothing here blocks the engine: the
/// copies go through unbounded channels, and the front end's new event channel drops `Step`
/// events when it falls behind, as the engine's does.
pub fn tee(
    events: EventRx,
    updates: Option<Receiver<MonitorUpdate>>,
    opts: TrackingOptions,
) -> (
    EventRx,
    Option<Receiver<MonitorUpdate>>,
    Option<TrackingGuard>,
) {
    let (to_writer, from_tee) = mpsc::channel::<Msg>();
    let handle = match std::thread::Builder::new()
        .name("cockpit-tracking".into())
        .spawn(move || writer::run(from_tee, opts))
    {
        Ok(h) => h,
        Err(e) => {
            tracing::warn!("tensorboard/mlflow logging off: {e}");
            return (events, updates, None);
        }
    };
    let (tx, rx) = events::channel(256);
    let w = to_writer.clone();
    let spawned = std::thread::Builder::new()
        .name("cockpit-tracking-tee".into())
        .spawn(move || {
            while let Some(ev) = events.recv() {
                let _ = w.send(Msg::Event(ev.clone()));
                if !tx.send(ev) {
                    break;
                }
            }
            // drain what the front end no longer takes, so the logs are complete
            while let Some(ev) = events.recv() {
                let _ = w.send(Msg::Event(ev));
            }
            let _ = w.send(Msg::Closed);
        });
    if let Err(e) = spawned {
        // as the advisor's tee: without the thread the front end sees the engine gone
        tracing::warn!("tensorboard/mlflow event thread: {e}");
    }
    let events = rx;
    let updates = updates.map(|src| {
        let (tx, rx) = mpsc::channel();
        let w = to_writer;
        let spawned = std::thread::Builder::new()
            .name("cockpit-tracking-telemetry".into())
            .spawn(move || {
                while let Ok(u) = src.recv() {
                    let _ = w.send(Msg::Update(u.clone()));
                    if tx.send(u).is_err() {
                        break;
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::warn!("tensorboard/mlflow telemetry off: {e}");
        }
        rx
    });
    (
        events,
        updates,
        Some(TrackingGuard {
            handle: Some(handle),
        }),
    )
}
