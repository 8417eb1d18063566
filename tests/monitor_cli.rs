//! The headless monitor through its library API (`cockpit::monitor::run_headless`): the
//! `--once --json` schema, status lines, the summary file, `--duration`, replays.

mod telemetry_support;

use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use cockpit::advisor::{ids, Severity};
use cockpit::monitor::{
    run_headless, spawn_pipeline, MonitorOptions, MonitorSummary, SUMMARY_FILE, SUMMARY_SCHEMA,
};
use serde_json::Value;
use telemetry_support::*;

fn run(opts: &MonitorOptions) -> (String, cockpit::monitor::MonitorSession) {
    let mut out = Vec::new();
    let session = run_headless(opts, &mut out, &AtomicBool::new(false)).unwrap();
    (String::from_utf8(out).unwrap(), session)
}

fn replay_opts(trace: &str, out_dir: &Path) -> MonitorOptions {
    MonitorOptions {
        no_tui: true,
        replay: Some(fixture(trace)),
        replay_speed: 0.0,
        out_dir: out_dir.to_path_buf(),
        ..MonitorOptions::default()
    }
}

fn assert_kind(value: &Value, key: &str, check: fn(&Value) -> bool, what: &str) {
    let field = value
        .get(key)
        .unwrap_or_else(|| panic!("missing key {key:?} in {value}"));
    assert!(check(field), "{key} should be {what}, is {field}");
}

fn number_or_null(v: &Value) -> bool {
    v.is_number() || v.is_null()
}

/// The documented `--once --json` schema.
fn assert_once_schema(doc: &Value) {
    assert_kind(doc, "timestamp_ms", Value::is_u64, "an integer");
    assert_kind(doc, "gpus", Value::is_array, "a list");
    assert_kind(doc, "host", Value::is_object, "an object");
    assert_kind(doc, "advice", Value::is_array, "a list");
    assert_kind(
        doc,
        "gpu_notice",
        |v| v.is_string() || v.is_null(),
        "a string or null",
    );
    let host = &doc["host"];
    assert_kind(host, "cpu_pct", Value::is_number, "a number");
    for key in [
        "cpu_cores",
        "ram_used_bytes",
        "ram_total_bytes",
        "self_rss_bytes",
    ] {
        assert_kind(host, key, Value::is_u64, "an integer");
    }
    for gpu in doc["gpus"].as_array().unwrap() {
        assert_kind(gpu, "index", Value::is_u64, "an integer");
        assert_kind(gpu, "name", Value::is_string, "a string");
        assert_kind(gpu, "uuid", Value::is_string, "a string");
        assert_kind(gpu, "mem_used_bytes", Value::is_u64, "an integer");
        assert_kind(gpu, "mem_total_bytes", Value::is_u64, "an integer");
        for key in [
            "util_gpu",
            "util_mem",
            "temperature_c",
            "power_w",
            "power_limit_w",
            "sm_clock_mhz",
            "sm_clock_max_mhz",
            "mem_clock_mhz",
            "mem_clock_max_mhz",
            "pcie_rx_kbps",
            "pcie_tx_kbps",
            "fan_pct",
            "sm_activity_pct",
            "sm_occupancy_pct",
        ] {
            assert_kind(gpu, key, number_or_null, "a number or null");
        }
        assert_kind(gpu, "throttle_reasons", Value::is_array, "a list");
        assert_kind(
            gpu,
            "compute_capability",
            |v| v.is_array() || v.is_null(),
            "[major, minor]",
        );
        assert_kind(gpu, "processes", Value::is_array, "a list");
        for p in gpu["processes"].as_array().unwrap() {
            assert_kind(p, "pid", Value::is_u64, "an integer");
            assert_kind(p, "name", Value::is_string, "a string");
            assert_kind(p, "kind", Value::is_string, "a string");
        }
    }
    for rec in doc["advice"].as_array().unwrap() {
        for key in ["id", "severity", "message", "action"] {
            assert_kind(rec, key, Value::is_string, "a string");
        }
        assert_kind(rec, "evidence", Value::is_array, "a list of [name, value]");
        assert_kind(
            rec,
            "gpu",
            |v| v.is_u64() || v.is_null(),
            "an integer or null",
        );
        assert_kind(
            rec,
            "key",
            |v| v.is_string() || v.is_null(),
            "a string or null",
        );
    }
}

