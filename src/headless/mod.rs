//! Headless front end (`--no-tui`, or stdout not a terminal): a progress line every few seconds
//! on stderr plus one line per notable event. `metrics.jsonl` is written by the engine itself,
//! so it is complete whatever the front end does.

use crate::advisor::MonitorUpdate;
use crate::engine::events::{
    Command, EvalStats, Event, EventRx, FinishReason, RunInfo, ScuStats, StepStats,
};
use crate::tui::fmt;
use crate::tui::state::Eta;
use crate::util::{human_count, human_duration};
use std::io::Write;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

pub use crate::process::SignalFlags;

#[cfg(test)]
pub(crate) mod fixtures;

/// What the progress line knows.
#[derive(Default)]
pub struct Progress {
    pub run: Option<RunInfo>,
    pub step: Option<StepStats>,
    pub eval: Option<EvalStats>,
    pub scu: Option<ScuStats>,
    pub telemetry: Option<MonitorUpdate>,
    /// The run is paused: no progress lines until it resumes.
    pub paused: bool,
    /// The time left, by the dashboard's formula.
    pub eta: Eta,
}

impl Progress {
    pub fn observe(&mut self, ev: &Event) {
        self.eta.observe(ev);
        match ev {
            Event::RunStarted(r) => self.run = Some(r.clone()),
            Event::Step(s) => self.step = Some(s.clone()),
            Event::Eval(e) => self.eval = Some(e.clone()),
            Event::Scu(s) => self.scu = Some(s.clone()),
            Event::Paused { .. } => self.paused = true,
            Event::Resumed { .. } | Event::Finished { .. } => self.paused = false,
            _ => {}
        }
    }

    /// `step 1200/5000 | loss 1.532 | val 1.611 ± 0.012 | lr 3.0e-4 | 41.2k tok/s | ETA 12m | GPU … | CPU 45% | RAM 67%`
    pub fn line(&self) -> Option<String> {
        let s = self.step.as_ref()?;
        let max = self.run.as_ref().map(|r| r.max_steps).unwrap_or(s.step);
        let mut parts = vec![
            format!("step {}/{}", s.step, max),
            format!("loss {:.3}", s.loss),
        ];
        if let Some(e) = &self.eval {
            parts.push(format!(
                "val {}",
                crate::util::plus_minus(e.val_loss, e.val_loss_se, 3)
            ));
        }
        parts.push(format!("lr {:.1e}", s.lr));
        parts.push(format!("{} tok/s", human_count(s.tokens_per_sec)));
        if let Some(eta) = self.eta.eta_s(s.step, max) {
            parts.push(format!("ETA {}", fmt::duration(eta)));
        }
        if s.ranks.len() > 1 {
            let ms: Vec<String> = s
                .ranks
                .iter()
                .map(|r| {
                    let util = r
                        .gpu_util_pct
                        .map(|u| format!(" {u:.0}%"))
                        .unwrap_or_default();
                    format!("r{} {:.0}ms{util}", r.rank, r.compute_ms)
                })
                .collect();
            parts.push(format!("ranks {} comm {:.0}ms", ms.join(" "), s.comm_ms));
        }
        if let Some(scu) = &self.scu {
            parts.push(format!(
                "S {:.2}% (S* {:.2}%) λ {:.3}",
                scu.s_ratio * 100.0,
                scu.target * 100.0,
                scu.lambda
            ));
        }
        if let Some(t) = &self.telemetry {
            for g in &t.snapshot.gpus {
                let mut gpu = format!(
                    "GPU{} {} ({:.0}%)",
                    g.index,
                    fmt::bytes_of(g.mem_used_bytes, g.mem_total_bytes),
                    g.mem_used_frac() * 100.0
                );
                if let Some(u) = g.util_gpu {
                    gpu.push_str(&format!(" util {u}%"));
                }
                parts.push(gpu);
            }
            let h = &t.snapshot.host;
            parts.push(format!("CPU {:.0}%", h.cpu_pct));
            if h.ram_total_bytes > 0 {
                parts.push(format!(
                    "RAM {:.0}%",
                    h.ram_used_bytes as f64 / h.ram_total_bytes as f64 * 100.0
                ));
            }
        }
        Some(parts.join(" | "))
    }
}

