//! Advisor rules on synthetic telemetry: each rule fires and clears, hysteresis holds, the
//! window slides, and a recorded trace always gives the same advice.

mod telemetry_support;

use cockpit::advisor::{ids, Advisor, AdvisorOptions, Recommendation, Severity};
use cockpit::engine::events::RunInfo;
use cockpit::telemetry::{read_trace, GpuSample};
use telemetry_support::*;

/// Ticks after which a windowed rule has certainly settled (window 30 s + confirmation).
const SETTLE: usize = 40;

fn has(ids: &[String], id: &str) -> bool {
    ids.iter().any(|i| i == id)
}

fn last(history: &[Vec<String>]) -> Vec<String> {
    history.last().cloned().unwrap_or_default()
}

/// A GPU with our training process on it.
fn ours(util: u32, mem_frac: f64) -> Vec<GpuSample> {
    vec![with_process(gpu(0, util, mem_frac), OWN_PID, "cockpit")]
}

/// A GPU with someone else's job on it (monitor-only).
fn theirs(util: u32, mem_frac: f64) -> Vec<GpuSample> {
    vec![with_process(gpu(0, util, mem_frac), 31337, "python")]
}

#[test]
fn data_bound_fires_and_clears() {
    let mut s = Session::new();
    s.attach("bf16", "cuda:0 (Synthetic GPU)");
    let fired = last(&s.run(SETTLE, || ours(20, 0.5), Some((100.0, 50.0))));
    assert_eq!(fired, vec![ids::DATA_BOUND], "data-bound run: {fired:?}");
    let rec = s.find(ids::DATA_BOUND).unwrap();
    assert_eq!(rec.severity, Severity::Warn);
    assert_eq!(rec.gpu, Some(0));
    assert!(rec.action.contains("data.prefetch_depth") && rec.action.contains("cockpit prepare"));
    let evidence: Vec<&str> = rec.evidence.iter().map(|(k, _)| k.as_str()).collect();
    assert!(evidence.contains(&"util_gpu_avg") && evidence.contains(&"data_wait_share"));
    assert!(rec
        .evidence
        .contains(&("data_wait_share".to_string(), "50%".to_string())));

    // The pipeline is fixed: data wait gone, the GPU busy.
    let cleared = last(&s.run(SETTLE, || ours(92, 0.5), Some((100.0, 2.0))));
    assert!(!has(&cleared, ids::DATA_BOUND), "{cleared:?}");
    assert_eq!(cleared, vec![ids::WELL_UTILIZED]);
}

#[test]
fn launch_bound_fires_with_the_batch_key_and_clears() {
    let mut s = Session::new();
    s.attach("bf16", "cuda:0");
    let fired = last(&s.run(SETTLE, || ours(25, 0.5), Some((20.0, 0.5))));
    assert_eq!(fired, vec![ids::LAUNCH_BOUND]);
    let rec = s.find(ids::LAUNCH_BOUND).unwrap();
    assert_eq!(rec.key.as_deref(), Some("+"));

    let cleared = last(&s.run(SETTLE, || ours(90, 0.5), Some((20.0, 0.5))));
    assert!(!has(&cleared, ids::LAUNCH_BOUND), "{cleared:?}");
}

#[test]
fn monitor_only_low_utilization_is_underutilized_not_data_bound() {
    let mut s = Session::new();
    let history = s.run(SETTLE, || theirs(20, 0.5), None);
    assert!(history
        .iter()
        .flatten()
        .all(|id| id != ids::DATA_BOUND && id != ids::LAUNCH_BOUND));
    assert_eq!(last(&history), vec![ids::UNDERUTILIZED]);
    let rec = s.find(ids::UNDERUTILIZED).unwrap();
    let evidence = |k: &str| {
        rec.evidence
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.clone())
    };
    assert_eq!(evidence("util_gpu_avg").as_deref(), Some("20%"));
    assert!(evidence("processes")
        .unwrap()
        .contains("31337 python (alice)"));

    let cleared = last(&s.run(SETTLE, || theirs(90, 0.5), None));
    assert_eq!(cleared, vec![ids::WELL_UTILIZED]);
}

