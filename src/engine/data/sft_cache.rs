//! The token cache of instruction/chat data: each sample's ids, loss mask and record
//! (`file:line`), train and val, in `.cockpit-cache/sft-<key>/` beside the data, as the text
//! pipeline caches its shards ([`prepare`](super::prepare)). The key covers the source files'
//! SHA-256 (recomputed only when a file's size or mtime changed), the tokenizer's (and its
//! tokenizer_config.json's), the chat template's text, the format, `train_on_prompt`, the base's BOS/EOS and the val split;
//! anything else changed is another key. A cache that does not read back whole (its length
//! and CRC-32C are in its manifest) is rebuilt.

use super::chat::Encoded;
use super::prepare::HashCache;
use super::{io_err, DataError, Special, CACHE_DIR};
use crate::util::{atomic_write, hex};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

/// Bump when the layout changes (the key includes it).
const FORMAT: &str = "sft-v1";

/// Samples with the record each came from.
pub type Samples = Vec<(Encoded, String)>;

/// Everything the encoded samples depend on.
pub struct Inputs<'a> {
    pub train: &'a [PathBuf],
    pub val: &'a [PathBuf],
    /// "byte", or a tokenizer.json path.
    pub tokenizer: &'a str,
    pub template: Option<&'a str>,
    pub format: &'a str,
    pub train_on_prompt: bool,
    pub special: Special,
    /// How val is split off train (the val fraction, when data.val is empty).
    pub split: String,
}

/// The cache directory for `x` (it may not exist yet).
pub fn dir(x: &Inputs) -> Result<PathBuf, DataError> {
    let base = x
        .train
        .first()
        .and_then(|f| f.parent())
        .map(Path::to_path_buf)
        .unwrap_or_default();
    let root = base.join(CACHE_DIR);
    let mut hashes = HashCache::load(&root);
    let mut h = Sha256::new();
    h.update(FORMAT.as_bytes());
    for (tag, files) in [("train", x.train), ("val", x.val)] {
        h.update(tag.as_bytes());
        for f in files {
            h.update(hashes.sha256(f)?.0.as_bytes());
        }
    }
    let tok = if x.tokenizer == "byte" {
        "byte".to_string()
    } else {
        // The template's special tokens come from the tokenizer_config.json beside it.
        let config = Path::new(x.tokenizer).with_file_name("tokenizer_config.json");
        let config = if config.is_file() {
            hashes.sha256(&config)?.0
        } else {
            String::new()
        };
        format!("{}+{config}", hashes.sha256(Path::new(x.tokenizer))?.0)
    };
    hashes.save(&root);
    h.update(format!("tok={tok}").as_bytes());
    h.update(format!("template={:?}", x.template).as_bytes());
    h.update(format!("format={}", x.format).as_bytes());
    h.update(format!("train_on_prompt={}", x.train_on_prompt).as_bytes());
    h.update(format!("bos={:?} eos={:?}", x.special.bos, x.special.eos).as_bytes());
    h.update(format!("split={}", x.split).as_bytes());
    Ok(root.join(format!("sft-{}", &hex(&h.finalize())[..16])))
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Manifest {
    format: String,
    train: usize,
    val: usize,
    bytes: u64,
    crc32c: u32,
}

fn put(out: &mut Vec<u8>, samples: &Samples) {
    out.extend((samples.len() as u64).to_le_bytes());
    for (e, at) in samples {
        out.extend((e.ids.len() as u32).to_le_bytes());
        for id in &e.ids {
            out.extend(id.to_le_bytes());
        }
        out.extend(e.trains.iter().map(|&t| u8::from(t)));
        out.extend((at.len() as u32).to_le_bytes());
        out.extend(at.as_bytes());
    }
}

/// Reads the layout [`put`] writes; None where it runs short or is malformed.
struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Option<&[u8]> {
        if self.0.len() < n {
            return None;
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Some(a)
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    fn samples(&mut self) -> Option<Samples> {
        let n = u64::from_le_bytes(self.take(8)?.try_into().ok()?) as usize;
        let mut out = Vec::with_capacity(n.min(1 << 20));
        for _ in 0..n {
            let len = self.u32()? as usize;
            let ids = self
                .take(len.checked_mul(4)?)?
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            let trains = self.take(len)?.iter().map(|&b| b != 0).collect();
            let at_len = self.u32()? as usize;
            let at = String::from_utf8(self.take(at_len)?.to_vec()).ok()?;
            out.push((Encoded { ids, trains }, at));
        }
        Some(out)
    }
}

/// The cached train and val samples in `dir`, when it holds a whole cache.
pub fn read(dir: &Path) -> Option<(Samples, Samples)> {
    let m: Manifest =
        serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).ok()?).ok()?;
    let bytes = std::fs::read(dir.join("samples.bin")).ok()?;
    if m.format != FORMAT || bytes.len() as u64 != m.bytes || crc32c::crc32c(&bytes) != m.crc32c {
        return None;
    }
    let mut r = Reader(&bytes);
    let train = r.samples()?;
    let val = r.samples()?;
    (r.0.is_empty() && train.len() == m.train && val.len() == m.val).then_some((train, val))
}

/// Write `train` and `val` to `dir` (the samples first, then the manifest that vouches for
/// them, each atomically).
pub fn write(dir: &Path, train: &Samples, val: &Samples) -> Result<(), DataError> {
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    let mut bytes = Vec::new();
    put(&mut bytes, train);
    put(&mut bytes, val);
    let data = dir.join("samples.bin");
    atomic_write(&data, &bytes).map_err(io_err(&data))?;
    let m = Manifest {
        format: FORMAT.into(),
        train: train.len(),
        val: val.len(),
        bytes: bytes.len() as u64,
        crc32c: crc32c::crc32c(&bytes),
    };
    let path = dir.join("manifest.json");
    let text = serde_json::to_vec_pretty(&m).unwrap_or_default();
    atomic_write(&path, &text).map_err(io_err(&path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_read_back_and_a_damaged_cache_does_not() {
        let tmp = tempfile::tempdir().unwrap();
        let s = |ids: Vec<u32>, at: &str| {
            let trains = ids.iter().map(|&i| i % 2 == 0).collect();
            (Encoded { ids, trains }, at.to_string())
        };
        let train = vec![s(vec![1, 2, 70000], "a.jsonl:1"), s(vec![], "a.jsonl:2")];
        let val = vec![s(vec![5], "é.jsonl:9")];
        write(tmp.path(), &train, &val).unwrap();
        assert_eq!(read(tmp.path()), Some((train, val)));
        let bin = tmp.path().join("samples.bin");
        let mut bytes = std::fs::read(&bin).unwrap();
        bytes[10] ^= 1;
        std::fs::write(&bin, &bytes).unwrap();
        assert_eq!(read(tmp.path()), None);
    }
}
