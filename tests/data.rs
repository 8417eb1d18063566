//! User data: text files → tokenizer → packed shards with a manifest, cached, and checked at open.

use assert_cmd::Command;
use cockpit::config;
use cockpit::engine::data;

fn corpus(dir: &std::path::Path) {
    std::fs::create_dir_all(dir.join("sub")).unwrap();
    let text = "the quick brown fox jumps over the lazy dog. ".repeat(400);
    std::fs::write(dir.join("a.txt"), &text).unwrap();
    std::fs::write(dir.join("sub/b.txt"), text.to_uppercase()).unwrap();
}

#[test]
fn text_files_are_packed_cached_and_trainable() {
    let tmp = tempfile::tempdir().unwrap();
    let data_dir = tmp.path().join("text");
    corpus(&data_dir);
    let cfg_path = tmp.path().join("files.toml");
    std::fs::write(
        &cfg_path,
        "[data]\nsource = \"files\"\ntrain = \"text\"\nval_fraction = 0.1\n[model]\nn_embd = 32\nseq_len = 32\n[optim]\nmicro_batch = 4\n[schedule]\nwarmup_steps = 0\n",
    )
    .unwrap();
    let cfg = config::load(Some(&cfg_path), &[]).unwrap().config;

    let first = data::prepare(&cfg).unwrap();
    assert!(!first.cached);
    assert_eq!(
        first.manifest.sources.len(),
        2,
        "the directory is walked recursively"
    );
    assert_eq!(first.manifest.vocab_size, 256, "byte-level by default");
    assert_eq!(
        first.manifest.width, 2,
        "u16 shards when the vocabulary fits"
    );
    let bytes: u64 = first.manifest.sources.iter().map(|s| s.bytes).sum();
    assert_eq!(first.manifest.train_tokens, bytes, "one token per byte");
    assert!(first.dir.join("train.bin").is_file() && first.dir.join("manifest.json").is_file());
    assert!(first.dir.starts_with(&data_dir), "cached beside the data");

    // Unchanged sources: the cache is reused. A changed source: re-packed under a new key.
    assert!(data::prepare(&cfg).unwrap().cached);
    std::fs::write(
        data_dir.join("a.txt"),
        "something else entirely. ".repeat(300),
    )
    .unwrap();
    let again = data::prepare(&cfg).unwrap();
    assert!(!again.cached);
    assert_ne!(again.dir, first.dir);

    // The cached dataset splits off val and trains.
    let ds = data::load(&cfg).unwrap();
    assert_eq!(ds.vocab_size, 256);
    assert!(ds.val.len() * 8 < ds.train.len());
    let mut row = Vec::new();
    ds.train.extend_into(0, 5, &mut row).unwrap();
    assert_eq!(row, b"somet".iter().map(|&b| b as u32).collect::<Vec<_>>());

    let out = Command::cargo_bin("cockpit")
        .unwrap()
        .args(["prepare"])
        .arg(&cfg_path)
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("already prepared"));
    let run = tmp.path().join("run");
    let out = Command::cargo_bin("cockpit")
        .unwrap()
        .args(["train", "--no-tui", "--max-steps", "5", "--run-dir"])
        .arg(&run)
        .arg(&cfg_path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("step 5/5"));
}

fn cockpit() -> Command {
    let mut c = Command::cargo_bin("cockpit").unwrap();
    c.timeout(std::time::Duration::from_secs(300));
    c
}

/// JSONL records are documents; each ends with the separator; empty files are skipped with a
/// warning naming them; prepare reports progress; a trained run's evals carry a standard error
/// and the run header says how many val tokens an eval covers.
#[test]
fn jsonl_documents_separators_warnings_and_eval_standard_error() {
    let tmp = tempfile::tempdir().unwrap();
    let text = tmp.path().join("text");
    std::fs::create_dir_all(&text).unwrap();
    let mut jsonl = String::new();
    for i in 0..200 {
        jsonl.push_str(&format!(
            "{{\"text\": \"record {i}: the quick brown fox jumps over the lazy dog\", \"id\": {i}}}\n"
        ));
    }
    jsonl.push('\n');
    std::fs::write(text.join("a.jsonl"), &jsonl).unwrap();
    std::fs::write(text.join("b.txt"), "plain text file. ".repeat(300)).unwrap();
    std::fs::write(text.join("empty.txt"), "").unwrap();
    std::fs::write(text.join("blank.txt"), " \n\t\n").unwrap();
    let cfg_path = tmp.path().join("c.toml");
    std::fs::write(
        &cfg_path,
        "[data]\nsource = \"files\"\ntrain = \"text\"\nval_fraction = 0.2\ndoc_separator = \"|\"\n\
         [model]\nn_embd = 16\nn_layer = 1\nn_head = 2\nseq_len = 32\n[optim]\nmicro_batch = 4\n\
         [schedule]\nwarmup_steps = 0\n[eval]\nevery = 2\nbatches = 3\n[monitor]\nenabled = false\n",
    )
    .unwrap();
    let cfg = config::load(Some(&cfg_path), &[]).unwrap().config;
    let p = data::prepare(&cfg).unwrap();
    assert_eq!(p.manifest.documents, 201, "200 records and one text file");
    assert_eq!(p.manifest.separator, vec![b'|' as u32]);
    let w = p.manifest.warnings.join("\n");
    assert!(w.contains("empty.txt: empty file"), "{w}");
    assert!(w.contains("blank.txt: only whitespace"), "{w}");
    let ds = data::load(&cfg).unwrap();
    let mut all = Vec::new();
    ds.train.extend_into(0, ds.train.len(), &mut all).unwrap();
    let s: String = all.iter().map(|&t| t as u8 as char).collect();
    assert!(
        s.starts_with("record 0: the quick brown fox jumps over the lazy dog|record 1:"),
        "{}",
        &s[..80]
    );
    assert_eq!(
        ds.warnings, p.manifest.warnings,
        "warnings survive the cache"
    );

    // Progress without a terminal: a line per 10%.
    std::fs::remove_dir_all(text.join(".cockpit-cache")).unwrap();
    let out = cockpit().arg("prepare").arg(&cfg_path).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("prepare: 100.0%") && err.contains("MB/s"),
        "{err}"
    );
    assert!(
        err.contains("warning: ") && err.contains("empty.txt"),
        "{err}"
    );

    let run = tmp.path().join("run");
    let out = cockpit()
        .args(["train", "--no-tui", "--max-steps", "4", "--run-dir"])
        .arg(&run)
        .arg(&cfg_path)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("random windows, eval 12 windows × 32 = 384 of"),
        "the header says what an eval covers: {err}"
    );
    assert!(err.contains("empty.txt: empty file"), "{err}");
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let evals: Vec<serde_json::Value> = metrics
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|e| e["event"] == "eval")
        .collect();
    assert_eq!(evals.len(), 2);
    for e in &evals {
        let se = e["val_bpt_se"].as_f64().unwrap();
        assert!(se > 0.0 && se < 1.0, "{e}");
        assert_eq!(e["val_tokens"], 384);
    }
    assert!(
        err.contains(" ± "),
        "the headless eval line shows ± se: {err}"
    );
}

