//! Restarted by a launcher (torchrun `--max-restarts`, a requeued SLURM job): where the run
//! lives, so a restart finds it, and resuming a single process from it. (Ranks of a job
//! resume from the checkpoint rank 0 picks: see `rank::join`.)

use crate::distributed::launcher;
use crate::engine::checkpoint;
use std::path::{Path, PathBuf};

fn env(k: &str) -> Option<String> {
    std::env::var(k).ok()
}

/// The run dir of a new run inside a SLURM job: `RUNS_ROOT/NAME-slurmJOBID`, the same for
/// every requeue of the job, so a requeued job finds its checkpoints. A second run of the
/// same config in one job (not a requeue) gets the usual timestamped dir. None outside
/// SLURM.
pub(super) fn default_run_dir(runs_root: &Path, name: &str) -> Option<PathBuf> {
    let job = launcher::slurm_job_id(env)?;
    let dir = runs_root.join(format!("{name}-slurm{job}"));
    let restarted = launcher::restart(env).ok().flatten().is_some();
    (restarted || !dir.exists()).then_some(dir)
}

/// A single process the launcher restarted resumes from its run's latest checkpoint (when
/// it has one; a run that never wrote one starts from scratch).
pub(super) fn single_process_resume(run_dir: &Path) -> Option<PathBuf> {
    let r = launcher::restart(env).ok().flatten()?;
    match checkpoint::resolve(run_dir) {
        Ok(step) => {
            crate::errln!(
                "cockpit: {}={}: the launcher restarted this job; resuming from {}",
                r.var,
                r.count,
                step.display()
            );
            Some(run_dir.to_path_buf())
        }
        Err(_) => {
            crate::errln!(
                "cockpit: {}={}: the launcher restarted this job, but {} has no checkpoint yet: starting from scratch",
                r.var,
                r.count,
                run_dir.display()
            );
            None
        }
    }
}
