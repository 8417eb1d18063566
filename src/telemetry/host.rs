//! The host side of the sampler (sysinfo): CPU, RAM, this process's RSS, and the names and
//! users of the processes NVML lists on the GPUs.

use std::collections::HashMap;

use sysinfo::{Pid, ProcessRefreshKind, ProcessesToUpdate, System, Uid, UpdateKind, Users};

use super::{round_pct, GpuProcess, HostSample};

/// Name shown for a GPU process the host cannot see (e.g. another PID namespace).
const UNKNOWN_PROCESS: &str = "unknown";

/// Samples host CPU/RAM and resolves process names.
pub(crate) struct HostSampler {
    /// `None` when sysinfo cannot read the system at all; samples are then zero.
    system: Option<System>,
    own_pid: Pid,
    users: Option<Users>,
    user_names: HashMap<Uid, Option<String>>,
}

impl HostSampler {
    /// Start sampling. The first CPU figure is meaningful only after
    /// [`sysinfo::MINIMUM_CPU_UPDATE_INTERVAL`] has passed since this call.
    pub(crate) fn new() -> Self {
        let system = match System::new() {
            Ok(mut system) => {
                system.refresh_cpu_usage();
                Some(system)
            }
            Err(err) => {
                tracing::warn!(%err, "cannot read host statistics; host metrics are zero");
                None
            }
        };
        Self {
            system,
            own_pid: Pid::from_u32(std::process::id()),
            users: None,
            user_names: HashMap::new(),
        }
    }

    /// CPU load since the previous call, RAM, and this process's resident set size.
    pub(crate) fn sample(&mut self) -> HostSample {
        let Some(system) = self.system.as_mut() else {
            return HostSample::default();
        };
        system.refresh_cpu_usage();
        system.refresh_memory();
        system.refresh_processes_specifics(
            ProcessesToUpdate::Some(&[self.own_pid]),
            true,
            ProcessRefreshKind::nothing().with_memory(),
        );
        let cpu = f64::from(system.global_cpu_usage());
        HostSample {
            cpu_pct: if cpu.is_finite() {
                round_pct(cpu.clamp(0.0, 100.0))
            } else {
                0.0
            },
            cpu_cores: system.cpus().len(),
            ram_used_bytes: system.used_memory(),
            ram_total_bytes: system.total_memory(),
            self_rss_bytes: system.process(self.own_pid).map_or(0, |p| p.memory()),
        }
    }

    /// Fill in `name` and `user` of GPU processes from the host's process table.
    pub(crate) fn describe_processes<'a>(
        &mut self,
        processes: impl IntoIterator<Item = &'a mut GpuProcess>,
    ) {
        let mut processes: Vec<&mut GpuProcess> = processes.into_iter().collect();
        if processes.is_empty() {
            return;
        }
        let Some(system) = self.system.as_mut() else {
            for p in processes {
                p.name = UNKNOWN_PROCESS.to_string();
            }
            return;
        };
        let pids: Vec<Pid> = processes.iter().map(|p| Pid::from_u32(p.pid)).collect();
        system.refresh_processes_specifics(
            ProcessesToUpdate::Some(&pids),
            true,
            ProcessRefreshKind::nothing().with_user(UpdateKind::OnlyIfNotSet),
        );
        let found: Vec<(String, Option<Uid>)> = pids
            .iter()
            .map(|pid| match system.process(*pid) {
                Some(proc_) => (
                    proc_.name().to_string_lossy().into_owned(),
                    proc_.user_id().cloned(),
                ),
                None => (UNKNOWN_PROCESS.to_string(), None),
            })
            .collect();
        for (p, (name, uid)) in processes.iter_mut().zip(found) {
            p.name = name;
            p.user = uid.and_then(|uid| self.user_name(uid));
        }
    }

    /// The login name of a user id, looked up once and remembered.
    fn user_name(&mut self, uid: Uid) -> Option<String> {
        if let Some(known) = self.user_names.get(&uid) {
            return known.clone();
        }
        if self.users.is_none() {
            self.users = Users::new_with_refreshed_list().ok();
        }
        let name = self
            .users
            .as_ref()
            .and_then(|users| users.get_user_by_id(&uid))
            .map(|user| user.name().to_string());
        self.user_names.insert(uid, name.clone());
        name
    }
}