/// Bad input fails with a clear error naming the file (exit 2), never an empty eval.
#[test]
fn bad_input_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let case = |name: &str, files: &[(&str, &str)], extra: &str| -> String {
        let dir = tmp.path().join(name);
        std::fs::create_dir_all(dir.join("t")).unwrap();
        for (f, body) in files {
            std::fs::write(dir.join(f), body).unwrap();
        }
        let cfg = dir.join("c.toml");
        std::fs::write(
            &cfg,
            format!("[data]\nsource = \"files\"\ntrain = \"t\"\n{extra}\n[model]\nn_embd = 16\nn_layer = 1\nn_head = 2\nseq_len = 64\n[monitor]\nenabled = false\n"),
        )
        .unwrap();
        let out = cockpit()
            .args(["train", "--no-tui", "--max-steps", "2", "--run-dir"])
            .arg(dir.join("run"))
            .arg(&cfg)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{name}");
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
        err
    };
    let err = case(
        "jsonl",
        &[(
            "t/a.jsonl",
            "{\"text\": \"fine\"}\n{\"body\": \"no text\"}\n",
        )],
        "",
    );
    assert!(err.contains("a.jsonl:2: no \"text\" field"), "{err}");
    let err = case("blank", &[("t/a.txt", "  \n\n"), ("t/b.txt", "")], "");
    assert!(
        err.contains("data.train = \"") && err.contains("blank/t\": no text to tokenize"),
        "{err}"
    );
    let long = "some training text. ".repeat(100);
    let err = case(
        "val",
        &[("t/a.txt", &long), ("v.txt", "too short")],
        "val = \"v.txt\"",
    );
    assert!(
        err.contains("v.txt\": 9 tokens is smaller than one window"),
        "{err}"
    );
    let err = case("sep", &[("t/a.txt", &long)], "doc_separator = \"eos\"");
    assert!(
        err.contains("data.doc_separator = \"eos\"") && err.contains("no EOS"),
        "{err}"
    );
}

/// The cache's manifest is untrusted input: a hand-edited width or vocabulary is not used
/// (no division by zero, no giant allocation): the sources are here, so the cache is rebuilt
/// and the rebuild is said.
#[test]
fn a_tampered_cache_manifest_is_rebuilt() {
    let tmp = tempfile::tempdir().unwrap();
    corpus(&tmp.path().join("text"));
    let cfg_path = tmp.path().join("files.toml");
    std::fs::write(
        &cfg_path,
        "[data]\nsource = \"files\"\ntrain = \"text\"\nval_fraction = 0.1\n[model]\nn_embd = 32\nseq_len = 32\n",
    )
    .unwrap();
    let cfg = config::load(Some(&cfg_path), &[]).unwrap().config;
    let p = data::prepare(&cfg).unwrap();
    let path = p.dir.join("manifest.json");
    let text = std::fs::read_to_string(&path).unwrap();
    for (key, value) in [
        ("width", 0u64),
        ("vocab_size", 100_000_000),
        ("vocab_size", 7),
    ] {
        let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
        v[key] = serde_json::json!(value);
        std::fs::write(&path, serde_json::to_string(&v).unwrap()).unwrap();
        let ds = data::load(&cfg).unwrap();
        assert_eq!(ds.vocab_size, 256, "{key} = {value}");
        assert!(
            ds.warnings
                .iter()
                .any(|w| w.contains("token cache rebuilt") && w.contains("manifest.json")),
            "{key} = {value}: {:?}",
            ds.warnings
        );
        assert!(
            data::prepare(&cfg).unwrap().cached,
            "the rebuilt cache is used"
        );
    }
}
