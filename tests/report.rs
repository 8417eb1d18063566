//! Run and monitor plots from synthetic metrics and telemetry, written the way the engine and
//! the samplers write them (serialized `Event`s and `Snapshot`s, one per line).

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use cockpit::engine::events::{EvalStats, Event, FinishReason, RunInfo, ScuStats, StepStats};
use cockpit::report::{
    self, load_metrics, load_telemetry, plot_monitor, plot_monitor_detailed, plot_run,
    plot_run_detailed, ReportError,
};
use cockpit::telemetry::{GpuSample, HostSample, Snapshot};

const GIB: u64 = 1 << 30;

fn run_info(start_step: u64) -> RunInfo {
    RunInfo {
        run_name: "tiny-lm".into(),
        run_dir: "runs/tiny-lm".into(),
        device: "cpu".into(),
        dtype: "f32".into(),
        dtype_reason: "cpu".into(),
        params_total: 1_000_000,
        params_trainable: 1_000_000,
        start_step,
        max_steps: 200,
        micro_batch: 8,
        accum: 1,
        seq_len: 128,
        vocab_size: 256,
        train_tokens: 1_000_000,
        entropy_floor_bpt: Some(1.5),
        flops_per_token: 6e6,
        peak_flops: None,
        attention_flops_fwd: None,
        mamba_flops: None,
        scu_enabled: true,
        scu_target: 0.01,
        summary: "test".into(),
    }
}

fn step(step: u64, loss: f64) -> Event {
    Event::Step(StepStats {
        step,
        loss,
        lr: 3e-4 * (step as f64 / 20.0).min(1.0),
        grad_norm: 1.0,
        tokens_per_sec: 50_000.0 + 5_000.0 * ((step as f64) * 0.7).sin(),
        step_ms: 20.0,
        data_wait_ms: 1.0,
        compute_ms: 17.0,
        optim_ms: 2.0,
        micro_batch: 8,
        accum: 1,
        tokens: step * 1024,
        epoch: step as f64 / 1000.0,
        elapsed_s: step as f64 * 0.02,
        memory_bytes: None,
        host_rss_bytes: None,
        dropped_before: 0,
        comm_ms: 0.0,
        ranks: vec![],
        kernels: vec![],
        trained_share: None,
    })
}

fn eval(step: u64, val_loss: f64) -> Event {
    Event::Eval(EvalStats {
        step,
        val_loss,
        val_bpt: val_loss / std::f64::consts::LN_2,
        val_ppl: val_loss.exp(),
        val_loss_se: f64::NAN,
        val_bpt_se: f64::NAN,
        val_tokens: 0,
    })
}

fn scu(step: u64, target: f64) -> Event {
    let s = 0.03 * (-(step as f64) / 60.0).exp() + target + 0.002 * ((step as f64) * 1.3).sin();
    Event::Scu(ScuStats {
        step,
        ce_loss: 2.0,
        reg_loss: 0.1,
        total_loss: 2.1,
        data_bpt: 2.8,
        param_bpt: 0.05,
        s_ratio: s,
        s_hat: s * 0.9 + target * 0.1,
        lambda: 1e-3 * (1.0 + step as f64 / 10.0),
        integral: 0.0,
        error: s - target,
        target,
        control: true,
    })
}

/// A 200-step run with evaluations every 50 steps and a setpoint change at step 120.
fn full_run_events() -> Vec<Event> {
    let mut events = vec![Event::RunStarted(run_info(0))];
    for i in 1..=200u64 {
        let loss = 1.2 + 4.0 * (-(i as f64) / 40.0).exp() + 0.08 * ((i as f64) * 2.1).sin();
        events.push(step(i, loss));
        events.push(scu(i, if i < 120 { 0.01 } else { 0.02 }));
        if i % 50 == 0 {
            events.push(eval(i, loss + 0.1));
        }
    }
    events.push(Event::Finished {
        step: 200,
        reason: FinishReason::Completed,
        message: "done".into(),
        elapsed_s: 4.0,
    });
    events
}

fn gpu(index: u32, util: Option<u32>, used_gib: f64) -> GpuSample {
    GpuSample {
        index,
        name: "NVIDIA H100 80GB HBM3".into(),
        uuid: format!("GPU-{index}"),
        util_gpu: util,
        mem_used_bytes: (used_gib * GIB as f64) as u64,
        mem_total_bytes: 80 * GIB,
        ..GpuSample::default()
    }
}

