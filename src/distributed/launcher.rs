//! Which launcher started this process, and the rank, world, local rank and master it
//! gives: torchrun (its agent's variables; the ranks meet through its store), the plain
//! torchrun-style variables (RANK, WORLD_SIZE, ... set by hand or by `--gpus N`), mpirun
//! (Open MPI's OMPI_COMM_WORLD_*, MPICH/Intel MPI's PMI_*), or srun (SLURM_PROCID, ...).
//!
//! The innermost launcher wins: torchrun and mpirun are often started inside a SLURM
//! allocation, whose variables then describe the outer job, not this process. Variables
//! that contradict each other (a rank at or past the world, Open MPI and PMI disagreeing,
//! RANK set by hand to the same value in every task of a launcher that numbers its tasks)
//! are refused before any rank waits, naming the variables and their values.

use super::nodelist;
use super::Topology;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Launcher {
    /// torchrun (TORCHELASTIC_* variables).
    Torchrun,
    /// RANK / WORLD_SIZE set by hand, a wrapper, or `cockpit train --gpus N`.
    Env,
    /// mpirun of Open MPI.
    OpenMpi,
    /// mpirun/mpiexec of MPICH or Intel MPI (PMI_RANK / PMI_SIZE).
    Pmi,
    /// srun.
    Slurm,
}

impl Launcher {
    pub fn name(self) -> &'static str {
        match self {
            Launcher::Torchrun => "torchrun",
            Launcher::Env => "RANK/WORLD_SIZE environment",
            Launcher::OpenMpi => "mpirun (Open MPI)",
            Launcher::Pmi => "mpirun (PMI)",
            Launcher::Slurm => "srun (SLURM)",
        }
    }
}

/// What the launcher gave this process.
#[derive(Clone, Debug, PartialEq)]
pub struct Launch {
    pub launcher: Launcher,
    pub topology: Topology,
    /// What was taken from where, for the run header: `VAR=value` and derived facts.
    pub taken: Vec<String>,
    /// torchrun: its agent serves a c10d TCPStore at MASTER_ADDR:MASTER_PORT
    /// (TORCHELASTIC_USE_AGENT_STORE), so the ranks meet through it.
    pub agent_store: bool,
    /// torchrun's TORCHELASTIC_RUN_ID ("none" for a static master).
    pub run_id: Option<String>,
    /// How often the launcher restarted this job: TORCHELASTIC_RESTART_COUNT, else
    /// SLURM_RESTART_COUNT (a requeued job); None when it has not.
    pub restart: Option<Restart>,
}

/// A launcher's count of restarts (> 0).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Restart {
    pub var: &'static str,
    pub count: u64,
}

impl Launch {
    /// One line for the run header: the launcher and what was taken from it.
    pub fn describe(&self) -> String {
        let mut s = format!(
            "launched by {}: {}",
            self.launcher.name(),
            self.taken.join(", ")
        );
        if let Some(r) = &self.restart {
            s.push_str(&format!(
                "; restart {} ({}={}): resumed from the run's latest checkpoint",
                r.count, r.var, r.count
            ));
        }
        s
    }
}

fn num(key: &str, v: &str) -> Result<usize, String> {
    v.trim()
        .parse::<usize>()
        .map_err(|_| format!("{key} = {v:?}: must be a non-negative integer"))
}

/// (rank, world, local rank) from one launcher's variables; None when neither its rank nor
/// its world variable is set.
fn triple(
    get: &impl Fn(&str) -> Option<String>,
    rank_var: &str,
    world_var: &str,
    local_var: Option<&str>,
) -> Result<Option<(usize, usize, Option<usize>)>, String> {
    let (rank, world) = (get(rank_var), get(world_var));
    let (rank, world) = match (rank, world) {
        (None, None) => return Ok(None),
        (Some(r), Some(w)) => (num(rank_var, &r)?, num(world_var, &w)?),
        (Some(r), None) => return Err(format!("{rank_var} = {r:?} is set but {world_var} is not")),
        (None, Some(w)) => return Err(format!("{world_var} = {w:?} is set but {rank_var} is not")),
    };
    if world == 0 {
        return Err(format!("{world_var} = \"0\": must be at least 1"));
    }
    if rank >= world {
        return Err(format!(
            "{rank_var} = {rank}: must be below {world_var} ({world})"
        ));
    }
    let local = match local_var.and_then(|k| get(k).map(|v| (k, v))) {
        Some((k, v)) => Some(num(k, &v)?),
        None => None,
    };
    Ok(Some((rank, world, local)))
}

