//! Data: the built-in corpus, or text files tokenized (byte-level or a `tokenizer.json`) into
//! packed token shards (u16 when the vocabulary fits, else u32) cached beside the data with a
//! manifest, checked at open and read by position at training time (`shard`). `loader` turns
//! splits into batches.

pub mod builtin;
pub mod chat;
pub mod formats;
pub mod loader;
pub mod packing;
mod prepare;
pub mod sft;
mod sft_cache;
mod shard;
pub mod template;

pub use prepare::{prepare, prepare_with, prepare_with_progress, PrepareProgress};

use crate::config::Config;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("data.train = {0:?}: no files matched")]
    NoFiles(String),
    #[error("data.tokenizer = {path:?}: cannot load: {message}")]
    Tokenizer { path: String, message: String },
    #[error("{path}: {message}")]
    Shard { path: String, message: String },
    #[error("data: {0}")]
    TooSmall(String),
    /// Input that cannot be used (an empty corpus, a JSONL record without text, a bad
    /// `data.doc_separator`).
    #[error("{path}: {message}")]
    Input { path: String, message: String },
    /// A token cache that is not what its manifest describes (truncated, overwritten,
    /// changed while in use), named by its file.
    #[error("token cache {path}: {message}")]
    Cache { path: String, message: String },
    /// A chat template that cannot be read or parsed (`data.chat_template`).
    #[error("{0}")]
    Template(String),
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> DataError + '_ {
    move |source| DataError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Where tokens live: in memory (the built-in corpus) or in a shard on disk.
#[derive(Clone)]
enum Store {
    Owned(Arc<Vec<u32>>),
    File(Arc<shard::Shard>),
}

/// A contiguous run of tokens.
#[derive(Clone)]
pub struct Tokens {
    store: Store,
    start: usize,
    len: usize,
}

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tokens({} tokens)", self.len)
    }
}