fn snapshots(n: u64, gpus: u32) -> Vec<Snapshot> {
    (0..n)
        .map(|i| Snapshot {
            timestamp_ms: 1_700_000_000_000 + i * 1000,
            gpus: (0..gpus)
                .map(|g| {
                    let util = ((i * 7 + u64::from(g) * 20) % 100) as u32;
                    gpu(g, Some(util), 10.0 + f64::from(g) * 15.0 + i as f64 * 0.5)
                })
                .collect(),
            host: HostSample {
                cpu_pct: 20.0 + (i % 10) as f64 * 5.0,
                cpu_cores: 16,
                ram_used_bytes: 40 * GIB + i * (GIB / 10),
                ram_total_bytes: 128 * GIB,
                self_rss_bytes: 2 * GIB,
            },
            gpu_notice: None,
        })
        .collect()
}

fn write_jsonl<T: serde::Serialize>(path: &Path, records: &[T]) {
    let mut f = fs::File::create(path).unwrap();
    for r in records {
        writeln!(f, "{}", serde_json::to_string(r).unwrap()).unwrap();
    }
}

fn append(path: &Path, text: &str) {
    let mut f = fs::OpenOptions::new().append(true).open(path).unwrap();
    f.write_all(text.as_bytes()).unwrap();
}

/// Width and height from the IHDR chunk of a complete PNG.
fn png_size(path: &Path) -> (u32, u32) {
    let bytes = fs::read(path).unwrap();
    assert_eq!(
        &bytes[..8],
        b"\x89PNG\r\n\x1a\n",
        "{}: not a PNG",
        path.display()
    );
    assert_eq!(&bytes[12..16], b"IHDR", "{}: no IHDR", path.display());
    assert_eq!(
        &bytes[bytes.len() - 8..bytes.len() - 4],
        b"IEND",
        "{}: truncated PNG",
        path.display()
    );
    let be = |b: &[u8]| u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
    (be(&bytes[16..20]), be(&bytes[20..24]))
}

/// Checks that `text` is a well-formed XML document whose root is a 1200x600 `<svg>`:
/// balanced tags, quoted attributes, nothing after the root.
fn assert_svg(path: &Path) -> String {
    let text = fs::read_to_string(path).unwrap();
    let mut rest = text.trim();
    let mut stack: Vec<String> = Vec::new();
    let mut root: Option<String> = None;
    while let Some(open) = rest.find('<') {
        assert!(
            !stack.is_empty() || rest[..open].trim().is_empty(),
            "{}: text outside the root element",
            path.display()
        );
        rest = &rest[open..];
        if let Some(body) = rest.strip_prefix("<?") {
            rest = &body[body.find("?>").expect("unclosed <?") + 2..];
            continue;
        }
        if let Some(body) = rest.strip_prefix("<!--") {
            rest = &body[body.find("-->").expect("unclosed comment") + 3..];
            continue;
        }
        // Find the end of the tag, skipping '>' inside quoted attribute values.
        let mut quote = None;
        let end = rest
            .char_indices()
            .find(|&(_, c)| match quote {
                Some(q) if c == q => {
                    quote = None;
                    false
                }
                Some(_) => false,
                None if c == '"' || c == '\'' => {
                    quote = Some(c);
                    false
                }
                None => c == '>',
            })
            .map(|(i, _)| i)
            .unwrap_or_else(|| panic!("{}: unclosed tag", path.display()));
        let tag = &rest[1..end];
        rest = &rest[end + 1..];
        if let Some(name) = tag.strip_prefix('/') {
            assert_eq!(
                stack.pop().as_deref(),
                Some(name.trim()),
                "{}: mismatched closing tag",
                path.display()
            );
            continue;
        }
        let self_closing = tag.ends_with('/');
        let tag = tag.trim_end_matches('/');
        let name: String = tag.chars().take_while(|c| !c.is_whitespace()).collect();
        assert!(!name.is_empty(), "{}: empty tag name", path.display());
        assert_attributes(path, &tag[name.len()..]);
        if stack.is_empty() {
            assert!(
                root.is_none(),
                "{}: more than one root element",
                path.display()
            );
            root = Some(tag.to_string());
        }
        if !self_closing {
            stack.push(name);
        }
    }
    assert!(
        stack.is_empty(),
        "{}: unclosed elements {stack:?}",
        path.display()
    );
    assert!(rest.trim().is_empty(), "{}: trailing text", path.display());
    let root = root.unwrap_or_default();
    assert!(
        root.starts_with("svg"),
        "{}: root is not <svg>",
        path.display()
    );
    assert!(
        root.contains("width=\"1200\"") && root.contains("height=\"600\""),
        "{root}"
    );
    text
}

