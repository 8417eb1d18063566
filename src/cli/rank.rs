//! One rank of a data-parallel job: where it stands (from the environment or `--gpus`),
//! meeting the other ranks, and the watchdogs that keep a job from hanging.

use super::args::TrainArgs;
use super::{EXIT_FAILURE, EXIT_PEER_FAILED, EXIT_USAGE};
use crate::config::Config;
use crate::distributed::launcher::Launch;
use crate::distributed::{Backend, CommError, Joined, Meet, Topology};
use crate::engine::events::Progress;
use crate::util::DeviceSpec;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// What this `cockpit train` process is in a data-parallel job.
pub(super) struct Plan {
    /// This process is one rank (the environment says so); None: a single process or a launcher.
    pub topology: Option<Topology>,
    /// The launcher that started this process (torchrun, srun, mpirun, ...), when one did.
    pub launch: Option<Launch>,
    /// `--gpus N` / distributed.gpus > 1 without a rank environment: start the workers.
    pub launching: bool,
    pub gpus: usize,
    pub backend: Backend,
    /// The device this process trains on (a rank on NCCL: `cuda:LOCAL_RANK`).
    pub device: DeviceSpec,
}

/// Read the rank environment and settle the device. `Err(exit code)` after printing why.
/// Ranks other than 0 get the monitor switched off (rank 0 samples the GPUs and advises).
pub(super) fn plan(a: &TrainArgs, cfg: &mut Config, origin: &str) -> Result<Plan, i32> {
    let env_var = |k: &str| std::env::var(k).ok();
    let launch = match crate::distributed::launcher::detect(
        env_var,
        &cfg.distributed.master_addr,
        cfg.distributed.master_port,
    ) {
        Err(e) => {
            crate::errln!("cockpit: distributed environment: {e}");
            return Err(EXIT_USAGE);
        }
        Ok(l) => l,
    };
    let topology = launch
        .as_ref()
        .map(|l| l.topology.clone())
        .filter(|t| t.is_distributed());
    let gpus = a.gpus.map_or(cfg.distributed.gpus, usize::from);
    let mut device = crate::util::parse_device(&cfg.run.device).unwrap_or(DeviceSpec::Auto);
    let launching = topology.is_none() && gpus > 1;
    let Some(backend) = resolve_backend(
        &cfg.distributed.backend,
        device,
        launching,
        crate::engine::device::cuda_device_count,
    ) else {
        crate::errln!(
            "cockpit: config error:\n{origin}: distributed.backend = {:?}: allowed: auto, nccl, tcp",
            cfg.distributed.backend
        );
        return Err(EXIT_USAGE);
    };
    if let Some(t) = &topology {
        if backend == Backend::Nccl && !cfg!(feature = "nccl") {
            crate::errln!("cockpit: rank {}: distributed.backend = \"nccl\": this build has no NCCL (build with --features nccl); \"tcp\" runs CPU processes", t.rank);
            return Err(EXIT_USAGE);
        }
        device = match (backend, device) {
            (Backend::Nccl, DeviceSpec::Cpu) => {
                crate::errln!("cockpit: config error:\n{origin}: distributed.backend = \"nccl\" needs CUDA devices, but run.device = \"cpu\" (backend \"tcp\" runs CPU processes)");
                return Err(EXIT_USAGE);
            }
            // Each rank takes the GPU of its LOCAL_RANK (choose GPUs with CUDA_VISIBLE_DEVICES).
            (Backend::Nccl, _) => DeviceSpec::Cuda(t.local_rank),
            (Backend::Tcp, d) => d,
        };
        if t.rank != 0 {
            cfg.monitor.enabled = false;
        }
    }
    if launching {
        let key = if a.gpus.is_some() {
            "--gpus".to_string()
        } else {
            format!("{origin}: distributed.gpus =")
        };
        if let Err(e) = check_world(gpus, backend, crate::engine::device::cuda_device_count) {
            crate::errln!("cockpit: config error:\n{key} {gpus}: {e}");
            return Err(EXIT_USAGE);
        }
    }
    Ok(Plan {
        launching,
        topology,
        launch,
        gpus,
        backend,
        device,
    })
}