#[test]
fn once_json_on_this_machine_follows_the_schema() {
    let dir = tempfile::tempdir().unwrap();
    let opts = MonitorOptions {
        once: true,
        json: true,
        out_dir: dir.path().to_path_buf(),
        ..MonitorOptions::default()
    };
    let (out, session) = run(&opts);
    assert_eq!(out.lines().count(), 1, "one JSON object: {out}");
    let doc: Value = serde_json::from_str(&out).unwrap();
    assert_once_schema(&doc);
    if doc["gpus"].as_array().unwrap().is_empty() {
        let notice = doc["gpu_notice"].as_str().expect("no GPU, so a notice");
        assert!(notice.contains("host metrics only"), "{notice}");
    }
    assert_eq!(session.sample_count(), 1);
    assert!(
        !dir.path().join(SUMMARY_FILE).exists(),
        "--once writes no summary"
    );
}

#[test]
fn once_json_of_a_gpu_trace_follows_the_schema() {
    let dir = tempfile::tempdir().unwrap();
    let opts = MonitorOptions {
        once: true,
        json: true,
        ..replay_opts("hot_and_full.jsonl", dir.path())
    };
    let (out, _) = run(&opts);
    let doc: Value = serde_json::from_str(&out).unwrap();
    assert_once_schema(&doc);
    assert_eq!(
        doc["gpus"][0]["compute_capability"],
        serde_json::json!([9, 0])
    );
    assert!(doc["gpu_notice"].is_null());
    // One snapshot judged on its own: memory at 95% is already worth a word.
    let advice: Vec<&str> = doc["advice"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["id"].as_str().unwrap())
        .collect();
    assert!(advice.contains(&ids::MEM_HIGH), "{advice:?}");
}

#[test]
fn once_text_is_a_readable_block() {
    let dir = tempfile::tempdir().unwrap();
    let opts = MonitorOptions {
        once: true,
        ..replay_opts("hot_and_full.jsonl", dir.path())
    };
    let (out, _) = run(&opts);
    assert!(
        out.contains("GPU 0   Synthetic GPU 80GB  (compute capability 9.0)"),
        "{out}"
    );
    assert!(out.contains("process 31337 python (alice)"), "{out}");
    assert!(out.contains("Host    cpu 20% of 16 cores"), "{out}");
    assert!(out.contains("[warn] mem_high"), "{out}");
    assert!(
        out.contains("action: The job is close to running out of memory"),
        "{out}"
    );
    assert!(
        !out.contains("[key"),
        "no cockpit key without a training run: {out}"
    );
}

#[test]
fn a_replayed_session_prints_status_lines_and_writes_a_summary() {
    let dir = tempfile::tempdir().unwrap();
    let (out, session) = run(&replay_opts("idle_gpu.jsonl", dir.path()));
    let lines: Vec<&str> = out.lines().collect();
    let trace_len = idle_trace().len();
    assert_eq!(
        lines.len(),
        trace_len + 1,
        "a line per snapshot and the summary path"
    );
    assert!(
        lines[0].contains("gpu0 0% 0.5/80.0G 40°C 80W | cpu 20% ram 12.0/64.0G | advice: -"),
        "{}",
        lines[0]
    );
    assert!(
        lines[trace_len - 1].ends_with("advice: idle(gpu0)"),
        "{}",
        lines[trace_len - 1]
    );
    assert!(lines[trace_len].starts_with("summary: "));

    assert_eq!(session.snapshots().len(), trace_len);
    let path = dir.path().join(SUMMARY_FILE);
    let summary: MonitorSummary =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert_eq!(summary, session.summary());
    assert_eq!(summary.schema, SUMMARY_SCHEMA);
    assert_eq!(summary.samples, trace_len as u64);
    assert_eq!(summary.duration_s, (trace_len - 1) as f64);
    assert_eq!(summary.gpus.len(), 1);
    assert_eq!(summary.gpus[0].util_gpu_peak_pct, Some(0));
    assert_eq!(summary.host.cpu_peak_pct, 20.0);
    let idle = &summary.advice[0];
    assert_eq!(
        (idle.id.as_str(), idle.gpu, idle.severity),
        (ids::IDLE, Some(0), Severity::Info)
    );
    assert_eq!(
        idle.first_seen_s, 6.0,
        "judged from 5 samples on, after 3 in a row"
    );
    assert_eq!(idle.last_seen_s, (trace_len - 1) as f64);
}

#[test]
fn the_summary_json_has_the_documented_keys() {
    let dir = tempfile::tempdir().unwrap();
    run(&replay_opts("data_starved.jsonl", dir.path()));
    let doc: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join(SUMMARY_FILE)).unwrap())
            .unwrap();
    for key in [
        "schema",
        "source",
        "started_ms",
        "ended_ms",
        "duration_s",
        "samples",
        "gpu_notice",
        "gpus",
        "host",
        "advice",
    ] {
        assert!(doc.get(key).is_some(), "missing {key}");
    }
    let gpu = &doc["gpus"][0];
    for key in [
        "mem_used_peak_bytes",
        "mem_used_avg_bytes",
        "util_gpu_avg_pct",
        "util_gpu_peak_pct",
    ] {
        assert!(gpu[key].is_number(), "{key}: {gpu}");
    }
    let advice: Vec<&str> = doc["advice"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["id"].as_str().unwrap())
        .collect();
    assert_eq!(advice, vec![ids::UNDERUTILIZED, ids::WELL_UTILIZED]);
    for a in doc["advice"].as_array().unwrap() {
        assert!(a["first_seen_s"].as_f64().unwrap() <= a["last_seen_s"].as_f64().unwrap());
    }
}

