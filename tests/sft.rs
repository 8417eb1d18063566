//! Instruction and chat fine-tuning from the command line: chat records through a template,
//! the loss on the answers, packed rows; Parquet records; bad records named (exit 2).

use assert_cmd::Command;
use std::path::{Path, PathBuf};

fn cockpit() -> Command {
    let mut c = Command::cargo_bin("cockpit").unwrap();
    c.timeout(std::time::Duration::from_secs(300));
    c
}

fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(rel)
}

/// `n` small conversations as JSONL lines (a system turn in every third).
fn conversations(n: usize) -> String {
    (0..n)
        .map(|i| {
            let (a, b) = (i % 17, i % 5 + 1);
            let mut m = Vec::new();
            if i % 3 == 0 {
                m.push(serde_json::json!({"role": "system", "content": "You add numbers."}));
            }
            m.push(serde_json::json!({"role": "user", "content": format!("What is {a} plus {b}?")}));
            m.push(serde_json::json!({"role": "assistant", "content": format!("{a} plus {b} is {}.", a + b)}));
            serde_json::json!({ "messages": m }).to_string() + "\n"
        })
        .collect()
}

fn config(dir: &Path, train: &str, extra: &str) -> PathBuf {
    let cfg = dir.join("c.toml");
    std::fs::write(
        &cfg,
        format!(
            "[data]\nsource = \"files\"\ntrain = {train:?}\nval_fraction = 0.1\n{}\n{extra}\n\
             [model]\nn_embd = 16\nn_layer = 1\nn_head = 2\nseq_len = 512\n[optim]\nmicro_batch = 2\n\
             [schedule]\nwarmup_steps = 0\n[eval]\nevery = 2\nbatches = 2\n[monitor]\nenabled = false\n",
            if extra.contains("chat_template") {
                String::new()
            } else {
                format!("chat_template = {:?}", fixture("chat/qwen.jinja").display().to_string())
            }
        ),
    )
    .unwrap();
    cfg
}

fn events(run: &Path, kind: &str) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|e| e["event"] == kind)
        .collect()
}

/// A chat dataset trains on its answers only: the header says what was found and the share
/// of tokens that train; every step record carries that share; evals score the answers.
#[test]
fn chat_records_train_on_the_answers_in_packed_rows() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("chat.jsonl"), conversations(80)).unwrap();
    let cfg = config(tmp.path(), "chat.jsonl", "");
    let run = tmp.path().join("run");
    let out = cockpit()
        .args(["train", "--no-tui", "--max-steps", "4", "--run-dir"])
        .arg(&run)
        .arg(&cfg)
        .args(["--set", "eval.sample_tokens=4", "--set"])
        .arg("eval.sample_prompt=What is 2 plus 3?")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("messages records (detected from the first record), chat template ")
            && err.contains("qwen.jinja, loss on the answers: ")
            && err.contains("packed best-fit, no sample sees another")
            && err.contains("% of tokens train")
            && !err.contains("split (longer than a row)")
            && err.contains(" answer tokens ("),
        "{err}"
    );
    let steps = events(&run, "step");
    assert_eq!(steps.len(), 4);
    for s in &steps {
        let share = s["trained_share"].as_f64().unwrap();
        assert!(share > 0.05 && share < 0.6, "{s}");
        assert!(s["loss"].as_f64().unwrap().is_finite());
    }
    let evals = events(&run, "eval");
    assert!(!evals.is_empty());
    // The sample prompt is a user turn through the template, with the generation prompt.
    let samples = events(&run, "sample");
    assert!(
        samples[0]["prompt"]
            .as_str()
            .unwrap()
            .ends_with("<|im_start|>user\nWhat is 2 plus 3?<|im_end|>\n<|im_start|>assistant\n"),
        "{}",
        samples[0]
    );
    assert!(evals[0]["val_loss"].as_f64().unwrap().is_finite());
}

