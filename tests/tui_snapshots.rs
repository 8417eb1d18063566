//! Dashboard tests: every view rendered on ratatui's `TestBackend` from canned event streams
//! (insta snapshots), key → command mapping, the quit flow, pending commands, bounded chart
//! history, themes and colour fallback.

use cockpit::advisor::{MonitorUpdate, ProcessStat, Recommendation, Severity};
use cockpit::engine::events::{
    Command, EvalStats, Event, FinishReason, RunInfo, ScuStats, StepStats,
};
use cockpit::telemetry::{GpuProcess, GpuSample, HostSample, Snapshot};
use cockpit::tui::state::{History, ThinnedSeries};
use cockpit::tui::{
    Action, App, ColorSupport, KeyAction, KeyBinding, Keymap, KeymapError, QuitChoice, RunStatus,
    Theme, ThemeError, TuiExit, TuiOptions,
};
use crossterm::event::{KeyCode, KeyEvent, KeyEventKind, KeyModifiers};
use ratatui::backend::TestBackend;
use ratatui::style::Color;
use ratatui::Terminal;
use std::collections::HashMap;

// ------------------------------------------------------------------ canned data

const GIB: u64 = 1024 * 1024 * 1024;

fn run_info(scu_enabled: bool) -> RunInfo {
    RunInfo {
        run_name: "tiny-shakespeare-12L".into(),
        run_dir: "runs/tiny-shakespeare-12L".into(),
        device: "cuda:0 (NVIDIA H100 80GB HBM3)".into(),
        dtype: "bf16".into(),
        dtype_reason: "bf16 supported (sm_90)".into(),
        params_total: 124_000_000,
        params_trainable: 124_000_000,
        start_step: 0,
        max_steps: 5000,
        micro_batch: 16,
        accum: 4,
        seq_len: 512,
        vocab_size: 50_257,
        train_tokens: 300_000_000,
        entropy_floor_bpt: None,
        flops_per_token: 7.44e8,
        peak_flops: Some(989e12),
        attention_flops_fwd: None,
        mamba_flops: None,
        scu_enabled,
        scu_target: 0.01,
        summary: "12 layers · d_model 768 · 12 heads · AdamW lr 6e-4 cosine".into(),
    }
}

fn loss_at(step: u64) -> f64 {
    let s = step as f64;
    2.1 + 8.0 * (-s / 250.0).exp() + 0.08 * (s * 0.7).sin()
}

fn step_stats(step: u64) -> StepStats {
    let s = step as f64;
    let tokens = step * 16 * 4 * 512;
    StepStats {
        step,
        loss: loss_at(step),
        lr: if step < 100 {
            6e-4 * s / 100.0
        } else {
            6e-4 * (0.5 + 0.5 * (std::f64::consts::PI * (s - 100.0) / 4900.0).cos())
        },
        grad_norm: 0.6 + 2.0 * (-s / 150.0).exp() + 0.1 * (s * 1.3).sin().abs(),
        tokens_per_sec: 180_000.0,
        step_ms: 182.0,
        data_wait_ms: 3.0,
        compute_ms: 170.0,
        optim_ms: 9.0,
        micro_batch: 16,
        accum: 4,
        tokens,
        epoch: tokens as f64 / 300_000_000.0,
        elapsed_s: s * 0.182,
        memory_bytes: Some(41 * GIB),
        host_rss_bytes: None,
        dropped_before: 0,
        comm_ms: 0.0,
        ranks: vec![],
        kernels: vec![],
        trained_share: None,
    }
}

fn scu_stats(step: u64) -> ScuStats {
    let s = step as f64;
    let s_ratio = 0.01 + 0.03 * (-s / 250.0).exp();
    ScuStats {
        step,
        ce_loss: loss_at(step),
        reg_loss: 0.01,
        total_loss: loss_at(step) + 0.01,
        data_bpt: 3.1,
        param_bpt: 0.03,
        s_ratio,
        s_hat: s_ratio,
        lambda: (1e-4 * (s / 200.0).exp()).min(3e-2),
        integral: 0.0,
        error: s_ratio - 0.01,
        target: 0.01,
        control: true,
    }
}

/// A realistic run up to `last` steps: start, steps with SCU, evals, checkpoints, a batch
/// change, a warning and SCU convergence.
fn canned_run(last: u64, scu_enabled: bool) -> Vec<Event> {
    let mut events = vec![Event::RunStarted(run_info(scu_enabled))];
    for step in 1..=last {
        events.push(Event::Step(step_stats(step)));
        if scu_enabled {
            events.push(Event::Scu(scu_stats(step)));
        }
        if step % 200 == 0 {
            events.push(Event::Eval(EvalStats {
                step,
                val_loss: loss_at(step) + 0.12,
                val_bpt: (loss_at(step) + 0.12) / std::f64::consts::LN_2,
                val_ppl: (loss_at(step) + 0.12).exp(),
                val_loss_se: 0.03,
                val_bpt_se: 0.03 / std::f64::consts::LN_2,
                val_tokens: 65_536,
            }));
        }
        if step % 500 == 0 {
            events.push(Event::CheckpointSaved {
                step,
                path: format!("runs/tiny-shakespeare-12L/ckpt-{step:06}"),
                bytes: 1_490_000_000,
                ms: 840.0,
            });
        }
        if step == 730 {
            events.push(Event::Warning {
                step,
                message: "loss spike: 4.1 vs EMA 2.6 (skipped update)".into(),
            });
        }
        if step == 800 && scu_enabled {
            events.push(Event::CommandApplied {
                step,
                command: Command::SetScuSetpoint { target: 0.01 },
                detail: "S* 1.00%".into(),
            });
        }
        if step == 1100 && scu_enabled {
            events.push(Event::ScuConverged {
                step,
                s_ratio: 0.0101,
                lambda: 2.4e-3,
                target: 0.01,
            });
        }
    }
    events
}

fn gpu(index: u32, util: u32, mem_gib: u64, temp: u32, power: f64) -> GpuSample {
    GpuSample {
        index,
        name: "NVIDIA H100 80GB HBM3".into(),
        uuid: format!("GPU-0000-{index}"),
        util_gpu: Some(util),
        util_mem: Some(util / 2),
        mem_used_bytes: mem_gib * GIB,
        mem_total_bytes: 80 * GIB,
        temperature_c: Some(temp),
        power_w: Some(power),
        power_limit_w: Some(700.0),
        sm_clock_mhz: Some(1980),
        sm_clock_max_mhz: Some(1980),
        mem_clock_mhz: Some(2619),
        mem_clock_max_mhz: Some(2619),
        throttle_reasons: Vec::new(),
        pcie_rx_kbps: None,
        pcie_tx_kbps: None,
        fan_pct: None,
        sm_activity_pct: None,
        sm_occupancy_pct: None,
        compute_capability: Some((9, 0)),
        processes: Vec::new(),
    }
}

fn host() -> HostSample {
    HostSample {
        cpu_pct: 23.0,
        cpu_cores: 16,
        ram_used_bytes: 12 * GIB,
        ram_total_bytes: 24 * GIB,
        self_rss_bytes: 2 * GIB,
    }
}

fn advice() -> Vec<Recommendation> {
    vec![
        Recommendation {
            id: "mem_low".into(),
            severity: Severity::Info,
            gpu: Some(1),
            message: "GPU1 memory mostly unused".into(),
            evidence: vec![("mem_used".into(), "38%".into())],
            action: "a larger micro-batch would fit".into(),
            key: Some("+".into()),
        },
        Recommendation {
            id: "data_bound".into(),
            severity: Severity::Warn,
            gpu: None,
            message: "input pipeline is the bottleneck".into(),
            evidence: vec![
                ("util_gpu_avg".into(), "61%".into()),
                ("data_wait".into(), "28% of step".into()),
            ],
            action: "raise data workers or prefetch".into(),
            key: None,
        },
        Recommendation {
            id: "thermal".into(),
            severity: Severity::Critical,
            gpu: Some(0),
            message: "GPU0 is thermally throttling".into(),
            evidence: vec![("temperature".into(), "89°C".into())],
            action: "check cooling".into(),
            key: None,
        },
    ]
}

