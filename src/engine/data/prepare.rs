//! `prepare`: text files (or JSONL records with a `text` field) → packed token shards.
//!
//! Files are streamed in pieces of about [`PIECE`] bytes, cut where tokenizing the pieces
//! apart gives the tokens of the whole (at the start of a line, for GPT-2 style byte-level
//! BPE), and the pieces are tokenized in parallel on every core, [`BATCH`] bytes at a time,
//! straight into the shard file: memory stays bounded whatever the corpus size. The cache is
//! keyed on the sources' SHA-256, and a file's hash is recomputed only when its (size, mtime)
//! changed since the last prepare.

use super::{
    io_err, list_files, shard, DataError, Manifest, Prepared, SourceFile, Special, Tok, CACHE_DIR,
};
use crate::config::Config;
use crate::util::{atomic_write, hex};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// Bytes per tokenization job.
const PIECE: usize = 256 << 10;
/// Bytes of text handed to the thread pool at once.
const BATCH: usize = 16 << 20;
/// Bump when the packed layout changes (the cache key includes it).
const FORMAT: &str = "pack-v2";

/// How far a prepare has got, for a progress bar.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PrepareProgress {
    /// Source bytes tokenized so far.
    pub bytes_done: u64,
    /// Source bytes to tokenize in all.
    pub bytes_total: u64,
    /// Tokens written so far.
    pub tokens: u64,
}

/// Tokenize and pack the configured text files (cached: a second call with unchanged sources
/// and tokenizer returns the existing shards).
pub fn prepare(cfg: &Config) -> Result<Prepared, DataError> {
    prepare_with(cfg, Special::default())
}

/// [`prepare`], with a base model's BOS/EOS ids around each document.
pub fn prepare_with(cfg: &Config, special: Special) -> Result<Prepared, DataError> {
    prepare_with_progress(cfg, special, &mut |_| {})
}

