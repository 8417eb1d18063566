//! `cockpit generate` over many prompts (`--prompts`, `--samples`, `--batch-size`,
//! `--output`) and its benchmark (`--bench`).

use super::hf::GenerateArgs;
use super::{EXIT_FAILURE, EXIT_OK, EXIT_USAGE};
use crate::engine::generate::diversity::Diversity;
use crate::engine::generate::run::{self, ManyOptions};
use crate::engine::EngineError;
use std::io::Write;
use std::path::PathBuf;

/// The options that make `generate` a many-prompt run.
pub struct Many {
    pub prompts: Option<PathBuf>,
    pub samples: usize,
    pub batch_size: Option<usize>,
    pub output: Option<PathBuf>,
    pub bench: Vec<usize>,
    /// The benchmark's prompt length in tokens.
    pub bench_prompt: usize,
}

impl Many {
    pub fn wanted(&self) -> bool {
        self.prompts.is_some()
            || self.samples != 1
            || self.output.is_some()
            || !self.bench.is_empty()
    }
}

fn usage(e: &str) -> anyhow::Result<i32> {
    crate::errln!("cockpit: generate: {e}");
    Ok(EXIT_USAGE)
}

fn failed(e: &EngineError) -> anyhow::Result<i32> {
    crate::errln!("cockpit: generate: {e}");
    Ok(if e.is_usage() {
        EXIT_USAGE
    } else {
        EXIT_FAILURE
    })
}

fn figures(d: &Diversity) -> String {
    let f = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.3}"));
    format!(
        "distinct-1 {}, distinct-2 {}, distinct-3 {}, cosine distance {}",
        f(d.distinct_1),
        f(d.distinct_2),
        f(d.distinct_3),
        f(d.cosine_distance)
    )
}

pub fn many(m: Many, a: GenerateArgs) -> anyhow::Result<i32> {
    let device = match a.device.map(crate::util::parse_device) {
        None => crate::util::DeviceSpec::Auto,
        Some(Some(d)) => d,
        Some(None) => return usage("--device: allowed: auto, cpu, cuda, cuda:N"),
    };
    if let Some(e) = a.sampling.problem() {
        return usage(&e);
    }
    if m.samples == 0 {
        return usage("--samples 0: give at least 1");
    }
    if m.batch_size == Some(0) {
        return usage("--batch-size 0: give at least 1");
    }
    if !m.bench.is_empty() {
        if m.bench.contains(&0) {
            return usage("--bench 0: a batch needs at least 1 row");
        }
        if m.bench_prompt == 0 {
            return usage("--bench-prompt 0: a prompt needs at least 1 token");
        }
        let result = run::bench(
            a.source,
            device,
            &m.bench,
            m.bench_prompt,
            a.max_tokens,
            &a.sampling,
            |r| {
                crate::errln!(
                    "batch {:>4}: {} new tokens in {:.2} s: {:.1} tokens/s, first token {:.1} ms, load {:.2} s; prefill {:.1} ms, decode {:.1} tokens/s{}, sampling {:.1}% of the time",
                    r.batch,
                    r.new_tokens,
                    r.seconds,
                    r.tokens_per_s,
                    r.first_token_ms,
                    r.load_s,
                    r.prefill_ms,
                    r.decode_tokens_per_s,
                    if r.graphed { " (CUDA graph)" } else { "" },
                    r.sampling_share * 100.0
                );
                crate::outln!("{}", serde_json::to_string(r).unwrap_or_default());
            },
        );
        return match result {
            Ok(_) => Ok(EXIT_OK),
            Err(e) => failed(&e),
        };
    }
    let o = ManyOptions {
        prompts_file: m.prompts,
        prompt: a.prompt,
        prompt_ids: a.prompt_ids,
        samples: m.samples,
        batch_size: m.batch_size,
        max_tokens: a.max_tokens,
        sampling: a.sampling,
        device,
        ignore_eos: a.ignore_eos,
        chat: a.chat,
    };
    // The output is written to a temporary file beside it, made before the model loads (a
    // directory that cannot be written fails at once), and renamed over it once whole: a run
    // that fails leaves an earlier file of that name as it was.
    let mut file = match &m.output {
        Some(p) if p.is_dir() => {
            return usage(&format!(
                "--output {}: a directory (name the file to write)",
                p.display()
            ));
        }
        Some(p) => {
            let dir = match p.parent() {
                Some(d) if !d.as_os_str().is_empty() => d,
                _ => std::path::Path::new("."),
            };
            // (Readable as a file `File::create` makes would be, not the temporary's 0600.)
            let mut b = tempfile::Builder::new();
            #[cfg(unix)]
            {
                use std::os::unix::fs::PermissionsExt;
                b.permissions(std::fs::Permissions::from_mode(0o644));
            }
            match b.tempfile_in(dir) {
                Ok(f) => Some((p.clone(), std::io::BufWriter::new(f))),
                Err(e) => return usage(&format!("--output {}: {e}", p.display())),
            }
        }
        None => None,
    };
    let report = match run::run_many(a.source, &o, |_, _| {}) {
        Ok(r) => r,
        Err(e) => return failed(&e),
    };
    for p in &report.prompts {
        let line = serde_json::to_string(p).unwrap_or_default();
        match &mut file {
            Some((path, w)) => {
                if let Err(e) = writeln!(w, "{line}") {
                    crate::errln!("cockpit: generate: {}: {e}", path.display());
                    return Ok(EXIT_FAILURE);
                }
            }
            None => crate::outln!("{line}"),
        }
    }
    if let Some((path, w)) = file {
        let written = w
            .into_inner()
            .map_err(|e| e.into_error())
            .and_then(|f| f.persist(&path).map(drop).map_err(|e| e.error));
        if let Err(e) = written {
            crate::errln!("cockpit: generate: {}: {e}", path.display());
            return Ok(EXIT_FAILURE);
        }
    }
    crate::errln!(
        "[{} prompts × {} samples in batches of {} rows: {} new tokens in {:.2} s, {:.1} tokens/s; first token {:.1} ms; load {:.2} s]",
        report.prompts.len(),
        o.samples,
        report.batch_size,
        report.new_tokens,
        report.seconds,
        report.new_tokens as f64 / report.seconds.max(1e-9),
        report.first_token_s * 1e3,
        report.load_s
    );
    let decode_s = (report.seconds - report.prefill_s).max(1e-9);
    crate::errln!(
        "[wall {:.2} s: prefill {:.2} s, decode {:.1} tokens/s, sampling {:.1}% of the wall time]",
        report.seconds,
        report.prefill_s,
        report.new_tokens as f64 / decode_s,
        report.sampling_s / report.seconds.max(1e-9) * 100.0
    );
    if o.samples >= 2 {
        crate::errln!("[diversity, mean over prompts: {}]", figures(&report.mean));
    }
    Ok(EXIT_OK)
}
