//! Started the way clusters start jobs (issue 42): the TCPStore client against torch's own
//! store, real torchrun CPU jobs (plain and restarted), and srun-shaped environments set by
//! hand, requeued. The torch cases skip, saying so, where python3 has no torch or there is
//! no torchrun (point COCKPIT_TEST_PYTHON / COCKPIT_TEST_TORCHRUN at them).

use cockpit::distributed::store::{Store, StoreError};
use cockpit::distributed::{rendezvous_via_store, Topology};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A small CPU run (as tests/data_parallel.rs), on the default `distributed.backend`
/// ("auto": tcp on the CPU).
const SMALL: &[&str] = &[
    "--device",
    "cpu",
    "--set",
    "data.builtin_tokens=300000",
    "--set",
    "model.dropout=0.0",
    "--set",
    "eval.every=0",
    "--set",
    "eval.batches=2",
    "--set",
    "monitor.enabled=false",
    "--set",
    "run.log_every_secs=60",
    "--set",
    "optim.micro_batch=4",
    "--set",
    "checkpoint.every_steps=2",
    "--set",
    "checkpoint.keep_last=8",
];

fn exe() -> PathBuf {
    assert_cmd::cargo::cargo_bin("cockpit")
}

/// Say a test skips, on the real stderr (libtest captures `eprintln!`, not this).
fn skipped(why: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED {why}");
}

/// `program` when `program args` runs and succeeds, or None after saying why the test skips.
fn runs_or_skip(test: &str, program: String, args: &[&str], missing: &str) -> Option<String> {
    let ok = Command::new(&program)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        skipped(&format!("{test}: {program} {missing}"));
    }
    ok.then_some(program)
}

/// A python3 that imports torch, or None after saying why the test skips.
fn python_with_torch(test: &str) -> Option<String> {
    let py = std::env::var("COCKPIT_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
    runs_or_skip(
        test,
        py,
        &["-c", "import torch.distributed"],
        "cannot import torch (set COCKPIT_TEST_PYTHON to a python with torch)",
    )
}

/// torchrun, or None after saying why the test skips.
fn torchrun(test: &str) -> Option<String> {
    let t = std::env::var("COCKPIT_TEST_TORCHRUN").unwrap_or_else(|_| "torchrun".into());
    runs_or_skip(
        test,
        t,
        &["--help"],
        "is missing (install torch, or set COCKPIT_TEST_TORCHRUN)",
    )
}

/// torch's own TCPStore server in a python process; its port. `script` runs after the
/// store is up (`s` is the store) and prints "ok" when its checks pass.
fn torch_store(py: &str, script: &str) -> (Child, u16) {
    let code = format!(
        "import datetime, sys\nfrom torch.distributed import TCPStore\n\
         s = TCPStore('127.0.0.1', 0, None, True, timeout=datetime.timedelta(seconds=120), wait_for_workers=False)\n\
         print(s.port, flush=True)\n{script}\nprint('ok', flush=True)\n"
    );
    let mut child = Command::new(py)
        .args(["-c", &code])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    let port = line
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("port: {line:?}"));
    (child, port)
}

fn finish_ok(child: Child) {
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("ok"),
        "python: {stdout}"
    );
}

#[test]
fn the_store_client_speaks_torchs_tcpstore() {
    let Some(py) = python_with_torch("the_store_client_speaks_torchs_tcpstore") else {
        return;
    };
    let (child, port) = torch_store(
        &py,
        "s.wait(['rust-done'])\n\
         assert s.get('a') == b'hello', s.get('a')\n\
         assert s.get('n') == b'7', s.get('n')\n\
         assert s.get('c') == b'first', s.get('c')\n\
         s.set('from-py', b'hi')\n\
         s.wait(['bye'])",
    );
    let mut s = Store::connect("127.0.0.1", port, Duration::from_secs(60)).unwrap();
    s.set("a", b"hello").unwrap();
    assert_eq!(s.add("n", 5).unwrap(), 5);
    assert_eq!(s.add("n", 2).unwrap(), 7);
    assert_eq!(s.compare_set("c", b"", b"first").unwrap(), b"first");
    assert_eq!(s.compare_set("c", b"", b"second").unwrap(), b"first");
    assert_eq!(s.compare_set("c", b"first", b"first").unwrap(), b"first");
    assert!(s.check(&["a", "n"]).unwrap());
    assert!(!s.check(&["a", "missing"]).unwrap());
    // A wait that times out is withdrawn, and the connection goes on working.
    let e = s.wait(&["never"], Duration::from_millis(300)).unwrap_err();
    assert!(matches!(e, StoreError::Timeout { .. }), "{e}");
    assert!(e.to_string().contains("never"), "{e}");
    assert_eq!(s.get("a").unwrap(), b"hello");
    s.set("rust-done", b"1").unwrap();
    assert_eq!(
        s.wait_get("from-py", Duration::from_secs(60)).unwrap(),
        b"hi"
    );
    s.set("bye", b"1").unwrap();
    finish_ok(child);
}