#[test]
fn a_busy_gpu_without_visible_processes_is_still_judged() {
    // Inside a container NVML may list no process; utilization still shows the work.
    let mut s = Session::new();
    let fired = last(&s.run(SETTLE, || vec![gpu(0, 20, 0.5)], None));
    assert_eq!(fired, vec![ids::UNDERUTILIZED]);
    let cleared = last(&s.run(SETTLE, || vec![gpu(0, 90, 0.5)], None));
    assert_eq!(cleared, vec![ids::WELL_UTILIZED]);
}

#[test]
fn an_idle_gpu_gets_one_idle_recommendation() {
    let mut s = Session::new();
    // Idle, with almost no memory in use: still no "raise the batch size".
    let fired = last(&s.run(SETTLE, || vec![gpu(0, 0, 0.01)], None));
    assert_eq!(fired, vec![ids::IDLE]);
    let rec = s.find(ids::IDLE).unwrap();
    assert_eq!(rec.severity, Severity::Info);
    assert_eq!(rec.key, None);

    // A job starts on it.
    let cleared = last(&s.run(SETTLE, || theirs(95, 0.5), None));
    assert!(!has(&cleared, ids::IDLE), "{cleared:?}");
    assert_eq!(cleared, vec![ids::WELL_UTILIZED]);
}

#[test]
fn an_attached_run_is_never_called_idle() {
    let mut s = Session::new();
    s.attach("bf16", "cuda:0");
    let history = s.run(SETTLE, || vec![gpu(0, 0, 0.01)], None);
    assert!(
        history.iter().flatten().all(|id| id != ids::IDLE),
        "{history:?}"
    );
}

#[test]
fn low_memory_fires_with_plus_and_clears() {
    let mut s = Session::new();
    s.attach("bf16", "cuda:0");
    let fired = last(&s.run(SETTLE, || ours(95, 0.10), Some((100.0, 1.0))));
    assert!(has(&fired, ids::MEM_LOW), "{fired:?}");
    assert_eq!(s.find(ids::MEM_LOW).unwrap().key.as_deref(), Some("+"));

    let cleared = last(&s.run(SETTLE, || ours(95, 0.60), Some((100.0, 1.0))));
    assert!(!has(&cleared, ids::MEM_LOW), "{cleared:?}");
}

#[test]
fn high_memory_fires_with_minus_and_clears() {
    let mut s = Session::new();
    s.attach("bf16", "cuda:0");
    let fired = last(&s.run(SETTLE, || ours(95, 0.95), Some((100.0, 1.0))));
    assert!(has(&fired, ids::MEM_HIGH), "{fired:?}");
    assert!(
        !has(&fired, ids::WELL_UTILIZED),
        "a warning stands: {fired:?}"
    );
    let rec = s.find(ids::MEM_HIGH).unwrap();
    assert_eq!(rec.key.as_deref(), Some("-"));
    assert!(rec.action.contains("accum"));

    let cleared = last(&s.run(SETTLE, || ours(95, 0.70), Some((100.0, 1.0))));
    assert!(!has(&cleared, ids::MEM_HIGH), "{cleared:?}");
    assert!(has(&cleared, ids::WELL_UTILIZED));
}

#[test]
fn fp32_on_tensor_cores_fires_and_clears_with_the_dtype() {
    let mut s = Session::new();
    s.attach("f32", "cuda:0");
    let fired = last(&s.run(5, || ours(95, 0.5), Some((100.0, 1.0))));
    assert!(has(&fired, ids::FP32_ON_TENSOR_CORES), "{fired:?}");
    assert!(s
        .find(ids::FP32_ON_TENSOR_CORES)
        .unwrap()
        .action
        .contains("precision.dtype = \"bf16\""));

    s.attach("bf16", "cuda:0");
    let cleared = last(&s.run(5, || ours(95, 0.5), Some((100.0, 1.0))));
    assert!(!has(&cleared, ids::FP32_ON_TENSOR_CORES), "{cleared:?}");
}

#[test]
fn fp32_without_tensor_cores_is_fine() {
    let mut s = Session::new();
    s.attach("f32", "cuda:0");
    let old = || {
        let mut g = with_process(gpu(0, 95, 0.5), OWN_PID, "cockpit");
        g.compute_capability = Some((6, 1));
        vec![g]
    };
    let history = s.run(SETTLE, old, Some((100.0, 1.0)));
    assert!(history
        .iter()
        .flatten()
        .all(|id| id != ids::FP32_ON_TENSOR_CORES));
}

