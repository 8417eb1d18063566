//! An MLflow file store (`mlflow ui --backend-store-uri DIR`): experiment `0` ("Default")
//! with one run per process start:
//! `DIR/0/meta.yaml`, `DIR/0/<run_id>/{meta.yaml, params/, metrics/, tags/, artifacts/}`.
//! Metric files hold lines `timestamp_ms value step`.

use std::collections::HashMap;
use std::fs::{self, File};
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

const EXPERIMENT_ID: &str = "0";

/// MLflow run status codes (`RunStatus`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RunStatus {
    Running = 1,
    Finished = 3,
    Failed = 4,
    Killed = 5,
}

pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn file_uri(p: &Path) -> String {
    format!("file://{}", p.display())
}

/// A YAML scalar in single quotes (MLflow reads these files with a YAML parser).
fn quoted(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''").replace(['\n', '\r'], " "))
}

/// A metric, param or tag name MLflow accepts as a file name: `/` and odd characters become `.`
/// / `_` so every name is one file.
pub fn key(name: &str) -> String {
    name.chars()
        .map(|c| match c {
            '/' => '.',
            c if c.is_ascii_alphanumeric() || "_-. ".contains(c) => c,
            _ => '_',
        })
        .collect()
}

pub struct MlflowRun {
    run_dir: PathBuf,
    run_id: String,
    run_name: String,
    start_ms: u64,
    metrics: HashMap<String, BufWriter<File>>,
}

impl MlflowRun {
    /// Create the experiment (when missing) and a new run named `run_name` under `root`.
    pub fn create(root: &Path, run_name: &str) -> io::Result<Self> {
        fs::create_dir_all(root)?;
        let root = fs::canonicalize(root)?;
        let exp = root.join(EXPERIMENT_ID);
        fs::create_dir_all(&exp)?;
        let now = now_ms();
        let exp_meta = exp.join("meta.yaml");
        if !exp_meta.exists() {
            let text = format!(
                "artifact_location: {}\ncreation_time: {now}\nexperiment_id: '{EXPERIMENT_ID}'\n\
                 last_update_time: {now}\nlifecycle_stage: active\nname: Default\n",
                quoted(&file_uri(&exp))
            );
            fs::write(&exp_meta, text)?;
        }
        let run_id = format!("{:032x}", rand::random::<u128>());
        let run_dir = exp.join(&run_id);
        for sub in ["params", "metrics", "tags", "artifacts"] {
            fs::create_dir_all(run_dir.join(sub))?;
        }
        let me = Self {
            run_dir,
            run_id,
            run_name: run_name.to_string(),
            start_ms: now,
            metrics: HashMap::new(),
        };
        me.write_meta(RunStatus::Running, None)?;
        me.tag("mlflow.runName", run_name)?;
        me.tag("mlflow.source.name", "cockpit")?;
        Ok(me)
    }

    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    pub fn artifacts(&self) -> PathBuf {
        self.run_dir.join("artifacts")
    }

    fn write_meta(&self, status: RunStatus, end_ms: Option<u64>) -> io::Result<()> {
        let user = std::env::var("USER").unwrap_or_else(|_| "cockpit".into());
        let end = end_ms.map_or("null".to_string(), |t| t.to_string());
        let text = format!(
            "artifact_uri: {}\nend_time: {end}\nentry_point_name: ''\nexperiment_id: '{EXPERIMENT_ID}'\n\
             lifecycle_stage: active\nrun_id: {id}\nrun_name: {}\nrun_uuid: {id}\nsource_name: ''\n\
             source_type: 4\nsource_version: ''\nstart_time: {}\nstatus: {}\ntags: []\nuser_id: {}\n",
            quoted(&file_uri(&self.artifacts())),
            quoted(&self.run_name),
            self.start_ms,
            status as u8,
            quoted(&user),
            id = self.run_id,
        );
        fs::write(self.run_dir.join("meta.yaml"), text)
    }

    pub fn tag(&self, name: &str, value: &str) -> io::Result<()> {
        fs::write(self.run_dir.join("tags").join(key(name)), value)
    }

    pub fn param(&self, name: &str, value: &str) -> io::Result<()> {
        // MLflow caps a param value at 6000 characters
        let v: String = value.chars().take(6000).collect();
        fs::write(self.run_dir.join("params").join(key(name)), v)
    }

    /// One metric point; non-finite values are skipped (MLflow's file store cannot hold them
    /// in every version).
    pub fn metric(&mut self, name: &str, value: f64, step: u64, ts_ms: u64) -> io::Result<()> {
        if !value.is_finite() {
            return Ok(());
        }
        let k = key(name);
        let w = match self.metrics.get_mut(&k) {
            Some(w) => w,
            None => {
                let f = File::options()
                    .create(true)
                    .append(true)
                    .open(self.run_dir.join("metrics").join(&k))?;
                self.metrics.entry(k).or_insert(BufWriter::new(f))
            }
        };
        writeln!(w, "{ts_ms} {value} {step}")
    }

    /// Copy a file into the run's artifacts (missing files are skipped).
    pub fn artifact(&self, src: &Path) -> io::Result<()> {
        let Some(name) = src.file_name() else {
            return Ok(());
        };
        if src.is_file() {
            fs::copy(src, self.artifacts().join(name))?;
        }
        Ok(())
    }

    pub fn flush(&mut self) -> io::Result<()> {
        for w in self.metrics.values_mut() {
            w.flush()?;
        }
        Ok(())
    }

    pub fn finish(&mut self, status: RunStatus) -> io::Result<()> {
        self.flush()?;
        self.write_meta(status, Some(now_ms()))
    }
}
