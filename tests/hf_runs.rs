//! Hugging Face models through the whole tool: full fine-tuning from one (`model.init_from`)
//! with its tokenizer, LoRA on every family, export → re-import, and the command line
//! (`train`, `export`, `generate`) on bad and good input.

mod common;
use assert_cmd::Command;
use candle_core::{DType, Device, Tensor, D};
use cockpit::config::{self, Config, ModelConfig};
use cockpit::engine::events::Event;
use cockpit::engine::export::{self, ExportOptions};
use cockpit::engine::model::Model;
use cockpit::engine::source;
use cockpit::engine::{Engine, EngineOptions};
use cockpit::util::DeviceSpec;
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(name)
}

fn expected(name: &str) -> (Vec<u32>, f64, Vec<u32>, Vec<u32>) {
    let v: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture(name).join("expected.json")).unwrap(),
    )
    .unwrap();
    let ids = |k: &str| -> Vec<u32> {
        v[k].as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    (
        ids("ids"),
        v["loss"].as_f64().unwrap(),
        ids("prompt_ids"),
        ids("greedy"),
    )
}

/// Mean next-token loss of `ids` under a model.
fn loss(model: &mut Model, ids: &[u32]) -> f64 {
    let n = ids.len() - 1;
    let x = Tensor::from_vec(ids[..n].to_vec(), (1, n), &Device::Cpu).unwrap();
    let logits = model.forward(&x, false).unwrap();
    let lp = candle_nn::ops::log_softmax(&logits, D::Minus1).unwrap();
    let lp: Vec<Vec<f32>> = lp.to_vec2().unwrap();
    -(0..n)
        .map(|i| lp[i][ids[i + 1] as usize] as f64)
        .sum::<f64>()
        / n as f64
}

/// Loss of the fixture's sequence under whatever `src` holds (HF dir or run; a run's model
/// takes its 32 training positions, so the first 33 tokens).
fn loss_of(src: &Path, fixture_name: &str) -> f64 {
    let (ids, ..) = expected(fixture_name);
    let ids = &ids[..33];
    let mut s = source::open(src, DType::F32, &Device::Cpu, ids.len() - 1).unwrap();
    loss(&mut s.model, ids)
}

const TEXT: &str = "The quick brown fox jumps over the lazy dog. A cockpit shows the pilot what \
the machine is doing, and a training cockpit shows the researcher what the model is doing. Loss \
goes down, the learning rate follows its schedule, and the gradient norm stays bounded. ";

/// A small text corpus in a temp dir.
fn corpus() -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    std::fs::write(d.path().join("a.txt"), TEXT.repeat(6)).unwrap();
    std::fs::write(d.path().join("b.txt"), TEXT.repeat(4)).unwrap();
    d
}