/// `n` ticks of two busy GPUs with processes and advice.
fn gpu_updates(n: u64) -> Vec<MonitorUpdate> {
    (0..n)
        .map(|i| {
            let wave = (i as f64 * 0.5).sin();
            let mut g0 = gpu(0, (80.0 + 15.0 * wave) as u32, 71, 89, 655.0);
            g0.throttle_reasons = vec!["hw_thermal_slowdown".into()];
            g0.processes = vec![GpuProcess {
                pid: 48213,
                name: "cockpit".into(),
                user: Some("alice".into()),
                gpu_memory_bytes: Some(70 * GIB),
                kind: "compute".into(),
                sm_pct: Some(93),
            }];
            let mut g1 = gpu(1, (55.0 + 20.0 * wave) as u32, 30, 64, 402.0);
            g1.processes = vec![
                GpuProcess {
                    pid: 48213,
                    name: "cockpit".into(),
                    user: Some("alice".into()),
                    gpu_memory_bytes: Some(29 * GIB),
                    kind: "compute".into(),
                    sm_pct: Some(61),
                },
                GpuProcess {
                    pid: 1807,
                    name: "Xorg".into(),
                    user: None,
                    gpu_memory_bytes: None,
                    kind: "graphics".into(),
                    sm_pct: None,
                },
            ];
            MonitorUpdate {
                snapshot: Snapshot {
                    timestamp_ms: 1_700_000_000_000 + i * 1000,
                    gpus: vec![g0, g1],
                    host: host(),
                    gpu_notice: None,
                },
                advice: advice(),
                // the host's view of the training process (the Xorg one is not ours to read)
                processes: vec![ProcessStat {
                    pid: 48213,
                    cpu_pct: Some(97.0 + i as f64 % 3.0),
                    rss_bytes: Some(3 * GIB + GIB / 5),
                }],
            }
        })
        .collect()
}

fn no_gpu_updates(n: u64) -> Vec<MonitorUpdate> {
    (0..n)
        .map(|i| MonitorUpdate {
            snapshot: Snapshot {
                timestamp_ms: 1_700_000_000_000 + i * 1000,
                gpus: Vec::new(),
                host: HostSample {
                    cpu_pct: 40.0 + 30.0 * (i as f64 * 0.4).sin(),
                    ..host()
                },
                gpu_notice: Some("NVML not available: libnvidia-ml.so.1 not found".into()),
            },
            advice: Vec::new(),
            processes: Vec::new(),
        })
        .collect()
}

fn opts() -> TuiOptions {
    TuiOptions::default()
}

fn training_app(events: Vec<Event>, updates: &[MonitorUpdate]) -> App {
    let mut app = App::training(&opts());
    for ev in events {
        app.on_event(ev);
    }
    for u in updates {
        app.on_update(u);
    }
    app
}

fn monitor_app(updates: &[MonitorUpdate]) -> App {
    let mut app = App::monitor(&opts());
    for u in updates {
        app.on_update(u);
    }
    app
}

fn render(app: &App, width: u16, height: u16) -> String {
    let mut terminal = Terminal::new(TestBackend::new(width, height)).unwrap();
    terminal.draw(|f| app.render(f)).unwrap();
    terminal.backend().to_string()
}

fn key(c: char) -> KeyEvent {
    KeyEvent::new(KeyCode::Char(c), KeyModifiers::NONE)
}

fn code(code: KeyCode) -> KeyEvent {
    KeyEvent::new(code, KeyModifiers::NONE)
}

fn ctrl_c() -> KeyEvent {
    KeyEvent::new(KeyCode::Char('c'), KeyModifiers::CONTROL)
}

fn send(command: Command) -> Option<Action> {
    Some(Action::Send(command))
}

// ------------------------------------------------------------------ snapshots: training

#[test]
fn snapshot_training_full() {
    let app = training_app(canned_run(1200, true), &gpu_updates(60));
    insta::assert_snapshot!("training_120x40", render(&app, 120, 40));
    insta::assert_snapshot!("training_80x24", render(&app, 80, 24));
}

#[test]
fn snapshot_training_waiting() {
    let app = App::training(&opts());
    insta::assert_snapshot!("training_waiting_120x40", render(&app, 120, 40));
    insta::assert_snapshot!("training_waiting_80x24", render(&app, 80, 24));
}

#[test]
fn snapshot_training_without_gpu() {
    let app = training_app(canned_run(400, true), &no_gpu_updates(30));
    insta::assert_snapshot!("training_no_gpu_120x40", render(&app, 120, 40));
    insta::assert_snapshot!("training_no_gpu_80x24", render(&app, 80, 24));
}

#[test]
fn snapshot_training_scu_off() {
    let app = training_app(canned_run(900, false), &gpu_updates(10));
    insta::assert_snapshot!("training_scu_off_120x40", render(&app, 120, 40));
}

#[test]
fn snapshot_training_recent_window_raw_loss() {
    let mut app = training_app(canned_run(1200, true), &gpu_updates(60));
    // the smoothing key cycles 0.6 → 0.9 → 0.98 → raw
    for _ in 0..3 {
        assert_eq!(app.on_key(key('s')), None);
    }
    assert_eq!(app.on_key(key('w')), None);
    assert_eq!(app.ui().smoothing, 0);
    assert!(app.ui().recent);
    insta::assert_snapshot!("training_recent_raw_120x40", render(&app, 120, 40));
}

#[test]
fn snapshot_training_paused_with_focus_on_second_gpu() {
    let mut app = training_app(canned_run(600, true), &gpu_updates(20));
    assert_eq!(app.on_key(key('p')), send(Command::Pause));
    app.on_event(Event::Paused { step: 600 });
    assert_eq!(app.on_key(code(KeyCode::Tab)), None);
    assert_eq!(app.ui().focus_gpu, 1);
    insta::assert_snapshot!("training_paused_120x40", render(&app, 120, 40));
}

#[test]
fn snapshot_training_help_overlay() {
    let mut app = training_app(canned_run(300, true), &gpu_updates(5));
    app.on_key(key('?'));
    insta::assert_snapshot!("training_help_120x40", render(&app, 120, 40));
    insta::assert_snapshot!("training_help_80x24", render(&app, 80, 24));
    // any key closes it, without acting
    assert_eq!(app.on_key(key('+')), None);
    assert_eq!(app.ui().overlay, cockpit::tui::app::Overlay::None);
}

#[test]
fn snapshot_training_quit_popup() {
    let mut app = training_app(canned_run(300, true), &gpu_updates(5));
    app.on_key(key('q'));
    insta::assert_snapshot!("training_quit_popup_120x40", render(&app, 120, 40));
    app.on_key(code(KeyCode::Down));
    insta::assert_snapshot!("training_quit_popup_80x24", render(&app, 80, 24));
}

#[test]
fn snapshot_training_finished() {
    let mut events = canned_run(5000, true);
    events.push(Event::Finished {
        step: 5000,
        reason: FinishReason::Completed,
        message: "reached max_steps".into(),
        elapsed_s: 912.4,
    });
    let app = training_app(events, &gpu_updates(60));
    insta::assert_snapshot!("training_finished_120x40", render(&app, 120, 40));
}

#[test]
fn snapshot_training_stopping() {
    let mut app = training_app(canned_run(300, true), &gpu_updates(5));
    app.on_key(key('q'));
    assert_eq!(app.on_key(key('s')), send(Command::Stop { save: true }));
    insta::assert_snapshot!("training_stopping_80x24", render(&app, 80, 24));
}

#[test]
fn snapshot_too_small() {
    let app = training_app(canned_run(100, true), &gpu_updates(5));
    insta::assert_snapshot!("training_too_small_60x20", render(&app, 60, 20));
    let monitor = monitor_app(&gpu_updates(5));
    insta::assert_snapshot!("monitor_too_small_40x10", render(&monitor, 40, 10));
}

