//! Checkpoints, exact resume and fault tolerance.

mod common;

use cockpit::config::Config;
use cockpit::engine::events::{Command, Event, FinishReason};
use cockpit::engine::faults::Faults;
use cockpit::engine::{checkpoint, Engine, EngineError, EngineOptions};
use cockpit::util::DeviceSpec;
use std::path::{Path, PathBuf};
use std::process::{Command as Proc, Stdio};
use std::time::{Duration, Instant};

/// What these runs add to [`common::SMALL`]: a short warm-up, no final checkpoint, and dropout
/// (so a resume must restore the dropout stream too).
const OWN: &[&str] = &[
    "schedule.warmup_steps=2",
    "checkpoint.at_end=false",
    "model.dropout=0.1",
];

/// The whole list as `--set` values, for the runs started through the binary.
fn small_sets() -> impl Iterator<Item = &'static str> {
    common::SMALL.iter().chain(OWN).copied()
}

fn small(extra: &[&str]) -> Config {
    common::small(&[OWN, extra].concat())
}

fn opts(cfg: Config, dir: &Path, resume: Option<PathBuf>, faults: Vec<u64>) -> EngineOptions {
    EngineOptions {
        resume,
        faults: Faults {
            nan_steps: faults,
            ..Faults::default()
        },
        ..EngineOptions::new(cfg, dir.to_path_buf(), DeviceSpec::Cpu)
    }
}

/// Run to the end; optionally send Stop{save} once `stop_after` steps were seen.
fn run(
    o: EngineOptions,
    stop_after: Option<u64>,
) -> (Vec<Event>, Result<cockpit::engine::RunSummary, EngineError>) {
    let e = Engine::spawn(o).unwrap_or_else(|e| panic!("{e}"));
    let mut out = Vec::new();
    while let Some(ev) = e.events.recv() {
        if let (Event::Step(s), Some(n)) = (&ev, stop_after) {
            if s.step == n {
                e.commands.send(Command::Stop { save: true }).unwrap();
            }
        }
        let done = matches!(ev, Event::Finished { .. });
        out.push(ev);
        if done {
            break;
        }
    }
    (out, e.thread.wait())
}

fn losses(events: &[Event]) -> Vec<(u64, f64)> {
    events
        .iter()
        .filter_map(|e| {
            if let Event::Step(s) = e {
                Some((s.step, s.loss))
            } else {
                None
            }
        })
        .collect()
}

/// On CPU a resumed run's losses are bitwise those of an uninterrupted run: stopped once at a
/// fixed odd step (between two SCU control steps) and once by a Stop command wherever it lands.
#[test]
fn resume_reproduces_the_uninterrupted_run_bitwise() {
    resume_bitwise("data.sampling=\"aligned\"");
}

/// The same across random windows (they start anywhere: the checkpoint falls mid-stream).
#[test]
fn resume_across_random_windows_is_bitwise() {
    resume_bitwise("data.sampling=\"random\"");
}

fn resume_bitwise(sampling: &str) {
    let base = ["scu.control_every=2", "schedule.kind=constant", sampling];
    let with = |extra: &[&str]| {
        let v: Vec<&str> = base.iter().chain(extra).copied().collect();
        small(&v)
    };
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (full, r) = run(
        opts(with(&["run.max_steps=24"]), a.path(), None, vec![]),
        None,
    );
    r.unwrap();
    let (first, r) = run(
        opts(
            with(&["run.max_steps=11", "checkpoint.at_end=true"]),
            b.path(),
            None,
            vec![],
        ),
        None,
    );
    assert_eq!(r.unwrap().step, 11);
    let resume = |stop_after| {
        run(
            opts(
                with(&["run.max_steps=24"]),
                b.path(),
                Some(b.path().to_path_buf()),
                vec![],
            ),
            stop_after,
        )
    };
    let (second, r) = resume(Some(16));
    assert_eq!(r.unwrap().reason, FinishReason::Stopped);
    let (third, r) = resume(None);
    assert_eq!(r.unwrap().step, 24);
    let resumed: Vec<(u64, f64)> = [first, second, third]
        .iter()
        .flat_map(|e| losses(e))
        .collect();
    assert_eq!(resumed.len(), 24);
    assert_eq!(
        resumed,
        losses(&full),
        "losses after the resume differ from the uninterrupted run"
    );
}