/// `name="value"` pairs separated by whitespace, nothing else.
fn assert_attributes(path: &Path, mut attrs: &str) {
    loop {
        attrs = attrs.trim_start();
        if attrs.is_empty() {
            return;
        }
        let eq = attrs
            .find('=')
            .unwrap_or_else(|| panic!("{}: attribute without value: {attrs}", path.display()));
        let name = &attrs[..eq];
        assert!(
            !name.is_empty() && !name.contains(char::is_whitespace),
            "{}: bad attribute name {name:?}",
            path.display()
        );
        let value = &attrs[eq + 1..];
        let quote = value.chars().next().unwrap_or(' ');
        assert!(
            quote == '"' || quote == '\'',
            "{}: unquoted attribute {name}",
            path.display()
        );
        let close = value[1..]
            .find(quote)
            .unwrap_or_else(|| panic!("{}: unterminated attribute {name}", path.display()));
        assert!(
            !value[1..=close].contains('<'),
            "{}: '<' in attribute",
            path.display()
        );
        attrs = &value[close + 2..];
    }
}

fn assert_chart_files(dir: &Path, chart: &str, written: &[PathBuf]) {
    let png = dir.join(format!("{chart}.png"));
    let svg = dir.join(format!("{chart}.svg"));
    assert!(written.contains(&png), "{} not reported", png.display());
    assert!(written.contains(&svg), "{} not reported", svg.display());
    assert_eq!(png_size(&png), (1200, 600));
    assert_svg(&svg);
}

#[test]
fn full_run_plots_every_chart_as_png_and_svg() {
    let dir = tempfile::tempdir().unwrap();
    write_jsonl(&dir.path().join("metrics.jsonl"), &full_run_events());
    write_jsonl(&dir.path().join("telemetry.jsonl"), &snapshots(120, 2));

    let summary = plot_run_detailed(dir.path()).unwrap();
    let expected = [
        "loss",
        "s_ratio",
        "lambda",
        "lr",
        "throughput",
        "gpu_util",
        "gpu_memory",
        "host_cpu",
        "host_ram",
    ];
    assert_eq!(summary.charts(), expected);
    assert!(summary.skipped.is_empty(), "{:?}", summary.skipped);
    assert_eq!(summary.written.len(), 2 * expected.len());
    let plots = dir.path().join("plots");
    for chart in expected {
        assert_chart_files(&plots, chart, &summary.written);
    }

    let loss = fs::read_to_string(plots.join("loss.svg")).unwrap();
    for text in [
        "Loss — tiny-lm",
        "train (smoothed)",
        "validation",
        "entropy floor",
        "step",
    ] {
        assert!(loss.contains(text), "loss.svg lacks {text:?}");
    }
    let s = fs::read_to_string(plots.join("s_ratio.svg")).unwrap();
    assert!(s.contains("setpoint S*"));
    let gpu = fs::read_to_string(plots.join("gpu_util.svg")).unwrap();
    assert!(gpu.contains("GPU0 H100 80GB HBM3") && gpu.contains("GPU1 H100 80GB HBM3"));

    // Text needs a font: either one was found, or the summary says so.
    match report::font_status() {
        report::FontStatus::Loaded(path) => assert!(path.is_file()),
        report::FontStatus::Missing(notice) => assert!(summary.notices.contains(notice)),
    }

    // The plain entry point writes the same files again.
    let again = plot_run(dir.path()).unwrap();
    assert_eq!(again, summary.written);
    let text = summary.to_string();
    assert!(text.starts_with("wrote 9 chart(s)"), "{text}");
}

#[test]
fn charts_without_data_are_skipped_not_drawn_empty() {
    let dir = tempfile::tempdir().unwrap();
    let events: Vec<Event> = std::iter::once(Event::RunStarted(run_info(0)))
        .chain((1..=50).map(|i| step(i, 3.0 - i as f64 * 0.01)))
        .collect();
    write_jsonl(&dir.path().join("metrics.jsonl"), &events);

    let summary = plot_run_detailed(dir.path()).unwrap();
    assert_eq!(summary.charts(), ["loss", "lr", "throughput"]);
    let skipped: Vec<&str> = summary.skipped.iter().map(|s| s.chart.as_str()).collect();
    assert_eq!(
        skipped,
        [
            "s_ratio",
            "lambda",
            "gpu_util",
            "gpu_memory",
            "host_cpu",
            "host_ram"
        ]
    );
    assert!(summary.skipped[0].reason.contains("SCU"));
    assert!(summary.skipped[2].reason.contains("telemetry.jsonl"));
    let plots = dir.path().join("plots");
    assert!(!plots.join("s_ratio.png").exists());
    assert!(!plots.join("lambda.svg").exists());
    assert!(summary
        .to_string()
        .contains("skipped lambda: no SCU events"));
}