fn cfg(data: &Path, overrides: &[String]) -> Config {
    let mut o: Vec<String> = [
        "data.source=\"files\"",
        "model.seq_len=32",
        "optim.micro_batch=4",
        "optim.lr=1e-3",
        "schedule.warmup_steps=0",
        "eval.every=0",
        "eval.batches=1",
        "checkpoint.every_steps=0",
        "checkpoint.at_end=true",
        "data.val_fraction=0.2",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    o.push(format!("data.train={:?}", data.display().to_string()));
    o.extend(overrides.iter().cloned());
    config::load(None, &o)
        .unwrap_or_else(|e| panic!("{e}"))
        .config
}

fn run(c: Config, dir: &Path) -> Vec<f64> {
    let e = Engine::spawn(EngineOptions::new(c, dir.to_path_buf(), DeviceSpec::Cpu))
        .unwrap_or_else(|e| panic!("{e}"));
    let mut losses = Vec::new();
    while let Some(ev) = e.events.recv() {
        match ev {
            Event::Step(s) => losses.push(s.loss),
            Event::Finished { .. } => break,
            _ => {}
        }
    }
    e.thread.wait().unwrap_or_else(|e| panic!("{e}"));
    losses
}

/// Full fine-tuning from a Hugging Face model: its shape, weights and tokenizer; the loss
/// starts where the pretrained model is (not at a random model's ln(vocab) ≈ 5.7), the run
/// trains every weight, and its export loads back to the same model.
#[test]
fn full_fine_tuning_from_a_hugging_face_model_then_export() {
    let data = corpus();
    let run_dir = tempfile::tempdir().unwrap();
    let init = format!(
        "model.init_from={:?}",
        fixture("llama3").display().to_string()
    );
    let losses = run(
        cfg(
            data.path(),
            &[
                init,
                "run.max_steps=6".into(),
                "eval.every=3".into(),
                "eval.sample_tokens=12".into(),
                "eval.sample_prompt=\"The quick brown\"".into(),
                "eval.samples_per_prompt=3".into(),
                "eval.sample_prompts=[\"The quick brown\", \"A cockpit shows\"]".into(),
            ],
        ),
        run_dir.path(),
    );
    assert_eq!(losses.len(), 6);
    // eval.sample_tokens: the model's text at each eval, in metrics.jsonl.
    let metrics = std::fs::read_to_string(run_dir.path().join("metrics.jsonl")).unwrap();
    let samples: Vec<serde_json::Value> = metrics
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["event"] == "sample")
        .collect();
    assert_eq!(samples.len(), 2, "one per eval");
    assert_eq!(samples[0]["prompt"], "The quick brown");
    assert!(
        samples[1]["text"].as_str().unwrap().starts_with(" fox"),
        "{:?}",
        samples[1]
    );
    // eval.samples_per_prompt: sampled on the live weights, the diversity in metrics.jsonl.
    let diversity: Vec<serde_json::Value> = metrics
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["event"] == "sample_diversity")
        .collect();
    assert_eq!(diversity.len(), 2, "one per eval");
    for d in &diversity {
        assert_eq!(d["prompts"], 2);
        assert_eq!(d["samples_per_prompt"], 3);
        let c = d["cosine_distance"].as_f64().unwrap();
        assert!((0.0..=2.0).contains(&c), "{d}");
        let d1 = d["distinct_1"].as_f64().unwrap();
        assert!(d1 > 0.0 && d1 <= 1.0, "{d}");
        assert!(d["new_tokens"].as_u64().unwrap() > 0, "{d}");
    }
    assert!(
        losses[0] < 3.0,
        "starts from the pretrained model: {losses:?}"
    );
    // The base's files are kept with the run; the data was packed with its tokenizer + BOS/EOS.
    assert!(run_dir.path().join("hf_base/tokenizer.json").is_file());
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            cockpit::engine::checkpoint::resolve(run_dir.path())
                .unwrap()
                .join("state.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let model_cfg: ModelConfig = serde_json::from_value(state["config"]["model"].clone()).unwrap();
    assert_eq!((model_cfg.head_dim, model_cfg.n_kv_head), (32, 2));
    assert!(state["config"]["data"]["tokenizer"]
        .as_str()
        .unwrap()
        .ends_with("tokenizer.json"));
    // Trained: the weights moved.
    let before = loss_of(&fixture("llama3"), "llama3");
    let after = loss_of(run_dir.path(), "llama3");
    assert!((before - after).abs() > 1e-4, "{before} vs {after}");
    // Export (sharded) → re-import: the same model.
    let out = tempfile::tempdir().unwrap();
    let dest = out.path().join("hf");
    let x = export::export(
        run_dir.path(),
        &dest,
        &ExportOptions {
            adapter: false,
            dtype: Some(DType::F32),
            max_shard_bytes: 60_000,
        },
    )
    .unwrap();
    assert_eq!(x.model_type, "llama");
    assert!(dest.join("model.safetensors.index.json").is_file());
    assert!(dest.join("tokenizer.json").is_file() && dest.join("generation_config.json").is_file());
    let c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dest.join("config.json")).unwrap()).unwrap();
    assert_eq!(c["rope_scaling"]["rope_type"], "llama3");
    assert_eq!(c["max_position_embeddings"], 64);
    let again = loss_of(&dest, "llama3");
    assert!((again - after).abs() < 1e-5, "{again} vs {after}");
}

