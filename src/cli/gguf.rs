//! `cockpit export SOURCE OUT.gguf --format gguf [--quant TYPE]`: the GGUF side of export.

use super::{EXIT_FAILURE, EXIT_OK, EXIT_USAGE};
use crate::engine::gguf::{self, Quant};
use std::path::Path;

/// Whether the export is a GGUF one (Some(encoding)), a Hugging Face one (None), or a usage
/// error already reported (Err(exit code)).
pub fn wants(out: &Path, format: Option<&str>, quant: Option<&str>) -> Result<Option<Quant>, i32> {
    let by_name = out
        .extension()
        .is_some_and(|x| x.eq_ignore_ascii_case("gguf"));
    let gguf = match format {
        None => by_name,
        Some("gguf") => true,
        Some("hf") => false,
        Some(f) => {
            crate::errln!("cockpit: export: --format {f:?}: allowed: hf, gguf");
            return Err(EXIT_USAGE);
        }
    };
    if !gguf {
        if let Some(q) = quant {
            crate::errln!(
                "cockpit: export: --quant {q:?} is for GGUF files (--format gguf); a Hugging Face export takes --dtype"
            );
            return Err(EXIT_USAGE);
        }
        return Ok(None);
    }
    match gguf::parse_quant(quant.unwrap_or("f16")) {
        Ok(q) => Ok(Some(q)),
        Err(m) => {
            crate::errln!("cockpit: export: {m}");
            Err(EXIT_USAGE)
        }
    }
}

pub fn export(
    source: &Path,
    out: &Path,
    adapter: bool,
    dtype: Option<&str>,
    quant: Quant,
) -> anyhow::Result<i32> {
    if adapter || dtype.is_some() {
        crate::errln!(
            "cockpit: export: --format gguf writes merged weights in --quant's encoding; --adapter and --dtype are for Hugging Face exports"
        );
        return Ok(EXIT_USAGE);
    }
    match crate::engine::export_gguf::export(source, out, quant) {
        Ok(x) => {
            for n in &x.notes {
                crate::errln!("note: {n}");
            }
            crate::errln!(
                "exported {} as {} to {} ({})",
                source.display(),
                x.model_type,
                out.display(),
                quant.name()
            );
            Ok(EXIT_OK)
        }
        Err(e) => {
            crate::errln!("cockpit: export: {e}");
            Ok(if e.is_usage() {
                EXIT_USAGE
            } else {
                EXIT_FAILURE
            })
        }
    }
}
