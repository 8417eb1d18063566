//! Host CPU and resident memory of the processes on the GPUs, from `/proc` (Linux): what
//! `top` shows for them, beside the GPU memory NVML reports. CPU is the share of one core
//! between two samples (a busy multi-threaded process can exceed 100%).

use crate::advisor::ProcessStat;
use crate::telemetry::Snapshot;
use std::collections::HashMap;

/// CPU time and when it was read, per process.
#[derive(Debug, Default)]
pub(crate) struct ProcSampler {
    last: HashMap<u32, (u64, u64)>,
}

/// Clock ticks per second and the page size, from the C library.
fn ticks_and_page() -> (f64, u64) {
    // SAFETY: sysconf only reads configuration values.
    let (ticks, page) = unsafe {
        (
            libc::sysconf(libc::_SC_CLK_TCK),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    (
        if ticks > 0 { ticks as f64 } else { 100.0 },
        u64::try_from(page).ok().filter(|p| *p > 0).unwrap_or(4096),
    )
}

/// User plus system CPU time in clock ticks, from the text of `/proc/PID/stat`.
pub(crate) fn cpu_ticks(stat: &str) -> Option<u64> {
    // the command name is in parentheses and may hold spaces: fields count from its end
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // after the name: state(0) … utime(11) stime(12)
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(utime + stime)
}

impl ProcSampler {
    /// The processes of every GPU in `snapshot`, each once.
    pub(crate) fn sample(&mut self, snapshot: &Snapshot) -> Vec<ProcessStat> {
        let (ticks_per_s, page) = ticks_and_page();
        let mut pids: Vec<u32> = snapshot
            .gpus
            .iter()
            .flat_map(|g| g.processes.iter().map(|p| p.pid))
            .collect();
        pids.sort_unstable();
        pids.dedup();
        let now = snapshot.timestamp_ms;
        let mut next = HashMap::new();
        let stats = pids
            .into_iter()
            .map(|pid| {
                let ticks = std::fs::read_to_string(format!("/proc/{pid}/stat"))
                    .ok()
                    .and_then(|s| cpu_ticks(&s));
                let cpu_pct = ticks.and_then(|t| {
                    next.insert(pid, (t, now));
                    let (t0, at0) = *self.last.get(&pid)?;
                    let dt = now.checked_sub(at0).filter(|d| *d > 0)? as f64 / 1000.0;
                    Some(t.saturating_sub(t0) as f64 / ticks_per_s / dt * 100.0)
                });
                let rss_bytes = std::fs::read_to_string(format!("/proc/{pid}/statm"))
                    .ok()
                    .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
                    .map(|pages| pages * page);
                ProcessStat {
                    pid,
                    cpu_pct,
                    rss_bytes,
                }
            })
            .collect();
        self.last = next;
        stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::{GpuProcess, GpuSample};

    #[test]
    fn parses_cpu_time_past_a_name_with_spaces() {
        let stat = "4242 (my (odd) proc) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 8";
        assert_eq!(cpu_ticks(stat), Some(300));
        assert_eq!(cpu_ticks("garbage"), None);
    }

    #[test]
    fn samples_this_process() {
        let me = std::process::id();
        let snapshot = |t| Snapshot {
            timestamp_ms: t,
            gpus: vec![GpuSample {
                processes: vec![GpuProcess {
                    pid: me,
                    ..GpuProcess::default()
                }],
                ..GpuSample::default()
            }],
            ..Snapshot::default()
        };
        let mut s = ProcSampler::default();
        let first = s.sample(&snapshot(1_000));
        assert_eq!(first.len(), 1);
        assert_eq!(first[0].cpu_pct, None, "CPU needs two samples");
        assert!(first[0].rss_bytes.is_some_and(|b| b > 0));
        let second = s.sample(&snapshot(3_000));
        assert!(second[0].cpu_pct.is_some_and(|c| c >= 0.0));
    }
}
