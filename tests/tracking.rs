//! TensorBoard and MLflow logs of a real run, read back with the real readers: TensorBoard's
//! EventAccumulator and MLflow's client (each skipped, with a message, where Python or the
//! package is missing), and the TFRecord framing checked here in Rust as well.

mod common;

use serde_json::Value;
use std::path::Path;

/// Run a reader script; None (after saying why) when python3 or its package is absent.
fn python_reader(script: &str, arg: &Path) -> Option<Value> {
    common::python_json("python3", "tracking_support", script, &[arg])
}

fn steps(series: &Value) -> Vec<u64> {
    series
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p[0].as_u64().unwrap())
        .collect()
}

#[test]
fn a_run_writes_tensorboard_and_mlflow_logs_that_their_readers_read() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let store = dir.path().join("mlruns");
    let out = common::cockpit()
        .args(["train", "--no-tui", "--max-steps", "12", "--run-dir"])
        .arg(&run)
        .args(["--set", "eval.every=4"])
        .args(["--set", &format!("monitor.mlflow=\"{}\"", store.display())])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");

    // one event file, named as TensorBoard names them, every record framed and checked
    let files: Vec<_> = std::fs::read_dir(run.join("tb"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let name = files[0].file_name().unwrap().to_string_lossy().into_owned();
    assert!(name.starts_with("events.out.tfevents."), "{name}");
    let bytes = std::fs::read(&files[0]).unwrap();
    let records = cockpit::tracking::tfrecord::read_records(&bytes);
    let framed: usize = records.iter().map(|r| r.len() + 16).sum();
    assert_eq!(
        framed,
        bytes.len(),
        "a record failed its length or CRC check"
    );
    assert!(records.len() > 12 + 3 + 2, "{} records", records.len());

    if let Some(tb) = python_reader("read_tb.py", &run.join("tb")) {
        let s = &tb["scalars"];
        let all: Vec<u64> = (1..=12).collect();
        for tag in [
            "train/loss",
            "train/bits_per_token",
            "train/lr",
            "train/grad_norm",
            "perf/tokens_per_sec",
            "time/step_ms",
            "time/compute_ms",
        ] {
            assert_eq!(steps(&s[tag]), all, "{tag}: {}", s[tag]);
        }
        let evals = steps(&s["val/loss"]);
        assert!(
            evals.contains(&4) && evals.contains(&8) && evals.contains(&12),
            "{evals:?}"
        );
        assert_eq!(steps(&s["val/bits_per_token"]), evals);
        // loss values come back as written (f32)
        let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
        let first: Vec<f64> = metrics
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|v| v["event"] == "step")
            .map(|v| v["loss"].as_f64().unwrap())
            .collect();
        let tb_loss: Vec<f64> = s["train/loss"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p[1].as_f64().unwrap())
            .collect();
        assert_eq!(first.len(), tb_loss.len());
        for (a, b) in first.iter().zip(&tb_loss) {
            assert!((a - b).abs() <= 1e-5 * a.abs().max(1.0), "{a} vs {b}");
        }
        let text = &tb["text"];
        assert!(text["run/header"][0].as_str().unwrap().contains("device"));
        assert!(text["run/config"][0]
            .as_str()
            .unwrap()
            .contains("max_steps = 12"));
        assert!(text["run/finished"][0]
            .as_str()
            .unwrap()
            .starts_with("Completed"));
        let hp = &tb["hparams"]["start"];
        assert_eq!(hp["run.max_steps"], 12.0, "{hp}");
        assert_eq!(hp["eval.every"], 4.0, "{hp}");
        assert_eq!(tb["hparams"]["end_status"], 1, "{tb}");
    }

    // the file-store layout: experiment 0, one run, its artifacts
    let exp = store.join("0");
    let run_dirs: Vec<_> = std::fs::read_dir(&exp)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .collect();
    assert_eq!(run_dirs.len(), 1, "{run_dirs:?}");
    let art = run_dirs[0].join("artifacts");
    for f in std::fs::read_dir(run.join("plots")).unwrap() {
        let f = f.unwrap().path();
        let copied = art.join("plots").join(f.file_name().unwrap());
        assert_eq!(std::fs::read(&f).unwrap(), std::fs::read(&copied).unwrap());
    }
    let ckpts = std::fs::read_to_string(art.join("checkpoints.txt")).unwrap();
    let last = ckpts.lines().last().unwrap();
    let (step, path) = last.split_once(' ').unwrap();
    assert_eq!(step, "12", "{ckpts}");
    assert!(Path::new(path).is_dir(), "{ckpts}");

    if let Some(ml) = python_reader("read_mlflow.py", &store) {
        let runs = ml.as_array().unwrap();
        assert_eq!(runs.len(), 1, "{ml}");
        let r = &runs[0];
        assert_eq!(r["run_name"], "run");
        assert_eq!(r["status"], "FINISHED");
        assert_eq!(r["params"]["run.max_steps"], "12");
        let all: Vec<u64> = (1..=12).collect();
        assert_eq!(steps(&r["metrics"]["train.loss"]), all, "{}", r["metrics"]);
        assert!(r["metrics"]["val.loss"].as_array().unwrap().len() >= 3);
        let artifacts = r["artifacts"].to_string();
        assert!(artifacts.contains("config.toml") && artifacts.contains("metrics.jsonl"));
        assert!(artifacts.contains("checkpoints.txt"), "{artifacts}");
        // the plots, drawn after the run, are artifacts too
        let plots = r["plots"].to_string();
        assert!(
            plots.contains("plots/loss.png") && plots.contains("plots/loss.svg"),
            "{plots}"
        );
        assert!(
            r["tags"]["cockpit.checkpoint.latest"].is_string(),
            "{}",
            r["tags"]
        );
    }
}

