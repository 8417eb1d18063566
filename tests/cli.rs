//! The command line as a user meets it: exit codes, messages, config errors, a short real run.

use assert_cmd::Command;
use predicates::prelude::*;
use std::path::Path;

fn cockpit() -> Command {
    let mut c = Command::cargo_bin("cockpit").unwrap();
    c.env("NO_COLOR", "1");
    c
}

#[test]
fn help_has_examples_and_exits_0() {
    cockpit().arg("--help").assert().success().stdout(
        predicate::str::contains("Examples:").and(predicate::str::contains("--monitor-only")),
    );
    cockpit()
        .args(["train", "--help"])
        .assert()
        .success()
        .stdout(predicate::str::contains("--test-run"));
}

#[test]
fn no_command_and_unknown_flags_are_usage_errors() {
    cockpit().assert().code(2);
    cockpit().args(["train", "--no-such-flag"]).assert().code(2);
    cockpit().args(["frobnicate"]).assert().code(2);
}

/// Each invalid config exits 2 and names the offending key.
#[test]
fn invalid_configs_exit_2_naming_the_key() {
    let expect = [
        ("unknown_key.toml", "model.n_hed"),
        ("unknown_section.toml", "modle"),
        ("wrong_type.toml", "model.n_head"),
        ("negative_lr.toml", "optim.lr"),
        (
            "n_head_divides.toml",
            "model.n_head = 7: must divide model.n_embd (384)",
        ),
        ("missing_data_path.toml", "data.train"),
        ("warmup_exceeds_steps.toml", "schedule.warmup_steps"),
        ("scu_with_weight_decay.toml", "optim.weight_decay"),
        ("bad_enum.toml", "model.norm"),
        ("scu_target_range.toml", "scu.target"),
        ("bad_device.toml", "run.device"),
        ("seq_len_too_small.toml", "model.seq_len"),
        ("lora_missing_base.toml", "lora.base"),
        ("lora_bad_target.toml", "lora.targets"),
        ("syntax_error.toml", "line 1"),
        ("missing_tokenizer.toml", "data.tokenizer"),
        ("kv_heads_divide.toml", "model.n_kv_head"),
        ("bad_backend.toml", "distributed.backend = \"gloo\""),
        (
            "bad_reduce_dtype.toml",
            "distributed.reduce_dtype = \"fp8\"",
        ),
        (
            "layout_layer_types.toml",
            "model.layout.layer_types = 3 entries: one per layer (model.n_layer = 2)",
        ),
        (
            "layout_bad_layer_type.toml",
            "model.layout.layer_types[1] = \"chunked\": unknown value; allowed: full or sliding",
        ),
        (
            "hybrid_bad_layer_kind.toml",
            "model.hybrid.layers[1] = \"sliding\": unknown value",
        ),
        ("hybrid_layers_count.toml", "model.hybrid.layers"),
        (
            "hybrid_mamba_groups.toml",
            "model.hybrid.mamba_n_groups = 3",
        ),
        ("hybrid_lora_gate.toml", "lora.targets = \"gate\""),
        (
            "eval_samples_without_prompts.toml",
            "eval.sample_prompts = []: give at least one prompt",
        ),
    ];
    let dir = Path::new("tests/invalid_configs");
    let files = std::fs::read_dir(dir).unwrap().count();
    assert_eq!(
        files,
        expect.len(),
        "every file in tests/invalid_configs has an expectation here"
    );
    for (file, key) in expect {
        let out = cockpit()
            .args(["train", "--no-tui"])
            .arg(dir.join(file))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{file}: {err}");
        assert!(err.contains(key), "{file}: expected {key:?} in:\n{err}");
        assert!(
            err.contains(file),
            "{file}: the message names the file:\n{err}"
        );
        assert!(!err.contains("panicked"), "{file}: {err}");
    }
}

#[test]
fn bad_set_overrides_exit_2_naming_the_argument() {
    for (arg, needle) in [
        ("optim.lr", "--set optim.lr"),
        ("lr=0.1", "--set lr=0.1"),
        ("optim.lr=fast", "optim.lr"),
        ("model.n_layers=3", "model.n_layers"),
        ("model.n_head=7", "model.n_head"),
    ] {
        let out = cockpit()
            .args(["train", "--no-tui", "--set", arg])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{arg}: {err}");
        assert!(
            err.contains(needle),
            "{arg}: expected {needle:?} in:\n{err}"
        );
    }
}

