//! Samplers and traces, on whatever machine the tests run: without an NVIDIA driver (CI) the
//! sampler must yield host metrics and one notice; with one, GPU samples and no notice.

mod telemetry_support;

use std::io::Write;
use std::time::Duration;

use cockpit::telemetry::{
    read_trace, sample_once, spawn_sampler, Replay, SamplerOptions, Snapshot, SourceKind,
    TelemetryError, TraceWriter,
};
use telemetry_support::*;

/// Generous: a stuck sampler fails the test instead of hanging it.
const PATIENCE: Duration = Duration::from_secs(30);

/// GPU metrics and the notice agree: either GPUs and no notice, or no GPU and a notice.
fn assert_gpu_side_consistent(snapshot: &Snapshot, notice: Option<&str>) {
    if snapshot.gpus.is_empty() {
        let notice = notice.expect("no GPU sampled, so there must be a notice");
        assert!(
            notice.contains("GPU metrics off, host metrics only"),
            "{notice}"
        );
        assert_eq!(snapshot.gpu_notice.as_deref(), Some(notice));
    } else {
        assert_eq!(notice, None);
        for g in &snapshot.gpus {
            assert!(!g.name.is_empty());
        }
    }
}

fn assert_host_metrics(snapshot: &Snapshot) {
    let host = &snapshot.host;
    assert!(host.cpu_cores > 0);
    assert!(host.ram_total_bytes > 0 && host.ram_used_bytes <= host.ram_total_bytes);
    assert!(host.self_rss_bytes > 0, "this process's RSS");
    assert!((0.0..=100.0).contains(&host.cpu_pct));
}

#[test]
fn the_live_sampler_yields_host_metrics_and_explains_missing_gpus() {
    let sampler = spawn_sampler(SamplerOptions {
        interval: Duration::from_millis(50),
        record: None,
    })
    .unwrap();
    assert_eq!(
        sampler.source(),
        &SourceKind::Live {
            interval: Duration::from_millis(50)
        }
    );
    let first = sampler.recv_timeout(PATIENCE).unwrap();
    let second = sampler.recv_timeout(PATIENCE).unwrap();
    assert!(second.timestamp_ms >= first.timestamp_ms);
    let notice = sampler.notice();
    for snapshot in [&first, &second] {
        assert_host_metrics(snapshot);
        assert_gpu_side_consistent(snapshot, notice.as_deref());
    }
}

#[test]
fn sample_once_works_without_a_gpu_driver() {
    let snapshot = sample_once();
    assert_host_metrics(&snapshot);
    let notice = snapshot.gpu_notice.clone();
    assert_gpu_side_consistent(&snapshot, notice.as_deref());
}

#[test]
fn a_zero_interval_is_refused() {
    let err = spawn_sampler(SamplerOptions {
        interval: Duration::ZERO,
        record: None,
    })
    .err()
    .unwrap();
    assert!(matches!(err, TelemetryError::ZeroInterval));
}

#[test]
fn recording_writes_what_the_sampler_delivers() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nested/trace.jsonl");
    let sampler = spawn_sampler(SamplerOptions {
        interval: Duration::from_millis(20),
        record: Some(path.clone()),
    })
    .unwrap();
    let received: Vec<Snapshot> = (0..3)
        .map(|_| sampler.recv_timeout(PATIENCE).unwrap())
        .collect();
    drop(sampler);
    let recorded = read_trace(&path).unwrap();
    assert!(recorded.len() >= received.len());
    assert_eq!(&recorded[..received.len()], &received[..]);
}

#[test]
fn a_replay_yields_the_trace_in_order_then_ends() {
    let trace = data_starved_trace();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.jsonl");
    let mut writer = TraceWriter::create(&path).unwrap();
    for s in &trace {
        writer.write(s).unwrap();
    }
    drop(writer);

    let replay = Replay::open(&path, 0.0).unwrap();
    assert_eq!(replay.notice(), None);
    let mut got = Vec::new();
    while let Ok(s) = replay.receiver().recv_timeout(PATIENCE) {
        got.push(s);
    }
    assert_eq!(
        got, trace,
        "every snapshot, in order, then the channel closes"
    );
}

#[test]
fn a_real_time_replay_can_be_dropped_mid_wait() {
    // Snapshots an hour apart: dropping the replay must not wait for the next one.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("slow.jsonl");
    let mut writer = TraceWriter::create(&path).unwrap();
    writer.write(&snapshot(0, vec![gpu(0, 50, 0.5)])).unwrap();
    writer
        .write(&snapshot(3600, vec![gpu(0, 50, 0.5)]))
        .unwrap();
    drop(writer);
    let replay = Replay::open(&path, 1.0).unwrap();
    assert!(replay.recv_timeout(PATIENCE).is_ok());
    drop(replay);
}

#[test]
fn a_replay_carries_the_recorded_notice() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nogpu.jsonl");
    let mut s = snapshot(0, Vec::new());
    s.gpu_notice = Some("NVML not available (test): GPU metrics off, host metrics only".into());
    let mut writer = TraceWriter::create(&path).unwrap();
    writer.write(&s).unwrap();
    drop(writer);
    let replay = Replay::open(&path, 0.0).unwrap();
    assert_eq!(replay.notice(), s.gpu_notice);
    assert_eq!(replay.recv(), Some(s));
    assert_eq!(replay.recv(), None);
}

#[test]
fn a_bad_trace_line_names_the_file_and_the_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.jsonl");
    let mut f = std::fs::File::create(&path).unwrap();
    let good = serde_json::to_string(&snapshot(0, vec![gpu(0, 1, 0.1)])).unwrap();
    writeln!(f, "{good}\n\n{{\"timestamp_ms\": \"soon\"}}").unwrap();
    drop(f);

    let err = Replay::open(&path, 1.0).err().unwrap();
    assert!(
        matches!(err, TelemetryError::BadTraceLine { line: 3, .. }),
        "{err:?}"
    );
    let text = err.to_string();
    assert!(
        text.starts_with(&format!("{}:3:", path.display())),
        "{text}"
    );
}

#[test]
fn replay_refuses_bad_input() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.jsonl");
    assert!(matches!(
        Replay::open(&missing, 1.0).err().unwrap(),
        TelemetryError::ReadTrace { .. }
    ));
    let empty = dir.path().join("empty.jsonl");
    std::fs::write(&empty, "\n").unwrap();
    assert!(matches!(
        Replay::open(&empty, 1.0).err().unwrap(),
        TelemetryError::EmptyTrace { .. }
    ));
    let ok = fixture("idle_gpu.jsonl");
    for speed in [-1.0, f64::NAN, f64::INFINITY] {
        assert!(matches!(
            Replay::open(&ok, speed).err().unwrap(),
            TelemetryError::BadSpeed(_)
        ));
    }
}

#[test]
fn the_trace_fixtures_are_up_to_date() {
    for (name, snapshots) in fixtures() {
        let on_disk = read_trace(&fixture(name)).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            on_disk, snapshots,
            "{name} differs from its generator: run `cargo test --test telemetry -- --ignored`"
        );
    }
}

/// Writes the fixtures under tests/traces/ from their generators.
#[test]
#[ignore = "regenerates tests/traces/; run by hand after changing the generators"]
fn regenerate_trace_fixtures() {
    for (name, snapshots) in fixtures() {
        let mut writer = TraceWriter::create(&fixture(name)).unwrap();
        for s in &snapshots {
            writer.write(s).unwrap();
        }
    }
}
