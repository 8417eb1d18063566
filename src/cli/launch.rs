//! `cockpit train CONFIG --gpus N`: start one worker process per GPU on this machine (the
//! same binary, with torchrun's environment: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
//! MASTER_PORT), show rank 0's run (the dashboard on a terminal, progress lines otherwise),
//! and end the whole job cleanly when any worker fails, naming the rank and its cause.

use super::args::TrainArgs;
use super::{EXIT_FAILURE, EXIT_OK, EXIT_PEER_FAILED, EXIT_USAGE};
use crate::config::Config;
use crate::distributed::{Backend, Topology};
use std::io::{IsTerminal, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long workers get to stop after SIGTERM before they are killed.
const GRACE: Duration = Duration::from_secs(15);
/// After a worker fails, how long the others get to notice (and name the cause in their
/// logs) by themselves before they are sent SIGTERM.
const NOTICE: Duration = Duration::from_secs(5);

/// The worker's log: `RUN_DIR/ranks/rank-N.log`.
pub fn worker_log(run_dir: &Path, rank: usize) -> PathBuf {
    run_dir.join("ranks").join(format!("rank-{rank}.log"))
}

/// The arguments a worker gets: the launcher's own, minus `--gpus`, plus the agreed run dir
/// and `--no-tui` (rank 0's run is shown by the launcher).
fn worker_args(a: &TrainArgs, run_dir: &Path) -> Vec<String> {
    let mut v = vec!["train".to_string()];
    if let Some(c) = &a.config {
        v.push(c.display().to_string());
    }
    v.push("--no-tui".into());
    v.push("--run-dir".into());
    v.push(run_dir.display().to_string());
    for s in &a.set {
        v.push("--set".into());
        v.push(s.clone());
    }
    if let Some(n) = a.max_steps {
        v.push("--max-steps".into());
        v.push(n.to_string());
    }
    if let Some(r) = &a.resume {
        v.push(format!("--resume={r}"));
    }
    if a.fresh {
        v.push("--fresh".into());
    }
    if a.test_run {
        v.push("--test-run".into());
    }
    if let Some(d) = &a.device {
        v.push("--device".into());
        v.push(d.clone());
    }
    v
}

/// A free TCP port when the configured one is taken (another job on this machine).
fn pick_port(addr: &str, want: u16) -> u16 {
    if std::net::TcpListener::bind(("0.0.0.0", want)).is_ok() {
        return want;
    }
    let free = std::net::TcpListener::bind((addr, 0))
        .or_else(|_| std::net::TcpListener::bind(("127.0.0.1", 0)))
        .and_then(|l| l.local_addr())
        .map(|a| a.port());
    match free {
        Ok(p) => {
            crate::errln!("cockpit: port {want} is in use; the ranks meet on port {p} instead");
            p
        }
        Err(_) => want,
    }
}

/// The last lines of a worker's log (for the failure message).
fn tail(path: &Path, lines: usize) -> String {
    let Ok(mut f) = std::fs::File::open(path) else {
        return String::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(8192)));
    let mut s = String::new();
    let _ = f.read_to_string(&mut s);
    let all: Vec<&str> = s.lines().filter(|l| !l.trim().is_empty()).collect();
    all[all.len().saturating_sub(lines)..].join("\n    ")
}

struct Worker {
    rank: usize,
    child: Child,
    status: Option<std::process::ExitStatus>,
}

/// The workers that failed, in the order they ended: (rank, how, exit code).
type Failures = Vec<(usize, String, Option<i32>)>;

/// The failure to report: the first rank that failed on its own, not one that ended because
/// another did (exit code [`EXIT_PEER_FAILED`]); else the first.
fn root_cause(f: &Failures) -> Option<&(usize, String, Option<i32>)> {
    f.iter()
        .find(|(_, _, code)| *code != Some(EXIT_PEER_FAILED))
        .or_else(|| f.first())
}

fn signal(child: &Child, sig: i32) {
    if let Ok(pid) = i32::try_from(child.id()) {
        // SAFETY: kill(2) on a child we started and have not reaped.
        unsafe {
            libc::kill(pid, sig);
        }
    }
}