/// [`prepare_with`], calling `progress` as the tokenization advances.
pub fn prepare_with_progress(
    cfg: &Config,
    special: Special,
    progress: &mut dyn FnMut(&PrepareProgress),
) -> Result<Prepared, DataError> {
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
    let base = if Path::new(&d.train).is_dir() {
        PathBuf::from(&d.train)
    } else {
        train_files[0]
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default()
    };
    let cache_root = base.join(CACHE_DIR);
    let mut hashes = HashCache::load(&cache_root);
    // "auto" without a base (the engine resolves it against the base first) is bytes.
    let (tok, tok_sha) = if d.tokenizer == "byte" || d.tokenizer == "auto" {
        (Tok::Byte, "byte".to_string())
    } else {
        let path = Path::new(&d.tokenizer);
        (Tok::open(&d.tokenizer)?, hashes.sha256(path)?.0)
    };
    let separator = separator(&d.doc_separator, &tok, special)?;
    let mut describe = |files: &[PathBuf]| -> Result<Vec<SourceFile>, DataError> {
        files
            .iter()
            .map(|f| {
                let (sha256, bytes) = hashes.sha256(f)?;
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
    hashes.save(&cache_root);
    let mut h = Sha256::new();
    h.update(FORMAT.as_bytes());
    for s in sources.iter().chain(&val_sources) {
        h.update(s.sha256.as_bytes());
    }
    h.update(tok_sha.as_bytes());
    if let Some(id) = special.bos {
        h.update(format!("bos={id}").as_bytes());
    }
    h.update(format!("sep={separator:?}").as_bytes());
    let key = hex(&h.finalize())[..16].to_string();
    let dir = cache_root.join(&key);
    let manifest_path = dir.join("manifest.json");
    let vocab_size = tok.vocab_size();
    let width = if vocab_size <= 1 << 16 { 2 } else { 4 };
    let mut notes = Vec::new();
    if let Ok(text) = std::fs::read_to_string(&manifest_path) {
        if let Ok(m) = serde_json::from_str::<Manifest>(&text) {
            if m.key == key && m.sources == sources && m.val_sources == val_sources {
                // The sources are here: a cache that fails its check is rebuilt.
                match cache_problem(&dir, &m, (vocab_size, width)) {
                    None => {
                        return Ok(Prepared {
                            dir,
                            manifest: m,
                            cached: true,
                            notes,
                        })
                    }
                    Some(why) => notes.push(format!("token cache rebuilt: {why}")),
                }
            }
        }
    }
    std::fs::create_dir_all(&dir).map_err(io_err(&dir))?;
    let total = sources.iter().chain(&val_sources).map(|s| s.bytes).sum();
    let mut packer = Packer {
        tok: &tok,
        bos: special.bos,
        separator: &separator,
        width,
        jobs: Vec::new(),
        job_bytes: 0,
        out: None,
        written: 0,
        documents: 0,
        warnings: Vec::new(),
        progress: PrepareProgress {
            bytes_done: 0,
            bytes_total: total,
            tokens: 0,
        },
        report: progress,
    };
    let train_tokens = packer.pack(
        &train_files,
        &dir.join("train.bin"),
        ("data.train", &d.train),
    )?;
    let val_tokens = if val_files.is_empty() {
        0
    } else {
        packer.pack(&val_files, &dir.join("val.bin"), ("data.val", &d.val))?
    };
    let fingerprint = |tokens: u64, name: &str| -> Result<Option<u32>, DataError> {
        if tokens == 0 {
            return Ok(None);
        }
        Ok(Some(shard::fingerprint_path(&dir.join(name))?.1))
    };
    let manifest = Manifest {
        version: 3,
        key,
        sources,
        val_sources,
        tokenizer: d.tokenizer.clone(),
        tokenizer_sha256: tok_sha,
        vocab_size,
        width,
        train_tokens,
        val_tokens,
        train_crc32c: fingerprint(train_tokens, "train.bin")?,
        val_crc32c: fingerprint(val_tokens, "val.bin")?,
        bos: special.bos,
        eos: special.eos,
        documents: packer.documents,
        warnings: packer.warnings,
        separator,
    };
    let text = serde_json::to_string_pretty(&manifest).unwrap_or_default();
    atomic_write(&manifest_path, text.as_bytes()).map_err(|e| DataError::Shard {
        path: manifest_path.display().to_string(),
        message: e.to_string(),
    })?;
    Ok(Prepared {
        dir,
        manifest,
        cached: false,
        notes,
    })
}

/// Why the cache in `dir` cannot be used as its manifest `m` describes it (a vocabulary or
/// width other than the tokenizer's `want`, a shard of another size or content), or None
/// when it can.
fn cache_problem(dir: &Path, m: &Manifest, want: (usize, usize)) -> Option<String> {
    if (m.vocab_size, m.width) != want {
        return Some(format!(
            "{}: vocab_size {} and width {} where the tokenizer gives {} and {}",
            dir.join("manifest.json").display(),
            m.vocab_size,
            m.width,
            want.0,
            want.1
        ));
    }
    shard::mismatch(
        &dir.join("train.bin"),
        m.train_tokens,
        m.width,
        m.train_crc32c,
    )
    .or_else(|| {
        (m.val_tokens > 0)
            .then(|| shard::mismatch(&dir.join("val.bin"), m.val_tokens, m.width, m.val_crc32c))
            .flatten()
    })
}

/// The tokens put after each document (`data.doc_separator`).
fn separator(spec: &str, tok: &Tok, special: Special) -> Result<Vec<u32>, DataError> {
    let eos = special.eos.or_else(|| tok.eos_id());
    let bad = |message: String| DataError::Input {
        path: format!("data.doc_separator = {spec:?}"),
        message,
    };
    match spec {
        "auto" => Ok(eos.into_iter().collect()),
        "none" => Ok(Vec::new()),
        "eos" => eos.map(|e| vec![e]).ok_or_else(|| {
            bad(match tok {
                Tok::Byte => "the byte-level tokenizer has no EOS token; use \"none\" or a text such as \"\\n\\n\"".into(),
                Tok::Hf(_) => format!("the tokenizer has none of the EOS tokens {:?}; use \"none\" or a text", super::EOS_NAMES),
            })
        }),
        text => {
            let ids = tok.encode_bytes(text.as_bytes(), "data.doc_separator")?;
            if ids.is_empty() {
                return Err(bad("the text tokenizes to nothing".into()));
            }
            Ok(ids)
        }
    }
}

/// A piece of a document to tokenize.
struct Job {
    bytes: Vec<u8>,
    /// The document's first piece (a BOS goes before it).
    first: bool,
    /// The document's last piece (the separator goes after it).
    last: bool,
    /// Source bytes this piece accounts for (progress).
    source_bytes: u64,
    /// For errors.
    path: std::sync::Arc<str>,
}

struct Packer<'a> {
    tok: &'a Tok,
    bos: Option<u32>,
    separator: &'a [u32],
    width: usize,
    jobs: Vec<Job>,
    job_bytes: usize,
    out: Option<(BufWriter<File>, PathBuf)>,
    /// Tokens written to the current shard.
    written: u64,
    documents: u64,
    warnings: Vec<String>,
    progress: PrepareProgress,
    report: &'a mut dyn FnMut(&PrepareProgress),
}

impl Packer<'_> {
    /// Tokenize `files` into the shard `dest` (written to a temp file, then renamed).
    /// `key` names the config key and value the files came from, for errors.
    fn pack(
        &mut self,
        files: &[PathBuf],
        dest: &Path,
        key: (&str, &str),
    ) -> Result<u64, DataError> {
        let tmp = dest.with_extension(format!("bin.tmp-{}", std::process::id()));
        let file = File::create(&tmp).map_err(io_err(&tmp))?;
        self.out = Some((BufWriter::with_capacity(1 << 20, file), tmp.clone()));
        self.written = 0;
        for f in files {
            if is_jsonl(f) {
                self.jsonl(f)?;
            } else {
                self.text_file(f)?;
            }
        }
        self.flush()?;
        let written = self.written;
        if let Some((w, path)) = self.out.take() {
            let file = w.into_inner().map_err(|e| DataError::Io {
                path: path.display().to_string(),
                source: e.into_error(),
            })?;
            file.sync_all().map_err(io_err(&path))?;
        }
        if written == 0 {
            let _ = std::fs::remove_file(&tmp);
            return Err(DataError::Input {
                path: format!("{} = {:?}", key.0, key.1),
                message: "no text to tokenize: every file is empty or only whitespace".into(),
            });
        }
        std::fs::rename(&tmp, dest).map_err(io_err(dest))?;
        Ok(written)
    }

    fn push(&mut self, job: Job) -> Result<(), DataError> {
        self.job_bytes += job.bytes.len();
        self.jobs.push(job);
        if self.job_bytes >= BATCH {
            self.flush()?;
        }
        Ok(())
    }

    /// Tokenize the queued pieces in parallel and append them, in order, to the shard.
    fn flush(&mut self) -> Result<(), DataError> {
        let jobs = std::mem::take(&mut self.jobs);
        self.job_bytes = 0;
        let tok = self.tok;
        let ids: Vec<Result<Vec<u32>, DataError>> = jobs
            .par_iter()
            .map(|j| tok.encode_bytes(&j.bytes, &j.path))
            .collect();
        let Some((w, path)) = self.out.as_mut() else {
            return Ok(());
        };
        let mut buf = Vec::with_capacity(PIECE * self.width);
        for (job, ids) in jobs.iter().zip(ids) {
            let ids = ids?;
            buf.clear();
            let mut put = |t: u32| {
                if self.width == 2 {
                    buf.extend_from_slice(&(t as u16).to_le_bytes());
                } else {
                    buf.extend_from_slice(&t.to_le_bytes());
                }
            };
            if job.first {
                self.bos.into_iter().for_each(&mut put);
            }
            ids.iter().copied().for_each(&mut put);
            if job.last {
                self.separator.iter().copied().for_each(&mut put);
            }
            w.write_all(&buf).map_err(io_err(path))?;
            let n = (buf.len() / self.width) as u64;
            self.written += n;
            self.progress.tokens += n;
            self.progress.bytes_done += job.source_bytes;
        }
        (self.report)(&self.progress);
        Ok(())
    }

    /// A text file: one document, streamed in pieces. Empty or whitespace-only files are
    /// skipped with a warning.
    fn text_file(&mut self, f: &Path) -> Result<(), DataError> {
        let path: std::sync::Arc<str> = f.display().to_string().into();
        let mut file = crate::util::open_regular(f).map_err(io_err(f))?;
        let mut buf: Vec<u8> = Vec::with_capacity(2 * PIECE);
        // Leading whitespace-only pieces wait until the document shows some text.
        let mut waiting: Vec<Job> = Vec::new();
        let mut seen_text = false;
        let mut eof = false;
        let mut first = true;
        while !eof || !buf.is_empty() {
            // Fill to two pieces (a cut is searched in the second).
            while !eof && buf.len() < 2 * PIECE {
                let old = buf.len();
                buf.resize(2 * PIECE, 0);
                let n = file.read(&mut buf[old..]).map_err(io_err(f))?;
                buf.truncate(old + n);
                eof = n == 0;
            }
            let at = if eof && buf.len() <= 2 * PIECE {
                buf.len()
            } else {
                cut(&buf, PIECE)
            };
            let rest = buf.split_off(at);
            let piece = std::mem::replace(&mut buf, rest);
            let job = Job {
                source_bytes: piece.len() as u64,
                first,
                last: eof && buf.is_empty(),
                bytes: piece,
                path: path.clone(),
            };
            first = false;
            if !seen_text && job.bytes.iter().all(u8::is_ascii_whitespace) {
                waiting.push(job);
                continue;
            }
            seen_text = true;
            for mut w in waiting.drain(..) {
                w.last = false;
                self.push(w)?;
            }
            self.push(job)?;
        }
        if seen_text {
            self.documents += 1;
        } else {
            self.progress.bytes_done += waiting.iter().map(|j| j.source_bytes).sum::<u64>();
            self.warnings.push(format!(
                "{path}: {}; skipped",
                if waiting.iter().all(|j| j.bytes.is_empty()) {
                    "empty file"
                } else {
                    "only whitespace"
                }
            ));
        }
        Ok(())
    }

    /// JSON Lines: one document per line, its `text` field. Blank lines are skipped; a line
    /// that is not an object with a string `text` is an error naming the file and line.
    fn jsonl(&mut self, f: &Path) -> Result<(), DataError> {
        let path: std::sync::Arc<str> = f.display().to_string().into();
        let file = crate::util::open_regular(f).map_err(io_err(f))?;
        let mut reader = BufReader::with_capacity(1 << 20, file);
        let mut line = Vec::new();
        let (mut docs, mut blank_docs) = (0u64, 0u64);
        for number in 1.. {
            line.clear();
            let n = reader.read_until(b'\n', &mut line).map_err(io_err(f))?;
            if n == 0 {
                break;
            }
            if line.iter().all(u8::is_ascii_whitespace) {
                self.progress.bytes_done += n as u64;
                continue;
            }
            #[derive(Deserialize)]
            struct Record {
                text: Option<serde_json::Value>,
            }
            let bad = |message: String| DataError::Input {
                path: format!("{path}:{number}"),
                message,
            };
            let record: Record = serde_json::from_slice(&line)
                .map_err(|e| bad(format!("not a JSON object: {e}")))?;
            let text = match record.text {
                Some(serde_json::Value::String(t)) => t,
                Some(_) => return Err(bad("\"text\" is not a string".into())),
                None => return Err(bad("no \"text\" field".into())),
            };
            if text.trim().is_empty() {
                blank_docs += 1;
                self.progress.bytes_done += n as u64;
                continue;
            }
            docs += 1;
            let mut bytes = text.into_bytes();
            let mut first = true;
            loop {
                let at = if bytes.len() <= 2 * PIECE {
                    bytes.len()
                } else {
                    cut(&bytes, PIECE)
                };
                let rest = bytes.split_off(at);
                let last = rest.is_empty();
                self.push(Job {
                    bytes,
                    first,
                    last,
                    // The line's bytes (JSON escapes included) are counted with its last piece.
                    source_bytes: if last { n as u64 } else { 0 },
                    path: path.clone(),
                })?;
                if last {
                    break;
                }
                bytes = rest;
                first = false;
            }
        }
        self.documents += docs;
        if blank_docs > 0 {
            self.warnings.push(format!(
                "{path}: {blank_docs} records with an empty \"text\"; skipped"
            ));
        }
        if docs == 0 {
            self.warnings.push(format!(
                "{path}: no documents (no non-empty \"text\"); skipped"
            ));
        }
        Ok(())
    }
}

fn is_jsonl(f: &Path) -> bool {
    f.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| e.eq_ignore_ascii_case("jsonl") || e.eq_ignore_ascii_case("ndjson"))
}