impl Tokens {
    pub fn from_vec(v: Vec<u32>) -> Self {
        let len = v.len();
        Self {
            store: Store::Owned(Arc::new(v)),
            start: 0,
            len,
        }
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn slice(&self, start: usize, len: usize) -> Self {
        let start = start.min(self.len);
        Self {
            store: self.store.clone(),
            start: self.start + start,
            len: len.min(self.len - start),
        }
    }
    /// Append tokens `[start, start+n)` to `out` (clipped to the tokens there are). A shard
    /// on disk that changed since it was opened is an error naming it.
    pub fn extend_into(&self, start: usize, n: usize, out: &mut Vec<u32>) -> Result<(), DataError> {
        let start = start.min(self.len);
        let n = n.min(self.len - start);
        let a = self.start + start;
        match &self.store {
            Store::Owned(v) => {
                out.extend_from_slice(&v[a..a + n]);
                Ok(())
            }
            Store::File(s) => s.read(a, n, out),
        }
    }
}

/// Train and val splits plus what is known about them.
#[derive(Clone, Debug)]
pub struct Dataset {
    pub train: Tokens,
    pub val: Tokens,
    pub vocab_size: usize,
    /// Bits per token a perfect model reaches (built-in corpus only).
    pub entropy_floor_bpt: Option<f64>,
    pub description: String,
    /// Problems with the input worth a warning at start (skipped empty files, …).
    pub warnings: Vec<String>,
    /// An instruction/chat dataset: packed rows with loss masks and sample boundaries (the
    /// token streams above then hold the rows' inputs).
    pub rows: Option<sft::SftRows>,
}

/// Build the dataset a config asks for (tokenizing and caching files when needed).
pub fn load(cfg: &Config) -> Result<Dataset, DataError> {
    load_with(cfg, Special::default())
}

/// [`load`], with BOS/EOS ids put around each document (text file) when packing.
pub fn load_with(cfg: &Config, special: Special) -> Result<Dataset, DataError> {
    let d = &cfg.data;
    if d.source == "builtin" {
        let src = builtin::MarkovSource::new(
            d.builtin_vocab,
            d.builtin_order,
            d.builtin_branching,
            d.builtin_seed,
        );
        let (tokens, floor) = src.generate(d.builtin_tokens, d.builtin_seed);
        let n = tokens.len();
        let n_val = ((n as f64 * d.val_fraction) as usize).max(cfg.model.seq_len + 1);
        let all = Tokens::from_vec(tokens);
        return Ok(Dataset {
            train: all.slice(0, n - n_val),
            val: all.slice(n - n_val, n_val),
            vocab_size: d.builtin_vocab,
            entropy_floor_bpt: Some(floor),
            description: format!(
                "built-in order-{} Markov corpus, {} symbols, {} tokens, entropy floor {:.3} bits/token",
                d.builtin_order, d.builtin_vocab, n, floor
            ),
            warnings: Vec::new(),
            rows: None,
        });
    }
    if let Some(format) = sft::format_of(cfg)? {
        return sft::load(cfg, special, format);
    }
    let prepared = prepare_with(cfg, special)?;
    let m = &prepared.manifest;
    let train = open_shard(&prepared.dir.join("train.bin"), m, m.train_tokens)?;
    let mut warnings = prepared.notes.clone();
    warnings.extend(m.warnings.iter().cloned());
    let val = if prepared.manifest.val_tokens > 0 {
        open_shard(&prepared.dir.join("val.bin"), m, m.val_tokens)?
    } else {
        let n = train.len();
        let n_val = ((n as f64 * d.val_fraction) as usize).max(cfg.model.seq_len + 1);
        if n_val >= n {
            return Err(DataError::TooSmall(too_small(cfg, n, 0)));
        }
        let val = train.slice(n - n_val, n_val);
        return Ok(Dataset {
            train: train.slice(0, n - n_val),
            val,
            vocab_size: prepared.manifest.vocab_size,
            entropy_floor_bpt: None,
            description: prepared.describe(),
            warnings,
            rows: None,
        });
    };
    Ok(Dataset {
        train,
        val,
        vocab_size: prepared.manifest.vocab_size,
        entropy_floor_bpt: None,
        description: prepared.describe(),
        warnings,
        rows: None,
    })
}

/// The error for splits too small for a window of `model.seq_len + 1` tokens, naming the files.
pub fn too_small(cfg: &Config, train: usize, val: usize) -> String {
    let (d, t) = (&cfg.data, cfg.model.seq_len);
    let need = t + 1;
    if d.source != "files" {
        return format!(
            "data: {train} train / {val} val tokens is too little for model.seq_len = {t}"
        );
    }
    if train < 2 * need {
        format!(
            "data.train = {:?}: {train} tokens (after the val split) is too little for model.seq_len = {t} (at least {} needed)",
            d.train,
            2 * need
        )
    } else if d.val.is_empty() {
        format!(
            "data.train = {:?}: a val split of {val} tokens (data.val_fraction = {}) is smaller than one window of model.seq_len + 1 = {need} tokens; raise data.val_fraction or set data.val",
            d.train, d.val_fraction
        )
    } else {
        format!(
            "data.val = {:?}: {val} tokens is smaller than one window of model.seq_len + 1 = {need} tokens",
            d.val
        )
    }
}

fn open_shard(path: &Path, m: &Manifest, tokens: u64) -> Result<Tokens, DataError> {
    let shard = shard::Shard::open(path, m.width, tokens, m.vocab_size)?;
    let len = shard.len;
    Ok(Tokens {
        store: Store::File(Arc::new(shard)),
        start: 0,
        len,
    })
}

/// The manifest written beside packed shards.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub version: u32,
    pub key: String,
    pub sources: Vec<SourceFile>,
    pub val_sources: Vec<SourceFile>,
    pub tokenizer: String,
    pub tokenizer_sha256: String,
    pub vocab_size: usize,
    /// Bytes per token: 2 (u16) or 4 (u32).
    pub width: usize,
    pub train_tokens: u64,
    pub val_tokens: u64,
    /// Fingerprints of `train.bin` and `val.bin` (CRC32C, see `shard`), checked at open.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub train_crc32c: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_crc32c: Option<u32>,
    /// Put before each document when packing (a base model's BOS).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bos: Option<u32>,
    /// Put after each document when packing (a base model's EOS).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eos: Option<u32>,
    /// Put after each document when packing (`data.doc_separator`).
    #[serde(default)]
    pub separator: Vec<u32>,
    /// Documents packed (files, JSONL records).
    #[serde(default)]
    pub documents: u64,
    /// Problems found while packing (skipped empty files, …), repeated at each load.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SourceFile {
    pub path: String,
    pub bytes: u64,
    pub sha256: String,
}

/// Result of [`prepare`].
#[derive(Clone, Debug)]
pub struct Prepared {
    pub dir: PathBuf,
    pub manifest: Manifest,
    /// True when the shards were already cached.
    pub cached: bool,
    /// What the prepare found worth a warning (a cache that failed its check and was rebuilt).
    pub notes: Vec<String>,
}

impl Prepared {
    pub fn describe(&self) -> String {
        let m = &self.manifest;
        let sep = if m.separator.is_empty() {
            "no separator".to_string()
        } else {
            format!("{} separator tokens after each", m.separator.len())
        };
        // (No validation files: the run cuts data.val_fraction of these off at load.)
        let tokens = if m.val_sources.is_empty() && m.val_tokens == 0 {
            format!(
                "{} tokens ({}), the validation split cut from them (data.val_fraction)",
                m.train_tokens, m.tokenizer
            )
        } else {
            format!(
                "{} train + {} val tokens ({})",
                m.train_tokens, m.val_tokens, m.tokenizer
            )
        };
        format!(
            "{} files, {} documents ({sep}), {tokens}, cache {}",
            m.sources.len() + m.val_sources.len(),
            m.documents,
            self.dir.display()
        )
    }
}