/// `distributed.backend`: "nccl" and "tcp" as written; "auto" is NCCL on CUDA devices and
/// tcp on the CPU. A device left to "auto" counts as CUDA where a GPU is visible, and
/// always for `--gpus N` (which asks for GPUs).
pub(super) fn resolve_backend(
    name: &str,
    device: DeviceSpec,
    launching: bool,
    visible_gpus: impl Fn() -> usize,
) -> Option<Backend> {
    match name {
        "auto" => Some(match device {
            DeviceSpec::Cpu => Backend::Tcp,
            DeviceSpec::Cuda(_) => Backend::Nccl,
            DeviceSpec::Auto if launching || visible_gpus() > 0 => Backend::Nccl,
            DeviceSpec::Auto => Backend::Tcp,
        }),
        other => Backend::parse(other),
    }
}

/// Worker processes the `tcp` backend may start per CPU core of this machine, and at least:
/// more only queue for the same cores (and a typo could fork thousands of processes).
pub const TCP_RANKS_PER_CORE: usize = 4;
pub const TCP_RANKS_MIN: usize = 8;

/// Whether `world` workers may be started on this machine, before any is: on NCCL one per
/// visible GPU, on TCP at most [`TCP_RANKS_PER_CORE`] per CPU core. `Err` says what is
/// available.
pub(super) fn check_world(
    world: usize,
    backend: Backend,
    visible_gpus: impl Fn() -> usize,
) -> Result<(), String> {
    match backend {
        Backend::Nccl => {
            if !cfg!(feature = "nccl") {
                return Err("distributed.backend = \"nccl\": this build has no NCCL (build with --features nccl); \"tcp\" runs CPU processes".into());
            }
            let n = visible_gpus();
            if world > n {
                let visible = std::env::var("CUDA_VISIBLE_DEVICES")
                    .map(|v| format!(" (CUDA_VISIBLE_DEVICES={v:?})"))
                    .unwrap_or_default();
                return Err(format!(
                    "one worker per GPU, and this process can see {n} GPU{}{visible}",
                    if n == 1 { "" } else { "s" }
                ));
            }
        }
        Backend::Tcp => {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            let cap = (cores * TCP_RANKS_PER_CORE).max(TCP_RANKS_MIN);
            if world > cap {
                return Err(format!(
                    "the \"tcp\" backend runs one CPU process per rank: at most {cap} on this machine ({cores} CPU cores × {TCP_RANKS_PER_CORE}, at least {TCP_RANKS_MIN})"
                ));
            }
        }
    }
    Ok(())
}

/// What a rank brings to the meeting besides its topology.
pub(super) struct Meeting<'a> {
    pub launch: Option<&'a Launch>,
    pub backend: Backend,
    /// The run dir this rank would use (rank 0's wins).
    pub run_dir: &'a Path,
    /// The user named a checkpoint (`--resume`): a restart does not pick one.
    pub explicit_resume: bool,
}