#[test]
fn tensorboard_off_writes_no_tb_dir() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let out = common::cockpit()
        .args(["train", "--no-tui", "--max-steps", "2", "--run-dir"])
        .arg(&run)
        .args(["--set", "monitor.tensorboard=false"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!run.join("tb").exists());
}

#[test]
fn an_unwritable_log_dir_warns_and_training_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    // a file where the MLflow store should be a directory
    let store = dir.path().join("not-a-dir");
    std::fs::write(&store, "x").unwrap();
    let out = common::cockpit()
        .args(["train", "--no-tui", "--max-steps", "3", "--run-dir"])
        .arg(&run)
        .args(["--set", &format!("monitor.mlflow=\"{}\"", store.display())])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("mlflow") && err.contains("not-a-dir"), "{err}");
    assert!(err.contains("step 3/3"), "{err}");
}

/// A resumed run adds a second event file; TensorBoard's reader merges them into one series.
#[test]
fn a_resumed_run_appends_an_event_file_that_tensorboard_merges() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let train = |steps: &str, resume: bool| {
        let mut c = common::cockpit();
        c.args(["train", "--no-tui", "--max-steps", steps]);
        if resume {
            c.args(["--resume", "latest"]);
        }
        let out = c
            .arg("--run-dir")
            .arg(&run)
            .args(["--set", "checkpoint.at_end=true"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    train("4", false);
    train("7", true);
    let files = std::fs::read_dir(run.join("tb")).unwrap().count();
    assert_eq!(files, 2);
    if let Some(tb) = python_reader("read_tb.py", &run.join("tb")) {
        assert_eq!(
            steps(&tb["scalars"]["train/loss"]),
            (1..=7).collect::<Vec<u64>>()
        );
    }
}

/// `tensorboard --logdir SWEEP_DIR` finds each run of a sweep, each with its own
/// hyperparameters for the HParams table; MLflow has the sweep as one experiment, named for
/// the sweep, with its runs.
#[test]
fn a_sweeps_runs_are_runs_of_their_own_under_the_sweep_dir() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("lr-sweep");
    let store = dir.path().join("mlruns");
    let mut c = common::cockpit();
    c.arg("sweep")
        .arg("--out")
        .arg(&out_dir)
        .args(["--seeds", "1"])
        .args(["--set", &format!("monitor.mlflow=\"{}\"", store.display())]);
    for s in [
        "model.n_embd=32",
        "model.seq_len=32",
        "optim.micro_batch=8",
        "data.builtin_tokens=100000",
        "run.max_steps=3",
        "schedule.warmup_steps=0",
        "eval.every=0",
        "eval.batches=2",
        "checkpoint.every_steps=0",
    ] {
        c.args(["--set", s]);
    }
    let out = c
        .args(["--set-grid", "optim.lr=0.001,0.002"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    if let Some(runs) = python_reader("read_tb_runs.py", &out_dir) {
        let runs = runs.as_object().unwrap();
        assert_eq!(runs.len(), 2, "{runs:?}");
        let mut lrs: Vec<f64> = runs
            .values()
            .map(|r| {
                assert_eq!(steps_of(&r["steps"]), vec![1, 2, 3], "{r}");
                r["hparams"]["optim.lr"].as_f64().unwrap()
            })
            .collect();
        lrs.sort_by(f64::total_cmp);
        assert_eq!(lrs, vec![0.001, 0.002]);
    }
    // one experiment (not Default), named for the sweep, holding both runs
    let exps: Vec<_> = std::fs::read_dir(&store)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .collect();
    assert_eq!(exps.len(), 1, "{exps:?}");
    let meta = std::fs::read_to_string(exps[0].join("meta.yaml")).unwrap();
    assert!(meta.contains("name: 'lr-sweep'"), "{meta}");
    if let Some(ml) = python_reader("read_mlflow.py", &store) {
        let runs = ml.as_array().unwrap();
        assert_eq!(runs.len(), 2, "{ml}");
        let mut names: Vec<&str> = runs
            .iter()
            .map(|r| {
                assert_eq!(r["experiment"], "lr-sweep", "{r}");
                assert_eq!(r["status"], "FINISHED", "{r}");
                r["run_name"].as_str().unwrap()
            })
            .collect();
        names.sort();
        let mut lrs: Vec<&str> = runs
            .iter()
            .map(|r| r["params"]["optim.lr"].as_str().unwrap())
            .collect();
        lrs.sort();
        assert_eq!(lrs, ["0.001", "0.002"], "{ml}");
        assert!(names.iter().all(|n| n.contains("lr")), "{names:?}");
    }
}

fn steps_of(list: &Value) -> Vec<u64> {
    list.as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_u64().unwrap())
        .collect()
}
