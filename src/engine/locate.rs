//! What a model path names — the one place it is decided: a Hugging Face model directory (or a
//! GGUF file, as the directory it describes), or
//! a cockpit checkpoint (a run dir, its checkpoints dir, `latest`, or a step dir) and the run
//! dir it belongs to. [`crate::engine::source`] opens what it finds; the base of a training
//! run (`engine::base`) reads it the same way.

use super::checkpoint::{self, CheckpointError};
use std::path::{Path, PathBuf};

/// Where a model's files are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Location {
    /// A Hugging Face model directory (config.json, safetensors, tokenizer files).
    HuggingFace(PathBuf),
    /// A cockpit checkpoint's step dir, and the run dir holding it (`RUN/checkpoints/step_N`).
    Checkpoint {
        step_dir: PathBuf,
        run_dir: Option<PathBuf>,
    },
}

/// Whether `dir` is a Hugging Face model directory (config.json, no cockpit manifest).
pub fn is_hf_dir(dir: &Path) -> bool {
    dir.join("config.json").is_file() && !dir.join("manifest.json").is_file()
}

/// The run dir a step dir belongs to (`RUN/checkpoints/step_N` → `RUN`).
pub fn run_dir_of(step_dir: &Path) -> Option<PathBuf> {
    let parent = step_dir.parent()?;
    (parent.file_name()? == "checkpoints")
        .then(|| parent.parent().map(Path::to_path_buf))
        .flatten()
}

/// Find what `path` names. A directory of safetensors without config.json is an error that
/// says so (rather than "no checkpoint here").
pub fn locate(path: &Path) -> Result<Location, CheckpointError> {
    use super::gguf::load;
    // A GGUF file: the Hugging Face directory it describes, made once in a cache.
    if path.is_file() && (load::is_gguf(path) || path.extension().is_some_and(|x| x == "gguf")) {
        return Ok(Location::HuggingFace(load::materialize(path)?));
    }
    if is_hf_dir(path) {
        return Ok(Location::HuggingFace(path.to_path_buf()));
    }
    let looks_hf = std::fs::read_dir(path).is_ok_and(|rd| {
        rd.filter_map(|e| e.ok())
            .any(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
    }) && !path.join("manifest.json").is_file()
        && !path.join("checkpoints").is_dir();
    if looks_hf {
        return Err(CheckpointError::Corrupt {
            path: path.join("config.json").display().to_string(),
            message: "missing: a Hugging Face model directory needs its config.json".into(),
        });
    }
    let step_dir = checkpoint::resolve(path)?;
    let run_dir = run_dir_of(&step_dir);
    Ok(Location::Checkpoint { step_dir, run_dir })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_dir_knows_its_run() {
        let run = Path::new("/runs/a");
        assert_eq!(
            run_dir_of(&run.join("checkpoints").join("step_00000010")),
            Some(run.to_path_buf())
        );
        assert_eq!(run_dir_of(Path::new("/elsewhere/step_1")), None);
    }

    #[test]
    fn safetensors_without_a_config_are_named() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("model.safetensors"), b"").unwrap();
        let e = locate(d.path()).unwrap_err().to_string();
        assert!(e.contains("config.json"), "{e}");
        std::fs::write(d.path().join("config.json"), b"{}").unwrap();
        assert_eq!(
            locate(d.path()).unwrap(),
            Location::HuggingFace(d.path().to_path_buf())
        );
    }
}