#[test]
fn snapshot_batch_size_pending_then_applied_then_rejected() {
    let mut app = training_app(canned_run(300, true), &gpu_updates(5));
    assert_eq!(
        app.on_key(key('+')),
        send(Command::SetBatchSize { micro_batch: 32 })
    );
    let pending = render(&app, 120, 40);
    assert!(
        pending.contains("→ 32 pending"),
        "header shows the pending size"
    );
    assert!(
        pending.contains("⧗ batch size -> 32 pending"),
        "footer shows pending"
    );
    insta::assert_snapshot!("batch_pending_120x40", pending);

    // a second press while pending does nothing but explain
    assert_eq!(app.on_key(key('+')), None);
    assert!(render(&app, 120, 40).contains("a batch-size change is already pending"));

    app.on_event(Event::CommandApplied {
        step: 301,
        command: Command::SetBatchSize { micro_batch: 32 },
        detail: "accum 4 -> 2, effective batch unchanged".into(),
    });
    let applied = render(&app, 120, 40);
    assert!(applied.contains("micro-batch 32×4"));
    assert!(!applied.contains("pending"));
    assert!(applied.contains("✓ batch size -> 32 applied at step 301"));
    insta::assert_snapshot!("batch_applied_120x40", applied);

    assert_eq!(
        app.on_key(key('+')),
        send(Command::SetBatchSize { micro_batch: 64 })
    );
    app.on_event(Event::CommandRejected {
        step: 302,
        command: Command::SetBatchSize { micro_batch: 64 },
        reason: "would need 92 GiB, 80 GiB available".into(),
    });
    let rejected = render(&app, 120, 40);
    assert!(rejected.contains("✗ batch size -> 64 rejected: would need 92 GiB, 80 GiB available"));
    assert!(rejected.contains("micro-batch 32×4"));
    insta::assert_snapshot!("batch_rejected_80x24", render(&app, 80, 24));
}

// ------------------------------------------------------------------ snapshots: monitor

#[test]
fn snapshot_monitor() {
    let app = monitor_app(&gpu_updates(60));
    insta::assert_snapshot!("monitor_120x40", render(&app, 120, 40));
    insta::assert_snapshot!("monitor_80x24", render(&app, 80, 24));
}

#[test]
fn a_replayed_monitor_says_so_in_its_header() {
    let mut app = App::monitor(&TuiOptions {
        source: Some("REPLAY of trace.jsonl at 10×".into()),
        ..opts()
    });
    for u in gpu_updates(5) {
        app.on_update(&u);
    }
    let screen = render(&app, 120, 40);
    assert!(
        screen
            .lines()
            .next()
            .is_some_and(|l| l.contains("REPLAY of trace.jsonl at 10×")),
        "{screen}"
    );
    assert!(!render(&monitor_app(&gpu_updates(5)), 120, 40).contains("REPLAY"));
}

#[test]
fn snapshot_monitor_waiting_and_no_gpu() {
    let app = monitor_app(&[]);
    insta::assert_snapshot!("monitor_waiting_80x24", render(&app, 80, 24));
    let app = monitor_app(&no_gpu_updates(30));
    insta::assert_snapshot!("monitor_no_gpu_80x24", render(&app, 80, 24));
}

#[test]
fn snapshot_monitor_many_gpus_follows_focus() {
    let updates: Vec<MonitorUpdate> = (0..10)
        .map(|i| MonitorUpdate {
            snapshot: Snapshot {
                timestamp_ms: i,
                gpus: (0..6)
                    .map(|g| gpu(g, 10 * g + i as u32, 10 + 5 * g as u64, 50, 300.0))
                    .collect(),
                host: host(),
                gpu_notice: None,
            },
            advice: Vec::new(),
            processes: Vec::new(),
        })
        .collect();
    let mut app = monitor_app(&updates);
    for _ in 0..4 {
        app.on_key(code(KeyCode::Tab));
    }
    assert_eq!(app.ui().focus_gpu, 4);
    let screen = render(&app, 80, 24);
    assert!(
        screen.contains("GPU4"),
        "the focused GPU is scrolled into view"
    );
    insta::assert_snapshot!("monitor_six_gpus_focus4_80x24", screen);
    app.on_key(key('?'));
    insta::assert_snapshot!("monitor_help_80x24", render(&app, 80, 24));
}

#[test]
fn rendering_is_deterministic() {
    let a = training_app(canned_run(700, true), &gpu_updates(30));
    let b = training_app(canned_run(700, true), &gpu_updates(30));
    assert_eq!(render(&a, 120, 40), render(&b, 120, 40));
}

#[test]
fn renders_at_odd_sizes_without_panicking() {
    let app = training_app(canned_run(50, true), &gpu_updates(3));
    let monitor = monitor_app(&gpu_updates(3));
    for (w, h) in [(1, 1), (72, 22), (73, 23), (200, 60), (300, 22), (72, 80)] {
        render(&app, w, h);
        render(&monitor, w, h);
    }
}

// ------------------------------------------------------------------ keys → commands

#[test]
fn every_default_key_maps_to_its_command() {
    let started = || training_app(canned_run(10, true), &gpu_updates(2));

    let mut app = started();
    assert_eq!(
        app.on_key(key('+')),
        send(Command::SetBatchSize { micro_batch: 32 })
    );
    let mut app2 = started();
    assert_eq!(
        app2.on_key(key('-')),
        send(Command::SetBatchSize { micro_batch: 8 })
    );
    // shift is part of '+' on most layouts: still matches
    let mut app3 = started();
    assert_eq!(
        app3.on_key(KeyEvent::new(KeyCode::Char('+'), KeyModifiers::SHIFT)),
        send(Command::SetBatchSize { micro_batch: 32 })
    );

    assert_eq!(
        app.on_key(key(']')),
        send(Command::SetScuSetpoint { target: 0.011 })
    );
    // successive presses build on the pending value
    assert_eq!(
        app.on_key(key(']')),
        send(Command::SetScuSetpoint { target: 0.012 })
    );
    let mut app4 = started();
    assert_eq!(
        app4.on_key(key('[')),
        send(Command::SetScuSetpoint { target: 0.009 })
    );

    assert_eq!(app.on_key(key('c')), send(Command::CheckpointNow));
    assert_eq!(app.on_key(key('c')), None, "one checkpoint at a time");
    app.on_event(Event::CheckpointSaved {
        step: 11,
        path: "ckpt".into(),
        bytes: 10,
        ms: 1.0,
    });
    assert_eq!(app.on_key(key('c')), send(Command::CheckpointNow));

    assert_eq!(app.on_key(key('p')), send(Command::Pause));
    assert_eq!(
        app.status(),
        RunStatus::Running,
        "paused only once the engine says so"
    );
    app.on_event(Event::Paused { step: 11 });
    assert_eq!(app.status(), RunStatus::Paused);
    assert_eq!(app.on_key(key('p')), send(Command::Resume));
    app.on_event(Event::Resumed { step: 11 });
    assert_eq!(app.status(), RunStatus::Running);

    assert_eq!(app.ui().smoothing, 1, "smoothed at 0.6 to begin with");
    assert_eq!(app.on_key(key('s')), None);
    assert_eq!(app.ui().smoothing, 2);
    assert_eq!(app.on_key(key('w')), None);
    assert!(app.ui().recent);
    assert_eq!(app.on_key(code(KeyCode::Tab)), None);
    assert_eq!(app.ui().focus_gpu, 1);
    assert_eq!(app.on_key(code(KeyCode::Tab)), None);
    assert_eq!(app.ui().focus_gpu, 0, "focus wraps around");
    assert_eq!(app.on_key(key('?')), None);
    assert_eq!(app.ui().overlay, cockpit::tui::app::Overlay::Help);
    app.on_key(code(KeyCode::Esc));
    assert_eq!(app.on_key(key('q')), None);
    assert_eq!(
        app.ui().overlay,
        cockpit::tui::app::Overlay::QuitConfirm {
            selected: QuitChoice::SaveAndQuit
        }
    );

    // key releases are ignored
    let mut app5 = started();
    let mut release = key('+');
    release.kind = KeyEventKind::Release;
    assert_eq!(app5.on_key(release), None);
    // unbound keys do nothing
    assert_eq!(app5.on_key(key('z')), None);
}