/// One line for events worth their own line (None for Step/Scu, which the progress line covers).
pub fn event_line(ev: &Event) -> Option<String> {
    Some(match ev {
        Event::RunStarted(r) => {
            let floor = r
                .entropy_floor_bpt
                .map(|f| format!(", entropy floor {f:.3} bits/token"))
                .unwrap_or_default();
            format!(
                "run {} in {}\n  device {} | dtype {} ({})\n  {} params ({} trainable) | micro-batch {} × accum {} × seq {}{}\n  {}",
                r.run_name,
                r.run_dir,
                r.device,
                r.dtype,
                r.dtype_reason,
                human_count(r.params_total as f64),
                human_count(r.params_trainable as f64),
                r.micro_batch,
                r.accum,
                r.seq_len,
                floor,
                r.summary
            )
        }
        Event::Eval(e) => format!(
            "eval  step {} | val loss {} | {} bits/token | ppl {:.2}{}",
            e.step,
            crate::util::plus_minus(e.val_loss, e.val_loss_se, 4),
            crate::util::plus_minus(e.val_bpt, e.val_bpt_se, 3),
            e.val_ppl,
            if e.val_tokens > 0 {
                format!(" | {} tokens", human_count(e.val_tokens as f64))
            } else {
                String::new()
            }
        ),
        Event::ScuConverged {
            step,
            s_ratio,
            lambda,
            target,
        } => {
            format!(
                "scu   step {step} | converged: S {:.2}% at S* {:.2}%, λ {lambda:.4}",
                s_ratio * 100.0,
                target * 100.0
            )
        }
        Event::CheckpointSaved {
            step,
            path,
            bytes,
            ms,
        } => format!(
            "ckpt  step {step} | {path} ({}, {ms:.0} ms)",
            fmt::bytes(*bytes)
        ),
        Event::CommandApplied { step, detail, .. } => format!("cmd   step {step} | {detail}"),
        Event::CommandRejected {
            step,
            command,
            reason,
        } => format!("cmd   step {step} | rejected {}: {reason}", command.label()),
        Event::Warning { step, message } => format!("warn  step {step} | {message}"),
        Event::Sample { step, prompt, text } => format!(
            "text  step {step} | {} ⟶ {}",
            prompt.escape_debug(),
            text.escape_debug()
        ),
        Event::SampleDiversity {
            step,
            prompts,
            samples_per_prompt,
            tokens_per_s,
            distinct_1,
            distinct_2,
            distinct_3,
            cosine_distance,
            ..
        } => {
            let f = |v: &Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.3}"));
            format!(
                "text  step {step} | {prompts} prompts × {samples_per_prompt} samples ({tokens_per_s:.0} tok/s): distinct-1/2/3 {} {} {}, cosine distance {}",
                f(distinct_1),
                f(distinct_2),
                f(distinct_3),
                f(cosine_distance)
            )
        }
        Event::Finished {
            step,
            reason,
            message,
            elapsed_s,
        } => {
            format!(
                "done  step {step} | {reason:?}: {message} | {}",
                human_duration(*elapsed_s)
            )
        }
        Event::Paused { step } => {
            format!("pause step {step} | paused: no progress lines until the run resumes")
        }
        // the run loop adds how long the pause lasted
        Event::Resumed { step } => format!("resume step {step} | resumed"),
        Event::Step(_) | Event::Scu(_) => return None,
    })
}

/// The terminal went away: the run goes on, its output from now on in `path`.
pub fn hang_up(path: &Path, out: &mut dyn Write) {
    let run_dir = path.parent().unwrap_or(Path::new("."));
    match crate::process::redirect_output(path) {
        Ok(()) => {
            let _ = writeln!(
                out,
                "SIGHUP: the terminal went away; the run goes on, printing here (attach a dashboard with `cockpit attach {}`)",
                run_dir.display()
            );
        }
        Err(e) => tracing::warn!("SIGHUP: cannot move the output to {}: {e}", path.display()),
    }
}

/// The advisor's warnings as lines: each once when it starts to stand (again, after it
/// cleared). Info-level advice stays on the dashboard.
#[derive(Default)]
pub struct AdviceLines {
    standing: std::collections::BTreeSet<(String, Option<u32>)>,
}

impl AdviceLines {
    pub fn update(&mut self, recs: &[crate::advisor::Recommendation]) -> Vec<String> {
        let warn: Vec<&crate::advisor::Recommendation> = recs
            .iter()
            .filter(|r| r.severity >= crate::advisor::Severity::Warn)
            .collect();
        let now: std::collections::BTreeSet<(String, Option<u32>)> =
            warn.iter().map(|r| (r.id.clone(), r.gpu)).collect();
        let lines = warn
            .iter()
            .filter(|r| !self.standing.contains(&(r.id.clone(), r.gpu)))
            .map(|r| {
                let level = if r.severity == crate::advisor::Severity::Critical {
                    "CRITICAL "
                } else {
                    ""
                };
                format!("advice | {level}{}. {}", r.message, r.action)
            })
            .collect();
        self.standing = now;
        lines
    }
}

/// How the front end ended.
#[derive(Default)]
pub struct HeadlessOutcome {
    pub finished: Option<FinishReason>,
    /// A terminate signal arrived.
    pub interrupted: bool,
}