/// Wait for every worker; when one fails (or the launcher is told to stop), stop the rest:
/// SIGTERM, then SIGKILL after the grace period.
fn supervise(
    workers: Arc<Mutex<Vec<Worker>>>,
    stop: Arc<AtomicBool>,
    failure: Arc<Mutex<Failures>>,
) {
    let mut term_sent: Option<Instant> = None;
    let mut failed_at: Option<Instant> = None;
    loop {
        let (all_done, failed_now) = {
            let Ok(mut ws) = workers.lock() else { return };
            let mut failed_now = Vec::new();
            for w in ws.iter_mut() {
                if w.status.is_none() {
                    if let Ok(Some(st)) = w.child.try_wait() {
                        w.status = Some(st);
                        if !st.success() {
                            failed_now.push((w.rank, describe_status(st), st.code()));
                        }
                    }
                }
            }
            (ws.iter().all(|w| w.status.is_some()), failed_now)
        };
        if !failed_now.is_empty() && !stop.load(Ordering::Relaxed) {
            if let Ok(mut f) = failure.lock() {
                f.extend(failed_now);
            }
        }
        if all_done {
            return;
        }
        let failing = failure.lock().map(|f| !f.is_empty()).unwrap_or(true);
        if failing && failed_at.is_none() {
            failed_at = Some(Instant::now());
        }
        let give_up = failed_at.is_some_and(|t| t.elapsed() > NOTICE);
        if (give_up || stop.load(Ordering::Relaxed)) && term_sent.is_none() {
            term_sent = Some(Instant::now());
            if let Ok(ws) = workers.lock() {
                for w in ws.iter().filter(|w| w.status.is_none()) {
                    signal(&w.child, libc::SIGTERM);
                }
            }
        }
        if term_sent.is_some_and(|t| t.elapsed() > GRACE) {
            if let Ok(mut ws) = workers.lock() {
                for w in ws.iter_mut().filter(|w| w.status.is_none()) {
                    let _ = w.child.kill();
                }
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn describe_status(st: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (st.code(), st.signal()) {
        (Some(c), _) => format!("exit code {c}"),
        (None, Some(s)) => format!("killed by signal {s}"),
        _ => "ended abnormally".into(),
    }
}

/// The environment variable that hands a worker its launcher's PID.
const LAUNCHER_PID: &str = "COCKPIT_LAUNCHER_PID";

/// In a worker of `--gpus N`: a thread that notices the launcher's death (this process
/// re-parented) even where the kernel's parent-death signal did not come (it is tied to
/// the thread that forked), stops the run as SIGTERM does, and leaves for good if the stop
/// has not ended the process after [`GRACE`] (its peers may be gone too).
pub fn watch_launcher() {
    let Some(launcher) = std::env::var(LAUNCHER_PID)
        .ok()
        .and_then(|p| p.parse::<i32>().ok())
    else {
        return;
    };
    let spawned = std::thread::Builder::new()
        .name("cockpit-launcher-watch".into())
        .spawn(move || {
            // SAFETY: getppid, getpid, kill and _exit have no preconditions.
            while unsafe { libc::getppid() } == launcher {
                std::thread::sleep(Duration::from_millis(250));
            }
            tracing::warn!("the --gpus launcher (PID {launcher}) is gone: stopping");
            unsafe { libc::kill(libc::getpid(), libc::SIGTERM) };
            std::thread::sleep(GRACE);
            tracing::warn!(
                "still running {}s after the launcher went: leaving",
                GRACE.as_secs()
            );
            unsafe { libc::_exit(EXIT_FAILURE) };
        });
    if let Err(e) = spawned {
        tracing::warn!("cannot watch the launcher: {e}");
    }
}

/// The CPU threads each worker's candle ops use, where the launcher sets them: CPU ranks
/// (the tcp backend) share the machine's cores (at least one each), unless `RAYON_NUM_THREADS`
/// is set already. A thread per core in every rank oversubscribes the cores, and candle's CPU
/// ops spin-wait at their barriers: two ranks on 2 cores ran 2.6x slower that way.
fn rank_threads(backend: Backend, world: usize, set: bool, cores: usize) -> Option<usize> {
    match (backend, set) {
        (Backend::Tcp, false) => Some((cores / world.max(1)).max(1)),
        _ => None,
    }
}

/// Launch `world` workers on this machine (on `backend`, resolved) and follow the job.
pub fn run(
    a: &TrainArgs,
    cfg: &Config,
    (world, backend): (usize, Backend),
    run_dir: PathBuf,
) -> anyhow::Result<i32> {
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            crate::errln!(
                "cockpit: --gpus {world}: cannot find this program to start the workers: {e}"
            );
            return Ok(EXIT_FAILURE);
        }
    };
    let ranks_dir = run_dir.join("ranks");
    if let Err(e) = std::fs::create_dir_all(&ranks_dir) {
        crate::errln!("cockpit: creating {}: {e}", ranks_dir.display());
        return Ok(EXIT_FAILURE);
    }
    let d = &cfg.distributed;
    let topology = Topology {
        rank: 0,
        world,
        local_rank: 0,
        master_addr: d.master_addr.clone(),
        master_port: pick_port(&d.master_addr, d.master_port),
    };
    let args = worker_args(a, &run_dir);
    let threads = rank_threads(
        backend,
        world,
        std::env::var_os("RAYON_NUM_THREADS").is_some(),
        std::thread::available_parallelism().map_or(1, |n| n.get()),
    );
    let mut workers = Vec::with_capacity(world);
    for rank in 0..world {
        let log = worker_log(&run_dir, rank);
        let spawned = std::fs::File::create(&log).and_then(|out| {
            let err = out.try_clone()?;
            let mut cmd = Command::new(&exe);
            // Their own process group: a Ctrl+C at the terminal reaches the launcher only,
            // which passes one SIGTERM on (two signals would make a worker quit at once).
            std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
            // A launcher killed with SIGKILL leaves no worker behind: the kernel sends each
            // SIGTERM when it dies (and one started after it died leaves at once).
            let parent = std::process::id() as i32;
            // SAFETY: prctl, getppid and _exit are async-signal-safe; nothing is allocated.
            unsafe {
                std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || {
                    if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    if libc::getppid() != parent {
                        libc::_exit(EXIT_FAILURE);
                    }
                    Ok(())
                });
            }
            if let Some(n) = threads {
                cmd.env("RAYON_NUM_THREADS", n.to_string());
            }
            cmd.args(&args)
                .env(LAUNCHER_PID, parent.to_string())
                .envs(topology.worker_env(rank))
                .stdin(Stdio::null())
                .stdout(out)
                .stderr(err);
            cmd.spawn()
        });
        match spawned {
            Ok(child) => workers.push(Worker {
                rank,
                child,
                status: None,
            }),
            Err(e) => {
                crate::errln!("cockpit: could not start rank {rank}: {e}");
                for w in &mut workers {
                    let _ = w.child.kill();
                    let _ = w.child.wait();
                }
                return Ok(EXIT_FAILURE);
            }
        }
    }
    crate::errln!(
        "cockpit: {world} workers ({} backend, rendezvous at {}:{}); their logs: {}/rank-N.log",
        match backend {
            Backend::Nccl => "nccl",
            Backend::Tcp => "tcp",
        },
        topology.master_addr,
        topology.master_port,
        ranks_dir.display()
    );
    let workers = Arc::new(Mutex::new(workers));
    let stop = Arc::new(AtomicBool::new(false));
    let failure: Arc<Mutex<Failures>> = Arc::new(Mutex::new(Vec::new()));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        let _ = signal_hook::flag::register(sig, stop.clone());
    }
    let supervisor = {
        let (w, s, f) = (workers.clone(), stop.clone(), failure.clone());
        std::thread::Builder::new()
            .name("cockpit-launcher".into())
            .spawn(move || supervise(w, s, f))?
    };
    // Rank 0's run: once its control socket is up, follow it like `cockpit attach`.
    let tui = !a.no_tui && std::io::stdout().is_terminal();
    let mut shown = false;
    while !supervisor.is_finished() {
        let live = crate::attach::socket_candidates(&run_dir)
            .iter()
            .any(|p| p.exists());
        if live {
            let theme = a.theme.as_deref();
            let _ = super::frontends::follow(&run_dir, !tui, true, theme, true);
            shown = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let _ = supervisor.join();
    let failed = failure.lock().ok().and_then(|f| root_cause(&f).cloned());
    let statuses: Vec<(usize, bool)> = workers
        .lock()
        .map(|ws| {
            ws.iter()
                .map(|w| (w.rank, w.status.is_some_and(|s| s.success())))
                .collect()
        })
        .unwrap_or_default();
    if let Some((rank, how, code)) = failed {
        let log = worker_log(&run_dir, rank);
        crate::errln!(
            "cockpit: rank {rank} failed ({how}); the other ranks were stopped. Its last words ({}):\n    {}",
            log.display(),
            tail(&log, 6)
        );
        // A config or usage error in a worker is one for the job.
        return Ok(if code == Some(EXIT_USAGE) {
            EXIT_USAGE
        } else {
            EXIT_FAILURE
        });
    }
    if !shown {
        crate::errln!(
            "cockpit: rank 0 never came up; see {}",
            worker_log(&run_dir, 0).display()
        );
    }
    if stop.load(Ordering::Relaxed) {
        return Ok(super::EXIT_INTERRUPTED);
    }
    let bad: Vec<String> = statuses
        .iter()
        .filter(|(_, ok)| !ok)
        .map(|(r, _)| r.to_string())
        .collect();
    if bad.is_empty() {
        Ok(EXIT_OK)
    } else {
        crate::errln!("cockpit: ranks {} did not finish cleanly", bad.join(", "));
        Ok(if shown { EXIT_FAILURE } else { EXIT_USAGE })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CPU ranks split the cores (one thread at least); GPU ranks and a set RAYON_NUM_THREADS
    /// are left alone.
    #[test]
    fn cpu_ranks_share_the_cores() {
        assert_eq!(rank_threads(Backend::Tcp, 2, false, 16), Some(8));
        assert_eq!(rank_threads(Backend::Tcp, 3, false, 2), Some(1));
        assert_eq!(rank_threads(Backend::Tcp, 2, true, 16), None);
        assert_eq!(rank_threads(Backend::Nccl, 2, false, 16), None);
    }
}