#[test]
fn setpoint_never_goes_below_the_minimum_and_step_is_configurable() {
    let mut info = run_info(true);
    info.scu_target = 0.0015;
    let mut app = App::training(&opts());
    app.on_event(Event::RunStarted(info.clone()));
    assert_eq!(
        app.on_key(key('[')),
        send(Command::SetScuSetpoint { target: 0.0005 })
    );
    assert_eq!(
        app.on_key(key('[')),
        send(Command::SetScuSetpoint {
            target: cockpit::tui::MIN_SETPOINT
        })
    );
    assert_eq!(app.on_key(key('[')), None, "already at the minimum");
    assert!(render(&app, 120, 40).contains("the setpoint is at its minimum"));

    let custom = TuiOptions {
        setpoint_step: 0.005,
        ..opts()
    };
    let mut app = App::training(&custom);
    app.on_event(Event::RunStarted(run_info(true)));
    assert_eq!(
        app.on_key(key(']')),
        send(Command::SetScuSetpoint { target: 0.015 })
    );

    // SCU off: no setpoint commands
    let mut app = App::training(&opts());
    app.on_event(Event::RunStarted(run_info(false)));
    assert_eq!(app.on_key(key(']')), None);
    assert!(render(&app, 120, 40).contains("SCU is off in this run"));
}

#[test]
fn no_commands_before_the_run_starts_or_after_it_ends() {
    let mut app = App::training(&opts());
    assert_eq!(app.on_key(key('+')), None);
    assert!(render(&app, 120, 40).contains("not known yet"));

    let mut app = training_app(canned_run(10, true), &[]);
    app.on_event(Event::Finished {
        step: 10,
        reason: FinishReason::Failed,
        message: "NaN loss".into(),
        elapsed_s: 2.0,
    });
    assert_eq!(app.on_key(key('+')), None);
    assert_eq!(app.on_key(key('c')), None);
    assert!(render(&app, 120, 40).contains("the run has finished: press q to leave"));
}

#[test]
fn custom_keymap() {
    let names: HashMap<String, String> = [
        ("batch_up", "u"),
        ("batch_down", "d"),
        ("quit", "x"),
        ("help", "f1"),
        ("focus", "ctrl+n"),
        ("checkpoint", "space"),
        ("pause", "plus"),
    ]
    .into_iter()
    .map(|(a, k)| (a.to_string(), k.to_string()))
    .collect();
    let keymap = Keymap::from_names(&names).unwrap();
    assert_eq!(keymap.key(KeyAction::Quit), KeyBinding::char('x'));
    assert_eq!(
        keymap.key(KeyAction::Smoothing),
        KeyBinding::char('s'),
        "defaults kept"
    );

    let custom = TuiOptions { keymap, ..opts() };
    let mut app = App::training(&custom);
    for ev in canned_run(10, true) {
        app.on_event(ev);
    }
    app.on_update(&gpu_updates(1)[0]);
    assert_eq!(
        app.on_key(key('u')),
        send(Command::SetBatchSize { micro_batch: 32 })
    );
    app.on_event(Event::CommandApplied {
        step: 11,
        command: Command::SetBatchSize { micro_batch: 32 },
        detail: String::new(),
    });
    assert_eq!(
        app.on_key(key('d')),
        send(Command::SetBatchSize { micro_batch: 16 })
    );
    assert_eq!(app.on_key(key(' ')), send(Command::CheckpointNow));
    assert_eq!(app.on_key(key('+')), send(Command::Pause));
    assert_eq!(
        app.on_key(KeyEvent::new(KeyCode::Char('n'), KeyModifiers::CONTROL)),
        None
    );
    assert_eq!(app.ui().focus_gpu, 1);
    assert_eq!(app.on_key(key('n')), None, "plain n is not ctrl+n");
    assert_eq!(app.ui().focus_gpu, 1);
    assert_eq!(app.on_key(key('q')), None, "q is unbound now");
    assert_eq!(app.ui().overlay, cockpit::tui::app::Overlay::None);
    assert_eq!(app.on_key(code(KeyCode::F(1))), None);
    assert_eq!(app.ui().overlay, cockpit::tui::app::Overlay::Help);
    app.on_key(code(KeyCode::Esc));
    assert_eq!(app.on_key(key('x')), None);
    assert!(matches!(
        app.ui().overlay,
        cockpit::tui::app::Overlay::QuitConfirm { .. }
    ));
    // the footer and help show the configured keys
    app.on_key(code(KeyCode::Esc));
    app.on_key(code(KeyCode::F(1)));
    let help = render(&app, 120, 40);
    assert!(help.contains("F1  show / hide this help"));
    assert!(help.contains("Ctrl+n  focus the next GPU"));
    assert!(help.contains("u/d"), "footer shows the custom batch keys");
}

#[test]
fn keymap_errors_are_clear() {
    let one = |a: &str, k: &str| HashMap::from([(a.to_string(), k.to_string())]);

    let err = Keymap::from_names(&one("launch_rockets", "r")).unwrap_err();
    assert!(matches!(err, KeymapError::UnknownAction { .. }));
    let msg = err.to_string();
    assert!(
        msg.contains("launch_rockets") && msg.contains("batch_up"),
        "{msg}"
    );

    let err = Keymap::from_names(&one("quit", "hyperspace")).unwrap_err();
    assert!(matches!(err, KeymapError::UnknownKey { .. }));
    assert!(err.to_string().contains("hyperspace"));

    let err = Keymap::from_names(&one("quit", "ctrl+c")).unwrap_err();
    assert!(matches!(err, KeymapError::Reserved { .. }));

    let err = Keymap::from_names(&one("quit", "p")).unwrap_err();
    assert_eq!(
        err,
        KeymapError::Conflict {
            key: "p".into(),
            first: "pause",
            second: "quit"
        }
    );
    assert_eq!(err.to_string(), "key p is bound to both pause and quit");
}

// ------------------------------------------------------------------ quit flow

#[test]
fn quit_popup_flow() {
    let started = || training_app(canned_run(20, true), &[]);

    // cancel: Esc, c and the Cancel button send nothing
    let mut app = started();
    assert_eq!(app.on_key(key('q')), None);
    assert_eq!(app.on_key(code(KeyCode::Esc)), None);
    assert_eq!(app.ui().overlay, cockpit::tui::app::Overlay::None);
    app.on_key(key('q'));
    assert_eq!(app.on_key(key('c')), None);
    app.on_key(key('q'));
    app.on_key(code(KeyCode::Up)); // wraps from Save to Cancel
    assert_eq!(app.on_key(code(KeyCode::Enter)), None);
    assert_eq!(app.status(), RunStatus::Running);
    assert!(app.exit().is_none());

    // save and quit: Enter on the default button, then Finished closes the dashboard
    let mut app = started();
    app.on_key(key('q'));
    assert_eq!(
        app.on_key(code(KeyCode::Enter)),
        send(Command::Stop { save: true })
    );
    assert_eq!(app.status(), RunStatus::Stopping { save: true });
    assert!(app.exit().is_none(), "waits for the engine to finish");
    app.on_event(Event::CheckpointSaved {
        step: 20,
        path: "ckpt".into(),
        bytes: 1,
        ms: 1.0,
    });
    app.on_event(Event::Finished {
        step: 20,
        reason: FinishReason::Stopped,
        message: "stopped by the user".into(),
        elapsed_s: 3.0,
    });
    assert_eq!(
        app.exit(),
        Some(&TuiExit::Finished {
            reason: FinishReason::Stopped
        })
    );

    // quit without saving: x, or Down + Enter
    let mut app = started();
    app.on_key(key('q'));
    assert_eq!(app.on_key(key('x')), send(Command::Stop { save: false }));
    let mut app = started();
    app.on_key(key('q'));
    app.on_key(code(KeyCode::Down));
    assert_eq!(
        app.on_key(code(KeyCode::Enter)),
        send(Command::Stop { save: false })
    );
    // q again while stopping leaves at once
    assert_eq!(app.on_key(key('q')), Some(Action::Quit));
    assert_eq!(app.exit(), Some(&TuiExit::StopRequested { save: false }));

    // save with s
    let mut app = started();
    app.on_key(key('q'));
    assert_eq!(app.on_key(key('s')), send(Command::Stop { save: true }));
}