/// A bad value given by a command's own flag is blamed on that flag, as typed — not on a
/// `--set` the user never wrote, nor on the config file.
#[test]
fn bad_flag_values_exit_2_naming_the_flag() {
    for (args, needle) in [
        (
            &["train", "--no-tui", "--device", "foo"][..],
            "--device foo: run.device = \"foo\": allowed",
        ),
        (
            &["train", "--no-tui", "--theme", "neon"][..],
            "--theme neon: run.theme = \"neon\": unknown theme",
        ),
        (
            &["train", "--no-tui", "--max-steps", "0"][..],
            "--max-steps 0: run.max_steps = 0: must be at least 1",
        ),
        (
            &["bench", "--device", "cuda:x"][..],
            "--device cuda:x: run.device",
        ),
        (
            &[
                "sweep",
                "--device",
                "tpu",
                "--set-grid",
                "optim.lr=1e-3,2e-3",
            ][..],
            "--device tpu: run.device",
        ),
    ] {
        let out = cockpit().args(args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(
            err.contains(needle),
            "{args:?}: expected {needle:?} in:\n{err}"
        );
        assert!(!err.contains("--set"), "{args:?}: {err}");
    }
    // Set in the file, it is the file's.
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("themed.toml");
    std::fs::write(&cfg, "[run]\ntheme = \"neon\"\n").unwrap();
    let out = cockpit()
        .args(["train", "--no-tui"])
        .arg(&cfg)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("themed.toml: run.theme = \"neon\": unknown theme"),
        "{err}"
    );
}

/// `optim.micro_batch = "auto"` searches a GPU's memory; on the CPU it is a usage error
/// that names the key, before any run dir exists.
#[test]
fn auto_micro_batch_on_the_cpu_exits_2_writing_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let out = cockpit()
        .args(["train", "--no-tui", "--device", "cpu"])
        .args(["--set", "optim.micro_batch=\"auto\""])
        .arg("--run-dir")
        .arg(&run_dir)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("optim.micro_batch") && err.contains("CPU"),
        "{err}"
    );
    assert!(!run_dir.exists());
}

#[test]
fn check_reports_the_machine_and_exits_0() {
    cockpit().arg("check").assert().success().stdout(
        predicate::str::contains("cores")
            .and(predicate::str::contains("NVML"))
            .and(predicate::str::contains("dtype")),
    );
}

#[test]
fn test_run_passes_every_stage() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    cockpit()
        .args(["train", "--test-run", "--run-dir"])
        .arg(&run)
        .assert()
        .success()
        .stderr(predicate::str::contains("test run ok"));
    assert!(run.join("checkpoints/latest").is_file());
    assert!(run.join("scu_metrics.json").is_file());
}

#[test]
fn headless_run_of_20_steps_writes_metrics_and_config() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let out = cockpit()
        .args(["train", "--no-tui", "--max-steps", "20", "--run-dir"])
        .arg(&run)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("step 20/20"), "{err}");
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let events: Vec<cockpit::engine::Event> = metrics
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let steps = events
        .iter()
        .filter(|e| matches!(e, cockpit::engine::Event::Step(_)))
        .count();
    assert_eq!(steps, 20);
    assert!(matches!(
        events.first(),
        Some(cockpit::engine::Event::RunStarted(_))
    ));
    assert!(matches!(
        events.last(),
        Some(cockpit::engine::Event::Finished { .. })
    ));
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("training_config.json")).unwrap())
            .unwrap();
    assert_eq!(cfg["run"]["max_steps"], 20);
}

#[test]
fn resume_of_nothing_is_a_usage_error() {
    let dir = tempfile::tempdir().unwrap();
    cockpit()
        .current_dir(dir.path())
        .args(["train", "--no-tui", "--resume"])
        .assert()
        .code(2)
        .stderr(predicate::str::contains("--resume"));
}

/// A torchrun-style environment is read: bad values are named, and WORLD_SIZE > 1 is
/// refused plainly (one process per job in this version) instead of N ranks training alone.
#[test]
fn distributed_environment_is_checked() {
    cockpit()
        .args(["train", "--no-tui", "--max-steps", "1"])
        .env("WORLD_SIZE", "2")
        .env("RANK", "5")
        .assert()
        .code(2)
        .stderr(predicate::str::contains("RANK = 5"));
    cockpit()
        .args(["train", "--no-tui", "--max-steps", "1"])
        .args(["--set", "distributed.backend=\"nccl\""])
        .env("WORLD_SIZE", "2")
        .env("RANK", "1")
        .assert()
        .code(2)
        .stderr(predicate::str::contains("this build has no NCCL").or(
            // a build with NCCL on a machine without GPUs
            predicate::str::contains("cuda"),
        ));
    // A rank whose rank 0 never comes: a clear error after distributed.timeout_secs.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    cockpit()
        .args(["train", "--no-tui", "--max-steps", "1", "--device", "cpu"])
        .args(["--set", "distributed.backend=\"tcp\""])
        .args(["--set", "distributed.timeout_secs=1"])
        .env("WORLD_SIZE", "2")
        .env("RANK", "1")
        .env("MASTER_PORT", port.to_string())
        .assert()
        .code(1)
        .stderr(predicate::str::contains("could not reach rank 0"));
}