fn port(key: &str, p: &str) -> Result<u16, String> {
    p.trim()
        .parse::<u16>()
        .map_err(|_| format!("{key} = {p:?}: must be a port number (0-65535)"))
}

/// The port SLURM ranks meet on without MASTER_PORT: one derived from the job id, so two
/// jobs sharing a node rarely collide (15000-34999).
pub fn slurm_port(job_id: u64) -> u16 {
    15000 + (job_id % 20000) as u16
}

fn restart_of(get: &impl Fn(&str) -> Option<String>) -> Result<Option<Restart>, String> {
    for var in ["TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"] {
        if let Some(v) = get(var) {
            let count = v
                .trim()
                .parse::<u64>()
                .map_err(|_| format!("{var} = {v:?}: must be a non-negative integer"))?;
            if count > 0 {
                return Ok(Some(Restart { var, count }));
            }
        }
    }
    Ok(None)
}

/// How often the launcher restarted this job (also for a single process, e.g. a requeued
/// SLURM job). Err names a variable that is not a count.
pub fn restart(get: impl Fn(&str) -> Option<String>) -> Result<Option<Restart>, String> {
    restart_of(&get)
}

/// A SLURM job's id (stable across requeues), when this process runs in one.
pub fn slurm_job_id(get: impl Fn(&str) -> Option<String>) -> Option<String> {
    get("SLURM_JOB_ID")
        .or_else(|| get("SLURM_JOBID"))
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
}

/// An MPI launcher's ranks: (which, rank, world, local rank, what was taken).
type MpiRanks = (Launcher, usize, usize, Option<usize>, Vec<String>);

fn mpi(get: &impl Fn(&str) -> Option<String>) -> Result<Option<MpiRanks>, String> {
    let ompi = triple(
        get,
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        Some("OMPI_COMM_WORLD_LOCAL_RANK"),
    )?;
    let pmi = triple(get, "PMI_RANK", "PMI_SIZE", Some("MPI_LOCALRANKID"))?;
    match (ompi, pmi) {
        (Some((r, w, _)), Some((pr, pw, _))) if (r, w) != (pr, pw) => Err(format!(
            "two launchers disagree: OMPI_COMM_WORLD_RANK = {r}, OMPI_COMM_WORLD_SIZE = {w}, but PMI_RANK = {pr}, PMI_SIZE = {pw}"
        )),
        (Some((r, w, l)), _) => {
            let mut taken = vec![
                format!("OMPI_COMM_WORLD_RANK={r}"),
                format!("OMPI_COMM_WORLD_SIZE={w}"),
            ];
            if let Some(l) = l {
                taken.push(format!("OMPI_COMM_WORLD_LOCAL_RANK={l}"));
            }
            Ok(Some((Launcher::OpenMpi, r, w, l, taken)))
        }
        (None, Some((r, w, l))) => {
            let mut taken = vec![format!("PMI_RANK={r}"), format!("PMI_SIZE={w}")];
            if let Some(l) = l {
                taken.push(format!("MPI_LOCALRANKID={l}"));
            }
            Ok(Some((Launcher::Pmi, r, w, l, taken)))
        }
        (None, None) => Ok(None),
    }
}

fn slurm(
    get: &impl Fn(&str) -> Option<String>,
) -> Result<Option<(usize, usize, Option<usize>)>, String> {
    if get("SLURM_PROCID").is_none() {
        return Ok(None);
    }
    let world_var = if get("SLURM_STEP_NUM_TASKS").is_some() && get("SLURM_NTASKS").is_none() {
        "SLURM_STEP_NUM_TASKS"
    } else {
        "SLURM_NTASKS"
    };
    triple(get, "SLURM_PROCID", world_var, Some("SLURM_LOCALID"))
}

