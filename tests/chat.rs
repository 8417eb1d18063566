//! `cockpit chat` driven as a user would, through a pipe: one reply a user line, greedy
//! replies equal to `cockpit generate --chat` on the same conversation, `/reset`, a context
//! that outgrows the model, a LoRA run dir, and bad sources (exit 2).

mod common;

use std::path::{Path, PathBuf};

fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(rel)
}

fn cockpit() -> assert_cmd::Command {
    let mut c = common::cockpit();
    c.timeout(std::time::Duration::from_secs(300));
    c
}

/// `cockpit chat SOURCE` greedy with `input` on stdin, 12 new tokens at most a reply unless
/// `extra` says: (exit code, stdout, stderr).
fn chat(source: &Path, input: &str, extra: &[&str]) -> (i32, String, String) {
    let max = if extra.contains(&"--max-new-tokens") {
        &[][..]
    } else {
        &["--max-tokens", "12"][..]
    };
    let out = cockpit()
        .arg("chat")
        .arg(source)
        .args(["--temperature", "0"])
        .args(max)
        .args(extra)
        .write_stdin(input)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `cockpit generate --chat` greedy on each conversation (JSON Lines of "messages"): the
/// reply texts.
fn generate(source: &Path, conversations: &[serde_json::Value]) -> Vec<String> {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("p.jsonl");
    let lines: Vec<String> = conversations
        .iter()
        .map(|m| serde_json::json!({ "messages": m }).to_string())
        .collect();
    std::fs::write(&file, lines.join("\n")).unwrap();
    let out = cockpit()
        .arg("generate")
        .arg(source)
        .arg("--prompts")
        .arg(&file)
        .args(["--chat", "--temperature", "0", "--max-tokens", "12"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["samples"][0]["text"].as_str().unwrap().to_string()
        })
        .collect()
}

fn user(text: &str) -> serde_json::Value {
    serde_json::json!({"role": "user", "content": text})
}

fn assistant(text: &str) -> serde_json::Value {
    serde_json::json!({"role": "assistant", "content": text})
}

/// A reply for every user line, each equal to `generate --chat` on the conversation so far;
/// `/reset` forgets it (the next reply is the first one again); the end of input exits 0.
#[test]
fn replies_are_generate_chat_on_the_whole_conversation() {
    let base = fixture("hf/chatml");
    let (code, out, err) = chat(
        &base,
        "Say river twice.\nSay apple.\n/reset\nSay river twice.\n",
        &[],
    );
    assert_eq!(code, 0, "{err}");
    let replies: Vec<&str> = out.lines().collect();
    assert_eq!(replies.len(), 3, "{out}\n{err}");
    // The fixture learned the format: it answers and ends its turn.
    assert_eq!(replies[0], "river river.", "{err}");
    assert_eq!(replies[2], replies[0]);
    assert!(
        err.contains("chat template") && err.contains("forgotten"),
        "{err}"
    );
    assert!(!err.contains("the most tokens"), "{err}");
    let want = generate(
        &base,
        &[
            serde_json::json!([user("Say river twice.")]),
            serde_json::json!([
                user("Say river twice."),
                assistant(replies[0]),
                user("Say apple.")
            ]),
        ],
    );
    assert_eq!(want, vec![replies[0], replies[1]]);
    // `generate --chat --prompt` streams the same first reply.
    let one = cockpit()
        .arg("generate")
        .arg(&base)
        .args([
            "--prompt",
            "Say river twice.",
            "--chat",
            "--temperature",
            "0",
        ])
        .args(["--max-tokens", "12"])
        .output()
        .unwrap();
    assert!(one.status.success());
    assert_eq!(String::from_utf8_lossy(&one.stdout).trim_end(), replies[0]);
}

/// A system turn goes first (`--system`), and `/exit` ends before the rest of the input.
#[test]
fn system_turn_and_exit() {
    let base = fixture("hf/chatml");
    let system = "You are a helpful assistant.";
    let (code, out, err) = chat(
        &base,
        "Say stone.\n/exit\nSay paper.\n",
        &["--system", system],
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.lines().count(), 1, "{out}");
    let want = generate(
        &base,
        &[serde_json::json!([
            {"role": "system", "content": system},
            user("Say stone.")
        ])],
    );
    assert_eq!(out.trim_end(), want[0]);
}

/// A conversation longer than the model's 256 positions (less 64 kept for the reply: a
/// quarter of them, fewer than --max-tokens) drops its oldest turns and says so;
/// a message too long on its own is refused and the chat goes on.
#[test]
fn a_long_conversation_drops_its_oldest_turns() {
    let base = fixture("hf/chatml");
    let turns = "Say river twice.\n".repeat(20);
    let long = "apple river stone ".repeat(120);
    let input = format!("{turns}{long}\nSay apple.\n");
    let (code, out, err) = chat(&base, &input, &["--max-new-tokens", "100"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("outgrew the model's 256 positions: dropped the oldest"),
        "{err}"
    );
    assert!(err.contains("it was not sent"), "{err}");
    // 21 replies (the long message got none), the refused message dropped nothing.
    let replies = err.matches(" prompt tokens, ").count();
    assert_eq!(replies, 21, "{out}\n{err}");
    let lines: Vec<&str> = err.lines().collect();
    let refused = lines.iter().position(|l| l.contains("not sent")).unwrap();
    assert!(lines[refused - 1].contains(" prompt tokens, "), "{err}");
    assert!(out.starts_with("river river.\n"), "{out}");
}

/// A source that is not a model, or a model without a chat template: one line, exit 2.
#[test]
fn bad_sources_exit_2() {
    let tmp = tempfile::tempdir().unwrap();
    for (source, want) in [
        (tmp.path().join("nope"), "nope"),
        (fixture("hf/qwen2"), "no chat template"),
    ] {
        let (code, out, err) = chat(&source, "hello\n", &[]);
        assert_eq!(code, 2, "{err}");
        assert!(out.is_empty());
        assert!(
            err.contains("cockpit: chat: ") && err.contains(want),
            "{err}"
        );
        assert_eq!(err.lines().count(), 1, "{err}");
    }
    let (code, _, err) = chat(&fixture("hf/chatml"), "", &["--top-p", "0"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--top-p 0"), "{err}");
}

/// The README's example config trains LoRA adapters on a chat dataset; `cockpit chat` on the
/// run dir (base + adapters) answers as `generate --chat` does on it.
#[test]
fn a_lora_run_dir_chats() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    let conv = |a: u32, b: u32| {
        serde_json::json!({"messages": [user(&format!("What is {a} plus {b}?")),
            assistant(&format!("{a} plus {b} is {}.", a + b))]})
        .to_string()
    };
    let lines: Vec<String> = (0..60).map(|i| conv(i % 10, i % 7)).collect();
    std::fs::write(data.join("train.jsonl"), lines.join("\n")).unwrap();
    std::fs::write(data.join("val.jsonl"), lines[..10].join("\n")).unwrap();
    let run = tmp.path().join("run");
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = cockpit()
        .args(["train", "--no-tui", "--max-steps", "6", "--run-dir"])
        .arg(&run)
        .arg(root.join("configs/lora-chat.toml"))
        .arg("--set")
        .arg(format!(
            "data.train={:?}",
            data.join("train.jsonl").display().to_string()
        ))
        .arg("--set")
        .arg(format!(
            "data.val={:?}",
            data.join("val.jsonl").display().to_string()
        ))
        .args(["--set", "eval.every=0", "--set", "checkpoint.every_steps=0"])
        .args(["--set", "eval.sample_tokens=0"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("messages records"), "{err}");
    let (code, replies, err) = chat(&run, "What is 3 plus 4?\n", &[]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(replies.lines().count(), 1, "{replies}");
    let want = generate(&run, &[serde_json::json!([user("What is 3 plus 4?")])]);
    assert_eq!(replies.trim_end_matches('\n'), want[0]);
}

/// The README's example config loads (its data made the way scripts/chat_data.py makes it)
/// and says what the example says: LoRA on the ChatML fixture, SCU on the adapters, the loss
/// on the answers, packed rows.
#[test]
fn the_example_config_validates() {
    let tmp = tempfile::tempdir().unwrap();
    let rec =
        serde_json::json!({"messages": [user("What is 1 plus 2?"), assistant("1 plus 2 is 3.")]});
    for f in ["train.jsonl", "val.jsonl"] {
        std::fs::write(tmp.path().join(f), format!("{rec}\n")).unwrap();
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let set = |k: &str, f: &str| format!("{k}={:?}", tmp.path().join(f).display().to_string());
    let c = cockpit::config::load(
        Some(&root.join("configs/lora-chat.toml")),
        &[
            set("data.train", "train.jsonl"),
            set("data.val", "val.jsonl"),
        ],
    )
    .unwrap_or_else(|e| panic!("{e}"))
    .config;
    assert!(c.lora.enabled && c.scu.enabled);
    assert_eq!(c.scu.params, cockpit::config::ScuParams::Lora);
    assert!(
        c.lora.base.ends_with("tests/fixtures/hf/chatml"),
        "{}",
        c.lora.base
    );
    assert!(!c.data.train_on_prompt && c.data.packing);
    assert_eq!(c.data.format, "auto");
    // And the data script's defaults are the paths the config reads.
    let script = std::fs::read_to_string(root.join("scripts/chat_data.py")).unwrap();
    assert!(script.contains("data/chat-add") && script.contains("train.jsonl"));
    let cfg = std::fs::read_to_string(root.join("configs/lora-chat.toml")).unwrap();
    assert!(cfg.contains("../data/chat-add/train.jsonl"));
}
