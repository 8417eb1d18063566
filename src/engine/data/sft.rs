//! Instruction and chat datasets end to end: records ([`formats`](super::formats)) → token
//! ids with their loss mask ([`chat`](super::chat), through the chat template) → rows packed
//! without contamination ([`packing`](super::packing)). The samples are cached beside the data
//! ([`sft_cache`](super::sft_cache)): a second start with the same files, tokenizer and
//! template reads them back instead of rendering and tokenizing again.

use super::chat::Encoder;
use super::formats::{is_records, read_records, Format, Record};
use super::packing::{pack, LongSamples, PackStats, Rows};
use super::sft_cache::{self, Samples};
use super::template::ChatTemplate;
use super::{list_files, DataError, Dataset, Special, Tok, Tokens};
use crate::config::Config;
use rayon::prelude::*;
use std::path::PathBuf;
use std::sync::Arc;

/// Packed train and val rows of an instruction/chat dataset.
#[derive(Clone, Debug)]
pub struct SftRows {
    pub train: Arc<Rows>,
    pub val: Arc<Rows>,
    pub stats: PackStats,
    pub format: Format,
}

/// The records' format when the configured files are an instruction/chat dataset (None: plain
/// text, or JSONL with `text`, which the token-stream pipeline reads).
pub fn format_of(cfg: &Config) -> Result<Option<(Format, bool)>, DataError> {
    let d = &cfg.data;
    if d.source != "files" {
        return Ok(None);
    }
    let files = list_files(&d.train)?;
    let records = files.iter().any(|f| is_records(f));
    // The token-stream pipeline reads text files and JSONL `text` records.
    let jsonl_only = files.iter().filter(|f| is_records(f)).all(|f| {
        f.extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("jsonl") || e.eq_ignore_ascii_case("ndjson"))
    });
    let explicit = Format::parse(&d.format).flatten();
    if !records || explicit == Some(Format::Text) && jsonl_only {
        return Ok(None);
    }
    if let Some(f) = explicit {
        return Ok(Some((f, false)));
    }
    let Some(first) = files.iter().find(|f| is_records(f)) else {
        return Ok(None);
    };
    let recs = read_records(first)?;
    let Some(r) = recs.first() else {
        return Err(DataError::Input {
            path: first.display().to_string(),
            message: "no records".into(),
        });
    };
    match Format::detect(&r.value) {
        Some(Format::Text) if jsonl_only => Ok(None),
        Some(f) => Ok(Some((f, true))),
        None => Err(DataError::Input {
            path: r.at.clone(),
            message: "data.format = \"auto\": the first record has none of the fields messages, prompt + completion, instruction + output, text".into(),
        }),
    }
}

/// The samples of the train and val files; without val files, every k-th train sample
/// (k = 1 / val_fraction) is held out, spread over the files.
fn encode_all(
    train_files: &[PathBuf],
    val_files: &[PathBuf],
    k: usize,
    encode: &dyn Fn(&[Record]) -> Result<Samples, DataError>,
) -> Result<(Samples, Samples), DataError> {
    let all = encode(&records(train_files, "data.train")?)?;
    if !val_files.is_empty() {
        return Ok((all, encode(&records(val_files, "data.val")?)?));
    }
    let (mut train, mut val) = (Vec::new(), Vec::new());
    for (i, s) in all.into_iter().enumerate() {
        if i % k == k - 1 {
            val.push(s);
        } else {
            train.push(s);
        }
    }
    if val.is_empty() && train.len() > 1 {
        val.extend(train.pop());
    }
    Ok((train, val))
}

fn records(files: &[PathBuf], key: &str) -> Result<Vec<Record>, DataError> {
    let mut out = Vec::new();
    for f in files {
        if !is_records(f) {
            return Err(DataError::Input {
                path: f.display().to_string(),
                message: format!(
                    "{key}: a plain text file among instruction/chat records (.jsonl, .json, .parquet)"
                ),
            });
        }
        out.extend(read_records(f)?);
    }
    Ok(out)
}

/// Load, tokenize and pack an instruction/chat dataset of `format`.
pub fn load(
    cfg: &Config,
    special: Special,
    (format, detected): (Format, bool),
) -> Result<Dataset, DataError> {
    let d = &cfg.data;
    let tok = if d.tokenizer == "byte" || d.tokenizer == "auto" {
        Tok::Byte
    } else {
        Tok::open(&d.tokenizer)?
    };
    let template =
        ChatTemplate::find(&d.chat_template, &d.tokenizer).map_err(DataError::Template)?;
    let enc = Encoder {
        tok: &tok,
        template: template.as_ref(),
        format,
        train_on_prompt: d.train_on_prompt,
        special,
    };
    let encode = |recs: &[Record]| -> Result<Samples, DataError> {
        recs.par_iter()
            .map(|r| {
                let s = r.sample(format)?;
                Ok((enc.encode(&s, &r.at)?, r.at.clone()))
            })
            .collect()
    };
    let train_files = list_files(&d.train)?;
    let val_files = if d.val.is_empty() {
        Vec::new()
    } else {
        list_files(&d.val)?
    };
    let k = (1.0 / d.val_fraction.max(1e-9)).round().max(2.0) as usize;
    let cache = sft_cache::dir(&sft_cache::Inputs {
        train: &train_files,
        val: &val_files,
        tokenizer: match tok {
            Tok::Byte => "byte",
            Tok::Hf(_) => &d.tokenizer,
        },
        template: template.as_ref().map(|t| t.text.as_str()),
        format: format.name(),
        train_on_prompt: d.train_on_prompt,
        special,
        split: if d.val.is_empty() {
            format!("every {k}th")
        } else {
            "data.val".into()
        },
    })?;
    let mut warnings = Vec::new();
    let cached = sft_cache::read(&cache);
    let from_cache = cached.is_some();
    let (train, val) = match cached {
        Some(tv) => tv,
        None => {
            let tv = encode_all(&train_files, &val_files, k, &encode)?;
            if let Err(e) = sft_cache::write(&cache, &tv.0, &tv.1) {
                warnings.push(format!("the token cache could not be written: {e}"));
            }
            tv
        }
    };
    let long = LongSamples::parse(&d.long_samples).unwrap_or(LongSamples::Split);
    let t = cfg.model.seq_len;
    let (train_rows, stats) = pack(&train, t, d.packing, long)?;
    let (val_rows, _) = pack(&val, t, d.packing, long)?;
    if train_rows.is_empty() || val_rows.is_empty() {
        return Err(DataError::TooSmall(format!(
            "data.train = {:?}: {} train and {} val rows after packing; at least one of each is needed",
            d.train,
            train_rows.len(),
            val_rows.len()
        )));
    }
    let how = if detected {
        "detected from the first record"
    } else {
        "data.format"
    };
    let description = format!(
        "{} records ({how}{}), chat template {}, {}: {}",
        format.name(),
        if from_cache {
            ", read from the token cache"
        } else {
            ""
        },
        template
            .as_ref()
            .map_or("none".to_string(), |t| t.source.clone()),
        if d.train_on_prompt {
            "loss on every token"
        } else {
            "loss on the answers"
        },
        stats.describe(t, d.packing),
    );
    let flat = |r: &Rows| Tokens::from_vec(r.inputs.clone());
    Ok(Dataset {
        train: flat(&train_rows),
        val: flat(&val_rows),
        vocab_size: tok.vocab_size(),
        entropy_floor_bpt: None,
        description,
        warnings,
        rows: Some(SftRows {
            train: Arc::new(train_rows),
            val: Arc::new(val_rows),
            stats,
            format,
        }),
    })
}
