//! An MLflow file store (`mlflow ui --backend-store-uri DIR`): one run per process start in
//! experiment `0` ("Default") or in a named one (a sweep's: `monitor.mlflow_experiment`):
//! `DIR/<exp_id>/meta.yaml`, `DIR/<exp_id>/<run_id>/{meta.yaml, params/, metrics/, tags/,
//! artifacts/}`. Metric files hold lines `timestamp_ms value step`. Artifacts: the config,
//! the logs, `checkpoints.txt` (step and path of every checkpoint saved) and the run's plots
//! (`plots/*.png`, `plots/*.svg`, copied once they are drawn: [`log_plots`]).

use std::collections::HashMap;
use std::fs::{self, File};
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

const DEFAULT_ID: &str = "0";
const DEFAULT_NAME: &str = "Default";

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

/// The `name:` of an experiment's meta.yaml (quoted or not).
fn meta_name(meta: &str) -> Option<String> {
    let v = meta.lines().find_map(|l| l.strip_prefix("name: "))?.trim();
    Some(
        match v.strip_prefix('\'').and_then(|v| v.strip_suffix('\'')) {
            Some(q) => q.replace("''", "'"),
            None => v.trim_matches('"').to_string(),
        },
    )
}

/// The id of experiment `name` under `root`: the one that exists, else one derived from the
/// name (so that runs starting at once, a sweep's on several GPUs, make the same one).
fn experiment_id(root: &Path, name: &str) -> String {
    if name == DEFAULT_NAME {
        return DEFAULT_ID.into();
    }
    if let Ok(entries) = fs::read_dir(root) {
        for e in entries.flatten() {
            let found = fs::read_to_string(e.path().join("meta.yaml"))
                .ok()
                .and_then(|m| meta_name(&m));
            if found.as_deref() == Some(name) {
                return e.file_name().to_string_lossy().into_owned();
            }
        }
    }
    use sha2::{Digest, Sha256};
    let h = Sha256::digest(name.as_bytes());
    let mut b = [0u8; 8];
    b.copy_from_slice(&h[..8]);
    // a positive 63-bit integer, as MLflow's own ids
    (u64::from_le_bytes(b) >> 1).max(1).to_string()
}

pub struct MlflowRun {
    run_dir: PathBuf,
    experiment_id: String,
    run_id: String,
    run_name: String,
    start_ms: u64,
    metrics: HashMap<String, BufWriter<File>>,
}

impl MlflowRun {
    /// Create the experiment `experiment` (None: "Default") when missing and a new run named
    /// `run_name` in it under `root`.
    pub fn create(root: &Path, run_name: &str, experiment: Option<&str>) -> io::Result<Self> {
        fs::create_dir_all(root)?;
        let root = fs::canonicalize(root)?;
        let name = experiment.filter(|n| !n.is_empty()).unwrap_or(DEFAULT_NAME);
        let experiment_id = experiment_id(&root, name);
        let exp = root.join(&experiment_id);
        fs::create_dir_all(&exp)?;
        let now = now_ms();
        let exp_meta = exp.join("meta.yaml");
        if !exp_meta.exists() {
            let text = format!(
                "artifact_location: {}\ncreation_time: {now}\nexperiment_id: '{experiment_id}'\n\
                 last_update_time: {now}\nlifecycle_stage: active\nname: {}\n",
                quoted(&file_uri(&exp)),
                quoted(name)
            );
            // whole or not at all: another run may be reading it
            let tmp = exp.join(format!(".meta.yaml.{}", std::process::id()));
            fs::write(&tmp, text)?;
            fs::rename(&tmp, &exp_meta)?;
        }
        let run_id = format!("{:032x}", rand::random::<u128>());
        let run_dir = exp.join(&run_id);
        for sub in ["params", "metrics", "tags", "artifacts"] {
            fs::create_dir_all(run_dir.join(sub))?;
        }
        let me = Self {
            run_dir,
            experiment_id,
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

    pub fn experiment_id(&self) -> &str {
        &self.experiment_id
    }

    pub fn artifacts(&self) -> PathBuf {
        self.run_dir.join("artifacts")
    }

    fn write_meta(&self, status: RunStatus, end_ms: Option<u64>) -> io::Result<()> {
        let user = std::env::var("USER").unwrap_or_else(|_| "cockpit".into());
        let end = end_ms.map_or("null".to_string(), |t| t.to_string());
        let text = format!(
            "artifact_uri: {}\nend_time: {end}\nentry_point_name: ''\nexperiment_id: '{}'\n\
             lifecycle_stage: active\nrun_id: {id}\nrun_name: {}\nrun_uuid: {id}\nsource_name: ''\n\
             source_type: 4\nsource_version: ''\nstart_time: {}\nstatus: {}\ntags: []\nuser_id: {}\n",
            quoted(&file_uri(&self.artifacts())),
            self.experiment_id,
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

    /// A checkpoint saved: one line `step path` more in the `checkpoints.txt` artifact.
    pub fn checkpoint(&self, step: u64, path: &str) -> io::Result<()> {
        let mut f = File::options()
            .create(true)
            .append(true)
            .open(self.artifacts().join("checkpoints.txt"))?;
        writeln!(f, "{step} {path}")
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

/// Copy the run's plots (`plots_dir/*.png` and `*.svg`) into the `plots/` artifacts of the
/// MLflow run whose artifacts are at `artifacts`; the number copied.
pub fn log_plots(artifacts: &Path, plots_dir: &Path) -> io::Result<usize> {
    let Ok(entries) = fs::read_dir(plots_dir) else {
        return Ok(0);
    };
    let mut files: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_file() && p.extension().is_some_and(|x| x == "png" || x == "svg"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Ok(0);
    }
    let out = artifacts.join("plots");
    fs::create_dir_all(&out)?;
    for f in &files {
        if let Some(name) = f.file_name() {
            fs::copy(f, out.join(name))?;
        }
    }
    Ok(files.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_named_experiment_is_found_again_or_made_once() {
        let dir = tempfile::tempdir().unwrap();
        let a = MlflowRun::create(dir.path(), "a", Some("sweep-x")).unwrap();
        let b = MlflowRun::create(dir.path(), "b", Some("sweep-x")).unwrap();
        let c = MlflowRun::create(dir.path(), "c", None).unwrap();
        assert_eq!(a.experiment_id(), b.experiment_id());
        assert_eq!(c.experiment_id(), "0");
        assert_ne!(a.experiment_id(), "0");
        let meta =
            fs::read_to_string(dir.path().join(a.experiment_id()).join("meta.yaml")).unwrap();
        assert_eq!(meta_name(&meta).as_deref(), Some("sweep-x"));
        let run_meta =
            fs::read_to_string(a.artifacts().parent().unwrap().join("meta.yaml")).unwrap();
        assert!(run_meta.contains(&format!("experiment_id: '{}'", a.experiment_id())));
        // an experiment MLflow made, under its own id, is found by its name
        let other = dir.path().join("12345");
        fs::create_dir_all(&other).unwrap();
        fs::write(
            other.join("meta.yaml"),
            "experiment_id: '12345'\nname: 'it''s mine'\n",
        )
        .unwrap();
        let d = MlflowRun::create(dir.path(), "d", Some("it's mine")).unwrap();
        assert_eq!(d.experiment_id(), "12345");
    }
}