/// Files named by a data spec: a file, a directory (recursively, sorted) or a glob.
pub fn list_files(spec: &str) -> Result<Vec<PathBuf>, DataError> {
    let p = Path::new(spec);
    let mut files = Vec::new();
    if p.is_file() {
        files.push(p.to_path_buf());
    } else if p.is_dir() {
        walk(p, &mut files)?;
    } else if let Ok(paths) = glob::glob(spec) {
        files.extend(paths.filter_map(Result::ok).filter(|p| p.is_file()));
    }
    files.retain(|f| !f.components().any(|c| c.as_os_str() == CACHE_DIR));
    files.sort();
    if files.is_empty() {
        return Err(DataError::NoFiles(spec.to_string()));
    }
    Ok(files)
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), DataError> {
    for entry in std::fs::read_dir(dir).map_err(io_err(dir))? {
        let path = entry.map_err(io_err(dir))?.path();
        if path.is_dir() {
            if path.file_name().is_some_and(|n| n != CACHE_DIR) {
                walk(&path, out)?;
            }
        } else if path.is_file() {
            // (a FIFO or a device would block or never end: not data)
            out.push(path);
        }
    }
    Ok(())
}

/// BOS/EOS put around each document when packing (from the base's config).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Special {
    pub bos: Option<u32>,
    pub eos: Option<u32>,
}

const CACHE_DIR: &str = ".cockpit-cache";

/// A tokenizer: bytes, or a Hugging Face tokenizer.json.
pub enum Tok {
    Byte,
    Hf(Box<tokenizers::Tokenizer>),
}

impl Tok {
    /// "byte" or the path of a tokenizer.json.
    pub fn open(spec: &str) -> Result<Tok, DataError> {
        if spec == "byte" {
            return Ok(Tok::Byte);
        }
        if let Err(e) = crate::util::open_regular(Path::new(spec)) {
            return Err(DataError::Tokenizer {
                path: spec.to_string(),
                message: e.to_string(),
            });
        }
        tokenizers::Tokenizer::from_file(spec)
            .map(|t| Tok::Hf(Box::new(t)))
            .map_err(|e| DataError::Tokenizer {
                path: spec.to_string(),
                message: e.to_string(),
            })
    }
    /// Text of token ids (bytes decoded lossily as UTF-8).
    pub fn decode(&self, ids: &[u32]) -> String {
        match self {
            Tok::Byte => {
                let bytes: Vec<u8> = ids.iter().map(|&i| i.min(255) as u8).collect();
                String::from_utf8_lossy(&bytes).into_owned()
            }
            Tok::Hf(t) => t.decode(ids, true).unwrap_or_default(),
        }
    }
    /// Ids of a prompt: with the tokenizer's own special tokens (a BOS, for most), as
    /// transformers does.
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, DataError> {
        match self {
            Tok::Byte => Ok(text.bytes().map(u32::from).collect()),
            Tok::Hf(t) => t
                .encode(text, true)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| DataError::Tokenizer {
                    path: "tokenizer.json".into(),
                    message: e.to_string(),
                }),
        }
    }
    pub fn vocab_size(&self) -> usize {
        match self {
            Tok::Byte => 256,
            Tok::Hf(t) => t.get_vocab_size(true),
        }
    }
    /// The id of the tokenizer's end-of-text token, when it has one of the usual names.
    pub fn eos_id(&self) -> Option<u32> {
        match self {
            Tok::Byte => None,
            Tok::Hf(t) => EOS_NAMES.iter().find_map(|n| t.token_to_id(n)),
        }
    }
    /// Ids of a piece of a document (no special tokens added; invalid UTF-8 is replaced for a
    /// tokenizer.json, kept as bytes for the byte-level one).
    fn encode_bytes(&self, bytes: &[u8], path: &str) -> Result<Vec<u32>, DataError> {
        match self {
            Tok::Byte => Ok(bytes.iter().map(|&b| u32::from(b)).collect()),
            Tok::Hf(t) => t
                .encode_fast(String::from_utf8_lossy(bytes), false)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| DataError::Tokenizer {
                    path: path.to_string(),
                    message: e.to_string(),
                }),
        }
    }
}

/// End-of-text tokens by name (GPT-2, Llama 3, Llama 2 / Mistral, Gemma), in that order.
const EOS_NAMES: [&str; 4] = ["<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>"];
