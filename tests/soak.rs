//! Soak: a long run of very small steps must not grow in memory (issue 26: every step of the
//! per-op path kept its activations, ~6.5 MB per step on the default model). Memory, not time,
//! is measured: `cockpit bench --soak` fits the host RSS of the steps after the warm-up and
//! exits 1 when it grows; its own process, so nothing else in the test run adds to it.

use assert_cmd::Command;
use predicates::prelude::*;

/// A model small enough for ~1 ms steps, the same code path as the default (per-op autograd,
/// plain AdamW, SCU on).
const TINY: [&str; 6] = [
    "model.n_layer=1",
    "model.n_embd=16",
    "model.n_head=2",
    "model.seq_len=16",
    "optim.micro_batch=4",
    "data.builtin_tokens=50000",
];

#[test]
fn host_memory_stays_flat_over_a_soak() {
    let mut c = Command::cargo_bin("cockpit").unwrap();
    c.args(["bench", "--soak", "1500", "--warmup", "20"]);
    for s in TINY {
        c.args(["--set", s]);
    }
    // Before the fix this reached ~+240 KB/step (+360 MB over the soak); flat is < 4 MB.
    c.assert().success().stdout(
        predicate::str::contains("soak | host RSS").and(predicate::str::contains("| flat")),
    );
}

#[test]
fn a_soak_too_short_to_judge_is_a_failure_not_a_pass() {
    let mut c = Command::cargo_bin("cockpit").unwrap();
    c.args(["bench", "--soak", "5", "--warmup", "1"]);
    for s in TINY {
        c.args(["--set", s]);
    }
    c.assert()
        .code(1)
        .stderr(predicate::str::contains("too few steps after the warm-up"));
}