#[test]
fn duration_stops_the_session_on_trace_time() {
    let dir = tempfile::tempdir().unwrap();
    let opts = MonitorOptions {
        duration: Some(Duration::from_secs(10)),
        ..replay_opts("data_starved.jsonl", dir.path())
    };
    let (_, session) = run(&opts);
    assert_eq!(session.sample_count(), 11, "t = 0 s … 10 s");
    assert_eq!(session.duration_s(), 10.0);
}

#[test]
fn json_streaming_prints_one_object_per_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let opts = MonitorOptions {
        json: true,
        ..replay_opts("hot_and_full.jsonl", dir.path())
    };
    let (out, _) = run(&opts);
    let docs: Vec<Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(
        docs.len(),
        hot_and_full_trace().len(),
        "only JSON on the output"
    );
    for doc in &docs {
        assert_once_schema(doc);
    }
}

#[test]
fn the_same_trace_gives_the_same_advice_sequence() {
    let advice_of = || {
        let dir = tempfile::tempdir().unwrap();
        let opts = MonitorOptions {
            json: true,
            ..replay_opts("data_starved.jsonl", dir.path())
        };
        let (out, _) = run(&opts);
        out.lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap()["advice"].clone())
            .collect::<Vec<_>>()
    };
    let first = advice_of();
    assert_eq!(first.len(), data_starved_trace().len());
    assert_eq!(first, advice_of());
}

#[test]
fn a_raised_stop_flag_ends_the_session() {
    let dir = tempfile::tempdir().unwrap();
    let mut out = Vec::new();
    let session = run_headless(
        &replay_opts("idle_gpu.jsonl", dir.path()),
        &mut out,
        &AtomicBool::new(true),
    )
    .unwrap();
    assert_eq!(session.sample_count(), 0);
    assert!(
        dir.path().join(SUMMARY_FILE).exists(),
        "a summary even when stopped at once"
    );
}

#[test]
fn a_live_session_on_this_machine_runs_and_summarises() {
    let dir = tempfile::tempdir().unwrap();
    let opts = MonitorOptions {
        no_tui: true,
        interval: Duration::from_millis(50),
        duration: Some(Duration::from_millis(150)),
        record: Some(dir.path().join("rec.jsonl")),
        out_dir: dir.path().to_path_buf(),
        ..MonitorOptions::default()
    };
    let (out, session) = run(&opts);
    assert!(session.sample_count() >= 2);
    assert!(out.lines().any(|l| l.contains("| cpu ")), "{out}");
    let recorded = cockpit::telemetry::read_trace(&dir.path().join("rec.jsonl")).unwrap();
    assert!(recorded.len() as u64 >= session.sample_count());
    assert!(dir.path().join(SUMMARY_FILE).exists());
}

#[test]
fn record_and_replay_together_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let opts = MonitorOptions {
        record: Some(dir.path().join("x.jsonl")),
        ..replay_opts("idle_gpu.jsonl", dir.path())
    };
    let mut out = Vec::new();
    let err = run_headless(&opts, &mut out, &AtomicBool::new(false)).unwrap_err();
    assert!(err.to_string().contains("--record and --replay"));
}

#[test]
fn the_pipeline_feeds_a_tui() {
    let dir = tempfile::tempdir().unwrap();
    let pipeline = spawn_pipeline(&replay_opts("idle_gpu.jsonl", dir.path())).unwrap();
    let updates: Vec<_> = pipeline.receiver().iter().collect();
    assert_eq!(updates.len(), idle_trace().len());
    assert_eq!(updates.last().unwrap().advice[0].id, ids::IDLE);
}

#[test]
fn a_detached_pipeline_runs_to_the_end_of_its_trace() {
    let dir = tempfile::tempdir().unwrap();
    let pipeline = spawn_pipeline(&replay_opts("data_starved.jsonl", dir.path())).unwrap();
    let feed = pipeline.feeder();
    let updates = pipeline.into_receiver();
    let got: Vec<_> = updates.iter().collect();
    assert_eq!(got.len(), data_starved_trace().len());
    // Feeding a finished pipeline is harmless.
    feed.feed(&cockpit::engine::events::Event::Paused { step: 0 });
}