/// Where to cut `buf` (longer than `target`) at or after `target`, so that tokenizing the two
/// parts apart gives the tokens of the whole for GPT-2 style pre-tokenizers: after a lone
/// newline between two non-spaces (`"a\n|b"`: a longer run of whitespace is split differently
/// at the end of a text); else before a lone space that starts a word (`"a| b"`); else any
/// UTF-8 character boundary.
pub(crate) fn cut(buf: &[u8], target: usize) -> usize {
    let target = target.clamp(2, buf.len());
    clean_cut(buf, target).unwrap_or_else(|| {
        (target..buf.len())
            .find(|&i| buf[i] & 0xC0 != 0x80)
            .unwrap_or(buf.len())
    })
}

/// The first cut at or after `target` (≥ 2) that keeps the words of the whole, if any: after
/// a lone newline, before a lone space, or between ASCII letters, digits and punctuation
/// (`"a|,"`, `"1|x"`; not around `'`, which starts `'s`-style words).
fn clean_cut(buf: &[u8], target: usize) -> Option<usize> {
    let text = |b: u8| !b.is_ascii_whitespace();
    let class = |b: u8| match b {
        b'a'..=b'z' | b'A'..=b'Z' => Some(0),
        b'0'..=b'9' => Some(1),
        b'\'' => None,
        _ if b.is_ascii_punctuation() => Some(2),
        _ => None,
    };
    let end = buf.len().saturating_sub(1);
    (target..buf.len())
        .find(|&i| buf[i - 1] == b'\n' && text(buf[i]) && text(buf[i - 2]))
        .or_else(|| (target..end).find(|&i| buf[i] == b' ' && text(buf[i + 1]) && text(buf[i - 1])))
        .or_else(|| {
            (target..buf.len()).find(
                |&i| matches!((class(buf[i - 1]), class(buf[i])), (Some(a), Some(b)) if a != b),
            )
        })
}