#[test]
fn thermal_and_power_throttling_fire_and_clear() {
    for (reason, id) in [
        ("hw_thermal_slowdown", ids::THERMAL_THROTTLE),
        ("sw_power_cap", ids::POWER_THROTTLE),
    ] {
        let mut s = Session::new();
        let hot = || {
            vec![throttled(
                with_process(gpu(0, 95, 0.5), 31337, "python"),
                &[reason],
            )]
        };
        let fired = last(&s.run(SETTLE, hot, None));
        assert!(has(&fired, id), "{reason}: {fired:?}");
        let rec = s.find(id).unwrap();
        assert!(rec
            .evidence
            .iter()
            .any(|(k, v)| k == "reasons" && v.contains(reason)));

        let cleared = last(&s.run(SETTLE, || theirs(95, 0.5), None));
        assert!(!has(&cleared, id), "{reason}: {cleared:?}");
    }
}

#[test]
fn another_process_on_our_gpu_is_contention() {
    let mut s = Session::new();
    s.attach("bf16", "cuda:0");
    let shared = || {
        let g = with_process(gpu(0, 95, 0.5), OWN_PID, "cockpit");
        vec![with_process(g, 777, "miner")]
    };
    let fired = last(&s.run(SETTLE, shared, Some((100.0, 1.0))));
    assert!(has(&fired, ids::GPU_CONTENTION), "{fired:?}");
    let rec = s.find(ids::GPU_CONTENTION).unwrap();
    let procs = rec.evidence.iter().find(|(k, _)| k == "processes").unwrap();
    assert!(procs.1.contains("777 miner") && !procs.1.contains("cockpit"));

    let cleared = last(&s.run(SETTLE, || ours(95, 0.5), Some((100.0, 1.0))));
    assert!(!has(&cleared, ids::GPU_CONTENTION), "{cleared:?}");
}

#[test]
fn monitor_only_contention_needs_two_processes() {
    let mut s = Session::new();
    let alone = s.run(SETTLE, || theirs(95, 0.5), None);
    assert!(alone.iter().flatten().all(|id| id != ids::GPU_CONTENTION));
    let two = || vec![with_process(with_process(gpu(0, 95, 0.5), 1, "a"), 2, "b")];
    assert!(has(&last(&s.run(SETTLE, two, None)), ids::GPU_CONTENTION));
}

#[test]
fn a_single_spike_neither_fires_nor_clears() {
    // Well utilized; one sample at 0% does not make it under-used.
    let mut s = Session::new();
    s.run(SETTLE, || theirs(92, 0.5), None);
    let after_dip = s.tick(theirs(0, 0.5), None);
    let later = last(&s.run(10, || theirs(92, 0.5), None));
    for ids_now in [&after_dip, &later] {
        assert_eq!(ids_now, &vec![ids::WELL_UTILIZED.to_string()]);
    }

    // Under-used; one sample at 100% does not clear it.
    let mut s = Session::new();
    s.run(SETTLE, || theirs(20, 0.5), None);
    let after_spike = s.tick(theirs(100, 0.5), None);
    let later = last(&s.run(10, || theirs(20, 0.5), None));
    for ids_now in [&after_spike, &later] {
        assert_eq!(ids_now, &vec![ids::UNDERUTILIZED.to_string()]);
    }

    // Memory: one sample at 99% does not fire mem_high.
    let mut s = Session::new();
    s.run(SETTLE, || theirs(92, 0.6), None);
    s.tick(theirs(92, 0.99), None);
    let history = s.run(SETTLE, || theirs(92, 0.6), None);
    assert!(history.iter().flatten().all(|id| id != ids::MEM_HIGH));
}

#[test]
fn the_dead_zone_between_thresholds_keeps_the_state() {
    // Fire under 50%, clear over 65%: hovering at 58% keeps whatever stood before.
    let mut s = Session::new();
    s.run(SETTLE, || theirs(20, 0.5), None);
    let hovering = s.run(SETTLE, || theirs(58, 0.5), None);
    assert!(
        hovering.iter().all(|ids| has(ids, ids::UNDERUTILIZED)),
        "{hovering:?}"
    );

    let mut s = Session::new();
    let hovering = s.run(SETTLE, || theirs(58, 0.5), None);
    assert!(hovering.iter().flatten().all(|id| id != ids::UNDERUTILIZED));
}