#[test]
fn a_run_with_nothing_to_plot_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    write_jsonl(
        &dir.path().join("metrics.jsonl"),
        &[Event::RunStarted(run_info(0))],
    );
    let summary = plot_run_detailed(dir.path()).unwrap();
    assert!(summary.written.is_empty());
    assert_eq!(summary.skipped.len(), 9);
    assert!(!dir.path().join("plots").exists());
    assert!(summary.to_string().starts_with("no charts written"));
}

#[test]
fn truncated_last_line_is_skipped_with_a_warning() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("metrics.jsonl");
    let events: Vec<Event> = (1..=5).map(|i| step(i, 2.0)).collect();
    write_jsonl(&path, &events);
    append(&path, "{\"event\":\"step\",\"step\":6,\"lo");

    let metrics = load_metrics(&path).unwrap();
    assert_eq!(metrics.steps.len(), 5);
    assert_eq!(metrics.warnings.len(), 1);
    assert!(
        metrics.warnings[0].contains("line 6"),
        "{:?}",
        metrics.warnings
    );

    let summary = plot_run_detailed(dir.path()).unwrap();
    assert!(summary.charts().contains(&"loss".to_string()));
    assert!(summary.notices.iter().any(|n| n.contains("line 6")));

    // Trailing blank lines after the broken one do not make it a "middle" line.
    append(&path, "\n\n");
    assert_eq!(load_metrics(&path).unwrap().steps.len(), 5);
}

#[test]
fn bad_middle_line_is_an_error_naming_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("metrics.jsonl");
    write_jsonl(&path, &[step(1, 2.0), step(2, 2.0)]);
    append(&path, "this is not json\n");
    append(
        &path,
        &format!("{}\n", serde_json::to_string(&step(3, 2.0)).unwrap()),
    );

    let err = load_metrics(&path).unwrap_err();
    match &err {
        ReportError::Parse { line, path: p, .. } => {
            assert_eq!(*line, 3);
            assert_eq!(p, &path);
        }
        other => panic!("expected a parse error, got {other:?}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains("metrics.jsonl") && msg.contains("line 3"),
        "{msg}"
    );
    assert!(matches!(
        plot_run(dir.path()),
        Err(ReportError::Parse { line: 3, .. })
    ));
}

#[test]
fn a_directory_without_metrics_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let err = plot_run(dir.path()).unwrap_err();
    assert!(matches!(err, ReportError::MissingMetrics { .. }));
    assert!(err.to_string().contains("metrics.jsonl"));
}

#[test]
fn resumed_runs_keep_the_timeline_that_continued() {
    // Resumed from the checkpoint at step 5 (as the engine numbers them: the resumed run's
    // first step is 6): step 5 and its eval belong to the timeline that continued, the first
    // run's steps past 5 and its eval at 10 do not.
    let mut events = vec![Event::RunStarted(run_info(0))];
    events.extend((1..=10).map(|i| step(i, 5.0)));
    events.push(eval(5, 5.0));
    events.push(eval(10, 5.0));
    events.push(Event::RunStarted(run_info(5)));
    events.extend((6..=8).map(|i| step(i, 1.0)));
    let m = report::RunMetrics::from_events(events);
    let steps: Vec<u64> = m.steps.iter().map(|s| s.step).collect();
    assert_eq!(steps, [1, 2, 3, 4, 5, 6, 7, 8]);
    assert!(m.steps[..5].iter().all(|s| s.loss == 5.0));
    assert!(m.steps[5..].iter().all(|s| s.loss == 1.0));
    let evals: Vec<u64> = m.evals.iter().map(|e| e.step).collect();
    assert_eq!(evals, [5]);
    assert_eq!(m.info.as_ref().map(|i| i.start_step), Some(5));
    assert_eq!(m.events.len(), 2);
}

#[test]
fn resuming_a_finished_run_keeps_its_last_step() {
    // A run that reached max_steps (10), resumed at once with the same max_steps: the second
    // run starts and ends at step 10, and the results at step 10 stay.
    let mut events = vec![Event::RunStarted(run_info(0))];
    events.extend((1..=10).map(|i| step(i, 5.0)));
    events.push(eval(10, 4.0));
    events.push(Event::RunStarted(run_info(10)));
    let m = report::RunMetrics::from_events(events);
    assert_eq!(m.steps.len(), 10);
    assert_eq!(m.val_loss(), vec![(10.0, 4.0)]);
}