/// Export → re-import of every fixture gives transformers' loss again (GPT-2's Conv1D layout
/// and fused q|k|v written back).
#[test]
fn every_fixture_survives_export_and_reimport() {
    for &name in common::HF_FIXTURES {
        let (ids, ..) = expected(name);
        let mut m = source::open(&fixture(name), DType::F32, &Device::Cpu, 32).unwrap();
        let want = loss(&mut m.model, &ids[..33]);
        let out = tempfile::tempdir().unwrap();
        let dest = out.path().join(name);
        export::export(
            &fixture(name),
            &dest,
            &ExportOptions {
                adapter: false,
                dtype: None,
                max_shard_bytes: u64::MAX,
            },
        )
        .unwrap();
        let got = loss_of(&dest, name);
        assert!((got - want).abs() < 1e-4, "{name}: {got} vs {want}");
        let c: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dest.join("config.json")).unwrap())
                .unwrap();
        let want_type = match name {
            "llama2" | "llama3" => "llama",
            // A gemma3 wrapper's language model exports as Gemma3ForCausalLM.
            "gemma3" => "gemma3_text",
            "phi3_longrope" => "phi3",
            "granite_hybrid" | "granite_hybrid_moe" => "granitemoehybrid",
            other => other,
        };
        assert_eq!(c["model_type"], want_type);
    }
}

/// LoRA on every family runs, leaves the base alone, and exports as merged weights and (but
/// for GPT-2) as a PEFT adapter.
#[test]
fn lora_on_every_family() {
    let data = corpus();
    for name in [
        "llama2",
        "llama3",
        "mistral",
        "qwen2",
        "gpt2",
        "granite",
        "qwen3",
        "olmo2",
        "phi3",
        "gemma3_text",
        "gemma2",
        "phi3_longrope",
    ] {
        let run_dir = tempfile::tempdir().unwrap();
        let b = format!("lora.base={:?}", fixture(name).display().to_string());
        let losses = run(
            cfg(
                data.path(),
                &[
                    b,
                    "lora.enabled=true".into(),
                    "lora.r=4".into(),
                    "lora.targets=[\"q\",\"v\",\"down\"]".into(),
                    "optim.lr=1e-2".into(),
                    "run.max_steps=4".into(),
                ],
            ),
            run_dir.path(),
        );
        assert_eq!(losses.len(), 4, "{name}");
        assert!(
            losses.iter().all(|l| l.is_finite() && *l < 4.0),
            "{name}: {losses:?}"
        );
        let out = tempfile::tempdir().unwrap();
        let merged = out.path().join("merged");
        export::export(
            run_dir.path(),
            &merged,
            &ExportOptions {
                adapter: false,
                // f32: merging into a bf16 base would round the adapter's contribution.
                dtype: Some(DType::F32),
                max_shard_bytes: u64::MAX,
            },
        )
        .unwrap();
        let (want_model, _) =
            cockpit::engine::lora::model_from_checkpoint(run_dir.path(), &Device::Cpu).unwrap();
        let (ids, ..) = expected(name);
        let mut m = want_model;
        let with_adapter = loss(&mut m, &ids[..32]);
        let merged_loss = loss_of(&merged, name);
        let (ids_all, ..) = expected(name);
        let mut s = source::open(&merged, DType::F32, &Device::Cpu, 31).unwrap();
        let merged_32 = loss(&mut s.model, &ids_all[..32]);
        assert!(
            (with_adapter - merged_32).abs() < 1e-4,
            "{name}: {with_adapter} vs {merged_32}"
        );
        assert!(merged_loss.is_finite());
        let adapter = out.path().join("adapter");
        let r = export::export(
            run_dir.path(),
            &adapter,
            &ExportOptions {
                adapter: true,
                dtype: None,
                max_shard_bytes: u64::MAX,
            },
        );
        if name == "gpt2" || name.starts_with("phi3") {
            // Their q, k, v (and Phi-3's gate, up) are fused layers in transformers.
            let fused = if name == "gpt2" { "c_attn" } else { "qkv_proj" };
            assert!(r.unwrap_err().to_string().contains(fused));
            assert!(!adapter.exists(), "nothing written on error");
        } else {
            r.unwrap();
            assert!(adapter.join("adapter_model.safetensors").is_file());
            assert!(adapter.join("adapter_config.json").is_file());
        }
    }
}