#[test]
fn advice_follows_the_window_not_the_whole_run() {
    // Five minutes under-used, then busy: a whole-run average would stay low for ages;
    // the 30 s window clears within about a window's length.
    let mut s = Session::new();
    s.run(300, || theirs(10, 0.5), None);
    let recovery = s.run(SETTLE, || theirs(95, 0.5), None);
    let cleared_at = recovery
        .iter()
        .position(|ids| !has(ids, ids::UNDERUTILIZED));
    assert!(
        cleared_at.is_some_and(|t| t <= 35),
        "cleared after {cleared_at:?} s"
    );
}

#[test]
fn advice_needs_a_few_samples_and_a_confirmation_streak() {
    let mut s = Session::new();
    let history = s.run(10, || theirs(10, 0.5), None);
    let first = history
        .iter()
        .position(|ids| has(ids, ids::UNDERUTILIZED))
        .unwrap();
    let opts = options();
    // Judged from the min_window_samples-th sample on, shown after confirm_samples in a row.
    assert_eq!(
        first + 1,
        opts.min_window_samples + opts.confirm_samples as usize - 1
    );
}

#[test]
fn cpu_run_without_gpu_metrics_gets_job_level_data_advice() {
    let mut s = Session::new();
    s.attach("f32", "cpu");
    let fired = last(&s.run(SETTLE, Vec::new, Some((100.0, 60.0))));
    assert_eq!(fired, vec![ids::DATA_BOUND]);
    assert_eq!(s.find(ids::DATA_BOUND).unwrap().gpu, None);
    let cleared = last(&s.run(SETTLE, Vec::new, Some((100.0, 1.0))));
    assert!(cleared.is_empty(), "{cleared:?}");
}

#[test]
fn no_gpu_and_no_run_gives_no_advice() {
    let mut s = Session::new();
    assert!(last(&s.run(SETTLE, Vec::new, None)).is_empty());
}

#[test]
fn recommendations_are_sorted_by_severity() {
    let mut s = Session::new();
    s.attach("bf16", "cuda:0");
    // Memory nearly full (warn) and throttled at the power cap (info).
    let gpus = || {
        vec![throttled(
            with_process(gpu(0, 95, 0.95), OWN_PID, "cockpit"),
            &["sw_power_cap"],
        )]
    };
    s.run(SETTLE, gpus, Some((100.0, 1.0)));
    let recs = s.recs();
    assert!(recs.len() >= 2, "{:?}", ids(&recs));
    assert!(
        recs.windows(2).all(|w| w[0].severity >= w[1].severity),
        "{:?}",
        ids(&recs)
    );
}

#[test]
fn gpus_are_judged_separately() {
    let mut s = Session::new();
    let two = || {
        vec![
            gpu(0, 0, 0.01),
            with_process(gpu(1, 95, 0.5), 31337, "python"),
        ]
    };
    s.run(SETTLE, two, None);
    let recs = s.recs();
    let by_gpu: Vec<(String, Option<u32>)> = recs.iter().map(|r| (r.id.clone(), r.gpu)).collect();
    assert!(
        by_gpu.contains(&(ids::IDLE.to_string(), Some(0))),
        "{by_gpu:?}"
    );
    assert!(
        by_gpu.contains(&(ids::WELL_UTILIZED.to_string(), Some(1))),
        "{by_gpu:?}"
    );
}

/// Replay a fixture through a fresh advisor; the ids standing after each snapshot.
fn advise_trace(name: &str) -> Vec<Vec<String>> {
    let snapshots = read_trace(&fixture(name)).unwrap();
    let mut advisor = Advisor::new(options());
    snapshots
        .iter()
        .map(|snap| {
            advisor.observe_snapshot(snap);
            ids(&advisor.recommendations())
        })
        .collect()
}

#[test]
fn the_shipped_traces_give_the_expected_advice() {
    assert_eq!(last(&advise_trace("idle_gpu.jsonl")), vec![ids::IDLE]);

    let starved = advise_trace("data_starved.jsonl");
    assert_eq!(starved[59], vec![ids::UNDERUTILIZED], "at 59 s");
    assert_eq!(last(&starved), vec![ids::WELL_UTILIZED]);

    let hot = advise_trace("hot_and_full.jsonl");
    assert!(has(&hot[15], ids::MEM_HIGH) && !has(&hot[15], ids::THERMAL_THROTTLE));
    let end = last(&hot);
    assert!(
        has(&end, ids::MEM_HIGH) && has(&end, ids::THERMAL_THROTTLE),
        "{end:?}"
    );
}

