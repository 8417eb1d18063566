//! A long run must not grow: the per-op (candle) path once kept every step's autograd graph
//! alive through the optimizer's moments (~6.5 MB a step on the default model). This trains a
//! small model for 1500 steps in its own process and compares the resident memory the engine
//! records per step (metrics.jsonl `memory_bytes`: RSS on the CPU) after warm-up with the
//! end. It measures memory, not time.

use assert_cmd::Command;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[test]
fn resident_memory_stays_flat_over_a_long_run() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let sets = [
        "model.n_embd=32",
        "model.seq_len=32",
        "optim.micro_batch=8",
        "data.builtin_tokens=200000",
        "eval.every=0",
        "checkpoint.every_steps=0",
        "checkpoint.at_end=false",
        "monitor.enabled=false",
    ];
    let mut cmd = Command::cargo_bin("cockpit").unwrap();
    cmd.args([
        "train",
        "--no-tui",
        "--max-steps",
        "1500",
        "--device",
        "cpu",
    ])
    .arg("--run-dir")
    .arg(&run);
    for s in sets {
        cmd.args(["--set", s]);
    }
    cmd.assert().success();
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let mem: Vec<(u64, f64)> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["event"] == "step")
        .filter_map(|v| Some((v["step"].as_u64()?, v["memory_bytes"].as_f64()?)))
        .collect();
    assert!(
        mem.len() >= 1400,
        "{} steps with a memory figure",
        mem.len()
    );
    let window = |lo: u64, hi: u64| {
        median(
            mem.iter()
                .filter(|(s, _)| (lo..hi).contains(s))
                .map(|&(_, m)| m)
                .collect(),
        )
    };
    let (warm, end) = (window(300, 400), window(1400, 1501));
    let growth = end / warm - 1.0;
    eprintln!(
        "RSS {:.1} MiB after warm-up, {:.1} MiB at the end ({:+.2}%)",
        warm / 1048576.0,
        end / 1048576.0,
        100.0 * growth
    );
    assert!(
        growth < 0.03,
        "resident memory grew {:.1}% from step 300 to 1500 ({:.1} → {:.1} MiB)",
        100.0 * growth,
        warm / 1048576.0,
        end / 1048576.0
    );
}