#[test]
fn ranks_meet_through_a_torch_store_and_keep_their_control_sockets() {
    let Some(py) = python_with_torch("ranks_meet_through_a_torch_store") else {
        return;
    };
    let (child, port) = torch_store(&py, "s.wait(['bye'])");
    let world = 3;
    let handles: Vec<_> = (0..world)
        .map(|r| {
            std::thread::spawn(move || {
                let t = Topology {
                    rank: r,
                    world,
                    local_rank: r,
                    master_addr: "127.0.0.1".into(),
                    master_port: port,
                };
                let mut store = Store::connect("127.0.0.1", port, Duration::from_secs(30)).unwrap();
                let payload = (r == 0).then(|| b"rank 0's".to_vec());
                let (p, peers) = rendezvous_via_store(
                    &t,
                    &mut store,
                    "cockpit/test/attempt-0",
                    payload,
                    Duration::from_secs(30),
                )
                .unwrap();
                (p, peers.connected())
            })
        })
        .collect();
    for (r, h) in handles.into_iter().enumerate() {
        let (p, connected) = h.join().unwrap();
        assert_eq!(p, b"rank 0's", "rank {r}");
        assert_eq!(connected, if r == 0 { vec![1, 2] } else { vec![0] });
    }
    let mut s = Store::connect("127.0.0.1", port, Duration::from_secs(30)).unwrap();
    s.set("bye", b"1").unwrap();
    finish_ok(child);
}

fn losses(metrics: &Path) -> Vec<(u64, f64)> {
    // The last line of each step: a restarted run logs the steps after its checkpoint again.
    let mut by_step = std::collections::BTreeMap::new();
    for l in std::fs::read_to_string(metrics)
        .unwrap_or_else(|e| panic!("{}: {e}", metrics.display()))
        .lines()
    {
        let Ok(e) = serde_json::from_str::<serde_json::Value>(l) else {
            continue;
        };
        if e["event"] == "step" {
            by_step.insert(e["step"].as_u64().unwrap(), e["loss"].as_f64().unwrap());
        }
    }
    by_step.into_iter().collect()
}

fn assert_same_track(a: &[(u64, f64)], b: &[(u64, f64)], what: &str) {
    assert!(
        !a.is_empty() && a.len() == b.len(),
        "{what}: {a:?} vs {b:?}"
    );
    for ((sa, la), (sb, lb)) in a.iter().zip(b) {
        assert_eq!(sa, sb, "{what}");
        assert!(
            ((la - lb) / lb).abs() < 1e-5,
            "{what}: step {sa}: {la} vs {lb}"
        );
    }
}

