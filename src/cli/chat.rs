//! `cockpit chat`: a conversation on stdin/stdout. Each line read is a user turn; the reply
//! streams to stdout and ends with a newline; notes and figures go to stderr. `/reset`
//! forgets the conversation, `/exit` or the end of input ends (exit 0).

use super::{EXIT_FAILURE, EXIT_OK, EXIT_USAGE};
use crate::engine::generate::chat::{Chat, ChatOptions};
use crate::engine::generate::Sampling;
use crate::engine::EngineError;
use std::io::{BufRead, IsTerminal, Write};
use std::path::Path;

/// Exit 2 for what the user gave (a source that is not a model, no template, bad options).
fn setup_code(e: &EngineError) -> i32 {
    if e.is_usage() || matches!(e, EngineError::Checkpoint(_) | EngineError::Data(_)) {
        EXIT_USAGE
    } else {
        EXIT_FAILURE
    }
}

pub fn chat(
    source: &Path,
    system: Option<String>,
    max_tokens: usize,
    sampling: Sampling,
    device: Option<&str>,
) -> anyhow::Result<i32> {
    let device = match device.map(crate::util::parse_device) {
        None => crate::util::DeviceSpec::Auto,
        Some(Some(d)) => d,
        Some(None) => {
            crate::errln!("cockpit: chat: --device: allowed: auto, cpu, cuda, cuda:N");
            return Ok(EXIT_USAGE);
        }
    };
    let options = ChatOptions {
        system,
        max_tokens,
        sampling,
        device,
    };
    let mut chat = match Chat::open(source, options) {
        Ok(c) => c,
        Err(e) => {
            crate::errln!("cockpit: chat: {e}");
            return Ok(setup_code(&e));
        }
    };
    let tty = std::io::stdin().is_terminal();
    crate::errln!(
        "[{} loaded in {:.2} s; chat template {}; {} positions. /reset forgets the conversation, /exit ends]",
        source.display(),
        chat.load_s,
        chat.template_source(),
        chat.limit()
    );
    let mut input = std::io::stdin().lock();
    let mut raw = Vec::new();
    loop {
        if tty {
            eprint!("> ");
            let _ = std::io::stderr().flush();
        }
        raw.clear();
        match input.read_until(b'\n', &mut raw) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) => {
                crate::errln!("cockpit: chat: reading stdin: {e}");
                return Ok(EXIT_FAILURE);
            }
        }
        let line = String::from_utf8_lossy(&raw);
        let line = line.trim_end_matches(['\n', '\r']);
        match line.trim() {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                chat.reset();
                crate::errln!("[the conversation is forgotten]");
                continue;
            }
            _ => {}
        }
        let result = chat.reply(
            line,
            |note| {
                crate::errln!("[{note}]");
            },
            |piece| {
                if !crate::stdio::Stream::Stdout.gone() {
                    crate::stdio::out_bytes(piece.as_bytes());
                }
            },
        );
        match result {
            Ok(r) => {
                crate::outln!();
                crate::errln!(
                    "[{} prompt tokens, {} new{}, {:.1} tokens/s]",
                    r.prompt_tokens,
                    r.ids.len(),
                    if r.ended { "" } else { " (the most tokens)" },
                    r.tokens_per_s
                );
            }
            // A message that cannot be answered (too long, the template refuses it) is
            // skipped; the conversation goes on.
            Err(e) if e.is_usage() => crate::errln!("cockpit: chat: {e}"),
            Err(e) => {
                crate::errln!("cockpit: chat: {e}");
                return Ok(EXIT_FAILURE);
            }
        }
    }
    Ok(EXIT_OK)
}