/// Issue 26: with the README's `quit = "x"`, pressing `x` twice stopped the run without
/// saving (the popup hard-coded `x`). The quit key again now takes the highlighted answer
/// (save and quit); quitting without saving has its own shown key that no binding uses.
#[test]
fn the_quit_key_twice_saves_and_discarding_needs_its_own_key() {
    let names: HashMap<String, String> = HashMap::from([("quit".to_string(), "x".to_string())]);
    let keymap = Keymap::from_names(&names).unwrap();
    assert_eq!(keymap.discard_key(), Some('X'));
    let custom = TuiOptions { keymap, ..opts() };
    let fresh = || {
        let mut app = App::training(&custom);
        for ev in canned_run(10, true) {
            app.on_event(ev);
        }
        app
    };
    let mut app = fresh();
    assert_eq!(app.on_key(key('x')), None, "the popup opens");
    let popup = render(&app, 120, 40);
    assert!(popup.contains("[X] quit WITHOUT saving"), "{popup}");
    assert!(!popup.contains("[x]"), "{popup}");
    assert_eq!(app.on_key(key('x')), send(Command::Stop { save: true }));
    let mut app = fresh();
    app.on_key(key('x'));
    assert_eq!(app.on_key(key('X')), send(Command::Stop { save: false }));
    // Every binding taken by a candidate: discarding is reached with the arrows only.
    let names: HashMap<String, String> = [
        ("quit", "x"),
        ("pause", "X"),
        ("window", "D"),
        ("help", "!"),
    ]
    .into_iter()
    .map(|(a, k)| (a.to_string(), k.to_string()))
    .collect();
    let keymap = Keymap::from_names(&names).unwrap();
    assert_eq!(keymap.discard_key(), None);
    let custom = TuiOptions { keymap, ..opts() };
    let mut app = App::training(&custom);
    for ev in canned_run(10, true) {
        app.on_event(ev);
    }
    app.on_key(key('x'));
    assert_eq!(
        app.on_key(key('X')),
        None,
        "a binding does nothing in the popup"
    );
    assert!(matches!(
        app.ui().overlay,
        cockpit::tui::app::Overlay::QuitConfirm { .. }
    ));
    assert_eq!(
        app.on_key(code(KeyCode::Enter)),
        send(Command::Stop { save: true })
    );
}

#[test]
fn finished_run_quits_without_popup() {
    let mut app = training_app(canned_run(20, true), &[]);
    app.on_key(key('q'));
    app.on_event(Event::Finished {
        step: 20,
        reason: FinishReason::Completed,
        message: String::new(),
        elapsed_s: 3.0,
    });
    assert_eq!(
        app.ui().overlay,
        cockpit::tui::app::Overlay::None,
        "popup closed"
    );
    assert!(app.exit().is_none(), "the user reads the result first");
    assert!(render(&app, 120, 40).contains("run completed · press q to exit"));
    assert_eq!(app.on_key(key('q')), Some(Action::Quit));
    assert_eq!(
        app.exit(),
        Some(&TuiExit::Finished {
            reason: FinishReason::Completed
        })
    );
}

#[test]
fn ctrl_c_signals_and_a_vanished_engine() {
    let mut app = training_app(canned_run(20, true), &[]);
    assert_eq!(
        app.on_key(ctrl_c()),
        send(Command::Interrupt {
            signal: "Ctrl+C".into()
        })
    );
    assert_eq!(app.on_key(ctrl_c()), Some(Action::Quit));
    assert_eq!(app.exit(), Some(&TuiExit::StopRequested { save: true }));

    let mut app = training_app(canned_run(20, true), &[]);
    assert_eq!(
        app.on_signal("SIGTERM"),
        Some(Command::Interrupt {
            signal: "SIGTERM".into()
        })
    );
    assert_eq!(app.exit(), Some(&TuiExit::Interrupted));

    let mut app = training_app(canned_run(20, true), &[]);
    app.on_engine_disconnected();
    assert_eq!(app.status(), RunStatus::EngineGone);
    assert!(app
        .log()
        .entries()
        .any(|e| e.text == "the engine stopped without finishing the run"));
    assert!(render(&app, 120, 40).contains("the engine is gone · press q to exit"));
    assert_eq!(app.on_key(key('q')), Some(Action::Quit));
    assert_eq!(app.exit(), Some(&TuiExit::EngineGone));

    let mut app = training_app(canned_run(20, true), &[]);
    app.on_send_failed(Command::CheckpointNow);
    assert_eq!(app.status(), RunStatus::EngineGone);
}

#[test]
fn monitor_keys() {
    let mut app = monitor_app(&gpu_updates(3));
    assert_eq!(app.on_key(key('+')), None, "no run to steer");
    assert_eq!(app.on_key(key('p')), None);
    assert_eq!(app.on_key(code(KeyCode::Tab)), None);
    assert_eq!(app.ui().focus_gpu, 1);
    assert_eq!(
        app.on_key(key('q')),
        Some(Action::Quit),
        "no popup: nothing to save"
    );
    assert_eq!(app.exit(), Some(&TuiExit::Closed));
}

// ------------------------------------------------------------------ bounded history

fn shape(x: f64) -> f64 {
    (x / 50_000.0).sin() * 3.0 + x / 1e6
}

#[test]
fn thinned_series_stays_bounded_over_a_million_points() {
    let mut s = ThinnedSeries::new(2048);
    let n = 1_000_000u64;
    let (mut true_min, mut true_max) = (f64::MAX, f64::MIN);
    for i in 0..n {
        let y = shape(i as f64);
        true_min = true_min.min(y);
        true_max = true_max.max(y);
        s.push(i as f64, y);
        assert!(s.points().len() <= s.capacity() + 1);
    }
    let pts = s.points();
    assert!(pts.len() > s.capacity() / 2, "thinning keeps at least half");
    assert_eq!(pts[0], (0.0, shape(0.0)), "first point kept");
    let last = (n - 1) as f64;
    assert_eq!(*pts.last().unwrap(), (last, shape(last)), "last point kept");
    // every kept point is an original one, evenly spaced: the shape is preserved
    let stride = s.stride() as f64;
    for w in pts[..pts.len() - 1].windows(2) {
        assert_eq!(w[1].0 - w[0].0, stride);
    }
    for &(x, y) in pts {
        assert_eq!(y, shape(x));
    }
    let (min, max) = pts.iter().fold((f64::MAX, f64::MIN), |(lo, hi), p| {
        (lo.min(p.1), hi.max(p.1))
    });
    // extremes survive thinning to within 1% of the range
    let range = true_max - true_min;
    assert!((min - true_min).abs() < 0.01 * range, "{min} vs {true_min}");
    assert!((max - true_max).abs() < 0.01 * range, "{max} vs {true_max}");
}

#[test]
fn run_history_memory_is_flat_over_a_million_steps() {
    let mut h = History::new(1024, 500);
    for i in 0..1_000_000u64 {
        h.push(i as f64, shape(i as f64));
    }
    assert!(h.full().len() <= 1025);
    assert_eq!(
        h.since(999_500.0).len(),
        500,
        "recent window at full resolution"
    );
    assert_eq!(h.first(), Some((0.0, shape(0.0))));

    // the same through the app's event path
    let small = TuiOptions {
        history_capacity: 256,
        recent_window: 100,
        ..opts()
    };
    let mut app = App::training(&small);
    app.on_event(Event::RunStarted(run_info(true)));
    let mut s = step_stats(0);
    for i in 1..=1_000_000u64 {
        s.step = i;
        s.loss = shape(i as f64);
        app.on_event(Event::Step(s.clone()));
    }
    let series = &app.run().series;
    assert!(series.train_loss.full().len() <= 257);
    for smoothed in &series.train_loss_smooth {
        assert!(smoothed.full().len() <= 257);
    }
    assert_eq!(series.train_loss.last(), Some((1e6, shape(1e6))));
    assert_eq!(series.train_loss.first(), Some((1.0, shape(1.0))));
}

// ------------------------------------------------------------------ themes and colours

