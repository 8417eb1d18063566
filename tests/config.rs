//! Config loading: the shipped configs and tests/valid_configs load; defaults are documented.

use cockpit::config::{self, Config};
use std::path::Path;

#[test]
fn embedded_default_equals_the_documented_defaults() {
    let loaded = config::load(None, &[]).unwrap();
    assert_eq!(
        loaded.config,
        Config::default(),
        "configs/tiny.toml and the schema defaults must agree"
    );
}

#[test]
fn every_valid_config_loads() {
    let mut n = 0;
    for entry in std::fs::read_dir("tests/valid_configs").unwrap() {
        let path = entry.unwrap().path();
        config::load(Some(&path), &[]).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        n += 1;
    }
    assert!(n >= 4);
}

#[test]
fn shipped_configs_load() {
    for name in ["tiny.toml", "gpt2-small.toml", "llama-small.toml"] {
        let path = Path::new("configs").join(name);
        config::load(Some(&path), &[]).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    }
}

#[test]
fn lora_example_loads_once_its_base_exists() {
    let path = Path::new("configs/lora-scu.toml");
    let err = config::load(Some(path), &["lora.base=\"/no/such/base\"".into()])
        .unwrap_err()
        .to_string();
    // the value came from --set: the flag is named, not the file
    assert!(
        err.contains("--set lora.base=\"/no/such/base\": lora.base"),
        "{err}"
    );
    let base = tempfile::tempdir().unwrap();
    let set = format!("lora.base={:?}", base.path().display().to_string());
    let c = config::load(Some(path), &[set]).unwrap().config;
    assert!(c.lora.enabled && c.scu.enabled);
    assert_eq!(c.scu.params, config::ScuParams::Lora);
}

#[test]
fn overrides_are_typed_and_validated() {
    let c = config::load(
        None,
        &[
            "optim.lr=0.5".into(),
            "run.name=\"abc\"".into(),
            "run.device=cpu".into(),
        ],
    )
    .unwrap()
    .config;
    assert_eq!(c.optim.lr, 0.5);
    assert_eq!(c.run.name, "abc");
    assert_eq!(c.run.device, "cpu");
    let err = config::load(None, &["optim.micro_batch=-3".into()])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("--set optim.micro_batch=-3") && err.contains("optim.micro_batch"),
        "{err}"
    );
}

#[test]
fn all_semantic_problems_are_reported_at_once() {
    let text = "[model]\nn_embd = 384\nn_head = 7\n[optim]\nlr = 0\n";
    let err = config::from_str(text, "x.toml", Path::new("."), &[])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("x.toml: model.n_head = 7: must divide model.n_embd (384)"),
        "{err}"
    );
    assert!(
        err.contains("x.toml: optim.lr = 0: must be a positive number"),
        "{err}"
    );
}

#[test]
fn a_bad_learning_rate_is_reported_once() {
    // Not again through the keys compared with it (schedule.min_lr, the upper bound).
    for lr in ["nan", "inf", "-1.0"] {
        let err = config::from_str("", "x.toml", Path::new("."), &[format!("optim.lr={lr}")])
            .unwrap_err()
            .to_string();
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(
            err.contains("optim.lr") && err.contains("must be a positive number"),
            "{err}"
        );
    }
}

#[test]
fn llama_arch_sets_the_family_defaults_and_explicit_keys_win() {
    use cockpit::config::{Activation, Norm, PosEncoding};
    let load = |text: &str| {
        config::from_str(text, "t.toml", Path::new("."), &[])
            .unwrap()
            .config
    };
    let c = load("[model]\narch = \"llama\"\n");
    assert_eq!(c.model.norm, Norm::RmsNorm);
    assert_eq!(c.model.pos, PosEncoding::Rope);
    assert_eq!(c.model.activation, Activation::SwiGlu);
    assert!(!c.model.bias && !c.model.tie_embeddings);
    assert!(c.model.arch_notes.is_empty());
    // An explicit key wins, and the header's notes say so.
    let c = load("[model]\narch = \"llama\"\ntie_embeddings = true\nnorm = \"layernorm\"\n");
    assert!(c.model.tie_embeddings);
    assert_eq!(c.model.norm, Norm::LayerNorm);
    assert_eq!(c.model.activation, Activation::SwiGlu);
    assert_eq!(c.model.arch_notes.len(), 2, "{:?}", c.model.arch_notes);
    assert!(c.model.arch_notes[0].contains("norm = layernorm"));
    // --set counts as explicit too.
    let c = config::from_str(
        "[model]\narch = \"llama\"\n",
        "t.toml",
        Path::new("."),
        &["model.bias=true".into()],
    )
    .unwrap()
    .config;
    assert!(c.model.bias);
    // The default arch changes nothing.
    let c = load("[model]\narch = \"gpt\"\n");
    assert_eq!(c.model.norm, Norm::LayerNorm);
    assert!(c.model.bias);
}

/// The 1B and 8B LoRA configs validate as their benchmark lines run them: a random base,
/// built-in data.
#[test]
fn lora_llama_configs_load_for_their_benchmarks() {
    for (file, shape, hd) in [
        ("configs/lora-llama-1b.toml", (16, 2048, 8), 64),
        ("configs/lora-llama-8b.toml", (32, 4096, 8), 128),
    ] {
        let set = [
            "lora.base=\"random\"".to_string(),
            "data.source=\"builtin\"".to_string(),
        ];
        let c = config::load(Some(Path::new(file)), &set)
            .unwrap_or_else(|e| panic!("{file}: {e}"))
            .config;
        assert!(c.lora.enabled && c.scu.enabled, "{file}");
        assert_eq!(c.lora.base, "random");
        assert_eq!(
            (c.model.n_layer, c.model.n_embd, c.model.n_kv_head),
            shape,
            "{file}"
        );
        assert_eq!(c.model.n_embd / c.model.n_head, hd, "{file}");
        assert_eq!(c.lora.targets.len(), 7);
    }
}

