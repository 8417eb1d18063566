//! User data: text files → tokenizer → packed shards with a manifest, cached and memory-mapped.

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

    // The memory-mapped dataset splits off val and trains.
    let ds = data::load(&cfg).unwrap();
    assert_eq!(ds.vocab_size, 256);
    assert!(ds.val.len() * 8 < ds.train.len());
    let mut row = Vec::new();
    ds.train.extend_into(0, 5, &mut row);
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
