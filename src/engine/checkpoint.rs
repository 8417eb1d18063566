//! Checkpoints: full training state written atomically (temp dir + fsync + rename; the
//! `latest` pointer moves last), verified by a manifest of sizes and SHA-256 checksums.

use super::data::loader::Cursor;
use super::precision::LossScaler;
use super::scu::ScuController;
use crate::util::{atomic_write, hex, sync_dir};
use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Corrupt { path: String, message: String },
    #[error("{path}: {message}")]
    Mismatch { path: String, message: String },
    #[error("{0}")]
    Tensor(String),
    /// Weights or optimizer state holding NaN or ±inf: never written, never loaded.
    #[error("{what} tensor {tensor} holds non-finite values (NaN or inf): the run diverged; not saved (lower optim.lr)")]
    NonFinite { what: &'static str, tensor: String },
}

/// The first tensor (by name) holding a NaN or ±inf. A float tensor's sum is non-finite
/// exactly when one of its values is (summed in f32: no overflow at any sane weight scale).
pub fn first_non_finite<'a>(
    tensors: impl IntoIterator<Item = (&'a String, &'a Tensor)>,
) -> Result<Option<String>, CheckpointError> {
    use candle_core::DType;
    let terr = |e: candle_core::Error| CheckpointError::Tensor(e.to_string());
    for (name, t) in tensors {
        let sum = match t.dtype() {
            DType::F32 => t.sum_all().map_err(terr)?,
            DType::F16 | DType::BF16 | DType::F64 => t
                .to_dtype(DType::F32)
                .and_then(|t| t.sum_all())
                .map_err(terr)?,
            _ => continue,
        };
        if !sum.to_scalar::<f32>().map_err(terr)?.is_finite() {
            return Ok(Some(name.clone()));
        }
    }
    Ok(None)
}