#[test]
fn a_data_bound_run_replayed_with_its_steps_is_data_bound() {
    // The monitor-side trace plus the run's step timings (as the TUI feeds them).
    let snapshots = read_trace(&fixture("data_starved.jsonl")).unwrap();
    let mut advisor = Advisor::new(AdvisorOptions {
        own_pid: 31337,
        ..options()
    });
    advisor.observe_run(&run_info("bf16", "cuda:0"));
    let mut seen = Vec::new();
    for (i, snap) in snapshots.iter().enumerate().take(60) {
        advisor.observe_step(&step(i as u64, 200.0, 120.0));
        advisor.observe_snapshot(snap);
        seen = ids(&advisor.recommendations());
    }
    assert_eq!(seen, vec![ids::DATA_BOUND]);
}

#[test]
fn replaying_a_trace_is_deterministic() {
    for (name, _) in fixtures() {
        assert_eq!(advise_trace(name), advise_trace(name), "{name}");
    }
}

/// Data parallelism: one rank whose steps take longer than the others' is named, with the
/// per-rank figures; when the ranks even out, the advice goes.
#[test]
fn a_straggler_rank_is_named_and_clears_when_the_ranks_even_out() {
    use cockpit::engine::events::RankStat;
    let mut advisor = Advisor::new(options());
    advisor.observe_run(&run_info("bf16", "cuda:0 (Synthetic GPU)"));
    let mut n = 0;
    let mut tick = |advisor: &mut Advisor, sec: u64, slow_ms: f64| {
        for _ in 0..4 {
            n += 1;
            let mut st = step(n, 120.0, 1.0);
            st.ranks = [100.0, 100.0, slow_ms, 100.0]
                .iter()
                .enumerate()
                .map(|(rank, &ms)| RankStat {
                    rank,
                    compute_ms: ms,
                    data_wait_ms: 1.0,
                    memory_bytes: None,
                    gpu_util_pct: Some(if rank == 2 { 71.0 } else { 99.0 }),
                    gpu_temp_c: Some(if rank == 2 { 87.0 } else { 60.0 }),
                })
                .collect();
            advisor.observe_step(&st);
        }
        advisor.observe_snapshot(&snapshot(sec, ours(95, 0.6)));
        ids(&advisor.recommendations())
    };
    let mut seen = Vec::new();
    for sec in 0..SETTLE as u64 {
        seen = tick(&mut advisor, sec, 150.0);
    }
    assert!(has(&seen, ids::STRAGGLER), "{seen:?}");
    let rec = advisor
        .recommendations()
        .into_iter()
        .find(|r| r.id == ids::STRAGGLER)
        .unwrap();
    assert_eq!(rec.severity, Severity::Warn);
    assert!(rec.message.contains("Rank 2"), "{}", rec.message);
    let evidence: String = rec
        .evidence
        .iter()
        .map(|(k, v)| format!("{k}={v};"))
        .collect();
    assert!(evidence.contains("rank 2: 150.0 ms"), "{evidence}");
    assert!(evidence.contains("job_time_lost=33%"), "{evidence}");
    assert!(
        evidence.contains("slowest_rank_gpu=util 71%, 87 °C"),
        "{evidence}"
    );
    for sec in SETTLE as u64..2 * SETTLE as u64 {
        seen = tick(&mut advisor, sec, 102.0);
    }
    assert!(!has(&seen, ids::STRAGGLER), "{seen:?}");
}

/// With two ranks the slower is measured against the other (a median over both would be
/// the slower itself, and nothing would ever fire).
#[test]
fn a_straggler_among_two_ranks_is_named() {
    use cockpit::engine::events::RankStat;
    let mut advisor = Advisor::new(options());
    advisor.observe_run(&run_info("bf16", "cuda:0 (Synthetic GPU)"));
    let mut n = 0;
    for sec in 0..SETTLE as u64 {
        for _ in 0..4 {
            n += 1;
            let mut st = step(n, 90.0, 0.5);
            st.ranks = [68.0, 80.0]
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
            advisor.observe_step(&st);
        }
        advisor.observe_snapshot(&snapshot(sec, ours(90, 0.6)));
    }
    let rec = advisor
        .recommendations()
        .into_iter()
        .find(|r| r.id == ids::STRAGGLER)
        .expect("a straggler among two ranks");
    assert!(
        rec.message.contains("Rank 1") && rec.message.contains("1.18×"),
        "{}",
        rec.message
    );
}

