//! `cockpit export` and `cockpit generate`.

use super::{EXIT_FAILURE, EXIT_OK, EXIT_USAGE};
use crate::engine::export::{self, ExportOptions, GenerateOptions};
use crate::engine::generate::Sampling;
use crate::engine::EngineError;
use std::path::Path;

fn exit_code(e: &EngineError) -> i32 {
    if e.is_usage() {
        EXIT_USAGE
    } else {
        EXIT_FAILURE
    }
}

pub fn export(
    source: &Path,
    out: &Path,
    adapter: bool,
    dtype: Option<&str>,
    max_shard_size: &str,
) -> anyhow::Result<i32> {
    let dtype = match dtype {
        None => None,
        Some(d) => match crate::engine::hf::parse_dtype(d) {
            Some(d) => Some(d),
            None => {
                crate::errln!("cockpit: export: --dtype {d:?}: allowed: f32, bf16, f16");
                return Ok(EXIT_USAGE);
            }
        },
    };
    let Some(max_shard_bytes) = parse_size(max_shard_size) else {
        crate::errln!(
            "cockpit: export: --max-shard-size {max_shard_size:?}: expected a size such as 200KB, 500MB or 5GB"
        );
        return Ok(EXIT_USAGE);
    };
    let o = ExportOptions {
        adapter,
        dtype,
        max_shard_bytes,
    };
    match export::export(source, out, &o) {
        Ok(x) => {
            for n in &x.notes {
                crate::errln!("note: {n}");
            }
            crate::errln!(
                "exported {} as model_type {} to {}: {}",
                source.display(),
                x.model_type,
                out.display(),
                x.files.join(", ")
            );
            Ok(EXIT_OK)
        }
        Err(e) => {
            crate::errln!("cockpit: export: {e}");
            Ok(exit_code(&e))
        }
    }
}

/// "5GB", "500MB", "200KB", "1000" (bytes): decimal units, as transformers' max_shard_size.
fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let split = s.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num.trim().parse().ok()?;
    let mult = match unit.to_ascii_uppercase().as_str() {
        "" | "B" => 1.0,
        "KB" => 1e3,
        "MB" => 1e6,
        "GB" => 1e9,
        _ => return None,
    };
    let bytes = n * mult;
    (bytes >= 1.0 && bytes.is_finite()).then_some(bytes as u64)
}

pub struct GenerateArgs<'a> {
    pub source: &'a Path,
    pub prompt: Option<String>,
    pub prompt_ids: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: Sampling,
    pub device: Option<&'a str>,
    pub ids: bool,
    pub ignore_eos: bool,
    pub chat: bool,
}

pub fn generate(a: GenerateArgs) -> anyhow::Result<i32> {
    // (the first GPU where there is one, as `train`'s run.device = "auto")
    let device = match a.device.map(crate::util::parse_device) {
        None => crate::util::DeviceSpec::Auto,
        Some(Some(d)) => d,
        Some(None) => {
            crate::errln!("cockpit: generate: --device: allowed: auto, cpu, cuda, cuda:N");
            return Ok(EXIT_USAGE);
        }
    };
    if let Some(e) = a.sampling.problem() {
        crate::errln!("cockpit: generate: {e}");
        return Ok(EXIT_USAGE);
    }
    if a.prompt.is_none() && a.prompt_ids.is_empty() {
        crate::errln!("cockpit: generate: give --prompt TEXT (or --prompt-ids 1,2,3)");
        return Ok(EXIT_USAGE);
    }
    let o = GenerateOptions {
        prompt: a.prompt,
        prompt_ids: a.prompt_ids,
        max_tokens: a.max_tokens,
        sampling: a.sampling,
        device,
        ignore_eos: a.ignore_eos,
        chat: a.chat,
    };
    let stream = !a.ids;
    let result = export::run_generate(a.source, &o, |piece| {
        // best effort: a reader that went away (`| head`) costs the rest of the stream only
        if stream && !crate::stdio::Stream::Stdout.gone() {
            crate::stdio::out_bytes(piece.as_bytes());
        }
    });
    match result {
        Ok(g) => {
            if a.ids {
                let ids: Vec<String> = g.ids.iter().map(|t| t.to_string()).collect();
                crate::outln!("{}", ids.join(" "));
            } else {
                crate::outln!();
            }
            crate::errln!(
                "[{} prompt tokens, {} new, {:.1} tokens/s]",
                g.prompt_ids.len(),
                g.ids.len(),
                g.tokens_per_sec
            );
            Ok(EXIT_OK)
        }
        Err(e) => {
            crate::errln!("cockpit: generate: {e}");
            Ok(exit_code(&e))
        }
    }
}