#[test]
fn non_finite_values_and_single_points_still_plot() {
    let dir = tempfile::tempdir().unwrap();
    let mut events = vec![Event::RunStarted(run_info(0))];
    events.extend((1..=40).map(|i| step(i, if i % 10 == 0 { f64::NAN } else { 2.0 })));
    events.push(eval(40, 1.9));
    events.push(scu(7, 0.01)); // one SCU step
    write_jsonl(&dir.path().join("metrics.jsonl"), &events);

    let summary = plot_run_detailed(dir.path()).unwrap();
    for chart in ["loss", "s_ratio", "lambda", "lr", "throughput"] {
        assert_chart_files(&dir.path().join("plots"), chart, &summary.written);
    }
    assert!(
        summary
            .notices
            .iter()
            .any(|n| n.starts_with("loss: left out 4 point(s)")),
        "{:?}",
        summary.notices
    );
}

#[test]
fn damaged_telemetry_costs_only_its_charts() {
    let dir = tempfile::tempdir().unwrap();
    write_jsonl(&dir.path().join("metrics.jsonl"), &full_run_events());
    let telemetry = dir.path().join("telemetry.jsonl");
    write_jsonl(&telemetry, &snapshots(3, 1));
    append(&telemetry, "garbage\n");
    write_jsonl(&dir.path().join("more.jsonl"), &snapshots(1, 1));
    append(
        &telemetry,
        &fs::read_to_string(dir.path().join("more.jsonl")).unwrap(),
    );

    assert!(matches!(
        load_telemetry(&telemetry),
        Err(ReportError::Parse { line: 4, .. })
    ));
    let summary = plot_run_detailed(dir.path()).unwrap();
    assert_eq!(summary.charts().len(), 5);
    let gpu = summary
        .skipped
        .iter()
        .find(|s| s.chart == "gpu_util")
        .unwrap();
    assert!(gpu.reason.contains("line 4"), "{}", gpu.reason);
}

#[test]
fn monitor_plots_one_line_per_gpu_and_host_usage() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("session");
    let snaps = snapshots(90, 3);

    let written = plot_monitor(&snaps, &out).unwrap();
    assert_eq!(written.len(), 8);
    for chart in ["gpu_util", "gpu_memory", "host_cpu", "host_ram"] {
        assert_chart_files(&out, chart, &written);
    }
    let util = fs::read_to_string(out.join("gpu_util.svg")).unwrap();
    for g in 0..3 {
        assert!(
            util.contains(&format!("GPU{g} H100")),
            "no legend entry for GPU{g}"
        );
    }
    assert!(util.contains("time since first sample (s)"));
    let mem = fs::read_to_string(out.join("gpu_memory.svg")).unwrap();
    assert!(mem.contains("of 80 GiB"));
    let ram = fs::read_to_string(out.join("host_ram.svg")).unwrap();
    assert!(ram.contains("used (of 128 GiB)") && ram.contains("cockpit RSS"));
}

#[test]
fn monitor_without_gpus_says_why_and_still_plots_the_host() {
    let dir = tempfile::tempdir().unwrap();
    let mut snaps = snapshots(20, 0);
    for s in &mut snaps {
        s.gpu_notice = Some("NVML not available: driver not loaded".into());
    }
    let summary = plot_monitor_detailed(&snaps, dir.path()).unwrap();
    assert_eq!(summary.charts(), ["host_cpu", "host_ram"]);
    assert_eq!(summary.skipped.len(), 2);
    assert!(summary.skipped[0].reason.contains("NVML not available"));
}

#[test]
fn monitor_tolerates_missing_fields_gaps_and_a_single_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    // Utilization unknown on GPU1, a long pause in the middle, then one lone sample.
    let mut snaps = snapshots(30, 2);
    for s in &mut snaps {
        s.gpus[1].util_gpu = None;
    }
    for s in &mut snaps[20..] {
        s.timestamp_ms += 3_600_000;
    }
    let written = plot_monitor(&snaps, dir.path()).unwrap();
    assert_eq!(written.len(), 8);
    let util = fs::read_to_string(dir.path().join("gpu_util.svg")).unwrap();
    assert!(util.contains("GPU0") && !util.contains("GPU1"));
    assert!(util.contains("time since first sample (min)"));

    let one = tempfile::tempdir().unwrap();
    let written = plot_monitor(&snapshots(1, 1), one.path()).unwrap();
    assert_eq!(written.len(), 8);
    assert_eq!(png_size(&one.path().join("gpu_memory.png")), (1200, 600));
}

#[test]
fn an_empty_monitor_session_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("never");
    let summary = plot_monitor_detailed(&[], &out).unwrap();
    assert!(summary.written.is_empty());
    assert_eq!(summary.skipped.len(), 4);
    assert!(!out.exists());
}