#[test]
fn shipped_themes_load() {
    let names = Theme::builtin_names();
    assert_eq!(names, vec!["dark", "light", "high-contrast"]);
    for name in names {
        let theme = Theme::load(name).unwrap();
        assert_eq!(theme.name(), name);
        assert_eq!(theme.color_support(), ColorSupport::TrueColor);
        let path = format!("{}/themes/{name}.toml", env!("CARGO_MANIFEST_DIR"));
        let from_file = Theme::load(&path).unwrap();
        assert_eq!(
            from_file, theme,
            "the embedded copy matches themes/{name}.toml"
        );
    }
    let hc = Theme::load("high-contrast").unwrap();
    assert_eq!(hc.colors().val_loss, Color::Rgb(0xe6, 0x9f, 0x00));
}

#[test]
fn bad_themes_are_rejected_clearly() {
    let dark = std::fs::read_to_string(format!("{}/themes/dark.toml", env!("CARGO_MANIFEST_DIR")))
        .unwrap();
    let dir = tempfile::tempdir().unwrap();

    let unknown_key = dir.path().join("unknown.toml");
    std::fs::write(&unknown_key, format!("{dark}\nsparkle = \"#ffffff\"\n")).unwrap();
    let err = Theme::load(unknown_key.to_str().unwrap()).unwrap_err();
    assert!(matches!(err, ThemeError::Parse { .. }));
    assert!(err.to_string().contains("unknown field `sparkle`"), "{err}");

    let bad_colour = dir.path().join("bad.toml");
    std::fs::write(&bad_colour, dark.replace("#5fb3f5", "skyblue")).unwrap();
    let err = Theme::load(bad_colour.to_str().unwrap()).unwrap_err();
    assert!(
        err.to_string()
            .contains("train_loss = \"skyblue\" is not a colour"),
        "{err}"
    );

    let missing = dir.path().join("missing.toml");
    std::fs::write(&missing, "name = \"x\"\ntext = \"#ffffff\"\n").unwrap();
    let err = Theme::load(missing.to_str().unwrap()).unwrap_err();
    assert!(err.to_string().contains("missing field"), "{err}");

    let err = Theme::load("solarized").unwrap_err();
    assert!(matches!(err, ThemeError::UnknownTheme { .. }));
    assert!(
        err.to_string().contains("dark, light, high-contrast"),
        "{err}"
    );

    let err = Theme::load("no/such/theme.toml").unwrap_err();
    assert!(matches!(err, ThemeError::Io { .. }));

    // a file without a name takes its stem
    let nameless = dir.path().join("mine.toml");
    std::fs::write(&nameless, dark.replace("name = \"dark\"", "")).unwrap();
    assert_eq!(
        Theme::load(nameless.to_str().unwrap()).unwrap().name(),
        "mine"
    );
}

#[test]
fn colour_depth_detection() {
    use ColorSupport::*;
    assert_eq!(
        ColorSupport::detect_from(Some("truecolor"), Some("xterm")),
        TrueColor
    );
    assert_eq!(ColorSupport::detect_from(Some("24bit"), None), TrueColor);
    assert_eq!(
        ColorSupport::detect_from(None, Some("xterm-256color")),
        Ansi256
    );
    assert_eq!(
        ColorSupport::detect_from(None, Some("tmux-256color")),
        Ansi256
    );
    assert_eq!(
        ColorSupport::detect_from(None, Some("xterm-direct")),
        TrueColor
    );
    assert_eq!(ColorSupport::detect_from(None, Some("xterm")), Ansi16);
    assert_eq!(ColorSupport::detect_from(None, Some("linux")), Ansi16);
    assert_eq!(ColorSupport::detect_from(None, None), Ansi16);
    assert_eq!("256".parse::<ColorSupport>(), Ok(Ansi256));
    assert_eq!("TrueColor".parse::<ColorSupport>(), Ok(TrueColor));
    assert_eq!("16".parse::<ColorSupport>(), Ok(Ansi16));
    assert!("lots".parse::<ColorSupport>().is_err());
}

#[test]
fn colour_fallback() {
    let hc = Theme::load("high-contrast").unwrap();
    let c256 = hc.clone().with_color_support(ColorSupport::Ansi256);
    assert_eq!(c256.colors().background, Color::Indexed(16));
    assert_eq!(c256.colors().text, Color::Indexed(231));
    // #e69f00 (orange) → cube levels (215, 175, 0) = 16 + 36*4 + 6*3 + 0
    assert_eq!(c256.colors().val_loss, Color::Indexed(178));

    let c16 = hc.with_color_support(ColorSupport::Ansi16);
    assert_eq!(c16.colors().background, Color::Black);
    assert_eq!(c16.colors().text, Color::White);
    assert_eq!(c16.colors().setpoint, Color::LightYellow);

    // every colour of every theme resolves to the right kind
    for name in Theme::builtin_names() {
        let theme = Theme::load(name).unwrap();
        let check = |t: &Theme, ok: fn(&Color) -> bool| {
            let c = t.colors();
            for color in [
                c.background,
                c.text,
                c.muted,
                c.accent,
                c.border,
                c.train_loss,
                c.val_loss,
                c.s_ratio,
                c.setpoint,
                c.lambda,
                c.lr,
                c.grad_norm,
                c.gauge_ok,
                c.gauge_warn,
                c.gauge_critical,
                c.severity_info,
                c.severity_warn,
                c.severity_critical,
            ] {
                assert!(ok(&color), "{name}: {color:?}");
            }
        };
        check(&theme, |c| matches!(c, Color::Rgb(..)));
        check(
            &theme.clone().with_color_support(ColorSupport::Ansi256),
            |c| matches!(c, Color::Indexed(_)),
        );
        check(&theme.with_color_support(ColorSupport::Ansi16), |c| {
            !matches!(c, Color::Rgb(..) | Color::Indexed(_) | Color::Reset)
        });
    }
}

#[test]
fn rendered_cells_use_only_the_terminal_palette() {
    let theme = Theme::load("dark")
        .unwrap()
        .with_color_support(ColorSupport::Ansi16);
    let o = TuiOptions { theme, ..opts() };
    let mut app = App::training(&o);
    for ev in canned_run(300, true) {
        app.on_event(ev);
    }
    for u in gpu_updates(10) {
        app.on_update(&u);
    }
    let mut terminal = Terminal::new(TestBackend::new(120, 40)).unwrap();
    terminal.draw(|f| app.render(f)).unwrap();
    for cell in terminal.backend().buffer().content() {
        for color in [cell.fg, cell.bg] {
            assert!(
                !matches!(color, Color::Rgb(..) | Color::Indexed(_)),
                "{color:?} in a 16-colour terminal"
            );
        }
    }
    // severity colours reach the advisor panel
    let buffer = terminal.backend().buffer().clone();
    let crit = buffer
        .content()
        .windows(4)
        .position(|w| w.iter().map(|c| c.symbol()).collect::<String>() == "CRIT")
        .expect("CRIT badge shown");
    assert_eq!(
        buffer.content()[crit].fg,
        app.theme().colors().severity_critical
    );
}

/// Data parallelism: the header shows every rank's compute time; a straggler is marked.
#[test]
fn the_header_shows_every_rank_and_marks_a_straggler() {
    use cockpit::engine::events::RankStat;
    let mut events = canned_run(50, false);
    let mut last = step_stats(51);
    last.ranks = [210.0, 208.0, 320.0]
        .iter()
        .enumerate()
        .map(|(rank, &ms)| RankStat {
            rank,
            compute_ms: ms,
            data_wait_ms: 0.5,
            memory_bytes: None,
            gpu_util_pct: None,
            gpu_temp_c: None,
        })
        .collect();
    last.comm_ms = 7.2;
    events.push(Event::Step(last));
    let app = training_app(events, &gpu_updates(3));
    let screen = render(&app, 160, 40);
    assert!(
        screen.contains("3 ranks r0 210ms r1 208ms r2 320ms comm 7ms"),
        "{screen}"
    );
    let mut terminal = Terminal::new(TestBackend::new(160, 40)).unwrap();
    terminal.draw(|f| app.render(f)).unwrap();
    let buf = terminal.backend().buffer().clone();
    let row = (0..40)
        .find(|&y| {
            (0..160)
                .map(|x| buf[(x, y)].symbol().to_string())
                .collect::<String>()
                .contains("r2 320ms")
        })
        .unwrap();
    let line: String = (0..160)
        .map(|x| buf[(x, row)].symbol().to_string())
        .collect();
    let x = line.find("r2 320ms").unwrap();
    let x = line[..x].chars().count() as u16;
    let (slow, fast) = (buf[(x, row)].fg, buf[(x - 9, row)].fg);
    assert_ne!(slow, fast, "the straggler stands out");
}