/// Safe config changes on resume are reported; shape changes are refused.
#[test]
fn resume_checks_config_changes() {
    let dir = tempfile::tempdir().unwrap();
    run(
        opts(
            small(&["run.max_steps=4", "checkpoint.at_end=true"]),
            dir.path(),
            None,
            vec![],
        ),
        None,
    )
    .1
    .unwrap();
    let (ev, r) = run(
        opts(
            small(&[
                "run.max_steps=6",
                "optim.lr=0.002",
                "checkpoint.at_end=true",
            ]),
            dir.path(),
            Some(dir.path().into()),
            vec![],
        ),
        None,
    );
    r.unwrap();
    let notes: Vec<String> = ev
        .iter()
        .filter_map(|e| {
            if let Event::Warning { message, .. } = e {
                Some(message.clone())
            } else {
                None
            }
        })
        .collect();
    assert!(notes.iter().any(|n| n.contains("optim.lr")), "{notes:?}");
    assert!(
        notes.iter().any(|n| n.contains("run.max_steps")),
        "{notes:?}"
    );
    let err = Engine::spawn(opts(
        small(&["run.max_steps=8", "model.n_layer=3"]),
        dir.path(),
        Some(dir.path().into()),
        vec![],
    ))
    .err()
    .unwrap();
    assert!(err.to_string().contains("model.n_layer"), "{err}");
    assert!(err.is_usage());
    // A max_steps the checkpoint (step 6) is already past: refused as a usage error, before
    // anything of the run's is rewritten.
    let config = std::fs::read(dir.path().join("training_config.json")).unwrap();
    let err = Engine::spawn(opts(
        small(&["run.max_steps=3"]),
        dir.path(),
        Some(dir.path().into()),
        vec![],
    ))
    .err()
    .unwrap();
    let msg = err.to_string();
    assert!(
        msg.contains("step 6") && msg.contains("run.max_steps = 3"),
        "{msg}"
    );
    assert!(err.is_usage());
    assert_eq!(
        std::fs::read(dir.path().join("training_config.json")).unwrap(),
        config
    );
}

/// `model.recompute` changes what the fast step keeps for the backward, not the model: a run
/// resumes with another setting (reported as a config change) and goes on from its step.
#[test]
fn resume_with_another_recompute_setting_is_allowed() {
    let dir = tempfile::tempdir().unwrap();
    run(
        opts(
            small(&["run.max_steps=2", "checkpoint.at_end=true"]),
            dir.path(),
            None,
            vec![],
        ),
        None,
    )
    .1
    .unwrap();
    let (ev, r) = run(
        opts(
            small(&["run.max_steps=4", "model.recompute=full"]),
            dir.path(),
            Some(dir.path().into()),
            vec![],
        ),
        None,
    );
    let summary = r.unwrap_or_else(|e| panic!("resume with model.recompute = full: {e}"));
    assert_eq!(summary.step, 4);
    assert_eq!(
        losses(&ev).first().map(|l| l.0),
        Some(3),
        "resumed at step 2"
    );
    let noted = ev.iter().any(
        |e| matches!(e, Event::Warning { message, .. } if message.contains("model.recompute")),
    );
    assert!(noted, "the changed key is reported");
}

/// NaN steps are skipped and counted; N in a row restore the last checkpoint with a lower LR.
#[test]
fn nan_steps_are_skipped_then_the_last_checkpoint_is_restored() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = small(&[
        "run.max_steps=30",
        "checkpoint.every_steps=10",
        "checkpoint.max_nonfinite_in_a_row=3",
    ]);
    let (ev, r) = run(opts(cfg, dir.path(), None, vec![5, 14, 15, 16]), None);
    let summary = r.unwrap();
    assert_eq!(summary.step, 30);
    let warns: Vec<String> = ev
        .iter()
        .filter_map(|e| {
            if let Event::Warning { message, .. } = e {
                Some(message.clone())
            } else {
                None
            }
        })
        .collect();
    assert!(
        warns.iter().any(|w| w.contains("step 5 skipped")),
        "{warns:?}"
    );
    assert!(
        warns
            .iter()
            .any(|w| w.contains("restored") && w.contains("LR × 0.5")),
        "{warns:?}"
    );
    // After the restore the run went back to step 10 and continued.
    let steps: Vec<u64> = losses(&ev).iter().map(|(s, _)| *s).collect();
    assert!(
        steps.windows(2).any(|w| w[1] == 11 && w[0] == 15),
        "{steps:?}"
    );

    // Diverging forever: a clear failure after max_restores.
    let dir = tempfile::tempdir().unwrap();
    let cfg = small(&[
        "run.max_steps=40",
        "checkpoint.every_steps=2",
        "checkpoint.max_nonfinite_in_a_row=2",
        "checkpoint.max_restores=2",
    ]);
    let (_, r) = run(opts(cfg, dir.path(), None, (3..40).collect()), None);
    assert!(matches!(r, Err(EngineError::NonFinite { .. })), "{r:?}");
}

