//! The training engine through its public interface: Engine::spawn, Commands in, Events out.

mod common;

use cockpit::config::{self, Config};
use cockpit::engine::events::{Command, Event, FinishReason, StepStats};
use cockpit::engine::faults::Faults;
use cockpit::engine::{Engine, EngineOptions};
use cockpit::util::DeviceSpec;
use common::spawn;
use std::path::Path;
use std::time::Duration;

/// [`common::SMALL`] without a final checkpoint.
fn small(overrides: &[&str]) -> Config {
    common::small(&[&["checkpoint.at_end=false"], overrides].concat())
}

fn run_to_end(cfg: Config, dir: &Path) -> Vec<Event> {
    collect(spawn(cfg, dir))
}

/// Every event of a run, to its end.
fn collect(e: Engine) -> Vec<Event> {
    let mut events = Vec::new();
    while let Some(ev) = e.events.recv() {
        let done = matches!(ev, Event::Finished { .. });
        events.push(ev);
        if done {
            break;
        }
    }
    e.thread.wait().unwrap();
    events
}

fn steps(events: &[Event]) -> Vec<StepStats> {
    events
        .iter()
        .filter_map(|e| {
            if let Event::Step(s) = e {
                Some(s.clone())
            } else {
                None
            }
        })
        .collect()
}

/// The embedded default learns: val bits/token ends within 15% of the corpus's entropy floor.
#[test]
fn default_config_learns_toward_the_entropy_floor() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config::load(
        None,
        &[
            "checkpoint.every_steps=0".into(),
            "checkpoint.at_end=false".into(),
        ],
    )
    .unwrap()
    .config;
    let events = run_to_end(cfg, dir.path());
    let floor = events
        .iter()
        .find_map(|e| {
            if let Event::RunStarted(r) = e {
                r.entropy_floor_bpt
            } else {
                None
            }
        })
        .unwrap();
    let evals: Vec<f64> = events
        .iter()
        .filter_map(|e| {
            if let Event::Eval(v) = e {
                Some(v.val_bpt)
            } else {
                None
            }
        })
        .collect();
    let last = *evals.last().unwrap();
    eprintln!("entropy floor {floor:.3} bits/token; val bits/token by eval: {evals:?}");
    assert!(
        last <= floor * 1.15,
        "val {last:.3} bits/token is not within 15% of the floor {floor:.3}"
    );
    assert!(evals[0] > last, "the loss fell");
}

/// micro-batch 4 × accum 2 computes the same steps as micro-batch 8 × accum 1.
#[test]
fn accumulation_matches_a_bigger_micro_batch() {
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    // The law is pinned: the adaptive law reads κ from Adam's v̂ after the first step, where
    // elements with gradients near 0 make it sensitive to summation order (0.5% between these
    // two runs), and its κ trend carries that into λ; log-pi reads S alone.
    let base = [
        "run.max_steps=5",
        "scu.control_every=1",
        "scu.law=\"log-pi\"",
        "model.dropout=0.0",
    ];
    let ev_a = run_to_end(
        small(&[&base[..], &["optim.micro_batch=4", "optim.accum=2"]].concat()),
        a.path(),
    );
    let ev_b = run_to_end(
        small(&[&base[..], &["optim.micro_batch=8", "optim.accum=1"]].concat()),
        b.path(),
    );
    let (sa, sb) = (steps(&ev_a), steps(&ev_b));
    assert_eq!(sa.len(), 5);
    for (x, y) in sa.iter().zip(&sb) {
        assert!(
            (x.loss - y.loss).abs() < 1e-4,
            "step {}: {} vs {}",
            x.step,
            x.loss,
            y.loss
        );
        assert!(
            (x.grad_norm - y.grad_norm).abs() / y.grad_norm < 1e-3,
            "step {}: grad norm {} vs {}",
            x.step,
            x.grad_norm,
            y.grad_norm
        );
        assert_eq!(x.tokens, y.tokens);
    }
}