// ------------------------------------------------------------------ charts that tell the truth

/// The rows of a rendered screen (TestBackend quotes each row).
fn rows(screen: &str) -> Vec<String> {
    screen
        .lines()
        .map(|l| l.trim_matches('"').to_string())
        .collect()
}

/// The title line of the panel whose title starts with `name` ("╭ loss …").
fn panel_title(screen: &str, name: &str) -> String {
    rows(screen)
        .into_iter()
        .find_map(|r| {
            let at = r.find(&format!("╭ {name} "))?;
            let rest = &r[at..];
            let end = rest[3..]
                .find('╮')
                .map_or(rest.len(), |e| e + 3 + '╮'.len_utf8());
            Some(rest[..end].to_string())
        })
        .unwrap_or_default()
}

#[test]
fn the_smoothing_key_cycles_and_the_title_keeps_the_raw_value() {
    let mut app = training_app(canned_run(300, false), &gpu_updates(3));
    let raw = format!("(raw {})", cockpit::tui::fmt::value(loss_at(300)));
    let title = panel_title(&render(&app, 160, 40), "loss");
    assert!(title.contains("ema 0.6") && title.contains(&raw), "{title}");
    let mut seen = Vec::new();
    for _ in 0..4 {
        app.on_key(key('s'));
        seen.push(panel_title(&render(&app, 160, 40), "loss"));
    }
    assert!(
        seen[0].contains("ema 0.9") && seen[0].contains(&raw),
        "{}",
        seen[0]
    );
    assert!(seen[1].contains("ema 0.98"), "{}", seen[1]);
    // raw: the train value is the raw loss, said once
    assert!(
        seen[2].contains("· raw ") && !seen[2].contains("(raw"),
        "{}",
        seen[2]
    );
    assert!(
        seen[2].contains(&format!("train {}", cockpit::tui::fmt::value(loss_at(300)))),
        "{}",
        seen[2]
    );
    assert!(
        seen[3].contains("ema 0.6"),
        "back to the start: {}",
        seen[3]
    );
}

#[test]
fn smoothing_is_a_debiased_ema_that_does_not_lag_from_the_start() {
    let mut app = App::training(&opts());
    app.on_event(Event::RunStarted(run_info(false)));
    let mut ema = 0.0;
    for step in 1..=97u64 {
        let mut s = step_stats(step);
        s.loss = 10.0 - step as f64 * 0.08;
        app.on_event(Event::Step(s));
        let beta = 0.6;
        ema = beta * ema + (1.0 - beta) * (10.0 - step as f64 * 0.08);
        let debiased = ema / (1.0 - beta.powi(step as i32));
        let (_, shown) = app.run().train_loss_at(1).last().unwrap();
        assert!((shown - debiased).abs() < 1e-9);
    }
    // at 0.6 the smoothed loss trails a steady fall by well under a tenth of the raw value
    let (_, smoothed) = app.run().train_loss_at(1).last().unwrap();
    let raw = 10.0 - 97.0 * 0.08;
    assert!(smoothed - raw < 0.15, "raw {raw}, smoothed {smoothed}");
}

#[test]
fn the_window_key_shows_the_last_fifth_of_a_600_step_run() {
    let mut app = training_app(canned_run(600, true), &gpu_updates(3));
    assert_eq!(app.run().x_range(false), Some((1.0, 600.0)));
    let before = render(&app, 120, 40);
    app.on_key(key('w'));
    assert_eq!(app.run().x_range(true), Some((480.0, 600.0)));
    let after = render(&app, 120, 40);
    assert_ne!(before, after);
    assert!(
        panel_title(&after, "loss").contains("last 120 steps"),
        "{after}"
    );
    assert!(
        after.contains("charts: the last 120 steps"),
        "a notice says so"
    );
    // the x axis now reads in the 480–600 range
    assert!(
        rows(&after)
            .iter()
            .any(|r| r.starts_with("│   480       500        520        540")),
        "{after}"
    );
}

#[test]
fn events_are_marked_on_the_loss_charts_x_axis() {
    let mut events = canned_run(400, false);
    events.push(Event::CommandApplied {
        step: 100,
        command: Command::SetBatchSize { micro_batch: 32 },
        detail: String::new(),
    });
    events.push(Event::Paused { step: 200 });
    events.push(Event::Resumed { step: 200 });
    events.push(Event::Warning {
        step: 300,
        message: "diverging at step 300: restored runs/x/checkpoints/step-00000250 (step 250), LR × 0.5 (restore 1/3)".into(),
    });
    let app = training_app(events, &gpu_updates(3));
    let screen = render(&app, 120, 40);
    let axis = rows(&screen)
        .into_iter()
        .find(|r| r.starts_with("│  └") || r.starts_with("│ └") || r.starts_with("│   └"))
        .expect("the loss chart's axis");
    for glyph in ['b', 'p', 'r'] {
        assert!(axis.contains(glyph), "{glyph} on {axis}");
    }
    let loss_axis = axis.split("││").next().unwrap_or(&axis);
    let order: Vec<char> = loss_axis.chars().filter(|c| "bpr".contains(*c)).collect();
    assert_eq!(order, vec!['b', 'p', 'r'], "in step order: {axis}");
    // the help explains the marks
    let mut app = app;
    app.on_key(key('?'));
    let help = render(&app, 120, 40);
    assert!(help.contains("chart marks: b batch · s S* · p pause · r restore · c checkpoint"));
}

#[test]
fn validation_points_are_markers_with_their_error_bars() {
    let mut events = canned_run(1000, false);
    events.push(Event::Eval(EvalStats {
        step: 1000,
        val_loss: 3.0,
        val_bpt: 3.0 / std::f64::consts::LN_2,
        val_ppl: 3f64.exp(),
        val_loss_se: 0.8,
        val_bpt_se: 0.8 / std::f64::consts::LN_2,
        val_tokens: 1000,
    }));
    let app = training_app(events, &gpu_updates(3));
    let screen = render(&app, 120, 40);
    // the loss panel's inside: from under its title to its bottom border, 68 columns
    let loss: Vec<String> = rows(&screen)
        .into_iter()
        .skip(4)
        .take_while(|r| !r.starts_with('╰'))
        .map(|r| r.chars().skip(1).take(68).collect())
        .collect();
    let markers: usize = loss.iter().map(|r| r.matches('●').count()).sum();
    assert_eq!(
        markers, 6,
        "one marker per eval (two at step 1000): {loss:#?}"
    );
    // the last eval's ±0.8 is a bar through its marker, in the last column
    let column: String = loss
        .iter()
        .map(|r| r.chars().last().unwrap_or(' '))
        .collect();
    assert!(column.contains("│●") && column.contains("●│"), "{column:?}");
}

#[test]
fn the_setpoint_stays_visible_where_s_crosses_it() {
    let app = training_app(canned_run(1200, true), &gpu_updates(3));
    let screen = render(&app, 120, 40);
    let s_rows: Vec<String> = rows(&screen)
        .into_iter()
        .filter(|r| r.starts_with("│1%┤") || r.starts_with("│1.0%┤"))
        .collect();
    let row = s_rows.first().expect("a 1% row on the S chart");
    // S settles onto S* = 1% over the right half: the setpoint's dashes (the dots ⠤) stay
    // in every other cell S runs through, up to the right edge
    let cells: Vec<u32> = row.chars().skip(4 + 18).take(18).map(u32::from).collect();
    let with_setpoint = cells
        .iter()
        .filter(|&&c| (0x2800..=0x28ff).contains(&c) && (c - 0x2800) & 0x24 == 0x24)
        .count();
    assert!(with_setpoint >= 8, "{row}");
    let with_s = cells
        .iter()
        .filter(|&&c| (0x2800..=0x28ff).contains(&c) && (c - 0x2800) & !0x24 != 0)
        .count();
    assert!(with_s >= 12, "S runs there too: {row}");
    assert!(
        panel_title(&screen, "S").contains("Ŝ 1.02%"),
        "Ŝ is drawn and named"
    );
}