/// A corrupt or truncated checkpoint is named in the error, and nothing is overwritten.
#[test]
fn corrupt_checkpoints_are_detected() {
    let dir = tempfile::tempdir().unwrap();
    run(
        opts(
            small(&["run.max_steps=2", "checkpoint.at_end=true"]),
            dir.path(),
            None,
            vec![],
        ),
        None,
    )
    .1
    .unwrap();
    let ckpt = checkpoint::resolve(dir.path()).unwrap();
    let model = ckpt.join("model.safetensors");
    let mut bytes = std::fs::read(&model).unwrap();
    let n = bytes.len();
    bytes[n - 10] ^= 0xFF;
    std::fs::write(&model, &bytes).unwrap();
    let err = checkpoint::load(&ckpt, &candle_core::Device::Cpu)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("model.safetensors") && err.contains("checksum"),
        "{err}"
    );
    std::fs::write(&model, &bytes[..n / 2]).unwrap();
    let err = checkpoint::load(&ckpt, &candle_core::Device::Cpu)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("model.safetensors") && err.contains("truncated"),
        "{err}"
    );
    let out = Proc::new(env!("CARGO_BIN_EXE_cockpit"))
        .args(["train", "--no-tui", "--resume"])
        .arg(dir.path())
        .args(small_sets().flat_map(|s| ["--set", s]))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("model.safetensors"));
}

fn spawn_cli(dir: &Path, extra: &[&str]) -> std::process::Child {
    let mut sets: Vec<&str> = Vec::new();
    for s in small_sets() {
        sets.push(s);
    }
    sets.extend_from_slice(extra);
    Proc::new(env!("CARGO_BIN_EXE_cockpit"))
        .args(["train", "--no-tui", "--run-dir"])
        .arg(dir)
        .args(sets.iter().flat_map(|s| ["--set", s]))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn signal(child: &std::process::Child, sig: i32) {
    // SAFETY: sending a signal to our own child process.
    unsafe { libc::kill(child.id() as i32, sig) };
}

/// kill -9 at random moments while checkpoints are written: `latest` always loads.
#[test]
fn kill_9_during_checkpoint_writes_never_breaks_latest() {
    let iterations: usize = std::env::var("COCKPIT_KILL_ITERATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    let dir = tempfile::tempdir().unwrap();
    let mut rng = 0x2545F4914F6CDD1Du64;
    let mut loaded = 0;
    for i in 0..iterations {
        let resume = if i > 0 && checkpoint::resolve(dir.path()).is_ok() {
            vec!["--resume".to_string()]
        } else {
            vec![]
        };
        // killed before its first checkpoint: its records are archived, the run starts over
        let fresh = resume.is_empty().then_some("--fresh");
        let mut child = Proc::new(env!("CARGO_BIN_EXE_cockpit"))
            .args(["train", "--no-tui", "--run-dir"])
            .arg(dir.path())
            .args(&resume)
            .args(resume.iter().map(|_| dir.path().display().to_string()))
            .args(fresh)
            .args(
                small_sets()
                    .chain([
                        "run.max_steps=100000",
                        "checkpoint.every_steps=1",
                        "checkpoint.keep_last=2",
                    ])
                    .flat_map(|s| ["--set", s]),
            )
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        std::thread::sleep(Duration::from_millis(400 + rng % 600));
        signal(&child, libc::SIGKILL);
        child.wait().unwrap();
        if let Ok(d) = checkpoint::resolve(dir.path()) {
            checkpoint::load(&d, &candle_core::Device::Cpu)
                .unwrap_or_else(|e| panic!("iteration {i}: latest does not load: {e}"));
            loaded += 1;
        }
    }
    assert!(
        loaded >= iterations / 2,
        "checkpoints were written in most iterations ({loaded}/{iterations})"
    );
}

/// Headless: SIGUSR1 saves and continues; SIGTERM saves and exits with 130.
#[test]
fn sigusr1_checkpoints_and_sigterm_saves_and_exits_130() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = spawn_cli(dir.path(), &["run.max_steps=100000"]);
    let t0 = Instant::now();
    while !dir.path().join("metrics.jsonl").is_file()
        || std::fs::read_to_string(dir.path().join("metrics.jsonl"))
            .unwrap()
            .matches("\"step\"")
            .count()
            < 3
    {
        assert!(t0.elapsed() < Duration::from_secs(60));
        std::thread::sleep(Duration::from_millis(50));
    }
    signal(&child, libc::SIGUSR1);
    let t0 = Instant::now();
    while checkpoint::resolve(dir.path()).is_err() {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "SIGUSR1 wrote no checkpoint"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        child.try_wait().unwrap().is_none(),
        "the run continues after SIGUSR1"
    );
    let first = checkpoint::resolve(dir.path()).unwrap();
    // Let the run go on past that checkpoint, so the one SIGTERM saves is a newer step.
    let steps = || {
        std::fs::read_to_string(dir.path().join("metrics.jsonl"))
            .map(|m| m.matches("\"step\"").count())
            .unwrap_or(0)
    };
    let at_usr1 = steps();
    common::wait_until(
        "two more steps after SIGUSR1",
        Duration::from_secs(60),
        || steps() >= at_usr1 + 2,
    );
    signal(&child, libc::SIGTERM);
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(130));
    let last = checkpoint::resolve(dir.path()).unwrap();
    assert_ne!(first, last, "SIGTERM saved a newer checkpoint");
    checkpoint::load(&last, &candle_core::Device::Cpu).unwrap();
}