/// SetBatchSize, Pause/Resume and Stop apply at the next optimizer-step boundary.
#[test]
fn commands_take_effect_at_the_next_boundary() {
    let dir = tempfile::tempdir().unwrap();
    let e = spawn(small(&["run.max_steps=100000"]), dir.path());
    let next_step = |e: &Engine| loop {
        match e.events.recv_timeout(Duration::from_secs(60)).unwrap() {
            Event::Step(s) => return s,
            _ => continue,
        }
    };
    assert_eq!(next_step(&e).micro_batch, 8);
    e.commands
        .send(Command::SetBatchSize { micro_batch: 16 })
        .unwrap();
    e.commands
        .send(Command::SetBatchSize { micro_batch: 0 })
        .unwrap();
    let (mut applied, mut rejected) = (None, None);
    while applied.is_none() || rejected.is_none() {
        match e.events.recv_timeout(Duration::from_secs(60)).unwrap() {
            Event::CommandApplied {
                step,
                command: Command::SetBatchSize { .. },
                ..
            } => applied = Some(step),
            Event::CommandRejected {
                command: Command::SetBatchSize { micro_batch: 0 },
                reason,
                ..
            } => rejected = Some(reason),
            Event::Step(s) => assert!(applied.is_none() || s.micro_batch == 16),
            _ => {}
        }
    }
    let s = next_step(&e);
    assert_eq!(s.micro_batch, 16);
    assert_eq!(
        s.step,
        applied.unwrap() + 1,
        "applied at the boundary, the very next step uses it"
    );

    e.commands.send(Command::Pause).unwrap();
    let paused_at = loop {
        if let Event::Paused { step } = e.events.recv_timeout(Duration::from_secs(60)).unwrap() {
            break step;
        }
    };
    // While paused no step runs: the loop waits for commands only. A second pause is
    // answered (rejected) from that wait, with no step before the answer.
    e.commands.send(Command::Pause).unwrap();
    let mut drained = Vec::new();
    loop {
        let ev = e.events.recv_timeout(Duration::from_secs(60)).unwrap();
        let rejected = matches!(ev, Event::CommandRejected { .. });
        drained.push(ev);
        if rejected {
            break;
        }
    }
    assert!(
        drained.iter().all(|ev| !matches!(ev, Event::Step(_))),
        "{drained:?}"
    );
    e.commands.send(Command::Resume).unwrap();
    assert_eq!(next_step(&e).step, paused_at + 1);

    e.commands.send(Command::Stop { save: false }).unwrap();
    let finished = loop {
        if let Event::Finished { reason, step, .. } =
            e.events.recv_timeout(Duration::from_secs(60)).unwrap()
        {
            break (reason, step);
        }
    };
    assert_eq!(finished.0, FinishReason::Stopped);
    let summary = e.thread.wait().unwrap();
    assert_eq!(summary.step, finished.1);
}

/// A consumer that never reads does not stall the engine: Step events are dropped and counted.
#[test]
fn a_slow_consumer_never_blocks_the_engine() {
    let dir = tempfile::tempdir().unwrap();
    let e = Engine::spawn(EngineOptions {
        max_queued_steps: 4,
        ..EngineOptions::new(
            small(&["run.max_steps=30"]),
            dir.path().to_path_buf(),
            DeviceSpec::Cpu,
        )
    })
    .unwrap();
    let summary = e.thread.wait().unwrap(); // finishes although nobody reads
    assert_eq!(summary.step, 30);
    let got = e.events.drain();
    assert_eq!(
        got.iter().filter(|ev| matches!(ev, Event::Step(_))).count(),
        4
    );
    assert!(e.events.dropped() >= 26);
    assert!(
        matches!(got.last(), Some(Event::Finished { .. })),
        "non-step events are never dropped"
    );
    // metrics.jsonl has every step regardless.
    let lines = std::fs::read_to_string(dir.path().join("metrics.jsonl")).unwrap();
    assert_eq!(
        lines
            .lines()
            .filter(|l| l.contains("\"event\":\"step\""))
            .count(),
        30
    );
}

#[test]
fn events_round_trip_through_serde() {
    let dir = tempfile::tempdir().unwrap();
    let events = run_to_end(
        small(&[
            "run.max_steps=4",
            "eval.every=2",
            "scu.control_every=2",
            "checkpoint.every_steps=2",
        ]),
        dir.path(),
    );
    for ev in &events {
        let text = serde_json::to_string(ev).unwrap();
        let back: Event = serde_json::from_str(&text).unwrap();
        assert_eq!(&back, ev);
    }
    for kind in [
        "run_started",
        "step",
        "eval",
        "scu",
        "checkpoint_saved",
        "finished",
    ] {
        assert!(
            events.iter().any(|e| serde_json::to_string(e)
                .unwrap()
                .contains(&format!("\"event\":\"{kind}\""))),
            "{kind}"
        );
    }
}

/// Out of memory at a step (not after a batch change): the micro-batch is split and the
/// accumulation raised so each optimizer step trains on the same sequences, the step is
/// redone, the user is told, and the run goes on exactly as one configured that way.
#[test]
fn out_of_memory_splits_the_micro_batch_and_keeps_the_step() {
    let set = ["run.max_steps=6", "optim.micro_batch=8", "optim.accum=1"];
    let dir = tempfile::tempdir().unwrap();
    let events = collect(
        Engine::spawn(EngineOptions {
            max_queued_steps: 100_000,
            faults: Faults {
                oom_above: Some(2),
                ..Faults::default()
            },
            ..EngineOptions::new(small(&set), dir.path().to_path_buf(), DeviceSpec::Cpu)
        })
        .unwrap(),
    );
    let warnings: Vec<&String> = events
        .iter()
        .filter_map(|e| match e {
            Event::Warning { message, .. } => Some(message),
            _ => None,
        })
        .collect();
    assert!(
        warnings
            .iter()
            .any(|m| m.contains("out of memory at micro-batch 8"))
            && warnings
                .iter()
                .any(|m| m.contains("micro-batch 2 × accumulation 4")),
        "{warnings:?}"
    );
    let got = steps(&events);
    let dir2 = tempfile::tempdir().unwrap();
    let want = steps(&run_to_end(
        small(&["run.max_steps=6", "optim.micro_batch=2", "optim.accum=4"]),
        dir2.path(),
    ));
    assert_eq!(got.len(), 6);
    for (a, b) in got.iter().zip(&want) {
        assert_eq!(a.loss, b.loss, "step {}", a.step);
    }
}