/// A world that cannot run here is refused before any worker starts (issue 26: 70000 forked
/// 32,444 rank processes): exit 2 naming the key, the value and what is available.
#[test]
fn an_impossible_world_size_is_refused_before_forking() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let out = cockpit()
        .args(["train", "--no-tui", "--max-steps", "1", "--run-dir"])
        .arg(&run_dir)
        .args(["--set", "distributed.gpus=70000"])
        .env("CUDA_VISIBLE_DEVICES", "")
        .assert()
        .code(2)
        .get_output()
        .clone();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("distributed.gpus = 70000"), "{err}");
    assert!(
        err.contains("this build has no NCCL") || err.contains("can see 0 GPUs"),
        "{err}"
    );
    assert!(!run_dir.join("ranks").exists(), "no rank was started");
    cockpit()
        .args(["train", "--no-tui", "--max-steps", "1", "--gpus", "60000"])
        .args(["--set", "distributed.backend=\"tcp\""])
        .arg("--run-dir")
        .arg(&run_dir)
        .assert()
        .code(2)
        .stderr(
            predicate::str::contains("--gpus 60000")
                .and(predicate::str::contains("CPU cores"))
                .and(predicate::str::contains("at most")),
        );
    assert!(!run_dir.join("ranks").exists(), "no rank was started");
}

/// `cockpit bench` times real steps and writes the figures the reference script writes.
#[test]
fn bench_reports_timed_steps_as_text_and_json() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("bench.json");
    cockpit()
        .args(["bench", "--steps", "4", "--warmup", "1", "--device", "cpu"])
        .args([
            "--set",
            "model.n_embd=32",
            "--set",
            "data.builtin_tokens=100000",
        ])
        .arg("--json")
        .arg(&json)
        .assert()
        .success()
        .stdout(predicate::str::contains("ms/step").and(predicate::str::contains("tok/s")));
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v["steps"], 4);
    assert_eq!(v["warmup"], 1);
    assert!(v["tokens_per_sec"].as_f64().unwrap() > 0.0);
    assert!(v["ms_per_step_median"].as_f64().unwrap() > 0.0);
    cockpit()
        .args(["bench", "--set", "model.n_head=0"])
        .assert()
        .code(2)
        .stderr(predicate::str::contains("model.n_head"));
    // A model that cannot fit is refused before anything is allocated, naming its keys.
    let runs = tempfile::tempdir().unwrap();
    cockpit()
        .args([
            "train",
            "--no-tui",
            "--device",
            "cpu",
            "--max-steps",
            "1",
            "--run-dir",
        ])
        .arg(runs.path().join("big"))
        .args([
            "--set",
            "model.vocab_size=16000000",
            "--set",
            "optim.micro_batch=512",
        ])
        .args(["--set", "schedule.warmup_steps=0"])
        .assert()
        .code(2)
        .stderr(predicate::str::contains("model.vocab_size = 16000000"));
    // The batch search is about device memory: on the CPU it says so (exit 2).
    cockpit()
        .args(["bench", "--find-batch", "--device", "cpu"])
        .assert()
        .code(2)
        .stderr(predicate::str::contains("needs a CUDA device"));
}

/// `eval.samples_per_prompt` on the built-in corpus (no tokenizer): prompts are token ids;
/// text is a usage error naming the entry; ids give a `sample_diversity` record per eval.
#[test]
fn eval_samples_on_the_builtin_corpus_take_token_ids() {
    let dir = tempfile::tempdir().unwrap();
    let base = [
        "run.max_steps=2",
        "schedule.warmup_steps=0",
        "eval.every=1",
        "eval.batches=1",
        "eval.sample_tokens=6",
        "eval.samples_per_prompt=3",
        "checkpoint.every_steps=0",
        "checkpoint.at_end=false",
    ];
    let train = |run: &str, prompts: &str| {
        let mut c = cockpit();
        c.args(["train", "--no-tui", "--device", "cpu", "--run-dir"])
            .arg(dir.path().join(run));
        for s in base {
            c.args(["--set", s]);
        }
        c.args(["--set", &format!("eval.sample_prompts={prompts}")]);
        c.output().unwrap()
    };
    let out = train("text", "[\"hello\"]");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("eval.sample_prompts[0] = \"hello\": the built-in corpus has no tokenizer"),
        "{err}"
    );
    let out = train("ids", "[\"1 2 3\", \"4,5\"]");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let metrics = std::fs::read_to_string(dir.path().join("ids/metrics.jsonl")).unwrap();
    let found: Vec<serde_json::Value> = metrics
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["event"] == "sample_diversity")
        .collect();
    assert_eq!(found.len(), 2, "one per eval: {metrics}");
    assert_eq!(found[0]["prompts"], 2);
    assert_eq!(found[0]["new_tokens"], 2 * 3 * 6);
    assert!(
        found[0]["cosine_distance"].as_f64().is_some(),
        "{}",
        found[0]
    );
}
