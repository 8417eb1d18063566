//! `cockpit sweep` and `cockpit compare` from the command line, on tiny runs.

use assert_cmd::Command;
use std::path::Path;

fn cockpit() -> Command {
    let mut c = Command::cargo_bin("cockpit").unwrap_or_else(|e| panic!("{e}"));
    c.env("NO_COLOR", "1");
    c
}

/// A run of a few steps on a small model, with one evaluation at the end.
const TINY: &[&str] = &[
    "model.n_embd=32",
    "model.seq_len=32",
    "optim.micro_batch=8",
    "data.builtin_tokens=100000",
    "schedule.warmup_steps=0",
    "run.max_steps=10",
    "scu.control_every=2",
    "eval.every=0",
    "eval.batches=2",
    "checkpoint.every_steps=0",
    "monitor.enabled=false",
];

fn sweep(out: &Path, grid: &[&str]) -> std::process::Output {
    let mut c = cockpit();
    c.arg("sweep").arg("--out").arg(out).args(["--seeds", "1"]);
    for s in TINY {
        c.args(["--set", s]);
    }
    for g in grid {
        c.args(["--set-grid", g]);
    }
    c.output().unwrap_or_else(|e| panic!("{e}"))
}

/// `--max-steps` shortens every run, as `train --max-steps` does: the embedded default's
/// warm-up (50 of 600 steps) shortened in proportion, so a 4-step sweep of it just works.
#[test]
fn max_steps_shortens_every_run_and_its_warmup() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let out = dir.path().join("sweep");
    let o = cockpit()
        .arg("sweep")
        .arg("--out")
        .arg(&out)
        .args(["--seeds", "1", "--max-steps", "4"])
        .args(["--set", "model.n_embd=32", "--set", "eval.batches=2"])
        .args(["--set", "monitor.enabled=false"])
        .args(["--set-grid", "optim.lr=0.01,0.003"])
        .output()
        .unwrap_or_else(|e| panic!("{e}"));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    let mut runs = 0;
    for e in std::fs::read_dir(&out).unwrap_or_else(|e| panic!("{e}")) {
        let p = e
            .unwrap_or_else(|e| panic!("{e}"))
            .path()
            .join("training_config.json");
        if let Ok(text) = std::fs::read_to_string(&p) {
            let c: serde_json::Value =
                serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(c["run"]["max_steps"], 4, "{}", p.display());
            assert_eq!(c["schedule"]["warmup_steps"], 0, "{}", p.display());
            runs += 1;
        }
    }
    assert_eq!(runs, 2, "{err}");
}

/// A grid naming an unknown key, a value of the wrong type or out of range, or a malformed
/// entry: exit 2, one line naming the entry, nothing created.
#[test]
fn bad_grids_exit_2_with_one_line_naming_the_entry() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let out = dir.path().join("sweep");
    for (grid, needles) in [
        ("scu.nope=1", &["--set-grid scu.nope=1", "unknown key"][..]),
        (
            "scu.target=abc",
            &["--set-grid scu.target=abc", "expected a number"][..],
        ),
        (
            "scu.target=0.01,2",
            &["--set-grid scu.target=2", "scu.target = 2", "(0, 1)"][..],
        ),
        (
            "scu.enabled=maybe",
            &["scu.enabled", "maybe", "true or false"][..],
        ),
        ("scu.target", &["--set-grid scu.target", "KEY=V1,V2"][..]),
        ("scu.target=0.01,", &["--set-grid scu.target=0.01,"][..]),
    ] {
        let o = sweep(&out, &[grid]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{grid}: {err}");
        assert_eq!(
            err.trim_end().lines().count(),
            1,
            "{grid}: one line:\n{err}"
        );
        assert!(err.starts_with("cockpit: sweep: "), "{grid}: {err}");
        for n in needles {
            assert!(err.contains(n), "{grid}: expected {n:?} in {err}");
        }
        assert!(!out.exists(), "{grid}: a refused sweep creates nothing");
    }
}

