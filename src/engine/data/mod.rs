//! Data: the built-in corpus, or text files tokenized (byte-level or a `tokenizer.json`) into
//! packed token shards (u16 when the vocabulary fits, else u32) cached beside the data with a
//! manifest, memory-mapped at training time. `loader` turns splits into batches.

pub mod builtin;
pub mod loader;

use crate::config::Config;
pub use crate::engine::base::Special;
use memmap2::Mmap;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
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
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> DataError + '_ {
    move |source| DataError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Where tokens live: in memory (the built-in corpus) or in a memory-mapped shard.
#[derive(Clone)]
enum Store {
    Owned(Arc<Vec<u32>>),
    Mapped { map: Arc<Mmap>, width: usize },
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
    /// Append tokens `[start, start+n)` to `out`.
    pub fn extend_into(&self, start: usize, n: usize, out: &mut Vec<u32>) {
        let a = self.start + start;
        match &self.store {
            Store::Owned(v) => out.extend_from_slice(&v[a..a + n]),
            Store::Mapped { map, width: 2 } => out.extend(
                map[a * 2..(a + n) * 2]
                    .chunks_exact(2)
                    .map(|c| u16::from_le_bytes([c[0], c[1]]) as u32),
            ),
            Store::Mapped { map, .. } => out.extend(
                map[a * 4..(a + n) * 4]
                    .chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            ),
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
        });
    }
    let prepared = prepare_with(cfg, special)?;
    let train = map_shard(&prepared.dir.join("train.bin"), prepared.manifest.width)?;
    let val = if prepared.manifest.val_tokens > 0 {
        map_shard(&prepared.dir.join("val.bin"), prepared.manifest.width)?
    } else {
        let n = train.len();
        let n_val = ((n as f64 * d.val_fraction) as usize).max(cfg.model.seq_len + 1);
        if n_val >= n {
            return Err(DataError::TooSmall(format!(
                "{n} tokens cannot hold a val split of {n_val}"
            )));
        }
        let val = train.slice(n - n_val, n_val);
        return Ok(Dataset {
            train: train.slice(0, n - n_val),
            val,
            vocab_size: prepared.manifest.vocab_size,
            entropy_floor_bpt: None,
            description: prepared.describe(),
        });
    };
    Ok(Dataset {
        train,
        val,
        vocab_size: prepared.manifest.vocab_size,
        entropy_floor_bpt: None,
        description: prepared.describe(),
    })
}

