//! `--max-steps N` (train, sweep) as config overrides: the run's length and the warm-up it
//! scales with it.

use super::flag_sets::FlagSets;
use crate::config::{self, ConfigError};
use std::path::Path;

/// The warm-up of a run that `--max-steps n` cuts (or stretches) from `total` steps, where it
/// changes: shortened with the run, in proportion — the embedded default warms up 50 of its 600
/// steps, so a 60-step run warms up 5, not 50 — so that `--max-steps` alone always works and a
/// shortened run keeps the schedule's shape. A warm-up given with `--set` (`explicit`) stays as
/// given unless it is longer than the run.
fn warmup_for_max_steps(w: u64, total: u64, n: u64, explicit: bool) -> Option<u64> {
    (w > n || (!explicit && n < total)).then(|| (w * n / total.max(1)).min(n))
}

/// Whether `--set` flags give the warm-up.
fn sets_warmup(set: &[String]) -> bool {
    set.iter()
        .any(|kv| kv.trim_start().starts_with("schedule.warmup_steps"))
}

/// Pushes `--max-steps n` onto `overrides` (those of `set` and the flags before it): the run's
/// length and, where [`warmup_for_max_steps`] changes it, the warm-up. A config that is wrong
/// whatever the warm-up gets its own errors, without the warm-up complaint the scaling would
/// have settled.
pub(super) fn push(
    config: Option<&Path>,
    set: &[String],
    overrides: &mut Vec<String>,
    flags: &mut FlagSets,
    n: u64,
) -> Result<(), ConfigError> {
    let flag = format!("--max-steps {n}");
    match config::load(config, overrides) {
        Ok(base) => {
            let c = &base.config;
            let (w, total) = (c.schedule.warmup_steps, c.run.max_steps);
            if let Some(w) = warmup_for_max_steps(w, total, n, sets_warmup(set)) {
                flags.push(
                    overrides,
                    format!("schedule.warmup_steps={w}"),
                    flag.clone(),
                );
            }
        }
        Err(_) => {
            // (The probe's own overrides blamed on the flag apart from `flags`, which only
            // hold what the run gets.)
            let (mut probe, mut probed) = (overrides.clone(), FlagSets::default());
            probed.push(&mut probe, "schedule.warmup_steps=0".into(), flag.clone());
            probed.push(&mut probe, format!("run.max_steps={n}"), flag.clone());
            config::load(config, &probe).map_err(|e| probed.blame(flags.blame(e)))?;
        }
    }
    flags.push(overrides, format!("run.max_steps={n}"), flag);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::warmup_for_max_steps as w;

    #[test]
    fn max_steps_shortens_the_warmup_in_proportion() {
        // The embedded default (50 of 600): 60 steps warm up 5, 20 steps 1; no shorter run
        // warms up longer than it lasts, none of the same length or longer changes.
        assert_eq!(w(50, 600, 60, false), Some(5));
        assert_eq!(w(50, 600, 20, false), Some(1));
        assert_eq!(w(50, 600, 600, false), None);
        assert_eq!(w(50, 600, 1200, false), None);
        // Given with --set: kept unless longer than the run.
        assert_eq!(w(10, 600, 60, true), None);
        assert_eq!(w(100, 600, 60, true), Some(10));
    }
}