/// `cockpit train --gpus 2` on the CPU: the reference track.
fn gpus_2(run_dir: &Path, steps: u32) -> Vec<(u64, f64)> {
    let out = Command::new(exe())
        .args([
            "train",
            "--gpus",
            "2",
            "--no-tui",
            "--max-steps",
            &steps.to_string(),
        ])
        .args(SMALL)
        .arg("--run-dir")
        .arg(run_dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "--gpus 2: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    losses(&run_dir.join("metrics.jsonl"))
}

/// Run torchrun with `args` then the cockpit command line; its output (both streams).
fn run_torchrun(t: &str, args: &[&str], cockpit: &[String], log: &Path) -> bool {
    let out = std::fs::File::create(log).unwrap();
    Command::new(t)
        .args(args)
        .args(cockpit)
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .status()
        .unwrap()
        .success()
}

fn train_args(steps: u32, run_dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = ["train", "--no-tui", "--max-steps", &steps.to_string()]
        .iter()
        .map(|s| s.to_string())
        .collect();
    v.extend(SMALL.iter().map(|s| s.to_string()));
    v.push("--run-dir".into());
    v.push(run_dir.display().to_string());
    v
}

#[test]
fn torchrun_standalone_trains_like_gpus_2() {
    let Some(t) = torchrun("torchrun_standalone_trains_like_gpus_2") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (tr, reference, log) = (
        dir.path().join("tr"),
        dir.path().join("ref"),
        dir.path().join("torchrun.log"),
    );
    let mut cmd = vec![exe().display().to_string()];
    cmd.extend(train_args(6, &tr));
    let ok = run_torchrun(
        &t,
        &["--standalone", "--nproc_per_node", "2", "--no-python"],
        &cmd,
        &log,
    );
    let out = std::fs::read_to_string(&log).unwrap();
    assert!(ok, "torchrun: {out}");
    assert!(out.contains("launched by torchrun"), "{out}");
    assert!(out.contains("through torchrun's store"), "{out}");
    assert_same_track(
        &losses(&tr.join("metrics.jsonl")),
        &gpus_2(&reference, 6),
        "torchrun --standalone vs --gpus 2",
    );
}

/// `--max-restarts 1`: rank 1 fails at step 5 on the first attempt; torchrun restarts both
/// workers, which resume from the step-4 checkpoint and train on exactly as an uninterrupted
/// run does.
#[test]
fn a_torchrun_restart_resumes_from_the_latest_checkpoint() {
    let Some(t) = torchrun("a_torchrun_restart_resumes_from_the_latest_checkpoint") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (tr, reference, log) = (
        dir.path().join("tr"),
        dir.path().join("ref"),
        dir.path().join("torchrun.log"),
    );
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
    // The fault only on the first attempt (the worker's environment is torchrun's).
    let mut cmd = vec![
        "sh".to_string(),
        "-c".into(),
        r#"if [ "$TORCHELASTIC_RESTART_COUNT" = 0 ]; then export COCKPIT_FAULT_FAIL=1:5; fi; exec "$@""#.into(),
        "worker".into(),
        exe().display().to_string(),
    ];
    cmd.extend(train_args(8, &tr));
    let ok = run_torchrun(
        &t,
        &[
            "--nnodes",
            "1",
            "--nproc_per_node",
            "2",
            "--max-restarts",
            "1",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            &port,
            "--no-python",
        ],
        &cmd,
        &log,
    );
    let out = std::fs::read_to_string(&log).unwrap();
    assert!(ok, "torchrun: {out}");
    assert!(out.contains("TORCHELASTIC_RESTART_COUNT=1"), "{out}");
    assert!(out.contains("every rank resumes from"), "{out}");
    assert!(out.contains("step-00000004"), "{out}");
    let resumed: Vec<_> = losses(&tr.join("metrics.jsonl"))
        .into_iter()
        .filter(|(s, _)| *s > 4)
        .collect();
    let whole: Vec<_> = gpus_2(&reference, 8)
        .into_iter()
        .filter(|(s, _)| *s > 4)
        .collect();
    assert_same_track(&resumed, &whole, "restarted vs uninterrupted, after step 4");
}

/// A port SLURM-shaped ranks derive from the job id (15000 + id % 20000) that is free now:
/// the job id that gives it.
fn free_slurm_job_id() -> u64 {
    let start = std::process::id() as u64 % 20000;
    (0..20000)
        .map(|i| (start + i * 7919) % 20000)
        .find(|id| std::net::TcpListener::bind(("0.0.0.0", 15000 + *id as u16)).is_ok())
        .expect("a free port in 15000-34999")
}

/// Two ranks started by hand the way srun starts them (no RANK, WORLD_SIZE, MASTER_*), twice:
/// the second time requeued (SLURM_RESTART_COUNT=1) after the first failed at step 5. Both
/// find the same run dir (named for the job), the requeued one resumes from its step-4
/// checkpoint and trains on as an uninterrupted `--gpus 2` run does.
#[test]
fn srun_shaped_ranks_train_and_a_requeued_job_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let runs = dir.path().join("runs");
    let job = free_slurm_job_id();
    let start = |restart: u32, fault: bool| -> Vec<(bool, String)> {
        let children: Vec<_> = (0..2)
            .map(|rank| {
                let mut c = Command::new(exe());
                c.args(["train", "--no-tui", "--max-steps", "8"])
                    .args(SMALL)
                    .args([
                        "--set",
                        &format!("run.runs_root={:?}", runs.display().to_string()),
                    ])
                    .env("SLURM_PROCID", rank.to_string())
                    .env("SLURM_NTASKS", "2")
                    .env("SLURM_LOCALID", rank.to_string())
                    .env("SLURM_STEP_ID", "0")
                    .env("SLURM_JOB_ID", job.to_string())
                    .env("SLURM_JOB_NODELIST", "localhost")
                    .env("SLURM_RESTART_COUNT", restart.to_string())
                    .env_remove("RANK")
                    .env_remove("WORLD_SIZE")
                    .env_remove("MASTER_ADDR")
                    .env_remove("MASTER_PORT")
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped());
                if fault {
                    c.env("COCKPIT_FAULT_FAIL", "1:5");
                }
                c.spawn().unwrap()
            })
            .collect();
        children
            .into_iter()
            .map(|c| {
                let out = c.wait_with_output().unwrap();
                let text = format!(
                    "{}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                );
                (out.status.success(), text)
            })
            .collect()
    };
    let first = start(0, true);
    assert!(!first[1].0, "rank 1 was to fail: {}", first[1].1);
    assert!(
        first[0].1.contains("launched by srun (SLURM)"),
        "{}",
        first[0].1
    );
    assert!(
        first[0].1.contains("first host of SLURM_JOB_NODELIST"),
        "{}",
        first[0].1
    );
    let run_dir = runs.join(format!("tiny-slurm{job}"));
    assert!(
        run_dir.join("checkpoints/step-00000004").is_dir(),
        "{}",
        first[0].1
    );
    let again = start(1, false);
    for (rank, (ok, out)) in again.iter().enumerate() {
        assert!(ok, "rank {rank}: {out}");
    }
    assert!(
        again[0].1.contains("SLURM_RESTART_COUNT=1"),
        "{}",
        again[0].1
    );
    assert!(
        again[0].1.contains("every rank resumes from"),
        "{}",
        again[0].1
    );
    let resumed: Vec<_> = losses(&run_dir.join("metrics.jsonl"))
        .into_iter()
        .filter(|(s, _)| *s > 4)
        .collect();
    let whole: Vec<_> = gpus_2(&dir.path().join("ref"), 8)
        .into_iter()
        .filter(|(s, _)| *s > 4)
        .collect();
    assert_same_track(&resumed, &whole, "requeued vs uninterrupted, after step 4");
}