/// A sweep runs every arm into its own run dir; the same command again skips the finished
/// runs and reruns only what is missing; compare prints one table row per arm.
#[test]
fn sweep_resumes_and_compare_prints_the_table() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let out = dir.path().join("sweep");
    let grid = ["scu.target=0.01,0.02", "scu.enabled=false"];
    let o = sweep(&out, &grid);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    let names = [
        "target-0.01-s1337",
        "target-0.02-s1337",
        "enabled-false-s1337",
    ];
    for n in names {
        assert!(out.join(n).join("metrics.jsonl").is_file(), "{n}: {err}");
    }
    assert!(out.join("sweep.json").is_file());
    // On the CPU: one run after another, in plan order, none pinned to a GPU.
    assert!(!err.contains("GPU"), "{err}");
    let at = |n: &str| {
        err.find(&format!("{n} finished"))
            .unwrap_or_else(|| panic!("{n} finished: {err}"))
    };
    assert!(
        at(names[0]) < at(names[1]) && at(names[1]) < at(names[2]),
        "{err}"
    );

    // One run lost: the same command runs it and skips the other two.
    std::fs::remove_dir_all(out.join(names[1])).unwrap_or_else(|e| panic!("{e}"));
    let o = sweep(&out, &grid);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert_eq!(err.matches("done before, skipped").count(), 2, "{err}");
    assert!(err.contains(&format!("{} finished", names[1])), "{err}");
    assert!(out.join(names[1]).join("metrics.jsonl").is_file());

    // A different grid into the same dir is refused (it would mix two sweeps).
    let o = sweep(&out, &["scu.target=0.03"]);
    assert_eq!(o.status.code(), Some(2));

    let cmp = dir.path().join("cmp");
    let o = cockpit()
        .arg("compare")
        .arg(&out)
        .arg("--out")
        .arg(&cmp)
        .output()
        .unwrap_or_else(|e| panic!("{e}"));
    let table = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{table}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        table.starts_with("| run | seeds | final val bits/token"),
        "{table}"
    );
    assert_eq!(table.lines().count(), 2 + 3, "header + 3 arms:\n{table}");
    for arm in ["target=0.01", "target=0.02", "enabled=false"] {
        assert!(table.contains(arm), "{arm} in\n{table}");
    }
    assert!(cmp.join("compare.md").is_file() && cmp.join("compare.json").is_file());
}

/// compare on a directory without runs: exit 2 naming it.
#[test]
fn compare_without_runs_exits_2_naming_the_dir() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let o = cockpit()
        .arg("compare")
        .arg(dir.path())
        .output()
        .unwrap_or_else(|e| panic!("{e}"));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains(&dir.path().display().to_string()), "{err}");
    assert!(err.contains("no runs"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
}

/// The grid and seeds from a `[sweep]` table; bad entries there exit 2 naming `sweep.*`.
#[test]
fn sweep_table_in_the_config() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let write = |name: &str, table: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, format!("[run]\nmax_steps = 100\n\n[sweep]\n{table}\n"))
            .unwrap_or_else(|e| panic!("{e}"));
        p
    };
    for (table, needles) in [
        ("seeds = 0", &["sweep.seeds", "[1, 1000]"][..]),
        ("grid = [\"scu.target\"]", &["sweep.grid", "KEY=V1,V2"][..]),
        (
            "grid = \"scu.target=0.1\"",
            &["sweep.grid", "wrong type"][..],
        ),
        (
            "grid = [\"scu.nope=1\"]",
            &["sweep.grid scu.nope=1", "unknown key"][..],
        ),
    ] {
        let cfg = write("bad.toml", table);
        let out = dir.path().join("never");
        let o = cockpit()
            .arg("sweep")
            .arg(&cfg)
            .arg("--out")
            .arg(&out)
            .output()
            .unwrap_or_else(|e| panic!("{e}"));
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{table}: {err}");
        for n in needles {
            assert!(err.contains(n), "{table}: expected {n:?} in {err}");
        }
        assert!(!out.exists(), "{table}");
    }
    // A good table plans its grid × seeds (a run refused by --seeds 0 shows the plan is not
    // run: the flag is checked first).
    let cfg = write(
        "good.toml",
        "grid = [\"scu.target=0.01,0.02\", \"scu.enabled=false\"]\nseeds = 2",
    );
    let o = cockpit()
        .arg("sweep")
        .arg(&cfg)
        .args(["--seeds", "0"])
        .output()
        .unwrap_or_else(|e| panic!("{e}"));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("--seeds 0"), "{err}");
}