/// Packed chat rows through a Granite-4.0-H-like hybrid (Mamba-2 layers beside NoPE attention):
/// they train, each sample's conv window and scan state starting again at its first token
/// (the model's own test holds packed rows equal to the samples run one by one).
#[test]
fn a_hybrid_trains_on_packed_chat_rows() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("chat.jsonl"), conversations(80)).unwrap();
    let cfg = config(tmp.path(), "chat.jsonl", "");
    let run = tmp.path().join("run");
    let mut c = cockpit();
    c.args(["train", "--no-tui", "--max-steps", "3", "--run-dir"])
        .arg(&run)
        .arg(&cfg);
    for set in [
        "model.norm=\"rmsnorm\"",
        "model.activation=\"swiglu\"",
        "model.bias=false",
        "model.n_layer=3",
        "model.n_embd=32",
        "model.hybrid.layers=[\"mamba\",\"attention\",\"mamba\"]",
        "model.hybrid.mamba_n_heads=4",
        "model.hybrid.mamba_d_head=8",
        "model.hybrid.mamba_d_state=8",
        "model.hybrid.mamba_chunk_size=64",
    ] {
        c.args(["--set", set]);
    }
    let out = c.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("hybrid 2 mamba/3 layers") && err.contains("packed best-fit"),
        "{err}"
    );
    let steps = events(&run, "step");
    assert_eq!(steps.len(), 3);
    assert!(steps
        .iter()
        .all(|s| s["loss"].as_f64().unwrap().is_finite()));
}

/// A JSON array, unpacked (`data.packing = false`: one sample a row, padded), and every
/// token trained (`data.train_on_prompt`).
#[test]
fn json_arrays_padded_rows_and_train_on_prompt() {
    let tmp = tempfile::tempdir().unwrap();
    let records: Vec<serde_json::Value> = conversations(40)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    std::fs::write(
        tmp.path().join("chat.json"),
        serde_json::to_string(&records).unwrap(),
    )
    .unwrap();
    let cfg = config(
        tmp.path(),
        "chat.json",
        "packing = false\ntrain_on_prompt = true",
    );
    let run = tmp.path().join("run");
    let out = cockpit()
        .args(["train", "--no-tui", "--max-steps", "2", "--run-dir"])
        .arg(&run)
        .arg(&cfg)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("loss on every token") && err.contains("one sample a row, padded"),
        "{err}"
    );
    assert!(err.contains("100.0% of tokens train"), "{err}");
}

/// Parquet files as Hugging Face datasets writes them (pyarrow: snappy and zstd pages; made
/// by scripts/sft_fixtures.py): alpaca and prompt/completion records are found and checked.
#[test]
fn parquet_records_are_read() {
    for (file, what) in [
        ("sft/alpaca.parquet", "alpaca records"),
        ("sft/prompt_completion.parquet", "prompt_completion records"),
        ("sft/messages.parquet", "messages records"),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let cfg = config(tmp.path(), &fixture(file).display().to_string(), "");
        let out = cockpit().arg("prepare").arg(&cfg).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{file}: {err}");
        assert!(err.contains(&format!("checked: {what} (detected")), "{err}");
    }
}