/// Sizes and durations past any use are config errors naming the key, not an abort later
/// (a billion-sequence micro-batch, a 1e30-second interval, a queue of a billion batches).
#[test]
fn absurd_sizes_and_durations_are_refused() {
    for (set, key) in [
        ("optim.micro_batch=1000000000", "optim.micro_batch"),
        ("model.n_layer=100000", "model.n_layer"),
        ("model.mlp_ratio=1e9", "model.mlp_ratio"),
        ("data.prefetch_depth=1000000000", "data.prefetch_depth"),
        ("model.vocab_size=100000000", "model.vocab_size"),
        ("run.log_every_secs=1e30", "run.log_every_secs"),
        ("monitor.interval_secs=1e30", "monitor.interval_secs"),
        ("distributed.timeout_secs=1e30", "distributed.timeout_secs"),
    ] {
        let err = config::load(None, &[set.to_string()])
            .unwrap_err()
            .to_string();
        assert!(err.contains(key), "{set}: {err}");
    }
}

/// A 4-bit base is a LoRA base on a GPU: asked for on the CPU or without LoRA, an error
/// naming the key.
#[test]
fn nf4_base_needs_lora_and_cuda() {
    let set = |extra: &[&str]| -> Vec<String> {
        let mut v = vec!["lora.base_dtype=\"nf4\"".to_string()];
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    let err = config::load(None, &set(&[])).unwrap_err().to_string();
    assert!(
        err.contains("lora.base_dtype") && err.contains("lora.enabled"),
        "{err}"
    );
    let err = config::load(
        None,
        &set(&[
            "lora.enabled=true",
            "lora.base=\"random\"",
            "run.device=\"cpu\"",
        ]),
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("lora.base_dtype") && err.contains("CUDA"),
        "{err}"
    );
    let ok = config::load(
        None,
        &set(&[
            "lora.enabled=true",
            "lora.base=\"random\"",
            "run.device=\"auto\"",
        ]),
    );
    assert!(ok.is_ok(), "{:?}", ok.err());
}

/// `optim.micro_batch` is a positive number or "auto" (held as MICRO_BATCH_AUTO until the
/// front end has tried the sizes); 0, negative numbers and other strings name the key.
#[test]
fn micro_batch_is_a_number_or_auto() {
    let auto = config::load(None, &["optim.micro_batch=\"auto\"".to_string()]).unwrap();
    assert_eq!(auto.config.optim.micro_batch, config::MICRO_BATCH_AUTO);
    // It is written back as "auto" (a run's config.json, a checkpoint's state).
    let json = serde_json::to_value(&auto.config).unwrap();
    assert_eq!(json.pointer("/optim/micro_batch").unwrap(), "auto");
    let n = config::load(None, &["optim.micro_batch=12".to_string()]).unwrap();
    assert_eq!(n.config.optim.micro_batch, 12);
    for bad in ["0", "-3", "\"big\""] {
        let err = config::load(None, &[format!("optim.micro_batch={bad}")])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("optim.micro_batch") && err.contains("auto"),
            "{bad}: {err}"
        );
    }
}

/// LoRA dropout is a probability like model.dropout (PEFT's lora_dropout).
#[test]
fn lora_dropout_is_a_probability() {
    let base = ["lora.enabled=true", "lora.base=\"random\""].map(String::from);
    let mut ok = base.to_vec();
    ok.push("lora.dropout=0.1".into());
    assert!(config::load(None, &ok).is_ok());
    let mut bad = base.to_vec();
    bad.push("lora.dropout=1.5".into());
    let err = config::load(None, &bad).unwrap_err().to_string();
    assert!(err.contains("lora.dropout"), "{err}");
}

#[test]
fn eval_samples_need_prompts_and_a_length() {
    let load = |o: &[&str]| {
        let o: Vec<String> = o.iter().map(|s| s.to_string()).collect();
        config::load(None, &o)
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    assert!(load(&[
        "eval.samples_per_prompt=4",
        "eval.sample_tokens=8",
        "eval.sample_prompts=[\"1 2\", \"3\"]",
    ])
    .is_ok());
    for (o, want) in [
        (
            &["eval.samples_per_prompt=4", "eval.sample_tokens=8"][..],
            "eval.sample_prompts",
        ),
        (
            &["eval.samples_per_prompt=4", "eval.sample_prompts=[\"1\"]"][..],
            "eval.sample_tokens",
        ),
        (
            &[
                "eval.samples_per_prompt=5000",
                "eval.sample_tokens=8",
                "eval.sample_prompts=[\"1\"]",
            ][..],
            "5000",
        ),
        (
            &[
                "eval.samples_per_prompt=2",
                "eval.sample_tokens=8",
                "eval.sample_prompts=[\"1\", \" \"]",
            ][..],
            "eval.sample_prompts[1]",
        ),
        // Past the training context (the default's seq_len is 64): refused, not cut short.
        (
            &["eval.sample_tokens=64"][..],
            "eval.sample_tokens = 64: must be below model.seq_len = 64",
        ),
    ] {
        let err = load(o).unwrap_err();
        assert!(err.contains(want), "{o:?}: {err}");
    }
}