#[test]
fn axis_labels_are_whole_or_elided_at_the_smallest_size() {
    let mut events = canned_run(1200, true);
    events.push(Event::CommandApplied {
        step: 1200,
        command: Command::SetScuSetpoint { target: 0.019 },
        detail: "S* 1.90%".into(),
    });
    let mut updates = gpu_updates(3);
    for u in &mut updates {
        u.snapshot.gpus[0].throttle_reasons = vec!["hw_slowdown".into(), "sw_power_cap".into()];
    }
    let app = training_app(events, &updates);
    let screen = render(&app, 72, 22);
    insta::assert_snapshot!("training_72x22", screen);
    for row in rows(&screen) {
        // a cut label always ends in "…"
        if let Some(at) = row.find("throttle: ") {
            let rest = &row[at..];
            assert!(
                rest.contains("hw_slowdown, sw_power_cap") || rest.contains('…'),
                "{row}"
            );
        }
        if let Some(at) = row.find("S* ") {
            let rest: String = row[at + 3..].chars().take(6).collect();
            assert!(
                rest.starts_with("1.90%") || rest.starts_with("1.00%") || rest.starts_with('…'),
                "S* cut: {row}"
            );
        }
    }
    // y labels never share a row: one label per row on the λ chart
    for row in rows(&screen) {
        assert!(row.matches("e-").count() <= 2, "{row}");
    }
}

#[test]
fn a_paused_run_freezes_its_rate_and_eta_and_says_for_how_long() {
    let mut app = training_app(canned_run(300, true), &gpu_updates(3));
    let eta = app.run().eta_s();
    app.tick(10.0);
    app.on_event(Event::Paused { step: 300 });
    app.tick(52.4);
    let screen = render(&app, 120, 40);
    assert!(screen.contains("paused 0:42"), "{screen}");
    assert!(screen.contains("‖ PAUSED"));
    assert!(screen.contains("throughput · paused"));
    assert_eq!(app.run().eta_s(), eta, "the ETA stands still");
    insta::assert_snapshot!("training_paused_clock_120x40", screen);
    app.on_event(Event::Resumed { step: 300 });
    assert!(!render(&app, 120, 40).contains("paused 0:"));
    let last = app.log().entries().last().unwrap().text.clone();
    assert_eq!(last, "resumed after 0:42");
    // the time in the pause is not a step's: the ETA after the next step is as before
    let mut s = step_stats(301);
    s.elapsed_s = step_stats(300).elapsed_s + 42.4 + 0.182;
    app.on_event(Event::Step(s));
    let after = app.run().eta_s().unwrap();
    assert!(
        (after - eta.unwrap() + 0.182).abs() < 0.01,
        "{after} vs {eta:?}"
    );
}

#[test]
fn an_attached_viewer_says_so_and_q_detaches() {
    let opts = TuiOptions {
        attached: true,
        ..TuiOptions::default()
    };
    let mut app = App::training(&opts);
    for ev in canned_run(300, true) {
        app.on_event(ev);
    }
    let screen = render(&app, 120, 40);
    let r = rows(&screen);
    assert!(r[0].contains("⇄ attached · q detaches"), "{}", r[0]);
    let footer = r.last().unwrap();
    assert!(
        footer.contains("q detach") && !footer.contains("q quit"),
        "{footer}"
    );
    insta::assert_snapshot!("training_attached_120x40", screen);
    // the one rule: a viewer steers like its owner; stopping needs --allow-stop
    assert_eq!(
        app.on_key(key('+')),
        send(Command::SetBatchSize { micro_batch: 32 })
    );
    assert_eq!(app.on_key(key('Q')), None);
    assert!(render(&app, 120, 40).contains("stopping the run needs `cockpit attach --allow-stop`"));
    app.on_key(key('?'));
    let help = render(&app, 120, 40);
    assert!(help.contains("detach: the run goes on"), "{help}");
    assert!(help.contains("stop the run: needs attach --allow-stop"));

    let mut app = App::training(&TuiOptions {
        allow_stop: true,
        ..opts
    });
    app.on_event(Event::RunStarted(run_info(true)));
    let screen = render(&app, 120, 40);
    assert!(rows(&screen)[0].contains("may stop the run"));
    assert!(rows(&screen).last().unwrap().contains("Q stop"));
}

#[test]
fn a_replayed_run_is_read_only_and_says_so() {
    let mut app = App::training(&TuiOptions {
        attached: true,
        source: Some("replay of a finished run · read-only".into()),
        ..TuiOptions::default()
    });
    for ev in canned_run(100, true) {
        app.on_event(ev);
    }
    let screen = render(&app, 120, 40);
    assert!(rows(&screen)[0].contains("replay of a finished run · read-only"));
    assert_eq!(app.on_key(key('c')), None);
    assert_eq!(app.on_key(key('p')), None);
    assert!(render(&app, 120, 40).contains("nothing to steer"));
}

#[test]
fn footer_hints_are_only_for_keys_that_work_here() {
    // no GPU: no focus key; SCU off: no setpoint keys
    let app = training_app(canned_run(300, false), &no_gpu_updates(3));
    let footer = rows(&render(&app, 160, 40)).last().unwrap().clone();
    assert!(
        !footer.contains("next GPU") && !footer.contains("S*"),
        "{footer}"
    );
    assert!(
        footer.contains("p pause") && footer.contains("c ckpt"),
        "{footer}"
    );
    // before the run starts there is nothing to steer
    let app = training_app(vec![], &no_gpu_updates(1));
    let footer = rows(&render(&app, 120, 40)).last().unwrap().clone();
    assert!(
        !footer.contains("pause") && !footer.contains("batch"),
        "{footer}"
    );
    // two GPUs: the focus key
    let app = monitor_app(&gpu_updates(3));
    assert!(rows(&render(&app, 120, 40))
        .last()
        .unwrap()
        .contains("Tab next GPU"));
    let app = monitor_app(&no_gpu_updates(3));
    let screen = render(&app, 120, 40);
    assert!(!rows(&screen).last().unwrap().contains("next GPU"));
    assert!(
        !screen.contains("GPU processes"),
        "no empty process table without GPUs"
    );
}

#[test]
fn a_long_notice_is_elided_and_never_pushes_the_keys_out() {
    let mut app = training_app(canned_run(300, true), &gpu_updates(3));
    app.on_key(key('+'));
    app.on_event(Event::CommandRejected {
        step: 301,
        command: Command::SetBatchSize { micro_batch: 32 },
        reason:
            "would need 92 GiB of device memory, 80 GiB available on cuda:0; accumulate instead"
                .into(),
    });
    for width in [72u16, 80, 120] {
        let screen = render(&app, width, 40);
        let footer = rows(&screen).last().unwrap().clone();
        assert!(
            footer.contains("? help") && footer.contains("q quit"),
            "{footer}"
        );
        assert!(
            footer.starts_with("✗ batch size -> 32 rejected"),
            "{footer}"
        );
        assert!(footer.contains('…'), "{footer}");
    }
}

#[test]
fn gpu_memory_is_in_gib_everywhere() {
    let app = training_app(canned_run(10, false), &gpu_updates(3));
    let screen = render(&app, 120, 40);
    assert!(screen.contains("71.0/80.0 GiB"), "{screen}");
    let app = monitor_app(&gpu_updates(3));
    let screen = render(&app, 120, 40);
    assert!(screen.contains("RAM 12.0 GiB / 24.0 GiB") && screen.contains("70.0 GiB"));
}

#[test]
fn gpu_processes_show_their_host_cpu_and_resident_memory() {
    let app = monitor_app(&gpu_updates(3));
    let screen = render(&app, 120, 40);
    let row = rows(&screen)
        .into_iter()
        .find(|r| r.contains("48213") && r.contains("70.0 GiB"))
        .expect("the training process");
    assert!(row.contains("99%") && row.contains("3.2 GiB"), "{row}");
    let xorg = rows(&screen)
        .into_iter()
        .find(|r| r.contains("Xorg"))
        .unwrap();
    assert!(
        xorg.contains("n/a        -      -"),
        "unknown, said so: {xorg}"
    );
}