/// Meet the other ranks; every rank takes rank 0's run dir, and the checkpoint rank 0 chose
/// when the launcher restarted the job. Under torchrun the ranks meet through its store,
/// where rank 0 also keeps the run dir of the first attempt: torchrun's agent outlives its
/// workers, so a restarted rank 0 finds the run it is to resume. On NCCL the control sockets
/// are watched: NCCL cannot notice a dead peer, so this rank ends rather than wait in a
/// collective forever. `Err(exit code)` after printing why.
pub(super) fn join(t: Topology, m: Meeting, cfg: &Config) -> Result<(PathBuf, Joined), i32> {
    let timeout = crate::distributed::timeout(cfg.distributed.timeout_secs);
    let backend = m.backend;
    let backend_name = match backend {
        Backend::Nccl => "nccl",
        Backend::Tcp => "tcp",
    };
    let mut run_dir = m.run_dir.to_path_buf();
    let mut meet = Meet::Listen;
    if let Some(l) = m.launch.filter(|l| l.agent_store) {
        crate::errln!(
            "cockpit: rank {} of {}: meeting the other ranks through torchrun's store at {}:{} ({backend_name} backend)",
            t.rank, t.world, t.master_addr, t.master_port
        );
        match agent_store(&t, l, &mut run_dir, timeout) {
            Ok(m) => meet = m,
            Err(e) => {
                crate::errln!("cockpit: rank {}: {e}", t.rank);
                return Err(EXIT_FAILURE);
            }
        }
    } else {
        crate::errln!(
            "cockpit: rank {} of {}: meeting the other ranks at {}:{} ({backend_name} backend)",
            t.rank,
            t.world,
            t.master_addr,
            t.master_port
        );
    }
    let resume = match m.launch.and_then(|l| l.restart.as_ref()) {
        Some(r) if t.rank == 0 && !m.explicit_resume => {
            match crate::engine::checkpoint::resolve(&run_dir) {
                Ok(step) => {
                    crate::errln!(
                        "cockpit: {}={}: the launcher restarted this job; every rank resumes from {}",
                        r.var,
                        r.count,
                        step.display()
                    );
                    Some(step.to_string_lossy().into_owned())
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
        _ => None,
    };
    match crate::distributed::join(
        t,
        backend,
        &run_dir.to_string_lossy(),
        resume,
        meet,
        timeout,
    ) {
        Ok(mut j) => {
            j.launcher = m.launch.map(Launch::describe);
            if backend == Backend::Nccl {
                j.peers.watch(move |msg: String| {
                    tracing::error!("{msg}");
                    crate::errln!("cockpit: {msg}; ending this rank");
                    // The engine thread may sit inside a collective that will never
                    // complete: leave at once, without the exit handlers (the CUDA
                    // runtime's would tear the context down under that thread).
                    // SAFETY: _exit ends the process; nothing runs after it.
                    unsafe { libc::_exit(EXIT_PEER_FAILED) }
                });
            }
            Ok((PathBuf::from(&j.handshake.run_dir), j))
        }
        Err(e) => {
            crate::errln!("cockpit: {e}");
            Err(if matches!(e, CommError::Setup(_)) {
                EXIT_USAGE
            } else {
                EXIT_FAILURE
            })
        }
    }
}

/// The keys of this run in torchrun's store: `cockpit/RUN_ID`.
fn store_base(l: &Launch) -> String {
    format!("cockpit/{}", l.run_id.as_deref().unwrap_or("none"))
}

/// Connect to torchrun's store; rank 0 agrees the run dir there (the first attempt's wins).
/// The meeting's keys are those of this attempt (TORCHELASTIC_RESTART_COUNT).
fn agent_store(
    t: &Topology,
    l: &Launch,
    run_dir: &mut PathBuf,
    timeout: std::time::Duration,
) -> Result<Meet, crate::distributed::store::StoreError> {
    let mut store =
        crate::distributed::store::Store::connect(&t.master_addr, t.master_port, timeout)?;
    let base = store_base(l);
    if t.rank == 0 {
        let mine = run_dir.to_string_lossy().into_owned();
        let agreed = store.compare_set(&format!("{base}/run_dir"), b"", mine.as_bytes())?;
        if !agreed.is_empty() {
            *run_dir = PathBuf::from(String::from_utf8_lossy(&agreed).into_owned());
        }
    }
    let attempt = std::env::var("TORCHELASTIC_RESTART_COUNT").unwrap_or_else(|_| "0".into());
    Ok(Meet::Store {
        store,
        prefix: format!("{base}/attempt-{}", attempt.trim()),
    })
}

/// The per-rank threads: this rank's GPU sampled for the step's figures, and the
/// stuck-rank watchdog.
pub(super) fn watch_this_rank(
    rank: usize,
    device: &DeviceSpec,
    progress: Arc<Progress>,
    timeout_secs: f64,
) {
    if let Some(index) = nvml_index_of(device) {
        rank_gpu_sampler(index, progress.clone());
    }
    stuck_watchdog(rank, progress, timeout_secs);
}

/// The NVML index of a CUDA device: its ordinal, mapped through CUDA_VISIBLE_DEVICES when
/// that lists indices (NVML does not see that variable).
fn nvml_index_of(device: &DeviceSpec) -> Option<u32> {
    let DeviceSpec::Cuda(ordinal) = device else {
        return None;
    };
    match std::env::var("CUDA_VISIBLE_DEVICES") {
        Ok(v) if !v.trim().is_empty() => v.split(',').nth(*ordinal)?.trim().parse().ok(),
        _ => u32::try_from(*ordinal).ok(),
    }
}

/// Data parallelism: sample this rank's GPU once a second for the step's per-rank figures
/// (they travel to rank 0, so a dashboard on rank 0 sees every rank's GPU on any node).
fn rank_gpu_sampler(index: u32, progress: Arc<Progress>) {
    use std::sync::atomic::Ordering;
    let _ = std::thread::Builder::new()
        .name("cockpit-rank-gpu".into())
        .spawn(move || {
            let mut c = crate::telemetry::Collector::new();
            if c.notice().is_some() {
                return;
            }
            while progress.step.load(Ordering::Relaxed) != u64::MAX {
                let snap = c.sample();
                if let Some(g) = snap.gpus.iter().find(|g| g.index == index) {
                    let v = |x: Option<u32>| x.unwrap_or(u32::MAX);
                    progress
                        .gpu_util_pct
                        .store(v(g.util_gpu), Ordering::Relaxed);
                    progress
                        .gpu_temp_c
                        .store(v(g.temperature_c), Ordering::Relaxed);
                }
                std::thread::sleep(std::time::Duration::from_secs(1));
            }
        });
}

/// Data parallelism: a collective never returns when a peer is stuck (alive but not
/// stepping), and NCCL has no timeout of its own. End this rank when no optimizer step has
/// finished for `timeout_secs`; its peers then see it go and end too.
fn stuck_watchdog(rank: usize, progress: Arc<Progress>, timeout_secs: f64) {
    use std::sync::atomic::Ordering;
    let timeout = crate::distributed::timeout(timeout_secs);
    let _ = std::thread::Builder::new()
        .name("cockpit-stuck-watchdog".into())
        .spawn(move || {
            let (mut last, mut since) = (progress.step.load(Ordering::Relaxed), std::time::Instant::now());
            loop {
                std::thread::sleep(std::time::Duration::from_millis(250).min(timeout));
                let now = progress.step.load(Ordering::Relaxed);
                if now == u64::MAX {
                    return;
                }
                if now != last {
                    (last, since) = (now, std::time::Instant::now());
                } else if since.elapsed() >= timeout {
                    let secs = timeout.as_secs_f64();
                    let waiting = progress.waiting.load(Ordering::Relaxed);
                    let (msg, code) = if waiting {
                        (format!("rank {rank}: waited {secs:.0} s (distributed.timeout_secs) in a collective after step {last}: another rank is stuck; ending this rank"), EXIT_PEER_FAILED)
                    } else {
                        (format!("rank {rank}: stuck: no optimizer step finished in {secs:.0} s (distributed.timeout_secs) after step {last}, and not waiting for the other ranks; ending this rank"), EXIT_FAILURE)
                    };
                    tracing::error!("{msg}");
                    crate::errln!("cockpit: {msg}");
                    // SAFETY: see the NCCL watchdog: leave without exit handlers.
                    unsafe { libc::_exit(code) }
                }
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_world_is_checked_against_the_gpus_and_cores_before_anything_starts() {
        let e = check_world(70000, Backend::Nccl, || 0).unwrap_err();
        if cfg!(feature = "nccl") {
            assert!(e.contains("can see 0 GPUs"), "{e}");
            assert!(check_world(4, Backend::Nccl, || 8).is_ok());
            assert!(check_world(8, Backend::Nccl, || 8).is_ok());
            assert!(check_world(9, Backend::Nccl, || 8).is_err());
        } else {
            assert!(e.contains("this build has no NCCL"), "{e}");
        }
        let e = check_world(70000, Backend::Tcp, || 0).unwrap_err();
        assert!(e.contains("at most") && e.contains("CPU cores"), "{e}");
        // A few CPU ranks always fit (the end-to-end tests run 3 on 2 cores).
        assert!(check_world(TCP_RANKS_MIN, Backend::Tcp, || 0).is_ok());
    }
}
