//! One writer per run dir: an advisory lock (`flock` on `RUN_DIR/.lock`) held for the run's
//! life and released by the OS however the process ends (kill -9 included), and the rule
//! that a fresh run does not write into a dir holding another run's records unless told to
//! start over (`--fresh`, which archives the old records under `RUN_DIR/archive/`).

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

/// The lock file in a run dir.
pub const LOCK_FILE: &str = ".lock";
/// Where `--fresh` moves an earlier run's records.
pub const ARCHIVE_DIR: &str = "archive";

/// The run dir's lock, held until dropped (or the process ends).
#[derive(Debug)]
pub struct RunLock {
    _file: File,
}

/// Why the lock was not taken.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error("{dir} is in use by another run ({holder}): wait for it to end, attach to it with `cockpit attach {dir}`, or choose another --run-dir")]
    Held { dir: String, holder: String },
    #[error("{path}: cannot lock the run dir: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
}

/// Take `dir`'s lock without waiting; refused (naming the holder's PID and host) while another
/// process holds it.
pub fn lock(dir: &Path) -> Result<RunLock, LockError> {
    let path = dir.join(LOCK_FILE);
    let io = |source| LockError::Io {
        path: path.display().to_string(),
        source,
    };
    let mut file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(&path)
        .map_err(io)?;
    // SAFETY: flock on a descriptor this function owns; no memory is passed.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            let holder = holder.trim();
            return Err(LockError::Held {
                dir: dir.display().to_string(),
                holder: if holder.is_empty() {
                    "holder unknown".into()
                } else {
                    holder.to_string()
                },
            });
        }
        return Err(io(e));
    }
    let me = format!(
        "PID {} on host {}, since {}\n",
        std::process::id(),
        hostname(),
        chrono::Local::now().format("%Y-%m-%d %H:%M:%S")
    );
    let written = file
        .set_len(0)
        .and_then(|()| file.seek(SeekFrom::Start(0)))
        .and_then(|_| file.write_all(me.as_bytes()));
    if let Err(e) = written {
        // the lock holds all the same; only the holder's name is missing
        tracing::warn!("{}: cannot record the holder: {e}", path.display());
    }
    Ok(RunLock { _file: file })
}

/// Whether another process holds `dir`'s lock now (an error naming it), without keeping it.
pub fn probe(dir: &Path) -> Result<(), LockError> {
    if dir.join(LOCK_FILE).is_file() {
        lock(dir).map(drop)
    } else {
        Ok(())
    }
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname NUL-terminates within it or
    // truncates, and the last byte stays 0.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len() - 1) };
    if rc != 0 {
        return "unknown".into();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// Whether `dir` holds a run's records: a non-empty `metrics.jsonl` or a checkpoint.
pub fn holds_records(dir: &Path) -> bool {
    let metrics = dir
        .join("metrics.jsonl")
        .metadata()
        .is_ok_and(|m| m.len() > 0);
    let checkpoints = std::fs::read_dir(dir.join("checkpoints"))
        .is_ok_and(|mut entries| entries.next().is_some());
    metrics || checkpoints
}

/// Move everything in `dir` but the lock, earlier archives and the ranks' dirs into
/// `dir/archive/<timestamp>/`; returns where it went.
pub fn archive_records(dir: &Path) -> std::io::Result<PathBuf> {
    let root = dir.join(ARCHIVE_DIR);
    let stamp = chrono::Local::now().format("%Y%m%d-%H%M%S").to_string();
    let mut to = root.join(&stamp);
    let mut n = 1;
    while to.exists() {
        n += 1;
        to = root.join(format!("{stamp}-{n}"));
    }
    std::fs::create_dir_all(&to)?;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name();
        if name == LOCK_FILE || name == ARCHIVE_DIR || name == "ranks" {
            continue;
        }
        std::fs::rename(entry.path(), to.join(&name))?;
    }
    Ok(to)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_is_refused_naming_the_holder() {
        let dir = tempfile::tempdir().unwrap();
        let held = lock(dir.path()).unwrap();
        let err = lock(dir.path()).unwrap_err().to_string();
        assert!(
            err.contains(&format!("PID {}", std::process::id())),
            "{err}"
        );
        assert!(err.contains("on host "), "{err}");
        drop(held);
        assert!(lock(dir.path()).is_ok());
    }

    #[test]
    fn archive_moves_records_and_keeps_the_lock() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("metrics.jsonl"), "{}\n").unwrap();
        std::fs::create_dir_all(dir.path().join("checkpoints/step-1")).unwrap();
        let _l = lock(dir.path()).unwrap();
        assert!(holds_records(dir.path()));
        let to = archive_records(dir.path()).unwrap();
        assert!(!holds_records(dir.path()));
        assert!(to.join("metrics.jsonl").is_file());
        assert!(to.join("checkpoints/step-1").is_dir());
        assert!(dir.path().join(LOCK_FILE).is_file());
    }
}