/// A bad record, template or sample: one line naming the file, the line and the field;
/// exit 2; nothing written to the run dir.
#[test]
fn bad_records_are_named_and_nothing_is_written() {
    let tmp = tempfile::tempdir().unwrap();
    let case = |name: &str, body: &str, extra: &str| -> String {
        let dir = tmp.path().join(name);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("d.jsonl"), body).unwrap();
        let cfg = config(&dir, &dir.join("d.jsonl").display().to_string(), extra);
        let run = dir.join("run");
        let out = cockpit()
            .args(["train", "--no-tui", "--max-steps", "2", "--run-dir"])
            .arg(&run)
            .arg(&cfg)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert_eq!(out.status.code(), Some(2), "{name}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{name}: one line: {err}");
        assert!(
            !run.join("metrics.jsonl").exists(),
            "{name}: nothing written"
        );
        err
    };
    let good = conversations(3);
    let err = case(
        "role",
        &(good.clone() + "{\"messages\": [{\"role\": \"bot\", \"content\": \"hi\"}]}\n"),
        "",
    );
    assert!(
        err.contains("d.jsonl:4: field \"messages[0].role\": unknown role \"bot\""),
        "{err}"
    );
    let err = case(
        "missing",
        &(good.clone() + "{\"messages\": [{\"role\": \"user\"}]}\n"),
        "",
    );
    assert!(
        err.contains("d.jsonl:4: field \"messages[0].content\": missing"),
        "{err}"
    );
    let err = case(
        "empty",
        &(good.clone()
            + "{\"messages\": [{\"role\": \"user\", \"content\": \"q\"}, {\"role\": \"assistant\", \"content\": \"\"}]}\n"),
        "",
    );
    assert!(
        err.contains("d.jsonl:4: field \"messages[1].content\": an empty assistant turn"),
        "{err}"
    );
    let err = case(
        "alpaca",
        "{\"instruction\": \"a\", \"output\": \"b\"}\n{\"instruction\": \"a\"}\n",
        "",
    );
    assert!(
        err.contains("d.jsonl:2: field \"output\": missing"),
        "{err}"
    );
    // Gemma's template refuses turns that do not alternate.
    let gemma = fixture("chat/gemma.jinja").display().to_string();
    let err = case(
        "render",
        "{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}, {\"role\": \"user\", \"content\": \"b\"}, {\"role\": \"assistant\", \"content\": \"c\"}]}\n",
        &format!("chat_template = {gemma:?}"),
    );
    assert!(
        err.contains("d.jsonl:1: field \"messages\": the chat template")
            && err.contains("Conversation roles must alternate"),
        "{err}"
    );
    let err = case("template-file", &good, "chat_template = \"nope.jinja\"");
    assert!(
        err.contains("data.chat_template = \"") && err.contains("nope.jinja\": "),
        "{err}"
    );
    let err = case("template-syntax", &good, "chat_template = \"{% if %}\"");
    assert!(err.contains("the chat template does not parse"), "{err}");
    let long = format!(
        "{{\"prompt\": \"q\", \"completion\": \"{}\"}}\n",
        "x".repeat(600)
    );
    let err = case(
        "long",
        &(long + "{\"prompt\": \"q\", \"completion\": \"y\"}\n"),
        "long_samples = \"error\"",
    );
    assert!(
        err.contains("d.jsonl:1: a sample of 601 tokens is longer than model.seq_len + 1 = 513"),
        "{err}"
    );
}

/// A chat dataset on a tokenizer without a chat template (and none given) is refused.
#[test]
fn a_chat_dataset_needs_a_template() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("chat.jsonl"), conversations(10)).unwrap();
    let cfg = config(tmp.path(), "chat.jsonl", "");
    let text = std::fs::read_to_string(&cfg)
        .unwrap()
        .lines()
        .filter(|l| !l.starts_with("chat_template"))
        .collect::<Vec<_>>()
        .join("\n");
    std::fs::write(&cfg, text).unwrap();
    let out = cockpit().arg("prepare").arg(&cfg).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("chat.jsonl:1: a messages dataset needs a chat template"),
        "{err}"
    );
}

/// The samples are cached beside the data: a second run reads them back (the header says
/// so) and trains the same losses; a changed file is tokenized again.
#[test]
fn a_second_run_reads_the_token_cache_and_trains_the_same() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("chat.jsonl");
    std::fs::write(&data, conversations(60)).unwrap();
    let cfg = config(tmp.path(), "chat.jsonl", "");
    let run = |name: &str| {
        let dir = tmp.path().join(name);
        let out = cockpit()
            .args(["train", "--no-tui", "--max-steps", "3", "--run-dir"])
            .arg(&dir)
            .arg(&cfg)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{err}");
        let losses: Vec<f64> = events(&dir, "step")
            .iter()
            .map(|s| s["loss"].as_f64().unwrap())
            .collect();
        (err, losses)
    };
    let (first, a) = run("a");
    assert!(!first.contains("read from the token cache"), "{first}");
    let cached: Vec<_> = std::fs::read_dir(tmp.path().join(".cockpit-cache"))
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("sft-"))
        .collect();
    assert_eq!(cached.len(), 1);
    let (second, b) = run("b");
    assert!(
        second.contains(
            "messages records (detected from the first record, read from the token cache)"
        ),
        "{second}"
    );
    assert_eq!(a.len(), 3);
    assert_eq!(a, b);
    // Another record: another key, tokenized again.
    std::fs::write(&data, conversations(61)).unwrap();
    let (third, _) = run("c");
    assert!(!third.contains("read from the token cache"), "{third}");
}