/// Where the headless front end writes, and where its output goes when the terminal hangs
/// up (`hangup_log`: the run goes on and prints there; None: the output stays where it is).
pub struct Output<'a> {
    pub out: &'a mut dyn Write,
    pub hangup_log: Option<&'a Path>,
    /// The run, when its `RunStarted` event went to an earlier front end (the dashboard).
    pub run: Option<RunInfo>,
}

/// Print progress until the engine finishes. Signals become commands; a hang-up (SIGHUP)
/// moves the output to `hangup_log` and the run goes on.
pub fn run(
    events: EventRx,
    commands: Sender<Command>,
    telemetry: Option<Receiver<MonitorUpdate>>,
    signals: &SignalFlags,
    log_every: Duration,
    output: Output<'_>,
) -> HeadlessOutcome {
    let Output {
        out,
        hangup_log,
        run,
    } = output;
    let mut p = Progress {
        run,
        ..Progress::default()
    };
    let mut last_line = Instant::now();
    let mut interrupted = false;
    let mut printed_step = 0;
    let mut advice = AdviceLines::default();
    let mut paused_at: Option<Instant> = None;
    loop {
        if signals.terminate.load(Ordering::SeqCst) && !interrupted {
            interrupted = true;
            let signal = signals.terminate_name();
            let _ = writeln!(
                out,
                "signal: {signal}: saving a checkpoint, then stopping (send it again to quit at once)"
            );
            let _ = commands.send(Command::Interrupt {
                signal: signal.into(),
            });
        }
        if signals.hangup.swap(false, Ordering::SeqCst) {
            if let Some(path) = hangup_log {
                hang_up(path, out);
            }
        }
        if signals.checkpoint.swap(false, Ordering::SeqCst) {
            let _ = commands.send(Command::CheckpointNow);
        }
        if let Some(rx) = &telemetry {
            while let Ok(u) = rx.try_recv() {
                for l in advice.update(&u.advice) {
                    let _ = writeln!(out, "{l}");
                }
                p.telemetry = Some(u);
            }
        }
        match events.recv_timeout(Duration::from_millis(100)) {
            Ok(ev) => {
                p.observe(&ev);
                // (The last progress line before the run's end, not after it.)
                if matches!(ev, Event::Finished { .. }) {
                    if let Some(l) = p
                        .line()
                        .filter(|_| p.step.as_ref().is_some_and(|s| s.step != printed_step))
                    {
                        let _ = writeln!(out, "{l}");
                    }
                }
                if let Some(l) = event_line(&ev) {
                    match (&ev, paused_at) {
                        (Event::Resumed { .. }, Some(at)) => {
                            let _ = writeln!(
                                out,
                                "{l} after {}",
                                fmt::clock(at.elapsed().as_secs_f64())
                            );
                        }
                        _ => {
                            let _ = writeln!(out, "{l}");
                        }
                    }
                }
                match &ev {
                    Event::Paused { .. } => paused_at = paused_at.or(Some(Instant::now())),
                    Event::Resumed { .. } => {
                        paused_at = None;
                        // the next progress line comes a full interval after the resume
                        last_line = Instant::now();
                    }
                    _ => {}
                }
                if let Event::Finished { reason, .. } = ev {
                    return HeadlessOutcome {
                        finished: Some(reason),
                        interrupted,
                    };
                }
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => {
                return HeadlessOutcome {
                    finished: None,
                    interrupted,
                }
            }
        }
        if last_line.elapsed() >= log_every && !p.paused {
            if let Some(l) = p.line() {
                printed_step = p.step.as_ref().map(|s| s.step).unwrap_or(0);
                let _ = writeln!(out, "{l}");
                last_line = Instant::now();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::fixtures::{run_info, step_stats};
    use super::{AdviceLines, Output, SignalFlags};
    use crate::advisor::{MonitorUpdate, Recommendation, Severity};
    use crate::engine::events::{self, Event, FinishReason};
    use crate::telemetry::{GpuSample, Snapshot};
    use std::time::Duration;

    fn step(step: u64) -> Event {
        Event::Step(step_stats(step, step as f64 * 0.5, 500.0))
    }

    /// The headless output for these events, with a progress line after every event.
    fn output(evs: Vec<Event>, telemetry: Option<MonitorUpdate>) -> String {
        output_every(evs, telemetry, Duration::ZERO)
    }

    /// The headless output for these events, a progress line at most every `every`.
    fn output_every(evs: Vec<Event>, telemetry: Option<MonitorUpdate>, every: Duration) -> String {
        let (tx, rx) = events::channel(1000);
        for ev in evs {
            tx.send(ev);
        }
        let (cmd_tx, _cmd_rx) = std::sync::mpsc::channel();
        let (tel_tx, tel_rx) = std::sync::mpsc::channel();
        if let Some(u) = telemetry {
            let _ = tel_tx.send(u);
        }
        let mut out = Vec::new();
        super::run(
            rx,
            cmd_tx,
            Some(tel_rx),
            &SignalFlags::default(),
            every,
            Output {
                out: &mut out,
                hangup_log: None,
                run: None,
            },
        );
        String::from_utf8(out).unwrap_or_default()
    }

    #[test]
    fn a_pause_prints_paused_and_resumed_instead_of_progress() {
        let text = output(
            vec![
                Event::RunStarted(run_info()),
                step(1),
                step(2),
                Event::Paused { step: 2 },
                Event::Warning {
                    step: 2,
                    message: "while paused".into(),
                },
                Event::Resumed { step: 2 },
                step(3),
                Event::Finished {
                    step: 3,
                    reason: FinishReason::Completed,
                    message: String::new(),
                    elapsed_s: 2.0,
                },
            ],
            None,
        );
        let lines: Vec<&str> = text.lines().collect();
        let paused = lines
            .iter()
            .position(|l| l.starts_with("pause step 2 | paused"));
        let resumed = lines
            .iter()
            .position(|l| l.starts_with("resume step 2 | resumed after 0:0"));
        let (Some(paused), Some(resumed)) = (paused, resumed) else {
            panic!("{text}");
        };
        assert!(
            lines[paused + 1..resumed]
                .iter()
                .all(|l| !l.starts_with("step ")),
            "no progress line while paused:\n{text}"
        );
        assert!(lines[..paused].iter().any(|l| l.starts_with("step 2/100")));
        // the ETA by the dashboard's formula: 97 steps at 0.5 s (the paused interval left out)
        assert!(
            text.contains("step 3/100 | loss 2.000 | lr 1.0e-3 | 1.0k tok/s | ETA 49s"),
            "{text}"
        );
    }

    #[test]
    fn the_last_progress_line_comes_before_the_end() {
        // Progress lines an hour apart: only the end brings the last step's line out.
        let text = output_every(
            vec![
                Event::RunStarted(run_info()),
                step(1),
                step(2),
                Event::Finished {
                    step: 2,
                    reason: FinishReason::Completed,
                    message: "reached max_steps (2)".into(),
                    elapsed_s: 1.0,
                },
            ],
            None,
            Duration::from_secs(3600),
        );
        let lines: Vec<&str> = text.lines().collect();
        let last = lines.iter().position(|l| l.starts_with("step 2/100"));
        let end = lines.iter().position(|l| l.contains("reached max_steps"));
        match (last, end) {
            (Some(a), Some(b)) => assert!(a < b, "{text}"),
            _ => panic!("{text}"),
        }
    }

    #[test]
    fn gpu_memory_and_checkpoints_are_in_binary_units() {
        let gib = 1u64 << 30;
        let update = MonitorUpdate {
            snapshot: Snapshot {
                timestamp_ms: 1,
                gpus: vec![GpuSample {
                    index: 0,
                    mem_used_bytes: 8 * gib + gib / 5,
                    mem_total_bytes: 16 * gib,
                    util_gpu: Some(85),
                    ..GpuSample::default()
                }],
                ..Snapshot::default()
            },
            advice: Vec::new(),
            processes: Vec::new(),
        };
        let text = output(
            vec![
                Event::RunStarted(run_info()),
                step(1),
                Event::CheckpointSaved {
                    step: 1,
                    path: "runs/t/checkpoints/step-00000001".into(),
                    bytes: 3 * gib / 2,
                    ms: 12.0,
                },
                Event::Finished {
                    step: 1,
                    reason: FinishReason::Completed,
                    message: String::new(),
                    elapsed_s: 1.0,
                },
            ],
            Some(update),
        );
        assert!(text.contains("GPU0 8.2/16.0 GiB (51%) util 85%"), "{text}");
        assert!(text.contains("(1.5 GiB, 12 ms)"), "{text}");
    }

    fn rec(id: &str, severity: Severity) -> Recommendation {
        Recommendation {
            id: id.into(),
            severity,
            gpu: None,
            message: format!("{id} message"),
            evidence: Vec::new(),
            action: "do this".into(),
            key: None,
        }
    }

    #[test]
    fn advice_lines_print_each_warning_once_while_it_stands() {
        let mut a = AdviceLines::default();
        let climb = rec("memory_climb", Severity::Critical);
        let info = rec("mem_low", Severity::Info);
        assert_eq!(
            a.update(&[climb.clone(), info.clone()]),
            vec!["advice | CRITICAL memory_climb message. do this".to_string()]
        );
        assert!(a.update(std::slice::from_ref(&climb)).is_empty());
        assert!(a.update(&[]).is_empty());
        assert_eq!(a.update(&[climb]).len(), 1, "again after it cleared");
    }
}