/// Steps on the CPU whose RSS follows `rss(step)`, one snapshot per 4 steps; the advice
/// standing at the end.
fn cpu_run_with_rss(rss: impl Fn(u64) -> u64, steps: u64, max_steps: u64) -> Vec<Recommendation> {
    let mut advisor = Advisor::new(options());
    advisor.observe_run(&RunInfo {
        max_steps,
        ..run_info("f32", "cpu (2 threads)")
    });
    for n in 1..=steps {
        let mut st = step(n, 100.0, 1.0);
        st.memory_bytes = Some(rss(n));
        st.host_rss_bytes = Some(rss(n));
        advisor.observe_step(&st);
        if n % 4 == 0 {
            advisor.observe_snapshot(&snapshot(n / 4, vec![]));
        }
    }
    advisor.recommendations()
}

#[test]
fn a_host_memory_climb_is_flagged_with_the_steps_left() {
    // The leak: 6.5 MB per step from 200 MB; the host has 52 GiB free.
    let recs = cpu_run_with_rss(|n| 200_000_000 + n * 6_500_000, 200, 100_000);
    let r = recs
        .iter()
        .find(|r| r.id == "memory_climb")
        .expect("memory_climb");
    assert!(
        r.message
            .starts_with("Host memory (RSS) grows 6.2 MiB/step: ~8"),
        "{}",
        r.message
    );
    // 52 GiB / 6.5 MB ≈ 8,590 steps: before max_steps, so the run will not finish.
    assert_eq!(r.severity, Severity::Critical);
    assert!(r.message.contains("steps until the machine is full"));
    // A short run that ends before memory does: a warning only.
    let recs = cpu_run_with_rss(|n| 200_000_000 + n * 6_500_000, 200, 400);
    let r = recs.iter().find(|r| r.id == "memory_climb").unwrap();
    assert_eq!(r.severity, Severity::Warn);
}

#[test]
fn flat_memory_with_eval_spikes_and_the_warm_up_climb_is_not_a_leak() {
    // Fast growth in the first 20 steps (allocator pools), then flat with spikes.
    let recs = cpu_run_with_rss(
        |n| {
            let warm = n.min(20) * 20_000_000;
            let spike = if n % 50 == 0 { 300_000_000 } else { 0 };
            200_000_000 + warm + spike + (n % 3) * 100_000
        },
        400,
        100_000,
    );
    assert!(
        !ids(&recs).contains(&"memory_climb".to_string()),
        "{recs:?}"
    );
}

// ---- training signals: λ at a clamp, a stuck or diverging loss --------------------------------

/// An advisor following a run on the CPU: `steps` steps with losses from `loss(step)` and, when
/// `scu` gives one, an SCU control step each; a snapshot every 4 steps. The advice at the end.
fn run_with(
    steps: u64,
    loss: impl Fn(u64) -> f64,
    scu: impl Fn(u64) -> Option<(f64, f64)>,
) -> Vec<Recommendation> {
    use cockpit::engine::events::{Event, ScuStats};
    let mut advisor = Advisor::new(options());
    advisor.observe_run(&run_info("f32", "cpu (2 threads)"));
    for n in 1..=steps {
        let mut st = step(n, 100.0, 1.0);
        st.loss = loss(n);
        advisor.observe_event(&Event::Step(st));
        if let Some((lambda, s_hat)) = scu(n) {
            advisor.observe_event(&Event::Scu(ScuStats {
                step: n,
                ce_loss: 2.0,
                reg_loss: 0.01,
                total_loss: 2.01,
                data_bpt: 3.0,
                param_bpt: 0.03,
                s_ratio: s_hat,
                s_hat,
                lambda,
                integral: 0.0,
                error: s_hat - 0.01,
                target: 0.01,
                control: true,
            }));
        }
        if n % 4 == 0 {
            advisor.observe_snapshot(&snapshot(n / 4, vec![]));
        }
    }
    advisor.recommendations()
}