/// The launcher of this process and the topology it gives; None when no launcher's
/// variables are set (a single process, or `--gpus N` about to launch). `default_addr` /
/// `default_port` (the config's) fill a master the environment does not name.
pub fn detect(
    get: impl Fn(&str) -> Option<String>,
    default_addr: &str,
    default_port: u16,
) -> Result<Option<Launch>, String> {
    let restart = restart_of(&get)?;
    let master_port = |taken: &mut Vec<String>, fallback: u16| -> Result<u16, String> {
        match get("MASTER_PORT") {
            Some(p) => {
                let p = port("MASTER_PORT", &p)?;
                taken.push(format!("MASTER_PORT={p}"));
                Ok(p)
            }
            None => Ok(fallback),
        }
    };
    // torchrun: its own variables, whatever else is set (it may run under srun).
    if get("TORCHELASTIC_RUN_ID").is_some() || get("TORCHELASTIC_RESTART_COUNT").is_some() {
        let (rank, world, local) = match triple(&get, "RANK", "WORLD_SIZE", Some("LOCAL_RANK"))? {
            Some(t) => t,
            None => {
                return Err(
                    "TORCHELASTIC_RUN_ID is set (torchrun) but RANK and WORLD_SIZE are not".into(),
                )
            }
        };
        let mut taken = vec![format!("RANK={rank}"), format!("WORLD_SIZE={world}")];
        if let Some(l) = local {
            taken.push(format!("LOCAL_RANK={l}"));
        }
        let master_addr = get("MASTER_ADDR").unwrap_or_else(|| default_addr.to_string());
        taken.push(format!("MASTER_ADDR={master_addr}"));
        let master_port = master_port(&mut taken, default_port)?;
        let agent_store = get("TORCHELASTIC_USE_AGENT_STORE")
            .is_some_and(|v| matches!(v.trim(), "True" | "true" | "1"));
        let run_id = get("TORCHELASTIC_RUN_ID");
        if let Some(id) = &run_id {
            taken.push(format!("TORCHELASTIC_RUN_ID={id}"));
        }
        taken.push(if agent_store {
            "the ranks meet through torchrun's store at MASTER_ADDR:MASTER_PORT".to_string()
        } else {
            "rank 0 listens at MASTER_ADDR:MASTER_PORT (no agent store)".to_string()
        });
        return Ok(Some(Launch {
            launcher: Launcher::Torchrun,
            topology: Topology {
                rank,
                world,
                local_rank: local.unwrap_or(rank),
                master_addr,
                master_port,
            },
            taken,
            agent_store,
            run_id,
            restart,
        }));
    }
    let mpi = mpi(&get)?;
    let slurm = slurm(&get)?;
    // RANK / WORLD_SIZE set by hand (or by `--gpus N`).
    if let Some(t) = Topology::from_env(&get, default_addr, default_port)? {
        // The same RANK in every task of a launcher that numbers its tasks (srun, mpirun)
        // would start several rank 0s: refuse it here rather than time out later.
        let others = mpi
            .iter()
            .map(|(l, r, w, _, _)| {
                let (rv, wv) = match l {
                    Launcher::OpenMpi => ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                    _ => ("PMI_RANK", "PMI_SIZE"),
                };
                (rv, wv, *r, *w)
            })
            .chain(
                slurm
                    .iter()
                    .filter(|_| get("SLURM_STEP_ID").is_some())
                    .map(|(r, w, _)| ("SLURM_PROCID", "SLURM_NTASKS", *r, *w)),
            );
        for (rv, wv, r, w) in others {
            if w == t.world && r != t.rank {
                return Err(format!(
                    "two launchers disagree: RANK = {}, but {rv} = {r} (WORLD_SIZE = {} = {wv}); set RANK per process, or unset RANK and WORLD_SIZE and let the launcher number the ranks",
                    t.rank, t.world
                ));
            }
        }
        let mut taken = vec![
            format!("RANK={}", t.rank),
            format!("WORLD_SIZE={}", t.world),
        ];
        if let Some(l) = get("LOCAL_RANK") {
            taken.push(format!("LOCAL_RANK={}", l.trim()));
        }
        taken.push(format!("master {}:{}", t.master_addr, t.master_port));
        return Ok(Some(Launch {
            launcher: Launcher::Env,
            topology: t,
            taken,
            agent_store: false,
            run_id: None,
            restart,
        }));
    }
    if let Some((launcher, rank, world, local, mut taken)) = mpi {
        let master_addr = match get("MASTER_ADDR") {
            Some(a) => a,
            None if world == 1 => default_addr.to_string(),
            None => {
                return Err(format!(
                    "{}: MASTER_ADDR is not set: mpirun does not name rank 0's host; set it to that host (Open MPI: mpirun -x MASTER_ADDR=HOST ...; MPICH: mpiexec -genv MASTER_ADDR HOST ...)",
                    launcher.name()
                ))
            }
        };
        taken.push(format!("MASTER_ADDR={master_addr}"));
        let master_port = master_port(&mut taken, default_port)?;
        if local.is_none() {
            taken.push(format!("local rank {rank} (no local rank variable)"));
        }
        return Ok(Some(Launch {
            launcher,
            topology: Topology {
                rank,
                world,
                local_rank: local.unwrap_or(rank),
                master_addr,
                master_port,
            },
            taken,
            agent_store: false,
            run_id: None,
            restart,
        }));
    }
    if let Some((rank, world, local)) = slurm {
        let mut taken = vec![
            format!("SLURM_PROCID={rank}"),
            format!("SLURM_NTASKS={world}"),
        ];
        if let Some(l) = local {
            taken.push(format!("SLURM_LOCALID={l}"));
        }
        let master_addr = match get("MASTER_ADDR") {
            Some(a) => {
                taken.push(format!("MASTER_ADDR={a}"));
                a
            }
            None => {
                let (var, list) = match (get("SLURM_STEP_NODELIST"), get("SLURM_JOB_NODELIST")) {
                    (Some(l), _) => ("SLURM_STEP_NODELIST", l),
                    (None, Some(l)) => ("SLURM_JOB_NODELIST", l),
                    (None, None) if world == 1 => ("", default_addr.to_string()),
                    (None, None) => {
                        return Err(
                            "srun: neither MASTER_ADDR nor SLURM_JOB_NODELIST is set: cannot tell rank 0's host"
                                .into(),
                        )
                    }
                };
                if var.is_empty() {
                    list
                } else {
                    let host = nodelist::first_host(&list)
                        .map_err(|e| format!("{var} = {list:?} does not parse: {e}"))?;
                    taken.push(format!("master {host} (the first host of {var}={list})"));
                    host
                }
            }
        };
        let job = slurm_job_id(&get);
        let fallback = match job.as_deref().map(str::parse::<u64>) {
            Some(Ok(id)) => Some(slurm_port(id)),
            _ => None,
        };
        let master_port = match (get("MASTER_PORT"), fallback) {
            (Some(_), _) => master_port(&mut taken, default_port)?,
            (None, Some(p)) => {
                taken.push(format!(
                    "port {p} (from SLURM_JOB_ID={})",
                    job.unwrap_or_default()
                ));
                p
            }
            (None, None) => default_port,
        };
        return Ok(Some(Launch {
            launcher: Launcher::Slurm,
            topology: Topology {
                rank,
                world,
                local_rank: local.unwrap_or(0),
                master_addr,
                master_port,
            },
            taken,
            agent_store: false,
            run_id: None,
            restart,
        }));
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    /// The launcher found and where this rank sits: (rank, world, local rank) and the master.
    fn assert_place(
        l: &Launch,
        launcher: Launcher,
        place: (usize, usize, usize),
        master: (&str, u16),
    ) {
        assert_eq!(l.launcher, launcher);
        let t = &l.topology;
        assert_eq!((t.rank, t.world, t.local_rank), place);
        assert_eq!((t.master_addr.as_str(), t.master_port), master);
    }

    fn launch(pairs: &[(&str, &str)]) -> Launch {
        detect(env(pairs), "127.0.0.1", 29500).unwrap().unwrap()
    }

    fn refused(pairs: &[(&str, &str)]) -> String {
        detect(env(pairs), "127.0.0.1", 29500).unwrap_err()
    }

    #[test]
    fn nothing_set_is_no_launcher() {
        assert_eq!(detect(env(&[]), "h", 1), Ok(None));
        // A SLURM allocation without a task id (e.g. salloc's shell) is no launcher either.
        assert_eq!(detect(env(&[("SLURM_JOB_ID", "7")]), "h", 1), Ok(None));
    }

    #[test]
    fn torchrun_wins_and_meets_through_its_store() {
        let l = launch(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "localhost"),
            ("MASTER_PORT", "43383"),
            ("TORCHELASTIC_RUN_ID", "abc"),
            ("TORCHELASTIC_RESTART_COUNT", "0"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
            // torchrun under srun: one task a node, SLURM numbers the agents, not the ranks.
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_STEP_ID", "0"),
        ]);
        assert_place(&l, Launcher::Torchrun, (1, 2, 1), ("localhost", 43383));
        assert!(l.agent_store);
        assert_eq!(l.run_id.as_deref(), Some("abc"));
        assert_eq!(l.restart, None);
        let d = l.describe();
        assert!(
            d.contains("torchrun") && d.contains("RANK=1") && d.contains("store"),
            "{d}"
        );
        // An older torchrun without the agent store: rank 0 listens as before.
        let l = launch(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("TORCHELASTIC_RUN_ID", "none"),
            ("TORCHELASTIC_USE_AGENT_STORE", "False"),
        ]);
        assert!(!l.agent_store);
        assert!(refused(&[("TORCHELASTIC_RUN_ID", "x")]).contains("RANK and WORLD_SIZE"));
    }

    #[test]
    fn restart_counts_come_from_torchrun_or_slurm() {
        let l = launch(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("TORCHELASTIC_RUN_ID", "r"),
            ("TORCHELASTIC_RESTART_COUNT", "2"),
        ]);
        assert_eq!(
            l.restart,
            Some(Restart {
                var: "TORCHELASTIC_RESTART_COUNT",
                count: 2
            })
        );
        assert!(l.describe().contains("restart 2"), "{}", l.describe());
        let l = launch(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_JOB_NODELIST", "n1"),
            ("SLURM_RESTART_COUNT", "1"),
        ]);
        assert_eq!(
            l.restart,
            Some(Restart {
                var: "SLURM_RESTART_COUNT",
                count: 1
            })
        );
        assert_eq!(restart(env(&[("SLURM_RESTART_COUNT", "0")])), Ok(None));
        assert_eq!(
            restart(env(&[("SLURM_RESTART_COUNT", "3")])),
            Ok(Some(Restart {
                var: "SLURM_RESTART_COUNT",
                count: 3
            }))
        );
        assert!(restart(env(&[("TORCHELASTIC_RESTART_COUNT", "x")]))
            .unwrap_err()
            .contains("TORCHELASTIC_RESTART_COUNT = \"x\""));
    }

    #[test]
    fn srun_takes_the_first_host_and_a_port_from_the_job() {
        let l = launch(&[
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_JOB_NODELIST", "gpu[07-10]"),
            ("SLURM_JOB_ID", "123456"),
        ]);
        assert_place(
            &l,
            Launcher::Slurm,
            (3, 8, 1),
            ("gpu07", slurm_port(123456)),
        );
        let d = l.describe();
        assert!(
            d.contains("SLURM_PROCID=3") && d.contains("first host of SLURM_JOB_NODELIST"),
            "{d}"
        );
        assert!(d.contains("SLURM_JOB_ID=123456"), "{d}");
        // MASTER_ADDR / MASTER_PORT win; the step's nodelist over the job's.
        let l = launch(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_JOB_NODELIST", "a1,b[2-3]"),
            ("MASTER_ADDR", "head"),
            ("MASTER_PORT", "4000"),
        ]);
        assert_eq!(
            (l.topology.master_addr.as_str(), l.topology.master_port),
            ("head", 4000)
        );
        let l = launch(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_JOB_NODELIST", "a1,b[2-3]"),
            ("SLURM_STEP_NODELIST", "b[2-3]"),
        ]);
        assert_eq!(l.topology.master_addr, "b2");
        let e = refused(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_JOB_NODELIST", "gpu[01-"),
        ]);
        assert!(
            e.contains("SLURM_JOB_NODELIST = \"gpu[01-\" does not parse"),
            "{e}"
        );
        let e = refused(&[("SLURM_PROCID", "2"), ("SLURM_NTASKS", "2")]);
        assert!(
            e.contains("SLURM_PROCID = 2: must be below SLURM_NTASKS (2)"),
            "{e}"
        );
        let e = refused(&[("SLURM_PROCID", "1")]);
        assert!(e.contains("SLURM_NTASKS is not"), "{e}");
        let e = refused(&[("SLURM_PROCID", "1"), ("SLURM_NTASKS", "2")]);
        assert!(
            e.contains("MASTER_ADDR") && e.contains("SLURM_JOB_NODELIST"),
            "{e}"
        );
    }

    #[test]
    fn mpirun_needs_master_addr_and_its_variables_must_agree() {
        let l = launch(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("MASTER_ADDR", "node0"),
        ]);
        assert_place(&l, Launcher::OpenMpi, (1, 4, 1), ("node0", 29500));
        let l = launch(&[
            ("PMI_RANK", "2"),
            ("PMI_SIZE", "3"),
            ("MPI_LOCALRANKID", "0"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "5555"),
        ]);
        assert_eq!(l.launcher, Launcher::Pmi);
        assert_eq!(
            (
                l.topology.rank,
                l.topology.local_rank,
                l.topology.master_port
            ),
            (2, 0, 5555)
        );
        let e = refused(&[("OMPI_COMM_WORLD_RANK", "1"), ("OMPI_COMM_WORLD_SIZE", "2")]);
        assert!(e.contains("MASTER_ADDR is not set"), "{e}");
        let e = refused(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("PMI_RANK", "0"),
            ("PMI_SIZE", "2"),
            ("MASTER_ADDR", "h"),
        ]);
        assert!(
            e.contains("two launchers disagree")
                && e.contains("OMPI_COMM_WORLD_RANK = 1")
                && e.contains("PMI_RANK = 0"),
            "{e}"
        );
        let e = refused(&[("PMI_RANK", "5"), ("PMI_SIZE", "4"), ("MASTER_ADDR", "h")]);
        assert!(
            e.contains("PMI_RANK = 5: must be below PMI_SIZE (4)"),
            "{e}"
        );
        // mpirun inside a SLURM allocation: mpirun numbers the ranks.
        let l = launch(&[
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "4"),
            ("MASTER_ADDR", "h"),
        ]);
        assert_eq!((l.launcher, l.topology.rank), (Launcher::OpenMpi, 3));
    }

    #[test]
    fn a_rank_set_by_hand_that_contradicts_the_launcher_is_refused() {
        let e = refused(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_STEP_ID", "0"),
        ]);
        assert!(e.contains("RANK = 0, but SLURM_PROCID = 1"), "{e}");
        let e = refused(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
        ]);
        assert!(e.contains("OMPI_COMM_WORLD_RANK = 1"), "{e}");
        // Agreeing, or describing another world (an outer allocation): RANK wins.
        let l = launch(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_STEP_ID", "0"),
        ]);
        assert_eq!((l.launcher, l.topology.rank), (Launcher::Env, 1));
        let l = launch(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "4"),
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
        ]);
        assert_eq!(l.topology.world, 4);
    }
}