/// Launcher variables that contradict each other are refused before any rank waits.
#[test]
fn contradicting_launcher_variables_are_refused_at_once() {
    let run = |envs: &[(&str, &str)]| {
        let mut c = Command::new(exe());
        c.args(["train", "--no-tui", "--max-steps", "1"])
            .args(SMALL);
        for k in ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"] {
            c.env_remove(k);
        }
        c.envs(envs.iter().copied());
        let out = c.output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, err) = run(&[
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_JOB_NODELIST", "gpu[01-"),
    ]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("SLURM_JOB_NODELIST = \"gpu[01-\""), "{err}");
    let (code, err) = run(&[("OMPI_COMM_WORLD_RANK", "1"), ("OMPI_COMM_WORLD_SIZE", "2")]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("MASTER_ADDR is not set"), "{err}");
    let (code, err) = run(&[
        ("OMPI_COMM_WORLD_RANK", "1"),
        ("OMPI_COMM_WORLD_SIZE", "2"),
        ("PMI_RANK", "0"),
        ("PMI_SIZE", "2"),
        ("MASTER_ADDR", "127.0.0.1"),
    ]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("two launchers disagree"), "{err}");
    let (code, err) = run(&[("SLURM_PROCID", "4"), ("SLURM_NTASKS", "4")]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("SLURM_PROCID = 4"), "{err}");
}