fn learning(n: u64) -> f64 {
    2.0 + 3.0 * (-(n as f64) / 100.0).exp()
}

#[test]
fn lambda_pinned_at_its_maximum_says_the_setpoint_is_out_of_reach() {
    // λ climbs for 40 control steps, reaching 10 (its clamp) at step 40, and sits there with Ŝ at 1.9% over S* 1%.
    let recs = run_with(200, learning, |n| {
        Some(if n <= 40 {
            (10f64.powf(n as f64 / 40.0), 0.03)
        } else {
            (10.0, 0.019)
        })
    });
    let rec = recs
        .iter()
        .find(|r| r.id == ids::LAMBDA_CLAMPED)
        .expect("λ at its clamp");
    assert_eq!(rec.severity, Severity::Warn);
    assert!(
        rec.message
            .starts_with("λ at λ_max (10.0) for 160 steps: S* is out of reach"),
        "{}",
        rec.message
    );
    assert!(rec.action.contains("scu.lambda_max") && rec.action.contains("setpoint"));
    assert_eq!(rec.key.as_deref(), Some("]"));

    // λ at its minimum with Ŝ below S*: lower lambda_min or the setpoint.
    let recs = run_with(200, learning, |_| Some((1e-4, 0.004)));
    let rec = recs.iter().find(|r| r.id == ids::LAMBDA_CLAMPED).unwrap();
    assert!(
        rec.message.starts_with("λ at λ_min (1.00e-4)"),
        "{}",
        rec.message
    );
    assert_eq!(rec.key.as_deref(), Some("["));
}

#[test]
fn a_controller_that_tracks_or_a_short_clamp_is_no_advice() {
    // λ held still with Ŝ on target (the dead band): fine.
    let recs = run_with(200, learning, |_| Some((0.5, 0.0101)));
    assert!(
        !ids(&recs).contains(&ids::LAMBDA_CLAMPED.to_string()),
        "{recs:?}"
    );
    // at the clamp for 30 control steps only, then λ leaves it
    let recs = run_with(200, learning, |n| {
        Some(if (100..130).contains(&n) {
            (10.0, 0.02)
        } else {
            (1.0 + n as f64 / 1000.0, 0.02)
        })
    });
    assert!(
        !ids(&recs).contains(&ids::LAMBDA_CLAMPED.to_string()),
        "{recs:?}"
    );
}

#[test]
fn a_loss_that_does_not_come_down_is_stuck() {
    let recs = run_with(300, |n| 10.8 + 0.01 * ((n % 7) as f64), |_| None);
    let rec = recs
        .iter()
        .find(|r| r.id == ids::LOSS_STUCK)
        .expect("stuck");
    assert!(
        rec.message
            .starts_with("The loss has not come down in 299 steps"),
        "{}",
        rec.message
    );
    assert!(rec.action.contains("learning rate"));
    // a run that learns is not stuck, however long it plateaus
    let recs = run_with(1000, learning, |_| None);
    assert!(
        !ids(&recs).contains(&ids::LOSS_STUCK.to_string()),
        "{recs:?}"
    );
}

#[test]
fn a_climbing_or_non_finite_loss_is_diverging() {
    // down to about 2.1 by step 300, then up to 4
    let recs = run_with(
        400,
        |n| {
            if n <= 300 {
                learning(n)
            } else {
                learning(300) + (n - 300) as f64 * 0.02
            }
        },
        |_| None,
    );
    let rec = recs
        .iter()
        .find(|r| r.id == ids::LOSS_DIVERGING)
        .expect("diverging");
    assert_eq!(rec.severity, Severity::Critical);
    assert!(
        rec.message.starts_with("The loss is diverging"),
        "{}",
        rec.message
    );
    assert!(rec.action.contains("optim.lr"));

    let recs = run_with(
        120,
        |n| if n > 100 { f64::NAN } else { learning(n) },
        |_| None,
    );
    let rec = recs.iter().find(|r| r.id == ids::LOSS_DIVERGING).unwrap();
    assert!(rec.message.contains("not finite"), "{}", rec.message);

    // noise around a plateau is not divergence
    let recs = run_with(600, |n| learning(n) + 0.05 * ((n % 5) as f64), |_| None);
    assert!(
        !ids(&recs).contains(&ids::LOSS_DIVERGING.to_string()),
        "{recs:?}"
    );
}
