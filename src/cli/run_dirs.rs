//! The run dirs of a config name: which directories under `run.runs_root` are its runs, and the
//! newest of them (`--resume latest`).

use crate::engine::checkpoint;
use std::path::{Path, PathBuf};

/// Whether a run dir's name is one cockpit gives a run of config name `name`:
/// `NAME-YYYYmmdd-HHMMSS` or, in a SLURM job, `NAME-slurmJOBID` (not another config's
/// `NAME-other-…`, nor a `--test-run`'s `NAME-test-…`).
fn is_run_of(dir_name: &str, name: &str) -> bool {
    let Some(rest) = dir_name
        .strip_prefix(name)
        .and_then(|r| r.strip_prefix('-'))
    else {
        return false;
    };
    let digits = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_digit());
    let stamp = rest
        .split_once('-')
        .is_some_and(|(d, t)| digits(d, 8) && digits(t, 6));
    let slurm = rest
        .strip_prefix("slurm")
        .is_some_and(|j| !j.is_empty() && j.bytes().all(|b| b.is_ascii_digit()));
    stamp || slurm
}

/// The newest run dir of a config name that holds a checkpoint.
pub(super) fn latest_run(runs_root: &Path, name: &str) -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(runs_root)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| is_run_of(&n.to_string_lossy(), name))
        })
        .filter(|p| p.join("checkpoints").join(checkpoint::LATEST).is_file())
        .collect();
    dirs.sort_by_key(|p| {
        std::fs::metadata(p.join("checkpoints").join(checkpoint::LATEST))
            .and_then(|m| m.modified())
            .ok()
    });
    dirs.pop()
}

#[cfg(test)]
mod tests {
    use super::is_run_of;

    #[test]
    fn latest_takes_only_the_runs_of_that_name() {
        assert!(is_run_of("exp-20261205-065512", "exp"));
        assert!(is_run_of("exp-slurm4242", "exp"));
        // Another config whose name begins with this one's, a test run, a stray dir.
        assert!(!is_run_of("exp-lowlr-20261205-065512", "exp"));
        assert!(!is_run_of("exp-test-20261205-065512", "exp"));
        assert!(!is_run_of("exp-backup", "exp"));
        assert!(!is_run_of("exp-2026120-065512", "exp"));
        assert!(!is_run_of("exp-slurm", "exp"));
        assert!(!is_run_of("experiment-20261205-065512", "exp"));
        // (A config named like another's run with its suffix still finds its own.)
        assert!(is_run_of("exp-lowlr-20261205-065512", "exp-lowlr"));
    }
}