fn cockpit() -> Command {
    let mut c = Command::cargo_bin("cockpit").unwrap();
    c.env("NO_COLOR", "1");
    c
}

/// Bad bases are one line, exit 2, and leave no run dir behind; a contradicting [model]
/// key names both values.
#[test]
fn train_refuses_bad_bases_and_contradictions_before_writing_anything() {
    let data = corpus();
    let broken = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture("gpt2").join(f), broken.path().join(f)).unwrap();
    }
    let cp = broken.path().join("config.json");
    let text = std::fs::read_to_string(&cp)
        .unwrap()
        .replace("\"gpt2\"", "\"bloom\"");
    std::fs::write(&cp, text).unwrap();
    // Granite 4.0 hybrids: a layer type cockpit does not compute; Mamba weights that do not
    // match the config.
    let hybrid = |change: &dyn Fn(&mut serde_json::Value)| {
        let d = tempfile::tempdir().unwrap();
        for f in ["config.json", "model.safetensors"] {
            std::fs::copy(fixture("granite_hybrid").join(f), d.path().join(f)).unwrap();
        }
        let cp = d.path().join("config.json");
        let mut c: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&cp).unwrap()).unwrap();
        change(&mut c);
        std::fs::write(&cp, c.to_string()).unwrap();
        d
    };
    let bad_kind = hybrid(&|c| c["layer_types"][3] = "sliding_attention".into());
    let bad_conv = hybrid(&|c| c["mamba_d_conv"] = 5.into());
    let runs = tempfile::tempdir().unwrap();
    let cases = [
        (
            format!("model.init_from={:?}", bad_kind.path().display().to_string()),
            "layer_types[3] = \"sliding_attention\": not supported for granitemoehybrid".to_string(),
        ),
        (
            format!("model.init_from={:?}", bad_conv.path().display().to_string()),
            "model.layers.0.mamba.conv1d.weight: shape [192, 1, 4], the config makes [192, 1, 5]".to_string(),
        ),
        (
            format!("model.init_from={:?}", broken.path().display().to_string()),
            "model_type = \"bloom\": not supported (supported: llama, mistral, qwen2, qwen3, olmo2, phi3, gpt2, granite, gemma3_text, gemma3, gemma2, granitemoehybrid)".to_string(),
        ),
        (
            format!("model.init_from={:?}", fixture("llama2").display().to_string()),
            "model.n_layer = 3 contradicts the base's 2".to_string(),
        ),
    ];
    for (i, (init, want)) in cases.iter().enumerate() {
        let run_dir = runs.path().join(format!("r{i}"));
        let mut args: Vec<String> = vec![
            "train".into(),
            "--no-tui".into(),
            "--run-dir".into(),
            run_dir.display().to_string(),
            "--set".into(),
            "data.source=\"files\"".into(),
            "--set".into(),
            format!("data.train={:?}", data.path().display().to_string()),
            "--set".into(),
            init.clone(),
        ];
        if i == 3 {
            args.extend(["--set".into(), "model.n_layer=3".into()]);
        }
        let out = cockpit().args(&args).assert().code(2).get_output().clone();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want.as_str()), "{err}");
        assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
        assert!(!run_dir.exists(), "nothing written: {}", run_dir.display());
    }
}

/// The first line a command printed to stdout, as JSON.
fn first_json_line(run: &assert_cmd::assert::Assert) -> serde_json::Value {
    let out = String::from_utf8_lossy(&run.get_output().stdout).into_owned();
    serde_json::from_str(out.lines().next().unwrap()).unwrap()
}