/// Refuse non-finite model weights or optimizer state.
fn ensure_finite<'a>(
    what: &'static str,
    tensors: impl IntoIterator<Item = (&'a String, &'a Tensor)>,
) -> Result<(), CheckpointError> {
    match first_non_finite(tensors)? {
        Some(tensor) => Err(CheckpointError::NonFinite { what, tensor }),
        None => Ok(()),
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| match source.kind() {
        // not text, not a regular file, too large: a damaged checkpoint, not a failing disk
        std::io::ErrorKind::InvalidData | std::io::ErrorKind::InvalidInput => {
            CheckpointError::Corrupt {
                path: path.display().to_string(),
                message: source.to_string(),
            }
        }
        _ => CheckpointError::Io {
            path: path.display().to_string(),
            source,
        },
    }
}

/// Everything but the tensors.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainState {
    pub step: u64,
    pub optim_t: u64,
    pub cursor: Cursor,
    pub micro_batch: usize,
    pub accum: usize,
    pub tokens: u64,
    pub elapsed_s: f64,
    pub scaler: LossScaler,
    pub scu: ScuController,
    pub best_val_loss: Option<f64>,
    pub lr_scale: f64,
    /// SHA-256 of the shape-defining config (model + data), to refuse incompatible resumes.
    pub shape_hash: String,
    pub seed: u64,
    /// Steps whose update was skipped for non-finite loss or gradients.
    #[serde(default)]
    pub skipped_steps: u64,
    /// Times the engine restored a checkpoint after repeated non-finite steps.
    #[serde(default)]
    pub restores: u32,
    /// The resolved config at save time (resume reports what changed).
    #[serde(default)]
    pub config: serde_json::Value,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FileEntry {
    pub name: String,
    pub bytes: u64,
    pub sha256: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CkptManifest {
    pub format: u32,
    pub step: u64,
    pub created_unix: u64,
    pub files: Vec<FileEntry>,
    pub val_loss: Option<f64>,
}

/// A loaded checkpoint.
pub struct Loaded {
    pub dir: PathBuf,
    pub state: TrainState,
    pub model: HashMap<String, Tensor>,
    pub optim: HashMap<String, Tensor>,
}

pub const LATEST: &str = "latest";

pub fn step_dir_name(step: u64) -> String {
    format!("step-{step:08}")
}

fn sha256_file(path: &Path) -> Result<(u64, String), CheckpointError> {
    if !path.is_file() {
        return Err(CheckpointError::Corrupt {
            path: path.display().to_string(),
            message: "missing, or not a regular file".into(),
        });
    }
    let bytes = std::fs::read(path).map_err(io(path))?;
    Ok((bytes.len() as u64, hex(&Sha256::digest(&bytes))))
}

fn write_safetensors(path: &Path, tensors: &[(String, Tensor)]) -> Result<(), CheckpointError> {
    let map: HashMap<String, Tensor> = tensors.iter().cloned().collect();
    candle_core::safetensors::save(&map, path)
        .map_err(|e| CheckpointError::Tensor(format!("{}: {e}", path.display())))?;
    File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(io(path))
}

/// Save a checkpoint under `root/step-XXXXXXXX` atomically, then move `root/latest`, then prune.
/// Returns the directory and its size in bytes.
pub fn save(
    root: &Path,
    state: &TrainState,
    model: &[(String, Tensor)],
    optim: &[(String, Tensor)],
    val_loss: Option<f64>,
    keep_last: usize,
    keep_best: bool,
) -> Result<(PathBuf, u64), CheckpointError> {
    // A diverged run's state is never a checkpoint (so never `latest`, never `best`, never
    // what recovery restores).
    ensure_finite("model", model.iter().map(|(n, t)| (n, t)))?;
    ensure_finite("optimizer", optim.iter().map(|(n, t)| (n, t)))?;
    let val_loss_best = val_loss.filter(|v| v.is_finite());
    // A second Ctrl+C while this runs waits for it: the checkpoint is committed whole.
    let _commit = crate::process::CommitGuard::begin();
    std::fs::create_dir_all(root).map_err(io(root))?;
    remove_leftovers(root);
    let name = step_dir_name(state.step);
    let tmp = root.join(format!(".tmp-{name}-{}", std::process::id()));
    let attempt = || {
        let r = write_step_dir(&tmp, state, model, optim, val_loss);
        if r.is_err() {
            // a half-written copy would hold the last free bytes
            let _ = std::fs::remove_dir_all(&tmp);
        }
        r
    };
    let total = match attempt() {
        // Out of space: make room by rotating the oldest checkpoint, then once more.
        Err(e) if out_of_space(&e) && rotate_oldest(root) => attempt()?,
        r => r?,
    };
    let dest = root.join(&name);
    if dest.exists() {
        // Same step saved twice (e.g. "checkpoint now" then the end of the run): replace it.
        let old = root.join(format!(".old-{name}-{}", std::process::id()));
        std::fs::rename(&dest, &old).map_err(io(&dest))?;
        std::fs::rename(&tmp, &dest).map_err(io(&dest))?;
        let _ = std::fs::remove_dir_all(&old);
    } else {
        std::fs::rename(&tmp, &dest).map_err(io(&dest))?;
    }
    sync_dir(root).map_err(io(root))?;
    atomic_write(&root.join(LATEST), name.as_bytes()).map_err(io(root))?;
    if keep_best {
        if let Some(v) = val_loss_best {
            let best = read_best(root);
            if best.as_ref().is_none_or(|(_, b)| v < *b) {
                let _ = atomic_write(&root.join("best"), format!("{name} {v}").as_bytes());
            }
        }
    }
    prune(root, keep_last);
    Ok((dest, total))
}

/// Whether a save failed for want of space (a full disk, a quota).
fn out_of_space(e: &CheckpointError) -> bool {
    match e {
        CheckpointError::Io { source, .. } => {
            matches!(
                source.raw_os_error(),
                Some(libc::ENOSPC) | Some(libc::EDQUOT)
            )
        }
        // the safetensors writer's errors arrive as text
        CheckpointError::Tensor(m) => {
            m.contains("os error 28") || m.contains("os error 122") || m.contains("No space left")
        }
        _ => false,
    }
}

/// Remove the oldest step dir that is neither `latest` nor `best` (manifest first); false
/// when there is none to remove.
fn rotate_oldest(root: &Path) -> bool {
    let best = read_best(root).map(|(n, _)| n);
    let latest = crate::util::read_regular_file(&root.join(LATEST), 4096).ok();
    let oldest = list(root).into_iter().find(|dir| {
        let name = dir_name(dir);
        Some(&name) != best.as_ref() && Some(name.as_str()) != latest.as_deref().map(str::trim)
    });
    match oldest {
        Some(dir) => {
            tracing::warn!(
                "checkpoint: out of space; removing the oldest checkpoint {} to make room",
                dir.display()
            );
            remove_step_dir(&dir);
            true
        }
        None => false,
    }
}

fn dir_name(dir: &Path) -> String {
    dir.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Delete a step dir manifest first: a dir cut short (kill -9 mid-delete) then holds no
/// manifest, so nothing takes it for a checkpoint.
fn remove_step_dir(dir: &Path) {
    let manifest = dir.join("manifest.json");
    if std::fs::remove_file(&manifest).is_ok() {
        let _ = sync_dir(dir);
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// Write the checkpoint's files into `tmp` (created fresh); returns their total size.
fn write_step_dir(
    tmp: &Path,
    state: &TrainState,
    model: &[(String, Tensor)],
    optim: &[(String, Tensor)],
    val_loss: Option<f64>,
) -> Result<u64, CheckpointError> {
    if tmp.exists() {
        std::fs::remove_dir_all(tmp).map_err(io(tmp))?;
    }
    std::fs::create_dir_all(tmp).map_err(io(tmp))?;
    write_safetensors(&tmp.join("model.safetensors"), model)?;
    write_safetensors(&tmp.join("optim.safetensors"), optim)?;
    let state_json =
        serde_json::to_vec_pretty(state).map_err(|e| CheckpointError::Tensor(e.to_string()))?;
    let p = tmp.join("state.json");
    File::create(&p)
        .and_then(|mut f| f.write_all(&state_json).and_then(|_| f.sync_all()))
        .map_err(io(&p))?;
    let mut files = Vec::new();
    let mut total = 0;
    for f in ["model.safetensors", "optim.safetensors", "state.json"] {
        let (bytes, sha256) = sha256_file(&tmp.join(f))?;
        total += bytes;
        files.push(FileEntry {
            name: f.into(),
            bytes,
            sha256,
        });
    }
    let created_unix = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let manifest = CkptManifest {
        format: 1,
        step: state.step,
        created_unix,
        files,
        val_loss,
    };
    let mp = tmp.join("manifest.json");
    let text =
        serde_json::to_vec_pretty(&manifest).map_err(|e| CheckpointError::Tensor(e.to_string()))?;
    File::create(&mp)
        .and_then(|mut f| f.write_all(&text).and_then(|_| f.sync_all()))
        .map_err(io(&mp))?;
    sync_dir(tmp).map_err(io(tmp))?;
    Ok(total)
}

/// The checkpoint with the best validation loss under `root` (a checkpoints dir), and that
/// loss, when one was recorded and still exists.
pub fn best(root: &Path) -> Option<(PathBuf, f64)> {
    let (name, v) = read_best(root)?;
    let dir = root.join(name);
    dir.join("manifest.json").is_file().then_some((dir, v))
}

/// What a process killed while saving leaves behind: half-written checkpoints (`.tmp-…`,
/// `.old-…`), never pointed at by `latest`, pointer files never renamed into place
/// (`.latest.tmp-PID`, `.best.tmp-PID`), and step dirs whose deletion was cut short. Removed at the start of a run (under its run-dir
/// lock) and before each save.
pub fn remove_leftovers(root: &Path) {
    let Ok(entries) = std::fs::read_dir(root) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with(".tmp-step-") || name.starts_with(".old-step-") {
            let _ = std::fs::remove_dir_all(e.path());
        } else if name.starts_with(".latest.tmp-") || name.starts_with(".best.tmp-") {
            let _ = std::fs::remove_file(e.path());
        } else if name.starts_with("step-") && !e.path().join("manifest.json").exists() {
            // a rotation cut short after its manifest went (step dirs appear whole, by rename)
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

fn read_best(root: &Path) -> Option<(String, f64)> {
    let text = crate::util::read_regular_file(&root.join("best"), 4096).ok()?;
    let (name, v) = text.trim().split_once(' ')?;
    let v: f64 = v.parse().ok()?;
    // a NaN "best" (written before non-finite checks) is no best
    v.is_finite().then(|| (name.to_string(), v))
}

/// Step dirs under root, oldest first.
pub fn list(root: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(root)
        .map(|rd| {
            rd.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| {
                    p.is_dir()
                        && p.file_name()
                            .is_some_and(|n| n.to_string_lossy().starts_with("step-"))
                })
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

fn prune(root: &Path, keep_last: usize) {
    let best = read_best(root).map(|(n, _)| n);
    let latest = crate::util::read_regular_file(&root.join(LATEST), 4096).ok();
    let all = list(root);
    let n = all.len();
    for (i, dir) in all.into_iter().enumerate() {
        let name = dir_name(&dir);
        let keep = i + keep_last.max(1) >= n
            || Some(&name) == best.as_ref()
            || Some(name.as_str()) == latest.as_deref().map(str::trim);
        if !keep {
            remove_step_dir(&dir);
        }
    }
}

/// The pointer files of a checkpoints dir that name a step dir (`best` adds its loss).
const POINTERS: [&str; 2] = [LATEST, "best"];

/// Resolve a run dir, a checkpoints dir, a step dir, or one of the pointer files (`latest`,
/// `best`) in a checkpoints dir to a step dir.
pub fn resolve(spec: &Path) -> Result<PathBuf, CheckpointError> {
    if spec.join("manifest.json").is_file() {
        return Ok(spec.to_path_buf());
    }
    let pointer = spec
        .file_name()
        .is_some_and(|n| POINTERS.iter().any(|p| n == *p));
    if let (true, true, Some(root)) = (pointer, spec.is_file(), spec.parent()) {
        let text = crate::util::read_regular_file(spec, 4096).map_err(io(spec))?;
        let name = text.split_whitespace().next().unwrap_or_default();
        let dir = root.join(name);
        if !name.is_empty() && dir.join("manifest.json").is_file() {
            return Ok(dir);
        }
        return Err(CheckpointError::Corrupt {
            path: spec.display().to_string(),
            message: format!("points at {} which holds no manifest.json", dir.display()),
        });
    }
    for root in [spec.to_path_buf(), spec.join("checkpoints")] {
        let latest = root.join(LATEST);
        if latest.exists() && !latest.is_file() {
            return Err(CheckpointError::Corrupt {
                path: latest.display().to_string(),
                message: "not a regular file (a FIFO, a device or a directory?)".into(),
            });
        }
        if let Ok(name) = crate::util::read_regular_file(&latest, 4096) {
            let dir = root.join(name.trim());
            if dir.join("manifest.json").is_file() {
                return Ok(dir);
            }
            return Err(CheckpointError::Corrupt {
                path: latest.display().to_string(),
                message: format!("points at {} which holds no manifest.json", dir.display()),
            });
        }
    }
    Err(CheckpointError::Corrupt {
        path: spec.display().to_string(),
        message: "no checkpoint here (no manifest.json, no latest pointer)".into(),
    })
}

/// Load and verify a checkpoint dir.
/// A checkpoint's `state.json` alone (no tensors, no checksums).
pub fn read_state(dir: &Path) -> Result<TrainState, CheckpointError> {
    let sp = dir.join("state.json");
    let text = crate::util::read_regular_file(&sp, 1 << 30).map_err(io(&sp))?;
    serde_json::from_str(&text).map_err(|e| CheckpointError::Corrupt {
        path: sp.display().to_string(),
        message: e.to_string(),
    })
}

pub fn load(dir: &Path, device: &Device) -> Result<Loaded, CheckpointError> {
    load_parts(dir, device, true)
}

/// [`load`] without the optimizer state (export, generate, a base): `optim.safetensors` may
/// be absent (deleted to save space) and is neither read nor checked; `optim` comes back
/// empty.
pub fn load_weights(dir: &Path, device: &Device) -> Result<Loaded, CheckpointError> {
    load_parts(dir, device, false)
}

fn load_parts(dir: &Path, device: &Device, with_optim: bool) -> Result<Loaded, CheckpointError> {
    let mp = dir.join("manifest.json");
    let text = crate::util::read_regular_file(&mp, 1 << 20).map_err(io(&mp))?;
    let manifest: CkptManifest =
        serde_json::from_str(&text).map_err(|e| CheckpointError::Corrupt {
            path: mp.display().to_string(),
            message: format!("unreadable manifest: {e}"),
        })?;
    for f in &manifest.files {
        if !with_optim && f.name == "optim.safetensors" {
            continue;
        }
        let p = dir.join(&f.name);
        let (bytes, sha) = sha256_file(&p)?;
        if bytes != f.bytes {
            return Err(CheckpointError::Corrupt {
                path: p.display().to_string(),
                message: format!(
                    "size {bytes} bytes, the manifest says {} (truncated?)",
                    f.bytes
                ),
            });
        }
        if sha != f.sha256 {
            return Err(CheckpointError::Corrupt {
                path: p.display().to_string(),
                message: "checksum mismatch: the file was modified or corrupted".into(),
            });
        }
    }
    let state = read_state(dir)?;
    let read = |name: &str| -> Result<HashMap<String, Tensor>, CheckpointError> {
        let p = dir.join(name);
        candle_core::safetensors::load(&p, device).map_err(|e| CheckpointError::Corrupt {
            path: p.display().to_string(),
            message: e.to_string(),
        })
    };
    let model = read("model.safetensors")?;
    let optim = if with_optim {
        read("optim.safetensors")?
    } else {
        HashMap::new()
    };
    // written before saves were checked: refused rather than restored
    let non_finite = |what: &str, e: CheckpointError| CheckpointError::Corrupt {
        path: dir.display().to_string(),
        message: format!("{what}: {e}"),
    };
    ensure_finite("model", &model).map_err(|e| non_finite("model.safetensors", e))?;
    ensure_finite("optimizer", &optim).map_err(|e| non_finite("optim.safetensors", e))?;
    Ok(Loaded {
        dir: dir.to_path_buf(),
        state,
        model,
        optim,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named(v: &[f32]) -> Vec<(String, Tensor)> {
        let t = Tensor::new(v, &Device::Cpu).unwrap();
        vec![
            (
                "ok".to_string(),
                Tensor::new(&[1f32, 2.0], &Device::Cpu).unwrap(),
            ),
            (
                "w".to_string(),
                t.to_dtype(candle_core::DType::BF16).unwrap(),
            ),
        ]
    }

    #[test]
    fn non_finite_tensors_are_found_by_name() {
        let finite = named(&[1.0, -3.0e30]);
        assert_eq!(
            first_non_finite(finite.iter().map(|(n, t)| (n, t))).unwrap(),
            None
        );
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let v = named(&[1.0, bad]);
            assert_eq!(
                first_non_finite(v.iter().map(|(n, t)| (n, t))).unwrap(),
                Some("w".to_string())
            );
            let e = ensure_finite("model", v.iter().map(|(n, t)| (n, t))).unwrap_err();
            assert!(e.to_string().contains("non-finite"), "{e}");
        }
    }

    #[test]
    fn the_pointer_files_resolve_to_their_step_dirs() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("checkpoints");
        for d in ["step-00000010", "step-00000020"] {
            std::fs::create_dir_all(root.join(d)).unwrap();
            std::fs::write(root.join(d).join("manifest.json"), b"{}").unwrap();
        }
        std::fs::write(root.join(LATEST), "step-00000020").unwrap();
        std::fs::write(root.join("best"), "step-00000010 2.5").unwrap();
        assert_eq!(
            resolve(&root.join("best")).unwrap(),
            root.join("step-00000010")
        );
        assert_eq!(
            resolve(&root.join(LATEST)).unwrap(),
            root.join("step-00000020")
        );
        assert_eq!(resolve(dir.path()).unwrap(), root.join("step-00000020"));
        std::fs::write(root.join("best"), "step-00000030 2.0").unwrap();
        let e = resolve(&root.join("best")).unwrap_err().to_string();
        assert!(e.contains("step-00000030") && e.contains("best"), "{e}");
    }

    #[test]
    fn a_nan_best_is_no_best() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("best"), "step-00000001 NaN").unwrap();
        assert_eq!(read_best(dir.path()), None);
    }

    #[test]
    fn rotation_leftovers_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        for d in [".tmp-step-00000002-9", "step-00000001"] {
            std::fs::create_dir_all(root.join(d)).unwrap();
        }
        // a rotation cut short: the payload half gone, the manifest already gone
        std::fs::write(root.join("step-00000001/model.safetensors"), b"x").unwrap();
        std::fs::create_dir_all(root.join("step-00000003")).unwrap();
        std::fs::write(root.join("step-00000003/manifest.json"), b"{}").unwrap();
        std::fs::write(root.join(".latest.tmp-77"), b"step-00000003").unwrap();
        remove_leftovers(root);
        let left: Vec<String> = std::fs::read_dir(root)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(left, vec!["step-00000003".to_string()]);
        remove_step_dir(&root.join("step-00000003"));
        assert!(!root.join("step-00000003").exists());
    }
}