/// SHA-256 of source files, remembered by (size, mtime) in `.cockpit-cache/hashes.json`: an
/// unchanged file is not read again.
#[derive(Default, Serialize, Deserialize)]
pub(super) struct HashCache {
    files: BTreeMap<String, HashEntry>,
    #[serde(skip)]
    changed: bool,
}

#[derive(Clone, Serialize, Deserialize)]
struct HashEntry {
    bytes: u64,
    mtime_ns: u64,
    sha256: String,
}

impl HashCache {
    pub(super) fn load(root: &Path) -> Self {
        std::fs::read(root.join("hashes.json"))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default()
    }

    /// Best effort: a cache that cannot be written only costs a re-hash next time.
    pub(super) fn save(&self, root: &Path) {
        if self.changed {
            if let Ok(text) = serde_json::to_vec(self) {
                let _ = atomic_write(&root.join("hashes.json"), &text);
            }
        }
    }

    /// (hex SHA-256, size) of `path`.
    pub(super) fn sha256(&mut self, path: &Path) -> Result<(String, u64), DataError> {
        let meta = std::fs::metadata(path).map_err(io_err(path))?;
        let mtime = meta.modified().map_err(io_err(path))?;
        let mtime_ns = mtime
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        let name = std::fs::canonicalize(path)
            .unwrap_or_else(|_| path.to_path_buf())
            .display()
            .to_string();
        if let Some(e) = self.files.get(&name) {
            if e.bytes == meta.len() && e.mtime_ns == mtime_ns && mtime_ns != 0 {
                return Ok((e.sha256.clone(), e.bytes));
            }
        }
        let mut file = crate::util::open_regular(path).map_err(io_err(path))?;
        let mut h = Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        let mut bytes = 0u64;
        loop {
            let n = file.read(&mut buf).map_err(io_err(path))?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
            bytes += n as u64;
        }
        let sha256 = hex(&h.finalize());
        // A file modified in the last seconds may change again within the mtime's
        // resolution: remember it only once it is older.
        let settled = SystemTime::now()
            .duration_since(mtime)
            .is_ok_and(|age| age.as_secs() >= 2);
        if settled && bytes == meta.len() {
            self.files.insert(
                name,
                HashEntry {
                    bytes,
                    mtime_ns,
                    sha256: sha256.clone(),
                },
            );
            self.changed = true;
        }
        Ok((sha256, bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpt2() -> Tok {
        let p = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/hf/gpt2/tokenizer.json"
        );
        Tok::open(p).unwrap()
    }

    /// GPT-2 pre-tokenization (the words BPE then splits) of `text`.
    fn words(text: &str) -> Vec<String> {
        use tokenizers::tokenizer::{OffsetReferential, OffsetType, PreTokenizedString};
        use tokenizers::PreTokenizer;
        let mut p = PreTokenizedString::from(text);
        tokenizers::pre_tokenizers::byte_level::ByteLevel::new(false, true, true)
            .pre_tokenize(&mut p)
            .unwrap();
        p.get_splits(OffsetReferential::Original, OffsetType::Byte)
            .into_iter()
            .map(|(s, _, _)| s.to_string())
            .collect()
    }

    #[test]
    fn cuts_keep_the_words_of_the_whole() {
        let text = "Hello world.\n\n  indented line\nNext line, with  two spaces\n\n\nÉté \
                    déjà\r\n\r\nx = 1;\r\ny\n\tz\n  {\"k\": \"v\", 'a' 's}\n   ],\n   \"V\":\"2012\"\n"
            .repeat(40);
        let whole = words(&text);
        let tok = gpt2();
        let whole_ids = tok.encode_bytes(text.as_bytes(), "t").unwrap();
        for target in [2, 7, 50, 333, 1000] {
            let mut rest = text.as_bytes();
            let (mut w, mut ids) = (Vec::new(), Vec::new());
            while !rest.is_empty() {
                let at = if rest.len() <= target {
                    rest.len()
                } else {
                    clean_cut(rest, target).unwrap_or(rest.len())
                };
                assert!(at > 0);
                w.extend(words(std::str::from_utf8(&rest[..at]).unwrap()));
                ids.extend(tok.encode_bytes(&rest[..at], "t").unwrap());
                rest = &rest[at..];
            }
            assert_eq!(w, whole, "pieces of about {target} bytes");
            assert_eq!(ids, whole_ids, "pieces of about {target} bytes");
        }
        // One long line: cut before a word.
        let line = "lorem ipsum dolor sit amet ".repeat(100);
        let at = cut(line.as_bytes(), 100);
        assert_eq!(line.as_bytes()[at], b' ');
        let mut w = words(&line[..at]);
        w.extend(words(&line[at..]));
        assert_eq!(w, words(&line));
        // No spaces at all: a character boundary.
        let s = "é".repeat(100);
        assert!(std::str::from_utf8(&s.as_bytes()[..cut(s.as_bytes(), 11)]).is_ok());
    }

    #[test]
    fn separators() {
        let byte = Tok::Byte;
        let none = Special::default();
        assert_eq!(separator("auto", &byte, none).unwrap(), Vec::<u32>::new());
        assert_eq!(separator("none", &byte, none).unwrap(), Vec::<u32>::new());
        assert_eq!(separator("\n\n", &byte, none).unwrap(), vec![10, 10]);
        let e = separator("eos", &byte, none).unwrap_err().to_string();
        assert!(
            e.contains("data.doc_separator") && e.contains("no EOS"),
            "{e}"
        );
        let base = Special {
            bos: None,
            eos: Some(7),
        };
        assert_eq!(separator("auto", &byte, base).unwrap(), vec![7]);
        // A tokenizer.json's own EOS.
        let tok = gpt2();
        let eos = tok.eos_id().unwrap();
        assert_eq!(separator("eos", &tok, none).unwrap(), vec![eos]);
    }

    #[test]
    fn hashes_are_kept_by_size_and_mtime() {
        let tmp = tempfile::tempdir().unwrap();
        let f = tmp.path().join("a.txt");
        let old = SystemTime::now() - std::time::Duration::from_secs(3600);
        let write = |body: &str, mtime: SystemTime| {
            std::fs::write(&f, body).unwrap();
            File::options()
                .write(true)
                .open(&f)
                .unwrap()
                .set_modified(mtime)
                .unwrap();
        };
        write("hello", old);
        let root = tmp.path().join(CACHE_DIR);
        let mut c = HashCache::load(&root);
        let (first, n) = c.sha256(&f).unwrap();
        assert_eq!(n, 5);
        c.save(&root);
        // Same size and mtime: not read again (the stale hash shows it).
        write("HELLO", old);
        let mut c = HashCache::load(&root);
        assert_eq!(c.sha256(&f).unwrap().0, first);
        // Another mtime: hashed again.
        write("HELLO", old + std::time::Duration::from_secs(1));
        assert_ne!(c.sha256(&f).unwrap().0, first);
        // A file written just now is hashed but not remembered (its mtime may not settle).
        let g = tmp.path().join("b.txt");
        std::fs::write(&g, "new").unwrap();
        c.sha256(&g).unwrap();
        assert!(!c.files.keys().any(|k| k.ends_with("b.txt")));
    }
}