#[test]
fn generate_and_export_on_the_command_line() {
    let (_, _, prompt, greedy) = expected("qwen2");
    let ids: Vec<String> = prompt.iter().map(|t| t.to_string()).collect();
    let out = cockpit()
        .args([
            "generate",
            &fixture("qwen2").display().to_string(),
            "--temperature",
            "0",
        ])
        .args([
            "--max-tokens",
            &greedy.len().to_string(),
            "--ids",
            "--prompt-ids",
            &ids.join(","),
        ])
        .assert()
        .success()
        .get_output()
        .clone();
    let got: Vec<u32> = String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .map(|t| t.parse().unwrap())
        .collect();
    assert_eq!(got, greedy);
    // Text in, text out, streamed.
    cockpit()
        .args([
            "generate",
            &fixture("llama2").display().to_string(),
            "--prompt",
            "The quick brown",
        ])
        .args(["--temperature", "0", "--max-tokens", "6"])
        .assert()
        .success()
        .stdout(predicates::str::contains("fox"));
    // A sampled run is reproducible from its seed.
    let sample = |seed: &str| {
        cockpit()
            .args([
                "generate",
                &fixture("gpt2").display().to_string(),
                "--prompt",
                "The",
            ])
            .args([
                "--max-tokens",
                "12",
                "--seed",
                seed,
                "--temperature",
                "1.5",
                "--ids",
            ])
            .assert()
            .success()
            .get_output()
            .stdout
            .clone()
    };
    assert_eq!(sample("3"), sample("3"));
    // Bad input: exit 2, one line.
    let tmp = tempfile::tempdir().unwrap();
    cockpit()
        .args(["export", &fixture("gpt2").display().to_string()])
        .arg(tmp.path().join("x"))
        .args(["--dtype", "f8"])
        .assert()
        .code(2)
        .stderr(predicates::str::contains("--dtype \"f8\""));
    cockpit()
        .args([
            "generate",
            &fixture("gpt2").display().to_string(),
            "--prompt",
            "x",
        ])
        .args(["--max-tokens", "500"])
        .assert()
        .code(2)
        .stderr(predicates::str::contains("exceed the model's 64 positions"));
    cockpit()
        .args(["export", tmp.path().to_str().unwrap()])
        .arg(tmp.path().join("y"))
        .assert()
        .code(2)
        .stderr(predicates::str::contains("no checkpoint here"));
    // Many prompts, several samples each: JSON Lines with the samples and their diversity.
    let prompts = tmp.path().join("prompts.jsonl");
    let ids2: Vec<String> = prompt[..3].iter().map(|t| t.to_string()).collect();
    std::fs::write(
        &prompts,
        format!(
            "{{\"prompt_ids\": [{}]}}\n\n{{\"prompt_ids\": [{}]}}\n",
            ids.join(", "),
            ids2.join(", ")
        ),
    )
    .unwrap();
    let out_file = tmp.path().join("out.jsonl");
    let run = cockpit()
        .args([
            "generate",
            &fixture("qwen2").display().to_string(),
            "--prompts",
        ])
        .arg(&prompts)
        .args(["--samples", "3", "--batch-size", "4", "--max-tokens"])
        .arg(greedy.len().to_string())
        .args(["--temperature", "0", "--ignore-eos", "--output"])
        .arg(&out_file)
        .assert()
        .success()
        .get_output()
        .clone();
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(
        err.contains("tokens/s") && err.contains("first token") && err.contains("load"),
        "{err}"
    );
    assert!(err.contains("cosine distance"), "{err}");
    assert!(
        err.contains("prefill") && err.contains("decode") && err.contains("sampling"),
        "{err}"
    );
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&out_file)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    assert_eq!(lines[1]["line"], 3);
    for l in &lines {
        let samples = l["samples"].as_array().unwrap();
        assert_eq!(samples.len(), 3);
        for s in samples {
            assert_eq!(s["tokens"], greedy.len());
            assert_eq!(s["stop"], "length");
        }
        // Greedy: three equal samples, no diversity.
        let d = &l["diversity"];
        assert!(d["cosine_distance"].as_f64().unwrap().abs() < 1e-4, "{d}");
        assert!(d["distinct_1"].as_f64().unwrap() <= 1.0 / 3.0 + 1e-9, "{d}");
    }
    let first: Vec<u32> = lines[0]["samples"][0]["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    assert_eq!(first, greedy, "a prompt of a batch decodes as alone");
    // Sampled: different samples, a positive distance.
    let sampled = cockpit()
        .args([
            "generate",
            &fixture("llama3").display().to_string(),
            "--prompts",
        ])
        .arg(&prompts)
        .args([
            "--samples",
            "4",
            "--max-tokens",
            "8",
            "--temperature",
            "1.5",
        ])
        .args([
            "--top-k",
            "0",
            "--top-p",
            "1",
            "--repetition-penalty",
            "1.2",
        ])
        .assert()
        .success();
    let first = first_json_line(&sampled);
    assert!(
        first["diversity"]["cosine_distance"].as_f64().unwrap() > 1e-4,
        "{first}"
    );
    assert!(first["samples"][0]["text"].is_string(), "{first}");
    // Bad input: one line naming the value, exit 2.
    let bad = tmp.path().join("bad.jsonl");
    std::fs::write(&bad, "{\"prompt\": \"a\"}\n{\"prompt\": 5}\n").unwrap();
    let long = tmp.path().join("long.txt");
    std::fs::write(&long, format!("short\n{}\n", "word ".repeat(80))).unwrap();
    let gpt2 = fixture("gpt2").display().to_string();
    for (args, want) in [
        (
            vec!["--prompts", bad.to_str().unwrap()],
            "bad.jsonl: line 2: \"prompt\": 5 is not a string",
        ),
        (
            vec!["--prompts", long.to_str().unwrap(), "--max-tokens", "4"],
            "long.txt: line 2: ",
        ),
        (vec!["--prompt", "x", "--samples", "0"], "--samples 0"),
        (vec!["--prompt", "x", "--top-p", "1.5"], "--top-p 1.5"),
        (
            vec!["--prompts", bad.to_str().unwrap(), "--top-p", "0"],
            "--top-p 0",
        ),
        (
            vec!["--prompt", "x", "--samples", "2", "--batch-size", "0"],
            "--batch-size 0",
        ),
        (
            vec!["--prompt", "x", "--samples", "2", "--repetition-penalty=-1"],
            "--repetition-penalty -1",
        ),
    ] {
        let out = cockpit()
            .args(["generate", &gpt2])
            .args(&args)
            .assert()
            .code(2)
            .get_output()
            .clone();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: one line: {err}");
    }
    // A directory of weights alone (no tokenizer files) takes prompts as token ids; its
    // samples have ids and no text.
    let bare = tmp.path().join("bare");
    std::fs::create_dir(&bare).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture("llama3").join(f), bare.join(f)).unwrap();
    }
    let out = cockpit()
        .args(["generate", bare.to_str().unwrap(), "--prompts"])
        .arg(&prompts)
        .args(["--samples", "2", "--max-tokens", "4"])
        .assert()
        .success();
    let first = first_json_line(&out);
    assert_eq!(first["samples"][0]["tokens"], 4, "{first}");
    assert!(first["samples"][0]["text"].is_null(), "{first}");
    // A run that fails leaves the output file it would have replaced as it was, and no
    // temporary beside it.
    let before = std::fs::read(&out_file).unwrap();
    cockpit()
        .args(["generate", &gpt2, "--prompts"])
        .arg(&bad)
        .arg("--output")
        .arg(&out_file)
        .assert()
        .code(2);
    assert_eq!(std::fs::read(&out_file).unwrap(), before);
    let strays: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with(".tmp"))
        .collect();
    assert!(strays.is_empty(), "{strays:?}");
    // A sharded export transformers would read: index + shards.
    let dest = tmp.path().join("sharded");
    cockpit()
        .args(["export", &fixture("granite").display().to_string()])
        .arg(&dest)
        .args(["--max-shard-size", "100KB"])
        .assert()
        .success();
    assert!(dest.join("model.safetensors.index.json").is_file());
    assert!(dest.join("model-00001-of-00005.safetensors").is_file());
}