fn map_shard(path: &Path, width: usize) -> Result<Tokens, DataError> {
    let file = std::fs::File::open(path).map_err(io_err(path))?;
    // SAFETY: the shard is written once (temp + rename) and never modified in place afterwards.
    let map = unsafe { Mmap::map(&file) }.map_err(io_err(path))?;
    if map.len() % width != 0 {
        return Err(DataError::Shard {
            path: path.display().to_string(),
            message: format!("size {} is not a multiple of {width}", map.len()),
        });
    }
    let len = map.len() / width;
    Ok(Tokens {
        store: Store::Mapped {
            map: Arc::new(map),
            width,
        },
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
    /// Put before each document when packing (a base model's BOS).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bos: Option<u32>,
    /// Put after each document when packing (a base model's EOS).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eos: Option<u32>,
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
}

impl Prepared {
    pub fn describe(&self) -> String {
        format!(
            "{} files, {} train + {} val tokens ({}), cache {}",
            self.manifest.sources.len(),
            self.manifest.train_tokens,
            self.manifest.val_tokens,
            self.manifest.tokenizer,
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
        } else {
            out.push(path);
        }
    }
    Ok(())
}

const CACHE_DIR: &str = ".cockpit-cache";

fn sha256_file(path: &Path) -> Result<(String, u64), DataError> {
    let bytes = std::fs::read(path).map_err(io_err(path))?;
    Ok((hex(&Sha256::digest(&bytes)), bytes.len() as u64))
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

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
    fn encode(&self, text: &str, path: &str) -> Result<Vec<u32>, DataError> {
        match self {
            Tok::Byte => Ok(text.bytes().map(u32::from).collect()),
            Tok::Hf(t) => t
                .encode(text, false)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| DataError::Tokenizer {
                    path: path.to_string(),
                    message: e.to_string(),
                }),
        }
    }
}

/// Tokenize and pack the configured text files (cached: a second call with unchanged sources
/// and tokenizer returns the existing shards).
pub fn prepare(cfg: &Config) -> Result<Prepared, DataError> {
    prepare_with(cfg, Special::default())
}

/// [`prepare`], with BOS/EOS ids around each document.
pub fn prepare_with(cfg: &Config, special: Special) -> Result<Prepared, DataError> {
    let d = &cfg.data;
    let train_files = list_files(&d.train)?;
    let val_files = if d.val.is_empty() {
        Vec::new()
    } else {
        list_files(&d.val)?
    };
    if d.tokenizer == "base" {
        return Err(DataError::Tokenizer {
            path: d.tokenizer.clone(),
            message: "no base model to take it from (model.init_from or lora.base)".into(),
        });
    }
    // "auto" without a base (the engine resolves it against the base first) is bytes.
    let (tok, tok_sha) = if d.tokenizer == "byte" || d.tokenizer == "auto" {
        (Tok::Byte, "byte".to_string())
    } else {
        let path = Path::new(&d.tokenizer);
        (Tok::open(&d.tokenizer)?, sha256_file(path)?.0)
    };
    let describe = |files: &[PathBuf]| -> Result<Vec<SourceFile>, DataError> {
        files
            .iter()
            .map(|f| {
                let (sha256, bytes) = sha256_file(f)?;
                Ok(SourceFile {
                    path: f.display().to_string(),
                    bytes,
                    sha256,
                })
            })
            .collect()
    };
    let sources = describe(&train_files)?;
    let val_sources = describe(&val_files)?;
    let mut h = Sha256::new();
    for s in sources.iter().chain(&val_sources) {
        h.update(s.sha256.as_bytes());
    }
    h.update(tok_sha.as_bytes());
    for (tag, id) in [("bos", special.bos), ("eos", special.eos)] {
        if let Some(id) = id {
            h.update(format!("{tag}={id}").as_bytes());
        }
    }
    let key = hex(&h.finalize())[..16].to_string();
    let base = if Path::new(&d.train).is_dir() {
        PathBuf::from(&d.train)
    } else {
        train_files[0]
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default()
    };
    let dir = base.join(CACHE_DIR).join(&key);
    let manifest_path = dir.join("manifest.json");
    if let Ok(text) = std::fs::read_to_string(&manifest_path) {
        if let Ok(m) = serde_json::from_str::<Manifest>(&text) {
            if m.key == key && m.sources == sources && m.val_sources == val_sources {
                return Ok(Prepared {
                    dir,
                    manifest: m,
                    cached: true,
                });
            }
        }
    }
    std::fs::create_dir_all(&dir).map_err(io_err(&dir))?;
    let vocab_size = tok.vocab_size();
    let width = if vocab_size <= 1 << 16 { 2 } else { 4 };
    let tokenize_all = |files: &[PathBuf]| -> Result<Vec<u32>, DataError> {
        let mut out = Vec::new();
        for f in files {
            let bytes = std::fs::read(f).map_err(io_err(f))?;
            let text = String::from_utf8_lossy(&bytes);
            out.extend(special.bos);
            out.extend(tok.encode(&text, &f.display().to_string())?);
            out.extend(special.eos);
        }
        Ok(out)
    };
    let train = tokenize_all(&train_files)?;
    let val = tokenize_all(&val_files)?;
    write_shard(&dir.join("train.bin"), &train, width)?;
    if !val.is_empty() {
        write_shard(&dir.join("val.bin"), &val, width)?;
    }
    let manifest = Manifest {
        version: 1,
        key,
        sources,
        val_sources,
        tokenizer: d.tokenizer.clone(),
        tokenizer_sha256: tok_sha,
        vocab_size,
        width,
        train_tokens: train.len() as u64,
        val_tokens: val.len() as u64,
        bos: special.bos,
        eos: special.eos,
    };
    let text = serde_json::to_string_pretty(&manifest).unwrap_or_default();
    crate::engine::checkpoint::atomic_write(&manifest_path, text.as_bytes()).map_err(|e| {
        DataError::Shard {
            path: manifest_path.display().to_string(),
            message: e.to_string(),
        }
    })?;
    Ok(Prepared {
        dir,
        manifest,
        cached: false,
    })
}

fn write_shard(path: &Path, tokens: &[u32], width: usize) -> Result<(), DataError> {
    let mut buf = Vec::with_capacity(tokens.len() * width);
    for &t in tokens {
        if width == 2 {
            buf.extend_from_slice(&(t as u16).to_le_bytes());
        } else {
            buf.extend_from_slice(&t.to_le_bytes());
        }
    }
    crate::engine::checkpoint::atomic_write(path, &buf).map_err(|e| DataError::Shard {
        path: path.display().to_string(),
        message: e.to_string(),
    })
}