/// A resume keeps the controller's state (λ, the setpoint) but takes gains and limits from
/// the config it is resumed with, so an edited `scu.kp` or `scu.lambda_max` applies. (The
/// published law, pinned: Kp is its gain; the adaptive law has none.)
#[test]
fn resume_takes_scu_gains_and_limits_from_the_new_config() {
    let dir = tempfile::tempdir().unwrap();
    let first = small(&[
        "run.max_steps=4",
        "checkpoint.at_end=true",
        "scu.control_every=1",
        "scu.law=\"reference\"",
    ]);
    let (_, r) = run(opts(first, dir.path(), None, vec![]), None);
    let before = r.unwrap();
    assert!(before.final_lambda > 0.0);
    let lambda_max = before.final_lambda / 2.0;
    let edited = small(&[
        "run.max_steps=5",
        "checkpoint.at_end=true",
        "scu.control_every=100",
        "scu.law=\"reference\"",
        "scu.kp=7.5",
        &format!("scu.lambda_max={lambda_max}"),
        &format!("scu.lambda_init={}", lambda_max / 2.0),
    ]);
    let (_, r) = run(
        opts(edited, dir.path(), Some(dir.path().into()), vec![]),
        None,
    );
    assert_eq!(r.unwrap().step, 5);
    let l = checkpoint::load(
        &checkpoint::resolve(dir.path()).unwrap(),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    assert_eq!(l.state.step, 5);
    assert_eq!(l.state.scu.kp, 7.5);
    assert_eq!(l.state.scu.lambda_max, lambda_max);
    assert_eq!(
        l.state.scu.lambda, lambda_max,
        "λ clamped into the new limits"
    );
}

/// Wait until `dir`'s metrics.jsonl has at least `n` step events.
fn wait_for_steps(dir: &Path, n: usize) {
    let t0 = Instant::now();
    while std::fs::read_to_string(dir.join("metrics.jsonl"))
        .map(|t| t.matches("\"event\":\"step\"").count())
        .unwrap_or(0)
        < n
    {
        assert!(t0.elapsed() < Duration::from_secs(120), "no {n} steps");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// SIGINT (headless) is logged as an interruption, not as a stop command, and every end
/// prints a summary — run dir, steps, losses, checkpoints, plots — with the plots written.
#[test]
fn sigint_is_an_interruption_with_a_summary_and_plots() {
    let dir = tempfile::tempdir().unwrap();
    let child = spawn_cli(
        dir.path(),
        &["run.max_steps=100000", "eval.every=2", "eval.batches=1"],
    );
    wait_for_steps(dir.path(), 3);
    signal(&child, libc::SIGINT);
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(130));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("Interrupted: interrupted by SIGINT at step"),
        "{err}"
    );
    assert!(!err.contains("stopped by command"), "{err}");
    for row in [
        "cockpit: run ended: interrupted at step",
        "run dir",
        "steps",
        "loss",
        "best ckpt",
        "last ckpt",
        "plots",
        "resume with",
    ] {
        assert!(err.contains(row), "summary lacks {row:?}:\n{err}");
    }
    let best = dir.path().join("checkpoints").join("best");
    assert!(
        best.is_file() || err.contains("no checkpoint with a val loss"),
        "{err}"
    );
    let plots: Vec<_> = std::fs::read_dir(dir.path().join("plots"))
        .unwrap()
        .flatten()
        .collect();
    assert!(!plots.is_empty(), "plots written after an interruption");
}

/// SIGHUP (the terminal went away): the run goes on, its output moved to cockpit.out, and
/// its control socket stays; SIGTERM then saves and ends it.
#[test]
fn sighup_leaves_the_run_going_headless() {
    let dir = tempfile::tempdir().unwrap();
    let child = spawn_cli(
        dir.path(),
        &["run.max_steps=100000", "run.log_every_secs=0.2"],
    );
    wait_for_steps(dir.path(), 2);
    signal(&child, libc::SIGHUP);
    let t0 = Instant::now();
    let log = dir.path().join("cockpit.out");
    while !std::fs::read_to_string(&log).is_ok_and(|t| t.contains("SIGHUP")) {
        assert!(t0.elapsed() < Duration::from_secs(30), "no SIGHUP note");
        std::thread::sleep(Duration::from_millis(50));
    }
    let steps = |d: &Path| {
        std::fs::read_to_string(d.join("metrics.jsonl"))
            .unwrap()
            .matches("\"event\":\"step\"")
            .count()
    };
    let before = steps(dir.path());
    wait_for_steps(dir.path(), before + 3);
    let mut child = child;
    assert!(child.try_wait().unwrap().is_none(), "still running");
    assert!(
        cockpit::attach::socket_candidates(dir.path())
            .iter()
            .any(|p| p.exists()),
        "the control socket stays for `cockpit attach`"
    );
    signal(&child, libc::SIGTERM);
    assert_eq!(child.wait().unwrap().code(), Some(130));
    let out = std::fs::read_to_string(&log).unwrap();
    assert!(
        out.contains("interrupted by SIGTERM") && out.contains("cockpit: run ended"),
        "{out}"
    );
    checkpoint::load(
        &checkpoint::resolve(dir.path()).unwrap(),
        &candle_core::Device::Cpu,
    )
    .unwrap();
}

/// `--resume latest --run-dir DIR` resumes DIR's latest checkpoint (wherever DIR is, whatever
/// its name); a DIR without one is a usage error naming it.
#[test]
fn resume_latest_with_a_run_dir_means_that_run() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("my-own-name");
    let first = Proc::new(env!("CARGO_BIN_EXE_cockpit"))
        .args(["train", "--no-tui", "--max-steps", "3", "--run-dir"])
        .arg(&run_dir)
        .args(
            small_sets()
                .chain(["checkpoint.at_end=true"])
                .flat_map(|s| ["--set", s]),
        )
        .output()
        .unwrap();
    assert!(
        first.status.success(),
        "{}",
        String::from_utf8_lossy(&first.stderr)
    );
    let second = Proc::new(env!("CARGO_BIN_EXE_cockpit"))
        .current_dir(dir.path())
        .args([
            "train",
            "--no-tui",
            "--max-steps",
            "5",
            "--resume",
            "latest",
            "--run-dir",
        ])
        .arg(&run_dir)
        .args(
            small_sets()
                .chain(["checkpoint.at_end=true"])
                .flat_map(|s| ["--set", s]),
        )
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&second.stderr);
    assert!(second.status.success(), "{err}");
    let started: Vec<u64> = std::fs::read_to_string(run_dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["event"] == "run_started")
        .filter_map(|v| v["start_step"].as_u64())
        .collect();
    assert_eq!(started, vec![0, 3], "the second run resumed at step 3");
    let empty = dir.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let out = Proc::new(env!("CARGO_BIN_EXE_cockpit"))
        .args(["train", "--no-tui", "--resume", "latest", "--run-dir"])
        .arg(&empty)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--resume latest --run-dir") && err.contains("empty"),
        "{err}"
    );
}
